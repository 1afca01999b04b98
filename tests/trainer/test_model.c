/* tests/trainer/test_model.c - the example model's DeepSeek-V3 parts (examples/train_mla.h) on the CPU:
   - MLA and MTP forward (logits of the main model and of every MTP module, and the loss
     L_main + lambda / D sum_k L_k) against an independent float64 implementation of the
     formulas (DeepSeek-V3 inference/model.py class MLA; the V3 report's MTP), for a query
     latent and a plain Wq, with and without the mscale correction;
   - --recompute attn and full: gradients bitwise equal to none, and the allocator's peak
     ordered full < attn < none (MLA and MHA models with MoE blocks and an MTP module);
   - a sequence long enough that the materialised attention's probabilities alone would not fit
     in this machine's memory trains a step (forward, backward, AdamW) with MLA's fused core;
   - bad MLA/MTP/recompute settings are refused with a message naming the flag. */
#define _POSIX_C_SOURCE 200809L /* kill, nanosleep, clock_gettime: the library is linked, not included */
#include "dsk_comm.h"
#include "dsk_moe.h"
/* the model header holds the trainer's routing record/replay, which this test does not call */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include "examples/train_model.h"
#pragma GCC diagnostic pop
#include "tests/dsk_test.h"

static dsk_ctx g_ctx;

/* ------------------------------------------------------------------ float64 reference */

static const double *ref_w(const tm_param *p, double **keep, int *nkeep) {
    int64_t n = dsk_tensor_numel(&p->w);
    double *d = (double *)malloc((size_t)n * sizeof *d);
    for (int64_t i = 0; i < n; i++) d[i] = ((const float *)p->w.data)[i];
    keep[(*nkeep)++] = d;
    return d;
}

/* y (n, o) = x (n, i) W^T, W (o, ld) read from column c0 */
static void ref_linear(double *y, const double *x, int64_t n, int64_t in, const double *W, int64_t o, int64_t ld,
                       int64_t c0) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t j = 0; j < o; j++) {
            double s = 0;
            for (int64_t k = 0; k < in; k++) s += x[r * in + k] * W[j * ld + c0 + k];
            y[r * o + j] = s;
        }
}

static void ref_rmsnorm(double *y, const double *x, int64_t n, int64_t d, const double *w, double eps) {
    for (int64_t r = 0; r < n; r++) {
        double ss = 0;
        for (int64_t k = 0; k < d; k++) ss += x[r * d + k] * x[r * d + k];
        double s = 1.0 / sqrt(ss / (double)d + eps);
        for (int64_t k = 0; k < d; k++) y[r * d + k] = x[r * d + k] * s * w[k];
    }
}

/* Interleaved pairs (2i, 2i+1) of v (d dims) rotated by pos * theta^(-2i/d) (model.py's
   view_as_complex of consecutive pairs times freqs_cis). */
static void ref_rope(double *v, int64_t d, int64_t pos, double theta) {
    for (int64_t i = 0; i < d / 2; i++) {
        double a = (double)pos * pow(theta, -2.0 * (double)i / (double)d), c = cos(a), s = sin(a);
        double x0 = v[2 * i], x1 = v[2 * i + 1];
        v[2 * i] = x0 * c - x1 * s;
        v[2 * i + 1] = x0 * s + x1 * c;
    }
}

typedef struct ref_ctx {
    const tm_model *m;
    double *keep[512];
    int nkeep;
} ref_ctx;
#define RW(p) ref_w((p), r->keep, &r->nkeep)

/* x (B*T, D) += MLA(RMSNorm(x)) of block b. */
static void ref_mla(ref_ctx *r, const tm_block *b, double *x) {
    const tm_config *c = &r->m->cfg;
    const tmla_config *a = &c->mla;
    int64_t B = c->batch, T = c->seq, N = B * T, D = c->d_model, H = c->n_heads, dn = a->qk_nope_dim,
            dr = a->qk_rope_dim;
    int64_t dv = a->v_head_dim, dq = dn + dr, R = a->kv_lora_rank;
    double *h = calloc((size_t)(N * D), sizeof(double)), *q = calloc((size_t)(N * H * dq), sizeof(double));
    double *kv = calloc((size_t)(N * (R + dr)), sizeof(double)), *lat = calloc((size_t)(N * R), sizeof(double));
    double *kvb = calloc((size_t)(N * H * (dn + dv)), sizeof(double)),
           *o = calloc((size_t)(N * H * dv), sizeof(double));
    double *sc = calloc((size_t)T, sizeof(double));
    ref_rmsnorm(h, x, N, D, RW(b->ln1), c->norm_eps);
    if (a->q_lora_rank > 0) {
        int64_t Q = a->q_lora_rank;
        double *cq = calloc((size_t)(N * Q), sizeof(double));
        ref_linear(cq, h, N, D, RW(b->mla.wq_a), Q, D, 0);
        ref_rmsnorm(cq, cq, N, Q, RW(b->mla.q_norm), c->norm_eps);
        ref_linear(q, cq, N, Q, RW(b->mla.wq_b), H * dq, Q, 0);
        free(cq);
    } else {
        ref_linear(q, h, N, D, RW(b->mla.wq), H * dq, D, 0);
    }
    ref_linear(kv, h, N, D, RW(b->mla.wkv_a), R + dr, D, 0);
    for (int64_t i = 0; i < N; i++) {
        for (int64_t hh = 0; hh < H; hh++) ref_rope(q + (i * H + hh) * dq + dn, dr, i % T, c->rope_theta);
        ref_rope(kv + i * (R + dr) + R, dr, i % T, c->rope_theta);
        for (int64_t k = 0; k < R; k++) lat[i * R + k] = kv[i * (R + dr) + k];
    }
    ref_rmsnorm(lat, lat, N, R, RW(b->mla.kv_norm), c->norm_eps);
    ref_linear(kvb, lat, N, R, RW(b->mla.wkv_b), H * (dn + dv), R, 0);
    double scale = 1.0 / sqrt((double)dq);
    if (a->original_seq > 0 && T > a->original_seq) {
        double ms = 0.1 * a->mscale * log(a->rope_factor) + 1.0;
        scale *= ms * ms;
    }
    for (int64_t bb = 0; bb < B; bb++)
        for (int64_t hh = 0; hh < H; hh++)
            for (int64_t i = 0; i < T; i++) {
                const double *qi = q + ((bb * T + i) * H + hh) * dq;
                double mx = -INFINITY, sum = 0;
                for (int64_t j = 0; j <= i; j++) {
                    const double *kn = kvb + ((bb * T + j) * H + hh) * (dn + dv),
                                 *kr = kv + (bb * T + j) * (R + dr) + R;
                    double s = 0;
                    for (int64_t k = 0; k < dn; k++) s += qi[k] * kn[k];
                    for (int64_t k = 0; k < dr; k++) s += qi[dn + k] * kr[k];
                    sc[j] = s * scale;
                    if (sc[j] > mx) mx = sc[j];
                }
                for (int64_t j = 0; j <= i; j++) {
                    sc[j] = exp(sc[j] - mx);
                    sum += sc[j];
                }
                double *oi = o + ((bb * T + i) * H + hh) * dv;
                for (int64_t j = 0; j <= i; j++) {
                    const double *vj = kvb + ((bb * T + j) * H + hh) * (dn + dv) + dn;
                    for (int64_t k = 0; k < dv; k++) oi[k] += sc[j] / sum * vj[k];
                }
            }
    double *y = calloc((size_t)(N * D), sizeof(double));
    ref_linear(y, o, N, H * dv, RW(b->mla.wo), D, H * dv, 0);
    for (int64_t i = 0; i < N * D; i++) x[i] += y[i];
    free(h);
    free(q);
    free(kv);
    free(lat);
    free(kvb);
    free(o);
    free(sc);
    free(y);
}

/* x += W2 (silu(W1 h) * W3 h), h = RMSNorm(x) of block b. */
static void ref_ffn(ref_ctx *r, const tm_block *b, double *x) {
    const tm_config *c = &r->m->cfg;
    int64_t N = (int64_t)c->batch * c->seq, D = c->d_model, F = c->ffn_hidden;
    double *h = calloc((size_t)(N * D), sizeof(double)), *g = calloc((size_t)(N * F), sizeof(double));
    double *u = calloc((size_t)(N * F), sizeof(double)), *y = calloc((size_t)(N * D), sizeof(double));
    ref_rmsnorm(h, x, N, D, RW(b->ln2), c->norm_eps);
    ref_linear(g, h, N, D, RW(b->w1), F, D, 0);
    ref_linear(u, h, N, D, RW(b->w3), F, D, 0);
    for (int64_t i = 0; i < N * F; i++) g[i] = g[i] / (1.0 + exp(-g[i])) * u[i];
    ref_linear(y, g, N, F, RW(b->w2), D, F, 0);
    for (int64_t i = 0; i < N * D; i++) x[i] += y[i];
    free(h);
    free(g);
    free(u);
    free(y);
}

/* The MoE parameter `index` (DSK_MOE_P_*) of block l in float64. */
static const double *ref_moe_w(ref_ctx *r, int l, int index) {
    for (int i = 0; i < r->m->n_params; i++)
        if (r->m->params[i].moe_layer == l && r->m->params[i].moe_index == index) return RW(&r->m->params[i]);
    return NULL;
}

/* y (D) += g * W2 (silu(W1 h) * W3 h) of one expert: W1, W3 (F, D), W2 (D, F). */
static void ref_swiglu(double *y, const double *h, int64_t D, int64_t F, const double *W1, const double *W3,
                       const double *W2, double g) {
    for (int64_t f = 0; f < F; f++) {
        double a = 0, u = 0;
        for (int64_t d = 0; d < D; d++) {
            a += W1[f * D + d] * h[d];
            u += W3[f * D + d] * h[d];
        }
        a = a / (1.0 + exp(-a)) * u;
        for (int64_t d = 0; d < D; d++) y[d] += g * W2[d * F + f] * a;
    }
}

/* x += MoE(RMSNorm(x)) of MoE block l, dsk_moe.h's formulas for sigmoid scores, one group, the
   (zero) bias in the selection only, normalised top-k weights times routed_scale, shared experts. */
static void ref_moe(ref_ctx *r, int l, double *x) {
    const tm_config *c = &r->m->cfg;
    const tm_block *b = &r->m->blocks[l];
    int64_t N = (int64_t)c->batch * c->seq, D = c->d_model, E = c->moe.n_routed, K = c->moe.top_k;
    int64_t F = c->moe.d_expert, S = c->moe.n_shared * F;
    const double *Wr = ref_moe_w(r, l, DSK_MOE_P_ROUTER), *W1 = ref_moe_w(r, l, DSK_MOE_P_W1);
    const double *W2 = ref_moe_w(r, l, DSK_MOE_P_W2), *W3 = ref_moe_w(r, l, DSK_MOE_P_W3);
    const double *S1 = ref_moe_w(r, l, DSK_MOE_P_SW1), *S2 = ref_moe_w(r, l, DSK_MOE_P_SW2);
    const double *S3 = ref_moe_w(r, l, DSK_MOE_P_SW3);
    const float *bias = (const float *)b->moe_bias.data;
    double *h = calloc((size_t)(N * D), sizeof(double)), *y = calloc((size_t)D, sizeof(double));
    double p[64], sc[64];
    ref_rmsnorm(h, x, N, D, RW(b->ln2), c->norm_eps);
    for (int64_t t = 0; t < N; t++) {
        const double *ht = h + t * D;
        int sel[64];
        double sum = 0;
        for (int64_t e = 0; e < E; e++) {
            double u = 0;
            for (int64_t d = 0; d < D; d++) u += Wr[e * D + d] * ht[d];
            p[e] = 1.0 / (1.0 + exp(-u));
            sc[e] = p[e] + bias[e];
        }
        for (int64_t k = 0; k < K; k++) { /* the largest remaining score, ties to the lower index */
            int best = -1;
            for (int64_t e = 0; e < E; e++)
                if (sc[e] > -INFINITY && (best < 0 || sc[e] > sc[best])) best = (int)e;
            sel[k] = best;
            sc[best] = -INFINITY;
            sum += p[best];
        }
        memset(y, 0, (size_t)D * sizeof *y);
        for (int64_t k = 0; k < K; k++)
            ref_swiglu(y, ht, D, F, W1 + sel[k] * F * D, W3 + sel[k] * F * D, W2 + sel[k] * D * F,
                       c->moe.routed_scale * p[sel[k]] / (sum + 1e-20));
        if (S1) ref_swiglu(y, ht, D, S, S1, S3, S2, 1.0);
        for (int64_t d = 0; d < D; d++) x[t * D + d] += y[d];
    }
    free(h);
    free(y);
}

/* The absolute tolerance of f32 logits against float64: 1e-5 of the largest reference logit (at
   least 1e-5). A logit is a chain of f32 dot products over the model; the rounding of each sum
   scales with the size of the values in it, so a logit near zero carries the error of its
   larger neighbours (the portable kernels' summation order shows 1.1e-5 at a largest logit of
   about 3, AVX-512's less). */
static double logit_atol(const double *ref, int64_t n) {
    double mx = 1.0;
    for (int64_t i = 0; i < n; i++) mx = fmax(mx, fabs(ref[i]));
    return 1e-5 * mx;
}

/* logits (N, V) of RMSNorm(x; w) and the shared head; returns the sum of -log p(target) over
   rows whose target is >= 0 and counts them. */
static double ref_head(ref_ctx *r, const double *x, const tm_param *norm, const int32_t *tgt, double *logits,
                       int64_t *count) {
    const tm_config *c = &r->m->cfg;
    int64_t N = (int64_t)c->batch * c->seq, D = c->d_model, V = c->vocab;
    double *h = calloc((size_t)(N * D), sizeof(double)), nll = 0;
    ref_rmsnorm(h, x, N, D, RW(norm), c->norm_eps);
    ref_linear(logits, h, N, D, RW(r->m->lm_head), V, D, 0);
    *count = 0;
    for (int64_t i = 0; i < N; i++) {
        if (tgt[i] < 0) continue;
        double mx = -INFINITY, s = 0;
        for (int64_t v = 0; v < V; v++) mx = fmax(mx, logits[i * V + v]);
        for (int64_t v = 0; v < V; v++) s += exp(logits[i * V + v] - mx);
        nll += mx + log(s) - logits[i * V + tgt[i]];
        (*count)++;
    }
    free(h);
    return nll;
}

/* ------------------------------------------------------------------ model helpers */

static tm_config small_config(int q_lora, int mtp, int layers, int n_dense) {
    tm_config c;
    memset(&c, 0, sizeof c);
    c.vocab = 40;
    c.seq = 12;
    c.d_model = 24;
    c.n_heads = 3;
    c.n_layers = layers;
    c.n_dense = n_dense;
    c.ffn_hidden = 20;
    c.batch = 2;
    c.rope_theta = 10000.0f;
    c.norm_eps = 1e-5f;
    c.init_std = 0.15f;
    c.cdt = DSK_F32;
    c.seed = 1234 + (uint64_t)dsk_test_rand_int(1000);
    c.moe.score = DSK_MOE_SIGMOID;
    c.moe.n_routed = 4;
    c.moe.n_shared = 1;
    c.moe.top_k = 2;
    c.moe.d_expert = 8;
    c.moe.n_group = 1;
    c.moe.topk_group = 1;
    c.moe.routed_scale = 1.0f;
    c.mla.attn = TMLA_ATTN_MLA;
    c.mla.q_lora_rank = q_lora;
    c.mla.kv_lora_rank = 10;
    c.mla.qk_nope_dim = 6;
    c.mla.qk_rope_dim = 4;
    c.mla.v_head_dim = 5;
    c.mla.rope_factor = 40.0f;
    c.mla.mscale = 1.0f;
    c.mla.mtp_depth = mtp;
    c.mla.mtp_lambda = 0.4f;
    return c;
}

/* Random tokens: tok (B, T+1); ids = tok[:, :T], targets = tok[:, 1:]. */
static void fill_batch(tm_model *m, int32_t *tok) {
    const tm_config *c = &m->cfg;
    int64_t T = c->seq;
    for (int64_t i = 0; i < (int64_t)c->batch * (T + 1); i++) tok[i] = (int32_t)dsk_test_rand_int(c->vocab);
    for (int64_t b = 0; b < c->batch; b++)
        for (int64_t t = 0; t < T; t++) {
            ((int32_t *)m->ids.data)[b * T + t] = tok[b * (T + 1) + t];
            ((int32_t *)m->targets.data)[b * T + t] = tok[b * (T + 1) + t + 1];
        }
}

static float host_loss(tm_model *m) { return *(const float *)m->loss.data; }

/* ------------------------------------------------------------------ forward against float64 */

/* moe: an MoE block after a dense one, and MTP blocks with MoE FFNs (tmla_config.mtp_moe). */
static void check_forward(int q_lora, int mtp, int long_ctx, int moe) {
    dsk_test_begin("MLA%s + MTP %d%s forward vs float64%s", q_lora ? " (query latent)" : " (plain Wq)", mtp,
                   moe ? " (MoE FFNs)" : "", long_ctx ? ", mscale correction on" : "");
    tm_config c = small_config(q_lora, mtp, 2, moe ? 1 : 2);
    c.mla.mtp_moe = moe;
    c.init_std = 0.5f; /* scores of order 1: the softmax scale shows in the logits */
    if (long_ctx) {
        c.mla.original_seq = 8;
        c.mla.mscale = 0.7f;
    }
    tm_model m;
    DSK_TEST_OK(tm_init(&m, &g_ctx, &c));
    int64_t T = c.seq, N = (int64_t)c.batch * T, D = c.d_model, V = c.vocab;
    int32_t *tok = malloc((size_t)(c.batch * (T + 1)) * sizeof *tok);
    fill_batch(&m, tok);
    dsk_test_poison_f32((float *)m.logits.data, N * V);
    for (int k = 0; k < mtp; k++) dsk_test_poison_f32((float *)m.mla.mtp[k].logits.data, N * V);
    tm_set_eval(&m, 0); /* training pass: the MTP modules run */
    DSK_TEST_OK(tm_forward(&m, c.batch));
    DSK_TEST_OK(tm_loss(&m, 1.0f));
    double mtp_obj;
    DSK_TEST_OK(tmla_mtp_objective(&m, &mtp_obj));

    ref_ctx rc;
    ref_ctx *r = &rc;
    memset(r, 0, sizeof *r);
    r->m = &m;
    double *x = calloc((size_t)(N * D), sizeof(double)), *logits = calloc((size_t)(N * V), sizeof(double));
    const double *E = RW(m.embed);
    for (int64_t i = 0; i < N; i++)
        for (int64_t d = 0; d < D; d++) x[i * D + d] = E[(int64_t)((int32_t *)m.ids.data)[i] * D + d];
    for (int l = 0; l < c.n_layers; l++) {
        ref_mla(r, &m.blocks[l], x);
        if (m.blocks[l].is_moe) ref_moe(r, l, x);
        else ref_ffn(r, &m.blocks[l], x);
    }
    int64_t cnt;
    double loss = ref_head(r, x, m.ln_f, (const int32_t *)m.targets.data, logits, &cnt) / (double)cnt;
    DSK_TEST_CLOSE((const float *)m.logits.data, logits, N * V, 1e-4, logit_atol(logits, N * V), "main logits");
    /* MTP module k: position i sees h^{k-1}_i and the embedding of t_{i+k}, predicts t_{i+k+1} */
    double total = loss, *hn = calloc((size_t)(N * D), sizeof(double)), *en = calloc((size_t)(N * D), sizeof(double));
    int32_t *tgt = malloc((size_t)N * sizeof *tgt);
    for (int k = 1; k <= mtp; k++) {
        tmla_mtp *mt = &m.mla.mtp[k - 1];
        tm_block *b = &m.blocks[c.n_layers + k - 1];
        ref_rmsnorm(hn, x, N, D, RW(mt->hnorm), c.norm_eps);
        for (int64_t bb = 0; bb < c.batch; bb++)
            for (int64_t i = 0; i < T; i++) {
                int64_t p = i + k <= T ? i + k : 0; /* past the window: masked below, any token */
                int32_t id = i + k <= T ? tok[bb * (T + 1) + p] : 0;
                for (int64_t d = 0; d < D; d++) en[(bb * T + i) * D + d] = E[(int64_t)id * D + d];
                tgt[bb * T + i] = i + k + 1 <= T ? tok[bb * (T + 1) + i + k + 1] : -1;
            }
        ref_rmsnorm(en, en, N, D, RW(mt->enorm), c.norm_eps);
        const double *P = RW(mt->proj);
        double *t1 = calloc((size_t)(N * D), sizeof(double));
        ref_linear(x, hn, N, D, P, D, 2 * D, 0);
        ref_linear(t1, en, N, D, P, D, 2 * D, D);
        for (int64_t i = 0; i < N * D; i++) x[i] += t1[i];
        free(t1);
        ref_mla(r, b, x);
        DSK_TEST_EXPECT(b->is_moe == moe, "MTP block %d: FFN %s", k, b->is_moe ? "MoE" : "dense");
        if (moe) ref_moe(r, c.n_layers + k - 1, x);
        else ref_ffn(r, b, x);
        double nll = ref_head(r, x, mt->norm, tgt, logits, &cnt);
        DSK_TEST_EXPECT(cnt == (int64_t)c.batch * (T - k), "module %d: %lld targets", k, (long long)cnt);
        total += c.mla.mtp_lambda / mtp * nll / (double)N; /* the report's 1/T per sequence */
        /* rows whose input token is inside the window */
        for (int64_t bb = 0; bb < c.batch; bb++) {
            char what[64];
            snprintf(what, sizeof what, "MTP module %d logits, sequence %lld", k, (long long)bb);
            DSK_TEST_CLOSE((const float *)mt->logits.data + bb * T * V, logits + bb * T * V, (T - k + 1) * V, 1e-4,
                           logit_atol(logits + bb * T * V, (T - k + 1) * V), what);
        }
    }
    double got = (double)host_loss(&m) + mtp_obj;
    DSK_TEST_CLOSE64(&got, &total, 1, 1e-5, 0, "L_main + lambda / D sum_k L_k");
    /* the FLOP count's attention weights are the MLA parameters of a block */
    double nw = 0;
    const tmla_block *p = &m.blocks[0].mla;
    const tm_param *ps[] = {p->wq, p->wq_a, p->wq_b, p->wkv_a, p->wkv_b, p->wo};
    for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) nw += ps[i] ? (double)tm_param_numel(ps[i]) : 0;
    DSK_TEST_EXPECT(nw == tmla_attn_weights(&c), "attention weights %g vs %g", nw, tmla_attn_weights(&c));
    DSK_TEST_EXPECT(tmla_core_flops(&c) ==
                        6.0 * c.seq * c.n_heads * (c.mla.qk_nope_dim + c.mla.qk_rope_dim + c.mla.v_head_dim) / 2,
                    "core FLOPs");
    double ffn = moe ? (double)D * c.moe.n_routed + 3.0 * D * c.moe.d_expert * (c.moe.top_k + c.moe.n_shared)
                     : 3.0 * D * c.ffn_hidden;
    double mw = 2.0 * D * D + nw + ffn + (double)D * c.vocab;
    DSK_TEST_EXPECT(tmla_mtp_flops(&c) == mtp * (6 * mw + tmla_core_flops(&c)), "MTP FLOPs %g", tmla_mtp_flops(&c));
    for (int i = 0; i < r->nkeep; i++) free(r->keep[i]);
    free(x);
    free(logits);
    free(hn);
    free(en);
    free(tgt);
    free(tok);
    tm_free(&m);
    dsk_test_end();
}

/* ------------------------------------------------------------------ recomputation */

typedef struct step_out {
    float *grad;
    int64_t n;
    float loss;
    int64_t peak;
} step_out;

/* One forward, loss and backward from fresh weights; the gradients and the allocator's peak
   growth over what was live before the model was built. */
static step_out one_step(const tm_config *c, int recompute, const int32_t *tok) {
    step_out o;
    tm_model m;
    tm_config cc = *c;
    cc.mla.recompute = recompute;
    dsk_tensor_mem live0 = dsk_tensor_mem_stats(dsk_cpu());
    dsk_tensor_mem_reset_peak(dsk_cpu());
    memset(&o, 0, sizeof o);
    DSK_TEST_OK(tm_init(&m, &g_ctx, &cc));
    int64_t T = cc.seq;
    for (int64_t b = 0; b < cc.batch; b++)
        for (int64_t t = 0; t < T; t++) {
            ((int32_t *)m.ids.data)[b * T + t] = tok[b * (T + 1) + t];
            ((int32_t *)m.targets.data)[b * T + t] = tok[b * (T + 1) + t + 1];
        }
    m.aux_scale = 1.0f;
    DSK_TEST_OK(tm_zero_grads(&m));
    DSK_TEST_OK(tm_forward(&m, cc.batch));
    DSK_TEST_OK(tm_loss(&m, 1.0f));
    DSK_TEST_OK(tm_backward(&m));
    o.n = m.numel;
    o.grad = malloc((size_t)o.n * sizeof(float));
    memcpy(o.grad, m.slab_g.data, (size_t)o.n * sizeof(float));
    o.loss = host_loss(&m);
    o.peak = dsk_tensor_mem_stats(dsk_cpu()).peak_bytes - live0.live_bytes;
    tm_free(&m);
    return o;
}

static void check_recompute(int mla) {
    dsk_test_begin("--recompute attn/full: %s gradients bitwise equal to none, peak full < attn < none",
                   mla ? "MLA" : "MHA");
    tm_config c = small_config(8, 1, 3, 2); /* 2 dense blocks (sharing FFN buffers), an MoE block, an MTP module */
    c.seq = 32;
    c.mla.attn = mla ? TMLA_ATTN_MLA : TMLA_ATTN_MHA;
    if (!mla) c.d_model = 24, c.n_heads = 2;
    int32_t *tok = malloc((size_t)(c.batch * (c.seq + 1)) * sizeof *tok);
    for (int64_t i = 0; i < (int64_t)c.batch * (c.seq + 1); i++) tok[i] = (int32_t)dsk_test_rand_int(c.vocab);
    step_out s[3];
    for (int r = 0; r < 3; r++) s[r] = one_step(&c, r, tok);
    for (int r = 1; r < 3; r++) {
        DSK_TEST_EXPECT(s[r].n == s[0].n, "gradient sizes %lld vs %lld", (long long)s[r].n, (long long)s[0].n);
        DSK_TEST_SAME_BYTES(s[r].grad, s[0].grad, (size_t)s[0].n * sizeof(float),
                            r == 1 ? "attn vs none gradients" : "full vs none gradients");
        DSK_TEST_EXPECT(s[r].loss == s[0].loss, "loss %.9g vs %.9g", (double)s[r].loss, (double)s[0].loss);
    }
    printf("     peak allocator growth: none %lld B, attn %lld B, full %lld B\n", (long long)s[0].peak,
           (long long)s[1].peak, (long long)s[2].peak);
    DSK_TEST_EXPECT(s[2].peak < s[1].peak && s[1].peak < s[0].peak, "peaks full %lld < attn %lld < none %lld",
                    (long long)s[2].peak, (long long)s[1].peak, (long long)s[0].peak);
    for (int r = 0; r < 3; r++) free(s[r].grad);
    free(tok);
    dsk_test_end();
}

/* ------------------------------------------------------------------ a sequence the materialised path cannot hold */

/* A long sequence without the (B, H, T, T) probabilities: T is fixed (the test reads nothing of
   the machine), large enough that their 8 GiB would be the whole step's memory many times over,
   and the allocator's peak must stay under 1/16 of them (one head's would be 1/2). */
static void check_long_sequence(void) {
    tm_config c = small_config(0, 0, 1, 1);
    c.batch = 1;
    c.n_heads = 2;
    c.d_model = 32;
    c.ffn_hidden = 32;
    c.vocab = 64;
    c.mla.kv_lora_rank = 16;
    c.mla.qk_nope_dim = 8;
    c.mla.qk_rope_dim = 8;
    c.mla.v_head_dim = 16;
    int64_t T = 32768;
    double mat = (double)c.batch * c.n_heads * (double)T * (double)T * 4.0;
    dsk_test_begin("MLA trains a step at T = %lld (materialised probabilities would be %.1f GiB)", (long long)T,
                   mat / 1073741824.0);
    c.seq = (int)T;
    tm_model m;
    dsk_tensor_mem live0 = dsk_tensor_mem_stats(dsk_cpu());
    dsk_tensor_mem_reset_peak(dsk_cpu());
    DSK_TEST_OK(tm_init(&m, &g_ctx, &c));
    int32_t *tok = malloc((size_t)(T + 1) * sizeof *tok);
    fill_batch(&m, tok);
    double t0 = dsk_test_now();
    m.aux_scale = 1.0f;
    DSK_TEST_OK(tm_zero_grads(&m));
    DSK_TEST_OK(tm_forward(&m, 1));
    DSK_TEST_OK(tm_loss(&m, 1.0f));
    float l0 = host_loss(&m);
    DSK_TEST_OK(tm_backward(&m));
    dsk_adamw_opts ao = dsk_adamw_defaults();
    ao.lr = 1e-2f;
    for (int i = 0; i < m.n_params; i++) {
        tm_param *p = &m.params[i];
        DSK_TEST_OK(dsk_adamw_step(&g_ctx, &p->w, &p->g, &p->m, &p->v, &ao, 1, 1.0f, NULL));
    }
    double step_s = dsk_test_now() - t0;
    DSK_TEST_OK(tm_forward(&m, 1));
    DSK_TEST_OK(tm_loss(&m, 1.0f));
    float l1 = host_loss(&m);
    double peak = (double)(dsk_tensor_mem_stats(dsk_cpu()).peak_bytes - live0.live_bytes);
    printf("     T %lld: step %.1f s, loss %.4f -> %.4f after one AdamW step, allocator peak %.1f MiB "
           "(materialised probabilities alone: %.1f GiB)\n",
           (long long)T, step_s, (double)l0, (double)l1, peak / 1048576.0, mat / 1073741824.0);
    char line[512];
    tmla_memory_line(dsk_cpu(), (double)dsk_tensor_nbytes(&m.slab_w), (double)dsk_tensor_nbytes(&m.slab_g),
                     2.0 * (double)dsk_tensor_nbytes(&m.slab_m), 0, "the end of the step", line, sizeof line);
    printf("     %s", line);
    DSK_TEST_EXPECT(isfinite(l0) && isfinite(l1) && l1 < l0, "loss %g -> %g", (double)l0, (double)l1);
    DSK_TEST_EXPECT(peak < mat / 16, "peak %.0f B against %.0f B materialised", peak, mat);
    free(tok);
    tm_free(&m);
    dsk_test_end();
}

/* ------------------------------------------------------------------ bad settings */

/* tm_init on c fails with DSK_ERR_ARG, its error naming `flag`; the model is freed either way. */
static void tm_init_refuses(const tm_config *c, const char *flag) {
    tm_model m;
    DSK_TEST_STATUS(tm_init(&m, &g_ctx, c), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS(flag);
    tm_free(&m);
}

static void check_bad_config(void) {
    tm_config c;
    dsk_test_begin("bad MLA/MTP/recompute settings are refused naming the flag");
    c = small_config(0, 0, 1, 1);
    c.mla.qk_rope_dim = 3;
    tm_init_refuses(&c, "--qk-rope-dim");
    c = small_config(0, 0, 1, 1);
    c.mla.kv_lora_rank = 0;
    tm_init_refuses(&c, "--kv-lora-rank");
    c = small_config(0, 0, 1, 1);
    c.mla.mtp_depth = c.seq;
    tm_init_refuses(&c, "--mtp");
    c = small_config(0, 0, 1, 1);
    c.mla.recompute = 7;
    tm_init_refuses(&c, "--recompute");
    dsk_test_end();
}

int main(void) {
    dsk_test_init("trainer/test_model");
    dsk_ctx_opts co;
    memset(&co, 0, sizeof co);
    co.device = DSK_PREFER_CPU;
    if (dsk_ctx_init(&g_ctx, &co) != DSK_OK) {
        printf("ctx: %s\n", dsk_last_error());
        return 1;
    }
    check_forward(6, 2, 0, 0);
    check_forward(0, 1, 1, 0);
    check_forward(6, 2, 0, 1);
    check_forward(0, 1, 0, 1);
    check_recompute(1);
    check_recompute(0);
    check_bad_config();
    check_long_sequence();
    dsk_ctx_free(&g_ctx);
    return dsk_test_finish();
}
