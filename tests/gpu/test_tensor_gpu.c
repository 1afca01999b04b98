/* test_tensor_gpu.c - every CUDA op of dsk_tensor.h against the CPU path on the same inputs.

   Each case builds random CPU tensors, copies them to the GPU, runs the op on both devices
   and compares: bitwise where the GPU must reproduce the CPU exactly (copies, casts, fills,
   uniform RNG, top-k, scatter-add), else within the dtype's tolerance (f32 about 1e-5
   relative, bf16 about 1e-2). GPU outputs are NaN-poisoned first; accumulated outputs start
   from the same random values on both devices. Without a usable CUDA device every GPU case
   reports as skipped; the runtime checks that need no device still run in CUDA builds, and
   the no-device fallback runs in a child process that sees no device (CUDA_VISIBLE_DEVICES
   empty). */
#define _POSIX_C_SOURCE 200809L /* readlink, setenv (the no-device child) */
#include "dsk_tensor.h"
#include "tests/dsk_test.h"
#include "tests/gpu/gpu_test_util.h" /* G, have_gpu, the tensor pool (halloc, dalloc, dev, host_as), CASE */

#include <sys/wait.h>
#include <unistd.h>

/* ------------------------------------------------------------------ tensor helpers */

/* A shape as (ndim, int64_t[]) arguments: SH(7, 129). */
#define SH(...) (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (const int64_t[]){__VA_ARGS__}

/* CPU tensor of uniform values in [lo, hi), rounded to dt. */
static dsk_tensor *hrand(dsk_dtype dt, int nd, const int64_t *shape, double lo, double hi) {
    dsk_tensor *f = halloc(DSK_F64, nd, shape), *t = halloc(dt, nd, shape);
    dsk_test_fill_f64((double *)f->data, dsk_tensor_numel(f), lo, hi);
    DSK_TEST_OK(dsk_tensor_copy(NULL, t, f));
    return t;
}
/* CPU i32 tensor of integers in [0, n). */
static dsk_tensor *hints(int nd, const int64_t *shape, int64_t n) {
    dsk_tensor *t = halloc(DSK_I32, nd, shape);
    for (int64_t i = 0; i < dsk_tensor_numel(t); i++) ((int32_t *)t->data)[i] = (int32_t)dsk_test_rand_int(n);
    return t;
}
/* GPU tensor like h, filled with NaN (floats) or 0xA5 bytes (ints) so unwritten elements show. */
/* CPU tensor of zeros (a DSK_GRAD_ADD reference for what DSK_GRAD_WRITE writes). */
static dsk_tensor *hzeros(dsk_dtype dt, int nd, const int64_t *shape) {
    dsk_tensor *t = halloc(dt, nd, shape);
    DSK_TEST_OK(dsk_tensor_fill(NULL, t, 0.0));
    return t;
}
static dsk_tensor *dpoison(const dsk_tensor *h) {
    dsk_tensor *d = dalloc(h->dtype, h->ndim, h->shape);
    if (dsk_dtype_is_float(h->dtype)) {
        DSK_TEST_OK(dsk_tensor_fill(&G, d, NAN));
    } else {
        dsk_tensor *p = halloc(h->dtype, h->ndim, h->shape);
        dsk_test_poison_bytes(p->data, dsk_tensor_nbytes(p));
        DSK_TEST_OK(dsk_tensor_copy(&G, d, p));
    }
    return d;
}

/* GPU result against the CPU result: |gpu - cpu| <= atol + rtol |cpu| element-wise. */
static void check(const dsk_tensor *gpu, const dsk_tensor *cpu, double rtol, double atol, const char *what) {
    const dsk_tensor *g = host_as(gpu, DSK_F32), *c = host_as(cpu, DSK_F64);
    DSK_TEST_CLOSE((const float *)g->data, (const double *)c->data, dsk_tensor_numel(c), rtol, atol, what);
}
/* GPU result bit for bit equal to the CPU result. */
static void check_same(const dsk_tensor *gpu, const dsk_tensor *cpu, const char *what) {
    const dsk_tensor *g = host_as(gpu, gpu->dtype), *c = host_as(cpu, cpu->dtype);
    DSK_TEST_SAME_BYTES(g->data, c->data, dsk_tensor_nbytes(c), what);
}
/* Tolerances for a result stored in dt (f32 ones scaled by the caller for long sums). */
static double rtol_of(dsk_dtype dt) { return dt == DSK_BF16 ? 1e-2 : dt == DSK_F16 ? 2e-3 : 1e-5; }
static double atol_of(dsk_dtype dt) { return dt == DSK_BF16 ? 1e-2 : dt == DSK_F16 ? 2e-3 : 1e-6; }

/* ------------------------------------------------------------------ runtime */

#ifdef DSK_CUDA
/* Runs with or without a device: the count is never an error, and matches availability. */
static void test_device_count(void) {
    int n = -1;
    DSK_TEST_OK(dsk_cuda_device_count(&n));
    DSK_TEST_EXPECT(n >= 0, "count %d", n);
    DSK_TEST_EXPECT(dsk_cuda_available() == (n > 0), "available %d with %d devices", dsk_cuda_available(), n);
    DSK_TEST_STATUS(dsk_cuda_device_count(NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_cuda_device_count");
}

/* Without a device, asking for CUDA fails cleanly and AUTO falls back to the CPU. */
static void test_no_device_fallback(void) {
    dsk_ctx c;
    dsk_ctx_opts o;
    memset(&o, 0, sizeof o);
    o.device = DSK_PREFER_CUDA;
    DSK_TEST_EXPECT(!dsk_cuda_available(), "a device is visible with CUDA_VISIBLE_DEVICES empty");
    DSK_TEST_STATUS(dsk_ctx_init(&c, &o), DSK_ERR_UNSUPPORTED);
    DSK_TEST_ERROR_MENTIONS("dsk_ctx_init");
    o.device = DSK_PREFER_AUTO;
    DSK_TEST_OK(dsk_ctx_init(&c, &o));
    DSK_TEST_EXPECT(c.device.type == DSK_DEV_CPU, "device type %d", (int)c.device.type);
    dsk_ctx_free(&c);
}

/* Runs this program as `--no-device-child` with CUDA_VISIBLE_DEVICES empty; the child runs
   test_no_device_fallback and exits with the number of failed checks. */
static void test_no_device_child(const char *self) {
    int status = 0;
    pid_t pid;
    fflush(stdout);
    pid = fork();
    if (pid == 0) {
        setenv("CUDA_VISIBLE_DEVICES", "", 1);
        unsetenv("CUDA_EMU_DEVICES"); /* the emulator's own count would win */
        execl(self, self, "--no-device-child", (char *)NULL);
        _exit(127);
    }
    DSK_TEST_EXPECT(pid > 0 && waitpid(pid, &status, 0) == pid, "fork or wait failed");
    DSK_TEST_EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child without a device failed (status 0x%x)", status);
}

/* Launchers called without a CUDA ctx fail with DSK_ERR_ARG naming the op (no device needed);
   ctx_free accepts a zeroed ctx. */
static void test_launchers_need_ctx(void) {
    dsk_ctx cpu;
    dsk_ctx_opts o;
    dsk_tensor t;
    dsk_adamw_opts ao;
    void *p = NULL;
    float host = 0;
    memset(&t, 0, sizeof t);
    ao = dsk_adamw_defaults();
    memset(&o, 0, sizeof o);
    o.device = DSK_PREFER_CPU;
    DSK_TEST_OK(dsk_ctx_init(&cpu, &o));
    for (int pass = 0; pass < 2; pass++) {
        dsk_ctx *c = pass ? &cpu : NULL;
        DSK_TEST_STATUS(dsk_cuda_tensor_copy(c, &t, &t), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_tensor_copy");
        DSK_TEST_STATUS(dsk_cuda_tensor_fill(c, &t, 1.0), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_tensor_fill");
        DSK_TEST_STATUS(dsk_cuda_tensor_normal(c, &t, 1, 2, 0.0f, 1.0f), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_tensor_normal");
        DSK_TEST_STATUS(dsk_cuda_matmul(c, &t, &t, 0, &t, 0, 1.0f, 0.0f), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_matmul");
        DSK_TEST_STATUS(dsk_cuda_elementwise(c, DSK_EW_ADD, &t, &t, &t, 0.0f), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_add");
        DSK_TEST_STATUS(dsk_cuda_reduce(c, &t, &t, 0, DSK_REDUCE_SUM), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_reduce");
        DSK_TEST_STATUS(dsk_cuda_sum_squares(c, &t, &t), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_sum_squares");
        DSK_TEST_STATUS(dsk_cuda_rmsnorm_backward(c, &t, &t, &t, &t, &t, &t), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_rmsnorm_backward");
        DSK_TEST_STATUS(dsk_cuda_scatter_add_rows(c, &t, &t, &t), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_scatter_add_rows");
        DSK_TEST_STATUS(dsk_cuda_cross_entropy(c, &t, NULL, &t, &t, -100, 1.0f), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_cross_entropy");
        DSK_TEST_STATUS(dsk_cuda_topk(c, &t, &t, &t, 1), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_topk");
        DSK_TEST_STATUS(dsk_cuda_attention_backward(c, &t, &t, &t, &t, &t, &t, &t, &t, 1.0f, 1), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_attention_backward");
        DSK_TEST_STATUS(dsk_cuda_attention_fused(c, &t, &t, &t, &t, &t, 1.0f), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_attention_fused");
        DSK_TEST_STATUS(dsk_cuda_attention_fused_backward(c, &t, &t, &t, &t, &t, &t, &t, &t, &t, 1.0f), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_attention_fused_backward");
        DSK_TEST_STATUS(dsk_cuda_adamw_step(c, &t, &t, &t, &t, &ao, 1, 1.0f, NULL), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_adamw_step");
        DSK_TEST_STATUS(dsk_cuda_malloc(c, 16, &p), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_cuda_malloc");
        DSK_TEST_STATUS(dsk_cuda_memcpy(c, &host, &host, sizeof host, 1), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_cuda_memcpy");
        DSK_TEST_STATUS(dsk_cuda_sync(c), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dsk_ctx_sync");
    }
    dsk_cuda_ctx_free(&cpu); /* nothing to release: must be a no-op */
    DSK_TEST_EXPECT(cpu.stream == NULL && cpu.cublas == NULL && cpu.workspace == NULL, "zeroed ctx changed");
    dsk_cuda_free(NULL, NULL);
    dsk_ctx_free(&cpu);
}

static void test_ctx_errors(void) {
    int n = 0;
    dsk_ctx c;
    dsk_ctx_opts o;
    void *p = NULL;
    DSK_TEST_OK(dsk_cuda_device_count(&n));
    memset(&o, 0, sizeof o);
    o.device = DSK_PREFER_CUDA;
    o.cuda_index = n; /* one past the last device */
    DSK_TEST_STATUS(dsk_ctx_init(&c, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("requested");
    DSK_TEST_EXPECT(c.stream == NULL && c.cublas == NULL, "failed init left stream %p cublas %p", c.stream, c.cublas);
    dsk_ctx_free(&c);
    DSK_TEST_STATUS(dsk_cuda_malloc(&G, (size_t)1 << 60, &p), DSK_ERR_OOM);
    DSK_TEST_ERROR_MENTIONS("cudaMallocAsync");
    DSK_TEST_EXPECT(p == NULL, "pointer %p after a failed allocation", p);
    /* The context still works after the failure. */
    {
        dsk_tensor *h = hrand(DSK_F32, SH(1000), -1, 1), *d = dev(h);
        check_same(d, h, "round trip after a failed allocation");
    }
    DSK_TEST_OK(dsk_ctx_sync(&G));
}

/* The runtime launchers of callers without a ctx (dsk_comm.h, dsk_zero.h): device memory and
   synchronous copies; a stream of their own that waits for an event of G's stream and then
   copies what G's stream wrote (as dsk_zero's communication stream does); failures named. */
static void test_runtime_no_ctx(void) {
    int n = 0, done = -1;
    void *d = NULL, *s = NULL, *ev = NULL;
    dsk_tensor *h = hrand(DSK_F32, SH(7, 129), -1, 1), *dh = dalloc(DSK_F32, SH(7, 129));
    dsk_tensor *back = halloc(DSK_F32, SH(7, 129)), *back2 = halloc(DSK_F32, SH(7, 129));
    size_t bytes = (size_t)dsk_tensor_nbytes(h);
    dsk_ctx sc = G;
    DSK_TEST_OK(dsk_cuda_device_count(&n));
    DSK_TEST_STATUS(dsk_cuda_set_device(n), DSK_ERR_CUDA);
    DSK_TEST_ERROR_MENTIONS("cudaSetDevice");
    DSK_TEST_OK(dsk_cuda_set_device(G.device.index));
    DSK_TEST_STATUS(dsk_cuda_device_malloc((size_t)1 << 60, &d), DSK_ERR_OOM);
    DSK_TEST_ERROR_MENTIONS("dsk_cuda_device_malloc");
    DSK_TEST_EXPECT(d == NULL, "pointer %p after a failed allocation", d);
    DSK_TEST_OK(dsk_tensor_fill(NULL, back, NAN));
    DSK_TEST_OK(dsk_tensor_fill(NULL, back2, NAN));
    DSK_TEST_OK(dsk_cuda_device_malloc(bytes, &d));
    DSK_TEST_OK(dsk_cuda_memcpy_sync(d, h->data, bytes, 1));
    DSK_TEST_OK(dsk_cuda_memcpy_sync(back->data, d, bytes, 0));
    check_same(back, h, "dsk_cuda_memcpy_sync there and back");
    DSK_TEST_OK(dsk_cuda_stream_create(&s));
    DSK_TEST_OK(dsk_cuda_event_create(&ev));
    sc.stream = s;
    sc.cublas = NULL;
    sc.workspace = NULL;
    sc.workspace_bytes = 0;
    DSK_TEST_OK(dsk_tensor_copy(&G, dh, h));
    DSK_TEST_OK(dsk_cuda_stream_record(G.stream, ev));
    DSK_TEST_OK(dsk_cuda_stream_wait_event(s, ev));
    DSK_TEST_OK(dsk_cuda_memcpy(&sc, back2->data, dh->data, bytes, 0));
    DSK_TEST_OK(dsk_cuda_stream_sync(s));
    DSK_TEST_OK(dsk_cuda_stream_done(s, &done));
    DSK_TEST_EXPECT(done == 1, "stream done %d after its synchronisation", done);
    check_same(back2, h, "a copy on a stream of its own after an event of G's stream");
    dsk_cuda_event_destroy(ev);
    dsk_cuda_stream_destroy(s);
    dsk_cuda_free(NULL, d);
}
#endif

/* One thread drives two devices: each op makes its context's device current (a launch on a
   stream of another device than the current one fails). */
static void test_two_devices(void) {
    dsk_ctx G1;
    dsk_tensor a1, b1, o1, back;
    dsk_tensor *a = hrand(DSK_F32, SH(3, 129), -1, 1), *b = hrand(DSK_F32, SH(3, 129), -1, 1), *want = halloc(DSK_F32, SH(3, 129));
    dsk_tensor *a0 = dev(a), *b0 = dev(b), *o0 = dpoison(want);
    if (!gpu_test_ctx_on(1, &G1)) { dsk_test_skip("needs 2 CUDA devices, driven by one thread"); return; }
    DSK_TEST_OK(dsk_add(NULL, want, a, b));
    DSK_TEST_OK(dsk_tensor_alloc(&G1, &a1, DSK_F32, a->ndim, a->shape));
    DSK_TEST_OK(dsk_tensor_alloc(&G1, &b1, DSK_F32, a->ndim, a->shape));
    DSK_TEST_OK(dsk_tensor_alloc(&G1, &o1, DSK_F32, a->ndim, a->shape));
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &back, DSK_F32, a->ndim, a->shape));
    DSK_TEST_OK(dsk_tensor_copy(&G1, &a1, a));
    DSK_TEST_OK(dsk_tensor_copy(&G1, &b1, b));
    for (int r = 0; r < 2; r++) { /* each op follows one on the other device */
        DSK_TEST_OK(dsk_add(&G1, &o1, &a1, &b1));
        DSK_TEST_OK(dsk_add(&G, o0, a0, b0));
    }
    check_same(o0, want, "add on device 0 after one on device 1");
    DSK_TEST_OK(dsk_tensor_copy(&G1, &back, &o1));
    DSK_TEST_SAME_BYTES(back.data, want->data, dsk_tensor_nbytes(want), "add on device 1");
    dsk_tensor_free(&G1, &a1);
    dsk_tensor_free(&G1, &b1);
    dsk_tensor_free(&G1, &o1);
    dsk_tensor_free(NULL, &back);
    dsk_ctx_free(&G1);
}

/* ------------------------------------------------------------------ copies, casts, fill, RNG */

static const dsk_dtype all_dtypes[] = {DSK_F32, DSK_F16, DSK_BF16, DSK_E4M3, DSK_E5M2, DSK_F64, DSK_I32, DSK_I64, DSK_U8};
#define N_DTYPES (int)(sizeof all_dtypes / sizeof all_dtypes[0])

/* Values that exercise rounding, saturation and the specials of every format. */
static dsk_tensor *hspecial(dsk_dtype dt, int64_t n) {
    static const double sp[] = {0.0, -0.0, 1.0, -1.0, 0.5, 1.5, 2.5, -2.5, 255.5, 300.0, -300.0, 448.0, 464.0, 1e5, -1e5,
                                6e4, 1e-8, -1e-8, 3.0e9, -3.0e9, 1e300, INFINITY, -INFINITY, NAN};
    int64_t ns = (int64_t)(sizeof sp / sizeof sp[0]);
    dsk_tensor *f = halloc(DSK_F64, SH(n)), *t = halloc(dt, SH(n));
    for (int64_t i = 0; i < n; i++) ((double *)f->data)[i] = i < ns ? sp[i] : dsk_test_rand(-600, 600);
    DSK_TEST_OK(dsk_tensor_copy(NULL, t, f));
    return t;
}

static void test_copy_roundtrip(dsk_dtype dt) {
    dsk_tensor *h = halloc(dt, SH(7, 129)), *d;
    for (size_t i = 0; i < dsk_tensor_nbytes(h); i++) ((unsigned char *)h->data)[i] = (unsigned char)dsk_test_rand_u64();
    d = dev(h);
    check_same(d, h, "host -> device -> host");
}

/* Every dtype pair, device cast against the CPU cast, bit for bit. */
static void test_cast_all(void) {
    char what[64];
    for (int a = 0; a < N_DTYPES; a++)
        for (int b = 0; b < N_DTYPES; b++) {
            dsk_tensor *src = hspecial(all_dtypes[a], 300), *dsrc = dev(src);
            dsk_tensor *cpu = halloc(all_dtypes[b], SH(300)), *gpu = dpoison(cpu);
            DSK_TEST_OK(dsk_tensor_copy(NULL, cpu, src));
            DSK_TEST_OK(dsk_tensor_copy(&G, gpu, dsrc));
            snprintf(what, sizeof what, "cast %s -> %s", dsk_dtype_name(all_dtypes[a]), dsk_dtype_name(all_dtypes[b]));
            check_same(gpu, cpu, what);
            release();
        }
}

/* Device-side strided copies (transpose, slice) with and without a cast. */
static void test_copy_strided(dsk_dtype sdt, dsk_dtype ddt, int64_t r, int64_t c) {
    dsk_tensor *h = hrand(sdt, SH(3, r, c), -100, 100), *d = dev(h);
    dsk_tensor ht, dt_, hs, ds;
    dsk_tensor *cpu, *gpu, *cpu2, *gpu2, *back;
    DSK_TEST_OK(dsk_tensor_transpose(h, 1, 2, &ht));
    DSK_TEST_OK(dsk_tensor_transpose(d, 1, 2, &dt_));
    cpu = halloc(ddt, SH(3, c, r));
    gpu = dpoison(cpu);
    DSK_TEST_OK(dsk_tensor_copy(NULL, cpu, &ht));
    DSK_TEST_OK(dsk_tensor_copy(&G, gpu, &dt_));
    check_same(gpu, cpu, "transposed copy");
    /* A slice of rows into the middle of a poisoned strided destination. */
    DSK_TEST_OK(dsk_tensor_slice(h, 2, c / 3, c - c / 3, &hs));
    DSK_TEST_OK(dsk_tensor_slice(d, 2, c / 3, c - c / 3, &ds));
    cpu2 = halloc(ddt, SH(3, r, c - c / 3));
    gpu2 = dpoison(cpu2);
    DSK_TEST_OK(dsk_tensor_copy(NULL, cpu2, &hs));
    DSK_TEST_OK(dsk_tensor_copy(&G, gpu2, &ds));
    check_same(gpu2, cpu2, "sliced copy");
    /* A strided device tensor straight to the host (the launcher packs it first). */
    back = halloc(sdt, SH(3, c, r));
    DSK_TEST_OK(dsk_tensor_copy(&G, back, &dt_));
    {
        dsk_tensor *ref = halloc(sdt, SH(3, c, r));
        DSK_TEST_OK(dsk_tensor_copy(NULL, ref, &ht));
        DSK_TEST_SAME_BYTES(back->data, ref->data, dsk_tensor_nbytes(ref), "strided device -> host");
    }
}

static void test_fill(dsk_dtype dt, double value) {
    dsk_tensor *h = hrand(dt, SH(5, 33), -1, 1), *d = dev(h);
    dsk_tensor hv, dv;
    DSK_TEST_OK(dsk_tensor_fill(NULL, h, value));
    DSK_TEST_OK(dsk_tensor_fill(&G, d, value));
    check_same(d, h, "contiguous fill");
    /* Strided: every other column of a transposed view. */
    h = hrand(dt, SH(5, 33), -1, 1);
    d = dev(h);
    DSK_TEST_OK(dsk_tensor_transpose(h, 0, 1, &hv));
    DSK_TEST_OK(dsk_tensor_transpose(d, 0, 1, &dv));
    DSK_TEST_OK(dsk_tensor_slice(&hv, 0, 3, 17, &hv));
    DSK_TEST_OK(dsk_tensor_slice(&dv, 0, 3, 17, &dv));
    DSK_TEST_OK(dsk_tensor_fill(NULL, &hv, value));
    DSK_TEST_OK(dsk_tensor_fill(&G, &dv, value));
    check_same(d, h, "strided fill");
}

static void test_rng(dsk_dtype dt, uint64_t seed, uint64_t offset) {
    dsk_tensor *h = halloc(dt, SH(3, 7, 129)), *d = dpoison(h);
    dsk_tensor hv, dv;
    DSK_TEST_OK(dsk_tensor_uniform(NULL, h, seed, offset, -2.0f, 3.0f));
    DSK_TEST_OK(dsk_tensor_uniform(&G, d, seed, offset, -2.0f, 3.0f));
    check_same(d, h, "uniform");
    /* Strided views number elements in logical order on both devices. */
    DSK_TEST_OK(dsk_tensor_transpose(h, 0, 2, &hv));
    DSK_TEST_OK(dsk_tensor_transpose(d, 0, 2, &dv));
    DSK_TEST_OK(dsk_tensor_uniform(NULL, &hv, seed + 1, offset, 0.0f, 1.0f));
    DSK_TEST_OK(dsk_tensor_uniform(&G, &dv, seed + 1, offset, 0.0f, 1.0f));
    check_same(d, h, "uniform on a transposed view");
    /* Normal: Box-Muller uses logf/cosf, whose device and libm results may differ by an ulp. */
    DSK_TEST_OK(dsk_tensor_normal(NULL, h, seed, offset, 0.5f, 2.0f));
    DSK_TEST_OK(dsk_tensor_normal(&G, d, seed, offset, 0.5f, 2.0f));
    check(d, h, dt == DSK_F32 ? 4e-6 : rtol_of(dt), dt == DSK_F32 ? 4e-6 : atol_of(dt), "normal");
}

/* ------------------------------------------------------------------ matmul */

/* A (M,K) or its transpose stored (K,M), as a view into a wider buffer when `padded`. */
static dsk_tensor *operand(dsk_dtype dt, int batch, int64_t rows, int64_t cols, int padded, dsk_tensor *view) {
    int64_t wide = cols + (padded ? 5 : 0);
    dsk_tensor *t = batch ? hrand(dt, SH(batch, rows, wide), -1, 1) : hrand(dt, SH(rows, wide), -1, 1);
    DSK_TEST_OK(dsk_tensor_slice(t, t->ndim - 1, 0, cols, view));
    return t;
}

static void test_matmul(dsk_dtype dt, dsk_dtype cdt, int64_t M, int64_t N, int64_t K, int ta, int tb, int batch, int a_batched,
                        int padded, float beta) {
    dsk_tensor av, bv, dav, dbv, *a, *b, *da, *db, *c, *dc;
    int64_t cb = batch ? batch : 1;
    a = operand(dt, a_batched ? batch : 0, ta ? K : M, ta ? M : K, padded, &av);
    b = operand(dt, batch, tb ? N : K, tb ? K : N, padded, &bv);
    da = dev(a);
    db = dev(b);
    DSK_TEST_OK(dsk_tensor_slice(da, da->ndim - 1, 0, av.shape[av.ndim - 1], &dav));
    DSK_TEST_OK(dsk_tensor_slice(db, db->ndim - 1, 0, bv.shape[bv.ndim - 1], &dbv));
    c = batch ? hrand(cdt, SH(cb, M, N), -1, 1) : hrand(cdt, SH(M, N), -1, 1);
    if (beta == 0.0f) {
        DSK_TEST_OK(dsk_tensor_fill(NULL, c, NAN));
        dc = dpoison(c);
    } else {
        dc = dev(c);
    }
    DSK_TEST_OK(dsk_matmul(NULL, c, &av, ta, &bv, tb, 0.75f, beta));
    DSK_TEST_OK(dsk_matmul(&G, dc, &dav, ta, &dbv, tb, 0.75f, beta));
    check(dc, c, rtol_of(cdt), cdt == DSK_F32 ? 1e-6 * (double)K + 1e-6 : atol_of(cdt), "C");
}

/* ------------------------------------------------------------------ elementwise */

static void test_elementwise(dsk_dtype dt, int nd, const int64_t *shape) {
    dsk_tensor *a = hrand(dt, nd, shape, -2, 2), *b = hrand(dt, nd, shape, -2, 2), *da = dev(a), *db = dev(b);
    dsk_tensor *o = halloc(dt, nd, shape), *dout = dpoison(o);
    double rt = dt == DSK_F32 ? 1e-6 : rtol_of(dt), at = dt == DSK_F32 ? 1e-7 : atol_of(dt);
    DSK_TEST_OK(dsk_add(NULL, o, a, b));
    DSK_TEST_OK(dsk_add(&G, dout, da, db));
    check(dout, o, rt, at, "add");
    DSK_TEST_OK(dsk_mul(NULL, o, a, b));
    DSK_TEST_OK(dsk_mul(&G, dout, da, db));
    check(dout, o, rt, at, "mul");
    DSK_TEST_OK(dsk_add(NULL, a, a, b)); /* in place */
    DSK_TEST_OK(dsk_add(&G, da, da, db));
    check(da, a, rt, at, "add in place");
    DSK_TEST_OK(dsk_scale(NULL, a, -1.25f));
    DSK_TEST_OK(dsk_scale(&G, da, -1.25f));
    check(da, a, rt, at, "scale");
    DSK_TEST_OK(dsk_axpy(NULL, a, 0.3f, b));
    DSK_TEST_OK(dsk_axpy(&G, da, 0.3f, db));
    check(da, a, rt, at, "axpy");
}

static void test_activations(dsk_dtype dt, int64_t n) {
    dsk_tensor *x = hrand(dt, SH(n), -6, 6), *u = hrand(dt, SH(n), -2, 2), *dy = hrand(dt, SH(n), -1, 1);
    dsk_tensor *dx0 = hrand(dt, SH(n), -1, 1), *du0 = hrand(dt, SH(n), -1, 1);
    dsk_tensor *gx = dev(x), *gu = dev(u), *gdy = dev(dy), *gdx = dev(dx0), *gdu = dev(du0);
    dsk_tensor *y = halloc(dt, SH(n)), *gy = dpoison(y);
    double rt = dt == DSK_F32 ? 4e-6 : rtol_of(dt), at = dt == DSK_F32 ? 1e-6 : atol_of(dt);
    DSK_TEST_OK(dsk_silu(NULL, y, x));
    DSK_TEST_OK(dsk_silu(&G, gy, gx));
    check(gy, y, rt, at, "silu");
    DSK_TEST_OK(dsk_silu_backward(NULL, dx0, dy, x));
    DSK_TEST_OK(dsk_silu_backward(&G, gdx, gdy, gx));
    check(gdx, dx0, rt, at, "silu backward (accumulated)");
    DSK_TEST_OK(dsk_swiglu(NULL, y, x, u));
    DSK_TEST_OK(dsk_swiglu(&G, gy, gx, gu));
    check(gy, y, rt, at, "swiglu");
    DSK_TEST_OK(dsk_swiglu_backward(NULL, dx0, du0, dy, x, u, DSK_GRAD_ADD));
    DSK_TEST_OK(dsk_swiglu_backward(&G, gdx, gdu, gdy, gx, gu, DSK_GRAD_ADD));
    check(gdx, dx0, rt, at, "swiglu dgate");
    check(gdu, du0, rt, at, "swiglu dup");
    { /* written into NaN on the GPU against the CPU's add into zeros */
        dsk_tensor *zx = hzeros(dt, SH(n)), *zu = hzeros(dt, SH(n)), *wx = dpoison(zx), *wu = dpoison(zu);
        DSK_TEST_OK(dsk_swiglu_backward(NULL, zx, zu, dy, x, u, DSK_GRAD_ADD));
        DSK_TEST_OK(dsk_swiglu_backward(&G, wx, wu, gdy, gx, gu, DSK_GRAD_WRITE));
        check(wx, zx, rt, at, "swiglu dgate (written)");
        check(wu, zu, rt, at, "swiglu dup (written)");
    }
}

/* ------------------------------------------------------------------ reductions */

static void test_reduce(dsk_dtype dt, int nd, const int64_t *shape, int axis) {
    static const dsk_reduce_op ops[] = {DSK_REDUCE_SUM, DSK_REDUCE_MEAN, DSK_REDUCE_MAX};
    static const char *names[] = {"sum", "mean", "max"};
    int64_t oshape[DSK_MAX_DIMS], len = shape[axis < 0 ? axis + nd : axis];
    int ax = axis < 0 ? axis + nd : axis;
    dsk_tensor *x = hrand(dt, nd, shape, -1, 1), *gx = dev(x);
    for (int i = 0; i < nd; i++) oshape[i] = i == ax ? 1 : shape[i];
    for (int o = 0; o < 3; o++) {
        dsk_tensor *y = halloc(dt, nd, oshape), *gy = dpoison(y);
        DSK_TEST_OK(dsk_reduce(NULL, y, x, axis, ops[o]));
        DSK_TEST_OK(dsk_reduce(&G, gy, gx, axis, ops[o]));
        /* Both sides sum in f64; an f32 result differs by its rounding only. */
        check(gy, y, dt == DSK_F32 ? 1e-6 : rtol_of(dt), dt == DSK_F32 ? 1e-6 * (double)len : atol_of(dt), names[o]);
    }
}

static void test_sum_squares(dsk_dtype dt, int64_t n) {
    dsk_tensor *x = hrand(dt, SH(n), -1, 1), *gx = dev(x);
    dsk_tensor *s = halloc(DSK_F32, SH(1)), *gs = dpoison(s), *gs2 = dpoison(s);
    DSK_TEST_OK(dsk_sum_squares(NULL, s, x));
    DSK_TEST_OK(dsk_sum_squares(&G, gs, gx));
    DSK_TEST_OK(dsk_sum_squares(&G, gs2, gx));
    check(gs, s, 1e-5, 0, "sum of squares");
    check_same(gs2, host_as(gs, DSK_F32), "sum of squares run twice");
}

/* ------------------------------------------------------------------ softmax, RMSNorm */

static void test_softmax(dsk_dtype dt, int nd, const int64_t *shape) {
    dsk_tensor *x = hrand(dt, nd, shape, -5, 5), *dy = hrand(dt, nd, shape, -1, 1), *dx = hrand(dt, nd, shape, -1, 1);
    dsk_tensor *gx = dev(x), *gdy = dev(dy), *gdx = dev(dx), *y = halloc(dt, nd, shape), *gy = dpoison(y);
    double rt = dt == DSK_F32 ? 1e-5 : rtol_of(dt), at = dt == DSK_F32 ? 1e-7 : atol_of(dt) / 4;
    DSK_TEST_OK(dsk_softmax(NULL, y, x));
    DSK_TEST_OK(dsk_softmax(&G, gy, gx));
    check(gy, y, rt, at, "softmax");
    /* Backward from the same y on both sides. */
    DSK_TEST_OK(dsk_tensor_copy(&G, gy, y));
    DSK_TEST_OK(dsk_softmax_backward(NULL, dx, y, dy));
    DSK_TEST_OK(dsk_softmax_backward(&G, gdx, gy, gdy));
    check(gdx, dx, rt, dt == DSK_F32 ? 1e-6 : atol_of(dt), "softmax backward");
}

static void test_rmsnorm(dsk_dtype dt, int64_t R, int64_t D) {
    dsk_tensor *x = hrand(dt, SH(R, D), -2, 2), *w = hrand(dt, SH(D), 0.5, 1.5), *dy = hrand(dt, SH(R, D), -1, 1);
    dsk_tensor *dx = hrand(dt, SH(R, D), -1, 1), *dw = hrand(dt, SH(D), -1, 1);
    dsk_tensor *gx = dev(x), *gw = dev(w), *gdy = dev(dy), *gdx = dev(dx), *gdw = dev(dw), *gdw2 = dev(dw), *gdw3 = dev(dw);
    dsk_tensor *y = halloc(dt, SH(R, D)), *gy = dpoison(y), *rs = halloc(DSK_F32, SH(R)), *grs = dpoison(rs);
    double rt = dt == DSK_F32 ? 1e-5 : rtol_of(dt), at = dt == DSK_F32 ? 1e-5 : atol_of(dt);
    DSK_TEST_OK(dsk_rmsnorm(NULL, y, rs, x, w, 1e-6f));
    DSK_TEST_OK(dsk_rmsnorm(&G, gy, grs, gx, gw, 1e-6f));
    check(gy, y, rt, at, "y");
    check(grs, rs, 1e-5, 0, "rstd");
    DSK_TEST_OK(dsk_tensor_copy(&G, grs, rs)); /* backward from the same saved rstd */
    DSK_TEST_OK(dsk_rmsnorm_backward(NULL, dx, dw, dy, x, w, rs));
    DSK_TEST_OK(dsk_rmsnorm_backward(&G, gdx, gdw, gdy, gx, gw, grs));
    check(gdx, dx, rt, at, "dx (accumulated)");
    check(gdw, dw, rt, dt == DSK_F32 ? 1e-6 * (double)R : atol_of(dt), "dw (accumulated)");
    /* dw alone, twice from the same start: bitwise the same as with dx. */
    DSK_TEST_OK(dsk_rmsnorm_backward(&G, NULL, gdw2, gdy, gx, gw, grs));
    DSK_TEST_OK(dsk_rmsnorm_backward(&G, NULL, gdw3, gdy, gx, gw, grs));
    check_same(gdw2, host_as(gdw, dt), "dw without dx");
    check_same(gdw3, host_as(gdw, dt), "dw run again");
}

/* ------------------------------------------------------------------ rows by index */

static void test_rows(dsk_dtype dt, int64_t R, int64_t N, int64_t D) {
    dsk_tensor *src = hrand(dt, SH(R, D), -1, 1), *idx = hints(SH(N), R), *rows = hrand(dt, SH(N, D), -1, 1);
    dsk_tensor *acc = hrand(dt, SH(R, D), -1, 1);
    dsk_tensor *gsrc = dev(src), *gidx = dev(idx), *grows = dev(rows), *gacc = dev(acc), *gacc2 = dev(acc);
    dsk_tensor *out = halloc(dt, SH(N, D)), *gout = dpoison(out);
    DSK_TEST_OK(dsk_gather_rows(NULL, out, src, idx));
    DSK_TEST_OK(dsk_gather_rows(&G, gout, gsrc, gidx));
    check_same(gout, out, "gather_rows");
    DSK_TEST_OK(dsk_embedding(&G, gout, gsrc, gidx));
    check_same(gout, out, "embedding");
    /* Same additions in the same order: bit for bit. */
    DSK_TEST_OK(dsk_scatter_add_rows(NULL, acc, rows, idx));
    DSK_TEST_OK(dsk_scatter_add_rows(&G, gacc, grows, gidx));
    check_same(gacc, acc, "scatter_add_rows");
    DSK_TEST_OK(dsk_embedding_backward(&G, gacc2, grows, gidx));
    check_same(gacc2, acc, "embedding_backward");
}

/* ------------------------------------------------------------------ grouped rows */

/* Keys with some outside [0, G); the device sort equals the CPU's exactly. */
static void test_group_by_key(int64_t N, int64_t ng) {
    dsk_tensor *keys = halloc(DSK_I32, SH(N)), *perm = halloc(DSK_I32, SH(N)), *off = halloc(DSK_I32, SH(ng + 1));
    dsk_tensor *gkeys, *gperm, *goff;
    for (int64_t i = 0; i < N; i++) ((int32_t *)keys->data)[i] = (int32_t)dsk_test_rand_int(ng + 2) - 1;
    gkeys = dev(keys);
    gperm = dpoison(perm);
    goff = dpoison(off);
    DSK_TEST_OK(dsk_group_by_key(NULL, perm, off, keys));
    DSK_TEST_OK(dsk_group_by_key(&G, gperm, goff, gkeys));
    check_same(goff, off, "offsets");
    check_same(gperm, perm, "permutation");
}

/* Random non-decreasing offsets over [1, R - 1) with an empty segment. */
static dsk_tensor *hoffsets(int64_t ng, int64_t R) {
    dsk_tensor *t = halloc(DSK_I32, SH(ng + 1));
    int32_t *o = (int32_t *)t->data;
    o[0] = R > 2 ? 1 : 0;
    o[ng] = (int32_t)(R > 2 ? R - 1 : R);
    for (int64_t g = 1; g < ng; g++) o[g] = (int32_t)(o[0] + dsk_test_rand_int(o[ng] - o[0] + 1));
    for (int64_t g = 1; g < ng; g++)
        for (int64_t h = g; h > 1 && o[h] < o[h - 1]; h--) { int32_t x = o[h]; o[h] = o[h - 1]; o[h - 1] = x; }
    if (ng > 2) o[2] = o[1];
    return t;
}

/* Both forms against the CPU, poison outside the segments kept (rows form). */
static void test_matmul_grouped(dsk_dtype dt, dsk_dtype cdt, int weights, int tb, int64_t ng, int64_t R, int64_t M,
                                int64_t N, int64_t K, float beta) {
    dsk_tensor *off = hoffsets(ng, R), *A, *B, *C, *gC;
    if (weights) {
        A = hrand(dt, SH(R, M), -1, 1); B = hrand(dt, SH(R, N), -1, 1); C = hrand(cdt, SH(ng, M, N), -1, 1);
    } else {
        A = hrand(dt, SH(R, K), -1, 1);
        B = tb ? hrand(dt, SH(ng, N, K), -1, 1) : hrand(dt, SH(ng, K, N), -1, 1);
        C = hrand(cdt, SH(R, N), -1, 1);
    }
    gC = dev(C);
    DSK_TEST_OK(dsk_matmul_grouped(NULL, C, A, weights, B, tb, off, 0.75f, beta));
    DSK_TEST_OK(dsk_matmul_grouped(&G, gC, dev(A), weights, dev(B), tb, dev(off), 0.75f, beta));
    check(gC, C, 4 * rtol_of(cdt) + (dt == DSK_F32 ? 0 : 4e-3), 4 * atol_of(cdt) + (dt == DSK_F32 ? 1e-5 : 4e-3),
          weights ? "grouped weights" : "grouped rows");
}

/* The grouped SwiGLU MLP and its backward against the CPU. */
static void test_swiglu_grouped(dsk_dtype dt) {
    int64_t ng = 4, R = 70, D = 40, F = 24;
    dsk_tensor *off = hoffsets(ng, R), *x = hrand(dt, SH(R, D), -1, 1), *dy = hrand(dt, SH(R, D), -1, 1);
    dsk_tensor *w1 = hrand(dt, SH(ng, F, D), -0.5, 0.5), *w2 = hrand(dt, SH(ng, D, F), -0.5, 0.5);
    dsk_tensor *w3 = hrand(dt, SH(ng, F, D), -0.5, 0.5), *out = hrand(dt, SH(R, D), -1, 1), *dx = hrand(dt, SH(R, D), -1, 1);
    dsk_tensor *dw1 = hrand(DSK_F32, SH(ng, F, D), -1, 1), *dw2 = hrand(DSK_F32, SH(ng, D, F), -1, 1);
    dsk_tensor *dw3 = hrand(DSK_F32, SH(ng, F, D), -1, 1);
    dsk_tensor *g[9] = {dev(out), dev(dx), dev(dw1), dev(dw2), dev(dw3)}, *hs[6], *ds[6];
    double rt = dt == DSK_F32 ? 1e-4 : 3e-2;
    for (int i = 0; i < 6; i++) { hs[i] = halloc(dt, SH(R, F)); ds[i] = dalloc(dt, SH(R, F)); }
    DSK_TEST_OK(dsk_swiglu_grouped(NULL, out, hs[0], hs[1], hs[2], x, w1, w2, w3, off));
    DSK_TEST_OK(dsk_swiglu_grouped_backward(NULL, dx, dw1, dw2, dw3, hs[3], hs[4], hs[5], dy, x, hs[0], hs[1], hs[2], w1, w2,
                                            w3, off));
    {
        dsk_tensor *gx = dev(x), *gdy = dev(dy), *gw1 = dev(w1), *gw2 = dev(w2), *gw3 = dev(w3), *goff = dev(off);
        DSK_TEST_OK(dsk_swiglu_grouped(&G, g[0], ds[0], ds[1], ds[2], gx, gw1, gw2, gw3, goff));
        DSK_TEST_OK(dsk_swiglu_grouped_backward(&G, g[1], g[2], g[3], g[4], ds[3], ds[4], ds[5], gdy, gx, ds[0], ds[1],
                                                ds[2], gw1, gw2, gw3, goff));
    }
    check(g[0], out, rt, rt, "out");
    check(g[1], dx, rt, rt, "dx");
    check(g[2], dw1, rt, rt, "dw1");
    check(g[3], dw2, rt, rt, "dw2");
    check(g[4], dw3, rt, rt, "dw3");
}

/* Scaled, plain (bit copies) and zero rows. */
static void test_gather_rows_scaled(dsk_dtype dt, int64_t R, int64_t N, int64_t D) {
    dsk_tensor *src = hrand(dt, SH(R, D), -1, 1), *idx = hints(SH(N), R), *scale = hrand(DSK_F32, SH(N), -2, 2);
    dsk_tensor *out = halloc(dt, SH(N, D)), *gout = dpoison(out);
    ((int32_t *)idx->data)[N - 1] = -1;
    DSK_TEST_OK(dsk_gather_rows_scaled(NULL, out, src, idx, scale));
    DSK_TEST_OK(dsk_gather_rows_scaled(&G, gout, dev(src), dev(idx), dev(scale)));
    check_same(gout, out, "gather_rows_scaled");
    DSK_TEST_OK(dsk_gather_rows_scaled(NULL, out, src, idx, NULL));
    DSK_TEST_OK(dsk_gather_rows_scaled(&G, gout, dev(src), dev(idx), NULL));
    check_same(gout, out, "gather_rows_scaled, plain rows");
}

/* Plain copies of fp8 codes (the FP8 experts' rows), zero codes for negative indices. */
static void test_gather_rows_fp8(dsk_dtype dt, int64_t R, int64_t N, int64_t D) {
    dsk_tensor *src = hrand(dt, SH(R, D), -400, 400), *idx = hints(SH(N), R);
    dsk_tensor *out = halloc(dt, SH(N, D)), *gout = dpoison(out);
    ((int32_t *)idx->data)[N - 1] = -1;
    DSK_TEST_OK(dsk_gather_rows_scaled(NULL, out, src, idx, NULL));
    DSK_TEST_OK(dsk_gather_rows_scaled(&G, gout, dev(src), dev(idx), NULL));
    check_same(gout, out, "gather_rows_scaled, fp8 codes");
}

/* ctx->counters: a sync and a device-to-host copy count, a launch or an upload does not; a
   graph replays what was captured and refuses a sync inside the capture. */
static void test_counters_and_graph(void) {
    dsk_tensor *h = hrand(DSK_F32, SH(7, 9), -1, 1), *d = dev(h), *back = halloc(DSK_F32, SH(7, 9));
    dsk_ctx_counters c0 = G.counters;
    dsk_graph g;
    DSK_TEST_OK(dsk_scale(&G, d, 2.0f));
    DSK_TEST_OK(dsk_tensor_copy(&G, d, h)); /* upload */
    DSK_TEST_EXPECT(G.counters.syncs - c0.syncs == 1 && G.counters.d2h_copies == c0.d2h_copies,
                    "an upload: %lld syncs (its staging buffer), %lld copies back", (long long)(G.counters.syncs - c0.syncs),
                    (long long)(G.counters.d2h_copies - c0.d2h_copies));
    c0 = G.counters;
    DSK_TEST_OK(dsk_tensor_copy(&G, back, d));
    DSK_TEST_EXPECT(G.counters.syncs - c0.syncs == 1 && G.counters.d2h_copies - c0.d2h_copies == 1 &&
                    G.counters.d2h_bytes - c0.d2h_bytes == 7 * 9 * 4, "a download: %lld syncs %lld copies %lld bytes",
                    (long long)(G.counters.syncs - c0.syncs), (long long)(G.counters.d2h_copies - c0.d2h_copies),
                    (long long)(G.counters.d2h_bytes - c0.d2h_bytes));
    DSK_TEST_OK(dsk_graph_begin(&G));
    DSK_TEST_OK(dsk_scale(&G, d, 3.0f));
    DSK_TEST_OK(dsk_graph_end(&G, &g));
    for (int i = 0; i < 2; i++) DSK_TEST_OK(dsk_graph_launch(&G, &g));
    DSK_TEST_OK(dsk_scale(NULL, h, 3.0f));
    DSK_TEST_OK(dsk_scale(NULL, h, 3.0f));
    check_same(d, h, "two replays of a captured scale by 3");
    dsk_graph_free(&g);
    dsk_graph_free(&g); /* freed twice is fine */
    DSK_TEST_OK(dsk_graph_begin(&G));
    DSK_TEST_STATUS(dsk_ctx_sync(&G), DSK_ERR_CUDA); /* the runtime refuses it; the capture is invalid */
    DSK_TEST_STATUS(dsk_graph_end(&G, &g), DSK_ERR_CUDA);
    DSK_TEST_EXPECT(g.exec == NULL, "an invalid capture gave a graph");
    DSK_TEST_STATUS(dsk_graph_begin(NULL), DSK_ERR_UNSUPPORTED);
    DSK_TEST_STATUS(dsk_graph_launch(&G, &g), DSK_ERR_ARG);
}

/* ------------------------------------------------------------------ cross-entropy */

static void test_cross_entropy(dsk_dtype dt, int64_t T, int64_t V, int n_ignored, int with_grad) {
    dsk_tensor *x = hrand(dt, SH(T, V), -4, 4), *tg = hints(SH(T), V), *gx, *gtg;
    dsk_tensor *loss = halloc(DSK_F32, SH(1)), *gloss, *dl = NULL, *gdl = NULL;
    for (int i = 0; i < n_ignored; i++) ((int32_t *)tg->data)[n_ignored >= T ? i % T : dsk_test_rand_int(T)] = -100;
    gx = dev(x);
    gtg = dev(tg);
    gloss = dpoison(loss);
    if (with_grad) {
        dl = halloc(dt, SH(T, V));
        gdl = dpoison(dl);
    }
    DSK_TEST_OK(dsk_cross_entropy(NULL, loss, dl, x, tg, -100, 2.0f));
    DSK_TEST_OK(dsk_cross_entropy(&G, gloss, gdl, gx, gtg, -100, 2.0f));
    check(gloss, loss, 1e-5, 1e-6, "loss");
    if (with_grad) check(gdl, dl, dt == DSK_F32 ? 1e-5 : rtol_of(dt), dt == DSK_F32 ? 1e-7 : atol_of(dt) / 10, "dlogits");
}

/* ------------------------------------------------------------------ top-k */

static void test_topk(int64_t R, int64_t C, int k, int with_specials) {
    dsk_tensor *x = hrand(DSK_F32, SH(R, C), -3, 3), *gx;
    dsk_tensor *v = halloc(DSK_F32, SH(R, k)), *ix = halloc(DSK_I32, SH(R, k)), *gv, *gix;
    float *p = (float *)x->data;
    /* Quantise to force ties, and sprinkle NaN and -Inf. */
    for (int64_t i = 0; i < R * C; i++) {
        p[i] = floorf(p[i] * 2.0f) / 2.0f;
        if (with_specials && dsk_test_rand_int(9) == 0) p[i] = dsk_test_rand_int(2) ? NAN : -INFINITY;
    }
    gx = dev(x);
    gv = dpoison(v);
    gix = dpoison(ix);
    DSK_TEST_OK(dsk_topk(NULL, v, ix, x, k));
    DSK_TEST_OK(dsk_topk(&G, gv, gix, gx, k));
    check_same(gix, ix, "indices");
    check_same(gv, v, "values");
}

/* ------------------------------------------------------------------ RoPE, attention */

static void test_rope(dsk_dtype dt, int64_t B, int64_t T, int64_t H, int64_t Dh, int64_t pos0) {
    dsk_tensor *x = hrand(dt, SH(B, T, H, Dh), -1, 1), *dx = hrand(dt, SH(B, T, H, Dh), -1, 1);
    dsk_tensor *gx = dev(x), *gdx = dev(dx), *y = halloc(dt, SH(B, T, H, Dh)), *gy = dpoison(y);
    /* Angles are (pos0 + t) theta^(-2i/Dh) in f32 through powf, cosf and sinf, whose device
       and libm results may differ by an ulp: allow that much at the largest angle. */
    double at = dt == DSK_F32 ? 4e-7 * (double)(pos0 + T) + 1e-6 : atol_of(dt);
    DSK_TEST_OK(dsk_rope(NULL, y, x, pos0, 10000.0f));
    DSK_TEST_OK(dsk_rope(&G, gy, gx, pos0, 10000.0f));
    check(gy, y, rtol_of(dt), at, "rope");
    DSK_TEST_OK(dsk_rope_backward(NULL, dx, x, pos0, 10000.0f, DSK_GRAD_ADD));
    DSK_TEST_OK(dsk_rope_backward(&G, gdx, gx, pos0, 10000.0f, DSK_GRAD_ADD));
    check(gdx, dx, rtol_of(dt), at, "rope backward (accumulated)");
    { /* written into NaN on the GPU against the CPU's add into zeros */
        dsk_tensor *zx = hzeros(dt, SH(B, T, H, Dh)), *wx = dpoison(zx);
        DSK_TEST_OK(dsk_rope_backward(NULL, zx, x, pos0, 10000.0f, DSK_GRAD_ADD));
        DSK_TEST_OK(dsk_rope_backward(&G, wx, gx, pos0, 10000.0f, DSK_GRAD_WRITE));
        check(wx, zx, rtol_of(dt), at, "rope backward (written)");
    }
    DSK_TEST_OK(dsk_rope(NULL, x, x, pos0, 10000.0f)); /* in place */
    DSK_TEST_OK(dsk_rope(&G, gx, gx, pos0, 10000.0f));
    check(gx, x, rtol_of(dt), at, "rope in place");
}

static void test_attention(dsk_dtype dt, int64_t B, int64_t T, int64_t H, int64_t Dh) {
    float scale = 1.0f / sqrtf((float)Dh);
    dsk_tensor *q = hrand(dt, SH(B, T, H, Dh), -2, 2), *k = hrand(dt, SH(B, T, H, Dh), -2, 2), *v = hrand(dt, SH(B, T, H, Dh), -1, 1);
    dsk_tensor *dout = hrand(dt, SH(B, T, H, Dh), -1, 1), *dq = hrand(dt, SH(B, T, H, Dh), -1, 1);
    dsk_tensor *dk = hrand(dt, SH(B, T, H, Dh), -1, 1), *dv = hrand(dt, SH(B, T, H, Dh), -1, 1);
    dsk_tensor *gq = dev(q), *gk = dev(k), *gv = dev(v), *gdout = dev(dout), *gdq = dev(dq), *gdk = dev(dk), *gdv = dev(dv);
    dsk_tensor *out = halloc(dt, SH(B, T, H, Dh)), *gout = dpoison(out);
    dsk_tensor *P = halloc(DSK_F32, SH(B, H, T, T)), *gP = dpoison(P);
    double rt = dt == DSK_F32 ? 1e-4 : 2e-2, at = dt == DSK_F32 ? 2e-5 : 2e-2;
    DSK_TEST_OK(dsk_attention(NULL, out, P, q, k, v, scale));
    DSK_TEST_OK(dsk_attention(&G, gout, gP, gq, gk, gv, scale));
    check(gP, P, 1e-4, 1e-6, "probs");
    check(gout, out, rt, at, "out");
    DSK_TEST_OK(dsk_tensor_copy(&G, gP, P)); /* backward from the same probs */
    DSK_TEST_OK(dsk_attention_backward(NULL, dq, dk, dv, dout, q, k, v, P, scale, DSK_GRAD_ADD));
    DSK_TEST_OK(dsk_attention_backward(&G, gdq, gdk, gdv, gdout, gq, gk, gv, gP, scale, DSK_GRAD_ADD));
    check(gdq, dq, rt, at, "dq (accumulated)");
    check(gdk, dk, rt, at, "dk (accumulated)");
    check(gdv, dv, rt, at, "dv (accumulated)");
    { /* written into NaN on the GPU against the CPU's add into zeros */
        dsk_tensor *z[3], *w[3];
        const char *what[3] = {"dq (written)", "dk (written)", "dv (written)"};
        for (int i = 0; i < 3; i++) {
            z[i] = hzeros(dt, SH(B, T, H, Dh));
            w[i] = dpoison(z[i]);
        }
        DSK_TEST_OK(dsk_attention_backward(NULL, z[0], z[1], z[2], dout, q, k, v, P, scale, DSK_GRAD_ADD));
        DSK_TEST_OK(dsk_attention_backward(&G, w[0], w[1], w[2], gdout, gq, gk, gv, gP, scale, DSK_GRAD_WRITE));
        for (int i = 0; i < 3; i++) check(w[i], z[i], rt, at, what[i]);
    }
}

/* ------------------------------------------------------------------ fused attention */

/* The (B, T, H, D) slice [off, off + D) of the last dim of p (on p's device). */
static dsk_tensor *fa_slice(const dsk_tensor *p, int64_t off, int64_t D) {
    dsk_tensor s;
    DSK_TEST_OK(dsk_tensor_slice(p, 3, off, D, &s));
    return keep(s);
}

/* The fused op on the GPU against its CPU path (which test_tensor checks against float64) on the
   same inputs: out and lse (NaN-poisoned on the GPU), and dq, dk, dv accumulated onto the same
   random values. packed: q, k, v and the gradients are slices of one (B, T, H, 2 Dk + Dv) tensor
   on each device. The GPU runs bf16/f16 through tensor cores with P and dS rounded to the
   dtype (FlashAttention's choice), hence the bf16 bounds. */
static void test_attention_fused(dsk_dtype dt, int64_t B, int64_t T, int64_t H, int64_t Dk, int64_t Dv, int packed, int with_lse) {
    float scale = 1.0f / sqrtf((float)Dk);
    double rt = dt == DSK_F32 ? 1e-4 : 2e-2, at = dt == DSK_F32 ? 2e-5 : 2e-2;
    dsk_tensor *q, *k, *v, *dq, *dk, *dv, *gq, *gk, *gv, *gdq, *gdk, *gdv;
    dsk_tensor *dout = hrand(dt, SH(B, T, H, Dv), -1, 1), *gdout = dev(dout);
    dsk_tensor *out = halloc(dt, SH(B, T, H, Dv)), *gout = dpoison(out), *lse = halloc(DSK_F32, SH(B, H, T)), *glse = dpoison(lse);
    if (packed) {
        dsk_tensor *p = hrand(dt, SH(B, T, H, 2 * Dk + Dv), -2, 2), *g = hrand(dt, SH(B, T, H, 2 * Dk + Dv), -1, 1);
        dsk_tensor *gp = dev(p), *gg = dev(g);
        q = fa_slice(p, 0, Dk); k = fa_slice(p, Dk, Dk); v = fa_slice(p, 2 * Dk, Dv);
        dq = fa_slice(g, 0, Dk); dk = fa_slice(g, Dk, Dk); dv = fa_slice(g, 2 * Dk, Dv);
        gq = fa_slice(gp, 0, Dk); gk = fa_slice(gp, Dk, Dk); gv = fa_slice(gp, 2 * Dk, Dv);
        gdq = fa_slice(gg, 0, Dk); gdk = fa_slice(gg, Dk, Dk); gdv = fa_slice(gg, 2 * Dk, Dv);
    } else {
        q = hrand(dt, SH(B, T, H, Dk), -2, 2); k = hrand(dt, SH(B, T, H, Dk), -2, 2); v = hrand(dt, SH(B, T, H, Dv), -1, 1);
        dq = hrand(dt, SH(B, T, H, Dk), -1, 1); dk = hrand(dt, SH(B, T, H, Dk), -1, 1); dv = hrand(dt, SH(B, T, H, Dv), -1, 1);
        gq = dev(q); gk = dev(k); gv = dev(v); gdq = dev(dq); gdk = dev(dk); gdv = dev(dv);
    }
    DSK_TEST_OK(dsk_attention_fused(NULL, out, lse, q, k, v, scale));
    DSK_TEST_OK(dsk_attention_fused(&G, gout, with_lse ? glse : NULL, gq, gk, gv, scale));
    check(gout, out, rt, at, "out");
    if (!with_lse) return;
    check(glse, lse, 1e-4, 1e-4, "lse");
    DSK_TEST_OK(dsk_attention_fused_backward(NULL, dq, dk, dv, dout, q, k, v, out, lse, scale, DSK_GRAD_ADD));
    DSK_TEST_OK(dsk_tensor_copy(&G, gout, out)); /* backward from the same out and lse */
    DSK_TEST_OK(dsk_tensor_copy(&G, glse, lse));
    DSK_TEST_OK(dsk_attention_fused_backward(&G, gdq, gdk, gdv, gdout, gq, gk, gv, gout, glse, scale, DSK_GRAD_ADD));
    check(gdq, dq, rt, at, "dq (accumulated)");
    check(gdk, dk, rt, at, "dk (accumulated)");
    check(gdv, dv, rt, at, "dv (accumulated)");
    { /* written into NaN on the GPU (slices of one tensor when packed) against the CPU's add into zeros */
        dsk_tensor *z[3], *w[3];
        const char *what[3] = {"dq (written)", "dk (written)", "dv (written)"};
        if (packed) {
            dsk_tensor *zp = hzeros(dt, SH(B, T, H, 2 * Dk + Dv)), *wp = dpoison(zp);
            z[0] = fa_slice(zp, 0, Dk);
            z[1] = fa_slice(zp, Dk, Dk);
            z[2] = fa_slice(zp, 2 * Dk, Dv);
            w[0] = fa_slice(wp, 0, Dk);
            w[1] = fa_slice(wp, Dk, Dk);
            w[2] = fa_slice(wp, 2 * Dk, Dv);
        } else {
            z[0] = hzeros(dt, SH(B, T, H, Dk));
            z[1] = hzeros(dt, SH(B, T, H, Dk));
            z[2] = hzeros(dt, SH(B, T, H, Dv));
            for (int i = 0; i < 3; i++) w[i] = dpoison(z[i]);
        }
        DSK_TEST_OK(dsk_attention_fused_backward(NULL, z[0], z[1], z[2], dout, q, k, v, out, lse, scale, DSK_GRAD_ADD));
        DSK_TEST_OK(
            dsk_attention_fused_backward(&G, w[0], w[1], w[2], gdout, gq, gk, gv, gout, glse, scale, DSK_GRAD_WRITE));
        for (int i = 0; i < 3; i++) check(w[i], z[i], rt, at, what[i]);
    }
}

/* Head dims beyond the kernels' 256: DSK_ERR_UNSUPPORTED, nothing launched. */
static void test_attention_fused_limits(void) {
    dsk_tensor *q = dalloc(DSK_BF16, SH(1, 4, 1, 264)), *v = dalloc(DSK_BF16, SH(1, 4, 1, 8)), *lse = dalloc(DSK_F32, SH(1, 1, 4));
    DSK_TEST_STATUS(dsk_attention_fused(&G, v, lse, q, q, v, 1.0f), DSK_ERR_UNSUPPORTED);
    DSK_TEST_ERROR_MENTIONS("dsk_attention_fused: head dims Dk 264, Dv 8: the CUDA kernels take at most 256");
}

/* ------------------------------------------------------------------ AdamW */

static void test_adamw(dsk_dtype gdt, dsk_dtype copy_dt, int64_t n, dsk_dtype mdt) {
    dsk_adamw_opts o;
    dsk_tensor *p = hrand(DSK_F32, SH(n), -1, 1), *m = hrand(mdt, SH(n), -0.1, 0.1), *v = hrand(mdt, SH(n), 0, 0.01);
    dsk_tensor *gp = dev(p), *gm = dev(m), *gv = dev(v), *cp = NULL, *gcp = NULL;
    o = dsk_adamw_defaults();
    o.lr = 1e-2f;
    o.weight_decay = 0.1f;
    if (copy_dt != DSK_DTYPE_COUNT) {
        cp = halloc(copy_dt, SH(n));
        gcp = dpoison(cp);
    }
    for (int64_t step = 1; step <= 3; step++) {
        dsk_tensor *g = hrand(gdt, SH(n), -1, 1), *gg = dev(g);
        DSK_TEST_OK(dsk_adamw_step(NULL, p, g, m, v, &o, step, 0.5f, cp));
        DSK_TEST_OK(dsk_adamw_step(&G, gp, gg, gm, gv, &o, step, 0.5f, gcp));
    }
    check(gp, p, 1e-6, 1e-7, "param");
    check(gm, m, mdt == DSK_F32 ? 1e-5 : 0.0, mdt == DSK_F32 ? 1e-8 : 0.0, "m"); /* bf16: the same bits */
    check(gv, v, mdt == DSK_F32 ? 1e-5 : 0.0, mdt == DSK_F32 ? 1e-10 : 0.0, "v");
    if (cp) check(gcp, cp, rtol_of(copy_dt), atol_of(copy_dt), "param copy");
}

/* ------------------------------------------------------------------ main */

int main(int argc, char **argv) {
    static const dsk_dtype fdt[] = {DSK_F32, DSK_BF16};
    char self[4096];
    ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
    self[k > 0 ? k : 0] = 0;
#ifdef DSK_CUDA
    if (argc == 2 && !strcmp(argv[1], "--no-device-child")) {
        test_no_device_fallback();
        return dsk_test_g.checks_failed_total ? 1 : 0;
    }
#endif
    (void)argc;
    (void)argv;
    dsk_test_init("test_tensor_gpu");
    gpu_test_setup();

#ifdef DSK_CUDA
    DSK_TEST_RUN(test_device_count);
    DSK_TEST_RUN(test_launchers_need_ctx);
    dsk_test_begin("no device: PREFER_CUDA fails, AUTO uses the CPU");
    if (have_gpu) test_no_device_child(self);
    else test_no_device_fallback();
    dsk_test_end();
    CASE(test_ctx_errors(), "ctx and allocation errors");
    CASE(test_runtime_no_ctx(), "runtime without a ctx: device memory, copies, a stream of its own, events");
#endif
    CASE(test_two_devices(), "one thread, two devices: ops alternate between contexts");

    for (int i = 0; i < N_DTYPES; i++) CASE(test_copy_roundtrip(all_dtypes[i]), "copy round trip %s", dsk_dtype_name(all_dtypes[i]));
    CASE(test_cast_all(), "casts between all %d dtypes, specials included", N_DTYPES);
    CASE(test_copy_strided(DSK_F32, DSK_F32, 7, 129), "strided copy f32 -> f32 (7, 129)");
    CASE(test_copy_strided(DSK_F32, DSK_BF16, 1, 33), "strided copy f32 -> bf16 (1, 33)");
    CASE(test_copy_strided(DSK_BF16, DSK_F16, 129, 7), "strided copy bf16 -> f16 (129, 7)");
    CASE(test_copy_strided(DSK_F32, DSK_F32, 129, 7), "strided copy f32 -> f32 (129, 7)");
    CASE(test_copy_strided(DSK_I64, DSK_I64, 5, 9), "strided copy i64 -> i64 (5, 9)");
    CASE(test_copy_strided(DSK_I64, DSK_I64, 40, 9), "strided copy i64 -> i64 (40, 9)");
    CASE(test_fill(DSK_F32, 0.0), "fill f32 0");
    CASE(test_fill(DSK_F32, -0.0), "fill f32 -0");
    CASE(test_fill(DSK_BF16, 3.14159), "fill bf16 pi");
    CASE(test_fill(DSK_E4M3, 1000.0), "fill e4m3 1000 (saturates)");
    CASE(test_fill(DSK_I32, -7.9), "fill i32 -7.9");
    CASE(test_rng(DSK_F32, 42, 0), "rng f32 seed 42");
    CASE(test_rng(DSK_BF16, 7, 1000003), "rng bf16 seed 7 offset 1000003");
    CASE(test_rng(DSK_F32, 0xFFFFFFFFFFull, (uint64_t)1 << 40), "rng f32 large seed and offset");

    for (int t = 0; t < 4; t++) {
        int ta = t & 1, tb = t >> 1;
        CASE(test_matmul(DSK_F32, DSK_F32, 1, 1, 1, ta, tb, 0, 0, 0, 0.0f), "matmul f32 1x1x1 ta %d tb %d", ta, tb);
        CASE(test_matmul(DSK_F32, DSK_F32, 7, 5, 3, ta, tb, 0, 0, 1, 0.5f), "matmul f32 7x5x3 views ta %d tb %d beta 0.5", ta, tb);
        CASE(test_matmul(DSK_F32, DSK_F32, 129, 33, 65, ta, tb, 0, 0, 0, 0.0f), "matmul f32 129x33x65 ta %d tb %d", ta, tb);
        CASE(test_matmul(DSK_BF16, DSK_F32, 64, 129, 256, ta, tb, 0, 0, 1, 0.0f), "matmul bf16 -> f32 64x129x256 views ta %d tb %d", ta, tb);
        CASE(test_matmul(DSK_BF16, DSK_BF16, 33, 64, 130, ta, tb, 3, 1, 0, 1.0f), "matmul bf16 batched 3x33x64x130 ta %d tb %d beta 1", ta, tb);
        CASE(test_matmul(DSK_F16, DSK_F32, 17, 31, 64, ta, tb, 4, 0, 0, 0.0f), "matmul f16 -> f32 4x17x31x64, 2-D A shared ta %d tb %d", ta, tb);
    }
    CASE(test_matmul(DSK_F16, DSK_F16, 65, 7, 129, 0, 1, 2, 1, 1, 0.25f), "matmul f16 -> f16 batched views 2x65x7x129");
    CASE(test_matmul(DSK_F32, DSK_F32, 8, 9, 0, 0, 0, 0, 0, 0, 0.5f), "matmul f32 K = 0 scales C by beta");
    CASE(test_matmul(DSK_F32, DSK_F32, 8, 9, 0, 0, 0, 0, 0, 0, 0.0f), "matmul f32 K = 0, beta 0 zeroes a NaN C");

    for (int d = 0; d < 2; d++) {
        const char *dn = dsk_dtype_name(fdt[d]);
        CASE(test_elementwise(fdt[d], SH(1)), "add/mul/scale/axpy %s (1)", dn);
        CASE(test_elementwise(fdt[d], SH(7, 129)), "add/mul/scale/axpy %s (7, 129)", dn);
        CASE(test_elementwise(fdt[d], SH(100003)), "add/mul/scale/axpy %s (100003)", dn);
        CASE(test_activations(fdt[d], 1), "silu/swiglu and backward %s (1)", dn);
        CASE(test_activations(fdt[d], 4099), "silu/swiglu and backward %s (4099)", dn);
        CASE(test_reduce(fdt[d], SH(7, 129), 1), "reduce %s (7, 129) axis 1", dn);
        CASE(test_reduce(fdt[d], SH(7, 129), 0), "reduce %s (7, 129) axis 0", dn);
        CASE(test_reduce(fdt[d], SH(3, 5, 7), -2), "reduce %s (3, 5, 7) axis -2", dn);
        CASE(test_reduce(fdt[d], SH(1, 1), 0), "reduce %s (1, 1) axis 0", dn);
        CASE(test_reduce(fdt[d], SH(2, 70001), 1), "reduce %s (2, 70001) axis 1", dn);
        CASE(test_sum_squares(fdt[d], 1), "sum_squares %s (1)", dn);
        CASE(test_sum_squares(fdt[d], 129), "sum_squares %s (129)", dn);
        CASE(test_sum_squares(fdt[d], 3000017), "sum_squares %s (3000017)", dn);
        CASE(test_softmax(fdt[d], SH(1, 1)), "softmax %s (1, 1)", dn);
        CASE(test_softmax(fdt[d], SH(7, 129)), "softmax %s (7, 129)", dn);
        CASE(test_softmax(fdt[d], SH(2, 3, 5000)), "softmax %s (2, 3, 5000)", dn);
        CASE(test_rmsnorm(fdt[d], 1, 7), "rmsnorm %s (1, 7)", dn);
        CASE(test_rmsnorm(fdt[d], 7, 129), "rmsnorm %s (7, 129)", dn);
        CASE(test_rmsnorm(fdt[d], 1000, 33), "rmsnorm %s (1000, 33)", dn);
        CASE(test_rows(fdt[d], 1, 5, 7), "gather/scatter/embedding %s R 1 N 5 D 7", dn);
        CASE(test_rows(fdt[d], 13, 50, 129), "gather/scatter/embedding %s R 13 N 50 D 129", dn);
        CASE(test_rows(fdt[d], 1000, 4096, 64), "gather/scatter/embedding %s R 1000 N 4096 D 64", dn);
        CASE(test_cross_entropy(fdt[d], 1, 5, 0, 1), "cross_entropy %s T 1 V 5", dn);
        CASE(test_cross_entropy(fdt[d], 33, 129, 5, 1), "cross_entropy %s T 33 V 129, ignored tokens", dn);
        CASE(test_cross_entropy(fdt[d], 7, 5000, 2, 0), "cross_entropy %s T 7 V 5000, loss only", dn);
        CASE(test_cross_entropy(fdt[d], 4, 9, 400, 1), "cross_entropy %s all tokens ignored", dn);
        CASE(test_rope(fdt[d], 2, 7, 3, 8, 0), "rope %s (2, 7, 3, 8) pos0 0", dn);
        CASE(test_rope(fdt[d], 1, 33, 2, 64, 100), "rope %s (1, 33, 2, 64) pos0 100", dn);
        CASE(test_attention(fdt[d], 1, 1, 1, 4), "attention %s (1, 1, 1, 4)", dn);
        CASE(test_attention(fdt[d], 2, 7, 3, 8), "attention %s (2, 7, 3, 8)", dn);
        CASE(test_attention(fdt[d], 1, 65, 2, 16), "attention %s (1, 65, 2, 16)", dn);
    }
    for (int d = 0; d < 3; d++) {
        static const dsk_dtype fa_dt[3] = {DSK_F32, DSK_BF16, DSK_F16};
        static const int64_t fa[6][7] = {{1, 1, 1, 32, 32, 0, 1}, {2, 7, 3, 32, 32, 0, 1}, {1, 129, 2, 64, 64, 0, 1},
                                         {2, 33, 1, 64, 32, 0, 1}, {1, 40, 2, 40, 24, 1, 1}, {1, 70, 1, 16, 16, 0, 0}};
        const char *dn = dsk_dtype_name(fa_dt[d]);
        for (int c = 0; c < 6; c++) {
            const int64_t *f = fa[c];
            CASE(test_attention_fused(fa_dt[d], f[0], f[1], f[2], f[3], f[4], (int)f[5], (int)f[6]),
                 "fused attention %s (%lld, %lld, %lld) Dk %lld Dv %lld%s%s", dn, (long long)f[0], (long long)f[1], (long long)f[2],
                 (long long)f[3], (long long)f[4], f[5] ? ", slices of one projection" : "", f[6] ? "" : ", no lse");
        }
    }
    CASE(test_attention_fused(DSK_BF16, 1, 9, 1, 256, 200, 0, 1), "fused attention bf16 (1, 9, 1) Dk 256 Dv 200: smaller tiles");
    CASE(test_attention_fused_limits(), "fused attention: head dims beyond 256");
    CASE(test_elementwise(DSK_F16, SH(33, 7)), "add/mul/scale/axpy f16 (33, 7)");
    CASE(test_group_by_key(0, 3), "group_by_key N 0");
    CASE(test_group_by_key(7, 1), "group_by_key N 7 G 1");
    CASE(test_group_by_key(3000, 64), "group_by_key N 3000 G 64 (3 chunks)");
    CASE(test_matmul_grouped(DSK_F32, DSK_F32, 0, 1, 4, 150, 0, 70, 33, 0.0f), "matmul_grouped rows f32 tb");
    CASE(test_matmul_grouped(DSK_F32, DSK_F32, 0, 0, 3, 40, 0, 129, 17, 0.5f), "matmul_grouped rows f32 beta");
    CASE(test_matmul_grouped(DSK_BF16, DSK_F32, 0, 1, 8, 300, 0, 48, 80, 0.0f), "matmul_grouped rows bf16 -> f32");
    CASE(test_matmul_grouped(DSK_BF16, DSK_BF16, 0, 0, 5, 100, 0, 32, 64, 0.0f), "matmul_grouped rows bf16 -> bf16");
    CASE(test_matmul_grouped(DSK_F32, DSK_F32, 1, 0, 4, 150, 33, 70, 0, 1.0f), "matmul_grouped weights f32 beta 1");
    CASE(test_matmul_grouped(DSK_BF16, DSK_F32, 1, 0, 6, 200, 64, 17, 0, 1.0f), "matmul_grouped weights bf16 -> f32");
    CASE(test_matmul_grouped(DSK_F16, DSK_F16, 1, 0, 3, 60, 9, 20, 0, 0.0f), "matmul_grouped weights f16");
    CASE(test_matmul_grouped(DSK_F16, DSK_F32, 0, 1, 4, 90, 0, 40, 48, 0.25f), "matmul_grouped rows f16 -> f32 tb beta");
    /* The tensor-core tile's 128-bit staging in each operand layout: segments past one 128-row tile,
       several K steps and a short last one, partial column tiles; then K odd (element loads only). */
    CASE(test_matmul_grouped(DSK_BF16, DSK_F32, 0, 1, 3, 700, 0, 200, 136, 0.0f),
         "matmul_grouped rows bf16 tb 128-bit");
    CASE(test_matmul_grouped(DSK_BF16, DSK_BF16, 0, 0, 3, 400, 0, 136, 72, 0.5f),
         "matmul_grouped rows bf16 128-bit beta");
    CASE(test_matmul_grouped(DSK_BF16, DSK_F32, 1, 0, 3, 600, 136, 144, 0, 0.5f),
         "matmul_grouped weights bf16 128-bit");
    CASE(test_matmul_grouped(DSK_F16, DSK_F32, 0, 1, 3, 300, 0, 130, 81, 0.0f), "matmul_grouped rows f16 tb K 81");
    CASE(test_swiglu_grouped(DSK_F32), "swiglu_grouped + backward f32");
    CASE(test_swiglu_grouped(DSK_BF16), "swiglu_grouped + backward bf16");
    for (int d = 0; d < 3; d++)
        CASE(test_gather_rows_scaled(d == 0 ? DSK_F32 : d == 1 ? DSK_BF16 : DSK_F16, 13, 50, 129),
             "gather_rows_scaled %s", d == 0 ? "f32" : d == 1 ? "bf16" : "f16");
    CASE(test_gather_rows_fp8(DSK_E4M3, 13, 50, 160), "gather_rows_scaled e4m3 codes");
    CASE(test_gather_rows_fp8(DSK_E5M2, 13, 50, 33), "gather_rows_scaled e5m2 codes");
    CASE(test_counters_and_graph(), "ctx counters; graph capture and replay; a sync inside a capture fails");
    CASE(test_topk(7, 1, 1, 0), "topk R 7 C 1 k 1");
    CASE(test_topk(7, 8, 8, 1), "topk R 7 C 8 k 8, NaN and -Inf");
    CASE(test_topk(33, 129, 6, 1), "topk R 33 C 129 k 6, NaN and -Inf");
    CASE(test_topk(3, 1000, 129, 0), "topk R 3 C 1000 k 129, ties");
    CASE(test_adamw(DSK_F32, DSK_DTYPE_COUNT, 7, DSK_F32), "adamw f32 grad (7)");
    CASE(test_adamw(DSK_BF16, DSK_BF16, 129, DSK_F32), "adamw bf16 grad, bf16 copy (129)");
    CASE(test_adamw(DSK_F32, DSK_F16, 100003, DSK_F32), "adamw f32 grad, f16 copy (100003)");
    CASE(test_adamw(DSK_F32, DSK_BF16, 4099, DSK_BF16), "adamw bf16 moments, bf16 copy (4099)");

    gpu_test_teardown();
    return dsk_test_finish();
}
