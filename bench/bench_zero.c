/* bench_zero.c - dsk_zero.h: step time, per-rank memory and bytes moved for ZeRO-0 (DDP), 1, 2
   and 3 on the host backend, each against ZeRO-0 measured in the same run.

   A synthetic model of `units` layers, each a (dim, dim) matrix and a (dim) vector, so every
   stage runs the same GEMMs: forward Y = X W^T per layer, backward dW += dY^T X and dX = dY W,
   with the layer's weights gathered (ZeRO-3) and its gradients reduced as backward goes. Ranks
   are forked processes over loopback TCP; each runs `threads` OpenMP threads. Step time is the
   median over the timed steps of the slowest rank; memory is what dsk_zero allocated by role
   (the allocator's figures) and the allocator's high-water mark over a step (activations
   included); bytes are per rank per step: handed to reductions and gathers, and sent on the wire;
   `waited` is the time rank 0 spent blocked on collectives per step (what overlap did not hide).

     bench_zero [-n 4] [--units 8] [--dim 512] [--batch 32] [--steps 6] [--warmup 2]
                [--threads 1] [--dtype f32|bf16] [--compress none|bf16|powersgd:R] */
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
    int n, units, dim, batch, steps, warmup, threads, psgd_rank;
    dsk_dtype dt;
    dsk_zero_compress compress;
} cfg;

typedef struct result {
    double step_s[64];
    dsk_zero_memory mem;
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
    int64_t bd[2] = {c->batch, c->dim};
    double t0 = 0;
    memset(&co, 0, sizeof co);
    co.backend = DSK_COMM_HOST;
    co.master_addr = "127.0.0.1";
    co.master_port = port;
    co.timeout_s = 600;
    BENCH_CHECK(dsk_comm_init(&comm, rank, c->n, &co));
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
    BENCH_CHECK(dsk_zero_init(&z, &comm, NULL, ps, 2 * c->units, &o));
    out->mem = z.memory;
    for (int p = 0; p < 2 * c->units; p++) {
        dsk_zero_piece pc;
        BENCH_CHECK(dsk_zero_get_piece(&z, p, &pc));
        BENCH_CHECK(dsk_tensor_normal(NULL, &pc.master, 1, (uint64_t)(p * c->dim * c->dim) + (uint64_t)pc.first, 0.0f,
                                      0.02f));
    }
    BENCH_CHECK(dsk_zero_refresh(&z, NULL));
    for (int u = 0; u <= c->units; u++) BENCH_CHECK(dsk_tensor_alloc(NULL, &x[u], c->dt, 2, bd));
    BENCH_CHECK(dsk_tensor_alloc(NULL, &dy, c->dt, 2, bd));
    BENCH_CHECK(dsk_tensor_alloc(NULL, &dx, c->dt, 2, bd));
    BENCH_CHECK(dsk_tensor_normal(NULL, &x[0], 2, (uint64_t)rank << 32, 0.0f, 1.0f));
    memset(&so, 0, sizeof so);
    so.mode = DSK_AMP_NONE;
    BENCH_CHECK(dsk_amp_scaler_init(&sc, NULL, &so));
    ao.lr = 1e-4f;
    for (int step = 0; step < c->warmup + c->steps; step++) {
        dsk_amp_decision dec;
        uint64_t red0 = z.stats.reduce_bytes, gat0 = z.stats.gather_bytes, wire0 = z.stats.sent_bytes;
        double wait0 = z.stats.wait_seconds;
        BENCH_CHECK(dsk_comm_barrier(&comm, NULL));
        if (step == c->warmup) dsk_tensor_mem_reset_peak(dsk_cpu());
        t0 = bench_now_s();
        for (int u = 0; u < c->units; u++) {
            BENCH_CHECK(dsk_zero_forward_begin(&z, NULL, u));
            BENCH_CHECK(dsk_matmul(NULL, &x[u + 1], &x[u], 0, &vals[2 * u + 1], 1, 1.0f, 0.0f));
            if (u < c->units - 1) BENCH_CHECK(dsk_zero_forward_end(&z, NULL, u));
        }
        BENCH_CHECK(dsk_zero_begin(&z, NULL, 1));
        BENCH_CHECK(dsk_tensor_normal(NULL, &dy, 3, (uint64_t)step << 32, 0.0f, 1e-2f));
        for (int u = c->units - 1; u >= 0; u--) {
            BENCH_CHECK(dsk_zero_backward_begin(&z, NULL, u));
            BENCH_CHECK(dsk_matmul(NULL, &grads[2 * u + 1], &dy, 1, &x[u], 0, 1.0f, 1.0f));
            BENCH_CHECK(dsk_zero_grad_ready(&z, NULL, 2 * u + 1));
            BENCH_CHECK(dsk_zero_grad_ready(&z, NULL, 2 * u));
            BENCH_CHECK(dsk_matmul(NULL, &dx, &dy, 0, &vals[2 * u + 1], 0, 1.0f, 0.0f));
            BENCH_CHECK(dsk_zero_backward_end(&z, NULL, u));
            BENCH_CHECK(dsk_tensor_copy(NULL, &dy, &dx));
        }
        BENCH_CHECK(dsk_zero_wait(&z, NULL));
        BENCH_CHECK(dsk_zero_unscale_decide(&zp, 1, &sc, &comm, NULL, 1.0, &dec));
        BENCH_CHECK(dsk_zero_step(&z, NULL, &ao, step + 1, &dec));
        if (step >= c->warmup) {
            double dt = bench_now_s() - t0;
            BENCH_CHECK(dsk_comm_all_reduce(&comm, NULL, &dt, &dt, 1, DSK_F64, DSK_COMM_MAX));
            out->step_s[step - c->warmup] = dt;
            out->reduce_b += (double)(z.stats.reduce_bytes - red0) / c->steps;
            out->gather_b += (double)(z.stats.gather_bytes - gat0) / c->steps;
            out->wire_b += (double)(z.stats.sent_bytes - wire0) / c->steps;
            out->wait_s += (z.stats.wait_seconds - wait0) / c->steps;
        }
    }
    /* the gathers of the last step are counted at the next wait: take them now */
    for (int u = 0; u < c->units; u++) {
        BENCH_CHECK(dsk_zero_forward_begin(&z, NULL, u));
        BENCH_CHECK(dsk_zero_forward_end(&z, NULL, u));
    }
    out->peak = dsk_tensor_mem_stats(dsk_cpu()).peak_bytes;
    dsk_amp_scaler_free(&sc, NULL);
    dsk_zero_free(&z, NULL);
    for (int u = 0; u <= c->units; u++) dsk_tensor_free(NULL, &x[u]);
    dsk_tensor_free(NULL, &dy);
    dsk_tensor_free(NULL, &dx);
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

static double mb(double b) { return b / (1024.0 * 1024.0); }

int main(int argc, char **argv) {
    cfg c;
    result *res;
    double base = 0;
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
                            "[--threads 1] [--dtype f32|bf16] [--compress none|bf16|powersgd:R]\n", argv[0]);
            return 2;
        }
    }
    if (c.n < 1 || c.n > 16 || c.units < 1 || c.dim < 1 || c.batch < 1 || c.steps < 1 || c.steps > 64 ||
        c.warmup < 0 || c.threads < 1) {
        fprintf(stderr, "bench_zero: a size out of range\n");
        return 2;
    }
    res = (result *)mmap(NULL, (size_t)c.n * sizeof *res, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (res == MAP_FAILED) return 1;
    printf("bench_zero: %d ranks x %d thread%s, %d layers of (%d, %d) + (%d) %s = %.1f M parameters, batch %d, "
           "%d timed steps after %d, compression %s\n",
           c.n, c.threads, c.threads > 1 ? "s" : "", c.units, c.dim, c.dim, c.dim, dsk_dtype_name(c.dt),
           (double)c.units * (c.dim + (double)c.dim * c.dim) / 1e6, c.batch, c.steps, c.warmup,
           c.compress == DSK_ZERO_COMPRESS_NONE ? "none" : c.compress == DSK_ZERO_COMPRESS_BF16 ? "bf16" : "powersgd");
    printf("| stage | step ms | vs ZeRO-0 | waited ms | weights MiB | grads MiB | optimizer MiB | comm MiB | "
           "peak MiB | reduce MiB/step | gather MiB/step | sent MiB/step |\n");
    printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for (int stage = 0; stage < 4; stage++) {
        double step;
        memset(res, 0, (size_t)c.n * sizeof *res);
        if (!run_stage(&c, stage, res)) { fprintf(stderr, "bench_zero: a rank of stage %d failed\n", stage); return 1; }
        step = bench_median(res[0].step_s, c.steps);
        if (stage == 0) base = step;
        printf("| ZeRO-%d | %.1f | %.2fx | %.1f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", stage,
               1e3 * step, step / base, 1e3 * res[0].wait_s, mb((double)res[0].mem.params),
               mb((double)res[0].mem.grads),
               mb((double)res[0].mem.optimizer), mb((double)res[0].mem.comm), mb((double)res[0].peak),
               mb(res[0].reduce_b), mb(res[0].gather_b), mb(res[0].wire_b));
        fflush(stdout);
    }
    munmap(res, (size_t)c.n * sizeof *res);
    return 0;
}
