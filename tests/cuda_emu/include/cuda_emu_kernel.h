/* cuda_emu_kernel.h - the CUDA kernel language for host C++ (included by cuda_runtime.h).

   Kernels keep their CUDA source: __global__/__device__ functions become host functions,
   threadIdx/blockIdx/blockDim/gridDim read the running fiber's coordinates, __shared__
   variables live in one ELF section (cuda_emu_shared) that the emulator refills with 0xff
   bytes before every block, so a read before the first write shows as NaN or -1. Barriers,
   warp intrinsics and the launch call into tests/cuda_emu/kernel.cpp. */
#ifndef CUDA_EMU_KERNEL_H
#define CUDA_EMU_KERNEL_H

#include <math.h>
#include <string.h>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static __attribute__((section("cuda_emu_shared")))

struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};
static constexpr int warpSize = 32;

namespace cuda_emu {

/* Coordinates of the CUDA thread whose fiber runs now. */
struct thread_ctx {
    uint3 tid, bid;
    dim3 bdim, gdim;
};
extern __thread thread_ctx *cur;

enum warp_kind { WARP_SHFL, WARP_SHFL_XOR, WARP_SHFL_UP, WARP_SHFL_DOWN, WARP_BALLOT, WARP_ANY, WARP_ALL, WARP_SYNC };
enum bar_kind { BAR_SYNC, BAR_OR, BAR_AND, BAR_COUNT };

/* Every lane in `mask` must reach the same intrinsic (same kind and mask); the values are
   exchanged when the last one arrives. Reading a lane outside the mask, a lane that left
   the kernel, or mixing intrinsics is a fault. */
uint64_t warp_op(int kind, unsigned mask, uint64_t value, int arg, int width, const char *file, int line);
/* __syncthreads and its reductions: every thread of the block, at the same call site. */
int block_op(int kind, int pred, const char *file, int line);
void *dynamic_shared();

/* One launch: configuration and the type-erased kernel call. */
struct launch_base {
    const char *name = "";
    dim3 grid, block;
    size_t shmem = 0;
    int device = 0;   /* of the stream it was issued on */
    int bad_args = 0; /* pointer arguments the launch check rejected */
    virtual ~launch_base() {}
    virtual void run_thread() = 0;   /* the kernel body of the current thread */
    virtual void check_args() = 0;   /* pointer arguments against the memory map */
};
void check_pointer_arg(const launch_base &l, size_t index, const void *p);
cudaError_t submit_launch(std::shared_ptr<launch_base> l, cudaStream_t stream);

template <class... P> struct launch_impl final : launch_base {
    void (*fn)(P...);
    std::tuple<typename std::decay<P>::type...> args;
    template <class... A> explicit launch_impl(void (*f)(P...), A &&...a) : fn(f), args(std::forward<A>(a)...) {}
    void run_thread() override { std::apply(fn, args); }
    void check_args() override { check_each(std::index_sequence_for<P...>{}); }
    template <size_t... I> void check_each(std::index_sequence<I...>) { (check_one(I, std::get<I>(args)), ...); }
    template <class T> void check_one(size_t i, const T &v) {
        if constexpr (std::is_pointer<T>::value) check_pointer_arg(*this, i, (const void *)v);
        else (void)i, (void)v;
    }
};

template <class T> inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "warp values are at most 8 bytes");
    uint64_t b = 0;
    memcpy(&b, &v, sizeof v);
    return b;
}
template <class T> inline T from_bits(uint64_t b) {
    T v;
    memcpy(&v, &b, sizeof v);
    return v;
}

} // namespace cuda_emu

/* The launch: kernel<<<grid, block, shmem, stream>>>(args...) as a call. Arguments are
   converted to the kernel's parameter types and copied, as CUDA does. */
template <class... P, class... A>
inline void cuda_emu_launch(const char *name, void (*fn)(P...), dim3 grid, dim3 block, size_t shmem, cudaStream_t stream,
                            A &&...args) {
    static_assert(sizeof...(P) == sizeof...(A), "kernel called with the wrong number of arguments");
    std::shared_ptr<cuda_emu::launch_impl<P...>> l = std::make_shared<cuda_emu::launch_impl<P...>>(fn, std::forward<A>(args)...);
    l->name = name;
    l->grid = grid;
    l->block = block;
    l->shmem = shmem;
    (void)cuda_emu::submit_launch(l, stream);
}
/* extern __shared__ T name[] of a launch's dynamic shared memory. */
#define CUDA_EMU_DYNAMIC_SHARED(T, name) T *name = (T *)cuda_emu::dynamic_shared()

#define threadIdx (cuda_emu::cur->tid)
#define blockIdx (cuda_emu::cur->bid)
#define blockDim (cuda_emu::cur->bdim)
#define gridDim (cuda_emu::cur->gdim)

#define CUDA_EMU_SITE const char *cuda_emu_file = __builtin_FILE(), int cuda_emu_line = __builtin_LINE()
#define CUDA_EMU_AT cuda_emu_file, cuda_emu_line

/* ---------------------------------------------------------------- barriers and warp intrinsics */

inline void __syncthreads(CUDA_EMU_SITE) { cuda_emu::block_op(cuda_emu::BAR_SYNC, 1, CUDA_EMU_AT); }
inline int __syncthreads_or(int pred, CUDA_EMU_SITE) { return cuda_emu::block_op(cuda_emu::BAR_OR, pred, CUDA_EMU_AT); }
inline int __syncthreads_and(int pred, CUDA_EMU_SITE) { return cuda_emu::block_op(cuda_emu::BAR_AND, pred, CUDA_EMU_AT); }
inline int __syncthreads_count(int pred, CUDA_EMU_SITE) { return cuda_emu::block_op(cuda_emu::BAR_COUNT, pred, CUDA_EMU_AT); }
inline void __syncwarp(unsigned mask = 0xffffffffu, CUDA_EMU_SITE) { cuda_emu::warp_op(cuda_emu::WARP_SYNC, mask, 0, 0, 32, CUDA_EMU_AT); }

template <class T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32, CUDA_EMU_SITE) {
    return cuda_emu::from_bits<T>(cuda_emu::warp_op(cuda_emu::WARP_SHFL, mask, cuda_emu::to_bits(v), src, width, CUDA_EMU_AT));
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32, CUDA_EMU_SITE) {
    return cuda_emu::from_bits<T>(cuda_emu::warp_op(cuda_emu::WARP_SHFL_XOR, mask, cuda_emu::to_bits(v), lane_mask, width, CUDA_EMU_AT));
}
template <class T> inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32, CUDA_EMU_SITE) {
    return cuda_emu::from_bits<T>(cuda_emu::warp_op(cuda_emu::WARP_SHFL_UP, mask, cuda_emu::to_bits(v), (int)delta, width, CUDA_EMU_AT));
}
template <class T> inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32, CUDA_EMU_SITE) {
    return cuda_emu::from_bits<T>(cuda_emu::warp_op(cuda_emu::WARP_SHFL_DOWN, mask, cuda_emu::to_bits(v), (int)delta, width, CUDA_EMU_AT));
}
inline unsigned __ballot_sync(unsigned mask, int pred, CUDA_EMU_SITE) {
    return (unsigned)cuda_emu::warp_op(cuda_emu::WARP_BALLOT, mask, pred != 0, 0, 32, CUDA_EMU_AT);
}
inline int __any_sync(unsigned mask, int pred, CUDA_EMU_SITE) {
    return (int)cuda_emu::warp_op(cuda_emu::WARP_ANY, mask, pred != 0, 0, 32, CUDA_EMU_AT);
}
inline int __all_sync(unsigned mask, int pred, CUDA_EMU_SITE) {
    return (int)cuda_emu::warp_op(cuda_emu::WARP_ALL, mask, pred != 0, 0, 32, CUDA_EMU_AT);
}
inline void __threadfence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

/* ---------------------------------------------------------------- atomics */

#define CUDA_EMU_ATOMIC_INT(T)                                                                          \
    inline T atomicAdd(T *a, T v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }              \
    inline T atomicSub(T *a, T v) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); }              \
    inline T atomicExch(T *a, T v) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); }            \
    inline T atomicAnd(T *a, T v) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); }              \
    inline T atomicOr(T *a, T v) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }                \
    inline T atomicXor(T *a, T v) { return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); }              \
    inline T atomicCAS(T *a, T cmp, T v) {                                                              \
        __atomic_compare_exchange_n(a, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);             \
        return cmp;                                                                                     \
    }                                                                                                   \
    inline T atomicMax(T *a, T v) {                                                                     \
        T old = __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                   \
        while (old < v && !__atomic_compare_exchange_n(a, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) { \
        }                                                                                               \
        return old;                                                                                     \
    }                                                                                                   \
    inline T atomicMin(T *a, T v) {                                                                     \
        T old = __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                   \
        while (old > v && !__atomic_compare_exchange_n(a, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) { \
        }                                                                                               \
        return old;                                                                                     \
    }
CUDA_EMU_ATOMIC_INT(int)
CUDA_EMU_ATOMIC_INT(unsigned int)
CUDA_EMU_ATOMIC_INT(long long)
CUDA_EMU_ATOMIC_INT(unsigned long long)
#undef CUDA_EMU_ATOMIC_INT

template <class F> inline F cuda_emu_atomic_float_add(F *a, F v) {
    F old = *a, want;
    do want = old + v;
    while (!__atomic_compare_exchange(a, &old, &want, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    return old;
}
inline float atomicAdd(float *a, float v) { return cuda_emu_atomic_float_add(a, v); }
inline double atomicAdd(double *a, double v) { return cuda_emu_atomic_float_add(a, v); }
inline float atomicExch(float *a, float v) {
    float old;
    __atomic_exchange(a, &v, &old, __ATOMIC_SEQ_CST);
    return old;
}
inline unsigned atomicInc(unsigned *a, unsigned limit) {
    unsigned old = __atomic_load_n(a, __ATOMIC_SEQ_CST), want;
    do want = old >= limit ? 0 : old + 1;
    while (!__atomic_compare_exchange_n(a, &old, want, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    return old;
}
inline unsigned atomicDec(unsigned *a, unsigned limit) {
    unsigned old = __atomic_load_n(a, __ATOMIC_SEQ_CST), want;
    do want = (old == 0 || old > limit) ? limit : old - 1;
    while (!__atomic_compare_exchange_n(a, &old, want, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    return old;
}

/* ---------------------------------------------------------------- device math */

inline unsigned __float_as_uint(float x) { return cuda_emu::from_bits<unsigned>(cuda_emu::to_bits(x)); }
inline float __uint_as_float(unsigned x) { return cuda_emu::from_bits<float>(x); }
inline int __float_as_int(float x) { return cuda_emu::from_bits<int>(cuda_emu::to_bits(x)); }
inline float __int_as_float(int x) { return cuda_emu::from_bits<float>((uint32_t)x); }
inline long long __double_as_longlong(double x) { return (long long)cuda_emu::to_bits(x); }
inline double __longlong_as_double(long long x) { return cuda_emu::from_bits<double>((uint64_t)x); }
/* Single roundings: the kernels are compiled with -ffp-contract=off, so no operation fuses. */
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __saturatef(float x) { return x != x ? 0.0f : x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; i++) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
template <class T> inline T __ldg(const T *p) { return *p; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

#endif /* CUDA_EMU_KERNEL_H */
