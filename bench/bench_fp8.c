/* bench_fp8.c - the CPU reference of the block-scaled FP8 GEMM (dsk_matmul_fp8 and the grouped
   rows form dsk_matmul_fp8_grouped) against dsk_matmul / dsk_matmul_grouped in bf16 and f32 on
   the same shapes, same run, same threads; and the quantisation that feeds it
   (dsk_amp_fp8_block_quantize in 1x128 tiles, its transposed form). Shapes: a square product
   and DeepSeek-V3's expert shapes (d_model 7168, expert hidden 2048) scaled by 1/4 to fit a
   2-core machine; the grouped forms over 16 experts of random sizes (rows: 2048 routed rows times
   the weights; weights: the experts' weight gradients dy^T x over those rows).
   Each variant: one warm-up call, then `rounds` alternating blocks of `repeats` samples, median
   time per call. Prints GFLOP/s (2 M N K per product), the ratio fp8 / bf16, and the machine's
   load average. The FP8 path computes exact arithmetic in a fixed order (a chunk's dot products
   in k order, 4 rows x 16 columns of them in vector registers), the bits the CUDA kernel gives.
   With --cuda (a CUDA build and device): the CUDA path instead, at DeepSeek-V3's expert shape
   (d_model 7168, expert hidden 2048): dsk_matmul_fp8 (bf16 out) against cublasGemmEx bf16 (f32
   accumulation, bf16 out) on 4096 rows, and dsk_matmul_fp8_grouped against dsk_matmul_grouped
   bf16 (WMMA) over one rank's experts: 256 experts top-8 under expert parallelism 8, i.e. 32
   local experts and 4096 tokens, 4096 routed rows (128 per expert on average, skewed), and the
   weights form (the experts' weight gradients dy^T x over those rows) against dsk_matmul_grouped's;
   2 warm-ups, median of --repeats calls, each timed to a stream sync.
   Prints "summary:" lines (scripts/device_check.sh). --quick: small shapes (an emulated run).
   Usage: bench_fp8 [--threads N] [--repeats R] [--rounds K] [--cuda [--quick]] */
#define _POSIX_C_SOURCE 200809L /* clock_gettime (bench_util.h) */
#define DSK_TENSOR_IMPLEMENTATION
#define DSK_AMP_IMPLEMENTATION
#include "dsk_tensor.h"
#include "dsk_amp.h"
#include "bench_util.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { V_FP8, V_BF16, V_F32, V_COUNT };

typedef struct prob {
    dsk_tensor x[V_COUNT], w[V_COUNT], c, sx, sw, off; /* x[V_FP8], w[V_FP8]: codes */
    int grouped;
    int wgrad; /* the weights form: x = dy (R, M), w = x (R, N), C (G, M, N); fp8: dy^T, x^T */
} prob;

static dsk_tensor alloc2(dsk_ctx *ctx, dsk_dtype dt, int nd, int64_t a, int64_t b, int64_t c) {
    dsk_tensor t;
    int64_t s[3] = {a, b, c};
    memset(&t, 0, sizeof t);
    BENCH_CHECK(dsk_tensor_alloc(ctx, &t, dt, nd, s));
    return t;
}

/* p->off (G + 1) i32 on ctx's device from the host's off. */
static void put_offsets(dsk_ctx *ctx, prob *p, const int32_t *off, int64_t G) {
    dsk_tensor h;
    int64_t n = G + 1;
    p->off = alloc2(ctx, DSK_I32, 1, n, 0, 0);
    BENCH_CHECK(dsk_tensor_wrap(&h, (void *)off, DSK_I32, dsk_cpu(), 1, &n));
    BENCH_CHECK(dsk_tensor_copy(ctx, &p->off, &h));
}

/* x (R, K) and w ([G,] N, K) in f32 and bf16, quantised to e4m3 (1x128 and 128x128). */
static void setup(dsk_ctx *ctx, prob *p, int64_t R, int64_t N, int64_t K, int64_t G, const int32_t *off) {
    int64_t g = G ? G : 1;
    memset(p, 0, sizeof *p);
    p->grouped = G > 0;
    p->x[V_F32] = alloc2(ctx, DSK_F32, 2, R, K, 0);
    p->x[V_BF16] = alloc2(ctx, DSK_BF16, 2, R, K, 0);
    p->x[V_FP8] = alloc2(ctx, DSK_E4M3, 2, R, K, 0);
    p->w[V_F32] = G ? alloc2(ctx, DSK_F32, 3, G, N, K) : alloc2(ctx, DSK_F32, 2, N, K, 0);
    p->w[V_BF16] = G ? alloc2(ctx, DSK_BF16, 3, G, N, K) : alloc2(ctx, DSK_BF16, 2, N, K, 0);
    p->w[V_FP8] = G ? alloc2(ctx, DSK_E4M3, 3, G, N, K) : alloc2(ctx, DSK_E4M3, 2, N, K, 0);
    p->sx = alloc2(ctx, DSK_F32, 2, R, (K + 127) / 128, 0);
    p->sw = G ? alloc2(ctx, DSK_F32, 3, G, (N + 127) / 128, (K + 127) / 128)
              : alloc2(ctx, DSK_F32, 2, (N + 127) / 128, (K + 127) / 128, 0);
    p->c = alloc2(ctx, DSK_F32, 2, R, N, 0);
    BENCH_CHECK(dsk_tensor_normal(ctx, &p->x[V_F32], 1, 0, 0.0f, 1.0f));
    BENCH_CHECK(dsk_tensor_normal(ctx, &p->w[V_F32], 2, 0, 0.0f, 0.02f));
    BENCH_CHECK(dsk_tensor_copy(ctx, &p->x[V_BF16], &p->x[V_F32]));
    BENCH_CHECK(dsk_tensor_copy(ctx, &p->w[V_BF16], &p->w[V_F32]));
    BENCH_CHECK(dsk_amp_fp8_block_quantize(ctx, &p->x[V_FP8], &p->sx, &p->x[V_F32], 1, 128, 0));
    for (int64_t i = 0; i < g; i++) {
        dsk_tensor wf = p->w[V_F32], wq = p->w[V_FP8], ws = p->sw;
        if (G) {
            BENCH_CHECK(dsk_tensor_select(&p->w[V_F32], i, &wf));
            BENCH_CHECK(dsk_tensor_select(&p->w[V_FP8], i, &wq));
            BENCH_CHECK(dsk_tensor_select(&p->sw, i, &ws));
        }
        BENCH_CHECK(dsk_amp_fp8_block_quantize(ctx, &wq, &ws, &wf, 128, 128, 0));
    }
    if (G) put_offsets(ctx, p, off, G);
}

/* The experts' weight gradients: dy (R, M) and x (R, N) in f32 and bf16, dy^T and x^T in e4m3
   (1x128 tiles along R), C (G, M, N) of dtype cdt. */
static void setup_wgrad(dsk_ctx *ctx, prob *p, int64_t R, int64_t M, int64_t N, int64_t G, const int32_t *off,
                        dsk_dtype cdt) {
    memset(p, 0, sizeof *p);
    p->grouped = p->wgrad = 1;
    p->x[V_F32] = alloc2(ctx, DSK_F32, 2, R, M, 0);
    p->x[V_BF16] = alloc2(ctx, DSK_BF16, 2, R, M, 0);
    p->x[V_FP8] = alloc2(ctx, DSK_E4M3, 2, M, R, 0);
    p->w[V_F32] = alloc2(ctx, DSK_F32, 2, R, N, 0);
    p->w[V_BF16] = alloc2(ctx, DSK_BF16, 2, R, N, 0);
    p->w[V_FP8] = alloc2(ctx, DSK_E4M3, 2, N, R, 0);
    p->sx = alloc2(ctx, DSK_F32, 2, M, (R + 127) / 128, 0);
    p->sw = alloc2(ctx, DSK_F32, 2, N, (R + 127) / 128, 0);
    p->c = alloc2(ctx, cdt, 3, G, M, N);
    BENCH_CHECK(dsk_tensor_normal(ctx, &p->x[V_F32], 4, 0, 0.0f, 1.0f));
    BENCH_CHECK(dsk_tensor_normal(ctx, &p->w[V_F32], 5, 0, 0.0f, 1.0f));
    BENCH_CHECK(dsk_tensor_copy(ctx, &p->x[V_BF16], &p->x[V_F32]));
    BENCH_CHECK(dsk_tensor_copy(ctx, &p->w[V_BF16], &p->w[V_F32]));
    BENCH_CHECK(dsk_amp_fp8_block_quantize_t(ctx, &p->x[V_FP8], &p->sx, &p->x[V_F32], 1, 128, 0));
    BENCH_CHECK(dsk_amp_fp8_block_quantize_t(ctx, &p->w[V_FP8], &p->sw, &p->w[V_F32], 1, 128, 0));
    put_offsets(ctx, p, off, G);
}

static void run(dsk_ctx *ctx, prob *p, int v) {
    if (v == V_FP8 && p->wgrad)
        BENCH_CHECK(dsk_matmul_fp8_grouped(ctx, &p->c, &p->x[v], &p->sx, &p->w[v], &p->sw, DSK_FP8_TILE_1X128, &p->off,
                                           1.0f, 0.0f));
    else if (p->wgrad) BENCH_CHECK(dsk_matmul_grouped(ctx, &p->c, &p->x[v], 1, &p->w[v], 0, &p->off, 1.0f, 0.0f));
    else if (v == V_FP8 && p->grouped)
        BENCH_CHECK(dsk_matmul_fp8_grouped(ctx, &p->c, &p->x[v], &p->sx, &p->w[v], &p->sw, DSK_FP8_BLOCK_128X128,
                                           &p->off, 1.0f, 0.0f));
    else if (v == V_FP8)
        BENCH_CHECK(dsk_matmul_fp8(ctx, &p->c, &p->x[v], &p->sx, DSK_FP8_TILE_1X128, &p->w[v], &p->sw,
                                   DSK_FP8_BLOCK_128X128, 1.0f, 0.0f));
    else if (p->grouped) BENCH_CHECK(dsk_matmul_grouped(ctx, &p->c, &p->x[v], 0, &p->w[v], 1, &p->off, 1.0f, 0.0f));
    else BENCH_CHECK(dsk_matmul(ctx, &p->c, &p->x[v], 0, &p->w[v], 1, 1.0f, 0.0f));
}

static void release(dsk_ctx *ctx, prob *p) {
    for (int v = 0; v < V_COUNT; v++) {
        dsk_tensor_free(ctx, &p->x[v]);
        dsk_tensor_free(ctx, &p->w[v]);
    }
    dsk_tensor_free(ctx, &p->c);
    dsk_tensor_free(ctx, &p->sx);
    dsk_tensor_free(ctx, &p->sw);
    dsk_tensor_free(ctx, &p->off);
}

/* Median seconds per call of each variant, alternating blocks of samples. */
static void time_all(dsk_ctx *ctx, prob *p, int repeats, int rounds, double *med) {
    double *t = (double *)malloc(sizeof(double) * (size_t)(V_COUNT * repeats * rounds));
    if (!t) {
        fprintf(stderr, "bench_fp8: out of memory\n");
        exit(1);
    }
    for (int v = 0; v < V_COUNT; v++) run(ctx, p, v);
    for (int r = 0; r < rounds; r++)
        for (int v = 0; v < V_COUNT; v++)
            for (int k = 0; k < repeats; k++) {
                double t0 = bench_now_s();
                run(ctx, p, v);
                t[v * repeats * rounds + r * repeats + k] = bench_now_s() - t0;
            }
    for (int v = 0; v < V_COUNT; v++) med[v] = bench_median(t + v * repeats * rounds, repeats * rounds);
    free(t);
}

/* Segment offsets of R rows over G experts: counts from a fixed pseudo-random routing. */
static void route(int32_t *off, int64_t R, int64_t G) {
    int64_t *cnt = (int64_t *)calloc((size_t)G, sizeof *cnt);
    if (!cnt) {
        fprintf(stderr, "bench_fp8: out of memory\n");
        exit(1);
    }
    for (int64_t r = 0; r < R; r++) {
        float u = dsk_rng_uniform_at(7, 0, (uint64_t)r);
        cnt[(int64_t)(u * u * (float)G) % G]++; /* skewed: low experts get more rows */
    }
    off[0] = 0;
    for (int64_t g = 0; g < G; g++) off[g + 1] = off[g] + (int32_t)cnt[g];
    free(cnt);
}

#ifdef DSK_CUDA
#include <cuda_runtime.h>
#include <cublas_v2.h>

typedef struct gpu_case {
    dsk_ctx *g;
    cublasHandle_t peer;
    prob *p;
    int v; /* V_FP8: dsk_matmul_fp8(_grouped); V_BF16: cuBLAS (dense) or dsk_matmul_grouped (grouped) */
} gpu_case;

static void gpu_run(gpu_case *c) {
    prob *p = c->p;
    if (c->v == V_BF16 && !p->grouped) { /* row-major y (M, N) = x (M, K) w (N, K)^T, column-major y^T = w x^T */
        float one = 1.0f, zero = 0.0f;
        int M = (int)p->x[V_BF16].shape[0], N = (int)p->w[V_BF16].shape[0], K = (int)p->x[V_BF16].shape[1];
        if (cublasGemmEx(c->peer, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, p->w[V_BF16].data, CUDA_R_16BF, K,
                         p->x[V_BF16].data, CUDA_R_16BF, K, &zero, p->c.data, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
            fprintf(stderr, "bench_fp8: cublasGemmEx failed\n");
            exit(1);
        }
    } else {
        run(c->g, p, c->v);
    }
}

/* Median seconds per call on the GPU. */
static double gpu_time(gpu_case *c, int repeats) {
    double t[64];
    int n = repeats < 64 ? repeats : 64;
    for (int i = 0; i < 2; i++) gpu_run(c);
    BENCH_CHECK(dsk_ctx_sync(c->g));
    for (int i = 0; i < n; i++) {
        double t0 = bench_now_s();
        gpu_run(c);
        BENCH_CHECK(dsk_ctx_sync(c->g));
        t[i] = bench_now_s() - t0;
    }
    return bench_median(t, n);
}

static int gpu_main(int repeats, int quick) {
    dsk_ctx g;
    dsk_ctx_opts o;
    cublasHandle_t peer;
    int64_t E = quick ? 4 : 32, T = quick ? 64 : 4096, D = quick ? 256 : 7168, F = quick ? 128 : 2048;
    int64_t R = quick ? 512 : T; /* T tokens x top-8 over 256 experts reach 32 local experts T times */
    int32_t *off = (int32_t *)malloc(sizeof(int32_t) * (size_t)(E + 1));
    struct {
        const char *name;
        int64_t M, N, K, G;
    } cases[4];
    double tf[4][2];
    memset(&o, 0, sizeof o);
    o.device = DSK_PREFER_CUDA;
    if (!off) {
        fprintf(stderr, "bench_fp8: out of memory\n");
        return 1;
    }
    if (dsk_ctx_init(&g, &o) != DSK_OK) {
        printf("summary: fp8 GEMM: no CUDA device (%s)\n", dsk_last_error());
        free(off);
        return 0;
    }
    if (cublasCreate(&peer) != CUBLAS_STATUS_SUCCESS || cublasSetStream(peer, (cudaStream_t)g.stream)) {
        fprintf(stderr, "bench_fp8: cuBLAS handle\n");
        return 1;
    }
    cases[0].name = "expert up   x (T, D) w (F, D)^T";
    cases[0].M = T;
    cases[0].N = F;
    cases[0].K = D;
    cases[0].G = 0;
    cases[1].name = "expert down h (T, F) w (D, F)^T";
    cases[1].M = T;
    cases[1].N = D;
    cases[1].K = F;
    cases[1].G = 0;
    cases[2].name = "grouped up  E experts, R rows";
    cases[2].M = R;
    cases[2].N = F;
    cases[2].K = D;
    cases[2].G = E;
    cases[3].name = "grouped wgrad dy^T x over R rows";
    cases[3].M = F;
    cases[3].N = D;
    cases[3].K = R;
    cases[3].G = E;
    printf("# bench_fp8 --cuda: %s; T %lld tokens, d_model %lld, hidden %lld, %lld experts, %lld routed rows\n",
           quick ? "quick shapes" : "DeepSeek-V3 expert shapes", (long long)T, (long long)D, (long long)F, (long long)E,
           (long long)R);
    printf("# %-34s %6s %6s %6s %14s %18s %7s\n", "product", "M", "N", "K", "fp8 TFLOP/s", "bf16 peer TFLOP/s",
           "fp8/bf16");
    for (int i = 0; i < 4; i++) {
        prob p;
        gpu_case c;
        double flop = 2.0 * (double)cases[i].M * (double)cases[i].N * (double)cases[i].K;
        if (i == 3) { /* bf16 out for both */
            route(off, cases[i].K, cases[i].G);
            setup_wgrad(&g, &p, cases[i].K, cases[i].M, cases[i].N, cases[i].G, off, DSK_BF16);
        } else {
            if (cases[i].G) route(off, cases[i].M, cases[i].G);
            setup(&g, &p, cases[i].M, cases[i].N, cases[i].K, cases[i].G, off);
            dsk_tensor_free(&g, &p.c);
            p.c = alloc2(&g, DSK_BF16, 2, cases[i].M, cases[i].N, 0);
        }
        c.g = &g;
        c.peer = peer;
        c.p = &p;
        for (int v = 0; v < 2; v++) {
            c.v = v == 0 ? V_FP8 : V_BF16;
            tf[i][v] = flop / gpu_time(&c, repeats) * 1e-12;
        }
        printf("  %-34s %6lld %6lld %6lld %14.1f %18.1f %7.2f  (peer: %s)\n", cases[i].name, (long long)cases[i].M,
               (long long)cases[i].N, (long long)cases[i].K, tf[i][0], tf[i][1], tf[i][0] / tf[i][1],
               cases[i].G ? "dsk_matmul_grouped bf16" : "cublasGemmEx bf16");
        release(&g, &p);
    }
    printf(
        "summary: fp8 GEMM (CUDA cores) expert up %.1f TFLOP/s = %.2fx cuBLAS bf16, down %.2fx; grouped %.1f TFLOP/s "
        "= %.2fx dsk bf16 grouped, wgrad %.2fx\n",
        tf[0][0], tf[0][0] / tf[0][1], tf[1][0] / tf[1][1], tf[2][0], tf[2][0] / tf[2][1], tf[3][0] / tf[3][1]);
    cublasDestroy(peer);
    dsk_ctx_free(&g);
    free(off);
    return 0;
}
#endif

int main(int argc, char **argv) {
    int threads = 2, repeats = 3, rounds = 2, cuda = 0, quick = 0;
    dsk_ctx ctx;
    dsk_ctx_opts co;
    double load[3] = {0, 0, 0};
    char kname[64];
    struct {
        const char *name;
        int64_t R, N, K, G;
        int wgrad;
    } shapes[] = {
        /* wgrad: M, N, K = tokens */
        {"square 1024", 1024, 1024, 1024, 0, 0},
        {"V3 expert up/4   (T,2048/4)=(T,7168/4)", 1024, 512, 1792, 0, 0},
        {"V3 expert down/4 (T,7168/4)=(T,2048/4)", 1024, 1792, 512, 0, 0},
        {"grouped 16 experts, up/8 (R,256)=(R,896)", 2048, 256, 896, 16, 0},
        {"grouped wgrad 16 experts (256,896)=dy^T x", 256, 896, 2048, 16, 1},
    };
    int32_t off[17];
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--repeats") && i + 1 < argc) repeats = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--cuda")) cuda = 1;
        else if (!strcmp(argv[i], "--quick")) quick = 1;
        else {
            fprintf(stderr, "usage: %s [--threads N] [--repeats R] [--rounds K] [--cuda [--quick]]\n", argv[0]);
            return 2;
        }
    }
    if (threads < 1 || repeats < 1 || rounds < 1) {
        fprintf(stderr, "bench_fp8: arguments must be >= 1\n");
        return 2;
    }
    if (cuda) {
#ifdef DSK_CUDA
        return gpu_main(repeats, quick);
#else
        (void)quick;
        printf("summary: fp8 GEMM: skipped (built without CUDA; build with make CUDA=1)\n");
        return 0;
#endif
    }
    (void)quick;
    memset(&co, 0, sizeof co);
    co.device = DSK_PREFER_CPU;
    co.n_threads = threads;
    BENCH_CHECK(dsk_ctx_init(&ctx, &co));
    {
        FILE *f = fopen("/proc/loadavg", "r");
        if (!f || fscanf(f, "%lf %lf %lf", &load[0], &load[1], &load[2]) != 3) load[0] = -1;
        if (f) fclose(f);
    }
    printf("# bench_fp8: C f32 = x w^T, %d threads, median of %d x %d samples after a warm-up; load %.2f\n", threads,
           rounds, repeats, load[0]);
    printf("# dsk GEMM kernel for bf16/f32: %s; fp8: the reference (1x128 x 128x128 scales, e4m3)\n",
           dsk_cpu_gemm_describe(ctx.cpu_isa, kname, sizeof kname));
    printf("# %-42s %5s %5s %5s %9s %9s %9s %8s\n", "shape", "M", "N", "K", "fp8 GF/s", "bf16 GF/s", "f32 GF/s",
           "fp8/bf16");
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        prob p;
        double med[V_COUNT], flop = 2.0 * (double)shapes[si].R * (double)shapes[si].N * (double)shapes[si].K;
        if (shapes[si].wgrad) {
            route(off, shapes[si].K, shapes[si].G);
            setup_wgrad(&ctx, &p, shapes[si].K, shapes[si].R, shapes[si].N, shapes[si].G, off, DSK_F32);
        } else {
            if (shapes[si].G) route(off, shapes[si].R, shapes[si].G);
            setup(&ctx, &p, shapes[si].R, shapes[si].N, shapes[si].K, shapes[si].G, off);
        }
        time_all(&ctx, &p, repeats, rounds, med);
        printf("  %-42s %5lld %5lld %5lld %9.1f %9.1f %9.1f %8.2f\n", shapes[si].name, (long long)shapes[si].R,
               (long long)shapes[si].N, (long long)shapes[si].K, flop / med[V_FP8] * 1e-9, flop / med[V_BF16] * 1e-9,
               flop / med[V_F32] * 1e-9, med[V_BF16] / med[V_FP8]);
        release(&ctx, &p);
    }
    { /* quantisation of an activation (T, D) = (2048, 1792) f32: 1x128 tiles and the transposed form */
        dsk_tensor x = alloc2(&ctx, DSK_F32, 2, 2048, 1792, 0), q = alloc2(&ctx, DSK_E4M3, 2, 2048, 1792, 0);
        dsk_tensor qt = alloc2(&ctx, DSK_E4M3, 2, 1792, 2048, 0), s = alloc2(&ctx, DSK_F32, 2, 2048, 14, 0);
        dsk_tensor st = alloc2(&ctx, DSK_F32, 2, 1792, 16, 0);
        double t[2][64], bytes = 2048.0 * 1792.0 * 5.0; /* read f32, write e4m3 */
        int n = repeats * rounds < 64 ? repeats * rounds : 64;
        BENCH_CHECK(dsk_tensor_normal(&ctx, &x, 3, 0, 0.0f, 1.0f));
        for (int k = 0; k < n; k++) {
            double t0 = bench_now_s();
            BENCH_CHECK(dsk_amp_fp8_block_quantize(&ctx, &q, &s, &x, 1, 128, 0));
            t[0][k] = bench_now_s() - t0;
            t0 = bench_now_s();
            BENCH_CHECK(dsk_amp_fp8_block_quantize_t(&ctx, &qt, &st, &x, 1, 128, 0));
            t[1][k] = bench_now_s() - t0;
        }
        printf("# quantise x (2048, 1792) f32 -> e4m3: 1x128 tiles %.2f GB/s, transposed (x^T, 1x128) %.2f GB/s\n",
               bytes / bench_median(t[0], n) * 1e-9, bytes / bench_median(t[1], n) * 1e-9);
        dsk_tensor_free(&ctx, &x);
        dsk_tensor_free(&ctx, &q);
        dsk_tensor_free(&ctx, &qt);
        dsk_tensor_free(&ctx, &s);
        dsk_tensor_free(&ctx, &st);
    }
    dsk_ctx_free(&ctx);
    return 0;
}
