/* tests/test_moe.c - dsk_moe.h against an independent float64 reference written here: routing
   (softmax, sigmoid, groups, bias, normalisation), capacity, shared experts, loss terms, the
   bias update, gradients by central finite differences, bf16, expert parallelism over forked
   host-backend ranks (the layer, and the mixed-precision statistics' join), routing record and
   replay, the experts' GEMMs in FP8 (against a float64 evaluation of the same quantised operands,
   and under expert parallelism), and bad configurations and calls. */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS for the ranks' shared results (POSIX alone lacks it) */
#include "dsk_comm.h"
#include "dsk_amp.h" /* before dsk_moe.h: dsk_moe_amp_unscale */
#include "dsk_moe.h"
#include "tests/dsk_test.h"
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---------------------------------------------------------------- float64 reference */

typedef struct cfg {
    int T, D, E, K, F, n_shared, Fs; /* Fs: total shared hidden */
    int sigmoid, norm, n_group, topk_group, seq_len, drop_pos;
    int group_rule; /* dsk_moe_group_rule */
    int count_sel;  /* losses count the actual selections (DSK_MOE_COUNT_SELECTED), not the plain top-K */
    double min_margin; /* inputs are redrawn until routing is this far from any tie [1e-4] */
    double scale, aux, seq_aux, z, cf;
    const int *force; /* (T,K) replayed experts instead of the selection, or NULL */
    const double *xe; /* (T,D) what the routed experts read instead of x (FP8 dispatch), or NULL */
} cfg;

/* Parameters in double, same layouts as the layer: wr (E,D), b (E), w1 w3 (E,F,D), w2 (E,D,F),
   s1 s3 (Fs,D), s2 (D,Fs). */
typedef struct refp { double *wr, *b, *w1, *w2, *w3, *s1, *s2, *s3; } refp;

typedef struct refout {
    int *sel;        /* (T,K) */
    double *g;       /* (T,K) */
    int *kept;       /* (T,K) */
    int dropped;
    double aux, seq_aux, z;
    double margin;   /* smallest selection gap (distance from a tie) */
    int *load;       /* (E) selections */
    int *lcnt;       /* (T,E) 1 where the balancing losses count expert e for token t */
} refout;

static double silu64(double h) { return h / (1.0 + exp(-h)); }

/* Sum of the w largest of v (n), from the published rules: DeepSeek-V3's Gate sums
   scores.topk(2) of a group when a bias exists (the layer always has one), Megatron-Core's
   group_limited_topk scores.topk(topk // group_topk), DeepSeek-V2's group-limited greedy the max. */
static double ref_top_sum(const double *v, int n, int w) {
    double s[512], sum = 0;
    memcpy(s, v, sizeof(double) * n);
    for (int i = 0; i < w; i++) { /* selection sort, largest first */
        int b = i;
        for (int j = i + 1; j < n; j++) if (s[j] > s[b]) b = j;
        { double t = s[i]; s[i] = s[b]; s[b] = t; }
        sum += s[i];
    }
    return sum;
}

static int ref_group_width(const cfg *c) {
    int w = c->group_rule == DSK_MOE_GROUP_MAX ? 1 : c->group_rule == DSK_MOE_GROUP_MEGATRON ? c->K / c->topk_group : 2;
    return w < c->E / c->n_group ? w : c->E / c->n_group;
}

/* Routes token x (D): writes sel (K), g (K), p (E) and returns its selection margin; with force
   (K) those experts are taken as they are (replay) and the margin is not a concern. */
static double ref_route(const cfg *c, const refp *w, const double *x, int *sel, double *g, double *p,
                        const int *force) {
    int E = c->E, K = c->K, G = c->n_group, gs = E / G;
    double u[512], cs[512], gsc[64], mx = -1e300, sum = 0, margin = 1e300;
    int allowed[512], gkeep[64];
    for (int j = 0; j < E; j++) {
        u[j] = 0;
        for (int d = 0; d < c->D; d++) u[j] += x[d] * w->wr[j * c->D + d];
        mx = u[j] > mx ? u[j] : mx;
    }
    for (int j = 0; j < E; j++) {
        p[j] = c->sigmoid ? 1.0 / (1.0 + exp(-u[j])) : exp(u[j] - mx);
        sum += p[j];
    }
    if (!c->sigmoid) for (int j = 0; j < E; j++) p[j] /= sum;
    for (int j = 0; j < E; j++) { cs[j] = p[j] + w->b[j]; allowed[j] = 1; }
    if (force) {
        sum = 0;
        for (int k = 0; k < K; k++) { sel[k] = force[k]; sum += p[sel[k]]; }
        for (int k = 0; k < K; k++) g[k] = c->scale * (c->norm ? p[sel[k]] / (sum + 1e-20) : p[sel[k]]);
        return 1e300;
    }
    if (G > 1) {
        for (int q = 0; q < G; q++) {
            gsc[q] = ref_top_sum(cs + q * gs, gs, ref_group_width(c));
            gkeep[q] = 0;
        }
        for (int r = 0; r < c->topk_group; r++) {
            int best = -1;
            for (int q = 0; q < G; q++) if (!gkeep[q] && (best < 0 || gsc[q] > gsc[best])) best = q;
            gkeep[best] = 1;
        }
        { /* margin between the last kept group and the best dropped one */
            double lo = 1e300, hi = -1e300;
            for (int q = 0; q < G; q++) {
                if (gkeep[q] && gsc[q] < lo) lo = gsc[q];
                if (!gkeep[q] && gsc[q] > hi) hi = gsc[q];
            }
            if (hi > -1e300 && lo - hi < margin) margin = lo - hi;
        }
        for (int j = 0; j < E; j++) allowed[j] = gkeep[j / gs];
    }
    sum = 0;
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int j = 0; j < E; j++) if (allowed[j] && (best < 0 || cs[j] > cs[best])) best = j;
        sel[k] = best;
        allowed[best] = 0;
        sum += p[best];
    }
    {
        double hi = -1e300;
        for (int j = 0; j < E; j++) if (allowed[j] && cs[j] > hi) hi = cs[j];
        if (hi > -1e300 && cs[sel[K - 1]] - hi < margin) margin = cs[sel[K - 1]] - hi;
        for (int k = 1; k < K; k++) if (cs[sel[k - 1]] - cs[sel[k]] < margin) margin = cs[sel[k - 1]] - cs[sel[k]];
    }
    for (int k = 0; k < K; k++) g[k] = c->scale * (c->norm ? p[sel[k]] / (sum + 1e-20) : p[sel[k]]);
    return margin;
}

typedef struct cand { double g; int i; } cand;
static int cand_cmp(const void *a, const void *b) {
    const cand *x = (const cand *)a, *y = (const cand *)b;
    if (x->g != y->g) return x->g > y->g ? -1 : 1;
    return x->i - y->i;
}

/* SwiGLU of x (D) with w1, w3 (F,D), w2 (D,F): out (D) += alpha * W2 (silu(W1 x) * W3 x). */
static void ref_swiglu(const double *x, const double *w1, const double *w2, const double *w3, int D, int F, double alpha, double *out) {
    double a[512];
    for (int f = 0; f < F; f++) {
        double h1 = 0, h3 = 0;
        for (int i = 0; i < D; i++) { h1 += w1[f * D + i] * x[i]; h3 += w3[f * D + i] * x[i]; }
        a[f] = silu64(h1) * h3;
    }
    for (int d = 0; d < D; d++) {
        double acc = 0;
        for (int f = 0; f < F; f++) acc += w2[d * F + f] * a[f];
        out[d] += alpha * acc;
    }
}

/* What the balancing losses count for one token (lcnt (E) = 0/1): its selections, or the
   published rule (DeepSeek-V3 paper, Megatron-Core): the top K of its unbiased scores p over all
   experts. Returns the gap between the K-th and the (K+1)-th score (a tie margin). */
static double ref_loss_count(const cfg *c, const double *p, const int *sel, int *lcnt) {
    int E = c->E, K = c->K, taken[512] = {0};
    double kth = 0, next = -1e300;
    memset(lcnt, 0, sizeof(int) * E);
    if (c->count_sel) {
        for (int k = 0; k < K; k++) lcnt[sel[k]] = 1;
        return 1e300;
    }
    for (int k = 0; k < K; k++) {
        int b = -1;
        for (int j = 0; j < E; j++) if (!taken[j] && (b < 0 || p[j] > p[b])) b = j;
        taken[b] = lcnt[b] = 1;
        kth = p[b];
    }
    for (int j = 0; j < E; j++) if (!taken[j] && p[j] > next) next = p[j];
    return kth - next;
}

/* y (T,D); returns sum(y * R) + loss terms (R may be NULL: just the loss terms). */
static double ref_forward(const cfg *c, const refp *w, const double *x, double *y, const double *R, refout *o) {
    int T = c->T, D = c->D, E = c->E, K = c->K, F = c->F;
    double *p = (double *)calloc((size_t)T * E, sizeof(double)), *pn = (double *)calloc((size_t)T * E, sizeof(double));
    double total = 0;
    o->margin = 1e300;
    o->dropped = 0;
    memset(o->load, 0, (size_t)E * sizeof(int));
    for (int t = 0; t < T; t++) {
        double m = ref_route(c, w, x + t * D, o->sel + t * K, o->g + t * K, p + t * E,
                             c->force ? c->force + t * K : NULL), tot = 0;
        if (m < o->margin) o->margin = m;
        if (c->aux > 0 || c->seq_aux > 0) {
            m = ref_loss_count(c, p + t * E, o->sel + t * K, o->lcnt + t * E);
            if (m < o->margin) o->margin = m;
        }
        for (int k = 0; k < K; k++) { o->kept[t * K + k] = 1; o->load[o->sel[t * K + k]]++; }
        for (int j = 0; j < E; j++) tot += p[t * E + j];
        for (int j = 0; j < E; j++) pn[t * E + j] = c->sigmoid ? p[t * E + j] / tot : p[t * E + j];
    }
    if (c->cf > 0) {
        int cap = (int)ceil((double)T * K / E * c->cf);
        for (int e = 0; e < E; e++) {
            cand *cs = (cand *)calloc((size_t)T * K, sizeof(cand));
            int n = 0;
            for (int i = 0; i < T * K; i++) if (o->sel[i] == e) { cs[n].g = c->drop_pos ? -(double)i : o->g[i]; cs[n].i = i; n++; }
            qsort(cs, (size_t)n, sizeof(cand), cand_cmp);
            for (int j = cap; j < n; j++) { o->kept[cs[j].i] = 0; o->dropped++; }
            free(cs);
        }
    }
    for (int t = 0; t < T; t++) {
        double *yt = y + t * D;
        memset(yt, 0, (size_t)D * sizeof(double));
        for (int k = 0; k < K; k++) {
            int e = o->sel[t * K + k];
            if (!o->kept[t * K + k]) continue;
            ref_swiglu((c->xe ? c->xe : x) + t * D, w->w1 + (size_t)e * F * D, w->w2 + (size_t)e * D * F,
                       w->w3 + (size_t)e * F * D, D, F, o->g[t * K + k], yt);
        }
        if (c->Fs > 0) ref_swiglu(x + t * D, w->s1, w->s2, w->s3, D, c->Fs, 1.0, yt);
        if (R) for (int d = 0; d < D; d++) total += yt[d] * R[t * D + d];
    }
    o->aux = o->seq_aux = o->z = 0;
    if (c->aux > 0) {
        for (int e = 0; e < E; e++) {
            double P = 0, cnt = 0;
            for (int t = 0; t < T; t++) { P += pn[t * E + e] / T; cnt += o->lcnt[t * E + e]; }
            o->aux += c->aux * E * (cnt / (T * K)) * P;
        }
    }
    if (c->seq_aux > 0) {
        int L = c->seq_len ? c->seq_len : T, ns = T / L;
        for (int q = 0; q < ns; q++)
            for (int e = 0; e < E; e++) {
                double P = 0, cnt = 0;
                for (int t = q * L; t < (q + 1) * L; t++) {
                    P += pn[t * E + e] / L;
                    cnt += o->lcnt[t * E + e];
                }
                o->seq_aux += c->seq_aux * ((double)E / (K * L) * cnt) * P / ns;
            }
    }
    if (c->z > 0) {
        for (int t = 0; t < T; t++) {
            double u[512], mx = -1e300, s = 0;
            for (int j = 0; j < E; j++) {
                u[j] = 0;
                for (int d = 0; d < D; d++) u[j] += x[t * D + d] * w->wr[j * D + d];
                mx = u[j] > mx ? u[j] : mx;
            }
            for (int j = 0; j < E; j++) s += exp(u[j] - mx);
            o->z += c->z * (mx + log(s)) * (mx + log(s)) / T;
        }
    }
    free(p); free(pn);
    return total + o->aux + o->seq_aux + o->z;
}

/* ---------------------------------------------------------------- layer <-> reference plumbing */

/* A layer whose parameters live in two slabs this test owns (sizes, then bind): values and f32
   gradients (dense parameters first, then the expert-sharded ones); initialised from opts.seed,
   gradients zero. */
typedef struct owned {
    dsk_tensor values, grads;
    int64_t grad_dense, grad_sharded;
} owned;

static dsk_status make_layer(dsk_moe *m, owned *s, const dsk_moe_opts *o) {
    int64_t vb, ng;
    memset(s, 0, sizeof *s);
    DSK__TRY(dsk_moe_init(m, NULL, o));
    dsk_moe_slab_sizes(m, &vb, &s->grad_dense, &s->grad_sharded);
    ng = s->grad_dense + s->grad_sharded;
    DSK__TRY(dsk_tensor_alloc(NULL, &s->values, DSK_U8, 1, &vb));
    DSK__TRY(dsk_tensor_alloc(NULL, &s->grads, DSK_F32, 1, &ng));
    DSK__TRY(dsk_moe_bind_slabs(m, NULL, &s->values, &s->grads));
    DSK__TRY(dsk_moe_init_params(m, NULL));
    return dsk_tensor_fill(NULL, &s->grads, 0.0);
}

static void drop_layer(dsk_moe *m, owned *s) {
    dsk_moe_free(m, NULL);
    dsk_tensor_free(NULL, &s->values);
    dsk_tensor_free(NULL, &s->grads);
}

typedef struct fixture {
    cfg c;
    dsk_moe m;
    owned own;
    refp w;
    double *x, *y, *R;
    refout o;
    dsk_tensor tx, ty;
    float *xf, *yf;
} fixture;

static dsk_moe_opts opts_of(const cfg *c, dsk_dtype dt) {
    dsk_moe_opts o;
    memset(&o, 0, sizeof o);
    o.d_model = c->D; o.n_routed = c->E; o.top_k = c->K; o.d_expert = c->F;
    o.n_shared = c->n_shared; o.d_shared = c->n_shared ? c->Fs / c->n_shared : 0;
    o.score = c->sigmoid ? DSK_MOE_SIGMOID : DSK_MOE_SOFTMAX;
    o.norm = c->norm ? DSK_MOE_NORM_ON : DSK_MOE_NORM_OFF;
    o.routed_scale = (float)c->scale; o.n_group = c->n_group; o.topk_group = c->topk_group;
    o.group_rule = (dsk_moe_group_rule)c->group_rule;
    o.loss_count = c->count_sel ? DSK_MOE_COUNT_SELECTED : DSK_MOE_COUNT_TOPK;
    o.aux_alpha = (float)c->aux; o.seq_aux_alpha = (float)c->seq_aux; o.seq_len = c->seq_len; o.z_beta = (float)c->z;
    o.capacity_factor = (float)c->cf; o.drop = c->drop_pos ? DSK_MOE_DROP_POSITION : DSK_MOE_DROP_PROB;
    o.dtype = dt;
    return o;
}

/* Fills a parameter with random values (rounded to its dtype) and mirrors them in double. */
static void fill_param(dsk_moe_param *p, double **mirror, double lo, double hi) {
    int64_t n = dsk_tensor_numel(&p->value);
    *mirror = (double *)calloc((size_t)(n ? n : 1), sizeof(double));
    for (int64_t i = 0; i < n; i++) {
        float v = (float)dsk_test_rand(lo, hi);
        if (p->value.dtype == DSK_BF16) {
            ((uint16_t *)p->value.data)[i] = dsk_f32_to_bf16(v);
            v = dsk_bf16_to_f32(((uint16_t *)p->value.data)[i]);
        } else {
            ((float *)p->value.data)[i] = v;
        }
        (*mirror)[i] = v;
    }
}

static void free_fixture(fixture *f) {
    double *ws[] = {f->w.wr, f->w.b, f->w.w1, f->w.w2, f->w.w3, f->w.s1, f->w.s2, f->w.s3};
    for (int i = 0; i < 8; i++) free(ws[i]);
    free(f->x); free(f->y); free(f->R); free(f->o.sel); free(f->o.g); free(f->o.kept); free(f->o.load); free(f->o.lcnt);
    dsk_tensor_free(NULL, &f->tx); dsk_tensor_free(NULL, &f->ty);
    free(f->xf); free(f->yf);
    drop_layer(&f->m, &f->own);
    memset(f, 0, sizeof *f);
}

/* Fresh random x (rounded to the layer's dtype, mirrored in double) and R. */
static void draw_x(fixture *f) {
    for (int i = 0; i < f->c.T * f->c.D; i++) {
        float v = (float)dsk_test_rand(-1.0, 1.0);
        if (f->tx.dtype == DSK_BF16) {
            ((uint16_t *)f->tx.data)[i] = dsk_f32_to_bf16(v);
            v = dsk_bf16_to_f32(((uint16_t *)f->tx.data)[i]);
        } else {
            ((float *)f->tx.data)[i] = v;
        }
        f->x[i] = v;
        f->R[i] = dsk_test_rand(-1.0, 1.0);
    }
}

/* Builds the layer with random parameters and inputs whose routing is at least 1e-4 away
   from any tie (re-drawing x otherwise). bias_mag: bias drawn in [-bias_mag, bias_mag]. */
static int setup(fixture *f, const cfg *c, dsk_dtype dt, double bias_mag) {
    dsk_moe_opts o = opts_of(c, dt);
    int64_t shp[2] = {c->T, c->D};
    memset(f, 0, sizeof *f);
    f->c = *c;
    if (make_layer(&f->m, &f->own, &o) != DSK_OK) {
        dsk_test_fail_at(__FILE__, __LINE__, "making the layer: %s", dsk_last_error());
        return 0;
    }
    fill_param(f->m.router, &f->w.wr, -1.0, 1.0);
    fill_param(f->m.bias, &f->w.b, -bias_mag, bias_mag);
    fill_param(f->m.w1, &f->w.w1, -0.5, 0.5);
    fill_param(f->m.w2, &f->w.w2, -0.5, 0.5);
    fill_param(f->m.w3, &f->w.w3, -0.5, 0.5);
    if (c->Fs > 0) {
        fill_param(f->m.sw1, &f->w.s1, -0.5, 0.5);
        fill_param(f->m.sw2, &f->w.s2, -0.5, 0.5);
        fill_param(f->m.sw3, &f->w.s3, -0.5, 0.5);
    }
    f->x = (double *)calloc((size_t)c->T * c->D + 1, sizeof(double));
    f->y = (double *)calloc((size_t)c->T * c->D + 1, sizeof(double));
    f->R = (double *)calloc((size_t)c->T * c->D + 1, sizeof(double));
    f->o.sel = (int *)calloc((size_t)c->T * c->K + 1, sizeof(int));
    f->o.g = (double *)calloc((size_t)c->T * c->K + 1, sizeof(double));
    f->o.kept = (int *)calloc((size_t)c->T * c->K + 1, sizeof(int));
    f->o.load = (int *)calloc((size_t)c->E, sizeof(int));
    f->o.lcnt = (int *)calloc((size_t)c->T * c->E + 1, sizeof(int));
    f->xf = (float *)calloc((size_t)c->T * c->D + 1, sizeof(float));
    f->yf = (float *)calloc((size_t)c->T * c->D + 1, sizeof(float));
    dsk_tensor_alloc(NULL, &f->tx, dt, 2, shp);
    dsk_tensor_alloc(NULL, &f->ty, dt, 2, shp);
    for (int tries = 0; tries < 50; tries++) {
        draw_x(f);
        ref_forward(c, &f->w, f->x, f->y, f->R, &f->o);
        if (f->o.margin > (c->min_margin > 0 ? c->min_margin : 1e-4)) return 1;
    }
    dsk_test_fail_at(__FILE__, __LINE__, "could not draw inputs away from routing ties");
    return 0;
}

/* Runs the layer forward (output poisoned first; replaying the routing `replay` unless NULL) and
   returns y as f32 in f->yf. */
static int run_forward_replay(fixture *f, dsk_moe_stats *st, const dsk_tensor *replay) {
    int64_t n = (int64_t)f->c.T * f->c.D;
    dsk_status s;
    if (f->ty.dtype == DSK_F32) dsk_test_poison_f32((float *)f->ty.data, n);
    else dsk_test_poison_bytes(f->ty.data, (size_t)n * 2);
    s = replay ? dsk_moe_forward_replay(&f->m, NULL, &f->ty, &f->tx, replay, st)
               : dsk_moe_forward(&f->m, NULL, &f->ty, &f->tx, st);
    if (s != DSK_OK) {
        dsk_test_fail_at(__FILE__, __LINE__, "dsk_moe_forward: %s: %s", dsk_status_str(s), dsk_last_error());
        return 0;
    }
    for (int64_t i = 0; i < n; i++)
        f->yf[i] = f->ty.dtype == DSK_F32 ? ((float *)f->ty.data)[i] : dsk_bf16_to_f32(((uint16_t *)f->ty.data)[i]);
    return 1;
}

static int run_forward(fixture *f, dsk_moe_stats *st) { return run_forward_replay(f, st, NULL); }

static cfg base_cfg(int T, int D, int E, int K, int F) {
    cfg c;
    memset(&c, 0, sizeof c);
    c.T = T; c.D = D; c.E = E; c.K = K; c.F = F; c.n_group = 1; c.topk_group = 1; c.scale = 1.0;
    return c;
}

/* ---------------------------------------------------------------- forward */

static void check_forward(const char *what, cfg c, double bias_mag) {
    fixture f;
    dsk_moe_stats st;
    dsk_test_begin("forward %s T=%d D=%d E=%d K=%d F=%d shared=%d", what, c.T, c.D, c.E, c.K, c.F, c.Fs);
    if (setup(&f, &c, DSK_F32, bias_mag) && run_forward(&f, &st)) {
        DSK_TEST_CLOSE(f.yf, f.y, (int64_t)c.T * c.D, 1e-4, 1e-5, "y");
        DSK_TEST_EXPECT(st.dropped == f.o.dropped, "dropped %lld, reference %d", (long long)st.dropped, f.o.dropped);
        DSK_TEST_EXPECT(st.tokens == c.T && st.slots == (int64_t)c.T * c.K, "tokens %lld slots %lld", (long long)st.tokens, (long long)st.slots);
        for (int e = 0; e < c.E; e++)
            DSK_TEST_EXPECT(st.tokens_per_expert[e] == f.o.load[e], "expert %d load %lld, reference %d", e, (long long)st.tokens_per_expert[e], f.o.load[e]);
    }
    free_fixture(&f);
    dsk_test_end();
}

static void test_forward_variants(void) {
    int Ts[3] = {1, 7, 129};
    for (int i = 0; i < 3; i++) {
        cfg c = base_cfg(Ts[i], 24, 6, 2, 16);
        check_forward("softmax", c, 0.0);
        c.norm = 1; c.n_shared = 2; c.Fs = 20; c.scale = 2.5;
        check_forward("softmax+norm+shared+scale", c, 0.0);
        c = base_cfg(Ts[i], 16, 12, 3, 10);
        c.sigmoid = 1; c.norm = 1; c.n_group = 4; c.topk_group = 2; c.scale = 2.5; c.n_shared = 1; c.Fs = 12;
        check_forward("sigmoid+groups+bias+shared", c, 0.05);
        c.norm = 0; c.n_group = 1; c.topk_group = 1; c.n_shared = 0; c.Fs = 0;
        check_forward("sigmoid no-norm", c, 0.05);
        c = base_cfg(Ts[i], 20, 10, 4, 8);
        c.n_group = 5; c.topk_group = 3;
        check_forward("softmax+groups, DeepSeek-V3 rule (top-2 sum)", c, 0.05);
        c.group_rule = DSK_MOE_GROUP_MAX;
        check_forward("softmax+groups, max rule", c, 0.05);
        c = base_cfg(Ts[i], 16, 16, 6, 8);
        c.sigmoid = 1; c.norm = 1; c.n_group = 4; c.topk_group = 2; c.group_rule = DSK_MOE_GROUP_MEGATRON;
        check_forward("sigmoid+groups, Megatron rule (top-3 sum)", c, 0.05);
    }
    {
        cfg c = base_cfg(129, 16, 7, 3, 8);
        c.cf = 1.0;
        check_forward("capacity drop-by-prob cf=1", c, 0.0);
        c.drop_pos = 1;
        check_forward("capacity drop-by-position cf=1", c, 0.0);
        c.cf = 0.5; c.sigmoid = 1; c.norm = 1;
        check_forward("capacity drop-by-position cf=0.5 sigmoid", c, 0.05);
        c.drop_pos = 0;
        check_forward("capacity drop-by-prob cf=0.5 sigmoid", c, 0.05);
    }
}

/* Masked groups are -inf, not 0: with every selection score negative (bias -2), a 0 fill
   would pick experts from dropped groups. */
static void test_group_mask_is_neg_inf(void) {
    cfg c = base_cfg(65, 16, 16, 4, 8);
    fixture f;
    dsk_moe_stats st;
    c.sigmoid = 1; c.norm = 1; c.n_group = 8; c.topk_group = 2;
    if (!setup(&f, &c, DSK_F32, 0.0)) { free_fixture(&f); return; }
    for (int e = 0; e < c.E; e++) {
        ((float *)f.m.bias->value.data)[e] = -2.0f - 0.01f * (float)e;
        f.w.b[e] = ((float *)f.m.bias->value.data)[e];
    }
    ref_forward(&c, &f.w, f.x, f.y, NULL, &f.o);
    if (run_forward(&f, &st)) {
        int outside = 0;
        DSK_TEST_CLOSE(f.yf, f.y, (int64_t)c.T * c.D, 1e-4, 1e-5, "y with a negative bias");
        /* every selected expert lies in one of the token's topk_group groups */
        for (int t = 0; t < c.T; t++) {
            int groups[8] = {0}, ng = 0;
            for (int k = 0; k < c.K; k++) groups[f.o.sel[t * c.K + k] / 2] = 1;
            for (int g = 0; g < 8; g++) ng += groups[g];
            outside += ng > c.topk_group;
        }
        DSK_TEST_EXPECT(outside == 0, "%d tokens use more than topk_group groups", outside);
    }
    free_fixture(&f);
}

/* The three group rules on the same layer and inputs: each matches its float64 reference, and
   they route some tokens differently (so the checks above tell them apart): 4 groups of 4
   experts, keep 2, top-6 (Megatron sums a group's top 3; with V3's own top-8 of 4 kept groups
   it would sum the top 2, as V3 does), softmax and sigmoid, with a bias. */
static void test_group_rules(void) {
    static const char *names[3] = {"DeepSeek-V3", "max", "Megatron"};
    for (int sig = 0; sig < 2; sig++) {
        cfg c = base_cfg(129, 16, 16, 6, 6);
        fixture f;
        int *sel0 = (int *)malloc(sizeof(int) * 129 * 6);
        c.sigmoid = sig; c.norm = sig; c.n_group = 4; c.topk_group = 2; c.scale = 2.5;
        dsk_test_begin("group rules, %s", sig ? "sigmoid" : "softmax");
        if (setup(&f, &c, DSK_F32, 0.05)) {
            int tries = 0;
            double margin = 0;
            for (; tries < 50 && margin <= 1e-4; tries++) { /* inputs away from ties under every rule */
                margin = 1e300;
                if (tries) draw_x(&f);
                for (int rule = 2; rule >= 0; rule--) {
                    f.c.group_rule = rule;
                    ref_forward(&f.c, &f.w, f.x, f.y, NULL, &f.o);
                    margin = f.o.margin < margin ? f.o.margin : margin;
                }
            }
            DSK_TEST_EXPECT(margin > 1e-4, "no inputs away from ties under every rule in %d draws", tries);
            memcpy(sel0, f.o.sel, sizeof(int) * 129 * 6); /* rule 0, DeepSeek-V3's */
            for (int rule = 0; rule < 3; rule++) {
                int differ = 0;
                f.c.group_rule = rule;
                f.m.routing.group_rule = (dsk_moe_group_rule)rule;
                ref_forward(&f.c, &f.w, f.x, f.y, NULL, &f.o);
                for (int t = 0; t < 129; t++) differ += memcmp(f.o.sel + t * 6, sel0 + t * 6, sizeof(int) * 6) != 0;
                if (rule > 0)
                    DSK_TEST_EXPECT(differ > 0, "the %s rule routes every token as DeepSeek-V3's does", names[rule]);
                if (run_forward(&f, NULL)) DSK_TEST_CLOSE(f.yf, f.y, 129 * 16, 1e-4, 1e-5, names[rule]);
            }
        }
        free(sel0);
        free_fixture(&f);
        dsk_test_end();
    }
}

/* The bias moves selection only: a uniform shift leaves y bitwise the same; a bias that
   changes the selection still gives weights from the unbiased scores (reference). */
static void test_bias_not_in_weights(void) {
    cfg c = base_cfg(33, 16, 8, 2, 8);
    fixture f;
    c.sigmoid = 1; c.norm = 1; c.scale = 2.5;
    if (setup(&f, &c, DSK_F32, 0.0) && run_forward(&f, NULL)) {
        float *y0 = (float *)malloc(sizeof(float) * c.T * c.D);
        int changed = 0;
        int *sel0 = (int *)malloc(sizeof(int) * c.T * c.K);
        memcpy(y0, f.yf, sizeof(float) * c.T * c.D);
        memcpy(sel0, f.o.sel, sizeof(int) * c.T * c.K);
        for (int e = 0; e < c.E; e++) ((float *)f.m.bias->value.data)[e] = 0.75f;
        if (run_forward(&f, NULL)) DSK_TEST_SAME_BYTES(f.yf, y0, sizeof(float) * c.T * c.D, "y with a uniform bias");
        for (int e = 0; e < c.E; e++) { ((float *)f.m.bias->value.data)[e] = (float)dsk_test_rand(-0.3, 0.3); f.w.b[e] = ((float *)f.m.bias->value.data)[e]; }
        ref_forward(&c, &f.w, f.x, f.y, NULL, &f.o);
        for (int i = 0; i < c.T * c.K; i++) changed += f.o.sel[i] != sel0[i];
        DSK_TEST_EXPECT(changed > 0, "the random bias changed no selection");
        if (f.o.margin > 1e-4 && run_forward(&f, NULL)) DSK_TEST_CLOSE(f.yf, f.y, (int64_t)c.T * c.D, 1e-4, 1e-5, "y with a random bias");
        free(y0); free(sel0);
    }
    free_fixture(&f);
}

static void test_loss_terms(void) {
    int Ts[2] = {8, 129};
    for (int i = 0; i < 2; i++) {
        for (int sig = 0; sig < 2; sig++) {
            cfg c = base_cfg(Ts[i] == 8 ? 8 : 128, 12, 6, 2, 6);
            fixture f;
            dsk_moe_stats st;
            dsk_test_begin("loss terms %s T=%d", sig ? "sigmoid" : "softmax", c.T);
            c.sigmoid = sig; c.norm = sig; c.aux = 0.01; c.seq_aux = 0.003; c.seq_len = c.T == 8 ? 4 : 32; c.z = 0.001;
            if (setup(&f, &c, DSK_F32, sig ? 0.05 : 0.0) && run_forward(&f, &st)) {
                double got[4] = {st.aux_loss, st.seq_aux_loss, st.z_loss, st.loss};
                double want[4] = {f.o.aux, f.o.seq_aux, f.o.z, f.o.aux + f.o.seq_aux + f.o.z};
                DSK_TEST_CLOSE64(got, want, 4, 1e-5, 0, "aux, seq_aux, z, total");
                DSK_TEST_EXPECT(f.o.aux > 0 && f.o.seq_aux > 0 && f.o.z > 0, "loss terms not all positive");
            }
            free_fixture(&f);
            dsk_test_end();
        }
    }
}

/* What the balancing losses count, on a DeepSeek-V3-like router (64 experts, top-8, 8 groups
   keep 4, sigmoid, a bias): by default the plain top-K of the unbiased scores (V3 paper,
   Megatron-Core), optionally the actual selections; both against float64 references, and the
   two count vectors differ (so the check tells the rules apart). */
static void test_loss_counts(void) {
    for (int sel = 0; sel < 2; sel++) {
        cfg c = base_cfg(64, 16, 64, 8, 4);
        fixture f;
        dsk_moe_stats st;
        dsk_test_begin("loss counts %s, V3-like router", sel ? "the selections" : "the plain top-K (default)");
        c.sigmoid = 1; c.norm = 1; c.n_group = 8; c.topk_group = 4; c.scale = 2.5;
        c.aux = 0.01; c.seq_aux = 0.003; c.seq_len = 16; c.count_sel = sel; c.min_margin = 2e-6;
        if (setup(&f, &c, DSK_F32, 0.2) && run_forward(&f, &st)) {
            double got[3] = {st.aux_loss, st.seq_aux_loss, st.loss},
                   want[3] = {f.o.aux, f.o.seq_aux, f.o.aux + f.o.seq_aux};
            double topk[64] = {0}, chosen[64] = {0}, diff = 0;
            DSK_TEST_CLOSE64(got, want, 3, 1e-5, 0, "aux, seq_aux, total");
            for (int t = 0; t < c.T; t++) {
                int one[64];
                double p[64];
                cfg pub = c;
                pub.count_sel = 0;
                for (int k = 0; k < c.K; k++) chosen[f.o.sel[t * c.K + k]] += 1;
                for (int e = 0; e < c.E; e++) { /* p from the reference: recompute the token's scores */
                    double u = 0;
                    for (int d = 0; d < c.D; d++) u += f.x[t * c.D + d] * f.w.wr[e * c.D + d];
                    p[e] = 1.0 / (1.0 + exp(-u));
                }
                ref_loss_count(&pub, p, f.o.sel + t * c.K, one);
                for (int e = 0; e < c.E; e++) topk[e] += one[e];
            }
            for (int e = 0; e < c.E; e++) diff += fabs(topk[e] - chosen[e]) / (c.T * c.K);
            DSK_TEST_EXPECT(diff > 0.1, "count vectors differ by only %.3f of the slots", diff);
            /* the loads for the bias update are the selections under either rule */
            for (int e = 0; e < c.E; e++)
                DSK_TEST_EXPECT(st.tokens_per_expert[e] == (int64_t)chosen[e], "expert %d load %lld, selected %g", e,
                                (long long)st.tokens_per_expert[e], chosen[e]);
        }
        free_fixture(&f);
        dsk_test_end();
    }
}

static void test_bias_update(void) {
    for (int rec = 0; rec < 2; rec++) {
        cfg c = base_cfg(37, 12, 9, 3, 6);
        fixture f;
        dsk_test_begin("bias update%s", rec ? " with re-centring" : "");
        c.sigmoid = 1; c.norm = 1;
        if (setup(&f, &c, DSK_F32, 0.02)) {
            double want[9], mean = 0, load[9] = {0}, bm = 0;
            float got[9];
            f.m.opts.bias_rate = 0.01f;
            f.m.opts.bias_recenter = rec;
            /* two micro-batches accumulate loads */
            run_forward(&f, NULL);
            run_forward(&f, NULL);
            for (int e = 0; e < c.E; e++) load[e] = 2.0 * f.o.load[e];
            for (int e = 0; e < c.E; e++) mean += load[e] / c.E;
            for (int e = 0; e < c.E; e++) want[e] = f.w.b[e] + 0.01 * (mean > load[e] ? 1 : mean < load[e] ? -1 : 0);
            if (rec) {
                for (int e = 0; e < c.E; e++) bm += want[e] / c.E;
                for (int e = 0; e < c.E; e++) want[e] -= bm;
            }
            { /* dsk_moe_update_bias_unless with the flag set changes nothing and keeps the loads; bad flags fail */
                int32_t flag = 1;
                float flag_f = 1.0f;
                double b0[9];
                dsk_tensor sk, skf;
                DSK_TEST_OK(dsk_tensor_wrap(&sk, &flag, DSK_I32, dsk_cpu(), 0, NULL));
                DSK_TEST_OK(dsk_tensor_wrap(&skf, &flag_f, DSK_F32, dsk_cpu(), 0, NULL));
                DSK_TEST_OK(dsk_moe_update_bias_unless(&f.m, NULL, &sk));
                memcpy(got, f.m.bias->value.data, sizeof got);
                for (int e = 0; e < c.E; e++) b0[e] = f.w.b[e];
                DSK_TEST_CLOSE(got, b0, c.E, 0, 0, "bias after a skipped update");
                DSK_TEST_STATUS(dsk_moe_update_bias_unless(&f.m, NULL, &skf), DSK_ERR_ARG);
                DSK_TEST_ERROR_MENTIONS("must be one i32 element");
                DSK_TEST_STATUS(dsk_moe_update_bias_unless(&f.m, NULL, NULL), DSK_ERR_ARG);
                DSK_TEST_ERROR_MENTIONS("dsk_moe_update_bias_unless: layer");
                flag = rec; /* re-centring case: the same update through the flag */
                if (rec) DSK_TEST_OK(dsk_moe_update_bias(&f.m, NULL, NULL));
                else DSK_TEST_OK(dsk_moe_update_bias_unless(&f.m, NULL, &sk));
            }
            memcpy(got, f.m.bias->value.data, sizeof got);
            DSK_TEST_CLOSE(got, want, c.E, 1e-6, 1e-7, "bias");
            /* loads were reset: an update with no forward in between changes nothing but re-centring */
            DSK_TEST_OK(dsk_moe_update_bias(&f.m, NULL, NULL));
            memcpy(got, f.m.bias->value.data, sizeof got);
            DSK_TEST_CLOSE(got, want, c.E, 1e-6, 1e-6, "bias after an empty update");
            /* an eval forward (validation, sampling) is not counted either */
            f.m.eval = 1;
            run_forward(&f, NULL);
            f.m.eval = 0;
            DSK_TEST_OK(dsk_moe_update_bias(&f.m, NULL, NULL));
            memcpy(got, f.m.bias->value.data, sizeof got);
            DSK_TEST_CLOSE(got, want, c.E, 1e-6, 1e-6, "bias after an eval forward");
        }
        free_fixture(&f);
        dsk_test_end();
    }
}

/* ---------------------------------------------------------------- gradients */

/* Central differences of the reference loss on one double array. */
static void fd_grad(fixture *f, double *arr, int64_t n, double *g) {
    const double h = 1e-6;
    double *yb = (double *)malloc(sizeof(double) * f->c.T * f->c.D);
    for (int64_t i = 0; i < n; i++) {
        double v = arr[i], lp, lm;
        arr[i] = v + h; lp = ref_forward(&f->c, &f->w, f->x, yb, f->R, &f->o);
        arr[i] = v - h; lm = ref_forward(&f->c, &f->w, f->x, yb, f->R, &f->o);
        arr[i] = v;
        g[i] = (lp - lm) / (2 * h);
    }
    free(yb);
}

static void check_grad(const char *what, const float *got, double *arr, int64_t n, fixture *f) {
    double *want = (double *)malloc(sizeof(double) * (size_t)(n ? n : 1)), mx = 0;
    fd_grad(f, arr, n, want);
    for (int64_t i = 0; i < n; i++) mx = fabs(want[i]) > mx ? fabs(want[i]) : mx;
    DSK_TEST_CLOSE(got, want, n, 2e-3, 2e-5 * (mx > 1 ? mx : 1), what);
    free(want);
}

static void check_backward(const char *what, cfg c, double bias_mag) {
    fixture f;
    dsk_test_begin("backward %s T=%d E=%d K=%d", what, c.T, c.E, c.K);
    if (setup(&f, &c, DSK_F32, bias_mag) && run_forward(&f, NULL)) {
        int64_t n = (int64_t)c.T * c.D;
        dsk_tensor dx, dy;
        int64_t shp[2] = {c.T, c.D};
        float *dx0 = (float *)malloc(sizeof(float) * n);
        dsk_tensor_alloc(NULL, &dx, DSK_F32, 2, shp);
        dsk_tensor_alloc(NULL, &dy, DSK_F32, 2, shp);
        for (int64_t i = 0; i < n; i++) { ((float *)dy.data)[i] = (float)f.R[i]; f.R[i] = ((float *)dy.data)[i]; }
        for (int64_t i = 0; i < n; i++) dx0[i] = ((float *)dx.data)[i] = (float)dsk_test_rand(-1, 1); /* backward accumulates */
        DSK_TEST_OK(dsk_moe_zero_grad(&f.m, NULL));
        DSK_TEST_OK(dsk_moe_backward(&f.m, NULL, &dx, &dy, 1.0f));
        for (int64_t i = 0; i < n; i++) ((float *)dx.data)[i] -= dx0[i];
        check_grad("dx", (const float *)dx.data, f.x, n, &f);
        check_grad("d router", (const float *)f.m.router->grad.data, f.w.wr, (int64_t)c.E * c.D, &f);
        check_grad("d w1", (const float *)f.m.w1->grad.data, f.w.w1, (int64_t)c.E * c.F * c.D, &f);
        check_grad("d w2", (const float *)f.m.w2->grad.data, f.w.w2, (int64_t)c.E * c.F * c.D, &f);
        check_grad("d w3", (const float *)f.m.w3->grad.data, f.w.w3, (int64_t)c.E * c.F * c.D, &f);
        if (c.Fs > 0) {
            check_grad("d shared.w1", (const float *)f.m.sw1->grad.data, f.w.s1, (int64_t)c.Fs * c.D, &f);
            check_grad("d shared.w2", (const float *)f.m.sw2->grad.data, f.w.s2, (int64_t)c.Fs * c.D, &f);
            check_grad("d shared.w3", (const float *)f.m.sw3->grad.data, f.w.s3, (int64_t)c.Fs * c.D, &f);
        }
        free(dx0);
        dsk_tensor_free(NULL, &dx);
        dsk_tensor_free(NULL, &dy);
    }
    free_fixture(&f);
    dsk_test_end();
}

static void test_backward_variants(void) {
    cfg c = base_cfg(7, 8, 5, 2, 6);
    check_backward("softmax", c, 0.0);
    c.norm = 1; c.scale = 2.0; c.n_shared = 1; c.Fs = 5; c.aux = 0.05; c.z = 0.01;
    check_backward("softmax+norm+shared+aux+z", c, 0.0);
    c = base_cfg(9, 8, 6, 2, 5);
    c.sigmoid = 1; c.norm = 1; c.n_group = 3; c.topk_group = 2; c.scale = 2.5; c.seq_aux = 0.05; c.seq_len = 3; c.aux = 0.02; c.z = 0.01;
    c.n_shared = 2; c.Fs = 6;
    check_backward("sigmoid+groups+bias+seq_aux+aux+z+shared", c, 0.05);
    c.norm = 0;
    check_backward("sigmoid no-norm", c, 0.05);
    c.norm = 1; c.count_sel = 1;
    check_backward("sigmoid+groups+bias+seq_aux+aux, losses count the selections", c, 0.05);
    c = base_cfg(1, 8, 5, 3, 4);
    c.sigmoid = 1; c.norm = 1;
    check_backward("T=1 sigmoid", c, 0.05);
    c = base_cfg(12, 6, 4, 2, 4);
    c.cf = 0.75; c.drop_pos = 1; c.aux = 0.02;
    check_backward("capacity by position", c, 0.0);
    c.drop_pos = 0; c.norm = 1;
    check_backward("capacity by prob", c, 0.0);
}

/* seq_len belongs to the sequence-wise loss only: with the Switch loss and z-loss alone, a T
   that is not a multiple of seq_len is fine, and loss values and gradients ignore seq_len
   (the trailing tokens' gradients read past the coefficients before). */
static void test_switch_loss_ignores_seq_len(void) {
    for (int sig = 0; sig < 2; sig++) {
        cfg c = base_cfg(9, 8, 5, 2, 4);
        fixture f;
        dsk_moe_stats st;
        c.sigmoid = sig; c.norm = sig; c.aux = 0.05; c.z = 0.01; c.seq_len = 5;
        dsk_test_begin("Switch loss, seq_len 5 not dividing T 9, %s", sig ? "sigmoid" : "softmax");
        if (setup(&f, &c, DSK_F32, sig ? 0.05 : 0.0) && run_forward(&f, &st)) {
            double got[2] = {st.aux_loss, st.z_loss}, want[2] = {f.o.aux, f.o.z};
            DSK_TEST_CLOSE64(got, want, 2, 1e-5, 0, "Switch and z losses");
        }
        free_fixture(&f);
        dsk_test_end();
        check_backward(sig ? "Switch aux, seq_len 5, T 9, sigmoid" : "Switch aux, seq_len 5, T 9, softmax", c,
                       sig ? 0.05 : 0.0);
    }
}

/* Gradients accumulate across micro-batches (forward, backward, forward, backward); a second
   backward of one forward fails naming the layer (it would add the gradients again) and changes
   nothing. */
static void test_grad_accumulates(void) {
    cfg c = base_cfg(11, 8, 4, 2, 6);
    fixture f;
    c.n_shared = 1; c.Fs = 6;
    if (setup(&f, &c, DSK_F32, 0.0) && run_forward(&f, NULL)) {
        int64_t n = (int64_t)c.T * c.D, ng = dsk_tensor_numel(&f.own.grads);
        dsk_tensor dx, dy;
        int64_t shp[2] = {c.T, c.D};
        float *g1 = (float *)malloc(sizeof(float) * ng);
        double *twice = (double *)malloc(sizeof(double) * ng);
        dsk_tensor_alloc(NULL, &dx, DSK_F32, 2, shp);
        dsk_tensor_alloc(NULL, &dy, DSK_F32, 2, shp);
        for (int64_t i = 0; i < n; i++) { ((float *)dy.data)[i] = (float)f.R[i]; ((float *)dx.data)[i] = 0; }
        DSK_TEST_OK(dsk_moe_backward(&f.m, NULL, &dx, &dy, 1.0f));
        memcpy(g1, f.own.grads.data, sizeof(float) * ng);
        DSK_TEST_STATUS(dsk_moe_backward(&f.m, NULL, &dx, &dy, 1.0f), DSK_ERR_STATE);
        DSK_TEST_ERROR_MENTIONS("dsk_moe_backward: layer \"moe\": a backward already used the forward in slot 0");
        DSK_TEST_SAME_BYTES(f.own.grads.data, g1, sizeof(float) * ng, "grads after a refused second backward");
        DSK_TEST_EXPECT(run_forward(&f, NULL), "second forward");
        DSK_TEST_OK(dsk_moe_backward(&f.m, NULL, &dx, &dy, 1.0f));
        for (int64_t i = 0; i < ng; i++) twice[i] = 2.0 * g1[i];
        DSK_TEST_CLOSE((const float *)f.own.grads.data, twice, ng, 1e-6, 0, "grad after two micro-batches");
        DSK_TEST_EXPECT(f.own.grad_dense == (int64_t)(c.E + 3 * c.Fs) * c.D &&
                        f.own.grad_sharded == (int64_t)3 * c.E * c.F * c.D, "slab parts %lld + %lld",
                        (long long)f.own.grad_dense, (long long)f.own.grad_sharded);
        free(g1); free(twice);
        dsk_tensor_free(NULL, &dx); dsk_tensor_free(NULL, &dy);
    }
    free_fixture(&f);
}

/* ---------------------------------------------------------------- saved forwards (dsk_moe_set_slots) */

enum { SL_MB = 4 }; /* micro-batches */

static dsk_moe_opts x8_opts(void);

typedef struct sl_io {
    int T[SL_MB];
    float *x[SL_MB], *dy[SL_MB]; /* (T[i], D) each */
} sl_io;

static sl_io sl_draw(int D, const int *T) {
    sl_io io;
    for (int i = 0; i < SL_MB; i++) {
        io.T[i] = T[i];
        io.x[i] = (float *)malloc(sizeof(float) * (size_t)(T[i] * D));
        io.dy[i] = (float *)malloc(sizeof(float) * (size_t)(T[i] * D));
        for (int j = 0; j < T[i] * D; j++) {
            io.x[i][j] = (float)dsk_test_rand(-1, 1);
            io.dy[i][j] = (float)dsk_test_rand(-1, 1);
        }
    }
    return io;
}

static void sl_free(sl_io *io) {
    for (int i = 0; i < SL_MB; i++) {
        free(io->x[i]);
        free(io->dy[i]);
    }
}

/* What a caller computes between a begin and its end (another micro-batch's attention): a 64 x 64 product. */
static int sl_other_work(void) {
    int64_t sh[2] = {64, 64};
    dsk_tensor t[3];
    int ok = 1;
    for (int i = 0; i < 3; i++) ok = dsk_tensor_alloc(NULL, &t[i], DSK_F32, 2, sh) == DSK_OK && ok;
    for (int i = 0; ok && i < 2 * 64 * 64; i++) ((float *)t[i / 4096].data)[i % 4096] = (float)(i % 101 - 50) / 50;
    ok = ok && dsk_matmul(NULL, &t[2], &t[0], 0, &t[1], 1, 1.0f, 0.0f) == DSK_OK;
    for (int i = 0; i < 3; i++) dsk_tensor_free(NULL, &t[i]);
    return ok;
}

/* How a call is made: whole; its begin, other work, its end; every step with other work between (begin,
   wait, experts, return, wait, end); begin, the return's begin (which computes the experts), end. */
enum { SL_WHOLE, SL_SPLIT, SL_STEPS, SL_SKIP, SL_MODES };

/* The steps between a begin and its end in mode `mode`. */
static int sl_between(dsk_moe *m, int mode) {
    if (mode == SL_SPLIT) return sl_other_work();
    if (mode == SL_SKIP) return dsk_moe_return_begin(m, NULL) == DSK_OK && sl_other_work();
    return sl_other_work() && dsk_moe_wait(m, NULL) == DSK_OK && dsk_moe_experts(m, NULL) == DSK_OK &&
           sl_other_work() && dsk_moe_return_begin(m, NULL) == DSK_OK && sl_other_work() &&
           dsk_moe_wait(m, NULL) == DSK_OK && dsk_moe_wait(m, NULL) == DSK_OK;
}

/* x (dy) of micro-batch i into y (dx, zeroed first) through layer m, the call begun only. */
static int sl_begin(dsk_moe *m, const sl_io *io, int i, int forward, float *dx) {
    int64_t shp[2] = {io->T[i], m->opts.d_model};
    dsk_tensor a;
    dsk_tensor_wrap(&a, forward ? io->x[i] : io->dy[i], DSK_F32, dsk_cpu(), 2, shp);
    if (forward) return dsk_moe_forward_begin(m, NULL, &a) == DSK_OK;
    memset(dx, 0, sizeof(float) * (size_t)(shp[0] * shp[1]));
    return dsk_moe_backward_begin(m, NULL, &a, 1.0f) == DSK_OK;
}

static int sl_end(dsk_moe *m, const sl_io *io, int i, int forward, float *out) {
    int64_t shp[2] = {io->T[i], m->opts.d_model};
    dsk_tensor b;
    dsk_tensor_wrap(&b, out, DSK_F32, dsk_cpu(), 2, shp);
    return (forward ? dsk_moe_forward_end(m, NULL, &b, NULL) : dsk_moe_backward_end(m, NULL, &b)) == DSK_OK;
}

/* One call of the schedule below on micro-batch i: its forward into y, or its backward into dx (zeroed first),
   made as `mode` says (SL_*). */
static int sl_call(dsk_moe *m, const sl_io *io, int i, int forward, int mode, float *y, float *dx) {
    int64_t shp[2] = {io->T[i], m->opts.d_model};
    dsk_tensor a, b;
    if (mode != SL_WHOLE)
        return sl_begin(m, io, i, forward, dx) && sl_between(m, mode) && sl_end(m, io, i, forward, forward ? y : dx);
    dsk_tensor_wrap(&a, forward ? io->x[i] : io->dy[i], DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&b, forward ? y : dx, DSK_F32, dsk_cpu(), 2, shp);
    if (forward) return dsk_moe_forward(m, NULL, &b, &a, NULL) == DSK_OK;
    memset(dx, 0, sizeof(float) * (size_t)(shp[0] * shp[1]));
    return dsk_moe_backward(m, NULL, &b, &a, 1.0f) == DSK_OK;
}

/* The micro-batches of io through a fresh layer of options o as a pipeline stage runs them: micro-batch i in
   slot i mod `slots`, forwards up to `slots` ahead of the backwards, backwards in micro-batch order (slots 1:
   each forward's backward at once), then the bias update; split: each call in two (sl_call). Results: each
   micro-batch's y and dx, the gradient slab and the updated bias (malloc'd, poisoned first, *len floats); NULL
   when a call failed. */
static float *sl_run(dsk_moe_opts o, const sl_io *io, int slots, int mode, size_t *len) {
    dsk_moe m;
    owned own;
    size_t off[SL_MB + 1] = {0}, ng;
    float *buf;
    int fwd = 0, bwd = 0, ok;
    if (make_layer(&m, &own, &o) != DSK_OK) return NULL;
    for (int i = 0; i < SL_MB; i++) off[i + 1] = off[i] + 2 * (size_t)(io->T[i] * o.d_model);
    ng = (size_t)dsk_tensor_numel(&own.grads);
    *len = off[SL_MB] + ng + (size_t)o.n_routed;
    buf = (float *)malloc(sizeof(float) * *len);
    for (size_t i = 0; i < *len; i++) buf[i] = NAN;
    ok = dsk_moe_set_slots(&m, NULL, slots) == DSK_OK;
    while (ok && bwd < SL_MB) {
        int forward = fwd < SL_MB && fwd - bwd < slots, i = forward ? fwd++ : bwd++;
        ok = dsk_moe_use_slot(&m, i % slots) == DSK_OK &&
             sl_call(&m, io, i, forward, mode, buf + off[i], buf + off[i] + (size_t)(io->T[i] * o.d_model));
    }
    ok = ok && dsk_moe_update_bias(&m, NULL, NULL) == DSK_OK;
    if (ok) {
        memcpy(buf + off[SL_MB], own.grads.data, sizeof(float) * ng);
        memcpy(buf + off[SL_MB] + ng, m.bias->value.data, sizeof(float) * (size_t)o.n_routed);
    } else {
        fprintf(stderr, "sl_run: %s\n", dsk_last_error());
        free(buf);
        buf = NULL;
    }
    drop_layer(&m, &own);
    return buf;
}

/* Two layers a and b of options o (b's weights from seed + 1), one expert group, as a paired schedule runs
   them: b's forward of micro-batch 1, then a's forward of micro-batch 0 beside b's backward of micro-batch 1,
   then a's backward. `interleaved`: the pair's steps alternate with one exchange in flight on the group at a
   time (b's rows travel while a computes, a's while b's experts compute, b's return while a's experts compute,
   a's return while b ends), else each call whole. Results: y0, y1, dx0, dx1 and both gradient slabs (malloc'd,
   poisoned first, *len floats); NULL when a call failed. */
static float *sl_pair(dsk_moe_opts o, const sl_io *io, int interleaved, size_t *len) {
    dsk_moe a, b;
    owned oa, ob;
    dsk_moe_opts o1 = o;
    size_t n0 = (size_t)(io->T[0] * o.d_model), n1 = (size_t)(io->T[1] * o.d_model), ng;
    float *buf, *y0, *y1, *dx0, *dx1;
    int ok;
    o1.seed = o.seed + 1;
    if (make_layer(&a, &oa, &o) != DSK_OK) return NULL;
    if (make_layer(&b, &ob, &o1) != DSK_OK) {
        drop_layer(&a, &oa);
        return NULL;
    }
    ng = (size_t)dsk_tensor_numel(&oa.grads);
    *len = 2 * (n0 + n1) + 2 * ng;
    buf = (float *)malloc(sizeof(float) * *len);
    for (size_t i = 0; i < *len; i++) buf[i] = NAN;
    y0 = buf, y1 = y0 + n0, dx0 = y1 + n1, dx1 = dx0 + n0;
    ok = sl_call(&b, io, 1, 1, SL_WHOLE, y1, NULL);
    if (!interleaved) {
        ok = ok && sl_call(&a, io, 0, 1, SL_WHOLE, y0, NULL) && sl_call(&b, io, 1, 0, SL_WHOLE, NULL, dx1);
    } else {
        ok = ok && sl_begin(&b, io, 1, 0, dx1) && sl_other_work() && dsk_moe_wait(&b, NULL) == DSK_OK &&
             sl_begin(&a, io, 0, 1, NULL) && dsk_moe_experts(&b, NULL) == DSK_OK && dsk_moe_wait(&a, NULL) == DSK_OK &&
             dsk_moe_return_begin(&b, NULL) == DSK_OK && dsk_moe_experts(&a, NULL) == DSK_OK &&
             dsk_moe_wait(&b, NULL) == DSK_OK && dsk_moe_return_begin(&a, NULL) == DSK_OK &&
             sl_end(&b, io, 1, 0, dx1) && sl_end(&a, io, 0, 1, y0);
    }
    ok = ok && sl_call(&a, io, 0, 0, SL_WHOLE, NULL, dx0);
    if (ok) {
        memcpy(dx1 + n1, oa.grads.data, sizeof(float) * ng);
        memcpy(dx1 + n1 + ng, ob.grads.data, sizeof(float) * ng);
    } else {
        fprintf(stderr, "sl_pair: %s\n", dsk_last_error());
        free(buf);
        buf = NULL;
    }
    drop_layer(&a, &oa);
    drop_layer(&b, &ob);
    return buf;
}

/* sl_pair interleaved = each call whole, bit for bit; 1 if so. */
static int sl_pair_same(dsk_moe_opts o, const sl_io *io) {
    size_t n1 = 0, n2 = 0;
    float *whole = sl_pair(o, io, 0, &n1), *steps = sl_pair(o, io, 1, &n2);
    int ok = whole && steps && n1 == n2 && memcmp(whole, steps, sizeof(float) * n1) == 0;
    free(whole);
    free(steps);
    return ok;
}

/* Micro-batches of 12, 8, 20 and 4 tokens through 2 and 4 slots (forwards 1 and 3 ahead, slots reused), and
   each call whole, split in its begin and end, or in all its steps, give the serial order's bits: every y, dx,
   gradient and the bias after its update. */
static void check_slots(const char *what, dsk_moe_opts o) {
    static const int T[SL_MB] = {12, 8, 20, 4};
    static const char *modes[] = {"", ", split", ", in steps", ", return begun"};
    sl_io io = sl_draw(o.d_model, T);
    size_t n1 = 0, n = 0;
    float *serial = sl_run(o, &io, 1, SL_WHOLE, &n1);
    dsk_test_begin("saved forwards: %s, 4 micro-batches in 2 and 4 slots, calls whole or in steps = serial (bits)",
                   what);
    DSK_TEST_EXPECT(serial != NULL, "the serial run failed");
    for (int v = 0; serial && v < 2 * SL_MODES; v++) {
        int slots = v < SL_MODES ? 2 : 4, mode = v % SL_MODES;
        float *got = sl_run(o, &io, slots, mode, &n);
        char msg[64];
        snprintf(msg, sizeof msg, "%d slots%s: y, dx, gradients, bias", slots, modes[mode]);
        DSK_TEST_EXPECT(got != NULL, "the run in %d slots%s failed", slots, modes[mode]);
        if (got) DSK_TEST_SAME_BYTES(got, serial, sizeof(float) * n1, msg);
        free(got);
    }
    DSK_TEST_EXPECT(sl_pair_same(o, &io), "two layers' forward and backward in interleaved steps differ from "
                                          "the calls whole (or failed)");
    free(serial);
    sl_free(&io);
    dsk_test_end();
}

static void test_slots_same_bits(void) {
    cfg c = base_cfg(16, 8, 16, 2, 6);
    dsk_moe_opts o;
    c.n_shared = 1;
    c.Fs = 6;
    c.aux = 0.01;
    c.seq_aux = 0.02;
    c.seq_len = 4;
    c.z = 0.001;
    o = opts_of(&c, DSK_F32);
    o.init_std = 0.5f;
    check_slots("softmax, shared expert, the three losses", o);
    c.sigmoid = 1;
    c.n_group = 4;
    c.topk_group = 2;
    c.aux = c.seq_aux = c.z = 0;
    c.cf = 1.0;
    c.scale = 2.5;
    o = opts_of(&c, DSK_F32);
    o.init_std = 0.5f;
    check_slots("sigmoid, groups, capacity 1 (drops)", o);
    check_slots("FP8 experts", x8_opts());
}

/* Bad slot counts and slots; a slot whose forward waits for its backward is not dropped. */
static void test_slots_bad(void) {
    static const int T[SL_MB] = {5, 5, 5, 5};
    cfg c = base_cfg(5, 8, 4, 2, 6);
    dsk_moe_opts o = opts_of(&c, DSK_F32);
    sl_io io = sl_draw(c.D, T);
    dsk_moe m;
    owned own;
    float y[5 * 8], dx[5 * 8];
    DSK_TEST_OK(make_layer(&m, &own, &o));
    DSK_TEST_STATUS(dsk_moe_set_slots(&m, NULL, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_moe_set_slots: layer \"moe\": 0 slots: want 1 to 4096");
    DSK_TEST_STATUS(dsk_moe_set_slots(&m, NULL, DSK_MOE_MAX_SLOTS + 1), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("4097 slots: want 1 to 4096");
    DSK_TEST_STATUS(dsk_moe_use_slot(&m, 1), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_moe_use_slot: layer \"moe\": slot 1 of 1");
    DSK_TEST_OK(dsk_moe_set_slots(&m, NULL, 3));
    DSK_TEST_STATUS(dsk_moe_use_slot(&m, -1), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("slot -1 of 3");
    DSK_TEST_OK(dsk_moe_use_slot(&m, 2));
    DSK_TEST_EXPECT(sl_call(&m, &io, 0, 1, 0, y, dx), "forward in slot 2: %s", dsk_last_error());
    DSK_TEST_OK(dsk_moe_use_slot(&m, 1));
    DSK_TEST_EXPECT(!sl_call(&m, &io, 0, 0, 0, y, dx), "a backward in slot 1, which holds no forward, ran");
    DSK_TEST_ERROR_MENTIONS("no forward to differentiate in slot 1");
    DSK_TEST_STATUS(dsk_moe_set_slots(&m, NULL, 2), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("slot 2 of 3 holds a forward no backward has used");
    DSK_TEST_OK(dsk_moe_use_slot(&m, 2)); /* the refusal kept the slot and its forward */
    DSK_TEST_EXPECT(sl_call(&m, &io, 0, 0, 0, y, dx), "backward in slot 2 after the refused drop: %s",
                    dsk_last_error());
    DSK_TEST_EXPECT(!sl_call(&m, &io, 0, 0, 0, y, dx), "a second backward of slot 2's forward ran");
    DSK_TEST_ERROR_MENTIONS("a backward already used the forward in slot 2");
    DSK_TEST_OK(dsk_moe_set_slots(&m, NULL, 2)); /* slot 2 dropped: the current slot becomes 0 */
    DSK_TEST_EXPECT(!sl_call(&m, &io, 0, 0, 0, y, dx), "a backward in slot 0, which holds no forward, ran");
    DSK_TEST_ERROR_MENTIONS("no forward to differentiate in slot 0");
    drop_layer(&m, &own);
    sl_free(&io);
}

/* A forward or backward split in its begin and end: calls out of order, or on the layer between them, fail
   naming what is pending; an end with a bad output tensor fails and leaves the call pending. */
static void test_split_bad(void) {
    cfg c = base_cfg(6, 8, 4, 2, 6);
    dsk_moe_opts o = opts_of(&c, DSK_F32);
    static const int T[SL_MB] = {6, 6, 6, 6};
    sl_io io = sl_draw(c.D, T);
    dsk_moe m;
    owned own;
    float y[6 * 8], y1[6 * 8], dx[6 * 8];
    int64_t shp[2] = {6, 8}, bad[2] = {5, 8};
    dsk_tensor x, dy, ty, ty1, tdx, tbad;
    dsk_tensor_wrap(&x, io.x[0], DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&dy, io.dy[0], DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&ty, y, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&ty1, y1, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&tdx, dx, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&tbad, y, DSK_F32, dsk_cpu(), 2, bad);
    memset(dx, 0, sizeof dx);
    DSK_TEST_OK(make_layer(&m, &own, &o));
    DSK_TEST_STATUS(dsk_moe_forward_end(&m, NULL, &ty, NULL), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("dsk_moe_forward_end: layer \"moe\": no forward begun");
    DSK_TEST_STATUS(dsk_moe_backward_end(&m, NULL, &tdx), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("dsk_moe_backward_end: layer \"moe\": no backward begun");
    DSK_TEST_OK(dsk_moe_forward_begin(&m, NULL, &x));
    DSK_TEST_STATUS(dsk_moe_forward_begin(&m, NULL, &x), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("a forward was begun and not ended: call dsk_moe_forward_end first");
    DSK_TEST_STATUS(dsk_moe_forward(&m, NULL, &ty, &x, NULL), DSK_ERR_STATE);
    DSK_TEST_STATUS(dsk_moe_backward(&m, NULL, &tdx, &dy, 1.0f), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("dsk_moe_backward: layer \"moe\": a forward was begun and not ended");
    DSK_TEST_STATUS(dsk_moe_backward_end(&m, NULL, &tdx), DSK_ERR_STATE);
    DSK_TEST_STATUS(dsk_moe_use_slot(&m, 0), DSK_ERR_STATE);
    DSK_TEST_STATUS(dsk_moe_set_slots(&m, NULL, 2), DSK_ERR_STATE);
    DSK_TEST_STATUS(dsk_moe_reserve(&m, NULL, 6), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("dsk_moe_reserve: layer \"moe\": a forward was begun and not ended");
    DSK_TEST_STATUS(dsk_moe_forward_end(&m, NULL, &tbad, NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_moe_forward_end: layer \"moe\": y is");
    DSK_TEST_OK(dsk_moe_forward_end(&m, NULL, &ty, NULL)); /* the refused end left the forward pending */
    DSK_TEST_OK(dsk_moe_forward(&m, NULL, &ty1, &x, NULL));
    DSK_TEST_SAME_BYTES(y, y1, sizeof y, "the split forward's y = dsk_moe_forward's");
    DSK_TEST_OK(dsk_moe_backward_begin(&m, NULL, &dy, 1.0f));
    DSK_TEST_STATUS(dsk_moe_forward_begin(&m, NULL, &x), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("a backward was begun and not ended: call dsk_moe_backward_end first");
    dsk_tensor_wrap(&tbad, dx, DSK_F32, dsk_cpu(), 2, bad);
    DSK_TEST_STATUS(dsk_moe_backward_end(&m, NULL, &tbad), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_moe_backward_end: layer \"moe\": dx is");
    DSK_TEST_OK(dsk_moe_backward_end(&m, NULL, &tdx));
    DSK_TEST_STATUS(dsk_moe_backward_begin(&m, NULL, &dy, 1.0f), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("a backward already used the forward in slot 0");
    /* the steps between: none without a call begun, none twice */
    DSK_TEST_STATUS(dsk_moe_experts(&m, NULL), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("dsk_moe_experts: layer \"moe\": no forward or backward begun");
    DSK_TEST_STATUS(dsk_moe_return_begin(&m, NULL), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("dsk_moe_return_begin: layer \"moe\": no forward or backward begun");
    DSK_TEST_STATUS(dsk_moe_wait(&m, NULL), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("dsk_moe_wait: layer \"moe\": no forward or backward begun");
    DSK_TEST_STATUS(dsk_moe_experts(NULL, NULL), DSK_ERR_ARG);
    memset(y, 0xff, sizeof y);
    DSK_TEST_OK(dsk_moe_forward_begin(&m, NULL, &x));
    DSK_TEST_OK(dsk_moe_experts(&m, NULL));
    DSK_TEST_OK(dsk_moe_experts(&m, NULL));                                   /* done: nothing */
    DSK_TEST_STATUS(dsk_moe_forward(&m, NULL, &ty, &x, NULL), DSK_ERR_STATE); /* still a call begun */
    DSK_TEST_ERROR_MENTIONS("a forward was begun and not ended");
    DSK_TEST_OK(dsk_moe_return_begin(&m, NULL));
    DSK_TEST_OK(dsk_moe_return_begin(&m, NULL));
    DSK_TEST_OK(dsk_moe_wait(&m, NULL));
    DSK_TEST_OK(dsk_moe_wait(&m, NULL));
    DSK_TEST_OK(dsk_moe_forward_end(&m, NULL, &ty, NULL));
    DSK_TEST_SAME_BYTES(y, y1, sizeof y, "the forward in steps (each twice): y = dsk_moe_forward's");
    DSK_TEST_STATUS(dsk_moe_wait(&m, NULL), DSK_ERR_STATE); /* ended */
    DSK_TEST_OK(dsk_moe_forward_begin(&m, NULL, &x)); /* freed with a forward pending */
    drop_layer(&m, &own);
    sl_free(&io);
}

/* ---------------------------------------------------------------- routing record and replay */

/* dy from f->R (rounded to f32 and mirrored) and dx zero, for a backward. */
static void grad_io(fixture *f, dsk_tensor *dx, dsk_tensor *dy) {
    int64_t n = (int64_t)f->c.T * f->c.D, shp[2] = {f->c.T, f->c.D};
    dsk_tensor_alloc(NULL, dx, DSK_F32, 2, shp);
    dsk_tensor_alloc(NULL, dy, DSK_F32, 2, shp);
    for (int64_t i = 0; i < n; i++) {
        ((float *)dy->data)[i] = (float)f->R[i];
        f->R[i] = ((float *)dy->data)[i];
        ((float *)dx->data)[i] = 0.0f;
    }
}

/* A recorded routing replayed on the same input and parameters gives the same bits: y, the
   statistics, dx, every gradient and the bias after its update. The record is the reference's
   selection. */
static void check_replay_recorded(const char *what, cfg c, double bias_mag) {
    fixture f;
    dsk_test_begin("replay of a recorded routing: %s T=%d E=%d K=%d", what, c.T, c.E, c.K);
    if (setup(&f, &c, DSK_F32, bias_mag)) {
        int64_t n = (int64_t)c.T * c.D, ng = dsk_tensor_numel(&f.own.grads), rs[2] = {c.T, c.K};
        dsk_tensor rec, dx, dy;
        dsk_moe_stats s1, s2;
        float *y1 = (float *)malloc(sizeof(float) * n), *dx1 = (float *)malloc(sizeof(float) * n);
        float *g1 = (float *)malloc(sizeof(float) * ng), b0[64], b1[64];
        int64_t load1[64];
        int same = 1;
        dsk_tensor_alloc(NULL, &rec, DSK_I32, 2, rs);
        dsk_test_poison_bytes(rec.data, (size_t)c.T * c.K * 4);
        grad_io(&f, &dx, &dy);
        memcpy(b0, f.m.bias->value.data, sizeof(float) * c.E);
        f.m.opts.bias_rate = 0.01f;
        if (run_forward(&f, &s1)) {
            memcpy(y1, f.yf, sizeof(float) * n);
            memcpy(load1, s1.tokens_per_expert, sizeof(int64_t) * c.E);
            DSK_TEST_OK(dsk_moe_routing(&f.m, NULL, &rec));
            for (int i = 0; i < c.T * c.K; i++) same &= ((int32_t *)rec.data)[i] == f.o.sel[i];
            DSK_TEST_EXPECT(same, "the recorded routing is the reference's selection");
            DSK_TEST_OK(dsk_moe_backward(&f.m, NULL, &dx, &dy, 1.0f));
            memcpy(dx1, dx.data, sizeof(float) * n);
            memcpy(g1, f.own.grads.data, sizeof(float) * ng);
            DSK_TEST_OK(dsk_moe_update_bias(&f.m, NULL, NULL));
            memcpy(b1, f.m.bias->value.data, sizeof(float) * c.E);
            /* the same state again, then the replay */
            memcpy(f.m.bias->value.data, b0, sizeof(float) * c.E);
            DSK_TEST_OK(dsk_moe_zero_grad(&f.m, NULL));
            dsk_tensor_fill(NULL, &dx, 0.0);
            if (run_forward_replay(&f, &s2, &rec)) {
                DSK_TEST_SAME_BYTES(f.yf, y1, sizeof(float) * n, "y");
                DSK_TEST_SAME_BYTES(s2.tokens_per_expert, load1, sizeof(int64_t) * c.E, "loads");
                DSK_TEST_EXPECT(s1.loss == s2.loss && s1.dropped == s2.dropped,
                                "loss %.17g vs %.17g, dropped %lld vs %lld", s2.loss, s1.loss, (long long)s2.dropped,
                                (long long)s1.dropped);
                DSK_TEST_OK(dsk_moe_backward(&f.m, NULL, &dx, &dy, 1.0f));
                DSK_TEST_SAME_BYTES(dx.data, dx1, sizeof(float) * n, "dx");
                DSK_TEST_SAME_BYTES(f.own.grads.data, g1, sizeof(float) * ng, "gradients");
                DSK_TEST_OK(dsk_moe_update_bias(&f.m, NULL, NULL));
                DSK_TEST_SAME_BYTES(f.m.bias->value.data, b1, sizeof(float) * c.E, "bias after its update");
            }
        }
        free(y1); free(dx1); free(g1);
        dsk_tensor_free(NULL, &rec); dsk_tensor_free(NULL, &dx); dsk_tensor_free(NULL, &dy);
    }
    free_fixture(&f);
    dsk_test_end();
}

/* K distinct experts per token drawn at random (a random permutation's first K). */
static void draw_assignment(int T, int E, int K, int *out) {
    for (int t = 0; t < T; t++) {
        int perm[512];
        for (int j = 0; j < E; j++) perm[j] = j;
        for (int j = 0; j < K; j++) {
            int r = j + (int)dsk_test_rand_int(E - j), tmp = perm[j];
            perm[j] = perm[r];
            perm[r] = tmp;
            out[t * K + j] = perm[j];
        }
    }
}

/* A fresh random assignment (not the layer's choice) replayed: y, the loads, drops and losses
   against the float64 reference routed the same way; gradients against its central
   differences; the bias update counts the replayed loads; the record returns the assignment. */
static void check_replay_fresh(const char *what, cfg c, double bias_mag) {
    fixture f;
    int *force = (int *)malloc(sizeof(int) * (size_t)c.T * c.K);
    dsk_test_begin("replay of a random assignment: %s T=%d E=%d K=%d", what, c.T, c.E, c.K);
    draw_assignment(c.T, c.E, c.K, force);
    c.force = force;
    if (setup(&f, &c, DSK_F32, bias_mag)) {
        int64_t n = (int64_t)c.T * c.D, rs[2] = {c.T, c.K};
        dsk_tensor rep, own_sel, dx, dy;
        dsk_moe_stats st;
        int differ = 0, same = 1;
        dsk_tensor_alloc(NULL, &rep, DSK_I32, 2, rs);
        dsk_tensor_alloc(NULL, &own_sel, DSK_I32, 2, rs);
        for (int i = 0; i < c.T * c.K; i++) ((int32_t *)rep.data)[i] = force[i];
        grad_io(&f, &dx, &dy);
        f.m.opts.bias_rate = 0.01f;
        /* the layer's own choice (an eval forward: counted nowhere) differs from the assignment */
        f.m.eval = 1;
        DSK_TEST_EXPECT(run_forward(&f, NULL), "selecting forward");
        f.m.eval = 0;
        DSK_TEST_OK(dsk_moe_routing(&f.m, NULL, &own_sel));
        for (int t = 0; t < c.T; t++)
            for (int k = 0; k < c.K; k++) differ += ((int32_t *)own_sel.data)[t * c.K + k] != force[t * c.K + k];
        DSK_TEST_EXPECT(differ > 0, "the random assignment is the layer's own choice: draw again");
        if (run_forward_replay(&f, &st, &rep)) {
            double got[3] = {st.aux_loss, st.seq_aux_loss, st.z_loss}, want[3] = {f.o.aux, f.o.seq_aux, f.o.z};
            double bias_want[64], mean = 0;
            float bias_got[64];
            DSK_TEST_CLOSE(f.yf, f.y, n, 1e-4, 1e-5, "y");
            DSK_TEST_CLOSE64(got, want, 3, 1e-5, 1e-9, "loss terms");
            DSK_TEST_EXPECT(st.dropped == f.o.dropped, "dropped %lld, reference %d", (long long)st.dropped,
                            f.o.dropped);
            for (int e = 0; e < c.E; e++)
                DSK_TEST_EXPECT(st.tokens_per_expert[e] == f.o.load[e], "expert %d load %lld, reference %d", e,
                                (long long)st.tokens_per_expert[e], f.o.load[e]);
            DSK_TEST_OK(dsk_moe_routing(&f.m, NULL, &own_sel));
            for (int i = 0; i < c.T * c.K; i++) same &= ((int32_t *)own_sel.data)[i] == force[i];
            DSK_TEST_EXPECT(same, "the record of a replayed forward is the replayed routing");
            DSK_TEST_OK(dsk_moe_zero_grad(&f.m, NULL));
            DSK_TEST_OK(dsk_moe_backward(&f.m, NULL, &dx, &dy, 1.0f));
            check_grad("dx", (const float *)dx.data, f.x, n, &f);
            check_grad("d router", (const float *)f.m.router->grad.data, f.w.wr, (int64_t)c.E * c.D, &f);
            check_grad("d w1", (const float *)f.m.w1->grad.data, f.w.w1, (int64_t)c.E * c.F * c.D, &f);
            check_grad("d w2", (const float *)f.m.w2->grad.data, f.w.w2, (int64_t)c.E * c.F * c.D, &f);
            if (c.Fs > 0) check_grad("d shared.w1", (const float *)f.m.sw1->grad.data, f.w.s1, (int64_t)c.Fs * c.D, &f);
            DSK_TEST_OK(dsk_moe_update_bias(&f.m, NULL, NULL));
            for (int e = 0; e < c.E; e++) mean += (double)f.o.load[e] / c.E;
            for (int e = 0; e < c.E; e++)
                bias_want[e] = f.w.b[e] + 0.01 * (mean > f.o.load[e] ? 1 : mean < f.o.load[e] ? -1 : 0);
            memcpy(bias_got, f.m.bias->value.data, sizeof(float) * c.E);
            DSK_TEST_CLOSE(bias_got, bias_want, c.E, 1e-6, 1e-7, "bias after an update counting the replayed loads");
        }
        dsk_tensor_free(NULL, &rep); dsk_tensor_free(NULL, &own_sel);
        dsk_tensor_free(NULL, &dx); dsk_tensor_free(NULL, &dy);
    }
    free_fixture(&f);
    free(force);
    dsk_test_end();
}

static void test_replay_variants(void) {
    cfg c = base_cfg(9, 8, 6, 2, 5);
    check_replay_recorded("softmax", c, 0.0);
    check_replay_fresh("softmax", c, 0.0);
    c.sigmoid = 1; c.norm = 1; c.n_group = 3; c.topk_group = 2; c.scale = 2.5; c.seq_aux = 0.05; c.seq_len = 3;
    c.aux = 0.02; c.z = 0.01; c.n_shared = 1; c.Fs = 6; c.count_sel = 1;
    check_replay_recorded("sigmoid+groups+bias+losses counting selections+shared", c, 0.05);
    check_replay_fresh("sigmoid+groups+bias+losses counting selections+shared", c, 0.05);
    c = base_cfg(12, 6, 4, 2, 4);
    c.cf = 0.75; c.aux = 0.02; c.norm = 1;
    check_replay_recorded("capacity by prob", c, 0.0);
    check_replay_fresh("capacity by prob", c, 0.0);
    c = base_cfg(131, 16, 8, 3, 8);
    c.sigmoid = 1; c.norm = 1;
    check_replay_recorded("sigmoid, 131 tokens", c, 0.05);
}

/* Bad replays fail with DSK_ERR_ARG naming the fault and leave the layer as it was: its saved
   forward (backward still runs), its record, its loads and statistics. */
static void test_replay_bad_input(void) {
    cfg c = base_cfg(6, 8, 5, 2, 4);
    fixture f;
    if (setup(&f, &c, DSK_F32, 0.0) && run_forward(&f, NULL)) {
        int64_t rs[2] = {c.T, c.K}, rl[2] = {c.T + 1, c.K}, rw[2] = {c.T, c.K + 1};
        dsk_tensor rec, after, longer, wider, asf, dx, dy;
        dsk_moe_stats st;
        int32_t *r;
        dsk_tensor_alloc(NULL, &rec, DSK_I32, 2, rs);
        dsk_tensor_alloc(NULL, &after, DSK_I32, 2, rs);
        dsk_tensor_alloc(NULL, &longer, DSK_I32, 2, rl);
        dsk_tensor_alloc(NULL, &wider, DSK_I32, 2, rw);
        dsk_tensor_alloc(NULL, &asf, DSK_F32, 2, rs);
        dsk_tensor_fill(NULL, &longer, 0.0);
        dsk_tensor_fill(NULL, &wider, 0.0);
        grad_io(&f, &dx, &dy);
        DSK_TEST_OK(dsk_moe_routing(&f.m, NULL, &rec));
        r = (int32_t *)rec.data;
        r[2 * c.K + 1] = c.E; /* out of range */
        DSK_TEST_STATUS(dsk_moe_forward_replay(&f.m, NULL, &f.ty, &f.tx, &rec, NULL), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_moe_forward_replay: layer \"moe\": experts[2][1] = 5 outside [0, 5)");
        r[2 * c.K + 1] = -1;
        DSK_TEST_STATUS(dsk_moe_forward_replay(&f.m, NULL, &f.ty, &f.tx, &rec, NULL), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("experts[2][1] = -1 outside [0, 5)");
        r[2 * c.K + 1] = r[2 * c.K]; /* the same expert twice */
        DSK_TEST_STATUS(dsk_moe_forward_replay(&f.m, NULL, &f.ty, &f.tx, &rec, NULL), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("token 2 takes expert");
        DSK_TEST_ERROR_MENTIONS("twice (slots 0 and 1)");
        DSK_TEST_STATUS(dsk_moe_forward_replay(&f.m, NULL, &f.ty, &f.tx, &longer, NULL), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("experts is [7,2] i32, want [6,2] i32");
        DSK_TEST_STATUS(dsk_moe_forward_replay(&f.m, NULL, &f.ty, &f.tx, &wider, NULL), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("experts is [6,3] i32, want [6,2] i32");
        DSK_TEST_STATUS(dsk_moe_forward_replay(&f.m, NULL, &f.ty, &f.tx, &asf, NULL), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("experts is [6,2] f32, want [6,2] i32");
        DSK_TEST_STATUS(dsk_moe_forward_replay(&f.m, NULL, &f.ty, &f.tx, NULL, NULL), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("experts is NULL");
        DSK_TEST_STATUS(dsk_moe_routing(&f.m, NULL, &wider), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_moe_routing: layer \"moe\": experts is [6,3] i32, want [6,2] i32");
        /* unchanged: the record, the saved forward, the loads and statistics of one forward */
        DSK_TEST_OK(dsk_moe_routing(&f.m, NULL, &after));
        for (int i = 0; i < c.T * c.K; i++)
            DSK_TEST_EXPECT(((int32_t *)after.data)[i] == f.o.sel[i], "record slot %d: %d, selection %d", i,
                            ((int32_t *)after.data)[i], f.o.sel[i]);
        DSK_TEST_OK(dsk_moe_backward(&f.m, NULL, &dx, &dy, 1.0f));
        check_grad("d w1 after the refused replays", (const float *)f.m.w1->grad.data, f.w.w1,
                   (int64_t)c.E * c.F * c.D, &f);
        DSK_TEST_OK(dsk_moe_stats_request(&f.m, NULL));
        DSK_TEST_OK(dsk_moe_stats_collect(&f.m, NULL, &st));
        DSK_TEST_EXPECT(st.calls == 1 && st.tokens == c.T, "calls %lld tokens %lld after the refused replays",
                        (long long)st.calls, (long long)st.tokens);
        dsk_tensor *ts[] = {&rec, &after, &longer, &wider, &asf, &dx, &dy};
        for (int i = 0; i < 7; i++) dsk_tensor_free(NULL, ts[i]);
    }
    free_fixture(&f);
}

/* Before any forward there is no routing to record. */
static void test_routing_before_forward(void) {
    dsk_moe m;
    owned own;
    dsk_moe_opts o;
    dsk_tensor rec;
    int64_t rs[2] = {3, 2};
    memset(&o, 0, sizeof o);
    o.d_model = 8; o.n_routed = 4; o.top_k = 2; o.d_expert = 4;
    DSK_TEST_OK(make_layer(&m, &own, &o));
    dsk_tensor_alloc(NULL, &rec, DSK_I32, 2, rs);
    DSK_TEST_STATUS(dsk_moe_routing(&m, NULL, &rec), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("dsk_moe_routing: layer \"moe\": no forward has routed tokens");
    dsk_tensor_free(NULL, &rec);
    drop_layer(&m, &own);
}

/* A NULL layer is a bad argument for every entry point (DSK_ERR_ARG naming the function); a
   zeroed or freed one is a bad state. */
static void test_null_layer(void) {
    dsk_tensor t;
    dsk_moe_stats st;
    dsk_moe z;
    int64_t vb = 1, gd = 1, gs = 1, shp[2] = {1, 1};
    float v = 0;
    int32_t flag = 0;
    dsk_tensor_wrap(&t, &v, DSK_F32, dsk_cpu(), 2, shp);
#define NULL_ARG(call, name)                                                                                          \
    do {                                                                                                              \
        DSK_TEST_STATUS(call, DSK_ERR_ARG);                                                                           \
        DSK_TEST_ERROR_MENTIONS(name ": layer is NULL");                                                             \
    } while (0)
    NULL_ARG(dsk_moe_forward(NULL, NULL, &t, &t, &st), "dsk_moe_forward");
    NULL_ARG(dsk_moe_forward_replay(NULL, NULL, &t, &t, &t, &st), "dsk_moe_forward_replay");
    NULL_ARG(dsk_moe_forward_replay(NULL, NULL, &t, &t, NULL, &st), "dsk_moe_forward_replay");
    NULL_ARG(dsk_moe_routing(NULL, NULL, &t), "dsk_moe_routing");
    NULL_ARG(dsk_moe_backward(NULL, NULL, &t, &t, 1.0f), "dsk_moe_backward");
    NULL_ARG(dsk_moe_bind(NULL, NULL, 0, &t, &t), "dsk_moe_bind");
    NULL_ARG(dsk_moe_bind_slabs(NULL, NULL, &t, &t), "dsk_moe_bind_slabs");
    NULL_ARG(dsk_moe_init_param(NULL, NULL, 0, &t), "dsk_moe_init_param");
    NULL_ARG(dsk_moe_init_params(NULL, NULL), "dsk_moe_init_params");
    NULL_ARG(dsk_moe_reserve(NULL, NULL, 4), "dsk_moe_reserve");
    NULL_ARG(dsk_moe_zero_grad(NULL, NULL), "dsk_moe_zero_grad");
    NULL_ARG(dsk_moe_update_bias(NULL, NULL, NULL), "dsk_moe_update_bias");
    dsk_tensor_wrap(&t, &flag, DSK_I32, dsk_cpu(), 0, NULL);
    NULL_ARG(dsk_moe_update_bias_unless(NULL, NULL, &t), "dsk_moe_update_bias_unless");
    NULL_ARG(dsk_moe_stats_request(NULL, NULL), "dsk_moe_stats_request");
    NULL_ARG(dsk_moe_stats_collect(NULL, NULL, &st), "dsk_moe_stats_collect");
#undef NULL_ARG
    DSK_TEST_STATUS(dsk_moe_init(NULL, NULL, NULL), DSK_ERR_ARG);
    DSK_TEST_EXPECT(dsk_moe_find_param(NULL, "moe.w1") == NULL, "find_param of a NULL layer");
    dsk_moe_slab_sizes(NULL, &vb, &gd, &gs);
    DSK_TEST_EXPECT(vb == 0 && gd == 0 && gs == 0, "slab sizes of a NULL layer %lld %lld %lld", (long long)vb,
                    (long long)gd, (long long)gs);
    dsk_moe_free(NULL, NULL);
    memset(&z, 0, sizeof z);
    DSK_TEST_STATUS(dsk_moe_forward(&z, NULL, &t, &t, NULL), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("dsk_moe_forward: layer not initialised");
}

/* The other pointer arguments: NULL is DSK_ERR_ARG naming the argument. */
static void test_null_args(void) {
    dsk_moe m;
    owned own;
    dsk_moe_opts o;
    dsk_tensor x, y;
    int64_t shp[2] = {4, 8};
    memset(&o, 0, sizeof o);
    o.d_model = 8; o.n_routed = 4; o.top_k = 2; o.d_expert = 4;
    DSK_TEST_OK(make_layer(&m, &own, &o));
    dsk_tensor_alloc(NULL, &x, DSK_F32, 2, shp);
    dsk_tensor_alloc(NULL, &y, DSK_F32, 2, shp);
    dsk_tensor_fill(NULL, &x, 0.5);
    DSK_TEST_STATUS(dsk_moe_forward(&m, NULL, NULL, &x, NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("y is NULL");
    DSK_TEST_OK(dsk_moe_forward(&m, NULL, &y, &x, NULL));
    DSK_TEST_STATUS(dsk_moe_backward(&m, NULL, NULL, &y, 1.0f), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dx is NULL");
    DSK_TEST_STATUS(dsk_moe_backward(&m, NULL, &x, NULL, 1.0f), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dy is NULL");
    DSK_TEST_STATUS(dsk_moe_routing(&m, NULL, NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_moe_routing: layer \"moe\": experts is NULL");
    DSK_TEST_STATUS(dsk_moe_bind(&m, NULL, DSK_MOE_P_W1, NULL, NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("parameter \"moe.w1\": value is NULL");
    DSK_TEST_STATUS(dsk_moe_bind_slabs(&m, NULL, NULL, &own.grads), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("a slab is NULL");
    DSK_TEST_STATUS(dsk_moe_init_param(&m, NULL, DSK_MOE_P_W1, NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dst must be a float tensor");
    DSK_TEST_STATUS(dsk_moe_stats_collect(&m, NULL, NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("out is NULL");
    DSK_TEST_EXPECT(dsk_moe_find_param(&m, NULL) == NULL, "find_param of a NULL name");
    dsk_tensor_free(NULL, &x);
    dsk_tensor_free(NULL, &y);
    drop_layer(&m, &own);
}

/* Statistics come back by request: the sums over the training forwards since the previous
   request (eval forwards left out), then zero until the next forwards. */
static void test_stats_request(void) {
    cfg c = base_cfg(12, 8, 6, 2, 5);
    fixture f;
    c.aux = 0.01; c.seq_aux = 0.02; c.seq_len = 4; c.z = 0.01; c.cf = 0.75;
    if (setup(&f, &c, DSK_F32, 0.05)) {
        dsk_moe_stats a, b, sum, none;
        int64_t a_loads[6];
        int bad = 0;
        DSK_TEST_OK(dsk_moe_stats_request(&f.m, NULL)); /* what setup's forwards left */
        DSK_TEST_OK(dsk_moe_forward(&f.m, NULL, &f.ty, &f.tx, &a));
        memcpy(a_loads, a.tokens_per_expert, sizeof a_loads); /* the layer's array: the next forward's */
        draw_x(&f);
        f.m.eval = 1;
        DSK_TEST_OK(dsk_moe_forward(&f.m, NULL, &f.ty, &f.tx, NULL)); /* not counted */
        f.m.eval = 0;
        DSK_TEST_OK(dsk_moe_forward(&f.m, NULL, &f.ty, &f.tx, &b));
        DSK_TEST_OK(dsk_moe_stats_request(&f.m, NULL));
        DSK_TEST_OK(dsk_moe_stats_collect(&f.m, NULL, &sum));
        DSK_TEST_EXPECT(sum.calls == 2 && sum.tokens == a.tokens + b.tokens && sum.slots == a.slots + b.slots &&
                        sum.dropped == a.dropped + b.dropped && a.dropped > 0 && sum.nonfinite == 0,
                        "calls %lld tokens %lld slots %lld dropped %lld (per call %lld, %lld)", (long long)sum.calls,
                        (long long)sum.tokens, (long long)sum.slots, (long long)sum.dropped, (long long)a.dropped,
                        (long long)b.dropped);
        for (int e = 0; e < c.E; e++) bad += sum.tokens_per_expert[e] != a_loads[e] + b.tokens_per_expert[e];
        DSK_TEST_EXPECT(bad == 0, "%d experts' loads are not the sums of the two forwards'", bad);
        DSK_TEST_EXPECT(sum.aux_loss == a.aux_loss + b.aux_loss && sum.seq_aux_loss == a.seq_aux_loss + b.seq_aux_loss &&
                        sum.z_loss == a.z_loss + b.z_loss && a.aux_loss > 0 && a.seq_aux_loss > 0 && a.z_loss > 0,
                        "loss sums %g %g %g", sum.aux_loss, sum.seq_aux_loss, sum.z_loss);
        DSK_TEST_OK(dsk_moe_stats_request(&f.m, NULL));
        DSK_TEST_OK(dsk_moe_stats_collect(&f.m, NULL, &none));
        DSK_TEST_EXPECT(none.calls == 0 && none.tokens == 0 && none.loss == 0, "a request after none: %lld calls",
                        (long long)none.calls);
        DSK_TEST_STATUS(dsk_moe_stats_collect(&f.m, NULL, NULL), DSK_ERR_ARG);
    }
    free_fixture(&f);
}

/* ---------------------------------------------------------------- bf16 */

static void test_bf16_forward_backward(void) {
    int Ts[2] = {7, 64};
    for (int i = 0; i < 2; i++) {
        cfg c = base_cfg(Ts[i], 32, 6, 2, 16);
        fixture f;
        dsk_test_begin("bf16 forward+backward T=%d", c.T);
        c.sigmoid = 1; c.norm = 1; c.n_shared = 1; c.Fs = 16; c.scale = 1.5;
        if (setup(&f, &c, DSK_BF16, 0.02) && run_forward(&f, NULL)) {
            int64_t n = (int64_t)c.T * c.D;
            dsk_tensor dx, dy;
            int64_t shp[2] = {c.T, c.D};
            double *want = (double *)malloc(sizeof(double) * (size_t)c.E * c.F * c.D);
            DSK_TEST_CLOSE(f.yf, f.y, n, 2e-2, 2e-2, "y bf16");
            dsk_tensor_alloc(NULL, &dx, DSK_BF16, 2, shp);
            dsk_tensor_alloc(NULL, &dy, DSK_BF16, 2, shp);
            for (int64_t j = 0; j < n; j++) {
                ((uint16_t *)dy.data)[j] = dsk_f32_to_bf16((float)f.R[j]);
                f.R[j] = dsk_bf16_to_f32(((uint16_t *)dy.data)[j]);
                ((uint16_t *)dx.data)[j] = 0;
            }
            DSK_TEST_OK(dsk_moe_backward(&f.m, NULL, &dx, &dy, 1.0f));
            fd_grad(&f, f.w.w2, (int64_t)c.E * c.F * c.D, want);
            DSK_TEST_CLOSE((const float *)f.m.w2->grad.data, want, (int64_t)c.E * c.F * c.D, 2e-2, 2e-3, "d w2 (bf16 layer)");
            fd_grad(&f, f.w.wr, (int64_t)c.E * c.D, want);
            DSK_TEST_CLOSE((const float *)f.m.router->grad.data, want, (int64_t)c.E * c.D, 2e-2, 2e-3, "d router (bf16 layer)");
            free(want);
            dsk_tensor_free(NULL, &dx); dsk_tensor_free(NULL, &dy);
        }
        free_fixture(&f);
        dsk_test_end();
    }
}

/* ---------------------------------------------------------------- API and errors */

/* Sizes, then bind: the parameters are reported (names, shapes, dtypes, flags) with no memory;
   the layer refuses to run until every one is bound; binding checks shapes, dtypes, devices and
   gradients; fresh values come from dsk_moe_init_param into any caller tensor. */
static void test_params_by_name(void) {
    dsk_moe m;
    dsk_moe_opts o;
    owned own;
    dsk_tensor x, y, v, g, gb;
    int64_t sx[2] = {4, 24}, s2[2] = {10, 24}, s1 = 10;
    const char *names[8] = {"blk3.moe.router", "blk3.moe.bias", "blk3.moe.w1", "blk3.moe.w2", "blk3.moe.w3",
                            "blk3.moe.shared.w1", "blk3.moe.shared.w2", "blk3.moe.shared.w3"};
    int64_t want[8][3] = {{10, 24, 0}, {10, 0, 0}, {10, 16, 24}, {10, 24, 16}, {10, 16, 24}, {40, 24, 0}, {24, 40, 0}, {40, 24, 0}};
    memset(&o, 0, sizeof o);
    o.name = "blk3.moe"; o.d_model = 24; o.n_routed = 10; o.top_k = 3; o.d_expert = 16; o.n_shared = 2; o.d_shared = 20;
    o.dtype = DSK_BF16;
    DSK_TEST_OK(dsk_moe_init(&m, NULL, &o));
    DSK_TEST_EXPECT(m.n_params == 8, "%d parameters", m.n_params);
    for (int i = 0; i < 8; i++) {
        dsk_moe_param *p = dsk_moe_find_param(&m, names[i]);
        DSK_TEST_EXPECT(p == &m.params[i], "parameter %s not at index %d", names[i], i);
        if (!p) continue;
        DSK_TEST_EXPECT(p->ndim == (i == 1 ? 1 : i >= 2 && i <= 4 ? 3 : 2), "%s has %d dims", names[i], p->ndim);
        for (int d = 0; d < p->ndim; d++) DSK_TEST_EXPECT(p->shape[d] == want[i][d], "%s dim %d = %lld", names[i], d, (long long)p->shape[d]);
        DSK_TEST_EXPECT(p->dtype == (i < 2 ? DSK_F32 : DSK_BF16), "%s dtype %s", names[i], dsk_dtype_name(p->dtype));
        DSK_TEST_EXPECT(p->expert_sharded == (i >= 2 && i <= 4) && p->trainable == (i != 1) && p->weight_decay == (i != 1),
                        "%s flags sharded %d trainable %d decay %d", names[i], p->expert_sharded, p->trainable, p->weight_decay);
        DSK_TEST_EXPECT(p->value.data == NULL && p->grad.data == NULL, "%s has memory before any bind", names[i]);
    }
    DSK_TEST_EXPECT(dsk_moe_find_param(&m, "blk3.moe.w4") == NULL, "found a parameter that does not exist");
    dsk_tensor_alloc(NULL, &x, DSK_BF16, 2, sx);
    dsk_tensor_alloc(NULL, &y, DSK_BF16, 2, sx);
    dsk_tensor_fill(NULL, &x, 0.25);
    DSK_TEST_STATUS(dsk_moe_forward(&m, NULL, &y, &x, NULL), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("parameter \"blk3.moe.router\" is not bound");
    /* bind errors */
    dsk_tensor_alloc(NULL, &v, DSK_F32, 2, s2);
    dsk_tensor_alloc(NULL, &g, DSK_F32, 2, s2);
    dsk_tensor_alloc(NULL, &gb, DSK_BF16, 2, s2);
    DSK_TEST_STATUS(dsk_moe_bind(&m, NULL, 8, &v, &g), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("parameter index 8 outside [0, 8)");
    DSK_TEST_STATUS(dsk_moe_bind(&m, NULL, DSK_MOE_P_ROUTER, &v, NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("is trainable: its f32 gradient is required");
    DSK_TEST_STATUS(dsk_moe_bind(&m, NULL, DSK_MOE_P_ROUTER, &v, &gb), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("grad is [10,24] bf16 on the CPU, want [10,24] f32");
    DSK_TEST_STATUS(dsk_moe_bind(&m, NULL, DSK_MOE_P_W1, &v, &g), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("parameter \"blk3.moe.w1\": value is [10,24] f32 on the CPU, want [10,16,24] bf16");
    DSK_TEST_STATUS(dsk_moe_bind(&m, NULL, DSK_MOE_P_BIAS, &v, NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("want [10] f32");
    dsk_tensor_free(NULL, &v);
    dsk_tensor_alloc(NULL, &v, DSK_F32, 1, &s1);
    DSK_TEST_STATUS(dsk_moe_bind(&m, NULL, DSK_MOE_P_BIAS, &v, &g), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("has no gradient: pass NULL");
    DSK_TEST_OK(dsk_moe_bind(&m, NULL, DSK_MOE_P_BIAS, &v, NULL));
    dsk_moe_free(&m, NULL);
    dsk_moe_free(&m, NULL); /* freed twice is fine */
    /* the slabs: values where the layer says, weights N(0, 0.02) from init_param, bias zero */
    DSK_TEST_OK(make_layer(&m, &own, &o));
    {
        double ss = 0;
        int64_t n = dsk_tensor_numel(&m.w1->value), vb, gd, gs;
        dsk_moe_slab_sizes(&m, &vb, &gd, &gs);
        for (int64_t i = 0; i < n; i++) { double d = dsk_bf16_to_f32(((uint16_t *)m.w1->value.data)[i]); ss += d * d; }
        DSK_TEST_EXPECT(fabs(sqrt(ss / n) - 0.02) < 0.002, "w1 std %g", sqrt(ss / n));
        DSK_TEST_EXPECT(((float *)m.bias->value.data)[3] == 0.0f, "bias not zero");
        DSK_TEST_EXPECT(gd == (10 + 3 * 40) * 24 && gs == 3 * 10 * 16 * 24, "gradient slab parts %lld + %lld",
                        (long long)gd, (long long)gs);
        DSK_TEST_EXPECT((char *)m.router->value.data == (char *)own.values.data &&
                        (float *)m.router->grad.data == (float *)own.grads.data &&
                        (float *)m.w1->grad.data == (float *)own.grads.data + gd, "views not where the layout says");
        DSK_TEST_OK(dsk_moe_forward(&m, NULL, &y, &x, NULL));
    }
    {   /* the documented streams: w3 at 3 * 2^40, shared.w2 at 6 * 2^40 ... router at 0 */
        static const int idx[3] = {DSK_MOE_P_ROUTER, DSK_MOE_P_W3, DSK_MOE_P_SW2};
        static const uint64_t stream[3] = {0, 3, 5};
        for (int k = 0; k < 3; k++) {
            dsk_moe_param *p = &m.params[idx[k]];
            dsk_tensor got, want;
            dsk_tensor_alloc(NULL, &got, DSK_F32, p->ndim, p->shape);
            dsk_tensor_alloc(NULL, &want, DSK_F32, p->ndim, p->shape);
            DSK_TEST_OK(dsk_moe_init_param(&m, NULL, idx[k], &got));
            dsk_tensor_normal(NULL, &want, o.seed, stream[k] << 40, 0.0f, 0.02f);
            DSK_TEST_SAME_BYTES(got.data, want.data, dsk_tensor_nbytes(&got), p->name);
            dsk_tensor_free(NULL, &got); dsk_tensor_free(NULL, &want);
        }
    }
    drop_layer(&m, &own);
    dsk_tensor_free(NULL, &v); dsk_tensor_free(NULL, &g); dsk_tensor_free(NULL, &gb);
    dsk_tensor_free(NULL, &x); dsk_tensor_free(NULL, &y);
}

static void expect_init_error(dsk_moe_opts o, const char *needle) {
    dsk_moe m;
    DSK_TEST_STATUS(dsk_moe_init(&m, NULL, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_moe_init");
    DSK_TEST_ERROR_MENTIONS(needle);
}

static void test_bad_config(void) {
    dsk_moe_opts o, b;
    memset(&o, 0, sizeof o);
    o.d_model = 16; o.n_routed = 8; o.top_k = 2; o.d_expert = 8;
    b = o; b.top_k = 9; expect_init_error(b, "top_k 9 outside [1, n_routed 8]");
    b = o; b.top_k = 0; expect_init_error(b, "top_k 0");
    b = o; b.n_group = 4; b.topk_group = 5; expect_init_error(b, "topk_group 5 > n_group 4");
    b = o; b.n_group = 3; expect_init_error(b, "n_routed 8 not divisible by n_group 3");
    b = o; b.n_group = 4; b.topk_group = 1; b.top_k = 3; expect_init_error(b, "top_k 3 > the 2 experts");
    b = o; b.d_model = 0; expect_init_error(b, "d_model 0");
    b = o; b.d_expert = -4; expect_init_error(b, "d_expert -4");
    b = o; b.dtype = DSK_F16; expect_init_error(b, "dtype f16 not supported");
    b = o; b.capacity_factor = -1; expect_init_error(b, "capacity_factor -1");
    b = o; b.score = (dsk_moe_score)7; expect_init_error(b, "unknown score function 7");
    b = o; b.group_rule = (dsk_moe_group_rule)3; expect_init_error(b, "unknown group rule 3");
    b = o;
    b.ep_dispatch = (dsk_moe_dispatch)2;
    expect_init_error(b, "unknown ep_dispatch 2");
    b = o;
    b.ep_exchange = (dsk_moe_ep_exchange)2;
    expect_init_error(b, "unknown ep_exchange 2");
    b = o;
    b.ep_chunk = (dsk_moe_ep_chunk)3;
    expect_init_error(b, "unknown ep_chunk 3 (auto 0, off 1, on 2)");
    b = o;
    b.ep_chunk = (dsk_moe_ep_chunk)-1;
    expect_init_error(b, "unknown ep_chunk -1");
    b = o;
    b.node_limit = 1;
    expect_init_error(b, "node_limit 1 needs an expert-parallel group");
    b = o;
    b.node_limit = -1;
    expect_init_error(b, "node_limit -1 needs an expert-parallel group and M > 0");
    b = o; b.n_group = 4; b.topk_group = 3; b.group_rule = DSK_MOE_GROUP_MEGATRON;
    expect_init_error(b, "top_k 2 < topk_group 3 sums none");
    b = o; b.name = "x"; b.n_routed = 0; expect_init_error(b, "layer \"x\": n_routed 0");
    {
        dsk_moe m;
        DSK_TEST_STATUS(dsk_moe_init(&m, NULL, NULL), DSK_ERR_ARG);
    }
}

static void test_bad_calls(void) {
    dsk_moe m;
    owned own;
    dsk_moe_opts o;
    dsk_tensor x, y, yb, x3;
    int64_t s2[2] = {5, 16}, s2b[2] = {4, 16}, s3[2] = {5, 12};
    memset(&o, 0, sizeof o);
    o.d_model = 16; o.n_routed = 4; o.top_k = 2; o.d_expert = 8; o.seq_aux_alpha = 0.1f; o.seq_len = 2;
    DSK_TEST_OK(make_layer(&m, &own, &o));
    dsk_tensor_alloc(NULL, &x, DSK_F32, 2, s2); dsk_tensor_alloc(NULL, &y, DSK_F32, 2, s2);
    dsk_tensor_alloc(NULL, &yb, DSK_BF16, 2, s2); dsk_tensor_alloc(NULL, &x3, DSK_F32, 2, s3);
    dsk_tensor_fill(NULL, &x, 0.5);
    DSK_TEST_STATUS(dsk_moe_backward(&m, NULL, &x, &y, 1.0f), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("no forward to differentiate in slot 0");
    DSK_TEST_STATUS(dsk_moe_forward(&m, NULL, &y, &x3, NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("x is [5,12] f32, want [5,16] f32");
    DSK_TEST_STATUS(dsk_moe_forward(&m, NULL, &yb, &x, NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("y is [5,16] bf16, want [5,16] f32");
    DSK_TEST_STATUS(dsk_moe_forward(&m, NULL, &y, &x, NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("5 tokens are not whole sequences of seq_len 2");
    DSK_TEST_STATUS(dsk_moe_forward(&m, NULL, &y, NULL, NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("x is NULL");
    dsk_tensor_free(NULL, &x); dsk_tensor_free(NULL, &y);
    s2[0] = 4;
    dsk_tensor_alloc(NULL, &x, DSK_F32, 2, s2); dsk_tensor_alloc(NULL, &y, DSK_F32, 2, s2b);
    dsk_tensor_fill(NULL, &x, 0.25);
    DSK_TEST_OK(dsk_moe_forward(&m, NULL, &y, &x, NULL));
    DSK_TEST_STATUS(dsk_moe_backward(&m, NULL, &x, &yb, 1.0f), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dy is [5,16] bf16, want [4,16] f32");
    DSK_TEST_STATUS(dsk_moe_backward(&m, NULL, &x, &y, NAN), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("aux_scale nan is not finite");
    dsk_tensor_free(NULL, &x); dsk_tensor_free(NULL, &y); dsk_tensor_free(NULL, &yb); dsk_tensor_free(NULL, &x3);
    drop_layer(&m, &own);
    DSK_TEST_STATUS(dsk_moe_forward(&m, NULL, &y, &x, NULL), DSK_ERR_STATE);
}

/* ---------------------------------------------------------------- expert parallelism */

enum { EP_T = 13, EP_D = 16, EP_E = 8, EP_K = 3, EP_F = 12, EP_FS = 10 };

static dsk_moe_opts ep_opts(int sigmoid) {
    dsk_moe_opts o;
    memset(&o, 0, sizeof o);
    o.d_model = EP_D; o.n_routed = EP_E; o.top_k = EP_K; o.d_expert = EP_F; o.n_shared = 1; o.d_shared = EP_FS;
    o.init_std = 0.5f; o.seed = 77;
    if (sigmoid) { o.score = DSK_MOE_SIGMOID; o.n_group = 4; o.topk_group = 2; o.routed_scale = 2.5f; }
    return o;
}

/* Shared-memory layout of one rank's results: y, dx (T,D), then the gradient slab. */

static void ep_inputs(float *x, float *dy, int n_tok) {
    for (int i = 0; i < n_tok * EP_D; i++) {
        x[i] = (float)dsk_test_rand(-1, 1);
        dy[i] = (float)dsk_test_rand(-1, 1);
    }
}

/* Floats of one rank's results: y, dx (T,D), the gradient slab (at most the dense part and
   every expert), and at the end the EP-group loads (E) and the updated bias (E). */
static size_t ep_per_rank(int n) {
    (void)n;
    return (size_t)(2 * EP_T * EP_D) + (size_t)(EP_E * EP_D + 3 * EP_FS * EP_D + 3 * EP_E * EP_F * EP_D) + 2 * EP_E;
}

/* One layer step on rows [r*EP_T, (r+1)*EP_T) of the global batch; results into out. */
/* A NaN in token 3 of rank 0's rows only: every rank fails with DSK_ERR_NONFINITE (rank 0
   naming the token, the others the group), none hangs, and the next forward runs. */
static int ep_nonfinite(dsk_moe *m, int rank, const float *x_rows) {
    float *xb = (float *)malloc(sizeof(float) * EP_T * EP_D), *yb = (float *)malloc(sizeof(float) * EP_T * EP_D);
    int64_t shp[2] = {EP_T, EP_D};
    dsk_tensor x, y;
    int ok;
    memcpy(xb, x_rows, sizeof(float) * EP_T * EP_D);
    if (rank == 0) xb[3 * EP_D + 1] = NAN;
    dsk_tensor_wrap(&x, xb, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&y, yb, DSK_F32, dsk_cpu(), 2, shp);
    ok = dsk_moe_forward(m, NULL, &y, &x, NULL) == DSK_ERR_NONFINITE &&
         strstr(dsk_last_error(), rank == 0 ? "token 3 of 13" : "1 tokens on other ranks") != NULL;
    memcpy(xb, x_rows, sizeof(float) * EP_T * EP_D);
    ok = ok && dsk_moe_forward(m, NULL, &y, &x, NULL) == DSK_OK;
    free(xb); free(yb);
    return ok;
}

/* One step (forward, backward, bias update over c) of a fresh layer of options o on this rank's first T rows:
   y, dx, the gradient slab, the loads and the dropped count, then the updated bias, appended to buf
   (malloc'd, *len floats); *chunks (may be NULL) the forward's stats.ep_chunks. */
static int ep_step_record_t(dsk_comm *c, dsk_moe_opts o, int64_t T, const float *x_rows, const float *dy_rows,
                            float **buf, size_t *len, int64_t *chunks) {
    dsk_moe m;
    owned own;
    dsk_tensor x, y, dx, dy;
    int64_t shp[2] = {T, EP_D}, ng;
    dsk_moe_stats st;
    size_t at;
    int rc = 0;
    if (make_layer(&m, &own, &o) != DSK_OK) return 1;
    ng = dsk_tensor_numel(&own.grads);
    *len = (size_t)(2 * T * EP_D + ng + EP_E + 1 + EP_E);
    *buf = (float *)malloc(sizeof(float) * *len);
    for (size_t i = 0; i < *len; i++) (*buf)[i] = NAN; /* poisoned */
    dsk_tensor_wrap(&x, (void *)x_rows, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&dy, (void *)dy_rows, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&y, *buf, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&dx, *buf + T * EP_D, DSK_F32, dsk_cpu(), 2, shp);
    memset(dx.data, 0, sizeof(float) * T * EP_D);
    if (dsk_moe_forward(&m, NULL, &y, &x, &st) != DSK_OK || dsk_moe_backward(&m, NULL, &dx, &dy, 1.0f) != DSK_OK ||
        dsk_moe_update_bias(&m, NULL, c) != DSK_OK) {
        rc = 2;
        goto done;
    }
    if (chunks) *chunks = st.ep_chunks;
    at = 2 * T * EP_D;
    memcpy(*buf + at, own.grads.data, sizeof(float) * (size_t)ng);
    at += (size_t)ng;
    for (int e = 0; e < EP_E; e++) (*buf)[at++] = (float)st.tokens_per_expert[e];
    (*buf)[at++] = (float)st.dropped;
    memcpy(*buf + at, m.bias->value.data, sizeof(float) * EP_E);
done:
    drop_layer(&m, &own);
    return rc;
}

static int ep_step_record(dsk_comm *c, dsk_moe_opts o, const float *x_rows, const float *dy_rows, float **buf,
                          size_t *len, int64_t *chunks) {
    return ep_step_record_t(c, o, EP_T, x_rows, dy_rows, buf, len, chunks);
}

/* A batch of no tokens under expert parallelism (a rank's share of an uneven split): rank 0's empty, the exact
   exchange overlapped and chunked, and across emulated nodes two hops overlapped and chunked, give the serial
   one's bits on every rank; every rank's empty (the bounded exchange needs one T), the bounded one serial,
   overlapped and chunked give the exact one's. 1 if all hold. */
static int ep_empty_batch(dsk_comm *c, dsk_moe_opts o, int rank, const float *x_rows, const float *dy_rows) {
    static const char *names[] = {
        "exact serial",       "exact overlapped",           "exact overlapped chunked",   "bounded serial",
        "bounded overlapped", "bounded overlapped chunked", "two hops overlapped chunked"};
    float *ref[2] = {NULL, NULL};
    size_t nref[2] = {0, 0};
    int ok = 1;
    dsk_moe_ep_route route = o.ep_route;
    for (int all = 0; all < 2; all++) {
        o.ep_exchange = DSK_MOE_EP_EXACT;
        o.ep_overlap = 0;
        o.ep_chunk = DSK_MOE_CHUNK_OFF;
        if (ep_step_record_t(c, o, all || rank == 0 ? 0 : EP_T, x_rows, dy_rows, &ref[all], &nref[all], NULL)) {
            fprintf(stderr, "rank %d: %s with %s empty: %s\n", rank, names[0], all ? "every batch" : "rank 0's",
                    dsk_last_error());
            ok = 0;
        }
    }
    for (int v = 1; v < 7; v++) {
        float *d = NULL;
        size_t nd = 0;
        int all = v >= 3 && v < 6;
        if (v == 6 && c->n_nodes < 2) break; /* two hops: across emulated nodes */
        o.ep_exchange = all ? DSK_MOE_EP_BOUNDED : DSK_MOE_EP_EXACT;
        o.ep_overlap = v % 3 > 0 || v == 6;
        o.ep_chunk = v % 3 == 2 || v == 6 ? DSK_MOE_CHUNK_ON : DSK_MOE_CHUNK_OFF;
        o.ep_route = v == 6 ? DSK_MOE_ROUTE_TWO_HOP : route;
        if (ep_step_record_t(c, o, all || rank == 0 ? 0 : EP_T, x_rows, dy_rows, &d, &nd, NULL)) {
            fprintf(stderr, "rank %d: %s with %s empty: %s\n", rank, names[v], all ? "every batch" : "rank 0's",
                    dsk_last_error());
            ok = 0;
        } else if (ref[all] && (nd != nref[all] || memcmp(d, ref[all], sizeof(float) * nd) != 0)) {
            fprintf(stderr, "rank %d: %s with %s empty differs from the serial exact\n", rank, names[v],
                    all ? "every batch" : "rank 0's");
            ok = 0;
        }
        free(d);
    }
    free(ref[0]);
    free(ref[1]);
    return ok;
}

/* The exchange variants give the serial exact exchange's results bit for bit: the exact one overlapped with
   compute (ep_overlap) and chunked (ep_chunk ON: the experts start on this rank's own rows, then run each other
   rank's as they land, one chunk per rank, which stats.ep_chunks must show) or not, the exact one serial with
   ep_chunk ON (chunking needs the overlap), the bounded one (DSK_MOE_EP_BOUNDED) serial, overlapped, and
   overlapped and chunked, the exact one overlapped with ep_chunk AUTO (chunked where the ranks span emulated nodes
   only); dropless, under capacity (which must drop slots here) and, across emulated nodes, with node-limited routing.
   Then FP8 dispatch (with experts in the activation dtype and in FP8) overlapped against serial: 1, or 0 with the
   differences on stderr. */
static int ep_bounded_same(dsk_comm *c, dsk_moe_opts o, int rank, const float *x_rows, const float *dy_rows) {
    static const char *names[] = {"",
                                  "exact overlapped chunked",
                                  "exact overlapped unchunked",
                                  "bounded serial",
                                  "bounded overlapped",
                                  "exact serial with ep_chunk ON",
                                  "exact overlapped with ep_chunk AUTO",
                                  "bounded overlapped chunked"};
    static const char *cfs[] = {"dropless", "capacity", "node-limited"};
    int ok = 1;
    for (int cf = 0; cf < (c->n_nodes > 1 ? 3 : 2); cf++) {
        float *a = NULL;
        size_t na = 0;
        int same = 1; /* every variant runs (the ranks' collectives stay in step) and says whether it differs */
        dsk_moe_opts b = o;
        b.capacity_factor = cf == 1 ? 0.75f : 0.0f;
        if (cf == 2) { /* each token's experts on one node */
            b.n_group = 0;
            b.topk_group = 0;
            b.node_limit = 1;
        }
        b.ep_route = DSK_MOE_ROUTE_FLAT;
        b.ep_exchange = DSK_MOE_EP_EXACT;
        b.ep_overlap = 0;
        if (ep_step_record(c, b, x_rows, dy_rows, &a, &na, NULL)) ok = same = 0;
        for (int v = 1; v < 8; v++) {
            float *d = NULL;
            size_t nd = 0;
            int want = v == 1 || v == 7 || (v == 6 && c->n_nodes > 1) ? c->world_size : 0; /* own, then each other */
            b.ep_exchange = v == 3 || v == 4 || v == 7 ? DSK_MOE_EP_BOUNDED : DSK_MOE_EP_EXACT;
            b.ep_overlap = v != 3 && v != 5;
            b.ep_chunk = v == 1 || v == 5 || v == 7 ? DSK_MOE_CHUNK_ON
                         : v == 6                   ? DSK_MOE_CHUNK_AUTO
                                                    : DSK_MOE_CHUNK_OFF;
            int64_t chunks = -1;
            int got = ep_step_record(c, b, x_rows, dy_rows, &d, &nd, &chunks) == 0;
            if (!got) ok = same = 0;
            if (got && chunks != want) {
                fprintf(stderr, "rank %d %s: %s ran %lld chunks, not %d\n", rank, cfs[cf], names[v], (long long)chunks,
                        want);
                ok = same = 0;
            }
            if (got && a && (na != nd || memcmp(a, d, sizeof(float) * na) != 0)) {
                size_t i = 0;
                while (i < na && !memcmp(a + i, d + i, sizeof(float))) i++;
                fprintf(stderr, "rank %d %s: %s differs from the serial exact at float %zu of %zu\n", rank, cfs[cf],
                        names[v], i, na);
                ok = same = 0;
            }
            free(d);
        }
        if (same && cf == 1 && !(a[na - EP_E - 1] > 0)) {
            fprintf(stderr, "rank %d: capacity 0.75 dropped no slot\n", rank);
            ok = 0;
        }
        free(a);
    }
    for (int f8e = 0; f8e < 2; f8e++) { /* FP8 dispatch, its codes and scales sized before the thread starts */
        float *r[2] = {NULL, NULL};
        size_t n[2] = {0, 0};
        dsk_moe_opts b = o;
        b.ep_route = DSK_MOE_ROUTE_FLAT;
        b.ep_exchange = DSK_MOE_EP_EXACT;
        b.ep_dispatch = DSK_MOE_DISPATCH_FP8;
        b.expert_gemm = f8e ? DSK_MOE_GEMM_FP8 : DSK_MOE_GEMM_ACT;
        b.ep_chunk = DSK_MOE_CHUNK_OFF;
        for (int ov = 0; ov < 2; ov++) {
            b.ep_overlap = ov;
            if (ep_step_record(c, b, x_rows, dy_rows, &r[ov], &n[ov], NULL)) ok = 0;
        }
        if (r[0] && r[1] && (n[0] != n[1] || memcmp(r[0], r[1], sizeof(float) * n[0]) != 0)) {
            fprintf(stderr, "rank %d: FP8 dispatch%s overlapped differs from serial\n", rank,
                    f8e ? " with FP8 experts" : "");
            ok = 0;
        }
        free(r[0]);
        free(r[1]);
    }
    return ok;
}

/* Saved forwards under expert parallelism: 4 micro-batches made of the rank's rows through 2 slots (the
   pipeline order of sl_run), each call split in its begin and end or in all its steps, and (dropless) two
   layers' calls in interleaved steps (sl_pair), give the serial order's bits, with the exact exchange serial
   and overlapped and chunked, the bounded one overlapped (chunked or not), FP8 dispatch and experts overlapped, and
   across 2 nodes two hops, serial and overlapped and chunked; dropless, under capacity and (2 nodes)
   node-limited. */
static int ep_slots_same(const dsk_comm *c, dsk_moe_opts o, int rank, const float *x_rows, const float *dy_rows) {
    static const char *names[] = {"exact serial",
                                  "exact overlapped chunked",
                                  "bounded overlapped",
                                  "FP8 dispatch and experts overlapped",
                                  "two hops",
                                  "bounded overlapped chunked",
                                  "two hops overlapped chunked"};
    sl_io io;
    int ok = 1;
    for (int i = 0; i < SL_MB; i++) { /* x, dy; dy, x; -x, 2 dy; (x + dy) / 2, -dy */
        io.T[i] = EP_T;
        io.x[i] = (float *)malloc(sizeof(float) * EP_T * EP_D);
        io.dy[i] = (float *)malloc(sizeof(float) * EP_T * EP_D);
        for (int j = 0; j < EP_T * EP_D; j++) {
            float x = x_rows[j], d = dy_rows[j];
            io.x[i][j] = i == 0 ? x : i == 1 ? d : i == 2 ? -x : 0.5f * (x + d);
            io.dy[i][j] = i == 0 ? d : i == 1 ? x : i == 2 ? 2.0f * d : -d;
        }
    }
    for (int k = 0; k < 7 * 3; k++) {
        static const char *cfs[] = {"dropless", "capacity 0.75", "node-limited"};
        int v = k % 7, cf = k / 7;
        dsk_moe_opts b = o;
        size_t n1 = 0, n2 = 0;
        float *serial, *slots;
        if ((v == 4 || v == 6 || cf == 2) && c->n_nodes < 2) continue; /* two hops and node limits: across nodes */
        b.capacity_factor = cf == 1 ? 0.75f : 0.0f;
        if (cf == 2) { /* each token's experts on one node */
            b.n_group = 0;
            b.topk_group = 0;
            b.node_limit = 1;
        }
        b.ep_overlap = v > 0 && v != 4;
        b.ep_chunk = v == 1 || v == 5 || v == 6 ? DSK_MOE_CHUNK_ON : DSK_MOE_CHUNK_OFF;
        b.ep_exchange = v == 2 || v == 5 ? DSK_MOE_EP_BOUNDED : DSK_MOE_EP_EXACT;
        b.ep_dispatch = v == 3 ? DSK_MOE_DISPATCH_FP8 : DSK_MOE_DISPATCH_ACT;
        b.expert_gemm = v == 3 ? DSK_MOE_GEMM_FP8 : DSK_MOE_GEMM_ACT;
        b.ep_route = v == 4 || v == 6 ? DSK_MOE_ROUTE_TWO_HOP : DSK_MOE_ROUTE_FLAT;
        serial = sl_run(b, &io, 1, SL_WHOLE, &n1);
        for (int mode = SL_SPLIT; mode < SL_SKIP; mode++) { /* the others: test_slots_same_bits */
            slots = sl_run(b, &io, 2, mode, &n2);
            if (!serial || !slots || n1 != n2 || memcmp(serial, slots, sizeof(float) * n1) != 0) {
                fprintf(stderr, "rank %d: saved forwards, mode %d, %s, %s: %s\n", rank, mode, names[v], cfs[cf],
                        serial && slots ? "2 slots differ from serial" : "a run failed");
                ok = 0;
            }
            free(slots);
        }
        if (cf == 0 && !sl_pair_same(b, &io)) {
            fprintf(stderr, "rank %d: two layers in interleaved steps, %s, %s: differ from the calls whole\n", rank,
                    names[v], cfs[cf]);
            ok = 0;
        }
        free(serial);
    }
    { /* freed with a forward begun (every rank alike): the layer joins the exchange thread first */
        dsk_moe m;
        owned own;
        dsk_moe_opts b = o;
        dsk_tensor x;
        int64_t shp[2] = {EP_T, EP_D};
        b.ep_overlap = 1;
        b.ep_chunk = DSK_MOE_CHUNK_OFF;
        dsk_tensor_wrap(&x, io.x[0], DSK_F32, dsk_cpu(), 2, shp);
        if (make_layer(&m, &own, &b) != DSK_OK || dsk_moe_forward_begin(&m, NULL, &x) != DSK_OK) {
            fprintf(stderr, "rank %d: a forward begun to free: %s\n", rank, dsk_last_error());
            ok = 0;
        }
        drop_layer(&m, &own);
    }
    sl_free(&io);
    return ok;
}

/* Node-limited routing (node_limit 1, the ranks on two emulated hosts) against a float64 reference of the
   rule: node q's score is the sum of its top K/M selection scores c = p + b, the best M nodes are kept, the
   top K of c among their experts selected; every token's experts on one node; stats.rows_off_node = the
   slots this rank routed to the other node, counted here from the routing. 1 if all hold. */
static int ep_node_limited(dsk_comm *c, dsk_moe_opts o, int rank, const float *x_rows) {
    dsk_moe m;
    owned own;
    dsk_tensor x, y, sel;
    int64_t shp[2] = {EP_T, EP_D}, ss[2] = {EP_T, EP_K}, off_node = 0;
    int ok = 1, per_node = EP_E / c->n_nodes, w = EP_K / 1;
    float yb[EP_T * EP_D];
    int32_t sb[EP_T * EP_K];
    dsk_moe_stats st, fs[2];
    o.n_group = 0;
    o.topk_group = 0;
    o.node_limit = 1;
    o.ep_route = DSK_MOE_ROUTE_FLAT; /* rows_off_node counts slots (two hops: tokens, ep_two_hop) */
    if (make_layer(&m, &own, &o) != DSK_OK) return 0;
    for (int e = 0; e < EP_E; e++) ((float *)m.bias->value.data)[e] = (float)dsk_test_rand(-0.05, 0.05);
    dsk_tensor_wrap(&x, (void *)x_rows, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&y, yb, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&sel, sb, DSK_I32, dsk_cpu(), 2, ss);
    for (int i = 0; i < EP_T * EP_K; i++) sb[i] = -7; /* poisoned */
    if (dsk_moe_forward(&m, NULL, &y, &x, &st) != DSK_OK || dsk_moe_routing(&m, NULL, &sel) != DSK_OK) ok = 0;
    for (int t = 0; ok && t < EP_T; t++) {
        const float *wr = (const float *)m.router->value.data, *b = (const float *)m.bias->value.data;
        double u[EP_E], p[EP_E], cs[EP_E], mx = -1e300, sum = 0, qs[EP_E], margin = 1e300;
        int best = 0, taken[EP_E] = {0};
        for (int e = 0; e < EP_E; e++) {
            u[e] = 0;
            for (int d = 0; d < EP_D; d++) u[e] += (double)x_rows[t * EP_D + d] * wr[e * EP_D + d];
            mx = u[e] > mx ? u[e] : mx;
        }
        for (int e = 0; e < EP_E; e++) {
            p[e] = o.score == DSK_MOE_SIGMOID ? 1 / (1 + exp(-u[e])) : exp(u[e] - mx);
            sum += p[e];
        }
        for (int e = 0; e < EP_E; e++) cs[e] = (o.score == DSK_MOE_SIGMOID ? p[e] : p[e] / sum) + b[e];
        for (int q = 0; q < c->n_nodes; q++) { /* the sum of the node's top w scores */
            double v[EP_E];
            qs[q] = 0;
            for (int i = 0; i < per_node; i++) v[i] = cs[q * per_node + i];
            for (int k = 0; k < w && k < per_node; k++) {
                int bi = 0;
                for (int i = 1; i < per_node; i++)
                    if (v[i] > v[bi]) bi = i;
                qs[q] += v[bi];
                v[bi] = -1e300;
            }
        }
        for (int q = 1; q < c->n_nodes; q++) {
            if (fabs(qs[q] - qs[best]) < margin) margin = fabs(qs[q] - qs[best]);
            if (qs[q] > qs[best]) best = q;
        }
        for (int k = 0; k < EP_K; k++) { /* top K of the kept node's experts, descending */
            int bi = -1;
            for (int e = best * per_node; e < (best + 1) * per_node; e++)
                if (!taken[e] && (bi < 0 || cs[e] > cs[bi])) bi = e;
            taken[bi] = 1;
            if (margin > 1e-5 && sb[t * EP_K + k] != bi) {
                fprintf(stderr, "rank %d token %d slot %d: expert %d, the rule's %d\n", rank, t, k, sb[t * EP_K + k],
                        bi);
                ok = 0;
            }
            if (sb[t * EP_K + k] / per_node != sb[t * EP_K] / per_node) {
                fprintf(stderr, "rank %d token %d: experts on two nodes\n", rank, t);
                ok = 0;
            }
            off_node += sb[t * EP_K + k] / per_node != c->node;
        }
    }
    if (ok && st.rows_off_node != off_node) {
        fprintf(stderr, "rank %d: rows_off_node %lld, counted %lld\n", rank, (long long)st.rows_off_node,
                (long long)off_node);
        ok = 0;
    }
    drop_layer(&m, &own);
    o.node_limit = 0; /* the figure beside it: the same tokens routed without the limit, exact and bounded */
    for (int bounded = 0; ok && bounded < 2; bounded++) {
        o.ep_exchange = bounded ? DSK_MOE_EP_BOUNDED : DSK_MOE_EP_EXACT;
        if (make_layer(&m, &own, &o) != DSK_OK) return 0;
        if (dsk_moe_forward(&m, NULL, &y, &x, &fs[bounded]) != DSK_OK) ok = 0;
        drop_layer(&m, &own);
    }
    if (ok && rank == 0) {
        printf("# rank 0 of 4 on 2 nodes, %d tokens, top-%d of %d experts: rows its dispatch sends to the other node: "
               "flat %lld, node-limited (M = 1) %lld, bounded %lld\n",
               EP_T, EP_K, EP_E, (long long)fs[0].rows_off_node, (long long)st.rows_off_node,
               (long long)fs[1].rows_off_node);
        fflush(stdout);
    }
    return ok;
}

/* Bytes rank me's exchanges send off its node in one forward and backward, from every rank's routing all
   (P ranks of T tokens, top K, dropless; ranks numbered node by node, L per node): flat, a row per slot whose
   expert sits on another node, and back; two hops, a token row per other node holding one of its experts
   (forward: with its 2K int32 of routing), and back the slots this rank relays (those of tokens of the rank
   with its node_rank on each other node, for experts on this node). *fwd: the forward's part. */
static uint64_t ep_off_bytes(const int32_t *all, int P, int L, int me, int two, uint64_t *fwd) {
    uint64_t row = sizeof(float) * EP_D, to = 0, meta = 0, back = 0;
    int El = EP_E / P;
    for (int p = 0; p < P; p++)
        for (int t = 0; t < EP_T; t++) {
            int seen = 0;
            for (int k = 0; k < EP_K; k++) {
                int e = all[((size_t)p * EP_T + t) * EP_K + k], b = e / El / L;
                if (p == me && b != me / L && !(two && (seen >> b & 1))) {
                    to += row;
                    meta += two ? 2 * EP_K * sizeof(int32_t) : 0;
                }
                if (p == me) seen |= 1 << b;
                if (p / L != me / L && (two ? b == me / L && p % L == me % L : e / El == me)) back += row;
            }
        }
    *fwd = to + meta + back;
    return 2 * (to + back) + meta;
}

/* Two hops in the layer (4 ranks on 2 emulated nodes): the two-hop layer, serial, on ep_overlap's thread and
   chunked there (ep_chunk ON: the experts compute this rank's own rows while the route carries the others', then
   each other rank's; stats.ep_chunks one a rank, 0 unchunked and with AUTO, which does not chunk two hops),
   gives the flat one's outputs, gradients, loads and bias bit for bit, dropless, under capacity 0.75 and
   node-limited (M = 1); and its statistics count the bytes sent off the node as ep_off_bytes computes them from
   the routing, fewer over the group than the flat layer's. 1 if all hold. */
static int ep_two_hop(dsk_comm *c, dsk_moe_opts o, int rank, const float *x_rows, const float *dy_rows) {
    int ok = 1;
    uint64_t got[2], want[2], fgot[2], fwant[2], sum[2];
    for (int cfg = 0; ok && cfg < 3; cfg++) {
        float *a = NULL, *b = NULL;
        size_t na = 0, nb = 0;
        dsk_moe_opts v = o;
        v.capacity_factor = cfg == 1 ? 0.75f : 0.0f;
        if (cfg == 2) {
            v.n_group = 0;
            v.topk_group = 0;
            v.node_limit = 1;
        }
        v.ep_route = DSK_MOE_ROUTE_FLAT;
        v.ep_overlap = 0;
        if (ep_step_record(c, v, x_rows, dy_rows, &a, &na, NULL)) ok = 0;
        v.ep_route = DSK_MOE_ROUTE_TWO_HOP;
        for (int ov = 0; ov < 4; ov++, b = NULL) { /* serial; on ep_overlap's thread, unchunked, chunked, AUTO */
            static const char *how[] = {"", " overlapped", " overlapped chunked", " overlapped, ep_chunk AUTO"};
            int64_t chunks = -1;
            v.ep_overlap = ov > 0;
            v.ep_chunk = ov == 2 ? DSK_MOE_CHUNK_ON : ov == 3 ? DSK_MOE_CHUNK_AUTO : DSK_MOE_CHUNK_OFF;
            if (ep_step_record(c, v, x_rows, dy_rows, &b, &nb, &chunks)) ok = 0;
            if (ok && chunks != (ov == 2 ? c->world_size : 0)) {
                fprintf(stderr, "rank %d config %d: two hops%s ran %lld chunks\n", rank, cfg, how[ov],
                        (long long)chunks);
                ok = 0;
            }
            if (ok && (na != nb || memcmp(a, b, sizeof(float) * na) != 0)) {
                size_t i = 0;
                while (i < na && !memcmp(a + i, b + i, sizeof(float))) i++;
                fprintf(stderr, "rank %d config %d: two hops%s differ from flat at float %zu of %zu\n", rank, cfg,
                        how[ov], i, na);
                ok = 0;
            }
            free(b);
        }
        free(a);
    }
    for (int two = 0; ok && two < 2; two++) {
        dsk_moe m;
        owned own;
        dsk_tensor x, y, dx, dy, sel;
        int64_t shp[2] = {EP_T, EP_D}, ss[2] = {EP_T, EP_K};
        float yb[EP_T * EP_D], dxb[EP_T * EP_D];
        int32_t sb[EP_T * EP_K], all[4 * EP_T * EP_K];
        dsk_moe_stats fs, cs;
        o.ep_route = two ? DSK_MOE_ROUTE_TWO_HOP : DSK_MOE_ROUTE_FLAT;
        if (make_layer(&m, &own, &o) != DSK_OK) return 0;
        dsk_tensor_wrap(&x, (void *)x_rows, DSK_F32, dsk_cpu(), 2, shp);
        dsk_tensor_wrap(&dy, (void *)dy_rows, DSK_F32, dsk_cpu(), 2, shp);
        dsk_tensor_wrap(&y, yb, DSK_F32, dsk_cpu(), 2, shp);
        dsk_tensor_wrap(&dx, dxb, DSK_F32, dsk_cpu(), 2, shp);
        dsk_tensor_wrap(&sel, sb, DSK_I32, dsk_cpu(), 2, ss);
        memset(dxb, 0, sizeof dxb);
        if (dsk_moe_forward(&m, NULL, &y, &x, &fs) != DSK_OK || dsk_moe_backward(&m, NULL, &dx, &dy, 1.0f) != DSK_OK ||
            dsk_moe_stats_request(&m, NULL) != DSK_OK || dsk_moe_stats_collect(&m, NULL, &cs) != DSK_OK ||
            dsk_moe_routing(&m, NULL, &sel) != DSK_OK ||
            dsk_comm_all_gather(c, NULL, sb, all, EP_T * EP_K, DSK_I32) != DSK_OK)
            ok = 0;
        got[two] = cs.bytes_off_node;
        fgot[two] = fs.bytes_off_node;
        want[two] = ep_off_bytes(all, c->world_size, c->node_size, rank, two, &fwant[two]);
        drop_layer(&m, &own);
    }
    for (int two = 0; ok && two < 2; two++)
        if (got[two] != want[two] || fgot[two] != fwant[two]) {
            fprintf(stderr, "rank %d %s: bytes off the node %llu (forward %llu), counted %llu (%llu)\n", rank,
                    two ? "two-hop" : "flat", (unsigned long long)got[two], (unsigned long long)fgot[two],
                    (unsigned long long)want[two], (unsigned long long)fwant[two]);
            ok = 0;
        }
    if (dsk_comm_all_reduce(c, NULL, got, sum, 2, DSK_I64, DSK_COMM_SUM) != DSK_OK) return 0;
    if (ok && !(sum[1] < sum[0])) {
        fprintf(stderr, "rank %d: two hops sent %llu bytes off the nodes, flat %llu\n", rank,
                (unsigned long long)sum[1], (unsigned long long)sum[0]);
        ok = 0;
    }
    if (ok && rank == 0) {
        printf("# 4 ranks on 2 nodes, %d tokens each, top-%d of %d experts, D %d, dropless: bytes sent off the "
               "nodes in a forward and backward, all ranks: flat %llu, two-hop %llu\n",
               EP_T, EP_K, EP_E, EP_D, (unsigned long long)sum[0], (unsigned long long)sum[1]);
        fflush(stdout);
    }
    return ok;
}

/* The bounded exchange needs the same T on every rank: rank 0 with one token fewer fails every rank's
   forward (the fixed-size all-to-all's counts disagree), none hangs. Last: it leaves o.ep unusable. */
static int ep_bounded_uneven(dsk_moe_opts o, int rank) {
    dsk_moe m;
    owned own;
    dsk_tensor x, y;
    int64_t shp[2] = {rank == 0 ? EP_T - 1 : EP_T, EP_D};
    float xb[EP_T * EP_D], yb[EP_T * EP_D];
    int ok;
    o.ep_exchange = DSK_MOE_EP_BOUNDED;
    if (make_layer(&m, &own, &o) != DSK_OK) return 0;
    for (int i = 0; i < EP_T * EP_D; i++) xb[i] = (float)dsk_test_rand(-1, 1);
    dsk_tensor_wrap(&x, xb, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&y, yb, DSK_F32, dsk_cpu(), 2, shp);
    ok = dsk_moe_forward(&m, NULL, &y, &x, NULL) != DSK_OK && strstr(dsk_last_error(), "all_to_all") != NULL;
    if (!ok) fprintf(stderr, "rank %d: uneven T under the bounded exchange: %s\n", rank, dsk_last_error());
    drop_layer(&m, &own);
    return ok;
}

/* Rank `rank` of n joins a host communicator at 127.0.0.1:port (60 s timeout); host_id NULL: this host. */
static dsk_status host_comm(dsk_comm *c, int rank, int n, int port, const char *host_id) {
    dsk_comm_opts co;
    memset(&co, 0, sizeof co);
    co.backend = DSK_COMM_HOST;
    co.master_addr = "127.0.0.1";
    co.master_port = port;
    co.timeout_s = 60;
    co.host_id = host_id;
    return dsk_comm_init(c, rank, n, &co);
}

static int ep_rank_main(int rank, int n, int port, int sigmoid, const float *gx, const float *gdy, float *out,
                        int *bad_cfg_ok, int *nonfinite_ok, int *bounded_ok, int *node_ok) {
    dsk_comm c;
    dsk_moe m;
    owned own;
    dsk_moe_opts o = ep_opts(sigmoid);
    dsk_tensor x, y, dx, dy;
    int64_t shp[2] = {EP_T, EP_D};
    dsk_moe_stats st;
    /* with 4 ranks, two emulated nodes (TCP between them) */
    if (host_comm(&c, rank, n, port, n == 4 ? (rank < 2 ? "ep-host-a" : "ep-host-b") : NULL) != DSK_OK) return 2;
    o.ep = &c;
    { /* E not divisible by the EP size fails on every rank, naming both */
        dsk_moe bad;
        dsk_moe_opts b = o;
        b.n_routed = n * 2 + 1; b.top_k = 1; b.n_group = 0; b.topk_group = 0;
        *bad_cfg_ok = dsk_moe_init(&bad, NULL, &b) == DSK_ERR_ARG && strstr(dsk_last_error(), "not divisible by the expert-parallel size") != NULL;
        if (n == 4) { /* two nodes: a node limit above them, or beside explicit groups */
            b = o;
            b.n_group = 0;
            b.topk_group = 0;
            b.node_limit = 3;
            *bad_cfg_ok = *bad_cfg_ok && dsk_moe_init(&bad, NULL, &b) == DSK_ERR_ARG &&
                          strstr(dsk_last_error(), "node_limit 3 must be <= the 2 nodes") != NULL;
            b = o;
            b.n_group = 4;
            b.topk_group = 2;
            b.node_limit = 1;
            *bad_cfg_ok = *bad_cfg_ok && dsk_moe_init(&bad, NULL, &b) == DSK_ERR_ARG &&
                          strstr(dsk_last_error(), "node_limit 1 sets the groups; n_group 4, topk_group 2") != NULL;
        }
        /* two hops refused where they cannot run, naming why */
        b = o;
        b.ep_route = DSK_MOE_ROUTE_TWO_HOP;
        b.ep_exchange = DSK_MOE_EP_BOUNDED;
        *bad_cfg_ok = *bad_cfg_ok && dsk_moe_init(&bad, NULL, &b) == DSK_ERR_UNSUPPORTED &&
                      strstr(dsk_last_error(), "two-hop needs the exact exchange") != NULL;
        b.ep_exchange = DSK_MOE_EP_EXACT;
        b.ep_dispatch = DSK_MOE_DISPATCH_FP8;
        *bad_cfg_ok = *bad_cfg_ok && dsk_moe_init(&bad, NULL, &b) == DSK_ERR_UNSUPPORTED &&
                      strstr(dsk_last_error(), "(ep_dispatch 0), not FP8") != NULL;
        b.ep_dispatch = DSK_MOE_DISPATCH_ACT;
        b.expert_gemm = DSK_MOE_GEMM_FP8;
        *bad_cfg_ok = *bad_cfg_ok && dsk_moe_init(&bad, NULL, &b) == DSK_ERR_UNSUPPORTED &&
                      strstr(dsk_last_error(), "(expert_gemm 0), not FP8") != NULL;
        b.expert_gemm = DSK_MOE_GEMM_ACT;
        b.ep = NULL;
        *bad_cfg_ok = *bad_cfg_ok && dsk_moe_init(&bad, NULL, &b) == DSK_ERR_ARG &&
                      strstr(dsk_last_error(), "two-hop needs an expert-parallel group of 2 or more ranks") != NULL;
        b.ep = &c;
        b.ep_route = (dsk_moe_ep_route)3;
        *bad_cfg_ok = *bad_cfg_ok && dsk_moe_init(&bad, NULL, &b) == DSK_ERR_ARG &&
                      strstr(dsk_last_error(), "unknown ep_route 3") != NULL;
    }
    if (make_layer(&m, &own, &o) != DSK_OK) return 3;
    dsk_tensor_wrap(&x, (void *)(gx + rank * EP_T * EP_D), DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&dy, (void *)(gdy + rank * EP_T * EP_D), DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&y, out, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&dx, out + EP_T * EP_D, DSK_F32, dsk_cpu(), 2, shp);
    memset(dx.data, 0, sizeof(float) * EP_T * EP_D);
    if (dsk_moe_forward(&m, NULL, &y, &x, &st) != DSK_OK) return 4;
    if (st.tokens != (int64_t)EP_T * n) return 5;
    if (dsk_moe_backward(&m, NULL, &dx, &dy, 1.0f) != DSK_OK) return 6;
    memcpy(out + 2 * EP_T * EP_D, own.grads.data, sizeof(float) * (size_t)dsk_tensor_numel(&own.grads));
    /* per-expert loads over the EP group, then the bias update from loads summed over every rank */
    for (int e = 0; e < EP_E; e++) out[ep_per_rank(n) - 2 * EP_E + e] = (float)st.tokens_per_expert[e];
    if (dsk_moe_update_bias(&m, NULL, &c) != DSK_OK) return 7;
    memcpy(out + ep_per_rank(n) - EP_E, m.bias->value.data, sizeof(float) * EP_E);
    *nonfinite_ok = ep_nonfinite(&m, rank, gx + rank * EP_T * EP_D);
    drop_layer(&m, &own);
    *bounded_ok = ep_bounded_same(&c, o, rank, gx + rank * EP_T * EP_D, gdy + rank * EP_T * EP_D);
    *bounded_ok = ep_slots_same(&c, o, rank, gx + rank * EP_T * EP_D, gdy + rank * EP_T * EP_D) && *bounded_ok;
    *node_ok = n == 4 ? ep_node_limited(&c, o, rank, gx + rank * EP_T * EP_D) : 1;
    *node_ok = *node_ok && (n != 4 || ep_two_hop(&c, o, rank, gx + rank * EP_T * EP_D, gdy + rank * EP_T * EP_D));
    *node_ok = *node_ok && ep_empty_batch(&c, o, rank, gx + rank * EP_T * EP_D, gdy + rank * EP_T * EP_D);
    *node_ok = *node_ok && ep_bounded_uneven(o, rank);
    dsk_comm_free(&c); /* unusable after the uneven exchange */
    return 0;
}

/* One EP configuration: ranks forked over shared memory, checked later against one rank. */
typedef struct ep_job {
    int n, sigmoid, NT;
    size_t per_rank, bytes;
    float *shm, *gx, *gdy;
    int *flags; /* [r]: rank r exit status, [32 + r]: bad EP configuration reported, [48 + r]: NaN reported,
                        [16 + r]: the bounded exchange gave the exact one's bits, [24 + r]: node-limited routing */
    int port_ok;
} ep_job;

/* One step of layer m on one rank holding every row: x and dy are host f32 (shp) rows; y and dx
   are allocated here (dx zeroed first); forward, backward with aux_scale 1, bias update. */
static void one_layer_step(dsk_moe *m, float *xs, float *dys, const int64_t *shp, dsk_tensor *y, dsk_tensor *dx,
                           dsk_moe_stats *st) {
    dsk_tensor x, dy;
    dsk_tensor_wrap(&x, xs, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&dy, dys, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_alloc(NULL, y, DSK_F32, 2, shp);
    dsk_tensor_alloc(NULL, dx, DSK_F32, 2, shp);
    dsk_tensor_fill(NULL, dx, 0.0);
    DSK_TEST_OK(dsk_moe_forward(m, NULL, y, &x, st));
    DSK_TEST_OK(dsk_moe_backward(m, NULL, dx, &dy, 1.0f));
    DSK_TEST_OK(dsk_moe_update_bias(m, NULL, NULL));
}

static float *ep_result(const ep_job *j, int r) { return j->gdy + (size_t)j->NT * EP_D + j->per_rank * (size_t)r; }

/* In a rank forked as one of n on this machine: what a launcher (torchrun, dsk_comm_spawn_local) tells it, so that
   the ranks' default OpenMP teams share the cores (dsk_tensor.h's default threads) rather than each running a
   full team whose waiting threads spin on cores the others need (on 2 cores, 4 ranks ran 10 times slower). */
static void as_local_rank_of(int n) {
    char v[16];
    snprintf(v, sizeof v, "%d", n);
    setenv("LOCAL_WORLD_SIZE", v, 1);
}

/* Waits for the n ranks forked: status[r], r in the order they end, is the wait status of a rank that
   failed (-1 if that is 0); the others are left as they are. */
static void wait_ranks(int n, int *status) {
    for (int r = 0; r < n; r++) {
        int st = 0;
        pid_t pid = wait(&st);
        if (pid > 0 && !(WIFEXITED(st) && WEXITSTATUS(st) == 0)) status[r] = st ? st : -1;
    }
}

/* Forks n ranks that run fn(job, rank, port), each returning 0 or the step that failed, on a free port and waits for
   them: status[r] as wait_ranks leaves it, -1 for a rank not forked. Returns 0, forking none, when no port is free.
   Called before this process uses OpenMP (libgomp's thread pool does not survive fork). */
static int run_ranks(const char *what, int n, int (*fn)(void *job, int rank, int port), void *job, int *status) {
    int port = 0;
    if (dsk_comm_free_port("127.0.0.1", &port) != DSK_OK) return 0;
    for (int r = 0; r < n; r++) {
        pid_t pid = fork();
        if (pid == 0) {
            int rc;
            as_local_rank_of(n);
            rc = fn(job, r, port);
            if (rc) fprintf(stderr, "%s %d: step %d failed: %s\n", what, r, rc, dsk_last_error());
            _exit(rc);
        }
        status[r] = pid < 0 ? -1 : 0;
    }
    wait_ranks(n, status);
    return 1;
}

static int ep_rank(void *job, int r, int port) {
    ep_job *j = (ep_job *)job;
    return ep_rank_main(r, j->n, port, j->sigmoid, j->gx, j->gdy, ep_result(j, r), &j->flags[32 + r], &j->flags[48 + r],
                        &j->flags[16 + r], &j->flags[24 + r]);
}

/* Forks the ranks and waits for them (run_ranks). */
static void ep_run(ep_job *j, int n, int sigmoid) {
    memset(j, 0, sizeof *j);
    j->n = n; j->sigmoid = sigmoid; j->NT = EP_T * n;
    j->per_rank = ep_per_rank(n);
    j->bytes = sizeof(float) * (2 * (size_t)j->NT * EP_D + j->per_rank * n) + 64 * sizeof(int);
    j->shm = (float *)mmap(NULL, j->bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    j->gx = j->shm; j->gdy = j->shm + j->NT * EP_D;
    j->flags = (int *)(j->gdy + (size_t)j->NT * EP_D + j->per_rank * n);
    ep_inputs(j->gx, j->gdy, j->NT);
    j->port_ok = run_ranks("rank", n, ep_rank, j, j->flags);
}

static void ep_check(ep_job *j) {
    int n = j->n, NT = j->NT;
    dsk_moe ref;
    owned own;
    dsk_moe_opts o = ep_opts(j->sigmoid);
    dsk_tensor y, dx;
    dsk_moe_stats st;
    int64_t shp[2] = {NT, EP_D};
    dsk_test_begin(
        "expert parallel %s over %d ranks = 1 rank, overlapped (chunked or not; FP8 dispatch too) & bounded = "
        "serial, 2 saved forwards = serial order, node-limited and two-hop = flat (bits, bytes off the node) on 4, "
        "empty batches",
        j->sigmoid ? "sigmoid+groups" : "softmax", n);
    memset(&y, 0, sizeof y); memset(&dx, 0, sizeof dx);
    DSK_TEST_OK(make_layer(&ref, &own, &o));
    if (!j->port_ok) { dsk_test_fail_at(__FILE__, __LINE__, "no free port: %s", dsk_last_error()); goto out; }
    for (int r = 0; r < n; r++) {
        DSK_TEST_EXPECT(j->flags[r] == 0, "a rank failed with status %d", j->flags[r]);
        DSK_TEST_EXPECT(j->flags[32 + r] == 1,
                        "rank %d: E not divisible by the EP size, or a two-hop route it cannot run, was not refused",
                        r);
        DSK_TEST_EXPECT(j->flags[48 + r] == 1, "rank %d: a NaN token on rank 0 did not fail the forward on every rank",
                        r);
        DSK_TEST_EXPECT(j->flags[16 + r] == 1,
                        "rank %d: overlapped (chunked or not) or bounded exchanges (dropless, capacity 0.75, "
                        "node-limited), or FP8 dispatch overlapped, differ from the serial one, or saved forwards "
                        "in 2 slots from the serial order",
                        r);
        DSK_TEST_EXPECT(j->flags[24 + r] == 1,
                        "rank %d: node-limited routing (2 emulated nodes) broke its rule, two hops differ from flat "
                        "or miscount the bytes off the node, an empty batch failed or changed the bits, or an uneven T "
                        "under the bounded exchange did not fail every rank",
                        r);
    }
    one_layer_step(&ref, j->gx, j->gdy, shp, &y, &dx, &st);
    for (int r = 0; r < n; r++) {
        const float *res = ep_result(j, r) + j->per_rank;
        int bad = 0;
        for (int e = 0; e < EP_E; e++) bad += res[-2 * EP_E + e] != (float)st.tokens_per_expert[e];
        DSK_TEST_EXPECT(bad == 0, "rank %d: %d experts' EP-group loads differ from one rank's", r, bad);
        DSK_TEST_SAME_BYTES(res - EP_E, ref.bias->value.data, sizeof(float) * EP_E, "bias updated from loads summed over ranks");
    }
    {
        int El = EP_E / n;
        int64_t nd = own.grad_dense, w1n = (int64_t)EP_E * EP_F * EP_D;
        double *dense = (double *)calloc((size_t)nd, sizeof(double)), *want = (double *)calloc((size_t)(w1n + nd), sizeof(double));
        const float *rg = (const float *)own.grads.data;
        double mx = 0;
        for (int r = 0; r < n; r++) {
            const float *res = ep_result(j, r);
            char what[64];
            snprintf(what, sizeof what, "rank %d y", r);
            DSK_TEST_SAME_BYTES(res, (float *)y.data + r * EP_T * EP_D, sizeof(float) * EP_T * EP_D, what);
            for (int i = 0; i < EP_T * EP_D; i++) want[i] = ((float *)dx.data)[r * EP_T * EP_D + i];
            snprintf(what, sizeof what, "rank %d dx", r);
            DSK_TEST_CLOSE(res + EP_T * EP_D, want, EP_T * EP_D, 1e-6, 1e-7, what);
            for (int64_t i = 0; i < nd; i++) dense[i] += res[2 * EP_T * EP_D + i];
            /* expert gradients: this rank's slice of each of w1, w2, w3 */
            for (int p = 0; p < 3; p++) {
                int64_t per = (int64_t)El * EP_F * EP_D;
                for (int64_t i = 0; i < per; i++) want[i] = rg[nd + p * w1n + r * per + i];
                snprintf(what, sizeof what, "rank %d expert grad %d", r, p);
                DSK_TEST_CLOSE(res + 2 * EP_T * EP_D + nd + p * per, want, per, 1e-6, 1e-7, what);
            }
        }
        for (int64_t i = 0; i < nd; i++) mx = fabs(rg[i]) > mx ? fabs(rg[i]) : mx;
        /* the single rank sums every token in one GEMM; the ranks' partial sums add in another order */
        DSK_TEST_CLOSE(rg, dense, nd, 1e-6, 1e-6 * mx, "router + shared grads = sum over ranks");
        free(dense); free(want);
    }
out:
    dsk_tensor_free(NULL, &y); dsk_tensor_free(NULL, &dx);
    drop_layer(&ref, &own);
    munmap(j->shm, j->bytes);
    dsk_test_end();
}

/* ---------------------------------------------------------------- FP8 dispatch */

/* 2 ranks, D = 160 (a row is a 128-wide tile and a 32-wide one): the EP layer with FP8 dispatch
   and with the default (f32 rows) against the float64 reference whose routed experts read the
   quantised tokens; the bytes of its statistics against the formula. */
enum { F8_T = 9, F8_D = 160, F8_E = 4, F8_K = 2, F8_F = 8, F8_FS = 6, F8_N = 2 };

typedef struct f8_job {
    float *x;                /* (N T, D) */
    float *y[2];             /* [dispatch] (N T, D): rank r's rows at r T */
    uint64_t (*bytes)[2][4]; /* [rank][dispatch]: forward's dispatch, combine; collected dispatch, combine */
    int *status;             /* [rank] */
    int port_ok;
} f8_job;

static dsk_moe_opts f8_opts(void) {
    dsk_moe_opts o;
    memset(&o, 0, sizeof o);
    o.d_model = F8_D;
    o.n_routed = F8_E;
    o.top_k = F8_K;
    o.d_expert = F8_F;
    o.n_shared = 1;
    o.d_shared = F8_FS;
    o.init_std = 0.3f;
    o.seed = 91;
    return o;
}

/* One rank: a forward (and a backward, which must run) with each dispatch. */
static int f8_rank_main(void *job, int rank, int port) {
    f8_job *j = (f8_job *)job;
    dsk_comm c;
    int64_t shp[2] = {F8_T, F8_D};
    float dyb[F8_T * F8_D], dxb[F8_T * F8_D];
    if (host_comm(&c, rank, F8_N, port, NULL) != DSK_OK) return 2;
    for (int i = 0; i < F8_T * F8_D; i++) dyb[i] = 0.5f;
    for (int fp8 = 0; fp8 < 2; fp8++) {
        dsk_moe m;
        owned own;
        dsk_moe_opts o = f8_opts();
        dsk_moe_stats st, col;
        dsk_tensor x, y, dy, dx;
        o.ep = &c;
        o.ep_dispatch = fp8 ? DSK_MOE_DISPATCH_FP8 : DSK_MOE_DISPATCH_ACT;
        if (make_layer(&m, &own, &o) != DSK_OK) return 3;
        dsk_tensor_wrap(&x, j->x + rank * F8_T * F8_D, DSK_F32, dsk_cpu(), 2, shp);
        dsk_tensor_wrap(&y, j->y[fp8] + rank * F8_T * F8_D, DSK_F32, dsk_cpu(), 2, shp);
        dsk_tensor_wrap(&dy, dyb, DSK_F32, dsk_cpu(), 2, shp);
        dsk_tensor_wrap(&dx, dxb, DSK_F32, dsk_cpu(), 2, shp);
        memset(dxb, 0, sizeof dxb);
        if (dsk_moe_forward(&m, NULL, &y, &x, &st) != DSK_OK) return 4;
        if (dsk_moe_backward(&m, NULL, &dx, &dy, 1.0f) != DSK_OK) return 5;
        for (int i = 0; i < F8_T * F8_D; i++)
            if (!isfinite(dxb[i])) return 6;
        if (dsk_moe_stats_request(&m, NULL) != DSK_OK || dsk_moe_stats_collect(&m, NULL, &col) != DSK_OK) return 7;
        j->bytes[rank][fp8][0] = st.dispatch_bytes;
        j->bytes[rank][fp8][1] = st.combine_bytes;
        j->bytes[rank][fp8][2] = col.dispatch_bytes;
        j->bytes[rank][fp8][3] = col.combine_bytes;
        drop_layer(&m, &own);
    }
    dsk_comm_free(&c);
    return 0;
}

static void f8_run(f8_job *j) {
    size_t nx = (size_t)F8_N * F8_T * F8_D, bytes = 3 * nx * sizeof(float) + sizeof(uint64_t[F8_N][2][4]) + 64;
    char *shm = (char *)mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    j->x = (float *)shm;
    j->y[0] = j->x + nx;
    j->y[1] = j->y[0] + nx;
    j->bytes = (uint64_t(*)[2][4])(j->y[1] + nx);
    j->status = (int *)(j->bytes + F8_N);
    for (size_t i = 0; i < nx; i++) {
        j->x[i] = (float)dsk_test_rand(-1, 1) * (i % F8_D < 128 ? 1.0f : 0.01f); /* tiles of other scales */
        j->y[0][i] = j->y[1][i] = NAN;
    }
    j->port_ok = run_ranks("fp8 dispatch rank", F8_N, f8_rank_main, j, j->status);
}

/* x's rows as the experts read them after FP8 dispatch: 1x128 tiles, d = dsk_amp_fp8_block_scale
   of the tile's amax, codes e4m3(x / d) (the f32 quotient), values the f32 of code * d. */
static void f8_quantised(const float *x, int64_t rows, double *xe) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c0 = 0; c0 < F8_D; c0 += 128) {
            int64_t c1 = c0 + 128 < F8_D ? c0 + 128 : F8_D;
            float amax = 0.0f, d;
            for (int64_t c = c0; c < c1; c++) amax = fabsf(x[r * F8_D + c]) > amax ? fabsf(x[r * F8_D + c]) : amax;
            d = dsk_amp_fp8_block_scale(amax, 448.0f, 0);
            for (int64_t c = c0; c < c1; c++) {
                uint8_t q = dsk_f32_to_e4m3((float)((double)x[r * F8_D + c] / (double)d));
                xe[r * F8_D + c] = (float)((double)dsk_e4m3_to_f32(q) * (double)d);
            }
        }
}

static double *f8_mirror(const dsk_moe_param *p) {
    int64_t n = dsk_tensor_numel(&p->value);
    double *d = (double *)calloc((size_t)n, sizeof(double));
    for (int64_t i = 0; i < n; i++) d[i] = ((const float *)p->value.data)[i];
    return d;
}

static void f8_check(f8_job *j) {
    const int NT = F8_N * F8_T, El = F8_E / F8_N, S = (F8_D + 127) / 128;
    cfg c = base_cfg(NT, F8_D, F8_E, F8_K, F8_F);
    dsk_moe one;
    owned own;
    dsk_moe_opts o = f8_opts();
    refp w;
    refout ro;
    double *xd = (double *)calloc((size_t)NT * F8_D, sizeof(double)), *xe = (double *)calloc((size_t)NT * F8_D, 8);
    double *y_q = (double *)calloc((size_t)NT * F8_D, 8), *y_x = (double *)calloc((size_t)NT * F8_D, 8), worst = 0;
    int sel[NT * F8_K], kept[NT * F8_K], load[F8_E], lcnt[NT * F8_E];
    double g[NT * F8_K];
    dsk_test_begin("FP8 expert dispatch, %d ranks, D %d (tiles of 128 and 32): y against float64 experts reading "
                   "the quantised tokens; bytes per forward against n (D + 4 ceil(D/128)) and n D 4",
                   F8_N, F8_D);
    if (!j->port_ok) {
        dsk_test_fail_at(__FILE__, __LINE__, "no free port: %s", dsk_last_error());
        goto out;
    }
    for (int r = 0; r < F8_N; r++) DSK_TEST_EXPECT(j->status[r] == 0, "rank %d failed with status %d", r, j->status[r]);
    DSK_TEST_OK(make_layer(&one, &own, &o)); /* the same seeded parameters, every expert */
    c.n_shared = 1;
    c.Fs = F8_FS;
    w.wr = f8_mirror(one.router);
    w.b = f8_mirror(one.bias);
    w.w1 = f8_mirror(one.w1);
    w.w2 = f8_mirror(one.w2);
    w.w3 = f8_mirror(one.w3);
    w.s1 = f8_mirror(one.sw1);
    w.s2 = f8_mirror(one.sw2);
    w.s3 = f8_mirror(one.sw3);
    ro.sel = sel;
    ro.g = g;
    ro.kept = kept;
    ro.load = load;
    ro.lcnt = lcnt;
    for (int i = 0; i < NT * F8_D; i++) xd[i] = j->x[i];
    f8_quantised(j->x, NT, xe);
    ref_forward(&c, &w, xd, y_x, NULL, &ro);
    c.xe = xe;
    ref_forward(&c, &w, xd, y_q, NULL, &ro);
    DSK_TEST_EXPECT(ro.margin > 1e-5, "routing %.3g from a tie: f32 and f64 may choose differently", ro.margin);
    DSK_TEST_CLOSE(j->y[1], y_q, (int64_t)NT * F8_D, 1e-4, 1e-5, "y, FP8 dispatch");
    DSK_TEST_CLOSE(j->y[0], y_x, (int64_t)NT * F8_D, 1e-4, 1e-5, "y, f32 dispatch");
    for (int i = 0; i < NT * F8_D; i++) worst = fmax(worst, fabs(y_q[i] - y_x[i]) / (1e-5 + 1e-4 * fabs(y_x[i])));
    DSK_TEST_EXPECT(worst > 10, "the quantisation moved no output beyond 10x the tolerance (%.3g)", worst);
    for (int r = 0; r < F8_N; r++) {
        uint64_t n_kept = (uint64_t)F8_T * F8_K, R = 0;
        for (int i = 0; i < NT * F8_K; i++) R += sel[i] / El == r;
        for (int k = 0; k < 4; k += 2) {
            DSK_TEST_EXPECT(j->bytes[r][1][k] == n_kept * (F8_D + 4 * S) && j->bytes[r][1][k + 1] == R * F8_D * 4,
                            "rank %d FP8 (%s): dispatch %llu bytes (want %llu), combine %llu (want %llu)", r,
                            k ? "collected" : "forward", (unsigned long long)j->bytes[r][1][k],
                            (unsigned long long)(n_kept * (F8_D + 4 * S)), (unsigned long long)j->bytes[r][1][k + 1],
                            (unsigned long long)(R * F8_D * 4));
            DSK_TEST_EXPECT(j->bytes[r][0][k] == n_kept * F8_D * 4 && j->bytes[r][0][k + 1] == R * F8_D * 4,
                            "rank %d f32 (%s): dispatch %llu bytes (want %llu), combine %llu (want %llu)", r,
                            k ? "collected" : "forward", (unsigned long long)j->bytes[r][0][k],
                            (unsigned long long)(n_kept * F8_D * 4), (unsigned long long)j->bytes[r][0][k + 1],
                            (unsigned long long)(R * F8_D * 4));
        }
    }
    drop_layer(&one, &own);
    {
        double *ws[] = {w.wr, w.b, w.w1, w.w2, w.w3, w.s1, w.s2, w.s3};
        for (int i = 0; i < 8; i++) free(ws[i]);
    }
out:
    free(xd);
    free(xe);
    free(y_q);
    free(y_x);
    dsk_test_end();
}

/* ---------------------------------------------------------------- loss span */

/* A micro-batch of SP_N rows in sequences of SP_L, split over 2 or 4 forked host ranks at rows that cut
   sequences in the middle (with expert parallelism 1 or 2), each rank's layer given the loss span (the world, its
   row0, SP_N): the Switch, sequence-wise and z losses are the micro-batch's on every rank, bit for bit alike, and
   equal to one layer over every row and to the float64 reference; dx, the router, shared and expert gradients
   summed over the ranks equal the one layer's and the reference's central differences; the bias update counts
   each row once. Routing is the same in every layout: the inputs are redrawn until every selection, group choice
   and loss count (the K-th against the (K+1)-th unbiased score) is SP_MARGIN away from a tie. */
enum { SP_N = 24, SP_D = 8, SP_E = 6, SP_K = 2, SP_F = 5, SP_FS = 4, SP_L = 6, SP_MAX = 4 };
#define SP_MARGIN 1e-4

typedef struct sp_job {
    const char *name;
    cfg c;
    int n, ep, bad;           /* ranks, expert-parallel size, and whether the ranks also run the bad spans */
    int64_t rows[SP_MAX + 1]; /* rank r holds rows [rows[r], rows[r + 1]) */
    float *val[8], *x, *dy;   /* f32 parameters (router, bias, w1, w2, w3, shared w1 w2 w3: the layer's layout, every
                                expert), x and dy (SP_N, SP_D) */
    refp w;                   /* their float64 mirrors */
    double *xd, *dyd;
    int drawn, port_ok;
    size_t grads_per_rank, bytes;
    void *shm;           /* the ranks' results: */
    double *loss;        /* (n, 4) stats: aux, seq_aux, z, total */
    float *y, *dx;       /* (SP_N, SP_D) each rank its rows */
    float *grads, *bias; /* (n, grads_per_rank) gradient slabs, (n, E) biases after the update */
    int *flag;           /* (n, 4): exit status, bad spans reported, state kept after them, loads kept */
} sp_job;

static const int64_t sp_numel[8] = {SP_E * SP_D,      SP_E,        SP_E *SP_F *SP_D, SP_E *SP_D *SP_F,
                                    SP_E *SP_F *SP_D, SP_FS *SP_D, SP_D *SP_FS,      SP_FS *SP_D};

static float *sp_draw(int64_t n, double lo, double hi, double **mirror) {
    float *v = (float *)malloc(sizeof(float) * (size_t)n);
    *mirror = (double *)malloc(sizeof(double) * (size_t)n);
    for (int64_t i = 0; i < n; i++) (*mirror)[i] = v[i] = (float)dsk_test_rand(lo, hi);
    return v;
}

/* Parameters, then x until routing is SP_MARGIN from any tie (pure C: no OpenMP before the forks). */
static void sp_inputs(sp_job *j, double bias_mag) {
    double **mir[8] = {&j->w.wr, &j->w.b, &j->w.w1, &j->w.w2, &j->w.w3, &j->w.s1, &j->w.s2, &j->w.s3};
    double lo[8] = {-1, -bias_mag, -0.5, -0.5, -0.5, -0.5, -0.5, -0.5};
    refout o;
    double *yb = (double *)malloc(sizeof(double) * SP_N * SP_D);
    for (int i = 0; i < 8; i++) j->val[i] = sp_draw(sp_numel[i], lo[i], -lo[i], mir[i]);
    j->dy = sp_draw(SP_N * SP_D, -1, 1, &j->dyd);
    o.sel = (int *)malloc(sizeof(int) * SP_N * SP_K);
    o.g = (double *)malloc(sizeof(double) * SP_N * SP_K);
    o.kept = (int *)malloc(sizeof(int) * SP_N * SP_K);
    o.load = (int *)malloc(sizeof(int) * SP_E);
    o.lcnt = (int *)malloc(sizeof(int) * SP_N * SP_E);
    j->x = NULL;
    j->xd = NULL;
    for (int tries = 0; tries < 50 && !j->drawn; tries++) {
        free(j->x);
        free(j->xd);
        j->x = sp_draw(SP_N * SP_D, -1, 1, &j->xd);
        ref_forward(&j->c, &j->w, j->xd, yb, NULL, &o);
        j->drawn = o.margin > SP_MARGIN;
    }
    free(o.sel);
    free(o.g);
    free(o.kept);
    free(o.load);
    free(o.lcnt);
    free(yb);
}

/* The job's values into m's bound parameters (its experts only). */
static void sp_load(const sp_job *j, dsk_moe *m) {
    for (int i = 0; i < m->n_params; i++) {
        int64_t n = dsk_tensor_numel(&m->params[i].value);
        int64_t off = m->params[i].expert_sharded ? m->expert0 * n / m->n_local : 0;
        memcpy(m->params[i].value.data, j->val[i] + off, sizeof(float) * (size_t)n);
    }
}

static dsk_comm sp_connect(int rank, int n, int port, int *ok) {
    dsk_comm c;
    *ok = host_comm(&c, rank, n, port, NULL) == DSK_OK;
    return c;
}

/* A forward on rows [r0, r0 + T) of x under the span (world, r0, total) that must fail naming `needle`. */
static int sp_refused(dsk_moe *m, dsk_comm *world, const float *x, int64_t r0, int64_t T, int64_t total,
                      const char *needle) {
    int64_t shp[2] = {T, SP_D};
    float *yb = (float *)malloc(sizeof(float) * (size_t)(T * SP_D));
    dsk_tensor tx, ty;
    int ok;
    dsk_tensor_wrap(&tx, (void *)(x + r0 * SP_D), DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&ty, yb, DSK_F32, dsk_cpu(), 2, shp);
    ok = dsk_moe_set_loss_span(m, world, r0, total) == DSK_OK &&
         dsk_moe_forward(m, NULL, &ty, &tx, NULL) == DSK_ERR_ARG && strstr(dsk_last_error(), needle) != NULL;
    if (!ok) fprintf(stderr, "rank %d: want an error naming \"%s\", got: %s\n", world->rank, needle, dsk_last_error());
    free(yb);
    return ok;
}

/* Two ranks (rows [0, 11) and [11, 24)) pass spans that do not fit together: every rank fails naming the values,
   no forward is left for backward and nothing counts toward the bias update. flag[1]: the errors, flag[2]: the
   state after them, flag[3]: the bias unchanged by an update after them. */
static void sp_bad_spans(sp_job *j, dsk_moe *m, dsk_comm *world, int rank, int *flag) {
    char want[160];
    int64_t r0 = j->rows[rank], T = j->rows[rank + 1] - r0, shp[2] = {T, SP_D};
    float b0[SP_E];
    dsk_tensor dx, dy;
    memcpy(b0, m->bias->value.data, sizeof b0);
    snprintf(want, sizeof want,
             "the loss span's total_rows differs between the 2 ranks of its group (this rank %d, "
             "their sum 54); nothing was computed",
             rank ? 30 : 24);
    flag[1] = sp_refused(m, world, j->x, r0, T, rank ? 30 : 24, want);
    snprintf(want, sizeof want,
             "the loss span's group holds 22 rows in all over its 2 rank(s), not total_rows 24 "
             "(this rank rows [%lld, %lld))",
             (long long)(rank ? 11 : 0), (long long)(rank ? 22 : 11));
    flag[1] &= sp_refused(m, world, j->x, rank ? 11 : 0, 11, 24, want);
    dsk_tensor_wrap(&dx, j->dx + r0 * SP_D, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&dy, j->dy + r0 * SP_D, DSK_F32, dsk_cpu(), 2, shp);
    flag[2] = dsk_moe_backward(m, NULL, &dx, &dy, 1.0f) == DSK_ERR_STATE;
    flag[3] = dsk_moe_update_bias(m, NULL, world) == DSK_OK && !memcmp(b0, m->bias->value.data, sizeof b0);
}

static int sp_rank_main(sp_job *j, int rank, int port) {
    dsk_comm world, epc;
    dsk_moe m;
    owned own;
    dsk_moe_opts o = opts_of(&j->c, DSK_F32);
    dsk_moe_stats st;
    dsk_tensor x, y, dx, dy;
    int64_t r0 = j->rows[rank], T = j->rows[rank + 1] - r0, shp[2] = {T, SP_D};
    int ok;
    world = sp_connect(rank, j->n, port, &ok);
    if (!ok) return 2;
    memset(&epc, 0, sizeof epc);
    if (j->ep > 1) {
        if (dsk_comm_split(&world, rank / j->ep, rank, &epc) != DSK_OK) return 3;
        o.ep = &epc;
    }
    if (make_layer(&m, &own, &o) != DSK_OK) return 4;
    sp_load(j, &m);
    dsk_tensor_wrap(&x, j->x + r0 * SP_D, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&dy, j->dy + r0 * SP_D, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&y, j->y + r0 * SP_D, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&dx, j->dx + r0 * SP_D, DSK_F32, dsk_cpu(), 2, shp);
    dsk_test_poison_f32((float *)y.data, T * SP_D);
    memset(dx.data, 0, sizeof(float) * (size_t)(T * SP_D));
    if (dsk_moe_set_loss_span(&m, &world, r0, SP_N) != DSK_OK) return 5;
    if (dsk_moe_forward(&m, NULL, &y, &x, &st) != DSK_OK) return 6;
    j->loss[rank * 4 + 0] = st.aux_loss;
    j->loss[rank * 4 + 1] = st.seq_aux_loss;
    j->loss[rank * 4 + 2] = st.z_loss;
    j->loss[rank * 4 + 3] = st.loss;
    if (dsk_moe_backward(&m, NULL, &dx, &dy, 1.0f) != DSK_OK) return 7;
    memcpy(j->grads + j->grads_per_rank * rank, own.grads.data, sizeof(float) * (size_t)dsk_tensor_numel(&own.grads));
    if (dsk_moe_update_bias(&m, NULL, &world) != DSK_OK) return 8;
    memcpy(j->bias + rank * SP_E, m.bias->value.data, sizeof(float) * SP_E);
    if (j->bad) sp_bad_spans(j, &m, &world, rank, j->flag + 4 * rank);
    drop_layer(&m, &own);
    if (j->ep > 1) dsk_comm_free(&epc);
    dsk_comm_free(&world);
    return 0;
}

/* Draws the job's inputs and forks its ranks (before this process starts OpenMP). */
static void sp_run(sp_job *j) {
    int port = 0;
    pid_t pids[SP_MAX];
    j->grads_per_rank =
        (size_t)(sp_numel[0] + sp_numel[2] + sp_numel[3] + sp_numel[4] + sp_numel[5] + sp_numel[6] + sp_numel[7]);
    j->bytes = sizeof(double) * 4 * j->n + sizeof(float) * (2 * SP_N * SP_D + j->grads_per_rank * j->n + SP_E * j->n) +
               sizeof(int) * 4 * j->n;
    j->shm = mmap(NULL, j->bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    j->loss = (double *)j->shm;
    j->y = (float *)(j->loss + 4 * j->n);
    j->dx = j->y + SP_N * SP_D;
    j->grads = j->dx + SP_N * SP_D;
    j->bias = j->grads + j->grads_per_rank * j->n;
    j->flag = (int *)(j->bias + SP_E * j->n);
    for (int i = 0; i < 4 * j->n; i++) j->loss[i] = NAN; /* poisoned: a rank that writes nothing fails the checks */
    dsk_test_poison_f32(j->bias, SP_E * j->n);
    sp_inputs(j, j->c.sigmoid ? 0.05 : 0.0);
    j->port_ok = dsk_comm_free_port("127.0.0.1", &port) == DSK_OK;
    if (!j->drawn || !j->port_ok) return;
    for (int r = 0; r < j->n; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            int rc;
            as_local_rank_of(j->n);
            rc = sp_rank_main(j, r, port);
            if (rc) fprintf(stderr, "rank %d: step %d failed: %s\n", r, rc, dsk_last_error());
            _exit(rc);
        }
    }
    for (int r = 0; r < j->n; r++) {
        int status = 0;
        if (pids[r] < 0 || waitpid(pids[r], &status, 0) != pids[r]) j->flag[4 * r] = -1;
        else if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) j->flag[4 * r] = status ? status : -1;
    }
}

/* The ranks' gradients assembled into one slab of the one layer's layout: the dense ones summed over the ranks,
   each expert's summed over the ranks holding it. */
static void sp_assemble(const sp_job *j, int64_t nd, float *out) {
    int64_t per = (int64_t)(SP_E / j->ep) * SP_F * SP_D, all = (int64_t)SP_E * SP_F * SP_D;
    memset(out, 0, sizeof(float) * j->grads_per_rank);
    for (int r = 0; r < j->n; r++) {
        const float *g = j->grads + j->grads_per_rank * r;
        for (int64_t i = 0; i < nd; i++) out[i] += g[i];
        for (int p = 0; p < 3; p++)
            for (int64_t i = 0; i < per; i++) out[nd + p * all + (r % j->ep) * per + i] += g[nd + p * per + i];
    }
}

static void sp_check(sp_job *j) {
    cfg c = j->c;
    dsk_moe one;
    owned own;
    dsk_moe_opts o = opts_of(&c, DSK_F32);
    dsk_moe_stats st;
    dsk_tensor y, dx;
    int64_t shp[2] = {SP_N, SP_D};
    float *sum = (float *)malloc(sizeof(float) * j->grads_per_rank);
    dsk_test_begin("loss span: %s over %d ranks (expert parallel %d), rows cutting sequences of %d = one layer = "
                   "float64",
                   j->name, j->n, j->ep, SP_L);
    memset(&y, 0, sizeof y);
    memset(&dx, 0, sizeof dx);
    if (!j->drawn) {
        dsk_test_fail_at(__FILE__, __LINE__, "no inputs %g away from a routing tie", SP_MARGIN);
        goto out;
    }
    if (!j->port_ok) {
        dsk_test_fail_at(__FILE__, __LINE__, "no free port: %s", dsk_last_error());
        goto out;
    }
    for (int r = 0; r < j->n; r++)
        DSK_TEST_EXPECT(j->flag[4 * r] == 0, "rank %d failed with status %d", r, j->flag[4 * r]);
    DSK_TEST_OK(make_layer(&one, &own, &o));
    sp_load(j, &one);
    one_layer_step(&one, j->x, j->dy, shp, &y, &dx, &st);
    {
        fixture f; /* the float64 reference over every row: loss values and central differences */
        double one_loss[4] = {st.aux_loss, st.seq_aux_loss, st.z_loss, st.loss}, ref[4], *yr, mx = 0;
        int64_t nd = own.grad_dense, all = (int64_t)SP_E * SP_F * SP_D;
        const float *og = (const float *)own.grads.data;
        memset(&f, 0, sizeof f);
        f.c = c;
        f.w = j->w;
        f.x = j->xd;
        f.R = j->dyd;
        f.o.sel = (int *)calloc(SP_N * SP_K, sizeof(int));
        f.o.g = (double *)calloc(SP_N * SP_K, sizeof(double));
        f.o.kept = (int *)calloc(SP_N * SP_K, sizeof(int));
        f.o.load = (int *)calloc(SP_E, sizeof(int));
        f.o.lcnt = (int *)calloc(SP_N * SP_E, sizeof(int));
        yr = (double *)malloc(sizeof(double) * SP_N * SP_D);
        ref_forward(&c, &j->w, j->xd, yr, NULL, &f.o);
        ref[0] = f.o.aux;
        ref[1] = f.o.seq_aux;
        ref[2] = f.o.z;
        ref[3] = f.o.aux + f.o.seq_aux + f.o.z;
        DSK_TEST_EXPECT(ref[0] > 0 && ref[1] > 0 && ref[2] > 0, "loss terms %g %g %g not all on", ref[0], ref[1],
                        ref[2]);
        for (int r = 0; r < j->n; r++) {
            char what[64];
            snprintf(what, sizeof what, "rank %d's loss values = rank 0's", r);
            DSK_TEST_SAME_BYTES(j->loss + 4 * r, j->loss, 4 * sizeof(double), what);
        }
        DSK_TEST_CLOSE64(j->loss, one_loss, 4, 1e-12, 0, "aux, seq_aux, z, total: ranks vs one layer");
        DSK_TEST_CLOSE64(j->loss, ref, 4, 1e-5, 0, "aux, seq_aux, z, total: ranks vs float64");
        DSK_TEST_SAME_BYTES(j->y, y.data, sizeof(float) * SP_N * SP_D, "y of the ranks' rows = one layer's");
        {
            double *w = (double *)malloc(sizeof(double) * SP_N * SP_D);
            for (int i = 0; i < SP_N * SP_D; i++) w[i] = ((float *)dx.data)[i];
            DSK_TEST_CLOSE(j->dx, w, SP_N * SP_D, 1e-6, 1e-7, "dx of the ranks' rows = one layer's");
            free(w);
        }
        sp_assemble(j, nd, sum);
        for (int64_t i = 0; i < (int64_t)j->grads_per_rank; i++) mx = fabs(og[i]) > mx ? fabs(og[i]) : mx;
        {
            double *w = (double *)malloc(sizeof(double) * j->grads_per_rank);
            for (size_t i = 0; i < j->grads_per_rank; i++) w[i] = og[i];
            DSK_TEST_CLOSE(sum, w, (int64_t)j->grads_per_rank, 1e-6, 1e-6 * mx,
                           "gradients summed over ranks = one "
                           "layer's");
            free(w);
        }
        check_grad("dx of the ranks vs float64", j->dx, j->xd, SP_N * SP_D, &f);
        check_grad("d router summed vs float64", sum, j->w.wr, sp_numel[0], &f);
        check_grad("d shared.w1 summed vs float64", sum + sp_numel[0], j->w.s1, sp_numel[5], &f);
        check_grad("d shared.w2 summed vs float64", sum + sp_numel[0] + sp_numel[5], j->w.s2, sp_numel[6], &f);
        check_grad("d shared.w3 summed vs float64", sum + sp_numel[0] + sp_numel[5] + sp_numel[6], j->w.s3, sp_numel[7],
                   &f);
        check_grad("d w1 summed vs float64", sum + nd, j->w.w1, all, &f);
        check_grad("d w2 summed vs float64", sum + nd + all, j->w.w2, all, &f);
        check_grad("d w3 summed vs float64", sum + nd + 2 * all, j->w.w3, all, &f);
        for (int r = 0; r < j->n; r++)
            DSK_TEST_SAME_BYTES(j->bias + SP_E * r, one.bias->value.data, sizeof(float) * SP_E,
                                "bias updated from every rank's loads = one layer's");
        for (int r = 0; r < j->n && j->bad; r++)
            DSK_TEST_EXPECT(j->flag[4 * r + 1] && j->flag[4 * r + 2] && j->flag[4 * r + 3],
                            "rank %d: spans that do not fit: errors named %d, no forward left %d, nothing counted %d",
                            r, j->flag[4 * r + 1], j->flag[4 * r + 2], j->flag[4 * r + 3]);
        free(f.o.sel);
        free(f.o.g);
        free(f.o.kept);
        free(f.o.load);
        free(f.o.lcnt);
        free(yr);
    }
    drop_layer(&one, &own);
out:
    dsk_tensor_free(NULL, &y);
    dsk_tensor_free(NULL, &dx);
    for (int i = 0; i < 8; i++) free(j->val[i]);
    free(j->x);
    free(j->dy);
    free(j->xd);
    free(j->dyd);
    free(sum);
    free(j->w.wr);
    free(j->w.b);
    free(j->w.w1);
    free(j->w.w2);
    free(j->w.w3);
    free(j->w.s1);
    free(j->w.s2);
    free(j->w.s3);
    munmap(j->shm, j->bytes);
    dsk_test_end();
}

/* The jobs: sigmoid with groups and a bias over 2 ranks (and the bad spans), softmax over 4, and expert
   parallelism 2 over 2 and over 4 ranks (two EP groups, the span over all four). */
static void sp_jobs(sp_job *j) {
    cfg sig = base_cfg(SP_N, SP_D, SP_E, SP_K, SP_F), soft;
    const int64_t r2[3] = {0, 11, 24}, r4[5] = {0, 5, 9, 17, 24}, r2e[3] = {0, 13, 24}, r4e[5] = {0, 7, 12, 20, 24};
    sig.sigmoid = 1;
    sig.norm = 1;
    sig.n_group = 3;
    sig.topk_group = 2;
    sig.scale = 2.5;
    sig.aux = 0.05;
    sig.seq_aux = 0.1;
    sig.seq_len = SP_L;
    sig.z = 0.02;
    sig.n_shared = 1;
    sig.Fs = SP_FS;
    soft = sig;
    soft.sigmoid = 0;
    soft.norm = 0;
    soft.n_group = 1;
    soft.topk_group = 1;
    soft.scale = 1.0;
    memset(j, 0, 4 * sizeof *j);
    j[0].name = "sigmoid+groups+bias";
    j[0].c = sig;
    j[0].n = 2;
    j[0].ep = 1;
    j[0].bad = 1;
    memcpy(j[0].rows, r2, sizeof r2);
    j[1].name = "softmax";
    j[1].c = soft;
    j[1].n = 4;
    j[1].ep = 1;
    memcpy(j[1].rows, r4, sizeof r4);
    j[2].name = "sigmoid+groups+bias";
    j[2].c = sig;
    j[2].n = 2;
    j[2].ep = 2;
    memcpy(j[2].rows, r2e, sizeof r2e);
    j[3].name = "sigmoid+groups+bias";
    j[3].c = sig;
    j[3].n = 4;
    j[3].ep = 2;
    memcpy(j[3].rows, r4e, sizeof r4e);
    { /* from a stream of their own: every other case draws what it drew before these jobs existed */
        uint64_t rng = dsk_test_g.rng;
        dsk_test_g.rng = dsk_test_g.seed ^ 0x5350414e5350414eull;
        for (int i = 0; i < 4; i++) sp_run(&j[i]);
        dsk_test_g.rng = rng;
    }
}

/* Bad spans on one rank: each fails naming its values and changes nothing; the span reset (or a span of the
   call's own rows) gives the bits of a call without one. */
static void test_loss_span_bad(void) {
    cfg c = base_cfg(6, 8, 5, 2, 4);
    fixture f;
    dsk_comm blank;
    c.aux = 0.05;
    c.seq_aux = 0.1;
    c.seq_len = 3;
    c.z = 0.02;
    memset(&blank, 0, sizeof blank);
    if (setup(&f, &c, DSK_F32, 0.0)) {
        dsk_moe_stats s0, s1;
        dsk_tensor dx, dy;
        float *g0 = (float *)malloc(sizeof(float) * (size_t)dsk_tensor_numel(&f.own.grads)),
              *dx0 = (float *)malloc(sizeof(float) * 48);
        grad_io(&f, &dx, &dy);
        DSK_TEST_STATUS(dsk_moe_set_loss_span(&f.m, NULL, -1, 6), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_moe_set_loss_span: layer \"moe\": row0 -1, total_rows 6: want 0 <= row0 <= "
                                "total_rows");
        DSK_TEST_STATUS(dsk_moe_set_loss_span(&f.m, NULL, 0, -3), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("row0 0, total_rows -3");
        DSK_TEST_STATUS(dsk_moe_set_loss_span(&f.m, NULL, 7, 6), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("row0 7, total_rows 6");
        DSK_TEST_STATUS(dsk_moe_set_loss_span(&f.m, &blank, 0, 6), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("the group is not an initialised communicator");
        DSK_TEST_STATUS(dsk_moe_set_loss_span(NULL, NULL, 0, 6), DSK_ERR_ARG);
        /* no span yet: a plain forward and backward, the bits to keep */
        if (run_forward(&f, &s0)) {
            DSK_TEST_OK(dsk_moe_backward(&f.m, NULL, &dx, &dy, 1.0f));
            memcpy(g0, f.own.grads.data, sizeof(float) * (size_t)dsk_tensor_numel(&f.own.grads));
            memcpy(dx0, dx.data, sizeof(float) * 48);
        }
        DSK_TEST_OK(dsk_moe_set_loss_span(&f.m, NULL, 3, 8));
        DSK_TEST_STATUS(dsk_moe_forward(&f.m, NULL, &f.ty, &f.tx, NULL), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_moe_forward: layer \"moe\": this call's 6 rows from row0 3 end past the loss "
                                "span's total_rows 8");
        DSK_TEST_OK(dsk_moe_set_loss_span(&f.m, NULL, 0, 9));
        DSK_TEST_STATUS(dsk_moe_forward(&f.m, NULL, &f.ty, &f.tx, NULL), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("a loss span without a group holds this call's rows only: total_rows 9 and row0 0, "
                                "but the call has 6 rows");
        DSK_TEST_OK(dsk_moe_set_loss_span(&f.m, NULL, 2, 8));
        DSK_TEST_STATUS(dsk_moe_forward(&f.m, NULL, &f.ty, &f.tx, NULL), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("total_rows 8 and row0 2, but the call has 6 rows");
        f.m.opts.seq_len = 4;
        DSK_TEST_OK(dsk_moe_set_loss_span(&f.m, NULL, 0, 6));
        DSK_TEST_STATUS(dsk_moe_forward(&f.m, NULL, &f.ty, &f.tx, NULL), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("6 tokens (the loss span's total_rows) are not whole sequences of seq_len 4");
        f.m.opts.seq_len = 3;
        { /* a group of one rank whose rows are not all of the span; a group on the other backend */
            int ok = 0, port = 0;
            dsk_comm one, other;
            memset(&one, 0, sizeof one);
            if (dsk_comm_free_port("127.0.0.1", &port) == DSK_OK) one = sp_connect(0, 1, port, &ok);
            DSK_TEST_EXPECT(ok, "a one-rank communicator: %s", dsk_last_error());
            if (ok) {
                DSK_TEST_OK(dsk_moe_set_loss_span(&f.m, &one, 3, 9));
                DSK_TEST_STATUS(dsk_moe_forward(&f.m, NULL, &f.ty, &f.tx, NULL), DSK_ERR_ARG);
                DSK_TEST_ERROR_MENTIONS("dsk_moe_forward: layer \"moe\": the loss span's group holds 6 rows in all "
                                        "over its 1 rank(s), not total_rows 9 (this rank rows [3, 9)); nothing was "
                                        "computed");
                other = one;
                other.world_size = 2;
                other.backend = DSK_COMM_NCCL;
                DSK_TEST_STATUS(dsk_moe_set_loss_span(&f.m, &other, 0, 12), DSK_ERR_UNSUPPORTED);
                DSK_TEST_ERROR_MENTIONS("dsk_moe_set_loss_span: layer \"moe\" is on the CPU: the group must use the "
                                        "host backend");
                DSK_TEST_OK(dsk_moe_set_loss_span(&f.m, NULL, 0, 0));
                dsk_comm_free(&one);
            }
        }
        /* the refused forwards left no forward and counted nothing */
        DSK_TEST_STATUS(dsk_moe_backward(&f.m, NULL, &dx, &dy, 1.0f), DSK_ERR_STATE);
        /* a span of the call's own rows, then none: the bits of the plain call */
        for (int reset = 0; reset < 2; reset++) {
            DSK_TEST_OK(reset ? dsk_moe_set_loss_span(&f.m, NULL, 0, 0) : dsk_moe_set_loss_span(&f.m, NULL, 0, 6));
            DSK_TEST_OK(dsk_moe_zero_grad(&f.m, NULL));
            dsk_tensor_fill(NULL, &dx, 0.0);
            if (run_forward(&f, &s1)) {
                DSK_TEST_OK(dsk_moe_backward(&f.m, NULL, &dx, &dy, 1.0f));
                DSK_TEST_EXPECT(s1.aux_loss == s0.aux_loss && s1.seq_aux_loss == s0.seq_aux_loss &&
                                    s1.z_loss == s0.z_loss,
                                "span %s: losses differ from the plain call's", reset ? "reset" : "of the call's rows");
                DSK_TEST_SAME_BYTES(f.own.grads.data, g0, sizeof(float) * (size_t)dsk_tensor_numel(&f.own.grads),
                                    reset ? "gradients, span reset" : "gradients, span of the call's rows");
                DSK_TEST_SAME_BYTES(dx.data, dx0, sizeof(float) * 48,
                                    reset ? "dx, span reset"
                                          : "dx, span of the "
                                            "call's rows");
            }
        }
        free(g0);
        free(dx0);
        dsk_tensor_free(NULL, &dx);
        dsk_tensor_free(NULL, &dy);
    }
    free_fixture(&f);
}

/* ---------------------------------------------------------------- non-finite input */

/* The routing function on NaN/Inf logits or biases: flags the token, selects experts 0..K-1
   (valid indices, no -1), NaN weights; on finite logits it returns 0 and ranks as before. */
static void test_route_token_nonfinite(void) {
    const float bad_vals[3] = {NAN, INFINITY, -INFINITY};
    for (int sig = 0; sig < 2; sig++)
        for (int grp = 0; grp < 2; grp++) {
            dsk_moe_router r;
            float u[12], b[12], prob[12], scr[12 + 4], gate[3];
            int32_t sel[3];
            memset(&r, 0, sizeof r);
            r.n_experts = 12; r.top_k = 3; r.score = sig ? DSK_MOE_SIGMOID : DSK_MOE_SOFTMAX;
            r.norm = 1; r.scale = 1.5f;
            r.n_group = grp ? 4 : 1; r.topk_group = grp ? 2 : 1;
            dsk_test_fill_f32(u, 12, -2, 2);
            dsk_test_fill_f32(b, 12, -0.1, 0.1);
            DSK_TEST_EXPECT(dsk_moe_route_token(&r, u, b, prob, scr, sel, gate) == 0, "finite logits flagged");
            for (int k = 0; k < 3; k++)
                DSK_TEST_EXPECT(sel[k] >= 0 && sel[k] < 12 && gate[k] == gate[k], "finite: slot %d", k);
            for (int v = 0; v < 3; v++)
                for (int where = 0; where < 2; where++) { /* a logit, or a bias value */
                    float u2[12], b2[12];
                    int j = (int)dsk_test_rand_int(12);
                    memcpy(u2, u, sizeof u2); memcpy(b2, b, sizeof b2);
                    if (where) b2[j] = bad_vals[v]; else u2[j] = bad_vals[v];
                    for (int k = 0; k < 3; k++) { sel[k] = -7; gate[k] = 0.5f; }
                    DSK_TEST_EXPECT(dsk_moe_route_token(&r, u2, b2, prob, scr, sel, gate) == 1,
                                    "%s %g at %d not flagged (%s, %d groups)", where ? "bias" : "logit",
                                    (double)bad_vals[v], j, sig ? "sigmoid" : "softmax", r.n_group);
                    for (int k = 0; k < 3; k++)
                        DSK_TEST_EXPECT(sel[k] == k && gate[k] != gate[k], "slot %d: expert %d gate %g", k, sel[k],
                                        (double)gate[k]);
                }
        }
}

/* A layer forward on NaN/Inf input fails with DSK_ERR_NONFINITE naming the first bad token,
   writes no y, zero stats, counts no loads, leaves no forward; the layer works afterwards. */
static void check_forward_nonfinite(const char *what, int sig, double cf, int kind) {
    cfg c = base_cfg(7, 8, 6, 2, 5);
    fixture f;
    dsk_moe_stats st;
    dsk_test_begin("non-finite %s, %s%s", what, sig ? "sigmoid" : "softmax", cf > 0 ? ", capacity" : "");
    c.sigmoid = sig; c.norm = sig; c.cf = cf; c.aux = 0.01; c.z = 0.01;
    if (c.sigmoid) { c.n_group = 3; c.topk_group = 2; }
    if (setup(&f, &c, DSK_F32, 0.02) && run_forward(&f, &st)) {
        int64_t n = (int64_t)c.T * c.D, loads[6];
        float *x = (float *)f.tx.data, *wr = (float *)f.m.router->value.data, *bias = (float *)f.m.bias->value.data;
        float saved_x = x[5 * c.D + 3], saved_w = wr[4 * c.D + 1], saved_b = bias[2], b0[6], want[6];
        dsk_tensor dx;
        int64_t shp[2] = {c.T, c.D};
        double mean = 0;
        char needle[64];
        for (int e = 0; e < 6; e++) loads[e] = st.tokens_per_expert[e];
        memcpy(b0, bias, sizeof b0);
        if (kind == 0) x[5 * c.D + 3] = NAN;           /* token 5 */
        else if (kind == 1) x[5 * c.D + 3] = INFINITY; /* token 5 (softmax: NaN inside) */
        else if (kind == 2) wr[4 * c.D + 1] = NAN;     /* every token */
        else bias[2] = INFINITY;                       /* every token */
        for (int64_t i = 0; i < n; i++) ((float *)f.ty.data)[i] = 1234.5f;
        memset(&st, 0x5a, sizeof st);
        DSK_TEST_STATUS(dsk_moe_forward(&f.m, NULL, &f.ty, &f.tx, &st), DSK_ERR_NONFINITE);
        snprintf(needle, sizeof needle, "token %d of 7", kind < 2 ? 5 : 0);
        DSK_TEST_ERROR_MENTIONS(needle);
        DSK_TEST_ERROR_MENTIONS(kind < 2 ? "1 such tokens" : "7 such tokens");
        {
            int wrote = 0;
            for (int64_t i = 0; i < n; i++) wrote += ((float *)f.ty.data)[i] != 1234.5f;
            DSK_TEST_EXPECT(wrote == 0, "%d elements of y written", wrote);
        }
        DSK_TEST_EXPECT(st.tokens == 0 && st.loss == 0 && st.tokens_per_expert == NULL, "stats not zeroed");
        dsk_tensor_alloc(NULL, &dx, DSK_F32, 2, shp);
        DSK_TEST_STATUS(dsk_moe_backward(&f.m, NULL, &dx, &f.ty, 1.0f), DSK_ERR_STATE);
        dsk_tensor_free(NULL, &dx);
        /* only the clean forward's loads count */
        x[5 * c.D + 3] = saved_x; wr[4 * c.D + 1] = saved_w; bias[2] = saved_b;
        for (int e = 0; e < 6; e++) mean += (double)loads[e] / 6;
        for (int e = 0; e < 6; e++) want[e] = b0[e] + 1e-3f * (float)((mean > loads[e]) - (mean < loads[e]));
        DSK_TEST_OK(dsk_moe_update_bias(&f.m, NULL, NULL));
        DSK_TEST_SAME_BYTES(bias, want, sizeof want, "bias updated from the clean forward's loads only");
        /* repaired input: the layer runs again and matches the reference */
        memcpy(bias, b0, sizeof b0);
        if (run_forward(&f, &st)) DSK_TEST_CLOSE(f.yf, f.y, n, 1e-4, 1e-5, "y after the repair");
    }
    free_fixture(&f);
    dsk_test_end();
}

static void test_forward_nonfinite(void) {
    static const char *kinds[4] = {"NaN in x", "+Inf in x", "NaN in a router weight", "+Inf in the bias"};
    for (int sig = 0; sig < 2; sig++)
        for (int kind = 0; kind < 4; kind++) check_forward_nonfinite(kinds[kind], sig, kind == 1 ? 0.5 : 0.0, kind);
}

/* An empty batch is valid: nothing routed, zero losses, gradients untouched. */
static void test_empty_batch(void) {
    dsk_moe m;
    owned own;
    dsk_moe_opts o;
    dsk_moe_stats st;
    dsk_tensor x, y;
    int64_t shp[2] = {0, 8};
    memset(&o, 0, sizeof o);
    o.d_model = 8; o.n_routed = 4; o.top_k = 2; o.d_expert = 4; o.n_shared = 1;
    o.aux_alpha = 0.1f; o.seq_aux_alpha = 0.1f; o.z_beta = 0.1f; o.capacity_factor = 1.0f;
    DSK_TEST_OK(make_layer(&m, &own, &o));
    dsk_tensor_alloc(NULL, &x, DSK_F32, 2, shp);
    dsk_tensor_alloc(NULL, &y, DSK_F32, 2, shp);
    DSK_TEST_OK(dsk_moe_forward(&m, NULL, &y, &x, &st));
    DSK_TEST_EXPECT(st.tokens == 0 && st.slots == 0 && st.dropped == 0 && st.loss == 0, "tokens %lld loss %g", (long long)st.tokens, st.loss);
    DSK_TEST_OK(dsk_moe_backward(&m, NULL, &x, &y, 1.0f));
    {
        int64_t n = dsk_tensor_numel(&own.grads);
        double *want = (double *)calloc((size_t)n, sizeof(double));
        DSK_TEST_CLOSE((const float *)own.grads.data, want, n, 0, 0, "gradients after an empty batch");
        free(want);
    }
    dsk_tensor_free(NULL, &x); dsk_tensor_free(NULL, &y);
    drop_layer(&m, &own);
}

/* ---------------------------------------------------------------- configuration in checkpoints */

/* dsk_moe_config_check of a layer made from o against the pairs of a layer made from base. */
static dsk_status config_against(const dsk_moe_opts *base, const dsk_moe_opts *o, int drop_key) {
    dsk_moe a, b;
    dsk_moe_config c;
    const char *keys[DSK_MOE_CONFIG_MAX], *values[DSK_MOE_CONFIG_MAX];
    dsk_status s;
    int n = 0;
    if (dsk_moe_init(&a, NULL, base) != DSK_OK || dsk_moe_init(&b, NULL, o) != DSK_OK ||
        dsk_moe_config_get(&a, "moe", &c) != DSK_OK)
        return dsk_set_error(DSK_ERR_STATE, "config_against: setup: %s", dsk_last_error());
    for (int i = 0; i < c.n; i++)
        if (i != drop_key) { keys[n] = c.key[i]; values[n] = c.value[i]; n++; }
    s = dsk_moe_config_check(&b, "moe", keys, values, n);
    dsk_moe_free(&a, NULL);
    dsk_moe_free(&b, NULL);
    return s;
}

/* The configuration written for a checkpoint: every option, resolved (a default and its explicit
   value agree); a layer that differs in one option fails naming it with both values; a partial
   set fails naming the missing key; no pairs at all (an older checkpoint) pass. */
static void test_config_check(void) {
    dsk_moe_opts base, o;
    dsk_moe m;
    dsk_moe_config c;
    memset(&base, 0, sizeof base);
    base.d_model = 16; base.n_routed = 8; base.top_k = 2; base.d_expert = 8; base.n_shared = 1;
    base.score = DSK_MOE_SIGMOID; base.routed_scale = 2.5f; base.n_group = 4; base.topk_group = 2;
    DSK_TEST_OK(dsk_moe_init(&m, NULL, &base));
    DSK_TEST_OK(dsk_moe_config_get(&m, "moe", &c));
    DSK_TEST_EXPECT(c.n == 22, "%d pairs", c.n);
    for (int i = 0; i < c.n; i++) {
        if (!strcmp(c.key[i], "moe.top_k")) DSK_TEST_EXPECT(!strcmp(c.value[i], "2"), "top_k \"%s\"", c.value[i]);
        if (!strcmp(c.key[i], "moe.routed_scale"))
            DSK_TEST_EXPECT(!strcmp(c.value[i], "2.5"), "scale \"%s\"", c.value[i]);
        if (!strcmp(c.key[i], "moe.norm")) DSK_TEST_EXPECT(!strcmp(c.value[i], "on"), "norm \"%s\"", c.value[i]);
    }
    DSK_TEST_OK(dsk_moe_config_get(&m, NULL, &c));
    DSK_TEST_EXPECT(!strcmp(c.key[0], "moe.d_model"), "default prefix: key \"%s\"", c.key[0]);
    o = base; o.norm = DSK_MOE_NORM_ON; o.bias_rate = 1e-3f; /* the defaults, explicit */
    DSK_TEST_OK(config_against(&base, &o, -1));
    o = base; o.top_k = 3;
    DSK_TEST_STATUS(config_against(&base, &o, -1), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_moe_config_check: layer \"moe\": moe.top_k: the checkpoint has 2, this layer 3");
    o = base; o.n_shared = 0;
    DSK_TEST_STATUS(config_against(&base, &o, -1), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("moe.n_shared: the checkpoint has 1, this layer 0");
    o = base; o.routed_scale = 0;
    DSK_TEST_STATUS(config_against(&base, &o, -1), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("moe.routed_scale: the checkpoint has 2.5, this layer 1");
    o = base; o.score = DSK_MOE_SOFTMAX; o.norm = DSK_MOE_NORM_ON;
    DSK_TEST_STATUS(config_against(&base, &o, -1), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("moe.score: the checkpoint has sigmoid, this layer softmax");
    o = base; o.group_rule = DSK_MOE_GROUP_MAX;
    DSK_TEST_STATUS(config_against(&base, &o, -1), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("moe.group_rule: the checkpoint has deepseek_v3, this layer max");
    DSK_TEST_STATUS(config_against(&base, &base, 5), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("the checkpoint holds no moe.d_shared (but other options of the layer)");
    DSK_TEST_OK(dsk_moe_config_check(&m, "moe", NULL, NULL, 0));
    DSK_TEST_STATUS(dsk_moe_config_check(&m, "moe", NULL, NULL, 3), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("3 pairs (keys NULL, values NULL)");
    DSK_TEST_STATUS(dsk_moe_config_get(&m, "moe", NULL), DSK_ERR_ARG);
    DSK_TEST_STATUS(dsk_moe_config_get(NULL, "moe", &c), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_moe_config_get: layer is NULL");
    DSK_TEST_STATUS(dsk_moe_config_check(NULL, "moe", NULL, NULL, 0), DSK_ERR_ARG);
    dsk_moe_free(&m, NULL);
}

/* ---------------------------------------------------------------- mixed-precision statistics under EP */

/* dsk_moe_amp_unscale over P forked ranks (host backend): two replicated gradients, equal on
   every rank, and two expert-sharded ones, each rank's own, all holding values v * scale. Three
   cases: clean; an Inf in rank 1's sharded gradient; a NaN in the replicated one (on every
   rank). Each rank returns its scaler's stats and whether its gradients came back to v. */
enum { AJ_REP = 37, AJ_SH = 23, AJ_CASES = 3 };

static float aj_value(uint64_t seed, int64_t i) { return 2.0f * dsk_rng_uniform_at(seed, 0, (uint64_t)i) - 1.0f; }
static uint64_t aj_seed(int sharded, int rank, int i) {
    return sharded ? 200 + 10 * (uint64_t)rank + (uint64_t)i : 100 + (uint64_t)i;
}

static int aj_rank_main(int rank, int n, int port, double *out) {
    dsk_comm c;
    dsk_amp_scaler sc;
    dsk_amp_scaler_opts so;
    dsk_tensor g[4];
    float scale;
    if (host_comm(&c, rank, n, port, NULL) != DSK_OK) return 2;
    memset(&so, 0, sizeof so);
    if (dsk_amp_scaler_init(&sc, NULL, &so) != DSK_OK || dsk_amp_scale_get(&sc, NULL, &scale) != DSK_OK) return 3;
    for (int i = 0; i < 4; i++) {
        int64_t len = i < 2 ? AJ_REP : AJ_SH;
        if (dsk_tensor_alloc(NULL, &g[i], DSK_F32, 1, &len) != DSK_OK) return 4;
    }
    for (int cs = 0; cs < AJ_CASES; cs++) {
        dsk_tensor *rep[2] = {&g[0], &g[1]}, *sh[2] = {&g[2], &g[3]};
        dsk_amp_stats st;
        int back = 1;
        for (int i = 0; i < 4; i++)
            for (int64_t e = 0; e < dsk_tensor_numel(&g[i]); e++)
                ((float *)g[i].data)[e] = aj_value(aj_seed(i >= 2, rank, i % 2), e) * scale;
        if (cs == 1 && rank == 1) ((float *)g[3].data)[5] = INFINITY;
        if (cs == 2) ((float *)g[0].data)[7] = NAN;
        if (dsk_moe_amp_unscale(&sc, NULL, &c, rep, 2, sh, 2) != DSK_OK) return 10 + cs;
        if (dsk_amp_stats_get(&sc, NULL, &st) != DSK_OK) return 20 + cs;
        for (int i = 0; i < 4 && cs == 0; i++)
            for (int64_t e = 0; e < dsk_tensor_numel(&g[i]); e++)
                back &= ((float *)g[i].data)[e] == aj_value(aj_seed(i >= 2, rank, i % 2), e);
        out[(cs * n + rank) * 3 + 0] = st.found_inf;
        out[(cs * n + rank) * 3 + 1] = st.sumsq;
        out[(cs * n + rank) * 3 + 2] = back;
    }
    for (int i = 0; i < 4; i++) dsk_tensor_free(NULL, &g[i]);
    dsk_amp_scaler_free(&sc, NULL);
    dsk_comm_free(&c);
    return 0;
}

typedef struct aj_job { int n, port_ok, status[8]; double *out; } aj_job;

static int aj_rank(void *job, int r, int port) {
    return aj_rank_main(r, ((aj_job *)job)->n, port, ((aj_job *)job)->out);
}

static void aj_run(aj_job *j, int n) {
    memset(j, 0, sizeof *j);
    j->n = n;
    j->out = (double *)mmap(NULL, sizeof(double) * 3 * AJ_CASES * n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                            -1, 0);
    for (int i = 0; i < 3 * AJ_CASES * n; i++) j->out[i] = NAN; /* poisoned */
    j->port_ok = run_ranks("rank", n, aj_rank, j, j->status);
}

/* Against float64: sumsq = the replicated gradients once + every rank's sharded ones, on every
   rank; found_inf counts a rank's Inf once and a NaN of the replicated gradients once (not once
   per rank, as one all-reduce of every rank's stats over the world would). */
static void aj_check(aj_job *j) {
    int n = j->n;
    double want = 0;
    dsk_test_begin("dsk_moe_amp_unscale over %d host ranks: the replicated gradients count once, the expert-sharded "
                   "ones once per rank", n);
    if (!j->port_ok) dsk_test_fail_at(__FILE__, __LINE__, "no free port: %s", dsk_last_error());
    for (int r = 0; r < n; r++) DSK_TEST_EXPECT(j->status[r] == 0, "rank %d exit status %d", r, j->status[r]);
    for (int i = 0; i < 2; i++)
        for (int64_t e = 0; e < AJ_REP; e++)
            want += (double)aj_value(aj_seed(0, 0, i), e) * aj_value(aj_seed(0, 0, i), e);
    for (int r = 0; r < n; r++)
        for (int i = 0; i < 2; i++)
            for (int64_t e = 0; e < AJ_SH; e++)
                want += (double)aj_value(aj_seed(1, r, i), e) * aj_value(aj_seed(1, r, i), e);
    for (int r = 0; r < n; r++) {
        const double *c0 = j->out + (0 * n + r) * 3, *c1 = j->out + (1 * n + r) * 3, *c2 = j->out + (2 * n + r) * 3;
        DSK_TEST_CLOSE64(&c0[1], &want, 1, 1e-12, 0, "sumsq");
        DSK_TEST_EXPECT(c0[0] == 0 && c0[2] == 1, "rank %d clean case: found_inf %g, gradients unscaled %g", r, c0[0],
                        c0[2]);
        DSK_TEST_EXPECT(c1[0] == 1, "rank %d: an Inf in rank 1's expert gradient: found_inf %g, want 1", r, c1[0]);
        DSK_TEST_EXPECT(c2[0] == 1, "rank %d: a NaN in the replicated gradient: found_inf %g, want 1 (not %d)", r,
                        c2[0], n);
    }
    munmap(j->out, sizeof(double) * 3 * AJ_CASES * n);
    dsk_test_end();
}

/* Bad arguments of dsk_moe_amp_unscale fail naming them. */
static void test_amp_unscale_bad(void) {
    dsk_amp_scaler sc;
    dsk_amp_scaler_opts so;
    memset(&so, 0, sizeof so);
    DSK_TEST_OK(dsk_amp_scaler_init(&sc, NULL, &so));
    DSK_TEST_STATUS(dsk_moe_amp_unscale(NULL, NULL, NULL, NULL, 0, NULL, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_moe_amp_unscale: scaler is NULL");
    DSK_TEST_STATUS(dsk_moe_amp_unscale(&sc, NULL, NULL, NULL, 2, NULL, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("2 replicated and 0 expert-sharded gradients (lists NULL, NULL)");
    DSK_TEST_STATUS(dsk_moe_amp_unscale(&sc, NULL, NULL, NULL, 0, NULL, -1), DSK_ERR_ARG);
    DSK_TEST_OK(dsk_moe_amp_unscale(&sc, NULL, NULL, NULL, 0, NULL, 0));
    dsk_amp_scaler_free(&sc, NULL);
}

/* ---------------------------------------------------------------- FP8 experts */

/* opts.expert_gemm = DSK_MOE_GEMM_FP8 against a float64 evaluation of the same quantised operands.
   The reference quantises with dsk_amp's quantisers what the layer quantises, from the same f32
   values: the layer's inputs, and its intermediates (h1, h3, silu(h1) h3, da, dh1, dh3), which it
   computes by the specified f32 arithmetic (x8_f32: per 128-wide chunk an f32 dot in k order, then
   fmaf(dot, sa sb, acc); dsk_swiglu_f and dsk_swiglu_grad_f), so every operand's codes and scales
   are the layer's. The outputs (y, dx, every expert's and shared expert's gradient) are computed
   from those operands in double and the layer's must lie within the chunk order's bound
   (x8_gamma: 128 products in f32, one fmaf and one scale product per chunk, then the f32 sums of
   the combine) of them. The router weights are 0 and the routing is replayed (no ties to avoid):
   every gate is 1/E exactly and the router adds nothing to dx, which is the experts' alone. */
enum { X8_D = 160, X8_E = 4, X8_K = 2, X8_F = 136, X8_FS = 136 };

/* An operand as the FP8 GEMMs read it: rows of k codes, each row's scale per 128-wide chunk. */
typedef struct x8_op {
    int64_t rows, k, nch;
    uint8_t *q;
    float *s; /* (rows, nch) */
} x8_op;

static void x8_op_free(x8_op *o) {
    free(o->q);
    free(o->s);
    memset(o, 0, sizeof *o);
}

/* v (n, c) f32 quantised by dsk_amp in 1x128 tiles or 128x128 blocks (blk), as it is (t 0: the
   operand's rows are v's) or transposed (t 1: the operand's rows are v's columns, k runs along v's
   rows). */
static x8_op x8_quant(const float *v, int64_t n, int64_t c, int t, int blk) {
    x8_op o;
    int64_t r = t ? c : n, k = t ? n : c, br = blk ? 128 : 1, sr = (r + br - 1) / br, sh[2] = {n, c}, qsh[2] = {r, k};
    int64_t ssh[2] = {sr, (k + 127) / 128};
    float *s = (float *)malloc(sizeof(float) * (size_t)(sr * ssh[1] + 1));
    dsk_tensor tv, tq, ts;
    o.rows = r;
    o.k = k;
    o.nch = ssh[1];
    o.q = (uint8_t *)malloc((size_t)(r * k + 1));
    o.s = (float *)malloc(sizeof(float) * (size_t)(r * o.nch + 1));
    dsk_tensor_wrap(&tv, (void *)v, DSK_F32, dsk_cpu(), 2, sh);
    dsk_tensor_wrap(&tq, o.q, DSK_E4M3, dsk_cpu(), 2, qsh);
    dsk_tensor_wrap(&ts, s, DSK_F32, dsk_cpu(), 2, ssh);
    if (r * k > 0)
        DSK_TEST_OK(t ? dsk_amp_fp8_block_quantize_t(NULL, &tq, &ts, &tv, (int)br, 128, 0)
                      : dsk_amp_fp8_block_quantize(NULL, &tq, &ts, &tv, (int)br, 128, 0));
    for (int64_t i = 0; i < r; i++)
        for (int64_t ch = 0; ch < o.nch; ch++) o.s[i * o.nch + ch] = s[(i / br) * o.nch + ch];
    free(s);
    return o;
}

/* Operand row i dequantised the way the layer's backward does (f32 code times scale, rounded to
   f32), as an f32 row of v's layout: out (k). */
static void x8_dequant_row(const x8_op *o, int64_t i, float *out) {
    for (int64_t j = 0; j < o->k; j++) out[j] = dsk_e4m3_to_f32(o->q[i * o->k + j]) * o->s[i * o->nch + j / 128];
}

/* The layer's f32 value of sum over k in [k0, k1) of A[i,k] B[j,k] (chunks on the grid of 128). */
static float x8_f32(const x8_op *A, int64_t i, const x8_op *B, int64_t j, int64_t k0, int64_t k1) {
    float acc = 0.0f;
    for (int64_t c = k0 / 128; c * 128 < k1; c++) {
        float dot = 0.0f;
        for (int64_t k = c * 128 > k0 ? c * 128 : k0; k < (c + 1) * 128 && k < k1; k++)
            dot += dsk_e4m3_to_f32(A->q[i * A->k + k]) * dsk_e4m3_to_f32(B->q[j * B->k + k]);
        acc = fmaf(dot, A->s[i * A->nch + c] * B->s[j * B->nch + c], acc);
    }
    return acc;
}

/* The same sum in double from the dequantised operands; *S gets sum |A[i,k]| |B[j,k]|. */
static double x8_f64(const x8_op *A, int64_t i, const x8_op *B, int64_t j, int64_t k0, int64_t k1, double *S) {
    double acc = 0.0, s = 0.0;
    for (int64_t k = k0; k < k1; k++) {
        double a = (double)dsk_e4m3_to_f32(A->q[i * A->k + k]) * A->s[i * A->nch + k / 128];
        double b = (double)dsk_e4m3_to_f32(B->q[j * B->k + k]) * B->s[j * B->nch + k / 128];
        acc += a * b;
        s += fabs(a * b);
    }
    *S = s;
    return acc;
}

/* The bound on |f32 - double| of such a sum over n elements, per unit of S: each chunk's dot in f32
   (at most 128 roundings), its scale product and fmaf, the chunks' sum, with a factor 2 of room. */
static double x8_gamma(int64_t n) { return 2.0 * (double)(128 + 2 * ((n + 127) / 128 + 1) + 2) * 0x1p-24; }

/* One SwiGLU's operands and results in the reference: x rows (n, D) with their expert's weights. */
typedef struct x8_ref {
    int64_t n;      /* rows */
    int64_t Fh;     /* hidden width */
    const int *seg; /* (G + 1) row segments, G experts (1 for the shared experts) */
    int G;
    x8_op xq, w1[X8_E], w2[X8_E], w3[X8_E], w1t[X8_E], w2t[X8_E], w3t[X8_E], aq;
    float *h1, *h3;         /* (n, Fh) the layer's f32 values */
    double *o, *oS;         /* (n, D) the output in double and its S */
    double *dx, *dxtol;     /* (n, D) the input gradient and its bound */
    double *g[3], *gtol[3]; /* the weight gradients w1 (G, Fh, D), w2 (G, D, Fh), w3 and their bounds */
} x8_ref;

/* The forward: h1, h3 in f32 as the layer computes them, a = swiglu quantised, o in double. */
static void x8_forward(x8_ref *r) {
    int64_t n = r->n, Fh = r->Fh;
    float *a = (float *)calloc((size_t)(n * Fh + 1), sizeof(float));
    for (int g = 0; g < r->G; g++)
        for (int64_t i = r->seg[g]; i < r->seg[g + 1]; i++)
            for (int64_t f = 0; f < Fh; f++) {
                r->h1[i * Fh + f] = x8_f32(&r->xq, i, &r->w1[g], f, 0, X8_D);
                r->h3[i * Fh + f] = x8_f32(&r->xq, i, &r->w3[g], f, 0, X8_D);
                a[i * Fh + f] = dsk_swiglu_f(r->h1[i * Fh + f], r->h3[i * Fh + f]);
            }
    r->aq = x8_quant(a, n, Fh, 0, 0);
    for (int g = 0; g < r->G; g++)
        for (int64_t i = r->seg[g]; i < r->seg[g + 1]; i++)
            for (int64_t d = 0; d < X8_D; d++)
                r->o[i * X8_D + d] = x8_f64(&r->aq, i, &r->w2[g], d, 0, Fh, &r->oS[i * X8_D + d]);
    free(a);
}

/* gw[g] (M, N) = sum over the rows of segment g of At[:, rows] Bt[:, rows] (operands along the rows). */
static void x8_wgrad(const x8_ref *r, const x8_op *At, const x8_op *Bt, double *gw, double *tol) {
    int64_t M = At->rows, N = Bt->rows;
    for (int g = 0; g < r->G; g++)
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) {
                double S;
                gw[(g * M + i) * N + j] = x8_f64(At, i, Bt, j, r->seg[g], r->seg[g + 1], &S);
                tol[(g * M + i) * N + j] = x8_gamma(r->n) * S;
            }
}

/* The backward from dy rows (n, D) f32: the weight gradients and dx in double with their bounds. */
static void x8_backward(x8_ref *r, const float *dy) {
    int64_t n = r->n, Fh = r->Fh;
    float *da = (float *)calloc((size_t)(n * Fh + 1), sizeof(float)), *dh1 = (float *)calloc((size_t)(n * Fh + 1), 4);
    float *dh3 = (float *)calloc((size_t)(n * Fh + 1), 4),
          *deq = (float *)calloc((size_t)(n * (Fh > X8_D ? Fh : X8_D) + 1), 4);
    x8_op gq = x8_quant(dy, n, X8_D, 0, 0), gt = x8_quant(dy, n, X8_D, 1, 0), at, xt, h1q, h1t, h3q, h3t;
    for (int64_t i = 0; i < n; i++) x8_dequant_row(&r->aq, i, deq + i * Fh);
    at = x8_quant(deq, n, Fh, 1, 0);
    x8_wgrad(r, &gt, &at, r->g[1], r->gtol[1]);
    for (int g = 0; g < r->G; g++)
        for (int64_t i = r->seg[g]; i < r->seg[g + 1]; i++)
            for (int64_t f = 0; f < Fh; f++) {
                int64_t e = i * Fh + f;
                da[e] = x8_f32(&gq, i, &r->w2t[g], f, 0, X8_D);
                dsk_swiglu_grad_f(r->h1[e], r->h3[e], da[e], &dh1[e], &dh3[e]);
            }
    for (int64_t i = 0; i < n; i++) x8_dequant_row(&r->xq, i, deq + i * X8_D);
    xt = x8_quant(deq, n, X8_D, 1, 0);
    h1q = x8_quant(dh1, n, Fh, 0, 0);
    h1t = x8_quant(dh1, n, Fh, 1, 0);
    h3q = x8_quant(dh3, n, Fh, 0, 0);
    h3t = x8_quant(dh3, n, Fh, 1, 0);
    x8_wgrad(r, &h1t, &xt, r->g[0], r->gtol[0]);
    x8_wgrad(r, &h3t, &xt, r->g[2], r->gtol[2]);
    for (int g = 0; g < r->G; g++)
        for (int64_t i = r->seg[g]; i < r->seg[g + 1]; i++)
            for (int64_t d = 0; d < X8_D; d++) {
                double S1, S3,
                    v = x8_f64(&h1q, i, &r->w1t[g], d, 0, Fh, &S1) + x8_f64(&h3q, i, &r->w3t[g], d, 0, Fh, &S3);
                r->dx[i * X8_D + d] = v;
                r->dxtol[i * X8_D + d] = x8_gamma(Fh) * (S1 + S3) + 0x1p-23 * fabs(v);
            }
    x8_op_free(&gq);
    x8_op_free(&gt);
    x8_op_free(&at);
    x8_op_free(&xt);
    x8_op_free(&h1q);
    x8_op_free(&h1t);
    x8_op_free(&h3q);
    x8_op_free(&h3t);
    free(da);
    free(dh1);
    free(dh3);
    free(deq);
}

/* The reference of one SwiGLU over n rows x (n, D) f32 in G segments, weights w1 w3 (G, Fh, D) and
   w2 (G, D, Fh) f32. */
static void x8_ref_init(x8_ref *r, const float *x, int64_t n, int64_t Fh, const int *seg, int G, const float *w1,
                        const float *w2, const float *w3) {
    memset(r, 0, sizeof *r);
    r->n = n;
    r->Fh = Fh;
    r->seg = seg;
    r->G = G;
    r->xq = x8_quant(x, n, X8_D, 0, 0);
    for (int g = 0; g < G; g++) {
        const float *a = w1 + g * Fh * X8_D, *b = w2 + g * Fh * X8_D, *c = w3 + g * Fh * X8_D;
        r->w1[g] = x8_quant(a, Fh, X8_D, 0, 1);
        r->w1t[g] = x8_quant(a, Fh, X8_D, 1, 1);
        r->w2[g] = x8_quant(b, X8_D, Fh, 0, 1);
        r->w2t[g] = x8_quant(b, X8_D, Fh, 1, 1);
        r->w3[g] = x8_quant(c, Fh, X8_D, 0, 1);
        r->w3t[g] = x8_quant(c, Fh, X8_D, 1, 1);
    }
    r->h1 = (float *)calloc((size_t)(n * Fh + 1), sizeof(float));
    r->h3 = (float *)calloc((size_t)(n * Fh + 1), sizeof(float));
    r->o = (double *)calloc((size_t)(n * X8_D + 1), sizeof(double));
    r->oS = (double *)calloc((size_t)(n * X8_D + 1), sizeof(double));
    r->dx = (double *)calloc((size_t)(n * X8_D + 1), sizeof(double));
    r->dxtol = (double *)calloc((size_t)(n * X8_D + 1), sizeof(double));
    for (int p = 0; p < 3; p++) {
        r->g[p] = (double *)calloc((size_t)(G * Fh * X8_D), sizeof(double));
        r->gtol[p] = (double *)calloc((size_t)(G * Fh * X8_D), sizeof(double));
    }
}

static void x8_ref_free(x8_ref *r) {
    x8_op_free(&r->xq);
    x8_op_free(&r->aq);
    for (int g = 0; g < r->G; g++) {
        x8_op_free(&r->w1[g]);
        x8_op_free(&r->w2[g]);
        x8_op_free(&r->w3[g]);
        x8_op_free(&r->w1t[g]);
        x8_op_free(&r->w2t[g]);
        x8_op_free(&r->w3t[g]);
    }
    free(r->h1);
    free(r->h3);
    free(r->o);
    free(r->oS);
    free(r->dx);
    free(r->dxtol);
    for (int p = 0; p < 3; p++) {
        free(r->g[p]);
        free(r->gtol[p]);
    }
}

/* got (f32, n) against want within tol elementwise: the count outside, the worst excess on stderr. */
static int x8_outside(const float *got, const double *want, const double *tol, int64_t n, const char *what) {
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - want[i]);
        if (!(d <= tol[i])) {
            if (!bad)
                fprintf(stderr, "  %s[%lld]: %.9g vs %.9g (bound %.3g)\n", what, (long long)i, got[i], want[i], tol[i]);
            bad++;
        }
    }
    return bad;
}

/* A layer of the FP8 experts (f32, router weights 0, softmax without normalisation: gates 1/E). */
static dsk_moe_opts x8_opts(void) {
    dsk_moe_opts o;
    memset(&o, 0, sizeof o);
    o.d_model = X8_D;
    o.n_routed = X8_E;
    o.top_k = X8_K;
    o.d_expert = X8_F;
    o.n_shared = 1;
    o.d_shared = X8_FS;
    o.norm = DSK_MOE_NORM_OFF;
    o.init_std = 0.05f;
    o.seed = 17;
    o.expert_gemm = DSK_MOE_GEMM_FP8;
    return o;
}

/* Token t's experts: token 0 -> 1, 3; the others -> 2, 3: segments of 0, 1, T - 1 and T rows. */
static void x8_assign(int T, int32_t *sel) {
    for (int t = 0; t < T; t++) {
        sel[t * X8_K] = t == 0 ? 1 : 2;
        sel[t * X8_K + 1] = 3;
    }
}

/* Random f32 values in [lo, hi). */
static void x8_fill(float *p, int64_t n, double lo, double hi) {
    for (int64_t i = 0; i < n; i++) p[i] = (float)dsk_test_rand(lo, hi);
}

/* The layer's y, dx and gradients (forward replaying x8_assign, backward of dy) against the
   reference on T tokens; rows of x scaled by 2^(t mod 7 - 3) so the tiles' scales differ. */
static void test_fp8_experts(void) {
    enum { T = 130, R = 2 * T };
    static const int seg[X8_E + 1] = {0, 0, 1, T, R}, seg1[2] = {0, T};
    dsk_moe m;
    owned own;
    dsk_moe_opts o = x8_opts();
    float *x = (float *)malloc(sizeof(float) * T * X8_D), *dy = (float *)malloc(sizeof(float) * T * X8_D);
    float *xr = (float *)malloc(sizeof(float) * R * X8_D), *dor = (float *)malloc(sizeof(float) * R * X8_D);
    float *y = (float *)malloc(sizeof(float) * T * X8_D), *dx = (float *)malloc(sizeof(float) * T * X8_D);
    double *want = (double *)malloc(sizeof(double) * T * X8_D), *tol = (double *)malloc(sizeof(double) * T * X8_D);
    int32_t sel[T * X8_K];
    int64_t shp[2] = {T, X8_D}, ssh[2] = {T, X8_K}, live0, need;
    dsk_tensor tx, ty, tdx, tdy, tsel;
    x8_ref rr, sr;
    int bad;
    DSK_TEST_OK(make_layer(&m, &own, &o));
    DSK_TEST_OK(dsk_tensor_fill(NULL, &m.router->value, 0.0));
    x8_fill((float *)m.w1->value.data, dsk_tensor_numel(&m.w1->value), -0.5, 0.5);
    x8_fill((float *)m.w2->value.data, dsk_tensor_numel(&m.w2->value), -0.5, 0.5);
    x8_fill((float *)m.w3->value.data, dsk_tensor_numel(&m.w3->value), -0.5, 0.5);
    x8_fill((float *)m.sw1->value.data, dsk_tensor_numel(&m.sw1->value), -0.5, 0.5);
    x8_fill((float *)m.sw2->value.data, dsk_tensor_numel(&m.sw2->value), -0.5, 0.5);
    x8_fill((float *)m.sw3->value.data, dsk_tensor_numel(&m.sw3->value), -0.5, 0.5);
    x8_fill(x, T * X8_D, -1, 1);
    x8_fill(dy, T * X8_D, -1, 1);
    for (int t = 0; t < T; t++)
        for (int d = 0; d < X8_D; d++) x[t * X8_D + d] = ldexpf(x[t * X8_D + d], t % 7 - 3);
    x8_assign(T, sel);
    dsk_tensor_wrap(&tx, x, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&tdy, dy, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&ty, y, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&tdx, dx, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&tsel, sel, DSK_I32, dsk_cpu(), 2, ssh);
    dsk_test_poison_f32(y, T * X8_D);
    memset(dx, 0, sizeof(float) * T * X8_D);
    /* the reservation counts every buffer: the forward and backward then allocate nothing */
    live0 = dsk_tensor_mem_stats(dsk_cpu()).live_bytes;
    DSK_TEST_OK(dsk_moe_reserve(&m, NULL, T));
    DSK_TEST_OK(dsk_moe_reserve_bytes(&m, T, -1, DSK_F32, &need));
    DSK_TEST_EXPECT(dsk_tensor_mem_stats(dsk_cpu()).live_bytes - live0 == need,
                    "dsk_moe_reserve allocated %lld bytes, dsk_moe_reserve_bytes says %lld",
                    (long long)(dsk_tensor_mem_stats(dsk_cpu()).live_bytes - live0), (long long)need);
    live0 = dsk_tensor_mem_stats(dsk_cpu()).live_bytes;
    DSK_TEST_OK(dsk_moe_forward_replay(&m, NULL, &ty, &tx, &tsel, NULL));
    DSK_TEST_OK(dsk_moe_backward(&m, NULL, &tdx, &tdy, 1.0f));
    DSK_TEST_EXPECT(dsk_tensor_mem_stats(dsk_cpu()).live_bytes == live0,
                    "forward + backward grew the workspace by %lld",
                    (long long)(dsk_tensor_mem_stats(dsk_cpu()).live_bytes - live0));
    /* the reference: routed rows expert-major (token 0 at rows 0 and T, token t > 0 at t and T + t) */
    for (int r = 0; r < R; r++) {
        int t = r < T ? r : r - T;
        for (int d = 0; d < X8_D; d++) {
            xr[r * X8_D + d] = x[t * X8_D + d];
            dor[r * X8_D + d] = 0.25f * dy[t * X8_D + d]; /* the gate, 1/E: exact */
        }
    }
    x8_ref_init(&rr, xr, R, X8_F, seg, X8_E, (float *)m.w1->value.data, (float *)m.w2->value.data,
                (float *)m.w3->value.data);
    x8_ref_init(&sr, x, T, X8_FS, seg1, 1, (float *)m.sw1->value.data, (float *)m.sw2->value.data,
                (float *)m.sw3->value.data);
    x8_forward(&rr);
    x8_forward(&sr);
    x8_backward(&rr, dor);
    x8_backward(&sr, dy);
    for (int t = 0; t < T; t++)
        for (int d = 0; d < X8_D; d++) {
            int64_t i = t * X8_D + d, a = (int64_t)t * X8_D + d, b = (int64_t)(T + t) * X8_D + d;
            double oa = 0.25 * rr.o[a], ob = 0.25 * rr.o[b], ys = sr.o[i];
            want[i] = oa + ob + ys;
            tol[i] = 0.25 * x8_gamma(X8_F) * (rr.oS[a] + rr.oS[b]) + x8_gamma(X8_FS) * sr.oS[i] +
                     4 * 0x1p-24 * (fabs(oa) + fabs(ob) + fabs(ys));
        }
    bad = x8_outside(y, want, tol, T * X8_D, "y");
    DSK_TEST_EXPECT(bad == 0, "y: %d of %d elements outside the chunk order's bound", bad, T * X8_D);
    for (int t = 0; t < T; t++)
        for (int d = 0; d < X8_D; d++) {
            int64_t i = t * X8_D + d, a = (int64_t)t * X8_D + d, b = (int64_t)(T + t) * X8_D + d;
            want[i] = rr.dx[a] + rr.dx[b] + sr.dx[i];
            tol[i] = rr.dxtol[a] + rr.dxtol[b] + sr.dxtol[i] +
                     4 * 0x1p-24 * (fabs(rr.dx[a]) + fabs(rr.dx[b]) + fabs(sr.dx[i]));
        }
    bad = x8_outside(dx, want, tol, T * X8_D, "dx");
    DSK_TEST_EXPECT(bad == 0, "dx: %d of %d elements outside the chunk order's bound", bad, T * X8_D);
    {
        dsk_moe_param *ps[6] = {m.w1, m.w2, m.w3, m.sw1, m.sw2, m.sw3};
        for (int p = 0; p < 6; p++) {
            const x8_ref *r = p < 3 ? &rr : &sr;
            int64_t n = dsk_tensor_numel(&ps[p]->grad);
            bad = x8_outside((const float *)ps[p]->grad.data, r->g[p % 3], r->gtol[p % 3], n, ps[p]->name);
            DSK_TEST_EXPECT(bad == 0, "%s gradient: %d of %lld elements outside the chunk order's bound", ps[p]->name,
                            bad, (long long)n);
        }
    }
    x8_ref_free(&rr);
    x8_ref_free(&sr);
    drop_layer(&m, &own);
    free(x);
    free(dy);
    free(xr);
    free(dor);
    free(y);
    free(dx);
    free(want);
    free(tol);
}


/* Non-finite values stay non-finite through the FP8 experts and reach only what reads them: a NaN
   in one weight of expert 2 makes the output of its tokens (1 .. T-1) NaN and leaves token 0's
   finite; a NaN in one element of dy makes that token's dx non-finite (the others' stay finite)
   and the expert gradients that sum it. And an unknown expert_gemm is refused. */
static void test_fp8_experts_nonfinite(void) {
    enum { T = 20 };
    dsk_moe m, bad;
    owned own;
    dsk_moe_opts o = x8_opts();
    float y[T * X8_D], dx[T * X8_D], dy[T * X8_D], x[T * X8_D], w;
    int32_t sel[T * X8_K];
    int64_t shp[2] = {T, X8_D}, ssh[2] = {T, X8_K}, nw2;
    dsk_tensor tx, ty, tdx, tdy, tsel;
    int row0 = 0, rows = 0, other = 0, g2 = 0;
    DSK_TEST_OK(make_layer(&m, &own, &o));
    x8_fill(x, T * X8_D, -1, 1);
    x8_fill(dy, T * X8_D, -1, 1);
    x8_assign(T, sel);
    dsk_tensor_wrap(&tx, x, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&ty, y, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&tdx, dx, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&tdy, dy, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&tsel, sel, DSK_I32, dsk_cpu(), 2, ssh);
    w = ((float *)m.w1->value.data)[(2 * X8_F + 5) * X8_D + 7];
    ((float *)m.w1->value.data)[(2 * X8_F + 5) * X8_D + 7] = NAN;
    dsk_test_poison_f32(y, T * X8_D);
    DSK_TEST_OK(dsk_moe_forward_replay(&m, NULL, &ty, &tx, &tsel, NULL));
    for (int t = 0; t < T; t++)
        for (int d = 0; d < X8_D; d++) {
            row0 += t == 0 && !isfinite(y[t * X8_D + d]);
            rows += t > 0 && !isfinite(y[t * X8_D + d]);
        }
    DSK_TEST_EXPECT(row0 == 0 && rows == (T - 1) * X8_D,
                    "a NaN in expert 2's w1: %d non-finite y in token 0 (want 0), %d in tokens 1.. (want %d)", row0,
                    rows, (T - 1) * X8_D);
    ((float *)m.w1->value.data)[(2 * X8_F + 5) * X8_D + 7] = w;
    dy[5 * X8_D + 3] = NAN;
    memset(dx, 0, sizeof dx);
    DSK_TEST_OK(dsk_moe_forward_replay(&m, NULL, &ty, &tx, &tsel, NULL));
    DSK_TEST_OK(dsk_moe_backward(&m, NULL, &tdx, &tdy, 1.0f));
    rows = 0;
    for (int t = 0; t < T; t++)
        for (int d = 0; d < X8_D; d++) {
            rows += t == 5 && !isfinite(dx[t * X8_D + d]);
            other += t != 5 && !isfinite(dx[t * X8_D + d]);
        }
    nw2 = X8_F * X8_D;
    for (int64_t i = 0; i < nw2; i++) g2 += !isfinite(((const float *)m.w2->grad.data)[2 * nw2 + i]);
    DSK_TEST_EXPECT(rows > 0 && other == 0 && g2 > 0,
                    "a NaN in token 5's dy: %d non-finite dx in token 5 (want > 0), %d elsewhere (want 0), %d in "
                    "expert 2's w2 gradient (want > 0)",
                    rows, other, g2);
    drop_layer(&m, &own);
    o.expert_gemm = (dsk_moe_expert_gemm)7;
    DSK_TEST_EXPECT(dsk_moe_init(&bad, NULL, &o) == DSK_ERR_ARG &&
                        strstr(dsk_last_error(), "unknown expert_gemm 7 (act 0, fp8 1)") != NULL,
                    "expert_gemm 7: %s", dsk_last_error());
}


/* FP8 experts under expert parallelism (2 forked ranks, each holding 2 of the 4 experts), with the
   rows dispatched in f32 and in FP8: y and dx are one rank's bits (every row's arithmetic is the
   same), and each rank's expert gradients are the reference's for its own rows (its experts' rows
   from both ranks, by rank then token), whose token tiles start at its first row. */
enum { X8P_T = 70, X8P_N = 2, X8P_NT = X8P_N * X8P_T, X8P_EL = X8_E / X8P_N };

typedef struct x8p_job {
    float *x, *dy;       /* (NT, D), drawn from their own stream (the other cases' draws stay as they were) */
    float *y[2], *dx[2]; /* [dispatch] (NT, D): rank r's rows at r T */
    float *g[2][X8P_N];  /* [dispatch][rank] w1, w2, w3 gradients of the rank's experts */
    int *status;         /* [rank] */
    int port_ok;
    size_t bytes;
} x8p_job;

static int64_t x8p_gsize(void) { return 3 * (int64_t)X8P_EL * X8_F * X8_D; }

static void x8p_layer_inputs(dsk_moe *m, const float *x, const float *dy, int64_t T, dsk_tensor *tx, dsk_tensor *tdy,
                             int32_t *sel, int64_t t0) {
    int64_t shp[2] = {T, X8_D};
    int32_t *all = (int32_t *)malloc(sizeof(int32_t) * X8P_NT * X8_K);
    x8_assign(X8P_NT, all);
    memcpy(sel, all + t0 * X8_K, sizeof(int32_t) * (size_t)(T * X8_K));
    free(all);
    dsk_tensor_fill(NULL, &m->router->value, 0.0);
    dsk_tensor_wrap(tx, (void *)(x + t0 * X8_D), DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(tdy, (void *)(dy + t0 * X8_D), DSK_F32, dsk_cpu(), 2, shp);
}

static int x8p_rank_main(void *job, int rank, int port) {
    x8p_job *j = (x8p_job *)job;
    dsk_comm c;
    int64_t shp[2] = {X8P_T, X8_D}, ssh[2] = {X8P_T, X8_K};
    int32_t sel[X8P_T * X8_K];
    if (host_comm(&c, rank, X8P_N, port, NULL) != DSK_OK) return 2;
    for (int fp8 = 0; fp8 < 2; fp8++) {
        dsk_moe m;
        owned own;
        dsk_moe_opts o = x8_opts();
        dsk_tensor x, y, dy, dx, ts;
        o.ep = &c;
        o.ep_dispatch = fp8 ? DSK_MOE_DISPATCH_FP8 : DSK_MOE_DISPATCH_ACT;
        if (make_layer(&m, &own, &o) != DSK_OK) return 3;
        x8p_layer_inputs(&m, j->x, j->dy, X8P_T, &x, &dy, sel, (int64_t)rank * X8P_T);
        dsk_tensor_wrap(&y, j->y[fp8] + rank * X8P_T * X8_D, DSK_F32, dsk_cpu(), 2, shp);
        dsk_tensor_wrap(&dx, j->dx[fp8] + rank * X8P_T * X8_D, DSK_F32, dsk_cpu(), 2, shp);
        dsk_tensor_wrap(&ts, sel, DSK_I32, dsk_cpu(), 2, ssh);
        dsk_tensor_fill(NULL, &dx, 0.0);
        if (dsk_moe_forward_replay(&m, NULL, &y, &x, &ts, NULL) != DSK_OK) return 4;
        if (dsk_moe_backward(&m, NULL, &dx, &dy, 1.0f) != DSK_OK) return 5;
        memcpy(j->g[fp8][rank], m.w1->grad.data, sizeof(float) * (size_t)(x8p_gsize() / 3));
        memcpy(j->g[fp8][rank] + x8p_gsize() / 3, m.w2->grad.data, sizeof(float) * (size_t)(x8p_gsize() / 3));
        memcpy(j->g[fp8][rank] + 2 * x8p_gsize() / 3, m.w3->grad.data, sizeof(float) * (size_t)(x8p_gsize() / 3));
        drop_layer(&m, &own);
    }
    dsk_comm_free(&c);
    return 0;
}

static void x8p_run(x8p_job *j) {
    size_t nx = (size_t)X8P_NT * X8_D, ng = (size_t)x8p_gsize();
    char *shm;
    j->bytes = (6 * nx + 4 * ng) * sizeof(float) + 64;
    shm = (char *)mmap(NULL, j->bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    j->x = (float *)shm;
    j->dy = j->x + nx;
    for (int d = 0; d < 2; d++) {
        j->y[d] = j->dy + nx + 2 * d * nx;
        j->dx[d] = j->y[d] + nx;
        for (int r = 0; r < X8P_N; r++) j->g[d][r] = j->x + 6 * nx + (size_t)(2 * d + r) * ng;
    }
    j->status = (int *)(j->x + 6 * nx + 4 * ng);
    for (size_t i = 0; i < nx; i++) {
        j->x[i] = (float)(2 * dsk_rng_uniform_at(31, 0, i) - 1);
        j->dy[i] = (float)(2 * dsk_rng_uniform_at(32, 0, i) - 1);
    }
    for (size_t i = 2 * nx; i < 6 * nx + 4 * ng; i++) j->x[i] = NAN; /* poisoned */
    j->port_ok = run_ranks("fp8 experts rank", X8P_N, x8p_rank_main, j, j->status);
}

/* Rank r's expert rows (its experts in order, each expert's rows by token) from the assignment. */
static int x8p_rows(int r, int *tok, int *seg) {
    int32_t sel[X8P_NT * X8_K];
    int n = 0;
    x8_assign(X8P_NT, sel);
    seg[0] = 0;
    for (int e = r * X8P_EL; e < (r + 1) * X8P_EL; e++) {
        for (int t = 0; t < X8P_NT; t++)
            for (int k = 0; k < X8_K; k++)
                if (sel[t * X8_K + k] == e) tok[n++] = t;
        seg[e - r * X8P_EL + 1] = n;
    }
    return n;
}

static void x8p_check(x8p_job *j) {
    dsk_moe one;
    owned own;
    dsk_moe_opts o = x8_opts();
    dsk_tensor x, dy, y, dx, ts;
    int64_t shp[2] = {X8P_NT, X8_D}, ssh[2] = {X8P_NT, X8_K}, nx = (int64_t)X8P_NT * X8_D;
    int32_t sel[X8P_NT * X8_K];
    float *y1 = (float *)malloc(sizeof(float) * (size_t)nx), *dx1 = (float *)malloc(sizeof(float) * (size_t)nx);
    dsk_test_begin("FP8 experts over 2 expert-parallel ranks, f32 and FP8 dispatch: y, dx = 1 rank's bits; expert "
                   "gradients = the reference's for the rank's rows");
    DSK_TEST_OK(make_layer(&one, &own, &o));
    if (!j->port_ok) {
        dsk_test_fail_at(__FILE__, __LINE__, "no free port: %s", dsk_last_error());
        goto out;
    }
    for (int r = 0; r < X8P_N; r++)
        DSK_TEST_EXPECT(j->status[r] == 0, "rank %d failed with status %d", r, j->status[r]);
    x8p_layer_inputs(&one, j->x, j->dy, X8P_NT, &x, &dy, sel, 0);
    dsk_tensor_wrap(&y, y1, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&dx, dx1, DSK_F32, dsk_cpu(), 2, shp);
    dsk_tensor_wrap(&ts, sel, DSK_I32, dsk_cpu(), 2, ssh);
    dsk_tensor_fill(NULL, &dx, 0.0);
    DSK_TEST_OK(dsk_moe_forward_replay(&one, NULL, &y, &x, &ts, NULL));
    DSK_TEST_OK(dsk_moe_backward(&one, NULL, &dx, &dy, 1.0f));
    for (int d = 0; d < 2; d++) {
        char what[64];
        snprintf(what, sizeof what, "y, %s dispatch", d ? "fp8" : "f32");
        DSK_TEST_SAME_BYTES(j->y[d], y1, sizeof(float) * (size_t)nx, what);
        snprintf(what, sizeof what, "dx, %s dispatch", d ? "fp8" : "f32");
        DSK_TEST_SAME_BYTES(j->dx[d], dx1, sizeof(float) * (size_t)nx, what);
    }
    for (int r = 0; r < X8P_N; r++) {
        int tok[X8P_NT * X8_K], seg[X8P_EL + 1], n = x8p_rows(r, tok, seg);
        int64_t per = (int64_t)X8P_EL * X8_F * X8_D, w0 = (int64_t)r * per;
        float *xr = (float *)malloc(sizeof(float) * (size_t)(n * X8_D + 1)),
              *dor = (float *)malloc(sizeof(float) * (size_t)(n * X8_D + 1));
        x8_ref ref;
        for (int i = 0; i < n; i++)
            for (int c = 0; c < X8_D; c++) {
                xr[i * X8_D + c] = j->x[tok[i] * X8_D + c];
                dor[i * X8_D + c] = 0.25f * j->dy[tok[i] * X8_D + c];
            }
        x8_ref_init(&ref, xr, n, X8_F, seg, X8P_EL, (float *)one.w1->value.data + w0, (float *)one.w2->value.data + w0,
                    (float *)one.w3->value.data + w0);
        x8_forward(&ref);
        x8_backward(&ref, dor);
        for (int d = 0; d < 2; d++)
            for (int p = 0; p < 3; p++) {
                int bad = x8_outside(j->g[d][r] + p * per, ref.g[p], ref.gtol[p], per, "rank's expert gradient");
                DSK_TEST_EXPECT(bad == 0, "rank %d, %s dispatch, w%d gradient: %d of %lld outside the bound", r,
                                d ? "fp8" : "f32", p + 1, bad, (long long)per);
            }
        x8_ref_free(&ref);
        free(xr);
        free(dor);
    }
out:
    drop_layer(&one, &own);
    free(y1);
    free(dx1);
    munmap(j->x, j->bytes);
    dsk_test_end();
}


/* ---------------------------------------------------------------- expert-parallel routes (dsk_moe_route_*) */

/* The transports a route case runs over: shared memory, TCP, or two emulated hosts (ranks
   [0, (n+1)/2) on one, the rest on the other: shared memory inside each, TCP across). */
enum { RT_SHM, RT_TCP, RT_TWO_HOSTS };
static const char *k_rt_modes[] = {"shared memory", "TCP", "2 emulated hosts"};
static int rt_mode;
static uint64_t rt_seed;

static int host_of(int r, int n) { return rt_mode == RT_TWO_HOSTS && r >= (n + 1) / 2; }

/* Element i of rank r's rows for `tag`: f32 in [-2, 2), never 0, or u8. */
static void rt_gen(void *buf, dsk_dtype dt, int64_t n, uint64_t tag, int r) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t u =
            dsk_test_mix64(rt_seed ^ dsk_test_mix64(tag * 131 + (uint64_t)r) ^ (uint64_t)i * 0xD1B54A32D192ED03ull);
        float f = (float)((double)(u >> 11) * (1.0 / 9007199254740992.0) * 4.0 - 2.0);
        if (dt == DSK_F32) ((float *)buf)[i] = f == 0 ? 0.5f : f;
        else ((uint8_t *)buf)[i] = (uint8_t)(u >> 56);
    }
}

#define ROUTE_K 3
#define ROUTE_E 5 /* f32 elements per row */

static int64_t route_rows(int r) { return r == 1 ? 0 : 17 + 5 * r; } /* rank 1 sends nothing */

/* Rank r's destinations: random ranks or -1 (unused), a rank repeated in a row now and then;
   row 0 has two slots on the last two ranks (one node with two emulated hosts), so a two-hop
   route sends that row across once where the flat one sends it twice. */
static void route_dest(int r, int n, int32_t *dest) {
    for (int64_t q = 0; q < route_rows(r) * ROUTE_K; q++) {
        uint64_t u = dsk_test_mix64(rt_seed ^ dsk_test_mix64(777 + (uint64_t)r) ^ (uint64_t)q);
        dest[q] = (int32_t)(u % (uint64_t)(n + 1)) - 1;
    }
    if (route_rows(r) == 0) return;
    dest[0] = n - 1;
    dest[1] = n > 1 ? n - 2 : n - 1;
}

/* What an expert on rank d makes of received row q: deterministic, different per rank and row. */
static void route_expert(int d, int64_t q, const float *in, float *out) {
    for (int e = 0; e < ROUTE_E; e++) out[e] = in[e] * 2.0f + (float)(d * 1000 + q);
}

typedef struct route_world {
    int n;
    int32_t *dest[8];
    float *rows[8];
    uint8_t *bytes[8]; /* 3-byte rows: an odd row size */
} route_world;

static void route_world_make(route_world *w, int n) {
    w->n = n;
    for (int p = 0; p < n; p++) {
        w->dest[p] = (int32_t *)malloc((size_t)(route_rows(p) + 1) * ROUTE_K * sizeof(int32_t));
        w->rows[p] = (float *)malloc((size_t)(route_rows(p) + 1) * ROUTE_E * sizeof(float));
        w->bytes[p] = (uint8_t *)malloc((size_t)(route_rows(p) + 1) * 3);
        route_dest(p, n, w->dest[p]);
        rt_gen(w->rows[p], DSK_F32, route_rows(p) * ROUTE_E, 4242, p);
        rt_gen(w->bytes[p], DSK_U8, route_rows(p) * 3, 4343, p);
    }
}

static void route_world_free(route_world *w) {
    for (int p = 0; p < w->n; p++) {
        free(w->dest[p]);
        free(w->rows[p]);
        free(w->bytes[p]);
    }
}

/* The rows rank me must receive (source order, then (row, slot) order), row_bytes each, from
   the sources' buffers src[p]; returns their number, counts[p] per source. */
static int64_t route_want(const route_world *w, int me, void *const *src, size_t row_bytes, char *out,
                          int64_t *counts) {
    int64_t q = 0;
    for (int p = 0; p < w->n; p++) {
        counts[p] = 0;
        for (int64_t s = 0; s < route_rows(p) * ROUTE_K; s++)
            if (w->dest[p][s] == me) {
                if (out)
                    memcpy(out + (size_t)q * row_bytes, (const char *)src[p] + (size_t)(s / ROUTE_K) * row_bytes,
                           row_bytes);
                counts[p]++;
                q++;
            }
    }
    return q;
}

/* Rows (per row, per slot) rank me sends off its node: a flat route sends one per slot, a
   two-hop one per (row, destination node). */
static int64_t route_off_node(const route_world *w, int me, int two_hop) {
    int64_t rows = 0;
    for (int64_t i = 0; i < route_rows(me); i++) {
        int seen = 0; /* bit: a node this row already went to */
        for (int j = 0; j < ROUTE_K; j++) {
            int d = w->dest[me][i * ROUTE_K + j], b;
            if (d < 0 || (b = host_of(d, w->n)) == host_of(me, w->n)) continue;
            if (!two_hop || !(seen >> b & 1)) rows++;
            seen |= 1 << b;
        }
    }
    return rows;
}

/* Dispatch and combine through a flat and a two-hop route: both bitwise what the flat
   all-to-all-v semantics give; with two emulated hosts the two-hop route sends fewer rows and
   bytes off the node. */
static void rank_routes(dsk_comm *c, void *arg) {
    int n = c->world_size, me = c->rank;
    route_world w;
    int64_t counts[8], want_counts[8], R = route_rows(me), slots = 0, nrecv;
    uint64_t off_bytes[2] = {0, 0};
    float *want, *got, *experts, *want_out, *out;
    uint8_t *wantb, *gotb;
    (void)arg;
    route_world_make(&w, n);
    nrecv = route_want(&w, me, (void *const *)w.rows, ROUTE_E * sizeof(float), NULL, want_counts);
    want = (float *)malloc((size_t)(nrecv + 1) * ROUTE_E * sizeof(float));
    got = (float *)malloc((size_t)(nrecv + 1) * ROUTE_E * sizeof(float));
    experts = (float *)malloc((size_t)(nrecv + 1) * ROUTE_E * sizeof(float));
    wantb = (uint8_t *)malloc((size_t)(nrecv + 1) * 3);
    gotb = (uint8_t *)malloc((size_t)(nrecv + 1) * 3);
    route_want(&w, me, (void *const *)w.rows, ROUTE_E * sizeof(float), (char *)want, counts);
    route_want(&w, me, (void *const *)w.bytes, 3, (char *)wantb, counts);
    for (int64_t s = 0; s < R * ROUTE_K; s++) slots += w.dest[me][s] >= 0;
    want_out = (float *)malloc((size_t)(slots + 1) * ROUTE_E * sizeof(float));
    out = (float *)malloc((size_t)(slots + 1) * ROUTE_E * sizeof(float));
    /* what comes back for slot (i, j): the expert on d applied to row i at its place in d's rows */
    {
        int64_t s = 0, sent[8] = {0};
        for (int64_t q = 0; q < R * ROUTE_K; q++) {
            int d = w.dest[me][q];
            int64_t at = 0, cd[8];
            if (d < 0) continue;
            route_want(&w, d, (void *const *)w.rows, ROUTE_E * sizeof(float), NULL, cd);
            for (int p = 0; p < me; p++) at += cd[p];
            route_expert(d, at + sent[d]++, w.rows[me] + (q / ROUTE_K) * ROUTE_E, want_out + s++ * ROUTE_E);
        }
    }
    for (int two = 0; two < 2; two++) {
        dsk_moe_route rt;
        dsk_moe_route_opts o;
        uint64_t before;
        char label[96];
        memset(&o, 0, sizeof o);
        o.two_hop = two;
        snprintf(label, sizeof label, "rank %d: %s route", me, two ? "two-hop" : "flat");
        DSK_TEST_OK(dsk_moe_route_init(&rt, c, NULL, R, ROUTE_K, w.dest[me], &o));
        if (!rt.impl) continue;
        DSK_TEST_EXPECT(rt.recv_rows == nrecv && rt.slots == slots && rt.two_hop == two,
                        "%s: %lld rows received, %lld slots; want %lld, %lld", label, (long long)rt.recv_rows,
                        (long long)rt.slots, (long long)nrecv, (long long)slots);
        for (int p = 0; p < n; p++)
            DSK_TEST_EXPECT(rt.recv_counts[p] == want_counts[p], "%s: %lld rows from rank %d, want %lld", label,
                            (long long)rt.recv_counts[p], p, (long long)want_counts[p]);
        DSK_TEST_EXPECT(rt.dispatch_rows_off_node == route_off_node(&w, me, two),
                        "%s: %lld rows off the node, want %lld", label, (long long)rt.dispatch_rows_off_node,
                        (long long)route_off_node(&w, me, two));
        for (int rep = 0; rep < 2; rep++) { /* a route is reused */
            dsk_test_poison_bytes(got, (size_t)nrecv * ROUTE_E * sizeof(float));
            before = c->stats.bytes_sent_off_node;
            DSK_TEST_OK(dsk_moe_route_dispatch(&rt, NULL, w.rows[me], ROUTE_E, DSK_F32, got));
            off_bytes[two] = c->stats.bytes_sent_off_node - before;
            DSK_TEST_SAME_BYTES(got, want, (size_t)nrecv * ROUTE_E * sizeof(float), label);
        }
        memset(gotb, 0xa5, (size_t)nrecv * 3);
        DSK_TEST_OK(dsk_moe_route_dispatch(&rt, NULL, w.bytes[me], 3, DSK_U8, gotb));
        DSK_TEST_SAME_BYTES(gotb, wantb, (size_t)nrecv * 3, label);
        for (int64_t q = 0; q < nrecv; q++) route_expert(me, q, got + q * ROUTE_E, experts + q * ROUTE_E);
        dsk_test_poison_bytes(out, (size_t)slots * ROUTE_E * sizeof(float));
        DSK_TEST_OK(dsk_moe_route_combine(&rt, NULL, experts, ROUTE_E, DSK_F32, out));
        DSK_TEST_SAME_BYTES(out, want_out, (size_t)slots * ROUTE_E * sizeof(float), label);
        DSK_TEST_EXPECT(off_bytes[two] >= (uint64_t)rt.dispatch_rows_off_node * ROUTE_E * sizeof(float),
                        "%s: %llu bytes off the node for %lld rows", label, (unsigned long long)off_bytes[two],
                        (long long)rt.dispatch_rows_off_node);
        dsk_moe_route_free(&rt);
        dsk_moe_route_free(&rt); /* freed twice is fine */
    }
    if (c->n_nodes == 1)
        DSK_TEST_EXPECT(off_bytes[0] == 0 && off_bytes[1] == 0, "one node, yet %llu and %llu bytes off it",
                        (unsigned long long)off_bytes[0], (unsigned long long)off_bytes[1]);
    else
        DSK_TEST_EXPECT(off_bytes[1] < off_bytes[0] && route_off_node(&w, me, 1) <= route_off_node(&w, me, 0),
                        "rank %d: two hops sent %llu bytes (%lld rows) off the node, flat %llu (%lld rows)", me,
                        (unsigned long long)off_bytes[1], (long long)route_off_node(&w, me, 1),
                        (unsigned long long)off_bytes[0], (long long)route_off_node(&w, me, 0));
    if (c->n_nodes > 1 && host_of(me, n) == 0 && R > 0)
        DSK_TEST_EXPECT(route_off_node(&w, me, 1) < route_off_node(&w, me, 0),
                        "rank %d: row 0 has two slots on the other node, yet two hops send as many rows", me);
    free(want);
    free(got);
    free(experts);
    free(wantb);
    free(gotb);
    free(want_out);
    free(out);
    route_world_free(&w);
}

/* Misuse: bad destinations and arguments fail at once; ranks that build different kinds of
   route all fail, and the communicator still works. */
static void rank_route_misuse(dsk_comm *c, void *arg) {
    int32_t dest[6] = {0, -1, 0, 0, -1, -1};
    dsk_moe_route rt;
    dsk_moe_route_opts o;
    float x[4] = {1, 2, 3, 4};
    (void)arg;
    memset(&o, 0, sizeof o);
    dest[3] = c->world_size;
    DSK_TEST_STATUS(dsk_moe_route_init(&rt, c, NULL, 2, 3, dest, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("row 1 slot 0 goes to rank");
    DSK_TEST_EXPECT(rt.impl == NULL, "a failed init left a route");
    DSK_TEST_STATUS(dsk_moe_route_init(&rt, c, NULL, 2, 0, dest, &o), DSK_ERR_ARG);
    DSK_TEST_STATUS(dsk_moe_route_init(&rt, c, NULL, 2, 3, NULL, &o), DSK_ERR_ARG);
    DSK_TEST_STATUS(dsk_moe_route_dispatch(&rt, NULL, x, 1, DSK_F32, x), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("route is NULL or not initialised");
    dest[3] = 0;
    o.two_hop = c->rank == 0;
    DSK_TEST_STATUS(dsk_moe_route_init(&rt, c, NULL, 2, 3, dest, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS(c->rank == 0 ? "a flat route but this rank (0) a two-hop one"
                                         : "rank 0 built a two-hop route");
    o.two_hop = 0;
    DSK_TEST_OK(dsk_moe_route_init(&rt, c, NULL, 2, 3, dest, &o));
    DSK_TEST_STATUS(dsk_moe_route_dispatch(&rt, NULL, x, -1, DSK_F32, x), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("row_elems -1 is negative");
    DSK_TEST_STATUS(dsk_moe_route_combine(&rt, NULL, x, 1, DSK_E4M3, x), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dtype e4m3 is not supported");
    dsk_moe_route_free(&rt);
    DSK_TEST_OK(dsk_comm_barrier(c, NULL));
}

/* Two hosts of 2 and 1 ranks: a two-hop route needs nodes of one size. */
static void rank_route_uneven(dsk_comm *c, void *arg) {
    int32_t dest[2] = {0, (c->rank + 1) % c->world_size};
    dsk_moe_route rt;
    dsk_moe_route_opts o;
    (void)arg;
    memset(&o, 0, sizeof o);
    o.two_hop = 1;
    DSK_TEST_STATUS(dsk_moe_route_init(&rt, c, NULL, 1, 2, dest, &o), DSK_ERR_UNSUPPORTED);
    DSK_TEST_ERROR_MENTIONS("two hops need nodes of one size");
    o.two_hop = 0;
    DSK_TEST_OK(dsk_moe_route_init(&rt, c, NULL, 1, 2, dest, &o));
    dsk_moe_route_free(&rt);
}

/* A layer over 3 ranks on nodes of 2 and 1 (two emulated hosts): two hops refused (nodes of one size),
   AUTO resolved to the flat exchange. */
static void rank_moe_route_uneven(dsk_comm *c, void *arg) {
    dsk_moe m;
    dsk_moe_opts o = ep_opts(0);
    (void)arg;
    o.n_routed = 6;
    o.ep = c;
    o.ep_route = DSK_MOE_ROUTE_TWO_HOP;
    DSK_TEST_STATUS(dsk_moe_init(&m, NULL, &o), DSK_ERR_UNSUPPORTED);
    DSK_TEST_ERROR_MENTIONS("two-hop needs an expert-parallel group whose nodes have one size");
    o.ep_route = DSK_MOE_ROUTE_AUTO;
    DSK_TEST_OK(dsk_moe_init(&m, NULL, &o));
    DSK_TEST_EXPECT(m.opts.ep_route == DSK_MOE_ROUTE_FLAT, "AUTO over uneven nodes resolved to %d, not flat",
                    (int)m.opts.ep_route);
    dsk_moe_free(&m, NULL);
}

/* Forks n ranks that init a host communicator over the current mode and run fn; a rank exits 1
   when one of its checks failed. Called before this process starts OpenMP threads. */
static void rt_case(const char *name, void (*fn)(dsk_comm *, void *), int n, int mode) {
    pid_t pid[4];
    int port = 0;
    rt_mode = mode;
    dsk_test_begin("[%s] %s, %d rank%s", k_rt_modes[mode], name, n, n > 1 ? "s" : "");
    if (dsk_comm_free_port("127.0.0.1", &port) != DSK_OK) {
        dsk_test_fail_at(__FILE__, __LINE__, "no free port: %s", dsk_last_error());
        dsk_test_end();
        return;
    }
    fflush(stdout);
    for (int r = 0; r < n; r++) {
        pid[r] = fork();
        if (pid[r] == 0) {
            dsk_comm c;
            dsk_comm_opts o;
            as_local_rank_of(n);
            memset(&o, 0, sizeof o);
            o.backend = DSK_COMM_HOST;
            o.master_addr = "127.0.0.1";
            o.master_port = port;
            o.timeout_s = 30;
            if (mode == RT_TCP) o.transport = DSK_COMM_TRANSPORT_TCP;
            if (mode == RT_TWO_HOSTS) o.host_id = host_of(r, n) ? "route-host-b" : "route-host-a";
            if (dsk_comm_init(&c, r, n, &o) != DSK_OK)
                dsk_test_fail_at(__FILE__, __LINE__, "rank %d: dsk_comm_init: %s", r, dsk_last_error());
            else {
                fn(&c, NULL);
                dsk_comm_free(&c);
            }
            fflush(stdout);
            _exit(dsk_test_g.checks_failed_total > 0 ? 1 : 0);
        }
    }
    for (int r = 0; r < n; r++) {
        int st = -1;
        if (pid[r] > 0) waitpid(pid[r], &st, 0);
        DSK_TEST_EXPECT(pid[r] > 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "rank %d of %d failed (status %d)", r, n,
                        st);
    }
    dsk_test_end();
}

/* The route cases of test_comm before the routes moved here: 1 to 4 ranks over shared memory, 2 over
   TCP, 4 on two emulated hosts; misuse on 3; two hops over uneven nodes. */
static void test_routes(void) {
    const char *name =
        "routes: flat and two-hop dispatch and combine, bitwise the flat all-to-all-v; rows off the node";
    rt_seed = dsk_test_g.seed ^ 0x726f757465ull;
    for (int n = 1; n <= 4; n++) rt_case(name, rank_routes, n, RT_SHM);
    rt_case(name, rank_routes, 2, RT_TCP);
    rt_case(name, rank_routes, 4, RT_TWO_HOSTS);
    rt_case("routes: bad arguments, ranks that build different kinds", rank_route_misuse, 3, RT_SHM);
    rt_case("routes: two hops over nodes of 2 and 1 ranks", rank_route_uneven, 3, RT_TWO_HOSTS);
    rt_case("layer: ep_route two-hop refused over nodes of 2 and 1 ranks, AUTO flat", rank_moe_route_uneven, 3,
            RT_TWO_HOSTS);
}

int main(void) {
    dsk_test_init("test_moe");
    ep_job jobs[3];
    f8_job f8;
    x8p_job x8p;
    aj_job aj[2];
    sp_job sp[4];
    /* every forked rank first, before this process starts OpenMP threads */
    test_routes();
    ep_run(&jobs[0], 2, 0);
    ep_run(&jobs[1], 4, 1);
    ep_run(&jobs[2], 2, 1);
    f8_run(&f8);
    x8p_run(&x8p);
    aj_run(&aj[0], 2);
    aj_run(&aj[1], 3);
    sp_jobs(sp);
    for (int i = 0; i < 3; i++) ep_check(&jobs[i]);
    f8_check(&f8);
    for (int i = 0; i < 2; i++) aj_check(&aj[i]);
    for (int i = 0; i < 4; i++) sp_check(&sp[i]);
    DSK_TEST_RUN(test_amp_unscale_bad);
    DSK_TEST_RUN(test_config_check);
    test_forward_variants();
    DSK_TEST_RUN(test_group_mask_is_neg_inf);
    DSK_TEST_RUN(test_bias_not_in_weights);
    test_group_rules();
    test_loss_terms();
    test_loss_counts();
    test_bias_update();
    test_backward_variants();
    test_switch_loss_ignores_seq_len();
    DSK_TEST_RUN(test_grad_accumulates);
    DSK_TEST_RUN(test_slots_same_bits);
    DSK_TEST_RUN(test_slots_bad);
    DSK_TEST_RUN(test_split_bad);
    test_replay_variants();
    DSK_TEST_RUN(test_replay_bad_input);
    DSK_TEST_RUN(test_routing_before_forward);
    DSK_TEST_RUN(test_null_layer);
    DSK_TEST_RUN(test_null_args);
    DSK_TEST_RUN(test_stats_request);
    test_bf16_forward_backward();
    DSK_TEST_RUN(test_params_by_name);
    DSK_TEST_RUN(test_bad_config);
    DSK_TEST_RUN(test_bad_calls);
    DSK_TEST_RUN(test_empty_batch);
    test_forward_nonfinite();
    DSK_TEST_RUN(test_route_token_nonfinite);
    DSK_TEST_RUN(test_loss_span_bad); /* last: the cases before it draw what they drew before it existed */
    DSK_TEST_RUN(test_fp8_experts);
    DSK_TEST_RUN(test_fp8_experts_nonfinite);
    x8p_check(&x8p);
    return dsk_test_finish();
}
