/* dsk_kernels.h - C prototypes of every CUDA launcher behind the dsk headers.
   Built by nvcc from the kernels/ .cu files into the dsk kernel library (and, for the tests,
   as host C++ against the CUDA emulation in tests/cuda_emu); the headers call these under
   DSK_CUDA after validating their arguments (shapes, dtypes, devices), so a launcher may
   assume valid input. Every launcher makes ctx's device current on the calling thread and
   enqueues on ctx->stream; launchers do not synchronise unless their comment says so. Each
   returns DSK_OK or, with dsk_last_error() set: DSK_ERR_ARG (ctx is not an initialised CUDA
   ctx, or a launcher's own argument check), DSK_ERR_OOM (device scratch memory),
   DSK_ERR_UNSUPPORTED (sizes beyond a grid or cuBLAS limit), DSK_ERR_CUDA (a failed CUDA or
   cuBLAS call; every call is checked, and cudaGetLastError() follows every launch).
   kernels/dsk_cuda.cuh holds what the .cu files share to do so.
   Contents: runtime (tensor.cu), tensor ops (tensor.cu), amp (amp.cu), moe (moe.cu). */
#ifndef DSK_KERNELS_H
#define DSK_KERNELS_H
#include "../dsk_tensor.h"
#ifdef __cplusplus
extern "C" {
#endif

/* ---- runtime (kernels/tensor.cu) */
dsk_status dsk_cuda_device_count(int *n);                 /* 0 devices (no driver) is DSK_OK with *n = 0 */
dsk_status dsk_cuda_ctx_init(dsk_ctx *ctx, int index);    /* sets device, stream, cuBLAS handle, workspace */
void dsk_cuda_ctx_free(dsk_ctx *ctx);                     /* releases what ctx_init made; safe on partial init */
dsk_status dsk_cuda_sync(dsk_ctx *ctx);                   /* cudaStreamSynchronize(ctx->stream) */
dsk_status dsk_cuda_malloc(dsk_ctx *ctx, size_t bytes, void **p); /* cudaMallocAsync on ctx->stream */
void dsk_cuda_free(dsk_ctx *ctx, void *p);                /* cudaFreeAsync on ctx->stream (sync free if ctx NULL) */
/* to_device = 1: host -> device, 0: device -> host; asynchronous on ctx->stream. */
dsk_status dsk_cuda_memcpy(dsk_ctx *ctx, void *dst, const void *src, size_t bytes, int to_device);

/* ---- tensor ops (kernels/tensor.cu): same contracts as the dsk_tensor.h function of the same name */
dsk_status dsk_cuda_tensor_copy(dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src); /* same device, any dtypes/strides */
dsk_status dsk_cuda_tensor_fill(dsk_ctx *ctx, dsk_tensor *t, double value);
dsk_status dsk_cuda_tensor_uniform(dsk_ctx *ctx, dsk_tensor *t, uint64_t seed, uint64_t offset, float lo, float hi);
dsk_status dsk_cuda_tensor_normal(dsk_ctx *ctx, dsk_tensor *t, uint64_t seed, uint64_t offset, float mean, float std);
dsk_status dsk_cuda_matmul(dsk_ctx *ctx, dsk_tensor *C, const dsk_tensor *A, int trans_a, const dsk_tensor *B, int trans_b, float alpha, float beta);
dsk_status dsk_cuda_add(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *a, const dsk_tensor *b);
dsk_status dsk_cuda_mul(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *a, const dsk_tensor *b);
dsk_status dsk_cuda_scale(dsk_ctx *ctx, dsk_tensor *t, float alpha);
dsk_status dsk_cuda_axpy(dsk_ctx *ctx, dsk_tensor *y, float alpha, const dsk_tensor *x);
dsk_status dsk_cuda_reduce(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *in, int axis, dsk_reduce_op op);
dsk_status dsk_cuda_sum_squares(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *in);
dsk_status dsk_cuda_softmax(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x);
dsk_status dsk_cuda_softmax_backward(dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *y, const dsk_tensor *dy);
dsk_status dsk_cuda_rmsnorm(dsk_ctx *ctx, dsk_tensor *y, dsk_tensor *rstd, const dsk_tensor *x, const dsk_tensor *w, float eps);
dsk_status dsk_cuda_rmsnorm_backward(dsk_ctx *ctx, dsk_tensor *dx, dsk_tensor *dw, const dsk_tensor *dy, const dsk_tensor *x, const dsk_tensor *w, const dsk_tensor *rstd);
dsk_status dsk_cuda_silu(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x);
dsk_status dsk_cuda_silu_backward(dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *dy, const dsk_tensor *x);
dsk_status dsk_cuda_swiglu(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *gate, const dsk_tensor *up);
dsk_status dsk_cuda_swiglu_backward(dsk_ctx *ctx, dsk_tensor *dgate, dsk_tensor *dup, const dsk_tensor *dout, const dsk_tensor *gate, const dsk_tensor *up);
dsk_status dsk_cuda_embedding(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *table, const dsk_tensor *ids);
dsk_status dsk_cuda_embedding_backward(dsk_ctx *ctx, dsk_tensor *dtable, const dsk_tensor *dout, const dsk_tensor *ids);
dsk_status dsk_cuda_cross_entropy(dsk_ctx *ctx, dsk_tensor *loss, dsk_tensor *dlogits, const dsk_tensor *logits, const dsk_tensor *targets, int32_t ignore_index, float grad_scale);
dsk_status dsk_cuda_gather_rows(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *src, const dsk_tensor *idx);
dsk_status dsk_cuda_scatter_add_rows(dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src, const dsk_tensor *idx);
dsk_status dsk_cuda_topk(dsk_ctx *ctx, dsk_tensor *values, dsk_tensor *indices, const dsk_tensor *x, int k);
dsk_status dsk_cuda_rope(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x, int64_t pos0, float theta);
dsk_status dsk_cuda_rope_backward(dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *dy, int64_t pos0, float theta);
dsk_status dsk_cuda_attention(dsk_ctx *ctx, dsk_tensor *out, dsk_tensor *probs, const dsk_tensor *q, const dsk_tensor *k, const dsk_tensor *v, float scale);
dsk_status dsk_cuda_attention_backward(dsk_ctx *ctx, dsk_tensor *dq, dsk_tensor *dk, dsk_tensor *dv, const dsk_tensor *dout, const dsk_tensor *q, const dsk_tensor *k, const dsk_tensor *v, const dsk_tensor *probs, float scale);
dsk_status dsk_cuda_adamw_step(dsk_ctx *ctx, dsk_tensor *param, const dsk_tensor *grad, dsk_tensor *m, dsk_tensor *v, const dsk_adamw_opts *opts, int64_t step, float grad_mult, dsk_tensor *param_copy);

/* ---- amp (kernels/amp.cu) */
/* `block` is a scaler's device state: {double found_inf, sumsq; float scale; int32 growth, hysteresis}. */
struct dsk_amp_scaler_opts;
dsk_status dsk_cuda_amp_unscale(dsk_ctx *ctx, dsk_tensor *const *grads, int n, void *block); /* multi-tensor; writes found_inf, sumsq */
dsk_status dsk_cuda_amp_update(dsk_ctx *ctx, void *block, const struct dsk_amp_scaler_opts *opts);  /* dsk_amp_scaler_rule, 1 thread */
dsk_status dsk_cuda_amp_cast(dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src, int stochastic, uint64_t key);
dsk_status dsk_cuda_amp_amax(dsk_ctx *ctx, float *amax, const dsk_tensor *x, int accumulate);   /* device f32 scalar */
/* *scale = dsk_amp_fp8_scale(max of amax[0..n), fp8_max, margin, pow2, keep_prev ? *scale : 1); then *clear = 0 if non-NULL. */
dsk_status dsk_cuda_amp_fp8_scale(dsk_ctx *ctx, float *scale, const float *amax, int n, float fp8_max, int margin, int pow2, int keep_prev, float *clear);
dsk_status dsk_cuda_amp_fp8_quantize(dsk_ctx *ctx, dsk_tensor *q, const dsk_tensor *x, const float *scale);
dsk_status dsk_cuda_amp_fp8_dequantize(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *q, const float *scale);
dsk_status dsk_cuda_amp_fp8_block_quantize(dsk_ctx *ctx, dsk_tensor *q, dsk_tensor *scales, const dsk_tensor *x, int br, int bc, int pow2);
dsk_status dsk_cuda_amp_fp8_block_dequantize(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *q, const dsk_tensor *scales, int br, int bc);

/* ---- moe (kernels/moe.cu) */
/* Row-major buffers; `dt` is the layer's compute dtype (f32 or bf16); slot i = t*K + k. */
/* C (M,N) = op(A) op(B) + beta C; A, B in ab_dt (f32/bf16), C f32 or ab_dt; f32 accumulation (cublasGemmEx). */
dsk_status dsk_cuda_moe_gemm(dsk_ctx *ctx, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, const void *A, int64_t lda,
                             const void *B, int64_t ldb, dsk_dtype ab_dt, float beta, void *C, int64_t ldc, dsk_dtype c_dt);
/* Fused router, one token per thread (dsk_moe_route_token with *r): u (T,E) -> prob (T,E), sel (T,K), gate (T,K),
   counts (E) selections (zeroed first; integer atomics). bias (E) or NULL; scratch (T, E + n_group). */
struct dsk_moe_router;
dsk_status dsk_cuda_moe_route(dsk_ctx *ctx, const struct dsk_moe_router *r, const float *u, const float *bias,
                              int64_t T, float *prob, float *scratch, int32_t *sel, float *gate, int32_t *counts);
/* du (T,E) WRITTEN by dsk_moe_route_token_backward per token; aux (T/seq_len, E) or NULL. */
dsk_status dsk_cuda_moe_route_backward(dsk_ctx *ctx, const struct dsk_moe_router *r, const float *u,
                                       const float *prob, int64_t T, const int32_t *sel, const float *dgate,
                                       const float *aux, int64_t seq_len, float aux_mult, float zcoef, float *du);
/* dst (n,D) row p = (gate ? gate[idx[p]] : 1) * src row idx[p] / div; dst, src in dt. */
dsk_status dsk_cuda_moe_gather(dsk_ctx *ctx, void *dst, const void *src, dsk_dtype dt, const int32_t *idx, int div,
                               const float *gate, int64_t n, int64_t D);
/* y (T,D) in dt = sum over kept slots in slot order of gate * rows[slot_pos] (f32) + shared (T,D) f32 or NULL. */
dsk_status dsk_cuda_moe_combine(dsk_ctx *ctx, void *y, dsk_dtype dt, const float *rows, const int32_t *slot_pos,
                                const float *gate, const float *shared, int64_t T, int K, int64_t D);
/* dx (T,D) f32 += sum over kept slots in slot order of rows[slot_pos]. */
dsk_status dsk_cuda_moe_scatter(dsk_ctx *ctx, float *dx, const float *rows, const int32_t *slot_pos, int64_t T, int K, int64_t D);
/* dgate (T*K) = dy (T,D, dt) row . rows[slot_pos] (0 when dropped); fixed-order warp sums. */
dsk_status dsk_cuda_moe_dgate(dsk_ctx *ctx, float *dgate, const void *dy, dsk_dtype dt, const float *rows, const int32_t *slot_pos,
                              int64_t T, int K, int64_t D);
/* a (n) in dt = silu(h1) * h3; backward: dh1, dh3 (n) in dt from h1, h3, da (f32). */
dsk_status dsk_cuda_moe_swiglu(dsk_ctx *ctx, void *a, dsk_dtype dt, const float *h1, const float *h3, int64_t n);
dsk_status dsk_cuda_moe_swiglu_backward(dsk_ctx *ctx, void *dh1, void *dh3, dsk_dtype dt, const float *h1, const float *h3,
                                        const float *da, int64_t n);
/* dst (n) in dt += src (n) f32. */
dsk_status dsk_cuda_moe_accumulate(dsk_ctx *ctx, void *dst, dsk_dtype dt, const float *src, int64_t n);

#ifdef __cplusplus
}
#endif
#endif /* DSK_KERNELS_H */
