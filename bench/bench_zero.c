/* bench_zero.c - dsk_zero.h: step time, per-rank memory and bytes moved for ZeRO-0 (DDP), 1, 2
   and 3 on the host backend (CPU tensors) or, with --cuda, on CUDA tensors over nccl, each
   against ZeRO-0 measured in the same run.

   A synthetic model of `units` layers, each a (dim, dim) matrix and a (dim) vector, so every
   stage runs the same GEMMs: forward Y = X W^T per layer, backward dW += dY^T X and dX = dY W,
   with the layer's weights gathered (ZeRO-3) and its gradients reduced as backward goes. Ranks
   are forked processes over loopback TCP; each runs `threads` OpenMP threads. With --cuda
   (a CUDA build) each rank holds one GPU (rank r: device r), its tensors live there and the
   collectives go over nccl: N = min(-n, the devices visible); on one GPU N = 1, which still
   measures each stage's step, its memory and the bytes it hands to collectives. The parent never
   touches CUDA (a forked child counts the devices), so the forked ranks start it fresh.
   Step time is the median over the timed steps of the slowest rank (ends after the device's
   stream is done); memory is what dsk_zero allocated by role (the figures of the allocator of
   the ranks' device) and that allocator's high-water mark over a step (activations included);
   bytes are per rank per step: handed to reductions and gathers, and sent on the wire (host
   backend only: NCCL moves the bytes itself, so over nccl that column reads n/a);
   `waited` is the time rank 0 spent blocked on collectives per step (what overlap did not hide;
   on CUDA the host waits only in dsk_zero_wait and dsk_zero_step). After the table, a check per
   stage that the roles add up to what the allocator gave dsk_zero_init, and what the
   activations add; last, one "summary:" line per stage (scripts/device_check.sh collects them).

     bench_zero [-n 4] [--units 8] [--dim 512] [--batch 32] [--steps 6] [--warmup 2]
                [--threads 1] [--dtype f32|bf16] [--compress none|bf16|powersgd:R] [--cuda] */
#define _GNU_SOURCE
#define DSK_TENSOR_IMPLEMENTATION
#define DSK_COMM_IMPLEMENTATION
#define DSK_AMP_IMPLEMENTATION
#define DSK_CKPT_IMPLEMENTATION
#define DSK_ZERO_IMPLEMENTATION
#include "dsk_zero.h"
#include "bench/bench_util.h"

#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef struct cfg {
    int n, units, dim, batch, steps, warmup, threads, psgd_rank, cuda;
    dsk_dtype dt;
    dsk_zero_compress compress;
} cfg;

typedef struct result {
    double step_s[64];
    dsk_zero_memory mem;
    int64_t zero_bytes; /* the allocator's live bytes added by dsk_zero_init */
    int64_t act_bytes;  /* ... by the activations (x per layer, dy, dx) */
    int64_t peak;
    double reduce_b, gather_b, wire_b, wait_s;
    int failed;
} result;

static void rank_main(const cfg *c, int stage, int rank, int port, result *out) {
    dsk_comm comm;
    dsk_comm_opts co;
    dsk_zero z, *zp = &z;
    dsk_zero_opts o;
    dsk_zero_param *ps = (dsk_zero_param *)calloc((size_t)(2 * c->units), sizeof *ps);
    dsk_tensor *vals = (dsk_tensor *)calloc((size_t)(2 * c->units), sizeof(dsk_tensor));
    dsk_tensor *grads = (dsk_tensor *)calloc((size_t)(2 * c->units), sizeof(dsk_tensor));
    dsk_tensor *x = (dsk_tensor *)calloc((size_t)(c->units + 1), sizeof(dsk_tensor)), dy, dx;
    char (*names)[32] = (char(*)[32])calloc((size_t)(2 * c->units), 32);
    dsk_amp_scaler sc;
    dsk_amp_scaler_opts so;
    dsk_adamw_opts ao = dsk_adamw_defaults();
    dsk_ctx gpu, *ctx = NULL; /* NULL: the CPU */
    dsk_device dev = dsk_cpu();
    int64_t bd[2] = {c->batch, c->dim}, live0;
    double t0 = 0;
    memset(&co, 0, sizeof co);
    co.backend = c->cuda ? DSK_COMM_NCCL : DSK_COMM_HOST;
    co.master_addr = "127.0.0.1";
    co.master_port = port;
    co.timeout_s = 600;
    BENCH_CHECK(dsk_comm_init(&comm, rank, c->n, &co));
    if (c->cuda) {
        dsk_ctx_opts xo;
        memset(&xo, 0, sizeof xo);
        xo.device = DSK_PREFER_CUDA;
        xo.cuda_index = rank;
        BENCH_CHECK(dsk_ctx_init(&gpu, &xo));
        ctx = &gpu;
        dev = gpu.device;
    }
    for (int u = 0; u < c->units; u++)
        for (int j = 0; j < 2; j++) {
            dsk_zero_param *p = &ps[2 * u + j];
            snprintf(names[2 * u + j], 32, "l%d.%s", u, j ? "w" : "b");
            p->name = names[2 * u + j];
            p->ndim = j ? 2 : 1;
            p->shape[0] = c->dim;
            p->shape[1] = c->dim;
            p->value = &vals[2 * u + j];
            p->grad = &grads[2 * u + j];
            p->unit = u;
            p->no_decay = !j;
        }
    memset(&o, 0, sizeof o);
    o.stage = stage;
    o.compute_dtype = c->dt;
    o.compress = c->compress;
    o.powersgd_rank = c->psgd_rank;
    live0 = dsk_tensor_mem_stats(dev).live_bytes;
    BENCH_CHECK(dsk_zero_init(&z, &comm, ctx, ps, 2 * c->units, &o));
    out->zero_bytes = dsk_tensor_mem_stats(dev).live_bytes - live0;
    out->mem = z.memory;
    for (int p = 0; p < 2 * c->units; p++) {
        dsk_zero_piece pc;
        BENCH_CHECK(dsk_zero_get_piece(&z, p, &pc));
        BENCH_CHECK(dsk_tensor_normal(ctx, &pc.master, 1, (uint64_t)(p * c->dim * c->dim) + (uint64_t)pc.first, 0.0f,
                                      0.02f));
    }
    BENCH_CHECK(dsk_zero_refresh(&z, ctx));
    live0 = dsk_tensor_mem_stats(dev).live_bytes;
    for (int u = 0; u <= c->units; u++) BENCH_CHECK(dsk_tensor_alloc(ctx, &x[u], c->dt, 2, bd));
    BENCH_CHECK(dsk_tensor_alloc(ctx, &dy, c->dt, 2, bd));
    BENCH_CHECK(dsk_tensor_alloc(ctx, &dx, c->dt, 2, bd));
    out->act_bytes = dsk_tensor_mem_stats(dev).live_bytes - live0;
    BENCH_CHECK(dsk_tensor_normal(ctx, &x[0], 2, (uint64_t)rank << 32, 0.0f, 1.0f));
    memset(&so, 0, sizeof so);
    so.mode = DSK_AMP_NONE;
    BENCH_CHECK(dsk_amp_scaler_init(&sc, ctx, &so));
    ao.lr = 1e-4f;
    for (int step = 0; step < c->warmup + c->steps; step++) {
        dsk_amp_decision dec;
        uint64_t red0 = z.stats.reduce_bytes, gat0 = z.stats.gather_bytes, wire0 = z.stats.sent_bytes;
        double wait0 = z.stats.wait_seconds;
        BENCH_CHECK(dsk_comm_barrier(&comm, ctx));
        if (step == c->warmup) dsk_tensor_mem_reset_peak(dev);
        t0 = bench_now_s();
        for (int u = 0; u < c->units; u++) {
            BENCH_CHECK(dsk_zero_forward_begin(&z, ctx, u));
            BENCH_CHECK(dsk_matmul(ctx, &x[u + 1], &x[u], 0, &vals[2 * u + 1], 1, 1.0f, 0.0f));
            if (u < c->units - 1) BENCH_CHECK(dsk_zero_forward_end(&z, ctx, u));
        }
        BENCH_CHECK(dsk_zero_begin(&z, ctx, 1));
        BENCH_CHECK(dsk_tensor_normal(ctx, &dy, 3, (uint64_t)step << 32, 0.0f, 1e-2f));
        for (int u = c->units - 1; u >= 0; u--) {
            BENCH_CHECK(dsk_zero_backward_begin(&z, ctx, u));
            BENCH_CHECK(dsk_matmul(ctx, &grads[2 * u + 1], &dy, 1, &x[u], 0, 1.0f, 1.0f));
            BENCH_CHECK(dsk_zero_grad_ready(&z, ctx, 2 * u + 1));
            BENCH_CHECK(dsk_zero_grad_ready(&z, ctx, 2 * u));
            BENCH_CHECK(dsk_matmul(ctx, &dx, &dy, 0, &vals[2 * u + 1], 0, 1.0f, 0.0f));
            BENCH_CHECK(dsk_zero_backward_end(&z, ctx, u));
            BENCH_CHECK(dsk_tensor_copy(ctx, &dy, &dx));
        }
        BENCH_CHECK(dsk_zero_wait(&z, ctx));
        BENCH_CHECK(dsk_zero_unscale_decide(&zp, 1, &sc, &comm, ctx, 1.0, &dec));
        BENCH_CHECK(dsk_zero_step(&z, ctx, &ao, step + 1, &dec));
        BENCH_CHECK(dsk_ctx_sync(ctx));
        if (step >= c->warmup) {
            out->step_s[step - c->warmup] = bench_now_s() - t0; /* the parent takes the slowest rank's */
            out->reduce_b += (double)(z.stats.reduce_bytes - red0) / c->steps;
            out->gather_b += (double)(z.stats.gather_bytes - gat0) / c->steps;
            out->wire_b += (double)(z.stats.sent_bytes - wire0) / c->steps;
            out->wait_s += (z.stats.wait_seconds - wait0) / c->steps;
        }
    }
    /* the gathers of the last step are counted at the next wait: take them now */
    for (int u = 0; u < c->units; u++) {
        BENCH_CHECK(dsk_zero_forward_begin(&z, ctx, u));
        BENCH_CHECK(dsk_zero_forward_end(&z, ctx, u));
    }
    BENCH_CHECK(dsk_ctx_sync(ctx));
    out->peak = dsk_tensor_mem_stats(dev).peak_bytes;
    dsk_amp_scaler_free(&sc, ctx);
    dsk_zero_free(&z, ctx);
    for (int u = 0; u <= c->units; u++) dsk_tensor_free(ctx, &x[u]);
    dsk_tensor_free(ctx, &dy);
    dsk_tensor_free(ctx, &dx);
    if (ctx) dsk_ctx_free(ctx);
    dsk_comm_free(&comm);
    free(ps); free(vals); free(grads); free(x); free(names);
}

/* Forks c->n ranks for one stage; res[r] comes back through shared memory. */
static int run_stage(const cfg *c, int stage, result *res) {
    pid_t pid[16];
    int port = 0, ok = 1;
    BENCH_CHECK(dsk_comm_free_port("127.0.0.1", &port));
    fflush(stdout);
    for (int r = 0; r < c->n; r++)
        if ((pid[r] = fork()) == 0) {
#ifdef _OPENMP
            omp_set_num_threads(c->threads);
#endif
            rank_main(c, stage, r, port, &res[r]);
            _exit(0);
        }
    for (int r = 0; r < c->n; r++) {
        int st = 0;
        waitpid(pid[r], &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) ok = 0;
    }
    return ok;
}

/* The CUDA devices visible, counted in a forked child so that this process never starts CUDA
   (a child forked after that could not use it); 0 in a CPU-only build or without a device. */
static int cuda_devices(void) {
    int *n = (int *)mmap(NULL, sizeof(int), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0), k;
    pid_t pid;
    if (n == MAP_FAILED) return 0;
    *n = 0;
    fflush(stdout);
    if ((pid = fork()) == 0) {
#ifdef DSK_CUDA
        int d = 0;
        if (dsk_cuda_device_count(&d) == DSK_OK) *n = d;
#endif
        _exit(0);
    }
    if (pid > 0) waitpid(pid, NULL, 0);
    k = *n;
    munmap(n, sizeof(int));
    return k;
}

/* Step time of each timed step: the slowest rank's. */
static void slowest_steps(const cfg *c, const result *res, double *out) {
    for (int s = 0; s < c->steps; s++) {
        out[s] = res[0].step_s[s];
        for (int r = 1; r < c->n; r++)
            if (res[r].step_s[s] > out[s]) out[s] = res[r].step_s[s];
    }
}

static double mb(double b) { return b / (1024.0 * 1024.0); }

/* Rank 0's memory check and the stage's summary line. */
static void record(const cfg *c, int stage, const result *r0, double step, double base, char *check, char *summary) {
    const dsk_zero_memory *m = &r0->mem;
    int64_t roles = m->params + m->grads + m->optimizer + m->comm;
    snprintf(check, 320,
             "check ZeRO-%d, rank 0: weights + grads + optimizer + comm = %.2f MiB, %s the allocator's %.2f MiB "
             "for dsk_zero_init; + activations %.2f MiB = %.2f MiB, peak %.2f MiB",
             stage, mb((double)roles), roles == r0->zero_bytes ? "equal to" : "NOT EQUAL to",
             mb((double)r0->zero_bytes),
             mb((double)r0->act_bytes), mb((double)(roles + r0->act_bytes)), mb((double)r0->peak));
    snprintf(summary, 320,
             "summary: ZeRO-%d %s x%d: %.3f ms/step (%.2fx ZeRO-0), state %.2f MiB/rank "
             "(w %.2f g %.2f opt %.2f comm %.2f), peak %.2f MiB, reduce %.2f + gather %.2f MiB/step",
             stage, c->cuda ? "cuda" : "cpu", c->n, 1e3 * step, step / base, mb((double)roles), mb((double)m->params),
             mb((double)m->grads), mb((double)m->optimizer), mb((double)m->comm), mb((double)r0->peak),
             mb(r0->reduce_b), mb(r0->gather_b));
}

int main(int argc, char **argv) {
    cfg c;
    result *res;
    double base = 0, steps[64];
    char check[4][320], summary[4][320];
    char where[64], sent[32];
    memset(&c, 0, sizeof c);
    c.n = 4; c.units = 8; c.dim = 512; c.batch = 32; c.steps = 6; c.warmup = 2; c.threads = 1; c.dt = DSK_F32;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-n") && v) c.n = atoi(argv[++i]);
        else if (!strcmp(a, "--units") && v) c.units = atoi(argv[++i]);
        else if (!strcmp(a, "--dim") && v) c.dim = atoi(argv[++i]);
        else if (!strcmp(a, "--batch") && v) c.batch = atoi(argv[++i]);
        else if (!strcmp(a, "--steps") && v) c.steps = atoi(argv[++i]);
        else if (!strcmp(a, "--warmup") && v) c.warmup = atoi(argv[++i]);
        else if (!strcmp(a, "--threads") && v) c.threads = atoi(argv[++i]);
        else if (!strcmp(a, "--cuda")) c.cuda = 1;
        else if (!strcmp(a, "--dtype") && v) c.dt = !strcmp(argv[++i], "bf16") ? DSK_BF16 : DSK_F32;
        else if (!strcmp(a, "--compress") && v) {
            const char *m = argv[++i];
            if (!strcmp(m, "bf16")) c.compress = DSK_ZERO_COMPRESS_BF16;
            else if (!strncmp(m, "powersgd:", 9)) {
                c.compress = DSK_ZERO_COMPRESS_POWERSGD;
                c.psgd_rank = atoi(m + 9);
            }
            else if (strcmp(m, "none") != 0) { fprintf(stderr, "bench_zero: --compress %s?\n", m); return 2; }
        } else {
            fprintf(stderr, "usage: %s [-n 4] [--units 8] [--dim 512] [--batch 32] [--steps 6] [--warmup 2] "
                            "[--threads 1] [--dtype f32|bf16] [--compress none|bf16|powersgd:R] [--cuda]\n", argv[0]);
            return 2;
        }
    }
    if (c.n < 1 || c.n > 16 || c.units < 1 || c.dim < 1 || c.batch < 1 || c.steps < 1 || c.steps > 64 ||
        c.warmup < 0 || c.threads < 1) {
        fprintf(stderr, "bench_zero: a size out of range\n");
        return 2;
    }
    if (c.cuda) {
        int ndev = cuda_devices();
        if (ndev < 1) {
            printf("summary: zero: no CUDA device (%s)\n",
#ifdef DSK_CUDA
                   "none visible"
#else
                   "a CPU-only build"
#endif
            );
            return 1;
        }
        if (c.n > ndev) {
            printf("bench_zero: %d ranks requested, %d CUDA device%s visible: %d rank%s, one per device\n", c.n, ndev,
                   ndev > 1 ? "s" : "", ndev, ndev > 1 ? "s" : "");
            c.n = ndev;
        }
        if (c.compress == DSK_ZERO_COMPRESS_POWERSGD) {
            fprintf(stderr, "bench_zero: PowerSGD runs on CPU tensors only (dsk_zero.h)\n");
            return 2;
        }
    }
    res = (result *)mmap(NULL, (size_t)c.n * sizeof *res, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (res == MAP_FAILED) return 1;
    if (c.cuda) snprintf(where, sizeof where, "on CUDA (one device each) over nccl");
    else snprintf(where, sizeof where, "x %d thread%s over the host backend", c.threads, c.threads > 1 ? "s" : "");
    printf("bench_zero: %d ranks %s, %d layers of (%d, %d) + (%d) %s = %.1f M parameters, batch %d, "
           "%d timed steps after %d, compression %s\n",
           c.n, where, c.units, c.dim, c.dim, c.dim, dsk_dtype_name(c.dt),
           (double)c.units * (c.dim + (double)c.dim * c.dim) / 1e6, c.batch, c.steps, c.warmup,
           c.compress == DSK_ZERO_COMPRESS_NONE ? "none" : c.compress == DSK_ZERO_COMPRESS_BF16 ? "bf16" : "powersgd");
    printf("| stage | step ms | vs ZeRO-0 | waited ms | weights MiB | grads MiB | optimizer MiB | comm MiB | "
           "peak MiB | reduce MiB/step | gather MiB/step | sent MiB/step |\n");
    printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for (int stage = 0; stage < 4; stage++) {
        double step;
        memset(res, 0, (size_t)c.n * sizeof *res);
        if (!run_stage(&c, stage, res)) { fprintf(stderr, "bench_zero: a rank of stage %d failed\n", stage); return 1; }
        slowest_steps(&c, res, steps);
        step = bench_median(steps, c.steps);
        if (stage == 0) base = step;
        record(&c, stage, &res[0], step, base, check[stage], summary[stage]);
        if (c.cuda) snprintf(sent, sizeof sent, "n/a");
        else snprintf(sent, sizeof sent, "%.2f", mb(res[0].wire_b));
        printf("| ZeRO-%d | %.2f | %.2fx | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %s |\n", stage,
               1e3 * step, step / base, 1e3 * res[0].wait_s, mb((double)res[0].mem.params),
               mb((double)res[0].mem.grads),
               mb((double)res[0].mem.optimizer), mb((double)res[0].mem.comm), mb((double)res[0].peak),
               mb(res[0].reduce_b), mb(res[0].gather_b), sent);
        fflush(stdout);
    }
    for (int stage = 0; stage < 4; stage++) printf("%s\n", check[stage]);
    for (int stage = 0; stage < 4; stage++) printf("%s\n", summary[stage]);
    munmap(res, (size_t)c.n * sizeof *res);
    return 0;
}
