/* tests/test_amp.c - dsk_amp.h on the CPU: loss-scale trajectories against an independent
   DeepSpeed-style reference, unscale/check/norm against float64, skip as a bitwise no-op,
   stochastic rounding statistics, fp8 round trips and scaling, an fp16-simulated training
   loop with an injected overflow, and every error path (status and message). */
#include "dsk_amp.h"
#include "tests/dsk_test.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* ---------------------------------------------------------------- helpers */

static dsk_tensor new_tensor(dsk_dtype dt, int ndim, const int64_t *shape) {
    dsk_tensor t;
    if (dsk_tensor_alloc(NULL, &t, dt, ndim, shape) != DSK_OK) memset(&t, 0, sizeof t);
    return t;
}
static dsk_tensor new_1d(dsk_dtype dt, int64_t n) { return new_tensor(dt, 1, &n); }
static dsk_tensor new_2d(dsk_dtype dt, int64_t r, int64_t c) { int64_t s[2] = {r, c}; return new_tensor(dt, 2, s); }

static void put(dsk_tensor *t, int64_t i, double x) {
    switch (t->dtype) {
    case DSK_F32: ((float *)t->data)[i] = (float)x; break;
    case DSK_BF16: ((uint16_t *)t->data)[i] = dsk_f32_to_bf16((float)x); break;
    case DSK_F16: ((uint16_t *)t->data)[i] = dsk_f32_to_f16((float)x); break;
    default: break;
    }
}
static double get(const dsk_tensor *t, int64_t i) {
    switch (t->dtype) {
    case DSK_F32: return ((const float *)t->data)[i];
    case DSK_BF16: return dsk_bf16_to_f32(((const uint16_t *)t->data)[i]);
    case DSK_F16: return dsk_f16_to_f32(((const uint16_t *)t->data)[i]);
    default: return NAN;
    }
}
/* Random non-zero values in +-[lo, hi], stored in t's dtype. */
static void fill_rand(dsk_tensor *t, double lo, double hi) {
    for (int64_t i = 0, n = dsk_tensor_numel(t); i < n; i++) {
        double m = dsk_test_rand(lo, hi);
        put(t, i, dsk_test_rand_u64() & 1 ? m : -m);
    }
}
/* Unit roundoff of a dtype (relative error bound of one RNE rounding). */
static double unit_roundoff(dsk_dtype dt) { return dt == DSK_F32 ? 0x1p-24 : dt == DSK_BF16 ? 0x1p-8 : 0x1p-11; }

/* ---------------------------------------------------------------- loss scaler trajectory */

/* Independent reference, written the DeepSpeed way (iteration counters instead of a growth
   tracker, hysteresis counted down and refilled), with PyTorch's f64 products and Inf guard. */
typedef struct ref_scaler {
    dsk_amp_scaler_opts o; /* resolved by hand in the test */
    float scale;
    long cur_iter, last_overflow;
    int cur_h;
} ref_scaler;

static void ref_update(ref_scaler *r, int overflow) {
    if (r->o.mode == DSK_AMP_DYNAMIC) {
        if (overflow) {
            if (r->o.hysteresis == 1 || r->cur_h == 1) {
                float next = (float)((double)r->scale * r->o.backoff_factor);
                if (r->o.min_scale > 0 && next < r->o.min_scale) next = r->o.min_scale;
                if (next > 0) r->scale = next;
            } else {
                r->cur_h--;
            }
            r->last_overflow = r->cur_iter;
        } else {
            if (r->o.hysteresis_consecutive) r->cur_h = r->o.hysteresis;
            if ((r->cur_iter - r->last_overflow) % r->o.growth_interval == 0) {
                float next = (float)((double)r->scale * r->o.growth_factor);
                if (!r->o.hysteresis_consecutive) r->cur_h = r->o.hysteresis;
                if (r->o.max_scale > 0 && next > r->o.max_scale) next = r->o.max_scale;
                if (!isinf(next)) r->scale = next;
            }
        }
    }
    r->cur_iter++;
}

/* Feeds `script` (1 = overflow) through the scaler and the reference, comparing state every
   step. With `real`, each step is a real unscale pass over a gradient that carries a NaN or
   Inf on overflow steps; without, or once the scale is so small that 1/scale would overflow
   f32, the stats are set directly. */
static void run_trajectory(const dsk_amp_scaler_opts *opts, const ref_scaler *ref0, const int *script, int steps, int real) {
    dsk_amp_scaler sc;
    ref_scaler r = *ref0;
    dsk_tensor g = new_1d(DSK_F32, 3);
    dsk_tensor *gl[1] = {&g};
    int bad = 0;
    DSK_TEST_OK(dsk_amp_scaler_init(&sc, NULL, opts));
    for (int t = 0; t < steps && !bad; t++) {
        dsk_amp_stats st = {NAN, NAN};
        dsk_amp_scaler_state s = {NAN, -1, -1};
        fill_rand(&g, 0.5, 2.0);
        if (script[t]) put(&g, t % 3, t % 2 ? INFINITY : NAN);
        DSK_TEST_OK(dsk_amp_state_get(&sc, NULL, &s));
        if (real && s.scale > 0x1p-100f) DSK_TEST_OK(dsk_amp_unscale(&sc, NULL, gl, 1));
        else { sc.stats.found_inf = script[t]; sc.stats.sumsq = 1.0; }
        DSK_TEST_OK(dsk_amp_stats_get(&sc, NULL, &st));
        if (dsk_amp_stats_overflow(st) != script[t]) { DSK_TEST_EXPECT(0, "step %d: overflow %d, script %d", t, dsk_amp_stats_overflow(st), script[t]); bad = 1; }
        DSK_TEST_OK(dsk_amp_update(&sc, NULL));
        ref_update(&r, script[t]);
        DSK_TEST_OK(dsk_amp_state_get(&sc, NULL, &s));
        {
            long want_tracker = r.o.mode == DSK_AMP_DYNAMIC ? (r.cur_iter - 1 - r.last_overflow) % r.o.growth_interval : 0;
            if (s.scale != r.scale || s.growth_tracker != want_tracker || (r.o.mode == DSK_AMP_DYNAMIC && s.hysteresis_left != r.cur_h)) {
                DSK_TEST_EXPECT(0, "step %d (overflow %d): scale %.9g tracker %d hyst %d, reference %.9g %ld %d", t, script[t], (double)s.scale,
                                (int)s.growth_tracker, (int)s.hysteresis_left, (double)r.scale, want_tracker, r.cur_h);
                bad = 1;
            }
            if (isinf(s.scale) || !(s.scale > 0)) { DSK_TEST_EXPECT(0, "step %d: scale %g", t, (double)s.scale); bad = 1; }
        }
    }
    dsk_amp_scaler_free(&sc, NULL);
    dsk_tensor_free(NULL, &g);
}

static ref_scaler ref_init(dsk_amp_mode mode, float init, double growth, double backoff, int interval, int hyst, int consec, float mn, float mx) {
    ref_scaler r;
    memset(&r, 0, sizeof r);
    r.o.mode = mode; r.o.init_scale = init; r.o.growth_factor = growth; r.o.backoff_factor = backoff;
    r.o.growth_interval = interval; r.o.hysteresis = hyst; r.o.hysteresis_consecutive = consec;
    r.o.min_scale = mn; r.o.max_scale = mx;
    r.scale = mode == DSK_AMP_NONE ? 1.0f : init;
    r.last_overflow = -1;
    r.cur_h = hyst;
    return r;
}

/* Script: bursts of overflows, long clean runs, random flips. */
static void make_script(int *s, int n, double p) {
    for (int t = 0; t < n; t++) s[t] = dsk_test_rand(0, 1) < p;
    for (int t = 5; t < n && t < 9; t++) s[t] = 1; /* a burst of four */
}

static void test_scaler_defaults(void) {
    dsk_amp_scaler sc;
    dsk_amp_scaler_state s = {NAN, -1, -1};
    DSK_TEST_OK(dsk_amp_scaler_init(&sc, NULL, NULL));
    DSK_TEST_OK(dsk_amp_state_get(&sc, NULL, &s));
    DSK_TEST_EXPECT(s.scale == 65536.0f && s.growth_tracker == 0 && s.hysteresis_left == 1, "state %g %d %d", (double)s.scale,
                    (int)s.growth_tracker, (int)s.hysteresis_left);
    DSK_TEST_EXPECT(sc.opts.growth_factor == 2.0 && sc.opts.backoff_factor == 0.5 && sc.opts.growth_interval == 2000 && sc.opts.mode == DSK_AMP_DYNAMIC,
                    "defaults %g %g %d", sc.opts.growth_factor, sc.opts.backoff_factor, (int)sc.opts.growth_interval);
    dsk_amp_scaler_free(&sc, NULL);
    dsk_amp_scaler_free(&sc, NULL); /* freed twice is fine */
}

static void test_trajectories(void) {
    enum { N = 4500 };
    static int script[N];
    struct { const char *name; ref_scaler r; double p; int steps; } cases[] = {
        {"default rule, interval 2000", ref_init(DSK_AMP_DYNAMIC, 65536, 2, 0.5, 2000, 1, 0, 0, 0), 0.0004, N},
        {"interval 3", ref_init(DSK_AMP_DYNAMIC, 1024, 2, 0.5, 3, 1, 0, 0, 0), 0.2, 600},
        {"odd factors 1.7 / 0.6", ref_init(DSK_AMP_DYNAMIC, 3000.5f, 1.7, 0.6, 2, 1, 0, 0, 0), 0.2, 600},
        {"hysteresis 3, refilled on growth", ref_init(DSK_AMP_DYNAMIC, 4096, 2, 0.5, 5, 3, 0, 0, 0), 0.25, 800},
        {"hysteresis 2, consecutive", ref_init(DSK_AMP_DYNAMIC, 4096, 2, 0.5, 5, 2, 1, 0, 0), 0.3, 800},
        {"min 1 / max 2^20", ref_init(DSK_AMP_DYNAMIC, 256, 4, 0.25, 2, 1, 0, 1.0f, 1048576.0f), 0.35, 800},
        {"growth toward Inf", ref_init(DSK_AMP_DYNAMIC, 0x1p120f, 2, 0.5, 1, 1, 0, 0, 0), 0.02, 400},
        {"backoff toward 0", ref_init(DSK_AMP_DYNAMIC, 1.0f, 2, 0.5, 1000, 1, 0, 0, 0), 0.98, 400},
        {"static", ref_init(DSK_AMP_STATIC, 512, 2, 0.5, 2, 1, 0, 0, 0), 0.3, 300},
        {"none (bf16)", ref_init(DSK_AMP_NONE, 512, 2, 0.5, 2, 1, 0, 0, 0), 0.3, 300},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        dsk_test_begin("scale trajectory: %s", cases[c].name);
        make_script(script, cases[c].steps, cases[c].p);
        if (c == 6) for (int t = 0; t < 20; t++) script[t] = 0; /* must hit the Inf guard */
        run_trajectory(&cases[c].r.o, &cases[c].r, script, cases[c].steps, c != 7);
        dsk_test_end();
    }
}

/* Hand-checked expectations, independent of both implementations. */
static void test_trajectory_by_hand(void) {
    dsk_amp_scaler sc;
    dsk_amp_scaler_opts o;
    dsk_amp_scaler_state s = {NAN, -1, -1};
    memset(&o, 0, sizeof o);
    o.init_scale = 1024; o.growth_interval = 2; o.hysteresis = 2;
    DSK_TEST_OK(dsk_amp_scaler_init(&sc, NULL, &o));
    {
        /* overflow: absorbed (hyst 2 -> 1); overflow: 512; clean; clean: grow to 1024 and refill */
        int script[] = {1, 1, 0, 0, 1, 0};
        float want_scale[] = {1024, 512, 512, 1024, 1024, 1024};
        int want_tr[] = {0, 0, 1, 0, 0, 1}, want_h[] = {1, 1, 1, 2, 1, 1};
        for (int t = 0; t < 6; t++) {
            dsk_amp_stats st = {script[t], 1.0};
            DSK_TEST_OK(dsk_amp_stats_set(&sc, NULL, &st));
            DSK_TEST_OK(dsk_amp_update(&sc, NULL));
            DSK_TEST_OK(dsk_amp_state_get(&sc, NULL, &s));
            DSK_TEST_EXPECT(s.scale == want_scale[t] && s.growth_tracker == want_tr[t] && s.hysteresis_left == want_h[t],
                            "step %d: %g %d %d, want %g %d %d", t, (double)s.scale, (int)s.growth_tracker, (int)s.hysteresis_left,
                            (double)want_scale[t], want_tr[t], want_h[t]);
        }
    }
    /* A non-finite sum of squares counts as overflow even with found_inf 0. */
    sc.stats.found_inf = 0; sc.stats.sumsq = INFINITY;
    DSK_TEST_OK(dsk_amp_update(&sc, NULL));
    sc.stats.sumsq = NAN;
    DSK_TEST_OK(dsk_amp_update(&sc, NULL));
    DSK_TEST_OK(dsk_amp_state_get(&sc, NULL, &s));
    DSK_TEST_EXPECT(s.scale == 256.0f, "scale %g after two non-finite norms, want 256", (double)s.scale);
    dsk_amp_scaler_free(&sc, NULL);
}

static void test_state_resume(void) {
    enum { N = 300 };
    int script[N];
    dsk_amp_scaler a, b;
    dsk_amp_scaler_opts o;
    dsk_amp_scaler_state sa = {NAN, -1, -1}, sb = {NAN, -2, -2}, mid = {NAN, -1, -1};
    memset(&o, 0, sizeof o);
    o.growth_interval = 7; o.hysteresis = 3; o.init_scale = 8192;
    make_script(script, N, 0.2);
    DSK_TEST_OK(dsk_amp_scaler_init(&a, NULL, &o));
    DSK_TEST_OK(dsk_amp_scaler_init(&b, NULL, &o));
    for (int t = 0; t < N; t++) {
        a.stats.found_inf = script[t]; a.stats.sumsq = 2.0;
        DSK_TEST_OK(dsk_amp_update(&a, NULL));
        if (t == N / 2) {
            /* checkpoint a's state into a fresh scaler b and continue there */
            DSK_TEST_OK(dsk_amp_state_get(&a, NULL, &mid));
            DSK_TEST_OK(dsk_amp_state_set(&b, NULL, &mid));
        } else if (t > N / 2) {
            b.stats.found_inf = script[t]; b.stats.sumsq = 2.0;
            DSK_TEST_OK(dsk_amp_update(&b, NULL));
        }
    }
    DSK_TEST_OK(dsk_amp_state_get(&a, NULL, &sa));
    DSK_TEST_OK(dsk_amp_state_get(&b, NULL, &sb));
    DSK_TEST_SAME_BYTES(&sa, &sb, sizeof sa, "resumed state");
    DSK_TEST_EXPECT(sa.scale != 8192.0f || sa.growth_tracker != 0, "trajectory did not move");
    dsk_amp_scaler_free(&a, NULL);
    dsk_amp_scaler_free(&b, NULL);
}

/* ---------------------------------------------------------------- unscale, check, norm */

#define NG 6
static const int64_t g_sizes[NG] = {1, 7, 129, 16384 + 3, 1000, 40000};

static void make_grads(dsk_tensor *g, dsk_dtype dt, double lo, double hi) {
    for (int i = 0; i < NG; i++) {
        g[i] = new_1d(dt, g_sizes[i]);
        fill_rand(&g[i], lo, hi);
    }
}
static void free_grads(dsk_tensor *g) { for (int i = 0; i < NG; i++) dsk_tensor_free(NULL, &g[i]); }

static void test_unscale_matches_f64(dsk_dtype dt, float scale) {
    dsk_tensor g[NG], *gl[NG];
    double *before[NG], want_sumsq = 0.0, got_sumsq = 0.0;
    dsk_amp_scaler sc;
    dsk_amp_scaler_opts o;
    dsk_amp_stats st = {NAN, NAN};
    double inv = (double)(float)(1.0 / (double)scale);
    memset(&o, 0, sizeof o);
    o.init_scale = scale;
    DSK_TEST_OK(dsk_amp_scaler_init(&sc, NULL, &o));
    make_grads(g, dt, 1e-3 * scale, 4.0 * scale);
    for (int i = 0; i < NG; i++) {
        gl[i] = &g[i];
        before[i] = (double *)malloc((size_t)g_sizes[i] * sizeof(double));
        for (int64_t k = 0; k < g_sizes[i]; k++) before[i][k] = get(&g[i], k);
    }
    DSK_TEST_OK(dsk_amp_unscale(&sc, NULL, gl, NG));
    DSK_TEST_OK(dsk_amp_stats_get(&sc, NULL, &st));
    for (int i = 0; i < NG; i++) {
        int64_t n = g_sizes[i], bad = 0, worst = -1;
        for (int64_t k = 0; k < n; k++) {
            double y = get(&g[i], k), exact = before[i][k] / (double)scale;
            /* one rounding of the f32 product, one more to the storage dtype, and inv's own rounding */
            double tol = (unit_roundoff(dt) + 2.0 * 0x1p-24) * fabs(exact) * 1.0000001;
            if (!(fabs(y - exact) <= tol)) { bad++; worst = k; }
            if (dt == DSK_F32 && (float)y != (float)(before[i][k] * inv)) { bad++; worst = k; }
            want_sumsq += exact * exact;
            got_sumsq += y * y;
        }
        DSK_TEST_EXPECT(bad == 0, "%s scale %g grads[%d]: %lld elements off, e.g. [%lld] got %.9g from %.9g", dsk_dtype_name(dt), (double)scale, i,
                        (long long)bad, (long long)worst, worst >= 0 ? get(&g[i], worst) : 0.0, worst >= 0 ? before[i][worst] : 0.0);
        free(before[i]);
    }
    DSK_TEST_EXPECT(st.found_inf == 0.0, "found_inf %g on finite gradients", st.found_inf);
    /* sumsq is of the stored values; against f64 sums of those, and of the exact quotients */
    DSK_TEST_EXPECT(fabs(st.sumsq - got_sumsq) <= 1e-12 * got_sumsq, "sumsq %.17g, f64 of stored values %.17g", st.sumsq, got_sumsq);
    DSK_TEST_EXPECT(fabs(st.sumsq - want_sumsq) <= 4 * unit_roundoff(dt) * want_sumsq, "sumsq %.17g, exact %.17g", st.sumsq, want_sumsq);
    free_grads(g);
    dsk_amp_scaler_free(&sc, NULL);
}

static void test_nonfinite_always_found(void) {
    const dsk_dtype dts[3] = {DSK_F32, DSK_BF16, DSK_F16};
    const double vals[3] = {NAN, INFINITY, -INFINITY};
    int missed = 0, cases = 0;
    for (int d = 0; d < 3; d++)
        for (int ti = 0; ti < NG; ti++)
            for (int where = 0; where < 3; where++)
                for (int v = 0; v < 3; v++) {
                    dsk_tensor g[NG], *gl[NG];
                    dsk_amp_scaler sc;
                    dsk_amp_stats st = {NAN, NAN};
                    int64_t pos = where == 0 ? 0 : where == 1 ? g_sizes[ti] - 1 : dsk_test_rand_int(g_sizes[ti]);
                    make_grads(g, dts[d], 0.1, 100.0);
                    for (int i = 0; i < NG; i++) gl[i] = &g[i];
                    put(&g[ti], pos, vals[v]);
                    DSK_TEST_OK(dsk_amp_scaler_init(&sc, NULL, NULL));
                    DSK_TEST_OK(dsk_amp_unscale(&sc, NULL, gl, NG));
                    DSK_TEST_OK(dsk_amp_stats_get(&sc, NULL, &st));
                    cases++;
                    if (!(st.found_inf > 0) || !dsk_amp_decide(st, 1.0).skip) {
                        missed++;
                        DSK_TEST_EXPECT(0, "%s: %g at grads[%d][%lld] not found (found_inf %g)", dsk_dtype_name(dts[d]), vals[v], ti, (long long)pos, st.found_inf);
                    }
                    free_grads(g);
                    dsk_amp_scaler_free(&sc, NULL);
                }
    DSK_TEST_EXPECT(missed == 0 && cases == 3 * NG * 3 * 3, "%d of %d missed", missed, cases);
}

/* A finite f16 value that becomes Inf once unscaled by a scale < 1 is an overflow too. */
static void test_overflow_by_unscaling(void) {
    dsk_tensor g = new_1d(DSK_F16, 9), *gl[1] = {&g};
    dsk_amp_scaler sc;
    dsk_amp_scaler_opts o;
    dsk_amp_stats st = {NAN, NAN};
    memset(&o, 0, sizeof o);
    o.mode = DSK_AMP_STATIC; o.init_scale = 0.5f;
    fill_rand(&g, 1.0, 10.0);
    put(&g, 4, 40000.0);
    DSK_TEST_OK(dsk_amp_scaler_init(&sc, NULL, &o));
    DSK_TEST_OK(dsk_amp_unscale(&sc, NULL, gl, 1));
    DSK_TEST_OK(dsk_amp_stats_get(&sc, NULL, &st));
    DSK_TEST_EXPECT(st.found_inf > 0 && isinf(get(&g, 4)), "found_inf %g, element %g", st.found_inf, get(&g, 4));
    dsk_amp_scaler_free(&sc, NULL);
    dsk_tensor_free(NULL, &g);
}

static void test_norm_and_clip(void) {
    dsk_tensor g[NG], *gl[NG];
    dsk_amp_scaler sc;
    dsk_amp_scaler_opts o;
    dsk_amp_stats st = {NAN, NAN};
    double ref = 0.0;
    memset(&o, 0, sizeof o);
    o.mode = DSK_AMP_NONE;
    make_grads(g, DSK_F32, 1e-3, 0.5);
    for (int i = 0; i < NG; i++) {
        gl[i] = &g[i];
        for (int64_t k = 0; k < g_sizes[i]; k++) ref += get(&g[i], k) * get(&g[i], k);
    }
    ref = sqrt(ref);
    DSK_TEST_OK(dsk_amp_scaler_init(&sc, NULL, &o));
    DSK_TEST_OK(dsk_amp_unscale(&sc, NULL, gl, NG));
    DSK_TEST_OK(dsk_amp_stats_get(&sc, NULL, &st));
    {
        double maxes[4] = {0.0, 1e9, ref * 0.25, ref * 0.999};
        for (int k = 0; k < 4; k++) {
            dsk_amp_decision d = dsk_amp_decide(st, maxes[k]);
            double want = maxes[k] > 0 ? fmin(1.0, maxes[k] / (ref + 1e-6)) : 1.0;
            DSK_TEST_EXPECT(!d.skip && fabs(d.norm - ref) <= 1e-12 * ref, "norm %.17g, f64 %.17g", d.norm, ref);
            DSK_TEST_EXPECT(fabs((double)d.grad_mult - want) <= 0x1p-24 * want, "max_norm %g: grad_mult %.9g, want %.9g", maxes[k], (double)d.grad_mult, want);
        }
    }
#ifdef _OPENMP
    {
        /* the fixed chunk order makes the f64 sum independent of the thread count */
        dsk_amp_stats s1 = {NAN, NAN}, s2 = {NAN, 0.0};
        int nt = omp_get_max_threads();
        for (int i = 0; i < NG; i++) fill_rand(&g[i], 1e-3, 0.5);
        omp_set_num_threads(1);
        DSK_TEST_OK(dsk_amp_unscale(&sc, NULL, gl, NG));
        DSK_TEST_OK(dsk_amp_stats_get(&sc, NULL, &s1));
        omp_set_num_threads(3);
        DSK_TEST_OK(dsk_amp_unscale(&sc, NULL, gl, NG));
        DSK_TEST_OK(dsk_amp_stats_get(&sc, NULL, &s2));
        omp_set_num_threads(nt);
        DSK_TEST_SAME_BYTES(&s1.sumsq, &s2.sumsq, sizeof s1.sumsq, "sumsq with 1 and 3 threads");
    }
#endif
    /* a tensor holding Inf gives a non-finite norm, which is an overflow */
    put(&g[2], 5, INFINITY);
    DSK_TEST_OK(dsk_amp_unscale(&sc, NULL, gl, NG));
    DSK_TEST_OK(dsk_amp_stats_get(&sc, NULL, &st));
    {
        dsk_amp_decision d = dsk_amp_decide(st, 1.0);
        DSK_TEST_EXPECT(!isfinite(d.norm) && d.skip, "norm %g skip %d", d.norm, d.skip);
    }
    /* squares overflowing nothing in f64 but a huge norm still clips to a finite coefficient */
    {
        dsk_amp_stats big = {0.0, 1e60};
        dsk_amp_decision d = dsk_amp_decide(big, 1.0);
        DSK_TEST_EXPECT(!d.skip && fabs(d.grad_mult - 1e-30) <= 1e-36, "grad_mult %g, want 1e-30", (double)d.grad_mult);
    }
    free_grads(g);
    dsk_amp_scaler_free(&sc, NULL);
}

/* Two ranks holding different shards: each exposes its local stats, one SUM joins them (here
   on the host: get, add, set), and both ranks then decide exactly as one rank holding every
   gradient; an Inf on one rank makes both skip and back off. */
static void test_sharded_ranks_join(void) {
    dsk_tensor g[NG], *gl[NG];
    dsk_amp_scaler rank[2], whole;
    dsk_amp_stats loc[2] = {{NAN, NAN}, {NAN, NAN}}, all = {NAN, NAN}, joined;
    for (int inject = 0; inject < 2; inject++) {
        make_grads(g, DSK_F32, 1.0, 100.0);
        if (inject) put(&g[4], 17, INFINITY);
        for (int i = 0; i < NG; i++) gl[i] = &g[i];
        DSK_TEST_OK(dsk_amp_scaler_init(&rank[0], NULL, NULL));
        DSK_TEST_OK(dsk_amp_scaler_init(&rank[1], NULL, NULL));
        DSK_TEST_OK(dsk_amp_scaler_init(&whole, NULL, NULL));
        {
            /* the single rank sees copies of all shards */
            dsk_tensor c[NG], *cl[NG];
            for (int i = 0; i < NG; i++) { c[i] = new_1d(DSK_F32, g_sizes[i]); memcpy(c[i].data, g[i].data, dsk_tensor_nbytes(&g[i])); cl[i] = &c[i]; }
            DSK_TEST_OK(dsk_amp_unscale(&whole, NULL, cl, NG));
            DSK_TEST_OK(dsk_amp_stats_get(&whole, NULL, &all));
            free_grads(c);
        }
        DSK_TEST_OK(dsk_amp_unscale(&rank[0], NULL, gl, 3));
        DSK_TEST_OK(dsk_amp_unscale(&rank[1], NULL, gl + 3, NG - 3));
        for (int r = 0; r < 2; r++) DSK_TEST_OK(dsk_amp_stats_get(&rank[r], NULL, &loc[r]));
        joined.found_inf = loc[0].found_inf + loc[1].found_inf;
        joined.sumsq = loc[0].sumsq + loc[1].sumsq;
        for (int r = 0; r < 2; r++) {
            dsk_amp_stats back = {NAN, NAN};
            dsk_amp_decision d, w = dsk_amp_decide(all, 0.1);
            dsk_amp_scaler_state s = {NAN, -1, -1};
            DSK_TEST_OK(dsk_amp_stats_set(&rank[r], NULL, &joined));
            DSK_TEST_OK(dsk_amp_stats_get(&rank[r], NULL, &back));
            DSK_TEST_SAME_BYTES(&back, &joined, sizeof back, "stats set and read back");
            d = dsk_amp_decide(back, 0.1);
            DSK_TEST_EXPECT(d.skip == w.skip && d.skip == inject, "rank %d: skip %d, one rank %d, injected %d", r, d.skip, w.skip, inject);
            if (!inject) {
                DSK_TEST_EXPECT(fabs(d.norm - w.norm) <= 1e-14 * w.norm && fabs(d.grad_mult - w.grad_mult) <= 1e-7f * w.grad_mult && d.grad_mult < 1.0f,
                                "rank %d: norm %.17g mult %.9g, one rank %.17g %.9g", r, d.norm, (double)d.grad_mult, w.norm, (double)w.grad_mult);
            }
            DSK_TEST_OK(dsk_amp_update(&rank[r], NULL));
            DSK_TEST_OK(dsk_amp_state_get(&rank[r], NULL, &s));
            DSK_TEST_EXPECT(s.scale == (inject ? 32768.0f : 65536.0f) && s.growth_tracker == (inject ? 0 : 1), "rank %d: scale %g tracker %d", r,
                            (double)s.scale, (int)s.growth_tracker);
        }
        DSK_TEST_EXPECT(!inject || (loc[0].found_inf == 0.0 && loc[1].found_inf == 1.0), "local flags %g %g", loc[0].found_inf, loc[1].found_inf);
        for (int r = 0; r < 2; r++) dsk_amp_scaler_free(&rank[r], NULL);
        dsk_amp_scaler_free(&whole, NULL);
        free_grads(g);
    }
    DSK_TEST_STATUS(dsk_amp_stats_set(&rank[0], NULL, NULL), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("dsk_amp_stats_set: scaler is not initialised");
}

/* ---------------------------------------------------------------- optimizer step, skip */

typedef struct param_set {
    dsk_tensor master, grad, m, v, copy;
} param_set;

static void make_params(param_set *p, dsk_amp_param *ap, int n, const int64_t *sizes, dsk_dtype copy_dt) {
    for (int i = 0; i < n; i++) {
        p[i].master = new_1d(DSK_F32, sizes[i]);
        p[i].grad = new_1d(DSK_F32, sizes[i]);
        p[i].m = new_1d(DSK_F32, sizes[i]);
        p[i].v = new_1d(DSK_F32, sizes[i]);
        p[i].copy = new_1d(copy_dt, sizes[i]);
        fill_rand(&p[i].master, 0.01, 1.0);
        fill_rand(&p[i].grad, 0.01, 1.0);
        fill_rand(&p[i].m, 0.001, 0.1);
        for (int64_t k = 0; k < sizes[i]; k++) ((float *)p[i].v.data)[k] = (float)dsk_test_rand(1e-4, 1e-2);
        for (int64_t k = 0; k < sizes[i]; k++) put(&p[i].copy, k, get(&p[i].master, k));
        ap[i].name = "w";
        ap[i].master = &p[i].master; ap[i].grad = &p[i].grad; ap[i].m = &p[i].m; ap[i].v = &p[i].v; ap[i].copy = &p[i].copy;
    }
}
static void free_params(param_set *p, int n) {
    for (int i = 0; i < n; i++) {
        dsk_tensor_free(NULL, &p[i].master); dsk_tensor_free(NULL, &p[i].grad); dsk_tensor_free(NULL, &p[i].m);
        dsk_tensor_free(NULL, &p[i].v); dsk_tensor_free(NULL, &p[i].copy);
    }
}
/* Concatenated bytes of every tensor but the gradients. */
static size_t snapshot(const param_set *p, int n, unsigned char *buf) {
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        const dsk_tensor *ts[4] = {&p[i].master, &p[i].m, &p[i].v, &p[i].copy};
        for (int k = 0; k < 4; k++) { memcpy(buf + off, ts[k]->data, dsk_tensor_nbytes(ts[k])); off += dsk_tensor_nbytes(ts[k]); }
    }
    return off;
}

static void test_step_skip_and_apply(void) {
    enum { NP = 3 };
    const int64_t sizes[NP] = {7, 129, 1};
    param_set p[NP];
    dsk_amp_param ap[NP];
    dsk_adamw_opts ao;
    unsigned char *a = (unsigned char *)malloc(1 << 16), *b = (unsigned char *)malloc(1 << 16);
    size_t na, nb;
    dsk_amp_stats bad = {1.0, 3.0}, good = {0.0, 3.0};
    dsk_amp_decision skip = dsk_amp_decide(bad, 1.0), go = dsk_amp_decide(good, 0.5);
    ao = dsk_adamw_defaults();
    ao.lr = 1e-2f; ao.weight_decay = 0.1f;
    make_params(p, ap, NP, sizes, DSK_BF16);
    na = snapshot(p, NP, a);
    DSK_TEST_EXPECT(skip.skip && !go.skip, "decisions %d %d", skip.skip, go.skip);
    DSK_TEST_OK(dsk_amp_step(NULL, ap, NP, &ao, 5, &skip, DSK_AMP_ROUND_NEAREST, 1));
    DSK_TEST_OK(dsk_amp_step(NULL, ap, NP, &ao, 5, &skip, DSK_AMP_ROUND_STOCHASTIC, 1));
    nb = snapshot(p, NP, b);
    DSK_TEST_EXPECT(na == nb, "snapshot sizes");
    DSK_TEST_SAME_BYTES(a, b, na, "masters, moments and copies after a skipped step");

    /* An applied step follows AdamW in f64 on grad * grad_mult, copy = RNE(master). */
    {
        double *want[NP], b1 = 0.9, b2 = 0.999, eps = 1e-8, lr = 1e-2, wd = 0.1, c = go.grad_mult;
        int64_t step = 5;
        double bc1 = 1 - pow(b1, (double)step), bc2 = 1 - pow(b2, (double)step);
        for (int i = 0; i < NP; i++) {
            want[i] = (double *)malloc((size_t)sizes[i] * sizeof(double));
            for (int64_t k = 0; k < sizes[i]; k++) {
                double g = get(&p[i].grad, k) * c, m = b1 * get(&p[i].m, k) + (1 - b1) * g, v = b2 * get(&p[i].v, k) + (1 - b2) * g * g;
                double w = get(&p[i].master, k);
                want[i][k] = w - lr * wd * w - lr * (m / bc1) / (sqrt(v / bc2) + eps);
            }
        }
        DSK_TEST_OK(dsk_amp_step(NULL, ap, NP, &ao, step, &go, DSK_AMP_ROUND_NEAREST, 1));
        for (int i = 0; i < NP; i++) {
            int64_t off = 0;
            DSK_TEST_CLOSE((const float *)p[i].master.data, want[i], sizes[i], 1e-5, 1e-7, "master after AdamW");
            for (int64_t k = 0; k < sizes[i]; k++)
                off += ((uint16_t *)p[i].copy.data)[k] != dsk_f32_to_bf16(((float *)p[i].master.data)[k]);
            DSK_TEST_EXPECT(off == 0, "params[%d]: %lld copy elements are not RNE of the master", i, (long long)off);
            free(want[i]);
        }
    }
    free(a); free(b);
    free_params(p, NP);
}

/* The device-resident step's entry points on the CPU (host memory) give the host-argument
   calls' bytes: four steps (the third with an Inf: skipped), stochastic copies keyed on the
   scheduled step, lr only from the schedule. */
static void test_step_dev_cpu(void) {
    enum { NP = 3, STEPS = 4 };
    const int64_t sizes[NP] = {7, 129, 1};
    param_set pa[NP], pb[NP];
    dsk_amp_param aa[NP], ab[NP];
    dsk_amp_scaler sa, sb;
    dsk_amp_scaler_opts so;
    dsk_amp_dstep ds;
    dsk_adamw_opts ao = dsk_adamw_defaults();
    unsigned char *a = (unsigned char *)malloc(1 << 16), *b = (unsigned char *)malloc(1 << 16);
    int64_t applied = 0;
    memset(&so, 0, sizeof so);
    so.init_scale = 256.0f;
    make_params(pa, aa, NP, sizes, DSK_BF16);
    make_params(pb, ab, NP, sizes, DSK_BF16);
    for (int i = 0; i < NP; i++) {
        const dsk_tensor *src[5] = {&pa[i].master, &pa[i].grad, &pa[i].m, &pa[i].v, &pa[i].copy};
        dsk_tensor *dst[5] = {&pb[i].master, &pb[i].grad, &pb[i].m, &pb[i].v, &pb[i].copy};
        for (int k = 0; k < 5; k++) memcpy(dst[k]->data, src[k]->data, dsk_tensor_nbytes(src[k]));
    }
    DSK_TEST_OK(dsk_amp_scaler_init(&sa, NULL, &so));
    DSK_TEST_OK(dsk_amp_scaler_init(&sb, NULL, &so));
    DSK_TEST_OK(dsk_amp_dstep_init(&ds, NULL));
    for (int k = 0; k < STEPS; k++) {
        dsk_tensor *ga[NP], *gb[NP];
        dsk_amp_stats st = {NAN, NAN};
        dsk_amp_decision dec;
        dsk_amp_step_vals v;
        size_t na, nb;
        float lr = 3e-3f * (float)(k + 2) / 5.0f;
        memset(&v, 0xff, sizeof v);
        for (int i = 0; i < NP; i++) {
            fill_rand(&pa[i].grad, 1.0, 300.0);
            if (k == 2 && i == 1) put(&pa[i].grad, 5, INFINITY);
            memcpy(pb[i].grad.data, pa[i].grad.data, dsk_tensor_nbytes(&pa[i].grad));
            ga[i] = &pa[i].grad;
            gb[i] = &pb[i].grad;
        }
        DSK_TEST_OK(dsk_amp_unscale(&sa, NULL, ga, NP));
        DSK_TEST_OK(dsk_amp_stats_get(&sa, NULL, &st));
        dec = dsk_amp_decide(st, 0.5);
        ao.lr = lr;
        DSK_TEST_OK(dsk_amp_step(NULL, aa, NP, &ao, applied + 1, &dec, DSK_AMP_ROUND_STOCHASTIC, 9));
        DSK_TEST_OK(dsk_amp_update(&sa, NULL));
        ao.lr = NAN; /* not read */
        DSK_TEST_OK(dsk_amp_dstep_schedule(&ds, NULL, lr, applied + 1, &ao));
        DSK_TEST_OK(dsk_amp_dstep_upload(&ds, NULL));
        DSK_TEST_OK(dsk_amp_unscale(&sb, NULL, gb, NP));
        DSK_TEST_OK(dsk_amp_decide_dev(&ds, NULL, &sb, 0.5));
        DSK_TEST_OK(dsk_amp_step_dev(NULL, ab, NP, &ao, &ds, DSK_AMP_ROUND_STOCHASTIC, 9));
        DSK_TEST_OK(dsk_amp_update(&sb, NULL));
        DSK_TEST_OK(dsk_amp_dstep_get(&ds, NULL, &v));
        DSK_TEST_EXPECT(v.skip == dec.skip && v.skip == (k == 2) && v.grad_mult == dec.grad_mult && v.norm == dec.norm &&
                            v.step == applied + 1 && v.lr == lr,
                        "step %d: dstep (skip %d, grad_mult %g, step %lld) vs host (%d, %g, %lld)", k, (int)v.skip,
                        (double)v.grad_mult, (long long)v.step, dec.skip, (double)dec.grad_mult, (long long)(applied + 1));
        na = snapshot(pa, NP, a);
        nb = snapshot(pb, NP, b);
        DSK_TEST_EXPECT(na == nb, "snapshot sizes %zu %zu", na, nb);
        DSK_TEST_SAME_BYTES(b, a, na, "masters, moments and copies");
        DSK_TEST_EXPECT(memcmp(&sa.state, &sb.state, sizeof sa.state) == 0, "step %d: scaler states differ", k);
        applied += !dec.skip;
    }
    dsk_amp_dstep_free(&ds, NULL);
    dsk_amp_scaler_free(&sa, NULL);
    dsk_amp_scaler_free(&sb, NULL);
    free_params(pa, NP);
    free_params(pb, NP);
    free(a); free(b);
}

/* Each error path of the device-resident step: nothing is written. */
static void test_step_dev_errors(void) {
    enum { NP = 1 };
    const int64_t sizes[NP] = {5};
    param_set p[NP];
    dsk_amp_param ap[NP];
    dsk_amp_dstep ds, none;
    dsk_amp_scaler sc;
    dsk_amp_step_vals v;
    dsk_adamw_opts ao = dsk_adamw_defaults(), bad = ao;
    unsigned char a[256], b[256];
    size_t na;
    memset(&none, 0, sizeof none);
    make_params(p, ap, NP, sizes, DSK_BF16);
    DSK_TEST_OK(dsk_amp_scaler_init(&sc, NULL, NULL));
    DSK_TEST_STATUS(dsk_amp_dstep_init(NULL, NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_amp_dstep_init: dstep is NULL");
    DSK_TEST_STATUS(dsk_amp_dstep_upload(&none, NULL), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("dsk_amp_dstep_upload: dstep is not initialised");
    DSK_TEST_OK(dsk_amp_dstep_init(&ds, NULL));
    memset(&v, 0xff, sizeof v);
    DSK_TEST_OK(dsk_amp_dstep_get(&ds, NULL, &v));
    DSK_TEST_EXPECT(v.skip == 1 && v.step == 0, "a new dstep: skip %d step %lld", (int)v.skip, (long long)v.step);
    na = snapshot(p, NP, a);
    DSK_TEST_OK(dsk_amp_decide_dev(&ds, NULL, &sc, 1.0)); /* stats 0: go */
    DSK_TEST_STATUS(dsk_amp_step_dev(NULL, ap, NP, &ao, &ds, DSK_AMP_ROUND_NEAREST, 1), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("dsk_amp_step_dev: the dstep has no schedule");
    DSK_TEST_STATUS(dsk_amp_dstep_schedule(&ds, NULL, NAN, 1, &ao), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_amp_dstep_schedule: lr nan");
    DSK_TEST_STATUS(dsk_amp_dstep_schedule(&ds, NULL, 1e-3f, 0, &ao), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("step 0 must be >= 1");
    bad.beta2 = 1.0f;
    DSK_TEST_STATUS(dsk_amp_dstep_schedule(&ds, NULL, 1e-3f, 1, &bad), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("beta2 1 must be in [0, 1)");
    DSK_TEST_STATUS(dsk_amp_dstep_schedule(&ds, NULL, 1e-3f, 1, NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("AdamW options are NULL");
    DSK_TEST_OK(dsk_amp_dstep_schedule(&ds, NULL, 1e-3f, 1, &ao));
    bad = ao;
    bad.beta1 = 0.5f;
    DSK_TEST_STATUS(dsk_amp_step_dev(NULL, ap, NP, &bad, &ds, DSK_AMP_ROUND_NEAREST, 1), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("betas (0.5, 0.999) differ from the schedule's (0.9, 0.999)");
    bad = ao;
    bad.eps = 0.0f;
    DSK_TEST_STATUS(dsk_amp_step_dev(NULL, ap, NP, &bad, &ds, DSK_AMP_ROUND_NEAREST, 1), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("eps 0 must be finite and > 0");
    DSK_TEST_STATUS(dsk_amp_step_dev(NULL, ap, NP, &ao, &ds, (dsk_amp_round)7, 1), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("unknown rounding mode 7");
    DSK_TEST_STATUS(dsk_amp_step_dev(NULL, ap, -1, &ao, &ds, DSK_AMP_ROUND_NEAREST, 1), DSK_ERR_ARG);
    ap[0].m = NULL;
    DSK_TEST_STATUS(dsk_amp_step_dev(NULL, ap, NP, &ao, &ds, DSK_AMP_ROUND_NEAREST, 1), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("params[0] \"w\" m is NULL");
    ap[0].m = &p[0].m;
    DSK_TEST_EXPECT(snapshot(p, NP, b) == na, "snapshot size");
    DSK_TEST_SAME_BYTES(b, a, na, "nothing written by the failed calls");
    DSK_TEST_STATUS(dsk_amp_decide_dev(&ds, NULL, NULL, 1.0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_amp_decide_dev: scaler is NULL");
    DSK_TEST_STATUS(dsk_amp_dstep_get(&ds, NULL, NULL), DSK_ERR_ARG);
    dsk_amp_dstep_free(&ds, NULL);
    dsk_amp_dstep_free(&ds, NULL); /* freed twice: fine */
    dsk_amp_scaler_free(&sc, NULL);
    free_params(p, NP);
}

/* Stochastic copies depend only on (seed, tensor, step): stopping after step 3, saving masters
   and moments and resuming in fresh tensors gives the straight run's bytes; a parameter
   without a copy is updated all the same. */
static void test_step_resume_stochastic(void) {
    enum { NP = 2, STEPS = 6, STOP = 3 };
    const int64_t sizes[NP] = {129, 33};
    param_set a[NP], b[NP];
    dsk_amp_param pa[NP], pb[NP];
    dsk_adamw_opts ao;
    dsk_amp_stats good = {0.0, 2.0};
    dsk_amp_decision d = dsk_amp_decide(good, 0.0);
    int differs_from_rne = 0;
    uint64_t saved = dsk_test_g.rng;
    ao = dsk_adamw_defaults();
    ao.lr = 3e-3f; ao.weight_decay = 0.0f;
    make_params(a, pa, NP, sizes, DSK_F16);
    dsk_test_g.rng = saved; /* the same random start for run b */
    make_params(b, pb, NP, sizes, DSK_F16);
    pa[1].copy = pb[1].copy = NULL;
    for (int64_t step = 1; step <= STEPS; step++) {
        DSK_TEST_OK(dsk_amp_step(NULL, pa, NP, &ao, step, &d, DSK_AMP_ROUND_STOCHASTIC, 99));
        if (step <= STOP) DSK_TEST_OK(dsk_amp_step(NULL, pb, NP, &ao, step, &d, DSK_AMP_ROUND_STOCHASTIC, 99));
    }
    {
        /* "checkpoint" run b: fresh tensors holding its masters and moments, copies not saved */
        param_set c[NP];
        dsk_amp_param pc[NP];
        make_params(c, pc, NP, sizes, DSK_F16);
        for (int i = 0; i < NP; i++) {
            memcpy(c[i].master.data, b[i].master.data, dsk_tensor_nbytes(&b[i].master));
            memcpy(c[i].m.data, b[i].m.data, dsk_tensor_nbytes(&b[i].m));
            memcpy(c[i].v.data, b[i].v.data, dsk_tensor_nbytes(&b[i].v));
            memcpy(c[i].grad.data, a[i].grad.data, dsk_tensor_nbytes(&a[i].grad));
        }
        pc[1].copy = NULL;
        for (int64_t step = STOP + 1; step <= STEPS; step++)
            DSK_TEST_OK(dsk_amp_step(NULL, pc, NP, &ao, step, &d, DSK_AMP_ROUND_STOCHASTIC, 99));
        for (int i = 0; i < NP; i++) {
            DSK_TEST_SAME_BYTES(a[i].master.data, c[i].master.data, dsk_tensor_nbytes(&a[i].master), "resumed master");
            DSK_TEST_SAME_BYTES(a[i].v.data, c[i].v.data, dsk_tensor_nbytes(&a[i].v), "resumed v");
        }
        DSK_TEST_SAME_BYTES(a[0].copy.data, c[0].copy.data, dsk_tensor_nbytes(&a[0].copy), "resumed stochastic copy");
        for (int64_t k = 0; k < sizes[0]; k++)
            differs_from_rne += ((uint16_t *)a[0].copy.data)[k] != dsk_f32_to_f16(((float *)a[0].master.data)[k]);
        DSK_TEST_EXPECT(differs_from_rne > 0, "stochastic copies all equal RNE: rounding was not stochastic");
        free_params(c, NP);
    }
    free_params(a, NP);
    free_params(b, NP);
}

/* ---------------------------------------------------------------- casts, stochastic rounding */

/* The two neighbours of x in dt (lo <= x <= hi), found by walking codes independently. */
static void neighbours(dsk_dtype dt, float x, double *lo, double *hi) {
    uint16_t h = dt == DSK_BF16 ? dsk_f32_to_bf16(x) : dsk_f32_to_f16(x);
    double v = dt == DSK_BF16 ? dsk_bf16_to_f32(h) : dsk_f16_to_f32(h);
    uint16_t other = (uint16_t)((v < x) == (x > 0) ? h + 1 : h - 1); /* away from or toward zero in magnitude */
    double w = dt == DSK_BF16 ? dsk_bf16_to_f32(other) : dsk_f16_to_f32(other);
    *lo = v < w ? v : w;
    *hi = v < w ? w : v;
    if (v == x) *lo = *hi = v;
}

static void test_stochastic_rounding(dsk_dtype dt) {
    enum { N = 1 << 16, NV = 10 };
    float vals[NV];
    dsk_tensor src = new_1d(DSK_F32, N), dst = new_1d(dt, N), again = new_1d(dt, N), other = new_1d(dt, N);
    int failures = 0;
    for (int j = 0; j < NV; j++) vals[j] = (float)(dsk_test_rand(0.1, 3.0) * (j & 1 ? -1 : 1) * pow(2.0, (double)(j - 5) * 2));
    if (dt == DSK_F16) { vals[NV - 2] = 3.7e-6f; vals[NV - 1] = -1.3e-7f; } /* f16 subnormals */
    else { vals[NV - 2] = 1.5e-39f; vals[NV - 1] = -3.0e30f; }                /* bf16 subnormal, large */
    for (int j = 0; j < NV; j++) {
        double lo, hi, sum = 0.0, p, sigma, mean;
        int64_t n_lo = 0, n_hi = 0;
        for (int64_t i = 0; i < N; i++) ((float *)src.data)[i] = vals[j];
        DSK_TEST_OK(dsk_amp_cast(NULL, &dst, &src, DSK_AMP_ROUND_STOCHASTIC, 1234, (uint64_t)j, 77));
        neighbours(dt, vals[j], &lo, &hi);
        for (int64_t i = 0; i < N; i++) {
            double y = get(&dst, i);
            sum += y;
            n_lo += y == lo; n_hi += y == hi;
        }
        mean = sum / N;
        p = hi > lo ? ((double)vals[j] - lo) / (hi - lo) : 0.0;
        sigma = (hi - lo) * sqrt(p * (1 - p) / N);
        if (n_lo + n_hi != N || fabs(mean - (double)vals[j]) > 5 * sigma + 1e-3 * (hi - lo) / sqrt((double)N)) {
            failures++;
            DSK_TEST_EXPECT(0, "%s value %.9g: mean %.12g off by %.3g (5 sigma %.3g); %lld low %lld high of %d", dsk_dtype_name(dt), (double)vals[j], mean,
                            mean - vals[j], 5 * sigma, (long long)n_lo, (long long)n_hi, N);
        }
        DSK_TEST_EXPECT(p < 0.02 || p > 0.98 || (n_lo > 0 && n_hi > 0), "value %g: both neighbours must occur (p %.3f)", (double)vals[j], p);
        /* repeatable for the same (seed, tensor, step); another step gives other draws */
        DSK_TEST_OK(dsk_amp_cast(NULL, &again, &src, DSK_AMP_ROUND_STOCHASTIC, 1234, (uint64_t)j, 77));
        DSK_TEST_SAME_BYTES(dst.data, again.data, dsk_tensor_nbytes(&dst), "same seed, tensor and step");
        DSK_TEST_OK(dsk_amp_cast(NULL, &other, &src, DSK_AMP_ROUND_STOCHASTIC, 1234, (uint64_t)j, 78));
        if (p > 0.01 && p < 0.99) DSK_TEST_EXPECT(memcmp(dst.data, other.data, dsk_tensor_nbytes(&dst)) != 0, "step 77 and 78 drew the same bits");
    }
    /* representable values, NaN and Inf pass unchanged; nearest mode is RNE */
    {
        float specials[5] = {1.0f, -0.0f, INFINITY, -INFINITY, NAN};
        for (int k = 0; k < 5; k++) {
            for (int64_t i = 0; i < N; i++) ((float *)src.data)[i] = specials[k];
            DSK_TEST_OK(dsk_amp_cast(NULL, &dst, &src, DSK_AMP_ROUND_STOCHASTIC, 9, 1, 1));
            for (int64_t i = 0; i < N; i += 997) {
                double y = get(&dst, i);
                if (!(y == specials[k] || (isnan(y) && isnan(specials[k])))) { DSK_TEST_EXPECT(0, "%g became %g", (double)specials[k], y); break; }
            }
        }
        fill_rand(&src, 1e-3, 1e3);
        DSK_TEST_OK(dsk_amp_cast(NULL, &dst, &src, DSK_AMP_ROUND_NEAREST, 9, 1, 1));
        for (int64_t i = 0; i < N; i++) {
            float x = ((float *)src.data)[i];
            double lo, hi, y = get(&dst, i);
            neighbours(dt, x, &lo, &hi);
            if (fabs(y - x) > fabs((lo == y ? hi : lo) - x) || (y != lo && y != hi)) { DSK_TEST_EXPECT(0, "nearest of %.9g gave %.9g", (double)x, y); break; }
        }
    }
    /* the documented stream: element i rounds with word i % 4 of Philox(key, i / 4) */
    {
        uint64_t key = dsk_amp_sr_key(5, 6, 7);
        int64_t off = 0;
        fill_rand(&src, 1e-6, 1e4);
        DSK_TEST_OK(dsk_amp_cast(NULL, &dst, &src, DSK_AMP_ROUND_STOCHASTIC, 5, 6, 7));
        for (int64_t i = 0; i < N; i++) {
            float x = ((float *)src.data)[i];
            uint32_t r = dsk_amp_sr_bits(key, (uint64_t)i);
            off += ((uint16_t *)dst.data)[i] != (dt == DSK_BF16 ? dsk_amp_f32_to_bf16_sr(x, r) : dsk_amp_f32_to_f16_sr(x, r));
        }
        DSK_TEST_EXPECT(off == 0, "%lld elements not rounded with their documented random word", (long long)off);
    }
    DSK_TEST_EXPECT(failures == 0, "%d biased values", failures);
    dsk_tensor_free(NULL, &src); dsk_tensor_free(NULL, &dst); dsk_tensor_free(NULL, &again); dsk_tensor_free(NULL, &other);
}

/* ---------------------------------------------------------------- FP8 */

/* Independent decoders from the bit fields (OCP FP8: e4m3fn bias 7, e5m2 bias 15). */
static double decode_e4m3(int b) {
    int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    double v;
    if (e == 15 && m == 7) return NAN;
    v = e == 0 ? m * pow(2.0, -9) : (1.0 + m / 8.0) * pow(2.0, e - 7);
    return s ? -v : v;
}
static double decode_e5m2(int b) {
    int s = b >> 7, e = (b >> 2) & 31, m = b & 3;
    double v;
    if (e == 31) return m ? NAN : (s ? -INFINITY : INFINITY);
    v = e == 0 ? m * pow(2.0, -16) : (1.0 + m / 4.0) * pow(2.0, e - 15);
    return s ? -v : v;
}
static double decode(dsk_dtype f, int b) { return f == DSK_E4M3 ? decode_e4m3(b) : decode_e5m2(b); }

static dsk_tensor scalar(float v) {
    dsk_tensor t = new_tensor(DSK_F32, 0, NULL);
    *(float *)t.data = v;
    return t;
}

static void test_fp8_round_trip(dsk_dtype fmt) {
    dsk_tensor x = new_1d(DSK_F32, 256), q = new_1d(fmt, 256), y = new_1d(DSK_F32, 256);
    int exps[3] = {0, 5, -7};
    for (int e = 0; e < 3; e++) {
        float s = ldexpf(1.0f, exps[e]);
        dsk_tensor sc = scalar(s);
        int n = 0, wrong = 0;
        int codes[256];
        for (int b = 0; b < 256; b++) {
            double v = decode(fmt, b);
            if (isnan(v) || isinf(v)) continue;
            codes[n] = b;
            ((float *)x.data)[n++] = (float)(v / s);
        }
        x.shape[0] = q.shape[0] = y.shape[0] = n;
        dsk_test_poison_bytes(q.data, 256);
        dsk_test_poison_f32((float *)y.data, 256);
        DSK_TEST_OK(dsk_amp_fp8_quantize(NULL, &q, &x, &sc));
        DSK_TEST_OK(dsk_amp_fp8_dequantize(NULL, &y, &q, &sc));
        for (int i = 0; i < n; i++) {
            if (((uint8_t *)q.data)[i] != codes[i] || ((float *)y.data)[i] != ((float *)x.data)[i]) {
                if (!wrong) DSK_TEST_EXPECT(0, "%s scale 2^%d: value %.9g -> code %02x (want %02x) -> %.9g", dsk_dtype_name(fmt), exps[e],
                                            (double)((float *)x.data)[i], ((uint8_t *)q.data)[i], codes[i], (double)((float *)y.data)[i]);
                wrong++;
            }
        }
        DSK_TEST_EXPECT(wrong == 0 && n == (fmt == DSK_E4M3 ? 254 : 248), "%d of %d representable values wrong", wrong, n);
        dsk_tensor_free(NULL, &sc);
    }
    /* overflow: e4m3 saturates (Inf too), e5m2 becomes Inf; NaN stays NaN */
    {
        float big[6] = {500.0f, -1e6f, INFINITY, -INFINITY, 61440.0f, NAN};
        dsk_tensor one = scalar(1.0f);
        x.shape[0] = q.shape[0] = y.shape[0] = 6;
        memcpy(x.data, big, sizeof big);
        DSK_TEST_OK(dsk_amp_fp8_quantize(NULL, &q, &x, &one));
        DSK_TEST_OK(dsk_amp_fp8_dequantize(NULL, &y, &q, &one));
        for (int i = 0; i < 6; i++) {
            double got = ((float *)y.data)[i], want;
            if (isnan(big[i])) want = NAN;
            else if (fmt == DSK_E4M3) want = big[i] > 0 ? 448.0 : -448.0;
            else want = big[i] == 500.0f ? 512.0 : big[i] > 0 ? INFINITY : -INFINITY;
            DSK_TEST_EXPECT(got == want || (isnan(got) && isnan(want)), "%s: %g -> %g, want %g", dsk_dtype_name(fmt), (double)big[i], got, want);
        }
        dsk_tensor_free(NULL, &one);
    }
    /* a NaN scale: every code a NaN with the sign of x times the scale's (+), the hardware's aside
       (x86 gives 1 * NaN and -2 * NaN the scale's NaN, a GPU +NaN; -NaN * NaN keeps x's on x86) */
    {
        float v[3] = {-NAN, 1.0f, -2.0f};
        dsk_tensor nan_scale = scalar(NAN);
        x.shape[0] = q.shape[0] = 3;
        memcpy(x.data, v, sizeof v);
        dsk_test_poison_bytes(q.data, 3);
        DSK_TEST_OK(dsk_amp_fp8_quantize(NULL, &q, &x, &nan_scale));
        for (int i = 0; i < 3; i++) {
            uint8_t c = ((uint8_t *)q.data)[i];
            DSK_TEST_EXPECT(isnan(decode(fmt, c)) && (c >> 7) == (signbit(v[i]) != 0),
                            "%s: %g times a NaN scale -> code 0x%02x, want a NaN of x's sign", dsk_dtype_name(fmt),
                            (double)v[i], c);
        }
        dsk_tensor_free(NULL, &nan_scale);
    }
    dsk_tensor_free(NULL, &x); dsk_tensor_free(NULL, &q); dsk_tensor_free(NULL, &y);
}

/* |dequant - x| within half a step of the format at |x * scale|, over the scale. */
static double fp8_bound(dsk_dtype fmt, double x, double scale) {
    double ax = fabs(x * scale), rel = fmt == DSK_E4M3 ? 0x1p-4 : 0x1p-3, sub = fmt == DSK_E4M3 ? 0x1p-10 : 0x1p-17;
    return (fmax(rel * ax, sub) / scale) * 1.0001 + 1e-7 * fabs(x);
}

static void test_fp8_current_scaling(dsk_dtype fmt, dsk_dtype xdt, int pow2, int64_t n) {
    dsk_tensor x = new_1d(xdt, n), q = new_1d(fmt, n), y = new_1d(DSK_F32, n), sc = scalar(NAN), am = scalar(NAN);
    double amax = 0, fmx = fmt == DSK_E4M3 ? 448.0 : 57344.0, want;
    int64_t bad = 0;
    fill_rand(&x, 1e-4, 37.0);
    for (int64_t i = 0; i < n; i++) amax = fmax(amax, fabs(get(&x, i)));
    DSK_TEST_OK(dsk_amp_fp8_current_scale(NULL, &sc, &am, &x, fmt, 0, pow2));
    want = (double)(float)((float)fmx / (float)amax);
    if (pow2) want = pow(2.0, floor(log2(fmx / amax)));
    DSK_TEST_EXPECT(*(float *)am.data == (float)amax, "amax %g, want %g", (double)*(float *)am.data, amax);
    DSK_TEST_EXPECT(*(float *)sc.data == (float)want, "scale %.9g, want %.9g", (double)*(float *)sc.data, want);
    DSK_TEST_OK(dsk_amp_fp8_quantize(NULL, &q, &x, &sc));
    DSK_TEST_OK(dsk_amp_fp8_dequantize(NULL, &y, &q, &sc));
    for (int64_t i = 0; i < n; i++) {
        double xi = get(&x, i), yi = ((float *)y.data)[i];
        if (!(fabs(yi - xi) <= fp8_bound(fmt, xi, *(float *)sc.data))) {
            if (!bad) DSK_TEST_EXPECT(0, "%s: x[%lld] %.9g -> %.9g beyond bound %.3g", dsk_dtype_name(fmt), (long long)i, xi, yi, fp8_bound(fmt, xi, *(float *)sc.data));
            bad++;
        }
    }
    /* amax 0 (all zero) and non-finite amax give scale 1 */
    for (int64_t i = 0; i < n; i++) put(&x, i, 0.0);
    DSK_TEST_OK(dsk_amp_fp8_current_scale(NULL, &sc, NULL, &x, fmt, 0, pow2));
    DSK_TEST_EXPECT(*(float *)sc.data == 1.0f, "scale %g for amax 0", (double)*(float *)sc.data);
    put(&x, n - 1, NAN);
    DSK_TEST_OK(dsk_amp_fp8_current_scale(NULL, &sc, &am, &x, fmt, 0, pow2));
    DSK_TEST_EXPECT(*(float *)sc.data == 1.0f && isnan(*(float *)am.data), "scale %g amax %g with a NaN", (double)*(float *)sc.data, (double)*(float *)am.data);
    dsk_tensor_free(NULL, &x); dsk_tensor_free(NULL, &q); dsk_tensor_free(NULL, &y); dsk_tensor_free(NULL, &sc); dsk_tensor_free(NULL, &am);
}

static void test_fp8_delayed(dsk_amp_amax_algo algo, int margin, int pow2) {
    enum { L = 4, STEPS = 12 };
    const double amaxes[STEPS] = {3.0, 0.5, 100.0, 0.25, 0.0, 7.0, 2.0, 1.0, 0.75, 0.125, 9.0, 0.0};
    dsk_amp_fp8_delayed d;
    dsk_amp_fp8_delayed_opts o;
    dsk_tensor x = new_1d(DSK_F32, 129), q = new_1d(DSK_E4M3, 129), q2 = new_1d(DSK_E4M3, 129);
    double hist[STEPS], ref_scale = 1.0;
    memset(&o, 0, sizeof o);
    o.history_len = L; o.margin = margin; o.algo = algo; o.pow2 = pow2;
    DSK_TEST_OK(dsk_amp_fp8_delayed_init(&d, NULL, &o));
    DSK_TEST_EXPECT(d.opts.fmt == DSK_E4M3, "default format %s", dsk_dtype_name(d.opts.fmt));
    for (int t = 0; t < STEPS; t++) {
        double a = 0.0;
        dsk_tensor prev = scalar((float)ref_scale);
        fill_rand(&x, 0.01, 1.0);
        for (int64_t i = 0; i < 129; i++) put(&x, i, get(&x, i) * amaxes[t]);
        if (amaxes[t] > 0) put(&x, 50, -amaxes[t]);
        for (int64_t i = 0; i < 129; i++) a = fmax(a, fabs(get(&x, i)));
        hist[t] = a;
        /* two quantisations in a step: the history keeps the larger amax */
        DSK_TEST_OK(dsk_amp_fp8_delayed_quantize(&d, NULL, &q2, &x));
        for (int64_t i = 0; i < 129; i++) put(&x, i, get(&x, i) * 0.5);
        DSK_TEST_OK(dsk_amp_fp8_delayed_quantize(&d, NULL, &q, &x));
        /* quantised with the previous step's scale */
        DSK_TEST_OK(dsk_amp_fp8_quantize(NULL, &q2, &x, &prev));
        DSK_TEST_SAME_BYTES(q.data, q2.data, 129, "delayed quantise uses the current scale");
        DSK_TEST_OK(dsk_amp_fp8_delayed_update(&d, NULL));
        {
            double am = 0.0, s;
            if (algo == DSK_AMP_AMAX_MOST_RECENT) am = hist[t];
            else for (int k = t - L + 1; k <= t; k++) if (k >= 0) am = fmax(am, hist[k]);
            if (am > 0) {
                s = (double)((448.0f / (float)am) / (float)pow(2.0, margin));
                if (pow2) s = pow(2.0, floor(log2(s)));
                ref_scale = s;
            }
            DSK_TEST_EXPECT(*(float *)d.scale.data == (float)ref_scale, "step %d: scale %.9g, want %.9g", t, (double)*(float *)d.scale.data, ref_scale);
        }
        dsk_tensor_free(NULL, &prev);
    }
    dsk_amp_fp8_delayed_free(&d, NULL);
    dsk_amp_fp8_delayed_free(&d, NULL);
    dsk_tensor_free(NULL, &x); dsk_tensor_free(NULL, &q); dsk_tensor_free(NULL, &q2);
}

static void test_fp8_blocks(dsk_dtype fmt, dsk_dtype xdt, int64_t R, int64_t C, int br, int bc, int pow2) {
    int64_t SR = (R + br - 1) / br, SC = (C + bc - 1) / bc, bad = 0;
    dsk_tensor x = new_2d(xdt, R, C), q = new_2d(fmt, R, C), sc = new_2d(DSK_F32, SR, SC), y = new_2d(DSK_F32, R, C);
    double fmx = fmt == DSK_E4M3 ? 448.0 : 57344.0;
    fill_rand(&x, 1e-3, 1.0);
    /* blocks of very different magnitudes, one all-zero block when there are several */
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < C; c++) put(&x, r * C + c, get(&x, r * C + c) * pow(4.0, (double)(((r / br) * 3 + (c / bc)) % 7) - 3));
    if (SR * SC > 2)
        for (int64_t r = 0; r < (R < br ? R : br); r++)
            for (int64_t c = bc; c < (C < 2 * bc ? C : 2 * bc); c++) put(&x, r * C + c, 0.0);
    dsk_test_poison_f32((float *)sc.data, SR * SC);
    dsk_test_poison_f32((float *)y.data, R * C);
    DSK_TEST_OK(dsk_amp_fp8_block_quantize(NULL, &q, &sc, &x, br, bc, pow2));
    DSK_TEST_OK(dsk_amp_fp8_block_dequantize(NULL, &y, &q, &sc, br, bc));
    for (int64_t b = 0; b < SR * SC; b++) {
        double am = 0.0, want;
        for (int64_t r = (b / SC) * br; r < R && r < (b / SC + 1) * br; r++)
            for (int64_t c = (b % SC) * bc; c < C && c < (b % SC + 1) * bc; c++) am = fmax(am, fabs(get(&x, r * C + c)));
        want = am > 0 ? (double)((float)am / (float)fmx) : 1.0;
        if (pow2 && am > 0) want = pow(2.0, ceil(log2(want)));
        if (((float *)sc.data)[b] != (float)want) {
            if (!bad) DSK_TEST_EXPECT(0, "block %lld: scale %.9g, want %.9g (amax %g)", (long long)b, (double)((float *)sc.data)[b], want, am);
            bad++;
        }
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < C; c++) {
            double xi = get(&x, r * C + c), yi = ((float *)y.data)[r * C + c], d = ((float *)sc.data)[(r / br) * SC + c / bc];
            if (!(fabs(yi - xi) <= fp8_bound(fmt, xi, 1.0 / d)) || fabs(xi / d) > fmx * (1 + 1e-6)) {
                if (!bad) DSK_TEST_EXPECT(0, "x[%lld,%lld] %.9g -> %.9g, block scale %g", (long long)r, (long long)c, xi, yi, d);
                bad++;
            }
        }
    DSK_TEST_EXPECT(bad == 0, "%lld bad scales or elements", (long long)bad);
    dsk_tensor_free(NULL, &x); dsk_tensor_free(NULL, &q); dsk_tensor_free(NULL, &sc); dsk_tensor_free(NULL, &y);
}

/* An Inf or a NaN inside a block stays non-finite through the block path, as in DeepSeek's
   act_quant (s = amax / 448, y = x / s): that block's scale is Inf (NaN for a NaN), its q holds
   0 and NaN codes, it dequantises to NaN, and the unscale check finds it. The other blocks
   are untouched by it and round-trip as usual. */
static void test_fp8_block_nonfinite(dsk_dtype fmt, int pow2) {
    const int64_t R = 4, C = 256;
    const float bad[3] = {INFINITY, -INFINITY, NAN};
    dsk_tensor x = new_2d(DSK_F32, R, C), q = new_2d(fmt, R, C), sc = new_2d(DSK_F32, R, 2), y = new_2d(DSK_F32, R, C);
    dsk_tensor *gl[1] = {&y};
    dsk_amp_scaler s;
    dsk_amp_stats st;
    double fmx = fmt == DSK_E4M3 ? 448.0 : 57344.0;
    fill_rand(&x, -1.0, 1.0);
    for (int b = 0; b < 3; b++) ((float *)x.data)[b * C + 5 + 40 * b] = bad[b]; /* blocks (0,0), (1,0), (2,0) */
    dsk_test_poison_f32((float *)sc.data, R * 2);
    dsk_test_poison_f32((float *)y.data, R * C);
    DSK_TEST_OK(dsk_amp_fp8_block_quantize(NULL, &q, &sc, &x, 1, 128, pow2));
    DSK_TEST_OK(dsk_amp_fp8_block_dequantize(NULL, &y, &q, &sc, 1, 128));
    for (int64_t r = 0; r < R; r++)
        for (int64_t cb = 0; cb < 2; cb++) {
            float d = ((float *)sc.data)[r * 2 + cb];
            int hit = r < 3 && cb == 0, finite_y = 0, nan_codes = 0, bad_round = 0, bad_sign = 0;
            for (int64_t c = cb * 128; c < (cb + 1) * 128; c++) {
                double xi = ((float *)x.data)[r * C + c], yi = ((float *)y.data)[r * C + c];
                uint8_t code = ((uint8_t *)q.data)[r * C + c];
                int nan = isnan(fmt == DSK_E4M3 ? dsk_e4m3_to_f32(code) : dsk_e5m2_to_f32(code));
                finite_y += isfinite(yi) != 0;
                nan_codes += nan;
                /* a NaN code's sign: x's times the (positive) scale's, not the hardware's default NaN */
                bad_sign += nan && (code >> 7) != (signbit(xi) != 0);
                if (!hit) bad_round += !(fabs(yi - xi) <= fp8_bound(fmt, xi, 1.0 / d));
            }
            if (hit) {
                DSK_TEST_EXPECT(r == 2 ? isnan(d) : d == INFINITY, "row %lld with %g: scale %g", (long long)r,
                                (double)bad[r], (double)d);
                DSK_TEST_EXPECT(finite_y == 0, "row %lld with %g: %d finite values after the round trip", (long long)r,
                                (double)bad[r], finite_y);
                DSK_TEST_EXPECT(nan_codes == (r == 2 ? 128 : 1), "row %lld with %g: %d NaN codes", (long long)r,
                                (double)bad[r], nan_codes);
                DSK_TEST_EXPECT(bad_sign == 0, "row %lld with %g: %d NaN codes of the wrong sign", (long long)r,
                                (double)bad[r], bad_sign);
            } else {
                DSK_TEST_EXPECT(isfinite(d) && d > 0 && d <= 1.0 / fmx * 4, "row %lld block %lld: scale %g",
                                (long long)r, (long long)cb, (double)d);
                DSK_TEST_EXPECT(finite_y == 128 && bad_round == 0, "row %lld block %lld: %d finite, %d off",
                                (long long)r, (long long)cb, finite_y, bad_round);
            }
        }
    /* what the block path produced is caught by the overflow check */
    DSK_TEST_OK(dsk_amp_scaler_init(&s, NULL, NULL));
    DSK_TEST_OK(dsk_amp_unscale(&s, NULL, gl, 1));
    DSK_TEST_OK(dsk_amp_stats_get(&s, NULL, &st));
    DSK_TEST_EXPECT(st.found_inf > 0, "the unscale check missed the non-finite blocks");
    dsk_amp_scaler_free(&s, NULL);
    dsk_tensor_free(NULL, &x); dsk_tensor_free(NULL, &q); dsk_tensor_free(NULL, &sc); dsk_tensor_free(NULL, &y);
}

/* ---------------------------------------------------------------- end to end */

/* Linear regression trained with fp16 compute: the forward uses the f16 copy of the weights,
   the backward produces f16 gradients of the scaled loss (Inf where they overflow), amp
   unscales, checks, clips and steps f32 masters. Step `inject` multiplies one target by 1e30
   so its gradient overflows: exactly that step is skipped and its scale is recovered after
   growth_interval clean steps. */
static void test_end_to_end_fp16(void) {
    enum { B = 16, D = 9, STEPS = 60, INTERVAL = 5, INJECT = 33 };
    double X[B][D], wt[D], tgt[B];
    dsk_tensor w = new_1d(DSK_F32, D), w16 = new_1d(DSK_F16, D), g16 = new_1d(DSK_F16, D), m = new_1d(DSK_F32, D), v = new_1d(DSK_F32, D);
    dsk_tensor *gl[1] = {&g16};
    dsk_amp_param ap = {"w", &w, &g16, &m, &v, &w16};
    dsk_amp_scaler sc;
    dsk_amp_scaler_opts o;
    dsk_adamw_opts ao;
    int64_t step = 1;
    int skipped = 0, skipped_inject = 0, mismatched = 0;
    float scale_before_inject = 0, scale_after_recovery = 0;
    double loss0 = 0, loss_end = 0;
    unsigned char before[4 * D * 4];
    memset(&o, 0, sizeof o);
    ao = dsk_adamw_defaults();
    o.init_scale = 0x1p22f; o.growth_interval = INTERVAL;
    ao.lr = 0.05f; ao.weight_decay = 0.0f;
    for (int j = 0; j < D; j++) wt[j] = dsk_test_rand(-2, 2);
    for (int i = 0; i < B; i++) {
        tgt[i] = 0;
        for (int j = 0; j < D; j++) { X[i][j] = dsk_test_rand(-1, 1); tgt[i] += X[i][j] * wt[j]; }
    }
    fill_rand(&w, 0.01, 0.1);
    memset(m.data, 0, dsk_tensor_nbytes(&m)); memset(v.data, 0, dsk_tensor_nbytes(&v));
    DSK_TEST_OK(dsk_amp_cast(NULL, &w16, &w, DSK_AMP_ROUND_NEAREST, 0, 0, 0));
    DSK_TEST_OK(dsk_amp_scaler_init(&sc, NULL, &o));
    for (int t = 0; t < STEPS; t++) {
        double grad[D] = {0}, loss = 0;
        float s = NAN;
        int any_inf = 0;
        dsk_amp_stats st = {NAN, NAN};
        dsk_amp_decision dec;
        DSK_TEST_OK(dsk_amp_scale_get(&sc, NULL, &s));
        for (int i = 0; i < B; i++) {
            double pred = 0, r;
            for (int j = 0; j < D; j++) pred += X[i][j] * get(&w16, j);
            r = pred - (t == INJECT && i == 3 ? tgt[i] * 1e30 : tgt[i]);
            loss += 0.5 * r * r / B;
            for (int j = 0; j < D; j++) grad[j] += r * X[i][j] / B;
        }
        for (int j = 0; j < D; j++) {
            put(&g16, j, (float)(grad[j] * s)); /* the f16 backward of the scaled loss */
            any_inf |= isinf(get(&g16, j)) ? 1 : 0;
        }
        if (t == 0) loss0 = loss;
        if (t != INJECT) loss_end = loss;
        if (t == INJECT) { scale_before_inject = s; memcpy(before, w.data, 4 * D); memcpy(before + 4 * D, w16.data, 2 * D); memcpy(before + 6 * D, m.data, 4 * D); memcpy(before + 10 * D, v.data, 4 * D); }
        DSK_TEST_OK(dsk_amp_unscale(&sc, NULL, gl, 1));
        DSK_TEST_OK(dsk_amp_stats_get(&sc, NULL, &st));
        dec = dsk_amp_decide(st, 10.0);
        mismatched += dec.skip != any_inf;
        DSK_TEST_OK(dsk_amp_step(NULL, &ap, 1, &ao, step, &dec, DSK_AMP_ROUND_NEAREST, 0));
        if (!dec.skip) step++;
        skipped += dec.skip;
        if (t == INJECT) {
            unsigned char after[4 * D * 4];
            skipped_inject = dec.skip;
            memcpy(after, w.data, 4 * D); memcpy(after + 4 * D, w16.data, 2 * D); memcpy(after + 6 * D, m.data, 4 * D); memcpy(after + 10 * D, v.data, 4 * D);
            DSK_TEST_SAME_BYTES(before, after, 14 * D, "weights, copy and moments at the injected overflow");
        }
        DSK_TEST_OK(dsk_amp_update(&sc, NULL));
        if (t == INJECT) {
            DSK_TEST_OK(dsk_amp_scale_get(&sc, NULL, &s));
            DSK_TEST_EXPECT(s == scale_before_inject * 0.5f, "scale %g after the injected overflow, want %g", (double)s, (double)scale_before_inject * 0.5);
        }
        if (t == INJECT + INTERVAL) DSK_TEST_OK(dsk_amp_scale_get(&sc, NULL, &scale_after_recovery));
    }
    DSK_TEST_EXPECT(mismatched == 0, "%d steps where skip differs from the gradient's overflow", mismatched);
    DSK_TEST_EXPECT(skipped_inject, "the injected overflow step was not skipped");
    DSK_TEST_EXPECT(skipped >= 3 && skipped <= STEPS / 3, "%d skipped steps (initial scale 2^22 must overflow a few times)", skipped);
    DSK_TEST_EXPECT(scale_after_recovery == scale_before_inject, "scale %g after %d clean steps, before the overflow %g", (double)scale_after_recovery,
                    INTERVAL, (double)scale_before_inject);
    DSK_TEST_EXPECT(loss_end < 0.05 * loss0, "loss %g -> %g did not fall", loss0, loss_end);
    dsk_amp_scaler_free(&sc, NULL);
    dsk_tensor_free(NULL, &w); dsk_tensor_free(NULL, &w16); dsk_tensor_free(NULL, &g16); dsk_tensor_free(NULL, &m); dsk_tensor_free(NULL, &v);
}

/* ---------------------------------------------------------------- errors */

static void test_errors(void) {
    dsk_amp_scaler sc, zero;
    dsk_amp_scaler_opts o;
    dsk_amp_scaler_state st = {NAN, -1, -1};
    dsk_tensor g = new_1d(DSK_F32, 8), gi = new_1d(DSK_I32, 8), g2 = new_2d(DSK_F32, 3, 5), gt, *gl[2];
    memset(&zero, 0, sizeof zero);
    DSK_TEST_STATUS(dsk_amp_scaler_init(NULL, NULL, NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_amp_scaler_init: scaler is NULL");
    memset(&o, 0, sizeof o); o.growth_factor = 0.5;
    DSK_TEST_STATUS(dsk_amp_scaler_init(&sc, NULL, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("growth_factor 0.5");
    memset(&o, 0, sizeof o); o.backoff_factor = 1.5;
    DSK_TEST_STATUS(dsk_amp_scaler_init(&sc, NULL, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("backoff_factor 1.5");
    memset(&o, 0, sizeof o); o.growth_interval = -3;
    DSK_TEST_STATUS(dsk_amp_scaler_init(&sc, NULL, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("growth_interval -3");
    memset(&o, 0, sizeof o); o.hysteresis = -1;
    DSK_TEST_STATUS(dsk_amp_scaler_init(&sc, NULL, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("hysteresis -1");
    memset(&o, 0, sizeof o); o.init_scale = NAN;
    DSK_TEST_STATUS(dsk_amp_scaler_init(&sc, NULL, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("init_scale nan");
    memset(&o, 0, sizeof o); o.min_scale = 10; o.max_scale = 5;
    DSK_TEST_STATUS(dsk_amp_scaler_init(&sc, NULL, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("min_scale 10 > max_scale 5");
    memset(&o, 0, sizeof o); o.max_scale = 100;
    DSK_TEST_STATUS(dsk_amp_scaler_init(&sc, NULL, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("init_scale 65536 outside");
    memset(&o, 0, sizeof o); o.mode = (dsk_amp_mode)7;
    DSK_TEST_STATUS(dsk_amp_scaler_init(&sc, NULL, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("unknown mode 7");

    DSK_TEST_STATUS(dsk_amp_update(&zero, NULL), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("dsk_amp_update: scaler is not initialised");
    DSK_TEST_STATUS(dsk_amp_state_get(NULL, NULL, &st), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_amp_state_get: scaler is NULL");

    memset(&o, 0, sizeof o); o.growth_interval = 10; o.hysteresis = 2;
    DSK_TEST_OK(dsk_amp_scaler_init(&sc, NULL, &o));
    st.scale = 0; st.growth_tracker = 0; st.hysteresis_left = 1;
    DSK_TEST_STATUS(dsk_amp_state_set(&sc, NULL, &st), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_amp_state_set: scale 0");
    st.scale = INFINITY;
    DSK_TEST_STATUS(dsk_amp_state_set(&sc, NULL, &st), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("scale inf");
    st.scale = 4; st.growth_tracker = 10;
    DSK_TEST_STATUS(dsk_amp_state_set(&sc, NULL, &st), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("growth_tracker 10 outside [0, growth_interval 10)");
    st.growth_tracker = 3; st.hysteresis_left = 3;
    DSK_TEST_STATUS(dsk_amp_state_set(&sc, NULL, &st), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("hysteresis_left 3 outside [1, hysteresis 2]");

    gl[0] = &g; gl[1] = &gi;
    DSK_TEST_STATUS(dsk_amp_unscale(&sc, NULL, gl, 2), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_amp_unscale: grads[1] is [8] i32, want f32, bf16 or f16");
    DSK_TEST_STATUS(dsk_amp_unscale(&sc, NULL, gl, -1), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_amp_unscale: -1 gradients");
    gl[1] = NULL;
    DSK_TEST_STATUS(dsk_amp_unscale(&sc, NULL, gl, 2), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("grads[1] is NULL");
    DSK_TEST_OK(dsk_tensor_transpose(&g2, 0, 1, &gt));
    gl[1] = &gt;
    DSK_TEST_STATUS(dsk_amp_unscale(&sc, NULL, gl, 2), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("grads[1] [5,3] f32 is not contiguous");
    {
        dsk_tensor fake = g;
        fake.device.type = DSK_DEV_CUDA;
        gl[1] = &fake;
        DSK_TEST_STATUS(dsk_amp_unscale(&sc, NULL, gl, 2), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("grads[1] [8] f32 cuda is on cuda:0, expected cpu:0");
    }
    {
        /* a view into g and g itself share memory */
        dsk_tensor tail;
        DSK_TEST_OK(dsk_tensor_slice(&g, 0, 6, 2, &tail));
        gl[0] = &tail; gl[1] = &g;
        DSK_TEST_STATUS(dsk_amp_unscale(&sc, NULL, gl, 2), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_amp_unscale: grads[0] and grads[1] share memory");
        DSK_TEST_OK(dsk_tensor_slice(&g, 0, 0, 6, &tail));
        gl[0] = &g; gl[1] = &tail;
        DSK_TEST_STATUS(dsk_amp_unscale(&sc, NULL, gl, 2), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("grads[0] and grads[1] share memory");
    }
    DSK_TEST_STATUS(dsk_amp_stats_set(&sc, NULL, NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_amp_stats_set: stats is NULL");
    DSK_TEST_STATUS(dsk_amp_scale_get(&sc, NULL, NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_amp_scale_get: out is NULL");

    /* casts */
    {
        dsk_tensor h = new_1d(DSK_BF16, 8), h7 = new_1d(DSK_BF16, 7), e = new_1d(DSK_E4M3, 8);
        DSK_TEST_STATUS(dsk_amp_cast(NULL, &h, &h7, DSK_AMP_ROUND_NEAREST, 0, 0, 0), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_amp_cast: src [7] bf16 must be f32");
        DSK_TEST_STATUS(dsk_amp_cast(NULL, &h7, &g, DSK_AMP_ROUND_NEAREST, 0, 0, 0), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dst [7] bf16 must be bf16, f16 or f32 of src's shape [8] f32");
        DSK_TEST_STATUS(dsk_amp_cast(NULL, &e, &g, DSK_AMP_ROUND_NEAREST, 0, 0, 0), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dst [8] e4m3 must be bf16");
        DSK_TEST_STATUS(dsk_amp_cast(NULL, &h, &g, (dsk_amp_round)5, 0, 0, 0), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("unknown rounding mode 5");
        dsk_tensor_free(NULL, &h); dsk_tensor_free(NULL, &h7); dsk_tensor_free(NULL, &e);
    }
    /* optimizer step: a bad second parameter leaves the first untouched */
    {
        const int64_t sizes[2] = {7, 5};
        param_set p[2];
        dsk_amp_param ap[2];
        dsk_amp_stats good = {0.0, 1.0};
        dsk_amp_decision d = dsk_amp_decide(good, 0.0);
        unsigned char a[512], b[512];
        dsk_tensor wrong = new_1d(DSK_F32, 6);
        make_params(p, ap, 2, sizes, DSK_F16);
        ap[1].name = "layer1.w";
        ap[1].v = &wrong;
        size_t na = snapshot(p, 2, a);
        DSK_TEST_STATUS(dsk_amp_step(NULL, ap, 2, NULL, 1, &d, DSK_AMP_ROUND_NEAREST, 0), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_amp_step: params[1] \"layer1.w\" v is [6] f32, master is [5] f32");
        DSK_TEST_EXPECT(snapshot(p, 2, b) == na, "snapshot size");
        DSK_TEST_SAME_BYTES(a, b, na, "params after a rejected step");
        ap[1].v = &p[1].v;
        ap[1].m = &gi;
        DSK_TEST_STATUS(dsk_amp_step(NULL, ap, 2, NULL, 1, &d, DSK_AMP_ROUND_NEAREST, 0), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("params[1] \"layer1.w\" m is [8] i32, master is [5] f32");
        ap[1].m = &p[1].m;
        DSK_TEST_STATUS(dsk_amp_step(NULL, ap, 2, NULL, 0, &d, DSK_AMP_ROUND_NEAREST, 0), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_amp_step: step 0 must be >= 1");
        d.grad_mult = NAN;
        DSK_TEST_STATUS(dsk_amp_step(NULL, ap, 2, NULL, 1, &d, DSK_AMP_ROUND_NEAREST, 0), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("grad_mult nan");
        DSK_TEST_STATUS(dsk_amp_step(NULL, ap, 2, NULL, 1, NULL, DSK_AMP_ROUND_NEAREST, 0), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_amp_step: decision is NULL");
        free_params(p, 2);
        dsk_tensor_free(NULL, &wrong);
    }
    /* fp8 */
    {
        dsk_tensor q = new_1d(DSK_E4M3, 8), q2 = new_2d(DSK_E4M3, 3, 5), s1 = scalar(1.0f), s2 = new_1d(DSK_F32, 2), bs = new_2d(DSK_F32, 1, 2);
        dsk_amp_fp8_delayed d, dz;
        dsk_amp_fp8_delayed_opts dop;
        memset(&dz, 0, sizeof dz);
        DSK_TEST_STATUS(dsk_amp_fp8_quantize(NULL, &g, &g, &s1), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_amp_fp8_quantize: q [8] f32 must be e4m3 or e5m2 of x's shape [8] f32");
        DSK_TEST_STATUS(dsk_amp_fp8_quantize(NULL, &q, &g, &s2), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("scale is [2] f32, want one f32 element");
        DSK_TEST_STATUS(dsk_amp_fp8_quantize(NULL, &q, &gi, &s1), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("x is [8] i32, want f32, bf16 or f16");
        DSK_TEST_STATUS(dsk_amp_fp8_current_scale(NULL, &s1, NULL, &g, DSK_BF16, 0, 0), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_amp_fp8_current_scale: format bf16 is not e4m3 or e5m2");
        DSK_TEST_STATUS(dsk_amp_fp8_current_scale(NULL, &s1, NULL, &g, DSK_E5M2, -2, 0), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("margin -2 outside [0, 64]");
        DSK_TEST_STATUS(dsk_amp_fp8_block_quantize(NULL, &q2, &bs, &g2, 1, 4, 0), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_amp_fp8_block_quantize: scales [1,2] f32, want [3,2] f32 for [3,5] f32 in 1x4 blocks");
        DSK_TEST_STATUS(dsk_amp_fp8_block_quantize(NULL, &q2, &bs, &g2, 0, 4, 0), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("block 0x4 must be at least 1x1");
        DSK_TEST_STATUS(dsk_amp_fp8_block_dequantize(NULL, &g, &q, &bs, 1, 4), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_amp_fp8_block_dequantize: tensor [8] f32 must be 2-D");
        memset(&dop, 0, sizeof dop); dop.fmt = DSK_F16;
        DSK_TEST_STATUS(dsk_amp_fp8_delayed_init(&d, NULL, &dop), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_amp_fp8_delayed_init: format f16 is not e4m3 or e5m2");
        dop.fmt = DSK_E5M2; dop.history_len = -4;
        DSK_TEST_STATUS(dsk_amp_fp8_delayed_init(&d, NULL, &dop), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("history_len -4 must be >= 1");
        DSK_TEST_STATUS(dsk_amp_fp8_delayed_update(&dz, NULL), DSK_ERR_STATE);
        DSK_TEST_ERROR_MENTIONS("dsk_amp_fp8_delayed_update: delayed scaling state is not initialised");
        dop.history_len = 2;
        DSK_TEST_OK(dsk_amp_fp8_delayed_init(&d, NULL, &dop));
        DSK_TEST_STATUS(dsk_amp_fp8_delayed_quantize(&d, NULL, &q, &g), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("q is e4m3, the delayed scaling format is e5m2");
        dsk_amp_fp8_delayed_free(&d, NULL);
        dsk_tensor_free(NULL, &q); dsk_tensor_free(NULL, &q2); dsk_tensor_free(NULL, &s1); dsk_tensor_free(NULL, &s2); dsk_tensor_free(NULL, &bs);
    }
    dsk_amp_scaler_free(&sc, NULL);
    dsk_tensor_free(NULL, &g); dsk_tensor_free(NULL, &gi); dsk_tensor_free(NULL, &g2);
}

int main(void) {
    const dsk_dtype gdt[3] = {DSK_F32, DSK_BF16, DSK_F16};
    const float scales[3] = {65536.0f, 3000.5f, 0.75f};
    dsk_test_init("test_amp");
    DSK_TEST_RUN(test_scaler_defaults);
    test_trajectories();
    DSK_TEST_RUN(test_trajectory_by_hand);
    DSK_TEST_RUN(test_state_resume);
    for (int d = 0; d < 3; d++)
        for (int s = 0; s < 3; s++) {
            dsk_test_begin("unscale %s grads, scale %g, vs f64", dsk_dtype_name(gdt[d]), (double)scales[s]);
            test_unscale_matches_f64(gdt[d], gdt[d] == DSK_F16 && scales[s] > 60000 ? 1024.0f : scales[s]);
            dsk_test_end();
        }
    DSK_TEST_RUN(test_nonfinite_always_found);
    DSK_TEST_RUN(test_overflow_by_unscaling);
    DSK_TEST_RUN(test_sharded_ranks_join);
    DSK_TEST_RUN(test_norm_and_clip);
    DSK_TEST_RUN(test_step_skip_and_apply);
    DSK_TEST_RUN(test_step_resume_stochastic);
    DSK_TEST_RUN(test_step_dev_cpu);
    DSK_TEST_RUN(test_step_dev_errors);
    dsk_test_begin("stochastic rounding bf16"); test_stochastic_rounding(DSK_BF16); dsk_test_end();
    dsk_test_begin("stochastic rounding f16"); test_stochastic_rounding(DSK_F16); dsk_test_end();
    dsk_test_begin("fp8 e4m3 round trip and overflow"); test_fp8_round_trip(DSK_E4M3); dsk_test_end();
    dsk_test_begin("fp8 e5m2 round trip and overflow"); test_fp8_round_trip(DSK_E5M2); dsk_test_end();
    {
        const int64_t ns[3] = {1, 129, 4099};
        for (int f = 0; f < 2; f++)
            for (int k = 0; k < 3; k++) {
                dsk_dtype fmt = f ? DSK_E5M2 : DSK_E4M3;
                dsk_test_begin("fp8 %s current scaling, %s x of %lld, pow2 %d", dsk_dtype_name(fmt), dsk_dtype_name(gdt[k]), (long long)ns[k], k == 2);
                test_fp8_current_scaling(fmt, gdt[k], k == 2, ns[k]);
                dsk_test_end();
            }
    }
    dsk_test_begin("fp8 delayed scaling, max of 4"); test_fp8_delayed(DSK_AMP_AMAX_MAX, 0, 0); dsk_test_end();
    dsk_test_begin("fp8 delayed scaling, most recent, margin 1");
    test_fp8_delayed(DSK_AMP_AMAX_MOST_RECENT, 1, 0);
    dsk_test_end();
    dsk_test_begin("fp8 delayed scaling, max, pow2"); test_fp8_delayed(DSK_AMP_AMAX_MAX, 0, 1); dsk_test_end();
    dsk_test_begin("fp8 blocks 1x128 activations (7, 300) e4m3"); test_fp8_blocks(DSK_E4M3, DSK_BF16, 7, 300, 1, 128, 0); dsk_test_end();
    dsk_test_begin("fp8 blocks 128x128 weights (257, 129) e4m3"); test_fp8_blocks(DSK_E4M3, DSK_F32, 257, 129, 128, 128, 0); dsk_test_end();
    dsk_test_begin("fp8 blocks 128x128 weights (130, 256) e4m3 pow2"); test_fp8_blocks(DSK_E4M3, DSK_F32, 130, 256, 128, 128, 1); dsk_test_end();
    dsk_test_begin("fp8 blocks 1x128 (1, 1) e5m2"); test_fp8_blocks(DSK_E5M2, DSK_F16, 1, 1, 1, 128, 0); dsk_test_end();
    dsk_test_begin("fp8 blocks 3x5 (7, 11) e5m2 pow2"); test_fp8_blocks(DSK_E5M2, DSK_F32, 7, 11, 3, 5, 1); dsk_test_end();
    dsk_test_begin("fp8 e4m3 block with Inf/NaN stays non-finite");
    test_fp8_block_nonfinite(DSK_E4M3, 0);
    dsk_test_end();
    dsk_test_begin("fp8 e5m2 block with Inf/NaN stays non-finite, pow2");
    test_fp8_block_nonfinite(DSK_E5M2, 1);
    dsk_test_end();
    DSK_TEST_RUN(test_end_to_end_fp16);
    DSK_TEST_RUN(test_errors);
    return dsk_test_finish();
}
