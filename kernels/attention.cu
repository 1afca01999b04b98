/* kernels/attention.cu - the CUDA path of dsk_attention_fused / dsk_attention_fused_backward
   (dsk_tensor.h): causal attention that never forms the T x T matrix (FlashAttention-2).

   Contents
     layout      dsk__fa_args (what every kernel gets), the shared-memory plan of each kernel
     products    dsk__fa_mma: C (16 x N, f32) (+)= A (16 x K) op(B) by one warp, on tensor cores
                 (WMMA m16n16k16, f32 accumulation) for bf16/f16, on CUDA cores for f32
     kernels     forward (a block per query tile; online softmax; out and lse), D = rowsum(dout
                 * out), keys (a block per key tile: dk, dv over the query tiles after it),
                 queries (a block per query tile: dq over the key tiles up to it)
     launchers   tile sizes chosen to fit the device's shared memory, the opt-in for more than
                 48 KiB, the three dtypes

   Each block has 16 rows per warp (rows = 16 * warps) and walks tiles of `cols` rows of the
   other operand, staged in shared memory in the compute type (zero past T and past the head
   dim, which is padded to a multiple of 16). The per-warp softmax works on the scores stored
   to shared memory, two lanes per row, so no layout of a WMMA fragment is assumed. Backward
   is deterministic: dk and dv belong to the block of their key tile, dq to the block of its
   query tile, and every sum runs in a fixed order (no atomics); the price is recomputing the
   scores in both kernels. The scalar math (exp, lse, dS) is dsk_tensor.h's, shared with the
   CPU path. Head dims up to 256. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include "dsk_cuda.cuh"

/* ======================================================================= layout */

#define DSK__FA_MAX_DIM 256

typedef struct dsk__fa_args {
    const void *q, *k, *v, *o, *dout; /* o: forward's output (backward's D) */
    void *out, *dq, *dk, *dv;
    float *lse;                       /* forward: written unless NULL; backward: read */
    float *drow;                      /* backward: D (B, H, T) */
    int64_t sq[3], sk[3], sv[3], so[3], sdo[3], sdq[3], sdk[3], sdv[3]; /* strides of b, t, h */
    int T, H, Dk, Dv, Dkp, Dvp;       /* Dkp, Dvp: the head dims padded to 16 */
    int rows, cols;                   /* tile rows of the block (16 per warp), rows of the other tile */
    float scale;
    dsk_dtype dt;
} dsk__fa_args;

enum { DSK__FA_FWD, DSK__FA_KEYS, DSK__FA_QUERIES };
enum { DSK__FA_Q, DSK__FA_K, DSK__FA_V, DSK__FA_DO, DSK__FA_LSE, DSK__FA_D, DSK__FA_S, DSK__FA_DP, DSK__FA_P,
       DSK__FA_DS, DSK__FA_ACC1, DSK__FA_ACC2, DSK__FA_NBUF };

/* Byte offsets of a kernel's shared buffers (128-byte aligned) and their total. Row pitches
   are padded by 16 bytes (fewer bank conflicts; WMMA wants pitches of 16 bytes and 32-byte
   aligned tiles, which 16-row blocks of these pitches keep). */
typedef struct dsk__fa_plan {
    size_t off[DSK__FA_NBUF], bytes;
    int ldk, ldv, lds, ldp, ldak, ldav; /* elements */
} dsk__fa_plan;

__host__ __device__ static inline dsk__fa_plan dsk__fa_make_plan(int phase, int rows, int cols, int es, int Dkp,
                                                                 int Dvp) {
    dsk__fa_plan p;
    size_t sz[DSK__FA_NBUF] = {0}, nw = (size_t)rows / 16, at = 0;
    int pad = 16 / es;
    /* query and key tile rows */
    int tq = phase == DSK__FA_KEYS ? cols : rows, tk = phase == DSK__FA_KEYS ? rows : cols;
    p.ldk = Dkp + pad; p.ldv = Dvp + pad; p.lds = cols + 4; p.ldp = cols + pad; p.ldak = Dkp + 4; p.ldav = Dvp + 4;
    sz[DSK__FA_Q] = (size_t)tq * p.ldk * es;
    sz[DSK__FA_K] = (size_t)tk * p.ldk * es;
    sz[DSK__FA_V] = (size_t)tk * p.ldv * es;
    sz[DSK__FA_S] = nw * 16 * p.lds * 4;
    sz[DSK__FA_P] = nw * 16 * p.ldp * es;
    if (phase == DSK__FA_FWD) sz[DSK__FA_ACC1] = nw * 16 * p.ldav * 4; /* O */
    else {
        sz[DSK__FA_DO] = (size_t)tq * p.ldv * es;
        sz[DSK__FA_LSE] = sz[DSK__FA_D] = (size_t)tq * 4;
        sz[DSK__FA_DP] = nw * 16 * p.lds * 4;
        sz[DSK__FA_ACC1] = nw * 16 * p.ldak * 4; /* dk or dq */
        if (phase == DSK__FA_KEYS) {
            sz[DSK__FA_DS] = nw * 16 * p.ldp * es;
            sz[DSK__FA_ACC2] = nw * 16 * p.ldav * 4; /* dv */
        } else {
            sz[DSK__FA_P] = 0; /* dS takes P's place: P is only an intermediate there */
            sz[DSK__FA_DS] = nw * 16 * p.ldp * es;
        }
    }
    for (int i = 0; i < DSK__FA_NBUF; i++) {
        p.off[i] = at;
        at += (sz[i] + 127) / 128 * 128;
    }
    p.bytes = at;
    return p;
}

/* ======================================================================= products */

template <class T> __device__ inline T dsk__fa_from_f32(float x);
template <> __device__ inline float dsk__fa_from_f32<float>(float x) { return x; }
template <> __device__ inline __half dsk__fa_from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ inline __nv_bfloat16 dsk__fa_from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

/* C (16 x N, f32, pitch ldc) = (accumulate ? C : 0) + A (16 x K, pitch lda) op(B), where op(B) is
   B (K x N, pitch ldb) or, with bt, the transpose of B (N x K, pitch ldb). N and K are multiples
   of 16; the whole warp calls it and finds C complete (for every lane) when it returns.
   bf16/f16: tensor cores, f32 accumulation. */
template <class T>
__device__ void dsk__fa_mma(float *C, int ldc, const T *A, int lda, const T *B, int ldb, bool bt, int N, int K,
                            bool accumulate) {
    using namespace nvcuda;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bc;
    for (int n = 0; n < N; n += 16) {
        if (accumulate) wmma::load_matrix_sync(acc, C + n, (unsigned)ldc, wmma::mem_row_major);
        else wmma::fill_fragment(acc, 0.0f);
        for (int k = 0; k < K; k += 16) {
            wmma::load_matrix_sync(a, A + k, (unsigned)lda);
            if (bt) {
                wmma::load_matrix_sync(bc, B + (size_t)n * ldb + k, (unsigned)ldb);
                wmma::mma_sync(acc, a, bc, acc);
            } else {
                wmma::load_matrix_sync(b, B + (size_t)k * ldb + n, (unsigned)ldb);
                wmma::mma_sync(acc, a, b, acc);
            }
        }
        wmma::store_matrix_sync(C + n, acc, (unsigned)ldc, wmma::mem_row_major);
    }
    __syncwarp();
}

/* f32: CUDA cores, each lane a strided set of C's elements, k in order. */
__device__ void dsk__fa_mma(float *C, int ldc, const float *A, int lda, const float *B, int ldb, bool bt, int N, int K,
                            bool accumulate) {
    for (int e = (int)(threadIdx.x & 31); e < 16 * N; e += 32) {
        int r = e / N, c = e % N;
        const float *ar = A + (size_t)r * lda;
        float s = 0.0f;
        if (bt)
            for (int k = 0; k < K; k++) s += ar[k] * B[(size_t)c * ldb + k];
        else
            for (int k = 0; k < K; k++) s += ar[k] * B[(size_t)k * ldb + c];
        C[(size_t)r * ldc + c] = accumulate ? C[(size_t)r * ldc + c] + s : s;
    }
    __syncwarp();
}

/* ======================================================================= kernels */

__device__ static inline unsigned char *dsk__fa_smem_base(unsigned char *raw) {
    return (unsigned char *)(((uintptr_t)raw + 127) & ~(uintptr_t)127);
}

/* Rows [r0, r0 + n) of the (b, h) matrix of `src` (row pitch rs, unit column stride) into dst
   (pitch ld) in type T, zero past T rows and past D columns up to Dp; the whole block. */
template <class T>
__device__ void dsk__fa_load(T *dst, int ld, const void *src, dsk_dtype dt, int64_t base, int64_t rs, int r0, int n,
                             int T_, int D, int Dp) {
    for (int e = (int)threadIdx.x; e < n * Dp; e += (int)blockDim.x) {
        int r = e / Dp, d = e % Dp;
        float x = r0 + r < T_ && d < D ? dsk_load_f32(src, dt, base + (int64_t)(r0 + r) * rs + d) : 0.0f;
        dst[(size_t)r * ld + d] = dsk__fa_from_f32<T>(x);
    }
}

/* (b, h) base offset of a tensor with strides s (b, t, h). */
__device__ static inline int64_t dsk__fa_base(const int64_t *s, int b, int h) {
    return (int64_t)b * s[0] + (int64_t)h * s[2];
}

/* Valid keys of query i in the key tile [j0, j0 + n): causal, j <= i. */
__device__ static inline int dsk__fa_ncols(int i, int j0, int n) {
    int c = i - j0 + 1;
    return c < 0 ? 0 : c > n ? n : c;
}

/* Forward: block (query tile, h, b); the largest tiles (most keys) are handed out first. */
template <class T> __device__ void dsk__fa_forward(const dsk__fa_args &a) {
    DSK__CUDA_DYNAMIC_SHARED(dsk__fa_raw);
    unsigned char *sm = dsk__fa_smem_base(dsk__fa_raw);
    const int BR = a.rows, BC = a.cols, w = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32, h = (int)blockIdx.y,
              b = (int)blockIdx.z;
    const int ntiles = (a.T + BR - 1) / BR, i0 = (ntiles - 1 - (int)blockIdx.x) * BR;
    const dsk__fa_plan p = dsk__fa_make_plan(DSK__FA_FWD, BR, BC, (int)sizeof(T), a.Dkp, a.Dvp);
    T *Qs = (T *)(sm + p.off[DSK__FA_Q]), *Ks = (T *)(sm + p.off[DSK__FA_K]), *Vs = (T *)(sm + p.off[DSK__FA_V]);
    float *S = (float *)(sm + p.off[DSK__FA_S]) + (size_t)w * 16 * p.lds,
          *O = (float *)(sm + p.off[DSK__FA_ACC1]) + (size_t)w * 16 * p.ldav;
    T *P = (T *)(sm + p.off[DSK__FA_P]) + (size_t)w * 16 * p.ldp;
    const int r = lane >> 1, half = lane & 1, row0 = i0 + w * 16, i = row0 + r;
    const int last = (i0 + BR < a.T ? i0 + BR : a.T) - 1;
    float m = -INFINITY, l = 0.0f;
    dsk__fa_load(Qs, p.ldk, a.q, a.dt, dsk__fa_base(a.sq, b, h), a.sq[1], i0, BR, a.T, a.Dk, a.Dkp);
    for (int e = lane; e < 16 * a.Dvp; e += 32) O[(size_t)(e / a.Dvp) * p.ldav + e % a.Dvp] = 0.0f;
    for (int j0 = 0; j0 <= last; j0 += BC) {
        const int bc = a.T - j0 < BC ? a.T - j0 : BC;
        __syncthreads();
        dsk__fa_load(Ks, p.ldk, a.k, a.dt, dsk__fa_base(a.sk, b, h), a.sk[1], j0, BC, a.T, a.Dk, a.Dkp);
        dsk__fa_load(Vs, p.ldv, a.v, a.dt, dsk__fa_base(a.sv, b, h), a.sv[1], j0, BC, a.T, a.Dv, a.Dvp);
        __syncthreads();
        if (row0 >= a.T || j0 > row0 + 15) continue; /* warp-uniform: no row of this warp sees these keys */
        dsk__fa_mma(S, p.lds, Qs + (size_t)w * 16 * p.ldk, p.ldk, Ks, p.ldk, true, BC, a.Dkp, false);
        {
            const int nc = i < a.T ? dsk__fa_ncols(i, j0, bc) : 0, c0 = half * (BC / 2), c1 = c0 + BC / 2;
            const float *s = S + (size_t)r * p.lds;
            float mx = m, sum = 0.0f, alpha;
            for (int c = c0; c < c1 && c < nc; c++) mx = fmaxf(mx, s[c] * a.scale);
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            alpha = nc > 0 ? dsk_exp_f(m - mx) : 1.0f;
            for (int c = c0; c < c1; c++) {
                float pc = c < nc ? dsk_exp_f(s[c] * a.scale - mx) : 0.0f;
                P[(size_t)r * p.ldp + c] = dsk__fa_from_f32<T>(pc);
                sum += pc;
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            if (nc > 0) {
                l = alpha * l + sum;
                m = mx;
            }
            for (int d = half; d < a.Dvp; d += 2) O[(size_t)r * p.ldav + d] *= alpha;
        }
        __syncwarp();
        dsk__fa_mma(O, p.ldav, P, p.ldp, Vs, p.ldv, false, a.Dvp, BC, true);
    }
    if (i < a.T) {
        const float inv = 1.0f / l;
        const int64_t ob = dsk__fa_base(a.so, b, h) + (int64_t)i * a.so[1];
        for (int d = half; d < a.Dv; d += 2) dsk_store_f32(a.out, a.dt, ob + d, O[(size_t)r * p.ldav + d] * inv);
        if (a.lse && half == 0) a.lse[((int64_t)b * a.H + h) * a.T + i] = dsk_attn_lse(m, l);
    }
}

__global__ void __launch_bounds__(128) dsk__fa_forward_f32(dsk__fa_args a) { dsk__fa_forward<float>(a); }
__global__ void __launch_bounds__(128) dsk__fa_forward_bf16(dsk__fa_args a) { dsk__fa_forward<__nv_bfloat16>(a); }
__global__ void __launch_bounds__(128) dsk__fa_forward_f16(dsk__fa_args a) { dsk__fa_forward<__half>(a); }

/* D (B, H, T) = rowsum(dout * out) in f32: a warp per row, a fixed shuffle tree. */
__global__ void dsk__fa_drow(dsk__fa_args a, int B) {
    const int lane = (int)threadIdx.x % 32;
    const int64_t nrows = (int64_t)B * a.H * a.T, nwarps = (int64_t)gridDim.x * blockDim.x / 32;
    for (int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; row < nrows; row += nwarps) {
        const int i = (int)(row % a.T), h = (int)(row / a.T % a.H), b = (int)(row / ((int64_t)a.T * a.H));
        const int64_t ob = dsk__fa_base(a.so, b, h) + (int64_t)i * a.so[1],
                      db = dsk__fa_base(a.sdo, b, h) + (int64_t)i * a.sdo[1];
        float s = 0.0f;
        for (int d = lane; d < a.Dv; d += 32) s += dsk_load_f32(a.dout, a.dt, db + d) * dsk_load_f32(a.o, a.dt, ob + d);
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) a.drow[row] = s;
    }
}

/* The scores' probabilities and gradients of one warp's 16 x n tile: S becomes P (f32) and
   dS = P (dP - D) is stored in T; P in T too when Pt is not NULL. qi/kj give the query and
   key of element (r, c); lse and D come per query. */
template <class T, class Fq, class Fk, class Fs>
__device__ void dsk__fa_dscores(const dsk__fa_args &a, const dsk__fa_plan &p, float *S, const float *dP, T *Pt, T *dS,
                                int n, Fq qi, Fk kj, Fs stat) {
    for (int e = (int)(threadIdx.x & 31); e < 16 * n; e += 32) {
        const int r = e / n, c = e % n, q = qi(r, c), k = kj(r, c);
        float lse, d, pr;
        stat(r, c, &lse, &d);
        pr = q < a.T && k <= q ? dsk_exp_f(S[(size_t)r * p.lds + c] * a.scale - lse) : 0.0f;
        if (Pt) Pt[(size_t)r * p.ldp + c] = dsk__fa_from_f32<T>(pr);
        dS[(size_t)r * p.ldp + c] = dsk__fa_from_f32<T>(dsk_attn_dscore(pr, dP[(size_t)r * p.lds + c], d));
    }
    __syncwarp();
}

/* lse and D of rows [r0, r0 + n) into shared memory (0 past T); the whole block. */
__device__ static void dsk__fa_load_stats(const dsk__fa_args &a, float *lse, float *drow, int b, int h, int r0, int n) {
    for (int e = (int)threadIdx.x; e < n; e += (int)blockDim.x) {
        const int64_t at = ((int64_t)b * a.H + h) * a.T + r0 + e;
        lse[e] = r0 + e < a.T ? a.lse[at] : 0.0f;
        drow[e] = r0 + e < a.T ? a.drow[at] : 0.0f;
    }
}

/* rows of dst (pitch from its strides) += mult * acc (16 x D, pitch ld) for rows [row0, row0 + 16) below T. */
__device__ static void dsk__fa_add_rows(void *dst, dsk_dtype dt, int64_t base, int64_t rs, const float *acc, int ld,
                                        int row0, int T_, int D, float mult) {
    for (int e = (int)(threadIdx.x & 31); e < 16 * D; e += 32) {
        const int r = e / D, d = e % D;
        if (row0 + r >= T_) continue;
        const int64_t o = base + (int64_t)(row0 + r) * rs + d;
        dsk_store_f32(dst, dt, o, dsk_load_f32(dst, dt, o) + mult * acc[(size_t)r * ld + d]);
    }
}

/* dk, dv: block (key tile, h, b), rows = keys (16 per warp), cols = queries per tile; the query
   tiles from the one holding the first key to the end, in order. Each warp works on the
   transposed scores of its 16 keys: S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q. */
template <class T> __device__ void dsk__fa_keys(const dsk__fa_args &a) {
    DSK__CUDA_DYNAMIC_SHARED(dsk__fa_raw);
    unsigned char *sm = dsk__fa_smem_base(dsk__fa_raw);
    const int BK = a.rows, BQ = a.cols, w = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32, h = (int)blockIdx.y,
              b = (int)blockIdx.z;
    const int j0 = (int)blockIdx.x * BK, kw = j0 + w * 16;
    const dsk__fa_plan p = dsk__fa_make_plan(DSK__FA_KEYS, BK, BQ, (int)sizeof(T), a.Dkp, a.Dvp);
    T *Ks = (T *)(sm + p.off[DSK__FA_K]), *Vs = (T *)(sm + p.off[DSK__FA_V]), *Qs = (T *)(sm + p.off[DSK__FA_Q]);
    T *dOs = (T *)(sm + p.off[DSK__FA_DO]);
    float *lse = (float *)(sm + p.off[DSK__FA_LSE]), *drow = (float *)(sm + p.off[DSK__FA_D]);
    float *S = (float *)(sm + p.off[DSK__FA_S]) + (size_t)w * 16 * p.lds,
          *dP = (float *)(sm + p.off[DSK__FA_DP]) + (size_t)w * 16 * p.lds;
    T *Pt = (T *)(sm + p.off[DSK__FA_P]) + (size_t)w * 16 * p.ldp,
      *dSt = (T *)(sm + p.off[DSK__FA_DS]) + (size_t)w * 16 * p.ldp;
    float *gk = (float *)(sm + p.off[DSK__FA_ACC1]) + (size_t)w * 16 * p.ldak,
          *gv = (float *)(sm + p.off[DSK__FA_ACC2]) + (size_t)w * 16 * p.ldav;
    dsk__fa_load(Ks, p.ldk, a.k, a.dt, dsk__fa_base(a.sk, b, h), a.sk[1], j0, BK, a.T, a.Dk, a.Dkp);
    dsk__fa_load(Vs, p.ldv, a.v, a.dt, dsk__fa_base(a.sv, b, h), a.sv[1], j0, BK, a.T, a.Dv, a.Dvp);
    for (int e = lane; e < 16 * a.Dkp; e += 32) gk[(size_t)(e / a.Dkp) * p.ldak + e % a.Dkp] = 0.0f;
    for (int e = lane; e < 16 * a.Dvp; e += 32) gv[(size_t)(e / a.Dvp) * p.ldav + e % a.Dvp] = 0.0f;
    for (int i0 = j0 / BQ * BQ; i0 < a.T; i0 += BQ) {
        __syncthreads();
        dsk__fa_load(Qs, p.ldk, a.q, a.dt, dsk__fa_base(a.sq, b, h), a.sq[1], i0, BQ, a.T, a.Dk, a.Dkp);
        dsk__fa_load(dOs, p.ldv, a.dout, a.dt, dsk__fa_base(a.sdo, b, h), a.sdo[1], i0, BQ, a.T, a.Dv, a.Dvp);
        dsk__fa_load_stats(a, lse, drow, b, h, i0, BQ);
        __syncthreads();
        if (kw >= a.T || i0 + BQ - 1 < kw) continue; /* warp-uniform: every query of the tile is before these keys */
        dsk__fa_mma(S, p.lds, Ks + (size_t)w * 16 * p.ldk, p.ldk, Qs, p.ldk, true, BQ, a.Dkp, false);
        dsk__fa_mma(dP, p.lds, Vs + (size_t)w * 16 * p.ldv, p.ldv, dOs, p.ldv, true, BQ, a.Dvp, false);
        dsk__fa_dscores<T>(
            a, p, S, dP, Pt, dSt, BQ, [&](int, int c) { return i0 + c; }, [&](int r, int) { return kw + r; },
            [&](int, int c, float *l, float *d) {
                *l = lse[c];
                *d = drow[c];
            });
        dsk__fa_mma(gv, p.ldav, Pt, p.ldp, dOs, p.ldv, false, a.Dvp, BQ, true);
        dsk__fa_mma(gk, p.ldak, dSt, p.ldp, Qs, p.ldk, false, a.Dkp, BQ, true);
    }
    dsk__fa_add_rows(a.dk, a.dt, dsk__fa_base(a.sdk, b, h), a.sdk[1], gk, p.ldak, kw, a.T, a.Dk, a.scale);
    dsk__fa_add_rows(a.dv, a.dt, dsk__fa_base(a.sdv, b, h), a.sdv[1], gv, p.ldav, kw, a.T, a.Dv, 1.0f);
}

__global__ void __launch_bounds__(128) dsk__fa_keys_f32(dsk__fa_args a) { dsk__fa_keys<float>(a); }
__global__ void __launch_bounds__(128) dsk__fa_keys_bf16(dsk__fa_args a) { dsk__fa_keys<__nv_bfloat16>(a); }
__global__ void __launch_bounds__(128) dsk__fa_keys_f16(dsk__fa_args a) { dsk__fa_keys<__half>(a); }

/* dq: block (query tile, h, b), rows = queries (16 per warp), cols = keys per tile; the key
   tiles up to the block's last query, in order: S = Q K^T, dP = dO V^T, dQ += dS K. */
template <class T> __device__ void dsk__fa_queries(const dsk__fa_args &a) {
    DSK__CUDA_DYNAMIC_SHARED(dsk__fa_raw);
    unsigned char *sm = dsk__fa_smem_base(dsk__fa_raw);
    const int BQ = a.rows, BK = a.cols, w = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32, h = (int)blockIdx.y,
              b = (int)blockIdx.z;
    const int ntiles = (a.T + BQ - 1) / BQ, i0 = (ntiles - 1 - (int)blockIdx.x) * BQ, qw = i0 + w * 16;
    const int last = (i0 + BQ < a.T ? i0 + BQ : a.T) - 1;
    const dsk__fa_plan p = dsk__fa_make_plan(DSK__FA_QUERIES, BQ, BK, (int)sizeof(T), a.Dkp, a.Dvp);
    T *Qs = (T *)(sm + p.off[DSK__FA_Q]), *dOs = (T *)(sm + p.off[DSK__FA_DO]), *Ks = (T *)(sm + p.off[DSK__FA_K]);
    T *Vs = (T *)(sm + p.off[DSK__FA_V]);
    float *lse = (float *)(sm + p.off[DSK__FA_LSE]), *drow = (float *)(sm + p.off[DSK__FA_D]);
    float *S = (float *)(sm + p.off[DSK__FA_S]) + (size_t)w * 16 * p.lds,
          *dP = (float *)(sm + p.off[DSK__FA_DP]) + (size_t)w * 16 * p.lds;
    T *dS = (T *)(sm + p.off[DSK__FA_DS]) + (size_t)w * 16 * p.ldp;
    float *gq = (float *)(sm + p.off[DSK__FA_ACC1]) + (size_t)w * 16 * p.ldak;
    dsk__fa_load(Qs, p.ldk, a.q, a.dt, dsk__fa_base(a.sq, b, h), a.sq[1], i0, BQ, a.T, a.Dk, a.Dkp);
    dsk__fa_load(dOs, p.ldv, a.dout, a.dt, dsk__fa_base(a.sdo, b, h), a.sdo[1], i0, BQ, a.T, a.Dv, a.Dvp);
    dsk__fa_load_stats(a, lse, drow, b, h, i0, BQ);
    for (int e = lane; e < 16 * a.Dkp; e += 32) gq[(size_t)(e / a.Dkp) * p.ldak + e % a.Dkp] = 0.0f;
    for (int j0 = 0; j0 <= last; j0 += BK) {
        __syncthreads();
        dsk__fa_load(Ks, p.ldk, a.k, a.dt, dsk__fa_base(a.sk, b, h), a.sk[1], j0, BK, a.T, a.Dk, a.Dkp);
        dsk__fa_load(Vs, p.ldv, a.v, a.dt, dsk__fa_base(a.sv, b, h), a.sv[1], j0, BK, a.T, a.Dv, a.Dvp);
        __syncthreads();
        if (qw >= a.T || j0 > qw + 15) continue; /* warp-uniform */
        dsk__fa_mma(S, p.lds, Qs + (size_t)w * 16 * p.ldk, p.ldk, Ks, p.ldk, true, BK, a.Dkp, false);
        dsk__fa_mma(dP, p.lds, dOs + (size_t)w * 16 * p.ldv, p.ldv, Vs, p.ldv, true, BK, a.Dvp, false);
        dsk__fa_dscores<T>(
            a, p, S, dP, (T *)NULL, dS, BK, [&](int r, int) { return qw + r; }, [&](int, int c) { return j0 + c; },
            [&](int r, int, float *l, float *d) {
                *l = lse[w * 16 + r];
                *d = drow[w * 16 + r];
            });
        dsk__fa_mma(gq, p.ldak, dS, p.ldp, Ks, p.ldk, false, a.Dkp, BK, true);
    }
    dsk__fa_add_rows(a.dq, a.dt, dsk__fa_base(a.sdq, b, h), a.sdq[1], gq, p.ldak, qw, a.T, a.Dk, a.scale);
}

__global__ void __launch_bounds__(128) dsk__fa_queries_f32(dsk__fa_args a) { dsk__fa_queries<float>(a); }
__global__ void __launch_bounds__(128) dsk__fa_queries_bf16(dsk__fa_args a) { dsk__fa_queries<__nv_bfloat16>(a); }
__global__ void __launch_bounds__(128) dsk__fa_queries_f16(dsk__fa_args a) { dsk__fa_queries<__half>(a); }

/* ======================================================================= launchers */

static void dsk__fa_strides(int64_t *dst, const dsk_tensor *t) {
    dst[0] = t->stride[0];
    dst[1] = t->stride[1];
    dst[2] = t->stride[2];
}

static dsk_status dsk__fa_common(const char *fn, dsk_ctx *ctx, dsk__fa_args *a, const dsk_tensor *q,
                                 const dsk_tensor *k, const dsk_tensor *v, float scale) {
    memset(a, 0, sizeof *a);
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    if (q->shape[3] > DSK__FA_MAX_DIM || v->shape[3] > DSK__FA_MAX_DIM)
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: head dims Dk %lld, Dv %lld: the CUDA kernels take at most %d",
                             fn, (long long)q->shape[3], (long long)v->shape[3], DSK__FA_MAX_DIM);
    if (q->shape[1] > INT_MAX / 2 || q->shape[2] > 65535 || q->shape[0] > 65535)
        return dsk_set_error(DSK_ERR_UNSUPPORTED,
                             "%s: B %lld, T %lld, H %lld exceed the grid (B, H <= 65535, T < 2^30)", fn,
                             (long long)q->shape[0], (long long)q->shape[1], (long long)q->shape[2]);
    a->q = q->data; a->k = k->data; a->v = v->data;
    dsk__fa_strides(a->sq, q); dsk__fa_strides(a->sk, k); dsk__fa_strides(a->sv, v);
    a->T = (int)q->shape[1]; a->H = (int)q->shape[2]; a->Dk = (int)q->shape[3]; a->Dv = (int)v->shape[3];
    a->Dkp = (a->Dk + 15) / 16 * 16; a->Dvp = (a->Dv + 15) / 16 * 16;
    if (a->Dkp == 0) a->Dkp = 16;
    if (a->Dvp == 0) a->Dvp = 16;
    a->scale = scale;
    a->dt = q->dtype;
    return DSK_OK;
}

/* The largest tiles whose plan fits the device's opt-in shared memory: (rows, cols) in *a and the bytes. */
static dsk_status dsk__fa_tiles(const char *fn, dsk_ctx *ctx, int phase, dsk__fa_args *a, size_t *bytes) {
    static const int cand[5][2] = {{64, 64}, {64, 32}, {32, 32}, {16, 32}, {16, 16}};
    int optin = 0;
    DSK__CUDA_CHECK(fn, cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx->device.index),
                    "shared memory limit");
    for (int c = 0; c < 5; c++) {
        dsk__fa_plan p = dsk__fa_make_plan(phase, cand[c][0], cand[c][1], (int)dsk_dtype_size(a->dt), a->Dkp, a->Dvp);
        if (p.bytes + 128 <= (size_t)optin) {
            a->rows = cand[c][0];
            a->cols = cand[c][1];
            *bytes = p.bytes + 128; /* room to align the base to 128 bytes */
            return DSK_OK;
        }
    }
    return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: head dims %d, %d need more shared memory than the device's %d bytes",
                         fn, a->Dk, a->Dv, optin);
}

/* Allows `bytes` of dynamic shared memory for the kernel of dtype dt when above the default. */
static dsk_status dsk__fa_allow(const char *fn, void (*f32)(dsk__fa_args), void (*bf16)(dsk__fa_args),
                                void (*f16)(dsk__fa_args), dsk_dtype dt, size_t bytes) {
    void (*k)(dsk__fa_args) = dt == DSK_BF16 ? bf16 : dt == DSK_F16 ? f16 : f32;
    if (bytes <= 48 * 1024) return DSK_OK;
    DSK__CUDA_CHECK(fn, cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes),
                    "dynamic shared memory");
    return DSK_OK;
}

/* kernel `phase`_<dtype> on (tiles, H, B) with rows / 16 warps, checked. */
#define DSK__FA_LAUNCH(fn, phase, a, tiles, B, bytes, ctx)                                                             \
    ((a).dt == DSK_BF16                                                                                                \
         ? DSK__CUDA_LAUNCHED_SHMEM(fn, phase##_bf16, dim3((unsigned)(tiles), (unsigned)(a).H, (unsigned)(B)),         \
                                    (unsigned)(a).rows * 2, bytes, dsk__cuda_stream(ctx), (tiles), a)                  \
     : (a).dt == DSK_F16                                                                                               \
         ? DSK__CUDA_LAUNCHED_SHMEM(fn, phase##_f16, dim3((unsigned)(tiles), (unsigned)(a).H, (unsigned)(B)),          \
                                    (unsigned)(a).rows * 2, bytes, dsk__cuda_stream(ctx), (tiles), a)                  \
         : DSK__CUDA_LAUNCHED_SHMEM(fn, phase##_f32, dim3((unsigned)(tiles), (unsigned)(a).H, (unsigned)(B)),          \
                                    (unsigned)(a).rows * 2, bytes, dsk__cuda_stream(ctx), (tiles), a))

extern "C" dsk_status dsk_cuda_attention_fused(dsk_ctx *ctx, dsk_tensor *out, dsk_tensor *lse, const dsk_tensor *q,
                                               const dsk_tensor *k, const dsk_tensor *v, float scale) {
    const char *fn = "dsk_attention_fused";
    dsk__fa_args a;
    size_t bytes;
    int B = (int)q->shape[0], tiles;
    DSK__TRY(dsk__fa_common(fn, ctx, &a, q, k, v, scale));
    if ((int64_t)B * a.H * a.T == 0) return DSK_OK;
    a.out = out->data;
    dsk__fa_strides(a.so, out);
    a.lse = lse ? (float *)lse->data : NULL;
    DSK__TRY(dsk__fa_tiles(fn, ctx, DSK__FA_FWD, &a, &bytes));
    DSK__TRY(dsk__fa_allow(fn, dsk__fa_forward_f32, dsk__fa_forward_bf16, dsk__fa_forward_f16, a.dt, bytes));
    tiles = (a.T + a.rows - 1) / a.rows;
    return DSK__FA_LAUNCH(fn, dsk__fa_forward, a, tiles, B, bytes, ctx);
}

extern "C" dsk_status dsk_cuda_attention_fused_backward(dsk_ctx *ctx, dsk_tensor *dq, dsk_tensor *dk, dsk_tensor *dv,
                                                        const dsk_tensor *dout, const dsk_tensor *q,
                                                        const dsk_tensor *k, const dsk_tensor *v, const dsk_tensor *out,
                                                        const dsk_tensor *lse, float scale) {
    const char *fn = "dsk_attention_fused_backward";
    dsk__fa_args a;
    size_t bytes;
    int B = (int)q->shape[0];
    int64_t nrows;
    void *drow = NULL;
    dsk_status s;
    char detail[64];
    DSK__TRY(dsk__fa_common(fn, ctx, &a, q, k, v, scale));
    nrows = (int64_t)B * a.H * a.T;
    if (nrows == 0) return DSK_OK;
    a.o = out->data; a.dout = dout->data; a.dq = dq->data; a.dk = dk->data; a.dv = dv->data;
    a.lse = (float *)lse->data;
    dsk__fa_strides(a.so, out); dsk__fa_strides(a.sdo, dout);
    dsk__fa_strides(a.sdq, dq); dsk__fa_strides(a.sdk, dk); dsk__fa_strides(a.sdv, dv);
    snprintf(detail, sizeof detail, "%lld row statistics", (long long)nrows);
    DSK__CUDA_CHECK(fn, cudaMallocAsync(&drow, (size_t)nrows * sizeof(float), dsk__cuda_stream(ctx)), detail);
    a.drow = (float *)drow;
    s = DSK__CUDA_LAUNCHED(fn, dsk__fa_drow, dsk__cuda_grid(nrows * 32), DSK__CUDA_THREADS, dsk__cuda_stream(ctx),
                           nrows, a, B);
    if (s == DSK_OK) s = dsk__fa_tiles(fn, ctx, DSK__FA_KEYS, &a, &bytes);
    if (s == DSK_OK) s = dsk__fa_allow(fn, dsk__fa_keys_f32, dsk__fa_keys_bf16, dsk__fa_keys_f16, a.dt, bytes);
    if (s == DSK_OK) s = DSK__FA_LAUNCH(fn, dsk__fa_keys, a, (a.T + a.rows - 1) / a.rows, B, bytes, ctx);
    if (s == DSK_OK) s = dsk__fa_tiles(fn, ctx, DSK__FA_QUERIES, &a, &bytes);
    if (s == DSK_OK) s = dsk__fa_allow(fn, dsk__fa_queries_f32, dsk__fa_queries_bf16, dsk__fa_queries_f16, a.dt, bytes);
    if (s == DSK_OK) s = DSK__FA_LAUNCH(fn, dsk__fa_queries, a, (a.T + a.rows - 1) / a.rows, B, bytes, ctx);
    {
        cudaError_t e = cudaFreeAsync(drow, dsk__cuda_stream(ctx));
        if (e != cudaSuccess && s == DSK_OK) s = dsk__cuda_fail(fn, "cudaFreeAsync", e, detail);
    }
    return s;
}
