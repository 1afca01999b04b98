/* test_tensor.c - dsk_tensor.h: conversions, RNG, views and copies, every op against float64
   references written here, backward passes against central finite differences of those
   references, AdamW against PyTorch's formula, and the argument checks. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <stdlib.h>
/* Host allocations go through a switch so the out-of-memory paths can be tested. */
static int tt_oom;
static void *tt_malloc(size_t n) { return tt_oom ? NULL : malloc(n); }
#define DSK_MALLOC(sz) tt_malloc(sz)
#define DSK_FREE(p) free(p)
#define DSK_TENSOR_IMPLEMENTATION
#include "dsk_tensor.h"
#include "tests/dsk_test.h"

/* ------------------------------------------------------------------ test utilities */

/* Everything a case allocates is tracked and released when the next case begins. */
static void *tt_ptrs[4096];
static int tt_nptrs;
static void *tt_alloc(size_t n) {
    void *p = calloc(1, n ? n : 1);
    if (!p || tt_nptrs == (int)(sizeof tt_ptrs / sizeof tt_ptrs[0])) { fprintf(stderr, "test_tensor: out of memory\n"); exit(2); }
    tt_ptrs[tt_nptrs++] = p;
    return p;
}
static dsk_tensor *tt_owned[1024];
static int tt_nowned;
static void tt_release(void) {
    while (tt_nowned) dsk_tensor_free(NULL, tt_owned[--tt_nowned]);
    while (tt_nptrs) free(tt_ptrs[--tt_nptrs]);
}
#define TT_CASE(...) (tt_release(), dsk_test_begin(__VA_ARGS__))

/* The CPU kernels under test: the ops' context (NULL: the best this CPU has) and its ISA. The
   op tests run once per instruction set this CPU has (main). */
static dsk_ctx *tt_cx;
static dsk_cpu_isa tt_isa;
#define SH(...) ((const int64_t[]){__VA_ARGS__})

static int64_t tt_offset(const dsk_tensor *t, int64_t lin) {
    int64_t off = 0;
    for (int d = t->ndim - 1; d >= 0; d--) {
        off += (lin % t->shape[d]) * t->stride[d];
        lin /= t->shape[d];
    }
    return off;
}
/* Element `lin` (row-major logical order) of a CPU tensor of any dtype and strides. */
static double tt_get(const dsk_tensor *t, int64_t lin) {
    int64_t o = tt_offset(t, lin);
    switch (t->dtype) {
    case DSK_F32: return ((const float *)t->data)[o];
    case DSK_F16: return dsk_f16_to_f32(((const uint16_t *)t->data)[o]);
    case DSK_BF16: return dsk_bf16_to_f32(((const uint16_t *)t->data)[o]);
    case DSK_E4M3: return dsk_e4m3_to_f32(((const uint8_t *)t->data)[o]);
    case DSK_E5M2: return dsk_e5m2_to_f32(((const uint8_t *)t->data)[o]);
    case DSK_F64: return ((const double *)t->data)[o];
    case DSK_I32: return ((const int32_t *)t->data)[o];
    case DSK_I64: return (double)((const int64_t *)t->data)[o];
    case DSK_U8: return ((const uint8_t *)t->data)[o];
    default: return NAN;
    }
}
static void tt_set(dsk_tensor *t, int64_t lin, double x) {
    int64_t o = tt_offset(t, lin);
    switch (t->dtype) {
    case DSK_F32: ((float *)t->data)[o] = (float)x; break;
    case DSK_F16: ((uint16_t *)t->data)[o] = dsk_f32_to_f16((float)x); break;
    case DSK_BF16: ((uint16_t *)t->data)[o] = dsk_f32_to_bf16((float)x); break;
    case DSK_E4M3: ((uint8_t *)t->data)[o] = dsk_f32_to_e4m3((float)x); break;
    case DSK_E5M2: ((uint8_t *)t->data)[o] = dsk_f32_to_e5m2((float)x); break;
    case DSK_F64: ((double *)t->data)[o] = x; break;
    case DSK_I32: ((int32_t *)t->data)[o] = (int32_t)x; break;
    case DSK_I64: ((int64_t *)t->data)[o] = (int64_t)x; break;
    case DSK_U8: ((uint8_t *)t->data)[o] = (uint8_t)x; break;
    default: break;
    }
}

static dsk_tensor *tt_new(dsk_dtype dt, int ndim, const int64_t *shape) {
    dsk_tensor *t = (dsk_tensor *)tt_alloc(sizeof *t);
    if (dsk_tensor_alloc(NULL, t, dt, ndim, shape) != DSK_OK) { fprintf(stderr, "test_tensor: %s\n", dsk_last_error()); exit(2); }
    tt_owned[tt_nowned++] = t;
    return t;
}
/* Fresh uniform values in [lo, hi) (stored in the tensor's dtype). */
static dsk_tensor *tt_rand(dsk_dtype dt, int ndim, const int64_t *shape, double lo, double hi) {
    dsk_tensor *t = tt_new(dt, ndim, shape);
    for (int64_t i = 0, n = dsk_tensor_numel(t); i < n; i++) tt_set(t, i, dsk_test_rand(lo, hi));
    return t;
}
static dsk_tensor *tt_poisoned(dsk_dtype dt, int ndim, const int64_t *shape) {
    dsk_tensor *t = tt_new(dt, ndim, shape);
    for (int64_t i = 0, n = dsk_tensor_numel(t); i < n; i++) tt_set(t, i, NAN);
    return t;
}
static dsk_tensor *tt_zeroed(dsk_dtype dt, int ndim, const int64_t *shape) {
    dsk_tensor *t = tt_new(dt, ndim, shape);
    for (int64_t i = 0, n = dsk_tensor_numel(t); i < n; i++) tt_set(t, i, 0.0);
    return t;
}
static dsk_tensor *tt_ids(int ndim, const int64_t *shape, int64_t limit) {
    dsk_tensor *t = tt_new(DSK_I32, ndim, shape);
    for (int64_t i = 0, n = dsk_tensor_numel(t); i < n; i++) ((int32_t *)t->data)[i] = (int32_t)dsk_test_rand_int(limit);
    return t;
}
/* The tensor's values as float64 (what the library actually sees). */
static double *tt_vals(const dsk_tensor *t) {
    int64_t n = dsk_tensor_numel(t);
    double *v = (double *)tt_alloc((size_t)n * sizeof(double));
    for (int64_t i = 0; i < n; i++) v[i] = tt_get(t, i);
    return v;
}
static double *tt_zeros(int64_t n) { return (double *)tt_alloc((size_t)(n ? n : 1) * sizeof(double)); }

/* Relative tolerance of an output stored in dt. */
static double tt_tol(dsk_dtype dt) { return dt == DSK_F32 ? 2e-5 : dt == DSK_F16 ? 2e-3 : 1.6e-2; }

static int tt_check_at(const char *file, int line, const dsk_tensor *t, const double *want, double rtol, double atol, const char *what) {
    int64_t n = dsk_tensor_numel(t);
    float *got = (float *)tt_alloc((size_t)(n ? n : 1) * sizeof(float));
    for (int64_t i = 0; i < n; i++) got[i] = (float)tt_get(t, i);
    return dsk_test_close_any(file, line, got, NULL, want, n, rtol, atol, what);
}
#define TT_CHECK(t, want, rtol, atol, what) tt_check_at(__FILE__, __LINE__, t, want, rtol, atol, what)

static const dsk_dtype tt_floats[3] = {DSK_F32, DSK_BF16, DSK_F16};

/* A call that must fail with `status` and a message containing `needle`. */
#define TT_ERR(call, status, needle)        \
    do {                                    \
        dsk_clear_error();                  \
        DSK_TEST_STATUS(call, status);      \
        DSK_TEST_ERROR_MENTIONS(needle);    \
    } while (0)

/* Central differences of a float64 scalar function of x[0..n) (x restored on return). */
typedef double (*tt_loss_fn)(const double *x, void *ud);
static double *tt_numgrad(tt_loss_fn f, double *x, int64_t n, void *ud) {
    double *g = tt_zeros(n);
    for (int64_t i = 0; i < n; i++) {
        double x0 = x[i], h = 1e-6 * (fabs(x0) > 1 ? fabs(x0) : 1.0), lp, lm;
        x[i] = x0 + h; lp = f(x, ud);
        x[i] = x0 - h; lm = f(x, ud);
        x[i] = x0;
        g[i] = (lp - lm) / (2 * h);
    }
    return g;
}
static double tt_dot(const double *a, const double *b, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}
/* want = before + grad, for checking accumulating backward outputs. */
static double *tt_plus(const double *a, const double *b, int64_t n) {
    double *r = tt_zeros(n);
    for (int64_t i = 0; i < n; i++) r[i] = a[i] + b[i];
    return r;
}

/* ------------------------------------------------------------------ dtype conversions */

/* Value of a binary format code decoded by its definition: `eb` exponent bits, `mb` mantissa
   bits, IEEE-style (all-ones exponent = Inf/NaN) unless `fn` (e4m3fn: only S.1111.111 is NaN). */
static double tt_decode(uint32_t code, int eb, int mb, int fn) {
    uint32_t sign = code >> (eb + mb) & 1u, e = code >> mb & ((1u << eb) - 1u), m = code & ((1u << mb) - 1u);
    int bias = (1 << (eb - 1)) - 1;
    double v;
    if (!fn && e == (1u << eb) - 1u) v = m ? NAN : INFINITY;
    else if (fn && e == (1u << eb) - 1u && m == (1u << mb) - 1u) v = NAN;
    else if (e == 0) v = ldexp((double)m, 1 - bias - mb);
    else v = ldexp(1.0 + ldexp((double)m, -mb), (int)e - bias);
    return sign ? -v : v;
}

typedef struct tt_format {
    const char *name;
    int eb, mb, fn;
    uint32_t max_code; /* largest finite magnitude code */
    double *val;       /* val[c] for c in [0, max_code] */
} tt_format;

static tt_format tt_format_make(const char *name, int eb, int mb, int fn) {
    tt_format f;
    f.name = name; f.eb = eb; f.mb = mb; f.fn = fn;
    f.max_code = fn ? (1u << (eb + mb)) - 2u : ((1u << eb) - 1u) << mb;
    if (!fn) f.max_code -= 1u;
    f.val = (double *)tt_alloc((f.max_code + 1) * sizeof(double));
    for (uint32_t c = 0; c <= f.max_code; c++) f.val[c] = tt_decode(c, eb, mb, fn);
    return f;
}

/* Reference f32 -> format: nearest magnitude code by search, ties to the even code; beyond the
   largest finite value: Inf for IEEE formats (from max + ulp/2 up), saturation for e4m3fn.
   Returns the full code with sign, or -1 for NaN input. */
static int64_t tt_round_ref(const tt_format *f, float x) {
    double a = fabs((double)x), mid, next;
    uint32_t lo = 0, hi = f->max_code, c, sign = signbit(x) ? 1u << (f->eb + f->mb) : 0u;
    if (x != x) return -1;
    if (isinf(x) || a >= f->val[f->max_code]) {
        if (f->fn) return sign | f->max_code;
        next = 2 * f->val[f->max_code] - f->val[f->max_code - 1];
        mid = 0.5 * (f->val[f->max_code] + next);
        return sign | (isinf(x) || a >= mid ? f->max_code + 1 : f->max_code);
    }
    while (lo < hi) { /* largest c with val[c] <= a */
        uint32_t m = (lo + hi + 1) / 2;
        if (f->val[m] <= a) lo = m; else hi = m - 1;
    }
    c = lo;
    mid = 0.5 * (f->val[c] + f->val[c + 1]);
    if (a > mid || (a == mid && (c & 1u))) c++;
    return sign | c;
}

static uint32_t tt_encode(int which, float x) {
    switch (which) {
    case 0: return dsk_f32_to_bf16(x);
    case 1: return dsk_f32_to_f16(x);
    case 2: return dsk_f32_to_e4m3(x);
    default: return dsk_f32_to_e5m2(x);
    }
}
static float tt_decode_lib(int which, uint32_t c) {
    switch (which) {
    case 0: return dsk_bf16_to_f32((uint16_t)c);
    case 1: return dsk_f16_to_f32((uint16_t)c);
    case 2: return dsk_e4m3_to_f32((uint8_t)c);
    default: return dsk_e5m2_to_f32((uint8_t)c);
    }
}
static tt_format tt_format_of(int which) {
    switch (which) {
    case 0: return tt_format_make("bf16", 8, 7, 0);
    case 1: return tt_format_make("f16", 5, 10, 0);
    case 2: return tt_format_make("e4m3", 4, 3, 1);
    default: return tt_format_make("e5m2", 5, 2, 0);
    }
}

/* Every code decodes to its definition and encodes back to itself (NaN stays NaN). */
static void test_format_all_codes(int which) {
    tt_format f = tt_format_of(which);
    uint32_t n = 1u << (1 + f.eb + f.mb), bad = 0;
    for (uint32_t c = 0; c < n; c++) {
        float got = tt_decode_lib(which, c);
        double want = tt_decode(c, f.eb, f.mb, f.fn);
        uint32_t back = tt_encode(which, got);
        if (want != want) {
            double again = tt_decode(back, f.eb, f.mb, f.fn);
            if (got == got || again == again) {
                if (!bad) DSK_TEST_EXPECT(0, "%s NaN code 0x%x decodes to %g and encodes back to 0x%x", f.name, c, (double)got, back);
                bad++;
            }
        } else if ((double)got != want || !signbit(got) != !signbit(want) || back != c) {
            if (!bad) DSK_TEST_EXPECT(0, "%s code 0x%x: decodes to %.9g (want %.9g), encodes back to 0x%x", f.name, c, (double)got, want, back);
            bad++;
        }
    }
    DSK_TEST_EXPECT(bad == 0, "%s: %u of %u codes wrong", f.name, bad, n);
}

static void tt_round_one(const tt_format *f, int which, float x, uint32_t *bad) {
    int64_t want = tt_round_ref(f, x);
    uint32_t got = tt_encode(which, x);
    int ok = want < 0 ? tt_decode(got, f->eb, f->mb, f->fn) != tt_decode(got, f->eb, f->mb, f->fn) : (int64_t)got == want;
    if (!ok) {
        if (*bad < 3) DSK_TEST_EXPECT(0, "%s: f32 %.9g (0x%08x) -> 0x%x, want 0x%llx", f->name, (double)x, dsk_f32_bits(x), got, (long long)want);
        (*bad)++;
    }
}

/* f32 -> format against the search reference on random bit patterns, every halfway point
   (and its f32 neighbours), subnormals, the overflow threshold, Inf and NaN. */
static void test_format_rounding(int which) {
    tt_format f = tt_format_of(which);
    uint32_t bad = 0, count = 0;
    for (int i = 0; i < 300000; i++, count++) tt_round_one(&f, which, dsk_bits_f32((uint32_t)dsk_test_rand_u64()), &bad);
    for (int i = 0; i < 100000; i++, count++) /* magnitudes around the format's range */
        tt_round_one(&f, which, (float)(dsk_test_rand(-1, 1) * ldexp(1.0, (int)dsk_test_rand_int(2 * f.eb * 8) - f.eb * 8)), &bad);
    for (uint32_t c = 0; c < f.max_code; c++) {
        float mid = (float)(0.5 * (f.val[c] + f.val[c + 1]));
        float cand[6] = {mid, nextafterf(mid, 0), nextafterf(mid, INFINITY), -mid, (float)f.val[c], -(float)f.val[c + 1]};
        for (int k = 0; k < 6; k++, count++) tt_round_one(&f, which, cand[k], &bad);
    }
    {
        double next = 2 * f.val[f.max_code] - f.val[f.max_code - 1];
        float edge[10] = {(float)f.val[f.max_code], (float)(0.5 * (f.val[f.max_code] + next)), nextafterf((float)(0.5 * (f.val[f.max_code] + next)), 0),
                          (float)next, INFINITY, -INFINITY, 0.0f, -0.0f, 1e-45f, FLT_MAX};
        for (int k = 0; k < 10; k++, count++) tt_round_one(&f, which, edge[k], &bad);
        tt_round_one(&f, which, NAN, &bad);
        tt_round_one(&f, which, -NAN, &bad);
    }
    DSK_TEST_EXPECT(bad == 0, "%s: %u of %u conversions differ from the reference", f.name, bad, count);
}

static void test_fp8_definitions(void) {
    DSK_TEST_EXPECT(dsk_e4m3_to_f32(0x7E) == 448.0f && DSK_E4M3_MAX == 448.0f, "e4m3 max");
    DSK_TEST_EXPECT(isnan(dsk_e4m3_to_f32(0x7F)) && isnan(dsk_e4m3_to_f32(0xFF)), "e4m3 NaN codes");
    DSK_TEST_EXPECT(dsk_f32_to_e4m3(INFINITY) == 0x7E && dsk_f32_to_e4m3(-INFINITY) == 0xFE, "e4m3 saturates Inf to 448");
    DSK_TEST_EXPECT(dsk_f32_to_e4m3(1e6f) == 0x7E && dsk_f32_to_e4m3(464.0f) == 0x7E, "e4m3 saturates overflow");
    DSK_TEST_EXPECT(dsk_e4m3_to_f32(0x01) == ldexpf(1, -9), "e4m3 smallest subnormal 2^-9");
    DSK_TEST_EXPECT(dsk_f32_to_e4m3(ldexpf(1, -10)) == 0x00 && dsk_f32_to_e4m3(ldexpf(3, -10)) == 0x02, "e4m3 halfway subnormals to even");
    DSK_TEST_EXPECT(isinf(dsk_e5m2_to_f32(0x7C)) && dsk_e5m2_to_f32(0x7B) == 57344.0f && DSK_E5M2_MAX == 57344.0f, "e5m2 Inf and max");
    DSK_TEST_EXPECT(dsk_f32_to_e5m2(61440.0f) == 0x7C && dsk_f32_to_e5m2(61439.0f) == 0x7B, "e5m2 overflow to Inf from max + ulp/2");
    DSK_TEST_EXPECT(isnan(dsk_e5m2_to_f32(0x7D)) && isnan(dsk_e5m2_to_f32(0xFF)), "e5m2 NaN codes");
    DSK_TEST_EXPECT(dsk_f32_to_f16(65520.0f) == 0x7C00 && dsk_f32_to_f16(65519.0f) == 0x7BFF, "f16 overflow threshold");
    DSK_TEST_EXPECT(dsk_f32_to_bf16(1.00390625f) == 0x3F80 && dsk_f32_to_bf16(1.01171875f) == 0x3F82, "bf16 ties to even");
}

/* ------------------------------------------------------------------ RNG */

/* Philox4x32-10 written from Salmon et al. (SC'11) with the full 4-word counter. */
static void tt_philox(const uint32_t ctr_in[4], const uint32_t key_in[2], uint32_t out[4]) {
    uint32_t c[4] = {ctr_in[0], ctr_in[1], ctr_in[2], ctr_in[3]}, k[2] = {key_in[0], key_in[1]};
    for (int r = 0; r < 10; r++) {
        uint64_t p0, p1;
        if (r) { k[0] += 0x9E3779B9u; k[1] += 0xBB67AE85u; }
        p0 = (uint64_t)0xD2511F53u * c[0];
        p1 = (uint64_t)0xCD9E8D57u * c[2];
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c[1] ^ k[0], n1 = (uint32_t)p1, n2 = (uint32_t)(p0 >> 32) ^ c[3] ^ k[1], n3 = (uint32_t)p0;
        c[0] = n0; c[1] = n1; c[2] = n2; c[3] = n3;
    }
    for (int i = 0; i < 4; i++) out[i] = c[i];
}

static void test_philox_known_answers(void) {
    /* Random123 kat_vectors: philox4x32 10, counter[4] key[2] -> output[4] */
    static const uint32_t kat[3][10] = {
        {0, 0, 0, 0, 0, 0, 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
        {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd},
        {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0, 0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}};
    uint32_t out[4];
    for (int v = 0; v < 3; v++) {
        tt_philox(kat[v], kat[v] + 4, out);
        DSK_TEST_EXPECT(!memcmp(out, kat[v] + 6, 16), "reference Philox on vector %d: %08x %08x %08x %08x", v, out[0], out[1], out[2], out[3]);
    }
    dsk_philox4x32(0, 0, out);
    DSK_TEST_EXPECT(!memcmp(out, kat[0] + 6, 16), "dsk_philox4x32(0, 0): %08x %08x %08x %08x", out[0], out[1], out[2], out[3]);
    for (int i = 0; i < 2000; i++) { /* library (seed, counter) = key (lo, hi), counter (lo, hi, 0, 0) */
        uint64_t seed = dsk_test_rand_u64(), ctr = dsk_test_rand_u64();
        uint32_t c4[4] = {(uint32_t)ctr, (uint32_t)(ctr >> 32), 0, 0}, k2[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)}, want[4];
        tt_philox(c4, k2, want);
        dsk_philox4x32(seed, ctr, out);
        if (memcmp(out, want, 16)) { DSK_TEST_EXPECT(0, "seed %llx counter %llx differs", (unsigned long long)seed, (unsigned long long)ctr); break; }
    }
}

static void test_rng_streams(void) {
    uint64_t seed = dsk_test_rand_u64();
    dsk_tensor *a = tt_new(DSK_F32, 1, SH(1000)), *b = tt_new(DSK_F32, 1, SH(900)), *m = tt_new(DSK_F32, 2, SH(20, 30)), tr;
    DSK_TEST_OK(dsk_tensor_uniform(NULL, a, seed, 5, -2.0f, 3.0f));
    DSK_TEST_OK(dsk_tensor_uniform(NULL, b, seed, 105, -2.0f, 3.0f));
    DSK_TEST_SAME_BYTES((float *)a->data + 100, b->data, 900 * sizeof(float), "offset 105 continues offset 5 at element 100");
    for (int i = 0; i < 1000; i++) {
        uint32_t c4[4] = {(uint32_t)(5 + i), 0, 0, 0}, k2[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)}, r[4];
        double u;
        tt_philox(c4, k2, r);
        u = ((double)(r[0] >> 8) + 0.5) / 16777216.0;
        if (fabs(tt_get(a, i) - (-2.0 + 5.0 * u)) > 1e-6) { DSK_TEST_EXPECT(0, "element %d: %g, want %g", i, tt_get(a, i), -2.0 + 5.0 * u); break; }
    }
    /* A strided view is filled in logical order: element (i, j) of the transpose gets i * 20 + j. */
    DSK_TEST_OK(dsk_tensor_transpose(m, 0, 1, &tr));
    DSK_TEST_OK(dsk_tensor_normal(NULL, &tr, seed, 0, 1.0f, 2.0f));
    for (int i = 0; i < 30; i++)
        for (int j = 0; j < 20; j++) {
            double want = 1.0 + 2.0 * dsk_rng_normal_at(seed, 0, (uint64_t)(i * 20 + j)), got = ((float *)m->data)[j * 30 + i];
            if (fabs(got - want) > 1e-5 * (1 + fabs(want))) { DSK_TEST_EXPECT(0, "transposed fill (%d,%d): %g want %g", i, j, got, want); i = 30; break; }
        }
}

static void test_rng_moments(void) {
    int64_t n = 1 << 20;
    dsk_tensor *u = tt_new(DSK_F32, 1, SH(n)), *g = tt_new(DSK_F32, 1, SH(n));
    double s1 = 0, s2 = 0, mn = 1, mx = 0, g1 = 0, g2 = 0, g3 = 0, g4 = 0, var;
    DSK_TEST_OK(dsk_tensor_uniform(NULL, u, 1234, 0, 0.0f, 1.0f));
    DSK_TEST_OK(dsk_tensor_normal(NULL, g, 1234, 1u << 30, 0.0f, 1.0f));
    for (int64_t i = 0; i < n; i++) {
        double x = ((float *)u->data)[i], y = ((float *)g->data)[i];
        s1 += x; s2 += x * x;
        if (x < mn) mn = x;
        if (x > mx) mx = x;
        g1 += y; g2 += y * y; g3 += y * y * y; g4 += y * y * y * y;
    }
    s1 /= n; var = s2 / n - s1 * s1;
    DSK_TEST_EXPECT(fabs(s1 - 0.5) < 2e-3 && fabs(var - 1.0 / 12) < 1e-3, "uniform mean %g var %g", s1, var);
    DSK_TEST_EXPECT(mn > 0 && mx < 1, "uniform range (%g, %g)", mn, mx);
    g1 /= n; g2 /= n; g3 /= n; g4 /= n;
    DSK_TEST_EXPECT(fabs(g1) < 5e-3 && fabs(g2 - 1) < 5e-3 && fabs(g3) < 2e-2 && fabs(g4 - 3) < 5e-2, "normal moments %g %g %g %g", g1, g2, g3, g4);
}

/* ------------------------------------------------------------------ core: names, ctx, tensors */

static void test_names(void) {
    DSK_TEST_EXPECT(!strcmp(dsk_status_str(DSK_OK), "DSK_OK") && !strcmp(dsk_status_str(DSK_ERR_NONFINITE), "DSK_ERR_NONFINITE"), "status names");
    DSK_TEST_EXPECT(!strcmp(dsk_status_str((dsk_status)99), "DSK_ERR_UNKNOWN"), "unknown status");
    DSK_TEST_EXPECT(dsk_dtype_size(DSK_BF16) == 2 && dsk_dtype_size(DSK_E4M3) == 1 && dsk_dtype_size(DSK_I64) == 8 && dsk_dtype_size((dsk_dtype)42) == 0, "sizes");
    DSK_TEST_EXPECT(!strcmp(dsk_dtype_name(DSK_E5M2), "e5m2") && !strcmp(dsk_dtype_name((dsk_dtype)-1), "invalid"), "dtype names");
    DSK_TEST_EXPECT(dsk_dtype_is_float(DSK_F64) && !dsk_dtype_is_float(DSK_I32) && !dsk_dtype_is_float(DSK_U8), "is_float");
    dsk_set_error(DSK_ERR_IO, "x %d", 5);
    DSK_TEST_EXPECT(!strcmp(dsk_last_error(), "x 5"), "message set");
    dsk_clear_error();
    DSK_TEST_EXPECT(dsk_last_error()[0] == 0, "message cleared");
}

static void test_ctx(void) {
    dsk_ctx ctx;
    dsk_ctx_opts o;
    memset(&o, 0, sizeof o);
    DSK_TEST_OK(dsk_ctx_init(&ctx, NULL));
    DSK_TEST_EXPECT(ctx.n_threads >= 1, "default threads %d", ctx.n_threads);
    dsk_ctx_free(&ctx);
    dsk_ctx_free(&ctx); /* freed twice is fine */
    o.n_threads = -1;
    TT_ERR(dsk_ctx_init(&ctx, &o), DSK_ERR_ARG, "dsk_ctx_init: n_threads -1 < 0");
    o.n_threads = 0;
    o.device = (dsk_device_pref)7;
    TT_ERR(dsk_ctx_init(&ctx, &o), DSK_ERR_ARG, "unknown device preference 7");
    o.device = DSK_PREFER_CPU;
    o.n_threads = 3;
    DSK_TEST_OK(dsk_ctx_init(&ctx, &o));
    DSK_TEST_EXPECT(ctx.device.type == DSK_DEV_CPU && ctx.n_threads == 3, "CPU ctx with 3 threads");
    DSK_TEST_OK(dsk_ctx_sync(&ctx));
    if (!dsk_cuda_available()) {
        o.device = DSK_PREFER_CUDA;
        TT_ERR(dsk_ctx_init(&ctx, &o), DSK_ERR_UNSUPPORTED, "dsk_ctx_init: CUDA requested");
        o.device = DSK_PREFER_AUTO;
        DSK_TEST_OK(dsk_ctx_init(&ctx, &o));
        DSK_TEST_EXPECT(ctx.device.type == DSK_DEV_CPU, "auto falls back to the CPU without a GPU");
    }
}

/* Restores an environment variable saved by tt_env_save. */
typedef struct tt_env { const char *name; int set; char value[256]; } tt_env;
static tt_env tt_env_save(const char *name) {
    tt_env e;
    const char *v = getenv(name);
    e.name = name;
    e.set = v != NULL;
    snprintf(e.value, sizeof e.value, "%s", v ? v : "");
    return e;
}
static void tt_env_restore(const tt_env *e) {
    if (e->set) setenv(e->name, e->value, 1);
    else unsetenv(e->name);
}

/* DSK_CPU_ISA names the kernels of a ctx whose cpu_isa is AUTO and of the calls without a ctx
   (dsk_cpu_gemm_describe(AUTO) shows which); explicit options win; an unknown name or an ISA this
   CPU lacks fails dsk_ctx_init naming the variable. The caller's value is restored. */
static void test_ctx_isa_env(void) {
    static const char *bad[4] = {"avx3", "AVX2", " avx2", "avx2,fma"};
    tt_env was = tt_env_save("DSK_CPU_ISA");
    char desc[32], want[64];
    dsk_ctx ctx;
    dsk_ctx_opts o;
    dsk_cpu_isa best = dsk_cpu_isa_best();
    memset(&o, 0, sizeof o);
    o.device = DSK_PREFER_CPU;
    for (int i = DSK_CPU_ISA_PORTABLE; i <= DSK_CPU_ISA_AVX512; i++) {
        const char *n = dsk_cpu_isa_name((dsk_cpu_isa)i);
        setenv("DSK_CPU_ISA", n, 1);
        if (!dsk_cpu_isa_supported((dsk_cpu_isa)i)) {
            snprintf(want, sizeof want, "DSK_CPU_ISA=%s but this CPU or build lacks %s", n, n);
            TT_ERR(dsk_ctx_init(&ctx, &o), DSK_ERR_UNSUPPORTED, want);
            DSK_TEST_EXPECT(dsk_cpu_isa_auto() == best, "DSK_CPU_ISA=%s (missing here): calls without a ctx use %s", n,
                            dsk_cpu_isa_name(best));
            continue;
        }
        DSK_TEST_OK(dsk_ctx_init(&ctx, &o));
        DSK_TEST_EXPECT(ctx.cpu_isa == (dsk_cpu_isa)i, "DSK_CPU_ISA=%s gives a ctx of %s", n,
                        dsk_cpu_isa_name(ctx.cpu_isa));
        dsk_cpu_gemm_describe(DSK_CPU_ISA_AUTO, desc, sizeof desc);
        DSK_TEST_EXPECT(dsk_cpu_isa_auto() == (dsk_cpu_isa)i && !strncmp(desc, n, strlen(n)) && desc[strlen(n)] == ' ',
                        "DSK_CPU_ISA=%s: calls without a ctx use %s (%s)", n, dsk_cpu_isa_name(dsk_cpu_isa_auto()),
                        desc);
        o.cpu_isa = i == DSK_CPU_ISA_PORTABLE ? best : DSK_CPU_ISA_PORTABLE; /* explicit options win */
        DSK_TEST_OK(dsk_ctx_init(&ctx, &o));
        DSK_TEST_EXPECT(ctx.cpu_isa == o.cpu_isa, "cpu_isa %s over DSK_CPU_ISA=%s gives %s",
                        dsk_cpu_isa_name(o.cpu_isa), n, dsk_cpu_isa_name(ctx.cpu_isa));
        o.cpu_isa = DSK_CPU_ISA_AUTO;
    }
    for (int i = 0; i < 2; i++) {
        setenv("DSK_CPU_ISA", i ? "auto" : "", 1);
        DSK_TEST_OK(dsk_ctx_init(&ctx, &o));
        DSK_TEST_EXPECT(ctx.cpu_isa == best && dsk_cpu_isa_auto() == best, "DSK_CPU_ISA=\"%s\" gives %s, want %s",
                        i ? "auto" : "", dsk_cpu_isa_name(ctx.cpu_isa), dsk_cpu_isa_name(best));
    }
    for (int i = 0; i < 4; i++) {
        setenv("DSK_CPU_ISA", bad[i], 1);
        snprintf(want, sizeof want, "DSK_CPU_ISA=\"%s\" is not one of", bad[i]);
        TT_ERR(dsk_ctx_init(&ctx, &o), DSK_ERR_ARG, want);
        DSK_TEST_EXPECT(dsk_cpu_isa_auto() == best, "DSK_CPU_ISA=\"%s\": calls without a ctx use the best", bad[i]);
        o.cpu_isa = DSK_CPU_ISA_PORTABLE; /* not read when the options name an ISA */
        DSK_TEST_OK(dsk_ctx_init(&ctx, &o));
        DSK_TEST_EXPECT(ctx.cpu_isa == DSK_CPU_ISA_PORTABLE, "cpu_isa portable over DSK_CPU_ISA=\"%s\"", bad[i]);
        o.cpu_isa = DSK_CPU_ISA_AUTO;
    }
    tt_env_restore(&was);
}

/* The default thread count: without OMP_NUM_THREADS each local rank gets its share of the cores,
   omp_get_num_procs() / LOCAL_WORLD_SIZE, at least 1 (before, every rank took them all), or
   OpenMP's maximum if the program set a lower one; with it, OpenMP's maximum; explicit options
   win. OpenMP's maximum is set to the core count first and restored. */
static void test_ctx_threads(void) {
#ifdef _OPENMP
    static const char *ignored[4] = {"0", "-2", "two", "2x"};
    tt_env omp = tt_env_save("OMP_NUM_THREADS"), lws = tt_env_save("LOCAL_WORLD_SIZE");
    int procs = omp_get_num_procs(), nt0 = omp_get_max_threads();
    char v[32];
    dsk_ctx ctx;
    dsk_ctx_opts o;
    omp_set_num_threads(procs);
    memset(&o, 0, sizeof o);
    o.device = DSK_PREFER_CPU;
    unsetenv("OMP_NUM_THREADS");
    unsetenv("LOCAL_WORLD_SIZE");
    DSK_TEST_OK(dsk_ctx_init(&ctx, &o));
    DSK_TEST_EXPECT(ctx.n_threads == procs, "one rank: %d threads, want the %d cores", ctx.n_threads, procs);
    for (int k = 1; k <= 2 * procs + 1; k += 1 + k / 2) {
        int want = procs / k > 1 ? procs / k : 1;
        snprintf(v, sizeof v, "%d", k);
        setenv("LOCAL_WORLD_SIZE", v, 1);
        DSK_TEST_OK(dsk_ctx_init(&ctx, &o));
        DSK_TEST_EXPECT(ctx.n_threads == want, "LOCAL_WORLD_SIZE=%d on %d cores: %d threads, want %d", k, procs,
                        ctx.n_threads, want);
    }
    for (int i = 0; i < 4; i++) {
        setenv("LOCAL_WORLD_SIZE", ignored[i], 1);
        DSK_TEST_OK(dsk_ctx_init(&ctx, &o));
        DSK_TEST_EXPECT(ctx.n_threads == procs, "LOCAL_WORLD_SIZE=\"%s\" counts as 1: %d threads, want %d", ignored[i],
                        ctx.n_threads, procs);
    }
    unsetenv("LOCAL_WORLD_SIZE");
    omp_set_num_threads(1); /* a program's lower maximum is kept */
    DSK_TEST_OK(dsk_ctx_init(&ctx, &o));
    DSK_TEST_EXPECT(ctx.n_threads == 1, "omp_set_num_threads(1): %d threads", ctx.n_threads);
    omp_set_num_threads(procs);
    setenv("LOCAL_WORLD_SIZE", "2", 1);
    o.n_threads = 3;
    DSK_TEST_OK(dsk_ctx_init(&ctx, &o));
    DSK_TEST_EXPECT(ctx.n_threads == 3, "explicit n_threads 3 under LOCAL_WORLD_SIZE=2: %d", ctx.n_threads);
    o.n_threads = 0;
    setenv("OMP_NUM_THREADS", "3", 1); /* OpenMP read it at start: its maximum is what the user chose */
    DSK_TEST_OK(dsk_ctx_init(&ctx, &o));
    DSK_TEST_EXPECT(ctx.n_threads == omp_get_max_threads(), "OMP_NUM_THREADS set: %d threads, want OpenMP's %d",
                    ctx.n_threads, omp_get_max_threads());
    tt_env_restore(&omp);
    tt_env_restore(&lws);
    omp_set_num_threads(nt0);
#else
    dsk_test_skip("built without OpenMP");
#endif
}

static void test_tensor_alloc_errors(void) {
    dsk_tensor t, z;
    int64_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    char buf[8];
    TT_ERR(dsk_tensor_alloc(NULL, &t, DSK_F32, 9, nine), DSK_ERR_ARG, "dsk_tensor_alloc: ndim 9 outside [0, 8]");
    TT_ERR(dsk_tensor_alloc(NULL, &t, DSK_F32, 2, SH(3, -2)), DSK_ERR_ARG, "shape[1] = -2 is negative");
    TT_ERR(dsk_tensor_alloc(NULL, &t, (dsk_dtype)77, 1, SH(3)), DSK_ERR_ARG, "invalid dtype 77");
    TT_ERR(dsk_tensor_wrap(&t, NULL, DSK_F32, dsk_cpu(), 1, SH(3)), DSK_ERR_ARG, "dsk_tensor_wrap: data is NULL for 3 elements");
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &t, DSK_BF16, 3, SH(2, 0, 5)));
    DSK_TEST_EXPECT(dsk_tensor_numel(&t) == 0 && dsk_tensor_nbytes(&t) == 0, "empty tensor");
    DSK_TEST_OK(dsk_scale(NULL, &t, 2.0f));
    dsk_tensor_free(NULL, &t);
    memset(&z, 0, sizeof z);
    dsk_tensor_free(NULL, &z); /* zeroed is fine */
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &t, DSK_F32, 3, SH(123, 456, 1)));
    DSK_TEST_EXPECT(!strcmp(dsk_tensor_describe(&t, buf, sizeof buf), "[123,45"), "describe truncates safely: \"%s\"", buf);
    dsk_tensor_free(NULL, &t);
}

/* A shape whose element count, byte count or contiguous strides do not fit (PTRDIFF_MAX bytes)
   fails every constructor, naming it: before, [2^40, 2^30] allocated 0 elements and [2^31, 2^31]
   f32 0 bytes (2^62 elements) that dsk_tensor_fill "filled". A size that fits but cannot be had
   is DSK_ERR_OOM. */
static void test_tensor_size_overflow(void) {
    static const struct { dsk_dtype dt; int ndim; int64_t shape[3]; const char *text; } big[5] = {
        {DSK_F32, 2, {1LL << 40, 1LL << 30}, "[1099511627776,1073741824] of f32"},
        {DSK_F32, 2, {1LL << 62, 4}, "[4611686018427387904,4] of f32"},
        {DSK_F32, 2, {1LL << 31, 1LL << 31}, "[2147483648,2147483648] of f32"},
        {DSK_F64, 1, {1LL << 60}, "[1152921504606846976] of f64"},
        {DSK_BF16, 3, {0, 1LL << 62, 1LL << 2}, "[0,4611686018427387904,4] of bf16"}};
    dsk_tensor t, v, *small = tt_rand(DSK_F32, 1, SH(4), -1, 1);
    char want[128];
    for (int i = 0; i < 5; i++) {
        snprintf(want, sizeof want, "shape %s is too large", big[i].text);
        t.data = small; /* a failed constructor leaves a zeroed tensor */
        TT_ERR(dsk_tensor_alloc(NULL, &t, big[i].dt, big[i].ndim, big[i].shape), DSK_ERR_ARG, want);
        DSK_TEST_EXPECT(!t.data && t.ndim == 0, "failed alloc leaves a zeroed tensor");
        TT_ERR(dsk_tensor_wrap(&t, small->data, big[i].dt, dsk_cpu(), big[i].ndim, big[i].shape), DSK_ERR_ARG, want);
        if (big[i].dt == DSK_F32) TT_ERR(dsk_tensor_reshape(small, big[i].ndim, big[i].shape, &v), DSK_ERR_ARG, want);
    }
    /* the largest sizes that fit: no wrap, the allocator just cannot have them */
    DSK_TEST_STATUS(dsk_tensor_alloc(NULL, &t, DSK_F64, 1, SH((1LL << 60) - 1)), DSK_ERR_OOM);
    DSK_TEST_STATUS(dsk_tensor_alloc(NULL, &t, DSK_U8, 2, SH(1LL << 31, 1LL << 31)), DSK_ERR_OOM);
    /* a slice whose end would wrap */
    TT_ERR(dsk_tensor_slice(small, 0, 1, INT64_MAX, &v), DSK_ERR_ARG,
           "[1, 1 + 9223372036854775807) outside dim 0 of size 4");
}

/* The allocator's accounting: live bytes, high-water mark and count move with every owning
   alloc and free on the CPU (views and wrapped memory do not count); reset_peak brings the
   mark down to what is live. Deltas, since the harness holds tensors of its own. */
static void test_tensor_mem(void) {
    dsk_tensor a, b, v;
    float host[6];
    dsk_tensor_mem m0, m1, m2, m3, m4;
    int64_t na = 100 + dsk_test_rand_int(50), nb = 37;
    dsk_tensor_mem_reset_peak(dsk_cpu());
    m0 = dsk_tensor_mem_stats(dsk_cpu());
    DSK_TEST_EXPECT(m0.peak_bytes == m0.live_bytes, "reset: peak %lld, live %lld", (long long)m0.peak_bytes,
                    (long long)m0.live_bytes);
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &a, DSK_F32, 2, SH(na, 3)));
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &b, DSK_BF16, 1, SH(nb)));
    DSK_TEST_OK(dsk_tensor_slice(&a, 0, 1, 2, &v));
    DSK_TEST_OK(dsk_tensor_wrap(&v, host, DSK_F32, dsk_cpu(), 1, SH(6)));
    dsk_tensor_free(NULL, &v); /* a view: counts nothing */
    m1 = dsk_tensor_mem_stats(dsk_cpu());
    DSK_TEST_EXPECT(m1.live_bytes - m0.live_bytes == na * 12 + nb * 2, "live grew by %lld, want %lld",
                    (long long)(m1.live_bytes - m0.live_bytes), (long long)(na * 12 + nb * 2));
    DSK_TEST_EXPECT(m1.allocs - m0.allocs == 2, "%lld allocations counted, want 2", (long long)(m1.allocs - m0.allocs));
    DSK_TEST_EXPECT(m1.peak_bytes == m1.live_bytes, "peak %lld, live %lld", (long long)m1.peak_bytes,
                    (long long)m1.live_bytes);
    dsk_tensor_free(NULL, &a);
    m2 = dsk_tensor_mem_stats(dsk_cpu());
    DSK_TEST_EXPECT(m2.live_bytes == m1.live_bytes - na * 12 && m2.peak_bytes == m1.peak_bytes,
                    "after a free: live %lld peak %lld", (long long)m2.live_bytes, (long long)m2.peak_bytes);
    dsk_tensor_mem_reset_peak(dsk_cpu());
    m3 = dsk_tensor_mem_stats(dsk_cpu());
    DSK_TEST_EXPECT(m3.peak_bytes == m2.live_bytes, "reset peak %lld, want live %lld", (long long)m3.peak_bytes,
                    (long long)m2.live_bytes);
    dsk_tensor_free(NULL, &b);
    m4 = dsk_tensor_mem_stats(dsk_cpu());
    DSK_TEST_EXPECT(m4.live_bytes == m0.live_bytes, "all freed: live %lld, want %lld", (long long)m4.live_bytes,
                    (long long)m0.live_bytes);
    v.device.type = DSK_DEV_CUDA;
    v.device.index = 64; /* beyond the counted devices: zeros, no crash */
    m4 = dsk_tensor_mem_stats(v.device);
    DSK_TEST_EXPECT(m4.live_bytes == 0 && m4.peak_bytes == 0 && m4.allocs == 0, "device 64 has figures");
}

/* ------------------------------------------------------------------ views and copies */

/* dsk_tensor_fill on dtype dt: contiguous tensors (the memset and pattern-doubling paths, odd
   sizes, an offset row slice) and strided views; every element checked, bytes outside the view
   left alone. The wanted value is the conversion of `value` done here (ints truncate, u8
   saturates negatives to 0). */
static void test_fill(dsk_dtype dt) {
    static const double vals[5] = {0.0, 1.0, 2.5, -1.75, 96.0};
    size_t es = dsk_dtype_size(dt);
    for (int vi = 0; vi < 5; vi++) {
        double value = vals[vi], want;
        dsk_tensor *one = tt_new(dt, 1, SH(1)), *t = tt_new(dt, 2, SH(7, 37)), *e = tt_new(dt, 2, SH(0, 5)), v;
        unsigned char *raw = (unsigned char *)t->data;
        if (dt == DSK_U8 && value < 0) want = 0;
        else { tt_set(one, 0, value); want = tt_get(one, 0); }
        for (int view = 0; view < 5; view++) {
            int64_t n;
            memset(t->data, 0xA5, dsk_tensor_nbytes(t)); /* poison */
            if (view == 0) v = *t;
            else if (view == 1) DSK_TEST_OK(dsk_tensor_slice(t, 0, 2, 3, &v));  /* contiguous, offset data */
            else if (view == 2) DSK_TEST_OK(dsk_tensor_slice(t, 1, 3, 20, &v)); /* strided rows */
            else if (view == 3) DSK_TEST_OK(dsk_tensor_transpose(t, 0, 1, &v));
            else { DSK_TEST_OK(dsk_tensor_slice(t, 1, 5, 1, &v)); DSK_TEST_OK(dsk_tensor_slice(&v, 0, 1, 5, &v)); } /* a (5, 1) column */
            DSK_TEST_OK(dsk_tensor_fill(NULL, &v, value));
            n = dsk_tensor_numel(&v);
            for (int64_t i = 0; i < n; i++)
                if (tt_get(&v, i) != want) {
                    DSK_TEST_EXPECT(0, "%s fill %g view %d: element %lld is %g, want %g", dsk_dtype_name(dt), value, view, (long long)i, tt_get(&v, i), want);
                    break;
                }
            /* every byte of t that the view does not cover still holds the poison */
            {
                unsigned char *mark = (unsigned char *)tt_alloc(dsk_tensor_nbytes(t));
                int64_t bad = -1;
                for (int64_t i = 0; i < n; i++) memset(mark + (size_t)((char *)v.data - (char *)t->data) + (size_t)tt_offset(&v, i) * es, 1, es);
                for (size_t b = 0; b < dsk_tensor_nbytes(t) && bad < 0; b++)
                    if (!mark[b] && raw[b] != 0xA5) bad = (int64_t)b;
                DSK_TEST_EXPECT(bad < 0, "%s fill %g view %d wrote byte %lld outside the view", dsk_dtype_name(dt), value, view, (long long)bad);
            }
        }
        DSK_TEST_OK(dsk_tensor_fill(NULL, e, value)); /* empty */
    }
}


static void test_views(void) {
    dsk_tensor *t = tt_rand(DSK_F32, 3, SH(4, 5, 6), -1, 1), v, w;
    double *x = tt_vals(t);
    DSK_TEST_OK(dsk_tensor_reshape(t, 2, SH(20, 6), &v));
    DSK_TEST_EXPECT(v.data == t->data && !v.owns && v.shape[0] == 20 && v.stride[0] == 6, "reshape");
    DSK_TEST_OK(dsk_tensor_slice(t, 1, 2, 3, &v)); /* (4, 3, 6) */
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 3; b++)
            for (int c = 0; c < 6; c++)
                if (tt_get(&v, (a * 3 + b) * 6 + c) != x[(a * 5 + b + 2) * 6 + c]) { DSK_TEST_EXPECT(0, "slice (%d,%d,%d)", a, b, c); a = 4; b = 3; break; }
    DSK_TEST_OK(dsk_tensor_transpose(t, 0, 2, &w)); /* (6, 5, 4) */
    for (int a = 0; a < 6; a++)
        for (int b = 0; b < 5; b++)
            for (int c = 0; c < 4; c++)
                if (tt_get(&w, (a * 5 + b) * 4 + c) != x[(c * 5 + b) * 6 + a]) { DSK_TEST_EXPECT(0, "transpose (%d,%d,%d)", a, b, c); a = 6; b = 5; break; }
    DSK_TEST_EXPECT(!dsk_tensor_is_contiguous(&w), "a transpose is not contiguous");
    DSK_TEST_OK(dsk_tensor_select(t, 3, &v));
    DSK_TEST_EXPECT(v.ndim == 2 && tt_get(&v, 7) == x[3 * 30 + 7], "select");
    DSK_TEST_STATUS(dsk_tensor_reshape(&w, 1, SH(120), &v), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("not contiguous");
    DSK_TEST_STATUS(dsk_tensor_reshape(t, 2, SH(7, 17), &v), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_tensor_reshape");
    DSK_TEST_STATUS(dsk_tensor_slice(t, 2, 4, 3, &v), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("[4, 4 + 3) outside dim 2 of size 6");
    DSK_TEST_STATUS(dsk_tensor_select(t, 4, &v), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("row 4 outside");
}

/* Expected value of a cast from double x to dt, written from the contract. */
static double tt_cast_ref(double x, dsk_dtype dt) {
    switch (dt) {
    case DSK_I32: case DSK_I64: return trunc(x);
    case DSK_U8: return x <= 0 ? 0 : trunc(x);
    default: return x; /* the inputs below are exact in every float format */
    }
}

/* Copy from `src_dt` to every dtype, contiguous and from a transposed view, values that every
   format holds exactly (so a float cast is exact and an int cast truncates). */
static void test_copy_casts(dsk_dtype src_dt) {
    static const double vals[] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, 7, 12, 14, 28, 0.25, -0.5, -1.5, -3, -7, -12};
    int is_int = !dsk_dtype_is_float(src_dt);
    dsk_tensor *src = tt_new(src_dt, 2, SH(7, 9)), tr;
    for (int i = 0; i < 63; i++) {
        double v = vals[dsk_test_rand_int(18)];
        if (is_int) v = src_dt == DSK_U8 ? fabs(trunc(v)) : trunc(v);
        tt_set(src, i, v);
    }
    DSK_TEST_OK(dsk_tensor_transpose(src, 0, 1, &tr));
    for (int d = 0; d < DSK_DTYPE_COUNT; d++) {
        dsk_tensor *dst = tt_new((dsk_dtype)d, 2, SH(7, 9)), *dtr = tt_new((dsk_dtype)d, 2, SH(9, 7));
        char what[64];
        memset(dst->data, 0xA5, dsk_tensor_nbytes(dst));
        memset(dtr->data, 0xA5, dsk_tensor_nbytes(dtr));
        DSK_TEST_OK(dsk_tensor_copy(NULL, dst, src));
        DSK_TEST_OK(dsk_tensor_copy(NULL, dtr, &tr));
        for (int i = 0; i < 63; i++) {
            double want = tt_cast_ref(tt_get(src, i), (dsk_dtype)d), got = tt_get(dst, i);
            double wt = tt_cast_ref(tt_get(&tr, i), (dsk_dtype)d), gt = tt_get(dtr, i);
            snprintf(what, sizeof what, "%s -> %s", dsk_dtype_name(src_dt), dsk_dtype_name((dsk_dtype)d));
            if (got != want || gt != wt) { DSK_TEST_EXPECT(0, "%s element %d: %g want %g; transposed %g want %g", what, i, got, want, gt, wt); break; }
        }
    }
}

/* Contiguous copies between f32, bf16 and f16 (converted a piece at a time through f32) give the
   bits of the element-wise cast engine, which a copy from a transposed view runs: on random bit
   patterns, so values that round, subnormals, Inf and NaNs quiet and signalling, over pieces. */
static void test_copy_float_pieces(void) {
    static const dsk_dtype fl[3] = {DSK_F32, DSK_BF16, DSK_F16};
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++) {
            dsk_tensor *src = tt_new(fl[a], 2, SH(23, 29)), *d1 = tt_new(fl[b], 2, SH(23, 29)), tr;
            dsk_tensor *d2 = tt_new(fl[b], 2, SH(29, 23));
            size_t es = dsk_dtype_size(fl[b]);
            int64_t bad = 0, first = -1;
            if (a == b) continue;
            for (size_t i = 0; i < dsk_tensor_nbytes(src); i++)
                ((uint8_t *)src->data)[i] = (uint8_t)dsk_test_rand_u64();
            memset(d1->data, 0xA5, dsk_tensor_nbytes(d1));
            memset(d2->data, 0x5A, dsk_tensor_nbytes(d2));
            DSK_TEST_OK(dsk_tensor_transpose(src, 0, 1, &tr));
            DSK_TEST_OK(dsk_tensor_copy(NULL, d1, src));
            DSK_TEST_OK(dsk_tensor_copy(NULL, d2, &tr));
            for (int64_t i = 0; i < 23; i++)
                for (int64_t j = 0; j < 29; j++)
                    if (memcmp((char *)d1->data + (i * 29 + j) * es, (char *)d2->data + (j * 23 + i) * es, es)) {
                        bad++;
                        first = first < 0 ? i * 29 + j : first;
                    }
            DSK_TEST_EXPECT(bad == 0, "%s -> %s: %lld of 667 elements differ from the element-wise cast (first %lld)",
                            dsk_dtype_name(fl[a]), dsk_dtype_name(fl[b]), (long long)bad, (long long)first);
        }
}

/* Same-dtype strided copies move bits: int64 beyond 2^53 and NaN payloads survive. */
static void test_copy_strided_exact(void) {
    dsk_tensor *a = tt_new(DSK_I64, 2, SH(5, 3)), *b = tt_new(DSK_I64, 2, SH(3, 5)), *f = tt_new(DSK_F32, 2, SH(4, 2)),
               *g = tt_new(DSK_F32, 2, SH(2, 4)), at, ft;
    int64_t *ap = (int64_t *)a->data, *bp = (int64_t *)b->data;
    uint32_t *fp = (uint32_t *)f->data, *gp = (uint32_t *)g->data;
    for (int i = 0; i < 15; i++) ap[i] = (int64_t)(dsk_test_rand_u64() >> 1) | ((int64_t)1 << 60);
    for (int i = 0; i < 8; i++) fp[i] = 0x7fc00000u | (uint32_t)(dsk_test_rand_u64() & 0x3fffffu) | (i & 1 ? 0x80000000u : 0);
    memset(b->data, 0xA5, dsk_tensor_nbytes(b));
    memset(g->data, 0xA5, dsk_tensor_nbytes(g));
    DSK_TEST_OK(dsk_tensor_transpose(a, 0, 1, &at));
    DSK_TEST_OK(dsk_tensor_copy(NULL, b, &at));
    DSK_TEST_OK(dsk_tensor_transpose(f, 0, 1, &ft));
    DSK_TEST_OK(dsk_tensor_copy(NULL, g, &ft));
    for (int r = 0; r < 3; r++)
        for (int c = 0; c < 5; c++)
            DSK_TEST_EXPECT(bp[r * 5 + c] == ap[c * 3 + r], "i64 [%d,%d]: %lld want %lld", r, c, (long long)bp[r * 5 + c], (long long)ap[c * 3 + r]);
    for (int r = 0; r < 2; r++)
        for (int c = 0; c < 4; c++)
            DSK_TEST_EXPECT(gp[r * 4 + c] == fp[c * 2 + r], "NaN bits [%d,%d]: %08x want %08x", r, c, gp[r * 4 + c], fp[c * 2 + r]);
}

/* Same-dtype copies between column slices, and from a broadcast (stride 0) view, of 4-D
   tensors (the row-at-a-time path): every element lands in place, nothing else is written. */
static void test_copy_rows(void) {
    dsk_tensor *a = tt_new(DSK_F32, 4, SH(2, 3, 4, 5)), *d = tt_new(DSK_F32, 4, SH(2, 3, 4, 7)),
               *e = tt_new(DSK_F32, 4, SH(2, 3, 1, 3));
    dsk_tensor as, ds, eb;
    float *ap = (float *)a->data, *dp = (float *)d->data, *ep = (float *)e->data;
    dsk_test_fill_f32(ap, 120, -1, 1);
    dsk_test_fill_f32(ep, 18, -1, 1);
    dsk_test_poison_f32(dp, 168);
    DSK_TEST_OK(dsk_tensor_slice(a, 3, 1, 3, &as));
    DSK_TEST_OK(dsk_tensor_slice(d, 3, 2, 3, &ds));
    DSK_TEST_OK(dsk_tensor_copy(NULL, &ds, &as));
    for (int r = 0; r < 24; r++)
        for (int c = 0; c < 7; c++) {
            float got = dp[r * 7 + c];
            if (c >= 2 && c < 5)
                DSK_TEST_EXPECT(got == ap[r * 5 + c - 1], "slice row %d col %d: %g want %g", r, c, got,
                                ap[r * 5 + c - 1]);
            else DSK_TEST_EXPECT(got != got, "row %d col %d outside the slice was written: %g", r, c, got);
        }
    eb = *e;
    eb.shape[2] = 4;
    eb.stride[2] = 0;
    DSK_TEST_OK(dsk_tensor_copy(NULL, &ds, &eb));
    for (int r = 0; r < 24; r++)
        for (int c = 2; c < 5; c++)
            DSK_TEST_EXPECT(dp[r * 7 + c] == ep[(r / 4) * 3 + c - 2], "broadcast row %d col %d: %g want %g", r, c,
                            dp[r * 7 + c], ep[(r / 4) * 3 + c - 2]);
}

static void test_copy_rounding(void) {
    dsk_tensor *src = tt_new(DSK_F64, 1, SH(5000)), *b = tt_new(DSK_BF16, 1, SH(5000)), *i8 = tt_new(DSK_U8, 1, SH(5000)), *i32 = tt_new(DSK_I32, 1, SH(5000));
    uint32_t bad = 0;
    for (int i = 0; i < 5000; i++) tt_set(src, i, dsk_test_rand(-400, 400));
    tt_set(src, 0, NAN); tt_set(src, 1, 1e12); tt_set(src, 2, -1e12);
    DSK_TEST_OK(dsk_tensor_copy(NULL, b, src));
    DSK_TEST_OK(dsk_tensor_copy(NULL, i8, src));
    DSK_TEST_OK(dsk_tensor_copy(NULL, i32, src));
    for (int i = 0; i < 5000; i++) {
        double x = tt_get(src, i);
        uint16_t wb = dsk_f32_to_bf16((float)x);
        double w8 = x != x ? 0 : x <= 0 ? 0 : x >= 255 ? 255 : trunc(x), w32 = x != x ? 0 : x >= 2147483647.0 ? 2147483647.0 : x <= -2147483648.0 ? -2147483648.0 : trunc(x);
        if (((uint16_t *)b->data)[i] != wb || tt_get(i8, i) != w8 || tt_get(i32, i) != w32) {
            if (!bad) DSK_TEST_EXPECT(0, "element %d (%g): bf16 %04x want %04x, u8 %g want %g, i32 %g want %g", i, x, ((uint16_t *)b->data)[i], wb,
                                      tt_get(i8, i), w8, tt_get(i32, i), w32);
            bad++;
        }
    }
}

/* ------------------------------------------------------------------ matmul */

typedef struct tt_mm {
    int64_t M, N, K, batch;
    int ta, tb, a3, b3, pad; /* a3/b3: operand is 3-D (else shared 2-D); pad: leading stride > cols */
    dsk_dtype in, out;
    float alpha, beta;
} tt_mm;

/* A random operand of logical shape (batch?, rows, cols), as a view with padded rows if asked. */
static dsk_tensor *tt_operand(dsk_dtype dt, int three, int64_t batch, int64_t rows, int64_t cols, int pad) {
    dsk_tensor *big = three ? tt_rand(dt, 3, SH(batch, rows, cols + 3 * pad), -1, 1) : tt_rand(dt, 2, SH(rows, cols + 3 * pad), -1, 1);
    dsk_tensor *v = (dsk_tensor *)tt_alloc(sizeof *v);
    DSK_TEST_OK(dsk_tensor_slice(big, big->ndim - 1, pad ? 2 : 0, cols, v));
    return v;
}

/* A CPU context of n_threads on the ISA under test. */
static dsk_status tt_isa_ctx(dsk_ctx *ctx, int n_threads) {
    dsk_ctx_opts o;
    memset(&o, 0, sizeof o);
    o.device = DSK_PREFER_CPU;
    o.n_threads = n_threads;
    o.cpu_isa = tt_isa;
    return dsk_ctx_init(ctx, &o);
}

static int tt_matmul_run(const tt_mm *c, int n_threads) {
    dsk_ctx ctx;
    int64_t M = c->M, N = c->N, K = c->K, B = c->batch, ar = c->ta ? K : M, ac = c->ta ? M : K, br = c->tb ? N : K, bc = c->tb ? K : N;
    dsk_tensor *A = tt_operand(c->in, c->a3, B, ar, ac, c->pad), *Bm = tt_operand(c->in, c->b3, B, br, bc, c->pad);
    int three = c->a3 || c->b3;
    dsk_tensor *C = tt_operand(c->out, three, B, M, N, c->pad);
    double *want = tt_zeros(B * M * N), *c0;
    char what[160];
    tt_isa_ctx(&ctx, n_threads);
    if (c->beta == 0.0f)
        for (int64_t i = 0; i < dsk_tensor_numel(C); i++) tt_set(C, i, NAN);
    c0 = tt_vals(C);
    for (int64_t b = 0; b < (three ? B : 1); b++)
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) {
                double s = 0;
                for (int64_t p = 0; p < K; p++) {
                    int64_t ai = (c->a3 ? b * ar * ac : 0) + (c->ta ? p * ac + i : i * ac + p);
                    int64_t bi = (c->b3 ? b * br * bc : 0) + (c->tb ? j * bc + p : p * bc + j);
                    s += tt_get(A, ai) * tt_get(Bm, bi);
                }
                want[(b * M + i) * N + j] = c->alpha * s + (c->beta == 0.0f ? 0.0 : c->beta * c0[(b * M + i) * N + j]);
            }
    DSK_TEST_OK(dsk_matmul(&ctx, C, A, c->ta, Bm, c->tb, c->alpha, c->beta));
    snprintf(what, sizeof what, "matmul M%lld N%lld K%lld batch %lld ta%d tb%d a%dd b%dd pad%d %s->%s", (long long)M, (long long)N, (long long)K,
             (long long)B, c->ta, c->tb, c->a3 ? 3 : 2, c->b3 ? 3 : 2, c->pad, dsk_dtype_name(c->in), dsk_dtype_name(c->out));
    return TT_CHECK(C, want, tt_tol(c->out), 2e-6 * (double)K + (c->out == DSK_F32 ? 0 : tt_tol(c->out)), what);
}

/* Every (M, N, K) in {1, 5, 17, 67, 130}^3 around the 6x16 tile and the blocking, f32. */
static void test_matmul_shapes(int ta, int tb) {
    static const int64_t s[5] = {1, 5, 17, 67, 130};
    for (int i = 0; i < 5; i++)
        for (int j = 0; j < 5; j++)
            for (int k = 0; k < 5; k++) {
                tt_mm c = {s[i], s[j], s[k], 1, ta, tb, 0, 0, (i + j + k) % 2, DSK_F32, DSK_F32, 1.0f, 0.0f};
                if (!tt_matmul_run(&c, 2)) return;
            }
}

static void test_matmul_variants(void) {
    tt_mm cs[] = {
        /* M, N, K, batch, ta, tb, a3, b3, pad, in, out, alpha, beta */
        {290, 300, 260, 1, 0, 0, 0, 0, 0, DSK_F32, DSK_F32, 1.0f, 0.0f}, /* crosses KC and MC */
        {7, 3100, 270, 1, 1, 0, 0, 0, 1, DSK_F32, DSK_F32, 0.5f, 0.0f},  /* crosses NC */
        {33, 17, 129, 1, 0, 1, 0, 0, 1, DSK_F32, DSK_F32, -1.5f, 0.75f}, /* alpha and beta */
        {17, 33, 1, 1, 1, 1, 0, 0, 0, DSK_F32, DSK_F32, 2.0f, 1.0f},
        {5, 7, 9, 4, 0, 0, 1, 1, 0, DSK_F32, DSK_F32, 1.0f, 0.0f},       /* batched */
        {5, 7, 9, 3, 1, 0, 1, 0, 1, DSK_F32, DSK_F32, 1.0f, 0.5f},       /* B shared by the batch */
        {5, 7, 9, 3, 0, 1, 0, 1, 1, DSK_F32, DSK_F32, 1.0f, 0.0f},       /* A shared by the batch */
        {67, 130, 17, 2, 1, 1, 1, 1, 1, DSK_BF16, DSK_F32, 1.0f, 0.0f},  /* bf16 inputs */
        {67, 130, 17, 1, 0, 0, 0, 0, 0, DSK_BF16, DSK_BF16, 1.0f, 0.0f}, /* bf16 out */
        {31, 18, 70, 2, 0, 1, 1, 0, 1, DSK_BF16, DSK_BF16, 1.0f, 1.0f},
        {67, 130, 17, 1, 1, 0, 0, 0, 1, DSK_F16, DSK_F32, 1.0f, 0.0f}, /* f16 */
        {9, 40, 300, 3, 0, 0, 1, 1, 0, DSK_F16, DSK_F16, 0.25f, 2.0f},
        {1, 1, 1, 1, 0, 0, 0, 0, 0, DSK_F32, DSK_F32, 1.0f, 0.0f},
        {133, 97, 401, 1, 1, 1, 0, 0, 1, DSK_F32, DSK_F32, 1.0f, 0.5f},   /* threaded, odd edges */
        {131, 67, 517, 2, 0, 1, 1, 0, 1, DSK_BF16, DSK_BF16, 1.0f, 0.0f}, /* threaded bf16 */
        /* B's rows 512 bytes apart, which alias in L1: the direct nest packs them */
        {260, 128, 530, 1, 0, 0, 0, 0, 0, DSK_F32, DSK_F32, 1.0f, 0.5f},
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        TT_CASE("matmul variant %zu: %lldx%lldx%lld batch %lld %s->%s", i, (long long)cs[i].M, (long long)cs[i].N, (long long)cs[i].K,
                (long long)cs[i].batch, dsk_dtype_name(cs[i].in), dsk_dtype_name(cs[i].out));
        tt_matmul_run(&cs[i], 2);
    }
}

static void test_matmul_k0_and_alpha0(void) {
    dsk_tensor *A = tt_rand(DSK_F32, 2, SH(4, 0), -1, 1), *B = tt_rand(DSK_F32, 2, SH(0, 3), -1, 1), *C = tt_rand(DSK_F32, 2, SH(4, 3), -1, 1);
    dsk_tensor *A2 = tt_rand(DSK_F32, 2, SH(4, 5), -1, 1), *B2 = tt_rand(DSK_F32, 2, SH(5, 3), -1, 1);
    double *c0 = tt_vals(C), *want = tt_zeros(12);
    for (int i = 0; i < 12; i++) want[i] = 0.5 * c0[i];
    DSK_TEST_OK(dsk_matmul(tt_cx, C, A, 0, B, 0, 1.0f, 0.5f));
    TT_CHECK(C, want, 1e-7, 0, "K = 0 scales C by beta");
    for (int i = 0; i < 12; i++) { tt_set(C, i, NAN); want[i] = 0; }
    DSK_TEST_OK(dsk_matmul(tt_cx, C, A2, 0, B2, 0, 0.0f, 0.0f));
    TT_CHECK(C, want, 0, 0, "alpha = beta = 0 writes zeros over NaN");
}

/* Each C element sums in a fixed order: 1, 2 and 3 threads give the same bits. */
static void test_matmul_deterministic(void) {
    int64_t M = 157, N = 301, K = 530;
    float *A = (float *)tt_alloc((size_t)(M * K) * 4), *B = (float *)tt_alloc((size_t)(K * N) * 4), *C[3];
    dsk_test_fill_f32(A, M * K, -1, 1);
    dsk_test_fill_f32(B, K * N, -1, 1);
    for (int t = 0; t < 3; t++) {
        C[t] = (float *)tt_alloc((size_t)(M * N) * 4);
        dsk_sgemm_cpu(0, 1, M, N, K, 1.0f, A, K, B, K, 0.0f, C[t], N, t + 1);
    }
    DSK_TEST_SAME_BYTES(C[0], C[1], (size_t)(M * N) * 4, "1 vs 2 threads");
    DSK_TEST_SAME_BYTES(C[0], C[2], (size_t)(M * N) * 4, "1 vs 3 threads");
}

static void test_sgemm_raw(void) {
    /* lda/ldb/ldc larger than the matrix; C's padding must stay untouched */
    int64_t M = 23, N = 41, K = 19, lda = 30, ldb = 50, ldc = 45;
    float *A = (float *)tt_alloc((size_t)(K * lda) * 4), *B = (float *)tt_alloc((size_t)(N * ldb) * 4), *C = (float *)tt_alloc((size_t)(M * ldc) * 4);
    double *want = tt_zeros(M * ldc);
    float *got = (float *)tt_alloc((size_t)(M * ldc) * 4);
    dsk_test_fill_f32(A, K * lda, -1, 1);
    dsk_test_fill_f32(B, N * ldb, -1, 1);
    dsk_test_fill_f32(C, M * ldc, -1, 1);
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < ldc; j++) {
            double s = 0;
            for (int64_t p = 0; j < N && p < K; p++) s += (double)A[p * lda + i] * B[j * ldb + p];
            want[i * ldc + j] = j < N ? 2.0 * s - 1.0 * C[i * ldc + j] : C[i * ldc + j];
        }
    dsk_sgemm_cpu(1, 1, M, N, K, 2.0f, A, lda, B, ldb, -1.0f, C, ldc, 2);
    memcpy(got, C, (size_t)(M * ldc) * 4);
    DSK_TEST_CLOSE(got, want, M * ldc, 1e-5, 1e-5, "sgemm trans/trans with leading dims");
}

/* Every CPU GEMM path of the ISA under test against float64: the direct nest (f32, N <= 512)
   with K across its 512-deep slices, the packed nest (N > 512), short edge tiles (M, N of 1, 7,
   129), all four transpositions, alpha/beta and padded (strided) operands. */
static void test_gemm_paths(void) {
    static const int64_t ms[3] = {1, 7, 129}, ns[4] = {1, 7, 33, 600}, ks[4] = {1, 7, 129, 700};
    int i = 0;
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 4; b++)
            for (int k = 0; k < 4; k++, i++) {
                int t = i % 4;
                tt_mm c = {ms[a], ns[b], ks[k], 1, t >> 1, t & 1, 0, 0, i % 3 == 0, DSK_F32, DSK_F32, i % 5 ? 1.0f : -0.5f,
                           i % 7 == 0 ? 0.5f : 0.0f};
                if ((double)c.M * c.N * c.K > 2e7) c.K = 129;
                if (!tt_matmul_run(&c, 1 + i % 3)) return;
            }
}

/* A^T operands: a short one in the direct nest (N across many tiles, K across slices) and a
   tall one (a weight gradient, M > 512), which the packed nest takes; against float64. */
static void test_gemm_blocking(void) {
    tt_mm c1 = {70, 301, 530, 1, 1, 0, 0, 0, 1, DSK_F32, DSK_F32, 1.0f, 0.5f};
    tt_mm c2 = {530, 40, 300, 1, 1, 0, 0, 0, 0, DSK_F32, DSK_F32, -0.5f, 0.0f};
    if (tt_matmul_run(&c1, 2)) tt_matmul_run(&c2, 3);
}

/* A deep A^T (a weight gradient) runs in the packed nest, the same product with A transposed in
   memory in the direct nest: both slice K by DSK__DIRECT_KC and sum each slice in order, so their
   bits are the same (the nest is a matter of speed, never of results), beta and K past a slice
   included, on 1 and 2 threads; the direct one against float64 by the other cases. */
static void test_gemm_nest_bits(void) {
    static const int64_t shapes[3][3] = {{128, 128, 2048}, {70, 301, 530}, {131, 17, 256}};
    for (int s = 0; s < 3; s++) {
        int64_t M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
        dsk_tensor *At = tt_rand(DSK_F32, 2, SH(K, M), -1, 1), *A = tt_poisoned(DSK_F32, 2, SH(M, K));
        dsk_tensor *B = tt_rand(DSK_F32, 2, SH(K, N), -1, 1), *C0 = tt_rand(DSK_F32, 2, SH(M, N), -1, 1), *C[2];
        for (int64_t p = 0; p < K; p++)
            for (int64_t i = 0; i < M; i++) ((float *)A->data)[i * K + p] = ((const float *)At->data)[p * M + i];
        for (int t = 0; t < 2; t++) {
            dsk_ctx ctx;
            DSK_TEST_OK(tt_isa_ctx(&ctx, t + 1));
            for (int v = 0; v < 2; v++) {
                C[v] = tt_poisoned(DSK_F32, 2, SH(M, N));
                memcpy(C[v]->data, C0->data, (size_t)(M * N) * 4);
            }
            DSK_TEST_OK(dsk_matmul(&ctx, C[0], At, 1, B, 0, 0.75f, 0.5f));
            DSK_TEST_OK(dsk_matmul(&ctx, C[1], A, 0, B, 0, 0.75f, 0.5f));
            DSK_TEST_SAME_BYTES(C[0]->data, C[1]->data, (size_t)(M * N) * 4, "A^T packed vs A direct");
            dsk_ctx_free(&ctx);
        }
    }
}

/* The same bits for 1, 2 and 3 threads on the ISA under test, in the direct and the packed nest, and
   just over the one-product team threshold (128^3 multiply-adds). */
static void test_gemm_threads(void) {
    static const int64_t shapes[3][3] = {{157, 301, 530}, {157, 700, 300}, {130, 140, 131}};
    for (int s = 0; s < 3; s++) {
        int64_t M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
        dsk_tensor *A = tt_rand(DSK_F32, 2, SH(M, K), -1, 1), *B = tt_rand(DSK_F32, 2, SH(N, K), -1, 1), *C[3];
        for (int t = 0; t < 3; t++) {
            dsk_ctx ctx;
            DSK_TEST_OK(tt_isa_ctx(&ctx, t + 1));
            C[t] = tt_poisoned(DSK_F32, 2, SH(M, N));
            DSK_TEST_OK(dsk_matmul(&ctx, C[t], A, 0, B, 1, 1.0f, 0.0f));
            dsk_ctx_free(&ctx);
        }
        DSK_TEST_SAME_BYTES(C[0]->data, C[1]->data, (size_t)(M * N) * 4, "1 vs 2 threads");
        DSK_TEST_SAME_BYTES(C[0]->data, C[2]->data, (size_t)(M * N) * 4, "1 vs 3 threads");
    }
}

/* A batch of small products (each below the one-product team threshold) runs as one parallel
   region over the batch: against float64, and the same bits for 1, 2 and 3 threads. */
static void test_matmul_batched_small(void) {
    tt_mm c = {64, 48, 80, 24, 0, 1, 1, 1, 1, DSK_F32, DSK_F32, 0.5f, 0.25f}; /* 24 x 246k multiply-adds */
    dsk_tensor *A = tt_rand(DSK_F32, 3, SH(24, 64, 80), -1, 1), *B = tt_rand(DSK_F32, 2, SH(80, 48), -1, 1), *C[3];
    if (!tt_matmul_run(&c, 2)) return;
    for (int t = 0; t < 3; t++) {
        dsk_ctx ctx;
        DSK_TEST_OK(tt_isa_ctx(&ctx, t + 1));
        C[t] = tt_poisoned(DSK_F32, 3, SH(24, 64, 48));
        DSK_TEST_OK(dsk_matmul(&ctx, C[t], A, 0, B, 0, 1.0f, 0.0f));
        dsk_ctx_free(&ctx);
    }
    DSK_TEST_SAME_BYTES(C[0]->data, C[1]->data, dsk_tensor_nbytes(C[0]), "batch of 24 small products, 1 vs 2 threads");
    DSK_TEST_SAME_BYTES(C[0]->data, C[2]->data, dsk_tensor_nbytes(C[0]), "batch of 24 small products, 1 vs 3 threads");
}

/* dsk_exp_f against exp in float64: within 2 ulp for normal results, 1 subnormal step below;
   NaN, infinities, overflow and underflow; dsk_sigmoid_f alike. */
static void test_exp(void) {
    int64_t bad = 0, worst_i = -1;
    double worst = 0;
    static const float special[8] = {0.0f, -0.0f, 88.72f, 88.73f, -87.4f, -103.9f, -104.5f, 1e-30f};
    for (int64_t i = 0; i <= 400000; i++) {
        float x = i < 8 ? special[i] : (float)(-105.0 + 195.0 * (double)i / 400000.0 + dsk_test_rand(0, 1e-4));
        double want = exp((double)x), got = dsk_exp_f(x), err;
        if (want > 3.4028234663852886e38) err = isinf(got) ? 0 : INFINITY;
        else if (want >= 1.1754943508222875e-38) err = fabs(got - want) / (want * 5.9604644775390625e-8); /* in ulp */
        else err = fabs(got - want) / 1.401298464324817e-45 / 2.0;                                        /* in subnormal steps */
        if (err > 2.0) bad++;
        if (err > worst) { worst = err; worst_i = i; }
    }
    DSK_TEST_EXPECT(bad == 0, "%lld arguments off by more than 2 ulp; worst %.2f ulp at sample %lld", (long long)bad, worst, (long long)worst_i);
    DSK_TEST_EXPECT(isnan(dsk_exp_f(NAN)), "exp(NaN) = %g", (double)dsk_exp_f(NAN));
    DSK_TEST_EXPECT(dsk_exp_f(INFINITY) == INFINITY && dsk_exp_f(-INFINITY) == 0.0f && dsk_exp_f(1000.0f) == INFINITY && dsk_exp_f(-1000.0f) == 0.0f,
                    "exp(+-inf) = %g %g, exp(+-1000) = %g %g", (double)dsk_exp_f(INFINITY), (double)dsk_exp_f(-INFINITY),
                    (double)dsk_exp_f(1000.0f), (double)dsk_exp_f(-1000.0f));
    DSK_TEST_EXPECT(dsk_exp_f(0.0f) == 1.0f && dsk_exp_f(1.0f) == expf(1.0f), "exp(0) = %.9g, exp(1) = %.9g", (double)dsk_exp_f(0.0f), (double)dsk_exp_f(1.0f));
    for (int i = 0; i < 2000; i++) {
        float x = (float)dsk_test_rand(-40, 40);
        double want = 1.0 / (1.0 + exp(-(double)x));
        if (fabs(dsk_sigmoid_f(x) - want) > 3e-7 * want) { DSK_TEST_EXPECT(0, "sigmoid(%.9g) = %.9g, want %.9g", (double)x, (double)dsk_sigmoid_f(x), want); break; }
    }
}

/* The row primitives of the ISA under test (the loops inside softmax, attention, norms, SwiGLU,
   rope, cross-entropy): exp, SwiGLU and rope bitwise equal to the scalar dsk_exp_f / dsk_swiglu_f /
   dsk_swiglu_grad_f / dsk_rope_rotate, the rest against float64; lengths around the vector widths, specials in the
   exp input, and a sentinel after each output that must stay untouched. */
static void test_row_kernels(void) {
    static const int64_t lens[7] = {1, 7, 8, 16, 17, 129, 1000};
    dsk__rowk rk = dsk__rowk_for(tt_isa);
    for (int li = 0; li < 7; li++) {
        int64_t n = lens[li];
        float *x = (float *)tt_alloc((size_t)(n + 1) * 4), *y = (float *)tt_alloc((size_t)(n + 1) * 4), *u = (float *)tt_alloc((size_t)n * 4);
        float *d = (float *)tt_alloc((size_t)n * 4), *dg = (float *)tt_alloc((size_t)(n + 1) * 4), *du = (float *)tt_alloc((size_t)(n + 1) * 4);
        double *want = tt_zeros(n), ws = 0, wd = 0, wabs = 0, wm = -INFINITY;
        float sum, got;
        int same = 1;
        dsk_test_fill_f32(x, n, -30, 30);
        dsk_test_fill_f32(u, n, -2, 2);
        dsk_test_fill_f32(d, n, -1, 1);
        if (n > 100) { x[3] = NAN; x[5] = INFINITY; x[6] = -INFINITY; x[7] = -200.0f; x[8] = 120.0f; }
        /* exp_sum: lane results bitwise the scalar function's, sum over the finite ones */
        dsk_test_poison_f32(y, n);
        y[n] = 12345.0f;
        sum = rk.exp_sum(y, x, n, 1.5f);
        for (int64_t i = 0; i < n; i++) {
            float e = dsk_exp_f(x[i] - 1.5f);
            same &= memcmp(&e, &y[i], 4) == 0;
            ws += e;
        }
        DSK_TEST_EXPECT(same, "%s exp_sum n %lld: lanes differ from dsk_exp_f", dsk_cpu_isa_name(tt_isa), (long long)n);
        DSK_TEST_EXPECT(y[n] == 12345.0f, "exp_sum n %lld wrote past the row", (long long)n);
        DSK_TEST_EXPECT((isnan(ws) && isnan(sum)) || (isinf(ws) && isinf(sum)) || fabs(sum - ws) <= 1e-6 * fabs(ws),
                        "exp_sum n %lld: sum %.9g, want %.9g", (long long)n, (double)sum, ws);
        /* max (NaN wins), dot, scale, mul_scale, sub_mul on finite inputs */
        got = rk.max(x, n);
        for (int64_t i = 0; i < n; i++) wm = x[i] != x[i] || wm != wm ? NAN : x[i] > wm ? x[i] : wm;
        DSK_TEST_EXPECT((isnan(wm) && isnan(got)) || got == wm, "max n %lld: %.9g, want %.9g", (long long)n, (double)got, wm);
        dsk_test_fill_f32(x, n, -3, 3);
        wm = -INFINITY;
        for (int64_t i = 0; i < n; i++) wm = x[i] > wm ? x[i] : wm;
        DSK_TEST_EXPECT(rk.max(x, n) == wm, "max n %lld of finite values: %.9g, want %.9g", (long long)n, (double)rk.max(x, n), wm);
        wabs = 0;
        for (int64_t i = 0; i < n; i++) wd += (double)x[i] * u[i], wabs += fabs((double)x[i] * u[i]);
        got = rk.dot(x, u, n);
        /* an f32 sum of n products in any order is within n u sum |x_i u_i| (u = 2^-24) of the exact one */
        DSK_TEST_EXPECT(fabs(got - wd) <= (double)(n + 1) * 0x1p-24 * wabs + 1e-30, "dot n %lld: %.9g, want %.9g",
                        (long long)n, (double)got, wd);
        dsk_test_poison_f32(y, n);
        rk.scale(y, x, 0.75f, n);
        for (int64_t i = 0; i < n; i++) want[i] = 0.75 * x[i];
        DSK_TEST_CLOSE(y, want, n, 1e-7, 0, "scale");
        dsk_test_poison_f32(y, n);
        rk.mul_scale(y, x, u, 1.25f, n);
        for (int64_t i = 0; i < n; i++) want[i] = (double)x[i] * 1.25 * u[i];
        DSK_TEST_CLOSE(y, want, n, 3e-7, 0, "mul_scale");
        for (int64_t i = 0; i < n; i++) { y[i] = d[i]; want[i] = d[i] + (double)x[i] * ((double)u[i] - 0.3f); }
        rk.sub_mul(y, x, u, 0.3f, n, 1);
        DSK_TEST_CLOSE(y, want, n, 1e-6, 1e-6, "sub_mul accumulating");
        DSK_TEST_EXPECT(y[n] == 12345.0f, "sub_mul n %lld wrote past the row", (long long)n);
        /* swiglu and its gradient (written and accumulated): bitwise the scalar functions */
        dsk_test_fill_f32(x, n, -12, 12);
        dsk_test_poison_f32(y, n);
        rk.swiglu(y, x, u, n);
        same = 1;
        for (int64_t i = 0; i < n; i++) { float e = dsk_swiglu_f(x[i], u[i]); same &= memcmp(&e, &y[i], 4) == 0; }
        DSK_TEST_EXPECT(same && y[n] == 12345.0f, "%s swiglu n %lld: differs from dsk_swiglu_f or wrote past the row", dsk_cpu_isa_name(tt_isa), (long long)n);
        for (int acc = 0; acc < 2; acc++) {
            same = 1;
            for (int64_t i = 0; i < n; i++) { dg[i] = acc ? 0.5f : NAN; du[i] = acc ? -0.25f : NAN; }
            dg[n] = du[n] = 12345.0f;
            rk.swiglu_bwd(dg, du, d, x, u, n, acc);
            for (int64_t i = 0; i < n; i++) {
                float a, b;
                dsk_swiglu_grad_f(x[i], u[i], d[i], &a, &b);
                if (acc) { a = 0.5f + a; b = -0.25f + b; }
                same &= memcmp(&a, &dg[i], 4) == 0 && memcmp(&b, &du[i], 4) == 0;
            }
            DSK_TEST_EXPECT(same && dg[n] == 12345.0f && du[n] == 12345.0f, "%s swiglu_bwd acc %d n %lld: differs from dsk_swiglu_grad_f",
                            dsk_cpu_isa_name(tt_isa), acc, (long long)n);
        }
        /* rope over the even part of the row (x pairs, u the (cos, sin) table), written in place and
           accumulated: bitwise dsk_rope_rotate (plus the old value) */
        for (int acc = 0; acc < 2; acc++) {
            int64_t m = n - (n & 1);
            same = 1;
            for (int64_t i = 0; i < m; i++) y[i] = acc ? d[i] : x[i];
            y[m] = 12345.0f;
            rk.rope(y, acc ? x : y, u, m, acc);
            for (int64_t i = 0; i < m; i += 2) {
                float y0, y1;
                dsk_rope_rotate(x[i], x[i + 1], u[i], u[i + 1], &y0, &y1);
                if (acc) { y0 = y0 + d[i]; y1 = y1 + d[i + 1]; }
                same &= memcmp(&y0, &y[i], 4) == 0 && memcmp(&y1, &y[i + 1], 4) == 0;
            }
            DSK_TEST_EXPECT(same && y[m] == 12345.0f, "%s rope acc %d n %lld: differs from dsk_rope_rotate or wrote past the row",
                            dsk_cpu_isa_name(tt_isa), acc, (long long)m);
        }
    }
    {   /* the public raw helpers (best ISA), gradient written over dout in place */
        float g[37], up[37], out[37], dgo[37], dup[37];
        int same = 1;
        dsk_test_fill_f32(g, 37, -8, 8);
        dsk_test_fill_f32(up, 37, -2, 2);
        dsk_test_fill_f32(dgo, 37, -1, 1);
        dsk_swiglu_cpu(37, g, up, out);
        for (int i = 0; i < 37; i++) { float e = dsk_swiglu_f(g[i], up[i]); same &= memcmp(&e, &out[i], 4) == 0; }
        DSK_TEST_EXPECT(same, "dsk_swiglu_cpu differs from dsk_swiglu_f");
        for (int i = 0; i < 37; i++) { float a, b; dsk_swiglu_grad_f(g[i], up[i], dgo[i], &a, &b); out[i] = a; dup[i] = b; }
        {
            float want_dup[37];
            memcpy(want_dup, dup, sizeof dup);
            dsk_swiglu_grad_cpu(37, g, up, dgo, dgo, dup);
            DSK_TEST_SAME_BYTES(dgo, out, sizeof out, "dsk_swiglu_grad_cpu dgate (in place over dout)");
            DSK_TEST_SAME_BYTES(dup, want_dup, sizeof dup, "dsk_swiglu_grad_cpu dup");
        }
    }
}

/* dsk_adamw_step on the ISA under test against dsk_adamw_update element by element (f32 and
   bf16 gradients, with a bf16 copy), lengths around the vector width and the op's chunks. */
static void test_adamw_isa(void) {
    static const int64_t lens[4] = {1, 17, 1000, 5000};
    dsk_adamw_opts o;
    memset(&o, 0, sizeof o);
    o.lr = 3e-3f; o.beta1 = 0.9f; o.beta2 = 0.95f; o.eps = 1e-8f; o.weight_decay = 0.1f;
    for (int li = 0; li < 4; li++)
        for (int d = 0; d < 2; d++) {
            int64_t n = lens[li];
            dsk_tensor *p = tt_rand(DSK_F32, 1, SH(n), -1, 1), *g = tt_rand(tt_floats[d], 1, SH(n), -1, 1), *m = tt_rand(DSK_F32, 1, SH(n), -0.1, 0.1);
            dsk_tensor *v = tt_rand(DSK_F32, 1, SH(n), 0, 0.01), *cp = tt_poisoned(DSK_BF16, 1, SH(n));
            double *wp = tt_zeros(n), *wm = tt_zeros(n), *wv = tt_zeros(n), *wc = tt_zeros(n);
            float bc1 = dsk_adamw_bias_correction(0.9f, 7), bc2 = dsk_adamw_bias_correction(0.95f, 7);
            for (int64_t i = 0; i < n; i++) {
                float pi = ((float *)p->data)[i], mi = ((float *)m->data)[i], vi = ((float *)v->data)[i];
                dsk_adamw_update(&pi, &mi, &vi, (float)tt_get(g, i) * 0.5f, o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, bc1, bc2);
                wp[i] = pi; wm[i] = mi; wv[i] = vi; wc[i] = dsk_bf16_to_f32(dsk_f32_to_bf16(pi));
            }
            DSK_TEST_OK(dsk_adamw_step(tt_cx, p, g, m, v, &o, 7, 0.5f, cp));
            TT_CHECK(p, wp, 1e-6, 1e-9, "AdamW param vs dsk_adamw_update");
            TT_CHECK(m, wm, 1e-6, 1e-12, "AdamW m");
            TT_CHECK(v, wv, 1e-6, 1e-15, "AdamW v");
            TT_CHECK(cp, wc, 8e-3, 0, "AdamW bf16 copy");
        }
}

/* ------------------------------------------------------------------ elementwise and reductions */

static const int64_t tt_shapes[4][3] = {{1, 1, 1}, {7, 1, 1}, {129, 1, 1}, {3, 5, 7}};
static const int tt_ndims[4] = {1, 1, 1, 3};

static void test_elementwise(dsk_dtype dt) {
    for (int s = 0; s < 4; s++) {
        const int64_t *sh = tt_shapes[s];
        int nd = tt_ndims[s];
        dsk_tensor *a = tt_rand(dt, nd, sh, -2, 2), *b = tt_rand(dt, nd, sh, -2, 2), *out = tt_poisoned(dt, nd, sh);
        int64_t n = dsk_tensor_numel(a);
        double *x = tt_vals(a), *y = tt_vals(b), *w = tt_zeros(n);
        for (int64_t i = 0; i < n; i++) w[i] = x[i] + y[i];
        DSK_TEST_OK(dsk_add(tt_cx, out, a, b));
        TT_CHECK(out, w, tt_tol(dt), 1e-6, "add");
        for (int64_t i = 0; i < n; i++) w[i] = x[i] * y[i];
        DSK_TEST_OK(dsk_mul(tt_cx, out, a, b));
        TT_CHECK(out, w, tt_tol(dt), 1e-6, "mul");
        for (int64_t i = 0; i < n; i++) w[i] = -0.75 * x[i];
        DSK_TEST_OK(dsk_scale(tt_cx, a, -0.75f));
        TT_CHECK(a, w, tt_tol(dt), 0, "scale");
        x = tt_vals(a);
        for (int64_t i = 0; i < n; i++) w[i] = x[i] + 1.25 * y[i];
        DSK_TEST_OK(dsk_axpy(tt_cx, a, 1.25f, b));
        TT_CHECK(a, w, tt_tol(dt), 1e-6, "axpy");
        x = tt_vals(a);
        for (int64_t i = 0; i < n; i++) w[i] = x[i] + x[i];
        DSK_TEST_OK(dsk_add(tt_cx, a, a, a));
        TT_CHECK(a, w, tt_tol(dt), 1e-6, "add in place");
    }
    {   /* large enough to run on several threads */
        dsk_tensor *a = tt_rand(dt, 2, SH(300, 301), -2, 2), *b = tt_rand(dt, 2, SH(300, 301), -2, 2), *out = tt_poisoned(dt, 2, SH(300, 301));
        double *x = tt_vals(a), *y = tt_vals(b), *w = tt_zeros(300 * 301);
        for (int64_t i = 0; i < 300 * 301; i++) w[i] = x[i] * y[i];
        DSK_TEST_OK(dsk_mul(tt_cx, out, a, b));
        TT_CHECK(out, w, tt_tol(dt), 1e-6, "mul 300x301");
    }
}

static void tt_reduce_ref(const double *x, const int64_t *shape, int ndim, int axis, dsk_reduce_op op, double *w) {
    int64_t outer = 1, len = shape[axis], inner = 1;
    for (int i = 0; i < axis; i++) outer *= shape[i];
    for (int i = axis + 1; i < ndim; i++) inner *= shape[i];
    for (int64_t o = 0; o < outer; o++)
        for (int64_t i = 0; i < inner; i++) {
            double acc = op == DSK_REDUCE_MAX ? -INFINITY : 0;
            for (int64_t r = 0; r < len; r++) {
                double v = x[(o * len + r) * inner + i];
                acc = op == DSK_REDUCE_MAX ? (v > acc ? v : acc) : acc + v;
            }
            w[o * inner + i] = op == DSK_REDUCE_MEAN ? acc / (double)len : acc;
        }
}

static void test_reduce(dsk_dtype dt) {
    static const int64_t shapes[3][3] = {{7, 129, 5}, {1, 7, 1}, {3, 300, 2}};
    for (int s = 0; s < 3; s++)
        for (int axis = -1; axis < 3; axis++)
            for (int op = 0; op < 3; op++) {
                const int64_t *sh = shapes[s];
                int ax = axis < 0 ? 2 : axis, keep = (s + axis + op) % 2;
                int64_t osh[3], n = sh[0] * sh[1] * sh[2];
                dsk_tensor *in = tt_rand(dt, 3, sh, -3, 3), *out;
                double *x = tt_vals(in), *w = tt_zeros(n);
                char what[96];
                int od = 0;
                for (int i = 0; i < 3; i++)
                    if (i != ax) osh[od++] = sh[i];
                    else if (keep) osh[od++] = 1;
                out = tt_poisoned(dt, od, osh);
                tt_reduce_ref(x, sh, 3, ax, (dsk_reduce_op)op, w);
                DSK_TEST_OK(dsk_reduce(NULL, out, in, axis, (dsk_reduce_op)op));
                snprintf(what, sizeof what, "reduce op %d axis %d of [%lld,%lld,%lld]%s", op, axis, (long long)sh[0], (long long)sh[1], (long long)sh[2],
                         keep ? " keepdim" : "");
                if (!TT_CHECK(out, w, tt_tol(dt), 1e-5 * (double)sh[ax], what)) return;
            }
    {   /* max propagates NaN */
        dsk_tensor *in = tt_rand(dt, 2, SH(3, 4), -1, 1), *out = tt_poisoned(dt, 1, SH(3));
        tt_set(in, 5, NAN);
        DSK_TEST_OK(dsk_reduce(NULL, out, in, 1, DSK_REDUCE_MAX));
        DSK_TEST_EXPECT(isnan(tt_get(out, 1)) && !isnan(tt_get(out, 0)) && !isnan(tt_get(out, 2)), "NaN in row 1 only");
    }
}

static void test_sum_squares(void) {
    static const int64_t ns[5] = {1, 7, 129, 4097, 600001};
    for (int d = 0; d < 3; d++)
        for (int s = 0; s < 5; s++) {
            dsk_tensor *in = tt_rand(tt_floats[d], 1, SH(ns[s]), -2, 2), *out = tt_poisoned(DSK_F32, 0, NULL);
            double *x = tt_vals(in), w = tt_dot(x, x, ns[s]);
            DSK_TEST_OK(dsk_sum_squares(NULL, out, in));
            if (!TT_CHECK(out, &w, 1e-6, 0, "sum_squares")) return;
        }
    {   /* the same bits with 1 and 2 threads */
        dsk_ctx c1, c2;
        dsk_ctx_opts o;
        dsk_tensor *in = tt_rand(DSK_F32, 1, SH(700001), -2, 2), *r1 = tt_new(DSK_F32, 0, NULL), *r2 = tt_new(DSK_F32, 0, NULL);
        memset(&o, 0, sizeof o);
        o.device = DSK_PREFER_CPU;
        o.n_threads = 1;
        dsk_ctx_init(&c1, &o);
        o.n_threads = 2;
        dsk_ctx_init(&c2, &o);
        DSK_TEST_OK(dsk_sum_squares(&c1, r1, in));
        DSK_TEST_OK(dsk_sum_squares(&c2, r2, in));
        DSK_TEST_SAME_BYTES(r1->data, r2->data, 4, "sum_squares 1 vs 2 threads");
    }
}

/* ------------------------------------------------------------------ softmax, rmsnorm, activations */

static void tt_softmax_ref(const double *x, int64_t R, int64_t C, double *y) {
    for (int64_t r = 0; r < R; r++) {
        double mx = -INFINITY, s = 0;
        for (int64_t j = 0; j < C; j++) mx = x[r * C + j] > mx ? x[r * C + j] : mx;
        for (int64_t j = 0; j < C; j++) s += exp(x[r * C + j] - mx);
        for (int64_t j = 0; j < C; j++) y[r * C + j] = exp(x[r * C + j] - mx) / s;
    }
}

typedef struct tt_ud {
    int64_t R, C, D, T, H, B, V, n;
    const double *g, *a, *b, *c;
    double scale, eps, theta;
    int64_t pos0;
    const int32_t *ids;
    int32_t ignore;
} tt_ud;

static double tt_softmax_loss(const double *x, void *p) {
    tt_ud *u = (tt_ud *)p;
    double *y = (double *)malloc((size_t)(u->R * u->C) * sizeof(double)), l;
    tt_softmax_ref(x, u->R, u->C, y);
    l = tt_dot(y, u->g, u->R * u->C);
    free(y);
    return l;
}

static void test_softmax(dsk_dtype dt) {
    static const int64_t sh[4][2] = {{1, 1}, {7, 129}, {5, 7}, {2, 1000}};
    for (int s = 0; s < 4; s++) {
        int64_t R = sh[s][0], C = sh[s][1];
        dsk_tensor *x = tt_rand(dt, 2, sh[s], -4, 4), *y = tt_poisoned(dt, 2, sh[s]), *dy = tt_rand(dt, 2, sh[s], -1, 1), *dx = tt_rand(dt, 2, sh[s], -1, 1);
        double *xv = tt_vals(x), *w = tt_zeros(R * C), *dx0 = tt_vals(dx), *g;
        tt_ud u;
        memset(&u, 0, sizeof u);
        tt_softmax_ref(xv, R, C, w);
        DSK_TEST_OK(dsk_softmax(tt_cx, y, x));
        TT_CHECK(y, w, tt_tol(dt), 1e-7, "softmax");
        if (R * C > 2000) continue;
        /* backward from the saved y against central differences of the reference */
        u.R = R; u.C = C; u.g = tt_vals(dy);
        g = tt_numgrad(tt_softmax_loss, xv, R * C, &u);
        DSK_TEST_OK(dsk_softmax_backward(tt_cx, dx, y, dy));
        TT_CHECK(dx, tt_plus(dx0, g, R * C), dt == DSK_F32 ? 1e-4 : 3 * tt_tol(dt), dt == DSK_F32 ? 1e-6 : 1e-2, "softmax backward vs finite differences");
    }
    {   /* in place, with huge logits */
        dsk_tensor *x = tt_rand(dt, 2, SH(3, 9), -1, 1);
        double *w = tt_zeros(27), *xv;
        tt_set(x, 4, 1e4); tt_set(x, 13, -1e4);
        xv = tt_vals(x);
        tt_softmax_ref(xv, 3, 9, w);
        DSK_TEST_OK(dsk_softmax(tt_cx, x, x));
        TT_CHECK(x, w, tt_tol(dt), 1e-7, "softmax in place, large logits");
    }
}

static void tt_rmsnorm_ref(const double *x, const double *w, int64_t R, int64_t D, double eps, double *y, double *rstd) {
    for (int64_t r = 0; r < R; r++) {
        double ss = 0, rs;
        for (int64_t j = 0; j < D; j++) ss += x[r * D + j] * x[r * D + j];
        rs = 1.0 / sqrt(ss / (double)D + eps);
        if (rstd) rstd[r] = rs;
        for (int64_t j = 0; j < D; j++) y[r * D + j] = x[r * D + j] * rs * w[j];
    }
}
/* Loss as a function of x (first R*D entries) and w (next D entries). */
static double tt_rmsnorm_loss(const double *xw, void *p) {
    tt_ud *u = (tt_ud *)p;
    double *y = (double *)malloc((size_t)(u->R * u->D) * sizeof(double)), l;
    tt_rmsnorm_ref(xw, xw + u->R * u->D, u->R, u->D, u->eps, y, NULL);
    l = tt_dot(y, u->g, u->R * u->D);
    free(y);
    return l;
}

static void test_rmsnorm(dsk_dtype dt) {
    static const int64_t sh[4][3] = {{1, 1, 1}, {1, 7, 129}, {2, 3, 7}, {1, 64, 300}};
    for (int s = 0; s < 4; s++) {
        int64_t R = sh[s][0] * sh[s][1], D = sh[s][2];
        dsk_tensor *x = tt_rand(dt, 3, sh[s], -2, 2), *w = tt_rand(dt, 1, SH(D), 0.5, 1.5), *y = tt_poisoned(dt, 3, sh[s]);
        dsk_tensor *rstd = tt_poisoned(DSK_F32, 2, sh[s]), *dy = tt_rand(dt, 3, sh[s], -1, 1), *dx = tt_rand(dt, 3, sh[s], -1, 1), *dw = tt_rand(dt, 1, SH(D), -1, 1);
        double *xw = tt_zeros(R * D + D), *yw = tt_zeros(R * D), *rw = tt_zeros(R), *dx0 = tt_vals(dx), *dw0 = tt_vals(dw), *g, eps = 1e-5;
        double tol = dt == DSK_F32 ? 1e-4 : 3 * tt_tol(dt), atol = dt == DSK_F32 ? 1e-5 : 3e-2;
        tt_ud u;
        memcpy(xw, tt_vals(x), (size_t)(R * D) * sizeof(double));
        memcpy(xw + R * D, tt_vals(w), (size_t)D * sizeof(double));
        tt_rmsnorm_ref(xw, xw + R * D, R, D, eps, yw, rw);
        DSK_TEST_OK(dsk_rmsnorm(tt_cx, y, rstd, x, w, (float)eps));
        TT_CHECK(y, yw, tt_tol(dt), 1e-6, "rmsnorm y");
        TT_CHECK(rstd, rw, 1e-5, 0, "rmsnorm rstd");
        memset(&u, 0, sizeof u);
        u.R = R; u.D = D; u.eps = eps; u.g = tt_vals(dy);
        if (R * D > 3000) {
            /* large: dw only against the reference in closed form (sum over rows of dy * x * rstd) */
            double *want = tt_zeros(D);
            for (int64_t j = 0; j < D; j++) {
                want[j] = dw0[j];
                for (int64_t r = 0; r < R; r++) want[j] += u.g[r * D + j] * xw[r * D + j] * rw[r];
            }
            DSK_TEST_OK(dsk_rmsnorm_backward(tt_cx, NULL, dw, dy, x, w, rstd));
            TT_CHECK(dw, want, tol, atol, "rmsnorm dw (dx NULL)");
            continue;
        }
        g = tt_numgrad(tt_rmsnorm_loss, xw, R * D + D, &u);
        DSK_TEST_OK(dsk_rmsnorm_backward(tt_cx, dx, dw, dy, x, w, rstd));
        TT_CHECK(dx, tt_plus(dx0, g, R * D), tol, atol, "rmsnorm dx vs finite differences");
        TT_CHECK(dw, tt_plus(dw0, g + R * D, D), tol, atol, "rmsnorm dw vs finite differences");
    }
}

static double tt_silu_ref(double x) { return x / (1 + exp(-x)); }
static double tt_silu_loss(const double *x, void *p) {
    tt_ud *u = (tt_ud *)p;
    double l = 0;
    for (int64_t i = 0; i < u->n; i++) l += tt_silu_ref(x[i]) * u->g[i];
    return l;
}
/* x = [gate; up] */
static double tt_swiglu_loss(const double *x, void *p) {
    tt_ud *u = (tt_ud *)p;
    double l = 0;
    for (int64_t i = 0; i < u->n; i++) l += tt_silu_ref(x[i]) * x[u->n + i] * u->g[i];
    return l;
}

static void test_silu_swiglu(dsk_dtype dt) {
    for (int s = 0; s < 4; s++) {
        const int64_t *sh = tt_shapes[s];
        int nd = tt_ndims[s];
        dsk_tensor *x = tt_rand(dt, nd, sh, -6, 6), *up = tt_rand(dt, nd, sh, -2, 2), *y = tt_poisoned(dt, nd, sh), *dy = tt_rand(dt, nd, sh, -1, 1);
        dsk_tensor *dx = tt_rand(dt, nd, sh, -1, 1), *dup = tt_rand(dt, nd, sh, -1, 1);
        int64_t n = dsk_tensor_numel(x);
        double *xv = tt_vals(x), *uv = tt_vals(up), *w = tt_zeros(n), *dx0 = tt_vals(dx), *du0 = tt_vals(dup), *both = tt_zeros(2 * n), *g;
        double tol = dt == DSK_F32 ? 1e-4 : 3 * tt_tol(dt), atol = dt == DSK_F32 ? 1e-6 : 1e-2;
        tt_ud u;
        memset(&u, 0, sizeof u);
        u.n = n; u.g = tt_vals(dy);
        for (int64_t i = 0; i < n; i++) w[i] = tt_silu_ref(xv[i]);
        DSK_TEST_OK(dsk_silu(tt_cx, y, x));
        TT_CHECK(y, w, tt_tol(dt), 1e-7, "silu");
        g = tt_numgrad(tt_silu_loss, xv, n, &u);
        DSK_TEST_OK(dsk_silu_backward(tt_cx, dx, dy, x));
        TT_CHECK(dx, tt_plus(dx0, g, n), tol, atol, "silu backward vs finite differences");
        for (int64_t i = 0; i < n; i++) w[i] = tt_silu_ref(xv[i]) * uv[i];
        DSK_TEST_OK(dsk_swiglu(tt_cx, y, x, up));
        TT_CHECK(y, w, tt_tol(dt), 1e-7, "swiglu");
        memcpy(both, xv, (size_t)n * sizeof(double));
        memcpy(both + n, uv, (size_t)n * sizeof(double));
        g = tt_numgrad(tt_swiglu_loss, both, 2 * n, &u);
        dx0 = tt_vals(dx);
        DSK_TEST_OK(dsk_swiglu_backward(tt_cx, dx, dup, dy, x, up, DSK_GRAD_ADD));
        TT_CHECK(dx, tt_plus(dx0, g, n), tol, atol, "swiglu dgate vs finite differences");
        TT_CHECK(dup, tt_plus(du0, g + n, n), tol, atol, "swiglu dup vs finite differences");
        { /* DSK_GRAD_WRITE into NaN: the values DSK_GRAD_ADD gives into zeros, and the finite differences */
            dsk_tensor *zg = tt_zeroed(dt, nd, sh), *zu = tt_zeroed(dt, nd, sh), *wg = tt_poisoned(dt, nd, sh),
                       *wu = tt_poisoned(dt, nd, sh);
            DSK_TEST_OK(dsk_swiglu_backward(tt_cx, zg, zu, dy, x, up, DSK_GRAD_ADD));
            DSK_TEST_OK(dsk_swiglu_backward(tt_cx, wg, wu, dy, x, up, DSK_GRAD_WRITE));
            TT_CHECK(wg, tt_vals(zg), 0, 0, "swiglu dgate written = added into zeros");
            TT_CHECK(wu, tt_vals(zu), 0, 0, "swiglu dup written = added into zeros");
            TT_CHECK(wg, g, tol, atol, "swiglu dgate written vs finite differences");
            TT_CHECK(wu, g + n, tol, atol, "swiglu dup written vs finite differences");
        }
    }
}

/* ------------------------------------------------------------------ embedding, gather, scatter */

static double tt_embed_loss(const double *table, void *p) {
    tt_ud *u = (tt_ud *)p;
    double l = 0;
    for (int64_t t = 0; t < u->T; t++)
        for (int64_t j = 0; j < u->D; j++) l += table[u->ids[t] * u->D + j] * u->g[t * u->D + j];
    return l;
}

static void test_embedding(dsk_dtype dt) {
    static const int64_t cfg[3][3] = {{1, 1, 1}, {7, 5, 13}, {50, 129, 3}}; /* V, D, T */
    for (int s = 0; s < 3; s++) {
        int64_t V = cfg[s][0], D = cfg[s][1], T = cfg[s][2];
        dsk_tensor *table = tt_rand(dt, 2, SH(V, D), -1, 1), *ids = tt_ids(2, SH(1, T), V), *out = tt_poisoned(dt, 3, SH(1, T, D));
        dsk_tensor *dout = tt_rand(dt, 3, SH(1, T, D), -1, 1), *dtab = tt_rand(dt, 2, SH(V, D), -1, 1);
        double *tv = tt_vals(table), *w = tt_zeros(T * D), *d0 = tt_vals(dtab), *g;
        tt_ud u;
        if (T > 2) ((int32_t *)ids->data)[2] = ((int32_t *)ids->data)[0]; /* a repeated id */
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < D; j++) w[t * D + j] = tv[((int32_t *)ids->data)[t] * D + j];
        DSK_TEST_OK(dsk_embedding(NULL, out, table, ids));
        TT_CHECK(out, w, 0, 0, "embedding rows are copied exactly");
        memset(&u, 0, sizeof u);
        u.T = T; u.D = D; u.ids = (const int32_t *)ids->data; u.g = tt_vals(dout);
        g = tt_numgrad(tt_embed_loss, tv, V * D, &u);
        DSK_TEST_OK(dsk_embedding_backward(NULL, dtab, dout, ids));
        TT_CHECK(dtab, tt_plus(d0, g, V * D), tt_tol(dt), dt == DSK_F32 ? 1e-6 : 2e-2, "embedding backward vs finite differences");
    }
}

static void test_gather_scatter(dsk_dtype dt) {
    static const int64_t cfg[3][3] = {{1, 1, 1}, {9, 7, 20}, {129, 70, 300}}; /* R, D, N */
    for (int s = 0; s < 3; s++) {
        int64_t R = cfg[s][0], D = cfg[s][1], N = cfg[s][2];
        dsk_tensor *src = tt_rand(dt, 2, SH(R, D), -1, 1), *idx = tt_ids(1, SH(N), R), *out = tt_poisoned(dt, 2, SH(N, D));
        dsk_tensor *rows = tt_rand(dt, 2, SH(N, D), -1, 1), *dst = tt_rand(dt, 2, SH(R, D), -1, 1);
        double *sv = tt_vals(src), *rv = tt_vals(rows), *w = tt_zeros(N * D), *acc = tt_vals(dst);
        const int32_t *ix = (const int32_t *)idx->data;
        for (int64_t i = 0; i < N; i++)
            for (int64_t j = 0; j < D; j++) {
                w[i * D + j] = sv[ix[i] * D + j];
                acc[ix[i] * D + j] += rv[i * D + j];
            }
        DSK_TEST_OK(dsk_gather_rows(NULL, out, src, idx));
        TT_CHECK(out, w, 0, 0, "gather_rows");
        DSK_TEST_OK(dsk_scatter_add_rows(NULL, dst, rows, idx));
        TT_CHECK(dst, acc, tt_tol(dt), dt == DSK_F32 ? 1e-5 : 0.1, "scatter_add_rows");
    }
}

/* ------------------------------------------------------------------ grouped rows */

/* Random keys in [-1, G + 1) (some outside [0, G): left out); perm and offsets poisoned. */
static void test_group_by_key(void) {
    static const int64_t cfg[6][2] = {{0, 3}, {1, 1}, {7, 3}, {129, 8}, {1000, 64}, {300, 1}}; /* N, G */
    for (int s = 0; s < 6; s++) {
        int64_t N = cfg[s][0], G = cfg[s][1], j = 0;
        dsk_tensor *keys = tt_new(DSK_I32, 1, SH(N)), *perm = tt_new(DSK_I32, 1, SH(N)), *off = tt_new(DSK_I32, 1, SH(G + 1));
        int32_t *k = (int32_t *)keys->data, *pm = (int32_t *)perm->data, *o = (int32_t *)off->data;
        int bad_perm = 0, bad_off = 0;
        for (int64_t i = 0; i < N; i++) { k[i] = (int32_t)dsk_test_rand_int(G + 2) - 1; pm[i] = 0x5a5a5a5a; }
        for (int64_t g = 0; g <= G; g++) o[g] = 0x5a5a5a5a;
        DSK_TEST_OK(dsk_group_by_key(NULL, perm, off, keys));
        for (int64_t g = 0; g < G; g++) { /* group g: its keys' indices in increasing order */
            bad_off += o[g] != j;
            for (int64_t i = 0; i < N; i++)
                if (k[i] == g) bad_perm += pm[j++] != i;
        }
        bad_off += o[G] != j;
        for (; j < N; j++) bad_perm += pm[j] != -1;
        DSK_TEST_EXPECT(bad_off == 0 && bad_perm == 0, "N %lld G %lld: %d offsets and %d perm entries wrong", (long long)N,
                        (long long)G, bad_off, bad_perm);
    }
}

/* Random non-decreasing offsets over [lo, hi) within R rows, some segments empty. */
static dsk_tensor *tt_offsets(int64_t G, int64_t lo, int64_t hi) {
    dsk_tensor *t = tt_new(DSK_I32, 1, SH(G + 1));
    int32_t *o = (int32_t *)t->data;
    o[0] = (int32_t)lo;
    o[G] = (int32_t)hi;
    for (int64_t g = 1; g < G; g++) o[g] = (int32_t)(lo + dsk_test_rand_int(hi - lo + 1));
    for (int64_t g = 1; g < G; g++) /* insertion sort of the inner offsets */
        for (int64_t h = g; h > 1 && o[h] < o[h - 1]; h--) { int32_t x = o[h]; o[h] = o[h - 1]; o[h - 1] = x; }
    if (G > 2) o[2] = o[1]; /* one empty segment for sure */
    return t;
}

typedef struct tt_gmm {
    int64_t G, R, M, N, K; /* rows form: C (R, N) = A (R, K) op(B) (G, K, N); weights: C (G, M, N) = A (R, M)^T B (R, N) */
    int weights, tb;
    dsk_dtype in, out;
    float alpha, beta;
} tt_gmm;

/* Against float64; rows outside the segments keep their (poison) values; same bits with 1
   and 3 threads and as dsk_matmul on each segment. */
static void tt_grouped_run(const tt_gmm *c) {
    int64_t G = c->G, R = c->R, lo = R > 2 ? 1 : 0, hi = R > 2 ? R - 1 : R;
    dsk_tensor *off = tt_offsets(G, lo, hi), *A, *B, *C, *C1, *C3;
    const int32_t *o = (const int32_t *)off->data;
    double *want, *c0, *a, *b;
    int64_t nc;
    dsk_ctx ctx1, ctx3;
    dsk_ctx_opts co;
    char what[160];
    memset(&co, 0, sizeof co);
    co.device = DSK_PREFER_CPU;
    co.n_threads = 1; dsk_ctx_init(&ctx1, &co);
    co.n_threads = 3; dsk_ctx_init(&ctx3, &co);
    if (c->weights) {
        A = tt_rand(c->in, 2, SH(R, c->M), -1, 1); B = tt_rand(c->in, 2, SH(R, c->N), -1, 1);
        C = tt_rand(c->out, 3, SH(G, c->M, c->N), -1, 1);
    } else {
        A = tt_rand(c->in, 2, SH(R, c->K), -1, 1);
        B = c->tb ? tt_rand(c->in, 3, SH(G, c->N, c->K), -1, 1) : tt_rand(c->in, 3, SH(G, c->K, c->N), -1, 1);
        C = tt_rand(c->out, 2, SH(R, c->N), -1, 1);
    }
    nc = dsk_tensor_numel(C);
    if (c->beta == 0.0f) /* poison the rows the op writes; the others keep random values */
        for (int64_t i = c->weights ? 0 : o[0] * c->N; i < (c->weights ? nc : o[G] * c->N); i++) tt_set(C, i, NAN);
    C1 = tt_new(c->out, C->ndim, C->shape); C3 = tt_new(c->out, C->ndim, C->shape);
    DSK_TEST_OK(dsk_tensor_copy(NULL, C1, C));
    DSK_TEST_OK(dsk_tensor_copy(NULL, C3, C));
    c0 = tt_vals(C); a = tt_vals(A); b = tt_vals(B);
    want = tt_zeros(nc);
    memcpy(want, c0, (size_t)nc * sizeof(double));
    for (int64_t g = 0; g < G; g++) {
        if (c->weights) {
            for (int64_t i = 0; i < c->M; i++)
                for (int64_t j = 0; j < c->N; j++) {
                    double acc = 0, *w = &want[(g * c->M + i) * c->N + j];
                    for (int64_t r = o[g]; r < o[g + 1]; r++) acc += a[r * c->M + i] * b[r * c->N + j];
                    *w = c->alpha * acc + (c->beta == 0.0f ? 0.0 : c->beta * *w);
                }
        } else {
            for (int64_t r = o[g]; r < o[g + 1]; r++)
                for (int64_t j = 0; j < c->N; j++) {
                    double acc = 0, *w = &want[r * c->N + j];
                    for (int64_t p = 0; p < c->K; p++)
                        acc += a[r * c->K + p] * b[g * c->K * c->N + (c->tb ? j * c->K + p : p * c->N + j)];
                    *w = c->alpha * acc + (c->beta == 0.0f ? 0.0 : c->beta * *w);
                }
        }
    }
    DSK_TEST_OK(dsk_matmul_grouped(&ctx1, C1, A, c->weights, B, c->tb, off, c->alpha, c->beta));
    DSK_TEST_OK(dsk_matmul_grouped(&ctx3, C3, A, c->weights, B, c->tb, off, c->alpha, c->beta));
    snprintf(what, sizeof what, "grouped %s G %lld R %lld M %lld N %lld K %lld tb %d %s->%s alpha %g beta %g",
             c->weights ? "weights" : "rows", (long long)G, (long long)R, (long long)c->M, (long long)c->N,
             (long long)c->K, c->tb, dsk_dtype_name(c->in), dsk_dtype_name(c->out), (double)c->alpha, (double)c->beta);
    TT_CHECK(C1, want, tt_tol(c->out), 2e-6 * (double)(c->weights ? R : c->K) + (c->out == DSK_F32 ? 0 : tt_tol(c->out)),
             what);
    DSK_TEST_SAME_BYTES(C1->data, C3->data, dsk_tensor_nbytes(C1), "1 and 3 threads");
    for (int64_t g = 0; g < G; g++) { /* each segment bit for bit as dsk_matmul */
        dsk_tensor cs, as, bs, seg;
        int64_t n = o[g + 1] - o[g];
        if (c->weights) {
            DSK_TEST_OK(dsk_tensor_select(C, g, &cs));
            DSK_TEST_OK(dsk_tensor_slice(A, 0, o[g], n, &as));
            DSK_TEST_OK(dsk_tensor_slice(B, 0, o[g], n, &bs));
            DSK_TEST_OK(dsk_matmul(&ctx1, &cs, &as, 1, &bs, 0, c->alpha, c->beta));
        } else if (n > 0) {
            DSK_TEST_OK(dsk_tensor_slice(C, 0, o[g], n, &cs));
            DSK_TEST_OK(dsk_tensor_slice(A, 0, o[g], n, &as));
            DSK_TEST_OK(dsk_tensor_select(B, g, &bs));
            DSK_TEST_OK(dsk_matmul(&ctx1, &cs, &as, 0, &bs, c->tb, c->alpha, c->beta));
        }
        (void)seg;
    }
    DSK_TEST_SAME_BYTES(C1->data, C->data, dsk_tensor_nbytes(C1), "the same bits as dsk_matmul per segment");
    dsk_ctx_free(&ctx1);
    dsk_ctx_free(&ctx3);
}

static void test_matmul_grouped(void) {
    tt_gmm cs[] = {
        /* G, R, M, N, K, weights, tb, in, out, alpha, beta */
        {1, 7, 0, 5, 9, 0, 1, DSK_F32, DSK_F32, 1.0f, 0.0f},
        {4, 40, 0, 17, 33, 0, 1, DSK_F32, DSK_F32, 1.0f, 0.0f},
        {5, 130, 0, 70, 19, 0, 0, DSK_F32, DSK_F32, -0.5f, 1.0f},
        {8, 300, 0, 24, 260, 0, 1, DSK_BF16, DSK_F32, 1.0f, 0.0f}, /* crosses KC */
        {3, 50, 0, 31, 12, 0, 0, DSK_BF16, DSK_BF16, 1.0f, 0.0f},
        {3, 50, 0, 31, 12, 0, 1, DSK_F16, DSK_F16, 2.0f, 0.5f},
        {1, 9, 6, 5, 0, 1, 0, DSK_F32, DSK_F32, 1.0f, 1.0f},
        {6, 70, 17, 33, 0, 1, 0, DSK_F32, DSK_F32, 1.0f, 1.0f},    /* weight gradients accumulate */
        {4, 300, 12, 8, 0, 1, 0, DSK_F32, DSK_F32, 0.75f, 0.0f},   /* segments longer than KC */
        {5, 60, 9, 14, 0, 1, 0, DSK_BF16, DSK_F32, 1.0f, 1.0f},
        {3, 40, 7, 6, 0, 1, 0, DSK_BF16, DSK_BF16, 1.0f, 0.0f},
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        TT_CASE("matmul_grouped %s %zu: G %lld R %lld %s->%s", cs[i].weights ? "weights" : "rows", i, (long long)cs[i].G,
                (long long)cs[i].R, dsk_dtype_name(cs[i].in), dsk_dtype_name(cs[i].out));
        tt_grouped_run(&cs[i]);
    }
}

/* The grouped SwiGLU MLP and its backward against float64, f32 (one thread per segment) and
   bf16 (grouped GEMMs and the activation): out, dx on the segments' rows, weight gradients
   accumulated; rows outside the segments of out and dx untouched; 1 and 3 threads alike. */
static void test_swiglu_grouped(dsk_dtype dt) {
    int64_t G = 5, R = 60, D = 12, F = 9;
    dsk_tensor *off = tt_offsets(G, 1, R - 1);
    const int32_t *o = (const int32_t *)off->data;
    dsk_tensor *x = tt_rand(dt, 2, SH(R, D), -1, 1), *dy = tt_rand(dt, 2, SH(R, D), -1, 1);
    dsk_tensor *w1 = tt_rand(dt, 3, SH(G, F, D), -0.5, 0.5), *w3 = tt_rand(dt, 3, SH(G, F, D), -0.5, 0.5);
    dsk_tensor *w2 = tt_rand(dt, 3, SH(G, D, F), -0.5, 0.5), *out[2], *dx[2], *dw[2][3], *h1, *h3, *a, *da, *dh1, *dh3;
    double *xv = tt_vals(x), *dyv = tt_vals(dy), *v1 = tt_vals(w1), *v2 = tt_vals(w2), *v3 = tt_vals(w3);
    double *wo = tt_zeros(R * D), *wdx = tt_zeros(R * D), *wd1 = tt_zeros(G * F * D), *wd2 = tt_zeros(G * D * F),
           *wd3 = tt_zeros(G * F * D), *g0 = NULL;
    double tol = dt == DSK_F32 ? 1e-4 : 3e-2;
    h1 = tt_new(dt, 2, SH(R, F)); h3 = tt_new(dt, 2, SH(R, F)); a = tt_new(dt, 2, SH(R, F));
    da = tt_new(dt, 2, SH(R, F)); dh1 = tt_new(dt, 2, SH(R, F)); dh3 = tt_new(dt, 2, SH(R, F));
    for (int t = 0; t < 2; t++) {
        out[t] = tt_rand(dt, 2, SH(R, D), -1, 1);
        dx[t] = tt_rand(dt, 2, SH(R, D), -1, 1);
        for (int k = 0; k < 3; k++) dw[t][k] = tt_rand(DSK_F32, 3, k == 1 ? SH(G, D, F) : SH(G, F, D), -1, 1);
        if (t) {
            DSK_TEST_OK(dsk_tensor_copy(NULL, out[1], out[0]));
            DSK_TEST_OK(dsk_tensor_copy(NULL, dx[1], dx[0]));
            for (int k = 0; k < 3; k++) DSK_TEST_OK(dsk_tensor_copy(NULL, dw[1][k], dw[0][k]));
        }
    }
    g0 = tt_vals(dw[0][0]);
    memcpy(wd1, g0, sizeof(double) * G * F * D);
    memcpy(wd2, tt_vals(dw[0][1]), sizeof(double) * G * D * F);
    memcpy(wd3, tt_vals(dw[0][2]), sizeof(double) * G * F * D);
    memcpy(wo, tt_vals(out[0]), sizeof(double) * R * D);
    memcpy(wdx, tt_vals(dx[0]), sizeof(double) * R * D);
    for (int64_t g = 0; g < G; g++) /* float64 reference, row by row */
        for (int64_t r = o[g]; r < o[g + 1]; r++) {
            double hh1[9], hh3[9], aa[9], dd[9], q1[9], q3[9];
            for (int64_t f = 0; f < F; f++) {
                hh1[f] = hh3[f] = 0;
                for (int64_t d = 0; d < D; d++) {
                    hh1[f] += xv[r * D + d] * v1[(g * F + f) * D + d];
                    hh3[f] += xv[r * D + d] * v3[(g * F + f) * D + d];
                }
                aa[f] = hh1[f] / (1 + exp(-hh1[f])) * hh3[f];
            }
            for (int64_t d = 0; d < D; d++) {
                wo[r * D + d] = 0;
                for (int64_t f = 0; f < F; f++) wo[r * D + d] += aa[f] * v2[(g * D + d) * F + f];
            }
            for (int64_t f = 0; f < F; f++) {
                double sg = 1 / (1 + exp(-hh1[f]));
                dd[f] = 0;
                for (int64_t d = 0; d < D; d++) dd[f] += dyv[r * D + d] * v2[(g * D + d) * F + f];
                q1[f] = dd[f] * hh3[f] * sg * (1 + hh1[f] * (1 - sg));
                q3[f] = dd[f] * hh1[f] * sg;
                for (int64_t d = 0; d < D; d++) {
                    wd2[(g * D + d) * F + f] += dyv[r * D + d] * aa[f];
                    wd1[(g * F + f) * D + d] += q1[f] * xv[r * D + d];
                    wd3[(g * F + f) * D + d] += q3[f] * xv[r * D + d];
                }
            }
            for (int64_t d = 0; d < D; d++) {
                wdx[r * D + d] = 0;
                for (int64_t f = 0; f < F; f++)
                    wdx[r * D + d] += q1[f] * v1[(g * F + f) * D + d] + q3[f] * v3[(g * F + f) * D + d];
            }
        }
    for (int t = 0; t < 2; t++) {
        dsk_ctx c;
        dsk_ctx_opts co;
        memset(&co, 0, sizeof co);
        co.device = DSK_PREFER_CPU;
        co.n_threads = t ? 3 : 1;
        dsk_ctx_init(&c, &co);
        DSK_TEST_OK(dsk_swiglu_grouped(&c, out[t], h1, h3, a, x, w1, w2, w3, off));
        DSK_TEST_OK(dsk_swiglu_grouped_backward(&c, dx[t], dw[t][0], dw[t][1], dw[t][2], da, dh1, dh3, dy, x, h1, h3, a,
                                                w1, w2, w3, off));
        dsk_ctx_free(&c);
    }
    TT_CHECK(out[0], wo, tol, tol, "out (rows outside the segments untouched)");
    TT_CHECK(dx[0], wdx, tol, tol, "dx (rows outside the segments untouched)");
    TT_CHECK(dw[0][0], wd1, tol, tol, "dw1 accumulated");
    TT_CHECK(dw[0][1], wd2, tol, tol, "dw2 accumulated");
    TT_CHECK(dw[0][2], wd3, tol, tol, "dw3 accumulated");
    DSK_TEST_SAME_BYTES(out[0]->data, out[1]->data, dsk_tensor_nbytes(out[0]), "out, 1 vs 3 threads");
    DSK_TEST_SAME_BYTES(dx[0]->data, dx[1]->data, dsk_tensor_nbytes(dx[0]), "dx, 1 vs 3 threads");
    for (int k = 0; k < 3; k++) DSK_TEST_SAME_BYTES(dw[0][k]->data, dw[1][k]->data, dsk_tensor_nbytes(dw[0][k]), "dw, 1 vs 3 threads");
    TT_ERR(dsk_swiglu_grouped(NULL, out[0], h1, h3, a, x, w1, w3, w3, off), DSK_ERR_ARG, "want x (R, D), w1 and w3 (5, F, D), w2 (5, D, F)");
    TT_ERR(dsk_swiglu_grouped(NULL, h1, h1, h3, a, x, w1, w2, w3, off), DSK_ERR_ARG, "dsk_swiglu_grouped: out");
    TT_ERR(dsk_swiglu_grouped_backward(NULL, dx[0], dw[0][1], dw[0][1], dw[0][2], da, dh1, dh3, dy, x, h1, h3, a, w1, w2,
                                       w3, off), DSK_ERR_ARG, "dsk_swiglu_grouped_backward: dw1");
}

/* Scaled rows, plain copies (bit for bit, NaN payloads too) and zero rows for negative indices. */
static void test_gather_rows_scaled(dsk_dtype dt) {
    static const int64_t cfg[3][3] = {{1, 1, 1}, {9, 7, 20}, {129, 70, 300}}; /* R, D, N */
    for (int s = 0; s < 3; s++) {
        int64_t R = cfg[s][0], D = cfg[s][1], N = cfg[s][2];
        dsk_tensor *src = tt_rand(dt, 2, SH(R, D), -1, 1), *idx = tt_ids(1, SH(N), R), *sc = tt_rand(DSK_F32, 1, SH(N), -2, 2);
        dsk_tensor *out = tt_poisoned(dt, 2, SH(N, D)), *out2 = tt_poisoned(dt, 2, SH(N, D));
        int32_t *ix = (int32_t *)idx->data;
        size_t es = dsk_dtype_size(dt);
        int bad = 0;
        ix[N - 1] = -1;
        if (N > 3) ix[2] = -5;
        tt_set(src, (R - 1) * D, NAN);
        ((uint8_t *)src->data)[((R - 1) * D) * es] ^= 1; /* a NaN payload that must survive the plain copy */
        DSK_TEST_OK(dsk_gather_rows_scaled(NULL, out, src, idx, sc));
        DSK_TEST_OK(dsk_gather_rows_scaled(NULL, out2, src, idx, NULL));
        for (int64_t i = 0; i < N; i++)
            for (int64_t j = 0; j < D; j++) {
                float g = (float)tt_get(out, i * D + j), w;
                const char *o2 = (const char *)out2->data + (size_t)(i * D + j) * es;
                if (ix[i] < 0) {
                    bad += g != 0.0f || tt_get(out2, i * D + j) != 0.0;
                    continue;
                }
                w = dsk_round_f32(dt, ((const float *)sc->data)[i] * (float)tt_get(src, ix[i] * D + j));
                bad += memcmp(&g, &w, 4) != 0 && !(g != g && w != w);
                bad += memcmp(o2, (const char *)src->data + (size_t)(ix[i] * D + j) * es, es) != 0;
            }
        DSK_TEST_EXPECT(bad == 0, "R %lld D %lld N %lld: %d elements wrong", (long long)R, (long long)D, (long long)N, bad);
    }
}

/* Plain copies of fp8 codes (e4m3, e5m2): rows bit for bit, zero codes for negative indices; a
   scale with fp8 rows is refused (codes have no arithmetic here). */
static void test_gather_rows_fp8(dsk_dtype dt) {
    dsk_tensor *src = tt_new(dt, 2, SH(9, 33)), *out = tt_new(dt, 2, SH(12, 33)), *idx = tt_ids(1, SH(12), 9);
    dsk_tensor *sc = tt_new(DSK_F32, 1, SH(12));
    uint8_t *s = (uint8_t *)src->data, *o = (uint8_t *)out->data;
    int32_t *ix = (int32_t *)idx->data;
    int bad = 0;
    for (int i = 0; i < 9 * 33; i++) s[i] = (uint8_t)dsk_test_rand_int(256);
    memset(o, 0xa5, 12 * 33); /* poisoned */
    ix[3] = -1;
    DSK_TEST_OK(dsk_gather_rows_scaled(NULL, out, src, idx, NULL));
    for (int i = 0; i < 12; i++)
        for (int j = 0; j < 33; j++) bad += o[i * 33 + j] != (ix[i] < 0 ? 0 : s[ix[i] * 33 + j]);
    DSK_TEST_EXPECT(bad == 0, "%d codes wrong", bad);
    TT_ERR(dsk_gather_rows_scaled(NULL, out, src, idx, sc), DSK_ERR_ARG, "dtype must be f32, bf16 or f16");
}

/* y (bf16 / f16) += alpha x (f32): one rounding of the f32 sum. */
static void test_axpy_mixed(dsk_dtype dt) {
    dsk_tensor *y = tt_rand(dt, 2, SH(37, 11), -2, 2), *x = tt_rand(DSK_F32, 2, SH(37, 11), -2, 2);
    double *y0 = tt_vals(y);
    int bad = 0;
    DSK_TEST_OK(dsk_axpy(NULL, y, 0.5f, x));
    for (int64_t i = 0; i < 37 * 11; i++) {
        float w = dsk_round_f32(dt, (float)y0[i] + 0.5f * ((const float *)x->data)[i]);
        bad += (float)tt_get(y, i) != w;
    }
    DSK_TEST_EXPECT(bad == 0, "%d elements differ from one rounding of the f32 sum", bad);
}

static void test_errors_grouped(void) {
    dsk_tensor *keys = tt_ids(1, SH(6), 3), *perm = tt_new(DSK_I32, 1, SH(6)), *perm5 = tt_new(DSK_I32, 1, SH(5));
    dsk_tensor *off = tt_new(DSK_I32, 1, SH(4)), *off0 = tt_new(DSK_I32, 1, SH(0)), *offf = tt_new(DSK_F32, 1, SH(4));
    dsk_tensor *A = tt_rand(DSK_F32, 2, SH(6, 5), -1, 1), *B = tt_rand(DSK_F32, 3, SH(3, 5, 4), -1, 1);
    dsk_tensor *C = tt_new(DSK_F32, 2, SH(6, 4)), *Cw = tt_new(DSK_F32, 3, SH(3, 5, 4)), *Bb = tt_rand(DSK_BF16, 3, SH(3, 5, 4), -1, 1);
    dsk_tensor *Bw = tt_rand(DSK_F32, 2, SH(6, 4), -1, 1), *src = tt_rand(DSK_F32, 2, SH(5, 4), -1, 1);
    dsk_tensor *out = tt_new(DSK_F32, 2, SH(6, 4)), *outb = tt_new(DSK_BF16, 2, SH(6, 4)), *sc = tt_new(DSK_F32, 1, SH(5));
    int32_t *o = (int32_t *)off->data;
    o[0] = 0; o[1] = 2; o[2] = 5; o[3] = 6;
    TT_ERR(dsk_group_by_key(NULL, perm5, off, keys), DSK_ERR_ARG, "dsk_group_by_key: perm [5] i32 does not match the shape of keys");
    TT_ERR(dsk_group_by_key(NULL, perm, off0, keys), DSK_ERR_ARG, "offsets [0] i32 must be (G + 1) with G >= 0");
    TT_ERR(dsk_group_by_key(NULL, perm, offf, keys), DSK_ERR_ARG, "offsets [4] f32: dtype must be i32");
    DSK_TEST_OK(dsk_matmul_grouped(NULL, C, A, 0, B, 0, off, 1.0f, 0.0f));
    DSK_TEST_OK(dsk_matmul_grouped(NULL, Cw, A, 1, Bw, 0, off, 1.0f, 0.0f));
    TT_ERR(dsk_matmul_grouped(NULL, C, A, 0, B, 1, off, 1.0f, 0.0f), DSK_ERR_ARG, "fit neither form");
    TT_ERR(dsk_matmul_grouped(NULL, Cw, A, 0, Bw, 0, off, 1.0f, 0.0f), DSK_ERR_ARG, "fit neither form");
    TT_ERR(dsk_matmul_grouped(NULL, C, A, 0, Bb, 0, off, 1.0f, 0.0f), DSK_ERR_ARG, "must have the dtype of A");
    o[2] = 1;
    TT_ERR(dsk_matmul_grouped(NULL, C, A, 0, B, 0, off, 1.0f, 0.0f), DSK_ERR_ARG,
           "dsk_matmul_grouped: offsets[1] = 2 > offsets[2] = 1 (must not decrease)");
    o[2] = 5; o[3] = 7;
    TT_ERR(dsk_matmul_grouped(NULL, Cw, A, 1, Bw, 0, off, 1.0f, 0.0f), DSK_ERR_ARG, "offsets run from 0 to 7, outside the 6 rows");
    o[3] = 6; o[0] = -1;
    TT_ERR(dsk_matmul_grouped(NULL, C, A, 0, B, 0, off, 1.0f, 0.0f), DSK_ERR_ARG, "offsets run from -1 to 6");
    ((int32_t *)keys->data)[4] = 5;
    TT_ERR(dsk_gather_rows_scaled(NULL, out, src, keys, NULL), DSK_ERR_ARG, "dsk_gather_rows_scaled: idx[4] = 5 outside [0, 5)");
    TT_ERR(dsk_gather_rows_scaled(NULL, outb, src, keys, NULL), DSK_ERR_ARG, "out [6,4] bf16 must have the dtype of src");
    TT_ERR(dsk_gather_rows_scaled(NULL, out, src, keys, sc), DSK_ERR_ARG, "scale [5] f32 does not match the shape of idx");
    TT_ERR(dsk_axpy(NULL, out, 1.0f, outb), DSK_ERR_ARG, "dsk_axpy: x [6,4] bf16 must have the dtype of y [6,4] f32");
}

/* ------------------------------------------------------------------ cross-entropy */

static double tt_ce_loss(const double *x, void *p) {
    tt_ud *u = (tt_ud *)p;
    double total = 0;
    int64_t count = 0;
    for (int64_t r = 0; r < u->R; r++) {
        double mx = -INFINITY, s = 0;
        if (u->ids[r] == u->ignore) continue;
        count++;
        for (int64_t j = 0; j < u->V; j++) mx = x[r * u->V + j] > mx ? x[r * u->V + j] : mx;
        for (int64_t j = 0; j < u->V; j++) s += exp(x[r * u->V + j] - mx);
        total += mx + log(s) - x[r * u->V + u->ids[r]];
    }
    return count ? total / (double)count : 0.0;
}

static void test_cross_entropy(dsk_dtype dt) {
    static const int64_t cfg[4][2] = {{1, 1}, {7, 129}, {5, 3}, {64, 1000}}; /* R, V */
    for (int s = 0; s < 4; s++) {
        int64_t R = cfg[s][0], V = cfg[s][1];
        dsk_tensor *logits = tt_rand(dt, 2, cfg[s], -5, 5), *tg = tt_ids(1, SH(R), V), *loss = tt_poisoned(DSK_F32, 0, NULL), *dl = tt_poisoned(dt, 2, cfg[s]);
        double *x = tt_vals(logits), want, *g, gs = 3.5;
        tt_ud u;
        if (R > 2) ((int32_t *)tg->data)[1] = -100; /* ignored */
        memset(&u, 0, sizeof u);
        u.R = R; u.V = V; u.ids = (const int32_t *)tg->data; u.ignore = -100;
        want = tt_ce_loss(x, &u);
        DSK_TEST_OK(dsk_cross_entropy(tt_cx, loss, dl, logits, tg, -100, (float)gs));
        TT_CHECK(loss, &want, 1e-5, 1e-6, "cross_entropy loss");
        if (R * V <= 1000) {
            g = tt_numgrad(tt_ce_loss, x, R * V, &u);
            for (int64_t i = 0; i < R * V; i++) g[i] *= gs;
            TT_CHECK(dl, g, dt == DSK_F32 ? 1e-4 : 3 * tt_tol(dt), dt == DSK_F32 ? 1e-6 : 1e-3, "dlogits vs finite differences");
        }
        DSK_TEST_OK(dsk_cross_entropy(tt_cx, loss, NULL, logits, tg, -100, 1.0f));
        TT_CHECK(loss, &want, 1e-5, 1e-6, "cross_entropy loss without dlogits");
    }
    {   /* every token ignored: loss 0, zero gradient */
        dsk_tensor *logits = tt_rand(dt, 2, SH(3, 4), -1, 1), *tg = tt_new(DSK_I32, 1, SH(3)), *loss = tt_poisoned(DSK_F32, 0, NULL), *dl = tt_poisoned(dt, 2, SH(3, 4));
        double z = 0, *zs = tt_zeros(12);
        for (int i = 0; i < 3; i++) ((int32_t *)tg->data)[i] = 7;
        DSK_TEST_OK(dsk_cross_entropy(tt_cx, loss, dl, logits, tg, 7, 1.0f));
        TT_CHECK(loss, &z, 0, 0, "all ignored: loss");
        TT_CHECK(dl, zs, 0, 0, "all ignored: dlogits");
    }
}

/* ------------------------------------------------------------------ top-k */

static void test_topk(void) {
    static const int64_t cfg[5][3] = {{1, 1, 1}, {7, 129, 8}, {5, 7, 7}, {3, 300, 1}, {20, 64, 6}}; /* R, C, k */
    for (int s = 0; s < 5; s++) {
        int64_t R = cfg[s][0], C = cfg[s][1];
        int k = (int)cfg[s][2];
        dsk_tensor *x = tt_new(DSK_F32, 2, SH(R, C)), *vals = tt_poisoned(DSK_F32, 2, SH(R, k)), *idx = tt_new(DSK_I32, 2, SH(R, k));
        double *wv = tt_zeros(R * k);
        int bad = 0;
        for (int64_t i = 0; i < R * C; i++) { /* few distinct values so ties are common, some NaN */
            double v = (double)dsk_test_rand_int(5) - 2.0;
            if (dsk_test_rand_int(10) == 0) v = NAN;
            if (s == 3) v = dsk_test_rand(-1, 1);
            tt_set(x, i, v);
        }
        DSK_TEST_OK(dsk_topk(NULL, vals, idx, x, k));
        for (int64_t r = 0; r < R; r++) {
            /* reference: selection by a full scan for the best remaining (value desc, NaN last, lower index) */
            char *used = (char *)tt_alloc((size_t)C);
            for (int j = 0; j < k; j++) {
                int64_t best = -1;
                for (int64_t c = 0; c < C; c++) {
                    double v = tt_get(x, r * C + c), b;
                    if (used[c]) continue;
                    if (best < 0) { best = c; continue; }
                    b = tt_get(x, r * C + best);
                    if ((v == v && b != b) || (v == v && b == b && v > b)) best = c;
                }
                used[best] = 1;
                wv[r * k + j] = tt_get(x, r * C + best);
                if (((int32_t *)idx->data)[r * k + j] != best && !bad++)
                    DSK_TEST_EXPECT(0, "row %lld rank %d: index %d, want %lld", (long long)r, j, ((int32_t *)idx->data)[r * k + j], (long long)best);
            }
        }
        TT_CHECK(vals, wv, 0, 0, "topk values");
    }
}

/* ------------------------------------------------------------------ rope, attention */

/* x (B, T, H, Dh) rotated by sign * angle in float64. */
static void tt_rope_ref(const double *x, const tt_ud *u, double sign, double *y) {
    for (int64_t b = 0; b < u->B; b++)
        for (int64_t t = 0; t < u->T; t++)
            for (int64_t h = 0; h < u->H; h++)
                for (int64_t i = 0; i < u->D / 2; i++) {
                    int64_t o = ((b * u->T + t) * u->H + h) * u->D + 2 * i;
                    double a = sign * (double)(u->pos0 + t) * pow(u->theta, -2.0 * (double)i / (double)u->D);
                    y[o] = x[o] * cos(a) - x[o + 1] * sin(a);
                    y[o + 1] = x[o] * sin(a) + x[o + 1] * cos(a);
                }
}
static double tt_rope_loss(const double *x, void *p) {
    tt_ud *u = (tt_ud *)p;
    double *y = (double *)malloc((size_t)u->n * sizeof(double)), l;
    tt_rope_ref(x, u, 1.0, y);
    l = tt_dot(y, u->g, u->n);
    free(y);
    return l;
}

static void test_rope(dsk_dtype dt) {
    static const int64_t cfg[3][4] = {{1, 1, 1, 2}, {2, 7, 3, 8}, {1, 9, 2, 32}};
    for (int s = 0; s < 3; s++) {
        dsk_tensor *x = tt_rand(dt, 4, cfg[s], -1, 1), *y = tt_poisoned(dt, 4, cfg[s]), *dy = tt_rand(dt, 4, cfg[s], -1, 1), *dx = tt_rand(dt, 4, cfg[s], -1, 1);
        int64_t n = dsk_tensor_numel(x);
        double *xv = tt_vals(x), *w = tt_zeros(n), *dx0 = tt_vals(dx), *g;
        tt_ud u;
        memset(&u, 0, sizeof u);
        u.B = cfg[s][0]; u.T = cfg[s][1]; u.H = cfg[s][2]; u.D = cfg[s][3]; u.n = n; u.pos0 = 3 + s; u.theta = 10000.0; u.g = tt_vals(dy);
        tt_rope_ref(xv, &u, 1.0, w);
        DSK_TEST_OK(dsk_rope(tt_cx, y, x, u.pos0, 10000.0f));
        TT_CHECK(y, w, tt_tol(dt), dt == DSK_F32 ? 2e-5 : 1e-2, "rope");
        g = tt_numgrad(tt_rope_loss, xv, n, &u);
        DSK_TEST_OK(dsk_rope_backward(tt_cx, dx, dy, u.pos0, 10000.0f, DSK_GRAD_ADD));
        TT_CHECK(dx, tt_plus(dx0, g, n), dt == DSK_F32 ? 1e-4 : 3 * tt_tol(dt), dt == DSK_F32 ? 2e-5 : 2e-2, "rope backward vs finite differences");
        { /* DSK_GRAD_WRITE into NaN against DSK_GRAD_ADD into zeros and the finite differences */
            dsk_tensor *zx = tt_zeroed(dt, 4, cfg[s]), *wx = tt_poisoned(dt, 4, cfg[s]);
            DSK_TEST_OK(dsk_rope_backward(tt_cx, zx, dy, u.pos0, 10000.0f, DSK_GRAD_ADD));
            DSK_TEST_OK(dsk_rope_backward(tt_cx, wx, dy, u.pos0, 10000.0f, DSK_GRAD_WRITE));
            TT_CHECK(wx, tt_vals(zx), 0, 0, "rope backward written = added into zeros");
            TT_CHECK(wx, g, dt == DSK_F32 ? 1e-4 : 3 * tt_tol(dt), dt == DSK_F32 ? 2e-5 : 2e-2,
                     "rope backward written vs finite differences");
        }
        DSK_TEST_OK(dsk_rope(tt_cx, x, x, u.pos0, 10000.0f));
        TT_CHECK(x, w, tt_tol(dt), dt == DSK_F32 ? 2e-5 : 1e-2, "rope in place");
    }
}

/* out = softmax(scale q k^T + causal mask) v, (B, T, H, Dh) layout; probs (B, H, T, T). */
static void tt_attention_ref(const double *q, const double *k, const double *v, const tt_ud *u, double *out, double *probs) {
    int64_t B = u->B, T = u->T, H = u->H, D = u->D;
    double *s = (double *)malloc((size_t)T * sizeof(double));
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < T; i++) {
                double mx = -INFINITY, sum = 0;
                for (int64_t j = 0; j <= i; j++) {
                    s[j] = 0;
                    for (int64_t d = 0; d < D; d++) s[j] += q[((b * T + i) * H + h) * D + d] * k[((b * T + j) * H + h) * D + d];
                    s[j] *= u->scale;
                    mx = s[j] > mx ? s[j] : mx;
                }
                for (int64_t j = 0; j <= i; j++) sum += exp(s[j] - mx);
                for (int64_t d = 0; d < D; d++) out[((b * T + i) * H + h) * D + d] = 0;
                for (int64_t j = 0; j < T; j++) {
                    double p = j <= i ? exp(s[j] - mx) / sum : 0;
                    if (probs) probs[((b * H + h) * T + i) * T + j] = p;
                    for (int64_t d = 0; d < D; d++) out[((b * T + i) * H + h) * D + d] += p * v[((b * T + j) * H + h) * D + d];
                }
            }
    free(s);
}
/* x = [q; k; v] */
static double tt_attention_loss(const double *x, void *p) {
    tt_ud *u = (tt_ud *)p;
    double *o = (double *)malloc((size_t)u->n * sizeof(double)), l;
    tt_attention_ref(x, x + u->n, x + 2 * u->n, u, o, NULL);
    l = tt_dot(o, u->g, u->n);
    free(o);
    return l;
}

static void test_attention(dsk_dtype dt) {
    /* T 24: a multiple of 8, so K and V transpose through the vector path (Dh 12: a tail of 4) */
    static const int64_t cfg[4][4] = {{1, 1, 1, 1}, {2, 7, 3, 5}, {1, 20, 2, 16}, {1, 24, 2, 12}};
    for (int s = 0; s < 4; s++) {
        const int64_t *sh = cfg[s];
        int64_t n = sh[0] * sh[1] * sh[2] * sh[3], np = sh[0] * sh[2] * sh[1] * sh[1];
        dsk_tensor *q = tt_rand(dt, 4, sh, -1, 1), *k = tt_rand(dt, 4, sh, -1, 1), *v = tt_rand(dt, 4, sh, -1, 1), *out = tt_poisoned(dt, 4, sh);
        dsk_tensor *probs = tt_poisoned(DSK_F32, 4, SH(sh[0], sh[2], sh[1], sh[1])), *dout = tt_rand(dt, 4, sh, -1, 1);
        dsk_tensor *dq = tt_rand(dt, 4, sh, -1, 1), *dk = tt_rand(dt, 4, sh, -1, 1), *dv = tt_rand(dt, 4, sh, -1, 1);
        double *x = tt_zeros(3 * n), *wo = tt_zeros(n), *wp = tt_zeros(np), *g, *q0 = tt_vals(dq), *k0 = tt_vals(dk), *v0 = tt_vals(dv);
        double tol = dt == DSK_F32 ? 1e-4 : 3 * tt_tol(dt), atol = dt == DSK_F32 ? 1e-5 : 3e-2;
        tt_ud u;
        memset(&u, 0, sizeof u);
        u.B = sh[0]; u.T = sh[1]; u.H = sh[2]; u.D = sh[3]; u.n = n; u.scale = 1.0 / sqrt((double)sh[3]); u.g = tt_vals(dout);
        memcpy(x, tt_vals(q), (size_t)n * sizeof(double));
        memcpy(x + n, tt_vals(k), (size_t)n * sizeof(double));
        memcpy(x + 2 * n, tt_vals(v), (size_t)n * sizeof(double));
        tt_attention_ref(x, x + n, x + 2 * n, &u, wo, wp);
        DSK_TEST_OK(dsk_attention(tt_cx, out, probs, q, k, v, (float)u.scale));
        TT_CHECK(out, wo, tt_tol(dt), 1e-6, "attention out");
        TT_CHECK(probs, wp, 1e-5, 1e-7, "attention probs (zero above the diagonal)");
        g = tt_numgrad(tt_attention_loss, x, 3 * n, &u);
        DSK_TEST_OK(dsk_attention_backward(tt_cx, dq, dk, dv, dout, q, k, v, probs, (float)u.scale, DSK_GRAD_ADD));
        TT_CHECK(dq, tt_plus(q0, g, n), tol, atol, "attention dq vs finite differences");
        TT_CHECK(dk, tt_plus(k0, g + n, n), tol, atol, "attention dk vs finite differences");
        TT_CHECK(dv, tt_plus(v0, g + 2 * n, n), tol, atol, "attention dv vs finite differences");
        { /* DSK_GRAD_WRITE into NaN against DSK_GRAD_ADD into zeros and the finite differences */
            dsk_tensor *z[3], *w[3];
            const char *what[3] = {"attention dq written", "attention dk written", "attention dv written"};
            for (int i = 0; i < 3; i++) {
                z[i] = tt_zeroed(dt, 4, sh);
                w[i] = tt_poisoned(dt, 4, sh);
            }
            DSK_TEST_OK(
                dsk_attention_backward(tt_cx, z[0], z[1], z[2], dout, q, k, v, probs, (float)u.scale, DSK_GRAD_ADD));
            DSK_TEST_OK(
                dsk_attention_backward(tt_cx, w[0], w[1], w[2], dout, q, k, v, probs, (float)u.scale, DSK_GRAD_WRITE));
            for (int i = 0; i < 3; i++) {
                TT_CHECK(w[i], tt_vals(z[i]), 0, 0, what[i]);
                TT_CHECK(w[i], g + i * n, tol, atol, what[i]);
            }
        }
    }
}

/* Backward of tt_attention_ref in float64 from its probs: dq, dk, dv (not accumulated). */
static void tt_attention_backward_ref(const double *q, const double *k, const double *v, const double *dout, const double *probs,
                                      const tt_ud *u, double *dq, double *dk, double *dv) {
    int64_t B = u->B, T = u->T, H = u->H, D = u->D;
    double *dp = (double *)malloc((size_t)T * sizeof(double));
    memset(dq, 0, (size_t)u->n * sizeof(double));
    memset(dk, 0, (size_t)u->n * sizeof(double));
    memset(dv, 0, (size_t)u->n * sizeof(double));
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < T; i++) {
                const double *pr = probs + ((b * H + h) * T + i) * T;
                int64_t io = ((b * T + i) * H + h) * D;
                double pdp = 0;
                for (int64_t j = 0; j <= i; j++) {
                    int64_t jo = ((b * T + j) * H + h) * D;
                    dp[j] = 0;
                    for (int64_t d = 0; d < D; d++) dp[j] += dout[io + d] * v[jo + d];
                    pdp += pr[j] * dp[j];
                }
                for (int64_t j = 0; j <= i; j++) {
                    int64_t jo = ((b * T + j) * H + h) * D;
                    double ds = u->scale * pr[j] * (dp[j] - pdp);
                    for (int64_t d = 0; d < D; d++) {
                        dq[io + d] += ds * k[jo + d];
                        dk[jo + d] += ds * q[io + d];
                        dv[jo + d] += pr[j] * dout[io + d];
                    }
                }
            }
    free(dp);
}

/* A larger shape against the float64 references, and the same bits with 1 and 2 threads. */
static void test_attention_threads(dsk_dtype dt) {
    const int64_t *sh = SH(2, 67, 3, 16), *ps = SH(2, 3, 67, 67);
    int64_t n = 2 * 67 * 3 * 16, np = 2 * 3 * 67 * 67;
    dsk_ctx c[2];
    dsk_ctx_opts o;
    dsk_tensor *q = tt_rand(dt, 4, sh, -2, 2), *k = tt_rand(dt, 4, sh, -2, 2), *v = tt_rand(dt, 4, sh, -1, 1), *dout = tt_rand(dt, 4, sh, -1, 1);
    dsk_tensor *out[2], *probs[2], *dq[2], *dk[2], *dv[2];
    double *wo = tt_zeros(n), *wp = tt_zeros(np), *gq = tt_zeros(n), *gk = tt_zeros(n), *gv = tt_zeros(n), *q0, *k0, *v0;
    double tol = dt == DSK_F32 ? 1e-4 : 3 * tt_tol(dt), atol = dt == DSK_F32 ? 1e-5 : 3e-2;
    tt_ud u;
    memset(&u, 0, sizeof u);
    u.B = 2; u.T = 67; u.H = 3; u.D = 16; u.n = n; u.scale = 0.25;
    memset(&o, 0, sizeof o);
    o.device = DSK_PREFER_CPU;
    o.cpu_isa = tt_isa;
    for (int t = 0; t < 2; t++) {
        o.n_threads = t + 1;
        DSK_TEST_OK(dsk_ctx_init(&c[t], &o));
        out[t] = tt_poisoned(dt, 4, sh);
        probs[t] = tt_poisoned(DSK_F32, 4, ps);
        dq[t] = tt_rand(dt, 4, sh, -1, 1);
        dk[t] = tt_rand(dt, 4, sh, -1, 1);
        dv[t] = tt_rand(dt, 4, sh, -1, 1);
    }
    DSK_TEST_OK(dsk_tensor_copy(NULL, dq[1], dq[0]));
    DSK_TEST_OK(dsk_tensor_copy(NULL, dk[1], dk[0]));
    DSK_TEST_OK(dsk_tensor_copy(NULL, dv[1], dv[0]));
    q0 = tt_vals(dq[0]); k0 = tt_vals(dk[0]); v0 = tt_vals(dv[0]);
    tt_attention_ref(tt_vals(q), tt_vals(k), tt_vals(v), &u, wo, wp);
    tt_attention_backward_ref(tt_vals(q), tt_vals(k), tt_vals(v), tt_vals(dout), wp, &u, gq, gk, gv);
    for (int t = 0; t < 2; t++) {
        DSK_TEST_OK(dsk_attention(&c[t], out[t], probs[t], q, k, v, 0.25f));
        DSK_TEST_OK(dsk_attention_backward(&c[t], dq[t], dk[t], dv[t], dout, q, k, v, probs[t], 0.25f, DSK_GRAD_ADD));
    }
    TT_CHECK(out[0], wo, tt_tol(dt), dt == DSK_F32 ? 1e-5 : 1e-2, "attention out (2, 67, 3, 16)");
    TT_CHECK(probs[0], wp, 1e-5, 1e-7, "attention probs (2, 3, 67, 67)");
    TT_CHECK(dq[0], tt_plus(q0, gq, n), tol, atol, "attention dq vs float64 backward");
    TT_CHECK(dk[0], tt_plus(k0, gk, n), tol, atol, "attention dk vs float64 backward");
    TT_CHECK(dv[0], tt_plus(v0, gv, n), tol, atol, "attention dv vs float64 backward");
    DSK_TEST_SAME_BYTES(out[0]->data, out[1]->data, dsk_tensor_nbytes(out[0]), "out 1 vs 2 threads");
    DSK_TEST_SAME_BYTES(probs[0]->data, probs[1]->data, dsk_tensor_nbytes(probs[0]), "probs 1 vs 2 threads");
    DSK_TEST_SAME_BYTES(dq[0]->data, dq[1]->data, dsk_tensor_nbytes(dq[0]), "dq 1 vs 2 threads");
    DSK_TEST_SAME_BYTES(dk[0]->data, dk[1]->data, dsk_tensor_nbytes(dk[0]), "dk 1 vs 2 threads");
    DSK_TEST_SAME_BYTES(dv[0]->data, dv[1]->data, dsk_tensor_nbytes(dv[0]), "dv 1 vs 2 threads");
    dsk_ctx_free(&c[0]);
    dsk_ctx_free(&c[1]);
}

/* T beyond the direct GEMM nest's widest product (512): the score products are as wide as T
   and take the packed nest, whose scratch is larger (it once wrote past a scratch sized for the
   direct nest). Forward and backward vs float64. */
static void test_attention_long(void) {
    int64_t T = 700, H = 2, D = 64, n = T * H * D;
    const int64_t *sh = SH(1, 700, 2, 64);
    dsk_tensor *q = tt_rand(DSK_F32, 4, sh, -2, 2), *k = tt_rand(DSK_F32, 4, sh, -2, 2), *v = tt_rand(DSK_F32, 4, sh, -1, 1);
    dsk_tensor *dout = tt_rand(DSK_F32, 4, sh, -1, 1), *out = tt_poisoned(DSK_F32, 4, sh), *probs = tt_poisoned(DSK_F32, 4, SH(1, 2, 700, 700));
    dsk_tensor *dq = tt_new(DSK_F32, 4, sh), *dk = tt_new(DSK_F32, 4, sh), *dv = tt_new(DSK_F32, 4, sh);
    double *wo = tt_zeros(n), *wp = tt_zeros(H * T * T), *gq = tt_zeros(n), *gk = tt_zeros(n), *gv = tt_zeros(n);
    tt_ud u;
    memset(&u, 0, sizeof u);
    u.B = 1; u.T = T; u.H = H; u.D = D; u.n = n; u.scale = 0.125;
    DSK_TEST_OK(dsk_tensor_fill(NULL, dq, 0.0));
    DSK_TEST_OK(dsk_tensor_fill(NULL, dk, 0.0));
    DSK_TEST_OK(dsk_tensor_fill(NULL, dv, 0.0));
    tt_attention_ref(tt_vals(q), tt_vals(k), tt_vals(v), &u, wo, wp);
    tt_attention_backward_ref(tt_vals(q), tt_vals(k), tt_vals(v), tt_vals(dout), wp, &u, gq, gk, gv);
    DSK_TEST_OK(dsk_attention(NULL, out, probs, q, k, v, 0.125f));
    DSK_TEST_OK(dsk_attention_backward(NULL, dq, dk, dv, dout, q, k, v, probs, 0.125f, DSK_GRAD_ADD));
    TT_CHECK(out, wo, 2e-5, 1e-6, "attention out, T 700");
    TT_CHECK(probs, wp, 1e-5, 1e-7, "attention probs, T 700");
    TT_CHECK(dq, gq, 1e-4, 1e-5, "attention dq, T 700");
    TT_CHECK(dk, gk, 1e-4, 1e-5, "attention dk, T 700");
    TT_CHECK(dv, gv, 1e-4, 1e-5, "attention dv, T 700");
    { /* written into NaN: the dK and dV products' K (up to T) spans two slices, the second adding to the first */
        dsk_tensor *w[3];
        for (int i = 0; i < 3; i++) w[i] = tt_poisoned(DSK_F32, 4, sh);
        DSK_TEST_OK(dsk_attention_backward(NULL, w[0], w[1], w[2], dout, q, k, v, probs, 0.125f, DSK_GRAD_WRITE));
        TT_CHECK(w[0], tt_vals(dq), 0, 0, "attention dq written = added into zeros, T 700");
        TT_CHECK(w[1], tt_vals(dk), 0, 0, "attention dk written = added into zeros, T 700");
        TT_CHECK(w[2], tt_vals(dv), 0, 0, "attention dv written = added into zeros, T 700");
    }
}

/* L = sum (A B) * G over x = [A; B]: the gradients a training step gets from two matmuls. */
static double tt_matmul_loss(const double *x, void *p) {
    tt_ud *u = (tt_ud *)p;
    const double *A = x, *B = x + u->R * u->D;
    double l = 0;
    for (int64_t i = 0; i < u->R; i++)
        for (int64_t j = 0; j < u->C; j++) {
            double s = 0;
            for (int64_t k = 0; k < u->D; k++) s += A[i * u->D + k] * B[k * u->C + j];
            l += s * u->g[i * u->C + j];
        }
    return l;
}

/* Backward of C = A B with the library's own transposed products, accumulating (beta = 1):
   dA += dC B^T, dB += A^T dC, against central differences. */
static void test_matmul_backward(void) {
    int64_t M = 7, K = 13, N = 5;
    dsk_tensor *A = tt_rand(DSK_F32, 2, SH(M, K), -1, 1), *B = tt_rand(DSK_F32, 2, SH(K, N), -1, 1), *dC = tt_rand(DSK_F32, 2, SH(M, N), -1, 1);
    dsk_tensor *dA = tt_rand(DSK_F32, 2, SH(M, K), -1, 1), *dB = tt_rand(DSK_F32, 2, SH(K, N), -1, 1);
    double *x = tt_zeros(M * K + K * N), *a0 = tt_vals(dA), *b0 = tt_vals(dB), *g;
    tt_ud u;
    memset(&u, 0, sizeof u);
    u.R = M; u.D = K; u.C = N; u.g = tt_vals(dC);
    memcpy(x, tt_vals(A), (size_t)(M * K) * sizeof(double));
    memcpy(x + M * K, tt_vals(B), (size_t)(K * N) * sizeof(double));
    g = tt_numgrad(tt_matmul_loss, x, M * K + K * N, &u);
    DSK_TEST_OK(dsk_matmul(tt_cx, dA, dC, 0, B, 1, 1.0f, 1.0f));
    DSK_TEST_OK(dsk_matmul(tt_cx, dB, A, 1, dC, 0, 1.0f, 1.0f));
    TT_CHECK(dA, tt_plus(a0, g, M * K), 1e-5, 1e-6, "dA = dC B^T vs finite differences");
    TT_CHECK(dB, tt_plus(b0, g + M * K, K * N), 1e-5, 1e-6, "dB = A^T dC vs finite differences");
}

/* bf16 / f16 inputs over the blocking edges, every transpose combination. */
static void test_matmul_half_shapes(dsk_dtype dt, int ta, int tb) {
    static const int64_t s[4] = {1, 7, 33, 130};
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++)
            for (int k = 0; k < 4; k++) {
                tt_mm c = {s[i], s[j], s[k], 1 + (i + k) % 2, ta, tb, (i + j) % 2, 1, (j + k) % 2, dt, (i + j + k) % 3 ? DSK_F32 : dt, 1.0f, (float)(k % 2)};
                if (!tt_matmul_run(&c, 2)) return;
            }
}

/* Deterministic reductions: the same bits with 1, 2 and 3 threads. */
static void test_reductions_thread_independent(void) {
    dsk_tensor *dout = tt_rand(DSK_F32, 2, SH(4000, 70), -1, 1), *ids = tt_ids(1, SH(4000), 17), *x = tt_rand(DSK_F32, 2, SH(4000, 70), -1, 1);
    dsk_tensor *w = tt_rand(DSK_F32, 1, SH(70), 0.5, 1.5), *rstd = tt_new(DSK_F32, 1, SH(4000)), *y = tt_new(DSK_F32, 2, SH(4000, 70));
    dsk_tensor *dx0 = tt_rand(DSK_F32, 2, SH(4000, 70), -1, 1), *tab[3], *dw[3], *red[3], *dx[3], *dw_dx[3];
    for (int t = 0; t < 3; t++) {
        dsk_ctx ctx;
        dsk_ctx_opts o;
        memset(&o, 0, sizeof o);
        o.device = DSK_PREFER_CPU;
        o.n_threads = t + 1;
        DSK_TEST_OK(dsk_ctx_init(&ctx, &o));
        tab[t] = tt_new(DSK_F32, 2, SH(17, 70));
        dw[t] = tt_new(DSK_F32, 1, SH(70));
        red[t] = tt_new(DSK_F32, 1, SH(70));
        memset(tab[t]->data, 0, dsk_tensor_nbytes(tab[t]));
        memset(dw[t]->data, 0, dsk_tensor_nbytes(dw[t]));
        DSK_TEST_OK(dsk_embedding_backward(&ctx, tab[t], dout, ids));
        DSK_TEST_OK(dsk_rmsnorm(&ctx, y, rstd, x, w, 1e-6f));
        DSK_TEST_OK(dsk_rmsnorm_backward(&ctx, NULL, dw[t], dout, x, w, rstd));
        /* with dx too: one thread sums dw in dx's pass over the rows, more split its columns */
        dx[t] = tt_new(DSK_F32, 2, SH(4000, 70));
        memcpy(dx[t]->data, dx0->data, dsk_tensor_nbytes(dx0));
        dw_dx[t] = tt_new(DSK_F32, 1, SH(70));
        memset(dw_dx[t]->data, 0, dsk_tensor_nbytes(dw_dx[t]));
        DSK_TEST_OK(dsk_rmsnorm_backward(&ctx, dx[t], dw_dx[t], dout, x, w, rstd));
        DSK_TEST_SAME_BYTES(dw[0]->data, dw_dx[t]->data, dsk_tensor_nbytes(dw[0]), "rmsnorm dw beside dx");
        DSK_TEST_OK(dsk_reduce(&ctx, red[t], x, 0, DSK_REDUCE_SUM));
        if (t) {
            DSK_TEST_SAME_BYTES(dx[0]->data, dx[t]->data, dsk_tensor_nbytes(dx[0]), "rmsnorm dx");
            DSK_TEST_SAME_BYTES(tab[0]->data, tab[t]->data, dsk_tensor_nbytes(tab[0]), "embedding backward");
            DSK_TEST_SAME_BYTES(dw[0]->data, dw[t]->data, dsk_tensor_nbytes(dw[0]), "rmsnorm dw");
            DSK_TEST_SAME_BYTES(red[0]->data, red[t]->data, dsk_tensor_nbytes(red[0]), "reduce sum over rows");
        }
    }
}

/* AdamW on 2 threads against 1, many times: its chunks' moment pointers were once shared by the
   threads (a race that updated one chunk's moments twice and another's not at all, seen about once
   in 30 runs of the emulated GPU test). Repeated calls give the race its chances; the bits must
   match every time. */
static void test_adamw_threads(void) {
    int64_t n = 100003;
    dsk_tensor *g = tt_rand(DSK_F32, 1, SH(n), -1, 1), *p[2], *m[2], *v[2], *c[2];
    dsk_adamw_opts o = dsk_adamw_defaults();
    dsk_ctx ctx[2];
    dsk_ctx_opts co;
    int same = 1;
    memset(&co, 0, sizeof co);
    co.device = DSK_PREFER_CPU;
    p[0] = tt_rand(DSK_F32, 1, SH(n), -1, 1);
    m[0] = tt_rand(DSK_BF16, 1, SH(n), -0.1, 0.1);
    v[0] = tt_rand(DSK_BF16, 1, SH(n), 0, 0.01);
    for (int t = 0; t < 2; t++) {
        co.n_threads = t + 1;
        DSK_TEST_OK(dsk_ctx_init(&ctx[t], &co));
        if (t) {
            p[1] = tt_new(DSK_F32, 1, SH(n));
            m[1] = tt_new(DSK_BF16, 1, SH(n));
            v[1] = tt_new(DSK_BF16, 1, SH(n));
            DSK_TEST_OK(dsk_tensor_copy(NULL, p[1], p[0]));
            DSK_TEST_OK(dsk_tensor_copy(NULL, m[1], m[0]));
            DSK_TEST_OK(dsk_tensor_copy(NULL, v[1], v[0]));
        }
        c[t] = tt_poisoned(DSK_F16, 1, SH(n));
    }
    for (int64_t step = 1; step <= 300 && same; step++)
        for (int t = 0; t < 2; t++) {
            DSK_TEST_OK(dsk_adamw_step(&ctx[t], p[t], g, m[t], v[t], &o, step, 0.5f, c[t]));
            if (t)
                same = !memcmp(p[0]->data, p[1]->data, dsk_tensor_nbytes(p[0])) &&
                       !memcmp(m[0]->data, m[1]->data, dsk_tensor_nbytes(m[0])) &&
                       !memcmp(v[0]->data, v[1]->data, dsk_tensor_nbytes(v[0])) &&
                       !memcmp(c[0]->data, c[1]->data, dsk_tensor_nbytes(c[0]));
        }
    DSK_TEST_EXPECT(same, "param, m, v and the f16 copy after up to 300 steps on 1 and on 2 threads differ");
    dsk_ctx_free(&ctx[0]);
    dsk_ctx_free(&ctx[1]);
}

/* Signed zeros tie (lower index first), infinities rank at the ends, NaN below -Inf. */
static void test_topk_special(void) {
    static const float row[8] = {0.0f, -INFINITY, NAN, -0.0f, INFINITY, 0.0f, NAN, -1.0f};
    static const int32_t want_idx[8] = {4, 0, 3, 5, 7, 1, 2, 6};
    dsk_tensor *x = tt_new(DSK_F32, 2, SH(1, 8)), *v = tt_poisoned(DSK_F32, 2, SH(1, 8)), *i = tt_new(DSK_I32, 2, SH(1, 8));
    memcpy(x->data, row, sizeof row);
    DSK_TEST_OK(dsk_topk(NULL, v, i, x, 8));
    DSK_TEST_SAME_BYTES(i->data, want_idx, sizeof want_idx, "order of indices");
    DSK_TEST_EXPECT(isinf(tt_get(v, 0)) && tt_get(v, 4) == -1.0 && isnan(tt_get(v, 7)), "values follow the indices");
}

/* Out of host memory: every allocating op returns DSK_ERR_OOM with a message (nothing
   crashes); dsk_sgemm_cpu, which cannot report, falls back to an unpacked loop. */
static void test_out_of_memory(void) {
    dsk_tensor t, *A = tt_rand(DSK_F32, 2, SH(40, 30), -1, 1), *B = tt_rand(DSK_F32, 2, SH(30, 50), -1, 1), *C = tt_new(DSK_F32, 2, SH(40, 50));
    dsk_tensor *Ab = tt_rand(DSK_BF16, 2, SH(40, 30), -1, 1), *Bb = tt_rand(DSK_BF16, 2, SH(30, 50), -1, 1), *Cb = tt_new(DSK_BF16, 2, SH(40, 50));
    dsk_tensor *lg = tt_rand(DSK_F32, 2, SH(5, 9), -1, 1), *tg = tt_ids(1, SH(5), 9), *loss = tt_new(DSK_F32, 0, NULL);
    dsk_tensor *q = tt_rand(DSK_F32, 4, SH(1, 4, 2, 8), -1, 1), *pr = tt_new(DSK_F32, 4, SH(1, 2, 4, 4)), *o = tt_new(DSK_F32, 4, SH(1, 4, 2, 8));
    float *a = (float *)A->data, *b = (float *)B->data, *c = (float *)tt_alloc(40 * 50 * 4);
    double *want = tt_zeros(40 * 50);
    for (int i = 0; i < 40; i++)
        for (int j = 0; j < 50; j++) {
            for (int p = 0; p < 30; p++) want[i * 50 + j] += (double)a[i * 30 + p] * b[p * 50 + j];
            c[i * 50 + j] = NAN;
        }
    tt_oom = 1;
    TT_ERR(dsk_tensor_alloc(NULL, &t, DSK_F32, 2, SH(3, 4)), DSK_ERR_OOM, "dsk_tensor_alloc: out of host memory for 48 bytes");
    TT_ERR(dsk_matmul(NULL, C, A, 0, B, 0, 1, 0), DSK_ERR_OOM, "dsk_matmul: out of host memory for the GEMM packing buffers");
    TT_ERR(dsk_matmul(NULL, Cb, Ab, 0, Bb, 0, 1, 0), DSK_ERR_OOM, "dsk_matmul: out of host memory for an f32 copy of C");
    TT_ERR(dsk_cross_entropy(NULL, loss, NULL, lg, tg, -100, 1.0f), DSK_ERR_OOM, "dsk_cross_entropy: out of host memory");
    TT_ERR(dsk_attention(NULL, o, pr, q, q, q, 0.3f), DSK_ERR_OOM, "dsk_attention: out of host memory");
    TT_ERR(dsk_attention_backward(NULL, o, o, o, o, q, q, q, pr, 0.3f, DSK_GRAD_ADD), DSK_ERR_OOM,
           "dsk_attention_backward: out of host memory");
    dsk_sgemm_cpu(0, 0, 40, 50, 30, 1.0f, a, 30, b, 50, 0.0f, c, 50, 2);
    tt_oom = 0;
    DSK_TEST_CLOSE(c, want, 40 * 50, 1e-5, 1e-5, "dsk_sgemm_cpu without packing buffers");
}

/* ------------------------------------------------------------------ fused attention */

typedef struct tt_fa {
    int64_t B, T, H, Dk, Dv;
    double scale;
} tt_fa;

/* Float64 causal attention on the full T x T matrix with Dk != Dv allowed, (B, T, H, D) arrays:
   out, lse (B, H, T); with dout also dq, dk, dv (written) by the textbook formulas
   dP = dout V^T, dS = P (dP - rowsum(P dP)), dQ = scale dS K, dK = scale dS^T Q, dV = P^T dout. */
static void tt_fa_ref(const tt_fa *a, const double *q, const double *k, const double *v, const double *dout, double *out, double *lse,
                      double *dq, double *dk, double *dv) {
    int64_t B = a->B, T = a->T, H = a->H, Dk = a->Dk, Dv = a->Dv;
    double *p = (double *)malloc((size_t)(T + 1) * sizeof(double)), *dp = (double *)malloc((size_t)(T + 1) * sizeof(double));
    if (dout) {
        memset(dq, 0, (size_t)(B * T * H * Dk) * sizeof(double));
        memset(dk, 0, (size_t)(B * T * H * Dk) * sizeof(double));
        memset(dv, 0, (size_t)(B * T * H * Dv) * sizeof(double));
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < T; i++) {
                const double *qi = q + ((b * T + i) * H + h) * Dk;
                double mx = -INFINITY, sum = 0, pdp = 0;
                for (int64_t j = 0; j <= i; j++) {
                    const double *kj = k + ((b * T + j) * H + h) * Dk;
                    p[j] = 0;
                    for (int64_t d = 0; d < Dk; d++) p[j] += qi[d] * kj[d];
                    p[j] *= a->scale;
                    mx = p[j] > mx ? p[j] : mx;
                }
                for (int64_t j = 0; j <= i; j++) sum += exp(p[j] - mx);
                lse[(b * H + h) * T + i] = mx + log(sum);
                for (int64_t j = 0; j <= i; j++) p[j] = exp(p[j] - mx) / sum;
                for (int64_t d = 0; d < Dv; d++) {
                    double o = 0;
                    for (int64_t j = 0; j <= i; j++) o += p[j] * v[((b * T + j) * H + h) * Dv + d];
                    out[((b * T + i) * H + h) * Dv + d] = o;
                }
                if (!dout) continue;
                for (int64_t j = 0; j <= i; j++) {
                    dp[j] = 0;
                    for (int64_t d = 0; d < Dv; d++) dp[j] += dout[((b * T + i) * H + h) * Dv + d] * v[((b * T + j) * H + h) * Dv + d];
                    pdp += p[j] * dp[j];
                }
                for (int64_t j = 0; j <= i; j++) {
                    double ds = a->scale * p[j] * (dp[j] - pdp);
                    for (int64_t d = 0; d < Dk; d++) {
                        dq[((b * T + i) * H + h) * Dk + d] += ds * k[((b * T + j) * H + h) * Dk + d];
                        dk[((b * T + j) * H + h) * Dk + d] += ds * qi[d];
                    }
                    for (int64_t d = 0; d < Dv; d++) dv[((b * T + j) * H + h) * Dv + d] += p[j] * dout[((b * T + i) * H + h) * Dv + d];
                }
            }
    free(p);
    free(dp);
}

/* Gradient bounds: f32 accumulation against float64; bf16/f16 also round the sum once. */
static double tt_fa_gtol(dsk_dtype dt) { return dt == DSK_F32 ? 1e-4 : 3 * tt_tol(dt); }
static double tt_fa_gatol(dsk_dtype dt) { return dt == DSK_F32 ? 1e-5 : 3e-2; }

/* The (B, T, H, D) slice [off, off + D) of the last dim of p. */
static dsk_tensor tt_fa_slice(const dsk_tensor *p, int64_t off, int64_t D) {
    dsk_tensor s;
    if (dsk_tensor_slice(p, 3, off, D, &s) != DSK_OK) { fprintf(stderr, "test_tensor: %s\n", dsk_last_error()); exit(2); }
    return s;
}

/* Fused forward and backward against tt_fa_ref: out and lse NaN-poisoned before the call; dq,
   dk, dv start from random values and must hold them plus the gradient. packed: q, k, v (and
   dq, dk, dv) are slices of one (B, T, H, 2 Dk + Dv) tensor, as a fused QKV projection gives. */
static void test_attention_fused(dsk_dtype dt, int64_t B, int64_t T, int64_t H, int64_t Dk, int64_t Dv, int packed) {
    const int64_t *sk = SH(B, T, H, Dk), *sv = SH(B, T, H, Dv), *sp = SH(B, T, H, 2 * Dk + Dv);
    int64_t nk = B * T * H * Dk, nv = B * T * H * Dv;
    dsk_tensor qs, ks, vs, dqs, dks, dvs, *q, *k, *v, *dq, *dk, *dv;
    dsk_tensor *out = tt_poisoned(dt, 4, sv), *lse = tt_poisoned(DSK_F32, 3, SH(B, H, T)), *dout = tt_rand(dt, 4, sv, -1, 1);
    tt_fa a = {B, T, H, Dk, Dv, 1.0 / sqrt((double)Dk)};
    double *wo = tt_zeros(nv), *wl = tt_zeros(B * H * T), *gq = tt_zeros(nk), *gk = tt_zeros(nk), *gv = tt_zeros(nv);
    double *q0, *k0, *v0, *qv, *kv, *vv;
    if (packed) {
        dsk_tensor *p = tt_rand(dt, 4, sp, -2, 2), *g = tt_rand(dt, 4, sp, -1, 1);
        qs = tt_fa_slice(p, 0, Dk); ks = tt_fa_slice(p, Dk, Dk); vs = tt_fa_slice(p, 2 * Dk, Dv);
        dqs = tt_fa_slice(g, 0, Dk); dks = tt_fa_slice(g, Dk, Dk); dvs = tt_fa_slice(g, 2 * Dk, Dv);
        q = &qs; k = &ks; v = &vs; dq = &dqs; dk = &dks; dv = &dvs;
    } else {
        q = tt_rand(dt, 4, sk, -2, 2); k = tt_rand(dt, 4, sk, -2, 2); v = tt_rand(dt, 4, sv, -1, 1);
        dq = tt_rand(dt, 4, sk, -1, 1); dk = tt_rand(dt, 4, sk, -1, 1); dv = tt_rand(dt, 4, sv, -1, 1);
    }
    qv = tt_vals(q); kv = tt_vals(k); vv = tt_vals(v);
    q0 = tt_vals(dq); k0 = tt_vals(dk); v0 = tt_vals(dv);
    tt_fa_ref(&a, qv, kv, vv, tt_vals(dout), wo, wl, gq, gk, gv);
    DSK_TEST_OK(dsk_attention_fused(tt_cx, out, lse, q, k, v, (float)a.scale));
    TT_CHECK(out, wo, tt_tol(dt), dt == DSK_F32 ? 1e-6 : 1e-2, "fused attention out vs float64");
    TT_CHECK(lse, wl, 2e-5, 2e-5, "fused attention lse vs float64");
    DSK_TEST_OK(dsk_attention_fused_backward(tt_cx, dq, dk, dv, dout, q, k, v, out, lse, (float)a.scale, DSK_GRAD_ADD));
    TT_CHECK(dq, tt_plus(q0, gq, nk), tt_fa_gtol(dt), tt_fa_gatol(dt), "fused attention dq vs float64");
    TT_CHECK(dk, tt_plus(k0, gk, nk), tt_fa_gtol(dt), tt_fa_gatol(dt), "fused attention dk vs float64");
    TT_CHECK(dv, tt_plus(v0, gv, nv), tt_fa_gtol(dt), tt_fa_gatol(dt), "fused attention dv vs float64");
    { /* DSK_GRAD_WRITE into NaN (slices of one poisoned tensor when packed) against float64 */
        dsk_tensor wqs, wks, wvs, *wq, *wk, *wv;
        if (packed) {
            dsk_tensor *w = tt_poisoned(dt, 4, sp);
            wqs = tt_fa_slice(w, 0, Dk);
            wks = tt_fa_slice(w, Dk, Dk);
            wvs = tt_fa_slice(w, 2 * Dk, Dv);
            wq = &wqs;
            wk = &wks;
            wv = &wvs;
        } else {
            wq = tt_poisoned(dt, 4, sk);
            wk = tt_poisoned(dt, 4, sk);
            wv = tt_poisoned(dt, 4, sv);
        }
        DSK_TEST_OK(
            dsk_attention_fused_backward(tt_cx, wq, wk, wv, dout, q, k, v, out, lse, (float)a.scale, DSK_GRAD_WRITE));
        TT_CHECK(wq, gq, tt_fa_gtol(dt), tt_fa_gatol(dt), "fused attention dq written vs float64");
        TT_CHECK(wk, gk, tt_fa_gtol(dt), tt_fa_gatol(dt), "fused attention dk written vs float64");
        TT_CHECK(wv, gv, tt_fa_gtol(dt), tt_fa_gatol(dt), "fused attention dv written vs float64");
    }
    if (packed) { /* the inputs are untouched */
        TT_CHECK(q, qv, 0, 0, "q after the calls");
        TT_CHECK(v, vv, 0, 0, "v after the calls");
    }
}

/* The fused op against the materialised dsk_attention on the same inputs (Dk = Dv). */
static void test_attention_fused_vs_materialised(dsk_dtype dt) {
    const int64_t *sh = SH(2, 67, 3, 16);
    int64_t n = 2 * 67 * 3 * 16;
    dsk_tensor *q = tt_rand(dt, 4, sh, -2, 2), *k = tt_rand(dt, 4, sh, -2, 2), *v = tt_rand(dt, 4, sh, -1, 1), *dout = tt_rand(dt, 4, sh, -1, 1);
    dsk_tensor *o1 = tt_poisoned(dt, 4, sh), *o2 = tt_poisoned(dt, 4, sh), *pr = tt_poisoned(DSK_F32, 4, SH(2, 3, 67, 67));
    dsk_tensor *lse = tt_poisoned(DSK_F32, 3, SH(2, 3, 67)), *g[6];
    for (int i = 0; i < 6; i++) { g[i] = tt_new(dt, 4, sh); DSK_TEST_OK(dsk_tensor_fill(NULL, g[i], 0.0)); }
    DSK_TEST_OK(dsk_attention(NULL, o1, pr, q, k, v, 0.25f));
    DSK_TEST_OK(dsk_attention_fused(NULL, o2, lse, q, k, v, 0.25f));
    DSK_TEST_OK(dsk_attention_backward(NULL, g[0], g[1], g[2], dout, q, k, v, pr, 0.25f, DSK_GRAD_ADD));
    DSK_TEST_OK(dsk_attention_fused_backward(NULL, g[3], g[4], g[5], dout, q, k, v, o2, lse, 0.25f, DSK_GRAD_ADD));
    (void)n;
    TT_CHECK(o2, tt_vals(o1), dt == DSK_F32 ? 1e-5 : 2 * tt_tol(dt), dt == DSK_F32 ? 1e-6 : 1e-2, "fused out vs dsk_attention");
    TT_CHECK(g[3], tt_vals(g[0]), tt_fa_gtol(dt), tt_fa_gatol(dt), "fused dq vs dsk_attention_backward");
    TT_CHECK(g[4], tt_vals(g[1]), tt_fa_gtol(dt), tt_fa_gatol(dt), "fused dk vs dsk_attention_backward");
    TT_CHECK(g[5], tt_vals(g[2]), tt_fa_gtol(dt), tt_fa_gatol(dt), "fused dv vs dsk_attention_backward");
}

/* Bits of out, lse, dq, dk, dv with 1, 2 and 3 threads. With B * H = 2 the first two run backward
   one head per thread and 3 threads take the two-pass order; with B * H = 1 only 1 thread takes
   the one-pass order: both orders must give the same bits. Also checked against float64. */
static void test_attention_fused_threads(dsk_dtype dt, int64_t H) {
    int64_t B = 1, T = 200, Dk = 32, Dv = 48, nk = B * T * H * Dk, nv = B * T * H * Dv;
    const int64_t *sk = SH(B, T, H, Dk), *sv = SH(B, T, H, Dv);
    tt_fa a = {B, T, H, Dk, Dv, 0.2};
    dsk_tensor *q = tt_rand(dt, 4, sk, -2, 2), *k = tt_rand(dt, 4, sk, -2, 2), *v = tt_rand(dt, 4, sv, -1, 1), *dout = tt_rand(dt, 4, sv, -1, 1);
    dsk_tensor *out[3], *lse[3], *dq[3], *dk[3], *dv[3];
    double *wo = tt_zeros(nv), *wl = tt_zeros(B * H * T), *gq = tt_zeros(nk), *gk = tt_zeros(nk), *gv = tt_zeros(nv);
    dsk_ctx c[3];
    dsk_ctx_opts o;
    memset(&o, 0, sizeof o);
    o.device = DSK_PREFER_CPU;
    o.cpu_isa = tt_isa;
    tt_fa_ref(&a, tt_vals(q), tt_vals(k), tt_vals(v), tt_vals(dout), wo, wl, gq, gk, gv);
    for (int t = 0; t < 3; t++) {
        o.n_threads = t + 1;
        DSK_TEST_OK(dsk_ctx_init(&c[t], &o));
        out[t] = tt_poisoned(dt, 4, sv);
        lse[t] = tt_poisoned(DSK_F32, 3, SH(B, H, T));
        dq[t] = tt_new(dt, 4, sk); dk[t] = tt_new(dt, 4, sk); dv[t] = tt_new(dt, 4, sv);
        DSK_TEST_OK(dsk_tensor_fill(NULL, dq[t], 0.0));
        DSK_TEST_OK(dsk_tensor_fill(NULL, dk[t], 0.0));
        DSK_TEST_OK(dsk_tensor_fill(NULL, dv[t], 0.0));
        DSK_TEST_OK(dsk_attention_fused(&c[t], out[t], lse[t], q, k, v, (float)a.scale));
        DSK_TEST_OK(dsk_attention_fused_backward(&c[t], dq[t], dk[t], dv[t], dout, q, k, v, out[t], lse[t],
                                                 (float)a.scale, DSK_GRAD_ADD));
    }
    TT_CHECK(out[0], wo, tt_tol(dt), dt == DSK_F32 ? 1e-6 : 1e-2, "out vs float64");
    TT_CHECK(lse[0], wl, 2e-5, 2e-5, "lse vs float64");
    TT_CHECK(dq[0], gq, tt_fa_gtol(dt), tt_fa_gatol(dt), "dq vs float64");
    TT_CHECK(dk[0], gk, tt_fa_gtol(dt), tt_fa_gatol(dt), "dk vs float64");
    TT_CHECK(dv[0], gv, tt_fa_gtol(dt), tt_fa_gatol(dt), "dv vs float64");
    for (int t = 1; t < 3; t++) {
        DSK_TEST_SAME_BYTES(out[0]->data, out[t]->data, dsk_tensor_nbytes(out[0]), "out: 1 thread vs more");
        DSK_TEST_SAME_BYTES(lse[0]->data, lse[t]->data, dsk_tensor_nbytes(lse[0]), "lse: 1 thread vs more");
        DSK_TEST_SAME_BYTES(dq[0]->data, dq[t]->data, dsk_tensor_nbytes(dq[0]), "dq: 1 thread vs more");
        DSK_TEST_SAME_BYTES(dk[0]->data, dk[t]->data, dsk_tensor_nbytes(dk[0]), "dk: 1 thread vs more");
        DSK_TEST_SAME_BYTES(dv[0]->data, dv[t]->data, dsk_tensor_nbytes(dv[0]), "dv: 1 thread vs more");
    }
    for (int t = 0; t < 3; t++) dsk_ctx_free(&c[t]);
}

/* Every argument check, the empty shapes, and running out of host memory. */
static void test_errors_attention_fused(void) {
    const char *fn = "dsk_attention_fused", *bn = "dsk_attention_fused_backward";
    dsk_tensor *q = tt_rand(DSK_F32, 4, SH(1, 3, 2, 4), -1, 1), *v = tt_rand(DSK_F32, 4, SH(1, 3, 2, 6), -1, 1);
    dsk_tensor *o = tt_new(DSK_F32, 4, SH(1, 3, 2, 6)), *l = tt_new(DSK_F32, 3, SH(1, 2, 3)), *dq = tt_new(DSK_F32, 4, SH(1, 3, 2, 4));
    dsk_tensor *q3 = tt_rand(DSK_F32, 3, SH(3, 2, 4), -1, 1), *qi = tt_new(DSK_I32, 4, SH(1, 3, 2, 4)), *kb = tt_rand(DSK_BF16, 4, SH(1, 3, 2, 4), -1, 1);
    dsk_tensor *k5 = tt_rand(DSK_F32, 4, SH(1, 3, 2, 5), -1, 1), *v2 = tt_rand(DSK_F32, 4, SH(1, 2, 2, 6), -1, 1);
    dsk_tensor *o5 = tt_new(DSK_F32, 4, SH(1, 3, 2, 5)), *l2 = tt_new(DSK_F32, 3, SH(1, 3, 2)), *lb = tt_new(DSK_BF16, 3, SH(1, 2, 3));
    dsk_tensor *wide = tt_new(DSK_F32, 4, SH(1, 3, 6, 2)), *e = tt_new(DSK_F32, 4, SH(1, 0, 2, 4)), *ev = tt_new(DSK_F32, 4, SH(1, 0, 2, 6));
    dsk_tensor *el = tt_new(DSK_F32, 3, SH(1, 2, 0)), ot, dev;
    char want[160];
    static float buf[48];
    DSK_TEST_OK(dsk_tensor_transpose(wide, 2, 3, &ot)); /* (1, 3, 2, 6) with last stride 2 */
    TT_ERR(dsk_attention_fused(NULL, o, l, NULL, q, v, 1.0f), DSK_ERR_ARG, "dsk_attention_fused: q is NULL");
    TT_ERR(dsk_attention_fused(NULL, o, l, q3, q3, v, 1.0f), DSK_ERR_ARG, "dsk_attention_fused: q [3,2,4] f32 must have 4 dims");
    TT_ERR(dsk_attention_fused(NULL, o, l, qi, qi, v, 1.0f), DSK_ERR_ARG, "q [1,3,2,4] i32: dtype must be f32, bf16 or f16");
    TT_ERR(dsk_attention_fused(NULL, o, l, q, kb, v, 1.0f), DSK_ERR_ARG, "k [1,3,2,4] bf16 must have the dtype of q [1,3,2,4] f32");
    TT_ERR(dsk_attention_fused(NULL, o, l, q, k5, v, 1.0f), DSK_ERR_ARG, "k [1,3,2,5] f32 does not match the shape of q [1,3,2,4] f32");
    TT_ERR(dsk_attention_fused(NULL, o, l, q, q, v2, 1.0f), DSK_ERR_ARG, "v [1,2,2,6] f32 must be (B, T, H, Dv) with B, T, H of q");
    TT_ERR(dsk_attention_fused(NULL, o5, l, q, q, v, 1.0f), DSK_ERR_ARG, "out [1,3,2,5] f32 must be (B, T, H, Dv) with B, T, H of q "
           "[1,3,2,4] f32 and the last dim of v");
    TT_ERR(dsk_attention_fused(NULL, &ot, l, q, q, v, 1.0f), DSK_ERR_ARG, "out [1,3,2,6] f32 needs unit stride in its last dim (has 2)");
    TT_ERR(dsk_attention_fused(NULL, o, l2, q, q, v, 1.0f), DSK_ERR_ARG, "lse [1,3,2] f32 must be (1, 2, 3) (B, H, T)");
    TT_ERR(dsk_attention_fused(NULL, o, lb, q, q, v, 1.0f), DSK_ERR_ARG, "lse [1,2,3] bf16: dtype must be f32");
    TT_ERR(dsk_attention_fused(NULL, o, l, q, q, v, INFINITY), DSK_ERR_ARG, "dsk_attention_fused: scale inf is not finite");
    DSK_TEST_OK(dsk_attention_fused(NULL, o, NULL, q, q, v, 1.0f)); /* lse is optional in forward */
    DSK_TEST_OK(dsk_attention_fused(NULL, o, l, q, q, v, 1.0f));
    TT_ERR(dsk_attention_fused_backward(NULL, dq, dq, v, o, q, q, v, o, NULL, 1.0f, DSK_GRAD_ADD), DSK_ERR_ARG,
           "dsk_attention_fused_backward: lse is NULL");
    TT_ERR(dsk_attention_fused_backward(NULL, NULL, dq, v, o, q, q, v, o, l, 1.0f, DSK_GRAD_ADD), DSK_ERR_ARG,
           "dsk_attention_fused_backward: dq is NULL");
    TT_ERR(dsk_attention_fused_backward(NULL, dq, k5, v, o, q, q, v, o, l, 1.0f, DSK_GRAD_ADD), DSK_ERR_ARG,
           "dk [1,3,2,5] f32 does not match the shape of k");
    TT_ERR(dsk_attention_fused_backward(NULL, dq, dq, o5, o, q, q, v, o, l, 1.0f, DSK_GRAD_ADD), DSK_ERR_ARG,
           "dv [1,3,2,5] f32 does not match the shape of v");
    TT_ERR(dsk_attention_fused_backward(NULL, dq, dq, v, o5, q, q, v, o, l, 1.0f, DSK_GRAD_ADD), DSK_ERR_ARG,
           "dout [1,3,2,5] f32 must be (B, T, H, Dv)");
    TT_ERR(dsk_attention_fused_backward(NULL, dq, dq, v, o, q, q, v, k5, l, 1.0f, DSK_GRAD_ADD), DSK_ERR_ARG,
           "out [1,3,2,5] f32 does not match the shape of dout");
    TT_ERR(dsk_attention_fused_backward(NULL, kb, dq, v, o, q, q, v, o, l, 1.0f, DSK_GRAD_ADD), DSK_ERR_ARG,
           "dq [1,3,2,4] bf16 must have the dtype of q");
    TT_ERR(dsk_attention_fused_backward(NULL, dq, dq, v, o, q, q, v, o, l, NAN, DSK_GRAD_ADD), DSK_ERR_ARG,
           "scale nan is not finite");
    /* empty sequences: nothing to do */
    DSK_TEST_OK(dsk_attention_fused(NULL, ev, el, e, e, ev, 1.0f));
    DSK_TEST_OK(dsk_attention_fused_backward(NULL, e, e, ev, ev, e, e, ev, ev, el, 1.0f, DSK_GRAD_ADD));
    /* a CUDA tensor */
    DSK_TEST_OK(dsk_tensor_wrap(&dev, buf, DSK_F32, (dsk_device){DSK_DEV_CUDA, 0}, 4, SH(1, 3, 2, 4)));
#ifdef DSK_CUDA
    snprintf(want, sizeof want, "%s: k is on cuda:0 but q is on cpu:0", fn);
    TT_ERR(dsk_attention_fused(NULL, o, l, q, &dev, v, 1.0f), DSK_ERR_ARG, want);
#else
    snprintf(want, sizeof want, "%s: k is a CUDA tensor in a build without DSK_CUDA", fn);
    TT_ERR(dsk_attention_fused(NULL, o, l, q, &dev, v, 1.0f), DSK_ERR_UNSUPPORTED, want);
#endif
    /* out of host memory: nothing is written, the error says what */
    tt_oom = 1;
    snprintf(want, sizeof want, "%s: out of host memory", fn);
    TT_ERR(dsk_attention_fused(NULL, o, l, q, q, v, 1.0f), DSK_ERR_OOM, want);
    snprintf(want, sizeof want, "%s: out of host memory", bn);
    TT_ERR(dsk_attention_fused_backward(NULL, dq, dq, v, o, q, q, v, o, l, 1.0f, DSK_GRAD_ADD), DSK_ERR_OOM, want);
    tt_oom = 0;
}

/* ------------------------------------------------------------------ AdamW */

/* opts: 0 explicit options, 1 NULL (PyTorch's AdamW defaults), 2 zeros honoured: beta1 = beta2 = 0
   and an lr that decays linearly to exactly 0 on the last step (which leaves the weights as they
   are and still updates the moments, as torch does). */
static void test_adamw(dsk_dtype grad_dt, int with_copy, int opts) {
    int64_t n = 1031;
    dsk_adamw_opts o;
    double lr = 2e-3, b1 = 0.8, b2 = 0.99, eps = 1e-6, wd = 0.1, mult = 0.5, lr0;
    dsk_tensor *p = tt_rand(DSK_F32, 2, SH(1, n), -1, 1), *m = tt_new(DSK_F32, 2, SH(1, n)), *v = tt_new(DSK_F32, 2, SH(1, n));
    dsk_tensor *copy = with_copy ? tt_poisoned(with_copy == 1 ? DSK_BF16 : DSK_F16, 2, SH(1, n)) : NULL;
    double *pw = tt_vals(p), *mw = tt_zeros(n), *vw = tt_zeros(n);
    memset(m->data, 0, dsk_tensor_nbytes(m));
    memset(v->data, 0, dsk_tensor_nbytes(v));
    float *before_last = (float *)malloc(sizeof(float) * n);
    if (opts == 1) { lr = 1e-3; b1 = 0.9; b2 = 0.999; eps = 1e-8; wd = 0.01; mult = 1; }
    if (opts == 2) { b1 = 0; b2 = 0; }
    o = dsk_adamw_defaults();
    o.beta1 = (float)b1; o.beta2 = (float)b2; o.eps = (float)eps; o.weight_decay = (float)wd;
    /* the API takes f32 hyperparameters: the reference uses the same values */
    lr0 = (float)lr; b1 = (float)b1; b2 = (float)b2; eps = (float)eps; wd = (float)wd;
    for (int step = 1; step <= 6; step++) {
        dsk_tensor *g = tt_rand(grad_dt, 2, SH(1, n), -1, 1);
        double *gv = tt_vals(g), bc1 = 1 - pow(b1, step), bc2 = 1 - pow(b2, step);
        o.lr = opts == 2 ? (float)(lr0 * (6 - step) / 5.0) : (float)lr0;
        lr = o.lr;
        for (int64_t i = 0; i < n; i++) { /* torch.optim.AdamW, single-tensor path */
            double gi = gv[i] * (double)(float)mult;
            pw[i] *= 1 - lr * wd;
            mw[i] = b1 * mw[i] + (1 - b1) * gi;
            vw[i] = b2 * vw[i] + (1 - b2) * gi * gi;
            pw[i] -= lr / bc1 * mw[i] / (sqrt(vw[i]) / sqrt(bc2) + eps);
        }
        memcpy(before_last, p->data, sizeof(float) * n);
        DSK_TEST_OK(dsk_adamw_step(NULL, p, g, m, v, opts == 1 ? NULL : &o, step, (float)mult, copy));
    }
    if (opts == 2) DSK_TEST_SAME_BYTES(p->data, before_last, sizeof(float) * n, "weights after a step with lr 0");
    free(before_last);
    TT_CHECK(p, pw, 1e-5, 1e-6, "AdamW param after 6 steps");
    TT_CHECK(m, mw, 1e-5, 1e-7, "AdamW first moment");
    TT_CHECK(v, vw, 1e-5, 1e-9, "AdamW second moment");
    if (copy) {
        int bad = 0;
        for (int64_t i = 0; i < n; i++) {
            float pf = ((float *)p->data)[i];
            uint16_t want = with_copy == 1 ? dsk_f32_to_bf16(pf) : dsk_f32_to_f16(pf);
            bad += ((uint16_t *)copy->data)[i] != want;
        }
        DSK_TEST_EXPECT(bad == 0, "%d param_copy elements are not the rounded param", bad);
    }
}

/* bf16 moments against a float64 evaluation of each step from the stored bf16 moments: each
   moment is the f64 update rounded once to bf16 (within a bf16 half-ulp, plus f32's rounding
   of the sum before it), and the weights move by the update of the unrounded moments. */
static void test_adamw_bf16_moments(void) {
    int64_t n = 2053;
    int bad_m = 0, bad_p = 0;
    dsk_adamw_opts o = dsk_adamw_defaults();
    dsk_tensor *p = tt_rand(DSK_F32, 1, SH(n), -1, 1), *m = tt_poisoned(DSK_BF16, 1, SH(n));
    dsk_tensor *v = tt_poisoned(DSK_BF16, 1, SH(n));
    o.lr = 1e-2f;
    o.beta1 = 0.8f;
    o.beta2 = 0.95f;
    o.weight_decay = 0.1f;
    DSK_TEST_OK(dsk_tensor_fill(NULL, m, 0.0));
    DSK_TEST_OK(dsk_tensor_fill(NULL, v, 0.0));
    for (int step = 1; step <= 5; step++) {
        dsk_tensor *g = tt_rand(DSK_F32, 1, SH(n), -1, 1);
        double *gv = tt_vals(g), *pw = tt_vals(p), *mw = tt_vals(m), *vw = tt_vals(v);
        double bc1 = 1 - pow(o.beta1, step), bc2 = 1 - pow(o.beta2, step);
        DSK_TEST_OK(dsk_adamw_step(NULL, p, g, m, v, &o, step, 0.5f, NULL));
        for (int64_t i = 0; i < n; i++) {
            double gi = 0.5 * gv[i], mn = o.beta1 * mw[i] + (1 - (double)o.beta1) * gi;
            double vn = o.beta2 * vw[i] + (1 - (double)o.beta2) * gi * gi;
            double pn = pw[i] * (1 - (double)o.lr * o.weight_decay) - o.lr * (mn / bc1) / (sqrt(vn / bc2) + o.eps);
            double mgot = dsk_bf16_to_f32(((uint16_t *)m->data)[i]), vgot = dsk_bf16_to_f32(((uint16_t *)v->data)[i]);
            double mterms = fabs(o.beta1 * mw[i]) + fabs(gi), vterms = fabs(o.beta2 * vw[i]) + gi * gi;
            bad_m += fabs(mgot - mn) > fabs(mn) * 0x1p-8 + mterms * 0x1p-21; /* half-ulp of bf16, f32's sums */
            bad_m += fabs(vgot - vn) > fabs(vn) * 0x1p-8 + vterms * 0x1p-21;
            bad_p += fabs(((float *)p->data)[i] - pn) > 1e-5 * fabs(pn) + 1e-7;
        }
    }
    DSK_TEST_EXPECT(bad_m == 0, "%d bf16 moments are not the f64 update rounded once", bad_m);
    DSK_TEST_EXPECT(bad_p == 0, "%d weights differ from the f64 update of the unrounded moments", bad_p);
    DSK_TEST_EXPECT(dsk_tensor_nbytes(m) * 2 == (size_t)n * sizeof(float), "bf16 moments take half the bytes");
}

/* ------------------------------------------------------------------ argument errors */


static void test_errors_matmul(void) {
    dsk_tensor *A = tt_rand(DSK_F32, 2, SH(4, 5), -1, 1), *B = tt_rand(DSK_F32, 2, SH(5, 3), -1, 1), *C = tt_new(DSK_F32, 2, SH(4, 3));
    dsk_tensor *Bb = tt_rand(DSK_BF16, 2, SH(5, 3), -1, 1), *Ab = tt_rand(DSK_BF16, 2, SH(4, 5), -1, 1), *Ch = tt_new(DSK_F16, 2, SH(4, 3));
    dsk_tensor *A3 = tt_rand(DSK_F32, 3, SH(2, 4, 5), -1, 1), *B3 = tt_rand(DSK_F32, 3, SH(3, 5, 3), -1, 1), *C3 = tt_new(DSK_F32, 3, SH(2, 4, 3));
    dsk_tensor *Ai = tt_new(DSK_I32, 2, SH(4, 5)), *C4 = tt_new(DSK_F32, 2, SH(4, 4)), *Bt = tt_rand(DSK_F32, 2, SH(3, 5), -1, 1), tv;
    DSK_TEST_OK(dsk_tensor_transpose(Bt, 0, 1, &tv));
    TT_ERR(dsk_matmul(NULL, C, NULL, 0, B, 0, 1, 0), DSK_ERR_ARG, "dsk_matmul: A is NULL");
    TT_ERR(dsk_matmul(NULL, C, A, 1, B, 0, 1, 0), DSK_ERR_ARG, "inner dims differ");
    TT_ERR(dsk_matmul(NULL, C4, A, 0, B, 0, 1, 0), DSK_ERR_ARG, "C [4,4] f32 must be (4, 3)");
    TT_ERR(dsk_matmul(NULL, C, A, 0, Bb, 0, 1, 0), DSK_ERR_ARG, "B [5,3] bf16 must have the dtype of A [4,5] f32");
    TT_ERR(dsk_matmul(NULL, Ch, Ab, 0, Bb, 0, 1, 0), DSK_ERR_ARG, "dtype must be f32 or A's dtype bf16");
    TT_ERR(dsk_matmul(NULL, C, Ai, 0, B, 0, 1, 0), DSK_ERR_ARG, "A [4,5] i32: dtype must be f32, bf16 or f16");
    TT_ERR(dsk_matmul(NULL, C, A, 0, &tv, 0, 1, 0), DSK_ERR_ARG, "needs unit stride in its last dim");
    TT_ERR(dsk_matmul(NULL, C3, A3, 0, B3, 0, 1, 0), DSK_ERR_ARG, "batch mismatch");
    TT_ERR(dsk_matmul(NULL, C, A3, 0, B, 0, 1, 0), DSK_ERR_ARG, "batch mismatch");
}

static void test_errors_elementwise(void) {
    dsk_tensor *a = tt_rand(DSK_F32, 2, SH(3, 4), -1, 1), *b = tt_rand(DSK_F32, 2, SH(4, 3), -1, 1), *h = tt_rand(DSK_F16, 2, SH(3, 4), -1, 1);
    dsk_tensor *i = tt_new(DSK_I32, 2, SH(3, 4)), *out = tt_new(DSK_F32, 2, SH(3, 4)), *s2 = tt_new(DSK_F32, 1, SH(2)), *o64 = tt_new(DSK_F64, 0, NULL), t;
    DSK_TEST_OK(dsk_tensor_transpose(b, 0, 1, &t));
    TT_ERR(dsk_add(NULL, out, a, b), DSK_ERR_ARG, "dsk_add: b [4,3] f32 does not match the shape of out [3,4] f32");
    TT_ERR(dsk_mul(NULL, out, a, &t), DSK_ERR_ARG, "dsk_mul: b [3,4] f32 is not contiguous");
    TT_ERR(dsk_mul(NULL, out, a, h), DSK_ERR_ARG, "b [3,4] f16 must have the dtype of out");
    TT_ERR(dsk_scale(NULL, i, 2.0f), DSK_ERR_ARG, "dsk_scale: t [3,4] i32: dtype must be f32, bf16 or f16");
    TT_ERR(dsk_axpy(NULL, out, 1.0f, NULL), DSK_ERR_ARG, "dsk_axpy: x is NULL");
    TT_ERR(dsk_reduce(NULL, s2, a, 3, DSK_REDUCE_SUM), DSK_ERR_ARG, "dsk_reduce: axis 3 outside in [3,4] f32");
    TT_ERR(dsk_reduce(NULL, s2, a, 0, DSK_REDUCE_SUM), DSK_ERR_ARG, "out [2] f32 must be in [3,4] f32 without axis 0");
    TT_ERR(dsk_reduce(NULL, out, a, 0, (dsk_reduce_op)9), DSK_ERR_ARG, "unknown op 9");
    TT_ERR(dsk_sum_squares(NULL, s2, a), DSK_ERR_ARG, "dsk_sum_squares: out [2] f32 must hold exactly one element");
    TT_ERR(dsk_sum_squares(NULL, o64, a), DSK_ERR_ARG, "out [] f64: dtype must be f32");
}

static void test_errors_norms(void) {
    dsk_tensor *x = tt_rand(DSK_F32, 2, SH(3, 7), -1, 1), *y = tt_new(DSK_F32, 2, SH(3, 7)), *w = tt_rand(DSK_F32, 1, SH(6), -1, 1), *w7 = tt_rand(DSK_F32, 1, SH(7), -1, 1);
    dsk_tensor *r = tt_new(DSK_F32, 1, SH(4)), *r3 = tt_new(DSK_F32, 1, SH(3)), *s = tt_new(DSK_F32, 0, NULL), *yb = tt_new(DSK_BF16, 2, SH(3, 7));
    TT_ERR(dsk_softmax(NULL, s, s), DSK_ERR_ARG, "dsk_softmax: x [] f32 must have at least 1 dim");
    TT_ERR(dsk_softmax(NULL, yb, x), DSK_ERR_ARG, "y [3,7] bf16 must have the dtype of x");
    TT_ERR(dsk_softmax_backward(NULL, x, y, r), DSK_ERR_ARG, "dsk_softmax_backward: dy [4] f32 does not match");
    TT_ERR(dsk_rmsnorm(NULL, y, r3, x, w, 1e-5f), DSK_ERR_ARG, "dsk_rmsnorm: w [6] f32 must be (7), the last dim of x [3,7] f32");
    TT_ERR(dsk_rmsnorm(NULL, y, r, x, w7, 1e-5f), DSK_ERR_ARG, "rstd [4] f32 must have the shape of x [3,7] f32 without its last dim");
    TT_ERR(dsk_rmsnorm(NULL, y, r3, x, w7, -1.0f), DSK_ERR_ARG, "eps -1 must be finite and >= 0");
    TT_ERR(dsk_rmsnorm_backward(NULL, y, NULL, x, x, w7, NULL), DSK_ERR_ARG, "dsk_rmsnorm_backward: rstd is NULL");
    TT_ERR(dsk_silu(NULL, yb, x), DSK_ERR_ARG, "dsk_silu: x [3,7] f32 must have the dtype of y");
    TT_ERR(dsk_swiglu_backward(NULL, y, y, x, x, r, DSK_GRAD_ADD), DSK_ERR_ARG,
           "dsk_swiglu_backward: up [4] f32 does not match");
}

static void test_errors_indices(void) {
    dsk_tensor *table = tt_rand(DSK_F32, 2, SH(5, 4), -1, 1), *ids = tt_ids(1, SH(6), 5), *out = tt_new(DSK_F32, 2, SH(6, 4)), *out3 = tt_new(DSK_F32, 2, SH(6, 3));
    dsk_tensor *fids = tt_new(DSK_F32, 1, SH(6)), *logits = tt_rand(DSK_F32, 2, SH(6, 4), -1, 1), *loss = tt_new(DSK_F32, 0, NULL), *loss2 = tt_new(DSK_F32, 1, SH(2));
    dsk_tensor *tg = tt_ids(1, SH(6), 4);
    ((int32_t *)ids->data)[3] = 9;
    TT_ERR(dsk_embedding(NULL, out, table, ids), DSK_ERR_ARG, "dsk_embedding: ids[3] = 9 outside [0, 5)");
    ((int32_t *)ids->data)[3] = -1;
    TT_ERR(dsk_embedding_backward(NULL, table, out, ids), DSK_ERR_ARG, "dsk_embedding_backward: ids[3] = -1 outside [0, 5)");
    TT_ERR(dsk_embedding(NULL, out, table, fids), DSK_ERR_ARG, "ids [6] f32: dtype must be i32");
    TT_ERR(dsk_embedding(NULL, out3, table, tg), DSK_ERR_ARG, "out [6,3] f32 must have the last dim of table [5,4] f32");
    TT_ERR(dsk_gather_rows(NULL, out, table, ids), DSK_ERR_ARG, "dsk_gather_rows: idx[3] = -1 outside [0, 5)");
    TT_ERR(dsk_scatter_add_rows(NULL, table, out3, tg), DSK_ERR_ARG, "dsk_scatter_add_rows: src [6,3] f32 must be (6, 4)");
    ((int32_t *)tg->data)[1] = 50;
    TT_ERR(dsk_cross_entropy(NULL, loss, NULL, logits, tg, -100, 1.0f), DSK_ERR_ARG, "dsk_cross_entropy: targets[1] = 50 outside [0, 4)");
    ((int32_t *)tg->data)[1] = -100;
    DSK_TEST_OK(dsk_cross_entropy(NULL, loss, NULL, logits, tg, -100, 1.0f));
    TT_ERR(dsk_cross_entropy(NULL, loss, NULL, logits, tg, -1, 1.0f), DSK_ERR_ARG, "targets[1] = -100 outside [0, 4)");
    TT_ERR(dsk_cross_entropy(NULL, loss2, NULL, logits, tg, -100, 1.0f), DSK_ERR_ARG, "loss [2] f32 must hold exactly one element");
    ((int32_t *)tg->data)[1] = 0;
    ((int32_t *)tg->data)[4] = -2;
    TT_ERR(dsk_cross_entropy(NULL, loss, NULL, logits, tg, -100, 1.0f), DSK_ERR_ARG, "targets[4] = -2 outside [0, 4)");
}

static void test_errors_topk_rope_attention(void) {
    dsk_tensor *x = tt_rand(DSK_F32, 2, SH(3, 8), -1, 1), *xb = tt_rand(DSK_BF16, 2, SH(3, 8), -1, 1), *v = tt_new(DSK_F32, 2, SH(3, 2)), *iv = tt_new(DSK_I32, 2, SH(3, 2));
    dsk_tensor *v9 = tt_new(DSK_F32, 2, SH(3, 9)), *i9 = tt_new(DSK_I32, 2, SH(3, 9)), *i3 = tt_new(DSK_I32, 2, SH(2, 2));
    dsk_tensor *q5 = tt_rand(DSK_F32, 4, SH(1, 2, 1, 5), -1, 1), *q = tt_rand(DSK_F32, 4, SH(1, 3, 2, 4), -1, 1), *q3 = tt_rand(DSK_F32, 3, SH(3, 2, 4), -1, 1);
    dsk_tensor *k2 = tt_rand(DSK_F32, 4, SH(1, 2, 2, 4), -1, 1), *o = tt_new(DSK_F32, 4, SH(1, 3, 2, 4)), *pr = tt_new(DSK_F32, 4, SH(1, 2, 3, 3)), *pb = tt_new(DSK_F32, 4, SH(1, 3, 2, 3));
    TT_ERR(dsk_topk(NULL, v9, i9, x, 9), DSK_ERR_ARG, "dsk_topk: k = 9 outside [1, 8] for x [3,8] f32");
    TT_ERR(dsk_topk(NULL, v, iv, x, 0), DSK_ERR_ARG, "k = 0 outside [1, 8]");
    TT_ERR(dsk_topk(NULL, v, iv, xb, 2), DSK_ERR_ARG, "x [3,8] bf16: dtype must be f32");
    TT_ERR(dsk_topk(NULL, v, i3, x, 2), DSK_ERR_ARG, "indices [2,2] i32 must be (3, 2)");
    TT_ERR(dsk_rope(NULL, q5, q5, 0, 10000.0f), DSK_ERR_ARG, "dsk_rope: x [1,2,1,5] f32: head dim 5 must be even");
    TT_ERR(dsk_rope(NULL, q, q, 0, 0.0f), DSK_ERR_ARG, "theta 0 must be finite and > 0");
    TT_ERR(dsk_rope_backward(NULL, q3, q3, 0, 1e4f, DSK_GRAD_ADD), DSK_ERR_ARG,
           "dsk_rope_backward: dy [3,2,4] f32 must have 4 dims");
    TT_ERR(dsk_attention(NULL, o, pr, q, k2, q, 0.5f), DSK_ERR_ARG, "dsk_attention: k [1,2,2,4] f32 does not match the shape of q");
    TT_ERR(dsk_attention(NULL, o, pb, q, q, q, 0.5f), DSK_ERR_ARG, "probs [1,3,2,3] f32 must be (1, 2, 3, 3) (B, H, T, T)");
    TT_ERR(dsk_attention(NULL, o, pr, q, q, q, NAN), DSK_ERR_ARG, "scale nan is not finite");
    TT_ERR(dsk_attention_backward(NULL, o, NULL, o, o, q, q, q, pr, 0.5f, DSK_GRAD_ADD), DSK_ERR_ARG,
           "dsk_attention_backward: dk is NULL");
}

/* A store that is neither DSK_GRAD_ADD nor DSK_GRAD_WRITE: each backward that takes one names
   it, and its outputs keep their values. */
static void test_errors_grad_store(void) {
    const int64_t *sh = SH(1, 3, 2, 4);
    dsk_tensor *q = tt_rand(DSK_F32, 4, sh, -1, 1), *o = tt_rand(DSK_F32, 4, sh, -1, 1), *g[3],
               *l = tt_new(DSK_F32, 3, SH(1, 2, 3));
    dsk_tensor *pr = tt_new(DSK_F32, 4, SH(1, 2, 3, 3));
    dsk_grad_store bad = (dsk_grad_store)2;
    double *before[3];
    DSK_TEST_OK(dsk_attention(NULL, o, pr, q, q, q, 0.5f));
    DSK_TEST_OK(dsk_attention_fused(NULL, o, l, q, q, q, 0.5f));
    for (int i = 0; i < 3; i++) {
        g[i] = tt_rand(DSK_F32, 4, sh, -1, 1);
        before[i] = tt_vals(g[i]);
    }
    TT_ERR(dsk_swiglu_backward(NULL, g[0], g[1], q, q, q, bad), DSK_ERR_ARG,
           "dsk_swiglu_backward: store 2 is neither DSK_GRAD_ADD (0) nor DSK_GRAD_WRITE (1)");
    TT_ERR(dsk_rope_backward(NULL, g[0], q, 0, 1e4f, bad), DSK_ERR_ARG, "dsk_rope_backward: store 2 is neither");
    TT_ERR(dsk_attention_backward(NULL, g[0], g[1], g[2], q, q, q, q, pr, 0.5f, bad), DSK_ERR_ARG,
           "dsk_attention_backward: store 2 is neither");
    TT_ERR(dsk_attention_fused_backward(NULL, g[0], g[1], g[2], q, q, q, q, o, l, 0.5f, (dsk_grad_store)-1),
           DSK_ERR_ARG, "dsk_attention_fused_backward: store -1 is neither");
    for (int i = 0; i < 3; i++) TT_CHECK(g[i], before[i], 0, 0, "a gradient output after the refused calls");
}

static void test_errors_adamw(void) {
    dsk_tensor *p = tt_rand(DSK_F32, 1, SH(5), -1, 1), *g = tt_rand(DSK_BF16, 1, SH(5), -1, 1), *m = tt_new(DSK_F32, 1, SH(5)), *v = tt_new(DSK_F32, 1, SH(5));
    dsk_tensor *m4 = tt_new(DSK_F32, 1, SH(4)), *gi = tt_new(DSK_I32, 1, SH(5)), *pb = tt_new(DSK_BF16, 1, SH(5));
    dsk_tensor *mb = tt_new(DSK_BF16, 1, SH(5)), *mh = tt_new(DSK_F16, 1, SH(5));
    dsk_adamw_opts o = dsk_adamw_defaults();
    TT_ERR(dsk_adamw_step(NULL, p, g, m, v, NULL, 0, 1.0f, NULL), DSK_ERR_ARG, "dsk_adamw_step: step 0 must be >= 1");
    TT_ERR(dsk_adamw_step(NULL, p, g, m4, v, NULL, 1, 1.0f, NULL), DSK_ERR_ARG, "m [4] f32 does not match the shape of param [5] f32");
    TT_ERR(dsk_adamw_step(NULL, p, gi, m, v, NULL, 1, 1.0f, NULL), DSK_ERR_ARG, "grad [5] i32: dtype must be f32, bf16 or f16");
    TT_ERR(dsk_adamw_step(NULL, pb, g, m, v, NULL, 1, 1.0f, NULL), DSK_ERR_ARG, "param [5] bf16: dtype must be f32");
    o.beta1 = 1.5f;
    TT_ERR(dsk_adamw_step(NULL, p, g, m, v, &o, 1, 1.0f, NULL), DSK_ERR_ARG, "beta1 1.5 outside [0, 1)");
    o = dsk_adamw_defaults(); o.beta2 = 1.0f;
    TT_ERR(dsk_adamw_step(NULL, p, g, m, v, &o, 1, 1.0f, NULL), DSK_ERR_ARG, "beta2 1 outside [0, 1)");
    o = dsk_adamw_defaults(); o.lr = -1;
    TT_ERR(dsk_adamw_step(NULL, p, g, m, v, &o, 1, 1.0f, NULL), DSK_ERR_ARG, "lr -1 must be finite and >= 0");
    o = dsk_adamw_defaults(); o.weight_decay = NAN;
    TT_ERR(dsk_adamw_step(NULL, p, g, m, v, &o, 1, 1.0f, NULL), DSK_ERR_ARG,
           "weight_decay nan must be finite and >= 0");
    TT_ERR(dsk_adamw_step(NULL, p, g, m, mb, NULL, 1, 1.0f, NULL), DSK_ERR_ARG,
           "moments m [5] f32 and v [5] bf16 must be both f32 or both bf16");
    TT_ERR(dsk_adamw_step(NULL, p, g, mh, mh, NULL, 1, 1.0f, NULL), DSK_ERR_ARG,
           "m [5] f16 and v [5] f16 must be both");
    memset(&o, 0, sizeof o); /* a zeroed struct is caught by its eps */
    TT_ERR(dsk_adamw_step(NULL, p, g, m, v, &o, 1, 1.0f, NULL), DSK_ERR_ARG, "eps 0 must be finite and > 0");
}

/* A tensor that claims to live on a CUDA device: a CPU build refuses it; a CUDA build needs a
   CUDA ctx for it and refuses to mix it with CPU tensors. */
static void test_errors_devices(void) {
    static float buf[12];
    dsk_tensor dev, *cpu = tt_rand(DSK_F32, 2, SH(3, 4), -1, 1), *out = tt_new(DSK_F32, 2, SH(3, 4));
    dsk_device cuda = {DSK_DEV_CUDA, 0};
    DSK_TEST_OK(dsk_tensor_wrap(&dev, buf, DSK_F32, cuda, 2, SH(3, 4)));
#ifdef DSK_CUDA
    TT_ERR(dsk_add(NULL, out, cpu, &dev), DSK_ERR_ARG, "dsk_add: b is on cuda:0 but out is on cpu:0");
    TT_ERR(dsk_scale(NULL, &dev, 2.0f), DSK_ERR_ARG, "dsk_scale: t is on cuda:0 but ctx is NULL");
#else
    TT_ERR(dsk_add(NULL, out, cpu, &dev), DSK_ERR_UNSUPPORTED, "dsk_add: b is a CUDA tensor in a build without DSK_CUDA");
    TT_ERR(dsk_softmax(NULL, &dev, cpu), DSK_ERR_UNSUPPORTED, "dsk_softmax: y is a CUDA tensor in a build without DSK_CUDA");
    TT_ERR(dsk_matmul(NULL, out, cpu, 0, &dev, 0, 1, 0), DSK_ERR_UNSUPPORTED, "dsk_matmul: B is a CUDA tensor in a build without DSK_CUDA");
#endif
}

/* cuBLAS, which a real CUDA build dlopens when it makes its first CUDA context (kernels/tensor.cu)
   instead of linking it: not mapped before, then every entry point resolved, and the errors of a
   missing library or symbol. Runs without a GPU (it loads the library, makes no handle). */
#if defined(DSK_CUDA) && !defined(DSK_CUDA_EMU)
dsk_status dsk__cuda_cublas_load(const char *lib); /* kernels/tensor.cu, for tests */

static int tt_cublas_mapped(void) {
    char line[4096];
    int found = 0;
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return -1;
    while (!found && fgets(line, sizeof line, f)) found = strstr(line, "/libcublas.so") != NULL;
    fclose(f);
    return found;
}

static void test_cublas_load(void) {
    int n = 0;
    DSK_TEST_OK(dsk_cuda_device_count(&n));
    if (n == 0) /* no CUDA ctx can have been made: the library must not be loaded yet */
        DSK_TEST_EXPECT(tt_cublas_mapped() == 0, "libcublas mapped before any CUDA context (linked?)");
    TT_ERR(dsk__cuda_cublas_load("libcublas.so.0-dsk-missing"), DSK_ERR_CUDA,
           "dsk_ctx_init: loading cuBLAS: dlopen(\"libcublas.so.0-dsk-missing\") failed: ");
    TT_ERR(dsk__cuda_cublas_load("libm.so.6"), DSK_ERR_CUDA,
           "dsk_ctx_init: loading cuBLAS: dlsym(\"libm.so.6\", \"cublasCreate_v2\") failed: ");
    dsk_clear_error();
    DSK_TEST_OK(dsk__cuda_cublas_load(NULL));
    DSK_TEST_OK(dsk__cuda_cublas_load(NULL)); /* loaded once; the second call finds it */
    DSK_TEST_EXPECT(tt_cublas_mapped() == 1, "libcublas not mapped after loading it");
}
#else
static void test_cublas_load(void) {
    dsk_test_skip("cuBLAS is dlopened only by a real CUDA build (this one: %s)",
#ifdef DSK_CUDA
                  "the CUDA emulator"
#else
                  "CUDA=0"
#endif
    );
}
#endif

/* ------------------------------------------------------------------ rows: the same bits for any row count
   The contract of dsk_matmul's comment: a row's result does not depend on how many rows a call
   is given, how they are split between calls, or the thread count. Each case computes its op on
   all M rows, then on the same rows cut into parts (one row each; two parts at every cut, so every
   remainder of every tile height; odd lengths 1, 3, 5, ...), on 1 and 2 threads, and wants every
   output byte of the whole call back. */

/* An op's tensors: t[0, nout) outputs, then row inputs, each cut along dim[i]; w[] whole
   inputs; init[o]: an accumulated output's value before each call (NULL: poisoned). */
typedef struct tt_rows_io {
    dsk_tensor *t[10];
    int dim[10], nt, nout;
    dsk_tensor *init[6];
    dsk_tensor *w[8];
    int flag[3];
    float f;
} tt_rows_io;
typedef dsk_status (*tt_rows_fn)(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n);

/* How many cut patterns M rows get: every one below for M <= 80, else 4 chunk lengths. */
static int64_t tt_rows_patterns(int64_t M) { return M <= 80 ? M + 1 : 4; }
/* The parts of cut pattern p of M rows; returns their count (at most 80). M > 80: chunks of 7,
   64 (the trainer's micro-batches), 144 (the packed nest's row block) and 145, then the rest. */
static int tt_rows_cut(int64_t M, int64_t p, int64_t *len) {
    static const int64_t chunk[4] = {7, 64, 144, 145};
    int k = 0;
    if (M > 80) {
        for (int64_t r = 0; r < M; r += len[k - 1]) len[k++] = chunk[p] < M - r ? chunk[p] : M - r;
        return k;
    }
    if (p == 0) { for (int64_t r = 0; r < M; r++) len[k++] = 1; return k; }
    if (p < M) { len[0] = p; len[1] = M - p; return 2; }
    for (int64_t r = 0, l = 1; r < M; r += len[k - 1], l += 2) len[k++] = l < M - r ? l : M - r;
    return k;
}

static void tt_rows_prepare(tt_rows_io *io) {
    for (int o = 0; o < io->nout; o++) {
        if (io->init[o]) memcpy(io->t[o]->data, io->init[o]->data, dsk_tensor_nbytes(io->t[o]));
        else memset(io->t[o]->data, 0xff, dsk_tensor_nbytes(io->t[o])); /* NaN (and -1 for indices) */
    }
}

/* Runs fn on rows [r0, r0 + n) of every cut tensor. */
static dsk_status tt_rows_call(dsk_ctx *cx, tt_rows_fn fn, tt_rows_io *io, int64_t r0, int64_t n) {
    dsk_tensor v[10];
    for (int i = 0; i < io->nt; i++)
        if (dsk_tensor_slice(io->t[i], io->dim[i], r0, n, &v[i]) != DSK_OK) return DSK_ERR_ARG;
    return fn(cx, io, v, r0, n);
}

/* 0, or 1 after reporting the first output row whose bytes differ from ref. */
static int tt_rows_differ(const char *op, tt_rows_io *io, unsigned char **ref, const char *how) {
    for (int o = 0; o < io->nout; o++) {
        const dsk_tensor *t = io->t[o];
        size_t es = dsk_dtype_size(t->dtype), nb = dsk_tensor_nbytes(t);
        const unsigned char *got = (const unsigned char *)t->data;
        for (size_t b = 0; b < nb; b++)
            if (got[b] != ref[o][b]) {
                int64_t e = (int64_t)(b / es), row = e / t->stride[io->dim[o]] % t->shape[io->dim[o]];
                DSK_TEST_EXPECT(0, "%s (%s, %s): output %d row %lld of %lld differs from the one call on all rows "
                                "(element %lld)", op, dsk_cpu_isa_name(tt_isa), how, o, (long long)row,
                                (long long)t->shape[io->dim[o]], (long long)e);
                return 1;
            }
    }
    return 0;
}

static void tt_rows_check(const char *op, tt_rows_fn fn, tt_rows_io *io) {
    int64_t M = io->t[0]->shape[io->dim[0]], len[80];
    unsigned char *ref[6];
    char how[96];
    dsk_ctx cx;
    dsk_ctx_opts o;
    memset(&o, 0, sizeof o);
    o.device = DSK_PREFER_CPU;
    o.cpu_isa = tt_isa;
    for (int i = 0; i < io->nout; i++) ref[i] = (unsigned char *)tt_alloc(dsk_tensor_nbytes(io->t[i]));
    for (int th = 1; th <= 2; th++) {
        o.n_threads = th;
        DSK_TEST_OK(dsk_ctx_init(&cx, &o));
        tt_rows_prepare(io);
        DSK_TEST_OK(tt_rows_call(&cx, fn, io, 0, M));
        if (th == 1)
            for (int i = 0; i < io->nout; i++) memcpy(ref[i], io->t[i]->data, dsk_tensor_nbytes(io->t[i]));
        snprintf(how, sizeof how, "%d threads, one call of %lld rows", th, (long long)M);
        if (tt_rows_differ(op, io, ref, how)) return;
        for (int64_t p = 0; p < tt_rows_patterns(M); p++) {
            int parts = tt_rows_cut(M, p, len);
            int64_t r0 = 0;
            tt_rows_prepare(io);
            for (int k = 0; k < parts; r0 += len[k++]) DSK_TEST_OK(tt_rows_call(&cx, fn, io, r0, len[k]));
            snprintf(how, sizeof how, "%d threads, %d calls of %lld%s rows", th, parts, (long long)len[0],
                     parts > 2 ? ", ..." : parts == 2 ? " and the rest" : "");
            if (tt_rows_differ(op, io, ref, how)) return;
        }
        dsk_ctx_free(&cx);
    }
}

/* The rows: M in [24, 40]. */
static int64_t tt_rows_m(void) { return 24 + dsk_test_rand_int(17); }

static dsk_status tt_rows_matmul(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n) {
    (void)r0; (void)n;
    return dsk_matmul(cx, &v[0], &v[1], io->flag[0], io->w[0], io->flag[1], io->f, io->flag[2] ? 0.5f : 0.0f);
}
/* C (M, N) of dtype cdt = 1.25 op(A) op(B) (+ 0.5 C with beta), A, B of dtype dt; M rows
   (0: tt_rows_m()). */
static void test_rows_matmul(dsk_dtype dt, dsk_dtype cdt, int ta, int tb, int64_t M, int64_t K, int64_t N, int beta) {
    M = M ? M : tt_rows_m();
    tt_rows_io io;
    char op[96];
    memset(&io, 0, sizeof io);
    io.nt = 2; io.nout = 1; io.f = 1.25f; io.flag[0] = ta; io.flag[1] = tb; io.flag[2] = beta;
    io.t[0] = tt_new(cdt, 2, SH(M, N));
    io.t[1] = ta ? tt_rand(dt, 2, SH(K, M), -1, 1) : tt_rand(dt, 2, SH(M, K), -1, 1);
    io.dim[1] = ta;
    io.w[0] = tb ? tt_rand(dt, 2, SH(N, K), -1, 1) : tt_rand(dt, 2, SH(K, N), -1, 1);
    if (beta) io.init[0] = tt_rand(cdt, 2, SH(M, N), -1, 1);
    snprintf(op, sizeof op, "matmul %s -> %s trans_a %d trans_b %d K %lld N %lld%s", dsk_dtype_name(dt),
             dsk_dtype_name(cdt), ta, tb, (long long)K, (long long)N, beta ? " beta 0.5" : "");
    tt_rows_check(op, tt_rows_matmul, &io);
}

static dsk_status tt_rows_softmax(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n) {
    (void)io; (void)r0; (void)n;
    return dsk_softmax(cx, &v[0], &v[1]);
}
static dsk_status tt_rows_softmax_bwd(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n) {
    (void)io; (void)r0; (void)n;
    return dsk_softmax_backward(cx, &v[0], &v[1], &v[2]);
}
static dsk_status tt_rows_rmsnorm(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n) {
    (void)r0; (void)n;
    return dsk_rmsnorm(cx, &v[0], &v[1], &v[2], io->w[0], 1e-5f);
}
static dsk_status tt_rows_rmsnorm_bwd(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n) {
    (void)r0; (void)n;
    return dsk_rmsnorm_backward(cx, &v[0], NULL, &v[1], &v[2], io->w[0], &v[3]);
}
static dsk_status tt_rows_silu(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n) {
    (void)io; (void)r0; (void)n;
    return dsk_silu(cx, &v[0], &v[1]);
}
static dsk_status tt_rows_swiglu(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n) {
    (void)io; (void)r0; (void)n;
    return dsk_swiglu(cx, &v[0], &v[1], &v[2]);
}
static dsk_status tt_rows_swiglu_bwd(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n) {
    (void)io; (void)r0; (void)n;
    return dsk_swiglu_backward(cx, &v[0], &v[1], &v[2], &v[3], &v[4], DSK_GRAD_ADD);
}
/* The raw f32 SwiGLU of dsk_moe.h (no ctx: dsk_cpu_isa_auto()'s kernels, so only for AUTO). */
static dsk_status tt_rows_swiglu_grad_cpu(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n) {
    (void)cx; (void)io; (void)r0;
    dsk_swiglu_grad_cpu(n * v[0].shape[1], (const float *)v[2].data, (const float *)v[3].data, (const float *)v[4].data,
                        (float *)v[0].data, (float *)v[1].data);
    return DSK_OK;
}
/* dlogits of the call's rows with grad_scale = its row count: the factor grad_scale / count is 1. */
static dsk_status tt_rows_xent(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n) {
    (void)r0;
    return dsk_cross_entropy(cx, io->w[0], &v[0], &v[1], &v[2], -1, (float)n);
}
static dsk_status tt_rows_rope(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n) {
    (void)io; (void)n;
    return dsk_rope(cx, &v[0], &v[1], r0, 10000.0f);
}
static dsk_status tt_rows_rope_bwd(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n) {
    (void)io; (void)n;
    return dsk_rope_backward(cx, &v[0], &v[1], r0, 10000.0f, DSK_GRAD_ADD);
}
static dsk_status tt_rows_gather(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n) {
    (void)r0; (void)n;
    return dsk_gather_rows_scaled(cx, &v[0], io->w[0], &v[1], &v[2]);
}
static dsk_status tt_rows_embedding(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n) {
    (void)r0; (void)n;
    return dsk_embedding(cx, &v[0], io->w[0], &v[1]);
}
static dsk_status tt_rows_axpy(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n) {
    (void)r0; (void)n;
    return dsk_axpy(cx, &v[0], io->f, &v[1]);
}

/* The row ops (dt) on M rows of odd widths (37, 2 x 9 for rope), cut every way. */
static void test_rows_ops(dsk_dtype dt) {
    int64_t M = tt_rows_m(), C = 37;
    const int64_t *mc = SH(M, C);
    tt_rows_io io;
    char op[64];
#define TT_ROWS_IO(NOUT) (memset(&io, 0, sizeof io), io.nout = (NOUT))
#define TT_ROWS_OP(name, fn) (snprintf(op, sizeof op, "%s %s", name, dsk_dtype_name(dt)), tt_rows_check(op, fn, &io))
    TT_ROWS_IO(1); io.nt = 2;
    io.t[0] = tt_new(dt, 2, mc); io.t[1] = tt_rand(dt, 2, mc, -4, 4);
    TT_ROWS_OP("softmax", tt_rows_softmax);
    TT_ROWS_IO(1); io.nt = 3;
    io.t[0] = tt_new(dt, 2, mc); io.t[1] = tt_rand(dt, 2, mc, 0, 0.2); io.t[2] = tt_rand(dt, 2, mc, -1, 1);
    io.init[0] = tt_rand(dt, 2, mc, -1, 1);
    TT_ROWS_OP("softmax_backward", tt_rows_softmax_bwd);
    TT_ROWS_IO(2); io.nt = 3;
    io.t[0] = tt_new(dt, 2, mc); io.t[1] = tt_new(DSK_F32, 1, SH(M)); io.t[2] = tt_rand(dt, 2, mc, -2, 2);
    io.w[0] = tt_rand(dt, 1, SH(C), 0.5, 1.5);
    TT_ROWS_OP("rmsnorm", tt_rows_rmsnorm);
    TT_ROWS_IO(1); io.nt = 4;
    io.t[0] = tt_new(dt, 2, mc); io.t[1] = tt_rand(dt, 2, mc, -1, 1); io.t[2] = tt_rand(dt, 2, mc, -2, 2);
    io.t[3] = tt_rand(DSK_F32, 1, SH(M), 0.5, 2); io.w[0] = tt_rand(dt, 1, SH(C), 0.5, 1.5);
    io.init[0] = tt_rand(dt, 2, mc, -1, 1);
    TT_ROWS_OP("rmsnorm_backward dx", tt_rows_rmsnorm_bwd);
    TT_ROWS_IO(1); io.nt = 2;
    io.t[0] = tt_new(dt, 2, mc); io.t[1] = tt_rand(dt, 2, mc, -6, 6);
    TT_ROWS_OP("silu", tt_rows_silu);
    TT_ROWS_IO(1); io.nt = 3;
    io.t[0] = tt_new(dt, 2, mc); io.t[1] = tt_rand(dt, 2, mc, -6, 6); io.t[2] = tt_rand(dt, 2, mc, -2, 2);
    TT_ROWS_OP("swiglu", tt_rows_swiglu);
    TT_ROWS_IO(2); io.nt = 5;
    io.t[0] = tt_new(dt, 2, mc); io.t[1] = tt_new(dt, 2, mc); io.t[2] = tt_rand(dt, 2, mc, -1, 1);
    io.t[3] = tt_rand(dt, 2, mc, -6, 6); io.t[4] = tt_rand(dt, 2, mc, -2, 2);
    io.init[0] = tt_rand(dt, 2, mc, -1, 1); io.init[1] = tt_rand(dt, 2, mc, -1, 1);
    TT_ROWS_OP("swiglu_backward", tt_rows_swiglu_bwd);
    if (dt == DSK_F32 && tt_isa == dsk_cpu_isa_auto()) { /* dgate, dup written from dout, gate, up */
        io.init[0] = io.init[1] = NULL;
        TT_ROWS_OP("dsk_swiglu_grad_cpu", tt_rows_swiglu_grad_cpu);
    }
    TT_ROWS_IO(1); io.nt = 3;
    io.t[0] = tt_new(dt, 2, mc); io.t[1] = tt_rand(dt, 2, mc, -4, 4); io.t[2] = tt_ids(1, SH(M), C);
    io.w[0] = tt_new(DSK_F32, 0, NULL);
    TT_ROWS_OP("cross_entropy dlogits", tt_rows_xent);
    TT_ROWS_IO(1); io.nt = 2; io.dim[0] = io.dim[1] = 1;
    io.t[0] = tt_new(dt, 4, SH(1, M, 2, 18)); io.t[1] = tt_rand(dt, 4, SH(1, M, 2, 18), -2, 2);
    TT_ROWS_OP("rope (rows are positions)", tt_rows_rope);
    io.init[0] = tt_rand(dt, 4, SH(1, M, 2, 18), -1, 1);
    TT_ROWS_OP("rope_backward (rows are positions)", tt_rows_rope_bwd);
    TT_ROWS_IO(1); io.nt = 3;
    io.t[0] = tt_new(dt, 2, mc); io.t[1] = tt_ids(1, SH(M), 11); io.t[2] = tt_rand(DSK_F32, 1, SH(M), -2, 2);
    io.w[0] = tt_rand(dt, 2, SH(11, C), -2, 2);
    TT_ROWS_OP("gather_rows_scaled", tt_rows_gather);
    TT_ROWS_IO(1); io.nt = 2;
    io.t[0] = tt_new(dt, 2, mc); io.t[1] = tt_ids(1, SH(M), 11); io.w[0] = tt_rand(dt, 2, SH(11, C), -2, 2);
    TT_ROWS_OP("embedding", tt_rows_embedding);
    TT_ROWS_IO(1); io.nt = 2; io.f = -0.75f;
    io.t[0] = tt_new(dt, 2, mc); io.t[1] = tt_rand(dt, 2, mc, -2, 2); io.init[0] = tt_rand(dt, 2, mc, -2, 2);
    TT_ROWS_OP("axpy", tt_rows_axpy);
#undef TT_ROWS_OP
#undef TT_ROWS_IO
}

static dsk_status tt_rows_attn(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n) {
    (void)io; (void)r0; (void)n;
    return dsk_attention(cx, &v[0], &v[1], &v[2], &v[3], &v[4], 0.3f);
}
static dsk_status tt_rows_attn_bwd(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n) {
    (void)io; (void)r0; (void)n;
    return dsk_attention_backward(cx, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7], 0.3f, DSK_GRAD_ADD);
}
static dsk_status tt_rows_fattn(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n) {
    (void)io; (void)r0; (void)n;
    return dsk_attention_fused(cx, &v[0], &v[1], &v[2], &v[3], &v[4], 0.3f);
}
static dsk_status tt_rows_fattn_bwd(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n) {
    (void)io; (void)r0; (void)n;
    return dsk_attention_fused_backward(cx, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7], &v[8], 0.3f,
                                        DSK_GRAD_ADD);
}

/* Attention (dt) on a batch of B sequences of T = 21 (3 heads of 12), cut along the batch: a
   sequence's bits do not depend on how many others share the call. */
static void test_rows_attention(dsk_dtype dt, int fused) {
    int64_t B = 5 + dsk_test_rand_int(4), T = 21, H = 3, D = 12;
    const int64_t *sh = SH(B, T, H, D);
    tt_rows_io io;
    char op[64];
    memset(&io, 0, sizeof io);
    io.nout = 2; io.nt = 5;
    io.t[0] = tt_new(dt, 4, sh);
    io.t[1] = fused ? tt_new(DSK_F32, 3, SH(B, H, T)) : tt_new(DSK_F32, 4, SH(B, H, T, T));
    for (int i = 2; i < 5; i++) io.t[i] = tt_rand(dt, 4, sh, -2, 2);
    snprintf(op, sizeof op, "%s %s", fused ? "attention_fused" : "attention", dsk_dtype_name(dt));
    tt_rows_check(op, fused ? tt_rows_fattn : tt_rows_attn, &io);
    /* backward: dq, dk, dv accumulated from dout and the forward's saved tensors */
    {
        dsk_tensor *out = io.t[0], *saved = io.t[1], *q = io.t[2], *k = io.t[3], *v = io.t[4];
        DSK_TEST_OK(fused ? dsk_attention_fused(tt_cx, out, saved, q, k, v, 0.3f)
                          : dsk_attention(tt_cx, out, saved, q, k, v, 0.3f));
        memset(&io, 0, sizeof io);
        io.nout = 3;
        for (int i = 0; i < 3; i++) { io.t[i] = tt_new(dt, 4, sh); io.init[i] = tt_rand(dt, 4, sh, -1, 1); }
        io.t[3] = tt_rand(dt, 4, sh, -1, 1); io.t[4] = q; io.t[5] = k; io.t[6] = v;
        if (fused) { io.t[7] = out; io.t[8] = saved; io.nt = 9; }
        else { io.t[7] = saved; io.nt = 8; }
        snprintf(op, sizeof op, "%s_backward %s", fused ? "attention_fused" : "attention", dsk_dtype_name(dt));
        tt_rows_check(op, fused ? tt_rows_fattn_bwd : tt_rows_attn_bwd, &io);
    }
}

/* Segments of the call's rows: segment g is the global rows [off[g], off[g + 1]) clipped to
   [r0, r0 + n), shifted by r0 (io->w[3], G + 1 i32, is rewritten for each call). */
static dsk_tensor *tt_rows_offsets(tt_rows_io *io, int64_t r0, int64_t n) {
    const int32_t *off = (const int32_t *)io->w[2]->data;
    int32_t *loc = (int32_t *)io->w[3]->data;
    for (int64_t g = 0; g < io->w[2]->shape[0]; g++) {
        int64_t o = off[g] - r0;
        loc[g] = (int32_t)(o < 0 ? 0 : o > n ? n : o);
    }
    return io->w[3];
}
static dsk_status tt_rows_mm_grouped(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n) {
    return dsk_matmul_grouped(cx, &v[0], &v[1], 0, io->w[0], io->flag[1], tt_rows_offsets(io, r0, n), 1.0f, 0.0f);
}
static dsk_status tt_rows_swiglu_grouped(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n) {
    return dsk_swiglu_grouped(cx, &v[0], &v[1], &v[2], &v[3], &v[4], io->w[0], io->w[1], io->w[4],
                              tt_rows_offsets(io, r0, n));
}
static dsk_status tt_rows_swiglu_grouped_bwd(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n) {
    return dsk_swiglu_grouped_backward(cx, &v[0], io->w[5], io->w[6], io->w[7], &v[1], &v[2], &v[3], &v[4], &v[5],
                                       &v[6], &v[7], &v[8], io->w[0], io->w[1], io->w[4], tt_rows_offsets(io, r0, n));
}

/* Grouped products (dt) over 3 segments of M rows (one may be empty), cut along the rows: a
   row's bits do not depend on how many rows its segment has in the call. */
static void test_rows_grouped(dsk_dtype dt) {
    int64_t M = tt_rows_m(), G = 3, K = 29, N = 21, F = 19;
    int32_t *off;
    tt_rows_io io;
    char op[64];
    dsk_tensor *x = tt_rand(dt, 2, SH(M, K), -1, 1), *offs = tt_new(DSK_I32, 1, SH(G + 1));
    dsk_tensor *loc = tt_new(DSK_I32, 1, SH(G + 1));
    off = (int32_t *)offs->data;
    off[0] = 0;
    off[1] = (int32_t)(M / 3 + dsk_test_rand_int(5));
    off[2] = off[1] + (int32_t)dsk_test_rand_int(2) * (int32_t)(M / 4); /* segment 1 empty half the time */
    off[3] = (int32_t)M;
    for (int tb = 0; tb < 2; tb++) {
        memset(&io, 0, sizeof io);
        io.nout = 1; io.nt = 2; io.flag[1] = tb;
        io.t[0] = tt_new(dt, 2, SH(M, N)); io.t[1] = x;
        io.w[0] = tb ? tt_rand(dt, 3, SH(G, N, K), -1, 1) : tt_rand(dt, 3, SH(G, K, N), -1, 1);
        io.w[2] = offs; io.w[3] = loc;
        snprintf(op, sizeof op, "matmul_grouped %s trans_b %d", dsk_dtype_name(dt), tb);
        tt_rows_check(op, tt_rows_mm_grouped, &io);
    }
    memset(&io, 0, sizeof io);
    io.nout = 4; io.nt = 5;
    io.t[0] = tt_new(dt, 2, SH(M, K));
    for (int i = 1; i < 4; i++) io.t[i] = tt_new(dt, 2, SH(M, F));
    io.t[4] = x;
    io.w[0] = tt_rand(dt, 3, SH(G, F, K), -1, 1); io.w[1] = tt_rand(dt, 3, SH(G, K, F), -1, 1);
    io.w[4] = tt_rand(dt, 3, SH(G, F, K), -1, 1); io.w[2] = offs; io.w[3] = loc;
    snprintf(op, sizeof op, "swiglu_grouped %s", dsk_dtype_name(dt));
    tt_rows_check(op, tt_rows_swiglu_grouped, &io);
    {
        dsk_tensor *h1 = tt_new(dt, 2, SH(M, F)), *h3 = tt_new(dt, 2, SH(M, F)), *a = tt_new(dt, 2, SH(M, F));
        DSK_TEST_OK(dsk_swiglu_grouped(tt_cx, io.t[0], h1, h3, a, x, io.w[0], io.w[1], io.w[4], offs));
        memset(io.t, 0, sizeof io.t);
        io.nout = 4; io.nt = 9;
        io.t[0] = tt_new(dt, 2, SH(M, K)); /* dx written; da, dh1, dh3 scratch written */
        for (int i = 1; i < 4; i++) io.t[i] = tt_new(dt, 2, SH(M, F));
        io.t[4] = tt_rand(dt, 2, SH(M, K), -1, 1); io.t[5] = x; io.t[6] = h1; io.t[7] = h3; io.t[8] = a;
        io.w[5] = tt_new(DSK_F32, 3, SH(G, F, K)); /* dw1, dw2, dw3: sums over rows, not compared */
        io.w[6] = tt_new(DSK_F32, 3, SH(G, K, F));
        io.w[7] = tt_new(DSK_F32, 3, SH(G, F, K));
        snprintf(op, sizeof op, "swiglu_grouped_backward dx %s", dsk_dtype_name(dt));
        tt_rows_check(op, tt_rows_swiglu_grouped_bwd, &io);
    }
}

static dsk_status tt_rows_adamw(dsk_ctx *cx, tt_rows_io *io, dsk_tensor *v, int64_t r0, int64_t n) {
    dsk_adamw_opts o = dsk_adamw_defaults();
    (void)io; (void)r0; (void)n;
    o.lr = 0.01f;
    return dsk_adamw_step(cx, &v[0], &v[4], &v[1], &v[2], &o, 3, 0.5f, &v[3]);
}
/* AdamW over a flat array of L elements cut anywhere: an element's bits do not depend on the
   length of the array it is updated in (vector bodies and tails alike). */
static void test_rows_adamw(dsk_dtype gdt) {
    int64_t L = 40 + dsk_test_rand_int(30);
    tt_rows_io io;
    char op[64];
    memset(&io, 0, sizeof io);
    io.nout = 4; io.nt = 5;
    for (int i = 0; i < 3; i++) io.t[i] = tt_new(DSK_F32, 1, SH(L));
    io.t[3] = tt_new(DSK_BF16, 1, SH(L));
    io.init[0] = tt_rand(DSK_F32, 1, SH(L), -1, 1); io.init[1] = tt_rand(DSK_F32, 1, SH(L), -0.1, 0.1);
    io.init[2] = tt_rand(DSK_F32, 1, SH(L), 0, 0.01); io.init[3] = tt_rand(DSK_BF16, 1, SH(L), -1, 1);
    io.t[4] = tt_rand(gdt, 1, SH(L), -1, 1);
    snprintf(op, sizeof op, "adamw_step grad %s", dsk_dtype_name(gdt));
    tt_rows_check(op, tt_rows_adamw, &io);
}

/* Products of dt inputs on M rows: f32 C for every transpose and (K, N) (the direct nest, the
   packed one past 512 columns, K slices past 256 and 512), a dt C with beta too, and 150 to 299
   rows in chunks (past the packed nest's 144-row blocks). */
static void test_rows_matmuls(dsk_dtype dt) {
    static const int64_t kn[5][2] = {{5, 7}, {37, 19}, {70, 600}, {300, 37}, {600, 33}};
    for (int t = 0; t < 4; t++)
        for (int s = 0; s < 5; s++) test_rows_matmul(dt, DSK_F32, t >> 1, t & 1, 0, kn[s][0], kn[s][1], 0);
    test_rows_matmul(dt, dt, 0, 1, 0, 37, 19, 1);
    for (int t = 0; t < 4; t++) /* the trainer's row counts: 256 tokens in one call or 64 in each */
        test_rows_matmul(dt, DSK_F32, t >> 1, t & 1, 150 + dsk_test_rand_int(150), t & 1 ? 70 : 37, t & 1 ? 600 : 19,
                         0);
}

/* ------------------------------------------------------------------ main */

int main(void) {
    static const char *fmt_names[4] = {"bf16", "f16", "e4m3", "e5m2"};
    dsk_test_init("test_tensor");
    for (int w = 0; w < 4; w++) {
        TT_CASE("%s: every code decodes by definition and round-trips", fmt_names[w]);
        test_format_all_codes(w);
        TT_CASE("%s: f32 rounding against a nearest-even reference", fmt_names[w]);
        test_format_rounding(w);
    }
    TT_CASE("fp8 and half-precision edge values");
    test_fp8_definitions();
    TT_CASE("Philox4x32-10 known answers (Random123)");
    test_philox_known_answers();
    TT_CASE("RNG streams: offsets, formula, strided fill");
    test_rng_streams();
    TT_CASE("RNG moments (uniform, normal)");
    test_rng_moments();
    TT_CASE("status and dtype names, error messages"); test_names();
    TT_CASE("ctx options and errors"); test_ctx();
    TT_CASE("DSK_CPU_ISA: each name, auto, empty, unknown names, explicit options win, calls without a ctx follow");
    test_ctx_isa_env();
    TT_CASE("default threads: the cores / LOCAL_WORLD_SIZE without OMP_NUM_THREADS, OpenMP's with it");
    test_ctx_threads();
    TT_CASE("tensor alloc/wrap/free: errors, empty tensors, describe"); test_tensor_alloc_errors();
    TT_CASE("tensor sizes that overflow: alloc, wrap, reshape, slice name the shape"); test_tensor_size_overflow();
    TT_CASE("allocator accounting: live bytes, high-water mark, reset"); test_tensor_mem();
    for (int d = 0; d < DSK_DTYPE_COUNT; d++) {
        TT_CASE("fill %s: contiguous and strided views, every element", dsk_dtype_name((dsk_dtype)d));
        test_fill((dsk_dtype)d);
    }
    TT_CASE("views: reshape, slice, transpose, select");
    test_views();
    for (int d = 0; d < DSK_DTYPE_COUNT; d++) {
        TT_CASE("copy from %s to every dtype, contiguous and strided", dsk_dtype_name((dsk_dtype)d));
        test_copy_casts((dsk_dtype)d);
    }
    TT_CASE("contiguous f32/bf16/f16 copies give the element-wise cast's bits (random bit patterns)");
    test_copy_float_pieces();
    TT_CASE("strided same-dtype copy keeps int64 > 2^53 and NaN payloads"); test_copy_strided_exact();
    TT_CASE("same-dtype copy between column slices and from a broadcast view"); test_copy_rows();
    TT_CASE("copy rounding: f64 to bf16, u8, i32 (saturation, NaN)");
    test_copy_rounding();
    for (int t = 0; t < 4; t++) {
        TT_CASE("matmul f32 all shapes in {1,5,17,67,130}^3, trans_a %d trans_b %d", t >> 1, t & 1);
        test_matmul_shapes(t >> 1, t & 1);
    }
    test_matmul_variants();
    for (int d = 1; d < 3; d++)
        for (int t = 0; t < 4; t++) {
            TT_CASE("matmul %s shapes in {1,7,33,130}^3, batches, broadcast, trans_a %d trans_b %d", dsk_dtype_name(tt_floats[d]), t >> 1, t & 1);
            test_matmul_half_shapes(tt_floats[d], t >> 1, t & 1);
        }
    TT_CASE("matmul backward (dA, dB accumulated) vs finite differences");
    test_matmul_backward();
    TT_CASE("matmul K = 0 and alpha = 0");
    test_matmul_k0_and_alpha0();
    TT_CASE("sgemm bitwise identical with 1, 2, 3 threads");
    test_matmul_deterministic();
    TT_CASE("dsk_sgemm_cpu leading dimensions");
    test_sgemm_raw();
    for (int d = 0; d < 3; d++) {
        dsk_dtype dt = tt_floats[d];
        const char *n = dsk_dtype_name(dt);
        TT_CASE("add/mul/scale/axpy %s", n); test_elementwise(dt);
        TT_CASE("reduce sum/mean/max %s", n); test_reduce(dt);
        TT_CASE("softmax + backward %s", n); test_softmax(dt);
        TT_CASE("rmsnorm + backward %s", n); test_rmsnorm(dt);
        TT_CASE("silu, swiglu + backward %s", n); test_silu_swiglu(dt);
        TT_CASE("embedding + backward %s", n); test_embedding(dt);
        TT_CASE("gather_rows, scatter_add_rows %s", n); test_gather_scatter(dt);
        TT_CASE("cross_entropy %s", n); test_cross_entropy(dt);
        TT_CASE("rope + backward %s", n); test_rope(dt);
        TT_CASE("attention + backward %s", n); test_attention(dt);
        TT_CASE("attention (2, 67, 3, 16) %s vs float64, same bits on 1 and 2 threads", n); test_attention_threads(dt);
        TT_CASE("AdamW 6 steps, grad %s", n); test_adamw(dt, 0, 0);
    }
    TT_CASE("dsk_exp_f within 2 ulp of exp, specials; dsk_sigmoid_f"); test_exp();
    for (int i = DSK_CPU_ISA_PORTABLE; i <= DSK_CPU_ISA_AVX512; i++) {
        dsk_ctx cx;
        dsk_ctx_opts o;
        const char *n = dsk_cpu_isa_name((dsk_cpu_isa)i);
        memset(&o, 0, sizeof o);
        o.device = DSK_PREFER_CPU;
        o.cpu_isa = (dsk_cpu_isa)i;
        if (!dsk_cpu_isa_supported((dsk_cpu_isa)i)) {
            TT_CASE("%s kernels", n);
            DSK_TEST_STATUS(dsk_ctx_init(&cx, &o), DSK_ERR_UNSUPPORTED);
            dsk_test_skip("this CPU has no %s", n);
            continue;
        }
        DSK_TEST_OK(dsk_ctx_init(&cx, &o));
        tt_cx = &cx;
        tt_isa = (dsk_cpu_isa)i;
        TT_CASE("%s GEMM: direct and packed nests, edges, K slices, vs float64", n); test_gemm_paths();
        TT_CASE("%s GEMM: A^T in the direct nest, tall A^T in the packed nest, vs float64", n);
        test_gemm_blocking();
        TT_CASE("%s GEMM: same bits on 1, 2, 3 threads (direct and packed)", n); test_gemm_threads();
        TT_CASE("%s GEMM: a deep A^T (packed) has the bits of A in memory order (direct)", n);
        test_gemm_nest_bits();
        TT_CASE("%s matmul: a batch of small products in one parallel region, vs float64 and 1/2/3 threads", n);
        test_matmul_batched_small();
        TT_CASE("%s row primitives: exp, SwiGLU and rope bitwise the scalar math, the rest vs float64", n); test_row_kernels();
        TT_CASE("%s AdamW vs dsk_adamw_update, f32 and bf16 gradients, bf16 copy", n); test_adamw_isa();
        for (int d = 0; d < 2; d++) {
            const char *dn = dsk_dtype_name(tt_floats[d]);
            TT_CASE("%s matmul %s, every trans_a/trans_b, N and K off the tiles: each row's bits for any row count, "
                    "cut and thread count", n, dn);
            test_rows_matmuls(tt_floats[d]);
            TT_CASE("%s row ops %s (softmax, rmsnorm, silu, swiglu, cross-entropy, rope, gathers, axpy, forward and "
                    "backward): each row's bits for any row count, cut and thread count", n, dn);
            test_rows_ops(tt_floats[d]);
            TT_CASE("%s attention and fused attention %s + backward: each sequence's bits for any batch, cut and "
                    "thread count", n, dn);
            test_rows_attention(tt_floats[d], 0);
            test_rows_attention(tt_floats[d], 1);
            TT_CASE("%s matmul_grouped, swiglu_grouped + backward %s: each row's bits for any segment length", n, dn);
            test_rows_grouped(tt_floats[d]);
            TT_CASE("%s AdamW grad %s: each element's bits for any array length", n, dn);
            test_rows_adamw(tt_floats[d]);
        }
        if (i != (int)dsk_cpu_isa_auto()) /* the ISA of ctx NULL ran every op test above */
            for (int d = 0; d < 2; d++) {
                dsk_dtype dt = tt_floats[d];
                for (int t = 0; t < 4 && d == 0; t++) {
                    TT_CASE("%s matmul f32 all shapes in {1,5,17,67,130}^3, trans_a %d trans_b %d", n, t >> 1, t & 1);
                    test_matmul_shapes(t >> 1, t & 1);
                }
                if (d == 1) {
                    TT_CASE("%s matmul bf16 shapes in {1,7,33,130}^3, trans_a 1", n);
                    test_matmul_half_shapes(dt, 1, 0);
                }
                TT_CASE("%s add/mul/scale/axpy %s", n, dsk_dtype_name(dt)); test_elementwise(dt);
                TT_CASE("%s softmax + backward %s", n, dsk_dtype_name(dt)); test_softmax(dt);
                TT_CASE("%s rmsnorm + backward %s", n, dsk_dtype_name(dt)); test_rmsnorm(dt);
                TT_CASE("%s silu, swiglu + backward %s", n, dsk_dtype_name(dt)); test_silu_swiglu(dt);
                TT_CASE("%s cross_entropy %s", n, dsk_dtype_name(dt)); test_cross_entropy(dt);
                TT_CASE("%s rope + backward %s", n, dsk_dtype_name(dt)); test_rope(dt);
                TT_CASE("%s attention + backward %s", n, dsk_dtype_name(dt)); test_attention(dt);
                TT_CASE("%s attention (2, 67, 3, 16) %s, same bits on 1 and 2 threads", n, dsk_dtype_name(dt)); test_attention_threads(dt);
                TT_CASE("%s fused attention %s (2, 129, 1) Dk 64 Dv 32 vs float64", n, dsk_dtype_name(dt));
                test_attention_fused(dt, 2, 129, 1, 64, 32, 0);
                TT_CASE("%s fused attention %s (1, 200, 1): same bits on 1, 2, 3 threads", n, dsk_dtype_name(dt));
                test_attention_fused_threads(dt, 1);
            }
        tt_cx = NULL;
        tt_isa = DSK_CPU_ISA_AUTO;
        dsk_ctx_free(&cx);
    }
    TT_CASE("sum_squares f64 accumulation, thread-count independent"); test_sum_squares();
    TT_CASE("topk ties, NaN, k = 1 and k = C"); test_topk();
    TT_CASE("AdamW with bf16 param_copy"); test_adamw(DSK_F32, 1, 0);
    TT_CASE("AdamW with f16 param_copy, default options"); test_adamw(DSK_BF16, 2, 1);
    TT_CASE("AdamW options of 0 honoured: beta1, beta2 0, lr decaying to 0"); test_adamw(DSK_F32, 0, 2);
    TT_CASE("AdamW with bf16 moments against f64 of the rounding");
    test_adamw_bf16_moments();
    TT_CASE("embedding backward, rmsnorm dw, reduce: same bits on 1, 2, 3 threads"); test_reductions_thread_independent();
    TT_CASE("topk signed zeros, infinities, NaN"); test_topk_special();
    TT_CASE("AdamW (bf16 moments, f16 copy): same bits on 1 and 2 threads, 300 steps");
    test_adamw_threads();
    TT_CASE("group_by_key: stable counting sort, keys left out"); test_group_by_key();
    TT_CASE("swiglu_grouped + backward f32 (a thread per segment) vs float64"); test_swiglu_grouped(DSK_F32);
    TT_CASE("swiglu_grouped + backward bf16 (grouped GEMMs) vs float64"); test_swiglu_grouped(DSK_BF16);
    test_matmul_grouped();
    for (int d = 0; d < 3; d++) {
        TT_CASE("gather_rows_scaled %s: scaled, plain copies, zero rows", dsk_dtype_name(tt_floats[d]));
        test_gather_rows_scaled(tt_floats[d]);
    }
    for (int d = 1; d < 3; d++) {
        TT_CASE("axpy %s += f32", dsk_dtype_name(tt_floats[d]));
        test_axpy_mixed(tt_floats[d]);
    }
    TT_CASE("out of host memory"); test_out_of_memory();
    TT_CASE("errors: matmul"); test_errors_matmul();
    TT_CASE("errors: elementwise and reductions"); test_errors_elementwise();
    TT_CASE("errors: softmax, rmsnorm, activations"); test_errors_norms();
    TT_CASE("errors: indices (embedding, gather, scatter, cross_entropy)"); test_errors_indices();
    TT_CASE("errors: topk, rope, attention"); test_errors_topk_rope_attention();
    TT_CASE("errors: a backward's store neither add nor write, outputs kept");
    test_errors_grad_store();
    TT_CASE("errors: group_by_key, matmul_grouped, gather_rows_scaled"); test_errors_grouped();
    TT_CASE("errors: AdamW"); test_errors_adamw();
    for (int d = 0; d < 3; d++) {
        dsk_dtype dt = tt_floats[d];
        const char *n = dsk_dtype_name(dt);
        static const int64_t fa[6][6] = {{1, 1, 1, 32, 32, 0}, {2, 7, 3, 32, 32, 0}, {1, 129, 2, 64, 64, 0},
                                         {2, 129, 1, 64, 32, 0}, {1, 7, 2, 48, 16, 1}, {2, 70, 2, 32, 64, 1}};
        for (int c = 0; c < 6; c++) {
            const int64_t *f = fa[c];
            TT_CASE("fused attention %s (%lld, %lld, %lld) Dk %lld Dv %lld%s vs float64", n, (long long)f[0], (long long)f[1],
                    (long long)f[2], (long long)f[3], (long long)f[4], f[5] ? ", q/k/v slices of one projection" : "");
            test_attention_fused(dt, f[0], f[1], f[2], f[3], f[4], (int)f[5]);
        }
        TT_CASE("fused attention %s vs the materialised dsk_attention", n); test_attention_fused_vs_materialised(dt);
        TT_CASE("fused attention %s (1, 200, 2): same bits on 1, 2, 3 threads (one-pass and two-pass backward)", n);
        test_attention_fused_threads(dt, 2);
        TT_CASE("fused attention %s (1, 200, 1): same bits on 1, 2, 3 threads (one-pass and two-pass backward)", n);
        test_attention_fused_threads(dt, 1);
    }
    TT_CASE("attention (1, 700, 2, 64) f32 vs float64: score products wider than the direct GEMM nest"); test_attention_long();
    TT_CASE("errors: fused attention"); test_errors_attention_fused();
    TT_CASE("errors: CUDA tensors and devices"); test_errors_devices();
    TT_CASE("cuBLAS loaded on first use: not mapped before, every entry point, missing library or symbol");
    test_cublas_load();
    TT_CASE("gather_rows_scaled e4m3: plain copies of codes, zero rows");
    test_gather_rows_fp8(DSK_E4M3);
    TT_CASE("gather_rows_scaled e5m2: plain copies of codes, zero rows");
    test_gather_rows_fp8(DSK_E5M2);
    tt_release();
    return dsk_test_finish();
}
