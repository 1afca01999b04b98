/* kernels/fp8.cu - the CUDA path of dsk_tensor.h's FP8 GEMM: dsk_matmul_fp8 and its grouped forms
   dsk_matmul_fp8_grouped (rows and weights), block-scaled e4m3/e5m2 operands in DeepSeek-V3's
   layouts (1x128 tiles, 128x128 blocks), f32 accumulation promoted every 128 elements of K.

   A kernel of our own on the CUDA cores. It runs the arithmetic dsk_tensor.h specifies, through
   the same DSK_HD functions (dsk_fp8_chunk_dot, dsk_fp8_chunk_acc, dsk_fp8_out), so it agrees bit
   for bit with the CPU reference. cuBLASLt (CUDA 12.9 and later, this toolkit's 13.0 too) offers
   the 1x128 and 128x128 scale modes (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, _BLK128x128_32F) on
   the tensor cores, whose accumulation order inside a chunk is theirs; it is not used: the CUDA
   emulation (tests/cuda_emu) has no cuBLASLt, so `make test` could not run it.

   Shape: a block of 128 threads computes a 32 x 64 tile of C; per 128-wide K chunk it stages the
   A rows and B rows of the chunk in shared memory as f32 (decoded; 48 KiB), then thread t
   computes row t / 4 and columns t % 4 + 4 j (j < DSK_FP8_DOT_W = 16) of the tile: one chunk dot
   call, each column's sum in k order, promoted with the two scales. The grid of the rows form is
   sized as kernels/grouped.cu's: R / BM + G row tiles (a bound; each block finds its segment and
   tile from the offsets on the device, and a block past the last tile returns); the weights form
   puts the segment on blockIdx.z and reads its K range from the offsets. Nothing comes back to
   the host. Conventions: kernels/dsk_cuda.cuh. */
#include "dsk_cuda.cuh"

#define DSK__FP8_BM 32
#define DSK__FP8_BN (4 * DSK_FP8_DOT_W)
#define DSK__FP8_CG 4 /* column groups: threads per tile row; each thread DSK_FP8_DOT_W columns */

struct dsk__fp8_gemm {
    const uint8_t *A, *B;
    const float *sa, *sb;
    dsk_dtype a_dt, b_dt, c_dt;
    int64_t M, N, K, kc, a_rows, b_rows, b_step, sb_step;
    const int32_t *off; /* NULL: one segment [0, M) */
    int64_t G;
    int weights; /* the weights form: segment blockIdx.z cuts K, C[g] (M, N) at g * c_step */
    int64_t c_step;
    void *C;
    float alpha, beta;
};

/* The segment of row tile t (tiles counted segment after segment), its first row and its end;
   -1 when t is past the last tile. Every thread finds it (the offsets are read through the
   cache), which leaves the shared memory to the tiles. */
__device__ static int64_t dsk__fp8_tile_of(const dsk__fp8_gemm &p, int64_t t, int64_t *r0, int64_t *r_end) {
    if (p.weights) { /* every segment has C[g]'s M rows; blockIdx.z is the segment */
        *r0 = t * DSK__FP8_BM;
        *r_end = p.M;
        return blockIdx.z;
    }
    if (!p.off) {
        *r0 = t * DSK__FP8_BM;
        *r_end = p.M;
        return *r0 < p.M ? 0 : -1;
    }
    for (int64_t g = 0; g < p.G; g++) {
        int64_t tiles = (p.off[g + 1] - p.off[g] + DSK__FP8_BM - 1) / DSK__FP8_BM;
        if (t < tiles) {
            *r0 = p.off[g] + t * DSK__FP8_BM;
            *r_end = p.off[g + 1];
            return g;
        }
        t -= tiles;
    }
    return -1;
}

__global__ void dsk__k_matmul_fp8(dsk__fp8_gemm p) {
    __shared__ float As[DSK__FP8_BM][DSK_FP8_BLOCK];
    __shared__ float Bs[DSK_FP8_BLOCK][DSK__FP8_BN];
    int tr = threadIdx.x / DSK__FP8_CG, cg = threadIdx.x % DSK__FP8_CG;
    int64_t n0 = (int64_t)blockIdx.y * DSK__FP8_BN, r0, r_end, m_lim, n_lim;
    int64_t g = dsk__fp8_tile_of(p, blockIdx.x, &r0, &r_end), klo, khi;
    float acc[DSK_FP8_DOT_W], dot[DSK_FP8_DOT_W];
    const uint8_t *B;
    const float *sb;
    if (g < 0) return; /* the whole block: past the last tile */
    m_lim = r_end - r0 < DSK__FP8_BM ? r_end - r0 : DSK__FP8_BM;
    n_lim = p.N - n0 < DSK__FP8_BN ? p.N - n0 : DSK__FP8_BN;
    B = p.B + g * p.b_step;
    sb = p.sb + g * p.sb_step;
    klo = p.weights ? p.off[g] : 0;
    khi = p.weights ? p.off[g + 1] : p.K;
    for (int j = 0; j < DSK_FP8_DOT_W; j++) acc[j] = 0.0f;
    for (int64_t c = klo / DSK_FP8_BLOCK; klo < khi && c * DSK_FP8_BLOCK < khi; c++) { /* chunks cut to [klo, khi) */
        int64_t k0 = c * DSK_FP8_BLOCK > klo ? c * DSK_FP8_BLOCK : klo;
        int n = (int)((c + 1) * DSK_FP8_BLOCK < khi ? (c + 1) * DSK_FP8_BLOCK - k0 : khi - k0);
        for (int e = threadIdx.x; e < DSK__FP8_BM * DSK_FP8_BLOCK; e += blockDim.x) {
            int mm = e / DSK_FP8_BLOCK, kk = e % DSK_FP8_BLOCK;
            As[mm][kk] = mm < m_lim && kk < n ? dsk_load_f32(p.A, p.a_dt, (r0 + mm) * p.K + k0 + kk) : 0.0f;
        }
        for (int e = threadIdx.x; e < DSK__FP8_BN * DSK_FP8_BLOCK; e += blockDim.x) {
            int nn = e / DSK_FP8_BLOCK, kk = e % DSK_FP8_BLOCK;
            Bs[kk][nn] = nn < n_lim && kk < n ? dsk_load_f32(B, p.b_dt, (n0 + nn) * p.K + k0 + kk) : 0.0f;
        }
        __syncthreads();
        if (tr < m_lim) {
            float s_a = p.sa[((r0 + tr) / p.a_rows) * p.kc + c];
            dsk_fp8_chunk_dot(dot, DSK_FP8_DOT_W, As[tr], &Bs[0][cg], DSK__FP8_BN, DSK__FP8_CG, n);
            for (int j = 0; j < DSK_FP8_DOT_W; j++) {
                int64_t col = n0 + cg + DSK__FP8_CG * j;
                if (col < p.N) acc[j] = dsk_fp8_chunk_acc(acc[j], dot[j], s_a, sb[(col / p.b_rows) * p.kc + c]);
            }
        }
        __syncthreads();
    }
    if (tr >= m_lim) return;
    for (int j = 0; j < DSK_FP8_DOT_W; j++) {
        int64_t col = n0 + cg + DSK__FP8_CG * j, o = g * p.c_step + (r0 + tr) * p.N + col;
        if (col >= p.N) continue;
        dsk_store_f32(p.C, p.c_dt, o,
                      dsk_fp8_out(acc[j], p.alpha, p.beta, p.beta != 0.0f ? dsk_load_f32(p.C, p.c_dt, o) : 0.0f));
    }
}

extern "C" dsk_status dsk_cuda_matmul_fp8(dsk_ctx *ctx, dsk_tensor *C, const dsk_tensor *A, const dsk_tensor *a_scales,
                                          int a_rows, const dsk_tensor *B, const dsk_tensor *b_scales, int b_rows,
                                          const dsk_tensor *offsets, float alpha, float beta) {
    const char *fn = offsets ? "dsk_matmul_fp8_grouped" : "dsk_matmul_fp8";
    dsk__fp8_gemm p;
    int64_t tiles_m, tiles_n;
    DSK__TRY(dsk__cuda_need_ctx(fn, ctx));
    p.A = (const uint8_t *)A->data;
    p.B = (const uint8_t *)B->data;
    p.sa = (const float *)a_scales->data;
    p.sb = (const float *)b_scales->data;
    p.a_dt = A->dtype;
    p.b_dt = B->dtype;
    p.c_dt = C->dtype;
    p.M = A->shape[0];
    p.N = C->shape[C->ndim - 1];
    p.K = A->shape[1];
    p.kc = (p.K + DSK_FP8_BLOCK - 1) / DSK_FP8_BLOCK;
    p.a_rows = a_rows;
    p.b_rows = b_rows;
    p.b_step = B->shape[B->ndim - 2] * p.K;
    p.sb_step = b_scales->shape[b_scales->ndim - 2] * p.kc;
    p.off = offsets ? (const int32_t *)offsets->data : NULL;
    p.G = offsets ? offsets->shape[0] - 1 : 1;
    p.C = C->data;
    p.alpha = alpha;
    p.beta = beta;
    p.weights = C->ndim == 3;
    p.c_step = p.weights ? p.M * p.N : 0;
    if (p.weights) p.b_step = p.sb_step = 0;
    /* rows: R / BM + G row tiles (a bound); weights: C[g]'s row tiles, segment g on blockIdx.z */
    tiles_m = (p.M + DSK__FP8_BM - 1) / DSK__FP8_BM + (offsets && !p.weights ? p.G : 0);
    tiles_n = (p.N + DSK__FP8_BN - 1) / DSK__FP8_BN;
    if (p.M == 0 || tiles_n == 0 || p.G == 0) return DSK_OK;
    if (tiles_m > INT_MAX || tiles_n > 65535 || (p.weights && p.G > 65535))
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: %lld x %lld tiles (x %lld groups) exceed the grid", fn,
                             (long long)tiles_m, (long long)tiles_n, (long long)(p.weights ? p.G : 1));
    DSK__CUDA_LAUNCH(fn, dsk__k_matmul_fp8, dim3((unsigned)tiles_m, (unsigned)tiles_n, p.weights ? (unsigned)p.G : 1u),
                     DSK__FP8_BM * DSK__FP8_CG, dsk__cuda_stream(ctx), p.M * p.N, p);
    return DSK_OK;
}
