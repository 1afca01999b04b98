/* bench_amp.c - the CPU paths of dsk_amp.h against peers measured in the same run.
   1. Fused unscale + non-finite check + f64 sum of squares over many f32 gradients, against
      memcpy of the same bytes (the floor: the pass reads and writes every gradient once) and
      against the unfused ops a trainer would otherwise call per tensor (dsk_scale, then
      dsk_sum_squares, which also needs a separate non-finite scan: its sum is NaN/Inf then).
   2. f32 -> bf16 copy refresh: stochastic rounding (Philox per 4 elements) against RNE.
   3. DeepSeek-V3 128x128 block fp8 quantisation of a weight, against RNE f32 -> bf16 casting
      of the same matrix (one read, a narrower write; the block pass also reads twice).
   Each measurement: one warm-up, then `repeats` timed runs, median. GB/s counts the bytes a
   pass must move at least. Usage: bench_amp [--mib N] [--repeats R] */
#define DSK_TENSOR_IMPLEMENTATION
#define DSK_AMP_IMPLEMENTATION
#include "dsk_amp.h"
#include "bench_util.h"
#include <stdio.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static int threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* Times `body` (a statement) `reps` times after one warm-up; median seconds into *out. */
#define TIME(out, reps, body)                             \
    do {                                                  \
        double t_[64];                                    \
        body;                                             \
        for (int r_ = 0; r_ < (reps); r_++) {             \
            double t0_ = bench_now_s();                   \
            body;                                         \
            t_[r_] = bench_now_s() - t0_;                 \
        }                                                 \
        *(out) = bench_median(t_, (reps));                \
    } while (0)

enum { NT = 96 };

int main(int argc, char **argv) {
    int64_t mib = 256;
    int reps = 7;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--mib") && i + 1 < argc) mib = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--repeats") && i + 1 < argc) reps = atoi(argv[++i]);
        else { fprintf(stderr, "usage: bench_amp [--mib N] [--repeats R]\n"); return 2; }
    }
    if (reps < 1 || reps > 64 || mib < 1) { fprintf(stderr, "bench_amp: repeats in [1, 64], mib >= 1\n"); return 2; }
    int64_t total = mib * 1024 * 1024 / 4, per = total / NT;
    dsk_tensor g[NT], *gl[NT], dst, sq;
    float *buf = (float *)malloc((size_t)(per * NT) * 4), *copy = (float *)malloc((size_t)(per * NT) * 4);
    if (!buf || !copy) { fprintf(stderr, "bench_amp: out of memory\n"); return 1; }
    for (int64_t i = 0; i < per * NT; i++) buf[i] = (float)((i * 2654435761u) % 1000003) * 1e-3f + 0.5f;
    for (int i = 0; i < NT; i++) {
        BENCH_CHECK(dsk_tensor_wrap(&g[i], buf + i * per, DSK_F32, dsk_cpu(), 1, &per));
        gl[i] = &g[i];
    }
    BENCH_CHECK(dsk_tensor_alloc(NULL, &sq, DSK_F32, 0, NULL));
    dsk_amp_scaler sc;
    dsk_amp_scaler_opts so;
    memset(&so, 0, sizeof so);
    so.mode = DSK_AMP_STATIC;
    so.init_scale = 1.0f; /* x * 1 keeps the data stable across repeats; the work is the same */
    BENCH_CHECK(dsk_amp_scaler_init(&sc, NULL, &so));
    double bytes = (double)(per * NT) * 4.0, t_fused, t_copy, t_unfused;
    printf("# bench_amp: %d gradients of %lld f32 (%.0f MiB), median of %d, OpenMP threads %d\n", NT, (long long)per, bytes / 1048576.0, reps, threads());
    TIME(&t_fused, reps, BENCH_CHECK(dsk_amp_unscale(&sc, NULL, gl, NT)));
    TIME(&t_copy, reps, memcpy(copy, buf, (size_t)bytes));
    TIME(&t_unfused, reps, for (int i = 0; i < NT; i++) {
        BENCH_CHECK(dsk_scale(NULL, &g[i], 1.0f));
        BENCH_CHECK(dsk_sum_squares(NULL, &sq, &g[i]));
    });
    printf("unscale+check+sumsq fused   %8.2f ms  %6.2f GB/s (read+write)\n", 1e3 * t_fused, 2 * bytes / t_fused / 1e9);
    printf("memcpy same bytes (floor)   %8.2f ms  %6.2f GB/s   fused/memcpy time ratio %.2f\n", 1e3 * t_copy, 2 * bytes / t_copy / 1e9, t_fused / t_copy);
    printf("dsk_scale + dsk_sum_squares %8.2f ms  %6.2f GB/s   fused speedup x%.2f\n", 1e3 * t_unfused, 2 * bytes / t_unfused / 1e9, t_unfused / t_fused);

    /* copy refresh: SR vs RNE over one big master */
    {
        int64_t n = per * NT;
        dsk_tensor master;
        double t_sr, t_rne;
        BENCH_CHECK(dsk_tensor_wrap(&master, buf, DSK_F32, dsk_cpu(), 1, &n));
        BENCH_CHECK(dsk_tensor_alloc(NULL, &dst, DSK_BF16, 1, &n));
        TIME(&t_rne, reps, BENCH_CHECK(dsk_amp_cast(NULL, &dst, &master, DSK_AMP_ROUND_NEAREST, 1, 2, 3)));
        TIME(&t_sr, reps, BENCH_CHECK(dsk_amp_cast(NULL, &dst, &master, DSK_AMP_ROUND_STOCHASTIC, 1, 2, 3)));
        printf("f32->bf16 nearest           %8.2f ms  %6.2f GB/s\n", 1e3 * t_rne, 6.0 * n / t_rne / 1e9);
        printf("f32->bf16 stochastic        %8.2f ms  %6.2f GB/s   SR/RNE time ratio %.2f\n", 1e3 * t_sr, 6.0 * n / t_sr / 1e9, t_sr / t_rne);
        dsk_tensor_free(NULL, &dst);
    }
    /* fp8 128x128 blocks of a weight vs the bf16 cast of the same matrix */
    {
        int64_t C = 4096, R = per * NT / C, shape[2] = {R, C}, ss[2] = {(R + 127) / 128, (C + 127) / 128};
        dsk_tensor w, q, s, b;
        double t_q, t_c;
        BENCH_CHECK(dsk_tensor_wrap(&w, buf, DSK_F32, dsk_cpu(), 2, shape));
        BENCH_CHECK(dsk_tensor_alloc(NULL, &q, DSK_E4M3, 2, shape));
        BENCH_CHECK(dsk_tensor_alloc(NULL, &s, DSK_F32, 2, ss));
        BENCH_CHECK(dsk_tensor_alloc(NULL, &b, DSK_BF16, 2, shape));
        TIME(&t_q, reps, BENCH_CHECK(dsk_amp_fp8_block_quantize(NULL, &q, &s, &w, 128, 128, 0)));
        TIME(&t_c, reps, BENCH_CHECK(dsk_amp_cast(NULL, &b, &w, DSK_AMP_ROUND_NEAREST, 0, 0, 0)));
        printf("fp8 e4m3 128x128 blocks     %8.2f ms  %6.2f GB/s (read+write)\n", 1e3 * t_q, 5.0 * R * C / t_q / 1e9);
        printf("f32->bf16 nearest, same W   %8.2f ms  %6.2f GB/s   fp8/bf16 time ratio %.2f\n", 1e3 * t_c, 6.0 * R * C / t_c / 1e9, t_q / t_c);
        dsk_tensor_free(NULL, &q); dsk_tensor_free(NULL, &s); dsk_tensor_free(NULL, &b);
    }
    dsk_amp_scaler_free(&sc, NULL);
    dsk_tensor_free(NULL, &sq);
    free(buf); free(copy);
    return 0;
}
