/* moe_layer.c - train one DeepSeek MoE layer with AdamW and loss scaling, its parameters in
   slabs this program allocates.

   What it shows: the life of a dsk_moe layer in a trainer of your own, top to bottom.
     1. dsk_moe_init reports the parameters (names, shapes, dtypes) and allocates none of them;
     2. this program allocates one slab per role with dsk_tensor_alloc (bf16 values, f32
        gradients, f32 master weights, f32 AdamW moments) and binds the layer to views of them
        (dsk_moe_bind_slabs); master weights and moments are laid out as the gradients are;
     3. each step: forward, a mean-squared-error loss against a fixed linear map of x, backward
        of the loss times the loss scale, dsk_amp_unscale (non-finite check and norm), the skip
        and clip decision, AdamW on the f32 masters with the bf16 copies refreshed
        (dsk_amp_step), the loss-scale rule (dsk_amp_update) and the aux-loss-free expert-bias
        update (dsk_moe_update_bias).
   It prints the loss every 10 steps and, at the end, the mean loss of the first and of the last 10
   steps: "loss: FIRST -> LAST (xR lower)".

   Needs: dsk_tensor.h, dsk_comm.h (dsk_moe.h includes it), dsk_amp.h, dsk_moe.h; link libdsk.a
   (the Makefile builds this file into build/examples/moe_layer).
   Usage: moe_layer [steps (default 200)] */
#include "dsk_tensor.h"
#include "dsk_amp.h"
#include "dsk_moe.h"

#include <stdio.h>
#include <stdlib.h>

enum { T = 64, D = 32, E = 8, K = 2, F = 32 }; /* tokens per step, model width, experts, top-k, expert width */

static void check(dsk_status s, const char *call) { /* exits at the first failing call, naming it and why */
    if (s != DSK_OK) fprintf(stderr, "moe_layer: %s: %s: %s\n", call, dsk_status_str(s), dsk_last_error()), exit(1);
}
#define CHECK(call) check((call), #call)

/* The view of role slab `slab` (f32, laid out as the gradient slab `grads`) that holds what
   gradient view `g` holds for its parameter: same offset, same shape. */
static dsk_status same_place(const dsk_tensor *slab, const dsk_tensor *grads, const dsk_tensor *g, dsk_tensor *out) {
    size_t off = (size_t)((const float *)g->data - (const float *)grads->data);
    return dsk_tensor_wrap(out, (float *)slab->data + off, DSK_F32, slab->device, g->ndim, g->shape);
}

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 200;
    if (steps < 10) {
        fprintf(stderr, "usage: moe_layer [steps, at least 10]\n");
        return 2;
    }
    dsk_ctx ctx;
    CHECK(dsk_ctx_init(&ctx, NULL)); /* the GPU when one is usable, else the CPU */
    printf("moe_layer: %d steps on %s, %d tokens of width %d, %d experts, top-%d\n", steps,
           ctx.device.type == DSK_DEV_CUDA ? "the GPU" : "the CPU", T, D, E, K);

    /* 1. The layer: sizes only. DeepSeek-V3's routing: sigmoid scores, normalised top-k weights,
       groups of experts, one shared expert, the expert bias for aux-loss-free balancing. Options
       not named are 0: their defaults. dtype bf16: compute copies; the masters below stay f32. */
    dsk_moe_opts o = {.d_model = D,
                      .n_routed = E,
                      .top_k = K,
                      .d_expert = F,
                      .n_shared = 1,
                      .score = DSK_MOE_SIGMOID,
                      .n_group = 2,
                      .topk_group = 1,
                      .dtype = DSK_BF16,
                      .init_std = 0.1f,
                      .seed = 1};
    dsk_moe moe;
    CHECK(dsk_moe_init(&moe, &ctx, &o));

    /* 2. The slabs: one allocation per role. values: every parameter in its own dtype (u8 bytes);
       grads, master, m, v: f32, the trainable parameters, in the gradients' layout. */
    int64_t value_bytes, grad_dense, grad_sharded;
    dsk_moe_slab_sizes(&moe, &value_bytes, &grad_dense, &grad_sharded);
    int64_t n_train = grad_dense + grad_sharded;
    dsk_tensor values, grads, master, mom1, mom2;
    CHECK(dsk_tensor_alloc(&ctx, &values, DSK_U8, 1, &value_bytes));
    CHECK(dsk_tensor_alloc(&ctx, &grads, DSK_F32, 1, &n_train));
    CHECK(dsk_tensor_alloc(&ctx, &master, DSK_F32, 1, &n_train));
    CHECK(dsk_tensor_alloc(&ctx, &mom1, DSK_F32, 1, &n_train));
    CHECK(dsk_tensor_alloc(&ctx, &mom2, DSK_F32, 1, &n_train));
    CHECK(dsk_tensor_fill(&ctx, &mom1, 0.0));
    CHECK(dsk_tensor_fill(&ctx, &mom2, 0.0));
    CHECK(dsk_moe_bind_slabs(&moe, &ctx, &values, &grads));
    printf("slabs: %lld bytes of values, %lld f32 per role (%lld dense, %lld expert-sharded)\n", (long long)value_bytes,
           (long long)n_train, (long long)grad_dense, (long long)grad_sharded);

    /* Each trainable parameter for dsk_amp_step: its master, gradient and moments (views of the
       f32 slabs at one offset) and its compute copy (the bound value). The initial values are
       drawn into the master and rounded into the copy; the bias (not trainable) starts at 0. */
    dsk_amp_param amp[DSK_MOE_N_PARAMS];
    dsk_tensor mw[DSK_MOE_N_PARAMS], m1[DSK_MOE_N_PARAMS], m2[DSK_MOE_N_PARAMS];
    dsk_tensor *grad_list[DSK_MOE_N_PARAMS];
    int n_amp = 0;
    for (int i = 0; i < moe.n_params; i++) {
        dsk_moe_param *p = &moe.params[i];
        if (!p->trainable) {
            CHECK(dsk_moe_init_param(&moe, &ctx, i, &p->value));
            continue;
        }
        CHECK(same_place(&master, &grads, &p->grad, &mw[n_amp]));
        CHECK(same_place(&mom1, &grads, &p->grad, &m1[n_amp]));
        CHECK(same_place(&mom2, &grads, &p->grad, &m2[n_amp]));
        CHECK(dsk_moe_init_param(&moe, &ctx, i, &mw[n_amp]));
        CHECK(dsk_tensor_copy(&ctx, &p->value, &mw[n_amp]));
        amp[n_amp] = (dsk_amp_param){p->name, &mw[n_amp], &p->grad, &m1[n_amp], &m2[n_amp], &p->value};
        grad_list[n_amp] = &p->grad;
        n_amp++;
    }

    /* The loss scaler: GradScaler's dynamic rule, grown every 20 clean steps. */
    dsk_amp_scaler scaler;
    dsk_amp_scaler_opts so;
    memset(&so, 0, sizeof so);
    so.init_scale = 1024.0f;
    so.growth_interval = 20;
    CHECK(dsk_amp_scaler_init(&scaler, &ctx, &so));
    dsk_adamw_opts adamw = dsk_adamw_defaults();
    adamw.lr = 1e-2f;
    adamw.weight_decay = 0.0f;

    /* The task: y = x A^T for a fixed random A (D, D); each step draws a fresh x. */
    int64_t sx[2] = {T, D}, sa[2] = {D, D}, one = 1;
    dsk_tensor a, x32, x, y, y32, target, dy32, dy, dx, sq;
    CHECK(dsk_tensor_alloc(&ctx, &a, DSK_F32, 2, sa));
    CHECK(dsk_tensor_normal(&ctx, &a, 7, 0, 0.0f, 1.0f / sqrtf((float)D)));
    CHECK(dsk_tensor_alloc(&ctx, &x32, DSK_F32, 2, sx));
    CHECK(dsk_tensor_alloc(&ctx, &target, DSK_F32, 2, sx));
    CHECK(dsk_tensor_alloc(&ctx, &y32, DSK_F32, 2, sx));
    CHECK(dsk_tensor_alloc(&ctx, &dy32, DSK_F32, 2, sx));
    CHECK(dsk_tensor_alloc(&ctx, &x, DSK_BF16, 2, sx)); /* the layer's dtype */
    CHECK(dsk_tensor_alloc(&ctx, &y, DSK_BF16, 2, sx));
    CHECK(dsk_tensor_alloc(&ctx, &dy, DSK_BF16, 2, sx));
    CHECK(dsk_tensor_alloc(&ctx, &dx, DSK_BF16, 2, sx));
    CHECK(dsk_tensor_alloc(&ctx, &sq, DSK_F32, 0, &one));

    double first = 0.0, last = 0.0; /* the mean loss of the first and of the last 10 steps */
    int64_t applied = 0;            /* AdamW's step counts applied steps only */
    for (int step = 1; step <= steps; step++) {
        float scale;
        CHECK(dsk_amp_scale_get(&scaler, &ctx, &scale));
        CHECK(dsk_tensor_normal(&ctx, &x32, 11, (uint64_t)step * T * D, 0.0f, 1.0f)); /* fresh x */
        CHECK(dsk_tensor_copy(&ctx, &x, &x32));
        CHECK(dsk_matmul(&ctx, &target, &x32, 0, &a, 1, 1.0f, 0.0f)); /* target = x A^T */

        /* forward; loss = mean (y - target)^2; dy = scale * 2 (y - target) / (T D) */
        CHECK(dsk_moe_zero_grad(&moe, &ctx));
        CHECK(dsk_moe_forward(&moe, &ctx, &y, &x, NULL));
        CHECK(dsk_tensor_copy(&ctx, &y32, &y));
        CHECK(dsk_tensor_copy(&ctx, &dy32, &y32));
        CHECK(dsk_axpy(&ctx, &dy32, -1.0f, &target));
        CHECK(dsk_sum_squares(&ctx, &sq, &dy32));
        CHECK(dsk_scale(&ctx, &dy32, scale * 2.0f / (T * D)));
        CHECK(dsk_tensor_copy(&ctx, &dy, &dy32));
        CHECK(dsk_tensor_fill(&ctx, &dx, 0.0)); /* backward adds into dx */
        CHECK(dsk_moe_backward(&moe, &ctx, &dx, &dy, scale));
        CHECK(dsk_moe_stats_request(&moe, &ctx));

        /* unscale, decide (clip at norm 1), step, move the scale, move the expert bias */
        dsk_amp_stats st;
        CHECK(dsk_amp_unscale(&scaler, &ctx, grad_list, n_amp));
        CHECK(dsk_amp_stats_get(&scaler, &ctx, &st));
        dsk_amp_decision dec = dsk_amp_decide(st, 1.0);
        CHECK(dsk_amp_step(&ctx, amp, n_amp, &adamw, applied + 1, &dec, DSK_AMP_ROUND_NEAREST, 0));
        applied += !dec.skip;
        CHECK(dsk_amp_update(&scaler, &ctx));
        if (!dec.skip) CHECK(dsk_moe_update_bias(&moe, &ctx, NULL));

        float sumsq;
        dsk_tensor h;
        CHECK(dsk_tensor_wrap(&h, &sumsq, DSK_F32, dsk_cpu(), 0, &one));
        CHECK(dsk_tensor_copy(&ctx, &h, &sq));
        double loss = (double)sumsq / (T * D);
        if (step <= 10) first += loss / 10;
        if (step > steps - 10) last += loss / 10;
        if (step == 1 || step % 10 == 0 || step == steps) {
            dsk_moe_stats ms;
            CHECK(dsk_moe_stats_collect(&moe, &ctx, &ms));
            printf("step %3d  loss %.6f  grad norm %.4f  loss scale %g%s  expert load max/mean %.2f\n", step, loss,
                   dec.norm, scale, dec.skip ? " (skipped)" : "", ms.mean_load > 0 ? ms.max_load / ms.mean_load : 0.0);
        }
    }
    printf("loss: %.6f -> %.6f (x%.1f lower)\n", first, last, last > 0 ? first / last : 0.0);

    dsk_tensor *owned[] = {&a,  &x32, &target, &y32,   &dy32,   &x,    &y,   &dy,
                           &dx, &sq,  &values, &grads, &master, &mom1, &mom2};
    for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++) dsk_tensor_free(&ctx, owned[i]);
    dsk_amp_scaler_free(&scaler, &ctx);
    dsk_moe_free(&moe, &ctx);
    dsk_ctx_free(&ctx);
    return 0;
}
