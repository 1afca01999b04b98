/* mma.h - the warp matrix functions (nvcuda::wmma) for the CPU emulation in tests/cuda_emu.

   The m16n16k16 shape with __half or __nv_bfloat16 inputs and a float accumulator: fragment,
   fill_fragment, load_matrix_sync, store_matrix_sync, mma_sync. As on a GPU, a fragment is a
   warp's matrix spread over its 32 lanes: each lane's fragment object holds num_elements = 8
   of the 256 elements, and which lane holds which element is left unspecified by CUDA; here it
   is a permutation drawn from CUDA_EMU_SEED, so a kernel that assumes some layout for x[]
   fails in the emulator (elementwise work on x[] that treats every element alike is fine).
   load, store and mma are warp-collective (tests/cuda_emu/wmma.cpp): every lane of the warp
   must call the same function at the same place with the same pointer, leading dimension and
   layout (a fault names the lane that differs); pointers must be 256-bit aligned and ldm a
   multiple of 16 bytes, as CUDA requires. mma_sync multiplies in float (products of 16-bit
   inputs are exact) and adds in k order onto c, and returns only when every lane has read the
   others' fragments, so a lane cannot overwrite its a or b while another still reads them.
   As on a GPU, a lane that reads what another lane stored needs a __syncwarp() in between. */
#ifndef CUDA_EMU_MMA_H
#define CUDA_EMU_MMA_H

#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "cuda_runtime.h"

namespace cuda_emu {
namespace wmma_impl {

enum op_kind { OP_LOAD_A, OP_LOAD_B, OP_LOAD_C, OP_STORE, OP_MMA };
/* What one lane passes to a collective operation. */
struct lane_args {
    int op;
    const void *ptr;          /* memory of a load or store */
    unsigned ldm;             /* its leading dimension in elements */
    int layout;               /* 0 row major, 1 column major */
    const void *frag[3];      /* mma: the lane's a, b and c fragments (their element arrays) */
};
/* The calling lane publishes `mine`, waits for all 32 lanes of its warp at the caller's site
   (a fault otherwise), checks that every lane passed what lane 0 did, and returns the warp's
   table of 32 entries (valid until the lane's next collective call). */
const lane_args *collective(const lane_args &mine, const char *name, size_t elem_bytes, const char *file, int line);
/* Waits for the warp again (the end of an mma: every lane has read the others' fragments). */
void collective_end(const char *name, const char *file, int line);
/* Lane of the calling thread in its warp. */
int lane();
/* The fragments' layout as tables (read once per call: an mma looks up 256 entries):
   element_indices()[lane * 8 + e] is the matrix position (row * 16 + col) of element e of
   lane's fragment, element_owners()[position] is lane * 8 + e back. */
const int16_t *element_indices();
const int16_t *element_owners();

inline float to_f32(float x) { return x; }
inline float to_f32(__half x) { return __half2float(x); }
inline float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

} // namespace wmma_impl
} // namespace cuda_emu

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void> struct fragment {
    static_assert(M == 16 && N == 16 && K == 16, "the emulation has the m16n16k16 shape");
    typedef T element_type;
    typedef T storage_element_type;
    enum { num_elements = 8 };
    T x[8];
};

template <class Use, int M, int N, int K, class T, class L, class V> inline void fill_fragment(fragment<Use, M, N, K, T, L> &f, const V &v) {
    for (int e = 0; e < 8; e++) f.x[e] = (T)v;
}
template <class Use, int M, int N, int K, class L, class V> inline void fill_fragment(fragment<Use, M, N, K, __half, L> &f, const V &v) {
    for (int e = 0; e < 8; e++) f.x[e] = __float2half((float)v);
}
template <class Use, int M, int N, int K, class L, class V>
inline void fill_fragment(fragment<Use, M, N, K, __nv_bfloat16, L> &f, const V &v) {
    for (int e = 0; e < 8; e++) f.x[e] = __float2bfloat16((float)v);
}

namespace detail {
template <class L> struct layout_code;
template <> struct layout_code<row_major> { enum { value = 0 }; };
template <> struct layout_code<col_major> { enum { value = 1 }; };

/* Element (r, c) of the 16 x 16 tile at p: row major p[r * ldm + c], column major p[c * ldm + r]. */
template <class T> inline T &at(T *p, unsigned ldm, int layout, int r, int c) {
    return layout == 0 ? p[(size_t)r * ldm + c] : p[(size_t)c * ldm + r];
}
template <class F, class T> inline void load(F &f, const T *p, unsigned ldm, int layout, int op, const char *name, const char *file, int line) {
    cuda_emu::wmma_impl::lane_args a = {op, p, ldm, layout, {nullptr, nullptr, nullptr}};
    int lane = cuda_emu::wmma_impl::lane();
    const int16_t *index = cuda_emu::wmma_impl::element_indices() + lane * 8;
    cuda_emu::wmma_impl::collective(a, name, sizeof(T), file, line);
    for (int e = 0; e < 8; e++) {
        int idx = index[e];
        f.x[e] = at(p, ldm, layout, idx / 16, idx % 16);
    }
}
} // namespace detail

/* matrix_a (m x k) and matrix_b (k x n) in their fragment's layout. */
template <class Use, class T, class L>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, L> &f, const T *p, unsigned ldm, CUDA_EMU_SITE) {
    detail::load(f, p, ldm, detail::layout_code<L>::value, std::is_same<Use, matrix_a>::value ? 0 : 1, "wmma::load_matrix_sync", CUDA_EMU_AT);
}
/* The accumulator (m x n) in the layout given. */
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float> &f, const float *p, unsigned ldm, layout_t layout, CUDA_EMU_SITE) {
    detail::load(f, p, ldm, layout == mem_row_major ? 0 : 1, cuda_emu::wmma_impl::OP_LOAD_C, "wmma::load_matrix_sync", CUDA_EMU_AT);
}
inline void store_matrix_sync(float *p, const fragment<accumulator, 16, 16, 16, float> &f, unsigned ldm, layout_t layout, CUDA_EMU_SITE) {
    int lo = layout == mem_row_major ? 0 : 1, lane = cuda_emu::wmma_impl::lane();
    cuda_emu::wmma_impl::lane_args a = {cuda_emu::wmma_impl::OP_STORE, p, ldm, lo, {nullptr, nullptr, nullptr}};
    const int16_t *index = cuda_emu::wmma_impl::element_indices() + lane * 8;
    cuda_emu::wmma_impl::collective(a, "wmma::store_matrix_sync", sizeof(float), CUDA_EMU_AT);
    for (int e = 0; e < 8; e++) {
        int idx = index[e];
        detail::at(p, ldm, lo, idx / 16, idx % 16) = f.x[e];
    }
}

/* d = a b + c over the warp; d may be c. */
template <class T, class La, class Lb>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float> &d, const fragment<matrix_a, 16, 16, 16, T, La> &a,
                     const fragment<matrix_b, 16, 16, 16, T, Lb> &b, const fragment<accumulator, 16, 16, 16, float> &c, bool satf = false,
                     CUDA_EMU_SITE) {
    using namespace cuda_emu::wmma_impl;
    lane_args mine = {OP_MMA, nullptr, 0, 0, {a.x, b.x, c.x}};
    int lane = cuda_emu::wmma_impl::lane();
    float out[8];
    const lane_args *all = collective(mine, "wmma::mma_sync", sizeof(T), CUDA_EMU_AT);
    (void)satf;
    const int16_t *index = element_indices() + lane * 8, *owner = element_owners();
    for (int e = 0; e < 8; e++) {
        int idx = index[e], r = idx / 16, col = idx % 16;
        float s = c.x[e];
        for (int k = 0; k < 16; k++) {
            int ia = owner[r * 16 + k], ib = owner[k * 16 + col];
            const T *fa = (const T *)all[ia / 8].frag[0], *fb = (const T *)all[ib / 8].frag[1];
            s += to_f32(fa[ia % 8]) * to_f32(fb[ib % 8]);
        }
        out[e] = s;
    }
    collective_end("wmma::mma_sync", CUDA_EMU_AT);
    for (int e = 0; e < 8; e++) d.x[e] = out[e];
}

} // namespace wmma
} // namespace nvcuda

#endif /* CUDA_EMU_MMA_H */
