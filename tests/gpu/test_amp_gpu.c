/* test_amp_gpu.c - every CUDA path of dsk_amp.h against the CPU path on the same inputs.

   Bitwise where the GPU runs the same element math (unscaled gradients, found flag, the
   scale trajectory, RNE and stochastic casts, fp8 scales, codes and dequantised values,
   block scales); the f64 sum of squares within 1e-12 relative (different tree order). The
   device-resident step (dsk_amp_dstep) against the host-argument one, both on the GPU, eager
   and replayed from a CUDA graph: bitwise.
   GPU outputs are NaN-poisoned first. Without a usable CUDA device every case reports as
   skipped. */
#include "dsk_amp.h"
#include "tests/dsk_test.h"
#include "tests/gpu/gpu_test_util.h"

static dsk_tensor *h1(dsk_dtype dt, int64_t n) { return halloc(dt, 1, &n); }
static dsk_tensor *h2(dsk_dtype dt, int64_t r, int64_t c) { int64_t s[2] = {r, c}; return halloc(dt, 2, s); }
/* CPU tensor of random values +-[lo, hi) rounded to dt. */
static dsk_tensor *hrand(dsk_dtype dt, int nd, const int64_t *shape, double lo, double hi) {
    dsk_tensor *f = halloc(DSK_F64, nd, shape), *t = halloc(dt, nd, shape);
    for (int64_t i = 0; i < dsk_tensor_numel(f); i++) {
        double m = dsk_test_rand(lo, hi);
        ((double *)f->data)[i] = dsk_test_rand_u64() & 1 ? m : -m;
    }
    DSK_TEST_OK(dsk_tensor_copy(NULL, t, f));
    return t;
}
/* A GPU tensor shaped like h, poisoned (NaN for floats, 0xA5 bytes for fp8). */
static dsk_tensor *dpoison(const dsk_tensor *h) {
    dsk_tensor *p = halloc(h->dtype, h->ndim, h->shape);
    if (h->dtype == DSK_F32 || h->dtype == DSK_BF16 || h->dtype == DSK_F16) DSK_TEST_OK(dsk_tensor_fill(NULL, p, NAN));
    else dsk_test_poison_bytes(p->data, dsk_tensor_nbytes(p));
    return dev(p);
}
static dsk_tensor *host(const dsk_tensor *d) { return host_as(d, d->dtype); }
static void same(const dsk_tensor *gpu, const dsk_tensor *cpu, const char *what) {
    dsk_tensor *g = host(gpu);
    DSK_TEST_SAME_BYTES(g->data, cpu->data, dsk_tensor_nbytes(cpu), what);
}

/* ---------------------------------------------------------------- unscale and scaler */

/* n gradients of mixed dtypes and sizes (some empty, some spanning many chunks), more than
   one launch's worth of tensors when n > 48. */
static void test_unscale(int n, float scale, int poison_at) {
    static const dsk_dtype dts[3] = {DSK_F32, DSK_BF16, DSK_F16};
    dsk_tensor **hc = (dsk_tensor **)malloc((size_t)n * sizeof *hc), **dg = (dsk_tensor **)malloc((size_t)n * sizeof *dg);
    dsk_amp_scaler hs, ds;
    dsk_amp_scaler_opts o;
    dsk_amp_stats a = {NAN, NAN}, b = {NAN, NAN};
    memset(&o, 0, sizeof o);
    o.init_scale = scale;
    for (int i = 0; i < n; i++) {
        int64_t len = i % 11 == 5 ? 0 : i % 7 == 3 ? 4096 * 3 + 17 : 1 + dsk_test_rand_int(300);
        dsk_dtype dt = dts[i % 3];
        hc[i] = hrand(dt, 1, &len, 1e-3 * (dt == DSK_F16 ? 1.0 : scale), 8.0 * (dt == DSK_F16 ? 1.0 : scale));
        if (i == poison_at && len > 0) {
            dsk_tensor *f = h1(DSK_F32, 1);
            ((float *)f->data)[0] = INFINITY;
            dsk_tensor one;
            DSK_TEST_OK(dsk_tensor_slice(hc[i], 0, len - 1, 1, &one));
            DSK_TEST_OK(dsk_tensor_copy(NULL, &one, f));
        }
        dg[i] = dev(hc[i]);
    }
    DSK_TEST_OK(dsk_amp_scaler_init(&hs, NULL, &o));
    DSK_TEST_OK(dsk_amp_scaler_init(&ds, &G, &o));
    DSK_TEST_OK(dsk_amp_unscale(&hs, NULL, hc, n));
    DSK_TEST_OK(dsk_amp_unscale(&ds, &G, dg, n));
    DSK_TEST_OK(dsk_amp_stats_get(&hs, NULL, &a));
    DSK_TEST_OK(dsk_amp_stats_get(&ds, &G, &b));
    for (int i = 0; i < n; i++) same(dg[i], hc[i], "unscaled gradient");
    DSK_TEST_EXPECT(a.found_inf == b.found_inf && a.found_inf == (poison_at >= 0 ? 1.0 : 0.0), "found_inf cpu %g gpu %g", a.found_inf, b.found_inf);
    if (poison_at < 0) DSK_TEST_CLOSE64(&b.sumsq, &a.sumsq, 1, 1e-12, 0, "sumsq");
    dsk_amp_scaler_free(&hs, NULL);
    dsk_amp_scaler_free(&ds, &G);
    free(hc); free(dg);
}

/* Scripted trajectory: the device rule and the host rule agree bitwise every step. */
static void test_trajectory(int hysteresis, int consecutive) {
    dsk_amp_scaler hs, ds;
    dsk_amp_scaler_opts o;
    dsk_tensor *hg = h1(DSK_F32, 5), *dg;
    memset(&o, 0, sizeof o);
    o.init_scale = 1024; o.growth_interval = 3; o.hysteresis = hysteresis; o.hysteresis_consecutive = consecutive; o.max_scale = 1e6f;
    DSK_TEST_OK(dsk_amp_scaler_init(&hs, NULL, &o));
    DSK_TEST_OK(dsk_amp_scaler_init(&ds, &G, &o));
    for (int t = 0; t < 200; t++) {
        dsk_amp_scaler_state a = {NAN, -1, -1}, b = {NAN, -2, -2};
        int over = dsk_test_rand(0, 1) < 0.3;
        for (int k = 0; k < 5; k++) ((float *)hg->data)[k] = (float)dsk_test_rand(0.5, 2.0);
        if (over) ((float *)hg->data)[t % 5] = t % 2 ? NAN : -INFINITY;
        dg = dev(hg);
        DSK_TEST_OK(dsk_amp_unscale(&hs, NULL, &hg, 1));
        DSK_TEST_OK(dsk_amp_unscale(&ds, &G, &dg, 1));
        DSK_TEST_OK(dsk_amp_update(&hs, NULL));
        DSK_TEST_OK(dsk_amp_update(&ds, &G));
        DSK_TEST_OK(dsk_amp_state_get(&hs, NULL, &a));
        DSK_TEST_OK(dsk_amp_state_get(&ds, &G, &b));
        if (memcmp(&a, &b, sizeof a) != 0) {
            DSK_TEST_EXPECT(0, "step %d: cpu %g %d %d, gpu %g %d %d", t, (double)a.scale, (int)a.growth_tracker, (int)a.hysteresis_left, (double)b.scale,
                            (int)b.growth_tracker, (int)b.hysteresis_left);
            break;
        }
    }
    {
        /* joined stats written from the host drive the device rule like the host rule */
        dsk_amp_stats joined = {1.0, 2.0}, back = {NAN, NAN};
        dsk_amp_scaler_state a = {NAN, -1, -1}, b = {NAN, -2, -2};
        DSK_TEST_OK(dsk_amp_stats_set(&hs, NULL, &joined));
        DSK_TEST_OK(dsk_amp_stats_set(&ds, &G, &joined));
        DSK_TEST_OK(dsk_amp_stats_get(&ds, &G, &back));
        DSK_TEST_SAME_BYTES(&back, &joined, sizeof back, "stats set/get on the device");
        DSK_TEST_OK(dsk_amp_update(&hs, NULL));
        DSK_TEST_OK(dsk_amp_update(&ds, &G));
        DSK_TEST_OK(dsk_amp_state_get(&hs, NULL, &a));
        DSK_TEST_OK(dsk_amp_state_get(&ds, &G, &b));
        DSK_TEST_SAME_BYTES(&a, &b, sizeof a, "state after joined stats");
    }
    {
        /* restore on the device and read back */
        dsk_amp_scaler_state st = {123.5f, 2, 1}, back = {NAN, -1, -1};
        DSK_TEST_OK(dsk_amp_state_set(&ds, &G, &st));
        DSK_TEST_OK(dsk_amp_state_get(&ds, &G, &back));
        DSK_TEST_SAME_BYTES(&st, &back, sizeof st, "state set/get on the device");
    }
    dsk_amp_scaler_free(&hs, NULL);
    dsk_amp_scaler_free(&ds, &G);
}

/* ---------------------------------------------------------------- casts and optimizer step */

static void test_cast(dsk_dtype dt, dsk_amp_round mode, int64_t n) {
    dsk_tensor *src = hrand(DSK_F32, 1, &n, 1e-6, 1e3), *hc = h1(dt, n), *ds = dev(src), *dc = dpoison(hc);
    DSK_TEST_OK(dsk_amp_cast(NULL, hc, src, mode, 42, 7, 1001));
    DSK_TEST_OK(dsk_amp_cast(&G, dc, ds, mode, 42, 7, 1001));
    same(dc, hc, "cast");
}

static void test_step(dsk_amp_round mode) {
    enum { NP = 3 };
    const int64_t sizes[NP] = {7, 129, 4099};
    dsk_amp_param hp[NP], dp[NP];
    dsk_adamw_opts ao;
    dsk_amp_stats good = {0.0, 4.0}, bad = {1.0, 4.0};
    dsk_amp_decision go = dsk_amp_decide(good, 1.0), skip = dsk_amp_decide(bad, 1.0);
    ao = dsk_adamw_defaults();
    ao.lr = 1e-2f; ao.weight_decay = 0.01f;
    for (int i = 0; i < NP; i++) {
        dsk_tensor *v = hrand(DSK_F32, 1, &sizes[i], 1e-4, 1e-2);
        for (int64_t k = 0; k < sizes[i]; k++) ((float *)v->data)[k] = fabsf(((float *)v->data)[k]);
        hp[i].name = dp[i].name = "w";
        hp[i].master = hrand(DSK_F32, 1, &sizes[i], 0.01, 1.0);
        hp[i].grad = hrand(DSK_BF16, 1, &sizes[i], 0.01, 1.0);
        hp[i].m = hrand(DSK_F32, 1, &sizes[i], 1e-3, 0.1);
        hp[i].v = v;
        hp[i].copy = h1(DSK_BF16, sizes[i]);
        DSK_TEST_OK(dsk_tensor_copy(NULL, hp[i].copy, hp[i].master));
        dp[i].master = dev(hp[i].master); dp[i].grad = dev(hp[i].grad); dp[i].m = dev(hp[i].m); dp[i].v = dev(hp[i].v); dp[i].copy = dev(hp[i].copy);
    }
    DSK_TEST_OK(dsk_amp_step(&G, dp, NP, &ao, 3, &skip, mode, 5));
    for (int i = 0; i < NP; i++) {
        same(dp[i].master, hp[i].master, "master after a skipped step");
        same(dp[i].m, hp[i].m, "m after a skipped step");
        same(dp[i].v, hp[i].v, "v after a skipped step");
        same(dp[i].copy, hp[i].copy, "copy after a skipped step");
    }
    DSK_TEST_OK(dsk_amp_step(NULL, hp, NP, &ao, 3, &go, mode, 5));
    DSK_TEST_OK(dsk_amp_step(&G, dp, NP, &ao, 3, &go, mode, 5));
    for (int i = 0; i < NP; i++) {
        dsk_tensor *m = host(dp[i].master), *c = host(dp[i].copy);
        double *want = (double *)malloc((size_t)sizes[i] * sizeof(double));
        int64_t far = 0;
        for (int64_t k = 0; k < sizes[i]; k++) want[k] = ((float *)hp[i].master->data)[k];
        DSK_TEST_CLOSE((const float *)m->data, want, sizes[i], 1e-5, 1e-6, "master after AdamW, gpu vs cpu");
        /* copies: the GPU rounds its own master; one bf16 step apart at most */
        for (int64_t k = 0; k < sizes[i]; k++) {
            float a = dsk_bf16_to_f32(((uint16_t *)c->data)[k]), b = dsk_bf16_to_f32(((uint16_t *)hp[i].copy->data)[k]);
            far += fabsf(a - b) > 0x1p-7f * fabsf(b) + 1e-30f;
        }
        DSK_TEST_EXPECT(far == 0, "params[%d]: %lld copies more than one bf16 step from the CPU's", i, (long long)far);
        free(want);
    }
}

/* ---------------------------------------------------------------- device-resident step */

/* Six steps of unscale + decision + AdamW + scale update on two copies of the same tensors: the
   host-argument calls (dsk_amp_decide on the host, dsk_amp_step with lr and step) and the
   device-resident ones (dsk_amp_dstep_schedule/upload, dsk_amp_decide_dev, dsk_amp_step_dev),
   run eagerly or captured once as a CUDA graph and replayed with a new schedule each step. Step 2
   holds an Inf (skipped, the f16-style dynamic scale backs off); growth every 2 clean steps moves
   the scale. Every tensor, the scaler's state and the device decision are compared bit for bit. */
static void test_step_dev(dsk_amp_round mode, int captured) {
    enum { NP = 3, STEPS = 6 };
    const int64_t sizes[NP] = {7, 129, 4099};
    const dsk_dtype gdt[NP] = {DSK_F32, DSK_BF16, DSK_F16};
    dsk_amp_param pa[NP], pb[NP];
    dsk_amp_scaler sa, sb;
    dsk_amp_scaler_opts so;
    dsk_amp_dstep ds;
    dsk_adamw_opts ao = dsk_adamw_defaults();
    dsk_graph g;
    dsk_tensor *ga[NP], *gb[NP];
    int64_t applied = 0;
    int skips = 0, scale_moves = 0;
    float prev_scale = 0.0f;
    memset(&so, 0, sizeof so);
    memset(&g, 0, sizeof g);
    so.init_scale = 1024.0f;
    so.growth_interval = 2;
    ao.beta1 = 0.8f; ao.beta2 = 0.95f; ao.weight_decay = 0.05f;
    for (int i = 0; i < NP; i++) {
        dsk_tensor *master = hrand(DSK_F32, 1, &sizes[i], 0.01, 1.0), *m = hrand(DSK_F32, 1, &sizes[i], 1e-3, 0.1);
        dsk_tensor *v = hrand(DSK_F32, 1, &sizes[i], 1e-4, 1e-2), *copy = h1(DSK_BF16, sizes[i]);
        for (int64_t k = 0; k < sizes[i]; k++) ((float *)v->data)[k] = fabsf(((float *)v->data)[k]);
        DSK_TEST_OK(dsk_tensor_copy(NULL, copy, master));
        ga[i] = dalloc(gdt[i], 1, &sizes[i]);
        gb[i] = dalloc(gdt[i], 1, &sizes[i]);
        pa[i].name = pb[i].name = "w";
        pa[i].master = dev(master); pa[i].m = dev(m); pa[i].v = dev(v); pa[i].copy = dev(copy); pa[i].grad = ga[i];
        pb[i].master = dev(master); pb[i].m = dev(m); pb[i].v = dev(v); pb[i].copy = dev(copy); pb[i].grad = gb[i];
    }
    DSK_TEST_OK(dsk_amp_scaler_init(&sa, &G, &so));
    DSK_TEST_OK(dsk_amp_scaler_init(&sb, &G, &so));
    DSK_TEST_OK(dsk_amp_dstep_init(&ds, &G));
    for (int k = 0; k < STEPS; k++) {
        float scale = NAN;
        dsk_amp_stats st = {NAN, NAN}; /* poisoned: a failed get must not leave it unset */
        dsk_amp_decision dec;
        dsk_amp_step_vals vals;
        dsk_amp_scaler_state qa, qb;
        float lr = 1e-2f * (float)(k + 1) / 7.0f;
        DSK_TEST_OK(dsk_amp_scale_get(&sa, &G, &scale));
        scale_moves += k > 0 && scale != prev_scale;
        prev_scale = scale;
        for (int i = 0; i < NP; i++) { /* this step's scaled gradients, the same on both sides */
            dsk_tensor *h = hrand(gdt[i], 1, &sizes[i], 0.01 * scale, 2.0 * scale);
            if (k == 2 && i == 1) ((uint16_t *)h->data)[sizes[i] / 2] = 0x7f80; /* +Inf in bf16 */
            DSK_TEST_OK(dsk_tensor_copy(&G, ga[i], h));
            DSK_TEST_OK(dsk_tensor_copy(&G, gb[i], h));
        }
        /* host arguments */
        DSK_TEST_OK(dsk_amp_unscale(&sa, &G, ga, NP));
        DSK_TEST_OK(dsk_amp_stats_get(&sa, &G, &st));
        dec = dsk_amp_decide(st, 1.0);
        ao.lr = lr;
        DSK_TEST_OK(dsk_amp_step(&G, pa, NP, &ao, applied + 1, &dec, mode, 11));
        DSK_TEST_OK(dsk_amp_update(&sa, &G));
        /* device-resident: lr poisoned in opts (not read) */
        ao.lr = NAN;
        DSK_TEST_OK(dsk_amp_dstep_schedule(&ds, &G, lr, applied + 1, &ao));
        if (!captured || !g.exec) {
            if (captured) DSK_TEST_OK(dsk_graph_begin(&G));
            DSK_TEST_OK(dsk_amp_dstep_upload(&ds, &G));
            DSK_TEST_OK(dsk_amp_unscale(&sb, &G, gb, NP));
            DSK_TEST_OK(dsk_amp_decide_dev(&ds, &G, &sb, 1.0));
            DSK_TEST_OK(dsk_amp_step_dev(&G, pb, NP, &ao, &ds, mode, 11));
            DSK_TEST_OK(dsk_amp_update(&sb, &G));
            if (captured) DSK_TEST_OK(dsk_graph_end(&G, &g));
        }
        if (captured) DSK_TEST_OK(dsk_graph_launch(&G, &g));
        DSK_TEST_OK(dsk_amp_dstep_get(&ds, &G, &vals));
        DSK_TEST_EXPECT(vals.skip == dec.skip && dsk_f32_bits(vals.grad_mult) == dsk_f32_bits(dec.grad_mult) &&
                            memcmp(&vals.norm, &dec.norm, sizeof dec.norm) == 0 && vals.step == applied + 1 &&
                            dsk_f32_bits(vals.lr) == dsk_f32_bits(lr),
                        "step %d: device decision (skip %d, grad_mult %.9g, norm %.17g, step %lld) vs host (%d, %.9g, %.17g, %lld)",
                        k, (int)vals.skip, (double)vals.grad_mult, vals.norm, (long long)vals.step, dec.skip,
                        (double)dec.grad_mult, dec.norm, (long long)(applied + 1));
        for (int i = 0; i < NP; i++) {
            same(pb[i].master, host(pa[i].master), "master");
            same(pb[i].m, host(pa[i].m), "m");
            same(pb[i].v, host(pa[i].v), "v");
            same(pb[i].copy, host(pa[i].copy), "copy");
            same(gb[i], host(ga[i]), "unscaled gradient");
        }
        DSK_TEST_OK(dsk_amp_state_get(&sa, &G, &qa));
        DSK_TEST_OK(dsk_amp_state_get(&sb, &G, &qb));
        DSK_TEST_EXPECT(memcmp(&qa, &qb, sizeof qa) == 0, "step %d: scaler state host-argument (%g, %d, %d) vs device (%g, %d, %d)",
                        k, (double)qa.scale, (int)qa.growth_tracker, (int)qa.hysteresis_left, (double)qb.scale,
                        (int)qb.growth_tracker, (int)qb.hysteresis_left);
        skips += dec.skip;
        if (!dec.skip) applied++;
    }
    DSK_TEST_EXPECT(skips == 1 && scale_moves >= 2, "the run had %d skipped steps and %d scale changes (want 1 and >= 2)",
                    skips, scale_moves);
    dsk_graph_free(&g);
    dsk_amp_dstep_free(&ds, &G);
    dsk_amp_scaler_free(&sa, &G);
    dsk_amp_scaler_free(&sb, &G);
}

/* ---------------------------------------------------------------- FP8 */

static dsk_tensor *hscalar(float v) {
    dsk_tensor *t = halloc(DSK_F32, 0, NULL);
    *(float *)t->data = v;
    return t;
}

static void test_fp8_tensor(dsk_dtype fmt, dsk_dtype xdt, int64_t n, int pow2, int margin) {
    dsk_tensor *x = hrand(xdt, 1, &n, 1e-5, 300.0), *dx = dev(x);
    dsk_tensor *hs = hscalar(NAN), *ha = hscalar(NAN), *ds = dpoison(hs), *da = dpoison(ha);
    dsk_tensor *hq = h1(fmt, n), *dq = dpoison(hq), *hy = h1(DSK_F32, n), *dy = dpoison(hy);
    DSK_TEST_OK(dsk_amp_fp8_current_scale(NULL, hs, ha, x, fmt, margin, pow2));
    DSK_TEST_OK(dsk_amp_fp8_current_scale(&G, ds, da, dx, fmt, margin, pow2));
    same(da, ha, "amax");
    same(ds, hs, "current scale");
    DSK_TEST_OK(dsk_amp_fp8_quantize(NULL, hq, x, hs));
    DSK_TEST_OK(dsk_amp_fp8_quantize(&G, dq, dx, ds));
    same(dq, hq, "fp8 codes");
    DSK_TEST_OK(dsk_amp_fp8_dequantize(NULL, hy, hq, hs));
    DSK_TEST_OK(dsk_amp_fp8_dequantize(&G, dy, dq, ds));
    same(dy, hy, "dequantised");
    /* amax NULL: the scale slot doubles as scratch on the GPU */
    DSK_TEST_OK(dsk_amp_fp8_current_scale(&G, ds, NULL, dx, fmt, margin, pow2));
    same(ds, hs, "current scale without amax");
}

static void test_fp8_delayed(dsk_amp_amax_algo algo) {
    dsk_amp_fp8_delayed hd, dd;
    dsk_amp_fp8_delayed_opts o;
    int64_t n = 1000;
    memset(&o, 0, sizeof o);
    o.fmt = DSK_E5M2; o.history_len = 3; o.algo = algo; o.margin = 2;
    DSK_TEST_OK(dsk_amp_fp8_delayed_init(&hd, NULL, &o));
    DSK_TEST_OK(dsk_amp_fp8_delayed_init(&dd, &G, &o));
    for (int t = 0; t < 9; t++) {
        double mag = pow(10.0, (double)((t * 5) % 7) - 3);
        dsk_tensor *x = hrand(DSK_F32, 1, &n, 0.01 * mag, mag), *dx = dev(x), *hq = h1(DSK_E5M2, n), *dq = dpoison(hq);
        DSK_TEST_OK(dsk_amp_fp8_delayed_quantize(&hd, NULL, hq, x));
        DSK_TEST_OK(dsk_amp_fp8_delayed_quantize(&dd, &G, dq, dx));
        same(dq, hq, "delayed codes");
        DSK_TEST_OK(dsk_amp_fp8_delayed_update(&hd, NULL));
        DSK_TEST_OK(dsk_amp_fp8_delayed_update(&dd, &G));
        same(&dd.scale, &hd.scale, "delayed scale");
        same(&dd.history, &hd.history, "amax history");
    }
    dsk_amp_fp8_delayed_free(&hd, NULL);
    dsk_amp_fp8_delayed_free(&dd, &G);
}

static void test_fp8_blocks(dsk_dtype fmt, dsk_dtype xdt, int64_t R, int64_t C, int br, int bc, int pow2) {
    int64_t shape[2] = {R, C};
    dsk_tensor *x = hrand(xdt, 2, shape, 1e-4, 50.0), *dx = dev(x);
    dsk_tensor *hq = h2(fmt, R, C), *dq = dpoison(hq), *hs = h2(DSK_F32, (R + br - 1) / br, (C + bc - 1) / bc), *dsc = dpoison(hs);
    dsk_tensor *hy = h2(DSK_BF16, R, C), *dy = dpoison(hy);
    DSK_TEST_OK(dsk_amp_fp8_block_quantize(NULL, hq, hs, x, br, bc, pow2));
    DSK_TEST_OK(dsk_amp_fp8_block_quantize(&G, dq, dsc, dx, br, bc, pow2));
    same(dsc, hs, "block scales");
    same(dq, hq, "block codes");
    DSK_TEST_OK(dsk_amp_fp8_block_dequantize(NULL, hy, hq, hs, br, bc));
    DSK_TEST_OK(dsk_amp_fp8_block_dequantize(&G, dy, dq, dsc, br, bc));
    same(dy, hy, "block dequantised");
}

/* Element-wise equal as f32 values, bit for bit, except that any NaN equals any NaN (the CPU
   and the GPU make NaNs with different signs and payloads). */
static void same_or_nan(const dsk_tensor *gpu, const dsk_tensor *cpu, const char *what) {
    dsk_tensor *g = host(gpu);
    int64_t n = dsk_tensor_numel(cpu), bad = 0, first = -1;
    for (int64_t i = 0; i < n; i++) {
        float a = dsk_load_f32(g->data, g->dtype, i), b = dsk_load_f32(cpu->data, cpu->dtype, i);
        if (!((a != a && b != b) || dsk_f32_bits(a) == dsk_f32_bits(b)) && !bad++) first = i;
    }
    DSK_TEST_EXPECT(bad == 0, "%s: %lld of %lld differ, first [%lld]", what, (long long)bad, (long long)n,
                    (long long)first);
}

/* Blocks holding +Inf, -Inf and NaN: the GPU keeps them non-finite exactly as the CPU does
   (non-finite scale, NaN codes, NaN after dequantising); the other blocks are bitwise equal. */
static void test_fp8_blocks_nonfinite(dsk_dtype fmt) {
    int64_t shape[2] = {4, 256};
    dsk_tensor *x = hrand(DSK_F32, 2, shape, -2.0, 2.0), *dx;
    dsk_tensor *hq = h2(fmt, 4, 256), *dq = dpoison(hq), *hs = h2(DSK_F32, 4, 2), *dsc = dpoison(hs);
    dsk_tensor *hy = h2(DSK_F32, 4, 256), *dy = dpoison(hy);
    ((float *)x->data)[0 * 256 + 3] = INFINITY;
    ((float *)x->data)[1 * 256 + 200] = -INFINITY;
    ((float *)x->data)[2 * 256 + 77] = NAN;
    dx = dev(x);
    DSK_TEST_OK(dsk_amp_fp8_block_quantize(NULL, hq, hs, x, 1, 128, 0));
    DSK_TEST_OK(dsk_amp_fp8_block_quantize(&G, dq, dsc, dx, 1, 128, 0));
    DSK_TEST_EXPECT(isinf(((float *)hs->data)[0]) && isinf(((float *)hs->data)[3]) && isnan(((float *)hs->data)[4]),
                    "CPU block scales %g %g %g", (double)((float *)hs->data)[0], (double)((float *)hs->data)[3],
                    (double)((float *)hs->data)[4]);
    same_or_nan(dsc, hs, "block scales");
    same_or_nan(dq, hq, "block codes");
    DSK_TEST_OK(dsk_amp_fp8_block_dequantize(NULL, hy, hq, hs, 1, 128));
    DSK_TEST_OK(dsk_amp_fp8_block_dequantize(&G, dy, dq, dsc, 1, 128));
    same_or_nan(dy, hy, "block dequantised");
}

/* One thread drives two devices: every call makes its context's device current (a launch
   on a stream of another device than the current one fails). */
static void test_two_devices(void) {
    int64_t n = 4099;
    dsk_ctx G1;
    dsk_tensor d1, c1, back;
    dsk_tensor *src = hrand(DSK_F32, 1, &n, 1e-3, 10.0), *want = h1(DSK_BF16, n), *d0 = dev(src), *c0 = dpoison(want);
    if (!gpu_test_ctx_on(1, &G1)) { dsk_test_skip("needs 2 CUDA devices, driven by one thread"); return; }
    DSK_TEST_OK(dsk_amp_cast(NULL, want, src, DSK_AMP_ROUND_NEAREST, 0, 0, 0));
    DSK_TEST_OK(dsk_tensor_alloc(&G1, &d1, DSK_F32, 1, &n));
    DSK_TEST_OK(dsk_tensor_alloc(&G1, &c1, DSK_BF16, 1, &n));
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &back, DSK_BF16, 1, &n));
    DSK_TEST_OK(dsk_tensor_copy(&G1, &d1, src));
    for (int r = 0; r < 2; r++) { /* each call follows one on the other device */
        DSK_TEST_OK(dsk_amp_cast(&G1, &c1, &d1, DSK_AMP_ROUND_NEAREST, 0, 0, 0));
        DSK_TEST_OK(dsk_amp_cast(&G, c0, d0, DSK_AMP_ROUND_NEAREST, 0, 0, 0));
    }
    same(c0, want, "cast on device 0 after one on device 1");
    DSK_TEST_OK(dsk_tensor_copy(&G1, &back, &c1));
    DSK_TEST_SAME_BYTES(back.data, want->data, dsk_tensor_nbytes(want), "cast on device 1");
    dsk_tensor_free(&G1, &d1);
    dsk_tensor_free(&G1, &c1);
    dsk_tensor_free(NULL, &back);
    dsk_ctx_free(&G1);
}

/* A CPU tensor handed to a CUDA scaler is an argument error, named. */
static void test_device_mismatch(void) {
    dsk_amp_scaler ds;
    dsk_tensor *hg = h1(DSK_F32, 4);
    DSK_TEST_OK(dsk_amp_scaler_init(&ds, &G, NULL));
    DSK_TEST_STATUS(dsk_amp_unscale(&ds, &G, &hg, 1), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("grads[0] [4] f32 is on cpu:0, expected cuda:0");
    DSK_TEST_STATUS(dsk_amp_update(&ds, NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_amp_update: CUDA device 0 needs a ctx on that device");
    dsk_amp_scaler_free(&ds, &G);
}

int main(void) {
    dsk_test_init("test_amp_gpu");
    gpu_test_setup();
    CASE(test_unscale(10, 65536.0f, -1), "unscale 10 mixed gradients, scale 65536");
    CASE(test_unscale(130, 3000.5f, -1), "unscale 130 mixed gradients (3 launches), scale 3000.5");
    CASE(test_unscale(130, 1024.0f, 97), "unscale 130 gradients, Inf in the last element of grads[97]");
    CASE(test_unscale(60, 512.0f, 0), "unscale 60 gradients, Inf in grads[0]");
    CASE(test_trajectory(1, 0), "scale trajectory on the device, no hysteresis");
    CASE(test_trajectory(3, 0), "scale trajectory on the device, hysteresis 3");
    CASE(test_trajectory(2, 1), "scale trajectory on the device, consecutive hysteresis 2");
    CASE(test_cast(DSK_BF16, DSK_AMP_ROUND_NEAREST, 100003), "cast f32 -> bf16 nearest");
    CASE(test_cast(DSK_F16, DSK_AMP_ROUND_NEAREST, 7), "cast f32 -> f16 nearest");
    CASE(test_cast(DSK_BF16, DSK_AMP_ROUND_STOCHASTIC, 100003), "cast f32 -> bf16 stochastic");
    CASE(test_cast(DSK_F16, DSK_AMP_ROUND_STOCHASTIC, 4099), "cast f32 -> f16 stochastic");
    CASE(test_step(DSK_AMP_ROUND_NEAREST), "optimizer step and skip, nearest copies");
    CASE(test_step(DSK_AMP_ROUND_STOCHASTIC), "optimizer step and skip, stochastic copies");
    CASE(test_step_dev(DSK_AMP_ROUND_NEAREST, 0), "device-resident step = host-argument step, 6 steps, nearest copies");
    CASE(test_step_dev(DSK_AMP_ROUND_STOCHASTIC, 0), "device-resident step = host-argument step, 6 steps, stochastic copies");
    CASE(test_step_dev(DSK_AMP_ROUND_NEAREST, 1), "device-resident step captured once, replayed 6 steps = host-argument");
    CASE(test_step_dev(DSK_AMP_ROUND_STOCHASTIC, 1), "device-resident step captured once, replayed, stochastic copies");
    CASE(test_fp8_tensor(DSK_E4M3, DSK_F32, 100003, 0, 0), "fp8 e4m3 per-tensor, f32 x");
    CASE(test_fp8_tensor(DSK_E5M2, DSK_BF16, 129, 1, 1), "fp8 e5m2 per-tensor, bf16 x, pow2, margin 1");
    CASE(test_fp8_tensor(DSK_E4M3, DSK_F16, 1, 0, 0), "fp8 e4m3 per-tensor, one f16 element");
    CASE(test_fp8_delayed(DSK_AMP_AMAX_MAX), "fp8 delayed scaling, max");
    CASE(test_fp8_delayed(DSK_AMP_AMAX_MOST_RECENT), "fp8 delayed scaling, most recent");
    CASE(test_fp8_blocks(DSK_E4M3, DSK_BF16, 33, 1000, 1, 128, 0), "fp8 blocks 1x128 (33, 1000)");
    CASE(test_fp8_blocks(DSK_E4M3, DSK_F32, 300, 257, 128, 128, 1), "fp8 blocks 128x128 (300, 257) pow2");
    CASE(test_fp8_blocks(DSK_E5M2, DSK_F16, 7, 5, 3, 2, 0), "fp8 blocks 3x2 (7, 5) e5m2");
    CASE(test_fp8_blocks_nonfinite(DSK_E4M3), "fp8 e4m3 blocks with Inf, -Inf, NaN stay non-finite");
    CASE(test_fp8_blocks_nonfinite(DSK_E5M2), "fp8 e5m2 blocks with Inf, -Inf, NaN stay non-finite");
    CASE(test_device_mismatch(), "CPU tensor with a CUDA scaler");
    CASE(test_two_devices(), "one thread, two devices: casts alternate between contexts");
    gpu_test_teardown();
    return dsk_test_finish();
}
