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
   Contents: runtime (tensor.cu), tensor ops (tensor.cu), fused attention (attention.cu), amp (amp.cu),
   grouped rows (grouped.cu), FP8 GEMM (fp8.cu), moe (moe.cu), par (par.cu). */
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
/* to_device = 1: host -> device, 0: device -> host; asynchronous on ctx->stream. A device-to-host
   copy counts in ctx->counters (d2h_copies, d2h_bytes), as dsk_cuda_sync counts in syncs. */
dsk_status dsk_cuda_memcpy(dsk_ctx *ctx, void *dst, const void *src, size_t bytes, int to_device);
/* Pinned host memory (cudaHostAlloc; NULL on failure) and its release. */
void *dsk_cuda_host_alloc(size_t bytes);
void dsk_cuda_host_free(void *p);
/* Events on ctx->stream (timing disabled): record one; wait on the host for one (counted as a
   sync unless it had completed already). */
dsk_status dsk_cuda_event_create(void **ev);
dsk_status dsk_cuda_event_record(dsk_ctx *ctx, void *ev);
dsk_status dsk_cuda_event_wait(dsk_ctx *ctx, void *ev);
void dsk_cuda_event_destroy(void *ev);
/* Capture of ctx->stream into a graph (global mode), instantiation, launch, release. */
dsk_status dsk_cuda_graph_begin(dsk_ctx *ctx);
dsk_status dsk_cuda_graph_end(dsk_ctx *ctx, void **graph, void **exec);
dsk_status dsk_cuda_graph_launch(dsk_ctx *ctx, void *exec);
void dsk_cuda_graph_free(void *graph, void *exec);

/* ---- tensor ops (kernels/tensor.cu): same contracts as the dsk_tensor.h function of the same name */
dsk_status dsk_cuda_tensor_copy(dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src); /* same device, any dtypes/strides */
dsk_status dsk_cuda_tensor_fill(dsk_ctx *ctx, dsk_tensor *t, double value);
dsk_status dsk_cuda_tensor_uniform(dsk_ctx *ctx, dsk_tensor *t, uint64_t seed, uint64_t offset, float lo, float hi);
dsk_status dsk_cuda_tensor_normal(dsk_ctx *ctx, dsk_tensor *t, uint64_t seed, uint64_t offset, float mean, float std);
dsk_status dsk_cuda_matmul(dsk_ctx *ctx, dsk_tensor *C, const dsk_tensor *A, int trans_a, const dsk_tensor *B, int trans_b, float alpha, float beta);
/* out = dsk_ew_f(op, x, y, alpha) per element (y NULL for DSK_EW_SCALE): every elementwise op */
dsk_status dsk_cuda_elementwise(dsk_ctx *ctx, dsk_ew_op op, dsk_tensor *out, const dsk_tensor *x, const dsk_tensor *y,
                                float alpha);
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

/* ---- fused attention (kernels/attention.cu): the contracts of dsk_attention_fused and
   dsk_attention_fused_backward (lse may be NULL in forward). bf16/f16 run on tensor cores (WMMA),
   f32 on CUDA cores; head dims up to 256 (DSK_ERR_UNSUPPORTED beyond); backward takes device
   scratch of B*H*T floats (D = rowsum(dout * out)); every sum in a fixed order, no atomics. */
dsk_status dsk_cuda_attention_fused(dsk_ctx *ctx, dsk_tensor *out, dsk_tensor *lse, const dsk_tensor *q, const dsk_tensor *k,
                                    const dsk_tensor *v, float scale);
dsk_status dsk_cuda_attention_fused_backward(dsk_ctx *ctx, dsk_tensor *dq, dsk_tensor *dk, dsk_tensor *dv, const dsk_tensor *dout,
                                             const dsk_tensor *q, const dsk_tensor *k, const dsk_tensor *v, const dsk_tensor *out,
                                             const dsk_tensor *lse, float scale);

/* ---- amp (kernels/amp.cu) */
/* `block` is a scaler's device state: {double found_inf, sumsq; float scale; int32 growth, hysteresis}. */
struct dsk_amp_scaler_opts;
dsk_status dsk_cuda_amp_unscale(dsk_ctx *ctx, dsk_tensor *const *grads, int n, void *block); /* multi-tensor; writes found_inf, sumsq */
dsk_status dsk_cuda_amp_update(dsk_ctx *ctx, void *block, const struct dsk_amp_scaler_opts *opts);  /* dsk_amp_scaler_rule, 1 thread */
dsk_status dsk_cuda_amp_cast(dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src, int stochastic, uint64_t key);
/* The device-resident step (dsk_amp_dstep): `vals` is its device dsk_amp_step_vals. decide: one thread writes
   dsk_amp_decide(block's stats, max_norm) into vals; adamw_dev and cast_dev return at once when vals->skip, else
   run dsk_adamw_step / the stochastic dsk_amp_cast with lr, bias corrections, grad_mult and step from vals. */
struct dsk_amp_step_vals;
dsk_status dsk_cuda_amp_decide(dsk_ctx *ctx, const void *block, struct dsk_amp_step_vals *vals, double max_norm);
dsk_status dsk_cuda_amp_adamw_dev(dsk_ctx *ctx, dsk_tensor *param, const dsk_tensor *grad, dsk_tensor *m, dsk_tensor *v,
                                  const dsk_adamw_opts *opts, const struct dsk_amp_step_vals *vals, dsk_tensor *copy);
dsk_status dsk_cuda_amp_cast_dev(dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src, uint64_t seed,
                                 uint64_t tensor_id, const struct dsk_amp_step_vals *vals);
dsk_status dsk_cuda_amp_amax(dsk_ctx *ctx, float *amax, const dsk_tensor *x, int accumulate);   /* device f32 scalar */
/* *scale = dsk_amp_fp8_scale(max of amax[0..n), fp8_max, margin, pow2, keep_prev ? *scale : 1); then *clear = 0 if non-NULL. */
dsk_status dsk_cuda_amp_fp8_scale(dsk_ctx *ctx, float *scale, const float *amax, int n, float fp8_max, int margin, int pow2, int keep_prev, float *clear);
dsk_status dsk_cuda_amp_fp8_quantize(dsk_ctx *ctx, dsk_tensor *q, const dsk_tensor *x, const float *scale);
dsk_status dsk_cuda_amp_fp8_dequantize(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *q, const float *scale);
dsk_status dsk_cuda_amp_fp8_block_quantize(dsk_ctx *ctx, dsk_tensor *q, dsk_tensor *scales, const dsk_tensor *x, int br, int bc, int pow2);
/* The same for x's transpose: q (C, R), x (R, C) */
dsk_status dsk_cuda_amp_fp8_block_quantize_t(dsk_ctx *ctx, dsk_tensor *q, dsk_tensor *scales, const dsk_tensor *x,
                                             int br, int bc, int pow2);
dsk_status dsk_cuda_amp_fp8_block_dequantize(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *q, const dsk_tensor *scales, int br, int bc);

/* ---- grouped rows (kernels/grouped.cu): same contracts as the dsk_tensor.h function of the same name;
   the offsets are read on the device, the grids sized by bounds from the shapes */
dsk_status dsk_cuda_group_by_key(dsk_ctx *ctx, dsk_tensor *perm, dsk_tensor *offsets, const dsk_tensor *keys);
dsk_status dsk_cuda_matmul_grouped(dsk_ctx *ctx, dsk_tensor *C, const dsk_tensor *A, int trans_a, const dsk_tensor *B,
                                   int trans_b, const dsk_tensor *offsets, float alpha, float beta);
dsk_status dsk_cuda_gather_rows_scaled(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *src, const dsk_tensor *idx,
                                       const dsk_tensor *scale);

/* ---- FP8 GEMM (kernels/fp8.cu): dsk_matmul_fp8 (offsets NULL: one segment of all of A's rows, B 2-D) and
   dsk_matmul_fp8_grouped (offsets (G + 1) on the device, B (G, N, K)); a_rows, b_rows: rows per scale (1 or 128) */
dsk_status dsk_cuda_matmul_fp8(dsk_ctx *ctx, dsk_tensor *C, const dsk_tensor *A, const dsk_tensor *a_scales, int a_rows,
                               const dsk_tensor *B, const dsk_tensor *b_scales, int b_rows, const dsk_tensor *offsets,
                               float alpha, float beta);

/* ---- moe (kernels/moe.cu): the MoE steps of dsk_moe.h, each a kernel over the DSK_HD function of
   the same name there; row-major buffers, slot i = t * K + k, T tokens, E experts, K slots */
struct dsk_moe_router;
/* dsk__moe_route_one per token: u (T,E) -> prob (T,E), scratch (T, E + n_group), sel, gate (T,K), keys (T*K);
   replay 1: sel holds the given experts (read, kept). */
dsk_status dsk_cuda_moe_route(dsk_ctx *ctx, const struct dsk_moe_router *r, int64_t T, const float *u, const float *bias,
                              float *prob, float *scratch, int32_t *sel, float *gate, int32_t *keys, int replay);
/* The balancing losses over a loss span (this call's T rows are rows [row0, row0 + T) of N, on `ranks` ranks).
   loss_parts: dsk__moe_loss_token per token, dsk__moe_switch_part per expert (aux_alpha > 0), dsk__moe_seq_part
   per (sequence, expert) (seq_alpha > 0) and the tail into part (zeroed by the caller); the caller sums part
   over the span's group; loss_finish: dsk__moe_loss_finish and dsk__moe_aux_coef per (sequence, expert). */
typedef struct dsk_cuda_moe_loss_args {
    int64_t T, N, row0, L, nseq;
    int E, K, ranks, sigmoid, count_topk;
    float aux_alpha, seq_alpha, z_beta;
    const float *prob, *u;
    const int32_t *sel;
    double *ptot, *part, *loss;
    float *lse, *aux;
    int32_t *lsel;
} dsk_cuda_moe_loss_args;
dsk_status dsk_cuda_moe_loss_parts(dsk_ctx *ctx, const dsk_cuda_moe_loss_args *a);
dsk_status dsk_cuda_moe_loss_finish(dsk_ctx *ctx, const dsk_cuda_moe_loss_args *a);
/* keys2 (TK) = the expert of each slot that keeps its place under capacity cap (dsk__moe_capacity_keep), else -1. */
dsk_status dsk_cuda_moe_capacity(dsk_ctx *ctx, int E, int drop, int64_t cap, int64_t TK, const int32_t *perm_all,
                                 const int32_t *off_all, const float *gate, int32_t *keys2);
/* pos (TK) = kept row of each slot or -1; row_tok, row_gate (n_rows) by dsk__moe_plan_row. */
dsk_status dsk_cuda_moe_plan(dsk_ctx *ctx, int E, int K, int64_t TK, int64_t n_rows, const int32_t *perm,
                             const int32_t *off, const float *gate, int32_t *pos, int32_t *row_tok, float *row_gate);
/* Bounded EP: pad, skey (P Cp) by dsk__moe_ep_slot, unpad (TK) by dsk__moe_ep_unslot; rgi (n) = the inverse
   of rg's first loff[El] entries, -1 elsewhere. */
dsk_status dsk_cuda_moe_ep_index(dsk_ctx *ctx, int P, int El, int64_t Cp, int64_t TK, const int32_t *off, int32_t *pad,
                                 int32_t *skey, int32_t *unpad);
dsk_status dsk_cuda_moe_ep_inverse(dsk_ctx *ctx, int El, int64_t n, const int32_t *rg, const int32_t *loff,
                                   int32_t *rgi);
/* cnt (3 + 2E) by dsk__moe_counts (one thread). */
dsk_status dsk_cuda_moe_counts(dsk_ctx *ctx, int64_t T, int K, int E, const int32_t *off_all, const int32_t *off,
                               int64_t *cnt);
/* dsk__moe_accumulate (one thread). */
dsk_status dsk_cuda_moe_accumulate(dsk_ctx *ctx, int E, int K, const int64_t *cnt, const int64_t *cnt_group,
                                   const double *loss, int64_t *load, int64_t *acc_i, double *acc_f);
/* y (T, D) in ydt by dsk__moe_combine_elem; rows (kept order) in rdt, shared (T, D) in sdt or NULL. */
dsk_status dsk_cuda_moe_combine(dsk_ctx *ctx, int K, int64_t T, int64_t D, void *y, dsk_dtype ydt, const int32_t *pos,
                                const float *gate, const void *rows, dsk_dtype rdt, const void *shared, dsk_dtype sdt);
/* dgate (TK) = dy_t . row_pos (0 for dropped slots): a warp per slot, dsk__moe_dot_part per lane, a fixed tree. */
dsk_status dsk_cuda_moe_dgate(dsk_ctx *ctx, int K, int64_t TK, int64_t D, float *dgate, const void *dy, dsk_dtype dydt,
                              const int32_t *pos, const void *rows, dsk_dtype rdt);
/* du (T,E) WRITTEN by dsk_moe_route_token_backward per token; aux (nseq, E) or NULL, token t in sequence
   (row0 + t) / seq_len. */
dsk_status dsk_cuda_moe_route_backward(dsk_ctx *ctx, const struct dsk_moe_router *r, int64_t T, const float *u,
                                       const float *prob, const int32_t *sel, const float *dgate, const float *aux,
                                       int64_t row0, int64_t seq_len, float aux_mult, float zcoef, float *du);
/* dxf (T, D) f32 by dsk__moe_uncombine_elem from rows (kept order) in rdt. */
dsk_status dsk_cuda_moe_uncombine(dsk_ctx *ctx, int K, int64_t T, int64_t D, float *dxf, const int32_t *pos,
                                  const void *rows, dsk_dtype rdt);
/* dsk__moe_bias_update (one thread), then load (E) zeroed; nothing when skip (device i32, may be NULL) is set. */
dsk_status dsk_cuda_moe_bias_update(dsk_ctx *ctx, int E, float rate, int recenter, int64_t *load, float *bias,
                                    const int32_t *skip);

/* ---- par (kernels/par.cu): dsk_par_cross_entropy's passes on logits (R, Vl), columns
   [lo, lo + Vl) of the full vocabulary, around its two all-reduces. */
/* mx (R) f32 = row max over this rank's columns; *count (device i64) = targets != ignore_index. */
dsk_status dsk_cuda_par_ce_max(dsk_ctx *ctx, float *mx, int64_t *count, const dsk_tensor *logits,
                               const dsk_tensor *targets, int32_t ignore_index);
/* acc (2R) f64: per row the sum of exp(x - mx) and the target's logit if this rank holds it (0 if not, or ignored). */
dsk_status dsk_cuda_par_ce_sums(dsk_ctx *ctx, double *acc, const float *mx, const dsk_tensor *logits,
                                const dsk_tensor *targets, int64_t lo, int32_t ignore_index);
/* From the all-reduced mx and acc: loss (device scalar f32) and dlogits (or NULL) as dsk_par_cross_entropy. */
dsk_status dsk_cuda_par_ce_finish(dsk_ctx *ctx, dsk_tensor *loss, dsk_tensor *dlogits, const float *mx, const double *acc,
                                  const int64_t *count, const dsk_tensor *logits, const dsk_tensor *targets, int64_t lo,
                                  int32_t ignore_index, float grad_scale);

#ifdef __cplusplus
}
#endif
#endif /* DSK_KERNELS_H */
