/* bench/bench_moe_ep.c - an expert-parallel MoE layer's forward + backward on forked CPU ranks (host backend:
   shared memory, or TCP between two emulated hosts with --two-hosts), exchanges serial against overlapped
   (dsk_moe_opts.ep_overlap) with and without chunked dispatch (ep_chunk), exact against bounded (ep_exchange),
   flat against two-hop routes (ep_route) and node-limited routing, FP8 dispatch serial and overlapped, and
   overlap across micro-batches: with "other work" (another micro-batch's q, k, v projections: a T x D x 3D
   GEMM) after the forward and after the backward, or between each call's begin and end (dsk_moe_forward_begin
   / _end, split), where it runs while the layer's rows travel, or half of it while the rows travel to the
   experts and half while their results travel back (dsk_moe_experts, dsk_moe_return_begin: in steps). Per
   variant, rank 0 prints the median step time, the time inside the layer's collectives (dsk_comm_stats.seconds:
   in serial runs the communication alone, as nothing runs beside it), the share of the serial run's
   communication the overlap hid, 1 - (step - compute) / communication with compute = serial step - serial
   communication, that is (serial step - overlapped step) / serial communication, and the bytes a step
   sent to the other node: the layer's count of its rows (dsk_moe_stats.bytes_off_node, exact) and what
   dsk_comm counted on the wire (headers and the counts exchange included).
   Warm-up 2 rounds, median of --repeats; each round one step of every variant in turn (the load, which
   drifts, weighs on all alike); a barrier before each step.
   Usage: bench_moe_ep [--ranks P] [--tokens T] [--repeats N] [--two-hosts] */
#define _POSIX_C_SOURCE 200809L
#define DSK_TENSOR_IMPLEMENTATION
#define DSK_COMM_IMPLEMENTATION
#define DSK_MOE_IMPLEMENTATION
#define DSK_AMP_IMPLEMENTATION
#include "dsk_comm.h"
#include "dsk_amp.h"
#include "dsk_moe.h"
#include "bench_util.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

typedef struct variant {
    const char *name;
    int serial, bounded, node_limit, two_hop, chunked, fp8; /* fp8: FP8 dispatch (e4m3 rows, 1x128 scales) */
    int work, split; /* work: other work after each call; split: between each call's begin and end (2: halves
                        beside each of its two exchanges) */
} variant;

static const variant variants[] = {
    {"exact, serial", 1, 0, 0, 0, 0, 0, 0, 0},
    {"exact, overlapped", 0, 0, 0, 0, 0, 0, 0, 0},
    {"exact, overlapped, chunked", 0, 0, 0, 0, 1, 0, 0, 0},
    {"bounded, serial", 1, 1, 0, 0, 0, 0, 0, 0},
    {"bounded, overlapped", 0, 1, 0, 0, 0, 0, 0, 0},
    {"bounded, overlapped, chunked", 0, 1, 0, 0, 1, 0, 0, 0},
    {"exact, overlapped, node-limited", 0, 0, 1, 0, 0, 0, 0, 0},
    {"exact, overlapped, chunked, node-limited", 0, 0, 1, 0, 1, 0, 0, 0},
    {"exact, serial, two-hop", 1, 0, 0, 1, 0, 0, 0, 0},
    {"exact, overlapped, two-hop", 0, 0, 0, 1, 0, 0, 0, 0},
    {"exact, overlapped, chunked, two-hop", 0, 0, 0, 1, 1, 0, 0, 0},
    {"exact, serial, FP8 dispatch", 1, 0, 0, 0, 0, 1, 0, 0},
    {"exact, overlapped, FP8 dispatch", 0, 0, 0, 0, 0, 1, 0, 0},
    {"exact, serial, two-hop, node-limited", 1, 0, 1, 1, 0, 0, 0, 0},
    {"exact, serial, + other work", 1, 0, 0, 0, 0, 0, 1, 0},
    {"exact, overlapped, + other work", 0, 0, 0, 0, 0, 0, 1, 0},
    {"exact, overlapped, other work split in", 0, 0, 0, 0, 0, 0, 1, 1},
    {"exact, overlapped, other work in steps", 0, 0, 0, 0, 0, 0, 1, 2},
};

#define NV (int)(sizeof variants / sizeof variants[0])

/* One variant's layer on this rank, its tensors and its per-round figures. */
typedef struct run {
    dsk_moe m;
    dsk_tensor x, y, dx, dy, vals, grads, wq, q; /* wq, q: the other work's weights (3D, D) and output (T, 3D) */
    double ts[64], cs[64], off_node[2]; /* off_node[0]: the layer's rows off the node a step, [1]: on the wire */
} run;

/* Builds variant v's layer and inputs on this rank. */
static int run_setup(dsk_comm *c, dsk_ctx *ctx, const variant *v, int T, run *r) {
    dsk_moe_opts o;
    int64_t sh[2], vb, gd, gs, ng;
    memset(r, 0, sizeof *r);
    memset(&o, 0, sizeof o);
    o.d_model = 256;
    o.n_routed = 16;
    o.top_k = 4;
    o.d_expert = 128;
    o.n_shared = 1;
    o.d_shared = 512;
    o.score = DSK_MOE_SIGMOID;
    o.routed_scale = 2.5f;
    o.init_std = 0.05f;
    o.seed = 5;
    o.ep = c;
    o.ep_overlap = !v->serial;
    o.ep_exchange = v->bounded ? DSK_MOE_EP_BOUNDED : DSK_MOE_EP_EXACT;
    o.node_limit = v->node_limit && c->n_nodes > 1 ? 1 : 0;
    o.ep_route = v->two_hop ? DSK_MOE_ROUTE_TWO_HOP : DSK_MOE_ROUTE_FLAT;
    o.ep_chunk = v->chunked ? DSK_MOE_CHUNK_ON : DSK_MOE_CHUNK_OFF;
    o.ep_dispatch = v->fp8 ? DSK_MOE_DISPATCH_FP8 : DSK_MOE_DISPATCH_ACT;
    if (dsk_moe_init(&r->m, ctx, &o) != DSK_OK) return 1;
    dsk_moe_slab_sizes(&r->m, &vb, &gd, &gs);
    ng = gd + gs;
    sh[0] = T;
    sh[1] = o.d_model;
    if (dsk_tensor_alloc(ctx, &r->vals, DSK_U8, 1, &vb) || dsk_tensor_alloc(ctx, &r->grads, DSK_F32, 1, &ng) ||
        dsk_moe_bind_slabs(&r->m, ctx, &r->vals, &r->grads) || dsk_moe_init_params(&r->m, ctx) ||
        dsk_tensor_alloc(ctx, &r->x, DSK_F32, 2, sh) || dsk_tensor_alloc(ctx, &r->y, DSK_F32, 2, sh) ||
        dsk_tensor_alloc(ctx, &r->dx, DSK_F32, 2, sh) || dsk_tensor_alloc(ctx, &r->dy, DSK_F32, 2, sh))
        return 2;
    sh[1] = 3 * o.d_model;
    if (dsk_tensor_alloc(ctx, &r->q, DSK_F32, 2, sh)) return 2;
    sh[0] = 3 * o.d_model;
    sh[1] = o.d_model;
    if (dsk_tensor_alloc(ctx, &r->wq, DSK_F32, 2, sh)) return 2;
    dsk_tensor_uniform(ctx, &r->wq, 7, 0, -1, 1);
    dsk_tensor_uniform(ctx, &r->x, 11 + (uint64_t)c->rank, 0, -1, 1);
    dsk_tensor_uniform(ctx, &r->dy, 99 + (uint64_t)c->rank, 0, -1, 1);
    return 0;
}

/* The other work on rows [lo, hi) of x: q = x Wq^T, another micro-batch's q, k, v projections. */
static int run_work_rows(dsk_ctx *ctx, run *r, int64_t lo, int64_t hi) {
    dsk_tensor q, x;
    return dsk_tensor_slice(&r->q, 0, lo, hi - lo, &q) != DSK_OK ||
           dsk_tensor_slice(&r->x, 0, lo, hi - lo, &x) != DSK_OK ||
           dsk_matmul(ctx, &q, &x, 0, &r->wq, 1, 1.0f, 0.0f) != DSK_OK;
}

static int run_work(dsk_ctx *ctx, run *r) { return run_work_rows(ctx, r, 0, r->x.shape[0]); }

/* The steps between a begun call's begin and end with the other work in halves beside its two exchanges. */
static int run_steps(dsk_ctx *ctx, run *r) {
    int64_t T = r->x.shape[0];
    return run_work_rows(ctx, r, 0, T / 2) || dsk_moe_experts(&r->m, ctx) || dsk_moe_return_begin(&r->m, ctx) ||
           run_work_rows(ctx, r, T / 2, T);
}

/* One timed step (forward + backward) of r's layer after a barrier; round i < 2 is warm-up. */
static int run_step(dsk_comm *c, dsk_ctx *ctx, const variant *v, run *r, int i) {
    dsk_comm_stats before;
    dsk_moe_stats st, col;
    double t0;
    if (dsk_comm_barrier(c, ctx)) return 3;
    before = c->stats;
    t0 = bench_now_s();
    if (v->split) {
        if (dsk_moe_forward_begin(&r->m, ctx, &r->x) || (v->split == 2 ? run_steps(ctx, r) : run_work(ctx, r)) ||
            dsk_moe_forward_end(&r->m, ctx, &r->y, &st) || dsk_moe_backward_begin(&r->m, ctx, &r->dy, 1.0f) ||
            (v->split == 2 ? run_steps(ctx, r) : run_work(ctx, r)) || dsk_moe_backward_end(&r->m, ctx, &r->dx))
            return 4;
    } else if (dsk_moe_forward(&r->m, ctx, &r->y, &r->x, &st) || (v->work && run_work(ctx, r)) ||
               dsk_moe_backward(&r->m, ctx, &r->dx, &r->dy, 1.0f) || (v->work && run_work(ctx, r))) {
        return 4;
    }
    t0 = bench_now_s() - t0;
    if (dsk_moe_stats_request(&r->m, ctx) || dsk_moe_stats_collect(&r->m, ctx, &col)) return 5; /* this step's */
    if (i < 2) return 0;
    r->ts[i - 2] = t0;
    r->cs[i - 2] = c->stats.seconds - before.seconds;
    r->off_node[1] = (double)(c->stats.bytes_sent_off_node - before.bytes_sent_off_node);
    r->off_node[0] = (double)col.bytes_off_node;
    return 0;
}

static void run_free(dsk_ctx *ctx, run *r) {
    dsk_moe_free(&r->m, ctx);
    dsk_tensor_free(ctx, &r->vals);
    dsk_tensor_free(ctx, &r->grads);
    dsk_tensor_free(ctx, &r->x);
    dsk_tensor_free(ctx, &r->y);
    dsk_tensor_free(ctx, &r->dx);
    dsk_tensor_free(ctx, &r->dy);
    dsk_tensor_free(ctx, &r->wq);
    dsk_tensor_free(ctx, &r->q);
}

/* Rank 0's line for variant v: median step and time in collectives, the share of the serial run's
   communication hidden (against the serial variant of the same exchange and route), the bytes off the node. */
static void report(const variant *v, run *r, const run *serial, int reps, int two_hosts) {
    double step = bench_median(r->ts, reps), comm = bench_median(r->cs, reps);
    printf("%-42s step %8.2f ms  in collectives %7.2f ms", v->name, 1e3 * step, 1e3 * comm);
    if (!v->serial && !v->node_limit && serial) {
        double ss[64], sc[64], s_step, s_comm;
        memcpy(ss, serial->ts, sizeof ss);
        memcpy(sc, serial->cs, sizeof sc);
        s_step = bench_median(ss, reps);
        s_comm = bench_median(sc, reps);
        if (s_comm > 0)
            printf("  hidden %5.1f%% of the serial run's %.2f ms", 100 * (s_step - step) / s_comm, 1e3 * s_comm);
    }
    if (two_hosts) printf("  off-node rows %.1f KiB/step (wire %.1f)", r->off_node[0] / 1024, r->off_node[1] / 1024);
    printf("\n");
}

/* Every variant's layer, then rounds of one step of each in turn (so that the machine's load, which drifts,
   weighs on all of them alike), then the medians. */
static int rank_main(int rank, int P, int port, int T, int reps, int two_hosts) {
    dsk_comm c;
    dsk_comm_opts co;
    dsk_ctx ctx;
    dsk_ctx_opts xo;
    run *runs;
    int rc = 0;
    memset(&co, 0, sizeof co);
    co.backend = DSK_COMM_HOST;
    co.master_addr = "127.0.0.1";
    co.master_port = port;
    co.timeout_s = 120;
    if (two_hosts) co.host_id = rank < P / 2 ? "bench-host-a" : "bench-host-b";
    memset(&xo, 0, sizeof xo);
    xo.n_threads = 1; /* P ranks share the machine's cores */
    if (dsk_comm_init(&c, rank, P, &co) || dsk_ctx_init(&ctx, &xo)) return 2;
    if (!(runs = (run *)calloc(NV, sizeof *runs))) return 2;
    for (int v = 0; v < NV && !rc; v++) rc = run_setup(&c, &ctx, &variants[v], T, &runs[v]);
    for (int i = 0; i < reps + 2 && !rc; i++)
        for (int v = 0; v < NV && !rc; v++) rc = run_step(&c, &ctx, &variants[v], &runs[v], i);
    if (rc) fprintf(stderr, "rank %d: step %d: %s\n", rank, rc, dsk_last_error());
    for (int v = 0; v < NV && rank == 0 && !rc; v++) {
        const run *serial = NULL;
        for (int s = 0; s < NV; s++)
            if (variants[s].serial && variants[s].bounded == variants[v].bounded &&
                variants[s].two_hop == variants[v].two_hop && variants[s].fp8 == variants[v].fp8 &&
                variants[s].work == variants[v].work && !variants[s].node_limit)
                serial = &runs[s];
        report(&variants[v], &runs[v], serial, reps, two_hosts);
    }
    fflush(stdout);
    for (int v = 0; v < NV; v++) run_free(&ctx, &runs[v]);
    free(runs);
    dsk_ctx_free(&ctx);
    dsk_comm_free(&c);
    return rc ? 3 : 0;
}

int main(int argc, char **argv) {
    int P = 4, T = 256, reps = 7, two_hosts = 0, port = 0, worst = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--ranks") && i + 1 < argc) P = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) T = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--repeats") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--two-hosts")) two_hosts = 1;
        else {
            fprintf(stderr, "usage: %s [--ranks P] [--tokens T] [--repeats N] [--two-hosts]\n", argv[0]);
            return 2;
        }
    }
    if (reps < 1 || reps > 64 || P < 2 || 16 % P) {
        fprintf(stderr, "repeats 1..64, ranks dividing 16\n");
        return 2;
    }
    if (dsk_comm_free_port("127.0.0.1", &port) != DSK_OK) return 2;
    printf("# bench_moe_ep: %d ranks%s, %d tokens a rank, D 256, 16 experts top-4 (F 128), 1 shared (512), "
           "f32, 1 thread a rank, median of %d\n",
           P, two_hosts ? " on 2 emulated hosts (TCP between)" : " (shm)", T, reps);
    fflush(stdout);
    for (int r = 0; r < P; r++)
        if (fork() == 0) _exit(rank_main(r, P, port, T, reps, two_hosts));
    for (int r = 0; r < P; r++) {
        int status = 0;
        wait(&status);
        if (!WIFEXITED(status) || WEXITSTATUS(status)) worst = 1;
    }
    return worst;
}
