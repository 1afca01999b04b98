/* kernels/amp.cu - the CUDA path of dsk_amp.h, with the contracts of dsk_amp.h's CUDA launchers.

   Conventions (kernels/dsk_cuda.cuh): every launcher checks its ctx and makes its device
   current, enqueues on ctx->stream and returns without synchronising; every CUDA call is
   checked and cudaGetLastError() follows every launch. Elements go through dsk_tensor.h's
   element-access layer. The element math (scale rule,
   1/scale, casts, stochastic rounding, fp8 scales) is the DSK_HD code of dsk_amp.h, so the
   GPU runs the formulas the CPU tests check. Reductions are deterministic: sums of squares
   go through per-block f64 partials in a fixed tree and one final block in a fixed order;
   amax is a max over ordered bit patterns (exact in any order, so atomicMax on the bits is
   deterministic); no float atomics. The scaler state never leaves the device. */
#include "dsk_amp.h"
#include "dsk_cuda.cuh"

#define DSK__AMP_THREADS DSK__CUDA_THREADS /* the block reductions below assume this block size */
#define DSK__AMP_CHUNK 4096 /* elements per block of the unscale pass */
#define DSK__AMP_MAX_T 48   /* tensors per unscale launch (the list travels as a kernel argument) */

/* The scaler's device block: stats (two f64) then the state. */
struct dsk__amp_block {
    dsk_amp_stats stats;
    dsk_amp_scaler_state state;
};

/* Shared-memory tree reductions of a fixed shape (DSK__AMP_THREADS threads). */
__device__ static double dsk__amp_block_sum(double v, double *sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = DSK__AMP_THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    v = sh[0];
    __syncthreads();
    return v;
}
__device__ static uint32_t dsk__amp_block_max(uint32_t v, uint32_t *sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = DSK__AMP_THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s && sh[threadIdx.x + s] > sh[threadIdx.x]) sh[threadIdx.x] = sh[threadIdx.x + s];
        __syncthreads();
    }
    v = sh[0];
    __syncthreads();
    return v;
}

/* ======================================================================= unscale + check */

struct dsk__amp_tlist {
    void *p[DSK__AMP_MAX_T];
    int64_t n[DSK__AMP_MAX_T];
    int64_t first[DSK__AMP_MAX_T + 1]; /* first block of each tensor; first[count] = blocks */
    dsk_dtype dt[DSK__AMP_MAX_T];
    int count;
    int64_t part0; /* index of this launch's first partial */
};

/* One block per chunk of DSK__AMP_CHUNK elements of one tensor: g *= 1/scale, stored in g's
   dtype; the block's f64 sum of squares of the stored values and its non-finite flag go to
   partials (one slot per block, no atomics). */
__global__ static void dsk__amp_unscale_kernel(dsk__amp_tlist L, const dsk__amp_block *blk, double *psum, int *pbad) {
    __shared__ double sh[DSK__AMP_THREADS];
    int t = 0;
    int64_t b = blockIdx.x, start, end;
    while (t + 1 < L.count && L.first[t + 1] <= b) t++;
    start = (b - L.first[t]) * DSK__AMP_CHUNK;
    end = start + DSK__AMP_CHUNK < L.n[t] ? start + DSK__AMP_CHUNK : L.n[t];
    {
        float inv = dsk_amp_inv_scale(blk->state.scale);
        dsk_dtype dt = L.dt[t];
        double acc = 0.0;
        int bad = 0;
        for (int64_t i = start + threadIdx.x; i < end; i += DSK__AMP_THREADS) {
            float y = dsk_store_f32(L.p[t], dt, i, dsk_load_f32(L.p[t], dt, i) * inv);
            bad |= !dsk_amp_isfinite(y);
            acc += (double)y * (double)y;
        }
        bad = __syncthreads_or(bad);
        acc = dsk__amp_block_sum(acc, sh);
        if (threadIdx.x == 0) {
            psum[L.part0 + b] = acc;
            pbad[L.part0 + b] = bad;
        }
    }
}

/* One block: stats = (any partial flag, sum of partials in a fixed order). */
__global__ static void dsk__amp_unscale_finish(dsk__amp_block *blk, const double *psum, const int *pbad,
                                               int64_t nparts) {
    __shared__ double sh[DSK__AMP_THREADS];
    double acc = 0.0;
    int bad = 0;
    for (int64_t i = threadIdx.x; i < nparts; i += DSK__AMP_THREADS) {
        acc += psum[i];
        bad |= pbad[i];
    }
    bad = __syncthreads_or(bad);
    acc = dsk__amp_block_sum(acc, sh);
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
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    for (int i = 0; i < n; i++) nparts += (dsk_tensor_numel(grads[i]) + DSK__AMP_CHUNK - 1) / DSK__AMP_CHUNK;
    if (nparts > 0) DSK__TRY(dsk_cuda_malloc(ctx, (size_t)nparts * (sizeof(double) + sizeof(int)), &scratch));
    psum = (double *)scratch;
    pbad = scratch ? (int *)(psum + nparts) : NULL;
    {
        dsk__amp_tlist L;
        int64_t done = 0;
        memset(&L, 0, sizeof L);
        for (int i = 0; i < n && s == DSK_OK; i++) {
            int64_t m = dsk_tensor_numel(grads[i]);
            if (m > 0) {
                L.p[L.count] = grads[i]->data;
                L.n[L.count] = m;
                L.dt[L.count] = grads[i]->dtype;
                L.first[L.count + 1] = L.first[L.count] + (m + DSK__AMP_CHUNK - 1) / DSK__AMP_CHUNK;
                L.count++;
            }
            if (L.count > 0 && (L.count == DSK__AMP_MAX_T || i == n - 1)) {
                int64_t blocks = L.first[L.count];
                L.part0 = done;
                s = DSK__CUDA_LAUNCHED(fn, dsk__amp_unscale_kernel, (unsigned)blocks, DSK__AMP_THREADS,
                                       dsk__cuda_stream(ctx), blocks * DSK__AMP_CHUNK, L, (const dsk__amp_block *)block,
                                       psum, pbad);
                done += blocks;
                memset(&L, 0, sizeof L);
            }
        }
    }
    if (s == DSK_OK) {
        s = DSK__CUDA_LAUNCHED(fn, dsk__amp_unscale_finish, 1u, DSK__AMP_THREADS, dsk__cuda_stream(ctx), nparts,
                               (dsk__amp_block *)block, psum, pbad, nparts);
    }
    if (scratch) dsk_cuda_free(ctx, scratch); /* stream-ordered after the kernels */
    return s;
}

/* ======================================================================= scale update */

__global__ static void dsk__amp_update_kernel(dsk__amp_block *blk, dsk_amp_scaler_opts o) {
    dsk_amp_scaler_rule(&blk->state, dsk_amp_stats_overflow(blk->stats), &o);
}

extern "C" dsk_status dsk_cuda_amp_update(dsk_ctx *ctx, void *block, const struct dsk_amp_scaler_opts *opts) {
    const char *fn = "dsk_cuda_amp_update";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    return DSK__CUDA_LAUNCHED(fn, dsk__amp_update_kernel, 1u, 1u, dsk__cuda_stream(ctx), 1, (dsk__amp_block *)block,
                              *opts);
}

/* ======================================================================= casts */

__global__ static void dsk__amp_cast_kernel(void *dst, dsk_dtype dt, const float *src, int64_t n) {
    DSK__CUDA_FOR(i, n) dsk_store_f32(dst, dt, i, src[i]);
}

/* One thread per group of four elements: one Philox call gives the four words that
   dsk_amp_sr_bits hands to elements 4g .. 4g+3, as on the CPU. */
__device__ static void dsk__amp_cast_sr(uint16_t *dst, dsk_dtype dt, const float *src, int64_t n, uint64_t key) {
    for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; 4 * g < n; g += (int64_t)gridDim.x * blockDim.x) {
        uint32_t r[4];
        dsk_philox4x32(key, (uint64_t)g, r);
        for (int k = 0; k < 4 && 4 * g + k < n; k++)
            dst[4 * g + k] = dt == DSK_BF16 ? dsk_amp_f32_to_bf16_sr(src[4 * g + k], r[k])
                                            : dsk_amp_f32_to_f16_sr(src[4 * g + k], r[k]);
    }
}
__global__ static void dsk__amp_cast_sr_kernel(uint16_t *dst, dsk_dtype dt, const float *src, int64_t n, uint64_t key) {
    dsk__amp_cast_sr(dst, dt, src, n, key);
}

extern "C" dsk_status dsk_cuda_amp_cast(dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src, int stochastic,
                                        uint64_t key) {
    const char *fn = "dsk_cuda_amp_cast";
    int64_t n = dsk_tensor_numel(src);
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (n == 0) return DSK_OK;
    if (stochastic && dst->dtype != DSK_F32)
        DSK__CUDA_LAUNCH(fn, dsk__amp_cast_sr_kernel, dsk__cuda_grid((n + 3) / 4), DSK__AMP_THREADS,
                         dsk__cuda_stream(ctx), n, (uint16_t *)dst->data, dst->dtype, (const float *)src->data, n, key);
    else
        DSK__CUDA_LAUNCH(fn, dsk__amp_cast_kernel, dsk__cuda_grid(n), DSK__AMP_THREADS, dsk__cuda_stream(ctx), n,
                         dst->data, dst->dtype, (const float *)src->data, n);
    return DSK_OK;
}

/* ======================================================================= device-resident step */

__global__ static void dsk__amp_decide_kernel(const dsk__amp_block *blk, dsk_amp_step_vals *sv, double max_norm) {
    dsk_amp_decision d = dsk_amp_decide(blk->stats, max_norm);
    sv->skip = d.skip;
    sv->grad_mult = d.grad_mult;
    sv->norm = d.norm;
}

extern "C" dsk_status dsk_cuda_amp_decide(dsk_ctx *ctx, const void *block, dsk_amp_step_vals *vals, double max_norm) {
    const char *fn = "dsk_amp_decide_dev";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    return DSK__CUDA_LAUNCHED(fn, dsk__amp_decide_kernel, 1u, 1u, dsk__cuda_stream(ctx), 1,
                              (const dsk__amp_block *)block, vals, max_norm);
}

/* dsk_adamw_step's kernel (kernels/tensor.cu) with lr, bias corrections and grad_mult read from the device. */
__global__ static void dsk__amp_adamw_dev_kernel(float *p, const void *grad, dsk_dtype dtg, void *m, void *v,
                                                 dsk_dtype dtm, int64_t n, float b1, float b2, float eps, float wd,
                                                 const dsk_amp_step_vals *sv, void *copy, dsk_dtype dtc) {
    if (sv->skip) return;
    float lr = sv->lr, bc1 = sv->bc1, bc2 = sv->bc2, grad_mult = sv->grad_mult;
    DSK__CUDA_FOR(i, n) {
        float pi = p[i], mi = dsk_load_f32(m, dtm, i), vi = dsk_load_f32(v, dtm, i);
        dsk_adamw_update(&pi, &mi, &vi, dsk_load_f32(grad, dtg, i) * grad_mult, lr, b1, b2, eps, wd, bc1, bc2);
        p[i] = pi;
        dsk_store_f32(m, dtm, i, mi);
        dsk_store_f32(v, dtm, i, vi);
        if (copy) dsk_store_f32(copy, dtc, i, pi);
    }
}

extern "C" dsk_status dsk_cuda_amp_adamw_dev(dsk_ctx *ctx, dsk_tensor *param, const dsk_tensor *grad, dsk_tensor *m,
                                             dsk_tensor *v, const dsk_adamw_opts *opts, const dsk_amp_step_vals *vals,
                                             dsk_tensor *copy) {
    const char *fn = "dsk_amp_step_dev";
    int64_t n = dsk_tensor_numel(param);
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (n == 0) return DSK_OK;
    DSK__CUDA_LAUNCH(fn, dsk__amp_adamw_dev_kernel, dsk__cuda_grid(n), DSK__AMP_THREADS, dsk__cuda_stream(ctx), n,
                     (float *)param->data, grad->data, grad->dtype, m->data, v->data, m->dtype, n, opts->beta1,
                     opts->beta2, opts->eps, opts->weight_decay, vals, copy ? copy->data : NULL,
                     copy ? copy->dtype : DSK_F32);
    return DSK_OK;
}

/* dsk_amp_cast with stochastic rounding keyed on the device's step (dsk_amp_sr_key(seed, tensor_id, step)); an
   f32 copy is a plain copy, as in dsk_cuda_amp_cast. */
__global__ static void dsk__amp_cast_sr_dev_kernel(void *dst, dsk_dtype dt, const float *src, int64_t n, uint64_t seed,
                                                   uint64_t tensor_id, const dsk_amp_step_vals *sv) {
    if (sv->skip) return;
    if (dt == DSK_F32) {
        DSK__CUDA_FOR(i, n) dsk_store_f32(dst, dt, i, src[i]);
        return;
    }
    dsk__amp_cast_sr((uint16_t *)dst, dt, src, n, dsk_amp_sr_key(seed, tensor_id, (uint64_t)sv->step));
}

extern "C" dsk_status dsk_cuda_amp_cast_dev(dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src, uint64_t seed,
                                            uint64_t tensor_id, const dsk_amp_step_vals *vals) {
    const char *fn = "dsk_amp_step_dev";
    int64_t n = dsk_tensor_numel(src);
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (n == 0) return DSK_OK;
    DSK__CUDA_LAUNCH(fn, dsk__amp_cast_sr_dev_kernel, dsk__cuda_grid(n), DSK__AMP_THREADS, dsk__cuda_stream(ctx), n,
                     dst->data, dst->dtype, (const float *)src->data, n, seed, tensor_id, vals);
    return DSK_OK;
}

/* ======================================================================= FP8 */

/* *amax = max(*amax, max over x of dsk_amp_abs_bits) as bits; per-block tree, then atomicMax on
   the bits (exact and order-free for the non-negative patterns). */
__global__ static void dsk__amp_amax_kernel(unsigned int *amax, const void *x, dsk_dtype dt, int64_t n) {
    __shared__ uint32_t sh[DSK__AMP_THREADS];
    uint32_t m = 0;
    DSK__CUDA_FOR(i, n) {
        uint32_t a = dsk_amp_abs_bits(dsk_load_f32(x, dt, i));
        m = a > m ? a : m;
    }
    m = dsk__amp_block_max(m, sh);
    if (threadIdx.x == 0 && m > 0) atomicMax(amax, m);
}

extern "C" dsk_status dsk_cuda_amp_amax(dsk_ctx *ctx, float *amax, const dsk_tensor *x, int accumulate) {
    const char *fn = "dsk_cuda_amp_amax";
    int64_t n = dsk_tensor_numel(x);
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (!accumulate)
        DSK__CUDA_CHECK(fn, cudaMemsetAsync(amax, 0, sizeof(float), dsk__cuda_stream(ctx)), "clearing amax");
    if (n == 0) return DSK_OK;
    DSK__CUDA_LAUNCH(fn, dsk__amp_amax_kernel, dsk__cuda_grid(n), DSK__AMP_THREADS, dsk__cuda_stream(ctx), n,
                     (unsigned int *)amax, x->data, x->dtype, n);
    return DSK_OK;
}

__global__ static void dsk__amp_fp8_scale_kernel(float *scale, const float *amax, int n, float fp8_max, int margin,
                                                 int pow2, int keep_prev, float *clear) {
    __shared__ uint32_t sh[DSK__AMP_THREADS];
    uint32_t m = 0;
    for (int i = threadIdx.x; i < n; i += DSK__AMP_THREADS) {
        uint32_t a = dsk_amp_abs_bits(amax[i]);
        m = a > m ? a : m;
    }
    m = dsk__amp_block_max(m, sh); /* every read of amax (which may alias scale) is done */
    if (threadIdx.x == 0) {
        *scale = dsk_amp_fp8_scale(dsk_bits_f32(m), fp8_max, margin, pow2, keep_prev ? *scale : 1.0f);
        if (clear) *clear = 0.0f;
    }
}

extern "C" dsk_status dsk_cuda_amp_fp8_scale(dsk_ctx *ctx, float *scale, const float *amax, int n, float fp8_max,
                                             int margin, int pow2, int keep_prev, float *clear) {
    const char *fn = "dsk_cuda_amp_fp8_scale";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    DSK__CUDA_LAUNCH(fn, dsk__amp_fp8_scale_kernel, 1u, DSK__AMP_THREADS, dsk__cuda_stream(ctx), n, scale, amax, n,
                     fp8_max, margin, pow2, keep_prev, clear);
    return DSK_OK;
}

__global__ static void dsk__amp_quantize_kernel(uint8_t *q, dsk_dtype fmt, const void *x, dsk_dtype dt, int64_t n,
                                                const float *scale) {
    float s = *scale;
    DSK__CUDA_FOR(i, n) q[i] = dsk_amp_to_fp8(dsk_amp_fp8_product(dsk_load_f32(x, dt, i), s), fmt);
}

__global__ static void dsk__amp_dequantize_kernel(void *y, dsk_dtype dt, const uint8_t *q, dsk_dtype fmt, int64_t n,
                                                  const float *scale) {
    float inv = 1.0f / *scale;
    DSK__CUDA_FOR(i, n) dsk_store_f32(y, dt, i, dsk_amp_from_fp8(q[i], fmt) * inv);
}

extern "C" dsk_status dsk_cuda_amp_fp8_quantize(dsk_ctx *ctx, dsk_tensor *q, const dsk_tensor *x, const float *scale) {
    const char *fn = "dsk_cuda_amp_fp8_quantize";
    int64_t n = dsk_tensor_numel(x);
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (n == 0) return DSK_OK;
    DSK__CUDA_LAUNCH(fn, dsk__amp_quantize_kernel, dsk__cuda_grid(n), DSK__AMP_THREADS, dsk__cuda_stream(ctx), n,
                     (uint8_t *)q->data, q->dtype, x->data, x->dtype, n, scale);
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_amp_fp8_dequantize(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *q,
                                                  const float *scale) {
    const char *fn = "dsk_cuda_amp_fp8_dequantize";
    int64_t n = dsk_tensor_numel(q);
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (n == 0) return DSK_OK;
    DSK__CUDA_LAUNCH(fn, dsk__amp_dequantize_kernel, dsk__cuda_grid(n), DSK__AMP_THREADS, dsk__cuda_stream(ctx), n,
                     y->data, y->dtype, (const uint8_t *)q->data, q->dtype, n, scale);
    return DSK_OK;
}

/* Index in x of element (i, j) of q (R, C): the same, or (j, i) when q holds x's transpose. */
__device__ static int64_t dsk__amp_block_src(int64_t i, int64_t j, int64_t R, int64_t C, int trans) {
    return trans ? j * R + i : i * C + j;
}

/* One CUDA block per scale block (br x bc elements of q (R, C)): block amax, scale, quantise;
   x is (R, C), or (C, R) with trans. */
__global__ static void dsk__amp_block_quantize_kernel(uint8_t *q, dsk_dtype fmt, float *scales, const void *x,
                                                      dsk_dtype dt, int64_t R, int64_t C, int br, int bc, int64_t SC,
                                                      int pow2, int trans) {
    __shared__ uint32_t sh[DSK__AMP_THREADS];
    int64_t b = blockIdx.x, r0 = (b / SC) * br, c0 = (b % SC) * bc;
    int64_t rows = R - r0 < br ? R - r0 : br, cols = C - c0 < bc ? C - c0 : bc, cnt = rows * cols;
    uint32_t m = 0;
    float d;
    for (int64_t e = threadIdx.x; e < cnt; e += DSK__AMP_THREADS) {
        int64_t xi = dsk__amp_block_src(r0 + e / cols, c0 + e % cols, R, C, trans);
        uint32_t a = dsk_amp_abs_bits(dsk_load_f32(x, dt, xi));
        m = a > m ? a : m;
    }
    m = dsk__amp_block_max(m, sh);
    d = dsk_amp_fp8_block_scale(dsk_bits_f32(m), dsk_amp_fp8_max(fmt), pow2);
    if (threadIdx.x == 0) scales[b] = d;
    for (int64_t e = threadIdx.x; e < cnt; e += DSK__AMP_THREADS) {
        int64_t i = (r0 + e / cols) * C + c0 + e % cols;
        q[i] = dsk_amp_to_fp8(
            dsk_amp_fp8_quotient(dsk_load_f32(x, dt, dsk__amp_block_src(r0 + e / cols, c0 + e % cols, R, C, trans)), d),
            fmt);
    }
}

__global__ static void dsk__amp_block_dequantize_kernel(void *y, dsk_dtype dt, const uint8_t *q, dsk_dtype fmt,
                                                        const float *scales, int64_t R, int64_t C, int br, int bc,
                                                        int64_t SC) {
    DSK__CUDA_FOR(i, R * C) {
        int64_t r = i / C, c = i % C;
        dsk_store_f32(y, dt, i, dsk_amp_from_fp8(q[i], fmt) * scales[(r / br) * SC + c / bc]);
    }
}

static dsk_status dsk__amp_block_quantize(const char *fn, dsk_ctx *ctx, dsk_tensor *q, dsk_tensor *scales,
                                          const dsk_tensor *x, int br, int bc, int pow2, int trans) {
    int64_t R = q->shape[0], C = q->shape[1], SR = scales->shape[0], SC = scales->shape[1];
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (SR * SC == 0) return DSK_OK;
    if (SR * SC > 0x7fffffffLL)
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: %lld blocks exceed one grid", fn, (long long)(SR * SC));
    DSK__CUDA_LAUNCH(fn, dsk__amp_block_quantize_kernel, (unsigned)(SR * SC), DSK__AMP_THREADS, dsk__cuda_stream(ctx),
                     R * C, (uint8_t *)q->data, q->dtype, (float *)scales->data, x->data, x->dtype, R, C, br, bc, SC,
                     pow2, trans);
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_amp_fp8_block_quantize(dsk_ctx *ctx, dsk_tensor *q, dsk_tensor *scales,
                                                      const dsk_tensor *x, int br, int bc, int pow2) {
    return dsk__amp_block_quantize("dsk_cuda_amp_fp8_block_quantize", ctx, q, scales, x, br, bc, pow2, 0);
}

extern "C" dsk_status dsk_cuda_amp_fp8_block_quantize_t(dsk_ctx *ctx, dsk_tensor *q, dsk_tensor *scales,
                                                        const dsk_tensor *x, int br, int bc, int pow2) {
    return dsk__amp_block_quantize("dsk_cuda_amp_fp8_block_quantize_t", ctx, q, scales, x, br, bc, pow2, 1);
}

extern "C" dsk_status dsk_cuda_amp_fp8_block_dequantize(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *q,
                                                        const dsk_tensor *scales, int br, int bc) {
    const char *fn = "dsk_cuda_amp_fp8_block_dequantize";
    int64_t R = q->shape[0], C = q->shape[1];
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (R * C == 0) return DSK_OK;
    DSK__CUDA_LAUNCH(fn, dsk__amp_block_dequantize_kernel, dsk__cuda_grid(R * C), DSK__AMP_THREADS,
                     dsk__cuda_stream(ctx), R * C, y->data, y->dtype, (const uint8_t *)q->data, q->dtype,
                     (const float *)scales->data, R, C, br, bc, scales->shape[1]);
    return DSK_OK;
}
