/* gpu_test_util.h - what the GPU tests that compare against the CPU path share: the CUDA
   context every case runs on (G) and whether there is one (have_gpu), a pool of tensors freed
   after each case, and CASE, which runs a case or, without a usable device, reports it as
   skipped (never passed). Include after dsk_tensor.h (or a header that includes it) and
   tests/dsk_test.h; static, one test program per translation unit. */
#ifndef DSK_GPU_TEST_UTIL_H
#define DSK_GPU_TEST_UTIL_H
#ifdef DSK_CUDA /* what the GPU cases call besides the API and the launchers (dsk_cuda_*): the runtime */
#include <cuda_runtime.h>
#endif

static dsk_ctx G; /* the CUDA context; valid only when have_gpu */
static int have_gpu;

/* Opens G on a CUDA device and sets have_gpu. Without a usable device (no driver, no device,
   a CPU-only build) says so on a comment line; cases then report as skipped. */
static inline void gpu_test_setup(void) {
    dsk_ctx_opts o;
    memset(&o, 0, sizeof o);
    o.device = DSK_PREFER_CUDA;
    have_gpu = dsk_cuda_available() && dsk_ctx_init(&G, &o) == DSK_OK;
    if (!have_gpu) printf("# no usable CUDA device (%s): GPU cases are skipped\n", dsk_last_error()[0] ? dsk_last_error() : "none");
}
/* A second context, on CUDA device `index`, for cases where one thread drives two devices;
   0 when there is no such device (the case then skips). */
static inline int gpu_test_ctx_on(int index, dsk_ctx *c) {
    dsk_ctx_opts o;
    int n = 0;
    memset(c, 0, sizeof *c);
#ifdef DSK_CUDA
    if (!have_gpu || dsk_cuda_device_count(&n) != DSK_OK || n <= index) return 0;
#endif
    memset(&o, 0, sizeof o);
    o.device = DSK_PREFER_CUDA;
    o.cuda_index = index;
    return n > index && dsk_ctx_init(c, &o) == DSK_OK;
}

static dsk_tensor **gpu_test_pool;
static int gpu_test_pool_n, gpu_test_pool_cap;

static inline void gpu_test_teardown(void) {
    if (have_gpu) dsk_ctx_free(&G);
    free(gpu_test_pool);
    gpu_test_pool = NULL;
    gpu_test_pool_cap = 0;
}

/* ---- tensor pool: every tensor a case makes through these is freed by release() */

static inline dsk_tensor *keep(dsk_tensor t) {
    dsk_tensor *p = (dsk_tensor *)malloc(sizeof *p);
    if (p && gpu_test_pool_n == gpu_test_pool_cap) { /* a case may keep any number of tensors */
        int cap = gpu_test_pool_cap ? 2 * gpu_test_pool_cap : 256;
        dsk_tensor **grown = (dsk_tensor **)realloc(gpu_test_pool, (size_t)cap * sizeof *grown);
        if (grown) gpu_test_pool = grown, gpu_test_pool_cap = cap;
    }
    if (!p || gpu_test_pool_n == gpu_test_pool_cap) { fprintf(stderr, "%s: out of memory for the tensor pool\n", dsk_test_g.program); exit(2); }
    *p = t;
    gpu_test_pool[gpu_test_pool_n++] = p;
    return p;
}
static inline void release(void) {
    for (int i = 0; i < gpu_test_pool_n; i++) {
        dsk_tensor_free(gpu_test_pool[i]->device.type == DSK_DEV_CUDA ? &G : NULL, gpu_test_pool[i]);
        free(gpu_test_pool[i]);
    }
    gpu_test_pool_n = 0;
}
/* Pooled CPU / GPU tensor (contents undefined). */
static inline dsk_tensor *halloc(dsk_dtype dt, int nd, const int64_t *shape) {
    dsk_tensor t;
    memset(&t, 0, sizeof t);
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &t, dt, nd, shape));
    return keep(t);
}
static inline dsk_tensor *dalloc(dsk_dtype dt, int nd, const int64_t *shape) {
    dsk_tensor t;
    memset(&t, 0, sizeof t);
    DSK_TEST_OK(dsk_tensor_alloc(&G, &t, dt, nd, shape));
    return keep(t);
}
/* Pooled GPU copy of a CPU tensor. */
static inline dsk_tensor *dev(const dsk_tensor *h) {
    dsk_tensor *d = dalloc(h->dtype, h->ndim, h->shape);
    DSK_TEST_OK(dsk_tensor_copy(&G, d, h));
    return d;
}
/* Pooled host copy of any tensor, cast to dt. */
static inline dsk_tensor *host_as(const dsk_tensor *t, dsk_dtype dt) {
    dsk_tensor *h = halloc(dt, t->ndim, t->shape);
    DSK_TEST_OK(dsk_tensor_copy(&G, h, t));
    return h;
}

/* One case: `call` on the GPU, or skipped without one; the pool is released either way. */
#define CASE(call, ...)                                        \
    do {                                                       \
        dsk_test_begin(__VA_ARGS__);                           \
        if (!have_gpu) dsk_test_skip("no usable CUDA device"); \
        else call;                                             \
        release();                                             \
        dsk_test_end();                                        \
    } while (0)

#endif /* DSK_GPU_TEST_UTIL_H */
