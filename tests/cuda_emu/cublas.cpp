/* cublas.cpp - cuBLAS of the CUDA emulation: handles and GEMMs as plain loops (column-major,
   transposes, leading dimensions, batch strides, alpha and beta, f32 accumulation with
   fused multiply-adds for f16/bf16/f32 inputs, f64 for f64), each a stream operation on the
   handle's stream. Also the emulator's half and fp8 conversions. */
#include "emu.h"
#include "cublas_v2.h"

#include <math.h>
#include <mutex>
#include <set>
#include <string.h>
#include <vector>

namespace cuda_emu {

/* ---------------------------------------------------------------- numbers */

static uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

unsigned short f32_to_bf16(float f) {
    uint32_t u = bits_of(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

/* A float as a minifloat with `mbits` mantissa bits, exponent bias `bias` and largest finite
   magnitude code `maxcode` (sign not included): round to nearest even, NaN kept. `sat`
   clamps overflow to the largest finite value (else it becomes infinity, code maxcode + 1). */
static unsigned minifloat_from(float f, int mbits, int ebits, int bias, unsigned maxcode, unsigned nan, bool sat) {
    uint32_t sign = (bits_of(f) >> 31) << (mbits + ebits);
    float a = fabsf(f);
    int e, exp;
    double r;
    unsigned code;
    if (f != f) return sign | nan;
    if (isinf(f)) return sign | (sat ? maxcode : maxcode + 1);
    if (a == 0.0f) return sign;
    (void)frexpf(a, &e);  /* a = m 2^e, m in [0.5, 1): a normal's biased exponent is e - 1 + bias */
    exp = e - 1 + bias;
    if (exp >= 1) {
        r = nearbyint(ldexp((double)a, mbits - (e - 1))); /* in [2^mbits, 2^(mbits+1)]; ties to even */
        if (r >= ldexp(1.0, mbits + 1)) {
            r /= 2;
            exp++;
        }
        code = ((unsigned)exp << mbits) | ((unsigned)r & ((1u << mbits) - 1));
    } else { /* subnormal: a multiple of 2^(1 - bias - mbits); rounding up may reach the smallest normal */
        code = (unsigned)nearbyint(ldexp((double)a, mbits + bias - 1));
    }
    if (code > maxcode) return sign | (sat ? maxcode : maxcode + 1);
    return sign | code;
}
static float minifloat_to(unsigned code, int mbits, int ebits, int bias) {
    unsigned sign = code >> (mbits + ebits), exp = (code >> mbits) & ((1u << ebits) - 1), man = code & ((1u << mbits) - 1);
    float v = exp ? ldexpf(1.0f + (float)man / (float)(1u << mbits), (int)exp - bias) : ldexpf((float)man, 1 - bias - mbits);
    return sign ? -v : v;
}

unsigned short f32_to_f16(float f) { return (unsigned short)minifloat_from(f, 10, 5, 15, 0x7bff, 0x7e00, false); }
float f16_to_f32(unsigned short h) {
    if ((h & 0x7c00) == 0x7c00) return (h & 0x3ff) ? NAN : ((h & 0x8000) ? -INFINITY : INFINITY);
    return minifloat_to(h, 10, 5, 15);
}
unsigned char f32_to_e4m3(float f) { return (unsigned char)minifloat_from(f, 3, 4, 7, 0x7e, 0x7f, true); }
float e4m3_to_f32(unsigned char b) { return (b & 0x7f) == 0x7f ? NAN : minifloat_to(b, 3, 4, 7); }
unsigned char f32_to_e5m2(float f) { return (unsigned char)minifloat_from(f, 2, 5, 15, 0x7b, 0x7e, false); }
float e5m2_to_f32(unsigned char b) {
    if ((b & 0x7c) == 0x7c) return (b & 3) ? NAN : ((b & 0x80) ? -INFINITY : INFINITY);
    return minifloat_to(b, 2, 5, 15);
}

} // namespace cuda_emu

using namespace cuda_emu;

struct cublasContext {
    int device;
    cudaStream_t stream;
    cublasMath_t math;
    cublasPointerMode_t pointer_mode;
    void *workspace;
    size_t workspace_bytes;
};

static std::mutex g_handles_mu;
static std::set<cublasContext *> *g_handles;

static bool live(cublasHandle_t h) {
    std::lock_guard<std::mutex> g(g_handles_mu);
    return g_handles && g_handles->count(h);
}

static size_t type_size(cudaDataType t) {
    switch (t) {
    case CUDA_R_64F: return 8;
    case CUDA_R_32F: return 4;
    case CUDA_R_16F:
    case CUDA_R_16BF: return 2;
    default: return 0;
    }
}

static double load(const void *p, cudaDataType t, size_t i) {
    switch (t) {
    case CUDA_R_64F: return ((const double *)p)[i];
    case CUDA_R_16F: return f16_to_f32(((const unsigned short *)p)[i]);
    case CUDA_R_16BF: return bf16_to_f32(((const unsigned short *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

static void store(void *p, cudaDataType t, size_t i, double v) {
    switch (t) {
    case CUDA_R_64F: ((double *)p)[i] = v; break;
    case CUDA_R_16F: ((unsigned short *)p)[i] = f32_to_f16((float)v); break;
    case CUDA_R_16BF: ((unsigned short *)p)[i] = f32_to_bf16((float)v); break;
    default: ((float *)p)[i] = (float)v; break;
    }
}

namespace {

struct gemm {
    cublasOperation_t ta, tb;
    int m, n, k, lda, ldb, ldc, batch;
    long long sa, sb, sc;
    const void *A, *B, *alpha_p, *beta_p;
    void *C;
    cudaDataType at, bt, ct;
    bool f64, half_acc, device_scalars;
    double alpha, beta;
};

/* op(X) (rows x cols) element (r, c) of a column-major X with leading dimension ld. */
size_t at_index(cublasOperation_t t, int r, int c, int ld) { return t == CUBLAS_OP_N ? (size_t)r + (size_t)c * ld : (size_t)c + (size_t)r * ld; }

const int kRows = 4; /* rows of op(A) per pass over a row of op(B)^T */

/* acc[i] = the k-ordered fmaf sum of a[i k + p] b[p] (rows at most kRows): rows in step, so the
   sums' additions overlap; half_acc rounds each partial to f16 as CUBLAS_COMPUTE_16F does. */
void dot_rows(float *acc, int rows, const float *a, const float *b, int k, bool half_acc) {
    float s[kRows] = {0, 0, 0, 0};
    if (rows == kRows && !half_acc) {
        for (int p = 0; p < k; p++)
            for (int i = 0; i < kRows; i++) s[i] = fmaf(a[(size_t)i * k + p], b[p], s[i]);
    } else {
        for (int i = 0; i < rows; i++)
            for (int p = 0; p < k; p++) {
                s[i] = fmaf(a[(size_t)i * k + p], b[p], s[i]);
                if (half_acc) s[i] = f16_to_f32(f32_to_f16(s[i]));
            }
    }
    for (int i = 0; i < rows; i++) acc[i] = s[i];
}

void run_gemm(const gemm &g) {
    double alpha = g.alpha, beta = g.beta;
    std::vector<float> a((size_t)g.m * g.k), b((size_t)g.n * g.k);
    std::vector<double> a64, b64;
    if (g.device_scalars) {
        alpha = load(g.alpha_p, g.f64 ? CUDA_R_64F : g.half_acc ? CUDA_R_16F : CUDA_R_32F, 0);
        beta = load(g.beta_p, g.f64 ? CUDA_R_64F : g.half_acc ? CUDA_R_16F : CUDA_R_32F, 0);
    }
    if (g.f64) {
        a64.resize(a.size());
        b64.resize(b.size());
    }
    for (int bi = 0; bi < g.batch; bi++) {
        const char *A = (const char *)g.A + (ptrdiff_t)bi * g.sa * (ptrdiff_t)type_size(g.at);
        const char *B = (const char *)g.B + (ptrdiff_t)bi * g.sb * (ptrdiff_t)type_size(g.bt);
        char *C = (char *)g.C + (ptrdiff_t)bi * g.sc * (ptrdiff_t)type_size(g.ct);
        /* op(A) as rows of k, op(B)^T as rows of k: the inner loop runs over contiguous memory */
        for (int i = 0; i < g.m; i++)
            for (int p = 0; p < g.k; p++) {
                double v = load(A, g.at, at_index(g.ta, i, p, g.lda));
                if (g.f64) a64[(size_t)i * g.k + p] = v;
                else a[(size_t)i * g.k + p] = (float)v;
            }
        for (int j = 0; j < g.n; j++)
            for (int p = 0; p < g.k; p++) {
                double v = load(B, g.bt, at_index(g.tb, p, j, g.ldb));
                if (g.f64) b64[(size_t)j * g.k + p] = v;
                else b[(size_t)j * g.k + p] = (float)v;
            }
        for (int j = 0; j < g.n; j++)
            for (int i0 = 0; i0 < g.m; i0 += kRows) {
                int rows = g.m - i0 < kRows ? g.m - i0 : kRows;
                double r[kRows];
                if (g.f64) {
                    for (int i = 0; i < rows; i++) {
                        double acc = 0;
                        for (int p = 0; p < g.k; p++)
                            acc = fma(a64[(size_t)(i0 + i) * g.k + p], b64[(size_t)j * g.k + p], acc);
                        r[i] = alpha * acc;
                    }
                } else {
                    float acc[kRows];
                    dot_rows(acc, rows, a.data() + (size_t)i0 * g.k, b.data() + (size_t)j * g.k, g.k, g.half_acc);
                    for (int i = 0; i < rows; i++) r[i] = (float)alpha * acc[i];
                }
                for (int i = 0; i < rows; i++) {
                    size_t ci = (size_t)(i0 + i) + (size_t)j * g.ldc;
                    if (beta != 0.0) /* beta 0: C is not read */
                        r[i] = g.f64 ? fma(beta, load(C, g.ct, ci), r[i])
                                     : fmaf((float)beta, (float)load(C, g.ct, ci), (float)r[i]);
                    store(C, g.ct, ci, r[i]);
                }
            }
    }
}

/* Extent in elements of `batch` column-major matrices rows x cols (as stored). */
size_t extent(int rows, int cols, int ld, long long stride, int batch) {
    if (!rows || !cols || !batch) return 0;
    return (size_t)(cols - 1) * ld + rows + (size_t)(batch - 1) * (size_t)(stride < 0 ? 0 : stride);
}

cublasStatus_t gemm_issue(cublasHandle_t h, gemm g, cublasComputeType_t compute, const char *fn) {
    stream *s;
    cudaError_t err;
    if (!live(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if ((g.ta != CUBLAS_OP_N && g.ta != CUBLAS_OP_T && g.ta != CUBLAS_OP_C) || (g.tb != CUBLAS_OP_N && g.tb != CUBLAS_OP_T && g.tb != CUBLAS_OP_C) ||
        g.m < 0 || g.n < 0 || g.k < 0 || g.batch < 0 || g.lda < (g.ta == CUBLAS_OP_N ? (g.m > 1 ? g.m : 1) : (g.k > 1 ? g.k : 1)) ||
        g.ldb < (g.tb == CUBLAS_OP_N ? (g.k > 1 ? g.k : 1) : (g.n > 1 ? g.n : 1)) || g.ldc < (g.m > 1 ? g.m : 1) || !g.alpha_p || !g.beta_p)
        return CUBLAS_STATUS_INVALID_VALUE;
    switch (compute) {
    case CUBLAS_COMPUTE_32F:
    case CUBLAS_COMPUTE_32F_PEDANTIC:
    case CUBLAS_COMPUTE_32F_FAST_16F:
    case CUBLAS_COMPUTE_32F_FAST_16BF:
    case CUBLAS_COMPUTE_32F_FAST_TF32:
        if (g.at != g.bt || !(g.at == CUDA_R_32F || g.at == CUDA_R_16F || g.at == CUDA_R_16BF) || !(g.ct == g.at || g.ct == CUDA_R_32F))
            return CUBLAS_STATUS_NOT_SUPPORTED;
        break;
    case CUBLAS_COMPUTE_64F:
    case CUBLAS_COMPUTE_64F_PEDANTIC:
        if (g.at != CUDA_R_64F || g.bt != CUDA_R_64F || g.ct != CUDA_R_64F) return CUBLAS_STATUS_NOT_SUPPORTED;
        g.f64 = true;
        break;
    case CUBLAS_COMPUTE_16F:
    case CUBLAS_COMPUTE_16F_PEDANTIC:
        if (g.at != CUDA_R_16F || g.bt != CUDA_R_16F || g.ct != CUDA_R_16F) return CUBLAS_STATUS_NOT_SUPPORTED;
        g.half_acc = true;
        break;
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (!(s = get_stream(h->stream, &err))) {
        fault("%s: the handle's stream %p is not a live stream", fn, (void *)h->stream);
        return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    if (h->device != current_device() || stream_device(s) != h->device) {
        fault("%s: handle of device %d used while device %d is current (stream of device %d)", fn, h->device, current_device(),
              stream_device(s));
        return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    if (g.m == 0 || g.n == 0 || g.batch == 0) return CUBLAS_STATUS_SUCCESS;
    {
        size_t ea = type_size(g.at), eb = type_size(g.bt), ec = type_size(g.ct);
        int ar = g.ta == CUBLAS_OP_N ? g.m : g.k, ac = g.ta == CUBLAS_OP_N ? g.k : g.m;
        int br = g.tb == CUBLAS_OP_N ? g.k : g.n, bc = g.tb == CUBLAS_OP_N ? g.n : g.k;
        char what[160];
        snprintf(what, sizeof what, "%s A", fn);
        if (g.k && !device_range_ok(what, g.A, extent(ar, ac, g.lda, g.sa, g.batch) * ea, h->device)) return CUBLAS_STATUS_EXECUTION_FAILED;
        snprintf(what, sizeof what, "%s B", fn);
        if (g.k && !device_range_ok(what, g.B, extent(br, bc, g.ldb, g.sb, g.batch) * eb, h->device)) return CUBLAS_STATUS_EXECUTION_FAILED;
        snprintf(what, sizeof what, "%s C", fn);
        if (!device_range_ok(what, g.C, extent(g.m, g.n, g.ldc, g.sc, g.batch) * ec, h->device)) return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    g.device_scalars = h->pointer_mode == CUBLAS_POINTER_MODE_DEVICE;
    if (!g.device_scalars) { /* host scalars are read when the call is made */
        cudaDataType st = g.f64 ? CUDA_R_64F : g.half_acc ? CUDA_R_16F : CUDA_R_32F;
        g.alpha = load(g.alpha_p, st, 0);
        g.beta = load(g.beta_p, st, 0);
    } else if (!device_range_ok(fn, g.alpha_p, type_size(g.f64 ? CUDA_R_64F : CUDA_R_32F), h->device) ||
               !device_range_ok(fn, g.beta_p, type_size(g.f64 ? CUDA_R_64F : CUDA_R_32F), h->device)) {
        return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    return issue_op(s, fn, [g]() { run_gemm(g); }) == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}

} // namespace

extern "C" {

cublasStatus_t cublasCreate(cublasHandle_t *handle) {
    int dev = 0;
    if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return CUBLAS_STATUS_NOT_INITIALIZED;
    }
    cublasContext *c = new cublasContext{dev, nullptr, CUBLAS_DEFAULT_MATH, CUBLAS_POINTER_MODE_HOST, nullptr, 0};
    std::lock_guard<std::mutex> g(g_handles_mu);
    if (!g_handles) g_handles = new std::set<cublasContext *>();
    g_handles->insert(c);
    *handle = c;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t h) {
    {
        std::lock_guard<std::mutex> g(g_handles_mu);
        if (!g_handles || !g_handles->erase(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    }
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetVersion(cublasHandle_t h, int *version) {
    if (!live(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!version) return CUBLAS_STATUS_INVALID_VALUE;
    *version = 130000;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t stream) {
    cudaError_t e;
    if (!live(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!get_stream(stream, &e)) return CUBLAS_STATUS_INVALID_VALUE;
    h->stream = stream;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream(cublasHandle_t h, cudaStream_t *stream) {
    if (!live(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!stream) return CUBLAS_STATUS_INVALID_VALUE;
    *stream = h->stream;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace(cublasHandle_t h, void *workspace, size_t bytes) {
    if (!live(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (bytes && !device_range_ok("cublasSetWorkspace", workspace, bytes, h->device)) return CUBLAS_STATUS_INVALID_VALUE;
    h->workspace = workspace;
    h->workspace_bytes = bytes;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t mode) {
    if (!live(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    h->math = mode;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetMathMode(cublasHandle_t h, cublasMath_t *mode) {
    if (!live(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!mode) return CUBLAS_STATUS_INVALID_VALUE;
    *mode = h->math;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetPointerMode(cublasHandle_t h, cublasPointerMode_t mode) {
    if (!live(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (mode != CUBLAS_POINTER_MODE_HOST && mode != CUBLAS_POINTER_MODE_DEVICE) return CUBLAS_STATUS_INVALID_VALUE;
    h->pointer_mode = mode;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetPointerMode(cublasHandle_t h, cublasPointerMode_t *mode) {
    if (!live(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!mode) return CUBLAS_STATUS_INVALID_VALUE;
    *mode = h->pointer_mode;
    return CUBLAS_STATUS_SUCCESS;
}

const char *cublasGetStatusName(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    }
    return "CUBLAS_STATUS_UNKNOWN";
}

const char *cublasGetStatusString(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "the resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "an invalid numeric value was used as an argument";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "an absent device architectural feature is required";
    case CUBLAS_STATUS_MAPPING_ERROR: return "an access to GPU memory space failed";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "an internal operation failed";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
    }
    return "unknown error";
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                          const void *alpha, const void *A, cudaDataType at, int lda, long long sa, const void *B,
                                          cudaDataType bt, int ldb, long long sb, const void *beta, void *C, cudaDataType ct, int ldc,
                                          long long sc, int batch, cublasComputeType_t compute, cublasGemmAlgo_t algo) {
    gemm g;
    (void)algo;
    memset(&g, 0, sizeof g);
    g.ta = ta == CUBLAS_OP_C ? CUBLAS_OP_T : ta;
    g.tb = tb == CUBLAS_OP_C ? CUBLAS_OP_T : tb;
    g.m = m, g.n = n, g.k = k, g.lda = lda, g.ldb = ldb, g.ldc = ldc, g.batch = batch;
    g.sa = sa, g.sb = sb, g.sc = sc;
    g.A = A, g.B = B, g.C = C, g.alpha_p = alpha, g.beta_p = beta;
    g.at = at, g.bt = bt, g.ct = ct;
    if (ta != CUBLAS_OP_N && ta != CUBLAS_OP_T && ta != CUBLAS_OP_C) g.ta = ta;
    if (tb != CUBLAS_OP_N && tb != CUBLAS_OP_T && tb != CUBLAS_OP_C) g.tb = tb;
    return gemm_issue(h, g, compute, "cublasGemmStridedBatchedEx");
}

cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void *alpha,
                            const void *A, cudaDataType at, int lda, const void *B, cudaDataType bt, int ldb, const void *beta, void *C,
                            cudaDataType ct, int ldc, cublasComputeType_t compute, cublasGemmAlgo_t algo) {
    return cublasGemmStridedBatchedEx(h, ta, tb, m, n, k, alpha, A, at, lda, 0, B, bt, ldb, 0, beta, C, ct, ldc, 0, 1, compute, algo);
}

cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const float *alpha,
                           const float *A, int lda, const float *B, int ldb, const float *beta, float *C, int ldc) {
    return cublasGemmStridedBatchedEx(h, ta, tb, m, n, k, alpha, A, CUDA_R_32F, lda, 0, B, CUDA_R_32F, ldb, 0, beta, C, CUDA_R_32F,
                                      ldc, 0, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                         const float *alpha, const float *A, int lda, long long sa, const float *B, int ldb,
                                         long long sb, const float *beta, float *C, int ldc, long long sc, int batch) {
    return cublasGemmStridedBatchedEx(h, ta, tb, m, n, k, alpha, A, CUDA_R_32F, lda, sa, B, CUDA_R_32F, ldb, sb, beta, C, CUDA_R_32F,
                                      ldc, sc, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

} // extern "C"
