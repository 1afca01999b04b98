/* kernels/moe.cu - the CUDA path of dsk_moe.h's MoE steps: routing, balancing losses, capacity,
   the dispatch plan and counts, combine, gate gradient, routing backward and the bias update.
   Everything generic (GEMMs, grouped GEMMs, gathers, the sort by expert, SwiGLU) runs through
   dsk_tensor.h ops; this file holds only what is MoE.

   Conventions (kernels/dsk_cuda.cuh): launchers check their ctx and make its device current,
   enqueue on ctx->stream, never synchronise, check cudaGetLastError() after every launch.
   Each kernel runs a DSK_HD function of dsk_moe.h, the code the CPU path runs in a loop, so the
   two devices compute the same arithmetic (the losses in f64 in the same order: the same bits).
   No float atomics: every sum has a fixed order (slot order for combine and its backward, a
   fixed warp tree for the gate gradient, one thread for the loss totals and the counts). */
#include "dsk_cuda.cuh"
#include "dsk_moe.h"

/* kernel over n items, `threads` a block, checked (nothing to launch when n is 0). */
#define DSK__MOE_LAUNCH(fn, kernel, n, threads, ...)                                                   \
    do {                                                                                               \
        if ((n) > 0)                                                                                   \
            DSK__CUDA_LAUNCH(fn, kernel, (unsigned)(((n) + (threads) - 1) / (threads)), (threads),     \
                             dsk__cuda_stream(ctx), (n), __VA_ARGS__);                                 \
    } while (0)

/* ======================================================================= routing */

__global__ void dsk__moe_k_route(dsk_moe_router r, int64_t T, const float *u, const float *bias, float *prob,
                                 float *scratch, int32_t *sel, float *gate, int32_t *keys, int replay) {
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < T) dsk__moe_route_one(&r, t, u, bias, prob, scratch, sel, gate, keys, replay);
}

extern "C" dsk_status dsk_cuda_moe_route(dsk_ctx *ctx, const dsk_moe_router *r, int64_t T, const float *u,
                                         const float *bias, float *prob, float *scratch, int32_t *sel, float *gate,
                                         int32_t *keys, int replay) {
    static const char *fn = "dsk_moe_forward (routing)";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    DSK__MOE_LAUNCH(fn, dsk__moe_k_route, T, 128, *r, T, u, bias, prob, scratch, sel, gate, keys, replay);
    return DSK_OK;
}

__global__ void dsk__moe_k_route_backward(dsk_moe_router r, int64_t T, const float *u, const float *prob,
                                          const int32_t *sel, const float *dgate, const float *aux, int64_t row0,
                                          int64_t seq_len, float aux_mult, float zcoef, float *du) {
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    int E = r.n_experts, K = r.top_k;
    if (t >= T) return;
    dsk_moe_route_token_backward(&r, u + t * E, prob + t * E, sel + t * K, dgate + t * K,
                                 aux ? aux + ((row0 + t) / seq_len) * E : NULL, aux_mult, zcoef, du + t * E);
}

extern "C" dsk_status dsk_cuda_moe_route_backward(dsk_ctx *ctx, const dsk_moe_router *r, int64_t T, const float *u,
                                                  const float *prob, const int32_t *sel, const float *dgate,
                                                  const float *aux, int64_t row0, int64_t seq_len, float aux_mult,
                                                  float zcoef, float *du) {
    static const char *fn = "dsk_moe_backward (routing)";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (aux && seq_len <= 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: seq_len %lld must be > 0 with loss coefficients", fn,
                             (long long)seq_len);
    DSK__MOE_LAUNCH(fn, dsk__moe_k_route_backward, T, 128, *r, T, u, prob, sel, dgate, aux, row0, seq_len, aux_mult,
                    zcoef, du);
    return DSK_OK;
}

/* ======================================================================= balancing losses */

__global__ void dsk__moe_k_loss_token(dsk_cuda_moe_loss_args a) {
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= a.T) return;
    dsk__moe_loss_token(a.E, a.K, a.count_topk, a.z_beta > 0, a.prob + t * a.E, a.u + t * a.E, a.sel + t * a.K,
                        a.ptot + t, a.z_beta > 0 ? a.lse + t : NULL, a.lsel + t * a.K);
}

__global__ void dsk__moe_k_switch_part(dsk_cuda_moe_loss_args a) {
    int j = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (j < a.E) dsk__moe_switch_part(j, a.T, a.N, a.E, a.K, a.sigmoid, a.prob, a.ptot, a.lsel, a.part);
}

__global__ void dsk__moe_k_seq_part(dsk_cuda_moe_loss_args a) {
    int64_t qj = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (qj < a.nseq * a.E)
        dsk__moe_seq_part((int)(qj % a.E), qj / a.E, a.row0, a.T, a.L, a.nseq, a.E, a.K, a.sigmoid, a.prob, a.ptot,
                          a.lsel, a.part);
}

__global__ void dsk__moe_k_part_tail(dsk_cuda_moe_loss_args a) {
    if (threadIdx.x == 0)
        dsk__moe_part_tail_fill(a.T, a.N, a.z_beta > 0 ? a.lse : NULL, a.part + dsk__moe_part_tail(a.E, a.nseq));
}

extern "C" dsk_status dsk_cuda_moe_loss_parts(dsk_ctx *ctx, const dsk_cuda_moe_loss_args *a) {
    static const char *fn = "dsk_moe_forward (balancing losses)";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    DSK__MOE_LAUNCH(fn, dsk__moe_k_loss_token, a->T, 128, *a);
    if (a->aux_alpha > 0 && a->N > 0) DSK__MOE_LAUNCH(fn, dsk__moe_k_switch_part, (int64_t)a->E, 64, *a);
    if (a->seq_alpha > 0 && a->N > 0) DSK__MOE_LAUNCH(fn, dsk__moe_k_seq_part, a->nseq * a->E, 128, *a);
    DSK__CUDA_LAUNCH(fn, dsk__moe_k_part_tail, 1, 32, dsk__cuda_stream(ctx), 1, *a);
    return DSK_OK;
}

/* One block: thread 0 sums the loss totals; every thread writes coefficients. */
__global__ void dsk__moe_k_loss_finish(dsk_cuda_moe_loss_args a) {
    if (threadIdx.x == 0)
        dsk__moe_loss_finish(a.E, a.K, a.N, a.L, a.nseq, a.ranks, a.aux_alpha, a.seq_alpha, a.z_beta, a.part, a.loss);
    for (int64_t qj = threadIdx.x; qj < a.nseq * a.E; qj += blockDim.x)
        a.aux[qj] = dsk__moe_aux_coef(qj, a.E, a.K, a.N, a.L, a.nseq, a.ranks, a.aux_alpha, a.seq_alpha, a.part);
}

extern "C" dsk_status dsk_cuda_moe_loss_finish(dsk_ctx *ctx, const dsk_cuda_moe_loss_args *a) {
    static const char *fn = "dsk_moe_forward (balancing losses)";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    DSK__CUDA_LAUNCH(fn, dsk__moe_k_loss_finish, 1, 256, dsk__cuda_stream(ctx), a->nseq * a->E, *a);
    return DSK_OK;
}

/* ======================================================================= dispatch plan */

__global__ void dsk__moe_k_fill_i32(int32_t *p, int64_t n, int32_t v) {
    DSK__CUDA_FOR(i, n) p[i] = v;
}

/* p[0..n) = -1 (no slot, no row): the entries the next kernel leaves unset. */
static dsk_status dsk__moe_unset_i32(const char *fn, dsk_ctx *ctx, int32_t *p, int64_t n) {
    DSK__CUDA_LAUNCH(fn, dsk__moe_k_fill_i32, dsk__cuda_grid(n), DSK__CUDA_THREADS, dsk__cuda_stream(ctx), n, p, n,
                     (int32_t)-1);
    return DSK_OK;
}

/* One block per expert: each slot of its segment (in position order) keeps its place or not. */
__global__ void dsk__moe_k_capacity(int drop, int64_t cap, const int32_t *perm_all, const int32_t *off_all,
                                    const float *gate, int32_t *keys2) {
    int e = blockIdx.x;
    int64_t o = off_all[e], n = off_all[e + 1] - o;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
        if (dsk__moe_capacity_keep(drop, gate, perm_all + o, n, j, cap)) keys2[perm_all[o + j]] = e;
}

extern "C" dsk_status dsk_cuda_moe_capacity(dsk_ctx *ctx, int E, int drop, int64_t cap, int64_t TK,
                                            const int32_t *perm_all, const int32_t *off_all, const float *gate,
                                            int32_t *keys2) {
    static const char *fn = "dsk_moe_forward (capacity)";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (TK == 0) return DSK_OK;
    DSK__TRY(dsk__moe_unset_i32(fn, ctx, keys2, TK));
    DSK__CUDA_LAUNCH(fn, dsk__moe_k_capacity, (unsigned)E, 128, dsk__cuda_stream(ctx), TK, drop, cap, perm_all, off_all,
                     gate, keys2);
    return DSK_OK;
}

__global__ void dsk__moe_k_plan(int E, int K, int64_t TK, int64_t n_rows, const int32_t *perm, const int32_t *off,
                                const float *gate, int32_t *pos, int32_t *row_tok, float *row_gate) {
    int32_t n_kept = off[E];
    DSK__CUDA_FOR(j, TK) {
        if (j < n_kept) pos[perm[j]] = (int32_t)j;
        if (j < n_rows) dsk__moe_plan_row(j, K, n_kept, perm, gate, row_tok, row_gate);
    }
}

extern "C" dsk_status dsk_cuda_moe_plan(dsk_ctx *ctx, int E, int K, int64_t TK, int64_t n_rows, const int32_t *perm,
                                        const int32_t *off, const float *gate, int32_t *pos, int32_t *row_tok,
                                        float *row_gate) {
    static const char *fn = "dsk_moe_forward (dispatch plan)";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (TK == 0) return DSK_OK;
    DSK__TRY(dsk__moe_unset_i32(fn, ctx, pos, TK));
    DSK__CUDA_LAUNCH(fn, dsk__moe_k_plan, dsk__cuda_grid(TK), DSK__CUDA_THREADS, dsk__cuda_stream(ctx), TK, E, K, TK,
                     n_rows, perm, off, gate, pos, row_tok, row_gate);
    return DSK_OK;
}

/* Bounded expert parallelism: the send layout (dsk__moe_ep_slot, dsk__moe_ep_unslot) and the inverse of
   the regroup index, from offsets on the device. */
__global__ void dsk__moe_k_ep_index(int P, int El, int64_t Cp, int64_t TK, const int32_t *off, int32_t *pad,
                                    int32_t *skey, int32_t *unpad) {
    DSK__CUDA_FOR(i, P * Cp + TK) {
        if (i < P * Cp) dsk__moe_ep_slot(i, El, Cp, off, pad + i, skey + i);
        else unpad[i - P * Cp] = dsk__moe_ep_unslot(i - P * Cp, P, El, Cp, off);
    }
}

extern "C" dsk_status dsk_cuda_moe_ep_index(dsk_ctx *ctx, int P, int El, int64_t Cp, int64_t TK, const int32_t *off,
                                            int32_t *pad, int32_t *skey, int32_t *unpad) {
    static const char *fn = "dsk_moe_forward (bounded EP layout)";
    int64_t n = P * Cp + TK;
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (n == 0) return DSK_OK;
    DSK__CUDA_LAUNCH(fn, dsk__moe_k_ep_index, dsk__cuda_grid(n), DSK__CUDA_THREADS, dsk__cuda_stream(ctx), n, P, El, Cp,
                     TK, off, pad, skey, unpad);
    return DSK_OK;
}

__global__ void dsk__moe_k_ep_inverse(int El, int64_t n, const int32_t *rg, const int32_t *loff, int32_t *rgi) {
    int32_t used = loff[El];
    DSK__CUDA_FOR(j, n) {
        if (j < used) rgi[rg[j]] = (int32_t)j;
    }
}

extern "C" dsk_status dsk_cuda_moe_ep_inverse(dsk_ctx *ctx, int El, int64_t n, const int32_t *rg, const int32_t *loff,
                                              int32_t *rgi) {
    static const char *fn = "dsk_moe_forward (bounded EP regroup)";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (n == 0) return DSK_OK;
    DSK__TRY(dsk__moe_unset_i32(fn, ctx, rgi, n));
    DSK__CUDA_LAUNCH(fn, dsk__moe_k_ep_inverse, dsk__cuda_grid(n), DSK__CUDA_THREADS, dsk__cuda_stream(ctx), n, El, n,
                     rg, loff, rgi);
    return DSK_OK;
}

__global__ void dsk__moe_k_block_segments(int64_t n, int El, int64_t Cp, const int32_t *key, int32_t *seg) {
    DSK__CUDA_FOR(i, n) seg[i] = dsk__moe_block_segment(i, El, Cp, key);
}

extern "C" dsk_status dsk_cuda_moe_block_segments(dsk_ctx *ctx, int P, int El, int64_t Cp, const int32_t *key,
                                                  int32_t *seg) {
    static const char *fn = "dsk_moe_forward (bounded EP chunks' segments)";
    int64_t n = (int64_t)P * (El + 1);
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    DSK__CUDA_LAUNCH(fn, dsk__moe_k_block_segments, dsk__cuda_grid(n), DSK__CUDA_THREADS, dsk__cuda_stream(ctx), n, n,
                     El, Cp, key, seg);
    return DSK_OK;
}

__global__ void dsk__moe_k_counts(int64_t T, int K, int E, const int32_t *off_all, const int32_t *off, int64_t *cnt) {
    if (threadIdx.x == 0) dsk__moe_counts(T, K, E, off_all, off, cnt);
}

extern "C" dsk_status dsk_cuda_moe_counts(dsk_ctx *ctx, int64_t T, int K, int E, const int32_t *off_all,
                                          const int32_t *off, int64_t *cnt) {
    static const char *fn = "dsk_moe_forward (counts)";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    DSK__CUDA_LAUNCH(fn, dsk__moe_k_counts, 1, 32, dsk__cuda_stream(ctx), E, T, K, E, off_all, off, cnt);
    return DSK_OK;
}

__global__ void dsk__moe_k_accumulate(int E, int K, const int64_t *cnt, const int64_t *cnt_group, const double *loss,
                                      int64_t *load, int64_t *acc_i, double *acc_f) {
    if (threadIdx.x == 0) dsk__moe_accumulate(E, K, cnt, cnt_group, loss, load, acc_i, acc_f);
}

extern "C" dsk_status dsk_cuda_moe_accumulate(dsk_ctx *ctx, int E, int K, const int64_t *cnt, const int64_t *cnt_group,
                                              const double *loss, int64_t *load, int64_t *acc_i, double *acc_f) {
    static const char *fn = "dsk_moe_forward (statistics)";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    DSK__CUDA_LAUNCH(fn, dsk__moe_k_accumulate, 1, 32, dsk__cuda_stream(ctx), E, E, K, cnt, cnt_group, loss, load,
                     acc_i, acc_f);
    return DSK_OK;
}

/* ======================================================================= combine and its backward */

/* A block per token, threads over the row. */
__global__ void dsk__moe_k_combine(int K, int64_t D, void *y, dsk_dtype ydt, const int32_t *pos, const float *gate,
                                   const void *rows, dsk_dtype rdt, const void *shared, dsk_dtype sdt) {
    int64_t t = blockIdx.x;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
        dsk_store_f32(y, ydt, t * D + d,
                      dsk__moe_combine_elem(K, pos + t * K, gate + t * K, rows, rdt, D, d, shared, sdt, t * D + d));
}

extern "C" dsk_status dsk_cuda_moe_combine(dsk_ctx *ctx, int K, int64_t T, int64_t D, void *y, dsk_dtype ydt,
                                           const int32_t *pos, const float *gate, const void *rows, dsk_dtype rdt,
                                           const void *shared, dsk_dtype sdt) {
    static const char *fn = "dsk_moe_forward (combine)";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    DSK__TRY(dsk__cuda_check_rows(fn, T));
    if (T == 0 || D == 0) return DSK_OK;
    DSK__CUDA_LAUNCH(fn, dsk__moe_k_combine, (unsigned)T, dsk__cuda_row_threads(D), dsk__cuda_stream(ctx), T * D, K, D,
                     y, ydt, pos, gate, rows, rdt, shared, sdt);
    return DSK_OK;
}

__global__ void dsk__moe_k_uncombine(int K, int64_t D, float *dxf, const int32_t *pos, const void *rows,
                                     dsk_dtype rdt) {
    int64_t t = blockIdx.x;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
        dxf[t * D + d] = dsk__moe_uncombine_elem(K, pos + t * K, rows, rdt, D, d, dxf[t * D + d]);
}

extern "C" dsk_status dsk_cuda_moe_uncombine(dsk_ctx *ctx, int K, int64_t T, int64_t D, float *dxf, const int32_t *pos,
                                             const void *rows, dsk_dtype rdt) {
    static const char *fn = "dsk_moe_backward (combine)";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    DSK__TRY(dsk__cuda_check_rows(fn, T));
    if (T == 0 || D == 0) return DSK_OK;
    DSK__CUDA_LAUNCH(fn, dsk__moe_k_uncombine, (unsigned)T, dsk__cuda_row_threads(D), dsk__cuda_stream(ctx), T * D, K,
                     D, dxf, pos, rows, rdt);
    return DSK_OK;
}

/* A warp per slot: lanes take every 32nd element, then a fixed butterfly sums the partials. */
__global__ void dsk__moe_k_dgate(int K, int64_t TK, int64_t D, float *dgate, const void *dy, dsk_dtype dydt,
                                 const int32_t *pos, const void *rows, dsk_dtype rdt) {
    int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x & 31;
    double acc = 0;
    if (i >= TK) return; /* whole warps leave together: TK is counted in warps */
    if (pos[i] >= 0) acc = dsk__moe_dot_part(dy, dydt, (i / K) * D, rows, rdt, (int64_t)pos[i] * D, D, lane, 32);
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) dgate[i] = (float)acc;
}

extern "C" dsk_status dsk_cuda_moe_dgate(dsk_ctx *ctx, int K, int64_t TK, int64_t D, float *dgate, const void *dy,
                                         dsk_dtype dydt, const int32_t *pos, const void *rows, dsk_dtype rdt) {
    static const char *fn = "dsk_moe_backward (gate gradient)";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    DSK__MOE_LAUNCH(fn, dsk__moe_k_dgate, TK * 32, 256, K, TK, D, dgate, dy, dydt, pos, rows, rdt);
    return DSK_OK;
}

/* ======================================================================= bias update */

__global__ void dsk__moe_k_bias_update(int E, float rate, int recenter, int64_t *load, float *bias,
                                       const int32_t *skip) {
    if (threadIdx.x != 0 || (skip && *skip)) return;
    dsk__moe_bias_update(E, rate, recenter, load, bias);
    for (int e = 0; e < E; e++) load[e] = 0;
}

extern "C" dsk_status dsk_cuda_moe_bias_update(dsk_ctx *ctx, int E, float rate, int recenter, int64_t *load,
                                               float *bias, const int32_t *skip) {
    static const char *fn = "dsk_moe_update_bias";
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    DSK__CUDA_LAUNCH(fn, dsk__moe_k_bias_update, 1, 32, dsk__cuda_stream(ctx), E, E, rate, recenter, load, bias, skip);
    return DSK_OK;
}
