/* kernel.cpp - kernel execution of the CUDA emulation: fibers (a hand-written context
   switch on x86-64, ucontext elsewhere), the block scheduler with barriers and warp
   intrinsics, launch checks, and the launch counts. */
#include "emu.h"

#include <map>
#include <numeric>
#include <mutex>
#include <stdarg.h>
#include <string.h>
#include <string>
#include <sys/mman.h>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif
#ifdef CUDA_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

extern "C" {
/* The static __shared__ variables of every kernel (the linker names the section's ends). */
extern char __start_cuda_emu_shared[] __attribute__((weak));
extern char __stop_cuda_emu_shared[] __attribute__((weak));
}

namespace cuda_emu {

__thread thread_ctx *cur;

/* ---------------------------------------------------------------- context switch */

#if defined(__x86_64__)
extern "C" void cuda_emu_switch(void **save_sp, void *to_sp);
extern "C" void cuda_emu_fiber_entry(void);
/* Saves the callee-saved registers and the FP control words on the current stack, stores
   the stack pointer in *save_sp, and resumes the stack at to_sp. A new fiber's stack is
   laid out so that the first switch "returns" into cuda_emu_fiber_entry with r12 = the
   argument and r13 = the function. */
asm(R"(
    .text
    .globl cuda_emu_switch
    .type cuda_emu_switch, @function
cuda_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cuda_emu_switch, .-cuda_emu_switch
    .globl cuda_emu_fiber_entry
    .type cuda_emu_fiber_entry, @function
cuda_emu_fiber_entry:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size cuda_emu_fiber_entry, .-cuda_emu_fiber_entry
)");
#endif

namespace {

#ifdef CUDA_EMU_ASAN
const size_t kStackBytes = (size_t)512 << 10;
#else
const size_t kStackBytes = (size_t)128 << 10;
#endif
const size_t kGuard = 4096;

struct fiber {
    char *map = nullptr; /* guard page, then the stack */
    void *sp = nullptr;
    void *fake = nullptr; /* ASan's fake stack while switched out */
#if !defined(__x86_64__)
    ucontext_t uc;
#endif
};

enum { T_RUN, T_WARP, T_BAR, T_DONE };

struct emu_thread {
    thread_ctx ctx;
    fiber *f;
    int state, lane, warp;
    int kind, arg, width, line;
    unsigned mask;
    uint64_t value, result;
    const char *file;
};

struct warp_state {
    bool active;
    int kind, line;
    unsigned mask, arrived, exited;
    const char *file;
};

struct block_run {
    launch_base *l;
    int device, n;
    std::vector<emu_thread> th;
    std::vector<warp_state> warps;
    std::vector<int> runnable;
    int ndone, nbar, bar_line, faults;
    const char *bar_file;
    bool divergent_reported, stuck;
    cudaError_t error;
    uint64_t rng;
    void *dyn_shared;
    size_t dyn_bytes;
};

/* Kernel execution state: one kernel at a time (g_kernel_mu). */
std::mutex g_kernel_mu;
std::vector<fiber *> &g_pool = *new std::vector<fiber *>(); /* never destroyed: workers may run past exit */
void *g_sched_sp;
block_run *g_block;
emu_thread *g_running;
#ifdef CUDA_EMU_ASAN
const void *g_sched_lo; /* the scheduler's stack, for ASan (as the fiber entered from it learns it) */
size_t g_sched_len;
bool g_from_sched;
#endif

std::mutex g_count_mu;
std::map<std::string, int64_t> *g_counts;
std::atomic<int64_t> g_launch_seq{0};

const char *warp_name(int kind) {
    static const char *names[] = {"__shfl_sync", "__shfl_xor_sync", "__shfl_up_sync", "__shfl_down_sync",
                                  "__ballot_sync", "__any_sync", "__all_sync", "__syncwarp"};
    return kind >= 0 && kind <= WARP_SYNC ? names[kind] : "a warp intrinsic";
}
const char *bar_name(int kind) {
    static const char *names[] = {"__syncthreads", "__syncthreads_or", "__syncthreads_and", "__syncthreads_count"};
    return kind >= 0 && kind <= BAR_COUNT ? names[kind] : "__syncthreads";
}
/* __FILE__ of two call sites: one literal in the common case, so the pointers decide before strcmp
   (a barrier or warp intrinsic compares them once per arriving thread). */
bool same_file(const char *a, const char *b) { return a == b || !strcmp(a, b); }
const char *base_name(const char *path) {
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

/* A fault inside the kernel: the message names the kernel, the block and the thread. */
void kfault(block_run &b, const emu_thread *t, cudaError_t code, const char *fmt, ...) CUDA_EMU_PRINTF(4, 5);
void kfault(block_run &b, const emu_thread *t, cudaError_t code, const char *fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (b.error == cudaSuccess) b.error = code;
    if (++b.faults > 4) return; /* the first few tell the story */
    if (t)
        fault("kernel %s, block (%u,%u,%u), thread (%u,%u,%u): %s", b.l->name, t->ctx.bid.x, t->ctx.bid.y, t->ctx.bid.z,
              t->ctx.tid.x, t->ctx.tid.y, t->ctx.tid.z, msg);
    else
        fault("kernel %s, block (%u,%u,%u): %s", b.l->name, b.th[0].ctx.bid.x, b.th[0].ctx.bid.y, b.th[0].ctx.bid.z, msg);
}

/* ---------------------------------------------------------------- fibers */

/* Fibers switch to one another: the thread that stops at a barrier, a warp intrinsic or its
   end does the scheduler's bookkeeping on its own stack and resumes the next runnable thread
   directly (one switch per stop, none when it picks itself). Only when nothing is runnable (the
   block is done, or stuck) does it switch back to the scheduler (run_block). */
void yield_thread(emu_thread *t);

/* ASan's side of arriving on a fiber's stack; the fiber entered from the scheduler records the
   scheduler's stack, which the switch back to it names. */
void arrived(void *fake) {
#ifdef CUDA_EMU_ASAN
    const void *lo;
    size_t len;
    __sanitizer_finish_switch_fiber(fake, &lo, &len);
    if (g_from_sched) {
        g_sched_lo = lo;
        g_sched_len = len;
        g_from_sched = false;
    }
#else
    (void)fake;
#endif
}

/* Leaves fiber f for thread `to` (nullptr: the scheduler); returns when f is resumed. */
void switch_from(fiber *f, emu_thread *to) {
    g_running = to;
    cur = to ? &to->ctx : nullptr;
#ifdef CUDA_EMU_ASAN
    __sanitizer_start_switch_fiber(&f->fake, to ? (const void *)(to->f->map + kGuard) : g_sched_lo,
                                   to ? kStackBytes : g_sched_len);
#endif
#if defined(__x86_64__)
    cuda_emu_switch(&f->sp, to ? to->f->sp : g_sched_sp);
#else
    swapcontext(&f->uc, to ? &to->f->uc : (ucontext_t *)g_sched_sp);
#endif
    arrived(f->fake);
}

/* The body of every fiber: run the assigned CUDA thread, report, wait for the next one. */
void fiber_main(fiber *) {
    arrived(nullptr);
    for (;;) {
        g_block->l->run_thread();
        g_running->state = T_DONE;
        yield_thread(g_running);
    }
}

#if !defined(__x86_64__)
void fiber_trampoline(unsigned hi, unsigned lo) { fiber_main((fiber *)(((uintptr_t)hi << 32) | lo)); }
#endif

fiber *fiber_new() {
    fiber *f = new fiber();
    f->map = (char *)mmap(nullptr, kGuard + kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (f->map == MAP_FAILED) {
        fprintf(stderr, "cuda_emu: cannot map a fiber stack\n");
        abort();
    }
    mprotect(f->map, kGuard, PROT_NONE);
#if defined(__x86_64__)
    {
        uintptr_t top = ((uintptr_t)(f->map + kGuard + kStackBytes)) & ~(uintptr_t)15;
        uint64_t *s = (uint64_t *)(top - 80);
        uint32_t mxcsr;
        uint16_t fpcw;
        __asm__ volatile("stmxcsr %0" : "=m"(mxcsr));
        __asm__ volatile("fnstcw %0" : "=m"(fpcw));
        memset(s, 0, 80);
        memcpy(&s[0], &mxcsr, 4);
        memcpy((char *)&s[0] + 4, &fpcw, 2);
        s[3] = (uint64_t)(uintptr_t)&fiber_main; /* r13 */
        s[4] = (uint64_t)(uintptr_t)f;           /* r12 */
        s[7] = (uint64_t)(uintptr_t)&cuda_emu_fiber_entry;
        f->sp = s;
    }
#else
    getcontext(&f->uc);
    f->uc.uc_stack.ss_sp = f->map + kGuard;
    f->uc.uc_stack.ss_size = kStackBytes;
    f->uc.uc_link = nullptr;
    makecontext(&f->uc, (void (*)())fiber_trampoline, 2, (unsigned)((uintptr_t)f >> 32), (unsigned)(uintptr_t)f);
#endif
    return f;
}

void fiber_delete(fiber *f) {
#ifdef CUDA_EMU_ASAN
    ASAN_UNPOISON_MEMORY_REGION(f->map + kGuard, kStackBytes);
#endif
    munmap(f->map, kGuard + kStackBytes);
    delete f;
}

/* From the scheduler: runs the block's threads from t on until nothing is runnable (the switch
   back, switch_from(..., nullptr), clears g_running and cur). */
void resume(emu_thread *t) {
    g_running = t;
    cur = &t->ctx;
#ifdef CUDA_EMU_ASAN
    void *fake = nullptr;
    g_from_sched = true;
    __sanitizer_start_switch_fiber(&fake, t->f->map + kGuard, kStackBytes);
#endif
#if defined(__x86_64__)
    cuda_emu_switch(&g_sched_sp, t->f->sp);
#else
    {
        ucontext_t here;
        g_sched_sp = &here;
        swapcontext(&here, &t->f->uc);
    }
#endif
#ifdef CUDA_EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

/* ---------------------------------------------------------------- warps and barriers */

unsigned lanes_present(const block_run &b, int warp) {
    int n = b.n - warp * 32;
    return n >= 32 ? 0xffffffffu : (1u << n) - 1;
}

void make_runnable(block_run &b, emu_thread &t) {
    t.state = T_RUN;
    b.runnable.push_back((int)(&t - &b.th[0]));
}

/* A random runnable thread, taken off the list; nullptr when none is. */
emu_thread *take_runnable(block_run &b) {
    if (b.runnable.empty()) return nullptr;
    size_t k = (size_t)(((unsigned __int128)next_random(&b.rng) * b.runnable.size()) >> 64);
    emu_thread *t = &b.th[(size_t)b.runnable[k]];
    b.runnable[k] = b.runnable.back();
    b.runnable.pop_back();
    return t;
}

/* Source lane of a shuffle (the lane itself when CUDA says so). */
int shuffle_source(int kind, int lane, int arg, int width) {
    int base = lane & ~(width - 1), pos = lane - base;
    switch (kind) {
    case WARP_SHFL: return base + (arg & (width - 1));
    case WARP_SHFL_XOR: {
        int s = lane ^ arg;
        return s >= base + width || s < 0 || s > 31 ? lane : s; /* later groups give the lane's own value */
    }
    case WARP_SHFL_UP: return pos - arg < 0 ? lane : lane - arg;
    case WARP_SHFL_DOWN: return pos + arg >= width ? lane : lane + arg;
    default: return lane;
    }
}

void resolve_warp(block_run &b, int wi) {
    warp_state &w = b.warps[wi];
    emu_thread *lanes = &b.th[(size_t)wi * 32];
    uint64_t ballot = 0;
    int all = 1;
    for (int l = 0; l < 32; l++)
        if (w.arrived & (1u << l)) {
            ballot |= (uint64_t)(lanes[l].value != 0) << l;
            all &= lanes[l].value != 0;
        }
    for (int l = 0; l < 32; l++) {
        if (!(w.arrived & (1u << l))) continue;
        emu_thread &t = lanes[l];
        switch (w.kind) {
        case WARP_BALLOT: t.result = ballot; break;
        case WARP_ANY: t.result = ballot != 0; break;
        case WARP_ALL: t.result = (uint64_t)all; break;
        case WARP_SYNC: t.result = 0; break;
        default: {
            int width = t.width, src;
            if (width < 1 || width > 32 || (width & (width - 1))) {
                kfault(b, &t, cudaErrorIllegalInstruction, "%s at %s:%d with width %d (a power of two up to 32)", warp_name(w.kind),
                       base_name(w.file), w.line, width);
                width = 32;
            }
            src = shuffle_source(w.kind, l, t.arg, width);
            if (src == l) t.result = t.value;
            else if (w.arrived & (1u << src)) t.result = lanes[src].value;
            else {
                kfault(b, &t, cudaErrorIllegalInstruction, "%s at %s:%d: lane %d reads lane %d, which %s (mask 0x%08x)",
                       warp_name(w.kind), base_name(w.file), w.line, l, src,
                       (w.mask & (1u << src)) ? "has exited" : "does not take part: it is not in the mask", w.mask);
                t.result = ~(uint64_t)0;
            }
        }
        }
        make_runnable(b, t);
    }
    w.active = false;
    w.arrived = 0;
}

void warp_check_complete(block_run &b, int wi) {
    warp_state &w = b.warps[wi];
    if (w.active && ((w.arrived | w.exited) & w.mask) == w.mask) resolve_warp(b, wi);
}

void on_warp_arrive(block_run &b, emu_thread &t) {
    warp_state &w = b.warps[t.warp];
    unsigned bit = 1u << t.lane, present = lanes_present(b, t.warp), mask = t.mask;
    if (!(mask & bit)) {
        kfault(b, &t, cudaErrorIllegalInstruction, "%s at %s:%d with mask 0x%08x, which leaves out the calling lane %d",
               warp_name(t.kind), base_name(t.file), t.line, mask, t.lane);
        mask |= bit;
    }
    if (mask & ~present) {
        kfault(b, &t, cudaErrorIllegalInstruction, "%s at %s:%d with mask 0x%08x names lanes beyond the block's %d threads",
               warp_name(t.kind), base_name(t.file), t.line, mask, b.n);
        mask &= present;
    }
    if (!w.active) {
        w.active = true;
        w.kind = t.kind;
        w.mask = mask;
        w.file = t.file;
        w.line = t.line;
        w.arrived = 0;
        if (w.exited & mask)
            kfault(b, &t, cudaErrorIllegalInstruction, "%s at %s:%d with mask 0x%08x, but lanes 0x%08x of the warp have exited",
                   warp_name(t.kind), base_name(t.file), t.line, mask, w.exited & mask);
    } else if (w.kind != t.kind || w.mask != mask || w.line != t.line || !same_file(w.file, t.file)) {
        kfault(b, &t, cudaErrorIllegalInstruction, "lanes of warp %d meet at different warp intrinsics: %s (mask 0x%08x) at %s:%d "
               "and %s (mask 0x%08x) at %s:%d", t.warp, warp_name(w.kind), w.mask, base_name(w.file), w.line, warp_name(t.kind),
               mask, base_name(t.file), t.line);
        w.mask |= mask;
    }
    w.arrived |= bit;
    warp_check_complete(b, t.warp);
}

void check_barrier(block_run &b) {
    if (b.nbar == 0 || b.nbar < b.n - b.ndone) return;
    if (b.ndone > 0 && !b.divergent_reported) {
        kfault(b, nullptr, cudaErrorIllegalInstruction, "__syncthreads at %s:%d is reached by %d threads while %d threads of the "
               "block have exited (a barrier in divergent code)", base_name(b.bar_file), b.bar_line, b.nbar, b.ndone);
        b.divergent_reported = true;
    }
    int count = 0, any = 0, all = 1;
    for (auto &t : b.th)
        if (t.state == T_BAR) {
            count += t.value != 0;
            any |= t.value != 0;
            all &= t.value != 0;
        }
    for (auto &t : b.th)
        if (t.state == T_BAR) {
            t.result = t.kind == BAR_OR ? any : t.kind == BAR_AND ? all : t.kind == BAR_COUNT ? count : 0;
            make_runnable(b, t);
        }
    b.nbar = 0;
}

void on_bar_arrive(block_run &b, emu_thread &t) {
    if (b.nbar == 0) {
        b.bar_file = t.file;
        b.bar_line = t.line;
    } else if (b.bar_line != t.line || !same_file(b.bar_file, t.file)) {
        kfault(b, &t, cudaErrorIllegalInstruction, "threads of the block wait at different barriers: %s at %s:%d and %s:%d",
               bar_name(t.kind), base_name(t.file), t.line, base_name(b.bar_file), b.bar_line);
    }
    b.nbar++;
    check_barrier(b);
}

void on_exit(block_run &b, emu_thread &t) {
    warp_state &w = b.warps[t.warp];
    unsigned bit = 1u << t.lane;
    b.ndone++;
    w.exited |= bit;
    if (w.active && (w.mask & bit) && !(w.arrived & bit))
        kfault(b, &t, cudaErrorIllegalInstruction, "lane %d exits while lanes 0x%08x of its warp wait for it in %s at %s:%d "
               "(mask 0x%08x)", t.lane, w.arrived, warp_name(w.kind), base_name(w.file), w.line, w.mask);
    warp_check_complete(b, t.warp);
    check_barrier(b);
}

/* Nothing can run, yet threads wait: describe the deadlock. */
void report_stuck(block_run &b) {
    std::string who;
    int at_bar = 0, at_warp = 0;
    for (auto &t : b.th) {
        if (t.state == T_BAR) at_bar++;
        if (t.state == T_WARP) at_warp++;
    }
    for (size_t wi = 0; wi < b.warps.size() && who.size() < 400; wi++) {
        const warp_state &w = b.warps[wi];
        if (!w.active) continue;
        char s[200];
        snprintf(s, sizeof s, "; warp %zu: lanes 0x%08x of mask 0x%08x in %s at %s:%d", wi, w.arrived, w.mask, warp_name(w.kind),
                 base_name(w.file), w.line);
        who += s;
    }
    kfault(b, nullptr, cudaErrorLaunchFailure, "deadlock: %d threads wait at a barrier%s%s, %d in warp intrinsics%s", at_bar,
           at_bar ? " at " : "", at_bar ? base_name(b.bar_file) : "", at_warp, who.c_str());
    b.stuck = true;
}

/* ---------------------------------------------------------------- blocks */

void run_block(block_run &b, uint3 bid) {
    const dim3 bd = b.l->block;
    b.ndone = b.nbar = 0;
    b.divergent_reported = false;
    b.runnable.clear();
    for (auto &w : b.warps) w = warp_state{false, 0, 0, 0, 0, 0, ""};
    for (int i = 0; i < b.n; i++) {
        emu_thread &t = b.th[(size_t)i];
        t.ctx.tid = uint3{(unsigned)i % bd.x, ((unsigned)i / bd.x) % bd.y, (unsigned)i / (bd.x * bd.y)};
        t.ctx.bid = bid;
        t.ctx.bdim = bd;
        t.ctx.gdim = b.l->grid;
        t.f = g_pool[(size_t)i];
        t.lane = i % 32;
        t.warp = i / 32;
        make_runnable(b, t);
    }
    if (+__start_cuda_emu_shared && +__stop_cuda_emu_shared > +__start_cuda_emu_shared)
        memset(__start_cuda_emu_shared, 0xff, (size_t)(__stop_cuda_emu_shared - __start_cuda_emu_shared));
    if (b.dyn_bytes) memset(b.dyn_shared, 0xff, b.dyn_bytes);
    /* The threads hand over to one another and come back here when none is runnable. */
    resume(take_runnable(b));
    if (b.ndone < b.n) report_stuck(b);
}

/* On t's fiber: t stopped (its state says where); record it and run the next runnable thread. */
void yield_thread(emu_thread *t) {
    block_run &b = *g_block;
    switch (t->state) {
    case T_DONE: on_exit(b, *t); break;
    case T_WARP: on_warp_arrive(b, *t); break;
    case T_BAR: on_bar_arrive(b, *t); break;
    default: break;
    }
    emu_thread *next = take_runnable(b);
    if (next == t) return;
    switch_from(t->f, next);
}

} // namespace

/* ---------------------------------------------------------------- called from kernels */

uint64_t warp_op(int kind, unsigned mask, uint64_t value, int arg, int width, const char *file, int line) {
    emu_thread *t = g_running;
    if (!t) {
        fault("%s at %s:%d called outside a kernel", warp_name(kind), base_name(file), line);
        return value;
    }
    t->kind = kind;
    t->mask = mask;
    t->value = value;
    t->arg = arg;
    t->width = width;
    t->file = file;
    t->line = line;
    t->state = T_WARP;
    yield_thread(t);
    return t->result;
}

int block_op(int kind, int pred, const char *file, int line) {
    emu_thread *t = g_running;
    if (!t) {
        fault("%s at %s:%d called outside a kernel", bar_name(kind), base_name(file), line);
        return pred;
    }
    t->kind = kind;
    t->value = (uint64_t)(pred != 0);
    t->file = file;
    t->line = line;
    t->state = T_BAR;
    yield_thread(t);
    return (int)t->result;
}

void *dynamic_shared() { return g_block ? g_block->dyn_shared : nullptr; }

/* ---------------------------------------------------------------- launches */

void check_pointer_arg(const launch_base &l, size_t index, const void *p) {
    if (!p) return;
    mem_info m = classify(p);
    if (m.cls == MEM_PINNED || m.cls == MEM_MANAGED) return;
    if (m.cls == MEM_DEVICE && m.device == l.device && (const char *)p <= m.base + m.size) return;
    if (m.cls == MEM_DEVICE && m.device != l.device)
        fault("kernel %s, argument %zu: %p is memory of device %d, but the kernel runs on device %d", l.name, index, p, m.device,
              l.device);
    else if (m.cls == MEM_DEVICE)
        fault("kernel %s, argument %zu: %p is %zu bytes past the end of the %zu-byte allocation at %p", l.name, index, p,
              (size_t)((const char *)p - (m.base + m.size)), m.size, (const void *)m.base);
    else
        fault("kernel %s, argument %zu: %p is %s, which a kernel cannot read", l.name, index, p, mem_class_name(m.cls));
    const_cast<launch_base &>(l).bad_args++;
}

/* cudaFuncAttributeMaxDynamicSharedMemorySize of each kernel that set it. */
std::mutex g_attr_mu;
std::map<const void *, size_t> *g_max_dyn;

size_t max_dynamic_shared(const void *fn) {
    std::lock_guard<std::mutex> g(g_attr_mu);
    if (g_max_dyn && fn) {
        auto it = g_max_dyn->find(fn);
        if (it != g_max_dyn->end()) return it->second;
    }
    return 48 * 1024;
}

cudaError_t submit_launch(std::shared_ptr<launch_base> l, cudaStream_t s) {
    cudaError_t err = cudaSuccess;
    const dim3 g = l->grid, b = l->block;
    uint64_t threads = (uint64_t)b.x * b.y * b.z;
    stream *st;
    ensure_init();
    if (!g.x || !g.y || !g.z || !threads || threads > 1024 || b.x > 1024 || b.y > 1024 || b.z > 64 || g.y > 65535 ||
        g.z > 65535 || g.x > 0x7fffffffu)
        return fail(cudaErrorInvalidConfiguration, "launch of %s with grid (%u,%u,%u) and block (%u,%u,%u)", l->name, g.x, g.y, g.z,
                    b.x, b.y, b.z);
    if (l->shmem > max_dynamic_shared(l->fn_addr))
        return fail(cudaErrorInvalidValue, "launch of %s with %zu bytes of dynamic shared memory (%zu allowed: 48 KiB unless "
                    "cudaFuncSetAttribute raised it, up to 227 KiB)", l->name, l->shmem, max_dynamic_shared(l->fn_addr));
    if (!(st = get_stream(s, &err))) return fail(err, "launch of %s on stream %p, which is not a live stream", l->name, (void *)s);
    l->device = stream_device(st);
    if (l->device != current_device())
        return fail(cudaErrorInvalidResourceHandle, "launch of %s on a stream of device %d while device %d is current", l->name,
                    l->device, current_device());
    l->check_args();
    if (l->bad_args) {
        device_error(l->device, cudaErrorIllegalAddress);
        return cudaSuccess; /* like a kernel that faults: the error comes at the next synchronisation */
    }
    return issue_op(st, l->name, [l]() {
        cudaError_t e = run_kernel(*l, l->device);
        if (e != cudaSuccess) device_error(l->device, e);
    });
}

cudaError_t run_kernel(launch_base &l, int device) {
    std::lock_guard<std::mutex> lock(g_kernel_mu);
    block_run b;
    const dim3 g = l.grid;
    uint64_t nblocks = (uint64_t)g.x * g.y * g.z, seq = (uint64_t)g_launch_seq.fetch_add(1), stride = 1, start = 0;
    std::vector<char> dyn(l.shmem ? l.shmem : 1);
    b.l = &l;
    b.device = device;
    b.n = (int)(l.block.x * l.block.y * l.block.z);
    b.th.assign((size_t)b.n, emu_thread());
    b.warps.assign((size_t)(b.n + 31) / 32, warp_state());
    b.faults = 0;
    b.error = cudaSuccess;
    b.stuck = false;
    b.rng = cuda_emu_seed() ^ (seq * 0x9E3779B97F4A7C15ull);
    b.dyn_shared = dyn.data();
    b.dyn_bytes = l.shmem;
    count_launch(l.name);
    while (g_pool.size() < (size_t)b.n) g_pool.push_back(fiber_new());
    g_block = &b;
    /* Blocks in a random order: a stride coprime with the count from a random start. */
    if (nblocks > 1) {
        start = next_random(&b.rng) % nblocks;
        do stride = 1 + next_random(&b.rng) % nblocks;
        while (std::gcd(stride, nblocks) != 1);
    }
    for (uint64_t k = 0; k < nblocks && b.error == cudaSuccess; k++) {
        uint64_t id = (start + k * stride) % nblocks;
        run_block(b, uint3{(unsigned)(id % g.x), (unsigned)(id / g.x % g.y), (unsigned)(id / ((uint64_t)g.x * g.y))});
        if (b.stuck) { /* the waiting fibers cannot be resumed: replace them */
            for (auto &t : b.th)
                if (t.state != T_DONE) {
                    fiber_delete(t.f);
                    g_pool[(size_t)(&t - &b.th[0])] = fiber_new();
                }
        }
    }
    g_block = nullptr;
    if (b.faults > 4) fprintf(stderr, "cuda_emu: kernel %s: %d more faults of this launch not shown\n", l.name, b.faults - 4);
    if (!check_red_zones(l.name) && b.error == cudaSuccess) b.error = cudaErrorIllegalAddress;
    return b.error;
}

void count_launch(const char *name) {
    std::lock_guard<std::mutex> g(g_count_mu);
    if (!g_counts) g_counts = new std::map<std::string, int64_t>();
    (*g_counts)[name]++;
}

void write_launch_counts(FILE *out, const char *prefix) {
    std::lock_guard<std::mutex> g(g_count_mu);
    if (!g_counts) return;
    for (auto &c : *g_counts) fprintf(out, "%s%s %lld\n", prefix, c.first.c_str(), (long long)c.second);
}

int64_t launch_total() {
    std::lock_guard<std::mutex> g(g_count_mu);
    int64_t n = 0;
    if (g_counts)
        for (auto &c : *g_counts) n += c.second;
    return n;
}

int64_t kernel_count() {
    std::lock_guard<std::mutex> g(g_count_mu);
    return g_counts ? (int64_t)g_counts->size() : 0;
}

} // namespace cuda_emu

extern "C" cudaError_t cudaFuncSetAttribute(const void *func, cudaFuncAttribute attr, int value) {
    cuda_emu::ensure_init();
    if (!func) return cuda_emu::fail(cudaErrorInvalidDeviceFunction, "cudaFuncSetAttribute: func is NULL");
    if (attr == cudaFuncAttributePreferredSharedMemoryCarveout) {
        if (value < -1 || value > 100) return cuda_emu::fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: carveout %d", value);
        return cudaSuccess;
    }
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize)
        return cuda_emu::fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: attribute %d", (int)attr);
    if (value < 0 || value > 227 * 1024)
        return cuda_emu::fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: %d bytes of dynamic shared memory (at most %d)", value,
                              227 * 1024);
    std::lock_guard<std::mutex> g(cuda_emu::g_attr_mu);
    if (!cuda_emu::g_max_dyn) cuda_emu::g_max_dyn = new std::map<const void *, size_t>();
    (*cuda_emu::g_max_dyn)[func] = (size_t)value;
    return cudaSuccess;
}

extern "C" int64_t cuda_emu_launches(const char *kernel) {
    std::lock_guard<std::mutex> g(cuda_emu::g_count_mu);
    if (!cuda_emu::g_counts) return 0;
    auto it = cuda_emu::g_counts->find(kernel);
    return it == cuda_emu::g_counts->end() ? 0 : it->second;
}
