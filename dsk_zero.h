/* dsk_zero.h - sharded data parallelism: ZeRO-1, ZeRO-2 and ZeRO-3 over flat parameter and
   gradient slabs, overlapped with compute, with gradient compression (bf16, PowerSGD, FP8) and
   checkpoints that load at another data-parallel size.

   Usage: #define DSK_ZERO_IMPLEMENTATION in exactly one .c file before including (with the
   implementations of dsk_tensor.h, dsk_comm.h, dsk_amp.h and dsk_ckpt.h somewhere in the
   program). Needs POSIX threads: include this header first in that file or build with
   _GNU_SOURCE. Options: DSK_STATIC, DSK_MALLOC/DSK_FREE, DSK_CUDA, DSK_NO_CUDA as in dsk_tensor.h.

   Example (given dsk_comm *dp_comm, dsk_comm *world, dsk_ctx *ctx, const dsk_zero_param *ps, int n,
            dsk_amp_scaler *scaler, const dsk_adamw_opts *adamw, int64_t step, double max_norm, dsk_ckpt *ck):
       // ps[n]: name, shape, &value, &grad (the caller's tensor structs), unit (layer)
       dsk_zero_opts o; memset(&o, 0, sizeof o); o.stage = 2;
       dsk_zero z;                                                    // points value and grad into its slabs
       dsk_status st = dsk_zero_init(&z, dp_comm, ctx, ps, n, &o);
       for (int p = 0; p < n && st == DSK_OK; p++) {
           dsk_zero_piece pc;                                         // write elements [pc.first, pc.first +
           st = dsk_zero_get_piece(&z, p, &pc);                       // pc.count) of p's master weights
           // initialise pc.master
       }
       if (st == DSK_OK) st = dsk_zero_refresh(&z, ctx);              // compute copies from the masters
       // each step, each micro-batch (1 here, the step's last):
       for (int u = 0; u < z.n_units && st == DSK_OK; u++) {
           st = dsk_zero_forward_begin(&z, ctx, u);
           // forward of unit u
           if (st == DSK_OK) st = dsk_zero_forward_end(&z, ctx, u);
       }
       if (st == DSK_OK) st = dsk_zero_begin(&z, ctx, 1);             // 1: the last micro-batch
       for (int u = z.n_units - 1; u >= 0 && st == DSK_OK; u--) {
           st = dsk_zero_backward_begin(&z, ctx, u);
           // backward of unit u, calling dsk_zero_grad_ready(&z, ctx, p) once p's gradient is final
           if (st == DSK_OK) st = dsk_zero_backward_end(&z, ctx, u);
       }
       if (st == DSK_OK) st = dsk_zero_wait(&z, ctx);
       dsk_zero *zp = &z;
       dsk_amp_decision dec;                                          // ONE all-reduce of 2 f64:
       if (st == DSK_OK) st = dsk_zero_unscale_decide(&zp, 1, scaler, world, ctx, max_norm, &dec);
       if (st == DSK_OK) st = dsk_zero_step(&z, ctx, adamw, step, &dec);  // AdamW on this rank's shard
       if (st == DSK_OK) st = dsk_amp_update(scaler, ctx);
       // checkpoints (to load: DSK_ZERO_CKPT_LOAD, dsk_ckpt_load, then dsk_zero_refresh)
       const dsk_ckpt_entry *e = NULL;
       int ne = 0;
       if (st == DSK_OK) st = dsk_zero_ckpt_entries(&z, ctx, DSK_ZERO_CKPT_SAVE, &e, &ne);
       if (st == DSK_OK) st = dsk_ckpt_save(ck, step, e, ne, NULL, 0);
       dsk_zero_free(&z, ctx);
       return st;
   End of example.

   The contract.
   - One dsk_zero shards the parameters it is given over the ranks of one communicator (the
     data-parallel group; for expert parameters the ranks that hold the same experts: make one
     dsk_zero per group). Every rank of the group passes the same parameter list and options.
   - Parameters form units: consecutive parameters with the same `unit` id (ids non-decreasing
     along the list, forward order). A unit is the grain of everything: its gradients are
     reduced as one collective as soon as backward has marked all of them ready (overlapping
     the rest of backward), and in ZeRO-3 its weights are gathered as one collective. Each unit
     of E elements is split into N chunks of c = ceil(E / N) (the last padded with zeros);
     rank r owns chunk r of every unit. Parameter p's piece on rank r is the part of p inside
     rank r's chunks (possibly empty).
   - Stage 0 (DDP): every rank holds everything; gradients all-reduce; every rank steps all.
     Stage 1: f32 master weights and both AdamW moments exist only for this rank's pieces;
     gradients all-reduce in full (on the last micro-batch only); each rank steps its pieces and
     the updated compute-dtype weights are all-gathered, one collective per unit, overlapped
     with the next forward (dsk_zero_forward_begin waits for its unit only).
     Stage 2: also gradients: a unit's gradients live in one of opts.grad_buffers buffers from
     dsk_zero_backward_begin until its reduce-scatter is done; this rank keeps only its chunks
     (every micro-batch reduces and accumulates into them, in f32).
     Stage 3: also parameters: outside dsk_zero_forward_begin/backward_begin .. _end a unit's
     weights do not exist on the rank (value->data is NULL); begin gathers them into one of
     opts.param_buffers buffers (waiting only if its gather is not done yet) and prefetches the
     next unit (forward: u + 1, backward: u - 1) into another; end frees the buffer. The last
     unit may stay gathered from its forward to its backward (skip that forward_end).
   - Binding: value (compute dtype) and grad (f32) are the caller's tensor structs; dsk_zero
     sets data, dtype, shape and strides: for good in stages 0-2 (values) and 0-1 (grads),
     while gathered (stage 3 values) or from backward_begin to backward_end (stage 2-3 grads).
   - Reduction: the average over the group (the sum with opts.sum_only), then times grad_post_scale.
     The host backend folds ranks in rank order, so stages 0-3 give bitwise the same gradients,
     norms and weights for one micro-batch per step; with accumulation stages 2-3 reduce per
     micro-batch (sums in another order: equal within rounding).
   - Clipping and the skip decision: dsk_zero_unscale_decide unscales this rank's pieces only,
     sums their squares (dsk_amp_unscale), and joins (found_inf, sumsq) over `world` in ONE
     all-reduce, so every rank gets the same decision. Each gradient element must be owned by
     exactly one rank of `world` across the dsk_zero objects passed: true when the groups tile
     the world (dense parameters over the world, experts over the ranks holding the same experts).
   - Compression (opts.compress) of the gradient reduction: BF16 rounds the gradients to bf16
     (nearest even), reduces bf16 on the wire with f32 accumulation (the host backend folds in
     f32 and rounds once), and widens the result to f32. POWERSGD follows PyTorch's
     powerSGD_hook per unit: plain reductions for passes < powersgd_start_iter; then with error
     feedback M += E; tensors with ndim >= 2 viewed as (shape[0], rest) and compressed when
     (n + m) r' min_compression_rate < n m (r' = min(n, m, rank)), the others all-reduced (AVG);
     Q from N(0, 1) (stream dsk_zero_powersgd_key) orthogonalised on first use (and every pass
     without warm start), else the previous Q orthogonalised again; P = M Q, all-reduce SUM,
     orthogonalise P (Gram-Schmidt; a zero column stays zero), Q = M^T P, all-reduce AVG,
     M <- P Q^T, E = M_in - M. The approximation is the same on every rank; stages 2-3 keep
     their chunks of it. Gram-Schmidt equals PyTorch's QR up to column signs, which cancel in P Q^T.
     FP8 (CPU and CUDA tensors): a unit's gradients, seen as (N, c) (rank p's chunk is row p),
     are quantised in 1x128 tiles by dsk_amp_fp8_block_quantize (scale d = amax / 448, codes
     e4m3(x / d)); an all-to-all of the codes and one of the scales bring every rank's copy of
     chunk r to rank r, which dequantises them (code * d) and sums them in f32 in rank order.
     Stages 2-3 keep that sum; stages 0-1 quantise it again the same way and all-gather codes and
     scales, so every rank holds the same dequantised values. Last, times grad_post_scale (and
     1 / N for the average: one f32 multiplier), rounded once. Per unit the message is N c code
     bytes and 4 N ceil(c / 128) scale bytes, about 3.9x fewer than f32 (bf16: 2x); stages 0-1
     send it twice (all-to-all, all-gather), as a ring all-reduce does. A tile holding an Inf or
     NaN gets a non-finite scale and dequantises to NaN everywhere, so the sum and the skip
     decision see it. fp8_error_feedback = 1 keeps each rank's residual g - dequantised codes of
     the first quantisation and adds it to the next pass's gradients (the reduced sum's second
     quantisation in stages 0-1 is not fed back); a skipped step (dec->skip) drops the residuals,
     which then hold the non-finite pass. Off by default: it costs a padded f32 copy of every
     unit's gradients on every rank (in stages 2-3 more than the sharded gradients themselves),
     and round-to-nearest with per-tile scales errs by at most 2^-4 |x| (|x| >= 2^-6 d) or
     2^-10 d (below it) per element, without bias in the scale; tests/test_zero_train.sh measures
     a dp2 run against uncompressed.
   - Bytes: dsk_zero.stats counts collectives, the bytes handed to the gradient reductions and
     what they would be uncompressed (plain_bytes), the all-gathers, and the wire bytes of the
     private communicator. FP8 counts its message (codes and scales) once per unit in
     reduce_bytes, as an all-reduce or reduce-scatter of it would be counted.
   - Memory: dsk_zero.memory holds the bytes this object allocated per role, read from the
     allocator (dsk_tensor_mem_stats) around each allocation at init; nothing is allocated later.
   - Checkpoints: every parameter is saved as three f32 tensors of its global shape, "<name>"
     (master), "<name>.adam_m", "<name>.adam_v": the global tensor it is a box of (global_shape
     and offset: expert rows, tensor-parallel shards), else its own shape. Each rank writes its
     pieces: a piece [a, b) of the flattened tensor is at most 2 ndim - 1 boxes of the global
     tensor (dsk_ckpt box entries), so every element is written once over the group. A load asks
     for this rank's pieces (stage 0: the whole tensor) and dsk_ckpt reads them from whichever
     files hold them, so a checkpoint loads at any group size, in any stage and in any layout
     that cuts the global tensors otherwise; the names and shapes are those of a plain model
     checkpoint (the weights and moments under their tensors' names).
   - Devices and threads: the reductions and gathers run in order on a private communicator
     split from the group at init, so the caller's communicators stay free. CPU tensors (ctx
     NULL or on the CPU) go over the host backend, run by a progress thread. CUDA tensors (ctx on
     a device, DSK_CUDA builds) go over nccl on a communication stream: each collective waits
     for an event on ctx's stream and the caller's stream waits for its event in turn, so begin
     calls never block the host; dsk_zero_wait, _step, _refresh and _ckpt_entries wait for the
     stream (polling nccl for errors). PowerSGD runs on CPU tensors only. Every rank must make
     the same sequence of calls. A peer that dies or hangs makes the call that waits for it fail
     within the communicator's timeout with the error naming the rank (on CUDA: the next call
     that waits on the host); the object then returns that error until freed.
   License: MIT, see the end of the file. */

/* Contents
     declarations
       options                  dsk_zero_compress, dsk_zero_opts
       parameters and state     dsk_zero_param, dsk_zero_memory, dsk_zero_stats, dsk_zero, dsk_zero_piece
       lifetime and weights     dsk_zero_init, dsk_zero_plan (sizes without memory), dsk_zero_free,
                                dsk_zero_get_piece, dsk_zero_refresh
       a training step          dsk_zero_begin, dsk_zero_forward_begin/end, dsk_zero_backward_begin/end,
                                dsk_zero_grad_ready, dsk_zero_wait, dsk_zero_unscale_decide, dsk_zero_step
       checkpoints              dsk_zero_ckpt_mode, dsk_zero_ckpt_entries
       PowerSGD helpers         dsk_zero_powersgd_key, dsk_zero_powersgd_compresses
     implementation (DSK_ZERO_IMPLEMENTATION)
       state; layout; progress thread (the operations: reductions plain, bf16, PowerSGD and FP8, gathers;
       the queue, issue on CUDA, waits); init and free; weights; units (gather, release, gradient
       buffers, the pass); the step; checkpoints */

#if defined(DSK_ZERO_IMPLEMENTATION) && !defined(_GNU_SOURCE) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L
#endif
/* With DSK_STATIC every dsk function is static, so this file must also compile its dependencies. */
#if defined(DSK_STATIC) && defined(DSK_ZERO_IMPLEMENTATION)
#ifndef DSK_TENSOR_IMPLEMENTATION
#define DSK_TENSOR_IMPLEMENTATION
#endif
#ifndef DSK_COMM_IMPLEMENTATION
#define DSK_COMM_IMPLEMENTATION
#endif
#ifndef DSK_AMP_IMPLEMENTATION
#define DSK_AMP_IMPLEMENTATION
#endif
#ifndef DSK_CKPT_IMPLEMENTATION
#define DSK_CKPT_IMPLEMENTATION
#endif
#endif
#ifndef DSK_ZERO_H
#define DSK_ZERO_H
#include "dsk_tensor.h"
#include "dsk_comm.h"
#include "dsk_amp.h"
#include "dsk_ckpt.h"
DSK__FP_EXACT_BEGIN
#ifdef __cplusplus
extern "C" {
#endif

/* ---- options */

typedef enum dsk_zero_compress {
    DSK_ZERO_COMPRESS_NONE = 0, /* f32 reductions */
    DSK_ZERO_COMPRESS_BF16,     /* bf16 on the wire, f32 accumulation */
    DSK_ZERO_COMPRESS_POWERSGD, /* PowerSGD rank powersgd_rank with error feedback and warm start */
    DSK_ZERO_COMPRESS_FP8       /* e4m3 codes with 1x128 f32 scales on the wire, f32 accumulation */
} dsk_zero_compress;

/* Zero fields take the defaults in brackets. */
typedef struct dsk_zero_opts {
    int stage;                 /* [0] 0 (DDP), 1, 2 or 3 */
    dsk_dtype compute_dtype;   /* [f32] f32, bf16 or f16: the dtype of the weights forward reads */
    dsk_dtype moment_dtype;    /* [f32] f32 or bf16: AdamW's two moments (bf16, as DeepSeek-V3: half their bytes) */
    int sum_only;              /* [0]: average over the group; 1: plain sum */
    float grad_post_scale;     /* [1] multiplies the reduced gradients (e.g. 1/world for a SUM over experts) */
    int param_buffers;         /* [2] stage 3: units gathered at once (>= 2: the current one and a prefetch) */
    int grad_buffers;          /* [2] stages 2-3: units whose full gradients exist at once (>= 1) */
    dsk_zero_compress compress; /* [NONE] */
    int powersgd_rank;         /* [1] matrix approximation rank */
    int powersgd_start_iter;   /* [0] plain reductions for the passes before this one (PyTorch's default is
                                  1000, its older one 10) */
    double powersgd_min_compression_rate; /* [2] compress a matrix when (n + m) r' times this < n m */
    int powersgd_no_error_feedback;       /* [0] error feedback on */
    int powersgd_no_warm_start;           /* [0] warm start on: Q carries over from pass to pass */
    float powersgd_epsilon;               /* [0] added to column norms when orthogonalising */
    uint64_t powersgd_seed;               /* [0] stream of the random Q */
    int fp8_error_feedback; /* [0] FP8: 1 adds each pass's quantisation residual to the next pass's gradients */
} dsk_zero_opts;

/* ---- parameters and state */

/* One trainable tensor, as this rank holds it. */
typedef struct dsk_zero_param {
    const char *name;            /* checkpoint name and messages (copied) */
    int ndim;                    /* 1 .. DSK_MAX_DIMS */
    int64_t shape[DSK_MAX_DIMS]; /* this rank's tensor, numel >= 1 */
    dsk_tensor *value;           /* the caller's struct, bound to the compute-dtype weights */
    dsk_tensor *grad;            /* the caller's struct, bound to the f32 gradient */
    int unit;                    /* unit (layer) id >= 0, non-decreasing along the list */
    int no_decay;                /* 1: no weight decay (norm weights, biases) */
    int64_t global_shape[DSK_MAX_DIMS]; /* [all 0: this tensor is the whole tensor] the global tensor this one
                                           is a box of (ndim values: expert rows, tensor-parallel shards) */
    int64_t offset[DSK_MAX_DIMS];       /* with global_shape: where this rank's box starts in it */
} dsk_zero_param;

/* Bytes this object allocated, by role, read from the allocator. */
typedef struct dsk_zero_memory {
    int64_t params;    /* compute-dtype weights: the full slab (stages 0-2), or the shard and the
                          gather buffers (stage 3; f32 weights share the master shard) */
    int64_t grads;     /* the full f32 gradient slab (stages 0-1), or the shard and unit buffers (2-3) */
    int64_t optimizer; /* f32 master weights (where not the weights themselves) and both moments */
    int64_t comm;      /* compression: bf16 staging, PowerSGD error feedback, P, Q and scratch, FP8 codes,
                          scales, the dequantised rows and the residual */
} dsk_zero_memory;

/* Cumulative figures of the collectives; dsk_zero_wait and dsk_zero_step update them. */
typedef struct dsk_zero_stats {
    int64_t collectives;     /* collectives issued */
    int64_t passes;          /* reduction passes (backward passes that reduced) */
    uint64_t reduce_bytes;   /* gradient reductions: elements handed over times their size (whole message) */
    uint64_t plain_bytes;    /* what the same reductions hand over uncompressed (f32) */
    uint64_t gather_bytes;   /* weight all-gathers: the gathered message */
    uint64_t sent_bytes, received_bytes; /* on the wire, from the private communicator */
    double seconds;          /* the progress thread's busy time (CPU) */
    double wait_seconds;     /* time the caller spent blocked on it */
} dsk_zero_stats;

typedef struct dsk__zero_impl dsk__zero_impl;
typedef struct dsk_zero {
    int stage, rank, world_size, n_params, n_units;
    dsk_zero_memory memory;
    dsk_zero_stats stats;
    dsk__zero_impl *impl;
} dsk_zero;

/* This rank's part of parameter p's optimizer state: elements [first, first + count) of the
   flattened parameter, as 1-D views (count may be 0; m and v in the moment dtype). Stage 0: the whole parameter.
   grad: the reduced gradient of those elements, valid from dsk_zero_wait to the next pass. */
typedef struct dsk_zero_piece {
    int64_t first, count;
    dsk_tensor master, m, v, grad;
} dsk_zero_piece;

/* ---- lifetime and weights */

/* Collective over c (NULL: this rank alone, a group of one). Checks the list and options, lays
   out and allocates every slab and buffer (moments zeroed, master weights zeroed until the
   caller writes them), binds the views, splits a private communicator and starts the progress
   thread. On failure *z is zeroed. */
DSK_API dsk_status dsk_zero_init(dsk_zero *z, dsk_comm *c, dsk_ctx *ctx, const dsk_zero_param *params, int n,
                                 const dsk_zero_opts *opts);
/* What one rank's dsk_zero would hold and move, without allocating or communicating: the
   layout and the list of slabs dsk_zero_init allocates (the same code), so `memory` equals
   dsk_zero.memory after dsk_zero_init on rank `rank` of a group of `world_size` given the same
   list (value and grad may be NULL here). Per reducing pass (stages 0-1: the last micro-batch of
   a step; 2-3: every micro-batch): the bytes handed to the reductions and uncompressed, and the
   collectives; per gather of every unit (stages 1-2: once per step; 3: before each unit's
   forward and backward): the gathered bytes. These equal dsk_zero.stats' increments for
   compression NONE and BF16; under POWERSGD the reduction bytes depend on the pass (the plain
   start) and are given as the uncompressed ones. */
typedef struct dsk_zero_plan_out {
    dsk_zero_memory memory;
    int n_units;
    int64_t reduce_collectives;      /* per reducing pass: one per unit */
    uint64_t reduce_bytes;           /* per reducing pass */
    uint64_t plain_bytes;            /* per reducing pass, uncompressed (f32) */
    uint64_t gather_bytes;           /* per gather of every unit (stages 1-3; 0 at stage 0) */
    int64_t full_elems, shard_elems; /* every unit padded to world_size chunks; this rank's chunks */
} dsk_zero_plan_out;
DSK_API dsk_status dsk_zero_plan(const dsk_zero_param *params, int n, int world_size, int rank,
                                 const dsk_zero_opts *opts, dsk_zero_plan_out *out);
/* Drains the progress thread, frees everything, unbinds the caller's views (data NULL).
   Zeroed or freed objects are fine. */
DSK_API void dsk_zero_free(dsk_zero *z, dsk_ctx *ctx);
/* Parameter p's piece on this rank (see dsk_zero_piece). */
DSK_API dsk_status dsk_zero_get_piece(const dsk_zero *z, int p, dsk_zero_piece *out);
/* Collective. Rebuilds the compute-dtype weights from the masters (round to nearest even) and,
   in stages 1-2, all-gathers them; after the caller wrote master weights (initialisation, a
   checkpoint load). Stage 3 drops any gathered unit. */
DSK_API dsk_status dsk_zero_refresh(dsk_zero *z, dsk_ctx *ctx);

/* ---- a training step */

/* Starts a backward pass (a micro-batch), ending the one before (whose reductions may still
   run; stages 0-1 wait for them, as they reduce in place). sync = 0: stages 0-1 accumulate
   without reducing; sync = 1 (the last micro-batch): units reduce as they complete. Stages 2-3
   reduce every pass. The first pass after a step (or init) starts the accumulation from zero. */
DSK_API dsk_status dsk_zero_begin(dsk_zero *z, dsk_ctx *ctx, int sync);
/* The unit's weights are needed for its forward: stages 1-2 wait for its all-gather after a
   step; stage 3 gathers it (or waits for its prefetch) and prefetches unit + 1. A unit id this
   object does not hold is a no-op. */
DSK_API dsk_status dsk_zero_forward_begin(dsk_zero *z, dsk_ctx *ctx, int unit);
/* Stage 3: frees the unit's gathered weights. Other stages: nothing. */
DSK_API dsk_status dsk_zero_forward_end(dsk_zero *z, dsk_ctx *ctx, int unit);
/* Before the unit's backward: stage 3 gathers (prefetching unit - 1); stages 2-3 bind its
   gradients to a zeroed buffer (waiting for a reduce-scatter to free one if all are busy). */
DSK_API dsk_status dsk_zero_backward_begin(dsk_zero *z, dsk_ctx *ctx, int unit);
/* Parameter `param`'s gradient is final for this pass; the unit's reduction starts (on the
   progress thread) once all its parameters are marked. */
DSK_API dsk_status dsk_zero_grad_ready(dsk_zero *z, dsk_ctx *ctx, int param);
/* After the unit's backward: stage 3 frees its weights; stages 2-3 unbind its gradients. */
DSK_API dsk_status dsk_zero_backward_end(dsk_zero *z, dsk_ctx *ctx, int unit);
/* Ends the pass: waits for every started reduction; in a reducing pass every parameter must have
   been marked. */
DSK_API dsk_status dsk_zero_wait(dsk_zero *z, dsk_ctx *ctx);
/* Unscale + non-finite check + global norm over the pieces of zs[0..n) (waited for here):
   dsk_amp_unscale on this rank's pieces, then ONE all-reduce SUM of the two f64 stats over
   `world` (NULL or 1 rank: none), dsk_amp_stats_set, dsk_amp_decide(stats, max_norm). Stage 0
   objects also unscale the rest of their gradients (their AdamW reads all of it). */
DSK_API dsk_status dsk_zero_unscale_decide(dsk_zero *const *zs, int n, dsk_amp_scaler *sc, dsk_comm *world,
                                           dsk_ctx *ctx, double max_norm, dsk_amp_decision *dec);
/* AdamW (dsk_adamw_step at `step`, grad_mult = dec->grad_mult, weight decay 0 for no_decay
   parameters) on this rank's pieces, refreshing the compute copies (round to nearest even);
   stages 1-2 then start the all-gathers of the updated weights. Nothing when dec->skip. */
DSK_API dsk_status dsk_zero_step(dsk_zero *z, dsk_ctx *ctx, const dsk_adamw_opts *opts, int64_t step,
                                 const dsk_amp_decision *dec);

/* ---- checkpoints */

typedef enum dsk_zero_ckpt_mode {
    DSK_ZERO_CKPT_SAVE = 0, /* this rank's pieces (empty ones left out) */
    DSK_ZERO_CKPT_LOAD = 1  /* what this rank holds: its pieces (stage 0: whole tensors) */
} dsk_zero_ckpt_mode;
/* Entries for dsk_ckpt_save / dsk_ckpt_load (see the top of the file): master, adam_m, adam_v
   of every parameter. *entries and the tensors and names it points to belong to z and stay
   valid until the next call or dsk_zero_free. Waits for pending collectives first. */
DSK_API dsk_status dsk_zero_ckpt_entries(dsk_zero *z, dsk_ctx *ctx, dsk_zero_ckpt_mode mode,
                                         const dsk_ckpt_entry **entries, int *n);

/* ---- PowerSGD helpers */

/* Key of the random stream of parameter p's initial Q at reduction pass `iter`: element j of
   the (m, r) matrix is dsk_rng_normal_at(key, 0, j). */
static inline DSK_HD uint64_t dsk_zero_powersgd_key(uint64_t seed, uint64_t p, uint64_t iter) {
    uint32_t a[4], b[4];
    dsk_philox4x32(seed ^ 0x7A45524F50534744ull, p, a); /* "zEROPSGD" */
    dsk_philox4x32(((uint64_t)a[1] << 32) | a[0], iter, b);
    return ((uint64_t)b[1] << 32) | b[0];
}
/* PyTorch's _should_compress for a tensor viewed as (rows, cols), plus ndim >= 2. */
static inline int dsk_zero_powersgd_compresses(int ndim, int64_t rows, int64_t cols, int rank, double min_rate) {
    int64_t r = rank < rows ? rank : rows;
    if (cols < r) r = cols;
    return ndim >= 2 && (double)((rows + cols) * r) * min_rate < (double)(rows * cols);
}

#ifdef __cplusplus
}
#endif
DSK__FP_EXACT_END
#endif /* DSK_ZERO_H */

/* ==================================================================== implementation */
#ifdef DSK_ZERO_IMPLEMENTATION
#ifndef DSK_ZERO_IMPLEMENTATION_DONE
#define DSK_ZERO_IMPLEMENTATION_DONE
DSK__FP_EXACT_BEGIN

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* ---------------------------------------------------------------- state */

enum { DSK__ZERO_RELEASED = 0, DSK__ZERO_GATHERING, DSK__ZERO_RESIDENT };
enum { DSK__ZERO_OP_GATHER = 1, DSK__ZERO_OP_REDUCE };

typedef struct dsk__zero_p {
    char *name;
    int ndim;
    int64_t shape[DSK_MAX_DIMS];
    int64_t numel, rows, cols; /* cols = numel / rows: the (rows, cols) view of PowerSGD */
    dsk_tensor *value, *grad;
    int unit, no_decay, marked;
    int64_t uoff;              /* offset in its unit */
    int64_t own_a, own_b;      /* this rank's piece [own_a, own_b) of the flattened parameter */
    int64_t g_shape[DSK_MAX_DIMS], g_at[DSK_MAX_DIMS]; /* the global tensor it is a box of, the box's start */
    int psgd;                  /* PowerSGD compresses it */
    int64_t rank_r, p_off, q_off; /* its P (rows, r) and Q (cols, r) in the unit's P and Q memory */
} dsk__zero_p;

typedef struct dsk__zero_u {
    int id, p0, np;
    int64_t numel, chunk, full_off, shard_off;
    int pstate, pbuf, gbuf, pending, reduced;
    int64_t bwd_pass;                    /* the pass whose backward bound its gradient buffer */
    int64_t gather_ticket, reduce_ticket;
    int64_t p_elems, q_elems, unc_elems; /* PowerSGD: P and Q memory, uncompressed elements */
    int64_t err_off, pq_off;             /* its error-feedback and P/Q memory in the shared slabs */
    int has_err, has_q;
} dsk__zero_u;

typedef struct dsk__zero_op {
    int kind, unit, accumulate;
    int64_t ticket, iter;
    float *grads; /* REDUCE: the unit's full gradients */
} dsk__zero_op;

struct dsk__zero_impl {
    int stage, rank, world;
    int dev;              /* 1: CUDA tensors over nccl (collectives on a stream), 0: CPU over the host backend */
    int alone;            /* no communicator: a group of one rank */
    dsk_device device;
    dsk_comm comm;        /* private, split from the group */
    dsk_ctx pctx;         /* where operations run: the progress thread's CPU context (one thread), or a copy
                             of the caller's CUDA context on the communication stream */
    dsk_zero_opts o;
    dsk__zero_p *p;
    dsk__zero_u *u;
    size_t cesz;          /* bytes of a compute-dtype element */
    int64_t full, shard, max_unit, max_chunk; /* padded full size, shard size, largest N c, largest c */
    int master_in_full;   /* f32 weights, stages 0-2: the master is the weights slab itself */
    dsk_tensor full_w, full_g, master, m, v, shard_w, shard_g, rs_tmp;
    dsk_tensor *pbufs, *gbufs;
    int *pbuf_owner, *gbuf_owner;
    dsk_tensor wire16, chunk16;                 /* bf16 staging */
    dsk_tensor err, pq, cp, unc;                /* PowerSGD; err also FP8's residual */
    dsk_tensor q8, rq8, sc8, rsc8, deq8;        /* FP8: codes and scales sent and received, dequantised rows */
    int in_pass, sync, fresh, have_gathers;
    int dry;                             /* dsk_zero_plan: slabs are counted, not allocated */
    int64_t iter, pass;                  /* reducing passes so far (PowerSGD's iteration); passes begun */
    /* progress thread and its queue of tickets [done + 1, next] */
    pthread_t thread;
    int thread_started, stop, mu_ready;
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    dsk__zero_op *q;
    int64_t qcap, next_ticket, done_ticket, head;
    dsk_status err_status;
    char errmsg[1200];
#ifdef DSK_CUDA
    void *cs;                   /* the communication stream (dev) */
    void **ev_ready, **ev_done; /* [qcap]: the caller's stream reached the op; the op is done */
#endif
    int64_t st_collectives;
    uint64_t st_reduce, st_plain, st_gather;
    double st_seconds;
    /* checkpoint entries */
    dsk_ckpt_entry *ck_e;
    dsk_tensor *ck_t;
    int64_t (*ck_at)[DSK_MAX_DIMS]; /* each entry's offset in its global tensor */
    char *ck_names;
    int ck_n;
};

#define DSK__ZERO_NAME_MAX 160

static double dsk__zero_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static dsk_status dsk__zero_need(const dsk_zero *z, const char *fn) {
    if (!z || !z->impl) return dsk_set_error(DSK_ERR_ARG, "%s: zero object is NULL or not initialised", fn);
    return DSK_OK;
}

/* A 1-D view of n elements of slab `s` from element `off`. */
static dsk_tensor dsk__zero_view(const dsk_tensor *s, int64_t off, int64_t n) {
    dsk_tensor v;
    memset(&v, 0, sizeof v);
    v.data = (char *)s->data + off * (int64_t)dsk_dtype_size(s->dtype);
    v.dtype = s->dtype;
    v.device = s->device;  /* the slab's: the object's device */
    v.ndim = 1;
    v.shape[0] = n;
    v.stride[0] = 1;
    return v;
}

/* Points the caller's struct at data with parameter p's shape (data NULL: unbound). */
static void dsk__zero_bind(dsk_tensor *t, const dsk__zero_p *p, void *data, dsk_dtype dt, dsk_device dev) {
    int64_t s = 1;
    memset(t, 0, sizeof *t);
    t->data = data;
    t->dtype = dt;
    t->device = dev;
    t->ndim = p->ndim;
    for (int d = p->ndim - 1; d >= 0; d--) {
        t->shape[d] = p->shape[d];
        t->stride[d] = s;
        s *= p->shape[d];
    }
}

static int dsk__zero_unit_of(const dsk__zero_impl *zi, int n_units, int id) {
    int lo = 0, hi = n_units - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (zi->u[mid].id == id) return mid;
        if (zi->u[mid].id < id) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

/* ---------------------------------------------------------------- layout */

/* Element offset, in the optimizer slabs (master, m, v), of element `a` of unit u (a inside
   this rank's chunk, or anywhere in stage 0, whose optimizer slabs have the full layout). */
static int64_t dsk__zero_opt_off(const dsk_zero *z, const dsk__zero_u *u, int64_t a) {
    if (z->stage == 0) return u->full_off + a;
    return u->shard_off + a - (int64_t)z->rank * u->chunk;
}

/* The master weights of elements [a, b) of parameter p (offsets in p). */
static dsk_tensor dsk__zero_master_of(const dsk_zero *z, const dsk__zero_p *p, int64_t a, int64_t b) {
    const dsk__zero_impl *zi = z->impl;
    const dsk__zero_u *u = &zi->u[p->unit];
    if (zi->master_in_full) return dsk__zero_view(&zi->full_w, u->full_off + p->uoff + a, b - a);
    return dsk__zero_view(&zi->master, dsk__zero_opt_off(z, u, p->uoff + a), b - a);
}

/* The reduced f32 gradient of elements [a, b) of parameter p (this rank's piece in stages 1-3). */
static dsk_tensor dsk__zero_grad_of(const dsk_zero *z, const dsk__zero_p *p, int64_t a, int64_t b) {
    const dsk__zero_impl *zi = z->impl;
    const dsk__zero_u *u = &zi->u[p->unit];
    if (z->stage <= 1) return dsk__zero_view(&zi->full_g, u->full_off + p->uoff + a, b - a);
    return dsk__zero_view(&zi->shard_g, u->shard_off + p->uoff + a - (int64_t)z->rank * u->chunk, b - a);
}

/* Where AdamW writes the compute copy of elements [a, b) of p, or a zeroed tensor when the
   master is the compute weights. */
static dsk_tensor dsk__zero_copy_of(const dsk_zero *z, const dsk__zero_p *p, int64_t a, int64_t b) {
    const dsk__zero_impl *zi = z->impl;
    const dsk__zero_u *u = &zi->u[p->unit];
    dsk_tensor none;
    memset(&none, 0, sizeof none);
    if (zi->o.compute_dtype == DSK_F32) return none;
    if (z->stage <= 2) return dsk__zero_view(&zi->full_w, u->full_off + p->uoff + a, b - a);
    return dsk__zero_view(&zi->shard_w, u->shard_off + p->uoff + a - (int64_t)z->rank * u->chunk, b - a);
}

/* The compute-dtype shard stage 3 gathers from: its own slab, or the f32 master shard. */
static const dsk_tensor *dsk__zero_send_shard(const dsk__zero_impl *zi) {
    return zi->o.compute_dtype == DSK_F32 ? &zi->master : &zi->shard_w;
}

/* ---------------------------------------------------------------- progress thread */

/* A 1-D tensor over n elements at p on the object's device. */
static dsk_tensor dsk__zero_t(const dsk__zero_impl *zi, void *p, dsk_dtype dt, int64_t n) {
    dsk_tensor t;
    memset(&t, 0, sizeof t);
    t.data = p;
    t.dtype = dt;
    t.device = zi->device;
    t.ndim = 1;
    t.shape[0] = n;
    t.stride[0] = 1;
    return t;
}

/* The communicator's ctx for collectives: none on the host backend, the stream's on nccl. */
static dsk_ctx *dsk__zero_cctx(dsk__zero_impl *zi) { return zi->dev ? &zi->pctx : NULL; }

/* The collectives on the private communicator; without one (a group of one rank) what they
   would give: the reductions of one rank leave it as it is, the gathers copy. */
static dsk_status dsk__zero_copy_n(dsk__zero_impl *zi, void *dst, const void *src, int64_t n, dsk_dtype dt) {
    dsk_tensor d = dsk__zero_t(zi, dst, dt, n), x = dsk__zero_t(zi, (void *)src, dt, n);
    return dst == src || n == 0 ? DSK_OK : dsk_tensor_copy(&zi->pctx, &d, &x);
}
static dsk_status dsk__zero_all_reduce(dsk__zero_impl *zi, void *buf, int64_t n, dsk_dtype dt, dsk_comm_op op) {
    return zi->alone ? DSK_OK : dsk_comm_all_reduce(&zi->comm, dsk__zero_cctx(zi), buf, buf, n, dt, op);
}
static dsk_status dsk__zero_reduce_scatter(dsk__zero_impl *zi, const void *send, void *recv, int64_t n, dsk_dtype dt,
                                           dsk_comm_op op) {
    return zi->alone ? dsk__zero_copy_n(zi, recv, send, n, dt)
                     : dsk_comm_reduce_scatter(&zi->comm, dsk__zero_cctx(zi), send, recv, n, dt, op);
}
static dsk_status dsk__zero_all_gather(dsk__zero_impl *zi, const void *send, void *recv, int64_t n, dsk_dtype dt) {
    return zi->alone ? dsk__zero_copy_n(zi, recv, send, n, dt)
                     : dsk_comm_all_gather(&zi->comm, dsk__zero_cctx(zi), send, recv, n, dt);
}

/* dst (n) <- src * s, or dst += src * s when accumulating (src is scratch: it may be scaled in
   place); the products are rounded to f32 before the sum. */
static dsk_status dsk__zero_land(dsk__zero_impl *zi, float *dst, float *src, int64_t n, float s, int accumulate) {
    dsk_tensor d = dsk__zero_t(zi, dst, DSK_F32, n), x = dsk__zero_t(zi, src, DSK_F32, n);
    if (accumulate) {
        if (s != 1.0f) DSK__TRY(dsk_scale(&zi->pctx, &x, s));
        return dsk_add(&zi->pctx, &d, &d, &x);
    }
    if (dst != src) DSK__TRY(dsk_tensor_copy(&zi->pctx, &d, &x));
    return s != 1.0f ? dsk_scale(&zi->pctx, &d, s) : DSK_OK;
}

/* Rounds n f32 to bf16 (nearest even: dsk_amp_cast's loop), or widens bf16 back to f32. */
static dsk_status dsk__zero_cast(dsk__zero_impl *zi, void *dst, dsk_dtype dd, void *src, dsk_dtype sd, int64_t n) {
    dsk_tensor d = dsk__zero_t(zi, dst, dd, n), x = dsk__zero_t(zi, src, sd, n);
    if (sd == DSK_F32) return dsk_amp_cast(&zi->pctx, &d, &x, DSK_AMP_ROUND_NEAREST, 0, 0, 0);
    if (zi->dev) return dsk_tensor_copy(&zi->pctx, &d, &x);
    for (int64_t i = 0; i < n; i++) ((float *)dst)[i] = dsk_bf16_to_f32(((const uint16_t *)src)[i]);
    return DSK_OK;
}

/* Counts a finished reduction (bytes handed over, uncompressed bytes) or gather (gathered bytes). */
static dsk_status dsk__zero_coll_done(dsk__zero_impl *zi, dsk_status st, uint64_t reduce, uint64_t plain,
                                      uint64_t gather) {
    if (st != DSK_OK) return st;
    pthread_mutex_lock(&zi->mu);
    zi->st_collectives++;
    zi->st_reduce += reduce;
    zi->st_plain += plain;
    zi->st_gather += gather;
    pthread_mutex_unlock(&zi->mu);
    return DSK_OK;
}

/* Gram-Schmidt on the columns of x (rows, r), row-major, as PyTorch's _orthogonalize: each
   column normalised (norm + eps; a zero norm with eps 0 leaves a zero column), then removed
   from the columns after it. Dot products in f64. */
static void dsk__zero_orthogonalize(float *x, int64_t rows, int64_t r, float eps) {
    for (int64_t i = 0; i < r; i++) {
        double ss = 0.0;
        for (int64_t j = 0; j < rows; j++) ss += (double)x[j * r + i] * (double)x[j * r + i];
        float nrm = (float)sqrt(ss), den = nrm + eps;
        for (int64_t j = 0; j < rows; j++) x[j * r + i] = den > 0.0f ? x[j * r + i] / den : 0.0f;
        for (int64_t k = i + 1; k < r; k++) {
            double dot = 0.0;
            for (int64_t j = 0; j < rows; j++) dot += (double)x[j * r + i] * (double)x[j * r + k];
            for (int64_t j = 0; j < rows; j++) x[j * r + k] -= (float)dot * x[j * r + i];
        }
    }
}

static dsk_status dsk__zero_mm(dsk__zero_impl *zi, float *c, int64_t cr, int64_t cc, const float *a, int64_t ar,
                               int64_t ac, int ta, const float *b, int64_t br, int64_t bc, int tb) {
    dsk_tensor A, B, C;
    int64_t sa[2] = {ar, ac}, sb[2] = {br, bc}, sc[2] = {cr, cc};
    DSK__TRY(dsk_tensor_wrap(&A, (void *)a, DSK_F32, dsk_cpu(), 2, sa));
    DSK__TRY(dsk_tensor_wrap(&B, (void *)b, DSK_F32, dsk_cpu(), 2, sb));
    DSK__TRY(dsk_tensor_wrap(&C, c, DSK_F32, dsk_cpu(), 2, sc));
    return dsk_matmul(&zi->pctx, &C, &A, ta, &B, tb, 1.0f, 0.0f);
}

/* PowerSGD on unit u's full gradients g (numel elements): leaves the approximation of their
   average (or sum) over the group in g. See the top of the file. */
static dsk_status dsk__zero_powersgd(dsk__zero_impl *zi, dsk__zero_u *u, float *g, int64_t iter) {
    const dsk_zero_opts *o = &zi->o;
    int64_t n = u->numel;
    float *err = (float *)zi->err.data + u->err_off, *cp = (float *)zi->cp.data, *unc = (float *)zi->unc.data;
    float *pm = (float *)zi->pq.data + u->pq_off, *qm = pm + u->p_elems;
    int ef = !o->powersgd_no_error_feedback;
    dsk_comm_op cop = o->sum_only ? DSK_COMM_SUM : DSK_COMM_AVG;
    if (ef) {
        if (u->has_err)
            for (int64_t i = 0; i < n; i++) g[i] += err[i];
        memcpy(cp, g, (size_t)n * sizeof(float));
    }
    if (u->unc_elems > 0) { /* the tensors PowerSGD leaves alone, packed and all-reduced */
        int64_t k = 0;
        for (int i = u->p0; i < u->p0 + u->np; i++)
            if (!zi->p[i].psgd) {
                memcpy(unc + k, g + zi->p[i].uoff, (size_t)zi->p[i].numel * sizeof(float));
                k += zi->p[i].numel;
            }
        DSK__TRY(dsk__zero_coll_done(zi, dsk__zero_all_reduce(zi, unc, k, DSK_F32, cop),
                                     (uint64_t)k * 4u, 0, 0));
        k = 0;
        for (int i = u->p0; i < u->p0 + u->np; i++)
            if (!zi->p[i].psgd) {
                memcpy(g + zi->p[i].uoff, unc + k, (size_t)zi->p[i].numel * sizeof(float));
                k += zi->p[i].numel;
            }
    }
    if (u->p_elems > 0) {
        int fresh = !u->has_q || o->powersgd_no_warm_start;
        for (int i = u->p0; i < u->p0 + u->np; i++) {
            dsk__zero_p *p = &zi->p[i];
            float *q = qm + p->q_off;
            if (!p->psgd) continue;
            if (fresh) {
                uint64_t key = dsk_zero_powersgd_key(o->powersgd_seed, (uint64_t)i, (uint64_t)iter);
                for (int64_t j = 0; j < p->cols * p->rank_r; j++) q[j] = dsk_rng_normal_at(key, 0, (uint64_t)j);
            }
            dsk__zero_orthogonalize(q, p->cols, p->rank_r, o->powersgd_epsilon);
            DSK__TRY(dsk__zero_mm(zi, pm + p->p_off, p->rows, p->rank_r, g + p->uoff, p->rows, p->cols, 0, q, p->cols,
                                  p->rank_r, 0));
        }
        u->has_q = 1;
        DSK__TRY(dsk__zero_coll_done(
            zi, dsk__zero_all_reduce(zi, pm, u->p_elems, DSK_F32, DSK_COMM_SUM),
            (uint64_t)u->p_elems * 4u, 0, 0));
        for (int i = u->p0; i < u->p0 + u->np; i++) {
            dsk__zero_p *p = &zi->p[i];
            if (!p->psgd) continue;
            dsk__zero_orthogonalize(pm + p->p_off, p->rows, p->rank_r, o->powersgd_epsilon);
            DSK__TRY(dsk__zero_mm(zi, qm + p->q_off, p->cols, p->rank_r, g + p->uoff, p->rows, p->cols, 1,
                                  pm + p->p_off, p->rows, p->rank_r, 0));
        }
        DSK__TRY(dsk__zero_coll_done(
            zi, dsk__zero_all_reduce(zi, qm, u->q_elems, DSK_F32, cop),
            (uint64_t)u->q_elems * 4u, 0, 0));
        for (int i = u->p0; i < u->p0 + u->np; i++) {
            dsk__zero_p *p = &zi->p[i];
            if (!p->psgd) continue;
            DSK__TRY(dsk__zero_mm(zi, g + p->uoff, p->rows, p->cols, pm + p->p_off, p->rows, p->rank_r, 0,
                                  qm + p->q_off, p->cols, p->rank_r, 1));
        }
    }
    if (ef) {
        for (int64_t i = 0; i < n; i++) err[i] = cp[i] - g[i];
        u->has_err = 1;
    }
    pthread_mutex_lock(&zi->mu);
    zi->st_plain += (uint64_t)(zi->stage <= 1 ? n : (int64_t)zi->world * u->chunk) * 4u;
    pthread_mutex_unlock(&zi->mu);
    return DSK_OK;
}

/* FP8 compression (see the top of the file). x (rows, c) f32 <-> codes q (rows, c) e4m3 and
   scales (rows, ceil(c / 128)) f32 in 1x128 tiles: a tile never straddles two ranks' chunks. */
static dsk_status dsk__zero_fp8_tensors(const dsk__zero_impl *zi, void *q, float *sc, int64_t rows, int64_t c,
                                        dsk_tensor *Q, dsk_tensor *S) {
    int64_t qs[2] = {rows, c}, ss[2] = {rows, (c + 127) / 128};
    DSK__TRY(dsk_tensor_wrap(Q, q, DSK_E4M3, zi->device, 2, qs));
    return dsk_tensor_wrap(S, sc, DSK_F32, zi->device, 2, ss);
}
static dsk_status dsk__zero_fp8_quantize(dsk__zero_impl *zi, void *q, float *sc, float *x, int64_t rows, int64_t c) {
    dsk_tensor Q, S, X;
    int64_t xs[2] = {rows, c};
    DSK__TRY(dsk__zero_fp8_tensors(zi, q, sc, rows, c, &Q, &S));
    DSK__TRY(dsk_tensor_wrap(&X, x, DSK_F32, zi->device, 2, xs));
    return dsk_amp_fp8_block_quantize(&zi->pctx, &Q, &S, &X, 1, 128, 0);
}
static dsk_status dsk__zero_fp8_dequantize(dsk__zero_impl *zi, float *y, void *q, float *sc, int64_t rows, int64_t c) {
    dsk_tensor Q, S, Y;
    int64_t ys[2] = {rows, c};
    DSK__TRY(dsk__zero_fp8_tensors(zi, q, sc, rows, c, &Q, &S));
    DSK__TRY(dsk_tensor_wrap(&Y, y, DSK_F32, zi->device, 2, ys));
    return dsk_amp_fp8_block_dequantize(&zi->pctx, &Y, &Q, &S, 1, 128);
}

/* Error feedback, before the codes are sent: g (nc) += the last residual, then quantised; the
   residual becomes g - dequantised codes (in f32: -deq, then + g, is the one rounding of g - deq). */
static dsk_status dsk__zero_fp8_encode(dsk__zero_impl *zi, dsk__zero_u *u, float *g, int64_t rows, int64_t c) {
    float *err = zi->o.fp8_error_feedback ? (float *)zi->err.data + u->err_off : NULL;
    dsk_tensor G = dsk__zero_t(zi, g, DSK_F32, rows * c), E = dsk__zero_t(zi, err, DSK_F32, rows * c);
    if (err && u->has_err) DSK__TRY(dsk_add(&zi->pctx, &G, &G, &E));
    DSK__TRY(dsk__zero_fp8_quantize(zi, zi->q8.data, (float *)zi->sc8.data, g, rows, c));
    if (!err) return DSK_OK;
    DSK__TRY(dsk__zero_fp8_dequantize(zi, err, zi->q8.data, (float *)zi->sc8.data, rows, c));
    DSK__TRY(dsk_scale(&zi->pctx, &E, -1.0f));
    DSK__TRY(dsk_add(&zi->pctx, &E, &E, &G));
    u->has_err = 1;
    return DSK_OK;
}

static dsk_status dsk__zero_all_to_all(dsk__zero_impl *zi, const void *send, void *recv, int64_t n, dsk_dtype dt) {
    return zi->alone ? dsk__zero_copy_n(zi, recv, send, n, dt)
                     : dsk_comm_all_to_all(&zi->comm, dsk__zero_cctx(zi), send, recv, n, dt);
}

/* FP8 reduction of unit u's full gradients g (N c, padded): each rank's chunks are quantised and
   sent to their owners (all-to-all of codes and of scales), the owner dequantises the N rows and
   sums them in f32 in rank order; stages 2-3 keep that sum, stages 0-1 quantise it again and
   all-gather codes and scales (together the bytes of a ring all-reduce of the message). Then
   times grad_post_scale (/ N for the average), rounded once. */
static dsk_status dsk__zero_reduce_fp8(dsk__zero_impl *zi, const dsk__zero_op *op, float *g) {
    dsk__zero_u *u = &zi->u[op->unit];
    int64_t N = zi->world, c = u->chunk, S = (c + 127) / 128, me = zi->rank;
    uint64_t msg = (uint64_t)(N * c) + (uint64_t)(N * S) * 4u,
             plain = (uint64_t)(zi->stage <= 1 ? u->numel : N * c) * 4u;
    uint8_t *rq = (uint8_t *)zi->rq8.data;
    float *rs = (float *)zi->rsc8.data, *d = (float *)zi->deq8.data;
    float s = zi->o.sum_only ? zi->o.grad_post_scale : zi->o.grad_post_scale / (float)N;
    dsk_tensor acc = dsk__zero_t(zi, d, DSK_F32, c);
    DSK__TRY(dsk__zero_fp8_encode(zi, u, g, N, c));
    DSK__TRY(dsk__zero_coll_done(zi, dsk__zero_all_to_all(zi, zi->q8.data, rq, c, DSK_U8), msg, plain, 0));
    DSK__TRY(dsk__zero_coll_done(zi, dsk__zero_all_to_all(zi, zi->sc8.data, rs, S, DSK_F32), 0, 0, 0));
    DSK__TRY(dsk__zero_fp8_dequantize(zi, d, rq, rs, N, c));
    for (int64_t j = 1; j < N; j++) {
        dsk_tensor row = dsk__zero_t(zi, d + j * c, DSK_F32, c);
        DSK__TRY(dsk_add(&zi->pctx, &acc, &acc, &row));
    }
    if (zi->stage >= 2) return dsk__zero_land(zi, (float *)zi->shard_g.data + u->shard_off, d, c, s, op->accumulate);
    DSK__TRY(dsk__zero_fp8_quantize(zi, rq + me * c, rs + me * S, d, 1, c));
    DSK__TRY(dsk__zero_coll_done(zi, dsk__zero_all_gather(zi, rq + me * c, rq, c, DSK_U8), 0, 0, 0));
    DSK__TRY(dsk__zero_coll_done(zi, dsk__zero_all_gather(zi, rs + me * S, rs, S, DSK_F32), 0, 0, 0));
    DSK__TRY(dsk__zero_fp8_dequantize(zi, d, rq, rs, N, c));
    return dsk__zero_land(zi, g, d, u->numel, s, 0);
}

/* Reduces unit u's full gradients g over the group: in place (stages 0-1) or into this
   rank's chunk of the shard (stages 2-3, added when `accumulate`). */
static dsk_status dsk__zero_reduce(dsk__zero_impl *zi, const dsk__zero_op *op) {
    const dsk_zero_opts *o = &zi->o;
    dsk__zero_u *u = &zi->u[op->unit];
    float *g = op->grads, ps = o->grad_post_scale, *mine;
    int64_t n = u->numel, c = u->chunk, nc = (int64_t)zi->world * c;
    int full = zi->stage <= 1;
    float *shard = full ? NULL : (float *)zi->shard_g.data + u->shard_off, *tmp = (float *)zi->rs_tmp.data;
    uint16_t *w16 = (uint16_t *)zi->wire16.data, *c16 = (uint16_t *)zi->chunk16.data;
    dsk_comm_op cop = o->sum_only ? DSK_COMM_SUM : DSK_COMM_AVG;
    if (o->compress == DSK_ZERO_COMPRESS_POWERSGD && op->iter >= o->powersgd_start_iter) {
        DSK__TRY(dsk__zero_powersgd(zi, u, g, op->iter));
        if (full) return dsk__zero_land(zi, g, g, n, ps, 0);
        return dsk__zero_land(zi, shard, g + (int64_t)zi->rank * c, c, ps, op->accumulate);
    }
    if (o->compress == DSK_ZERO_COMPRESS_FP8) return dsk__zero_reduce_fp8(zi, op, g);
    if (o->compress == DSK_ZERO_COMPRESS_BF16) {
        DSK__TRY(dsk__zero_cast(zi, w16, DSK_BF16, g, DSK_F32, full ? n : nc));
        if (full) {
            DSK__TRY(dsk__zero_coll_done(zi, dsk__zero_all_reduce(zi, w16, n, DSK_BF16, cop),
                                         (uint64_t)n * 2u, (uint64_t)n * 4u, 0));
            DSK__TRY(dsk__zero_cast(zi, g, DSK_F32, w16, DSK_BF16, n));
            return dsk__zero_land(zi, g, g, n, ps, 0);
        }
        DSK__TRY(dsk__zero_coll_done(zi, dsk__zero_reduce_scatter(zi, w16, c16, c, DSK_BF16, cop),
                                     (uint64_t)nc * 2u, (uint64_t)nc * 4u, 0));
        DSK__TRY(dsk__zero_cast(zi, tmp, DSK_F32, c16, DSK_BF16, c));
        return dsk__zero_land(zi, shard, tmp, c, ps, op->accumulate);
    }
    if (full) {
        DSK__TRY(dsk__zero_coll_done(zi, dsk__zero_all_reduce(zi, g, n, DSK_F32, cop),
                                     (uint64_t)n * 4u, (uint64_t)n * 4u, 0));
        return dsk__zero_land(zi, g, g, n, ps, 0);
    }
    mine = op->accumulate ? tmp : shard;
    DSK__TRY(dsk__zero_coll_done(zi, dsk__zero_reduce_scatter(zi, g, mine, c, DSK_F32, cop),
                                 (uint64_t)nc * 4u, (uint64_t)nc * 4u, 0));
    return dsk__zero_land(zi, shard, mine, c, ps, op->accumulate);
}

/* All-gathers unit u's compute-dtype weights: in place in the full slab (stages 1-2) or
   from the shard into its gather buffer (stage 3). */
static dsk_status dsk__zero_gather(dsk__zero_impl *zi, const dsk__zero_op *op) {
    dsk__zero_u *u = &zi->u[op->unit];
    dsk_dtype dt = zi->o.compute_dtype;
    int64_t c = u->chunk, nc = (int64_t)zi->world * c;
    const char *send;
    char *recv;
    if (zi->stage <= 2) {
        recv = (char *)zi->full_w.data + u->full_off * (int64_t)zi->cesz;
        send = recv + (int64_t)zi->rank * c * (int64_t)zi->cesz;
    } else {
        recv = (char *)zi->pbufs[u->pbuf].data;
        send = (const char *)dsk__zero_send_shard(zi)->data + u->shard_off * (int64_t)zi->cesz;
    }
    return dsk__zero_coll_done(zi, dsk__zero_all_gather(zi, send, recv, c, dt), 0, 0,
                               (uint64_t)nc * zi->cesz);
}

static const char *dsk__zero_op_name(int kind) { return kind == DSK__ZERO_OP_GATHER ? "all-gather" : "reduction"; }

/* Records the first error of the object (it is unusable afterwards). */
static void dsk__zero_fail(dsk__zero_impl *zi, dsk_status st, const char *what, int unit) {
    pthread_mutex_lock(&zi->mu);
    if (zi->err_status == DSK_OK) {
        zi->err_status = st;
        snprintf(zi->errmsg, sizeof zi->errmsg, "%s of unit %d (\"%s\" ...): %.1000s", what, zi->u[unit].id,
                 zi->p[zi->u[unit].p0].name, dsk_last_error());
    }
    pthread_mutex_unlock(&zi->mu);
}

static void *dsk__zero_thread(void *arg) {
    dsk__zero_impl *zi = (dsk__zero_impl *)arg;
#ifdef _OPENMP
    omp_set_num_threads(1); /* its ops stay on this thread: no OpenMP team of its own competing with the caller's */
#endif
    pthread_mutex_lock(&zi->mu);
    for (;;) {
        dsk__zero_op op;
        dsk_status st = DSK_OK;
        double t0;
        while (!zi->stop && zi->head > zi->next_ticket) pthread_cond_wait(&zi->cv_work, &zi->mu);
        if (zi->head > zi->next_ticket) break;
        op = zi->q[(zi->head - 1) % zi->qcap];
        pthread_mutex_unlock(&zi->mu);
        t0 = dsk__zero_now();
        if (zi->err_status == DSK_OK)
            st = op.kind == DSK__ZERO_OP_GATHER ? dsk__zero_gather(zi, &op) : dsk__zero_reduce(zi, &op);
        if (st != DSK_OK) dsk__zero_fail(zi, st, dsk__zero_op_name(op.kind), op.unit);
        pthread_mutex_lock(&zi->mu);
        zi->st_seconds += dsk__zero_now() - t0;
        zi->done_ticket = op.ticket;
        zi->head++;
        pthread_cond_broadcast(&zi->cv_done);
    }
    pthread_mutex_unlock(&zi->mu);
    return NULL;
}

static dsk_status dsk__zero_error(const dsk_zero *z, const char *fn) {
    const dsk__zero_impl *zi = z->impl;
    return dsk_set_error(zi->err_status, "%s: rank %d of %d: %s", fn, z->rank, z->world_size, zi->errmsg);
}

#ifdef DSK_CUDA
static void *dsk__zero_stream(const dsk_ctx *ctx) { return ctx ? ctx->stream : NULL; }

/* CUDA: issues the operation on the communication stream now, after the caller's stream. */
static dsk_status dsk__zero_issue_cuda(dsk__zero_impl *zi, dsk_ctx *ctx, const dsk__zero_op *op) {
    int k = (int)((op->ticket - 1) % zi->qcap);
    dsk_status st;
    DSK__TRY(dsk_cuda_stream_record(dsk__zero_stream(ctx), zi->ev_ready[k])); /* after the caller's stream */
    DSK__TRY(dsk_cuda_stream_wait_event(zi->cs, zi->ev_ready[k]));
    st = op->kind == DSK__ZERO_OP_GATHER ? dsk__zero_gather(zi, op) : dsk__zero_reduce(zi, op);
    if (st != DSK_OK) return st;
    return dsk_cuda_stream_record(zi->cs, zi->ev_done[k]);
}
#endif

/* Queues an operation (CPU: for the progress thread, waiting for room when the queue is full;
   CUDA: issued on the communication stream at once); *ticket orders it. */
static dsk_status dsk__zero_enqueue(dsk_zero *z, dsk_ctx *ctx, int kind, int unit, float *grads, int accumulate,
                                    int64_t *ticket, const char *fn) {
    dsk__zero_impl *zi = z->impl;
    dsk__zero_op *op;
    int64_t t;
    if (zi->err_status != DSK_OK) return dsk__zero_error(z, fn);
    pthread_mutex_lock(&zi->mu);
    while (!zi->dev && zi->next_ticket - zi->done_ticket >= zi->qcap) pthread_cond_wait(&zi->cv_done, &zi->mu);
    t = ++zi->next_ticket;
    op = &zi->q[(t - 1) % zi->qcap];
    op->kind = kind;
    op->unit = unit;
    op->grads = grads;
    op->accumulate = accumulate;
    op->iter = zi->iter;
    op->ticket = t;
    if (!zi->dev) pthread_cond_signal(&zi->cv_work);
    pthread_mutex_unlock(&zi->mu);
    *ticket = t;
#ifdef DSK_CUDA
    if (zi->dev) {
        dsk_status st = dsk__zero_issue_cuda(zi, ctx, op);
        if (st != DSK_OK) {
            dsk__zero_fail(zi, st, dsk__zero_op_name(kind), unit);
            return dsk__zero_error(z, fn);
        }
        zi->done_ticket = t; /* issued: the stream orders the rest */
    }
#endif
    (void)ctx;
    return DSK_OK;
}

/* Ticket t is done before the caller goes on: CPU: waits for the progress thread; CUDA: the
   caller's stream waits for the operation's event (no host wait). The first error, if any. */
static dsk_status dsk__zero_wait_ticket(dsk_zero *z, dsk_ctx *ctx, int64_t t, const char *fn) {
    dsk__zero_impl *zi = z->impl;
    dsk_status st;
    double t0 = dsk__zero_now();
#ifdef DSK_CUDA
    if (zi->dev) {
        if (zi->err_status != DSK_OK) return dsk__zero_error(z, fn);
        if (t <= 0) return DSK_OK;
        return dsk_cuda_stream_wait_event(dsk__zero_stream(ctx), zi->ev_done[(t - 1) % zi->qcap]);
    }
#endif
    (void)ctx;
    pthread_mutex_lock(&zi->mu);
    while (zi->done_ticket < t && zi->err_status == DSK_OK) pthread_cond_wait(&zi->cv_done, &zi->mu);
    st = zi->err_status;
    pthread_mutex_unlock(&zi->mu);
    z->stats.wait_seconds += dsk__zero_now() - t0;
    return st != DSK_OK ? dsk__zero_error(z, fn) : DSK_OK;
}

static void dsk__zero_update_stats(dsk_zero *z) {
    dsk__zero_impl *zi = z->impl;
    pthread_mutex_lock(&zi->mu);
    z->stats.collectives = zi->st_collectives;
    z->stats.reduce_bytes = zi->st_reduce;
    z->stats.plain_bytes = zi->st_plain;
    z->stats.gather_bytes = zi->st_gather;
    z->stats.seconds = zi->st_seconds;
    z->stats.sent_bytes = zi->comm.stats.bytes_sent;
    z->stats.received_bytes = zi->comm.stats.bytes_received;
    pthread_mutex_unlock(&zi->mu);
}

/* ---------------------------------------------------------------- init and free */

static dsk_status dsk__zero_check_opts(const char *fn, dsk_zero_opts *o, const dsk_comm *c) {
    if (o->stage < 0 || o->stage > 3)
        return dsk_set_error(DSK_ERR_ARG, "%s: stage %d is not 0, 1, 2 or 3", fn, o->stage);
    if (o->compute_dtype != DSK_F32 && o->compute_dtype != DSK_BF16 && o->compute_dtype != DSK_F16)
        return dsk_set_error(DSK_ERR_ARG, "%s: compute dtype %s is not f32, bf16 or f16", fn,
                             dsk_dtype_name(o->compute_dtype));
    if (o->moment_dtype != DSK_F32 && o->moment_dtype != DSK_BF16)
        return dsk_set_error(DSK_ERR_ARG, "%s: moment dtype %s is not f32 or bf16", fn,
                             dsk_dtype_name(o->moment_dtype));
    if (o->sum_only != 0 && o->sum_only != 1)
        return dsk_set_error(DSK_ERR_ARG, "%s: sum_only %d is not 0 or 1", fn, o->sum_only);
    if (o->grad_post_scale == 0.0f) o->grad_post_scale = 1.0f;
    if (!(o->grad_post_scale > 0.0f) || !dsk_amp_isfinite(o->grad_post_scale))
        return dsk_set_error(DSK_ERR_ARG, "%s: grad_post_scale %g must be finite and > 0", fn,
                             (double)o->grad_post_scale);
    if (o->param_buffers == 0) o->param_buffers = 2;
    if (o->grad_buffers == 0) o->grad_buffers = 2;
    if (o->param_buffers < 2 || o->param_buffers > 64 || o->grad_buffers < 1 || o->grad_buffers > 64)
        return dsk_set_error(DSK_ERR_ARG, "%s: param_buffers %d (want 2..64) or grad_buffers %d (want 1..64)", fn,
                             o->param_buffers, o->grad_buffers);
    if ((int)o->compress < DSK_ZERO_COMPRESS_NONE || o->compress > DSK_ZERO_COMPRESS_FP8)
        return dsk_set_error(DSK_ERR_ARG, "%s: unknown compression %d", fn, (int)o->compress);
    if (o->fp8_error_feedback != 0 && o->fp8_error_feedback != 1)
        return dsk_set_error(DSK_ERR_ARG, "%s: fp8_error_feedback %d is not 0 or 1", fn, o->fp8_error_feedback);
    if (o->fp8_error_feedback && o->compress != DSK_ZERO_COMPRESS_FP8)
        return dsk_set_error(DSK_ERR_ARG, "%s: fp8_error_feedback is set but the compression is %d, not FP8 (%d)", fn,
                             (int)o->compress, (int)DSK_ZERO_COMPRESS_FP8);
    if (o->powersgd_rank == 0) o->powersgd_rank = 1;
    if (o->powersgd_min_compression_rate == 0.0) o->powersgd_min_compression_rate = 2.0;
    if (o->powersgd_rank < 1 || o->powersgd_start_iter < 0 || !(o->powersgd_min_compression_rate > 0.0) ||
        !(o->powersgd_epsilon >= 0.0f))
        return dsk_set_error(DSK_ERR_ARG,
                             "%s: PowerSGD rank %d (>= 1), start_iter %d (>= 0), min_compression_rate %g (> 0), "
                             "epsilon %g (>= 0)",
                             fn, o->powersgd_rank, o->powersgd_start_iter, o->powersgd_min_compression_rate,
                             (double)o->powersgd_epsilon);
    (void)c;
    return DSK_OK;
}

/* CPU tensors go over the host backend, CUDA tensors over nccl (no PowerSGD there). */
static dsk_status dsk__zero_check_device(const char *fn, const dsk_zero_opts *o, const dsk_comm *c,
                                         const dsk_ctx *ctx) {
    int cuda = ctx && ctx->device.type == DSK_DEV_CUDA;
#ifndef DSK_CUDA
    if (cuda) return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: ctx is on cuda:%d in a build without DSK_CUDA", fn,
                                   ctx->device.index);
#endif
    if (!c) return cuda && o->compress == DSK_ZERO_COMPRESS_POWERSGD ?
                 dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: PowerSGD runs on CPU tensors only (ctx on cuda:%d)", fn,
                               ctx->device.index) : DSK_OK;
    if (!cuda && c->backend != DSK_COMM_HOST)
        return dsk_set_error(DSK_ERR_ARG, "%s: CPU tensors (ctx %s) need a host-backend communicator, this one is nccl",
                             fn, ctx ? "on the CPU" : "NULL");
    if (cuda && c->backend != DSK_COMM_NCCL)
        return dsk_set_error(DSK_ERR_ARG, "%s: CUDA tensors (ctx on cuda:%d) need an nccl communicator, this one is "
                             "host", fn, ctx->device.index);
    if (cuda && o->compress == DSK_ZERO_COMPRESS_POWERSGD)
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: PowerSGD runs on CPU tensors only (ctx on cuda:%d)", fn,
                             ctx->device.index);
    return DSK_OK;
}

/* The global tensor parameter i is a box of (itself when global_shape is all zero), checked. */
static dsk_status dsk__zero_take_box(const char *fn, int i, const char *nm, const dsk_zero_param *q, dsk__zero_p *p) {
    int whole = 1;
    for (int d = 0; d < q->ndim; d++) whole &= q->global_shape[d] == 0 && q->offset[d] == 0;
    for (int d = 0; d < q->ndim; d++) {
        p->g_shape[d] = whole ? q->shape[d] : q->global_shape[d];
        p->g_at[d] = whole ? 0 : q->offset[d];
        if (p->g_at[d] < 0 || p->g_at[d] + q->shape[d] > p->g_shape[d])
            return dsk_set_error(DSK_ERR_ARG,
                                 "%s: params[%d] \"%s\": dim %d's [%lld, %lld) does not fit in the global "
                                 "tensor's %lld",
                                 fn, i, nm, d, (long long)p->g_at[d], (long long)(p->g_at[d] + q->shape[d]),
                                 (long long)p->g_shape[d]);
    }
    return DSK_OK;
}

/* Copies and checks the parameter list; groups it into units. */
static dsk_status dsk__zero_take_params(const char *fn, dsk_zero *z, const dsk_zero_param *ps, int n) {
    dsk__zero_impl *zi = z->impl;
    int nu = 0;
    for (int i = 0; i < n; i++) {
        const dsk_zero_param *q = &ps[i];
        dsk__zero_p *p = &zi->p[i];
        const char *nm = q->name ? q->name : "";
        if (!q->name || !*q->name || strlen(q->name) >= DSK__ZERO_NAME_MAX - 16)
            return dsk_set_error(DSK_ERR_ARG, "%s: params[%d] needs a name of 1 to %d characters", fn, i,
                                 DSK__ZERO_NAME_MAX - 17);
        if (q->ndim < 1 || q->ndim > DSK_MAX_DIMS || (!zi->dry && (!q->value || !q->grad)) || q->unit < 0)
            return dsk_set_error(DSK_ERR_ARG, "%s: params[%d] \"%s\": ndim %d (want 1..%d), value %p, grad %p, unit %d",
                                 fn, i, nm, q->ndim, DSK_MAX_DIMS, (void *)q->value, (void *)q->grad, q->unit);
        if (i > 0 && q->unit < ps[i - 1].unit)
            return dsk_set_error(DSK_ERR_ARG, "%s: params[%d] \"%s\" has unit %d after unit %d: unit ids must not "
                                 "decrease along the list", fn, i, nm, q->unit, ps[i - 1].unit);
        p->numel = 1;
        for (int d = 0; d < q->ndim; d++) {
            if (q->shape[d] < 1)
                return dsk_set_error(DSK_ERR_ARG, "%s: params[%d] \"%s\": shape[%d] = %lld (want >= 1)", fn, i, nm, d,
                                     (long long)q->shape[d]);
            p->shape[d] = q->shape[d];
            p->numel *= q->shape[d];
        }
        p->ndim = q->ndim;
        p->rows = q->shape[0];
        p->cols = p->numel / p->rows;
        DSK__TRY(dsk__zero_take_box(fn, i, nm, q, p));
        if (!(p->name = (char *)DSK_MALLOC(strlen(q->name) + 1)))
            return dsk_set_error(DSK_ERR_OOM, "%s: parameter names", fn);
        strcpy(p->name, q->name);
        p->value = q->value;
        p->grad = q->grad;
        p->no_decay = q->no_decay != 0;
        if (i == 0 || q->unit != ps[i - 1].unit) {
            zi->u[nu].id = q->unit;
            zi->u[nu].p0 = i;
            nu++;
        }
        p->unit = nu - 1;
        p->uoff = zi->u[nu - 1].numel;
        zi->u[nu - 1].numel += p->numel;
        zi->u[nu - 1].np++;
    }
    z->n_units = nu;
    return DSK_OK;
}

/* Chunks, offsets, pieces and PowerSGD shapes of every unit. */
static void dsk__zero_layout(dsk_zero *z) {
    dsk__zero_impl *zi = z->impl;
    int64_t N = z->world_size, r = z->rank, full = 0, shard = 0, err = 0, pq = 0;
    for (int k = 0; k < z->n_units; k++) {
        dsk__zero_u *u = &zi->u[k];
        u->chunk = (u->numel + N - 1) / N;
        u->full_off = full;
        u->shard_off = shard;
        u->err_off = err;
        u->pq_off = pq;
        u->pbuf = u->gbuf = -1;
        full += N * u->chunk;
        shard += u->chunk;
        if (N * u->chunk > zi->max_unit) zi->max_unit = N * u->chunk;
        if (u->chunk > zi->max_chunk) zi->max_chunk = u->chunk;
        for (int i = u->p0; i < u->p0 + u->np; i++) {
            dsk__zero_p *p = &zi->p[i];
            int64_t lo = r * u->chunk, hi = lo + u->chunk;
            int64_t a = p->uoff > lo ? p->uoff : lo, b = p->uoff + p->numel < hi ? p->uoff + p->numel : hi;
            p->own_a = a < b ? a - p->uoff : 0;
            p->own_b = a < b ? b - p->uoff : 0;
            if (zi->o.compress != DSK_ZERO_COMPRESS_POWERSGD) continue;
            p->psgd = dsk_zero_powersgd_compresses(p->ndim, p->rows, p->cols, zi->o.powersgd_rank,
                                                   zi->o.powersgd_min_compression_rate);
            if (!p->psgd) { u->unc_elems += p->numel; continue; }
            p->rank_r = zi->o.powersgd_rank;
            if (p->rank_r > p->rows) p->rank_r = p->rows;
            if (p->rank_r > p->cols) p->rank_r = p->cols;
            p->p_off = u->p_elems;
            p->q_off = u->q_elems;
            u->p_elems += p->rows * p->rank_r;
            u->q_elems += p->cols * p->rank_r;
        }
        err += zi->o.compress == DSK_ZERO_COMPRESS_FP8 ? N * u->chunk : u->numel;
        pq += u->p_elems + u->q_elems;
    }
    zi->full = full;
    zi->shard = shard;
}

/* bytes of zeroed host memory, or NULL: tables that dsk_zero_free reads even after a failed init. */
static void *dsk__zero_calloc(size_t bytes) {
    void *p = DSK_MALLOC(bytes);
    if (p) memset(p, 0, bytes);
    return p;
}

/* Allocates a zeroed f32/bf16/f16 slab on ctx's device and adds its allocator-measured bytes to *role
   (dsk_zero_plan: adds the bytes the allocator would count, n times the dtype's size). */
static dsk_status dsk__zero_alloc(dsk_ctx *ctx, dsk_tensor *t, dsk_dtype dt, int64_t n, int64_t *role) {
    dsk_device dev = ctx ? ctx->device : dsk_cpu();
    int64_t before = dsk_tensor_mem_stats(dev).live_bytes;
    if (!t) {
        *role += n * (int64_t)dsk_dtype_size(dt);
        return DSK_OK;
    }
    DSK__TRY(dsk_tensor_alloc(ctx, t, dt, 1, &n));
    DSK__TRY(dsk_tensor_fill(ctx, t, 0.0));
    *role += dsk_tensor_mem_stats(dev).live_bytes - before;
    return DSK_OK;
}

/* The tensor a slab is allocated into, or NULL when dsk_zero_plan only counts it. */
static dsk_tensor *dsk__zero_slab(const dsk__zero_impl *zi, dsk_tensor *t) { return zi->dry ? NULL : t; }

/* FP8: codes sent and received (u8), their scales (f32), the dequantised rows, the residual. */
static dsk_status dsk__zero_alloc_fp8(dsk_zero *z, dsk_ctx *ctx) {
    dsk__zero_impl *zi = z->impl;
    int64_t *mem = &z->memory.comm, nsc = (int64_t)z->world_size * ((zi->max_chunk + 127) / 128);
    DSK__TRY(dsk__zero_alloc(ctx, dsk__zero_slab(zi, &zi->q8), DSK_U8, zi->max_unit, mem));
    DSK__TRY(dsk__zero_alloc(ctx, dsk__zero_slab(zi, &zi->rq8), DSK_U8, zi->max_unit, mem));
    DSK__TRY(dsk__zero_alloc(ctx, dsk__zero_slab(zi, &zi->sc8), DSK_F32, nsc, mem));
    DSK__TRY(dsk__zero_alloc(ctx, dsk__zero_slab(zi, &zi->rsc8), DSK_F32, nsc, mem));
    DSK__TRY(dsk__zero_alloc(ctx, dsk__zero_slab(zi, &zi->deq8), DSK_F32, zi->max_unit, mem));
    return zi->o.fp8_error_feedback ? dsk__zero_alloc(ctx, dsk__zero_slab(zi, &zi->err), DSK_F32, zi->full, mem) : DSK_OK;
}

static dsk_status dsk__zero_alloc_all(const char *fn, dsk_zero *z, dsk_ctx *ctx) {
    dsk__zero_impl *zi = z->impl;
    dsk_zero_memory *mem = &z->memory;
    dsk_dtype cdt = zi->o.compute_dtype;
    int64_t opt_n = z->stage == 0 ? zi->full : zi->shard, err = 0, pq = 0, cp = 0, unc = 0;
    int psgd = zi->o.compress == DSK_ZERO_COMPRESS_POWERSGD;
    zi->master_in_full = cdt == DSK_F32 && z->stage <= 2;
    if (z->stage <= 2) DSK__TRY(dsk__zero_alloc(ctx, dsk__zero_slab(zi, &zi->full_w), cdt, zi->full, &mem->params));
    if (z->stage == 3 && cdt != DSK_F32)
        DSK__TRY(dsk__zero_alloc(ctx, dsk__zero_slab(zi, &zi->shard_w), cdt, zi->shard, &mem->params));
    if (z->stage == 3) {
        zi->pbufs = (dsk_tensor *)dsk__zero_calloc((size_t)zi->o.param_buffers * sizeof(dsk_tensor));
        zi->pbuf_owner = (int *)DSK_MALLOC((size_t)zi->o.param_buffers * sizeof(int));
        if (!zi->pbufs || !zi->pbuf_owner) return dsk_set_error(DSK_ERR_OOM, "%s: buffer lists", fn);
        for (int i = 0; i < zi->o.param_buffers; i++) {
            zi->pbuf_owner[i] = -1;
            DSK__TRY(dsk__zero_alloc(ctx, dsk__zero_slab(zi, &zi->pbufs[i]), cdt, zi->max_unit, &mem->params));
        }
    }
    if (!zi->master_in_full)
        DSK__TRY(dsk__zero_alloc(ctx, dsk__zero_slab(zi, &zi->master), DSK_F32, opt_n, &mem->optimizer));
    DSK__TRY(dsk__zero_alloc(ctx, dsk__zero_slab(zi, &zi->m), zi->o.moment_dtype, opt_n, &mem->optimizer));
    DSK__TRY(dsk__zero_alloc(ctx, dsk__zero_slab(zi, &zi->v), zi->o.moment_dtype, opt_n, &mem->optimizer));
    if (z->stage <= 1) DSK__TRY(dsk__zero_alloc(ctx, dsk__zero_slab(zi, &zi->full_g), DSK_F32, zi->full, &mem->grads));
    if (z->stage >= 2) {
        DSK__TRY(dsk__zero_alloc(ctx, dsk__zero_slab(zi, &zi->shard_g), DSK_F32, zi->shard, &mem->grads));
        DSK__TRY(dsk__zero_alloc(ctx, dsk__zero_slab(zi, &zi->rs_tmp), DSK_F32, zi->max_chunk, &mem->grads));
        zi->gbufs = (dsk_tensor *)dsk__zero_calloc((size_t)zi->o.grad_buffers * sizeof(dsk_tensor));
        zi->gbuf_owner = (int *)DSK_MALLOC((size_t)zi->o.grad_buffers * sizeof(int));
        if (!zi->gbufs || !zi->gbuf_owner) return dsk_set_error(DSK_ERR_OOM, "%s: buffer lists", fn);
        for (int i = 0; i < zi->o.grad_buffers; i++) {
            zi->gbuf_owner[i] = -1;
            DSK__TRY(dsk__zero_alloc(ctx, dsk__zero_slab(zi, &zi->gbufs[i]), DSK_F32, zi->max_unit, &mem->grads));
        }
    }
    if (zi->o.compress == DSK_ZERO_COMPRESS_BF16) {
        DSK__TRY(dsk__zero_alloc(ctx, dsk__zero_slab(zi, &zi->wire16), DSK_BF16, zi->max_unit, &mem->comm));
        if (z->stage >= 2)
            DSK__TRY(dsk__zero_alloc(ctx, dsk__zero_slab(zi, &zi->chunk16), DSK_BF16, zi->max_chunk, &mem->comm));
    }
    if (psgd) {
        for (int k = 0; k < z->n_units; k++) {
            const dsk__zero_u *u = &zi->u[k];
            err += u->numel;
            pq += u->p_elems + u->q_elems;
            if (u->numel > cp) cp = u->numel;
            if (u->unc_elems > unc) unc = u->unc_elems;
        }
        if (!zi->o.powersgd_no_error_feedback) {
            DSK__TRY(dsk__zero_alloc(ctx, dsk__zero_slab(zi, &zi->err), DSK_F32, err, &mem->comm));
            DSK__TRY(dsk__zero_alloc(ctx, dsk__zero_slab(zi, &zi->cp), DSK_F32, cp, &mem->comm));
        }
        DSK__TRY(dsk__zero_alloc(ctx, dsk__zero_slab(zi, &zi->pq), DSK_F32, pq, &mem->comm));
        DSK__TRY(dsk__zero_alloc(ctx, dsk__zero_slab(zi, &zi->unc), DSK_F32, unc, &mem->comm));
    }
    if (zi->o.compress == DSK_ZERO_COMPRESS_FP8) DSK__TRY(dsk__zero_alloc_fp8(z, ctx));
    return DSK_OK;
}

/* The views stages 0-2 keep for good. */
static void dsk__zero_bind_all(dsk_zero *z) {
    dsk__zero_impl *zi = z->impl;
    for (int i = 0; i < z->n_params; i++) {
        dsk__zero_p *p = &zi->p[i];
        const dsk__zero_u *u = &zi->u[p->unit];
        char *w = z->stage <= 2 ? (char *)zi->full_w.data + (u->full_off + p->uoff) * (int64_t)zi->cesz : NULL;
        float *g = z->stage <= 1 ? (float *)zi->full_g.data + u->full_off + p->uoff : NULL;
        dsk__zero_bind(p->value, p, w, zi->o.compute_dtype, zi->device);
        dsk__zero_bind(p->grad, p, g, DSK_F32, zi->device);
    }
}

DSK_API void dsk_zero_free(dsk_zero *z, dsk_ctx *ctx) {
    dsk__zero_impl *zi;
    if (!z || !z->impl) { if (z) memset(z, 0, sizeof *z); return; }
    zi = z->impl;
    if (zi->thread_started) {
        pthread_mutex_lock(&zi->mu);
        zi->stop = 1;
        pthread_cond_broadcast(&zi->cv_work);
        pthread_mutex_unlock(&zi->mu);
        pthread_join(zi->thread, NULL);
    }
#ifdef DSK_CUDA
    if (zi->cs) (void)dsk_cuda_stream_sync(zi->cs); /* nothing may still use the buffers */
    for (int i = 0; i < zi->qcap && zi->ev_ready; i++) {
        dsk_cuda_event_destroy(zi->ev_ready[i]);
        dsk_cuda_event_destroy(zi->ev_done[i]);
    }
    DSK_FREE(zi->ev_ready);
    DSK_FREE(zi->ev_done);
#endif
    if (zi->mu_ready) {
        pthread_mutex_destroy(&zi->mu);
        pthread_cond_destroy(&zi->cv_work);
        pthread_cond_destroy(&zi->cv_done);
    }
    dsk_comm_free(&zi->comm);
    if (zi->p)
        for (int i = 0; i < z->n_params; i++) {
            if (zi->p[i].value) dsk__zero_bind(zi->p[i].value, &zi->p[i], NULL, zi->o.compute_dtype, zi->device);
            if (zi->p[i].grad) dsk__zero_bind(zi->p[i].grad, &zi->p[i], NULL, DSK_F32, zi->device);
            DSK_FREE(zi->p[i].name);
        }
    {
        dsk_tensor *ts[] = {&zi->full_w, &zi->full_g, &zi->master,  &zi->m,    &zi->v,   &zi->shard_w, &zi->shard_g,
                            &zi->rs_tmp, &zi->wire16, &zi->chunk16, &zi->err,  &zi->pq,  &zi->cp,      &zi->unc,
                            &zi->q8,     &zi->rq8,    &zi->sc8,     &zi->rsc8, &zi->deq8};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dsk_tensor_free(ctx, ts[i]);
    }
    if (zi->pbufs)
        for (int i = 0; i < zi->o.param_buffers; i++) dsk_tensor_free(ctx, &zi->pbufs[i]);
    if (zi->gbufs)
        for (int i = 0; i < zi->o.grad_buffers; i++) dsk_tensor_free(ctx, &zi->gbufs[i]);
#ifdef DSK_CUDA
    dsk_cuda_stream_destroy(zi->cs);
#endif
    DSK_FREE(zi->pbufs); DSK_FREE(zi->gbufs); DSK_FREE(zi->pbuf_owner); DSK_FREE(zi->gbuf_owner);
    DSK_FREE(zi->p); DSK_FREE(zi->u); DSK_FREE(zi->q);
    DSK_FREE(zi->ck_e);
    DSK_FREE(zi->ck_t);
    DSK_FREE(zi->ck_at);
    DSK_FREE(zi->ck_names);
    DSK_FREE(zi);
    memset(z, 0, sizeof *z);
}

static dsk_status dsk__zero_init(dsk_zero *z, dsk_comm *c, dsk_ctx *ctx, const dsk_zero_param *params, int n,
                                 const dsk_zero_opts *opts) {
    const char *fn = "dsk_zero_init";
    dsk__zero_impl *zi;
    dsk_ctx_opts co;
    dsk_status st;
    if (c && !c->impl) return dsk_set_error(DSK_ERR_ARG, "%s: communicator is not initialised", fn);
    if (n < 1 || !params) return dsk_set_error(DSK_ERR_ARG, "%s: need at least one parameter (got %d)", fn, n);
    if (!(zi = (dsk__zero_impl *)dsk__zero_calloc(sizeof *zi))) return dsk_set_error(DSK_ERR_OOM, "%s: state", fn);
    z->impl = zi;
    if (opts) zi->o = *opts;
    DSK__TRY(dsk__zero_check_opts(fn, &zi->o, c));
    DSK__TRY(dsk__zero_check_device(fn, &zi->o, c, ctx));
    zi->dev = ctx && ctx->device.type == DSK_DEV_CUDA;
    zi->device = zi->dev ? ctx->device : dsk_cpu();
    pthread_mutex_init(&zi->mu, NULL);
    pthread_cond_init(&zi->cv_work, NULL);
    pthread_cond_init(&zi->cv_done, NULL);
    zi->mu_ready = 1;
    z->stage = zi->stage = zi->o.stage;
    zi->alone = !c;
    z->rank = zi->rank = c ? c->rank : 0;
    z->world_size = zi->world = c ? c->world_size : 1;
    z->n_params = n;
    zi->cesz = dsk_dtype_size(zi->o.compute_dtype);
    zi->p = (dsk__zero_p *)dsk__zero_calloc((size_t)n * sizeof *zi->p);
    zi->u = (dsk__zero_u *)dsk__zero_calloc((size_t)n * sizeof *zi->u);
    zi->qcap = 2 * (int64_t)n + 2;
    zi->q = (dsk__zero_op *)DSK_MALLOC((size_t)zi->qcap * sizeof *zi->q);
    if (!zi->p || !zi->u || !zi->q) return dsk_set_error(DSK_ERR_OOM, "%s: tables for %d parameters", fn, n);
    DSK__TRY(dsk__zero_take_params(fn, z, params, n));
    dsk__zero_layout(z);
    DSK__TRY(dsk__zero_alloc_all(fn, z, ctx));
    dsk__zero_bind_all(z);
    if (c && (st = dsk_comm_split(c, 0, c->rank, &zi->comm)) != DSK_OK) {
        char msg[1100];
        snprintf(msg, sizeof msg, "%s: splitting the private communicator: %s", fn, dsk_last_error());
        return dsk_set_error(st, "%s", msg);
    }
    zi->head = 1;
    zi->fresh = 1;
#ifdef DSK_CUDA
    if (zi->dev) { /* a copy of the caller's context on a stream of its own, no workspace (nothing here needs one) */
        st = dsk_cuda_stream_create(&zi->cs);
        zi->pctx = *ctx;
        zi->pctx.stream = zi->cs;
        zi->pctx.workspace = NULL;
        zi->pctx.workspace_bytes = 0;
        zi->pctx.cublas = NULL;
        zi->ev_ready = (void **)DSK_MALLOC((size_t)zi->qcap * sizeof(void *));
        zi->ev_done = (void **)DSK_MALLOC((size_t)zi->qcap * sizeof(void *));
        if (!zi->ev_ready || !zi->ev_done) return dsk_set_error(DSK_ERR_OOM, "%s: event lists", fn);
        memset(zi->ev_ready, 0, (size_t)zi->qcap * sizeof(void *));
        memset(zi->ev_done, 0, (size_t)zi->qcap * sizeof(void *));
        for (int i = 0; st == DSK_OK && i < zi->qcap; i++)
            if ((st = dsk_cuda_event_create(&zi->ev_ready[i])) == DSK_OK) st = dsk_cuda_event_create(&zi->ev_done[i]);
        if (st != DSK_OK) return st; /* the communication stream and its events */
        /* the slabs were zeroed on the caller's stream: settle that before anything else touches them */
        DSK__TRY(dsk_ctx_sync(ctx));
        return zi->alone ? DSK_OK : dsk_comm_barrier(&zi->comm, &zi->pctx);
    }
#endif
    memset(&co, 0, sizeof co);
    co.device = DSK_PREFER_CPU;
    co.n_threads = 1;
    DSK__TRY(dsk_ctx_init(&zi->pctx, &co));
    if (pthread_create(&zi->thread, NULL, dsk__zero_thread, zi) != 0)
        return dsk_set_error(DSK_ERR_IO, "%s: cannot start the progress thread", fn);
    zi->thread_started = 1;
    /* every rank is through the split before any returns (and may free the store it used) */
    return zi->alone ? DSK_OK : dsk_comm_barrier(&zi->comm, NULL);
}

DSK_API dsk_status dsk_zero_init(dsk_zero *z, dsk_comm *c, dsk_ctx *ctx, const dsk_zero_param *params, int n,
                                 const dsk_zero_opts *opts) {
    dsk_status st;
    if (!z) return dsk_set_error(DSK_ERR_ARG, "dsk_zero_init: zero object is NULL");
    memset(z, 0, sizeof *z);
    st = dsk__zero_init(z, c, ctx, params, n, opts);
    if (st != DSK_OK) {
        char msg[1200];
        snprintf(msg, sizeof msg, "%s", dsk_last_error());
        dsk_zero_free(z, ctx);
        dsk_set_error(st, "%s", msg);
    }
    return st;
}

/* The collectives of the plan: each unit's reduction (the message dsk__zero_reduce hands over)
   and gather (dsk__zero_gather's). */
static void dsk__zero_plan_bytes(const dsk_zero *z, dsk_zero_plan_out *out) {
    const dsk__zero_impl *zi = z->impl;
    uint64_t esz = zi->o.compress == DSK_ZERO_COMPRESS_BF16 ? 2u : 4u;
    for (int k = 0; k < z->n_units; k++) {
        const dsk__zero_u *u = &zi->u[k];
        uint64_t msg = (uint64_t)(z->stage <= 1 ? u->numel : (int64_t)zi->world * u->chunk);
        out->reduce_bytes += msg * esz;
        out->plain_bytes += msg * 4u;
        if (z->stage >= 1) out->gather_bytes += (uint64_t)((int64_t)zi->world * u->chunk) * zi->cesz;
    }
    if (zi->o.compress == DSK_ZERO_COMPRESS_POWERSGD) out->reduce_bytes = out->plain_bytes;
    out->reduce_collectives = z->n_units;
}

DSK_API dsk_status dsk_zero_plan(const dsk_zero_param *params, int n, int world_size, int rank,
                                 const dsk_zero_opts *opts, dsk_zero_plan_out *out) {
    const char *fn = "dsk_zero_plan";
    dsk_zero z;
    dsk__zero_impl *zi;
    dsk_status st;
    if (!out) return dsk_set_error(DSK_ERR_ARG, "%s: out is NULL", fn);
    if (n < 1 || !params) return dsk_set_error(DSK_ERR_ARG, "%s: need at least one parameter (got %d)", fn, n);
    if (world_size < 1 || rank < 0 || rank >= world_size)
        return dsk_set_error(DSK_ERR_ARG, "%s: rank %d of a group of %d", fn, rank, world_size);
    memset(&z, 0, sizeof z);
    if (!(zi = (dsk__zero_impl *)dsk__zero_calloc(sizeof *zi))) return dsk_set_error(DSK_ERR_OOM, "%s: state", fn);
    z.impl = zi;
    zi->dry = 1;
    if (opts) zi->o = *opts;
    z.stage = zi->stage = zi->o.stage;
    z.rank = zi->rank = rank;
    z.world_size = zi->world = world_size;
    z.n_params = n;
    zi->p = (dsk__zero_p *)dsk__zero_calloc((size_t)n * sizeof *zi->p);
    zi->u = (dsk__zero_u *)dsk__zero_calloc((size_t)n * sizeof *zi->u);
    st = zi->p && zi->u ? dsk__zero_check_opts(fn, &zi->o, NULL)
                        : dsk_set_error(DSK_ERR_OOM, "%s: tables for %d parameters", fn, n);
    z.stage = zi->stage = zi->o.stage;
    zi->cesz = dsk_dtype_size(zi->o.compute_dtype);
    if (st == DSK_OK) st = dsk__zero_take_params(fn, &z, params, n);
    for (int i = 0; zi->p && i < n; i++) zi->p[i].value = zi->p[i].grad = NULL; /* the caller's: never bound */
    if (st == DSK_OK) {
        dsk__zero_layout(&z);
        st = dsk__zero_alloc_all(fn, &z, NULL);
    }
    if (st == DSK_OK) {
        memset(out, 0, sizeof *out);
        out->memory = z.memory;
        out->n_units = z.n_units;
        out->full_elems = zi->full;
        out->shard_elems = zi->shard;
        dsk__zero_plan_bytes(&z, out);
    }
    dsk_zero_free(&z, NULL);
    return st;
}

/* ---------------------------------------------------------------- weights */

DSK_API dsk_status dsk_zero_get_piece(const dsk_zero *z, int p, dsk_zero_piece *out) {
    const dsk__zero_impl *zi;
    const dsk__zero_p *pp;
    int64_t a, b;
    DSK__TRY(dsk__zero_need(z, "dsk_zero_get_piece"));
    if (p < 0 || p >= z->n_params || !out)
        return dsk_set_error(DSK_ERR_ARG, "dsk_zero_get_piece: parameter %d not in [0, %d) or out is NULL", p,
                             z->n_params);
    zi = z->impl;
    pp = &zi->p[p];
    a = z->stage == 0 ? 0 : pp->own_a;
    b = z->stage == 0 ? pp->numel : pp->own_b;
    memset(out, 0, sizeof *out);
    out->first = a;
    out->count = b - a;
    out->master = dsk__zero_master_of(z, pp, a, b);
    out->m = dsk__zero_view(&zi->m, dsk__zero_opt_off(z, &zi->u[pp->unit], pp->uoff + a), b - a);
    out->v = dsk__zero_view(&zi->v, dsk__zero_opt_off(z, &zi->u[pp->unit], pp->uoff + a), b - a);
    out->grad = dsk__zero_grad_of(z, pp, a, b);
    return DSK_OK;
}

/* Waits (on the host) for every queued collective; CUDA: the communication stream, polling
   nccl for errors up to the communicator's timeout. */
static dsk_status dsk__zero_drain(dsk_zero *z, dsk_ctx *ctx, const char *fn) {
    dsk__zero_impl *zi = z->impl;
    int64_t t;
    if (zi->err_status != DSK_OK) return dsk__zero_error(z, fn);
#ifdef DSK_CUDA
    if (zi->dev) {
        double t0 = dsk__zero_now();
        dsk_status st = zi->alone ? dsk_ctx_sync(&zi->pctx) : dsk_comm_sync(&zi->comm, &zi->pctx);
        z->stats.wait_seconds += dsk__zero_now() - t0;
        if (st != DSK_OK) {
            pthread_mutex_lock(&zi->mu);
            if (zi->err_status == DSK_OK) {
                zi->err_status = st;
                snprintf(zi->errmsg, sizeof zi->errmsg, "the communication stream: %.1100s", dsk_last_error());
            }
            pthread_mutex_unlock(&zi->mu);
            return dsk__zero_error(z, fn);
        }
    }
#endif
    pthread_mutex_lock(&zi->mu);
    t = zi->next_ticket;
    pthread_mutex_unlock(&zi->mu);
    DSK__TRY(dsk__zero_wait_ticket(z, ctx, t, fn));
    for (int k = 0; k < z->n_units; k++)
        if (zi->u[k].pstate == DSK__ZERO_GATHERING && z->stage <= 2) zi->u[k].pstate = DSK__ZERO_RESIDENT;
    dsk__zero_update_stats(z);
    return DSK_OK;
}

/* Stage 3: drops every gathered unit (its weights are stale or no longer needed). */
static void dsk__zero_release_all(dsk_zero *z) {
    dsk__zero_impl *zi = z->impl;
    if (z->stage != 3) return;
    for (int k = 0; k < z->n_units; k++) {
        dsk__zero_u *u = &zi->u[k];
        if (u->pbuf >= 0) zi->pbuf_owner[u->pbuf] = -1;
        u->pbuf = -1;
        u->pstate = DSK__ZERO_RELEASED;
        for (int i = u->p0; i < u->p0 + u->np; i++)
            dsk__zero_bind(zi->p[i].value, &zi->p[i], NULL, zi->o.compute_dtype, zi->device);
    }
}

/* Stages 1-2: queues the all-gather of every unit's weights; forward_begin waits per unit. */
static dsk_status dsk__zero_start_gathers(dsk_zero *z, dsk_ctx *ctx, const char *fn) {
    dsk__zero_impl *zi = z->impl;
    for (int k = 0; k < z->n_units; k++) {
        DSK__TRY(dsk__zero_enqueue(z, ctx, DSK__ZERO_OP_GATHER, k, NULL, 0, &zi->u[k].gather_ticket, fn));
        zi->u[k].pstate = DSK__ZERO_GATHERING;
    }
    return DSK_OK;
}

DSK_API dsk_status dsk_zero_refresh(dsk_zero *z, dsk_ctx *ctx) {
    const char *fn = "dsk_zero_refresh";
    dsk__zero_impl *zi;
    DSK__TRY(dsk__zero_need(z, fn));
    zi = z->impl;
    if (zi->in_pass) return dsk_set_error(DSK_ERR_STATE, "%s: called inside a backward pass", fn);
    DSK__TRY(dsk__zero_drain(z, ctx, fn));
    for (int i = 0; i < z->n_params; i++) {
        dsk__zero_p *p = &zi->p[i];
        int64_t a = z->stage == 0 ? 0 : p->own_a, b = z->stage == 0 ? p->numel : p->own_b;
        dsk_tensor master = dsk__zero_master_of(z, p, a, b), copy = dsk__zero_copy_of(z, p, a, b);
        if (b > a && copy.data) DSK__TRY(dsk_tensor_copy(ctx, &copy, &master));
    }
    dsk__zero_release_all(z);
    if (z->stage == 1 || z->stage == 2) {
        DSK__TRY(dsk__zero_start_gathers(z, ctx, fn));
        DSK__TRY(dsk__zero_drain(z, ctx, fn));
    }
    return DSK_OK;
}

/* ---------------------------------------------------------------- units */

/* A free slot of a pool, or -1. */
static int dsk__zero_free_slot(const int *owner, int n) {
    for (int i = 0; i < n; i++)
        if (owner[i] < 0) return i;
    return -1;
}

/* Stage 3: queues unit k's gather into a free buffer (*started 0 when none is free). */
static dsk_status dsk__zero_start_gather(dsk_zero *z, dsk_ctx *ctx, int k, int *started, const char *fn) {
    dsk__zero_impl *zi = z->impl;
    dsk__zero_u *u = &zi->u[k];
    int slot = dsk__zero_free_slot(zi->pbuf_owner, zi->o.param_buffers);
    *started = slot >= 0;
    if (slot < 0) return DSK_OK;
    zi->pbuf_owner[slot] = k;
    u->pbuf = slot;
    u->pstate = DSK__ZERO_GATHERING;
    return dsk__zero_enqueue(z, ctx, DSK__ZERO_OP_GATHER, k, NULL, 0, &u->gather_ticket, fn);
}

/* Makes unit k's weights available (gathering or waiting as needed), then prefetches unit
   k + dir of this object. */
static dsk_status dsk__zero_need_unit(dsk_zero *z, dsk_ctx *ctx, int k, int dir, const char *fn) {
    dsk__zero_impl *zi = z->impl;
    dsk__zero_u *u = &zi->u[k];
    int started = 1;
    if (z->stage == 1 || z->stage == 2) {
        if (u->pstate == DSK__ZERO_GATHERING) {
            DSK__TRY(dsk__zero_wait_ticket(z, ctx, u->gather_ticket, fn));
            u->pstate = DSK__ZERO_RESIDENT;
        }
        return DSK_OK;
    }
    if (z->stage != 3) return DSK_OK;
    if (u->pstate == DSK__ZERO_RELEASED) DSK__TRY(dsk__zero_start_gather(z, ctx, k, &started, fn));
    if (!started) {
        char held[256];
        size_t len = 0;
        held[0] = 0;
        for (int i = 0; i < zi->o.param_buffers && len < sizeof held - 16; i++)
            len += (size_t)snprintf(held + len, sizeof held - len, "%s%d", i ? ", " : "", zi->u[zi->pbuf_owner[i]].id);
        return dsk_set_error(DSK_ERR_STATE, "%s: no free gather buffer for unit %d: units %s are gathered (end "
                             "their forward or backward first, or raise param_buffers from %d)", fn, u->id, held,
                             zi->o.param_buffers);
    }
    if (u->pstate == DSK__ZERO_GATHERING) {
        char *buf = (char *)zi->pbufs[u->pbuf].data;
        DSK__TRY(dsk__zero_wait_ticket(z, ctx, u->gather_ticket, fn));
        u->pstate = DSK__ZERO_RESIDENT;
        for (int i = u->p0; i < u->p0 + u->np; i++)
            dsk__zero_bind(zi->p[i].value, &zi->p[i], buf + zi->p[i].uoff * (int64_t)zi->cesz, zi->o.compute_dtype,
                           zi->device);
    }
    if (k + dir >= 0 && k + dir < z->n_units && zi->u[k + dir].pstate == DSK__ZERO_RELEASED)
        DSK__TRY(dsk__zero_start_gather(z, ctx, k + dir, &started, fn));
    return DSK_OK;
}

static dsk_status dsk__zero_unit_arg(dsk_zero *z, int unit, const char *fn, int *k) {
    DSK__TRY(dsk__zero_need(z, fn));
    *k = dsk__zero_unit_of(z->impl, z->n_units, unit);
    return DSK_OK;
}

DSK_API dsk_status dsk_zero_forward_begin(dsk_zero *z, dsk_ctx *ctx, int unit) {
    int k;
    DSK__TRY(dsk__zero_unit_arg(z, unit, "dsk_zero_forward_begin", &k));
    return k < 0 ? DSK_OK : dsk__zero_need_unit(z, ctx, k, 1, "dsk_zero_forward_begin");
}

/* Stage 3: frees unit k's gather buffer (a prefetched gather still in flight is waited for). */
static dsk_status dsk__zero_release(dsk_zero *z, dsk_ctx *ctx, int k, const char *fn) {
    dsk__zero_impl *zi = z->impl;
    dsk__zero_u *u = &zi->u[k];
    if (z->stage != 3 || u->pstate == DSK__ZERO_RELEASED) return DSK_OK;
    if (u->pstate == DSK__ZERO_GATHERING) DSK__TRY(dsk__zero_wait_ticket(z, ctx, u->gather_ticket, fn));
    zi->pbuf_owner[u->pbuf] = -1;
    u->pbuf = -1;
    u->pstate = DSK__ZERO_RELEASED;
    for (int i = u->p0; i < u->p0 + u->np; i++)
        dsk__zero_bind(zi->p[i].value, &zi->p[i], NULL, zi->o.compute_dtype, zi->device);
    return DSK_OK;
}

DSK_API dsk_status dsk_zero_forward_end(dsk_zero *z, dsk_ctx *ctx, int unit) {
    int k;
    DSK__TRY(dsk__zero_unit_arg(z, unit, "dsk_zero_forward_end", &k));
    return k < 0 ? DSK_OK : dsk__zero_release(z, ctx, k, "dsk_zero_forward_end");
}

/* Stages 2-3: a gradient buffer for unit k, zeroed, its parameters' grads bound to it: a free
   one, else the one whose reduction was queued first (the queue runs in order, so it is the
   first to finish) once that reduction is done. */
static dsk_status dsk__zero_take_grad_buffer(dsk_zero *z, dsk_ctx *ctx, int k, const char *fn) {
    dsk__zero_impl *zi = z->impl;
    dsk__zero_u *u = &zi->u[k];
    int nb = zi->o.grad_buffers, slot = dsk__zero_free_slot(zi->gbuf_owner, nb), blocked = -1;
    if (u->bwd_pass == zi->pass)
        return dsk_set_error(DSK_ERR_STATE, "%s: unit %d's backward already began in this pass", fn, u->id);
    if (u->gbuf >= 0) slot = u->gbuf; /* its own buffer from an earlier pass: its reduction must be done */
    if (slot < 0 || zi->gbuf_owner[slot] >= 0) {
        int64_t oldest = 0;
        for (int i = 0; u->gbuf < 0 && i < nb; i++) {
            const dsk__zero_u *o = &zi->u[zi->gbuf_owner[i]];
            if (o->bwd_pass == zi->pass && o->pending > 0) { blocked = i; continue; } /* still being written */
            if (slot < 0 || o->reduce_ticket < oldest) { oldest = o->reduce_ticket; slot = i; }
        }
        if (slot < 0)
            return dsk_set_error(DSK_ERR_STATE, "%s: no free gradient buffer for unit %d: unit %d's gradients "
                                 "are not all marked ready (or raise grad_buffers from %d)", fn, u->id,
                                 zi->u[zi->gbuf_owner[blocked]].id, nb);
        DSK__TRY(dsk__zero_wait_ticket(z, ctx, zi->u[zi->gbuf_owner[slot]].reduce_ticket, fn));
        zi->u[zi->gbuf_owner[slot]].gbuf = -1;
    }
    zi->gbuf_owner[slot] = k;
    u->gbuf = slot;
    u->bwd_pass = zi->pass;
    u->reduce_ticket = 0;
    DSK__TRY(dsk_tensor_fill(ctx, &zi->gbufs[slot], 0.0));
    for (int i = u->p0; i < u->p0 + u->np; i++)
        dsk__zero_bind(zi->p[i].grad, &zi->p[i], (float *)zi->gbufs[slot].data + zi->p[i].uoff, DSK_F32, zi->device);
    return DSK_OK;
}

DSK_API dsk_status dsk_zero_backward_begin(dsk_zero *z, dsk_ctx *ctx, int unit) {
    const char *fn = "dsk_zero_backward_begin";
    int k;
    DSK__TRY(dsk__zero_unit_arg(z, unit, fn, &k));
    if (k < 0) return DSK_OK;
    if (!z->impl->in_pass)
        return dsk_set_error(DSK_ERR_STATE, "%s: unit %d outside a pass (call dsk_zero_begin)", fn, unit);
    DSK__TRY(dsk__zero_need_unit(z, ctx, k, -1, fn));
    if (z->stage >= 2) DSK__TRY(dsk__zero_take_grad_buffer(z, ctx, k, fn));
    return DSK_OK;
}

DSK_API dsk_status dsk_zero_backward_end(dsk_zero *z, dsk_ctx *ctx, int unit) {
    const char *fn = "dsk_zero_backward_end";
    dsk__zero_impl *zi;
    int k;
    DSK__TRY(dsk__zero_unit_arg(z, unit, fn, &k));
    if (k < 0) return DSK_OK;
    zi = z->impl;
    if (z->stage >= 2)
        for (int i = zi->u[k].p0; i < zi->u[k].p0 + zi->u[k].np; i++)
            dsk__zero_bind(zi->p[i].grad, &zi->p[i], NULL, DSK_F32, zi->device);
    return dsk__zero_release(z, ctx, k, fn);
}

/* Ends the pass in progress, if any: a reducing pass must have marked every parameter. */
static dsk_status dsk__zero_close_pass(dsk_zero *z, const char *fn) {
    dsk__zero_impl *zi = z->impl;
    if (!zi->in_pass) return DSK_OK;
    zi->in_pass = 0;
    if (!zi->sync) return DSK_OK;
    for (int i = 0; i < z->n_params; i++)
        if (!zi->p[i].marked)
            return dsk_set_error(DSK_ERR_STATE, "%s: parameter %d \"%s\" (unit %d) was never marked ready in the "
                                 "pass", fn, i, zi->p[i].name, zi->u[zi->p[i].unit].id);
    zi->iter++;
    z->stats.passes++;
    return DSK_OK;
}

DSK_API dsk_status dsk_zero_begin(dsk_zero *z, dsk_ctx *ctx, int sync) {
    const char *fn = "dsk_zero_begin";
    dsk__zero_impl *zi;
    DSK__TRY(dsk__zero_need(z, fn));
    zi = z->impl;
    if (zi->in_pass && z->stage <= 1 && zi->sync) DSK__TRY(dsk__zero_drain(z, ctx, fn)); /* reduced in place */
    DSK__TRY(dsk__zero_close_pass(z, fn));
    if (zi->fresh) {
        DSK__TRY(dsk__zero_drain(z, ctx, fn));
        if (z->stage <= 1) DSK__TRY(dsk_tensor_fill(ctx, &zi->full_g, 0.0));
        for (int k = 0; k < z->n_units; k++) zi->u[k].reduced = 0;
        zi->fresh = 0;
    }
    for (int k = 0; k < z->n_units; k++) zi->u[k].pending = zi->u[k].np;
    for (int i = 0; i < z->n_params; i++) zi->p[i].marked = 0;
    zi->sync = sync != 0 || z->stage >= 2;
    zi->in_pass = 1;
    zi->pass++;
    return DSK_OK;
}

DSK_API dsk_status dsk_zero_grad_ready(dsk_zero *z, dsk_ctx *ctx, int param) {
    const char *fn = "dsk_zero_grad_ready";
    dsk__zero_impl *zi;
    dsk__zero_u *u;
    DSK__TRY(dsk__zero_need(z, fn));
    zi = z->impl;
    if (param < 0 || param >= z->n_params)
        return dsk_set_error(DSK_ERR_ARG, "%s: parameter %d not in [0, %d)", fn, param, z->n_params);
    if (!zi->in_pass)
        return dsk_set_error(DSK_ERR_STATE, "%s: parameter %d \"%s\" marked outside a pass (call dsk_zero_begin)", fn,
                             param, zi->p[param].name);
    if (zi->p[param].marked)
        return dsk_set_error(DSK_ERR_STATE, "%s: parameter %d \"%s\" marked ready twice in one pass", fn, param,
                             zi->p[param].name);
    u = &zi->u[zi->p[param].unit];
    if (z->stage >= 2 && (u->gbuf < 0 || u->bwd_pass != zi->pass))
        return dsk_set_error(DSK_ERR_STATE, "%s: parameter %d \"%s\" marked before its unit %d's backward began "
                             "(dsk_zero_backward_begin)", fn, param, zi->p[param].name, u->id);
    zi->p[param].marked = 1;
    if (--u->pending > 0 || !zi->sync) return DSK_OK;
    {
        float *g = z->stage <= 1 ? (float *)zi->full_g.data + u->full_off : (float *)zi->gbufs[u->gbuf].data;
        DSK__TRY(dsk__zero_enqueue(z, ctx, DSK__ZERO_OP_REDUCE, (int)(u - zi->u), g, u->reduced, &u->reduce_ticket,
                                   fn));
        u->reduced = 1;
    }
    return DSK_OK;
}

DSK_API dsk_status dsk_zero_wait(dsk_zero *z, dsk_ctx *ctx) {
    const char *fn = "dsk_zero_wait";
    dsk__zero_impl *zi;
    DSK__TRY(dsk__zero_need(z, fn));
    zi = z->impl;
    DSK__TRY(dsk__zero_drain(z, ctx, fn));
    for (int i = 0; z->stage >= 2 && i < zi->o.grad_buffers; i++) /* every reduction is done: free the buffers */
        if (zi->gbuf_owner[i] >= 0) {
            zi->u[zi->gbuf_owner[i]].gbuf = -1;
            zi->gbuf_owner[i] = -1;
        }
    return dsk__zero_close_pass(z, fn);
}

/* ---------------------------------------------------------------- the step */

/* Gradient views of this rank's pieces (in), or of the rest of each gradient (stage 0). */
static int dsk__zero_grad_pieces(const dsk_zero *z, dsk_tensor *out, int rest) {
    const dsk__zero_impl *zi = z->impl;
    int n = 0;
    for (int i = 0; i < z->n_params; i++) {
        const dsk__zero_p *p = &zi->p[i];
        if (!rest) {
            if (p->own_b > p->own_a) out[n++] = dsk__zero_grad_of(z, p, p->own_a, p->own_b);
            continue;
        }
        if (p->own_b <= p->own_a) { out[n++] = dsk__zero_grad_of(z, p, 0, p->numel); continue; }
        if (p->own_a > 0) out[n++] = dsk__zero_grad_of(z, p, 0, p->own_a);
        if (p->own_b < p->numel) out[n++] = dsk__zero_grad_of(z, p, p->own_b, p->numel);
    }
    return n;
}

DSK_API dsk_status dsk_zero_unscale_decide(dsk_zero *const *zs, int n, dsk_amp_scaler *sc, dsk_comm *world,
                                           dsk_ctx *ctx, double max_norm, dsk_amp_decision *dec) {
    const char *fn = "dsk_zero_unscale_decide";
    dsk_tensor *views = NULL, **list = NULL;
    int total = 0, k = 0;
    dsk_amp_stats st;
    dsk_status s = DSK_OK;
    memset(&st, 0, sizeof st);
    if (n < 1 || !zs || !sc || !dec) return dsk_set_error(DSK_ERR_ARG, "%s: need objects, a scaler and dec", fn);
    for (int i = 0; i < n; i++) {
        DSK__TRY(dsk__zero_need(zs[i], fn));
        if (zs[i]->impl->in_pass) return dsk_set_error(DSK_ERR_STATE, "%s: object %d's pass was not waited for", fn, i);
        DSK__TRY(dsk__zero_drain(zs[i], ctx, fn));
        total += 2 * zs[i]->n_params;
    }
    views = (dsk_tensor *)DSK_MALLOC((size_t)total * sizeof *views);
    list = (dsk_tensor **)DSK_MALLOC((size_t)total * sizeof *list);
    if (!views || !list) { s = dsk_set_error(DSK_ERR_OOM, "%s: piece lists", fn); goto done; }
    for (int i = 0; i < n; i++) k += dsk__zero_grad_pieces(zs[i], views + k, 0);
    for (int i = 0; i < k; i++) list[i] = &views[i];
    if ((s = dsk_amp_unscale(sc, ctx, list, k)) != DSK_OK || (s = dsk_amp_stats_get(sc, ctx, &st)) != DSK_OK) goto done;
    for (int i = 0; i < n; i++) /* stage 0 steps whole gradients: unscale the rest too, keep the pieces' stats */
        if (zs[i]->stage == 0) {
            int m = dsk__zero_grad_pieces(zs[i], views, 1);
            for (int j = 0; j < m; j++) list[j] = &views[j];
            if ((s = dsk_amp_unscale(sc, ctx, list, m)) != DSK_OK) goto done;
        }
    if ((s = dsk_amp_stats_set(sc, ctx, &st)) != DSK_OK) goto done; /* this rank's pieces' (stage 0 overwrote) */
    if (world && world->world_size > 1 && sc->device.type == DSK_DEV_CUDA) { /* in the scaler's device memory */
        double *w = dsk_amp_stats_data(sc);
        if ((s = dsk_comm_all_reduce(world, ctx, w, w, 2, DSK_F64, DSK_COMM_SUM)) != DSK_OK ||
            (s = dsk_amp_stats_get(sc, ctx, &st)) != DSK_OK)
            goto done;
    } else if (world && world->world_size > 1) {
        double w[2] = {st.found_inf, st.sumsq};
        if ((s = dsk_comm_all_reduce(world, NULL, w, w, 2, DSK_F64, DSK_COMM_SUM)) != DSK_OK) goto done;
        st.found_inf = w[0];
        st.sumsq = w[1];
    }
    if ((s = dsk_amp_stats_set(sc, ctx, &st)) != DSK_OK) goto done;
    *dec = dsk_amp_decide(st, max_norm);
done:
    DSK_FREE(views);
    DSK_FREE(list);
    return s;
}

DSK_API dsk_status dsk_zero_step(dsk_zero *z, dsk_ctx *ctx, const dsk_adamw_opts *opts, int64_t step,
                                 const dsk_amp_decision *dec) {
    const char *fn = "dsk_zero_step";
    dsk__zero_impl *zi;
    dsk_adamw_opts o = opts ? *opts : dsk_adamw_defaults(), plain;
    DSK__TRY(dsk__zero_need(z, fn));
    zi = z->impl;
    if (!dec) return dsk_set_error(DSK_ERR_ARG, "%s: decision is NULL", fn);
    if (zi->in_pass) return dsk_set_error(DSK_ERR_STATE, "%s: the pass was not waited for (dsk_zero_wait)", fn);
    DSK__TRY(dsk__zero_drain(z, ctx, fn));
    for (int k = 0; k < z->n_units; k++)
        if (!zi->u[k].reduced)
            return dsk_set_error(DSK_ERR_STATE, "%s: unit %d (\"%s\" ...) has no reduced gradients since the last "
                                 "step (no synchronising pass ran its backward)", fn, zi->u[k].id,
                                 zi->p[zi->u[k].p0].name);
    zi->fresh = 1;
    if (dec->skip)
        for (int k = 0; k < z->n_units; k++) zi->u[k].has_err &= zi->o.compress != DSK_ZERO_COMPRESS_FP8;
    if (dec->skip) return DSK_OK;
    plain = o;
    plain.weight_decay = 0.0f;
    for (int i = 0; i < z->n_params; i++) {
        dsk__zero_p *p = &zi->p[i];
        const dsk__zero_u *u = &zi->u[p->unit];
        int64_t a = z->stage == 0 ? 0 : p->own_a, b = z->stage == 0 ? p->numel : p->own_b;
        dsk_tensor master, grad, m, v, copy;
        if (b <= a) continue;
        master = dsk__zero_master_of(z, p, a, b);
        grad = dsk__zero_grad_of(z, p, a, b);
        m = dsk__zero_view(&zi->m, dsk__zero_opt_off(z, u, p->uoff + a), b - a);
        v = dsk__zero_view(&zi->v, dsk__zero_opt_off(z, u, p->uoff + a), b - a);
        copy = dsk__zero_copy_of(z, p, a, b);
        DSK__TRY(dsk_adamw_step(ctx, &master, &grad, &m, &v, p->no_decay ? &plain : &o, step, dec->grad_mult,
                                copy.data ? &copy : NULL));
    }
    dsk__zero_release_all(z);
    if (z->stage == 1 || z->stage == 2) DSK__TRY(dsk__zero_start_gathers(z, ctx, fn));
    return DSK_OK;
}

/* ---------------------------------------------------------------- checkpoints */

/* The boxes of elements [a, b) of a row-major tensor of shape sh (dims d..nd-1, the dims before
   fixed at at[0..d)): at most 2 (nd - d) - 1 boxes, each contiguous in the flattening. Box k
   starts at box_at[k] with extent box_ext[k]; returns the count. */
static int dsk__zero_boxes(int nd, const int64_t *sh, int d, int64_t a, int64_t b, int64_t *at,
                           int64_t (*box_at)[DSK_MAX_DIMS], int64_t (*box_ext)[DSK_MAX_DIMS]) {
    int64_t inner = 1, r0, r1;
    int k = 0;
    if (b <= a) return 0;
    for (int j = d + 1; j < nd; j++) inner *= sh[j];
    r0 = a / inner;
    r1 = b / inner;
    if (a % inner) { /* the head: part of row r0 */
        int64_t e = b < (r0 + 1) * inner ? b - r0 * inner : inner;
        at[d] = r0;
        k += dsk__zero_boxes(nd, sh, d + 1, a % inner, e, at, box_at + k, box_ext + k);
        if (b < (r0 + 1) * inner) return k;
        r0++;
    }
    if (r1 > r0) { /* whole rows */
        for (int j = 0; j < nd; j++) {
            box_at[k][j] = j < d ? at[j] : j == d ? r0 : 0;
            box_ext[k][j] = j < d ? 1 : j == d ? r1 - r0 : sh[j];
        }
        k++;
    }
    if (b % inner) { /* the tail: part of row r1 */
        at[d] = r1;
        k += dsk__zero_boxes(nd, sh, d + 1, 0, b % inner, at, box_at + k, box_ext + k);
    }
    return k;
}

/* Appends the box entries of role r (0 master, 1 adam_m, 2 adam_v) of elements [a, b) of p. */
static dsk_status dsk__zero_ck_add(dsk_zero *z, const dsk__zero_p *p, int r, int64_t a, int64_t b) {
    static const char *suffix[3] = {"", ".adam_m", ".adam_v"};
    dsk__zero_impl *zi = z->impl;
    const dsk__zero_u *u = &zi->u[p->unit];
    int64_t at[DSK_MAX_DIMS], box_at[2 * DSK_MAX_DIMS][DSK_MAX_DIMS], box_ext[2 * DSK_MAX_DIMS][DSK_MAX_DIMS], pos = a;
    int nb = dsk__zero_boxes(p->ndim, p->shape, 0, a, b, at, box_at, box_ext);
    for (int k = 0; k < nb; k++) {
        int i = zi->ck_n++;
        int64_t n = 1;
        dsk_ckpt_entry *e = &zi->ck_e[i];
        char *name = zi->ck_names + (size_t)i * DSK__ZERO_NAME_MAX;
        dsk_tensor flat;
        for (int j = 0; j < p->ndim; j++) {
            n *= box_ext[k][j];
            zi->ck_at[i][j] = p->g_at[j] + box_at[k][j];
        }
        snprintf(name, DSK__ZERO_NAME_MAX, "%s%s", p->name, suffix[r]);
        if (r == 0) flat = dsk__zero_master_of(z, p, pos, pos + n);
        else flat = dsk__zero_view(r == 1 ? &zi->m : &zi->v, dsk__zero_opt_off(z, u, p->uoff + pos), n);
        DSK__TRY(dsk_tensor_reshape(&flat, p->ndim, box_ext[k], &zi->ck_t[i]));
        memset(e, 0, sizeof *e);
        e->name = name;
        e->tensor = &zi->ck_t[i];
        e->split = DSK_CKPT_BOX;
        e->offset = zi->ck_at[i];
        e->global_shape = p->g_shape;
        pos += n;
    }
    return DSK_OK;
}

DSK_API dsk_status dsk_zero_ckpt_entries(dsk_zero *z, dsk_ctx *ctx, dsk_zero_ckpt_mode mode,
                                         const dsk_ckpt_entry **entries, int *n) {
    const char *fn = "dsk_zero_ckpt_entries";
    dsk__zero_impl *zi;
    size_t cap;
    DSK__TRY(dsk__zero_need(z, fn));
    if (!entries || !n || (mode != DSK_ZERO_CKPT_SAVE && mode != DSK_ZERO_CKPT_LOAD))
        return dsk_set_error(DSK_ERR_ARG, "%s: bad mode %d or NULL output", fn, (int)mode);
    zi = z->impl;
    DSK__TRY(dsk__zero_drain(z, ctx, fn));
    cap = (size_t)3 * (size_t)z->n_params * (2 * DSK_MAX_DIMS - 1);
    if (!zi->ck_e) {
        zi->ck_e = (dsk_ckpt_entry *)DSK_MALLOC(cap * sizeof *zi->ck_e);
        zi->ck_t = (dsk_tensor *)DSK_MALLOC(cap * sizeof *zi->ck_t);
        zi->ck_at = (int64_t(*)[DSK_MAX_DIMS])DSK_MALLOC(cap * sizeof *zi->ck_at);
        zi->ck_names = (char *)DSK_MALLOC(cap * DSK__ZERO_NAME_MAX);
        if (!zi->ck_e || !zi->ck_t || !zi->ck_at || !zi->ck_names)
            return dsk_set_error(DSK_ERR_OOM, "%s: entry lists", fn);
    }
    zi->ck_n = 0;
    for (int i = 0; i < z->n_params; i++) {
        const dsk__zero_p *p = &zi->p[i];
        int whole = z->stage == 0 && mode == DSK_ZERO_CKPT_LOAD;
        int64_t a = whole ? 0 : p->own_a, b = whole ? p->numel : p->own_b;
        for (int r = 0; r < 3 && b > a; r++) DSK__TRY(dsk__zero_ck_add(z, p, r, a, b));
    }
    *entries = zi->ck_e;
    *n = zi->ck_n;
    return DSK_OK;
}

DSK__FP_EXACT_END
#endif /* DSK_ZERO_IMPLEMENTATION_DONE */
#endif /* DSK_ZERO_IMPLEMENTATION */

/* MIT License. Copyright (c) 2026 the dsk authors. Permission is hereby granted, free of charge, to any
   person obtaining a copy of this software, to deal in it without restriction, subject to including this
   notice. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND. */
