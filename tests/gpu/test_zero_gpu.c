/* test_zero_gpu.c - dsk_zero.h on CUDA tensors over nccl against the CPU path over the host
   backend.

   The parent starts 2 ranks (one per GPU; one rank where there is one GPU) with
   dsk_comm_spawn_local, re-running this binary with --rank-child PART. Each rank opens an nccl
   communicator with a CUDA context and a host communicator on the next port, and trains the
   same small layered model in both: the gradient of every element is a (w - t) from the
   weights forward reads, computed on the host. After 3 steps the master weights and both
   moments of every piece must agree within 2e-6 relative (NCCL sums in its own order), in every
   stage, with f32 and bf16 weights, with bf16 compression and with FP8 compression (with and
   without error feedback); the memory figures of the device
   object come from the device allocator. Errors: PowerSGD on CUDA, mismatched backends.
   Without a usable CUDA device every case is skipped. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp, readlink, dirent: the library is linked, not included */
#include "../../dsk_zero.h"
#include "tests/dsk_test.h"
#include "tests/gpu/gpu_test_spawn.h"

#ifdef DSK_CUDA
#include <cuda_runtime.h>

static dsk_comm NC, HC; /* nccl and host communicators of this rank */
static int g_fp8_ef;    /* FP8 compression runs with error feedback */
static dsk_ctx G;

#define NPAR 5
static const int k_nd[NPAR] = {2, 1, 2, 3, 2}, k_unit[NPAR] = {0, 0, 1, 1, 2};
static const int64_t k_shape[NPAR][3] = {{7, 5, 0}, {5, 0, 0}, {9, 7, 0}, {3, 4, 5}, {11, 3, 0}};

static int64_t numel(int p) {
    int64_t n = 1;
    for (int d = 0; d < k_nd[p]; d++) n *= k_shape[p][d];
    return n;
}
static float hashf(uint64_t a, uint64_t b, uint64_t c, float lo, float hi) {
    uint64_t z = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xBF58476D1CE4E5B9ull;
    z ^= c * 0x94D049BB133111EBull;
    z ^= z >> 31;
    z *= 0xD6E8FEB86659FD93ull;
    z ^= z >> 32;
    return lo + (hi - lo) * (float)((double)(z >> 11) * (1.0 / 9007199254740992.0));
}

/* What a run leaves: master, m, v of this rank's pieces, per parameter, on the host. */
typedef struct state { float w[NPAR][64], m[NPAR][64], v[NPAR][64]; int64_t first[NPAR], count[NPAR]; } state;

/* Copies a contiguous float tensor on any device to the host as f32. */
static void fetch(dsk_ctx *ctx, const dsk_tensor *t, float *out) {
    dsk_tensor h;
    if (dsk_tensor_numel(t) == 0) return;
    DSK_TEST_OK(dsk_tensor_wrap(&h, out, DSK_F32, dsk_cpu(), t->ndim, t->shape));
    if (t->dtype != DSK_F32) {
        dsk_tensor tmp;
        DSK_TEST_OK(dsk_tensor_alloc(NULL, &tmp, t->dtype, t->ndim, t->shape));
        DSK_TEST_OK(dsk_tensor_copy(ctx, &tmp, t));
        DSK_TEST_OK(dsk_tensor_copy(NULL, &h, &tmp));
        dsk_tensor_free(NULL, &tmp);
    } else {
        DSK_TEST_OK(dsk_tensor_copy(ctx, &h, t));
    }
}

/* Trains 3 steps on comm c with ctx (NULL: the CPU) and returns this rank's pieces. */
static void train(dsk_comm *c, dsk_ctx *ctx, int stage, dsk_dtype cdt, dsk_zero_compress cmp, state *out,
                  dsk_zero_memory *mem) {
    dsk_zero_param ps[NPAR];
    dsk_tensor vals[NPAR], grads[NPAR];
    dsk_zero z, *zp = &z;
    dsk_zero_opts o;
    dsk_amp_scaler sc;
    dsk_amp_scaler_opts so;
    dsk_adamw_opts ao = dsk_adamw_defaults();
    static char names[NPAR][16];
    memset(ps, 0, sizeof ps);
    for (int p = 0; p < NPAR; p++) {
        snprintf(names[p], sizeof names[p], "p%d", p);
        ps[p].name = names[p];
        ps[p].ndim = k_nd[p];
        for (int d = 0; d < k_nd[p]; d++) ps[p].shape[d] = k_shape[p][d];
        ps[p].value = &vals[p];
        ps[p].grad = &grads[p];
        ps[p].unit = k_unit[p];
        ps[p].no_decay = k_nd[p] == 1;
    }
    memset(&o, 0, sizeof o);
    o.stage = stage;
    o.compute_dtype = cdt;
    o.compress = cmp;
    o.fp8_error_feedback = cmp == DSK_ZERO_COMPRESS_FP8 && g_fp8_ef;
    if (dsk_zero_init(&z, c, ctx, ps, NPAR, &o) != DSK_OK) {
        dsk_test_fail_at(__FILE__, __LINE__, "dsk_zero_init: %s", dsk_last_error());
        return;
    }
    if (mem) *mem = z.memory;
    for (int p = 0; p < NPAR; p++) {
        dsk_zero_piece pc;
        float host[64];
        dsk_tensor h;
        DSK_TEST_OK(dsk_zero_get_piece(&z, p, &pc));
        for (int64_t i = 0; i < pc.count; i++) host[i] = hashf(1, (uint64_t)p, (uint64_t)(pc.first + i), -1, 1);
        if (pc.count == 0) continue;
        DSK_TEST_OK(dsk_tensor_wrap(&h, host, DSK_F32, dsk_cpu(), 1, &pc.count));
        DSK_TEST_OK(dsk_tensor_copy(ctx, &pc.master, &h));
    }
    DSK_TEST_OK(dsk_zero_refresh(&z, ctx));
    memset(&so, 0, sizeof so);
    so.mode = DSK_AMP_NONE;
    DSK_TEST_OK(dsk_amp_scaler_init(&sc, ctx, &so));
    ao.lr = 1e-2f;
    for (int step = 1; step <= 3; step++) {
        dsk_amp_decision dec;
        DSK_TEST_OK(dsk_zero_begin(&z, ctx, 1));
        for (int u = 2; u >= 0; u--) {
            DSK_TEST_OK(dsk_zero_backward_begin(&z, ctx, u));
            for (int p = NPAR - 1; p >= 0; p--) {
                float v[64], g[64];
                dsk_tensor h;
                if (k_unit[p] != u) continue;
                fetch(ctx, &vals[p], v);
                for (int64_t i = 0; i < numel(p); i++)
                    g[i] = hashf(2, (uint64_t)(p * 16 + c->rank), (uint64_t)i, 0.5f, 1.5f) *
                           (v[i] - hashf(3, (uint64_t)(p * 16 + c->rank), (uint64_t)i, -1, 1));
                DSK_TEST_OK(dsk_tensor_wrap(&h, g, DSK_F32, dsk_cpu(), k_nd[p], k_shape[p]));
                DSK_TEST_OK(dsk_tensor_copy(ctx, &grads[p], &h));
                DSK_TEST_OK(dsk_zero_grad_ready(&z, ctx, p));
            }
            DSK_TEST_OK(dsk_zero_backward_end(&z, ctx, u));
        }
        DSK_TEST_OK(dsk_zero_wait(&z, ctx));
        DSK_TEST_OK(dsk_zero_unscale_decide(&zp, 1, &sc, c, ctx, 0, &dec));
        DSK_TEST_OK(dsk_zero_step(&z, ctx, &ao, step, &dec));
    }
    for (int p = 0; p < NPAR; p++) {
        dsk_zero_piece pc;
        DSK_TEST_OK(dsk_zero_get_piece(&z, p, &pc));
        out->first[p] = pc.first;
        out->count[p] = pc.count;
        fetch(ctx, &pc.master, out->w[p]);
        fetch(ctx, &pc.m, out->m[p]);
        fetch(ctx, &pc.v, out->v[p]);
    }
    dsk_amp_scaler_free(&sc, ctx);
    dsk_zero_free(&z, ctx);
    DSK_TEST_OK(dsk_ctx_sync(ctx));
}

static void compare(const state *a, const state *b, const char *what) {
    double worst = 0;
    for (int p = 0; p < NPAR; p++) {
        DSK_TEST_EXPECT(a->first[p] == b->first[p] && a->count[p] == b->count[p], "%s p%d: pieces differ", what, p);
        for (int64_t i = 0; i < a->count[p]; i++) {
            const float *x[3] = {a->w[p], a->m[p], a->v[p]}, *y[3] = {b->w[p], b->m[p], b->v[p]};
            for (int k = 0; k < 3; k++) {
                double d = fabs((double)x[k][i] - y[k][i]) / fmax(fabs(y[k][i]), 1e-6);
                if (d > worst) worst = d;
            }
        }
    }
    DSK_TEST_EXPECT(worst <= 2e-6, "%s: CUDA/nccl differs from the CPU/host path by %.3g relative", what, worst);
    if (NC.rank == 0) printf("     %s: largest relative difference %.3g\n", what, worst);
}

static void part_train(void) {
    static state dev, host;
    for (int stage = 0; stage < 4; stage++)
        for (int d = 0; d < 2; d++) {
            char what[96];
            dsk_dtype cdt = d ? DSK_BF16 : DSK_F32;
            dsk_zero_memory mem;
            int64_t before = dsk_tensor_mem_stats(G.device).live_bytes;
            memset(&dev, 0, sizeof dev);
            memset(&host, 0, sizeof host);
            train(&NC, &G, stage, cdt, DSK_ZERO_COMPRESS_NONE, &dev, &mem);
            train(&HC, NULL, stage, cdt, DSK_ZERO_COMPRESS_NONE, &host, NULL);
            snprintf(what, sizeof what, "ZeRO-%d %s", stage, dsk_dtype_name(cdt));
            compare(&dev, &host, what);
            DSK_TEST_EXPECT(mem.optimizer > 0 && mem.grads > 0, "%s: device memory figures %lld %lld", what,
                            (long long)mem.optimizer, (long long)mem.grads);
            DSK_TEST_EXPECT(dsk_tensor_mem_stats(G.device).live_bytes == before, "%s: %lld device bytes left", what,
                            (long long)(dsk_tensor_mem_stats(G.device).live_bytes - before));
        }
    for (int stage = 0; stage < 4; stage += 2) {
        char what[64];
        memset(&dev, 0, sizeof dev);
        memset(&host, 0, sizeof host);
        train(&NC, &G, stage, DSK_F32, DSK_ZERO_COMPRESS_BF16, &dev, NULL);
        train(&HC, NULL, stage, DSK_F32, DSK_ZERO_COMPRESS_BF16, &host, NULL);
        snprintf(what, sizeof what, "ZeRO-%d, bf16 compression", stage);
        compare(&dev, &host, what);
    }
    for (int stage = 0; stage < 4; stage++) { /* the same quantisation and f32 sums: only the transport differs */
        char what[64];
        memset(&dev, 0, sizeof dev);
        memset(&host, 0, sizeof host);
        g_fp8_ef = stage % 2;
        train(&NC, &G, stage, DSK_F32, DSK_ZERO_COMPRESS_FP8, &dev, NULL);
        train(&HC, NULL, stage, DSK_F32, DSK_ZERO_COMPRESS_FP8, &host, NULL);
        snprintf(what, sizeof what, "ZeRO-%d, fp8 compression%s", stage, g_fp8_ef ? ", error feedback" : "");
        compare(&dev, &host, what);
    }
}

static void part_errors(void) {
    dsk_zero_param ps[1];
    dsk_tensor v, g;
    dsk_zero z;
    dsk_zero_opts o;
    memset(ps, 0, sizeof ps);
    ps[0].name = "w";
    ps[0].ndim = 1;
    ps[0].shape[0] = 8;
    ps[0].value = &v;
    ps[0].grad = &g;
    memset(&o, 0, sizeof o);
    o.compress = DSK_ZERO_COMPRESS_POWERSGD;
    DSK_TEST_STATUS(dsk_zero_init(&z, &NC, &G, ps, 1, &o), DSK_ERR_UNSUPPORTED);
    DSK_TEST_ERROR_MENTIONS("PowerSGD runs on CPU tensors only");
    o.compress = DSK_ZERO_COMPRESS_NONE;
    DSK_TEST_STATUS(dsk_zero_init(&z, &NC, NULL, ps, 1, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("need a host-backend communicator");
    DSK_TEST_STATUS(dsk_zero_init(&z, &HC, &G, ps, 1, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("need an nccl communicator");
}

static int child_main(const char *part) {
    if (gpu_test_rank_open(&NC, &HC, &G, NULL)) return 3;
    if (!strcmp(part, "train")) part_train();
    else part_errors();
    return gpu_test_rank_close(&NC, &HC, &G);
}
#endif

int main(int argc, char **argv) {
    static const char *parts[] = {"train", "errors"};
    int ndev = 0;
#ifdef DSK_CUDA
    if (argc > 2 && !strcmp(argv[1], "--rank-child")) return child_main(argv[2]);
#endif
    dsk_test_init("test_zero_gpu");
#ifdef DSK_CUDA
    if (dsk_cuda_available()) cudaGetDeviceCount(&ndev);
#endif
    for (int p = 0; p < 2; p++) {
        dsk_test_begin("dsk_zero on CUDA over nccl vs CPU over the host backend, %d ranks: %s", ndev >= 2 ? 2 : 1,
                       parts[p]);
        if (ndev == 0) {
            dsk_test_skip("no usable CUDA device");
            continue;
        }
        gpu_test_spawn_self(ndev >= 2 ? 2 : 1, parts[p]);
    }
    (void)argc;
    (void)argv;
    return dsk_test_finish();
}
