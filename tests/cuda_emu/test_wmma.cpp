/* test_wmma.cpp - the emulated warp matrix functions (tests/cuda_emu/include/mma.h, wmma.cpp)
   on their own: products of bf16 and f16 tiles in every layout against float64, chained
   k-blocks and an accumulator loaded and stored in both layouts, the fragment layout being a
   permutation that a kernel can only see through load and store, and the misuses the emulator
   must report (arguments that differ between lanes, a misaligned pointer, a leading dimension
   that is not a multiple of 16 bytes, a partial warp). Also cudaFuncSetAttribute's opt-in for
   more than 48 KiB of dynamic shared memory. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <vector>

#include "../dsk_test.h"

#define LAUNCH(kernel, grid, block, shmem, ...) cuda_emu_launch(#kernel, kernel, dim3 grid, dim3 block, shmem, (cudaStream_t)0, __VA_ARGS__)
#define CU(call) DSK_TEST_EXPECT((call) == cudaSuccess, "%s", cudaGetErrorString(cudaGetLastError()))

using namespace nvcuda;

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

template <class T> static T *dev_copy(const std::vector<T> &h) {
    void *p = NULL;
    CU(cudaMalloc(&p, h.size() * sizeof(T) + 1));
    CU(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    return (T *)p;
}
template <class T> static std::vector<T> host_copy(const T *d, size_t n) {
    std::vector<T> h(n);
    CU(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
}

static float to_f(__half x) { return __half2float(x); }
static float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T> static T from_f(float x);
template <> __half from_f<__half>(float x) { return __float2half(x); }
template <> __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

/* ---------------------------------------------------------------- products */

/* C (M x N) = A (M x K) B (K x N) + C0 by one warp per 16 x 16 tile of C, k in 16-blocks.
   A is row or column major (lda), B likewise; C0 and C use c_layout. */
template <class T, class LA, class LB>
__global__ void k_gemm(const T *A, int lda, const T *B, int ldb, float *C, int ldc, int c_col, int K) {
    int tile = (int)threadIdx.x / 32, m0 = tile / 2 * 16, n0 = tile % 2 * 16; /* a 32 x 32 C, four warps */
    bool a_col = std::is_same<LA, wmma::col_major>::value, b_col = std::is_same<LB, wmma::col_major>::value;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, LA> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LB> b;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::layout_t cl = c_col ? wmma::mem_col_major : wmma::mem_row_major;
    float *ct = C + (c_col ? (size_t)n0 * ldc + m0 : (size_t)m0 * ldc + n0);
    wmma::load_matrix_sync(acc, ct, (unsigned)ldc, cl);
    for (int k = 0; k < K; k += 16) {
        wmma::load_matrix_sync(a, A + (a_col ? (size_t)k * lda + m0 : (size_t)m0 * lda + k), (unsigned)lda);
        wmma::load_matrix_sync(b, B + (b_col ? (size_t)n0 * ldb + k : (size_t)k * ldb + n0), (unsigned)ldb);
        wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(ct, acc, (unsigned)ldc, cl);
}

template <class T, class LA, class LB> static void test_gemm(int c_col) {
    const int M = 32, N = 32, K = 48, lda = 56, ldb = 40, ldc = 36; /* padded leading dims */
    bool a_col = std::is_same<LA, wmma::col_major>::value, b_col = std::is_same<LB, wmma::col_major>::value;
    std::vector<T> A((size_t)lda * 64), B((size_t)ldb * 64);
    std::vector<float> C((size_t)ldc * 32);
    std::vector<double> want((size_t)M * N);
    for (auto &x : A) x = from_f<T>((float)dsk_test_rand(-2, 2));
    for (auto &x : B) x = from_f<T>((float)dsk_test_rand(-2, 2));
    for (auto &x : C) x = (float)dsk_test_rand(-1, 1);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double s = C[c_col ? (size_t)n * ldc + m : (size_t)m * ldc + n];
            for (int k = 0; k < K; k++)
                s += (double)to_f(A[a_col ? (size_t)k * lda + m : (size_t)m * lda + k]) * to_f(B[b_col ? (size_t)n * ldb + k : (size_t)k * ldb + n]);
            want[(size_t)m * N + n] = s;
        }
    T *dA = dev_copy(A), *dB = dev_copy(B);
    float *dC = dev_copy(C);
    LAUNCH((k_gemm<T, LA, LB>), (1), (128), 0, dA, lda, dB, ldb, dC, ldc, c_col, K);
    CU(cudaDeviceSynchronize());
    std::vector<float> got = host_copy(dC, C.size()), g((size_t)M * N);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) g[(size_t)m * N + n] = got[c_col ? (size_t)n * ldc + m : (size_t)m * ldc + n];
    DSK_TEST_CLOSE(g.data(), want.data(), M * N, 1e-6, 1e-5, "warp GEMM vs float64");
    for (int r = 0; r < (c_col ? 32 : 32); r++) /* the padding of C is untouched */
        for (int c = 32; c < ldc; c++) DSK_TEST_EXPECT(got[(size_t)r * ldc + c] == C[(size_t)r * ldc + c], "padding (%d, %d) written", r, c);
    expect_no_faults();
    cudaFree(dA);
    cudaFree(dB);
    cudaFree(dC);
}

/* ---------------------------------------------------------------- the fragment layout */

/* Loads a tile whose element (r, c) is r * 16 + c and writes each lane's x[] out: lane l,
   element e holds the index of the position it got. */
__global__ void k_layout(const float *idx, float *out) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    int lane = (int)threadIdx.x;
    wmma::load_matrix_sync(acc, idx, 16, wmma::mem_row_major);
    for (int e = 0; e < acc.num_elements; e++) out[lane * acc.num_elements + e] = acc.x[e];
    for (int e = 0; e < acc.num_elements; e++) acc.x[e] *= 2.0f; /* elementwise work treats all alike */
    wmma::store_matrix_sync(out + 256, acc, 16, wmma::mem_row_major);
}

static void test_layout(void) {
    std::vector<float> idx(256);
    for (int i = 0; i < 256; i++) idx[i] = (float)i;
    float *d = dev_copy(idx), *out = dev_copy(std::vector<float>(512, -1.0f));
    LAUNCH(k_layout, (1), (32), 0, d, out);
    CU(cudaDeviceSynchronize());
    std::vector<float> h = host_copy(out, 512);
    std::vector<int> seen(256, 0);
    int in_order = 1;
    for (int i = 0; i < 256; i++) {
        int v = (int)h[i];
        if (v >= 0 && v < 256) seen[v]++;
        in_order &= v == i;
        DSK_TEST_EXPECT(h[256 + i] == 2.0f * (float)i, "doubled tile [%d] = %g", i, (double)h[256 + i]);
    }
    for (int i = 0; i < 256; i++) DSK_TEST_EXPECT(seen[i] == 1, "position %d held %d times", i, seen[i]);
    DSK_TEST_EXPECT(!in_order, "the layout is a permutation other than the identity");
    expect_no_faults();
    cudaFree(d);
    cudaFree(out);
}

/* ---------------------------------------------------------------- misuses */

/* mode 0: lane-dependent pointer; 1: misaligned pointer; 2: ldm of 12 bytes; 3: half the warp;
   4: a correct call (for a block that has no full warp). */
__global__ void k_misuse(const __half *p, int mode) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
    int lane = (int)threadIdx.x % 32;
    if (mode == 0) wmma::load_matrix_sync(a, p + (lane == 5 ? 16 : 0), 16);
    if (mode == 1) wmma::load_matrix_sync(a, p + 8, 16);
    if (mode == 2) wmma::load_matrix_sync(a, p, 6);
    if (mode == 3 && lane < 16) wmma::load_matrix_sync(a, p, 16);
    if (mode == 4) wmma::load_matrix_sync(a, p, 16);
}

static void test_misuse(void) {
    __half *p = dev_copy(std::vector<__half>(1024, __float2half(1.0f)));
    LAUNCH(k_misuse, (1), (32), 0, p, 0);
    cudaDeviceSynchronize();
    (void)cudaGetLastError();
    expect_faults(1, "must be the same for the whole warp");
    LAUNCH(k_misuse, (1), (32), 0, p, 1);
    cudaDeviceSynchronize();
    (void)cudaGetLastError();
    expect_faults(1, "is not 256-bit aligned");
    LAUNCH(k_misuse, (1), (32), 0, p, 2);
    cudaDeviceSynchronize();
    (void)cudaGetLastError();
    expect_faults(1, "ldm 6 is not a multiple of 16 bytes");
    LAUNCH(k_misuse, (1), (32), 0, p, 3);
    cudaDeviceSynchronize();
    (void)cudaGetLastError();
    expect_faults(1, "exits while lanes");
    LAUNCH(k_misuse, (1), (16), 0, p, 4); /* a 16-thread block has no full warp */
    cudaDeviceSynchronize();
    (void)cudaGetLastError();
    expect_faults(1, "names lanes beyond the block's 16 threads");
    cudaFree(p);
}

/* ---------------------------------------------------------------- dynamic shared memory opt-in */

__global__ void k_big_shared(float *out, int n) {
    CUDA_EMU_DYNAMIC_SHARED(float, sh);
    for (int i = (int)threadIdx.x; i < n; i += (int)blockDim.x) sh[i] = (float)i;
    __syncthreads();
    if (threadIdx.x == 0) out[0] = sh[n - 1];
}

static void test_shared_optin(void) {
    const int n = 64 * 1024 / 4;
    float *out = dev_copy(std::vector<float>(1, 0.0f));
    LAUNCH(k_big_shared, (1), (64), (size_t)n * 4, out, n);
    DSK_TEST_EXPECT(cudaGetLastError() == cudaErrorInvalidValue, "64 KiB without the opt-in must fail");
    CU(cudaFuncSetAttribute(k_big_shared, cudaFuncAttributeMaxDynamicSharedMemorySize, n * 4));
    LAUNCH(k_big_shared, (1), (64), (size_t)n * 4, out, n);
    CU(cudaGetLastError());
    CU(cudaDeviceSynchronize());
    DSK_TEST_EXPECT(host_copy(out, 1)[0] == (float)(n - 1), "kernel with 64 KiB of dynamic shared memory ran");
    DSK_TEST_EXPECT(cudaFuncSetAttribute(k_big_shared, cudaFuncAttributeMaxDynamicSharedMemorySize, 228 * 1024) == cudaErrorInvalidValue,
                    "228 KiB is beyond the device");
    (void)cudaGetLastError();
    expect_no_faults();
    cudaFree(out);
}

int main(void) {
    dsk_test_init("test_wmma");
    dsk_test_begin("bf16 warp GEMM, A row / B row, C row major"); test_gemm<__nv_bfloat16, wmma::row_major, wmma::row_major>(0);
    dsk_test_begin("bf16 warp GEMM, A row / B column, C column major"); test_gemm<__nv_bfloat16, wmma::row_major, wmma::col_major>(1);
    dsk_test_begin("f16 warp GEMM, A column / B row, C row major"); test_gemm<__half, wmma::col_major, wmma::row_major>(0);
    dsk_test_begin("f16 warp GEMM, A column / B column, C column major"); test_gemm<__half, wmma::col_major, wmma::col_major>(1);
    dsk_test_begin("fragment layout: a permutation seen only through load and store"); test_layout();
    dsk_test_begin("misuses: lane-dependent pointer, misalignment, ldm, partial warps"); test_misuse();
    dsk_test_begin("cudaFuncSetAttribute: dynamic shared memory beyond 48 KiB"); test_shared_optin();
    return dsk_test_finish();
}
