/* mma.h - the warp matrix functions of CUDA (nvcuda::wmma) for the CPU emulation in
   tests/cuda_emu, the pieces dsk's kernels use: m16n16k16 fragments of half or bfloat16
   matrices (row- or column-major) and float accumulators; fill_fragment, load_matrix_sync,
   mma_sync, store_matrix_sync.

   Model: every lane of the warp holds the whole tile in its fragment (the hardware spreads a
   tile over the lanes in an order it does not document, so code that reads fragment.x[i] by
   lane is not portable and is not modelled: x holds the tile row-major, num_elements its
   size). Each operation is warp-collective: it begins with __syncwarp(), so a warp that calls
   it divergently is a fault, as on the hardware. mma_sync multiplies exactly (a product of two
   16-bit floats fits a float) and sums over k in increasing order with single roundings; the
   tensor cores' internal order and rounding differ in the last bits, which the dsk tests
   allow for as they do for cuBLAS. Loads and stores check the 256-bit alignment CUDA
   requires and ldm (a multiple of 8 for 16-bit elements, of 4 for float). */
#ifndef CUDA_EMU_MMA_H
#define CUDA_EMU_MMA_H

#include <stdint.h>
#include "cuda_bf16.h"
#include "cuda_fp16.h"

namespace cuda_emu {
void fault(const char *fmt, ...);
}

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

namespace detail {
template <class Use, int M, int N, int K> struct dims;
template <int M, int N, int K> struct dims<matrix_a, M, N, K> { enum { rows = M, cols = K }; };
template <int M, int N, int K> struct dims<matrix_b, M, N, K> { enum { rows = K, cols = N }; };
template <int M, int N, int K> struct dims<accumulator, M, N, K> { enum { rows = M, cols = N }; };
inline float to_float(__half h) { return __half2float(h); }
inline float to_float(__nv_bfloat16 h) { return __bfloat162float(h); }
inline float to_float(float f) { return f; }
inline void check(const void *p, unsigned ldm, unsigned elem, const char *what) {
    if ((uintptr_t)p % 32 != 0) cuda_emu::fault("wmma::%s: pointer %p is not 256-bit aligned", what, p);
    if (ldm % (16 / elem) != 0) cuda_emu::fault("wmma::%s: ldm %u is not a multiple of %u", what, ldm, 16 / elem);
}
} // namespace detail

template <class Use, int M, int N, int K, class T, class Layout = void> struct fragment {
    static_assert(M == 16 && N == 16 && K == 16, "the emulation models m16n16k16 only");
    enum { rows = detail::dims<Use, M, N, K>::rows, cols = detail::dims<Use, M, N, K>::cols, num_elements = rows * cols };
    T x[num_elements]; /* the whole tile, row-major, in every lane */
};

template <class Use, int M, int N, int K, class T, class L> inline void fill_fragment(fragment<Use, M, N, K, T, L> &f, T v) {
    __syncwarp();
    for (int i = 0; i < f.num_elements; i++) f.x[i] = v;
}

/* A or B tile from memory laid out as the fragment's Layout says. */
template <class Use, int M, int N, int K, class T, class L>
inline void load_matrix_sync(fragment<Use, M, N, K, T, L> &f, const T *p, unsigned ldm) {
    const bool row = std::is_same<L, row_major>::value;
    __syncwarp();
    detail::check(p, ldm, sizeof(T), "load_matrix_sync");
    for (int r = 0; r < f.rows; r++)
        for (int c = 0; c < f.cols; c++) f.x[r * f.cols + c] = row ? p[(size_t)r * ldm + c] : p[(size_t)c * ldm + r];
}

/* An accumulator tile from memory in layout l. */
template <int M, int N, int K>
inline void load_matrix_sync(fragment<accumulator, M, N, K, float> &f, const float *p, unsigned ldm, layout_t l) {
    __syncwarp();
    detail::check(p, ldm, sizeof(float), "load_matrix_sync");
    for (int r = 0; r < M; r++)
        for (int c = 0; c < N; c++) f.x[r * N + c] = l == mem_row_major ? p[(size_t)r * ldm + c] : p[(size_t)c * ldm + r];
}

template <int M, int N, int K>
inline void store_matrix_sync(float *p, const fragment<accumulator, M, N, K, float> &f, unsigned ldm, layout_t l) {
    __syncwarp();
    detail::check(p, ldm, sizeof(float), "store_matrix_sync");
    for (int r = 0; r < M; r++)
        for (int c = 0; c < N; c++) {
            if (l == mem_row_major) p[(size_t)r * ldm + c] = f.x[r * N + c];
            else p[(size_t)c * ldm + r] = f.x[r * N + c];
        }
}

/* d = a b + c (d may be c). */
template <int M, int N, int K, class T, class LA, class LB>
inline void mma_sync(fragment<accumulator, M, N, K, float> &d, const fragment<matrix_a, M, N, K, T, LA> &a,
                     const fragment<matrix_b, M, N, K, T, LB> &b, const fragment<accumulator, M, N, K, float> &c) {
    float out[M * N];
    __syncwarp();
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            float acc = c.x[i * N + j];
            for (int k = 0; k < K; k++) acc += detail::to_float(a.x[i * K + k]) * detail::to_float(b.x[k * N + j]);
            out[i * N + j] = acc;
        }
    for (int i = 0; i < M * N; i++) d.x[i] = out[i];
}

} // namespace wmma
} // namespace nvcuda

#endif /* CUDA_EMU_MMA_H */
