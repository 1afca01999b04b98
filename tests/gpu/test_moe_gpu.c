/* tests/gpu/test_moe_gpu.c - the CUDA path of dsk_moe.h against its CPU path on the same
   parameters and inputs: forward (y, routing statistics, loss terms), backward (dx, every
   gradient), bias update, for softmax/sigmoid, groups, shared experts, capacity, f32 and bf16.
   Without a usable GPU every case reports as skipped. */
#define DSK_TENSOR_IMPLEMENTATION
#define DSK_COMM_IMPLEMENTATION
#define DSK_MOE_IMPLEMENTATION
#include "dsk_comm.h"
#include "dsk_moe.h"
#include "tests/dsk_test.h"

typedef struct gcase {
    const char *name;
    int T, D, E, K, F, n_shared, n_group, topk_group;
    dsk_moe_score score;
    float cf, aux, seq_aux, z;
    int64_t seq_len;
    dsk_dtype dt;
    dsk_moe_group_rule rule;
} gcase;

/* Host f32 copy of a tensor on any device. */
static float *to_host_f32(dsk_ctx *ctx, const dsk_tensor *t) {
    int64_t n = dsk_tensor_numel(t);
    float *h = (float *)malloc(sizeof(float) * (size_t)(n ? n : 1));
    dsk_tensor ht;
    dsk_tensor_wrap(&ht, h, DSK_F32, dsk_cpu(), t->ndim, t->shape);
    if (dsk_tensor_copy(ctx, &ht, t) != DSK_OK) { free(h); return NULL; }
    return h;
}

static void compare(dsk_ctx *ctx, const dsk_tensor *gpu, const dsk_tensor *cpu, double rtol, double atol, const char *what) {
    int64_t n = dsk_tensor_numel(cpu);
    float *g = to_host_f32(ctx, gpu), *c = to_host_f32(NULL, cpu);
    double *w = (double *)malloc(sizeof(double) * (size_t)(n ? n : 1)), mx = 0;
    if (!g || !c) { dsk_test_fail_at(__FILE__, __LINE__, "%s: copy to host failed: %s", what, dsk_last_error()); goto out; }
    for (int64_t i = 0; i < n; i++) { w[i] = c[i]; mx = fabs(w[i]) > mx ? fabs(w[i]) : mx; }
    DSK_TEST_CLOSE(g, w, n, rtol, atol * (mx > 1 ? mx : 1), what);
out:
    free(g); free(c); free(w);
}

/* A layer with its parameters bound into two slabs on ctx's device (sizes, then bind). */
typedef struct owned { dsk_tensor values, grads; } owned;

static dsk_status make_layer(dsk_moe *m, owned *s, dsk_ctx *ctx, const dsk_moe_opts *o) {
    int64_t vb, gd, gs;
    memset(s, 0, sizeof *s);
    DSK__TRY(dsk_moe_init(m, ctx, o));
    dsk_moe_slab_sizes(m, &vb, &gd, &gs);
    gd += gs;
    DSK__TRY(dsk_tensor_alloc(ctx, &s->values, DSK_U8, 1, &vb));
    DSK__TRY(dsk_tensor_alloc(ctx, &s->grads, DSK_F32, 1, &gd));
    DSK__TRY(dsk_moe_bind_slabs(m, ctx, &s->values, &s->grads));
    DSK__TRY(dsk_moe_init_params(m, ctx));
    return dsk_tensor_fill(ctx, &s->grads, 0.0);
}

static void drop_layer(dsk_moe *m, owned *s, dsk_ctx *ctx) {
    dsk_moe_free(m, ctx);
    dsk_tensor_free(ctx, &s->values);
    dsk_tensor_free(ctx, &s->grads);
}

static void run_case(dsk_ctx *gctx, const gcase *c) {
    dsk_moe cm, gm;
    owned co, go;
    dsk_moe_opts o;
    dsk_moe_stats cs, gs;
    dsk_tensor hx, hy, hdy, hdx, gx, gy, gdy, gdx;
    int64_t shp[2] = {c->T, c->D};
    int bf = c->dt == DSK_BF16;
    double rt = bf ? 3e-2 : 2e-4, at = bf ? 3e-2 : 2e-5;
    dsk_test_begin("cuda vs cpu: %s T=%d %s", c->name, c->T, dsk_dtype_name(c->dt));
    if (!dsk_cuda_available()) { dsk_test_skip("no usable CUDA device"); dsk_test_end(); return; }
    memset(&o, 0, sizeof o);
    o.d_model = c->D; o.n_routed = c->E; o.top_k = c->K; o.d_expert = c->F; o.n_shared = c->n_shared;
    o.n_group = c->n_group; o.topk_group = c->topk_group; o.score = c->score; o.capacity_factor = c->cf;
    o.aux_alpha = c->aux; o.seq_aux_alpha = c->seq_aux; o.z_beta = c->z; o.seq_len = c->seq_len; o.dtype = c->dt;
    o.group_rule = c->rule;
    o.init_std = 0.3f; o.seed = 5; o.routed_scale = 1.5f;
    DSK_TEST_OK(make_layer(&cm, &co, NULL, &o));
    DSK_TEST_OK(make_layer(&gm, &go, gctx, &o));
    /* same parameters on both: the CPU ones, bias included (the slabs share a layout) */
    dsk_tensor_uniform(NULL, &cm.bias->value, 9, 0, -0.05f, 0.05f);
    DSK_TEST_OK(dsk_tensor_copy(gctx, &go.values, &co.values));
    dsk_tensor_alloc(NULL, &hx, c->dt, 2, shp); dsk_tensor_alloc(NULL, &hy, c->dt, 2, shp);
    dsk_tensor_alloc(NULL, &hdy, c->dt, 2, shp); dsk_tensor_alloc(NULL, &hdx, c->dt, 2, shp);
    dsk_tensor_uniform(NULL, &hx, 11, 0, -1, 1);
    dsk_tensor_uniform(NULL, &hdy, 12, 0, -1, 1);
    dsk_tensor_uniform(NULL, &hdx, 13, 0, -1, 1);
    dsk_tensor_alloc(gctx, &gx, c->dt, 2, shp); dsk_tensor_alloc(gctx, &gy, c->dt, 2, shp);
    dsk_tensor_alloc(gctx, &gdy, c->dt, 2, shp); dsk_tensor_alloc(gctx, &gdx, c->dt, 2, shp);
    dsk_tensor_copy(gctx, &gx, &hx); dsk_tensor_copy(gctx, &gdy, &hdy); dsk_tensor_copy(gctx, &gdx, &hdx);
    dsk_tensor_fill(gctx, &gy, NAN);
    dsk_tensor_fill(NULL, &hy, NAN);
    DSK_TEST_OK(dsk_moe_forward(&cm, NULL, &hy, &hx, &cs));
    DSK_TEST_OK(dsk_moe_forward(&gm, gctx, &gy, &gx, &gs));
    compare(gctx, &gy, &hy, rt, at, "y");
    DSK_TEST_EXPECT(cs.dropped == gs.dropped, "dropped cpu %lld cuda %lld", (long long)cs.dropped, (long long)gs.dropped);
    for (int e = 0; e < c->E; e++)
        DSK_TEST_EXPECT(cs.tokens_per_expert[e] == gs.tokens_per_expert[e], "expert %d: cpu %lld cuda %lld", e,
                        (long long)cs.tokens_per_expert[e], (long long)gs.tokens_per_expert[e]);
    {
        double got[3] = {gs.aux_loss, gs.seq_aux_loss, gs.z_loss}, want[3] = {cs.aux_loss, cs.seq_aux_loss, cs.z_loss};
        DSK_TEST_CLOSE64(got, want, 3, 1e-4, 1e-9, "loss terms");
    }
    DSK_TEST_OK(dsk_moe_backward(&cm, NULL, &hdx, &hdy, 2.0f));
    DSK_TEST_OK(dsk_moe_backward(&gm, gctx, &gdx, &gdy, 2.0f));
    compare(gctx, &gdx, &hdx, rt, at, "dx");
    for (int i = 0; i < cm.n_params; i++) {
        char what[128];
        if (!cm.params[i].trainable) continue;
        snprintf(what, sizeof what, "grad %s", cm.params[i].name);
        compare(gctx, &gm.params[i].grad, &cm.params[i].grad, bf ? 5e-2 : 1e-3, bf ? 5e-2 : 1e-4, what);
    }
    DSK_TEST_OK(dsk_moe_update_bias(&cm, NULL, NULL));
    DSK_TEST_OK(dsk_moe_update_bias(&gm, gctx, NULL));
    compare(gctx, &gm.bias->value, &cm.bias->value, 0, 0, "bias after update");
    dsk_tensor_free(NULL, &hx); dsk_tensor_free(NULL, &hy); dsk_tensor_free(NULL, &hdy); dsk_tensor_free(NULL, &hdx);
    dsk_tensor_free(gctx, &gx); dsk_tensor_free(gctx, &gy); dsk_tensor_free(gctx, &gdy); dsk_tensor_free(gctx, &gdx);
    drop_layer(&cm, &co, NULL);
    drop_layer(&gm, &go, gctx);
    dsk_test_end();
}

/* NaN/Inf in x: the CUDA forward fails like the CPU one (DSK_ERR_NONFINITE naming the token),
   routes nothing out of range and runs again on repaired input. */
static void run_nonfinite(dsk_ctx *gctx, dsk_moe_score score, float bad) {
    dsk_moe gm;
    owned go;
    dsk_moe_opts o;
    dsk_tensor hx, gx, gy;
    int64_t shp[2] = {33, 32};
    dsk_test_begin("cuda: x with %g in token 4, %s", (double)bad,
                   score == DSK_MOE_SIGMOID ? "sigmoid+groups" : "softmax");
    if (!dsk_cuda_available()) { dsk_test_skip("no usable CUDA device"); dsk_test_end(); return; }
    memset(&o, 0, sizeof o);
    o.d_model = 32; o.n_routed = 8; o.top_k = 2; o.d_expert = 16; o.score = score;
    o.aux_alpha = 0.01f; o.capacity_factor = 0.5f;
    if (score == DSK_MOE_SIGMOID) { o.n_group = 4; o.topk_group = 2; }
    DSK_TEST_OK(make_layer(&gm, &go, gctx, &o));
    dsk_tensor_alloc(NULL, &hx, DSK_F32, 2, shp);
    dsk_tensor_alloc(gctx, &gx, DSK_F32, 2, shp); dsk_tensor_alloc(gctx, &gy, DSK_F32, 2, shp);
    dsk_tensor_uniform(NULL, &hx, 21, 0, -1, 1);
    ((float *)hx.data)[4 * 32 + 7] = bad;
    DSK_TEST_OK(dsk_tensor_copy(gctx, &gx, &hx));
    DSK_TEST_STATUS(dsk_moe_forward(&gm, gctx, &gy, &gx, NULL), DSK_ERR_NONFINITE);
    DSK_TEST_ERROR_MENTIONS("token 4 of 33");
    ((float *)hx.data)[4 * 32 + 7] = 0.5f;
    DSK_TEST_OK(dsk_tensor_copy(gctx, &gx, &hx));
    DSK_TEST_OK(dsk_moe_forward(&gm, gctx, &gy, &gx, NULL));
    dsk_tensor_free(NULL, &hx); dsk_tensor_free(gctx, &gx); dsk_tensor_free(gctx, &gy);
    drop_layer(&gm, &go, gctx);
    dsk_test_end();
}

int main(void) {
    dsk_ctx gctx;
    dsk_ctx_opts co;
    int have = dsk_cuda_available();
    const gcase cases[] = {
        {"softmax", 129, 64, 12, 2, 32, 0, 0, 0, DSK_MOE_SOFTMAX, 0, 0, 0, 0, 0, DSK_F32, DSK_MOE_GROUP_DEEPSEEK_V3},
        {"softmax+aux+z+shared", 7, 64, 6, 3, 48, 2, 0, 0, DSK_MOE_SOFTMAX, 0, 0.01f, 0, 0.001f, 0, DSK_F32,
         DSK_MOE_GROUP_DEEPSEEK_V3},
        {"sigmoid+groups+seq_aux+shared", 256, 128, 16, 4, 64, 1, 8, 4, DSK_MOE_SIGMOID, 0, 0, 0.003f, 0, 64, DSK_F32,
         DSK_MOE_GROUP_DEEPSEEK_V3},
        {"sigmoid capacity 0.75", 129, 64, 8, 2, 32, 0, 0, 0, DSK_MOE_SIGMOID, 0.75f, 0.01f, 0, 0, 0, DSK_F32,
         DSK_MOE_GROUP_DEEPSEEK_V3},
        {"softmax", 1, 64, 6, 2, 32, 1, 0, 0, DSK_MOE_SOFTMAX, 0, 0, 0, 0, 0, DSK_F32, DSK_MOE_GROUP_DEEPSEEK_V3},
        {"softmax+groups, DeepSeek-V3 rule", 129, 64, 16, 6, 32, 0, 4, 2, DSK_MOE_SOFTMAX, 0, 0.01f, 0, 0, 0, DSK_F32,
         DSK_MOE_GROUP_DEEPSEEK_V3},
        {"sigmoid+groups, Megatron rule", 129, 64, 16, 6, 32, 0, 4, 2, DSK_MOE_SIGMOID, 0, 0, 0, 0, 0, DSK_F32,
         DSK_MOE_GROUP_MEGATRON},
        {"Switch aux, seq_len 5 not dividing T", 37, 64, 6, 2, 32, 0, 0, 0, DSK_MOE_SOFTMAX, 0, 0.01f, 0, 0.001f, 5,
         DSK_F32, DSK_MOE_GROUP_DEEPSEEK_V3},
        {"sigmoid+groups+shared", 200, 128, 16, 4, 64, 1, 4, 2, DSK_MOE_SIGMOID, 0, 0.01f, 0, 0.001f, 0, DSK_BF16,
         DSK_MOE_GROUP_DEEPSEEK_V3},
    };
    dsk_test_init("test_moe_gpu");
    memset(&co, 0, sizeof co);
    co.device = DSK_PREFER_CUDA;
    memset(&gctx, 0, sizeof gctx);
    if (have && dsk_ctx_init(&gctx, &co) != DSK_OK) {
        dsk_test_begin("cuda context");
        dsk_test_fail_at(__FILE__, __LINE__, "dsk_ctx_init: %s", dsk_last_error());
        dsk_test_end();
        return dsk_test_finish();
    }
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&gctx, &cases[i]);
    run_nonfinite(&gctx, DSK_MOE_SOFTMAX, INFINITY);
    run_nonfinite(&gctx, DSK_MOE_SIGMOID, NAN);
    dsk_ctx_free(&gctx);
    return dsk_test_finish();
}
