/* test_comm.c - dsk_comm.h on the host backend: ranks are forked processes over loopback.

   Every collective, dtype and op is checked bit for bit against a reference computed here
   from every rank's input (inputs are a function of (tag, rank, index), so each rank can
   compute all of them), folded in the documented order: rank 0, 1, ..., n-1, in f32 for
   float dtypes (rounded once) and int64 for integers. Each case forks its ranks; a rank
   exits non-zero when any of its checks failed, and the parent counts the case. Faults:
   killed and stopped ranks (rank 0 too), mismatched calls and roots, differing options,
   another job on the port, a duplicate rank, bad environment, busy port, missing store,
   close + re-init without leaks. Launchers: dsk_comm_spawn_local, mpirun and torchrun when
   installed; run with `<binary> --rank-child` it is a rank of those end-to-end cases. */
#define DSK_COMM_IMPLEMENTATION
#include "dsk_comm.h"
#include "tests/dsk_test.h"

#include <dirent.h>
#include <stdarg.h>
#include <pthread.h>
#include <sys/mman.h>

/* ------------------------------------------------------------------ rank processes */

typedef void (*rank_fn)(dsk_comm *c, void *arg);

typedef struct group {
    int n;
    dsk_comm_opts opts;
    unsigned tcp_ranks;    /* bit r: rank r asks for TCP with everyone (opts.transport) */
    pid_t pid[8];          /* the ranks' process ids, for the shared-memory segment checks */
    int world_override[8]; /* world size each rank passes to init (0: n) */
    int no_init;           /* ranks call fn with c = NULL and init themselves */
    double limit_s;        /* parent kills the ranks after this long */
    int reap;              /* 1 + rank the parent SIGKILLs once the others have exited (a stopped rank) */
    int status[8];         /* exit codes, 128 + signal when killed */
    int port;
} group;

static void group_defaults(group *g, int n) {
    memset(g, 0, sizeof *g);
    g->n = n;
    g->opts.timeout_s = 20;
    g->limit_s = 60;
}

static int g_rank; /* this process's rank inside a group (children only) */

/* How the ranks of a group reach each other: every collective and fault case runs in each. */
enum { MODE_SHM, MODE_TCP, MODE_TWO_HOSTS, N_MODES };
static const char *k_mode_names[N_MODES] = {"shared memory", "TCP", "2 emulated hosts"};
static int g_mode;

/* Mode MODE_TWO_HOSTS: ranks [0, (n+1)/2) report one host identity, the others another. */
static int host_of(int r, int n) { return g_mode == MODE_TWO_HOSTS && r >= (n + 1) / 2; }

static int allows_shm(const group *g, int r) { return g_mode != MODE_TCP && !(g->tcp_ranks >> r & 1u); }

static void apply_mode(const group *g, int r, dsk_comm_opts *o) {
    if (!allows_shm(g, r)) o->transport = DSK_COMM_TRANSPORT_TCP;
    if (g_mode == MODE_TWO_HOSTS) o->host_id = host_of(r, g->n) ? "emulated-host-b" : "emulated-host-a";
}

/* Segments in /dev/shm named after one of the processes pids[0..n) ("dsk-<pid ns>-<pid>-<hash>"). */
static int segments_of(const pid_t *pids, int n) {
    DIR *d = opendir("/dev/shm");
    struct dirent *e;
    int found = 0;
    if (!d) return 0;
    while ((e = readdir(d)) != NULL) {
        unsigned long long ns;
        int pid;
        if (sscanf(e->d_name, "dsk-%llu-%d-", &ns, &pid) != 2) continue;
        for (int i = 0; i < n; i++)
            if (pid == (int)pids[i]) {
                printf("     left in /dev/shm: %s\n", e->d_name);
                found++;
            }
    }
    closedir(d);
    return found;
}

/* The nodes and the shared-memory peers rank r must see after init; the segment (if any) is
   already unlinked, as every rank of the node has mapped it. */
static void check_transport(const group *g, const dsk_comm *c) {
    int n = g->n, r = c->rank, shm = 0, node_rank = 0, node_size = 0, two = g_mode == MODE_TWO_HOSTS && n > 1;
    for (int s = 0; s < n; s++) {
        if (host_of(s, n) != host_of(r, n)) continue;
        node_rank += s < r;
        node_size++;
        shm += s != r && allows_shm(g, s) && allows_shm(g, r);
    }
    DSK_TEST_EXPECT(c->shm_peers == shm, "%s: rank %d reaches %d peers through shared memory, want %d",
                    k_mode_names[g_mode], r, c->shm_peers, shm);
    DSK_TEST_EXPECT(c->n_nodes == (two ? 2 : 1) && c->node == host_of(r, n) && c->node_rank == node_rank &&
                        c->node_size == node_size,
                    "%s: rank %d is node %d of %d, index %d of %d; want node %d of %d, index %d of %d",
                    k_mode_names[g_mode], r, c->node, c->n_nodes, c->node_rank, c->node_size, host_of(r, n),
                    two ? 2 : 1, node_rank, node_size);
    {
        pid_t me = getpid();
        DSK_TEST_EXPECT(segments_of(&me, 1) == 0, "rank %d: its segment is still linked after init", r);
    }
}

/* Forks g->n ranks that init a host communicator on a fresh port, run fn and exit with
   status 1 if any check failed. Fills g->status; returns 1 if all exited 0. */
static int run_group(group *g, rank_fn fn, void *arg) {
    pid_t pid[8];
    double t0 = dsk_test_now();
    int ok = 1;
    g->opts.backend = DSK_COMM_HOST;
    if (!g->port && dsk_comm_free_port("127.0.0.1", &g->port) != DSK_OK) {
        dsk_test_fail_at(__FILE__, __LINE__, "no free port: %s", dsk_last_error());
        return 0;
    }
    g->opts.master_addr = "127.0.0.1";
    g->opts.master_port = g->port;
    fflush(stdout);
    for (int r = 0; r < g->n; r++) {
        pid[r] = fork();
        if (pid[r] == 0) {
            dsk_comm c;
            int failed_before = dsk_test_g.checks_failed_total;
            g_rank = r;
            if (g->no_init) fn(NULL, arg);
            else {
                dsk_comm_opts o = g->opts;
                dsk_status st;
                apply_mode(g, r, &o);
                st = dsk_comm_init(&c, r, g->world_override[r] ? g->world_override[r] : g->n, &o);
                if (st != DSK_OK)
                    dsk_test_fail_at(__FILE__, __LINE__, "rank %d: dsk_comm_init: %s: %s", r, dsk_status_str(st),
                                     dsk_last_error());
                else {
                    check_transport(g, &c);
                    fn(&c, arg);
                    dsk_comm_free(&c);
                }
            }
            fflush(stdout);
            _exit(dsk_test_g.checks_failed_total > failed_before ? 1 : 0);
        }
        g->pid[r] = pid[r];
    }
    for (int r = 0; r < g->n; r++) g->status[r] = -1;
    for (int left = g->n; left > 0;) {
        for (int r = 0; r < g->n; r++) {
            int st;
            if (g->status[r] != -1) continue;
            if (waitpid(pid[r], &st, WNOHANG) == pid[r]) {
                g->status[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
                left--;
            }
        }
        if (g->reap && left == 1 && g->status[g->reap - 1] == -1) kill(pid[g->reap - 1], SIGKILL);
        if (left && dsk_test_now() - t0 > g->limit_s) {
            for (int r = 0; r < g->n; r++)
                if (g->status[r] == -1) kill(pid[r], SIGKILL);
            dsk_test_fail_at(__FILE__, __LINE__, "ranks still running after %.0f s were killed (a hang)", g->limit_s);
            g->limit_s = 1e9;
        }
        if (left) {
            struct timespec ts = {0, 2000000};
            nanosleep(&ts, NULL);
        }
    }
    for (int r = 0; r < g->n; r++) ok &= g->status[r] == 0;
    return ok;
}

/* Runs a group in which every rank must succeed. */
static void expect_group_ok(group *g, rank_fn fn, void *arg) {
    if (!run_group(g, fn, arg))
        for (int r = 0; r < g->n; r++)
            DSK_TEST_EXPECT(g->status[r] == 0, "rank %d of %d exited with status %d", r, g->n, g->status[r]);
}

/* ------------------------------------------------------------------ inputs and references */

static uint64_t g_seed;

/* Element i of rank r's input for call `tag`: floats in [-2, 2) (exact in the dtype), never 0;
   integers small enough that sums of 4 ranks are exact. */
static void gen(void *buf, dsk_dtype dt, int64_t n, uint64_t tag, int r) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t u =
            dsk_test_mix64(g_seed ^ dsk_test_mix64(tag * 131 + (uint64_t)r) ^ (uint64_t)i * 0xD1B54A32D192ED03ull);
        double d = (double)(u >> 11) * (1.0 / 9007199254740992.0) * 4.0 - 2.0; /* f64: all 53 bits */
        float f = (float)d;
        if (f == 0) f = 0.5f;
        switch (dt) {
        case DSK_F32: ((float *)buf)[i] = f; break;
        case DSK_F16: ((uint16_t *)buf)[i] = dsk_f32_to_f16(f); break;
        case DSK_BF16: ((uint16_t *)buf)[i] = dsk_f32_to_bf16(f); break;
        case DSK_F64: ((double *)buf)[i] = d != 0 ? d : 0.5; break;
        case DSK_I32: ((int32_t *)buf)[i] = (int32_t)(u >> 36) - (1 << 27); break;
        case DSK_I64: ((int64_t *)buf)[i] = (int64_t)(u >> 4) - ((int64_t)1 << 59); break;
        default: ((uint8_t *)buf)[i] = (uint8_t)(u >> 58); break;
        }
    }
}

static double load_d(const void *p, dsk_dtype dt, int64_t i) {
    switch (dt) {
    case DSK_F32: return ((const float *)p)[i];
    case DSK_F16: return dsk_f16_to_f32(((const uint16_t *)p)[i]);
    case DSK_BF16: return dsk_bf16_to_f32(((const uint16_t *)p)[i]);
    case DSK_F64: return ((const double *)p)[i];
    case DSK_I32: return ((const int32_t *)p)[i];
    case DSK_I64: return (double)((const int64_t *)p)[i];
    default: return ((const uint8_t *)p)[i];
    }
}

/* out[i] = in[0][off+i] op ... op in[n-1][off+i], folded in rank order as documented. */
static void ref_reduce(dsk_dtype dt, dsk_comm_op op, int n, void **in, int64_t off, int64_t len, void *out) {
    for (int64_t i = 0; i < len; i++) {
        if (dt == DSK_F64) {
            double a = ((double *)in[0])[off + i];
            for (int r = 1; r < n; r++) {
                double x = ((double *)in[r])[off + i];
                a = op == DSK_COMM_MAX ? (x > a ? x : a) : op == DSK_COMM_MIN ? (x < a ? x : a) : a + x;
            }
            ((double *)out)[i] = op == DSK_COMM_AVG ? a / n : a;
        } else if (dt == DSK_F32 || dt == DSK_F16 || dt == DSK_BF16) {
            float a = (float)load_d(in[0], dt, off + i);
            for (int r = 1; r < n; r++) {
                float x = (float)load_d(in[r], dt, off + i);
                a = op == DSK_COMM_MAX ? (x > a ? x : a) : op == DSK_COMM_MIN ? (x < a ? x : a) : a + x;
            }
            if (op == DSK_COMM_AVG) a = a / (float)n;
            if (dt == DSK_F32) ((float *)out)[i] = a;
            else if (dt == DSK_F16) ((uint16_t *)out)[i] = dsk_f32_to_f16(a);
            else ((uint16_t *)out)[i] = dsk_f32_to_bf16(a);
        } else {
            int64_t a = dt == DSK_I64 ? ((int64_t *)in[0])[off + i] : (int64_t)load_d(in[0], dt, off + i);
            for (int r = 1; r < n; r++) {
                int64_t x = dt == DSK_I64 ? ((int64_t *)in[r])[off + i] : (int64_t)load_d(in[r], dt, off + i);
                a = op == DSK_COMM_MAX ? (x > a ? x : a) : op == DSK_COMM_MIN ? (x < a ? x : a) : a + x;
            }
            if (op == DSK_COMM_AVG) a /= n;
            if (dt == DSK_I32) ((int32_t *)out)[i] = (int32_t)a;
            else if (dt == DSK_I64) ((int64_t *)out)[i] = a;
            else ((uint8_t *)out)[i] = (uint8_t)a;
        }
    }
}

static const dsk_dtype k_dtypes[] = {DSK_F32, DSK_F16, DSK_BF16, DSK_F64, DSK_I32, DSK_I64, DSK_U8};
static const dsk_comm_op k_ops[] = {DSK_COMM_SUM, DSK_COMM_AVG, DSK_COMM_MAX, DSK_COMM_MIN};
/* 0, 1, odd, around the small-message threshold and several pieces (piece_bytes 64 KiB) */
static const int64_t k_sizes[] = {0, 1, 7, 129, 4099, 70001};

/* n buffers of len elements of dt, each rank's input for `tag`. */
static void **gen_all(int n, dsk_dtype dt, int64_t len, uint64_t tag) {
    void **in = (void **)malloc((size_t)n * sizeof(void *));
    for (int r = 0; r < n; r++) {
        in[r] = malloc((size_t)(len ? len : 1) * dsk_dtype_size(dt));
        gen(in[r], dt, len, tag, r);
    }
    return in;
}
static void free_all(int n, void **in) {
    for (int r = 0; r < n; r++) free(in[r]);
    free((void *)in);
}

/* ------------------------------------------------------------------ collectives */

static void check_all_reduce(dsk_comm *c, dsk_dtype dt, dsk_comm_op op, int64_t len, int in_place, uint64_t tag) {
    int n = c->world_size;
    size_t esz = dsk_dtype_size(dt), bytes = (size_t)len * esz;
    void **in = gen_all(n, dt, len, tag);
    char *got = (char *)malloc(bytes + 1), *want = (char *)malloc(bytes + 1);
    char label[160];
    snprintf(label, sizeof label, "rank %d: all_reduce %s %s count %lld %s", c->rank, dsk_dtype_name(dt),
             dsk_comm_op_name(op), (long long)len, in_place ? "in place" : "out of place");
    if (in_place) memcpy(got, in[c->rank], bytes);
    else dsk_test_poison_bytes(got, bytes);
    ref_reduce(dt, op, n, in, 0, len, want);
    if (in_place) DSK_TEST_OK(dsk_comm_all_reduce(c, NULL, got, got, len, dt, op));
    else DSK_TEST_OK(dsk_comm_all_reduce(c, NULL, in[c->rank], got, len, dt, op));
    DSK_TEST_SAME_BYTES(got, want, bytes, label);
    if (dt == DSK_F32 && op == DSK_COMM_SUM && len > 0) {
        /* and the fold is a sum: float64 reference within f32 rounding */
        double *w64 = (double *)malloc((size_t)len * sizeof(double));
        for (int64_t i = 0; i < len; i++) {
            w64[i] = 0;
            for (int r = 0; r < n; r++) w64[i] += ((float *)in[r])[i];
        }
        DSK_TEST_CLOSE((float *)got, w64, len, 1e-5, 2e-6 * n, label);
        free(w64);
    }
    free(got);
    free(want);
    free_all(n, in);
}

/* The payload counter of a collective's kind moved by `want` bytes since `before`, after a call
   that failed (a negative count) added nothing. */
static void check_payload(const char *kind, const dsk_comm *c, uint64_t before, uint64_t now, uint64_t want,
                          dsk_status bad) {
    DSK_TEST_STATUS(bad, DSK_ERR_ARG);
    DSK_TEST_EXPECT(now - before == want, "rank %d of %d: %s_payload counted %llu bytes, the calls handed over %llu",
                    c->rank, c->world_size, kind, (unsigned long long)(now - before), (unsigned long long)want);
}

static void rank_all_reduce(dsk_comm *c, void *arg) {
    uint64_t tag = 1000, before = c->stats.all_reduce_payload, whole = 0;
    float x = 1;
    (void)arg;
    for (size_t d = 0; d < sizeof k_dtypes / sizeof *k_dtypes; d++)
        for (size_t o = 0; o < 4; o++)
            for (size_t s = 0; s < sizeof k_sizes / sizeof *k_sizes; s++) {
                check_all_reduce(c, k_dtypes[d], k_ops[o], k_sizes[s], (int)((s + o) & 1), tag++);
                whole += (uint64_t)k_sizes[s] * dsk_dtype_size(k_dtypes[d]);
            }
    /* several MB, many pieces */
    check_all_reduce(c, DSK_F32, DSK_COMM_SUM, 1500007, 0, tag++);
    check_all_reduce(c, DSK_BF16, DSK_COMM_AVG, 1000003, 1, tag++);
    whole += 1500007 * 4 + 1000003 * 2;
    check_payload("all_reduce", c, before, c->stats.all_reduce_payload, whole,
                  dsk_comm_all_reduce(c, NULL, &x, &x, -1, DSK_F32, DSK_COMM_SUM));
}

static void rank_reduce_scatter(dsk_comm *c, void *arg) {
    int n = c->world_size;
    uint64_t tag = 2000, before = c->stats.reduce_scatter_payload, whole = 0; /* the whole inputs */
    float x = 1;
    (void)arg;
    for (size_t d = 0; d < sizeof k_dtypes / sizeof *k_dtypes; d++)
        for (size_t o = 0; o < 4; o++)
            for (size_t s = 0; s < sizeof k_sizes / sizeof *k_sizes; s++) {
                dsk_dtype dt = k_dtypes[d];
                int64_t len = k_sizes[s] / 2 + (int64_t)s; /* per-rank block */
                size_t esz = dsk_dtype_size(dt);
                void **in = gen_all(n, dt, len * n, tag++);
                char *got = (char *)malloc((size_t)len * esz + 1), *want = (char *)malloc((size_t)len * esz + 1);
                char label[160];
                int in_place = (int)(s & 1);
                snprintf(label, sizeof label, "rank %d: reduce_scatter %s %s block %lld%s", c->rank, dsk_dtype_name(dt),
                         dsk_comm_op_name(k_ops[o]), (long long)len, in_place ? " in place" : "");
                ref_reduce(dt, k_ops[o], n, in, (int64_t)c->rank * len, len, want);
                if (in_place) {
                    /* recv = send + rank * block, on a copy of the input */
                    char *copy = (char *)malloc((size_t)len * n * esz + 1),
                         *buf = copy + (size_t)c->rank * (size_t)len * esz;
                    memcpy(copy, in[c->rank], (size_t)len * n * esz);
                    DSK_TEST_OK(dsk_comm_reduce_scatter(c, NULL, copy, buf, len, dt, k_ops[o]));
                    DSK_TEST_SAME_BYTES(buf, want, (size_t)len * esz, label);
                    free(copy);
                } else {
                    dsk_test_poison_bytes(got, (size_t)len * esz);
                    DSK_TEST_OK(dsk_comm_reduce_scatter(c, NULL, in[c->rank], got, len, dt, k_ops[o]));
                    DSK_TEST_SAME_BYTES(got, want, (size_t)len * esz, label);
                }
                free(got);
                free(want);
                free_all(n, in);
                whole += (uint64_t)len * (uint64_t)n * esz;
            }
    check_payload("reduce_scatter", c, before, c->stats.reduce_scatter_payload, whole,
                  dsk_comm_reduce_scatter(c, NULL, &x, &x, -1, DSK_F32, DSK_COMM_SUM));
}

static void rank_all_gather(dsk_comm *c, void *arg) {
    int n = c->world_size;
    uint64_t tag = 3000, before = c->stats.all_gather_payload, whole = 0; /* the whole outputs */
    float x = 1;
    (void)arg;
    for (size_t d = 0; d < sizeof k_dtypes / sizeof *k_dtypes; d++)
        for (size_t s = 0; s < sizeof k_sizes / sizeof *k_sizes; s++)
            for (int in_place = 0; in_place < 2; in_place++) {
                dsk_dtype dt = k_dtypes[d];
                int64_t len = k_sizes[s];
                size_t esz = dsk_dtype_size(dt), blk = (size_t)len * esz;
                void **in = gen_all(n, dt, len, tag++);
                char *got = (char *)malloc(blk * n + 1), *want = (char *)malloc(blk * n + 1);
                char label[160];
                snprintf(label, sizeof label, "rank %d: all_gather %s count %lld%s", c->rank, dsk_dtype_name(dt),
                         (long long)len, in_place ? " in place" : "");
                for (int r = 0; r < n; r++) memcpy(want + r * blk, in[r], blk);
                dsk_test_poison_bytes(got, blk * n);
                if (in_place) {
                    memcpy(got + c->rank * blk, in[c->rank], blk);
                    DSK_TEST_OK(dsk_comm_all_gather(c, NULL, got + c->rank * blk, got, len, dt));
                } else {
                    DSK_TEST_OK(dsk_comm_all_gather(c, NULL, in[c->rank], got, len, dt));
                }
                DSK_TEST_SAME_BYTES(got, want, blk * n, label);
                free(got);
                free(want);
                free_all(n, in);
                whole += (uint64_t)blk * (uint64_t)n;
            }
    check_payload("all_gather", c, before, c->stats.all_gather_payload, whole,
                  dsk_comm_all_gather(c, NULL, &x, &x, -1, DSK_F32));
}

static void rank_broadcast(dsk_comm *c, void *arg) {
    int n = c->world_size;
    uint64_t tag = 4000;
    static const int64_t sizes[] = {0, 1, 7, 129, 70001, 600011};
    (void)arg;
    for (size_t d = 0; d < sizeof k_dtypes / sizeof *k_dtypes; d++)
        for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++)
            for (int root = 0; root < n; root += (n > 1 ? n - 1 : 1)) {
                dsk_dtype dt = k_dtypes[d];
                int64_t len = sizes[s];
                size_t bytes = (size_t)len * dsk_dtype_size(dt);
                void **in = gen_all(n, dt, len, tag++);
                char *got = (char *)malloc(bytes + 1);
                char label[160];
                int in_place = (int)(s & 1);
                snprintf(label, sizeof label, "rank %d: broadcast %s count %lld root %d%s", c->rank, dsk_dtype_name(dt),
                         (long long)len, root, in_place ? " in place" : "");
                dsk_test_poison_bytes(got, bytes);
                if (in_place && c->rank == root) memcpy(got, in[root], bytes);
                DSK_TEST_OK(dsk_comm_broadcast(c, NULL, in_place ? got : in[c->rank], got, len, dt, root));
                DSK_TEST_SAME_BYTES(got, in[root], bytes, label);
                free(got);
                free_all(n, in);
            }
}

/* Rooted collectives at roots 0 and n - 1; the other ranks' recv is NULL or a poisoned buffer
   that must stay untouched. in place on the root every other case. */
static void rank_reduce(dsk_comm *c, void *arg) {
    int n = c->world_size, me = c->rank;
    uint64_t tag = 14000;
    (void)arg;
    for (size_t d = 0; d < sizeof k_dtypes / sizeof *k_dtypes; d++)
        for (size_t o = 0; o < 4; o++)
            for (size_t s = 0; s < sizeof k_sizes / sizeof *k_sizes; s++)
                for (int root = 0; root < n; root += (n > 1 ? n - 1 : 1)) {
                    dsk_dtype dt = k_dtypes[d];
                    int64_t len = k_sizes[s];
                    size_t bytes = (size_t)len * dsk_dtype_size(dt);
                    /* the fold is all_reduce's (checked there for every op and size): here every size
                       with sum, the other ops on one small and one large (reduce-scatter) size */
                    if (k_ops[o] != DSK_COMM_SUM && len != 7 && len != 70001) continue;
                    void **in = gen_all(n, dt, len, tag++);
                    char *got = (char *)malloc(bytes + 1), *want = (char *)malloc(bytes + 1),
                         *poison = (char *)malloc(bytes + 1);
                    char label[160];
                    int in_place = (int)((s + o) & 1);
                    snprintf(label, sizeof label, "rank %d: reduce %s %s count %lld root %d%s", me, dsk_dtype_name(dt),
                             dsk_comm_op_name(k_ops[o]), (long long)len, root, in_place ? " in place" : "");
                    dsk_test_poison_bytes(got, bytes);
                    dsk_test_poison_bytes(poison, bytes);
                    if (me == root) {
                        ref_reduce(dt, k_ops[o], n, in, 0, len, want);
                        if (in_place) memcpy(got, in[me], bytes);
                        DSK_TEST_OK(dsk_comm_reduce(c, NULL, in_place ? got : in[me], got, len, dt, k_ops[o], root));
                        DSK_TEST_SAME_BYTES(got, want, bytes, label);
                    } else {
                        DSK_TEST_OK(dsk_comm_reduce(c, NULL, in[me], in_place ? NULL : got, len, dt, k_ops[o], root));
                        DSK_TEST_SAME_BYTES(got, poison, bytes, label); /* untouched off the root */
                    }
                    free(got);
                    free(want);
                    free(poison);
                    free_all(n, in);
                }
}

static void rank_gather(dsk_comm *c, void *arg) {
    int n = c->world_size, me = c->rank;
    uint64_t tag = 15000;
    (void)arg;
    for (size_t d = 0; d < sizeof k_dtypes / sizeof *k_dtypes; d++)
        for (size_t s = 0; s < sizeof k_sizes / sizeof *k_sizes; s++)
            for (int root = 0; root < n; root += (n > 1 ? n - 1 : 1)) {
                dsk_dtype dt = k_dtypes[d];
                int64_t len = k_sizes[s];
                size_t blk = (size_t)len * dsk_dtype_size(dt);
                void **in = gen_all(n, dt, len, tag++);
                char *got = (char *)malloc(blk * n + 1), *want = (char *)malloc(blk * n + 1), label[160];
                int in_place = (int)(s & 1);
                snprintf(label, sizeof label, "rank %d: gather %s count %lld root %d%s", me, dsk_dtype_name(dt),
                         (long long)len, root, in_place ? " in place" : "");
                dsk_test_poison_bytes(got, blk * n);
                memcpy(want, got, blk * n); /* off the root: untouched */
                if (me == root) {
                    for (int r = 0; r < n; r++) memcpy(want + r * blk, in[r], blk);
                    if (in_place) memcpy(got + me * blk, in[me], blk);
                }
                DSK_TEST_OK(dsk_comm_gather(c, NULL, in_place && me == root ? got + me * blk : in[me],
                                            in_place && me != root ? NULL : got, len, dt, root));
                DSK_TEST_SAME_BYTES(got, want, blk * n, label);
                free(got);
                free(want);
                free_all(n, in);
            }
}

static void rank_scatter(dsk_comm *c, void *arg) {
    int n = c->world_size, me = c->rank;
    uint64_t tag = 16000;
    (void)arg;
    for (size_t d = 0; d < sizeof k_dtypes / sizeof *k_dtypes; d++)
        for (size_t s = 0; s < sizeof k_sizes / sizeof *k_sizes; s++)
            for (int root = 0; root < n; root += (n > 1 ? n - 1 : 1)) {
                dsk_dtype dt = k_dtypes[d];
                int64_t len = k_sizes[s];
                size_t blk = (size_t)len * dsk_dtype_size(dt);
                void **in = gen_all(n, dt, len * n, tag++);
                char *got = (char *)malloc(blk * n + 1), label[160];
                int in_place = (int)(s & 1);
                snprintf(label, sizeof label, "rank %d: scatter %s count %lld root %d%s", me, dsk_dtype_name(dt),
                         (long long)len, root, in_place ? " in place" : "");
                dsk_test_poison_bytes(got, blk * n);
                if (me == root && in_place) {
                    memcpy(got, in[root], blk * n);
                    DSK_TEST_OK(dsk_comm_scatter(c, NULL, got, got + me * blk, len, dt, root));
                    DSK_TEST_SAME_BYTES(got, in[root], blk * n, label); /* its block in place, the rest as it was */
                } else {
                    const void *src = me == root ? in[root] : in_place ? NULL : in[me]; /* NULL off the root */
                    DSK_TEST_OK(dsk_comm_scatter(c, NULL, src, got, len, dt, root));
                    DSK_TEST_SAME_BYTES(got, (char *)in[root] + me * blk, blk, label);
                }
                free(got);
                free_all(n, in);
            }
}

static void rank_all_to_all(dsk_comm *c, void *arg) {
    int n = c->world_size;
    uint64_t tag = 5000;
    (void)arg;
    for (size_t d = 0; d < sizeof k_dtypes / sizeof *k_dtypes; d++)
        for (size_t s = 0; s < sizeof k_sizes / sizeof *k_sizes; s++) {
            dsk_dtype dt = k_dtypes[d];
            int64_t len = k_sizes[s] / 3 + (int64_t)s;
            size_t blk = (size_t)len * dsk_dtype_size(dt);
            void **in = gen_all(n, dt, len * n, tag++);
            char *got = (char *)malloc(blk * n + 1), *want = (char *)malloc(blk * n + 1);
            char label[160];
            int in_place = (int)(s & 1);
            snprintf(label, sizeof label, "rank %d: all_to_all %s block %lld%s", c->rank, dsk_dtype_name(dt),
                     (long long)len, in_place ? " in place" : "");
            for (int p = 0; p < n; p++) memcpy(want + p * blk, (char *)in[p] + c->rank * blk, blk);
            if (in_place) memcpy(got, in[c->rank], blk * n);
            else dsk_test_poison_bytes(got, blk * n);
            DSK_TEST_OK(dsk_comm_all_to_all(c, NULL, in_place ? got : in[c->rank], got, len, dt));
            DSK_TEST_SAME_BYTES(got, want, blk * n, label);
            free(got);
            free(want);
            free_all(n, in);
        }
}

/* counts[s][d]: elements rank s sends rank d in round `tag`; about a third are 0. */
static int64_t a2av_count(uint64_t tag, int s, int d, int64_t scale) {
    uint64_t u = dsk_test_mix64(g_seed ^ dsk_test_mix64(tag * 7 + (uint64_t)s * 64 + (uint64_t)d));
    return (u % 3 == 0) ? 0 : (int64_t)((u >> 8) % (uint64_t)scale) + 1;
}

/* dsk_comm_all_to_all_v_notify's callback: rank p's block must be whole in got when p is reported, each rank
   once, this rank's own first. */
typedef struct a2av_told {
    const char *got, *want;
    const int64_t *rd, *rc;
    size_t esz;
    int told[8], calls, first;
} a2av_told;

static void a2av_arrived(void *arg, int p) {
    a2av_told *t = (a2av_told *)arg;
    if (t->calls++ == 0) t->first = p;
    if (p < 0 || p >= 8) return;
    t->told[p]++;
    if (memcmp(t->got + t->rd[p] * (int64_t)t->esz, t->want + t->rd[p] * (int64_t)t->esz, (size_t)t->rc[p] * t->esz))
        t->told[p] = -1000; /* reported before its data landed */
}

/* dsk_comm_all_to_all_v_gated's side: a thread writes this rank's send blocks into a poisoned buffer one by one,
   in an order the seed shuffles, a pause before each, and opens each block's gate after writing it; a message
   that left before its gate carries poison, which the receiver's comparison catches. */
typedef struct a2av_filler {
    char *send;      /* poisoned until written */
    const char *src; /* the blocks' data */
    const int64_t *sd, *sc;
    size_t esz;
    int n, order[8];
    int gate[8]; /* 0 shut, 1 open (atomics) */
    int asked;   /* ready's calls (atomic) */
} a2av_filler;

static void *a2av_fill(void *arg) {
    a2av_filler *f = (a2av_filler *)arg;
    for (int i = 0; i < f->n; i++) {
        int p = f->order[i];
        nanosleep(&(struct timespec){0, 300000}, NULL);
        memcpy(f->send + f->sd[p] * (int64_t)f->esz, f->src + f->sd[p] * (int64_t)f->esz, (size_t)f->sc[p] * f->esz);
        __atomic_store_n(&f->gate[p], 1, __ATOMIC_RELEASE);
    }
    return NULL;
}

static int a2av_ready(void *arg, int p) {
    a2av_filler *f = (a2av_filler *)arg;
    __atomic_add_fetch(&f->asked, 1, __ATOMIC_RELAXED);
    return p >= 0 && p < f->n ? __atomic_load_n(&f->gate[p], __ATOMIC_ACQUIRE) : -1;
}

/* The gated exchange of in (tot elements) with a2av_fill filling a poisoned copy meanwhile; packed: NULL
   displacements to the call (sd and rd are then the prefix sums). */
static dsk_status a2av_gated(dsk_comm *c, const void *in, int64_t tot, const int64_t *sc, const int64_t *sd, void *got,
                             const int64_t *rc, const int64_t *rd, int packed, dsk_dtype dt, uint64_t tag, int *asked) {
    int n = c->world_size;
    size_t esz = dsk_dtype_size(dt);
    a2av_filler f = {(char *)malloc((size_t)tot * esz), (const char *)in, sd, sc, esz, n, {0}, {0}, 0};
    pthread_t th;
    dsk_status st;
    dsk_test_poison_bytes(f.send, (size_t)tot * esz);
    for (int p = 0; p < n; p++) f.order[p] = p;
    for (int p = n - 1; p > 0; p--) { /* Fisher-Yates from the seed */
        int q = (int)(dsk_test_mix64(g_seed ^ (tag * 31 + (uint64_t)p)) % (uint64_t)(p + 1)), t = f.order[p];
        f.order[p] = f.order[q];
        f.order[q] = t;
    }
    if (pthread_create(&th, NULL, a2av_fill, &f)) {
        free(f.send);
        return dsk_set_error(DSK_ERR_OOM, "test: pthread_create");
    }
    st = dsk_comm_all_to_all_v_gated(c, NULL, f.send, sc, packed ? NULL : sd, got, rc, packed ? NULL : rd, dt,
                                     a2av_ready, &f);
    pthread_join(th, NULL);
    *asked = __atomic_load_n(&f.asked, __ATOMIC_RELAXED);
    free(f.send);
    return st;
}

static void *a2av_finish_main(void *c) { return (void *)(intptr_t)dsk_comm_finish((dsk_comm *)c, NULL); }

/* The exchange begun (dsk_comm_all_to_all_v_start) and finished: here, or on a thread of its own when the
   transport left bytes unsent, as dsk_moe does; one call counted, at the finish. */
static void a2av_begun(dsk_comm *c, const void *in, const int64_t *sc, const int64_t *sd, void *got, const int64_t *rc,
                       const int64_t *rd, dsk_dtype dt, int64_t send_bytes, const char *label) {
    size_t unsent = (size_t)-1;
    int64_t calls = c->stats.calls;
    DSK_TEST_OK(dsk_comm_all_to_all_v_start(c, NULL, in, sc, sd, got, rc, rd, dt, &unsent));
    DSK_TEST_EXPECT(unsent <= (size_t)send_bytes + (size_t)c->world_size * 64, "%s: %zu bytes unsent of %lld", label,
                    unsent, (long long)send_bytes);
    DSK_TEST_EXPECT(c->stats.calls == calls, "%s: counted at the start", label);
    if (unsent > 0) {
        pthread_t th;
        void *rv = NULL;
        DSK_TEST_EXPECT(pthread_create(&th, NULL, a2av_finish_main, c) == 0, "%s: pthread_create", label);
        pthread_join(th, &rv);
        DSK_TEST_EXPECT((dsk_status)(intptr_t)rv == DSK_OK, "%s: finish on a thread: %s", label, dsk_last_error());
    } else {
        DSK_TEST_OK(dsk_comm_finish(c, NULL));
    }
    DSK_TEST_EXPECT(c->stats.calls == calls + 1, "%s: %lld calls counted", label, (long long)(c->stats.calls - calls));
}

/* The exchange begun and moved on by dsk_comm_progress, waiting (or polling, `poll`) until every rank's message
   has landed, each checked against want the moment it is first reported (this rank's own at the first call), none
   reported and then taken back, every waiting call bringing one at least; then finished. rd: the displacements
   (also when the call gets NULL ones). */
static void a2av_progressed(dsk_comm *c, const void *in, const int64_t *sc, const int64_t *sd, char *got,
                            const int64_t *rc, const int64_t *rd, const int64_t *call_rd, const char *want,
                            dsk_dtype dt, int poll, const char *label) {
    int n = c->world_size, me = c->rank, landed[8], seen[8] = {0}, all = 0, calls = 0;
    size_t esz = dsk_dtype_size(dt), unsent = 0, before = (size_t)-1;
    double t0 = dsk_test_now();
    DSK_TEST_OK(dsk_comm_all_to_all_v_start(c, NULL, in, sc, sd, got, rc, call_rd, dt, NULL));
    while (!all) {
        int fresh = 0;
        dsk_status st = dsk_comm_progress(c, NULL, !poll, landed, &unsent);
        DSK_TEST_OK(st);
        if (st != DSK_OK) return;
        DSK_TEST_EXPECT(unsent <= before, "%s: %zu bytes unsent after %zu", label, unsent, before);
        before = unsent;
        all = 1;
        for (int p = 0; p < n; p++) {
            DSK_TEST_EXPECT(landed[p] || !seen[p], "%s: rank %d landed, then not", label, p);
            if (landed[p] && !seen[p]) {
                char what[200];
                snprintf(what, sizeof what, "%s: rank %d's block when reported", label, p);
                DSK_TEST_SAME_BYTES(got + rd[p] * (int64_t)esz, want + rd[p] * (int64_t)esz, (size_t)rc[p] * esz, what);
                seen[p] = 1;
                fresh++;
            }
            all &= seen[p];
        }
        DSK_TEST_EXPECT(calls > 0 || landed[me], "%s: this rank's own block not landed at the first call", label);
        DSK_TEST_EXPECT(poll || fresh > 0, "%s: a waiting call returned with nothing landed", label);
        DSK_TEST_EXPECT(dsk_test_now() - t0 < 60, "%s: not all landed after 60 s", label);
        if (dsk_test_now() - t0 >= 60) break;
        calls++;
    }
    DSK_TEST_OK(dsk_comm_finish(c, NULL));
}

/* all_to_all_v against the blocks computed here, or its _notify form (mode 1), whose callback checks each
   rank's block as it is reported, or its _gated form (mode 2), whose blocks are written as it runs, or begun
   and finished (mode 3), or begun and moved on by dsk_comm_progress waiting (4) or polling (5). */
static void a2av_check(dsk_comm *c, int notify) {
    int n = c->world_size, me = c->rank;
    static const int64_t scales[] = {1, 5, 130, 40000};
    for (size_t d = 0; d < sizeof k_dtypes / sizeof *k_dtypes; d++)
        for (size_t s = 0; s < sizeof scales / sizeof *scales; s++)
            for (int packed = 0; packed < 2; packed++) {
                uint64_t tag = 6000 + d * 100 + s * 10 + (uint64_t)packed;
                dsk_dtype dt = k_dtypes[d];
                size_t esz = dsk_dtype_size(dt);
                int64_t sc[8], sd[8], rc[8], rd[8], stot = 0, rtot = 0, gap = packed ? 0 : 3;
                void **in;
                char *got, *want;
                char label[160];
                for (int p = 0; p < n; p++) {
                    sc[p] = a2av_count(tag, me, p, scales[s]);
                    rc[p] = a2av_count(tag, p, me, scales[s]);
                    sd[p] = stot;
                    rd[p] = rtot;
                    stot += sc[p] + gap; /* gaps between blocks when not packed */
                    rtot += rc[p] + gap;
                }
                /* every rank's send buffer, sized for its own counts */
                in = (void **)malloc((size_t)n * sizeof(void *));
                for (int p = 0; p < n; p++) {
                    int64_t tot = 1;
                    for (int q = 0; q < n; q++) tot += a2av_count(tag, p, q, scales[s]) + gap;
                    in[p] = malloc((size_t)tot * esz);
                    gen(in[p], dt, tot, tag, p);
                }
                got = (char *)malloc((size_t)(rtot + 1) * esz);
                want = (char *)malloc((size_t)(rtot + 1) * esz);
                dsk_test_poison_bytes(got, (size_t)rtot * esz);
                memcpy(want, got, (size_t)rtot * esz);
                /* what rank p sends me starts at p's displacement for me */
                for (int p = 0; p < n; p++) {
                    int64_t off = 0;
                    for (int q = 0; q < me; q++) off += a2av_count(tag, p, q, scales[s]) + gap;
                    memcpy(want + rd[p] * (int64_t)esz, (char *)in[p] + off * (int64_t)esz, (size_t)rc[p] * esz);
                }
                snprintf(label, sizeof label, "rank %d: all_to_all_v %s scale %lld%s", me, dsk_dtype_name(dt),
                         (long long)scales[s], packed ? " packed (NULL displacements)" : " with gaps");
                if (notify >= 4) {
                    a2av_progressed(c, in[me], sc, packed ? NULL : sd, got, rc, rd, packed ? NULL : rd, want, dt,
                                    notify == 5, label);
                } else if (notify == 3) {
                    a2av_begun(c, in[me], sc, packed ? NULL : sd, got, rc, packed ? NULL : rd, dt,
                               (stot - (int64_t)n * gap) * (int64_t)esz, label);
                } else if (notify == 2) {
                    int64_t tot = 1;
                    int asked = 0;
                    for (int q = 0; q < n; q++) tot += sc[q] + gap;
                    DSK_TEST_OK(a2av_gated(c, in[me], tot, sc, sd, got, rc, rd, packed, dt, tag, &asked));
                    DSK_TEST_EXPECT(asked >= n, "%s: ready asked %d times for %d ranks", label, asked, n);
                } else if (notify) {
                    a2av_told t = {got, want, rd, rc, esz, {0}, 0, -1};
                    DSK_TEST_OK(dsk_comm_all_to_all_v_notify(c, NULL, in[me], sc, packed ? NULL : sd, got, rc,
                                                             packed ? NULL : rd, dt, a2av_arrived, &t));
                    DSK_TEST_EXPECT(t.calls == n && t.first == me, "%s: %d reports, the first for rank %d", label,
                                    t.calls, t.first);
                    for (int p = 0; p < n; p++)
                        DSK_TEST_EXPECT(t.told[p] == 1, "%s: rank %d reported %d times (< 0: before its data)", label,
                                        p, t.told[p]);
                } else {
                    DSK_TEST_OK(dsk_comm_all_to_all_v(c, NULL, in[me], sc, packed ? NULL : sd, got, rc,
                                                      packed ? NULL : rd, dt));
                }
                DSK_TEST_SAME_BYTES(got, want, (size_t)rtot * esz, label);
                free(got);
                free(want);
                free_all(n, in);
            }
}

static void rank_all_to_all_v(dsk_comm *c, void *arg) {
    (void)arg;
    a2av_check(c, 0);
}

static void rank_all_to_all_v_notify(dsk_comm *c, void *arg) {
    (void)arg;
    a2av_check(c, 1);
}

static void rank_all_to_all_v_gated(dsk_comm *c, void *arg) {
    (void)arg;
    a2av_check(c, 2);
}

static void rank_all_to_all_v_begun(dsk_comm *c, void *arg) {
    (void)arg;
    a2av_check(c, 3);
}

static void rank_all_to_all_v_progress(dsk_comm *c, void *arg) {
    (void)arg;
    a2av_check(c, 4);
    a2av_check(c, 5);
}

/* Misuse of a begun exchange: a finish with none begun, and any other call (a second start, a barrier) while
   one is in flight, fail with DSK_ERR_STATE naming the call and leave the exchange and the communicator as
   they were: its finish then delivers every rank's message. */
static void rank_all_to_all_v_begun_misuse(dsk_comm *c, void *arg) {
    int n = c->world_size, me = c->rank;
    int64_t cnt[8], x[8], y[8], z[8];
    (void)arg;
    for (int p = 0; p < n; p++) {
        cnt[p] = 1;
        x[p] = 100 * me + p;
        y[p] = -1;
    }
    DSK_TEST_STATUS(dsk_comm_finish(c, NULL), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("dsk_comm_finish: rank");
    DSK_TEST_ERROR_MENTIONS("has no exchange begun by dsk_comm_all_to_all_v_start");
    DSK_TEST_STATUS(dsk_comm_progress(c, NULL, 1, NULL, NULL), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("dsk_comm_progress: rank");
    DSK_TEST_ERROR_MENTIONS("has no exchange begun by dsk_comm_all_to_all_v_start");
    DSK_TEST_OK(dsk_comm_all_to_all_v_start(c, NULL, x, cnt, NULL, y, cnt, NULL, DSK_I64, NULL));
    DSK_TEST_STATUS(dsk_comm_all_to_all_v_start(c, NULL, x, cnt, NULL, z, cnt, NULL, DSK_I64, NULL), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("dsk_comm_all_to_all_v_start: rank");
    DSK_TEST_ERROR_MENTIONS("exchange begun by dsk_comm_all_to_all_v_start is in flight; dsk_comm_finish it first");
    DSK_TEST_STATUS(dsk_comm_barrier(c, NULL), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("dsk_comm_barrier: rank");
    DSK_TEST_OK(dsk_comm_finish(c, NULL));
    for (int p = 0; p < n; p++)
        DSK_TEST_EXPECT(y[p] == 100 * p + me, "rank %d: got %lld from rank %d, not %d", me, (long long)y[p], p,
                        100 * p + me);
    DSK_TEST_OK(dsk_comm_barrier(c, NULL));
}

static int a2av_give_up(void *arg, int p) {
    (void)arg;
    (void)p;
    return -1;
}

/* Every rank gives up its messages (ready says -1): each call fails with DSK_ERR_STATE naming a rank, and the
   communicator is broken after it (the peers will never get those messages); ready NULL is DSK_ERR_ARG. */
static void rank_all_to_all_v_gated_give_up(dsk_comm *c, void *arg) {
    int n = c->world_size;
    int64_t cnt[8], x[8] = {0}, y[8];
    (void)arg;
    for (int p = 0; p < n; p++) cnt[p] = 1;
    DSK_TEST_STATUS(dsk_comm_all_to_all_v_gated(c, NULL, x, cnt, NULL, y, cnt, NULL, DSK_I64, NULL, NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("ready is NULL");
    DSK_TEST_STATUS(dsk_comm_all_to_all_v_gated(c, NULL, x, cnt, NULL, y, cnt, NULL, DSK_I64, a2av_give_up, NULL),
                    DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("dsk_comm_all_to_all_v_gated: the caller gave up its message to rank");
    DSK_TEST_EXPECT(dsk_comm_barrier(c, NULL) != DSK_OK, "a barrier after a given-up exchange succeeded");
}

/* Ring: each rank sends to rank + 1 and receives from rank - 1 (even ranks send first). */
static void rank_send_recv(dsk_comm *c, void *arg) {
    int n = c->world_size, me = c->rank, next = (me + 1) % n, prev = (me + n - 1) % n;
    uint64_t sent_next = 0;
    (void)arg;
    if (n == 1) {
        float x = 1;
        DSK_TEST_STATUS(dsk_comm_send(c, NULL, &x, 1, DSK_F32, 0), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("peer 0");
        return;
    }
    for (size_t d = 0; d < sizeof k_dtypes / sizeof *k_dtypes; d++) {
        dsk_dtype dt = k_dtypes[d];
        int64_t len = 100003 + (int64_t)d;
        size_t bytes = (size_t)len * dsk_dtype_size(dt);
        void **in = gen_all(n, dt, len, 7000 + d);
        char *got = (char *)malloc(bytes);
        char label[96];
        dsk_test_poison_bytes(got, bytes);
        if (me % 2 == 0) {
            DSK_TEST_OK(dsk_comm_send(c, NULL, in[me], len, dt, next));
            DSK_TEST_OK(dsk_comm_recv(c, NULL, got, len, dt, prev));
        } else {
            DSK_TEST_OK(dsk_comm_recv(c, NULL, got, len, dt, prev));
            DSK_TEST_OK(dsk_comm_send(c, NULL, in[me], len, dt, next));
        }
        snprintf(label, sizeof label, "rank %d: recv %s from rank %d", me, dsk_dtype_name(dt), prev);
        DSK_TEST_SAME_BYTES(got, in[prev], bytes, label);
        sent_next += bytes;
        free(got);
        free_all(n, in);
    }
    DSK_TEST_OK(dsk_comm_barrier(c, NULL));
    DSK_TEST_EXPECT(c->stats.calls > 0 && c->stats.bytes_sent > 0 && c->stats.bytes_received > 0, "stats not counted");
    /* bytes to the other emulated host: at least the payloads if `next` is there, headers anyway */
    if (g_mode != MODE_TWO_HOSTS)
        DSK_TEST_EXPECT(c->stats.bytes_sent_off_node == 0, "%llu bytes counted as sent off the node",
                        (unsigned long long)c->stats.bytes_sent_off_node);
    else
        DSK_TEST_EXPECT(c->stats.bytes_sent_off_node > 0 && c->stats.bytes_sent_off_node < c->stats.bytes_sent &&
                            (host_of(next, n) == host_of(me, n) || c->stats.bytes_sent_off_node > sent_next),
                        "rank %d: %llu of %llu bytes sent off the node, %llu of payload to rank %d", me,
                        (unsigned long long)c->stats.bytes_sent_off_node, (unsigned long long)c->stats.bytes_sent,
                        (unsigned long long)sent_next, next);
}

/* Begun point to point: every rank begins its sends to rank + 1 first (an order that would deadlock with blocking
   sends larger than a ring), then its receives from rank - 1, each pair of messages a small one and one larger
   than a shared-memory ring, 7 dtypes; waited in the reverse order (the later receive first, then all). Each
   receive holds its own message (the two from one peer meet in order); a finished id waits at once. */
static void rank_p2p_begun(dsk_comm *c, void *arg) {
    int n = c->world_size, me = c->rank, next = (me + 1) % n, prev = (me + n - 1) % n;
    uint64_t payload0 = c->stats.send_payload;
    int64_t want_payload = 0;
    (void)arg;
    if (n == 1) {
        float x = 1;
        DSK_TEST_STATUS(dsk_comm_recv_start(c, NULL, &x, 1, DSK_F32, 0, NULL), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_comm_recv_start: peer 0 is not another rank");
        return;
    }
    for (size_t d = 0; d < sizeof k_dtypes / sizeof *k_dtypes; d++) {
        dsk_dtype dt = k_dtypes[d];
        int64_t len[2] = {17 + (int64_t)d, 300007 + (int64_t)d}, sreq[2], rreq[2];
        void **in[2];
        char *got[2], label[96];
        for (int k = 0; k < 2; k++) {
            in[k] = gen_all(n, dt, len[k], 7100 + 10 * d + (size_t)k);
            got[k] = (char *)malloc((size_t)len[k] * dsk_dtype_size(dt));
            dsk_test_poison_bytes(got[k], (size_t)len[k] * dsk_dtype_size(dt));
        }
        for (int k = 0; k < 2; k++) DSK_TEST_OK(dsk_comm_send_start(c, NULL, in[k][me], len[k], dt, next, &sreq[k]));
        for (int k = 0; k < 2; k++) DSK_TEST_OK(dsk_comm_recv_start(c, NULL, got[k], len[k], dt, prev, &rreq[k]));
        DSK_TEST_EXPECT(sreq[1] == sreq[0] + 1 && rreq[0] == sreq[1] + 1 && rreq[1] == rreq[0] + 1,
                        "request ids %lld %lld %lld %lld", (long long)sreq[0], (long long)sreq[1], (long long)rreq[0],
                        (long long)rreq[1]);
        DSK_TEST_OK(dsk_comm_wait(c, NULL, rreq[1]));
        snprintf(label, sizeof label, "rank %d: the larger %s from rank %d", me, dsk_dtype_name(dt), prev);
        DSK_TEST_SAME_BYTES(got[1], in[1][prev], (size_t)len[1] * dsk_dtype_size(dt), label);
        DSK_TEST_OK(dsk_comm_wait(c, NULL, DSK_COMM_ALL_REQUESTS));
        DSK_TEST_OK(dsk_comm_wait(c, NULL, sreq[0])); /* finished: at once */
        snprintf(label, sizeof label, "rank %d: the small %s from rank %d", me, dsk_dtype_name(dt), prev);
        DSK_TEST_SAME_BYTES(got[0], in[0][prev], (size_t)len[0] * dsk_dtype_size(dt), label);
        want_payload += (len[0] + len[1]) * (int64_t)dsk_dtype_size(dt);
        for (int k = 0; k < 2; k++) {
            free(got[k]);
            free_all(n, in[k]);
        }
    }
    DSK_TEST_EXPECT(c->stats.send_payload - payload0 == (uint64_t)want_payload, "rank %d: send_payload %llu, want %lld",
                    me, (unsigned long long)(c->stats.send_payload - payload0), (long long)want_payload);
    DSK_TEST_OK(dsk_comm_barrier(c, NULL));
}

/* dsk_comm_test: a receive begun before its sender may send (each rank sends to rank + 1 only once that rank said
   "go") is idle; polled, it moves on to done, larger than a ring, and holds the message; a waited request is done;
   bad arguments. */
static void rank_p2p_test(dsk_comm *c, void *arg) {
    int n = c->world_size, me = c->rank, next = (me + 1) % n, prev = (me + n - 1) % n, state = -1, polls = 0;
    int64_t len = 300007, req, req_go, go = 1, got_go = 0;
    void **in = gen_all(n, DSK_F32, len, 7300);
    float *got = (float *)malloc((size_t)len * sizeof(float));
    (void)arg;
    if (n == 1) {
        DSK_TEST_STATUS(dsk_comm_test(c, NULL, 0, &state), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_comm_test: request 0 was never begun");
        free(got);
        free_all(n, in);
        return;
    }
    dsk_test_poison_bytes(got, (size_t)len * sizeof(float));
    /* the go from rank + 1 first: with 2 ranks it travels before the message on the same link */
    DSK_TEST_OK(dsk_comm_recv_start(c, NULL, &got_go, 1, DSK_I64, next, &req_go));
    DSK_TEST_OK(dsk_comm_recv_start(c, NULL, got, len, DSK_F32, prev, &req));
    DSK_TEST_OK(dsk_comm_test(c, NULL, req, &state));
    DSK_TEST_EXPECT(state == DSK_COMM_REQ_IDLE, "rank %d: a receive its sender cannot have begun is in state %d", me,
                    state);
    DSK_TEST_OK(dsk_comm_send(c, NULL, &go, 1, DSK_I64, prev));
    DSK_TEST_OK(dsk_comm_wait(c, NULL, req_go));
    DSK_TEST_OK(dsk_comm_send(c, NULL, in[me], len, DSK_F32, next));
    while (state != DSK_COMM_REQ_DONE && polls++ < 10000000)
        if (dsk_comm_test(c, NULL, req, &state) != DSK_OK || state < DSK_COMM_REQ_IDLE || state > DSK_COMM_REQ_DONE) {
            DSK_TEST_EXPECT(0, "rank %d: dsk_comm_test: state %d, %s", me, state, dsk_last_error());
            break;
        }
    DSK_TEST_EXPECT(state == DSK_COMM_REQ_DONE && got_go == 1, "rank %d: state %d after %d polls, go %lld", me, state,
                    polls, (long long)got_go);
    DSK_TEST_SAME_BYTES(got, in[prev], (size_t)len * sizeof(float), "the message polled to the end");
    DSK_TEST_OK(dsk_comm_test(c, NULL, req_go, &state)); /* waited: done */
    DSK_TEST_EXPECT(state == DSK_COMM_REQ_DONE, "a waited receive is in state %d", state);
    DSK_TEST_STATUS(dsk_comm_test(c, NULL, DSK_COMM_ALL_REQUESTS, &state), DSK_ERR_ARG);
    DSK_TEST_STATUS(dsk_comm_test(c, NULL, req, NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("state is NULL");
    DSK_TEST_OK(dsk_comm_wait(c, NULL, DSK_COMM_ALL_REQUESTS));
    DSK_TEST_OK(dsk_comm_barrier(c, NULL));
    free(got);
    free_all(n, in);
}

/* Begun point to point, misuse: a collective or a begun exchange while requests are pending (state, naming them),
   an id never issued (argument), a blocking send while a receive is pending (it moves it). */
static void rank_p2p_begun_misuse(dsk_comm *c, void *arg) {
    int n = c->world_size, me = c->rank, next = (me + 1) % n, prev = (me + n - 1) % n;
    float x[4] = {1, 2, 3, (float)me}, y[4] = {0}, z[4];
    int64_t req, cnt[8];
    (void)arg;
    if (n == 1) return;
    for (int p = 0; p < n; p++) cnt[p] = 1;
    DSK_TEST_OK(dsk_comm_recv_start(c, NULL, y, 4, DSK_F32, prev, &req));
    DSK_TEST_STATUS(dsk_comm_all_reduce(c, NULL, x, z, 4, DSK_F32, DSK_COMM_SUM), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("dsk_comm_all_reduce: rank");
    DSK_TEST_ERROR_MENTIONS("pending; dsk_comm_wait them first");
    DSK_TEST_STATUS(dsk_comm_all_to_all_v_start(c, NULL, x, cnt, NULL, z, cnt, NULL, DSK_F32, NULL), DSK_ERR_STATE);
    DSK_TEST_STATUS(dsk_comm_wait(c, NULL, req + 1), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("was never begun");
    DSK_TEST_STATUS(dsk_comm_wait(c, NULL, -2), DSK_ERR_ARG);
    DSK_TEST_OK(dsk_comm_send(c, NULL, x, 4, DSK_F32, next));
    DSK_TEST_OK(dsk_comm_wait(c, NULL, req));
    DSK_TEST_EXPECT(y[0] == 1 && y[3] == (float)prev, "rank %d: received %g ... %g", me, (double)y[0], (double)y[3]);
    DSK_TEST_OK(dsk_comm_barrier(c, NULL)); /* none pending: collectives again */
    DSK_TEST_STATUS(dsk_comm_wait(NULL, NULL, 0), DSK_ERR_ARG);
    /* what a send leaves in the buffers: a ring's room over shared memory, nothing over TCP, to itself or no rank */
    if (g_mode != MODE_TWO_HOSTS)
        DSK_TEST_EXPECT(dsk_comm_buffered_bytes(c, next) == (g_mode == MODE_SHM ? dsk_comm_host_ring_room(n) : 0),
                        "rank %d: %lld bytes buffered to rank %d", me, (long long)dsk_comm_buffered_bytes(c, next),
                        next);
    DSK_TEST_EXPECT(dsk_comm_buffered_bytes(c, me) == 0 && dsk_comm_buffered_bytes(c, n) == 0 &&
                        dsk_comm_buffered_bytes(NULL, 0) == 0 && dsk_comm_host_ring_room(1) == 0,
                    "buffered bytes to itself, to no rank, or on no communicator");
}

/* Sub-groups: parity groups with reversed keys, a rank outside every group, a nested split. */
static void rank_split(dsk_comm *c, void *arg) {
    int n = c->world_size, me = c->rank;
    dsk_comm sub, solo, nested;
    int color = me % 2, members = 0, my_index = 0;
    float x[5], want[5];
    (void)arg;
    DSK_TEST_OK(dsk_comm_split(c, color, -me, &sub));
    for (int r = 0; r < n; r++)
        if (r % 2 == color) { members++; if (r > me) my_index++; }
    DSK_TEST_EXPECT(sub.world_size == members && sub.rank == my_index, "rank %d: sub rank %d of %d, want %d of %d", me,
                    sub.rank, sub.world_size, my_index, members);
    /* all-reduce in the sub-group: fold in sub-rank order = descending world rank */
    {
        void **in = gen_all(n, DSK_F32, 5, 8000), *ord[8];
        int k = 0;
        for (int r = n - 1; r >= 0; r--)
            if (r % 2 == color) ord[k++] = in[r];
        ref_reduce(DSK_F32, DSK_COMM_SUM, k, ord, 0, 5, want);
        DSK_TEST_OK(dsk_comm_all_reduce(&sub, NULL, in[me], x, 5, DSK_F32, DSK_COMM_SUM));
        DSK_TEST_SAME_BYTES(x, want, sizeof x, "sub-group all_reduce");
        free_all(n, in);
    }
    /* a split where the last rank joins nothing */
    DSK_TEST_OK(dsk_comm_split(c, me == n - 1 ? DSK_COMM_NO_COLOR : 0, 0, &solo));
    if (me == n - 1)
        DSK_TEST_EXPECT(solo.world_size == 0 && solo.impl == NULL, "NO_COLOR gave a group of %d", solo.world_size);
    else {
        int64_t one = 1, sum = 0;
        DSK_TEST_OK(dsk_comm_all_reduce(&solo, NULL, &one, &sum, 1, DSK_I64, DSK_COMM_SUM));
        DSK_TEST_EXPECT(sum == n - 1, "group without the last rank sums to %lld, want %d", (long long)sum, n - 1);
    }
    /* split of a split, and the parent still works in between */
    DSK_TEST_OK(dsk_comm_split(&sub, 0, sub.rank, &nested));
    {
        int32_t v = me + 1, s = 0, w = 0;
        DSK_TEST_OK(dsk_comm_all_reduce(&nested, NULL, &v, &s, 1, DSK_I32, DSK_COMM_MAX));
        for (int r = 0; r < n; r++)
            if (r % 2 == color && r + 1 > w) w = r + 1;
        DSK_TEST_EXPECT(s == w, "nested max %d, want %d", s, w);
        DSK_TEST_OK(dsk_comm_all_reduce(c, NULL, &v, &s, 1, DSK_I32, DSK_COMM_SUM));
        DSK_TEST_EXPECT(s == n * (n + 1) / 2, "parent sum %d after splits", s);
    }
    DSK_TEST_OK(dsk_comm_store_barrier(&sub));
    dsk_comm_free(&nested);
    dsk_comm_free(&solo);
    dsk_comm_free(&sub);
}

/* Tensor forms: in-place all-reduce, reduce-scatter / all-gather round trip, broadcast, all-to-all. */
static void rank_tensors(dsk_comm *c, void *arg) {
    int n = c->world_size, me = c->rank;
    int64_t shape[2] = {n * 3, 5}, blk[2] = {3, 5};
    dsk_tensor t, part, full, a2a;
    void **in = gen_all(n, DSK_BF16, n * 15, 9000);
    char want[512];
    (void)arg;
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &t, DSK_BF16, 2, shape));
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &part, DSK_BF16, 2, blk));
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &full, DSK_BF16, 2, shape));
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &a2a, DSK_BF16, 2, shape));
    memcpy(t.data, in[me], (size_t)n * 30);
    ref_reduce(DSK_BF16, DSK_COMM_AVG, n, in, 0, n * 15, want);
    DSK_TEST_OK(dsk_comm_all_reduce_tensor(c, NULL, &t, DSK_COMM_AVG));
    DSK_TEST_SAME_BYTES(t.data, want, (size_t)n * 30, "all_reduce_tensor avg");
    memcpy(t.data, in[me], (size_t)n * 30);
    DSK_TEST_OK(dsk_comm_reduce_scatter_tensor(c, NULL, &part, &t, DSK_COMM_SUM));
    ref_reduce(DSK_BF16, DSK_COMM_SUM, n, in, me * 15, 15, want);
    DSK_TEST_SAME_BYTES(part.data, want, 30, "reduce_scatter_tensor");
    DSK_TEST_OK(dsk_comm_all_gather_tensor(c, NULL, &full, &part));
    ref_reduce(DSK_BF16, DSK_COMM_SUM, n, in, 0, n * 15, want);
    DSK_TEST_SAME_BYTES(full.data, want, (size_t)n * 30, "all_gather_tensor after reduce_scatter = all_reduce");
    memcpy(t.data, in[me], (size_t)n * 30);
    DSK_TEST_OK(dsk_comm_broadcast_tensor(c, NULL, &t, n - 1));
    DSK_TEST_SAME_BYTES(t.data, in[n - 1], (size_t)n * 30, "broadcast_tensor");
    memcpy(t.data, in[me], (size_t)n * 30);
    DSK_TEST_OK(dsk_comm_all_to_all_tensor(c, NULL, &a2a, &t));
    for (int p = 0; p < n; p++) memcpy(want + p * 30, (char *)in[p] + me * 30, 30); /* blocks of 15 bf16 */
    DSK_TEST_SAME_BYTES(a2a.data, want, (size_t)n * 30, "all_to_all_tensor");
    /* shape errors name the tensors */
    {
        dsk_tensor one;
        int64_t s1 = 1;
        DSK_TEST_OK(dsk_tensor_alloc(NULL, &one, DSK_BF16, 1, &s1));
        DSK_TEST_STATUS(dsk_comm_all_gather_tensor(c, NULL, &part, &one), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_comm_all_gather_tensor: out [3,5] bf16 does not fit in [1] bf16");
        dsk_tensor_free(NULL, &one);
    }
    dsk_tensor_free(NULL, &t);
    dsk_tensor_free(NULL, &part);
    dsk_tensor_free(NULL, &full);
    dsk_tensor_free(NULL, &a2a);
    free_all(n, in);
}

/* The store: set/get/add, a get that waits for a later set, a get that times out. */
static void rank_store(dsk_comm *c, void *arg) {
    int n = c->world_size, me = c->rank;
    char key[32], val[64];
    size_t len = 0;
    int64_t total = 0;
    (void)arg;
    snprintf(key, sizeof key, "k%d", me);
    snprintf(val, sizeof val, "value of rank %d", me);
    DSK_TEST_OK(dsk_comm_store_set(c, key, val, strlen(val) + 1));
    DSK_TEST_OK(dsk_comm_store_add(c, "counter", me + 1, NULL));
    DSK_TEST_OK(dsk_comm_store_barrier(c));
    for (int r = 0; r < n; r++) {
        char want[64], got[64];
        snprintf(key, sizeof key, "k%d", r);
        snprintf(want, sizeof want, "value of rank %d", r);
        DSK_TEST_OK(dsk_comm_store_get(c, key, got, sizeof got, &len));
        DSK_TEST_EXPECT(len == strlen(want) + 1 && strcmp(got, want) == 0, "store %s = \"%s\" (len %zu)", key, got,
                        len);
    }
    DSK_TEST_OK(dsk_comm_store_add(c, "counter", 0, &total));
    DSK_TEST_EXPECT(total == n * (n + 1) / 2, "counter %lld want %d", (long long)total, n * (n + 1) / 2);
    /* the last rank sets "late" after 0.3 s; the others' get waits for it */
    if (me == n - 1) {
        struct timespec ts = {0, 300000000};
        nanosleep(&ts, NULL);
        DSK_TEST_OK(dsk_comm_store_set(c, "late", "x", 1));
    } else {
        double t0 = dsk_test_now();
        DSK_TEST_OK(dsk_comm_store_get(c, "late", val, sizeof val, &len));
        DSK_TEST_EXPECT(len == 1 && val[0] == 'x' && dsk_test_now() - t0 > 0.2, "late get returned after %.2f s",
                        dsk_test_now() - t0);
    }
    DSK_TEST_OK(dsk_comm_store_barrier(c));
}

static void case_store_timeout(void) {
    dsk_comm c;
    dsk_comm_opts o;
    int port = 0;
    double t0;
    char buf[8];
    memset(&o, 0, sizeof o);
    o.backend = DSK_COMM_HOST;
    o.timeout_s = 0.5;
    o.master_addr = "127.0.0.1";
    DSK_TEST_OK(dsk_comm_free_port("127.0.0.1", &port));
    o.master_port = port;
    DSK_TEST_OK(dsk_comm_init(&c, 0, 1, &o));
    t0 = dsk_test_now();
    DSK_TEST_STATUS(dsk_comm_store_get(&c, "never-set", buf, sizeof buf, NULL), DSK_ERR_TIMEOUT);
    DSK_TEST_ERROR_MENTIONS("key \"never-set\"");
    DSK_TEST_EXPECT(dsk_test_now() - t0 < 2.0, "store get timed out after %.2f s for a 0.5 s timeout",
                    dsk_test_now() - t0);
    dsk_comm_free(&c);
}

/* dsk_comm_free_port: ports a store can listen on, and not one port for every call (random
   below the kernel's ephemeral range: concurrent tests choosing alike would collide). */
static void case_free_port(void) {
    int ports[16], distinct = 0;
    for (int i = 0; i < 16; i++) {
        dsk_comm c;
        dsk_comm_opts o;
        memset(&o, 0, sizeof o);
        o.backend = DSK_COMM_HOST;
        o.master_addr = "127.0.0.1";
        ports[i] = 0;
        DSK_TEST_OK(dsk_comm_free_port("127.0.0.1", &ports[i]));
        DSK_TEST_EXPECT(ports[i] >= 1024 && ports[i] < 65536, "port %d", ports[i]);
        o.master_port = ports[i];
        DSK_TEST_OK(dsk_comm_init(&c, 0, 1, &o));
        dsk_comm_free(&c);
        distinct += i == 0 || ports[i] != ports[i - 1];
    }
    DSK_TEST_EXPECT(distinct >= 12, "%d distinct ports in 16 calls", distinct);
    DSK_TEST_OK(dsk_comm_free_port(NULL, &ports[0]));
    DSK_TEST_STATUS(dsk_comm_free_port("127.0.0.1", NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("port is NULL");
}

/* The emulated link (opts.link_gbps 0.05, link_latency_us 2000): an all-to-all lasts at least the
   latency plus the bytes this rank sent over 50 MB/s, and delivers the data intact; a begun one reports the other
   ranks' blocks landed no sooner than the latency plus the bytes received over 50 MB/s; a split inherits the
   link (its all-reduce lasts the latency at least); the link is the rank's: two begun sends, and calls on the
   parent and the split from two threads at once, take their bytes one after another. Bad values fail init naming
   the field or variable. */
enum { LINK_N = 1 << 18 }; /* floats a rank sends in all */

typedef struct link_call {
    dsk_comm *c;
    const float *x;
    float *y;
    int64_t n;
    dsk_status st;
} link_call;

static void *link_all_reduce(void *arg) {
    link_call *a = (link_call *)arg;
    a->st = dsk_comm_all_reduce(a->c, NULL, a->x, a->y, a->n, DSK_F32, DSK_COMM_SUM);
    return NULL;
}

static void rank_link(dsk_comm *c, void *arg) {
    int n = c->world_size, me = c->rank;
    float *x = (float *)malloc(sizeof(float) * LINK_N), *y = (float *)malloc(sizeof(float) * LINK_N);
    int64_t cnt[8];
    double t0, dt, want;
    uint64_t b0;
    dsk_comm sub;
    (void)arg;
    for (int i = 0; i < LINK_N; i++) x[i] = (float)(me * LINK_N + i);
    for (int p = 0; p < n; p++) cnt[p] = LINK_N / n;
    b0 = c->stats.bytes_sent;
    t0 = dsk_test_now();
    DSK_TEST_OK(dsk_comm_all_to_all(c, NULL, x, y, LINK_N / n, DSK_F32));
    dt = dsk_test_now() - t0;
    want = 2e-3 + (double)(c->stats.bytes_sent - b0) / 5e7;
    DSK_TEST_EXPECT(c->stats.bytes_sent - b0 >= (uint64_t)(sizeof(float) * LINK_N / n * (n - 1)),
                    "rank %d sent %llu bytes", me, (unsigned long long)(c->stats.bytes_sent - b0));
    DSK_TEST_EXPECT(dt >= want - 1e-4 && dt < want + 2.0, "rank %d: the all-to-all took %.4f s, the link %.4f s", me,
                    dt, want);
    for (int r = 0, bad = 0; r < n && !bad; r++)
        for (int i = 0; i < LINK_N / n && !bad; i++)
            if (y[r * (LINK_N / n) + i] != (float)(r * LINK_N + me * (LINK_N / n) + i)) {
                DSK_TEST_EXPECT(0, "rank %d: element %d from rank %d is %g", me, i, r, (double)y[r * (LINK_N / n) + i]);
                bad = 1;
            }
    /* begun: the others' blocks are reported landed once their bytes would have crossed */
    t0 = dsk_test_now();
    DSK_TEST_OK(dsk_comm_all_to_all_v_start(c, NULL, x, cnt, NULL, y, cnt, NULL, DSK_F32, NULL));
    for (int all = 0, landed[8]; !all;) {
        if (dsk_comm_progress(c, NULL, 1, landed, NULL) != DSK_OK) {
            DSK_TEST_EXPECT(0, "rank %d: dsk_comm_progress: %s", me, dsk_last_error());
            break;
        }
        all = 1;
        for (int p = 0; p < n; p++) all &= landed[p];
    }
    dt = dsk_test_now() - t0;
    want = 2e-3 + (double)(sizeof(float) * LINK_N / n * (n - 1)) / 5e7;
    DSK_TEST_EXPECT(dt >= want - 1e-4, "rank %d: every block landed after %.4f s, the link %.4f s", me, dt, want);
    DSK_TEST_OK(dsk_comm_finish(c, NULL));
    /* begun point to point: a send ends no sooner than its start, the latency and its bytes at the rate */
    {
        int64_t req;
        int to = (me + 1) % n, from = (me + n - 1) % n;
        t0 = dsk_test_now();
        DSK_TEST_OK(dsk_comm_recv_start(c, NULL, y, LINK_N / n, DSK_F32, from, NULL));
        DSK_TEST_OK(dsk_comm_send_start(c, NULL, x, LINK_N / n, DSK_F32, to, &req));
        DSK_TEST_OK(dsk_comm_wait(c, NULL, req));
        dt = dsk_test_now() - t0;
        want = 2e-3 + (double)(sizeof(float) * (LINK_N / n)) / 5e7;
        DSK_TEST_EXPECT(dt >= want - 1e-4, "rank %d: a begun send ended after %.4f s, the link %.4f s", me, dt, want);
        DSK_TEST_OK(dsk_comm_wait(c, NULL, DSK_COMM_ALL_REQUESTS));
    }
    /* two begun sends: the second's bytes leave after the first's */
    {
        int64_t req[2];
        int to = (me + 1) % n, from = (me + n - 1) % n, k = LINK_N / 2;
        t0 = dsk_test_now();
        for (int i = 0; i < 2; i++) DSK_TEST_OK(dsk_comm_recv_start(c, NULL, y + i * k, k, DSK_F32, from, NULL));
        for (int i = 0; i < 2; i++) DSK_TEST_OK(dsk_comm_send_start(c, NULL, x + i * k, k, DSK_F32, to, &req[i]));
        DSK_TEST_OK(dsk_comm_wait(c, NULL, req[1]));
        dt = dsk_test_now() - t0;
        want = 2e-3 + 2.0 * sizeof(float) * k / 5e7;
        DSK_TEST_EXPECT(dt >= want - 1e-4, "rank %d: the second of two begun sends ended after %.4f s, the link %.4f s",
                        me, dt, want);
        DSK_TEST_OK(dsk_comm_wait(c, NULL, DSK_COMM_ALL_REQUESTS));
    }
    DSK_TEST_OK(dsk_comm_split(c, 0, me, &sub));
    t0 = dsk_test_now();
    DSK_TEST_OK(dsk_comm_all_reduce(&sub, NULL, x, y, 16, DSK_F32, DSK_COMM_SUM));
    DSK_TEST_EXPECT(dsk_test_now() - t0 >= 2e-3 - 1e-4,
                    "rank %d: a split's all-reduce took %.4f s, under the "
                    "link's latency",
                    me, dsk_test_now() - t0);
    /* the parent and the split at once, from two threads: one link, their bytes one after another */
    {
        link_call a = {c, x, y, LINK_N / 2, DSK_ERR_STATE},
                  b = {&sub, x + LINK_N / 2, y + LINK_N / 2, LINK_N / 2, DSK_ERR_STATE};
        uint64_t sent = c->stats.bytes_sent + sub.stats.bytes_sent;
        pthread_t th;
        t0 = dsk_test_now();
        DSK_TEST_EXPECT(pthread_create(&th, NULL, link_all_reduce, &b) == 0, "rank %d: pthread_create", me);
        link_all_reduce(&a);
        pthread_join(th, NULL);
        dt = dsk_test_now() - t0;
        sent = c->stats.bytes_sent + sub.stats.bytes_sent - sent;
        want = 2e-3 + (double)sent / 5e7;
        DSK_TEST_EXPECT(a.st == DSK_OK && b.st == DSK_OK, "rank %d: all-reduces at once: %s", me, dsk_last_error());
        DSK_TEST_EXPECT(sent >= 2 * sizeof(float) * (LINK_N / 2) * (n - 1) / n, "rank %d sent %llu bytes", me,
                        (unsigned long long)sent);
        DSK_TEST_EXPECT(dt >= want - 1e-4,
                        "rank %d: two communicators' all-reduces at once took %.4f s, the link %.4f s", me, dt, want);
    }
    dsk_comm_free(&sub);
    free(x);
    free(y);
}

/* Two emulated hosts of 2 ranks (0, 1 | 2, 3) on a link of 1 MB/s and 2 ms: only bytes between the hosts take
   it. A send to the rank beside this one, and an all-to-all on the node's communicator, end in well under
   what their bytes would take on the link; a send to the other host, and the world's all-to-all, last at least
   the latency and the bytes to the other host at the link's rate; a begun world exchange reports the block from
   beside landed before the blocks from the other host could have crossed. */
enum { LINK_NODE_N = 1 << 14 }; /* floats to each peer */

static void rank_link_nodes(dsk_comm *c, void *arg) {
    int me = c->rank, near = me ^ 1, far = (me + 2) % 4, landed[4] = {0, 0, 0, 0};
    int64_t cnt[4] = {LINK_NODE_N, LINK_NODE_N, LINK_NODE_N, LINK_NODE_N};
    float *x = (float *)malloc(sizeof(float) * 8 * LINK_NODE_N), *y = (float *)malloc(sizeof(float) * 8 * LINK_NODE_N);
    const double rate = 1e6, lat = 2e-3, block = sizeof(float) * LINK_NODE_N;
    double t0, dt, t_near = -1, t_far = -1;
    uint64_t off0;
    dsk_comm *node, *cross;
    int64_t req;
    (void)arg;
    for (int i = 0; i < 8 * LINK_NODE_N; i++) x[i] = (float)(me * 8 * LINK_NODE_N + i);
    /* beside: 4 blocks each way, off the link */
    t0 = dsk_test_now();
    DSK_TEST_OK(dsk_comm_recv_start(c, NULL, y, 4 * LINK_NODE_N, DSK_F32, near, NULL));
    DSK_TEST_OK(dsk_comm_send_start(c, NULL, x, 4 * LINK_NODE_N, DSK_F32, near, &req));
    DSK_TEST_OK(dsk_comm_wait(c, NULL, DSK_COMM_ALL_REQUESTS));
    dt = dsk_test_now() - t0;
    DSK_TEST_EXPECT(dt < (lat + 4 * block / rate) / 2,
                    "rank %d: a send to rank %d beside it took %.4f s (the link: %.4f)", me, near, dt,
                    lat + 4 * block / rate);
    DSK_TEST_EXPECT(y[7] == (float)(near * 8 * LINK_NODE_N + 7), "rank %d: element 7 from rank %d is %g", me, near,
                    (double)y[7]);
    /* to the other host: on it */
    t0 = dsk_test_now();
    DSK_TEST_OK(dsk_comm_recv_start(c, NULL, y, LINK_NODE_N, DSK_F32, far, NULL));
    DSK_TEST_OK(dsk_comm_send_start(c, NULL, x, LINK_NODE_N, DSK_F32, far, &req));
    DSK_TEST_OK(dsk_comm_wait(c, NULL, req));
    dt = dsk_test_now() - t0;
    DSK_TEST_EXPECT(dt >= lat + block / rate - 1e-4,
                    "rank %d: a send to rank %d on the other host took %.4f s, the link %.4f", me, far, dt,
                    lat + block / rate);
    DSK_TEST_OK(dsk_comm_wait(c, NULL, DSK_COMM_ALL_REQUESTS));
    /* the node's communicator: off the link */
    DSK_TEST_OK(dsk_comm_node_comms(c, &node, &cross));
    t0 = dsk_test_now();
    DSK_TEST_OK(dsk_comm_all_to_all(node, NULL, x, y, 4 * LINK_NODE_N, DSK_F32));
    dt = dsk_test_now() - t0;
    DSK_TEST_EXPECT(dt < (lat + 4 * block / rate) / 2, "rank %d: the node's all-to-all took %.4f s (the link: %.4f)",
                    me, dt, lat + 4 * block / rate);
    /* the world's all-to-all: the two blocks to the other host on the link, the one beside off it */
    off0 = c->stats.bytes_sent_off_node;
    t0 = dsk_test_now();
    DSK_TEST_OK(dsk_comm_all_to_all(c, NULL, x, y, LINK_NODE_N, DSK_F32));
    dt = dsk_test_now() - t0;
    DSK_TEST_EXPECT(c->stats.bytes_sent_off_node - off0 >= (uint64_t)(2 * block),
                    "rank %d sent %llu bytes off the node", me,
                    (unsigned long long)(c->stats.bytes_sent_off_node - off0));
    DSK_TEST_EXPECT(dt >= lat + 2 * block / rate - 1e-4, "rank %d: the world's all-to-all took %.4f s, the link %.4f",
                    me, dt, lat + 2 * block / rate);
    /* begun: the block from beside lands first, the other host's once their bytes could have crossed */
    t0 = dsk_test_now();
    DSK_TEST_OK(dsk_comm_all_to_all_v_start(c, NULL, x, cnt, NULL, y, cnt, NULL, DSK_F32, NULL));
    while (t_far < 0) {
        if (dsk_comm_progress(c, NULL, 1, landed, NULL) != DSK_OK) {
            DSK_TEST_EXPECT(0, "rank %d: dsk_comm_progress: %s", me, dsk_last_error());
            break;
        }
        if (landed[near] && t_near < 0) t_near = dsk_test_now() - t0;
        if (landed[far] && landed[far ^ 1]) t_far = dsk_test_now() - t0;
    }
    DSK_TEST_OK(dsk_comm_finish(c, NULL));
    DSK_TEST_EXPECT(t_far >= lat + 2 * block / rate - 1e-4 && t_near < lat + 2 * block / rate,
                    "rank %d: the block from beside landed after %.4f s, the other host's after %.4f s (the link %.4f)",
                    me, t_near, t_far, lat + 2 * block / rate);
    free(x);
    free(y);
}

static void case_link(void) {
    group g;
    dsk_comm c;
    dsk_comm_opts o;
    memset(&o, 0, sizeof o);
    dsk_test_begin("[%s] an emulated link: calls last their bytes over its bandwidth and its latency",
                   k_mode_names[g_mode]);
    group_defaults(&g, 2);
    g.opts.link_gbps = 0.05;
    g.opts.link_latency_us = 2000;
    expect_group_ok(&g, rank_link, NULL);
    if (g_mode == MODE_TWO_HOSTS) { /* 2 + 2 ranks: the link is between the hosts */
        group_defaults(&g, 4);
        g.opts.link_gbps = 0.001;
        g.opts.link_latency_us = 2000;
        expect_group_ok(&g, rank_link_nodes, NULL);
    }
    o.backend = DSK_COMM_HOST;
    o.link_gbps = -1;
    DSK_TEST_STATUS(dsk_comm_init(&c, 0, 1, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("link_gbps -1: want 0 or more");
    o.link_gbps = 0;
    setenv("DSK_LINK_LATENCY_US", "slow", 1);
    DSK_TEST_STATUS(dsk_comm_init(&c, 0, 1, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("DSK_LINK_LATENCY_US=\"slow\": want a number");
    unsetenv("DSK_LINK_LATENCY_US");
    dsk_test_end();
}

/* MAX and MIN propagate NaN, SUM does too; every rank agrees bitwise (checked against rank 0's bytes). */
static void rank_nan(dsk_comm *c, void *arg) {
    int n = c->world_size, me = c->rank;
    float x[64], y[64], first[64];
    (void)arg;
    for (int o = 0; o < 4; o++) {
        gen(x, DSK_F32, 64, 12000 + (uint64_t)o, me);
        if (me == n - 1) x[5] = NAN;  /* NaN on the last rank ... */
        if (me == 0) x[9] = NAN;      /* ... and on the first */
        DSK_TEST_OK(dsk_comm_all_reduce(c, NULL, x, y, 64, DSK_F32, k_ops[o]));
        DSK_TEST_EXPECT(y[5] != y[5] && y[9] != y[9], "%s: NaN did not propagate (%g, %g)", dsk_comm_op_name(k_ops[o]),
                        y[5], y[9]);
        memcpy(first, y, sizeof y);
        DSK_TEST_OK(dsk_comm_broadcast(c, NULL, first, first, 64, DSK_F32, 0));
        DSK_TEST_SAME_BYTES(y, first, sizeof y, "result differs from rank 0's");
    }
}

/* ------------------------------------------------------------------ faults */

static dsk_comm_opts fault_opts(double timeout) {
    dsk_comm_opts o;
    memset(&o, 0, sizeof o);
    o.timeout_s = timeout;
    return o;
}

typedef struct fault_arg { int victim; int sig; int64_t count; } fault_arg;

/* The victim raises sig (SIGKILL or SIGSTOP) before the third all-reduce; the others must
   fail within the timeout naming it, then find the communicator unusable. */
static void rank_victim(dsk_comm *c, void *argp) {
    fault_arg *a = (fault_arg *)argp;
    float *x = (float *)malloc((size_t)a->count * sizeof(float));
    char name[32];
    double t0;
    dsk_status st = DSK_OK;
    gen(x, DSK_F32, a->count, 1, c->rank);
    for (int i = 0; i < 2; i++) DSK_TEST_OK(dsk_comm_all_reduce(c, NULL, x, x, a->count, DSK_F32, DSK_COMM_SUM));
    if (c->rank == a->victim) raise(a->sig);
    t0 = dsk_test_now();
    for (int i = 0; i < 3 && st == DSK_OK; i++)
        st = dsk_comm_all_reduce(c, NULL, x, x, a->count, DSK_F32, DSK_COMM_SUM);
    printf("     rank %d: %s after %.2f s: %s\n", c->rank, dsk_status_str(st), dsk_test_now() - t0, dsk_last_error());
    snprintf(name, sizeof name, "rank %d", a->victim);
    DSK_TEST_EXPECT(st == DSK_ERR_PEER || st == DSK_ERR_TIMEOUT, "rank %d got %s", c->rank, dsk_status_str(st));
    DSK_TEST_ERROR_MENTIONS(name);
    DSK_TEST_ERROR_MENTIONS("dsk_comm_all_reduce");
    /* the 1 s timeout bounds the wait, not the 300 s default; the slack is a loaded machine's (CI's 2 cores run
       builds beside the suite: 1 s of slack failed there once) */
    DSK_TEST_EXPECT(dsk_test_now() - t0 < 1.0 + 2.5, "took %.2f s for a 1 s timeout", dsk_test_now() - t0);
    DSK_TEST_STATUS(dsk_comm_all_reduce(c, NULL, x, x, a->count, DSK_F32, DSK_COMM_SUM), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("unusable after an earlier error");
    free(x);
}

static void case_rank_dies(int sig, int64_t count) {
    group g;
    fault_arg a;
    group_defaults(&g, 3);
    g.opts = fault_opts(1.0);
    a.victim = 2;
    a.sig = sig;
    a.count = count;
    if (sig == SIGSTOP) g.reap = a.victim + 1; /* the parent kills the stopped victim once the others are done */
    run_group(&g, rank_victim, &a);
    DSK_TEST_EXPECT(g.status[0] == 0 && g.status[1] == 0, "surviving ranks exited %d %d", g.status[0], g.status[1]);
    DSK_TEST_EXPECT(g.status[2] == 128 + SIGKILL, "victim exited %d", g.status[2]);
}

/* A rank dies during a collective of a sub-communicator (the even ranks {0, 2} of 3): the
   survivor names it by its rank there and by its world rank, which is what a launcher's log and
   the other groups' messages say. */
static void rank_sub_victim(dsk_comm *c, void *argp) {
    dsk_comm even;
    float x[64];
    dsk_status st = DSK_OK;
    (void)argp;
    gen(x, DSK_F32, 64, 31, c->rank);
    DSK_TEST_OK(dsk_comm_split(c, c->rank % 2 ? DSK_COMM_NO_COLOR : 0, c->rank, &even));
    if (c->rank == 1) return;
    DSK_TEST_OK(dsk_comm_all_reduce(&even, NULL, x, x, 64, DSK_F32, DSK_COMM_SUM));
    if (c->rank == 2) raise(SIGKILL);
    for (int i = 0; i < 3 && st == DSK_OK; i++) st = dsk_comm_all_reduce(&even, NULL, x, x, 64, DSK_F32, DSK_COMM_SUM);
    DSK_TEST_EXPECT(st == DSK_ERR_PEER || st == DSK_ERR_TIMEOUT, "rank 0 got %s", dsk_status_str(st));
    DSK_TEST_ERROR_MENTIONS("rank 1 (world rank 2)");
    dsk_comm_free(&even);
}

static void case_sub_rank_dies(void) {
    group g;
    group_defaults(&g, 3);
    g.opts = fault_opts(1.0);
    run_group(&g, rank_sub_victim, NULL);
    DSK_TEST_EXPECT(g.status[0] == 0 && g.status[1] == 0, "surviving ranks exited %d %d", g.status[0], g.status[1]);
    DSK_TEST_EXPECT(g.status[2] == 128 + SIGKILL, "victim exited %d", g.status[2]);
}

/* dsk_comm_abort, a program's error exit: rank 0 fails on its own (no call failed) and aborts
   through a sub-group {0, 1}; the world breaks with it, so rank 1 (blocked in the sub-group)
   and rank 2 (blocked on rank 0 in the world) both report rank 0's own error, looked up in the
   store rank 0 serves after it returned from the abort: they start their calls 0.3 s late,
   and rank 0 exits (_exit, no dsk_comm_free) as soon as dsk_comm_abort returns. */
static void rank_aborts(dsk_comm *c, void *arg) {
    dsk_comm pair, none;
    float x[16];
    char why[96];
    dsk_status st;
    int failed_before = dsk_test_g.checks_failed_total;
    snprintf(why, sizeof why, "rank 0 gave up on its own (token %llu)", (unsigned long long)(g_seed % 100000));
    (void)arg;
    gen(x, DSK_F32, 16, 41, c->rank);
    DSK_TEST_OK(dsk_comm_split(c, c->rank < 2 ? 0 : DSK_COMM_NO_COLOR, c->rank, &pair));
    DSK_TEST_OK(dsk_comm_barrier(c, NULL));
    if (c->rank == 0) {
        memset(&none, 0, sizeof none);
        dsk_comm_abort(NULL, why); /* no communicator: nothing to do */
        dsk_comm_abort(&none, why);
        dsk_set_error(DSK_ERR_IO, "%s", why);
        dsk_comm_abort(&pair, NULL);
        DSK_TEST_STATUS(dsk_comm_all_reduce(c, NULL, x, x, 16, DSK_F32, DSK_COMM_SUM), DSK_ERR_STATE);
        DSK_TEST_ERROR_MENTIONS(why);
        fflush(stdout); /* exits as a program's error exit does: dsk_comm_free would keep the store up itself */
        _exit(dsk_test_g.checks_failed_total > failed_before ? 1 : 0);
    }
    nanosleep(&(struct timespec){0, 300000000}, NULL);
    st = c->rank == 1 ? dsk_comm_all_reduce(&pair, NULL, x, x, 16, DSK_F32, DSK_COMM_SUM)
                      : dsk_comm_recv(c, NULL, x, 16, DSK_F32, 0);
    printf("     rank %d: %s: %s\n", c->rank, dsk_status_str(st), dsk_last_error());
    DSK_TEST_STATUS(st, DSK_ERR_PEER);
    DSK_TEST_ERROR_MENTIONS("after its own error: ");
    DSK_TEST_ERROR_MENTIONS(why);
    if (c->rank == 1) dsk_comm_free(&pair);
}

/* Rank 0 hosts the store that relays root causes (issue 10 item 11): when it dies, every
   survivor must name it, not another survivor that failed after it. chain: ranks 1..3 each
   receive from the previous rank, so ranks 2 and 3 see a survivor hang up, never rank 0;
   otherwise a 4 MB all_reduce. */
static void rank_zero_dies(dsk_comm *c, void *argp) {
    int chain = *(const int *)argp;
    int64_t n = chain ? 1 : 1 << 20;
    float *x = (float *)malloc((size_t)n * sizeof(float));
    dsk_status st;
    double t0;
    gen(x, DSK_F32, n, 21, c->rank);
    DSK_TEST_OK(dsk_comm_barrier(c, NULL));
    if (c->rank == 0) raise(SIGKILL);
    t0 = dsk_test_now();
    st = chain ? dsk_comm_recv(c, NULL, x, 1, DSK_F32, c->rank - 1)
               : dsk_comm_all_reduce(c, NULL, x, x, n, DSK_F32, DSK_COMM_SUM);
    printf("     rank %d: %s after %.2f s: %s\n", c->rank, dsk_status_str(st), dsk_test_now() - t0, dsk_last_error());
    DSK_TEST_STATUS(st, DSK_ERR_PEER);
    DSK_TEST_ERROR_MENTIONS("rank 0, which serves the key-value store at 127.0.0.1:");
    DSK_TEST_ERROR_MENTIONS("is gone (exited or crashed)");
    DSK_TEST_EXPECT(dsk_test_now() - t0 < 1.5, "rank %d took %.2f s to fail", c->rank, dsk_test_now() - t0);
    free(x);
}

static void case_zero_dies(int chain) {
    group g;
    group_defaults(&g, 4);
    g.opts = fault_opts(3.0);
    run_group(&g, rank_zero_dies, &chain);
    DSK_TEST_EXPECT(g.status[0] == 128 + SIGKILL, "rank 0 exited %d", g.status[0]);
    for (int r = 1; r < 4; r++) DSK_TEST_EXPECT(g.status[r] == 0, "surviving rank %d exited %d", r, g.status[r]);
}

/* Rank 0 is stopped (issue 10 item 12): the survivors time out in the timeout, not a second
   later, and the time in the message is the time the call took. */
static void rank_zero_stops(dsk_comm *c, void *arg) {
    float x[100];
    dsk_status st;
    double t0, took, said = -1;
    const char *at;
    (void)arg;
    gen(x, DSK_F32, 100, 22, c->rank);
    for (int i = 0; i < 2; i++) DSK_TEST_OK(dsk_comm_all_reduce(c, NULL, x, x, 100, DSK_F32, DSK_COMM_SUM));
    if (c->rank == 0) raise(SIGSTOP);
    t0 = dsk_test_now();
    st = dsk_comm_all_reduce(c, NULL, x, x, 100, DSK_F32, DSK_COMM_SUM);
    took = dsk_test_now() - t0;
    printf("     rank %d: %s after %.2f s: %s\n", c->rank, dsk_status_str(st), took, dsk_last_error());
    DSK_TEST_STATUS(st, DSK_ERR_TIMEOUT);
    DSK_TEST_ERROR_MENTIONS("waiting for rank 0");
    at = strstr(dsk_last_error(), "timed out after ");
    if (at) said = atof(at + strlen("timed out after "));
    DSK_TEST_EXPECT(took < 1.0 + 0.4, "rank %d failed after %.2f s for a 1 s timeout", c->rank, took);
    DSK_TEST_EXPECT(said >= 0 && fabs(took - said) < 0.25, "rank %d: the message says %.2f s, the call took %.2f s",
                    c->rank, said, took);
}

typedef struct mismatch_arg { int kind; } mismatch_arg;

/* Rank 1 makes a different call than the others; everyone must get an error, and the
   ranks that see rank 1's header name both calls. */
static void rank_mismatch(dsk_comm *c, void *argp) {
    mismatch_arg *a = (mismatch_arg *)argp;
    float x[200], y[600];
    int32_t xi[100];
    dsk_status st;
    double t0 = dsk_test_now();
    int odd = c->rank == 1;
    gen(x, DSK_F32, 200, 3, c->rank);
    gen(xi, DSK_I32, 100, 3, c->rank);
    DSK_TEST_OK(dsk_comm_all_reduce(c, NULL, x, y, 100, DSK_F32, DSK_COMM_SUM));
    if (a->kind == 0) st = dsk_comm_all_reduce(c, NULL, x, y, odd ? 101 : 100, DSK_F32, DSK_COMM_SUM);
    else if (a->kind == 1) st = odd ? dsk_comm_all_reduce(c, NULL, xi, y, 100, DSK_I32, DSK_COMM_SUM)
                                    : dsk_comm_all_reduce(c, NULL, x, y, 100, DSK_F32, DSK_COMM_SUM);
    else if (a->kind == 2) st = odd ? dsk_comm_all_gather(c, NULL, x, y, 100, DSK_F32)
                                    : dsk_comm_all_reduce(c, NULL, x, y, 100, DSK_F32, DSK_COMM_SUM);
    else if (a->kind == 3) {
        int64_t sc[4] = {1, 1, 1, 1}, rc[4] = {1, 1, 1, 1};
        if (c->rank == 0) rc[1] = 2; /* rank 0 expects 2 elements from rank 1, which sends 1 */
        st = dsk_comm_all_to_all_v(c, NULL, x, sc, NULL, y, rc, NULL, DSK_F32);
    } else {
        /* rank 0 takes itself for the root, the others rank 1. 150 elements take the large-
           message path (small_bytes 512): broadcast's scatter + all-gather, reduce's
           reduce-scatter */
        int64_t count = a->kind == 5 || a->kind == 7 ? 150 : 100;
        int root = c->rank == 0 ? 0 : 1;
        if (a->kind <= 5) st = dsk_comm_broadcast(c, NULL, x, y, count, DSK_F32, root);
        else if (a->kind <= 7) st = dsk_comm_reduce(c, NULL, x, y, count, DSK_F32, DSK_COMM_SUM, root);
        else if (a->kind == 8) st = dsk_comm_gather(c, NULL, x, y, count, DSK_F32, root);
        else st = dsk_comm_scatter(c, NULL, y, x, count, DSK_F32, root);
    }
    printf("     rank %d: %s after %.2f s: %s\n", c->rank, dsk_status_str(st), dsk_test_now() - t0,
           st ? dsk_last_error() : "");
    DSK_TEST_EXPECT(st == DSK_ERR_PEER || st == DSK_ERR_TIMEOUT, "rank %d got %s", c->rank, dsk_status_str(st));
    if (a->kind == 0 && st == DSK_ERR_PEER) {
        DSK_TEST_ERROR_MENTIONS("mismatched calls");
        DSK_TEST_ERROR_MENTIONS("count 100");
        DSK_TEST_ERROR_MENTIONS("count 101");
    }
    /* a rank that saw rank 1's header names both calls; one that saw a peer hang up relays its error */
    if (a->kind == 1) {
        DSK_TEST_ERROR_MENTIONS("mismatched calls");
        DSK_TEST_ERROR_MENTIONS("all_reduce(count 100, i32, sum)");
        DSK_TEST_ERROR_MENTIONS("all_reduce(count 100, f32, sum)");
    }
    if (a->kind == 2) {
        DSK_TEST_ERROR_MENTIONS("mismatched calls");
        DSK_TEST_ERROR_MENTIONS("all_gather(count 100, f32)");
        DSK_TEST_ERROR_MENTIONS("all_reduce(count 100, f32, sum)");
    }
    /* all_to_all_v: the receiver and the sender both fail with the same sentence */
    if (a->kind == 3)
        DSK_TEST_ERROR_MENTIONS("all_to_all_v counts disagree: rank 1 sends rank 0 1 elements but rank 0 expects 2");
    if (a->kind >= 4) {
        static const char *fns[] = {"dsk_comm_broadcast: ", "dsk_comm_broadcast: ", "dsk_comm_reduce: ",
                                    "dsk_comm_reduce: ", "dsk_comm_gather: ", "dsk_comm_scatter: "};
        DSK_TEST_ERROR_MENTIONS(fns[a->kind - 4]);
        DSK_TEST_ERROR_MENTIONS("mismatched calls");
        DSK_TEST_ERROR_MENTIONS(", root 0)");
        DSK_TEST_ERROR_MENTIONS(", root 1)");
    }
    DSK_TEST_EXPECT(dsk_test_now() - t0 < 3.5, "mismatch took %.2f s", dsk_test_now() - t0);
}

static void case_mismatch(int n, int kind) {
    group g;
    mismatch_arg a;
    group_defaults(&g, n);
    g.opts = fault_opts(2.0);
    g.opts.small_bytes = 512; /* 150 f32 take the large-message path */
    a.kind = kind;
    expect_group_ok(&g, rank_mismatch, &a);
}

/* A rank that leaves early: a big send into its closed socket must give DSK_ERR_PEER, not SIGPIPE. */
static void rank_leaves(dsk_comm *c, void *arg) {
    int64_t n = 4 << 20;
    float *x;
    dsk_status st;
    (void)arg;
    if (c->rank == 1) {
        dsk_comm_free(c);
        return;
    }
    x = (float *)malloc((size_t)n * sizeof(float));
    gen(x, DSK_F32, n, 4, 0);
    st = dsk_comm_all_reduce(c, NULL, x, x, n, DSK_F32, DSK_COMM_SUM);
    DSK_TEST_EXPECT(st == DSK_ERR_PEER, "got %s: %s", dsk_status_str(st), dsk_last_error());
    DSK_TEST_ERROR_MENTIONS("rank 1");
    free(x);
}

/* Ranks that init with these world sizes and must fail with these errors within the timeout. */
typedef struct init_expect {
    group g;
    int n;                     /* processes [2] */
    int world[8];
    size_t small[8], piece[8]; /* per-rank small_bytes and piece_bytes [default] */
    dsk_status want[8];
    const char *needle[8];
} init_expect;

static void rank_init_expect(dsk_comm *unused, void *argp) {
    const init_expect *e = (const init_expect *)argp;
    dsk_comm c;
    dsk_comm_opts o = e->g.opts;
    double t0 = dsk_test_now();
    dsk_status st;
    (void)unused;
    o.small_bytes = e->small[g_rank];
    o.piece_bytes = e->piece[g_rank];
    st = dsk_comm_init(&c, g_rank, e->world[g_rank], &o);
    printf("     rank %d: %s after %.2f s: %s\n", g_rank, dsk_status_str(st), dsk_test_now() - t0,
           st ? dsk_last_error() : "");
    DSK_TEST_EXPECT(st == e->want[g_rank], "rank %d: init returned %s, want %s", g_rank, dsk_status_str(st),
                    dsk_status_str(e->want[g_rank]));
    if (st == DSK_OK) {
        /* a world that came up anyway must compute correctly (a mismatch would show here) */
        float x[1000], y[1000];
        gen(x, DSK_F32, 1000, 31, c.rank);
        DSK_TEST_OK(dsk_comm_all_reduce(&c, NULL, x, y, 1000, DSK_F32, DSK_COMM_SUM));
        dsk_comm_free(&c);
        return;
    }
    DSK_TEST_ERROR_MENTIONS(e->needle[g_rank]);
    DSK_TEST_EXPECT(dsk_test_now() - t0 < e->g.opts.timeout_s + 1.5, "init took %.2f s for a %.1f s timeout",
                    dsk_test_now() - t0, e->g.opts.timeout_s);
    DSK_TEST_EXPECT(c.impl == NULL && c.world_size == 0, "failed init left state behind");
}

static void expect_init_failures(init_expect *e) {
    group_defaults(&e->g, e->n ? e->n : 2);
    e->g.no_init = 1;
    e->g.opts = fault_opts(1.0);
    e->g.opts.backend = DSK_COMM_HOST;
    e->g.opts.master_addr = "127.0.0.1";
    DSK_TEST_OK(dsk_comm_free_port("127.0.0.1", &e->g.port));
    e->g.opts.master_port = e->g.port;
    expect_group_ok(&e->g, rank_init_expect, e);
}

/* Two jobs on one port (issue 10 item 7): job A's rank 0 serves the store and a rank 1 of job
   B reaches it before job A's rank 1 does. The intruder must fail naming the other job, and
   job A must run unharmed. The job id comes from opts.job_id, or (env = 1) from Open MPI's
   variables through dsk_comm_init_env. */
typedef struct two_jobs_arg { group g; int env; } two_jobs_arg;
static void clear_env(void);

static void rank_two_jobs(dsk_comm *unused, void *argp) {
    const two_jobs_arg *a = (const two_jobs_arg *)argp;
    dsk_comm_opts o = a->g.opts;
    dsk_comm c;
    dsk_status st;
    int intruder = g_rank == 1, rank = g_rank == 0 ? 0 : 1;
    double t0;
    int64_t v = intruder ? 100 : rank + 1, sum = 0;
    (void)unused;
    if (g_rank == 2) {
        struct timespec ts = {0, 400000000};
        nanosleep(&ts, NULL);
    }
    t0 = dsk_test_now();
    if (a->env) {
        char port[16];
        snprintf(port, sizeof port, "%d", a->g.port);
        clear_env();
        setenv("OMPI_COMM_WORLD_RANK", rank ? "1" : "0", 1);
        setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
        setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
        setenv("MASTER_PORT", port, 1);
        setenv("PMIX_NAMESPACE", intruder ? "job-B" : "job-A", 1);
        unsetenv("DSK_JOB_ID");
        o.master_addr = NULL;
        o.master_port = 0;
        st = dsk_comm_init_env(&c, &o);
    } else {
        o.job_id = intruder ? "job-B" : "job-A";
        st = dsk_comm_init(&c, rank, 2, &o);
    }
    printf("     process %d (rank %d of job %s): init %s after %.2f s: %s\n", g_rank, rank, intruder ? "B" : "A",
           dsk_status_str(st), dsk_test_now() - t0, st ? dsk_last_error() : "");
    if (intruder) {
        DSK_TEST_STATUS(st, DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("belongs to another job");
        DSK_TEST_ERROR_MENTIONS("job-A");
        DSK_TEST_ERROR_MENTIONS("job-B");
    } else {
        DSK_TEST_OK(st);
    }
    if (st != DSK_OK) return;
    /* a merged intruder would add 100 to job A's sum */
    DSK_TEST_OK(dsk_comm_all_reduce(&c, NULL, &v, &sum, 1, DSK_I64, DSK_COMM_SUM));
    if (!intruder) DSK_TEST_EXPECT(sum == 3, "job A's sum is %lld, want 1 + 2 = 3", (long long)sum);
    dsk_comm_free(&c);
}

static void case_two_jobs(int env) {
    two_jobs_arg a;
    group_defaults(&a.g, 3);
    a.env = env;
    a.g.no_init = 1;
    a.g.opts = fault_opts(2.0);
    a.g.opts.backend = DSK_COMM_HOST;
    a.g.opts.master_addr = "127.0.0.1";
    DSK_TEST_OK(dsk_comm_free_port("127.0.0.1", &a.g.port));
    a.g.opts.master_port = a.g.port;
    expect_group_ok(&a.g, rank_two_jobs, &a);
}

static void case_wrong_world(void) {
    init_expect e;
    memset(&e, 0, sizeof e);
    e.world[0] = 2; e.want[0] = DSK_ERR_TIMEOUT; e.needle[0] = "rank 1 of 2 to join";
    e.world[1] = 3; e.want[1] = DSK_ERR_ARG; e.needle[1] = "this rank (1) has WORLD_SIZE 3 but rank 0 has 2";
    expect_init_failures(&e);
}

/* Wire-protocol options that differ between ranks fail init on every rank (issue 10 item 8);
   before, 2 ranks with different small_bytes summed half the elements wrong with DSK_OK. */
static void case_options_differ(void) {
    init_expect e;
    memset(&e, 0, sizeof e);
    for (int r = 0; r < 2; r++) { e.world[r] = 2; e.want[r] = DSK_ERR_ARG; }
    e.small[1] = 1024;
    e.needle[0] = "rank 1 has small_bytes 1024 but this rank (0) has the default";
    e.needle[1] = "rank 0 has small_bytes the default but this rank (1) has 1024";
    expect_init_failures(&e);
    memset(&e, 0, sizeof e);
    e.n = 3;
    for (int r = 0; r < 3; r++) { e.world[r] = 3; e.want[r] = DSK_ERR_ARG; e.needle[r] = "piece_bytes"; }
    e.piece[2] = 4096;
    e.needle[0] = e.needle[1] = "rank 2 has piece_bytes 4096 but this rank";
    expect_init_failures(&e);
}

/* A duplicate RANK (issue 10 item 12): processes 1 and 2 both say rank 1 (process 2 a
   moment later). Process 2 must fail at once with the documented message; the others run.
   Before, it retried until the timeout and reported "no key-value store ... refused". */
typedef struct duplicate_arg { group g; int dup; } duplicate_arg; /* dup: the rank process 2 claims too */

static void rank_duplicate(dsk_comm *unused, void *argp) {
    const duplicate_arg *d = (const duplicate_arg *)argp;
    dsk_comm c;
    dsk_status st;
    double t0;
    int64_t v = g_rank, sum = 0;
    int rank = g_rank == 2 ? d->dup : g_rank;
    (void)unused;
    if (g_rank == 2) {
        struct timespec ts = {0, 200000000};
        nanosleep(&ts, NULL);
    }
    t0 = dsk_test_now();
    st = dsk_comm_init(&c, rank, 2, &d->g.opts);
    printf("     process %d (rank %d): %s after %.2f s: %s\n", g_rank, rank, dsk_status_str(st),
           dsk_test_now() - t0, st ? dsk_last_error() : "");
    if (g_rank == 2) {
        char want[64];
        snprintf(want, sizeof want, "dsk_comm_init: rank %d is claimed by 2 processes: pid ", d->dup);
        DSK_TEST_STATUS(st, DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS(want);
        DSK_TEST_ERROR_MENTIONS(d->dup ? "is RANK 1 set twice?" : "is RANK 0 set twice?");
        DSK_TEST_EXPECT(!strstr(dsk_last_error(), "pick another MASTER_PORT"), "told to pick another port");
        DSK_TEST_EXPECT(dsk_test_now() - t0 < 1.0, "the duplicate failed after %.2f s", dsk_test_now() - t0);
        if (st == DSK_OK) dsk_comm_free(&c);
        return;
    }
    DSK_TEST_OK(st);
    if (st != DSK_OK) return;
    DSK_TEST_OK(dsk_comm_all_reduce(&c, NULL, &v, &sum, 1, DSK_I64, DSK_COMM_SUM));
    DSK_TEST_EXPECT(sum == 1, "sum %lld, want 0 + 1", (long long)sum);
    /* stay up until the duplicate has had its answer */
    {
        struct timespec ts = {0, 400000000};
        nanosleep(&ts, NULL);
    }
    dsk_comm_free(&c);
}

static void duplicate_case(int dup) {
    duplicate_arg d;
    group_defaults(&d.g, 3);
    d.dup = dup;
    d.g.no_init = 1;
    d.g.opts = fault_opts(3.0);
    d.g.opts.backend = DSK_COMM_HOST;
    d.g.opts.master_addr = "127.0.0.1";
    DSK_TEST_OK(dsk_comm_free_port("127.0.0.1", &d.g.port));
    d.g.opts.master_port = d.g.port;
    expect_group_ok(&d.g, rank_duplicate, &d);
}

static void case_duplicate_rank(void) { duplicate_case(1); }

/* Two processes both claiming rank 0 (same MASTER_ADDR:MASTER_PORT): the second finds the
   port taken by the first's store, which holds rank 0's claim. It must say that a second
   process claims rank 0; before, it said "port ... already in use: pick another MASTER_PORT". */
static void case_duplicate_rank0(void) { duplicate_case(0); }

/* The same process starting a second rank 0 on the port its live communicator serves is told
   that (free the first one or use another port), not that another process claims rank 0. */
static void case_rank0_twice_in_process(void) {
    dsk_comm a, b;
    dsk_comm_opts o = fault_opts(2.0);
    o.backend = DSK_COMM_HOST;
    o.master_addr = "127.0.0.1";
    DSK_TEST_OK(dsk_comm_free_port("127.0.0.1", &o.master_port));
    DSK_TEST_OK(dsk_comm_init(&a, 0, 1, &o));
    DSK_TEST_STATUS(dsk_comm_init(&b, 0, 1, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("this process already serves rank 0's key-value store at 127.0.0.1:");
    dsk_comm_free(&a);
    DSK_TEST_OK(dsk_comm_init(&b, 0, 1, &o)); /* freed: the port is free again */
    dsk_comm_free(&b);
}

/* dsk_comm_check_agree (issue: ranks given different --d-model failed later with "all_to_all_v
   counts disagree"): 3 ranks, settings drawn fresh; every rank must get the same verdict, and
   a mismatch must name the setting, both values and both ranks. */
typedef struct agree_arg { unsigned d_model, experts; } agree_arg;

static void agree_expect(dsk_comm *c, const char *config, const char *needle, const char *count) {
    dsk_status st = dsk_comm_check_agree(c, "test options", config);
    if (!needle) { DSK_TEST_OK(st); return; }
    DSK_TEST_STATUS(st, DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_comm_check_agree: test options differ between ranks: ");
    DSK_TEST_ERROR_MENTIONS(needle);
    DSK_TEST_ERROR_MENTIONS(count);
}

static void rank_check_agree(dsk_comm *c, void *argp) {
    const agree_arg *a = (const agree_arg *)argp;
    char cfg[160], needle[200];
    int64_t v = 1, sum = 0;
    unsigned d = a->d_model, other = a->d_model + 16;
    snprintf(cfg, sizeof cfg, "d_model=%u experts=%u dtype=bf16", d, a->experts);
    agree_expect(c, cfg, NULL, NULL);
    /* rank 1 has another d_model (as in the issue) */
    snprintf(cfg, sizeof cfg, "d_model=%u  experts=%u dtype=bf16", c->rank == 1 ? other : d, a->experts);
    snprintf(needle, sizeof needle, "d_model is \"%u\" on rank 0 but \"%u\" on rank 1", d, other);
    agree_expect(c, cfg, needle, "(1 of 3 ranks differ from rank 0)");
    /* ranks 1 and 2 lack a setting: the first of them to report is named */
    snprintf(cfg, sizeof cfg, c->rank ? "d_model=%u dtype=bf16" : "d_model=%u experts=%u dtype=bf16", d, a->experts);
    snprintf(needle, sizeof needle, "experts is \"%u\" on rank 0 but not given on rank ", a->experts);
    agree_expect(c, cfg, needle, "(2 of 3 ranks differ from rank 0)");
    /* rank 2 has one more */
    snprintf(cfg, sizeof cfg, "d_model=%u dtype=bf16%s", d, c->rank == 2 ? " mtp=1" : "");
    agree_expect(c, cfg, "mtp is not given on rank 0 but \"1\" on rank 2", "(1 of 3 ranks differ from rank 0)");
    DSK_TEST_STATUS(dsk_comm_check_agree(c, NULL, NULL), DSK_ERR_ARG);
    DSK_TEST_STATUS(dsk_comm_check_agree(NULL, "x", "a=1"), DSK_ERR_ARG);
    /* a sub-communicator agrees on its own: groups {0, 2} and {1} with different texts */
    {
        dsk_comm sub;
        DSK_TEST_OK(dsk_comm_split(c, c->rank % 2, 0, &sub));
        snprintf(cfg, sizeof cfg, "group=%d", c->rank % 2);
        DSK_TEST_OK(dsk_comm_check_agree(&sub, "group options", cfg));
        dsk_comm_free(&sub);
    }
    /* the communicator is unharmed */
    DSK_TEST_OK(dsk_comm_all_reduce(c, NULL, &v, &sum, 1, DSK_I64, DSK_COMM_SUM));
    DSK_TEST_EXPECT(sum == 3, "sum %lld after the checks", (long long)sum);
}

static void case_check_agree(void) {
    group g;
    agree_arg a;
    a.d_model = 64 + 16 * (unsigned)dsk_test_rand_int(40);
    a.experts = 2 + (unsigned)dsk_test_rand_int(60);
    group_defaults(&g, 3);
    expect_group_ok(&g, rank_check_agree, &a);
}

static void case_missing_rank(void) {
    init_expect e;
    memset(&e, 0, sizeof e);
    for (int r = 0; r < 2; r++) { e.world[r] = 3; e.want[r] = DSK_ERR_TIMEOUT; e.needle[r] = "rank 2 of 3 to join"; }
    expect_init_failures(&e);
}

static void case_port_in_use(void) {
    struct sockaddr_in sa;
    int fd = socket(AF_INET, SOCK_STREAM, 0), port;
    socklen_t sl = sizeof sa;
    dsk_comm c;
    dsk_comm_opts o = fault_opts(1.0);
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    DSK_TEST_EXPECT(bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0 && listen(fd, 4) == 0, "test listener");
    getsockname(fd, (struct sockaddr *)&sa, &sl);
    port = ntohs(sa.sin_port);
    o.master_addr = "127.0.0.1";
    o.master_port = port;
    o.backend = DSK_COMM_HOST;
    DSK_TEST_STATUS(dsk_comm_init(&c, 0, 2, &o), DSK_ERR_IO);
    DSK_TEST_ERROR_MENTIONS("already in use");
    DSK_TEST_ERROR_MENTIONS("dsk_comm_init");
    close(fd);
}

static void case_no_store(void) {
    dsk_comm c;
    dsk_comm_opts o = fault_opts(1.0);
    int port = 0;
    double t0;
    DSK_TEST_OK(dsk_comm_free_port("127.0.0.1", &port));
    o.master_addr = "127.0.0.1";
    o.master_port = port;
    o.backend = DSK_COMM_HOST;
    t0 = dsk_test_now();
    DSK_TEST_STATUS(dsk_comm_init(&c, 1, 2, &o), DSK_ERR_TIMEOUT);
    printf("     no store: failed after %.2f s: %s\n", dsk_test_now() - t0, dsk_last_error());
    DSK_TEST_ERROR_MENTIONS("no key-value store");
    DSK_TEST_ERROR_MENTIONS("rank 1 of 2");
    DSK_TEST_EXPECT(dsk_test_now() - t0 < 2.5, "took %.2f s for a 1 s timeout", dsk_test_now() - t0);
}

static const char *k_env_vars[] = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
    "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "TORCHELASTIC_USE_AGENT_STORE", "DSK_MASTER_PORT", "DSK_JOB_ID",
    "TORCHELASTIC_RUN_ID", "PMIX_NAMESPACE", "OMPI_MCA_orte_hnp_uri", "SLURM_JOB_ID", "SLURM_STEP_ID"};

static void clear_env(void) {
    for (size_t i = 0; i < sizeof k_env_vars / sizeof *k_env_vars; i++) unsetenv(k_env_vars[i]);
}

/* Sets "NAME=value" pairs (NULL-terminated) on a clean launcher environment and expects `want`. */
static void env_expect(dsk_status want, const char *needle, ...) {
    va_list ap;
    const char *kv;
    dsk_comm c;
    dsk_comm_opts o = fault_opts(1.0);
    o.backend = DSK_COMM_HOST;
    clear_env();
    va_start(ap, needle);
    while ((kv = va_arg(ap, const char *)) != NULL) {
        char name[64];
        const char *eq = strchr(kv, '=');
        snprintf(name, sizeof name, "%.*s", (int)(eq - kv), kv);
        setenv(name, eq + 1, 1);
    }
    va_end(ap);
    DSK_TEST_STATUS(dsk_comm_init_env(&c, &o), want);
    if (want != DSK_OK) {
        DSK_TEST_ERROR_MENTIONS("dsk_comm_init"); /* _env, or dsk_comm_init for what it checks */
        DSK_TEST_ERROR_MENTIONS(needle);
    } else {
        int32_t v = 5, s = 0;
        DSK_TEST_EXPECT(c.rank == 0 && c.world_size == 1 && c.local_world_size == 1, "rank %d world %d local %d",
                        c.rank, c.world_size, c.local_world_size);
        DSK_TEST_OK(dsk_comm_all_reduce(&c, NULL, &v, &s, 1, DSK_I32, DSK_COMM_SUM));
        DSK_TEST_EXPECT(s == 5, "world of one all_reduce gave %d", s);
        dsk_comm_free(&c);
    }
    clear_env();
}

static void case_env(void) {
    char port[32], pp[48];
    int p = 0;
    DSK_TEST_OK(dsk_comm_free_port("127.0.0.1", &p));
    snprintf(port, sizeof port, "%d", p);
    snprintf(pp, sizeof pp, "MASTER_PORT=%d", p);
    env_expect(DSK_ERR_ARG, "no launcher environment", (const char *)NULL);
    env_expect(DSK_ERR_ARG, "RANK=\"abc\" is not a non-negative integer", "RANK=abc", "WORLD_SIZE=2",
               (const char *)NULL);
    env_expect(DSK_ERR_ARG, "RANK=3 is not below WORLD_SIZE=2", "RANK=3", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1",
               (const char *)NULL);
    env_expect(DSK_ERR_ARG, "RANK is set but WORLD_SIZE is not", "RANK=0", (const char *)NULL);
    env_expect(DSK_ERR_ARG, "WORLD_SIZE=\"-2\"", "RANK=0", "WORLD_SIZE=-2", (const char *)NULL);
    env_expect(DSK_ERR_ARG, "MASTER_ADDR is not set", "RANK=1", "WORLD_SIZE=2", (const char *)NULL);
    env_expect(DSK_ERR_ARG, "MASTER_PORT=\"70000\"", "RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1",
               "MASTER_PORT=70000", (const char *)NULL);
    env_expect(DSK_ERR_ARG, "MASTER_PORT=\"12ab\"", "RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1",
               "MASTER_PORT=12ab", (const char *)NULL);
    env_expect(DSK_ERR_ARG, "LOCAL_RANK=4 is not below LOCAL_WORLD_SIZE=2", "RANK=0", "WORLD_SIZE=1", "LOCAL_RANK=4",
               "LOCAL_WORLD_SIZE=2", (const char *)NULL);
    env_expect(DSK_ERR_ARG, "cannot resolve address \"no.such.host.invalid\"", "RANK=0", "WORLD_SIZE=1",
               "MASTER_ADDR=no.such.host.invalid", pp, (const char *)NULL);
    env_expect(DSK_ERR_ARG, "OMPI_COMM_WORLD_RANK=2 is not below OMPI_COMM_WORLD_SIZE=2", "OMPI_COMM_WORLD_RANK=2",
               "OMPI_COMM_WORLD_SIZE=2", (const char *)NULL);
    /* worlds of one start from each launcher's variables */
    env_expect(DSK_OK, "", "RANK=0", "WORLD_SIZE=1", "MASTER_ADDR=127.0.0.1", pp, (const char *)NULL);
    env_expect(DSK_OK, "", "OMPI_COMM_WORLD_RANK=0", "OMPI_COMM_WORLD_SIZE=1", "OMPI_COMM_WORLD_LOCAL_RANK=0", pp,
               (const char *)NULL);
    env_expect(DSK_OK, "", "SLURM_PROCID=0", "SLURM_NTASKS=1", "SLURM_LOCALID=0", "SLURM_NTASKS_PER_NODE=1(x1)", pp,
               (const char *)NULL);
    env_expect(DSK_ERR_ARG, "DSK_MASTER_PORT=\"x\"", "RANK=0", "WORLD_SIZE=1", "DSK_MASTER_PORT=x", (const char *)NULL);
    /* torchrun: its agent's store holds MASTER_PORT, so dsk's store moves to the next port */
    {
        struct sockaddr_in sa;
        int agent = -1, ok = 0;
        char mp[48];
        for (int tries = 0; tries < 20 && !ok; tries++) { /* an agent port whose successor is free */
            int next = socket(AF_INET, SOCK_STREAM, 0);
            socklen_t sl = sizeof sa;
            if (agent >= 0) close(agent);
            agent = socket(AF_INET, SOCK_STREAM, 0);
            memset(&sa, 0, sizeof sa);
            sa.sin_family = AF_INET;
            sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            if (bind(agent, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(agent, 4) != 0) { close(next); continue; }
            getsockname(agent, (struct sockaddr *)&sa, &sl);
            snprintf(mp, sizeof mp, "MASTER_PORT=%d", (int)ntohs(sa.sin_port));
            sa.sin_port = htons((uint16_t)(ntohs(sa.sin_port) + 1));
            ok = bind(next, (struct sockaddr *)&sa, sizeof sa) == 0;
            close(next);
        }
        DSK_TEST_EXPECT(ok, "no port pair for the torchrun agent case");
        if (ok) {
            env_expect(DSK_ERR_IO, "already in use (EADDRINUSE): pick another MASTER_PORT", "RANK=0", "WORLD_SIZE=1",
                       "MASTER_ADDR=127.0.0.1", mp, (const char *)NULL);
            env_expect(DSK_OK, "", "RANK=0", "WORLD_SIZE=1", "MASTER_ADDR=127.0.0.1", mp,
                       "TORCHELASTIC_USE_AGENT_STORE=True", (const char *)NULL);
        }
        close(agent);
    }
    /* a busy store port names where it came from (issue 10 item 12): under torchrun MASTER_PORT+1 */
    {
        struct sockaddr_in sa;
        socklen_t sl = sizeof sa;
        int busy = socket(AF_INET, SOCK_STREAM, 0);
        char mp[48], dp[48], want[160];
        memset(&sa, 0, sizeof sa);
        sa.sin_family = AF_INET;
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        DSK_TEST_EXPECT(bind(busy, (struct sockaddr *)&sa, sizeof sa) == 0 && listen(busy, 4) == 0, "busy listener");
        getsockname(busy, (struct sockaddr *)&sa, &sl);
        snprintf(mp, sizeof mp, "MASTER_PORT=%d", (int)ntohs(sa.sin_port) - 1);
        snprintf(dp, sizeof dp, "DSK_MASTER_PORT=%d", (int)ntohs(sa.sin_port));
        snprintf(want, sizeof want, "under torchrun dsk's store takes MASTER_PORT+1 = %d", (int)ntohs(sa.sin_port));
        env_expect(DSK_ERR_IO, want, "RANK=0", "WORLD_SIZE=1", "MASTER_ADDR=127.0.0.1", mp,
                   "TORCHELASTIC_USE_AGENT_STORE=True", (const char *)NULL);
        env_expect(DSK_ERR_IO, "or set DSK_MASTER_PORT to a free port", "RANK=0", "WORLD_SIZE=1",
                   "MASTER_ADDR=127.0.0.1", mp, "TORCHELASTIC_USE_AGENT_STORE=True", (const char *)NULL);
        env_expect(DSK_ERR_IO, "already in use (EADDRINUSE): pick another DSK_MASTER_PORT", "RANK=0", "WORLD_SIZE=1",
                   "MASTER_ADDR=127.0.0.1", mp, dp, "TORCHELASTIC_USE_AGENT_STORE=True", (const char *)NULL);
        close(busy);
    }
}

/* Argument errors on a world of one: status and message. */
static void case_bad_args(void) {
    dsk_comm c;
    dsk_comm_opts o = fault_opts(2.0);
    int port = 0;
    float x[4] = {1, 2, 3, 4};
    int64_t cnt[1] = {-1}, ok1[1] = {1};
    dsk_tensor t, tt;
    int64_t shape[2] = {2, 2};
    DSK_TEST_OK(dsk_comm_free_port("127.0.0.1", &port));
    o.master_addr = "127.0.0.1";
    o.master_port = port;
    o.backend = DSK_COMM_HOST;
    DSK_TEST_STATUS(dsk_comm_init(&c, 2, 2, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_comm_init: rank 2 is not in [0, world_size 2)");
    {
        char id[130];
        memset(id, 'h', sizeof id - 1);
        id[sizeof id - 1] = 0;
        o.host_id = id;
        DSK_TEST_STATUS(dsk_comm_init(&c, 0, 1, &o), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("host_id of 129 characters exceeds 120");
        o.host_id = NULL;
        o.transport = (dsk_comm_transport)7;
        DSK_TEST_STATUS(dsk_comm_init(&c, 0, 1, &o), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("unknown transport 7");
        o.transport = DSK_COMM_TRANSPORT_AUTO;
    }
    o.backend = DSK_COMM_NCCL;
    DSK_TEST_STATUS(dsk_comm_init(&c, 0, 1, &o), DSK_ERR_UNSUPPORTED);
    DSK_TEST_ERROR_MENTIONS("nccl backend");
    o.backend = DSK_COMM_HOST;
    DSK_TEST_OK(dsk_comm_init(&c, 0, 1, &o));
    DSK_TEST_STATUS(dsk_comm_all_reduce(NULL, NULL, x, x, 4, DSK_F32, DSK_COMM_SUM), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_comm_all_reduce: communicator is NULL");
    DSK_TEST_STATUS(dsk_comm_all_reduce(&c, NULL, x, x, 4, DSK_E4M3, DSK_COMM_SUM), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dtype e4m3 is not supported");
    DSK_TEST_STATUS(dsk_comm_all_reduce(&c, NULL, x, x, -3, DSK_F32, DSK_COMM_SUM), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("count -3 is negative");
    DSK_TEST_STATUS(dsk_comm_all_reduce(&c, NULL, NULL, x, 4, DSK_F32, DSK_COMM_SUM), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("NULL buffer for 4 elements");
    DSK_TEST_STATUS(dsk_comm_all_reduce(&c, NULL, x, x, 4, DSK_F32, (dsk_comm_op)9), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("unknown reduction op 9");
    DSK_TEST_STATUS(dsk_comm_broadcast(&c, NULL, x, x, 4, DSK_F32, 1), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("root 1 is not in [0, world_size 1)");
    DSK_TEST_STATUS(dsk_comm_reduce(&c, NULL, x, x, 4, DSK_F32, DSK_COMM_SUM, -1), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_comm_reduce: root -1 is not in [0, world_size 1)");
    DSK_TEST_STATUS(dsk_comm_reduce(&c, NULL, x, NULL, 4, DSK_F32, DSK_COMM_SUM, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_comm_reduce: NULL buffer for 4 elements");
    DSK_TEST_STATUS(dsk_comm_reduce(&c, NULL, x, x, 4, DSK_F32, (dsk_comm_op)7, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_comm_reduce: unknown reduction op 7");
    DSK_TEST_STATUS(dsk_comm_gather(&c, NULL, x, NULL, 4, DSK_F32, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_comm_gather: NULL buffer for 4 elements");
    DSK_TEST_STATUS(dsk_comm_gather(&c, NULL, x, x, 4, DSK_F32, 2), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_comm_gather: root 2 is not in [0, world_size 1)");
    DSK_TEST_STATUS(dsk_comm_scatter(&c, NULL, NULL, x, 4, DSK_F32, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_comm_scatter: NULL buffer for 4 elements");
    DSK_TEST_STATUS(dsk_comm_scatter(&c, NULL, x, x, -2, DSK_F32, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_comm_scatter: count -2 is negative");
    DSK_TEST_STATUS(dsk_comm_recv(&c, NULL, x, 4, DSK_F32, 5), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("peer 5 is not another rank");
    DSK_TEST_STATUS(dsk_comm_all_to_all_v(&c, NULL, x, cnt, NULL, x + 2, ok1, NULL, DSK_F32), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("negative count or displacement for rank 0");
    cnt[0] = 2;
    DSK_TEST_STATUS(dsk_comm_all_to_all_v(&c, NULL, x, cnt, NULL, x + 2, ok1, NULL, DSK_F32), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("rank 0 sends itself 2 elements but expects 1");
    DSK_TEST_STATUS(dsk_comm_split(&c, -5, 0, &c), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_comm_split");
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &t, DSK_F32, 2, shape));
    DSK_TEST_OK(dsk_tensor_transpose(&t, 0, 1, &tt));
    DSK_TEST_STATUS(dsk_comm_all_reduce_tensor(&c, NULL, &tt, DSK_COMM_SUM), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("tensor t [2,2] f32 is not contiguous");
    tt = t;
    tt.device.type = DSK_DEV_CUDA;
    DSK_TEST_STATUS(dsk_comm_all_reduce_tensor(&c, NULL, &tt, DSK_COMM_SUM), DSK_ERR_UNSUPPORTED);
    DSK_TEST_ERROR_MENTIONS("host backend needs CPU memory");
    dsk_tensor_free(NULL, &t);
    dsk_comm_free(&c);
    dsk_comm_free(&c); /* freed twice is fine */
    DSK_TEST_STATUS(dsk_comm_barrier(&c, NULL), DSK_ERR_ARG);
}

/* Open descriptors and threads of this process. */
static int count_dir(const char *path) {
    DIR *d = opendir(path);
    int n = 0;
    struct dirent *e;
    if (!d) return -1;
    while ((e = readdir(d)) != NULL) n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

/* Mappings of dsk segments in this process. */
static int mapped_segments(void) {
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    int n = 0;
    if (!f) return -1;
    while (fgets(line, sizeof line, f)) n += strstr(line, "/dsk-") != NULL;
    fclose(f);
    return n;
}

static void rank_reinit(dsk_comm *unused, void *argp) {
    const group *g = (const group *)argp;
    int fds0 = count_dir("/proc/self/fd"), thr0 = count_dir("/proc/self/task");
    (void)unused;
    for (int round = 0; round < 3; round++) {
        dsk_comm c, sub;
        float v = (float)g_rank, s = 0;
        DSK_TEST_OK(dsk_comm_init(&c, g_rank, g->n, &g->opts));
        if (!c.impl) return;
        DSK_TEST_EXPECT(c.shm_peers == 1 && mapped_segments() == 1, "round %d: %d shared-memory peers, %d mappings",
                        round, c.shm_peers, mapped_segments());
        DSK_TEST_OK(dsk_comm_all_reduce(&c, NULL, &v, &s, 1, DSK_F32, DSK_COMM_SUM));
        DSK_TEST_EXPECT(s == 1.0f, "round %d sum %g", round, s);
        DSK_TEST_OK(dsk_comm_split(&c, 0, 0, &sub));
        DSK_TEST_OK(dsk_comm_all_reduce(&sub, NULL, &v, &s, 1, DSK_F32, DSK_COMM_SUM));
        dsk_comm_free(&sub);
        dsk_comm_free(&c);
    }
    DSK_TEST_EXPECT(count_dir("/proc/self/fd") == fds0, "rank %d: %d descriptors before, %d after 3 init/free rounds",
                    g_rank, fds0, count_dir("/proc/self/fd"));
    DSK_TEST_EXPECT(count_dir("/proc/self/task") == thr0, "rank %d: %d threads before, %d after", g_rank, thr0,
                    count_dir("/proc/self/task"));
    DSK_TEST_EXPECT(mapped_segments() == 0, "rank %d: %d shared-memory mappings left after 3 init/free rounds",
                    g_rank, mapped_segments());
}

static void case_reinit(void) {
    group g;
    group_defaults(&g, 2);
    g.no_init = 1;
    g.opts = fault_opts(10.0);
    g.opts.backend = DSK_COMM_HOST;
    g.opts.master_addr = "127.0.0.1";
    /* every round binds the same port again: the store's SO_REUSEADDR makes that work */
    if (dsk_comm_free_port("127.0.0.1", &g.port) != DSK_OK) return;
    g.opts.master_port = g.port;
    expect_group_ok(&g, rank_reinit, &g);
}

/* ------------------------------------------------------------------ launcher */

/* A rank started by a launcher: contributes DSK_TEST_BASE + rank + 1 (base default 0) to a sum
   and checks it; DSK_TEST_TIMEOUT (default 20 s) bounds every wait. */
static int child_main(void) {
    dsk_comm c;
    dsk_comm_opts o;
    const char *base_s = getenv("DSK_TEST_BASE"), *timeout_s = getenv("DSK_TEST_TIMEOUT");
    int64_t v, s = 0, base = base_s ? atoll(base_s) : 0;
    memset(&o, 0, sizeof o);
    o.backend = DSK_COMM_HOST;
    o.timeout_s = timeout_s ? atof(timeout_s) : 20;
    if (dsk_comm_init_env(&c, &o) != DSK_OK) {
        printf("init_env failed: %s\n", dsk_last_error());
        return 3;
    }
    v = base + c.rank + 1;
    if (dsk_comm_all_reduce(&c, NULL, &v, &s, 1, DSK_I64, DSK_COMM_SUM) != DSK_OK) {
        printf("all_reduce failed: %s\n", dsk_last_error());
        return 4;
    }
    printf("rank %d of %d local %d of %d sum %lld\n", c.rank, c.world_size, c.local_rank, c.local_world_size,
           (long long)(s - base * c.world_size));
    v = (int64_t)c.world_size * (c.world_size + 1) / 2 + base * c.world_size;
    dsk_comm_free(&c);
    return s == v ? 0 : 5;
}

static char *slurp(int fd) {
    static char buf[8192];
    size_t n = 0;
    ssize_t r;
    while (n + 1 < sizeof buf && (r = read(fd, buf + n, sizeof buf - 1 - n)) > 0) n += (size_t)r;
    buf[n] = 0;
    return buf;
}

static void case_spawn(void) {
    int p[2];
    dsk_comm_spawn_opts so;
    int worst = -1;
    char *out, *argv_sh[] = {(char *)"/bin/sh", (char *)"-c",
                             (char *)"echo \"r=$RANK w=$WORLD_SIZE l=$LOCAL_RANK/$LOCAL_WORLD_SIZE a=$MASTER_ADDR "
                                     "t=${OMP_NUM_THREADS-unset}\"; "
                                     "printf partial; exit $RANK",
                             NULL};
    char self[4096], *argv_self[] = {self, (char *)"--rank-child", NULL};
    char *argv_sleep[] = {(char *)"/bin/sleep", (char *)"30", NULL};
    ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
    self[k > 0 ? k : 0] = 0;
    memset(&so, 0, sizeof so);
    DSK_TEST_EXPECT(pipe(p) == 0, "pipe");
    so.out_fd = p[1];
    DSK_TEST_OK(dsk_comm_spawn_local(3, argv_sh, &so, &worst));
    close(p[1]);
    out = slurp(p[0]);
    close(p[0]);
    DSK_TEST_EXPECT(worst == 2, "worst exit %d, want 2", worst);
    for (int r = 0; r < 3; r++) {
        char line[256];
        /* LOCAL_WORLD_SIZE divides the cores among the ranks; OMP_NUM_THREADS passes through as set */
        snprintf(line, sizeof line, "[rank %d] r=%d w=3 l=%d/3 a=127.0.0.1 t=%s\n", r, r, r,
                 getenv("OMP_NUM_THREADS") ? getenv("OMP_NUM_THREADS") : "unset");
        DSK_TEST_EXPECT(strstr(out, line) != NULL, "output lacks \"%s\":\n%s", line, out);
        snprintf(line, sizeof line, "[rank %d] partial\n", r);
        DSK_TEST_EXPECT(strstr(out, line) != NULL, "unterminated last line not forwarded: \"%s\":\n%s", line, out);
    }
    /* the real thing: this binary as 4 ranks that bootstrap from the environment */
    DSK_TEST_EXPECT(pipe(p) == 0, "pipe");
    so.out_fd = p[1];
    so.timeout_s = 60;
    DSK_TEST_OK(dsk_comm_spawn_local(4, argv_self, &so, &worst));
    close(p[1]);
    out = slurp(p[0]);
    close(p[0]);
    DSK_TEST_EXPECT(worst == 0, "ranks exited with %d:\n%s", worst, out);
    DSK_TEST_EXPECT(strstr(out, "[rank 3] rank 3 of 4 local 3 of 4 sum 10") != NULL, "output:\n%s", out);
    /* timeout kills, and a missing program is exit status 127 */
    so.out_fd = 0;
    so.timeout_s = 0.3;
    DSK_TEST_STATUS(dsk_comm_spawn_local(2, argv_sleep, &so, &worst), DSK_ERR_TIMEOUT);
    DSK_TEST_EXPECT(worst == 128 + SIGKILL, "worst exit %d after the timeout", worst);
    DSK_TEST_ERROR_MENTIONS("dsk_comm_spawn_local");
}

/* dsk_comm_spawn_local forwards whole lines (issue: a line was cut at 4 KiB and another rank's
   line landed in the middle): 4 ranks each write 6 lines of L = 20000 + 1000 r bytes of their
   own digit at once, then one without a newline; every forwarded line must be one rank's
   prefix and exactly its L digits. */
static void case_spawn_long_lines(void) {
    char path[256], *out;
    const char *tmp = getenv("TMPDIR");
    char *argv_sh[] = {(char *)"/bin/sh", (char *)"-c",
                       (char *)"n=$((20000 + 1000 * RANK)); for i in 1 2 3 4 5 6; do "
                               "head -c $n /dev/zero | tr '\\0' \"$RANK\"; echo; done; "
                               "head -c $n /dev/zero | tr '\\0' \"$RANK\"",
                       NULL};
    dsk_comm_spawn_opts so;
    int worst = -1, fd, lines[4] = {0, 0, 0, 0}, bad = 0;
    long size;
    FILE *f;
    snprintf(path, sizeof path, "%s/dsk_spawn_lines_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    fd = mkstemp(path);
    DSK_TEST_EXPECT(fd >= 0, "mkstemp");
    if (fd < 0) return;
    memset(&so, 0, sizeof so);
    so.out_fd = fd;
    so.timeout_s = 60;
    DSK_TEST_OK(dsk_comm_spawn_local(4, argv_sh, &so, &worst));
    DSK_TEST_EXPECT(worst == 0, "worst exit %d", worst);
    size = lseek(fd, 0, SEEK_END);
    out = (char *)malloc((size_t)size + 1);
    f = fdopen(fd, "r");
    rewind(f);
    DSK_TEST_EXPECT(fread(out, 1, (size_t)size, f) == (size_t)size, "read back");
    out[size] = 0;
    fclose(f);
    unlink(path);
    for (char *line = out, *nl; *line; line = nl + 1) {
        int r = -1;
        size_t k = 0, want;
        if (!(nl = strchr(line, '\n'))) { bad++; break; }
        if (sscanf(line, "[rank %d] ", &r) != 1 || r < 0 || r > 3) { bad++; continue; }
        want = 20000 + 1000 * (size_t)r;
        line += strlen("[rank 0] ");
        while (line + k < nl && line[k] == '0' + r) k++;
        if (line + k != nl || k != want) {
            if (bad++ < 3) printf("     rank %d's line: %zu of its digits then %ld more bytes, want %zu\n", r, k,
                                  (long)(nl - line) - (long)k, want);
            continue;
        }
        lines[r]++;
    }
    for (int r = 0; r < 4; r++) DSK_TEST_EXPECT(lines[r] == 7, "rank %d: %d whole lines, want 7", r, lines[r]);
    DSK_TEST_EXPECT(bad == 0, "%d forwarded lines were not one rank's whole line", bad);
    free(out);
}

/* The trainer checks its options across ranks as soon as they meet: two ranks started by hand
   (RANK 0 and 1) with different --d-model both stop naming the option and both values (they
   used to fail later with "all_to_all_v counts disagree ... 160 elements ... expects 240"). */
static void case_trainer_disagrees(void) {
    char self[4096], trainer[4200], log[2][4300];
    ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
    int port = 0, d0 = 32 + 16 * (int)dsk_test_rand_int(4), d1 = d0 + 16;
    pid_t pid[2];
    self[k > 0 ? k : 0] = 0;
    if (strrchr(self, '/')) *strrchr(self, '/') = 0;
    snprintf(trainer, sizeof trainer, "%s/../examples/train_moe", self);
    if (access(trainer, X_OK) != 0) {
        dsk_test_skip("%s not built", trainer);
        return;
    }
    DSK_TEST_OK(dsk_comm_free_port("127.0.0.1", &port));
    fflush(stdout);
    for (int r = 0; r < 2; r++) {
        const char *tmp = getenv("TMPDIR");
        snprintf(log[r], sizeof log[r], "%s/dsk_trainer_disagrees.%d.%d.log", tmp && *tmp ? tmp : "/tmp",
                 (int)getpid(), r);
        if ((pid[r] = fork()) == 0) {
            char v[16], d[16];
            int fd = open(log[r], O_WRONLY | O_CREAT | O_TRUNC, 0644);
            dup2(fd, 1);
            dup2(fd, 2);
            snprintf(v, sizeof v, "%d", r); setenv("RANK", v, 1);
            snprintf(v, sizeof v, "%d", port); setenv("MASTER_PORT", v, 1);
            setenv("WORLD_SIZE", "2", 1); setenv("MASTER_ADDR", "127.0.0.1", 1); setenv("OMP_NUM_THREADS", "1", 1);
            unsetenv("DSK_JOB_ID");
            snprintf(d, sizeof d, "%d", r ? d1 : d0);
            execl(trainer, trainer, "--d-model", d, "--steps", "1", (char *)NULL);
            _exit(127);
        }
    }
    for (int r = 0; r < 2; r++) {
        int st = 0;
        size_t n = 0;
        char want[160], *out;
        FILE *f;
        double t0 = dsk_test_now();
        while (waitpid(pid[r], &st, WNOHANG) == 0) { /* a run that trains on is killed after 60 s */
            struct timespec ts = {0, 20000000};
            if (dsk_test_now() - t0 > 60) kill(pid[r], SIGKILL);
            nanosleep(&ts, NULL);
        }
        f = fopen(log[r], "r");
        out = (char *)calloc(1, 1 << 16);
        if (f) { n = fread(out, 1, (1 << 16) - 1, f); fclose(f); }
        out[n] = 0;
        unlink(log[r]);
        snprintf(want, sizeof want, "train_moe options differ between ranks: d_model is \"%d\" on rank 0 but \"%d\" "
                 "on rank 1", d0, d1);
        DSK_TEST_EXPECT(WIFEXITED(st) && WEXITSTATUS(st) != 0 && strstr(out, want),
                        "rank %d (status %d) lacks \"%s\":\n%.2000s", r, st, want, out);
        free(out);
    }
}

/* Open MPI's launcher: OMPI_COMM_WORLD_* only, no MASTER_ADDR (all ranks on this host). */
static void case_mpirun(void) {
    char self[4096], cmd[8400], *out;
    ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
    int port = 0, rc;
    FILE *p;
    if (system("command -v mpirun >/dev/null 2>&1") != 0) {
        dsk_test_skip("mpirun not installed (Debian libopenmpi-dev / openmpi-bin)");
        return;
    }
    self[k > 0 ? k : 0] = 0;
    DSK_TEST_OK(dsk_comm_free_port("127.0.0.1", &port));
    snprintf(cmd, sizeof cmd,
             "env -u MASTER_ADDR timeout 60 mpirun --allow-run-as-root --oversubscribe -np 3 -x MASTER_PORT=%d %s "
             "--rank-child 2>&1",
             port, self);
    fflush(stdout);
    p = popen(cmd, "r");
    DSK_TEST_EXPECT(p != NULL, "popen %s", cmd);
    if (!p) return;
    out = slurp(fileno(p));
    rc = pclose(p);
    DSK_TEST_EXPECT(rc == 0, "mpirun exited with %d:\n%s", rc, out);
    for (int r = 0; r < 3; r++) {
        char line[96];
        snprintf(line, sizeof line, "rank %d of 3 local %d of 3 sum 6", r, r);
        DSK_TEST_EXPECT(strstr(out, line) != NULL, "mpirun output lacks \"%s\":\n%s", line, out);
    }
}

/* A port whose successor is free too (a moment ago): torchrun's agent store, then dsk's. */
static int free_port_pair(void) {
    for (int tries = 0; tries < 50; tries++) {
        struct sockaddr_in sa;
        int port = 0, fd = socket(AF_INET, SOCK_STREAM, 0), ok;
        if (dsk_comm_free_port("127.0.0.1", &port) != DSK_OK) break;
        memset(&sa, 0, sizeof sa);
        sa.sin_family = AF_INET;
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        sa.sin_port = htons((uint16_t)(port + 1));
        ok = bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
        close(fd);
        if (ok) return port;
    }
    return 0;
}

/* The flags of the README's torchrun command (the line "    torchrun ... build/examples/train_moe"),
   with --nproc_per_node's value replaced by 3; 0 if the README has no such line. */
static int readme_torchrun_flags(const char *self, char *flags, size_t cap) {
    char path[4200], line[512];
    FILE *f;
    int found = 0;
    snprintf(path, sizeof path, "%s", self);
    for (int up = 0; up < 3; up++) { /* <root>/<build>/tests/test_comm -> <root> */
        char *slash = strrchr(path, '/');
        if (slash) *slash = 0;
    }
    strncat(path, "/README.md", sizeof path - strlen(path) - 1);
    if (!(f = fopen(path, "r"))) return 0;
    while (!found && fgets(line, sizeof line, f)) {
        char *prog = strstr(line, " build/examples/train_moe"), *tok;
        if (strncmp(line, "    torchrun ", 13) != 0 || !prog) continue;
        *prog = 0;
        flags[0] = 0;
        for (tok = strtok(line + 13, " "); tok; tok = strtok(NULL, " ")) {
            int nproc = strcmp(tok, "--nproc_per_node") == 0;
            snprintf(flags + strlen(flags), cap - strlen(flags), " %s", tok);
            if (nproc && (tok = strtok(NULL, " ")) != NULL) snprintf(flags + strlen(flags), cap - strlen(flags), " 3");
        }
        found = 1;
    }
    fclose(f);
    return found;
}

/* The real torchrun (issue 10 item 13), run with the flags the README gives: torch 1.13
   accepts only --no_python (newer torch both), and Debian's torch 1.13 torchrun dies under
   Python 3.11 before starting workers unless given -r 1 -t 1. dsk's store goes on
   MASTER_PORT + 1 beside the agent's. */
static void case_torchrun(void) {
    char self[4096], cmd[8400], flags[512], *out;
    ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
    int port = free_port_pair(), rc;
    FILE *p;
    if (system("command -v torchrun >/dev/null 2>&1") != 0) {
        dsk_test_skip("torchrun not installed (Debian python3-torch; .ci/run leaves it out: about 230 packages)");
        return;
    }
    self[k > 0 ? k : 0] = 0;
    DSK_TEST_EXPECT(port > 0, "no free port pair");
    int have_flags = readme_torchrun_flags(self, flags, sizeof flags);
    DSK_TEST_EXPECT(have_flags, "README.md has no \"    torchrun ... build/examples/train_moe\" line");
    if (!have_flags) return; /* flags is unset */
    printf("     README's torchrun flags:%s\n", flags);
    snprintf(cmd, sizeof cmd, "env -u MASTER_ADDR -u MASTER_PORT -u DSK_JOB_ID -u DSK_MASTER_PORT timeout 120 torchrun "
             "--master_port %d --monitor_interval 0.2%s %s --rank-child 2>&1", port, flags, self);
    fflush(stdout);
    p = popen(cmd, "r");
    DSK_TEST_EXPECT(p != NULL, "popen %s", cmd);
    if (!p) return;
    out = slurp(fileno(p));
    rc = pclose(p);
    DSK_TEST_EXPECT(rc == 0, "torchrun exited with %d:\n%s", rc, out);
    for (int r = 0; r < 3; r++) {
        char line[96];
        snprintf(line, sizeof line, "rank %d of 3 local %d of 3 sum 6", r, r);
        DSK_TEST_EXPECT(strstr(out, line) != NULL, "torchrun output lacks \"%s\":\n%s", line, out);
    }
}

/* Two `mpirun -np 2` jobs started together on one MASTER_PORT (issue 10 item 7): they must
   never merge. A rank either completes its own job's sum (a merged rank sees the other job's
   numbers and exits 5) or fails naming the cause; at least one job completes. */
static void case_mpirun_two_jobs(void) {
    char self[4096], cmd[2][8600], *out;
    ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
    int port = 0, rc[2], done = 0;
    FILE *p[2];
    if (system("command -v mpirun >/dev/null 2>&1") != 0) {
        dsk_test_skip("mpirun not installed (Debian libopenmpi-dev / openmpi-bin)");
        return;
    }
    self[k > 0 ? k : 0] = 0;
    DSK_TEST_OK(dsk_comm_free_port("127.0.0.1", &port));
    for (int j = 0; j < 2; j++)
        snprintf(cmd[j], sizeof cmd[j],
                 "env -u MASTER_ADDR -u DSK_JOB_ID timeout 60 mpirun --allow-run-as-root --oversubscribe "
                 "-np 2 -x MASTER_PORT=%d -x DSK_TEST_BASE=%d -x DSK_TEST_TIMEOUT=3 %s --rank-child 2>&1",
                 port, 1000 * j, self);
    fflush(stdout);
    for (int j = 0; j < 2; j++) p[j] = popen(cmd[j], "r");
    for (int j = 0; j < 2; j++) {
        char *line;
        int ok_lines = 0;
        DSK_TEST_EXPECT(p[j] != NULL, "popen %s", cmd[j]);
        if (!p[j]) continue;
        out = slurp(fileno(p[j]));
        rc[j] = pclose(p[j]);
        printf("     job %d (exit %d):\n", j, rc[j]);
        for (line = strtok(out, "\n"); line; line = strtok(NULL, "\n")) {
            printf("       %s\n", line);
            if (strstr(line, "of 2 local") && strstr(line, "sum 3")) ok_lines++;
            if (strstr(line, "init_env failed"))
                DSK_TEST_EXPECT(strstr(line, "belongs to another job") || strstr(line, "already in use") ||
                                    strstr(line, "no key-value store") ||
                                    strstr(line, "is taken by the key-value store of another job's rank 0"),
                                "job %d: a rank failed without naming the cause: %s", j, line);
            DSK_TEST_EXPECT(!strstr(line, "all_reduce failed"), "job %d: a rank failed after init: %s", j, line);
        }
        if (rc[j] == 0) DSK_TEST_EXPECT(ok_lines == 2, "job %d exited 0 with %d ranks reporting its sum", j, ok_lines);
        DSK_TEST_EXPECT(WIFEXITED(rc[j]) && WEXITSTATUS(rc[j]) != 5, "job %d: a rank got another job's numbers", j);
        done += rc[j] == 0;
    }
    DSK_TEST_EXPECT(done >= 1, "neither job completed");
}

/* Payloads that end 1 to 7 bytes past a 64-byte line, larger than a ring, both ways at once: the
   writer holds back the last bytes until their padding fits, so a read can end inside the first
   word of a line whose other bytes the writer is still filling (a reader that cleared that word
   then erased them). */
static void rank_stream_tails(dsk_comm *c, void *arg) {
    int me = c->rank, peer = 1 - me;
    (void)arg;
    for (int i = 0; i < 24; i++) {
        int64_t len = 300000 + 64 * (i % 5) + 1 + i % 7, cnt[2];
        uint8_t *x = (uint8_t *)malloc((size_t)len), *y = (uint8_t *)malloc((size_t)len);
        uint8_t *want = (uint8_t *)malloc((size_t)len);
        char label[64];
        gen(x, DSK_U8, len, 9100 + (uint64_t)i, me);
        gen(want, DSK_U8, len, 9100 + (uint64_t)i, peer);
        memset(y, 0xa5, (size_t)len);
        cnt[me] = 0;
        cnt[peer] = len;
        DSK_TEST_OK(dsk_comm_all_to_all_v(c, NULL, x, cnt, NULL, y, cnt, NULL, DSK_U8));
        snprintf(label, sizeof label, "rank %d: message %d of %lld bytes", me, i, (long long)len);
        DSK_TEST_SAME_BYTES(y, want, (size_t)len, label);
        free(x);
        free(y);
        free(want);
    }
}

/* The ring protocol in one process, the interleaving made explicit: a read that ends 2 bytes
   into the first word of a line (the writer held its last bytes back), while the writer has
   already filled the rest of that word but not published it. The read must not clear that word
   (it would erase the writer's bytes); the read that ends past it must, and every boundary word
   the reader consumed is zero afterwards, so no stale byte passes for a frame's stamp. */
static void case_ring_partial_word(void) {
    const uint64_t R = 4096;
    size_t bytes = sizeof(dsk__comm_chan) + R;
    char *mem = (char *)aligned_alloc(128, bytes), src[70], dst[70];
    dsk__comm_link w, r;
    uint64_t word0 = 1, word64 = 1;
    memset(mem, 0, bytes);
    memset(&w, 0, sizeof w);
    memset(&r, 0, sizeof r);
    w.tx = r.rx = (dsk__comm_chan *)mem;
    w.txd = r.rxd = mem + sizeof(dsk__comm_chan);
    for (int i = 0; i < 70; i++) src[i] = (char)(i + 1);
    memset(dst, 0, sizeof dst);
    /* a payload of 70 bytes padded to 128: the writer publishes 66, fills 66..69, the reader reads 66 */
    DSK_TEST_EXPECT(dsk__comm_ring_put(&w, R, src, 66, 0) == 66, "put 66 bytes");
    dsk__comm_ring_write(w.txd, R, 66, src + 66, 4);
    DSK_TEST_EXPECT(dsk__comm_ring_get(&r, R, dst, 70, 58) == 66, "the reader took what was published");
    w.tx_head = 70 + 58;
    dsk__comm_store64(&w.tx->head, w.tx_head);
    DSK_TEST_EXPECT(dsk__comm_ring_get(&r, R, dst + 66, 4, 58) == 4, "the reader took the rest");
    DSK_TEST_SAME_BYTES(dst, src, sizeof src, "payload read across the writer's hold-back");
    memcpy(&word0, r.rxd, 8);
    memcpy(&word64, r.rxd + 64, 8);
    DSK_TEST_EXPECT(word0 == 0 && word64 == 0 && r.rx_tail == 128, "boundary words %llx %llx, tail %llu",
                    (unsigned long long)word0, (unsigned long long)word64, (unsigned long long)r.rx_tail);
    free(mem);
}

/* One ring, writer and reader stepped in a random order in this process: random message
   lengths (empty, inline, eager, streamed, several times the ring), the writer blocked by a full
   ring and the reader by an empty one at arbitrary points. Every payload arrives intact (a reader
   that cleared a line's first word after the writer had reused its bytes failed this). */
static char ring_byte(int m, size_t i) { return (char)(((unsigned)m * 131u + (unsigned)i * 7u) | 1u); }

static void case_ring_interleavings(void) {
    static const uint64_t rings[3] = {1024, 4096, 16384};
    for (int cfg = 0; cfg < 3; cfg++) {
        const uint64_t R = rings[cfg];
        const int msgs = 20000;
        size_t bytes = sizeof(dsk__comm_chan) + R;
        char *mem = (char *)aligned_alloc(128, bytes), *back = (char *)aligned_alloc(128, bytes);
        size_t *lens = (size_t *)malloc((size_t)msgs * sizeof(size_t));
        dsk_comm a, b;
        dsk__comm_link *w, *r;
        dsk__comm_io wop, rop;
        char *wbuf = NULL, *rbuf = NULL;
        int sent = 0, got = 0, wbusy = 0, rbusy = 0, bad = 0;
        uint64_t rng = g_seed ^ (uint64_t)(cfg + 1), steps = 0;
        memset(mem, 0, bytes);
        memset(back, 0, bytes);
        memset(&a, 0, sizeof a);
        memset(&b, 0, sizeof b);
        a.world_size = b.world_size = 2;
        b.rank = 1;
        DSK_TEST_OK(dsk__comm_impl_alloc(&a, "test", NULL, "127.0.0.1", 1));
        DSK_TEST_OK(dsk__comm_impl_alloc(&b, "test", NULL, "127.0.0.1", 1));
        a.impl->ring = b.impl->ring = R;
        w = &a.impl->links[1];
        r = &b.impl->links[0];
        w->tx = r->rx = (dsk__comm_chan *)mem;
        w->txd = r->rxd = mem + sizeof(dsk__comm_chan);
        w->rx = r->tx = (dsk__comm_chan *)back;
        w->rxd = r->txd = back + sizeof(dsk__comm_chan);
        for (int m = 0; m < msgs; m++) {
            uint64_t u = dsk_test_mix64(rng ^ (uint64_t)m);
            lens[m] = u % 5 == 0 ? u % 64 : u % 3 == 0 ? u % (R / 2) : u % (3 * R);
        }
        while (got < msgs) {
            if (dsk_test_mix64(rng ^ ++steps) & 1) {
                if (!wbusy && sent < msgs) {
                    dsk__comm_wire h = dsk__comm_wire_make(a.impl, DSK__COMM_SEND, DSK_U8, 0, -1, (int64_t)lens[sent]);
                    wbuf = (char *)malloc(lens[sent] + 1);
                    for (size_t i = 0; i < lens[sent]; i++) wbuf[i] = ring_byte(sent, i);
                    h.seq = (uint64_t)sent;
                    dsk__comm_io_post(&wop, 1, 1, &h, wbuf, lens[sent]);
                    wbusy = 1;
                }
                if (wbusy) dsk__comm_shm_send(&a, &wop);
                if (wbusy && dsk__comm_io_finished(&wop)) {
                    free(wbuf);
                    wbusy = 0;
                    sent++;
                }
            } else {
                dsk_status err = DSK_OK;
                if (!rbusy && got < sent + wbusy) {
                    dsk__comm_wire h = dsk__comm_wire_make(b.impl, DSK__COMM_SEND, DSK_U8, 0, -1, (int64_t)lens[got]);
                    rbuf = (char *)malloc(lens[got] + 1);
                    memset(rbuf, 0xa5, lens[got]);
                    h.seq = (uint64_t)got;
                    dsk__comm_io_post(&rop, 0, 0, &h, rbuf, lens[got]);
                    rbusy = 1;
                }
                if (rbusy && dsk__comm_shm_recv(&b, "test", &rop, &err) < 0) {
                    DSK_TEST_OK(err);
                    break;
                }
                if (rbusy && dsk__comm_io_finished(&rop)) {
                    for (size_t i = 0; i < lens[got] && bad < 3; i++)
                        if (rbuf[i] != ring_byte(got, i)) {
                            DSK_TEST_EXPECT(0, "ring of %llu bytes, message %d of %zu bytes: byte %zu is %02x",
                                            (unsigned long long)R, got, lens[got], i, (unsigned)(unsigned char)rbuf[i]);
                            bad++;
                            break;
                        }
                    free(rbuf);
                    rbusy = 0;
                    got++;
                }
            }
        }
        if (wbusy) free(wbuf);
        if (rbusy) free(rbuf);
        DSK_TEST_EXPECT(got == msgs && bad == 0, "ring of %llu bytes: %d of %d messages, %d damaged",
                        (unsigned long long)R, got, msgs, bad);
        dsk__comm_impl_free(&a);
        dsk__comm_impl_free(&b);
        free(lens);
        free(mem);
        free(back);
    }
}

/* dsk_comm_node_comms: this rank's node (node_size ranks, in rank order) and the cross-node group (one rank per
   node, node_rank alike), split once and kept; dsk_comm_node_of; bad arguments. */
static void rank_node_comms(dsk_comm *c, void *arg) {
    dsk_comm *node = NULL, *cross = NULL, *node2 = NULL, *cross2 = NULL;
    (void)arg;
    DSK_TEST_STATUS(dsk_comm_node_comms(c, NULL, &cross), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("node or cross is NULL");
    DSK_TEST_STATUS(dsk_comm_node_comms(NULL, &node, &cross), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("communicator is NULL or not initialised");
    DSK_TEST_EXPECT(dsk_comm_node_of(c, -1) == -1 && dsk_comm_node_of(c, c->world_size) == -1 &&
                        dsk_comm_node_of(NULL, 0) == -1,
                    "a rank out of range has a node");
    for (int r = 0; r < c->world_size; r++)
        DSK_TEST_EXPECT(dsk_comm_node_of(c, r) == host_of(r, c->world_size), "rank %d: node %d, host %d", r,
                        dsk_comm_node_of(c, r), host_of(r, c->world_size));
    DSK_TEST_OK(dsk_comm_node_comms(c, &node, &cross));
    DSK_TEST_OK(dsk_comm_node_comms(c, &node2, &cross2));
    if (!node || !cross) return;
    DSK_TEST_EXPECT(node == node2 && cross == cross2, "a second call split again");
    DSK_TEST_EXPECT(node->world_size == c->node_size && node->rank == c->node_rank, "node group: rank %d of %d",
                    node->rank, node->world_size);
    DSK_TEST_EXPECT(cross->world_size == c->n_nodes && cross->rank == c->node, "cross group: rank %d of %d",
                    cross->rank, cross->world_size);
    {
        int64_t mine = c->rank, sum = -1, want = 0;
        DSK_TEST_OK(dsk_comm_all_reduce(node, NULL, &mine, &sum, 1, DSK_I64, DSK_COMM_SUM));
        for (int r = 0; r < c->world_size; r++) want += host_of(r, c->world_size) == c->node ? r : 0;
        DSK_TEST_EXPECT(sum == want, "node group sums ranks to %lld, want %lld", (long long)sum, (long long)want);
    }
}

/* ------------------------------------------------------------------ shared memory */

static void *kill_soon(void *arg) {
    struct timespec ts = {0, 30000000};
    (void)arg;
    nanosleep(&ts, NULL);
    raise(SIGKILL);
    return NULL;
}

/* Rank 1 is killed 30 ms into a run of 16 MB all-reduces, inside one of them: the others
   fail within the timeout, naming it. */
static void rank_killed_inside(dsk_comm *c, void *arg) {
    int64_t n = 4 << 20;
    float *x = (float *)malloc((size_t)n * sizeof(float));
    dsk_status st = DSK_OK;
    double t0 = 0;
    (void)arg;
    gen(x, DSK_F32, n, 31, c->rank);
    DSK_TEST_OK(dsk_comm_barrier(c, NULL));
    if (c->rank == 1) {
        pthread_t t;
        pthread_create(&t, NULL, kill_soon, NULL);
    }
    for (int i = 0; i < 50 && st == DSK_OK; i++) {
        t0 = dsk_test_now();
        st = dsk_comm_all_reduce(c, NULL, x, x, n, DSK_F32, DSK_COMM_SUM);
    }
    printf("     rank %d: %s after %.2f s: %s\n", c->rank, dsk_status_str(st), dsk_test_now() - t0, dsk_last_error());
    DSK_TEST_EXPECT(st == DSK_ERR_PEER || st == DSK_ERR_TIMEOUT, "rank %d got %s", c->rank, dsk_status_str(st));
    DSK_TEST_ERROR_MENTIONS("rank 1");
    DSK_TEST_ERROR_MENTIONS("dsk_comm_all_reduce");
    DSK_TEST_EXPECT(dsk_test_now() - t0 < 1.0 + 1.0, "the failing call took %.2f s for a 1 s timeout",
                    dsk_test_now() - t0);
    free(x);
}

static void case_killed_inside(void) {
    group g;
    group_defaults(&g, 3);
    g.opts = fault_opts(1.0);
    run_group(&g, rank_killed_inside, NULL);
    DSK_TEST_EXPECT(g.status[0] == 0 && g.status[2] == 0, "surviving ranks exited %d %d", g.status[0], g.status[2]);
    DSK_TEST_EXPECT(g.status[1] == 128 + SIGKILL, "victim exited %d", g.status[1]);
    DSK_TEST_EXPECT(segments_of(g.pid, g.n) == 0, "segments left behind by the job");
}

static void rank_barrier(dsk_comm *c, void *arg) {
    (void)arg;
    DSK_TEST_OK(dsk_comm_barrier(c, NULL));
}

static unsigned long long pid_namespace(void) {
    char link[64] = "";
    unsigned long long ino = 0;
    ssize_t k = readlink("/proc/self/ns/pid", link, sizeof link - 1);
    if (k > 0) {
        link[k] = 0;
        if (sscanf(link, "pid:[%llu]", &ino) != 1) ino = 0;
    }
    return ino;
}

static int shm_exists(const char *name) {
    int fd = shm_open(name, O_RDONLY, 0);
    if (fd < 0) return 0;
    close(fd);
    return 1;
}

/* A segment left by a dead creator (in this pid namespace) is removed when the next one is
   created; one of a live process, or of another pid namespace, is kept. */
static void case_stale_segments(void) {
    unsigned long long ns = pid_namespace();
    pid_t dead = fork();
    char stale[96], live[96], other[96];
    const char *names[3] = {stale, live, other};
    group g;
    if (dead == 0) _exit(0);
    waitpid(dead, NULL, 0);
    snprintf(stale, sizeof stale, "/dsk-%llu-%d-00000000000000aa", ns, (int)dead);
    snprintf(live, sizeof live, "/dsk-%llu-%d-00000000000000bb", ns, (int)getpid());
    snprintf(other, sizeof other, "/dsk-%llu-%d-00000000000000cc", ns + 1, (int)dead);
    for (int i = 0; i < 3; i++) {
        int fd = shm_open(names[i], O_CREAT | O_RDWR, 0600);
        DSK_TEST_EXPECT(fd >= 0, "shm_open %s: %s", names[i], strerror(errno));
        if (fd >= 0) close(fd);
    }
    group_defaults(&g, 2);
    expect_group_ok(&g, rank_barrier, NULL);
    DSK_TEST_EXPECT(!shm_exists(stale), "%s (creator %d is dead) was not removed", stale, (int)dead);
    DSK_TEST_EXPECT(shm_exists(live), "%s (creator alive) was removed", live);
    DSK_TEST_EXPECT(shm_exists(other), "%s (another pid namespace) was removed", other);
    for (int i = 0; i < 3; i++) shm_unlink(names[i]);
}

/* Rank 1 asks for TCP: it reaches everyone over TCP, ranks 0 and 2 share memory. */
static void rank_mixed_pairs(dsk_comm *c, void *arg) {
    rank_all_to_all_v(c, arg);
    rank_send_recv(c, arg);
}

static void case_tcp_rank(void) {
    group g;
    group_defaults(&g, 3);
    g.tcp_ranks = 1u << 1;
    expect_group_ok(&g, rank_mixed_pairs, NULL);
}

/* ------------------------------------------------------------------ main */

static void coll_case(const char *name, rank_fn fn, int n, size_t piece) {
    group g;
    group_defaults(&g, n);
    g.opts.piece_bytes = piece;
    dsk_test_begin("[%s] %s, %d rank%s", k_mode_names[g_mode], name, n, n > 1 ? "s" : "");
    expect_group_ok(&g, fn, NULL);
    dsk_test_end();
}

/* dsk_test_begin with the transport mode in front of the name. */
static void mode_begin(const char *fmt, ...) {
    char name[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    dsk_test_begin("[%s] %s", k_mode_names[g_mode], name);
}

/* Every collective and fault case in the current transport mode. Shared memory (the default)
   runs the collectives on 1 to 4 ranks; TCP on 2 (several TCP peers per rank: the splits, the
   faults and the rounds with two emulated hosts); two emulated hosts on 4 (2 + 2: shared memory
   inside each, TCP across).
   The fault cases that only wait out a timeout run where the transport changes what they test.
   Kept so to hold test_comm near 40 s on a loaded 2-core machine. */
static void run_suite(void) {
    int n0 = g_mode == MODE_SHM ? 1 : g_mode == MODE_TWO_HOSTS ? 4 : 2, n1 = g_mode == MODE_TCP ? 2 : 4;
    for (int n = n0; n <= n1; n++) {
        coll_case("all_reduce: 7 dtypes x 4 ops x sizes 0..70001 + 6 MB, exact rank-order fold", rank_all_reduce, n,
                  65536);
        coll_case("reduce_scatter: 7 dtypes x 4 ops x 6 sizes", rank_reduce_scatter, n, 65536);
        coll_case("all_gather: 7 dtypes x 6 sizes, in place and not", rank_all_gather, n, 0);
        coll_case("broadcast: 7 dtypes x 6 sizes x 2 roots", rank_broadcast, n, 0);
        coll_case("reduce: 7 dtypes x (sum x 6 sizes, avg/max/min x 2) x 2 roots, = all_reduce, others untouched",
                  rank_reduce, n, 65536);
        coll_case("gather: 7 dtypes x 6 sizes x 2 roots, in place and not", rank_gather, n, 0);
        coll_case("scatter: 7 dtypes x 6 sizes x 2 roots, in place and not", rank_scatter, n, 0);
        coll_case("all_to_all: 7 dtypes x 6 sizes", rank_all_to_all, n, 0);
        coll_case("all_to_all_v: uneven counts with zeros, packed and with gaps", rank_all_to_all_v, n, 0);
        coll_case("all_to_all_v_notify: each rank reported once, own first, after its block landed",
                  rank_all_to_all_v_notify, n, 0);
        coll_case("all_to_all_v_gated: blocks written as it runs, in a shuffled order, none sent before its gate",
                  rank_all_to_all_v_gated, n, 0);
        coll_case("all_to_all_v_gated: a gate that says -1 fails the call and breaks the communicator",
                  rank_all_to_all_v_gated_give_up, n, 0);
        coll_case("all_to_all_v_start + finish: = all_to_all_v; finished on a thread where bytes were left unsent",
                  rank_all_to_all_v_begun, n, 0);
        coll_case("all_to_all_v_start + progress: each block right when reported landed, waiting and polling",
                  rank_all_to_all_v_progress, n, 0);
        coll_case("all_to_all_v_start: finish with none begun, calls while one is in flight refused (state)",
                  rank_all_to_all_v_begun_misuse, n, 0);
        coll_case("send/recv ring and barrier", rank_send_recv, n, 0);
        coll_case("send_start/recv_start: sends begun first, larger than a ring, 7 dtypes; waited out of order",
                  rank_p2p_begun, n, 0);
        coll_case("test: a receive whose sender waits for a go is idle, then polled to done", rank_p2p_test, n, 0);
        coll_case("send_start/recv_start: collectives refused while pending (state), unknown ids (argument)",
                  rank_p2p_begun_misuse, n, 0);
        coll_case("tensor forms", rank_tensors, n, 0);
        if (g_mode == MODE_SHM) coll_case("store set/get/add/barrier", rank_store, n, 0);
    }
    if (g_mode != MODE_TWO_HOSTS) coll_case("split: parity groups, NO_COLOR, nested", rank_split, 3, 0);
    coll_case("split: parity groups, NO_COLOR, nested", rank_split, 4, 0);
    coll_case("NaN propagates through sum, avg, max, min; ranks agree bitwise", rank_nan, 3, 0);
    case_link();
    coll_case("node communicators: the node's and the cross-node ranks, kept; bad arguments", rank_node_comms, 4, 0);
    if (g_mode == MODE_SHM)
        coll_case("rings: payloads ending 1 to 7 bytes into a line, larger than a ring", rank_stream_tails, 2, 0);
    mode_begin("fault: rank 2 of 3 SIGKILLed mid-run, small messages");
    case_rank_dies(SIGKILL, 100);
    mode_begin("fault: rank 2 of 3 SIGKILLed in a sub-group's all-reduce -> named with its world rank");
    case_sub_rank_dies();
    mode_begin("fault: rank 2 of 3 SIGKILLed mid-run, 8 MB messages");
    case_rank_dies(SIGKILL, 2 << 20);
    if (g_mode != MODE_TCP) {
        mode_begin("fault: rank 2 of 3 SIGSTOPped mid-run -> timeout naming it");
        case_rank_dies(SIGSTOP, 1000);
    }
    if (g_mode != MODE_TWO_HOSTS) {
        mode_begin("fault: rank 2 of 3 SIGSTOPped mid-run, 8 MB messages (sends block too)");
        case_rank_dies(SIGSTOP, 2 << 20);
    }
    mode_begin("fault: rank 0 aborts through a sub-group (dsk_comm_abort): blocked peers in the world and the "
               "sub-group report its own error");
    {
        group g;
        group_defaults(&g, 3);
        g.opts = fault_opts(3.0);
        expect_group_ok(&g, rank_aborts, NULL);
    }
    mode_begin("fault: rank 0 of 4 SIGKILLed, chain of receives: every survivor blames rank 0 (it hosts the store)");
    case_zero_dies(1);
    mode_begin("fault: rank 0 of 4 SIGKILLed in a 4 MB all_reduce: every survivor blames rank 0");
    case_zero_dies(0);
    if (g_mode == MODE_SHM) {
        group g;
        group_defaults(&g, 3);
        g.opts = fault_opts(1.0);
        g.reap = 1;
        mode_begin("fault: rank 0 of 3 SIGSTOPped: survivors fail in the timeout, the message tells the time taken");
        run_group(&g, rank_zero_stops, NULL);
        DSK_TEST_EXPECT(g.status[1] == 0 && g.status[2] == 0, "surviving ranks exited %d %d", g.status[1], g.status[2]);
    }
    mode_begin("fault: mismatched count (2 ranks)");
    case_mismatch(2, 0);
    mode_begin("fault: mismatched dtype (3 ranks)");
    case_mismatch(3, 1);
    mode_begin("fault: mismatched collective (3 ranks)");
    case_mismatch(3, 2);
    mode_begin("fault: mismatched all_to_all_v counts fail the receiver and the sender, naming both (2 ranks)");
    case_mismatch(2, 3);
    mode_begin("fault: mismatched broadcast roots fail every rank in that call (2 ranks)");
    case_mismatch(2, 4);
    mode_begin("fault: mismatched broadcast roots fail every rank in that call (3 ranks, scatter + all-gather)");
    case_mismatch(3, 5);
    mode_begin("fault: mismatched reduce roots fail every rank in that call (3 ranks)");
    case_mismatch(3, 6);
    mode_begin("fault: mismatched reduce roots fail every rank in that call (3 ranks, reduce-scatter + gather)");
    case_mismatch(3, 7);
    mode_begin("fault: mismatched gather roots fail every rank in that call (3 ranks)");
    case_mismatch(3, 8);
    mode_begin("fault: mismatched scatter roots fail every rank in that call (3 ranks)");
    case_mismatch(3, 9);
    if (g_mode != MODE_TWO_HOSTS) {
        group g;
        group_defaults(&g, 2);
        g.opts = fault_opts(3.0);
        mode_begin("fault: peer closed mid-send gives DSK_ERR_PEER, not SIGPIPE");
        expect_group_ok(&g, rank_leaves, NULL);
    }
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--rank-child") == 0) return child_main();
    dsk_test_init("test_comm");
    g_seed = dsk_test_rand_u64();
    for (g_mode = 0; g_mode < N_MODES; g_mode++) run_suite();
    g_mode = MODE_SHM;
    mode_begin("fault: rank 1 of 3 SIGKILLed inside a 16 MB all_reduce: the others name it, no segment is left");
    case_killed_inside();
    DSK_TEST_RUN(case_ring_partial_word);
    DSK_TEST_RUN(case_ring_interleavings);
    mode_begin("segments of dead creators are removed, others kept");
    case_stale_segments();
    mode_begin("a rank that asks for TCP: pairs with it use TCP, the others shared memory (3 ranks)");
    case_tcp_rank();
    DSK_TEST_RUN(case_store_timeout);
    DSK_TEST_RUN(case_free_port);
    dsk_test_begin(
        "job identity: a rank of another job (opts.job_id) reaching this job's store fails, the job runs on");
    case_two_jobs(0);
    dsk_test_begin(
        "job identity: a rank of another job (PMIX_NAMESPACE) reaching this job's store fails, the job runs on");
    case_two_jobs(1);
    DSK_TEST_RUN(case_wrong_world);
    DSK_TEST_RUN(case_missing_rank);
    DSK_TEST_RUN(case_options_differ);
    DSK_TEST_RUN(case_duplicate_rank);
    DSK_TEST_RUN(case_duplicate_rank0);
    DSK_TEST_RUN(case_rank0_twice_in_process);
    DSK_TEST_RUN(case_check_agree);
    DSK_TEST_RUN(case_port_in_use);
    DSK_TEST_RUN(case_no_store);
    DSK_TEST_RUN(case_env);
    DSK_TEST_RUN(case_bad_args);
    DSK_TEST_RUN(case_reinit);
    DSK_TEST_RUN(case_spawn);
    DSK_TEST_RUN(case_spawn_long_lines);
    DSK_TEST_RUN(case_trainer_disagrees);
    DSK_TEST_RUN(case_mpirun);
    DSK_TEST_RUN(case_mpirun_two_jobs);
    DSK_TEST_RUN(case_torchrun);
    return dsk_test_finish();
}
