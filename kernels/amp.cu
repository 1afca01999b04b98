/* kernels/amp.cu - the CUDA path of dsk_amp.h, with the contracts of kernels/dsk_kernels.h.

   Every launcher enqueues on ctx->stream and returns without synchronising; every CUDA call
   is checked and cudaGetLastError() follows every launch. The element math (scale rule,
   1/scale, casts, stochastic rounding, fp8 scales) is the DSK_HD code of dsk_amp.h, so the
   GPU runs the formulas the CPU tests check. Reductions are deterministic: sums of squares
   go through per-block f64 partials in a fixed tree and one final block in a fixed order;
   amax is a max over ordered bit patterns (exact in any order, so atomicMax on the bits is
   deterministic); no float atomics. The scaler state never leaves the device. */
#include <cuda_runtime.h>
#include <stdio.h>
#include "dsk_amp.h"
#include "dsk_kernels.h"

#define DSK_AMP__THREADS 256
#define DSK_AMP__CHUNK 4096 /* elements per block of the unscale pass */
#define DSK_AMP__MAX_T 48   /* tensors per unscale launch (the list travels as a kernel argument) */

static dsk_status dsk_amp__cuda_fail(const char *fn, const char *call, cudaError_t e) {
    (void)cudaGetLastError();
    return dsk_set_error(DSK_ERR_CUDA, "%s: %s failed: %s (%s)", fn, call, cudaGetErrorName(e), cudaGetErrorString(e));
}
static dsk_status dsk_amp__launched(const char *fn, const char *kernel, unsigned grid, int64_t n) {
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) return DSK_OK;
    return dsk_set_error(DSK_ERR_CUDA, "%s: launch of %s (grid %u, %lld elements) failed: %s (%s)", fn, kernel, grid, (long long)n,
                         cudaGetErrorName(e), cudaGetErrorString(e));
}
#define DSK_AMP__TRY(expr)                         \
    do {                                           \
        dsk_status dsk_amp_s_ = (expr);            \
        if (dsk_amp_s_ != DSK_OK) return dsk_amp_s_; \
    } while (0)
#define DSK_AMP__CU(fn, call)                                                          \
    do {                                                                               \
        cudaError_t dsk_amp_e_ = (call);                                               \
        if (dsk_amp_e_ != cudaSuccess) return dsk_amp__cuda_fail(fn, #call, dsk_amp_e_); \
    } while (0)
#define DSK_AMP__LAUNCH(fn, kernel, grid, stream, n, ...)                                          \
    do {                                                                                           \
        kernel<<<(unsigned)(grid), DSK_AMP__THREADS, 0, (stream)>>>(__VA_ARGS__);                  \
        DSK_AMP__TRY(dsk_amp__launched(fn, #kernel, (unsigned)(grid), (int64_t)(n)));              \
    } while (0)

static cudaStream_t dsk_amp__stream(const dsk_ctx *ctx) { return (cudaStream_t)ctx->stream; }
static dsk_status dsk_amp__need(const char *fn, const dsk_ctx *ctx) {
    if (!ctx || ctx->device.type != DSK_DEV_CUDA || !ctx->stream)
        return dsk_set_error(DSK_ERR_ARG, "%s: CUDA tensors need an initialised CUDA ctx", fn);
    return DSK_OK;
}
/* Blocks for a grid-stride elementwise kernel over n elements. */
static unsigned dsk_amp__grid(int64_t n) {
    int64_t b = (n + DSK_AMP__THREADS - 1) / DSK_AMP__THREADS;
    return (unsigned)(b < 1 ? 1 : b > 65536 ? 65536 : b);
}

/* The scaler's device block: stats (two f64) then the state. */
struct dsk_amp__block {
    dsk_amp_stats stats;
    dsk_amp_scaler_state state;
};

/* Shared-memory tree reductions of a fixed shape (DSK_AMP__THREADS threads). */
__device__ static double dsk_amp__block_sum(double v, double *sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = DSK_AMP__THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    v = sh[0];
    __syncthreads();
    return v;
}
__device__ static uint32_t dsk_amp__block_max(uint32_t v, uint32_t *sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = DSK_AMP__THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s && sh[threadIdx.x + s] > sh[threadIdx.x]) sh[threadIdx.x] = sh[threadIdx.x + s];
        __syncthreads();
    }
    v = sh[0];
    __syncthreads();
    return v;
}

/* ======================================================================= unscale + check */

struct dsk_amp__tlist {
    void *p[DSK_AMP__MAX_T];
    int64_t n[DSK_AMP__MAX_T];
    int64_t first[DSK_AMP__MAX_T + 1]; /* first block of each tensor; first[count] = blocks */
    int dt[DSK_AMP__MAX_T];
    int count;
    int64_t part0; /* index of this launch's first partial */
};

/* One block per chunk of DSK_AMP__CHUNK elements of one tensor: g *= 1/scale, stored in g's
   dtype; the block's f64 sum of squares of the stored values and its non-finite flag go to
   partials (one slot per block, no atomics). */
__global__ static void dsk_amp__unscale_kernel(dsk_amp__tlist L, const dsk_amp__block *blk, double *psum, int *pbad) {
    __shared__ double sh[DSK_AMP__THREADS];
    int t = 0;
    int64_t b = blockIdx.x, start, end;
    while (t + 1 < L.count && L.first[t + 1] <= b) t++;
    start = (b - L.first[t]) * DSK_AMP__CHUNK;
    end = start + DSK_AMP__CHUNK < L.n[t] ? start + DSK_AMP__CHUNK : L.n[t];
    {
        float inv = dsk_amp_inv_scale(blk->state.scale);
        dsk_dtype dt = (dsk_dtype)L.dt[t];
        double acc = 0.0;
        int bad = 0;
        for (int64_t i = start + threadIdx.x; i < end; i += DSK_AMP__THREADS) {
            float y = dsk_store_f32(L.p[t], dt, i, dsk_load_f32(L.p[t], dt, i) * inv);
            bad |= !dsk_amp_isfinite(y);
            acc += (double)y * (double)y;
        }
        bad = __syncthreads_or(bad);
        acc = dsk_amp__block_sum(acc, sh);
        if (threadIdx.x == 0) {
            psum[L.part0 + b] = acc;
            pbad[L.part0 + b] = bad;
        }
    }
}

/* One block: stats = (any partial flag, sum of partials in a fixed order). */
__global__ static void dsk_amp__unscale_finish(dsk_amp__block *blk, const double *psum, const int *pbad, int64_t nparts) {
    __shared__ double sh[DSK_AMP__THREADS];
    double acc = 0.0;
    int bad = 0;
    for (int64_t i = threadIdx.x; i < nparts; i += DSK_AMP__THREADS) {
        acc += psum[i];
        bad |= pbad[i];
    }
    bad = __syncthreads_or(bad);
    acc = dsk_amp__block_sum(acc, sh);
    if (threadIdx.x == 0) {
        blk->stats.found_inf = bad ? 1.0 : 0.0;
        blk->stats.sumsq = acc;
    }
}

extern "C" dsk_status dsk_cuda_amp_unscale(dsk_ctx *ctx, dsk_tensor *const *grads, int n, void *block) {
    const char *fn = "dsk_cuda_amp_unscale";
    int64_t nparts = 0;
    void *scratch = NULL;
    double *psum;
    int *pbad;
    dsk_status s = DSK_OK;
    DSK_AMP__TRY(dsk_amp__need(fn, ctx));
    for (int i = 0; i < n; i++) nparts += (dsk_tensor_numel(grads[i]) + DSK_AMP__CHUNK - 1) / DSK_AMP__CHUNK;
    if (nparts > 0) DSK_AMP__TRY(dsk_cuda_malloc(ctx, (size_t)nparts * (sizeof(double) + sizeof(int)), &scratch));
    psum = (double *)scratch;
    pbad = scratch ? (int *)(psum + nparts) : NULL;
    {
        dsk_amp__tlist L;
        int64_t done = 0;
        memset(&L, 0, sizeof L);
        for (int i = 0; i < n && s == DSK_OK; i++) {
            int64_t m = dsk_tensor_numel(grads[i]);
            if (m > 0) {
                L.p[L.count] = grads[i]->data;
                L.n[L.count] = m;
                L.dt[L.count] = (int)grads[i]->dtype;
                L.first[L.count + 1] = L.first[L.count] + (m + DSK_AMP__CHUNK - 1) / DSK_AMP__CHUNK;
                L.count++;
            }
            if (L.count > 0 && (L.count == DSK_AMP__MAX_T || i == n - 1)) {
                int64_t blocks = L.first[L.count];
                L.part0 = done;
                dsk_amp__unscale_kernel<<<(unsigned)blocks, DSK_AMP__THREADS, 0, dsk_amp__stream(ctx)>>>(L, (const dsk_amp__block *)block, psum, pbad);
                s = dsk_amp__launched(fn, "dsk_amp__unscale_kernel", (unsigned)blocks, blocks * DSK_AMP__CHUNK);
                done += blocks;
                memset(&L, 0, sizeof L);
            }
        }
    }
    if (s == DSK_OK) {
        dsk_amp__unscale_finish<<<1, DSK_AMP__THREADS, 0, dsk_amp__stream(ctx)>>>((dsk_amp__block *)block, psum, pbad, nparts);
        s = dsk_amp__launched(fn, "dsk_amp__unscale_finish", 1, nparts);
    }
    if (scratch) dsk_cuda_free(ctx, scratch); /* stream-ordered after the kernels */
    return s;
}

/* ======================================================================= scale update */

__global__ static void dsk_amp__update_kernel(dsk_amp__block *blk, dsk_amp_scaler_opts o) {
    dsk_amp_scaler_rule(&blk->state, dsk_amp_stats_overflow(blk->stats), &o);
}

extern "C" dsk_status dsk_cuda_amp_update(dsk_ctx *ctx, void *block, const struct dsk_amp_scaler_opts *opts) {
    const char *fn = "dsk_cuda_amp_update";
    DSK_AMP__TRY(dsk_amp__need(fn, ctx));
    dsk_amp__update_kernel<<<1, 1, 0, dsk_amp__stream(ctx)>>>((dsk_amp__block *)block, *opts);
    return dsk_amp__launched(fn, "dsk_amp__update_kernel", 1, 1);
}

/* ======================================================================= casts */

__global__ static void dsk_amp__cast_kernel(void *dst, int dt, const float *src, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dsk_store_f32(dst, (dsk_dtype)dt, i, src[i]);
}

/* One thread per group of four elements: one Philox call gives the four words that
   dsk_amp_sr_bits hands to elements 4g .. 4g+3, as on the CPU. */
__global__ static void dsk_amp__cast_sr_kernel(uint16_t *dst, int dt, const float *src, int64_t n, uint64_t key) {
    for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; 4 * g < n; g += (int64_t)gridDim.x * blockDim.x) {
        uint32_t r[4];
        dsk_philox4x32(key, (uint64_t)g, r);
        for (int k = 0; k < 4 && 4 * g + k < n; k++)
            dst[4 * g + k] = dt == DSK_BF16 ? dsk_f32_to_bf16_sr(src[4 * g + k], r[k]) : dsk_f32_to_f16_sr(src[4 * g + k], r[k]);
    }
}

extern "C" dsk_status dsk_cuda_amp_cast(dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src, int stochastic, uint64_t key) {
    const char *fn = "dsk_cuda_amp_cast";
    int64_t n = dsk_tensor_numel(src);
    DSK_AMP__TRY(dsk_amp__need(fn, ctx));
    if (n == 0) return DSK_OK;
    if (stochastic && dst->dtype != DSK_F32)
        DSK_AMP__LAUNCH(fn, dsk_amp__cast_sr_kernel, dsk_amp__grid((n + 3) / 4), dsk_amp__stream(ctx), n, (uint16_t *)dst->data, (int)dst->dtype,
                        (const float *)src->data, n, key);
    else
        DSK_AMP__LAUNCH(fn, dsk_amp__cast_kernel, dsk_amp__grid(n), dsk_amp__stream(ctx), n, dst->data, (int)dst->dtype, (const float *)src->data, n);
    return DSK_OK;
}

/* ======================================================================= FP8 */

/* *amax = max(*amax, max over x of dsk_amp_abs_bits) as bits; per-block tree, then atomicMax on
   the bits (exact and order-free for the non-negative patterns). */
__global__ static void dsk_amp__amax_kernel(unsigned int *amax, const void *x, int dt, int64_t n) {
    __shared__ uint32_t sh[DSK_AMP__THREADS];
    uint32_t m = 0;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        uint32_t a = dsk_amp_abs_bits(dsk_load_f32(x, (dsk_dtype)dt, i));
        m = a > m ? a : m;
    }
    m = dsk_amp__block_max(m, sh);
    if (threadIdx.x == 0 && m > 0) atomicMax(amax, m);
}

extern "C" dsk_status dsk_cuda_amp_amax(dsk_ctx *ctx, float *amax, const dsk_tensor *x, int accumulate) {
    const char *fn = "dsk_cuda_amp_amax";
    int64_t n = dsk_tensor_numel(x);
    DSK_AMP__TRY(dsk_amp__need(fn, ctx));
    if (!accumulate) DSK_AMP__CU(fn, cudaMemsetAsync(amax, 0, sizeof(float), dsk_amp__stream(ctx)));
    if (n == 0) return DSK_OK;
    DSK_AMP__LAUNCH(fn, dsk_amp__amax_kernel, dsk_amp__grid(n), dsk_amp__stream(ctx), n, (unsigned int *)amax, x->data, (int)x->dtype, n);
    return DSK_OK;
}

__global__ static void dsk_amp__fp8_scale_kernel(float *scale, const float *amax, int n, float fp8_max, int margin, int pow2, int keep_prev,
                                                 float *clear) {
    __shared__ uint32_t sh[DSK_AMP__THREADS];
    uint32_t m = 0;
    for (int i = threadIdx.x; i < n; i += DSK_AMP__THREADS) {
        uint32_t a = dsk_amp_abs_bits(amax[i]);
        m = a > m ? a : m;
    }
    m = dsk_amp__block_max(m, sh); /* every read of amax (which may alias scale) is done */
    if (threadIdx.x == 0) {
        *scale = dsk_amp_fp8_scale(dsk_bits_f32(m), fp8_max, margin, pow2, keep_prev ? *scale : 1.0f);
        if (clear) *clear = 0.0f;
    }
}

extern "C" dsk_status dsk_cuda_amp_fp8_scale(dsk_ctx *ctx, float *scale, const float *amax, int n, float fp8_max, int margin, int pow2,
                                             int keep_prev, float *clear) {
    const char *fn = "dsk_cuda_amp_fp8_scale";
    DSK_AMP__TRY(dsk_amp__need(fn, ctx));
    DSK_AMP__LAUNCH(fn, dsk_amp__fp8_scale_kernel, 1, dsk_amp__stream(ctx), n, scale, amax, n, fp8_max, margin, pow2, keep_prev, clear);
    return DSK_OK;
}

__global__ static void dsk_amp__quantize_kernel(uint8_t *q, int fmt, const void *x, int dt, int64_t n, const float *scale) {
    float s = *scale;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        q[i] = dsk_amp_to_fp8(dsk_load_f32(x, (dsk_dtype)dt, i) * s, (dsk_dtype)fmt);
}

__global__ static void dsk_amp__dequantize_kernel(void *y, int dt, const uint8_t *q, int fmt, int64_t n, const float *scale) {
    float inv = 1.0f / *scale;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dsk_store_f32(y, (dsk_dtype)dt, i, dsk_amp_from_fp8(q[i], (dsk_dtype)fmt) * inv);
}

extern "C" dsk_status dsk_cuda_amp_fp8_quantize(dsk_ctx *ctx, dsk_tensor *q, const dsk_tensor *x, const float *scale) {
    const char *fn = "dsk_cuda_amp_fp8_quantize";
    int64_t n = dsk_tensor_numel(x);
    DSK_AMP__TRY(dsk_amp__need(fn, ctx));
    if (n == 0) return DSK_OK;
    DSK_AMP__LAUNCH(fn, dsk_amp__quantize_kernel, dsk_amp__grid(n), dsk_amp__stream(ctx), n, (uint8_t *)q->data, (int)q->dtype, x->data,
                    (int)x->dtype, n, scale);
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_amp_fp8_dequantize(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *q, const float *scale) {
    const char *fn = "dsk_cuda_amp_fp8_dequantize";
    int64_t n = dsk_tensor_numel(q);
    DSK_AMP__TRY(dsk_amp__need(fn, ctx));
    if (n == 0) return DSK_OK;
    DSK_AMP__LAUNCH(fn, dsk_amp__dequantize_kernel, dsk_amp__grid(n), dsk_amp__stream(ctx), n, y->data, (int)y->dtype, (const uint8_t *)q->data,
                    (int)q->dtype, n, scale);
    return DSK_OK;
}

/* One CUDA block per scale block (br x bc elements of x (R, C)): block amax, scale, quantise. */
__global__ static void dsk_amp__block_quantize_kernel(uint8_t *q, int fmt, float *scales, const void *x, int dt, int64_t R, int64_t C,
                                                      int br, int bc, int64_t SC, int pow2) {
    __shared__ uint32_t sh[DSK_AMP__THREADS];
    int64_t b = blockIdx.x, r0 = (b / SC) * br, c0 = (b % SC) * bc;
    int64_t rows = R - r0 < br ? R - r0 : br, cols = C - c0 < bc ? C - c0 : bc, cnt = rows * cols;
    uint32_t m = 0;
    float d;
    for (int64_t e = threadIdx.x; e < cnt; e += DSK_AMP__THREADS) {
        uint32_t a = dsk_amp_abs_bits(dsk_load_f32(x, (dsk_dtype)dt, (r0 + e / cols) * C + c0 + e % cols));
        m = a > m ? a : m;
    }
    m = dsk_amp__block_max(m, sh);
    d = dsk_amp_fp8_block_scale(dsk_bits_f32(m), dsk_amp_fp8_max((dsk_dtype)fmt), pow2);
    if (threadIdx.x == 0) scales[b] = d;
    for (int64_t e = threadIdx.x; e < cnt; e += DSK_AMP__THREADS) {
        int64_t i = (r0 + e / cols) * C + c0 + e % cols;
        q[i] = dsk_amp_to_fp8(dsk_load_f32(x, (dsk_dtype)dt, i) / d, (dsk_dtype)fmt);
    }
}

__global__ static void dsk_amp__block_dequantize_kernel(void *y, int dt, const uint8_t *q, int fmt, const float *scales, int64_t R, int64_t C,
                                                        int br, int bc, int64_t SC) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < R * C; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = i / C, c = i % C;
        dsk_store_f32(y, (dsk_dtype)dt, i, dsk_amp_from_fp8(q[i], (dsk_dtype)fmt) * scales[(r / br) * SC + c / bc]);
    }
}

extern "C" dsk_status dsk_cuda_amp_fp8_block_quantize(dsk_ctx *ctx, dsk_tensor *q, dsk_tensor *scales, const dsk_tensor *x, int br, int bc,
                                                      int pow2) {
    const char *fn = "dsk_cuda_amp_fp8_block_quantize";
    int64_t R = x->shape[0], C = x->shape[1], SR = scales->shape[0], SC = scales->shape[1];
    DSK_AMP__TRY(dsk_amp__need(fn, ctx));
    if (SR * SC == 0) return DSK_OK;
    if (SR * SC > 0x7fffffffLL) return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: %lld blocks exceed one grid", fn, (long long)(SR * SC));
    DSK_AMP__LAUNCH(fn, dsk_amp__block_quantize_kernel, SR * SC, dsk_amp__stream(ctx), R * C, (uint8_t *)q->data, (int)q->dtype,
                    (float *)scales->data, x->data, (int)x->dtype, R, C, br, bc, SC, pow2);
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_amp_fp8_block_dequantize(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *q, const dsk_tensor *scales, int br,
                                                        int bc) {
    const char *fn = "dsk_cuda_amp_fp8_block_dequantize";
    int64_t R = q->shape[0], C = q->shape[1];
    DSK_AMP__TRY(dsk_amp__need(fn, ctx));
    if (R * C == 0) return DSK_OK;
    DSK_AMP__LAUNCH(fn, dsk_amp__block_dequantize_kernel, dsk_amp__grid(R * C), dsk_amp__stream(ctx), R * C, y->data, (int)y->dtype,
                    (const uint8_t *)q->data, (int)q->dtype, (const float *)scales->data, R, C, br, bc, scales->shape[1]);
    return DSK_OK;
}
