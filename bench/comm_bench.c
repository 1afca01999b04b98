/* comm_bench.c - dsk_comm collectives in the style of nccl-tests, against Open MPI in the same run.

   For each size (bytes, x4 steps): time per call, algorithm bandwidth (bytes / time) and bus
   bandwidth (algbw * 2(n-1)/n for all_reduce, (n-1)/n for reduce_scatter, all_gather and
   all_to_all), out of place and in place, and a wrong-value count from a checked call; then
   the barrier's time. Timing: one warm-up call, then 5 repeats of k calls (k: enough to move
   64 MiB, 1 to 1000), the median per call of the slowest rank.

   Host backend: ranks are forked processes on this machine (shared memory between them, or
   TCP loopback with --tcp), bound like mpirun binds its ranks by default (--bind core for 2
   ranks or fewer: rank r on the r-th allowed CPU; none for more), and mpirun gets the same
   --bind-to. With --mpi, Open MPI runs the same collectives on the same sizes
   (bench/mpi_allreduce.c under mpirun) and the runs alternate: for each of --rounds rounds,
   Open MPI then dsk, each with the machine's load average read before it. The tables show the
   median over rounds of every figure, Open MPI's busbw and the ratio dsk / Open MPI (busbw; for
   the barrier, Open MPI's time / dsk's), and the spread (min..max over rounds) of the ratio.
   nccl backend (--nccl, a DSK_CUDA build on GPUs): run one process per GPU under a launcher
   (torchrun --no_python, srun, mpirun) so dsk_comm_init_env finds the environment; buffers
   are device memory; one round, no peer.

   Usage: comm_bench [-n ranks] [-b min_bytes] [-e max_bytes] [-f factor] [-c all_reduce|
                     reduce_scatter|all_gather|all_to_all|all] [--rounds R] [--mpi] [--tcp]
                     [--bind core|none] [--nccl]
   Sizes go from -b (8) by -f (4) to exactly -e (256 MiB); --rounds 3. */
#define DSK_TENSOR_IMPLEMENTATION
#define DSK_COMM_IMPLEMENTATION
#include "dsk_comm.h"
#include "bench_util.h"

#include <sched.h>
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
#define MAX_SIZES 40
#define MAX_ROUNDS 15

typedef struct cfg {
    int n, which, mpi, nccl, tcp, factor, rounds, bind; /* bind: 1 core, 0 none, -1 as mpirun */
    long long small_bytes;                               /* opts.small_bytes (0: the default) */
    long long lo, hi;
} cfg;

/* Microseconds per call by round, collective and size index (0: not measured); barrier last. */
typedef struct results {
    double dsk_oop[MAX_ROUNDS][NCOLL][MAX_SIZES], dsk_ip[MAX_ROUNDS][NCOLL][MAX_SIZES];
    double mpi[MAX_ROUNDS][NCOLL][MAX_SIZES];
    double dsk_barrier[MAX_ROUNDS], mpi_barrier[MAX_ROUNDS];
    double load_dsk[MAX_ROUNDS], load_mpi[MAX_ROUNDS];
    long long wrong[NCOLL][MAX_SIZES];
} results;

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
        /* a plain cudaMemcpy may return before the bytes land, and nccl's stream would not wait */
        if (dsk_cuda_memcpy_sync(send, host, (size_t)count * 4, 1) != DSK_OK ||
            run_coll(c, ctx, coll, send, recv, bytes, in_place) != DSK_OK || dsk_comm_sync(c, ctx) != DSK_OK)
            return count;
        dst = coll == RS && in_place ? send + me * per : in_place ? send : recv;
        if (dsk_cuda_memcpy_sync(host, dst, (size_t)outn * 4, 0) != DSK_OK) return count;
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

/* Calls per repeat: enough that a repeat moves 64 MiB, at least 1, at most 1000 (as the peer). */
static int calls_for(long long bytes) {
    long long k = bytes > 0 ? (64ll << 20) / bytes : 1000;
    return (int)(k < 1 ? 1 : k > 1000 ? 1000 : k);
}

/* The slowest rank's value of v. */
static double slowest(dsk_comm *c, double v) {
    int64_t ns = (int64_t)(v * 1e9), worst = ns;
#ifdef DSK_CUDA
    if (c->backend == DSK_COMM_NCCL) {
        /* through the host-side store: NCCL needs device buffers */
        static int64_t round;
        char key[64];
        round++;
        worst = 0;
        for (int r = 0; r < c->world_size; r++) {
            int64_t x = 0;
            size_t len = 0;
            snprintf(key, sizeof key, "bench/%lld/%d", (long long)round, r);
            if (r == c->rank && dsk_comm_store_set(c, key, &ns, sizeof ns) != DSK_OK) return -1;
            if (dsk_comm_store_get(c, key, &x, sizeof x, &len) != DSK_OK) return -1;
            if (x > worst) worst = x;
        }
        return (double)worst * 1e-9;
    }
#endif
    if (dsk_comm_all_reduce(c, NULL, &ns, &worst, 1, DSK_I64, DSK_COMM_MAX) != DSK_OK) return -1;
    return (double)worst * 1e-9;
}

/* Median seconds per call over 5 repeats of k calls, the slowest rank's; coll < 0: the barrier. */
static double time_coll(dsk_comm *c, dsk_ctx *ctx, int coll, float *send, float *recv, long long bytes, int in_place) {
    int k = coll < 0 ? 1000 : calls_for(bytes);
    double t[5];
    if ((coll < 0 ? dsk_comm_barrier(c, ctx) : run_coll(c, ctx, coll, send, recv, bytes, in_place)) != DSK_OK)
        return -1;
    for (int r = 0; r < 5; r++) {
        double t0;
        if (dsk_comm_barrier(c, ctx) != DSK_OK) return -1;
        t0 = bench_now_s();
        for (int i = 0; i < k; i++)
            if ((coll < 0 ? dsk_comm_barrier(c, ctx) : run_coll(c, ctx, coll, send, recv, bytes, in_place)) != DSK_OK)
                return -1;
        if (dsk_comm_sync(c, ctx) != DSK_OK) return -1;
        t[r] = (bench_now_s() - t0) / k;
    }
    return slowest(c, bench_median(t, 5));
}

/* Measures every collective and size on communicator c; rank 0 writes one line per figure to
   out ("dsk <collective> <bytes> <oop us> <ip us> <wrong>", "dsk barrier 0 <us> 0 0").
   Returns the number of failures. */
static int rank_main(dsk_comm *c, const cfg *g, FILE *out) {
    dsk_ctx ctx, *pctx = NULL;
    float *send = NULL, *recv = NULL, *host = (float *)malloc((size_t)g->hi);
    int n = c->world_size, fails = 0;
    double tb;
    memset(&ctx, 0, sizeof ctx);
#ifdef DSK_CUDA
    if (c->backend == DSK_COMM_NCCL) {
        dsk_ctx_opts co;
        memset(&co, 0, sizeof co);
        co.device = DSK_PREFER_CUDA;
        co.cuda_index = c->cuda_device;
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
        for (long long bytes = g->lo; bytes; bytes = next_size(bytes, g)) {
            double t[2];
            long long wrong[2];
            long long eff = bytes / (4 * n) * (4 * n); /* a multiple of 4 n so blocks are even */
            if (eff == 0) continue;
            for (int ip = 0; ip < 2; ip++) {
                t[ip] = wrong[ip] = 0; /* in-place all_to_all on nccl: unsupported (dsk_comm.h), not timed */
                if (ip && coll == A2A && c->backend == DSK_COMM_NCCL) continue;
                t[ip] = time_coll(c, pctx, coll, send, recv, eff, ip);
                wrong[ip] = wrong_values(c, pctx, coll, send, recv, host, eff, ip);
                if (t[ip] < 0) {
                    fprintf(stderr, "rank %d: %s of %lld bytes failed: %s\n", c->rank, coll_names[coll], eff,
                            dsk_last_error());
                    fails++;
                    goto out;
                }
            }
            if (c->rank == 0) fprintf(out, "dsk %s %lld %.3f %.3f %lld\n", coll_names[coll], bytes, t[0] * 1e6,
                                      t[1] * 1e6, wrong[0] + wrong[1]);
            fflush(out);
            fails += wrong[0] > 0 || wrong[1] > 0;
        }
    }
    if ((tb = time_coll(c, pctx, -1, NULL, NULL, 0, 0)) < 0) {
        fprintf(stderr, "rank %d: barrier failed: %s\n", c->rank, dsk_last_error());
        fails++;
    } else if (c->rank == 0) {
        fprintf(out, "dsk barrier 0 %.3f 0 0\n", tb * 1e6);
        fflush(out);
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

static int coll_index(const char *name) {
    for (int c = 0; c < NCOLL; c++)
        if (!strcmp(name, coll_names[c])) return c;
    return strcmp(name, "barrier") ? -2 : -1;
}

static int size_index(const cfg *g, long long bytes) {
    int si = 0;
    for (long long b = g->lo; b && b < bytes; b = next_size(b, g)) si++;
    return si < MAX_SIZES ? si : -1;
}

/* Reads result lines ("dsk ..." or "mpi ...") into round r; echoes anything else as a comment. */
static void parse_lines(FILE *in, const cfg *g, results *res, int r) {
    char line[512], who[8], name[32];
    while (fgets(line, sizeof line, in)) {
        long long bytes, wrong = 0;
        double a = 0, b = 0;
        int k = sscanf(line, "%7s %31s %lld %lf %lf %lld", who, name, &bytes, &a, &b, &wrong), ci, si;
        if (k < 4 || (strcmp(who, "dsk") && strcmp(who, "mpi")) || (ci = coll_index(name)) == -2) {
            printf("# %s", line);
            continue;
        }
        if (ci == -1) {
            if (who[0] == 'd') res->dsk_barrier[r] = a;
            else res->mpi_barrier[r] = a;
            continue;
        }
        if ((si = size_index(g, bytes)) < 0) continue;
        if (who[0] == 'm') res->mpi[r][ci][si] = a;
        else {
            res->dsk_oop[r][ci][si] = a;
            res->dsk_ip[r][ci][si] = b;
            res->wrong[ci][si] += wrong;
        }
    }
}

static double load_average(void) {
    double l = -1;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf", &l) != 1) l = -1;
        fclose(f);
    }
    return l;
}

/* Runs Open MPI's peer on the same sizes and collectives under mpirun; results into round r. */
static void run_mpi_peer(const cfg *g, results *res, int r) {
    char self[4096], cmd[8192];
    ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
    FILE *p;
    if (k <= 0) return;
    self[k] = 0;
    *strrchr(self, '/') = 0;
    snprintf(cmd, sizeof cmd,
             "mpirun --allow-run-as-root --oversubscribe --bind-to %s -np %d %s/mpi_allreduce %lld %lld %d %s barrier "
             "2>&1", g->bind ? "core" : "none", g->n, self, g->lo, g->hi, g->factor,
             g->which >= 0 ? coll_names[g->which] : "all_reduce reduce_scatter all_gather all_to_all");
    if (r == 0) printf("# peer: %s\n", cmd);
    fflush(stdout);
    res->load_mpi[r] = load_average();
    if (!(p = popen(cmd, "r"))) return;
    parse_lines(p, g, res, r);
    if (pclose(p) != 0) printf("# round %d: mpirun failed; no Open MPI figures\n", r + 1);
}

/* Binds this process to the k-th CPU it may run on (modulo their count), as mpirun --bind-to core. */
static void bind_to_cpu(int k) {
    cpu_set_t allowed, one;
    int seen = 0, count;
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0 || (count = CPU_COUNT(&allowed)) == 0) return;
    for (int cpu = 0; cpu < CPU_SETSIZE; cpu++) {
        if (!CPU_ISSET(cpu, &allowed) || seen++ != k % count) continue;
        CPU_ZERO(&one);
        CPU_SET(cpu, &one);
        sched_setaffinity(0, sizeof one, &one);
        return;
    }
}

/* Forks g->n ranks on a fresh port; rank 0's result lines come back through a pipe. */
static int run_dsk(const cfg *g, results *res, int r) {
    int port = 0, worst = 0, fd[2];
    pid_t pid[64];
    FILE *in;
    if (dsk_comm_free_port("127.0.0.1", &port) != DSK_OK || pipe(fd) != 0) {
        fprintf(stderr, "%s\n", dsk_last_error());
        return 1;
    }
    res->load_dsk[r] = load_average();
    fflush(stdout);
    for (int k = 0; k < g->n; k++) {
        pid[k] = fork();
        if (pid[k] == 0) {
            dsk_comm c;
            dsk_comm_opts o;
            FILE *out;
            int rc;
            close(fd[0]);
            if (g->bind) bind_to_cpu(k);
            memset(&o, 0, sizeof o);
            o.backend = DSK_COMM_HOST;
            o.transport = g->tcp ? DSK_COMM_TRANSPORT_TCP : DSK_COMM_TRANSPORT_AUTO;
            o.small_bytes = (size_t)g->small_bytes;
            o.timeout_s = 120;
            o.master_addr = "127.0.0.1";
            o.master_port = port;
            if (dsk_comm_init(&c, k, g->n, &o) != DSK_OK) {
                fprintf(stderr, "rank %d: %s\n", k, dsk_last_error());
                _exit(1);
            }
            if (k == 0 && r == 0)
                printf("# dsk: %d ranks, %d reached through shared memory by rank 0\n", g->n, c.shm_peers);
            fflush(stdout);
            out = fdopen(fd[1], "w");
            rc = rank_main(&c, g, out);
            fclose(out);
            dsk_comm_free(&c);
            _exit(rc);
        }
    }
    close(fd[1]);
    in = fdopen(fd[0], "r");
    parse_lines(in, g, res, r);
    fclose(in);
    for (int k = 0; k < g->n; k++) {
        int st = 0;
        waitpid(pid[k], &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st)) worst = 1;
    }
    return worst;
}

/* Median over rounds of v[round] (zeros are missing figures); *lo, *hi: the spread. */
static double med(const double *v, int rounds, double *lo, double *hi) {
    double t[MAX_ROUNDS];
    int k = 0;
    for (int r = 0; r < rounds; r++)
        if (v[r] > 0) t[k++] = v[r];
    if (!k) return 0;
    bench_median(t, k);
    if (lo) *lo = t[0];
    if (hi) *hi = t[k - 1];
    return bench_median(t, k);
}

static void print_tables(const cfg *g, results *res) {
    int n = g->n;
    double v[MAX_ROUNDS], l0 = 0, l1 = 0;
    med(res->load_dsk, g->rounds, &l0, &l1);
    printf("\n# load average (1 min) before each run: dsk %.2f..%.2f", l0, l1);
    if (g->mpi) {
        med(res->load_mpi, g->rounds, &l0, &l1);
        printf(", Open MPI %.2f..%.2f", l0, l1);
    }
    printf(" (%d rounds)\n", g->rounds);
    for (int coll = 0; coll < NCOLL; coll++) {
        if (g->which >= 0 && g->which != coll) continue;
        printf("\n# %s, %d ranks, %s, f32 sum; median of %d rounds (each: median of 5 repeats, slowest rank)\n",
               coll_names[coll], n, g->nccl ? "nccl" : g->tcp ? "host/TCP" : "host/shared memory", g->rounds);
        printf("%12s | %10s %9s %6s | %10s %9s %6s", "size(B)", "oop us", "busbw", "#wrong", "ip us", "busbw",
               "#wrong");
        if (g->mpi) printf(" | %10s %9s %8s %15s", "MPI us", "MPI busbw", "dsk/MPI", "(min..max)");
        printf("\n");
        for (long long bytes = g->lo, si = 0; bytes && si < MAX_SIZES; bytes = next_size(bytes, g), si++) {
            double t0, t1, bf = bus_factor(coll, n);
            long long eff = bytes / (4 * n) * (4 * n);
            for (int r = 0; r < g->rounds; r++) v[r] = res->dsk_oop[r][coll][si];
            t0 = med(v, g->rounds, NULL, NULL);
            for (int r = 0; r < g->rounds; r++) v[r] = res->dsk_ip[r][coll][si];
            t1 = med(v, g->rounds, NULL, NULL);
            if (eff == 0 || t0 <= 0) continue;
            printf("%12lld | %10.2f %9.3f %6lld | ", eff, t0, eff / t0 * 1e-3 * bf, res->wrong[coll][si]);
            if (t1 > 0) printf("%10.2f %9.3f %6lld", t1, eff / t1 * 1e-3 * bf, res->wrong[coll][si]);
            else printf("%10s %9s %6s", "n/a", "n/a", "n/a");
            if (g->mpi) {
                double tm, lo = 0, hi = 0;
                for (int r = 0; r < g->rounds; r++) v[r] = res->mpi[r][coll][si];
                tm = med(v, g->rounds, NULL, NULL);
                /* the ratio per round, dsk's busbw over Open MPI's (= MPI time / dsk time) */
                for (int r = 0; r < g->rounds; r++)
                    v[r] = res->mpi[r][coll][si] > 0 && res->dsk_oop[r][coll][si] > 0
                               ? res->mpi[r][coll][si] / res->dsk_oop[r][coll][si] : 0;
                if (tm > 0) {
                    double ratio = med(v, g->rounds, &lo, &hi);
                    printf(" | %10.2f %9.3f %7.2fx %6.2fx..%.2fx", tm, eff / tm * 1e-3 * bf, ratio, lo, hi);
                }
            }
            printf("\n");
        }
    }
    printf("\n# barrier, %d ranks: dsk %.2f us", n, med(res->dsk_barrier, g->rounds, NULL, NULL));
    if (g->mpi) {
        double lo = 0, hi = 0, ratio;
        for (int r = 0; r < g->rounds; r++)
            v[r] = res->mpi_barrier[r] > 0 && res->dsk_barrier[r] > 0 ? res->mpi_barrier[r] / res->dsk_barrier[r] : 0;
        ratio = med(v, g->rounds, &lo, &hi);
        printf(", Open MPI %.2f us, Open MPI time / dsk time %.2fx (%.2fx..%.2fx)",
               med(res->mpi_barrier, g->rounds, NULL, NULL), ratio, lo, hi);
    }
    printf("\n");
}

int main(int argc, char **argv) {
    cfg g;
    int worst = 0;
    static results res;
    memset(&g, 0, sizeof g);
    g.n = 2;
    g.which = -1;
    g.lo = 8;
    g.hi = 256ll << 20;
    g.factor = 4;
    g.rounds = 3;
    g.bind = -1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-n") && i + 1 < argc) g.n = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-b") && i + 1 < argc) g.lo = atoll(argv[++i]);
        else if (!strcmp(argv[i], "-e") && i + 1 < argc) g.hi = atoll(argv[++i]);
        else if (!strcmp(argv[i], "-f") && i + 1 < argc) g.factor = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) g.rounds = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-s") && i + 1 < argc) g.small_bytes = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--mpi")) g.mpi = 1;
        else if (!strcmp(argv[i], "--tcp")) g.tcp = 1;
        else if (!strcmp(argv[i], "--nccl")) g.nccl = 1;
        else if (!strcmp(argv[i], "--bind") && i + 1 < argc) {
            const char *b = argv[++i];
            if (strcmp(b, "core") && strcmp(b, "none")) { fprintf(stderr, "--bind core|none\n"); return 2; }
            g.bind = !strcmp(b, "core");
        }
        else if (!strcmp(argv[i], "-c") && i + 1 < argc) {
            const char *w = argv[++i];
            g.which = coll_index(w);
            if (g.which < 0 && strcmp(w, "all")) { fprintf(stderr, "unknown collective %s\n", w); return 2; }
            if (g.which < 0) g.which = -1;
        } else {
            fprintf(stderr, "usage: %s [-n ranks] [-b min_bytes] [-e max_bytes] [-f factor] [-c collective|all] "
                            "[--rounds R] [--mpi] [--tcp] [--nccl]\n", argv[0]);
            return 2;
        }
    }
    if (g.n < 1 || g.n > 64 || g.lo < 4 || g.hi < g.lo || g.factor < 2 || g.rounds < 1 || g.rounds > MAX_ROUNDS) {
        fprintf(stderr, "bad -n/-b/-e/-f/--rounds\n");
        return 2;
    }
    if (g.bind < 0) g.bind = g.n <= 2; /* mpirun's default: core for 2 ranks or fewer, else socket */
    if (g.nccl) {
        /* one process per GPU, started by a launcher; one round */
        dsk_comm c;
        dsk_comm_opts o;
        int rc;
        FILE *tmp = tmpfile();
        memset(&o, 0, sizeof o);
        o.backend = DSK_COMM_NCCL;
        o.timeout_s = 120;
        g.rounds = 1;
        if (!tmp || dsk_comm_init_env(&c, &o) != DSK_OK) {
            fprintf(stderr, "comm_bench: %s\n", dsk_last_error());
            return 1;
        }
        g.n = c.world_size;
        rc = rank_main(&c, &g, tmp);
        if (c.rank == 0) {
            rewind(tmp);
            parse_lines(tmp, &g, &res, 0);
            print_tables(&g, &res);
        }
        fclose(tmp);
        dsk_comm_free(&c);
        return rc;
    }
    printf("# comm_bench: host backend, %d ranks on this machine (%s, bound to %s), sizes %lld..%lld bytes, %d "
           "rounds%s\n", g.n, g.tcp ? "TCP loopback" : "shared memory", g.bind ? "a core each" : "no CPU", g.lo, g.hi,
           g.rounds, g.mpi ? ", alternating with Open MPI" : "");
    for (int r = 0; r < g.rounds; r++) {
        if (g.mpi) run_mpi_peer(&g, &res, r);
        worst |= run_dsk(&g, &res, r);
        printf("# round %d of %d done\n", r + 1, g.rounds);
        fflush(stdout);
    }
    print_tables(&g, &res);
    return worst;
}
