/* test_fp8.c - the block-scaled FP8 GEMM of dsk_tensor.h (dsk_matmul_fp8, dsk_matmul_fp8_grouped)
   and the DeepSeek-V3 quantisation it reads (dsk_amp_fp8_block_quantize and its transposed form).
   Inputs are fresh random tensors (f32 or bf16, rows spread over 2^-6..2^6 so the scales differ),
   quantised by dsk_amp; outputs are NaN-poisoned before each call. Checks:
   - the GEMM against a float64 evaluation of the same codes and scales, within the bound that the
     chunk order gives (see fp8_bound), and bit for bit against the specified f32 arithmetic
     written out here as scalar loops (spec_value);
   - the rows contract: any row slice and any thread count give the same bits;
   - the grouped form: segments of 0, 1 and 129 rows, rows outside the segments untouched;
   - NaN and Inf in one block make exactly the outputs that read that block non-finite;
   - quantisation: every tile's scale is dsk_amp_fp8_block_scale of its amax, each element round
     trips within half an fp8 ulp, the transposed form equals the plain form on a transposed copy;
   - every bad argument gets DSK_ERR_ARG naming the function and the values. */
#include "dsk_tensor.h"
#include "dsk_amp.h"
#include "tests/dsk_test.h"

#define U32 (1.0 / 16777216.0) /* unit roundoff of f32, 2^-24 */

static dsk_tensor new_t(dsk_dtype dt, int nd, int64_t d0, int64_t d1, int64_t d2) {
    dsk_tensor t;
    int64_t s[3] = {d0, d1, d2};
    memset(&t, 0, sizeof t);
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &t, dt, nd, s));
    return t;
}
static dsk_tensor new_2d(dsk_dtype dt, int64_t r, int64_t c) { return new_t(dt, 2, r, c, 0); }
static void free_all(dsk_tensor **ts, int n) {
    for (int i = 0; i < n; i++) dsk_tensor_free(NULL, ts[i]);
}
static float get(const dsk_tensor *t, int64_t i) { return dsk_load_f32(t->data, t->dtype, i); }
static void poison(dsk_tensor *t) {
    for (int64_t i = 0, n = dsk_tensor_numel(t); i < n; i++) dsk_store_f32(t->data, t->dtype, i, NAN);
}

/* Normal values, each row times 2^u (u uniform in [-6, 6]), rounded to x's dtype. */
static void fill_rows(dsk_tensor *x) {
    int64_t R = x->shape[0], C = dsk_tensor_numel(x) / (R ? R : 1);
    for (int64_t r = 0; r < R; r++) {
        double m = pow(2.0, dsk_test_rand(-6.0, 6.0));
        for (int64_t c = 0; c < C; c++) dsk_store_f32(x->data, x->dtype, r * C + c, (float)(m * dsk_test_randn()));
    }
}

/* ---------------------------------------------------------------- quantisation checks */

/* Half an ulp of the fp8 format at |v| (v in the scaled domain): e4m3 has 3 mantissa bits and
   normals from 2^-6, e5m2 2 bits and normals from 2^-14. */
static double fp8_half_ulp(dsk_dtype fmt, double v) {
    int mb = fmt == DSK_E4M3 ? 3 : 2, emin = fmt == DSK_E4M3 ? -6 : -14;
    int e = v > 0 ? (int)floor(log2(v)) : emin;
    return 0.5 * ldexp(1.0, (e < emin ? emin : e) - mb);
}

/* q (QR, QC) with scales in (br, bc) blocks quantises x, read at x[xi(i, j)]: each scale is
   dsk_amp_fp8_block_scale(block amax) and each element dequantises within half an fp8 ulp (of
   the scaled value; plus the f32 division's rounding). trans: x is (QC, QR). */
static void check_quant(const dsk_tensor *q, const dsk_tensor *sc, const dsk_tensor *x, int br, int bc, int trans) {
    int64_t QR = q->shape[0], QC = q->shape[1], SC = sc->shape[1], bad = 0;
    float fmax = q->dtype == DSK_E4M3 ? DSK_E4M3_MAX : DSK_E5M2_MAX;
    for (int64_t b = 0; b < sc->shape[0] * SC; b++) {
        int64_t i0 = b / SC * br, j0 = b % SC * bc;
        float am = 0.0f, want, got = ((const float *)sc->data)[b];
        for (int64_t i = i0; i < i0 + br && i < QR; i++)
            for (int64_t j = j0; j < j0 + bc && j < QC; j++)
                am = fmaxf(am, fabsf(get(x, trans ? j * QR + i : i * QC + j)));
        want = dsk_amp_fp8_block_scale(am, fmax, 0);
        if (dsk_f32_bits(got) != dsk_f32_bits(want) && !bad++)
            DSK_TEST_EXPECT(0, "block %lld: scale %.9g, want dsk_amp_fp8_block_scale(%.9g) = %.9g", (long long)b,
                            (double)got, (double)am, (double)want);
    }
    for (int64_t i = 0; i < QR; i++)
        for (int64_t j = 0; j < QC; j++) {
            double xv = get(x, trans ? j * QR + i : i * QC + j), d = ((const float *)sc->data)[(i / br) * SC + j / bc];
            double y = get(q, i * QC + j) * d, v = fabs(xv) / d;
            if (!(fabs(y - xv) <= d * (fp8_half_ulp(q->dtype, v) + v * U32) * (1 + 1e-9)) && !bad++)
                DSK_TEST_EXPECT(0, "q[%lld,%lld]: x %.9g -> %.9g with scale %.9g", (long long)i, (long long)j, xv, y,
                                d);
        }
    DSK_TEST_EXPECT(bad == 0, "%lld bad scales or elements", (long long)bad);
}

/* The transposed quantisation equals the plain one of a transposed copy, bit for bit, and
   passes check_quant. */
static void test_quant_t(dsk_dtype xdt, dsk_dtype fmt, int64_t R, int64_t C, int br, int bc) {
    int64_t SR = (C + br - 1) / br, SC = (R + bc - 1) / bc;
    dsk_tensor x = new_2d(xdt, R, C), xt = new_2d(xdt, C, R), q = new_2d(fmt, C, R), s = new_2d(DSK_F32, SR, SC);
    dsk_tensor q2 = new_2d(fmt, C, R), s2 = new_2d(DSK_F32, SR, SC), view;
    dsk_tensor *all[6] = {&x, &xt, &q, &s, &q2, &s2};
    fill_rows(&x);
    DSK_TEST_OK(dsk_tensor_transpose(&x, 0, 1, &view));
    DSK_TEST_OK(dsk_tensor_copy(NULL, &xt, &view));
    dsk_test_poison_bytes(q.data, dsk_tensor_nbytes(&q));
    poison(&s);
    DSK_TEST_OK(dsk_amp_fp8_block_quantize_t(NULL, &q, &s, &x, br, bc, 0));
    DSK_TEST_OK(dsk_amp_fp8_block_quantize(NULL, &q2, &s2, &xt, br, bc, 0));
    DSK_TEST_SAME_BYTES(q.data, q2.data, dsk_tensor_nbytes(&q), "codes of x^T");
    DSK_TEST_SAME_BYTES(s.data, s2.data, dsk_tensor_nbytes(&s), "scales of x^T");
    check_quant(&q, &s, &x, br, bc, 1);
    free_all(all, 6);
}

/* A NaN and an Inf in x: the tiles of x^T holding them get non-finite scales and dequantise to
   NaN everywhere; the other tiles stay finite. */
static void test_quant_t_nonfinite(void) {
    const int64_t R = 300, C = 5;
    dsk_tensor x = new_2d(DSK_F32, R, C), q = new_2d(DSK_E4M3, C, R), y = new_2d(DSK_F32, C, R);
    dsk_tensor s = new_2d(DSK_F32, C, 3), *all[4] = {&x, &q, &s, &y};
    fill_rows(&x);
    ((float *)x.data)[200 * C + 1] = NAN;    /* x^T row 1, tile 1 */
    ((float *)x.data)[7 * C + 4] = INFINITY; /* x^T row 4, tile 0 */
    poison(&s);
    DSK_TEST_OK(dsk_amp_fp8_block_quantize_t(NULL, &q, &s, &x, 1, 128, 0));
    DSK_TEST_OK(dsk_amp_fp8_block_dequantize(NULL, &y, &q, &s, 1, 128));
    for (int64_t i = 0; i < C; i++)
        for (int64_t t = 0; t < 3; t++) {
            int hit = (i == 1 && t == 1) || (i == 4 && t == 0), finite = 0;
            for (int64_t j = t * 128; j < R && j < (t + 1) * 128; j++) finite += isfinite(get(&y, i * R + j)) != 0;
            DSK_TEST_EXPECT(hit ? finite == 0 && !isfinite(get(&s, i * 3 + t)) : finite == (t < 2 ? 128 : 44),
                            "x^T row %lld tile %lld: %d finite values, scale %g", (long long)i, (long long)t, finite,
                            (double)get(&s, i * 3 + t));
        }
    free_all(all, 4);
}

/* ---------------------------------------------------------------- the GEMM's references */

/* One operand as the GEMM reads it: codes (rows, K) and scales with `rows_per` rows per scale. */
typedef struct opnd {
    const dsk_tensor *q, *s;
    int rows_per;
    int64_t row0; /* first row of q (and of the scale layout) this operand starts at */
} opnd;

static float code(const opnd *o, int64_t r, int64_t k) {
    return get(o->q, (o->row0 + r) * o->q->shape[o->q->ndim - 1] + k);
}
static float scale_of(const opnd *o, int64_t r, int64_t c) {
    int64_t kc = o->s->shape[o->s->ndim - 1];
    return ((const float *)o->s->data)[((o->row0 + r) / o->rows_per) * kc + c];
}

/* C[i,j] by the specified f32 arithmetic over k in [klo, khi), written out: per 128-chunk of the
   scales' grid (cut to the range) a k-ascending f32 dot, then acc = fmaf(dot, sa * sb, acc);
   then alpha, beta as dsk_fp8_out. */
static float spec_value(const opnd *a, const opnd *b, int64_t i, int64_t j, int64_t klo, int64_t khi, float alpha,
                        float beta, float old) {
    float acc = 0.0f, v;
    for (int64_t k0 = klo; k0 < khi; k0 = (k0 / 128 + 1) * 128) {
        float dot = 0.0f;
        for (int64_t k = k0; k < khi && k < (k0 / 128 + 1) * 128; k++) dot += code(a, i, k) * code(b, j, k);
        acc = fmaf(dot, scale_of(a, i, k0 / 128) * scale_of(b, j, k0 / 128), acc);
    }
    v = alpha * acc;
    return beta != 0.0f ? fmaf(beta, old, v) : v;
}

/* C[i,j] in f64 from the same codes and scales, and the bound of the f32 result's error:
   within a chunk, n <= 128 exact products summed in order cost at most (n - 1) u of the chunk's
   mass sum |a b|; the scale product sa * sb rounds once (u); each chunk's fmaf into acc rounds
   once, at most u of the mass so far; alpha * acc and the beta fmaf round once each. So
   |C - ref| <= (n_max + n_chunks + 2) u (|alpha| mass + |beta old|), mass = sum over chunks of
   |sa sb| sum |a b| (first order in u = 2^-24; the factor 1.001 covers the second). */
static double ref_value(const opnd *a, const opnd *b, int64_t i, int64_t j, int64_t klo, int64_t khi, float alpha,
                        float beta, float old, double *bound) {
    double acc = 0.0, mass = 0.0;
    int64_t nc = 0, nmax = khi - klo < 128 ? khi - klo : 128;
    for (int64_t k0 = klo; k0 < khi; k0 = (k0 / 128 + 1) * 128, nc++) {
        double dot = 0.0, m = 0.0, s = (double)scale_of(a, i, k0 / 128) * scale_of(b, j, k0 / 128);
        for (int64_t k = k0; k < khi && k < (k0 / 128 + 1) * 128; k++) {
            double p = (double)code(a, i, k) * code(b, j, k);
            dot += p;
            m += fabs(p);
        }
        acc += dot * s;
        mass += m * fabs(s);
    }
    *bound = (double)(nmax + nc + 2) * U32 * (fabs(alpha) * mass + fabs((double)beta * old)) * 1.001 + 1e-37;
    return alpha * acc + (beta != 0.0f ? (double)beta * old : 0.0);
}

/* An f16 C may overflow to Inf where the value, within the bound, reaches f16's rounding limit. */
static int f16_overflow(dsk_dtype dt, float got, double ref, double bound) {
    return dt == DSK_F16 && isinf(got) && (got > 0) == (ref > 0) && fabs(ref) + bound >= 65520.0;
}

/* Rows [r0, r1) of C (N columns) against both references; `old` holds C before the call. */
static void check_rows(const dsk_tensor *C, const dsk_tensor *old, const opnd *a, const opnd *b, int64_t r0, int64_t r1,
                       int64_t K, float alpha, float beta, const char *what) {
    int64_t N = C->shape[1], bad_spec = 0, bad_ref = 0;
    for (int64_t i = r0; i < r1; i++)
        for (int64_t j = 0; j < N; j++) {
            float o = beta != 0.0f ? get(old, i * N + j) : 0.0f, got = get(C, i * N + j);
            float want = dsk_round_f32(C->dtype, spec_value(a, b, i - r0, j, 0, K, alpha, beta, o));
            double bound, ref = ref_value(a, b, i - r0, j, 0, K, alpha, beta, o, &bound);
            if (C->dtype != DSK_F32) /* one more rounding: half an ulp, relative (and f16's subnormal step) */
                bound += fabs(ref) * (C->dtype == DSK_BF16 ? 1.0 / 256 : 1.0 / 2048) + 3e-8;
            if (dsk_f32_bits(got) != dsk_f32_bits(want) && !bad_spec++)
                DSK_TEST_EXPECT(0, "%s: C[%lld,%lld] %.9g, the specified arithmetic gives %.9g", what, (long long)i,
                                (long long)j, (double)got, (double)want);
            if (!(fabs(got - ref) <= bound || f16_overflow(C->dtype, got, ref, bound)) && !bad_ref++)
                DSK_TEST_EXPECT(0, "%s: C[%lld,%lld] %.9g, f64 %.9g, bound %.3g", what, (long long)i, (long long)j,
                                (double)got, ref, bound);
        }
    DSK_TEST_EXPECT(bad_spec == 0 && bad_ref == 0, "%s: %lld off the specified bits, %lld outside the bound", what,
                    (long long)bad_spec, (long long)bad_ref);
}

/* x (rows, K) of dtype xdt quantised in (rows_per x 128) blocks into q (fmt) and s. */
static void quantise(dsk_tensor *x, dsk_tensor *q, dsk_tensor *s, dsk_dtype xdt, dsk_dtype fmt, int64_t rows, int64_t K,
                     int rows_per) {
    *x = new_2d(xdt, rows, K);
    *q = new_2d(fmt, rows, K);
    *s = new_2d(DSK_F32, (rows + rows_per - 1) / rows_per, (K + 127) / 128);
    fill_rows(x);
    poison(s);
    DSK_TEST_OK(dsk_amp_fp8_block_quantize(NULL, q, s, x, rows_per, 128, 0));
    check_quant(q, s, x, rows_per, 128, 0);
}

/* ---------------------------------------------------------------- GEMM cases */

/* C (M, N) = alpha A B^T + beta C against both references; then the rows contract: rows
   [3, M - 2) computed alone, and the whole product on one thread, give the same bits. */
static void test_gemm(int64_t M, int64_t N, int64_t K, dsk_dtype fa, dsk_dtype fb, int a_rows, int b_rows,
                      dsk_dtype cdt, float alpha, float beta) {
    dsk_tensor x, qa, sa, w, qb, sb, C = new_2d(cdt, M, N), old = new_2d(cdt, M, N), C1 = new_2d(cdt, M, N);
    dsk_tensor *all[9] = {&x, &qa, &sa, &w, &qb, &sb, &C, &old, &C1};
    opnd a, b;
    dsk_ctx one;
    dsk_ctx_opts o;
    quantise(&x, &qa, &sa, DSK_F32, fa, M, K, a_rows);
    quantise(&w, &qb, &sb, DSK_BF16, fb, N, K, b_rows);
    if (beta != 0.0f) fill_rows(&C);
    else poison(&C);
    DSK_TEST_OK(dsk_tensor_copy(NULL, &old, &C));
    DSK_TEST_OK(dsk_tensor_copy(NULL, &C1, &C));
    DSK_TEST_OK(
        dsk_matmul_fp8(NULL, &C, &qa, &sa, (dsk_fp8_scaling)a_rows, &qb, &sb, (dsk_fp8_scaling)b_rows, alpha, beta));
    a.q = &qa;
    a.s = &sa;
    a.rows_per = a_rows;
    a.row0 = 0;
    b.q = &qb;
    b.s = &sb;
    b.rows_per = b_rows;
    b.row0 = 0;
    check_rows(&C, &old, &a, &b, 0, M, K, alpha, beta, "C");
    memset(&o, 0, sizeof o);
    o.device = DSK_PREFER_CPU;
    o.n_threads = 1;
    DSK_TEST_OK(dsk_ctx_init(&one, &o));
    DSK_TEST_OK(
        dsk_matmul_fp8(&one, &C1, &qa, &sa, (dsk_fp8_scaling)a_rows, &qb, &sb, (dsk_fp8_scaling)b_rows, alpha, beta));
    DSK_TEST_SAME_BYTES(C1.data, C.data, dsk_tensor_nbytes(&C), "one thread vs the default threads");
    dsk_ctx_free(&one);
    if (M > 5 && a_rows == 1) { /* rows [3, M - 2) alone: A's rows and their scales sliced */
        dsk_tensor qs, ss, cs, os;
        DSK_TEST_OK(dsk_tensor_slice(&qa, 0, 3, M - 5, &qs));
        DSK_TEST_OK(dsk_tensor_slice(&sa, 0, 3, M - 5, &ss));
        DSK_TEST_OK(dsk_tensor_slice(&C1, 0, 3, M - 5, &cs));
        DSK_TEST_OK(dsk_tensor_slice(&old, 0, 3, M - 5, &os));
        DSK_TEST_OK(dsk_tensor_copy(NULL, &cs, &os));
        DSK_TEST_OK(
            dsk_matmul_fp8(NULL, &cs, &qs, &ss, DSK_FP8_TILE_1X128, &qb, &sb, (dsk_fp8_scaling)b_rows, alpha, beta));
        DSK_TEST_SAME_BYTES(cs.data, (char *)C.data + dsk_tensor_nbytes(&cs) / (size_t)(M - 5) * 3,
                            dsk_tensor_nbytes(&cs), "rows 3.. alone vs in the whole product");
    }
    free_all(all, 9);
}

/* Segments of 0, 1, 129, 0 and 5 rows from row 2 of R = 140 (rows 0, 1 and 137.. outside):
   each segment's rows against both references and bit for bit against dsk_matmul_fp8 of the
   segment with B[g]; the rows outside keep their poison. */
static void test_grouped(int b_rows, dsk_dtype fb, dsk_dtype cdt) {
    const int64_t R = 140, N = 33, K = 200, G = 5, nb = b_rows == 1 ? N : 1;
    const int32_t offs[6] = {2, 2, 3, 132, 132, 137};
    dsk_tensor x, qa, sa, w = new_t(DSK_F32, 3, G, N, K), qb = new_t(fb, 3, G, N, K), sb = new_t(DSK_F32, 3, G, nb, 2);
    dsk_tensor off = new_t(DSK_I32, 1, G + 1, 0, 0), C = new_2d(cdt, R, N), C1 = new_2d(cdt, R, N);
    dsk_tensor old = new_2d(cdt, R, N);
    dsk_tensor *all[10] = {&x, &qa, &sa, &w, &qb, &sb, &off, &C, &C1, &old};
    int64_t outside = 0;
    quantise(&x, &qa, &sa, DSK_BF16, DSK_E4M3, R, K, 1);
    fill_rows(&w);
    memcpy(off.data, offs, sizeof offs);
    for (int64_t g = 0; g < G; g++) {
        dsk_tensor wg, qg, sg;
        DSK_TEST_OK(dsk_tensor_select(&w, g, &wg));
        DSK_TEST_OK(dsk_tensor_select(&qb, g, &qg));
        DSK_TEST_OK(dsk_tensor_select(&sb, g, &sg));
        DSK_TEST_OK(dsk_amp_fp8_block_quantize(NULL, &qg, &sg, &wg, b_rows, 128, 0));
    }
    poison(&C);
    DSK_TEST_OK(dsk_tensor_copy(NULL, &old, &C));
    DSK_TEST_OK(dsk_matmul_fp8_grouped(NULL, &C, &qa, &sa, &qb, &sb, (dsk_fp8_scaling)b_rows, &off, 1.0f, 0.0f));
    for (int64_t r = 0; r < R; r++)
        if (r < offs[0] || r >= offs[G])
            for (int64_t j = 0; j < N; j++) outside += !isnan(get(&C, r * N + j));
    DSK_TEST_EXPECT(outside == 0, "%lld elements of rows outside the segments were written", (long long)outside);
    for (int64_t g = 0; g < G; g++) {
        int64_t r0 = offs[g], n = offs[g + 1] - offs[g];
        dsk_tensor qg, sg, as, ss, cs;
        opnd a, b;
        char what[48];
        if (n == 0) continue;
        DSK_TEST_OK(dsk_tensor_select(&qb, g, &qg));
        DSK_TEST_OK(dsk_tensor_select(&sb, g, &sg));
        a.q = &qa;
        a.s = &sa;
        a.rows_per = 1;
        a.row0 = r0;
        b.q = &qg;
        b.s = &sg;
        b.rows_per = b_rows;
        b.row0 = 0;
        snprintf(what, sizeof what, "segment %lld (%lld rows)", (long long)g, (long long)n);
        check_rows(&C, &old, &a, &b, r0, r0 + n, K, 1.0f, 0.0f, what);
        DSK_TEST_OK(dsk_tensor_slice(&qa, 0, r0, n, &as));
        DSK_TEST_OK(dsk_tensor_slice(&sa, 0, r0, n, &ss));
        DSK_TEST_OK(dsk_tensor_slice(&C1, 0, r0, n, &cs));
        DSK_TEST_OK(
            dsk_matmul_fp8(NULL, &cs, &as, &ss, DSK_FP8_TILE_1X128, &qg, &sg, (dsk_fp8_scaling)b_rows, 1.0f, 0.0f));
        DSK_TEST_SAME_BYTES(cs.data, (const char *)C.data + (size_t)(r0 * N) * dsk_dtype_size(cdt),
                            dsk_tensor_nbytes(&cs), what);
    }
    free_all(all, 10);
}

/* The weights form: dw[g] = dy[seg g]^T x[seg g] from dy^T and x^T quantised whole (tiles on
   the grid of 128 tokens from row 0; segments of 0, 1, 129, 0 and 155 tokens from token 5, so
   boundaries cut tiles and tokens 0..4 and 290.. lie outside). Each C[g] against both references
   over its tokens; the empty segments give beta * C[g]. */
static void test_grouped_weights(int b_rows, dsk_dtype cdt, float beta) {
    const int64_t R = 300, M = 37, N = 70, G = 5, SB = b_rows == 1 ? N : 1;
    const int32_t offs[6] = {5, 5, 6, 135, 135, 290};
    dsk_tensor dy = new_2d(DSK_BF16, R, M), x = new_2d(DSK_F32, R, N), qa = new_2d(DSK_E4M3, M, R);
    dsk_tensor sa = new_2d(DSK_F32, M, 3), qb = new_2d(DSK_E4M3, N, R), sb = new_2d(DSK_F32, SB, 3);
    dsk_tensor off = new_t(DSK_I32, 1, G + 1, 0, 0), C = new_t(cdt, 3, G, M, N), old = new_t(cdt, 3, G, M, N);
    dsk_tensor *all[9] = {&dy, &x, &qa, &sa, &qb, &sb, &off, &C, &old};
    int64_t bad_spec = 0, bad_ref = 0;
    opnd a, b;
    fill_rows(&dy);
    fill_rows(&x);
    DSK_TEST_OK(dsk_amp_fp8_block_quantize_t(NULL, &qa, &sa, &dy, 1, 128, 0));
    DSK_TEST_OK(dsk_amp_fp8_block_quantize_t(NULL, &qb, &sb, &x, b_rows, 128, 0));
    memcpy(off.data, offs, sizeof offs);
    if (beta != 0.0f) fill_rows(&C);
    else poison(&C);
    DSK_TEST_OK(dsk_tensor_copy(NULL, &old, &C));
    DSK_TEST_OK(dsk_matmul_fp8_grouped(NULL, &C, &qa, &sa, &qb, &sb, (dsk_fp8_scaling)b_rows, &off, 1.0f, beta));
    a.q = &qa;
    a.s = &sa;
    a.rows_per = 1;
    a.row0 = 0;
    b.q = &qb;
    b.s = &sb;
    b.rows_per = b_rows;
    b.row0 = 0;
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) {
                int64_t e = (g * M + i) * N + j;
                float o = beta != 0.0f ? get(&old, e) : 0.0f, got = get(&C, e);
                float want = dsk_round_f32(cdt, spec_value(&a, &b, i, j, offs[g], offs[g + 1], 1.0f, beta, o));
                double bound, ref = ref_value(&a, &b, i, j, offs[g], offs[g + 1], 1.0f, beta, o, &bound);
                if (cdt != DSK_F32) bound += fabs(ref) / 256;
                if (dsk_f32_bits(got) != dsk_f32_bits(want) && !bad_spec++)
                    DSK_TEST_EXPECT(0, "C[%lld][%lld,%lld] %.9g, the specified arithmetic gives %.9g", (long long)g,
                                    (long long)i, (long long)j, (double)got, (double)want);
                if (!(fabs(got - ref) <= bound) && !bad_ref++)
                    DSK_TEST_EXPECT(0, "C[%lld][%lld,%lld] %.9g, f64 %.9g, bound %.3g", (long long)g, (long long)i,
                                    (long long)j, (double)got, ref, bound);
            }
    DSK_TEST_EXPECT(bad_spec == 0 && bad_ref == 0, "%lld off the specified bits, %lld outside the bound",
                    (long long)bad_spec, (long long)bad_ref);
    free_all(all, 9);
}

/* NaN in row 3's second tile and Inf in row 7's first tile of A, -Inf in B's block (1, 0) (rows
   128..159): exactly rows 3 and 7 and columns 128..159 of C are non-finite. */
static void test_nonfinite(dsk_dtype fb) {
    const int64_t M = 9, N = 160, K = 200;
    dsk_tensor x = new_2d(DSK_F32, M, K), qa = new_2d(DSK_E4M3, M, K), sa = new_2d(DSK_F32, M, 2);
    dsk_tensor w = new_2d(DSK_F32, N, K), qb = new_2d(fb, N, K), sb = new_2d(DSK_F32, 2, 2), C = new_2d(DSK_F32, M, N);
    dsk_tensor *all[7] = {&x, &qa, &sa, &w, &qb, &sb, &C};
    int64_t wrong = 0;
    fill_rows(&x);
    fill_rows(&w);
    ((float *)x.data)[3 * K + 150] = NAN;
    ((float *)x.data)[7 * K + 10] = INFINITY;
    ((float *)w.data)[140 * K + 20] = -INFINITY;
    DSK_TEST_OK(dsk_amp_fp8_block_quantize(NULL, &qa, &sa, &x, 1, 128, 0));
    DSK_TEST_OK(dsk_amp_fp8_block_quantize(NULL, &qb, &sb, &w, 128, 128, 0));
    poison(&C);
    DSK_TEST_OK(dsk_matmul_fp8(NULL, &C, &qa, &sa, DSK_FP8_TILE_1X128, &qb, &sb, DSK_FP8_BLOCK_128X128, 1.0f, 0.0f));
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            int hit = i == 3 || i == 7 || j >= 128;
            if ((isfinite(get(&C, i * N + j)) != 0) == hit && !wrong++)
                DSK_TEST_EXPECT(0, "C[%lld,%lld] = %g", (long long)i, (long long)j, (double)get(&C, i * N + j));
        }
    DSK_TEST_EXPECT(wrong == 0, "%lld elements finite where they read a non-finite block or the reverse",
                    (long long)wrong);
    free_all(all, 7);
}

/* ---------------------------------------------------------------- bad arguments */

#define BAD(call, needle) \
    do { \
        DSK_TEST_STATUS(call, DSK_ERR_ARG); \
        DSK_TEST_ERROR_MENTIONS(needle); \
    } while (0)

static void test_bad_args(void) {
    dsk_tensor qa = new_2d(DSK_E4M3, 4, 200), sa = new_2d(DSK_F32, 4, 2), qb = new_2d(DSK_E4M3, 6, 200);
    dsk_tensor sb = new_2d(DSK_F32, 1, 2), C = new_2d(DSK_F32, 4, 6), f = new_2d(DSK_F32, 4, 200);
    dsk_tensor sa1 = new_2d(DSK_F32, 4, 1), Cb = new_2d(DSK_I32, 4, 6), s16 = new_2d(DSK_BF16, 4, 2);
    dsk_tensor C5 = new_2d(DSK_F32, 4, 5);
    dsk_tensor qg = new_t(DSK_E4M3, 3, 2, 6, 200), sg = new_t(DSK_F32, 3, 2, 1, 2), off = new_t(DSK_I32, 1, 3, 0, 0);
    dsk_tensor off16 = new_t(DSK_I64, 1, 3, 0, 0), sg6 = new_t(DSK_F32, 3, 2, 6, 2), x = new_2d(DSK_F32, 300, 5);
    dsk_tensor qt = new_2d(DSK_E4M3, 5, 300), st = new_2d(DSK_F32, 5, 3), st2 = new_2d(DSK_F32, 5, 2), tv;
    dsk_tensor v1 = new_t(DSK_F32, 1, 8, 0, 0);
    dsk_tensor *all[20] = {&qa, &sa, &qb,  &sb,    &C,   &f, &sa1, &Cb, &s16, &C5,
                           &qg, &sg, &off, &off16, &sg6, &x, &qt,  &st, &st2, &v1};
    const dsk_fp8_scaling T = DSK_FP8_TILE_1X128, B = DSK_FP8_BLOCK_128X128;
    int32_t o[3] = {0, 3, 4};
    memcpy(off.data, o, sizeof o);
    /* NULL */
    BAD(dsk_matmul_fp8(NULL, NULL, &qa, &sa, T, &qb, &sb, B, 1, 0), "dsk_matmul_fp8: C is NULL");
    BAD(dsk_matmul_fp8(NULL, &C, NULL, &sa, T, &qb, &sb, B, 1, 0), "dsk_matmul_fp8: A is NULL");
    BAD(dsk_matmul_fp8(NULL, &C, &qa, NULL, T, &qb, &sb, B, 1, 0), "dsk_matmul_fp8: a_scales is NULL");
    BAD(dsk_matmul_fp8(NULL, &C, &qa, &sa, T, NULL, &sb, B, 1, 0), "dsk_matmul_fp8: B is NULL");
    BAD(dsk_matmul_fp8(NULL, &C, &qa, &sa, T, &qb, NULL, B, 1, 0), "dsk_matmul_fp8: b_scales is NULL");
    BAD(dsk_matmul_fp8_grouped(NULL, &C, &qa, &sa, &qg, &sg, B, NULL, 1, 0), "dsk_matmul_fp8_grouped: offsets is NULL");
    /* dtypes */
    BAD(dsk_matmul_fp8(NULL, &C, &f, &sa, T, &qb, &sb, B, 1, 0), "A [4,200] f32: dtype must be e4m3 or e5m2");
    BAD(dsk_matmul_fp8(NULL, &C, &qa, &sa, T, &f, &sb, B, 1, 0), "B [4,200] f32: dtype must be e4m3 or e5m2");
    BAD(dsk_matmul_fp8(NULL, &Cb, &qa, &sa, T, &qb, &sb, B, 1, 0), "C [4,6] i32: dtype must be f32, bf16 or f16");
    BAD(dsk_matmul_fp8(NULL, &C, &qa, &s16, T, &qb, &sb, B, 1, 0), "a_scales [4,2] bf16: dtype must be f32");
    BAD(dsk_matmul_fp8_grouped(NULL, &C, &qa, &sa, &qg, &sg, B, &off16, 1, 0), "offsets [3] i64: dtype must be i32");
    /* shapes */
    BAD(dsk_matmul_fp8(NULL, &C5, &qa, &sa, T, &qb, &sb, B, 1, 0),
        "C [4,5] f32, A [4,200] e4m3, B [6,200] e4m3: want C (M, N) = A (M, K) B (N, K)^T");
    BAD(dsk_matmul_fp8(NULL, &C, &qa, &sa, T, &qg, &sb, B, 1, 0), "B [2,6,200] e4m3 must have 2 dims");
    BAD(dsk_matmul_fp8(NULL, &C, &qa, &sa, (dsk_fp8_scaling)7, &qb, &sb, B, 1, 0),
        "a_scaling 7 is neither DSK_FP8_TILE_1X128 (1) nor DSK_FP8_BLOCK_128X128 (128)");
    BAD(dsk_matmul_fp8(NULL, &C, &qa, &sa, T, &qb, &sb, (dsk_fp8_scaling)0, 1, 0), "b_scaling 0 is neither");
    DSK_TEST_OK(dsk_tensor_transpose(&C, 0, 1, &tv));
    BAD(dsk_matmul_fp8(NULL, &tv, &qa, &sa, T, &qb, &sb, B, 1, 0), "C [6,4] f32 is not contiguous");
    /* scale shapes */
    BAD(dsk_matmul_fp8(NULL, &C, &qa, &sa1, T, &qb, &sb, B, 1, 0),
        "a_scales [4,1] f32, want [4,2] f32 for A [4,200] e4m3 in 1x128 tiles");
    BAD(dsk_matmul_fp8(NULL, &C, &qa, &sa, B, &qb, &sb, B, 1, 0),
        "a_scales [4,2] f32, want [1,2] f32 for A [4,200] e4m3 in 128x128 blocks");
    BAD(dsk_matmul_fp8(NULL, &C, &qa, &sa, T, &qb, &sb, T, 1, 0),
        "b_scales [1,2] f32, want [6,2] f32 for B [6,200] e4m3 in 1x128 tiles");
    /* grouped */
    BAD(dsk_matmul_fp8_grouped(NULL, &C, &qa, &sa, &qb, &sb, B, &off, 1, 0), "B [6,200] e4m3 must have 3 dims");
    BAD(dsk_matmul_fp8_grouped(NULL, &C, &qa, &sa, &qg, &sg6, B, &off, 1, 0),
        "b_scales [2,6,2] f32, want [2,1,2] f32 for B [2,6,200] e4m3 in 128x128 blocks");
    BAD(dsk_matmul_fp8_grouped(NULL, &C, &qa, &sa1, &qg, &sg, B, &off, 1, 0),
        "a_scales [4,1] f32, want [4,2] f32 for A [4,200] e4m3 in 1x128 tiles");
    o[0] = 0;
    o[1] = 3;
    o[2] = 2;
    memcpy(off.data, o, sizeof o);
    BAD(dsk_matmul_fp8_grouped(NULL, &C, &qa, &sa, &qg, &sg, B, &off, 1, 0),
        "dsk_matmul_fp8_grouped: offsets[1] = 3 > offsets[2] = 2 (must not decrease)");
    o[2] = 5;
    memcpy(off.data, o, sizeof o);
    BAD(dsk_matmul_fp8_grouped(NULL, &C, &qa, &sa, &qg, &sg, B, &off, 1, 0),
        "offsets run from 0 to 5, outside the 4 rows");
    { /* the weights form: C (G, M, N) = A (M, R) B (N, R)^T */
        dsk_tensor Cw = new_t(DSK_F32, 3, 2, 4, 5);
        o[0] = 0;
        o[1] = 3;
        o[2] = 200;
        memcpy(off.data, o, sizeof o);
        BAD(dsk_matmul_fp8_grouped(NULL, &Cw, &qa, &sa, &qb, &sb, B, &off, 1, 0),
            "C [2,4,5] f32, A [4,200] e4m3, B [6,200] e4m3 with 2 groups: want the weights form");
        BAD(dsk_matmul_fp8_grouped(NULL, &Cw, &qa, &sa, &qg, &sg, B, &off, 1, 0), "B [2,6,200] e4m3 must have 2 dims");
        o[2] = 201;
        memcpy(off.data, o, sizeof o);
        dsk_tensor_free(NULL, &Cw);
        Cw = new_t(DSK_F32, 3, 2, 4, 6);
        BAD(dsk_matmul_fp8_grouped(NULL, &Cw, &qa, &sa, &qb, &sb, B, &off, 1, 0),
            "offsets run from 0 to 201, outside the 200 rows");
        dsk_tensor_free(NULL, &Cw);
    }
    {
        dsk_tensor off2 = new_t(DSK_I32, 1, 2, 0, 0);
        BAD(dsk_matmul_fp8_grouped(NULL, &C, &qa, &sa, &qg, &sg, B, &off2, 1, 0),
            "B [2,6,200] e4m3 holds 2 matrices, offsets 1 groups");
        dsk_tensor_free(NULL, &off2);
    }
    /* the transposed quantisation */
    BAD(dsk_amp_fp8_block_quantize_t(NULL, &qt, &st, NULL, 1, 128, 0), "dsk_amp_fp8_block_quantize_t: x is NULL");
    BAD(dsk_amp_fp8_block_quantize_t(NULL, &qt, &st, &qa, 1, 128, 0), "x is [4,200] e4m3, want f32, bf16 or f16");
    BAD(dsk_amp_fp8_block_quantize_t(NULL, &qa, &st, &x, 1, 128, 0),
        "q [4,200] e4m3 must be e4m3 or e5m2 of shape [5,300]");
    BAD(dsk_amp_fp8_block_quantize_t(NULL, &qt, &st2, &x, 1, 128, 0),
        "scales [5,2] f32, want [5,3] f32 for [5,300] f32 in 1x128 blocks");
    BAD(dsk_amp_fp8_block_quantize_t(NULL, &qt, &st, &x, 1, 0, 0), "block 1x0 must be at least 1x1");
    BAD(dsk_amp_fp8_block_quantize_t(NULL, &qt, &st, &v1, 1, 128, 0),
        "dsk_amp_fp8_block_quantize_t: tensor [8] f32 must be 2-D (R, C)");
    free_all(all, 20);
}

/* One case: `call` between the harness's begin and end, named by the format that follows. */
#define RUN(call, ...) \
    do { \
        dsk_test_begin(__VA_ARGS__); \
        call; \
        dsk_test_end(); \
    } while (0)

int main(void) {
    const dsk_dtype E4 = DSK_E4M3, E5 = DSK_E5M2;
    dsk_test_init("test_fp8");
    DSK_TEST_RUN(test_bad_args);
    RUN(test_quant_t(DSK_F32, E4, 300, 37, 1, 128), "quantise x^T in 1x128 tiles, f32 (300, 37)");
    RUN(test_quant_t(DSK_BF16, E5, 129, 200, 1, 128), "quantise x^T in 1x128 tiles, bf16 (129, 200) e5m2");
    RUN(test_quant_t(DSK_F32, E4, 260, 200, 128, 128), "quantise x^T in 128x128 blocks, f32 (260, 200)");
    RUN(test_quant_t(DSK_F32, E4, 1000, 300, 1, 128),
        "quantise x^T in 1x128 tiles, f32 (1000, 300): bands in parallel");
    DSK_TEST_RUN(test_quant_t_nonfinite);
    RUN(test_gemm(37, 45, 200, E4, E4, 1, 128, DSK_F32, 1.0f, 0.0f), "gemm (37, 45, 200) 1x128 x 128x128, f32 out");
    RUN(test_gemm(5, 130, 129, E4, E4, 1, 128, DSK_BF16, 1.0f, 0.0f), "gemm (5, 130, 129) 1x128 x 128x128, bf16 out");
    RUN(test_gemm(33, 17, 64, E4, E4, 1, 1, DSK_F32, 1.0f, 1.0f),
        "gemm (33, 17, 64) 1x128 x 1x128 (weight-gradient form), f32 +=");
    RUN(test_gemm(150, 70, 384, E4, E4, 128, 1, DSK_F32, 0.5f, -2.0f),
        "gemm (150, 70, 384) 128x128 x 1x128, alpha 0.5 beta -2");
    RUN(test_gemm(19, 66, 200, E4, E5, 1, 128, DSK_F16, 1.0f, 0.0f), "gemm (19, 66, 200) e4m3 x e5m2, f16 out");
    RUN(test_gemm(1, 1, 1, E5, E4, 1, 128, DSK_F32, 1.0f, 0.0f), "gemm (1, 1, 1)");
    RUN(test_gemm(3, 4, 0, E4, E4, 1, 128, DSK_F32, 1.0f, 0.5f), "gemm (3, 4, 0): K = 0 gives beta C");
    RUN(test_grouped(128, E4, DSK_F32), "grouped: segments 0, 1, 129, 0, 5 rows, 128x128 weights, f32 out");
    RUN(test_grouped(1, E5, DSK_BF16), "grouped: segments 0, 1, 129, 0, 5 rows, 1x128 e5m2 B, bf16 out");
    RUN(test_grouped_weights(1, DSK_F32, 0.0f),
        "grouped weights form: segments 0, 1, 129, 0, 155 tokens, 1x128 x 1x128");
    RUN(test_grouped_weights(128, DSK_BF16, 1.0f), "grouped weights form: 1x128 x 128x128, bf16 C +=");
    RUN(test_nonfinite(E4), "NaN and Inf blocks stay non-finite in the rows and columns that read them");
    RUN(test_nonfinite(E5), "NaN and Inf blocks stay non-finite, e5m2 weights");
    return dsk_test_finish();
}
