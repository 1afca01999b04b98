/* train_model.h - the model of examples/train_moe.c: a DeepSeek-style decoder-only MoE
   transformer, forward and backward, built from dsk_tensor.h ops and dsk_moe.h layers.

     ids (B, T) -> embedding -> L blocks -> RMSNorm -> LM head -> logits (B*T, V)
     block: x2 = x + Wo attn(rope(Wq h1), rope(Wk h1), Wv h1),  h1 = RMSNorm(x)
            y  = x2 + FFN(h2),                                   h2 = RMSNorm(x2)
     FFN: dense SwiGLU W2 (silu(W1 h) * W3 h) in the first `n_dense` blocks, dsk_moe after.

   Parameters live in slabs (llm.c style): one f32 slab each for master weights, gradients
   and the two AdamW moments, plus a compute-dtype copy when that is not f32; every
   parameter is a view into them, the MoE layers' too: a layer reports its parameters
   (dsk_moe_init) and the model binds views of these slabs into it (dsk_moe_bind), so every
   parameter takes the same buckets, optimizer and checkpoint path. The slabs hold the
   replicated parameters first (the model's and the MoE routers and shared experts, in the
   order backward finishes them in reverse), then the expert-sharded ones (every MoE layer's
   w1, w2, w3), whose gradients reduce over the ranks holding the same experts. Activations
   are kept per block for backward; backward accumulates into the gradient slab (+=). */
#ifndef TRAIN_MODEL_H
#define TRAIN_MODEL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../dsk_moe.h"
#include "../dsk_tensor.h"
#define TM_TRY(call) do { dsk_status tm_s_ = (call); if (tm_s_ != DSK_OK) return tm_s_; } while (0)

#include "train_fp8.h" /* --dtype fp8: the FP8 linear layers */
#include "train_mla.h" /* MLA, MTP, recomputation: types and prototypes here, definitions at the end */

typedef struct tm_config {
    int vocab, seq, d_model, n_heads, n_layers, n_dense, ffn_hidden;
    int batch;          /* sequences per micro-batch on this rank */
    float rope_theta, norm_eps, init_std;
    dsk_dtype cdt;      /* compute dtype of weights copies and activations */
    dsk_dtype mdt;      /* AdamW's moments: f32 or bf16 (--optim-dtype) */
    int fp8;            /* 1: every linear layer's and expert's GEMMs in block-scaled FP8, their inputs kept in
                           e4m3 for backward (DeepSeek-V3's recipe; cdt bf16; train_fp8.h) */
    uint64_t seed;
    dsk_moe_opts moe;   /* template of every MoE layer (name, d_model, dtype, seed are set per layer) */
    tmla_config mla;    /* attention kind and MLA sizes, MTP depth, recomputation (train_mla.h) */
    int external;       /* 1: no slabs: the caller binds every parameter's wc and g (and binds the MoE layers'),
                           keeps masters and moments, initialises the weights (ZeRO, examples/train_zero.h) */
    int64_t *plan_bytes; /* non-NULL: a plan (train_plan.h): activations and buffers are not allocated, their bytes
                            are added here (tm_alloc_nd), and the MoE layers' workspace is counted, not reserved */
    int plan_cuda;       /* with plan_bytes: count the MoE workspace as a GPU holds it (the layer's dtype) */
} tm_config;

/* Blocks of the model: the n_layers main ones, then one per MTP module (train_mla.h). */
static inline int tm_n_blocks(const tm_config *c) { return c->n_layers + c->mla.mtp_depth; }

/* One trainable tensor: master weights, gradient, moments (f32) and the compute copy. */
typedef struct tm_param {
    char name[64];
    int ndim;
    int64_t shape[3];
    int decay;          /* 1: weight decay applies (matrices) */
    float init_std;     /* 0: initialised to ones (norm weights) */
    dsk_tensor w, g, m, v, wc; /* wc: the weights the forward pass reads (== w when cdt is f32) */
    dsk_tensor gc;      /* norm weights under bf16/f16: the gradient in the compute dtype, which
                           dsk_rmsnorm_backward accumulates into; copied to g when final */
    int moe_layer;      /* the block of an MoE parameter, or -1 */
    int moe_index;      /* its index in that layer's params[] */
    int sharded;        /* 1: an expert-sharded MoE parameter (after every replicated one in the slabs) */
    int unit;           /* its unit: 0 the embedding, 1 + l block l, n_layers + 1 the final norm and head */
} tm_param;

typedef struct tm_block {
    tm_param *ln1, *wq, *wk, *wv, *wo, *ln2, *w1, *w3, *w2; /* w1/w3/w2 only in dense blocks */
    /* saved activations, N = B*T rows */
    dsk_tensor x;                       /* (N, D) block input */
    dsk_tensor h1, rstd1, q, k, v, qr, kr, att, x2, h2, rstd2; /* (N, D) or (N) for rstd */
    dsk_tensor probs;                   /* (B, H, T, T) f32 attention probabilities */
    dsk_tensor g, u, a;                 /* (N, F) dense FFN */
    /* --dtype fp8: the FP8 linears' inputs in e4m3 (h1 of wq wk wv, att of wo, h2 of w1 w3, a of w2); h1, att
       and a dense block's h2 and a then pass through backward's scratch datt and da, idle in forward */
    tf8_act f8_h1, f8_att, f8_h2, f8_a;
    /* MoE blocks */
    int is_moe;
    dsk_moe moe;
    dsk_tensor moe_bias;                /* (E) f32 the layer's expert bias (not a gradient parameter) */
    dsk_moe_stats stats;                /* of the last step (training) or forward (want_stats) */
    dsk_tensor mx, my;                  /* (N, D) MoE input/output in the layer's dtype */
    tmla_block mla;                     /* MLA parameters and activations (train_mla.h) */
} tm_block;

/* Phases of a step whose time --profile reports (train_moe adds data and optimizer). */
typedef enum tm_phase {
    TM_PH_EMBED, TM_PH_NORM, TM_PH_LINEAR, TM_PH_ROPE, TM_PH_ATTN, TM_PH_FFN, TM_PH_MOE, TM_PH_HEAD, TM_PH_MOVE, TM_PH_COUNT
} tm_phase;
static const char *const tm_phase_names[TM_PH_COUNT] = {
    "embedding", "rmsnorm", "attention projections (q k v o)", "rope", "attention core (causal softmax, per head GEMMs)",
    "dense FFN (block 0)", "MoE layers (router, dispatch, experts, combine)", "LM head + cross-entropy", "residual adds, copies, zeroing"};

typedef struct tm_routes tm_routes; /* routing record and replay: train/routes.h */

typedef struct tm_model {
    tm_config cfg;
    tm_routes *routes;                  /* routing record/replay, or NULL */
    /* the loss span of every MoE call (dsk_moe_set_loss_span): its rows are rows [loss_row0, +n)
       of a micro-batch of loss_rows tokens spread over loss_group (NULL, 0, 0: each call its own) */
    dsk_comm *loss_group;
    int64_t loss_row0, loss_rows;
    dsk_ctx *ctx;
    int n_params, n_dense_params;       /* params[0, n_dense_params) replicated, the rest expert-sharded */
    int64_t numel_dense;                /* slab elements of the replicated parameters */
    int want_stats;                     /* 1: each MoE forward fills its block's stats (a host read) */
    int profile;                        /* 1: time each op into phase_s (synchronising the device) */
    double phase_s[TM_PH_COUNT];        /* seconds per phase since the caller last cleared them */
    double phase_cpu_s[TM_PH_COUNT];    /* the same in CPU time of the process (all threads) */
    tm_param params[1024];
    float aux_scale;                    /* weight of the MoE losses' gradients: loss scale / accum */
    /* called by backward when a slab parameter's gradient is final for this micro-batch
       (data-parallel buckets start their all-reduce from it); may be NULL */
    dsk_status (*grad_ready)(void *user, int param_index);
    void *grad_ready_user;
    /* called at the edges of each unit's forward and backward (ZeRO gathers, frees and binds there);
       may be NULL. The last unit's forward has no end: backward begins with it. */
    dsk_status (*unit_hook)(void *user, int unit, int phase);
    void *unit_hook_user;
    int unit_cur;                       /* tm_declare: the unit of the parameters being declared */
    int64_t numel;                      /* elements of each slab */
    dsk_tensor slab_w, slab_g, slab_m, slab_v, slab_wc;
    tm_param *embed, *ln_f, *lm_head;
    tm_block *blocks;
    char (*moe_names)[32];              /* name prefixes of the MoE layers ("blocks.3.moe") */
    dsk_tensor x_final, hf, rstdf, logits, dlogits; /* (N, D), (N, D), (N), (N, V), (N, V) */
    dsk_tensor ids, targets;            /* (N) i32 on the device */
    dsk_tensor loss;                    /* scalar f32 */
    /* backward scratch */
    dsk_tensor dx, dh, dq, dk, dv, dqr, dkr, datt, dg, du, da;
    dsk_tensor dx32;                    /* (N, D) f32 copy of dx for the embedding gradient (bf16/f16 only) */
    tmla_model mla;                     /* MLA scratch and the MTP modules (train_mla.h) */
    tf8_scratch f8;                     /* --dtype fp8: the FP8 linears' scratch */
} tm_model;

#include "train/timer.h" /* the phase timer: tm_clock, TM_T (--profile) */

/* ------------------------------------------------------------------ views */

/* First n rows of t as a view. */
static dsk_tensor tm_rows(const dsk_tensor *t, int64_t n) {
    dsk_tensor v;
    dsk_tensor_slice(t, 0, 0, n, &v);
    return v;
}

/* The first nb*T rows of an (N, D) tensor as (nb, T, H, Dh). */
static dsk_tensor tm_heads(const tm_model *m, const dsk_tensor *t, int nb) {
    const tm_config *c = &m->cfg;
    int64_t sh[4] = {nb, c->seq, c->n_heads, c->d_model / c->n_heads};
    dsk_tensor r = tm_rows(t, (int64_t)nb * c->seq), v;
    dsk_tensor_reshape(&r, 4, sh, &v);
    return v;
}

static dsk_status tm_mm(tm_model *m, dsk_tensor *C, const dsk_tensor *A, int ta, const dsk_tensor *B, int tb, float beta) {
    return dsk_matmul(m->ctx, C, A, ta, B, tb, 1.0f, beta);
}

/* --dtype fp8: x (the input of one or more linear layers) quantised into its cache. */
static dsk_status tm_keep(tm_model *m, tf8_act *act, const dsk_tensor *x) {
    return m->cfg.fp8 ? tf8_keep(m->ctx, act, x) : DSK_OK;
}

/* A linear layer y = x w^T + beta y (w a compute copy, or rows of one): in FP8 from x's cache (tm_keep) under
   --dtype fp8. */
static dsk_status tm_linear(tm_model *m, dsk_tensor *y, const dsk_tensor *x, const tf8_act *act, const dsk_tensor *w,
                            float beta) {
    if (m->cfg.fp8) return tf8_forward(m->ctx, &m->f8, y, act, w, beta);
    return tm_mm(m, y, x, 0, w, 1, beta);
}

/* t <- 0 (dsk_tensor_fill clears +0 by memset on either device). */
static dsk_status tm_zero(tm_model *m, dsk_tensor *t) { return dsk_tensor_fill(m->ctx, t, 0.0); }

/* ------------------------------------------------------------------ parameters */

static tm_param *tm_add_param(tm_model *m, int decay, float std, int ndim, int64_t d0, int64_t d1, const char *fmt, int layer) {
    tm_param *p = &m->params[m->n_params++];
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, fmt, layer);
    p->moe_layer = -1;
    p->unit = m->unit_cur;
    p->decay = decay;
    p->init_std = std;
    p->ndim = ndim;
    p->shape[0] = d0;
    p->shape[1] = d1;
    return p;
}

static int64_t tm_param_numel(const tm_param *p) {
    int64_t n = 1;
    for (int d = 0; d < p->ndim; d++) n *= p->shape[d];
    return n;
}

/* Parameter i of MoE block l as a tm_param: shape, flags and name from the layer. */
static void tm_add_moe_param(tm_model *m, int l, int i) {
    const dsk_moe_param *mp = &m->blocks[l].moe.params[i];
    tm_param *p = &m->params[m->n_params++];
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "%s", mp->name);
    p->ndim = mp->ndim;
    for (int d = 0; d < mp->ndim; d++) p->shape[d] = mp->shape[d];
    p->decay = mp->weight_decay;
    p->moe_layer = l;
    p->moe_index = i;
    p->sharded = mp->expert_sharded;
    p->unit = l < m->cfg.n_layers ? l + 1 : m->cfg.n_layers + 1; /* an MTP block's: the head's unit */
}

/* Declares the dense parameters in slab order, which is also the order backward finishes
   them in reverse (lm_head first, embed last), so data-parallel gradient buckets, which take
   parameters in reverse order, fill while backward runs. */
/* Block l's attention half and the norm after it: ln1, the attention's weights (MHA or MLA), ln2. */
static void tm_declare_attention(tm_model *m, int l, float std, float out_std) {
    const tm_config *c = &m->cfg;
    tm_block *b = &m->blocks[l];
    int64_t D = c->d_model;
    b->ln1 = tm_add_param(m, 0, 0, 1, D, 0, "blocks.%d.ln1", l);
    if (tmla_is_mla(&c->mla)) {
        tmla_declare_attn(m, l);
    } else {
        b->wq = tm_add_param(m, 1, std, 2, D, D, "blocks.%d.attn.wq", l);
        b->wk = tm_add_param(m, 1, std, 2, D, D, "blocks.%d.attn.wk", l);
        b->wv = tm_add_param(m, 1, std, 2, D, D, "blocks.%d.attn.wv", l);
        b->wo = tm_add_param(m, 1, out_std, 2, D, D, "blocks.%d.attn.wo", l);
    }
    b->ln2 = tm_add_param(m, 0, 0, 1, D, 0, "blocks.%d.ln2", l);
}

static void tm_declare(tm_model *m) {
    const tm_config *c = &m->cfg;
    int64_t D = c->d_model, F = c->ffn_hidden, V = c->vocab;
    float std = c->init_std, out_std = c->init_std / sqrtf(2.0f * (float)c->n_layers); /* GPT-2 residual scaling */
    m->unit_cur = 0;
    m->embed = tm_add_param(m, 1, std, 2, V, D, "embed", 0);
    for (int l = 0; l < c->n_layers; l++) {
        tm_block *b = &m->blocks[l];
        m->unit_cur = l + 1;
        tm_declare_attention(m, l, std, out_std);
        if (l < c->n_dense) {
            b->w1 = tm_add_param(m, 1, std, 2, F, D, "blocks.%d.ffn.w1", l);
            b->w3 = tm_add_param(m, 1, std, 2, F, D, "blocks.%d.ffn.w3", l);
            b->w2 = tm_add_param(m, 1, out_std, 2, D, F, "blocks.%d.ffn.w2", l);
        } else { /* the MoE layer's replicated parameters: router, shared experts */
            for (int i = 0; i < b->moe.n_params; i++)
                if (b->moe.params[i].trainable && !b->moe.params[i].expert_sharded) tm_add_moe_param(m, l, i);
        }
    }
    m->unit_cur = c->n_layers + 1;
    m->ln_f = tm_add_param(m, 0, 0, 1, D, 0, "ln_f", 0);
    m->lm_head = tm_add_param(m, 1, std, 2, V, D, "lm_head", 0);
    tmla_declare_mtp(m);
    m->n_dense_params = m->n_params;
    for (int l = c->n_dense; l < tm_n_blocks(c); l++) /* then every expert-sharded one (MTP blocks' too) */
        for (int i = 0; i < m->blocks[l].moe.n_params; i++)
            if (m->blocks[l].moe.params[i].expert_sharded) tm_add_moe_param(m, l, i);
}

/* The dtype the forward pass reads a parameter in (its compute copy wc; f32: the master):
   an MoE parameter's is the layer's (routers are always f32). */
static dsk_dtype tm_param_dtype(const tm_model *m, const tm_param *p) {
    return p->moe_layer >= 0 ? m->blocks[p->moe_layer].moe.params[p->moe_index].dtype : m->cfg.cdt;
}

static dsk_status tm_alloc_slab(tm_model *m, dsk_tensor *slab, dsk_dtype dt) {
    int64_t n = m->numel;
    return dsk_tensor_alloc(m->ctx, slab, dt, 1, &n);
}

/* Points every parameter's tensors into the slabs. */
static dsk_status tm_bind(tm_model *m) {
    int64_t off = 0;
    for (int i = 0; i < m->n_params; i++) {
        tm_param *p = &m->params[i];
        int64_t n = tm_param_numel(p);
        dsk_tensor s;
        const dsk_tensor *slabs[5] = {&m->slab_w, &m->slab_g, &m->slab_m, &m->slab_v, &m->slab_wc};
        dsk_tensor *views[5] = {&p->w, &p->g, &p->m, &p->v, &p->wc};
        for (int k = 0; k < 5; k++) {
            int own_copy = k < 4 || tm_param_dtype(m, p) != DSK_F32;
            if (!slabs[k]->data || !own_copy) { *views[k] = p->w; continue; } /* no separate compute copy */
            TM_TRY(dsk_tensor_slice(slabs[k], 0, off, n, &s));
            TM_TRY(dsk_tensor_reshape(&s, p->ndim, p->shape, views[k]));
        }
        off += n;
    }
    return DSK_OK;
}

/* Fresh weights: normal(0, std) from the counter-based RNG (each element its own counter,
   so the result does not depend on the device), ones for norm weights; an MoE layer's from
   its own streams (dsk_moe_init_param: an expert's numbers do not depend on the EP size). */
static dsk_status tm_init_weights(tm_model *m) {
    uint64_t off = 0;
    for (int i = 0; i < m->n_params; i++) {
        tm_param *p = &m->params[i];
        if (p->moe_layer >= 0) {
            TM_TRY(dsk_moe_init_param(&m->blocks[p->moe_layer].moe, m->ctx, p->moe_index, &p->w));
            continue;
        }
        if (p->init_std > 0) TM_TRY(dsk_tensor_normal(m->ctx, &p->w, m->cfg.seed, off, 0.0f, p->init_std));
        else TM_TRY(dsk_tensor_fill(m->ctx, &p->w, 1.0));
        off += (uint64_t)tm_param_numel(p);
    }
    TM_TRY(dsk_tensor_fill(m->ctx, &m->slab_m, 0.0));
    TM_TRY(dsk_tensor_fill(m->ctx, &m->slab_v, 0.0));
    TM_TRY(dsk_tensor_fill(m->ctx, &m->slab_g, 0.0));
    if (m->slab_wc.data) TM_TRY(dsk_tensor_copy(m->ctx, &m->slab_wc, &m->slab_w));
    return DSK_OK;
}

/* ------------------------------------------------------------------ activations */

/* Read-only: what a planned tensor points at (nothing may read or write it). */
static const char tm_plan_mark = 0;

/* Every activation and buffer of the model is allocated here (user: the tm_model, as tf8_alloc_fn): under a plan
   (cfg.plan_bytes) it adds the bytes the allocator would count instead, and t becomes a header over no memory. */
static dsk_status tm_alloc_nd(void *user, dsk_tensor *t, dsk_dtype dt, int nd, const int64_t *shape) {
    tm_model *m = (tm_model *)user;
    if (!m->cfg.plan_bytes) return dsk_tensor_alloc(m->ctx, t, dt, nd, shape);
    TM_TRY(dsk_tensor_wrap(t, (void *)&tm_plan_mark, dt, dsk_cpu(), nd, shape));
    *m->cfg.plan_bytes += (int64_t)dsk_tensor_nbytes(t);
    return DSK_OK;
}

static dsk_status tm_alloc2(tm_model *m, dsk_tensor *t, dsk_dtype dt, int64_t r, int64_t c) {
    int64_t sh[2] = {r, c};
    return tm_alloc_nd(m, t, dt, c ? 2 : 1, sh);
}

/* --dtype fp8: the blocks' FP8 caches (shared under --recompute: tmla_cache) and the scratch; the linears' bf16 inputs
   become views of backward's datt (h1, att, a dense block's h2) and da (a); a MoE block's h2 is the MoE layer's input.
   Under --recompute, MLA or --mtp train_mla.h allocates the blocks' activations (and MLA's latent caches). */
static dsk_status tm_alloc_fp8(tm_model *m) {
    const tm_config *c = &m->cfg;
    int64_t N = (int64_t)c->batch * c->seq, D = c->d_model, F = c->ffn_hidden;
    int64_t sh[2 * TMLA_FP8_SHAPES], Fd = c->n_dense > 0 || (c->mla.mtp_depth > 0 && !c->mla.mtp_moe) ? F : 0;
    int64_t Dt = c->mla.mtp_depth > 0 ? D : 0; /* the MTP projection's */
    TM_TRY(tf8_scratch_alloc(tm_alloc_nd, m, &m->f8, N, tmla_fp8_shapes(&c->mla, c->n_heads, D, D, Fd, Dt, sh), sh));
    for (int l = 0; l < tm_n_blocks(c); l++) { /* and the MTP modules' blocks (train_mla.h allocates theirs) */
        tm_block *b = &m->blocks[l];
        int dense = l < c->n_dense || (l >= c->n_layers && !c->mla.mtp_moe);
        TM_TRY(tmla_cache(m, l, &b->f8_h1, TMLA_RECOMPUTE_FULL, D));
        if (!tmla_is_mla(&c->mla)) TM_TRY(tmla_cache(m, l, &b->f8_att, TMLA_RECOMPUTE_ATTN, D)); /* MLA: the model's */
        if (dense) TM_TRY(tmla_cache(m, l, &b->f8_h2, TMLA_RECOMPUTE_FULL, D));
        if (dense) TM_TRY(tmla_cache(m, l, &b->f8_a, TMLA_RECOMPUTE_FULL, F));
        if (tmla_custom_alloc(m)) continue;
        b->h1 = m->datt;
        b->h1.owns = 0;
        b->att = b->h1;
        if (l >= c->n_dense) continue;
        b->h2 = b->h1;
        b->a = m->da;
        b->a.owns = 0;
    }
    return DSK_OK;
}

static dsk_status tm_alloc_acts(tm_model *m) {
    const tm_config *c = &m->cfg;
    int64_t N = (int64_t)c->batch * c->seq, D = c->d_model, F = c->ffn_hidden, V = c->vocab;
    dsk_dtype dt = c->cdt;
    for (int l = 0; l < c->n_layers; l++) {
        tm_block *b = &m->blocks[l];
        if (tmla_custom_alloc(m)) { TM_TRY(tmla_alloc_block(m, l)); continue; }
        dsk_tensor *nd[] = {&b->x, &b->h1, &b->q, &b->k, &b->v, &b->qr, &b->kr, &b->att, &b->x2, &b->h2};
        for (size_t i = 0; i < sizeof nd / sizeof nd[0]; i++) /* fp8: h1, att, a dense h2 in tm_alloc_fp8 */
            if (!c->fp8 || (nd[i] != &b->h1 && nd[i] != &b->att && (nd[i] != &b->h2 || l >= c->n_dense)))
                TM_TRY(tm_alloc2(m, nd[i], dt, N, D));
        TM_TRY(tm_alloc2(m, &b->rstd1, DSK_F32, N, 0));
        TM_TRY(tm_alloc2(m, &b->rstd2, DSK_F32, N, 0));
        int64_t ps[4] = {c->batch, c->n_heads, c->seq, c->seq};
        TM_TRY(tm_alloc_nd(m, &b->probs, DSK_F32, 4, ps));
        if (l < c->n_dense) {
            TM_TRY(tm_alloc2(m, &b->g, dt, N, F));
            TM_TRY(tm_alloc2(m, &b->u, dt, N, F));
            if (!c->fp8) TM_TRY(tm_alloc2(m, &b->a, dt, N, F));
        }
    }
    dsk_tensor *nd[] = {&m->x_final, &m->hf, &m->dx, &m->dh, &m->dq, &m->dk, &m->dv, &m->dqr, &m->dkr, &m->datt};
    for (size_t i = 0; i < sizeof nd / sizeof nd[0]; i++) TM_TRY(tm_alloc2(m, nd[i], dt, N, D));
    TM_TRY(tm_alloc2(m, &m->rstdf, DSK_F32, N, 0));
    TM_TRY(tm_alloc2(m, &m->logits, dt, N, V));
    TM_TRY(tm_alloc2(m, &m->dlogits, dt, N, V));
    if (c->n_dense > 0 || c->mla.mtp_depth > 0) {
        TM_TRY(tm_alloc2(m, &m->dg, dt, N, F));
        TM_TRY(tm_alloc2(m, &m->du, dt, N, F));
        TM_TRY(tm_alloc2(m, &m->da, dt, N, F));
    }
    if (dt != DSK_F32) {
        TM_TRY(tm_alloc2(m, &m->dx32, DSK_F32, N, D));
        for (int i = 0; i < m->n_params; i++)
            if (m->params[i].ndim == 1) TM_TRY(tm_alloc_nd(m, &m->params[i].gc, dt, 1, m->params[i].shape));
    }
    TM_TRY(tm_alloc_nd(m, &m->ids, DSK_I32, 1, &N));
    TM_TRY(tm_alloc_nd(m, &m->targets, DSK_I32, 1, &N));
    TM_TRY(tm_alloc_nd(m, &m->loss, DSK_F32, 0, NULL));
    if (c->fp8) TM_TRY(tm_alloc_fp8(m));
    return tmla_alloc(m);
}

/* ------------------------------------------------------------------ MoE blocks */

/* dsk_moe computes in f32 or bf16; an f16 model runs its MoE layers in f32. */
static dsk_dtype tm_moe_dtype(dsk_dtype cdt) { return cdt == DSK_BF16 ? DSK_BF16 : DSK_F32; }

/* Sizes only: the MoE layer of block l reports its parameters (bound by tm_bind_moe). */
static dsk_status tm_init_moe(tm_model *m, int l, char *name, size_t name_size) {
    const tm_config *c = &m->cfg;
    tm_block *b = &m->blocks[l];
    dsk_moe_opts o = c->moe;
    int64_t N = (int64_t)c->batch * c->seq, E = c->moe.n_routed;
    snprintf(name, name_size, "blocks.%d.moe", l);
    o.name = name;
    o.d_model = c->d_model;
    o.dtype = tm_moe_dtype(c->cdt);
    o.seq_len = c->seq;
    o.init_std = c->init_std;
    o.seed = c->seed + 1000003ull * (uint64_t)(l + 1);
    TM_TRY(dsk_moe_init(&b->moe, m->ctx, &o));
    b->is_moe = 1;
    TM_TRY(tm_alloc_nd(m, &b->moe_bias, DSK_F32, 1, &E));
    if (o.dtype != c->cdt) {
        TM_TRY(tm_alloc2(m, &b->mx, o.dtype, N, c->d_model));
        TM_TRY(tm_alloc2(m, &b->my, o.dtype, N, c->d_model));
    }
    return DSK_OK;
}

/* A plan's MoE workspace: what dsk_moe_reserve would allocate for tm_bind_moe's call. */
static dsk_status tm_plan_moe(tm_model *m) {
    for (int l = m->cfg.n_dense; l < tm_n_blocks(&m->cfg); l++) {
        const tm_block *b = &m->blocks[l];
        int64_t bytes;
        if (!b->is_moe) continue;
        TM_TRY(dsk_moe_reserve_bytes(&b->moe, (int64_t)m->cfg.batch * m->cfg.seq, -1,
                                     m->cfg.plan_cuda ? b->moe.opts.dtype : DSK_F32, &bytes));
        *m->cfg.plan_bytes += bytes;
    }
    return DSK_OK;
}

/* Binds every MoE layer's parameters: the compute copies and gradients in the model's slabs,
   the expert bias in its own small tensor (zero). Then the workspace for a full micro-batch. */
static dsk_status tm_bind_moe(tm_model *m) {
    if (m->cfg.plan_bytes) return tm_plan_moe(m);
    for (int i = 0; !m->cfg.external && i < m->n_params; i++) {
        tm_param *p = &m->params[i];
        if (p->moe_layer >= 0) TM_TRY(dsk_moe_bind(&m->blocks[p->moe_layer].moe, m->ctx, p->moe_index, &p->wc, &p->g));
    }
    for (int l = m->cfg.n_dense; l < tm_n_blocks(&m->cfg); l++) {
        tm_block *b = &m->blocks[l];
        if (!b->is_moe) continue; /* a pipeline stage (train_par.h) holds only its own blocks; dense MTP blocks */
        TM_TRY(dsk_moe_bind(&b->moe, m->ctx, DSK_MOE_P_BIAS, &b->moe_bias, NULL));
        TM_TRY(dsk_moe_init_param(&b->moe, m->ctx, DSK_MOE_P_BIAS, &b->moe_bias));
        TM_TRY(dsk_moe_reserve(&b->moe, m->ctx, (int64_t)m->cfg.batch * m->cfg.seq));
    }
    return DSK_OK;
}

#include "train/routes.h" /* routing record and replay, tm_moe_call */

/* y = x2 + MoE(h2) for the first N rows. */
static dsk_status tm_moe_forward(tm_model *m, int layer, int64_t N, dsk_tensor *y) {
    tm_block *b = &m->blocks[layer];
    dsk_tensor x2 = tm_rows(&b->x2, N), h2 = tm_rows(&b->h2, N);
    dsk_moe_stats *st = m->want_stats ? &b->stats : NULL;
    if (!b->mx.data) {
        TM_TRY(tm_moe_call(m, &b->moe, layer, 0, y, &h2, st));
    } else {
        dsk_tensor mx = tm_rows(&b->mx, N), my = tm_rows(&b->my, N);
        TM_TRY(dsk_tensor_copy(m->ctx, &mx, &h2));
        TM_TRY(tm_moe_call(m, &b->moe, layer, 0, &my, &mx, st));
        TM_TRY(dsk_tensor_copy(m->ctx, y, &my));
    }
    return dsk_add(m->ctx, y, y, &x2);
}

/* dx holds d(block output); adds the layer's gradients and leaves d(h2) in dh. */
static dsk_status tm_moe_backward(tm_model *m, int layer) {
    tm_block *b = &m->blocks[layer];
    if (!b->mx.data) {
        TM_TRY(tm_zero(m, &m->dh));
        return dsk_moe_backward(&b->moe, m->ctx, &m->dh, &m->dx, m->aux_scale);
    }
    TM_TRY(dsk_tensor_copy(m->ctx, &b->my, &m->dx));
    TM_TRY(tm_zero(m, &b->mx));
    TM_TRY(dsk_moe_backward(&b->moe, m->ctx, &b->mx, &b->my, m->aux_scale));
    return dsk_tensor_copy(m->ctx, &m->dh, &b->mx);
}

static void tm_free(tm_model *m) {
    dsk_ctx *ctx = m->ctx;
    tmla_free(m);
    for (int i = 0; i < m->n_params; i++) dsk_tensor_free(ctx, &m->params[i].gc);
    if (m->blocks)
        for (int l = 0; l < tm_n_blocks(&m->cfg); l++) {
            tm_block *b = &m->blocks[l];
            dsk_tensor *ts[] = {&b->x, &b->h1, &b->rstd1, &b->q, &b->k, &b->v, &b->qr, &b->kr, &b->att, &b->x2,
                                &b->h2, &b->rstd2, &b->probs, &b->g, &b->u, &b->a, &b->mx, &b->my};
            for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dsk_tensor_free(ctx, ts[i]);
            tf8_act *f8[] = {&b->f8_h1, &b->f8_att, &b->f8_h2, &b->f8_a};
            for (size_t i = 0; i < sizeof f8 / sizeof f8[0]; i++) tf8_act_free(ctx, f8[i]);
            dsk_moe_free(&b->moe, ctx);
            dsk_tensor_free(ctx, &b->moe_bias);
        }
    dsk_tensor *ts[] = {&m->slab_w, &m->slab_g, &m->slab_m, &m->slab_v, &m->slab_wc, &m->x_final, &m->hf, &m->rstdf,
                        &m->logits, &m->dlogits, &m->ids, &m->targets, &m->loss, &m->dx, &m->dh, &m->dq, &m->dk,
                        &m->dv, &m->dqr, &m->dkr, &m->datt, &m->dg, &m->du, &m->da, &m->dx32};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dsk_tensor_free(ctx, ts[i]);
    tf8_scratch_free(ctx, &m->f8);
    free(m->blocks);
    free(m->moe_names);
    memset(m, 0, sizeof *m);
}

/* Checks the configuration; every message names the flag. */
static dsk_status tm_check_config(const tm_config *c) {
    if (c->vocab < 2) return dsk_set_error(DSK_ERR_ARG, "--vocab %d: need at least 2", c->vocab);
    if (c->seq < 1 || c->d_model < 2 || c->n_heads < 1 || c->n_layers < 1 || c->ffn_hidden < 1 || c->batch < 1)
        return dsk_set_error(DSK_ERR_ARG, "model sizes must be positive: --seq %d --d-model %d --heads %d --layers %d --ffn-hidden %d, "
                             "batch %d per rank", c->seq, c->d_model, c->n_heads, c->n_layers, c->ffn_hidden, c->batch);
    if (c->d_model % c->n_heads != 0)
        return dsk_set_error(DSK_ERR_ARG, "--heads %d does not divide --d-model %d", c->n_heads, c->d_model);
    if ((c->d_model / c->n_heads) % 2 != 0)
        return dsk_set_error(DSK_ERR_ARG, "head size --d-model/--heads = %d must be even for rotary embeddings",
                             c->d_model / c->n_heads);
    if (c->n_dense < 0 || c->n_dense > c->n_layers)
        return dsk_set_error(DSK_ERR_ARG, "--dense-layers %d outside [0, --layers %d]", c->n_dense, c->n_layers);
    if (c->n_layers > 100) return dsk_set_error(DSK_ERR_ARG, "--layers %d: at most 100", c->n_layers);
    return tmla_check_config(c);
}

/* Declares the model's parameters (names, shapes, units; the MoE layers report theirs) without
   slabs or activations: what tm_init starts with, and what a planner sizes (train_plan.h). */
static dsk_status tm_declare_model(tm_model *m, dsk_ctx *ctx, const tm_config *cfg) {
    memset(m, 0, sizeof *m);
    m->cfg = *cfg;
    m->ctx = ctx;
    TM_TRY(tm_check_config(cfg));
    m->blocks = (tm_block *)calloc((size_t)(cfg->n_layers + cfg->mla.mtp_depth), sizeof *m->blocks); /* + MTP blocks */
    if (!m->blocks) return dsk_set_error(DSK_ERR_OOM, "tm_init: out of memory for %d blocks", cfg->n_layers);
    m->moe_names = (char(*)[32])calloc((size_t)tm_n_blocks(cfg), sizeof *m->moe_names);
    if (!m->moe_names) return dsk_set_error(DSK_ERR_OOM, "tm_init: out of memory");
    for (int l = cfg->n_dense; l < tm_n_blocks(cfg); l++)
        if (l < cfg->n_layers || cfg->mla.mtp_moe) TM_TRY(tm_init_moe(m, l, m->moe_names[l], sizeof m->moe_names[l]));
    tm_declare(m);
    for (int i = 0; i < m->n_params; i++) {
        m->numel += tm_param_numel(&m->params[i]);
        if (i < m->n_dense_params) m->numel_dense = m->numel;
    }
    return DSK_OK;
}

/* Builds the model's dense parameters and activations on ctx's device. */
static dsk_status tm_init(tm_model *m, dsk_ctx *ctx, const tm_config *cfg) {
    TM_TRY(tm_declare_model(m, ctx, cfg));
    if (!cfg->external) {
        TM_TRY(tm_alloc_slab(m, &m->slab_w, DSK_F32));
        TM_TRY(tm_alloc_slab(m, &m->slab_g, DSK_F32));
        TM_TRY(tm_alloc_slab(m, &m->slab_m, cfg->mdt));
        TM_TRY(tm_alloc_slab(m, &m->slab_v, cfg->mdt));
        if (cfg->cdt != DSK_F32) TM_TRY(tm_alloc_slab(m, &m->slab_wc, cfg->cdt));
        TM_TRY(tm_bind(m));
        TM_TRY(tm_init_weights(m));
    }
    TM_TRY(tm_alloc_acts(m));
    return tm_bind_moe(m);
}

/* ------------------------------------------------------------------ forward */

/* FFN input h2 -> block output y = x2 + FFN(h2), dense version. */
static dsk_status tm_dense_forward(tm_model *m, tm_block *b, int64_t N, dsk_tensor *y) {
    dsk_tensor h2 = tm_rows(&b->h2, N), g = tm_rows(&b->g, N), u = tm_rows(&b->u, N), a = tm_rows(&b->a, N);
    dsk_tensor x2 = tm_rows(&b->x2, N);
    TM_T(TM_PH_FFN, tm_keep(m, &b->f8_h2, &h2));
    TM_T(TM_PH_FFN, tm_linear(m, &g, &h2, &b->f8_h2, &b->w1->wc, 0.0f));
    TM_T(TM_PH_FFN, tm_linear(m, &u, &h2, &b->f8_h2, &b->w3->wc, 0.0f));
    TM_T(TM_PH_FFN, dsk_swiglu(m->ctx, &a, &g, &u));
    TM_T(TM_PH_FFN, tm_keep(m, &b->f8_a, &a));
    TM_T(TM_PH_MOVE, dsk_tensor_copy(m->ctx, y, &x2));
    TM_T(TM_PH_FFN, tm_linear(m, y, &a, &b->f8_a, &b->w2->wc, 1.0f));
    return DSK_OK;
}

/* Attention half of block b: x -> x2, with everything backward needs saved. */
static dsk_status tm_attn_forward(tm_model *m, tm_block *b, int nb) {
    const tm_config *c = &m->cfg;
    if (tmla_is_mla(&c->mla)) return tmla_attn_forward(m, b, nb);
    int64_t N = (int64_t)nb * c->seq;
    dsk_tensor x = tm_rows(&b->x, N), h1 = tm_rows(&b->h1, N), rstd1 = tm_rows(&b->rstd1, N);
    dsk_tensor q = tm_rows(&b->q, N), k = tm_rows(&b->k, N), v = tm_rows(&b->v, N), att = tm_rows(&b->att, N);
    dsk_tensor x2 = tm_rows(&b->x2, N);
    TM_T(TM_PH_NORM, dsk_rmsnorm(m->ctx, &h1, &rstd1, &x, &b->ln1->wc, c->norm_eps));
    TM_T(TM_PH_LINEAR, tm_keep(m, &b->f8_h1, &h1));
    TM_T(TM_PH_LINEAR, tm_linear(m, &q, &h1, &b->f8_h1, &b->wq->wc, 0.0f));
    TM_T(TM_PH_LINEAR, tm_linear(m, &k, &h1, &b->f8_h1, &b->wk->wc, 0.0f));
    TM_T(TM_PH_LINEAR, tm_linear(m, &v, &h1, &b->f8_h1, &b->wv->wc, 0.0f));
    dsk_tensor q4 = tm_heads(m, &q, nb), k4 = tm_heads(m, &k, nb);
    dsk_tensor qr4 = tm_heads(m, &b->qr, nb), kr4 = tm_heads(m, &b->kr, nb);
    TM_T(TM_PH_ROPE, dsk_rope(m->ctx, &qr4, &q4, 0, c->rope_theta));
    TM_T(TM_PH_ROPE, dsk_rope(m->ctx, &kr4, &k4, 0, c->rope_theta));
    /* causal attention, every (sequence, head) in one call: P = softmax(scale Q K^T, causal), O = P V */
    float scale = 1.0f / sqrtf((float)(c->d_model / c->n_heads));
    dsk_tensor v4 = tm_heads(m, &b->v, nb), att4 = tm_heads(m, &b->att, nb), probs;
    TM_TRY(dsk_tensor_slice(&b->probs, 0, 0, nb, &probs));
    TM_T(TM_PH_ATTN, dsk_attention(m->ctx, &att4, &probs, &qr4, &kr4, &v4, scale));
    TM_T(TM_PH_MOVE, dsk_tensor_copy(m->ctx, &x2, &x));
    TM_T(TM_PH_LINEAR, tm_keep(m, &b->f8_att, &att));
    TM_T(TM_PH_LINEAR, tm_linear(m, &x2, &att, &b->f8_att, &b->wo->wc, 1.0f));
    dsk_tensor h2 = tm_rows(&b->h2, N), rstd2 = tm_rows(&b->rstd2, N);
    TM_T(TM_PH_NORM, dsk_rmsnorm(m->ctx, &h2, &rstd2, &x2, &b->ln2->wc, c->norm_eps));
    return DSK_OK;
}

/* Forward pass over the first nb sequences of m->ids; writes m->logits rows [0, nb*T).
*/
/* Evaluation passes (validation, sampling) must not count toward the expert-bias update. */
static void tm_set_eval(tm_model *m, int eval) {
    for (int l = 0; l < tm_n_blocks(&m->cfg); l++)
        if (m->blocks[l].is_moe) m->blocks[l].moe.eval = eval;
    m->mla.eval = eval;
}

/* The edges of a unit's forward and backward, for m->unit_hook. */
enum { TM_FWD_BEGIN = 0, TM_FWD_END, TM_BWD_BEGIN, TM_BWD_END };
static dsk_status tm_unit(tm_model *m, int unit, int phase) {
    return m->unit_hook ? m->unit_hook(m->unit_hook_user, unit, phase) : DSK_OK;
}

static dsk_status tm_forward(tm_model *m, int nb) {
    const tm_config *c = &m->cfg;
    int64_t N = (int64_t)nb * c->seq;
    dsk_tensor ids = tm_rows(&m->ids, N), x0 = tm_rows(&m->blocks[0].x, N);
    TM_TRY(tm_unit(m, 0, TM_FWD_BEGIN));
    TM_T(TM_PH_EMBED, dsk_embedding(m->ctx, &x0, &m->embed->wc, &ids));
    TM_TRY(tmla_mtp_embed(m, nb)); /* the MTP modules' inputs */
    TM_TRY(tm_unit(m, 0, TM_FWD_END));
    for (int l = 0; l < c->n_layers; l++) {
        tm_block *b = &m->blocks[l];
        dsk_tensor y = tm_rows(l + 1 < c->n_layers ? &m->blocks[l + 1].x : &m->x_final, N);
        TM_TRY(tm_unit(m, l + 1, TM_FWD_BEGIN));
        TM_TRY(tm_attn_forward(m, b, nb));
        if (l < c->n_dense) TM_TRY(tm_dense_forward(m, b, N, &y));
        else TM_T(TM_PH_MOE, tm_moe_forward(m, l, N, &y));
        TM_TRY(tm_unit(m, l + 1, TM_FWD_END));
    }
    dsk_tensor xf = tm_rows(&m->x_final, N), hf = tm_rows(&m->hf, N), rstdf = tm_rows(&m->rstdf, N);
    dsk_tensor logits = tm_rows(&m->logits, N);
    TM_TRY(tm_unit(m, c->n_layers + 1, TM_FWD_BEGIN));
    TM_T(TM_PH_NORM, dsk_rmsnorm(m->ctx, &hf, &rstdf, &xf, &m->ln_f->wc, c->norm_eps));
    TM_T(TM_PH_HEAD, tm_mm(m, &logits, &hf, 0, &m->lm_head->wc, 1, 0.0f));
    return tmla_mtp_forward(m, nb);
}

/* Mean cross-entropy of the full micro-batch into m->loss; dlogits = grad_scale * dloss/dlogits. */
static dsk_status tm_loss(tm_model *m, float grad_scale) {
    TM_T(TM_PH_HEAD, dsk_cross_entropy(m->ctx, &m->loss, &m->dlogits, &m->logits, &m->targets, -1, grad_scale));
    return tmla_mtp_loss(m, grad_scale);
}

/* ------------------------------------------------------------------ backward */

/* The gradient backward accumulates into for a norm weight. */
static dsk_tensor *tm_grad(tm_param *p) { return p->gc.data ? &p->gc : &p->g; }

/* p's gradient is final for this micro-batch. */
static dsk_status tm_ready(tm_model *m, tm_param *p) {
    if (p->gc.data) TM_TRY(dsk_tensor_copy(m->ctx, &p->g, &p->gc));
    return m->grad_ready ? m->grad_ready(m->grad_ready_user, (int)(p - m->params)) : DSK_OK;
}

/* Clears every gradient before a step's first micro-batch. */
static dsk_status tm_zero_grads(tm_model *m) {
    if (m->slab_g.data) TM_TRY(tm_zero(m, &m->slab_g));
    for (int i = 0; i < m->n_params; i++)
        if (m->params[i].gc.data) TM_TRY(dsk_tensor_fill(m->ctx, &m->params[i].gc, 0.0));
    return DSK_OK;
}

/* The backward of n linear layers that read one input x (its cache act under --dtype fp8) with weights w[i]
   (compute copies, or rows of one) and output gradients dy[i]: gw[i] += dy[i]^T x, then dx = sum over i of
   dy[i] w[i] (in i order, written). Phase ph takes the time. */
static dsk_status tm_linears_backward(tm_model *m, int ph, int n, dsk_tensor *const *gw, const dsk_tensor *const *w,
                                      dsk_tensor *const *dy, const dsk_tensor *x, const tf8_act *act, dsk_tensor *dx) {
    if (m->cfg.fp8) {
        TM_T(ph, tf8_linear_backward(m->ctx, &m->f8, n, gw, w, (const dsk_tensor *const *)dy, act, dx));
        return DSK_OK;
    }
    for (int i = 0; i < n; i++) TM_T(ph, tm_mm(m, gw[i], dy[i], 1, x, 0, 1.0f));
    for (int i = 0; i < n; i++) TM_T(ph, tm_mm(m, dx, dy[i], 0, w[i], 0, i ? 1.0f : 0.0f));
    return DSK_OK;
}

/* tm_linears_backward of the parameters w[i], each made ready after (unless the caller marks whole units:
   tmla_model.unit_ready). */
static dsk_status tm_linear_backward(tm_model *m, int ph, int n, tm_param **w, dsk_tensor **dy, const dsk_tensor *x,
                                     const tf8_act *act, dsk_tensor *dx) {
    dsk_tensor *gw[3] = {NULL, NULL, NULL}; /* initialised: gcc -O1 with ASan cannot see n <= 3 */
    const dsk_tensor *wc[3] = {NULL, NULL, NULL};
    for (int i = 0; i < n; i++) gw[i] = &w[i]->g;
    for (int i = 0; i < n; i++) wc[i] = &w[i]->wc;
    TM_TRY(tm_linears_backward(m, ph, n, gw, wc, dy, x, act, dx));
    for (int i = 0; i < n && !m->mla.unit_ready; i++) TM_T(TM_PH_MOVE, tm_ready(m, w[i]));
    return DSK_OK;
}

/* dx holds d(block output); adds the dense FFN's weight gradients, leaves d(h2) in dh. */
static dsk_status tm_dense_backward(tm_model *m, tm_block *b) {
    tm_param *w2[1] = {b->w2}, *w13[2] = {b->w1, b->w3};
    dsk_tensor *dy2[1] = {&m->dx}, *dy13[2] = {&m->dg, &m->du};
    /* dW2 (D,F) += dy^T a, da (N,F) = dy (N,D) W2 (D,F) */
    TM_TRY(tm_linear_backward(m, TM_PH_FFN, 1, w2, dy2, &b->a, &b->f8_a, &m->da));
    TM_T(TM_PH_FFN, dsk_swiglu_backward(m->ctx, &m->dg, &m->du, &m->da, &b->g, &b->u, DSK_GRAD_WRITE));
    /* dW1 (F,D) += dg^T h2, dW3 likewise; dh2 = dg W1 + du W3 */
    return tm_linear_backward(m, TM_PH_FFN, 2, w13, dy13, &b->h2, &b->f8_h2, &m->dh);
}

/* dx holds d(x2); turns it into d(x) and adds the attention weights' gradients. */
static dsk_status tm_attn_backward(tm_model *m, tm_block *b) {
    const tm_config *c = &m->cfg;
    int nb = c->batch;
    if (tmla_is_mla(&c->mla)) return tmla_attn_backward(m, b);
    TM_TRY(tmla_recompute_core(m, b));
    tm_param *wo[1] = {b->wo}, *wqkv[3] = {b->wq, b->wk, b->wv};
    dsk_tensor *dyo[1] = {&m->dx}, *dyqkv[3] = {&m->dq, &m->dk, &m->dv};
    TM_TRY(tm_linear_backward(m, TM_PH_LINEAR, 1, wo, dyo, &b->att, &b->f8_att, &m->datt)); /* dWo += dx2^T att */
    /* dQ, dK, dV of the causal attention, written */
    float scale = 1.0f / sqrtf((float)(c->d_model / c->n_heads));
    dsk_tensor qr4 = tm_heads(m, &b->qr, nb), kr4 = tm_heads(m, &b->kr, nb), v4 = tm_heads(m, &b->v, nb);
    dsk_tensor do4 = tm_heads(m, &m->datt, nb), dv4 = tm_heads(m, &m->dv, nb);
    dsk_tensor dqr4 = tm_heads(m, &m->dqr, nb), dkr4 = tm_heads(m, &m->dkr, nb);
    TM_T(TM_PH_ATTN,
         dsk_attention_backward(m->ctx, &dqr4, &dkr4, &dv4, &do4, &qr4, &kr4, &v4, &b->probs, scale, DSK_GRAD_WRITE));
    dsk_tensor dq4 = tm_heads(m, &m->dq, nb), dk4 = tm_heads(m, &m->dk, nb);
    TM_T(TM_PH_ROPE, dsk_rope_backward(m->ctx, &dq4, &dqr4, 0, c->rope_theta, DSK_GRAD_WRITE));
    TM_T(TM_PH_ROPE, dsk_rope_backward(m->ctx, &dk4, &dkr4, 0, c->rope_theta, DSK_GRAD_WRITE));
    /* dWq (D,D) += dq^T h1, dWk, dWv likewise; dh1 = dq Wq + dk Wk + dv Wv */
    TM_TRY(tm_linear_backward(m, TM_PH_LINEAR, 3, wqkv, dyqkv, &b->h1, &b->f8_h1, &m->dh));
    TM_T(TM_PH_NORM, dsk_rmsnorm_backward(m->ctx, &m->dx, tm_grad(b->ln1), &m->dh, &b->x, &b->ln1->wc, &b->rstd1));
    TM_T(TM_PH_MOVE, tm_ready(m, b->ln1));
    return DSK_OK;
}

/* Backward of the full micro-batch from m->dlogits; gradients accumulate into the slab. The
   residual stream's gradient runs through m->dx, each norm adding its branch to it. */
static dsk_status tm_backward(tm_model *m) {
    const tm_config *c = &m->cfg;
    TM_TRY(tm_unit(m, c->n_layers + 1, TM_BWD_BEGIN));
    TM_TRY(tmla_mtp_backward(m)); /* the MTP modules first: they share the head and the embedding */
    TM_T(TM_PH_HEAD, tm_mm(m, &m->lm_head->g, &m->dlogits, 1, &m->hf, 0, 1.0f)); /* dWlm (V,D) += dlogits^T hf */
    TM_T(TM_PH_MOVE, tm_ready(m, m->lm_head));
    TM_T(TM_PH_HEAD, tm_mm(m, &m->dh, &m->dlogits, 0, &m->lm_head->wc, 0, 0.0f)); /* dhf (N,D) = dlogits Wlm */
    TM_T(TM_PH_MOVE, tmla_seed_dx(m)); /* zero, or the MTP modules' d(x_final) */
    TM_T(TM_PH_NORM, dsk_rmsnorm_backward(m->ctx, &m->dx, tm_grad(m->ln_f), &m->dh, &m->x_final, &m->ln_f->wc, &m->rstdf));
    TM_T(TM_PH_MOVE, tm_ready(m, m->ln_f));
    TM_TRY(tm_unit(m, c->n_layers + 1, TM_BWD_END));
    for (int l = c->n_layers - 1; l >= 0; l--) {
        tm_block *b = &m->blocks[l];
        TM_TRY(tm_unit(m, l + 1, TM_BWD_BEGIN));
        TM_TRY(tmla_recompute_block(m, l)); /* --recompute full: the block's forward again */
        if (l < c->n_dense) TM_TRY(tm_dense_backward(m, b));
        else TM_T(TM_PH_MOE, tm_moe_backward(m, l));
        for (int i = 0; l >= c->n_dense && i < m->n_params; i++) /* the MoE layer's gradients are final */
            if (m->params[i].moe_layer == l) TM_T(TM_PH_MOVE, tm_ready(m, &m->params[i]));
        TM_T(TM_PH_NORM, dsk_rmsnorm_backward(m->ctx, &m->dx, tm_grad(b->ln2), &m->dh, &b->x2, &b->ln2->wc, &b->rstd2));
        TM_T(TM_PH_MOVE, tm_ready(m, b->ln2));
        TM_TRY(tm_attn_backward(m, b));
        TM_TRY(tm_unit(m, l + 1, TM_BWD_END));
    }
    TM_TRY(tm_unit(m, 0, TM_BWD_BEGIN));
    TM_TRY(tmla_mtp_embed_backward(m)); /* the MTP modules' inputs */
    if (m->dx32.data) { /* the table's gradient is f32: accumulate it from an f32 copy of dx */
        TM_T(TM_PH_MOVE, dsk_tensor_copy(m->ctx, &m->dx32, &m->dx));
        TM_T(TM_PH_EMBED, dsk_embedding_backward(m->ctx, &m->embed->g, &m->dx32, &m->ids));
    } else {
        TM_T(TM_PH_EMBED, dsk_embedding_backward(m->ctx, &m->embed->g, &m->dx, &m->ids));
    }
    TM_T(TM_PH_MOVE, tm_ready(m, m->embed));
    return tm_unit(m, 0, TM_BWD_END);
}

#define TRAIN_MODEL_H_DONE
#include "train_mla.h" /* the definitions */

#endif /* TRAIN_MODEL_H */
