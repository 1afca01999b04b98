/* dsk_moe.h - the DeepSeek Mixture-of-Experts layer: router, dispatch/combine, SwiGLU experts,
   shared experts, balancing losses, expert bias, capacity, expert parallelism; forward and backward.

   Usage: #define DSK_MOE_IMPLEMENTATION in exactly one .c file before including (with
   DSK_TENSOR_IMPLEMENTATION and DSK_COMM_IMPLEMENTATION somewhere in the program).
   Options: DSK_STATIC, DSK_MALLOC/DSK_FREE, DSK_CUDA, DSK_NO_CUDA as in dsk_tensor.h.

       dsk_moe_opts o = {0};
       o.d_model = 512; o.n_routed = 16; o.top_k = 4; o.d_expert = 256; o.n_shared = 1;
       o.score = DSK_MOE_SIGMOID; o.n_group = 4; o.topk_group = 2;
       dsk_moe moe;  dsk_moe_init(&moe, ctx, &o);
       for each micro-batch:
           dsk_moe_forward(&moe, ctx, &y, &x, &stats);      // y (T, D) from x (T, D)
           loss += stats.loss;                              // the layer's balancing losses
           ... dsk_moe_backward(&moe, ctx, &dx, &dy, 1.0f); // dx += ..., grads += ...
       all-reduce moe.grad_slab (dense part over every data-parallel rank, expert part over
       the ranks holding the same experts), optimizer step on the named parameters, then
       dsk_moe_update_bias(&moe, ctx, dp_comm);            // aux-loss-free balancing
       dsk_moe_free(&moe, ctx);

   Routing (router always f32; W_r (E, D), bias b (E)):
     u = x W_r^T.  Softmax: p = softmax(u).  Sigmoid (DeepSeek-V3): p = sigmoid(u).
     Selection scores c = p + b. With n_group > 1 the experts form n_group equal groups; a group
     scores by opts.group_rule: by default DeepSeek-V3's, the sum of its two largest c (the
     layer always has its bias b; without a bias V3 takes the largest c), for either score
     function; DSK_MOE_GROUP_MAX the largest c (DeepSeek-V2); DSK_MOE_GROUP_MEGATRON the sum
     of its top_k / topk_group largest c (Megatron-Core). The topk_group best groups are kept
     (ties: lower group index) and every other expert is set to -inf.
     The top_k largest c are selected (ties: lower expert index), in descending order; that
     order is the token's slot order. Weights g_k = scale * p_k / (sum of selected p + 1e-20)
     with normalisation, g_k = scale * p_k without; the bias never enters g or its gradient.
   Non-finite input: a token whose logits u or scores c hold a NaN or an Inf (from x, W_r or b)
     has no ranking; routing gives it experts 0 .. K-1 with NaN weights (never an index out of
     range), and dsk_moe_forward fails with DSK_ERR_NONFINITE naming the first such token, on
     the CPU and on CUDA alike (the CUDA forward reads the routing back to the host anyway) and,
     with expert parallelism, on every rank of the group together. Such a call writes no y,
     counts nothing toward the bias update and leaves no forward for backward.
   Experts: SwiGLU o = W2 (silu(W1 x) * (W3 x)), w1, w3 (E, F, D), w2 (E, D, F). Shared experts
     are one SwiGLU of hidden n_shared * d_shared, always added: y = sum_k g_k o_k + shared(x).
   Dispatch: the kept (token, slot) pairs, flat index t*K + k, stably counting-sorted by expert;
     combine sums a token's slots in slot order (deterministic, no float atomics).
   Losses (over this call's T tokens, added to the model loss by the caller; their gradients
     enter backward scaled by its aux_scale), with p' = p for softmax and s / sum_j s_j for sigmoid:
     Switch/GShard  aux_alpha * E * sum_i f_i P_i, f_i = cnt_i / (T K), P_i = mean_t p'_ti;
     DeepSeek-V3 sequence-wise, per sequence of seq_len tokens then averaged over sequences (a
                    call's T must be a multiple of seq_len, else DSK_ERR_ARG: no partial sequences):
                    seq_aux_alpha * sum_i (E/(K L)) cnt_i * (1/L) sum_t p'_ti;
       where cnt_i counts the tokens with i among the top K of their unbiased scores p over all
       experts (opts.loss_count, default, as the V3 paper and Megatron-Core count), or among their
       actual selections (DSK_MOE_COUNT_SELECTED); counts carry no gradient;
     z-loss         z_beta * mean_t (logsumexp_j u_tj)^2.
   Capacity (capacity_factor > 0): C = ceil(T K / E * capacity_factor) slots per expert from this
     rank's tokens; the rest are dropped (lowest weight first, or latest position first) and
     contribute zero. Default: dropless.
   Expert parallelism (opts.ep with P ranks): rank r holds experts [r E/P, (r+1) E/P); each rank
     routes its own tokens, sends rows by all-to-all-v (counts first), the owners compute and
     send the outputs back; backward runs the reverse exchanges. Every rank must call forward
     and backward together (collectives).
   Devices: the layer lives on ctx's device. CPU: f32 math (bf16 layers convert their weights
     and round y, dx to bf16). CUDA (kernels/moe.cu): activations stay on the device, expert
     GEMMs run through cuBLAS in the compute dtype with f32 accumulation; each forward brings the
     routing decisions back to the host once (one stream sync) for the dispatch plan, capacity,
     losses and the per-expert row counts of the GEMMs. Expert parallelism: CPU layers with a
     host-backend communicator, CUDA layers with an nccl one (rows regrouped on the device).
   License: MIT, see the end of the file. */

/* Contents
     declarations
       options                   dsk_moe_score, dsk_moe_norm, dsk_moe_group_rule, dsk_moe_loss_count, dsk_moe_drop,
                                 dsk_moe_router, dsk_moe_opts
       the layer                 dsk_moe_param, dsk_moe_stats, dsk_moe, dsk_moe_init/free/find_param/forward/
                                 backward/zero_grad/update_bias
       per-token routing math    dsk_moe_route_token, dsk_moe_route_token_backward (DSK_HD: CPU and CUDA kernels)
     implementation (DSK_MOE_IMPLEMENTATION)
       state; options and init; CPU building blocks; routing, losses, capacity; expert-parallel exchange;
       forward and backward (CPU); CUDA path; public entry points */
/* With DSK_STATIC every dsk function is static, so this file must also compile its dependencies. */
#if defined(DSK_STATIC) && defined(DSK_MOE_IMPLEMENTATION)
#ifndef DSK_TENSOR_IMPLEMENTATION
#define DSK_TENSOR_IMPLEMENTATION
#endif
#ifndef DSK_COMM_IMPLEMENTATION
#define DSK_COMM_IMPLEMENTATION
#endif
#endif
#ifndef DSK_MOE_H
#define DSK_MOE_H
#include "dsk_tensor.h"
#include "dsk_comm.h" /* expert parallelism */
#ifdef __cplusplus
extern "C" {
#endif

/* ---- options */

typedef enum dsk_moe_score { DSK_MOE_SOFTMAX = 0, DSK_MOE_SIGMOID = 1 } dsk_moe_score;
/* Normalisation of the selected weights; the default is on for sigmoid, off for softmax. */
typedef enum dsk_moe_norm { DSK_MOE_NORM_DEFAULT = 0, DSK_MOE_NORM_ON = 1, DSK_MOE_NORM_OFF = 2 } dsk_moe_norm;
/* How group-limited routing scores a group from its experts' selection scores c = p + b. */
typedef enum dsk_moe_group_rule {
    DSK_MOE_GROUP_DEEPSEEK_V3 = 0, /* DeepSeek-V3's reference Gate (inference/model.py): the sum of the two largest
                                      c when there is a bias, the largest c without one, for either score function */
    DSK_MOE_GROUP_MAX = 1,         /* the largest c (DeepSeek-V2's group-limited greedy routing) */
    DSK_MOE_GROUP_MEGATRON = 2     /* Megatron-Core's group_limited_topk: the sum of the top_k / topk_group
                                      (integer division) largest c, bias or not (V3's shape, top-8 from 4 kept
                                      groups, sums 2 like V3; other shapes differ) */
} dsk_moe_group_rule;
/* What the balancing losses count as expert i's load (f_i); the bias update always counts the
   actual selections. */
typedef enum dsk_moe_loss_count {
    DSK_MOE_COUNT_TOPK = 0,    /* the published rule (DeepSeek-V3 paper's sequence-wise loss, Megatron-Core's
                                  compute_routing_scores_for_aux_loss): i among the plain top-K of the token's
                                  unbiased scores over all experts */
    DSK_MOE_COUNT_SELECTED = 1 /* i among the token's actual selections, after the bias and the group limit */
} dsk_moe_loss_count;
/* Which slots capacity mode drops: the lowest routing weights, or the latest tokens. */
typedef enum dsk_moe_drop { DSK_MOE_DROP_PROB = 0, DSK_MOE_DROP_POSITION = 1 } dsk_moe_drop;

/* The routing configuration the per-token routing functions and the CUDA router take (the
   layer resolves it from its options into dsk_moe.routing). */
typedef struct dsk_moe_router {
    int n_experts;          /* E */
    int top_k;              /* K, 1 <= K <= E */
    dsk_moe_score score;    /* softmax or sigmoid */
    int norm;               /* 1: the selected weights are normalised to sum 1 (before the scale) */
    float scale;            /* routed_scale */
    int n_group;            /* groups of E / n_group experts (1: no group limit) */
    int topk_group;         /* groups kept per token, 1 <= topk_group <= n_group */
    dsk_moe_group_rule group_rule; /* how a group scores (with DSK_MOE_GROUP_MEGATRON: top_k >= topk_group) */
} dsk_moe_router;

/* Zero fields take the defaults in brackets. */
typedef struct dsk_moe_opts {
    const char *name;        /* parameter name prefix ["moe"]: "moe.w1", "moe.shared.w2", ... */
    int64_t d_model;         /* D, required */
    int n_routed;            /* E routed experts, required */
    int top_k;               /* K experts per token, required, 1 <= K <= E */
    int64_t d_expert;        /* F, hidden size of a routed expert, required */
    int n_shared;            /* shared experts [0] */
    int64_t d_shared;        /* hidden size of one shared expert [d_expert] */
    dsk_moe_score score;     /* [DSK_MOE_SOFTMAX] */
    dsk_moe_norm norm;       /* [on for sigmoid, off for softmax] */
    float routed_scale;      /* multiplies the routed weights [1] */
    int n_group;             /* expert groups for group-limited routing [1]; must divide E */
    int topk_group;          /* groups kept per token [n_group] */
    dsk_moe_group_rule group_rule; /* [DSK_MOE_GROUP_DEEPSEEK_V3]; the layer always has its bias, so this ranks
                                      groups by their two largest c */
    float aux_alpha;         /* Switch/GShard auxiliary loss coefficient [0] */
    float seq_aux_alpha;     /* DeepSeek-V3 sequence-wise auxiliary loss coefficient [0] */
    int64_t seq_len;         /* sequence length of the sequence-wise loss [T of each call]: each call's T must
                                then be a multiple of it (whole sequences, as DeepSeek-V3 and Megatron-Core
                                take them); the Switch and z losses do not use it */
    float z_beta;            /* router z-loss coefficient [0] */
    dsk_moe_loss_count loss_count; /* what the Switch and sequence-wise losses count [DSK_MOE_COUNT_TOPK] */
    float bias_rate;         /* aux-loss-free bias update rate gamma [1e-3] */
    int bias_recenter;       /* 1: re-centre the bias to mean 0 after each update [0] */
    float capacity_factor;   /* [0 = dropless] */
    dsk_moe_drop drop;       /* [DSK_MOE_DROP_PROB] */
    dsk_dtype dtype;         /* parameters, x, y, dx, dy: DSK_F32 or DSK_BF16 [DSK_F32] */
    dsk_comm *ep;            /* expert-parallel group [NULL = every expert local] */
    float init_std;          /* weights ~ N(0, init_std) [0.02] (router, experts, shared) */
    uint64_t seed;           /* weight init stream [0]; expert e uses the same numbers at any EP size */
} dsk_moe_opts;

/* ---- the layer */

/* A named parameter: value in the parameter slab, gradient (f32) in the gradient slab. */
typedef struct dsk_moe_param {
    char name[96];           /* "<prefix>.w1" */
    dsk_tensor value;        /* view into param_slab (router and bias f32, the rest opts.dtype) */
    dsk_tensor grad;         /* f32 view into grad_slab; zero-size for the bias (not a gradient parameter) */
    int expert_sharded;      /* 1: this rank's slice of the experts (w1 w2 w3), 0: replicated */
} dsk_moe_param;

#define DSK_MOE_N_PARAMS 8

/* Per-call statistics, written by dsk_moe_forward. */
typedef struct dsk_moe_stats {
    int64_t tokens;                   /* tokens over the EP group */
    int64_t slots;                    /* routed (token, expert) pairs over the EP group, T*K summed */
    int64_t dropped;                  /* slots dropped by capacity over the EP group */
    const int64_t *tokens_per_expert; /* (E) slots each expert was selected for, EP group; owned by the layer */
    double max_load, mean_load;       /* max and mean of tokens_per_expert */
    double aux_loss, seq_aux_loss, z_loss; /* this rank's loss terms (coefficients included) */
    double loss;                      /* their sum: add it to the model loss */
} dsk_moe_stats;

struct dsk__moe_state;

typedef struct dsk_moe {
    dsk_moe_opts opts;        /* resolved: every default filled in */
    dsk_moe_router routing;   /* the router's configuration, from opts */
    int64_t d_shared_total;   /* n_shared * d_shared */
    int ep_rank, ep_size;     /* 0, 1 without expert parallelism */
    int n_local;              /* experts on this rank: E / ep_size */
    int expert0;              /* first local expert */
    dsk_device device;
    dsk_tensor param_slab;    /* u8 bytes: every parameter */
    dsk_tensor grad_slab;     /* f32, every gradient in this order: router, shared.w1, shared.w2, shared.w3
                                 (dense), then w1, w2, w3 (this rank's experts); params[i].grad point in */
    int64_t grad_dense_numel; /* grad_slab[0, grad_dense_numel): all-reduce over every DP rank */
    int64_t grad_expert_numel;/* the rest: all-reduce over the ranks holding the same experts */
    dsk_moe_param params[DSK_MOE_N_PARAMS];
    int n_params;
    /* shortcuts into params[] */
    dsk_moe_param *router, *bias, *w1, *w2, *w3, *sw1, *sw2, *sw3;
    struct dsk__moe_state *st; /* saved activations and workspace */
    int eval;                 /* 1: forward passes are not counted toward the bias update
                                 (validation, generation); set and clear it around them [0] */
} dsk_moe;

/* Validates opts, allocates parameters (initialised from opts.seed), zeroed gradients and the
   state on ctx's device (ctx NULL = CPU). With opts.ep the call is collective on that group. */
DSK_API dsk_status dsk_moe_init(dsk_moe *m, dsk_ctx *ctx, const dsk_moe_opts *opts);
DSK_API void dsk_moe_free(dsk_moe *m, dsk_ctx *ctx); /* zeroed/freed ok */
/* The parameter named `name` (full name, e.g. "moe.w1"), or NULL. */
DSK_API dsk_moe_param *dsk_moe_find_param(dsk_moe *m, const char *name);
/* y (T, D) = MoE(x (T, D)), both opts.dtype on the layer's device; saves what backward needs
   (one forward in flight per layer). stats may be NULL (zeroed on error). DSK_ERR_NONFINITE when
   a token's router logits are NaN/Inf (see "Non-finite input" above). */
DSK_API dsk_status dsk_moe_forward(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x, dsk_moe_stats *stats);
/* dx (T, D) += d/dx, every parameter gradient += its part, for the last forward; dy (T, D).
   aux_scale weights the gradients of the layer's loss terms (1; the loss scale under amp;
   divided by the micro-batch count when the model loss is). */
DSK_API dsk_status dsk_moe_backward(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *dy, float aux_scale);
/* Zeroes every gradient. */
DSK_API dsk_status dsk_moe_zero_grad(dsk_moe *m, dsk_ctx *ctx);
/* Aux-loss-free balancing, after the optimizer step: loads = selections per expert counted by
   every forward since the last update (except those run with m->eval set), summed over `comm`
   (the data-parallel world, NULL = this rank only); b_i += bias_rate * sign(mean load - load_i);
   re-centred if asked. */
DSK_API dsk_status dsk_moe_update_bias(dsk_moe *m, dsk_ctx *ctx, dsk_comm *comm);

/* ---- per-token routing math shared by the CPU path and the CUDA kernels */

/* logsumexp of u (E). */
static inline DSK_HD float dsk_moe_logsumexp(const float *u, int E) {
    float mx = u[0], s = 0.0f;
    for (int j = 1; j < E; j++) mx = u[j] > mx ? u[j] : mx;
    for (int j = 0; j < E; j++) s += expf(u[j] - mx);
    return mx + logf(s);
}

/* 1 if x is NaN or +-Inf. */
static inline DSK_HD int dsk__moe_nonfinite(float x) { return (dsk_f32_bits(x) & 0x7f800000u) == 0x7f800000u; }

/* How many of a group's largest selection scores make its score, by the group rule. */
static inline DSK_HD int dsk__moe_group_width(const dsk_moe_router *r, int has_bias) {
    int gs = r->n_experts / r->n_group, w;
    if (r->group_rule == DSK_MOE_GROUP_MAX) w = 1;
    else if (r->group_rule == DSK_MOE_GROUP_MEGATRON) w = r->top_k / r->topk_group;
    else w = has_bias ? 2 : 1;
    return w < gs ? w : gs;
}

/* Sum of the w largest of c (n finite values), added largest first (ties: lower index first);
   w <= n. No scratch: pass i takes the largest value ranked after pass i-1's (value, index). */
static inline DSK_HD float dsk__moe_top_sum(const float *c, int n, int w) {
    float s = 0.0f, pv = INFINITY;
    int pi = -1;
    for (int i = 0; i < w; i++) {
        int best = -1;
        for (int j = 0; j < n; j++)
            if ((c[j] < pv || (c[j] == pv && j > pi)) && (best < 0 || c[j] > c[best])) best = j;
        s += c[best];
        pv = c[best];
        pi = best;
    }
    return s;
}

/* Routes one token. u (E) logits; bias (E) or NULL; writes prob (E) (softmax p or sigmoid s),
   sel (K) expert ids in slot order and gate (K) weights. scratch: E + n_group floats.
   Returns 0, or 1 when a logit or a selection score (p + bias) is NaN or Inf: then sel holds
   experts 0 .. K-1 (always valid indices) and every gate is NaN. */
static inline DSK_HD int dsk_moe_route_token(const dsk_moe_router *r, const float *u, const float *bias, float *prob,
                                             float *scratch, int32_t *sel, float *gate) {
    const int E = r->n_experts, K = r->top_k, sigmoid = r->score == DSK_MOE_SIGMOID;
    float *c = scratch, *gscore = scratch + E, sum = 0.0f;
    int bad = 0;
    if (sigmoid) {
        for (int j = 0; j < E; j++) prob[j] = dsk_sigmoid_f(u[j]);
    } else {
        float mx = u[0];
        for (int j = 1; j < E; j++) mx = u[j] > mx ? u[j] : mx;
        for (int j = 0; j < E; j++) { prob[j] = expf(u[j] - mx); sum += prob[j]; }
        for (int j = 0; j < E; j++) prob[j] /= sum;
    }
    for (int j = 0; j < E; j++) {
        c[j] = prob[j] + (bias ? bias[j] : 0.0f);
        bad |= dsk__moe_nonfinite(u[j]) | dsk__moe_nonfinite(c[j]);
    }
    if (bad) { /* no order among NaNs: a fixed, valid selection, and NaN weights */
        for (int k = 0; k < K; k++) { sel[k] = k; gate[k] = NAN; }
        return 1;
    }
    if (r->n_group > 1) {
        int gs = E / r->n_group, w = dsk__moe_group_width(r, bias != NULL);
        for (int g = 0; g < r->n_group; g++) gscore[g] = dsk__moe_top_sum(c + g * gs, gs, w);
        for (int k = 0; k < r->topk_group; k++) { /* mark kept groups with NaN */
            int best = -1;
            for (int g = 0; g < r->n_group; g++)
                if (gscore[g] == gscore[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
            gscore[best] = NAN;
        }
        for (int g = 0; g < r->n_group; g++)
            if (gscore[g] == gscore[g])
                for (int j = g * gs; j < (g + 1) * gs; j++) c[j] = -INFINITY;
    }
    sum = 0.0f;
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int j = 0; j < E; j++)
            if (c[j] == c[j] && (best < 0 || c[j] > c[best])) best = j;
        c[best] = NAN; /* taken */
        sel[k] = best;
        sum += prob[best];
    }
    for (int k = 0; k < K; k++) gate[k] = r->scale * (r->norm ? prob[sel[k]] / (sum + 1e-20f) : prob[sel[k]]);
    return 0;
}

/* Backward of one token's routing into its logits: du (E) is WRITTEN with the gradient from
   dgate (K) (d loss / d gate, zero for dropped slots), the balancing-loss gradient aux_dp (E)
   (d loss / d p' per unit loss weight, times aux_mult; NULL for none) and the z-loss (zcoef *
   d (lse^2) / du / 2, i.e. the caller passes beta * 2 / T * aux_scale; 0 for none). */
static inline DSK_HD void dsk_moe_route_token_backward(const dsk_moe_router *r, const float *u, const float *prob,
                                                       const int32_t *sel, const float *dgate, const float *aux_dp,
                                                       float aux_mult, float zcoef, float *du) {
    const int E = r->n_experts, K = r->top_k, sigmoid = r->score == DSK_MOE_SIGMOID;
    float S = 0.0f, dot = 0.0f;
    for (int k = 0; k < K; k++) S += prob[sel[k]];
    /* du <- d loss / d prob */
    if (aux_dp && sigmoid) { /* p' = s / sum s */
        float tot = 0.0f, d = 0.0f;
        for (int j = 0; j < E; j++) tot += prob[j];
        for (int j = 0; j < E; j++) d += aux_dp[j] * prob[j];
        d /= tot;
        for (int j = 0; j < E; j++) du[j] = aux_mult * (aux_dp[j] - d) / tot;
    } else {
        for (int j = 0; j < E; j++) du[j] = aux_dp ? aux_mult * aux_dp[j] : 0.0f;
    }
    if (r->norm) {
        float sdq = 0.0f, inv = 1.0f / (S + 1e-20f);
        for (int k = 0; k < K; k++) sdq += dgate[k] * prob[sel[k]];
        for (int k = 0; k < K; k++) du[sel[k]] += r->scale * (dgate[k] - sdq * inv) * inv;
    } else {
        for (int k = 0; k < K; k++) du[sel[k]] += r->scale * dgate[k];
    }
    /* through the score function */
    if (sigmoid) {
        for (int j = 0; j < E; j++) du[j] *= prob[j] * (1.0f - prob[j]);
    } else {
        for (int j = 0; j < E; j++) dot += du[j] * prob[j];
        for (int j = 0; j < E; j++) du[j] = prob[j] * (du[j] - dot);
    }
    if (zcoef != 0.0f) {
        float lse = dsk_moe_logsumexp(u, E);
        for (int j = 0; j < E; j++) du[j] += zcoef * lse * expf(u[j] - lse);
    }
}

#ifdef __cplusplus
}
#endif
#endif /* DSK_MOE_H */

/* ==================================================================== implementation */
#ifdef DSK_MOE_IMPLEMENTATION
#ifndef DSK_MOE_IMPLEMENTATION_DONE
#define DSK_MOE_IMPLEMENTATION_DONE

#include <stdio.h>
#include <stdlib.h>
#ifdef DSK_CUDA
#include "kernels/dsk_kernels.h"
#endif

/* ---------------------------------------------------------------- state */

#ifdef DSK_CUDA
/* Device buffers of the CUDA path (cd = compute dtype). */
enum dsk__moe_dev_id {
    DSK__MOE_D_XC, DSK__MOE_D_XF, DSK__MOE_D_U, DSK__MOE_D_PROB, DSK__MOE_D_SCR, DSK__MOE_D_SEL, DSK__MOE_D_GATE,
    DSK__MOE_D_CNT, DSK__MOE_D_PERM, DSK__MOE_D_POS, DSK__MOE_D_AUX, DSK__MOE_D_XS, DSK__MOE_D_H1, DSK__MOE_D_H3,
    DSK__MOE_D_A, DSK__MOE_D_O, DSK__MOE_D_HS1, DSK__MOE_D_HS3, DSK__MOE_D_AS, DSK__MOE_D_YS, DSK__MOE_D_DXF,
    DSK__MOE_D_DGATE, DSK__MOE_D_DOS, DSK__MOE_D_DA, DSK__MOE_D_DH1, DSK__MOE_D_DH3, DSK__MOE_D_DXR, DSK__MOE_D_DU,
    DSK__MOE_D_DAS, DSK__MOE_D_DHS1, DSK__MOE_D_DHS3, DSK__MOE_D_COMM, DSK__MOE_D_XR, DSK__MOE_D_OB, DSK__MOE_D_DOR,
    DSK__MOE_D_DXP, DSK__MOE_D_RG, DSK__MOE_D_RGI, DSK__MOE_D_RT, DSK__MOE_D_RTMP, DSK__MOE_NDEV
};
#endif

/* OpenMP pragmas only when compiled with -fopenmp (no unknown-pragma warnings without). */
#ifdef _OPENMP
#define DSK__MOE_OMP(x) _Pragma(#x)
#else
#define DSK__MOE_OMP(x)
#endif

/* Host scratch grown on demand. */
typedef struct dsk__moe_buf { void *p; size_t cap; } dsk__moe_buf;

struct dsk__moe_state {
    int have_fwd;            /* a forward's activations are saved */
    int64_t T, n_kept, R;    /* tokens, kept slots sent, rows received */
    int64_t n_seq, seq_len;  /* sequences of the sequence-wise loss */
    int64_t n_bad, first_bad; /* tokens routed as non-finite this call, the first of them (-1: none) */
    /* T-sized (host) */
    dsk__moe_buf xf, u, prob, gate, sel, slot_pos, perm, xs, ob, hs1, hs3, as, ys, aux_coef;
    /* R-sized */
    dsk__moe_buf xr, h1, h3, a, orr, rg;
    /* backward scratch */
    dsk__moe_buf dyf, dxf, du, dgate, dos, dor, dh1, dh3, dxr, dxp, das, dhs1, dhs3;
    dsk__moe_buf wf; /* f32 copies of bf16 weights, per forward */
#ifdef DSK_CUDA
    dsk__moe_buf dev[DSK__MOE_NDEV]; /* device buffers of the CUDA path, see dsk__moe_dev_id */
#endif
    int64_t *sel_count;      /* (E) local selections this call */
    int64_t *kept_count;     /* (E) local kept slots this call */
    int64_t *global_count;   /* (E) selections over the EP group this call */
    int64_t *load_accum;     /* (E) local selections since the last bias update */
    int64_t *send_rows, *recv_rows;   /* (P) rows to / from each EP rank */
    int64_t *recv_cnt;       /* (P, n_local) rows from each rank for each local expert */
    int64_t *local_off;      /* (n_local + 1) row offsets of local experts in the regrouped buffer */
    int n_threads;
};

static dsk_status dsk__moe_reserve(dsk__moe_buf *b, size_t bytes) {
    if (bytes <= b->cap) return DSK_OK;
    DSK_FREE(b->p);
    b->p = DSK_MALLOC(bytes);
    b->cap = b->p ? bytes : 0;
    if (!b->p) return dsk_set_error(DSK_ERR_OOM, "dsk_moe: out of host memory for %zu bytes of workspace", bytes);
    return DSK_OK;
}
#define DSK__MOE_F(b) ((float *)(b).p)
#define DSK__MOE_I(b) ((int32_t *)(b).p)

static void dsk__moe_state_free(struct dsk__moe_state *st, dsk_ctx *ctx) {
    dsk__moe_buf *bufs[] = {&st->xf, &st->u, &st->prob, &st->gate, &st->sel, &st->slot_pos, &st->perm, &st->xs,
                            &st->ob, &st->hs1, &st->hs3, &st->as, &st->ys, &st->aux_coef, &st->xr, &st->h1,
                            &st->h3, &st->a, &st->orr, &st->rg, &st->dyf, &st->dxf, &st->du, &st->dgate, &st->dos,
                            &st->dor, &st->dh1, &st->dh3, &st->dxr, &st->dxp, &st->das, &st->dhs1, &st->dhs3, &st->wf};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) DSK_FREE(bufs[i]->p);
#ifdef DSK_CUDA
    for (int i = 0; i < DSK__MOE_NDEV; i++) if (st->dev[i].p) dsk_cuda_free(ctx, st->dev[i].p);
#endif
    (void)ctx;
    DSK_FREE(st->sel_count); DSK_FREE(st->kept_count); DSK_FREE(st->global_count); DSK_FREE(st->load_accum);
    DSK_FREE(st->send_rows); DSK_FREE(st->recv_rows); DSK_FREE(st->recv_cnt); DSK_FREE(st->local_off);
    DSK_FREE(st);
}

/* ---------------------------------------------------------------- options and init */

static dsk_status dsk__moe_resolve(dsk_moe_opts *o, int ep_size) {
    const char *fn = "dsk_moe_init";
    if (!o->name) o->name = "moe";
    if (strlen(o->name) > 64)
        return dsk_set_error(DSK_ERR_ARG, "%s: name \"%.20s...\" longer than 64 characters", fn, o->name);
    if (o->d_model <= 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": d_model %lld must be > 0", fn, o->name,
                             (long long)o->d_model);
    if (o->n_routed <= 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": n_routed %d must be > 0", fn, o->name, o->n_routed);
    if (o->top_k <= 0 || o->top_k > o->n_routed)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": top_k %d outside [1, n_routed %d]", fn, o->name, o->top_k,
                             o->n_routed);
    if (o->d_expert <= 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": d_expert %lld must be > 0", fn, o->name,
                             (long long)o->d_expert);
    if (o->n_shared < 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": n_shared %d < 0", fn, o->name, o->n_shared);
    if (o->d_shared < 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": d_shared %lld < 0", fn, o->name, (long long)o->d_shared);
    if (!o->d_shared) o->d_shared = o->d_expert;
    if (o->score != DSK_MOE_SOFTMAX && o->score != DSK_MOE_SIGMOID)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": unknown score function %d", fn, o->name, (int)o->score);
    if ((int)o->norm < 0 || (int)o->norm > 2)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": unknown norm setting %d", fn, o->name, (int)o->norm);
    if (o->norm == DSK_MOE_NORM_DEFAULT) o->norm = o->score == DSK_MOE_SIGMOID ? DSK_MOE_NORM_ON : DSK_MOE_NORM_OFF;
    if (o->routed_scale == 0.0f) o->routed_scale = 1.0f;
    if (!(o->routed_scale > 0.0f) || !isfinite(o->routed_scale))
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": routed_scale %g must be finite and > 0", fn, o->name,
                             (double)o->routed_scale);
    if (o->n_group < 0 || o->topk_group < 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": n_group %d, topk_group %d must be >= 0", fn, o->name,
                             o->n_group, o->topk_group);
    if (!o->n_group) o->n_group = 1;
    if (!o->topk_group) o->topk_group = o->n_group;
    if (o->n_routed % o->n_group)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": n_routed %d not divisible by n_group %d", fn, o->name,
                             o->n_routed, o->n_group);
    if (o->topk_group > o->n_group)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": topk_group %d > n_group %d", fn, o->name, o->topk_group,
                             o->n_group);
    if ((int)o->group_rule < 0 || (int)o->group_rule > DSK_MOE_GROUP_MEGATRON)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": unknown group rule %d", fn, o->name, (int)o->group_rule);
    if (o->group_rule == DSK_MOE_GROUP_MEGATRON && o->n_group > 1 && o->top_k < o->topk_group)
        return dsk_set_error(DSK_ERR_ARG,
                             "%s: layer \"%s\": DSK_MOE_GROUP_MEGATRON sums a group's top_k / topk_group largest "
                             "scores: top_k %d < topk_group %d sums none",
                             fn, o->name, o->top_k, o->topk_group);
    if ((int64_t)o->topk_group * (o->n_routed / o->n_group) < o->top_k)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": top_k %d > the %d experts in topk_group %d groups of %d",
                             fn, o->name, o->top_k, o->topk_group * (o->n_routed / o->n_group), o->topk_group,
                             o->n_routed / o->n_group);
    if (o->loss_count != DSK_MOE_COUNT_TOPK && o->loss_count != DSK_MOE_COUNT_SELECTED)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": unknown loss count rule %d", fn, o->name,
                             (int)o->loss_count);
    if (o->aux_alpha < 0 || o->seq_aux_alpha < 0 || o->z_beta < 0 || o->bias_rate < 0 || o->capacity_factor < 0 ||
        !isfinite(o->aux_alpha) || !isfinite(o->seq_aux_alpha) || !isfinite(o->z_beta) || !isfinite(o->bias_rate) ||
        !isfinite(o->capacity_factor))
        return dsk_set_error(DSK_ERR_ARG,
                             "%s: layer \"%s\": aux_alpha %g, seq_aux_alpha %g, z_beta %g, bias_rate %g, "
                             "capacity_factor %g must be finite and >= 0",
                             fn, o->name, (double)o->aux_alpha, (double)o->seq_aux_alpha, (double)o->z_beta,
                             (double)o->bias_rate, (double)o->capacity_factor);
    if (o->seq_len < 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": seq_len %lld < 0", fn, o->name, (long long)o->seq_len);
    if (!o->bias_rate) o->bias_rate = 1e-3f;
    if (o->drop != DSK_MOE_DROP_PROB && o->drop != DSK_MOE_DROP_POSITION)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": unknown drop policy %d", fn, o->name, (int)o->drop);
    if (o->dtype != DSK_F32 && o->dtype != DSK_BF16)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": dtype %s not supported (f32 or bf16)", fn, o->name,
                             dsk_dtype_name(o->dtype));
    if (o->init_std < 0 || !isfinite(o->init_std))
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": init_std %g must be finite and >= 0", fn, o->name,
                             (double)o->init_std);
    if (!o->init_std) o->init_std = 0.02f;
    if (o->n_routed % ep_size)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": n_routed %d not divisible by the expert-parallel size %d",
                             fn, o->name, o->n_routed, ep_size);
    return DSK_OK;
}

/* The routing configuration of resolved options. */
static dsk_moe_router dsk__moe_router_of(const dsk_moe_opts *o) {
    dsk_moe_router r;
    memset(&r, 0, sizeof r);
    r.n_experts = o->n_routed;
    r.top_k = o->top_k;
    r.score = o->score;
    r.norm = o->norm == DSK_MOE_NORM_ON;
    r.scale = o->routed_scale;
    r.n_group = o->n_group;
    r.topk_group = o->topk_group;
    r.group_rule = o->group_rule;
    return r;
}

/* Lays out one parameter: value at *poff bytes in the param slab, grad at *goff floats. */
typedef struct dsk__moe_spec {
    const char *suffix;
    dsk_dtype dt;
    int ndim;
    int64_t shape[3];
    int has_grad, sharded;
    uint64_t rng_offset; /* element offset of this rank's slice in the init stream */
} dsk__moe_spec;

static int64_t dsk__moe_numel(const dsk__moe_spec *s) {
    int64_t n = 1;
    for (int i = 0; i < s->ndim; i++) n *= s->shape[i];
    return n;
}

static dsk_status dsk__moe_alloc_params(dsk_moe *m, dsk_ctx *ctx) {
    const dsk_moe_opts *o = &m->opts;
    int64_t D = o->d_model, E = o->n_routed, F = o->d_expert, Fs = m->d_shared_total, El = m->n_local;
    /* Init streams are spaced 2^40 apart; expert slices start at their global element. */
    uint64_t big = (uint64_t)1 << 40, e0 = (uint64_t)m->expert0;
    dsk__moe_spec specs[DSK_MOE_N_PARAMS] = {
        {"router", DSK_F32, 2, {E, D, 0}, 1, 0, 0},
        {"bias", DSK_F32, 1, {E, 0, 0}, 0, 0, 0},
        {"w1", o->dtype, 3, {El, F, D}, 1, 1, 1 * big + e0 * (uint64_t)(F * D)},
        {"w2", o->dtype, 3, {El, D, F}, 1, 1, 2 * big + e0 * (uint64_t)(F * D)},
        {"w3", o->dtype, 3, {El, F, D}, 1, 1, 3 * big + e0 * (uint64_t)(F * D)},
        {"shared.w1", o->dtype, 2, {Fs, D, 0}, 1, 0, 4 * big},
        {"shared.w2", o->dtype, 2, {D, Fs, 0}, 1, 0, 5 * big},
        {"shared.w3", o->dtype, 2, {Fs, D, 0}, 1, 0, 6 * big},
    };
    /* grad order: dense (router, shared.*) first, then experts */
    static const int grad_order[DSK_MOE_N_PARAMS] = {0, 5, 6, 7, 2, 3, 4, 1};
    size_t poff[DSK_MOE_N_PARAMS], pbytes = 0;
    int64_t goff[DSK_MOE_N_PARAMS], gtot = 0;
    int n = o->n_shared > 0 ? DSK_MOE_N_PARAMS : 5;
    dsk_status s;
    int64_t one;
    for (int i = 0; i < n; i++) {
        poff[i] = pbytes;
        pbytes += ((size_t)dsk__moe_numel(&specs[i]) * dsk_dtype_size(specs[i].dt) + 255) & ~(size_t)255;
    }
    for (int j = 0; j < DSK_MOE_N_PARAMS; j++) {
        int i = grad_order[j];
        if (i >= n || !specs[i].has_grad) continue;
        goff[i] = gtot;
        gtot += dsk__moe_numel(&specs[i]);
        if (!specs[i].sharded) m->grad_dense_numel = gtot;
    }
    m->grad_expert_numel = gtot - m->grad_dense_numel;
    one = (int64_t)pbytes;
    DSK__TRY(dsk_tensor_alloc_on(ctx, m->device, &m->param_slab, DSK_U8, 1, &one));
    DSK__TRY(dsk_tensor_alloc_on(ctx, m->device, &m->grad_slab, DSK_F32, 1, &gtot));
    for (int i = 0; i < n; i++) {
        dsk_moe_param *p = &m->params[i];
        snprintf(p->name, sizeof p->name, "%s.%s", o->name, specs[i].suffix);
        DSK__TRY(dsk_tensor_wrap(&p->value, (char *)m->param_slab.data + poff[i], specs[i].dt, m->device, specs[i].ndim,
                                 specs[i].shape));
        if (specs[i].has_grad) {
            DSK__TRY(dsk_tensor_wrap(&p->grad, (float *)m->grad_slab.data + goff[i], DSK_F32, m->device, specs[i].ndim,
                                     specs[i].shape));
        } else {
            memset(&p->grad, 0, sizeof p->grad);
            p->grad.device = m->device;
            p->grad.dtype = DSK_F32;
            p->grad.ndim = 1; /* shape [0] */
        }
        p->expert_sharded = specs[i].sharded;
        if (i == 1) s = dsk_tensor_fill(ctx, &p->value, 0.0);
        else s = dsk_tensor_normal(ctx, &p->value, o->seed, specs[i].rng_offset, 0.0f, o->init_std);
        if (s != DSK_OK) return s;
    }
    m->n_params = n;
    m->router = &m->params[0]; m->bias = &m->params[1];
    m->w1 = &m->params[2]; m->w2 = &m->params[3]; m->w3 = &m->params[4];
    m->sw1 = n > 5 ? &m->params[5] : NULL;
    m->sw2 = n > 5 ? &m->params[6] : NULL;
    m->sw3 = n > 5 ? &m->params[7] : NULL;
    return dsk_tensor_fill(ctx, &m->grad_slab, 0.0);
}

static dsk_status dsk__moe_alloc_state(dsk_moe *m) {
    struct dsk__moe_state *st;
    int64_t E = m->opts.n_routed, P = m->ep_size;
    m->st = st = (struct dsk__moe_state *)DSK_MALLOC(sizeof *st);
    if (!st) return dsk_set_error(DSK_ERR_OOM, "dsk_moe_init: out of host memory");
    memset(st, 0, sizeof *st);
    st->sel_count = (int64_t *)DSK_MALLOC((size_t)E * sizeof(int64_t));
    st->kept_count = (int64_t *)DSK_MALLOC((size_t)E * sizeof(int64_t));
    st->global_count = (int64_t *)DSK_MALLOC((size_t)E * sizeof(int64_t));
    st->load_accum = (int64_t *)DSK_MALLOC((size_t)E * sizeof(int64_t));
    st->send_rows = (int64_t *)DSK_MALLOC((size_t)P * sizeof(int64_t));
    st->recv_rows = (int64_t *)DSK_MALLOC((size_t)P * sizeof(int64_t));
    st->recv_cnt = (int64_t *)DSK_MALLOC((size_t)(P * m->n_local) * sizeof(int64_t));
    st->local_off = (int64_t *)DSK_MALLOC((size_t)(m->n_local + 1) * sizeof(int64_t));
    if (!st->sel_count || !st->kept_count || !st->global_count || !st->load_accum || !st->send_rows || !st->recv_rows ||
        !st->recv_cnt || !st->local_off)
        return dsk_set_error(DSK_ERR_OOM, "dsk_moe_init: out of host memory");
    memset(st->load_accum, 0, (size_t)E * sizeof(int64_t));
    memset(st->global_count, 0, (size_t)E * sizeof(int64_t));
    return DSK_OK;
}

DSK_API dsk_status dsk_moe_init(dsk_moe *m, dsk_ctx *ctx, const dsk_moe_opts *opts) {
    dsk_status s;
    if (!m) return dsk_set_error(DSK_ERR_ARG, "dsk_moe_init: layer is NULL");
    memset(m, 0, sizeof *m);
    if (!opts) return dsk_set_error(DSK_ERR_ARG, "dsk_moe_init: opts is NULL");
    m->opts = *opts;
    m->ep_size = 1;
    if (opts->ep) {
        if (opts->ep->world_size < 1 || !opts->ep->impl)
            return dsk_set_error(DSK_ERR_ARG, "dsk_moe_init: expert-parallel communicator is not initialised");
        m->ep_rank = opts->ep->rank;
        m->ep_size = opts->ep->world_size;
    }
    s = dsk__moe_resolve(&m->opts, m->ep_size);
    if (s != DSK_OK) {
        memset(m, 0, sizeof *m);
        return s;
    }
    m->routing = dsk__moe_router_of(&m->opts);
    m->d_shared_total = (int64_t)m->opts.n_shared * m->opts.d_shared;
    m->n_local = m->opts.n_routed / m->ep_size;
    m->expert0 = m->ep_rank * m->n_local;
    m->device = ctx ? ctx->device : dsk_cpu();
    if (opts->ep && m->ep_size > 1 && (m->device.type == DSK_DEV_CUDA) != (opts->ep->backend == DSK_COMM_NCCL)) {
        memset(m, 0, sizeof *m);
        return dsk_set_error(
            DSK_ERR_UNSUPPORTED,
            "dsk_moe_init: layer \"%s\": a %s layer needs an expert-parallel communicator on the %s backend",
            opts->name ? opts->name : "moe", ctx && ctx->device.type == DSK_DEV_CUDA ? "CUDA" : "CPU",
            ctx && ctx->device.type == DSK_DEV_CUDA ? "nccl" : "host");
    }
#ifndef DSK_CUDA
    if (m->device.type != DSK_DEV_CPU) {
        memset(m, 0, sizeof *m);
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "dsk_moe_init: CUDA context in a build without DSK_CUDA");
    }
#endif
    s = dsk__moe_alloc_params(m, ctx);
    if (s == DSK_OK) s = dsk__moe_alloc_state(m);
    if (s != DSK_OK) { /* free what was made, keep the first error's message */
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", dsk_last_error());
        dsk_moe_free(m, ctx);
        return dsk_set_error(s, "%s", msg);
    }
    m->st->n_threads = ctx && ctx->n_threads > 0 ? ctx->n_threads : 0;
    return DSK_OK;
}

DSK_API void dsk_moe_free(dsk_moe *m, dsk_ctx *ctx) {
    if (!m) return;
    if (m->st) dsk__moe_state_free(m->st, ctx);
    dsk_tensor_free(ctx, &m->param_slab);
    dsk_tensor_free(ctx, &m->grad_slab);
    memset(m, 0, sizeof *m);
}

DSK_API dsk_moe_param *dsk_moe_find_param(dsk_moe *m, const char *name) {
    if (!m || !name) return NULL;
    for (int i = 0; i < m->n_params; i++)
        if (!strcmp(m->params[i].name, name)) return &m->params[i];
    return NULL;
}

DSK_API dsk_status dsk_moe_zero_grad(dsk_moe *m, dsk_ctx *ctx) {
    if (!m || !m->st) return dsk_set_error(DSK_ERR_STATE, "dsk_moe_zero_grad: layer not initialised");
    return dsk_tensor_fill(ctx, &m->grad_slab, 0.0);
}

/* ---------------------------------------------------------------- CPU building blocks */

/* nt: GEMM threads (0 = OpenMP's default; 1 inside the per-expert parallel loops). */
static void dsk__moe_gemm(int nt, int ta, int tb, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                          const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    if (M == 0 || N == 0) return;
    dsk_sgemm_cpu(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc, nt);
}

/* rows (n, D) of a tensor in f32 or bf16 -> f32 */
static void dsk__moe_to_f32(float *dst, const void *src, dsk_dtype dt, int64_t n) {
    if (dt == DSK_F32) { memcpy(dst, src, (size_t)n * sizeof(float)); return; }
    for (int64_t i = 0; i < n; i++) dst[i] = dsk_load_f32(src, dt, i);
}

/* Per-expert f32 weight pointers: the parameters themselves (f32) or converted copies (bf16). */
typedef struct dsk__moe_w { const float *w1, *w2, *w3, *sw1, *sw2, *sw3; } dsk__moe_w;

static dsk_status dsk__moe_weights_f32(dsk_moe *m, dsk__moe_w *w) {
    struct dsk__moe_state *st = m->st;
    dsk_moe_param *ps[6] = {m->w1, m->w2, m->w3, m->sw1, m->sw2, m->sw3};
    const float **out[6] = {&w->w1, &w->w2, &w->w3, &w->sw1, &w->sw2, &w->sw3};
    int64_t tot = 0, off = 0;
    memset(w, 0, sizeof *w);
    for (int i = 0; i < 6; i++) if (ps[i]) tot += dsk_tensor_numel(&ps[i]->value);
    if (m->opts.dtype == DSK_F32) {
        for (int i = 0; i < 6; i++) if (ps[i]) *out[i] = (const float *)ps[i]->value.data;
        return DSK_OK;
    }
    DSK__TRY(dsk__moe_reserve(&st->wf, (size_t)tot * sizeof(float)));
    for (int i = 0; i < 6; i++) {
        if (!ps[i]) continue;
        dsk__moe_to_f32(DSK__MOE_F(st->wf) + off, ps[i]->value.data, DSK_BF16, dsk_tensor_numel(&ps[i]->value));
        *out[i] = DSK__MOE_F(st->wf) + off;
        off += dsk_tensor_numel(&ps[i]->value);
    }
    return DSK_OK;
}

/* SwiGLU forward on n rows: h1 = x W1^T, h3 = x W3^T (n, F); a = silu(h1) h3; out = a W2^T (n, D). */
static void dsk__moe_swiglu_fwd(int nt, int64_t n, int64_t D, int64_t F, const float *x, const float *w1,
                                const float *w2, const float *w3, float *h1, float *h3, float *a, float *out) {
    if (n == 0) return;
    dsk__moe_gemm(nt, 0, 1, n, F, D, x, D, w1, D, 0.0f, h1, F);
    dsk__moe_gemm(nt, 0, 1, n, F, D, x, D, w3, D, 0.0f, h3, F);
    dsk_swiglu_cpu(n * F, h1, h3, a);
    dsk__moe_gemm(nt, 0, 1, n, D, F, a, F, w2, F, 0.0f, out, D);
}

/* SwiGLU backward on n rows: dx (n, D) = (written), dW1, dW3 (F, D), dW2 (D, F) += . */
static void dsk__moe_swiglu_bwd(int nt, int64_t n, int64_t D, int64_t F, const float *x, const float *w1,
                                const float *w2, const float *w3, const float *h1, const float *h3, const float *a,
                                const float *dout, float *dh1, float *dh3, float *dx, float *dw1, float *dw2,
                                float *dw3) {
    if (n == 0) return;
    dsk__moe_gemm(nt, 0, 0, n, F, D, dout, D, w2, F, 0.0f, dh1, F); /* da, in dh1 */
    dsk__moe_gemm(nt, 1, 0, D, F, n, dout, D, a, F, 1.0f, dw2, F);
    dsk_swiglu_grad_cpu(n * F, h1, h3, dh1, dh1, dh3);
    dsk__moe_gemm(nt, 0, 0, n, D, F, dh1, F, w1, D, 0.0f, dx, D);
    dsk__moe_gemm(nt, 0, 0, n, D, F, dh3, F, w3, D, 1.0f, dx, D);
    dsk__moe_gemm(nt, 1, 0, F, D, n, dh1, F, x, D, 1.0f, dw1, D);
    dsk__moe_gemm(nt, 1, 0, F, D, n, dh3, F, x, D, 1.0f, dw3, D);
}

/* ---------------------------------------------------------------- routing, losses, capacity */

static dsk_status dsk__moe_route(dsk_moe *m, int64_t T) {
    struct dsk__moe_state *st = m->st;
    const dsk_moe_opts *o = &m->opts;
    int E = o->n_routed, K = o->top_k;
    const float *bias = (const float *)m->bias->value.data;
    float *u = DSK__MOE_F(st->u), *prob = DSK__MOE_F(st->prob), *gate = DSK__MOE_F(st->gate);
    int32_t *sel = DSK__MOE_I(st->sel);
    float *scratch = DSK__MOE_F(st->du); /* (T, E + n_group), free during forward */
    dsk__moe_gemm(st->n_threads, 0, 1, T, E, o->d_model, DSK__MOE_F(st->xf), o->d_model,
                  (const float *)m->router->value.data, o->d_model, 0.0f, u, E);
    DSK__MOE_OMP(omp parallel for schedule(static))
    for (int64_t t = 0; t < T; t++)
        dsk_moe_route_token(&m->routing, u + t * E, bias, prob + t * E, scratch + t * (E + o->n_group), sel + t * K,
                            gate + t * K);
    memset(st->sel_count, 0, (size_t)E * sizeof(int64_t));
    for (int64_t i = 0; i < T * K; i++) st->sel_count[sel[i]]++;
    return DSK_OK;
}

/* Finds the tokens routing marked non-finite (their gates are NaN; finite routing never gives
   a NaN gate): st->n_bad and st->first_bad. */
static void dsk__moe_find_nonfinite(dsk_moe *m, int64_t T) {
    struct dsk__moe_state *st = m->st;
    const float *gate = DSK__MOE_F(st->gate);
    int K = m->opts.top_k;
    st->n_bad = 0;
    st->first_bad = -1;
    for (int64_t t = 0; t < T; t++)
        if (gate[t * K] != gate[t * K]) {
            if (!st->n_bad++) st->first_bad = t;
        }
}

/* After a successful forward: its selections count toward the next bias update. */
static void dsk__moe_count_loads(dsk_moe *m) {
    if (m->eval) return;
    for (int e = 0; e < m->opts.n_routed; e++) m->st->load_accum[e] += m->st->sel_count[e];
}

/* p' row of token t: p for softmax, s / sum s for sigmoid (into out, E). */
static void dsk__moe_prob_norm(const dsk_moe *m, const float *prob, double *out) {
    int E = m->opts.n_routed;
    double tot = 0;
    for (int j = 0; j < E; j++) tot += prob[j];
    for (int j = 0; j < E; j++) out[j] = m->opts.score == DSK_MOE_SIGMOID ? prob[j] / tot : prob[j];
}

/* cnt (E) += token t's count vector for the balancing losses: its K selections, or (the
   published rule) the K experts with the largest unbiased scores over all E, ties to the lower
   index, whatever the bias and the group limit chose. */
static void dsk__moe_loss_count(const dsk_moe *m, int64_t t, double *cnt) {
    const struct dsk__moe_state *st = m->st;
    int E = m->opts.n_routed, K = m->opts.top_k, pi = -1;
    const float *p = DSK__MOE_F(st->prob) + t * E;
    float pv = INFINITY;
    if (m->opts.loss_count == DSK_MOE_COUNT_SELECTED) {
        for (int k = 0; k < K; k++) cnt[DSK__MOE_I(st->sel)[t * K + k]] += 1.0;
        return;
    }
    for (int k = 0; k < K; k++) { /* pass k: the largest (value, index) ranked after pass k-1's */
        int best = -1;
        for (int j = 0; j < E; j++)
            if ((p[j] < pv || (p[j] == pv && j > pi)) && (best < 0 || p[j] > p[best])) best = j;
        cnt[best] += 1.0;
        pv = p[best];
        pi = best;
    }
}

/* Loss values and the per-expert d loss / d p' coefficients (aux_coef: (n_seq, E), row q for
   tokens of sequence q; Switch and sequence-wise parts summed). Only the sequence-wise loss has
   sequences (the forward checked that T is a multiple of seq_len); otherwise the whole call is
   one row, whatever seq_len says. */
static dsk_status dsk__moe_losses(dsk_moe *m, int64_t T, dsk_moe_stats *stats) {
    struct dsk__moe_state *st = m->st;
    const dsk_moe_opts *o = &m->opts;
    int E = o->n_routed, K = o->top_k;
    int64_t L = o->seq_aux_alpha > 0 && o->seq_len ? o->seq_len : (T > 0 ? T : 1), nseq = T / L > 0 ? T / L : 1;
    const float *prob = DSK__MOE_F(st->prob), *u = DSK__MOE_F(st->u);
    double *P, *pn, *cnt;
    float *coef;
    st->n_seq = nseq;
    st->seq_len = L;
    DSK__TRY(dsk__moe_reserve(&st->aux_coef, (size_t)(nseq * E) * sizeof(float)));
    coef = DSK__MOE_F(st->aux_coef);
    memset(coef, 0, (size_t)(nseq * E) * sizeof(float));
    if (T == 0) return DSK_OK; /* no tokens: every loss term is 0 */
    P = (double *)DSK_MALLOC((size_t)(3 * E) * sizeof(double));
    if (!P) return dsk_set_error(DSK_ERR_OOM, "dsk_moe_forward: out of host memory");
    pn = P + E; cnt = P + 2 * E;
    if (o->aux_alpha > 0) { /* Switch: alpha E sum f_i P_i */
        double loss = 0;
        memset(P, 0, (size_t)E * sizeof(double));
        memset(cnt, 0, (size_t)E * sizeof(double));
        for (int64_t t = 0; t < T; t++) {
            dsk__moe_prob_norm(m, prob + t * E, pn);
            for (int j = 0; j < E; j++) P[j] += pn[j] / (double)T;
            dsk__moe_loss_count(m, t, cnt);
        }
        for (int j = 0; j < E; j++) {
            double f = cnt[j] / (double)(T * K);
            loss += f * P[j];
            for (int64_t q = 0; q < nseq; q++) coef[q * E + j] += (float)(o->aux_alpha * E * f / (double)T);
        }
        stats->aux_loss = o->aux_alpha * E * loss;
    }
    if (o->seq_aux_alpha > 0) { /* per sequence: alpha sum_i (E/(K L)) cnt_i * (1/L) sum_t p'_ti, averaged */
        double total = 0;
        for (int64_t q = 0; q < nseq; q++) {
            double loss = 0;
            memset(P, 0, (size_t)E * sizeof(double));
            memset(cnt, 0, (size_t)E * sizeof(double));
            for (int64_t t = q * L; t < (q + 1) * L; t++) {
                dsk__moe_prob_norm(m, prob + t * E, pn);
                for (int j = 0; j < E; j++) P[j] += pn[j] / (double)L;
                dsk__moe_loss_count(m, t, cnt);
            }
            for (int j = 0; j < E; j++) {
                double f = (double)E / (double)(K * L) * cnt[j];
                loss += f * P[j];
                coef[q * E + j] += (float)(o->seq_aux_alpha * f / (double)L / (double)nseq);
            }
            total += o->seq_aux_alpha * loss;
        }
        stats->seq_aux_loss = total / (double)nseq;
    }
    if (o->z_beta > 0) {
        double z = 0;
        for (int64_t t = 0; t < T; t++) {
            double l = dsk_moe_logsumexp(u + t * E, E);
            z += l * l;
        }
        stats->z_loss = o->z_beta * z / (double)T;
    }
    DSK_FREE(P);
    stats->loss = stats->aux_loss + stats->seq_aux_loss + stats->z_loss;
    return DSK_OK;
}

typedef struct dsk__moe_cand { float g; int32_t i; } dsk__moe_cand;
/* By weight (descending), then position; a NaN weight (a non-finite token, which fails the
   call later) ranks last so the order stays total. */
static int dsk__moe_cand_cmp(const void *pa, const void *pb) {
    const dsk__moe_cand *a = (const dsk__moe_cand *)pa, *b = (const dsk__moe_cand *)pb;
    float ga = a->g == a->g ? a->g : -INFINITY, gb = b->g == b->g ? b->g : -INFINITY;
    if (ga != gb) return ga > gb ? -1 : 1;
    return a->i < b->i ? -1 : a->i > b->i;
}

/* Stable counting sort of the (token, slot) pairs by expert, applying capacity: perm (n_kept)
   flat slot indices, slot_pos (T*K) position in perm or -1 when dropped, kept_count (E). */
static dsk_status dsk__moe_dispatch_plan(dsk_moe *m, int64_t T, int64_t *dropped) {
    struct dsk__moe_state *st = m->st;
    const dsk_moe_opts *o = &m->opts;
    int E = o->n_routed, K = o->top_k;
    int64_t N = T * K, cap = INT64_MAX, pos = 0;
    const int32_t *sel = DSK__MOE_I(st->sel);
    const float *gate = DSK__MOE_F(st->gate);
    int32_t *perm = DSK__MOE_I(st->perm), *slot_pos = DSK__MOE_I(st->slot_pos);
    int64_t *off = st->kept_count; /* first: start offsets of each expert in the full sort */
    if (o->capacity_factor > 0) cap = (int64_t)ceil((double)N / E * o->capacity_factor);
    memset(off, 0, (size_t)E * sizeof(int64_t));
    for (int64_t i = 0; i < N; i++) off[sel[i]]++;
    for (int e = 0; e < E; e++) { int64_t c = off[e]; off[e] = pos; pos += c; }
    for (int64_t i = 0; i < N; i++) slot_pos[i] = (int32_t)(off[sel[i]]++); /* full sort positions, off -> ends */
    for (int64_t i = 0; i < N; i++) perm[slot_pos[i]] = (int32_t)i;
    /* capacity: per expert, keep the first `cap` by position or the `cap` largest weights */
    *dropped = 0;
    pos = 0;
    {
        int64_t start = 0;
        dsk__moe_cand *cand = NULL;
        if (o->drop == DSK_MOE_DROP_PROB && cap < N) {
            cand = (dsk__moe_cand *)DSK_MALLOC((size_t)N * sizeof *cand);
            if (!cand) return dsk_set_error(DSK_ERR_OOM, "dsk_moe_forward: out of host memory");
        }
        for (int e = 0; e < E; e++) {
            int64_t end = off[e], n = end - start, keep = n < cap ? n : cap;
            if (keep < n && cand) { /* sort by weight (desc), then position; keep the best, in position order */
                for (int64_t j = 0; j < n; j++) { cand[j].i = perm[start + j]; cand[j].g = gate[perm[start + j]]; }
                qsort(cand, (size_t)n, sizeof *cand, dsk__moe_cand_cmp);
                for (int64_t j = 0; j < n; j++) slot_pos[cand[j].i] = j < keep ? 0 : -1;
                for (int64_t j = start; j < end; j++) {
                    int32_t i = perm[j];
                    if (slot_pos[i] == 0) { slot_pos[i] = (int32_t)pos; perm[pos++] = i; }
                }
            } else {
                for (int64_t j = start; j < end; j++) {
                    int32_t i = perm[j];
                    if (j - start < keep) { slot_pos[i] = (int32_t)pos; perm[pos++] = i; }
                    else slot_pos[i] = -1;
                }
            }
            *dropped += n - keep;
            off[e] = keep; /* kept_count */
            start = end;
        }
        DSK_FREE(cand);
    }
    st->n_kept = pos;
    return DSK_OK;
}

/* ---------------------------------------------------------------- expert-parallel exchange */

#ifdef DSK_CUDA
static dsk_status dsk__moe_dev(dsk_moe *m, dsk_ctx *ctx, int id, size_t bytes, void **p);
#endif

/* Small int64 collectives on host arrays: all-to-all of n per rank (all_to_all = 1) or an
   in-place sum of n. The nccl backend of a CUDA layer needs device memory: staged through it. */
static dsk_status dsk__moe_host_i64(dsk_moe *m, dsk_ctx *ctx, dsk_comm *c, int all_to_all, const int64_t *send,
                                    int64_t *recv, int64_t n) {
    dsk_status s;
#ifdef DSK_CUDA
    if (m->device.type == DSK_DEV_CUDA && c->backend == DSK_COMM_NCCL) {
        int64_t total = all_to_all ? n * c->world_size : n;
        size_t bytes = (size_t)total * sizeof(int64_t);
        void *d;
        DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_COMM, 2 * bytes, &d));
        DSK__TRY(dsk_cuda_memcpy(ctx, d, send, bytes, 1));
        DSK__TRY(all_to_all ? dsk_comm_all_to_all(c, ctx, d, (char *)d + bytes, n, DSK_I64)
                            : dsk_comm_all_reduce(c, ctx, d, (char *)d + bytes, n, DSK_I64, DSK_COMM_SUM));
        DSK__TRY(dsk_cuda_memcpy(ctx, recv, (char *)d + bytes, bytes, 0));
        return dsk_cuda_sync(ctx);
    }
#endif
    if (c->backend != DSK_COMM_HOST)
        return dsk_set_error(DSK_ERR_UNSUPPORTED,
                             "dsk_moe: layer \"%s\" is on the CPU: its communicators must use the host backend",
                             m->opts.name);
    s = all_to_all ? dsk_comm_all_to_all(c, ctx, send, recv, n, DSK_I64)
                   : dsk_comm_all_reduce(c, ctx, send, recv, n, DSK_I64, DSK_COMM_SUM);
    return s;
}

/* All-to-all-v of `width`-element rows over the EP group: rows_to[r] rows go to rank r in
   rank order from `send`, rows_from[r] arrive from rank r into `recv` in rank order. */
static dsk_status dsk__moe_exchange(dsk_moe *m, dsk_ctx *ctx, const void *send, const int64_t *rows_to, void *recv,
                                    const int64_t *rows_from, int64_t width, dsk_dtype dt) {
    int P = m->ep_size;
    int64_t *cnt, so = 0, ro = 0;
    dsk_status s;
    if (P == 1) {
        memcpy(recv, send, (size_t)(rows_to[0] * width) * dsk_dtype_size(dt));
        return DSK_OK;
    }
    cnt = (int64_t *)DSK_MALLOC((size_t)(4 * P) * sizeof(int64_t));
    if (!cnt) return dsk_set_error(DSK_ERR_OOM, "dsk_moe: out of host memory");
    for (int r = 0; r < P; r++) {
        cnt[r] = rows_to[r] * width; cnt[P + r] = so; so += cnt[r];
        cnt[2 * P + r] = rows_from[r] * width; cnt[3 * P + r] = ro; ro += cnt[2 * P + r];
    }
    s = dsk_comm_all_to_all_v(m->opts.ep, ctx, send, cnt, cnt + P, recv, cnt + 2 * P, cnt + 3 * P, dt);
    DSK_FREE(cnt);
    return s;
}

/* Counts first: every rank learns how many rows each peer sends for each of its experts
   (recv_cnt (P, n_local)), and the EP-group totals of the statistics. Non-finite tokens on any
   rank fail the call on every rank here, after the collectives, so the group stays in step. */
static dsk_status dsk__moe_exchange_counts(dsk_moe *m, dsk_ctx *ctx, int64_t T, int64_t dropped, dsk_moe_stats *stats) {
    struct dsk__moe_state *st = m->st;
    int P = m->ep_size, El = m->n_local, E = m->opts.n_routed;
    int64_t *tot;
    dsk_status s = DSK_OK;
    for (int r = 0; r < P; r++) {
        st->send_rows[r] = 0;
        for (int e = r * El; e < (r + 1) * El; e++) st->send_rows[r] += st->kept_count[e];
    }
    tot = (int64_t *)DSK_MALLOC((size_t)(E + 3) * sizeof(int64_t));
    if (!tot) return dsk_set_error(DSK_ERR_OOM, "dsk_moe: out of host memory");
    if (P == 1) memcpy(st->recv_cnt, st->kept_count, (size_t)E * sizeof(int64_t));
    else if ((s = dsk__moe_host_i64(m, ctx, m->opts.ep, 1, st->kept_count, st->recv_cnt, El)) != DSK_OK) goto done;
    memcpy(tot, st->sel_count, (size_t)E * sizeof(int64_t));
    tot[E] = dropped;
    tot[E + 1] = T;
    tot[E + 2] = st->n_bad;
    if (P > 1 && (s = dsk__moe_host_i64(m, ctx, m->opts.ep, 0, tot, tot, E + 3)) != DSK_OK) goto done;
    if (st->n_bad > 0) {
        s = dsk_set_error(
            DSK_ERR_NONFINITE,
            "dsk_moe_forward: layer \"%s\": token %lld of %lld has a NaN or Inf router logit or "
            "selection score (from x, the router weights or the expert bias), %lld such tokens; nothing was "
            "computed",
            m->opts.name, (long long)st->first_bad, (long long)T, (long long)st->n_bad);
        goto done;
    }
    if (tot[E + 2] > 0) {
        s = dsk_set_error(DSK_ERR_NONFINITE, "dsk_moe_forward: layer \"%s\": %lld tokens on other ranks of the "
                          "expert-parallel group have NaN or Inf router logits; nothing was computed", m->opts.name,
                          (long long)tot[E + 2]);
        goto done;
    }
    memcpy(st->global_count, tot, (size_t)E * sizeof(int64_t));
    stats->tokens = tot[E + 1];
    stats->dropped = tot[E];
    stats->slots = tot[E + 1] * m->opts.top_k;
    stats->tokens_per_expert = st->global_count;
    stats->max_load = 0;
    for (int e = 0; e < E; e++) stats->max_load = (double)tot[e] > stats->max_load ? (double)tot[e] : stats->max_load;
    stats->mean_load = (double)stats->slots / E;
    /* regrouped layout: local expert e, then source rank r */
    st->R = 0;
    for (int r = 0; r < P; r++) {
        st->recv_rows[r] = 0;
        for (int e = 0; e < El; e++) st->recv_rows[r] += st->recv_cnt[r * El + e];
        st->R += st->recv_rows[r];
    }
    st->local_off[0] = 0;
    for (int e = 0; e < El; e++) {
        st->local_off[e + 1] = st->local_off[e];
        for (int r = 0; r < P; r++) st->local_off[e + 1] += st->recv_cnt[r * El + e];
    }
done:
    DSK_FREE(tot);
    return s;
}

/* rg (R): regrouped row q (expert-major) -> row in the received (rank-major) buffer. */
static dsk_status dsk__moe_regroup_index(dsk_moe *m) {
    struct dsk__moe_state *st = m->st;
    int P = m->ep_size, El = m->n_local;
    int64_t src = 0;
    int32_t *rg;
    DSK__TRY(dsk__moe_reserve(&st->rg, (size_t)(st->R + 1) * sizeof(int32_t)));
    rg = DSK__MOE_I(st->rg);
    for (int r = 0; r < P; r++) {
        for (int e = 0; e < El; e++) {
            int64_t before = 0; /* rows of expert e from ranks < r */
            for (int r2 = 0; r2 < r; r2++) before += st->recv_cnt[r2 * El + e];
            for (int64_t j = 0; j < st->recv_cnt[r * El + e]; j++)
                rg[st->local_off[e] + before + j] = (int32_t)(src + j);
            src += st->recv_cnt[r * El + e];
        }
    }
    return DSK_OK;
}

/* dst[q] = src[rg[q]] (to_expert_major) or dst[rg[q]] = src[q] (back), rows of D floats. */
static void dsk__moe_regroup(const dsk_moe *m, float *dst, const float *src, int to_expert_major) {
    const struct dsk__moe_state *st = m->st;
    const int32_t *rg = DSK__MOE_I(st->rg);
    int64_t D = m->opts.d_model;
    DSK__MOE_OMP(omp parallel for schedule(static))
    for (int64_t q = 0; q < st->R; q++) {
        if (to_expert_major) memcpy(dst + q * D, src + (int64_t)rg[q] * D, (size_t)D * sizeof(float));
        else memcpy(dst + (int64_t)rg[q] * D, src + q * D, (size_t)D * sizeof(float));
    }
}

/* Sends rows (n_kept, D) in perm order to their experts' ranks; regrouped into dst (R, D). */
static dsk_status dsk__moe_to_experts(dsk_moe *m, dsk_ctx *ctx, const float *rows, float *tmp, float *dst) {
    struct dsk__moe_state *st = m->st;
    if (m->ep_size == 1) { memcpy(dst, rows, (size_t)(st->R * m->opts.d_model) * sizeof(float)); return DSK_OK; }
    DSK__TRY(dsk__moe_exchange(m, ctx, rows, st->send_rows, tmp, st->recv_rows, m->opts.d_model, DSK_F32));
    dsk__moe_regroup(m, dst, tmp, 1);
    return DSK_OK;
}

/* The reverse: rows (R, D) expert-major back to their tokens' ranks, into dst (n_kept, D) in perm order. */
static dsk_status dsk__moe_from_experts(dsk_moe *m, dsk_ctx *ctx, const float *rows, float *tmp, float *dst) {
    struct dsk__moe_state *st = m->st;
    if (m->ep_size == 1) { memcpy(dst, rows, (size_t)(st->R * m->opts.d_model) * sizeof(float)); return DSK_OK; }
    dsk__moe_regroup(m, tmp, rows, 0);
    return dsk__moe_exchange(m, ctx, tmp, st->recv_rows, dst, st->send_rows, m->opts.d_model, DSK_F32);
}

/* ---------------------------------------------------------------- forward and backward (CPU) */

static dsk_status dsk__moe_check_io(const dsk_moe *m, const char *fn, const char *what, const dsk_tensor *t,
                                    int64_t T) {
    char b[96];
    if (!t) return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": %s is NULL", fn, m->opts.name, what);
    if (t->ndim != 2 || t->shape[1] != m->opts.d_model || t->dtype != m->opts.dtype || (T >= 0 && t->shape[0] != T))
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": %s is %s, want [%lld,%lld] %s", fn, m->opts.name, what,
                             dsk_tensor_describe(t, b, sizeof b), T >= 0 ? (long long)T : (long long)t->shape[0],
                             (long long)m->opts.d_model, dsk_dtype_name(m->opts.dtype));
    if (t->device.type != m->device.type || t->device.index != m->device.index)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": %s is on %s, the layer on %s", fn, m->opts.name, what,
                             t->device.type == DSK_DEV_CUDA ? "CUDA" : "the CPU",
                             m->device.type == DSK_DEV_CUDA ? "CUDA" : "the CPU");
    if (!dsk_tensor_is_contiguous(t) || (!t->data && t->shape[0] > 0))
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": %s must be contiguous with data", fn, m->opts.name, what);
    return DSK_OK;
}

static dsk_status dsk__moe_reserve_T(dsk_moe *m, int64_t T) {
    struct dsk__moe_state *st = m->st;
    int64_t D = m->opts.d_model, E = m->opts.n_routed, K = m->opts.top_k, Fs = m->d_shared_total;
    size_t f = sizeof(float), T1 = (size_t)(T > 0 ? T : 1);
    DSK__TRY(dsk__moe_reserve(&st->xf, T1 * D * f));
    DSK__TRY(dsk__moe_reserve(&st->u, T1 * E * f));
    DSK__TRY(dsk__moe_reserve(&st->prob, T1 * E * f));
    DSK__TRY(dsk__moe_reserve(&st->gate, T1 * K * f));
    DSK__TRY(dsk__moe_reserve(&st->sel, T1 * K * 4));
    DSK__TRY(dsk__moe_reserve(&st->slot_pos, T1 * K * 4));
    DSK__TRY(dsk__moe_reserve(&st->perm, T1 * K * 4));
    DSK__TRY(dsk__moe_reserve(&st->xs, T1 * K * D * f));
    DSK__TRY(dsk__moe_reserve(&st->du, T1 * (size_t)(E + m->opts.n_group) * f));
    DSK__TRY(dsk__moe_reserve(&st->ob, T1 * K * D * f));
    DSK__TRY(dsk__moe_reserve(&st->ys, T1 * D * f));
    if (Fs > 0) DSK__TRY(dsk__moe_reserve(&st->hs1, T1 * Fs * f));
    if (Fs > 0) DSK__TRY(dsk__moe_reserve(&st->hs3, T1 * Fs * f));
    if (Fs > 0) DSK__TRY(dsk__moe_reserve(&st->as, T1 * Fs * f));
    return DSK_OK;
}

static dsk_status dsk__moe_reserve_R(dsk_moe *m) {
    struct dsk__moe_state *st = m->st;
    size_t R1 = (size_t)(st->R > 0 ? st->R : 1), D = (size_t)m->opts.d_model, F = (size_t)m->opts.d_expert,
           f = sizeof(float);
    DSK__TRY(dsk__moe_reserve(&st->xr, R1 * D * f));
    DSK__TRY(dsk__moe_reserve(&st->h1, R1 * F * f));
    DSK__TRY(dsk__moe_reserve(&st->h3, R1 * F * f));
    DSK__TRY(dsk__moe_reserve(&st->a, R1 * F * f));
    DSK__TRY(dsk__moe_reserve(&st->orr, R1 * D * f));
    DSK__TRY(dsk__moe_reserve(&st->dxr, R1 * D * f));
    return DSK_OK;
}

/* Writes a (T, D) f32 result into y (opts.dtype); accumulate: y += r. */
static void dsk__moe_store(const dsk_moe *m, dsk_tensor *y, const float *r, int64_t n, int accumulate) {
    if (m->opts.dtype == DSK_F32) {
        float *p = (float *)y->data;
        if (accumulate) for (int64_t i = 0; i < n; i++) p[i] += r[i];
        else memcpy(p, r, (size_t)n * sizeof(float));
    } else {
        for (int64_t i = 0; i < n; i++)
            dsk_store_f32(y->data, y->dtype, i, (accumulate ? dsk_load_f32(y->data, y->dtype, i) : 0.0f) + r[i]);
    }
}

static dsk_status dsk__moe_forward_cpu(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x, int64_t T,
                                       dsk_moe_stats *stats) {
    struct dsk__moe_state *st = m->st;
    const dsk_moe_opts *o = &m->opts;
    int64_t D = o->d_model, F = o->d_expert, K = o->top_k, Fs = m->d_shared_total, dropped = 0;
    dsk__moe_w w;
    float *xf, *xs, *ob, *ys;
    const float *gate;
    const int32_t *perm, *slot_pos;
    DSK__TRY(dsk__moe_reserve_T(m, T));
    xf = DSK__MOE_F(st->xf); xs = DSK__MOE_F(st->xs); ob = DSK__MOE_F(st->ob); ys = DSK__MOE_F(st->ys);
    dsk__moe_to_f32(xf, x->data, o->dtype, T * D);
    DSK__TRY(dsk__moe_weights_f32(m, &w));
    DSK__TRY(dsk__moe_route(m, T));
    dsk__moe_find_nonfinite(m, T);
    if (!st->n_bad) DSK__TRY(dsk__moe_losses(m, T, stats));
    DSK__TRY(dsk__moe_dispatch_plan(m, T, &dropped));
    perm = DSK__MOE_I(st->perm); slot_pos = DSK__MOE_I(st->slot_pos); gate = DSK__MOE_F(st->gate);
    DSK__MOE_OMP(omp parallel for schedule(static))
    for (int64_t p = 0; p < st->n_kept; p++) memcpy(xs + p * D, xf + (perm[p] / K) * D, (size_t)D * sizeof(float));
    DSK__TRY(dsk__moe_exchange_counts(m, ctx, T, dropped, stats));
    dsk__moe_count_loads(m);
    DSK__TRY(dsk__moe_reserve_R(m));
    DSK__TRY(dsk__moe_regroup_index(m));
    DSK__TRY(dsk__moe_to_experts(m, ctx, xs, DSK__MOE_F(st->orr), DSK__MOE_F(st->xr)));
    /* experts in parallel, one thread each (many small GEMMs scale better this way); each
       expert's rows and results are its own, so the order of the threads does not matter */
    DSK__MOE_OMP(omp parallel for schedule(dynamic, 1) if (m->n_local > 1))
    for (int e = 0; e < m->n_local; e++) {
        int64_t r0 = st->local_off[e], n = st->local_off[e + 1] - r0;
        dsk__moe_swiglu_fwd(m->n_local > 1 ? 1 : st->n_threads, n, D, F, DSK__MOE_F(st->xr) + r0 * D, w.w1 + e * F * D,
                            w.w2 + e * D * F, w.w3 + e * F * D, DSK__MOE_F(st->h1) + r0 * F,
                            DSK__MOE_F(st->h3) + r0 * F, DSK__MOE_F(st->a) + r0 * F, DSK__MOE_F(st->orr) + r0 * D);
    }
    DSK__TRY(dsk__moe_from_experts(m, ctx, DSK__MOE_F(st->orr), DSK__MOE_F(st->dxr), ob));
    if (Fs > 0)
        dsk__moe_swiglu_fwd(st->n_threads, T, D, Fs, xf, w.sw1, w.sw2, w.sw3, DSK__MOE_F(st->hs1), DSK__MOE_F(st->hs3),
                            DSK__MOE_F(st->as), ys);
    /* combine: slots in slot order, then the shared experts */
    DSK__MOE_OMP(omp parallel for schedule(static))
    for (int64_t t = 0; t < T; t++) {
        float *out = xs + t * D; /* xs is free now; reuse it for the f32 result */
        for (int64_t d = 0; d < D; d++) out[d] = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            int32_t p = slot_pos[t * K + k];
            float g = gate[t * K + k];
            if (p < 0) continue;
            for (int64_t d = 0; d < D; d++) out[d] += g * ob[(int64_t)p * D + d];
        }
        if (Fs > 0) for (int64_t d = 0; d < D; d++) out[d] += ys[t * D + d];
    }
    dsk__moe_store(m, y, xs, T * D, 0);
    st->T = T;
    st->have_fwd = 1;
    return DSK_OK;
}

static dsk_status dsk__moe_reserve_bwd(dsk_moe *m) {
    struct dsk__moe_state *st = m->st;
    size_t f = sizeof(float), T1 = (size_t)(st->T > 0 ? st->T : 1), R1 = (size_t)(st->R > 0 ? st->R : 1);
    size_t D = (size_t)m->opts.d_model, F = (size_t)m->opts.d_expert, E = (size_t)m->opts.n_routed,
           K = (size_t)m->opts.top_k;
    size_t Fs = (size_t)m->d_shared_total;
    DSK__TRY(dsk__moe_reserve(&st->dyf, T1 * D * f));
    DSK__TRY(dsk__moe_reserve(&st->dxf, T1 * D * f));
    DSK__TRY(dsk__moe_reserve(&st->du, T1 * E * f));
    DSK__TRY(dsk__moe_reserve(&st->dgate, T1 * K * f));
    DSK__TRY(dsk__moe_reserve(&st->dos, T1 * K * D * f));
    DSK__TRY(dsk__moe_reserve(&st->dor, R1 * D * f));
    DSK__TRY(dsk__moe_reserve(&st->dh1, R1 * F * f));
    DSK__TRY(dsk__moe_reserve(&st->dh3, R1 * F * f));
    DSK__TRY(dsk__moe_reserve(&st->dxp, T1 * K * D * f));
    if (Fs > 0) DSK__TRY(dsk__moe_reserve(&st->dhs1, T1 * Fs * f));
    if (Fs > 0) DSK__TRY(dsk__moe_reserve(&st->dhs3, T1 * Fs * f));
    return DSK_OK;
}

static dsk_status dsk__moe_backward_cpu(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *dy,
                                        float aux_scale) {
    struct dsk__moe_state *st = m->st;
    const dsk_moe_opts *o = &m->opts;
    int64_t T = st->T, D = o->d_model, F = o->d_expert, K = o->top_k, E = o->n_routed, Fs = m->d_shared_total;
    float zcoef = T > 0 ? o->z_beta * 2.0f / (float)T * aux_scale : 0.0f;
    int has_aux = o->aux_alpha > 0 || o->seq_aux_alpha > 0;
    dsk__moe_w w;
    float *dyf, *dxf, *ob, *dos, *dgate, *du, *dxp;
    const float *gate;
    const int32_t *perm, *slot_pos, *sel;
    DSK__TRY(dsk__moe_reserve_bwd(m));
    DSK__TRY(dsk__moe_weights_f32(m, &w));
    dyf = DSK__MOE_F(st->dyf); dxf = DSK__MOE_F(st->dxf); ob = DSK__MOE_F(st->ob); dos = DSK__MOE_F(st->dos);
    dgate = DSK__MOE_F(st->dgate); du = DSK__MOE_F(st->du); dxp = DSK__MOE_F(st->dxp);
    gate = DSK__MOE_F(st->gate);
    perm = DSK__MOE_I(st->perm);
    slot_pos = DSK__MOE_I(st->slot_pos);
    sel = DSK__MOE_I(st->sel);
    dsk__moe_to_f32(dyf, dy->data, o->dtype, T * D);
    /* shared experts: dxf written here (or zeroed) */
    if (Fs > 0)
        dsk__moe_swiglu_bwd(st->n_threads, T, D, Fs, DSK__MOE_F(st->xf), w.sw1, w.sw2, w.sw3, DSK__MOE_F(st->hs1),
                            DSK__MOE_F(st->hs3), DSK__MOE_F(st->as), dyf, DSK__MOE_F(st->dhs1), DSK__MOE_F(st->dhs3),
                            dxf, (float *)m->sw1->grad.data, (float *)m->sw2->grad.data, (float *)m->sw3->grad.data);
    else
        memset(dxf, 0, (size_t)(T * D) * sizeof(float));
    /* d gate = dy . o (kept slots), rows sent back to the experts: g * dy */
    DSK__MOE_OMP(omp parallel for schedule(static))
    for (int64_t i = 0; i < T * K; i++) {
        int32_t p = slot_pos[i];
        double acc = 0;
        if (p >= 0)
            for (int64_t d = 0; d < D; d++) acc += (double)dyf[(i / K) * D + d] * ob[(int64_t)p * D + d];
        dgate[i] = (float)acc;
    }
    DSK__MOE_OMP(omp parallel for schedule(static))
    for (int64_t p = 0; p < st->n_kept; p++) {
        int64_t i = perm[p];
        float g = gate[i];
        for (int64_t d = 0; d < D; d++) dos[p * D + d] = g * dyf[(i / K) * D + d];
    }
    DSK__TRY(dsk__moe_to_experts(m, ctx, dos, DSK__MOE_F(st->dxr), DSK__MOE_F(st->dor)));
    DSK__MOE_OMP(omp parallel for schedule(dynamic, 1) if (m->n_local > 1))
    for (int e = 0; e < m->n_local; e++) {
        int64_t r0 = st->local_off[e], n = st->local_off[e + 1] - r0;
        dsk__moe_swiglu_bwd(m->n_local > 1 ? 1 : st->n_threads, n, D, F, DSK__MOE_F(st->xr) + r0 * D, w.w1 + e * F * D,
                            w.w2 + e * D * F, w.w3 + e * F * D, DSK__MOE_F(st->h1) + r0 * F,
                            DSK__MOE_F(st->h3) + r0 * F, DSK__MOE_F(st->a) + r0 * F, DSK__MOE_F(st->dor) + r0 * D,
                            DSK__MOE_F(st->dh1) + r0 * F, DSK__MOE_F(st->dh3) + r0 * F, DSK__MOE_F(st->dxr) + r0 * D,
                            (float *)m->w1->grad.data + e * F * D, (float *)m->w2->grad.data + e * D * F,
                            (float *)m->w3->grad.data + e * F * D);
    }
    /* dxr -> back to the tokens' ranks (dor is free now as the staging buffer) */
    DSK__TRY(dsk__moe_from_experts(m, ctx, DSK__MOE_F(st->dxr), DSK__MOE_F(st->dor), dxp));
    /* router: du (T, E) per token, then dx += du W_r, dW_r += du^T x */
    DSK__MOE_OMP(omp parallel for schedule(static))
    for (int64_t t = 0; t < T; t++) {
        const float *aux = has_aux ? DSK__MOE_F(st->aux_coef) + (t / st->seq_len) * E : NULL;
        dsk_moe_route_token_backward(&m->routing, DSK__MOE_F(st->u) + t * E, DSK__MOE_F(st->prob) + t * E, sel + t * K,
                                     dgate + t * K, aux, aux_scale, zcoef, du + t * E);
        /* routed contributions to dx in slot order */
        for (int64_t k = 0; k < K; k++) {
            int32_t p = slot_pos[t * K + k];
            if (p < 0) continue;
            for (int64_t d = 0; d < D; d++) dxf[t * D + d] += dxp[(int64_t)p * D + d];
        }
    }
    dsk__moe_gemm(st->n_threads, 0, 0, T, D, E, du, E, (const float *)m->router->value.data, D, 1.0f, dxf, D);
    dsk__moe_gemm(st->n_threads, 1, 0, E, D, T, du, E, DSK__MOE_F(st->xf), D, 1.0f, (float *)m->router->grad.data, D);
    dsk__moe_store(m, dx, dxf, T * D, 1);
    return DSK_OK;
}

/* ---------------------------------------------------------------- CUDA path */
#ifdef DSK_CUDA

static dsk_status dsk__moe_dev(dsk_moe *m, dsk_ctx *ctx, int id, size_t bytes, void **p) {
    dsk__moe_buf *b = &m->st->dev[id];
    if (bytes == 0) bytes = 1;
    if (bytes > b->cap) {
        if (b->p) dsk_cuda_free(ctx, b->p);
        b->p = NULL;
        b->cap = 0;
        DSK__TRY(dsk_cuda_malloc(ctx, bytes, &b->p));
        b->cap = bytes;
    }
    *p = b->p;
    return DSK_OK;
}

/* Device <-> device copy (with a cast when the dtypes differ) of n elements. */
static dsk_status dsk__moe_dcopy(dsk_ctx *ctx, dsk_device dev, void *dst, dsk_dtype ddt, const void *src, dsk_dtype sdt,
                                 int64_t n) {
    dsk_tensor a, b;
    if (n == 0) return DSK_OK;
    DSK__TRY(dsk_tensor_wrap(&a, dst, ddt, dev, 1, &n));
    DSK__TRY(dsk_tensor_wrap(&b, (void *)src, sdt, dev, 1, &n));
    return dsk_tensor_copy(ctx, &a, &b);
}

static dsk_status dsk__moe_dzero(dsk_ctx *ctx, dsk_device dev, float *p, int64_t n) {
    dsk_tensor a;
    if (n == 0) return DSK_OK;
    DSK__TRY(dsk_tensor_wrap(&a, p, DSK_F32, dev, 1, &n));
    return dsk_tensor_fill(ctx, &a, 0.0);
}

/* Expert parallelism on the device: regroup indices (rg: expert-major row -> received row, and
   its inverse) uploaded once per forward. */
static dsk_status dsk__moe_cuda_ep_index(dsk_moe *m, dsk_ctx *ctx) {
    struct dsk__moe_state *st = m->st;
    int32_t *rg, *rgi;
    void *drg, *drgi;
    DSK__TRY(dsk__moe_regroup_index(m));
    DSK__TRY(dsk__moe_reserve(&st->dxr, (size_t)(st->R + 1) * sizeof(int32_t))); /* host scratch */
    rg = DSK__MOE_I(st->rg);
    rgi = DSK__MOE_I(st->dxr);
    for (int64_t q = 0; q < st->R; q++) rgi[rg[q]] = (int32_t)q;
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_RG, (size_t)(st->R + 1) * 4, &drg));
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_RGI, (size_t)(st->R + 1) * 4, &drgi));
    DSK__TRY(dsk_cuda_memcpy(ctx, drg, rg, (size_t)st->R * 4, 1));
    DSK__TRY(dsk_cuda_memcpy(ctx, drgi, rgi, (size_t)st->R * 4, 1));
    return dsk_cuda_sync(ctx); /* the host index buffers are reused */
}

/* rows (n_kept, D) in perm order, dtype dt -> all-to-all-v -> regrouped expert-major dst (R, D). */
static dsk_status dsk__moe_cuda_to_experts(dsk_moe *m, dsk_ctx *ctx, const void *rows, void *dst, dsk_dtype dt) {
    struct dsk__moe_state *st = m->st;
    void *rt;
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_RT, (size_t)(st->R * m->opts.d_model) * dsk_dtype_size(dt), &rt));
    DSK__TRY(dsk__moe_exchange(m, ctx, rows, st->send_rows, rt, st->recv_rows, m->opts.d_model, dt));
    return dsk_cuda_moe_gather(ctx, dst, rt, dt, (const int32_t *)st->dev[DSK__MOE_D_RG].p, 1, NULL, st->R,
                               m->opts.d_model);
}

/* f32 rows (R, D) expert-major -> rank-major -> all-to-all-v back -> dst (n_kept, D) in perm order. */
static dsk_status dsk__moe_cuda_from_experts(dsk_moe *m, dsk_ctx *ctx, const void *rows, void *dst) {
    struct dsk__moe_state *st = m->st;
    void *rt;
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_RTMP, (size_t)(st->R * m->opts.d_model) * sizeof(float), &rt));
    DSK__TRY(dsk_cuda_moe_gather(ctx, rt, rows, DSK_F32, (const int32_t *)st->dev[DSK__MOE_D_RGI].p, 1, NULL, st->R,
                                 m->opts.d_model));
    return dsk__moe_exchange(m, ctx, rt, st->recv_rows, dst, st->send_rows, m->opts.d_model, DSK_F32);
}

/* The CUDA forward keeps its activations on the device; routing decisions come back to the
   host once per call (the dispatch plan, capacity and the losses run there, as on the CPU),
   which also gives the per-expert row counts the expert GEMMs need. */
static dsk_status dsk__moe_forward_cuda(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x, int64_t T,
                                        dsk_moe_stats *stats) {
    struct dsk__moe_state *st = m->st;
    const dsk_moe_opts *o = &m->opts;
    int64_t D = o->d_model, F = o->d_expert, E = o->n_routed, K = o->top_k, G = o->n_group, Fs = m->d_shared_total,
            dropped = 0;
    dsk_dtype cd = o->dtype;
    size_t es = dsk_dtype_size(cd), f4 = sizeof(float);
    int need_losses = o->aux_alpha > 0 || o->seq_aux_alpha > 0 || o->z_beta > 0;
    void *xc, *xf, *u, *prob, *scr, *sel, *gate, *cnt, *perm, *pos, *xs, *xr, *h1, *h3, *a, *orr, *ob,
        *hs1 = NULL, *hs3 = NULL, *as = NULL, *ys = NULL;
    int P = m->ep_size;
    int32_t *hcnt;
    const char *w1 = (const char *)m->w1->value.data, *w2 = (const char *)m->w2->value.data,
               *w3 = (const char *)m->w3->value.data;
    if (!ctx || ctx->device.type != DSK_DEV_CUDA)
        return dsk_set_error(DSK_ERR_ARG, "dsk_moe_forward: layer \"%s\" is on CUDA: pass its CUDA ctx", o->name);
    DSK__TRY(dsk__moe_reserve_T(m, T));
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_XC, (size_t)(T * D) * es, &xc));
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_XF, (size_t)(T * D) * f4, &xf));
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_U, (size_t)(T * E) * f4, &u));
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_PROB, (size_t)(T * E) * f4, &prob));
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_SCR, (size_t)(T * (E + G)) * f4, &scr));
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_SEL, (size_t)(T * K) * 4, &sel));
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_GATE, (size_t)(T * K) * f4, &gate));
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_CNT, (size_t)E * 4, &cnt));
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_PERM, (size_t)(T * K) * 4, &perm));
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_POS, (size_t)(T * K) * 4, &pos));
    DSK__TRY(dsk__moe_dcopy(ctx, m->device, xc, cd, x->data, cd, T * D));
    DSK__TRY(dsk__moe_dcopy(ctx, m->device, xf, DSK_F32, x->data, cd, T * D));
    DSK__TRY(dsk_cuda_moe_gemm(ctx, 0, 1, T, E, D, xf, D, m->router->value.data, D, DSK_F32, 0.0f, u, E, DSK_F32));
    DSK__TRY(dsk_cuda_moe_route(ctx, &m->routing, (const float *)u, (const float *)m->bias->value.data, T,
                                (float *)prob, (float *)scr, (int32_t *)sel, (float *)gate, (int32_t *)cnt));
    /* routing decisions to the host */
    hcnt = (int32_t *)st->du.p; /* host scratch of (T, E + n_group) floats, unused by the CUDA forward */
    DSK__TRY(dsk_cuda_memcpy(ctx, st->sel.p, sel, (size_t)(T * K) * 4, 0));
    DSK__TRY(dsk_cuda_memcpy(ctx, st->gate.p, gate, (size_t)(T * K) * f4, 0));
    DSK__TRY(dsk_cuda_memcpy(ctx, hcnt, cnt, (size_t)E * 4, 0));
    if (need_losses) DSK__TRY(dsk_cuda_memcpy(ctx, st->u.p, u, (size_t)(T * E) * f4, 0));
    if (need_losses) DSK__TRY(dsk_cuda_memcpy(ctx, st->prob.p, prob, (size_t)(T * E) * f4, 0));
    DSK__TRY(dsk_cuda_sync(ctx));
    for (int64_t e = 0; e < E; e++) st->sel_count[e] = hcnt[e];
    dsk__moe_find_nonfinite(m, T);
    if (need_losses && !st->n_bad) DSK__TRY(dsk__moe_losses(m, T, stats));
    if (!need_losses) { st->n_seq = 1; st->seq_len = T > 0 ? T : 1; }
    DSK__TRY(dsk__moe_dispatch_plan(m, T, &dropped));
    DSK__TRY(dsk__moe_exchange_counts(m, ctx, T, dropped, stats));
    dsk__moe_count_loads(m);
    DSK__TRY(dsk_cuda_memcpy(ctx, perm, st->perm.p, (size_t)(st->n_kept > 0 ? st->n_kept : 0) * 4, 1));
    DSK__TRY(dsk_cuda_memcpy(ctx, pos, st->slot_pos.p, (size_t)(T * K) * 4, 1));
    if (need_losses && (o->aux_alpha > 0 || o->seq_aux_alpha > 0)) {
        void *aux;
        DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_AUX, (size_t)(st->n_seq * E) * f4, &aux));
        DSK__TRY(dsk_cuda_memcpy(ctx, aux, st->aux_coef.p, (size_t)(st->n_seq * E) * f4, 1));
    }
    /* experts: rows in expert order (one rank: perm order) */
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_XS, (size_t)(st->n_kept * D) * es, &xs));
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_H1, (size_t)(st->R * F) * f4, &h1));
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_H3, (size_t)(st->R * F) * f4, &h3));
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_A, (size_t)(st->R * F) * es, &a));
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_O, (size_t)(st->R * D) * f4, &orr));
    DSK__TRY(dsk_cuda_moe_gather(ctx, xs, xc, cd, (const int32_t *)perm, (int)K, NULL, st->n_kept, D));
    xr = xs; /* one rank: the rows are already in expert order */
    ob = orr;
    if (P > 1) {
        DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_XR, (size_t)(st->R * D) * es, &xr));
        DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_OB, (size_t)(st->n_kept * D) * f4, &ob));
        DSK__TRY(dsk__moe_cuda_ep_index(m, ctx));
        DSK__TRY(dsk__moe_cuda_to_experts(m, ctx, xs, xr, cd));
    }
    for (int e = 0; e < m->n_local; e++) {
        int64_t r0 = st->local_off[e], n = st->local_off[e + 1] - r0;
        const char *xe = (const char *)xr + (size_t)(r0 * D) * es;
        DSK__TRY(dsk_cuda_moe_gemm(ctx, 0, 1, n, F, D, xe, D, w1 + (size_t)(e * F * D) * es, D, cd, 0.0f,
                                   (float *)h1 + r0 * F, F, DSK_F32));
        DSK__TRY(dsk_cuda_moe_gemm(ctx, 0, 1, n, F, D, xe, D, w3 + (size_t)(e * F * D) * es, D, cd, 0.0f,
                                   (float *)h3 + r0 * F, F, DSK_F32));
    }
    DSK__TRY(dsk_cuda_moe_swiglu(ctx, a, cd, (const float *)h1, (const float *)h3, st->R * F));
    for (int e = 0; e < m->n_local; e++) {
        int64_t r0 = st->local_off[e], n = st->local_off[e + 1] - r0;
        DSK__TRY(dsk_cuda_moe_gemm(ctx, 0, 1, n, D, F, (const char *)a + (size_t)(r0 * F) * es, F,
                                   w2 + (size_t)(e * D * F) * es, F, cd, 0.0f, (float *)orr + r0 * D, D, DSK_F32));
    }
    if (P > 1) DSK__TRY(dsk__moe_cuda_from_experts(m, ctx, orr, ob));
    if (Fs > 0) {
        DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_HS1, (size_t)(T * Fs) * f4, &hs1));
        DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_HS3, (size_t)(T * Fs) * f4, &hs3));
        DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_AS, (size_t)(T * Fs) * es, &as));
        DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_YS, (size_t)(T * D) * f4, &ys));
        DSK__TRY(dsk_cuda_moe_gemm(ctx, 0, 1, T, Fs, D, xc, D, m->sw1->value.data, D, cd, 0.0f, hs1, Fs, DSK_F32));
        DSK__TRY(dsk_cuda_moe_gemm(ctx, 0, 1, T, Fs, D, xc, D, m->sw3->value.data, D, cd, 0.0f, hs3, Fs, DSK_F32));
        DSK__TRY(dsk_cuda_moe_swiglu(ctx, as, cd, (const float *)hs1, (const float *)hs3, T * Fs));
        DSK__TRY(dsk_cuda_moe_gemm(ctx, 0, 1, T, D, Fs, as, Fs, m->sw2->value.data, Fs, cd, 0.0f, ys, D, DSK_F32));
    }
    DSK__TRY(dsk_cuda_moe_combine(ctx, y->data, cd, (const float *)ob, (const int32_t *)pos, (const float *)gate,
                                  (const float *)ys, T, (int)K, D));
    st->T = T;
    st->have_fwd = 1;
    return DSK_OK;
}

static dsk_status dsk__moe_backward_cuda(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *dy,
                                         float aux_scale) {
    struct dsk__moe_state *st = m->st;
    const dsk_moe_opts *o = &m->opts;
    int64_t T = st->T, D = o->d_model, F = o->d_expert, E = o->n_routed, K = o->top_k, Fs = m->d_shared_total,
            R = st->R;
    dsk_dtype cd = o->dtype;
    size_t es = dsk_dtype_size(cd), f4 = sizeof(float);
    void *dxf, *dgate, *dos, *da, *dh1, *dh3, *dxr, *du;
    const char *w1 = (const char *)m->w1->value.data, *w2 = (const char *)m->w2->value.data,
               *w3 = (const char *)m->w3->value.data;
    float *g1 = (float *)m->w1->grad.data, *g2 = (float *)m->w2->grad.data, *g3 = (float *)m->w3->grad.data;
    int P = m->ep_size;
    const void *xr = st->dev[P > 1 ? DSK__MOE_D_XR : DSK__MOE_D_XS].p, *a = st->dev[DSK__MOE_D_A].p,
               *ob = st->dev[P > 1 ? DSK__MOE_D_OB : DSK__MOE_D_O].p;
    void *dor, *dxp;
    const float *h1 = (const float *)st->dev[DSK__MOE_D_H1].p, *h3 = (const float *)st->dev[DSK__MOE_D_H3].p;
    const int32_t *perm = (const int32_t *)st->dev[DSK__MOE_D_PERM].p,
                  *pos = (const int32_t *)st->dev[DSK__MOE_D_POS].p;
    const float *gate = (const float *)st->dev[DSK__MOE_D_GATE].p;
    const float *aux = (o->aux_alpha > 0 || o->seq_aux_alpha > 0) ? (const float *)st->dev[DSK__MOE_D_AUX].p : NULL;
    float zcoef = T > 0 ? o->z_beta * 2.0f / (float)T * aux_scale : 0.0f;
    if (!ctx || ctx->device.type != DSK_DEV_CUDA)
        return dsk_set_error(DSK_ERR_ARG, "dsk_moe_backward: layer \"%s\" is on CUDA: pass its CUDA ctx", o->name);
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_DXF, (size_t)(T * D) * f4, &dxf));
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_DGATE, (size_t)(T * K) * f4, &dgate));
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_DOS, (size_t)(st->n_kept * D) * es, &dos));
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_DA, (size_t)(R * F) * f4, &da));
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_DH1, (size_t)(R * F) * es, &dh1));
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_DH3, (size_t)(R * F) * es, &dh3));
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_DXR, (size_t)(R * D) * f4, &dxr));
    DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_DU, (size_t)(T * E) * f4, &du));
    /* shared experts write dxf (or it starts at zero) */
    if (Fs > 0) {
        void *das, *dhs1, *dhs3;
        const void *xc = st->dev[DSK__MOE_D_XC].p, *as = st->dev[DSK__MOE_D_AS].p;
        DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_DAS, (size_t)(T * Fs) * f4, &das));
        DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_DHS1, (size_t)(T * Fs) * es, &dhs1));
        DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_DHS3, (size_t)(T * Fs) * es, &dhs3));
        DSK__TRY(dsk_cuda_moe_gemm(ctx, 0, 0, T, Fs, D, dy->data, D, m->sw2->value.data, Fs, cd, 0.0f, das, Fs,
                                   DSK_F32));
        DSK__TRY(dsk_cuda_moe_gemm(ctx, 1, 0, D, Fs, T, dy->data, D, as, Fs, cd, 1.0f, m->sw2->grad.data, Fs, DSK_F32));
        DSK__TRY(dsk_cuda_moe_swiglu_backward(ctx, dhs1, dhs3, cd, (const float *)st->dev[DSK__MOE_D_HS1].p,
                                              (const float *)st->dev[DSK__MOE_D_HS3].p, (const float *)das, T * Fs));
        DSK__TRY(dsk_cuda_moe_gemm(ctx, 0, 0, T, D, Fs, dhs1, Fs, m->sw1->value.data, D, cd, 0.0f, dxf, D, DSK_F32));
        DSK__TRY(dsk_cuda_moe_gemm(ctx, 0, 0, T, D, Fs, dhs3, Fs, m->sw3->value.data, D, cd, 1.0f, dxf, D, DSK_F32));
        DSK__TRY(dsk_cuda_moe_gemm(ctx, 1, 0, Fs, D, T, dhs1, Fs, xc, D, cd, 1.0f, m->sw1->grad.data, D, DSK_F32));
        DSK__TRY(dsk_cuda_moe_gemm(ctx, 1, 0, Fs, D, T, dhs3, Fs, xc, D, cd, 1.0f, m->sw3->grad.data, D, DSK_F32));
    } else {
        DSK__TRY(dsk__moe_dzero(ctx, m->device, (float *)dxf, T * D));
    }
    /* routed experts */
    DSK__TRY(dsk_cuda_moe_dgate(ctx, (float *)dgate, dy->data, cd, (const float *)ob, pos, T, (int)K, D));
    DSK__TRY(dsk_cuda_moe_gather(ctx, dos, dy->data, cd, perm, (int)K, gate, st->n_kept, D));
    dor = dos;
    dxp = dxr;
    if (P > 1) DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_DOR, (size_t)(R * D) * es, &dor));
    if (P > 1) DSK__TRY(dsk__moe_dev(m, ctx, DSK__MOE_D_DXP, (size_t)(st->n_kept * D) * f4, &dxp));
    if (P > 1) DSK__TRY(dsk__moe_cuda_to_experts(m, ctx, dos, dor, cd));
    for (int e = 0; e < m->n_local; e++) {
        int64_t r0 = st->local_off[e], n = st->local_off[e + 1] - r0;
        const char *de = (const char *)dor + (size_t)(r0 * D) * es;
        DSK__TRY(dsk_cuda_moe_gemm(ctx, 0, 0, n, F, D, de, D, w2 + (size_t)(e * D * F) * es, F, cd, 0.0f,
                                   (float *)da + r0 * F, F, DSK_F32));
        DSK__TRY(dsk_cuda_moe_gemm(ctx, 1, 0, D, F, n, de, D, (const char *)a + (size_t)(r0 * F) * es, F, cd, 1.0f,
                                   g2 + e * D * F, F, DSK_F32));
    }
    DSK__TRY(dsk_cuda_moe_swiglu_backward(ctx, dh1, dh3, cd, h1, h3, (const float *)da, R * F));
    for (int e = 0; e < m->n_local; e++) {
        int64_t r0 = st->local_off[e], n = st->local_off[e + 1] - r0;
        const char *d1 = (const char *)dh1 + (size_t)(r0 * F) * es, *d3 = (const char *)dh3 + (size_t)(r0 * F) * es;
        const char *xe = (const char *)xr + (size_t)(r0 * D) * es;
        DSK__TRY(dsk_cuda_moe_gemm(ctx, 0, 0, n, D, F, d1, F, w1 + (size_t)(e * F * D) * es, D, cd, 0.0f,
                                   (float *)dxr + r0 * D, D, DSK_F32));
        DSK__TRY(dsk_cuda_moe_gemm(ctx, 0, 0, n, D, F, d3, F, w3 + (size_t)(e * F * D) * es, D, cd, 1.0f,
                                   (float *)dxr + r0 * D, D, DSK_F32));
        DSK__TRY(dsk_cuda_moe_gemm(ctx, 1, 0, F, D, n, d1, F, xe, D, cd, 1.0f, g1 + e * F * D, D, DSK_F32));
        DSK__TRY(dsk_cuda_moe_gemm(ctx, 1, 0, F, D, n, d3, F, xe, D, cd, 1.0f, g3 + e * F * D, D, DSK_F32));
    }
    if (P > 1) DSK__TRY(dsk__moe_cuda_from_experts(m, ctx, dxr, dxp));
    DSK__TRY(dsk_cuda_moe_scatter(ctx, (float *)dxf, (const float *)dxp, pos, T, (int)K, D));
    /* router */
    DSK__TRY(dsk_cuda_moe_route_backward(ctx, &m->routing, (const float *)st->dev[DSK__MOE_D_U].p,
                                         (const float *)st->dev[DSK__MOE_D_PROB].p, T,
                                         (const int32_t *)st->dev[DSK__MOE_D_SEL].p, (const float *)dgate, aux,
                                         st->seq_len, aux_scale, zcoef, (float *)du));
    DSK__TRY(dsk_cuda_moe_gemm(ctx, 0, 0, T, D, E, du, E, m->router->value.data, D, DSK_F32, 1.0f, dxf, D, DSK_F32));
    DSK__TRY(dsk_cuda_moe_gemm(ctx, 1, 0, E, D, T, du, E, st->dev[DSK__MOE_D_XF].p, D, DSK_F32, 1.0f,
                               m->router->grad.data, D, DSK_F32));
    return dsk_cuda_moe_accumulate(ctx, dx->data, cd, (const float *)dxf, T * D);
}
#endif /* DSK_CUDA */

/* ---------------------------------------------------------------- public entry points */

DSK_API dsk_status dsk_moe_forward(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x, dsk_moe_stats *stats) {
    const char *fn = "dsk_moe_forward";
    dsk_moe_stats local;
    int64_t T;
    dsk_status s;
    if (!m || !m->st) return dsk_set_error(DSK_ERR_STATE, "%s: layer not initialised", fn);
    DSK__TRY(dsk__moe_check_io(m, fn, "x", x, -1));
    T = x->shape[0];
    DSK__TRY(dsk__moe_check_io(m, fn, "y", y, T));
    if (m->opts.seq_aux_alpha > 0 && m->opts.seq_len > 0 && T % m->opts.seq_len)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": %lld tokens are not whole sequences of seq_len %lld", fn,
                             m->opts.name, (long long)T, (long long)m->opts.seq_len);
    if (!stats) stats = &local;
    memset(stats, 0, sizeof *stats);
    m->st->have_fwd = 0;
#ifdef DSK_CUDA
    if (m->device.type == DSK_DEV_CUDA) s = dsk__moe_forward_cuda(m, ctx, y, x, T, stats);
    else s = dsk__moe_forward_cpu(m, ctx, y, x, T, stats);
#else
    s = dsk__moe_forward_cpu(m, ctx, y, x, T, stats);
#endif
    if (s != DSK_OK) memset(stats, 0, sizeof *stats);
    return s;
}

DSK_API dsk_status dsk_moe_backward(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *dy, float aux_scale) {
    const char *fn = "dsk_moe_backward";
    if (!m || !m->st) return dsk_set_error(DSK_ERR_STATE, "%s: layer not initialised", fn);
    if (!m->st->have_fwd)
        return dsk_set_error(DSK_ERR_STATE, "%s: layer \"%s\": no forward to differentiate", fn, m->opts.name);
    DSK__TRY(dsk__moe_check_io(m, fn, "dy", dy, m->st->T));
    DSK__TRY(dsk__moe_check_io(m, fn, "dx", dx, m->st->T));
    if (!isfinite(aux_scale))
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": aux_scale %g is not finite", fn, m->opts.name,
                             (double)aux_scale);
#ifdef DSK_CUDA
    if (m->device.type == DSK_DEV_CUDA) return dsk__moe_backward_cuda(m, ctx, dx, dy, aux_scale);
#endif
    return dsk__moe_backward_cpu(m, ctx, dx, dy, aux_scale);
}

DSK_API dsk_status dsk_moe_update_bias(dsk_moe *m, dsk_ctx *ctx, dsk_comm *comm) {
    struct dsk__moe_state *st;
    int E;
    float *b;
    double mean = 0, bmean = 0;
    dsk_status s = DSK_OK;
    if (!m || !m->st) return dsk_set_error(DSK_ERR_STATE, "dsk_moe_update_bias: layer not initialised");
    st = m->st;
    E = m->opts.n_routed;
    if (comm && comm->world_size > 1) DSK__TRY(dsk__moe_host_i64(m, ctx, comm, 0, st->load_accum, st->load_accum, E));
    b = (float *)DSK_MALLOC((size_t)E * sizeof(float));
    if (!b) return dsk_set_error(DSK_ERR_OOM, "dsk_moe_update_bias: out of host memory");
    if (m->device.type == DSK_DEV_CPU) memcpy(b, m->bias->value.data, (size_t)E * sizeof(float));
#ifdef DSK_CUDA
    else {
        s = dsk_cuda_memcpy(ctx, b, m->bias->value.data, (size_t)E * sizeof(float), 0);
        if (s == DSK_OK) s = dsk_cuda_sync(ctx);
        if (s != DSK_OK) goto done;
    }
#endif
    for (int e = 0; e < E; e++) mean += (double)st->load_accum[e] / E;
    for (int e = 0; e < E; e++) {
        double l = (double)st->load_accum[e];
        b[e] += m->opts.bias_rate * (float)((mean > l) - (mean < l));
    }
    if (m->opts.bias_recenter) {
        for (int e = 0; e < E; e++) bmean += b[e];
        bmean /= E;
        for (int e = 0; e < E; e++) b[e] -= (float)bmean;
    }
    memset(st->load_accum, 0, (size_t)E * sizeof(int64_t));
    if (m->device.type == DSK_DEV_CPU) memcpy(m->bias->value.data, b, (size_t)E * sizeof(float));
#ifdef DSK_CUDA
    else if ((s = dsk_cuda_memcpy(ctx, m->bias->value.data, b, (size_t)E * sizeof(float), 1)) == DSK_OK)
        s = dsk_cuda_sync(ctx);
done:
#endif
    DSK_FREE(b);
    return s;
}

#endif /* DSK_MOE_IMPLEMENTATION_DONE */
#endif /* DSK_MOE_IMPLEMENTATION */

/* MIT License. Copyright (c) 2026 the dsk authors. Permission is hereby granted, free of
   charge, to any person obtaining a copy of this software, to deal in the software without
   restriction, subject to including this notice. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT
   WARRANTY OF ANY KIND. */
