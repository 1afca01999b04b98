/* bench/bench_moe.c - forward + backward tokens/s of the dsk MoE layer against the same layer in
   PyTorch (bench/moe_torch.py, a Hugging Face style loop over experts) on the same inputs and
   weights, in one run: warm-up, repeats, median, ratio. CPU f32 by default; with a GPU
   (`--cuda`, CUDA build) the dsk layer runs on the device in bf16 (the PyTorch peer too, when its
   torch has CUDA; else no ratio), and two more lines per shape: the grouped expert GEMM
   (dsk_matmul_grouped, balanced segments) in TFLOP/s against one dense cuBLAS GEMM of the same
   FLOPs, and the step time of forward + backward replayed as one CUDA graph against eager.
   Shapes (scaled to a 2-core machine; pass --full for the real widths):
     v2lite: softmax, 64 routed, top-6, 2 shared, no normalisation   D 1024, F 704  (full: 2048, 1408)
     v3:     sigmoid, 64 routed, 8 groups, top-4 groups, top-8, 1 shared, norm, scale 2.5
                                                                      D 1024, F 256  (full: 7168, 2048)
   --tiny: D 64, F 32 (a smoke run of every path, e.g. on the emulated GPU of tests/cuda_emu).
   --no-peer: no PyTorch run (bench/moe_before_after.sh times the layer alone between runs of the
   layer before the redesign, bench/moe_old/bench_moe_old.c).
   Usage: bench_moe [--tokens T] [--repeats N] [--full | --tiny] [--python /usr/bin/python3] [--cuda] [--no-peer] */
#define DSK_TENSOR_IMPLEMENTATION
#define DSK_COMM_IMPLEMENTATION
#define DSK_MOE_IMPLEMENTATION
#include "dsk_comm.h"
#include "dsk_moe.h"
#include "bench_util.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct shape {
    const char *name;
    int D, E, K, F, n_shared, n_group, topk_group;
    dsk_moe_score score;
    float scale;
} shape;

/* Appends the f32 contents of t (any device/dtype) to f. */
static void write_f32(dsk_ctx *ctx, FILE *f, const dsk_tensor *t) {
    int64_t n = dsk_tensor_numel(t);
    float *h = (float *)malloc(sizeof(float) * (size_t)(n ? n : 1));
    dsk_tensor ht;
    BENCH_CHECK(dsk_tensor_wrap(&ht, h, DSK_F32, dsk_cpu(), t->ndim, t->shape));
    BENCH_CHECK(dsk_tensor_copy(ctx, &ht, t));
    if (fwrite(h, sizeof(float), (size_t)n, f) != (size_t)n) { fprintf(stderr, "bench_moe: write failed\n"); exit(1); }
    free(h);
}

#ifdef DSK_CUDA
/* Median seconds of `reps` timed calls of one GEMM (after 2 warm-up calls); grouped: offsets given. */
static double time_gemm(dsk_ctx *ctx, dsk_tensor *c, const dsk_tensor *a, const dsk_tensor *b, const dsk_tensor *off) {
    double t[10];
    for (int i = 0; i < 12; i++) {
        double t0 = bench_now_s();
        if (off) BENCH_CHECK(dsk_matmul_grouped(ctx, c, a, 0, b, 1, off, 1.0f, 0.0f));
        else BENCH_CHECK(dsk_matmul(ctx, c, a, 0, b, 1, 1.0f, 0.0f));
        BENCH_CHECK(dsk_ctx_sync(ctx));
        if (i >= 2) t[i - 2] = bench_now_s() - t0;
    }
    return bench_median(t, 10);
}

/* The routed experts' first GEMM as the layer runs it, dsk_matmul_grouped over E segments of
   the T*K routed rows (balanced: T*K/E rows each; offsets on the device), against one dense
   cuBLAS GEMM of the same FLOPs (M = T*K, N = F, K = D): bf16 in and out, f32 accumulation. */
static void report_gemms(dsk_ctx *ctx, const shape *sh, int T, double layer_flops_s) {
    int64_t M = (int64_t)T * sh->K, N = sh->F, Kd = sh->D, E = sh->E;
    int64_t sa[2] = {M, Kd}, sb[2] = {N, Kd}, sg[3] = {E, N, Kd}, sc[2] = {M, N}, so = E + 1;
    int32_t *ho = (int32_t *)malloc(sizeof(int32_t) * (size_t)so);
    dsk_tensor a, b, bg, c, off, hoff;
    double dense, grouped;
    for (int64_t g = 0; g <= E; g++) ho[g] = (int32_t)(M * g / E);
    BENCH_CHECK(dsk_tensor_alloc(ctx, &a, DSK_BF16, 2, sa));
    BENCH_CHECK(dsk_tensor_alloc(ctx, &b, DSK_BF16, 2, sb));
    BENCH_CHECK(dsk_tensor_alloc(ctx, &bg, DSK_BF16, 3, sg));
    BENCH_CHECK(dsk_tensor_alloc(ctx, &c, DSK_BF16, 2, sc));
    BENCH_CHECK(dsk_tensor_alloc(ctx, &off, DSK_I32, 1, &so));
    BENCH_CHECK(dsk_tensor_wrap(&hoff, ho, DSK_I32, dsk_cpu(), 1, &so));
    BENCH_CHECK(dsk_tensor_copy(ctx, &off, &hoff));
    BENCH_CHECK(dsk_tensor_uniform(ctx, &a, 7, 0, -1, 1));
    BENCH_CHECK(dsk_tensor_uniform(ctx, &b, 8, 0, -1, 1));
    BENCH_CHECK(dsk_tensor_uniform(ctx, &bg, 9, 0, -1, 1));
    dense = 2.0 * (double)M * N * Kd / time_gemm(ctx, &c, &a, &b, NULL);
    grouped = 2.0 * (double)M * N * Kd / time_gemm(ctx, &c, &a, &bg, &off);
    printf("%-7s grouped bf16 GEMM (%lld segments of %lld rows) x (%lld x %lld): %.1f TFLOP/s; dense cuBLAS %lldx%lldx%lld: "
           "%.1f TFLOP/s (grouped = %.0f%%); the whole layer: %.1f TFLOP/s\n",
           sh->name, (long long)E, (long long)(M / E), (long long)Kd, (long long)N, grouped * 1e-12, (long long)M, (long long)N,
           (long long)Kd, dense * 1e-12, 100.0 * grouped / dense, layer_flops_s * 1e-12);
    printf("summary: moe %s cuda: grouped GEMM %.1f TFLOP/s = %.0f%% of dense cuBLAS %.1f TFLOP/s; layer %.1f TFLOP/s\n", sh->name,
           grouped * 1e-12, 100.0 * grouped / dense, dense * 1e-12, layer_flops_s * 1e-12);
    dsk_tensor_free(ctx, &a); dsk_tensor_free(ctx, &b); dsk_tensor_free(ctx, &bg); dsk_tensor_free(ctx, &c);
    dsk_tensor_free(ctx, &off);
    free(ho);
}

/* Forward + backward captured once as a CUDA graph (buffers reserved first), then replayed:
   the median step against the eager one (what train_moe --cuda-graph saves per layer). */
static void report_graph(dsk_ctx *ctx, const char *label, dsk_moe *m, dsk_tensor *y, dsk_tensor *dx, const dsk_tensor *x,
                         const dsk_tensor *dy, int T, int repeats, double eager_ms) {
    dsk_graph g;
    dsk_status s1, s2, s3;
    double *t = (double *)malloc(sizeof(double) * (size_t)repeats), ms;
    memset(&g, 0, sizeof g);
    BENCH_CHECK(dsk_moe_reserve(m, ctx, T));
    BENCH_CHECK(dsk_graph_begin(ctx));
    s1 = dsk_tensor_fill(ctx, dx, 0.0);
    s2 = dsk_moe_forward(m, ctx, y, x, NULL);
    s3 = dsk_moe_backward(m, ctx, dx, dy, 1.0f);
    BENCH_CHECK(dsk_graph_end(ctx, &g));
    BENCH_CHECK(s1); BENCH_CHECK(s2); BENCH_CHECK(s3);
    for (int it = 0; it < 1 + repeats; it++) {
        double t0 = bench_now_s();
        BENCH_CHECK(dsk_graph_launch(ctx, &g));
        BENCH_CHECK(dsk_ctx_sync(ctx));
        if (it >= 1) t[it - 1] = bench_now_s() - t0;
    }
    ms = 1e3 * bench_median(t, repeats);
    printf("%-7s forward+backward as one CUDA graph: %.2f ms/step (eager %.2f ms, %.0f%%)\n", label, ms, eager_ms,
           100.0 * ms / eager_ms);
    printf("summary: moe %s cuda: step eager %.2f ms, graph %.2f ms, %.0f tok/s eager\n", label, eager_ms, ms,
           T / (eager_ms * 1e-3));
    dsk_graph_free(&g);
    free(t);
}
#endif

static void run_shape(const shape *sh, int T, int warmup, int repeats, const char *python, dsk_ctx *ctx) {
    /* python NULL: no PyTorch peer */
    dsk_moe m;
    dsk_tensor values, grads;
    int64_t vb, gd, gs;
    dsk_moe_opts o;
    dsk_moe_stats st;
    dsk_tensor x, y, dx, dy;
    int64_t shp[2] = {T, sh->D};
    dsk_dtype dt = ctx->device.type == DSK_DEV_CUDA ? DSK_BF16 : DSK_F32;
    double *times = (double *)malloc(sizeof(double) * (size_t)repeats), dsk_ms, cpu_ms, torch_ms = 0, maxrel = -1;
    double *cpu_times = (double *)malloc(sizeof(double) * (size_t)repeats);
    double flops_tok, Fs = (double)sh->n_shared * sh->F;
    char path[256], cmd[1024], line[256];
    FILE *f, *p;
    memset(&o, 0, sizeof o);
    o.d_model = sh->D; o.n_routed = sh->E; o.top_k = sh->K; o.d_expert = sh->F; o.n_shared = sh->n_shared;
    o.score = sh->score; o.n_group = sh->n_group; o.topk_group = sh->topk_group; o.routed_scale = sh->scale;
    o.dtype = dt; o.seed = 1234;
    BENCH_CHECK(dsk_moe_init(&m, ctx, &o));
    dsk_moe_slab_sizes(&m, &vb, &gd, &gs);
    gd += gs;
    BENCH_CHECK(dsk_tensor_alloc(ctx, &values, DSK_U8, 1, &vb));
    BENCH_CHECK(dsk_tensor_alloc(ctx, &grads, DSK_F32, 1, &gd));
    BENCH_CHECK(dsk_moe_bind_slabs(&m, ctx, &values, &grads));
    BENCH_CHECK(dsk_moe_init_params(&m, ctx));
    BENCH_CHECK(dsk_tensor_fill(ctx, &grads, 0.0));
    BENCH_CHECK(dsk_tensor_alloc(ctx, &x, dt, 2, shp));
    BENCH_CHECK(dsk_tensor_alloc(ctx, &y, dt, 2, shp));
    BENCH_CHECK(dsk_tensor_alloc(ctx, &dx, dt, 2, shp));
    BENCH_CHECK(dsk_tensor_alloc(ctx, &dy, dt, 2, shp));
    BENCH_CHECK(dsk_tensor_uniform(ctx, &x, 1, 0, -1.0f, 1.0f));
    BENCH_CHECK(dsk_tensor_uniform(ctx, &dy, 2, 0, -1.0f, 1.0f));
    BENCH_CHECK(dsk_tensor_fill(ctx, &dx, 0.0));
    BENCH_CHECK(dsk_tensor_uniform(ctx, &m.bias->value, 3, 0, -1e-3f, 1e-3f));
    for (int it = 0; it < warmup + repeats; it++) {
        double t0 = bench_now_s(), c0 = bench_cpu_s();
        BENCH_CHECK(dsk_moe_forward(&m, ctx, &y, &x, NULL));
        BENCH_CHECK(dsk_moe_backward(&m, ctx, &dx, &dy, 1.0f));
        BENCH_CHECK(dsk_ctx_sync(ctx));
        if (it >= warmup) times[it - warmup] = bench_now_s() - t0;
        if (it >= warmup) cpu_times[it - warmup] = bench_cpu_s() - c0;
    }
    dsk_ms = 1e3 * bench_median(times, repeats);
    cpu_ms = 1e3 * bench_median(cpu_times, repeats);
    BENCH_CHECK(dsk_moe_stats_request(&m, ctx)); /* the loads of every timed call, read after their sync */
    BENCH_CHECK(dsk_ctx_sync(ctx));
    BENCH_CHECK(dsk_moe_stats_collect(&m, ctx, &st));
    if (ctx->device.type == DSK_DEV_CPU) { /* the check bench/moe_before_after.sh makes: old and new gave the same y */
        double ysum = 0;
        for (int64_t i = 0; i < (int64_t)T * sh->D; i++) ysum += ((const float *)y.data)[i];
        printf("%-7s ysum=%.17g\n", sh->name, ysum);
    }
    /* 3 GEMMs forward, 6 backward, 2 flops per multiply-add */
    flops_tok = 18.0 * sh->D * ((double)sh->K * sh->F + Fs) + 6.0 * sh->D * sh->E;
    printf("%-7s T=%d D=%d E=%d K=%d F=%d shared=%d %s%s: dsk %.1f ms/step, %.0f tokens/s, %.1f GFLOP/s, max/mean load %.2f; CPU time %.1f ms/step\n",
           sh->name, T, sh->D, sh->E, sh->K, sh->F, sh->n_shared, dsk_dtype_name(dt), ctx->device.type == DSK_DEV_CUDA ? " cuda" : "",
           dsk_ms, T / (dsk_ms * 1e-3), flops_tok * T / (dsk_ms * 1e-3) * 1e-9, st.max_load / st.mean_load, cpu_ms);
    if (!python) goto peer_done;
    /* the same inputs and weights for the PyTorch peer */
    snprintf(path, sizeof path, "/tmp/dsk_bench_moe_%d.bin", (int)getpid());
    f = fopen(path, "wb");
    if (!f) { fprintf(stderr, "bench_moe: cannot write %s\n", path); exit(1); }
    write_f32(ctx, f, &x); write_f32(ctx, f, &dy);
    write_f32(ctx, f, &m.router->value); write_f32(ctx, f, &m.bias->value);
    write_f32(ctx, f, &m.w1->value); write_f32(ctx, f, &m.w2->value); write_f32(ctx, f, &m.w3->value);
    if (sh->n_shared) { write_f32(ctx, f, &m.sw1->value); write_f32(ctx, f, &m.sw2->value); write_f32(ctx, f, &m.sw3->value); }
    write_f32(ctx, f, &y);
    fclose(f);
    snprintf(cmd, sizeof cmd, "%s bench/moe_torch.py %s %d %d %d %d %d %d %d %d %g %d %d %d %d %d %s", python, path, T, sh->D,
             sh->E, sh->K, sh->F, (int)Fs, sh->score == DSK_MOE_SIGMOID, m.opts.norm == DSK_MOE_NORM_ON, (double)sh->scale,
             m.opts.n_group, m.opts.topk_group, warmup, repeats, ctx->n_threads > 0 ? ctx->n_threads : 2,
             ctx->device.type == DSK_DEV_CUDA ? "cuda" : "cpu");
    p = popen(cmd, "r");
    while (p && fgets(line, sizeof line, p)) sscanf(line, "torch_ms=%lf maxrel=%lf", &torch_ms, &maxrel);
    if (p) pclose(p);
    remove(path);
    if (torch_ms > 0) {
        printf("%-7s PyTorch %.1f ms/step, %.0f tokens/s (outputs agree to %.2g relative)   ratio dsk/PyTorch: %.2fx\n", sh->name,
               torch_ms, T / (torch_ms * 1e-3), maxrel, torch_ms / dsk_ms);
        printf("summary: moe %s %s: dsk %.0f tok/s, PyTorch %.0f tok/s, %.2fx\n", sh->name, ctx->device.type == DSK_DEV_CUDA ? "cuda bf16" : "cpu f32",
               T / (dsk_ms * 1e-3), T / (torch_ms * 1e-3), torch_ms / dsk_ms);
    } else {
        printf("%-7s PyTorch peer did not run (%s)\n", sh->name, cmd);
        printf("summary: moe %s %s: dsk %.0f tok/s, no PyTorch peer\n", sh->name, ctx->device.type == DSK_DEV_CUDA ? "cuda bf16" : "cpu f32",
               T / (dsk_ms * 1e-3));
    }
peer_done:
#ifdef DSK_CUDA
    if (ctx->device.type == DSK_DEV_CUDA) {
        report_gemms(ctx, sh, T, flops_tok * T / (dsk_ms * 1e-3));
        report_graph(ctx, sh->name, &m, &y, &dx, &x, &dy, T, repeats, dsk_ms);
    }
#endif
    fflush(stdout);
    dsk_tensor_free(ctx, &x); dsk_tensor_free(ctx, &y); dsk_tensor_free(ctx, &dx); dsk_tensor_free(ctx, &dy);
    dsk_moe_free(&m, ctx);
    dsk_tensor_free(ctx, &values);
    dsk_tensor_free(ctx, &grads);
    free(times);
    free(cpu_times);
}

int main(int argc, char **argv) {
    int T = 1024, repeats = 5, warmup = 1, full = 0, tiny = 0, cuda = 0, peer = 1;
    const char *python = "/usr/bin/python3";
    dsk_ctx ctx;
    dsk_ctx_opts co;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tokens") && i + 1 < argc) T = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--repeats") && i + 1 < argc) repeats = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--python") && i + 1 < argc) python = argv[++i];
        else if (!strcmp(argv[i], "--full")) full = 1;
        else if (!strcmp(argv[i], "--tiny")) tiny = 1;
        else if (!strcmp(argv[i], "--cuda")) cuda = 1;
        else if (!strcmp(argv[i], "--no-peer")) peer = 0;
        else {
            fprintf(stderr, "usage: %s [--tokens T] [--repeats N] [--full | --tiny] [--python PATH] [--cuda] "
                            "[--no-peer]\n", argv[0]);
            return 2;
        }
    }
    if (T < 1 || repeats < 1) { fprintf(stderr, "bench_moe: --tokens and --repeats must be >= 1\n"); return 2; }
    memset(&co, 0, sizeof co);
    co.device = cuda ? DSK_PREFER_CUDA : DSK_PREFER_CPU;
    BENCH_CHECK(dsk_ctx_init(&ctx, &co));
    {
        shape v2 = {"v2lite", full ? 2048 : 1024, 64, 6, full ? 1408 : 704, 2, 1, 1, DSK_MOE_SOFTMAX, 1.0f};
        shape v3 = {"v3", full ? 7168 : 1024, 64, 8, full ? 2048 : 256, 1, 8, 4, DSK_MOE_SIGMOID, 2.5f};
        if (tiny) { v2.D = v3.D = 64; v2.F = v3.F = 32; }
        printf("# bench_moe: forward+backward, %d tokens, median of %d after %d warm-up, %d threads\n", T, repeats, warmup, ctx.n_threads);
        run_shape(&v2, T, warmup, repeats, peer ? python : NULL, &ctx);
        run_shape(&v3, T, warmup, repeats, peer ? python : NULL, &ctx);
    }
    dsk_ctx_free(&ctx);
    return 0;
}
