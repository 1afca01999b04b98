/* bench/moe_old/bench_moe_old.c - bench_moe's CPU timing loop on the MoE layer as it was before
   issue 13's redesign (dsk_moe.h of commit 7a9d942, built against this tree's dsk_tensor.h as
   tests/golden/gen_moe_golden.c builds it), for bench/moe_before_after.sh to time old against
   new in one run. Same shapes, seeds, inputs, expert bias and timing as bench/bench_moe.c's
   run_shape (forward + backward, median after a warm-up, wall and CPU time); prints one line per
   shape:
       old <shape> T=<T> wall_ms=<median> cpu_ms=<median> load=<max/mean> ysum=<sum of y in f64>
   ysum lets the script check that both layers computed the same y. Not built by the Makefile
   (it needs the old header): the script builds it with -I<dir holding the old dsk_moe.h>.
   Usage: bench_moe_old [--tokens T] [--repeats N] */
#define DSK_TENSOR_IMPLEMENTATION
#define DSK_COMM_IMPLEMENTATION
#define DSK_MOE_IMPLEMENTATION
#include "dsk_comm.h"
#include "dsk_moe.h" /* the old one: found first on the include path */
#include "bench/bench_util.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double cpu_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct shape {
    const char *name;
    int D, E, K, F, n_shared, n_group, topk_group;
    dsk_moe_score score;
    float scale;
} shape;

static void run_shape(const shape *sh, int T, int warmup, int repeats, dsk_ctx *ctx) {
    dsk_moe m;
    dsk_moe_opts o;
    dsk_moe_stats st;
    dsk_tensor x, y, dx, dy;
    int64_t shp[2] = {T, sh->D};
    double *wall = (double *)malloc(sizeof(double) * (size_t)repeats);
    double *cpu = (double *)malloc(sizeof(double) * (size_t)repeats);
    double ysum = 0;
    memset(&o, 0, sizeof o);
    o.d_model = sh->D; o.n_routed = sh->E; o.top_k = sh->K; o.d_expert = sh->F; o.n_shared = sh->n_shared;
    o.score = sh->score; o.n_group = sh->n_group; o.topk_group = sh->topk_group; o.routed_scale = sh->scale;
    o.dtype = DSK_F32; o.seed = 1234;
    BENCH_CHECK(dsk_moe_init(&m, ctx, &o));
    BENCH_CHECK(dsk_tensor_alloc(ctx, &x, DSK_F32, 2, shp));
    BENCH_CHECK(dsk_tensor_alloc(ctx, &y, DSK_F32, 2, shp));
    BENCH_CHECK(dsk_tensor_alloc(ctx, &dx, DSK_F32, 2, shp));
    BENCH_CHECK(dsk_tensor_alloc(ctx, &dy, DSK_F32, 2, shp));
    BENCH_CHECK(dsk_tensor_uniform(ctx, &x, 1, 0, -1.0f, 1.0f));
    BENCH_CHECK(dsk_tensor_uniform(ctx, &dy, 2, 0, -1.0f, 1.0f));
    BENCH_CHECK(dsk_tensor_fill(ctx, &dx, 0.0));
    BENCH_CHECK(dsk_tensor_uniform(ctx, &m.bias->value, 3, 0, -1e-3f, 1e-3f));
    for (int it = 0; it < warmup + repeats; it++) {
        double t0 = bench_now_s(), c0 = cpu_now_s();
        BENCH_CHECK(dsk_moe_forward(&m, ctx, &y, &x, &st));
        BENCH_CHECK(dsk_moe_backward(&m, ctx, &dx, &dy, 1.0f));
        if (it >= warmup) {
            wall[it - warmup] = bench_now_s() - t0;
            cpu[it - warmup] = cpu_now_s() - c0;
        }
    }
    for (int64_t i = 0; i < (int64_t)T * sh->D; i++) ysum += ((const float *)y.data)[i];
    printf("old %s T=%d wall_ms=%.1f cpu_ms=%.1f load=%.2f ysum=%.17g\n", sh->name, T,
           1e3 * bench_median(wall, repeats), 1e3 * bench_median(cpu, repeats), st.max_load / st.mean_load, ysum);
    fflush(stdout);
    dsk_tensor_free(ctx, &x); dsk_tensor_free(ctx, &y); dsk_tensor_free(ctx, &dx); dsk_tensor_free(ctx, &dy);
    dsk_moe_free(&m, ctx);
    free(wall);
    free(cpu);
}

int main(int argc, char **argv) {
    int T = 1024, repeats = 5, warmup = 1;
    dsk_ctx ctx;
    dsk_ctx_opts co;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tokens") && i + 1 < argc) T = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--repeats") && i + 1 < argc) repeats = atoi(argv[++i]);
        else { fprintf(stderr, "usage: %s [--tokens T] [--repeats N]\n", argv[0]); return 2; }
    }
    if (T < 1 || repeats < 1) { fprintf(stderr, "bench_moe_old: --tokens and --repeats must be >= 1\n"); return 2; }
    memset(&co, 0, sizeof co);
    co.device = DSK_PREFER_CPU;
    BENCH_CHECK(dsk_ctx_init(&ctx, &co));
    {
        shape v2 = {"v2lite", 1024, 64, 6, 704, 2, 1, 1, DSK_MOE_SOFTMAX, 1.0f};
        shape v3 = {"v3", 1024, 64, 8, 256, 1, 8, 4, DSK_MOE_SIGMOID, 2.5f};
        run_shape(&v2, T, warmup, repeats, &ctx);
        run_shape(&v3, T, warmup, repeats, &ctx);
    }
    dsk_ctx_free(&ctx);
    return 0;
}
