/* bench_gpu_ops.c - dsk's CUDA ops against peers measured in the same run on the same GPU.

   Memory-bound ops (cast, strided copy, add, rmsnorm, softmax, adamw): achieved GB/s (the
   least bytes each op must read and write, over its time) against a cudaMemcpyAsync
   device-to-device copy moving the same number of bytes (half read, half written).
   GEMM: TFLOP/s of dsk_matmul (bf16 in, bf16 out, f32 accumulation) against a direct
   cublasGemmEx of the same problem on its own handle, square 8192 and MoE expert shapes.
   Each figure: 3 warm-up runs, then the median of 20 timed with CUDA events on the stream.
   Without CUDA (build or device) it says so and exits 0.
   Usage: bench_gpu_ops [--quick]   (--quick: smaller sizes, for a smoke run) */
#define DSK_TENSOR_IMPLEMENTATION
#include "dsk_tensor.h"
#include "bench_util.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef DSK_CUDA
int main(void) {
    printf("bench_gpu_ops: skipped (built without CUDA; build with make CUDA=1)\n");
    return 0;
}
#else
#include <cuda_runtime.h>
#include <cublas_v2.h>

#define WARMUP 3
#define REPS 20

static dsk_ctx G;

#define CHECK_CUBLAS(call)                                                                      \
    do {                                                                                        \
        cublasStatus_t s_ = (call);                                                             \
        if (s_ != CUBLAS_STATUS_SUCCESS) { fprintf(stderr, "bench_gpu_ops: %s: %d\n", #call, (int)s_); exit(1); } \
    } while (0)
#define CHECK_CUDA(call)                                                                        \
    do {                                                                                        \
        cudaError_t e_ = (call);                                                                \
        if (e_ != cudaSuccess) { fprintf(stderr, "bench_gpu_ops: %s: %s\n", #call, cudaGetErrorString(e_)); exit(1); } \
    } while (0)

typedef void (*bench_fn)(void *arg);

/* Median milliseconds of fn(arg) on the ctx stream. */
static double time_ms(bench_fn fn, void *arg) {
    cudaStream_t st = (cudaStream_t)G.stream;
    cudaEvent_t e0, e1;
    double ms[REPS];
    CHECK_CUDA(cudaEventCreate(&e0));
    CHECK_CUDA(cudaEventCreate(&e1));
    for (int i = 0; i < WARMUP; i++) fn(arg);
    CHECK_CUDA(cudaStreamSynchronize(st));
    for (int i = 0; i < REPS; i++) {
        CHECK_CUDA(cudaEventRecord(e0, st));
        fn(arg);
        CHECK_CUDA(cudaEventRecord(e1, st));
        CHECK_CUDA(cudaEventSynchronize(e1));
        float m;
        CHECK_CUDA(cudaEventElapsedTime(&m, e0, e1));
        ms[i] = m;
    }
    CHECK_CUDA(cudaEventDestroy(e0));
    CHECK_CUDA(cudaEventDestroy(e1));
    return bench_median(ms, REPS);
}

static dsk_tensor dalloc(dsk_dtype dt, int nd, const int64_t *shape, float lo, float hi) {
    dsk_tensor t;
    BENCH_CHECK(dsk_tensor_alloc(&G, &t, dt, nd, shape));
    BENCH_CHECK(dsk_tensor_uniform(&G, &t, 1234, 0, lo, hi));
    return t;
}

/* ------------------------------------------------------------------ memory-bound ops */

typedef struct op_args {
    dsk_tensor x, x2, y, yt, ybf, w, rstd, m, v; /* (R, D) f32 except yt (D, R), ybf bf16, w (D), rstd (R) */
    int64_t step;
    void *src, *dst;
    size_t bytes;
} op_args;

static void run_memcpy(void *p) {
    op_args *o = (op_args *)p;
    CHECK_CUDA(cudaMemcpyAsync(o->dst, o->src, o->bytes, cudaMemcpyDeviceToDevice, (cudaStream_t)G.stream));
}
static void run_cast(void *p) { op_args *o = (op_args *)p; BENCH_CHECK(dsk_tensor_copy(&G, &o->ybf, &o->x)); }
static void run_transpose(void *p) {
    op_args *o = (op_args *)p;
    dsk_tensor t;
    BENCH_CHECK(dsk_tensor_transpose(&o->x, 0, 1, &t));
    BENCH_CHECK(dsk_tensor_copy(&G, &o->yt, &t));
}
static void run_add(void *p) { op_args *o = (op_args *)p; BENCH_CHECK(dsk_add(&G, &o->y, &o->x, &o->x2)); }
static void run_rmsnorm(void *p) { op_args *o = (op_args *)p; BENCH_CHECK(dsk_rmsnorm(&G, &o->y, &o->rstd, &o->x, &o->w, 1e-6f)); }
static void run_softmax(void *p) { op_args *o = (op_args *)p; BENCH_CHECK(dsk_softmax(&G, &o->y, &o->x)); }
/* param y, grad x, moments m and v, bf16 copy ybf. */
static void run_adamw(void *p) {
    op_args *o = (op_args *)p;
    dsk_adamw_opts opts = dsk_adamw_defaults();
    BENCH_CHECK(dsk_adamw_step(&G, &o->y, &o->x, &o->m, &o->v, &opts, ++o->step, 1.0f, &o->ybf));
}

/* Times op and a memcpy of the same traffic; prints one row, returns the ratio. */
static double mem_row(const char *name, bench_fn fn, op_args *o, double bytes, void *scratch) {
    double t = time_ms(fn, o), tc, gbs, gbs_c;
    op_args m = *o;
    m.src = scratch;
    m.dst = (char *)scratch + (size_t)(bytes / 2);
    m.bytes = (size_t)(bytes / 2);
    tc = time_ms(run_memcpy, &m);
    gbs = bytes / (t * 1e-3) / 1e9;
    gbs_c = bytes / (tc * 1e-3) / 1e9;
    printf("%-34s %10.1f MB %9.3f ms %8.0f GB/s   memcpy %8.0f GB/s   ratio %.2f\n", name, bytes / 1e6, t, gbs, gbs_c, tc / t);
    return tc / t;
}

static void bench_memory(int quick, double *worst, char *summary, size_t summary_n) {
    static const char *names[6] = {"cast f32 -> bf16", "transpose copy (R, D) -> (D, R)", "add", "rmsnorm (R, 4096) with rstd",
                                   "softmax (R, 4096)", "adamw f32 grad, bf16 copy"};
    static const char *keys[6] = {"cast", "transpose", "add", "rmsnorm", "softmax", "adamw"};
    static const bench_fn fns[6] = {run_cast, run_transpose, run_add, run_rmsnorm, run_softmax, run_adamw};
    int64_t R = quick ? 1024 : 16384, D = 4096, n = R * D, shape[2] = {R, D}, tshape[2] = {D, R};
    double nn = (double)n, traffic[6];
    op_args o;
    void *scratch;
    size_t k = strlen(summary);
    /* The least bytes each op reads and writes. */
    traffic[0] = 6 * nn;
    traffic[1] = 8 * nn;
    traffic[2] = 12 * nn;
    traffic[3] = 8 * nn + 4.0 * (double)(R + D);
    traffic[4] = 8 * nn;
    traffic[5] = 30 * nn; /* read p m v g, write p m v, write the bf16 copy */
    memset(&o, 0, sizeof o);
    o.x = dalloc(DSK_F32, 2, shape, -1, 1);
    o.x2 = dalloc(DSK_F32, 2, shape, -1, 1);
    o.y = dalloc(DSK_F32, 2, shape, -1, 1);
    o.yt = dalloc(DSK_F32, 2, tshape, -1, 1);
    o.ybf = dalloc(DSK_BF16, 2, shape, -1, 1);
    o.w = dalloc(DSK_F32, 1, &D, 0.5f, 1.5f);
    o.rstd = dalloc(DSK_F32, 1, &R, 0, 1);
    o.m = dalloc(DSK_F32, 2, shape, -0.1f, 0.1f);
    o.v = dalloc(DSK_F32, 2, shape, 0, 0.01f);
    BENCH_CHECK(dsk_cuda_malloc(&G, (size_t)(30 * nn), &scratch));
    printf("\n%-34s %13s %12s %13s %20s\n", "op (f32 unless noted)", "least bytes", "median", "achieved", "peer");
    for (int i = 0; i < 6; i++) {
        double r = mem_row(names[i], fns[i], &o, traffic[i], scratch);
        if (i == 0 || r < *worst) *worst = r;
        k += (size_t)snprintf(summary + k, summary_n - k, "%s%s %.2f", i ? ", " : "", keys[i], r);
    }
    BENCH_CHECK(dsk_ctx_sync(&G));
    dsk_cuda_free(&G, scratch);
    /* The tensors live until the process exits right after the benchmarks. */
}

/* ------------------------------------------------------------------ GEMM */

typedef struct gemm_args {
    dsk_tensor A, B, C;
    int64_t M, N, K, batch;
    cublasHandle_t peer;
} gemm_args;

static void run_dsk_gemm(void *p) {
    gemm_args *g = (gemm_args *)p;
    BENCH_CHECK(dsk_matmul(&G, &g->C, &g->A, 0, &g->B, 0, 1.0f, 0.0f));
}

/* The same product straight through cuBLAS (row-major as C^T = B^T A^T). */
static void run_cublas_gemm(void *p) {
    gemm_args *g = (gemm_args *)p;
    float alpha = 1.0f, beta = 0.0f;
    cublasStatus_t st = cublasGemmStridedBatchedEx(
        g->peer, CUBLAS_OP_N, CUBLAS_OP_N, (int)g->N, (int)g->M, (int)g->K, &alpha, g->B.data, CUDA_R_16BF, (int)g->N,
        g->batch > 1 ? g->K * g->N : 0, g->A.data, CUDA_R_16BF, (int)g->K, g->batch > 1 ? g->M * g->K : 0, &beta, g->C.data,
        CUDA_R_16BF, (int)g->N, g->batch > 1 ? g->M * g->N : 0, (int)g->batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) { fprintf(stderr, "bench_gpu_ops: cublasGemmStridedBatchedEx: %d\n", (int)st); exit(1); }
}

static double gemm_row(const char *name, int64_t batch, int64_t M, int64_t N, int64_t K, cublasHandle_t peer, void *peer_ws,
                       size_t ws_bytes, double *tflops) {
    gemm_args g;
    double t, tp, flops = 2.0 * (double)batch * (double)M * (double)N * (double)K;
    int64_t sa[3] = {batch, M, K}, sb[3] = {batch, K, N}, sc[3] = {batch, M, N};
    int nd = batch > 1 ? 3 : 2;
    memset(&g, 0, sizeof g);
    g.A = dalloc(DSK_BF16, nd, nd == 3 ? sa : sa + 1, -1, 1);
    g.B = dalloc(DSK_BF16, nd, nd == 3 ? sb : sb + 1, -1, 1);
    g.C = dalloc(DSK_BF16, nd, nd == 3 ? sc : sc + 1, -1, 1);
    g.M = M; g.N = N; g.K = K; g.batch = batch; g.peer = peer;
    CHECK_CUBLAS(cublasSetWorkspace(peer, peer_ws, ws_bytes));
    t = time_ms(run_dsk_gemm, &g);
    tp = time_ms(run_cublas_gemm, &g);
    *tflops = flops / (t * 1e-3) / 1e12;
    printf("%-34s %9.3f ms %7.1f TFLOP/s   cuBLAS %7.1f TFLOP/s   ratio %.2f\n", name, t, *tflops, flops / (tp * 1e-3) / 1e12, tp / t);
    dsk_tensor_free(&G, &g.A);
    dsk_tensor_free(&G, &g.B);
    dsk_tensor_free(&G, &g.C);
    return tp / t;
}

static void bench_gemm(int quick, double *worst, double *tf8192, char *summary, size_t summary_n) {
    cublasHandle_t peer;
    void *ws;
    size_t ws_bytes = (size_t)32 << 20, k = strlen(summary);
    double r, tf;
    int64_t big = quick ? 2048 : 8192;
    char name[64];
    CHECK_CUBLAS(cublasCreate(&peer));
    CHECK_CUBLAS(cublasSetStream(peer, (cudaStream_t)G.stream));
    BENCH_CHECK(dsk_cuda_malloc(&G, ws_bytes, &ws));
    printf("\n%-34s %12s %15s %24s\n", "GEMM bf16 -> bf16, f32 accumulate", "median", "dsk_matmul", "direct cuBLAS");
    snprintf(name, sizeof name, "square %lld^3", (long long)big);
    *worst = gemm_row(name, 1, big, big, big, peer, ws, ws_bytes, tf8192);
    k += (size_t)snprintf(summary + k, summary_n - k, "gemm %lld^3 %.0f TFLOP/s (%.2fx cuBLAS)", (long long)big, *tf8192, *worst);
    /* DeepSeek-V3 expert: d_model 7168, hidden 2048; 4096 tokens routed to one expert. */
    r = gemm_row("expert up   4096 x 2048 x 7168", 1, 4096, 2048, 7168, peer, ws, ws_bytes, &tf);
    if (r < *worst) *worst = r;
    r = gemm_row("expert down 4096 x 7168 x 2048", 1, 4096, 7168, 2048, peer, ws, ws_bytes, &tf);
    if (r < *worst) *worst = r;
    /* V2-Lite-like: 8 local experts of 512 tokens, d_model 2048, hidden 1408, batched. */
    r = gemm_row("8 experts 512 x 1408 x 2048", 8, 512, 1408, 2048, peer, ws, ws_bytes, &tf);
    if (r < *worst) *worst = r;
    k += (size_t)snprintf(summary + k, summary_n - k, ", MoE shapes worst %.2fx cuBLAS", *worst);
    BENCH_CHECK(dsk_ctx_sync(&G));
    dsk_cuda_free(&G, ws);
    cublasDestroy(peer);
}

int main(int argc, char **argv) {
    dsk_ctx_opts o;
    struct cudaDeviceProp prop;
    int quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    double mem_worst = 0, gemm_worst = 0, tf = 0;
    char mem_summary[256] = "", gemm_summary[256] = "";
    if (!dsk_cuda_available()) {
        printf("bench_gpu_ops: skipped (no usable CUDA device or driver)\n");
        return 0;
    }
    memset(&o, 0, sizeof o);
    o.device = DSK_PREFER_CUDA;
    BENCH_CHECK(dsk_ctx_init(&G, &o));
    CHECK_CUDA(cudaGetDeviceProperties(&prop, G.device.index));
    printf("bench_gpu_ops: %s, %d SMs, %.0f GiB%s; median of %d after %d warm-up\n", prop.name, prop.multiProcessorCount,
           (double)prop.totalGlobalMem / (1 << 30), quick ? ", --quick sizes" : "", REPS, WARMUP);
    bench_memory(quick, &mem_worst, mem_summary, sizeof mem_summary);
    bench_gemm(quick, &gemm_worst, &tf, gemm_summary, sizeof gemm_summary);
    printf("\nsummary: memory-bound vs memcpy: %s (worst %.2f)\n", mem_summary, mem_worst);
    printf("summary: %s\n", gemm_summary);
    dsk_ctx_free(&G);
    return 0;
}
#endif
