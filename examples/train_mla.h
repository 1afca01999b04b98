/* train_mla.h - the DeepSeek-V2/V3 parts of the example model (examples/train_model.h):
   multi-head latent attention (MLA), multi-token prediction (MTP) and activation
   recomputation, forward and backward on dsk_tensor.h ops.

   MLA, as class MLA of DeepSeek-V3's inference/model.py (attn_impl "naive", the form that
   trains), with H heads, per head qk = nope + rope dims and v dims:
     q    = Wq h                         q_lora_rank == 0
     q    = Wq_b RMSNorm_q(Wq_a h)       q_lora_rank  > 0   (RMSNorm on the query latent)
     [c | kr] = Wkv_a h                  c: kv_lora_rank latent, kr: qk_rope_head_dim
     [k_nope | v] = Wkv_b RMSNorm_kv(c)  per head qk_nope_head_dim and v_head_dim
     q_h = [q_nope_h | rope(q_rope_h)],  k_h = [k_nope_h | rope(kr)]  (one rope key for all heads)
     out = Wo concat_h causal_softmax(scale q_h k_h^T) v_h
   scale = (nope + rope)^-1/2, times mscale^2 with mscale = 0.1 * m * ln(rope_factor) + 1 when
   the sequence is longer than the original one (the reference's long-context correction). With
   yarn (set by Hugging Face imports, examples/train_hf.h) the rope frequencies also follow
   YaRN's per-frequency ramp (tmla_yarn_freq) and both apply at any length, as transformers
   applies them (DeepSeek-V3's reference applies them when its max_seq_len exceeds the
   original length, which its published configs do). The attention core is
   dsk_attention_fused with Dk = nope + rope != Dv = v: O(T) memory, row log-sum-exp saved.
   Between the block's norm and Wo (tmla_latent_forward / _backward) it runs the heads of
   tmla_model.heads (train_par.h: a tensor-parallel rank's H/tp, on the gathered input).

   MTP (DeepSeek-V3 report, section 2.2): D modules after the main model; module k (1..D) at
   position i combines RMSNorm(h^{k-1}_i) and RMSNorm(Emb(t_{i+k})) by a projection M_k (d x 2d),
   runs one transformer block (this model's attention and, by mtp_moe, an MoE FFN configured as
   the main MoE layers, as DeepSeek-V3's MTP layer has, or a dense SwiGLU FFN) and predicts
   t_{i+k+1} through its own RMSNorm and the shared output head; h^0 is the main model's last
   block output. L = L_main + lambda / D sum_k L_k, L_k = -1/T sum_i log P_k(t_{i+k+1}) over the
   T - k positions that have a target (the rest are masked: causal attention keeps them from
   the others, so this equals running the shorter sequence). An MoE block is a full MoE layer
   (block n_layers + k - 1: expert bias, balancing losses, statistics, checkpoints, routing
   record/replay); its router sees the k masked positions too (token 0), so its balance
   statistics, unlike the loss, count T rows per sequence.

   Recomputation (--recompute): `attn` keeps the attention inputs of each block and recomputes
   the core (output and row statistics, or the materialised probabilities for MHA) in backward;
   `full` keeps each block's input only and reruns the block's forward (attention half and
   dense FFN; an MoE layer keeps its own saved state) right before its backward. The blocks
   then share one set of buffers; the same ops on the same inputs give the same bits, so the
   gradients equal those of `none` bit for bit.

   The header is read twice by train_model.h: first for the types and prototypes (before the
   model's types), then, with TRAIN_MODEL_H_DONE defined, for the definitions.

   Contents: types | prototypes | helpers | parameters | activations | MLA forward and
   backward | recomputation | MTP (train/mtp.h) | FLOPs | memory report */
#ifndef TRAIN_MLA_H
#define TRAIN_MLA_H

#include "../dsk_tensor.h"

/* ------------------------------------------------------------------ types */

#define TMLA_MAX_MTP 4
#define TMLA_MAX_ROPE 512

typedef enum tmla_attn { TMLA_ATTN_MHA = 0, TMLA_ATTN_MLA } tmla_attn;
typedef enum tmla_recompute { TMLA_RECOMPUTE_NONE = 0, TMLA_RECOMPUTE_ATTN, TMLA_RECOMPUTE_FULL } tmla_recompute;

typedef struct tmla_config {
    int attn;                           /* tmla_attn */
    int q_lora_rank;                    /* 0: plain Wq */
    int kv_lora_rank, qk_nope_dim, qk_rope_dim, v_head_dim;
    int original_seq;                   /* > 0 and < seq: the mscale correction applies */
    float rope_factor, mscale;
    int yarn;                           /* 1: YaRN as transformers applies it (Hugging Face imports): the rope
                                           frequencies ramped by beta_fast/beta_slow over original_seq and
                                           rope_factor, and the mscale correction, at any length */
    float beta_fast, beta_slow;
    float latent_eps;                   /* eps of the query and kv latents' RMSNorms [0: the model's norm_eps];
                                           transformers fixes them at 1e-6 whatever rms_norm_eps says */
    int mtp_depth;                      /* D, 0 = off */
    float mtp_lambda;
    int mtp_moe;                        /* 1: each MTP block's FFN is an MoE layer of the main ones' config (DeepSeek-V3,
                                           Hugging Face imports); 0: a dense SwiGLU of ffn_hidden */
    int recompute;                      /* tmla_recompute */
} tmla_config;

struct tm_param;
struct tm_model;
struct tm_block;

/* MLA parameters and saved activations of one block (N = B*T rows). */
typedef struct tmla_block {
    struct tm_param *wq, *wq_a, *q_norm, *wq_b, *wkv_a, *kv_norm, *wkv_b, *wo;
    dsk_tensor cq, cqn, rstd_q;         /* (N, q_lora), (N): query latent, normed */
    dsk_tensor q;                       /* (N, H*(nope+rope)) queries, rope part rotated */
    dsk_tensor ckv, ckvn, rstd_kv;      /* (N, kv_lora), (N): kv latent, normed */
    dsk_tensor kpe;                     /* (N, rope) the shared rope key, rotated */
    dsk_tensor kvb;                     /* (N, H*(nope+v)) Wkv_b output: k_nope and v per head */
    dsk_tensor k;                       /* (N, H*(nope+rope)) keys */
    dsk_tensor att;                     /* (N, H*v) attention output */
    dsk_tensor lse;                     /* (B, H, T) f32 row log-sum-exp */
    int recompute;                      /* this block's buffers are shared: tmla_recompute mode */
    tf8_act f8_cqn, f8_ckvn;            /* --dtype fp8: Wq_b's and Wkv_b's inputs in e4m3 (h1's: tm_block.f8_h1) */
} tmla_block;

/* One MTP module: parameters, inputs and saved activations. */
typedef struct tmla_mtp {
    struct tm_param *hnorm, *enorm, *proj, *norm; /* proj (D, 2D): [RMSNorm(h) | RMSNorm(emb)] -> D */
    dsk_tensor ids, tgt;                /* (N) i32: t_{i+k} (0 past the end), t_{i+k+1} (-1 past the end) */
    dsk_tensor emb, en, rstd_e, hn, rstd_h; /* (N, D), (N) */
    dsk_tensor demb;                    /* (N, D) d(emb), applied to the embedding in its own backward unit */
    dsk_tensor y, hf, rstdf, logits, dlogits; /* block output, final norm, head */
    dsk_tensor loss;                    /* scalar f32 */
    tf8_act f8_in;                      /* --dtype fp8: the projection's input [hn | en] (N, 2D) in e4m3 */
} tmla_mtp;

/* Model-wide MLA/MTP state: backward scratch and the MTP modules. */
typedef struct tmla_model {
    dsk_tensor pe, pe2;                 /* (N, H*rope) contiguous rope parts */
    dsk_tensor dpe1, dkpe;              /* (N, rope) */
    dsk_tensor dq, dk, dkvb, datt;      /* MLA gradients */
    dsk_tensor dc, dc2, dcq, dcq2;      /* latent gradients */
    dsk_tensor yscr;                    /* (N, D) --recompute full: dense FFN output while recomputing */
    tmla_mtp mtp[TMLA_MAX_MTP];
    dsk_tensor ry_in, ry_out;           /* (N, H*4) YaRN rotation scratch (one pair at a time) */
    float ry_theta[TMLA_MAX_ROPE / 2];  /* YaRN: per pair i the theta with which dsk_rope's second pair of four
                                           turns at pair i's ramped frequency: theta_i = f_i^-2 */
    dsk_tensor dcarry, dtmp;            /* (N, D) MTP backward */
    tf8_act f8_att;                     /* --dtype fp8: Wo's input (N, H*v) in e4m3, quantised from the bf16 attention
                                           output (which the core's backward reads) in forward and again in backward */
    dsk_tensor cat;                     /* (N, 2D) --dtype fp8 and --mtp: [hn | en], then its gradient */
    int eval;                           /* 1: forward passes skip the MTP modules */
    int64_t heads;                      /* heads this rank runs [0: all]; train_par.h: n_heads / tp */
    int unit_ready;                     /* 1: the caller marks gradients final per unit (train_par.h), not the
                                           MLA backward per parameter */
} tmla_model;

static inline int tmla_is_mla(const tmla_config *a) { return a->attn == TMLA_ATTN_MLA; }

/* The weights (out, in) of the FP8 linears, pairs in sh, which size their scratch (train_fp8.h), absent ones (0, 0):
   an MLA block's with H heads (Wq or Wq_a, Wq_b, Wkv_a's latent and rope-key rows, Wkv_b, Wo), or MHA's projections
   of Dl columns or rows (the rank's heads), the dense FFN's of Fl and the MTP projection (Dt, 2 Dt) (0: none). */
#define TMLA_FP8_SHAPES 11
static inline int tmla_fp8_shapes(const tmla_config *a, int64_t H, int64_t D, int64_t Dl, int64_t Fl, int64_t Dt,
                                  int64_t sh[2 * TMLA_FP8_SHAPES]) {
    int64_t m = tmla_is_mla(a), ql = m * a->q_lora_rank, kv = m * a->kv_lora_rank, dr = m * a->qk_rope_dim, mD = m * D;
    int64_t hq = m * H * (a->qk_nope_dim + a->qk_rope_dim), q0 = ql > 0 ? ql : hq, q1 = ql > 0 ? hq : 0;
    int64_t kvb = m * H * (a->qk_nope_dim + a->v_head_dim), o = m * H * a->v_head_dim, hD = (1 - m) * D;
    int64_t hDl = (1 - m) * Dl, fD = Fl > 0 ? D : 0, t2 = 2 * Dt;
    const int64_t s[2 * TMLA_FP8_SHAPES] = {q0, mD,  q1, ql, kv,  mD, dr, mD, kvb, kv, mD,
                                            o,  hDl, hD, hD, hDl, Fl, fD, fD, Fl,  Dt, t2};
    memcpy(sh, s, sizeof s);
    return TMLA_FP8_SHAPES;
}

/* ------------------------------------------------------------------ prototypes (train_model.h calls these) */

static void tmla_declare_attn(struct tm_model *m, int l);
static void tmla_declare_mtp(struct tm_model *m);
static dsk_status tmla_check_config(const void *cfg);
static int tmla_custom_alloc(const struct tm_model *m);
static dsk_status tmla_alloc_block(struct tm_model *m, int l);
static dsk_status tmla_alloc(struct tm_model *m);
static void tmla_free(struct tm_model *m);
static dsk_status tmla_attn_forward(struct tm_model *m, struct tm_block *b, int nb);
static dsk_status tmla_attn_backward(struct tm_model *m, struct tm_block *b);
static dsk_status tmla_recompute_core(struct tm_model *m, struct tm_block *b);
static dsk_status tmla_recompute_block(struct tm_model *m, int l);
static dsk_status tmla_cache(struct tm_model *m, int l, tf8_act *a, int need, int64_t k);
static dsk_status tmla_mtp_embed(struct tm_model *m, int nb);
static dsk_status tmla_mtp_forward(struct tm_model *m, int nb);
static dsk_status tmla_mtp_loss(struct tm_model *m, float grad_scale);
static dsk_status tmla_mtp_backward(struct tm_model *m);
static dsk_status tmla_mtp_embed_backward(struct tm_model *m);
static dsk_status tmla_seed_dx(struct tm_model *m);

#elif defined(TRAIN_MODEL_H_DONE) && !defined(TRAIN_MLA_BODY)
#define TRAIN_MLA_BODY

/* ------------------------------------------------------------------ helpers */

/* Rows [0, nb*T) of an (N, H*d) tensor as (nb, T, H, d). */
static dsk_tensor tmla_heads(const tm_model *m, const dsk_tensor *t, int nb, int64_t H, int64_t d) {
    int64_t sh[4] = {nb, m->cfg.seq, H, d};
    dsk_tensor r = tm_rows(t, (int64_t)nb * m->cfg.seq), v;
    dsk_tensor_reshape(&r, 4, sh, &v);
    return v;
}

/* The heads this rank's MLA runs (their rows of Wq/Wq_b and Wkv_b, columns of Wo). */
static int64_t tmla_nh(const tm_model *m) { return m->mla.heads > 0 ? m->mla.heads : m->cfg.n_heads; }

/* p's gradient is final (unless the caller marks whole units: tmla_model.unit_ready). */
static dsk_status tmla_ready(tm_model *m, struct tm_param *p) { return m->mla.unit_ready ? DSK_OK : tm_ready(m, p); }

/* Columns [c0, c0 + n) of the last dim (a strided view). */
static dsk_tensor tmla_cols(const dsk_tensor *t, int64_t c0, int64_t n) {
    dsk_tensor v;
    dsk_tensor_slice(t, t->ndim - 1, c0, n, &v);
    return v;
}

/* Rows [r0, r0 + n) of a matrix (a weight's output rows: contiguous). */
static dsk_tensor tmla_wrows(const dsk_tensor *t, int64_t r0, int64_t n) {
    dsk_tensor v;
    dsk_tensor_slice(t, 0, r0, n, &v);
    return v;
}

/* The first nb sequences of a (B, H, T) row-statistics tensor. */
static dsk_tensor tmla_lse(const dsk_tensor *lse, int nb) {
    dsk_tensor v;
    dsk_tensor_slice(lse, 0, 0, nb, &v);
    return v;
}

/* Softmax scale of MLA: (nope + rope)^-1/2, with the reference's long-context factor mscale^2. */
static float tmla_scale(const tm_config *c) {
    const tmla_config *a = &c->mla;
    float s = 1.0f / sqrtf((float)(a->qk_nope_dim + a->qk_rope_dim));
    if (a->original_seq > 0 && (c->seq > a->original_seq || a->yarn) && a->rope_factor > 1.0f) {
        float ms = 0.1f * a->mscale * logf(a->rope_factor) + 1.0f;
        s *= ms * ms;
    }
    return s;
}

static float tmla_latent_eps(const tm_config *c) { return c->mla.latent_eps > 0 ? c->mla.latent_eps : c->norm_eps; }

/* YaRN's frequency of rope pair i of d dims, as transformers' _compute_yarn_parameters (f32
   like torch; the correction range in double like its math): the extrapolated base^(-2i/d)
   and the interpolated one (/ factor) blended by a ramp between the dims that turn beta_fast
   and beta_slow times over the original length (floored, ceiled, clamped to [0, d - 1]). */
static float tmla_yarn_freq(const tmla_config *a, float base, int i) {
    const double two_pi = 6.283185307179586;
    int d = a->qk_rope_dim;
    double lo = floor(d * log(a->original_seq / (a->beta_fast * two_pi)) / (2 * log((double)base)));
    double hi = ceil(d * log(a->original_seq / (a->beta_slow * two_pi)) / (2 * log((double)base)));
    float pos = powf(base, (float)(2 * i) / (float)d), ext = 1.0f / pos, inter = 1.0f / (a->rope_factor * pos);
    lo = lo < 0 ? 0 : lo;
    hi = hi > d - 1 ? d - 1 : hi;
    if (lo == hi) hi += 0.001;
    float ramp = ((float)i - (float)lo) / (float)(hi - lo);
    float keep = 1.0f - (ramp < 0.0f ? 0.0f : ramp > 1.0f ? 1.0f : ramp); /* share of the extrapolated frequency */
    return inter * (1.0f - keep) + ext * keep;
}

/* y (nb, T, Hx, rope) = rope(x) (inverse 0; y may alias x) or the backward rotation of x
   (inverse 1; y written). Plain RoPE is one dsk_rope call; under
   YaRN each pair i turns at its own frequency f_i: it is copied into the second pair of a
   four-dim scratch head, which dsk_rope turns at theta_i^(-2/4) = f_i, and copied back. */
static dsk_status tmla_rotate(tm_model *m, dsk_tensor *y, const dsk_tensor *x, int inverse) {
    const tm_config *c = &m->cfg;
    tmla_model *s = &m->mla;
    if (!c->mla.yarn) {
        if (!inverse) return dsk_rope(m->ctx, y, x, 0, c->rope_theta);
        return dsk_rope_backward(m->ctx, y, x, 0, c->rope_theta, DSK_GRAD_WRITE);
    }
    int64_t sh[4] = {x->shape[0], x->shape[1], x->shape[2], 4}, n = sh[0] * sh[1] * sh[2] * 4;
    int64_t all = dsk_tensor_numel(&s->ry_in);
    dsk_tensor fi, fo, fi1, fo1, in, out; /* the scratch's first n elements as (nb, T, Hx, 4) */
    TM_TRY(dsk_tensor_reshape(&s->ry_in, 1, &all, &fi));
    TM_TRY(dsk_tensor_reshape(&s->ry_out, 1, &all, &fo));
    TM_TRY(dsk_tensor_slice(&fi, 0, 0, n, &fi1));
    TM_TRY(dsk_tensor_slice(&fo, 0, 0, n, &fo1));
    TM_TRY(dsk_tensor_reshape(&fi1, 4, sh, &in));
    TM_TRY(dsk_tensor_reshape(&fo1, 4, sh, &out));
    dsk_tensor in2 = tmla_cols(&in, 2, 2), out2 = tmla_cols(&out, 2, 2);
    for (int64_t i = 0; i < x->shape[3] / 2; i++) {
        dsk_tensor xp = tmla_cols(x, 2 * i, 2), yp = tmla_cols(y, 2 * i, 2);
        TM_TRY(dsk_tensor_copy(m->ctx, &in2, &xp));
        if (inverse) {
            TM_TRY(dsk_rope_backward(m->ctx, &out, &in, 0, s->ry_theta[i], DSK_GRAD_WRITE));
        } else {
            TM_TRY(dsk_rope(m->ctx, &out, &in, 0, s->ry_theta[i]));
        }
        TM_TRY(dsk_tensor_copy(m->ctx, &yp, &out2));
    }
    return DSK_OK;
}

/* ------------------------------------------------------------------ parameters */

/* The MLA parameters of block l in slab order (backward finishes them in reverse). */
static void tmla_declare_attn(tm_model *m, int l) {
    const tm_config *c = &m->cfg;
    const tmla_config *a = &c->mla;
    tmla_block *p = &m->blocks[l].mla;
    int64_t D = c->d_model, H = c->n_heads, dqk = a->qk_nope_dim + a->qk_rope_dim;
    float std = c->init_std, out_std = c->init_std / sqrtf(2.0f * (float)c->n_layers);
    if (a->q_lora_rank > 0) {
        p->wq_a = tm_add_param(m, 1, std, 2, a->q_lora_rank, D, "blocks.%d.attn.wq_a", l);
        p->q_norm = tm_add_param(m, 0, 0, 1, a->q_lora_rank, 0, "blocks.%d.attn.q_norm", l);
        p->wq_b = tm_add_param(m, 1, std, 2, H * dqk, a->q_lora_rank, "blocks.%d.attn.wq_b", l);
    } else {
        p->wq = tm_add_param(m, 1, std, 2, H * dqk, D, "blocks.%d.attn.wq", l);
    }
    p->wkv_a = tm_add_param(m, 1, std, 2, a->kv_lora_rank + a->qk_rope_dim, D, "blocks.%d.attn.wkv_a", l);
    p->kv_norm = tm_add_param(m, 0, 0, 1, a->kv_lora_rank, 0, "blocks.%d.attn.kv_norm", l);
    p->wkv_b =
        tm_add_param(m, 1, std, 2, H * (a->qk_nope_dim + a->v_head_dim), a->kv_lora_rank, "blocks.%d.attn.wkv_b", l);
    p->wo = tm_add_param(m, 1, out_std, 2, D, H * a->v_head_dim, "blocks.%d.attn.wo", l);
}

/* The MTP modules' parameters, after the LM head: backward finishes them first (depth D
   first). Module k's block is blocks[n_layers + k - 1], named like a layer after the last. */
static void tmla_declare_mtp(tm_model *m) {
    const tm_config *c = &m->cfg;
    int64_t D = c->d_model, F = c->ffn_hidden;
    float std = c->init_std, out_std = c->init_std / sqrtf(2.0f * (float)c->n_layers);
    for (int k = 0; k < c->mla.mtp_depth; k++) {
        int l = c->n_layers + k;
        tmla_mtp *t = &m->mla.mtp[k];
        tm_block *b = &m->blocks[l];
        t->hnorm = tm_add_param(m, 0, 0, 1, D, 0, "blocks.%d.mtp.hnorm", l);
        t->enorm = tm_add_param(m, 0, 0, 1, D, 0, "blocks.%d.mtp.enorm", l);
        t->proj = tm_add_param(m, 1, std, 2, D, 2 * D, "blocks.%d.mtp.proj", l);
        tm_declare_attention(m, l, std, out_std);
        for (int i = 0; b->is_moe && i < b->moe.n_params; i++) /* router, shared experts (experts: tm_declare) */
            if (b->moe.params[i].trainable && !b->moe.params[i].expert_sharded) tm_add_moe_param(m, l, i);
        if (!b->is_moe) {
            b->w1 = tm_add_param(m, 1, std, 2, F, D, "blocks.%d.ffn.w1", l);
            b->w3 = tm_add_param(m, 1, std, 2, F, D, "blocks.%d.ffn.w3", l);
            b->w2 = tm_add_param(m, 1, out_std, 2, D, F, "blocks.%d.ffn.w2", l);
        }
        t->norm = tm_add_param(m, 0, 0, 1, D, 0, "blocks.%d.mtp.norm", l);
    }
}

/* Checks the MLA, MTP and recompute settings; every message names the flag. */
static dsk_status tmla_check_config(const void *cfg) {
    const tm_config *c = (const tm_config *)cfg;
    const tmla_config *a = &c->mla;
    if (a->attn != TMLA_ATTN_MHA && a->attn != TMLA_ATTN_MLA) return dsk_set_error(DSK_ERR_ARG, "--attn: mha or mla");
    if (a->recompute < TMLA_RECOMPUTE_NONE || a->recompute > TMLA_RECOMPUTE_FULL)
        return dsk_set_error(DSK_ERR_ARG, "--recompute: none, attn or full");
    if (a->mtp_depth < 0 || a->mtp_depth > TMLA_MAX_MTP || a->mtp_depth >= c->seq)
        return dsk_set_error(DSK_ERR_ARG, "--mtp %d: between 0 and %d, and below --seq %d", a->mtp_depth, TMLA_MAX_MTP,
                             c->seq);
    if (!(a->mtp_lambda >= 0.0f))
        return dsk_set_error(DSK_ERR_ARG, "--mtp-lambda %g: must be >= 0", (double)a->mtp_lambda);
    if (a->mtp_moe && a->mtp_depth > 0 && c->n_dense >= c->n_layers)
        return dsk_set_error(DSK_ERR_ARG, "--mtp-ffn moe: the model has no MoE layer (--dense-layers %d of --layers %d)",
                             c->n_dense, c->n_layers);
    if (!tmla_is_mla(a)) return DSK_OK;
    if (a->q_lora_rank < 0 || a->kv_lora_rank < 1 || a->qk_nope_dim < 0 || a->qk_rope_dim < 2 || a->v_head_dim < 1)
        return dsk_set_error(DSK_ERR_ARG,
                             "MLA sizes: --q-lora-rank %d (>= 0), --kv-lora-rank %d (>= 1), --qk-nope-dim %d (>= 0), "
                             "--qk-rope-dim %d (>= 2), --v-head-dim %d (>= 1)",
                             a->q_lora_rank, a->kv_lora_rank, a->qk_nope_dim, a->qk_rope_dim, a->v_head_dim);
    if (a->qk_rope_dim % 2 != 0)
        return dsk_set_error(DSK_ERR_ARG, "--qk-rope-dim %d must be even for rotary embeddings", a->qk_rope_dim);
    if (a->qk_rope_dim > TMLA_MAX_ROPE)
        return dsk_set_error(DSK_ERR_ARG, "--qk-rope-dim %d: at most %d", a->qk_rope_dim, TMLA_MAX_ROPE);
    if (a->yarn && (a->original_seq < 1 || !(a->beta_fast > 0.0f) || !(a->beta_slow > 0.0f)))
        return dsk_set_error(DSK_ERR_ARG, "YaRN: original length %d (>= 1), beta_fast %g and beta_slow %g (> 0)",
                             a->original_seq, (double)a->beta_fast, (double)a->beta_slow);
    if (a->original_seq < 0 || (a->original_seq > 0 && !(a->rope_factor >= 1.0f)))
        return dsk_set_error(DSK_ERR_ARG, "--original-seq %d (>= 0) with --rope-factor %g (>= 1)", a->original_seq,
                             (double)a->rope_factor);
    return DSK_OK;
}

/* ------------------------------------------------------------------ activations */

/* An FP8 cache of n rows of k columns through the model's allocator, which a plan counts. */
static dsk_status tmla_alloc_cache(tm_model *m, tf8_act *a, int64_t n, int64_t k) {
    return tf8_act_alloc(tm_alloc_nd, m, a, n, k);
}

/* Block l's FP8 cache a (N x k), or block 0's when its backward recomputes the input (mode >= need) and quantises
   it again (the same codes): shared as the recomputed bf16 activations are (an MTP block keeps its own). */
static dsk_status tmla_cache(tm_model *m, int l, tf8_act *a, int need, int64_t k) {
    const tm_config *c = &m->cfg;
    const tf8_act *src = (const tf8_act *)((const char *)m->blocks + ((const char *)a - (const char *)&m->blocks[l]));
    if (l == 0 || l >= c->n_layers || c->mla.recompute < need || !src->q.data)
        return tmla_alloc_cache(m, a, (int64_t)c->batch * c->seq, k);
    *a = *src;
    a->q.owns = a->s.owns = 0;
    return DSK_OK;
}

/* 1 when train_mla.h allocates the blocks' activations (MLA, or shared buffers). */
static int tmla_custom_alloc(const tm_model *m) {
    return tmla_is_mla(&m->cfg.mla) || m->cfg.mla.recompute != TMLA_RECOMPUTE_NONE || m->cfg.mla.mtp_depth > 0;
}

/* Allocates t (N rows by `cols`, or (N) when cols == 0), or with `share` makes it a view of
   the same tensor of block 0 where block 0 has it (the shared buffers of recomputation and of FP8). */
static dsk_status tmla_act(tm_model *m, tm_block *b, dsk_tensor *t, int share, dsk_dtype dt, int64_t cols) {
    const dsk_tensor *src = (const dsk_tensor *)((const char *)&m->blocks[0] + ((const char *)t - (const char *)b));
    if (share && b != &m->blocks[0] && src->data) {
        *t = *src;
        t->owns = 0;
        return DSK_OK;
    }
    return tm_alloc2(m, t, dt, (int64_t)m->cfg.batch * m->cfg.seq, cols);
}

/* Block l's activations; main blocks share all but their input under --recompute full and
   the attention core's output and statistics under --recompute attn. MTP blocks own theirs,
   except that under --dtype fp8 every block shares the inputs only its FP8 linears read (kept in
   their e4m3 caches): h1, a dense FFN's h2 and a, MHA's attention output, MLA's normed latents. */
static dsk_status tmla_alloc_block(tm_model *m, int l) {
    const tm_config *c = &m->cfg;
    const tmla_config *a = &c->mla;
    tm_block *b = &m->blocks[l];
    tmla_block *p = &b->mla;
    int mode = l < c->n_layers ? a->recompute : TMLA_RECOMPUTE_NONE;
    int full = mode == TMLA_RECOMPUTE_FULL, core = mode != TMLA_RECOMPUTE_NONE;
    int dense = l < c->n_dense || (l >= c->n_layers && !a->mtp_moe), f8 = full || c->fp8;
    int64_t D = c->d_model, F = c->ffn_hidden, H = c->n_heads;
    dsk_dtype dt = c->cdt;
    p->recompute = mode;
    TM_TRY(tmla_act(m, b, &b->x, 0, dt, D));
    TM_TRY(tmla_act(m, b, &b->h1, f8, dt, D));
    TM_TRY(tmla_act(m, b, &b->x2, full, dt, D));
    TM_TRY(tmla_act(m, b, &b->h2, dense ? f8 : full, dt, D)); /* an MoE layer's input stays */
    TM_TRY(tmla_act(m, b, &b->rstd1, full, DSK_F32, 0));
    TM_TRY(tmla_act(m, b, &b->rstd2, full, DSK_F32, 0));
    if (dense) {
        TM_TRY(tmla_act(m, b, &b->g, full, dt, F));
        TM_TRY(tmla_act(m, b, &b->u, full, dt, F));
        TM_TRY(tmla_act(m, b, &b->a, f8, dt, F));
    }
    if (!tmla_is_mla(a)) {
        dsk_tensor *md[] = {&b->q, &b->k, &b->v, &b->qr, &b->kr};
        for (size_t i = 0; i < sizeof md / sizeof md[0]; i++) TM_TRY(tmla_act(m, b, md[i], full, dt, D));
        TM_TRY(tmla_act(m, b, &b->att, core || c->fp8, dt, D));
        if (core && b != &m->blocks[0]) return tmla_act(m, b, &b->probs, 1, DSK_F32, 0);
        int64_t ps[4] = {c->batch, H, c->seq, c->seq};
        return tm_alloc_nd(m, &b->probs, DSK_F32, 4, ps);
    }
    int64_t dn = a->qk_nope_dim, dr = a->qk_rope_dim, dv = a->v_head_dim, dqk = dn + dr;
    if (a->q_lora_rank > 0) {
        TM_TRY(tmla_act(m, b, &p->cq, full, dt, a->q_lora_rank));
        TM_TRY(tmla_act(m, b, &p->cqn, f8, dt, a->q_lora_rank));
        TM_TRY(tmla_act(m, b, &p->rstd_q, full, DSK_F32, 0));
    }
    TM_TRY(tmla_act(m, b, &p->q, full, dt, H * dqk));
    TM_TRY(tmla_act(m, b, &p->ckv, full, dt, a->kv_lora_rank));
    TM_TRY(tmla_act(m, b, &p->ckvn, f8, dt, a->kv_lora_rank));
    if (c->fp8 && a->q_lora_rank > 0) TM_TRY(tmla_cache(m, l, &p->f8_cqn, TMLA_RECOMPUTE_FULL, a->q_lora_rank));
    if (c->fp8) TM_TRY(tmla_cache(m, l, &p->f8_ckvn, TMLA_RECOMPUTE_FULL, a->kv_lora_rank)); /* the up-projections' */
    TM_TRY(tmla_act(m, b, &p->rstd_kv, full, DSK_F32, 0));
    TM_TRY(tmla_act(m, b, &p->kpe, full, dt, dr));
    TM_TRY(tmla_act(m, b, &p->kvb, full, dt, H * (dn + dv)));
    TM_TRY(tmla_act(m, b, &p->k, full, dt, H * dqk));
    TM_TRY(tmla_act(m, b, &p->att, core, dt, H * dv));
    if (core && b != &m->blocks[0]) return tmla_act(m, b, &p->lse, 1, DSK_F32, 0);
    int64_t ls[3] = {c->batch, H, c->seq};
    return tm_alloc_nd(m, &p->lse, DSK_F32, 3, ls);
}

/* The MLA backward scratch and rope tables for N rows and H heads (the one-rank model: the
   batch and every head; train_par.h: a micro-batch and the rank's heads). */
static dsk_status tmla_alloc_scratch(tm_model *m, int64_t N, int64_t H) {
    const tm_config *c = &m->cfg;
    const tmla_config *a = &c->mla;
    tmla_model *s = &m->mla;
    dsk_dtype dt = c->cdt;
    int64_t dn = a->qk_nope_dim, dr = a->qk_rope_dim, dv = a->v_head_dim, dqk = dn + dr;
    TM_TRY(tm_alloc2(m, &s->pe, dt, N, H * dr));
    TM_TRY(tm_alloc2(m, &s->pe2, dt, N, H * dr));
    TM_TRY(tm_alloc2(m, &s->dpe1, dt, N, dr));
    TM_TRY(tm_alloc2(m, &s->dkpe, dt, N, dr));
    TM_TRY(tm_alloc2(m, &s->dq, dt, N, H * dqk));
    TM_TRY(tm_alloc2(m, &s->dk, dt, N, H * dqk));
    TM_TRY(tm_alloc2(m, &s->dkvb, dt, N, H * (dn + dv)));
    TM_TRY(tm_alloc2(m, &s->datt, dt, N, H * dv));
    TM_TRY(tm_alloc2(m, &s->dc, dt, N, a->kv_lora_rank));
    TM_TRY(tm_alloc2(m, &s->dc2, dt, N, a->kv_lora_rank));
    if (c->fp8) TM_TRY(tmla_alloc_cache(m, &s->f8_att, N, H * dv));
    if (a->q_lora_rank > 0) {
        TM_TRY(tm_alloc2(m, &s->dcq, dt, N, a->q_lora_rank));
        TM_TRY(tm_alloc2(m, &s->dcq2, dt, N, a->q_lora_rank));
    }
    if (a->yarn) {
        TM_TRY(tm_alloc2(m, &s->ry_in, dt, N, H * 4));
        TM_TRY(tm_alloc2(m, &s->ry_out, dt, N, H * 4));
        if (!m->cfg.plan_bytes) TM_TRY(tm_zero(m, &s->ry_in)); /* its first pair turns unused: finite */
        for (int i = 0; i < a->qk_rope_dim / 2; i++) {
            double f = tmla_yarn_freq(a, c->rope_theta, i);
            s->ry_theta[i] = (float)(1.0 / (f * f));
        }
    }
    return DSK_OK;
}

/* Model-wide MLA scratch, the MTP blocks and modules. */
static dsk_status tmla_alloc(tm_model *m) {
    const tm_config *c = &m->cfg;
    const tmla_config *a = &c->mla;
    tmla_model *s = &m->mla;
    int64_t N = (int64_t)c->batch * c->seq, D = c->d_model, V = c->vocab;
    dsk_dtype dt = c->cdt;
    if (tmla_is_mla(a)) TM_TRY(tmla_alloc_scratch(m, N, c->n_heads));
    if (a->recompute == TMLA_RECOMPUTE_FULL && c->n_dense > 0) TM_TRY(tm_alloc2(m, &s->yscr, dt, N, D));
    for (int k = 0; k < a->mtp_depth; k++) {
        tmla_mtp *t = &s->mtp[k];
        TM_TRY(tmla_alloc_block(m, c->n_layers + k));
        dsk_tensor *nd[] = {&t->emb, &t->en, &t->hn, &t->y, &t->hf, &t->demb};
        for (size_t i = 0; i < sizeof nd / sizeof nd[0]; i++) TM_TRY(tm_alloc2(m, nd[i], dt, N, D));
        TM_TRY(tm_alloc2(m, &t->rstd_e, DSK_F32, N, 0));
        TM_TRY(tm_alloc2(m, &t->rstd_h, DSK_F32, N, 0));
        TM_TRY(tm_alloc2(m, &t->rstdf, DSK_F32, N, 0));
        TM_TRY(tm_alloc2(m, &t->logits, dt, N, V));
        TM_TRY(tm_alloc2(m, &t->dlogits, dt, N, V));
        TM_TRY(tm_alloc2(m, &t->ids, DSK_I32, N, 0));
        TM_TRY(tm_alloc2(m, &t->tgt, DSK_I32, N, 0));
        TM_TRY(tm_alloc_nd(m, &t->loss, DSK_F32, 0, NULL));
        if (c->fp8) TM_TRY(tmla_alloc_cache(m, &t->f8_in, N, 2 * D));
    }
    if (a->mtp_depth > 0) {
        TM_TRY(tm_alloc2(m, &s->dcarry, dt, N, D));
        TM_TRY(tm_alloc2(m, &s->dtmp, dt, N, D));
        if (c->fp8) TM_TRY(tm_alloc2(m, &s->cat, dt, N, 2 * D));
    }
    return DSK_OK;
}

static void tmla_free_block(dsk_ctx *ctx, tm_block *b) {
    tmla_block *p = &b->mla;
    dsk_tensor *ts[] = {&p->cq, &p->cqn, &p->rstd_q, &p->q, &p->ckv, &p->ckvn, &p->rstd_kv, &p->kpe, &p->kvb, &p->k,
                        &p->att, &p->lse};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dsk_tensor_free(ctx, ts[i]);
    tf8_act_free(ctx, &p->f8_cqn);
    tf8_act_free(ctx, &p->f8_ckvn);
}

/* Frees what train_mla.h allocated (views are only zeroed). Before tm_free's own loop. */
static void tmla_free(tm_model *m) {
    dsk_ctx *ctx = m->ctx;
    tmla_model *s = &m->mla;
    if (m->blocks) {
        for (int l = 0; l < m->cfg.n_layers; l++) tmla_free_block(ctx, &m->blocks[l]);
        for (int k = 0; k < m->cfg.mla.mtp_depth; k++) /* the rest of an MTP block: tm_free */
            tmla_free_block(ctx, &m->blocks[m->cfg.n_layers + k]);
    }
    for (int k = 0; k < TMLA_MAX_MTP; k++) {
        tmla_mtp *t = &s->mtp[k];
        dsk_tensor *ts[] = {&t->ids, &t->tgt, &t->emb, &t->en, &t->rstd_e, &t->hn, &t->rstd_h, &t->y, &t->hf, &t->rstdf,
                            &t->logits, &t->dlogits, &t->loss, &t->demb};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dsk_tensor_free(ctx, ts[i]);
        tf8_act_free(ctx, &t->f8_in);
    }
    dsk_tensor *ts[] = {&s->pe,  &s->pe2, &s->dpe1, &s->dkpe, &s->dq,     &s->dk,   &s->dkvb,  &s->datt,   &s->dc,
                        &s->dc2, &s->dcq, &s->dcq2, &s->yscr, &s->dcarry, &s->dtmp, &s->ry_in, &s->ry_out, &s->cat};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dsk_tensor_free(ctx, ts[i]);
    tf8_act_free(ctx, &s->f8_att);
}

/* ------------------------------------------------------------------ MLA forward and backward */

/* The attention core of an MLA block for nb sequences: att and lse from q, k and kvb. */
static dsk_status tmla_core(tm_model *m, tm_block *b, int nb) {
    const tm_config *c = &m->cfg;
    const tmla_config *a = &c->mla;
    tmla_block *p = &b->mla;
    int64_t H = tmla_nh(m), dn = a->qk_nope_dim, dv = a->v_head_dim, dqk = dn + a->qk_rope_dim;
    dsk_tensor q4 = tmla_heads(m, &p->q, nb, H, dqk), k4 = tmla_heads(m, &p->k, nb, H, dqk);
    dsk_tensor kvb4 = tmla_heads(m, &p->kvb, nb, H, dn + dv), v4 = tmla_cols(&kvb4, dn, dv);
    dsk_tensor att4 = tmla_heads(m, &p->att, nb, H, dv), lse = tmla_lse(&p->lse, nb);
    TM_T(TM_PH_ATTN, dsk_attention_fused(m->ctx, &att4, &lse, &q4, &k4, &v4, tmla_scale(c)));
    return DSK_OK;
}

/* The attention of an MLA block from its normed input h1 (nb sequences, every row of the
   micro-batch): the latents, queries, keys and values of this rank's heads and the core, att
   and lse; everything backward needs saved. Under --dtype fp8 the linears run in FP8 from
   the e4m3 caches of h1 (b->f8_h1) and of the normed latents (tm_linear). */
static dsk_status tmla_latent_forward(tm_model *m, tm_block *b, int nb, const dsk_tensor *h1) {
    const tm_config *c = &m->cfg;
    const tmla_config *a = &c->mla;
    tmla_block *p = &b->mla;
    tmla_model *s = &m->mla;
    int64_t N = (int64_t)nb * c->seq, H = tmla_nh(m), dn = a->qk_nope_dim, dr = a->qk_rope_dim, dqk = dn + dr;
    int64_t R = a->kv_lora_rank;
    dsk_tensor q = tm_rows(&p->q, N), ckv = tm_rows(&p->ckv, N), ckvn = tm_rows(&p->ckvn, N);
    dsk_tensor rkv = tm_rows(&p->rstd_kv, N), kpe = tm_rows(&p->kpe, N), kvb = tm_rows(&p->kvb, N);
    TM_T(TM_PH_LINEAR, tm_keep(m, &b->f8_h1, h1));
    if (a->q_lora_rank > 0) {
        dsk_tensor cq = tm_rows(&p->cq, N), cqn = tm_rows(&p->cqn, N), rq = tm_rows(&p->rstd_q, N);
        TM_T(TM_PH_LINEAR, tm_linear(m, &cq, h1, &b->f8_h1, &p->wq_a->wc, 0.0f));
        TM_T(TM_PH_NORM, dsk_rmsnorm(m->ctx, &cqn, &rq, &cq, &p->q_norm->wc, tmla_latent_eps(c)));
        TM_T(TM_PH_LINEAR, tm_keep(m, &p->f8_cqn, &cqn));
        TM_T(TM_PH_LINEAR, tm_linear(m, &q, &cqn, &p->f8_cqn, &p->wq_b->wc, 0.0f));
    } else {
        TM_T(TM_PH_LINEAR, tm_linear(m, &q, h1, &b->f8_h1, &p->wq->wc, 0.0f));
    }
    /* rotate the rope part of every query head through a contiguous copy */
    dsk_tensor q4 = tmla_heads(m, &p->q, nb, H, dqk), qpe = tmla_cols(&q4, dn, dr),
               pe4 = tmla_heads(m, &s->pe, nb, H, dr);
    TM_T(TM_PH_MOVE, dsk_tensor_copy(m->ctx, &pe4, &qpe));
    TM_T(TM_PH_ROPE, tmla_rotate(m, &pe4, &pe4, 0));
    TM_T(TM_PH_MOVE, dsk_tensor_copy(m->ctx, &qpe, &pe4));
    /* [c | kr] = Wkv_a h1 as two products over the weight's row blocks */
    dsk_tensor wc = tmla_wrows(&p->wkv_a->wc, 0, R), wr = tmla_wrows(&p->wkv_a->wc, R, dr);
    TM_T(TM_PH_LINEAR, tm_linear(m, &ckv, h1, &b->f8_h1, &wc, 0.0f));
    TM_T(TM_PH_LINEAR, tm_linear(m, &kpe, h1, &b->f8_h1, &wr, 0.0f));
    dsk_tensor kpe4 = tmla_heads(m, &p->kpe, nb, 1, dr);
    TM_T(TM_PH_ROPE, tmla_rotate(m, &kpe4, &kpe4, 0));
    TM_T(TM_PH_NORM, dsk_rmsnorm(m->ctx, &ckvn, &rkv, &ckv, &p->kv_norm->wc, tmla_latent_eps(c)));
    TM_T(TM_PH_LINEAR, tm_keep(m, &p->f8_ckvn, &ckvn));
    TM_T(TM_PH_LINEAR, tm_linear(m, &kvb, &ckvn, &p->f8_ckvn, &p->wkv_b->wc, 0.0f));
    /* keys: [k_nope_h | rope key], the rope key broadcast over the heads (stride 0) */
    dsk_tensor kvb4 = tmla_heads(m, &p->kvb, nb, H, dn + a->v_head_dim), k4 = tmla_heads(m, &p->k, nb, H, dqk);
    dsk_tensor kn = tmla_cols(&k4, 0, dn), kr = tmla_cols(&k4, dn, dr), kvn = tmla_cols(&kvb4, 0, dn), kb = kpe4;
    kb.shape[2] = H;
    kb.stride[2] = 0;
    TM_T(TM_PH_MOVE, dsk_tensor_copy(m->ctx, &kn, &kvn));
    TM_T(TM_PH_MOVE, dsk_tensor_copy(m->ctx, &kr, &kb));
    return tmla_core(m, b, nb);
}

/* Attention half of an MLA block: x -> x2 and h2 = RMSNorm(x2), everything backward needs saved. */
static dsk_status tmla_attn_forward(tm_model *m, tm_block *b, int nb) {
    const tm_config *c = &m->cfg;
    tmla_block *p = &b->mla;
    int64_t N = (int64_t)nb * c->seq;
    dsk_tensor x = tm_rows(&b->x, N), h1 = tm_rows(&b->h1, N), rstd1 = tm_rows(&b->rstd1, N);
    TM_T(TM_PH_NORM, dsk_rmsnorm(m->ctx, &h1, &rstd1, &x, &b->ln1->wc, c->norm_eps));
    TM_TRY(tmla_latent_forward(m, b, nb, &h1));
    dsk_tensor att = tm_rows(&p->att, N), x2 = tm_rows(&b->x2, N), h2 = tm_rows(&b->h2, N),
               rstd2 = tm_rows(&b->rstd2, N);
    TM_T(TM_PH_MOVE, dsk_tensor_copy(m->ctx, &x2, &x));
    TM_T(TM_PH_LINEAR, tm_keep(m, &m->mla.f8_att, &att));
    TM_T(TM_PH_LINEAR, tm_linear(m, &x2, &att, &m->mla.f8_att, &p->wo->wc, 1.0f));
    TM_T(TM_PH_NORM, dsk_rmsnorm(m->ctx, &h2, &rstd2, &x2, &b->ln2->wc, c->norm_eps));
    return DSK_OK;
}

/* The query path backward from dq (pre-rope gradient) down to the linear that reads h1: with
   a query latent, Wq_b's gradients and the latent norm's. *w is that linear (Wq or Wq_a), *dy
   its output gradient. */
static dsk_status tmla_query_backward(tm_model *m, tm_block *b, tm_param **w, dsk_tensor **dy) {
    tmla_block *p = &b->mla;
    tmla_model *s = &m->mla;
    tm_param *wq_b[1] = {p->wq_b};
    dsk_tensor *dq[1] = {&s->dq};
    *w = m->cfg.mla.q_lora_rank > 0 ? p->wq_a : p->wq;
    *dy = m->cfg.mla.q_lora_rank > 0 ? &s->dcq2 : &s->dq;
    if (m->cfg.mla.q_lora_rank == 0) return DSK_OK;
    TM_TRY(tm_linear_backward(m, TM_PH_LINEAR, 1, wq_b, dq, &p->cqn, &p->f8_cqn, &s->dcq));
    TM_T(TM_PH_MOVE, tm_zero(m, &s->dcq2));
    TM_T(TM_PH_NORM,
         dsk_rmsnorm_backward(m->ctx, &s->dcq2, tm_grad(p->q_norm), &s->dcq, &p->cq, &p->q_norm->wc, &p->rstd_q));
    TM_T(TM_PH_MOVE, tmla_ready(m, p->q_norm));
    return DSK_OK;
}

/* datt holds d(att) of nb sequences: the gradients of this rank's heads into the MLA weights
   (added) and d(h1) into dh (written), h1 the normed input the latent forward took. */
static dsk_status tmla_latent_backward(tm_model *m, tm_block *b, int nb, const dsk_tensor *h1, dsk_tensor *dh) {
    const tm_config *c = &m->cfg;
    const tmla_config *a = &c->mla;
    tmla_block *p = &b->mla;
    tmla_model *s = &m->mla;
    int64_t H = tmla_nh(m), dn = a->qk_nope_dim, dr = a->qk_rope_dim, dv = a->v_head_dim, dqk = dn + dr,
            R = a->kv_lora_rank;
    TM_T(TM_PH_MOVE, tm_zero(m, &s->dq));
    TM_T(TM_PH_MOVE, tm_zero(m, &s->dk));
    TM_T(TM_PH_MOVE, tm_zero(m, &s->dkvb));
    dsk_tensor q4 = tmla_heads(m, &p->q, nb, H, dqk), k4 = tmla_heads(m, &p->k, nb, H, dqk);
    dsk_tensor kvb4 = tmla_heads(m, &p->kvb, nb, H, dn + dv), v4 = tmla_cols(&kvb4, dn, dv);
    dsk_tensor att4 = tmla_heads(m, &p->att, nb, H, dv), datt4 = tmla_heads(m, &s->datt, nb, H, dv);
    dsk_tensor dq4 = tmla_heads(m, &s->dq, nb, H, dqk), dk4 = tmla_heads(m, &s->dk, nb, H, dqk);
    dsk_tensor dkvb4 = tmla_heads(m, &s->dkvb, nb, H, dn + dv), dv4 = tmla_cols(&dkvb4, dn, dv);
    TM_T(TM_PH_ATTN, dsk_attention_fused_backward(m->ctx, &dq4, &dk4, &dv4, &datt4, &q4, &k4, &v4, &att4, &p->lse,
                                                  tmla_scale(c), DSK_GRAD_ADD));
    /* k_nope's gradient goes to its place in Wkv_b's output */
    dsk_tensor dkn = tmla_cols(&dkvb4, 0, dn), dkn_src = tmla_cols(&dk4, 0, dn);
    TM_T(TM_PH_MOVE, dsk_tensor_copy(m->ctx, &dkn, &dkn_src));
    /* the shared rope key: sum over heads, rotate back */
    dsk_tensor pe4 = tmla_heads(m, &s->pe, nb, H, dr), pe24 = tmla_heads(m, &s->pe2, nb, H, dr),
               dkr = tmla_cols(&dk4, dn, dr);
    dsk_tensor dpe1 = tmla_heads(m, &s->dpe1, nb, 1, dr), dkpe4 = tmla_heads(m, &s->dkpe, nb, 1, dr);
    TM_T(TM_PH_MOVE, dsk_tensor_copy(m->ctx, &pe4, &dkr));
    TM_T(TM_PH_ROPE, dsk_reduce(m->ctx, &dpe1, &pe4, 2, DSK_REDUCE_SUM));
    TM_T(TM_PH_ROPE, tmla_rotate(m, &dkpe4, &dpe1, 1));
    /* the queries' rope part: rotate back in place through the scratch */
    dsk_tensor dqr = tmla_cols(&dq4, dn, dr);
    TM_T(TM_PH_MOVE, dsk_tensor_copy(m->ctx, &pe4, &dqr));
    TM_T(TM_PH_ROPE, tmla_rotate(m, &pe24, &pe4, 1));
    TM_T(TM_PH_MOVE, dsk_tensor_copy(m->ctx, &dqr, &pe24));
    /* kv latent path */
    tm_param *wkv_b[1] = {p->wkv_b}, *wq;
    dsk_tensor *dkvb[1] = {&s->dkvb}, *dyq;
    TM_TRY(tm_linear_backward(m, TM_PH_LINEAR, 1, wkv_b, dkvb, &p->ckvn, &p->f8_ckvn, &s->dc));
    TM_T(TM_PH_MOVE, tm_zero(m, &s->dc2));
    TM_T(TM_PH_NORM,
         dsk_rmsnorm_backward(m->ctx, &s->dc2, tm_grad(p->kv_norm), &s->dc, &p->ckv, &p->kv_norm->wc, &p->rstd_kv));
    TM_T(TM_PH_MOVE, tmla_ready(m, p->kv_norm));
    TM_TRY(tmla_query_backward(m, b, &wq, &dyq));
    /* the three linears that read h1: the query's, Wkv_a's latent rows and rope-key rows; dh written */
    dsk_tensor gc = tmla_wrows(&p->wkv_a->g, 0, R), gr = tmla_wrows(&p->wkv_a->g, R, dr);
    dsk_tensor wc = tmla_wrows(&p->wkv_a->wc, 0, R), wr = tmla_wrows(&p->wkv_a->wc, R, dr);
    dsk_tensor *gw[3] = {&wq->g, &gc, &gr}, *dy[3] = {dyq, &s->dc2, &s->dkpe};
    const dsk_tensor *w[3] = {&wq->wc, &wc, &wr};
    TM_TRY(tm_linears_backward(m, TM_PH_LINEAR, 3, gw, w, dy, h1, &b->f8_h1, dh));
    TM_T(TM_PH_MOVE, tmla_ready(m, wq));
    TM_T(TM_PH_MOVE, tmla_ready(m, p->wkv_a));
    return DSK_OK;
}

/* dx holds d(x2); turns it into d(x) and adds the MLA weights' gradients (full micro-batch). */
static dsk_status tmla_attn_backward(tm_model *m, tm_block *b) {
    tmla_block *p = &b->mla;
    int nb = m->cfg.batch;
    tm_param *wo[1] = {p->wo};
    dsk_tensor *dx[1] = {&m->dx};
    if (p->recompute == TMLA_RECOMPUTE_ATTN) TM_TRY(tmla_core(m, b, nb));
    TM_T(TM_PH_LINEAR, tm_keep(m, &m->mla.f8_att, &p->att)); /* fp8: forward's codes again, from the same values */
    TM_TRY(tm_linear_backward(m, TM_PH_LINEAR, 1, wo, dx, &p->att, &m->mla.f8_att, &m->mla.datt)); /* dWo, datt */
    TM_TRY(tmla_latent_backward(m, b, nb, &b->h1, &m->dh));
    TM_T(TM_PH_NORM, dsk_rmsnorm_backward(m->ctx, &m->dx, tm_grad(b->ln1), &m->dh, &b->x, &b->ln1->wc, &b->rstd1));
    TM_T(TM_PH_MOVE, tm_ready(m, b->ln1));
    return DSK_OK;
}

/* ------------------------------------------------------------------ recomputation */

/* --recompute attn, MHA block: the materialised probabilities and output again, before backward. */
static dsk_status tmla_recompute_core(tm_model *m, tm_block *b) {
    const tm_config *c = &m->cfg;
    int nb = c->batch;
    if (b->mla.recompute != TMLA_RECOMPUTE_ATTN) return DSK_OK;
    float scale = 1.0f / sqrtf((float)(c->d_model / c->n_heads));
    dsk_tensor qr4 = tm_heads(m, &b->qr, nb), kr4 = tm_heads(m, &b->kr, nb), v4 = tm_heads(m, &b->v, nb);
    dsk_tensor att4 = tm_heads(m, &b->att, nb);
    TM_T(TM_PH_ATTN, dsk_attention(m->ctx, &att4, &b->probs, &qr4, &kr4, &v4, scale));
    TM_T(TM_PH_LINEAR, tm_keep(m, &b->f8_att, &b->att)); /* fp8: Wo's input into the blocks' one cache again */
    return DSK_OK;
}

/* --recompute full: block l's forward again from its saved input, before its backward (the
   dense FFN's output goes to scratch; an MoE layer's saved state is its own and stays). */
static dsk_status tmla_recompute_block(tm_model *m, int l) {
    tm_block *b = &m->blocks[l];
    if (b->mla.recompute != TMLA_RECOMPUTE_FULL) return DSK_OK;
    TM_TRY(tm_attn_forward(m, b, m->cfg.batch));
    if (l < m->cfg.n_dense) TM_TRY(tm_dense_forward(m, b, (int64_t)m->cfg.batch * m->cfg.seq, &m->mla.yscr));
    return DSK_OK;
}

#include "train/mtp.h" /* MTP: the modules' inputs, forward, loss and backward */

/* ------------------------------------------------------------------ FLOPs */

/* Attention weights per layer and the causal core's training FLOPs per token and layer
   (6 T H (dqk + dv) / 2: Kaplan et al.'s 6 d_model T when dqk = dv = d_model / H). */
static double tmla_attn_weights(const tm_config *c) {
    const tmla_config *a = &c->mla;
    double D = c->d_model, H = c->n_heads, dqk = a->qk_nope_dim + a->qk_rope_dim;
    if (!tmla_is_mla(a)) return 4 * D * D;
    double q = a->q_lora_rank > 0 ? D * a->q_lora_rank + a->q_lora_rank * H * dqk : D * H * dqk;
    return q + D * (a->kv_lora_rank + a->qk_rope_dim) + a->kv_lora_rank * H * (a->qk_nope_dim + a->v_head_dim) +
           H * a->v_head_dim * D;
}
static double tmla_core_flops(const tm_config *c) {
    const tmla_config *a = &c->mla;
    if (!tmla_is_mla(a)) return 6.0 * c->d_model * c->seq;
    return 6.0 * c->seq * c->n_heads * (a->qk_nope_dim + a->qk_rope_dim + a->v_head_dim) / 2.0;
}

/* Training FLOPs per token of one block: 6 x its weights (an MTP module's projection, the attention, the
   FFN (dense, or the MoE's router and active experts), an MTP module's shared head) + its attention core;
   of them the core's (attn) and the GEMMs --dtype fp8 runs in FP8 (fp8: the attention's and the FFN's or
   experts' linears; not the router, the projection, the head or the core). */
typedef struct tmla_flops {
    double total, attn, fp8;
} tmla_flops;
static tmla_flops tmla_block_flops(const tm_config *c, int moe, int mtp) {
    const dsk_moe_opts *o = &c->moe;
    double D = c->d_model, experts = 3 * D * (double)o->d_expert * (o->top_k + o->n_shared);
    double ffn = moe ? D * o->n_routed + experts : 3 * D * c->ffn_hidden;
    double w = (mtp ? 2 * D * D : 0) + tmla_attn_weights(c) + ffn + (mtp ? D * c->vocab : 0);
    tmla_flops f = {6 * w + tmla_core_flops(c), tmla_core_flops(c),
                    6 * (tmla_attn_weights(c) + (moe ? experts : 3 * D * c->ffn_hidden))};
    return f;
}

/* Of main block l (the first n_dense dense, the rest MoE). */
static tmla_flops tmla_layer_flops(const tm_config *c, int l) { return tmla_block_flops(c, l >= c->n_dense, 0); }

/* Adds main blocks [lo, hi)'s FLOPs into *f, a block at a time. */
static void tmla_add_layers_flops(const tm_config *c, int lo, int hi, tmla_flops *f) {
    for (int l = lo; l < hi; l++) {
        tmla_flops b = tmla_layer_flops(c, l);
        f->total += b.total;
        f->attn += b.attn;
        f->fp8 += b.fp8;
    }
}

/* Training FLOPs per token of the MTP modules (their blocks: tmla_block_flops). */
static double tmla_mtp_flops(const tm_config *c) {
    return c->mla.mtp_depth * tmla_block_flops(c, c->mla.mtp_moe, 1).total;
}

/* Training FLOPs per token of the LM head. */
static double tmla_head_flops(const tm_config *c) { return 6.0 * c->d_model * c->vocab; }

/* Adds what the last pipeline stage holds besides its blocks, the LM head and the MTP modules, into *f (their
   attention cores not in attn: --recompute attn reruns the main blocks'). */
static void tmla_add_tail_flops(const tm_config *c, tmla_flops *f) {
    f->total = f->total + tmla_head_flops(c) + tmla_mtp_flops(c);
    f->fp8 += c->mla.mtp_depth * tmla_block_flops(c, c->mla.mtp_moe, 1).fp8;
}

/* Training FLOPs per token of the model: every block, the head and the MTP modules: 6 x active parameters
   (embedding lookups excluded) + causal attention 6 L D T (Kaplan et al. 2020, arXiv:2001.08361, Table 1:
   6N + 6 n_layer n_ctx d_model). */
static double tmla_model_flops(const tm_config *c) {
    tmla_flops f = {0, 0, 0};
    tmla_add_layers_flops(c, 0, c->n_layers, &f);
    tmla_add_tail_flops(c, &f);
    return f.total;
}

/* ------------------------------------------------------------------ memory report */

typedef struct tmla_mem {
    double state, acts, peak, peak_acts; /* bytes */
} tmla_mem;

/* Memory on device `dev` from the allocator (dsk_tensor_mem_stats) given the training state's
   bytes (params, grads, optim: parameters, gradients, optimizer state as the caller holds them,
   in the model's slabs or in dsk_zero's pieces): the rest of what is allocated now (activations
   and workspace), the high-water mark of everything and of the rest (peak activations). */
static tmla_mem tmla_memory(dsk_device dev, double params, double grads, double optim) {
    tmla_mem r;
    dsk_tensor_mem st = dsk_tensor_mem_stats(dev);
    r.state = params + grads + optim;
    r.acts = (double)st.live_bytes - r.state;
    r.peak = (double)st.peak_bytes;
    r.peak_acts = r.peak - r.state;
    return r;
}

/* One line of tmla_memory for the trainer's log (`when`: "the end", ...). */
static void tmla_memory_line(dsk_device dev, double params, double grads, double optim, int rank, const char *when,
                             char *buf, size_t n) {
    tmla_mem r = tmla_memory(dev, params, grads, optim);
    const double MiB = 1024.0 * 1024.0;
    snprintf(buf, n, "memory at %s, rank %d (allocator, %s): parameters %.2f MiB, gradients %.2f MiB, optimizer state "
             "%.2f MiB, activations and workspace %.2f MiB, peak activations %.3f MiB (%.0f B), peak of all %.2f MiB\n",
             when, rank, dev.type == DSK_DEV_CUDA ? "GPU" : "CPU", params / MiB, grads / MiB, optim / MiB, r.acts / MiB,
             r.peak_acts / MiB, r.peak_acts, r.peak / MiB);
}

#endif /* TRAIN_MLA_H */
