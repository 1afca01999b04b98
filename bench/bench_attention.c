/* bench_attention.c - the fused causal attention (dsk_attention_fused, O(T) memory) against the
   materialised one (dsk_attention, which keeps the (B, H, T, T) probabilities), same run, same
   threads, same inputs.

   CPU: for T = 256 .. --tmax (doubling), f32, (B, H, Dh) = (1, --heads, --dim): the median of
   --repeats forward+backward passes of each (one warm-up), GFLOP/s counted as causal attention
   (forward T^2 (Dk + Dv) per head, backward 2.5 times that), the ratio materialised / fused,
   and the peak memory each needs beyond its inputs, outputs and gradients: the growth of the
   peak resident set of a forked child that runs one forward+backward (the materialised path's
   probabilities are allocated inside it, as a trainer must keep them from forward to backward).
   GPU (--gpu): bf16, T = 4096, (B, H, Dh) = (1, 16, 128): forward and backward TFLOP/s of the
   fused kernels and the materialised path's time as the peer; "summary:" lines for
   scripts/device_check.sh.
   Usage: bench_attention [--threads N] [--heads H] [--dim D] [--tmin T] [--tmax T] [--repeats R] [--gpu] */
#define _POSIX_C_SOURCE 200809L
#define DSK_TENSOR_IMPLEMENTATION
#include "dsk_tensor.h"
#include "bench_util.h"

#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

typedef struct bench_cfg {
    int threads, heads, dim, tmin, tmax, repeats, gpu;
} bench_cfg;

/* The tensors of one shape on ctx's device; probs only for the materialised path. */
typedef struct bench_set {
    dsk_tensor q, k, v, out, dout, dq, dk, dv, lse, probs;
} bench_set;

static void set_alloc(dsk_ctx *ctx, bench_set *s, dsk_dtype dt, int64_t T, int64_t H, int64_t D) {
    int64_t sh[4] = {1, T, H, D}, ls[3] = {1, H, T};
    dsk_tensor *t[8] = {&s->q, &s->k, &s->v, &s->out, &s->dout, &s->dq, &s->dk, &s->dv};
    memset(s, 0, sizeof *s);
    for (int i = 0; i < 8; i++) {
        BENCH_CHECK(dsk_tensor_alloc(ctx, t[i], dt, 4, sh));
        BENCH_CHECK(dsk_tensor_normal(ctx, t[i], 17, (uint64_t)i << 40, 0.0f, 1.0f));
    }
    BENCH_CHECK(dsk_tensor_alloc(ctx, &s->lse, DSK_F32, 3, ls));
    BENCH_CHECK(dsk_tensor_fill(ctx, &s->lse, 0.0));
}

static void set_free(dsk_ctx *ctx, bench_set *s) {
    dsk_tensor *t[10] = {&s->q, &s->k, &s->v, &s->out, &s->dout, &s->dq, &s->dk, &s->dv, &s->lse, &s->probs};
    for (int i = 0; i < 10; i++) dsk_tensor_free(ctx, t[i]);
}

static void alloc_probs(dsk_ctx *ctx, bench_set *s) {
    int64_t ps[4] = {1, s->q.shape[2], s->q.shape[1], s->q.shape[1]};
    BENCH_CHECK(dsk_tensor_alloc(ctx, &s->probs, DSK_F32, 4, ps));
}

static void run_fwd(dsk_ctx *ctx, bench_set *s, int fused, float scale) {
    if (fused) BENCH_CHECK(dsk_attention_fused(ctx, &s->out, &s->lse, &s->q, &s->k, &s->v, scale));
    else BENCH_CHECK(dsk_attention(ctx, &s->out, &s->probs, &s->q, &s->k, &s->v, scale));
}
static void run_bwd(dsk_ctx *ctx, bench_set *s, int fused, float scale) {
    if (fused)
        BENCH_CHECK(dsk_attention_fused_backward(ctx, &s->dq, &s->dk, &s->dv, &s->dout, &s->q, &s->k, &s->v, &s->out,
                                                 &s->lse, scale, DSK_GRAD_ADD));
    else
        BENCH_CHECK(dsk_attention_backward(ctx, &s->dq, &s->dk, &s->dv, &s->dout, &s->q, &s->k, &s->v, &s->probs, scale,
                                           DSK_GRAD_ADD));
}

/* Median seconds of forward (*fwd) and backward (*bwd) over r repeats after a warm-up. */
static void time_passes(dsk_ctx *ctx, bench_set *s, int fused, float scale, int r, double *fwd, double *bwd) {
    double f[32], b[32];
    run_fwd(ctx, s, fused, scale);
    run_bwd(ctx, s, fused, scale);
    BENCH_CHECK(dsk_ctx_sync(ctx));
    for (int i = 0; i < r; i++) {
        double t0 = bench_now_s(), t1, t2;
        run_fwd(ctx, s, fused, scale);
        BENCH_CHECK(dsk_ctx_sync(ctx));
        t1 = bench_now_s();
        run_bwd(ctx, s, fused, scale);
        BENCH_CHECK(dsk_ctx_sync(ctx));
        t2 = bench_now_s();
        f[i] = t1 - t0;
        b[i] = t2 - t1;
    }
    *fwd = bench_median(f, r);
    *bwd = bench_median(b, r);
}

static long maxrss_kb(void) {
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return u.ru_maxrss;
}

/* Peak resident growth (MiB) of one forward+backward in a forked child, inputs made before. */
static double peak_extra_mib(dsk_ctx *ctx, int64_t T, int64_t H, int64_t D, int fused, float scale) {
    int fd[2];
    pid_t pid;
    double mib = -1;
    if (pipe(fd) != 0) return -1;
    pid = fork();
    if (pid == 0) {
        bench_set s;
        long before;
        double d;
        close(fd[0]);
        set_alloc(ctx, &s, DSK_F32, T, H, D);
        before = maxrss_kb();
        if (!fused) alloc_probs(ctx, &s);
        run_fwd(ctx, &s, fused, scale);
        run_bwd(ctx, &s, fused, scale);
        d = (double)(maxrss_kb() - before) / 1024.0;
        if (write(fd[1], &d, sizeof d) != (ssize_t)sizeof d) _exit(1);
        _exit(0);
    }
    close(fd[1]);
    if (pid > 0) {
        if (read(fd[0], &mib, sizeof mib) != (ssize_t)sizeof mib) mib = -1;
        waitpid(pid, NULL, 0);
    }
    close(fd[0]);
    return mib;
}

static void bench_cpu(const bench_cfg *c) {
    dsk_ctx ctx;
    dsk_ctx_opts o;
    int64_t H = c->heads, D = c->dim;
    double pf_mib[16], pm_mib[16];
    float scale = 1.0f / sqrtf((float)D);
    memset(&o, 0, sizeof o);
    o.device = DSK_PREFER_CPU;
    o.n_threads = c->threads;
    BENCH_CHECK(dsk_ctx_init(&ctx, &o));
    printf("CPU, f32, B 1, H %lld, Dh %lld, %d threads, median of %d (forward / backward seconds; GFLOP/s of causal attention)\n",
           (long long)H, (long long)D, c->threads, c->repeats);
    printf("%6s | %9s %9s %7s %9s | %9s %9s %7s %9s | %7s %9s\n", "T", "fused fwd", "bwd", "GF/s", "peak MiB", "mat. fwd", "bwd", "GF/s",
           "peak MiB", "time x", "memory x");
    /* The memory children first: libgomp cannot run in a child forked after the parent used it. */
    for (int64_t T = c->tmin, i = 0; T <= c->tmax && i < 16; T *= 2, i++) {
        pf_mib[i] = peak_extra_mib(&ctx, T, H, D, 1, scale);
        pm_mib[i] = peak_extra_mib(&ctx, T, H, D, 0, scale);
    }
    for (int64_t T = c->tmin, i = 0; T <= c->tmax && i < 16; T *= 2, i++) {
        bench_set s;
        double ff, fb, mf, mb, pf = pf_mib[i], pm = pm_mib[i], flops = (double)T * (double)T * (double)(2 * D) * (double)H * 3.5;
        set_alloc(&ctx, &s, DSK_F32, T, H, D);
        time_passes(&ctx, &s, 1, scale, c->repeats, &ff, &fb);
        alloc_probs(&ctx, &s);
        time_passes(&ctx, &s, 0, scale, c->repeats, &mf, &mb);
        set_free(&ctx, &s);
        printf("%6lld | %9.4f %9.4f %7.1f %9.1f | %9.4f %9.4f %7.1f %9.1f | %7.2f %9.1f\n", (long long)T, ff, fb, flops / (ff + fb) * 1e-9, pf, mf,
               mb, flops / (mf + mb) * 1e-9, pm, (mf + mb) / (ff + fb), pf > 0 ? pm / pf : 0.0);
        printf("summary: cpu T %lld: fused fwd+bwd %.4f s, materialised %.4f s (x%.2f); extra peak %.1f MiB vs %.1f MiB\n", (long long)T,
               ff + fb, mf + mb, (mf + mb) / (ff + fb), pf, pm);
        fflush(stdout);
    }
    dsk_ctx_free(&ctx);
}

static void bench_gpu(const bench_cfg *c) {
    dsk_ctx ctx;
    dsk_ctx_opts o;
    bench_set s;
    int64_t T = 4096, H = 16, D = 128;
    double ff, fb, mf, mb, flops = (double)T * (double)T * (double)(2 * D) * (double)H;
    float scale = 1.0f / sqrtf((float)D);
    memset(&o, 0, sizeof o);
    o.device = DSK_PREFER_CUDA;
    if (dsk_ctx_init(&ctx, &o) != DSK_OK) {
        printf("summary: no CUDA device (%s)\n", dsk_last_error());
        return;
    }
    set_alloc(&ctx, &s, DSK_BF16, T, H, D);
    time_passes(&ctx, &s, 1, scale, c->repeats, &ff, &fb);
    alloc_probs(&ctx, &s);
    time_passes(&ctx, &s, 0, scale, c->repeats, &mf, &mb);
    printf("GPU bf16, B 1, T %lld, H %lld, Dh %lld: fused fwd %.3f ms, bwd %.3f ms; materialised fwd %.3f ms, bwd %.3f ms\n", (long long)T,
           (long long)H, (long long)D, ff * 1e3, fb * 1e3, mf * 1e3, mb * 1e3);
    printf("summary: fused attention bf16 T 4096 Dh 128: fwd %.1f TFLOP/s, bwd %.1f TFLOP/s (causal FLOPs); materialised fwd+bwd x%.2f the time\n",
           flops / ff * 1e-12, 2.5 * flops / fb * 1e-12, (mf + mb) / (ff + fb));
    set_free(&ctx, &s);
    dsk_ctx_free(&ctx);
}

int main(int argc, char **argv) {
    bench_cfg c = {2, 4, 64, 256, 8192, 3, 0};
    for (int i = 1; i < argc; i++) {
        int has = i + 1 < argc;
        if (!strcmp(argv[i], "--threads") && has) c.threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--heads") && has) c.heads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--dim") && has) c.dim = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--tmin") && has) c.tmin = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--tmax") && has) c.tmax = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--repeats") && has) c.repeats = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--gpu")) c.gpu = 1;
        else {
            fprintf(stderr, "usage: %s [--threads N] [--heads H] [--dim D] [--tmin T] [--tmax T] [--repeats R] [--gpu]\n", argv[0]);
            return 2;
        }
    }
    if (c.repeats < 1 || c.repeats > 32 || c.tmin < 1 || c.heads < 1 || c.dim < 1) {
        fprintf(stderr, "%s: repeats in [1, 32], T, heads and dim positive\n", argv[0]);
        return 2;
    }
    if (c.gpu) bench_gpu(&c);
    else bench_cpu(&c);
    return 0;
}
