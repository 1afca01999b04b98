/* kernels/moe.cu - the CUDA path of dsk_moe.h: fused router, row gather (dispatch), SwiGLU
   activation, combine, and their backwards; expert GEMMs through cublasGemmEx.

   Conventions (kernels/dsk_cuda.cuh): launchers check their ctx and make its device current,
   enqueue on ctx->stream, never synchronise, check every CUDA/cuBLAS call and
   cudaGetLastError() after every launch; elements go through dsk_tensor.h's element-access
   layer. The routing math is
   dsk_moe_route_token / dsk_moe_route_token_backward from dsk_moe.h, the same code the CPU
   runs. No float atomics: every sum has a fixed order (slot order for combine and scatter,
   a fixed warp tree for dot products); per-expert counts use integer atomics (exact). */
#include "dsk_cuda.cuh"
#include "dsk_moe.h"

/* kernel over n items, `threads` a block, checked (nothing to launch when n is 0). */
#define DSK__MOE_LAUNCH(fn, kernel, n, threads, ...)                                                   \
    do {                                                                                               \
        if ((n) > 0)                                                                                   \
            DSK__CUDA_LAUNCH(fn, kernel, (unsigned)(((n) + (threads) - 1) / (threads)), (threads),     \
                             dsk__cuda_stream(ctx), (n), __VA_ARGS__);                                 \
    } while (0)

/* ======================================================================= GEMM */

extern "C" dsk_status dsk_cuda_moe_gemm(dsk_ctx *ctx, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, const void *A,
                                        int64_t lda, const void *B, int64_t ldb, dsk_dtype ab_dt, float beta, void *C, int64_t ldc,
                                        dsk_dtype c_dt) {
    const char *fn = "dsk_cuda_moe_gemm";
    float alpha = 1.0f;
    cublasStatus_t st;
    cudaDataType_t abt = ab_dt == DSK_BF16 ? CUDA_R_16BF : CUDA_R_32F, ct = c_dt == DSK_BF16 ? CUDA_R_16BF : CUDA_R_32F;
    char detail[96];
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (!ctx->cublas) return dsk_set_error(DSK_ERR_ARG, "%s: the CUDA ctx has no cuBLAS handle", fn);
    if (M == 0 || N == 0) return DSK_OK;
    if (M > INT32_MAX || N > INT32_MAX || K > INT32_MAX)
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: GEMM %lld x %lld x %lld exceeds cuBLAS int sizes", fn, (long long)M,
                             (long long)N, (long long)K);
    /* Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T. */
    st = cublasGemmEx((cublasHandle_t)ctx->cublas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, (int)N,
                      (int)M, (int)K, &alpha, B, abt, (int)ldb, A, abt, (int)lda, &beta, C, ct, (int)ldc, CUBLAS_COMPUTE_32F,
                      CUBLAS_GEMM_DEFAULT);
    if (st == CUBLAS_STATUS_SUCCESS) return DSK_OK;
    snprintf(detail, sizeof detail, "%lld x %lld x %lld, ta %d tb %d", (long long)M, (long long)N, (long long)K,
             trans_a, trans_b);
    return dsk__cuda_cublas_fail(fn, "cublasGemmEx", st, detail);
}

/* ======================================================================= router */

static __global__ void dsk__moe_route_kernel(dsk_moe_router r, const float *u, const float *bias, int64_t T,
                                             float *prob, float *scratch, int32_t *sel, float *gate, int32_t *counts) {
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    int E = r.n_experts, K = r.top_k;
    if (t >= T) return;
    dsk_moe_route_token(&r, u + t * E, bias, prob + t * E, scratch + t * (E + r.n_group), sel + t * K, gate + t * K);
    for (int k = 0; k < K; k++) atomicAdd(&counts[sel[t * K + k]], 1); /* integer: exact in any order */
}

extern "C" dsk_status dsk_cuda_moe_route(dsk_ctx *ctx, const dsk_moe_router *r, const float *u, const float *bias,
                                         int64_t T, float *prob, float *scratch, int32_t *sel, float *gate,
                                         int32_t *counts) {
    const char *fn = "dsk_cuda_moe_route";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    DSK__CUDA_CHECK(fn, cudaMemsetAsync(counts, 0, (size_t)r->n_experts * sizeof(int32_t), dsk__cuda_stream(ctx)),
                    "zeroing the counts");
    DSK__MOE_LAUNCH(fn, dsk__moe_route_kernel, T, 128, *r, u, bias, T, prob, scratch, sel, gate, counts);
    return DSK_OK;
}

static __global__ void dsk__moe_route_backward_kernel(dsk_moe_router r, const float *u, const float *prob, int64_t T,
                                                      const int32_t *sel, const float *dgate, const float *aux,
                                                      int64_t seq_len, float aux_mult, float zcoef, float *du) {
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    int E = r.n_experts, K = r.top_k;
    if (t >= T) return;
    dsk_moe_route_token_backward(&r, u + t * E, prob + t * E, sel + t * K, dgate + t * K,
                                 aux ? aux + (t / seq_len) * E : NULL, aux_mult, zcoef, du + t * E);
}

extern "C" dsk_status dsk_cuda_moe_route_backward(dsk_ctx *ctx, const dsk_moe_router *r, const float *u,
                                                  const float *prob, int64_t T, const int32_t *sel,
                                                  const float *dgate, const float *aux, int64_t seq_len, float aux_mult,
                                                  float zcoef, float *du) {
    const char *fn = "dsk_cuda_moe_route_backward";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (aux && seq_len <= 0) return dsk_set_error(DSK_ERR_ARG, "%s: seq_len %lld must be > 0 with aux coefficients", fn, (long long)seq_len);
    DSK__MOE_LAUNCH(fn, dsk__moe_route_backward_kernel, T, 128, *r, u, prob, T, sel, dgate, aux, seq_len, aux_mult,
                    zcoef, du);
    return DSK_OK;
}

/* ======================================================================= dispatch and combine */

/* dst row p = (gate ? gate[idx[p]] : 1) * src row idx[p] / div. One block per row. */
static __global__ void dsk__moe_gather_kernel(void *dst, const void *src, dsk_dtype dt, const int32_t *idx, int div,
                                              const float *gate, int64_t D) {
    int64_t p = blockIdx.x;
    int32_t i = idx[p];
    int64_t row = i / div;
    float g = gate ? gate[i] : 1.0f;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
        float v = dsk_load_f32(src, dt, row * D + d);
        dsk_store_f32(dst, dt, p * D + d, gate ? g * v : v);
    }
}

extern "C" dsk_status dsk_cuda_moe_gather(dsk_ctx *ctx, void *dst, const void *src, dsk_dtype dt, const int32_t *idx, int div,
                                          const float *gate, int64_t n, int64_t D) {
    const char *fn = "dsk_cuda_moe_gather";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (n <= 0 || D <= 0) return DSK_OK;
    return DSK__CUDA_LAUNCHED(fn, dsk__moe_gather_kernel, (unsigned)n, 256u, dsk__cuda_stream(ctx), n * D, dst, src, dt,
                              idx, div, gate, D);
}

/* y[t] = sum over slots k in order of gate * rows[slot_pos] (dropped: skipped) + shared[t]. */
static __global__ void dsk__moe_combine_kernel(void *y, dsk_dtype dt, const float *rows, const int32_t *slot_pos,
                                               const float *gate, const float *shared, int K, int64_t D) {
    int64_t t = blockIdx.x;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.0f;
        for (int k = 0; k < K; k++) {
            int32_t p = slot_pos[t * K + k];
            if (p >= 0) acc += gate[t * K + k] * rows[(int64_t)p * D + d];
        }
        if (shared) acc += shared[t * D + d];
        dsk_store_f32(y, dt, t * D + d, acc);
    }
}

extern "C" dsk_status dsk_cuda_moe_combine(dsk_ctx *ctx, void *y, dsk_dtype dt, const float *rows, const int32_t *slot_pos,
                                           const float *gate, const float *shared, int64_t T, int K, int64_t D) {
    const char *fn = "dsk_cuda_moe_combine";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (T <= 0 || D <= 0) return DSK_OK;
    return DSK__CUDA_LAUNCHED(fn, dsk__moe_combine_kernel, (unsigned)T, 256u, dsk__cuda_stream(ctx), T * D, y, dt, rows,
                              slot_pos, gate, shared, K, D);
}

/* dx[t] += sum over kept slots k in order of rows[slot_pos] (f32). */
static __global__ void dsk__moe_scatter_kernel(float *dx, const float *rows, const int32_t *slot_pos, int K, int64_t D) {
    int64_t t = blockIdx.x;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = dx[t * D + d];
        for (int k = 0; k < K; k++) {
            int32_t p = slot_pos[t * K + k];
            if (p >= 0) acc += rows[(int64_t)p * D + d];
        }
        dx[t * D + d] = acc;
    }
}

extern "C" dsk_status dsk_cuda_moe_scatter(dsk_ctx *ctx, float *dx, const float *rows, const int32_t *slot_pos, int64_t T, int K,
                                           int64_t D) {
    const char *fn = "dsk_cuda_moe_scatter";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (T <= 0 || D <= 0) return DSK_OK;
    return DSK__CUDA_LAUNCHED(fn, dsk__moe_scatter_kernel, (unsigned)T, 256u, dsk__cuda_stream(ctx), T * D, dx, rows,
                              slot_pos, K, D);
}

/* dgate[i] = dy[i / K] . rows[slot_pos[i]] (0 for dropped). One warp per slot; lanes stride
   over D and reduce by a fixed butterfly, so the sum order is fixed. */
static __global__ void dsk__moe_dgate_kernel(float *dgate, const void *dy, dsk_dtype dt, const float *rows,
                                             const int32_t *slot_pos, int64_t n, int K, int64_t D) {
    int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x & 31;
    float acc = 0.0f;
    if (i >= n) return; /* whole warps leave together: n is per warp */
    {
        int32_t p = slot_pos[i];
        if (p >= 0)
            for (int64_t d = lane; d < D; d += 32)
                acc += dsk_load_f32(dy, dt, (i / K) * D + d) * rows[(int64_t)p * D + d];
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) dgate[i] = acc;
}

extern "C" dsk_status dsk_cuda_moe_dgate(dsk_ctx *ctx, float *dgate, const void *dy, dsk_dtype dt, const float *rows,
                                         const int32_t *slot_pos, int64_t T, int K, int64_t D) {
    const char *fn = "dsk_cuda_moe_dgate";
    int64_t n = T * K;
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    DSK__MOE_LAUNCH(fn, dsk__moe_dgate_kernel, n * 32, 256, dgate, dy, dt, rows, slot_pos, n, K, D);
    return DSK_OK;
}

/* ======================================================================= SwiGLU */

static __global__ void dsk__moe_swiglu_kernel(void *a, dsk_dtype dt, const float *h1, const float *h3, int64_t n) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dsk_store_f32(a, dt, i, dsk_swiglu_f(h1[i], h3[i]));
}

extern "C" dsk_status dsk_cuda_moe_swiglu(dsk_ctx *ctx, void *a, dsk_dtype dt, const float *h1, const float *h3, int64_t n) {
    const char *fn = "dsk_cuda_moe_swiglu";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    DSK__MOE_LAUNCH(fn, dsk__moe_swiglu_kernel, n, 256, a, dt, h1, h3, n);
    return DSK_OK;
}

static __global__ void dsk__moe_swiglu_backward_kernel(void *dh1, void *dh3, dsk_dtype dt, const float *h1,
                                                       const float *h3, const float *da, int64_t n) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    float g1, g3;
    if (i >= n) return;
    dsk_swiglu_grad_f(h1[i], h3[i], da[i], &g1, &g3);
    dsk_store_f32(dh1, dt, i, g1);
    dsk_store_f32(dh3, dt, i, g3);
}

extern "C" dsk_status dsk_cuda_moe_swiglu_backward(dsk_ctx *ctx, void *dh1, void *dh3, dsk_dtype dt, const float *h1,
                                                   const float *h3, const float *da, int64_t n) {
    const char *fn = "dsk_cuda_moe_swiglu_backward";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    DSK__MOE_LAUNCH(fn, dsk__moe_swiglu_backward_kernel, n, 256, dh1, dh3, dt, h1, h3, da, n);
    return DSK_OK;
}

/* dst (compute dtype) += src (f32), elementwise. */
static __global__ void dsk__moe_accumulate_kernel(void *dst, dsk_dtype dt, const float *src, int64_t n) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dsk_store_f32(dst, dt, i, dsk_load_f32(dst, dt, i) + src[i]);
}

extern "C" dsk_status dsk_cuda_moe_accumulate(dsk_ctx *ctx, void *dst, dsk_dtype dt, const float *src, int64_t n) {
    const char *fn = "dsk_cuda_moe_accumulate";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    DSK__MOE_LAUNCH(fn, dsk__moe_accumulate_kernel, n, 256, dst, dt, src, n);
    return DSK_OK;
}
