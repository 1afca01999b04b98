/* cuda_graph_step.c - one GPU training step of an MoE layer captured as a CUDA graph and replayed.

   What it shows: what a step must look like to be captured once and launched as one graph.
     - Nothing in the step may wait for the device or copy to the host: the MoE layer keeps its
       routing, counts and offsets on the device (no expert parallelism), dsk_moe_reserve sizes
       its workspace before the capture, and the optimizer takes its step from device memory:
       dsk_amp_dstep holds lr and the AdamW step (written by the host before each launch with
       dsk_amp_dstep_schedule, copied in by the captured dsk_amp_dstep_upload), and
       dsk_amp_decide_dev makes the skip/clip decision there; dsk_moe_update_bias_unless skips
       the bias update on that device flag.
     - What changes between replays lives at fixed addresses: the batch is copied into the same
       device buffer before each launch; the loss lands in the same device scalar.
     - Kernel arguments are frozen at capture: the loss scale is one of them, so this step uses a
       static scale (DSK_AMP_STATIC; a dynamic scale would mean capturing again when it moves).
   The step is one function, run as it is (--eager) or recorded between dsk_graph_begin and
   dsk_graph_end at the first step and launched with dsk_graph_launch at every step (--graph,
   the default). Both print each step's loss, and --out FILE writes the final weights (raw f32):
   the two runs give the same bits (tests/test_teach.sh compares them on the CUDA emulator).
   It needs a GPU: in a build without CUDA, or where no device is usable, it says so and exits
   with status 77.

   Needs: dsk_tensor.h, dsk_comm.h (dsk_moe.h includes it), dsk_amp.h, dsk_moe.h, and the CUDA
   kernels (libdsk_kernels.a, -DDSK_CUDA); the Makefile builds build/examples/cuda_graph_step and,
   on the CUDA emulator (tests/cuda_emu), build/emu/examples/cuda_graph_step.
   Usage: cuda_graph_step [--eager | --graph] [--steps N (default 6)] [--out FILE] */
#include "dsk_tensor.h"
#include "dsk_amp.h"
#include "dsk_moe.h"

#include <stdio.h>
#include <stdlib.h>

enum { T = 16, D = 16, E = 4, K = 2, F = 8, NEEDS_GPU = 77 }; /* tokens, width, experts, top-k, expert width */

static void check(dsk_status s, const char *call) { /* exits at the first failing call, naming it and why */
    if (s != DSK_OK)
        fprintf(stderr, "cuda_graph_step: %s: %s: %s\n", call, dsk_status_str(s), dsk_last_error()), exit(1);
}
#define CHECK(call) check((call), #call)

/* Everything the step touches, on the device at addresses fixed from the start. */
typedef struct model {
    dsk_ctx ctx;
    dsk_moe moe;
    dsk_tensor values, grads, m1, m2; /* slabs: f32 values, gradients, AdamW moments */
    dsk_tensor m1v[DSK_MOE_N_PARAMS], m2v[DSK_MOE_N_PARAMS];
    dsk_amp_param amp[DSK_MOE_N_PARAMS];
    dsk_tensor *grad_list[DSK_MOE_N_PARAMS];
    int n_amp;
    dsk_tensor a, x, target, y, dy, dx, loss; /* the map to learn, batch, activations, loss scalar */
    dsk_amp_scaler scaler;
    dsk_amp_dstep dstep;
    dsk_adamw_opts adamw;
    float scale;
} model;

/* One training step, every operation enqueued on the context's stream: no sync, no host copy.
   (A failing call exits the program, so the step has no status to return.) */
static void step(model *m) {
    CHECK(dsk_amp_dstep_upload(&m->dstep, &m->ctx)); /* lr and the AdamW step the host scheduled */
    CHECK(dsk_matmul(&m->ctx, &m->target, &m->x, 0, &m->a, 1, 1.0f, 0.0f));
    CHECK(dsk_moe_zero_grad(&m->moe, &m->ctx));
    CHECK(dsk_moe_forward(&m->moe, &m->ctx, &m->y, &m->x, NULL));
    CHECK(dsk_tensor_copy(&m->ctx, &m->dy, &m->y)); /* loss = mean (y - target)^2 */
    CHECK(dsk_axpy(&m->ctx, &m->dy, -1.0f, &m->target));
    CHECK(dsk_sum_squares(&m->ctx, &m->loss, &m->dy));
    CHECK(dsk_scale(&m->ctx, &m->dy, m->scale * 2.0f / (T * D)));
    CHECK(dsk_tensor_fill(&m->ctx, &m->dx, 0.0));
    CHECK(dsk_moe_backward(&m->moe, &m->ctx, &m->dx, &m->dy, m->scale));
    CHECK(dsk_amp_unscale(&m->scaler, &m->ctx, m->grad_list, m->n_amp));
    CHECK(dsk_amp_decide_dev(&m->dstep, &m->ctx, &m->scaler, 1.0)); /* clip at norm 1 */
    CHECK(dsk_amp_step_dev(&m->ctx, m->amp, m->n_amp, &m->adamw, &m->dstep, DSK_AMP_ROUND_NEAREST, 0));
    CHECK(dsk_moe_update_bias_unless(&m->moe, &m->ctx, &m->dstep.skip));
    CHECK(dsk_amp_update(&m->scaler, &m->ctx));
}

/* The view of f32 slab `slab` laid out as the gradient slab, where gradient view g sits. */
static dsk_status same_place(const dsk_tensor *slab, const dsk_tensor *grads, const dsk_tensor *g, dsk_tensor *out) {
    size_t off = (size_t)((const float *)g->data - (const float *)grads->data);
    return dsk_tensor_wrap(out, (float *)slab->data + off, DSK_F32, slab->device, g->ndim, g->shape);
}

/* The layer in f32 (its values are the masters), its slabs, the optimizer state and buffers. */
static void setup(model *m) {
    dsk_moe_opts o = {.d_model = D,
                      .n_routed = E,
                      .top_k = K,
                      .d_expert = F,
                      .score = DSK_MOE_SIGMOID, /* no shared expert (n_shared 0) */
                      .init_std = 0.2f,
                      .seed = 3};
    CHECK(dsk_moe_init(&m->moe, &m->ctx, &o));
    int64_t value_bytes, gd, gs, one = 1, sx[2] = {T, D}, sa[2] = {D, D};
    dsk_moe_slab_sizes(&m->moe, &value_bytes, &gd, &gs);
    int64_t n = gd + gs;
    CHECK(dsk_tensor_alloc(&m->ctx, &m->values, DSK_U8, 1, &value_bytes));
    dsk_tensor *f32[] = {&m->grads, &m->m1, &m->m2};
    for (int i = 0; i < 3; i++) CHECK(dsk_tensor_alloc(&m->ctx, f32[i], DSK_F32, 1, &n));
    CHECK(dsk_tensor_fill(&m->ctx, &m->m1, 0.0));
    CHECK(dsk_tensor_fill(&m->ctx, &m->m2, 0.0));
    CHECK(dsk_moe_bind_slabs(&m->moe, &m->ctx, &m->values, &m->grads));
    CHECK(dsk_moe_init_params(&m->moe, &m->ctx));
    for (int i = 0; i < m->moe.n_params; i++) {
        dsk_moe_param *p = &m->moe.params[i];
        int k = m->n_amp;
        if (!p->trainable) continue;
        CHECK(same_place(&m->m1, &m->grads, &p->grad, &m->m1v[k]));
        CHECK(same_place(&m->m2, &m->grads, &p->grad, &m->m2v[k]));
        m->amp[k] = (dsk_amp_param){p->name, &p->value, &p->grad, &m->m1v[k], &m->m2v[k], NULL};
        m->grad_list[k] = &p->grad;
        m->n_amp++;
    }
    CHECK(dsk_moe_reserve(&m->moe, &m->ctx, T)); /* no allocation inside the step from now on */
    dsk_amp_scaler_opts so;
    memset(&so, 0, sizeof so);
    so.mode = DSK_AMP_STATIC;
    so.init_scale = 1024.0f;
    CHECK(dsk_amp_scaler_init(&m->scaler, &m->ctx, &so));
    CHECK(dsk_amp_scale_get(&m->scaler, &m->ctx, &m->scale));
    CHECK(dsk_amp_dstep_init(&m->dstep, &m->ctx));
    m->adamw = dsk_adamw_defaults();
    m->adamw.lr = 1e-2f;
    CHECK(dsk_tensor_alloc(&m->ctx, &m->a, DSK_F32, 2, sa));
    CHECK(dsk_tensor_normal(&m->ctx, &m->a, 7, 0, 0.0f, 0.25f));
    dsk_tensor *act[] = {&m->x, &m->target, &m->y, &m->dy, &m->dx};
    for (int i = 0; i < 5; i++) CHECK(dsk_tensor_alloc(&m->ctx, act[i], DSK_F32, 2, sx));
    CHECK(dsk_tensor_alloc(&m->ctx, &m->loss, DSK_F32, 0, &one));
}

int main(int argc, char **argv) {
    int graph = 1, steps = 6;
    const char *out = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--eager")) graph = 0;
        else if (!strcmp(argv[i], "--graph")) graph = 1;
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--out") && i + 1 < argc) out = argv[++i];
        else {
            fprintf(stderr, "usage: cuda_graph_step [--eager | --graph] [--steps N] [--out FILE]\n");
            return 2;
        }
    }
    if (!dsk_cuda_available()) {
        printf("cuda_graph_step: needs a GPU: this build has no CUDA (DSK_CUDA) or no device is usable here; "
               "nothing to show (exit status %d)\n",
               NEEDS_GPU);
        return NEEDS_GPU;
    }
    static model m; /* zeroed: every free below accepts what setup did not reach */
    dsk_ctx_opts xo;
    memset(&xo, 0, sizeof xo);
    xo.device = DSK_PREFER_CUDA;
    CHECK(dsk_ctx_init(&m.ctx, &xo));
    setup(&m);
    printf("cuda_graph_step: %d steps, %s\n", steps, graph ? "captured once, replayed each step" : "eager");

    int64_t one = 1, sx[2] = {T, D};
    float xs[T * D], loss;
    dsk_tensor hx, hloss;
    CHECK(dsk_tensor_wrap(&hx, xs, DSK_F32, dsk_cpu(), 2, sx));
    CHECK(dsk_tensor_wrap(&hloss, &loss, DSK_F32, dsk_cpu(), 0, &one));
    dsk_graph g;
    memset(&g, 0, sizeof g);
    int64_t applied = 0;
    for (int s = 1; s <= steps; s++) {
        /* Host side, before the step: its batch into the fixed input buffer, its schedule. */
        CHECK(dsk_tensor_normal(NULL, &hx, 11, (uint64_t)s * T * D, 0.0f, 1.0f));
        CHECK(dsk_tensor_copy(&m.ctx, &m.x, &hx));
        CHECK(dsk_amp_dstep_schedule(&m.dstep, &m.ctx, m.adamw.lr, applied + 1, &m.adamw));
        if (!graph) {
            step(&m);
        } else {
            if (!g.exec) { /* the first step: record it */
                CHECK(dsk_graph_begin(&m.ctx));
                step(&m); /* recorded, not run: a call that would wait for the device fails the capture */
                CHECK(dsk_graph_end(&m.ctx, &g));
            }
            CHECK(dsk_graph_launch(&m.ctx, &g));
        }
        /* After: the loss and the decision. Reading them waits for the step, so the host may write
           the next schedule (a pending launch still copying it must not see it change). */
        dsk_amp_step_vals v;
        CHECK(dsk_tensor_copy(&m.ctx, &hloss, &m.loss));
        CHECK(dsk_amp_dstep_get(&m.dstep, &m.ctx, &v));
        applied += !v.skip;
        printf("step %d  loss %.9g  grad norm %.9g%s\n", s, loss / (T * D), v.norm, v.skip ? "  (skipped)" : "");
    }

    if (out) { /* every parameter's values, in params[] order */
        FILE *f = fopen(out, "wb");
        int bad = !f;
        for (int i = 0; !bad && i < m.moe.n_params; i++) {
            dsk_tensor *v = &m.moe.params[i].value, hw;
            float *w = (float *)malloc(dsk_tensor_nbytes(v));
            bad = !w || dsk_tensor_wrap(&hw, w, DSK_F32, dsk_cpu(), v->ndim, v->shape) != DSK_OK ||
                  dsk_tensor_copy(&m.ctx, &hw, v) != DSK_OK || fwrite(w, dsk_tensor_nbytes(v), 1, f) != 1;
            free(w);
        }
        if ((f && fclose(f) != 0) || bad) {
            fprintf(stderr, "cuda_graph_step: cannot write %s: %s\n", out, dsk_last_error());
            return 1;
        }
        printf("final weights in %s\n", out);
    }

    dsk_graph_free(&g);
    dsk_tensor *owned[] = {&m.values, &m.grads, &m.m1, &m.m2, &m.a, &m.x, &m.target, &m.y, &m.dy, &m.dx, &m.loss};
    for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++) dsk_tensor_free(&m.ctx, owned[i]);
    dsk_amp_dstep_free(&m.dstep, &m.ctx);
    dsk_amp_scaler_free(&m.scaler, &m.ctx);
    dsk_moe_free(&m.moe, &m.ctx);
    dsk_ctx_free(&m.ctx);
    return 0;
}
