/* comm_bench.c - dsk_comm collectives in the style of nccl-tests, against Open MPI.

   For each size (bytes, x4 steps): time per call, algorithm bandwidth (bytes / time) and bus
   bandwidth (algbw * 2(n-1)/n for all_reduce, (n-1)/n for reduce_scatter, all_gather and
   all_to_all), out of place and in place, and a wrong-value count from a checked call.
   Timing: one warm-up call, then 5 repeats of k calls; the median per call of the slowest
   rank. With --mpi, Open MPI's MPI_Allreduce (bench/mpi_allreduce.c under mpirun) runs in
   the same process tree on the same sizes and the all_reduce table gets its busbw and the
   ratio dsk / MPI.

   Host backend: ranks are forked processes on this machine, over TCP loopback.
   nccl backend (--nccl, a DSK_CUDA build on GPUs): run one process per GPU under a launcher
   (torchrun --no_python, srun, mpirun) so dsk_comm_init_env finds the environment; buffers
   are device memory.

   Usage: comm_bench [-n ranks] [-b min_bytes] [-e max_bytes] [-f factor] [-c all_reduce|
                     reduce_scatter|all_gather|all_to_all|all] [--mpi] [--nccl]
   Sizes go from -b (8) by -f (4) to exactly -e (256 MiB). */
#define DSK_TENSOR_IMPLEMENTATION
#define DSK_COMM_IMPLEMENTATION
#include "dsk_comm.h"
#include "bench_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef DSK_CUDA
#include <cuda_runtime.h>
#endif

enum { AR, RS, AG, A2A, NCOLL };
static const char *coll_names[NCOLL] = {"all_reduce", "reduce_scatter", "all_gather", "all_to_all"};

typedef struct cfg {
    int n, which, mpi, nccl, factor;
    long long lo, hi;
    double mpi_us[40]; /* by size index */
    int have_mpi;
} cfg;

/* One call of collective `coll` on `bytes` of f32 per rank's contribution (nccl-tests sizes:
   the all_reduce buffer, the reduce_scatter input, the all_gather output, the all_to_all buffer). */
static dsk_status run_coll(dsk_comm *c, dsk_ctx *ctx, int coll, float *send, float *recv, long long bytes,
                           int in_place) {
    int64_t count = (int64_t)(bytes / 4), per = count / c->world_size;
    float *out = in_place ? send : recv;
    switch (coll) {
    case AR: return dsk_comm_all_reduce(c, ctx, send, out, count, DSK_F32, DSK_COMM_SUM);
    case RS:
        return dsk_comm_reduce_scatter(c, ctx, send, in_place ? send + (int64_t)c->rank * per : recv, per, DSK_F32,
                                       DSK_COMM_SUM);
    case AG: return dsk_comm_all_gather(c, ctx, in_place ? out + (int64_t)c->rank * per : send, out, per, DSK_F32);
    default: return dsk_comm_all_to_all(c, ctx, send, out, per, DSK_F32);
    }
}

static double bus_factor(int coll, int n) { return coll == AR ? 2.0 * (n - 1) / n : (double)(n - 1) / n; }

/* Input element i of rank r: small integers, so every sum is exact and checkable. */
static float input_value(int r, int64_t i) { return (float)((r + 1) * (int)(1 + i % 7)); }

/* Fills send with the inputs, runs one call and counts outputs that differ from the exact result. */
static long long wrong_values(dsk_comm *c, dsk_ctx *ctx, int coll, float *send, float *recv, float *host,
                              long long bytes, int in_place) {
    int n = c->world_size, me = c->rank;
    int64_t count = (int64_t)(bytes / 4), per = count / n;
    int64_t outn = coll == RS ? per : coll == AG || coll == A2A ? per * n : count;
    long long wrong = 0;
    float *dst;
    for (int64_t i = 0; i < count; i++) host[i] = input_value(me, i);
    if (coll == AG && in_place) for (int64_t i = 0; i < per; i++) host[me * per + i] = input_value(me, i);
#ifdef DSK_CUDA
    if (c->backend == DSK_COMM_NCCL) {
        cudaMemcpy(send, host, (size_t)count * 4, cudaMemcpyHostToDevice);
        if (run_coll(c, ctx, coll, send, recv, bytes, in_place) != DSK_OK || dsk_comm_sync(c, ctx) != DSK_OK)
            return count;
        dst = coll == RS && in_place ? send + me * per : in_place ? send : recv;
        cudaMemcpy(host, dst, (size_t)outn * 4, cudaMemcpyDeviceToHost);
        dst = host;
    } else
#endif
    {
        memcpy(send, host, (size_t)count * 4);
        if (run_coll(c, ctx, coll, send, recv, bytes, in_place) != DSK_OK) return count;
        dst = coll == RS && in_place ? send + me * per : in_place ? send : recv;
    }
    for (int64_t i = 0; i < outn; i++) {
        float want;
        if (coll == AR) want = (float)(n * (n + 1) / 2 * (int)(1 + i % 7));
        else if (coll == RS) want = (float)(n * (n + 1) / 2 * (int)(1 + (me * per + i) % 7));
        else if (coll == AG) want = input_value((int)(i / per), i % per);
        else want = input_value((int)(i / per), me * per + i % per);
        wrong += dst[i] != want;
    }
    return wrong;
}

/* The size after `bytes`: times factor, ending exactly at hi; 0 after hi. */
static long long next_size(long long bytes, const cfg *g) {
    if (bytes >= g->hi) return 0;
    return bytes * g->factor < g->hi ? bytes * g->factor : g->hi;
}

/* Median seconds per call over 5 repeats of k calls, the slowest rank's. */
static double time_coll(dsk_comm *c, dsk_ctx *ctx, int coll, float *send, float *recv, long long bytes, int in_place) {
    int k = bytes >= (64ll << 20) ? 1 : (int)((64ll << 20) / bytes > 50 ? 50 : (64ll << 20) / bytes);
    double t[5];
    int64_t ns, worst = 0;
    if (run_coll(c, ctx, coll, send, recv, bytes, in_place) != DSK_OK) return -1;
    for (int r = 0; r < 5; r++) {
        double t0;
        if (dsk_comm_barrier(c, ctx) != DSK_OK) return -1;
        t0 = bench_now_s();
        for (int i = 0; i < k; i++)
            if (run_coll(c, ctx, coll, send, recv, bytes, in_place) != DSK_OK) return -1;
        if (dsk_comm_sync(c, ctx) != DSK_OK) return -1;
        t[r] = (bench_now_s() - t0) / k;
    }
    ns = (int64_t)(bench_median(t, 5) * 1e9);
#ifdef DSK_CUDA
    if (c->backend == DSK_COMM_NCCL) {
        /* reduce the timing through the host-side store: NCCL needs device buffers */
        char key[64];
        int64_t v = 0;
        for (int r = 0; r < c->world_size; r++) {
            size_t len = 0;
            snprintf(key, sizeof key, "bench/%lld/%d/%d/%d", bytes, coll, in_place, r);
            if (r == c->rank) dsk_comm_store_set(c, key, &ns, sizeof ns);
            if (dsk_comm_store_get(c, key, &v, sizeof v, &len) != DSK_OK) return -1;
            if (v > worst) worst = v;
        }
        return (double)worst * 1e-9;
    }
#endif
    if (dsk_comm_all_reduce(c, ctx, &ns, &worst, 1, DSK_I64, DSK_COMM_MAX) != DSK_OK) return -1;
    return (double)worst * 1e-9;
}

static int rank_main(dsk_comm *c, const cfg *g) {
    dsk_ctx ctx, *pctx = NULL;
    float *send = NULL, *recv = NULL, *host = (float *)malloc((size_t)g->hi);
    int n = c->world_size, fails = 0;
    memset(&ctx, 0, sizeof ctx);
#ifdef DSK_CUDA
    if (c->backend == DSK_COMM_NCCL) {
        dsk_ctx_opts co;
        memset(&co, 0, sizeof co);
        co.device = DSK_PREFER_CUDA;
        co.cuda_index = c->local_rank;
        if (dsk_ctx_init(&ctx, &co) != DSK_OK || cudaMalloc((void **)&send, (size_t)g->hi) != cudaSuccess ||
            cudaMalloc((void **)&recv, (size_t)g->hi) != cudaSuccess) {
            fprintf(stderr, "rank %d: device buffers: %s\n", c->rank, dsk_last_error());
            return 1;
        }
        pctx = &ctx;
    } else
#endif
    {
        send = (float *)malloc((size_t)g->hi);
        recv = (float *)malloc((size_t)g->hi);
        for (long long i = 0; i < g->hi / 4; i++) send[i] = recv[i] = 1.0f;
    }
    for (int coll = 0; coll < NCOLL; coll++) {
        if (g->which >= 0 && g->which != coll) continue;
        if (c->rank == 0) {
            printf("\n# %s, %d ranks, %s backend, f32 sum; times are the median of 5 repeats, slowest rank\n",
                   coll_names[coll], n, c->backend == DSK_COMM_NCCL ? "nccl" : "host");
            printf("%12s %12s | %10s %9s %9s %6s | %10s %9s %9s %6s%s\n", "size(B)", "count", "oop us", "algbw",
                   "busbw", "#wrong", "ip us", "algbw", "busbw", "#wrong",
                   coll == AR && g->have_mpi ? " |  MPI busbw  dsk/MPI" : "");
        }
        double last_bus = 0, min_ratio = 1e30;
        long long last_bytes = 0;
        for (long long bytes = g->lo, si = 0; bytes; bytes = next_size(bytes, g), si++) {
            double t[2];
            long long wrong[2];
            long long eff = bytes / (4 * n) * (4 * n); /* a multiple of 4 n so blocks are even */
            if (eff == 0) continue;
            for (int ip = 0; ip < 2; ip++) {
                t[ip] = time_coll(c, pctx, coll, send, recv, eff, ip);
                wrong[ip] = wrong_values(c, pctx, coll, send, recv, host, eff, ip);
                if (t[ip] < 0) {
                    fprintf(stderr, "rank %d: %s of %lld bytes failed: %s\n", c->rank, coll_names[coll], eff,
                            dsk_last_error());
                    fails++;
                    goto out;
                }
            }
            if (c->rank == 0) {
                double bf = bus_factor(coll, n), a0 = eff / t[0] * 1e-9, a1 = eff / t[1] * 1e-9;
                printf("%12lld %12lld | %10.1f %9.3f %9.3f %6lld | %10.1f %9.3f %9.3f %6lld", eff, eff / 4, t[0] * 1e6,
                       a0, a0 * bf, wrong[0], t[1] * 1e6, a1, a1 * bf, wrong[1]);
                if (coll == AR && g->have_mpi && g->mpi_us[si] > 0) {
                    double mb = bytes / (g->mpi_us[si] * 1e-6) * 1e-9 * bf;
                    printf(" | %10.3f  %6.2fx", mb, a0 * bf / mb);
                    if (bytes >= (16ll << 20) && a0 * bf / mb < min_ratio) min_ratio = a0 * bf / mb;
                }
                last_bus = a0 * bf;
                last_bytes = eff;
                printf("\n");
                fflush(stdout);
            }
            fails += wrong[0] > 0 || wrong[1] > 0;
        }
        if (c->rank == 0 && last_bytes) {
            printf("summary: %s %d ranks %s: busbw %.3f GB/s at %lld B\n", coll_names[coll], n,
                   c->backend == DSK_COMM_NCCL ? "nccl" : "host", last_bus, last_bytes);
            if (min_ratio < 1e30)
                printf("summary: all_reduce busbw dsk/Open MPI at >= 16 MB: %.2fx (worst size)\n", min_ratio);
        }
    }
out:
#ifdef DSK_CUDA
    if (c->backend == DSK_COMM_NCCL) {
        cudaFree(send);
        cudaFree(recv);
        dsk_ctx_free(&ctx);
        send = recv = NULL;
    }
#endif
    free(send);
    free(recv);
    free(host);
    return fails ? 1 : 0;
}

/* Runs Open MPI's peer on the same sizes under mpirun and keeps its microseconds per size. */
static void run_mpi_peer(cfg *g) {
    char self[4096], cmd[8192];
    ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
    FILE *p;
    char line[256];
    if (k <= 0) return;
    self[k] = 0;
    *strrchr(self, '/') = 0;
    snprintf(cmd, sizeof cmd, "mpirun --allow-run-as-root --oversubscribe -np %d %s/mpi_allreduce %lld %lld %d 2>&1",
             g->n, self, g->lo, g->hi, g->factor);
    printf("# peer: %s\n", cmd);
    fflush(stdout);
    if (!(p = popen(cmd, "r"))) return;
    while (fgets(line, sizeof line, p)) {
        long long bytes;
        double us;
        if (sscanf(line, "mpi %lld %lf", &bytes, &us) == 2) {
            int si = 0;
            for (long long b = g->lo; b && b < bytes; b = next_size(b, g)) si++;
            if (si < 40) { g->mpi_us[si] = us; g->have_mpi = 1; }
        } else {
            printf("# mpirun: %s", line);
        }
    }
    if (pclose(p) != 0) printf("# mpirun failed; no MPI column\n");
}

int main(int argc, char **argv) {
    cfg g;
    int port = 0, worst = 0;
    pid_t pid[64];
    memset(&g, 0, sizeof g);
    g.n = 2;
    g.which = -1;
    g.lo = 8;
    g.hi = 256ll << 20;
    g.factor = 4;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-n") && i + 1 < argc) g.n = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-b") && i + 1 < argc) g.lo = atoll(argv[++i]);
        else if (!strcmp(argv[i], "-e") && i + 1 < argc) g.hi = atoll(argv[++i]);
        else if (!strcmp(argv[i], "-f") && i + 1 < argc) g.factor = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--mpi")) g.mpi = 1;
        else if (!strcmp(argv[i], "--nccl")) g.nccl = 1;
        else if (!strcmp(argv[i], "-c") && i + 1 < argc) {
            const char *w = argv[++i];
            g.which = -1;
            for (int c = 0; c < NCOLL; c++)
                if (!strcmp(w, coll_names[c])) g.which = c;
            if (g.which < 0 && strcmp(w, "all")) { fprintf(stderr, "unknown collective %s\n", w); return 2; }
        } else {
            fprintf(stderr, "usage: %s [-n ranks] [-b min_bytes] [-e max_bytes] [-f factor] [-c collective|all] "
                            "[--mpi] [--nccl]\n", argv[0]);
            return 2;
        }
    }
    if (g.n < 1 || g.n > 64 || g.lo < 4 || g.hi < g.lo || g.factor < 2) {
        fprintf(stderr, "bad -n/-b/-e/-f\n");
        return 2;
    }
    if (g.nccl) {
        /* one process per GPU, started by a launcher */
        dsk_comm c;
        dsk_comm_opts o;
        int rc;
        memset(&o, 0, sizeof o);
        o.backend = DSK_COMM_NCCL;
        o.timeout_s = 120;
        if (dsk_comm_init_env(&c, &o) != DSK_OK) { fprintf(stderr, "comm_bench: %s\n", dsk_last_error()); return 1; }
        rc = rank_main(&c, &g);
        dsk_comm_free(&c);
        return rc;
    }
    printf("# comm_bench: host backend, %d ranks over TCP loopback, sizes %lld..%lld bytes\n", g.n, g.lo, g.hi);
    if (g.mpi) run_mpi_peer(&g);
    if (dsk_comm_free_port("127.0.0.1", &port) != DSK_OK) { fprintf(stderr, "%s\n", dsk_last_error()); return 1; }
    fflush(stdout);
    for (int r = 0; r < g.n; r++) {
        pid[r] = fork();
        if (pid[r] == 0) {
            dsk_comm c;
            dsk_comm_opts o;
            int rc;
            memset(&o, 0, sizeof o);
            o.backend = DSK_COMM_HOST;
            o.timeout_s = 120;
            o.master_addr = "127.0.0.1";
            o.master_port = port;
            if (dsk_comm_init(&c, r, g.n, &o) != DSK_OK) {
                fprintf(stderr, "rank %d: %s\n", r, dsk_last_error());
                _exit(1);
            }
            rc = rank_main(&c, &g);
            dsk_comm_free(&c);
            fflush(stdout);
            _exit(rc);
        }
    }
    for (int r = 0; r < g.n; r++) {
        int st = 0;
        waitpid(pid[r], &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st)) worst = 1;
    }
    return worst;
}
