/* runtime.cpp - the CUDA runtime of the emulation: process setup and exit report, errors
   and faults, devices, streams (a worker thread each), events, memory entry points, copies,
   and graph capture and replay. */
#include "emu.h"

#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <thread>
#include <time.h>
#include <unistd.h>

namespace cuda_emu {

/* ---------------------------------------------------------------- process */

namespace {

struct device_state {
    std::atomic<int> error{cudaSuccess};
    stream *legacy = nullptr;
};

struct process_state {
    uint64_t seed = 0;
    int devices = 0;
    device_state *dev = nullptr;
    std::atomic<int> faults{0};
    std::mutex fault_mu;
    std::string last_fault;
};

std::once_flag g_once;
process_state *P;

__thread cudaError_t t_last;
__thread int t_device;
__thread cudaError_t t_detail_code;
__thread char t_detail[768];
__thread char t_message[1024];

uint64_t env_u64(const char *name, uint64_t dflt) {
    const char *s = getenv(name);
    return s && *s ? strtoull(s, nullptr, 0) : dflt;
}

int visible_devices() {
    const char *v = getenv("CUDA_VISIBLE_DEVICES");
    int n = 0;
    if (v && !(getenv("CUDA_EMU_DEVICES") && *getenv("CUDA_EMU_DEVICES"))) {
        /* as many devices as the list names; an empty list hides them all */
        for (const char *p = v; *p;) {
            while (*p == ',' || *p == ' ') p++;
            if (!*p) break;
            n++;
            while (*p && *p != ',') p++;
        }
        return n;
    }
    n = (int)env_u64("CUDA_EMU_DEVICES", 4);
    return n < 1 ? 1 : n > 16 ? 16 : n;
}

void exit_report() {
    const char *dir = getenv("CUDA_EMU_COVERAGE_DIR");
    int faults = P->faults.load();
    if (dir && *dir) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s.%d", dir, program_invocation_short_name, (int)getpid());
        FILE *f = fopen(path, "w");
        if (f) {
            write_launch_counts(f, "");
            fclose(f);
        }
    }
    if (launch_total() || faults)
        printf("# cuda_emu: %lld kernel launches of %lld kernels, %d unacknowledged faults (seed %llu)\n", (long long)launch_total(),
               (long long)kernel_count(), faults, (unsigned long long)P->seed);
    if (faults > 0) {
        fprintf(stderr, "cuda_emu: %d faults were found and not acknowledged (last: %s); exit status 3\n", faults,
                P->last_fault.c_str());
        fflush(nullptr);
        _exit(3);
    }
}

} // namespace

void ensure_init() {
    std::call_once(g_once, [] {
        struct timespec ts;
        uint64_t mix;
        P = new process_state();
        clock_gettime(CLOCK_REALTIME, &ts);
        mix = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20) ^ ((uint64_t)getpid() << 40);
        P->seed = env_u64("CUDA_EMU_SEED", next_random(&mix) % 1000000007ull);
        P->devices = visible_devices();
        P->dev = new device_state[P->devices > 0 ? P->devices : 1];
        memory_init(P->devices);
        printf("# cuda_emu: %d emulated devices, schedule seed %llu (set CUDA_EMU_SEED to repeat)\n", P->devices,
               (unsigned long long)P->seed);
        fflush(stdout);
        atexit(exit_report);
    });
}

int num_devices() { return P->devices; }
int current_device() { return t_device; }

double now_s() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---------------------------------------------------------------- errors and faults */

cudaError_t set_error(cudaError_t e) {
    if (e != cudaSuccess) t_last = e;
    return e;
}

cudaError_t fail(cudaError_t e, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t_detail, sizeof t_detail, fmt, ap);
    va_end(ap);
    t_detail_code = e;
    return set_error(e);
}

void fault(const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "cuda_emu: fault: %s\n", msg);
    fflush(stderr);
    std::lock_guard<std::mutex> g(P->fault_mu);
    P->last_fault = msg;
    P->faults++;
}

void device_error(int device, cudaError_t e) {
    int expected = cudaSuccess;
    P->dev[device].error.compare_exchange_strong(expected, (int)e);
}

cudaError_t take_device_error(int device) {
    if (device < 0 || device >= P->devices) return cudaSuccess;
    return (cudaError_t)P->dev[device].error.exchange(cudaSuccess);
}

/* Sets the last error from a device error that a synchronising call surfaces. */
static cudaError_t surface(int device) { return set_error(take_device_error(device)); }

static cudaError_t need_device() {
    ensure_init();
    if (P->devices == 0) return fail(cudaErrorNoDevice, "no CUDA device (CUDA_VISIBLE_DEVICES is empty)");
    return cudaSuccess;
}

/* ---------------------------------------------------------------- streams */

namespace {

struct op {
    op_fn run;
    const char *what;
    std::vector<token_ptr> deps;
    token_ptr done;
};

struct graph_node {
    const char *what;
    op_maker make;
};

/* What a capture records, shared by the graph and every graph instantiated from it. */
struct graph_data {
    std::vector<graph_node> nodes;
    std::vector<void *> owned; /* cudaMallocAsync during capture */
    ~graph_data() {
        for (void *p : owned) device_free(p, "cudaGraphDestroy (memory allocated during capture)");
    }
};

struct capture {
    std::shared_ptr<graph_data> g;
    stream *origin;
    cudaStreamCaptureMode mode;
    std::thread::id thread;
    bool invalid = false;
    std::set<stream *> members;
    std::map<stream *, size_t> last;   /* node index of each member's last node */
    std::map<stream *, size_t> joined; /* node count when the origin last waited on the member */
};

std::mutex g_tok_mu;
std::condition_variable &g_tok_cv = *new std::condition_variable(); /* never destroyed: workers wait on it past exit */
std::mutex g_streams_mu; /* the stream registry; then a stream's own mutex */
std::set<stream *> *g_streams;
std::mutex g_cap_mu; /* every capture field */
std::set<capture *> *g_captures;

void complete(const token_ptr &t) {
    {
        std::lock_guard<std::mutex> g(g_tok_mu);
        t->time = now_s();
        t->done = true;
    }
    g_tok_cv.notify_all();
}

} // namespace

struct stream {
    int device;
    unsigned flags;
    bool legacy;
    bool destroyed = false;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<op> q;
    token_ptr tail;
    capture *cap = nullptr;
};

namespace {

void worker(stream *s) {
    std::unique_ptr<device_access> window;
    for (;;) {
        op o;
        {
            std::unique_lock<std::mutex> lk(s->mu);
            if (s->q.empty() && window) {
                lk.unlock();
                window.reset(); /* idle: device memory goes back to PROT_NONE */
                lk.lock();
            }
            s->cv.wait(lk, [s] { return !s->q.empty() || s->destroyed; });
            if (s->q.empty()) break;
            o = std::move(s->q.front());
            s->q.pop_front();
        }
        for (auto &d : o.deps) wait_token(d);
        if (!window) window.reset(new device_access());
        if (o.run) o.run();
        o.run = nullptr; /* what the operation holds goes before its completion is seen */
        complete(o.done);
    }
    window.reset();
    delete s;
}

stream *new_stream(int device, unsigned flags, bool legacy) {
    stream *s = new stream();
    s->device = device;
    s->flags = flags;
    s->legacy = legacy;
    {
        std::lock_guard<std::mutex> g(g_streams_mu);
        if (!g_streams) g_streams = new std::set<stream *>();
        g_streams->insert(s);
    }
    std::thread(worker, s).detach();
    return s;
}

stream *legacy_stream(int device) {
    std::lock_guard<std::mutex> g(g_streams_mu);
    if (!P->dev[device].legacy) {
        stream *s = new stream();
        s->device = device;
        s->flags = 0;
        s->legacy = true;
        if (!g_streams) g_streams = new std::set<stream *>();
        g_streams->insert(s);
        std::thread(worker, s).detach();
        P->dev[device].legacy = s;
    }
    return P->dev[device].legacy;
}

__thread stream *t_per_thread[16];

/* Tails the legacy-stream rules add: the legacy stream waits for every blocking stream of
   its device, a blocking stream for the legacy stream. */
void legacy_deps(stream *s, std::vector<token_ptr> &deps) {
    if (s->flags & cudaStreamNonBlocking) return;
    std::lock_guard<std::mutex> g(g_streams_mu);
    for (stream *o : *g_streams) {
        if (o == s || o->device != s->device || (o->flags & cudaStreamNonBlocking) || o->legacy == s->legacy) continue;
        std::lock_guard<std::mutex> g2(o->mu);
        if (o->tail && !o->tail->done) deps.push_back(o->tail);
    }
}

void invalidate(capture *c) { c->invalid = true; }

void detach_capture(capture *c) {
    for (stream *m : c->members) m->cap = nullptr;
    g_captures->erase(c);
    delete c;
}

} // namespace

stream *get_stream(cudaStream_t h, cudaError_t *err) {
    *err = need_device();
    if (*err) return nullptr;
    if (h == nullptr || h == cudaStreamLegacy) return legacy_stream(t_device);
    if (h == cudaStreamPerThread) {
        if (!t_per_thread[t_device]) t_per_thread[t_device] = new_stream(t_device, 0, false);
        return t_per_thread[t_device];
    }
    std::lock_guard<std::mutex> g(g_streams_mu);
    if (g_streams && g_streams->count((stream *)h)) return (stream *)h;
    *err = cudaErrorInvalidResourceHandle;
    return nullptr;
}

int stream_device(const stream *s) { return s->device; }

bool stream_capturing(const stream *s) {
    std::lock_guard<std::mutex> g(g_cap_mu);
    return s->cap != nullptr;
}

cudaError_t issue(stream *s, const char *what, op_maker make, const std::vector<token_ptr> &deps, token_ptr *done) {
    {
        std::lock_guard<std::mutex> g(g_cap_mu);
        if (s->cap) {
            capture *c = s->cap;
            if (c->invalid) return fail(cudaErrorStreamCaptureInvalidated, "%s on a stream whose capture was invalidated", what);
            c->last[s] = c->g->nodes.size();
            c->g->nodes.push_back(graph_node{what, make});
            return cudaSuccess;
        }
    }
    op o;
    o.run = make();
    o.what = what;
    o.deps = deps;
    o.done = std::make_shared<token>();
    legacy_deps(s, o.deps);
    if (done) *done = o.done;
    {
        std::lock_guard<std::mutex> g(s->mu);
        s->tail = o.done;
        s->q.push_back(std::move(o));
    }
    s->cv.notify_one();
    return cudaSuccess;
}

cudaError_t issue_op(stream *s, const char *what, op_fn fn, token_ptr *done) {
    return issue(s, what, [fn]() { return fn; }, {}, done);
}

void wait_token(const token_ptr &t) {
    if (!t || t->done) return;
    std::unique_lock<std::mutex> lk(g_tok_mu);
    g_tok_cv.wait(lk, [&t] { return t->done.load(); });
}

void wait_stream(stream *s) {
    token_ptr t;
    {
        std::lock_guard<std::mutex> g(s->mu);
        t = s->tail;
    }
    wait_token(t);
}

bool capture_forbids(const char *what) {
    std::lock_guard<std::mutex> g(g_cap_mu);
    bool hit = false;
    if (!g_captures) return false;
    for (capture *c : *g_captures)
        if (c->mode == cudaStreamCaptureModeGlobal || (c->mode == cudaStreamCaptureModeThreadLocal && c->thread == std::this_thread::get_id())) {
            if (!c->invalid) fault("%s while a stream capture is active: the capture is invalidated", what);
            invalidate(c);
            hit = true;
        }
    return hit;
}

/* Waits for every stream of a device. */
static void wait_device(int device) {
    std::vector<token_ptr> tails;
    {
        std::lock_guard<std::mutex> g(g_streams_mu);
        if (g_streams)
            for (stream *s : *g_streams)
                if (s->device == device) {
                    std::lock_guard<std::mutex> g2(s->mu);
                    if (s->tail) tails.push_back(s->tail);
                }
    }
    for (auto &t : tails) wait_token(t);
}

} // namespace cuda_emu

using namespace cuda_emu;

/* ================================================================= C API */

extern "C" {

/* ---------------------------------------------------------------- errors */

const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
#define CUDA_EMU_NAME(x) \
    case x: return #x;
        CUDA_EMU_NAME(cudaSuccess)
        CUDA_EMU_NAME(cudaErrorInvalidValue)
        CUDA_EMU_NAME(cudaErrorMemoryAllocation)
        CUDA_EMU_NAME(cudaErrorInitializationError)
        CUDA_EMU_NAME(cudaErrorInvalidConfiguration)
        CUDA_EMU_NAME(cudaErrorInvalidDevicePointer)
        CUDA_EMU_NAME(cudaErrorInvalidMemcpyDirection)
        CUDA_EMU_NAME(cudaErrorInvalidDeviceFunction)
        CUDA_EMU_NAME(cudaErrorNoDevice)
        CUDA_EMU_NAME(cudaErrorInvalidDevice)
        CUDA_EMU_NAME(cudaErrorInvalidResourceHandle)
        CUDA_EMU_NAME(cudaErrorIllegalState)
        CUDA_EMU_NAME(cudaErrorNotReady)
        CUDA_EMU_NAME(cudaErrorIllegalAddress)
        CUDA_EMU_NAME(cudaErrorLaunchOutOfResources)
        CUDA_EMU_NAME(cudaErrorHostMemoryAlreadyRegistered)
        CUDA_EMU_NAME(cudaErrorHostMemoryNotRegistered)
        CUDA_EMU_NAME(cudaErrorIllegalInstruction)
        CUDA_EMU_NAME(cudaErrorLaunchFailure)
        CUDA_EMU_NAME(cudaErrorNotSupported)
        CUDA_EMU_NAME(cudaErrorStreamCaptureUnsupported)
        CUDA_EMU_NAME(cudaErrorStreamCaptureInvalidated)
        CUDA_EMU_NAME(cudaErrorStreamCaptureUnmatched)
        CUDA_EMU_NAME(cudaErrorStreamCaptureUnjoined)
        CUDA_EMU_NAME(cudaErrorStreamCaptureIsolation)
        CUDA_EMU_NAME(cudaErrorStreamCaptureImplicit)
        CUDA_EMU_NAME(cudaErrorStreamCaptureWrongThread)
        CUDA_EMU_NAME(cudaErrorUnknown)
#undef CUDA_EMU_NAME
    }
    return "cudaErrorUnknown";
}

static const char *error_text(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorInvalidDeviceFunction: return "invalid device function";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorIllegalState: return "the operation cannot be performed in the present state";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorHostMemoryAlreadyRegistered: return "part or all of the requested memory range is already mapped";
    case cudaErrorHostMemoryNotRegistered: return "pointer does not correspond to a registered memory region";
    case cudaErrorIllegalInstruction: return "an illegal instruction was encountered";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorNotSupported: return "operation not supported";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureUnmatched: return "operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorStreamCaptureUnjoined: return "capture stream was not joined back into the origin stream";
    case cudaErrorStreamCaptureIsolation: return "dependency created on uncaptured work in another stream";
    case cudaErrorStreamCaptureImplicit: return "operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorStreamCaptureWrongThread: return "attempt to terminate a thread-local capture sequence from another thread";
    default: return "unknown error";
    }
}

const char *cudaGetErrorString(cudaError_t e) {
    ensure_init();
    if (e != cudaSuccess && e == t_detail_code && t_detail[0]) {
        snprintf(t_message, sizeof t_message, "%s (cuda_emu: %s)", error_text(e), t_detail);
        return t_message;
    }
    if (e == cudaErrorIllegalAddress || e == cudaErrorIllegalInstruction || e == cudaErrorLaunchFailure) {
        std::lock_guard<std::mutex> g(P->fault_mu);
        if (!P->last_fault.empty()) {
            snprintf(t_message, sizeof t_message, "%s (cuda_emu: %s)", error_text(e), P->last_fault.c_str());
            return t_message;
        }
    }
    return error_text(e);
}

cudaError_t cudaGetLastError(void) {
    ensure_init();
    cudaError_t e = t_last;
    t_last = cudaSuccess;
    if (e == cudaSuccess && P->devices > 0) e = take_device_error(t_device);
    return e;
}

cudaError_t cudaPeekAtLastError(void) {
    ensure_init();
    if (t_last == cudaSuccess && P->devices > 0) return (cudaError_t)P->dev[t_device].error.load();
    return t_last;
}

/* ---------------------------------------------------------------- devices */

cudaError_t cudaGetDeviceCount(int *count) {
    ensure_init();
    if (!count) return fail(cudaErrorInvalidValue, "cudaGetDeviceCount: count is NULL");
    *count = P->devices;
    return need_device();
}

cudaError_t cudaSetDevice(int device) {
    cudaError_t e = need_device();
    if (e) return e;
    if (device < 0 || device >= P->devices) return fail(cudaErrorInvalidDevice, "cudaSetDevice(%d) of %d devices", device, P->devices);
    t_device = device;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device) {
    cudaError_t e = need_device();
    if (e) return e;
    if (!device) return fail(cudaErrorInvalidValue, "cudaGetDevice: device is NULL");
    *device = t_device;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int device) {
    cudaError_t e = need_device();
    if (e) return e;
    if (!p) return fail(cudaErrorInvalidValue, "cudaGetDeviceProperties: prop is NULL");
    if (device < 0 || device >= P->devices) return fail(cudaErrorInvalidDevice, "cudaGetDeviceProperties(%d)", device);
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "cuda_emu %d (CPU emulation of an sm_90 GPU)", device);
    p->totalGlobalMem = device_capacity();
    p->sharedMemPerBlock = 48 * 1024;
    p->regsPerBlock = 65536;
    p->warpSize = 32;
    p->maxThreadsPerBlock = 1024;
    p->maxThreadsDim[0] = 1024;
    p->maxThreadsDim[1] = 1024;
    p->maxThreadsDim[2] = 64;
    p->maxGridSize[0] = 0x7fffffff;
    p->maxGridSize[1] = 65535;
    p->maxGridSize[2] = 65535;
    p->totalConstMem = 65536;
    p->major = 9;
    p->minor = 0;
    p->multiProcessorCount = 4;
    p->l2CacheSize = 50 << 20;
    p->maxThreadsPerMultiProcessor = 2048;
    p->sharedMemPerBlockOptin = 227 * 1024;
    p->sharedMemPerMultiprocessor = 228 * 1024;
    p->memoryBusWidth = 5120;
    p->pciBusID = device + 1;
    p->unifiedAddressing = 1;
    p->managedMemory = 1;
    p->concurrentKernels = 1;
    p->asyncEngineCount = 2;
    p->memoryPoolsSupported = 1;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetPCIBusId(char *pciBusId, int len, int device) {
    cudaDeviceProp p;
    cudaError_t e = cudaGetDeviceProperties(&p, device);
    if (e) return e;
    if (!pciBusId || len < 13) return fail(cudaErrorInvalidValue, "cudaDeviceGetPCIBusId: buffer of %d bytes", len);
    snprintf(pciBusId, (size_t)len, "0000:%02x:00.0", p.pciBusID);
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device) {
    cudaDeviceProp p;
    cudaError_t e = cudaGetDeviceProperties(&p, device);
    if (e) return e;
    if (!value) return fail(cudaErrorInvalidValue, "cudaDeviceGetAttribute: value is NULL");
    switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = p.maxThreadsPerBlock; break;
    case cudaDevAttrMaxBlockDimX: *value = p.maxThreadsDim[0]; break;
    case cudaDevAttrMaxBlockDimY: *value = p.maxThreadsDim[1]; break;
    case cudaDevAttrMaxBlockDimZ: *value = p.maxThreadsDim[2]; break;
    case cudaDevAttrMaxGridDimX: *value = p.maxGridSize[0]; break;
    case cudaDevAttrMaxGridDimY: *value = p.maxGridSize[1]; break;
    case cudaDevAttrMaxGridDimZ: *value = p.maxGridSize[2]; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = (int)p.sharedMemPerBlock; break;
    case cudaDevAttrWarpSize: *value = p.warpSize; break;
    case cudaDevAttrMultiProcessorCount: *value = p.multiProcessorCount; break;
    case cudaDevAttrL2CacheSize: *value = p.l2CacheSize; break;
    case cudaDevAttrComputeCapabilityMajor: *value = p.major; break;
    case cudaDevAttrComputeCapabilityMinor: *value = p.minor; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = (int)p.sharedMemPerBlockOptin; break;
    case cudaDevAttrMemoryPoolsSupported: *value = 1; break;
    default: return fail(cudaErrorInvalidValue, "cudaDeviceGetAttribute: attribute %d", (int)attr);
    }
    return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
    cudaError_t e = need_device();
    if (e) return e;
    if (capture_forbids("cudaDeviceSynchronize"))
        return fail(cudaErrorStreamCaptureUnsupported, "cudaDeviceSynchronize during a stream capture");
    wait_device(t_device);
    return surface(t_device);
}

cudaError_t cudaDeviceReset(void) {
    cudaError_t e = need_device();
    if (e) return e;
    wait_device(t_device);
    (void)take_device_error(t_device);
    return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int *v) {
    if (!v) return fail(cudaErrorInvalidValue, "cudaDriverGetVersion: NULL");
    *v = CUDART_VERSION;
    return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int *v) {
    if (!v) return fail(cudaErrorInvalidValue, "cudaRuntimeGetVersion: NULL");
    *v = CUDART_VERSION;
    return cudaSuccess;
}

/* ---------------------------------------------------------------- streams */

cudaError_t cudaStreamCreateWithPriority(cudaStream_t *s, unsigned int flags, int priority) {
    cudaError_t e = need_device();
    (void)priority;
    if (e) return e;
    if (!s) return fail(cudaErrorInvalidValue, "cudaStreamCreate: stream is NULL");
    if (flags & ~1u) return fail(cudaErrorInvalidValue, "cudaStreamCreateWithFlags: flags 0x%x", flags);
    *s = (cudaStream_t)new_stream(t_device, flags, false);
    return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int flags) { return cudaStreamCreateWithPriority(s, flags, 0); }
cudaError_t cudaStreamCreate(cudaStream_t *s) { return cudaStreamCreateWithPriority(s, 0, 0); }

cudaError_t cudaStreamDestroy(cudaStream_t h) {
    cudaError_t e;
    stream *s;
    if (h == nullptr || h == cudaStreamLegacy || h == cudaStreamPerThread)
        return fail(cudaErrorInvalidResourceHandle, "cudaStreamDestroy of a default stream");
    if (!(s = get_stream(h, &e))) return fail(e ? e : cudaErrorInvalidResourceHandle, "cudaStreamDestroy(%p): not a live stream", (void *)h);
    {
        std::lock_guard<std::mutex> g(g_cap_mu);
        if (s->cap) {
            invalidate(s->cap);
            s->cap->members.erase(s);
            if (s->cap->origin == s) detach_capture(s->cap);
            s->cap = nullptr;
        }
    }
    {
        std::lock_guard<std::mutex> g(g_streams_mu);
        g_streams->erase(s);
    }
    {
        std::lock_guard<std::mutex> g(s->mu);
        s->destroyed = true; /* the worker drains the queue, then frees the stream */
    }
    s->cv.notify_one();
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t h) {
    cudaError_t e;
    stream *s = get_stream(h, &e);
    if (!s) return fail(e, "cudaStreamSynchronize(%p): not a live stream", (void *)h);
    if (stream_capturing(s)) {
        std::lock_guard<std::mutex> g(g_cap_mu);
        if (s->cap) invalidate(s->cap);
        return fail(cudaErrorStreamCaptureUnsupported, "cudaStreamSynchronize on a capturing stream");
    }
    wait_stream(s);
    return surface(s->device);
}

cudaError_t cudaStreamQuery(cudaStream_t h) {
    cudaError_t e;
    stream *s = get_stream(h, &e);
    token_ptr t;
    if (!s) return fail(e, "cudaStreamQuery(%p): not a live stream", (void *)h);
    if (stream_capturing(s)) {
        std::lock_guard<std::mutex> g(g_cap_mu);
        if (s->cap) invalidate(s->cap);
        return fail(cudaErrorStreamCaptureUnsupported, "cudaStreamQuery on a capturing stream");
    }
    {
        std::lock_guard<std::mutex> g(s->mu);
        t = s->tail;
    }
    if (t && !t->done) return cudaErrorNotReady;
    return surface(s->device);
}

cudaError_t cudaLaunchHostFunc(cudaStream_t h, cudaHostFn_t fn, void *data) {
    cudaError_t e;
    stream *s = get_stream(h, &e);
    if (!s) return fail(e, "cudaLaunchHostFunc(%p): not a live stream", (void *)h);
    if (!fn) return fail(cudaErrorInvalidValue, "cudaLaunchHostFunc: fn is NULL");
    return issue_op(s, "host function", [fn, data]() { fn(data); });
}

/* ---------------------------------------------------------------- events */

struct CUevent_st {
    unsigned flags;
    int device;
    bool recorded;
    token_ptr tok;
    capture *cap;
    stream *cap_stream;
    size_t cap_pos;
};
static std::mutex g_events_mu;
static std::set<CUevent_st *> *g_events;

static CUevent_st *get_event(cudaEvent_t e) {
    std::lock_guard<std::mutex> g(g_events_mu);
    return g_events && g_events->count(e) ? e : nullptr;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *ev, unsigned int flags) {
    cudaError_t e = need_device();
    if (e) return e;
    if (!ev) return fail(cudaErrorInvalidValue, "cudaEventCreate: event is NULL");
    if (flags & ~7u) return fail(cudaErrorInvalidValue, "cudaEventCreateWithFlags: flags 0x%x", flags);
    CUevent_st *x = new CUevent_st{flags, t_device, false, nullptr, nullptr, nullptr, 0};
    std::lock_guard<std::mutex> g(g_events_mu);
    if (!g_events) g_events = new std::set<CUevent_st *>();
    g_events->insert(x);
    *ev = x;
    return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t *ev) { return cudaEventCreateWithFlags(ev, cudaEventDefault); }

cudaError_t cudaEventDestroy(cudaEvent_t ev) {
    ensure_init();
    {
        std::lock_guard<std::mutex> g(g_events_mu);
        if (!g_events || !g_events->erase(ev)) return fail(cudaErrorInvalidResourceHandle, "cudaEventDestroy(%p): not an event", (void *)ev);
    }
    delete ev;
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t h, cudaStream_t sh) {
    cudaError_t e;
    CUevent_st *ev;
    stream *s = get_stream(sh, &e);
    if (!s) return fail(e, "cudaEventRecord: stream %p is not a live stream", (void *)sh);
    if (!(ev = get_event(h))) return fail(cudaErrorInvalidResourceHandle, "cudaEventRecord(%p): not an event", (void *)h);
    if (ev->device != s->device)
        return fail(cudaErrorInvalidResourceHandle, "cudaEventRecord: event of device %d on a stream of device %d", ev->device, s->device);
    {
        std::lock_guard<std::mutex> g(g_cap_mu);
        if (s->cap) {
            if (s->cap->invalid) return fail(cudaErrorStreamCaptureInvalidated, "cudaEventRecord on an invalidated capture");
            ev->cap = s->cap;
            ev->cap_stream = s;
            ev->cap_pos = s->cap->g->nodes.size();
            ev->recorded = true;
            return cudaSuccess;
        }
    }
    ev->cap = nullptr;
    token_ptr t;
    e = issue_op(s, "cudaEventRecord", nullptr, &t);
    if (e) return e;
    ev->tok = t;
    ev->recorded = true;
    return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t h) {
    CUevent_st *ev;
    ensure_init();
    if (!(ev = get_event(h))) return fail(cudaErrorInvalidResourceHandle, "cudaEventQuery(%p): not an event", (void *)h);
    if (ev->recorded && ev->tok && !ev->tok->done) return cudaErrorNotReady;
    return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t h) {
    CUevent_st *ev;
    ensure_init();
    if (!(ev = get_event(h))) return fail(cudaErrorInvalidResourceHandle, "cudaEventSynchronize(%p): not an event", (void *)h);
    if (ev->recorded && ev->tok) wait_token(ev->tok);
    return surface(ev->device);
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
    CUevent_st *x, *y;
    ensure_init();
    if (!ms) return fail(cudaErrorInvalidValue, "cudaEventElapsedTime: ms is NULL");
    if (!(x = get_event(a)) || !(y = get_event(b))) return fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: not an event");
    if ((x->flags | y->flags) & cudaEventDisableTiming)
        return fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: an event was created with cudaEventDisableTiming");
    if (x->device != y->device) return fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: events of devices %d and %d", x->device, y->device);
    if (!x->recorded || !y->recorded || !x->tok || !y->tok)
        return fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: an event was not recorded");
    if (!x->tok->done || !y->tok->done) return cudaErrorNotReady;
    *ms = (float)((y->tok->time - x->tok->time) * 1e3);
    return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t sh, cudaEvent_t h, unsigned int flags) {
    cudaError_t e;
    CUevent_st *ev;
    stream *s = get_stream(sh, &e);
    (void)flags;
    if (!s) return fail(e, "cudaStreamWaitEvent: stream %p is not a live stream", (void *)sh);
    if (!(ev = get_event(h))) return fail(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent(%p): not an event", (void *)h);
    {
        std::lock_guard<std::mutex> g(g_cap_mu);
        if (ev->cap && g_captures && g_captures->count(ev->cap)) { /* an event of an active capture */
            capture *c = ev->cap;
            if (s->cap && s->cap != c) {
                invalidate(c);
                return fail(cudaErrorStreamCaptureIsolation, "cudaStreamWaitEvent joins two different captures");
            }
            if (!s->cap) { /* fork: s joins the capture */
                s->cap = c;
                c->members.insert(s);
            } else if (ev->cap_stream != s) {
                size_t &j = c->joined[ev->cap_stream];
                if (ev->cap_pos > j) j = ev->cap_pos;
            }
            return cudaSuccess;
        }
        if (s->cap) {
            invalidate(s->cap);
            return fail(cudaErrorStreamCaptureIsolation, "cudaStreamWaitEvent: a capturing stream waits on an event recorded outside the capture");
        }
    }
    if (!ev->recorded || !ev->tok || ev->tok->done) return cudaSuccess;
    return issue(s, "cudaStreamWaitEvent", []() { return op_fn(); }, {ev->tok});
}

/* ---------------------------------------------------------------- memory */

cudaError_t cudaMalloc(void **ptr, size_t size) {
    cudaError_t e = need_device();
    if (e) return e;
    if (!ptr) return fail(cudaErrorInvalidValue, "cudaMalloc: ptr is NULL");
    if (capture_forbids("cudaMalloc")) return fail(cudaErrorStreamCaptureUnsupported, "cudaMalloc during a stream capture");
    *ptr = size ? device_alloc(t_device, size) : nullptr;
    if (size && !*ptr)
        return fail(cudaErrorMemoryAllocation, "cudaMalloc of %zu bytes on device %d (%zu of %zu bytes in use)", size, t_device,
                    device_used(t_device), device_capacity());
    return cudaSuccess;
}

cudaError_t cudaMallocAsync(void **ptr, size_t size, cudaStream_t sh) {
    cudaError_t e;
    stream *s = get_stream(sh, &e);
    if (!s) return fail(e, "cudaMallocAsync: stream %p is not a live stream", (void *)sh);
    if (!ptr) return fail(cudaErrorInvalidValue, "cudaMallocAsync: ptr is NULL");
    *ptr = size ? device_alloc(s->device, size) : nullptr;
    if (size && !*ptr)
        return fail(cudaErrorMemoryAllocation, "cudaMallocAsync of %zu bytes on device %d (%zu of %zu bytes in use)", size, s->device,
                    device_used(s->device), device_capacity());
    std::lock_guard<std::mutex> g(g_cap_mu);
    if (s->cap && *ptr) s->cap->g->owned.push_back(*ptr); /* lives as long as the graph */
    return cudaSuccess;
}

static bool is_allocation(const void *p) {
    mem_info m = classify(p);
    return m.cls == MEM_DEVICE && m.base == p;
}

cudaError_t cudaFree(void *ptr) {
    ensure_init();
    if (!ptr) return cudaSuccess;
    if (capture_forbids("cudaFree")) return fail(cudaErrorStreamCaptureUnsupported, "cudaFree during a stream capture");
    mem_info m = classify(ptr);
    if (m.cls == MEM_MANAGED && m.base == ptr) return host_free(ptr, MEM_MANAGED) ? cudaSuccess : fail(cudaErrorInvalidValue, "cudaFree(%p)", ptr);
    if (m.cls == MEM_DEVICE || m.cls == MEM_FREED) wait_device(m.device);
    if (!device_free(ptr, "cudaFree")) return fail(cudaErrorInvalidValue, "cudaFree(%p): %s", ptr, cuda_emu_last_fault());
    return surface(m.device);
}

cudaError_t cudaFreeAsync(void *ptr, cudaStream_t sh) {
    cudaError_t e;
    stream *s = get_stream(sh, &e);
    if (!s) return fail(e, "cudaFreeAsync: stream %p is not a live stream", (void *)sh);
    if (!ptr) return cudaSuccess;
    if (!is_allocation(ptr)) {
        fault("cudaFreeAsync: %p is not the start of a live device allocation (%s)", ptr, mem_class_name(classify(ptr).cls));
        return fail(cudaErrorInvalidValue, "cudaFreeAsync(%p): not a live device allocation", ptr);
    }
    {
        std::lock_guard<std::mutex> g(g_cap_mu);
        if (s->cap) {
            for (void *o : s->cap->g->owned)
                if (o == ptr) return cudaSuccess; /* freed with the graph */
        }
    }
    return issue_op(s, "cudaFreeAsync", [ptr]() {
        if (!device_free(ptr, "cudaFreeAsync")) device_error(classify(ptr).device, cudaErrorInvalidValue);
    });
}

cudaError_t cudaHostAlloc(void **ptr, size_t size, unsigned int flags) {
    ensure_init();
    (void)flags;
    if (!ptr) return fail(cudaErrorInvalidValue, "cudaHostAlloc: ptr is NULL");
    if (capture_forbids("cudaHostAlloc")) return fail(cudaErrorStreamCaptureUnsupported, "cudaHostAlloc during a stream capture");
    if (!(*ptr = host_alloc(size, MEM_PINNED))) return fail(cudaErrorMemoryAllocation, "cudaHostAlloc of %zu bytes", size);
    return cudaSuccess;
}
cudaError_t cudaMallocHost(void **ptr, size_t size) { return cudaHostAlloc(ptr, size, 0); }

cudaError_t cudaFreeHost(void *ptr) {
    ensure_init();
    if (!ptr) return cudaSuccess;
    if (!host_free(ptr, MEM_PINNED)) {
        fault("cudaFreeHost: %p is %s, not memory from cudaMallocHost/cudaHostAlloc", ptr, mem_class_name(classify(ptr).cls));
        return fail(cudaErrorInvalidValue, "cudaFreeHost(%p)", ptr);
    }
    return cudaSuccess;
}

cudaError_t cudaHostRegister(void *ptr, size_t size, unsigned int flags) {
    ensure_init();
    (void)flags;
    if (!ptr || !size) return fail(cudaErrorInvalidValue, "cudaHostRegister(%p, %zu)", ptr, size);
    if (!host_range_ok("cudaHostRegister", ptr, size)) return fail(cudaErrorInvalidValue, "cudaHostRegister of device memory");
    if (!host_register(ptr, size)) return fail(cudaErrorHostMemoryAlreadyRegistered, "cudaHostRegister(%p, %zu)", ptr, size);
    return cudaSuccess;
}

cudaError_t cudaHostUnregister(void *ptr) {
    ensure_init();
    if (!host_unregister(ptr)) return fail(cudaErrorHostMemoryNotRegistered, "cudaHostUnregister(%p)", ptr);
    return cudaSuccess;
}

cudaError_t cudaMallocManaged(void **ptr, size_t size, unsigned int flags) {
    cudaError_t e = need_device();
    (void)flags;
    if (e) return e;
    if (!ptr) return fail(cudaErrorInvalidValue, "cudaMallocManaged: ptr is NULL");
    if (!(*ptr = host_alloc(size, MEM_MANAGED))) return fail(cudaErrorMemoryAllocation, "cudaMallocManaged of %zu bytes", size);
    return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    cudaError_t e = need_device();
    if (e) return e;
    if (!free_bytes || !total_bytes) return fail(cudaErrorInvalidValue, "cudaMemGetInfo: NULL");
    *total_bytes = device_capacity();
    *free_bytes = device_capacity() - device_used(t_device);
    return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes *a, const void *p) {
    ensure_init();
    if (!a) return fail(cudaErrorInvalidValue, "cudaPointerGetAttributes: attributes is NULL");
    mem_info m = classify(p);
    memset(a, 0, sizeof *a);
    switch (m.cls) {
    case MEM_DEVICE:
        a->type = cudaMemoryTypeDevice;
        a->device = m.device;
        a->devicePointer = (void *)p;
        break;
    case MEM_MANAGED:
        a->type = cudaMemoryTypeManaged;
        a->devicePointer = a->hostPointer = (void *)p;
        break;
    case MEM_PINNED:
        a->type = cudaMemoryTypeHost;
        a->devicePointer = a->hostPointer = (void *)p;
        break;
    case MEM_FREED: return fail(cudaErrorInvalidValue, "cudaPointerGetAttributes(%p): freed device memory", p);
    default: a->type = cudaMemoryTypeUnregistered; break;
    }
    return cudaSuccess;
}

cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *pool, int device) {
    cudaError_t e = need_device();
    if (e) return e;
    if (!pool) return fail(cudaErrorInvalidValue, "cudaDeviceGetDefaultMemPool: pool is NULL");
    if (device < 0 || device >= P->devices) return fail(cudaErrorInvalidDevice, "cudaDeviceGetDefaultMemPool(%d)", device);
    *pool = (cudaMemPool_t)(uintptr_t)(device + 1);
    return cudaSuccess;
}

cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void *value) {
    ensure_init();
    uintptr_t d = (uintptr_t)pool;
    if (d < 1 || d > (uintptr_t)P->devices || !value) return fail(cudaErrorInvalidValue, "cudaMemPoolSetAttribute: pool %p", (void *)pool);
    if (attr < cudaMemPoolReuseFollowEventDependencies || attr > cudaMemPoolAttrUsedMemHigh)
        return fail(cudaErrorInvalidValue, "cudaMemPoolSetAttribute: attribute %d", (int)attr);
    return cudaSuccess; /* the emulator's pool keeps everything; the settings change nothing observable */
}

cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void *value) {
    ensure_init();
    uintptr_t d = (uintptr_t)pool;
    if (d < 1 || d > (uintptr_t)P->devices || !value) return fail(cudaErrorInvalidValue, "cudaMemPoolGetAttribute: pool %p", (void *)pool);
    if (attr == cudaMemPoolAttrReleaseThreshold || attr >= cudaMemPoolAttrReservedMemCurrent) *(uint64_t *)value = device_used((int)d - 1);
    else *(int *)value = 1;
    return cudaSuccess;
}

/* ---------------------------------------------------------------- copies */

static bool host_side_is_pageable(const void *p) {
    mem_class c = classify(p).cls;
    return c != MEM_PINNED && c != MEM_MANAGED;
}

/* Checks both pointers against the kind (cudaMemcpyDefault: what they are). */
static cudaError_t check_copy(const char *fn, void *dst, const void *src, size_t n, cudaMemcpyKind *kind) {
    if (*kind == cudaMemcpyDefault) {
        mem_class d = classify(dst).cls, s = classify(src).cls;
        bool dd = d == MEM_DEVICE || d == MEM_FREED, sd = s == MEM_DEVICE || s == MEM_FREED;
        *kind = dd ? (sd ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice) : (sd ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
    }
    if (n && (!dst || !src)) return fail(cudaErrorInvalidValue, "%s of %zu bytes with a NULL pointer", fn, n);
    bool ok;
    char what_d[96], what_s[96];
    snprintf(what_d, sizeof what_d, "%s destination", fn);
    snprintf(what_s, sizeof what_s, "%s source", fn);
    switch (*kind) {
    case cudaMemcpyHostToHost: ok = host_range_ok(what_d, dst, n) && host_range_ok(what_s, src, n); break;
    case cudaMemcpyHostToDevice: ok = device_range_ok(what_d, dst, n, -1) && host_range_ok(what_s, src, n); break;
    case cudaMemcpyDeviceToHost: ok = host_range_ok(what_d, dst, n) && device_range_ok(what_s, src, n, -1); break;
    case cudaMemcpyDeviceToDevice: ok = device_range_ok(what_d, dst, n, -1) && device_range_ok(what_s, src, n, -1); break;
    default: return fail(cudaErrorInvalidMemcpyDirection, "%s: kind %d", fn, (int)*kind);
    }
    if (!ok) return fail(cudaErrorInvalidValue, "%s: %s", fn, cuda_emu_last_fault());
    return cudaSuccess;
}

static cudaError_t copy_on(stream *s, const char *fn, void *dst, const void *src, size_t n, cudaMemcpyKind kind, bool sync) {
    cudaError_t e = check_copy(fn, dst, src, n, &kind);
    bool host_src = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyHostToHost;
    bool host_dst = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyHostToHost;
    token_ptr t;
    if (e) return e;
    if (!n) return cudaSuccess;
    if (stream_capturing(s) && ((host_src && host_side_is_pageable(src)) || (host_dst && host_side_is_pageable(dst)))) {
        std::lock_guard<std::mutex> g(g_cap_mu);
        if (s->cap) invalidate(s->cap);
        return fail(cudaErrorStreamCaptureUnsupported, "%s with pageable host memory during a stream capture", fn);
    }
    if (host_src && host_side_is_pageable(src)) { /* staged now: the caller may reuse its buffer at once */
        std::shared_ptr<std::vector<char>> stage = std::make_shared<std::vector<char>>((const char *)src, (const char *)src + n);
        e = issue_op(s, fn, [dst, stage]() { memcpy(dst, stage->data(), stage->size()); }, &t);
    } else {
        e = issue_op(s, fn, [dst, src, n]() { memcpy(dst, src, n); }, &t);
    }
    if (e) return e;
    if (sync || (host_dst && host_side_is_pageable(dst))) { /* into pageable memory: returns when done */
        wait_token(t);
        return surface(s->device);
    }
    return cudaSuccess;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind kind) {
    cudaError_t e;
    stream *s = get_stream(nullptr, &e);
    if (!s) return e;
    if (capture_forbids("cudaMemcpy")) return fail(cudaErrorStreamCaptureUnsupported, "cudaMemcpy during a stream capture");
    return copy_on(s, "cudaMemcpy", dst, src, n, kind, true);
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind, cudaStream_t sh) {
    cudaError_t e;
    stream *s = get_stream(sh, &e);
    if (!s) return fail(e, "cudaMemcpyAsync: stream %p is not a live stream", (void *)sh);
    return copy_on(s, "cudaMemcpyAsync", dst, src, n, kind, false);
}

static cudaError_t memset_on(stream *s, const char *fn, void *p, int value, size_t n, bool sync) {
    token_ptr t;
    cudaError_t e;
    if (!device_range_ok(fn, p, n, -1)) return fail(cudaErrorInvalidValue, "%s: %s", fn, cuda_emu_last_fault());
    if (!n) return cudaSuccess;
    e = issue_op(s, fn, [p, value, n]() { memset(p, value, n); }, &t);
    if (e || !sync) return e;
    wait_token(t);
    return surface(s->device);
}

cudaError_t cudaMemset(void *p, int value, size_t n) {
    cudaError_t e;
    stream *s = get_stream(nullptr, &e);
    if (!s) return e;
    if (capture_forbids("cudaMemset")) return fail(cudaErrorStreamCaptureUnsupported, "cudaMemset during a stream capture");
    return memset_on(s, "cudaMemset", p, value, n, true);
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t n, cudaStream_t sh) {
    cudaError_t e;
    stream *s = get_stream(sh, &e);
    if (!s) return fail(e, "cudaMemsetAsync: stream %p is not a live stream", (void *)sh);
    return memset_on(s, "cudaMemsetAsync", p, value, n, false);
}

/* ---------------------------------------------------------------- graphs */

struct CUgraph_st {
    std::shared_ptr<graph_data> g;
};
struct CUgraphExec_st {
    std::shared_ptr<graph_data> g;
};

cudaError_t cudaStreamBeginCapture(cudaStream_t sh, cudaStreamCaptureMode mode) {
    cudaError_t e;
    stream *s = get_stream(sh, &e);
    if (!s) return fail(e, "cudaStreamBeginCapture: stream %p is not a live stream", (void *)sh);
    if (s->legacy) return fail(cudaErrorStreamCaptureUnsupported, "cudaStreamBeginCapture on the legacy default stream");
    if (mode < cudaStreamCaptureModeGlobal || mode > cudaStreamCaptureModeRelaxed)
        return fail(cudaErrorInvalidValue, "cudaStreamBeginCapture: mode %d", (int)mode);
    std::lock_guard<std::mutex> g(g_cap_mu);
    if (s->cap) return fail(cudaErrorIllegalState, "cudaStreamBeginCapture on a stream that is already capturing");
    capture *c = new capture();
    c->g = std::make_shared<graph_data>();
    c->origin = s;
    c->mode = mode;
    c->thread = std::this_thread::get_id();
    c->members.insert(s);
    if (!g_captures) g_captures = new std::set<capture *>();
    g_captures->insert(c);
    s->cap = c;
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t sh, cudaGraph_t *graph) {
    cudaError_t e;
    stream *s = get_stream(sh, &e);
    if (!s) return fail(e, "cudaStreamEndCapture: stream %p is not a live stream", (void *)sh);
    if (!graph) return fail(cudaErrorInvalidValue, "cudaStreamEndCapture: graph is NULL");
    std::lock_guard<std::mutex> g(g_cap_mu);
    capture *c = s->cap;
    *graph = nullptr;
    if (!c) return fail(cudaErrorIllegalState, "cudaStreamEndCapture on a stream that is not capturing");
    if (c->origin != s) {
        invalidate(c);
        return fail(cudaErrorStreamCaptureUnmatched, "cudaStreamEndCapture on a stream that joined the capture, not its origin");
    }
    if (c->mode == cudaStreamCaptureModeThreadLocal && c->thread != std::this_thread::get_id()) {
        invalidate(c);
        return fail(cudaErrorStreamCaptureWrongThread, "cudaStreamEndCapture from another thread");
    }
    if (c->invalid) {
        detach_capture(c);
        return fail(cudaErrorStreamCaptureInvalidated, "cudaStreamEndCapture: the capture was invalidated");
    }
    for (stream *m : c->members) {
        if (m == s || !c->last.count(m)) continue;
        if (!c->joined.count(m) || c->joined[m] <= c->last[m]) {
            detach_capture(c);
            return fail(cudaErrorStreamCaptureUnjoined, "cudaStreamEndCapture: a stream that joined the capture has work the origin "
                        "never waited for");
        }
    }
    *graph = new CUgraph_st{c->g};
    detach_capture(c);
    return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t sh, cudaStreamCaptureStatus *status) {
    cudaError_t e;
    stream *s = get_stream(sh, &e);
    if (!s) return fail(e, "cudaStreamIsCapturing: stream %p is not a live stream", (void *)sh);
    if (!status) return fail(cudaErrorInvalidValue, "cudaStreamIsCapturing: status is NULL");
    std::lock_guard<std::mutex> g(g_cap_mu);
    *status = !s->cap ? cudaStreamCaptureStatusNone : s->cap->invalid ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive;
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long flags) {
    ensure_init();
    (void)flags;
    if (!exec || !graph) return fail(cudaErrorInvalidValue, "cudaGraphInstantiate: NULL argument");
    *exec = new CUgraphExec_st{graph->g};
    return cudaSuccess;
}
cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long flags) {
    return cudaGraphInstantiate(exec, graph, flags);
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t sh) {
    cudaError_t e;
    stream *s = get_stream(sh, &e);
    if (!s) return fail(e, "cudaGraphLaunch: stream %p is not a live stream", (void *)sh);
    if (!exec) return fail(cudaErrorInvalidValue, "cudaGraphLaunch: exec is NULL");
    std::shared_ptr<graph_data> g = exec->g;
    for (const graph_node &n : g->nodes) {
        op_maker make = n.make;
        e = issue(s, n.what, [g, make]() {
            op_fn fn = make();
            return op_fn([g, fn]() { /* the graph (and the memory it owns) lives while its work runs */
                if (fn) fn();
            });
        });
        if (e) return e;
    }
    return cudaSuccess;
}

cudaError_t cudaGraphGetNodes(cudaGraph_t graph, cudaGraphNode_t *nodes, size_t *count) {
    ensure_init();
    if (!graph || !count) return fail(cudaErrorInvalidValue, "cudaGraphGetNodes: NULL argument");
    if (nodes)
        for (size_t i = 0; i < *count && i < graph->g->nodes.size(); i++) nodes[i] = (cudaGraphNode_t)(uintptr_t)(i + 1);
    *count = graph->g->nodes.size();
    return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
    ensure_init();
    if (!exec) return fail(cudaErrorInvalidValue, "cudaGraphExecDestroy: NULL");
    delete exec;
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
    ensure_init();
    if (!graph) return fail(cudaErrorInvalidValue, "cudaGraphDestroy: NULL");
    delete graph;
    return cudaSuccess;
}

/* ---------------------------------------------------------------- emulator controls */

int cuda_emu_fault_count(void) {
    ensure_init();
    return P->faults.load();
}

int cuda_emu_take_faults(void) {
    ensure_init();
    return P->faults.exchange(0);
}

const char *cuda_emu_last_fault(void) {
    static __thread char buf[1024];
    ensure_init();
    std::lock_guard<std::mutex> g(P->fault_mu);
    snprintf(buf, sizeof buf, "%s", P->last_fault.c_str());
    return buf;
}

uint64_t cuda_emu_seed(void) {
    ensure_init();
    return P->seed;
}

} // extern "C"
