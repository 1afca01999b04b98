/* bench_gemm.c - the built-in f32 CPU GEMM (dsk_matmul on the CPU) against OpenBLAS cblas_sgemm,
   same run, same thread count. Square sizes, the shapes an MoE expert sees (tokens x hidden x
   d_model and the transposed products of its backward pass) and, with --model, every product
   shape of `make run`'s model (train_moe defaults: 2048 tokens, d_model 128, attention per head
   T 128 x Dh 32, weight gradients with K = 2048). For each shape: one warm-up call each, then
   `rounds` alternating blocks of `repeats` samples of each library with a pause between blocks
   (OpenBLAS threads spin for a while after a call), median time per call; a sample of a small
   product times enough calls for 20 MFLOP. Prints the dsk micro-kernel and OpenBLAS's core,
   GFLOP/s of both, the ratio dsk / OpenBLAS, and the largest difference between the two results
   relative to max |C|. OpenBLAS honours OPENBLAS_CORETYPE: unset it to let it pick its kernels
   (OPENBLAS_CORETYPE=Haswell is its AVX2 kernel family, the peer of --isa avx2). --cpu-time times
   samples by the process's CPU time instead of the wall clock: on a loaded machine it leaves out
   the time the threads waited for a core (at 2 threads it counts spinning threads too).
   Usage: bench_gemm [--threads N] [--repeats R] [--rounds K] [--quick] [--model] [--isa NAME] [--cpu-time] */
#define DSK_TENSOR_IMPLEMENTATION
#include "dsk_tensor.h"
#include "bench_util.h"
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct shape { const char *name; int ta, tb; int64_t M, N, K; } shape;

static void pause_s(double s) {
    struct timespec ts;
    ts.tv_sec = (time_t)s;
    ts.tv_nsec = (long)((s - (double)ts.tv_sec) * 1e9);
    nanosleep(&ts, NULL);
}

/* Seconds of wall time, or of the process's CPU time (cpu != 0). */
static double now_s(int cpu) { return cpu ? bench_cpu_s() : bench_now_s(); }

static void run_dsk(dsk_ctx *ctx, const shape *s, const float *A, const float *B, float *C) {
    dsk_tensor a, b, c;
    int64_t sa[2] = {s->ta ? s->K : s->M, s->ta ? s->M : s->K}, sb[2] = {s->tb ? s->N : s->K, s->tb ? s->K : s->N}, sc[2] = {s->M, s->N};
    BENCH_CHECK(dsk_tensor_wrap(&a, (void *)A, DSK_F32, dsk_cpu(), 2, sa));
    BENCH_CHECK(dsk_tensor_wrap(&b, (void *)B, DSK_F32, dsk_cpu(), 2, sb));
    BENCH_CHECK(dsk_tensor_wrap(&c, C, DSK_F32, dsk_cpu(), 2, sc));
    BENCH_CHECK(dsk_matmul(ctx, &c, &a, s->ta, &b, s->tb, 1.0f, 0.0f));
}
static void run_blas(const shape *s, const float *A, const float *B, float *C) {
    cblas_sgemm(CblasRowMajor, s->ta ? CblasTrans : CblasNoTrans, s->tb ? CblasTrans : CblasNoTrans, (int)s->M, (int)s->N, (int)s->K, 1.0f, A,
                (int)(s->ta ? s->M : s->K), B, (int)(s->tb ? s->K : s->N), 0.0f, C, (int)s->N);
}

int main(int argc, char **argv) {
    int threads = 2, repeats = 5, rounds = 2, quick = 0, model = 0, cpu = 0;
    dsk_cpu_isa isa = DSK_CPU_ISA_AUTO;
    dsk_ctx ctx;
    dsk_ctx_opts co;
    char kname[64];
    static const shape all[] = {
        {"square 256", 0, 0, 256, 256, 256},
        {"square 512", 0, 0, 512, 512, 512},
        {"square 1024", 0, 0, 1024, 1024, 1024},
        {"square 2048", 0, 0, 2048, 2048, 2048},
        {"moe up   x W^T  (T,H)=(T,D)(H,D)^T", 0, 1, 4096, 1536, 512},
        {"moe down x W^T  (T,D)=(T,H)(D,H)^T", 0, 1, 4096, 512, 1536},
        {"moe fwd  x W    (T,H)=(T,D)(D,H)", 0, 0, 4096, 1536, 512},
        {"moe dX   dY W   (T,D)=(T,H)(H,D)", 0, 0, 4096, 512, 1536},
        {"moe dW   dY^T X (H,D)=(T,H)^T(T,D)", 1, 0, 1536, 512, 4096},
    };
    static const shape small[] = {
        {"square 64", 0, 0, 64, 64, 64},
        {"square 128", 0, 0, 128, 128, 128},
        {"qkv/wo x W^T (N,D)(D,D)^T", 0, 1, 2048, 128, 128},
        {"ffn up x W^T (N,D)(F,D)^T", 0, 1, 2048, 384, 128},
        {"ffn down x W^T (N,F)(D,F)^T", 0, 1, 2048, 128, 384},
        {"lm head x W^T (N,D)(V,D)^T", 0, 1, 2048, 256, 128},
        {"dX = dY W (N,D)(D,D)", 0, 0, 2048, 128, 128},
        {"dX = dY W (N,V)(V,D)", 0, 0, 2048, 128, 256},
        {"dW = dY^T X (N,D)^T(N,D)", 1, 0, 128, 128, 2048},
        {"dW lm = dY^T X (N,V)^T(N,D)", 1, 0, 256, 128, 2048},
        {"expert dW (n,F)^T(n,D), n 512", 1, 0, 128, 128, 512},
        {"expert up (n,D)(F,D)^T, n 512", 0, 1, 512, 128, 128},
        {"attn S = Q K^T (T,Dh)(T,Dh)^T", 0, 1, 128, 128, 32},
        {"attn O = P V (T,T)(T,Dh)", 0, 0, 128, 32, 128},
        {"attn dK = dS^T Q (T,T)^T(T,Dh)", 1, 0, 128, 32, 128},
    };
    const shape *list = all;
    int n_shapes = (int)(sizeof all / sizeof all[0]);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--repeats") && i + 1 < argc) repeats = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--quick")) quick = 1;
        else if (!strcmp(argv[i], "--model")) model = 1;
        else if (!strcmp(argv[i], "--cpu-time")) cpu = 1;
        else if (!strcmp(argv[i], "--isa") && i + 1 < argc) {
            const char *n = argv[++i];
            isa = !strcmp(n, "portable") ? DSK_CPU_ISA_PORTABLE : !strcmp(n, "avx2") ? DSK_CPU_ISA_AVX2 : !strcmp(n, "avx512") ? DSK_CPU_ISA_AVX512 : (dsk_cpu_isa)-1;
        } else {
            fprintf(stderr,
                    "usage: %s [--threads N] [--repeats R] [--rounds K] [--quick] [--model] [--isa "
                    "portable|avx2|avx512] [--cpu-time]\n",
                    argv[0]);
            return 2;
        }
    }
    if (threads < 1 || repeats < 1 || rounds < 1) { fprintf(stderr, "bench_gemm: threads, repeats and rounds must be >= 1\n"); return 2; }
    if (quick) n_shapes = 3;
    if (model) { list = small; n_shapes = (int)(sizeof small / sizeof small[0]); }
    memset(&co, 0, sizeof co);
    co.device = DSK_PREFER_CPU;
    co.n_threads = threads;
    co.cpu_isa = isa;
    BENCH_CHECK(dsk_ctx_init(&ctx, &co));
    openblas_set_num_threads(threads);
    printf("# bench_gemm: f32 C = A B, %d threads (dsk n_threads and openblas_set_num_threads), median of %d x %d "
           "samples after a warm-up, "
           "%s time\n",
           threads, rounds, repeats, cpu ? "process CPU" : "wall");
    printf("# dsk kernel %s (best here: %s), OpenBLAS %s\n", dsk_cpu_gemm_describe(ctx.cpu_isa, kname, sizeof kname),
           dsk_cpu_isa_name(dsk_cpu_isa_best()), openblas_get_corename());
    printf("# %-36s %5s %5s %5s %10s %10s %7s %9s\n", "shape", "M", "N", "K", "dsk GF/s", "blas GF/s", "ratio", "max diff");
    for (int si = 0; si < n_shapes; si++) {
        const shape *s = &list[si];
        size_t na = (size_t)(s->M * s->K), nb = (size_t)(s->K * s->N), nc = (size_t)(s->M * s->N);
        float *A = (float *)malloc(na * 4), *B = (float *)malloc(nb * 4), *C1 = (float *)malloc(nc * 4), *C2 = (float *)malloc(nc * 4);
        double *td = (double *)malloc(sizeof(double) * (size_t)(repeats * rounds)), *tb = (double *)malloc(sizeof(double) * (size_t)(repeats * rounds));
        double flop = 2.0 * (double)s->M * (double)s->N * (double)s->K, maxc = 0, maxd = 0, gd, gb;
        int inner = flop >= 2e7 ? 1 : (int)(2e7 / flop); /* calls per sample */
        if (!A || !B || !C1 || !C2 || !td || !tb) { fprintf(stderr, "bench_gemm: out of memory\n"); return 1; }
        for (size_t i = 0; i < na; i++) A[i] = dsk_rng_uniform_at(1, 0, i) - 0.5f;
        for (size_t i = 0; i < nb; i++) B[i] = dsk_rng_uniform_at(2, 0, i) - 0.5f;
        run_dsk(&ctx, s, A, B, C1);
        run_blas(s, A, B, C2);
        for (size_t i = 0; i < nc; i++) {
            double c = fabs((double)C2[i]), d = fabs((double)C1[i] - (double)C2[i]);
            if (c > maxc) maxc = c;
            if (d > maxd || d != d) maxd = d;
        }
        for (int r = 0; r < rounds; r++) {
            pause_s(0.3);
            for (int k = 0; k < repeats; k++) {
                double t0 = now_s(cpu);
                for (int q = 0; q < inner; q++) run_dsk(&ctx, s, A, B, C1);
                td[r * repeats + k] = (now_s(cpu) - t0) / inner;
            }
            pause_s(0.3);
            for (int k = 0; k < repeats; k++) {
                double t0 = now_s(cpu);
                for (int q = 0; q < inner; q++) run_blas(s, A, B, C2);
                tb[r * repeats + k] = (now_s(cpu) - t0) / inner;
            }
        }
        gd = flop / bench_median(td, repeats * rounds) * 1e-9;
        gb = flop / bench_median(tb, repeats * rounds) * 1e-9;
        printf("  %-36s %5lld %5lld %5lld %10.1f %10.1f %7.2f %9.1e\n", s->name, (long long)s->M, (long long)s->N, (long long)s->K, gd, gb, gd / gb,
               maxc > 0 ? maxd / maxc : maxd);
        fflush(stdout);
        free(A); free(B); free(C1); free(C2); free(td); free(tb);
    }
    dsk_ctx_free(&ctx);
    return 0;
}
