/* dsk_par.h - tensor, sequence and pipeline parallelism: the rank grid, Megatron's collective
   mappings, column- and row-parallel linears, vocabulary-parallel embedding and cross-entropy,
   pipeline schedules as data and a pipeline executor.

   Usage: #define DSK_PAR_IMPLEMENTATION in exactly one .c file before including (with
   DSK_TENSOR_IMPLEMENTATION and DSK_COMM_IMPLEMENTATION somewhere in the program).
   Options: DSK_STATIC, DSK_MALLOC/DSK_FREE, DSK_CUDA, DSK_NO_CUDA as in dsk_tensor.h.

   Example (given dsk_comm *world, dsk_ctx *ctx, const dsk_par_stage_fns *fns):
       dsk_par_dims d;  memset(&d, 0, sizeof d);  d.tp = 2; d.pp = 2;  // dp = world / (tp * pp)
       dsk_par_grid g;                                      // collective over world:
       if (dsk_par_grid_init(&g, world, &d) != DSK_OK) return 1;   // dsk_last_error() says why
       dsk_par_schedule s;
       dsk_status st = dsk_par_schedule_init(&s, DSK_PAR_1F1B, g.dims.pp, 8, 1, g.at.pp);
       if (st == DSK_OK) st = dsk_par_pipeline_run(&s, &g.pp, ctx, fns);  // fns: forward, backward, buffers
       // ... the optimizer step, the next step's pipeline run ...
       dsk_par_schedule_free(&s);  dsk_par_grid_free(&g);
       return st;
   End of example.

   The rank grid. world = tp * dp * pp; world rank = tp_i + tp * (dp_i + dp * pp_i): tensor
     parallelism varies fastest, then data parallelism, then the pipeline stage. Expert
     parallelism splits the data-parallel dimension: ep divides dp, dp_i = ep_i + ep * edp_i
     (edp_i: the expert-data-parallel index, the replicas of one expert shard).
     Why this order: tensor parallelism communicates inside every layer on the critical path
     (two all-reduces or all-gather/reduce-scatter pairs per block, forward and backward), so its
     ranks are neighbours (one node, NVLink); expert parallelism's all-to-all runs twice per MoE
     layer and comes next, then data parallelism's gradient all-reduce, once per step and
     overlapped with backward; the pipeline sends one activation per micro-batch between
     adjacent stages, the least traffic, so stages may sit on different nodes. This is
     Megatron-Core's default order (tp-cp-ep-dp-pp without context parallelism).
     Groups (each a dsk_comm split from the world, ranks ordered by their index in it):
       tp  same (dp_i, pp_i), ordered by tp_i     pp  same (tp_i, dp_i), ordered by pp_i
       dp  same (tp_i, pp_i), ordered by dp_i     ep  same (tp_i, pp_i, edp_i), by ep_i
       edp same (tp_i, pp_i, ep_i), by edp_i: all-reduce expert gradients here, dense ones on dp.

   Tensor-parallel mappings (Megatron-LM's mappings.py). tp may be NULL or of one rank: then
     every mapping is the identity (a copy) and every linear is a plain one.
       COPY    f: forward identity,             backward all-reduce (sum)
       REDUCE  g: forward all-reduce (sum),     backward identity
       GATHER  forward all-gather along dim,    backward reduce-scatter (sum) along dim
       SCATTER forward reduce-scatter along dim, backward all-gather along dim
       SPLIT   forward keeps this rank's block, backward all-gather along dim
     Sequence parallelism replaces f/g around a block by GATHER before the column-parallel
     linears and SCATTER after the row-parallel ones, so the norms and residual adds in between
     run on N/tp tokens. "Along dim" means blocks of shape[dim] / tp in rank order; the tensors
     are contiguous; dim 0 is one collective, another dim adds a strided copy through a
     temporary. Mappings WRITE their outputs (they are not gradients of weights); COPY and
     REDUCE may run in place.

   Parallel linears (weights (out, in) as nn.Linear: y = x W^T), thin compositions of
     dsk_matmul and dsk_comm; weight gradients ACCUMULATE (+=), input gradients are WRITTEN:
       column  W (out/tp, in): Y (N, out/tp) = X W^T. Several weights that share one input
               (q, k, v; gate and up) go in one call so backward reduces their input gradient
               once. Sequence parallel: X (N/tp, in) is all-gathered into xg (N, in) first.
       row     W (out, in/tp): Y = sum over tp of X W^T with X (N, in/tp); all-reduced into
               Y (N, out), or with sequence parallelism reduce-scattered into Y (N/tp, out)
               through the scratch yp (N, out).
     Pass the scratch (xg, dxg, yp, dyg) to select sequence parallelism, NULL for none.

   Vocabulary parallelism. Rank r of tp holds vocabulary rows [r Vl, (r + 1) Vl) of the
     embedding table and of the LM head (Vl = V / tp). Embedding: local rows gathered, others
     0, then all-reduced (or reduce-scattered with sequence parallelism); exactly one rank
     contributes each row, so the result is bitwise one rank's. Cross-entropy from logits
     (N, Vl): the row max is all-reduced (max, f32), then the sum of exp(logit - max) and the
     target's logit (f64, one all-reduce of 2N values); the full (N, V) logits are never formed.
     Loss and gradient are dsk_cross_entropy's (mean over non-ignored tokens, dlogits written
     with grad_scale * (softmax - onehot) / count): over several ranks the same math in f64,
     on one CPU rank dsk_cross_entropy itself (its bits). Every function runs on CPU
     tensors over the host backend and on CUDA tensors over nccl (the cross-entropy's passes in
     kernels/par.cu); a tensor on one and a communicator of the other is DSK_ERR_ARG.

   Pipeline schedules as data. p stages (pipeline ranks), m micro-batches, v chunks (virtual
     stages) per rank; rank r runs the global stages s = c p + r, c < v (v = 1 except for the
     interleaved schedule), or under DualPipeV (v = 2) the V s = r and s = 2 p - 1 - r
     (dsk_par_stage, dsk_par_stage_rank). dsk_par_schedule_init gives rank r its ordered action list:
     FORWARD / BACKWARD of (micro-batch, chunk), SEND / RECV of an activation or a gradient
     with the pipeline peer. Compute orders:
       GPipe        every forward (micro-batches 0..m-1), then every backward (0..m-1)
       1F1B         min(p - r - 1, m) warm-up forwards, then one forward and one backward
                    alternately, then the remaining backwards (PipeDream-Flush, Megatron)
       interleaved  Megatron's interleaved 1F1B: forward k runs chunk (k mod pv) / p of
                    micro-batch (k / pv) p + k mod p (backward: chunk v - 1 - that); warm-up
                    2 (p - r - 1) + (v - 1) p forwards (all of them when m = p); m must be a
                    multiple of p. With v = 1 it is 1F1B.
       dualpipev    DeepSeek's DualPipeV (deepseek-ai/DualPipe; Sea AI Lab's "cut-in-half" of the
                    bidirectional DualPipe): chunk 0 runs stages 0..p-1 down the ranks, chunk 1 stages
                    p..2p-1 back up, so the embedding and the head share rank 0 and the turn at rank
                    p - 1 hands over in memory (no message: the model reads the other chunk's
                    buffer). Its eight steps: F0 x 2 (p - r - 1); (F0 F1) x (r + 1); (B1 F1) x
                    (p - r - 1); (F0 B1 F1 B0) x (m - 2 p + r + 1); (B1 F1 B0) x (p - r - 1); (B1 B0)
                    x (r + 1); B0 x (p - r - 1); m >= 2 p. Without a split backward (zero bubble's
                    W) its weight steps are part of B. Each chunk's forwards and backwards go in
                    micro-batch order, so gradients accumulate as under the other schedules.
     Transfers are placed by running all ranks' compute orders together in unit time steps (a
     forward or a backward each takes one step; a rank runs its next computation as soon as
     its input has arrived) and appending the messages produced in a step, on both ends, in
     one global order. Every rank's list is then a projection of one global sequence, so the
     lists run with blocking (rendezvous) sends and receives without deadlock, on the host
     backend and on NCCL alike, and every input arrives before the computation that needs it.
     Bounds: micro-batch chunks whose forward ran and whose backward has not (activations kept)
       GPipe m; 1F1B min(p - r, m); interleaved min(2 (p - r - 1) + (v - 1) p + 1, m v)
       (m v when m = p); DualPipeV 2 p + 1 on every rank. Bubble (idle share of the ideal compute
       time): (p - 1) / m for GPipe and 1F1B, (p - 1) / (v m) interleaved and DualPipeV (v = 2);
       the unit-step run reaches exactly these. The DualPipe paper's (p - 1)(F&B + B - 3W) for
       DualPipeV (F&B a forward and a backward overlapped, W the weight part a split backward
       defers) is a bound of another model: timed (dsk_par_schedule_time, receives ahead) with a
       chunk's F 1 and B 2, W 0 and no overlap, DualPipeV idles 3, 11 and 27 units at p 2, 4, 8
       against that formula's 5, 15, 35 and 1F1B's (p - 1)(F + B) of 6, 18, 42 (its stages two
       chunks long), interleaved 3, 9, 21.
     Paired (dsk_par_schedule_init_paired): each steady-state forward runs with the backward
       after it, of another micro-batch, as one FORWARD_BACKWARD action, so that the model can
       interleave the two (one's expert all-to-all in flight while the other computes:
       Megatron-Core's combined 1F1B, DualPipe's overlapped chunks). A pair needs both inputs
       when it starts and sends both outputs when it ends, so the warm-up grows to the
       interleaved one's plus one, 2 (p - r - 1) + (v - 1) p + 1 forwards (1F1B: 2 (p - r) - 1),
       which keeps the bubble formula above (the unit-step run, a pair two steps) at the price
       of activations: min(warm-up + 1, m v) chunks in flight, 2 p instead of p on rank 0 under
       1F1B. The forwards and the backwards keep their unpaired order. GPipe has no pairs.
       DualPipeV pairs as DualPipe overlaps its chunks, F0 with the B1 after it and F1 with the B0
       after it (not the last rank's first F0 B1), in its own order: 2 p + 1 in flight, and p more
       unit steps than unpaired (p > 1) where a pair waits for its second input.
     Executed (dsk_par_pipeline_run): a receive of a message its sender leaves in the transport's buffers
       (the host's shared-memory rings) is begun at its place in the list and finished just before the
       computation that uses its data, so a stage never waits at a receive it does not need yet; a larger
       message, whose sender waits for its receiver, is received where the list has it, and nccl keeps the
       list's order on the stream. The lists place each transfer where the unit-step run met it, which,
       run in order with rendezvous sends, stalls the interleaved schedule when a backward takes longer
       than a forward (a stage reaches a receive whose sender is still in a backward): f = 1, b = 2 at
       p 2, m 16, v 2 take 121 units against the formula's 99; with the receives ahead they take 99.
     Timed (dsk_par_schedule_time): every rank's list run as the executor runs it on a transport
       (DSK_PAR_TRANSFERS_IN_ORDER: sends and receives in the list's order, a send meeting its receive, as
       on nccl; DSK_PAR_TRANSFERS_AHEAD: sends leave at once, receives finish where their data is used, as
       on the host backend with messages its buffers hold) with each stage's own forward and backward time
       and a link time per message. The formulas above hold for equal stages; where the first or last stage
       carries the embedding or the head, or the stages hold different numbers of MoE layers, the faster
       stages wait on the slowest one's messages, and dsk_plan.h prices that.
   License: MIT, see the end of the file. */
/* Contents. Each section starts with a rule comment "---- <title>"; search for the title.
   Declarations: the rank grid; tensor-parallel mappings; parallel linears; vocabulary
   parallelism; pipeline schedules; the pipeline executor; CUDA launchers (kernels/par.cu).
   Implementation (after the "implementation" rule): checks and helpers; the rank grid;
   mappings; parallel linears; vocabulary-parallel embedding; vocabulary-parallel
   cross-entropy; schedules: compute orders; schedules: placing the transfers; schedules: timed; the executor. */
#if defined(DSK_STATIC) && defined(DSK_PAR_IMPLEMENTATION) && !defined(DSK_COMM_IMPLEMENTATION)
#define DSK_COMM_IMPLEMENTATION
#endif
#ifndef DSK_PAR_H
#define DSK_PAR_H
#include "dsk_comm.h"
#include "dsk_tensor.h"
DSK__FP_EXACT_BEGIN
#ifdef __cplusplus
extern "C" {
#endif

/* ---- the rank grid */

/* Zero fields take the defaults in brackets. */
typedef struct dsk_par_dims {
    int tp; /* [1] tensor-parallel ranks */
    int ep; /* [1] expert-parallel ranks; divides dp */
    int dp; /* [world / (tp pp)] data-parallel ranks */
    int pp; /* [1] pipeline stages */
} dsk_par_dims;

/* A rank's place in the grid. */
typedef struct dsk_par_coords {
    int tp, dp, pp; /* the three dimensions */
    int ep, edp;    /* dp = ep + dims.ep * edp */
} dsk_par_coords;

typedef struct dsk_par_grid {
    dsk_par_dims dims;  /* resolved: every field set */
    int rank, world_size;
    dsk_par_coords at;  /* this rank's coordinates */
    dsk_comm tp, dp, pp, ep, edp;
} dsk_par_grid;

/* Fills the defaults of d for world_size ranks and checks that tp * dp * pp == world_size and
   that ep divides dp; DSK_ERR_ARG names the sizes. */
DSK_API dsk_status dsk_par_dims_resolve(dsk_par_dims *d, int world_size);
/* Coordinates of world rank `rank` in resolved dims d. */
DSK_API dsk_status dsk_par_coords_of(const dsk_par_dims *d, int rank, dsk_par_coords *at);
/* The world rank at (tp_i, dp_i, pp_i) of resolved dims d; -1 when out of range. */
DSK_API int dsk_par_rank_of(const dsk_par_dims *d, int tp_i, int dp_i, int pp_i);
/* Collective over world: resolves dims and splits the five groups. On failure *g is zeroed. */
DSK_API dsk_status dsk_par_grid_init(dsk_par_grid *g, dsk_comm *world, const dsk_par_dims *dims);
DSK_API void dsk_par_grid_free(dsk_par_grid *g); /* zeroed/freed ok */

/* ---- tensor-parallel mappings */

typedef enum dsk_par_map {
    DSK_PAR_MAP_COPY = 0, /* f */
    DSK_PAR_MAP_REDUCE,   /* g */
    DSK_PAR_MAP_GATHER,   /* sequence parallel: all-gather forward, reduce-scatter backward */
    DSK_PAR_MAP_SCATTER,  /* sequence parallel: reduce-scatter forward, all-gather backward */
    DSK_PAR_MAP_SPLIT     /* this rank's block forward, all-gather backward */
} dsk_par_map;

/* out = map(in) along dim (see the top of the file for shapes). Same dtype and device. */
DSK_API dsk_status dsk_par_map_forward(dsk_comm *tp, dsk_ctx *ctx, dsk_par_map map, int dim, dsk_tensor *out,
                                       const dsk_tensor *in);
/* din = the backward of map applied to dout: din has in's shape, dout out's. */
DSK_API dsk_status dsk_par_map_backward(dsk_comm *tp, dsk_ctx *ctx, dsk_par_map map, int dim, dsk_tensor *din,
                                        const dsk_tensor *dout);
DSK_API const char *dsk_par_map_name(dsk_par_map map); /* "copy", "reduce", ... */

/* ---- parallel linears (2-D tensors (rows, features), float dtypes as dsk_matmul) */

/* Y[i] (N, O_i) = Xf W[i]^T for i < n, W[i] (O_i, K): this rank's rows of each full weight.
   xg NULL: Xf = X (N, K) (f's forward is the identity). xg (N, K): sequence parallel, X
   (N/tp, K) is all-gathered into xg and Xf = xg (keep it for backward). */
DSK_API dsk_status dsk_par_column_forward(dsk_comm *tp, dsk_ctx *ctx, int n, dsk_tensor *const *Y,
                                          const dsk_tensor *const *W, const dsk_tensor *X, dsk_tensor *xg);
/* dW[i] += dY[i]^T Xf (dW[i] may be NULL: not computed); the input gradient sum_i dY[i] W[i]
   summed over tp: all-reduced into dX (N, K) (dxg NULL), or computed in the scratch dxg (N, K)
   and reduce-scattered into dX (N/tp, K) (sequence parallel). Xf: the forward's Xf. */
DSK_API dsk_status dsk_par_column_backward(dsk_comm *tp, dsk_ctx *ctx, int n, dsk_tensor *dX, dsk_tensor *dxg,
                                           dsk_tensor *const *dW, const dsk_tensor *const *dY,
                                           const dsk_tensor *const *W, const dsk_tensor *Xf);
/* X (N, K/tp), W (O, K/tp). yp NULL: Y (N, O) = X W^T all-reduced over tp. yp (N, O): the
   partial product goes there and is reduce-scattered into Y (N/tp, O) (sequence parallel). */
DSK_API dsk_status dsk_par_row_forward(dsk_comm *tp, dsk_ctx *ctx, dsk_tensor *Y, dsk_tensor *yp, const dsk_tensor *X,
                                       const dsk_tensor *W);
/* dyg NULL: dY (N, O); dyg (N, O): dY (N/tp, O) is all-gathered into it (sequence parallel).
   With dYf the full gradient: dX (N, K/tp) = dYf W (written), dW += dYf^T X (dW may be NULL). */
DSK_API dsk_status dsk_par_row_backward(dsk_comm *tp, dsk_ctx *ctx, dsk_tensor *dX, dsk_tensor *dW,
                                        const dsk_tensor *dY, dsk_tensor *dyg, const dsk_tensor *X,
                                        const dsk_tensor *W);

/* ---- vocabulary parallelism */

/* table (Vl, D): rows [r Vl, (r+1) Vl) of the full table on rank r of tp; ids (N) i32 in
   [0, Vl tp). part NULL: out (N, D) = full-table rows at ids (all-reduced). part (N, D)
   scratch: sequence parallel, the partial rows go there and out (N/tp, D) is their reduce-scatter. */
DSK_API dsk_status dsk_par_embedding_forward(dsk_comm *tp, dsk_ctx *ctx, dsk_tensor *out, dsk_tensor *part,
                                             const dsk_tensor *table, const dsk_tensor *ids);
/* dtable (Vl, D) += the rows of the full dout at this rank's ids, in token order. dg NULL:
   dout (N, D). dg (N, D) scratch: sequence parallel, dout (N/tp, D) is all-gathered into it. */
DSK_API dsk_status dsk_par_embedding_backward(dsk_comm *tp, dsk_ctx *ctx, dsk_tensor *dtable, const dsk_tensor *dout,
                                              dsk_tensor *dg, const dsk_tensor *ids);
/* logits (N, Vl): columns [r Vl, (r+1) Vl) of the full logits; targets (N) i32 in [0, Vl tp)
   or ignore_index. loss (scalar f32) and dlogits ((N, Vl) or NULL) as dsk_cross_entropy
   gives them for the full logits. CPU tensors on the host backend, CUDA tensors on nccl
   (kernels/par.cu; target ranges are checked on the CPU path only). Collective over tp
   (every rank, same targets). */
DSK_API dsk_status dsk_par_cross_entropy(dsk_comm *tp, dsk_ctx *ctx, dsk_tensor *loss, dsk_tensor *dlogits,
                                         const dsk_tensor *logits, const dsk_tensor *targets, int32_t ignore_index,
                                         float grad_scale);

/* The per-element math of dsk_par_cross_entropy, shared by its CPU path and kernels/par.cu:
   log-sum-exp from the row max and the summed exp(x - max); the gradient of one logit. */
static inline DSK_HD double dsk_par_ce_lse(float mx, double sum_exp) { return (double)mx + log(sum_exp); }
static inline DSK_HD float dsk_par_ce_grad(float x, double lse, int is_target, float grad_scale, int64_t count) {
    double p = exp((double)x - lse) - (is_target ? 1.0 : 0.0);
    return (float)((double)grad_scale * p / (double)count);
}

/* ---- pipeline schedules */

typedef enum dsk_par_schedule_kind {
    DSK_PAR_GPIPE = 0,
    DSK_PAR_1F1B,
    DSK_PAR_INTERLEAVED,
    DSK_PAR_DUALPIPE_V /* DeepSeek's DualPipeV: two chunks a rank in a V, stage r and 2 p - 1 - r */
} dsk_par_schedule_kind;

typedef enum dsk_par_action_kind {
    DSK_PAR_FORWARD = 0,
    DSK_PAR_BACKWARD,
    DSK_PAR_SEND_ACT,        /* the output activation of (micro, chunk) to the next stage's rank */
    DSK_PAR_RECV_ACT,        /* the input activation of (micro, chunk) from the previous stage's rank */
    DSK_PAR_SEND_GRAD,       /* the input gradient of (micro, chunk) to the previous stage's rank */
    DSK_PAR_RECV_GRAD,       /* the output gradient of (micro, chunk) from the next stage's rank */
    DSK_PAR_FORWARD_BACKWARD /* paired schedules: the forward of (micro, chunk) and the backward of
                                (bwd_micro, bwd_chunk), another micro-batch, as one computation */
} dsk_par_action_kind;

typedef struct dsk_par_action {
    dsk_par_action_kind kind;
    int micro; /* micro-batch, 0 .. m-1 */
    int chunk; /* this rank's chunk, 0 .. v-1 */
    int stage; /* its global stage: dsk_par_stage(kind, p, chunk, rank) */
    int peer;  /* pipeline rank sent to / received from; -1 for computations */
    int bwd_micro, bwd_chunk, bwd_stage; /* FORWARD_BACKWARD's backward; -1 otherwise */
} dsk_par_action;

typedef struct dsk_par_schedule {
    dsk_par_schedule_kind kind;
    int stages, micro, chunks, rank; /* p, m, v, r */
    int n;                           /* actions */
    dsk_par_action *actions;         /* owned */
    int paired;                      /* built by dsk_par_schedule_init_paired */
    int in_flight;                   /* dsk_par_in_flight_bound for this rank (+1 paired) */
    double bubble;                   /* dsk_par_bubble_fraction */
} dsk_par_schedule;

/* Rank `rank`'s action list for p stages, m micro-batches, v chunks (v must be 1 for GPipe
   and 1F1B; m a multiple of p for the interleaved schedule with v > 1). */
DSK_API dsk_status dsk_par_schedule_init(dsk_par_schedule *s, dsk_par_schedule_kind kind, int stages, int micro,
                                         int chunks, int rank);
/* The same schedule with each steady-state forward and backward of two different micro-batches
   paired into one FORWARD_BACKWARD action, so that the model can interleave them (one micro-batch's
   expert exchange in flight while the other computes): one more warm-up forward per rank (the
   last stage's backward k pairs with forward k + 1), so one more micro-batch chunk in flight. The
   forwards and the backwards keep their order: gradients accumulate as in the unpaired schedule. */
DSK_API dsk_status dsk_par_schedule_init_paired(dsk_par_schedule *s, dsk_par_schedule_kind kind, int stages, int micro,
                                                int chunks, int rank);
DSK_API void dsk_par_schedule_free(dsk_par_schedule *s); /* zeroed/freed ok */
/* (p - 1) / m for GPipe and 1F1B, (p - 1) / (v m) for the interleaved schedule and DualPipeV (v = 2). */
DSK_API double dsk_par_bubble_fraction(dsk_par_schedule_kind kind, int stages, int micro, int chunks);
/* How the transfers of a pipeline run meet (the header's "Executed" and "Timed"). */
typedef enum dsk_par_transfers {
    DSK_PAR_TRANSFERS_IN_ORDER = 0, /* each rank's sends and receives in its list's order, a send meeting its
                                       receive, then both taking link_s (nccl: ordered on the stream) */
    DSK_PAR_TRANSFERS_AHEAD         /* a send leaves at once and lands link_s later; a computation waits for its
                                       input's message (the host backend, messages within its buffers) */
} dsk_par_transfers;
/* The time of a step under a schedule whose stages take different times: every rank runs its list
   (dsk_par_schedule_init's, paired: _paired's) as dsk_par_pipeline_run does on a transport whose transfers meet
   as `transfers` says, the forward and the backward of global stage s = c p + r (c < v) taking fwd_s[s] and
   bwd_s[s] seconds a micro-batch (a pair their sum), each message link_s. *step_s: when the last rank ends, the
   bubble included (equal stages, f + b a micro-batch and no link: the formula's (1 + bubble) m v (f + b)). */
DSK_API dsk_status dsk_par_schedule_time(dsk_par_schedule_kind kind, int stages, int micro, int chunks, int paired,
                                         dsk_par_transfers transfers, const double *fwd_s, const double *bwd_s,
                                         double link_s, double *step_s);
/* The most micro-batch chunks rank `rank` holds activations of (formulas at the top). */
DSK_API int dsk_par_in_flight_bound(dsk_par_schedule_kind kind, int stages, int micro, int chunks, int rank);
DSK_API const char *dsk_par_schedule_name(dsk_par_schedule_kind kind); /* "gpipe", "1f1b", "interleaved", "dualpipev" */
/* "gpipe", "1f1b", "interleaved" or "dualpipev" into *kind; DSK_ERR_ARG otherwise. */
DSK_API dsk_status dsk_par_schedule_parse(const char *name, dsk_par_schedule_kind *kind);
DSK_API const char *dsk_par_action_name(dsk_par_action_kind kind); /* "forward", "send activation", ... */
/* The global stage of chunk `chunk` on pipeline rank `rank` of `stages` (c p + r; DualPipeV's chunk 1: 2 p - 1 - r),
   and the pipeline rank holding global stage `stage`; -1 for an unknown kind, stages < 1, a rank outside [0, stages),
   a negative chunk or stage, or DualPipeV's past its 2 chunks and 2 p stages. */
DSK_API int dsk_par_stage(dsk_par_schedule_kind kind, int stages, int chunk, int rank);
DSK_API int dsk_par_stage_rank(dsk_par_schedule_kind kind, int stages, int stage);

/* ---- the pipeline executor */

/* The model side of a pipeline run. Every callback returns DSK_OK or an error with its message. */
typedef struct dsk_par_stage_fns {
    void *user;
    dsk_status (*forward)(void *user, int micro, int chunk);
    dsk_status (*backward)(void *user, int micro, int chunk);
    /* The contiguous buffer action a (a send or receive) reads or fills: CPU memory on the host
       backend, device memory on nccl. Both ends must give the same count and dtype. A receive's
       buffer is filled by the time the computation of its micro-batch and chunk starts, so no action
       before that may use it; each (micro-batch, chunk) needs its own. */
    dsk_status (*buffer)(void *user, const dsk_par_action *a, dsk_tensor *t);
    /* A paired schedule's FORWARD_BACKWARD; NULL: forward, then backward. */
    dsk_status (*forward_backward)(void *user, int micro, int chunk, int bwd_micro, int bwd_chunk);
} dsk_par_stage_fns;

/* Runs s's actions in order on pp (the pipeline group: pp->rank == s->rank, pp->world_size ==
   s->stages). A send returns once its message is out (dsk_comm_send); a receive whose message fits the
   transport's buffers (dsk_comm_buffered_bytes: its sender does not wait for it) is begun where the list
   has it (dsk_comm_recv_start) and finished just before the computation that reads it, or before an
   earlier computation once it is moving (dsk_comm_test); a larger one, whose sender waits for it, is
   taken where the list has it (as the lists' rendezvous order places it, nccl's every one); none is
   pending when the run returns DSK_OK. An error stops the run and names the action,
   the micro-batch, the chunk and the peer, after the cause (a dead peer is named by the
   communicator's message); the communicator is then unusable as after any dsk_comm error. */
DSK_API dsk_status dsk_par_pipeline_run(const dsk_par_schedule *s, dsk_comm *pp, dsk_ctx *ctx,
                                        const dsk_par_stage_fns *fns);

/* ---------------------------------------------------------------- CUDA launchers
   The C entry points of kernels/par.cu, with the contracts of dsk_tensor.h's CUDA launchers. */
#if defined(DSK_CUDA) || defined(__CUDACC__) /* a CUDA build, or nvcc compiling the kernels */
/* ---- par (kernels/par.cu): dsk_par_cross_entropy's passes on logits (R, Vl), columns
   [lo, lo + Vl) of the full vocabulary, around its two all-reduces. */
/* mx (R) f32 = row max over this rank's columns; *count (device i64) = targets != ignore_index. */
dsk_status dsk_cuda_par_ce_max(dsk_ctx *ctx, float *mx, int64_t *count, const dsk_tensor *logits,
                               const dsk_tensor *targets, int32_t ignore_index);
/* acc (2R) f64: per row the sum of exp(x - mx) and the target's logit if this rank holds it (0 if not, or ignored). */
dsk_status dsk_cuda_par_ce_sums(dsk_ctx *ctx, double *acc, const float *mx, const dsk_tensor *logits,
                                const dsk_tensor *targets, int64_t lo, int32_t ignore_index);
/* From the all-reduced mx and acc: loss (device scalar f32) and dlogits (or NULL) as dsk_par_cross_entropy. */
dsk_status dsk_cuda_par_ce_finish(dsk_ctx *ctx, dsk_tensor *loss, dsk_tensor *dlogits, const float *mx,
                                  const double *acc, const int64_t *count, const dsk_tensor *logits,
                                  const dsk_tensor *targets, int64_t lo, int32_t ignore_index, float grad_scale);
#endif

#ifdef __cplusplus
}
#endif
DSK__FP_EXACT_END
#endif /* DSK_PAR_H */

/* ==================================================================== implementation */
#ifdef DSK_PAR_IMPLEMENTATION
#ifndef DSK_PAR_IMPLEMENTATION_DONE
#define DSK_PAR_IMPLEMENTATION_DONE
DSK__FP_EXACT_BEGIN

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- checks and helpers */

static int dsk__par_n(const dsk_comm *tp) { return tp && tp->world_size > 1 ? tp->world_size : 1; }
static int dsk__par_r(const dsk_comm *tp) { return tp && tp->world_size > 1 ? tp->rank : 0; }

static dsk_status dsk__par_need_tensor(const char *fn, const char *name, const dsk_tensor *t) {
    char d[96];
    if (!t || !t->data) return dsk_set_error(DSK_ERR_ARG, "%s: tensor %s is NULL or empty", fn, name);
    if (!dsk_tensor_is_contiguous(t))
        return dsk_set_error(DSK_ERR_ARG, "%s: tensor %s %s is not contiguous", fn, name,
                             dsk_tensor_describe(t, d, sizeof d));
    return DSK_OK;
}

/* A contiguous 2-D float tensor of shape (rows, cols); a negative size is not checked. */
static dsk_status dsk__par_need_2d(const char *fn, const char *name, const dsk_tensor *t, int64_t rows,
                                   int64_t cols) {
    char d[96];
    DSK__TRY(dsk__par_need_tensor(fn, name, t));
    if (t->ndim != 2 || !dsk_dtype_is_float(t->dtype) || (rows >= 0 && t->shape[0] != rows) ||
        (cols >= 0 && t->shape[1] != cols))
        return dsk_set_error(DSK_ERR_ARG, "%s: %s is %s, want a float (%lld, %lld) matrix (-1: any)", fn, name,
                             dsk_tensor_describe(t, d, sizeof d), (long long)rows, (long long)cols);
    return DSK_OK;
}

static dsk_status dsk__par_need_same_dtype(const char *fn, const char *a, const dsk_tensor *x, const char *b,
                                           const dsk_tensor *y) {
    if (x->dtype != y->dtype || x->device.type != y->device.type || x->device.index != y->device.index)
        return dsk_set_error(DSK_ERR_ARG, "%s: %s (%s) and %s (%s) differ in dtype or device", fn, a,
                             dsk_dtype_name(x->dtype), b, dsk_dtype_name(y->dtype));
    return DSK_OK;
}

/* Tensors on the CPU travel over the host backend, CUDA tensors over nccl (tp of one rank: any). */
static dsk_status dsk__par_need_backend(const char *fn, const dsk_comm *tp, const char *name, const dsk_tensor *t) {
    int cuda = t->device.type == DSK_DEV_CUDA;
    if (dsk__par_n(tp) == 1 || cuda == (tp->backend == DSK_COMM_NCCL)) return DSK_OK;
    return dsk_set_error(DSK_ERR_ARG, "%s: %s is on %s but the tensor-parallel communicator uses the %s backend", fn,
                         name, cuda ? "a CUDA device" : "the CPU", tp->backend == DSK_COMM_NCCL ? "nccl" : "host");
}

/* A tensor on a device this build runs: a CUDA one needs DSK_CUDA. */
static dsk_status dsk__par_need_build(const char *fn, const char *name, const dsk_tensor *t) {
#ifndef DSK_CUDA
    char d[96];
    if (t->device.type == DSK_DEV_CUDA)
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: %s %s on a CUDA device in a build without DSK_CUDA", fn, name,
                             dsk_tensor_describe(t, d, sizeof d));
#endif
    (void)fn;
    (void)name;
    (void)t;
    return DSK_OK;
}

/* A contiguous temporary like `like` with shape sh (on like's device). */
static dsk_status dsk__par_temp(dsk_ctx *ctx, const dsk_tensor *like, dsk_tensor *t, dsk_dtype dt, int ndim,
                                const int64_t *sh) {
    return dsk_tensor_alloc_on(ctx, like->device, t, dt, ndim, sh);
}

/* ---------------------------------------------------------------- the rank grid */

DSK_API dsk_status dsk_par_dims_resolve(dsk_par_dims *d, int world_size) {
    const char *fn = "dsk_par_dims_resolve";
    if (!d) return dsk_set_error(DSK_ERR_ARG, "%s: dims is NULL", fn);
    if (world_size < 1) return dsk_set_error(DSK_ERR_ARG, "%s: world size %d", fn, world_size);
    if (d->tp == 0) d->tp = 1;
    if (d->pp == 0) d->pp = 1;
    if (d->ep == 0) d->ep = 1;
    if (d->tp < 0 || d->pp < 0 || d->ep < 0 || d->dp < 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: negative size (tp %d, dp %d, pp %d, ep %d)", fn, d->tp, d->dp, d->pp,
                             d->ep);
    if (d->dp == 0) {
        if (world_size % (d->tp * d->pp) != 0)
            return dsk_set_error(DSK_ERR_ARG, "%s: tp %d x pp %d = %d does not divide the world size %d", fn, d->tp,
                                 d->pp, d->tp * d->pp, world_size);
        d->dp = world_size / (d->tp * d->pp);
    }
    if ((int64_t)d->tp * d->dp * d->pp != world_size)
        return dsk_set_error(DSK_ERR_ARG, "%s: tp %d x dp %d x pp %d = %lld ranks, the world has %d", fn, d->tp, d->dp,
                             d->pp, (long long)d->tp * d->dp * d->pp, world_size);
    if (d->dp % d->ep != 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: ep %d does not divide dp %d (expert parallelism splits the "
                             "data-parallel ranks)", fn, d->ep, d->dp);
    return DSK_OK;
}

DSK_API dsk_status dsk_par_coords_of(const dsk_par_dims *d, int rank, dsk_par_coords *at) {
    if (!d || !at || d->tp < 1 || d->dp < 1 || d->pp < 1 || d->ep < 1)
        return dsk_set_error(DSK_ERR_ARG, "dsk_par_coords_of: dims NULL or not resolved");
    if (rank < 0 || rank >= d->tp * d->dp * d->pp)
        return dsk_set_error(DSK_ERR_ARG, "dsk_par_coords_of: rank %d outside [0, %d)", rank,
                             d->tp * d->dp * d->pp);
    at->tp = rank % d->tp;
    at->dp = rank / d->tp % d->dp;
    at->pp = rank / (d->tp * d->dp);
    at->ep = at->dp % d->ep;
    at->edp = at->dp / d->ep;
    return DSK_OK;
}

DSK_API int dsk_par_rank_of(const dsk_par_dims *d, int tp_i, int dp_i, int pp_i) {
    if (!d || tp_i < 0 || tp_i >= d->tp || dp_i < 0 || dp_i >= d->dp || pp_i < 0 || pp_i >= d->pp) return -1;
    return tp_i + d->tp * (dp_i + d->dp * pp_i);
}

DSK_API void dsk_par_grid_free(dsk_par_grid *g) {
    if (!g) return;
    dsk_comm_free(&g->edp);
    dsk_comm_free(&g->ep);
    dsk_comm_free(&g->pp);
    dsk_comm_free(&g->dp);
    dsk_comm_free(&g->tp);
    memset(g, 0, sizeof *g);
}

DSK_API dsk_status dsk_par_grid_init(dsk_par_grid *g, dsk_comm *world, const dsk_par_dims *dims) {
    const char *fn = "dsk_par_grid_init";
    dsk_par_dims d;
    dsk_par_coords a;
    dsk_status st;
    if (!g || !world || !world->impl) return dsk_set_error(DSK_ERR_ARG, "%s: grid or world communicator is NULL", fn);
    memset(g, 0, sizeof *g);
    memset(&d, 0, sizeof d);
    if (dims) d = *dims;
    DSK__TRY(dsk_par_dims_resolve(&d, world->world_size));
    DSK__TRY(dsk_par_coords_of(&d, world->rank, &a));
    g->dims = d;
    g->rank = world->rank;
    g->world_size = world->world_size;
    g->at = a;
    /* colors enumerate the other coordinates; keys order each group by its own coordinate */
    st = dsk_comm_split(world, a.dp + d.dp * a.pp, a.tp, &g->tp);
    if (st == DSK_OK) st = dsk_comm_split(world, a.tp + d.tp * a.pp, a.dp, &g->dp);
    if (st == DSK_OK) st = dsk_comm_split(world, a.tp + d.tp * a.dp, a.pp, &g->pp);
    if (st == DSK_OK) st = dsk_comm_split(world, a.tp + d.tp * (a.edp + (d.dp / d.ep) * a.pp), a.ep, &g->ep);
    if (st == DSK_OK) st = dsk_comm_split(world, a.tp + d.tp * (a.ep + d.ep * a.pp), a.edp, &g->edp);
    if (st != DSK_OK) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", dsk_last_error());
        dsk_par_grid_free(g);
        return dsk_set_error(st, "%s: rank %d (tp %d, dp %d, pp %d): %s", fn, world->rank, a.tp, a.dp, a.pp, msg);
    }
    return DSK_OK;
}

/* ---------------------------------------------------------------- mappings */

DSK_API const char *dsk_par_map_name(dsk_par_map map) {
    static const char *names[] = {"copy", "reduce", "gather", "scatter", "split"};
    return (int)map >= 0 && (int)map <= (int)DSK_PAR_MAP_SPLIT ? names[map] : "invalid";
}

/* Outer (product of dims before dim), extent of dim, inner (product after). */
static void dsk__par_dim_split(const dsk_tensor *t, int dim, int64_t *outer, int64_t *len, int64_t *inner) {
    *outer = 1;
    *inner = 1;
    for (int i = 0; i < dim; i++) *outer *= t->shape[i];
    for (int i = dim + 1; i < t->ndim; i++) *inner *= t->shape[i];
    *len = t->shape[dim];
}

/* `big` has `small`'s shape except along dim, where it is n times longer. */
static dsk_status dsk__par_need_blocks(const char *fn, const char *bn, const dsk_tensor *big, const char *sn,
                                       const dsk_tensor *small, int dim, int n) {
    char a[96], b[96];
    int ok = big->ndim == small->ndim && dim >= 0 && dim < big->ndim;
    for (int i = 0; ok && i < big->ndim; i++) ok = big->shape[i] == small->shape[i] * (i == dim ? n : 1);
    if (!ok)
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %s must be %s %s with dim %d times %d", fn, bn,
                             dsk_tensor_describe(big, a, sizeof a), sn, dsk_tensor_describe(small, b, sizeof b), dim,
                             n);
    return DSK_OK;
}

/* Block b of `big` along dim (a strided view) */
static dsk_status dsk__par_block(const dsk_tensor *big, int dim, int64_t len, int b, dsk_tensor *v) {
    return dsk_tensor_slice(big, dim, (int64_t)b * len, len, v);
}

/* big (.., n len, ..) <- all-gather along dim of small (.., len, ..). */
static dsk_status dsk__par_all_gather_dim(dsk_comm *tp, dsk_ctx *ctx, dsk_tensor *big, const dsk_tensor *small,
                                          int dim) {
    int n = dsk__par_n(tp);
    int64_t outer, len, inner, sh[DSK_MAX_DIMS + 1];
    dsk_tensor tmp, blk, src;
    dsk_status st = DSK_OK;
    dsk__par_dim_split(small, dim, &outer, &len, &inner);
    if (n == 1) return dsk_tensor_copy(ctx, big, small);
    if (outer == 1)
        return dsk_comm_all_gather(tp, ctx, small->data, big->data, dsk_tensor_numel(small), small->dtype);
    sh[0] = n;
    for (int i = 0; i < small->ndim; i++) sh[i + 1] = small->shape[i];
    DSK__TRY(dsk__par_temp(ctx, small, &tmp, small->dtype, small->ndim + 1, sh));
    st = dsk_comm_all_gather(tp, ctx, small->data, tmp.data, dsk_tensor_numel(small), small->dtype);
    for (int b = 0; st == DSK_OK && b < n; b++) {
        st = dsk_tensor_select(&tmp, b, &src);
        if (st == DSK_OK) st = dsk__par_block(big, dim, len, b, &blk);
        if (st == DSK_OK) st = dsk_tensor_copy(ctx, &blk, &src);
    }
    dsk_tensor_free(ctx, &tmp);
    return st;
}

/* small (.., len, ..) <- block `rank` of the sum over ranks of big (.., n len, ..) along dim. */
static dsk_status dsk__par_reduce_scatter_dim(dsk_comm *tp, dsk_ctx *ctx, dsk_tensor *small, const dsk_tensor *big,
                                              int dim) {
    int n = dsk__par_n(tp);
    int64_t outer, len, inner, sh[DSK_MAX_DIMS + 1];
    dsk_tensor tmp, blk, dst;
    dsk_status st = DSK_OK;
    dsk__par_dim_split(small, dim, &outer, &len, &inner);
    if (n == 1) return dsk_tensor_copy(ctx, small, big);
    if (outer == 1)
        return dsk_comm_reduce_scatter(tp, ctx, big->data, small->data, dsk_tensor_numel(small), small->dtype,
                                       DSK_COMM_SUM);
    sh[0] = n;
    for (int i = 0; i < small->ndim; i++) sh[i + 1] = small->shape[i];
    DSK__TRY(dsk__par_temp(ctx, small, &tmp, small->dtype, small->ndim + 1, sh));
    for (int b = 0; st == DSK_OK && b < n; b++) {
        st = dsk_tensor_select(&tmp, b, &dst);
        if (st == DSK_OK) st = dsk__par_block(big, dim, len, b, &blk);
        if (st == DSK_OK) st = dsk_tensor_copy(ctx, &dst, &blk);
    }
    if (st == DSK_OK)
        st = dsk_comm_reduce_scatter(tp, ctx, tmp.data, small->data, dsk_tensor_numel(small), small->dtype,
                                     DSK_COMM_SUM);
    dsk_tensor_free(ctx, &tmp);
    return st;
}

/* dst <- src, or the in-place all-reduce of dst after it. */
static dsk_status dsk__par_all_reduce_into(dsk_comm *tp, dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src) {
    if (dst->data != src->data) DSK__TRY(dsk_tensor_copy(ctx, dst, src));
    if (dsk__par_n(tp) == 1) return DSK_OK;
    return dsk_comm_all_reduce(tp, ctx, dst->data, dst->data, dsk_tensor_numel(dst), dst->dtype, DSK_COMM_SUM);
}

static dsk_status dsk__par_map_check(const char *fn, dsk_comm *tp, dsk_par_map map, int dim, const dsk_tensor *big,
                                     const char *bn, const dsk_tensor *small, const char *sn) {
    char a[96], b[96];
    if ((int)map < 0 || (int)map > (int)DSK_PAR_MAP_SPLIT)
        return dsk_set_error(DSK_ERR_ARG, "%s: unknown mapping %d", fn, (int)map);
    DSK__TRY(dsk__par_need_tensor(fn, bn, big));
    DSK__TRY(dsk__par_need_tensor(fn, sn, small));
    DSK__TRY(dsk__par_need_same_dtype(fn, bn, big, sn, small));
    DSK__TRY(dsk__par_need_backend(fn, tp, bn, big));
    if (map == DSK_PAR_MAP_COPY || map == DSK_PAR_MAP_REDUCE) {
        if (!dsk_tensor_same_shape(big, small))
            return dsk_set_error(DSK_ERR_ARG, "%s: %s mapping: %s %s and %s %s differ in shape", fn,
                                 dsk_par_map_name(map), bn, dsk_tensor_describe(big, a, sizeof a), sn,
                                 dsk_tensor_describe(small, b, sizeof b));
        return DSK_OK;
    }
    if (dim < 0 || dim >= small->ndim)
        return dsk_set_error(DSK_ERR_ARG, "%s: %s mapping: dim %d outside [0, %d)", fn, dsk_par_map_name(map), dim,
                             small->ndim);
    return dsk__par_need_blocks(fn, bn, big, sn, small, dim, dsk__par_n(tp));
}

DSK_API dsk_status dsk_par_map_forward(dsk_comm *tp, dsk_ctx *ctx, dsk_par_map map, int dim, dsk_tensor *out,
                                       const dsk_tensor *in) {
    const char *fn = "dsk_par_map_forward";
    dsk_tensor blk;
    int gather = map == DSK_PAR_MAP_GATHER;
    /* the full-size side: out for GATHER, in for SCATTER/SPLIT, either for COPY/REDUCE */
    DSK__TRY(dsk__par_map_check(fn, tp, map, dim, gather ? out : in, gather ? "out" : "in", gather ? in : out,
                                gather ? "in" : "out"));
    switch (map) {
    case DSK_PAR_MAP_COPY: return out->data == in->data ? DSK_OK : dsk_tensor_copy(ctx, out, in);
    case DSK_PAR_MAP_REDUCE: return dsk__par_all_reduce_into(tp, ctx, out, in);
    case DSK_PAR_MAP_GATHER: return dsk__par_all_gather_dim(tp, ctx, out, in, dim);
    case DSK_PAR_MAP_SCATTER: return dsk__par_reduce_scatter_dim(tp, ctx, out, in, dim);
    default:
        DSK__TRY(dsk__par_block(in, dim, out->shape[dim], dsk__par_r(tp), &blk));
        return dsk_tensor_copy(ctx, out, &blk);
    }
}

DSK_API dsk_status dsk_par_map_backward(dsk_comm *tp, dsk_ctx *ctx, dsk_par_map map, int dim, dsk_tensor *din,
                                        const dsk_tensor *dout) {
    const char *fn = "dsk_par_map_backward";
    int gather = map == DSK_PAR_MAP_GATHER;
    /* din has in's shape: the full-size side is dout for GATHER, din for SCATTER/SPLIT */
    DSK__TRY(dsk__par_map_check(fn, tp, map, dim, gather ? dout : din, gather ? "dout" : "din", gather ? din : dout,
                                gather ? "din" : "dout"));
    switch (map) {
    case DSK_PAR_MAP_COPY: return dsk__par_all_reduce_into(tp, ctx, din, dout);
    case DSK_PAR_MAP_REDUCE: return din->data == dout->data ? DSK_OK : dsk_tensor_copy(ctx, din, dout);
    case DSK_PAR_MAP_GATHER: return dsk__par_reduce_scatter_dim(tp, ctx, din, dout, dim);
    default: return dsk__par_all_gather_dim(tp, ctx, din, dout, dim);
    }
}

/* ---------------------------------------------------------------- parallel linears */

/* X (rows, K) full or, with scratch xg, (rows / n, K) gathered into xg (rows, K). */
static dsk_status dsk__par_gathered(const char *fn, dsk_comm *tp, const dsk_tensor *X, const dsk_tensor *xg,
                                    const char *xn, const char *gn) {
    int n = dsk__par_n(tp);
    DSK__TRY(dsk__par_need_2d(fn, xn, X, -1, -1));
    DSK__TRY(dsk__par_need_backend(fn, tp, xn, X));
    if (!xg) return DSK_OK;
    DSK__TRY(dsk__par_need_2d(fn, gn, xg, X->shape[0] * n, X->shape[1]));
    return dsk__par_need_same_dtype(fn, xn, X, gn, xg);
}

DSK_API dsk_status dsk_par_column_forward(dsk_comm *tp, dsk_ctx *ctx, int n, dsk_tensor *const *Y,
                                          const dsk_tensor *const *W, const dsk_tensor *X, dsk_tensor *xg) {
    const char *fn = "dsk_par_column_forward";
    const dsk_tensor *Xf;
    if (n < 1 || !Y || !W) return dsk_set_error(DSK_ERR_ARG, "%s: %d weights (need at least one)", fn, n);
    DSK__TRY(dsk__par_gathered(fn, tp, X, xg, "X", "xg"));
    Xf = xg ? xg : X;
    for (int i = 0; i < n; i++) {
        char wn[16], yn[16];
        snprintf(wn, sizeof wn, "W[%d]", i);
        snprintf(yn, sizeof yn, "Y[%d]", i);
        DSK__TRY(dsk__par_need_2d(fn, wn, W[i], -1, Xf->shape[1]));
        DSK__TRY(dsk__par_need_2d(fn, yn, Y[i], Xf->shape[0], W[i]->shape[0]));
    }
    if (xg) DSK__TRY(dsk__par_all_gather_dim(tp, ctx, xg, X, 0));
    for (int i = 0; i < n; i++) DSK__TRY(dsk_matmul(ctx, Y[i], Xf, 0, W[i], 1, 1.0f, 0.0f));
    return DSK_OK;
}

DSK_API dsk_status dsk_par_column_backward(dsk_comm *tp, dsk_ctx *ctx, int n, dsk_tensor *dX, dsk_tensor *dxg,
                                           dsk_tensor *const *dW, const dsk_tensor *const *dY,
                                           const dsk_tensor *const *W, const dsk_tensor *Xf) {
    const char *fn = "dsk_par_column_backward";
    dsk_tensor *acc;
    if (n < 1 || !dY || !W) return dsk_set_error(DSK_ERR_ARG, "%s: %d weights (need at least one)", fn, n);
    DSK__TRY(dsk__par_need_2d(fn, "Xf", Xf, -1, -1));
    DSK__TRY(dsk__par_gathered(fn, tp, dX, dxg, "dX", "dxg"));
    acc = dxg ? dxg : dX;
    DSK__TRY(dsk__par_need_2d(fn, dxg ? "dxg" : "dX", acc, Xf->shape[0], Xf->shape[1]));
    for (int i = 0; i < n; i++) {
        char wn[16], yn[16], gn[16];
        snprintf(wn, sizeof wn, "W[%d]", i);
        snprintf(yn, sizeof yn, "dY[%d]", i);
        snprintf(gn, sizeof gn, "dW[%d]", i);
        DSK__TRY(dsk__par_need_2d(fn, wn, W[i], -1, Xf->shape[1]));
        DSK__TRY(dsk__par_need_2d(fn, yn, dY[i], Xf->shape[0], W[i]->shape[0]));
        if (dW && dW[i]) DSK__TRY(dsk__par_need_2d(fn, gn, dW[i], W[i]->shape[0], W[i]->shape[1]));
    }
    for (int i = 0; i < n; i++) {
        if (dW && dW[i]) DSK__TRY(dsk_matmul(ctx, dW[i], dY[i], 1, Xf, 0, 1.0f, 1.0f));
        DSK__TRY(dsk_matmul(ctx, acc, dY[i], 0, W[i], 0, 1.0f, i ? 1.0f : 0.0f));
    }
    if (dxg) return dsk__par_reduce_scatter_dim(tp, ctx, dX, dxg, 0);
    return dsk__par_all_reduce_into(tp, ctx, dX, dX);
}

DSK_API dsk_status dsk_par_row_forward(dsk_comm *tp, dsk_ctx *ctx, dsk_tensor *Y, dsk_tensor *yp, const dsk_tensor *X,
                                       const dsk_tensor *W) {
    const char *fn = "dsk_par_row_forward";
    dsk_tensor *part;
    DSK__TRY(dsk__par_need_2d(fn, "X", X, -1, -1));
    DSK__TRY(dsk__par_need_2d(fn, "W", W, -1, X->shape[1]));
    DSK__TRY(dsk__par_gathered(fn, tp, Y, yp, "Y", "yp"));
    part = yp ? yp : Y;
    DSK__TRY(dsk__par_need_2d(fn, yp ? "yp" : "Y", part, X->shape[0], W->shape[0]));
    DSK__TRY(dsk_matmul(ctx, part, X, 0, W, 1, 1.0f, 0.0f));
    if (yp) return dsk__par_reduce_scatter_dim(tp, ctx, Y, yp, 0);
    return dsk__par_all_reduce_into(tp, ctx, Y, Y);
}

DSK_API dsk_status dsk_par_row_backward(dsk_comm *tp, dsk_ctx *ctx, dsk_tensor *dX, dsk_tensor *dW,
                                        const dsk_tensor *dY, dsk_tensor *dyg, const dsk_tensor *X,
                                        const dsk_tensor *W) {
    const char *fn = "dsk_par_row_backward";
    const dsk_tensor *dYf;
    DSK__TRY(dsk__par_need_2d(fn, "X", X, -1, -1));
    DSK__TRY(dsk__par_need_2d(fn, "W", W, -1, X->shape[1]));
    DSK__TRY(dsk__par_gathered(fn, tp, dY, dyg, "dY", "dyg"));
    dYf = dyg ? dyg : dY;
    DSK__TRY(dsk__par_need_2d(fn, dyg ? "dyg" : "dY", dYf, X->shape[0], W->shape[0]));
    DSK__TRY(dsk__par_need_2d(fn, "dX", dX, X->shape[0], X->shape[1]));
    if (dW) DSK__TRY(dsk__par_need_2d(fn, "dW", dW, W->shape[0], W->shape[1]));
    if (dyg) DSK__TRY(dsk__par_all_gather_dim(tp, ctx, dyg, dY, 0));
    if (dW) DSK__TRY(dsk_matmul(ctx, dW, dYf, 1, X, 0, 1.0f, 1.0f));
    return dsk_matmul(ctx, dX, dYf, 0, W, 0, 1.0f, 0.0f);
}

/* ---------------------------------------------------------------- vocabulary-parallel embedding */

/* The tokens whose id falls in this rank's rows [lo, lo + Vl): their positions and local rows,
   as i32 tensors on `dev` (*k = how many; the tensors are left empty when k = 0). */
typedef struct dsk__par_hits {
    int64_t k;
    dsk_tensor tok, row;
} dsk__par_hits;

static void dsk__par_hits_free(dsk_ctx *ctx, dsk__par_hits *h) {
    dsk_tensor_free(ctx, &h->tok);
    dsk_tensor_free(ctx, &h->row);
}

static dsk_status dsk__par_hits_find(const char *fn, dsk_ctx *ctx, const dsk_tensor *ids, int64_t lo, int64_t vl,
                                     int64_t v_full, dsk_device dev, dsk__par_hits *h) {
    int64_t n = dsk_tensor_numel(ids), k = 0;
    dsk_tensor host, ht, hr;
    const int32_t *id;
    int32_t *tok, *row;
    dsk_status st = DSK_OK;
    memset(h, 0, sizeof *h);
    memset(&host, 0, sizeof host);
    if (ids->device.type == DSK_DEV_CPU) host = *ids;
    else {
        DSK__TRY(dsk_tensor_alloc_on(ctx, dsk_cpu(), &host, DSK_I32, 1, &n));
        if ((st = dsk_tensor_copy(ctx, &host, ids)) != DSK_OK) goto done;
    }
    id = (const int32_t *)host.data;
    for (int64_t t = 0; t < n; t++) {
        if (id[t] < 0 || id[t] >= v_full) {
            st = dsk_set_error(DSK_ERR_ARG, "%s: ids[%lld] = %d outside the vocabulary [0, %lld)", fn, (long long)t,
                               (int)id[t], (long long)v_full);
            goto done;
        }
        k += id[t] >= lo && id[t] < lo + vl;
    }
    h->k = k;
    if (k == 0) goto done;
    if ((st = dsk_tensor_alloc_on(ctx, dsk_cpu(), &ht, DSK_I32, 1, &k)) != DSK_OK) goto done;
    if ((st = dsk_tensor_alloc_on(ctx, dsk_cpu(), &hr, DSK_I32, 1, &k)) != DSK_OK) {
        dsk_tensor_free(ctx, &ht);
        goto done;
    }
    tok = (int32_t *)ht.data;
    row = (int32_t *)hr.data;
    for (int64_t t = 0, j = 0; t < n; t++)
        if (id[t] >= lo && id[t] < lo + vl) { tok[j] = (int32_t)t; row[j] = (int32_t)(id[t] - lo); j++; }
    if (dev.type == DSK_DEV_CPU) { h->tok = ht; h->row = hr; goto done; }
    st = dsk_tensor_alloc_on(ctx, dev, &h->tok, DSK_I32, 1, &k);
    if (st == DSK_OK) st = dsk_tensor_alloc_on(ctx, dev, &h->row, DSK_I32, 1, &k);
    if (st == DSK_OK) st = dsk_tensor_copy(ctx, &h->tok, &ht);
    if (st == DSK_OK) st = dsk_tensor_copy(ctx, &h->row, &hr);
    dsk_tensor_free(ctx, &ht);
    dsk_tensor_free(ctx, &hr);
done:
    if (host.data != ids->data) dsk_tensor_free(ctx, &host);
    if (st != DSK_OK) dsk__par_hits_free(ctx, h);
    return st;
}

static dsk_status dsk__par_need_ids(const char *fn, const dsk_tensor *ids, int64_t rows) {
    char d[96];
    DSK__TRY(dsk__par_need_tensor(fn, "ids", ids));
    if (ids->dtype != DSK_I32 || dsk_tensor_numel(ids) != rows)
        return dsk_set_error(DSK_ERR_ARG, "%s: ids %s must be %lld i32 values", fn,
                             dsk_tensor_describe(ids, d, sizeof d), (long long)rows);
    return DSK_OK;
}

DSK_API dsk_status dsk_par_embedding_forward(dsk_comm *tp, dsk_ctx *ctx, dsk_tensor *out, dsk_tensor *part,
                                             const dsk_tensor *table, const dsk_tensor *ids) {
    const char *fn = "dsk_par_embedding_forward";
    int n = dsk__par_n(tp);
    dsk_tensor *rows_out, rows;
    dsk__par_hits h;
    dsk_status st;
    int64_t sh[2];
    DSK__TRY(dsk__par_need_2d(fn, "table", table, -1, -1));
    DSK__TRY(dsk__par_gathered(fn, tp, out, part, "out", "part"));
    rows_out = part ? part : out;
    DSK__TRY(dsk__par_need_2d(fn, part ? "part" : "out", rows_out, -1, table->shape[1]));
    DSK__TRY(dsk__par_need_same_dtype(fn, "out", out, "table", table));
    DSK__TRY(dsk__par_need_ids(fn, ids, rows_out->shape[0]));
    DSK__TRY(dsk__par_hits_find(fn, ctx, ids, dsk__par_r(tp) * table->shape[0], table->shape[0],
                                table->shape[0] * n, table->device, &h));
    st = dsk_tensor_fill(ctx, rows_out, 0.0);
    if (st == DSK_OK && h.k > 0) {
        sh[0] = h.k;
        sh[1] = table->shape[1];
        st = dsk__par_temp(ctx, table, &rows, table->dtype, 2, sh);
        if (st == DSK_OK) {
            st = dsk_gather_rows(ctx, &rows, table, &h.row);
            if (st == DSK_OK) st = dsk_scatter_add_rows(ctx, rows_out, &rows, &h.tok); /* 0 + x = x exactly */
            dsk_tensor_free(ctx, &rows);
        }
    }
    dsk__par_hits_free(ctx, &h);
    DSK__TRY(st);
    if (part) return dsk__par_reduce_scatter_dim(tp, ctx, out, part, 0);
    return dsk__par_all_reduce_into(tp, ctx, out, out);
}

DSK_API dsk_status dsk_par_embedding_backward(dsk_comm *tp, dsk_ctx *ctx, dsk_tensor *dtable, const dsk_tensor *dout,
                                              dsk_tensor *dg, const dsk_tensor *ids) {
    const char *fn = "dsk_par_embedding_backward";
    int n = dsk__par_n(tp);
    const dsk_tensor *full;
    dsk_tensor rows;
    dsk__par_hits h;
    dsk_status st = DSK_OK;
    int64_t sh[2];
    DSK__TRY(dsk__par_need_2d(fn, "dtable", dtable, -1, -1));
    DSK__TRY(dsk__par_gathered(fn, tp, dout, dg, "dout", "dg"));
    full = dg ? dg : dout;
    DSK__TRY(dsk__par_need_2d(fn, dg ? "dg" : "dout", full, -1, dtable->shape[1]));
    DSK__TRY(dsk__par_need_same_dtype(fn, "dout", dout, "dtable", dtable));
    DSK__TRY(dsk__par_need_ids(fn, ids, full->shape[0]));
    if (dg) DSK__TRY(dsk__par_all_gather_dim(tp, ctx, dg, dout, 0));
    DSK__TRY(dsk__par_hits_find(fn, ctx, ids, dsk__par_r(tp) * dtable->shape[0], dtable->shape[0],
                                dtable->shape[0] * n, dtable->device, &h));
    if (h.k > 0) {
        sh[0] = h.k;
        sh[1] = dtable->shape[1];
        st = dsk__par_temp(ctx, dtable, &rows, dtable->dtype, 2, sh);
        if (st == DSK_OK) {
            st = dsk_gather_rows(ctx, &rows, full, &h.tok);
            if (st == DSK_OK) st = dsk_scatter_add_rows(ctx, dtable, &rows, &h.row); /* token order */
            dsk_tensor_free(ctx, &rows);
        }
    }
    dsk__par_hits_free(ctx, &h);
    return st;
}

/* ---------------------------------------------------------------- vocabulary-parallel cross-entropy */

/* The CPU path: row max, all-reduce (max), sums, all-reduce (sum, f64), loss and gradient. */
static dsk_status dsk__par_ce_cpu(dsk_comm *tp, dsk_ctx *ctx, dsk_tensor *loss, dsk_tensor *dlogits,
                                  const dsk_tensor *logits, const int32_t *tg, int64_t lo, int64_t count,
                                  int32_t ignore_index, float grad_scale) {
    const char *fn = "dsk_par_cross_entropy";
    int64_t R = logits->shape[0], V = logits->shape[1];
    const void *x = logits->data;
    float *mx = (float *)DSK_MALLOC((size_t)(R ? R : 1) * sizeof(float));
    double *acc = (double *)DSK_MALLOC((size_t)(R ? R : 1) * 2 * sizeof(double)), total = 0.0;
    dsk_status st = DSK_OK;
    if (!mx || !acc) {
        st = dsk_set_error(DSK_ERR_OOM, "%s: out of host memory for %lld rows", fn, (long long)R);
        goto done;
    }
    for (int64_t r = 0; r < R; r++) { /* NaN propagates, as in dsk_cross_entropy */
        float m = -INFINITY;
        for (int64_t j = 0; j < V; j++) {
            float v = dsk_load_f32(x, logits->dtype, r * V + j);
            if (v > m || v != v) m = v;
        }
        mx[r] = m;
    }
    if (dsk__par_n(tp) > 1 && (st = dsk_comm_all_reduce(tp, ctx, mx, mx, R, DSK_F32, DSK_COMM_MAX)) != DSK_OK)
        goto done;
    for (int64_t r = 0; r < R; r++) {
        double s = 0.0, z = 0.0;
        if (tg[r] != ignore_index) {
            for (int64_t j = 0; j < V; j++) s += exp((double)dsk_load_f32(x, logits->dtype, r * V + j) - mx[r]);
            if (tg[r] >= lo && tg[r] < lo + V) z = (double)dsk_load_f32(x, logits->dtype, r * V + tg[r] - lo);
        }
        acc[2 * r] = s;
        acc[2 * r + 1] = z;
    }
    if (dsk__par_n(tp) > 1 && (st = dsk_comm_all_reduce(tp, ctx, acc, acc, 2 * R, DSK_F64, DSK_COMM_SUM)) != DSK_OK)
        goto done;
    for (int64_t r = 0; r < R; r++) {
        double lse;
        if (tg[r] == ignore_index) {
            if (dlogits)
                for (int64_t j = 0; j < V; j++) dsk_store_f32(dlogits->data, dlogits->dtype, r * V + j, 0.0f);
            continue;
        }
        lse = dsk_par_ce_lse(mx[r], acc[2 * r]);
        total += lse - acc[2 * r + 1];
        if (dlogits)
            for (int64_t j = 0; j < V; j++)
                dsk_store_f32(dlogits->data, dlogits->dtype, r * V + j,
                              dsk_par_ce_grad(dsk_load_f32(x, logits->dtype, r * V + j), lse, lo + j == tg[r],
                                              grad_scale, count));
    }
    *(float *)loss->data = count ? (float)(total / (double)count) : 0.0f;
done:
    DSK_FREE(mx);
    DSK_FREE(acc);
    return st;
}

#ifdef DSK_CUDA
/* The CUDA path: the same passes in kernels/par.cu, the all-reduces on device buffers. */
static dsk_status dsk__par_ce_cuda(dsk_comm *tp, dsk_ctx *ctx, dsk_tensor *loss, dsk_tensor *dlogits,
                                   const dsk_tensor *logits, const dsk_tensor *targets, int64_t lo,
                                   int32_t ignore_index, float grad_scale) {
    int64_t R = logits->shape[0], two_r = 2 * R, one = 1;
    dsk_tensor mx, acc, count;
    dsk_status st;
    if (R == 0) return dsk_tensor_fill(ctx, loss, 0.0);
    memset(&mx, 0, sizeof mx);
    memset(&acc, 0, sizeof acc);
    memset(&count, 0, sizeof count);
    st = dsk_tensor_alloc(ctx, &mx, DSK_F32, 1, &R);
    if (st == DSK_OK) st = dsk_tensor_alloc(ctx, &acc, DSK_F64, 1, &two_r);
    if (st == DSK_OK) st = dsk_tensor_alloc(ctx, &count, DSK_I64, 1, &one);
    if (st == DSK_OK)
        st = dsk_cuda_par_ce_max(ctx, (float *)mx.data, (int64_t *)count.data, logits, targets, ignore_index);
    if (st == DSK_OK && dsk__par_n(tp) > 1)
        st = dsk_comm_all_reduce(tp, ctx, mx.data, mx.data, R, DSK_F32, DSK_COMM_MAX);
    if (st == DSK_OK)
        st = dsk_cuda_par_ce_sums(ctx, (double *)acc.data, (const float *)mx.data, logits, targets, lo, ignore_index);
    if (st == DSK_OK && dsk__par_n(tp) > 1)
        st = dsk_comm_all_reduce(tp, ctx, acc.data, acc.data, two_r, DSK_F64, DSK_COMM_SUM);
    if (st == DSK_OK)
        st = dsk_cuda_par_ce_finish(ctx, loss, dlogits, (const float *)mx.data, (const double *)acc.data,
                                    (const int64_t *)count.data, logits, targets, lo, ignore_index, grad_scale);
    dsk_tensor_free(ctx, &mx);
    dsk_tensor_free(ctx, &acc);
    dsk_tensor_free(ctx, &count);
    return st;
}
#endif

DSK_API dsk_status dsk_par_cross_entropy(dsk_comm *tp, dsk_ctx *ctx, dsk_tensor *loss, dsk_tensor *dlogits,
                                         const dsk_tensor *logits, const dsk_tensor *targets, int32_t ignore_index,
                                         float grad_scale) {
    const char *fn = "dsk_par_cross_entropy";
    int n = dsk__par_n(tp);
    int64_t R, V, lo, count = 0;
    const int32_t *tg;
    char d[96];
    DSK__TRY(dsk__par_need_2d(fn, "logits", logits, -1, -1));
    R = logits->shape[0];
    V = logits->shape[1];
    lo = (int64_t)dsk__par_r(tp) * V;
    DSK__TRY(dsk__par_need_ids(fn, targets, R));
    if (!loss || !loss->data || loss->dtype != DSK_F32 || dsk_tensor_numel(loss) != 1)
        return dsk_set_error(DSK_ERR_ARG, "%s: loss must be one f32 value", fn);
    if (dlogits) {
        DSK__TRY(dsk__par_need_2d(fn, "dlogits", dlogits, R, V));
        DSK__TRY(dsk__par_need_same_dtype(fn, "dlogits", dlogits, "logits", logits));
    }
    if (targets->device.type != logits->device.type || loss->device.type != logits->device.type)
        return dsk_set_error(DSK_ERR_ARG, "%s: logits %s, targets and loss must be on one device", fn,
                             dsk_tensor_describe(logits, d, sizeof d));
    DSK__TRY(dsk__par_need_backend(fn, tp, "logits", logits));
    DSK__TRY(dsk__par_need_build(fn, "logits", logits));
    DSK__CUDA_PATH(logits->device.type == DSK_DEV_CUDA,
                   dsk__par_ce_cuda(tp, ctx, loss, dlogits, logits, targets, lo, ignore_index, grad_scale));
    tg = (const int32_t *)targets->data;
    for (int64_t r = 0; r < R; r++) {
        if (tg[r] == ignore_index) continue;
        if (tg[r] < 0 || tg[r] >= V * n)
            return dsk_set_error(DSK_ERR_ARG, "%s: targets[%lld] = %d outside [0, %lld) (ignore_index %d)", fn,
                                 (long long)r, (int)tg[r], (long long)(V * n), (int)ignore_index);
        count++;
    }
    if (n == 1) return dsk_cross_entropy(ctx, loss, dlogits, logits, targets, ignore_index, grad_scale);
    return dsk__par_ce_cpu(tp, ctx, loss, dlogits, logits, tg, lo, count, ignore_index, grad_scale);
}

/* ---------------------------------------------------------------- schedules: compute orders */

/* Whether kind is one of the schedules. */
static int dsk__par_kind_known(dsk_par_schedule_kind kind) {
    return (int)kind >= 0 && (int)kind <= (int)DSK_PAR_DUALPIPE_V;
}

DSK_API const char *dsk_par_schedule_name(dsk_par_schedule_kind kind) {
    static const char *names[] = {"gpipe", "1f1b", "interleaved", "dualpipev"};
    return dsk__par_kind_known(kind) ? names[kind] : "invalid";
}

DSK_API dsk_status dsk_par_schedule_parse(const char *name, dsk_par_schedule_kind *kind) {
    for (int k = 0; k <= (int)DSK_PAR_DUALPIPE_V; k++)
        if (name && kind && strcmp(name, dsk_par_schedule_name((dsk_par_schedule_kind)k)) == 0) {
            *kind = (dsk_par_schedule_kind)k;
            return DSK_OK;
        }
    return dsk_set_error(DSK_ERR_ARG,
                         "dsk_par_schedule_parse: \"%s\" is not a schedule (gpipe, 1f1b, interleaved, dualpipev)",
                         name ? name : "(null)");
}

DSK_API const char *dsk_par_action_name(dsk_par_action_kind kind) {
    static const char *names[] = {"forward",       "backward",         "send activation",     "receive activation",
                                  "send gradient", "receive gradient", "forward and backward"};
    return (int)kind >= 0 && (int)kind <= (int)DSK_PAR_FORWARD_BACKWARD ? names[kind] : "invalid";
}

static dsk_status dsk__par_sched_check(const char *fn, dsk_par_schedule_kind kind, int p, int m, int v, int r) {
    if (!dsk__par_kind_known(kind)) return dsk_set_error(DSK_ERR_ARG, "%s: unknown schedule %d", fn, (int)kind);
    if (p < 1 || m < 1 || v < 1 || r < 0 || r >= p)
        return dsk_set_error(DSK_ERR_ARG, "%s: %s with %d stages, %d micro-batches, %d chunks, rank %d: need "
                             "positive sizes and 0 <= rank < stages", fn, dsk_par_schedule_name(kind), p, m, v, r);
    if (kind == DSK_PAR_DUALPIPE_V && (v != 2 || m < 2 * p))
        return dsk_set_error(DSK_ERR_ARG,
                             "%s: dualpipev runs 2 chunks a rank (not %d) and at least 2 micro-batches a "
                             "stage (%d stages: %d or more, not %d)",
                             fn, v, p, 2 * p, m);
    if (kind != DSK_PAR_INTERLEAVED && kind != DSK_PAR_DUALPIPE_V && v != 1)
        return dsk_set_error(DSK_ERR_ARG, "%s: %s runs one chunk per rank, not %d (use the interleaved schedule)", fn,
                             dsk_par_schedule_name(kind), v);
    if (kind == DSK_PAR_INTERLEAVED && v > 1 && m % p != 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: interleaved schedule with %d chunks: %d micro-batches is not a "
                             "multiple of the %d stages", fn, v, m, p);
    if ((int64_t)m * v > 1000000 || (int64_t)p * v > 1000000)
        return dsk_set_error(DSK_ERR_ARG, "%s: %d micro-batches x %d chunks x %d stages is too large", fn, m, v, p);
    return DSK_OK;
}

DSK_API double dsk_par_bubble_fraction(dsk_par_schedule_kind kind, int stages, int micro, int chunks) {
    /* DualPipeV: 2 (p - 1) unit steps of 4 m, as interleaved's at v = 2 */
    int v = kind == DSK_PAR_DUALPIPE_V ? 2 : kind == DSK_PAR_INTERLEAVED && chunks > 1 ? chunks : 1;
    if (stages < 1 || micro < 1) return 0.0;
    return (double)(stages - 1) / ((double)v * micro);
}

DSK_API int dsk_par_stage(dsk_par_schedule_kind kind, int stages, int chunk, int rank) {
    int vee = kind == DSK_PAR_DUALPIPE_V;
    if (!dsk__par_kind_known(kind) || stages < 1 || rank < 0 || rank >= stages || chunk < 0 || (vee && chunk > 1))
        return -1;
    return vee && chunk == 1 ? 2 * stages - 1 - rank : chunk * stages + rank;
}

DSK_API int dsk_par_stage_rank(dsk_par_schedule_kind kind, int stages, int stage) {
    int vee = kind == DSK_PAR_DUALPIPE_V;
    if (!dsk__par_kind_known(kind) || stages < 1 || stage < 0 || (vee && stage >= 2 * stages)) return -1;
    return vee && stage >= stages ? 2 * stages - 1 - stage : stage % stages;
}

/* Warm-up forwards of rank r (forwards before the first backward, steady state aside). */
static int dsk__par_warmup(dsk_par_schedule_kind kind, int p, int m, int v, int r) {
    int total = m * v, w;
    if (kind == DSK_PAR_GPIPE) return m;
    if (kind == DSK_PAR_1F1B || v == 1) return p - r - 1 < m ? p - r - 1 : m;
    if (m == p) return total; /* Megatron: every forward first when m equals p */
    w = 2 * (p - r - 1) + (v - 1) * p;
    return w < total ? w : total;
}

/* Paired: the interleaved warm-up (1F1B's doubled: 2 (p - r - 1) at v = 1) and one more, so that a
   pair's gradient has come back when it starts and the stages keep 1F1B's (interleaved's) bubble. */
static int dsk__par_warmup_paired(dsk_par_schedule_kind kind, int p, int m, int v, int r) {
    int total = m * v, w = 2 * (p - r - 1) + (v - 1) * p + 1;
    if (kind == DSK_PAR_GPIPE || (v > 1 && m == p)) return dsk__par_warmup(kind, p, m, v, r);
    return w < total ? w : total;
}

DSK_API int dsk_par_in_flight_bound(dsk_par_schedule_kind kind, int stages, int micro, int chunks, int rank) {
    int total, w;
    if (dsk__par_sched_check("dsk_par_in_flight_bound", kind, stages, micro, chunks, rank) != DSK_OK) return -1;
    total = micro * chunks;
    if (kind == DSK_PAR_DUALPIPE_V) return 2 * stages + 1; /* 2 p forwards before the first backward, then one more */
    w = dsk__par_warmup(kind, stages, micro, chunks, rank);
    return w + 1 < total ? w + 1 : total;
}

/* Compute i of rank r's order as (backward?, micro, chunk); pair: a forward that runs with the
   backward after it as one computation. */
typedef struct dsk__par_op {
    int bwd, micro, chunk, pair;
} dsk__par_op;

/* The k-th forward (or backward) of a rank: (micro, chunk) in Megatron's interleaved order;
   with v = 1 simply micro-batch k. */
static dsk__par_op dsk__par_kth(int p, int v, int k, int bwd) {
    dsk__par_op o;
    int c = (k % (p * v)) / p;
    o.bwd = bwd;
    o.pair = 0;
    o.micro = v == 1 ? k : (k / (p * v)) * p + k % p;
    o.chunk = v == 1 ? 0 : bwd ? v - 1 - c : c;
    return o;
}

/* Appends DualPipeV's next operation of (bwd, chunk) to ops[*n]: that kind's next micro-batch (next[2 bwd + chunk]
   counts them), paired with the operation after it when pair is set. */
static void dsk__par_v_op(dsk__par_op *ops, int *n, int *next, int bwd, int chunk, int pair) {
    dsk__par_op *o = &ops[(*n)++];
    o->bwd = bwd;
    o->chunk = chunk;
    o->pair = pair;
    o->micro = next[2 * bwd + chunk]++;
}

/* DualPipeV's compute order (deepseek-ai/DualPipe, dualpipev.py, its eight steps; chunk 0 runs stages 0..p-1 down
   the ranks, chunk 1 stages p..2p-1 back up): F0 x 2 (p - r - 1); (F0 F1) x (r + 1); (B1 F1) x (p - r - 1);
   (F0 B1 F1 B0) x (m - 2 p + r + 1); (B1 F1 B0) x (p - r - 1); (B1 B0) x (r + 1); B0 x (p - r - 1). Each chunk's
   forwards and backwards go in micro-batch order (the gradients accumulate as under 1F1B), and without a split
   backward its weight steps are part of B. Paired: F0 with the B1 after it and F1 with the B0 after it (DualPipe's
   overlapped chunks), except the last rank's first F0 B1 (DualPipeV does not overlap those either). */
static void dsk__par_order_v(int p, int m, int r, int paired, dsk__par_op *ops) {
    int next[4] = {0, 0, 0, 0}, n = 0; /* next micro-batch of F0, F1, B0, B1 */
    for (int i = 0; i < 2 * (p - r - 1); i++) dsk__par_v_op(ops, &n, next, 0, 0, 0);
    for (int i = 0; i < r + 1; i++) {
        dsk__par_v_op(ops, &n, next, 0, 0, 0);
        dsk__par_v_op(ops, &n, next, 0, 1, 0);
    }
    for (int i = 0; i < p - r - 1; i++) {
        dsk__par_v_op(ops, &n, next, 1, 1, 0);
        dsk__par_v_op(ops, &n, next, 0, 1, 0);
    }
    for (int i = 0; i < m - 2 * p + r + 1; i++) {
        dsk__par_v_op(ops, &n, next, 0, 0, paired && !(i == 0 && r == p - 1));
        dsk__par_v_op(ops, &n, next, 1, 1, 0);
        dsk__par_v_op(ops, &n, next, 0, 1, paired);
        dsk__par_v_op(ops, &n, next, 1, 0, 0);
    }
    for (int i = 0; i < p - r - 1; i++) {
        dsk__par_v_op(ops, &n, next, 1, 1, 0);
        dsk__par_v_op(ops, &n, next, 0, 1, paired);
        dsk__par_v_op(ops, &n, next, 1, 0, 0);
    }
    for (int i = 0; i < r + 1; i++) {
        dsk__par_v_op(ops, &n, next, 1, 1, 0);
        dsk__par_v_op(ops, &n, next, 1, 0, 0);
    }
    for (int i = 0; i < p - r - 1; i++) dsk__par_v_op(ops, &n, next, 1, 0, 0);
}

/* Rank r's compute order: 2 m v operations; paired: one more warm-up forward, and each steady
   forward paired with the backward after it unless they are of the same micro-batch. */
static void dsk__par_order(dsk_par_schedule_kind kind, int p, int m, int v, int r, int paired, dsk__par_op *ops) {
    int total = m * v, w, n = 0;
    if (kind == DSK_PAR_DUALPIPE_V) {
        dsk__par_order_v(p, m, r, paired, ops);
        return;
    }
    w = paired ? dsk__par_warmup_paired(kind, p, m, v, r) : dsk__par_warmup(kind, p, m, v, r);
    if (kind == DSK_PAR_GPIPE) {
        for (int k = 0; k < total; k++) ops[n++] = dsk__par_kth(p, v, k, 0);
        for (int k = 0; k < total; k++) ops[n++] = dsk__par_kth(p, v, k, 1);
        return;
    }
    for (int k = 0; k < w; k++) ops[n++] = dsk__par_kth(p, v, k, 0);
    for (int k = 0; k < total - w; k++) {
        ops[n] = dsk__par_kth(p, v, w + k, 0);
        ops[n + 1] = dsk__par_kth(p, v, k, 1);
        ops[n].pair = paired && ops[n].micro != ops[n + 1].micro;
        n += 2;
    }
    for (int k = total - w; k < total; k++) ops[n++] = dsk__par_kth(p, v, k, 1);
}

/* ---------------------------------------------------------------- schedules: placing the transfers */

DSK_API void dsk_par_schedule_free(dsk_par_schedule *s) {
    if (!s) return;
    DSK_FREE(s->actions);
    memset(s, 0, sizeof *s);
}

typedef struct dsk__par_sim {
    dsk_par_schedule_kind kind;
    int p, m, v, S;            /* S = p v global stages */
    dsk__par_op *order;        /* [p][2 m v] */
    int *pos;                  /* [p] next operation of each rank */
    unsigned char *act, *grad; /* [S][m]: input activation / output gradient available */
    int *msg;                  /* messages of the current step: (is_grad, micro, from stage) triples, 2 per rank */
    dsk_par_action *out;       /* the requested rank's list */
    int n_out, rank;           /* rank -1: every rank's, into outs[r] (n_outs[r] each, room apart) */
    dsk_par_action *outs;
    int *n_outs;
    size_t room;
    const char *fn;
} dsk__par_sim;

static dsk_par_action *dsk__par_emit(dsk__par_sim *z, int rank, dsk_par_action_kind kind, int micro, int stage,
                                     int peer) {
    dsk_par_action *a;
    if (z->rank < 0) a = &z->outs[(size_t)rank * z->room + (size_t)z->n_outs[rank]++];
    else if (rank != z->rank) return NULL;
    else a = &z->out[z->n_out++];
    a->kind = kind;
    a->micro = micro;
    a->stage = stage;
    a->chunk = stage / z->p;
    a->peer = peer;
    a->bwd_micro = a->bwd_chunk = a->bwd_stage = -1;
    return a;
}

/* Rank r runs operation o (global stage s): its message, if it makes one, joins the step's. */
static void dsk__par_produce(dsk__par_sim *z, const dsk__par_op *o, int s, int *n_msg) {
    if (o->bwd ? s == 0 : s == z->S - 1) return;
    z->msg[3 * *n_msg] = o->bwd;
    z->msg[3 * *n_msg + 1] = o->micro;
    z->msg[3 * *n_msg + 2] = s;
    (*n_msg)++;
}

/* Whether rank r's next operation has its input. */
static int dsk__par_ready(const dsk__par_sim *z, int r, const dsk__par_op *o) {
    int s = dsk_par_stage(z->kind, z->p, o->chunk, r);
    if (!o->bwd) return s == 0 || z->act[(size_t)s * z->m + o->micro];
    return s == z->S - 1 || z->grad[(size_t)s * z->m + o->micro];
}

/* Runs every rank's order in unit steps and writes rank z->rank's actions. */
static dsk_status dsk__par_simulate(dsk__par_sim *z) {
    int per = 2 * z->m * z->v, left = z->p * per;
    while (left > 0) {
        int n_msg = 0, ran = 0;
        for (int r = 0; r < z->p; r++) {
            const dsk__par_op *o, *b;
            dsk_par_action *a;
            int s;
            if (z->pos[r] == per) continue;
            o = &z->order[(size_t)r * per + z->pos[r]];
            b = o->pair ? o + 1 : NULL;
            if (!dsk__par_ready(z, r, o) || (b && !dsk__par_ready(z, r, b))) continue;
            s = dsk_par_stage(z->kind, z->p, o->chunk, r);
            a = dsk__par_emit(z, r,
                              b        ? DSK_PAR_FORWARD_BACKWARD
                              : o->bwd ? DSK_PAR_BACKWARD
                                       : DSK_PAR_FORWARD,
                              o->micro, s, -1);
            dsk__par_produce(z, o, s, &n_msg);
            if (b) {
                int sb = dsk_par_stage(z->kind, z->p, b->chunk, r);
                if (a) {
                    a->bwd_micro = b->micro;
                    a->bwd_chunk = b->chunk;
                    a->bwd_stage = sb;
                }
                dsk__par_produce(z, b, sb, &n_msg);
            }
            z->pos[r] += b ? 2 : 1;
            left -= b ? 2 : 1;
            ran++;
        }
        if (!ran)
            return dsk_set_error(DSK_ERR_STATE,
                                 "%s: the compute orders of %d stages, %d micro-batches, %d chunks "
                                 "wait on each other",
                                 z->fn, z->p, z->m, z->v);
        /* this step's messages, in producer-rank order, on both ends */
        for (int i = 0; i < n_msg; i++) {
            int bwd = z->msg[3 * i], mb = z->msg[3 * i + 1], s = z->msg[3 * i + 2];
            int to = bwd ? s - 1 : s + 1;
            int rs = dsk_par_stage_rank(z->kind, z->p, s), rt = dsk_par_stage_rank(z->kind, z->p, to);
            if (bwd) z->grad[(size_t)to * z->m + mb] = 1;
            else z->act[(size_t)to * z->m + mb] = 1;
            if (rs == rt) continue; /* one rank (p = 1; DualPipeV's turn at rank p - 1): a local hand-over */
            dsk__par_emit(z, rs, bwd ? DSK_PAR_SEND_GRAD : DSK_PAR_SEND_ACT, mb, s, rt);
            dsk__par_emit(z, rt, bwd ? DSK_PAR_RECV_GRAD : DSK_PAR_RECV_ACT, mb, to, rs);
        }
    }
    return DSK_OK;
}

static void dsk__par_sim_free(dsk__par_sim *z) {
    DSK_FREE(z->order);
    DSK_FREE(z->pos);
    DSK_FREE(z->act);
    DSK_FREE(z->grad);
    DSK_FREE(z->msg);
}

/* Every rank's compute order and the run's state (dsk__par_sim_free after, failed or not); the fields the caller
   set (rank, out or outs) are kept. */
static dsk_status dsk__par_sim_init(dsk__par_sim *z, const char *fn, dsk_par_schedule_kind kind, int p, int m, int v,
                                    int paired) {
    size_t per = (size_t)2 * m * v;
    z->kind = kind, z->p = p, z->m = m, z->v = v, z->S = p * v, z->fn = fn;
    z->order = (dsk__par_op *)DSK_MALLOC((size_t)p * per * sizeof *z->order);
    z->pos = (int *)DSK_MALLOC((size_t)p * sizeof(int));
    z->act = (unsigned char *)DSK_MALLOC((size_t)z->S * m);
    z->grad = (unsigned char *)DSK_MALLOC((size_t)z->S * m);
    z->msg = (int *)DSK_MALLOC((size_t)p * 6 * sizeof(int));
    if (!z->order || !z->pos || !z->act || !z->grad || !z->msg) /* the caller's dsk__par_sim_free frees what came */
        return dsk_set_error(DSK_ERR_OOM, "%s: out of memory for %d stages x %zu operations", fn, p, per);
    memset(z->pos, 0, (size_t)p * sizeof(int));
    memset(z->act, 0, (size_t)z->S * m);
    memset(z->grad, 0, (size_t)z->S * m);
    for (int r = 0; r < p; r++) dsk__par_order(kind, p, m, v, r, paired, z->order + (size_t)r * per);
    return DSK_OK;
}

static dsk_status dsk__par_schedule_build(const char *fn, dsk_par_schedule *s, dsk_par_schedule_kind kind, int stages,
                                          int micro, int chunks, int rank, int paired) {
    dsk__par_sim z;
    dsk_status st;
    size_t per;
    if (!s) return dsk_set_error(DSK_ERR_ARG, "%s: schedule is NULL", fn);
    memset(s, 0, sizeof *s);
    DSK__TRY(dsk__par_sched_check(fn, kind, stages, micro, chunks, rank));
    if (kind == DSK_PAR_INTERLEAVED && chunks == 1) kind = DSK_PAR_1F1B;
    memset(&z, 0, sizeof z);
    z.rank = rank;
    per = (size_t)2 * micro * chunks;
    z.out = (dsk_par_action *)DSK_MALLOC(per * 3 * sizeof *z.out); /* each op: itself + at most one send, one recv */
    if (!z.out) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory for %zu actions", fn, per * 3);
    st = dsk__par_sim_init(&z, fn, kind, stages, micro, chunks, paired);
    if (st == DSK_OK) st = dsk__par_simulate(&z);
    dsk__par_sim_free(&z);
    if (st != DSK_OK) {
        DSK_FREE(z.out);
        return st;
    }
    s->kind = kind;
    s->stages = stages;
    s->micro = micro;
    s->chunks = chunks;
    s->rank = rank;
    s->n = z.n_out;
    s->actions = z.out;
    s->paired = paired;
    s->in_flight = dsk_par_in_flight_bound(kind, stages, micro, chunks, rank);
    if (paired && kind != DSK_PAR_DUALPIPE_V) { /* DualPipeV's pairs keep its order */
        int w = dsk__par_warmup_paired(kind, stages, micro, chunks, rank);
        s->in_flight = w + 1 < micro * chunks ? w + 1 : micro * chunks;
    }
    s->bubble = dsk_par_bubble_fraction(kind, stages, micro, chunks);
    return DSK_OK;
}

DSK_API dsk_status dsk_par_schedule_init(dsk_par_schedule *s, dsk_par_schedule_kind kind, int stages, int micro,
                                         int chunks, int rank) {
    return dsk__par_schedule_build("dsk_par_schedule_init", s, kind, stages, micro, chunks, rank, 0);
}

DSK_API dsk_status dsk_par_schedule_init_paired(dsk_par_schedule *s, dsk_par_schedule_kind kind, int stages, int micro,
                                                int chunks, int rank) {
    return dsk__par_schedule_build("dsk_par_schedule_init_paired", s, kind, stages, micro, chunks, rank, 1);
}

/* ---------------------------------------------------------------- schedules: timed */

/* Every rank's list as the placing run writes it: lists [p][room] (rank r's n[r] actions from r * room). */
static dsk_status dsk__par_all_lists(const char *fn, dsk_par_schedule_kind kind, int p, int m, int v, int paired,
                                     dsk_par_action *lists, size_t room, int *n) {
    dsk__par_sim z;
    dsk_status st;
    memset(&z, 0, sizeof z);
    z.rank = -1, z.outs = lists, z.n_outs = n, z.room = room;
    for (int r = 0; r < p; r++) n[r] = 0;
    st = dsk__par_sim_init(&z, fn, kind, p, m, v, paired);
    if (st == DSK_OK) st = dsk__par_simulate(&z);
    dsk__par_sim_free(&z);
    return st;
}

/* Runs rank r's list from *pos while it can: computations for their times, a send once its receiver is at the
   matching receive (both then leave at the later arrival plus link_s). Returns the actions run. */
static int dsk__par_time_rank(const dsk_par_action *lists, const int *n, size_t room, int r, int *pos, double *clock,
                              const double *fwd_s, const double *bwd_s, double link_s) {
    int ran = 0;
    while (pos[r] < n[r]) {
        const dsk_par_action *a = &lists[(size_t)r * room + (size_t)pos[r]];
        if (a->kind == DSK_PAR_FORWARD) clock[r] += fwd_s[a->stage];
        else if (a->kind == DSK_PAR_BACKWARD) clock[r] += bwd_s[a->stage];
        else if (a->kind == DSK_PAR_FORWARD_BACKWARD) clock[r] += fwd_s[a->stage] + bwd_s[a->bwd_stage];
        else if (a->kind == DSK_PAR_SEND_ACT || a->kind == DSK_PAR_SEND_GRAD) {
            int q = a->peer;
            const dsk_par_action *b = pos[q] < n[q] ? &lists[(size_t)q * room + (size_t)pos[q]] : NULL;
            double t;
            if (!b || (b->kind != DSK_PAR_RECV_ACT && b->kind != DSK_PAR_RECV_GRAD) || b->peer != r) break;
            t = (clock[r] > clock[q] ? clock[r] : clock[q]) + link_s;
            clock[r] = clock[q] = t;
            pos[q]++;
            ran++;
        } else break; /* a receive: its sender moves both */
        pos[r]++;
        ran++;
    }
    return ran;
}

/* The same under DSK_PAR_TRANSFERS_AHEAD: a send sets its message's landing time (arrive[is_grad][stage][micro],
   the consumer's stage; negative: not sent yet), a receive costs nothing, a computation starts once its
   inputs have landed. */
static int dsk__par_time_rank_ahead(dsk_par_schedule_kind kind, const dsk_par_action *lists, const int *n, size_t room,
                                    int r, int *pos, double *clock, const double *fwd_s, const double *bwd_s,
                                    double link_s, double *arrive, int p, int S, int m) {
    int ran = 0;
    while (pos[r] < n[r]) {
        const dsk_par_action *a = &lists[(size_t)r * room + (size_t)pos[r]];
        double *act = arrive, *grad = arrive + (size_t)S * m, in = 0.0;
        if (a->kind == DSK_PAR_SEND_ACT) act[(size_t)(a->stage + 1) * m + a->micro] = clock[r] + link_s;
        else if (a->kind == DSK_PAR_SEND_GRAD) grad[(size_t)(a->stage - 1) * m + a->micro] = clock[r] + link_s;
        else if (a->kind != DSK_PAR_RECV_ACT && a->kind != DSK_PAR_RECV_GRAD) {
            int fs = a->kind == DSK_PAR_BACKWARD ? -1 : a->stage, bs = a->kind == DSK_PAR_FORWARD ? -1 : a->stage;
            int bm = a->micro;
            if (a->kind == DSK_PAR_FORWARD_BACKWARD) bs = a->bwd_stage, bm = a->bwd_micro;
            /* inputs from another rank: a forward's activation (not stage 0), a backward's gradient (not the last
               stage's), unless the neighbouring stage is on this rank (p = 1, DualPipeV's turn) */
            int fin = fs > 0 && dsk_par_stage_rank(kind, p, fs - 1) != r;
            int bin = bs >= 0 && bs < S - 1 && dsk_par_stage_rank(kind, p, bs + 1) != r;
            if ((fin && act[(size_t)fs * m + a->micro] < 0) || (bin && grad[(size_t)bs * m + bm] < 0)) break;
            if (fin) in = act[(size_t)fs * m + a->micro];
            if (bin && grad[(size_t)bs * m + bm] > in) in = grad[(size_t)bs * m + bm];
            clock[r] = (clock[r] > in ? clock[r] : in) + (fs >= 0 ? fwd_s[fs] : 0.0) + (bs >= 0 ? bwd_s[bs] : 0.0);
        }
        pos[r]++;
        ran++;
    }
    return ran;
}

DSK_API dsk_status dsk_par_schedule_time(dsk_par_schedule_kind kind, int stages, int micro, int chunks, int paired,
                                         dsk_par_transfers transfers, const double *fwd_s, const double *bwd_s,
                                         double link_s, double *step_s) {
    const char *fn = "dsk_par_schedule_time";
    int S, left = 0, *n, *pos;
    size_t room;
    dsk_par_action *lists;
    double *clock, *arrive;
    dsk_status st = DSK_OK;
    if (!fwd_s || !bwd_s || !step_s) return dsk_set_error(DSK_ERR_ARG, "%s: fwd_s, bwd_s or step_s is NULL", fn);
    if (transfers != DSK_PAR_TRANSFERS_IN_ORDER && transfers != DSK_PAR_TRANSFERS_AHEAD)
        return dsk_set_error(DSK_ERR_ARG, "%s: unknown transfers %d (in order 0, ahead 1)", fn, (int)transfers);
    DSK__TRY(dsk__par_sched_check(fn, kind, stages, micro, chunks, 0));
    if (!(link_s >= 0) || isinf(link_s))
        return dsk_set_error(DSK_ERR_ARG, "%s: link_s %g must be finite and >= 0", fn, link_s);
    S = stages * chunks;
    for (int s = 0; s < S; s++)
        if (!(fwd_s[s] >= 0) || !(bwd_s[s] >= 0) || isinf(fwd_s[s]) || isinf(bwd_s[s]))
            return dsk_set_error(DSK_ERR_ARG, "%s: stage %d of %d: forward %g s, backward %g s: need finite times >= 0",
                                 fn, s, S, fwd_s[s], bwd_s[s]);
    room = (size_t)6 * micro * chunks; /* each computation, at most one send and one receive */
    lists = (dsk_par_action *)DSK_MALLOC((size_t)stages * room * sizeof *lists);
    n = (int *)DSK_MALLOC((size_t)stages * sizeof *n);
    pos = (int *)DSK_MALLOC((size_t)stages * sizeof *pos);
    clock = (double *)DSK_MALLOC((size_t)stages * sizeof *clock);
    arrive = (double *)DSK_MALLOC((size_t)2 * S * micro * sizeof *arrive);
    if (!lists || !n || !pos || !clock || !arrive)
        st = dsk_set_error(DSK_ERR_OOM, "%s: out of memory for %d stages x %zu actions", fn, stages, room);
    if (st == DSK_OK) st = dsk__par_all_lists(fn, kind, stages, micro, chunks, paired, lists, room, n);
    for (int i = 0; st == DSK_OK && i < 2 * S * micro; i++) arrive[i] = -1.0;
    for (int r = 0; st == DSK_OK && r < stages; r++) {
        left += n[r];
        pos[r] = 0;
        clock[r] = 0.0;
    }
    /* the lists run with rendezvous sends (the placing run's promise), so every sweep moves until all end */
    while (st == DSK_OK && left > 0) {
        int ran = 0;
        for (int r = 0; r < stages; r++)
            ran += transfers == DSK_PAR_TRANSFERS_AHEAD
                       ? dsk__par_time_rank_ahead(kind, lists, n, room, r, pos, clock, fwd_s, bwd_s, link_s, arrive,
                                                  stages, S, micro)
                       : dsk__par_time_rank(lists, n, room, r, pos, clock, fwd_s, bwd_s, link_s);
        if (!ran)
            st = dsk_set_error(DSK_ERR_STATE,
                               "%s: the lists of %d stages, %d micro-batches, %d chunks wait on each other", fn, stages,
                               micro, chunks);
        left -= ran;
    }
    if (st == DSK_OK) {
        *step_s = 0.0;
        for (int r = 0; r < stages; r++) *step_s = clock[r] > *step_s ? clock[r] : *step_s;
    }
    DSK_FREE(lists);
    DSK_FREE(n);
    DSK_FREE(pos);
    DSK_FREE(clock);
    DSK_FREE(arrive);
    return st;
}

/* ---------------------------------------------------------------- the executor */

/* The error of action i (its cause in dsk_last_error), naming the action, its micro-batch, chunk and peer. */
static dsk_status dsk__par_action_error(const dsk_par_schedule *s, int i, dsk_status st) {
    const dsk_par_action *a = &s->actions[i];
    char why[1024], peer[80] = "";
    snprintf(why, sizeof why, "%s", dsk_last_error());
    if (a->peer >= 0)
        snprintf(peer, sizeof peer, " %s pipeline rank %d",
                 a->kind == DSK_PAR_SEND_ACT || a->kind == DSK_PAR_SEND_GRAD ? "to" : "from", a->peer);
    if (a->kind == DSK_PAR_FORWARD_BACKWARD)
        snprintf(peer, sizeof peer, "; backward of micro-batch %d, chunk %d, stage %d", a->bwd_micro, a->bwd_chunk,
                 a->bwd_stage);
    return dsk_set_error(st,
                         "dsk_par_pipeline_run: pipeline rank %d, action %d of %d (%s of micro-batch %d, chunk %d, "
                         "stage %d%s): %s",
                         s->rank, i, s->n, dsk_par_action_name(a->kind), a->micro, a->chunk, a->stage, peer, why);
}

/* The receives begun ahead of their use, by (is gradient, micro-batch, chunk): the request and the action. */
typedef struct dsk__par_pending {
    int64_t *req;
    int *at;
} dsk__par_pending;

static int dsk__par_slot(const dsk_par_schedule *s, int is_grad, int micro, int chunk) {
    return (is_grad * s->micro + micro) * s->chunks + chunk;
}

/* Finishes the receive begun in slot k (idle: only once it is moving or done), if any; on failure *blame is
   that receive's action. */
static dsk_status dsk__par_finish(dsk_comm *pp, dsk_ctx *ctx, dsk__par_pending *w, int k, int unless_idle, int *blame) {
    int state = DSK_COMM_REQ_DONE;
    if (!w->req || w->req[k] < 0) return DSK_OK;
    *blame = w->at[k];
    if (unless_idle) DSK__TRY(dsk_comm_test(pp, ctx, w->req[k], &state));
    if (state == DSK_COMM_REQ_IDLE) return DSK_OK;
    DSK__TRY(dsk_comm_wait(pp, ctx, w->req[k]));
    w->req[k] = -1;
    return DSK_OK;
}

/* Finishes the receive of the input (is_grad 0: activation, 1: gradient) of (micro, chunk), if one was begun. */
static dsk_status dsk__par_await(const dsk_par_schedule *s, dsk_comm *pp, dsk_ctx *ctx, dsk__par_pending *w,
                                 int is_grad, int micro, int chunk, int *blame) {
    return dsk__par_finish(pp, ctx, w, dsk__par_slot(s, is_grad, micro, chunk), 0, blame);
}

/* Finishes each begun receive whose message is moving or done (its sender is at it). */
static dsk_status dsk__par_take_moving(const dsk_par_schedule *s, dsk_comm *pp, dsk_ctx *ctx, dsk__par_pending *w,
                                       int *blame) {
    for (int k = 0; w->req && k < 2 * s->micro * s->chunks; k++) DSK__TRY(dsk__par_finish(pp, ctx, w, k, 1, blame));
    return DSK_OK;
}

/* Runs action i; a computation first takes the moving receives and finishes the receives of its inputs. On failure
   *blame is the action the error belongs to. */
static dsk_status dsk__par_run_action(const dsk_par_schedule *s, int i, dsk_comm *pp, dsk_ctx *ctx,
                                      const dsk_par_stage_fns *fns, dsk__par_pending *w, int *blame) {
    const dsk_par_action *a = &s->actions[i];
    dsk_tensor t;
    int64_t req;
    int k;
    memset(&t, 0, sizeof t);
    if (a->kind == DSK_PAR_FORWARD || a->kind == DSK_PAR_BACKWARD || a->kind == DSK_PAR_FORWARD_BACKWARD)
        DSK__TRY(dsk__par_take_moving(s, pp, ctx, w, blame));
    switch (a->kind) {
    case DSK_PAR_FORWARD:
        DSK__TRY(dsk__par_await(s, pp, ctx, w, 0, a->micro, a->chunk, blame));
        *blame = i;
        return fns->forward(fns->user, a->micro, a->chunk);
    case DSK_PAR_BACKWARD:
        DSK__TRY(dsk__par_await(s, pp, ctx, w, 1, a->micro, a->chunk, blame));
        *blame = i;
        return fns->backward(fns->user, a->micro, a->chunk);
    case DSK_PAR_FORWARD_BACKWARD:
        DSK__TRY(dsk__par_await(s, pp, ctx, w, 0, a->micro, a->chunk, blame));
        DSK__TRY(dsk__par_await(s, pp, ctx, w, 1, a->bwd_micro, a->bwd_chunk, blame));
        *blame = i;
        if (fns->forward_backward)
            return fns->forward_backward(fns->user, a->micro, a->chunk, a->bwd_micro, a->bwd_chunk);
        DSK__TRY(fns->forward(fns->user, a->micro, a->chunk));
        return fns->backward(fns->user, a->bwd_micro, a->bwd_chunk);
    default:
        DSK__TRY(fns->buffer(fns->user, a, &t));
        if (!t.data || !dsk_tensor_is_contiguous(&t))
            return dsk_set_error(DSK_ERR_ARG, "the buffer callback gave an empty or non-contiguous tensor");
        if (a->kind == DSK_PAR_SEND_ACT || a->kind == DSK_PAR_SEND_GRAD)
            return dsk_comm_send(pp, ctx, t.data, dsk_tensor_numel(&t), t.dtype, a->peer);
        DSK__TRY(dsk_comm_recv_start(pp, ctx, t.data, dsk_tensor_numel(&t), t.dtype, a->peer, &req));
        /* a message its sender cannot leave in the transport's buffers: here, where its sender meets it */
        if ((int64_t)dsk_tensor_nbytes(&t) > dsk_comm_buffered_bytes(pp, a->peer)) return dsk_comm_wait(pp, ctx, req);
        k = dsk__par_slot(s, a->kind == DSK_PAR_RECV_GRAD, a->micro, a->chunk);
        w->req[k] = req;
        w->at[k] = i;
        return DSK_OK;
    }
}

DSK_API dsk_status dsk_par_pipeline_run(const dsk_par_schedule *s, dsk_comm *pp, dsk_ctx *ctx,
                                        const dsk_par_stage_fns *fns) {
    const char *fn = "dsk_par_pipeline_run";
    dsk__par_pending w = {NULL, NULL};
    dsk_status st = DSK_OK;
    int slots;
    if (!s || !s->actions || !fns || !fns->forward || !fns->backward || !fns->buffer)
        return dsk_set_error(DSK_ERR_ARG, "%s: schedule, its actions or a callback is NULL", fn);
    if (s->stages > 1 && (!pp || pp->world_size != s->stages || pp->rank != s->rank))
        return dsk_set_error(DSK_ERR_ARG, "%s: the schedule is rank %d of %d stages, the communicator rank %d of %d",
                             fn, s->rank, s->stages, pp ? pp->rank : -1, pp ? pp->world_size : 0);
    slots = 2 * s->micro * s->chunks;
    if (s->stages > 1) {
        w.req = (int64_t *)DSK_MALLOC((size_t)slots * sizeof *w.req);
        w.at = (int *)DSK_MALLOC((size_t)slots * sizeof *w.at);
        if (!w.req || !w.at) st = dsk_set_error(DSK_ERR_OOM, "%s: %d pending receives", fn, slots);
        for (int k = 0; st == DSK_OK && k < slots; k++) w.req[k] = w.at[k] = -1;
    }
    for (int i = 0; st == DSK_OK && i < s->n; i++) {
        int blame = i;
        dsk_status e = dsk__par_run_action(s, i, pp, ctx, fns, &w, &blame);
        if (e != DSK_OK) st = dsk__par_action_error(s, blame, e);
    }
    if (st == DSK_OK && s->stages > 1) st = dsk_comm_wait(pp, ctx, DSK_COMM_ALL_REQUESTS);
    DSK_FREE(w.req);
    DSK_FREE(w.at);
    return st;
}

DSK__FP_EXACT_END
#endif /* DSK_PAR_IMPLEMENTATION_DONE */
#endif /* DSK_PAR_IMPLEMENTATION */

/* MIT License. Copyright (c) 2026 the dsk authors. Permission is hereby granted, free of
   charge, to any person obtaining a copy of this software, to deal in the software without
   restriction, subject to including this notice. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT
   WARRANTY OF ANY KIND. */
