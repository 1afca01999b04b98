/* dsk_test.h - the test harness shared by every tests/test_*.c program.

   A program is a list of cases. A case passes when every check inside it passes; checks
   print the worst element (index, got, want, relative error) when they fail. The program
   prints one totals line for scripts/run_tests.sh and exits non-zero on any failure.

       static void test_add(void) { ... DSK_TEST_CLOSE(got, want, n, 1e-6, 0, "add"); }
       int main(void) {
           dsk_test_init("test_tensor");
           DSK_TEST_RUN(test_add);                    // one case named "test_add"
           dsk_test_begin("matmul %dx%d", m, n); ... dsk_test_end();   // or name cases yourself
           return dsk_test_finish();
       }

   Inputs come from dsk_test_rand*() seeded by DSK_TEST_SEED (default fixed, printed), so
   every run is reproducible and `DSK_TEST_SEED=$RANDOM make test` gives fresh inputs.
   A case that cannot run here calls dsk_test_skip(reason): counted as skipped, never passed.
   A check that fails outside any case counts as a failed case. Only for tests: it prints;
   DSK_TEST_STATUS/OK and DSK_TEST_ERROR_MENTIONS need dsk_tensor.h, the rest no dsk code. */
#ifndef DSK_TEST_H
#define DSK_TEST_H

/* A test's own arithmetic (its inputs, its references, the golden records' recomputation) is written operation by
   operation, as the library's is: clang would contract a * b + c into one FMA by default (gcc does not in ISO C),
   and a test built by clang would then feed the layer other inputs than the golden records were made from. From
   here to the end of the including file, no contraction. */
#if defined(__clang__)
#pragma clang fp contract(off)
#endif

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct dsk_test_state {
    const char *program;
    char case_name[256];
    int in_case, case_failed, case_skipped;
    int passed, failed, skipped;
    int checks_failed_total;
    uint64_t rng;
    uint64_t seed;
    double case_start;
} dsk_test_state;

static dsk_test_state dsk_test_g;

static inline double dsk_test_now(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- random inputs (splitmix64; independent of the library's RNG on purpose) */
/* splitmix64's output for state z: a hash of z, for inputs drawn from their indices. */
static inline uint64_t dsk_test_mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static inline uint64_t dsk_test_rand_u64(void) {
    uint64_t z = dsk_test_mix64(dsk_test_g.rng);
    dsk_test_g.rng += 0x9E3779B97F4A7C15ull;
    return z;
}
/* Uniform in [lo, hi). */
static inline double dsk_test_rand(double lo, double hi) { return lo + (hi - lo) * (double)(dsk_test_rand_u64() >> 11) * (1.0 / 9007199254740992.0); }
/* Uniform integer in [0, n). */
static inline int64_t dsk_test_rand_int(int64_t n) { return n <= 0 ? 0 : (int64_t)(dsk_test_rand_u64() % (uint64_t)n); }
static inline double dsk_test_randn(void) {
    double u1 = dsk_test_rand(1e-300, 1.0), u2 = dsk_test_rand(0.0, 1.0);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}
static inline void dsk_test_fill_f32(float *p, int64_t n, double lo, double hi) { for (int64_t i = 0; i < n; i++) p[i] = (float)dsk_test_rand(lo, hi); }
static inline void dsk_test_fill_f64(double *p, int64_t n, double lo, double hi) { for (int64_t i = 0; i < n; i++) p[i] = dsk_test_rand(lo, hi); }
/* NaN-fill an output before the call under test, so unwritten elements fail the check. */
static inline void dsk_test_poison_f32(float *p, int64_t n) { for (int64_t i = 0; i < n; i++) p[i] = NAN; }
static inline void dsk_test_poison_bytes(void *p, size_t n) { memset(p, 0xA5, n); }

/* ---- cases */
static inline void dsk_test_init(const char *program) {
    const char *s = getenv("DSK_TEST_SEED");
    memset(&dsk_test_g, 0, sizeof dsk_test_g);
    dsk_test_g.program = program;
    dsk_test_g.seed = s && *s ? strtoull(s, NULL, 0) : 20261129ull;
    dsk_test_g.rng = dsk_test_g.seed;
    printf("# %s: seed %llu (set DSK_TEST_SEED to change)\n", program, (unsigned long long)dsk_test_g.seed);
    fflush(stdout);
}

static inline void dsk_test_end(void);
static inline void dsk_test_begin(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;
static inline void dsk_test_begin(const char *fmt, ...) {
    va_list ap;
    if (dsk_test_g.in_case) dsk_test_end();
    va_start(ap, fmt);
    vsnprintf(dsk_test_g.case_name, sizeof dsk_test_g.case_name, fmt, ap);
    va_end(ap);
    dsk_test_g.in_case = 1;
    dsk_test_g.case_failed = 0;
    dsk_test_g.case_skipped = 0;
    dsk_test_g.case_start = dsk_test_now();
}

static inline void dsk_test_end(void) {
    double ms = 1e3 * (dsk_test_now() - dsk_test_g.case_start);
    if (!dsk_test_g.in_case) return;
    dsk_test_g.in_case = 0;
    if (dsk_test_g.case_failed) {
        dsk_test_g.failed++;
        printf("FAIL %s (%.0f ms)\n", dsk_test_g.case_name, ms);
    } else if (dsk_test_g.case_skipped) {
        dsk_test_g.skipped++;
        printf("skip %s\n", dsk_test_g.case_name);
    } else {
        dsk_test_g.passed++;
        printf("ok   %s (%.0f ms)\n", dsk_test_g.case_name, ms);
    }
    fflush(stdout);
}

/* Marks the current case skipped (unless something in it already failed). */
static inline void dsk_test_skip(const char *fmt, ...) {
    va_list ap;
    char why[256];
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    dsk_test_g.case_skipped = 1;
    printf("     %s: skipped: %s\n", dsk_test_g.case_name, why);
}

/* A failed check inside a case fails the case; outside any case (setup in main, a helper run
   between cases) it counts as one failed case of its own, so it can never leave exit status 0. */
static inline void dsk_test_fail_at(const char *file, int line, const char *fmt, ...) {
    va_list ap;
    dsk_test_g.checks_failed_total++;
    if (dsk_test_g.in_case) {
        dsk_test_g.case_failed = 1;
        printf("     %s:%d: %s: ", file, line, dsk_test_g.case_name);
    } else {
        dsk_test_g.failed++;
        printf("FAIL %s:%d: outside any case: ", file, line);
    }
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
    fflush(stdout);
}

#define DSK_TEST_RUN(fn) do { dsk_test_begin("%s", #fn); fn(); dsk_test_end(); } while (0)

/* Prints the totals line and returns the exit status for main. */
static inline int dsk_test_finish(void) {
    if (dsk_test_g.in_case) dsk_test_end();
    printf("[%s] totals: %d passed / %d failed / %d skipped\n", dsk_test_g.program, dsk_test_g.passed, dsk_test_g.failed,
           dsk_test_g.skipped);
    fflush(stdout);
    return dsk_test_g.failed ? 1 : 0;
}

/* ---- checks */
#define DSK_TEST_EXPECT(cond, ...) \
    do { if (!(cond)) dsk_test_fail_at(__FILE__, __LINE__, "expected " #cond ": " __VA_ARGS__); } while (0)

/* Error of `g` against `w` in units of the allowed error atol + rtol * |w|: 0 when both are
   the same NaN or infinity, infinite when only one is non-finite (an unwritten, NaN-poisoned
   output fails), else |g - w| / allowed. */
static inline double dsk_test_err_ratio(double g, double w, double rtol, double atol) {
    double allow = atol + rtol * fabs(w);
    if ((g != g) || (w != w)) return (g != g) == (w != w) ? 0 : INFINITY;
    if (isinf(g) || isinf(w)) return g == w ? 0 : INFINITY;
    return fabs(g - w) / (allow > 0 ? allow : 1e-300);
}

/* Compares n values (f32 `gf` or f64 `gd`, exactly one non-NULL) with a float64 reference:
   |got - want| <= atol + rtol * |want|. Reports the count off and the worst element by
   (error / allowed). Returns 1 on success. */
static inline int dsk_test_close_any(const char *file, int line, const float *gf, const double *gd, const double *want, int64_t n,
                                     double rtol, double atol, const char *what) {
    int64_t worst = -1, bad = 0;
    double worst_ratio = 0;
    for (int64_t i = 0; i < n; i++) {
        double ratio = dsk_test_err_ratio(gf ? (double)gf[i] : gd[i], want[i], rtol, atol);
        if (ratio > 1.0) bad++;
        if (ratio > 1.0 && (worst < 0 || ratio > worst_ratio)) { worst_ratio = ratio; worst = i; }
    }
    if (bad == 0) return 1;
    {
        double g = gf ? (double)gf[worst] : gd[worst], w = want[worst];
        dsk_test_fail_at(file, line, "%s: %lld of %lld elements off; worst [%lld] got %.*g want %.17g rel err %.3g (rtol %.1g atol %.1g)",
                         what, (long long)bad, (long long)n, (long long)worst, gf ? 9 : 17, g, w,
                         fabs(g - w) / (fabs(w) > 0 ? fabs(w) : 1.0), rtol, atol);
    }
    return 0;
}
#define DSK_TEST_CLOSE(got, want, n, rtol, atol, what) dsk_test_close_any(__FILE__, __LINE__, got, NULL, want, n, rtol, atol, what)
#define DSK_TEST_CLOSE64(got, want, n, rtol, atol, what) dsk_test_close_any(__FILE__, __LINE__, NULL, got, want, n, rtol, atol, what)

/* Bitwise equality of two buffers; reports the first differing byte. */
static inline int dsk_test_same_bytes_at(const char *file, int line, const void *a, const void *b, size_t n, const char *what) {
    const unsigned char *x = (const unsigned char *)a, *y = (const unsigned char *)b;
    for (size_t i = 0; i < n; i++)
        if (x[i] != y[i]) {
            dsk_test_fail_at(file, line, "%s: first difference at byte %zu of %zu: %02x vs %02x", what, i, n, x[i], y[i]);
            return 0;
        }
    return 1;
}
#define DSK_TEST_SAME_BYTES(a, b, n, what) dsk_test_same_bytes_at(__FILE__, __LINE__, a, b, n, what)

/* A dsk call expected to return `want`; on mismatch prints both and dsk_last_error(). Use
   DSK_TEST_OK(call) for success. Requires dsk_tensor.h. */
#define DSK_TEST_STATUS(call, want)                                                                                     \
    do {                                                                                                                \
        dsk_status dsk_test_s_ = (call);                                                                                \
        if (dsk_test_s_ != (want))                                                                                      \
            dsk_test_fail_at(__FILE__, __LINE__, "%s returned %s, want %s (last error: %s)", #call,                     \
                             dsk_status_str(dsk_test_s_), dsk_status_str(want), dsk_last_error());                      \
    } while (0)
#define DSK_TEST_OK(call) DSK_TEST_STATUS(call, DSK_OK)

/* An error must name the function it came from and carry a message (checks `needle` in it). */
#define DSK_TEST_ERROR_MENTIONS(needle)                                                                                 \
    DSK_TEST_EXPECT(strstr(dsk_last_error(), (needle)) != NULL, "last error \"%s\" lacks \"%s\"", dsk_last_error(), (needle))

#endif /* DSK_TEST_H */
