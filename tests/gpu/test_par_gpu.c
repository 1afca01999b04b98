/* test_par_gpu.c - dsk_par.h on CUDA tensors over the nccl backend, against its CPU path on the
   host backend.

   The parent starts 2 ranks (one per GPU, where there are two; else one rank) with
   dsk_comm_spawn_local, re-running this binary with --rank-child. Each rank opens an nccl and
   a host communicator and runs every operation twice on the same inputs: CPU tensors through
   the host backend, CUDA tensors through nccl. Data movement (sequence-parallel gathers, the
   vocabulary-parallel embedding, pipeline messages) must match bitwise; sums of products
   within f32 tolerance (cuBLAS and NCCL add in their own order), as is the vocabulary-parallel
   cross-entropy (kernels/par.cu). Without a usable CUDA device every case is skipped. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp, readlink, dirent: the library is linked, not included */
#include "../../dsk_par.h"
#include "tests/dsk_test.h"
#include "tests/gpu/gpu_test_spawn.h"

#ifdef DSK_CUDA
static dsk_comm NC, HC; /* nccl and host communicators of this rank */
static dsk_ctx G;

/* A host f32 tensor (rows, cols) of input `tag`, the same on every rank, values in [-1, 1). */
static dsk_tensor host_in(int64_t rows, int64_t cols, uint64_t tag) {
    dsk_tensor t;
    int64_t sh[2] = {rows, cols};
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &t, DSK_F32, 2, sh));
    for (int64_t i = 0; i < rows * cols; i++) {
        uint64_t u = dsk_test_mix64(dsk_test_mix64(tag) ^ (uint64_t)i * 0xD1B54A32D192ED03ull);
        ((float *)t.data)[i] = (float)((double)(u >> 11) * (1.0 / 9007199254740992.0) * 2.0 - 1.0);
    }
    return t;
}

static dsk_tensor host_nan(int64_t rows, int64_t cols) {
    dsk_tensor t;
    int64_t sh[2] = {rows, cols};
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &t, DSK_F32, 2, sh));
    dsk_test_poison_f32((float *)t.data, rows * cols);
    return t;
}

/* A device copy of a host tensor (NaN-filled copies serve as poisoned outputs). */
static dsk_tensor dev_of(const dsk_tensor *h) {
    dsk_tensor d;
    DSK_TEST_OK(dsk_tensor_alloc(&G, &d, h->dtype, h->ndim, h->shape));
    DSK_TEST_OK(dsk_tensor_copy(&G, &d, h));
    return d;
}

/* The device tensor d equals the host tensor h within (rtol, atol); 0, 0 means bitwise. */
static void same(const dsk_tensor *d, const dsk_tensor *h, double rtol, double atol, const char *what) {
    int64_t n = dsk_tensor_numel(h);
    dsk_tensor back;
    double *want = (double *)malloc((size_t)n * sizeof(double));
    DSK_TEST_OK(dsk_comm_sync(&NC, &G));
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &back, h->dtype, h->ndim, h->shape));
    DSK_TEST_OK(dsk_tensor_copy(&G, &back, d));
    for (int64_t i = 0; i < n; i++) want[i] = ((const float *)h->data)[i];
    DSK_TEST_CLOSE((const float *)back.data, want, n, rtol, atol, what);
    dsk_tensor_free(NULL, &back);
    free(want);
}

static void free_all(dsk_tensor *ts, int n) {
    for (int i = 0; i < n; i++) dsk_tensor_free(ts[i].device.type == DSK_DEV_CUDA ? &G : NULL, &ts[i]);
}

/* Column-parallel (two weights sharing the input) then row-parallel, sequence parallel. */
static void part_linears(void) {
    int n = NC.world_size, r = NC.rank;
    int64_t N = 8 * n, K = 24, Ol = 16, Nl = N / n;
    enum { X, XG, W1, W3, Y1, Y3, DY1, DY3, DX, DXG, DW1, DW3, W2, Z, ZP, DZ, DZG, DA, DW2, NT };
    dsk_tensor h[NT], d[NT];
    h[X] = host_in(Nl, K, 10 + (uint64_t)r);
    h[XG] = host_nan(N, K);
    h[W1] = host_in(Ol, K, 20 + (uint64_t)r);
    h[W3] = host_in(Ol, K, 30 + (uint64_t)r);
    h[Y1] = host_nan(N, Ol);
    h[Y3] = host_nan(N, Ol);
    h[DY1] = host_in(N, Ol, 40 + (uint64_t)r);
    h[DY3] = host_in(N, Ol, 50 + (uint64_t)r);
    h[DX] = host_nan(Nl, K);
    h[DXG] = host_nan(N, K);
    h[DW1] = host_in(Ol, K, 60);
    h[DW3] = host_in(Ol, K, 70);
    h[W2] = host_in(K, Ol, 80 + (uint64_t)r);
    h[Z] = host_nan(Nl, K);
    h[ZP] = host_nan(N, K);
    h[DZ] = host_in(Nl, K, 90 + (uint64_t)r);
    h[DZG] = host_nan(N, K);
    h[DA] = host_nan(N, Ol);
    h[DW2] = host_in(K, Ol, 100);
    for (int i = 0; i < NT; i++) d[i] = dev_of(&h[i]);
    for (int dev = 0; dev < 2; dev++) {
        dsk_tensor *t = dev ? d : h;
        dsk_comm *c = dev ? &NC : &HC;
        dsk_ctx *ctx = dev ? &G : NULL;
        dsk_tensor *Ys[2] = {&t[Y1], &t[Y3]}, *dWs[2] = {&t[DW1], &t[DW3]};
        const dsk_tensor *Ws[2] = {&t[W1], &t[W3]}, *dYs[2] = {&t[DY1], &t[DY3]};
        DSK_TEST_OK(dsk_par_column_forward(c, ctx, 2, Ys, Ws, &t[X], &t[XG]));
        DSK_TEST_OK(dsk_par_column_backward(c, ctx, 2, &t[DX], &t[DXG], dWs, dYs, Ws, &t[XG]));
        DSK_TEST_OK(dsk_par_row_forward(c, ctx, &t[Z], &t[ZP], &t[Y1], &t[W2]));
        DSK_TEST_OK(dsk_par_row_backward(c, ctx, &t[DA], &t[DW2], &t[DZ], &t[DZG], &t[Y1], &t[W2]));
    }
    same(&d[XG], &h[XG], 0, 0, "column forward: gathered input");
    same(&d[Y1], &h[Y1], 1e-5, 1e-6, "column forward Y1");
    same(&d[Y3], &h[Y3], 1e-5, 1e-6, "column forward Y3");
    same(&d[DX], &h[DX], 1e-5, 1e-5, "column backward dX (reduce-scattered)");
    same(&d[DW1], &h[DW1], 1e-5, 1e-5, "column backward dW1");
    same(&d[DW3], &h[DW3], 1e-5, 1e-5, "column backward dW3");
    same(&d[Z], &h[Z], 1e-5, 1e-5, "row forward Z (reduce-scattered)");
    same(&d[DZG], &h[DZG], 0, 0, "row backward: gathered output gradient");
    same(&d[DA], &h[DA], 1e-5, 1e-5, "row backward dA");
    same(&d[DW2], &h[DW2], 1e-5, 1e-5, "row backward dW2");
    free_all(h, NT);
    free_all(d, NT);
}

/* Sequence-parallel gather and scatter along dim 1 of a (3, T, 5) tensor (strided copies). */
static void part_maps(void) {
    int n = NC.world_size, r = NC.rank;
    int64_t small[3] = {3, 4, 5}, full[3] = {3, 4 * (int64_t)n, 5};
    dsk_tensor hs = host_in(3 * 4, 5, 200 + (uint64_t)r), hf = host_in(3 * 4 * n, 5, 300 + (uint64_t)r);
    dsk_tensor hg = host_nan(3 * 4 * n, 5), hr = host_nan(3 * 4, 5), ds, df, dg, dr;
    hs.ndim = hf.ndim = hg.ndim = hr.ndim = 3;
    memcpy(hs.shape, small, sizeof small);
    memcpy(hr.shape, small, sizeof small);
    memcpy(hf.shape, full, sizeof full);
    memcpy(hg.shape, full, sizeof full);
    for (int i = 0; i < 3; i++) {
        hs.stride[i] = hr.stride[i] = i == 2 ? 1 : i == 1 ? 5 : 20;
        hf.stride[i] = hg.stride[i] = i == 2 ? 1 : i == 1 ? 5 : 20 * n;
    }
    ds = dev_of(&hs); df = dev_of(&hf); dg = dev_of(&hg); dr = dev_of(&hr);
    DSK_TEST_OK(dsk_par_map_forward(&HC, NULL, DSK_PAR_MAP_GATHER, 1, &hg, &hs));
    DSK_TEST_OK(dsk_par_map_forward(&NC, &G, DSK_PAR_MAP_GATHER, 1, &dg, &ds));
    same(&dg, &hg, 0, 0, "gather along dim 1");
    DSK_TEST_OK(dsk_par_map_forward(&HC, NULL, DSK_PAR_MAP_SCATTER, 1, &hr, &hf));
    DSK_TEST_OK(dsk_par_map_forward(&NC, &G, DSK_PAR_MAP_SCATTER, 1, &dr, &df));
    same(&dr, &hr, 1e-6, 1e-7, "scatter along dim 1");
    dsk_tensor hs2[4] = {hs, hf, hg, hr}, ds2[4] = {ds, df, dg, dr};
    free_all(hs2, 4);
    free_all(ds2, 4);
}

/* Vocabulary-parallel embedding forward and backward (sequence parallel) and cross-entropy. */
static void part_vocab(void) {
    int n = NC.world_size, r = NC.rank;
    int64_t N = 6 * n, Nl = 6, Vl = 300, D = 8, sh0 = 0;
    dsk_tensor ht = host_in(Vl, D, 400 + (uint64_t)r), ho = host_nan(Nl, D), hp = host_nan(N, D);
    dsk_tensor hd = host_in(Nl, D, 500 + (uint64_t)r), hg = host_nan(N, D), hdt = host_in(Vl, D, 600);
    dsk_tensor hl = host_in(N, Vl, 700 + (uint64_t)r), hdl = host_nan(N, Vl), htg, hloss, dloss;
    dsk_tensor hids, dids, dt, dout, dp, dd, dg, ddt, dl, ddl, dtg;
    float l = NAN;
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &hids, DSK_I32, 1, &N));
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &htg, DSK_I32, 1, &N));
    for (int64_t t = 0; t < N; t++) {
        ((int32_t *)hids.data)[t] = (int32_t)(dsk_test_mix64(777 + (uint64_t)t) % (uint64_t)(Vl * n));
        ((int32_t *)htg.data)[t] = t % 4 == 1 ? -1 : (int32_t)(dsk_test_mix64(999 + (uint64_t)t) % (uint64_t)(Vl * n));
    }
    for (int64_t i = 0; i < N * Vl; i++) ((float *)hl.data)[i] *= 8.0f;
    dids = dev_of(&hids); dt = dev_of(&ht); dout = dev_of(&ho); dp = dev_of(&hp); dd = dev_of(&hd); dg = dev_of(&hg);
    ddt = dev_of(&hdt); dl = dev_of(&hl); ddl = dev_of(&hdl); dtg = dev_of(&htg);
    DSK_TEST_OK(dsk_par_embedding_forward(&HC, NULL, &ho, &hp, &ht, &hids));
    DSK_TEST_OK(dsk_par_embedding_forward(&NC, &G, &dout, &dp, &dt, &dids));
    same(&dout, &ho, 0, 0, "embedding forward");
    DSK_TEST_OK(dsk_par_embedding_backward(&HC, NULL, &hdt, &hd, &hg, &hids));
    DSK_TEST_OK(dsk_par_embedding_backward(&NC, &G, &ddt, &dd, &dg, &dids));
    same(&ddt, &hdt, 1e-6, 1e-7, "embedding backward");
    /* cross-entropy: the device passes and nccl against the CPU over host */
    DSK_TEST_OK(dsk_tensor_wrap(&hloss, &l, DSK_F32, dsk_cpu(), 0, &sh0));
    DSK_TEST_OK(dsk_tensor_alloc(&G, &dloss, DSK_F32, 0, &sh0));
    DSK_TEST_OK(dsk_par_cross_entropy(&HC, NULL, &hloss, &hdl, &hl, &htg, -1, 0.5f));
    DSK_TEST_OK(dsk_par_cross_entropy(&NC, &G, &dloss, &ddl, &dl, &dtg, -1, 0.5f));
    same(&dloss, &hloss, 1e-6, 0, "vocab-parallel loss");
    same(&ddl, &hdl, 1e-5, 1e-9, "vocab-parallel dlogits");
    /* CUDA tensors with the host communicator: refused before any transfer where tp has ranks to
       talk to; tp of one rank moves nothing, and takes any backend */
    if (n > 1) {
        DSK_TEST_STATUS(dsk_par_cross_entropy(&HC, &G, &dloss, &ddl, &dl, &dtg, -1, 0.5f), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("uses the host backend");
        DSK_TEST_STATUS(dsk_par_embedding_forward(&HC, &G, &dout, &dp, &dt, &dids), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("uses the host backend");
    } else {
        DSK_TEST_OK(dsk_par_cross_entropy(&HC, &G, &dloss, &ddl, &dl, &dtg, -1, 0.5f));
        same(&dloss, &hloss, 1e-6, 0, "vocab-parallel loss, one rank over host");
        DSK_TEST_OK(dsk_par_embedding_forward(&HC, &G, &dout, &dp, &dt, &dids));
    }
    dsk_tensor hs[9] = {ht, ho, hp, hd, hg, hdt, hids, hl, hdl};
    dsk_tensor ds[11] = {dids, dt, dout, dp, dd, dg, ddt, dl, ddl, dtg, dloss};
    free_all(hs, 9);
    free_all(ds, 11);
    dsk_tensor_free(NULL, &htg);
}

/* A 1F1B pipeline over nccl send/recv with device buffers: every message arrives intact. */
typedef struct gpipe_state {
    int m;
    dsk_tensor *in, *out; /* [2 m]: activations then gradients, device buffers of 256 floats */
    dsk_tensor host;
} gpipe_state;

static uint64_t gmsg_tag(int grad, int micro, int from) {
    return 5000 + (uint64_t)grad * 100 + (uint64_t)micro * 10 + (uint64_t)from;
}

static dsk_status g_check(void *user, int micro, int chunk, int grad) {
    gpipe_state *ps = (gpipe_state *)user;
    int s = NC.rank, from = grad ? s + 1 : s - 1;
    dsk_tensor want;
    (void)chunk;
    if (from < 0 || from >= NC.world_size) return DSK_OK;
    dsk_status st = dsk_comm_sync(&NC, &G);
    if (st == DSK_OK) st = dsk_tensor_copy(&G, &ps->host, &ps->in[grad * ps->m + micro]);
    want = host_in(1, 256, gmsg_tag(grad, micro, from));
    if (st == DSK_OK && memcmp(want.data, ps->host.data, 256 * sizeof(float)) != 0)
        st = dsk_set_error(DSK_ERR_CORRUPT, "micro %d: the %s from rank %d differs", micro,
                           grad ? "gradient" : "activation", from);
    dsk_tensor_free(NULL, &want);
    return st;
}
static dsk_status g_forward(void *user, int micro, int chunk) { return g_check(user, micro, chunk, 0); }
static dsk_status g_backward(void *user, int micro, int chunk) { return g_check(user, micro, chunk, 1); }

static dsk_status g_buffer(void *user, const dsk_par_action *a, dsk_tensor *t) {
    gpipe_state *ps = (gpipe_state *)user;
    int grad = a->kind == DSK_PAR_SEND_GRAD || a->kind == DSK_PAR_RECV_GRAD;
    int send = a->kind == DSK_PAR_SEND_ACT || a->kind == DSK_PAR_SEND_GRAD;
    if (send) {
        dsk_tensor src = host_in(1, 256, gmsg_tag(grad, a->micro, a->stage));
        dsk_status s = dsk_tensor_copy(&G, &ps->out[grad * ps->m + a->micro], &src);
        dsk_tensor_free(NULL, &src);
        DSK__TRY(s);
        *t = ps->out[grad * ps->m + a->micro];
    } else {
        *t = ps->in[grad * ps->m + a->micro];
    }
    return DSK_OK;
}

static void part_pipeline(void) {
    gpipe_state ps;
    dsk_par_schedule s;
    dsk_par_stage_fns fns;
    dsk_tensor in[8], out[8];
    int64_t sh[2] = {1, 256};
    memset(&ps, 0, sizeof ps);
    ps.m = 4;
    ps.in = in;
    ps.out = out;
    for (int i = 0; i < 2 * ps.m; i++) {
        DSK_TEST_OK(dsk_tensor_alloc(&G, &in[i], DSK_F32, 2, sh));
        DSK_TEST_OK(dsk_tensor_alloc(&G, &out[i], DSK_F32, 2, sh));
    }
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &ps.host, DSK_F32, 2, sh));
    memset(&fns, 0, sizeof fns);
    fns.user = &ps;
    fns.forward = g_forward;
    fns.backward = g_backward;
    fns.buffer = g_buffer;
    DSK_TEST_OK(dsk_par_schedule_init(&s, DSK_PAR_1F1B, NC.world_size, ps.m, 1, NC.rank));
    DSK_TEST_OK(dsk_par_pipeline_run(&s, &NC, &G, &fns));
    dsk_par_schedule_free(&s);
    free_all(in, 2 * ps.m);
    free_all(out, 2 * ps.m);
    dsk_tensor_free(NULL, &ps.host);
}

static int child_main(const char *part) {
    if (gpu_test_rank_open(&NC, &HC, &G, NULL)) return 3;
    if (!strcmp(part, "linears")) part_linears();
    else if (!strcmp(part, "maps")) part_maps();
    else if (!strcmp(part, "vocab")) part_vocab();
    else part_pipeline();
    return gpu_test_rank_close(&NC, &HC, &G);
}
#endif

int main(int argc, char **argv) {
    static const char *parts[] = {"linears", "maps", "vocab", "pipeline"};
    int ndev = 0, world;
#ifdef DSK_CUDA
    if (argc > 2 && !strcmp(argv[1], "--rank-child")) return child_main(argv[2]);
#endif
    dsk_test_init("test_par_gpu");
#ifdef DSK_CUDA
    if (dsk_cuda_available()) cudaGetDeviceCount(&ndev);
#endif
    world = ndev >= 2 ? 2 : 1;
    for (int p = 0; p < 4; p++) {
        dsk_test_begin("dsk_par on CUDA tensors over nccl vs the CPU over host, %d ranks: %s", world, parts[p]);
        if (ndev == 0) {
            dsk_test_skip("no usable CUDA device");
            continue;
        }
        gpu_test_spawn_self(world, parts[p]);
    }
    (void)argc;
    (void)argv;
    return dsk_test_finish();
}
