/* par.cu - the CUDA path of dsk_par.h: the vocabulary-parallel cross-entropy, in three passes
   around the two all-reduces dsk_par_cross_entropy makes between them (row max; sum of
   exp(x - max) and the target's logit; loss and gradient). The per-element math is the
   DSK_HD functions of dsk_par.h, which the CPU path calls too. Reductions run in a fixed tree
   for a given row length, so the result is the same on every run. */
#include "dsk_cuda.cuh"
#include "dsk_par.h"

/* Reduces one value per thread (blockDim.x a power of two, at most DSK__CUDA_THREADS) in a
   fixed tree and returns it to every thread. */
template <typename T, typename Op> __device__ T dsk__par_block_reduce(T v, Op op, T *sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] = op(sh[threadIdx.x], sh[threadIdx.x + s]);
        __syncthreads();
    }
    v = sh[0];
    __syncthreads();
    return v;
}

struct dsk__par_max { /* NaN wins, as in dsk_cross_entropy */
    __device__ float operator()(float a, float b) const { return (a != a || a > b) ? a : b; }
};
struct dsk__par_sum {
    __device__ double operator()(double a, double b) const { return a + b; }
};

/* A block per row: mx[r] = max over this rank's columns. Block 0 also counts the targets. */
__global__ void dsk__k_par_ce_max(float *mx, int64_t *count, const void *x, dsk_dtype dt, const int32_t *tg, int64_t R,
                                  int64_t V, int32_t ignore) {
    __shared__ float shf[DSK__CUDA_THREADS];
    __shared__ double shd[DSK__CUDA_THREADS];
    const int64_t r = blockIdx.x;
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) m = dsk__par_max()(m, dsk_load_f32(x, dt, r * V + j));
    m = dsk__par_block_reduce(m, dsk__par_max(), shf);
    if (threadIdx.x == 0) mx[r] = m;
    if (r == 0) {
        double c = 0;
        for (int64_t t = threadIdx.x; t < R; t += blockDim.x) c += tg[t] != ignore;
        c = dsk__par_block_reduce(c, dsk__par_sum(), shd);
        if (threadIdx.x == 0) *count = (int64_t)c;
    }
}

/* A block per row: acc[2r] = sum of exp(x - mx[r]) in f64, acc[2r+1] = the target's logit when
   this rank holds its column; both 0 for an ignored row. */
__global__ void dsk__k_par_ce_sums(double *acc, const float *mx, const void *x, dsk_dtype dt, const int32_t *tg,
                                   int64_t V, int64_t lo, int32_t ignore) {
    __shared__ double sh[DSK__CUDA_THREADS];
    const int64_t r = blockIdx.x;
    const int32_t y = tg[r];
    double s = 0;
    if (y == ignore) {
        if (threadIdx.x == 0) acc[2 * r] = acc[2 * r + 1] = 0;
        return;
    }
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) s += exp((double)dsk_load_f32(x, dt, r * V + j) - mx[r]);
    s = dsk__par_block_reduce(s, dsk__par_sum(), sh);
    if (threadIdx.x == 0) {
        acc[2 * r] = s;
        acc[2 * r + 1] = y >= lo && y < lo + V ? (double)dsk_load_f32(x, dt, r * V + (y - lo)) : 0.0;
    }
}

/* A block per row: rowloss[r] = lse - target logit (0 if ignored); dlogits written. */
__global__ void dsk__k_par_ce_rows(double *rowloss, void *dl, dsk_dtype dtdl, const float *mx, const double *acc,
                                   const int64_t *count, const void *x, dsk_dtype dt, const int32_t *tg, int64_t V,
                                   int64_t lo, int32_t ignore, float grad_scale) {
    const int64_t r = blockIdx.x;
    const int32_t y = tg[r];
    double lse;
    if (y == ignore) {
        if (dl)
            for (int64_t j = threadIdx.x; j < V; j += blockDim.x) dsk_store_f32(dl, dtdl, r * V + j, 0.0f);
        if (threadIdx.x == 0) rowloss[r] = 0;
        return;
    }
    lse = dsk_par_ce_lse(mx[r], acc[2 * r]);
    if (threadIdx.x == 0) rowloss[r] = lse - acc[2 * r + 1];
    if (!dl) return;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
        dsk_store_f32(dl, dtdl, r * V + j,
                      dsk_par_ce_grad(dsk_load_f32(x, dt, r * V + j), lse, lo + j == y, grad_scale, *count));
}

/* loss = sum of rowloss / count (0 when nothing counts), in a fixed order. */
__global__ void dsk__k_par_ce_loss(float *loss, const double *rowloss, const int64_t *count, int64_t R) {
    __shared__ double sh[DSK__CUDA_THREADS];
    double s = 0;
    for (int64_t r = threadIdx.x; r < R; r += blockDim.x) s += rowloss[r];
    s = dsk__par_block_reduce(s, dsk__par_sum(), sh);
    if (threadIdx.x == 0) *loss = *count ? (float)(s / (double)*count) : 0.0f;
}

extern "C" dsk_status dsk_cuda_par_ce_max(dsk_ctx *ctx, float *mx, int64_t *count, const dsk_tensor *logits,
                                          const dsk_tensor *targets, int32_t ignore_index) {
    static const char *fn = "dsk_par_cross_entropy";
    int64_t R = logits->shape[0], V = logits->shape[1];
    unsigned th = dsk__cuda_row_threads(V > R ? V : R);
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    DSK__TRY(dsk__cuda_check_rows(fn, R));
    if (R == 0) return DSK_OK;
    DSK__CUDA_LAUNCH(fn, dsk__k_par_ce_max, (unsigned)R, th, dsk__cuda_stream(ctx), R * V, mx, count, logits->data,
                     logits->dtype, (const int32_t *)targets->data, R, V, ignore_index);
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_par_ce_sums(dsk_ctx *ctx, double *acc, const float *mx, const dsk_tensor *logits,
                                           const dsk_tensor *targets, int64_t lo, int32_t ignore_index) {
    static const char *fn = "dsk_par_cross_entropy";
    int64_t R = logits->shape[0], V = logits->shape[1];
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (R == 0) return DSK_OK;
    DSK__CUDA_LAUNCH(fn, dsk__k_par_ce_sums, (unsigned)R, dsk__cuda_row_threads(V), dsk__cuda_stream(ctx), R * V, acc,
                     mx, logits->data, logits->dtype, (const int32_t *)targets->data, V, lo, ignore_index);
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_par_ce_finish(dsk_ctx *ctx, dsk_tensor *loss, dsk_tensor *dlogits, const float *mx,
                                             const double *acc, const int64_t *count, const dsk_tensor *logits,
                                             const dsk_tensor *targets, int64_t lo, int32_t ignore_index,
                                             float grad_scale) {
    static const char *fn = "dsk_par_cross_entropy";
    int64_t R = logits->shape[0], V = logits->shape[1];
    double *rowloss = NULL;
    dsk_status s = DSK_OK;
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    DSK__TRY(dsk_cuda_malloc(ctx, (size_t)(R ? R : 1) * sizeof(double), (void **)&rowloss));
    if (R > 0)
        s = DSK__CUDA_LAUNCHED(fn, dsk__k_par_ce_rows, (unsigned)R, dsk__cuda_row_threads(V), dsk__cuda_stream(ctx),
                               R * V, rowloss, dlogits ? dlogits->data : NULL, dlogits ? dlogits->dtype : DSK_F32, mx,
                               acc, count, logits->data, logits->dtype, (const int32_t *)targets->data, V, lo,
                               ignore_index, grad_scale);
    if (s == DSK_OK)
        s = DSK__CUDA_LAUNCHED(fn, dsk__k_par_ce_loss, 1, DSK__CUDA_THREADS, dsk__cuda_stream(ctx), R,
                               (float *)loss->data, rowloss, count, R);
    dsk_cuda_free(ctx, rowloss);
    return s;
}
