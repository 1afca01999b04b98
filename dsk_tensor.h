/* dsk_tensor.h - status and errors, dtypes, devices, tensors, RNG, ops, GEMM, AdamW.
   The ground floor of dsk: every other dsk header includes this one.

   Usage: #define DSK_TENSOR_IMPLEMENTATION in exactly one .c file before including.
   Options (define before every include):
     DSK_STATIC          give every dsk function static linkage (CPU builds only: the
                         CUDA kernel library links against the extern symbols)
     DSK_MALLOC/DSK_FREE host allocator override; define both or neither
     DSK_CUDA            enable the CUDA paths; the implementation then calls the launchers
                         of the CUDA launchers section, built by nvcc (see the Makefile)
     DSK_NO_CUDA         force the CPU-only build even where DSK_CUDA is set
   Threading: CPU ops use OpenMP when compiled with -fopenmp and run serially without it.
   Errors: every function that can fail returns a dsk_status; dsk_last_error() then holds a
   thread-local message naming the function, the object and the values.
   Layout: tensors are row-major with element strides; shapes in comments are (T, D) style.
   Backward functions accumulate (+=) into their gradient outputs; those whose outputs are activation
   gradients, formed once per step (attention, RoPE, SwiGLU), may write them instead (dsk_grad_store).
   License: MIT, see the end of the file.

   One step of a linear layer y = x w^T with AdamW (after a failed call s holds its status, the
   calls after it are skipped, and dsk_last_error() names the function, tensor and values):

   Example:
       dsk_ctx ctx;
       dsk_tensor x, w, y, dy, dw, m, v;
       const int64_t xs[2] = {64, 128}, ws[2] = {256, 128}, ys[2] = {64, 256};
       dsk_adamw_opts adamw = dsk_adamw_defaults();              // PyTorch's AdamW defaults
       dsk_status s;
       memset(&x, 0, sizeof x);
       w = y = dy = dw = m = v = x;                              // zeroed: free accepts them
       s = dsk_ctx_init(&ctx, NULL);                             // the GPU if usable, else the CPU
       if (s == DSK_OK) s = dsk_tensor_alloc(&ctx, &x, DSK_F32, 2, xs);  // contents undefined
       if (s == DSK_OK) s = dsk_tensor_alloc(&ctx, &w, DSK_F32, 2, ws);  // f32 master weights
       if (s == DSK_OK) s = dsk_tensor_alloc(&ctx, &dw, DSK_F32, 2, ws);
       if (s == DSK_OK) s = dsk_tensor_alloc(&ctx, &m, DSK_F32, 2, ws);
       if (s == DSK_OK) s = dsk_tensor_alloc(&ctx, &v, DSK_F32, 2, ws);
       if (s == DSK_OK) s = dsk_tensor_alloc(&ctx, &y, DSK_F32, 2, ys);
       if (s == DSK_OK) s = dsk_tensor_alloc(&ctx, &dy, DSK_F32, 2, ys);
       if (s == DSK_OK) s = dsk_tensor_normal(&ctx, &x, 1, 0, 0.0f, 1.0f);   // seed 1, offset 0
       if (s == DSK_OK) s = dsk_tensor_normal(&ctx, &w, 2, 0, 0.0f, 0.02f);
       if (s == DSK_OK) s = dsk_tensor_fill(&ctx, &dw, 0.0);     // gradients accumulate
       if (s == DSK_OK) s = dsk_tensor_fill(&ctx, &m, 0.0);
       if (s == DSK_OK) s = dsk_tensor_fill(&ctx, &v, 0.0);
       if (s == DSK_OK) s = dsk_matmul(&ctx, &y, &x, 0, &w, 1, 1.0f, 0.0f);  // y = x w^T
       if (s == DSK_OK) s = dsk_tensor_copy(&ctx, &dy, &y);      // the loss 0.5 |y|^2: dy = y
       if (s == DSK_OK) s = dsk_matmul(&ctx, &dw, &dy, 1, &x, 0, 1.0f, 1.0f); // dw += dy^T x
       if (s == DSK_OK) s = dsk_adamw_step(&ctx, &w, &dw, &m, &v, &adamw, 1, 1.0f, NULL); // step 1
       if (s == DSK_OK) s = dsk_ctx_sync(&ctx);                  // CUDA: wait for the stream
       dsk_tensor_free(&ctx, &x); dsk_tensor_free(&ctx, &w); dsk_tensor_free(&ctx, &y);
       dsk_tensor_free(&ctx, &dy); dsk_tensor_free(&ctx, &dw); dsk_tensor_free(&ctx, &m);
       dsk_tensor_free(&ctx, &v);
       dsk_ctx_free(&ctx);
       return s;
   End of example.

   Contents (declarations; the implementation follows the same order)
     status and errors     dsk_status, dsk_status_str, dsk_last_error, dsk_set_error, DSK__TRY
     dtypes                dsk_dtype, sizes and names, RNE conversions (bf16, f16, e4m3, e5m2)
     element access        dsk_load_f32/f64, dsk_store_f32/f64, dsk_round_f32, dsk_move_elem
     counter-based RNG     Philox4x32-10, dsk_rng_uniform_at, dsk_rng_normal_at
     devices and context   dsk_device, dsk_ctx (stream, cuBLAS, workspace, CPU ISA, counters),
                           CUDA graph capture (dsk_graph_begin/end/launch/free)
     tensors               alloc/wrap/free, views (slice, reshape, transpose), copy/cast, fill,
                           random fills, allocator statistics (dsk_tensor_mem_stats)
     elementwise math      the DSK_HD functions the CPU loops and the CUDA kernels share
     ops                   matmul, elementwise, reductions, softmax, RMSNorm, SwiGLU, RoPE,
                           attention, embedding, cross-entropy, top-k, rows by index (forward and
                           backward)
     grouped rows          dsk_group_by_key, dsk_matmul_grouped, dsk_swiglu_grouped,
                           dsk_gather_rows_scaled
     AdamW                 dsk_adamw_opts, dsk_adamw_defaults, dsk_adamw_step
     fused attention       dsk_attention_fused, dsk_attention_fused_backward
     FP8 GEMM              dsk_fp8_scaling (1x128 tiles, 128x128 blocks), the chunk math,
                           dsk_matmul_fp8, dsk_matmul_fp8_grouped
     CUDA launchers        (DSK_CUDA) dsk_cuda_*: the runtime and the ops of kernels/tensor.cu,
                           attention.cu, grouped.cu, fp8.cu
   Implementation only: the CPU GEMM (packed and direct nests, run-time micro-kernels), the CPU
   row primitives. */
/* The comm, safetensors and ckpt implementations need POSIX 2008 (sockets, pread, O_CLOEXEC).
   Feature macros only work before the first system header, and every module includes this
   header first, so ask for POSIX here when one of those implementations is being compiled. */
#if (defined(DSK_COMM_IMPLEMENTATION) || defined(DSK_CKPT_IMPLEMENTATION) || defined(DSK_MOE_IMPLEMENTATION) || \
     defined(DSK_ZERO_IMPLEMENTATION) || defined(DSK_SAFETENSORS_IMPLEMENTATION)) && \
    !defined(_GNU_SOURCE) && !defined(_POSIX_C_SOURCE) && !defined(_XOPEN_SOURCE)
#define _POSIX_C_SOURCE 200809L
#endif
#ifndef DSK_TENSOR_H
#define DSK_TENSOR_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(DSK_NO_CUDA) && defined(DSK_CUDA)
#undef DSK_CUDA
#endif

/* The CPU math is specified operation by operation (the vector kernels repeat the scalar functions' roundings,
   and explicit fmaf where a fused multiply-add is meant), so no compiler may contract a * b + c into one FMA
   in dsk's code. gcc does not in ISO C (-std=c11); clang does by default (-ffp-contract=on), so its headers
   turn contraction off for their own code, restored after them for the includer's. */
#if defined(__clang__)
#define DSK__FP_EXACT_BEGIN _Pragma("float_control(push)") _Pragma("clang fp contract(off)")
#define DSK__FP_EXACT_END _Pragma("float_control(pop)")
#else
#define DSK__FP_EXACT_BEGIN
#define DSK__FP_EXACT_END
#endif
DSK__FP_EXACT_BEGIN

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
/* For the implementations of dsk modules (and embedders who like it): returns the status of
   `call` from the enclosing function unless it is DSK_OK. */
#define DSK__TRY(call)                                      \
    do {                                                    \
        dsk_status dsk__try_s_ = (call);                    \
        if (dsk__try_s_ != DSK_OK) return dsk__try_s_;      \
    } while (0)

/* Device dispatch, the one spelling of it in an op's body: when `cuda` (the op's tensors are on a
   CUDA device) the op returns the status of `launch`, its launcher's call; without DSK_CUDA the
   call is compiled out. */
#ifdef DSK_CUDA
#define DSK__CUDA_PATH(cuda, launch) \
    do { \
        if (cuda) return (launch); \
    } while (0)
#else
#define DSK__CUDA_PATH(cuda, launch) ((void)(cuda))
#endif

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
/* Branch-free, so that a CPU loop of it vectorises (the FP8 quantisers), with the bits
   dsk__round_minifloat(f, 3, 7) saturated at 0x7e would give (checked on all 2^32 inputs):
   from 2^-6 up, the f32 bits rounded to 3 mantissa bits (ties to even) and rebiased; below,
   the subnormal step 2^-9 is the f32 ulp of 2^14, so |f| + 2^14 rounds (to even) to
   2^14 + mag * 2^-9. Inf saturates with the overflow; a NaN's saturated 0x7e becomes 0x7f. */
static inline DSK_HD uint8_t dsk_f32_to_e4m3(float f) {
    uint32_t u = dsk_f32_bits(f), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
    uint32_t normal = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - ((127u - 7u) << 3);
    uint32_t subnormal = dsk_f32_bits(dsk_bits_f32(a) + 16384.0f) - 0x46800000u; /* 0x46800000: 2^14 */
    uint32_t is_sub = 0u - (uint32_t)(a < 0x3c800000u);                          /* 0x3c800000: 2^-6 */
    uint32_t mag = (subnormal & is_sub) | (normal & ~is_sub); /* masks: gcc turns a ?: here into a branch */
    mag = mag > 0x7eu ? 0x7eu : mag;
    return (uint8_t)(sign | mag | ((0u - (uint32_t)(a > 0x7f800000u)) & 1u));
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

/* ------------------------------------------------------------------ element access
   The one layer through which every dsk module and kernel reads and writes an element of a
   contiguous buffer of a runtime dtype (CPU paths and CUDA kernels alike). */

/* f32 <-> f64 keeping a NaN's sign and payload (quiet bit set, payload shifted) the way x86
   conversions do, so a device, whose own conversion gives the canonical NaN, matches the CPU. */
static inline DSK_HD double dsk_f32_to_f64(float x) {
    uint32_t u = dsk_f32_bits(x);
    uint64_t b = ((uint64_t)(u & 0x80000000u) << 32) | 0x7ff8000000000000ull | ((uint64_t)(u & 0x3fffffu) << 29);
    double d;
    if (x == x) return (double)x;
    memcpy(&d, &b, 8);
    return d;
}
static inline DSK_HD float dsk_f64_to_f32(double x) {
    uint64_t u;
    if (x == x) return (float)x;
    memcpy(&u, &x, 8);
    return dsk_bits_f32((uint32_t)((u >> 32) & 0x80000000u) | 0x7fc00000u | (uint32_t)((u >> 29) & 0x3fffffu));
}
/* Float -> integer: truncates toward zero and saturates at [lo, hi]; NaN gives 0. */
static inline DSK_HD int64_t dsk_f64_to_int(double x, double lo, double hi) {
    if (x != x) return 0;
    if (x <= lo) return (int64_t)lo;
    if (x >= hi) return (int64_t)hi;
    return (int64_t)x;
}

/* Element i as f32: the float dtypes convert exactly (f64 rounds to nearest), integers round. */
static inline DSK_HD float dsk_load_f32(const void *p, dsk_dtype dt, int64_t i) {
    switch (dt) {
    case DSK_F16: return dsk_f16_to_f32(((const uint16_t *)p)[i]);
    case DSK_BF16: return dsk_bf16_to_f32(((const uint16_t *)p)[i]);
    case DSK_E4M3: return dsk_e4m3_to_f32(((const uint8_t *)p)[i]);
    case DSK_E5M2: return dsk_e5m2_to_f32(((const uint8_t *)p)[i]);
    case DSK_F64: return dsk_f64_to_f32(((const double *)p)[i]);
    case DSK_I32: return (float)((const int32_t *)p)[i];
    case DSK_I64: return (float)((const int64_t *)p)[i];
    case DSK_U8: return (float)((const uint8_t *)p)[i];
    default: return ((const float *)p)[i];
    }
}
/* Stores x as element i of a float buffer (f32, f16, bf16, e4m3 saturating, e5m2, f64),
   rounding to nearest even; returns the stored value as f32 (what a load gives back). */
static inline DSK_HD float dsk_store_f32(void *p, dsk_dtype dt, int64_t i, float x) {
    switch (dt) {
    case DSK_F16: { uint16_t h = dsk_f32_to_f16(x); ((uint16_t *)p)[i] = h; return dsk_f16_to_f32(h); }
    case DSK_BF16: { uint16_t h = dsk_f32_to_bf16(x); ((uint16_t *)p)[i] = h; return dsk_bf16_to_f32(h); }
    case DSK_E4M3: { uint8_t b = dsk_f32_to_e4m3(x); ((uint8_t *)p)[i] = b; return dsk_e4m3_to_f32(b); }
    case DSK_E5M2: { uint8_t b = dsk_f32_to_e5m2(x); ((uint8_t *)p)[i] = b; return dsk_e5m2_to_f32(b); }
    case DSK_F64: ((double *)p)[i] = dsk_f32_to_f64(x); return x;
    default: ((float *)p)[i] = x; return x;
    }
}
/* dst[i] = element off + i of a contiguous buffer of float dtype dt, as f32, n at a time (host code:
   the dtype switch outside the element loop). */
static inline void dsk_load_f32_n(float *dst, const void *src, dsk_dtype dt, int64_t off, int64_t n) {
    if (dt == DSK_F32) {
        memcpy(dst, (const float *)src + off, (size_t)n * sizeof(float));
        return;
    }
    if (dt == DSK_BF16) {
        const uint16_t *q = (const uint16_t *)src + off;
        for (int64_t i = 0; i < n; i++) dst[i] = dsk_bf16_to_f32(q[i]);
        return;
    }
    if (dt == DSK_F16) {
        const uint16_t *q = (const uint16_t *)src + off;
        for (int64_t i = 0; i < n; i++) dst[i] = dsk_f16_to_f32(q[i]);
        return;
    }
    for (int64_t i = 0; i < n; i++) dst[i] = dsk_load_f32(src, dt, off + i);
}
/* Element off + i of dst (float dtype dt) = src[i], rounded to nearest even. */
static inline void dsk_store_f32_n(void *dst, dsk_dtype dt, int64_t off, const float *src, int64_t n) {
    if (dt == DSK_F32) {
        memcpy((float *)dst + off, src, (size_t)n * sizeof(float));
        return;
    }
    if (dt == DSK_BF16) {
        uint16_t *q = (uint16_t *)dst + off;
        for (int64_t i = 0; i < n; i++) q[i] = dsk_f32_to_bf16(src[i]);
        return;
    }
    if (dt == DSK_F16) {
        uint16_t *q = (uint16_t *)dst + off;
        for (int64_t i = 0; i < n; i++) q[i] = dsk_f32_to_f16(src[i]);
        return;
    }
    for (int64_t i = 0; i < n; i++) dsk_store_f32(dst, dt, off + i, src[i]);
}
/* x rounded to the float dtype dt and back: what a store followed by a load gives. */
static inline DSK_HD float dsk_round_f32(dsk_dtype dt, float x) {
    switch (dt) {
    case DSK_F16: return dsk_f16_to_f32(dsk_f32_to_f16(x));
    case DSK_BF16: return dsk_bf16_to_f32(dsk_f32_to_bf16(x));
    case DSK_E4M3: return dsk_e4m3_to_f32(dsk_f32_to_e4m3(x));
    case DSK_E5M2: return dsk_e5m2_to_f32(dsk_f32_to_e5m2(x));
    default: return x;
    }
}
/* Any dtype as f64 and back: the cast engine of dsk_tensor_copy on every device. Integers
   convert exactly up to 2^53; stores into integers truncate and saturate (NaN -> 0). */
static inline DSK_HD double dsk_load_f64(const void *p, dsk_dtype dt, int64_t i) {
    switch (dt) {
    case DSK_F64: return ((const double *)p)[i];
    case DSK_I32: return ((const int32_t *)p)[i];
    case DSK_I64: return (double)((const int64_t *)p)[i];
    case DSK_U8: return ((const uint8_t *)p)[i];
    default: return dsk_f32_to_f64(dsk_load_f32(p, dt, i));
    }
}
static inline DSK_HD void dsk_store_f64(void *p, dsk_dtype dt, int64_t i, double x) {
    switch (dt) {
    case DSK_F64: ((double *)p)[i] = x; break;
    case DSK_I32: ((int32_t *)p)[i] = (int32_t)dsk_f64_to_int(x, -2147483648.0, 2147483647.0); break;
    case DSK_I64: ((int64_t *)p)[i] = dsk_f64_to_int(x, -9223372036854775808.0, 9223372036854774784.0); break;
    case DSK_U8: ((uint8_t *)p)[i] = (uint8_t)dsk_f64_to_int(x, 0.0, 255.0); break;
    default: (void)dsk_store_f32(p, dt, i, dsk_f64_to_f32(x)); break;
    }
}
/* Element si of s to element di of d, both of `size` bytes: bit exact (NaN payloads, int64). */
static inline DSK_HD void dsk_move_elem(void *d, int64_t di, const void *s, int64_t si, size_t size) {
    switch (size) {
    case 8: ((uint64_t *)d)[di] = ((const uint64_t *)s)[si]; break;
    case 4: ((uint32_t *)d)[di] = ((const uint32_t *)s)[si]; break;
    case 2: ((uint16_t *)d)[di] = ((const uint16_t *)s)[si]; break;
    default: ((uint8_t *)d)[di] = ((const uint8_t *)s)[si]; break;
    }
}

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

/* Instruction set of the CPU kernels: the GEMM micro-kernel (and so every CPU product), the row
   primitives (softmax, norms, SwiGLU, RoPE, attention, cross-entropy) and AdamW. */
typedef enum dsk_cpu_isa {
    DSK_CPU_ISA_AUTO = 0,    /* the best this CPU and build have */
    DSK_CPU_ISA_PORTABLE,    /* plain C, 4 x 16 tiles */
    DSK_CPU_ISA_AVX2,        /* AVX2 + FMA, 6 x 16 tiles */
    DSK_CPU_ISA_AVX512       /* AVX-512F, 12 x 32 tiles */
} dsk_cpu_isa;

typedef struct dsk_ctx_opts {
    dsk_device_pref device;  /* default DSK_PREFER_AUTO */
    int cuda_index;          /* CUDA device ordinal, default 0 */
    size_t workspace_bytes;  /* device workspace for cuBLAS and reductions, default 32 MiB */
    /* CPU threads for ops. Default: OpenMP's maximum (omp_get_max_threads(), which
       OMP_NUM_THREADS and omp_set_num_threads set); when OMP_NUM_THREADS is not set, at most
       this rank's share of the cores, omp_get_num_procs() / LOCAL_WORLD_SIZE (at least 1), so
       local ranks (torchrun, dsk_comm_spawn_local) do not each start a thread per core and
       fight over them. A LOCAL_WORLD_SIZE that is not a positive integer counts as 1. */
    int n_threads;
    /* CPU kernels, default DSK_CPU_ISA_AUTO; one the CPU lacks is an error (DSK_ERR_UNSUPPORTED).
       AUTO reads the environment variable DSK_CPU_ISA = portable | avx2 | avx512 | auto (unset,
       empty or auto: the best this CPU and build have); an explicit cpu_isa wins over it. An
       unknown name is DSK_ERR_ARG, an ISA this CPU or build lacks DSK_ERR_UNSUPPORTED, both from
       dsk_ctx_init naming the variable and its value. So DSK_CPU_ISA=avx2 runs a program on an
       AVX-512 machine as on an AVX2 one. The calls without a ctx (dsk_sgemm_cpu, dsk_swiglu_cpu,
       dsk_swiglu_grad_cpu, CPU ops given ctx NULL) read it too, through dsk_cpu_isa_auto(). */
    dsk_cpu_isa cpu_isa;
} dsk_ctx_opts;

/* What the host waited for on a CUDA context: every stream synchronisation made through the
   dsk wrappers (dsk_ctx_sync and the library's own) and every device-to-host copy (each also
   waits, or is waited for). A test reads them before and after a call to prove the call made
   the device stop for nothing. */
typedef struct dsk_ctx_counters {
    int64_t syncs;          /* cudaStreamSynchronize on the context's stream */
    int64_t d2h_copies;     /* device-to-host copies */
    int64_t d2h_bytes;
} dsk_ctx_counters;

/* Execution context passed to every op. CPU ops accept ctx == NULL. */
typedef struct dsk_ctx {
    dsk_device device;       /* where ops run and tensors are allocated by default */
    void *stream;            /* cudaStream_t of the context (CUDA only) */
    void *cublas;            /* cublasHandle_t bound to `stream` (CUDA only) */
    void *workspace;         /* device workspace (CUDA only) */
    size_t workspace_bytes;
    int n_threads;
    dsk_ctx_counters counters; /* host waits on the device, counted (CUDA only) */
    dsk_cpu_isa cpu_isa;     /* resolved: never DSK_CPU_ISA_AUTO after dsk_ctx_init */
} dsk_ctx;

/* 1 if this build has CUDA and a device and driver are usable at run time, else 0. */
DSK_API int dsk_cuda_available(void);
DSK_API dsk_status dsk_ctx_init(dsk_ctx *ctx, const dsk_ctx_opts *opts); /* opts may be NULL */
DSK_API void dsk_ctx_free(dsk_ctx *ctx);                                  /* zeroed/freed ok */
DSK_API dsk_status dsk_ctx_sync(dsk_ctx *ctx); /* waits for the context's stream */
/* Threads a CPU op on ctx runs on: ctx->n_threads, else (NULL ctx or 0) dsk_ctx_opts.n_threads' default. */
DSK_API int dsk_ctx_threads(const dsk_ctx *ctx);
DSK_API dsk_device dsk_cpu(void);
/* The best CPU GEMM instruction set this CPU and build have (checked at run time). */
DSK_API dsk_cpu_isa dsk_cpu_isa_best(void);
/* What DSK_CPU_ISA_AUTO means now: DSK_CPU_ISA's value when it names an ISA this CPU and build
   have, else dsk_cpu_isa_best() (a bad value falls back here; dsk_ctx_init reports it). Read
   from the environment at each call, nothing cached. */
DSK_API dsk_cpu_isa dsk_cpu_isa_auto(void);
DSK_API int dsk_cpu_isa_supported(dsk_cpu_isa isa); /* 1 if usable here (AUTO: 0) */
DSK_API const char *dsk_cpu_isa_name(dsk_cpu_isa isa); /* "avx512", ...; "invalid" */
/* Writes the kernel `isa` selects, e.g. "avx512 12x32", into buf (terminated); returns buf. */
DSK_API const char *dsk_cpu_gemm_describe(dsk_cpu_isa isa, char *buf, size_t n);

/* CUDA graphs: everything enqueued on ctx's stream between begin and end is recorded (not run)
   and replayed by dsk_graph_launch as one launch. A captured call must neither synchronise nor
   copy to pageable host memory nor allocate outside the stream's pool; the CUDA runtime fails
   the capture if it does (DSK_ERR_CUDA naming the call). CPU ctx: DSK_ERR_UNSUPPORTED. */
typedef struct dsk_graph { void *graph, *exec; } dsk_graph;
DSK_API dsk_status dsk_graph_begin(dsk_ctx *ctx);
DSK_API dsk_status dsk_graph_end(dsk_ctx *ctx, dsk_graph *g); /* g: the instantiated graph */
DSK_API dsk_status dsk_graph_launch(dsk_ctx *ctx, const dsk_graph *g);
DSK_API void dsk_graph_free(dsk_graph *g);                     /* zeroed/freed ok */

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
   Device memory comes from cudaMallocAsync on ctx's stream. Every constructor of a shape
   (alloc, wrap, reshape, slice) refuses one whose size does not fit: the product of its
   nonzero dims (so every contiguous stride) times the element size must be at most
   PTRDIFF_MAX bytes, else DSK_ERR_ARG naming the shape (never a wrapped count of 0). */
DSK_API dsk_status dsk_tensor_alloc(dsk_ctx *ctx, dsk_tensor *t, dsk_dtype dt, int ndim, const int64_t *shape);
/* As dsk_tensor_alloc on an explicit device. */
DSK_API dsk_status dsk_tensor_alloc_on(dsk_ctx *ctx, dsk_device dev, dsk_tensor *t, dsk_dtype dt, int ndim, const int64_t *shape);
/* Releases an owning tensor and zeroes *t; views and zeroed tensors are just zeroed. */
DSK_API void dsk_tensor_free(dsk_ctx *ctx, dsk_tensor *t);
/* Allocator accounting per device, like torch.cuda.memory_allocated / max_memory_allocated:
   bytes held by tensors that dsk_tensor_alloc made and dsk_tensor_free has not released, and
   their high-water mark. Process-wide atomic counters (the one shared state besides the error
   message). A tensor counts dsk_tensor_nbytes when allocated and again when released, so an
   owning tensor's shape and dtype must not be edited in between; views, wrapped memory and
   the modules' private scratch (DSK_MALLOC) are not counted. CUDA devices 0..63. */
typedef struct dsk_tensor_mem {
    int64_t live_bytes; /* held now */
    int64_t peak_bytes; /* most held at once since the start or the last dsk_tensor_mem_reset_peak */
    int64_t allocs;     /* allocations so far */
} dsk_tensor_mem;
DSK_API dsk_tensor_mem dsk_tensor_mem_stats(dsk_device dev);
DSK_API void dsk_tensor_mem_reset_peak(dsk_device dev); /* peak <- live */
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

/* ------------------------------------------------------------------ elementwise math
   Shared by the CPU ops below and the CUDA kernels (kernels/tensor.cu), so both paths
   run the same arithmetic. */

/* e^x in f32 within 2 ulp: x = n ln2 + r with |r| <= ln2/2 (Cody-Waite, two FMAs), e^r by
   Cephes' degree-6 polynomial, 2^n applied in two halves so subnormal results round once; NaN
   stays NaN, x > 88.73 gives Inf, x < -103.98 gives 0. The vector CPU kernels repeat these
   operations lane by lane, so scalar and vector paths give the same bits. */
static inline DSK_HD float dsk_exp_f(float x) {
    float xc = x > -104.0f ? (x < 89.0f ? x : 89.0f) : -104.0f; /* NaN -> -104, replaced below */
    float t = fmaf(xc, 1.44269504088896341f, 12582912.0f);      /* 1.5 * 2^23: rounds to an integer */
    float n = t - 12582912.0f, r, p, y;
    int32_t ni = (int32_t)n, n1 = (ni - (ni & 1)) / 2, n2 = ni - n1; /* n1 = floor(n / 2) */
    r = fmaf(n, -0.693359375f, xc);
    r = fmaf(n, 2.12194440e-4f, r);
    p = fmaf(1.9875691500e-4f, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    y = fmaf(p, r * r, r) + 1.0f;
    y = y * dsk_bits_f32((uint32_t)(n1 + 127) << 23) * dsk_bits_f32((uint32_t)(n2 + 127) << 23);
    return x != x ? x : y;
}
static inline DSK_HD float dsk_sigmoid_f(float x) { return 1.0f / (1.0f + dsk_exp_f(-x)); }
static inline DSK_HD float dsk_silu_f(float x) { return x * dsk_sigmoid_f(x); }
/* d silu(x) / dx = s (1 + x (1 - s)), s = sigmoid(x); one explicit FMA, so no compiler's
   contraction choice can make the vector kernels' bits differ. */
static inline DSK_HD float dsk_silu_grad_f(float x) {
    float s = dsk_sigmoid_f(x);
    return s * fmaf(x, 1.0f - s, 1.0f);
}
static inline DSK_HD float dsk_swiglu_f(float gate, float up) { return dsk_silu_f(gate) * up; }
/* Gradients of out = silu(gate) * up given dout (to be accumulated by the caller). */
static inline DSK_HD void dsk_swiglu_grad_f(float gate, float up, float dout, float *dgate, float *dup) {
    *dgate = dout * up * dsk_silu_grad_f(gate);
    *dup = dout * dsk_silu_f(gate);
}
/* RoPE frequency of pair i (0 <= i < dh/2): theta^(-2i/dh). */
static inline DSK_HD float dsk_rope_freq(int64_t i, int64_t dh, float theta) { return powf(theta, -2.0f * (float)i / (float)dh); }
/* RoPE angle of pair i at position pos: pos * theta^(-2i/dh). */
static inline DSK_HD float dsk_rope_angle(int64_t pos, int64_t i, int64_t dh, float theta) {
    return (float)pos * dsk_rope_freq(i, dh, theta);
}
/* Rotates (x0, x1) by the angle with cosine c and sine s; backward passes -s. */
static inline DSK_HD void dsk_rope_rotate(float x0, float x1, float c, float s, float *y0, float *y1) {
    *y0 = x0 * c + x1 * -s; /* not x0 c - x1 s: gcc -O3 vectorises that into fused multiply-add-subtracts */
    *y1 = x0 * s + x1 * c;
}

/* The elementwise ops, out = dsk_ew_f(op, x, y, alpha), one rounding per f32 operation (no
   contraction into an FMA on either device): each entry is the op's value, its public function and
   that function's form. A BINARY op (out = f(a, b)) gets its body from this list; an OWN one (the
   forms of dsk_scale and dsk_axpy) writes its argument checks and calls dsk__ew_run. The CPU loop
   (dsk__ew), the one device dispatch (dsk__ew_run) and the CUDA kernel (dsk_cuda_elementwise) take
   every entry as it is; dsk_ew_f's switch has no default, so an entry without its math does not
   compile (-Wswitch, as ggml's static assertion on GGML_OP_COUNT). */
#define DSK_EW_OPS(X) \
    X(DSK_EW_ADD, dsk_add, BINARY) \
    X(DSK_EW_MUL, dsk_mul, BINARY) X(DSK_EW_AXPY, dsk_axpy, OWN) X(DSK_EW_SCALE, dsk_scale, OWN)
#define DSK__EW_ENUM(op, name, form) op,
#define DSK__EW_NAME(op, name, form) #name,
typedef enum dsk_ew_op { DSK_EW_OPS(DSK__EW_ENUM) DSK_EW_COUNT } dsk_ew_op;
#if defined(__CUDA_ARCH__)
#define DSK__FADD_RN(a, b) __fadd_rn(a, b)
#define DSK__FMUL_RN(a, b) __fmul_rn(a, b)
#else
#define DSK__FADD_RN(a, b) ((a) + (b))
#define DSK__FMUL_RN(a, b) ((a) * (b))
#endif
static inline DSK_HD float dsk_ew_f(dsk_ew_op op, float x, float y, float alpha) {
    switch (op) {
    case DSK_EW_ADD: return DSK__FADD_RN(x, y);                        /* x + y */
    case DSK_EW_MUL: return DSK__FMUL_RN(x, y);                        /* x * y */
    case DSK_EW_AXPY: return DSK__FADD_RN(x, DSK__FMUL_RN(alpha, y));  /* x + alpha y */
    case DSK_EW_SCALE: return DSK__FMUL_RN(alpha, x);                  /* alpha x */
    case DSK_EW_COUNT: break;                                          /* not an op */
    }
    return x;
}

/* ------------------------------------------------------------------ ops
   Unless a comment says otherwise: tensors are contiguous and on one device (CUDA tensors
   need a ctx on that device; CPU ops accept ctx == NULL); float tensors are f32, bf16 or
   f16 with math in f32, and the float tensors of one op share a dtype; index tensors are
   i32; outputs are written, and backward outputs (dx, dw, ...) are accumulated. Index
   ranges are checked on the CPU path only (a CUDA launcher may assume valid indices). */

/* C = alpha * op(A) op(B) + beta * C, op(X) = X or X^T; A (M,K), B (K,N), C (M,N) after op.
   3-D operands (batch, rows, cols) form a strided batched product; a 2-D A or B is shared
   by every batch. A and B: same dtype, f32/bf16/f16; C: f32 or A's dtype; f32 accumulation.
   Each matrix needs unit stride in its last dim; leading strides are free (views work).
   beta == 0 ignores C's prior contents (NaN included). C must not overlap A or B. On the CPU
   the result is bitwise the same for any ctx->n_threads (fixed summation order).
   Rows contract (CPU, every op here that works row by row: matmul, matmul_grouped and
   swiglu_grouped, softmax, rmsnorm, silu, swiglu, cross-entropy's dlogits, rope, attention and
   fused attention per sequence, gathers, elementwise ops, AdamW per element, and their backward
   passes' per-row outputs): on a given ISA (ctx->cpu_isa), a row's result has the same bits
   whatever the number of rows in the call, however a batch is split between calls (data,
   pipeline and sequence parallelism cut it differently), and for any thread count. Tile edges,
   short tiles and vector tails run the same arithmetic as full ones (masked lanes, the same
   fused multiply-adds, dsk_exp_f's operations); only the ISA may change the bits. Sums over rows
   (weight gradients, the loss) are not per-row results: their order follows the rows given. */
DSK_API dsk_status dsk_matmul(dsk_ctx *ctx, dsk_tensor *C, const dsk_tensor *A, int trans_a,
                              const dsk_tensor *B, int trans_b, float alpha, float beta);
/* Raw row-major f32 GEMM on the CPU: C = alpha*op(A)op(B) + beta*C with leading dims
   (op(A) is M x K, op(B) K x N); n_threads <= 0 means dsk_ctx_opts' default. Cache-blocked, on the
   micro-kernel of dsk_cpu_isa_auto() (AVX-512, AVX2/FMA or portable, chosen at run time); same
   bits for any thread count. Cannot fail: without memory for its buffers it computes the
   product with plain loops. */
DSK_API void dsk_sgemm_cpu(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                           const float *A, int64_t lda, const float *B, int64_t ldb, float beta,
                           float *C, int64_t ldc, int n_threads);

/* Raw f32 SwiGLU on the CPU for i < n, vectorised for dsk_cpu_isa_auto() with the same bits as
   dsk_swiglu_f / dsk_swiglu_grad_f: out = silu(gate) up; dgate, dup = the gradients for dout,
   WRITTEN (dgate may be dout). One thread; for callers that own their loops (dsk_moe.h). */
DSK_API void dsk_swiglu_cpu(int64_t n, const float *gate, const float *up, float *out);
DSK_API void dsk_swiglu_grad_cpu(int64_t n, const float *gate, const float *up, const float *dout, float *dgate, float *dup);

DSK_API dsk_status dsk_add(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *a, const dsk_tensor *b); /* out = a + b (out may alias) */
DSK_API dsk_status dsk_mul(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *a, const dsk_tensor *b); /* out = a * b */
DSK_API dsk_status dsk_scale(dsk_ctx *ctx, dsk_tensor *t, float alpha);                            /* t *= alpha */
/* y += alpha x; x has y's dtype, or is f32 for a bf16/f16 y (an f32 partial result added with
   one rounding). */
DSK_API dsk_status dsk_axpy(dsk_ctx *ctx, dsk_tensor *y, float alpha, const dsk_tensor *x);

typedef enum dsk_reduce_op { DSK_REDUCE_SUM = 0, DSK_REDUCE_MEAN, DSK_REDUCE_MAX } dsk_reduce_op;
/* out = reduce of `in` along `axis` (negative counts from the end); out has in's shape without
   that axis (or with it as 1) and in's dtype. Sums in f64 on the CPU; max propagates NaN;
   an empty axis gives sum 0, mean NaN, max -Inf. */
DSK_API dsk_status dsk_reduce(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *in, int axis, dsk_reduce_op op);
/* out (scalar f32: one element) = sum of squares of all elements of `in` (any float dtype,
   f32/bf16/f16), accumulated in f64 on the CPU and in a fixed-order f32 tree on the GPU. */
DSK_API dsk_status dsk_sum_squares(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *in);

/* Row softmax over the last dim: x, y (..., C). Backward: dx += y * (dy - sum(dy * y)). */
DSK_API dsk_status dsk_softmax(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x);
DSK_API dsk_status dsk_softmax_backward(dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *y, const dsk_tensor *dy);

/* RMSNorm over the last dim: y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps).
   x, y (..., D); w (D); rstd f32 with x's shape without the last dim, saved for backward
   (may be NULL in forward). Backward: dx and dw may each be NULL (not computed). */
DSK_API dsk_status dsk_rmsnorm(dsk_ctx *ctx, dsk_tensor *y, dsk_tensor *rstd, const dsk_tensor *x, const dsk_tensor *w, float eps);
DSK_API dsk_status dsk_rmsnorm_backward(dsk_ctx *ctx, dsk_tensor *dx, dsk_tensor *dw, const dsk_tensor *dy,
                                        const dsk_tensor *x, const dsk_tensor *w, const dsk_tensor *rstd);

/* How a backward function stores its gradient outputs (the last argument of dsk_swiglu_backward,
   dsk_rope_backward, dsk_attention_backward and dsk_attention_fused_backward):
     DSK_GRAD_ADD    added to what the outputs hold (a tensor's gradients from several uses sum there);
     DSK_GRAD_WRITE  written over them: they are not read, so they need no clearing first (NaN there is
                     not carried) and an activation gradient costs one pass less.
   Either gives the values DSK_GRAD_ADD gives into zeros (a zero's sign aside: -0 + +0 is +0). */
typedef enum dsk_grad_store { DSK_GRAD_ADD = 0, DSK_GRAD_WRITE = 1 } dsk_grad_store;

/* SiLU y = x * sigmoid(x); SwiGLU out = silu(gate) * up. */
DSK_API dsk_status dsk_silu(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x);
DSK_API dsk_status dsk_silu_backward(dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *dy, const dsk_tensor *x);
DSK_API dsk_status dsk_swiglu(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *gate, const dsk_tensor *up);
DSK_API dsk_status dsk_swiglu_backward(dsk_ctx *ctx, dsk_tensor *dgate, dsk_tensor *dup, const dsk_tensor *dout,
                                       const dsk_tensor *gate, const dsk_tensor *up, dsk_grad_store store);

/* Embedding: out (..., D) = table (V, D) rows at ids (...) i32. Backward: dtable[ids[t]] += dout[t],
   in token order (deterministic, no float atomics). Ids out of range are an error. */
DSK_API dsk_status dsk_embedding(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *table, const dsk_tensor *ids);
DSK_API dsk_status dsk_embedding_backward(dsk_ctx *ctx, dsk_tensor *dtable, const dsk_tensor *dout, const dsk_tensor *ids);

/* Fused softmax cross-entropy from logits (..., V) and targets (...) i32. loss (scalar f32) =
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
   to the lower index; NaN ranks below every number; 1 <= k <= C. */
DSK_API dsk_status dsk_topk(dsk_ctx *ctx, dsk_tensor *values, dsk_tensor *indices, const dsk_tensor *x, int k);

/* Rotary position embedding on x (B, T, H, Dh), Dh even, pairs (2i, 2i+1) rotated by
   angle (pos0 + t) * theta^(-2i/Dh) (dsk_rope_angle, dsk_rope_rotate); y may alias x.
   Backward rotates dy by the negative angle into dx (added or written: store). */
DSK_API dsk_status dsk_rope(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x, int64_t pos0, float theta);
DSK_API dsk_status dsk_rope_backward(dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *dy, int64_t pos0, float theta,
                                     dsk_grad_store store);

/* Causal self-attention with q, k, v, out (B, T, H, Dh): probs (B, H, T, T) f32 is written
   (saved for backward; entries above the diagonal are 0); out = softmax(scale q k^T + mask) v.
   Backward adds to or writes dq, dk, dv (store). CPU: f32 GEMMs per (b, h) (bf16/f16 converted to f32, results
   rounded once), softmax in f32; the same bits for any ctx->n_threads. */
DSK_API dsk_status dsk_attention(dsk_ctx *ctx, dsk_tensor *out, dsk_tensor *probs, const dsk_tensor *q,
                                 const dsk_tensor *k, const dsk_tensor *v, float scale);
DSK_API dsk_status dsk_attention_backward(dsk_ctx *ctx, dsk_tensor *dq, dsk_tensor *dk, dsk_tensor *dv,
                                          const dsk_tensor *dout, const dsk_tensor *q, const dsk_tensor *k,
                                          const dsk_tensor *v, const dsk_tensor *probs, float scale,
                                          dsk_grad_store store);

/* ------------------------------------------------------------------ grouped rows
   Building blocks of Mixture-of-Experts layers (dsk_moe.h), usable for any computation on rows
   grouped into contiguous segments. Segment g of a 2-D tensor with R rows is rows
   [offsets[g], offsets[g + 1]) for offsets (G + 1) i32, non-decreasing, offsets[0] >= 0 and
   offsets[G] <= R. The offsets live on the tensors' device and are read there: a CUDA launch
   is sized from the shapes (bounds) alone and never copies them to the host, so a GPU caller
   can compute them on the device and never wait for them. The CPU path checks them; rows
   outside [offsets[0], offsets[G]) are neither read nor written. Every result has a fixed
   summation order (no float atomics), the same on every run. */

/* Stable counting sort of keys (N) i32 by key into G = offsets.shape[0] - 1 groups: offsets
   (G + 1) i32 gets offsets[g] = the number of keys < g among the keys in [0, G); perm (N) i32
   gets, at position j < offsets[G], the index of the j-th such key in (key, index) order, and
   -1 at j >= offsets[G]. Keys outside [0, G) (-1 say) are left out. */
DSK_API dsk_status dsk_group_by_key(dsk_ctx *ctx, dsk_tensor *perm, dsk_tensor *offsets, const dsk_tensor *keys);

/* Grouped matmul over row segments (A, B: f32, bf16 or f16 alike; C: f32 or A's dtype; f32
   accumulation; alpha, beta and beta == 0 as in dsk_matmul). Two forms:
     rows:    C (R, N), A (R, K), trans_a = 0, B (G, K, N) or with trans_b (G, N, K):
              row r of segment g: C[r] = alpha * A[r] op(B[g]) + beta * C[r];
     weights: C (G, M, N), A (R, M) with trans_a = 1, B (R, N) with trans_b = 0:
              C[g] = alpha * A[seg g]^T B[seg g] + beta * C[g] (beta * C[g] for an empty segment).
   The rows form gives an expert layer's forward and input gradient, the weights form its weight
   gradients. CPU: the segments' GEMMs run in parallel, each with dsk_matmul's kernel and its bits. */
DSK_API dsk_status dsk_matmul_grouped(dsk_ctx *ctx, dsk_tensor *C, const dsk_tensor *A, int trans_a,
                                      const dsk_tensor *B, int trans_b, const dsk_tensor *offsets, float alpha,
                                      float beta);

/* A SwiGLU MLP per row segment (the routed experts of an MoE layer): for the rows r of segment g,
   h1[r] = x[r] W1[g]^T and h3[r] = x[r] W3[g]^T (F each), a[r] = silu(h1[r]) h3[r], out[r] =
   a[r] W2[g]^T (D). x, out (R, D); h1, h3, a (R, F), saved for the backward; w1, w3 (G, F, D),
   w2 (G, D, F); one dtype (f32, bf16 or f16: GEMMs accumulate in f32 and round their results
   to it). out's rows outside the segments are not written; h1, h3 and a there are scratch.
   The CPU runs each segment's whole MLP on one thread, segments side by side (each GEMM as
   dsk_matmul would: the same bits); CUDA three grouped matmuls and dsk_swiglu. */
DSK_API dsk_status dsk_swiglu_grouped(dsk_ctx *ctx, dsk_tensor *out, dsk_tensor *h1, dsk_tensor *h3, dsk_tensor *a,
                                      const dsk_tensor *x, const dsk_tensor *w1, const dsk_tensor *w2,
                                      const dsk_tensor *w3, const dsk_tensor *offsets);
/* Its backward from dout (R, D): dx (R, D) WRITTEN on the segments' rows (an intermediate, as
   dsk_cross_entropy's dlogits); dw1, dw3 (G, F, D) and dw2 (G, D, F), f32 or x's dtype,
   accumulated; da, dh1, dh3 (R, F) of x's dtype are scratch (overwritten). */
DSK_API dsk_status dsk_swiglu_grouped_backward(dsk_ctx *ctx, dsk_tensor *dx, dsk_tensor *dw1, dsk_tensor *dw2,
                                               dsk_tensor *dw3, dsk_tensor *da, dsk_tensor *dh1, dsk_tensor *dh3,
                                               const dsk_tensor *dout, const dsk_tensor *x, const dsk_tensor *h1,
                                               const dsk_tensor *h3, const dsk_tensor *a, const dsk_tensor *w1,
                                               const dsk_tensor *w2, const dsk_tensor *w3, const dsk_tensor *offsets);

/* out (N, D) row i = scale[i] * src (R, D) row idx[i], math in f32 and rounded once; scale (N)
   f32 or NULL (a plain copy of the row); idx (N) i32, a negative idx[i] gives a zero row (the
   padding of a buffer sized by a bound). out and src share a dtype: f32, bf16, f16, or, for
   plain copies (scale NULL), e4m3 and e5m2 codes. */
DSK_API dsk_status dsk_gather_rows_scaled(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *src, const dsk_tensor *idx,
                                          const dsk_tensor *scale);

/* ------------------------------------------------------------------ AdamW */

/* AdamW hyperparameters, taken literally: the exception to "zero means the default", since lr,
   beta1 and beta2 of 0 are valid settings (a schedule that decays to lr 0, beta1 0 for RMSProp-
   like steps; PyTorch accepts them). Start from dsk_adamw_defaults() and change what differs.
   Ranges: lr >= 0, beta1 and beta2 in [0, 1), eps > 0 (0 would turn 0 / 0 into NaN weights and
   is what a zeroed struct holds), weight_decay >= 0, all finite. */
typedef struct dsk_adamw_opts {
    float lr;
    float beta1;
    float beta2;
    float eps;
    float weight_decay; /* decoupled: p -= lr * wd * p */
} dsk_adamw_opts;

/* PyTorch's torch.optim.AdamW defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01. */
static inline dsk_adamw_opts dsk_adamw_defaults(void) {
    dsk_adamw_opts o;
    o.lr = 1e-3f;
    o.beta1 = 0.9f;
    o.beta2 = 0.999f;
    o.eps = 1e-8f;
    o.weight_decay = 0.01f;
    return o;
}

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

/* Bias correction 1 - beta^step, computed in f64 and rounded to f32 (host and device). */
static inline DSK_HD float dsk_adamw_bias_correction(float beta, int64_t step) {
    return (float)(1.0 - pow((double)beta, (double)step));
}

/* One AdamW step at `step` (1-based) on f32 master weights `param` with moments m, v (all the
   same shape; m and v both f32 or both bf16) from `grad` (f32, bf16 or f16) times `grad_mult`
   (fuses loss unscaling and clipping). bf16 moments (DeepSeek-V3's, half the optimizer state)
   are read into f32, updated by dsk_adamw_update as f32 ones are, and rounded back to nearest
   even; the weights get the update computed from the unrounded moments. If `param_copy` is not
   NULL (bf16, f16 or f32, same shape) it receives the updated weights rounded to nearest even.
   opts NULL means dsk_adamw_defaults();
   the CUDA launcher receives validated opts. */
DSK_API dsk_status dsk_adamw_step(dsk_ctx *ctx, dsk_tensor *param, const dsk_tensor *grad, dsk_tensor *m, dsk_tensor *v,
                                  const dsk_adamw_opts *opts, int64_t step, float grad_mult, dsk_tensor *param_copy);

/* ------------------------------------------------------------------ fused attention
   Causal self-attention that never forms the T x T score matrix: the FlashAttention-2
   algorithm (Dao, 2023): tiles of queries meet tiles of keys under an online softmax, and
   backward recomputes the scores from the rows' log-sum-exp, the one statistic forward saves.
   q, k (B, T, H, Dk); v (B, T, H, Dv); out (B, T, H, Dv). Dk and Dv may differ (multi-head
   latent attention: Dk = qk_nope + qk_rope, Dv = v_head_dim). Every 4-D tensor of a call has
   the one float dtype (f32, bf16, f16) and unit stride in its last dim; the other strides are
   free, so slices of a wider projection need no copy. Output rows must not overlap inputs.
   out[b,i,h] = sum_{j <= i} softmax_j(scale q[b,i,h] . k[b,j,h]) v[b,j,h], in f32 with one
   rounding to the dtype. lse (B, H, T) f32 contiguous: the row's log of sum_j e^(scale q.k)
   (natural log), written by forward (NULL: not kept), read by backward.
   Memory beyond the tensors: tiles per thread plus O(B H T) for the row statistics.
   CPU: 64 x 64 tiles through the GEMM micro-kernel and row primitives of ctx->cpu_isa (the exp
   is dsk_exp_f, on the GPU too), threads over (batch, head, query tile); backward
   over (batch, head) when there are enough of them, else in two passes over key tiles (dk, dv)
   and query tiles (dq); every sum keeps its order either way, so the bits are the same for any
   ctx->n_threads. CUDA (kernels/attention.cu): bf16 and f16 on tensor cores (WMMA, f32
   accumulation), f32 on CUDA cores. The materialised dsk_attention stays as the reference. */

/* A row's log-sum-exp from its running maximum m and its sum l of e^(s - m). */
static inline DSK_HD float dsk_attn_lse(float m, float l) { return m + logf(l); }
/* Gradient of a score from its probability p, the gradient dp of p and the row's
   D = sum_j p_j dp_j = dout . out: dS = p (dp - D). */
static inline DSK_HD float dsk_attn_dscore(float p, float dp, float d) { return p * (dp - d); }

/* Forward: out and (unless NULL) lse written. */
DSK_API dsk_status dsk_attention_fused(dsk_ctx *ctx, dsk_tensor *out, dsk_tensor *lse, const dsk_tensor *q,
                                       const dsk_tensor *k, const dsk_tensor *v, float scale);
/* Backward from forward's out and lse: dq (like q), dk (like k), dv (like v) take the gradients
   of out given dout (like out), each rounded once into its dtype: added, or written (store: the
   kernels sum over tiles into the outputs, so DSK_GRAD_WRITE clears them first, with no gain). */
DSK_API dsk_status dsk_attention_fused_backward(dsk_ctx *ctx, dsk_tensor *dq, dsk_tensor *dk, dsk_tensor *dv,
                                                const dsk_tensor *dout, const dsk_tensor *q, const dsk_tensor *k,
                                                const dsk_tensor *v, const dsk_tensor *out, const dsk_tensor *lse,
                                                float scale, dsk_grad_store store);

/* ------------------------------------------------------------------ FP8 GEMM
   Block-scaled FP8 products in DeepSeek-V3's recipe (technical report, section 3.3). Operands
   are e4m3 (or e5m2) codes q with f32 dequantisation scales s, x ~ q * s, one scale per 128
   elements of K (DSK_FP8_BLOCK) in one of two layouts, for an operand of R rows and K columns:
     DSK_FP8_TILE_1X128     activations, output gradients: scales (R, ceil(K/128)), row r, chunk c
     DSK_FP8_BLOCK_128X128  weights: scales (ceil(R/128), ceil(K/128)), block (r / 128, c)
   (what dsk_amp_fp8_block_quantize in dsk_amp.h writes with blocks 1x128 and 128x128). Both
   operands are K-major, as in DeepGEMM: C (M, N) = alpha * A (M, K) B (N, K)^T + beta * C, a
   linear layer's y = x w^T. Its other two GEMMs take transposed operands, quantised from the
   transposes (dsk_amp_fp8_block_quantize_t): the input gradient dx = dy w with B = w^T in 128x128
   blocks, the weight gradient dw = dy^T x with A = dy^T and B = x^T, both 1x128 along the tokens.
   The arithmetic, exactly, on every device: for each C[i,j],
     acc = 0; for each chunk c of K (k in [128c, min(128c + 128, K)), the last one partial):
       dot = sum of a[i,k] * b[j,k] in f32, k ascending        (dsk_fp8_chunk_dot)
       acc = fmaf(dot, sa(i,c) * sb(j,c), acc)                  (dsk_fp8_chunk_acc)
     C[i,j] = alpha * acc, + beta * C[i,j] by one fmaf when beta != 0, rounded once to C's dtype
   (dsk_fp8_out). The product of two fp8 values is exact in f32, so a fused or a separate
   multiply-add gives the same dot, and the CPU loops and the CUDA kernel (kernels/fp8.cu), which
   call these three functions, agree bit for bit. Each C[i,j] depends only on row i of A, row j of
   B and their scales: the rows contract of dsk_matmul holds (any row count, split or thread
   count). A NaN or Inf among the values or scales a C[i,j] reads makes it non-finite: a block
   that dsk_amp_fp8_block_quantize saw holding an Inf or a NaN (non-finite scale, NaN codes)
   turns every output that reads it into NaN, which a loss scaler's check sees.
   A and B: e4m3 or e5m2 (either each), contiguous; scales f32, contiguous; C f32, bf16 or f16,
   contiguous; beta == 0: C is not read. CPU: tiles of 16 rows x 64 columns on OpenMP threads. CUDA:
   our kernel on CUDA cores (kernels/fp8.cu), not the tensor cores: their FP8 accumulation order
   is not this one. */

#define DSK_FP8_BLOCK 128 /* K elements per scale, rows per weight block */
#define DSK_FP8_DOT_W 16  /* outputs per dsk_fp8_chunk_dot group: sums kept in registers (CPU vectors) */

typedef enum dsk_fp8_scaling {
    DSK_FP8_TILE_1X128 = 1,     /* one scale per row and 128 columns */
    DSK_FP8_BLOCK_128X128 = 128 /* one scale per 128 x 128 block */
} dsk_fp8_scaling;

/* The chunk's partial sums of nj outputs (nj a multiple of DSK_FP8_DOT_W): dot[j] = sum over k
   in [0, n) of a[k] * b[k * ldb + j * ldj], in f32, k ascending (a, b: fp8 values decoded to f32). */
static inline DSK_HD void dsk_fp8_chunk_dot(float *dot, int nj, const float *a, const float *b, int64_t ldb,
                                            int64_t ldj, int n) {
    for (int j0 = 0; j0 < nj; j0 += DSK_FP8_DOT_W) { /* DSK_FP8_DOT_W sums at a time, in registers */
        float s[DSK_FP8_DOT_W];
        for (int j = 0; j < DSK_FP8_DOT_W; j++) s[j] = 0.0f;
        for (int k = 0; k < n; k++) {
            float ak = a[k];
            for (int j = 0; j < DSK_FP8_DOT_W; j++) s[j] += ak * b[k * ldb + (j0 + j) * ldj];
        }
        for (int j = 0; j < DSK_FP8_DOT_W; j++) dot[j0 + j] = s[j];
    }
}
/* A chunk's partial promoted into the f32 accumulator with its two scales. */
static inline DSK_HD float dsk_fp8_chunk_acc(float acc, float dot, float sa, float sb) {
    return fmaf(dot, sa * sb, acc);
}
/* The value stored into C (before rounding to C's dtype); c_old is read only when beta != 0. */
static inline DSK_HD float dsk_fp8_out(float acc, float alpha, float beta, float c_old) {
    return beta != 0.0f ? fmaf(beta, c_old, alpha * acc) : alpha * acc;
}

/* C (M, N) = alpha * A (M, K) B (N, K)^T + beta * C with A's scales in layout a_scaling and B's
   in b_scaling (see above). */
DSK_API dsk_status dsk_matmul_fp8(dsk_ctx *ctx, dsk_tensor *C, const dsk_tensor *A, const dsk_tensor *a_scales,
                                  dsk_fp8_scaling a_scaling, const dsk_tensor *B, const dsk_tensor *b_scales,
                                  dsk_fp8_scaling b_scaling, float alpha, float beta);
/* dsk_matmul_grouped in FP8, its two forms told apart by C's dims; offsets (G + 1) i32 on the
   tensors' device, as there.
     rows (an expert layer's forward and input gradient), C (R, N): for the rows r of segment g,
       C[r] = alpha * A[r] B[g]^T + beta * C[r]. A (R, K) with 1x128 scales (R, ceil(K/128)) (a
       row tile never straddles two experts); B (G, N, K) with scales (G, N, ceil(K/128)) for
       1x128 or (G, ceil(N/128), ceil(K/128)) for 128x128 blocks. Rows outside the segments are
       neither read nor written; each row gets the bits dsk_matmul_fp8 gives it with B[g].
     weights (its weight gradients), C (G, M, N): the segments cut K (the tokens):
       C[g] = alpha * A[:, seg g] B[:, seg g]^T + beta * C[g] (beta * C[g] for an empty segment),
       A (M, R) = dy^T and B (N, R) = x^T as dsk_amp_fp8_block_quantize_t writes them, in 1x128
       tiles along R (scales (M, ceil(R/128))) or, for B, 128x128 blocks. The chunks stay those
       of the scales, on the grid of 128 from row 0: a chunk that a segment boundary cuts adds
       only its rows of the segment, dequantised with the whole tile's scale (so a tile made
       non-finite by an Inf or NaN reaches every segment that shares it). No quantisation needs
       the offsets, and each C[g] gets the bits of the chunk arithmetic over [off[g], off[g + 1])
       on CPU and CUDA alike. */
DSK_API dsk_status dsk_matmul_fp8_grouped(dsk_ctx *ctx, dsk_tensor *C, const dsk_tensor *A, const dsk_tensor *a_scales,
                                          const dsk_tensor *B, const dsk_tensor *b_scales, dsk_fp8_scaling b_scaling,
                                          const dsk_tensor *offsets, float alpha, float beta);

/* ---------------------------------------------------------------- CUDA launchers
   The C entry points of the kernels behind this header: kernels/tensor.cu (the runtime and the
   ops), attention.cu, grouped.cu and fp8.cu, built by nvcc into libdsk_kernels.a (and, for the
   tests, as host C++ against the CUDA emulation in tests/cuda_emu).
   Declared in CUDA builds (DSK_CUDA) and to nvcc; the implementation calls them after validating its arguments (shapes,
   dtypes, devices), so a launcher may assume valid input. Every launcher makes ctx's device current
   on the calling thread and enqueues on ctx->stream; launchers do not synchronise unless their
   comment says so. Each returns DSK_OK or, with dsk_last_error() set: DSK_ERR_ARG (ctx is not an
   initialised CUDA ctx, or a launcher's own argument check), DSK_ERR_OOM (device scratch memory),
   DSK_ERR_UNSUPPORTED (sizes beyond a grid or cuBLAS limit), DSK_ERR_CUDA (a failed CUDA or cuBLAS
   call; every call is checked, and cudaGetLastError() follows every launch, through
   kernels/dsk_cuda.cuh). The headers above this one declare the launchers of
   their own kernels (dsk_amp.h: kernels/amp.cu, dsk_moe.h: moe.cu, dsk_par.h: par.cu). */
#if defined(DSK_CUDA) || defined(__CUDACC__) /* a CUDA build, or nvcc compiling the kernels */
/* ---- runtime (kernels/tensor.cu) */
dsk_status dsk_cuda_device_count(int *n);              /* 0 devices (no driver) is DSK_OK with *n = 0 */
dsk_status dsk_cuda_ctx_init(dsk_ctx *ctx, int index); /* sets device, stream, cuBLAS handle, workspace */
void dsk_cuda_ctx_free(dsk_ctx *ctx);                  /* releases what ctx_init made; safe on partial init */
dsk_status dsk_cuda_sync(dsk_ctx *ctx);                /* cudaStreamSynchronize(ctx->stream) */
dsk_status dsk_cuda_malloc(dsk_ctx *ctx, size_t bytes, void **p); /* cudaMallocAsync on ctx->stream */
void dsk_cuda_free(dsk_ctx *ctx, void *p); /* cudaFreeAsync on ctx->stream (sync free if ctx NULL) */
/* to_device = 1: host -> device, 0: device -> host; asynchronous on ctx->stream. A device-to-host
   copy counts in ctx->counters (d2h_copies, d2h_bytes), as dsk_cuda_sync counts in syncs. */
dsk_status dsk_cuda_memcpy(dsk_ctx *ctx, void *dst, const void *src, size_t bytes, int to_device);
/* Pinned host memory (cudaHostAlloc; NULL on failure) and its release. */
void *dsk_cuda_host_alloc(size_t bytes);
void dsk_cuda_host_free(void *p);
/* Events on ctx->stream (timing disabled): record one; wait on the host for one (counted as a
   sync unless it had completed already). */
dsk_status dsk_cuda_event_create(void **ev);
dsk_status dsk_cuda_event_record(dsk_ctx *ctx, void *ev);
dsk_status dsk_cuda_event_wait(dsk_ctx *ctx, void *ev);
void dsk_cuda_event_destroy(void *ev);
/* Capture of ctx->stream into a graph (global mode), instantiation, launch, release. */
dsk_status dsk_cuda_graph_begin(dsk_ctx *ctx);
dsk_status dsk_cuda_graph_end(dsk_ctx *ctx, void **graph, void **exec);
dsk_status dsk_cuda_graph_launch(dsk_ctx *ctx, void *exec);
void dsk_cuda_graph_free(void *graph, void *exec);

/* Streams and memory without a dsk_ctx (a communicator's setup, a module's own stream): `stream` is a
   cudaStream_t, NULL the legacy default stream; `ev` an event of dsk_cuda_event_create. */
dsk_status dsk_cuda_set_device(int index);                 /* makes device `index` current on this thread */
dsk_status dsk_cuda_device_bus_id(int index, char *buf, int len); /* its PCI bus id, "0000:3c:00.0" (len >= 13) */
dsk_status dsk_cuda_device_malloc(size_t bytes, void **p); /* cudaMalloc (synchronous); dsk_cuda_free(NULL, p) */
dsk_status dsk_cuda_memcpy_sync(void *dst, const void *src, size_t bytes, int to_device); /* done on return */
dsk_status dsk_cuda_stream_create(void **stream); /* a non-blocking stream on the current device */
dsk_status dsk_cuda_stream_sync(void *stream);
void dsk_cuda_stream_destroy(void *stream);
dsk_status dsk_cuda_stream_done(void *stream, int *done);      /* *done: 1 when all its work is done, else 0 */
dsk_status dsk_cuda_stream_record(void *stream, void *ev);     /* records ev on stream */
dsk_status dsk_cuda_stream_wait_event(void *stream, void *ev); /* stream waits for ev (the host does not) */

/* ---- tensor ops (kernels/tensor.cu): same contracts as the dsk_tensor.h function of the same name */
dsk_status dsk_cuda_tensor_copy(dsk_ctx *ctx, dsk_tensor *dst,
                                const dsk_tensor *src); /* same device, any dtypes/strides */
dsk_status dsk_cuda_tensor_fill(dsk_ctx *ctx, dsk_tensor *t, double value);
dsk_status dsk_cuda_tensor_uniform(dsk_ctx *ctx, dsk_tensor *t, uint64_t seed, uint64_t offset, float lo, float hi);
dsk_status dsk_cuda_tensor_normal(dsk_ctx *ctx, dsk_tensor *t, uint64_t seed, uint64_t offset, float mean, float std);
dsk_status dsk_cuda_matmul(dsk_ctx *ctx, dsk_tensor *C, const dsk_tensor *A, int trans_a, const dsk_tensor *B,
                           int trans_b, float alpha, float beta);
/* out = dsk_ew_f(op, x, y, alpha) per element (y NULL for DSK_EW_SCALE): every elementwise op */
dsk_status dsk_cuda_elementwise(dsk_ctx *ctx, dsk_ew_op op, dsk_tensor *out, const dsk_tensor *x, const dsk_tensor *y,
                                float alpha);
dsk_status dsk_cuda_reduce(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *in, int axis, dsk_reduce_op op);
dsk_status dsk_cuda_sum_squares(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *in);
dsk_status dsk_cuda_softmax(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x);
dsk_status dsk_cuda_softmax_backward(dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *y, const dsk_tensor *dy);
dsk_status dsk_cuda_rmsnorm(dsk_ctx *ctx, dsk_tensor *y, dsk_tensor *rstd, const dsk_tensor *x, const dsk_tensor *w,
                            float eps);
dsk_status dsk_cuda_rmsnorm_backward(dsk_ctx *ctx, dsk_tensor *dx, dsk_tensor *dw, const dsk_tensor *dy,
                                     const dsk_tensor *x, const dsk_tensor *w, const dsk_tensor *rstd);
dsk_status dsk_cuda_silu(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x);
dsk_status dsk_cuda_silu_backward(dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *dy, const dsk_tensor *x);
dsk_status dsk_cuda_swiglu(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *gate, const dsk_tensor *up);
dsk_status dsk_cuda_swiglu_backward(dsk_ctx *ctx, dsk_tensor *dgate, dsk_tensor *dup, const dsk_tensor *dout,
                                    const dsk_tensor *gate, const dsk_tensor *up, int add);
dsk_status dsk_cuda_embedding(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *table, const dsk_tensor *ids);
dsk_status dsk_cuda_embedding_backward(dsk_ctx *ctx, dsk_tensor *dtable, const dsk_tensor *dout, const dsk_tensor *ids);
dsk_status dsk_cuda_cross_entropy(dsk_ctx *ctx, dsk_tensor *loss, dsk_tensor *dlogits, const dsk_tensor *logits,
                                  const dsk_tensor *targets, int32_t ignore_index, float grad_scale);
dsk_status dsk_cuda_gather_rows(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *src, const dsk_tensor *idx);
dsk_status dsk_cuda_scatter_add_rows(dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src, const dsk_tensor *idx);
dsk_status dsk_cuda_topk(dsk_ctx *ctx, dsk_tensor *values, dsk_tensor *indices, const dsk_tensor *x, int k);
dsk_status dsk_cuda_rope(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x, int64_t pos0, float theta);
dsk_status dsk_cuda_rope_backward(dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *dy, int64_t pos0, float theta,
                                  int add);
dsk_status dsk_cuda_attention(dsk_ctx *ctx, dsk_tensor *out, dsk_tensor *probs, const dsk_tensor *q,
                              const dsk_tensor *k, const dsk_tensor *v, float scale);
dsk_status dsk_cuda_attention_backward(dsk_ctx *ctx, dsk_tensor *dq, dsk_tensor *dk, dsk_tensor *dv,
                                       const dsk_tensor *dout, const dsk_tensor *q, const dsk_tensor *k,
                                       const dsk_tensor *v, const dsk_tensor *probs, float scale, int add);
dsk_status dsk_cuda_adamw_step(dsk_ctx *ctx, dsk_tensor *param, const dsk_tensor *grad, dsk_tensor *m, dsk_tensor *v,
                               const dsk_adamw_opts *opts, int64_t step, float grad_mult, dsk_tensor *param_copy);

/* ---- fused attention (kernels/attention.cu): the contracts of dsk_attention_fused and
   dsk_attention_fused_backward (lse may be NULL in forward). bf16/f16 run on tensor cores (WMMA),
   f32 on CUDA cores; head dims up to 256 (DSK_ERR_UNSUPPORTED beyond); backward takes device
   scratch of B*H*T floats (D = rowsum(dout * out)); every sum in a fixed order, no atomics. */
dsk_status dsk_cuda_attention_fused(dsk_ctx *ctx, dsk_tensor *out, dsk_tensor *lse, const dsk_tensor *q,
                                    const dsk_tensor *k, const dsk_tensor *v, float scale);
dsk_status dsk_cuda_attention_fused_backward(dsk_ctx *ctx, dsk_tensor *dq, dsk_tensor *dk, dsk_tensor *dv,
                                             const dsk_tensor *dout, const dsk_tensor *q, const dsk_tensor *k,
                                             const dsk_tensor *v, const dsk_tensor *out, const dsk_tensor *lse,
                                             float scale);

/* ---- grouped rows (kernels/grouped.cu): same contracts as the dsk_tensor.h function of the same name;
   the offsets are read on the device, the grids sized by bounds from the shapes */
dsk_status dsk_cuda_group_by_key(dsk_ctx *ctx, dsk_tensor *perm, dsk_tensor *offsets, const dsk_tensor *keys);
dsk_status dsk_cuda_matmul_grouped(dsk_ctx *ctx, dsk_tensor *C, const dsk_tensor *A, int trans_a, const dsk_tensor *B,
                                   int trans_b, const dsk_tensor *offsets, float alpha, float beta);
dsk_status dsk_cuda_gather_rows_scaled(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *src, const dsk_tensor *idx,
                                       const dsk_tensor *scale);

/* ---- FP8 GEMM (kernels/fp8.cu): dsk_matmul_fp8 (offsets NULL: one segment of all of A's rows, B 2-D) and
   dsk_matmul_fp8_grouped (offsets (G + 1) on the device, B (G, N, K)); a_rows, b_rows: rows per scale (1 or 128) */
dsk_status dsk_cuda_matmul_fp8(dsk_ctx *ctx, dsk_tensor *C, const dsk_tensor *A, const dsk_tensor *a_scales, int a_rows,
                               const dsk_tensor *B, const dsk_tensor *b_scales, int b_rows, const dsk_tensor *offsets,
                               float alpha, float beta);
#endif

#ifdef __cplusplus
}
#endif
DSK__FP_EXACT_END
#endif /* DSK_TENSOR_H */

/* ==================================================================== implementation */
#ifdef DSK_TENSOR_IMPLEMENTATION
#ifndef DSK_TENSOR_IMPLEMENTATION_DONE
#define DSK_TENSOR_IMPLEMENTATION_DONE
DSK__FP_EXACT_BEGIN

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h> /* getenv (DSK_MALLOC may stand in for malloc without it) */
#include <float.h>
#ifdef _OPENMP
#include <omp.h>
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

#ifdef _OPENMP
/* LOCAL_WORLD_SIZE as a positive count; 1 when unset or not one. */
static int dsk__local_world_size(void) {
    const char *v = getenv("LOCAL_WORLD_SIZE");
    char *end;
    long n = v ? strtol(v, &end, 10) : 0;
    return v && *v && !*end && n > 0 && n < 1000000 ? (int)n : 1;
}
#endif

/* dsk_ctx_opts.n_threads' default: OpenMP's maximum, without OMP_NUM_THREADS at most this local
   rank's share of the cores. */
static int dsk__default_threads(void) {
#ifdef _OPENMP
    const char *omp = getenv("OMP_NUM_THREADS");
    int n = omp_get_max_threads(), share = omp_get_num_procs() / dsk__local_world_size();
    if (omp && *omp) return n;
    share = share > 1 ? share : 1;
    return n < share ? n : share;
#else
    return 1;
#endif
}

/* The ISA a DSK_CPU_ISA value names: AUTO for NULL, "" and "auto"; -1 for an unknown name. */
static int dsk__cpu_isa_parse(const char *v) {
    if (!v || !*v || !strcmp(v, "auto")) return DSK_CPU_ISA_AUTO;
    for (int i = DSK_CPU_ISA_PORTABLE; i <= DSK_CPU_ISA_AVX512; i++)
        if (!strcmp(v, dsk_cpu_isa_name((dsk_cpu_isa)i))) return i;
    return -1;
}

/* The ISA the environment asks for (AUTO: none), or the error naming DSK_CPU_ISA's value. */
static dsk_status dsk__cpu_isa_env(dsk_cpu_isa *isa) {
    const char *v = getenv("DSK_CPU_ISA");
    int i = dsk__cpu_isa_parse(v);
    *isa = DSK_CPU_ISA_AUTO;
    if (i < 0)
        return dsk_set_error(DSK_ERR_ARG, "dsk_ctx_init: environment DSK_CPU_ISA=\"%.64s\" is not one of portable, "
                             "avx2, avx512, auto", v);
    if (i != DSK_CPU_ISA_AUTO && !dsk_cpu_isa_supported((dsk_cpu_isa)i))
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "dsk_ctx_init: environment DSK_CPU_ISA=%s but this CPU or build "
                             "lacks %s (best: %s)", v, v, dsk_cpu_isa_name(dsk_cpu_isa_best()));
    *isa = (dsk_cpu_isa)i;
    return DSK_OK;
}

DSK_API dsk_status dsk_ctx_init(dsk_ctx *ctx, const dsk_ctx_opts *opts) {
    dsk_ctx_opts o;
    if (!ctx) return dsk_set_error(DSK_ERR_ARG, "dsk_ctx_init: ctx is NULL");
    memset(&o, 0, sizeof o);
    if (opts) o = *opts;
    memset(ctx, 0, sizeof *ctx);
    if (o.n_threads < 0) return dsk_set_error(DSK_ERR_ARG, "dsk_ctx_init: n_threads %d < 0", o.n_threads);
    if (o.cuda_index < 0) return dsk_set_error(DSK_ERR_ARG, "dsk_ctx_init: cuda_index %d < 0", o.cuda_index);
    if ((int)o.cpu_isa < 0 || o.cpu_isa > DSK_CPU_ISA_AVX512)
        return dsk_set_error(DSK_ERR_ARG, "dsk_ctx_init: unknown cpu_isa %d", (int)o.cpu_isa);
    if (o.cpu_isa != DSK_CPU_ISA_AUTO && !dsk_cpu_isa_supported(o.cpu_isa))
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "dsk_ctx_init: cpu_isa %s requested but this CPU or build lacks it (best: %s)",
                             dsk_cpu_isa_name(o.cpu_isa), dsk_cpu_isa_name(dsk_cpu_isa_best()));
    if (o.cpu_isa == DSK_CPU_ISA_AUTO) DSK__TRY(dsk__cpu_isa_env(&o.cpu_isa));
    ctx->device = dsk_cpu();
    ctx->n_threads = o.n_threads ? o.n_threads : dsk__default_threads();
    ctx->cpu_isa = o.cpu_isa != DSK_CPU_ISA_AUTO ? o.cpu_isa : dsk_cpu_isa_best();
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

static dsk_status dsk__need_cuda_ctx(const char *fn, const dsk_ctx *ctx) {
    if (!ctx || ctx->device.type != DSK_DEV_CUDA)
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: CUDA graphs need a CUDA ctx (got %s)", fn,
                             ctx ? "a CPU ctx" : "NULL");
    return DSK_OK;
}

DSK_API dsk_status dsk_graph_begin(dsk_ctx *ctx) {
    DSK__TRY(dsk__need_cuda_ctx("dsk_graph_begin", ctx));
#ifdef DSK_CUDA
    return dsk_cuda_graph_begin(ctx);
#else
    return DSK_OK;
#endif
}

DSK_API dsk_status dsk_graph_end(dsk_ctx *ctx, dsk_graph *g) {
    if (!g) return dsk_set_error(DSK_ERR_ARG, "dsk_graph_end: graph is NULL");
    memset(g, 0, sizeof *g);
    DSK__TRY(dsk__need_cuda_ctx("dsk_graph_end", ctx));
#ifdef DSK_CUDA
    return dsk_cuda_graph_end(ctx, &g->graph, &g->exec);
#else
    return DSK_OK;
#endif
}

DSK_API dsk_status dsk_graph_launch(dsk_ctx *ctx, const dsk_graph *g) {
    DSK__TRY(dsk__need_cuda_ctx("dsk_graph_launch", ctx));
    if (!g || !g->exec) return dsk_set_error(DSK_ERR_ARG, "dsk_graph_launch: no instantiated graph");
#ifdef DSK_CUDA
    return dsk_cuda_graph_launch(ctx, g->exec);
#else
    return DSK_OK;
#endif
}

DSK_API void dsk_graph_free(dsk_graph *g) {
    if (!g) return;
#ifdef DSK_CUDA
    if (g->graph || g->exec) dsk_cuda_graph_free(g->graph, g->exec);
#endif
    memset(g, 0, sizeof *g);
}

static int dsk__threads(const dsk_ctx *ctx) { return ctx && ctx->n_threads > 0 ? ctx->n_threads : dsk__default_threads(); }

DSK_API int dsk_ctx_threads(const dsk_ctx *ctx) { return dsk__threads(ctx); }

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

/* Writes "[a,b,...]" into buf (terminated). */
static const char *dsk__shape_str(char *buf, size_t n, int ndim, const int64_t *shape) {
    size_t k = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < ndim && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, i ? ",%lld" : "%lld", (long long)shape[i]);
    if (k < n) snprintf(buf + k, n - k, "]");
    return buf;
}

/* The shape's nonzero dims (every contiguous stride) times the element size fit in PTRDIFF_MAX
   bytes: numel, nbytes, strides and byte offsets cannot wrap (dims checked >= 0 already). */
static dsk_status dsk__check_size(const char *fn, dsk_dtype dt, int ndim, const int64_t *shape) {
    int64_t limit = (int64_t)(PTRDIFF_MAX / (ptrdiff_t)dsk_dtype_size(dt)), n = 1;
    char b[192];
    for (int i = 0; i < ndim; i++) {
        if (shape[i] == 0) continue;
        if (n > limit / shape[i])
            return dsk_set_error(DSK_ERR_ARG, "%s: shape %s of %s is too large: its element or byte count overflows "
                                 "(at most %lld elements of %zu bytes)", fn, dsk__shape_str(b, sizeof b, ndim, shape),
                                 dsk_dtype_name(dt), (long long)limit, dsk_dtype_size(dt));
        n *= shape[i];
    }
    return DSK_OK;
}

static dsk_status dsk__check_shape(const char *fn, dsk_dtype dt, int ndim, const int64_t *shape) {
    if (dsk_dtype_size(dt) == 0) return dsk_set_error(DSK_ERR_ARG, "%s: invalid dtype %d", fn, (int)dt);
    if (ndim < 0 || ndim > DSK_MAX_DIMS) return dsk_set_error(DSK_ERR_ARG, "%s: ndim %d outside [0, %d]", fn, ndim, DSK_MAX_DIMS);
    if (ndim > 0 && !shape) return dsk_set_error(DSK_ERR_ARG, "%s: shape is NULL for ndim %d", fn, ndim);
    for (int i = 0; i < ndim; i++)
        if (shape[i] < 0) return dsk_set_error(DSK_ERR_ARG, "%s: shape[%d] = %lld is negative", fn, i, (long long)shape[i]);
    return dsk__check_size(fn, dt, ndim, shape);
}

static void dsk__init_header(dsk_tensor *t, dsk_dtype dt, dsk_device dev, int ndim, const int64_t *shape) {
    memset(t, 0, sizeof *t);
    t->dtype = dt;
    t->device = dev;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
    dsk__set_contiguous_strides(t);
}

/* ---- allocator accounting: slot 0 the CPU, slot 1 + i CUDA device i */
#define DSK__MEM_SLOTS 65
static int64_t dsk__mem_live[DSK__MEM_SLOTS], dsk__mem_peak[DSK__MEM_SLOTS], dsk__mem_allocs[DSK__MEM_SLOTS];

static int dsk__mem_slot(dsk_device dev) {
    if (dev.type == DSK_DEV_CPU) return 0;
    return dev.index >= 0 && dev.index < DSK__MEM_SLOTS - 1 ? 1 + dev.index : -1;
}

static void dsk__mem_count(dsk_device dev, int64_t delta) {
    int k = dsk__mem_slot(dev);
    int64_t live, peak;
    if (k < 0) return;
    live = __atomic_add_fetch(&dsk__mem_live[k], delta, __ATOMIC_RELAXED);
    if (delta <= 0) return;
    __atomic_add_fetch(&dsk__mem_allocs[k], 1, __ATOMIC_RELAXED);
    peak = __atomic_load_n(&dsk__mem_peak[k], __ATOMIC_RELAXED);
    while (live > peak &&
           !__atomic_compare_exchange_n(&dsk__mem_peak[k], &peak, live, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
}

DSK_API dsk_tensor_mem dsk_tensor_mem_stats(dsk_device dev) {
    dsk_tensor_mem m;
    int k = dsk__mem_slot(dev);
    memset(&m, 0, sizeof m);
    if (k < 0) return m;
    m.live_bytes = __atomic_load_n(&dsk__mem_live[k], __ATOMIC_RELAXED);
    m.peak_bytes = __atomic_load_n(&dsk__mem_peak[k], __ATOMIC_RELAXED);
    m.allocs = __atomic_load_n(&dsk__mem_allocs[k], __ATOMIC_RELAXED);
    return m;
}

DSK_API void dsk_tensor_mem_reset_peak(dsk_device dev) {
    int k = dsk__mem_slot(dev);
    if (k < 0) return;
    __atomic_store_n(&dsk__mem_peak[k], __atomic_load_n(&dsk__mem_live[k], __ATOMIC_RELAXED), __ATOMIC_RELAXED);
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
        dsk__mem_count(dev, (int64_t)bytes);
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
        dsk__mem_count(dev, (int64_t)bytes);
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
        dsk__mem_count(t->device, -(int64_t)dsk_tensor_nbytes(t));
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
        long long n = (long long)dsk_tensor_numel(t);
        memset(t, 0, sizeof *t);
        return dsk_set_error(DSK_ERR_ARG, "dsk_tensor_wrap: data is NULL for %lld elements", n);
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
    if (start < 0 || len < 0 || start > t->shape[dim] || len > t->shape[dim] - start) /* start + len may wrap */
        return dsk_set_error(DSK_ERR_ARG, "dsk_tensor_slice: [%lld, %lld + %lld) outside dim %d of size %lld",
                             (long long)start, (long long)start, (long long)len, dim, (long long)t->shape[dim]);
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

/* The float dtypes whose values f32 holds exactly (f64 does not). */
static int dsk__is_f32_exact(dsk_dtype dt) { return dt == DSK_F32 || dt == DSK_BF16 || dt == DSK_F16; }

/* n contiguous elements between two of those dtypes, a piece at a time through f32: the values
   the f64 cast engine gives (a NaN passes through f64 quietened, as x86 converts it). */
static void dsk__convert_f32(void *dst, dsk_dtype ddt, const void *src, dsk_dtype sdt, int64_t n) {
    float buf[256];
    const int64_t piece = (int64_t)(sizeof buf / sizeof buf[0]);
    for (int64_t i = 0; i < n; i += piece) {
        int64_t len = n - i < piece ? n - i : piece;
        dsk_load_f32_n(buf, src, sdt, i, len);
        for (int64_t k = 0; k < len; k++) { /* dsk_f64_to_f32(dsk_f32_to_f64(x)), without branches */
            uint32_t u = dsk_f32_bits(buf[k]);
            buf[k] = (u & 0x7fffffffu) > 0x7f800000u ? dsk_bits_f32(u | 0x00400000u) : buf[k];
        }
        dsk_store_f32_n(dst, ddt, i, buf, len);
    }
}

static dsk_status dsk__copy_cpu(dsk_tensor *dst, const dsk_tensor *src) {
    int64_t n = dsk_tensor_numel(src);
    size_t es = dsk_dtype_size(src->dtype);
    if (n == 0) return DSK_OK;
    if (dst->dtype == src->dtype && dsk_tensor_is_contiguous(dst) && dsk_tensor_is_contiguous(src)) {
        memmove(dst->data, src->data, (size_t)n * es);
        return DSK_OK;
    }
    /* Element-wise (dst may alias src only when identical, handled by the memmove above).
       Same dtype: move the bytes, so int64 beyond 2^53 and NaN payloads survive; rows whose
       last dim has unit stride on both sides (column slices, broadcasts) move a row at a time. */
    if (dst->dtype == src->dtype && src->ndim > 0 && src->shape[src->ndim - 1] > 1 && src->stride[src->ndim - 1] == 1 &&
        dst->stride[dst->ndim - 1] == 1) {
        int64_t len = src->shape[src->ndim - 1];
        for (int64_t r = 0; r < n / len; r++)
            memcpy((char *)dst->data + (size_t)dsk__offset(dst, r * len) * es,
                   (const char *)src->data + (size_t)dsk__offset(src, r * len) * es, (size_t)len * es);
        return DSK_OK;
    }
    if (dst->dtype == src->dtype) {
        for (int64_t i = 0; i < n; i++)
            memcpy((char *)dst->data + (size_t)dsk__offset(dst, i) * es, (const char *)src->data + (size_t)dsk__offset(src, i) * es, es);
        return DSK_OK;
    }
    if (dsk__is_f32_exact(src->dtype) && dsk__is_f32_exact(dst->dtype) && dsk_tensor_is_contiguous(dst) &&
        dsk_tensor_is_contiguous(src)) {
        dsk__convert_f32(dst->data, dst->dtype, src->data, src->dtype, n);
        return DSK_OK;
    }
    for (int64_t i = 0; i < n; i++)
        dsk_store_f64(dst->data, dst->dtype, dsk__offset(dst, i), dsk_load_f64(src->data, src->dtype, dsk__offset(src, i)));
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
    int64_t n;
    if ((s = dsk__need("dsk_tensor_fill", "tensor", t)) != DSK_OK) return s;
    DSK__CUDA_PATH(t->device.type == DSK_DEV_CUDA, dsk_cuda_tensor_fill(ctx, t, value));
    (void)ctx;
    n = dsk_tensor_numel(t);
    if (n > 0 && dsk_tensor_is_contiguous(t)) {
        /* Convert once, then replicate the element's bytes: memset when they are all equal
           (zero, say), else copy the filled prefix onto the rest, doubling it each time. */
        size_t es = dsk_dtype_size(t->dtype), total = (size_t)n * es, done = es;
        union { double d; int64_t i; unsigned char b[8]; } e; /* aligned for any dtype */
        unsigned char *p = (unsigned char *)t->data;
        int same = 1;
        dsk_store_f64(&e, t->dtype, 0, value);
        for (size_t i = 1; i < es; i++) same &= e.b[i] == e.b[0];
        if (same) { memset(p, e.b[0], total); return DSK_OK; }
        memcpy(p, e.b, es);
        while (done < total) {
            size_t c = done < total - done ? done : total - done;
            memcpy(p + done, p, c);
            done += c;
        }
        return DSK_OK;
    }
    for (int64_t i = 0; i < n; i++) dsk_store_f64(t->data, t->dtype, dsk__offset(t, i), value);
    return DSK_OK;
}

DSK_API dsk_status dsk_tensor_uniform(dsk_ctx *ctx, dsk_tensor *t, uint64_t seed, uint64_t offset, float lo, float hi) {
    dsk_status s;
    if ((s = dsk__need("dsk_tensor_uniform", "tensor", t)) != DSK_OK) return s;
    if (!dsk_dtype_is_float(t->dtype))
        return dsk_set_error(DSK_ERR_ARG, "dsk_tensor_uniform: dtype %s is not a float type", dsk_dtype_name(t->dtype));
    DSK__CUDA_PATH(t->device.type == DSK_DEV_CUDA, dsk_cuda_tensor_uniform(ctx, t, seed, offset, lo, hi));
    (void)ctx;
    for (int64_t i = 0, n = dsk_tensor_numel(t); i < n; i++)
        dsk_store_f64(t->data, t->dtype, dsk__offset(t, i), lo + (hi - lo) * dsk_rng_uniform_at(seed, offset, (uint64_t)i));
    return DSK_OK;
}

DSK_API dsk_status dsk_tensor_normal(dsk_ctx *ctx, dsk_tensor *t, uint64_t seed, uint64_t offset, float mean, float std) {
    dsk_status s;
    if ((s = dsk__need("dsk_tensor_normal", "tensor", t)) != DSK_OK) return s;
    if (!dsk_dtype_is_float(t->dtype))
        return dsk_set_error(DSK_ERR_ARG, "dsk_tensor_normal: dtype %s is not a float type", dsk_dtype_name(t->dtype));
    DSK__CUDA_PATH(t->device.type == DSK_DEV_CUDA, dsk_cuda_tensor_normal(ctx, t, seed, offset, mean, std));
    (void)ctx;
    for (int64_t i = 0, n = dsk_tensor_numel(t); i < n; i++)
        dsk_store_f64(t->data, t->dtype, dsk__offset(t, i), mean + std * dsk_rng_normal_at(seed, offset, (uint64_t)i));
    return DSK_OK;
}

/* ---------------------------------------------------------------- ops (CPU paths; CUDA dispatch) */

#ifdef _OPENMP
#define DSK__PRAGMA(x) _Pragma(#x)
#define DSK__OMP(x) DSK__PRAGMA(omp x)
#else
#define DSK__OMP(x)
#endif

/* Below this many elements (or flops) an op runs on one thread: a 256 KB row op takes ~25 us on
   one core, while a fork and join costs microseconds on an idle machine and milliseconds when
   the team's threads must wait for a core (bench/RESULTS.md, Training). At 262144 the main job's
   row ops (2048 tokens x 128) ran on one thread of two: 3.5-9% of its 2-thread step on a quiet
   machine, and no faster under load. dsk_moe.h's row loops use the same bound. */
#define DSK__PAR_MIN 65536

static int dsk__thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static int dsk__is_cfloat(dsk_dtype dt) { return dt == DSK_F32 || dt == DSK_BF16 || dt == DSK_F16; }
static int dsk__is_fp8(dsk_dtype dt) { return dt == DSK_E4M3 || dt == DSK_E5M2; }

/* ---- argument checks: each names the function, the argument and its shape/dtype */

static dsk_status dsk__need_contig(const char *fn, const char *what, const dsk_tensor *t) {
    char b[96];
    DSK__TRY(dsk__need(fn, what, t));
    if (!dsk_tensor_is_contiguous(t))
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %s is not contiguous", fn, what, dsk_tensor_describe(t, b, sizeof b));
    return DSK_OK;
}

/* A dsk_grad_store value. */
static dsk_status dsk__need_store(const char *fn, dsk_grad_store store) {
    if (store != DSK_GRAD_ADD && store != DSK_GRAD_WRITE)
        return dsk_set_error(DSK_ERR_ARG, "%s: store %d is neither DSK_GRAD_ADD (0) nor DSK_GRAD_WRITE (1)", fn,
                             (int)store);
    return DSK_OK;
}

/* Contiguous f32, bf16 or f16. */
static dsk_status dsk__need_float(const char *fn, const char *what, const dsk_tensor *t) {
    char b[96];
    DSK__TRY(dsk__need_contig(fn, what, t));
    if (!dsk__is_cfloat(t->dtype))
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %s: dtype must be f32, bf16 or f16", fn, what, dsk_tensor_describe(t, b, sizeof b));
    return DSK_OK;
}

/* Contiguous with dtype dt. */
static dsk_status dsk__need_dtype(const char *fn, const char *what, const dsk_tensor *t, dsk_dtype dt) {
    char b[96];
    DSK__TRY(dsk__need_contig(fn, what, t));
    if (t->dtype != dt)
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %s: dtype must be %s", fn, what, dsk_tensor_describe(t, b, sizeof b), dsk_dtype_name(dt));
    return DSK_OK;
}

static dsk_status dsk__need_ndim(const char *fn, const char *what, const dsk_tensor *t, int ndim) {
    char b[96];
    if (t->ndim != ndim)
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %s must have %d dims", fn, what, dsk_tensor_describe(t, b, sizeof b), ndim);
    return DSK_OK;
}

static dsk_status dsk__need_rows(const char *fn, const char *what, const dsk_tensor *t) {
    char b[96];
    if (t->ndim < 1)
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %s must have at least 1 dim", fn, what, dsk_tensor_describe(t, b, sizeof b));
    return DSK_OK;
}

static dsk_status dsk__need_same_shape(const char *fn, const char *what, const dsk_tensor *t, const char *rwhat, const dsk_tensor *r) {
    char a[96], b[96];
    if (!dsk_tensor_same_shape(t, r))
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %s does not match the shape of %s %s", fn, what, dsk_tensor_describe(t, a, sizeof a),
                             rwhat, dsk_tensor_describe(r, b, sizeof b));
    return DSK_OK;
}

static dsk_status dsk__need_same_dtype(const char *fn, const char *what, const dsk_tensor *t, const char *rwhat, const dsk_tensor *r) {
    char a[96], b[96];
    if (t->dtype != r->dtype)
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %s must have the dtype of %s %s", fn, what, dsk_tensor_describe(t, a, sizeof a), rwhat,
                             dsk_tensor_describe(r, b, sizeof b));
    return DSK_OK;
}

/* Same shape and same dtype as r. */
static dsk_status dsk__need_like(const char *fn, const char *what, const dsk_tensor *t, const char *rwhat, const dsk_tensor *r) {
    DSK__TRY(dsk__need_same_shape(fn, what, t, rwhat, r));
    return dsk__need_same_dtype(fn, what, t, rwhat, r);
}

/* t has r's shape without r's last dim (r has at least one dim). */
static dsk_status dsk__need_lead_shape(const char *fn, const char *what, const dsk_tensor *t, const char *rwhat, const dsk_tensor *r) {
    char a[96], b[96];
    int ok = t->ndim == r->ndim - 1;
    for (int i = 0; ok && i < t->ndim; i++) ok = t->shape[i] == r->shape[i];
    if (!ok)
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %s must have the shape of %s %s without its last dim", fn, what,
                             dsk_tensor_describe(t, a, sizeof a), rwhat, dsk_tensor_describe(r, b, sizeof b));
    return DSK_OK;
}

/* One f32 element (any shape of numel 1). */
static dsk_status dsk__need_scalar(const char *fn, const char *what, const dsk_tensor *t) {
    char b[96];
    DSK__TRY(dsk__need_dtype(fn, what, t, DSK_F32));
    if (dsk_tensor_numel(t) != 1)
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %s must hold exactly one element", fn, what, dsk_tensor_describe(t, b, sizeof b));
    return DSK_OK;
}

/* All non-NULL tensors on the device of ts[0]; a CUDA device needs a ctx on it. Returns 1 in
   *cuda when the op runs on CUDA. */
static dsk_status dsk__need_devices(const char *fn, const dsk_ctx *ctx, int n, const dsk_tensor *const *ts, const char *const *names,
                                    int *cuda) {
    const dsk_tensor *t0 = ts[0];
    *cuda = t0->device.type == DSK_DEV_CUDA;
    for (int i = 1; i < n; i++) {
        if (!ts[i]) continue;
        if (ts[i]->device.type != t0->device.type || ts[i]->device.index != t0->device.index)
            return dsk_set_error(DSK_ERR_ARG, "%s: %s is on %s:%d but %s is on %s:%d", fn, names[i],
                                 ts[i]->device.type == DSK_DEV_CUDA ? "cuda" : "cpu", ts[i]->device.index, names[0],
                                 t0->device.type == DSK_DEV_CUDA ? "cuda" : "cpu", t0->device.index);
    }
    if (*cuda && (!ctx || ctx->device.type != DSK_DEV_CUDA || ctx->device.index != t0->device.index))
        return dsk_set_error(DSK_ERR_ARG, "%s: %s is on cuda:%d but ctx is %s", fn, names[0], t0->device.index,
                             !ctx ? "NULL" : ctx->device.type == DSK_DEV_CUDA ? "on another CUDA device" : "a CPU context");
    return DSK_OK;
}

/* Every ids[i] in [0, limit); otherwise names the first offender. */
static dsk_status dsk__need_indices(const char *fn, const char *what, const dsk_tensor *ids, int64_t limit, int allow_ignore,
                                    int32_t ignore) {
    const int32_t *p = (const int32_t *)ids->data;
    for (int64_t i = 0, n = dsk_tensor_numel(ids); i < n; i++) {
        if (allow_ignore && p[i] == ignore) continue;
        if (p[i] < 0 || p[i] >= limit)
            return dsk_set_error(DSK_ERR_ARG, "%s: %s[%lld] = %d outside [0, %lld)", fn, what, (long long)i, (int)p[i], (long long)limit);
    }
    return DSK_OK;
}

/* Number of rows (product of all dims but the last) and the last dim of t. */
static void dsk__rows_cols(const dsk_tensor *t, int64_t *rows, int64_t *cols) {
    *cols = t->ndim ? t->shape[t->ndim - 1] : 1;
    *rows = 1;
    for (int i = 0; i + 1 < t->ndim; i++) *rows *= t->shape[i];
}

/* ---------------------------------------------------------------- CPU GEMM
   One register-blocked micro-kernel computes an MR x NR tile of C from k steps of A (MR
   broadcasts) and B (NR-wide rows) with f32 FMAs; it is picked at run time from the CPU:
   AVX-512 (12 x 32), AVX2 + FMA (6 x 16) or portable C (4 x 16). Two loop nests feed it:
   direct  f32 operands, N <= DSK__DIRECT_N and no tall or deep A^T (dsk__gemm_is_direct):
           A is read in place through its strides (a bottom edge tile is copied), op(B) in place
           when its rows are contiguous and their stride spreads them over L1's sets
           (dsk__gemm_b_in_place), else each K slice is packed once per thread.
   packed  everything else (bf16/f16 operands, wide N, weight gradients A^T B): BLIS-style, C cut
           into NC-wide column panels and K into slices, op(B) packed into NR-wide micro-panels
           and each MC-tall block of op(A) into MR-tall micro-panels (converted to f32).
   K slices are DSK__DIRECT_KC deep for the f32 products of at most DSK__DIRECT_N columns in
   either nest (dsk__gemm_kc), DSK__KC for the rest. Threads own disjoint blocks of C and never
   split K; the loop nest and the K slices depend on the shape only, so every element of C sums
   its products in the same order whatever the thread count. */

#define DSK__KC 256
#define DSK__MC 144
#define DSK__NC 3072
#define DSK__DIRECT_N 512  /* widest op(B) the direct nest takes */
#define DSK__DIRECT_KC 512 /* K slice of the direct nest */

typedef struct dsk__gemm_args {
    int64_t M, N, K;
    float alpha, beta;
    /* op(A)[i][p] = A[i * a_rs + p * a_cs]; op(B)[p][j] = B[p * b_rs + j * b_cs] */
    const void *A; dsk_dtype a_dt; int64_t a_rs, a_cs;
    const void *B; dsk_dtype b_dt; int64_t b_rs, b_cs;
    float *C; int64_t ldc;
    int b_pack; /* 1: the direct nest may pack rows of op(B) it could read in place (dsk__gemm_b_in_place) and a
                   deep A^T may go to the packed nest; 0 for callers whose scratch holds the direct nest's A
                   tile only (the attention products) */
} dsk__gemm_args;

/* C[0:m, 0:n] = alpha * sum_{p < k} A[i][p] B[p][j] + beta * C (beta == 0: C is not read), with
   A[i][p] = a[i * a_rs + p * a_cs] for every i < MR (callers pad a short tile) and row p of B
   at b + p * b_rs, of which only the first n columns are read. */
typedef void (*dsk__ukernel_fn)(int64_t k, const float *a, int64_t a_rs, int64_t a_cs, const float *b, int64_t b_rs, float *c,
                                int64_t ldc, int m, int n, float alpha, float beta);
typedef struct dsk__ukernel {
    dsk_cpu_isa isa;
    int mr, nr;
    dsk__ukernel_fn fn;
} dsk__ukernel;

/* Packs rows [0, rows) x cols [0, kc) of X (X[i][p] = src[i * rs + p * cs]) into micro-panels
   of width w: panel c holds dst[c * w * kc + p * w + r] = X[c * w + r][p], zero past `rows`.
   Only panels [c0, c1) are written. The loops follow whichever of rs, cs is 1, so the source
   is read along its rows (a strided walk down the rows would touch a new page per element). */
#define DSK__PACK_LOOP(T, LOAD)                                                                          \
    do {                                                                                                 \
        const T *s_ = (const T *)src;                                                                    \
        for (int64_t c = c0; c < c1; c++) {                                                              \
            float *d = dst + c * w * kc;                                                                 \
            int64_t r0 = c * w, nr = rows - r0 < w ? rows - r0 : w;                                      \
            for (int64_t p = 0; nr < w && p < kc; p++)                                                   \
                for (int64_t r = nr; r < w; r++) d[p * w + r] = 0.0f;                                    \
            if (cs == 1) /* the w rows are read side by side (parallel streams) */                       \
                for (int64_t p = 0; p < kc; p++)                                                         \
                    for (int64_t r = 0; r < nr; r++) d[p * w + r] = LOAD(s_[(r0 + r) * rs + p]);         \
        }                                                                                                \
        if (cs != 1)                                                                                     \
            for (int64_t p = 0; p < kc; p++)                                                             \
                for (int64_t c = c0; c < c1; c++) {                                                      \
                    float *d = dst + c * w * kc + p * w;                                                 \
                    int64_t r0 = c * w, nr = rows - r0 < w ? rows - r0 : w;                              \
                    for (int64_t r = 0; r < nr; r++) d[r] = LOAD(s_[(r0 + r) * rs + p * cs]);            \
                }                                                                                        \
    } while (0)
#define DSK__LOAD_F32(x) (x)
#define DSK__LOAD_BF16(x) dsk_bf16_to_f32(x)
#define DSK__LOAD_F16(x) dsk_f16_to_f32(x)
static int64_t dsk__pack_min(int64_t a, int64_t b) { return a < b ? a : b; }

static void dsk__pack_t_f32(float *dst, const float *src, int64_t rs, int64_t kc, int64_t w);

/* n rows of W floats from s (rows cs apart) to d (rows W apart); W a constant where it can be. */
#define DSK__PACK_ROWS(d, s, cs, n, W) \
    for (int64_t p_ = 0; p_ < (n); p_++) memcpy((d) + p_ * (W), (s) + p_ * (cs), (size_t)(W) * sizeof *(d))

/* dsk__pack for f32 rows that are contiguous (rs == 1, cs != 1): row p of panel c is the w floats at
   src + p * cs + c * w, copied whole; a copy of a constant length becomes a few vector moves, where the
   element loop of DSK__PACK_LOOP took about a third of a weight gradient's time (A^T and op(B) packed). */
static void dsk__pack_rows_f32(float *dst, const float *src, int64_t cs, int64_t rows, int64_t kc, int64_t w,
                               int64_t c0, int64_t c1) {
    for (int64_t p0 = 0; p0 < kc; p0 += 32) /* 32 source rows stay in L1 while each panel takes its part */
        for (int64_t c = c0; c < c1; c++) {
            int64_t n = dsk__pack_min(kc - p0, 32), nr = dsk__pack_min(rows - c * w, w);
            float *d = dst + c * w * kc + p0 * w;
            const float *s = src + p0 * cs + c * w;
            if (nr < w) { /* the last panel: zeros past `rows` */
                for (int64_t p = 0; p < n; p++)
                    for (int64_t r = 0; r < w; r++) d[p * w + r] = r < nr ? s[p * cs + r] : 0.0f;
                continue;
            }
            /* the micro-kernels' MR and NR as constants: each row's copy becomes a few vector moves */
            switch (w) {
            case 6: DSK__PACK_ROWS(d, s, cs, n, 6); break;
            case 12: DSK__PACK_ROWS(d, s, cs, n, 12); break;
            case 16: DSK__PACK_ROWS(d, s, cs, n, 16); break;
            case 32: DSK__PACK_ROWS(d, s, cs, n, 32); break;
            default: DSK__PACK_ROWS(d, s, cs, n, w);
            }
        }
}

/* vec: the f32 panels that transpose (cs == 1) and are full may go through dsk__pack_t_f32's
   vector transposes (AVX2 and up; the same values either way). */
static void dsk__pack(float *dst, const void *src, dsk_dtype dt, int64_t rs, int64_t cs, int64_t rows, int64_t kc, int64_t w,
                      int64_t c0, int64_t c1, int vec) {
    if (dt == DSK_F32 && rs == 1 && cs != 1) {
        dsk__pack_rows_f32(dst, (const float *)src, cs, rows, kc, w, c0, c1);
        return;
    }
    if (dt == DSK_F32 && cs == 1 && rs != 1 && vec) {
        int64_t full = dsk__pack_min(c1, rows / w);
        for (; c0 < full; c0++) dsk__pack_t_f32(dst + c0 * w * kc, (const float *)src + c0 * w * rs, rs, kc, w);
        if (c0 >= c1) return;
    }
    if (dt == DSK_F32) DSK__PACK_LOOP(float, DSK__LOAD_F32);
    else if (dt == DSK_BF16) DSK__PACK_LOOP(uint16_t, DSK__LOAD_BF16);
    else DSK__PACK_LOOP(uint16_t, DSK__LOAD_F16);
}

/* Portable micro-kernel, 4 x 16; the compiler vectorises the j loops where it can. */
static void dsk__ukernel_portable(int64_t k, const float *a, int64_t a_rs, int64_t a_cs, const float *b, int64_t b_rs, float *c,
                                  int64_t ldc, int m, int n, float alpha, float beta) {
    float t[4][16];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 16; j++) t[i][j] = 0.0f;
    for (int64_t p = 0; p < k; p++, a += a_cs, b += b_rs)
        for (int i = 0; i < 4; i++) {
            float av = a[i * a_rs];
            for (int j = 0; j < n; j++) t[i][j] += av * b[j];
        }
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            float v = alpha * t[i][j];
            c[i * ldc + j] = beta == 0.0f ? v : v + beta * c[i * ldc + j];
        }
}

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__CUDACC__)
#define DSK__X86 1
/* g++ 12 flags the intrinsics' own _mm512_undefined_* as maybe-uninitialized (GCC bug 105593). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
/* Compiled for these instruction sets whatever the build flags; called only when the CPU has them. */
#define DSK__TARGET_AVX2 __attribute__((target("avx2,fma")))
#define DSK__TARGET_AVX512 __attribute__((target("avx512f,fma")))
#define DSK__INLINE static inline __attribute__((always_inline))

#define DSK__ROWS6(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define DSK__ROWS12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

/* AVX-512, 12 x 32: 24 accumulators, 2 B vectors, 1 broadcast; short rows of B load masked
   (masked-off lanes are never read), the tile stores masked. a_rs and `masked` are constants
   at each call site below, so the compiler builds four specialised loops. */
#define DSK__K512_ZERO(i) __m512 c##i##a = _mm512_setzero_ps(), c##i##b = _mm512_setzero_ps();
#define DSK__K512_FMA(i)                                                                          \
    {                                                                                             \
        __m512 av_ = _mm512_set1_ps(a[(i) * a_rs]);                                               \
        c##i##a = _mm512_fmadd_ps(av_, b0, c##i##a);                                              \
        c##i##b = _mm512_fmadd_ps(av_, b1, c##i##b);                                              \
    }
#define DSK__K512_STORE(i)                                                                        \
    if ((i) < m) {                                                                                \
        float *cr_ = c + (i) * ldc;                                                               \
        __m512 v0_ = _mm512_mul_ps(va, c##i##a), v1_ = _mm512_mul_ps(va, c##i##b);                \
        if (beta != 0.0f) {                                                                       \
            v0_ = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(k0, cr_), v0_);                       \
            v1_ = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(k1, cr_ + 16), v1_);                  \
        }                                                                                         \
        _mm512_mask_storeu_ps(cr_, k0, v0_);                                                      \
        _mm512_mask_storeu_ps(cr_ + 16, k1, v1_);                                                 \
    }
DSK__INLINE DSK__TARGET_AVX512 void dsk__ukernel_avx512_body(int64_t k, const float *a, int64_t a_rs, int64_t a_cs, const float *b,
                                                            int64_t b_rs, float *c, int64_t ldc, int m, int n, float alpha,
                                                            float beta, int masked) {
    __mmask16 k0 = (__mmask16)(n >= 16 ? 0xffffu : (1u << n) - 1u), k1 = (__mmask16)(n >= 32 ? 0xffffu : n > 16 ? (1u << (n - 16)) - 1u : 0u);
    __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta), b0, b1;
    DSK__ROWS12(DSK__K512_ZERO)
    for (int64_t p = 0; p < k; p++, a += a_cs, b += b_rs) {
        if (masked) {
            b0 = _mm512_maskz_loadu_ps(k0, b);
            b1 = _mm512_maskz_loadu_ps(k1, b + 16);
        } else {
            b0 = _mm512_loadu_ps(b);
            b1 = _mm512_loadu_ps(b + 16);
        }
        DSK__ROWS12(DSK__K512_FMA)
    }
    DSK__ROWS12(DSK__K512_STORE)
}
static DSK__TARGET_AVX512 void dsk__ukernel_avx512(int64_t k, const float *a, int64_t a_rs, int64_t a_cs, const float *b, int64_t b_rs,
                                                   float *c, int64_t ldc, int m, int n, float alpha, float beta) {
    if (a_rs == 1) {
        if (n == 32) dsk__ukernel_avx512_body(k, a, 1, a_cs, b, b_rs, c, ldc, m, n, alpha, beta, 0);
        else dsk__ukernel_avx512_body(k, a, 1, a_cs, b, b_rs, c, ldc, m, n, alpha, beta, 1);
    } else {
        if (n == 32) dsk__ukernel_avx512_body(k, a, a_rs, a_cs, b, b_rs, c, ldc, m, n, alpha, beta, 0);
        else dsk__ukernel_avx512_body(k, a, a_rs, a_cs, b, b_rs, c, ldc, m, n, alpha, beta, 1);
    }
}

/* AVX2 + FMA, 6 x 16: 12 accumulators, 2 B vectors, 1 broadcast; the same scheme with
   vmaskmov for short rows (masked-off lanes are never read). Full tiles load and store C
   with plain moves: a vmaskmov store is microcoded on AMD cores (tens of cycles each). */
DSK__INLINE DSK__TARGET_AVX2 __m256 dsk__ld256(const float *p, __m256i k, int masked) {
    return masked ? _mm256_maskload_ps(p, k) : _mm256_loadu_ps(p);
}
DSK__INLINE DSK__TARGET_AVX2 void dsk__st256(float *p, __m256i k, __m256 v, int masked) {
    if (masked) _mm256_maskstore_ps(p, k, v);
    else _mm256_storeu_ps(p, v);
}
#define DSK__K256_ZERO(i) __m256 c##i##a = _mm256_setzero_ps(), c##i##b = _mm256_setzero_ps();
/* The tile's rows of C (first and last element: one line or two) are fetched while the k loop runs. */
#define DSK__K256_PREFETCH(i) \
    if ((i) < m) { \
        _mm_prefetch((const char *)(c + (i)*ldc), _MM_HINT_T0); \
        _mm_prefetch((const char *)(c + (i)*ldc + n - 1), _MM_HINT_T0); \
    }
#define DSK__K256_FMA(i)                                                                          \
    {                                                                                             \
        __m256 av_ = _mm256_broadcast_ss(a + (i) * a_rs);                                         \
        c##i##a = _mm256_fmadd_ps(av_, b0, c##i##a);                                              \
        c##i##b = _mm256_fmadd_ps(av_, b1, c##i##b);                                              \
    }
#define DSK__K256_STORE(i) \
    if ((i) < m) { \
        float *cr_ = c + (i)*ldc; \
        __m256 v0_ = _mm256_mul_ps(va, c##i##a), v1_ = _mm256_mul_ps(va, c##i##b); \
        if (beta != 0.0f) { \
            v0_ = _mm256_fmadd_ps(vb, dsk__ld256(cr_, k0, masked), v0_); \
            v1_ = _mm256_fmadd_ps(vb, dsk__ld256(cr_ + 8, k1, masked), v1_); \
        } \
        dsk__st256(cr_, k0, v0_, masked); \
        dsk__st256(cr_ + 8, k1, v1_, masked); \
    }
DSK__INLINE DSK__TARGET_AVX2 void dsk__ukernel_avx2_body(int64_t k, const float *a, int64_t a_rs, int64_t a_cs, const float *b,
                                                        int64_t b_rs, float *c, int64_t ldc, int m, int n, float alpha, float beta,
                                                        int masked) {
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i k0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane), k1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8), lane);
    __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta), b0, b1;
    DSK__ROWS6(DSK__K256_ZERO)
    DSK__ROWS6(DSK__K256_PREFETCH)
    for (int64_t p = 0; p < k; p++, a += a_cs, b += b_rs) {
        if (masked) {
            b0 = _mm256_maskload_ps(b, k0);
            b1 = _mm256_maskload_ps(b + 8, k1);
        } else {
            b0 = _mm256_loadu_ps(b);
            b1 = _mm256_loadu_ps(b + 8);
        }
        DSK__ROWS6(DSK__K256_FMA)
    }
    DSK__ROWS6(DSK__K256_STORE)
}
static DSK__TARGET_AVX2 void dsk__ukernel_avx2(int64_t k, const float *a, int64_t a_rs, int64_t a_cs, const float *b, int64_t b_rs,
                                               float *c, int64_t ldc, int m, int n, float alpha, float beta) {
    if (a_rs == 1) {
        if (n == 16) dsk__ukernel_avx2_body(k, a, 1, a_cs, b, b_rs, c, ldc, m, n, alpha, beta, 0);
        else dsk__ukernel_avx2_body(k, a, 1, a_cs, b, b_rs, c, ldc, m, n, alpha, beta, 1);
    } else {
        if (n == 16) dsk__ukernel_avx2_body(k, a, a_rs, a_cs, b, b_rs, c, ldc, m, n, alpha, beta, 0);
        else dsk__ukernel_avx2_body(k, a, a_rs, a_cs, b, b_rs, c, ldc, m, n, alpha, beta, 1);
    }
}
/* dst[p * w + r] = src[r * rs + p] for r < w (a multiple of 8), p < kc: 8 x 8 blocks through
   registers (unpack, shuffle, lane permute), the last kc % 8 columns one by one. */
static DSK__TARGET_AVX2 void dsk__pack_t_avx2(float *dst, const float *src, int64_t rs, int64_t kc, int64_t w) {
    int64_t p0 = 0;
    for (; p0 + 8 <= kc; p0 += 8)
        for (int64_t rb = 0; rb < w; rb += 8) {
            const float *s0 = src + rb * rs + p0;
            __m256 r0 = _mm256_loadu_ps(s0), r1 = _mm256_loadu_ps(s0 + rs), r2 = _mm256_loadu_ps(s0 + 2 * rs);
            __m256 r3 = _mm256_loadu_ps(s0 + 3 * rs), r4 = _mm256_loadu_ps(s0 + 4 * rs), r5 = _mm256_loadu_ps(s0 + 5 * rs);
            __m256 r6 = _mm256_loadu_ps(s0 + 6 * rs), r7 = _mm256_loadu_ps(s0 + 7 * rs);
            __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3);
            __m256 t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
            __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
            __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
            __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
            __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
            __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
            float *d = dst + p0 * w + rb;
            _mm256_storeu_ps(d, _mm256_permute2f128_ps(u0, u4, 0x20));
            _mm256_storeu_ps(d + w, _mm256_permute2f128_ps(u1, u5, 0x20));
            _mm256_storeu_ps(d + 2 * w, _mm256_permute2f128_ps(u2, u6, 0x20));
            _mm256_storeu_ps(d + 3 * w, _mm256_permute2f128_ps(u3, u7, 0x20));
            _mm256_storeu_ps(d + 4 * w, _mm256_permute2f128_ps(u0, u4, 0x31));
            _mm256_storeu_ps(d + 5 * w, _mm256_permute2f128_ps(u1, u5, 0x31));
            _mm256_storeu_ps(d + 6 * w, _mm256_permute2f128_ps(u2, u6, 0x31));
            _mm256_storeu_ps(d + 7 * w, _mm256_permute2f128_ps(u3, u7, 0x31));
        }
    for (; p0 < kc; p0++)
        for (int64_t r = 0; r < w; r++) dst[p0 * w + r] = src[r * rs + p0];
}
#else
#define DSK__X86 0
#endif

static void dsk__pack_t_f32(float *dst, const float *src, int64_t rs, int64_t kc, int64_t w) {
#if DSK__X86
    if (w % 8 == 0) {
        dsk__pack_t_avx2(dst, src, rs, kc, w);
        return;
    }
#endif
    for (int64_t p = 0; p < kc; p++)
        for (int64_t r = 0; r < w; r++) dst[p * w + r] = src[r * rs + p];
}

/* Whether dsk__pack may take its vector transposes with the micro-kernel of `isa`. */
static int dsk__pack_vec(dsk_cpu_isa isa) { return isa == DSK_CPU_ISA_AVX2 || isa == DSK_CPU_ISA_AVX512; }

/* The instruction sets this build and this CPU both have, as a bit per dsk_cpu_isa. */
static unsigned dsk__cpu_isa_mask(void) {
    unsigned m = 1u << DSK_CPU_ISA_PORTABLE;
#if DSK__X86
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) m |= 1u << DSK_CPU_ISA_AVX2;
    if (__builtin_cpu_supports("avx512f")) m |= 1u << DSK_CPU_ISA_AVX512;
#endif
    return m;
}

DSK_API dsk_cpu_isa dsk_cpu_isa_best(void) {
    unsigned m = dsk__cpu_isa_mask();
    return (m >> DSK_CPU_ISA_AVX512) & 1u ? DSK_CPU_ISA_AVX512 : (m >> DSK_CPU_ISA_AVX2) & 1u ? DSK_CPU_ISA_AVX2 : DSK_CPU_ISA_PORTABLE;
}

DSK_API dsk_cpu_isa dsk_cpu_isa_auto(void) {
    int i = dsk__cpu_isa_parse(getenv("DSK_CPU_ISA"));
    return i > 0 && dsk_cpu_isa_supported((dsk_cpu_isa)i) ? (dsk_cpu_isa)i : dsk_cpu_isa_best();
}

DSK_API int dsk_cpu_isa_supported(dsk_cpu_isa isa) { return (int)isa > 0 && (int)isa < 32 && ((dsk__cpu_isa_mask() >> isa) & 1u); }

DSK_API const char *dsk_cpu_isa_name(dsk_cpu_isa isa) {
    switch (isa) {
    case DSK_CPU_ISA_AUTO: return "auto";
    case DSK_CPU_ISA_PORTABLE: return "portable";
    case DSK_CPU_ISA_AVX2: return "avx2";
    case DSK_CPU_ISA_AVX512: return "avx512";
    default: return "invalid";
    }
}

/* The micro-kernel of `isa` (AUTO or one this CPU lacks: dsk_cpu_isa_auto()'s). */
static dsk__ukernel dsk__ukernel_for(dsk_cpu_isa isa) {
    dsk__ukernel u;
    if (!dsk_cpu_isa_supported(isa)) isa = dsk_cpu_isa_auto();
    u.isa = isa;
    u.mr = 4; u.nr = 16; u.fn = dsk__ukernel_portable;
#if DSK__X86
    if (isa == DSK_CPU_ISA_AVX512) { u.mr = 12; u.nr = 32; u.fn = dsk__ukernel_avx512; }
    if (isa == DSK_CPU_ISA_AVX2) { u.mr = 6; u.nr = 16; u.fn = dsk__ukernel_avx2; }
#endif
    return u;
}

DSK_API const char *dsk_cpu_gemm_describe(dsk_cpu_isa isa, char *buf, size_t n) {
    dsk__ukernel u = dsk__ukernel_for(isa);
    if (n) snprintf(buf, n, "%s %dx%d", dsk_cpu_isa_name(u.isa), u.mr, u.nr);
    return buf;
}

static int64_t dsk__round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
static int64_t dsk__min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* C = beta * C (beta == 0 writes zeros, NaN in C included). */
static void dsk__scale_c(const dsk__gemm_args *g) {
    for (int64_t i = 0; i < g->M; i++)
        for (int64_t j = 0; j < g->N; j++) {
            float *c = g->C + i * g->ldc + j;
            *c = g->beta == 0.0f ? 0.0f : g->beta * *c;
        }
}

/* The f32 products the direct nest is made for: op(B) at most DSK__DIRECT_N wide, and not a tall
   op(A) = A^T (a weight gradient dY^T X), whose tiles, one cache line per k, are better packed a
   DSK__MC block at a time from A's contiguous rows. Their K slices are DSK__DIRECT_KC deep in
   either nest, so the nest a product runs in does not change its bits. */
static int dsk__gemm_narrow(const dsk__gemm_args *g) {
    if (g->a_cs != 1 && g->M > DSK__DIRECT_N) return 0;
    return g->a_dt == DSK_F32 && g->b_dt == DSK_F32 && g->N <= DSK__DIRECT_N;
}
/* A narrow product runs direct unless op(A) = A^T is 256 or more deep: read in place, its tiles and
   op(B)'s rows step 4 N bytes a k, both in the few L1 sets such strides reach, and the kernel
   waited on L2 (0.65-0.8x of OpenBLAS on the trainer's dW shapes); packed they stream. Callers
   whose scratch holds the direct nest's tile only (b_pack 0) stay direct. */
static int dsk__gemm_is_direct(const dsk__gemm_args *g) {
    return dsk__gemm_narrow(g) && (g->a_cs == 1 || g->K < 256 || !g->b_pack);
}
/* The K slice of the packed nest. */
static int64_t dsk__gemm_kc(const dsk__gemm_args *g) { return dsk__gemm_narrow(g) ? DSK__DIRECT_KC : DSK__KC; }
/* op(B)'s rows are contiguous f32: the direct nest reads them in place, unless their stride is a
   multiple of 512 bytes and the K slice is deeper than 64 rows: such rows map to at most 8 of the
   64 sets of a 32 KB 8-way L1, so no more than 64 of them stay cached and each tile row of C would
   fetch the panel again from L2 (a power-of-two N: 0.5x of OpenBLAS at 512^3); those are packed
   when M has enough tile rows (256) to repay the copy (at 128^3 packing was slower). */
static int dsk__gemm_b_in_place(const dsk__gemm_args *g) {
    if (g->b_dt != DSK_F32 || (g->b_cs != 1 && g->N != 1)) return 0;
    return g->N == 1 || !g->b_pack || g->b_rs % 128 != 0 || g->K <= 64 || g->M < 256;
}

/* Floats of scratch one thread needs for a block of C nc columns wide. */
static int64_t dsk__gemm_scratch(const dsk__gemm_args *g, const dsk__ukernel *uk, int64_t nc) {
    if (dsk__gemm_is_direct(g)) {
        int64_t kc = dsk__min64(g->K, DSK__DIRECT_KC);
        return kc * uk->mr + (dsk__gemm_b_in_place(g) ? 0 : kc * dsk__round_up(nc, uk->nr));
    }
    return dsk__min64(g->K, dsk__gemm_kc(g)) * (DSK__MC + dsk__round_up(dsk__min64(nc, DSK__NC), uk->nr));
}

/* Direct nest over the block C[i0:i1, j0:j1]; ws: dsk__gemm_scratch floats. */
static void dsk__gemm_direct(const dsk__gemm_args *g, const dsk__ukernel *uk, int64_t i0, int64_t i1, int64_t j0, int64_t j1, float *ws) {
    const float *A = (const float *)g->A, *B = (const float *)g->B;
    int64_t MR = uk->mr, NR = uk->nr, nc = j1 - j0, in_place = dsk__gemm_b_in_place(g);
    float *ap = ws, *bp = ws + dsk__min64(g->K, DSK__DIRECT_KC) * MR;
    for (int64_t pc = 0; pc < g->K; pc += DSK__DIRECT_KC) {
        int64_t kc = dsk__min64(g->K - pc, DSK__DIRECT_KC), b_rs = in_place ? g->b_rs : NR;
        float beta = pc == 0 ? g->beta : 1.0f;
        if (!in_place) /* X[j][p] = op(B)[pc + p][j0 + j]: rows step b_cs, columns b_rs */
            dsk__pack(bp, B + pc * g->b_rs + j0 * g->b_cs, DSK_F32, g->b_cs, g->b_rs, nc, kc, NR, 0, (nc + NR - 1) / NR,
                      dsk__pack_vec(uk->isa));
        for (int64_t it = i0; it < i1; it += MR) {
            int64_t m = dsk__min64(MR, i1 - it), a_rs = g->a_rs, a_cs = g->a_cs;
            const float *a = A + it * g->a_rs + pc * g->a_cs;
            if (m < MR) { /* rows past M must not be read: copy the short tile, zero padded */
                dsk__pack(ap, a, DSK_F32, g->a_rs, g->a_cs, m, kc, MR, 0, 1, 0);
                a = ap; a_rs = 1; a_cs = MR;
            }
            for (int64_t jt = j0; jt < j1; jt += NR) {
                const float *b = in_place ? B + pc * g->b_rs + jt * g->b_cs : bp + (jt - j0) * kc;
                uk->fn(kc, a, a_rs, a_cs, b, b_rs, g->C + it * g->ldc + jt, g->ldc, (int)m, (int)dsk__min64(NR, j1 - jt), g->alpha, beta);
            }
        }
    }
}

/* Packed (BLIS) nest over the block C[i0:i1, j0:j1]; ws: dsk__gemm_scratch floats. */
static void dsk__gemm_packed(const dsk__gemm_args *g, const dsk__ukernel *uk, int64_t i0, int64_t i1, int64_t j0, int64_t j1, float *ws) {
    size_t ae = dsk_dtype_size(g->a_dt), be = dsk_dtype_size(g->b_dt);
    int64_t MR = uk->mr, NR = uk->nr, KC = dsk__gemm_kc(g);
    float *ap = ws, *bp = ws + dsk__min64(g->K, KC) * DSK__MC;
    for (int64_t jc = j0; jc < j1; jc += DSK__NC) {
        int64_t nc = dsk__min64(j1 - jc, DSK__NC), n_jr = (nc + NR - 1) / NR;
        for (int64_t pc = 0; pc < g->K; pc += KC) {
            int64_t kc = dsk__min64(g->K - pc, KC);
            float beta = pc == 0 ? g->beta : 1.0f;
            /* X[j][p] = op(B)[pc + p][jc + j]: panel rows step b_cs, columns b_rs */
            dsk__pack(bp, (const char *)g->B + (size_t)(pc * g->b_rs + jc * g->b_cs) * be, g->b_dt, g->b_cs, g->b_rs, nc, kc, NR, 0, n_jr,
                      dsk__pack_vec(uk->isa));
            for (int64_t ic = i0; ic < i1; ic += DSK__MC) {
                int64_t mc = dsk__min64(i1 - ic, DSK__MC), n_ir = (mc + MR - 1) / MR;
                dsk__pack(ap, (const char *)g->A + (size_t)(ic * g->a_rs + pc * g->a_cs) * ae, g->a_dt, g->a_rs, g->a_cs, mc, kc, MR, 0, n_ir,
                          dsk__pack_vec(uk->isa));
                for (int64_t jr = 0; jr < n_jr; jr++)
                    for (int64_t ir = 0; ir < n_ir; ir++) {
                        int64_t r0 = ir * MR, c0 = jr * NR;
                        uk->fn(kc, ap + ir * MR * kc, 1, MR, bp + jr * NR * kc, NR, g->C + (ic + r0) * g->ldc + jc + c0, g->ldc,
                               (int)dsk__min64(MR, mc - r0), (int)dsk__min64(NR, nc - c0), g->alpha, beta);
                    }
            }
        }
    }
}

/* One thread's share of a product: the block C[i0:i1, j0:j1] (ws: dsk__gemm_scratch floats). */
static void dsk__gemm_block(const dsk__gemm_args *g, const dsk__ukernel *uk, int64_t i0, int64_t i1, int64_t j0, int64_t j1, float *ws) {
    if (i0 >= i1 || j0 >= j1) return;
    if (dsk__gemm_is_direct(g)) dsk__gemm_direct(g, uk, i0, i1, j0, j1, ws);
    else dsk__gemm_packed(g, uk, i0, i1, j0, j1, ws);
}

/* Splits `units` tiles into `parts` near-equal ranges; range p is [*lo, *hi). */
static void dsk__split(int64_t units, int64_t parts, int64_t p, int64_t *lo, int64_t *hi) {
    *lo = units * p / parts;
    *hi = units * (p + 1) / parts;
}

/* Threads own disjoint blocks of C (a tm x tn grid) and pack their own operands, so they never
   wait for each other; the grid minimises the padded tile work of the largest block. */
static void dsk__gemm_grid(int64_t M, int64_t N, int nt, int64_t mr, int64_t nr, int64_t *tm, int64_t *tn) {
    int64_t mu = (M + mr - 1) / mr, nu = (N + nr - 1) / nr, best = -1;
    *tm = 1; *tn = 1;
    for (int64_t a = 1; a <= nt; a++) {
        int64_t b = nt / a, work;
        if (a * b != nt || a > mu || b > nu) continue;
        work = ((mu + a - 1) / a) * mr * ((nu + b - 1) / b) * nr;
        if (best < 0 || work < best) { best = work; *tm = a; *tn = b; }
    }
}

/* The product on one thread with the caller's scratch (dsk__gemm_scratch(g, uk, g->N) floats). */
static void dsk__gemm_serial(const dsk__gemm_args *g, const dsk__ukernel *uk, float *ws) {
    if (g->M <= 0 || g->N <= 0) return;
    if (g->K <= 0 || g->alpha == 0.0f) { dsk__scale_c(g); return; }
    dsk__gemm_block(g, uk, 0, g->M, 0, g->N, ws);
}

/* Below 128^3 multiply-adds one thread finishes before a team would be worth waking (at 128^3 on
   two Zen 4 cores: 85 GFLOP/s on one thread, 155 on two; OpenBLAS's two 70-118). */
static int dsk__gemm_threaded(const dsk__gemm_args *g) { return (double)g->M * g->N * g->K >= 2097152.0; }
/* A batch of products under ~160^3 multiply-adds each goes a product a thread (dsk__matmul_batched):
   no team to wake per product, and no product split. */
static int dsk__gemm_batch_per_thread(const dsk__gemm_args *g) { return (double)g->M * g->N * g->K < 4194304.0; }

static dsk_status dsk__gemm(const dsk__gemm_args *g, const dsk__ukernel *uk, int n_threads) {
    int64_t M = g->M, N = g->N, K = g->K;
    int failed = 0, team = dsk__gemm_threaded(g);
    if (M <= 0 || N <= 0) return DSK_OK;
    if (K <= 0 || g->alpha == 0.0f) { dsk__scale_c(g); return DSK_OK; }
    (void)n_threads;
    (void)team; /* used by the OpenMP clause only */
    DSK__OMP(parallel num_threads(n_threads) if (team) reduction(|| : failed)) {
        int nt = 1, tid = 0;
        int64_t tm, tn, mlo, mhi, nlo, nhi;
        float *ws;
#ifdef _OPENMP
        nt = omp_get_num_threads();
        tid = omp_get_thread_num();
#endif
        dsk__gemm_grid(M, N, nt, uk->mr, uk->nr, &tm, &tn);
        if (tid < tm * tn) {
            dsk__split((M + uk->mr - 1) / uk->mr, tm, tid / tn, &mlo, &mhi);
            dsk__split((N + uk->nr - 1) / uk->nr, tn, tid % tn, &nlo, &nhi);
            mlo *= uk->mr; mhi = dsk__min64(mhi * uk->mr, M);
            nlo *= uk->nr; nhi = dsk__min64(nhi * uk->nr, N);
            ws = (float *)DSK_MALLOC((size_t)dsk__gemm_scratch(g, uk, nhi - nlo) * sizeof(float) + 1);
            if (ws) dsk__gemm_block(g, uk, mlo, mhi, nlo, nhi, ws);
            failed = !ws && mlo < mhi && nlo < nhi;
            if (ws) DSK_FREE(ws);
        }
    }
    if (failed) return dsk_set_error(DSK_ERR_OOM, "dsk_matmul: out of host memory for the GEMM packing buffers (K %lld)", (long long)K);
    return DSK_OK;
}

/* Used by dsk_sgemm_cpu only when the packing buffers cannot be allocated. */
static void dsk__gemm_unpacked(const dsk__gemm_args *g) {
    const float *A = (const float *)g->A, *B = (const float *)g->B;
    for (int64_t i = 0; i < g->M; i++)
        for (int64_t j = 0; j < g->N; j++) {
            float acc = 0.0f, *c = g->C + i * g->ldc + j;
            for (int64_t p = 0; p < g->K; p++) acc += A[i * g->a_rs + p * g->a_cs] * B[p * g->b_rs + j * g->b_cs];
            *c = g->alpha * acc + (g->beta == 0.0f ? 0.0f : g->beta * *c);
        }
}

/* Raw f32 GEMM arguments (dsk_sgemm_cpu's convention). */
static dsk__gemm_args dsk__sgemm_args(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                                      const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    dsk__gemm_args g;
    g.M = M; g.N = N; g.K = K; g.alpha = alpha; g.beta = beta;
    g.A = A; g.a_dt = DSK_F32; g.a_rs = trans_a ? 1 : lda; g.a_cs = trans_a ? lda : 1;
    g.B = B; g.b_dt = DSK_F32; g.b_rs = trans_b ? 1 : ldb; g.b_cs = trans_b ? ldb : 1;
    g.C = C; g.ldc = ldc;
    g.b_pack = 1;
    return g;
}

DSK_API void dsk_sgemm_cpu(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                           const float *B, int64_t ldb, float beta, float *C, int64_t ldc, int n_threads) {
    dsk__gemm_args g = dsk__sgemm_args(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    dsk__ukernel uk = dsk__ukernel_for(DSK_CPU_ISA_AUTO);
    if (dsk__gemm(&g, &uk, n_threads > 0 ? n_threads : dsk__default_threads()) != DSK_OK) dsk__gemm_unpacked(&g);
}

/* ---------------------------------------------------------------- CPU row primitives
   The f32 inner loops of the row ops (softmax, attention, norms, SwiGLU, cross-entropy) in
   portable C and in AVX-512 and AVX2 versions, picked with the GEMM kernel (ctx->cpu_isa).
   The vector exp repeats dsk_exp_f's operations lane by lane (the same bits as the scalar
   path); the vector loops cover a row's tail with masked loads and stores, and sums and maxima
   reduce lane-wise, then across lanes in a fixed order: a result depends on the instruction
   set, never on the thread count. */

typedef struct dsk__rowk {
    float (*max)(const float *x, int64_t n);                                   /* NaN if any is NaN; -Inf if n == 0 */
    float (*exp_sum)(float *y, const float *x, int64_t n, float sub);          /* y = e^(x - sub), returns sum y; y may be x */
    void (*scale)(float *y, const float *x, float s, int64_t n);               /* y = s x; y may be x */
    float (*dot)(const float *a, const float *b, int64_t n);
    void (*mul_scale)(float *y, const float *x, const float *w, float s, int64_t n); /* y = x s w */
    void (*sub_mul)(float *y, const float *p, const float *d, float c, int64_t n, int acc); /* y (+)= p (d - c) */
    void (*swiglu)(float *out, const float *g, const float *u, int64_t n);     /* out = silu(g) u */
    void (*swiglu_bwd)(float *dg, float *du, const float *dout, const float *g, const float *u, int64_t n, int acc); /* dg, du (+)= */
    /* pairs (y[2i], y[2i+1]) (+)= dsk_rope_rotate(x[2i], x[2i+1], cs[2i], cs[2i+1]); n even */
    void (*rope)(float *y, const float *x, const float *cs, int64_t n, int acc);
} dsk__rowk;

static float dsk__max_c(const float *x, int64_t n) {
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++) m = (x[i] > m || x[i] != x[i]) && m == m ? x[i] : m;
    return m;
}
static float dsk__exp_sum_c(float *y, const float *x, int64_t n, float sub) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += (y[i] = dsk_exp_f(x[i] - sub));
    return s;
}
static void dsk__scale_c32(float *y, const float *x, float s, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = s * x[i];
}
static float dsk__dot_c(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}
static void dsk__mul_scale_c(float *y, const float *x, const float *w, float s, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * s * w[i];
}
static void dsk__sub_mul_c(float *y, const float *p, const float *d, float c, int64_t n, int acc) {
    for (int64_t i = 0; i < n; i++) y[i] = (acc ? y[i] : 0.0f) + p[i] * (d[i] - c);
}
static void dsk__swiglu_c(float *out, const float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = dsk_swiglu_f(g[i], u[i]);
}
static void dsk__swiglu_bwd_c(float *dg, float *du, const float *dout, const float *g, const float *u, int64_t n, int acc) {
    for (int64_t i = 0; i < n; i++) {
        float a, b;
        dsk_swiglu_grad_f(g[i], u[i], dout[i], &a, &b);
        dg[i] = acc ? dg[i] + a : a;
        du[i] = acc ? du[i] + b : b;
    }
}

static void dsk__rope_c(float *y, const float *x, const float *cs, int64_t n, int acc) {
    for (int64_t i = 0; i < n; i += 2) {
        float y0, y1;
        dsk_rope_rotate(x[i], x[i + 1], cs[i], cs[i + 1], &y0, &y1);
        y[i] = acc ? y0 + y[i] : y0;
        y[i + 1] = acc ? y1 + y[i + 1] : y1;
    }
}

#if DSK__X86
/* dsk_exp_f on 16 lanes, operation for operation. */
DSK__INLINE DSK__TARGET_AVX512 __m512 dsk__exp512(__m512 x) {
    __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f)); /* NaN -> -104 */
    __m512 t = _mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(12582912.0f));
    __m512 n = _mm512_sub_ps(t, _mm512_set1_ps(12582912.0f)), r, p, y;
    __m512i ni = _mm512_cvtps_epi32(n), n1 = _mm512_srai_epi32(ni, 1), n2 = _mm512_sub_epi32(ni, n1), e = _mm512_set1_epi32(127);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), xc);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    p = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500e-4f), r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    y = _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, e), 23)));
    y = _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, e), 23)));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), y, x);
}
DSK__INLINE DSK__TARGET_AVX512 __mmask16 dsk__tail512(int64_t left) { return (__mmask16)(left >= 16 ? 0xffffu : (1u << left) - 1u); }
/* sigmoid(g) = 1 / (1 + e^-g), as dsk_sigmoid_f. */
DSK__INLINE DSK__TARGET_AVX512 __m512 dsk__sigmoid512(__m512 g) {
    __m512 one = _mm512_set1_ps(1.0f);
    __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32((int)0x80000000u)));
    return _mm512_div_ps(one, _mm512_add_ps(one, dsk__exp512(neg)));
}

static DSK__TARGET_AVX512 float dsk__max_avx512(const float *x, int64_t n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = dsk__tail512(n - i);
        __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, x + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        m = _mm512_max_ps(m, v);
    }
    return nan ? NAN : _mm512_reduce_max_ps(m);
}
static DSK__TARGET_AVX512 float dsk__exp_sum_avx512(float *y, const float *x, int64_t n, float sub) {
    __m512 s = _mm512_setzero_ps(), vs = _mm512_set1_ps(sub);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = dsk__tail512(n - i);
        __m512 e = dsk__exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), vs));
        _mm512_mask_storeu_ps(y + i, k, e);
        s = _mm512_mask_add_ps(s, k, s, e);
    }
    return _mm512_reduce_add_ps(s);
}
static DSK__TARGET_AVX512 void dsk__scale_avx512(float *y, const float *x, float s, int64_t n) {
    __m512 vs = _mm512_set1_ps(s);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = dsk__tail512(n - i);
        _mm512_mask_storeu_ps(y + i, k, _mm512_mul_ps(vs, _mm512_maskz_loadu_ps(k, x + i)));
    }
}
/* Four sums in flight, as dsk__dot_avx2. */
static DSK__TARGET_AVX512 float dsk__dot_avx512(const float *a, const float *b, int64_t n) {
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
        s2 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 32), _mm512_loadu_ps(b + i + 32), s2);
        s3 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 48), _mm512_loadu_ps(b + i + 48), s3);
    }
    for (; i < n; i += 16) {
        __mmask16 k = dsk__tail512(n - i);
        s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + i), _mm512_maskz_loadu_ps(k, b + i), s0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}
static DSK__TARGET_AVX512 void dsk__mul_scale_avx512(float *y, const float *x, const float *w, float s, int64_t n) {
    __m512 vs = _mm512_set1_ps(s);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = dsk__tail512(n - i);
        _mm512_mask_storeu_ps(y + i, k, _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), vs), _mm512_maskz_loadu_ps(k, w + i)));
    }
}
static DSK__TARGET_AVX512 void dsk__sub_mul_avx512(float *y, const float *p, const float *d, float c, int64_t n, int acc) {
    __m512 vc = _mm512_set1_ps(c);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = dsk__tail512(n - i);
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, p + i), _mm512_sub_ps(_mm512_maskz_loadu_ps(k, d + i), vc));
        if (acc) v = _mm512_add_ps(_mm512_maskz_loadu_ps(k, y + i), v);
        _mm512_mask_storeu_ps(y + i, k, v);
    }
}
static DSK__TARGET_AVX512 void dsk__swiglu_avx512(float *out, const float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = dsk__tail512(n - i);
        __m512 vg = _mm512_maskz_loadu_ps(k, g + i);
        _mm512_mask_storeu_ps(out + i, k, _mm512_mul_ps(_mm512_mul_ps(vg, dsk__sigmoid512(vg)), _mm512_maskz_loadu_ps(k, u + i)));
    }
}
static DSK__TARGET_AVX512 void dsk__swiglu_bwd_avx512(float *dg, float *du, const float *dout, const float *g, const float *u, int64_t n,
                                                      int acc) {
    __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = dsk__tail512(n - i);
        __m512 vg = _mm512_maskz_loadu_ps(k, g + i), vu = _mm512_maskz_loadu_ps(k, u + i), vd = _mm512_maskz_loadu_ps(k, dout + i);
        __m512 s = dsk__sigmoid512(vg), grad = _mm512_mul_ps(s, _mm512_fmadd_ps(vg, _mm512_sub_ps(one, s), one));
        __m512 a = _mm512_mul_ps(_mm512_mul_ps(vd, vu), grad), b = _mm512_mul_ps(vd, _mm512_mul_ps(vg, s));
        if (acc) {
            a = _mm512_add_ps(_mm512_maskz_loadu_ps(k, dg + i), a);
            b = _mm512_add_ps(_mm512_maskz_loadu_ps(k, du + i), b);
        }
        _mm512_mask_storeu_ps(dg + i, k, a);
        _mm512_mask_storeu_ps(du + i, k, b);
    }
}
/* dsk_rope_rotate on 8 pairs: y0 = x0 c + x1 (-s), y1 = x1 c + x0 s (the same products and sums:
   a - b is a + (-b) and the sum commutes), a multiply and an add each (never fused). */
static DSK__TARGET_AVX512 void dsk__rope_avx512(float *y, const float *x, const float *cs, int64_t n, int acc) {
    __m512i neg_even = _mm512_set4_epi32(0, (int)0x80000000u, 0, (int)0x80000000u); /* integer xor: AVX-512F only */
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = dsk__tail512(n - i);
        __m512 vx = _mm512_maskz_loadu_ps(k, x + i), vcs = _mm512_maskz_loadu_ps(k, cs + i);
        __m512 c = _mm512_moveldup_ps(vcs);
        __m512 sn = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_movehdup_ps(vcs)), neg_even));
        __m512 v = _mm512_add_ps(_mm512_mul_ps(vx, c), _mm512_mul_ps(_mm512_permute_ps(vx, 0xB1), sn));
        if (acc) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, y + i));
        _mm512_mask_storeu_ps(y + i, k, v);
    }
}

/* dsk_exp_f on 8 lanes, operation for operation. */
DSK__INLINE DSK__TARGET_AVX2 __m256 dsk__exp256(__m256 x) {
    __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)), _mm256_set1_ps(89.0f)); /* NaN -> -104 */
    __m256 t = _mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(12582912.0f));
    __m256 n = _mm256_sub_ps(t, _mm256_set1_ps(12582912.0f)), r, p, y;
    __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1), e = _mm256_set1_epi32(127);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), xc);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    p = _mm256_fmadd_ps(_mm256_set1_ps(1.9875691500e-4f), r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, e), 23)));
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, e), 23)));
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
/* Lanes [0, left) of 8 set: the vmaskmov mask of a row's tail. */
DSK__INLINE DSK__TARGET_AVX2 __m256i dsk__tail256(int64_t left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 8 ? left : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
/* The 8 floats at p, of which `left` (from 1) are the row's: lanes past the row read as zero. vmaskmov
   only at the tail: on AMD's cores a masked store costs about 13 plain ones (microcoded) and a masked
   load 2, so a row loop masking every vector ran its row kernels several times slower there. */
DSK__INLINE DSK__TARGET_AVX2 __m256 dsk__load256(const float *p, int64_t left) {
    return left >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, dsk__tail256(left));
}
/* Stores the row's lanes [0, min(left, 8)) of v at p; nothing past them. */
DSK__INLINE DSK__TARGET_AVX2 void dsk__store256(float *p, int64_t left, __m256 v) {
    if (left >= 8) _mm256_storeu_ps(p, v);
    else _mm256_maskstore_ps(p, dsk__tail256(left), v);
}
DSK__INLINE DSK__TARGET_AVX2 __m256 dsk__sigmoid256(__m256 g) {
    __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_div_ps(one, _mm256_add_ps(one, dsk__exp256(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)))));
}
static DSK__TARGET_AVX2 float dsk__hsum256(__m256 v) {
    float t[8], s = 0.0f;
    _mm256_storeu_ps(t, v);
    for (int i = 0; i < 8; i++) s += t[i];
    return s;
}

static DSK__TARGET_AVX2 float dsk__max_avx2(const float *x, int64_t n) {
    __m256 m = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    float t[8], r = -INFINITY;
    for (int64_t i = 0; i < n; i += 8) {
        __m256i k = dsk__tail256(n - i);
        __m256 v = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), dsk__load256(x + i, n - i), _mm256_castsi256_ps(k));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        m = _mm256_max_ps(m, v);
    }
    if (_mm256_movemask_ps(nan)) return NAN;
    _mm256_storeu_ps(t, m);
    for (int i = 0; i < 8; i++) r = t[i] > r ? t[i] : r;
    return r;
}
static DSK__TARGET_AVX2 float dsk__exp_sum_avx2(float *y, const float *x, int64_t n, float sub) {
    __m256 s = _mm256_setzero_ps(), vs = _mm256_set1_ps(sub);
    for (int64_t i = 0; i < n; i += 8) {
        __m256i k = dsk__tail256(n - i);
        __m256 e = dsk__exp256(_mm256_sub_ps(dsk__load256(x + i, n - i), vs));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(k));
        dsk__store256(y + i, n - i, e);
        s = _mm256_add_ps(s, e);
    }
    return dsk__hsum256(s);
}
static DSK__TARGET_AVX2 void dsk__scale_avx2(float *y, const float *x, float s, int64_t n) {
    __m256 vs = _mm256_set1_ps(s);
    for (int64_t i = 0; i < n; i += 8) dsk__store256(y + i, n - i, _mm256_mul_ps(vs, dsk__load256(x + i, n - i)));
}
/* Four sums in flight (an FMA's latency is four of its issue slots), lane sums added pairwise. */
static DSK__TARGET_AVX2 float dsk__dot_avx2(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
    }
    for (; i < n; i += 8) s0 = _mm256_fmadd_ps(dsk__load256(a + i, n - i), dsk__load256(b + i, n - i), s0);
    return dsk__hsum256(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
}
static DSK__TARGET_AVX2 void dsk__mul_scale_avx2(float *y, const float *x, const float *w, float s, int64_t n) {
    __m256 vs = _mm256_set1_ps(s);
    for (int64_t i = 0; i < n; i += 8) {
        dsk__store256(y + i, n - i,
                      _mm256_mul_ps(_mm256_mul_ps(dsk__load256(x + i, n - i), vs), dsk__load256(w + i, n - i)));
    }
}
static DSK__TARGET_AVX2 void dsk__sub_mul_avx2(float *y, const float *p, const float *d, float c, int64_t n, int acc) {
    __m256 vc = _mm256_set1_ps(c);
    for (int64_t i = 0; i < n; i += 8) {
        __m256 v = _mm256_mul_ps(dsk__load256(p + i, n - i), _mm256_sub_ps(dsk__load256(d + i, n - i), vc));
        if (acc) v = _mm256_add_ps(dsk__load256(y + i, n - i), v);
        dsk__store256(y + i, n - i, v);
    }
}
static DSK__TARGET_AVX2 void dsk__swiglu_avx2(float *out, const float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; i += 8) {
        __m256 vg = dsk__load256(g + i, n - i);
        dsk__store256(out + i, n - i,
                      _mm256_mul_ps(_mm256_mul_ps(vg, dsk__sigmoid256(vg)), dsk__load256(u + i, n - i)));
    }
}
static DSK__TARGET_AVX2 void dsk__swiglu_bwd_avx2(float *dg, float *du, const float *dout, const float *g, const float *u, int64_t n,
                                                  int acc) {
    __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += 8) {
        __m256 vg = dsk__load256(g + i, n - i), vu = dsk__load256(u + i, n - i), vd = dsk__load256(dout + i, n - i);
        __m256 s = dsk__sigmoid256(vg), grad = _mm256_mul_ps(s, _mm256_fmadd_ps(vg, _mm256_sub_ps(one, s), one));
        __m256 a = _mm256_mul_ps(_mm256_mul_ps(vd, vu), grad), b = _mm256_mul_ps(vd, _mm256_mul_ps(vg, s));
        if (acc) {
            a = _mm256_add_ps(dsk__load256(dg + i, n - i), a);
            b = _mm256_add_ps(dsk__load256(du + i, n - i), b);
        }
        dsk__store256(dg + i, n - i, a);
        dsk__store256(du + i, n - i, b);
    }
}
static DSK__TARGET_AVX2 void dsk__rope_avx2(float *y, const float *x, const float *cs, int64_t n, int acc) {
    __m256 neg_even = _mm256_castsi256_ps(_mm256_setr_epi32((int)0x80000000u, 0, (int)0x80000000u, 0, (int)0x80000000u, 0,
                                                            (int)0x80000000u, 0));
    for (int64_t i = 0; i < n; i += 8) {
        __m256 vx = dsk__load256(x + i, n - i), vcs = dsk__load256(cs + i, n - i);
        __m256 c = _mm256_moveldup_ps(vcs), sn = _mm256_xor_ps(_mm256_movehdup_ps(vcs), neg_even);
        __m256 v = _mm256_add_ps(_mm256_mul_ps(vx, c), _mm256_mul_ps(_mm256_permute_ps(vx, 0xB1), sn));
        if (acc) v = _mm256_add_ps(v, dsk__load256(y + i, n - i));
        dsk__store256(y + i, n - i, v);
    }
}
#endif

/* The row primitives of `isa` (AUTO or one this CPU lacks: dsk_cpu_isa_auto()'s). */
static dsk__rowk dsk__rowk_for(dsk_cpu_isa isa) {
    dsk__rowk r;
    if (!dsk_cpu_isa_supported(isa)) isa = dsk_cpu_isa_auto();
    r.max = dsk__max_c; r.exp_sum = dsk__exp_sum_c; r.scale = dsk__scale_c32; r.dot = dsk__dot_c;
    r.mul_scale = dsk__mul_scale_c; r.sub_mul = dsk__sub_mul_c; r.swiglu = dsk__swiglu_c; r.swiglu_bwd = dsk__swiglu_bwd_c;
    r.rope = dsk__rope_c;
#if DSK__X86
    if (isa == DSK_CPU_ISA_AVX512) {
        r.max = dsk__max_avx512; r.exp_sum = dsk__exp_sum_avx512; r.scale = dsk__scale_avx512; r.dot = dsk__dot_avx512;
        r.mul_scale = dsk__mul_scale_avx512; r.sub_mul = dsk__sub_mul_avx512; r.swiglu = dsk__swiglu_avx512;
        r.swiglu_bwd = dsk__swiglu_bwd_avx512; r.rope = dsk__rope_avx512;
    }
    if (isa == DSK_CPU_ISA_AVX2) {
        r.max = dsk__max_avx2; r.exp_sum = dsk__exp_sum_avx2; r.scale = dsk__scale_avx2; r.dot = dsk__dot_avx2;
        r.mul_scale = dsk__mul_scale_avx2; r.sub_mul = dsk__sub_mul_avx2; r.swiglu = dsk__swiglu_avx2; r.swiglu_bwd = dsk__swiglu_bwd_avx2;
        r.rope = dsk__rope_avx2;
    }
#endif
    return r;
}
static dsk__rowk dsk__rowk_ctx(const dsk_ctx *ctx) { return dsk__rowk_for(ctx ? ctx->cpu_isa : DSK_CPU_ISA_AUTO); }

DSK_API void dsk_swiglu_cpu(int64_t n, const float *gate, const float *up, float *out) {
    dsk__rowk_for(DSK_CPU_ISA_AUTO).swiglu(out, gate, up, n);
}
DSK_API void dsk_swiglu_grad_cpu(int64_t n, const float *gate, const float *up, const float *dout, float *dgate, float *dup) {
    dsk__rowk_for(DSK_CPU_ISA_AUTO).swiglu_bwd(dgate, dup, dout, gate, up, n, 0);
}

/* ---------------------------------------------------------------- matmul */

/* A matmul operand: the rows x cols matrix of batch b is at data + b * bstride (elements). */
typedef struct dsk__mat {
    int64_t batch, rows, cols, ld, bstride;
} dsk__mat;

static dsk_status dsk__matmul_operand(const char *what, const dsk_tensor *t, dsk__mat *m) {
    char b[96];
    if (t->ndim != 2 && t->ndim != 3)
        return dsk_set_error(DSK_ERR_ARG, "dsk_matmul: %s %s must have 2 or 3 dims", what, dsk_tensor_describe(t, b, sizeof b));
    if (t->shape[t->ndim - 1] > 1 && t->stride[t->ndim - 1] != 1)
        return dsk_set_error(DSK_ERR_ARG, "dsk_matmul: %s %s needs unit stride in its last dim (has %lld); pass a transpose flag instead",
                             what, dsk_tensor_describe(t, b, sizeof b), (long long)t->stride[t->ndim - 1]);
    m->batch = t->ndim == 3 ? t->shape[0] : 1;
    m->bstride = t->ndim == 3 ? t->stride[0] : 0;
    m->rows = t->shape[t->ndim - 2];
    m->cols = t->shape[t->ndim - 1];
    m->ld = t->stride[t->ndim - 2];
    return DSK_OK;
}

static dsk_status dsk__matmul_check(const dsk_tensor *C, const dsk_tensor *A, int trans_a, const dsk_tensor *B, int trans_b,
                                    dsk__mat *mc, dsk__mat *ma, dsk__mat *mb) {
    const char *fn = "dsk_matmul";
    char a[96], b[96], c[96];
    int64_t M, N, Ka, Kb;
    DSK__TRY(dsk__need(fn, "C", C));
    DSK__TRY(dsk__need(fn, "A", A));
    DSK__TRY(dsk__need(fn, "B", B));
    if (!dsk__is_cfloat(A->dtype))
        return dsk_set_error(DSK_ERR_ARG, "dsk_matmul: A %s: dtype must be f32, bf16 or f16", dsk_tensor_describe(A, a, sizeof a));
    DSK__TRY(dsk__need_same_dtype(fn, "B", B, "A", A));
    if (C->dtype != DSK_F32 && C->dtype != A->dtype)
        return dsk_set_error(DSK_ERR_ARG, "dsk_matmul: C %s: dtype must be f32 or A's dtype %s", dsk_tensor_describe(C, c, sizeof c),
                             dsk_dtype_name(A->dtype));
    DSK__TRY(dsk__matmul_operand("A", A, ma));
    DSK__TRY(dsk__matmul_operand("B", B, mb));
    DSK__TRY(dsk__matmul_operand("C", C, mc));
    M = trans_a ? ma->cols : ma->rows;
    Ka = trans_a ? ma->rows : ma->cols;
    Kb = trans_b ? mb->cols : mb->rows;
    N = trans_b ? mb->rows : mb->cols;
    if (Ka != Kb)
        return dsk_set_error(DSK_ERR_ARG, "dsk_matmul: inner dims differ: op(A) of A %s%s has K = %lld, op(B) of B %s%s has K = %lld",
                             dsk_tensor_describe(A, a, sizeof a), trans_a ? " (transposed)" : "", (long long)Ka,
                             dsk_tensor_describe(B, b, sizeof b), trans_b ? " (transposed)" : "", (long long)Kb);
    if (mc->rows != M || mc->cols != N)
        return dsk_set_error(DSK_ERR_ARG, "dsk_matmul: C %s must be (%lld, %lld) for A %s%s and B %s%s", dsk_tensor_describe(C, c, sizeof c),
                             (long long)M, (long long)N, dsk_tensor_describe(A, a, sizeof a), trans_a ? " (transposed)" : "",
                             dsk_tensor_describe(B, b, sizeof b), trans_b ? " (transposed)" : "");
    if (C->ndim != (A->ndim == 3 || B->ndim == 3 ? 3 : 2) || (A->ndim == 3 && ma->batch != mc->batch) ||
        (B->ndim == 3 && mb->batch != mc->batch))
        return dsk_set_error(DSK_ERR_ARG, "dsk_matmul: batch mismatch: C %s, A %s, B %s (3-D operands share the batch; C is 3-D iff one is)",
                             dsk_tensor_describe(C, c, sizeof c), dsk_tensor_describe(A, a, sizeof a), dsk_tensor_describe(B, b, sizeof b));
    return DSK_OK;
}

/* A batch of products too small for a team each (f32 C): one parallel region, each product on one
   thread with that thread's scratch, so the bits are those of a one-thread run. */
static dsk_status dsk__matmul_batched(dsk_ctx *ctx, const dsk__gemm_args *g0, const dsk__ukernel *uk, const dsk__mat *mc,
                                      const dsk__mat *ma, const dsk__mat *mb, size_t ae, size_t be) {
    int failed = 0;
    (void)ctx; /* used by the OpenMP clause only */
    DSK__OMP(parallel num_threads(dsk__threads(ctx)) if (mc->batch * g0->M * g0->N * g0->K >= 4194304) reduction(|| : failed))
    {
        float *ws = (float *)DSK_MALLOC((size_t)dsk__gemm_scratch(g0, uk, g0->N) * sizeof(float) + 1);
        failed = !ws;
        DSK__OMP(for schedule(static))
        for (int64_t bi = 0; bi < mc->batch; bi++) {
            dsk__gemm_args g = *g0;
            if (!ws) continue;
            g.A = (const char *)g0->A + (size_t)(bi * ma->bstride) * ae;
            g.B = (const char *)g0->B + (size_t)(bi * mb->bstride) * be;
            g.C = g0->C + bi * mc->bstride;
            dsk__gemm_serial(&g, uk, ws);
        }
        if (ws) DSK_FREE(ws);
    }
    if (failed) return dsk_set_error(DSK_ERR_OOM, "dsk_matmul: out of host memory for the GEMM buffers of a batch of %lld", (long long)mc->batch);
    return DSK_OK;
}

DSK_API dsk_status dsk_matmul(dsk_ctx *ctx, dsk_tensor *C, const dsk_tensor *A, int trans_a, const dsk_tensor *B, int trans_b,
                              float alpha, float beta) {
    dsk__mat mc, ma, mb;
    dsk__gemm_args g;
    dsk__ukernel uk = dsk__ukernel_for(ctx ? ctx->cpu_isa : DSK_CPU_ISA_AUTO);
    float *tmp = NULL;
    size_t ce = 0, ae, be;
    int cuda = 0;
    const dsk_tensor *ts[3] = {C, A, B};
    const char *names[3] = {"C", "A", "B"};
    DSK__TRY(dsk__matmul_check(C, A, trans_a, B, trans_b, &mc, &ma, &mb));
    DSK__TRY(dsk__need_devices("dsk_matmul", ctx, 3, ts, names, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_matmul(ctx, C, A, trans_a, B, trans_b, alpha, beta));
    (void)cuda;
    if (C->dtype != DSK_F32 && mc.rows * mc.cols > 0) {
        tmp = (float *)DSK_MALLOC((size_t)(mc.rows * mc.cols) * sizeof(float));
        if (!tmp) return dsk_set_error(DSK_ERR_OOM, "dsk_matmul: out of host memory for an f32 copy of C (%lld elements)", (long long)(mc.rows * mc.cols));
    }
    ae = dsk_dtype_size(A->dtype);
    be = dsk_dtype_size(B->dtype);
    ce = dsk_dtype_size(C->dtype);
    g.M = mc.rows; g.N = mc.cols; g.K = trans_a ? ma.rows : ma.cols;
    g.alpha = alpha; g.beta = beta;
    g.a_dt = A->dtype; g.a_rs = trans_a ? 1 : ma.ld; g.a_cs = trans_a ? ma.ld : 1;
    g.b_dt = B->dtype; g.b_rs = trans_b ? 1 : mb.ld; g.b_cs = trans_b ? mb.ld : 1;
    g.b_pack = 1;
    if (!tmp && mc.batch > 1 && dsk__gemm_batch_per_thread(&g)) {
        g.A = A->data; g.B = B->data; g.C = (float *)C->data; g.ldc = mc.ld;
        return dsk__matmul_batched(ctx, &g, &uk, &mc, &ma, &mb, ae, be);
    }
    for (int64_t bi = 0; bi < mc.batch; bi++) {
        dsk_status s;
        char *cdata = (char *)C->data + (size_t)(bi * mc.bstride) * ce;
        g.A = (const char *)A->data + (size_t)(bi * ma.bstride) * ae;
        g.B = (const char *)B->data + (size_t)(bi * mb.bstride) * be;
        if (tmp) {
            g.C = tmp; g.ldc = mc.cols;
            if (beta != 0.0f)
                for (int64_t i = 0; i < mc.rows; i++)
                    dsk_load_f32_n(tmp + i * mc.cols, cdata, C->dtype, i * mc.ld, mc.cols);
        } else {
            g.C = (float *)cdata; g.ldc = mc.ld;
        }
        s = dsk__gemm(&g, &uk, dsk__threads(ctx));
        if (s != DSK_OK) { if (tmp) DSK_FREE(tmp); return s; }
        if (tmp)
            for (int64_t i = 0; i < mc.rows; i++)
                dsk_store_f32_n(cdata, C->dtype, i * mc.ld, tmp + i * mc.cols, mc.cols);
    }
    if (tmp) DSK_FREE(tmp);
    return DSK_OK;
}

/* ---------------------------------------------------------------- f32 rows of any float dtype
   The row ops below compute in f32 on whole rows: f32 data in place, bf16/f16 converted into a
   per-thread row buffer with the dtype switch outside the element loop, and stored back once. */

/* Elements [off, off + n) of t as f32: t's own data when f32, else a converted copy in buf. */
static const float *dsk__row_in(const dsk_tensor *t, int64_t off, int64_t n, float *buf) {
    if (t->dtype == DSK_F32) return (const float *)t->data + off;
    dsk_load_f32_n(buf, t->data, t->dtype, off, n);
    return buf;
}
/* Where to write elements [off, off + n) of t in f32 (t's data or buf); dsk__row_out_done stores buf. */
static float *dsk__row_out(dsk_tensor *t, int64_t off, float *buf) { return t->dtype == DSK_F32 ? (float *)t->data + off : buf; }
static void dsk__row_out_done(dsk_tensor *t, int64_t off, int64_t n, const float *buf) {
    if (t->dtype != DSK_F32) dsk_store_f32_n(t->data, t->dtype, off, buf, n);
}
/* The same for an output that accumulates (+=): buf starts as the current values. */
static float *dsk__row_acc(dsk_tensor *t, int64_t off, int64_t n, float *buf) {
    if (t->dtype == DSK_F32) return (float *)t->data + off;
    dsk_load_f32_n(buf, t->data, t->dtype, off, n);
    return buf;
}
/* Per-thread f32 scratch: n_threads blocks of `per` floats (thread t uses block t). */
static float *dsk__scratch(const char *fn, dsk_ctx *ctx, int64_t per, dsk_status *s) {
    float *p = (float *)DSK_MALLOC((size_t)(per * dsk__threads(ctx)) * sizeof(float) + 1);
    *s = p ? DSK_OK : dsk_set_error(DSK_ERR_OOM, "%s: out of host memory for %lld scratch floats", fn, (long long)(per * dsk__threads(ctx)));
    return p;
}

/* Elementwise ops run over chunks of this many elements, each a row of the helpers above. */
#define DSK__EW_CHUNK 1024

/* o = dsk_ew_f(op, x, y, alpha) on n f32 elements (o may be x; y NULL for DSK_EW_SCALE): one
   loop per op, so each vectorises with its op fixed. */
static void dsk__ew_f32(dsk_ew_op op, float *o, const float *x, const float *y, float alpha, int64_t n) {
    const float *yy = y ? y : x;
    switch (op) {
#define DSK__EW_LOOP(OP, name, form) \
    case OP: DSK__OMP(simd) for (int64_t i = 0; i < n; i++) o[i] = dsk_ew_f(OP, x[i], yy[i], alpha); break;
        DSK_EW_OPS(DSK__EW_LOOP)
#undef DSK__EW_LOOP
    default: break;
    }
}

/* out = op(x, y) over every element, in f32 chunks (y NULL for DSK_EW_SCALE). */
static void dsk__ew(dsk_ctx *ctx, dsk_ew_op op, dsk_tensor *out, const dsk_tensor *x, const dsk_tensor *y, float alpha) {
    int64_t n = dsk_tensor_numel(out), n_chunks = (n + DSK__EW_CHUNK - 1) / DSK__EW_CHUNK;
    (void)ctx; /* used by the OpenMP clause only */
    DSK__OMP(parallel for schedule(static) num_threads(dsk__threads(ctx)) if (n > DSK__PAR_MIN))
    for (int64_t c = 0; c < n_chunks; c++) {
        float bo[DSK__EW_CHUNK], bx[DSK__EW_CHUNK], by[DSK__EW_CHUNK];
        int64_t off = c * DSK__EW_CHUNK, len = n - off < DSK__EW_CHUNK ? n - off : DSK__EW_CHUNK;
        const float *px = dsk__row_in(x, off, len, bx), *py = y ? dsk__row_in(y, off, len, by) : NULL;
        float *po = dsk__row_out(out, off, bo);
        dsk__ew_f32(op, po, px, py, alpha, len);
        dsk__row_out_done(out, off, len, bo);
    }
}

/* The one device dispatch of the elementwise ops: CUDA tensors to the launcher, the others to dsk__ew. */
static dsk_status dsk__ew_run(dsk_ctx *ctx, int cuda, dsk_ew_op op, dsk_tensor *out, const dsk_tensor *x,
                              const dsk_tensor *y, float alpha) {
    DSK__CUDA_PATH(cuda, dsk_cuda_elementwise(ctx, op, out, x, y, alpha));
    dsk__ew(ctx, op, out, x, y, alpha);
    return DSK_OK;
}

/* ---------------------------------------------------------------- elementwise */

static dsk_status dsk__binary(const char *fn, dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *a, const dsk_tensor *b, int *cuda) {
    const dsk_tensor *ts[3] = {out, a, b};
    const char *names[3] = {"out", "a", "b"};
    DSK__TRY(dsk__need_float(fn, "out", out));
    DSK__TRY(dsk__need_float(fn, "a", a));
    DSK__TRY(dsk__need_float(fn, "b", b));
    DSK__TRY(dsk__need_like(fn, "a", a, "out", out));
    DSK__TRY(dsk__need_like(fn, "b", b, "out", out));
    return dsk__need_devices(fn, ctx, 3, ts, names, cuda);
}

/* The public function of each BINARY entry of DSK_EW_OPS (dsk_add, dsk_mul): checks, dispatch. */
#define DSK__EW_DEFINE_BINARY(OP, name) \
    DSK_API dsk_status name(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *a, const dsk_tensor *b) { \
        int cuda = 0; \
        DSK__TRY(dsk__binary(#name, ctx, out, a, b, &cuda)); \
        return dsk__ew_run(ctx, cuda, OP, out, a, b, 0.0f); \
    }
#define DSK__EW_DEFINE_OWN(OP, name)
#define DSK__EW_DEFINE(OP, name, form) DSK__EW_DEFINE_##form(OP, name)
DSK_EW_OPS(DSK__EW_DEFINE)
#undef DSK__EW_DEFINE
#undef DSK__EW_DEFINE_OWN
#undef DSK__EW_DEFINE_BINARY

DSK_API dsk_status dsk_scale(dsk_ctx *ctx, dsk_tensor *t, float alpha) {
    int cuda = 0;
    const dsk_tensor *ts[1] = {t};
    const char *names[1] = {"t"};
    DSK__TRY(dsk__need_float("dsk_scale", "t", t));
    DSK__TRY(dsk__need_devices("dsk_scale", ctx, 1, ts, names, &cuda));
    return dsk__ew_run(ctx, cuda, DSK_EW_SCALE, t, t, NULL, alpha);
}

DSK_API dsk_status dsk_axpy(dsk_ctx *ctx, dsk_tensor *y, float alpha, const dsk_tensor *x) {
    int cuda = 0;
    const dsk_tensor *ts[2] = {y, x};
    const char *names[2] = {"y", "x"};
    DSK__TRY(dsk__need_float("dsk_axpy", "y", y));
    DSK__TRY(dsk__need_float("dsk_axpy", "x", x));
    DSK__TRY(dsk__need_same_shape("dsk_axpy", "x", x, "y", y));
    if (x->dtype != DSK_F32) DSK__TRY(dsk__need_same_dtype("dsk_axpy", "x", x, "y", y));
    DSK__TRY(dsk__need_devices("dsk_axpy", ctx, 2, ts, names, &cuda));
    return dsk__ew_run(ctx, cuda, DSK_EW_AXPY, y, y, x, alpha);
}

/* ---------------------------------------------------------------- reductions */

/* out's shape is in's without `axis`, or with it as 1. */
static dsk_status dsk__need_reduced_shape(const dsk_tensor *out, const dsk_tensor *in, int axis) {
    char a[96], b[96];
    int ok = 1;
    if (out->ndim == in->ndim - 1) {
        for (int i = 0, j = 0; i < in->ndim; i++)
            if (i != axis && out->shape[j++] != in->shape[i]) ok = 0;
    } else if (out->ndim == in->ndim) {
        for (int i = 0; i < in->ndim; i++)
            if (out->shape[i] != (i == axis ? 1 : in->shape[i])) ok = 0;
    } else {
        ok = 0;
    }
    if (!ok)
        return dsk_set_error(DSK_ERR_ARG, "dsk_reduce: out %s must be in %s without axis %d (or with it as 1)",
                             dsk_tensor_describe(out, a, sizeof a), dsk_tensor_describe(in, b, sizeof b), axis);
    return DSK_OK;
}

#define DSK__REDUCE_CHUNK 256

DSK_API dsk_status dsk_reduce(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *in, int axis, dsk_reduce_op op) {
    const char *fn = "dsk_reduce";
    char b[96];
    int cuda = 0;
    int64_t outer = 1, len, inner = 1, n_chunks;
    const dsk_tensor *ts[2] = {out, in};
    const char *names[2] = {"out", "in"};
    DSK__TRY(dsk__need_float(fn, "out", out));
    DSK__TRY(dsk__need_float(fn, "in", in));
    DSK__TRY(dsk__need_same_dtype(fn, "out", out, "in", in));
    if (axis < 0) axis += in->ndim;
    if (axis < 0 || axis >= in->ndim)
        return dsk_set_error(DSK_ERR_ARG, "dsk_reduce: axis %d outside in %s", axis < 0 ? axis - in->ndim : axis, dsk_tensor_describe(in, b, sizeof b));
    if (op != DSK_REDUCE_SUM && op != DSK_REDUCE_MEAN && op != DSK_REDUCE_MAX)
        return dsk_set_error(DSK_ERR_ARG, "dsk_reduce: unknown op %d", (int)op);
    DSK__TRY(dsk__need_reduced_shape(out, in, axis));
    DSK__TRY(dsk__need_devices(fn, ctx, 2, ts, names, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_reduce(ctx, out, in, axis, op));
    for (int i = 0; i < axis; i++) outer *= in->shape[i];
    for (int i = axis + 1; i < in->ndim; i++) inner *= in->shape[i];
    len = in->shape[axis];
    n_chunks = (inner + DSK__REDUCE_CHUNK - 1) / DSK__REDUCE_CHUNK;
    /* Each output sums its `len` inputs in index order, in f64: thread-count independent. */
    DSK__OMP(parallel for schedule(static) num_threads(dsk__threads(ctx)) if (outer * inner * len > DSK__PAR_MIN))
    for (int64_t task = 0; task < outer * n_chunks; task++) {
        double acc[DSK__REDUCE_CHUNK];
        int64_t o = task / n_chunks, i0 = (task % n_chunks) * DSK__REDUCE_CHUNK;
        int64_t ni = inner - i0 < DSK__REDUCE_CHUNK ? inner - i0 : DSK__REDUCE_CHUNK;
        for (int64_t i = 0; i < ni; i++) acc[i] = op == DSK_REDUCE_MAX ? -INFINITY : 0.0;
        for (int64_t r = 0; r < len; r++) {
            int64_t base = (o * len + r) * inner + i0;
            for (int64_t i = 0; i < ni; i++) {
                double x = dsk_load_f32(in->data, in->dtype, base + i);
                if (op != DSK_REDUCE_MAX) acc[i] += x;
                else if (acc[i] == acc[i] && (x != x || x > acc[i])) acc[i] = x; /* NaN sticks */
            }
        }
        for (int64_t i = 0; i < ni; i++)
            dsk_store_f32(out->data, out->dtype, o * inner + i0 + i, (float)(op == DSK_REDUCE_MEAN ? acc[i] / (double)len : acc[i]));
    }
    return DSK_OK;
}

#define DSK__SSQ_CHUNK 4096
#define DSK__SSQ_GROUP 64

DSK_API dsk_status dsk_sum_squares(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *in) {
    int cuda = 0;
    int64_t n;
    double total = 0.0;
    const dsk_tensor *ts[2] = {out, in};
    const char *names[2] = {"out", "in"};
    DSK__TRY(dsk__need_scalar("dsk_sum_squares", "out", out));
    DSK__TRY(dsk__need_float("dsk_sum_squares", "in", in));
    DSK__TRY(dsk__need_devices("dsk_sum_squares", ctx, 2, ts, names, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_sum_squares(ctx, out, in));
    n = dsk_tensor_numel(in);
    /* Fixed chunks with f64 partials, combined in chunk order: thread-count independent. */
    for (int64_t g0 = 0; g0 < n; g0 += (int64_t)DSK__SSQ_CHUNK * DSK__SSQ_GROUP) {
        double part[DSK__SSQ_GROUP];
        DSK__OMP(parallel for schedule(static) num_threads(dsk__threads(ctx)) if (n - g0 > DSK__PAR_MIN))
        for (int c = 0; c < DSK__SSQ_GROUP; c++) {
            int64_t lo = g0 + (int64_t)c * DSK__SSQ_CHUNK, hi = lo + DSK__SSQ_CHUNK < n ? lo + DSK__SSQ_CHUNK : n;
            double s = 0.0;
            for (int64_t i = lo; i < hi; i++) {
                double x = dsk_load_f32(in->data, in->dtype, i);
                s += x * x;
            }
            part[c] = s;
        }
        for (int c = 0; c < DSK__SSQ_GROUP; c++) total += part[c];
    }
    *(float *)out->data = (float)total;
    return DSK_OK;
}

/* ---------------------------------------------------------------- softmax, norms, activations */

DSK_API dsk_status dsk_softmax(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x) {
    const char *fn = "dsk_softmax";
    int cuda, half;
    int64_t R, C;
    float *scratch;
    dsk_status s;
    dsk__rowk rk = dsk__rowk_ctx(ctx);
    const dsk_tensor *ts[2] = {y, x};
    const char *names[2] = {"y", "x"};
    DSK__TRY(dsk__need_float(fn, "y", y));
    DSK__TRY(dsk__need_float(fn, "x", x));
    DSK__TRY(dsk__need_rows(fn, "x", x));
    DSK__TRY(dsk__need_like(fn, "y", y, "x", x));
    DSK__TRY(dsk__need_devices(fn, ctx, 2, ts, names, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_softmax(ctx, y, x));
    dsk__rows_cols(x, &R, &C);
    half = x->dtype != DSK_F32;
    if (!(scratch = dsk__scratch(fn, ctx, half ? 2 * C : 0, &s))) return s;
    /* one exp per element: y = e^(x - max), then y *= 1 / sum y (y may alias x) */
    DSK__OMP(parallel for schedule(static) num_threads(dsk__threads(ctx)) if (R * C > DSK__PAR_MIN))
    for (int64_t r = 0; r < R; r++) {
        float *buf = scratch + (half ? 2 * C : 0) * dsk__thread_id();
        const float *xr = dsk__row_in(x, r * C, C, buf);
        float *yr = dsk__row_out(y, r * C, buf + C);
        rk.scale(yr, yr, 1.0f / rk.exp_sum(yr, xr, C, rk.max(xr, C)), C);
        dsk__row_out_done(y, r * C, C, yr);
    }
    DSK_FREE(scratch);
    return DSK_OK;
}

DSK_API dsk_status dsk_softmax_backward(dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *y, const dsk_tensor *dy) {
    const char *fn = "dsk_softmax_backward";
    int cuda, half;
    int64_t R, C;
    float *scratch;
    dsk_status s;
    dsk__rowk rk = dsk__rowk_ctx(ctx);
    const dsk_tensor *ts[3] = {dx, y, dy};
    const char *names[3] = {"dx", "y", "dy"};
    DSK__TRY(dsk__need_float(fn, "dx", dx));
    DSK__TRY(dsk__need_float(fn, "y", y));
    DSK__TRY(dsk__need_float(fn, "dy", dy));
    DSK__TRY(dsk__need_rows(fn, "y", y));
    DSK__TRY(dsk__need_like(fn, "dy", dy, "y", y));
    DSK__TRY(dsk__need_like(fn, "dx", dx, "y", y));
    DSK__TRY(dsk__need_devices(fn, ctx, 3, ts, names, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_softmax_backward(ctx, dx, y, dy));
    dsk__rows_cols(y, &R, &C);
    half = y->dtype != DSK_F32;
    if (!(scratch = dsk__scratch(fn, ctx, half ? 3 * C : 0, &s))) return s;
    DSK__OMP(parallel for schedule(static) num_threads(dsk__threads(ctx)) if (R * C > DSK__PAR_MIN))
    for (int64_t r = 0; r < R; r++) {
        float *buf = scratch + (half ? 3 * C : 0) * dsk__thread_id();
        const float *yr = dsk__row_in(y, r * C, C, buf), *dyr = dsk__row_in(dy, r * C, C, buf + C);
        float *dxr = dsk__row_acc(dx, r * C, C, buf + 2 * C);
        rk.sub_mul(dxr, yr, dyr, rk.dot(yr, dyr, C), C, 1);
        dsk__row_out_done(dx, r * C, C, dxr);
    }
    DSK_FREE(scratch);
    return DSK_OK;
}

/* t is 1-D of length n (the last dim of r). */
static dsk_status dsk__need_vec(const char *fn, const char *what, const dsk_tensor *t, int64_t n, const char *rwhat, const dsk_tensor *r) {
    char a[96], b[96];
    if (t->ndim != 1 || t->shape[0] != n)
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %s must be (%lld), the last dim of %s %s", fn, what, dsk_tensor_describe(t, a, sizeof a),
                             (long long)n, rwhat, dsk_tensor_describe(r, b, sizeof b));
    return DSK_OK;
}

DSK_API dsk_status dsk_rmsnorm(dsk_ctx *ctx, dsk_tensor *y, dsk_tensor *rstd, const dsk_tensor *x, const dsk_tensor *w, float eps) {
    const char *fn = "dsk_rmsnorm";
    int cuda, half;
    int64_t R, D;
    float *scratch;
    dsk_status s;
    dsk__rowk rk = dsk__rowk_ctx(ctx);
    const dsk_tensor *ts[4] = {y, x, w, rstd};
    const char *names[4] = {"y", "x", "w", "rstd"};
    DSK__TRY(dsk__need_float(fn, "y", y));
    DSK__TRY(dsk__need_float(fn, "x", x));
    DSK__TRY(dsk__need_float(fn, "w", w));
    DSK__TRY(dsk__need_rows(fn, "x", x));
    DSK__TRY(dsk__need_like(fn, "y", y, "x", x));
    DSK__TRY(dsk__need_same_dtype(fn, "w", w, "x", x));
    dsk__rows_cols(x, &R, &D);
    DSK__TRY(dsk__need_vec(fn, "w", w, D, "x", x));
    if (rstd) {
        DSK__TRY(dsk__need_dtype(fn, "rstd", rstd, DSK_F32));
        DSK__TRY(dsk__need_lead_shape(fn, "rstd", rstd, "x", x));
    }
    if (!(eps >= 0.0f) || isinf(eps)) return dsk_set_error(DSK_ERR_ARG, "dsk_rmsnorm: eps %g must be finite and >= 0", (double)eps);
    DSK__TRY(dsk__need_devices(fn, ctx, 4, ts, names, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_rmsnorm(ctx, y, rstd, x, w, eps));
    half = x->dtype != DSK_F32;
    if (!(scratch = dsk__scratch(fn, ctx, half ? 3 * D : 0, &s))) return s;
    DSK__OMP(parallel for schedule(static) num_threads(dsk__threads(ctx)) if (R * D > DSK__PAR_MIN))
    for (int64_t r = 0; r < R; r++) {
        float *buf = scratch + (half ? 3 * D : 0) * dsk__thread_id();
        const float *xr = dsk__row_in(x, r * D, D, buf), *wr = dsk__row_in(w, 0, D, buf + D);
        float *yr = dsk__row_out(y, r * D, buf + 2 * D);
        float rs = (float)(1.0 / sqrt((double)rk.dot(xr, xr, D) / (double)D + (double)eps));
        if (rstd) ((float *)rstd->data)[r] = rs;
        rk.mul_scale(yr, xr, wr, rs, D);
        dsk__row_out_done(y, r * D, D, yr);
    }
    DSK_FREE(scratch);
    return DSK_OK;
}

/* acc[j] += dy[j] (x[j] rstd) in f64: one row's share of RMSNorm's weight gradient. */
static void dsk__rms_dw_row(double *acc, const float *dy, const float *x, float rstd, int64_t n) {
    DSK__OMP(simd)
    for (int64_t j = 0; j < n; j++) acc[j] += (double)dy[j] * (x[j] * rstd);
}
/* dw[j0 + j] += acc[j], rounded to dw's dtype once (buf: n floats for a half dw). */
static void dsk__rms_dw_add(dsk_tensor *dw, const double *acc, int64_t j0, int64_t n, float *buf) {
    float *dwr = dsk__row_acc(dw, j0, n, buf);
    for (int64_t j = 0; j < n; j++) dwr[j] = (float)(dwr[j] + acc[j]);
    dsk__row_out_done(dw, j0, n, dwr);
}

DSK_API dsk_status dsk_rmsnorm_backward(dsk_ctx *ctx, dsk_tensor *dx, dsk_tensor *dw, const dsk_tensor *dy, const dsk_tensor *x,
                                        const dsk_tensor *w, const dsk_tensor *rstd) {
    const char *fn = "dsk_rmsnorm_backward";
    int cuda, half, fused;
    int64_t R, D, nt, per;
    const float *rs;
    float *scratch;
    dsk_status s;
    dsk__rowk rk = dsk__rowk_ctx(ctx);
    const dsk_tensor *ts[6] = {dy, x, w, rstd, dx, dw};
    const char *names[6] = {"dy", "x", "w", "rstd", "dx", "dw"};
    DSK__TRY(dsk__need_float(fn, "dy", dy));
    DSK__TRY(dsk__need_float(fn, "x", x));
    DSK__TRY(dsk__need_float(fn, "w", w));
    DSK__TRY(dsk__need_rows(fn, "x", x));
    DSK__TRY(dsk__need_like(fn, "dy", dy, "x", x));
    DSK__TRY(dsk__need_same_dtype(fn, "w", w, "x", x));
    dsk__rows_cols(x, &R, &D);
    DSK__TRY(dsk__need_vec(fn, "w", w, D, "x", x));
    DSK__TRY(dsk__need_dtype(fn, "rstd", rstd, DSK_F32));
    DSK__TRY(dsk__need_lead_shape(fn, "rstd", rstd, "x", x));
    if (dx) {
        DSK__TRY(dsk__need_float(fn, "dx", dx));
        DSK__TRY(dsk__need_like(fn, "dx", dx, "x", x));
    }
    if (dw) {
        DSK__TRY(dsk__need_float(fn, "dw", dw));
        DSK__TRY(dsk__need_like(fn, "dw", dw, "w", w));
    }
    DSK__TRY(dsk__need_devices(fn, ctx, 6, ts, names, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_rmsnorm_backward(ctx, dx, dw, dy, x, w, rstd));
    rs = (const float *)rstd->data;
    half = x->dtype != DSK_F32;
    nt = R * D > DSK__PAR_MIN ? dsk__threads(ctx) : 1;
    fused = dx && dw && nt == 1;
    per = 2 * D + dsk__round_up(half ? 4 * D : D, 2); /* dw's f64 sums first (8-byte aligned), then rows */
    if (!(scratch = dsk__scratch(fn, ctx, per, &s))) return s;
    if (dx) {
        /* xh = x rstd, g = dy w: dx += rstd (g - xh mean(g xh)); on one thread dw's sums ride along */
        double *acc = fused ? (double *)scratch : NULL;
        if (fused) memset(acc, 0, (size_t)D * sizeof *acc);
        DSK__OMP(parallel for schedule(static) num_threads(nt) if (nt > 1))
        for (int64_t r = 0; r < R; r++) {
            float *buf = scratch + per * dsk__thread_id() + 2 * D, *g = buf + (half ? 3 * D : 0);
            const float *xr = dsk__row_in(x, r * D, D, buf), *dyr = dsk__row_in(dy, r * D, D, buf + D), *wr;
            float *dxr, c;
            wr = dsk__row_in(w, 0, D, g); /* g doubles as w's buffer until it is written */
            DSK__OMP(simd)
            for (int64_t j = 0; j < D; j++) g[j] = dyr[j] * wr[j];
            c = rs[r] * (rk.dot(g, xr, D) * rs[r] / (float)D); /* rstd * mean(g xh) */
            dxr = dsk__row_acc(dx, r * D, D, buf + 2 * D);
            DSK__OMP(simd)
            for (int64_t j = 0; j < D; j++) dxr[j] += rs[r] * (g[j] - xr[j] * c);
            dsk__row_out_done(dx, r * D, D, dxr);
            if (fused) dsk__rms_dw_row(acc, dyr, xr, rs[r], D);
        }
        if (fused) dsk__rms_dw_add(dw, acc, 0, D, scratch + 2 * D);
    }
    if (dw && !fused) {
        /* A contiguous range of columns per thread, read row by row; each column sums its rows in
           order, in f64, so the bits do not depend on the split. */
        int64_t cw = dsk__round_up((D + nt - 1) / nt, 8), n_chunks = (D + cw - 1) / cw;
        DSK__OMP(parallel for schedule(static) num_threads(nt) if (nt > 1))
        for (int64_t c = 0; c < n_chunks; c++) {
            double *acc = (double *)(scratch + per * dsk__thread_id());
            float *buf = scratch + per * dsk__thread_id() + 2 * D;
            int64_t j0 = c * cw, nj = D - j0 < cw ? D - j0 : cw;
            memset(acc, 0, (size_t)nj * sizeof *acc);
            for (int64_t r = 0; r < R; r++)
                dsk__rms_dw_row(acc, dsk__row_in(dy, r * D + j0, nj, buf + D), dsk__row_in(x, r * D + j0, nj, buf),
                                rs[r], nj);
            dsk__rms_dw_add(dw, acc, j0, nj, buf);
        }
    }
    DSK_FREE(scratch);
    return DSK_OK;
}

/* Checks for the elementwise activations: every tensor like the first. */
static dsk_status dsk__need_all_like(const char *fn, dsk_ctx *ctx, int n, const dsk_tensor *const *ts, const char *const *names, int *cuda) {
    for (int i = 0; i < n; i++) DSK__TRY(dsk__need_float(fn, names[i], ts[i]));
    for (int i = 1; i < n; i++) DSK__TRY(dsk__need_like(fn, names[i], ts[i], names[0], ts[0]));
    return dsk__need_devices(fn, ctx, n, ts, names, cuda);
}

/* The activations run over f32 chunks of DSK__EW_CHUNK elements (dsk__ew's scheme). */
typedef enum dsk__act_op { DSK__ACT_SILU, DSK__ACT_SILU_BWD, DSK__ACT_SWIGLU, DSK__ACT_SWIGLU_BWD } dsk__act_op;

/* o0 (and o1) = op(a, b, c): silu(a); dx o0 += a silu'(b); swiglu(gate a, up b); dgate o0, dup o1
   (+)= the SwiGLU gradients for gate a, up b, dout c (added when acc, else written). */
static void dsk__act(dsk_ctx *ctx, dsk__act_op op, int acc, dsk_tensor *o0, dsk_tensor *o1, const dsk_tensor *a,
                     const dsk_tensor *b, const dsk_tensor *c) {
    int64_t n = dsk_tensor_numel(a), n_chunks = (n + DSK__EW_CHUNK - 1) / DSK__EW_CHUNK;
    dsk__rowk rk = dsk__rowk_ctx(ctx);
    DSK__OMP(parallel for schedule(static) num_threads(dsk__threads(ctx)) if (n > DSK__PAR_MIN))
    for (int64_t ch = 0; ch < n_chunks; ch++) {
        float b0[DSK__EW_CHUNK], b1[DSK__EW_CHUNK], ba[DSK__EW_CHUNK], bb[DSK__EW_CHUNK], bc[DSK__EW_CHUNK];
        int64_t off = ch * DSK__EW_CHUNK, len = n - off < DSK__EW_CHUNK ? n - off : DSK__EW_CHUNK;
        const float *pa = dsk__row_in(a, off, len, ba), *pb = b ? dsk__row_in(b, off, len, bb) : NULL;
        const float *pc = c ? dsk__row_in(c, off, len, bc) : NULL;
        float *p0 = acc ? dsk__row_acc(o0, off, len, b0) : dsk__row_out(o0, off, b0);
        float *p1 = !o1 ? NULL : acc ? dsk__row_acc(o1, off, len, b1) : dsk__row_out(o1, off, b1);
        if (op == DSK__ACT_SILU)
            for (int64_t i = 0; i < len; i++) p0[i] = dsk_silu_f(pa[i]);
        else if (op == DSK__ACT_SILU_BWD) /* a = dy, b = x */
            for (int64_t i = 0; i < len; i++) p0[i] += pa[i] * dsk_silu_grad_f(pb[i]);
        else if (op == DSK__ACT_SWIGLU) /* a = gate, b = up */
            rk.swiglu(p0, pa, pb, len);
        else rk.swiglu_bwd(p0, p1, pc, pa, pb, len, acc); /* a = gate, b = up, c = dout */
        dsk__row_out_done(o0, off, len, p0);
        if (o1) dsk__row_out_done(o1, off, len, p1);
    }
}

DSK_API dsk_status dsk_silu(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x) {
    int cuda = 0;
    const dsk_tensor *ts[2] = {y, x};
    const char *names[2] = {"y", "x"};
    DSK__TRY(dsk__need_all_like("dsk_silu", ctx, 2, ts, names, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_silu(ctx, y, x));
    dsk__act(ctx, DSK__ACT_SILU, 0, y, NULL, x, NULL, NULL);
    return DSK_OK;
}

DSK_API dsk_status dsk_silu_backward(dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *dy, const dsk_tensor *x) {
    int cuda = 0;
    const dsk_tensor *ts[3] = {dx, dy, x};
    const char *names[3] = {"dx", "dy", "x"};
    DSK__TRY(dsk__need_all_like("dsk_silu_backward", ctx, 3, ts, names, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_silu_backward(ctx, dx, dy, x));
    dsk__act(ctx, DSK__ACT_SILU_BWD, 1, dx, NULL, dy, x, NULL);
    return DSK_OK;
}

DSK_API dsk_status dsk_swiglu(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *gate, const dsk_tensor *up) {
    int cuda = 0;
    const dsk_tensor *ts[3] = {out, gate, up};
    const char *names[3] = {"out", "gate", "up"};
    DSK__TRY(dsk__need_all_like("dsk_swiglu", ctx, 3, ts, names, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_swiglu(ctx, out, gate, up));
    dsk__act(ctx, DSK__ACT_SWIGLU, 0, out, NULL, gate, up, NULL);
    return DSK_OK;
}

DSK_API dsk_status dsk_swiglu_backward(dsk_ctx *ctx, dsk_tensor *dgate, dsk_tensor *dup, const dsk_tensor *dout,
                                       const dsk_tensor *gate, const dsk_tensor *up, dsk_grad_store store) {
    int cuda = 0;
    const dsk_tensor *ts[5] = {dgate, dup, dout, gate, up};
    const char *names[5] = {"dgate", "dup", "dout", "gate", "up"};
    DSK__TRY(dsk__need_all_like("dsk_swiglu_backward", ctx, 5, ts, names, &cuda));
    DSK__TRY(dsk__need_store("dsk_swiglu_backward", store));
    DSK__CUDA_PATH(cuda, dsk_cuda_swiglu_backward(ctx, dgate, dup, dout, gate, up, store == DSK_GRAD_ADD));
    dsk__act(ctx, DSK__ACT_SWIGLU_BWD, store == DSK_GRAD_ADD, dgate, dup, gate, up, dout);
    return DSK_OK;
}

/* ---------------------------------------------------------------- rows by index */

#define DSK__COL_CHUNK 64

/* dst (R, D) row idx[i] += src (N, D) row i for i = 0..N-1 in order. Threads split the
   columns, so each element accumulates in index order whatever the thread count. */
static void dsk__scatter_add_cpu(dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src, const int32_t *idx, int64_t N, int64_t D) {
    (void)ctx; /* used by the OpenMP clause only */
    int64_t n_chunks = (D + DSK__COL_CHUNK - 1) / DSK__COL_CHUNK;
    DSK__OMP(parallel for schedule(static) num_threads(dsk__threads(ctx)) if (N * D > DSK__PAR_MIN))
    for (int64_t c = 0; c < n_chunks; c++) {
        int64_t j0 = c * DSK__COL_CHUNK, j1 = j0 + DSK__COL_CHUNK < D ? j0 + DSK__COL_CHUNK : D;
        if (dst->dtype == DSK_F32 && src->dtype == DSK_F32) { /* the same adds, the dtype switch hoisted */
            for (int64_t i = 0; i < N; i++) {
                float *d = (float *)dst->data + (int64_t)idx[i] * D;
                const float *x = (const float *)src->data + i * D;
                DSK__OMP(simd)
                for (int64_t j = j0; j < j1; j++) d[j] += x[j];
            }
            continue;
        }
        for (int64_t i = 0; i < N; i++)
            for (int64_t j = j0; j < j1; j++) {
                int64_t o = (int64_t)idx[i] * D + j;
                dsk_store_f32(dst->data, dst->dtype, o, dsk_load_f32(dst->data, dst->dtype, o) + dsk_load_f32(src->data, src->dtype, i * D + j));
            }
    }
}

/* out (N, D) row i = src (R, D) row idx[i]; same dtype. */
static void dsk__gather_cpu(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *src, const int32_t *idx, int64_t N, int64_t D) {
    (void)ctx; /* used by the OpenMP clause only */
    size_t row = (size_t)D * dsk_dtype_size(src->dtype);
    DSK__OMP(parallel for schedule(static) num_threads(dsk__threads(ctx)) if (N * D > DSK__PAR_MIN))
    for (int64_t i = 0; i < N; i++) memcpy((char *)out->data + (size_t)i * row, (const char *)src->data + (size_t)idx[i] * row, row);
}

/* table (V, D), ids (...) i32, rows (..., D) like table: the embedding argument checks. */
static dsk_status dsk__embedding_check(const char *fn, dsk_ctx *ctx, const char *rows_name, const dsk_tensor *rows, const char *table_name,
                                       const dsk_tensor *table, const dsk_tensor *ids, int *cuda) {
    char a[96], b[96];
    const dsk_tensor *ts[3] = {rows, table, ids};
    const char *names[3] = {rows_name, table_name, "ids"};
    DSK__TRY(dsk__need_float(fn, table_name, table));
    DSK__TRY(dsk__need_ndim(fn, table_name, table, 2));
    DSK__TRY(dsk__need_float(fn, rows_name, rows));
    DSK__TRY(dsk__need_same_dtype(fn, rows_name, rows, table_name, table));
    DSK__TRY(dsk__need_dtype(fn, "ids", ids, DSK_I32));
    DSK__TRY(dsk__need_rows(fn, rows_name, rows));
    DSK__TRY(dsk__need_lead_shape(fn, "ids", ids, rows_name, rows));
    if (rows->shape[rows->ndim - 1] != table->shape[1])
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %s must have the last dim of %s %s", fn, rows_name, dsk_tensor_describe(rows, a, sizeof a),
                             table_name, dsk_tensor_describe(table, b, sizeof b));
    return dsk__need_devices(fn, ctx, 3, ts, names, cuda);
}

DSK_API dsk_status dsk_embedding(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *table, const dsk_tensor *ids) {
    int cuda = 0;
    DSK__TRY(dsk__embedding_check("dsk_embedding", ctx, "out", out, "table", table, ids, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_embedding(ctx, out, table, ids));
    DSK__TRY(dsk__need_indices("dsk_embedding", "ids", ids, table->shape[0], 0, 0));
    dsk__gather_cpu(ctx, out, table, (const int32_t *)ids->data, dsk_tensor_numel(ids), table->shape[1]);
    return DSK_OK;
}

DSK_API dsk_status dsk_embedding_backward(dsk_ctx *ctx, dsk_tensor *dtable, const dsk_tensor *dout, const dsk_tensor *ids) {
    int cuda = 0;
    DSK__TRY(dsk__embedding_check("dsk_embedding_backward", ctx, "dout", dout, "dtable", dtable, ids, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_embedding_backward(ctx, dtable, dout, ids));
    DSK__TRY(dsk__need_indices("dsk_embedding_backward", "ids", ids, dtable->shape[0], 0, 0));
    dsk__scatter_add_cpu(ctx, dtable, dout, (const int32_t *)ids->data, dsk_tensor_numel(ids), dtable->shape[1]);
    return DSK_OK;
}

/* src/dst (R, D) `big`, idx (N) i32, rows (N, D) like big: gather/scatter argument checks. */
static dsk_status dsk__rows_check(const char *fn, dsk_ctx *ctx, const char *big_name, const dsk_tensor *big, const char *rows_name,
                                  const dsk_tensor *rows, const dsk_tensor *idx, int *cuda) {
    char a[96], b[96], c[96];
    const dsk_tensor *ts[3] = {big, rows, idx};
    const char *names[3] = {big_name, rows_name, "idx"};
    DSK__TRY(dsk__need_float(fn, big_name, big));
    DSK__TRY(dsk__need_ndim(fn, big_name, big, 2));
    DSK__TRY(dsk__need_float(fn, rows_name, rows));
    DSK__TRY(dsk__need_ndim(fn, rows_name, rows, 2));
    DSK__TRY(dsk__need_same_dtype(fn, rows_name, rows, big_name, big));
    DSK__TRY(dsk__need_dtype(fn, "idx", idx, DSK_I32));
    DSK__TRY(dsk__need_ndim(fn, "idx", idx, 1));
    if (rows->shape[0] != idx->shape[0] || rows->shape[1] != big->shape[1])
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %s must be (%lld, %lld) for idx %s and %s %s", fn, rows_name, dsk_tensor_describe(rows, a, sizeof a),
                             (long long)idx->shape[0], (long long)big->shape[1], dsk_tensor_describe(idx, b, sizeof b), big_name,
                             dsk_tensor_describe(big, c, sizeof c));
    return dsk__need_devices(fn, ctx, 3, ts, names, cuda);
}

DSK_API dsk_status dsk_gather_rows(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *src, const dsk_tensor *idx) {
    int cuda = 0;
    DSK__TRY(dsk__rows_check("dsk_gather_rows", ctx, "src", src, "out", out, idx, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_gather_rows(ctx, out, src, idx));
    DSK__TRY(dsk__need_indices("dsk_gather_rows", "idx", idx, src->shape[0], 0, 0));
    dsk__gather_cpu(ctx, out, src, (const int32_t *)idx->data, idx->shape[0], src->shape[1]);
    return DSK_OK;
}

DSK_API dsk_status dsk_scatter_add_rows(dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src, const dsk_tensor *idx) {
    int cuda = 0;
    DSK__TRY(dsk__rows_check("dsk_scatter_add_rows", ctx, "dst", dst, "src", src, idx, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_scatter_add_rows(ctx, dst, src, idx));
    DSK__TRY(dsk__need_indices("dsk_scatter_add_rows", "idx", idx, dst->shape[0], 0, 0));
    dsk__scatter_add_cpu(ctx, dst, src, (const int32_t *)idx->data, idx->shape[0], dst->shape[1]);
    return DSK_OK;
}

/* ---------------------------------------------------------------- loss */

DSK_API dsk_status dsk_cross_entropy(dsk_ctx *ctx, dsk_tensor *loss, dsk_tensor *dlogits, const dsk_tensor *logits, const dsk_tensor *targets,
                                     int32_t ignore_index, float grad_scale) {
    const char *fn = "dsk_cross_entropy";
    int cuda = 0;
    int64_t R, V, count = 0;
    float *scratch;
    dsk_status s;
    dsk__rowk rk = dsk__rowk_ctx(ctx);
    const int32_t *tg;
    double *row_loss, total = 0.0;
    const dsk_tensor *ts[4] = {logits, targets, loss, dlogits};
    const char *names[4] = {"logits", "targets", "loss", "dlogits"};
    DSK__TRY(dsk__need_float(fn, "logits", logits));
    DSK__TRY(dsk__need_rows(fn, "logits", logits));
    DSK__TRY(dsk__need_dtype(fn, "targets", targets, DSK_I32));
    DSK__TRY(dsk__need_lead_shape(fn, "targets", targets, "logits", logits));
    DSK__TRY(dsk__need_scalar(fn, "loss", loss));
    if (dlogits) {
        DSK__TRY(dsk__need_float(fn, "dlogits", dlogits));
        DSK__TRY(dsk__need_like(fn, "dlogits", dlogits, "logits", logits));
    }
    DSK__TRY(dsk__need_devices(fn, ctx, 4, ts, names, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_cross_entropy(ctx, loss, dlogits, logits, targets, ignore_index, grad_scale));
    dsk__rows_cols(logits, &R, &V);
    DSK__TRY(dsk__need_indices(fn, "targets", targets, V, 1, ignore_index));
    tg = (const int32_t *)targets->data;
    for (int64_t r = 0; r < R; r++) count += tg[r] != ignore_index;
    row_loss = (double *)DSK_MALLOC((size_t)(R ? R : 1) * sizeof(double));
    if (!row_loss) return dsk_set_error(DSK_ERR_OOM, "dsk_cross_entropy: out of host memory for %lld row losses", (long long)R);
    if (!(scratch = dsk__scratch(fn, ctx, 3 * V, &s))) { DSK_FREE(row_loss); return s; }
    /* Rows in f32 through the row primitives (as the CUDA kernel, in f32): e = e^(x - max) by
       dsk_exp_f, lse = max + log(sum e) (the row's loss in f64 from there), dlogits =
       (grad_scale / count) (e / sum - onehot). */
    DSK__OMP(parallel for schedule(static) num_threads(dsk__threads(ctx)) if (R * V > DSK__PAR_MIN))
    for (int64_t r = 0; r < R; r++) {
        float *buf = scratch + 3 * V * dsk__thread_id(), *e = buf + V, *d, mx, sum, coef;
        const float *xr;
        row_loss[r] = 0.0;
        if (tg[r] == ignore_index) {
            if (dlogits) {
                d = dsk__row_out(dlogits, r * V, buf);
                memset(d, 0, (size_t)V * sizeof(float));
                dsk__row_out_done(dlogits, r * V, V, d);
            }
            continue;
        }
        xr = dsk__row_in(logits, r * V, V, buf);
        mx = rk.max(xr, V);
        sum = rk.exp_sum(e, xr, V, mx);
        row_loss[r] = (double)mx + log((double)sum) - (double)xr[tg[r]];
        if (dlogits) { /* xr is read for the last time above: d may overwrite it */
            coef = (float)((double)grad_scale / (double)count);
            d = dsk__row_out(dlogits, r * V, buf + 2 * V);
            rk.scale(d, e, coef / sum, V);
            d[tg[r]] -= coef;
            dsk__row_out_done(dlogits, r * V, V, d);
        }
    }
    DSK_FREE(scratch);
    for (int64_t r = 0; r < R; r++) total += row_loss[r];
    *(float *)loss->data = count ? (float)(total / (double)count) : 0.0f;
    DSK_FREE(row_loss);
    return DSK_OK;
}

/* ---------------------------------------------------------------- top-k */

/* 1 if (a, ia) ranks above (b, ib): larger value first, NaN last, ties to the lower index. */
static int dsk__ranks_above(float a, int64_t ia, float b, int64_t ib) {
    if (a != a) return b != b && ia < ib;
    if (b != b) return 1;
    if (a != b) return a > b;
    return ia < ib;
}

DSK_API dsk_status dsk_topk(dsk_ctx *ctx, dsk_tensor *values, dsk_tensor *indices, const dsk_tensor *x, int k) {
    const char *fn = "dsk_topk";
    char a[96], b[96];
    int cuda = 0;
    int64_t R, C;
    const dsk_tensor *ts[3] = {x, values, indices};
    const char *names[3] = {"x", "values", "indices"};
    DSK__TRY(dsk__need_dtype(fn, "x", x, DSK_F32));
    DSK__TRY(dsk__need_ndim(fn, "x", x, 2));
    DSK__TRY(dsk__need_dtype(fn, "values", values, DSK_F32));
    DSK__TRY(dsk__need_dtype(fn, "indices", indices, DSK_I32));
    R = x->shape[0];
    C = x->shape[1];
    if (k < 1 || k > C) return dsk_set_error(DSK_ERR_ARG, "dsk_topk: k = %d outside [1, %lld] for x %s", k, (long long)C, dsk_tensor_describe(x, a, sizeof a));
    if (values->ndim != 2 || values->shape[0] != R || values->shape[1] != k)
        return dsk_set_error(DSK_ERR_ARG, "dsk_topk: values %s must be (%lld, %d)", dsk_tensor_describe(values, a, sizeof a), (long long)R, k);
    if (!dsk_tensor_same_shape(indices, values))
        return dsk_set_error(DSK_ERR_ARG, "dsk_topk: indices %s must be (%lld, %d)", dsk_tensor_describe(indices, b, sizeof b), (long long)R, k);
    DSK__TRY(dsk__need_devices(fn, ctx, 3, ts, names, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_topk(ctx, values, indices, x, k));
    DSK__OMP(parallel for schedule(static) num_threads(dsk__threads(ctx)) if (R * C * k > DSK__PAR_MIN))
    for (int64_t r = 0; r < R; r++) {
        const float *xr = (const float *)x->data + r * C;
        float *vr = (float *)values->data + r * k;
        int32_t *ir = (int32_t *)indices->data + r * k;
        int64_t cnt = 0;
        /* insertion into the sorted list of the best k so far */
        for (int64_t j = 0; j < C; j++) {
            int64_t pos;
            if (cnt == k && !dsk__ranks_above(xr[j], j, vr[k - 1], ir[k - 1])) continue;
            pos = cnt < k ? cnt++ : k - 1;
            while (pos > 0 && dsk__ranks_above(xr[j], j, vr[pos - 1], ir[pos - 1])) {
                vr[pos] = vr[pos - 1];
                ir[pos] = ir[pos - 1];
                pos--;
            }
            vr[pos] = xr[j];
            ir[pos] = (int32_t)j;
        }
    }
    return DSK_OK;
}

/* ---------------------------------------------------------------- rope, attention */

static dsk_status dsk__rope_check(const char *fn, dsk_ctx *ctx, const char *yn, const dsk_tensor *y, const char *xn, const dsk_tensor *x,
                                  float theta, int *cuda) {
    char b[96];
    const dsk_tensor *ts[2] = {y, x};
    const char *names[2] = {yn, xn};
    DSK__TRY(dsk__need_float(fn, xn, x));
    DSK__TRY(dsk__need_ndim(fn, xn, x, 4));
    DSK__TRY(dsk__need_float(fn, yn, y));
    DSK__TRY(dsk__need_like(fn, yn, y, xn, x));
    if (x->shape[3] % 2)
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %s: head dim %lld must be even", fn, xn, dsk_tensor_describe(x, b, sizeof b), (long long)x->shape[3]);
    if (!(theta > 0.0f) || isinf(theta)) return dsk_set_error(DSK_ERR_ARG, "%s: theta %g must be finite and > 0", fn, (double)theta);
    return dsk__need_devices(fn, ctx, 2, ts, names, cuda);
}

/* y (B,T,H,Dh) = rotate(x) by sign * angle; accumulate adds into y instead of writing. The
   cosines and sines of the T x Dh/2 angles are computed once per call. */
static dsk_status dsk__rope_cpu(const char *fn, dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x, int64_t pos0, float theta, float sign,
                                int accumulate) {
    int64_t B = x->shape[0], T = x->shape[1], H = x->shape[2], Dh = x->shape[3], W = H * Dh, per = x->dtype == DSK_F32 ? 0 : 2 * W;
    dsk_status s;
    dsk__rowk rk = dsk__rowk_ctx(ctx);
    float *tab = (float *)DSK_MALLOC((size_t)(T * W + Dh / 2) * sizeof(float) + 1), *inv, *scratch;
    if (!tab) return dsk_set_error(DSK_ERR_OOM, "%s: out of host memory for %lld angles", fn, (long long)(T * W / 2));
    if (!(scratch = dsk__scratch(fn, ctx, per, &s))) { DSK_FREE(tab); return s; }
    /* dsk_rope_angle's cosines and sines per position, the frequency taken once per pair index, the
       row repeated for every head: a position's H heads rotate as one row (one call, not H short ones) */
    inv = tab + T * W;
    for (int64_t i = 0; i < Dh / 2; i++) inv[i] = dsk_rope_freq(i, Dh, theta);
    for (int64_t t = 0; t < T; t++) {
        float *cs = tab + t * W;
        for (int64_t i = 0; i < Dh / 2; i++) {
            float ang = (float)(pos0 + t) * inv[i];
            cs[2 * i] = cosf(ang);
            cs[2 * i + 1] = sign * sinf(ang);
        }
        for (int64_t h = 1; h < H; h++) memcpy(cs + h * Dh, cs, (size_t)Dh * sizeof(float));
    }
    DSK__OMP(parallel for schedule(static) num_threads(dsk__threads(ctx)) if (B * T * W > DSK__PAR_MIN))
    for (int64_t bt = 0; bt < B * T; bt++) {
        float *buf = scratch + per * dsk__thread_id();
        const float *xr = dsk__row_in(x, bt * W, W, buf);
        float *yr = accumulate ? dsk__row_acc(y, bt * W, W, buf + per / 2) : dsk__row_out(y, bt * W, buf + per / 2);
        rk.rope(yr, xr, tab + (bt % T) * W, W, accumulate);
        dsk__row_out_done(y, bt * W, W, yr);
    }
    DSK_FREE(scratch);
    DSK_FREE(tab);
    return DSK_OK;
}

DSK_API dsk_status dsk_rope(dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x, int64_t pos0, float theta) {
    int cuda = 0;
    DSK__TRY(dsk__rope_check("dsk_rope", ctx, "y", y, "x", x, theta, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_rope(ctx, y, x, pos0, theta));
    return dsk__rope_cpu("dsk_rope", ctx, y, x, pos0, theta, 1.0f, 0);
}

DSK_API dsk_status dsk_rope_backward(dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *dy, int64_t pos0, float theta,
                                     dsk_grad_store store) {
    int cuda = 0;
    DSK__TRY(dsk__rope_check("dsk_rope_backward", ctx, "dx", dx, "dy", dy, theta, &cuda));
    DSK__TRY(dsk__need_store("dsk_rope_backward", store));
    DSK__CUDA_PATH(cuda, dsk_cuda_rope_backward(ctx, dx, dy, pos0, theta, store == DSK_GRAD_ADD));
    return dsk__rope_cpu("dsk_rope_backward", ctx, dx, dy, pos0, theta, -1.0f, store == DSK_GRAD_ADD);
}

/* q, k, v (and `o`) (B, T, H, Dh) alike; probs (B, H, T, T) f32. */
static dsk_status dsk__attention_check(const char *fn, const dsk_tensor *o, const char *on, const dsk_tensor *probs, const dsk_tensor *q,
                                       const dsk_tensor *k, const dsk_tensor *v, float scale) {
    char a[96];
    DSK__TRY(dsk__need_float(fn, "q", q));
    DSK__TRY(dsk__need_ndim(fn, "q", q, 4));
    DSK__TRY(dsk__need_float(fn, "k", k));
    DSK__TRY(dsk__need_like(fn, "k", k, "q", q));
    DSK__TRY(dsk__need_float(fn, "v", v));
    DSK__TRY(dsk__need_like(fn, "v", v, "q", q));
    DSK__TRY(dsk__need_float(fn, on, o));
    DSK__TRY(dsk__need_like(fn, on, o, "q", q));
    DSK__TRY(dsk__need_dtype(fn, "probs", probs, DSK_F32));
    if (probs->ndim != 4 || probs->shape[0] != q->shape[0] || probs->shape[1] != q->shape[2] || probs->shape[2] != q->shape[1] ||
        probs->shape[3] != q->shape[1])
        return dsk_set_error(DSK_ERR_ARG, "%s: probs %s must be (%lld, %lld, %lld, %lld) (B, H, T, T)", fn, dsk_tensor_describe(probs, a, sizeof a),
                             (long long)q->shape[0], (long long)q->shape[2], (long long)q->shape[1], (long long)q->shape[1]);
    if (!isfinite(scale)) return dsk_set_error(DSK_ERR_ARG, "%s: scale %g is not finite", fn, (double)scale);
    return DSK_OK;
}

/* The (b, h) slice of a (B, T, H, Dh) tensor as a T x Dh f32 matrix: the tensor itself (row
   stride H * Dh) when it is f32, else converted into `buf` (row stride Dh). */
static const float *dsk__attn_in(const dsk_tensor *t, int64_t b, int64_t h, float *buf, int64_t *ld) {
    int64_t T = t->shape[1], H = t->shape[2], Dh = t->shape[3], base = (b * T * H + h) * Dh;
    if (t->dtype == DSK_F32) { *ld = H * Dh; return (const float *)t->data + base; }
    for (int64_t i = 0; i < T; i++) dsk_load_f32_n(buf + i * Dh, t->data, t->dtype, base + i * H * Dh, Dh);
    *ld = Dh;
    return buf;
}

/* dst (Dh x T) = src (T x Dh, row stride ld) transposed, so products with it read rows in place. */
static void dsk__attn_transpose(const dsk__ukernel *uk, float *dst, const float *src, int64_t ld, int64_t T, int64_t Dh) {
    if (dsk__pack_vec(uk->isa) && T % 8 == 0) { /* the GEMM packing's register transposes */
        dsk__pack_t_f32(dst, src, ld, Dh, T);
        return;
    }
    for (int64_t t = 0; t < T; t++)
        for (int64_t d = 0; d < Dh; d++) dst[d * T + t] = src[t * ld + d];
}

/* C (M x N, ldc) = alpha A B + beta C on one thread; A (M x K) at a with strides (a_rs, a_cs), B
   (K x N) rows of stride ldb: the direct GEMM nest (ws: DSK__DIRECT_KC * MR floats). */
static void dsk__attn_gemm(const dsk__ukernel *uk, int64_t M, int64_t N, int64_t K, float alpha, const float *a, int64_t a_rs,
                           int64_t a_cs, const float *b, int64_t ldb, float beta, float *c, int64_t ldc, float *ws) {
    dsk__gemm_args g;
    g.M = M; g.N = N; g.K = K; g.alpha = alpha; g.beta = beta;
    g.A = a; g.a_dt = DSK_F32; g.a_rs = a_rs; g.a_cs = a_cs;
    g.B = b; g.b_dt = DSK_F32; g.b_rs = ldb; g.b_cs = 1;
    g.b_pack = 0; /* ws holds DSK__DIRECT_KC * MR floats */
    g.C = c; g.ldc = ldc;
    dsk__gemm_serial(&g, uk, ws);
}

/* Floats of GEMM scratch the attention products need. */
static int64_t dsk__attn_ws(const dsk__ukernel *uk, int64_t T) {
    int64_t direct = (int64_t)DSK__DIRECT_KC * uk->mr;
    int64_t packed = (int64_t)DSK__KC * (DSK__MC + dsk__round_up(dsk__min64(T, DSK__NC), uk->nr));
    return T > DSK__DIRECT_N && packed > direct ? packed : direct;
}

DSK_API dsk_status dsk_attention(dsk_ctx *ctx, dsk_tensor *out, dsk_tensor *probs, const dsk_tensor *q, const dsk_tensor *k, const dsk_tensor *v,
                                 float scale) {
    const char *fn = "dsk_attention";
    int cuda, half;
    int64_t B, T, H, Dh, per, RB;
    float *scratch;
    dsk_status s;
    dsk__ukernel uk = dsk__ukernel_for(ctx ? ctx->cpu_isa : DSK_CPU_ISA_AUTO);
    dsk__rowk rk = dsk__rowk_ctx(ctx);
    const dsk_tensor *ts[5] = {q, k, v, out, probs};
    const char *names[5] = {"q", "k", "v", "out", "probs"};
    DSK__TRY(dsk__attention_check(fn, out, "out", probs, q, k, v, scale));
    DSK__TRY(dsk__need_devices(fn, ctx, 5, ts, names, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_attention(ctx, out, probs, q, k, v, scale));
    B = q->shape[0]; T = q->shape[1]; H = q->shape[2]; Dh = q->shape[3];
    half = q->dtype != DSK_F32;
    RB = 2 * uk.mr; /* query rows per block: the causal products stop at the block's last row */
    per = Dh * T + dsk__attn_ws(&uk, T) + (half ? 4 * T * Dh : 0); /* K^T, GEMM scratch; bf16/f16: f32 q, k, v, out */
    if (!(scratch = dsk__scratch(fn, ctx, per, &s))) return s;
    /* One (b, h) per thread with its own scratch and one-thread GEMMs: the same bits for any
       thread count. Per block of query rows [i0, i1): S = scale Q K^T for the columns j < i1
       straight into probs, a softmax over j <= i in place (the masked entries are never
       exponentiated, and written as 0), then out = P V over those columns. */
    DSK__OMP(parallel for schedule(static) num_threads(dsk__threads(ctx)) if (B * H * T * T * Dh > DSK__PAR_MIN))
    for (int64_t bh = 0; bh < B * H; bh++) {
        int64_t b = bh / H, h = bh % H, ldq, ldk, ldv, ldo = H * Dh, base = (b * T * H + h) * Dh;
        float *Kt = scratch + per * dsk__thread_id(), *ws = Kt + Dh * T, *sc = ws + dsk__attn_ws(&uk, T);
        const float *Q = dsk__attn_in(q, b, h, sc, &ldq), *K = dsk__attn_in(k, b, h, sc + T * Dh, &ldk);
        const float *V = dsk__attn_in(v, b, h, sc + 2 * T * Dh, &ldv);
        float *P = (float *)probs->data + bh * T * T, *O = half ? sc + 3 * T * Dh : (float *)out->data + base;
        if (half) ldo = Dh;
        dsk__attn_transpose(&uk, Kt, K, ldk, T, Dh);
        for (int64_t i0 = 0; i0 < T; i0 += RB) {
            int64_t i1 = i0 + RB < T ? i0 + RB : T;
            dsk__attn_gemm(&uk, i1 - i0, i1, Dh, scale, Q + i0 * ldq, ldq, 1, Kt, T, 0.0f, P + i0 * T, T, ws);
            for (int64_t i = i0; i < i1; i++) {
                float *row = P + i * T, mx = rk.max(row, i + 1);
                rk.scale(row, row, 1.0f / rk.exp_sum(row, row, i + 1, mx), i + 1);
                memset(row + i + 1, 0, (size_t)(T - i - 1) * sizeof(float));
            }
            dsk__attn_gemm(&uk, i1 - i0, Dh, i1, 1.0f, P + i0 * T, T, 1, V, ldv, 0.0f, O + i0 * ldo, ldo, ws);
        }
        if (half)
            for (int64_t i = 0; i < T; i++) dsk_store_f32_n(out->data, out->dtype, base + i * H * Dh, O + i * Dh, Dh);
    }
    DSK_FREE(scratch);
    return DSK_OK;
}

DSK_API dsk_status dsk_attention_backward(dsk_ctx *ctx, dsk_tensor *dq, dsk_tensor *dk, dsk_tensor *dv,
                                          const dsk_tensor *dout, const dsk_tensor *q, const dsk_tensor *k,
                                          const dsk_tensor *v, const dsk_tensor *probs, float scale,
                                          dsk_grad_store store) {
    const char *fn = "dsk_attention_backward";
    int cuda, half;
    int64_t B, T, H, Dh, per, RB;
    float *scratch;
    dsk_status s;
    dsk__ukernel uk = dsk__ukernel_for(ctx ? ctx->cpu_isa : DSK_CPU_ISA_AUTO);
    dsk__rowk rk = dsk__rowk_ctx(ctx);
    const dsk_tensor *ts[8] = {q, k, v, dout, probs, dq, dk, dv};
    const char *names[8] = {"q", "k", "v", "dout", "probs", "dq", "dk", "dv"};
    DSK__TRY(dsk__attention_check(fn, dout, "dout", probs, q, k, v, scale));
    DSK__TRY(dsk__need_float(fn, "dq", dq));
    DSK__TRY(dsk__need_like(fn, "dq", dq, "q", q));
    DSK__TRY(dsk__need_float(fn, "dk", dk));
    DSK__TRY(dsk__need_like(fn, "dk", dk, "q", q));
    DSK__TRY(dsk__need_float(fn, "dv", dv));
    DSK__TRY(dsk__need_like(fn, "dv", dv, "q", q));
    DSK__TRY(dsk__need_store(fn, store));
    DSK__TRY(dsk__need_devices(fn, ctx, 8, ts, names, &cuda));
    DSK__CUDA_PATH(cuda,
                   dsk_cuda_attention_backward(ctx, dq, dk, dv, dout, q, k, v, probs, scale, store == DSK_GRAD_ADD));
    B = q->shape[0]; T = q->shape[1]; H = q->shape[2]; Dh = q->shape[3];
    half = q->dtype != DSK_F32;
    RB = 2 * uk.mr;
    /* dS (T x T), V^T, GEMM scratch; bf16/f16 add f32 copies of q, k, v, dout and the gradients gq, gk, gv */
    per = T * T + Dh * T + dsk__attn_ws(&uk, T) + (half ? 7 * T * Dh : 0);
    if (!(scratch = dsk__scratch(fn, ctx, per, &s))) return s;
    /* Each (b, h) owns its slices of dq, dk, dv. f32: the GEMMs add into them (beta 1) or write
       them (beta 0); bf16/f16: the gradient is formed in f32 and added or stored once, rounding
       once. Causal structure: row i of dP, dS and dQ needs columns j <= i; row j of dK and dV
       needs rows i >= j of dS, P. */
    DSK__OMP(parallel for schedule(static) num_threads(dsk__threads(ctx)) if (B * H * T * T * Dh > DSK__PAR_MIN))
    for (int64_t bh = 0; bh < B * H; bh++) {
        int64_t b = bh / H, h = bh % H, ldq, ldk, ldv, ldo, ldg = half ? Dh : H * Dh, base = (b * T * H + h) * Dh;
        float *dS = scratch + per * dsk__thread_id(), *Vt = dS + T * T, *ws = Vt + Dh * T, *sc = ws + dsk__attn_ws(&uk, T);
        int add = store == DSK_GRAD_ADD;
        float beta = half || !add ? 0.0f : 1.0f;
        const float *P = (const float *)probs->data + bh * T * T;
        const float *Q = dsk__attn_in(q, b, h, sc, &ldq), *K = dsk__attn_in(k, b, h, sc + T * Dh, &ldk);
        const float *V = dsk__attn_in(v, b, h, sc + 2 * T * Dh, &ldv), *dO = dsk__attn_in(dout, b, h, sc + 3 * T * Dh, &ldo);
        float *gq = half ? sc + 4 * T * Dh : (float *)dq->data + base, *gk = half ? sc + 5 * T * Dh : (float *)dk->data + base;
        float *gv = half ? sc + 6 * T * Dh : (float *)dv->data + base;
        dsk__attn_transpose(&uk, Vt, V, ldv, T, Dh);
        for (int64_t i0 = 0; i0 < T; i0 += RB) {
            int64_t i1 = i0 + RB < T ? i0 + RB : T;
            dsk__attn_gemm(&uk, i1 - i0, i1, Dh, 1.0f, dO + i0 * ldo, ldo, 1, Vt, T, 0.0f, dS + i0 * T, T, ws); /* dP = dO V^T */
            for (int64_t i = i0; i < i1; i++) { /* dS = P (dP - rowsum(P dP)) */
                float *drow = dS + i * T;
                const float *prow = P + i * T;
                rk.sub_mul(drow, prow, drow, rk.dot(prow, drow, i + 1), i + 1, 0);
                memset(drow + i + 1, 0, (size_t)(T - i - 1) * sizeof(float));
            }
            dsk__attn_gemm(&uk, i1 - i0, Dh, i1, scale, dS + i0 * T, T, 1, K, ldk, beta, gq + i0 * ldg, ldg, ws); /* dQ += scale dS K */
        }
        for (int64_t j0 = 0; j0 < T; j0 += RB) {
            int64_t j1 = j0 + RB < T ? j0 + RB : T;
            /* dK += scale dS^T Q, dV += P^T dO over rows i >= j0 */
            dsk__attn_gemm(&uk, j1 - j0, Dh, T - j0, scale, dS + j0 * T + j0, 1, T, Q + j0 * ldq, ldq, beta, gk + j0 * ldg, ldg, ws);
            dsk__attn_gemm(&uk, j1 - j0, Dh, T - j0, 1.0f, P + j0 * T + j0, 1, T, dO + j0 * ldo, ldo, beta, gv + j0 * ldg, ldg, ws);
        }
        if (half)
            for (int64_t t = 0; t < T; t++)
                for (int64_t d = 0; d < Dh; d++) {
                    int64_t o = base + t * H * Dh + d;
                    dsk_store_f32(dq->data, dq->dtype, o,
                                  add ? dsk_load_f32(dq->data, dq->dtype, o) + gq[t * Dh + d] : gq[t * Dh + d]);
                    dsk_store_f32(dk->data, dk->dtype, o,
                                  add ? dsk_load_f32(dk->data, dk->dtype, o) + gk[t * Dh + d] : gk[t * Dh + d]);
                    dsk_store_f32(dv->data, dv->dtype, o,
                                  add ? dsk_load_f32(dv->data, dv->dtype, o) + gv[t * Dh + d] : gv[t * Dh + d]);
                }
    }
    DSK_FREE(scratch);
    return DSK_OK;
}

/* ---------------------------------------------------------------- grouped rows */

/* offsets (G + 1) i32, contiguous; *G = its length - 1 >= 0. */
static dsk_status dsk__need_offsets(const char *fn, const dsk_tensor *offsets, int64_t *G) {
    char b[96];
    DSK__TRY(dsk__need_dtype(fn, "offsets", offsets, DSK_I32));
    if (offsets->ndim != 1 || offsets->shape[0] < 1)
        return dsk_set_error(DSK_ERR_ARG, "%s: offsets %s must be (G + 1) with G >= 0", fn,
                             dsk_tensor_describe(offsets, b, sizeof b));
    *G = offsets->shape[0] - 1;
    return DSK_OK;
}

/* CPU: offsets non-decreasing within [0, R]. */
static dsk_status dsk__check_offsets(const char *fn, const dsk_tensor *offsets, int64_t G, int64_t R) {
    const int32_t *o = (const int32_t *)offsets->data;
    if (o[0] < 0 || o[G] > R)
        return dsk_set_error(DSK_ERR_ARG, "%s: offsets run from %d to %d, outside the %lld rows", fn, (int)o[0],
                             (int)o[G], (long long)R);
    for (int64_t g = 0; g < G; g++)
        if (o[g + 1] < o[g])
            return dsk_set_error(DSK_ERR_ARG, "%s: offsets[%lld] = %d > offsets[%lld] = %d (must not decrease)", fn,
                                 (long long)g, (int)o[g], (long long)(g + 1), (int)o[g + 1]);
    return DSK_OK;
}

/* The order in which the CPU's threads take the segments of (checked) offsets: the most rows
   first, ties in index order. Each segment's products run on one thread, so with the largest
   last (routing is often that uneven: a third of the rows on one expert of eight) one thread
   would finish it alone; largest first, the last to start is a short one. *order: G indices
   from DSK_MALLOC, NULL when G < 2 (nothing to order). Sorted as keys (INT32_MAX - rows) << 32 | g
   (rows and g fit in 31 bits: offsets are int32), decoded in place. */
static int dsk__i64_cmp(const void *pa, const void *pb) {
    int64_t a = *(const int64_t *)pa, b = *(const int64_t *)pb;
    return a < b ? -1 : a > b;
}
static dsk_status dsk__segments_largest_first(const char *fn, const int32_t *off, int64_t G, int64_t **order) {
    int64_t *o;
    *order = NULL;
    if (G < 2 || G > INT32_MAX) return DSK_OK;
    o = (int64_t *)DSK_MALLOC((size_t)G * sizeof *o);
    if (!o)
        return dsk_set_error(DSK_ERR_OOM, "%s: out of host memory for the order of %lld segments", fn, (long long)G);
    for (int64_t g = 0; g < G; g++) o[g] = ((int64_t)(INT32_MAX - (off[g + 1] - off[g])) << 32) | g;
    qsort(o, (size_t)G, sizeof *o, dsk__i64_cmp);
    for (int64_t i = 0; i < G; i++) o[i] &= 0xffffffff;
    *order = o;
    return DSK_OK;
}

DSK_API dsk_status dsk_group_by_key(dsk_ctx *ctx, dsk_tensor *perm, dsk_tensor *offsets, const dsk_tensor *keys) {
    const char *fn = "dsk_group_by_key";
    const dsk_tensor *ts[3] = {keys, perm, offsets};
    const char *names[3] = {"keys", "perm", "offsets"};
    int cuda = 0;
    int64_t G, N;
    int32_t *off, *pm;
    const int32_t *k;
    DSK__TRY(dsk__need_dtype(fn, "keys", keys, DSK_I32));
    DSK__TRY(dsk__need_ndim(fn, "keys", keys, 1));
    DSK__TRY(dsk__need_dtype(fn, "perm", perm, DSK_I32));
    DSK__TRY(dsk__need_like(fn, "perm", perm, "keys", keys));
    DSK__TRY(dsk__need_offsets(fn, offsets, &G));
    N = keys->shape[0];
    if (N > INT32_MAX || G > INT32_MAX)
        return dsk_set_error(DSK_ERR_ARG, "%s: %lld keys into %lld groups exceed i32 positions", fn, (long long)N,
                             (long long)G);
    DSK__TRY(dsk__need_devices(fn, ctx, 3, ts, names, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_group_by_key(ctx, perm, offsets, keys));
    off = (int32_t *)offsets->data;
    pm = (int32_t *)perm->data;
    k = (const int32_t *)keys->data;
    /* counts at off[g + 1], exclusive prefix sums, then each key's next slot at off[g + 1] */
    for (int64_t g = 0; g <= G; g++) off[g] = 0;
    for (int64_t i = 0; i < N; i++)
        if (k[i] >= 0 && k[i] < G) off[k[i] + 1]++;
    for (int64_t g = 0; g < G; g++) off[g + 1] += off[g];
    for (int64_t j = off[G]; j < N; j++) pm[j] = -1;
    for (int64_t g = G; g > 0; g--) off[g] = off[g - 1];
    for (int64_t i = 0; i < N; i++)
        if (k[i] >= 0 && k[i] < G) pm[off[k[i] + 1]++] = (int32_t)i;
    return DSK_OK; /* off[g + 1] ended at the end of group g: the offsets again */
}

/* The shapes of a grouped matmul: *weights 1 for the weights form; M, N, K of one product. */
static dsk_status dsk__matmul_grouped_check(const dsk_tensor *C, const dsk_tensor *A, int trans_a, const dsk_tensor *B,
                                            int trans_b, int64_t G, int *weights) {
    const char *fn = "dsk_matmul_grouped";
    char a[96], b[96], c[96];
    int ok;
    DSK__TRY(dsk__need_contig(fn, "C", C));
    DSK__TRY(dsk__need_contig(fn, "A", A));
    DSK__TRY(dsk__need_contig(fn, "B", B));
    if (!dsk__is_cfloat(A->dtype))
        return dsk_set_error(DSK_ERR_ARG, "%s: A %s: dtype must be f32, bf16 or f16", fn, dsk_tensor_describe(A, a, sizeof a));
    DSK__TRY(dsk__need_same_dtype(fn, "B", B, "A", A));
    if (C->dtype != DSK_F32 && C->dtype != A->dtype)
        return dsk_set_error(DSK_ERR_ARG, "%s: C %s: dtype must be f32 or A's dtype %s", fn,
                             dsk_tensor_describe(C, c, sizeof c), dsk_dtype_name(A->dtype));
    *weights = C->ndim == 3;
    if (*weights) /* C (G, M, N) = A (R, M)^T B (R, N) per segment */
        ok = trans_a && !trans_b && A->ndim == 2 && B->ndim == 2 && A->shape[0] == B->shape[0] &&
             C->shape[0] == G && C->shape[1] == A->shape[1] && C->shape[2] == B->shape[1];
    else /* C (R, N) = A (R, K) op(B[g]) */
        ok = !trans_a && C->ndim == 2 && A->ndim == 2 && B->ndim == 3 && B->shape[0] == G &&
             A->shape[0] == C->shape[0] && A->shape[1] == B->shape[trans_b ? 2 : 1] &&
             C->shape[1] == B->shape[trans_b ? 1 : 2];
    if (!ok)
        return dsk_set_error(DSK_ERR_ARG,
                             "%s: C %s, A %s%s, B %s%s with %lld groups fit neither form: rows C (R, N) = A (R, K) "
                             "op(B) (G, K, N), or weights C (G, M, N) = A (R, M)^T B (R, N) with trans_a",
                             fn, dsk_tensor_describe(C, c, sizeof c), dsk_tensor_describe(A, a, sizeof a),
                             trans_a ? " (transposed)" : "", dsk_tensor_describe(B, b, sizeof b),
                             trans_b ? " (transposed)" : "", (long long)G);
    return DSK_OK;
}

/* One product of a grouped matmul on the CPU, into the f32 matrix c (leading dim ldc). */
static dsk_status dsk__grouped_one(const dsk_tensor *A, int trans_a, const dsk_tensor *B, int trans_b, int weights,
                                   int64_t g, int64_t r0, int64_t r1, float alpha, float beta, float *c, int64_t ldc,
                                   const dsk__ukernel *uk, int n_threads) {
    dsk__gemm_args a;
    size_t ae = dsk_dtype_size(A->dtype), be = dsk_dtype_size(B->dtype);
    int64_t n = r1 - r0;
    a.alpha = alpha; a.beta = beta; a.a_dt = A->dtype; a.b_dt = B->dtype; a.C = c; a.ldc = ldc;
    a.b_pack = 1;
    if (weights) { /* (M, N) = A[r0:r1]^T (M x n) B[r0:r1] (n x N) */
        int64_t M = A->shape[1], N = B->shape[1];
        a.M = M; a.N = N; a.K = n;
        a.A = (const char *)A->data + (size_t)(r0 * M) * ae; a.a_rs = 1; a.a_cs = M;
        a.B = (const char *)B->data + (size_t)(r0 * N) * be; a.b_rs = N; a.b_cs = 1;
    } else { /* (n, N) = A[r0:r1] (n x K) op(B[g]) (K x N) */
        int64_t K = A->shape[1], N = B->shape[trans_b ? 1 : 2];
        a.M = n; a.N = N; a.K = K;
        a.A = (const char *)A->data + (size_t)(r0 * K) * ae; a.a_rs = K; a.a_cs = 1;
        a.B = (const char *)B->data + (size_t)(g * K * N) * be;
        a.b_rs = trans_b ? 1 : N; a.b_cs = trans_b ? K : 1;
    }
    (void)trans_a;
    return dsk__gemm(&a, uk, n_threads);
}

DSK_API dsk_status dsk_matmul_grouped(dsk_ctx *ctx, dsk_tensor *C, const dsk_tensor *A, int trans_a,
                                      const dsk_tensor *B, int trans_b, const dsk_tensor *offsets, float alpha,
                                      float beta) {
    const char *fn = "dsk_matmul_grouped";
    const dsk_tensor *ts[4] = {C, A, B, offsets};
    const char *names[4] = {"C", "A", "B", "offsets"};
    int cuda, weights = 0, failed = 0, nt;
    int64_t G, R, per, cols, first, last, *order;
    const int32_t *off;
    float *tmp = NULL;
    dsk__ukernel uk = dsk__ukernel_for(ctx ? ctx->cpu_isa : DSK_CPU_ISA_AUTO);
    DSK__TRY(dsk__need(fn, "C", C));
    DSK__TRY(dsk__need(fn, "A", A));
    DSK__TRY(dsk__need(fn, "B", B));
    DSK__TRY(dsk__need_offsets(fn, offsets, &G));
    DSK__TRY(dsk__matmul_grouped_check(C, A, trans_a, B, trans_b, G, &weights));
    DSK__TRY(dsk__need_devices(fn, ctx, 4, ts, names, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_matmul_grouped(ctx, C, A, trans_a, B, trans_b, offsets, alpha, beta));
    R = A->shape[0];
    DSK__TRY(dsk__check_offsets(fn, offsets, G, R));
    off = (const int32_t *)offsets->data;
    /* the f32 matrices written: C's rows [first, last) (rows form) or all of C (weights form) */
    cols = C->shape[C->ndim - 1];
    per = weights ? C->shape[1] * cols : 0;
    first = weights ? 0 : off[0];
    last = weights ? G * C->shape[1] : off[G];
    DSK__TRY(dsk__segments_largest_first(fn, off, G, &order));
    if (C->dtype != DSK_F32 && last > first) {
        tmp = (float *)DSK_MALLOC((size_t)((last - first) * cols) * sizeof(float));
        if (!tmp) {
            DSK_FREE(order);
            return dsk_set_error(DSK_ERR_OOM, "%s: out of host memory for an f32 copy of C (%lld elements)", fn,
                                 (long long)((last - first) * cols));
        }
        if (beta != 0.0f) dsk_load_f32_n(tmp, C->data, C->dtype, first * cols, (last - first) * cols);
    }
    /* many small products run side by side, one thread each; a single one uses them all */
    nt = G > 1 ? 1 : dsk__threads(ctx);
    DSK__OMP(parallel for schedule(dynamic, 1) num_threads(dsk__threads(ctx)) if (G > 1) reduction(|| : failed))
    for (int64_t i = 0; i < G; i++) {
        int64_t g = order ? order[i] : i;
        float *c = tmp ? tmp + (weights ? g * per : (off[g] - first) * cols)
                       : (float *)C->data + (weights ? g * per : off[g] * cols);
        if (!weights && off[g + 1] == off[g]) continue;
        failed = failed || dsk__grouped_one(A, trans_a, B, trans_b, weights, g, off[g], off[g + 1], alpha, beta, c,
                                            cols, &uk, nt) != DSK_OK;
    }
    DSK_FREE(order);
    if (tmp) {
        dsk_store_f32_n(C->data, C->dtype, first * cols, tmp, (last - first) * cols);
        DSK_FREE(tmp);
    }
    if (failed) return dsk_set_error(DSK_ERR_OOM, "%s: out of host memory for the GEMM packing buffers", fn);
    return DSK_OK;
}

/* One raw f32 GEMM on `nt` threads (dsk_sgemm_cpu's convention); 0 or the packing failure. */
static int dsk__sgemm_nt(int ta, int tb, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
                         int64_t ldb, float beta, float *C, int64_t ldc, const dsk__ukernel *uk, int nt) {
    dsk__gemm_args g;
    if (M == 0 || N == 0) return 0;
    g.M = M; g.N = N; g.K = K; g.alpha = 1.0f; g.beta = beta;
    g.A = A; g.a_dt = DSK_F32; g.a_rs = ta ? 1 : lda; g.a_cs = ta ? lda : 1;
    g.B = B; g.b_dt = DSK_F32; g.b_rs = tb ? 1 : ldb; g.b_cs = tb ? ldb : 1;
    g.C = C; g.ldc = ldc;
    g.b_pack = 1;
    return dsk__gemm(&g, uk, nt) != DSK_OK;
}

/* The shapes of a grouped SwiGLU MLP: x (R, D), w1, w3 (G, F, D), w2 (G, D, F); *F, *D. */
static dsk_status dsk__swiglu_grouped_check(const char *fn, const dsk_tensor *x, const dsk_tensor *w1,
                                            const dsk_tensor *w2, const dsk_tensor *w3, int64_t G, int64_t *F,
                                            int64_t *D) {
    char a[96], b[96], c[96], d[96];
    DSK__TRY(dsk__need_float(fn, "x", x));
    DSK__TRY(dsk__need_float(fn, "w1", w1));
    DSK__TRY(dsk__need_like(fn, "w3", w3, "w1", w1));
    DSK__TRY(dsk__need_same_dtype(fn, "w1", w1, "x", x));
    DSK__TRY(dsk__need_same_dtype(fn, "w2", w2, "x", x));
    DSK__TRY(dsk__need_contig(fn, "w2", w2));
    if (x->ndim != 2 || w1->ndim != 3 || w2->ndim != 3 || w1->shape[0] != G || w2->shape[0] != G ||
        w1->shape[2] != x->shape[1] || w2->shape[1] != x->shape[1] || w2->shape[2] != w1->shape[1])
        return dsk_set_error(DSK_ERR_ARG, "%s: x %s, w1 %s, w2 %s, w3 %s: want x (R, D), w1 and w3 (%lld, F, D), w2 "
                             "(%lld, D, F)", fn, dsk_tensor_describe(x, a, sizeof a), dsk_tensor_describe(w1, b, sizeof b),
                             dsk_tensor_describe(w2, c, sizeof c), dsk_tensor_describe(w3, d, sizeof d), (long long)G,
                             (long long)G);
    *F = w1->shape[1];
    *D = x->shape[1];
    return DSK_OK;
}

/* t is (rows, cols) like x's dtype or, for a weight gradient (grad), f32 too. */
static dsk_status dsk__need_mat(const char *fn, const char *what, const dsk_tensor *t, const dsk_tensor *x, int grad,
                                int ndim, const int64_t *shape) {
    char a[96];
    int ok = t && t->ndim == ndim;
    DSK__TRY(dsk__need_float(fn, what, t));
    for (int d = 0; ok && d < ndim; d++) ok = t->shape[d] == shape[d];
    if (!ok || !(t->dtype == x->dtype || (grad && t->dtype == DSK_F32)))
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %s: want (%lld, %lld%s%lld) %s%s", fn, what,
                             dsk_tensor_describe(t, a, sizeof a), (long long)shape[0], (long long)shape[1],
                             ndim == 3 ? ", " : ")", ndim == 3 ? (long long)shape[2] : 0LL, dsk_dtype_name(x->dtype),
                             grad ? " or f32" : "");
    return DSK_OK;
}

DSK_API dsk_status dsk_swiglu_grouped(dsk_ctx *ctx, dsk_tensor *out, dsk_tensor *h1, dsk_tensor *h3, dsk_tensor *a,
                                      const dsk_tensor *x, const dsk_tensor *w1, const dsk_tensor *w2,
                                      const dsk_tensor *w3, const dsk_tensor *offsets) {
    const char *fn = "dsk_swiglu_grouped";
    const dsk_tensor *ts[8] = {x, out, h1, h3, a, w1, w2, w3};
    const char *names[8] = {"x", "out", "h1", "h3", "a", "w1", "w2", "w3"};
    int64_t G, F, D, R, rf[2], rd[2], *order;
    int cuda, failed = 0, nt;
    const int32_t *off;
    dsk__ukernel uk = dsk__ukernel_for(ctx ? ctx->cpu_isa : DSK_CPU_ISA_AUTO);
    dsk__rowk rk = dsk__rowk_ctx(ctx);
    DSK__TRY(dsk__need_offsets(fn, offsets, &G));
    DSK__TRY(dsk__swiglu_grouped_check(fn, x, w1, w2, w3, G, &F, &D));
    R = x->shape[0];
    rf[0] = R; rf[1] = F; rd[0] = R; rd[1] = D;
    DSK__TRY(dsk__need_mat(fn, "out", out, x, 0, 2, rd));
    DSK__TRY(dsk__need_mat(fn, "h1", h1, x, 0, 2, rf));
    DSK__TRY(dsk__need_mat(fn, "h3", h3, x, 0, 2, rf));
    DSK__TRY(dsk__need_mat(fn, "a", a, x, 0, 2, rf));
    DSK__TRY(dsk__need_devices(fn, ctx, 8, ts, names, &cuda));
    if (cuda || x->dtype != DSK_F32) { /* three grouped GEMMs and the activation */
        DSK__TRY(dsk_matmul_grouped(ctx, h1, x, 0, w1, 1, offsets, 1.0f, 0.0f));
        DSK__TRY(dsk_matmul_grouped(ctx, h3, x, 0, w3, 1, offsets, 1.0f, 0.0f));
        DSK__TRY(dsk_swiglu(ctx, a, h1, h3));
        return dsk_matmul_grouped(ctx, out, a, 0, w2, 1, offsets, 1.0f, 0.0f);
    }
    DSK__TRY(dsk__check_offsets(fn, offsets, G, R));
    off = (const int32_t *)offsets->data;
    DSK__TRY(dsk__segments_largest_first(fn, off, G, &order));
    nt = G > 1 ? 1 : dsk__threads(ctx);
    /* each segment's MLP on one thread: many small GEMMs scale better side by side */
    DSK__OMP(parallel for schedule(dynamic, 1) num_threads(dsk__threads(ctx)) if (G > 1) reduction(|| : failed))
    for (int64_t i = 0; i < G; i++) {
        int64_t g = order ? order[i] : i, r0 = off[g], n = off[g + 1] - r0;
        const float *xs = (const float *)x->data + r0 * D;
        float *p1 = (float *)h1->data + r0 * F, *p3 = (float *)h3->data + r0 * F, *pa = (float *)a->data + r0 * F;
        if (n == 0) continue;
        failed = failed || dsk__sgemm_nt(0, 1, n, F, D, xs, D, (const float *)w1->data + g * F * D, D, 0.0f, p1, F, &uk, nt);
        failed = failed || dsk__sgemm_nt(0, 1, n, F, D, xs, D, (const float *)w3->data + g * F * D, D, 0.0f, p3, F, &uk, nt);
        rk.swiglu(pa, p1, p3, n * F);
        failed = failed || dsk__sgemm_nt(0, 1, n, D, F, pa, F, (const float *)w2->data + g * D * F, F, 0.0f,
                                         (float *)out->data + r0 * D, D, &uk, nt);
    }
    DSK_FREE(order);
    if (failed) return dsk_set_error(DSK_ERR_OOM, "%s: out of host memory for the GEMM packing buffers", fn);
    return DSK_OK;
}

DSK_API dsk_status dsk_swiglu_grouped_backward(dsk_ctx *ctx, dsk_tensor *dx, dsk_tensor *dw1, dsk_tensor *dw2,
                                               dsk_tensor *dw3, dsk_tensor *da, dsk_tensor *dh1, dsk_tensor *dh3,
                                               const dsk_tensor *dout, const dsk_tensor *x, const dsk_tensor *h1,
                                               const dsk_tensor *h3, const dsk_tensor *a, const dsk_tensor *w1,
                                               const dsk_tensor *w2, const dsk_tensor *w3, const dsk_tensor *offsets) {
    const char *fn = "dsk_swiglu_grouped_backward";
    const dsk_tensor *ts[15] = {x, dx, dw1, dw2, dw3, da, dh1, dh3, dout, h1, h3, a, w1, w2, w3};
    const char *names[15] = {"x", "dx", "dw1", "dw2", "dw3", "da", "dh1", "dh3", "dout", "h1", "h3", "a", "w1", "w2", "w3"};
    int64_t G, F, D, R, rf[2], rd[2], gfd[3], gdf[3], *order;
    int cuda, failed = 0, nt;
    const int32_t *off;
    dsk__ukernel uk = dsk__ukernel_for(ctx ? ctx->cpu_isa : DSK_CPU_ISA_AUTO);
    dsk__rowk rk = dsk__rowk_ctx(ctx);
    DSK__TRY(dsk__need_offsets(fn, offsets, &G));
    DSK__TRY(dsk__swiglu_grouped_check(fn, x, w1, w2, w3, G, &F, &D));
    R = x->shape[0];
    rf[0] = R; rf[1] = F; rd[0] = R; rd[1] = D;
    gfd[0] = G; gfd[1] = F; gfd[2] = D; gdf[0] = G; gdf[1] = D; gdf[2] = F;
    DSK__TRY(dsk__need_mat(fn, "dx", dx, x, 0, 2, rd));
    DSK__TRY(dsk__need_mat(fn, "dout", dout, x, 0, 2, rd));
    DSK__TRY(dsk__need_mat(fn, "h1", h1, x, 0, 2, rf));
    DSK__TRY(dsk__need_mat(fn, "h3", h3, x, 0, 2, rf));
    DSK__TRY(dsk__need_mat(fn, "a", a, x, 0, 2, rf));
    DSK__TRY(dsk__need_mat(fn, "da", da, x, 0, 2, rf));
    DSK__TRY(dsk__need_mat(fn, "dh1", dh1, x, 0, 2, rf));
    DSK__TRY(dsk__need_mat(fn, "dh3", dh3, x, 0, 2, rf));
    DSK__TRY(dsk__need_mat(fn, "dw1", dw1, x, 1, 3, gfd));
    DSK__TRY(dsk__need_mat(fn, "dw3", dw3, x, 1, 3, gfd));
    DSK__TRY(dsk__need_mat(fn, "dw2", dw2, x, 1, 3, gdf));
    DSK__TRY(dsk__need_devices(fn, ctx, 15, ts, names, &cuda));
    if (cuda || x->dtype != DSK_F32 || dw1->dtype != DSK_F32 || dw2->dtype != DSK_F32 || dw3->dtype != DSK_F32) {
        DSK__TRY(dsk_matmul_grouped(ctx, da, dout, 0, w2, 0, offsets, 1.0f, 0.0f));
        DSK__TRY(dsk_matmul_grouped(ctx, dw2, dout, 1, a, 0, offsets, 1.0f, 1.0f));
        DSK__TRY(dsk_swiglu_backward(ctx, dh1, dh3, da, h1, h3, DSK_GRAD_WRITE));
        DSK__TRY(dsk_matmul_grouped(ctx, dx, dh1, 0, w1, 0, offsets, 1.0f, 0.0f));
        DSK__TRY(dsk_matmul_grouped(ctx, dx, dh3, 0, w3, 0, offsets, 1.0f, 1.0f));
        DSK__TRY(dsk_matmul_grouped(ctx, dw1, dh1, 1, x, 0, offsets, 1.0f, 1.0f));
        return dsk_matmul_grouped(ctx, dw3, dh3, 1, x, 0, offsets, 1.0f, 1.0f);
    }
    DSK__TRY(dsk__check_offsets(fn, offsets, G, R));
    off = (const int32_t *)offsets->data;
    DSK__TRY(dsk__segments_largest_first(fn, off, G, &order));
    nt = G > 1 ? 1 : dsk__threads(ctx);
    DSK__OMP(parallel for schedule(dynamic, 1) num_threads(dsk__threads(ctx)) if (G > 1) reduction(|| : failed))
    for (int64_t i = 0; i < G; i++) {
        int64_t g = order ? order[i] : i, r0 = off[g], n = off[g + 1] - r0;
        const float *xs = (const float *)x->data + r0 * D, *dy = (const float *)dout->data + r0 * D;
        const float *p1 = (const float *)h1->data + r0 * F, *p3 = (const float *)h3->data + r0 * F;
        const float *w1g = (const float *)w1->data + g * F * D, *w3g = (const float *)w3->data + g * F * D;
        float *pda = (float *)da->data + r0 * F, *q1 = (float *)dh1->data + r0 * F, *q3 = (float *)dh3->data + r0 * F;
        float *dxs = (float *)dx->data + r0 * D;
        if (n == 0) continue;
        failed = failed || dsk__sgemm_nt(0, 0, n, F, D, dy, D, (const float *)w2->data + g * D * F, F, 0.0f, pda, F, &uk, nt);
        failed = failed || dsk__sgemm_nt(1, 0, D, F, n, dy, D, (const float *)a->data + r0 * F, F, 1.0f,
                                         (float *)dw2->data + g * D * F, F, &uk, nt);
        rk.swiglu_bwd(q1, q3, pda, p1, p3, n * F, 0);
        failed = failed || dsk__sgemm_nt(0, 0, n, D, F, q1, F, w1g, D, 0.0f, dxs, D, &uk, nt);
        failed = failed || dsk__sgemm_nt(0, 0, n, D, F, q3, F, w3g, D, 1.0f, dxs, D, &uk, nt);
        failed = failed || dsk__sgemm_nt(1, 0, F, D, n, q1, F, xs, D, 1.0f, (float *)dw1->data + g * F * D, D, &uk, nt);
        failed = failed || dsk__sgemm_nt(1, 0, F, D, n, q3, F, xs, D, 1.0f, (float *)dw3->data + g * F * D, D, &uk, nt);
    }
    DSK_FREE(order);
    if (failed) return dsk_set_error(DSK_ERR_OOM, "%s: out of host memory for the GEMM packing buffers", fn);
    return DSK_OK;
}

DSK_API dsk_status dsk_gather_rows_scaled(dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *src, const dsk_tensor *idx,
                                          const dsk_tensor *scale) {
    const char *fn = "dsk_gather_rows_scaled";
    char a[96], b[96];
    int cuda = 0;
    int64_t N, D, R;
    size_t row;
    const int32_t *ix;
    const dsk_tensor *ts[4] = {src, out, idx, scale};
    const char *names[4] = {"src", "out", "idx", "scale"};
    dsk__rowk rk;
    if (scale || !dsk__is_fp8(src->dtype)) { /* fp8 codes: plain copies only */
        DSK__TRY(dsk__need_float(fn, "src", src));
        DSK__TRY(dsk__need_float(fn, "out", out));
    } else {
        DSK__TRY(dsk__need_contig(fn, "src", src));
        DSK__TRY(dsk__need_contig(fn, "out", out));
    }
    DSK__TRY(dsk__need_ndim(fn, "src", src, 2));
    DSK__TRY(dsk__need_ndim(fn, "out", out, 2));
    DSK__TRY(dsk__need_same_dtype(fn, "out", out, "src", src));
    DSK__TRY(dsk__need_dtype(fn, "idx", idx, DSK_I32));
    DSK__TRY(dsk__need_ndim(fn, "idx", idx, 1));
    if (out->shape[0] != idx->shape[0] || out->shape[1] != src->shape[1])
        return dsk_set_error(DSK_ERR_ARG, "%s: out %s must be (%lld, %lld) for idx %s", fn,
                             dsk_tensor_describe(out, a, sizeof a), (long long)idx->shape[0], (long long)src->shape[1],
                             dsk_tensor_describe(idx, b, sizeof b));
    if (scale) {
        DSK__TRY(dsk__need_dtype(fn, "scale", scale, DSK_F32));
        DSK__TRY(dsk__need_same_shape(fn, "scale", scale, "idx", idx));
    }
    DSK__TRY(dsk__need_devices(fn, ctx, 4, ts, names, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_gather_rows_scaled(ctx, out, src, idx, scale));
    N = out->shape[0]; D = out->shape[1]; R = src->shape[0];
    ix = (const int32_t *)idx->data;
    for (int64_t i = 0; i < N; i++)
        if (ix[i] >= R)
            return dsk_set_error(DSK_ERR_ARG, "%s: idx[%lld] = %d outside [0, %lld) (negative: a zero row)", fn,
                                 (long long)i, (int)ix[i], (long long)R);
    row = (size_t)D * dsk_dtype_size(src->dtype);
    rk = dsk__rowk_ctx(ctx);
    DSK__OMP(parallel for schedule(static) num_threads(dsk__threads(ctx)) if (N * D > DSK__PAR_MIN))
    for (int64_t i = 0; i < N; i++) {
        char *o = (char *)out->data + (size_t)i * row;
        if (ix[i] < 0) {
            memset(o, 0, row);
        } else if (!scale) {
            memcpy(o, (const char *)src->data + (size_t)ix[i] * row, row);
        } else if (src->dtype == DSK_F32) { /* out has src's dtype */
            rk.scale((float *)o, (const float *)src->data + (int64_t)ix[i] * D, ((const float *)scale->data)[i], D);
        } else {
            float sc = ((const float *)scale->data)[i];
            for (int64_t d = 0; d < D; d++)
                dsk_store_f32(o, out->dtype, d, sc * dsk_load_f32(src->data, src->dtype, (int64_t)ix[i] * D + d));
        }
    }
    return DSK_OK;
}

/* ---------------------------------------------------------------- AdamW */

#if DSK__X86
/* dsk_adamw_update on 16 lanes, operation for operation (no contraction: the same bits). */
static DSK__TARGET_AVX512 void dsk__adamw_avx512(float *p, float *m, float *v, const float *g, int64_t n, float gm, const dsk_adamw_opts *o,
                                                 float bc1, float bc2) {
    __m512 b1 = _mm512_set1_ps(o->beta1), b2 = _mm512_set1_ps(o->beta2), c1 = _mm512_set1_ps(1.0f - o->beta1), c2 = _mm512_set1_ps(1.0f - o->beta2);
    __m512 lr = _mm512_set1_ps(o->lr), lrwd = _mm512_set1_ps(o->lr * o->weight_decay), eps = _mm512_set1_ps(o->eps);
    __m512 vbc1 = _mm512_set1_ps(bc1), vbc2 = _mm512_set1_ps(bc2), vgm = _mm512_set1_ps(gm);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = dsk__tail512(n - i);
        __m512 gi = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, g + i), vgm), pi = _mm512_maskz_loadu_ps(k, p + i);
        __m512 mn = _mm512_add_ps(_mm512_mul_ps(b1, _mm512_maskz_loadu_ps(k, m + i)), _mm512_mul_ps(c1, gi));
        __m512 vn = _mm512_add_ps(_mm512_mul_ps(b2, _mm512_maskz_loadu_ps(k, v + i)), _mm512_mul_ps(_mm512_mul_ps(c2, gi), gi));
        __m512 pn = _mm512_sub_ps(pi, _mm512_mul_ps(lrwd, pi));
        __m512 den = _mm512_add_ps(_mm512_sqrt_ps(_mm512_div_ps(vn, vbc2)), eps);
        pn = _mm512_sub_ps(pn, _mm512_div_ps(_mm512_mul_ps(lr, _mm512_div_ps(mn, vbc1)), den));
        _mm512_mask_storeu_ps(m + i, k, mn);
        _mm512_mask_storeu_ps(v + i, k, vn);
        _mm512_mask_storeu_ps(p + i, k, pn);
    }
}
/* The same on 8 lanes (AVX2 has no masked arithmetic: the tail's unloaded lanes are zeros, and only
   the loaded lanes are stored). */
static DSK__TARGET_AVX2 void dsk__adamw_avx2(float *p, float *m, float *v, const float *g, int64_t n, float gm,
                                             const dsk_adamw_opts *o, float bc1, float bc2) {
    __m256 b1 = _mm256_set1_ps(o->beta1), b2 = _mm256_set1_ps(o->beta2), c1 = _mm256_set1_ps(1.0f - o->beta1),
           c2 = _mm256_set1_ps(1.0f - o->beta2);
    __m256 lr = _mm256_set1_ps(o->lr), lrwd = _mm256_set1_ps(o->lr * o->weight_decay), eps = _mm256_set1_ps(o->eps);
    __m256 vbc1 = _mm256_set1_ps(bc1), vbc2 = _mm256_set1_ps(bc2), vgm = _mm256_set1_ps(gm);
    for (int64_t i = 0; i < n; i += 8) {
        __m256 gi = _mm256_mul_ps(dsk__load256(g + i, n - i), vgm), pi = dsk__load256(p + i, n - i);
        __m256 mn = _mm256_add_ps(_mm256_mul_ps(b1, dsk__load256(m + i, n - i)), _mm256_mul_ps(c1, gi));
        __m256 vn =
            _mm256_add_ps(_mm256_mul_ps(b2, dsk__load256(v + i, n - i)), _mm256_mul_ps(_mm256_mul_ps(c2, gi), gi));
        __m256 pn = _mm256_sub_ps(pi, _mm256_mul_ps(lrwd, pi));
        __m256 den = _mm256_add_ps(_mm256_sqrt_ps(_mm256_div_ps(vn, vbc2)), eps);
        pn = _mm256_sub_ps(pn, _mm256_div_ps(_mm256_mul_ps(lr, _mm256_div_ps(mn, vbc1)), den));
        dsk__store256(m + i, n - i, mn);
        dsk__store256(v + i, n - i, vn);
        dsk__store256(p + i, n - i, pn);
    }
}
#endif

/* AdamW on n f32 elements with gradient g times gm: vectorised where the ISA allows. */
static void dsk__adamw_rows(dsk_cpu_isa isa, float *p, float *m, float *v, const float *g, int64_t n, float gm, const dsk_adamw_opts *o,
                            float bc1, float bc2) {
#if DSK__X86
    if (!dsk_cpu_isa_supported(isa)) isa = dsk_cpu_isa_auto();
    if (isa == DSK_CPU_ISA_AVX512) { dsk__adamw_avx512(p, m, v, g, n, gm, o, bc1, bc2); return; }
    if (isa == DSK_CPU_ISA_AVX2) {
        dsk__adamw_avx2(p, m, v, g, n, gm, o, bc1, bc2);
        return;
    }
#else
    (void)isa;
#endif
    for (int64_t i = 0; i < n; i++) dsk_adamw_update(p + i, m + i, v + i, g[i] * gm, o->lr, o->beta1, o->beta2, o->eps, o->weight_decay, bc1, bc2);
}

/* AdamW's moments: m and v both f32 or both bf16. */
static dsk_status dsk__need_moments(const char *fn, const dsk_tensor *m, const dsk_tensor *v) {
    char a[96], b[96];
    DSK__TRY(dsk__need(fn, "m", m));
    DSK__TRY(dsk__need(fn, "v", v));
    if ((m->dtype != DSK_F32 && m->dtype != DSK_BF16) || v->dtype != m->dtype)
        return dsk_set_error(DSK_ERR_ARG, "%s: moments m %s and v %s must be both f32 or both bf16", fn,
                             dsk_tensor_describe(m, a, sizeof a), dsk_tensor_describe(v, b, sizeof b));
    return DSK_OK;
}

/* The options in force (opts, or the defaults for NULL), range-checked; nothing is replaced. */
static dsk_status dsk__adamw_resolve(const dsk_adamw_opts *in, dsk_adamw_opts *o) {
    const char *fn = "dsk_adamw_step";
    *o = in ? *in : dsk_adamw_defaults();
    if (!(o->lr >= 0.0f) || isinf(o->lr))
        return dsk_set_error(DSK_ERR_ARG, "%s: lr %g must be finite and >= 0", fn, (double)o->lr);
    if (!(o->beta1 >= 0.0f && o->beta1 < 1.0f))
        return dsk_set_error(DSK_ERR_ARG, "%s: beta1 %g outside [0, 1)", fn, (double)o->beta1);
    if (!(o->beta2 >= 0.0f && o->beta2 < 1.0f))
        return dsk_set_error(DSK_ERR_ARG, "%s: beta2 %g outside [0, 1)", fn, (double)o->beta2);
    if (!(o->eps > 0.0f) || isinf(o->eps))
        return dsk_set_error(DSK_ERR_ARG, "%s: eps %g must be finite and > 0 (options are taken literally: start from "
                             "dsk_adamw_defaults())", fn, (double)o->eps);
    if (!(o->weight_decay >= 0.0f) || isinf(o->weight_decay))
        return dsk_set_error(DSK_ERR_ARG, "%s: weight_decay %g must be finite and >= 0", fn, (double)o->weight_decay);
    return DSK_OK;
}

DSK_API dsk_status dsk_adamw_step(dsk_ctx *ctx, dsk_tensor *param, const dsk_tensor *grad, dsk_tensor *m, dsk_tensor *v, const dsk_adamw_opts *opts,
                                  int64_t step, float grad_mult, dsk_tensor *param_copy) {
    const char *fn = "dsk_adamw_step";
    dsk_adamw_opts o;
    int cuda = 0;
    int64_t n;
    float bc1, bc2, *p;
    const dsk_tensor *ts[5] = {param, grad, m, v, param_copy};
    const char *names[5] = {"param", "grad", "m", "v", "param_copy"};
    DSK__TRY(dsk__need_dtype(fn, "param", param, DSK_F32));
    DSK__TRY(dsk__need_float(fn, "grad", grad));
    DSK__TRY(dsk__need_same_shape(fn, "grad", grad, "param", param));
    DSK__TRY(dsk__need_moments(fn, m, v));
    DSK__TRY(dsk__need_same_shape(fn, "m", m, "param", param));
    DSK__TRY(dsk__need_same_shape(fn, "v", v, "param", param));
    if (param_copy) {
        DSK__TRY(dsk__need_float(fn, "param_copy", param_copy));
        DSK__TRY(dsk__need_same_shape(fn, "param_copy", param_copy, "param", param));
    }
    if (step < 1) return dsk_set_error(DSK_ERR_ARG, "dsk_adamw_step: step %lld must be >= 1", (long long)step);
    DSK__TRY(dsk__adamw_resolve(opts, &o));
    DSK__TRY(dsk__need_devices(fn, ctx, 5, ts, names, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_adamw_step(ctx, param, grad, m, v, &o, step, grad_mult, param_copy));
    bc1 = dsk_adamw_bias_correction(o.beta1, step);
    bc2 = dsk_adamw_bias_correction(o.beta2, step);
    n = dsk_tensor_numel(param);
    p = (float *)param->data;
    DSK__OMP(parallel for schedule(static) num_threads(dsk__threads(ctx)) if (n > DSK__PAR_MIN))
    for (int64_t c = 0; c < (n + DSK__EW_CHUNK - 1) / DSK__EW_CHUNK; c++) {
        float bg[DSK__EW_CHUNK], bm[DSK__EW_CHUNK], bv[DSK__EW_CHUNK];
        int64_t off = c * DSK__EW_CHUNK, len = n - off < DSK__EW_CHUNK ? n - off : DSK__EW_CHUNK;
        /* each thread's own chunk pointers (bf16 moments: f32 copies in bm, bv, stored back below) */
        float *mm = (float *)dsk__row_in(m, off, len, bm), *vv = (float *)dsk__row_in(v, off, len, bv);
        dsk__adamw_rows(ctx ? ctx->cpu_isa : DSK_CPU_ISA_AUTO, p + off, mm, vv, dsk__row_in(grad, off, len, bg), len,
                        grad_mult, &o, bc1, bc2);
        dsk__row_out_done(m, off, len, mm);
        dsk__row_out_done(v, off, len, vv);
        if (param_copy) dsk_store_f32_n(param_copy->data, param_copy->dtype, off, p + off, len);
    }
    return DSK_OK;
}


/* ---------------------------------------------------------------- fused attention (CPU) */

#define DSK__FA_BR 64 /* queries per tile */
#define DSK__FA_BC 64 /* keys per tile */

/* A 4-D attention tensor, unit stride in its last dim. */
static dsk_status dsk__fa_need4(const char *fn, const char *what, const dsk_tensor *t, const dsk_tensor *q) {
    char b[96];
    DSK__TRY(dsk__need(fn, what, t));
    DSK__TRY(dsk__need_ndim(fn, what, t, 4));
    if (!dsk__is_cfloat(t->dtype))
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %s: dtype must be f32, bf16 or f16", fn, what, dsk_tensor_describe(t, b, sizeof b));
    if (t->shape[3] > 1 && t->stride[3] != 1)
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %s needs unit stride in its last dim (has %lld)", fn, what,
                             dsk_tensor_describe(t, b, sizeof b), (long long)t->stride[3]);
    if (q && t != q) DSK__TRY(dsk__need_same_dtype(fn, what, t, "q", q));
    return DSK_OK;
}

/* t is (B, T, H, d) with B, T, H of q and d = dim (or any when dim < 0). */
static dsk_status dsk__fa_need_rows(const char *fn, const char *what, const dsk_tensor *t, const dsk_tensor *q, int64_t dim,
                                    const char *dim_name) {
    char a[96], b[96];
    if (t->shape[0] != q->shape[0] || t->shape[1] != q->shape[1] || t->shape[2] != q->shape[2] || (dim >= 0 && t->shape[3] != dim))
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %s must be (B, T, H, %s) with B, T, H of q %s%s", fn, what,
                             dsk_tensor_describe(t, a, sizeof a), dim_name, dsk_tensor_describe(q, b, sizeof b),
                             dim >= 0 ? " and the last dim of v" : "");
    return DSK_OK;
}

/* q, k, v, `o` (out or dout) and lse (may be NULL when lse_optional). */
static dsk_status dsk__fa_check(const char *fn, const dsk_tensor *o, const char *on, const dsk_tensor *lse, int lse_optional,
                                const dsk_tensor *q, const dsk_tensor *k, const dsk_tensor *v, float scale) {
    char a[96];
    DSK__TRY(dsk__fa_need4(fn, "q", q, NULL));
    DSK__TRY(dsk__fa_need4(fn, "k", k, q));
    DSK__TRY(dsk__need_same_shape(fn, "k", k, "q", q));
    DSK__TRY(dsk__fa_need4(fn, "v", v, q));
    DSK__TRY(dsk__fa_need_rows(fn, "v", v, q, -1, "Dv"));
    DSK__TRY(dsk__fa_need4(fn, on, o, q));
    DSK__TRY(dsk__fa_need_rows(fn, on, o, q, v->shape[3], "Dv"));
    if (lse || !lse_optional) {
        DSK__TRY(dsk__need_dtype(fn, "lse", lse, DSK_F32));
        if (lse->ndim != 3 || lse->shape[0] != q->shape[0] || lse->shape[1] != q->shape[2] || lse->shape[2] != q->shape[1])
            return dsk_set_error(DSK_ERR_ARG, "%s: lse %s must be (%lld, %lld, %lld) (B, H, T)", fn, dsk_tensor_describe(lse, a, sizeof a),
                                 (long long)q->shape[0], (long long)q->shape[2], (long long)q->shape[1]);
    }
    if (!isfinite(scale)) return dsk_set_error(DSK_ERR_ARG, "%s: scale %g is not finite", fn, (double)scale);
    return DSK_OK;
}

/* The (b, h) matrix of a 4-D attention tensor: row t (length cols) at data + base + t * rs. */
typedef struct dsk__fa_mat {
    void *data;
    dsk_dtype dt;
    int64_t base, rs, cols;
} dsk__fa_mat;

static dsk__fa_mat dsk__fa_head(const dsk_tensor *t, int64_t b, int64_t h) {
    dsk__fa_mat m;
    m.data = t->data;
    m.dt = t->dtype;
    m.base = b * t->stride[0] + h * t->stride[2];
    m.rs = t->stride[1];
    m.cols = t->shape[3];
    return m;
}

/* Row r of m as f32 into dst (the dtype switch outside the element loop). */
static void dsk__fa_load_row(const dsk__fa_mat *m, int64_t r, float *dst) {
    int64_t o = m->base + r * m->rs, n = m->cols;
    if (m->dt == DSK_F32) memcpy(dst, (const float *)m->data + o, (size_t)n * sizeof(float));
    else if (m->dt == DSK_BF16)
        for (int64_t d = 0; d < n; d++) dst[d] = dsk_bf16_to_f32(((const uint16_t *)m->data)[o + d]);
    else
        for (int64_t d = 0; d < n; d++) dst[d] = dsk_f16_to_f32(((const uint16_t *)m->data)[o + d]);
}

/* Rows [r0, r0 + n) of m as an f32 matrix: in place (leading dim rs) when m is f32, else
   converted into buf (leading dim cols). */
static const float *dsk__fa_rows(const dsk__fa_mat *m, int64_t r0, int64_t n, float *buf, int64_t *ld) {
    if (m->dt == DSK_F32) {
        *ld = m->rs;
        return (const float *)m->data + m->base + r0 * m->rs;
    }
    for (int64_t i = 0; i < n; i++) dsk__fa_load_row(m, r0 + i, buf + i * m->cols);
    *ld = m->cols;
    return buf;
}

/* Rows [r0, r0 + n) of m += acc (n x cols, leading dim cols), one rounding per element. */
static void dsk__fa_add_rows(const dsk__fa_mat *m, int64_t r0, int64_t n, const float *acc) {
    for (int64_t i = 0; i < n; i++) {
        int64_t o = m->base + (r0 + i) * m->rs;
        const float *a = acc + i * m->cols;
        if (m->dt == DSK_F32) {
            float *y = (float *)m->data + o;
            for (int64_t d = 0; d < m->cols; d++) y[d] += a[d];
        } else {
            for (int64_t d = 0; d < m->cols; d++) dsk_store_f32(m->data, m->dt, o + d, dsk_load_f32(m->data, m->dt, o + d) + a[d]);
        }
    }
}

/* dst (cols x n, leading dim n) = rows [r0, r0 + n) of m transposed, as f32: the right operand
   of Q K^T and dO V^T with contiguous rows. row: scratch of cols floats. */
static void dsk__fa_rows_t(const dsk__fa_mat *m, int64_t r0, int64_t n, float *dst, float *row) {
    for (int64_t i = 0; i < n; i++) {
        const float *x = row;
        if (m->dt == DSK_F32) x = (const float *)m->data + m->base + (r0 + i) * m->rs;
        else dsk__fa_load_row(m, r0 + i, row);
        for (int64_t d = 0; d < m->cols; d++) dst[d * n + i] = x[d];
    }
}

/* Valid keys of query row i in the key tile starting at j0 with bc keys (causal: j <= i). */
static int64_t dsk__fa_ncols(int64_t i, int64_t j0, int64_t bc) {
    int64_t n = i - j0 + 1;
    return n < 0 ? 0 : n > bc ? bc : n;
}

/* The kernels of one call: ctx's GEMM micro-kernel and row primitives, and the floats of GEMM
   scratch a tile product needs (the direct nest; the packed one past DSK__DIRECT_N columns). */
typedef struct dsk__fa_k {
    dsk__ukernel uk;
    dsk__rowk rk;
    int64_t ws;
} dsk__fa_k;

static dsk__fa_k dsk__fa_kernels(const dsk_ctx *ctx, int64_t Dk, int64_t Dv) {
    dsk__fa_k k;
    int64_t n = Dk > Dv ? Dk : Dv, packed;
    k.uk = dsk__ukernel_for(ctx ? ctx->cpu_isa : DSK_CPU_ISA_AUTO);
    k.rk = dsk__rowk_ctx(ctx);
    k.ws = (int64_t)DSK__DIRECT_KC * k.uk.mr;
    packed = (int64_t)DSK__KC * (DSK__MC + dsk__round_up(dsk__min64(n, DSK__NC), k.uk.nr));
    if (n > DSK__DIRECT_N && packed > k.ws) k.ws = packed;
    return k;
}

/* Online softmax over one tile. S (br x bc, leading dim DSK__FA_BC) holds the scaled scores of
   query rows i0.. against keys j0..; it becomes P = e^(S - m_new), 0 where masked. Each row's
   running max m and sum l are updated and its accumulated output O (leading dim dv) rescaled. */
static void dsk__fa_softmax_tile(const dsk__fa_k *k, float *S, int64_t br, int64_t bc, int64_t i0, int64_t j0, float *m, float *l, float *O,
                                 int64_t dv) {
    for (int64_t r = 0; r < br; r++) {
        float *s = S + r * DSK__FA_BC, mx, alpha;
        int64_t nc = dsk__fa_ncols(i0 + r, j0, bc);
        memset(s + nc, 0, (size_t)(bc - nc) * sizeof(float));
        if (nc == 0) continue;
        mx = k->rk.max(s, nc);
        mx = mx > m[r] ? mx : m[r];
        alpha = dsk_exp_f(m[r] - mx);
        l[r] = alpha * l[r] + k->rk.exp_sum(s, s, nc, mx);
        m[r] = mx;
        if (alpha != 1.0f) k->rk.scale(O + r * dv, O + r * dv, alpha, dv);
    }
}

/* Forward of query tile it of head (b, h); sc: this thread's scratch (dsk__fa_forward_scratch). */
static void dsk__fa_forward_tile(const dsk__fa_k *kk, dsk_tensor *out, dsk_tensor *lse, const dsk_tensor *q, const dsk_tensor *k,
                                 const dsk_tensor *v, float scale, int64_t b, int64_t h, int64_t it, float *sc) {
    int64_t T = q->shape[1], H = q->shape[2], Dk = q->shape[3], Dv = v->shape[3];
    int64_t i0 = it * DSK__FA_BR, br = T - i0 < DSK__FA_BR ? T - i0 : DSK__FA_BR, ldq, ldv;
    float *qb = sc, *kt = qb + DSK__FA_BR * Dk, *vb = kt + DSK__FA_BC * Dk, *S = vb + DSK__FA_BC * Dv;
    float *O = S + DSK__FA_BR * DSK__FA_BC, *m = O + DSK__FA_BR * Dv, *l = m + DSK__FA_BR, *row = l + DSK__FA_BR;
    float *ws = row + (Dk > Dv ? Dk : Dv);
    dsk__fa_mat mq = dsk__fa_head(q, b, h), mk = dsk__fa_head(k, b, h), mv = dsk__fa_head(v, b, h), mo = dsk__fa_head(out, b, h);
    const float *Q = dsk__fa_rows(&mq, i0, br, qb, &ldq);
    for (int64_t r = 0; r < br; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
    memset(O, 0, (size_t)(br * Dv) * sizeof(float));
    for (int64_t j0 = 0; j0 < i0 + br; j0 += DSK__FA_BC) {
        int64_t bc = i0 + br - j0 < DSK__FA_BC ? i0 + br - j0 : DSK__FA_BC;
        const float *V = dsk__fa_rows(&mv, j0, bc, vb, &ldv);
        dsk__fa_rows_t(&mk, j0, bc, kt, row);
        dsk__attn_gemm(&kk->uk, br, bc, Dk, scale, Q, ldq, 1, kt, bc, 0.0f, S, DSK__FA_BC, ws); /* S = scale Q K^T */
        dsk__fa_softmax_tile(kk, S, br, bc, i0, j0, m, l, O, Dv);
        dsk__attn_gemm(&kk->uk, br, Dv, bc, 1.0f, S, DSK__FA_BC, 1, V, ldv, 1.0f, O, Dv, ws); /* O += P V */
    }
    for (int64_t r = 0; r < br; r++) {
        int64_t o = mo.base + (i0 + r) * mo.rs;
        if (mo.dt == DSK_F32) kk->rk.scale((float *)mo.data + o, O + r * Dv, 1.0f / l[r], Dv);
        else
            for (int64_t d = 0; d < Dv; d++) dsk_store_f32(mo.data, mo.dt, o + d, O[r * Dv + d] * (1.0f / l[r]));
        if (lse) ((float *)lse->data)[(b * H + h) * T + i0 + r] = dsk_attn_lse(m[r], l[r]);
    }
}

/* Per-thread scratch floats of the forward tiles. */
static int64_t dsk__fa_forward_scratch(const dsk__fa_k *k, int64_t Dk, int64_t Dv) {
    return DSK__FA_BR * Dk + DSK__FA_BC * Dk + DSK__FA_BC * Dv + DSK__FA_BR * DSK__FA_BC + DSK__FA_BR * Dv + 2 * DSK__FA_BR +
           (Dk > Dv ? Dk : Dv) + k->ws;
}

DSK_API dsk_status dsk_attention_fused(dsk_ctx *ctx, dsk_tensor *out, dsk_tensor *lse, const dsk_tensor *q, const dsk_tensor *k,
                                       const dsk_tensor *v, float scale) {
    const char *fn = "dsk_attention_fused";
    int cuda = 0;
    int64_t B, T, H, nt, per;
    float *scratch;
    dsk__fa_k kk;
    dsk_status s;
    const dsk_tensor *ts[5] = {q, k, v, out, lse};
    const char *names[5] = {"q", "k", "v", "out", "lse"};
    DSK__TRY(dsk__fa_check(fn, out, "out", lse, 1, q, k, v, scale));
    DSK__TRY(dsk__need_devices(fn, ctx, 5, ts, names, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_attention_fused(ctx, out, lse, q, k, v, scale));
    B = q->shape[0]; T = q->shape[1]; H = q->shape[2];
    nt = (T + DSK__FA_BR - 1) / DSK__FA_BR;
    if (B * H * T == 0) return DSK_OK;
    kk = dsk__fa_kernels(ctx, q->shape[3], v->shape[3]);
    per = dsk__fa_forward_scratch(&kk, q->shape[3], v->shape[3]);
    if (!(scratch = dsk__scratch(fn, ctx, per, &s))) return s;
    /* Every (b, h, query tile) owns its rows of out and lse; tiles near the end of a sequence
       cost more (more keys), so they are handed out first, dynamically. */
    DSK__OMP(parallel for schedule(dynamic) num_threads(dsk__threads(ctx)) if (B * H * nt > 1))
    for (int64_t w = 0; w < B * H * nt; w++)
        dsk__fa_forward_tile(&kk, out, lse, q, k, v, scale, w / (H * nt), w / nt % H, nt - 1 - w % nt, scratch + per * dsk__thread_id());
    DSK_FREE(scratch);
    return DSK_OK;
}

/* ---- backward */

typedef struct dsk__fa_bwd {
    const dsk_tensor *q, *k, *v, *dout, *dq, *dk, *dv;
    const float *lse, *drow; /* (B, H, T): forward's log-sum-exp and D = dout . out */
    float scale;
    int64_t T, H, Dk, Dv;
    dsk__fa_k kk;
} dsk__fa_bwd;

/* A key tile of one head as the backward products read it: K row-major (in place when f32),
   K^T and V^T (d x bc, leading dim bc). */
typedef struct dsk__fa_ktile {
    const float *K, *Kt, *Vt;
    int64_t ldk, j0, bc;
} dsk__fa_ktile;

static dsk__fa_ktile dsk__fa_load_ktile(const dsk__fa_bwd *a, int64_t b, int64_t h, int64_t j0, int64_t bc, float *kb, float *kt, float *vt,
                                        float *row) {
    dsk__fa_ktile t;
    dsk__fa_mat mk = dsk__fa_head(a->k, b, h), mv = dsk__fa_head(a->v, b, h);
    t.K = dsk__fa_rows(&mk, j0, bc, kb, &t.ldk);
    dsk__fa_rows_t(&mk, j0, bc, kt, row);
    dsk__fa_rows_t(&mv, j0, bc, vt, row);
    t.Kt = kt; t.Vt = vt; t.j0 = j0; t.bc = bc;
    return t;
}

/* dS of query rows i0.. (br) against key tile kt of head bh, Q and dO as f32 with their leading
   dims: S becomes P = e^(scale Q K^T - lse) (0 where masked) and dP becomes dS = P (dO V^T - D). */
static void dsk__fa_dscores(const dsk__fa_bwd *a, int64_t bh, int64_t i0, int64_t br, const dsk__fa_ktile *kt, const float *Q, int64_t ldq,
                            const float *dO, int64_t ldo, float *S, float *dP, float *ws) {
    const float *lse = a->lse + bh * a->T + i0, *drow = a->drow + bh * a->T + i0;
    int64_t bc = kt->bc;
    dsk__attn_gemm(&a->kk.uk, br, bc, a->Dk, a->scale, Q, ldq, 1, kt->Kt, bc, 0.0f, S, DSK__FA_BC, ws);
    dsk__attn_gemm(&a->kk.uk, br, bc, a->Dv, 1.0f, dO, ldo, 1, kt->Vt, bc, 0.0f, dP, DSK__FA_BC, ws);
    for (int64_t r = 0; r < br; r++) {
        float *s = S + r * DSK__FA_BC, *dp = dP + r * DSK__FA_BC;
        int64_t nc = dsk__fa_ncols(i0 + r, kt->j0, bc);
        (void)a->kk.rk.exp_sum(s, s, nc, lse[r]);
        a->kk.rk.sub_mul(dp, s, dp, drow[r], nc, 0); /* dsk_attn_dscore, a row at a time */
        memset(s + nc, 0, (size_t)(bc - nc) * sizeof(float));
        memset(dp + nc, 0, (size_t)(bc - nc) * sizeof(float));
    }
}

/* Scratch floats per thread of the backward tiles (dq_whole: T x Dk more for the one-pass
   order, which accumulates a whole head's dq). Layout: Q, dO (query tile), K, K^T, V^T (key
   tile), S, dP, then dK, dV (key pass) or dQ (query pass), a row, GEMM scratch, and the whole
   dq last. */
static int64_t dsk__fa_backward_acc(int64_t Dk, int64_t Dv) {
    return DSK__FA_BC * (Dk + Dv) > DSK__FA_BR * Dk ? DSK__FA_BC * (Dk + Dv) : DSK__FA_BR * Dk;
}
static int64_t dsk__fa_backward_scratch(const dsk__fa_k *k, int64_t T, int64_t Dk, int64_t Dv, int dq_whole) {
    return DSK__FA_BR * (Dk + Dv) + DSK__FA_BC * (2 * Dk + Dv) + 2 * DSK__FA_BR * DSK__FA_BC + dsk__fa_backward_acc(Dk, Dv) +
           (Dk > Dv ? Dk : Dv) + k->ws + (dq_whole ? T * Dk : 0);
}

/* Key tile jt of head (b, h): its dk and dv rows from every query tile at or after it, in
   increasing order. With dq (a whole head's T x Dk f32 accumulator) the same tiles also add
   scale dS K into it (the one-pass order); else dq is left to dsk__fa_bwd_queries. */
static void dsk__fa_bwd_keys(const dsk__fa_bwd *a, int64_t b, int64_t h, int64_t jt, float *sc, float *dq) {
    int64_t T = a->T, Dk = a->Dk, Dv = a->Dv, j0 = jt * DSK__FA_BC, bc = T - j0 < DSK__FA_BC ? T - j0 : DSK__FA_BC, ldq, ldo;
    float *qb = sc, *ob = qb + DSK__FA_BR * Dk, *kb = ob + DSK__FA_BR * Dv, *ktb = kb + DSK__FA_BC * Dk, *vtb = ktb + DSK__FA_BC * Dk;
    float *S = vtb + DSK__FA_BC * Dv, *dP = S + DSK__FA_BR * DSK__FA_BC, *gk = dP + DSK__FA_BR * DSK__FA_BC, *gv = gk + DSK__FA_BC * Dk;
    float *row = gk + dsk__fa_backward_acc(Dk, Dv), *ws = row + (Dk > Dv ? Dk : Dv);
    const dsk__ukernel *uk = &a->kk.uk;
    dsk__fa_mat mq = dsk__fa_head(a->q, b, h), mo = dsk__fa_head(a->dout, b, h), mk = dsk__fa_head(a->dk, b, h), mv = dsk__fa_head(a->dv, b, h);
    dsk__fa_ktile kt = dsk__fa_load_ktile(a, b, h, j0, bc, kb, ktb, vtb, row);
    memset(gk, 0, (size_t)(bc * Dk) * sizeof(float));
    memset(gv, 0, (size_t)(bc * Dv) * sizeof(float));
    for (int64_t i0 = j0 / DSK__FA_BR * DSK__FA_BR; i0 < T; i0 += DSK__FA_BR) {
        int64_t br = T - i0 < DSK__FA_BR ? T - i0 : DSK__FA_BR;
        const float *Q = dsk__fa_rows(&mq, i0, br, qb, &ldq), *dO = dsk__fa_rows(&mo, i0, br, ob, &ldo);
        dsk__fa_dscores(a, b * a->H + h, i0, br, &kt, Q, ldq, dO, ldo, S, dP, ws);
        dsk__attn_gemm(uk, bc, Dv, br, 1.0f, S, 1, DSK__FA_BC, dO, ldo, 1.0f, gv, Dv, ws);      /* dV += P^T dO */
        dsk__attn_gemm(uk, bc, Dk, br, a->scale, dP, 1, DSK__FA_BC, Q, ldq, 1.0f, gk, Dk, ws); /* dK += scale dS^T Q */
        if (dq) dsk__attn_gemm(uk, br, Dk, bc, a->scale, dP, DSK__FA_BC, 1, kt.K, kt.ldk, 1.0f, dq + i0 * Dk, Dk, ws); /* dQ += scale dS K */
    }
    dsk__fa_add_rows(&mk, j0, bc, gk);
    dsk__fa_add_rows(&mv, j0, bc, gv);
}

/* Query tile it of head (b, h): its dq rows from every key tile up to it, in increasing order
   (the same sums, in the same order, as the one-pass loop). */
static void dsk__fa_bwd_queries(const dsk__fa_bwd *a, int64_t b, int64_t h, int64_t it, float *sc) {
    int64_t T = a->T, Dk = a->Dk, Dv = a->Dv, i0 = it * DSK__FA_BR, br = T - i0 < DSK__FA_BR ? T - i0 : DSK__FA_BR, ldq, ldo;
    float *qb = sc, *ob = qb + DSK__FA_BR * Dk, *kb = ob + DSK__FA_BR * Dv, *ktb = kb + DSK__FA_BC * Dk, *vtb = ktb + DSK__FA_BC * Dk;
    float *S = vtb + DSK__FA_BC * Dv, *dP = S + DSK__FA_BR * DSK__FA_BC, *gq = dP + DSK__FA_BR * DSK__FA_BC;
    float *row = gq + dsk__fa_backward_acc(Dk, Dv), *ws = row + (Dk > Dv ? Dk : Dv);
    dsk__fa_mat mq = dsk__fa_head(a->q, b, h), mo = dsk__fa_head(a->dout, b, h), mdq = dsk__fa_head(a->dq, b, h);
    const float *Q = dsk__fa_rows(&mq, i0, br, qb, &ldq), *dO = dsk__fa_rows(&mo, i0, br, ob, &ldo);
    memset(gq, 0, (size_t)(br * Dk) * sizeof(float));
    for (int64_t j0 = 0; j0 < i0 + br; j0 += DSK__FA_BC) {
        int64_t bc = T - j0 < DSK__FA_BC ? T - j0 : DSK__FA_BC;
        dsk__fa_ktile kt = dsk__fa_load_ktile(a, b, h, j0, bc, kb, ktb, vtb, row);
        dsk__fa_dscores(a, b * a->H + h, i0, br, &kt, Q, ldq, dO, ldo, S, dP, ws);
        dsk__attn_gemm(&a->kk.uk, br, Dk, bc, a->scale, dP, DSK__FA_BC, 1, kt.K, kt.ldk, 1.0f, gq, Dk, ws);
    }
    dsk__fa_add_rows(&mdq, i0, br, gq);
}

/* D (B, H, T) = row sums of dout * out in f32, in order. */
static void dsk__fa_drow(int nthreads, const dsk__rowk *rk, float *drow, const dsk_tensor *dout, const dsk_tensor *out) {
    int64_t B = out->shape[0], T = out->shape[1], H = out->shape[2], D = out->shape[3];
    (void)nthreads;
    DSK__OMP(parallel for schedule(static) num_threads(nthreads) if (B * H * T * D > DSK__PAR_MIN))
    for (int64_t bh = 0; bh < B * H; bh++) {
        dsk__fa_mat mo = dsk__fa_head(out, bh / H, bh % H), md = dsk__fa_head(dout, bh / H, bh % H);
        float a[256], b[256];
        for (int64_t i = 0; i < T; i++) {
            float s = 0.0f;
            for (int64_t d0 = 0; d0 < D; d0 += 256) { /* in chunks of 256, converted unless f32 */
                int64_t n = D - d0 < 256 ? D - d0 : 256;
                const float *x = a, *y = b;
                if (mo.dt == DSK_F32) {
                    x = (const float *)mo.data + mo.base + i * mo.rs + d0;
                    y = (const float *)md.data + md.base + i * md.rs + d0;
                } else {
                    for (int64_t d = 0; d < n; d++) {
                        a[d] = dsk_load_f32(mo.data, mo.dt, mo.base + i * mo.rs + d0 + d);
                        b[d] = dsk_load_f32(md.data, md.dt, md.base + i * md.rs + d0 + d);
                    }
                }
                s += rk->dot(x, y, n);
            }
            drow[bh * T + i] = s;
        }
    }
}

DSK_API dsk_status dsk_attention_fused_backward(dsk_ctx *ctx, dsk_tensor *dq, dsk_tensor *dk, dsk_tensor *dv,
                                                const dsk_tensor *dout, const dsk_tensor *q, const dsk_tensor *k,
                                                const dsk_tensor *v, const dsk_tensor *out, const dsk_tensor *lse,
                                                float scale, dsk_grad_store store) {
    const char *fn = "dsk_attention_fused_backward";
    int cuda, nthreads, one_pass;
    int64_t B, T, H, nt, per;
    float *scratch, *drow;
    dsk__fa_bwd a;
    dsk_status s;
    const dsk_tensor *ts[9] = {q, k, v, out, dout, lse, dq, dk, dv};
    const char *names[9] = {"q", "k", "v", "out", "dout", "lse", "dq", "dk", "dv"};
    DSK__TRY(dsk__fa_check(fn, dout, "dout", lse, 0, q, k, v, scale));
    DSK__TRY(dsk__fa_need4(fn, "out", out, q));
    DSK__TRY(dsk__need_same_shape(fn, "out", out, "dout", dout));
    DSK__TRY(dsk__fa_need4(fn, "dq", dq, q));
    DSK__TRY(dsk__need_same_shape(fn, "dq", dq, "q", q));
    DSK__TRY(dsk__fa_need4(fn, "dk", dk, q));
    DSK__TRY(dsk__need_same_shape(fn, "dk", dk, "k", k));
    DSK__TRY(dsk__fa_need4(fn, "dv", dv, q));
    DSK__TRY(dsk__need_same_shape(fn, "dv", dv, "v", v));
    DSK__TRY(dsk__need_store(fn, store));
    DSK__TRY(dsk__need_devices(fn, ctx, 9, ts, names, &cuda));
    if (store == DSK_GRAD_WRITE) { /* the kernels add each tile's part into the outputs */
        DSK__TRY(dsk_tensor_fill(ctx, dq, 0.0));
        DSK__TRY(dsk_tensor_fill(ctx, dk, 0.0));
        DSK__TRY(dsk_tensor_fill(ctx, dv, 0.0));
    }
    DSK__CUDA_PATH(cuda, dsk_cuda_attention_fused_backward(ctx, dq, dk, dv, dout, q, k, v, out, lse, scale));
    B = q->shape[0]; T = q->shape[1]; H = q->shape[2];
    if (B * H * T == 0) return DSK_OK;
    nt = (T + DSK__FA_BR - 1) / DSK__FA_BR;
    nthreads = dsk__threads(ctx);
    /* One pass per head while there are heads for every thread; else dk/dv by key tiles, then
       dq by query tiles, which costs two more tile products per pair but keeps threads busy. */
    one_pass = B * H >= nthreads;
    a.kk = dsk__fa_kernels(ctx, q->shape[3], v->shape[3]);
    per = dsk__fa_backward_scratch(&a.kk, T, q->shape[3], v->shape[3], one_pass);
    if (!(drow = (float *)DSK_MALLOC((size_t)(B * H * T) * sizeof(float))))
        return dsk_set_error(DSK_ERR_OOM, "%s: out of host memory for %lld row statistics", fn, (long long)(B * H * T));
    if (!(scratch = dsk__scratch(fn, ctx, per, &s))) { DSK_FREE(drow); return s; }
    a.q = q; a.k = k; a.v = v; a.dout = dout; a.dq = dq; a.dk = dk; a.dv = dv;
    a.lse = (const float *)lse->data; a.drow = drow; a.scale = scale;
    a.T = T; a.H = H; a.Dk = q->shape[3]; a.Dv = v->shape[3];
    dsk__fa_drow(nthreads, &a.kk.rk, drow, dout, out);
    if (one_pass) {
        DSK__OMP(parallel for schedule(dynamic) num_threads(nthreads) if (B * H > 1))
        for (int64_t bh = 0; bh < B * H; bh++) {
            float *sc = scratch + per * dsk__thread_id(), *gq = sc + per - T * a.Dk;
            dsk__fa_mat mq = dsk__fa_head(dq, bh / H, bh % H);
            memset(gq, 0, (size_t)(T * a.Dk) * sizeof(float));
            for (int64_t jt = 0; jt < nt; jt++) dsk__fa_bwd_keys(&a, bh / H, bh % H, jt, sc, gq);
            dsk__fa_add_rows(&mq, 0, T, gq);
        }
    } else {
        DSK__OMP(parallel for schedule(dynamic) num_threads(nthreads))
        for (int64_t w = 0; w < B * H * nt; w++)
            dsk__fa_bwd_keys(&a, w / (H * nt), w / nt % H, w % nt, scratch + per * dsk__thread_id(), NULL);
        DSK__OMP(parallel for schedule(dynamic) num_threads(nthreads))
        for (int64_t w = 0; w < B * H * nt; w++)
            dsk__fa_bwd_queries(&a, w / (H * nt), w / nt % H, nt - 1 - w % nt, scratch + per * dsk__thread_id());
    }
    DSK_FREE(scratch);
    DSK_FREE(drow);
    return DSK_OK;
}

/* ---------------------------------------------------------------- FP8 GEMM */

static const char *dsk__fp8_layout(dsk_fp8_scaling s) {
    return s == DSK_FP8_TILE_1X128 ? "1x128 tiles" : "128x128 blocks";
}

static dsk_status dsk__fp8_need_scaling(const char *fn, const char *what, dsk_fp8_scaling s) {
    if (s != DSK_FP8_TILE_1X128 && s != DSK_FP8_BLOCK_128X128)
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %d is neither DSK_FP8_TILE_1X128 (1) nor DSK_FP8_BLOCK_128X128 (128)",
                             fn, what, (int)s);
    return DSK_OK;
}

/* An operand of ndim dims, e4m3 or e5m2 codes, contiguous. */
static dsk_status dsk__fp8_need_codes(const char *fn, const char *what, const dsk_tensor *t, int ndim) {
    char b[96];
    DSK__TRY(dsk__need_contig(fn, what, t));
    if (t->dtype != DSK_E4M3 && t->dtype != DSK_E5M2)
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %s: dtype must be e4m3 or e5m2", fn, what,
                             dsk_tensor_describe(t, b, sizeof b));
    return dsk__need_ndim(fn, what, t, ndim);
}

/* The scales of operand q (its last two dims R x K, leading dims kept) in layout sc. */
static dsk_status dsk__fp8_need_scales(const char *fn, const char *what, const dsk_tensor *s, const char *qwhat,
                                       const dsk_tensor *q, dsk_fp8_scaling sc) {
    char a[96], b[96], c[96];
    int64_t want[DSK_MAX_DIMS], R = q->shape[q->ndim - 2], K = q->shape[q->ndim - 1];
    int ok;
    DSK__TRY(dsk__need_dtype(fn, what, s, DSK_F32));
    for (int d = 0; d < q->ndim - 2; d++) want[d] = q->shape[d];
    want[q->ndim - 2] = (R + sc - 1) / sc;
    want[q->ndim - 1] = (K + DSK_FP8_BLOCK - 1) / DSK_FP8_BLOCK;
    ok = s->ndim == q->ndim;
    for (int d = 0; ok && d < q->ndim; d++) ok = s->shape[d] == want[d];
    if (!ok) {
        dsk_tensor w = *s;
        w.ndim = q->ndim;
        for (int d = 0; d < q->ndim; d++) w.shape[d] = want[d];
        return dsk_set_error(DSK_ERR_ARG, "%s: %s %s, want %s for %s %s in %s", fn, what,
                             dsk_tensor_describe(s, a, sizeof a), dsk_tensor_describe(&w, b, sizeof b), qwhat,
                             dsk_tensor_describe(q, c, sizeof c), dsk__fp8_layout(sc));
    }
    return DSK_OK;
}

/* C: contiguous f32, bf16 or f16 of shape (rows, cols). */
static dsk_status dsk__fp8_need_out(const char *fn, const dsk_tensor *C, const dsk_tensor *A, const dsk_tensor *B) {
    char a[96], b[96], c[96];
    DSK__TRY(dsk__need_float(fn, "C", C));
    if (C->ndim != 2 || C->shape[0] != A->shape[0] || C->shape[1] != B->shape[B->ndim - 2] ||
        A->shape[1] != B->shape[B->ndim - 1])
        return dsk_set_error(DSK_ERR_ARG, "%s: C %s, A %s, B %s: want C (M, N) = A (M, K) B (%sN, K)^T", fn,
                             dsk_tensor_describe(C, c, sizeof c), dsk_tensor_describe(A, a, sizeof a),
                             dsk_tensor_describe(B, b, sizeof b), B->ndim == 3 ? "G, " : "");
    return DSK_OK;
}

/* The CPU tiles: TM rows x TN columns. B's chunk is decoded once per tile: the more rows share it,
   the less decoding per product. */
#define DSK__FP8_TM 64
#define DSK__FP8_TN 64
#if DSK__FP8_TN % DSK_FP8_DOT_W
#error "dsk: the CPU FP8 tile must hold whole groups of DSK_FP8_DOT_W columns"
#endif

typedef struct dsk__fp8_args {
    const uint8_t *A, *B;
    const float *sa, *sb;
    float lut_a[256], lut_b[256];     /* fp8 code -> f32 */
    int64_t N, K, kc, a_rows, b_rows; /* a_rows, b_rows: rows per scale */
    int64_t b_step, sb_step;          /* elements from B[g] (and its scales) to B[g + 1] */
    int weights;                      /* the weights form: segments cut K, C[g] (M, N) */
    int64_t M, c_step;                /* C[g]'s rows and the elements from C[g] to C[g + 1] */
    void *C;
    dsk_dtype c_dt;
    float alpha, beta;
    const int32_t *off; /* (G + 1) segment offsets */
    int64_t *task0;     /* (G + 1): the first task of each segment */
    int64_t G, tiles_n;
} dsk__fp8_args;

static void dsk__fp8_lut(float *lut, dsk_dtype dt) {
    for (int i = 0; i < 256; i++) lut[i] = dt == DSK_E4M3 ? dsk_e4m3_to_f32((uint8_t)i) : dsk_e5m2_to_f32((uint8_t)i);
}

#define DSK__FP8_ROWS 4 /* rows of a tile whose sums dsk__fp8_dot_rows keeps in registers at once */

#if defined(__GNUC__) || defined(__clang__)
typedef float dsk__f32x8 __attribute__((vector_size(32)));
/* dsk_fp8_chunk_dot for DSK__FP8_ROWS rows of a (lda DSK_FP8_BLOCK) against b (ldb nj, ldj 1):
   dot[r * nj + j], the same sums (one vector lane each, k ascending; the products of fp8 values
   are exact, so a fused multiply-add changes nothing), with the 8 vectors of a group's sums in
   registers: a row at a time the adds' latency would bound the loop. */
static void dsk__fp8_dot_rows(float *dot, int nj, const float *a, const float *b, int n) {
    const float *a0 = a, *a1 = a + DSK_FP8_BLOCK, *a2 = a + 2 * DSK_FP8_BLOCK, *a3 = a + 3 * DSK_FP8_BLOCK;
    for (int j0 = 0; j0 < nj; j0 += DSK_FP8_DOT_W) { /* named sums: gcc keeps an array of them in memory */
        dsk__f32x8 s00 = {0}, s01 = {0}, s10 = {0}, s11 = {0}, s20 = {0}, s21 = {0}, s30 = {0}, s31 = {0}, b0, b1;
        for (int k = 0; k < n; k++) {
            memcpy(&b0, b + k * nj + j0, sizeof b0);
            memcpy(&b1, b + k * nj + j0 + 8, sizeof b1);
            s00 += a0[k] * b0, s01 += a0[k] * b1, s10 += a1[k] * b0, s11 += a1[k] * b1;
            s20 += a2[k] * b0, s21 += a2[k] * b1, s30 += a3[k] * b0, s31 += a3[k] * b1;
        }
        memcpy(dot + j0, &s00, 32), memcpy(dot + j0 + 8, &s01, 32);
        memcpy(dot + nj + j0, &s10, 32), memcpy(dot + nj + j0 + 8, &s11, 32);
        memcpy(dot + 2 * nj + j0, &s20, 32), memcpy(dot + 2 * nj + j0 + 8, &s21, 32);
        memcpy(dot + 3 * nj + j0, &s30, 32), memcpy(dot + 3 * nj + j0 + 8, &s31, 32);
    }
}
#else
static void dsk__fp8_dot_rows(float *dot, int nj, const float *a, const float *b, int n) {
    for (int r = 0; r < DSK__FP8_ROWS; r++) dsk_fp8_chunk_dot(dot + r * nj, nj, a + r * DSK_FP8_BLOCK, b, nj, 1, n);
}
#endif

/* Rows [i0, i1) x columns [j0, j1) of segment g's product (of C[g] in the weights form, whose K
   is the segment's); w: TM * 128 + 128 * TN + TM * TN floats. The columns are computed in whole
   groups of DSK_FP8_DOT_W (zeros past j1), the rows DSK__FP8_ROWS at a time and the last ones alone. */
static void dsk__fp8_tile(const dsk__fp8_args *p, int64_t g, int64_t i0, int64_t i1, int64_t j0, int64_t j1, float *w) {
    float *ad = w, *bd = ad + DSK__FP8_TM * DSK_FP8_BLOCK, *acc = bd + DSK_FP8_BLOCK * DSK__FP8_TN;
    float dot[DSK__FP8_ROWS * DSK__FP8_TN], s_b[DSK__FP8_TN]; /* s_b: the chunk's scales of B's rows */
    const uint8_t *B = p->B + g * p->b_step;
    const float *sb = p->sb + g * p->sb_step;
    int64_t m = i1 - i0, nn = j1 - j0, klo = p->weights ? p->off[g] : 0, khi = p->weights ? p->off[g + 1] : p->K;
    int nj = (int)((nn + DSK_FP8_DOT_W - 1) / DSK_FP8_DOT_W * DSK_FP8_DOT_W);
    for (int64_t e = 0; e < DSK__FP8_TM * DSK__FP8_TN; e++) acc[e] = 0.0f;
    for (int64_t c = klo / DSK_FP8_BLOCK; klo < khi && c * DSK_FP8_BLOCK < khi; c++) { /* chunks cut to [klo, khi) */
        int64_t k0 = c * DSK_FP8_BLOCK > klo ? c * DSK_FP8_BLOCK : klo;
        int n = (int)((c + 1) * DSK_FP8_BLOCK < khi ? (c + 1) * DSK_FP8_BLOCK - k0 : khi - k0);
        for (int64_t i = 0; i < m; i++)
            for (int k = 0; k < n; k++) ad[i * DSK_FP8_BLOCK + k] = p->lut_a[p->A[(i0 + i) * p->K + k0 + k]];
        for (int64_t j = 0; j < nj; j++) /* B's rows as columns, zeros past the last */
            for (int k = 0; k < n; k++) bd[k * nj + j] = j < nn ? p->lut_b[B[(j0 + j) * p->K + k0 + k]] : 0.0f;
        for (int64_t j = 0; j < nn; j++) s_b[j] = sb[((j0 + j) / p->b_rows) * p->kc + c];
        for (int64_t i = 0; i < m; i += DSK__FP8_ROWS) {
            int rows = m - i < DSK__FP8_ROWS ? (int)(m - i) : DSK__FP8_ROWS;
            if (rows == DSK__FP8_ROWS) dsk__fp8_dot_rows(dot, nj, ad + i * DSK_FP8_BLOCK, bd, n);
            else
                for (int r = 0; r < rows; r++)
                    dsk_fp8_chunk_dot(dot + r * nj, nj, ad + (i + r) * DSK_FP8_BLOCK, bd, nj, 1, n);
            for (int r = 0; r < rows; r++) {
                float s_a = p->sa[((i0 + i + r) / p->a_rows) * p->kc + c], *row = acc + (i + r) * DSK__FP8_TN;
                for (int64_t j = 0; j < nn; j++) row[j] = dsk_fp8_chunk_acc(row[j], dot[r * nj + j], s_a, s_b[j]);
            }
        }
    }
    for (int64_t i = 0; i < m; i++) { /* C's rows, converted a row at a time (the old values into dot) */
        int64_t o = g * p->c_step + (i0 + i) * p->N + j0;
        float *row = acc + i * DSK__FP8_TN;
        if (p->beta != 0.0f) dsk_load_f32_n(dot, p->C, p->c_dt, o, nn);
        for (int64_t j = 0; j < nn; j++)
            row[j] = dsk_fp8_out(row[j], p->alpha, p->beta, p->beta != 0.0f ? dot[j] : 0.0f);
        dsk_store_f32_n(p->C, p->c_dt, o, row, nn);
    }
}

/* Every segment's tiles on the ctx's threads; p->task0 is filled here. */
static dsk_status dsk__fp8_run(const char *fn, dsk_ctx *ctx, dsk__fp8_args *p) {
    int64_t total, per = DSK__FP8_TM * DSK_FP8_BLOCK + DSK_FP8_BLOCK * DSK__FP8_TN + DSK__FP8_TM * DSK__FP8_TN;
    float *scratch;
    dsk_status s;
    p->tiles_n = (p->N + DSK__FP8_TN - 1) / DSK__FP8_TN;
    p->task0[0] = 0;
    for (int64_t g = 0; g < p->G; g++) /* row tiles of the segment's rows, or of C[g]'s M rows */
        p->task0[g + 1] = p->task0[g] + ((p->weights ? p->M : p->off[g + 1] - p->off[g]) + DSK__FP8_TM - 1) /
                                            DSK__FP8_TM * p->tiles_n;
    total = p->task0[p->G];
    if (total == 0) return DSK_OK;
    if (!(scratch = dsk__scratch(fn, ctx, per, &s))) return s;
    DSK__OMP(parallel for schedule(dynamic) num_threads(dsk__threads(ctx)) \
        if ((p->off[p->G] - p->off[0]) * p->N * (p->weights ? p->M : p->K) > DSK__PAR_MIN))
    for (int64_t t = 0; t < total; t++) {
        int64_t lo = 0, hi = p->G, r0, tr;
        while (hi - lo > 1) { /* the segment g with task0[g] <= t < task0[g + 1] */
            int64_t mid = (lo + hi) / 2;
            if (p->task0[mid] <= t) lo = mid;
            else hi = mid;
        }
        tr = (t - p->task0[lo]) / p->tiles_n;
        r0 = (p->weights ? 0 : p->off[lo]) + tr * DSK__FP8_TM;
        {
            int64_t r_end = p->weights ? p->M : p->off[lo + 1];
            int64_t r1 = r0 + DSK__FP8_TM < r_end ? r0 + DSK__FP8_TM : r_end;
            int64_t c0 = (t - p->task0[lo]) % p->tiles_n * DSK__FP8_TN;
            int64_t c1 = c0 + DSK__FP8_TN < p->N ? c0 + DSK__FP8_TN : p->N;
            dsk__fp8_tile(p, lo, r0, r1, c0, c1, scratch + per * dsk__thread_id());
        }
    }
    DSK_FREE(scratch);
    return DSK_OK;
}

static void dsk__fp8_args_init(dsk__fp8_args *p, dsk_tensor *C, const dsk_tensor *A, const dsk_tensor *sa,
                               int64_t a_rows, const dsk_tensor *B, const dsk_tensor *sb, int64_t b_rows, float alpha,
                               float beta) {
    p->A = (const uint8_t *)A->data;
    p->B = (const uint8_t *)B->data;
    p->sa = (const float *)sa->data;
    p->sb = (const float *)sb->data;
    dsk__fp8_lut(p->lut_a, A->dtype);
    dsk__fp8_lut(p->lut_b, B->dtype);
    p->N = C->shape[C->ndim - 1];
    p->K = A->shape[1];
    p->kc = (p->K + DSK_FP8_BLOCK - 1) / DSK_FP8_BLOCK;
    p->a_rows = a_rows;
    p->b_rows = b_rows;
    p->b_step = B->shape[B->ndim - 2] * p->K;
    p->sb_step = sb->shape[sb->ndim - 2] * p->kc;
    p->C = C->data;
    p->c_dt = C->dtype;
    p->alpha = alpha;
    p->beta = beta;
    p->weights = C->ndim == 3;
    p->M = A->shape[0];
    p->c_step = p->weights ? C->shape[1] * C->shape[2] : 0;
    if (p->weights) p->b_step = p->sb_step = 0;
}

DSK_API dsk_status dsk_matmul_fp8(dsk_ctx *ctx, dsk_tensor *C, const dsk_tensor *A, const dsk_tensor *a_scales,
                                  dsk_fp8_scaling a_scaling, const dsk_tensor *B, const dsk_tensor *b_scales,
                                  dsk_fp8_scaling b_scaling, float alpha, float beta) {
    const char *fn = "dsk_matmul_fp8";
    const dsk_tensor *ts[5] = {C, A, a_scales, B, b_scales};
    const char *names[5] = {"C", "A", "a_scales", "B", "b_scales"};
    int cuda;
    int32_t off[2];
    int64_t task0[2];
    dsk__fp8_args p;
    DSK__TRY(dsk__fp8_need_codes(fn, "A", A, 2));
    DSK__TRY(dsk__fp8_need_codes(fn, "B", B, 2));
    DSK__TRY(dsk__fp8_need_out(fn, C, A, B));
    DSK__TRY(dsk__fp8_need_scaling(fn, "a_scaling", a_scaling));
    DSK__TRY(dsk__fp8_need_scaling(fn, "b_scaling", b_scaling));
    DSK__TRY(dsk__fp8_need_scales(fn, "a_scales", a_scales, "A", A, a_scaling));
    DSK__TRY(dsk__fp8_need_scales(fn, "b_scales", b_scales, "B", B, b_scaling));
    DSK__TRY(dsk__need_devices(fn, ctx, 5, ts, names, &cuda));
    if (A->shape[0] > INT32_MAX)
        return dsk_set_error(DSK_ERR_ARG, "%s: A has %lld rows, more than i32 row offsets hold", fn,
                             (long long)A->shape[0]);
    DSK__CUDA_PATH(
        cuda, dsk_cuda_matmul_fp8(ctx, C, A, a_scales, (int)a_scaling, B, b_scales, (int)b_scaling, NULL, alpha, beta));
    dsk__fp8_args_init(&p, C, A, a_scales, a_scaling, B, b_scales, b_scaling, alpha, beta);
    off[0] = 0;
    off[1] = (int32_t)A->shape[0];
    p.off = off;
    p.task0 = task0;
    p.G = 1;
    p.b_step = p.sb_step = 0;
    return dsk__fp8_run(fn, ctx, &p);
}

/* The weights form's shapes: C (G, M, N) = A (M, R) B (N, R)^T per segment of R. */
static dsk_status dsk__fp8_need_weights(const char *fn, const dsk_tensor *C, const dsk_tensor *A, const dsk_tensor *B,
                                        int64_t G) {
    char a[96], b[96], c[96];
    DSK__TRY(dsk__need_float(fn, "C", C));
    if (C->shape[0] != G || C->shape[1] != A->shape[0] || C->shape[2] != B->shape[0] || A->shape[1] != B->shape[1])
        return dsk_set_error(DSK_ERR_ARG,
                             "%s: C %s, A %s, B %s with %lld groups: want the weights form C (G, M, N) = "
                             "A (M, R) B (N, R)^T over segments of R",
                             fn, dsk_tensor_describe(C, c, sizeof c), dsk_tensor_describe(A, a, sizeof a),
                             dsk_tensor_describe(B, b, sizeof b), (long long)G);
    return DSK_OK;
}

DSK_API dsk_status dsk_matmul_fp8_grouped(dsk_ctx *ctx, dsk_tensor *C, const dsk_tensor *A, const dsk_tensor *a_scales,
                                          const dsk_tensor *B, const dsk_tensor *b_scales, dsk_fp8_scaling b_scaling,
                                          const dsk_tensor *offsets, float alpha, float beta) {
    const char *fn = "dsk_matmul_fp8_grouped";
    const dsk_tensor *ts[6] = {C, A, a_scales, B, b_scales, offsets};
    const char *names[6] = {"C", "A", "a_scales", "B", "b_scales", "offsets"};
    char b[96];
    int cuda, weights;
    int64_t G = 0;
    dsk__fp8_args p;
    dsk_status s;
    DSK__TRY(dsk__need_offsets(fn, offsets, &G));
    DSK__TRY(dsk__need(fn, "C", C));
    weights = C->ndim == 3;
    DSK__TRY(dsk__fp8_need_codes(fn, "A", A, 2));
    DSK__TRY(dsk__fp8_need_codes(fn, "B", B, weights ? 2 : 3));
    if (!weights && B->shape[0] != G)
        return dsk_set_error(DSK_ERR_ARG, "%s: B %s holds %lld matrices, offsets %lld groups", fn,
                             dsk_tensor_describe(B, b, sizeof b), (long long)B->shape[0], (long long)G);
    DSK__TRY(weights ? dsk__fp8_need_weights(fn, C, A, B, G) : dsk__fp8_need_out(fn, C, A, B));
    DSK__TRY(dsk__fp8_need_scaling(fn, "b_scaling", b_scaling));
    DSK__TRY(dsk__fp8_need_scales(fn, "a_scales", a_scales, "A", A, DSK_FP8_TILE_1X128));
    DSK__TRY(dsk__fp8_need_scales(fn, "b_scales", b_scales, "B", B, b_scaling));
    DSK__TRY(dsk__need_devices(fn, ctx, 6, ts, names, &cuda));
    DSK__CUDA_PATH(cuda, dsk_cuda_matmul_fp8(ctx, C, A, a_scales, DSK_FP8_TILE_1X128, B, b_scales, (int)b_scaling,
                                             offsets, alpha, beta));
    DSK__TRY(dsk__check_offsets(fn, offsets, G, A->shape[weights ? 1 : 0]));
    dsk__fp8_args_init(&p, C, A, a_scales, DSK_FP8_TILE_1X128, B, b_scales, b_scaling, alpha, beta);
    p.off = (const int32_t *)offsets->data;
    p.G = G;
    if (!(p.task0 = (int64_t *)DSK_MALLOC((size_t)(G + 1) * sizeof(int64_t))))
        return dsk_set_error(DSK_ERR_OOM, "%s: out of host memory for %lld segments", fn, (long long)G);
    s = dsk__fp8_run(fn, ctx, &p);
    DSK_FREE(p.task0);
    return s;
}

DSK__FP_EXACT_END
#endif /* DSK_TENSOR_IMPLEMENTATION_DONE */
#endif /* DSK_TENSOR_IMPLEMENTATION */

/* MIT License. Copyright (c) 2026 the dsk authors. Permission is hereby granted, free of
   charge, to any person obtaining a copy of this software, to deal in the software without
   restriction, subject to including this notice. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT
   WARRANTY OF ANY KIND. */
