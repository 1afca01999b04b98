/* test_fp8_gpu.c - the CUDA path of the FP8 GEMM (dsk_matmul_fp8, dsk_matmul_fp8_grouped;
   kernels/fp8.cu) and of the transposed block quantisation (dsk_amp_fp8_block_quantize_t)
   against the CPU path on the same inputs, bit for bit: the kernel runs the CPU's arithmetic
   (the DSK_HD chunk functions of dsk_tensor.h) in the same order. Where NaNs arise (non-finite
   blocks) any NaN equals any NaN: the CPU and the GPU make them with different signs and
   payloads. GPU outputs are poisoned first. Without a usable CUDA device every case skips. */
#include "dsk_amp.h"
#include "tests/dsk_test.h"
#include "tests/gpu/gpu_test_util.h"

static dsk_tensor *h2(dsk_dtype dt, int64_t r, int64_t c) {
    int64_t s[2] = {r, c};
    return halloc(dt, 2, s);
}
static dsk_tensor *h3(dsk_dtype dt, int64_t g, int64_t r, int64_t c) {
    int64_t s[3] = {g, r, c};
    return halloc(dt, 3, s);
}
static dsk_tensor *host(const dsk_tensor *d) { return host_as(d, d->dtype); }

/* Normal values, each leading row times 2^u (u uniform in [-6, 6]), rounded to t's dtype. */
static void fill_rows(dsk_tensor *t) {
    int64_t R = t->shape[0], C = dsk_tensor_numel(t) / (R ? R : 1);
    for (int64_t r = 0; r < R; r++) {
        double m = pow(2.0, dsk_test_rand(-6.0, 6.0));
        for (int64_t c = 0; c < C; c++) dsk_store_f32(t->data, t->dtype, r * C + c, (float)(m * dsk_test_randn()));
    }
}
static void poison(dsk_tensor *t) {
    if (t->dtype == DSK_E4M3 || t->dtype == DSK_E5M2) dsk_test_poison_bytes(t->data, dsk_tensor_nbytes(t));
    else DSK_TEST_OK(dsk_tensor_fill(NULL, t, NAN));
}
static void same(const dsk_tensor *gpu, const dsk_tensor *cpu, const char *what) {
    dsk_tensor *g = host(gpu);
    DSK_TEST_SAME_BYTES(g->data, cpu->data, dsk_tensor_nbytes(cpu), what);
}
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

/* x (rows, K) of dtype xdt quantised on the CPU in (rows_per x 128) blocks: codes and scales. */
static void quantise(dsk_tensor **q, dsk_tensor **s, dsk_dtype xdt, dsk_dtype fmt, int64_t rows, int64_t K,
                     int rows_per) {
    dsk_tensor *x = h2(xdt, rows, K);
    *q = h2(fmt, rows, K);
    *s = h2(DSK_F32, (rows + rows_per - 1) / rows_per, (K + 127) / 128);
    fill_rows(x);
    DSK_TEST_OK(dsk_amp_fp8_block_quantize(NULL, *q, *s, x, rows_per, 128, 0));
}

static void test_gemm(int64_t M, int64_t N, int64_t K, dsk_dtype fa, dsk_dtype fb, int a_rows, int b_rows,
                      dsk_dtype cdt, float alpha, float beta) {
    dsk_tensor *qa, *sa, *qb, *sb, *C = h2(cdt, M, N), *dC;
    quantise(&qa, &sa, DSK_F32, fa, M, K, a_rows);
    quantise(&qb, &sb, DSK_BF16, fb, N, K, b_rows);
    if (beta != 0.0f) fill_rows(C);
    else poison(C);
    dC = dev(C);
    DSK_TEST_OK(dsk_matmul_fp8(NULL, C, qa, sa, (dsk_fp8_scaling)a_rows, qb, sb, (dsk_fp8_scaling)b_rows, alpha, beta));
    DSK_TEST_OK(dsk_matmul_fp8(&G, dC, dev(qa), dev(sa), (dsk_fp8_scaling)a_rows, dev(qb), dev(sb),
                               (dsk_fp8_scaling)b_rows, alpha, beta));
    same(dC, C, "C");
}

/* Segments of 0, 1, 129, 0 and 5 rows from row 2 of 140: the rows outside keep their poison. */
static void test_grouped(int b_rows, dsk_dtype cdt) {
    const int64_t R = 140, N = 45, K = 200, NG = 5, nb = b_rows == 1 ? N : 1;
    const int32_t offs[6] = {2, 2, 3, 132, 132, 137};
    int64_t one = NG + 1;
    dsk_tensor *qa, *sa, *w = h3(DSK_F32, NG, N, K), *qb = h3(DSK_E4M3, NG, N, K), *sb = h3(DSK_F32, NG, nb, 2);
    dsk_tensor *off = halloc(DSK_I32, 1, &one), *C = h2(cdt, R, N), *dC;
    quantise(&qa, &sa, DSK_BF16, DSK_E4M3, R, K, 1);
    fill_rows(w);
    for (int64_t g = 0; g < NG; g++) {
        dsk_tensor wg, qg, sg;
        DSK_TEST_OK(dsk_tensor_select(w, g, &wg));
        DSK_TEST_OK(dsk_tensor_select(qb, g, &qg));
        DSK_TEST_OK(dsk_tensor_select(sb, g, &sg));
        DSK_TEST_OK(dsk_amp_fp8_block_quantize(NULL, &qg, &sg, &wg, b_rows, 128, 0));
    }
    memcpy(off->data, offs, sizeof offs);
    poison(C);
    dC = dev(C);
    DSK_TEST_OK(dsk_matmul_fp8_grouped(NULL, C, qa, sa, qb, sb, (dsk_fp8_scaling)b_rows, off, 1.0f, 0.0f));
    DSK_TEST_OK(dsk_matmul_fp8_grouped(&G, dC, dev(qa), dev(sa), dev(qb), dev(sb), (dsk_fp8_scaling)b_rows, dev(off),
                                       1.0f, 0.0f));
    same(dC, C, "C (the rows outside the segments poisoned on both)");
}

/* The weights form: C[g] = dy[seg g]^T x[seg g] from dy^T and x^T quantised whole on each device
   (segments of 0, 1, 129, 0 and 155 of 300 tokens from token 5, cutting tiles). */
static void test_grouped_weights(int b_rows, dsk_dtype cdt, float beta) {
    const int64_t R = 300, M = 37, N = 70, NG = 5;
    const int32_t offs[6] = {5, 5, 6, 135, 135, 290};
    int64_t one = NG + 1;
    dsk_tensor *dy = h2(DSK_BF16, R, M), *x = h2(DSK_F32, R, N), *qa = h2(DSK_E4M3, M, R), *sa = h2(DSK_F32, M, 3);
    dsk_tensor *qb = h2(DSK_E4M3, N, R), *sb = h2(DSK_F32, b_rows == 1 ? N : 1, 3), *off = halloc(DSK_I32, 1, &one);
    dsk_tensor *C = h3(cdt, NG, M, N), *dqa = dev(qa), *dsa = dev(sa), *dqb = dev(qb), *dsb = dev(sb), *dC;
    fill_rows(dy);
    fill_rows(x);
    memcpy(off->data, offs, sizeof offs);
    if (beta != 0.0f) fill_rows(C);
    else poison(C);
    dC = dev(C);
    DSK_TEST_OK(dsk_amp_fp8_block_quantize_t(NULL, qa, sa, dy, 1, 128, 0));
    DSK_TEST_OK(dsk_amp_fp8_block_quantize_t(NULL, qb, sb, x, b_rows, 128, 0));
    DSK_TEST_OK(dsk_amp_fp8_block_quantize_t(&G, dqa, dsa, dev(dy), 1, 128, 0));
    DSK_TEST_OK(dsk_amp_fp8_block_quantize_t(&G, dqb, dsb, dev(x), b_rows, 128, 0));
    DSK_TEST_OK(dsk_matmul_fp8_grouped(NULL, C, qa, sa, qb, sb, (dsk_fp8_scaling)b_rows, off, 1.0f, beta));
    DSK_TEST_OK(dsk_matmul_fp8_grouped(&G, dC, dqa, dsa, dqb, dsb, (dsk_fp8_scaling)b_rows, dev(off), 1.0f, beta));
    same(dqa, qa, "dy^T codes");
    same(dsb, sb, "x^T scales");
    same(dC, C, "C (G, M, N)");
}

/* NaN and Inf in A's tiles and B's blocks: the same outputs non-finite on both devices. */
static void test_nonfinite(void) {
    const int64_t M = 9, N = 160, K = 200;
    dsk_tensor *x = h2(DSK_F32, M, K), *w = h2(DSK_F32, N, K), *qa = h2(DSK_E4M3, M, K), *sa = h2(DSK_F32, M, 2);
    dsk_tensor *qb = h2(DSK_E4M3, N, K), *sb = h2(DSK_F32, 2, 2), *C = h2(DSK_F32, M, N), *dC;
    fill_rows(x);
    fill_rows(w);
    ((float *)x->data)[3 * K + 150] = NAN;
    ((float *)x->data)[7 * K + 10] = INFINITY;
    ((float *)w->data)[140 * K + 20] = -INFINITY;
    DSK_TEST_OK(dsk_amp_fp8_block_quantize(NULL, qa, sa, x, 1, 128, 0));
    DSK_TEST_OK(dsk_amp_fp8_block_quantize(NULL, qb, sb, w, 128, 128, 0));
    poison(C);
    dC = dev(C);
    DSK_TEST_OK(dsk_matmul_fp8(NULL, C, qa, sa, DSK_FP8_TILE_1X128, qb, sb, DSK_FP8_BLOCK_128X128, 1.0f, 0.0f));
    DSK_TEST_OK(dsk_matmul_fp8(&G, dC, dev(qa), dev(sa), DSK_FP8_TILE_1X128, dev(qb), dev(sb), DSK_FP8_BLOCK_128X128,
                               1.0f, 0.0f));
    same_or_nan(dC, C, "C");
}

/* The transposed quantisation (optionally with an Inf and a NaN in x) on both devices. */
static void test_quant_t(dsk_dtype xdt, dsk_dtype fmt, int64_t R, int64_t C, int br, int bc, int nonfinite) {
    dsk_tensor *x = h2(xdt, R, C), *q = h2(fmt, C, R), *s = h2(DSK_F32, (C + br - 1) / br, (R + bc - 1) / bc);
    dsk_tensor *dq, *ds;
    fill_rows(x);
    if (nonfinite) {
        dsk_store_f32(x->data, xdt, (R - 1) * C + 1, NAN);
        dsk_store_f32(x->data, xdt, 2 * C, -INFINITY);
    }
    poison(q);
    poison(s);
    dq = dev(q);
    ds = dev(s);
    DSK_TEST_OK(dsk_amp_fp8_block_quantize_t(NULL, q, s, x, br, bc, 0));
    DSK_TEST_OK(dsk_amp_fp8_block_quantize_t(&G, dq, ds, dev(x), br, bc, 0));
    same(dq, q, "codes");
    if (nonfinite) same_or_nan(ds, s, "scales");
    else same(ds, s, "scales");
}

/* Operands on two devices: DSK_ERR_ARG naming the tensor and both devices, nothing launched. */
static void test_devices(void) {
    dsk_tensor *qa, *sa, *qb, *sb, *C = h2(DSK_F32, 4, 6), *dC = dev(C);
    int64_t two = 2;
    dsk_tensor *off = halloc(DSK_I32, 1, &two);
    quantise(&qa, &sa, DSK_F32, DSK_E4M3, 4, 200, 1);
    quantise(&qb, &sb, DSK_F32, DSK_E4M3, 6, 200, 128);
    DSK_TEST_STATUS(
        dsk_matmul_fp8(&G, dC, qa, dev(sa), DSK_FP8_TILE_1X128, dev(qb), dev(sb), DSK_FP8_BLOCK_128X128, 1.0f, 0.0f),
        DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_matmul_fp8: A is on cpu:0 but C is on cuda:0");
    DSK_TEST_STATUS(dsk_matmul_fp8(NULL, dC, dev(qa), dev(sa), DSK_FP8_TILE_1X128, dev(qb), dev(sb),
                                   DSK_FP8_BLOCK_128X128, 1.0f, 0.0f),
                    DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_matmul_fp8: C is on cuda:0 but ctx is NULL");
    DSK_TEST_STATUS(dsk_amp_fp8_block_quantize_t(&G, dev(qa), sa, dev(C), 1, 128, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_amp_fp8_block_quantize_t: scales [4,2] f32 is on cpu:0, expected cuda:0");
    {
        int64_t g3[3] = {1, 6, 200}, s3[3] = {1, 1, 2};
        dsk_tensor *bg = dalloc(DSK_E4M3, 3, g3), *sg = dalloc(DSK_F32, 3, s3);
        ((int32_t *)off->data)[0] = 0;
        ((int32_t *)off->data)[1] = 4;
        DSK_TEST_STATUS(
            dsk_matmul_fp8_grouped(&G, dC, dev(qa), dev(sa), bg, sg, DSK_FP8_BLOCK_128X128, off, 1.0f, 0.0f),
            DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_matmul_fp8_grouped: offsets is on cpu:0 but C is on cuda:0");
    }
}

int main(void) {
    dsk_test_init("test_fp8_gpu");
    gpu_test_setup();
    CASE(test_gemm(37, 45, 200, DSK_E4M3, DSK_E4M3, 1, 128, DSK_F32, 1.0f, 0.0f),
         "gemm (37, 45, 200) 1x128 x 128x128 f32");
    CASE(test_gemm(5, 130, 129, DSK_E4M3, DSK_E4M3, 1, 128, DSK_BF16, 1.0f, 0.0f), "gemm (5, 130, 129) bf16 out");
    CASE(test_gemm(33, 17, 64, DSK_E4M3, DSK_E4M3, 1, 1, DSK_F32, 1.0f, 1.0f), "gemm (33, 17, 64) 1x128 x 1x128, C +=");
    CASE(test_gemm(70, 40, 384, DSK_E5M2, DSK_E4M3, 128, 1, DSK_F16, 0.5f, -2.0f),
         "gemm (70, 40, 384) e5m2 128x128 x 1x128, f16 out, alpha 0.5 beta -2");
    CASE(test_gemm(1, 1, 1, DSK_E4M3, DSK_E5M2, 1, 128, DSK_F32, 1.0f, 0.0f), "gemm (1, 1, 1)");
    CASE(test_grouped(128, DSK_F32), "grouped: segments 0, 1, 129, 0, 5 rows, 128x128 weights");
    CASE(test_grouped(1, DSK_BF16), "grouped: segments 0, 1, 129, 0, 5 rows, 1x128 B, bf16 out");
    CASE(test_grouped_weights(1, DSK_F32, 0.0f), "grouped weights form: segments 0, 1, 129, 0, 155 tokens");
    CASE(test_grouped_weights(128, DSK_BF16, 1.0f), "grouped weights form: 128x128 B, bf16 C +=");
    CASE(test_nonfinite(), "NaN and Inf blocks: the same outputs non-finite");
    CASE(test_quant_t(DSK_BF16, DSK_E4M3, 300, 37, 1, 128, 0), "quantise x^T in 1x128 tiles (300, 37) bf16");
    CASE(test_quant_t(DSK_F32, DSK_E5M2, 260, 200, 128, 128, 0), "quantise x^T in 128x128 blocks (260, 200) e5m2");
    CASE(test_quant_t(DSK_F32, DSK_E4M3, 129, 5, 1, 128, 1), "quantise x^T with NaN and -Inf (129, 5)");
    CASE(test_devices(), "operands on two devices: errors naming them");
    gpu_test_teardown();
    return dsk_test_finish();
}
