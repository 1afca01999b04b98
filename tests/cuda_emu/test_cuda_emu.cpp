/* test_cuda_emu.cpp - the CPU emulation of CUDA (tests/cuda_emu) tested on its own: it must
   run correct kernels correctly and catch wrong ones.

   Kernels: coordinates, barriers (a reduction without its __syncthreads fails for some
   schedule, with them it never does), every warp intrinsic against a host model of a warp,
   atomics, static and dynamic shared memory; the misuses it must report (a shuffle from a
   lane that does not take part, a lane that leaves while its warp waits, a barrier in
   divergent code, a deadlock, a host pointer as argument, a launch on another device's
   stream). Memory: an out-of-bounds device write (canary, or ASan in sanitizer builds) and a
   host dereference of a device pointer, each in a child process that must die of it; copy
   kinds, freed memory, poison, pinned memory. Streams and events in order across streams;
   graph capture and replay, fork and join, invalidation. cuBLAS against a float64 GEMM;
   cub's radix sort against std::stable_sort. NCCL over 2 and 4 processes: every collective,
   data type and reduction against exact references, groups, send/recv, split, an all-reduce
   captured in a graph and launched three times, a mismatch, and a peer that aborts or dies. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <cub/cub.cuh>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <errno.h>
#include <stdarg.h>
#include <string>
#include <signal.h>
#include <stdint.h>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

#include "../dsk_test.h"
#include "emu.h" /* the emulator's fp8 conversions */

#define LAUNCH(kernel, grid, block, shmem, stream, ...) cuda_emu_launch(#kernel, kernel, dim3 grid, dim3 block, shmem, stream, __VA_ARGS__)
#define CU(call) DSK_TEST_EXPECT((call) == cudaSuccess, "%s", cudaGetErrorString(cudaGetLastError()))

static char g_self[4096];

/* Faults this case provoked on purpose: at least `min`, the last one mentioning `needle`. */
static void expect_faults(int min, const char *needle) {
    const char *last = cuda_emu_last_fault();
    int n = cuda_emu_take_faults();
    DSK_TEST_EXPECT(n >= min, "%d faults reported, want at least %d", n, min);
    DSK_TEST_EXPECT(strstr(last, needle) != NULL, "last fault \"%s\" lacks \"%s\"", last, needle);
}
static void expect_no_faults(void) {
    int n = cuda_emu_take_faults();
    DSK_TEST_EXPECT(n == 0, "%d unexpected faults (last: %s)", n, cuda_emu_last_fault());
}

template <class T> static T *dev_alloc(size_t n) {
    void *p = NULL;
    CU(cudaMalloc(&p, n * sizeof(T)));
    return (T *)p;
}
template <class T> static std::vector<T> to_host(const T *d, size_t n) {
    std::vector<T> h(n);
    CU(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
}
template <class T> static T *to_dev(const std::vector<T> &h) {
    T *d = dev_alloc<T>(h.size());
    CU(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}

/* ---------------------------------------------------------------- kernels: coordinates, barriers */

__global__ void k_ids(int *count, uint32_t *where) {
    unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    unsigned i = b * blockDim.x * blockDim.y * blockDim.z + t;
    atomicAdd(&count[i], 1);
    where[i] = (b << 16) | t;
}

static void test_coordinates(void) {
    const dim3 g(3, 2, 2), b(5, 3, 2);
    size_t n = 12 * 30;
    int *count = dev_alloc<int>(n);
    uint32_t *where = dev_alloc<uint32_t>(n);
    CU(cudaMemset(count, 0, n * sizeof(int)));
    LAUNCH(k_ids, (3, 2, 2), (5, 3, 2), 0, 0, count, where);
    CU(cudaGetLastError());
    std::vector<int> c = to_host(count, n);
    std::vector<uint32_t> w = to_host(where, n);
    int bad = 0;
    for (size_t i = 0; i < n; i++) bad += c[i] != 1 || w[i] != (uint32_t)(((i / 30) << 16) | (i % 30));
    DSK_TEST_EXPECT(bad == 0, "%d of %zu threads ran with wrong coordinates or not exactly once", bad, n);
    DSK_TEST_EXPECT(cuda_emu_launches("k_ids") == 1, "launch count %lld", (long long)cuda_emu_launches("k_ids"));
    (void)g, (void)b;
    CU(cudaFree(count));
    CU(cudaFree(where));
}

/* Tree sum of one value per thread in shared memory; `sync` 0 drops every barrier. With
   `twice`, a second sum reuses the array: without the barrier that ends the first sum, a
   fast thread overwrites sh[0] before the others have read it. */
__global__ void k_block_sum(float *out, const float *in, int sync, int twice) {
    __shared__ float sh[128];
    unsigned t = threadIdx.x;
    float total = 0;
    for (int round = 0; round < (twice ? 2 : 1); round++) {
        sh[t] = in[blockIdx.x * blockDim.x + t] * (float)(round + 1);
        if (sync) __syncthreads();
        for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
            if (t < s) sh[t] += sh[t + s];
            if (sync) __syncthreads();
        }
        total += sh[0];
        if (sync == 1) __syncthreads(); /* sync 2: all but this trailing barrier */
    }
    out[blockIdx.x * blockDim.x + t] = total;
}

/* Runs k_block_sum `runs` times (each launch has its own schedule); returns how many runs
   gave a wrong sum anywhere. */
static int block_sum_failures(int sync, int twice, int runs) {
    const int blocks = 4, threads = 128;
    std::vector<float> in((size_t)blocks * threads);
    for (size_t i = 0; i < in.size(); i++) in[i] = (float)dsk_test_rand_int(16);
    float *din = to_dev(in), *dout = dev_alloc<float>(in.size());
    int failures = 0;
    for (int r = 0; r < runs; r++) {
        LAUNCH(k_block_sum, (blocks), (threads), 0, 0, dout, din, sync, twice);
        std::vector<float> out = to_host(dout, in.size());
        int bad = 0;
        for (int b = 0; b < blocks; b++) {
            float want = 0;
            for (int t = 0; t < threads; t++) want += in[(size_t)b * threads + t];
            want *= twice ? 3.0f : 1.0f;
            for (int t = 0; t < threads; t++) bad += out[(size_t)b * threads + t] != want;
        }
        failures += bad > 0;
    }
    CU(cudaFree(din));
    CU(cudaFree(dout));
    return failures;
}

static void test_barriers(void) {
    DSK_TEST_EXPECT(block_sum_failures(1, 0, 8) == 0, "a correct reduction failed");
    DSK_TEST_EXPECT(block_sum_failures(1, 1, 8) == 0, "a correct reduction used twice failed");
    DSK_TEST_EXPECT(block_sum_failures(0, 0, 8) > 0, "a reduction without __syncthreads passed 8 schedules out of 8");
    DSK_TEST_EXPECT(block_sum_failures(2, 1, 16) > 0, "a reused reduction without its trailing __syncthreads passed 16 schedules");
    expect_no_faults();
}

/* ---------------------------------------------------------------- warp intrinsics */

/* Per lane of a 48-thread block (a full warp and half of one): the results of every
   intrinsic, for a host model to check. */
__global__ void k_warp(int *out, const int *in, int full_width) {
    unsigned t = threadIdx.x, lane = t & 31;
    unsigned full = t < 32 ? 0xffffffffu : 0x0000ffffu;
    int width = t < 32 || full_width < 16 ? full_width : 16; /* the second warp has 16 lanes */
    int v = in[t], *o = out + t * 8;
    o[0] = __shfl_xor_sync(full, v, 1, width);
    o[1] = __shfl_down_sync(full, v, 3, width);
    o[2] = __shfl_up_sync(full, v, 2, width);
    o[3] = __shfl_sync(full, v, (int)(lane * 7 + 1), width);
    o[4] = (int)__ballot_sync(full, v & 1);
    o[5] = __any_sync(full, v > 90);
    o[6] = __all_sync(full, v >= 0);
    __syncwarp(full);
    o[7] = __shfl_xor_sync(full, (double)v * 0.5, 4) == (double)in[(t & ~31u) + ((lane ^ 4) & (t < 32 ? 31 : 15))] * 0.5;
}

static void test_warp_intrinsics(void) {
    for (int width = 4; width <= 32; width *= 2) {
        std::vector<int> in(48);
        for (int i = 0; i < 48; i++) in[i] = (int)dsk_test_rand_int(100);
        int *din = to_dev(in), *dout = dev_alloc<int>(48 * 8);
        LAUNCH(k_warp, (1), (48), 0, 0, dout, din, width);
        std::vector<int> o = to_host(dout, 48 * 8);
        int bad = 0;
        for (int t = 0; t < 48; t++) {
            int lane = t & 31, n = t < 32 ? 32 : 16, base = t & ~31, w = t < 32 || width < 16 ? width : 16;
            int seg = lane & ~(w - 1), pos = lane - seg;
            auto at = [&](int l) { return in[(size_t)(base + l)]; };
            int x = lane ^ 1, d = pos + 3 < w ? lane + 3 : lane, u = pos >= 2 ? lane - 2 : lane, s = seg + ((lane * 7 + 1) & (w - 1));
            unsigned ballot = 0;
            int any = 0, all = 1;
            for (int l = 0; l < n; l++) {
                ballot |= (unsigned)(at(l) & 1) << l;
                any |= at(l) > 90;
                all &= at(l) >= 0;
            }
            const int *r = &o[(size_t)t * 8];
            bad += r[0] != at(x < seg + w ? x : lane) || r[1] != at(d) || r[2] != at(u) || r[3] != at(s) || r[4] != (int)ballot ||
                   r[5] != any || r[6] != all || r[7] != 1;
            (void)n;
        }
        DSK_TEST_EXPECT(bad == 0, "width %d: %d of 48 lanes disagree with the host model of a warp", width, bad);
        CU(cudaFree(din));
        CU(cudaFree(dout));
    }
    expect_no_faults();
}

__global__ void k_shfl_outside_mask(int *out) {
    int v = (int)threadIdx.x;
    if (threadIdx.x < 16) out[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, v, 16); /* reads lanes 16..31 */
}
__global__ void k_lane_leaves(int *out) {
    if (threadIdx.x == 3) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}
__global__ void k_divergent_barrier(int *out) {
    if (threadIdx.x < 16) __syncthreads();
    out[threadIdx.x] = 1;
}
__global__ void k_deadlock(int *out) {
    if (threadIdx.x == 5) __syncthreads();
    else out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}

static void expect_kernel_error(cudaError_t want, const char *needle) {
    cudaError_t e = cudaDeviceSynchronize();
    DSK_TEST_EXPECT(e == want, "synchronising returned %s, want %s", cudaGetErrorName(e), cudaGetErrorName(want));
    DSK_TEST_EXPECT(strstr(cudaGetErrorString(e), needle) != NULL, "error text \"%s\" lacks \"%s\"", cudaGetErrorString(e), needle);
    expect_faults(1, needle);
}

static void test_warp_misuse(void) {
    int *out = dev_alloc<int>(64);
    LAUNCH(k_shfl_outside_mask, (1), (32), 0, 0, out);
    expect_kernel_error(cudaErrorIllegalInstruction, "does not take part");
    LAUNCH(k_lane_leaves, (1), (32), 0, 0, out);
    expect_kernel_error(cudaErrorIllegalInstruction, "exit");
    LAUNCH(k_divergent_barrier, (1), (32), 0, 0, out);
    expect_kernel_error(cudaErrorIllegalInstruction, "divergent");
    LAUNCH(k_deadlock, (2), (32), 0, 0, out);
    expect_kernel_error(cudaErrorLaunchFailure, "deadlock");
    /* the emulator recovers: a correct kernel runs again */
    DSK_TEST_EXPECT(block_sum_failures(1, 1, 2) == 0, "a correct kernel failed after the faults");
    expect_no_faults();
    CU(cudaFree(out));
}

/* ---------------------------------------------------------------- atomics, shared memory */

__global__ void k_atomics(int *sum, unsigned *mx, unsigned long long *cas, float *fsum) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(sum, (int)(i % 7));
    atomicMax(mx, i * 3u);
    atomicAdd(fsum, 0.5f);
    unsigned long long old = *cas, seen;
    while ((seen = atomicCAS(cas, old, old + i)) != old) old = seen;
}

__global__ void k_shared_poison(float *out) {
    __shared__ float before[4];
    CUDA_EMU_DYNAMIC_SHARED(float, dyn);
    out[threadIdx.x] = before[threadIdx.x % 4]; /* never written: 0xff bytes */
    out[64 + threadIdx.x] = dyn[threadIdx.x];
    __syncthreads();
    dyn[threadIdx.x] = (float)threadIdx.x;
    __syncthreads();
    out[128 + threadIdx.x] = dyn[(threadIdx.x + 1) % blockDim.x];
}

static void test_atomics_and_shared(void) {
    int *sum = dev_alloc<int>(1);
    unsigned *mx = dev_alloc<unsigned>(1);
    unsigned long long *cas = dev_alloc<unsigned long long>(1);
    float *fsum = dev_alloc<float>(1), *out = dev_alloc<float>(192);
    long long want = 0;
    CU(cudaMemset(sum, 0, 4));
    CU(cudaMemset(mx, 0, 4));
    CU(cudaMemset(cas, 0, 8));
    CU(cudaMemset(fsum, 0, 4));
    LAUNCH(k_atomics, (40), (64), 0, 0, sum, mx, cas, fsum);
    for (int i = 0; i < 2560; i++) want += i % 7;
    DSK_TEST_EXPECT(to_host(sum, 1)[0] == (int)want, "atomicAdd sum %d, want %lld", to_host(sum, 1)[0], want);
    DSK_TEST_EXPECT(to_host(mx, 1)[0] == 2559u * 3u, "atomicMax %u", to_host(mx, 1)[0]);
    DSK_TEST_EXPECT(to_host(cas, 1)[0] == 2559ull * 2560ull / 2, "atomicCAS loop %llu", to_host(cas, 1)[0]);
    DSK_TEST_EXPECT(to_host(fsum, 1)[0] == 1280.0f, "float atomicAdd %g", (double)to_host(fsum, 1)[0]);
    LAUNCH(k_shared_poison, (2), (64), 64 * sizeof(float), 0, out);
    std::vector<float> o = to_host(out, 192);
    int bad = 0;
    for (int t = 0; t < 64; t++) bad += o[(size_t)t] == o[(size_t)t] || o[64 + (size_t)t] == o[64 + (size_t)t] || o[128 + (size_t)t] != (float)((t + 1) % 64);
    DSK_TEST_EXPECT(bad == 0, "%d threads saw shared memory that was not poisoned, or wrong dynamic shared memory", bad);
    expect_no_faults();
    CU(cudaFree(sum));
    CU(cudaFree(mx));
    CU(cudaFree(cas));
    CU(cudaFree(fsum));
    CU(cudaFree(out));
}

/* ---------------------------------------------------------------- launches */

__global__ void k_write(float *p, int n, float v) {
    for (int i = (int)(blockIdx.x * blockDim.x + threadIdx.x); i < n; i += (int)(gridDim.x * blockDim.x)) p[i] = v;
}

static void test_launch_checks(void) {
    float *d = dev_alloc<float>(16), host[16];
    cudaStream_t s1;
    LAUNCH(k_write, (1), (2048), 0, 0, d, 16, 1.0f);
    DSK_TEST_EXPECT(cudaGetLastError() == cudaErrorInvalidConfiguration, "a 2048-thread block was accepted");
    LAUNCH(k_write, (0), (32), 0, 0, d, 16, 1.0f);
    DSK_TEST_EXPECT(cudaGetLastError() == cudaErrorInvalidConfiguration, "an empty grid was accepted");
    /* a stream of device 1 while device 0 is current */
    CU(cudaSetDevice(1));
    CU(cudaStreamCreate(&s1));
    CU(cudaSetDevice(0));
    LAUNCH(k_write, (1), (32), 0, s1, d, 16, 1.0f);
    DSK_TEST_EXPECT(cudaGetLastError() == cudaErrorInvalidResourceHandle, "a launch on another device's stream was accepted");
    /* device 0 memory as argument of a kernel on device 1 */
    CU(cudaSetDevice(1));
    LAUNCH(k_write, (1), (32), 0, s1, d, 16, 1.0f);
    expect_kernel_error(cudaErrorIllegalAddress, "device 0");
    CU(cudaStreamDestroy(s1));
    CU(cudaSetDevice(0));
    /* host memory as argument */
    LAUNCH(k_write, (1), (32), 0, 0, host, 16, 1.0f);
    expect_kernel_error(cudaErrorIllegalAddress, "host memory");
    CU(cudaFree(d));
}

/* ---------------------------------------------------------------- memory */

__global__ void k_write_past_end(float *p, int n) {
    if (threadIdx.x == 0) p[n] = 1.0f;
}

/* Runs this program as `--child what` and returns its wait status; its output goes to `out`. */
static int run_child(const char *what, std::string *out) {
    int fds[2];
    char buf[4096];
    ssize_t k;
    int status = 0;
    if (pipe(fds) != 0) return -1;
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        close(fds[0]);
        execl(g_self, g_self, "--child", what, (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    while ((k = read(fds[0], buf, sizeof buf)) > 0) out->append(buf, (size_t)k);
    close(fds[0]);
    waitpid(pid, &status, 0);
    return status;
}

static int child_main(const char *what) {
    if (!strcmp(what, "oob")) { /* exits 3 from the canary fault, or ASan stops it */
        float *d = NULL;
        cudaMalloc((void **)&d, 10 * sizeof(float));
        LAUNCH(k_write_past_end, (1), (32), 0, 0, d, 10);
        cudaDeviceSynchronize();
        return 0;
    }
    if (!strcmp(what, "host-deref")) { /* SIGSEGV: device memory is PROT_NONE outside device work */
        float *d = NULL;
        cudaMalloc((void **)&d, 4);
        printf("read %g\n", (double)*(volatile float *)d);
        return 0;
    }
    return 2;
}

static void test_oob_write_caught(void) {
    std::string out;
    int st = run_child("oob", &out);
    DSK_TEST_EXPECT(!(WIFEXITED(st) && WEXITSTATUS(st) == 0), "the child survived an out-of-bounds write: %s", out.c_str());
    DSK_TEST_EXPECT(out.find("past its end") != std::string::npos || out.find("AddressSanitizer") != std::string::npos,
                    "the child's output names no overrun: %s", out.c_str());
}

static void test_host_deref_caught(void) {
    std::string out;
    int st = run_child("host-deref", &out);
    DSK_TEST_EXPECT((WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV) || out.find("SEGV") != std::string::npos,
                    "a host read of device memory was not stopped (status 0x%x): %s", st, out.c_str());
}

static void test_copies(void) {
    float *d = dev_alloc<float>(100), *d2 = dev_alloc<float>(100), host[100], *pinned = NULL;
    std::vector<float> h(100);
    for (int i = 0; i < 100; i++) h[(size_t)i] = (float)i;
    DSK_TEST_EXPECT(((uintptr_t)d & 255) == 0, "allocation %p not 256-byte aligned", (void *)d);
    DSK_TEST_EXPECT(to_host(d, 1)[0] != to_host(d, 1)[0], "fresh device memory is not poisoned (NaN)");
    CU(cudaMemcpy(d, h.data(), 400, cudaMemcpyHostToDevice));
    DSK_TEST_EXPECT(cudaMemcpy(d2, d, 400, cudaMemcpyHostToDevice) == cudaErrorInvalidValue, "device source accepted as host");
    expect_faults(1, "not host memory");
    DSK_TEST_EXPECT(cudaMemcpy(host, host + 50, 40, cudaMemcpyDeviceToDevice) == cudaErrorInvalidValue, "host pointers accepted as device");
    expect_faults(1, "not device memory");
    DSK_TEST_EXPECT(cudaMemcpy(host, d + 90, 80, cudaMemcpyDeviceToHost) == cudaErrorInvalidValue, "a copy past the end was accepted");
    expect_faults(1, "past the end");
    CU(cudaMemcpy(d2, d, 400, cudaMemcpyDefault));
    DSK_TEST_EXPECT(to_host(d2, 100) == h, "cudaMemcpyDefault device to device");
    CU(cudaFree(d2));
    DSK_TEST_EXPECT(cudaMemcpy(host, d2, 4, cudaMemcpyDeviceToHost) == cudaErrorInvalidValue, "a copy from freed memory was accepted");
    expect_faults(1, "freed");
    DSK_TEST_EXPECT(cudaFree(d2) == cudaErrorInvalidValue, "a double free was accepted");
    expect_faults(1, "freed twice");
    /* pinned memory: an asynchronous copy into it is done only after synchronising */
    CU(cudaMallocHost((void **)&pinned, 400));
    CU(cudaMemcpyAsync(pinned, d, 400, cudaMemcpyDeviceToHost, 0));
    CU(cudaStreamSynchronize(0));
    DSK_TEST_EXPECT(memcmp(pinned, h.data(), 400) == 0, "pinned copy");
    {
        cudaPointerAttributes a;
        CU(cudaPointerGetAttributes(&a, d));
        DSK_TEST_EXPECT(a.type == cudaMemoryTypeDevice && a.device == 0, "attributes of device memory: type %d device %d", (int)a.type, a.device);
        CU(cudaPointerGetAttributes(&a, pinned));
        DSK_TEST_EXPECT(a.type == cudaMemoryTypeHost, "attributes of pinned memory: type %d", (int)a.type);
    }
    CU(cudaFreeHost(pinned));
    {
        void *huge = NULL;
        DSK_TEST_EXPECT(cudaMalloc(&huge, (size_t)1 << 40) == cudaErrorMemoryAllocation && huge == NULL, "a 1 TiB allocation");
        DSK_TEST_EXPECT(cudaGetLastError() == cudaErrorMemoryAllocation, "the last error after it");
    }
    CU(cudaFree(d));
    expect_no_faults();
}

/* ---------------------------------------------------------------- streams, events */

/* The gate holds a stream in a host function until the test opens it; g_held says the stream has
   reached it (so the 20 ms hold starts after the stream's earlier operations ran, however late). */
static std::atomic<int> g_gate, g_held;
static void wait_gate(void *) {
    g_held = 1;
    while (!g_gate) usleep(1000);
}

__global__ void k_add(float *p, int n, float v) {
    for (int i = (int)(blockIdx.x * blockDim.x + threadIdx.x); i < n; i += (int)(gridDim.x * blockDim.x)) p[i] += v;
}

static void test_streams_events(void) {
    cudaStream_t a, b;
    cudaEvent_t done, t0, t1;
    float *x = dev_alloc<float>(1000), *y = dev_alloc<float>(1000), ms = -1;
    CU(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
    CU(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
    CU(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    CU(cudaEventCreate(&t0));
    CU(cudaEventCreate(&t1));
    CU(cudaMemsetAsync(x, 0, 4000, a));
    g_gate = 0;
    g_held = 0;
    CU(cudaEventRecord(t0, a));
    CU(cudaLaunchHostFunc(a, wait_gate, NULL)); /* holds stream a */
    LAUNCH(k_add, (4), (64), 0, a, x, 1000, 2.5f);
    CU(cudaEventRecord(done, a));
    CU(cudaEventRecord(t1, a));
    CU(cudaStreamWaitEvent(b, done, 0));
    CU(cudaMemcpyAsync(y, x, 4000, cudaMemcpyDeviceToDevice, b));
    while (!g_held) usleep(1000);
    usleep(20000);
    DSK_TEST_EXPECT(cudaEventQuery(done) == cudaErrorNotReady, "the event completed while its stream was held");
    DSK_TEST_EXPECT(cudaStreamQuery(a) == cudaErrorNotReady && cudaStreamQuery(b) == cudaErrorNotReady, "streams idle while held");
    g_gate = 1;
    CU(cudaStreamSynchronize(b));
    DSK_TEST_EXPECT(cudaEventQuery(done) == cudaSuccess, "the event is not complete after the waiting stream finished");
    {
        std::vector<float> out = to_host(y, 1000);
        int bad = 0;
        for (float v : out) bad += v != 2.5f;
        DSK_TEST_EXPECT(bad == 0, "%d elements copied before the kernel they waited for", bad);
    }
    CU(cudaEventSynchronize(t1));
    CU(cudaEventElapsedTime(&ms, t0, t1));
    DSK_TEST_EXPECT(ms >= 15.0f, "elapsed %g ms across a 20 ms hold", (double)ms);
    DSK_TEST_EXPECT(cudaEventElapsedTime(&ms, t0, done) == cudaErrorInvalidResourceHandle, "timing of a DisableTiming event");
    CU(cudaEventDestroy(done));
    CU(cudaEventDestroy(t0));
    CU(cudaEventDestroy(t1));
    CU(cudaStreamDestroy(a));
    CU(cudaStreamDestroy(b));
    CU(cudaFree(x));
    CU(cudaFree(y));
    expect_no_faults();
}

/* ---------------------------------------------------------------- graphs */

static void test_graphs(void) {
    cudaStream_t s, f;
    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    cudaEvent_t fork_ev, join_ev;
    float *x = dev_alloc<float>(256), *y = dev_alloc<float>(256), *tmp = NULL, v = 1.5f;
    size_t nodes = 0;
    cudaStreamCaptureStatus cs;
    CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CU(cudaStreamCreateWithFlags(&f, cudaStreamNonBlocking));
    CU(cudaEventCreateWithFlags(&fork_ev, cudaEventDisableTiming));
    CU(cudaEventCreateWithFlags(&join_ev, cudaEventDisableTiming));
    CU(cudaMemset(x, 0, 1024));
    CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CU(cudaStreamIsCapturing(s, &cs));
    DSK_TEST_EXPECT(cs == cudaStreamCaptureStatusActive, "capture status %d", (int)cs);
    CU(cudaMallocAsync((void **)&tmp, 1024, s));
    LAUNCH(k_add, (2), (64), 0, s, x, 256, v);           /* x += 1.5 per replay */
    CU(cudaEventRecord(fork_ev, s));
    CU(cudaStreamWaitEvent(f, fork_ev, 0));                /* f joins the capture */
    CU(cudaMemcpyAsync(tmp, x, 1024, cudaMemcpyDeviceToDevice, f));
    LAUNCH(k_add, (1), (256), 0, f, tmp, 256, 10.0f);
    CU(cudaEventRecord(join_ev, f));
    CU(cudaStreamWaitEvent(s, join_ev, 0));                /* and is joined back */
    CU(cudaMemcpyAsync(y, tmp, 1024, cudaMemcpyDeviceToDevice, s));
    CU(cudaFreeAsync(tmp, s));
    v = 100.0f; /* arguments were taken at capture */
    CU(cudaStreamEndCapture(s, &g));
    CU(cudaGraphGetNodes(g, NULL, &nodes));
    DSK_TEST_EXPECT(nodes == 4, "%zu nodes captured, want 4 (stream-ordered allocations and events are not nodes here)", nodes);
    DSK_TEST_EXPECT(to_host(x, 1)[0] == 0.0f, "captured work ran during capture");
    CU(cudaGraphInstantiate(&ge, g, 0));
    for (int r = 0; r < 3; r++) CU(cudaGraphLaunch(ge, s));
    CU(cudaStreamSynchronize(s));
    {
        std::vector<float> hx = to_host(x, 256), hy = to_host(y, 256);
        int bad = 0;
        for (int i = 0; i < 256; i++) bad += hx[(size_t)i] != 4.5f || hy[(size_t)i] != 14.5f;
        DSK_TEST_EXPECT(bad == 0, "%d elements wrong after 3 replays (x %g, y %g)", bad, (double)hx[0], (double)hy[0]);
    }
    CU(cudaGraphExecDestroy(ge));
    CU(cudaGraphDestroy(g));
    /* a forked stream that is never joined back */
    CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CU(cudaEventRecord(fork_ev, s));
    CU(cudaStreamWaitEvent(f, fork_ev, 0));
    LAUNCH(k_add, (1), (32), 0, f, x, 256, 1.0f);
    DSK_TEST_EXPECT(cudaStreamEndCapture(s, &g) == cudaErrorStreamCaptureUnjoined && g == NULL, "an unjoined fork was accepted");
    /* synchronising a capturing stream invalidates the capture */
    CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    LAUNCH(k_add, (1), (32), 0, s, x, 256, 1.0f);
    DSK_TEST_EXPECT(cudaStreamSynchronize(s) == cudaErrorStreamCaptureUnsupported, "a sync during capture was accepted");
    DSK_TEST_EXPECT(cudaStreamEndCapture(s, &g) == cudaErrorStreamCaptureInvalidated && g == NULL, "an invalidated capture ended well");
    /* cudaMalloc during a global-mode capture on another thread's stream is refused */
    CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    {
        void *p = NULL;
        DSK_TEST_EXPECT(cudaMalloc(&p, 16) == cudaErrorStreamCaptureUnsupported, "cudaMalloc during a global capture");
    }
    DSK_TEST_EXPECT(cudaStreamEndCapture(s, &g) == cudaErrorStreamCaptureInvalidated, "the capture survived a cudaMalloc");
    expect_faults(1, "stream capture");
    {
        std::vector<float> hx = to_host(x, 256);
        DSK_TEST_EXPECT(hx[0] == 4.5f, "work of failed captures ran: x %g", (double)hx[0]);
    }
    CU(cudaEventDestroy(fork_ev));
    CU(cudaEventDestroy(join_ev));
    CU(cudaStreamDestroy(s));
    CU(cudaStreamDestroy(f));
    CU(cudaFree(x));
    CU(cudaFree(y));
    expect_no_faults();
}

/* ---------------------------------------------------------------- cuBLAS */

static size_t esize(cudaDataType t) { return t == CUDA_R_64F ? 8 : t == CUDA_R_32F ? 4 : 2; }
static void put(cudaDataType t, void *p, size_t i, double v) {
    switch (t) {
    case CUDA_R_16BF: ((__nv_bfloat16 *)p)[i] = __float2bfloat16((float)v); break;
    case CUDA_R_16F: ((__half *)p)[i] = __float2half((float)v); break;
    case CUDA_R_32F: ((float *)p)[i] = (float)v; break;
    default: ((double *)p)[i] = v; break;
    }
}
static double get(cudaDataType t, const void *p, size_t i) {
    switch (t) {
    case CUDA_R_16BF: return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    case CUDA_R_16F: return __half2float(((const __half *)p)[i]);
    case CUDA_R_32F: return ((const float *)p)[i];
    default: return ((const double *)p)[i];
    }
}

/* One strided-batched GEMM against a float64 reference on the same (rounded) inputs. */
static void gemm_case(cublasHandle_t h, cudaDataType ab, cudaDataType ct, cublasComputeType_t ctype, int ta, int tb, int m, int n,
                      int k, int batch, double beta, double rtol, double atol) {
    int ar = ta ? k : m, ac = ta ? m : k, br = tb ? n : k, bc = tb ? k : n, lda = ar + 3, ldb = br + 1, ldc = m + 2;
    long long sa = 0 /* A shared by the batch */, sb = (long long)ldb * bc + 5, sc = (long long)ldc * n + 7;
    size_t na = (size_t)lda * ac, nb = (size_t)sb * batch, nc = (size_t)sc * batch;
    std::vector<char> A(na * esize(ab)), B(nb * esize(ab)), C(nc * esize(ct)), got(nc * esize(ct));
    std::vector<double> want(nc);
    for (size_t i = 0; i < na; i++) put(ab, A.data(), i, dsk_test_rand(-1, 1));
    for (size_t i = 0; i < nb; i++) put(ab, B.data(), i, dsk_test_rand(-1, 1));
    for (size_t i = 0; i < nc; i++) put(ct, C.data(), i, beta == 0 ? NAN : dsk_test_rand(-1, 1));
    for (int bi = 0; bi < batch; bi++)
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++) {
                double acc = 0;
                for (int p = 0; p < k; p++) {
                    double a = get(ab, A.data(), ta ? (size_t)p + (size_t)i * lda : (size_t)i + (size_t)p * lda);
                    double b = get(ab, B.data(), (size_t)bi * sb + (tb ? (size_t)j + (size_t)p * ldb : (size_t)p + (size_t)j * ldb));
                    acc += a * b;
                }
                size_t ci = (size_t)bi * sc + (size_t)i + (size_t)j * ldc;
                want[ci] = 0.75 * acc + (beta != 0 ? beta * get(ct, C.data(), ci) : 0.0);
            }
    void *dA = to_dev(A), *dB = to_dev(B), *dC = to_dev(C);
    float a32 = 0.75f, b32 = (float)beta;
    double a64 = 0.75, b64 = beta;
    __half a16 = __float2half(0.75f), b16 = __float2half((float)beta);
    const void *alpha = ctype == CUBLAS_COMPUTE_64F ? (const void *)&a64 : ctype == CUBLAS_COMPUTE_16F ? (const void *)&a16 : &a32;
    const void *betap = ctype == CUBLAS_COMPUTE_64F ? (const void *)&b64 : ctype == CUBLAS_COMPUTE_16F ? (const void *)&b16 : &b32;
    cublasStatus_t st = cublasGemmStridedBatchedEx(h, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k, alpha, dA,
                                                   ab, lda, sa, dB, ab, ldb, sb, betap, dC, ct, ldc, sc, batch, ctype, CUBLAS_GEMM_DEFAULT);
    DSK_TEST_EXPECT(st == CUBLAS_STATUS_SUCCESS, "GEMM status %s", cublasGetStatusName(st));
    {
        cudaStream_t s;
        cublasGetStream(h, &s);
        CU(cudaStreamSynchronize(s)); /* a non-blocking stream: cudaMemcpy alone would not wait for it */
    }
    CU(cudaMemcpy(got.data(), dC, got.size(), cudaMemcpyDeviceToHost));
    {
        std::vector<double> g(nc), w(nc);
        size_t cnt = 0;
        for (int bi = 0; bi < batch; bi++)
            for (int j = 0; j < n; j++)
                for (int i = 0; i < m; i++) {
                    size_t ci = (size_t)bi * sc + (size_t)i + (size_t)j * ldc;
                    g[cnt] = get(ct, got.data(), ci);
                    w[cnt++] = want[ci];
                }
        char what[128];
        snprintf(what, sizeof what, "GEMM type %d->%d ta %d tb %d %dx%dx%d batch %d beta %g", (int)ab, (int)ct, ta, tb, m, n, k, batch, beta);
        DSK_TEST_CLOSE64(g.data(), w.data(), (int64_t)cnt, rtol, atol, what);
        /* the padding between columns and batches is untouched */
        int touched = 0;
        for (size_t i = 0; i < nc; i++)
            if ((i % (size_t)sc) % (size_t)ldc >= (size_t)m || (i % (size_t)sc) >= (size_t)ldc * n)
                touched += memcmp(got.data() + i * esize(ct), C.data() + i * esize(ct), esize(ct)) != 0;
        DSK_TEST_EXPECT(touched == 0, "%s: %d padding elements of C written", what, touched);
    }
    CU(cudaFree(dA));
    CU(cudaFree(dB));
    CU(cudaFree(dC));
}

static void test_cublas(void) {
    cublasHandle_t h;
    cudaStream_t s;
    DSK_TEST_EXPECT(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS, "cublasCreate");
    CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    DSK_TEST_EXPECT(cublasSetStream(h, s) == CUBLAS_STATUS_SUCCESS, "cublasSetStream");
    for (int t = 0; t < 4; t++) {
        int ta = t & 1, tb = t >> 1;
        gemm_case(h, CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F, ta, tb, 7, 5, 33, 1, 0.0, 1e-6, 1e-6);
        gemm_case(h, CUDA_R_16BF, CUDA_R_32F, CUBLAS_COMPUTE_32F, ta, tb, 9, 4, 65, 3, 0.5, 1e-6, 1e-5);
        gemm_case(h, CUDA_R_16BF, CUDA_R_16BF, CUBLAS_COMPUTE_32F, ta, tb, 3, 8, 17, 2, 1.0, 8e-3, 8e-3);
        gemm_case(h, CUDA_R_16F, CUDA_R_16F, CUBLAS_COMPUTE_32F, ta, tb, 6, 6, 40, 2, 0.0, 1e-3, 2e-3);
        gemm_case(h, CUDA_R_64F, CUDA_R_64F, CUBLAS_COMPUTE_64F, ta, tb, 5, 7, 31, 2, -0.25, 1e-14, 1e-14);
    }
    gemm_case(h, CUDA_R_16F, CUDA_R_16F, CUBLAS_COMPUTE_16F, 0, 1, 4, 4, 16, 1, 0.0, 1e-2, 2e-2);
    gemm_case(h, CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F, 0, 0, 1, 1, 0, 1, 0.5, 1e-7, 1e-7); /* k = 0: C = beta C */
    {
        float *d = dev_alloc<float>(64), one = 1.0f, zero = 0.0f;
        DSK_TEST_EXPECT(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, &one, d, CUDA_R_32F, 3, d, CUDA_R_32F, 4, &zero, d, CUDA_R_32F, 4,
                                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_INVALID_VALUE, "lda 3 < m 4 accepted");
        DSK_TEST_EXPECT(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, &one, d, CUDA_R_32F, 4, d, CUDA_R_16BF, 4, &zero, d, CUDA_R_32F, 4,
                                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_NOT_SUPPORTED, "f32 A with bf16 B accepted");
        CU(cudaSetDevice(1));
        DSK_TEST_EXPECT(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, &one, d, CUDA_R_32F, 4, d, CUDA_R_32F, 4, &zero, d, CUDA_R_32F, 4,
                                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_EXECUTION_FAILED,
                        "a handle of device 0 ran while device 1 was current");
        expect_faults(1, "while device 1 is current");
        CU(cudaSetDevice(0));
        CU(cudaFree(d));
    }
    DSK_TEST_EXPECT(cublasDestroy(h) == CUBLAS_STATUS_SUCCESS, "cublasDestroy");
    CU(cudaStreamDestroy(s));
    expect_no_faults();
}

/* ---------------------------------------------------------------- cub */

template <class K> static void sort_case(const std::vector<K> &keys, int begin, int end) {
    int n = (int)keys.size();
    std::vector<int> vals((size_t)n), order((size_t)n);
    for (int i = 0; i < n; i++) vals[(size_t)i] = order[(size_t)i] = i;
    auto digit = [&](K k) {
        uint64_t u = 0;
        memcpy(&u, &k, sizeof k);
        if (std::is_signed<K>::value && !std::is_floating_point<K>::value) u ^= (uint64_t)1 << (sizeof(K) * 8 - 1);
        return end - begin >= 64 ? u >> begin : (u >> begin) & (((uint64_t)1 << (end - begin)) - 1);
    };
    if (std::is_floating_point<K>::value && begin == 0 && end == (int)sizeof(K) * 8)
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return keys[(size_t)a] < keys[(size_t)b]; });
    else
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return digit(keys[(size_t)a]) < digit(keys[(size_t)b]); });
    K *kin = to_dev(keys), *kout = dev_alloc<K>((size_t)n);
    int *vin = to_dev(vals), *vout = dev_alloc<int>((size_t)n);
    size_t bytes = 0;
    void *temp = NULL;
    CU(cub::DeviceRadixSort::SortPairs(NULL, bytes, (const K *)NULL, (K *)NULL, (const int *)NULL, (int *)NULL, n, begin, end, 0));
    CU(cudaMalloc(&temp, bytes));
    CU(cub::DeviceRadixSort::SortPairs(temp, bytes, kin, kout, vin, vout, n, begin, end, 0));
    std::vector<int> got = to_host(vout, (size_t)n);
    DSK_TEST_EXPECT(got == order, "radix sort of %d %zu-byte keys on bits [%d, %d) differs from a stable sort", n, sizeof(K), begin, end);
    {
        size_t small = bytes - 1;
        DSK_TEST_EXPECT(cub::DeviceRadixSort::SortPairs(temp, small, kin, kout, vin, vout, n, begin, end, 0) == cudaErrorInvalidValue,
                        "temporary storage smaller than asked for was accepted");
        expect_faults(1, "temporary storage");
    }
    CU(cudaFree(kin));
    CU(cudaFree(kout));
    CU(cudaFree(vin));
    CU(cudaFree(vout));
    CU(cudaFree(temp));
}

static void test_cub_sort(void) {
    std::vector<int32_t> k32(1000);
    std::vector<float> kf(777);
    for (auto &k : k32) k = (int32_t)dsk_test_rand_int(100) - 50;
    for (auto &k : kf) k = (float)dsk_test_rand(-10, 10);
    sort_case(k32, 0, 32);
    sort_case(k32, 0, 4);
    sort_case(k32, 2, 9);
    sort_case(kf, 0, 32);
    sort_case(std::vector<int32_t>(), 0, 32);
    expect_no_faults();
}

/* ---------------------------------------------------------------- NCCL (one process per rank) */

static const ncclDataType_t k_types[] = {ncclInt8, ncclUint8, ncclInt32, ncclUint32, ncclInt64, ncclUint64,
                                         ncclFloat16, ncclFloat32, ncclFloat64, ncclBfloat16, ncclFloat8e4m3, ncclFloat8e5m2};
static size_t nsize(ncclDataType_t t) {
    return t == ncclInt8 || t == ncclUint8 || t == ncclFloat8e4m3 || t == ncclFloat8e5m2 ? 1 : t == ncclFloat16 || t == ncclBfloat16 ? 2
           : t == ncclInt32 || t == ncclUint32 || t == ncclFloat32 ? 4 : 8;
}
/* Exact small integers in every type: rank r's element i of input `tag`. Sums, products and
   averages of these over 2 or 4 ranks are exact in every type, fp8 included. */
static double nval(ncclDataType_t t, int r, size_t i, int tag, int op) {
    uint64_t z = (uint64_t)r * 1000003u + i * 7919u + (uint64_t)tag * 104729u;
    z = (z ^ (z >> 13)) * 0x9E3779B97F4A7C15ull;
    bool is_unsigned = t == ncclUint8 || t == ncclUint32 || t == ncclUint64;
    int span = op == ncclProd || t == ncclFloat8e5m2 ? 2 : 3;
    int v = (int)((z >> 40) % (uint64_t)(2 * span + 1)) - span;
    return is_unsigned ? (double)(v < 0 ? -v : v) : (double)v;
}
static void nput(ncclDataType_t t, void *p, size_t i, double v) {
    switch (t) {
    case ncclInt8: ((int8_t *)p)[i] = (int8_t)v; break;
    case ncclUint8: ((uint8_t *)p)[i] = (uint8_t)v; break;
    case ncclInt32: ((int32_t *)p)[i] = (int32_t)v; break;
    case ncclUint32: ((uint32_t *)p)[i] = (uint32_t)v; break;
    case ncclInt64: ((int64_t *)p)[i] = (int64_t)v; break;
    case ncclUint64: ((uint64_t *)p)[i] = (uint64_t)v; break;
    case ncclFloat16: ((__half *)p)[i] = __float2half((float)v); break;
    case ncclFloat32: ((float *)p)[i] = (float)v; break;
    case ncclFloat64: ((double *)p)[i] = v; break;
    case ncclBfloat16: ((__nv_bfloat16 *)p)[i] = __float2bfloat16((float)v); break;
    case ncclFloat8e4m3: ((uint8_t *)p)[i] = cuda_emu::f32_to_e4m3((float)v); break;
    default: ((uint8_t *)p)[i] = cuda_emu::f32_to_e5m2((float)v); break;
    }
}
static double nfold(double a, double b, ncclRedOp_t op) {
    return op == ncclProd ? a * b : op == ncclMax ? (a > b ? a : b) : op == ncclMin ? (a < b ? a : b) : a + b;
}
static bool nfloat(ncclDataType_t t) { return t >= ncclFloat16; }

struct nccl_rank {
    int rank, n, failures = 0;
    ncclComm_t comm = NULL;
    cudaStream_t s;
};

static void nexpect(nccl_rank &R, bool ok, const char *fmt, ...) {
    if (ok) return;
    va_list ap;
    va_start(ap, fmt);
    printf("rank %d: ", R.rank);
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    R.failures++;
}

static ncclResult_t settle(ncclComm_t c, double seconds) {
    ncclResult_t st = ncclInProgress;
    for (double t0 = dsk_test_now(); st == ncclInProgress && dsk_test_now() - t0 < seconds; usleep(200))
        if (ncclCommGetAsyncError(c, &st) != ncclSuccess) return ncclInternalError;
    return st;
}

/* Runs one call on every rank's inputs of `tag`; checks this rank's bytes against the
   float64 reference built from every rank's inputs. */
static void ncheck(nccl_rank &R, const char *what, ncclDataType_t t, ncclRedOp_t op, size_t count, int tag) {
    int n = R.n, me = R.rank, root = n - 1;
    size_t es = nsize(t), in_n = count, out_n = count;
    bool gather = !strcmp(what, "allgather"), scatter = !strcmp(what, "reducescatter"), bcast = !strcmp(what, "broadcast");
    bool reduce = !strcmp(what, "reduce"), inplace = strstr(what, "inplace") != NULL;
    if (gather) out_n = count * (size_t)n;
    if (scatter) in_n = count * (size_t)n;
    std::vector<char> in(in_n * es), want(out_n * es), got(out_n * es);
    for (size_t i = 0; i < in_n; i++) nput(t, in.data(), i, nval(t, me, i, tag, op));
    for (size_t i = 0; i < out_n; i++) {
        double v;
        if (gather) v = nval(t, (int)(i / count), i % count, tag, op);
        else if (bcast) v = nval(t, 1, i, tag, op);
        else {
            size_t at = scatter ? (size_t)me * count + i : i;
            v = nval(t, 0, at, tag, op);
            for (int r = 1; r < n; r++) v = nfold(v, nval(t, r, at, tag, op), op);
            if (op == ncclAvg) v = nfloat(t) ? v / n : (double)(long long)(v / n);
        }
        nput(t, want.data(), i, v);
    }
    char *din = (char *)to_dev(in), *dout = (char *)dev_alloc<char>(std::max(out_n * es, (size_t)1));
    ncclResult_t r;
    if (inplace) { /* allreduce in place, and allgather from this rank's block of the output */
        CU(cudaMemset(dout, 0, out_n * es));
        CU(cudaMemcpy(gather ? dout + (size_t)me * count * es : dout, in.data(), count * es, cudaMemcpyHostToDevice));
    }
    if (gather) r = ncclAllGather(inplace ? dout + (size_t)me * count * es : din, dout, count, t, R.comm, R.s);
    else if (scatter) r = ncclReduceScatter(din, dout, count, t, op, R.comm, R.s);
    else if (bcast) r = inplace ? ncclBcast(me == 1 ? dout : dout, count, t, 1, R.comm, R.s) : ncclBroadcast(din, dout, count, t, 1, R.comm, R.s);
    else if (reduce) r = ncclReduce(din, dout, count, t, op, root, R.comm, R.s);
    else r = ncclAllReduce(inplace ? dout : din, dout, count, t, op, R.comm, R.s);
    nexpect(R, r == ncclSuccess, "%s type %d op %d: %s", what, (int)t, (int)op, ncclGetErrorString(r));
    CU(cudaStreamSynchronize(R.s));
    CU(cudaMemcpy(got.data(), dout, got.size(), cudaMemcpyDeviceToHost));
    if (!reduce || me == root) {
        if (bcast && inplace && me != 1) { /* broadcast in place: non-root outputs are the root's */
        }
        size_t bad = 0;
        for (size_t i = 0; i < out_n; i++) bad += memcmp(&got[i * es], &want[i * es], es) != 0;
        nexpect(R, bad == 0, "%s type %d op %d count %zu: %zu of %zu elements differ from the reference", what, (int)t, (int)op, count, bad, out_n);
    }
    CU(cudaFree(din));
    CU(cudaFree(dout));
}

static int nccl_child(int rank, int n, const char *idhex, const char *scenario) {
    nccl_rank R;
    ncclUniqueId id;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    int ndev = 0;
    R.rank = rank;
    R.n = n;
    memset(&id, 0, sizeof id);
    for (size_t i = 0; i < sizeof id.internal && idhex[2 * i]; i++) {
        unsigned b;
        sscanf(idhex + 2 * i, "%2x", &b);
        id.internal[i] = (char)b;
    }
    cudaGetDeviceCount(&ndev);
    cudaSetDevice(rank % ndev);
    cudaStreamCreateWithFlags(&R.s, cudaStreamNonBlocking);
    cfg.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&R.comm, n, id, rank, &cfg);
    nexpect(R, r == ncclSuccess || r == ncclInProgress, "init: %s", ncclGetErrorString(r));
    nexpect(R, settle(R.comm, 30) == ncclSuccess, "init did not settle: %s", ncclGetLastError(R.comm));
    if (R.failures) return R.failures;
    if (!strcmp(scenario, "all")) {
        int tag = 1, cnt = 0, rk = -1;
        ncclCommCount(R.comm, &cnt);
        ncclCommUserRank(R.comm, &rk);
        nexpect(R, cnt == n && rk == rank, "count %d rank %d", cnt, rk);
        for (ncclDataType_t t : k_types)
            for (int op = 0; op < ncclNumOps; op++) ncheck(R, "allreduce", t, (ncclRedOp_t)op, 301, tag++);
        for (ncclDataType_t t : {ncclFloat32, ncclFloat64, ncclBfloat16, ncclInt64}) {
            ncheck(R, "allreduce-inplace", t, ncclSum, 70001, tag++);
            ncheck(R, "reduce", t, ncclMax, 129, tag++);
            ncheck(R, "broadcast", t, ncclSum, 7, tag++);
            ncheck(R, "reducescatter", t, ncclSum, 333, tag++);
            ncheck(R, "reducescatter", t, ncclMin, 1, tag++);
            ncheck(R, "allgather", t, ncclSum, 777, tag++);
            ncheck(R, "allgather-inplace", t, ncclSum, 5, tag++);
        }
        { /* a group: a ring of sends and receives, a self send, and an all-reduce */
            size_t c = 4099;
            std::vector<float> mine(c), fromprev(c), self(c);
            for (size_t i = 0; i < c; i++) mine[i] = (float)(rank * 10000 + (int)i);
            float *dm = to_dev(mine), *dp = dev_alloc<float>(c), *ds = dev_alloc<float>(c), *da = to_dev(mine);
            ncclGroupStart();
            ncclSend(dm, c, ncclFloat32, (rank + 1) % n, R.comm, R.s);
            ncclRecv(dp, c, ncclFloat32, (rank + n - 1) % n, R.comm, R.s);
            ncclSend(dm, c, ncclFloat32, rank, R.comm, R.s);
            ncclRecv(ds, c, ncclFloat32, rank, R.comm, R.s);
            ncclAllReduce(da, da, c, ncclFloat32, ncclMax, R.comm, R.s);
            r = ncclGroupEnd();
            nexpect(R, r == ncclSuccess, "group: %s", ncclGetErrorString(r));
            CU(cudaStreamSynchronize(R.s));
            std::vector<float> p = to_host(dp, c), sf = to_host(ds, c), a = to_host(da, c);
            int bad = 0;
            for (size_t i = 0; i < c; i++)
                bad += p[i] != (float)(((rank + n - 1) % n) * 10000 + (int)i) || sf[i] != mine[i] || a[i] != (float)((n - 1) * 10000 + (int)i);
            nexpect(R, bad == 0, "group of send/recv and all-reduce: %d elements wrong", bad);
            CU(cudaFree(dm));
            CU(cudaFree(dp));
            CU(cudaFree(ds));
            CU(cudaFree(da));
        }
        { /* an all-reduce captured in a graph with the copy feeding it: nothing runs at capture, and each
             launch reduces the inputs of its own time (the collective's order is taken at launch) */
            size_t c = 1031;
            float *src = dev_alloc<float>(c), *d = dev_alloc<float>(c);
            cudaGraph_t g = NULL;
            cudaGraphExec_t ge = NULL;
            std::vector<float> poison(c, -7.0f);
            CU(cudaMemcpy(d, poison.data(), c * sizeof(float), cudaMemcpyHostToDevice));
            CU(cudaStreamBeginCapture(R.s, cudaStreamCaptureModeGlobal));
            CU(cudaMemcpyAsync(d, src, c * sizeof(float), cudaMemcpyDeviceToDevice, R.s));
            r = ncclAllReduce(d, d, c, ncclFloat32, ncclSum, R.comm, R.s);
            nexpect(R, r == ncclSuccess, "all-reduce in a capture: %s", ncclGetErrorString(r));
            CU(cudaStreamEndCapture(R.s, &g));
            nexpect(R, to_host(d, c)[0] == -7.0f, "the captured all-reduce ran during the capture");
            CU(cudaGraphInstantiate(&ge, g, 0));
            for (int l = 0; l < 3; l++) {
                std::vector<float> in(c);
                for (size_t i = 0; i < c; i++) in[i] = (float)nval(ncclFloat32, rank, i, tag + l, ncclSum);
                CU(cudaMemcpy(src, in.data(), c * sizeof(float), cudaMemcpyHostToDevice));
                CU(cudaGraphLaunch(ge, R.s));
                CU(cudaStreamSynchronize(R.s));
                std::vector<float> got = to_host(d, c);
                int bad = 0;
                for (size_t i = 0; i < c; i++) {
                    double want = 0;
                    for (int q = 0; q < n; q++) want += nval(ncclFloat32, q, i, tag + l, ncclSum);
                    bad += got[i] != (float)want;
                }
                nexpect(R, bad == 0, "launch %d of a captured all-reduce: %d of %zu elements wrong", l, bad, c);
            }
            tag += 3;
            CU(cudaGraphExecDestroy(ge));
            CU(cudaGraphDestroy(g));
            CU(cudaFree(src));
            CU(cudaFree(d));
        }
        { /* split by parity, ranks reversed */
            ncclComm_t sub = NULL;
            ncclConfig_t sc = NCCL_CONFIG_INITIALIZER;
            sc.blocking = 0;
            r = ncclCommSplit(R.comm, rank % 2, -rank, &sub, &sc);
            nexpect(R, r == ncclSuccess || r == ncclInProgress, "split: %s", ncclGetErrorString(r));
            nexpect(R, settle(R.comm, 30) == ncclSuccess && sub != NULL, "split did not settle");
            if (sub) {
                int cnt = 0, rk = -1, members = (n + 1 - rank % 2) / 2, higher = 0;
                ncclCommCount(sub, &cnt);
                ncclCommUserRank(sub, &rk);
                for (int q = rank + 2; q < n; q += 2) higher++;
                nexpect(R, cnt == members && rk == higher, "sub-communicator: rank %d of %d, want %d of %d", rk, cnt, higher, members);
                double *d = dev_alloc<double>(3), v[3] = {(double)rank, 1.0, -0.5 * rank};
                CU(cudaMemcpy(d, v, sizeof v, cudaMemcpyHostToDevice));
                r = ncclAllReduce(d, d, 3, ncclFloat64, ncclSum, sub, R.s);
                CU(cudaStreamSynchronize(R.s));
                std::vector<double> got = to_host(d, 3);
                double sum = 0;
                for (int q = rank % 2; q < n; q += 2) sum += q;
                nexpect(R, r == ncclSuccess && got[0] == sum && got[1] == members && got[2] == -0.5 * sum, "f64 all-reduce on the sub-communicator");
                ncclCommDestroy(sub);
                CU(cudaFree(d));
            }
        }
    } else if (!strcmp(scenario, "abort") || !strcmp(scenario, "die") || !strcmp(scenario, "mismatch")) {
        float *d = dev_alloc<float>(64);
        CU(cudaMemset(d, 0, 256));
        if (rank == 1 && !strcmp(scenario, "abort")) {
            ncclCommAbort(R.comm);
            return R.failures;
        }
        if (rank == 1 && !strcmp(scenario, "die")) _exit(0);
        size_t count = !strcmp(scenario, "mismatch") ? (size_t)(10 + rank) : 64;
        r = ncclAllReduce(d, d, count, ncclFloat32, ncclSum, R.comm, R.s);
        nexpect(R, r == ncclSuccess, "enqueue: %s", ncclGetErrorString(r));
        ncclResult_t st = ncclSuccess;
        for (double t0 = dsk_test_now(); st == ncclSuccess && dsk_test_now() - t0 < 20; usleep(1000)) ncclCommGetAsyncError(R.comm, &st);
        ncclResult_t want = !strcmp(scenario, "mismatch") ? ncclInvalidUsage : ncclRemoteError;
        nexpect(R, st == want, "%s: async error %s (%s), want %s", scenario, ncclGetErrorString(st), ncclGetLastError(R.comm),
                ncclGetErrorString(want));
        ncclCommAbort(R.comm);
        CU(cudaStreamSynchronize(R.s));
        return R.failures;
    }
    ncclCommDestroy(R.comm);
    cudaStreamDestroy(R.s);
    return R.failures;
}

/* Starts n ranks of this program and returns how many failed. */
static int run_ranks(int n, const char *scenario) {
    ncclUniqueId id;
    char hex[2 * sizeof id.internal + 1], rs[16], ns[16];
    std::vector<pid_t> pids;
    int bad = 0;
    DSK_TEST_EXPECT(ncclGetUniqueId(&id) == ncclSuccess, "ncclGetUniqueId");
    for (size_t i = 0; i < sizeof id.internal; i++) snprintf(hex + 2 * i, 3, "%02x", (unsigned char)id.internal[i]);
    fflush(stdout);
    for (int r = 0; r < n; r++) {
        snprintf(rs, sizeof rs, "%d", r);
        snprintf(ns, sizeof ns, "%d", n);
        pid_t pid = fork();
        if (pid == 0) {
            execl(g_self, g_self, "--nccl", rs, ns, hex, scenario, (char *)NULL);
            _exit(127);
        }
        pids.push_back(pid);
    }
    for (pid_t p : pids) {
        int st = 0;
        waitpid(p, &st, 0);
        bad += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    return bad;
}

static void test_nccl(int n) { DSK_TEST_EXPECT(run_ranks(n, "all") == 0, "ranks failed (their lines above say what)"); }
static void test_nccl_faults(void) {
    DSK_TEST_EXPECT(run_ranks(2, "abort") == 0, "a peer's abort was not reported as ncclRemoteError");
    DSK_TEST_EXPECT(run_ranks(2, "die") == 0, "a peer that died was not reported as ncclRemoteError");
    DSK_TEST_EXPECT(run_ranks(2, "mismatch") == 0, "mismatched counts were not reported as ncclInvalidUsage");
}

/* ---------------------------------------------------------------- main */

int main(int argc, char **argv) {
    ssize_t k = readlink("/proc/self/exe", g_self, sizeof g_self - 1);
    g_self[k > 0 ? k : 0] = 0;
    if (argc == 3 && !strcmp(argv[1], "--child")) return child_main(argv[2]);
    if (argc == 6 && !strcmp(argv[1], "--nccl")) return nccl_child(atoi(argv[2]), atoi(argv[3]), argv[4], argv[5]) ? 1 : 0;
    dsk_test_init("test_cuda_emu");
    DSK_TEST_RUN(test_coordinates);
    DSK_TEST_RUN(test_barriers);
    DSK_TEST_RUN(test_warp_intrinsics);
    DSK_TEST_RUN(test_warp_misuse);
    DSK_TEST_RUN(test_atomics_and_shared);
    DSK_TEST_RUN(test_launch_checks);
    DSK_TEST_RUN(test_oob_write_caught);
    DSK_TEST_RUN(test_host_deref_caught);
    DSK_TEST_RUN(test_copies);
    DSK_TEST_RUN(test_streams_events);
    DSK_TEST_RUN(test_graphs);
    DSK_TEST_RUN(test_cublas);
    DSK_TEST_RUN(test_cub_sort);
    dsk_test_begin("nccl over 2 ranks: every collective, type and reduction; group; split");
    test_nccl(2);
    dsk_test_begin("nccl over 4 ranks: every collective, type and reduction; group; split");
    test_nccl(4);
    DSK_TEST_RUN(test_nccl_faults);
    return dsk_test_finish();
}
