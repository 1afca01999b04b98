/* dsk_tensor.h - status and errors, dtypes, devices, tensors, RNG, ops, GEMM, AdamW.
   The ground floor of dsk: every other dsk header includes this one.

   Usage: #define DSK_TENSOR_IMPLEMENTATION in exactly one .c file before including.
   Options (define before every include):
     DSK_STATIC          give every dsk function static linkage (CPU builds only: the
                         CUDA kernel library links against the extern symbols)
     DSK_MALLOC/DSK_FREE host allocator override; define both or neither
     DSK_CUDA            enable the CUDA paths; the implementation then calls the launchers
                         of kernels/dsk_kernels.h, built by nvcc (see the Makefile)
     DSK_NO_CUDA         force the CPU-only build even where DSK_CUDA is set
   Threading: CPU ops use OpenMP when compiled with -fopenmp and run serially without it.
   Errors: every function that can fail returns a dsk_status; dsk_last_error() then holds a
   thread-local message naming the function, the object and the values.
   Layout: tensors are row-major with element strides; shapes in comments are (T, D) style.
   Backward functions accumulate (+=) into their gradient outputs.
   License: MIT, see the end of the file. */
#ifndef DSK_TENSOR_H
#define DSK_TENSOR_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(DSK_NO_CUDA) && defined(DSK_CUDA)
#undef DSK_CUDA
#endif

#ifdef DSK_STATIC
#define DSK_API static
#else
#define DSK_API extern
#endif

/* DSK_HD marks math shared by the CPU path and the CUDA kernels. */
#ifdef __CUDACC__
#define DSK_HD __host__ __device__
#else
#define DSK_HD
#endif

#if defined(DSK_MALLOC) != defined(DSK_FREE)
#error "dsk: define both DSK_MALLOC and DSK_FREE, or neither"
#endif
#ifndef DSK_MALLOC
#include <stdlib.h>
#define DSK_MALLOC(sz) malloc(sz)
#define DSK_FREE(p) free(p)
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ status and errors */

typedef enum dsk_status {
    DSK_OK = 0,
    DSK_ERR_ARG,         /* bad argument: null, shape, dtype, device, range */
    DSK_ERR_OOM,         /* host or device allocation failed */
    DSK_ERR_IO,          /* file or socket I/O failed */
    DSK_ERR_CORRUPT,     /* data failed a format or checksum check */
    DSK_ERR_CUDA,        /* a CUDA runtime or cuBLAS call failed */
    DSK_ERR_NCCL,        /* an NCCL call failed */
    DSK_ERR_TIMEOUT,     /* a wait ran past its deadline */
    DSK_ERR_PEER,        /* a peer rank died, closed or disagreed */
    DSK_ERR_UNSUPPORTED, /* valid request this build or device cannot do */
    DSK_ERR_STATE,       /* call not valid in the object's current state */
    DSK_ERR_NONFINITE,   /* NaN or Inf where a finite value is required */
    DSK_STATUS_COUNT
} dsk_status;

/* Name of a status code ("DSK_ERR_ARG"); never NULL. */
DSK_API const char *dsk_status_str(dsk_status s);
/* Message of the last failing dsk call on this thread ("" if none). */
DSK_API const char *dsk_last_error(void);
/* Sets this thread's message (printf format) and returns `s`; for dsk modules and
   embedders: `return dsk_set_error(DSK_ERR_ARG, "dsk_x: tensor \"%s\" ...", ...)`. */
DSK_API dsk_status dsk_set_error(dsk_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
/* Clears this thread's message. */
DSK_API void dsk_clear_error(void);

/* ------------------------------------------------------------------ dtypes */

typedef enum dsk_dtype {
    DSK_F32 = 0,
    DSK_F16,
    DSK_BF16,
    DSK_E4M3, /* fp8 OCP e4m3fn: bias 7, max 448, no Inf, NaN = S.1111.111 */
    DSK_E5M2, /* fp8 OCP e5m2: bias 15, max 57344, Inf and NaN as IEEE */
    DSK_F64,
    DSK_I32,
    DSK_I64,
    DSK_U8,
    DSK_DTYPE_COUNT
} dsk_dtype;

DSK_API size_t dsk_dtype_size(dsk_dtype dt);       /* bytes per element; 0 if invalid */
DSK_API const char *dsk_dtype_name(dsk_dtype dt);  /* "f32", "bf16", ...; "invalid" */
DSK_API int dsk_dtype_is_float(dsk_dtype dt);      /* f32 f16 bf16 e4m3 e5m2 f64 */

/* Conversions, round to nearest even, NaN stays NaN (sign kept), Inf stays Inf where the
   format has it. f32 -> e4m3 saturates finite and infinite overflow to +-448 (CUDA's
   __NV_SATFINITE); f32 -> e5m2 and f16 overflow to Inf as IEEE does. */
static inline DSK_HD uint32_t dsk_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline DSK_HD float dsk_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline DSK_HD float dsk_bf16_to_f32(uint16_t h) { return dsk_bits_f32((uint32_t)h << 16); }
static inline DSK_HD uint16_t dsk_f32_to_bf16(float f) {
    uint32_t u = dsk_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Rounds |f| (finite, f32) to a binary format with `mbits` mantissa bits and exponent
   bias `bias` (minimum normal exponent 1 - bias), ties to even, subnormals included.
   Returns the magnitude code (exponent field << mbits | mantissa), which may exceed the
   format's largest finite code: the caller decides between Inf, NaN and saturation. */
static inline DSK_HD uint32_t dsk__round_minifloat(float f, int mbits, int bias) {
    uint32_t u = dsk_f32_bits(f) & 0x7fffffffu;
    int e32 = (int)(u >> 23);
    if (e32 == 0) return 0; /* f32 subnormals are below every target's smallest subnormal */
    int e = e32 - 127, emin = 1 - bias;
    uint32_t sig = (u & 0x7fffffu) | 0x800000u;
    int shift = 23 - mbits + (e < emin ? emin - e : 0);
    if (shift > 25) return 0;
    uint32_t q = sig >> shift, rem = sig & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;
    if (e < emin) return q; /* subnormal; q == 1 << mbits is exactly the smallest normal */
    return ((uint32_t)(e + bias) << mbits) + (q - (1u << mbits)); /* carry bumps the exponent */
}
static inline DSK_HD float dsk__minifloat_to_f32(uint32_t mag, int mbits, int bias) {
    uint32_t ef = mag >> mbits, m = mag & ((1u << mbits) - 1u);
    if (ef == 0) return ldexpf((float)m, 1 - bias - mbits);
    return dsk_bits_f32(((ef - (uint32_t)bias + 127u) << 23) | (m << (23 - mbits)));
}

static inline DSK_HD float dsk_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, mag = h & 0x7fffu;
    if (mag >= 0x7c00u) return dsk_bits_f32(sign | 0x7f800000u | ((mag & 0x3ffu) << 13));
    return dsk_bits_f32(sign | dsk_f32_bits(dsk__minifloat_to_f32(mag, 10, 15)));
}
static inline DSK_HD uint16_t dsk_f32_to_f16(float f) {
    uint32_t u = dsk_f32_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a == 0x7f800000u) return (uint16_t)(sign | 0x7c00u);
    uint32_t mag = dsk__round_minifloat(f, 10, 15);
    return (uint16_t)(sign | (mag >= 0x7c00u ? 0x7c00u : mag));
}
static inline DSK_HD float dsk_e4m3_to_f32(uint8_t b) {
    uint32_t sign = (uint32_t)(b & 0x80u) << 24, mag = b & 0x7fu;
    if (mag == 0x7fu) return dsk_bits_f32(sign | 0x7fc00000u);
    return dsk_bits_f32(sign | dsk_f32_bits(dsk__minifloat_to_f32(mag, 3, 7)));
}
static inline DSK_HD uint8_t dsk_f32_to_e4m3(float f) {
    uint32_t u = dsk_f32_bits(f), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint8_t)(sign | 0x7fu);
    if (a == 0x7f800000u) return (uint8_t)(sign | 0x7eu);
    uint32_t mag = dsk__round_minifloat(f, 3, 7);
    return (uint8_t)(sign | (mag > 0x7eu ? 0x7eu : mag));
}
static inline DSK_HD float dsk_e5m2_to_f32(uint8_t b) {
    uint32_t sign = (uint32_t)(b & 0x80u) << 24, mag = b & 0x7fu;
    if (mag >= 0x7cu) return dsk_bits_f32(sign | 0x7f800000u | ((mag & 3u) << 21));
    return dsk_bits_f32(sign | dsk_f32_bits(dsk__minifloat_to_f32(mag, 2, 15)));
}
static inline DSK_HD uint8_t dsk_f32_to_e5m2(float f) {
    uint32_t u = dsk_f32_bits(f), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint8_t)(sign | 0x7eu);
    if (a == 0x7f800000u) return (uint8_t)(sign | 0x7cu);
    uint32_t mag = dsk__round_minifloat(f, 2, 15);
    return (uint8_t)(sign | (mag >= 0x7cu ? 0x7cu : mag));
}
#define DSK_E4M3_MAX 448.0f
#define DSK_E5M2_MAX 57344.0f

/* ------------------------------------------------------------------ counter-based RNG */

/* Philox4x32-10 (Salmon et al. 2011): four 32-bit words for (seed, counter). Element i of
   a tensor filled with (seed, offset) uses counter offset + i, so the CPU and GPU paths
   produce the same numbers and a stream can resume from any offset. */
static inline DSK_HD void dsk_philox4x32(uint64_t seed, uint64_t counter, uint32_t out[4]) {
    uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32), c2 = 0, c3 = 0;
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1; c3 = (uint32_t)p0; c0 = n0; c2 = n2;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
    out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}
/* Uniform in (0, 1), never 0 or 1: 24 random bits centred in their interval. */
static inline DSK_HD float dsk_u32_to_unit(uint32_t x) { return ((float)(x >> 8) + 0.5f) * (1.0f / 16777216.0f); }
/* Uniform (0,1) for element `i` of stream (seed, offset). */
static inline DSK_HD float dsk_rng_uniform_at(uint64_t seed, uint64_t offset, uint64_t i) {
    uint32_t r[4]; dsk_philox4x32(seed, offset + i, r); return dsk_u32_to_unit(r[0]);
}
/* Standard normal for element `i` of stream (seed, offset), Box-Muller on words 0 and 1. */
static inline DSK_HD float dsk_rng_normal_at(uint64_t seed, uint64_t offset, uint64_t i) {
    uint32_t r[4]; dsk_philox4x32(seed, offset + i, r);
    float u1 = dsk_u32_to_unit(r[0]), u2 = dsk_u32_to_unit(r[1]);
    return sqrtf(-2.0f * logf(u1)) * cosf(6.283185307179586f * u2);
}

/* ------------------------------------------------------------------ devices and context */

typedef enum dsk_device_type { DSK_DEV_CPU = 0, DSK_DEV_CUDA = 1 } dsk_device_type;
typedef struct dsk_device { dsk_device_type type; int index; } dsk_device;

typedef enum dsk_device_pref {
    DSK_PREFER_AUTO = 0, /* the CUDA device if one is usable, else the CPU */
    DSK_PREFER_CPU,
    DSK_PREFER_CUDA      /* fail with DSK_ERR_UNSUPPORTED when no CUDA device is usable */
} dsk_device_pref;

typedef struct dsk_ctx_opts {
    dsk_device_pref device;  /* default DSK_PREFER_AUTO */
    int cuda_index;          /* CUDA device ordinal, default 0 */
    size_t workspace_bytes;  /* device workspace for cuBLAS and reductions, default 32 MiB */
    int n_threads;           /* CPU threads for ops, default: OpenMP's maximum */
} dsk_ctx_opts;

/* Execution context passed to every op. CPU ops accept ctx == NULL. */
typedef struct dsk_ctx {
    dsk_device device;       /* where ops run and tensors are allocated by default */
    void *stream;            /* cudaStream_t of the context (CUDA only) */
    void *cublas;            /* cublasHandle_t bound to `stream` (CUDA only) */
    void *workspace;         /* device workspace (CUDA only) */
    size_t workspace_bytes;
    int n_threads;
} dsk_ctx;

/* 1 if this build has CUDA and a device and driver are usable at run time, else 0. */
DSK_API int dsk_cuda_available(void);
DSK_API dsk_status dsk_ctx_init(dsk_ctx *ctx, const dsk_ctx_opts *opts); /* opts may be NULL */
DSK_API void dsk_ctx_free(dsk_ctx *ctx);                                  /* zeroed/freed ok */
DSK_API dsk_status dsk_ctx_sync(dsk_ctx *ctx); /* waits for the context's stream */
DSK_API dsk_device dsk_cpu(void);

/* ------------------------------------------------------------------ tensors */

#define DSK_MAX_DIMS 8

typedef struct dsk_tensor {
    void *data;                    /* element (0,..,0); NULL for an empty or freed tensor */
    dsk_dtype dtype;
    dsk_device device;
    int ndim;                      /* 0 = scalar (one element) */
    int64_t shape[DSK_MAX_DIMS];
    int64_t stride[DSK_MAX_DIMS];  /* in elements */
    int owns;                      /* 1: dsk_tensor_free releases data */
} dsk_tensor;

/* Allocates a contiguous tensor on ctx's device (CPU if ctx is NULL); contents undefined.
   Device memory comes from cudaMallocAsync on ctx's stream. */
DSK_API dsk_status dsk_tensor_alloc(dsk_ctx *ctx, dsk_tensor *t, dsk_dtype dt, int ndim, const int64_t *shape);
/* As dsk_tensor_alloc on an explicit device. */
DSK_API dsk_status dsk_tensor_alloc_on(dsk_ctx *ctx, dsk_device dev, dsk_tensor *t, dsk_dtype dt, int ndim, const int64_t *shape);
/* Releases an owning tensor and zeroes *t; views and zeroed tensors are just zeroed. */
DSK_API void dsk_tensor_free(dsk_ctx *ctx, dsk_tensor *t);
/* A non-owning contiguous tensor over caller memory. */
DSK_API dsk_status dsk_tensor_wrap(dsk_tensor *t, void *data, dsk_dtype dt, dsk_device dev, int ndim, const int64_t *shape);

DSK_API int64_t dsk_tensor_numel(const dsk_tensor *t);
DSK_API size_t dsk_tensor_nbytes(const dsk_tensor *t);     /* numel * element size */
DSK_API int dsk_tensor_is_contiguous(const dsk_tensor *t); /* row-major, no gaps */
DSK_API int dsk_tensor_same_shape(const dsk_tensor *a, const dsk_tensor *b);
/* Writes "[8,256,128] bf16" into buf (always terminated); returns buf. */
DSK_API const char *dsk_tensor_describe(const dsk_tensor *t, char *buf, size_t n);

/* Views share data with `t` and never own it. */
DSK_API dsk_status dsk_tensor_reshape(const dsk_tensor *t, int ndim, const int64_t *shape, dsk_tensor *out); /* t contiguous */
DSK_API dsk_status dsk_tensor_slice(const dsk_tensor *t, int dim, int64_t start, int64_t len, dsk_tensor *out);
DSK_API dsk_status dsk_tensor_transpose(const dsk_tensor *t, int d0, int d1, dsk_tensor *out);
/* Row i of the leading dimension as a tensor of ndim - 1 dims. */
DSK_API dsk_status dsk_tensor_select(const dsk_tensor *t, int64_t i, dsk_tensor *out);

/* dst <- src for any two devices, dtypes and strides of the same shape (a cast when the
   dtypes differ: floats round to nearest even, float -> int truncates toward zero). */
DSK_API dsk_status dsk_tensor_copy(dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src);
DSK_API dsk_status dsk_tensor_fill(dsk_ctx *ctx, dsk_tensor *t, double value);
/* Element i (row-major logical order) <- lo + (hi - lo) * dsk_rng_uniform_at(seed, offset, i). */
DSK_API dsk_status dsk_tensor_uniform(dsk_ctx *ctx, dsk_tensor *t, uint64_t seed, uint64_t offset, float lo, float hi);
/* Element i <- mean + std * dsk_rng_normal_at(seed, offset, i). */
DSK_API dsk_status dsk_tensor_normal(dsk_ctx *ctx, dsk_tensor *t, uint64_t seed, uint64_t offset, float mean, float std);

/* ------------------------------------------------------------------ ops
   Unless a comment says otherwise: tensors are contiguous and on ctx's device; float
   tensors are f32, bf16 or f16 with math in f32; index tensors are i32; outputs are
   written, and backward outputs (dx, dw, ...) are accumulated. */

/* C = alpha * op(A) op(B) + beta * C, op(X) = X or X^T; A (M,K), B (K,N), C (M,N) after op.
   3-D operands (batch, rows, cols) form a strided batched product; a 2-D A or B is shared
   by every batch. A and B: same dtype, f32/bf16/f16; C: f32 or A's dtype; f32 accumulation.
   Each matrix needs unit stride in its last dim; leading strides are free (views work).
   beta == 0 ignores C's prior contents (NaN included). */
DSK_API dsk_status dsk_matmul(dsk_ctx *ctx, dsk_tensor *C, const dsk_tensor *A, int trans_a,
                              const dsk_tensor *B, int trans_b, float alpha, float beta);
/* Raw row-major f32 GEMM on the CPU: C = alpha*op(A)op(B) + beta*C with leading dims. */
DSK_API void dsk_sgemm_cpu(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                           const float *A, int64_t lda, const float *B, int64_t ldb, float beta,
                           float *C, int64_t ldc, int n_threads);

DSK_API dsk_status dsk_add(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *a, const dsk_tensor *b); /* out = a + b (out may alias) */
DSK_API dsk_status dsk_mul(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *a, const dsk_tensor *b); /* out = a * b */
DSK_API dsk_status dsk_scale(dsk_ctx *ctx, dsk_tensor *t, float alpha);                            /* t *= alpha */
DSK_API dsk_status dsk_axpy(dsk_ctx *ctx, dsk_tensor *y, float alpha, const dsk_tensor *x);        /* y += alpha x */

typedef enum dsk_reduce_op { DSK_REDUCE_SUM = 0, DSK_REDUCE_MEAN, DSK_REDUCE_MAX } dsk_reduce_op;
/* out = reduce of `in` along `axis`; out has in's shape without that axis (or with it as 1). */
DSK_API dsk_status dsk_reduce(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *in, int axis, dsk_reduce_op op);
/* out (scalar f32) = sum of squares of all elements, accumulated in f64 on the CPU and in a
   fixed-order f32 tree on the GPU. */
DSK_API dsk_status dsk_sum_squares(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *in);

/* Row softmax over the last dim: y (R, C). Backward: dx += y * (dy - sum(dy * y)). */
DSK_API dsk_status dsk_softmax(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x);
DSK_API dsk_status dsk_softmax_backward(dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *y, const dsk_tensor *dy);

/* RMSNorm over the last dim: y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps).
   x, y (R, D); w (D); rstd (R) f32 saved for backward (may be NULL in forward). */
DSK_API dsk_status dsk_rmsnorm(dsk_ctx *ctx, dsk_tensor *y, dsk_tensor *rstd, const dsk_tensor *x, const dsk_tensor *w, float eps);
DSK_API dsk_status dsk_rmsnorm_backward(dsk_ctx *ctx, dsk_tensor *dx, dsk_tensor *dw, const dsk_tensor *dy,
                                        const dsk_tensor *x, const dsk_tensor *w, const dsk_tensor *rstd);

/* SiLU y = x * sigmoid(x); SwiGLU out = silu(gate) * up. */
DSK_API dsk_status dsk_silu(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x);
DSK_API dsk_status dsk_silu_backward(dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *dy, const dsk_tensor *x);
DSK_API dsk_status dsk_swiglu(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *gate, const dsk_tensor *up);
DSK_API dsk_status dsk_swiglu_backward(dsk_ctx *ctx, dsk_tensor *dgate, dsk_tensor *dup, const dsk_tensor *dout,
                                       const dsk_tensor *gate, const dsk_tensor *up);

/* Embedding: out (T, D) = table (V, D) rows at ids (T) i32. Backward: dtable[ids[t]] += dout[t],
   in token order (deterministic, no float atomics). Ids out of range are an error. */
DSK_API dsk_status dsk_embedding(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *table, const dsk_tensor *ids);
DSK_API dsk_status dsk_embedding_backward(dsk_ctx *ctx, dsk_tensor *dtable, const dsk_tensor *dout, const dsk_tensor *ids);

/* Fused softmax cross-entropy from logits (T, V) and targets (T) i32. loss (scalar f32) =
   mean over tokens whose target != ignore_index of -log softmax(logits)[target] (0 if none).
   dlogits (T, V) or NULL: WRITTEN (not accumulated) with grad_scale * (softmax - onehot) / count,
   zero rows for ignored tokens. Targets outside [0, V) other than ignore_index are an error. */
DSK_API dsk_status dsk_cross_entropy(dsk_ctx *ctx, dsk_tensor *loss, dsk_tensor *dlogits, const dsk_tensor *logits,
                                     const dsk_tensor *targets, int32_t ignore_index, float grad_scale);

/* out (N, D) = src (R, D) rows at idx (N). scatter-add: dst (R, D)[idx[i]] += src (N, D)[i] in
   increasing i (deterministic). Indices out of range are an error. */
DSK_API dsk_status dsk_gather_rows(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *src, const dsk_tensor *idx);
DSK_API dsk_status dsk_scatter_add_rows(dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src, const dsk_tensor *idx);

/* Per-row top-k of x (R, C) f32: values (R, k) f32 descending, indices (R, k) i32; ties go
   to the lower index; NaN ranks below every number. */
DSK_API dsk_status dsk_topk(dsk_ctx *ctx, dsk_tensor *values, dsk_tensor *indices, const dsk_tensor *x, int k);

/* Rotary position embedding on x (B, T, H, Dh), Dh even, pairs (2i, 2i+1) rotated by
   angle (pos0 + t) * theta^(-2i/Dh). Backward rotates by the negative angle (dx += ...). */
DSK_API dsk_status dsk_rope(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x, int64_t pos0, float theta);
DSK_API dsk_status dsk_rope_backward(dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *dy, int64_t pos0, float theta);

/* Causal self-attention with q, k, v, out (B, T, H, Dh): probs (B, H, T, T) f32 is written
   (saved for backward; entries above the diagonal are 0); out = softmax(scale q k^T + mask) v.
   Backward accumulates dq, dk, dv. */
DSK_API dsk_status dsk_attention(dsk_ctx *ctx, dsk_tensor *out, dsk_tensor *probs, const dsk_tensor *q,
                                 const dsk_tensor *k, const dsk_tensor *v, float scale);
DSK_API dsk_status dsk_attention_backward(dsk_ctx *ctx, dsk_tensor *dq, dsk_tensor *dk, dsk_tensor *dv,
                                          const dsk_tensor *dout, const dsk_tensor *q, const dsk_tensor *k,
                                          const dsk_tensor *v, const dsk_tensor *probs, float scale);

/* ------------------------------------------------------------------ AdamW */

/* Zero fields take the defaults in brackets (PyTorch's). */
typedef struct dsk_adamw_opts {
    float lr;           /* [1e-3] */
    float beta1;        /* [0.9] */
    float beta2;        /* [0.999] */
    float eps;          /* [1e-8] */
    float weight_decay; /* [0] decoupled: p -= lr * wd * p */
} dsk_adamw_opts;

/* The per-element AdamW update shared by the CPU path and the CUDA kernel. bc1, bc2 are
   the bias corrections 1 - beta^step. g is the raw gradient times the gradient multiplier. */
static inline DSK_HD void dsk_adamw_update(float *p, float *m, float *v, float g, float lr, float b1, float b2,
                                           float eps, float wd, float bc1, float bc2) {
    float mn = b1 * *m + (1.0f - b1) * g;
    float vn = b2 * *v + (1.0f - b2) * g * g;
    float pn = *p - lr * wd * *p;
    pn -= lr * (mn / bc1) / (sqrtf(vn / bc2) + eps);
    *m = mn; *v = vn; *p = pn;
}

/* One AdamW step at `step` (1-based) on f32 master weights `param` with f32 moments m, v
   (all the same shape) from `grad` (f32, bf16 or f16) times `grad_mult` (fuses loss
   unscaling and clipping). If `param_copy` is not NULL (bf16, f16 or f32, same shape) it
   receives the updated weights rounded to nearest even. */
DSK_API dsk_status dsk_adamw_step(dsk_ctx *ctx, dsk_tensor *param, const dsk_tensor *grad, dsk_tensor *m, dsk_tensor *v,
                                  const dsk_adamw_opts *opts, int64_t step, float grad_mult, dsk_tensor *param_copy);

#ifdef __cplusplus
}
#endif
#endif /* DSK_TENSOR_H */

/* ==================================================================== implementation */
#ifdef DSK_TENSOR_IMPLEMENTATION
#ifndef DSK_TENSOR_IMPLEMENTATION_DONE
#define DSK_TENSOR_IMPLEMENTATION_DONE

#include <stdarg.h>
#include <stdio.h>
#include <float.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef DSK_CUDA
#include "kernels/dsk_kernels.h"
#endif

#ifdef __cplusplus
#define DSK__TLS thread_local
#else
#define DSK__TLS _Thread_local
#endif

/* ---------------------------------------------------------------- status and errors */

static DSK__TLS char dsk__errbuf[1024];

DSK_API const char *dsk_status_str(dsk_status s) {
    static const char *names[DSK_STATUS_COUNT] = {
        "DSK_OK", "DSK_ERR_ARG", "DSK_ERR_OOM", "DSK_ERR_IO", "DSK_ERR_CORRUPT", "DSK_ERR_CUDA",
        "DSK_ERR_NCCL", "DSK_ERR_TIMEOUT", "DSK_ERR_PEER", "DSK_ERR_UNSUPPORTED", "DSK_ERR_STATE",
        "DSK_ERR_NONFINITE"};
    return ((int)s >= 0 && s < DSK_STATUS_COUNT) ? names[s] : "DSK_ERR_UNKNOWN";
}

DSK_API const char *dsk_last_error(void) { return dsk__errbuf; }

DSK_API dsk_status dsk_set_error(dsk_status s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(dsk__errbuf, sizeof dsk__errbuf, fmt, ap);
    va_end(ap);
    return s;
}

DSK_API void dsk_clear_error(void) { dsk__errbuf[0] = 0; }

/* ---------------------------------------------------------------- dtypes */

DSK_API size_t dsk_dtype_size(dsk_dtype dt) {
    static const size_t sizes[DSK_DTYPE_COUNT] = {4, 2, 2, 1, 1, 8, 4, 8, 1};
    return ((int)dt >= 0 && dt < DSK_DTYPE_COUNT) ? sizes[dt] : 0;
}

DSK_API const char *dsk_dtype_name(dsk_dtype dt) {
    static const char *names[DSK_DTYPE_COUNT] = {"f32", "f16", "bf16", "e4m3", "e5m2", "f64", "i32", "i64", "u8"};
    return ((int)dt >= 0 && dt < DSK_DTYPE_COUNT) ? names[dt] : "invalid";
}

DSK_API int dsk_dtype_is_float(dsk_dtype dt) { return (int)dt >= 0 && dt <= DSK_F64; }

/* Element i of a contiguous buffer as double, and the reverse; the CPU cast engine. */
static double dsk__load(const void *p, dsk_dtype dt, int64_t i) {
    switch (dt) {
    case DSK_F32: return ((const float *)p)[i];
    case DSK_F16: return dsk_f16_to_f32(((const uint16_t *)p)[i]);
    case DSK_BF16: return dsk_bf16_to_f32(((const uint16_t *)p)[i]);
    case DSK_E4M3: return dsk_e4m3_to_f32(((const uint8_t *)p)[i]);
    case DSK_E5M2: return dsk_e5m2_to_f32(((const uint8_t *)p)[i]);
    case DSK_F64: return ((const double *)p)[i];
    case DSK_I32: return ((const int32_t *)p)[i];
    case DSK_I64: return (double)((const int64_t *)p)[i];
    case DSK_U8: return ((const uint8_t *)p)[i];
    default: return 0;
    }
}

/* Float -> int conversions truncate toward zero and saturate at the type's range (NaN -> 0). */
static int64_t dsk__to_int(double x, double lo, double hi) {
    if (x != x) return 0;
    if (x <= lo) return (int64_t)lo;
    if (x >= hi) return (int64_t)hi;
    return (int64_t)x;
}

static void dsk__store(void *p, dsk_dtype dt, int64_t i, double x) {
    switch (dt) {
    case DSK_F32: ((float *)p)[i] = (float)x; break;
    case DSK_F16: ((uint16_t *)p)[i] = dsk_f32_to_f16((float)x); break;
    case DSK_BF16: ((uint16_t *)p)[i] = dsk_f32_to_bf16((float)x); break;
    case DSK_E4M3: ((uint8_t *)p)[i] = dsk_f32_to_e4m3((float)x); break;
    case DSK_E5M2: ((uint8_t *)p)[i] = dsk_f32_to_e5m2((float)x); break;
    case DSK_F64: ((double *)p)[i] = x; break;
    case DSK_I32: ((int32_t *)p)[i] = (int32_t)dsk__to_int(x, -2147483648.0, 2147483647.0); break;
    case DSK_I64: ((int64_t *)p)[i] = dsk__to_int(x, -9223372036854775808.0, 9223372036854774784.0); break;
    case DSK_U8: ((uint8_t *)p)[i] = (uint8_t)dsk__to_int(x, 0.0, 255.0); break;
    default: break;
    }
}

/* ---------------------------------------------------------------- devices and context */

DSK_API dsk_device dsk_cpu(void) {
    dsk_device d;
    d.type = DSK_DEV_CPU;
    d.index = 0;
    return d;
}

DSK_API int dsk_cuda_available(void) {
#ifdef DSK_CUDA
    int n = 0;
    return dsk_cuda_device_count(&n) == DSK_OK && n > 0;
#else
    return 0;
#endif
}

static int dsk__default_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

DSK_API dsk_status dsk_ctx_init(dsk_ctx *ctx, const dsk_ctx_opts *opts) {
    dsk_ctx_opts o;
    if (!ctx) return dsk_set_error(DSK_ERR_ARG, "dsk_ctx_init: ctx is NULL");
    memset(&o, 0, sizeof o);
    if (opts) o = *opts;
    memset(ctx, 0, sizeof *ctx);
    if (o.n_threads < 0) return dsk_set_error(DSK_ERR_ARG, "dsk_ctx_init: n_threads %d < 0", o.n_threads);
    if (o.cuda_index < 0) return dsk_set_error(DSK_ERR_ARG, "dsk_ctx_init: cuda_index %d < 0", o.cuda_index);
    ctx->device = dsk_cpu();
    ctx->n_threads = o.n_threads ? o.n_threads : dsk__default_threads();
    if (o.device == DSK_PREFER_CPU) return DSK_OK;
    if (o.device != DSK_PREFER_AUTO && o.device != DSK_PREFER_CUDA)
        return dsk_set_error(DSK_ERR_ARG, "dsk_ctx_init: unknown device preference %d", (int)o.device);
    if (!dsk_cuda_available()) {
        if (o.device == DSK_PREFER_AUTO) return DSK_OK;
#ifdef DSK_CUDA
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "dsk_ctx_init: CUDA requested but no usable CUDA device or driver");
#else
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "dsk_ctx_init: CUDA requested but this build has no CUDA (define DSK_CUDA)");
#endif
    }
#ifdef DSK_CUDA
    ctx->workspace_bytes = o.workspace_bytes ? o.workspace_bytes : ((size_t)32 << 20);
    {
        dsk_status s = dsk_cuda_ctx_init(ctx, o.cuda_index);
        if (s != DSK_OK) { dsk_cuda_ctx_free(ctx); memset(ctx, 0, sizeof *ctx); }
        return s;
    }
#else
    return DSK_OK;
#endif
}

DSK_API void dsk_ctx_free(dsk_ctx *ctx) {
    if (!ctx) return;
#ifdef DSK_CUDA
    if (ctx->device.type == DSK_DEV_CUDA) dsk_cuda_ctx_free(ctx);
#endif
    memset(ctx, 0, sizeof *ctx);
}

DSK_API dsk_status dsk_ctx_sync(dsk_ctx *ctx) {
#ifdef DSK_CUDA
    if (ctx && ctx->device.type == DSK_DEV_CUDA) return dsk_cuda_sync(ctx);
#endif
    (void)ctx;
    return DSK_OK;
}

static int dsk__threads(const dsk_ctx *ctx) { return ctx && ctx->n_threads > 0 ? ctx->n_threads : dsk__default_threads(); }

/* ---------------------------------------------------------------- tensors */

DSK_API int64_t dsk_tensor_numel(const dsk_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

DSK_API size_t dsk_tensor_nbytes(const dsk_tensor *t) { return (size_t)dsk_tensor_numel(t) * dsk_dtype_size(t->dtype); }

static void dsk__set_contiguous_strides(dsk_tensor *t) {
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; i--) { t->stride[i] = s; s *= t->shape[i]; }
}

DSK_API int dsk_tensor_is_contiguous(const dsk_tensor *t) {
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->stride[i] != s) return 0;
        s *= t->shape[i];
    }
    return 1;
}

DSK_API int dsk_tensor_same_shape(const dsk_tensor *a, const dsk_tensor *b) {
    if (a->ndim != b->ndim) return 0;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return 0;
    return 1;
}

DSK_API const char *dsk_tensor_describe(const dsk_tensor *t, char *buf, size_t n) {
    size_t k = 0;
    if (!n) return buf;
    buf[0] = 0;
    if (!t) { snprintf(buf, n, "(null)"); return buf; }
    k += (size_t)snprintf(buf + k, n - k, "[");
    for (int i = 0; i < t->ndim && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, i ? ",%lld" : "%lld", (long long)t->shape[i]);
    if (k < n) snprintf(buf + k, n - k, "] %s%s", dsk_dtype_name(t->dtype), t->device.type == DSK_DEV_CUDA ? " cuda" : "");
    return buf;
}

static dsk_status dsk__check_shape(const char *fn, dsk_dtype dt, int ndim, const int64_t *shape) {
    if (dsk_dtype_size(dt) == 0) return dsk_set_error(DSK_ERR_ARG, "%s: invalid dtype %d", fn, (int)dt);
    if (ndim < 0 || ndim > DSK_MAX_DIMS) return dsk_set_error(DSK_ERR_ARG, "%s: ndim %d outside [0, %d]", fn, ndim, DSK_MAX_DIMS);
    if (ndim > 0 && !shape) return dsk_set_error(DSK_ERR_ARG, "%s: shape is NULL for ndim %d", fn, ndim);
    for (int i = 0; i < ndim; i++)
        if (shape[i] < 0) return dsk_set_error(DSK_ERR_ARG, "%s: shape[%d] = %lld is negative", fn, i, (long long)shape[i]);
    return DSK_OK;
}

static void dsk__init_header(dsk_tensor *t, dsk_dtype dt, dsk_device dev, int ndim, const int64_t *shape) {
    memset(t, 0, sizeof *t);
    t->dtype = dt;
    t->device = dev;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
    dsk__set_contiguous_strides(t);
}

DSK_API dsk_status dsk_tensor_alloc_on(dsk_ctx *ctx, dsk_device dev, dsk_tensor *t, dsk_dtype dt, int ndim, const int64_t *shape) {
    dsk_status s;
    size_t bytes;
    if (!t) return dsk_set_error(DSK_ERR_ARG, "dsk_tensor_alloc: tensor is NULL");
    memset(t, 0, sizeof *t);
    if ((s = dsk__check_shape("dsk_tensor_alloc", dt, ndim, shape)) != DSK_OK) return s;
    dsk__init_header(t, dt, dev, ndim, shape);
    bytes = dsk_tensor_nbytes(t);
    if (dev.type == DSK_DEV_CPU) {
        t->data = DSK_MALLOC(bytes ? bytes : 1);
        if (!t->data) {
            memset(t, 0, sizeof *t);
            return dsk_set_error(DSK_ERR_OOM, "dsk_tensor_alloc: out of host memory for %zu bytes", bytes);
        }
        t->owns = 1;
        return DSK_OK;
    }
#ifdef DSK_CUDA
    if (dev.type == DSK_DEV_CUDA) {
        if (!ctx || ctx->device.type != DSK_DEV_CUDA || ctx->device.index != dev.index) {
            memset(t, 0, sizeof *t);
            return dsk_set_error(DSK_ERR_ARG, "dsk_tensor_alloc: CUDA device %d needs a ctx on that device", dev.index);
        }
        s = dsk_cuda_malloc(ctx, bytes ? bytes : 1, &t->data);
        if (s != DSK_OK) { memset(t, 0, sizeof *t); return s; }
        t->owns = 1;
        return DSK_OK;
    }
#endif
    (void)ctx;
    memset(t, 0, sizeof *t);
    return dsk_set_error(DSK_ERR_UNSUPPORTED, "dsk_tensor_alloc: device type %d not available in this build", (int)dev.type);
}

DSK_API dsk_status dsk_tensor_alloc(dsk_ctx *ctx, dsk_tensor *t, dsk_dtype dt, int ndim, const int64_t *shape) {
    return dsk_tensor_alloc_on(ctx, ctx ? ctx->device : dsk_cpu(), t, dt, ndim, shape);
}

DSK_API void dsk_tensor_free(dsk_ctx *ctx, dsk_tensor *t) {
    if (!t) return;
    if (t->owns && t->data) {
        if (t->device.type == DSK_DEV_CPU) DSK_FREE(t->data);
#ifdef DSK_CUDA
        else dsk_cuda_free(ctx, t->data);
#endif
    }
    (void)ctx;
    memset(t, 0, sizeof *t);
}

DSK_API dsk_status dsk_tensor_wrap(dsk_tensor *t, void *data, dsk_dtype dt, dsk_device dev, int ndim, const int64_t *shape) {
    dsk_status s;
    if (!t) return dsk_set_error(DSK_ERR_ARG, "dsk_tensor_wrap: tensor is NULL");
    memset(t, 0, sizeof *t);
    if ((s = dsk__check_shape("dsk_tensor_wrap", dt, ndim, shape)) != DSK_OK) return s;
    dsk__init_header(t, dt, dev, ndim, shape);
    if (!data && dsk_tensor_numel(t) > 0) {
        memset(t, 0, sizeof *t);
        return dsk_set_error(DSK_ERR_ARG, "dsk_tensor_wrap: data is NULL for %lld elements", (long long)dsk_tensor_numel(t));
    }
    t->data = data;
    return DSK_OK;
}

static dsk_tensor dsk__view_of(const dsk_tensor *t) {
    dsk_tensor v = *t;
    v.owns = 0;
    return v;
}

DSK_API dsk_status dsk_tensor_reshape(const dsk_tensor *t, int ndim, const int64_t *shape, dsk_tensor *out) {
    dsk_status s;
    dsk_tensor v;
    char b[96];
    if (!t || !out) return dsk_set_error(DSK_ERR_ARG, "dsk_tensor_reshape: NULL tensor");
    if ((s = dsk__check_shape("dsk_tensor_reshape", t->dtype, ndim, shape)) != DSK_OK) return s;
    if (!dsk_tensor_is_contiguous(t))
        return dsk_set_error(DSK_ERR_ARG, "dsk_tensor_reshape: tensor %s is not contiguous", dsk_tensor_describe(t, b, sizeof b));
    v = dsk__view_of(t);
    v.ndim = ndim;
    for (int i = 0; i < ndim; i++) v.shape[i] = shape[i];
    if (dsk_tensor_numel(&v) != dsk_tensor_numel(t))
        return dsk_set_error(DSK_ERR_ARG, "dsk_tensor_reshape: %lld elements of %s cannot take a shape of %lld elements",
                             (long long)dsk_tensor_numel(t), dsk_tensor_describe(t, b, sizeof b), (long long)dsk_tensor_numel(&v));
    dsk__set_contiguous_strides(&v);
    *out = v;
    return DSK_OK;
}

DSK_API dsk_status dsk_tensor_slice(const dsk_tensor *t, int dim, int64_t start, int64_t len, dsk_tensor *out) {
    dsk_tensor v;
    char b[96];
    if (!t || !out) return dsk_set_error(DSK_ERR_ARG, "dsk_tensor_slice: NULL tensor");
    if (dim < 0 || dim >= t->ndim)
        return dsk_set_error(DSK_ERR_ARG, "dsk_tensor_slice: dim %d outside tensor %s", dim, dsk_tensor_describe(t, b, sizeof b));
    if (start < 0 || len < 0 || start + len > t->shape[dim])
        return dsk_set_error(DSK_ERR_ARG, "dsk_tensor_slice: [%lld, %lld) outside dim %d of size %lld", (long long)start,
                             (long long)(start + len), dim, (long long)t->shape[dim]);
    v = dsk__view_of(t);
    if (v.data) v.data = (char *)v.data + (size_t)(start * t->stride[dim]) * dsk_dtype_size(t->dtype);
    v.shape[dim] = len;
    *out = v;
    return DSK_OK;
}

DSK_API dsk_status dsk_tensor_transpose(const dsk_tensor *t, int d0, int d1, dsk_tensor *out) {
    dsk_tensor v;
    int64_t x;
    char b[96];
    if (!t || !out) return dsk_set_error(DSK_ERR_ARG, "dsk_tensor_transpose: NULL tensor");
    if (d0 < 0 || d1 < 0 || d0 >= t->ndim || d1 >= t->ndim)
        return dsk_set_error(DSK_ERR_ARG, "dsk_tensor_transpose: dims (%d, %d) outside tensor %s", d0, d1, dsk_tensor_describe(t, b, sizeof b));
    v = dsk__view_of(t);
    x = v.shape[d0]; v.shape[d0] = v.shape[d1]; v.shape[d1] = x;
    x = v.stride[d0]; v.stride[d0] = v.stride[d1]; v.stride[d1] = x;
    *out = v;
    return DSK_OK;
}

DSK_API dsk_status dsk_tensor_select(const dsk_tensor *t, int64_t i, dsk_tensor *out) {
    dsk_tensor v;
    char b[96];
    if (!t || !out) return dsk_set_error(DSK_ERR_ARG, "dsk_tensor_select: NULL tensor");
    if (t->ndim < 1 || i < 0 || i >= t->shape[0])
        return dsk_set_error(DSK_ERR_ARG, "dsk_tensor_select: row %lld outside tensor %s", (long long)i, dsk_tensor_describe(t, b, sizeof b));
    v = dsk__view_of(t);
    if (v.data) v.data = (char *)v.data + (size_t)(i * t->stride[0]) * dsk_dtype_size(t->dtype);
    for (int d = 1; d < t->ndim; d++) { v.shape[d - 1] = t->shape[d]; v.stride[d - 1] = t->stride[d]; }
    v.ndim = t->ndim - 1;
    *out = v;
    return DSK_OK;
}

/* Offset in elements of logical row-major index `lin` in a strided tensor. */
static int64_t dsk__offset(const dsk_tensor *t, int64_t lin) {
    int64_t off = 0;
    for (int d = t->ndim - 1; d >= 0; d--) {
        int64_t n = t->shape[d];
        if (n == 0) return 0;
        off += (lin % n) * t->stride[d];
        lin /= n;
    }
    return off;
}

static dsk_status dsk__copy_cpu(dsk_tensor *dst, const dsk_tensor *src) {
    int64_t n = dsk_tensor_numel(src);
    size_t es = dsk_dtype_size(src->dtype);
    if (n == 0) return DSK_OK;
    if (dst->dtype == src->dtype && dsk_tensor_is_contiguous(dst) && dsk_tensor_is_contiguous(src)) {
        memmove(dst->data, src->data, (size_t)n * es);
        return DSK_OK;
    }
    /* Element-wise; (dst may alias src only when identical, handled by the memmove above). */
    for (int64_t i = 0; i < n; i++)
        dsk__store(dst->data, dst->dtype, dsk__offset(dst, i), dsk__load(src->data, src->dtype, dsk__offset(src, i)));
    return DSK_OK;
}

#ifdef DSK_CUDA
/* Cross-device copy staged through a contiguous host buffer. */
static dsk_status dsk__copy_via_host(dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src) {
    dsk_status s;
    dsk_tensor h, dev_tmp;
    int to_host = dst->device.type == DSK_DEV_CPU;
    const dsk_tensor *dev_side = to_host ? src : dst;
    dsk_tensor dev_contig = *dev_side;
    int need_tmp = !dsk_tensor_is_contiguous(dev_side);
    memset(&dev_tmp, 0, sizeof dev_tmp);
    if ((s = dsk_tensor_alloc_on(NULL, dsk_cpu(), &h, dev_side->dtype, dev_side->ndim, dev_side->shape)) != DSK_OK) return s;
    if (need_tmp) {
        if ((s = dsk_tensor_alloc_on(ctx, dev_side->device, &dev_tmp, dev_side->dtype, dev_side->ndim, dev_side->shape)) != DSK_OK) goto done;
        dev_contig = dev_tmp;
    }
    if (to_host) {
        if (need_tmp && (s = dsk_cuda_tensor_copy(ctx, &dev_contig, src)) != DSK_OK) goto done;
        if ((s = dsk_cuda_memcpy(ctx, h.data, dev_contig.data, dsk_tensor_nbytes(&h), 0)) != DSK_OK) goto done;
        if ((s = dsk_cuda_sync(ctx)) != DSK_OK) goto done;
        s = dsk__copy_cpu(dst, &h);
    } else {
        if ((s = dsk__copy_cpu(&h, src)) != DSK_OK) goto done;
        if ((s = dsk_cuda_memcpy(ctx, dev_contig.data, h.data, dsk_tensor_nbytes(&h), 1)) != DSK_OK) goto done;
        if (need_tmp && (s = dsk_cuda_tensor_copy(ctx, dst, &dev_contig)) != DSK_OK) goto done;
        s = dsk_cuda_sync(ctx); /* the host staging buffer is freed below */
    }
done:
    dsk_tensor_free(ctx, &dev_tmp);
    dsk_tensor_free(NULL, &h);
    return s;
}
#endif

DSK_API dsk_status dsk_tensor_copy(dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src) {
    char a[96], b[96];
    if (!dst || !src) return dsk_set_error(DSK_ERR_ARG, "dsk_tensor_copy: NULL tensor");
    if (!dsk_tensor_same_shape(dst, src))
        return dsk_set_error(DSK_ERR_ARG, "dsk_tensor_copy: shape mismatch, dst %s, src %s", dsk_tensor_describe(dst, a, sizeof a),
                             dsk_tensor_describe(src, b, sizeof b));
    if (dsk_tensor_numel(src) == 0) return DSK_OK;
    if (!dst->data || !src->data) return dsk_set_error(DSK_ERR_ARG, "dsk_tensor_copy: tensor without data");
    if (dst->device.type == DSK_DEV_CPU && src->device.type == DSK_DEV_CPU) return dsk__copy_cpu(dst, src);
#ifdef DSK_CUDA
    if (dst->device.type == DSK_DEV_CUDA && src->device.type == DSK_DEV_CUDA) {
        if (dst->device.index != src->device.index)
            return dsk_set_error(DSK_ERR_UNSUPPORTED, "dsk_tensor_copy: CUDA device %d to CUDA device %d", src->device.index, dst->device.index);
        return dsk_cuda_tensor_copy(ctx, dst, src);
    }
    return dsk__copy_via_host(ctx, dst, src);
#else
    (void)ctx;
    return dsk_set_error(DSK_ERR_UNSUPPORTED, "dsk_tensor_copy: CUDA tensor in a build without DSK_CUDA");
#endif
}

/* Checks shared by every op: non-NULL, on a device this build knows. */
static dsk_status dsk__need(const char *fn, const char *what, const dsk_tensor *t) {
    if (!t) return dsk_set_error(DSK_ERR_ARG, "%s: %s is NULL", fn, what);
    if (!t->data && dsk_tensor_numel(t) > 0) return dsk_set_error(DSK_ERR_ARG, "%s: %s has no data", fn, what);
#ifndef DSK_CUDA
    if (t->device.type != DSK_DEV_CPU)
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: %s is a CUDA tensor in a build without DSK_CUDA", fn, what);
#endif
    return DSK_OK;
}

DSK_API dsk_status dsk_tensor_fill(dsk_ctx *ctx, dsk_tensor *t, double value) {
    dsk_status s;
    if ((s = dsk__need("dsk_tensor_fill", "tensor", t)) != DSK_OK) return s;
#ifdef DSK_CUDA
    if (t->device.type == DSK_DEV_CUDA) return dsk_cuda_tensor_fill(ctx, t, value);
#endif
    (void)ctx;
    for (int64_t i = 0, n = dsk_tensor_numel(t); i < n; i++) dsk__store(t->data, t->dtype, dsk__offset(t, i), value);
    return DSK_OK;
}

DSK_API dsk_status dsk_tensor_uniform(dsk_ctx *ctx, dsk_tensor *t, uint64_t seed, uint64_t offset, float lo, float hi) {
    dsk_status s;
    if ((s = dsk__need("dsk_tensor_uniform", "tensor", t)) != DSK_OK) return s;
    if (!dsk_dtype_is_float(t->dtype))
        return dsk_set_error(DSK_ERR_ARG, "dsk_tensor_uniform: dtype %s is not a float type", dsk_dtype_name(t->dtype));
#ifdef DSK_CUDA
    if (t->device.type == DSK_DEV_CUDA) return dsk_cuda_tensor_uniform(ctx, t, seed, offset, lo, hi);
#endif
    (void)ctx;
    for (int64_t i = 0, n = dsk_tensor_numel(t); i < n; i++)
        dsk__store(t->data, t->dtype, dsk__offset(t, i), lo + (hi - lo) * dsk_rng_uniform_at(seed, offset, (uint64_t)i));
    return DSK_OK;
}

DSK_API dsk_status dsk_tensor_normal(dsk_ctx *ctx, dsk_tensor *t, uint64_t seed, uint64_t offset, float mean, float std) {
    dsk_status s;
    if ((s = dsk__need("dsk_tensor_normal", "tensor", t)) != DSK_OK) return s;
    if (!dsk_dtype_is_float(t->dtype))
        return dsk_set_error(DSK_ERR_ARG, "dsk_tensor_normal: dtype %s is not a float type", dsk_dtype_name(t->dtype));
#ifdef DSK_CUDA
    if (t->device.type == DSK_DEV_CUDA) return dsk_cuda_tensor_normal(ctx, t, seed, offset, mean, std);
#endif
    (void)ctx;
    for (int64_t i = 0, n = dsk_tensor_numel(t); i < n; i++)
        dsk__store(t->data, t->dtype, dsk__offset(t, i), mean + std * dsk_rng_normal_at(seed, offset, (uint64_t)i));
    return DSK_OK;
}

/* ---------------------------------------------------------------- ops (CPU paths; CUDA dispatch) */

#endif /* DSK_TENSOR_IMPLEMENTATION_DONE */
#endif /* DSK_TENSOR_IMPLEMENTATION */

/* MIT License. Copyright (c) 2026 the dsk authors. Permission is hereby granted, free of
   charge, to any person obtaining a copy of this software, to deal in the software without
   restriction, subject to including this notice. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT
   WARRANTY OF ANY KIND. */
