/* tests/gpu/test_moe_gpu.c - the CUDA path of dsk_moe.h against its CPU path on the same
   parameters and inputs: forward (y, routing statistics, loss terms), backward (dx, every
   gradient), bias update, for softmax/sigmoid, groups, shared experts, capacity, f32 and bf16;
   a forward and backward that make no host sync and no device-to-host copy (ctx->counters),
   statistics that come back by request, a forward and backward captured as a CUDA graph and
   replayed bit for bit, non-finite routing without a sync, expert parallelism over nccl; the
   routing recorded on CUDA is the CPU's, and a random assignment replayed on both gives the same
   outputs, loads and gradients; FP8 experts give the CPU's bits.
   Without a usable GPU every case reports as skipped. */
#define _POSIX_C_SOURCE 200809L /* readlink: the other modules are linked, not included */
#include <unistd.h>
#define DSK_MOE_IMPLEMENTATION /* the layer's state (dsk__moe_state: the rows an EP rank sent) */
#include "dsk_comm.h"
#include "dsk_amp.h" /* before dsk_moe.h: the FP8 experts */
#include "dsk_moe.h"
#include "tests/dsk_test.h"
#include <cuda_runtime.h> /* the emulator's declares cuda_emu_launches */

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

/* The CUDA layer's record of its last forward is the CPU layer's; then a fresh random assignment
   (K distinct experts per token) replayed on both: y, the loads, dx and every gradient agree, and
   the CUDA record is the assignment. */
static void replay_case(dsk_ctx *gctx, const gcase *c, dsk_moe *cm, dsk_moe *gm, const dsk_tensor *hx,
                        const dsk_tensor *gx, dsk_tensor *hy, dsk_tensor *gy, double rt, double at) {
    int64_t rs[2] = {c->T, c->K}, shp[2] = {c->T, c->D}, TK = (int64_t)c->T * c->K;
    dsk_tensor crec, grec, asg, hdy, hdx, gdy, gdx;
    dsk_moe_stats cs, gs;
    int bf = c->dt == DSK_BF16;
    dsk_tensor_alloc(NULL, &crec, DSK_I32, 2, rs);
    dsk_tensor_alloc(NULL, &grec, DSK_I32, 2, rs);
    dsk_tensor_alloc(NULL, &asg, DSK_I32, 2, rs);
    DSK_TEST_OK(dsk_moe_routing(cm, NULL, &crec));
    dsk_test_poison_bytes(grec.data, (size_t)TK * 4);
    DSK_TEST_OK(dsk_moe_routing(gm, gctx, &grec));
    DSK_TEST_SAME_BYTES(grec.data, crec.data, (size_t)TK * 4, "routing recorded on CUDA and on the CPU");
    for (int t = 0; t < c->T; t++) {
        int perm[64];
        for (int j = 0; j < c->E; j++) perm[j] = j;
        for (int k = 0; k < c->K; k++) {
            int r = k + (int)dsk_test_rand_int(c->E - k), tmp = perm[k];
            perm[k] = perm[r];
            perm[r] = tmp;
            ((int32_t *)asg.data)[t * c->K + k] = perm[k];
        }
    }
    dsk_tensor_fill(gctx, gy, NAN);
    dsk_tensor_fill(NULL, hy, NAN);
    DSK_TEST_OK(dsk_moe_forward_replay(cm, NULL, hy, hx, &asg, &cs));
    DSK_TEST_OK(dsk_moe_forward_replay(gm, gctx, gy, gx, &asg, &gs));
    compare(gctx, gy, hy, rt, at, "y of a replayed assignment");
    for (int e = 0; e < c->E; e++)
        DSK_TEST_EXPECT(cs.tokens_per_expert[e] == gs.tokens_per_expert[e], "replay: expert %d: cpu %lld cuda %lld", e,
                        (long long)cs.tokens_per_expert[e], (long long)gs.tokens_per_expert[e]);
    dsk_test_poison_bytes(grec.data, (size_t)TK * 4);
    DSK_TEST_OK(dsk_moe_routing(gm, gctx, &grec));
    DSK_TEST_SAME_BYTES(grec.data, asg.data, (size_t)TK * 4, "CUDA record of the replayed forward");
    dsk_tensor_alloc(NULL, &hdy, c->dt, 2, shp); dsk_tensor_alloc(NULL, &hdx, c->dt, 2, shp);
    dsk_tensor_alloc(gctx, &gdy, c->dt, 2, shp); dsk_tensor_alloc(gctx, &gdx, c->dt, 2, shp);
    dsk_tensor_uniform(NULL, &hdy, 21, 0, -1, 1);
    dsk_tensor_fill(NULL, &hdx, 0.0);
    dsk_tensor_copy(gctx, &gdy, &hdy);
    dsk_tensor_fill(gctx, &gdx, 0.0);
    DSK_TEST_OK(dsk_moe_zero_grad(cm, NULL));
    DSK_TEST_OK(dsk_moe_zero_grad(gm, gctx));
    DSK_TEST_OK(dsk_moe_backward(cm, NULL, &hdx, &hdy, 1.0f));
    DSK_TEST_OK(dsk_moe_backward(gm, gctx, &gdx, &gdy, 1.0f));
    compare(gctx, &gdx, &hdx, rt, at, "dx of a replayed assignment");
    for (int i = 0; i < cm->n_params; i++) {
        char what[128];
        if (!cm->params[i].trainable) continue;
        snprintf(what, sizeof what, "replay: grad %s", cm->params[i].name);
        compare(gctx, &gm->params[i].grad, &cm->params[i].grad, bf ? 5e-2 : 1e-3, bf ? 5e-2 : 1e-4, what);
    }
    dsk_tensor_free(NULL, &crec); dsk_tensor_free(NULL, &grec); dsk_tensor_free(NULL, &asg);
    dsk_tensor_free(NULL, &hdy); dsk_tensor_free(NULL, &hdx);
    dsk_tensor_free(gctx, &gdy); dsk_tensor_free(gctx, &gdx);
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
    DSK_TEST_OK(dsk_moe_reserve(&gm, gctx, c->T));
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
    replay_case(gctx, c, &cm, &gm, &hx, &gx, &hy, &gy, rt, at);
    { /* on a device flag: set, nothing changes and the loads keep counting; clear, dsk_moe_update_bias's bias */
        int32_t flag = 1;
        dsk_tensor hflag, dflag;
        DSK_TEST_OK(dsk_tensor_wrap(&hflag, &flag, DSK_I32, dsk_cpu(), 0, NULL));
        DSK_TEST_OK(dsk_tensor_alloc(gctx, &dflag, DSK_I32, 0, NULL));
        DSK_TEST_OK(dsk_tensor_copy(gctx, &dflag, &hflag));
        DSK_TEST_OK(dsk_moe_update_bias_unless(&gm, gctx, &dflag));
        compare(gctx, &gm.bias->value, &cm.bias->value, 0, 0, "bias after an update skipped on the device");
        flag = 0;
        DSK_TEST_OK(dsk_tensor_copy(gctx, &dflag, &hflag));
        DSK_TEST_OK(dsk_moe_update_bias(&cm, NULL, NULL));
        DSK_TEST_OK(dsk_moe_update_bias_unless(&gm, gctx, &dflag));
        compare(gctx, &gm.bias->value, &cm.bias->value, 0, 0, "bias after update");
        dsk_tensor_free(gctx, &dflag);
    }
    dsk_tensor_free(NULL, &hx); dsk_tensor_free(NULL, &hy); dsk_tensor_free(NULL, &hdy); dsk_tensor_free(NULL, &hdx);
    dsk_tensor_free(gctx, &gx); dsk_tensor_free(gctx, &gy); dsk_tensor_free(gctx, &gdy); dsk_tensor_free(gctx, &gdx);
    drop_layer(&cm, &co, NULL);
    drop_layer(&gm, &go, gctx);
    dsk_test_end();
}

/* ---------------------------------------------------------------- one thread, two devices */

/* The same layer on device 0 and device 1, forward and backward alternating between them:
   every launcher makes its context's device current (a launch on a stream of another device
   than the current one fails), and both give the same results. */
static void test_two_devices(dsk_ctx *g0, int ndev) {
    gcase c = {"softmax+shared", 33, 64, 8, 2, 32, 1, 0, 0, DSK_MOE_SOFTMAX, 0, 0.01f, 0, 0, 0, DSK_F32,
               DSK_MOE_GROUP_DEEPSEEK_V3};
    dsk_ctx g1;
    dsk_ctx_opts co;
    dsk_moe m[2];
    owned own[2];
    dsk_moe_opts o;
    dsk_tensor hx, hv, x[2], y[2], dx[2];
    dsk_ctx *ctx[2] = {g0, &g1};
    int64_t shp[2] = {c.T, c.D};
    dsk_test_begin("one thread, two devices: forward and backward alternate between contexts");
    memset(&co, 0, sizeof co);
    co.device = DSK_PREFER_CUDA;
    co.cuda_index = 1;
    if (ndev < 2 || dsk_ctx_init(&g1, &co) != DSK_OK) {
        dsk_test_skip("needs 2 CUDA devices, driven by one thread");
        dsk_test_end();
        return;
    }
    memset(&o, 0, sizeof o);
    o.d_model = c.D; o.n_routed = c.E; o.top_k = c.K; o.d_expert = c.F; o.n_shared = c.n_shared; o.aux_alpha = c.aux;
    o.init_std = 0.3f; o.seed = 5;
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &hx, DSK_F32, 2, shp));
    dsk_tensor_uniform(NULL, &hx, 21, 0, -1, 1);
    for (int d = 0; d < 2; d++) {
        DSK_TEST_OK(make_layer(&m[d], &own[d], ctx[d], &o));
        DSK_TEST_OK(dsk_tensor_alloc(ctx[d], &x[d], DSK_F32, 2, shp));
        DSK_TEST_OK(dsk_tensor_alloc(ctx[d], &y[d], DSK_F32, 2, shp));
        DSK_TEST_OK(dsk_tensor_alloc(ctx[d], &dx[d], DSK_F32, 2, shp));
        DSK_TEST_OK(dsk_tensor_copy(ctx[d], &x[d], &hx));
        DSK_TEST_OK(dsk_tensor_fill(ctx[d], &dx[d], 0.0));
    }
    /* device 0's parameters on device 1, through the host */
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &hv, DSK_U8, 1, own[0].values.shape));
    DSK_TEST_OK(dsk_tensor_copy(ctx[0], &hv, &own[0].values));
    DSK_TEST_OK(dsk_tensor_copy(ctx[1], &own[1].values, &hv));
    for (int d = 1; d >= 0; d--) DSK_TEST_OK(dsk_moe_forward(&m[d], ctx[d], &y[d], &x[d], NULL));
    for (int d = 1; d >= 0; d--) DSK_TEST_OK(dsk_moe_backward(&m[d], ctx[d], &dx[d], &y[d], 1.0f));
    {
        dsk_tensor h1y;
        DSK_TEST_OK(dsk_tensor_alloc(NULL, &h1y, DSK_F32, 2, shp));
        DSK_TEST_OK(dsk_tensor_copy(ctx[1], &h1y, &y[1]));
        compare(ctx[0], &y[0], &h1y, 0, 0, "y on device 0 vs device 1");
        DSK_TEST_OK(dsk_tensor_copy(ctx[1], &h1y, &dx[1]));
        compare(ctx[0], &dx[0], &h1y, 0, 0, "dx on device 0 vs device 1");
        dsk_tensor_free(NULL, &h1y);
    }
    for (int d = 0; d < 2; d++) {
        dsk_tensor_free(ctx[d], &x[d]); dsk_tensor_free(ctx[d], &y[d]); dsk_tensor_free(ctx[d], &dx[d]);
        drop_layer(&m[d], &own[d], ctx[d]);
    }
    dsk_tensor_free(NULL, &hx);
    dsk_tensor_free(NULL, &hv);
    dsk_ctx_free(&g1);
    dsk_test_end();
}

/* ---------------------------------------------------------------- expert parallelism (nccl) */

enum { EP_T = 13, EP_D = 16, EP_E = 8, EP_K = 3, EP_F = 12, EP_FS = 10 };

static dsk_moe_opts ep_opts(int sigmoid) {
    dsk_moe_opts o;
    memset(&o, 0, sizeof o);
    o.d_model = EP_D; o.n_routed = EP_E; o.top_k = EP_K; o.d_expert = EP_F; o.n_shared = 1; o.d_shared = EP_FS;
    o.init_std = 0.5f;
    o.seed = 77;
    o.aux_alpha = 0.05f;
    o.seq_aux_alpha = 0.1f;
    o.seq_len = 2 * EP_T;
    o.z_beta = 0.02f;
    if (sigmoid) { o.score = DSK_MOE_SIGMOID; o.n_group = 4; o.topk_group = 2; o.routed_scale = 2.5f; }
    return o;
}

/* Launches of the grouped GEMMs' rows form so far, as the emulator counts them (-1 on a GPU). */
static int64_t gmm_rows_launches(void) {
#ifdef CUDA_EMU
    return cuda_emu_launches("dsk__k_gmm_rows_simt") + cuda_emu_launches("dsk__k_gmm_rows_bf16") +
           cuda_emu_launches("dsk__k_gmm_rows_f16");
#else
    return -1;
#endif
}

/* One step of a fresh layer of options o on this rank's rows gx, gdy (device): y, dx and the gradient slab
   as host bytes (malloc'd, *n bytes); *syncs, *d2h: what the forward and backward did (after a reserve);
   *chunks (unless NULL): the forward's chunks (stats.ep_chunks); *gmm (unless NULL): the rows-form grouped GEMM
   launches of the forward and backward (gmm_rows_launches). */
static char *ep_step_bytes(dsk_comm *c, dsk_ctx *g, dsk_moe_opts o, const dsk_tensor *gx, const dsk_tensor *gdy,
                           int64_t row0, int64_t NT, size_t *n, int64_t *syncs, int64_t *d2h, int64_t *chunks,
                           int64_t *gmm) {
    dsk_moe m;
    owned mo;
    dsk_tensor gy, gdx, h;
    dsk_ctx_counters c0;
    size_t xb = dsk_tensor_nbytes(gx), gb;
    char *out = NULL;
    memset(&gy, 0, sizeof gy);
    memset(&gdx, 0, sizeof gdx);
    if (make_layer(&m, &mo, g, &o) != DSK_OK || dsk_moe_set_loss_span(&m, c, row0, NT) != DSK_OK ||
        dsk_moe_reserve(&m, g, gx->shape[0]) != DSK_OK || dsk_tensor_alloc(g, &gy, DSK_F32, 2, gx->shape) != DSK_OK ||
        dsk_tensor_alloc(g, &gdx, DSK_F32, 2, gx->shape) != DSK_OK || dsk_tensor_fill(g, &gy, NAN) != DSK_OK ||
        dsk_tensor_fill(g, &gdx, 0.0) != DSK_OK || dsk_ctx_sync(g) != DSK_OK)
        goto done;
    c0 = g->counters;
    if (gmm) *gmm = -gmm_rows_launches();
    if (dsk_moe_forward(&m, g, &gy, gx, NULL) != DSK_OK) goto done;
    if (chunks) *chunks = m.st->fwd_chunks; /* stats.ep_chunks, read without the statistics' copy back */
    if (dsk_moe_backward(&m, g, &gdx, gdy, 1.0f) != DSK_OK) goto done;
    *syncs = g->counters.syncs - c0.syncs;
    *d2h = g->counters.d2h_copies - c0.d2h_copies;
    if (gmm && dsk_ctx_sync(g) != DSK_OK) goto done; /* the emulator counts the launches that ran */
    if (gmm) *gmm += gmm_rows_launches();
    gb = dsk_tensor_nbytes(&mo.grads);
    *n = 2 * xb + gb;
    out = (char *)malloc(*n);
    dsk_tensor_wrap(&h, out, DSK_F32, dsk_cpu(), 2, gx->shape);
    if (dsk_tensor_copy(g, &h, &gy) != DSK_OK) goto fail;
    dsk_tensor_wrap(&h, out + xb, DSK_F32, dsk_cpu(), 2, gx->shape);
    if (dsk_tensor_copy(g, &h, &gdx) != DSK_OK) goto fail;
    dsk_tensor_wrap(&h, out + 2 * xb, DSK_F32, dsk_cpu(), 1, mo.grads.shape);
    if (dsk_tensor_copy(g, &h, &mo.grads) != DSK_OK || dsk_ctx_sync(g) != DSK_OK) goto fail;
    goto done;
fail:
    free(out);
    out = NULL;
done:
    dsk_tensor_free(g, &gy);
    dsk_tensor_free(g, &gdx);
    drop_layer(&m, &mo, g);
    return out;
}

/* The bounded exchange over nccl, dropless and under capacity 0.75: a forward and backward make no host
   sync and no device-to-host copy, and give the exact exchange's y, dx and gradients bit for bit; and so do
   both exchanges with ep_overlap (issued on the layer's exchange stream, beside the shared experts and the
   router's backward), with the serial exchange's syncs, and the exact one chunked (ep_chunk ON: the experts
   start on this rank's own rows while the ring shifts carry the others', a chunk a rank, each chunk's rows-form
   GEMMs a launch each whatever the experts a rank holds: the serial step's count a chunk, on the emulator; AUTO
   does not chunk a CUDA layer, across the emulated hosts too), and the bounded one chunked, still without a host
   sync; and FP8 dispatch overlapped gives its serial bits. */
static void ep_bounded_check(dsk_comm *c, dsk_ctx *g, dsk_moe_opts o, const dsk_tensor *gx, const dsk_tensor *gdy,
                             int64_t row0, int64_t NT) {
    static const char *names[] = {"",
                                  "bounded serial",
                                  "exact overlapped",
                                  "bounded overlapped",
                                  "exact overlapped chunked",
                                  "exact overlapped with ep_chunk AUTO",
                                  "bounded overlapped chunked"};
    for (int cap = 0; cap < 2; cap++) {
        size_t na = 0;
        int64_t sa = -1, da = -1, gmm_a = -1;
        char *a;
        o.capacity_factor = cap ? 0.75f : 0.0f;
        o.ep_exchange = DSK_MOE_EP_EXACT;
        o.ep_overlap = 0;
        a = ep_step_bytes(c, g, o, gx, gdy, row0, NT, &na, &sa, &da, NULL, &gmm_a);
        DSK_TEST_EXPECT(a, "capacity %g: the exact step failed: %s", (double)o.capacity_factor, dsk_last_error());
        DSK_TEST_EXPECT(sa == 1, "capacity %g: exact EP: %lld syncs (want the counts' 1)", (double)o.capacity_factor,
                        (long long)sa);
        for (int v = 1; v < 7; v++) {
            size_t nb = 0;
            int exact = v == 2 || v == 4 || v == 5, chunked = v == 4 || v == 6;
            int64_t sb = -1, db = -1, want = exact ? 1 : 0, chunks = -1, gmm = -1;
            int64_t want_chunks = chunked ? c->world_size : 0; /* own, then a rank each; AUTO: CPU layers only */
            char *b;
            o.ep_exchange = exact ? DSK_MOE_EP_EXACT : DSK_MOE_EP_BOUNDED;
            o.ep_overlap = v >= 2;
            o.ep_chunk = chunked ? DSK_MOE_CHUNK_ON : v == 5 ? DSK_MOE_CHUNK_AUTO : DSK_MOE_CHUNK_OFF;
            b = ep_step_bytes(c, g, o, gx, gdy, row0, NT, &nb, &sb, &db, &chunks, &gmm);
            DSK_TEST_EXPECT(b, "capacity %g: %s: the step failed: %s", (double)o.capacity_factor, names[v],
                            dsk_last_error());
            DSK_TEST_EXPECT(sb == want && db == (exact ? da : 0),
                            "capacity %g: %s EP forward+backward: %lld syncs, %lld copies back (want %lld, %lld)",
                            (double)o.capacity_factor, names[v], (long long)sb, (long long)db, (long long)want,
                            (long long)(exact ? da : 0));
            DSK_TEST_EXPECT(!b || chunks == want_chunks, "capacity %g: %s: %lld chunks, want %lld",
                            (double)o.capacity_factor, names[v], (long long)chunks, (long long)want_chunks);
            if (chunked && gmm_a >= 0) /* on the emulator: at most the serial count a chunk (an empty one has none) */
                DSK_TEST_EXPECT(gmm > 0 && gmm <= chunks * gmm_a,
                                "capacity %g: %s: %lld rows-form grouped GEMM launches, want 1 to %lld (serial %lld "
                                "a step, %lld chunks; %d experts a rank)",
                                (double)o.capacity_factor, names[v], (long long)gmm, (long long)(chunks * gmm_a),
                                (long long)gmm_a, (long long)chunks, EP_E / c->world_size);
            if (a && b) {
                DSK_TEST_EXPECT(na == nb, "%s: sizes %zu and %zu", names[v], na, nb);
                DSK_TEST_SAME_BYTES(b, a, na < nb ? na : nb, names[v]);
            }
            free(b);
        }
        free(a);
    }
    o.capacity_factor = 0.0f;
    o.ep_exchange = DSK_MOE_EP_EXACT;
    o.ep_dispatch = DSK_MOE_DISPATCH_FP8;
    {
        size_t n[2] = {0, 0};
        int64_t sy[2] = {-1, -1}, d2h[2] = {-1, -1};
        char *r[2];
        for (int ov = 0; ov < 2; ov++) {
            o.ep_overlap = ov;
            r[ov] = ep_step_bytes(c, g, o, gx, gdy, row0, NT, &n[ov], &sy[ov], &d2h[ov], NULL, NULL);
        }
        DSK_TEST_EXPECT(r[0] && r[1], "FP8 dispatch: a step failed: %s", dsk_last_error());
        DSK_TEST_EXPECT(sy[1] == sy[0] && d2h[1] == d2h[0], "FP8 dispatch overlapped: %lld syncs, %lld copies back",
                        (long long)sy[1], (long long)d2h[1]);
        if (r[0] && r[1]) {
            DSK_TEST_EXPECT(n[0] == n[1], "FP8 dispatch: sizes %zu and %zu", n[0], n[1]);
            DSK_TEST_SAME_BYTES(r[1], r[0], n[0] < n[1] ? n[0] : n[1], "FP8 dispatch overlapped = serial");
        }
        free(r[0]);
        free(r[1]);
    }
}

/* Two micro-batches (gx, gdy; then gdy, gx) through a fresh layer of options o, reserved in `slots` saved
   forwards: serially (slots 1) or both forwards before the backwards (slots 2, micro-batch i in slot i), each
   call in one piece, (split 1) in its begin and end, or (split 2) in all its steps (begin, wait, experts, the
   return's begin, wait, end). y, dx of each and the gradient slab as host bytes (malloc'd, *n bytes); *syncs: the
   host syncs of the four calls. */
static char *ep_slots_bytes(dsk_comm *c, dsk_ctx *g, dsk_moe_opts o, const dsk_tensor *gx, const dsk_tensor *gdy,
                            int64_t row0, int64_t NT, int slots, int split, size_t *n, int64_t *syncs) {
    static const int order[2][4] = {{0, 2, 1, 3}, {0, 1, 2, 3}}; /* calls: 0, 1 the forwards, 2, 3 the backwards */
    const dsk_tensor *in[2][2] = {{gx, gdy}, {gdy, gx}};         /* [micro-batch]: x, dy */
    dsk_moe m;
    owned mo;
    dsk_tensor out[4], h; /* y0, y1, dx0, dx1 */
    size_t xb = dsk_tensor_nbytes(gx), gb;
    int64_t s0;
    char *bytes = NULL;
    int ok;
    memset(out, 0, sizeof out);
    ok = make_layer(&m, &mo, g, &o) == DSK_OK && dsk_moe_set_loss_span(&m, c, row0, NT) == DSK_OK &&
         dsk_moe_set_slots(&m, g, slots) == DSK_OK && dsk_moe_reserve(&m, g, gx->shape[0]) == DSK_OK;
    for (int i = 0; ok && i < 4; i++)
        ok = dsk_tensor_alloc(g, &out[i], DSK_F32, 2, gx->shape) == DSK_OK &&
             dsk_tensor_fill(g, &out[i], i < 2 ? NAN : 0.0) == DSK_OK;
    ok = ok && dsk_ctx_sync(g) == DSK_OK;
    s0 = g->counters.syncs;
    for (int k = 0; ok && k < 4; k++) {
        int call = order[slots - 1][k], mb = call % 2;
        ok = dsk_moe_use_slot(&m, slots == 2 ? mb : 0) == DSK_OK;
        if (ok && split)
            ok = (call < 2 ? dsk_moe_forward_begin(&m, g, in[mb][0])
                           : dsk_moe_backward_begin(&m, g, in[mb][1], 1.0f)) == DSK_OK;
        if (ok && split == 2)
            ok = dsk_moe_wait(&m, g) == DSK_OK && dsk_moe_experts(&m, g) == DSK_OK &&
                 dsk_moe_return_begin(&m, g) == DSK_OK && dsk_moe_wait(&m, g) == DSK_OK;
        if (ok && split)
            ok = (call < 2 ? dsk_moe_forward_end(&m, g, &out[mb], NULL) : dsk_moe_backward_end(&m, g, &out[2 + mb])) ==
                 DSK_OK;
        else if (ok)
            ok = (call < 2 ? dsk_moe_forward(&m, g, &out[mb], in[mb][0], NULL)
                           : dsk_moe_backward(&m, g, &out[2 + mb], in[mb][1], 1.0f)) == DSK_OK;
    }
    *syncs = g->counters.syncs - s0;
    gb = dsk_tensor_nbytes(&mo.grads);
    *n = 4 * xb + gb;
    if (ok) bytes = (char *)malloc(*n);
    for (int i = 0; bytes && ok && i < 5; i++) {
        if (i < 4) dsk_tensor_wrap(&h, bytes + i * xb, DSK_F32, dsk_cpu(), 2, gx->shape);
        else dsk_tensor_wrap(&h, bytes + 4 * xb, DSK_F32, dsk_cpu(), 1, mo.grads.shape);
        ok = dsk_tensor_copy(g, &h, i < 4 ? &out[i] : &mo.grads) == DSK_OK;
    }
    if (!ok || dsk_ctx_sync(g) != DSK_OK) {
        free(bytes);
        bytes = NULL;
    }
    for (int i = 0; i < 4; i++) dsk_tensor_free(g, &out[i]);
    drop_layer(&m, &mo, g);
    return bytes;
}

/* Saved forwards over nccl: two micro-batches in 2 slots, calls in one piece, split in begin and end or in all
   their steps, give the serial order's y, dx and gradients bit for bit, with the exact exchange, the bounded
   one overlapped (whose calls make no host sync) and the exact and bounded ones overlapped and chunked. */
static void ep_slots_check(dsk_comm *c, dsk_ctx *g, dsk_moe_opts o, const dsk_tensor *gx, const dsk_tensor *gdy,
                           int64_t row0, int64_t NT) {
    for (int v = 0; v < 4; v++) { /* exact serial, bounded overlapped, exact and bounded overlapped and chunked */
        static const char *what[] = {"", "2 slots = serial: y, dx, gradients", "2 slots, split = serial",
                                     "2 slots, in steps = serial"};
        static const char *ways[] = {"exact", "bounded", "exact chunked", "bounded chunked"};
        size_t n[4] = {0, 0, 0, 0};
        int64_t sy[4] = {-1, -1, -1, -1};
        int bounded = v == 1 || v == 3;
        char *r[4];
        o.ep_exchange = bounded ? DSK_MOE_EP_BOUNDED : DSK_MOE_EP_EXACT;
        o.ep_overlap = v > 0;
        o.ep_chunk = v >= 2 ? DSK_MOE_CHUNK_ON : DSK_MOE_CHUNK_OFF;
        for (int k = 0; k < 4; k++) /* 1 slot; 2; 2 split; 2 in steps */
            r[k] = ep_slots_bytes(c, g, o, gx, gdy, row0, NT, k ? 2 : 1, k >= 2 ? k - 1 : 0, &n[k], &sy[k]);
        DSK_TEST_EXPECT(r[0] && r[1] && r[2] && r[3], "saved forwards (%s): a run failed: %s", ways[v],
                        dsk_last_error());
        DSK_TEST_EXPECT(!bounded || (sy[0] == 0 && sy[1] == 0 && sy[2] == 0 && sy[3] == 0),
                        "%s: %lld, %lld, %lld and %lld host syncs (want 0)", ways[v], (long long)sy[0],
                        (long long)sy[1], (long long)sy[2], (long long)sy[3]);
        for (int k = 1; k < 4 && r[0]; k++)
            if (r[k]) DSK_TEST_SAME_BYTES(r[k], r[0], n[0] < n[k] ? n[0] : n[k], what[k]);
        for (int k = 0; k < 4; k++) free(r[k]);
    }
}

/* Every rank's batch empty (the bounded exchange needs one T): the exact exchange and the bounded one serial,
   overlapped and chunked run through and give the same (empty) y and dx and gradients, the bounded ones with no
   host sync. */
static void ep_empty_check(dsk_comm *c, dsk_ctx *g, dsk_moe_opts o, const dsk_tensor *gx, const dsk_tensor *gdy) {
    static const char *names[] = {"exact serial", "bounded serial", "bounded overlapped", "bounded overlapped chunked"};
    dsk_tensor x0, dy0;
    size_t n[4] = {0, 0, 0, 0};
    char *r[4];
    DSK_TEST_OK(dsk_tensor_slice(gx, 0, 0, 0, &x0));
    DSK_TEST_OK(dsk_tensor_slice(gdy, 0, 0, 0, &dy0));
    for (int v = 0; v < 4; v++) {
        int64_t sy = -1, d2h = -1;
        o.ep_exchange = v ? DSK_MOE_EP_BOUNDED : DSK_MOE_EP_EXACT;
        o.ep_overlap = v >= 2;
        o.ep_chunk = v == 3 ? DSK_MOE_CHUNK_ON : DSK_MOE_CHUNK_OFF;
        r[v] = ep_step_bytes(c, g, o, &x0, &dy0, 0, 0, &n[v], &sy, &d2h, NULL, NULL);
        DSK_TEST_EXPECT(r[v], "every batch empty: %s: the step failed: %s", names[v], dsk_last_error());
        DSK_TEST_EXPECT(!v || (sy == 0 && d2h == 0), "every batch empty: %s: %lld syncs, %lld copies back (want 0)",
                        names[v], (long long)sy, (long long)d2h);
        if (v && r[0] && r[v]) {
            DSK_TEST_EXPECT(n[v] == n[0], "every batch empty: %s: %zu bytes, the exact %zu", names[v], n[v], n[0]);
            DSK_TEST_SAME_BYTES(r[v], r[0], n[0] < n[v] ? n[0] : n[v], names[v]);
        }
    }
    for (int v = 0; v < 4; v++) free(r[v]);
}

/* Two hops over the emulated hosts (ep_route TWO_HOP; AUTO routes flat on CUDA): the CUDA layer routed in two
   hops (serial and with ep_overlap) gives the flat route's y, dx and gradients bit for bit, dropless and under
   capacity 0.75; the host syncs of its forward and backward are printed (the route is planned on the host). */
static void ep_two_hop_check(dsk_comm *c, dsk_ctx *g, dsk_moe_opts o, const dsk_tensor *gx, const dsk_tensor *gdy,
                             int64_t row0, int64_t NT) {
    for (int cap = 0; cap < 2; cap++) {
        size_t na = 0;
        int64_t sa, da;
        char *a;
        o.capacity_factor = cap ? 0.75f : 0.0f;
        o.ep_route = DSK_MOE_ROUTE_FLAT;
        o.ep_overlap = 0;
        a = ep_step_bytes(c, g, o, gx, gdy, row0, NT, &na, &sa, &da, NULL, NULL);
        DSK_TEST_EXPECT(a, "capacity %g: the flat step failed: %s", (double)o.capacity_factor, dsk_last_error());
        o.ep_route = DSK_MOE_ROUTE_TWO_HOP;
        for (int ov = 0; ov < 2; ov++) {
            size_t nb = 0;
            int64_t sb, db;
            char *b;
            o.ep_overlap = ov;
            b = ep_step_bytes(c, g, o, gx, gdy, row0, NT, &nb, &sb, &db, NULL, NULL);
            DSK_TEST_EXPECT(b, "capacity %g: the two-hop step failed: %s", (double)o.capacity_factor, dsk_last_error());
            if (!cap && !ov && c->rank == 0)
                printf(
                    "# rank 0: a two-hop forward and backward: %lld host syncs, %lld copies back (flat: %lld, %lld)\n",
                    (long long)sb, (long long)db, (long long)sa, (long long)da);
            if (a && b) {
                DSK_TEST_EXPECT(na == nb, "two hops: sizes %zu and %zu", na, nb);
                DSK_TEST_SAME_BYTES(b, a, na < nb ? na : nb,
                                    ov ? "two hops overlapped: y, dx, gradients = flat"
                                       : "two hops: y, dx, gradients = flat");
            }
            free(b);
        }
        free(a);
    }
}

/* One rank of an expert-parallel step: the global batch (every rank draws the same one),
   one CPU layer over all of it as the reference, and this rank's CUDA layer (its experts
   copied from the reference) over its rows, its loss span the global batch over the nccl world
   (sequences of 2 EP_T rows straddling ranks); compares y, dx, its experts' gradients, the
   dense gradients summed over ranks (an nccl all-reduce), the EP-group loads and the loss
   values (the global batch's on every rank); then a span whose rows do not add up to its
   total_rows makes the loss NaN without a host sync. hosts: the ranks' halves on two emulated hosts, where the
   layer routes in two hops (ep_route AUTO), and two hops against flat. */
static int ep_rank(int sigmoid, int hosts) {
    dsk_comm c;
    dsk_comm_opts co;
    dsk_ctx g;
    dsk_ctx_opts go;
    dsk_moe ref, m;
    owned ro, mo;
    dsk_moe_opts o = ep_opts(sigmoid);
    dsk_moe_stats rs, gs;
    dsk_tensor x, dy, y, dx, gx, gdy, gy, gdx, xs, dys, ys, dxs;
    int64_t NT, shp[2];
    int n, me;
    memset(&co, 0, sizeof co);
    co.backend = DSK_COMM_NCCL;
    co.timeout_s = 120;
    if (hosts) { /* the launcher's RANK and WORLD_SIZE: the first half on one host, the rest on the other */
        const char *r = getenv("RANK"), *w = getenv("WORLD_SIZE");
        co.host_id = 2 * atoi(r ? r : "0") < atoi(w ? w : "1") ? "emulated-host-a" : "emulated-host-b";
    }
    if (dsk_comm_init_env(&c, &co) != DSK_OK) { printf("nccl init: %s\n", dsk_last_error()); return 3; }
    n = c.world_size;
    me = c.rank;
    NT = (int64_t)EP_T * n;
    memset(&go, 0, sizeof go);
    go.device = DSK_PREFER_CUDA;
    go.cuda_index = c.cuda_device;
    if (dsk_ctx_init(&g, &go) != DSK_OK) { printf("ctx: %s\n", dsk_last_error()); return 3; }
    dsk_test_begin("expert parallel rank %d of %d", me, n);
    shp[0] = NT; shp[1] = EP_D;
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &x, DSK_F32, 2, shp));
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &dy, DSK_F32, 2, shp));
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &y, DSK_F32, 2, shp));
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &dx, DSK_F32, 2, shp));
    dsk_tensor_uniform(NULL, &x, 31, 0, -1, 1);
    dsk_tensor_uniform(NULL, &dy, 32, 0, -1, 1);
    dsk_tensor_fill(NULL, &dx, 0.0);
    DSK_TEST_OK(make_layer(&ref, &ro, NULL, &o));
    DSK_TEST_OK(dsk_moe_forward(&ref, NULL, &y, &x, &rs));
    DSK_TEST_OK(dsk_moe_backward(&ref, NULL, &dx, &dy, 1.0f));
    o.ep = &c;
    { /* two hops with the bounded exchange fail init, naming why */
        dsk_moe bad;
        dsk_moe_opts b = o;
        b.ep_route = DSK_MOE_ROUTE_TWO_HOP;
        b.ep_exchange = DSK_MOE_EP_BOUNDED;
        DSK_TEST_STATUS(dsk_moe_init(&bad, &g, &b), DSK_ERR_UNSUPPORTED);
        DSK_TEST_ERROR_MENTIONS("ep_route two-hop needs the exact exchange");
    }
    DSK_TEST_EXPECT(c.n_nodes == (hosts ? 2 : 1), "%d nodes", c.n_nodes);
    DSK_TEST_OK(make_layer(&m, &mo, &g, &o));
    DSK_TEST_OK(dsk_moe_set_loss_span(&m, &c, (int64_t)me * EP_T, NT));
    for (int i = 0; i < m.n_params; i++) { /* the reference's parameters; experts: this rank's slice */
        dsk_tensor src = ref.params[i].value;
        if (src.ndim == 3) DSK_TEST_OK(dsk_tensor_slice(&ref.params[i].value, 0, m.expert0, m.n_local, &src));
        DSK_TEST_OK(dsk_tensor_copy(&g, &m.params[i].value, &src));
    }
    DSK_TEST_OK(dsk_tensor_slice(&x, 0, me * EP_T, EP_T, &xs));
    DSK_TEST_OK(dsk_tensor_slice(&dy, 0, me * EP_T, EP_T, &dys));
    DSK_TEST_OK(dsk_tensor_slice(&y, 0, me * EP_T, EP_T, &ys));
    DSK_TEST_OK(dsk_tensor_slice(&dx, 0, me * EP_T, EP_T, &dxs));
    shp[0] = EP_T;
    DSK_TEST_OK(dsk_tensor_alloc(&g, &gx, DSK_F32, 2, shp));
    DSK_TEST_OK(dsk_tensor_alloc(&g, &gdy, DSK_F32, 2, shp));
    DSK_TEST_OK(dsk_tensor_alloc(&g, &gy, DSK_F32, 2, shp));
    DSK_TEST_OK(dsk_tensor_alloc(&g, &gdx, DSK_F32, 2, shp));
    DSK_TEST_OK(dsk_tensor_copy(&g, &gx, &xs));
    DSK_TEST_OK(dsk_tensor_copy(&g, &gdy, &dys));
    DSK_TEST_OK(dsk_tensor_fill(&g, &gy, NAN));
    DSK_TEST_OK(dsk_tensor_fill(&g, &gdx, 0.0));
    { /* expert parallelism keeps one host sync per forward (the counts), none in backward (AUTO routes flat on
           CUDA, also across hosts) */
        dsk_ctx_counters c0;
        int64_t sent = 0, back, want_syncs = 1, want_d2h = 2;
        DSK_TEST_OK(dsk_ctx_sync(&g));
        c0 = g.counters;
        DSK_TEST_OK(dsk_moe_forward(&m, &g, &gy, &gx, NULL));
        DSK_TEST_EXPECT(g.counters.syncs - c0.syncs == want_syncs && g.counters.d2h_copies - c0.d2h_copies == want_d2h,
                        "EP forward: %lld syncs, %lld copies back (want %lld and %lld)",
                        (long long)(g.counters.syncs - c0.syncs), (long long)(g.counters.d2h_copies - c0.d2h_copies),
                        (long long)want_syncs, (long long)want_d2h);
        back = g.counters.d2h_bytes - c0.d2h_bytes;
        c0 = g.counters;
        DSK_TEST_OK(dsk_moe_backward(&m, &g, &gdx, &gdy, 1.0f));
        DSK_TEST_EXPECT(g.counters.syncs == c0.syncs && g.counters.d2h_copies == c0.d2h_copies,
                        "EP backward: %lld syncs", (long long)(g.counters.syncs - c0.syncs));
        for (int r = 0; r < n; r++) sent += m.st->f->send_rows[r];
        printf("# rank %d: EP forward, 1 sync, %lld bytes of counts back; rows sent %lld of %lld bytes (a bounded "
               "exchange without the sync: %lld bytes)\n", me, (long long)back,
               (long long)sent, (long long)(sent * EP_D * 4), (long long)((int64_t)n * EP_T * EP_K * EP_D * 4));
        DSK_TEST_OK(dsk_moe_zero_grad(&m, &g));
        DSK_TEST_OK(dsk_tensor_fill(&g, &gdx, 0.0));
    }
    DSK_TEST_OK(dsk_moe_forward(&m, &g, &gy, &gx, &gs));
    DSK_TEST_OK(dsk_moe_backward(&m, &g, &gdx, &gdy, 1.0f));
    compare(&g, &gy, &ys, 2e-4, 2e-5, "y of this rank's rows");
    compare(&g, &gdx, &dxs, 2e-4, 2e-5, "dx of this rank's rows");
    DSK_TEST_EXPECT(gs.tokens == NT, "tokens %lld, want %lld", (long long)gs.tokens, (long long)NT);
    {
        double got[4] = {gs.aux_loss, gs.seq_aux_loss, gs.z_loss, gs.loss};
        double want[4] = {rs.aux_loss, rs.seq_aux_loss, rs.z_loss, rs.loss};
        DSK_TEST_CLOSE64(got, want, 4, 1e-4, 1e-9, "loss values of the span = one layer's over the global batch");
        DSK_TEST_EXPECT(rs.aux_loss > 0 && rs.seq_aux_loss > 0 && rs.z_loss > 0, "loss terms not all on");
    }
    for (int e = 0; e < EP_E; e++)
        DSK_TEST_EXPECT(gs.tokens_per_expert[e] == rs.tokens_per_expert[e], "expert %d: EP-group load %lld, one layer %lld", e,
                        (long long)gs.tokens_per_expert[e], (long long)rs.tokens_per_expert[e]);
    for (int i = 0; i < m.n_params; i++) {
        dsk_tensor want = ref.params[i].grad;
        char what[128];
        if (!m.params[i].trainable) continue;
        if (want.ndim == 3) DSK_TEST_OK(dsk_tensor_slice(&ref.params[i].grad, 0, m.expert0, m.n_local, &want));
        else DSK_TEST_OK(dsk_comm_all_reduce(&c, &g, m.params[i].grad.data, m.params[i].grad.data, dsk_tensor_numel(&want), DSK_F32,
                                             DSK_COMM_SUM)); /* dense: partial sums over this rank's tokens */
        DSK_TEST_OK(dsk_comm_sync(&c, &g));
        snprintf(what, sizeof what, "grad %s", ref.params[i].name);
        compare(&g, &m.params[i].grad, &want, 1e-3, 1e-4, what);
    }
    ep_bounded_check(&c, &g, o, &gx, &gdy, (int64_t)me * EP_T, NT);
    ep_slots_check(&c, &g, o, &gx, &gdy, (int64_t)me * EP_T, NT);
    ep_empty_check(&c, &g, o, &gx, &gdy);
    if (hosts) ep_two_hop_check(&c, &g, o, &gx, &gdy, (int64_t)me * EP_T, NT);
    { /* rows adding up to NT, total_rows NT + 2 EP_T (whole sequences): NaN values, no host sync in the forward */
        dsk_ctx_counters c0;
        dsk_moe_stats bs;
        DSK_TEST_OK(dsk_moe_set_loss_span(&m, &c, (int64_t)me * EP_T, NT + 2 * EP_T));
        DSK_TEST_OK(dsk_ctx_sync(&g));
        c0 = g.counters;
        DSK_TEST_OK(dsk_moe_forward(&m, &g, &gy, &gx, NULL));
        DSK_TEST_EXPECT(g.counters.syncs - c0.syncs == 1, "EP forward with a bad span: %lld syncs (want the counts' 1)",
                        (long long)(g.counters.syncs - c0.syncs));
        DSK_TEST_OK(dsk_moe_forward(&m, &g, &gy, &gx, &bs));
        DSK_TEST_EXPECT(bs.loss != bs.loss && bs.aux_loss != bs.aux_loss,
                        "rows 13 x %d of total_rows %lld: loss %g, "
                        "want NaN",
                        n, (long long)(NT + 2 * EP_T), bs.loss);
    }
    dsk_tensor_free(NULL, &x); dsk_tensor_free(NULL, &dy); dsk_tensor_free(NULL, &y); dsk_tensor_free(NULL, &dx);
    dsk_tensor_free(&g, &gx); dsk_tensor_free(&g, &gdy); dsk_tensor_free(&g, &gy); dsk_tensor_free(&g, &gdx);
    drop_layer(&m, &mo, &g);
    drop_layer(&ref, &ro, NULL);
    dsk_test_end();
    dsk_ctx_free(&g);
    dsk_comm_free(&c);
    return dsk_test_g.failed ? 1 : 0;
}

/* Starts `ranks` processes of this program, each one rank of ep_rank() (hosts: on two emulated hosts). */
static void run_ep(int ranks, int ndev, int sigmoid, int hosts) {
    char self[4096],
        *av[] = {self, (char *)"--ep-rank", (char *)(sigmoid ? "1" : "0"), (char *)(hosts ? "2" : "1"), NULL};
    ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
    dsk_comm_spawn_opts so;
    int worst = -1, port = 0;
    dsk_test_begin("expert parallel over %d ranks on the nccl backend (%s)%s = one CPU layer", ranks,
                   sigmoid ? "sigmoid+groups" : "softmax", hosts ? " on 2 emulated hosts, two hops = flat" : "");
    if (ndev < ranks) {
        dsk_test_skip("needs %d CUDA devices (one per rank), %d present", ranks, ndev);
        dsk_test_end();
        return;
    }
    self[k > 0 ? k : 0] = 0;
    DSK_TEST_OK(dsk_comm_free_port("127.0.0.1", &port));
    memset(&so, 0, sizeof so);
    so.master_port = port;
    so.timeout_s = 300;
    fflush(stdout);
    DSK_TEST_OK(dsk_comm_spawn_local(ranks, av, &so, &worst));
    DSK_TEST_EXPECT(worst == 0, "ranks exited with status %d", worst);
    dsk_test_end();
}

/* ---------------------------------------------------------------- no host sync, CUDA graphs */

/* Host bits of a device tensor (raw bytes), malloc'd. */
static void *to_host_bytes(dsk_ctx *ctx, const dsk_tensor *t) {
    dsk_tensor h;
    void *p = malloc(dsk_tensor_nbytes(t) + 1);
    dsk_tensor_wrap(&h, p, t->dtype, dsk_cpu(), t->ndim, t->shape);
    if (dsk_tensor_copy(ctx, &h, t) != DSK_OK) { free(p); return NULL; }
    return p;
}

/* A layer with every device-side decision in play (sigmoid, groups, capacity by weight, the
   three losses, shared experts, bf16): after dsk_moe_reserve, one forward and one backward make
   no synchronising call and no device-to-host copy; the statistics then come back by request,
   equal to the CPU layer's; the same forward and backward captured as a CUDA graph and replayed
   twice give the eager call's y, dx and gradients bit for bit. */
static void test_no_sync_and_graph(dsk_ctx *gctx) {
    gcase c = {"v3-like", 96, 64, 16, 4, 32, 1, 4, 2, DSK_MOE_SIGMOID, 0.75f, 0.01f, 0.01f, 0.001f, 32, DSK_BF16,
               DSK_MOE_GROUP_DEEPSEEK_V3};
    dsk_moe gm, cm;
    owned go, co;
    dsk_moe_opts o;
    dsk_moe_stats gs, cs;
    dsk_tensor hx, hdy, hy, hdx, gx, gdy, gy, gdx;
    dsk_graph graph;
    int64_t shp[2] = {c.T, c.D};
    dsk_ctx_counters before;
    void *eager[3] = {NULL, NULL, NULL};
    dsk_test_begin("cuda: forward + backward without a host sync; statistics by request; graph replay = eager");
    if (!dsk_cuda_available()) { dsk_test_skip("no usable CUDA device"); dsk_test_end(); return; }
    memset(&graph, 0, sizeof graph);
    memset(&o, 0, sizeof o);
    o.d_model = c.D; o.n_routed = c.E; o.top_k = c.K; o.d_expert = c.F; o.n_shared = c.n_shared;
    o.n_group = c.n_group; o.topk_group = c.topk_group; o.score = c.score; o.capacity_factor = c.cf;
    o.aux_alpha = c.aux; o.seq_aux_alpha = c.seq_aux; o.z_beta = c.z; o.seq_len = c.seq_len; o.dtype = c.dt;
    o.init_std = 0.3f; o.seed = 5; o.routed_scale = 2.5f;
    DSK_TEST_OK(make_layer(&gm, &go, gctx, &o));
    DSK_TEST_OK(make_layer(&cm, &co, NULL, &o));
    dsk_tensor_uniform(NULL, &cm.bias->value, 9, 0, -0.05f, 0.05f);
    DSK_TEST_OK(dsk_tensor_copy(gctx, &go.values, &co.values));
    dsk_tensor_alloc(NULL, &hx, c.dt, 2, shp); dsk_tensor_alloc(NULL, &hdy, c.dt, 2, shp);
    dsk_tensor_alloc(NULL, &hy, c.dt, 2, shp); dsk_tensor_alloc(NULL, &hdx, c.dt, 2, shp);
    dsk_tensor_alloc(gctx, &gx, c.dt, 2, shp); dsk_tensor_alloc(gctx, &gdy, c.dt, 2, shp);
    dsk_tensor_alloc(gctx, &gy, c.dt, 2, shp); dsk_tensor_alloc(gctx, &gdx, c.dt, 2, shp);
    dsk_tensor_uniform(NULL, &hx, 41, 0, -1, 1);
    dsk_tensor_uniform(NULL, &hdy, 42, 0, -1, 1);
    DSK_TEST_OK(dsk_tensor_copy(gctx, &gx, &hx));
    DSK_TEST_OK(dsk_tensor_copy(gctx, &gdy, &hdy));
    DSK_TEST_OK(dsk_moe_reserve(&gm, gctx, c.T));
    DSK_TEST_OK(dsk_moe_stats_request(&gm, gctx)); /* statistics from here on */
    DSK_TEST_OK(dsk_tensor_fill(gctx, &gdx, 0.0));
    DSK_TEST_OK(dsk_ctx_sync(gctx));
    before = gctx->counters;
    DSK_TEST_OK(dsk_moe_forward(&gm, gctx, &gy, &gx, NULL));
    DSK_TEST_OK(dsk_moe_backward(&gm, gctx, &gdx, &gdy, 0.5f));
    DSK_TEST_EXPECT(gctx->counters.syncs == before.syncs && gctx->counters.d2h_copies == before.d2h_copies,
                    "forward + backward made %lld syncs and %lld device-to-host copies",
                    (long long)(gctx->counters.syncs - before.syncs),
                    (long long)(gctx->counters.d2h_copies - before.d2h_copies));
    /* statistics, a step later, against the CPU layer's */
    DSK_TEST_OK(dsk_moe_stats_request(&gm, gctx));
    DSK_TEST_OK(dsk_ctx_sync(gctx));
    DSK_TEST_OK(dsk_moe_stats_collect(&gm, gctx, &gs));
    DSK_TEST_OK(dsk_moe_forward(&cm, NULL, &hy, &hx, &cs));
    DSK_TEST_EXPECT(gs.calls == 1 && gs.tokens == c.T && gs.dropped == cs.dropped && cs.dropped > 0,
                    "calls %lld tokens %lld dropped %lld (cpu %lld)", (long long)gs.calls, (long long)gs.tokens,
                    (long long)gs.dropped, (long long)cs.dropped);
    {
        double got[3] = {gs.aux_loss, gs.seq_aux_loss, gs.z_loss}, want[3] = {cs.aux_loss, cs.seq_aux_loss, cs.z_loss};
        int bad = 0;
        DSK_TEST_CLOSE64(got, want, 3, 1e-3, 1e-9, "loss terms, collected");
        for (int e = 0; e < c.E; e++) bad += gs.tokens_per_expert[e] != cs.tokens_per_expert[e];
        DSK_TEST_EXPECT(bad == 0, "%d experts' loads differ from the CPU's", bad);
    }
    /* the eager results, then the same calls captured once and replayed twice */
    eager[0] = to_host_bytes(gctx, &gy);
    eager[1] = to_host_bytes(gctx, &gdx);
    eager[2] = to_host_bytes(gctx, &go.grads);
    DSK_TEST_OK(dsk_graph_begin(gctx));
    {
        dsk_status s1 = dsk_moe_zero_grad(&gm, gctx), s2 = dsk_tensor_fill(gctx, &gdx, 0.0);
        dsk_status s3 = dsk_moe_forward(&gm, gctx, &gy, &gx, NULL), s4 = dsk_moe_backward(&gm, gctx, &gdx, &gdy, 0.5f);
        DSK_TEST_OK(dsk_graph_end(gctx, &graph));
        DSK_TEST_OK(s1); DSK_TEST_OK(s2); DSK_TEST_OK(s3); DSK_TEST_OK(s4);
    }
    for (int rep = 0; rep < 2 && graph.exec; rep++) {
        void *got[3];
        DSK_TEST_OK(dsk_tensor_fill(gctx, &gy, NAN));
        DSK_TEST_OK(dsk_graph_launch(gctx, &graph));
        got[0] = to_host_bytes(gctx, &gy);
        got[1] = to_host_bytes(gctx, &gdx);
        got[2] = to_host_bytes(gctx, &go.grads);
        DSK_TEST_SAME_BYTES(got[0], eager[0], dsk_tensor_nbytes(&gy), "y, graph replay vs eager");
        DSK_TEST_SAME_BYTES(got[1], eager[1], dsk_tensor_nbytes(&gdx), "dx, graph replay vs eager");
        DSK_TEST_SAME_BYTES(got[2], eager[2], dsk_tensor_nbytes(&go.grads), "gradients, graph replay vs eager");
        for (int i = 0; i < 3; i++) free(got[i]);
    }
    for (int i = 0; i < 3; i++) free(eager[i]);
    dsk_graph_free(&graph);
    dsk_tensor_free(NULL, &hx); dsk_tensor_free(NULL, &hdy); dsk_tensor_free(NULL, &hy); dsk_tensor_free(NULL, &hdx);
    dsk_tensor_free(gctx, &gx); dsk_tensor_free(gctx, &gdy); dsk_tensor_free(gctx, &gy); dsk_tensor_free(gctx, &gdx);
    drop_layer(&gm, &go, gctx);
    drop_layer(&cm, &co, NULL);
    dsk_test_end();
}

/* NaN/Inf in x on CUDA: the forward does not stop to look. The token's row of y is NaN (so a
   loss over it is, and a loss scaler skips the step), its slots are dispatched nowhere and
   counted nowhere, the statistics report it, and every other row is what the CPU gives for
   the same input with that token repaired (dropless: a token's row depends on itself only). */
static void run_nonfinite(dsk_ctx *gctx, dsk_moe_score score, float bad) {
    dsk_moe gm, cm;
    owned go, co;
    dsk_moe_opts o;
    dsk_moe_stats st;
    dsk_tensor hx, hy, gx, gy;
    int64_t shp[2] = {33, 32}, syncs;
    dsk_test_begin("cuda: x with %g in token 4, %s: no sync, a NaN row, counted", (double)bad,
                   score == DSK_MOE_SIGMOID ? "sigmoid+groups" : "softmax");
    if (!dsk_cuda_available()) { dsk_test_skip("no usable CUDA device"); dsk_test_end(); return; }
    memset(&o, 0, sizeof o);
    o.d_model = 32; o.n_routed = 8; o.top_k = 2; o.d_expert = 16; o.score = score; o.n_shared = 1;
    o.aux_alpha = 0.01f;
    if (score == DSK_MOE_SIGMOID) { o.n_group = 4; o.topk_group = 2; }
    DSK_TEST_OK(make_layer(&gm, &go, gctx, &o));
    DSK_TEST_OK(make_layer(&cm, &co, NULL, &o));
    DSK_TEST_OK(dsk_tensor_copy(gctx, &go.values, &co.values));
    dsk_tensor_alloc(NULL, &hx, DSK_F32, 2, shp); dsk_tensor_alloc(NULL, &hy, DSK_F32, 2, shp);
    dsk_tensor_alloc(gctx, &gx, DSK_F32, 2, shp); dsk_tensor_alloc(gctx, &gy, DSK_F32, 2, shp);
    dsk_tensor_uniform(NULL, &hx, 21, 0, -1, 1);
    DSK_TEST_OK(dsk_moe_forward(&cm, NULL, &hy, &hx, NULL));
    ((float *)hx.data)[4 * 32 + 7] = bad;
    DSK_TEST_OK(dsk_tensor_copy(gctx, &gx, &hx));
    DSK_TEST_OK(dsk_moe_reserve(&gm, gctx, 33));
    DSK_TEST_OK(dsk_moe_stats_request(&gm, gctx)); /* start the statistics from this forward */
    DSK_TEST_OK(dsk_ctx_sync(gctx));
    syncs = gctx->counters.syncs + gctx->counters.d2h_copies;
    DSK_TEST_OK(dsk_moe_forward(&gm, gctx, &gy, &gx, NULL));
    DSK_TEST_EXPECT(gctx->counters.syncs + gctx->counters.d2h_copies == syncs, "the forward waited on the device");
    DSK_TEST_OK(dsk_moe_stats_request(&gm, gctx));
    DSK_TEST_OK(dsk_ctx_sync(gctx));
    DSK_TEST_OK(dsk_moe_stats_collect(&gm, gctx, &st));
    DSK_TEST_EXPECT(st.nonfinite == 1 && st.calls == 1, "nonfinite %lld calls %lld", (long long)st.nonfinite,
                    (long long)st.calls);
    {
        int64_t sum = 0;
        for (int e = 0; e < 8; e++) sum += st.tokens_per_expert[e];
        DSK_TEST_EXPECT(sum == 32 * 2, "loads count %lld slots, want the 64 of the 32 finite tokens", (long long)sum);
    }
    {
        float *g = to_host_f32(gctx, &gy);
        double *w = (double *)malloc(sizeof(double) * 33 * 32);
        int nan_row = 0;
        for (int d = 0; d < 32; d++) nan_row += g[4 * 32 + d] != g[4 * 32 + d];
        DSK_TEST_EXPECT(nan_row == 32, "%d of token 4's 32 outputs are NaN", nan_row);
        for (int i = 0; i < 33 * 32; i++) w[i] = ((float *)hy.data)[i];
        for (int d = 0; d < 32; d++) g[4 * 32 + d] = (float)w[4 * 32 + d]; /* compared above */
        DSK_TEST_CLOSE(g, w, 33 * 32, 2e-4, 2e-5, "the other tokens' rows");
        free(g); free(w);
    }
    dsk_tensor_free(NULL, &hx); dsk_tensor_free(NULL, &hy); dsk_tensor_free(gctx, &gx); dsk_tensor_free(gctx, &gy);
    drop_layer(&gm, &go, gctx);
    drop_layer(&cm, &co, NULL);
    dsk_test_end();
}

/* FP8 experts (opts.expert_gemm) on CUDA and on the CPU, f32 layers with the router weights 0 (every
   gate 1/E, exactly, on both) and a replayed routing: the FP8 arithmetic is specified to the bit
   (dsk_matmul_fp8, dsk_amp's quantisers), so y, dx and every expert's and shared expert's gradient
   are the CPU's bit for bit (the router's gradient, an f32 GEMM of each device, within a tolerance);
   the forward and backward make no host sync and no device-to-host copy. */
static void test_fp8_experts(dsk_ctx *gctx) {
    enum { T = 77, D = 160, E = 4, K = 2 };
    dsk_moe cm, gm;
    owned co, go;
    dsk_moe_opts o;
    dsk_tensor hx, hy, hdy, hdx, gx, gy, gdy, gdx, asg;
    int64_t shp[2] = {T, D}, ash[2] = {T, K};
    dsk_ctx_counters before;
    dsk_test_begin("cuda vs cpu: FP8 experts (routed and shared), f32: y, dx, expert gradients bit for bit");
    if (!dsk_cuda_available()) {
        dsk_test_skip("no usable CUDA device");
        dsk_test_end();
        return;
    }
    memset(&o, 0, sizeof o);
    o.d_model = D;
    o.n_routed = E;
    o.top_k = K;
    o.d_expert = 136;
    o.n_shared = 1;
    o.d_shared = 72;
    o.norm = DSK_MOE_NORM_OFF;
    o.init_std = 0.3f;
    o.seed = 23;
    o.expert_gemm = DSK_MOE_GEMM_FP8;
    DSK_TEST_OK(make_layer(&cm, &co, NULL, &o));
    DSK_TEST_OK(make_layer(&gm, &go, gctx, &o));
    DSK_TEST_OK(dsk_tensor_fill(NULL, &cm.router->value, 0.0));
    DSK_TEST_OK(dsk_tensor_copy(gctx, &go.values, &co.values));
    DSK_TEST_OK(dsk_moe_reserve(&gm, gctx, T));
    dsk_tensor_alloc(NULL, &hx, DSK_F32, 2, shp);
    dsk_tensor_alloc(NULL, &hy, DSK_F32, 2, shp);
    dsk_tensor_alloc(NULL, &hdy, DSK_F32, 2, shp);
    dsk_tensor_alloc(NULL, &hdx, DSK_F32, 2, shp);
    dsk_tensor_alloc(gctx, &gx, DSK_F32, 2, shp);
    dsk_tensor_alloc(gctx, &gy, DSK_F32, 2, shp);
    dsk_tensor_alloc(gctx, &gdy, DSK_F32, 2, shp);
    dsk_tensor_alloc(gctx, &gdx, DSK_F32, 2, shp);
    dsk_tensor_alloc(NULL, &asg, DSK_I32, 2, ash);
    for (int t = 0; t < T; t++) { /* experts 1..3 (expert 0 gets no row), distinct per token */
        ((int32_t *)asg.data)[t * K] = 1 + t % 3;
        ((int32_t *)asg.data)[t * K + 1] = 1 + (t % 3 + 1 + (t / 3) % 2) % 3;
    }
    dsk_tensor_uniform(NULL, &hx, 51, 0, -2, 2);
    dsk_tensor_uniform(NULL, &hdy, 52, 0, -1, 1);
    DSK_TEST_OK(dsk_tensor_copy(gctx, &gx, &hx));
    DSK_TEST_OK(dsk_tensor_copy(gctx, &gdy, &hdy));
    DSK_TEST_OK(dsk_tensor_fill(gctx, &gy, NAN));
    DSK_TEST_OK(dsk_tensor_fill(NULL, &hy, NAN));
    DSK_TEST_OK(dsk_tensor_fill(gctx, &gdx, 0.0));
    DSK_TEST_OK(dsk_tensor_fill(NULL, &hdx, 0.0));
    DSK_TEST_OK(dsk_moe_forward_replay(&cm, NULL, &hy, &hx, &asg, NULL));
    DSK_TEST_OK(dsk_moe_backward(&cm, NULL, &hdx, &hdy, 1.0f));
    DSK_TEST_OK(dsk_moe_forward_replay(&gm, gctx, &gy, &gx, &asg, NULL)); /* copies the routing to the device */
    DSK_TEST_OK(dsk_ctx_sync(gctx));
    before = gctx->counters;
    DSK_TEST_OK(dsk_moe_forward_replay(&gm, gctx, &gy, &gx, &asg, NULL));
    DSK_TEST_OK(dsk_moe_backward(&gm, gctx, &gdx, &gdy, 1.0f));
    DSK_TEST_EXPECT(gctx->counters.syncs == before.syncs && gctx->counters.d2h_copies == before.d2h_copies,
                    "forward + backward made %lld syncs and %lld device-to-host copies",
                    (long long)(gctx->counters.syncs - before.syncs),
                    (long long)(gctx->counters.d2h_copies - before.d2h_copies));
    compare(gctx, &gy, &hy, 0, 0, "y");
    compare(gctx, &gdx, &hdx, 0, 0, "dx");
    for (int i = 0; i < cm.n_params; i++) {
        char what[128];
        int router = i == DSK_MOE_P_ROUTER;
        if (!cm.params[i].trainable) continue;
        snprintf(what, sizeof what, "grad %s", cm.params[i].name);
        compare(gctx, &gm.params[i].grad, &cm.params[i].grad, router ? 1e-4 : 0, router ? 1e-5 : 0, what);
    }
    dsk_tensor_free(NULL, &hx);
    dsk_tensor_free(NULL, &hy);
    dsk_tensor_free(NULL, &hdy);
    dsk_tensor_free(NULL, &hdx);
    dsk_tensor_free(NULL, &asg);
    dsk_tensor_free(gctx, &gx);
    dsk_tensor_free(gctx, &gy);
    dsk_tensor_free(gctx, &gdy);
    dsk_tensor_free(gctx, &gdx);
    drop_layer(&cm, &co, NULL);
    drop_layer(&gm, &go, gctx);
    dsk_test_end();
}

int main(int argc, char **argv) {
    dsk_ctx gctx;
    dsk_ctx_opts co;
    int have = dsk_cuda_available(), ndev = 0;
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
    if (argc == 4 && !strcmp(argv[1], "--ep-rank")) {
        dsk_test_init("test_moe_gpu rank");
        return ep_rank(atoi(argv[2]), atoi(argv[3]) == 2);
    }
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
#ifdef DSK_CUDA
    if (have) dsk_cuda_device_count(&ndev);
#endif
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&gctx, &cases[i]);
    test_no_sync_and_graph(&gctx);
    test_fp8_experts(&gctx);
    run_nonfinite(&gctx, DSK_MOE_SOFTMAX, INFINITY);
    run_nonfinite(&gctx, DSK_MOE_SIGMOID, NAN);
    test_two_devices(&gctx, ndev);
    dsk_ctx_free(&gctx);
    run_ep(2, ndev, 0, 0);
    run_ep(4, ndev, 1, 0);
    run_ep(4, ndev, 1, 1);
    return dsk_test_finish();
}
