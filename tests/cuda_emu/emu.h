/* emu.h - internals of the CPU emulation of CUDA, cuBLAS and NCCL (tests/cuda_emu).

   The machine model, which the GPU tests run against in `make test`:
   - Devices: CUDA_EMU_DEVICES of them (default 4), each with 4 GiB of device memory in one
     reserved mapping of its own, so any pointer can be told apart: device memory (which
     device, which allocation, how far into it), freed device memory, pinned or managed host
     memory, or plain host memory. Outside device work the whole mapping is PROT_NONE, so a
     host dereference of a device pointer is a SIGSEGV (CUDA_EMU_PROTECT=0 turns this off).
     Allocations are 256-byte aligned, filled with 0xff bytes (NaN, -1) when made and 0xdd
     when freed, and followed by a red zone: poisoned for ASan in sanitizer builds, else a
     canary checked after every kernel and at every free. Freed memory waits in a quarantine
     before it is reused.
   - Streams: each stream has a worker thread that runs its operations in order, after the
     events they wait on; the host never runs device work itself, so a missing
     synchronisation shows up as a race as it would on a GPU. The legacy default stream
     synchronises with blocking streams, as in CUDA. Copies from pageable host memory are
     staged when issued; copies into pageable host memory return when done (CUDA's rules).
   - Kernels: one kernel runs at a time (static __shared__ variables live in one section).
     Blocks run in a random order; every thread of a block is a fiber that runs until it
     reaches a barrier, a warp intrinsic or its end; the next fiber is drawn at random among
     the runnable ones, from a generator seeded by CUDA_EMU_SEED and the launch number, and
     the fiber that stopped switches to it directly.
     A warp intrinsic completes when every lane in its mask has arrived; a barrier when
     every thread of the block has. Misuse is a fault (see cuda_runtime.h): the kernel stops,
     the error is reported at the next synchronising call on the device.
   - Warp matrix functions (include/mma.h, wmma.cpp): fragments spread over the warp's lanes in a
     layout drawn from the seed; load, store and mma are warp-collective with CUDA's argument rules.
   - Graphs: a capture records the issued operations; a launch issues them again in order.
   Faults are printed on stderr as they happen and counted; the exit report prints the
   launch counts, writes them to $CUDA_EMU_COVERAGE_DIR when set, and turns the exit
   status to 3 when faults were left unacknowledged. */
#ifndef CUDA_EMU_EMU_H
#define CUDA_EMU_EMU_H

#include "cuda_bf16.h"
#include "cuda_runtime.h"

#include <atomic>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define CUDA_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CUDA_EMU_ASAN 1
#endif
#endif

#if defined(__GNUC__)
#define CUDA_EMU_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define CUDA_EMU_PRINTF(f, a)
#endif

namespace cuda_emu {

/* ---------------------------------------------------------------- process (runtime.cpp) */

void ensure_init();                 /* idempotent: environment, device memory, exit report */
int num_devices();
int current_device();               /* of the calling host thread */
/* splitmix64; inline: the scheduler draws one at every thread switch */
inline uint64_t next_random(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
double now_s();

/* ---------------------------------------------------------------- errors and faults (runtime.cpp) */

cudaError_t set_error(cudaError_t e);   /* the calling thread's last error; returns e */
/* An API call that fails: sets the last error and keeps the detail for cudaGetErrorString. */
cudaError_t fail(cudaError_t e, const char *fmt, ...) CUDA_EMU_PRINTF(2, 3);
/* A misuse the emulator detected: printed, counted, kept as the last fault. */
void fault(const char *fmt, ...) CUDA_EMU_PRINTF(1, 2);
/* An error raised while device work ran: returned by the next synchronising call. */
void device_error(int device, cudaError_t e);
cudaError_t take_device_error(int device);

/* ---------------------------------------------------------------- memory (memory.cpp) */

enum mem_class { MEM_HOST, MEM_DEVICE, MEM_FREED, MEM_PINNED, MEM_MANAGED };
struct mem_info {
    mem_class cls;
    int device;       /* MEM_DEVICE, MEM_FREED */
    const char *base; /* the allocation (MEM_DEVICE, MEM_PINNED, MEM_MANAGED) */
    size_t size;      /* its size in bytes */
};
void memory_init(int devices);
mem_info classify(const void *p);
const char *mem_class_name(mem_class c);
/* [p, p + n) inside one live allocation of `device` (-1: any device; managed memory counts);
   else a fault naming `what` and false. n == 0 is always fine. */
bool device_range_ok(const char *what, const void *p, size_t n, int device);
/* p is not device memory (live or freed); else a fault naming `what` and false. */
bool host_range_ok(const char *what, const void *p, size_t n);
void *device_alloc(int device, size_t n); /* NULL when the device is full */
bool device_free(const void *p, const char *what); /* a fault and false for a pointer that is not an allocation */
bool check_red_zones(const char *after);  /* canaries of every live allocation (not under ASan); false: overrun */
size_t device_capacity();
size_t device_used(int device);
void *host_alloc(size_t n, mem_class cls);
bool host_free(void *p, mem_class cls);
bool host_register(void *p, size_t n);
bool host_unregister(void *p);
/* While one exists, device memory is readable and writable (it is PROT_NONE otherwise). */
struct device_access {
    device_access();
    ~device_access();
    device_access(const device_access &) = delete;
    device_access &operator=(const device_access &) = delete;
};

/* ---------------------------------------------------------------- streams (runtime.cpp) */

struct token {
    std::atomic<bool> done{false};
    double time = 0;
};
using token_ptr = std::shared_ptr<token>;
using op_fn = std::function<void()>;
/* Makes the operation when it is issued: at once, or at every launch of a captured graph
   (NCCL takes its place in the communicator's order at issue). */
using op_maker = std::function<op_fn()>;

struct stream;
/* The stream behind a handle (0 and cudaStreamLegacy: the current device's legacy stream);
   NULL and *err set for a handle that is not a live stream. */
stream *get_stream(cudaStream_t s, cudaError_t *err);
int stream_device(const stream *s);
bool stream_capturing(const stream *s);
/* Issues an operation on s (to run after `deps`; *done gets its token), or records it when s
   is capturing (then *done stays empty). */
cudaError_t issue(stream *s, const char *what, op_maker make, const std::vector<token_ptr> &deps = {}, token_ptr *done = nullptr);
cudaError_t issue_op(stream *s, const char *what, op_fn fn, token_ptr *done = nullptr);
/* Blocks until the work issued on s so far has run. */
void wait_stream(stream *s);
void wait_token(const token_ptr &t);
/* A call CUDA forbids while a capture is active (global mode anywhere, thread-local mode on
   this thread): invalidates those captures and returns true. */
bool capture_forbids(const char *what);

/* ---------------------------------------------------------------- numbers (cublas.cpp) */

/* Round-to-nearest-even conversions, NaN kept a NaN; e4m3 saturates to +-448 (no infinity). */
unsigned short f32_to_f16(float f);
float f16_to_f32(unsigned short h);
unsigned short f32_to_bf16(float f); /* bf16_to_f32: inline, include/cuda_bf16.h */
unsigned char f32_to_e4m3(float f);
float e4m3_to_f32(unsigned char b);
unsigned char f32_to_e5m2(float f);
float e5m2_to_f32(unsigned char b);

/* ---------------------------------------------------------------- kernels (kernel.cpp) */

struct launch_base;
cudaError_t run_kernel(launch_base &l, int device); /* runs every block; cudaSuccess or the fault's error */
void count_launch(const char *name);
void write_launch_counts(FILE *out, const char *prefix); /* "prefix name count" lines */
int64_t launch_total();
int64_t kernel_count();

} // namespace cuda_emu

#endif /* CUDA_EMU_EMU_H */
