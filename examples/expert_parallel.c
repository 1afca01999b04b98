/* expert_parallel.c - one MoE layer's experts split over local ranks (expert parallelism).

   What it shows: how a program starts ranks on one machine and runs a dsk_moe layer whose
   experts are spread over them, on the host backend (CPU buffers, shared memory between ranks):
     - the launcher: run without RANK in the environment and --nproc N > 1, the program starts N
       copies of itself with dsk_comm_spawn_local (as torchrun would: RANK, WORLD_SIZE,
       MASTER_ADDR, MASTER_PORT set), each output line prefixed "[rank r]";
     - each rank: dsk_comm_init_env, then a layer with opts.ep = the communicator: rank r holds
       experts [r E/N, (r+1) E/N), routes its own tokens, and the layer exchanges rows with
       all-to-all-v in forward and backward (every rank calls them together);
     - the parameters are drawn from one seed by global position, so expert e has the same
       values whichever rank holds it, and a run on N ranks computes what one rank computes;
     - after backward, the replicated gradients (the router's; shared experts' too where a layer
       has them) are summed over the ranks, as a data-parallel trainer reduces them (the
       expert-sharded ones would be summed over the ranks holding the same experts: here each
       expert has one holder).
   The global batch is NT tokens; rank r takes rows [r NT/N, (r+1) NT/N). With --out PREFIX each
   rank writes its rows of y and dx to PREFIX.y.rank<r> and PREFIX.dx.rank<r> and rank 0 the
   summed router gradient to PREFIX.router_grad (raw f32), so runs on 1 and 2 ranks compare.
   --nproc 1 runs the same layer with no communicator (opts.ep NULL): the reference.

   Needs: dsk_tensor.h, dsk_comm.h, dsk_moe.h; link libdsk.a (the Makefile builds this file into
   build/examples/expert_parallel).
   Usage: expert_parallel [--nproc N (default 2)] [--out PREFIX] */
#include "dsk_tensor.h"
#include "dsk_comm.h"
#include "dsk_moe.h"

#include <stdio.h>
#include <stdlib.h>

enum { NT = 32, D = 16, E = 8, K = 2, F = 12 }; /* global tokens, width, experts, top-k, expert width */

static void check(dsk_status s, const char *call) { /* exits at the first failing call, naming it and why */
    if (s != DSK_OK)
        fprintf(stderr, "expert_parallel: %s: %s: %s\n", call, dsk_status_str(s), dsk_last_error()), exit(1);
}
#define CHECK(call) check((call), #call)

/* Writes n bytes to PREFIX.what[.rank<r>] (r < 0: no rank suffix); 0 on success. */
static int write_raw(const char *prefix, const char *what, int r, const void *p, size_t n) {
    char path[4096];
    if (r >= 0) snprintf(path, sizeof path, "%s.%s.rank%d", prefix, what, r);
    else snprintf(path, sizeof path, "%s.%s", prefix, what);
    FILE *f = fopen(path, "wb");
    int bad = !f || fwrite(p, 1, n, f) != n;
    if (f && fclose(f) != 0) bad = 1;
    if (bad) fprintf(stderr, "expert_parallel: cannot write %s\n", path);
    return bad;
}

int main(int argc, char **argv) {
    int nproc = 2;
    const char *out = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--nproc") && i + 1 < argc) nproc = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--out") && i + 1 < argc) out = argv[++i];
        else {
            fprintf(stderr, "usage: expert_parallel [--nproc N] [--out PREFIX]\n");
            return 2;
        }
    }
    if (nproc < 1 || E % nproc || NT % nproc) {
        fprintf(stderr, "expert_parallel: --nproc must divide %d experts and %d tokens\n", E, NT);
        return 2;
    }

    /* The launcher: N copies of this program, the same arguments, RANK set in each. */
    if (!getenv("RANK") && nproc > 1) {
        int worst = 0;
        printf("starting %d local ranks\n", nproc);
        fflush(stdout);
        CHECK(dsk_comm_spawn_local(nproc, argv, NULL, &worst));
        return worst;
    }

    /* A rank: join the others (host backend), or run alone with no communicator. */
    dsk_comm comm;
    memset(&comm, 0, sizeof comm);
    int rank = 0, world = 1;
    if (getenv("RANK")) {
        dsk_comm_opts co;
        memset(&co, 0, sizeof co);
        co.backend = DSK_COMM_HOST;
        co.timeout_s = 60;
        CHECK(dsk_comm_init_env(&comm, &co));
        rank = comm.rank;
        world = comm.world_size;
    }
    dsk_ctx_opts xo;
    memset(&xo, 0, sizeof xo);
    xo.device = DSK_PREFER_CPU; /* the host backend moves CPU buffers */
    dsk_ctx ctx;
    CHECK(dsk_ctx_init(&ctx, &xo));

    /* The layer: experts over the ranks of comm (or all local); softmax routing, no shared expert. */
    dsk_moe_opts o = {.d_model = D,
                      .n_routed = E,
                      .top_k = K,
                      .d_expert = F,
                      .init_std = 0.2f,
                      .seed = 42,
                      .ep = world > 1 ? &comm : NULL};
    dsk_moe moe;
    CHECK(dsk_moe_init(&moe, &ctx, &o));
    int64_t value_bytes, grad_dense, grad_sharded;
    dsk_moe_slab_sizes(&moe, &value_bytes, &grad_dense, &grad_sharded);
    int64_t n_grads = grad_dense + grad_sharded;
    dsk_tensor values, grads;
    CHECK(dsk_tensor_alloc(&ctx, &values, DSK_U8, 1, &value_bytes));
    CHECK(dsk_tensor_alloc(&ctx, &grads, DSK_F32, 1, &n_grads));
    CHECK(dsk_moe_bind_slabs(&moe, &ctx, &values, &grads));
    CHECK(dsk_moe_init_params(&moe, &ctx)); /* expert e: the same numbers on whichever rank holds it */
    CHECK(dsk_moe_zero_grad(&moe, &ctx));
    printf("rank %d of %d: experts [%d, %d) of %d\n", rank, world, moe.expert0, moe.expert0 + moe.n_local, E);

    /* This rank's rows of the global batch (x and dy drawn whole from fixed seeds, then sliced). */
    int64_t T = NT / world, sg[2] = {NT, D}, sl[2] = {T, D};
    dsk_tensor gx, gdy, x, dy, y, dx;
    CHECK(dsk_tensor_alloc(&ctx, &gx, DSK_F32, 2, sg));
    CHECK(dsk_tensor_alloc(&ctx, &gdy, DSK_F32, 2, sg));
    CHECK(dsk_tensor_normal(&ctx, &gx, 1, 0, 0.0f, 1.0f));
    CHECK(dsk_tensor_normal(&ctx, &gdy, 2, 0, 0.0f, 1.0f));
    CHECK(dsk_tensor_slice(&gx, 0, rank * T, T, &x));
    CHECK(dsk_tensor_slice(&gdy, 0, rank * T, T, &dy));
    CHECK(dsk_tensor_alloc(&ctx, &y, DSK_F32, 2, sl));
    CHECK(dsk_tensor_alloc(&ctx, &dx, DSK_F32, 2, sl));
    CHECK(dsk_tensor_fill(&ctx, &dx, 0.0));

    /* Forward and backward: collective over the expert-parallel group. */
    dsk_moe_stats st;
    CHECK(dsk_moe_forward(&moe, &ctx, &y, &x, &st));
    CHECK(dsk_moe_backward(&moe, &ctx, &dx, &dy, 1.0f));
    printf("rank %d: routed %lld slots of the group's %lld tokens; tokens per expert:", rank, (long long)st.slots,
           (long long)st.tokens);
    for (int e = 0; e < E; e++) printf(" %lld", (long long)st.tokens_per_expert[e]);
    printf("\n");

    /* The replicated gradients (every parameter not expert-sharded) summed over the ranks; a
       data-parallel trainer would then divide by the number of ranks whose losses it averages. */
    dsk_tensor *router_grad = &moe.router->grad;
    for (int i = 0; world > 1 && i < moe.n_params; i++) {
        dsk_moe_param *p = &moe.params[i];
        if (p->trainable && !p->expert_sharded) CHECK(dsk_comm_all_reduce_tensor(&comm, &ctx, &p->grad, DSK_COMM_SUM));
    }

    int bad = 0;
    if (out) {
        bad |= write_raw(out, "y", rank, y.data, dsk_tensor_nbytes(&y));
        bad |= write_raw(out, "dx", rank, dx.data, dsk_tensor_nbytes(&dx));
        if (rank == 0) bad |= write_raw(out, "router_grad", -1, router_grad->data, dsk_tensor_nbytes(router_grad));
    }

    dsk_tensor *owned[] = {&gx, &gdy, &y, &dx, &values, &grads};
    for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++) dsk_tensor_free(&ctx, owned[i]);
    dsk_moe_free(&moe, &ctx);
    dsk_ctx_free(&ctx);
    dsk_comm_free(&comm);
    return bad;
}
