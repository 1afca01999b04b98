/* kernels/dsk_cuda.cuh - the CUDA helper every kernels/ .cu file uses, so that each
   launcher checks its context, reports errors and launches the same way.

   Contents
     errors        dsk__cuda_fail, dsk__cuda_cublas_fail, DSK__CUDA_CHECK
     launches      DSK__CUDA_KERNEL (the one spelling of a launch), dsk__cuda_launched,
                   DSK__CUDA_LAUNCH (launch and check), DSK__CUDA_LAUNCHED (the same as an
                   expression, for paths that clean up before returning), DSK__CUDA_LAUNCHED_SHMEM
                   (with dynamic shared memory), DSK__CUDA_DYNAMIC_SHARED (its declaration)
     shapes        DSK__CUDA_THREADS, dsk__cuda_grid, dsk__cuda_row_threads,
                   dsk__cuda_check_rows, DSK__CUDA_FOR, DSK__CUDA_UNROLL
     context       dsk__cuda_need_ctx (a CUDA ctx, its device made current), dsk__cuda_stream

   Under DSK_CUDA_EMU the file is compiled as host C++ against the CPU emulation in
   tests/cuda_emu, and DSK__CUDA_KERNEL calls cuda_emu_launch instead of <<<...>>>. */
#ifndef DSK_CUDA_CUH
#define DSK_CUDA_CUH

#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <limits.h>
#include <stdio.h>
#include "../dsk_tensor.h"

/* ---------------------------------------------------------------- errors */

/* A failed CUDA runtime call `call` in `fn`: DSK_ERR_CUDA naming the error and `detail`
   (the sizes or devices involved); clears the runtime's last-error slot. */
static inline dsk_status dsk__cuda_fail(const char *fn, const char *call, cudaError_t e, const char *detail) {
    (void)cudaGetLastError();
    return dsk_set_error(DSK_ERR_CUDA, "%s: %s failed: %s (%s)%s%s", fn, call, cudaGetErrorName(e),
                         cudaGetErrorString(e), detail && *detail ? "; " : "", detail ? detail : "");
}

/* cuBLAS's text for a status (cublasGetStatusString); kernels/tensor.cu, which loads cuBLAS at run
   time in a real CUDA build and never calls it through a NULL pointer. */
const char *dsk__cuda_cublas_status_string(cublasStatus_t st);

/* A failed cuBLAS call `call` in `fn`. Every cuBLAS call is in kernels/tensor.cu, through its
   table of entry points (dsk__cublas there): nothing else calls cuBLAS. */
static inline dsk_status dsk__cuda_cublas_fail(const char *fn, const char *call, cublasStatus_t st,
                                               const char *detail) {
    return dsk_set_error(DSK_ERR_CUDA, "%s: %s failed: %s (%d)%s%s", fn, call, dsk__cuda_cublas_status_string(st),
                         (int)st, detail && *detail ? "; " : "", detail ? detail : "");
}

/* Returns from the calling function when a CUDA runtime call fails. */
#define DSK__CUDA_CHECK(fn, call, detail) \
    do { \
        cudaError_t dsk__cuda_e_ = (call); \
        if (dsk__cuda_e_ != cudaSuccess) return dsk__cuda_fail(fn, #call, dsk__cuda_e_, detail); \
    } while (0)

/* ---------------------------------------------------------------- launches */

#ifdef DSK_CUDA_EMU
#define DSK__CUDA_KERNEL(kernel, grid, block, shmem, stream, ...) \
    cuda_emu_launch(#kernel, kernel, dim3(grid), dim3(block), (shmem), (stream), __VA_ARGS__)
#else
#define DSK__CUDA_KERNEL(kernel, grid, block, shmem, stream, ...)                                                      \
    kernel<<<(grid), (block), (shmem), (stream)>>>(__VA_ARGS__)
#endif

/* Checks the launch just made; `n` (the work size) goes into the message. */
static inline dsk_status dsk__cuda_launched(const char *fn, const char *kernel, dim3 grid, dim3 block, int64_t n) {
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) return DSK_OK;
    return dsk_set_error(DSK_ERR_CUDA, "%s: launch of %s (grid %u,%u block %u, %lld elements) failed: %s (%s)", fn,
                         kernel, grid.x, grid.y, block.x * block.y * block.z, (long long)n, cudaGetErrorName(e),
                         cudaGetErrorString(e));
}

/* kernel(args...) on stream with (grid, block), checked: the status of the launch. */
#define DSK__CUDA_LAUNCHED(fn, kernel, grid, block, stream, n, ...)       \
    (DSK__CUDA_KERNEL(kernel, grid, block, 0, stream, __VA_ARGS__),        \
     dsk__cuda_launched(fn, #kernel, dim3(grid), dim3(block), (int64_t)(n)))
/* The same, returning from the calling function when the launch fails. */
#define DSK__CUDA_LAUNCH(fn, kernel, grid, block, stream, n, ...) \
    DSK__TRY(DSK__CUDA_LAUNCHED(fn, kernel, grid, block, stream, n, __VA_ARGS__))
/* DSK__CUDA_LAUNCHED with `shmem` bytes of dynamic shared memory. */
#define DSK__CUDA_LAUNCHED_SHMEM(fn, kernel, grid, block, shmem, stream, n, ...) \
    (DSK__CUDA_KERNEL(kernel, grid, block, shmem, stream, __VA_ARGS__),           \
     dsk__cuda_launched(fn, #kernel, dim3(grid), dim3(block), (int64_t)(n)))
/* The launch's dynamic shared memory as `unsigned char name[]` (inside a kernel). */
#ifdef DSK_CUDA_EMU
#define DSK__CUDA_DYNAMIC_SHARED(name) CUDA_EMU_DYNAMIC_SHARED(unsigned char, name)
#else
#define DSK__CUDA_DYNAMIC_SHARED(name) extern __shared__ __align__(128) unsigned char name[]
#endif

/* ---------------------------------------------------------------- launch shapes */

#define DSK__CUDA_THREADS 256

/* Blocks of a grid-stride loop over n elements (capped: more blocks would only add
   overhead; elementwise results do not depend on the grid). */
static inline unsigned dsk__cuda_grid(int64_t n) {
    int64_t g = (n + DSK__CUDA_THREADS - 1) / DSK__CUDA_THREADS;
    return (unsigned)(g < 1 ? 1 : g > 8192 ? 8192 : g);
}

/* Threads of a row kernel: a power of two in [32, 256] covering the row when it is short.
   A function of the row length only, so reductions have the same shape on every run. */
static inline unsigned dsk__cuda_row_threads(int64_t cols) {
    unsigned t = 32;
    while (t < DSK__CUDA_THREADS && (int64_t)t < cols) t *= 2;
    return t;
}

/* Row kernels put rows on blockIdx.x (up to 2^31 - 1). */
static inline dsk_status dsk__cuda_check_rows(const char *fn, int64_t rows) {
    if (rows > INT_MAX)
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: %lld rows exceed the grid limit %d", fn, (long long)rows,
                             INT_MAX);
    return DSK_OK;
}

#define DSK__CUDA_FOR(i, n) \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

/* Unrolls the loop that follows in nvcc's build, where a fragment or register array indexed by
   the loop must stay in registers; nothing in the emulation (a host compiler warns of the pragma). */
#ifdef DSK_CUDA_EMU
#define DSK__CUDA_UNROLL
#else
#define DSK__CUDA_UNROLL _Pragma("unroll")
#endif

/* ---------------------------------------------------------------- context */

static inline cudaStream_t dsk__cuda_stream(const dsk_ctx *ctx) { return (cudaStream_t)ctx->stream; }

/* A CUDA ctx, its device made current on the calling thread: one thread may drive several
   devices, and a launch on a stream of another device than the current one fails. */
static inline dsk_status dsk__cuda_need_ctx(const char *fn, const dsk_ctx *ctx) {
    int cur = -1;
    if (!ctx || ctx->device.type != DSK_DEV_CUDA || !ctx->stream)
        return dsk_set_error(DSK_ERR_ARG, "%s: CUDA tensors need an initialised CUDA ctx", fn);
    if (cudaGetDevice(&cur) != cudaSuccess || cur != ctx->device.index) {
        cudaError_t e = cudaSetDevice(ctx->device.index);
        if (e != cudaSuccess) {
            char detail[48];
            snprintf(detail, sizeof detail, "device %d (current %d)", ctx->device.index, cur);
            return dsk__cuda_fail(fn, "cudaSetDevice", e, detail);
        }
    }
    return DSK_OK;
}

#endif /* DSK_CUDA_CUH */
