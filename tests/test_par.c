/* test_par.c - dsk_par.h: schedules, the rank grid, tensor-parallel mappings, parallel linears,
   vocabulary-parallel embedding and cross-entropy, and a rank killed inside a pipeline send.

   Schedules are property-tested over many (stages, micro-batches, chunks) by a simulator
   written here, independent of the library's: every rank's list runs with blocking
   (rendezvous) sends and receives; a computation whose input has not arrived fails the case,
   as does a state where no rank can move (deadlock), a send that meets a different receive,
   or a computation done twice or never. The same run, with one time unit per computation,
   gives the bubble, compared with (p - 1) / m or (p - 1) / (v m); the activations held per
   rank are compared with the documented bound. Distributed cases fork 2 or 4 ranks on the
   host backend and compare with float64 references computed on every rank from the same
   seeded inputs (each input is a function of (tag, index), so every rank can form the full
   tensors). */
#define _POSIX_C_SOURCE 200809L /* kill, nanosleep, clock_gettime: the library is linked, not included */
#include "dsk_par.h"
#include "tests/dsk_test.h"

#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

/* ------------------------------------------------------------------ rank processes */

typedef void (*rank_fn)(dsk_comm *c, void *arg);

static int g_rank;

/* Forks n ranks that init a host communicator on a fresh port and run fn; a rank exits 1 if
   any of its checks failed. status[r]: exit code, 128 + signal when killed. Returns 1 if all
   exited 0. Ranks still running after limit_s are killed and the case fails (a hang). */
static int run_ranks(int n, rank_fn fn, void *arg, double timeout_s, double limit_s, int *status) {
    pid_t pid[8];
    dsk_comm_opts o;
    int port = 0, ok = 1;
    double t0 = dsk_test_now();
    for (int r = 0; r < n; r++) status[r] = -1; /* what the caller reads if no rank starts */
    if (dsk_comm_free_port("127.0.0.1", &port) != DSK_OK) {
        dsk_test_fail_at(__FILE__, __LINE__, "no free port: %s", dsk_last_error());
        return 0;
    }
    memset(&o, 0, sizeof o);
    o.backend = DSK_COMM_HOST;
    o.timeout_s = timeout_s;
    o.master_addr = "127.0.0.1";
    o.master_port = port;
    fflush(stdout);
    for (int r = 0; r < n; r++) {
        pid[r] = fork();
        if (pid[r] == 0) {
            dsk_comm c;
            int failed_before = dsk_test_g.checks_failed_total;
            dsk_status st;
            g_rank = r;
            st = dsk_comm_init(&c, r, n, &o);
            if (st != DSK_OK)
                dsk_test_fail_at(__FILE__, __LINE__, "rank %d: dsk_comm_init: %s", r, dsk_last_error());
            else {
                fn(&c, arg);
                dsk_comm_free(&c);
            }
            fflush(stdout);
            _exit(dsk_test_g.checks_failed_total > failed_before ? 1 : 0);
        }
    }
    for (int left = n; left > 0;) {
        for (int r = 0; r < n; r++) {
            int st;
            if (status[r] != -1) continue;
            if (waitpid(pid[r], &st, WNOHANG) == pid[r]) {
                status[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
                left--;
            }
        }
        if (left && dsk_test_now() - t0 > limit_s) {
            for (int r = 0; r < n; r++)
                if (status[r] == -1) kill(pid[r], SIGKILL);
            dsk_test_fail_at(__FILE__, __LINE__, "ranks still running after %.0f s were killed (a hang)", limit_s);
            limit_s = 1e9;
        }
        if (left) {
            struct timespec ts = {0, 2000000};
            nanosleep(&ts, NULL);
        }
    }
    for (int r = 0; r < n; r++) ok &= status[r] == 0;
    return ok;
}

static void expect_ranks_ok(int n, rank_fn fn, void *arg) {
    int status[8];
    if (!run_ranks(n, fn, arg, 20, 60, status))
        for (int r = 0; r < n; r++)
            DSK_TEST_EXPECT(status[r] == 0, "rank %d of %d exited with status %d", r, n, status[r]);
}

/* ------------------------------------------------------------------ inputs */

/* Element i of input `tag`: in [-1, 1), never 0, the same on every rank. */
static float gen1(uint64_t tag, int64_t i) {
    uint64_t u = dsk_test_mix64(dsk_test_g.seed ^ dsk_test_mix64(tag * 7919u) ^ (uint64_t)i * 0xD1B54A32D192ED03ull);
    float f = (float)((double)(u >> 11) * (1.0 / 9007199254740992.0) * 2.0 - 1.0);
    return f == 0 ? 0.25f : f;
}

static void gen(float *p, int64_t n, uint64_t tag) {
    for (int64_t i = 0; i < n; i++) p[i] = gen1(tag, i);
}

static float *falloc(int64_t n) {
    float *p = (float *)malloc((size_t)(n ? n : 1) * sizeof(float));
    if (!p) { fprintf(stderr, "out of memory\n"); exit(2); }
    return p;
}

static double *dalloc(int64_t n) {
    double *p = (double *)calloc((size_t)(n ? n : 1), sizeof(double));
    if (!p) { fprintf(stderr, "out of memory\n"); exit(2); }
    return p;
}

static dsk_tensor wrap2(float *p, int64_t r, int64_t c) {
    dsk_tensor t;
    int64_t sh[2] = {r, c};
    dsk_tensor_wrap(&t, p, DSK_F32, dsk_cpu(), 2, sh);
    return t;
}

/* ------------------------------------------------------------------ schedules: the checker */

typedef struct sim_result {
    int ok;          /* 0: a check failed (reported unless quiet) */
    char why[512];   /* the failure */
    int makespan;    /* time units with F = B = 1 */
    int in_flight[16];
} sim_result;

/* Owner rank of global stage s: c p + r, or DualPipeV's V (chunk 1: stage 2 p - 1 - r), written out here apart
   from dsk_par_stage_rank. */
static int owner(int s, int p, dsk_par_schedule_kind k) {
    return k == DSK_PAR_DUALPIPE_V && s >= p ? 2 * p - 1 - s : s % p;
}

/* Runs the p lists with rendezvous sends and receives; reports the first violation. */
static sim_result simulate(dsk_par_schedule *sc, int p, int m, int v, const char *what, int quiet) {
    sim_result res;
    int S = p * v, pos[16], clock[16], held[16], done_ranks = 0;
    unsigned char *fw = (unsigned char *)calloc((size_t)S * m, 1), *bw = (unsigned char *)calloc((size_t)S * m, 1);
    unsigned char *racts = (unsigned char *)calloc((size_t)S * m, 1);
    unsigned char *rgrad = (unsigned char *)calloc((size_t)S * m, 1);
    memset(&res, 0, sizeof res);
    res.ok = 1;
    for (int r = 0; r < p; r++) pos[r] = clock[r] = held[r] = 0;
#define SIM_FAIL(...)                                                                                 \
    do {                                                                                              \
        snprintf(res.why, sizeof res.why, __VA_ARGS__);                                               \
        if (!quiet) dsk_test_fail_at(__FILE__, __LINE__, "%s", res.why);                              \
        res.ok = 0;                                                                                   \
        goto out;                                                                                     \
    } while (0)
    while (done_ranks < p) {
        int moved = 0;
        done_ranks = 0;
        for (int r = 0; r < p; r++) {
            const dsk_par_action *a;
            int s;
            if (pos[r] == sc[r].n) { done_ranks++; continue; }
            a = &sc[r].actions[pos[r]];
            s = a->stage;
            if (owner(s, p, sc[0].kind) != r || a->chunk != s / p || a->micro < 0 || a->micro >= m || s < 0 || s >= S)
                SIM_FAIL("%s: rank %d action %d: stage %d chunk %d micro %d do not belong here", what, r, pos[r], s,
                         a->chunk, a->micro);
            if (a->kind == DSK_PAR_FORWARD_BACKWARD) { /* the forward, then the backward, one unit each */
                int sb = a->bwd_stage, mb = a->bwd_micro, ready;
                if (owner(sb, p, sc[0].kind) != r || a->bwd_chunk != sb / p || mb < 0 || mb >= m || sb < 0 || sb >= S ||
                    mb == a->micro)
                    SIM_FAIL("%s: rank %d action %d pairs forward micro %d with backward micro %d stage %d", what, r,
                             pos[r], a->micro, mb, sb);
                ready =
                    s == 0 || (owner(s - 1, p, sc[0].kind) == r ? fw[(s - 1) * m + a->micro] : racts[s * m + a->micro]);
                ready =
                    ready && fw[sb * m + mb] &&
                    (sb == S - 1 || (owner(sb + 1, p, sc[0].kind) == r ? bw[(sb + 1) * m + mb] : rgrad[sb * m + mb]));
                if (!ready) SIM_FAIL("%s: rank %d runs the pair (F%d, B%d) before its inputs", what, r, a->micro, mb);
                if (fw[s * m + a->micro]++) SIM_FAIL("%s: forward of micro %d stage %d twice", what, a->micro, s);
                if (bw[sb * m + mb]++) SIM_FAIL("%s: backward of micro %d stage %d twice", what, mb, sb);
                clock[r] += 2;
                if (++held[r] > res.in_flight[r]) res.in_flight[r] = held[r];
                held[r]--;
                pos[r]++;
                moved = 1;
            } else if (a->kind == DSK_PAR_FORWARD) {
                int ready =
                    s == 0 || (owner(s - 1, p, sc[0].kind) == r ? fw[(s - 1) * m + a->micro] : racts[s * m + a->micro]);
                if (!ready)
                    SIM_FAIL("%s: rank %d runs forward of micro %d stage %d before its input", what, r, a->micro, s);
                if (fw[s * m + a->micro]++) SIM_FAIL("%s: forward of micro %d stage %d twice", what, a->micro, s);
                clock[r]++;
                if (++held[r] > res.in_flight[r]) res.in_flight[r] = held[r];
                pos[r]++;
                moved = 1;
            } else if (a->kind == DSK_PAR_BACKWARD) {
                int local = owner(s + 1, p, sc[0].kind) == r;
                int ready = fw[s * m + a->micro] &&
                            (s == S - 1 || (local ? bw[(s + 1) * m + a->micro] : rgrad[s * m + a->micro]));
                if (!ready)
                    SIM_FAIL("%s: rank %d runs backward of micro %d stage %d before its input", what, r, a->micro, s);
                if (bw[s * m + a->micro]++) SIM_FAIL("%s: backward of micro %d stage %d twice", what, a->micro, s);
                clock[r]++;
                held[r]--;
                pos[r]++;
                moved = 1;
            } else if (a->kind == DSK_PAR_SEND_ACT || a->kind == DSK_PAR_SEND_GRAD) {
                int grad = a->kind == DSK_PAR_SEND_GRAD, to = grad ? s - 1 : s + 1, q = a->peer;
                const dsk_par_action *b;
                if (to < 0 || to >= S || q != owner(to, p, sc[0].kind) || q == r)
                    SIM_FAIL("%s: rank %d sends %s of stage %d to rank %d", what, r, grad ? "grad" : "act", s, q);
                if (!(grad ? bw[s * m + a->micro] : fw[s * m + a->micro]))
                    SIM_FAIL("%s: rank %d sends micro %d stage %d before computing it", what, r, a->micro, s);
                if (pos[q] == sc[q].n) continue;
                b = &sc[q].actions[pos[q]];
                if (b->kind != DSK_PAR_RECV_ACT && b->kind != DSK_PAR_RECV_GRAD) continue; /* q not receiving yet */
                if (b->peer != r) continue;                                           /* receiving from another */
                if (b->kind != (grad ? DSK_PAR_RECV_GRAD : DSK_PAR_RECV_ACT) || b->micro != a->micro || b->stage != to)
                    SIM_FAIL("%s: rank %d sends %s micro %d stage %d, rank %d receives %s micro %d stage %d", what, r,
                             dsk_par_action_name(a->kind), a->micro, s, q, dsk_par_action_name(b->kind), b->micro,
                             b->stage);
                (grad ? rgrad : racts)[to * m + a->micro] = 1;
                clock[r] = clock[q] = clock[r] > clock[q] ? clock[r] : clock[q];
                pos[r]++;
                pos[q]++;
                moved = 1;
            }
            /* a rank at a receive waits for its sender to arrive at the send */
        }
        if (!moved && done_ranks < p) {
            char where[256] = "";
            for (int r = 0; r < p; r++)
                if (pos[r] < sc[r].n)
                    snprintf(where + strlen(where), sizeof where - strlen(where), " rank %d at %s(micro %d, peer %d);",
                             r, dsk_par_action_name(sc[r].actions[pos[r]].kind), sc[r].actions[pos[r]].micro,
                             sc[r].actions[pos[r]].peer);
            SIM_FAIL("%s: deadlock:%s", what, where);
        }
    }
    for (int i = 0; i < S * m; i++)
        if (!fw[i] || !bw[i])
            SIM_FAIL("%s: micro %d stage %d never ran its %s", what, i % m, i / m, fw[i] ? "backward" : "forward");
    for (int r = 0; r < p; r++) {
        if (clock[r] > res.makespan) res.makespan = clock[r];
        if (held[r] != 0) SIM_FAIL("%s: rank %d ends holding %d activations", what, r, held[r]);
    }
#undef SIM_FAIL
out:
    free(fw);
    free(bw);
    free(racts);
    free(rgrad);
    return res;
}

/* Every rank's list (paired or not) into sc, zeroed first; 1 when all were built (failures reported). */
static int build_lists(dsk_par_schedule *sc, dsk_par_schedule_kind kind, int p, int m, int v, int paired,
                       const char *what) {
    int ok = 1;
    memset(sc, 0, (size_t)p * sizeof *sc);
    for (int r = 0; r < p; r++)
        if ((paired ? dsk_par_schedule_init_paired(&sc[r], kind, p, m, v, r)
                    : dsk_par_schedule_init(&sc[r], kind, p, m, v, r)) != DSK_OK) {
            dsk_test_fail_at(__FILE__, __LINE__, "%s rank %d: %s", what, r, dsk_last_error());
            ok = 0;
        }
    return ok;
}

/* Builds every rank's list and checks them; returns 1 when all properties hold. */
static int check_schedule(dsk_par_schedule_kind kind, int p, int m, int v) {
    dsk_par_schedule sc[16];
    char what[96];
    int ok = 1;
    sim_result res;
    snprintf(what, sizeof what, "%s p=%d m=%d v=%d", dsk_par_schedule_name(kind), p, m, v);
    if (!build_lists(sc, kind, p, m, v, 0, what)) {
        ok = 0;
        goto out;
    }
    res = simulate(sc, p, m, v, what, 0);
    if (!res.ok) { ok = 0; goto out; }
    {
        double bubble = (double)(res.makespan - 2 * m * v) / (2.0 * m * v);
        double want = dsk_par_bubble_fraction(kind, p, m, v);
        if (fabs(bubble - want) > 1e-12 || fabs(sc[0].bubble - want) > 1e-12) {
            dsk_test_fail_at(__FILE__, __LINE__,
                             "%s: simulated bubble %.6f (makespan %d), formula %.6f, schedule says %.6f", what, bubble,
                             res.makespan, want, sc[0].bubble);
            ok = 0;
        }
        /* the bound by formula, written out here */
        for (int r = 0; r < p; r++) {
            int bound;
            if (kind == DSK_PAR_GPIPE) bound = m;
            else if (kind == DSK_PAR_DUALPIPE_V) bound = 2 * p + 1; /* 2 p forwards, then F0 before B1 */
            else if (kind == DSK_PAR_1F1B || v == 1) bound = p - r < m ? p - r : m;
            else if (m == p) bound = m * v;
            else bound = 2 * (p - r - 1) + (v - 1) * p + 1 < m * v ? 2 * (p - r - 1) + (v - 1) * p + 1 : m * v;
            if (res.in_flight[r] != bound || sc[r].in_flight != bound) {
                dsk_test_fail_at(__FILE__, __LINE__,
                                 "%s: rank %d holds at most %d micro-batch chunks, bound %d, schedule says %d", what, r,
                                 res.in_flight[r], bound, sc[r].in_flight);
                ok = 0;
            }
        }
    }
out:
    for (int r = 0; r < p; r++) dsk_par_schedule_free(&sc[r]);
    return ok;
}

/* The computations of a list in order, a paired one as its forward then its backward: (backward?,
   micro, chunk) triples into ops; returns their count. */
static int compute_order(const dsk_par_schedule *s, int *ops) {
    int n = 0;
    for (int i = 0; i < s->n; i++) {
        const dsk_par_action *a = &s->actions[i];
        if (a->kind != DSK_PAR_FORWARD && a->kind != DSK_PAR_BACKWARD && a->kind != DSK_PAR_FORWARD_BACKWARD) continue;
        ops[n++] = a->kind == DSK_PAR_BACKWARD, ops[n++] = a->micro, ops[n++] = a->chunk;
        if (a->kind == DSK_PAR_FORWARD_BACKWARD) ops[n++] = 1, ops[n++] = a->bwd_micro, ops[n++] = a->bwd_chunk;
    }
    return n / 3;
}

/* The forwards of a list in order and its backwards in order, each a sequence of (micro, chunk). */
static void split_order(const int *ops, int n, int *fwd, int *bwd) {
    int nf = 0, nb = 0;
    for (int i = 0; i < n; i++) {
        int *to = ops[3 * i] ? bwd + 2 * nb++ : fwd + 2 * nf++;
        to[0] = ops[3 * i + 1], to[1] = ops[3 * i + 2];
    }
}

/* A paired schedule: every rank's list runs (the checker above) with the unpaired schedule's
   bubble, its forwards and its backwards each in the unpaired order (gradients accumulate as
   there), the warm-up 2 (p - r - 1) + (v - 1) p + 1 forwards (capped at m v; every forward when
   interleaved with m = p; GPipe unpaired) and one more chunk than that in flight, and under 1F1B
   every steady-state forward paired. *pairs counts the pairs. */
static int check_paired(dsk_par_schedule_kind kind, int p, int m, int v, int *pairs) {
    dsk_par_schedule sc[16], un;
    char what[96];
    int ok = 1, *ops = NULL, *ops_un = NULL, *f1 = NULL, *f2 = NULL;
    sim_result res;
    snprintf(what, sizeof what, "paired %s p=%d m=%d v=%d", dsk_par_schedule_name(kind), p, m, v);
    memset(&un, 0, sizeof un);
    if (!build_lists(sc, kind, p, m, v, 1, what)) {
        ok = 0;
        goto out;
    }
    res = simulate(sc, p, m, v, what, 0);
    if (!res.ok) {
        ok = 0;
        goto out;
    }
    /* DualPipeV's pairs wait for both inputs: p more unit steps than its unpaired 2 (p - 1) (p > 1) */
    if (fabs((double)(res.makespan - 2 * m * v) / (2.0 * m * v) - dsk_par_bubble_fraction(kind, p, m, v) -
             (kind == DSK_PAR_DUALPIPE_V && p > 1 ? p / (2.0 * m * v) : 0.0)) > 1e-12) {
        dsk_test_fail_at(__FILE__, __LINE__, "%s: makespan %d, bubble %.6f, unpaired formula %.6f", what, res.makespan,
                         (double)(res.makespan - 2 * m * v) / (2.0 * m * v), dsk_par_bubble_fraction(kind, p, m, v));
        ok = 0;
    }
    ops = (int *)malloc(sizeof(int) * 6 * m * v);
    ops_un = (int *)malloc(sizeof(int) * 6 * m * v);
    f1 = (int *)malloc(sizeof(int) * 4 * m * v);
    f2 = (int *)malloc(sizeof(int) * 4 * m * v);
    for (int r = 0; r < p && ok; r++) {
        int n, n_un, fused = 0, w = 2 * (p - r - 1) + (v - 1) * p + 1, bound;
        if ((v > 1 && m == p) || kind == DSK_PAR_GPIPE) w = m * v; /* every forward first, as unpaired */
        w = w < m * v ? w : m * v;
        bound = w + 1 < m * v ? w + 1 : m * v;
        if (kind == DSK_PAR_DUALPIPE_V) bound = 2 * p + 1; /* the pairs keep DualPipeV's order */
        DSK_TEST_OK(dsk_par_schedule_init(&un, kind, p, m, v, r));
        n = compute_order(&sc[r], ops);
        n_un = compute_order(&un, ops_un);
        split_order(ops, n, f1, f1 + 2 * m * v);
        split_order(ops_un, n_un, f2, f2 + 2 * m * v);
        if (n != n_un || memcmp(f1, f2, sizeof(int) * 4 * m * v) != 0) {
            dsk_test_fail_at(__FILE__, __LINE__, "%s rank %d: forwards or backwards out of the unpaired order", what,
                             r);
            ok = 0;
        }
        if (res.in_flight[r] > bound || sc[r].in_flight != bound || !sc[r].paired) {
            dsk_test_fail_at(__FILE__, __LINE__, "%s rank %d: %d chunks in flight, bound %d, schedule says %d", what, r,
                             res.in_flight[r], bound, sc[r].in_flight);
            ok = 0;
        }
        for (int i = 0; i < sc[r].n; i++) fused += sc[r].actions[i].kind == DSK_PAR_FORWARD_BACKWARD;
        if (kind == DSK_PAR_1F1B && fused != m - w) {
            dsk_test_fail_at(__FILE__, __LINE__, "%s rank %d: %d pairs, want %d", what, r, fused, m - w);
            ok = 0;
        }
        *pairs += fused;
        dsk_par_schedule_free(&un);
    }
out:
    free(ops);
    free(ops_un);
    free(f1);
    free(f2);
    for (int r = 0; r < p; r++) dsk_par_schedule_free(&sc[r]);
    return ok;
}

static void test_schedules_property(void) {
    int n = 0, bad = 0, pairs = 0;
    for (int p = 1; p <= 8; p++)
        for (int m = 1; m <= 12; m++) {
            bad += !check_schedule(DSK_PAR_GPIPE, p, m, 1);
            bad += !check_schedule(DSK_PAR_1F1B, p, m, 1);
            bad += !check_paired(DSK_PAR_GPIPE, p, m, 1, &pairs);
            bad += !check_paired(DSK_PAR_1F1B, p, m, 1, &pairs);
            n += 4;
        }
    for (int p = 1; p <= 6; p++)
        for (int v = 1; v <= 4; v++)
            for (int k = 1; k <= 4; k++) {
                bad += !check_schedule(DSK_PAR_INTERLEAVED, p, k * p, v);
                bad += !check_paired(DSK_PAR_INTERLEAVED, p, k * p, v, &pairs);
                n += 2;
            }
    for (int p = 1; p <= 6; p++)
        for (int m = 2 * p; m <= 4 * p + 2; m++) {
            bad += !check_schedule(DSK_PAR_DUALPIPE_V, p, m, 2);
            bad += !check_paired(DSK_PAR_DUALPIPE_V, p, m, 2, &pairs);
            n += 2;
        }
    printf("     %d configurations checked (half of them paired, %d pairs), %d failed\n", n, pairs, bad);
}

/* The checker must catch what it claims to: rank 0's adjacent "send activation, receive
   gradient" swapped in a valid 1F1B list deadlocks (both ranks wait to receive); a send moved
   before the computation that produces it is caught too. */
static void test_schedule_checker_catches_faults(void) {
    dsk_par_schedule sc[2];
    int swapped = 0;
    sim_result res;
    DSK_TEST_OK(dsk_par_schedule_init(&sc[0], DSK_PAR_1F1B, 2, 4, 1, 0));
    DSK_TEST_OK(dsk_par_schedule_init(&sc[1], DSK_PAR_1F1B, 2, 4, 1, 1));
    res = simulate(sc, 2, 4, 1, "valid 1f1b", 0);
    DSK_TEST_EXPECT(res.ok, "the valid lists fail");
    for (int i = 0; i + 1 < sc[0].n && !swapped; i++)
        if (sc[0].actions[i].kind == DSK_PAR_SEND_ACT && sc[0].actions[i + 1].kind == DSK_PAR_RECV_GRAD) {
            dsk_par_action t = sc[0].actions[i];
            sc[0].actions[i] = sc[0].actions[i + 1];
            sc[0].actions[i + 1] = t;
            swapped = 1;
        }
    DSK_TEST_EXPECT(swapped, "rank 0 has no send of an activation followed by a receive of a gradient");
    res = simulate(sc, 2, 4, 1, "swapped 1f1b", 1);
    DSK_TEST_EXPECT(!res.ok && strstr(res.why, "deadlock"), "swapped lists: %s", res.ok ? "passed" : res.why);
    dsk_par_schedule_free(&sc[0]);
    DSK_TEST_OK(dsk_par_schedule_init(&sc[0], DSK_PAR_1F1B, 2, 4, 1, 0));
    /* rank 0 list starts forward 0, send activation 0: put the send first */
    DSK_TEST_EXPECT(sc[0].actions[0].kind == DSK_PAR_FORWARD && sc[0].actions[1].kind == DSK_PAR_SEND_ACT,
                    "list start");
    {
        dsk_par_action t = sc[0].actions[0];
        sc[0].actions[0] = sc[0].actions[1];
        sc[0].actions[1] = t;
    }
    res = simulate(sc, 2, 4, 1, "early send", 1);
    DSK_TEST_EXPECT(!res.ok && strstr(res.why, "before computing it"), "early send: %s", res.ok ? "passed" : res.why);
    dsk_par_schedule_free(&sc[0]);
    dsk_par_schedule_free(&sc[1]);
}

static void test_schedule_shapes(void) {
    dsk_par_schedule s;
    dsk_par_schedule_kind k;
    int nf = 0, nb = 0, ns = 0, nr = 0;
    /* 1F1B, 4 stages, 8 micro-batches, rank 1: 2 warm-up forwards, then alternating */
    DSK_TEST_OK(dsk_par_schedule_init(&s, DSK_PAR_1F1B, 4, 8, 1, 1));
    for (int i = 0; i < s.n; i++) {
        const dsk_par_action *a = &s.actions[i];
        nf += a->kind == DSK_PAR_FORWARD;
        nb += a->kind == DSK_PAR_BACKWARD;
        ns += a->kind == DSK_PAR_SEND_ACT || a->kind == DSK_PAR_SEND_GRAD;
        nr += a->kind == DSK_PAR_RECV_ACT || a->kind == DSK_PAR_RECV_GRAD;
        if (a->kind == DSK_PAR_SEND_ACT || a->kind == DSK_PAR_RECV_GRAD)
            DSK_TEST_EXPECT(a->peer == 2, "peer %d", a->peer);
        if (a->kind == DSK_PAR_SEND_GRAD || a->kind == DSK_PAR_RECV_ACT)
            DSK_TEST_EXPECT(a->peer == 0, "peer %d", a->peer);
    }
    DSK_TEST_EXPECT(nf == 8 && nb == 8 && ns == 16 && nr == 16, "%d F %d B %d sends %d receives", nf, nb, ns, nr);
    {
        int seen = 0, order[16], j = 0;
        for (int i = 0; i < s.n && j < 16; i++)
            if (s.actions[i].kind <= DSK_PAR_BACKWARD) order[j++] = s.actions[i].kind == DSK_PAR_FORWARD ? 1 : -1;
        /* F F F B F B ... : three forwards (2 warm-up + the first steady one) before the first backward */
        for (int i = 0; i < 3; i++) seen += order[i] == 1;
        DSK_TEST_EXPECT(seen == 3 && order[3] == -1 && order[4] == 1 && order[5] == -1,
                        "order starts %d %d %d %d %d %d", order[0], order[1], order[2], order[3], order[4], order[5]);
    }
    DSK_TEST_EXPECT(s.in_flight == 3 && fabs(s.bubble - 3.0 / 8.0) < 1e-15, "in flight %d bubble %g", s.in_flight,
                    s.bubble);
    dsk_par_schedule_free(&s);
    dsk_par_schedule_free(&s); /* freed twice is fine */
    DSK_TEST_EXPECT(fabs(dsk_par_bubble_fraction(DSK_PAR_INTERLEAVED, 4, 8, 2) - 3.0 / 16.0) < 1e-15, "interleaved");
    DSK_TEST_OK(dsk_par_schedule_parse("interleaved", &k));
    DSK_TEST_EXPECT(k == DSK_PAR_INTERLEAVED, "parse");
    DSK_TEST_OK(dsk_par_schedule_parse("gpipe", &k));
    DSK_TEST_EXPECT(k == DSK_PAR_GPIPE, "parse");
}

/* When the last of p ranks ended its list (pos[r] actions run, at clock[r]); -1 if one stopped before its end. */
static double lists_end(const dsk_par_schedule *sc, int p, const int *pos, const double *clock) {
    double step = 0;
    for (int r = 0; r < p; r++) {
        if (pos[r] != sc[r].n) return -1;
        step = fmax(step, clock[r]);
    }
    return step;
}

/* The step under every rank's action list (the library's lists, read here) as the executor runs them: in order,
   the global stage s's forward and backward taking fwd[s] and bwd[s] seconds (a pair their sum), a send waiting
   for its receiver to reach the receive, both then leaving at the later of the two plus link. Written apart from
   dsk_par_schedule_time, over the public lists; -1 if the lists stop. */
static double timed_lists(const dsk_par_schedule *sc, int p, const double *fwd, const double *bwd, double link) {
    int moved = 1, pos[16] = {0};
    double clock[16] = {0};
    while (moved) {
        moved = 0;
        for (int r = 0; r < p; r++) {
            const dsk_par_action *a = pos[r] < sc[r].n ? &sc[r].actions[pos[r]] : NULL;
            if (!a) continue;
            if (a->kind == DSK_PAR_FORWARD) clock[r] += fwd[a->stage];
            else if (a->kind == DSK_PAR_BACKWARD) clock[r] += bwd[a->stage];
            else if (a->kind == DSK_PAR_FORWARD_BACKWARD) clock[r] += fwd[a->stage] + bwd[a->bwd_stage];
            else if (a->kind == DSK_PAR_SEND_ACT || a->kind == DSK_PAR_SEND_GRAD) {
                int q = a->peer;
                const dsk_par_action *b = pos[q] < sc[q].n ? &sc[q].actions[pos[q]] : NULL;
                if (!b || b->peer != r || (b->kind != DSK_PAR_RECV_ACT && b->kind != DSK_PAR_RECV_GRAD)) continue;
                clock[r] = clock[q] = fmax(clock[r], clock[q]) + link;
                pos[q]++;
            } else continue;
            pos[r]++;
            moved = 1;
        }
    }
    return lists_end(sc, p, pos, clock);
}

/* The same with the receives ahead (DSK_PAR_TRANSFERS_AHEAD): a send stamps its message's landing at its sender's
   clock plus link and moves on; a receive costs nothing; a computation starts once the messages it reads (a forward's
   activation off stage 0, a backward's gradient off the last stage, when p > 1) have landed. */
static double timed_lists_ahead(const dsk_par_schedule *sc, int p, int m, int v, const double *fwd, const double *bwd,
                                double link) {
    int moved = 1, pos[16] = {0}, S = p * v;
    double clock[16] = {0}, act[64][64], grad[64][64];
    for (int s = 0; s < S; s++)
        for (int i = 0; i < m; i++) act[s][i] = grad[s][i] = -1;
    while (moved) {
        moved = 0;
        for (int r = 0; r < p; r++) {
            const dsk_par_action *a = pos[r] < sc[r].n ? &sc[r].actions[pos[r]] : NULL;
            double start = clock[r];
            int fwd_in, bwd_in, bs, bm;
            if (!a) continue;
            bs = a->kind == DSK_PAR_FORWARD_BACKWARD ? a->bwd_stage : a->stage;
            bm = a->kind == DSK_PAR_FORWARD_BACKWARD ? a->bwd_micro : a->micro;
            /* inputs from other ranks: not a local hand-over (p = 1, DualPipeV's turn) */
            fwd_in = (a->kind == DSK_PAR_FORWARD || a->kind == DSK_PAR_FORWARD_BACKWARD) && a->stage > 0 &&
                     owner(a->stage - 1, p, sc[0].kind) != r;
            bwd_in = (a->kind == DSK_PAR_BACKWARD || a->kind == DSK_PAR_FORWARD_BACKWARD) && bs < S - 1 &&
                     owner(bs + 1, p, sc[0].kind) != r;
            if (a->kind == DSK_PAR_SEND_ACT) act[a->stage + 1][a->micro] = clock[r] + link;
            else if (a->kind == DSK_PAR_SEND_GRAD) grad[a->stage - 1][a->micro] = clock[r] + link;
            else if (a->kind != DSK_PAR_RECV_ACT && a->kind != DSK_PAR_RECV_GRAD) {
                if ((fwd_in && act[a->stage][a->micro] < 0) || (bwd_in && grad[bs][bm] < 0)) continue;
                if (fwd_in) start = fmax(start, act[a->stage][a->micro]);
                if (bwd_in) start = fmax(start, grad[bs][bm]);
                clock[r] = start + (a->kind != DSK_PAR_BACKWARD ? fwd[a->stage] : 0) +
                           (a->kind != DSK_PAR_FORWARD ? bwd[bs] : 0);
            }
            pos[r]++;
            moved = 1;
        }
    }
    return lists_end(sc, p, pos, clock);
}

/* dsk_par_schedule_time, both transfers: equal stages give the bubble formula's step; random unequal stages and
   links the step of the lists timed above (DualPipeV's paired lists: at most p units over the unpaired formula,
   as its pairs wait for both inputs); backward twice the forward: the bubble formula for GPipe and 1F1B both
   ways, for the interleaved lists only with the receives ahead (in order they stall: 121 units against 99 at p
   2, m 16, v 2); a two-stage 1F1B by hand (a heavy last stage idles the first less than (p - 1) / m of the
   heaviest says); bad input. */
static void test_schedule_time(void) {
    static const struct {
        dsk_par_schedule_kind kind;
        int p, m, v;
    } cases[] = {
        {DSK_PAR_GPIPE, 1, 3, 1},       {DSK_PAR_GPIPE, 4, 6, 1},       {DSK_PAR_1F1B, 2, 2, 1},
        {DSK_PAR_1F1B, 4, 8, 1},        {DSK_PAR_1F1B, 8, 5, 1},        {DSK_PAR_1F1B, 3, 7, 1},
        {DSK_PAR_INTERLEAVED, 2, 4, 2}, {DSK_PAR_INTERLEAVED, 4, 8, 2}, {DSK_PAR_INTERLEAVED, 4, 4, 3},
        {DSK_PAR_INTERLEAVED, 3, 9, 4}, {DSK_PAR_DUALPIPE_V, 1, 2, 2},  {DSK_PAR_DUALPIPE_V, 2, 4, 2},
        {DSK_PAR_DUALPIPE_V, 3, 7, 2},  {DSK_PAR_DUALPIPE_V, 4, 8, 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        for (int paired = 0; paired < 2; paired++)
            for (int t = 0; t < 2; t++) {
                dsk_par_transfers tr = t ? DSK_PAR_TRANSFERS_AHEAD : DSK_PAR_TRANSFERS_IN_ORDER;
                const char *how = t ? "ahead" : "in order";
                int p = cases[i].p, m = cases[i].m, v = cases[i].v, S = p * v;
                double fwd[64], bwd[64], step, want, got;
                dsk_par_schedule sc[16];
                if (paired && cases[i].kind == DSK_PAR_GPIPE) continue; /* GPipe has no pairs */
                for (int s = 0; s < S; s++) fwd[s] = 1.0, bwd[s] = 1.0;
                DSK_TEST_OK(dsk_par_schedule_time(cases[i].kind, p, m, v, paired, tr, fwd, bwd, 0.0, &step));
                want = (1 + dsk_par_bubble_fraction(cases[i].kind, p, m, v)) * m * v * 2.0;
                if (paired && cases[i].kind == DSK_PAR_DUALPIPE_V && p > 1 && step >= want - 1e-9)
                    want = step <= want + p ? step : want + p; /* its pairs wait for both inputs: at most p units */
                DSK_TEST_EXPECT(fabs(step - want) < 1e-9,
                                "%s p %d m %d v %d paired %d %s: equal stages %.9g s, formula %.9g",
                                dsk_par_schedule_name(cases[i].kind), p, m, v, paired, how, step, want);
                /* in order, the interleaved lists stall when b > f; DualPipeV's turn is not the formula's */
                if (v == 1 || (t && !paired && cases[i].kind == DSK_PAR_INTERLEAVED)) {
                    for (int s = 0; s < S; s++) fwd[s] = 0.5, bwd[s] = 1.0;
                    DSK_TEST_OK(dsk_par_schedule_time(cases[i].kind, p, m, v, paired, tr, fwd, bwd, 0.0, &step));
                    want = (1 + dsk_par_bubble_fraction(cases[i].kind, p, m, v)) * m * v * 1.5;
                    DSK_TEST_EXPECT(fabs(step - want) < 1e-9,
                                    "%s p %d m %d v %d paired %d %s: backward twice the forward: %.9g s, "
                                    "formula %.9g",
                                    dsk_par_schedule_name(cases[i].kind), p, m, v, paired, how, step, want);
                }
                if (!build_lists(sc, cases[i].kind, p, m, v, paired, "timed")) continue;
                for (int round = 0; round < 3; round++) {
                    double link = round == 0 ? 0.0 : dsk_test_rand(0.0, 0.5);
                    for (int s = 0; s < S; s++) fwd[s] = dsk_test_rand(0.1, 2.0), bwd[s] = dsk_test_rand(0.2, 4.0);
                    DSK_TEST_OK(dsk_par_schedule_time(cases[i].kind, p, m, v, paired, tr, fwd, bwd, link, &got));
                    want = t ? timed_lists_ahead(sc, p, m, v, fwd, bwd, link) : timed_lists(sc, p, fwd, bwd, link);
                    DSK_TEST_EXPECT(want > 0 && fabs(got - want) <= 1e-12 * want,
                                    "%s p %d m %d v %d paired %d %s link %g: %.12g s, the lists' %.12g s",
                                    dsk_par_schedule_name(cases[i].kind), p, m, v, paired, how, link, got, want);
                }
                for (int r = 0; r < p; r++) dsk_par_schedule_free(&sc[r]);
            }
    {
        /* the stall the receives ahead remove: f 1, b 2 on equal stages, in order against the formula */
        static const int pmv[3][3] = {{2, 16, 2}, {4, 8, 2}, {2, 4, 2}};
        for (int i = 0; i < 3; i++) {
            int p = pmv[i][0], m = pmv[i][1], v = pmv[i][2];
            double f[8], b[8], in_order, ahead,
                formula = (1 + dsk_par_bubble_fraction(DSK_PAR_INTERLEAVED, p, m, v)) * m * v * 3;
            for (int s = 0; s < p * v; s++) f[s] = 1, b[s] = 2;
            DSK_TEST_OK(dsk_par_schedule_time(DSK_PAR_INTERLEAVED, p, m, v, 0, DSK_PAR_TRANSFERS_IN_ORDER, f, b, 0.0,
                                              &in_order));
            DSK_TEST_OK(
                dsk_par_schedule_time(DSK_PAR_INTERLEAVED, p, m, v, 0, DSK_PAR_TRANSFERS_AHEAD, f, b, 0.0, &ahead));
            DSK_TEST_EXPECT(ahead == formula && in_order > formula,
                            "interleaved p %d m %d v %d, f 1 b 2: in order %g, ahead %g, formula %g", p, m, v, in_order,
                            ahead, formula);
        }
    }
    {
        /* p 2, m 2, 1F1B; stage 0: f 1, b 2; stage 1: f 3, b 6. Lists: rank 0 F0 >a0 F1 >a1 <g0 B0 <g1 B1, rank 1
           <a0 F0 <a1 B0 >g0 F1 B1 >g1. Rank 0: F0 [0,1], a0 at 1, F1 [1,2], a1 waits for rank 1's F0 until 4,
           B0 [10,12], B1 [19,21]; rank 1: F0 [1,4], B0 [4,10], F1 [10,13], B1 [13,19]. With a link of 0.5: a0
           at 1.5, rank 1 F0 [1.5,4.5], a1 at 5, B0 [5,11], g0 at 11.5, F1 [11.5,14.5], B1 [14.5,20.5], g1 at 21,
           rank 0 B1 [21,23]. */
        double f[2] = {1, 3}, b[2] = {2, 6}, step;
        DSK_TEST_OK(dsk_par_schedule_time(DSK_PAR_1F1B, 2, 2, 1, 0, DSK_PAR_TRANSFERS_IN_ORDER, f, b, 0.0, &step));
        DSK_TEST_EXPECT(step == 21.0, "by hand: %g, want 21 (the heaviest stage's 18 plus (p - 1) / m of it: 27)",
                        step);
        DSK_TEST_OK(dsk_par_schedule_time(DSK_PAR_1F1B, 2, 2, 1, 0, DSK_PAR_TRANSFERS_IN_ORDER, f, b, 0.5, &step));
        DSK_TEST_EXPECT(step == 23.0, "by hand with a link of 0.5: %g, want 23", step);
    }
    {
        double f[4] = {1, 1, 1, 1}, b[4] = {1, -1, 1, 1}, step = -7;
        DSK_TEST_STATUS(dsk_par_schedule_time(DSK_PAR_1F1B, 4, 8, 1, 0, DSK_PAR_TRANSFERS_IN_ORDER, f, b, 0.0, &step),
                        DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("stage 1 of 4: forward 1 s, backward -1 s");
        b[1] = NAN;
        DSK_TEST_STATUS(dsk_par_schedule_time(DSK_PAR_1F1B, 4, 8, 1, 0, DSK_PAR_TRANSFERS_IN_ORDER, f, b, 0.0, &step),
                        DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("backward nan s");
        b[1] = 1;
        DSK_TEST_STATUS(dsk_par_schedule_time(DSK_PAR_1F1B, 4, 8, 1, 0, DSK_PAR_TRANSFERS_IN_ORDER, f, b, -0.1, &step),
                        DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("link_s -0.1");
        DSK_TEST_STATUS(
            dsk_par_schedule_time(DSK_PAR_INTERLEAVED, 2, 3, 2, 0, DSK_PAR_TRANSFERS_IN_ORDER, f, b, 0.0, &step),
            DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("not a multiple of the 2 stages");
        DSK_TEST_STATUS(
            dsk_par_schedule_time(DSK_PAR_1F1B, 4, 8, 1, 0, DSK_PAR_TRANSFERS_IN_ORDER, NULL, b, 0.0, &step),
            DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("is NULL");
        DSK_TEST_STATUS(dsk_par_schedule_time(DSK_PAR_1F1B, 4, 8, 1, 0, (dsk_par_transfers)2, f, b, 0.0, &step),
                        DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("unknown transfers 2");
        DSK_TEST_EXPECT(step == -7, "a refused call wrote %g", step);
    }
}

static void test_schedule_errors(void) {
    dsk_par_schedule s;
    dsk_par_schedule_kind k;
    DSK_TEST_STATUS(dsk_par_schedule_init(&s, DSK_PAR_GPIPE, 2, 4, 2, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("one chunk per rank");
    DSK_TEST_STATUS(dsk_par_schedule_init(&s, DSK_PAR_INTERLEAVED, 4, 6, 2, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("6 micro-batches is not a multiple of the 4 stages");
    DSK_TEST_STATUS(dsk_par_schedule_init(&s, DSK_PAR_1F1B, 4, 8, 1, 4), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("rank 4");
    DSK_TEST_STATUS(dsk_par_schedule_init(&s, DSK_PAR_1F1B, 4, 0, 1, 0), DSK_ERR_ARG);
    DSK_TEST_STATUS(dsk_par_schedule_init(&s, (dsk_par_schedule_kind)7, 4, 4, 1, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("unknown schedule 7");
    DSK_TEST_STATUS(dsk_par_schedule_init_paired(&s, DSK_PAR_INTERLEAVED, 4, 6, 2, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_par_schedule_init_paired: interleaved schedule with 2 chunks: 6 micro-batches");
    DSK_TEST_EXPECT(s.actions == NULL && s.n == 0, "failed init leaves the schedule zeroed");
    DSK_TEST_STATUS(dsk_par_schedule_init(&s, DSK_PAR_DUALPIPE_V, 3, 5, 2, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("at least 2 micro-batches a stage (3 stages: 6 or more, not 5)");
    DSK_TEST_STATUS(dsk_par_schedule_init_paired(&s, DSK_PAR_DUALPIPE_V, 2, 8, 1, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dualpipev runs 2 chunks a rank (not 1)");
    DSK_TEST_EXPECT(dsk_par_in_flight_bound(DSK_PAR_DUALPIPE_V, 2, 3, 2, 0) == -1, "dualpipev, m 3 < 2 p: -1");
    DSK_TEST_STATUS(dsk_par_schedule_parse("zb", &k), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("\"zb\" is not a schedule");
    DSK_TEST_OK(dsk_par_schedule_parse("dualpipev", &k));
    DSK_TEST_EXPECT(k == DSK_PAR_DUALPIPE_V && strcmp(dsk_par_schedule_name(k), "dualpipev") == 0, "dualpipev: %d", k);
    /* the V's stage map, both ways: chunk 0 down the ranks, chunk 1 back up */
    for (int r = 0; r < 4; r++) {
        DSK_TEST_EXPECT(dsk_par_stage(DSK_PAR_DUALPIPE_V, 4, 0, r) == r &&
                            dsk_par_stage(DSK_PAR_DUALPIPE_V, 4, 1, r) == 7 - r,
                        "dualpipev rank %d: stages %d %d", r, dsk_par_stage(DSK_PAR_DUALPIPE_V, 4, 0, r),
                        dsk_par_stage(DSK_PAR_DUALPIPE_V, 4, 1, r));
        DSK_TEST_EXPECT(dsk_par_stage(DSK_PAR_INTERLEAVED, 4, 1, r) == 4 + r, "interleaved rank %d", r);
    }
    DSK_TEST_EXPECT(
        dsk_par_stage(DSK_PAR_DUALPIPE_V, 4, 2, 0) == -1 && dsk_par_stage(DSK_PAR_1F1B, 4, 0, 4) == -1 &&
            dsk_par_stage(DSK_PAR_1F1B, 0, 0, 0) == -1 && dsk_par_stage((dsk_par_schedule_kind)9, 4, 0, 0) == -1 &&
            dsk_par_stage_rank(DSK_PAR_DUALPIPE_V, 4, 8) == -1 && dsk_par_stage_rank(DSK_PAR_1F1B, 4, -1) == -1,
        "a chunk, rank or stage out of range gives -1");
    for (int st = 0; st < 8; st++)
        DSK_TEST_EXPECT(
            dsk_par_stage(DSK_PAR_DUALPIPE_V, 4, st / 4, dsk_par_stage_rank(DSK_PAR_DUALPIPE_V, 4, st)) == st &&
                dsk_par_stage(DSK_PAR_INTERLEAVED, 4, st / 4, dsk_par_stage_rank(DSK_PAR_INTERLEAVED, 4, st)) == st,
            "stage %d: its rank's chunk does not hold it", st);
    DSK_TEST_EXPECT(dsk_par_in_flight_bound(DSK_PAR_1F1B, 2, 2, 1, 5) == -1, "bad rank gives -1");
}

/* ------------------------------------------------------------------ the rank grid */

static void rank_grid(dsk_comm *world, void *arg) {
    const dsk_par_dims *want = (const dsk_par_dims *)arg;
    dsk_par_grid g;
    dsk_par_dims d = *want;
    dsk_comm *groups[5];
    const char *names[5] = {"tp", "dp", "pp", "ep", "edp"};
    DSK_TEST_OK(dsk_par_grid_init(&g, world, &d));
    if (!g.tp.impl) return;
    groups[0] = &g.tp; groups[1] = &g.dp; groups[2] = &g.pp; groups[3] = &g.ep; groups[4] = &g.edp;
    DSK_TEST_EXPECT(g.at.tp == world->rank % d.tp, "tp coordinate %d", g.at.tp);
    DSK_TEST_EXPECT(dsk_par_rank_of(&g.dims, g.at.tp, g.at.dp, g.at.pp) == world->rank, "rank_of");
    DSK_TEST_EXPECT(g.tp.rank == g.at.tp && g.dp.rank == g.at.dp && g.pp.rank == g.at.pp && g.ep.rank == g.at.ep &&
                    g.edp.rank == g.at.edp, "group ranks differ from the coordinates");
    /* each group's members, gathered in group-rank order, are the ranks the formula names */
    for (int k = 0; k < 5; k++) {
        int32_t me = world->rank, got[8];
        int n = groups[k]->world_size;
        DSK_TEST_OK(dsk_comm_all_gather(groups[k], NULL, &me, got, 1, DSK_I32));
        for (int i = 0; i < n; i++) {
            dsk_par_coords a = g.at;
            int want_rank;
            if (k == 0) a.tp = i;
            if (k == 1) a.dp = i;
            if (k == 2) a.pp = i;
            if (k == 3) a.dp = i + g.dims.ep * a.edp;
            if (k == 4) a.dp = a.ep + g.dims.ep * i;
            want_rank = dsk_par_rank_of(&g.dims, a.tp, a.dp, a.pp);
            DSK_TEST_EXPECT(got[i] == want_rank, "%s group of rank %d: member %d is rank %d, want %d", names[k],
                            world->rank, i, (int)got[i], want_rank);
        }
    }
    dsk_par_grid_free(&g);
    dsk_par_grid_free(&g);
}

static void test_grid(void) {
    dsk_par_dims d;
    dsk_par_coords a;
    memset(&d, 0, sizeof d);
    d.tp = 2; d.pp = 2; d.ep = 2;
    DSK_TEST_OK(dsk_par_dims_resolve(&d, 8));
    DSK_TEST_EXPECT(d.dp == 2, "dp %d", d.dp);
    DSK_TEST_OK(dsk_par_coords_of(&d, 7, &a));
    DSK_TEST_EXPECT(a.tp == 1 && a.dp == 1 && a.pp == 1 && a.ep == 1 && a.edp == 0, "coords of 7");
    DSK_TEST_OK(dsk_par_coords_of(&d, 2, &a));
    DSK_TEST_EXPECT(a.tp == 0 && a.dp == 1 && a.pp == 0, "coords of 2: tp %d dp %d pp %d", a.tp, a.dp, a.pp);
    expect_ranks_ok(8, rank_grid, &d);
    memset(&d, 0, sizeof d);
    d.tp = 1; d.pp = 2; d.ep = 2;
    expect_ranks_ok(8, rank_grid, &d); /* dp 4 = ep 2 x edp 2 */
}

static void test_grid_errors(void) {
    dsk_par_dims d;
    memset(&d, 0, sizeof d);
    d.tp = 3;
    DSK_TEST_STATUS(dsk_par_dims_resolve(&d, 8), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("does not divide the world size 8");
    memset(&d, 0, sizeof d);
    d.tp = 2; d.ep = 3;
    DSK_TEST_STATUS(dsk_par_dims_resolve(&d, 8), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("ep 3 does not divide dp 4");
    memset(&d, 0, sizeof d);
    d.tp = 2; d.ep = 3;
    DSK_TEST_OK(dsk_par_dims_resolve(&d, 6)); /* dp 3, ep 3 */
    DSK_TEST_EXPECT(d.dp == 3 && d.pp == 1, "dp %d pp %d", d.dp, d.pp);
    memset(&d, 0, sizeof d);
    d.tp = 2; d.dp = 2; d.pp = 3;
    DSK_TEST_STATUS(dsk_par_dims_resolve(&d, 8), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("12 ranks, the world has 8");
    memset(&d, 0, sizeof d);
    d.tp = 2; d.ep = 4;
    DSK_TEST_STATUS(dsk_par_dims_resolve(&d, 4), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("ep 4 does not divide dp 2");
}

/* ------------------------------------------------------------------ mappings */

/* Checks every mapping, forward and backward, on a (B, T, D) tensor split along dim. */
static void rank_maps(dsk_comm *c, void *arg) {
    int n = c->world_size, r = c->rank, dim = *(int *)arg;
    int64_t full[3] = {3, 4, 5}, small[3] = {3, 4, 5};
    int64_t nf, ns, inner = 1, len;
    full[dim] *= n;
    nf = full[0] * full[1] * full[2];
    ns = nf / n;
    for (int i = dim + 1; i < 3; i++) inner *= full[i];
    len = small[dim];
    float *big = falloc(nf), *sm = falloc(ns), *out = falloc(nf), *blk = falloc(nf);
    double *want = dalloc(nf);
    dsk_tensor tb, ts, to, tsm;
    dsk_tensor_wrap(&tb, big, DSK_F32, dsk_cpu(), 3, full);
    dsk_tensor_wrap(&ts, sm, DSK_F32, dsk_cpu(), 3, small);
    /* block b of a full tensor along dim, element j of the small shape -> full index */
#define FULL_INDEX(b, j) (((j) / (len * inner)) * (n * len * inner) + (b) * len * inner + (j) % (len * inner))
    /* GATHER forward = concatenation of every rank's block; SCATTER backward, SPLIT backward too */
    gen(sm, ns, 100 + (uint64_t)r);
    for (int b = 0; b < n; b++)
        for (int64_t j = 0; j < ns; j++) want[FULL_INDEX(b, j)] = gen1(100 + (uint64_t)b, j);
    for (int k = 0; k < 3; k++) {
        dsk_par_map map = k == 0 ? DSK_PAR_MAP_GATHER : k == 1 ? DSK_PAR_MAP_SCATTER : DSK_PAR_MAP_SPLIT;
        dsk_test_poison_f32(out, nf);
        dsk_tensor_wrap(&to, out, DSK_F32, dsk_cpu(), 3, full);
        if (k == 0) DSK_TEST_OK(dsk_par_map_forward(c, NULL, map, dim, &to, &ts));
        else DSK_TEST_OK(dsk_par_map_backward(c, NULL, map, dim, &to, &ts));
        DSK_TEST_CLOSE(out, want, nf, 0, 0, dsk_par_map_name(map));
    }
    /* GATHER backward and SCATTER forward: this rank's block of the sum over ranks */
    gen(big, nf, 200 + (uint64_t)r);
    for (int64_t j = 0; j < ns; j++) {
        double s = 0;
        for (int q = 0; q < n; q++) s += gen1(200 + (uint64_t)q, FULL_INDEX(r, j));
        want[j] = s;
    }
    for (int k = 0; k < 2; k++) {
        dsk_test_poison_f32(out, ns);
        dsk_tensor_wrap(&tsm, out, DSK_F32, dsk_cpu(), 3, small);
        if (k == 0) DSK_TEST_OK(dsk_par_map_forward(c, NULL, DSK_PAR_MAP_SCATTER, dim, &tsm, &tb));
        else DSK_TEST_OK(dsk_par_map_backward(c, NULL, DSK_PAR_MAP_GATHER, dim, &tsm, &tb));
        DSK_TEST_CLOSE(out, want, ns, 1e-6, 1e-7, k ? "gather backward" : "scatter forward");
    }
    /* SPLIT forward: this rank's block, exactly */
    for (int64_t j = 0; j < ns; j++) want[j] = big[FULL_INDEX(r, j)];
    dsk_test_poison_f32(out, ns);
    DSK_TEST_OK(dsk_par_map_forward(c, NULL, DSK_PAR_MAP_SPLIT, dim, &tsm, &tb));
    DSK_TEST_CLOSE(out, want, ns, 0, 0, "split forward");
    /* COPY backward and REDUCE forward: the sum; COPY forward and REDUCE backward: identity */
    for (int64_t j = 0; j < nf; j++) {
        double s = 0;
        for (int q = 0; q < n; q++) s += gen1(200 + (uint64_t)q, j);
        want[j] = s;
    }
    for (int k = 0; k < 2; k++) {
        dsk_test_poison_f32(out, nf);
        dsk_tensor_wrap(&to, out, DSK_F32, dsk_cpu(), 3, full);
        if (k == 0) DSK_TEST_OK(dsk_par_map_forward(c, NULL, DSK_PAR_MAP_REDUCE, dim, &to, &tb));
        else DSK_TEST_OK(dsk_par_map_backward(c, NULL, DSK_PAR_MAP_COPY, dim, &to, &tb));
        DSK_TEST_CLOSE(out, want, nf, 1e-6, 1e-7, k ? "copy backward" : "reduce forward");
    }
    memcpy(blk, big, (size_t)nf * sizeof(float)); /* in place */
    dsk_tensor_wrap(&to, blk, DSK_F32, dsk_cpu(), 3, full);
    DSK_TEST_OK(dsk_par_map_forward(c, NULL, DSK_PAR_MAP_REDUCE, dim, &to, &to));
    DSK_TEST_CLOSE(blk, want, nf, 1e-6, 1e-7, "reduce forward in place");
    for (int k = 0; k < 2; k++) {
        dsk_test_poison_f32(out, nf);
        dsk_tensor_wrap(&to, out, DSK_F32, dsk_cpu(), 3, full);
        if (k == 0) DSK_TEST_OK(dsk_par_map_forward(c, NULL, DSK_PAR_MAP_COPY, dim, &to, &tb));
        else DSK_TEST_OK(dsk_par_map_backward(c, NULL, DSK_PAR_MAP_REDUCE, dim, &to, &tb));
        DSK_TEST_SAME_BYTES(out, big, (size_t)nf * sizeof(float), k ? "reduce backward" : "copy forward");
    }
    /* errors: wrong block shape, bad dim, unknown mapping; no collective is entered */
    DSK_TEST_STATUS(dsk_par_map_forward(c, NULL, DSK_PAR_MAP_GATHER, dim, &tb, &tb), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_par_map_forward");
    DSK_TEST_STATUS(dsk_par_map_forward(c, NULL, DSK_PAR_MAP_SPLIT, 3, &ts, &tb), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dim 3 outside");
    DSK_TEST_STATUS(dsk_par_map_backward(c, NULL, (dsk_par_map)9, dim, &tb, &tb), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("unknown mapping 9");
#undef FULL_INDEX
    free(big); free(sm); free(out); free(blk); free(want);
}

static void test_maps(void) {
    int dims[2] = {0, 1};
    for (int n = 2; n <= 4; n += 2)
        for (int k = 0; k < 2; k++) {
            dsk_test_begin("mappings on %d ranks along dim %d (copy, reduce, gather, scatter, split)", n, dims[k]);
            expect_ranks_ok(n, rank_maps, &dims[k]);
        }
}

/* ------------------------------------------------------------------ parallel linears */

typedef struct lin_case { int sp; int64_t N, K, O; } lin_case;

/* C (M, N) = A (M, K) B^T (N, K) in f64 from f32. */
static void ref_abt(double *C, const float *A, const float *B, int64_t M, int64_t N, int64_t K) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double s = 0;
            for (int64_t k = 0; k < K; k++) s += (double)A[i * K + k] * B[j * K + k];
            C[i * N + j] = s;
        }
}

/* Column-parallel pair (two weights sharing X, like gate and up) then row-parallel, against the
   one-rank f64 products: outputs, input gradients and this rank's weight-gradient shards. */
static void rank_linears(dsk_comm *c, void *arg) {
    const lin_case *lc = (const lin_case *)arg;
    int n = c->world_size, r = c->rank, sp = lc->sp;
    int64_t N = lc->N, K = lc->K, O = lc->O, Ol = O / n, Nl = N / n, Nx = sp ? Nl : N;
    /* full tensors (every rank builds them) */
    float *X = falloc(N * K), *W1 = falloc(O * K), *W3 = falloc(O * K), *dY1 = falloc(N * O), *dY3 = falloc(N * O);
    float *W2 = falloc(K * O), *dZ = falloc(N * K);
    double *ref = dalloc(N * O > N * K ? N * O : N * K), *refb = dalloc(O * K);
    /* this rank's shards */
    float *w1 = falloc(Ol * K), *w3 = falloc(Ol * K), *w2 = falloc(K * Ol), *x = falloc(Nx * K), *xg = falloc(N * K);
    float *y1 = falloc(N * Ol), *y3 = falloc(N * Ol), *dy1 = falloc(N * Ol), *dy3 = falloc(N * Ol);
    float *dx = falloc(Nx * K);
    float *dxg = falloc(N * K), *dw1 = falloc(Ol * K), *dw3 = falloc(Ol * K), *dw2 = falloc(K * Ol);
    float *z = falloc(Nx * K), *zp = falloc(N * K), *dz = falloc(Nx * K), *dzg = falloc(N * K), *a = falloc(N * Ol);
    float *da = falloc(N * Ol);
    gen(X, N * K, 1); gen(W1, O * K, 2); gen(W3, O * K, 3); gen(dY1, N * O, 4); gen(dY3, N * O, 5);
    gen(W2, K * O, 6); gen(dZ, N * K, 7);
    for (int64_t i = 0; i < Ol * K; i++) { w1[i] = W1[r * Ol * K + i]; w3[i] = W3[r * Ol * K + i]; }
    for (int64_t i = 0; i < K; i++)
        for (int64_t j = 0; j < Ol; j++) w2[i * Ol + j] = W2[i * O + r * Ol + j];
    for (int64_t i = 0; i < Nx * K; i++) x[i] = X[(sp ? r * Nl * K : 0) + i];
    for (int64_t i = 0; i < N; i++)
        for (int64_t j = 0; j < Ol; j++) {
            dy1[i * Ol + j] = dY1[i * O + r * Ol + j];
            dy3[i * Ol + j] = dY3[i * O + r * Ol + j];
        }
    dsk_tensor tX = wrap2(x, Nx, K), tXg = wrap2(xg, N, K), tW1 = wrap2(w1, Ol, K), tW3 = wrap2(w3, Ol, K);
    dsk_tensor tY1 = wrap2(y1, N, Ol), tY3 = wrap2(y3, N, Ol), tdY1 = wrap2(dy1, N, Ol), tdY3 = wrap2(dy3, N, Ol);
    dsk_tensor tdX = wrap2(dx, Nx, K), tdXg = wrap2(dxg, N, K), tdW1 = wrap2(dw1, Ol, K), tdW3 = wrap2(dw3, Ol, K);
    dsk_tensor *Ys[2] = {&tY1, &tY3}, *dWs[2] = {&tdW1, &tdW3};
    const dsk_tensor *Ws[2] = {&tW1, &tW3}, *dYs[2] = {&tdY1, &tdY3};
    /* column forward: Y_i = X W_i^T, columns [r Ol, (r+1) Ol) of the full product */
    dsk_test_poison_f32(y1, N * Ol);
    dsk_test_poison_f32(y3, N * Ol);
    DSK_TEST_OK(dsk_par_column_forward(c, NULL, 2, Ys, Ws, &tX, sp ? &tXg : NULL));
    ref_abt(ref, X, W1 + r * Ol * K, N, Ol, K);
    DSK_TEST_CLOSE(y1, ref, N * Ol, 1e-5, 1e-6, "column forward Y1");
    ref_abt(ref, X, W3 + r * Ol * K, N, Ol, K);
    DSK_TEST_CLOSE(y3, ref, N * Ol, 1e-5, 1e-6, "column forward Y3");
    /* column backward: dX = dY1 W1 + dY3 W3 over the full width; dW_i shard += dY_i^T X */
    dsk_test_poison_f32(dx, Nx * K);
    for (int64_t i = 0; i < Ol * K; i++) { dw1[i] = 0.5f; dw3[i] = -0.25f; } /* accumulated into */
    DSK_TEST_OK(dsk_par_column_backward(c, NULL, 2, &tdX, sp ? &tdXg : NULL, dWs, dYs, Ws, sp ? &tXg : &tX));
    for (int64_t i = 0; i < Nx; i++)
        for (int64_t k = 0; k < K; k++) {
            double s = 0;
            int64_t row = (sp ? r * Nl : 0) + i;
            for (int64_t o = 0; o < O; o++)
                s += (double)dY1[row * O + o] * W1[o * K + k] + (double)dY3[row * O + o] * W3[o * K + k];
            ref[i * K + k] = s;
        }
    DSK_TEST_CLOSE(dx, ref, Nx * K, 1e-5, 1e-6, "column backward dX");
    for (int w = 0; w < 2; w++) {
        const float *dY = w ? dY3 : dY1;
        for (int64_t o = 0; o < Ol; o++)
            for (int64_t k = 0; k < K; k++) {
                double s = w ? -0.25 : 0.5;
                for (int64_t i = 0; i < N; i++) s += (double)dY[i * O + r * Ol + o] * X[i * K + k];
                refb[o * K + k] = s;
            }
        DSK_TEST_CLOSE(w ? dw3 : dw1, refb, Ol * K, 1e-5, 1e-6, w ? "column backward dW3" : "column backward dW1");
    }
    /* row forward: Z = A W2^T summed over ranks, A (N, Ol) = this rank's columns of A_full = Y1 */
    memcpy(a, y1, (size_t)(N * Ol) * sizeof(float));
    {
        dsk_tensor tA = wrap2(a, N, Ol), tW2 = wrap2(w2, K, Ol), tZ = wrap2(z, Nx, K), tZp = wrap2(zp, N, K);
        dsk_tensor tdZ = wrap2(dz, Nx, K), tdZg = wrap2(dzg, N, K), tdA = wrap2(da, N, Ol), tdW2 = wrap2(dw2, K, Ol);
        float *Afull = falloc(N * O);
        /* A_full from the exact column-forward reference, rounded to f32 as each rank holds it */
        for (int q = 0; q < n; q++) {
            ref_abt(ref, X, W1 + q * Ol * K, N, Ol, K);
            for (int64_t i = 0; i < N; i++)
                for (int64_t j = 0; j < Ol; j++) Afull[i * O + q * Ol + j] = (float)ref[i * Ol + j];
        }
        for (int64_t i = 0; i < N; i++)
            for (int64_t j = 0; j < Ol; j++) a[i * Ol + j] = Afull[i * O + r * Ol + j]; /* the same on every rank */
        dsk_test_poison_f32(z, Nx * K);
        DSK_TEST_OK(dsk_par_row_forward(c, NULL, &tZ, sp ? &tZp : NULL, &tA, &tW2));
        ref_abt(ref, Afull, W2, N, K, O);
        DSK_TEST_CLOSE(z, ref + (sp ? r * Nl * K : 0), Nx * K, 1e-5, 1e-6, "row forward Z");
        /* row backward: dA = dZ_full W2 shard; dW2 shard += dZ_full^T A shard */
        for (int64_t i = 0; i < Nx * K; i++) dz[i] = dZ[(sp ? r * Nl * K : 0) + i];
        for (int64_t i = 0; i < K * Ol; i++) dw2[i] = 0.125f;
        dsk_test_poison_f32(da, N * Ol);
        DSK_TEST_OK(dsk_par_row_backward(c, NULL, &tdA, &tdW2, &tdZ, sp ? &tdZg : NULL, &tA, &tW2));
        for (int64_t i = 0; i < N; i++)
            for (int64_t j = 0; j < Ol; j++) {
                double s = 0;
                for (int64_t k = 0; k < K; k++) s += (double)dZ[i * K + k] * W2[k * O + r * Ol + j];
                ref[i * Ol + j] = s;
            }
        DSK_TEST_CLOSE(da, ref, N * Ol, 1e-5, 1e-6, "row backward dA");
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < Ol; j++) {
                double s = 0.125;
                for (int64_t i = 0; i < N; i++) s += (double)dZ[i * K + k] * Afull[i * O + r * Ol + j];
                refb[k * Ol + j] = s;
            }
        DSK_TEST_CLOSE(dw2, refb, K * Ol, 1e-5, 1e-6, "row backward dW2");
        /* errors: a weight of the wrong width, scratch of the wrong size */
        DSK_TEST_STATUS(dsk_par_row_forward(c, NULL, &tZ, sp ? &tZp : NULL, &tA, &tW1), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_par_row_forward: W");
        DSK_TEST_STATUS(dsk_par_column_forward(c, NULL, 1, Ys, Ws, &tX, &tX), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("xg");
        DSK_TEST_STATUS(dsk_par_column_forward(c, NULL, 0, Ys, Ws, &tX, NULL), DSK_ERR_ARG);
        free(Afull);
    }
    free(X); free(W1); free(W3); free(dY1); free(dY3); free(W2); free(dZ); free(ref); free(refb);
    free(w1); free(w3); free(w2); free(x); free(xg); free(y1); free(y3); free(dy1); free(dy3); free(dx); free(dxg);
    free(dw1); free(dw3); free(dw2); free(z); free(zp); free(dz); free(dzg); free(a); free(da);
}

static void test_linears(void) {
    for (int n = 2; n <= 4; n += 2)
        for (int sp = 0; sp < 2; sp++) {
            lin_case lc;
            lc.sp = sp;
            lc.N = 12;
            lc.K = 7;
            lc.O = 4 * 5;
            dsk_test_begin("column (2 weights) and row-parallel linears on %d ranks%s", n,
                           sp ? ", sequence parallel" : "");
            expect_ranks_ok(n, rank_linears, &lc);
        }
}

/* ------------------------------------------------------------------ vocabulary parallelism */

typedef struct vocab_case { int sp; int64_t N, V, D; } vocab_case;

static void rank_vocab(dsk_comm *c, void *arg) {
    const vocab_case *vc = (const vocab_case *)arg;
    int n = c->world_size, r = c->rank, sp = vc->sp;
    int64_t N = vc->N, V = vc->V, D = vc->D, Vl = V / n, Nl = N / n, No = sp ? Nl : N;
    float *table = falloc(V * D), *dout = falloc(N * D), *logits = falloc(N * V);
    float *tl = falloc(Vl * D), *out = falloc(No * D), *part = falloc(N * D), *dtl = falloc(Vl * D);
    float *dl = falloc(N * Vl), *ll = falloc(N * Vl), *loss1 = falloc(1), *dfull = falloc(N * V), loss = NAN;
    double *ref = dalloc(N * V);
    int32_t *ids = (int32_t *)malloc((size_t)N * sizeof(int32_t)), *tg = (int32_t *)malloc((size_t)N * sizeof(int32_t));
    int64_t shN = N, sh0 = 0;
    dsk_tensor tids, ttg, tT = wrap2(tl, Vl, D), tO = wrap2(out, No, D), tP = wrap2(part, N, D);
    dsk_tensor tdT = wrap2(dtl, Vl, D);
    dsk_tensor tD, tL = wrap2(ll, N, Vl), tdL = wrap2(dl, N, Vl), tloss, tfull = wrap2(logits, N, V), tdfull;
    gen(table, V * D, 11);
    gen(dout, N * D, 12);
    gen(logits, N * V, 13);
    for (int64_t i = 0; i < N * V; i++) logits[i] *= 6.0f; /* spread, so the max matters */
    for (int64_t t = 0; t < N; t++) {
        ids[t] = (int32_t)(dsk_test_mix64(dsk_test_g.seed + 31 * (uint64_t)t) % (uint64_t)V);
        tg[t] = t % 5 == 3 ? -1 : (int32_t)(dsk_test_mix64(dsk_test_g.seed + 77 * (uint64_t)t) % (uint64_t)V);
    }
    ids[0] = 0;
    ids[1] = (int32_t)(V - 1); /* both ends of the vocabulary */
    tg[0] = (int32_t)(V - 1);
    dsk_tensor_wrap(&tids, ids, DSK_I32, dsk_cpu(), 1, &shN);
    dsk_tensor_wrap(&ttg, tg, DSK_I32, dsk_cpu(), 1, &shN);
    dsk_tensor_wrap(&tloss, &loss, DSK_F32, dsk_cpu(), 0, &sh0);
    memcpy(tl, table + r * Vl * D, (size_t)(Vl * D) * sizeof(float));
    /* embedding forward: exactly the full table's rows (one rank contributes each row) */
    for (int64_t t = 0; t < No; t++)
        for (int64_t j = 0; j < D; j++) ref[t * D + j] = table[(int64_t)ids[(sp ? r * Nl : 0) + t] * D + j];
    dsk_test_poison_f32(out, No * D);
    DSK_TEST_OK(dsk_par_embedding_forward(c, NULL, &tO, sp ? &tP : NULL, &tT, &tids));
    DSK_TEST_CLOSE(out, ref, No * D, 0, 0, "embedding forward");
    /* embedding backward: dtable shard += sum of the full dout rows at the ids in it */
    for (int64_t i = 0; i < Vl * D; i++) { dtl[i] = 0.5f; ref[i] = 0.5; }
    for (int64_t t = 0; t < N; t++)
        if (ids[t] >= r * Vl && ids[t] < (r + 1) * Vl)
            for (int64_t j = 0; j < D; j++) ref[(ids[t] - r * Vl) * D + j] += dout[t * D + j];
    memcpy(part, dout + (sp ? r * Nl * D : 0), (size_t)(No * D) * sizeof(float));
    tD = wrap2(part, No, D);
    {
        float *dg = falloc(N * D);
        dsk_tensor tdg = wrap2(dg, N, D);
        DSK_TEST_OK(dsk_par_embedding_backward(c, NULL, &tdT, &tD, sp ? &tdg : NULL, &tids));
        DSK_TEST_CLOSE(dtl, ref, Vl * D, 1e-6, 1e-7, "embedding backward");
        free(dg);
    }
    /* cross-entropy: f64 reference from the full logits, and dsk_cross_entropy on one rank */
    {
        double total = 0;
        int64_t count = 0;
        for (int64_t t = 0; t < N; t++) count += tg[t] != -1;
        for (int64_t t = 0; t < N; t++) {
            double mx = -INFINITY, s = 0;
            for (int64_t j = 0; j < V; j++) mx = fmax(mx, logits[t * V + j]);
            for (int64_t j = 0; j < V; j++) s += exp(logits[t * V + j] - mx);
            for (int64_t j = 0; j < Vl; j++) {
                double p = tg[t] == -1 ? 0 : exp(logits[t * V + r * Vl + j] - mx) / s - (r * Vl + j == tg[t]);
                ref[t * Vl + j] = 0.75 * p / (double)count;
            }
            if (tg[t] != -1) total += mx + log(s) - logits[t * V + tg[t]];
        }
        for (int64_t t = 0; t < N; t++) memcpy(ll + t * Vl, logits + t * V + r * Vl, (size_t)Vl * sizeof(float));
        dsk_test_poison_f32(dl, N * Vl);
        DSK_TEST_OK(dsk_par_cross_entropy(c, NULL, &tloss, &tdL, &tL, &ttg, -1, 0.75f));
        DSK_TEST_CLOSE(dl, ref, N * Vl, 1e-5, 1e-9, "vocab-parallel dlogits");
        ref[0] = total / (double)count;
        DSK_TEST_CLOSE(&loss, ref, 1, 1e-6, 0, "vocab-parallel loss");
        /* against one rank's dsk_cross_entropy of the full logits */
        dsk_tensor_wrap(&tdfull, dfull, DSK_F32, dsk_cpu(), 2, tfull.shape);
        dsk_tensor_wrap(&tloss, loss1, DSK_F32, dsk_cpu(), 0, &sh0);
        DSK_TEST_OK(dsk_cross_entropy(NULL, &tloss, &tdfull, &tfull, &ttg, -1, 0.75f));
        ref[0] = *loss1;
        DSK_TEST_CLOSE(&loss, ref, 1, 2e-7, 0, "vocab-parallel loss vs dsk_cross_entropy");
        for (int64_t t = 0; t < N; t++)
            for (int64_t j = 0; j < Vl; j++) ref[t * Vl + j] = dfull[t * V + r * Vl + j];
        DSK_TEST_CLOSE(dl, ref, N * Vl, 1e-6, 1e-9, "vocab-parallel dlogits vs dsk_cross_entropy");
        dsk_tensor_wrap(&tloss, &loss, DSK_F32, dsk_cpu(), 0, &sh0);
        /* errors, all before any collective: a target past the full vocabulary, an id too */
        tg[2] = (int32_t)V;
        DSK_TEST_STATUS(dsk_par_cross_entropy(c, NULL, &tloss, &tdL, &tL, &ttg, -1, 1.0f), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("targets[2]");
        ids[3] = (int32_t)V;
        DSK_TEST_STATUS(dsk_par_embedding_forward(c, NULL, &tO, sp ? &tP : NULL, &tT, &tids), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("ids[3]");
    }
    free(table); free(dout); free(logits); free(tl); free(out); free(part); free(dtl); free(dl); free(ll);
    free(loss1); free(dfull); free(ref); free(ids); free(tg);
}

static void test_vocab(void) {
    for (int n = 2; n <= 4; n += 2)
        for (int sp = 0; sp < 2; sp++) {
            vocab_case vc;
            vc.sp = sp;
            vc.N = 12;
            vc.V = 4 * 9;
            vc.D = 5;
            dsk_test_begin("vocabulary-parallel embedding and cross-entropy on %d ranks%s", n,
                           sp ? ", sequence parallel" : "");
            expect_ranks_ok(n, rank_vocab, &vc);
        }
}

static void test_one_rank_is_plain(void) {
    /* tp NULL: the mappings copy, the cross-entropy is dsk_cross_entropy's */
    float lg[3 * 4], d1[12], d2[12], l1 = NAN, l2 = NAN;
    int32_t tg[3] = {1, -1, 3};
    int64_t sh0 = 0, s3 = 3;
    dsk_tensor L = wrap2(lg, 3, 4), D1 = wrap2(d1, 3, 4), D2 = wrap2(d2, 3, 4), T, o1, o2, out = wrap2(d2, 3, 4);
    gen(lg, 12, 41);
    dsk_tensor_wrap(&T, tg, DSK_I32, dsk_cpu(), 1, &s3);
    dsk_tensor_wrap(&o1, &l1, DSK_F32, dsk_cpu(), 0, &sh0);
    dsk_tensor_wrap(&o2, &l2, DSK_F32, dsk_cpu(), 0, &sh0);
    DSK_TEST_OK(dsk_cross_entropy(NULL, &o1, &D1, &L, &T, -1, 1.0f));
    DSK_TEST_OK(dsk_par_cross_entropy(NULL, NULL, &o2, &D2, &L, &T, -1, 1.0f));
    DSK_TEST_SAME_BYTES(&l1, &l2, sizeof l1, "loss");
    DSK_TEST_SAME_BYTES(d1, d2, sizeof d1, "dlogits");
    DSK_TEST_OK(dsk_par_map_forward(NULL, NULL, DSK_PAR_MAP_GATHER, 0, &out, &L));
    DSK_TEST_SAME_BYTES(d2, lg, sizeof d2, "gather on one rank copies");
}

/* ------------------------------------------------------------------ a rank killed inside a pipeline send */

#define KILL_ELEMS (8 << 20) /* 32 MB messages: a send takes long enough to be cut */

typedef struct pipe_state {
    dsk_comm *c;
    float *buf;
    volatile int armed;
} pipe_state;

static dsk_status pipe_compute(void *user, int micro, int chunk) {
    (void)user; (void)micro; (void)chunk;
    return DSK_OK;
}

static void sleep_us(long us) {
    struct timespec ts = {0, us * 1000};
    nanosleep(&ts, NULL);
}

/* The victim's watcher: once its send has moved a few MB, the process dies. */
static void *pipe_killer(void *arg) {
    pipe_state *ps = (pipe_state *)arg;
    volatile uint64_t *sent = &ps->c->stats.bytes_sent;
    uint64_t start;
    while (!ps->armed) sleep_us(100);
    start = *sent;
    for (int i = 0; i < 200000 && *sent < start + (2u << 20); i++) sleep_us(10);
    raise(SIGKILL);
    return NULL;
}

static dsk_status pipe_buffer(void *user, const dsk_par_action *a, dsk_tensor *t) {
    pipe_state *ps = (pipe_state *)user;
    int64_t n = KILL_ELEMS;
    if (ps->c->rank == 1 && a->kind == DSK_PAR_SEND_ACT && a->micro == 1) ps->armed = 1;
    return dsk_tensor_wrap(t, ps->buf, DSK_F32, dsk_cpu(), 1, &n);
}

static void rank_pipe_kill(dsk_comm *c, void *arg) {
    pipe_state ps;
    dsk_par_schedule s;
    dsk_par_stage_fns fns;
    pthread_t th;
    double t0;
    dsk_status st;
    (void)arg;
    memset(&ps, 0, sizeof ps);
    ps.c = c;
    ps.buf = falloc(KILL_ELEMS);
    gen(ps.buf, KILL_ELEMS, 9);
    memset(&fns, 0, sizeof fns);
    fns.user = &ps;
    fns.forward = pipe_compute;
    fns.backward = pipe_compute;
    fns.buffer = pipe_buffer;
    DSK_TEST_OK(dsk_par_schedule_init(&s, DSK_PAR_1F1B, 3, 4, 1, c->rank));
    if (c->rank == 1) pthread_create(&th, NULL, pipe_killer, &ps);
    t0 = dsk_test_now();
    st = dsk_par_pipeline_run(&s, c, NULL, &fns);
    /* only the survivors get here */
    DSK_TEST_EXPECT(st == DSK_ERR_PEER, "rank %d: %s: %s", c->rank, dsk_status_str(st), dsk_last_error());
    DSK_TEST_EXPECT(strstr(dsk_last_error(), "rank 1") != NULL, "rank %d: error does not name rank 1: %s", c->rank,
                    dsk_last_error());
    DSK_TEST_EXPECT(strstr(dsk_last_error(), "dsk_par_pipeline_run: pipeline rank") != NULL, "rank %d: %s", c->rank,
                    dsk_last_error());
    DSK_TEST_EXPECT(dsk_test_now() - t0 < 10, "rank %d took %.1f s to see the failure", c->rank, dsk_test_now() - t0);
    printf("     rank %d: %s\n", c->rank, dsk_last_error());
    dsk_par_schedule_free(&s);
    free(ps.buf);
}

static void test_pipeline_rank_killed(void) {
    int status[3];
    run_ranks(3, rank_pipe_kill, NULL, 30, 60, status);
    DSK_TEST_EXPECT(status[1] == 128 + SIGKILL, "victim exited %d", status[1]);
    DSK_TEST_EXPECT(status[0] == 0 && status[2] == 0, "survivors exited %d and %d", status[0], status[2]);
}

/* A pipeline that runs to the end moves every message: each one carries values made from
   (activation or gradient, micro-batch, the stage it leaves), checked by the computation that
   consumes it. */
typedef struct pipe_ok {
    dsk_comm *c;
    int p, m, v;
    int64_t len; /* floats a message */
    float *slot; /* [4][m][v][len]: received activations, sent ones, received gradients, sent ones */
    float *want; /* [len] */
    int pairs;   /* forward_backward calls */
    int slow;    /* this rank sleeps 20 ms in each computation */
    int vshape;  /* DualPipeV: chunk 1 holds stage 2 p - 1 - rank */
    unsigned char *begun; /* [2][m][v]: a receive of (activation or gradient, micro, chunk) was begun */
    int ahead;            /* computations that ran while a receive begun before them was still in flight */
} pipe_ok;

static uint64_t msg_tag(int grad, int micro, int from_stage) {
    return 1000 + (uint64_t)grad * 500 + (uint64_t)micro * 20 + (uint64_t)from_stage;
}

static float *ok_slot(pipe_ok *ps, int kind, int micro, int chunk) {
    return ps->slot + (((size_t)kind * ps->m + (size_t)micro) * ps->v + (size_t)chunk) * (size_t)ps->len;
}

static dsk_status ok_buffer(void *user, const dsk_par_action *a, dsk_tensor *t) {
    pipe_ok *ps = (pipe_ok *)user;
    int64_t n = ps->len;
    int grad = a->kind == DSK_PAR_SEND_GRAD || a->kind == DSK_PAR_RECV_GRAD;
    int is_send = a->kind == DSK_PAR_SEND_ACT || a->kind == DSK_PAR_SEND_GRAD;
    float *b = ok_slot(ps, 2 * grad + is_send, a->micro, a->chunk);
    if (is_send) gen(b, n, msg_tag(grad, a->micro, a->stage));
    else {
        dsk_test_poison_f32(b, n);
        ps->begun[((size_t)grad * ps->m + (size_t)a->micro) * ps->v + (size_t)a->chunk] = 1;
    }
    return dsk_tensor_wrap(t, b, DSK_F32, dsk_cpu(), 1, &n);
}

/* At the start of a computation: whether a receive begun earlier still waits for its message (its buffer all
   NaN; a message is never NaN); the slow rank sleeps. */
static void ok_computing(pipe_ok *ps) {
    int stalled = 0;
    for (int g = 0; g < 2; g++)
        for (int mi = 0; mi < ps->m; mi++)
            for (int c = 0; c < ps->v; c++) {
                const float *b = ok_slot(ps, 2 * g, mi, c);
                int in_flight = ps->begun[((size_t)g * ps->m + (size_t)mi) * ps->v + (size_t)c];
                for (int i = 0; i < 64 && in_flight; i++) in_flight = b[i] != b[i];
                stalled |= in_flight;
            }
    ps->ahead += stalled;
    if (ps->slow) {
        struct timespec ts = {0, 20000000};
        nanosleep(&ts, NULL);
    }
}

/* The input of (micro, chunk) must hold what its sender put there. */
static dsk_status ok_check(pipe_ok *ps, int grad, int micro, int chunk) {
    int r = ps->c->rank, s = ps->vshape && chunk ? 2 * ps->p - 1 - r : chunk * ps->p + r, from = grad ? s + 1 : s - 1;
    if (from < 0 || from >= ps->p * ps->v) return DSK_OK;
    if (owner(from, ps->p, ps->vshape ? DSK_PAR_DUALPIPE_V : DSK_PAR_INTERLEAVED) == r) return DSK_OK; /* local */
    gen(ps->want, ps->len, msg_tag(grad, micro, from));
    if (memcmp(ps->want, ok_slot(ps, 2 * grad, micro, chunk), (size_t)ps->len * sizeof(float)) != 0)
        return dsk_set_error(DSK_ERR_CORRUPT, "%s of micro %d chunk %d holds the wrong message",
                             grad ? "gradient" : "activation", micro, chunk);
    return DSK_OK;
}

static dsk_status ok_forward(void *user, int micro, int chunk) {
    ok_computing((pipe_ok *)user);
    return ok_check((pipe_ok *)user, 0, micro, chunk);
}
static dsk_status ok_backward(void *user, int micro, int chunk) {
    ok_computing((pipe_ok *)user);
    return ok_check((pipe_ok *)user, 1, micro, chunk);
}
static dsk_status ok_pair(void *user, int micro, int chunk, int bwd_micro, int bwd_chunk) {
    pipe_ok *ps = (pipe_ok *)user;
    ps->pairs++;
    ok_computing(ps);
    DSK__TRY(ok_check(ps, 0, micro, chunk));
    return ok_check(ps, 1, bwd_micro, bwd_chunk);
}

static void rank_pipe_ok(dsk_comm *c, void *arg) {
    pipe_ok ps;
    dsk_par_schedule s;
    dsk_par_stage_fns fns;
    /* chunks; 0 unpaired, 1 paired, 2 paired with forward_backward; 1 + the rank that computes slowly, or 0;
       floats a message, 0: 64; 1: DualPipeV (2 chunks) */
    const int *how = (const int *)arg;
    int v = how[0], want = 0;
    dsk_par_schedule_kind kind = how[4] ? DSK_PAR_DUALPIPE_V : v > 1 ? DSK_PAR_INTERLEAVED : DSK_PAR_1F1B;
    memset(&ps, 0, sizeof ps);
    ps.c = c;
    ps.p = c->world_size;
    ps.m = 2 * c->world_size;
    ps.v = v;
    ps.slow = how[2] == c->rank + 1;
    ps.vshape = how[4];
    ps.len = how[3] ? how[3] : 64;
    ps.slot = falloc((int64_t)4 * ps.m * v * ps.len);
    ps.want = falloc(ps.len);
    ps.begun = (unsigned char *)calloc((size_t)2 * ps.m * v, 1);
    memset(&fns, 0, sizeof fns);
    fns.user = &ps;
    fns.forward = ok_forward;
    fns.backward = ok_backward;
    fns.buffer = ok_buffer;
    if (how[1] == 2) fns.forward_backward = ok_pair;
    if (how[1]) DSK_TEST_OK(dsk_par_schedule_init_paired(&s, kind, ps.p, ps.m, v, c->rank));
    else DSK_TEST_OK(dsk_par_schedule_init(&s, kind, ps.p, ps.m, v, c->rank));
    DSK_TEST_OK(dsk_par_pipeline_run(&s, c, NULL, &fns));
    for (int i = 0; i < s.n && how[1] == 2; i++) want += s.actions[i].kind == DSK_PAR_FORWARD_BACKWARD;
    DSK_TEST_EXPECT(ps.pairs == want, "rank %d: %d forward_backward calls, the list has %d", c->rank, ps.pairs, want);
    DSK_TEST_EXPECT(how[1] != 2 || c->rank > 0 || want > 0, "rank 0 has no pair to run");
    /* with the other rank slow, a fast one reaches receives long before their messages and computes past them when
       they fit the rings (their senders leave them there); larger ones it takes where the list has them */
    if (how[2] && !ps.slow) {
        int fits = (int64_t)sizeof(float) * ps.len <= dsk_comm_buffered_bytes(c, (c->rank + 1) % c->world_size);
        DSK_TEST_EXPECT(
            fits ? ps.ahead > 0 : ps.ahead == 0,
            "rank %d, messages of %lld bytes (%s the ring): %d computations with a begun receive unfinished", c->rank,
            (long long)(sizeof(float) * ps.len), fits ? "within" : "beyond", ps.ahead);
    }
    dsk_par_schedule_free(&s);
    free(ps.begun);
    free(ps.want);
    free(ps.slot);
}

static dsk_status no_buffer(void *user, const dsk_par_action *a, dsk_tensor *t);

/* A buffer callback that gives no memory fails its action on each rank, before any transfer. */
static void rank_pipe_no_buffer(dsk_comm *c, void *arg) {
    dsk_par_schedule s;
    dsk_par_stage_fns fns;
    (void)arg;
    memset(&fns, 0, sizeof fns);
    fns.forward = pipe_compute;
    fns.backward = pipe_compute;
    fns.buffer = no_buffer;
    DSK_TEST_OK(dsk_par_schedule_init(&s, DSK_PAR_1F1B, 2, 2, 1, c->rank));
    DSK_TEST_STATUS(dsk_par_pipeline_run(&s, c, NULL, &fns), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS(c->rank == 0 ? "send activation of micro-batch 0" : "receive activation of micro-batch 0");
    DSK_TEST_ERROR_MENTIONS("empty or non-contiguous");
    dsk_par_schedule_free(&s);
}

static void test_pipeline_runs(void) {
    int v1[5] = {1, 0, 0, 0, 0}, v2[5] = {2, 0, 0, 0, 0}, p1[5] = {1, 2, 0, 0, 0}, p2[5] = {2, 2, 0, 0, 0};
    int p0[5] = {2, 1, 0, 0, 0}, ahead[5] = {2, 0, 1, 0, 0}, large[5] = {2, 0, 0, 100003, 0};
    int large_slow[5] = {2, 0, 1, 100003, 0}, dv[5] = {2, 0, 0, 0, 1}, dv_pair[5] = {2, 2, 0, 0, 1};
    int dv_slow[5] = {2, 1, 2, 100003, 1};
    dsk_test_begin("pipeline executor: 1F1B on 4 ranks, to the end");
    expect_ranks_ok(4, rank_pipe_ok, v1);
    dsk_test_begin("pipeline executor: interleaved (2 chunks) on 3 ranks, to the end");
    expect_ranks_ok(3, rank_pipe_ok, v2);
    dsk_test_begin("pipeline executor: interleaved on 2 ranks, rank 0 slow: rank 1 computes past its receives");
    expect_ranks_ok(2, rank_pipe_ok, ahead);
    dsk_test_begin("pipeline executor: messages larger than a ring: interleaved on 3 ranks, and taken where listed");
    expect_ranks_ok(3, rank_pipe_ok, large);
    expect_ranks_ok(2, rank_pipe_ok, large_slow);
    dsk_test_begin("pipeline executor: paired 1F1B on 4 ranks, each pair's two inputs there");
    expect_ranks_ok(4, rank_pipe_ok, p1);
    dsk_test_begin("pipeline executor: paired interleaved on 3 ranks, pairs by forward_backward and without it");
    expect_ranks_ok(3, rank_pipe_ok, p2);
    expect_ranks_ok(3, rank_pipe_ok, p0);
    dsk_test_begin("pipeline executor: dualpipev (the V: chunk 1 back up the ranks) on 3 ranks, to the end");
    expect_ranks_ok(3, rank_pipe_ok, dv);
    expect_ranks_ok(1, rank_pipe_ok, dv);
    dsk_test_begin("pipeline executor: paired dualpipev on 4 ranks by forward_backward; on 2 ranks, rank 1 slow, "
                   "messages larger than a ring, pairs without it");
    expect_ranks_ok(4, rank_pipe_ok, dv_pair);
    expect_ranks_ok(2, rank_pipe_ok, dv_slow);
    dsk_test_begin("pipeline executor: a buffer callback without memory fails its action on 2 ranks");
    expect_ranks_ok(2, rank_pipe_no_buffer, NULL);
    dsk_test_end();
}

/* Argument errors that need no communicator (tp NULL: one rank), each named. */
static void test_argument_errors(void) {
    float a[24], b[24], l = NAN;
    int32_t ids[4] = {0, 1, 2, 3};
    int64_t s4 = 4, sh0 = 0;
    dsk_tensor A = wrap2(a, 4, 6), B = wrap2(b, 4, 6), At, I, L, Bh, Cu;
    dsk_par_dims d;
    dsk_par_coords at;
    gen(a, 24, 51);
    dsk_tensor_transpose(&A, 0, 1, &At);
    dsk_tensor_wrap(&I, ids, DSK_I32, dsk_cpu(), 1, &s4);
    dsk_tensor_wrap(&L, &l, DSK_F32, dsk_cpu(), 0, &sh0);
    /* mappings: a non-contiguous tensor, a dtype mismatch */
    DSK_TEST_STATUS(dsk_par_map_forward(NULL, NULL, DSK_PAR_MAP_COPY, 0, &B, &At), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("not contiguous");
    Bh = wrap2(b, 4, 6);
    Bh.dtype = DSK_BF16;
    DSK_TEST_STATUS(dsk_par_map_forward(NULL, NULL, DSK_PAR_MAP_COPY, 0, &Bh, &A), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("differ in dtype or device");
    /* embedding: ids of the wrong count */
    {
        float out[12];
        dsk_tensor O = wrap2(out, 2, 6);
        DSK_TEST_STATUS(dsk_par_embedding_forward(NULL, NULL, &O, NULL, &A, &I), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("must be 2 i32 values");
    }
    /* cross-entropy: loss not a scalar f32, dlogits of another shape, logits on a CUDA device */
    DSK_TEST_STATUS(dsk_par_cross_entropy(NULL, NULL, &A, NULL, &A, &I, -1, 1.0f), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("loss must be one f32 value");
    {
        float g[8];
        dsk_tensor G = wrap2(g, 4, 2);
        DSK_TEST_STATUS(dsk_par_cross_entropy(NULL, NULL, &L, &G, &A, &I, -1, 1.0f), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dlogits");
    }
    Cu = A;
    Cu.device.type = DSK_DEV_CUDA; /* only described, never read */
    DSK_TEST_STATUS(dsk_par_cross_entropy(NULL, NULL, &L, NULL, &Cu, &I, -1, 1.0f), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("targets and loss must be on one device");
#ifndef DSK_CUDA
    {
        dsk_tensor Ic = I, Lc = L;
        Ic.device.type = Lc.device.type = DSK_DEV_CUDA;
        DSK_TEST_STATUS(dsk_par_cross_entropy(NULL, NULL, &Lc, NULL, &Cu, &Ic, -1, 1.0f), DSK_ERR_UNSUPPORTED);
        DSK_TEST_ERROR_MENTIONS("in a build without DSK_CUDA");
    }
#endif
    /* grid: NULL dims, negative sizes, a rank outside */
    DSK_TEST_STATUS(dsk_par_dims_resolve(NULL, 4), DSK_ERR_ARG);
    memset(&d, 0, sizeof d);
    d.tp = -2;
    DSK_TEST_STATUS(dsk_par_dims_resolve(&d, 4), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("negative size");
    memset(&d, 0, sizeof d);
    DSK_TEST_OK(dsk_par_dims_resolve(&d, 4));
    DSK_TEST_STATUS(dsk_par_coords_of(&d, 4, &at), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("rank 4 outside [0, 4)");
    DSK_TEST_EXPECT(dsk_par_rank_of(&d, 0, 4, 0) == -1, "dp index 4 of 4");
    DSK_TEST_STATUS(dsk_par_grid_init(NULL, NULL, &d), DSK_ERR_ARG);
}

/* The executor names the action whose callback failed, after the callback's message. */
static dsk_status fail_backward(void *user, int micro, int chunk) {
    (void)user; (void)chunk;
    return micro == 2 ? dsk_set_error(DSK_ERR_NONFINITE, "model: loss of micro-batch %d is NaN", micro) : DSK_OK;
}

static dsk_status no_buffer(void *user, const dsk_par_action *a, dsk_tensor *t) {
    (void)user; (void)a;
    memset(t, 0, sizeof *t);
    return DSK_OK;
}

static void test_executor_errors(void) {
    dsk_par_schedule s, s2;
    dsk_par_stage_fns fns;
    memset(&fns, 0, sizeof fns);
    fns.forward = pipe_compute;
    fns.backward = fail_backward;
    fns.buffer = no_buffer;
    DSK_TEST_OK(dsk_par_schedule_init(&s, DSK_PAR_GPIPE, 1, 4, 1, 0));
    DSK_TEST_EXPECT(s.n == 8, "one stage: 4 forwards and 4 backwards, got %d actions", s.n);
    DSK_TEST_STATUS(dsk_par_pipeline_run(&s, NULL, NULL, &fns), DSK_ERR_NONFINITE);
    DSK_TEST_ERROR_MENTIONS("action 6 of 8 (backward of micro-batch 2, chunk 0, stage 0): model: loss of micro-batch 2 "
                            "is NaN");
    fns.backward = NULL;
    DSK_TEST_STATUS(dsk_par_pipeline_run(&s, NULL, NULL, &fns), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("callback is NULL");
    /* two stages need a communicator of two ranks */
    fns.backward = pipe_compute;
    DSK_TEST_OK(dsk_par_schedule_init(&s2, DSK_PAR_1F1B, 2, 2, 1, 0));
    DSK_TEST_STATUS(dsk_par_pipeline_run(&s2, NULL, NULL, &fns), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("the communicator rank -1 of 0");
    dsk_par_schedule_free(&s);
    dsk_par_schedule_free(&s2);
}

int main(void) {
    dsk_test_init("test_par");
    DSK_TEST_RUN(test_schedules_property);
    DSK_TEST_RUN(test_schedule_checker_catches_faults);
    DSK_TEST_RUN(test_schedule_shapes);
    DSK_TEST_RUN(test_schedule_errors);
    DSK_TEST_RUN(test_schedule_time);
    DSK_TEST_RUN(test_grid_errors);
    DSK_TEST_RUN(test_grid);
    DSK_TEST_RUN(test_one_rank_is_plain);
    DSK_TEST_RUN(test_argument_errors);
    DSK_TEST_RUN(test_executor_errors);
    test_maps();
    test_linears();
    test_vocab();
    test_pipeline_runs();
    DSK_TEST_RUN(test_pipeline_rank_killed);
    return dsk_test_finish();
}
