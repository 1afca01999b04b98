/* dsk_amp.h - mixed-precision training: loss scaling, unscale + non-finite check, global-norm
   clipping, f32 master weights with bf16/f16 copies, FP8 scaling helpers.

   Usage: #define DSK_AMP_IMPLEMENTATION in exactly one .c file before including (with
   DSK_TENSOR_IMPLEMENTATION somewhere in the program).
   Options: DSK_STATIC, DSK_MALLOC/DSK_FREE, DSK_CUDA, DSK_NO_CUDA as in dsk_tensor.h.

   One training step (every call runs on the scaler's device; on CUDA nothing below syncs
   the host except the reads dsk_amp_scale_get and dsk_amp_stats_get, 12 and 16 bytes; the
   trainer needs them on the host anyway, for its loss gradient and for AdamW's grad_mult):

   Example (given dsk_amp_scaler *sc, dsk_ctx *ctx, dsk_tensor *const *grads, const dsk_amp_param *params,
            int n, const dsk_adamw_opts *adamw, int64_t *step, double max_norm, uint64_t seed):
       float s;
       dsk_status e = dsk_amp_scale_get(sc, ctx, &s);          // loss scale of this step
       // forward, loss; backward with the loss gradient times s, e.g. dsk_cross_entropy(..., s)
       if (e == DSK_OK) e = dsk_amp_unscale(sc, ctx, grads, n); // grads *= 1/s; local stats
       // Where ranks hold different gradients, ONE all-reduce SUM joins the local stats when
       // every element of the world sits on exactly one rank (ZeRO shards: dsk_zero_unscale_decide),
       // two f64 in sc's memory at dsk_amp_stats_data(sc), in place:
       // ncclAllReduce(p, p, 2, ncclFloat64, ncclSum, comm, stream) keeps it on the device;
       // or on the host: dsk_amp_stats_get, all-reduce the two numbers, dsk_amp_stats_set.
       // found_inf becomes the number of ranks that saw NaN/Inf, sumsq the global sum of squares.
       // Not so under expert parallelism: replicated gradients are equal on every rank (a world
       // sum would count them once per rank) and only the expert-sharded ones differ across the
       // EP group: dsk_moe_amp_unscale (dsk_moe.h) joins stats(replicated) + SUM over the EP
       // group of stats(expert-sharded) instead.
       dsk_amp_stats st;
       if (e == DSK_OK) e = dsk_amp_stats_get(sc, ctx, &st);
       if (e != DSK_OK) return e;                              // st is set only on success
       dsk_amp_decision d = dsk_amp_decide(st, max_norm);      // skip? clip coefficient
       e = dsk_amp_step(ctx, params, n, adamw, *step, &d, DSK_AMP_ROUND_NEAREST, seed); // no-op if d.skip
       if (e == DSK_OK && !d.skip) ++*step;
       return e == DSK_OK ? dsk_amp_update(sc, ctx) : e;       // scale rule on sc's device
   End of example.

   Loss scaling follows PyTorch GradScaler (aten AmpKernels.cu _amp_update_scale_, grad_scaler.py):
   on overflow the step is skipped, scale *= backoff and the growth tracker resets; after
   growth_interval clean steps in a row scale *= growth, kept only if finite. Optional
   hysteresis as in Megatron/DeepSpeed/apex, min/max scale, static and no-scaling (bf16) modes.
   The rule is dsk_amp_scaler_rule(), one DSK_HD function run by the CPU path and the CUDA
   kernel, so the GPU keeps the scale in device memory and updates it without a host sync.

   FP8: e4m3 (max 448, saturating) and e5m2 (max 57344, Inf) with per-tensor current
   scaling, delayed scaling from an amax history (TransformerEngine's rule), and DeepSeek-V3
   fine-grained block scaling (1x128 activations, 128x128 weights, f32 dequantisation scales).
   Per-tensor casts saturate an Inf to +-448 in e4m3 (as TransformerEngine does); the block
   path keeps a block with an Inf or NaN non-finite (as DeepSeek's kernel does).

   Arguments: a call on an object takes it first, then ctx (dsk_amp_unscale(&sc, ctx, ...),
   dsk_amp_fp8_delayed_update(&d, ctx)); a free-standing op takes ctx first (dsk_amp_cast,
   dsk_amp_step, dsk_amp_amax, the fp8 quantize/dequantize functions).
   License: MIT, see the end of the file. */

/* Contents
     declarations
       loss scaler                dsk_amp_scaler_opts/state/stats, dsk_amp_scaler_rule, dsk_amp_scaler_init/free,
                                  dsk_amp_state_get/set, dsk_amp_scale_get, dsk_amp_unscale, dsk_amp_stats_*,
                                  dsk_amp_update
       clipping and skip          dsk_amp_decision, dsk_amp_decide
       master weights and casts   dsk_amp_round, stochastic rounding (dsk_amp_sr_key, dsk_amp_f32_to_bf16_sr,
                                  dsk_amp_f32_to_f16_sr), dsk_amp_cast, dsk_amp_param, dsk_amp_step
       device-resident step       dsk_amp_step_vals, dsk_amp_dstep (init/free/schedule/upload/get),
                                  dsk_amp_decide_dev, dsk_amp_step_dev: a whole step in a CUDA graph
       FP8 scaling                scale rules (dsk_amp_fp8_scale, dsk_amp_fp8_block_scale), dsk_amp_amax,
                                  per-tensor current scaling and quantize, delayed scaling, DeepSeek-V3 blocks
                                  (dsk_amp_fp8_block_quantize, its transposed form _t, dequantize)
       CUDA launchers             (DSK_CUDA) dsk_cuda_amp_*: kernels/amp.cu
     implementation (DSK_AMP_IMPLEMENTATION)
       checks, loss scaler, unscale + check, casts and optimizer step, device-resident step, FP8 */
#ifndef DSK_AMP_H
#define DSK_AMP_H

#include "dsk_tensor.h"

DSK__FP_EXACT_BEGIN
#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ loss scaler */

typedef enum dsk_amp_mode {
    DSK_AMP_DYNAMIC = 0, /* GradScaler rule, optional hysteresis and min/max */
    DSK_AMP_STATIC,      /* the scale stays init_scale; overflow steps are still skipped */
    DSK_AMP_NONE         /* bf16: scale 1, the non-finite check and skip are kept */
} dsk_amp_mode;

/* Zero fields take the defaults in brackets. */
typedef struct dsk_amp_scaler_opts {
    dsk_amp_mode mode;              /* [DSK_AMP_DYNAMIC] */
    float init_scale;               /* [65536]; DSK_AMP_NONE always uses 1 */
    double growth_factor;           /* [2.0], > 1 */
    double backoff_factor;          /* [0.5], in (0, 1) */
    int32_t growth_interval;        /* [2000] clean steps in a row before growth */
    int32_t hysteresis;             /* [1] the Nth overflow backs off; the ones before are only skipped */
    int32_t hysteresis_consecutive; /* [0] refill hysteresis on growth (Megatron, DeepSpeed default);
                                       1: on every clean step (apex, DeepSpeed consecutive_hysteresis) */
    float min_scale;                /* [0 = none, as PyTorch] back-off never goes below it; without
                                       one, a long run of overflows can push the scale under 2^-126
                                       where 1/scale overflows (DeepSpeed and Megatron use 1) */
    float max_scale;                /* [0 = none] growth stops at it; growth never reaches Inf */
} dsk_amp_scaler_opts;

/* Everything the scaler carries from step to step: save it in checkpoints, restore it with
   dsk_amp_state_set and the trajectory continues exactly. */
typedef struct dsk_amp_scaler_state {
    float scale;
    int32_t growth_tracker;  /* clean steps since the last growth or overflow, < growth_interval */
    int32_t hysteresis_left; /* overflows (this one included) until the next back-off, in [1, hysteresis] */
} dsk_amp_scaler_state;

/* Result of one unscale pass. Two f64 so one SUM all-reduce joins all ranks. */
typedef struct dsk_amp_stats {
    double found_inf; /* > 0 if some gradient element was NaN or Inf (after unscaling) */
    double sumsq;     /* sum of squares of the unscaled gradients, f64 */
} dsk_amp_stats;

typedef struct dsk_amp_scaler {
    dsk_amp_scaler_opts opts;  /* resolved: defaults filled in */
    dsk_device device;         /* where the state and stats live */
    dsk_amp_stats stats;       /* CPU scaler: the stats */
    dsk_amp_scaler_state state;/* CPU scaler: the state */
    void *dev_block;           /* CUDA scaler: device memory {dsk_amp_stats; dsk_amp_scaler_state} */
} dsk_amp_scaler;

/* 1 if stats say this step must be skipped: a NaN/Inf was seen or the norm is not finite. */
static inline DSK_HD int dsk_amp_stats_overflow(dsk_amp_stats st) {
    return !(st.found_inf <= 0.0) || !(st.sumsq - st.sumsq == 0.0);
}

static inline DSK_HD int dsk_amp_isfinite(float x) { return (dsk_f32_bits(x) & 0x7f800000u) != 0x7f800000u; }

/* The loss-scale update rule, shared by the CPU path and the CUDA kernel. `o` must be
   resolved (dsk_amp_scaler_init fills the defaults). Products are formed in f64 and
   rounded to f32 as PyTorch does. */
static inline DSK_HD void dsk_amp_scaler_rule(dsk_amp_scaler_state *s, int overflow, const dsk_amp_scaler_opts *o) {
    if (o->mode != DSK_AMP_DYNAMIC) return;
    if (overflow) {
        s->growth_tracker = 0;
        if (s->hysteresis_left > 1) { s->hysteresis_left--; return; } /* absorbed: skip only */
        float next = (float)((double)s->scale * o->backoff_factor);
        if (o->min_scale > 0.0f && next < o->min_scale) next = o->min_scale;
        if (next > 0.0f) s->scale = next; /* the mirror of the Inf guard: never reaches 0 */
        return;
    }
    if (o->hysteresis_consecutive) s->hysteresis_left = o->hysteresis;
    if (s->growth_tracker + 1 >= o->growth_interval) {
        float next = (float)((double)s->scale * o->growth_factor);
        if (o->max_scale > 0.0f && next > o->max_scale) next = o->max_scale;
        if (dsk_amp_isfinite(next)) s->scale = next;
        s->growth_tracker = 0;
        s->hysteresis_left = o->hysteresis;
    } else {
        s->growth_tracker++;
    }
}

/* 1/scale computed in f64 and rounded to f32 (GradScaler's inv_scale). */
static inline DSK_HD float dsk_amp_inv_scale(float scale) { return (float)(1.0 / (double)scale); }

/* Fills defaults and checks ranges; on CUDA the state lives in device memory of ctx's device. */
DSK_API dsk_status dsk_amp_scaler_init(dsk_amp_scaler *sc, dsk_ctx *ctx, const dsk_amp_scaler_opts *opts);
DSK_API void dsk_amp_scaler_free(dsk_amp_scaler *sc, dsk_ctx *ctx); /* zeroed/freed ok */
/* Reads the state (CUDA: copies 12 bytes and syncs the stream). */
DSK_API dsk_status dsk_amp_state_get(const dsk_amp_scaler *sc, dsk_ctx *ctx, dsk_amp_scaler_state *out);
/* Restores a saved state; checks scale > 0 finite, tracker in [0, interval), hysteresis_left in [1, hysteresis]. */
DSK_API dsk_status dsk_amp_state_set(dsk_amp_scaler *sc, dsk_ctx *ctx, const dsk_amp_scaler_state *st);
/* Current loss scale (dsk_amp_state_get's scale). */
DSK_API dsk_status dsk_amp_scale_get(const dsk_amp_scaler *sc, dsk_ctx *ctx, float *scale);

/* One fused pass over n gradients (each contiguous f32, bf16 or f16 on sc's device, any
   sizes, empty ok, no two sharing memory): g <- g * inv_scale, stored in g's dtype (RNE); sets the scaler's stats
   for this step: found_inf = 1 if any stored value is NaN or Inf, sumsq = sum of the squares
   of the stored values in f64, in a fixed order (deterministic for any thread count).
   16-bit gradients round once more when stored: prefer f32 gradients with large scales. */
DSK_API dsk_status dsk_amp_unscale(dsk_amp_scaler *sc, dsk_ctx *ctx, dsk_tensor *const *grads, int n);
/* The scaler's stats as two f64 in its device memory (found_inf, sumsq): the buffer to
   all-reduce (SUM) across ranks between dsk_amp_unscale and dsk_amp_stats_get/update. */
DSK_API double *dsk_amp_stats_data(dsk_amp_scaler *sc);
/* Reads the stats (CUDA: copies 16 bytes and syncs the stream). */
DSK_API dsk_status dsk_amp_stats_get(const dsk_amp_scaler *sc, dsk_ctx *ctx, dsk_amp_stats *out);
/* Overwrites the stats, e.g. with values joined across ranks on the host, so that
   dsk_amp_update sees them (CUDA: copies 16 bytes and syncs the stream). */
DSK_API dsk_status dsk_amp_stats_set(dsk_amp_scaler *sc, dsk_ctx *ctx, const dsk_amp_stats *st);
/* Applies the rule with overflow = dsk_amp_stats_overflow(stats), on the scaler's device
   (CUDA: one single-thread kernel, no host sync). Call once per step after the optimizer. */
DSK_API dsk_status dsk_amp_update(dsk_amp_scaler *sc, dsk_ctx *ctx);

/* ------------------------------------------------------------------ clipping and skip */

typedef struct dsk_amp_decision {
    int skip;        /* 1: leave weights, moments and copies untouched this step */
    float grad_mult; /* gradient multiplier for AdamW: the clip coefficient (1 if no clipping) */
    double norm;     /* global L2 norm of the unscaled gradients */
} dsk_amp_decision;

/* skip = dsk_amp_stats_overflow(st) (a non-finite norm counts as overflow); norm = sqrt(sumsq);
   grad_mult = min(1, max_norm / (norm + 1e-6)) in f64 rounded to f32 when max_norm > 0, else 1. */
static inline DSK_HD dsk_amp_decision dsk_amp_decide(dsk_amp_stats st, double max_norm) {
    dsk_amp_decision d;
    d.skip = dsk_amp_stats_overflow(st);
    d.norm = sqrt(st.sumsq);
    d.grad_mult = 1.0f;
    if (!d.skip && max_norm > 0.0) {
        double c = max_norm / (d.norm + 1e-6);
        d.grad_mult = (float)(c < 1.0 ? c : 1.0);
    }
    return d;
}

/* ------------------------------------------------------------------ master weights and casts */

typedef enum dsk_amp_round {
    DSK_AMP_ROUND_NEAREST = 0, /* round to nearest even */
    DSK_AMP_ROUND_STOCHASTIC   /* round up with probability (x - down) / (up - down), unbiased */
} dsk_amp_round;

/* Key of the stochastic-rounding stream of tensor `tensor_id` at optimizer `step`: element i
   uses word i % 4 of dsk_philox4x32(key, i / 4), so resume at any step is exact. */
static inline DSK_HD uint64_t dsk_amp_sr_key(uint64_t seed, uint64_t tensor_id, uint64_t step) {
    uint32_t a[4], b[4];
    dsk_philox4x32(seed, tensor_id, a);
    dsk_philox4x32(((uint64_t)a[1] << 32) | a[0], step, b);
    return ((uint64_t)b[1] << 32) | b[0];
}
static inline DSK_HD uint32_t dsk_amp_sr_bits(uint64_t key, uint64_t i) {
    uint32_t r[4];
    dsk_philox4x32(key, i >> 2, r);
    return r[i & 3];
}

/* f32 -> bf16 rounding up with probability (low 16 bits)/2^16, from 32 random bits `rnd`;
   NaN stays NaN; Inf stays Inf; a finite value above the largest bf16 may round to Inf. */
static inline DSK_HD uint16_t dsk_amp_f32_to_bf16_sr(float f, uint32_t rnd) {
    uint32_t u = dsk_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    if ((u & 0x7fffffffu) == 0x7f800000u) return (uint16_t)(u >> 16);
    return (uint16_t)((u + (rnd >> 16)) >> 16);
}
/* f32 -> f16 magnitude code with stochastic rounding (cf. dsk__round_minifloat): rounds up
   with probability rem / 2^shift from the 32 random bits; exact for shifts up to 32. */
static inline DSK_HD uint32_t dsk__amp_sr_minifloat(float f, int mbits, int bias, uint32_t rnd) {
    uint32_t u = dsk_f32_bits(f) & 0x7fffffffu;
    int e32 = (int)(u >> 23), e = e32 - 127, emin = 1 - bias, shift;
    uint32_t sig, q, thr;
    if (e32 == 0) return 0; /* f32 subnormals lie below 2^-126, far under every target's step */
    sig = (u & 0x7fffffu) | 0x800000u;
    shift = 23 - mbits + (e < emin ? emin - e : 0);
    if (shift >= 56) return 0;
    if (shift < 32) {
        q = sig >> shift;
        thr = (sig & ((1u << shift) - 1u)) << (32 - shift); /* rem / 2^shift as a 32-bit fraction */
    } else {
        q = 0;
        thr = sig >> (shift - 32);
    }
    if (rnd < thr) q++;
    if (e < emin) return q;
    return ((uint32_t)(e + bias) << mbits) + (q - (1u << mbits));
}
static inline DSK_HD uint16_t dsk_amp_f32_to_f16_sr(float f, uint32_t rnd) {
    uint32_t u = dsk_f32_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a == 0x7f800000u) return (uint16_t)(sign | 0x7c00u);
    uint32_t mag = dsk__amp_sr_minifloat(f, 10, 15, rnd);
    return (uint16_t)(sign | (mag >= 0x7c00u ? 0x7c00u : mag));
}

/* dst (bf16, f16 or f32) <- src (f32), same shape, contiguous, same device. NEAREST rounds
   to nearest even; STOCHASTIC uses stream dsk_amp_sr_key(seed, tensor_id, step). */
DSK_API dsk_status dsk_amp_cast(dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src, dsk_amp_round mode,
                                uint64_t seed, uint64_t tensor_id, uint64_t step);

/* One trainable tensor under mixed precision. */
typedef struct dsk_amp_param {
    const char *name;   /* for messages; may be NULL */
    dsk_tensor *master; /* f32 master weights */
    dsk_tensor *grad;   /* unscaled gradient, f32/bf16/f16 */
    dsk_tensor *m, *v;  /* AdamW moments: both f32 or both bf16 (dsk_adamw_step) */
    dsk_tensor *copy;   /* bf16/f16 compute copy, or NULL */
} dsk_amp_param;

/* One optimizer step over params[0..n) unless dec->skip (then nothing is read or written):
   dsk_adamw_step(master, grad, m, v, opts, step, dec->grad_mult) (opts taken literally, NULL for
   dsk_adamw_defaults()), then the copy is refreshed
   from the master with `round` (stochastic stream: seed, tensor id = index in params, step;
   give each group of params its own seed when calling once per group).
   `step` is 1-based and counts applied steps only. */
DSK_API dsk_status dsk_amp_step(dsk_ctx *ctx, const dsk_amp_param *params, int n, const dsk_adamw_opts *opts,
                                int64_t step, const dsk_amp_decision *dec, dsk_amp_round round, uint64_t seed);

/* ------------------------------------------------------------------ device-resident step

   dsk_amp_decide and dsk_amp_step take the step's scalars from the host (lr, the AdamW step, the
   skip decision and clip coefficient): a step captured once as a CUDA graph (dsk_graph_begin)
   could not change them between replays. A dsk_amp_dstep keeps them in memory of its device:
     schedule  lr, the AdamW step and its bias corrections, computed by the host exactly as
               dsk_adamw_step does (dsk_amp_dstep_schedule writes them into pinned memory) and
               copied to the device by dsk_amp_dstep_upload, a copy a capture records: every
               replay copies what the host wrote last;
     decision  skip, grad_mult, norm: dsk_amp_decide_dev runs dsk_amp_decide on the device on
               the scaler's stats;
   and dsk_amp_step_dev reads both there (a skipped step leaves every tensor untouched). On the
   same gradients the result is bitwise that of dsk_amp_decide + dsk_amp_step given the same lr
   and step from the host. On the CPU the calls work on host memory (upload does nothing), so one
   code path serves both devices.

   A captured step (the loss scale is a constant of the capture: capture again when it changes):
       before each launch (host):  dsk_amp_dstep_schedule(&ds, ctx, lr, applied + 1, &adamw);
       captured once:              dsk_amp_dstep_upload(&ds, ctx);
                                   forward, backward with the loss gradient times the scale
                                   dsk_amp_unscale(&sc, ctx, grads, n);
                                   dsk_amp_decide_dev(&ds, ctx, &sc, max_norm);
                                   dsk_amp_step_dev(ctx, params, n, &adamw, &ds, round, seed);
                                   dsk_amp_update(&sc, ctx);
       after the launch (host):    dsk_amp_stats_get + dsk_amp_decide give the same decision,
                                   for the log and the applied-step count (applied += !skip).
   The host must not rewrite the schedule while a launch that copies it may be pending: sync the
   stream in between (reading the step's loss does). */

typedef struct dsk_amp_step_vals {
    double norm;     /* decision: global L2 norm of the unscaled gradients */
    float grad_mult; /* decision: the clip coefficient (1 without clipping) */
    int32_t skip;    /* decision: 1 = leave everything untouched this step */
    int64_t step;    /* schedule: AdamW step, 1-based, counting applied steps (and the rounding stream's key) */
    float lr;        /* schedule */
    float bc1, bc2;  /* schedule: dsk_adamw_bias_correction(beta1 and beta2, step) */
    float reserved;  /* zero (keeps the struct's size a multiple of 8 on every ABI) */
} dsk_amp_step_vals;

typedef struct dsk_amp_dstep {
    dsk_device device;
    float beta1, beta2;        /* of the last schedule: dsk_amp_step_dev's opts must carry them */
    dsk_amp_step_vals *vals;   /* on `device` (CPU: host memory) */
    dsk_amp_step_vals *pinned; /* CUDA: the schedule as the host wrote it, pinned; upload copies it to vals */
    dsk_tensor skip;           /* i32 scalar view of vals->skip, e.g. for dsk_moe_update_bias_unless */
} dsk_amp_dstep;

/* On ctx's device (ctx NULL: CPU); starts with step 0 and skip = 1 until a decision. */
DSK_API dsk_status dsk_amp_dstep_init(dsk_amp_dstep *ds, dsk_ctx *ctx);
DSK_API void dsk_amp_dstep_free(dsk_amp_dstep *ds, dsk_ctx *ctx); /* zeroed/freed ok */
/* Host side only (no device work): lr (finite, >= 0), step (>= 1) and the bias corrections of
   opts' betas (ranges as dsk_adamw_step; its lr is not read) for the next upload. */
DSK_API dsk_status dsk_amp_dstep_schedule(dsk_amp_dstep *ds, dsk_ctx *ctx, float lr, int64_t step,
                                          const dsk_adamw_opts *opts);
/* CUDA: enqueues the copy of the schedule from pinned memory to the device (no sync; capturable).
   CPU: nothing (the schedule is in place). */
DSK_API dsk_status dsk_amp_dstep_upload(dsk_amp_dstep *ds, dsk_ctx *ctx);
/* Reads the values (CUDA: copies them and syncs the stream), e.g. to inspect a step. */
DSK_API dsk_status dsk_amp_dstep_get(const dsk_amp_dstep *ds, dsk_ctx *ctx, dsk_amp_step_vals *out);
/* The decision dsk_amp_decide(stats of sc, max_norm), made on the device (CUDA: one single-thread
   kernel, no sync). sc and ds on the same device. */
DSK_API dsk_status dsk_amp_decide_dev(dsk_amp_dstep *ds, dsk_ctx *ctx, const dsk_amp_scaler *sc, double max_norm);
/* dsk_amp_step with lr, step and the decision read from ds on its device (CUDA: no sync; a
   skipped step launches kernels that return at once). opts gives beta1, beta2 (those of the
   schedule), eps and weight_decay; its lr is not read. Stochastic rounding keys on ds's step. */
DSK_API dsk_status dsk_amp_step_dev(dsk_ctx *ctx, const dsk_amp_param *params, int n, const dsk_adamw_opts *opts,
                                    const dsk_amp_dstep *ds, dsk_amp_round round, uint64_t seed);

/* ------------------------------------------------------------------ FP8 scaling */

/* Largest finite value of an fp8 format: 448 (e4m3), 57344 (e5m2); 0 for other dtypes. */
static inline DSK_HD float dsk_amp_fp8_max(dsk_dtype fmt) {
    return fmt == DSK_E4M3 ? DSK_E4M3_MAX : fmt == DSK_E5M2 ? DSK_E5M2_MAX : 0.0f;
}
static inline DSK_HD uint8_t dsk_amp_to_fp8(float x, dsk_dtype fmt) {
    return fmt == DSK_E4M3 ? dsk_f32_to_e4m3(x) : dsk_f32_to_e5m2(x);
}
/* x / d and x * s as the fp8 quantisers take them: a NaN result gets the sign of the operands'
   product (IEEE's rule for the sign of a quotient), where hardware differs (x86 gives -inf / inf
   and 0 / 0 the negative default NaN and passes an operand's NaN on; a GPU gives +NaN), so the
   CPU and the CUDA kernels write the same NaN code. */
static inline DSK_HD float dsk__amp_nan_sign(float v, float a, float b) {
    return v != v ? dsk_bits_f32(((dsk_f32_bits(a) ^ dsk_f32_bits(b)) & 0x80000000u) | 0x7fc00000u) : v;
}
static inline DSK_HD float dsk_amp_fp8_quotient(float x, float d) { return dsk__amp_nan_sign(x / d, x, d); }
static inline DSK_HD float dsk_amp_fp8_product(float x, float s) { return dsk__amp_nan_sign(x * s, x, s); }
static inline DSK_HD float dsk_amp_from_fp8(uint8_t b, dsk_dtype fmt) {
    return fmt == DSK_E4M3 ? dsk_e4m3_to_f32(b) : dsk_e5m2_to_f32(b);
}
/* |x| as ordered bits, every NaN as 0x7fc00000: the max over these is exact in any order
   (so CPU and GPU agree bitwise) and ranks NaN > Inf > finite. */
static inline DSK_HD uint32_t dsk_amp_abs_bits(float x) {
    uint32_t a = dsk_f32_bits(x) & 0x7fffffffu;
    return a > 0x7f800000u ? 0x7fc00000u : a;
}

/* Largest power of two <= x (x > 0 finite normal or subnormal); for pow2 scales. */
static inline DSK_HD float dsk_amp_pow2_floor(float x) {
    uint32_t u = dsk_f32_bits(x);
    if (u >= 0x00800000u) return dsk_bits_f32(u & 0xff800000u);
    while (u & (u - 1u)) u &= u - 1u; /* subnormal: keep the top bit */
    return dsk_bits_f32(u);
}

/* Quantisation scale (multiplier) from an amax: (fp8_max / amax) / 2^margin; amax 0 or not
   finite gives `prev`; a scale that overflows f32 becomes FLT_MAX; pow2 rounds it down to a
   power of two. Current scaling passes prev = 1, delayed scaling the previous scale
   (TransformerEngine's _default_sf_compute). */
static inline DSK_HD float dsk_amp_fp8_scale(float amax, float fp8_max, int margin, int pow2, float prev) {
    float s;
    if (!(amax > 0.0f) || !dsk_amp_isfinite(amax)) return prev;
    s = (fp8_max / amax) / ldexpf(1.0f, margin);
    if (!dsk_amp_isfinite(s)) s = 3.40282347e38f;
    return pow2 ? dsk_amp_pow2_floor(s) : s;
}
/* DeepSeek-V3 block dequantisation scale from a block amax: amax / fp8_max (x ~ q * d), 1
   when amax is 0, at least the smallest normal f32; pow2 rounds it up to a power of two (so
   |x| / d <= fp8_max still holds). A non-finite amax stays non-finite (Inf, or NaN for a NaN
   in the block), as in DeepSeek's act_quant kernel (s = amax / 448, y = x / s): the block
   quantises to 0 and NaN codes and dequantises to NaN, which the non-finite check sees. */
static inline DSK_HD float dsk_amp_fp8_block_scale(float amax, float fp8_max, int pow2) {
    float d;
    if (amax == 0.0f) return 1.0f;
    if (!dsk_amp_isfinite(amax)) return amax / fp8_max;
    d = amax / fp8_max;
    if (d < 1.17549435e-38f) d = 1.17549435e-38f;
    if (pow2) {
        float f = dsk_amp_pow2_floor(d);
        d = f == d ? d : 2.0f * f;
    }
    return d;
}

/* amax (scalar f32 on x's device) = max |x| over x (f32/bf16/f16, contiguous); NaN if any NaN,
   else Inf if any Inf. accumulate = 1 takes the max with amax's prior value, which must be
   >= 0 or NaN (as this function writes it). */
DSK_API dsk_status dsk_amp_amax(dsk_ctx *ctx, dsk_tensor *amax, const dsk_tensor *x, int accumulate);
/* Per-tensor current scaling: amax = max |x|, scale = dsk_amp_fp8_scale(amax, max of fmt,
   margin, pow2, 1); scale and amax are scalar f32 tensors on x's device (amax may be NULL). */
DSK_API dsk_status dsk_amp_fp8_current_scale(dsk_ctx *ctx, dsk_tensor *scale, dsk_tensor *amax, const dsk_tensor *x,
                                             dsk_dtype fmt, int margin, int pow2);
/* q (e4m3/e5m2) = fp8(x * scale), x f32/bf16/f16, scale a scalar f32 tensor; e4m3 saturates
   at +-448 (Inf too, as TransformerEngine's per-tensor cast: check x or its amax for overflow,
   not q), e5m2 overflows to Inf; NaN stays NaN. The block path below keeps Inf non-finite. */
DSK_API dsk_status dsk_amp_fp8_quantize(dsk_ctx *ctx, dsk_tensor *q, const dsk_tensor *x, const dsk_tensor *scale);
/* y (f32/bf16/f16) = f32(q) * (1 / scale), the reciprocal rounded to f32. */
DSK_API dsk_status dsk_amp_fp8_dequantize(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *q, const dsk_tensor *scale);

typedef enum dsk_amp_amax_algo { DSK_AMP_AMAX_MAX = 0, DSK_AMP_AMAX_MOST_RECENT } dsk_amp_amax_algo;

typedef struct dsk_amp_fp8_delayed_opts {
    dsk_dtype fmt;          /* [DSK_E4M3]; DSK_E4M3 or DSK_E5M2 (0, i.e. DSK_F32, means the default) */
    int history_len;        /* [1024] */
    int margin;             /* [0] */
    dsk_amp_amax_algo algo; /* [DSK_AMP_AMAX_MAX] over the history, or the most recent amax */
    int pow2;               /* [0] 1: power-of-two scales */
} dsk_amp_fp8_delayed_opts;

/* Delayed scaling of one tensor stream: quantise with the scale from past amaxes, record
   this amax, update the scale once per step. State lives on ctx's device. */
typedef struct dsk_amp_fp8_delayed {
    dsk_amp_fp8_delayed_opts opts; /* resolved */
    dsk_tensor history;            /* (history_len) f32 amaxes; slot `pos` collects this step's */
    dsk_tensor scale;              /* scalar f32, starts at 1 */
    int64_t pos;
} dsk_amp_fp8_delayed;

DSK_API dsk_status dsk_amp_fp8_delayed_init(dsk_amp_fp8_delayed *d, dsk_ctx *ctx, const dsk_amp_fp8_delayed_opts *opts);
DSK_API void dsk_amp_fp8_delayed_free(dsk_amp_fp8_delayed *d, dsk_ctx *ctx); /* zeroed/freed ok */
/* q = fp8(x * scale) with the current scale; history[pos] = max(history[pos], max |x|). */
DSK_API dsk_status dsk_amp_fp8_delayed_quantize(dsk_amp_fp8_delayed *d, dsk_ctx *ctx, dsk_tensor *q,
                                                const dsk_tensor *x);
/* End of step: amax = max of the history (or history[pos]); scale = dsk_amp_fp8_scale(amax,
   fp8_max, margin, pow2, scale); then pos advances and its slot is zeroed. */
DSK_API dsk_status dsk_amp_fp8_delayed_update(dsk_amp_fp8_delayed *d, dsk_ctx *ctx);

/* Fine-grained block scaling of a 2-D x (R, C) in blocks of (br, bc) elements (DeepSeek-V3:
   1x128 for activations, 128x128 for weights; edge blocks may be partial): scales
   (ceil(R/br), ceil(C/bc)) f32 = dsk_amp_fp8_block_scale(block amax, fmt max, pow2), and
   q (R, C) e4m3/e5m2 = fp8(x / scale of its block). A block holding an Inf or a NaN gets a
   non-finite scale and dequantises to NaN everywhere (DeepSeek's kernel), never to +-448. */
DSK_API dsk_status dsk_amp_fp8_block_quantize(dsk_ctx *ctx, dsk_tensor *q, dsk_tensor *scales, const dsk_tensor *x,
                                              int br, int bc, int pow2);
/* The transposed form, for the operands of the weight-gradient GEMM (dsk_matmul_fp8 in
   dsk_tensor.h takes K-major operands: dw = dy^T x reads dy^T and x^T, scaled along the tokens):
   q (C, R) and scales (ceil(C/br), ceil(R/bc)) are what dsk_amp_fp8_block_quantize writes for a
   transposed copy of x (R, C), bit for bit, with no copy made; with 1x128 blocks each scale covers
   128 rows of one column of x. */
DSK_API dsk_status dsk_amp_fp8_block_quantize_t(dsk_ctx *ctx, dsk_tensor *q, dsk_tensor *scales, const dsk_tensor *x,
                                                int br, int bc, int pow2);
/* y (R, C) f32/bf16/f16 = f32(q) * scale of its block. */
DSK_API dsk_status dsk_amp_fp8_block_dequantize(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *q,
                                                const dsk_tensor *scales, int br, int bc);

/* ---------------------------------------------------------------- CUDA launchers
   The C entry points of kernels/amp.cu, with the contracts of dsk_tensor.h's CUDA launchers. */
#if defined(DSK_CUDA) || defined(__CUDACC__) /* a CUDA build, or nvcc compiling the kernels */
/* ---- amp (kernels/amp.cu) */
/* `block` is a scaler's device state: {double found_inf, sumsq; float scale; int32 growth, hysteresis}. */
dsk_status dsk_cuda_amp_unscale(dsk_ctx *ctx, dsk_tensor *const *grads, int n,
                                void *block); /* multi-tensor; writes found_inf, sumsq */
dsk_status dsk_cuda_amp_update(dsk_ctx *ctx, void *block,
                               const struct dsk_amp_scaler_opts *opts); /* dsk_amp_scaler_rule, 1 thread */
dsk_status dsk_cuda_amp_cast(dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src, int stochastic, uint64_t key);
/* The device-resident step (dsk_amp_dstep): `vals` is its device dsk_amp_step_vals. decide: one thread writes
   dsk_amp_decide(block's stats, max_norm) into vals; adamw_dev and cast_dev return at once when vals->skip, else
   run dsk_adamw_step / the stochastic dsk_amp_cast with lr, bias corrections, grad_mult and step from vals. */
dsk_status dsk_cuda_amp_decide(dsk_ctx *ctx, const void *block, struct dsk_amp_step_vals *vals, double max_norm);
dsk_status dsk_cuda_amp_adamw_dev(dsk_ctx *ctx, dsk_tensor *param, const dsk_tensor *grad, dsk_tensor *m, dsk_tensor *v,
                                  const dsk_adamw_opts *opts, const struct dsk_amp_step_vals *vals, dsk_tensor *copy);
dsk_status dsk_cuda_amp_cast_dev(dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src, uint64_t seed,
                                 uint64_t tensor_id, const struct dsk_amp_step_vals *vals);
dsk_status dsk_cuda_amp_amax(dsk_ctx *ctx, float *amax, const dsk_tensor *x, int accumulate); /* device f32 scalar */
/* *scale = dsk_amp_fp8_scale(max of amax[0..n), fp8_max, margin, pow2, keep_prev ? *scale : 1);
   then *clear = 0 if non-NULL. */
dsk_status dsk_cuda_amp_fp8_scale(dsk_ctx *ctx, float *scale, const float *amax, int n, float fp8_max, int margin,
                                  int pow2, int keep_prev, float *clear);
dsk_status dsk_cuda_amp_fp8_quantize(dsk_ctx *ctx, dsk_tensor *q, const dsk_tensor *x, const float *scale);
dsk_status dsk_cuda_amp_fp8_dequantize(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *q, const float *scale);
dsk_status dsk_cuda_amp_fp8_block_quantize(dsk_ctx *ctx, dsk_tensor *q, dsk_tensor *scales, const dsk_tensor *x, int br,
                                           int bc, int pow2);
/* The same for x's transpose: q (C, R), x (R, C) */
dsk_status dsk_cuda_amp_fp8_block_quantize_t(dsk_ctx *ctx, dsk_tensor *q, dsk_tensor *scales, const dsk_tensor *x,
                                             int br, int bc, int pow2);
dsk_status dsk_cuda_amp_fp8_block_dequantize(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *q, const dsk_tensor *scales,
                                             int br, int bc);
#endif

#ifdef __cplusplus
}
#endif
DSK__FP_EXACT_END
#endif /* DSK_AMP_H */

/* ==================================================================== implementation */
#ifdef DSK_AMP_IMPLEMENTATION
#ifndef DSK_AMP_IMPLEMENTATION_DONE
#define DSK_AMP_IMPLEMENTATION_DONE
DSK__FP_EXACT_BEGIN

/* With static linkage every translation unit needs its own copy of the ground floor. */
#if defined(DSK_STATIC) && !defined(DSK_TENSOR_IMPLEMENTATION)
#define DSK_TENSOR_IMPLEMENTATION
#include "dsk_tensor.h"
#endif
#include <stdio.h>
#include <stdlib.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Elements per CPU chunk: the fixed unit of every f64 partial sum (thread-count independent). */
#define DSK__AMP_CHUNK 16384

static int dsk__amp_is_grad_dtype(dsk_dtype dt) { return dt == DSK_F32 || dt == DSK_BF16 || dt == DSK_F16; }
static int dsk__amp_is_fp8(dsk_dtype dt) { return dt == DSK_E4M3 || dt == DSK_E5M2; }

/* A tensor an amp op can use: non-NULL, contiguous, data if non-empty, on `dev`, and on a
   device this build supports. `what` names it in messages. */
static dsk_status dsk__amp_check(const char *fn, const char *what, const dsk_tensor *t, dsk_device dev) {
    char b[96];
    if (!t) return dsk_set_error(DSK_ERR_ARG, "%s: %s is NULL", fn, what);
    if (!t->data && dsk_tensor_numel(t) > 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %s has no data", fn, what, dsk_tensor_describe(t, b, sizeof b));
    if (!dsk_tensor_is_contiguous(t))
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %s is not contiguous", fn, what, dsk_tensor_describe(t, b, sizeof b));
    if (t->device.type != dev.type || t->device.index != dev.index)
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %s is on %s:%d, expected %s:%d", fn, what,
                             dsk_tensor_describe(t, b, sizeof b), t->device.type == DSK_DEV_CUDA ? "cuda" : "cpu",
                             t->device.index, dev.type == DSK_DEV_CUDA ? "cuda" : "cpu", dev.index);
#ifndef DSK_CUDA
    if (t->device.type != DSK_DEV_CPU)
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: %s is a CUDA tensor in a build without DSK_CUDA", fn, what);
#endif
    return DSK_OK;
}

/* CUDA ops need a ctx on the tensor's device. */
static dsk_status dsk__amp_need_ctx(const char *fn, const dsk_ctx *ctx, dsk_device dev) {
    if (dev.type != DSK_DEV_CUDA) return DSK_OK;
    if (!ctx || ctx->device.type != DSK_DEV_CUDA || ctx->device.index != dev.index)
        return dsk_set_error(DSK_ERR_ARG, "%s: CUDA device %d needs a ctx on that device", fn, dev.index);
    return DSK_OK;
}

static dsk_status dsk__amp_scalar_f32(const char *fn, const char *what, const dsk_tensor *t, dsk_device dev) {
    char b[96];
    dsk_status s = dsk__amp_check(fn, what, t, dev);
    if (s != DSK_OK) return s;
    if (t->dtype != DSK_F32 || dsk_tensor_numel(t) != 1)
        return dsk_set_error(DSK_ERR_ARG, "%s: %s is %s, want one f32 element", fn, what,
                             dsk_tensor_describe(t, b, sizeof b));
    return DSK_OK;
}

/* ---------------------------------------------------------------- loss scaler */

static dsk_status dsk__amp_resolve(const dsk_amp_scaler_opts *in, dsk_amp_scaler_opts *o) {
    const char *fn = "dsk_amp_scaler_init";
    memset(o, 0, sizeof *o);
    if (in) *o = *in;
    if ((int)o->mode < DSK_AMP_DYNAMIC || (int)o->mode > DSK_AMP_NONE)
        return dsk_set_error(DSK_ERR_ARG, "%s: unknown mode %d", fn, (int)o->mode);
    if (o->init_scale == 0.0f) o->init_scale = 65536.0f;
    if (o->growth_factor == 0.0) o->growth_factor = 2.0;
    if (o->backoff_factor == 0.0) o->backoff_factor = 0.5;
    if (o->growth_interval == 0) o->growth_interval = 2000;
    if (o->hysteresis == 0) o->hysteresis = 1;
    if (o->mode == DSK_AMP_NONE) o->init_scale = 1.0f;
    if (!(o->init_scale > 0.0f) || !dsk_amp_isfinite(o->init_scale))
        return dsk_set_error(DSK_ERR_ARG, "%s: init_scale %g must be finite and > 0", fn, (double)o->init_scale);
    if (!(o->growth_factor > 1.0) || !(o->growth_factor < 1e30))
        return dsk_set_error(DSK_ERR_ARG, "%s: growth_factor %g must be finite and > 1", fn, o->growth_factor);
    if (!(o->backoff_factor > 0.0 && o->backoff_factor < 1.0))
        return dsk_set_error(DSK_ERR_ARG, "%s: backoff_factor %g must be in (0, 1)", fn, o->backoff_factor);
    if (o->growth_interval < 1)
        return dsk_set_error(DSK_ERR_ARG, "%s: growth_interval %d must be >= 1", fn, (int)o->growth_interval);
    if (o->hysteresis < 1) return dsk_set_error(DSK_ERR_ARG, "%s: hysteresis %d must be >= 1", fn, (int)o->hysteresis);
    if (!(o->min_scale >= 0.0f) || !(o->max_scale >= 0.0f) || !dsk_amp_isfinite(o->min_scale) ||
        !dsk_amp_isfinite(o->max_scale))
        return dsk_set_error(DSK_ERR_ARG, "%s: min_scale %g and max_scale %g must be finite and >= 0", fn,
                             (double)o->min_scale, (double)o->max_scale);
    if (o->max_scale > 0.0f && o->min_scale > o->max_scale)
        return dsk_set_error(DSK_ERR_ARG, "%s: min_scale %g > max_scale %g", fn, (double)o->min_scale,
                             (double)o->max_scale);
    if (o->mode == DSK_AMP_DYNAMIC && ((o->min_scale > 0.0f && o->init_scale < o->min_scale) ||
                                       (o->max_scale > 0.0f && o->init_scale > o->max_scale)))
        return dsk_set_error(DSK_ERR_ARG, "%s: init_scale %g outside [min_scale %g, max_scale %g]", fn,
                             (double)o->init_scale, (double)o->min_scale, (double)o->max_scale);
    return DSK_OK;
}

#ifdef DSK_CUDA
/* The CUDA scaler's state: stats and state in one device block, copied up from the host's. */
static dsk_status dsk__amp_scaler_init_cuda(dsk_amp_scaler *sc, dsk_ctx *ctx) {
    char blk[sizeof(dsk_amp_stats) + sizeof(dsk_amp_scaler_state)];
    dsk_status s;
    memcpy(blk, &sc->stats, sizeof sc->stats);
    memcpy(blk + sizeof sc->stats, &sc->state, sizeof sc->state);
    s = dsk_cuda_malloc(ctx, sizeof blk, &sc->dev_block);
    if (s == DSK_OK) s = dsk_cuda_memcpy(ctx, sc->dev_block, blk, sizeof blk, 1);
    if (s == DSK_OK) s = dsk_cuda_sync(ctx);
    if (s != DSK_OK) {
        if (sc->dev_block) dsk_cuda_free(ctx, sc->dev_block);
        memset(sc, 0, sizeof *sc);
    }
    return s;
}
#endif

DSK_API dsk_status dsk_amp_scaler_init(dsk_amp_scaler *sc, dsk_ctx *ctx, const dsk_amp_scaler_opts *opts) {
    if (!sc) return dsk_set_error(DSK_ERR_ARG, "dsk_amp_scaler_init: scaler is NULL");
    memset(sc, 0, sizeof *sc);
    DSK__TRY(dsk__amp_resolve(opts, &sc->opts));
    sc->device = ctx ? ctx->device : dsk_cpu();
    sc->state.scale = sc->opts.init_scale;
    sc->state.growth_tracker = 0;
    sc->state.hysteresis_left = sc->opts.hysteresis;
    DSK__CUDA_PATH(sc->device.type == DSK_DEV_CUDA, dsk__amp_scaler_init_cuda(sc, ctx));
    if (sc->device.type != DSK_DEV_CPU) {
        memset(sc, 0, sizeof *sc);
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "dsk_amp_scaler_init: ctx device type %d not available in this build",
                             (int)(ctx ? ctx->device.type : 0));
    }
    return DSK_OK;
}

DSK_API void dsk_amp_scaler_free(dsk_amp_scaler *sc, dsk_ctx *ctx) {
    if (!sc) return;
#ifdef DSK_CUDA
    if (sc->dev_block) dsk_cuda_free(ctx, sc->dev_block);
#endif
    (void)ctx;
    memset(sc, 0, sizeof *sc);
}

static dsk_status dsk__amp_need_scaler(const char *fn, const dsk_ctx *ctx, const dsk_amp_scaler *sc) {
    if (!sc) return dsk_set_error(DSK_ERR_ARG, "%s: scaler is NULL", fn);
    if (sc->opts.growth_interval < 1) return dsk_set_error(DSK_ERR_STATE, "%s: scaler is not initialised", fn);
    if (sc->device.type == DSK_DEV_CUDA && !sc->dev_block)
        return dsk_set_error(DSK_ERR_STATE, "%s: CUDA scaler without device state", fn);
    return dsk__amp_need_ctx(fn, ctx, sc->device);
}

/* Copies `bytes` between device memory `dev` and host memory, synced. */
static dsk_status dsk__amp_dev_io(dsk_ctx *ctx, void *dev, void *host, size_t bytes, int to_device) {
#ifdef DSK_CUDA
    DSK__TRY(dsk_cuda_memcpy(ctx, to_device ? dev : host, to_device ? (const void *)host : (const void *)dev, bytes,
                             to_device));
    return dsk_cuda_sync(ctx);
#else
    (void)ctx;
    (void)dev;
    (void)host;
    (void)bytes;
    (void)to_device;
    return dsk_set_error(DSK_ERR_UNSUPPORTED, "dsk_amp: CUDA scaler in a build without DSK_CUDA");
#endif
}

/* Copies `bytes` at `offset` of the scaler's device block to or from host memory, synced. */
static dsk_status dsk__amp_block_io(dsk_ctx *ctx, const dsk_amp_scaler *sc, size_t offset, void *host, size_t bytes,
                                    int to_device) {
    return dsk__amp_dev_io(ctx, (char *)sc->dev_block + offset, host, bytes, to_device);
}

DSK_API dsk_status dsk_amp_state_get(const dsk_amp_scaler *sc, dsk_ctx *ctx, dsk_amp_scaler_state *out) {
    DSK__TRY(dsk__amp_need_scaler("dsk_amp_state_get", ctx, sc));
    if (!out) return dsk_set_error(DSK_ERR_ARG, "dsk_amp_state_get: out is NULL");
    if (sc->device.type == DSK_DEV_CPU) { *out = sc->state; return DSK_OK; }
    return dsk__amp_block_io(ctx, sc, sizeof(dsk_amp_stats), out, sizeof *out, 0);
}

DSK_API dsk_status dsk_amp_state_set(dsk_amp_scaler *sc, dsk_ctx *ctx, const dsk_amp_scaler_state *st) {
    const char *fn = "dsk_amp_state_set";
    dsk_amp_scaler_state v;
    DSK__TRY(dsk__amp_need_scaler(fn, ctx, sc));
    if (!st) return dsk_set_error(DSK_ERR_ARG, "%s: state is NULL", fn);
    v = *st;
    if (!(v.scale > 0.0f) || !dsk_amp_isfinite(v.scale))
        return dsk_set_error(DSK_ERR_ARG, "%s: scale %g must be finite and > 0", fn, (double)v.scale);
    if (v.growth_tracker < 0 || v.growth_tracker >= sc->opts.growth_interval)
        return dsk_set_error(DSK_ERR_ARG, "%s: growth_tracker %d outside [0, growth_interval %d)", fn,
                             (int)v.growth_tracker, (int)sc->opts.growth_interval);
    if (v.hysteresis_left < 1 || v.hysteresis_left > sc->opts.hysteresis)
        return dsk_set_error(DSK_ERR_ARG, "%s: hysteresis_left %d outside [1, hysteresis %d]", fn,
                             (int)v.hysteresis_left, (int)sc->opts.hysteresis);
    if (sc->opts.mode == DSK_AMP_NONE && v.scale != 1.0f)
        return dsk_set_error(DSK_ERR_ARG, "%s: scale %g in mode DSK_AMP_NONE, which keeps scale 1", fn,
                             (double)v.scale);
    if (sc->device.type == DSK_DEV_CPU) { sc->state = v; return DSK_OK; }
    return dsk__amp_block_io(ctx, sc, sizeof(dsk_amp_stats), &v, sizeof v, 1);
}

DSK_API dsk_status dsk_amp_scale_get(const dsk_amp_scaler *sc, dsk_ctx *ctx, float *scale) {
    dsk_amp_scaler_state st;
    memset(&st, 0, sizeof st);
    if (!scale) return dsk_set_error(DSK_ERR_ARG, "dsk_amp_scale_get: out is NULL");
    DSK__TRY(dsk_amp_state_get(sc, ctx, &st));
    *scale = st.scale;
    return DSK_OK;
}

DSK_API double *dsk_amp_stats_data(dsk_amp_scaler *sc) {
    if (!sc) return NULL;
    return sc->device.type == DSK_DEV_CPU ? &sc->stats.found_inf : (double *)sc->dev_block;
}

DSK_API dsk_status dsk_amp_stats_get(const dsk_amp_scaler *sc, dsk_ctx *ctx, dsk_amp_stats *out) {
    DSK__TRY(dsk__amp_need_scaler("dsk_amp_stats_get", ctx, sc));
    if (!out) return dsk_set_error(DSK_ERR_ARG, "dsk_amp_stats_get: out is NULL");
    if (sc->device.type == DSK_DEV_CPU) { *out = sc->stats; return DSK_OK; }
    return dsk__amp_block_io(ctx, sc, 0, out, sizeof *out, 0);
}

DSK_API dsk_status dsk_amp_stats_set(dsk_amp_scaler *sc, dsk_ctx *ctx, const dsk_amp_stats *st) {
    dsk_amp_stats v;
    DSK__TRY(dsk__amp_need_scaler("dsk_amp_stats_set", ctx, sc));
    if (!st) return dsk_set_error(DSK_ERR_ARG, "dsk_amp_stats_set: stats is NULL");
    v = *st;
    if (sc->device.type == DSK_DEV_CPU) { sc->stats = v; return DSK_OK; }
    return dsk__amp_block_io(ctx, sc, 0, &v, sizeof v, 1);
}

DSK_API dsk_status dsk_amp_update(dsk_amp_scaler *sc, dsk_ctx *ctx) {
    DSK__TRY(dsk__amp_need_scaler("dsk_amp_update", ctx, sc));
    DSK__CUDA_PATH(sc->device.type == DSK_DEV_CUDA, dsk_cuda_amp_update(ctx, sc->dev_block, &sc->opts));
    dsk_amp_scaler_rule(&sc->state, dsk_amp_stats_overflow(sc->stats), &sc->opts);
    return DSK_OK;
}

/* ---------------------------------------------------------------- unscale + check */

/* A list of (tensor, first element, count) chunks over all gradients, in gradient order. */
typedef struct dsk__amp_chunk { int t; int64_t start, len; } dsk__amp_chunk;

static int64_t dsk__amp_count_chunks(dsk_tensor *const *g, int n) {
    int64_t c = 0;
    for (int i = 0; i < n; i++) c += (dsk_tensor_numel(g[i]) + DSK__AMP_CHUNK - 1) / DSK__AMP_CHUNK;
    return c;
}

/* One chunk: four f64 lanes (element i in lane i % 4) summed as (l0 + l1) + (l2 + l3), a fixed
   order that lets the compiler vectorise; f32 gets a loop without the dtype switch. */
static void dsk__amp_unscale_chunk(dsk_tensor *g, int64_t start, int64_t len, float inv, double *sumsq, int *found) {
    double acc[4] = {0.0, 0.0, 0.0, 0.0};
    uint32_t bad = 0;
    if (g->dtype == DSK_F32) {
        float *p = (float *)g->data + start;
        int64_t i = 0;
        for (; i + 4 <= len; i += 4)
            for (int k = 0; k < 4; k++) {
                float y = p[i + k] * inv;
                p[i + k] = y;
                bad |= (dsk_f32_bits(y) & 0x7f800000u) == 0x7f800000u;
                acc[k] += (double)y * (double)y;
            }
        for (; i < len; i++) {
            float y = p[i] * inv;
            p[i] = y;
            bad |= (dsk_f32_bits(y) & 0x7f800000u) == 0x7f800000u;
            acc[i & 3] += (double)y * (double)y;
        }
    } else {
        for (int64_t i = 0; i < len; i++) {
            float y = dsk_store_f32(g->data, g->dtype, start + i, dsk_load_f32(g->data, g->dtype, start + i) * inv);
            bad |= (dsk_f32_bits(y) & 0x7f800000u) == 0x7f800000u;
            acc[i & 3] += (double)y * (double)y;
        }
    }
    *sumsq = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    *found = bad != 0;
}

static dsk_status dsk__amp_unscale_cpu(dsk_amp_scaler *sc, const dsk_ctx *ctx, dsk_tensor *const *g, int n) {
    int nt = dsk_ctx_threads(ctx);
    (void)nt; /* without OpenMP */
    int64_t nc = dsk__amp_count_chunks(g, n), c = 0;
    float inv = dsk_amp_inv_scale(sc->state.scale);
    dsk__amp_chunk *ch;
    double *part, sum = 0.0;
    int *bad, found = 0;
    if (nc == 0) { sc->stats.found_inf = 0.0; sc->stats.sumsq = 0.0; return DSK_OK; }
    ch = (dsk__amp_chunk *)DSK_MALLOC((size_t)nc * sizeof *ch);
    part = (double *)DSK_MALLOC((size_t)nc * sizeof *part);
    bad = (int *)DSK_MALLOC((size_t)nc * sizeof *bad);
    if (!ch || !part || !bad) {
        DSK_FREE(ch); DSK_FREE(part); DSK_FREE(bad);
        return dsk_set_error(DSK_ERR_OOM, "dsk_amp_unscale: out of host memory for %lld chunk partials", (long long)nc);
    }
    for (int i = 0; i < n; i++)
        for (int64_t s = 0, m = dsk_tensor_numel(g[i]); s < m; s += DSK__AMP_CHUNK, c++) {
            ch[c].t = i; ch[c].start = s; ch[c].len = m - s < DSK__AMP_CHUNK ? m - s : DSK__AMP_CHUNK;
        }
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(nt) if (nc > 1)
#endif
    for (int64_t k = 0; k < nc; k++) dsk__amp_unscale_chunk(g[ch[k].t], ch[k].start, ch[k].len, inv, &part[k], &bad[k]);
    for (int64_t k = 0; k < nc; k++) { sum += part[k]; found |= bad[k]; }
    sc->stats.found_inf = found ? 1.0 : 0.0;
    sc->stats.sumsq = sum;
    DSK_FREE(ch); DSK_FREE(part); DSK_FREE(bad);
    return DSK_OK;
}

/* Byte range of gradient `i`, for the overlap check. */
typedef struct dsk__amp_range { uintptr_t lo, hi; int i; } dsk__amp_range;
static int dsk__amp_cmp_range(const void *a, const void *b) {
    const dsk__amp_range *x = (const dsk__amp_range *)a, *y = (const dsk__amp_range *)b;
    return (x->lo > y->lo) - (x->lo < y->lo);
}
/* Gradients are unscaled in place, in parallel: two that share memory would be scaled twice
   and raced on, so overlapping ones are refused. */
static dsk_status dsk__amp_no_overlap(const char *fn, dsk_tensor *const *g, int n) {
    dsk__amp_range *r;
    int m = 0;
    dsk_status s = DSK_OK;
    if (n < 2) return DSK_OK;
    r = (dsk__amp_range *)DSK_MALLOC((size_t)n * sizeof *r);
    if (!r) return dsk_set_error(DSK_ERR_OOM, "%s: out of host memory for %d gradient ranges", fn, n);
    for (int i = 0; i < n; i++)
        if (dsk_tensor_numel(g[i]) > 0) {
            r[m].lo = (uintptr_t)g[i]->data;
            r[m].hi = r[m].lo + dsk_tensor_nbytes(g[i]);
            r[m++].i = i;
        }
    qsort(r, (size_t)m, sizeof *r, dsk__amp_cmp_range);
    for (int k = 1; k < m && s == DSK_OK; k++)
        if (r[k].lo < r[k - 1].hi) {
            int a = r[k - 1].i < r[k].i ? r[k - 1].i : r[k].i, b = r[k - 1].i < r[k].i ? r[k].i : r[k - 1].i;
            s = dsk_set_error(DSK_ERR_ARG, "%s: grads[%d] and grads[%d] share memory", fn, a, b);
        }
    DSK_FREE(r);
    return s;
}

DSK_API dsk_status dsk_amp_unscale(dsk_amp_scaler *sc, dsk_ctx *ctx, dsk_tensor *const *grads, int n) {
    const char *fn = "dsk_amp_unscale";
    char what[32], b[96];
    DSK__TRY(dsk__amp_need_scaler(fn, ctx, sc));
    if (n < 0 || (n > 0 && !grads))
        return dsk_set_error(DSK_ERR_ARG, "%s: %d gradients with list %p", fn, n, (const void *)grads);
    for (int i = 0; i < n; i++) {
        snprintf(what, sizeof what, "grads[%d]", i);
        DSK__TRY(dsk__amp_check(fn, what, grads[i], sc->device));
        if (!dsk__amp_is_grad_dtype(grads[i]->dtype))
            return dsk_set_error(DSK_ERR_ARG, "%s: grads[%d] is %s, want f32, bf16 or f16", fn, i,
                                 dsk_tensor_describe(grads[i], b, sizeof b));
    }
    DSK__TRY(dsk__amp_no_overlap(fn, grads, n));
    DSK__CUDA_PATH(sc->device.type == DSK_DEV_CUDA, dsk_cuda_amp_unscale(ctx, grads, n, sc->dev_block));
    return dsk__amp_unscale_cpu(sc, ctx, grads, n);
}

/* ---------------------------------------------------------------- casts and optimizer step */

static void dsk__amp_cast_cpu(const dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src, dsk_amp_round mode,
                              uint64_t key) {
    const float *x = (const float *)src->data;
    int64_t n = dsk_tensor_numel(src);
    int nt = dsk_ctx_threads(ctx);
    (void)nt; /* without OpenMP */
    if (mode == DSK_AMP_ROUND_NEAREST || dst->dtype == DSK_F32) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(nt) if (n > 65536)
#endif
        for (int64_t i = 0; i < n; i++) dsk_store_f32(dst->data, dst->dtype, i, x[i]);
        return;
    }
    /* one Philox call per group of four elements (the words dsk_amp_sr_bits hands out) */
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(nt) if (n > 16384)
#endif
    for (int64_t g = 0; g < (n + 3) / 4; g++) {
        uint32_t r[4];
        uint16_t *o = (uint16_t *)dst->data;
        int64_t end = 4 * g + 4 < n ? 4 * g + 4 : n;
        dsk_philox4x32(key, (uint64_t)g, r);
        for (int64_t i = 4 * g; i < end; i++)
            o[i] = dst->dtype == DSK_BF16 ? dsk_amp_f32_to_bf16_sr(x[i], r[i & 3])
                                          : dsk_amp_f32_to_f16_sr(x[i], r[i & 3]);
    }
}

DSK_API dsk_status dsk_amp_cast(dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src, dsk_amp_round mode,
                                uint64_t seed, uint64_t tensor_id, uint64_t step) {
    const char *fn = "dsk_amp_cast";
    char a[96], b[96];
    DSK__TRY(dsk__amp_check(fn, "src", src, src ? src->device : dsk_cpu()));
    DSK__TRY(dsk__amp_check(fn, "dst", dst, src->device));
    DSK__TRY(dsk__amp_need_ctx(fn, ctx, src->device));
    if (src->dtype != DSK_F32)
        return dsk_set_error(DSK_ERR_ARG, "%s: src %s must be f32", fn, dsk_tensor_describe(src, a, sizeof a));
    if (!dsk__amp_is_grad_dtype(dst->dtype) || !dsk_tensor_same_shape(dst, src))
        return dsk_set_error(DSK_ERR_ARG, "%s: dst %s must be bf16, f16 or f32 of src's shape %s", fn,
                             dsk_tensor_describe(dst, a, sizeof a), dsk_tensor_describe(src, b, sizeof b));
    if (mode != DSK_AMP_ROUND_NEAREST && mode != DSK_AMP_ROUND_STOCHASTIC)
        return dsk_set_error(DSK_ERR_ARG, "%s: unknown rounding mode %d", fn, (int)mode);
    DSK__CUDA_PATH(src->device.type == DSK_DEV_CUDA, dsk_cuda_amp_cast(ctx, dst, src, mode == DSK_AMP_ROUND_STOCHASTIC,
                                                                       dsk_amp_sr_key(seed, tensor_id, step)));
    dsk__amp_cast_cpu(ctx, dst, src, mode, dsk_amp_sr_key(seed, tensor_id, step));
    return DSK_OK;
}

/* Checks every parameter before anything is written, so an error leaves all tensors as they were. */
static dsk_status dsk__amp_check_param(const dsk_amp_param *p, int i) {
    const char *fn = "dsk_amp_step";
    char what[160], a[96], b[96];
    const char *nm = p->name ? p->name : "";
    dsk_device dev;
    const dsk_tensor *ts[4];
    static const char *roles[4] = {"grad", "m", "v", "copy"};
    if (!p->master) return dsk_set_error(DSK_ERR_ARG, "%s: params[%d] \"%s\": master is NULL", fn, i, nm);
    dev = p->master->device;
    snprintf(what, sizeof what, "params[%d] \"%s\" master", i, nm);
    DSK__TRY(dsk__amp_check(fn, what, p->master, dev));
    if (p->master->dtype != DSK_F32)
        return dsk_set_error(DSK_ERR_ARG, "%s: %s is %s, want f32", fn, what,
                             dsk_tensor_describe(p->master, a, sizeof a));
    ts[0] = p->grad; ts[1] = p->m; ts[2] = p->v; ts[3] = p->copy;
    for (int k = 0; k < 4; k++) {
        if (k == 3 && !ts[k]) continue;
        snprintf(what, sizeof what, "params[%d] \"%s\" %s", i, nm, roles[k]);
        DSK__TRY(dsk__amp_check(fn, what, ts[k], dev));
        if (!dsk_tensor_same_shape(ts[k], p->master))
            return dsk_set_error(DSK_ERR_ARG, "%s: %s is %s, master is %s", fn, what,
                                 dsk_tensor_describe(ts[k], a, sizeof a), dsk_tensor_describe(p->master, b, sizeof b));
        if ((k == 1 || k == 2) ? ts[k]->dtype != DSK_F32 && ts[k]->dtype != DSK_BF16
                               : !dsk__amp_is_grad_dtype(ts[k]->dtype))
            return dsk_set_error(DSK_ERR_ARG, "%s: %s has dtype %s", fn, what, dsk_dtype_name(ts[k]->dtype));
    }
    if (p->m->dtype != p->v->dtype) /* dsk_adamw_step's moments: both f32 or both bf16 */
        return dsk_set_error(DSK_ERR_ARG, "%s: params[%d] \"%s\": m is %s, v is %s (want one dtype)", fn, i, nm,
                             dsk_dtype_name(p->m->dtype), dsk_dtype_name(p->v->dtype));
    return DSK_OK;
}

DSK_API dsk_status dsk_amp_step(dsk_ctx *ctx, const dsk_amp_param *params, int n, const dsk_adamw_opts *opts,
                                int64_t step, const dsk_amp_decision *dec, dsk_amp_round round, uint64_t seed) {
    const char *fn = "dsk_amp_step";
    if (!dec) return dsk_set_error(DSK_ERR_ARG, "%s: decision is NULL", fn);
    if (n < 0 || (n > 0 && !params))
        return dsk_set_error(DSK_ERR_ARG, "%s: %d params with list %p", fn, n, (const void *)params);
    if (step < 1) return dsk_set_error(DSK_ERR_ARG, "%s: step %lld must be >= 1", fn, (long long)step);
    if (round != DSK_AMP_ROUND_NEAREST && round != DSK_AMP_ROUND_STOCHASTIC)
        return dsk_set_error(DSK_ERR_ARG, "%s: unknown rounding mode %d", fn, (int)round);
    if (!dec->skip && !(dsk_amp_isfinite(dec->grad_mult) && dec->grad_mult >= 0.0f))
        return dsk_set_error(DSK_ERR_ARG, "%s: grad_mult %g must be finite and >= 0", fn, (double)dec->grad_mult);
    for (int i = 0; i < n; i++)
        DSK__TRY(dsk__amp_check_param(&params[i], i));
    if (dec->skip) return DSK_OK;
    for (int i = 0; i < n; i++) {
        const dsk_amp_param *p = &params[i];
        int rne_copy = p->copy && round == DSK_AMP_ROUND_NEAREST;
        dsk_tensor *copy = rne_copy ? p->copy : NULL; /* refreshed by the AdamW pass itself */
        DSK__TRY(dsk_adamw_step(ctx, p->master, p->grad, p->m, p->v, opts, step, dec->grad_mult, copy));
        if (p->copy && !rne_copy)
            DSK__TRY(dsk_amp_cast(ctx, p->copy, p->master, round, seed, (uint64_t)i, (uint64_t)step));
    }
    return DSK_OK;
}

/* ---------------------------------------------------------------- device-resident step */

/* The bytes dsk_amp_dstep_upload copies: the schedule, from `step` to the end. */
#define DSK__AMP_SCHED_OFF offsetof(dsk_amp_step_vals, step)
#define DSK__AMP_SCHED_BYTES (sizeof(dsk_amp_step_vals) - DSK__AMP_SCHED_OFF)

static dsk_status dsk__amp_need_dstep(const char *fn, const dsk_ctx *ctx, const dsk_amp_dstep *ds) {
    if (!ds) return dsk_set_error(DSK_ERR_ARG, "%s: dstep is NULL", fn);
    if (!ds->vals) return dsk_set_error(DSK_ERR_STATE, "%s: dstep is not initialised", fn);
    return dsk__amp_need_ctx(fn, ctx, ds->device);
}

/* beta1, beta2, eps and weight_decay in dsk_adamw_step's ranges (lr is the schedule's). */
static dsk_status dsk__amp_check_betas(const char *fn, const dsk_adamw_opts *o) {
    if (!o) return dsk_set_error(DSK_ERR_ARG, "%s: AdamW options are NULL (start from dsk_adamw_defaults())", fn);
    if (!(o->beta1 >= 0.0f && o->beta1 < 1.0f) || !(o->beta2 >= 0.0f && o->beta2 < 1.0f))
        return dsk_set_error(DSK_ERR_ARG, "%s: beta1 %g and beta2 %g must be in [0, 1)", fn, (double)o->beta1,
                             (double)o->beta2);
    if (!(o->eps > 0.0f) || !dsk_amp_isfinite(o->eps))
        return dsk_set_error(DSK_ERR_ARG, "%s: eps %g must be finite and > 0", fn, (double)o->eps);
    if (!(o->weight_decay >= 0.0f) || !dsk_amp_isfinite(o->weight_decay))
        return dsk_set_error(DSK_ERR_ARG, "%s: weight_decay %g must be finite and >= 0", fn, (double)o->weight_decay);
    return DSK_OK;
}

#ifdef DSK_CUDA
/* The CUDA dstep's values: device memory, and pinned host memory for the schedule's upload. */
static dsk_status dsk__amp_dstep_vals_cuda(const char *fn, dsk_amp_dstep *ds, dsk_ctx *ctx,
                                           const dsk_amp_step_vals *v) {
    void *dev = NULL;
    ds->pinned = (dsk_amp_step_vals *)dsk_cuda_host_alloc(sizeof *v);
    if (!ds->pinned) return dsk_set_error(DSK_ERR_OOM, "%s: no pinned host memory for %zu bytes", fn, sizeof *v);
    DSK__TRY(dsk_cuda_malloc(ctx, sizeof *v, &dev));
    ds->vals = (dsk_amp_step_vals *)dev;
    *ds->pinned = *v;
    DSK__TRY(dsk_cuda_memcpy(ctx, ds->vals, ds->pinned, sizeof *v, 1));
    return dsk_cuda_sync(ctx);
}
#endif

/* The dstep's values on its device, set to v (what is taken is kept in ds for dsk_amp_dstep_free). */
static dsk_status dsk__amp_dstep_vals(const char *fn, dsk_amp_dstep *ds, dsk_ctx *ctx, const dsk_amp_step_vals *v) {
    DSK__CUDA_PATH(ds->device.type == DSK_DEV_CUDA, dsk__amp_dstep_vals_cuda(fn, ds, ctx, v));
    (void)ctx; /* the CPU's values need none */
    if (ds->device.type != DSK_DEV_CPU)
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: ctx device type %d not available in this build", fn,
                             (int)ds->device.type);
    ds->vals = (dsk_amp_step_vals *)DSK_MALLOC(sizeof *v);
    if (!ds->vals) return dsk_set_error(DSK_ERR_OOM, "%s: out of host memory", fn);
    *ds->vals = *v;
    return DSK_OK;
}

DSK_API dsk_status dsk_amp_dstep_init(dsk_amp_dstep *ds, dsk_ctx *ctx) {
    const char *fn = "dsk_amp_dstep_init";
    dsk_amp_step_vals v;
    dsk_status s;
    if (!ds) return dsk_set_error(DSK_ERR_ARG, "%s: dstep is NULL", fn);
    memset(ds, 0, sizeof *ds);
    memset(&v, 0, sizeof v);
    v.skip = 1;
    ds->device = ctx ? ctx->device : dsk_cpu();
    ds->beta1 = ds->beta2 = -1.0f; /* no schedule yet */
    s = dsk__amp_dstep_vals(fn, ds, ctx, &v);
    if (s == DSK_OK) s = dsk_tensor_wrap(&ds->skip, &ds->vals->skip, DSK_I32, ds->device, 0, NULL);
    if (s != DSK_OK) dsk_amp_dstep_free(ds, ctx);
    return s;
}

DSK_API void dsk_amp_dstep_free(dsk_amp_dstep *ds, dsk_ctx *ctx) {
    if (!ds) return;
#ifdef DSK_CUDA
    if (ds->device.type == DSK_DEV_CUDA) {
        if (ds->vals) dsk_cuda_free(ctx, ds->vals);
        if (ds->pinned) dsk_cuda_host_free(ds->pinned);
        ds->vals = NULL;
    }
#endif
    if (ds->device.type == DSK_DEV_CPU) DSK_FREE(ds->vals);
    (void)ctx;
    memset(ds, 0, sizeof *ds);
}

DSK_API dsk_status dsk_amp_dstep_schedule(dsk_amp_dstep *ds, dsk_ctx *ctx, float lr, int64_t step,
                                          const dsk_adamw_opts *opts) {
    const char *fn = "dsk_amp_dstep_schedule";
    dsk_amp_step_vals *v;
    DSK__TRY(dsk__amp_need_dstep(fn, ctx, ds));
    DSK__TRY(dsk__amp_check_betas(fn, opts));
    if (!(lr >= 0.0f) || !dsk_amp_isfinite(lr))
        return dsk_set_error(DSK_ERR_ARG, "%s: lr %g must be finite and >= 0", fn, (double)lr);
    if (step < 1) return dsk_set_error(DSK_ERR_ARG, "%s: step %lld must be >= 1", fn, (long long)step);
    v = ds->device.type == DSK_DEV_CUDA ? ds->pinned : ds->vals;
    v->step = step;
    v->lr = lr;
    v->bc1 = dsk_adamw_bias_correction(opts->beta1, step);
    v->bc2 = dsk_adamw_bias_correction(opts->beta2, step);
    v->reserved = 0.0f;
    ds->beta1 = opts->beta1;
    ds->beta2 = opts->beta2;
    return DSK_OK;
}

DSK_API dsk_status dsk_amp_dstep_upload(dsk_amp_dstep *ds, dsk_ctx *ctx) {
    DSK__TRY(dsk__amp_need_dstep("dsk_amp_dstep_upload", ctx, ds));
    DSK__CUDA_PATH(ds->device.type == DSK_DEV_CUDA,
                   dsk_cuda_memcpy(ctx, (char *)ds->vals + DSK__AMP_SCHED_OFF,
                                   (const char *)ds->pinned + DSK__AMP_SCHED_OFF, DSK__AMP_SCHED_BYTES, 1));
    return DSK_OK;
}

DSK_API dsk_status dsk_amp_dstep_get(const dsk_amp_dstep *ds, dsk_ctx *ctx, dsk_amp_step_vals *out) {
    DSK__TRY(dsk__amp_need_dstep("dsk_amp_dstep_get", ctx, ds));
    if (!out) return dsk_set_error(DSK_ERR_ARG, "dsk_amp_dstep_get: out is NULL");
    DSK__CUDA_PATH(ds->device.type == DSK_DEV_CUDA, dsk__amp_dev_io(ctx, ds->vals, out, sizeof *out, 0));
    *out = *ds->vals;
    return DSK_OK;
}

DSK_API dsk_status dsk_amp_decide_dev(dsk_amp_dstep *ds, dsk_ctx *ctx, const dsk_amp_scaler *sc, double max_norm) {
    const char *fn = "dsk_amp_decide_dev";
    dsk_amp_decision d;
    DSK__TRY(dsk__amp_need_dstep(fn, ctx, ds));
    DSK__TRY(dsk__amp_need_scaler(fn, ctx, sc));
    if (sc->device.type != ds->device.type || sc->device.index != ds->device.index)
        return dsk_set_error(DSK_ERR_ARG, "%s: the scaler is on %s:%d, the dstep on %s:%d", fn,
                             sc->device.type == DSK_DEV_CUDA ? "cuda" : "cpu", sc->device.index,
                             ds->device.type == DSK_DEV_CUDA ? "cuda" : "cpu", ds->device.index);
    DSK__CUDA_PATH(ds->device.type == DSK_DEV_CUDA, dsk_cuda_amp_decide(ctx, sc->dev_block, ds->vals, max_norm));
    d = dsk_amp_decide(sc->stats, max_norm);
    ds->vals->skip = d.skip;
    ds->vals->grad_mult = d.grad_mult;
    ds->vals->norm = d.norm;
    return DSK_OK;
}

#ifdef DSK_CUDA
/* dsk_amp_step_dev's CUDA path: each parameter's AdamW and cast read the decision from ds->vals. */
static dsk_status dsk__amp_step_dev_cuda(dsk_ctx *ctx, const dsk_amp_param *params, int n, const dsk_adamw_opts *opts,
                                         const dsk_amp_dstep *ds, dsk_amp_round round, uint64_t seed) {
    for (int i = 0; i < n; i++) {
        const dsk_amp_param *p = &params[i];
        int rne_copy = p->copy && round == DSK_AMP_ROUND_NEAREST;
        dsk_tensor *copy = rne_copy ? p->copy : NULL; /* refreshed by the AdamW pass itself */
        DSK__TRY(dsk_cuda_amp_adamw_dev(ctx, p->master, p->grad, p->m, p->v, opts, ds->vals, copy));
        if (p->copy && !rne_copy) DSK__TRY(dsk_cuda_amp_cast_dev(ctx, p->copy, p->master, seed, (uint64_t)i, ds->vals));
    }
    return DSK_OK;
}
#endif

DSK_API dsk_status dsk_amp_step_dev(dsk_ctx *ctx, const dsk_amp_param *params, int n, const dsk_adamw_opts *opts,
                                    const dsk_amp_dstep *ds, dsk_amp_round round, uint64_t seed) {
    const char *fn = "dsk_amp_step_dev";
    DSK__TRY(dsk__amp_need_dstep(fn, ctx, ds));
    DSK__TRY(dsk__amp_check_betas(fn, opts));
    if (ds->beta1 < 0.0f)
        return dsk_set_error(DSK_ERR_STATE, "%s: the dstep has no schedule (dsk_amp_dstep_schedule)", fn);
    if (opts->beta1 != ds->beta1 || opts->beta2 != ds->beta2)
        return dsk_set_error(DSK_ERR_ARG, "%s: betas (%g, %g) differ from the schedule's (%g, %g), whose bias "
                             "corrections the step would use", fn, (double)opts->beta1, (double)opts->beta2,
                             (double)ds->beta1, (double)ds->beta2);
    if (n < 0 || (n > 0 && !params))
        return dsk_set_error(DSK_ERR_ARG, "%s: %d params with list %p", fn, n, (const void *)params);
    if (round != DSK_AMP_ROUND_NEAREST && round != DSK_AMP_ROUND_STOCHASTIC)
        return dsk_set_error(DSK_ERR_ARG, "%s: unknown rounding mode %d", fn, (int)round);
    for (int i = 0; i < n; i++) {
        DSK__TRY(dsk__amp_check_param(&params[i], i));
        if (params[i].master->device.type != ds->device.type || params[i].master->device.index != ds->device.index)
            return dsk_set_error(DSK_ERR_ARG, "%s: params[%d] \"%s\" is not on the dstep's device", fn, i,
                                 params[i].name ? params[i].name : "");
    }
    DSK__CUDA_PATH(ds->device.type == DSK_DEV_CUDA, dsk__amp_step_dev_cuda(ctx, params, n, opts, ds, round, seed));
    {
        const dsk_amp_step_vals *v = ds->vals;
        dsk_amp_decision d;
        dsk_adamw_opts o = *opts;
        if (v->skip) return DSK_OK;
        d.skip = 0;
        d.grad_mult = v->grad_mult;
        d.norm = v->norm;
        o.lr = v->lr;
        return dsk_amp_step(ctx, params, n, &o, v->step, &d, round, seed);
    }
}

/* ---------------------------------------------------------------- FP8 */

static dsk_status dsk__amp_fp8_in(const char *fn, const char *what, const dsk_tensor *t, dsk_device dev) {
    char b[96];
    dsk_status s = dsk__amp_check(fn, what, t, dev);
    if (s != DSK_OK) return s;
    if (!dsk__amp_is_grad_dtype(t->dtype))
        return dsk_set_error(DSK_ERR_ARG, "%s: %s is %s, want f32, bf16 or f16", fn, what,
                             dsk_tensor_describe(t, b, sizeof b));
    return DSK_OK;
}

static float dsk__amp_amax_cpu(const dsk_tensor *x) {
    uint32_t m = 0;
    for (int64_t i = 0, n = dsk_tensor_numel(x); i < n; i++) {
        uint32_t a = dsk_amp_abs_bits(dsk_load_f32(x->data, x->dtype, i));
        if (a > m) m = a;
    }
    return dsk_bits_f32(m);
}

DSK_API dsk_status dsk_amp_amax(dsk_ctx *ctx, dsk_tensor *amax, const dsk_tensor *x, int accumulate) {
    const char *fn = "dsk_amp_amax";
    DSK__TRY(dsk__amp_fp8_in(fn, "x", x, x ? x->device : dsk_cpu()));
    DSK__TRY(dsk__amp_scalar_f32(fn, "amax", amax, x->device));
    DSK__TRY(dsk__amp_need_ctx(fn, ctx, x->device));
    DSK__CUDA_PATH(x->device.type == DSK_DEV_CUDA, dsk_cuda_amp_amax(ctx, (float *)amax->data, x, accumulate));
    {
        float *out = (float *)amax->data;
        uint32_t m = dsk_f32_bits(dsk__amp_amax_cpu(x)), prior = dsk_f32_bits(*out);
        *out = dsk_bits_f32(accumulate && prior > m ? prior : m); /* the GPU's atomicMax on the bits */
    }
    return DSK_OK;
}

static dsk_status dsk__amp_fp8_fmt(const char *fn, dsk_dtype fmt) {
    if (!dsk__amp_is_fp8(fmt))
        return dsk_set_error(DSK_ERR_ARG, "%s: format %s is not e4m3 or e5m2", fn, dsk_dtype_name(fmt));
    return DSK_OK;
}

static dsk_status dsk__amp_margin(const char *fn, int margin) {
    if (margin < 0 || margin > 64) return dsk_set_error(DSK_ERR_ARG, "%s: margin %d outside [0, 64]", fn, margin);
    return DSK_OK;
}

#ifdef DSK_CUDA
/* dsk_amp_fp8_current_scale's CUDA path: x's amax, then the scale from it, on the device. */
static dsk_status dsk__amp_current_scale_cuda(dsk_ctx *ctx, dsk_tensor *scale, dsk_tensor *amax, const dsk_tensor *x,
                                              dsk_dtype fmt, int margin, int pow2) {
    /* without amax, the scale slot holds it: the scale kernel may read and write one slot */
    float *am = amax ? (float *)amax->data : (float *)scale->data;
    DSK__TRY(dsk_cuda_amp_amax(ctx, am, x, 0));
    return dsk_cuda_amp_fp8_scale(ctx, (float *)scale->data, am, 1, dsk_amp_fp8_max(fmt), margin, pow2, 0, NULL);
}
#endif

DSK_API dsk_status dsk_amp_fp8_current_scale(dsk_ctx *ctx, dsk_tensor *scale, dsk_tensor *amax, const dsk_tensor *x,
                                             dsk_dtype fmt, int margin, int pow2) {
    const char *fn = "dsk_amp_fp8_current_scale";
    DSK__TRY(dsk__amp_fp8_fmt(fn, fmt));
    DSK__TRY(dsk__amp_margin(fn, margin));
    DSK__TRY(dsk__amp_fp8_in(fn, "x", x, x ? x->device : dsk_cpu()));
    DSK__TRY(dsk__amp_scalar_f32(fn, "scale", scale, x->device));
    if (amax) DSK__TRY(dsk__amp_scalar_f32(fn, "amax", amax, x->device));
    DSK__TRY(dsk__amp_need_ctx(fn, ctx, x->device));
    DSK__CUDA_PATH(x->device.type == DSK_DEV_CUDA, dsk__amp_current_scale_cuda(ctx, scale, amax, x, fmt, margin, pow2));
    {
        float a = dsk__amp_amax_cpu(x);
        if (amax) *(float *)amax->data = a;
        *(float *)scale->data = dsk_amp_fp8_scale(a, dsk_amp_fp8_max(fmt), margin, pow2, 1.0f);
    }
    return DSK_OK;
}

DSK_API dsk_status dsk_amp_fp8_quantize(dsk_ctx *ctx, dsk_tensor *q, const dsk_tensor *x, const dsk_tensor *scale) {
    const char *fn = "dsk_amp_fp8_quantize";
    char a[96], b[96];
    DSK__TRY(dsk__amp_fp8_in(fn, "x", x, x ? x->device : dsk_cpu()));
    DSK__TRY(dsk__amp_check(fn, "q", q, x->device));
    DSK__TRY(dsk__amp_scalar_f32(fn, "scale", scale, x->device));
    DSK__TRY(dsk__amp_need_ctx(fn, ctx, x->device));
    if (!dsk__amp_is_fp8(q->dtype) || !dsk_tensor_same_shape(q, x))
        return dsk_set_error(DSK_ERR_ARG, "%s: q %s must be e4m3 or e5m2 of x's shape %s", fn,
                             dsk_tensor_describe(q, a, sizeof a), dsk_tensor_describe(x, b, sizeof b));
    DSK__CUDA_PATH(x->device.type == DSK_DEV_CUDA, dsk_cuda_amp_fp8_quantize(ctx, q, x, (const float *)scale->data));
    {
        float sc = *(const float *)scale->data;
        uint8_t *o = (uint8_t *)q->data;
        for (int64_t i = 0, n = dsk_tensor_numel(x); i < n; i++)
            o[i] = dsk_amp_to_fp8(dsk_amp_fp8_product(dsk_load_f32(x->data, x->dtype, i), sc), q->dtype);
    }
    return DSK_OK;
}

DSK_API dsk_status dsk_amp_fp8_dequantize(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *q, const dsk_tensor *scale) {
    const char *fn = "dsk_amp_fp8_dequantize";
    char a[96], b[96];
    DSK__TRY(dsk__amp_check(fn, "q", q, q ? q->device : dsk_cpu()));
    DSK__TRY(dsk__amp_fp8_in(fn, "y", y, q->device));
    DSK__TRY(dsk__amp_scalar_f32(fn, "scale", scale, q->device));
    DSK__TRY(dsk__amp_need_ctx(fn, ctx, q->device));
    if (!dsk__amp_is_fp8(q->dtype) || !dsk_tensor_same_shape(q, y))
        return dsk_set_error(DSK_ERR_ARG, "%s: q %s must be e4m3 or e5m2 of y's shape %s", fn,
                             dsk_tensor_describe(q, a, sizeof a), dsk_tensor_describe(y, b, sizeof b));
    DSK__CUDA_PATH(q->device.type == DSK_DEV_CUDA, dsk_cuda_amp_fp8_dequantize(ctx, y, q, (const float *)scale->data));
    {
        float inv = 1.0f / *(const float *)scale->data;
        const uint8_t *in = (const uint8_t *)q->data;
        for (int64_t i = 0, n = dsk_tensor_numel(q); i < n; i++)
            dsk_store_f32(y->data, y->dtype, i, dsk_amp_from_fp8(in[i], q->dtype) * inv);
    }
    return DSK_OK;
}

DSK_API dsk_status dsk_amp_fp8_delayed_init(dsk_amp_fp8_delayed *d, dsk_ctx *ctx,
                                            const dsk_amp_fp8_delayed_opts *opts) {
    const char *fn = "dsk_amp_fp8_delayed_init";
    dsk_status s;
    dsk_amp_fp8_delayed_opts o;
    int64_t len;
    if (!d) return dsk_set_error(DSK_ERR_ARG, "%s: object is NULL", fn);
    memset(d, 0, sizeof *d);
    memset(&o, 0, sizeof o);
    if (opts) o = *opts;
    if (o.fmt == DSK_F32) o.fmt = DSK_E4M3;
    if (o.history_len == 0) o.history_len = 1024;
    DSK__TRY(dsk__amp_fp8_fmt(fn, o.fmt));
    DSK__TRY(dsk__amp_margin(fn, o.margin));
    if (o.history_len < 1) return dsk_set_error(DSK_ERR_ARG, "%s: history_len %d must be >= 1", fn, o.history_len);
    if (o.algo != DSK_AMP_AMAX_MAX && o.algo != DSK_AMP_AMAX_MOST_RECENT)
        return dsk_set_error(DSK_ERR_ARG, "%s: unknown amax algo %d", fn, (int)o.algo);
    len = o.history_len;
    s = dsk_tensor_alloc(ctx, &d->history, DSK_F32, 1, &len);
    if (s == DSK_OK) s = dsk_tensor_alloc(ctx, &d->scale, DSK_F32, 0, NULL);
    if (s == DSK_OK) s = dsk_tensor_fill(ctx, &d->history, 0.0);
    if (s == DSK_OK) s = dsk_tensor_fill(ctx, &d->scale, 1.0);
    if (s != DSK_OK) {
        dsk_amp_fp8_delayed_free(d, ctx); /* frees what was made (zeroed tensors are fine) */
        return s;
    }
    d->opts = o;
    return DSK_OK;
}

DSK_API void dsk_amp_fp8_delayed_free(dsk_amp_fp8_delayed *d, dsk_ctx *ctx) {
    if (!d) return;
    dsk_tensor_free(ctx, &d->history);
    dsk_tensor_free(ctx, &d->scale);
    memset(d, 0, sizeof *d);
}

static dsk_status dsk__amp_need_delayed(const char *fn, const dsk_amp_fp8_delayed *d) {
    if (!d) return dsk_set_error(DSK_ERR_ARG, "%s: object is NULL", fn);
    if (!d->history.data || !d->scale.data)
        return dsk_set_error(DSK_ERR_STATE, "%s: delayed scaling state is not initialised", fn);
    return DSK_OK;
}

DSK_API dsk_status dsk_amp_fp8_delayed_quantize(dsk_amp_fp8_delayed *d, dsk_ctx *ctx, dsk_tensor *q,
                                                const dsk_tensor *x) {
    const char *fn = "dsk_amp_fp8_delayed_quantize";
    dsk_tensor slot;
    DSK__TRY(dsk__amp_need_delayed(fn, d));
    if (q && q->dtype != d->opts.fmt && dsk__amp_is_fp8(q->dtype))
        return dsk_set_error(DSK_ERR_ARG, "%s: q is %s, the delayed scaling format is %s", fn, dsk_dtype_name(q->dtype),
                             dsk_dtype_name(d->opts.fmt));
    DSK__TRY(dsk_amp_fp8_quantize(ctx, q, x, &d->scale));
    DSK__TRY(dsk_tensor_slice(&d->history, 0, d->pos, 1, &slot));
    return dsk_amp_amax(ctx, &slot, x, 1);
}

#ifdef DSK_CUDA
/* dsk_amp_fp8_delayed_update's CUDA path: the scale from the history (or its slot pos), slot next cleared. */
static dsk_status dsk__amp_delayed_update_cuda(dsk_amp_fp8_delayed *d, dsk_ctx *ctx, float *h, int64_t next) {
    int most_recent = d->opts.algo == DSK_AMP_AMAX_MOST_RECENT;
    DSK__TRY(dsk_cuda_amp_fp8_scale(ctx, (float *)d->scale.data, most_recent ? h + d->pos : h,
                                    most_recent ? 1 : d->opts.history_len, dsk_amp_fp8_max(d->opts.fmt), d->opts.margin,
                                    d->opts.pow2, 1, h + next));
    d->pos = next;
    return DSK_OK;
}
#endif

DSK_API dsk_status dsk_amp_fp8_delayed_update(dsk_amp_fp8_delayed *d, dsk_ctx *ctx) {
    const char *fn = "dsk_amp_fp8_delayed_update";
    float *h;
    int64_t next;
    DSK__TRY(dsk__amp_need_delayed(fn, d));
    DSK__TRY(dsk__amp_need_ctx(fn, ctx, d->history.device));
    h = (float *)d->history.data;
    next = (d->pos + 1) % d->opts.history_len;
    DSK__CUDA_PATH(d->history.device.type == DSK_DEV_CUDA, dsk__amp_delayed_update_cuda(d, ctx, h, next));
    {
        uint32_t m = 0;
        float *sc = (float *)d->scale.data;
        if (d->opts.algo == DSK_AMP_AMAX_MOST_RECENT) m = dsk_amp_abs_bits(h[d->pos]);
        else
            for (int i = 0; i < d->opts.history_len; i++)
                if (dsk_amp_abs_bits(h[i]) > m) m = dsk_amp_abs_bits(h[i]);
        *sc = dsk_amp_fp8_scale(dsk_bits_f32(m), dsk_amp_fp8_max(d->opts.fmt), d->opts.margin, d->opts.pow2, *sc);
        h[next] = 0.0f;
        d->pos = next;
    }
    return DSK_OK;
}

static dsk_status dsk__amp_block_args(const char *fn, const dsk_tensor *x, const dsk_tensor *q,
                                      const dsk_tensor *scales, int br, int bc) {
    char a[96], b[96], c[96];
    int64_t R, C;
    if (br < 1 || bc < 1) return dsk_set_error(DSK_ERR_ARG, "%s: block %dx%d must be at least 1x1", fn, br, bc);
    if (x->ndim != 2)
        return dsk_set_error(DSK_ERR_ARG, "%s: tensor %s must be 2-D (R, C)", fn, dsk_tensor_describe(x, a, sizeof a));
    R = x->shape[0]; C = x->shape[1];
    if (!dsk__amp_is_fp8(q->dtype) || !dsk_tensor_same_shape(q, x))
        return dsk_set_error(DSK_ERR_ARG, "%s: q %s must be e4m3 or e5m2 of shape %s", fn,
                             dsk_tensor_describe(q, a, sizeof a), dsk_tensor_describe(x, b, sizeof b));
    if (scales->dtype != DSK_F32 || scales->ndim != 2 || scales->shape[0] != (R + br - 1) / br ||
        scales->shape[1] != (C + bc - 1) / bc)
        return dsk_set_error(DSK_ERR_ARG, "%s: scales %s, want [%lld,%lld] f32 for %s in %dx%d blocks", fn,
                             dsk_tensor_describe(scales, c, sizeof c), (long long)((R + br - 1) / br),
                             (long long)((C + bc - 1) / bc), dsk_tensor_describe(x, b, sizeof b), br, bc);
    return DSK_OK;
}

/* OpenMP pragmas only when compiled with -fopenmp (no unknown-pragma warnings without). */
#ifdef _OPENMP
#define DSK__AMP_OMP(x) _Pragma(#x)
#else
#define DSK__AMP_OMP(x)
#endif

/* The CPU quantisers read their input DSK__AMP_PIECE elements at a time as f32 (f32 in place), so
   that the loops over a piece have no dtype switch and vectorise (dsk_f32_to_e4m3 is branch-free). */
#define DSK__AMP_PIECE 256

static const float *dsk__amp_piece(float *buf, const void *x, dsk_dtype dt, int64_t off, int64_t n) {
    if (dt == DSK_F32) return (const float *)x + off;
    dsk_load_f32_n(buf, x, dt, off, n);
    return buf;
}
/* The larger of m and the dsk_amp_abs_bits of v[0, n). */
static uint32_t dsk__amp_amax_f32(const float *v, int64_t n, uint32_t m) {
    DSK__AMP_OMP(omp simd reduction(max : m))
    for (int64_t i = 0; i < n; i++) {
        uint32_t a = dsk_amp_abs_bits(v[i]);
        m = a > m ? a : m;
    }
    return m;
}
/* o[i] = the fmt code of v[i] / d, i in [0, n). */
static void dsk__amp_codes_f32(uint8_t *o, const float *v, int64_t n, float d, dsk_dtype fmt) {
    if (fmt == DSK_E4M3) {
        DSK__AMP_OMP(omp simd)
        for (int64_t i = 0; i < n; i++) o[i] = dsk_f32_to_e4m3(dsk_amp_fp8_quotient(v[i], d));
    } else {
        for (int64_t i = 0; i < n; i++) o[i] = dsk_f32_to_e5m2(dsk_amp_fp8_quotient(v[i], d));
    }
}
/* A block row: the largest dsk_amp_abs_bits of elements [off, off + len) of x, and their codes. */
static uint32_t dsk__amp_row_amax(const void *x, dsk_dtype dt, int64_t off, int64_t len) {
    float buf[DSK__AMP_PIECE];
    uint32_t m = 0;
    for (int64_t i = 0; i < len; i += DSK__AMP_PIECE) {
        int64_t n = len - i < DSK__AMP_PIECE ? len - i : DSK__AMP_PIECE;
        m = dsk__amp_amax_f32(dsk__amp_piece(buf, x, dt, off + i, n), n, m);
    }
    return m;
}
static void dsk__amp_row_quantize(uint8_t *o, dsk_dtype fmt, const void *x, dsk_dtype dt, int64_t off, int64_t len,
                                  float d) {
    float buf[DSK__AMP_PIECE];
    for (int64_t i = 0; i < len; i += DSK__AMP_PIECE) {
        int64_t n = len - i < DSK__AMP_PIECE ? len - i : DSK__AMP_PIECE;
        dsk__amp_codes_f32(o + i, dsk__amp_piece(buf, x, dt, off + i, n), n, d, fmt);
    }
}

DSK_API dsk_status dsk_amp_fp8_block_quantize(dsk_ctx *ctx, dsk_tensor *q, dsk_tensor *scales, const dsk_tensor *x,
                                              int br, int bc, int pow2) {
    const char *fn = "dsk_amp_fp8_block_quantize";
    DSK__TRY(dsk__amp_fp8_in(fn, "x", x, x ? x->device : dsk_cpu()));
    DSK__TRY(dsk__amp_check(fn, "q", q, x->device));
    DSK__TRY(dsk__amp_check(fn, "scales", scales, x->device));
    DSK__TRY(dsk__amp_need_ctx(fn, ctx, x->device));
    DSK__TRY(dsk__amp_block_args(fn, x, q, scales, br, bc));
    DSK__CUDA_PATH(x->device.type == DSK_DEV_CUDA, dsk_cuda_amp_fp8_block_quantize(ctx, q, scales, x, br, bc, pow2));
    {
        int64_t R = x->shape[0], C = x->shape[1], SR = scales->shape[0], SC = scales->shape[1];
        float fmax = dsk_amp_fp8_max(q->dtype), *sc = (float *)scales->data;
        uint8_t *o = (uint8_t *)q->data;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(dsk_ctx_threads(ctx)) if (SR * SC > 16)
#endif
        for (int64_t blk = 0; blk < SR * SC; blk++) {
            int64_t r0 = (blk / SC) * br, c0 = (blk % SC) * bc, r1 = r0 + br < R ? r0 + br : R,
                    c1 = c0 + bc < C ? c0 + bc : C;
            uint32_t m = 0;
            float d;
            for (int64_t r = r0; r < r1; r++) {
                uint32_t a = dsk__amp_row_amax(x->data, x->dtype, r * C + c0, c1 - c0);
                if (a > m) m = a;
            }
            d = dsk_amp_fp8_block_scale(dsk_bits_f32(m), fmax, pow2);
            sc[blk] = d;
            for (int64_t r = r0; r < r1; r++)
                dsk__amp_row_quantize(o + r * C + c0, q->dtype, x->data, x->dtype, r * C + c0, c1 - c0, d);
        }
    }
    return DSK_OK;
}

/* Columns of x per tile of the transposed quantisation: whole blocks of br columns, at least 64. */
static int64_t dsk__amp_tile_cols(int br) { return br >= 64 ? br : (64 + br - 1) / br * br; }

/* Band jb of the transposed quantisation: x's rows [jb bc, jb bc + bc), i.e. column block jb of
   q (C, R). A tile of columns at a time is read row by row (contiguous reads) as f32 into t
   transposed (t[column][row]), so that each column's run over the band is contiguous: its
   maximum, its block's scale, then its codes, a vector loop each. */
static void dsk__amp_quantize_t_band(dsk_tensor *q, dsk_tensor *scales, const dsk_tensor *x, int64_t jb, int br, int bc,
                                     int pow2, float *t) {
    int64_t R = x->shape[0], C = x->shape[1], SC = scales->shape[1], tc = dsk__amp_tile_cols(br);
    int64_t r0 = jb * bc, nr = r0 + bc < R ? bc : R - r0;
    float fmax = dsk_amp_fp8_max(q->dtype), *sc = (float *)scales->data, buf[DSK__AMP_PIECE];
    uint8_t *o = (uint8_t *)q->data;
    for (int64_t c0 = 0; c0 < C; c0 += tc) {
        int64_t nc = c0 + tc < C ? tc : C - c0;
        for (int64_t r = 0; r < nr; r++)
            for (int64_t i = 0; i < nc; i += DSK__AMP_PIECE) {
                int64_t n = nc - i < DSK__AMP_PIECE ? nc - i : DSK__AMP_PIECE;
                const float *v = dsk__amp_piece(buf, x->data, x->dtype, (r0 + r) * C + c0 + i, n);
                for (int64_t k = 0; k < n; k++) t[(i + k) * bc + r] = v[k];
            }
        for (int64_t b0 = 0; b0 < nc; b0 += br) { /* the (br x bc) blocks of q: br columns of x */
            int64_t b1 = b0 + br < nc ? b0 + br : nc;
            uint32_t m = 0;
            float d;
            for (int64_t c = b0; c < b1; c++) m = dsk__amp_amax_f32(t + c * bc, nr, m);
            d = dsk_amp_fp8_block_scale(dsk_bits_f32(m), fmax, pow2);
            sc[((c0 + b0) / br) * SC + jb] = d;
            for (int64_t c = b0; c < b1; c++) dsk__amp_codes_f32(o + (c0 + c) * R + r0, t + c * bc, nr, d, q->dtype);
        }
    }
}

DSK_API dsk_status dsk_amp_fp8_block_quantize_t(dsk_ctx *ctx, dsk_tensor *q, dsk_tensor *scales, const dsk_tensor *x,
                                                int br, int bc, int pow2) {
    const char *fn = "dsk_amp_fp8_block_quantize_t";
    char a[96];
    dsk_tensor xt;
    DSK__TRY(dsk__amp_fp8_in(fn, "x", x, x ? x->device : dsk_cpu()));
    DSK__TRY(dsk__amp_check(fn, "q", q, x->device));
    DSK__TRY(dsk__amp_check(fn, "scales", scales, x->device));
    DSK__TRY(dsk__amp_need_ctx(fn, ctx, x->device));
    if (x->ndim != 2)
        return dsk_set_error(DSK_ERR_ARG, "%s: tensor %s must be 2-D (R, C)", fn, dsk_tensor_describe(x, a, sizeof a));
    DSK__TRY(dsk_tensor_transpose(x, 0, 1, &xt)); /* only its shape is used: the checks are those of x^T */
    DSK__TRY(dsk__amp_block_args(fn, &xt, q, scales, br, bc));
    DSK__CUDA_PATH(x->device.type == DSK_DEV_CUDA, dsk_cuda_amp_fp8_block_quantize_t(ctx, q, scales, x, br, bc, pow2));
    {
        int64_t SC = scales->shape[1], tile = dsk__amp_tile_cols(br) * bc;
        float *t = (float *)DSK_MALLOC((size_t)(SC * tile) * sizeof(float) + 1); /* a tile per band */
        if (!t)
            return dsk_set_error(DSK_ERR_OOM, "%s: out of host memory for %lld bands of %lld floats", fn, (long long)SC,
                                 (long long)tile);
#ifdef _OPENMP
#pragma omp parallel for schedule(static) \
    num_threads(dsk_ctx_threads(ctx)) if (SC > 1 && x->shape[0] * x->shape[1] > 65536)
#endif
        for (int64_t jb = 0; jb < SC; jb++) dsk__amp_quantize_t_band(q, scales, x, jb, br, bc, pow2, t + jb * tile);
        DSK_FREE(t);
    }
    return DSK_OK;
}

DSK_API dsk_status dsk_amp_fp8_block_dequantize(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *q,
                                                const dsk_tensor *scales, int br, int bc) {
    const char *fn = "dsk_amp_fp8_block_dequantize";
    DSK__TRY(dsk__amp_check(fn, "q", q, q ? q->device : dsk_cpu()));
    DSK__TRY(dsk__amp_fp8_in(fn, "y", y, q->device));
    DSK__TRY(dsk__amp_check(fn, "scales", scales, q->device));
    DSK__TRY(dsk__amp_need_ctx(fn, ctx, q->device));
    DSK__TRY(dsk__amp_block_args(fn, y, q, scales, br, bc));
    DSK__CUDA_PATH(q->device.type == DSK_DEV_CUDA, dsk_cuda_amp_fp8_block_dequantize(ctx, y, q, scales, br, bc));
    {
        int64_t R = q->shape[0], C = q->shape[1], SC = scales->shape[1];
        const float *sc = (const float *)scales->data;
        const uint8_t *in = (const uint8_t *)q->data;
        float value[256], row[DSK__AMP_PIECE]; /* each code's value; a piece of a row of y */
        for (int i = 0; i < 256; i++) value[i] = dsk_amp_from_fp8((uint8_t)i, q->dtype);
        for (int64_t r = 0; r < R; r++)
            for (int64_t c0 = 0; c0 < C; c0 += DSK__AMP_PIECE) {
                int64_t n = C - c0 < DSK__AMP_PIECE ? C - c0 : DSK__AMP_PIECE;
                for (int64_t k = 0; k < n; k++) row[k] = value[in[r * C + c0 + k]] * sc[(r / br) * SC + (c0 + k) / bc];
                dsk_store_f32_n(y->data, y->dtype, r * C + c0, row, n);
            }
    }
    return DSK_OK;
}

#ifdef __cplusplus
}
#endif
DSK__FP_EXACT_END
#endif /* DSK_AMP_IMPLEMENTATION_DONE */
#endif /* DSK_AMP_IMPLEMENTATION */

/* MIT License. Copyright (c) 2026 the dsk authors. Permission is hereby granted, free of
   charge, to any person obtaining a copy of this software, to deal in the software without
   restriction, subject to including this notice. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT
   WARRANTY OF ANY KIND. */
