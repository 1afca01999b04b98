/* kernels/tensor.cu - the CUDA path of dsk_tensor.h: runtime (devices, streams, cuBLAS,
   memory) and one launcher per tensor op, with the contracts of dsk_tensor.h's CUDA launchers.

   Conventions (kernels/dsk_cuda.cuh): every launcher checks its ctx and makes its device
   current, enqueues on ctx->stream and returns without synchronising; every CUDA and cuBLAS
   call is checked and cudaGetLastError() follows every launch. Elements are read and
   written through dsk_tensor.h's element-access layer (dsk_load_f32, dsk_store_f64, ...)
   and the elementwise math comes from its DSK_HD functions, so the CPU and the GPU run the
   same formulas. Reductions use block trees of a fixed shape (the block size and
   the partition depend only on the tensor's shape), never float atomics, so results are
   bitwise reproducible on a given device. Scratch memory comes from cudaMallocAsync on the
   context's stream and is freed stream-ordered before the launcher returns. Indices are
   validated on the CPU path only; here an out-of-range index never touches memory out of
   bounds: gathers write NaN rows, scatters skip the row, and cross-entropy yields a NaN loss
   and NaN gradient row. */
#include <cub/cub.cuh>
#include <math.h>
#include <type_traits>
#include "dsk_cuda.cuh"
#ifndef DSK_CUDA_EMU
#include <dlfcn.h>
#include <mutex>
#endif

/* ======================================================================= cuBLAS, loaded on first use

   A real CUDA build does not link cuBLAS: loading libcublas and libcublasLt costs every process
   about 0.1 s of CPU (their static initialisers), CPU-only runs included. The first
   dsk_cuda_ctx_init dlopens "libcublas.so.<CUBLAS_VER_MAJOR>" (the toolkit compiled against) once
   and resolves the entry points below; a missing library or symbol is its DSK_ERR_CUDA. The
   CUDA emulator (DSK_CUDA_EMU) links its cuBLAS statically: the table holds its functions. */
/* cublasGemmStridedBatchedEx is overloaded in C++ (an int64_t variant): its int one, checked
   against the header (an unevaluated static_cast picks the overload of this type, or fails). */
typedef cublasStatus_t (*dsk__cublas_gemm_sb_fn)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                                 const void *, const void *, cudaDataType, int, long long int,
                                                 const void *, cudaDataType, int, long long int, const void *, void *,
                                                 cudaDataType, int, long long int, int, cublasComputeType_t,
                                                 cublasGemmAlgo_t);
static_assert(std::is_same<decltype(static_cast<dsk__cublas_gemm_sb_fn>(&cublasGemmStridedBatchedEx)),
                           dsk__cublas_gemm_sb_fn>::value,
              "cublasGemmStridedBatchedEx's prototype");
struct dsk__cublas_fns {
    decltype(&cublasCreate) create;
    decltype(&cublasDestroy) destroy;
    decltype(&cublasSetStream) set_stream;
    decltype(&cublasSetWorkspace) set_workspace;
    decltype(&cublasGetStatusString) status_string;
    dsk__cublas_gemm_sb_fn gemm_strided_batched_ex;
};

#ifdef DSK_CUDA_EMU
static const dsk__cublas_fns dsk__cublas = {cublasCreate,       cublasDestroy,         cublasSetStream,
                                            cublasSetWorkspace, cublasGetStatusString, cublasGemmStridedBatchedEx};
static dsk_status dsk__cublas_ready(void) { return DSK_OK; }
#else
#define DSK__CUBLAS_STR2(x) #x
#define DSK__CUBLAS_STR(x) DSK__CUBLAS_STR2(x)
#define DSK__CUBLAS_LIB "libcublas.so." DSK__CUBLAS_STR(CUBLAS_VER_MAJOR)

static dsk__cublas_fns dsk__cublas; /* all set by dsk__cublas_ready's one load, or all NULL */
/* Every entry point: its field and the name libcublas exports. */
#define DSK__CUBLAS_FNS(X) \
    X(create, "cublasCreate_v2") \
    X(destroy, "cublasDestroy_v2") \
    X(set_stream, "cublasSetStream_v2") \
    X(set_workspace, "cublasSetWorkspace_v2") \
    X(status_string, "cublasGetStatusString") \
    X(gemm_strided_batched_ex, "cublasGemmStridedBatchedEx")

/* dlopens `lib` and resolves every entry point into *f (the exported names: cublas_v2.h maps
   cublasCreate to cublasCreate_v2 and so on). On failure *f is untouched and the library closed. */
static dsk_status dsk__cublas_open(const char *lib, dsk__cublas_fns *f, void **handle) {
    static const char *fn = "dsk_ctx_init";
    dsk__cublas_fns t;
    const char *err;
    void *h;
    dlerror();
    if (!(h = dlopen(lib, RTLD_NOW | RTLD_LOCAL))) {
        err = dlerror();
        return dsk_set_error(DSK_ERR_CUDA, "%s: loading cuBLAS: dlopen(\"%s\") failed: %s", fn, lib,
                             err ? err : "(no dlerror)");
    }
#define DSK__CUBLAS_SYM(field, name) \
    dlerror(); \
    if (!(t.field = reinterpret_cast<decltype(t.field)>(dlsym(h, name)))) { \
        err = dlerror(); \
        dsk_set_error(DSK_ERR_CUDA, "%s: loading cuBLAS: dlsym(\"%s\", \"%s\") failed: %s", fn, lib, name, \
                      err ? err : "(NULL)"); \
        dlclose(h); \
        return DSK_ERR_CUDA; \
    }
    DSK__CUBLAS_FNS(DSK__CUBLAS_SYM)
#undef DSK__CUBLAS_SYM
    *f = t;
    *handle = h;
    return DSK_OK;
}

/* The process's one load of cuBLAS (thread-safe); its failure is returned, with its message, to
   every call. */
static dsk_status dsk__cublas_ready(void) {
    static std::once_flag once;
    static dsk_status status;
    static char message[512];
    std::call_once(once, [] {
        void *h = NULL;
        status = dsk__cublas_open(DSK__CUBLAS_LIB, &dsk__cublas, &h);
        if (status != DSK_OK) snprintf(message, sizeof message, "%s", dsk_last_error());
    });
    if (status != DSK_OK) return dsk_set_error(status, "%s", message);
    return DSK_OK;
}

/* For tests (tests/test_tensor.c), not a public API: lib NULL loads cuBLAS as dsk_cuda_ctx_init
   does (dsk__cublas_open sets every entry point or none); otherwise a trial load of `lib` (closed
   again) that leaves the process's table alone, to see a load's errors. */
extern "C" dsk_status dsk__cuda_cublas_load(const char *lib) {
    dsk__cublas_fns t;
    void *h = NULL;
    if (!lib) return dsk__cublas_ready();
    DSK__TRY(dsk__cublas_open(lib, &t, &h));
    dlclose(h);
    return DSK_OK;
}
#endif

const char *dsk__cuda_cublas_status_string(cublasStatus_t st) {
    return dsk__cublas.status_string ? dsk__cublas.status_string(st) : "(cuBLAS not loaded)";
}

/* ======================================================================= runtime */

extern "C" dsk_status dsk_cuda_device_count(int *n) {
    int count = 0;
    cudaError_t e;
    if (!n) return dsk_set_error(DSK_ERR_ARG, "dsk_cuda_device_count: n is NULL");
    e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) { /* no driver or no device: a CPU machine, not an error */
        (void)cudaGetLastError();
        count = 0;
    }
    *n = count;
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_ctx_init(dsk_ctx *ctx, int index) {
    static const char *fn = "dsk_ctx_init";
    cudaStream_t stream = NULL;
    cublasHandle_t handle = NULL;
    cublasStatus_t st;
    cudaMemPool_t pool;
    uint64_t keep = UINT64_MAX;
    char detail[96];
    int n = 0;
    DSK__TRY(dsk_cuda_device_count(&n));
    if (index < 0 || index >= n)
        return dsk_set_error(DSK_ERR_ARG, "%s: CUDA device %d requested, %d present", fn, index, n);
    DSK__TRY(dsk__cublas_ready());
    snprintf(detail, sizeof detail, "device %d", index);
    DSK__CUDA_CHECK(fn, cudaSetDevice(index), detail);
    ctx->device.type = DSK_DEV_CUDA;
    ctx->device.index = index;
    DSK__CUDA_CHECK(fn, cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), detail);
    ctx->stream = stream;
    /* Keep freed blocks in the pool across synchronisations instead of returning them to the
       driver, so per-op scratch allocations stay cheap. */
    DSK__CUDA_CHECK(fn, cudaDeviceGetDefaultMemPool(&pool, index), detail);
    DSK__CUDA_CHECK(fn, cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), detail);
    if ((st = dsk__cublas.create(&handle)) != CUBLAS_STATUS_SUCCESS)
        return dsk__cuda_cublas_fail(fn, "cublasCreate", st, detail);
    ctx->cublas = handle;
    if ((st = dsk__cublas.set_stream(handle, stream)) != CUBLAS_STATUS_SUCCESS)
        return dsk__cuda_cublas_fail(fn, "cublasSetStream", st, detail);
    if (ctx->workspace_bytes) {
        void *ws = NULL;
        snprintf(detail, sizeof detail, "device %d, workspace of %zu bytes", index, ctx->workspace_bytes);
        DSK__CUDA_CHECK(fn, cudaMallocAsync(&ws, ctx->workspace_bytes, stream), detail);
        ctx->workspace = ws;
        if ((st = dsk__cublas.set_workspace(handle, ws, ctx->workspace_bytes)) != CUBLAS_STATUS_SUCCESS)
            return dsk__cuda_cublas_fail(fn, "cublasSetWorkspace", st, detail);
    }
    DSK__CUDA_CHECK(fn, cudaStreamSynchronize(stream), detail);
    return DSK_OK;
}

extern "C" void dsk_cuda_ctx_free(dsk_ctx *ctx) {
    cudaStream_t stream;
    if (!ctx) return;
    stream = (cudaStream_t)ctx->stream;
    if (ctx->device.type == DSK_DEV_CUDA) (void)cudaSetDevice(ctx->device.index);
    if (ctx->cublas) (void)dsk__cublas.destroy((cublasHandle_t)ctx->cublas);
    if (ctx->workspace) {
        if (stream) (void)cudaFreeAsync(ctx->workspace, stream);
        else (void)cudaFree(ctx->workspace);
    }
    if (stream) {
        (void)cudaStreamSynchronize(stream);
        (void)cudaStreamDestroy(stream);
    }
    (void)cudaGetLastError();
    ctx->cublas = NULL;
    ctx->workspace = NULL;
    ctx->stream = NULL;
}

extern "C" dsk_status dsk_cuda_sync(dsk_ctx *ctx) {
    DSK__TRY(dsk__cuda_need_ctx("dsk_ctx_sync", ctx));
    ctx->counters.syncs++;
    DSK__CUDA_CHECK("dsk_ctx_sync", cudaStreamSynchronize(dsk__cuda_stream(ctx)), "");
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_malloc(dsk_ctx *ctx, size_t bytes, void **p) {
    cudaError_t e;
    char detail[64];
    DSK__TRY(dsk__cuda_need_ctx("dsk_cuda_malloc", ctx));
    *p = NULL;
    e = cudaMallocAsync(p, bytes, dsk__cuda_stream(ctx));
    if (e == cudaSuccess) return DSK_OK;
    snprintf(detail, sizeof detail, "%zu bytes on device %d", bytes, ctx->device.index);
    (void)dsk__cuda_fail("dsk_cuda_malloc", "cudaMallocAsync", e, detail);
    *p = NULL;
    return e == cudaErrorMemoryAllocation ? DSK_ERR_OOM : DSK_ERR_CUDA;
}

extern "C" void dsk_cuda_free(dsk_ctx *ctx, void *p) {
    if (!p) return;
    if (ctx && ctx->stream) (void)cudaFreeAsync(p, (cudaStream_t)ctx->stream);
    else (void)cudaFree(p);
    (void)cudaGetLastError();
}

extern "C" dsk_status dsk_cuda_memcpy(dsk_ctx *ctx, void *dst, const void *src, size_t bytes, int to_device) {
    char detail[64];
    DSK__TRY(dsk__cuda_need_ctx("dsk_cuda_memcpy", ctx));
    if (!bytes) return DSK_OK;
    if (!to_device) {
        ctx->counters.d2h_copies++;
        ctx->counters.d2h_bytes += (int64_t)bytes;
    }
    snprintf(detail, sizeof detail, "%zu bytes %s", bytes, to_device ? "host to device" : "device to host");
    DSK__CUDA_CHECK("dsk_cuda_memcpy",
                    cudaMemcpyAsync(dst, src, bytes, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost,
                                    dsk__cuda_stream(ctx)),
                    detail);
    return DSK_OK;
}

extern "C" void *dsk_cuda_host_alloc(size_t bytes) {
    void *p = NULL;
    if (cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocDefault) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return p;
}

extern "C" void dsk_cuda_host_free(void *p) {
    if (p) (void)cudaFreeHost(p);
    (void)cudaGetLastError();
}

extern "C" dsk_status dsk_cuda_event_create(void **ev) {
    cudaEvent_t e = NULL;
    DSK__CUDA_CHECK("dsk_cuda_event_create", cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "");
    *ev = e;
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_event_record(dsk_ctx *ctx, void *ev) {
    DSK__TRY(dsk__cuda_need_ctx("dsk_cuda_event_record", ctx));
    DSK__CUDA_CHECK("dsk_cuda_event_record", cudaEventRecord((cudaEvent_t)ev, dsk__cuda_stream(ctx)), "");
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_event_wait(dsk_ctx *ctx, void *ev) {
    cudaError_t e;
    DSK__TRY(dsk__cuda_need_ctx("dsk_cuda_event_wait", ctx));
    e = cudaEventQuery((cudaEvent_t)ev);
    if (e == cudaSuccess) return DSK_OK;
    if (e != cudaErrorNotReady) return dsk__cuda_fail("dsk_cuda_event_wait", "cudaEventQuery", e, "");
    ctx->counters.syncs++; /* the host waits */
    DSK__CUDA_CHECK("dsk_cuda_event_wait", cudaEventSynchronize((cudaEvent_t)ev), "");
    return DSK_OK;
}

extern "C" void dsk_cuda_event_destroy(void *ev) {
    if (ev) (void)cudaEventDestroy((cudaEvent_t)ev);
    (void)cudaGetLastError();
}

extern "C" dsk_status dsk_cuda_graph_begin(dsk_ctx *ctx) {
    DSK__TRY(dsk__cuda_need_ctx("dsk_graph_begin", ctx));
    DSK__CUDA_CHECK("dsk_graph_begin", cudaStreamBeginCapture(dsk__cuda_stream(ctx), cudaStreamCaptureModeGlobal), "");
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_graph_end(dsk_ctx *ctx, void **graph, void **exec) {
    cudaGraph_t g = NULL;
    cudaGraphExec_t x = NULL;
    cudaError_t e;
    DSK__TRY(dsk__cuda_need_ctx("dsk_graph_end", ctx));
    e = cudaStreamEndCapture(dsk__cuda_stream(ctx), &g);
    if (e != cudaSuccess) {
        if (g) (void)cudaGraphDestroy(g);
        return dsk__cuda_fail("dsk_graph_end", "cudaStreamEndCapture", e, "a captured call failed or synchronised");
    }
    e = cudaGraphInstantiateWithFlags(&x, g, 0);
    if (e != cudaSuccess) {
        (void)cudaGraphDestroy(g);
        return dsk__cuda_fail("dsk_graph_end", "cudaGraphInstantiateWithFlags", e, "");
    }
    *graph = g;
    *exec = x;
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_graph_launch(dsk_ctx *ctx, void *exec) {
    DSK__TRY(dsk__cuda_need_ctx("dsk_graph_launch", ctx));
    DSK__CUDA_CHECK("dsk_graph_launch", cudaGraphLaunch((cudaGraphExec_t)exec, dsk__cuda_stream(ctx)), "");
    return DSK_OK;
}

extern "C" void dsk_cuda_graph_free(void *graph, void *exec) {
    if (exec) (void)cudaGraphExecDestroy((cudaGraphExec_t)exec);
    if (graph) (void)cudaGraphDestroy((cudaGraph_t)graph);
    (void)cudaGetLastError();
}

/* Streams and memory for callers without a dsk_ctx (a communicator's setup, a module's own
   stream): `stream` is a cudaStream_t, NULL the legacy default stream. */
extern "C" dsk_status dsk_cuda_set_device(int index) {
    char detail[32];
    snprintf(detail, sizeof detail, "device %d", index);
    DSK__CUDA_CHECK("dsk_cuda_set_device", cudaSetDevice(index), detail);
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_device_bus_id(int index, char *buf, int len) {
    char detail[32];
    snprintf(detail, sizeof detail, "device %d", index);
    DSK__CUDA_CHECK("dsk_cuda_device_bus_id", cudaDeviceGetPCIBusId(buf, len, index), detail);
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_device_malloc(size_t bytes, void **p) {
    char detail[48];
    cudaError_t e;
    *p = NULL;
    e = cudaMalloc(p, bytes ? bytes : 1);
    if (e == cudaSuccess) return DSK_OK;
    *p = NULL;
    snprintf(detail, sizeof detail, "%zu bytes", bytes);
    (void)dsk__cuda_fail("dsk_cuda_device_malloc", "cudaMalloc", e, detail);
    return e == cudaErrorMemoryAllocation ? DSK_ERR_OOM : DSK_ERR_CUDA;
}

/* cudaMemcpy returns from a copy out of pageable host memory once the bytes are staged, before
   the DMA to the device has landed ("API synchronization behavior" in the CUDA runtime's
   reference), and work on a non-blocking stream does not wait for it: the stream the copy ran
   on is synchronised too, so the bytes are in place when this returns. */
extern "C" dsk_status dsk_cuda_memcpy_sync(void *dst, const void *src, size_t bytes, int to_device) {
    char detail[64];
    if (!bytes) return DSK_OK;
    snprintf(detail, sizeof detail, "%zu bytes %s", bytes, to_device ? "host to device" : "device to host");
    DSK__CUDA_CHECK("dsk_cuda_memcpy_sync",
                    cudaMemcpy(dst, src, bytes, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost), detail);
    if (to_device) DSK__CUDA_CHECK("dsk_cuda_memcpy_sync", cudaStreamSynchronize(0), detail);
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_stream_create(void **stream) {
    cudaStream_t s = NULL;
    *stream = NULL;
    DSK__CUDA_CHECK("dsk_cuda_stream_create", cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "");
    *stream = s;
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_stream_sync(void *stream) {
    DSK__CUDA_CHECK("dsk_cuda_stream_sync", cudaStreamSynchronize((cudaStream_t)stream), "");
    return DSK_OK;
}

extern "C" void dsk_cuda_stream_destroy(void *stream) {
    if (stream) (void)cudaStreamDestroy((cudaStream_t)stream);
    (void)cudaGetLastError();
}

extern "C" dsk_status dsk_cuda_stream_done(void *stream, int *done) {
    cudaError_t e = cudaStreamQuery((cudaStream_t)stream);
    *done = e == cudaSuccess;
    if (e == cudaSuccess || e == cudaErrorNotReady) return DSK_OK;
    return dsk__cuda_fail("dsk_cuda_stream_done", "cudaStreamQuery", e, "");
}

extern "C" dsk_status dsk_cuda_stream_record(void *stream, void *ev) {
    DSK__CUDA_CHECK("dsk_cuda_stream_record", cudaEventRecord((cudaEvent_t)ev, (cudaStream_t)stream), "");
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_stream_wait_event(void *stream, void *ev) {
    DSK__CUDA_CHECK("dsk_cuda_stream_wait_event", cudaStreamWaitEvent((cudaStream_t)stream, (cudaEvent_t)ev, 0), "");
    return DSK_OK;
}

/* Scratch buffer of `bytes` freed stream-ordered by dsk__scratch_free. */
static dsk_status dsk__scratch(dsk_ctx *ctx, size_t bytes, void **p) {
    return dsk_cuda_malloc(ctx, bytes ? bytes : 1, p);
}
static void dsk__scratch_free(dsk_ctx *ctx, void *p) { dsk_cuda_free(ctx, p); }

/* ======================================================================= strided layouts */

/* Shape with two stride sets (a, b) over the same logical elements, dims merged where both
   tensors allow it and size-1 dims dropped; row-major logical order is preserved. */
struct dsk__lay {
    int nd;
    int64_t shape[DSK_MAX_DIMS];
    int64_t sa[DSK_MAX_DIMS];
    int64_t sb[DSK_MAX_DIMS];
};

static dsk__lay dsk__layout(const dsk_tensor *a, const dsk_tensor *b) {
    dsk__lay L;
    int k = 0;
    memset(&L, 0, sizeof L);
    for (int d = 0; d < a->ndim; d++) {
        if (a->shape[d] == 1) continue;
        if (k > 0 && L.sa[k - 1] == a->stride[d] * a->shape[d] && L.sb[k - 1] == b->stride[d] * a->shape[d]) {
            L.shape[k - 1] *= a->shape[d]; /* dim d continues the previous one in both tensors */
            L.sa[k - 1] = a->stride[d];
            L.sb[k - 1] = b->stride[d];
            continue;
        }
        L.shape[k] = a->shape[d];
        L.sa[k] = a->stride[d];
        L.sb[k] = b->stride[d];
        k++;
    }
    L.nd = k;
    return L;
}

/* Element offsets (in a and in b) of logical row-major index i. */
__device__ __forceinline__ void dsk__offsets(const dsk__lay &L, int64_t i, int64_t *oa, int64_t *ob) {
    int64_t a = 0, b = 0;
    if (L.nd <= 1) {
        *oa = L.nd ? i * L.sa[0] : 0;
        *ob = L.nd ? i * L.sb[0] : 0;
        return;
    }
    for (int d = L.nd - 1; d >= 0; d--) {
        int64_t n = L.shape[d], q = i / n, r = i - q * n;
        a += r * L.sa[d];
        b += r * L.sb[d];
        i = q;
    }
    *oa = a;
    *ob = b;
}

/* ======================================================================= copy, fill, RNG */

/* Element-wise strided copy: a thread per element (for short innermost rows). */
__global__ void dsk__k_copy_elems(void *dst, dsk_dtype dtd, const void *src, dsk_dtype dts, int es, dsk__lay L,
                                  int64_t n) {
    DSK__CUDA_FOR(i, n) {
        int64_t od, os;
        dsk__offsets(L, i, &od, &os);
        if (dtd == dts) dsk_move_elem(dst, od, src, os, es);
        else dsk_store_f64(dst, dtd, od, dsk_load_f64(src, dts, os));
    }
}

/* Row-wise strided copy: a block per row of the innermost dim (`outer` indexes the rows), the
   row's start offsets computed once, threads along the row. */
__global__ void dsk__k_copy_rows(void *dst, dsk_dtype dtd, const void *src, dsk_dtype dts, int es, dsk__lay outer,
                                 int64_t rows, int64_t len, int64_t sd, int64_t ss) {
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        int64_t od, os;
        dsk__offsets(outer, r, &od, &os);
        for (int64_t j = threadIdx.x; j < len; j += blockDim.x) {
            if (dtd == dts) dsk_move_elem(dst, od + j * sd, src, os + j * ss, es);
            else dsk_store_f64(dst, dtd, od + j * sd, dsk_load_f64(src, dts, os + j * ss));
        }
    }
}

/* Strided copy (with a cast when the dtypes differ) over the merged layout L. */
static dsk_status dsk__copy_strided(dsk_ctx *ctx, const char *fn, dsk_tensor *dst, const dsk_tensor *src, dsk__lay L,
                                    int64_t n) {
    int es = (int)dsk_dtype_size(src->dtype);
    int64_t len = L.nd ? L.shape[L.nd - 1] : 1;
    if (L.nd >= 2 && len >= 32) {
        dsk__lay outer = L;
        int64_t rows = n / len;
        unsigned grid = (unsigned)(rows < 16384 ? rows : 16384);
        outer.nd = L.nd - 1;
        DSK__CUDA_LAUNCH(fn, dsk__k_copy_rows, grid, dsk__cuda_row_threads(len), dsk__cuda_stream(ctx), n, dst->data,
                         dst->dtype, src->data, src->dtype, es, outer, rows, len, L.sa[L.nd - 1], L.sb[L.nd - 1]);
        return DSK_OK;
    }
    DSK__CUDA_LAUNCH(fn, dsk__k_copy_elems, dsk__cuda_grid(n), DSK__CUDA_THREADS, dsk__cuda_stream(ctx), n, dst->data,
                     dst->dtype, src->data, src->dtype, es, L, n);
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_tensor_copy(dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src) {
    static const char *fn = "dsk_tensor_copy";
    int64_t n = dsk_tensor_numel(src);
    dsk__lay L;
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (n == 0) return DSK_OK;
    L = dsk__layout(dst, src);
    if (dst->dtype == src->dtype) {
        if (dst->data == src->data && (L.nd == 0 || memcmp(L.sa, L.sb, sizeof L.sa) == 0))
            return DSK_OK; /* a copy onto itself */
        if (dsk_tensor_is_contiguous(dst) && dsk_tensor_is_contiguous(src)) {
            char detail[64];
            snprintf(detail, sizeof detail, "%zu bytes device to device", dsk_tensor_nbytes(src));
            DSK__CUDA_CHECK(fn,
                            cudaMemcpyAsync(dst->data, src->data, dsk_tensor_nbytes(src), cudaMemcpyDeviceToDevice,
                                            dsk__cuda_stream(ctx)),
                            detail);
            return DSK_OK;
        }
    }
    return dsk__copy_strided(ctx, fn, dst, src, L, n);
}

__global__ void dsk__k_fill(void *t, dsk_dtype dt, dsk__lay L, int64_t n, double value) {
    DSK__CUDA_FOR(i, n) {
        int64_t o, unused;
        dsk__offsets(L, i, &o, &unused);
        dsk_store_f64(t, dt, o, value);
    }
}

extern "C" dsk_status dsk_cuda_tensor_fill(dsk_ctx *ctx, dsk_tensor *t, double value) {
    static const char *fn = "dsk_tensor_fill";
    int64_t n = dsk_tensor_numel(t);
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (n == 0) return DSK_OK;
    if (value == 0.0 && !signbit(value) && dsk_tensor_is_contiguous(t)) { /* +0 is all-zero bytes in every dtype */
        char detail[48];
        snprintf(detail, sizeof detail, "%zu bytes", dsk_tensor_nbytes(t));
        DSK__CUDA_CHECK(fn, cudaMemsetAsync(t->data, 0, dsk_tensor_nbytes(t), dsk__cuda_stream(ctx)), detail);
        return DSK_OK;
    }
    DSK__CUDA_LAUNCH(fn, dsk__k_fill, dsk__cuda_grid(n), DSK__CUDA_THREADS, dsk__cuda_stream(ctx), n, t->data, t->dtype,
                     dsk__layout(t, t), n, value);
    return DSK_OK;
}

/* lo + (hi - lo) u and mean + std z with explicit roundings: no fused multiply-add, so the
   numbers match the CPU path (C11 without contraction) bit for bit for the same u. */
__global__ void dsk__k_uniform(void *t, dsk_dtype dt, dsk__lay L, int64_t n, uint64_t seed, uint64_t offset, float lo,
                               float hi) {
    DSK__CUDA_FOR(i, n) {
        int64_t o, unused;
        float u = dsk_rng_uniform_at(seed, offset, (uint64_t)i);
        dsk__offsets(L, i, &o, &unused);
        dsk_store_f64(t, dt, o, (double)__fadd_rn(lo, __fmul_rn(__fsub_rn(hi, lo), u)));
    }
}

__global__ void dsk__k_normal(void *t, dsk_dtype dt, dsk__lay L, int64_t n, uint64_t seed, uint64_t offset, float mean,
                              float std) {
    DSK__CUDA_FOR(i, n) {
        int64_t o, unused;
        float z = dsk_rng_normal_at(seed, offset, (uint64_t)i);
        dsk__offsets(L, i, &o, &unused);
        dsk_store_f64(t, dt, o, (double)__fadd_rn(mean, __fmul_rn(std, z)));
    }
}

extern "C" dsk_status dsk_cuda_tensor_uniform(dsk_ctx *ctx, dsk_tensor *t, uint64_t seed, uint64_t offset, float lo,
                                              float hi) {
    static const char *fn = "dsk_tensor_uniform";
    int64_t n = dsk_tensor_numel(t);
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (n == 0) return DSK_OK;
    DSK__CUDA_LAUNCH(fn, dsk__k_uniform, dsk__cuda_grid(n), DSK__CUDA_THREADS, dsk__cuda_stream(ctx), n, t->data,
                     t->dtype, dsk__layout(t, t), n, seed, offset, lo, hi);
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_tensor_normal(dsk_ctx *ctx, dsk_tensor *t, uint64_t seed, uint64_t offset, float mean,
                                             float std) {
    static const char *fn = "dsk_tensor_normal";
    int64_t n = dsk_tensor_numel(t);
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (n == 0) return DSK_OK;
    DSK__CUDA_LAUNCH(fn, dsk__k_normal, dsk__cuda_grid(n), DSK__CUDA_THREADS, dsk__cuda_stream(ctx), n, t->data,
                     t->dtype, dsk__layout(t, t), n, seed, offset, mean, std);
    return DSK_OK;
}

/* ======================================================================= GEMM (cuBLAS) */

static cudaDataType dsk__cuda_dtype(dsk_dtype dt) {
    return dt == DSK_BF16 ? CUDA_R_16BF : dt == DSK_F16 ? CUDA_R_16F : CUDA_R_32F;
}

/* One row-major operand of a batched GEMM: `rows` x `cols` as stored, leading stride `ld`,
   batch stride `bs` (0: shared by every batch). */
struct dsk__mat {
    const void *p;
    cudaDataType dt;
    int64_t rows, cols, ld, bs;
};

/* Sets C[b] = beta * C[b] (beta == 0 writes zeros, NaN included) for a product with K == 0. */
__global__ void dsk__k_scale_mat(void *c, dsk_dtype dt, int64_t rows, int64_t cols, int64_t ld, int64_t bs, int64_t n,
                                 float beta) {
    DSK__CUDA_FOR(i, n) {
        int64_t b = i / (rows * cols), r = (i / cols) % rows, j = i % cols, o = b * bs + r * ld + j;
        dsk_store_f32(c, dt, o, beta == 0.0f ? 0.0f : __fmul_rn(beta, dsk_load_f32(c, dt, o)));
    }
}

/* Row-major C[b] (M,N) = alpha op(A[b]) op(B[b]) + beta C[b] for b < batch, f32 accumulation.
   cuBLAS is column-major, where a row-major X is X^T: so it computes C^T = op(B)^T op(A)^T,
   i.e. B is its first operand and A its second, with the transposes unchanged. */
static dsk_status dsk__gemm(dsk_ctx *ctx, const char *fn, int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha,
                            dsk__mat A, dsk__mat B, float beta, void *C, dsk_dtype cdt, int64_t ldc, int64_t sc,
                            int64_t batch) {
    cublasStatus_t st;
    char detail[192];
    if (M == 0 || N == 0 || batch == 0) return DSK_OK;
    snprintf(detail, sizeof detail, "M %lld N %lld K %lld batch %lld, lda %lld ldb %lld ldc %lld", (long long)M,
             (long long)N, (long long)K, (long long)batch, (long long)A.ld, (long long)B.ld, (long long)ldc);
    if (K == 0) {
        int64_t n = M * N * batch;
        DSK__CUDA_LAUNCH(fn, dsk__k_scale_mat, dsk__cuda_grid(n), DSK__CUDA_THREADS, dsk__cuda_stream(ctx), n, C, cdt,
                         M, N, ldc, sc, n, beta);
        return DSK_OK;
    }
    /* A single-row matrix may carry any leading stride; cuBLAS wants ld >= its row length. */
    if (A.rows == 1 && A.ld < A.cols) A.ld = A.cols;
    if (B.rows == 1 && B.ld < B.cols) B.ld = B.cols;
    if (M == 1 && ldc < N) ldc = N;
    if (A.ld < A.cols || B.ld < B.cols || ldc < N)
        return dsk_set_error(DSK_ERR_ARG, "%s: overlapping rows (leading stride below the row length): %s", fn, detail);
    if (M > INT_MAX || N > INT_MAX || K > INT_MAX || batch > INT_MAX || A.ld > INT_MAX || B.ld > INT_MAX ||
        ldc > INT_MAX)
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: sizes beyond cuBLAS's int range: %s", fn, detail);
    st = dsk__cublas.gemm_strided_batched_ex(
        (cublasHandle_t)ctx->cublas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, (int)N, (int)M,
        (int)K, &alpha, B.p, B.dt, (int)B.ld, (long long)B.bs, A.p, A.dt, (int)A.ld, (long long)A.bs, &beta, C,
        dsk__cuda_dtype(cdt), (int)ldc, (long long)sc, (int)batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) return dsk__cuda_cublas_fail(fn, "cublasGemmStridedBatchedEx", st, detail);
    return DSK_OK;
}

/* The last two dims of a 2-D or 3-D tensor as a GEMM operand. */
static dsk__mat dsk__mat_of(const dsk_tensor *t) {
    dsk__mat m;
    int nd = t->ndim;
    m.p = t->data;
    m.dt = dsk__cuda_dtype(t->dtype);
    m.rows = t->shape[nd - 2];
    m.cols = t->shape[nd - 1];
    m.ld = t->stride[nd - 2];
    m.bs = nd == 3 ? t->stride[0] : 0;
    return m;
}

extern "C" dsk_status dsk_cuda_matmul(dsk_ctx *ctx, dsk_tensor *C, const dsk_tensor *A, int trans_a,
                                      const dsk_tensor *B, int trans_b, float alpha, float beta) {
    static const char *fn = "dsk_matmul";
    dsk__mat a, b;
    int64_t M, N, K, batch;
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    a = dsk__mat_of(A);
    b = dsk__mat_of(B);
    M = trans_a ? a.cols : a.rows;
    K = trans_a ? a.rows : a.cols;
    N = trans_b ? b.rows : b.cols;
    batch = C->ndim == 3 ? C->shape[0] : A->ndim == 3 ? A->shape[0] : B->ndim == 3 ? B->shape[0] : 1;
    return dsk__gemm(ctx, fn, trans_a, trans_b, M, N, K, alpha, a, b, beta, C->data, C->dtype, C->stride[C->ndim - 2],
                     C->ndim == 3 ? C->stride[0] : 0, batch);
}

/* ======================================================================= elementwise */

/* Every elementwise op of dsk_tensor.h's DSK_EW_OPS through its one math, dsk_ew_f. */
__global__ void dsk__k_ew(void *out, dsk_dtype dto, const void *x, dsk_dtype dtx, const void *y, dsk_dtype dty,
                          int64_t n, dsk_ew_op op, float alpha) {
    DSK__CUDA_FOR(i, n) {
        float b = y ? dsk_load_f32(y, dty, i) : 0.0f;
        dsk_store_f32(out, dto, i, dsk_ew_f(op, dsk_load_f32(x, dtx, i), b, alpha));
    }
}

extern "C" dsk_status dsk_cuda_elementwise(dsk_ctx *ctx, dsk_ew_op op, dsk_tensor *out, const dsk_tensor *x,
                                           const dsk_tensor *y, float alpha) {
    static const char *names[DSK_EW_COUNT] = {DSK_EW_OPS(DSK__EW_NAME)};
    const char *fn = op >= 0 && op < DSK_EW_COUNT ? names[op] : "dsk_cuda_elementwise";
    int64_t n = dsk_tensor_numel(out);
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (op < 0 || op >= DSK_EW_COUNT) return dsk_set_error(DSK_ERR_ARG, "%s: op %d is not a dsk_ew_op", fn, (int)op);
    if (n == 0) return DSK_OK;
    DSK__CUDA_LAUNCH(fn, dsk__k_ew, dsk__cuda_grid(n), DSK__CUDA_THREADS, dsk__cuda_stream(ctx), n, out->data,
                     out->dtype, x->data, x->dtype, y ? y->data : NULL, y ? y->dtype : x->dtype, n, op, alpha);
    return DSK_OK;
}

__global__ void dsk__k_silu(void *y, dsk_dtype dty, const void *x, dsk_dtype dtx, int64_t n) {
    DSK__CUDA_FOR(i, n) dsk_store_f32(y, dty, i, dsk_silu_f(dsk_load_f32(x, dtx, i)));
}
__global__ void dsk__k_silu_bwd(void *dx, dsk_dtype dtdx, const void *dy, dsk_dtype dtdy, const void *x, dsk_dtype dtx,
                                int64_t n) {
    DSK__CUDA_FOR(i, n) {
        float g = dsk_load_f32(dy, dtdy, i) * dsk_silu_grad_f(dsk_load_f32(x, dtx, i));
        dsk_store_f32(dx, dtdx, i, dsk_load_f32(dx, dtdx, i) + g);
    }
}
__global__ void dsk__k_swiglu(void *out, dsk_dtype dto, const void *gate, dsk_dtype dtg, const void *up, dsk_dtype dtu,
                              int64_t n) {
    DSK__CUDA_FOR(i, n) dsk_store_f32(out, dto, i, dsk_swiglu_f(dsk_load_f32(gate, dtg, i), dsk_load_f32(up, dtu, i)));
}
__global__ void dsk__k_swiglu_bwd(void *dgate, dsk_dtype dtdg, void *dup, dsk_dtype dtdu, const void *dout,
                                  dsk_dtype dtdo, const void *gate, dsk_dtype dtg, const void *up, dsk_dtype dtu,
                                  int64_t n, int add) {
    DSK__CUDA_FOR(i, n) {
        float dg, du;
        dsk_swiglu_grad_f(dsk_load_f32(gate, dtg, i), dsk_load_f32(up, dtu, i), dsk_load_f32(dout, dtdo, i), &dg, &du);
        if (dgate) dsk_store_f32(dgate, dtdg, i, add ? dsk_load_f32(dgate, dtdg, i) + dg : dg);
        if (dup) dsk_store_f32(dup, dtdu, i, add ? dsk_load_f32(dup, dtdu, i) + du : du);
    }
}

extern "C" dsk_status dsk_cuda_silu(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x) {
    static const char *fn = "dsk_silu";
    int64_t n = dsk_tensor_numel(x);
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (n == 0) return DSK_OK;
    DSK__CUDA_LAUNCH(fn, dsk__k_silu, dsk__cuda_grid(n), DSK__CUDA_THREADS, dsk__cuda_stream(ctx), n, y->data, y->dtype,
                     x->data, x->dtype, n);
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_silu_backward(dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *dy, const dsk_tensor *x) {
    static const char *fn = "dsk_silu_backward";
    int64_t n = dsk_tensor_numel(x);
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (n == 0) return DSK_OK;
    DSK__CUDA_LAUNCH(fn, dsk__k_silu_bwd, dsk__cuda_grid(n), DSK__CUDA_THREADS, dsk__cuda_stream(ctx), n, dx->data,
                     dx->dtype, dy->data, dy->dtype, x->data, x->dtype, n);
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_swiglu(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *gate, const dsk_tensor *up) {
    static const char *fn = "dsk_swiglu";
    int64_t n = dsk_tensor_numel(gate);
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (n == 0) return DSK_OK;
    DSK__CUDA_LAUNCH(fn, dsk__k_swiglu, dsk__cuda_grid(n), DSK__CUDA_THREADS, dsk__cuda_stream(ctx), n, out->data,
                     out->dtype, gate->data, gate->dtype, up->data, up->dtype, n);
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_swiglu_backward(dsk_ctx *ctx, dsk_tensor *dgate, dsk_tensor *dup, const dsk_tensor *dout,
                                               const dsk_tensor *gate, const dsk_tensor *up, int add) {
    static const char *fn = "dsk_swiglu_backward";
    int64_t n = dsk_tensor_numel(gate);
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (n == 0 || (!dgate && !dup)) return DSK_OK;
    DSK__CUDA_LAUNCH(fn, dsk__k_swiglu_bwd, dsk__cuda_grid(n), DSK__CUDA_THREADS, dsk__cuda_stream(ctx), n,
                     dgate ? dgate->data : NULL, dgate ? dgate->dtype : DSK_F32, dup ? dup->data : NULL,
                     dup ? dup->dtype : DSK_F32, dout->data, dout->dtype, gate->data, gate->dtype, up->data, up->dtype,
                     n, add);
    return DSK_OK;
}

/* ======================================================================= block reductions */

struct dsk__op_sum {
    template <typename T> __device__ T operator()(T a, T b) const { return a + b; }
};
/* Max that propagates NaN. */
struct dsk__op_max {
    __device__ float operator()(float a, float b) const { return (a != a || a > b) ? a : b; }
};

/* Reduces one value per thread over the block in a fixed tree (warp butterflies, then warp 0
   over the warp results) and returns the result to every thread. `sh` holds 32 T. A block of
   one warp (rows of up to 32 columns) is done after the butterfly, which leaves the result in
   every lane: its __syncwarp orders the caller's shared memory as the barriers would. */
template <typename T, typename Op> __device__ T dsk__block_reduce(T v, Op op, T identity, T *sh) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (nwarps == 1) {
        __syncwarp();
        return v;
    }
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < nwarps ? sh[lane] : identity;
        for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
        if (lane == 0) sh[0] = v;
    }
    __syncthreads();
    v = sh[0];
    __syncthreads(); /* sh may be reused right away */
    return v;
}

/* ======================================================================= reduce, sum of squares */

/* in viewed as (outer, n, inner); out (outer, inner). Rows (inner == 1): a block per row. */
__global__ void dsk__k_reduce_rows(void *out, dsk_dtype dto, const void *in, dsk_dtype dti, int64_t n,
                                   dsk_reduce_op op) {
    __shared__ double shd[32];
    __shared__ float shf[32];
    int64_t row = blockIdx.x;
    const int64_t base = row * n;
    if (op == DSK_REDUCE_MAX) {
        float m = -INFINITY;
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) m = dsk__op_max()(m, dsk_load_f32(in, dti, base + j));
        m = dsk__block_reduce(m, dsk__op_max(), -INFINITY, shf);
        if (threadIdx.x == 0) dsk_store_f32(out, dto, row, m);
        return;
    }
    double s = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) s += dsk_load_f32(in, dti, base + j);
    s = dsk__block_reduce(s, dsk__op_sum(), 0.0, shd);
    if (threadIdx.x == 0) dsk_store_f32(out, dto, row, (float)(op == DSK_REDUCE_MEAN ? s / (double)n : s));
}

/* inner > 1: a thread per output, summing along n in order (coalesced across inner). */
__global__ void dsk__k_reduce_cols(void *out, dsk_dtype dto, const void *in, dsk_dtype dti, int64_t outer, int64_t n,
                                   int64_t inner, dsk_reduce_op op) {
    DSK__CUDA_FOR(i, outer * inner) {
        int64_t o = i / inner, j = i - o * inner, base = o * n * inner + j;
        if (op == DSK_REDUCE_MAX) {
            float m = -INFINITY;
            for (int64_t k = 0; k < n; k++) m = dsk__op_max()(m, dsk_load_f32(in, dti, base + k * inner));
            dsk_store_f32(out, dto, i, m);
        } else {
            double s = 0;
            for (int64_t k = 0; k < n; k++) s += dsk_load_f32(in, dti, base + k * inner);
            dsk_store_f32(out, dto, i, (float)(op == DSK_REDUCE_MEAN ? s / (double)n : s));
        }
    }
}

extern "C" dsk_status dsk_cuda_reduce(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *in, int axis, dsk_reduce_op op) {
    static const char *fn = "dsk_reduce";
    int64_t outer = 1, n, inner = 1, nout;
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (axis < 0) axis += in->ndim;
    if (in->ndim == 0) axis = 0; /* a scalar reduces to itself */
    n = in->ndim ? in->shape[axis] : 1;
    for (int d = 0; d < axis; d++) outer *= in->shape[d];
    for (int d = axis + 1; d < in->ndim; d++) inner *= in->shape[d];
    nout = outer * inner;
    if (nout == 0) return DSK_OK;
    if (inner == 1 && n > 1) {
        DSK__TRY(dsk__cuda_check_rows(fn, outer));
        unsigned th = dsk__cuda_row_threads(n);
        DSK__CUDA_LAUNCH(fn, dsk__k_reduce_rows, (unsigned)outer, th, dsk__cuda_stream(ctx), outer * n, out->data,
                         out->dtype, in->data, in->dtype, n, op);
        return DSK_OK;
    }
    DSK__CUDA_LAUNCH(fn, dsk__k_reduce_cols, dsk__cuda_grid(nout), DSK__CUDA_THREADS, dsk__cuda_stream(ctx), nout * n,
                     out->data, out->dtype, in->data, in->dtype, outer, n, inner, op);
    return DSK_OK;
}

/* Sum of squares: pass 1 gives one f32 partial per block over a fixed partition (the block
   count depends on n only), pass 2 adds the partials in order in one block. */
#define DSK__SS_BLOCKS_MAX 1024
__global__ void dsk__k_sumsq_partial(float *part, const void *in, dsk_dtype dt, int64_t n) {
    __shared__ float sh[32];
    float s = 0;
    DSK__CUDA_FOR(i, n) {
        float x = dsk_load_f32(in, dt, i);
        s = __fmaf_rn(x, x, s);
    }
    s = dsk__block_reduce(s, dsk__op_sum(), 0.0f, sh);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}
__global__ void dsk__k_sumsq_final(float *out, const float *part, int nparts) {
    __shared__ float sh[32];
    float s = 0;
    for (int i = threadIdx.x; i < nparts; i += blockDim.x) s += part[i];
    s = dsk__block_reduce(s, dsk__op_sum(), 0.0f, sh);
    if (threadIdx.x == 0) *out = s;
}

extern "C" dsk_status dsk_cuda_sum_squares(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *in) {
    static const char *fn = "dsk_sum_squares";
    int64_t n = dsk_tensor_numel(in);
    int64_t nb = (n + DSK__CUDA_THREADS * 16 - 1) / (DSK__CUDA_THREADS * 16);
    float *part = NULL;
    dsk_status s;
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (nb < 1) nb = 1;
    if (nb > DSK__SS_BLOCKS_MAX) nb = DSK__SS_BLOCKS_MAX;
    DSK__TRY(dsk__scratch(ctx, (size_t)nb * sizeof(float), (void **)&part));
    DSK__CUDA_KERNEL(dsk__k_sumsq_partial, (unsigned)nb, DSK__CUDA_THREADS, 0, dsk__cuda_stream(ctx), part, in->data,
                     in->dtype, n);
    s = dsk__cuda_launched(fn, "dsk__k_sumsq_partial", dim3((unsigned)nb), dim3(DSK__CUDA_THREADS), n);
    if (s == DSK_OK) {
        DSK__CUDA_KERNEL(dsk__k_sumsq_final, 1, DSK__CUDA_THREADS, 0, dsk__cuda_stream(ctx), (float *)out->data, part,
                         (int)nb);
        s = dsk__cuda_launched(fn, "dsk__k_sumsq_final", dim3(1), dim3(DSK__CUDA_THREADS), nb);
    }
    dsk__scratch_free(ctx, part);
    return s;
}

/* ======================================================================= softmax */

__global__ void dsk__k_softmax(void *y, dsk_dtype dty, const void *x, dsk_dtype dtx, int64_t C) {
    __shared__ float sh[32];
    const int64_t base = (int64_t)blockIdx.x * C;
    float m = -INFINITY, s = 0;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) m = dsk__op_max()(m, dsk_load_f32(x, dtx, base + j));
    m = dsk__block_reduce(m, dsk__op_max(), -INFINITY, sh);
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) s += expf(dsk_load_f32(x, dtx, base + j) - m);
    s = dsk__block_reduce(s, dsk__op_sum(), 0.0f, sh);
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x)
        dsk_store_f32(y, dty, base + j, expf(dsk_load_f32(x, dtx, base + j) - m) / s);
}

__global__ void dsk__k_softmax_bwd(void *dx, dsk_dtype dtdx, const void *y, dsk_dtype dty, const void *dy,
                                   dsk_dtype dtdy, int64_t C) {
    __shared__ float sh[32];
    const int64_t base = (int64_t)blockIdx.x * C;
    float dot = 0;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x)
        dot += dsk_load_f32(dy, dtdy, base + j) * dsk_load_f32(y, dty, base + j);
    dot = dsk__block_reduce(dot, dsk__op_sum(), 0.0f, sh);
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
        float g = dsk_load_f32(y, dty, base + j) * (dsk_load_f32(dy, dtdy, base + j) - dot);
        dsk_store_f32(dx, dtdx, base + j, dsk_load_f32(dx, dtdx, base + j) + g);
    }
}

/* Rows and row length of a (..., C) tensor. */
static void dsk__rows_of(const dsk_tensor *t, int64_t *rows, int64_t *cols) {
    *cols = t->ndim ? t->shape[t->ndim - 1] : 1;
    *rows = *cols ? dsk_tensor_numel(t) / *cols : 0;
}

extern "C" dsk_status dsk_cuda_softmax(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x) {
    static const char *fn = "dsk_softmax";
    int64_t R, C;
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    dsk__rows_of(x, &R, &C);
    if (R == 0) return DSK_OK;
    DSK__TRY(dsk__cuda_check_rows(fn, R));
    DSK__CUDA_LAUNCH(fn, dsk__k_softmax, (unsigned)R, dsk__cuda_row_threads(C), dsk__cuda_stream(ctx), R * C, y->data,
                     y->dtype, x->data, x->dtype, C);
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_softmax_backward(dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *y,
                                                const dsk_tensor *dy) {
    static const char *fn = "dsk_softmax_backward";
    int64_t R, C;
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    dsk__rows_of(y, &R, &C);
    if (R == 0) return DSK_OK;
    DSK__TRY(dsk__cuda_check_rows(fn, R));
    DSK__CUDA_LAUNCH(fn, dsk__k_softmax_bwd, (unsigned)R, dsk__cuda_row_threads(C), dsk__cuda_stream(ctx), R * C,
                     dx->data, dx->dtype, y->data, y->dtype, dy->data, dy->dtype, C);
    return DSK_OK;
}

/* ======================================================================= RMSNorm */

__global__ void dsk__k_rmsnorm(void *y, dsk_dtype dty, float *rstd, const void *x, dsk_dtype dtx, const void *w,
                               dsk_dtype dtw, int64_t D, float eps) {
    __shared__ float sh[32];
    const int64_t row = blockIdx.x, base = row * D;
    float ss = 0, r;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
        float v = dsk_load_f32(x, dtx, base + j);
        ss += v * v;
    }
    ss = dsk__block_reduce(ss, dsk__op_sum(), 0.0f, sh);
    r = 1.0f / sqrtf(ss / (float)D + eps);
    if (rstd && threadIdx.x == 0) rstd[row] = r;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x)
        dsk_store_f32(y, dty, base + j, dsk_load_f32(x, dtx, base + j) * r * dsk_load_f32(w, dtw, j));
}

/* dx += r w dy - x r^3 / D * sum_j(dy_j w_j x_j). */
__global__ void dsk__k_rmsnorm_bwd_dx(void *dx, dsk_dtype dtdx, const void *dy, dsk_dtype dtdy, const void *x,
                                      dsk_dtype dtx, const void *w, dsk_dtype dtw, const float *rstd, int64_t D) {
    __shared__ float sh[32];
    const int64_t row = blockIdx.x, base = row * D;
    const float r = rstd[row];
    float dot = 0, c;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x)
        dot += dsk_load_f32(dy, dtdy, base + j) * dsk_load_f32(w, dtw, j) * dsk_load_f32(x, dtx, base + j);
    dot = dsk__block_reduce(dot, dsk__op_sum(), 0.0f, sh);
    c = r * r * r * dot / (float)D;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
        float g = r * dsk_load_f32(w, dtw, j) * dsk_load_f32(dy, dtdy, base + j) - c * dsk_load_f32(x, dtx, base + j);
        dsk_store_f32(dx, dtdx, base + j, dsk_load_f32(dx, dtdx, base + j) + g);
    }
}

/* Column sums over rows without atomics: block (32, 8) owns 32 columns and one chunk of
   rows; part[chunk][col] = sum over the chunk in a fixed order. */
#define DSK__COL_TX 32
#define DSK__COL_TY 8
__global__ void dsk__k_rmsnorm_dw_partial(float *part, const void *dy, dsk_dtype dtdy, const void *x, dsk_dtype dtx,
                                          const float *rstd, int64_t R, int64_t D, int64_t rows_per_chunk) {
    __shared__ float sh[DSK__COL_TY][DSK__COL_TX];
    const int64_t col = (int64_t)blockIdx.x * DSK__COL_TX + threadIdx.x, chunk = blockIdx.y;
    const int64_t r0 = chunk * rows_per_chunk, r1 = r0 + rows_per_chunk < R ? r0 + rows_per_chunk : R;
    float s = 0;
    if (col < D)
        for (int64_t r = r0 + threadIdx.y; r < r1; r += DSK__COL_TY)
            s += dsk_load_f32(dy, dtdy, r * D + col) * dsk_load_f32(x, dtx, r * D + col) * rstd[r];
    sh[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < D) {
        for (int k = 1; k < DSK__COL_TY; k++) s += sh[k][threadIdx.x];
        part[chunk * D + col] = s;
    }
}
__global__ void dsk__k_col_finish(void *dw, dsk_dtype dtdw, const float *part, int64_t chunks, int64_t D) {
    DSK__CUDA_FOR(col, D) {
        float s = 0;
        for (int64_t c = 0; c < chunks; c++) s += part[c * D + col];
        dsk_store_f32(dw, dtdw, col, dsk_load_f32(dw, dtdw, col) + s);
    }
}

static dsk_status dsk__rmsnorm_dw(dsk_ctx *ctx, const char *fn, dsk_tensor *dw, const dsk_tensor *dy,
                                  const dsk_tensor *x, const float *rstd, int64_t R, int64_t D) {
    int64_t chunks = (R + 63) / 64, per;
    float *part = NULL;
    dsk_status s;
    dim3 grid, block(DSK__COL_TX, DSK__COL_TY);
    if (chunks > 256) chunks = 256;
    if (chunks < 1) chunks = 1;
    per = (R + chunks - 1) / chunks;
    grid = dim3((unsigned)((D + DSK__COL_TX - 1) / DSK__COL_TX), (unsigned)chunks);
    DSK__TRY(dsk__scratch(ctx, (size_t)(chunks * D) * sizeof(float), (void **)&part));
    DSK__CUDA_KERNEL(dsk__k_rmsnorm_dw_partial, grid, block, 0, dsk__cuda_stream(ctx), part, dy->data, dy->dtype,
                     x->data, x->dtype, rstd, R, D, per);
    s = dsk__cuda_launched(fn, "dsk__k_rmsnorm_dw_partial", grid, block, R * D);
    if (s == DSK_OK) {
        DSK__CUDA_KERNEL(dsk__k_col_finish, dsk__cuda_grid(D), DSK__CUDA_THREADS, 0, dsk__cuda_stream(ctx), dw->data,
                         dw->dtype, part, chunks, D);
        s = dsk__cuda_launched(fn, "dsk__k_col_finish", dim3(dsk__cuda_grid(D)), dim3(DSK__CUDA_THREADS), D);
    }
    dsk__scratch_free(ctx, part);
    return s;
}

extern "C" dsk_status dsk_cuda_rmsnorm(dsk_ctx *ctx, dsk_tensor *y, dsk_tensor *rstd, const dsk_tensor *x,
                                       const dsk_tensor *w, float eps) {
    static const char *fn = "dsk_rmsnorm";
    int64_t R, D;
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    dsk__rows_of(x, &R, &D);
    if (R == 0) return DSK_OK;
    DSK__TRY(dsk__cuda_check_rows(fn, R));
    DSK__CUDA_LAUNCH(fn, dsk__k_rmsnorm, (unsigned)R, dsk__cuda_row_threads(D), dsk__cuda_stream(ctx), R * D, y->data,
                     y->dtype, rstd ? (float *)rstd->data : (float *)NULL, x->data, x->dtype, w->data, w->dtype, D,
                     eps);
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_rmsnorm_backward(dsk_ctx *ctx, dsk_tensor *dx, dsk_tensor *dw, const dsk_tensor *dy,
                                                const dsk_tensor *x, const dsk_tensor *w, const dsk_tensor *rstd) {
    static const char *fn = "dsk_rmsnorm_backward";
    int64_t R, D;
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    dsk__rows_of(x, &R, &D);
    if (R == 0 || D == 0) return DSK_OK;
    DSK__TRY(dsk__cuda_check_rows(fn, R));
    if (dx)
        DSK__CUDA_LAUNCH(fn, dsk__k_rmsnorm_bwd_dx, (unsigned)R, dsk__cuda_row_threads(D), dsk__cuda_stream(ctx), R * D,
                         dx->data, dx->dtype, dy->data, dy->dtype, x->data, x->dtype, w->data, w->dtype,
                         (const float *)rstd->data, D);
    if (dw) return dsk__rmsnorm_dw(ctx, fn, dw, dy, x, (const float *)rstd->data, R, D);
    return DSK_OK;
}

/* ======================================================================= rows by index */

/* out[i] = src[idx[i]] for i < N (a block per row); an index outside [0, R) gives a NaN row. */
__global__ void dsk__k_gather(void *out, dsk_dtype dto, const void *src, dsk_dtype dts, const int32_t *idx, int64_t R,
                              int64_t D) {
    const int64_t i = blockIdx.x, r = idx[i];
    const int ok = r >= 0 && r < R;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x)
        dsk_store_f32(out, dto, i * D + j, ok ? dsk_load_f32(src, dts, r * D + j) : NAN);
}

static dsk_status dsk__gather(dsk_ctx *ctx, const char *fn, dsk_tensor *out, const dsk_tensor *src,
                              const dsk_tensor *idx) {
    int64_t N = dsk_tensor_numel(idx), R = src->shape[0], D = R ? dsk_tensor_numel(src) / R : 0;
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (N == 0 || D == 0) return DSK_OK;
    DSK__TRY(dsk__cuda_check_rows(fn, N));
    DSK__CUDA_LAUNCH(fn, dsk__k_gather, (unsigned)N, dsk__cuda_row_threads(D), dsk__cuda_stream(ctx), N * D, out->data,
                     out->dtype, src->data, src->dtype, (const int32_t *)idx->data, R, D);
    return DSK_OK;
}

/* Scatter-add without atomics: a stable radix sort of (row, i) pairs groups the sources of
   each destination row in increasing i; the first position of each group adds them in that
   order onto the row, rounding to dst's dtype after each addition as the CPU path does. */
__global__ void dsk__k_scatter_keys(int32_t *keys, int32_t *vals, const int32_t *idx, int64_t N, int32_t R) {
    DSK__CUDA_FOR(i, N) {
        int32_t r = idx[i];
        keys[i] = (r >= 0 && r < R) ? r : R; /* out-of-range rows sort last and are skipped */
        vals[i] = (int32_t)i;
    }
}
__global__ void dsk__k_scatter_segments(void *dst, dsk_dtype dtd, const void *src, dsk_dtype dts, const int32_t *keys,
                                        const int32_t *order, int64_t N, int32_t R, int64_t D) {
    const int64_t p = blockIdx.x;
    const int32_t r = keys[p];
    if (r == R || (p > 0 && keys[p - 1] == r)) return; /* invalid row, or not the first of its group */
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
        float acc = dsk_load_f32(dst, dtd, (int64_t)r * D + j);
        for (int64_t q = p; q < N && keys[q] == r; q++)
            acc = dsk_round_f32(dtd, acc + dsk_load_f32(src, dts, (int64_t)order[q] * D + j));
        dsk_store_f32(dst, dtd, (int64_t)r * D + j, acc);
    }
}

static size_t dsk__align256(size_t n) { return (n + 255) & ~(size_t)255; }

static dsk_status dsk__scatter_add(dsk_ctx *ctx, const char *fn, dsk_tensor *dst, const dsk_tensor *src,
                                   const dsk_tensor *idx) {
    int64_t N = dsk_tensor_numel(idx), R = dst->shape[0], D = R ? dsk_tensor_numel(dst) / R : 0;
    size_t sort_bytes = 0, ib;
    int bits = 1;
    char *buf = NULL;
    int32_t *keys, *vals, *keys_sorted, *vals_sorted;
    cudaError_t e;
    dsk_status s = DSK_OK;
    char detail[96];
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (N == 0 || D == 0) return DSK_OK;
    if (N > INT_MAX || R >= INT_MAX)
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: %lld indices into %lld rows exceed the int32 sort range", fn,
                             (long long)N, (long long)R);
    while (bits < 31 && (1ll << bits) <= R) bits++; /* keys take values 0..R */
    snprintf(detail, sizeof detail, "%lld keys of %d bits", (long long)N, bits);
    e = cub::DeviceRadixSort::SortPairs(NULL, sort_bytes, (const int32_t *)NULL, (int32_t *)NULL, (const int32_t *)NULL,
                                        (int32_t *)NULL, (int)N, 0, bits, dsk__cuda_stream(ctx));
    if (e != cudaSuccess) return dsk__cuda_fail(fn, "cub::DeviceRadixSort::SortPairs (size query)", e, detail);
    ib = dsk__align256((size_t)N * sizeof(int32_t));
    DSK__TRY(dsk__scratch(ctx, 4 * ib + sort_bytes, (void **)&buf));
    keys = (int32_t *)buf;
    vals = (int32_t *)(buf + ib);
    keys_sorted = (int32_t *)(buf + 2 * ib);
    vals_sorted = (int32_t *)(buf + 3 * ib);
    DSK__CUDA_KERNEL(dsk__k_scatter_keys, dsk__cuda_grid(N), DSK__CUDA_THREADS, 0, dsk__cuda_stream(ctx), keys, vals,
                     (const int32_t *)idx->data, N, (int32_t)R);
    s = dsk__cuda_launched(fn, "dsk__k_scatter_keys", dim3(dsk__cuda_grid(N)), dim3(DSK__CUDA_THREADS), N);
    if (s == DSK_OK) {
        e = cub::DeviceRadixSort::SortPairs(buf + 4 * ib, sort_bytes, keys, keys_sorted, vals, vals_sorted, (int)N, 0,
                                            bits, dsk__cuda_stream(ctx));
        if (e != cudaSuccess) s = dsk__cuda_fail(fn, "cub::DeviceRadixSort::SortPairs", e, detail);
    }
    if (s == DSK_OK) {
        unsigned th = dsk__cuda_row_threads(D);
        DSK__CUDA_KERNEL(dsk__k_scatter_segments, (unsigned)N, th, 0, dsk__cuda_stream(ctx), dst->data, dst->dtype,
                         src->data, src->dtype, keys_sorted, vals_sorted, N, (int32_t)R, D);
        s = dsk__cuda_launched(fn, "dsk__k_scatter_segments", dim3((unsigned)N), dim3(th), N * D);
    }
    dsk__scratch_free(ctx, buf);
    return s;
}

extern "C" dsk_status dsk_cuda_embedding(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *table,
                                         const dsk_tensor *ids) {
    return dsk__gather(ctx, "dsk_embedding", out, table, ids);
}
extern "C" dsk_status dsk_cuda_embedding_backward(dsk_ctx *ctx, dsk_tensor *dtable, const dsk_tensor *dout,
                                                  const dsk_tensor *ids) {
    return dsk__scatter_add(ctx, "dsk_embedding_backward", dtable, dout, ids);
}
extern "C" dsk_status dsk_cuda_gather_rows(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *src,
                                           const dsk_tensor *idx) {
    return dsk__gather(ctx, "dsk_gather_rows", out, src, idx);
}
extern "C" dsk_status dsk_cuda_scatter_add_rows(dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src,
                                                const dsk_tensor *idx) {
    return dsk__scatter_add(ctx, "dsk_scatter_add_rows", dst, src, idx);
}

/* ======================================================================= cross-entropy */

/* Number of counted tokens (target != ignore), an exact integer sum. */
__global__ void dsk__k_ce_count(int64_t *count, const int32_t *targets, int64_t T, int32_t ignore) {
    __shared__ double sh[32];
    double c = 0;
    for (int64_t t = threadIdx.x; t < T; t += blockDim.x) c += targets[t] != ignore;
    c = dsk__block_reduce(c, dsk__op_sum(), 0.0, sh);
    if (threadIdx.x == 0) *count = (int64_t)c;
}

/* A block per token: rowloss[t] = logsumexp(x) - x[target] (0 if ignored, NaN if the target
   is out of range); dlogits row = scale (softmax - onehot) / count, or zeros if ignored. */
__global__ void dsk__k_ce_rows(float *rowloss, void *dl, dsk_dtype dtdl, const void *x, dsk_dtype dtx,
                               const int32_t *targets, const int64_t *count, int64_t V, int32_t ignore,
                               float grad_scale) {
    __shared__ float sh[32];
    const int64_t t = blockIdx.x, base = t * V;
    const int32_t y = targets[t];
    const int ignored = y == ignore, ok = y >= 0 && y < V;
    float m = -INFINITY, s = 0, coef;
    if (ignored) {
        if (dl)
            for (int64_t j = threadIdx.x; j < V; j += blockDim.x) dsk_store_f32(dl, dtdl, base + j, 0.0f);
        if (threadIdx.x == 0) rowloss[t] = 0.0f;
        return;
    }
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) m = dsk__op_max()(m, dsk_load_f32(x, dtx, base + j));
    m = dsk__block_reduce(m, dsk__op_max(), -INFINITY, sh);
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) s += expf(dsk_load_f32(x, dtx, base + j) - m);
    s = dsk__block_reduce(s, dsk__op_sum(), 0.0f, sh);
    if (threadIdx.x == 0) rowloss[t] = ok ? m + logf(s) - dsk_load_f32(x, dtx, base + y) : NAN;
    if (!dl) return;
    coef = ok ? grad_scale / (float)*count : NAN;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
        float p = expf(dsk_load_f32(x, dtx, base + j) - m) / s;
        dsk_store_f32(dl, dtdl, base + j, (p - (j == y ? 1.0f : 0.0f)) * coef);
    }
}

/* loss = sum(rowloss) / count in f64, in a fixed order; 0 when no token counts. */
__global__ void dsk__k_ce_loss(float *loss, const float *rowloss, const int64_t *count, int64_t T) {
    __shared__ double sh[32];
    double s = 0;
    for (int64_t t = threadIdx.x; t < T; t += blockDim.x) s += rowloss[t];
    s = dsk__block_reduce(s, dsk__op_sum(), 0.0, sh);
    if (threadIdx.x == 0) *loss = *count ? (float)(s / (double)*count) : 0.0f;
}

extern "C" dsk_status dsk_cuda_cross_entropy(dsk_ctx *ctx, dsk_tensor *loss, dsk_tensor *dlogits,
                                             const dsk_tensor *logits, const dsk_tensor *targets, int32_t ignore_index,
                                             float grad_scale) {
    static const char *fn = "dsk_cross_entropy";
    int64_t T, V;
    char *buf = NULL;
    int64_t *count;
    float *rowloss;
    dsk_status s;
    cudaStream_t st;
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    st = dsk__cuda_stream(ctx);
    dsk__rows_of(logits, &T, &V);
    DSK__TRY(dsk__cuda_check_rows(fn, T));
    DSK__TRY(dsk__scratch(ctx, 256 + (size_t)T * sizeof(float), (void **)&buf));
    count = (int64_t *)buf;
    rowloss = (float *)(buf + 256);
    DSK__CUDA_KERNEL(dsk__k_ce_count, 1, DSK__CUDA_THREADS, 0, st, count, (const int32_t *)targets->data, T,
                     ignore_index);
    s = dsk__cuda_launched(fn, "dsk__k_ce_count", dim3(1), dim3(DSK__CUDA_THREADS), T);
    if (s == DSK_OK && T > 0) {
        unsigned th = dsk__cuda_row_threads(V);
        DSK__CUDA_KERNEL(dsk__k_ce_rows, (unsigned)T, th, 0, st, rowloss, dlogits ? dlogits->data : NULL,
                         dlogits ? dlogits->dtype : DSK_F32, logits->data, logits->dtype,
                         (const int32_t *)targets->data, count, V, ignore_index, grad_scale);
        s = dsk__cuda_launched(fn, "dsk__k_ce_rows", dim3((unsigned)T), dim3(th), T * V);
    }
    if (s == DSK_OK) {
        DSK__CUDA_KERNEL(dsk__k_ce_loss, 1, DSK__CUDA_THREADS, 0, st, (float *)loss->data, rowloss, count, T);
        s = dsk__cuda_launched(fn, "dsk__k_ce_loss", dim3(1), dim3(DSK__CUDA_THREADS), T);
    }
    dsk__scratch_free(ctx, buf);
    return s;
}

/* ======================================================================= top-k */

/* Order of candidates: numbers before NaN, larger first, ties (and NaNs) by lower index.
   idx < 0 is "no candidate", after everything. */
__device__ __forceinline__ bool dsk__topk_before(float av, int ai, float bv, int bi) {
    bool an = av != av, bn = bv != bv;
    if (ai < 0) return false;
    if (bi < 0) return true;
    if (an != bn) return bn;
    if (!an && av != bv) return av > bv;
    return ai < bi;
}

/* A block per row, k rounds; round r picks the first candidate (in the order above) after
   the pick of round r - 1, so every pick is distinct and the picks come out sorted. */
__global__ void dsk__k_topk(float *values, int32_t *indices, const float *x, int64_t C, int k) {
    __shared__ float shv[32];
    __shared__ int shi[32];
    __shared__ float prev_v;
    __shared__ int prev_i;
    const int64_t row = blockIdx.x;
    const float *xr = x + row * C;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    float pv = 0;
    int pi = -1;
    for (int r = 0; r < k; r++) {
        float bv = 0;
        int bi = -1;
        for (int j = threadIdx.x; j < C; j += blockDim.x) {
            float v = xr[j];
            if ((pi < 0 || dsk__topk_before(pv, pi, v, j)) && dsk__topk_before(v, j, bv, bi)) { bv = v; bi = j; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (dsk__topk_before(ov, oi, bv, bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) { shv[warp] = bv; shi[warp] = bi; }
        __syncthreads();
        if (warp == 0) {
            bv = lane < nwarps ? shv[lane] : 0.0f;
            bi = lane < nwarps ? shi[lane] : -1;
            for (int o = 16; o > 0; o >>= 1) {
                float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (dsk__topk_before(ov, oi, bv, bi)) { bv = ov; bi = oi; }
            }
            if (lane == 0) {
                prev_v = bv;
                prev_i = bi;
                values[row * k + r] = bv;
                indices[row * k + r] = bi;
            }
        }
        __syncthreads();
        pv = prev_v;
        pi = prev_i;
        __syncthreads(); /* prev_* is rewritten next round */
    }
}

extern "C" dsk_status dsk_cuda_topk(dsk_ctx *ctx, dsk_tensor *values, dsk_tensor *indices, const dsk_tensor *x, int k) {
    static const char *fn = "dsk_topk";
    int64_t R, C;
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    dsk__rows_of(x, &R, &C);
    if (R == 0 || k <= 0) return DSK_OK;
    DSK__TRY(dsk__cuda_check_rows(fn, R));
    if (C > INT_MAX)
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: rows of %lld columns exceed int32 indices", fn, (long long)C);
    DSK__CUDA_LAUNCH(fn, dsk__k_topk, (unsigned)R, dsk__cuda_row_threads(C), dsk__cuda_stream(ctx), R * C,
                     (float *)values->data, (int32_t *)indices->data, (const float *)x->data, C, k);
    return DSK_OK;
}

/* ======================================================================= RoPE */

/* A thread per pair (b, t, h, i) of x (B, T, H, Dh); backward rotates by the negative angle, and
   adds into y when add. */
__global__ void dsk__k_rope(void *y, dsk_dtype dty, const void *x, dsk_dtype dtx, int64_t T, int64_t H, int64_t Dh,
                            int64_t pos0, float theta, int64_t npairs, int backward, int add) {
    const int64_t half = Dh / 2;
    DSK__CUDA_FOR(e, npairs) {
        int64_t i = e % half, t = (e / (half * H)) % T, o = 2 * e;
        float a = dsk_rope_angle(pos0 + t, i, Dh, theta), c = cosf(a), s = sinf(a), y0, y1;
        float x0 = dsk_load_f32(x, dtx, o), x1 = dsk_load_f32(x, dtx, o + 1);
        dsk_rope_rotate(x0, x1, c, backward ? -s : s, &y0, &y1);
        if (add) {
            y0 += dsk_load_f32(y, dty, o);
            y1 += dsk_load_f32(y, dty, o + 1);
        }
        dsk_store_f32(y, dty, o, y0);
        dsk_store_f32(y, dty, o + 1, y1);
    }
}

static dsk_status dsk__rope(dsk_ctx *ctx, const char *fn, dsk_tensor *y, const dsk_tensor *x, int64_t pos0, float theta,
                            int backward, int add) {
    int64_t T = x->shape[1], H = x->shape[2], Dh = x->shape[3], npairs = dsk_tensor_numel(x) / 2;
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (npairs == 0) return DSK_OK;
    DSK__CUDA_LAUNCH(fn, dsk__k_rope, dsk__cuda_grid(npairs), DSK__CUDA_THREADS, dsk__cuda_stream(ctx), npairs, y->data,
                     y->dtype, x->data, x->dtype, T, H, Dh, pos0, theta, npairs, backward, add);
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_rope(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x, int64_t pos0, float theta) {
    return dsk__rope(ctx, "dsk_rope", y, x, pos0, theta, 0, 0);
}
extern "C" dsk_status dsk_cuda_rope_backward(dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *dy, int64_t pos0,
                                             float theta, int add) {
    return dsk__rope(ctx, "dsk_rope_backward", dx, dy, pos0, theta, 1, add);
}

/* ======================================================================= attention */

/* (B, T, H, Dh) of any op dtype <-> (B, H, T, Dh) f32 scratch; `accumulate` adds into dst. */
__global__ void dsk__k_to_bhtd(float *dst, const void *src, dsk_dtype dts, int64_t T, int64_t H, int64_t Dh,
                               int64_t n) {
    DSK__CUDA_FOR(e, n) {
        int64_t d = e % Dh, t = (e / Dh) % T, h = (e / (Dh * T)) % H, b = e / (Dh * T * H);
        dst[e] = dsk_load_f32(src, dts, ((b * T + t) * H + h) * Dh + d);
    }
}
__global__ void dsk__k_from_bhtd(void *dst, dsk_dtype dtd, const float *src, int64_t T, int64_t H, int64_t Dh,
                                 int64_t n, int accumulate) {
    DSK__CUDA_FOR(e, n) {
        int64_t d = e % Dh, t = (e / Dh) % T, h = (e / (Dh * T)) % H, b = e / (Dh * T * H);
        int64_t o = ((b * T + t) * H + h) * Dh + d;
        dsk_store_f32(dst, dtd, o, accumulate ? dsk_load_f32(dst, dtd, o) + src[e] : src[e]);
    }
}

/* In place on scores (rows of T, row i of each (b, h) block): causal softmax, zeros above
   the diagonal. */
__global__ void dsk__k_causal_softmax(float *p, int64_t T) {
    __shared__ float sh[32];
    const int64_t row = blockIdx.x, i = row % T;
    float *pr = p + row * T;
    float m = -INFINITY, s = 0;
    for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) m = dsk__op_max()(m, pr[j]);
    m = dsk__block_reduce(m, dsk__op_max(), -INFINITY, sh);
    for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) s += expf(pr[j] - m);
    s = dsk__block_reduce(s, dsk__op_sum(), 0.0f, sh);
    for (int64_t j = threadIdx.x; j < T; j += blockDim.x) pr[j] = j <= i ? expf(pr[j] - m) / s : 0.0f;
}

/* In place on dP: dS = P (dP - sum_j(dP_j P_j)) per row. */
__global__ void dsk__k_softmax_grad_inplace(float *dp, const float *p, int64_t T) {
    __shared__ float sh[32];
    const int64_t base = (int64_t)blockIdx.x * T;
    float dot = 0;
    for (int64_t j = threadIdx.x; j < T; j += blockDim.x) dot += dp[base + j] * p[base + j];
    dot = dsk__block_reduce(dot, dsk__op_sum(), 0.0f, sh);
    for (int64_t j = threadIdx.x; j < T; j += blockDim.x) dp[base + j] = p[base + j] * (dp[base + j] - dot);
}

/* Shapes of one attention call: BH (T, Dh) f32 matrices, and GEMM operand helpers. */
struct dsk__att {
    int64_t B, T, H, Dh, BH, n; /* n = B*H*T*Dh */
};
static dsk__mat dsk__att_mat(const float *p, int64_t rows, int64_t cols) {
    dsk__mat m;
    m.p = p;
    m.dt = CUDA_R_32F;
    m.rows = rows;
    m.cols = cols;
    m.ld = cols;
    m.bs = rows * cols;
    return m;
}
/* C[bh] = alpha op(A[bh]) op(B[bh]) + beta C[bh] over the BH matrices of an attention call. */
static dsk_status dsk__att_gemm(dsk_ctx *ctx, const char *fn, const dsk__att *g, int ta, int tb, int64_t M, int64_t N,
                                int64_t K, float alpha, dsk__mat A, dsk__mat B, float *C) {
    return dsk__gemm(ctx, fn, ta, tb, M, N, K, alpha, A, B, 0.0f, C, DSK_F32, N, M * N, g->BH);
}

static dsk_status dsk__to_f32(dsk_ctx *ctx, const char *fn, const dsk__att *g, float *dst, const dsk_tensor *src) {
    DSK__CUDA_LAUNCH(fn, dsk__k_to_bhtd, dsk__cuda_grid(g->n), DSK__CUDA_THREADS, dsk__cuda_stream(ctx), g->n, dst,
                     src->data, src->dtype, g->T, g->H, g->Dh, g->n);
    return DSK_OK;
}
static dsk_status dsk__from_f32(dsk_ctx *ctx, const char *fn, const dsk__att *g, dsk_tensor *dst, const float *src,
                                int accumulate) {
    DSK__CUDA_LAUNCH(fn, dsk__k_from_bhtd, dsk__cuda_grid(g->n), DSK__CUDA_THREADS, dsk__cuda_stream(ctx), g->n,
                     dst->data, dst->dtype, src, g->T, g->H, g->Dh, g->n, accumulate);
    return DSK_OK;
}

static dsk__att dsk__att_of(const dsk_tensor *q) {
    dsk__att g;
    g.B = q->shape[0];
    g.T = q->shape[1];
    g.H = q->shape[2];
    g.Dh = q->shape[3];
    g.BH = g.B * g.H;
    g.n = g.BH * g.T * g.Dh;
    return g;
}

static dsk_status dsk__attention_fwd(dsk_ctx *ctx, const char *fn, const dsk__att *g, float *buf, dsk_tensor *out,
                                     float *P, const dsk_tensor *q, const dsk_tensor *k, const dsk_tensor *v,
                                     float scale) {
    float *Q = buf, *K = buf + g->n, *V = buf + 2 * g->n, *O = buf + 3 * g->n;
    int64_t T = g->T, Dh = g->Dh;
    DSK__TRY(dsk__to_f32(ctx, fn, g, Q, q));
    DSK__TRY(dsk__to_f32(ctx, fn, g, K, k));
    DSK__TRY(dsk__to_f32(ctx, fn, g, V, v));
    /* S = scale Q K^T (T, T), then the causal softmax in place: P. */
    DSK__TRY(dsk__att_gemm(ctx, fn, g, 0, 1, T, T, Dh, scale, dsk__att_mat(Q, T, Dh), dsk__att_mat(K, T, Dh), P));
    DSK__TRY(dsk__cuda_check_rows(fn, g->BH * T));
    DSK__CUDA_LAUNCH(fn, dsk__k_causal_softmax, (unsigned)(g->BH * T), dsk__cuda_row_threads(T), dsk__cuda_stream(ctx),
                     g->BH * T * T, P, T);
    /* O = P V (T, Dh). */
    DSK__TRY(dsk__att_gemm(ctx, fn, g, 0, 0, T, Dh, T, 1.0f, dsk__att_mat(P, T, T), dsk__att_mat(V, T, Dh), O));
    return dsk__from_f32(ctx, fn, g, out, O, 0);
}

extern "C" dsk_status dsk_cuda_attention(dsk_ctx *ctx, dsk_tensor *out, dsk_tensor *probs, const dsk_tensor *q,
                                         const dsk_tensor *k, const dsk_tensor *v, float scale) {
    static const char *fn = "dsk_attention";
    dsk__att g;
    float *buf = NULL;
    dsk_status s;
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    g = dsk__att_of(q);
    if (g.n == 0) return DSK_OK;
    DSK__TRY(dsk__scratch(ctx, (size_t)(4 * g.n) * sizeof(float), (void **)&buf));
    s = dsk__attention_fwd(ctx, fn, &g, buf, out, (float *)probs->data, q, k, v, scale);
    dsk__scratch_free(ctx, buf);
    return s;
}

static dsk_status dsk__attention_bwd(dsk_ctx *ctx, const char *fn, const dsk__att *g, float *buf, dsk_tensor *dq,
                                     dsk_tensor *dk, dsk_tensor *dv, const dsk_tensor *dout, const dsk_tensor *q,
                                     const dsk_tensor *k, const dsk_tensor *v, const float *P, float scale, int add) {
    int64_t T = g->T, Dh = g->Dh;
    float *Q = buf, *K = buf + g->n, *V = buf + 2 * g->n, *dO = buf + 3 * g->n, *dX = buf + 4 * g->n,
          *dP = buf + 5 * g->n;
    DSK__TRY(dsk__to_f32(ctx, fn, g, dO, dout));
    if (dv) { /* dV = P^T dO */
        DSK__TRY(dsk__att_gemm(ctx, fn, g, 1, 0, T, Dh, T, 1.0f, dsk__att_mat(P, T, T), dsk__att_mat(dO, T, Dh), dX));
        DSK__TRY(dsk__from_f32(ctx, fn, g, dv, dX, add));
    }
    if (!dq && !dk) return DSK_OK;
    DSK__TRY(dsk__to_f32(ctx, fn, g, Q, q));
    DSK__TRY(dsk__to_f32(ctx, fn, g, K, k));
    DSK__TRY(dsk__to_f32(ctx, fn, g, V, v));
    /* dP = dO V^T, then dS = P (dP - rowsum(dP P)) in place. */
    DSK__TRY(dsk__att_gemm(ctx, fn, g, 0, 1, T, T, Dh, 1.0f, dsk__att_mat(dO, T, Dh), dsk__att_mat(V, T, Dh), dP));
    DSK__TRY(dsk__cuda_check_rows(fn, g->BH * T));
    DSK__CUDA_LAUNCH(fn, dsk__k_softmax_grad_inplace, (unsigned)(g->BH * T), dsk__cuda_row_threads(T),
                     dsk__cuda_stream(ctx), g->BH * T * T, dP, P, T);
    if (dq) { /* dQ = scale dS K */
        DSK__TRY(dsk__att_gemm(ctx, fn, g, 0, 0, T, Dh, T, scale, dsk__att_mat(dP, T, T), dsk__att_mat(K, T, Dh), dX));
        DSK__TRY(dsk__from_f32(ctx, fn, g, dq, dX, add));
    }
    if (dk) { /* dK = scale dS^T Q */
        DSK__TRY(dsk__att_gemm(ctx, fn, g, 1, 0, T, Dh, T, scale, dsk__att_mat(dP, T, T), dsk__att_mat(Q, T, Dh), dX));
        DSK__TRY(dsk__from_f32(ctx, fn, g, dk, dX, add));
    }
    return DSK_OK;
}

extern "C" dsk_status dsk_cuda_attention_backward(dsk_ctx *ctx, dsk_tensor *dq, dsk_tensor *dk, dsk_tensor *dv,
                                                  const dsk_tensor *dout, const dsk_tensor *q, const dsk_tensor *k,
                                                  const dsk_tensor *v, const dsk_tensor *probs, float scale, int add) {
    static const char *fn = "dsk_attention_backward";
    dsk__att g;
    float *buf = NULL;
    dsk_status s;
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    g = dsk__att_of(q);
    if (g.n == 0 || (!dq && !dk && !dv)) return DSK_OK;
    /* Q, K, V, dO, one gradient at a time, and dP (BH, T, T). */
    DSK__TRY(dsk__scratch(ctx, (size_t)(5 * g.n + g.BH * g.T * g.T) * sizeof(float), (void **)&buf));
    s = dsk__attention_bwd(ctx, fn, &g, buf, dq, dk, dv, dout, q, k, v, (const float *)probs->data, scale, add);
    dsk__scratch_free(ctx, buf);
    return s;
}

/* ======================================================================= AdamW */

/* m, v: f32 or bf16 (dtm), read into f32 and rounded back to nearest even, as on the CPU. */
__global__ void dsk__k_adamw(float *p, const void *grad, dsk_dtype dtg, void *m, void *v, dsk_dtype dtm, int64_t n,
                             float lr, float b1, float b2, float eps, float wd, float bc1, float bc2, float grad_mult,
                             void *copy, dsk_dtype dtc) {
    DSK__CUDA_FOR(i, n) {
        float pi = p[i], mi = dsk_load_f32(m, dtm, i), vi = dsk_load_f32(v, dtm, i);
        dsk_adamw_update(&pi, &mi, &vi, dsk_load_f32(grad, dtg, i) * grad_mult, lr, b1, b2, eps, wd, bc1, bc2);
        p[i] = pi;
        dsk_store_f32(m, dtm, i, mi);
        dsk_store_f32(v, dtm, i, vi);
        if (copy) dsk_store_f32(copy, dtc, i, pi);
    }
}

extern "C" dsk_status dsk_cuda_adamw_step(dsk_ctx *ctx, dsk_tensor *param, const dsk_tensor *grad, dsk_tensor *m,
                                          dsk_tensor *v, const dsk_adamw_opts *opts, int64_t step, float grad_mult,
                                          dsk_tensor *param_copy) {
    static const char *fn = "dsk_adamw_step";
    int64_t n = dsk_tensor_numel(param);
    float bc1 = dsk_adamw_bias_correction(opts->beta1, step), bc2 = dsk_adamw_bias_correction(opts->beta2, step);
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (n == 0) return DSK_OK;
    DSK__CUDA_LAUNCH(fn, dsk__k_adamw, dsk__cuda_grid(n), DSK__CUDA_THREADS, dsk__cuda_stream(ctx), n,
                     (float *)param->data, grad->data, grad->dtype, m->data, v->data, m->dtype, n, opts->lr,
                     opts->beta1, opts->beta2, opts->eps, opts->weight_decay, bc1, bc2, grad_mult,
                     param_copy ? param_copy->data : NULL, param_copy ? param_copy->dtype : DSK_F32);
    return DSK_OK;
}
