/* memory.cpp - device memory of the CUDA emulation: one reserved mapping per device with a
   first-fit allocator, red zones, a quarantine, pointer classification, the PROT_NONE
   window, and the registry of pinned, registered and managed host memory. */
#include "emu.h"

#include <deque>
#include <map>
#include <mutex>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#ifdef CUDA_EMU_ASAN
#include <sanitizer/asan_interface.h>
#endif

namespace cuda_emu {

static const size_t kDeviceBytes = (size_t)4 << 30;
static const size_t kAlign = 256;       /* cudaMalloc's alignment */
static const size_t kRedZone = 256;     /* at least this much after every allocation */
static const size_t kQuarantine = (size_t)256 << 20;
static const unsigned char kFresh = 0xff, kFreed = 0xdd, kCanary = 0xcb;

namespace {

struct block {
    size_t user, total;
};

struct heap {
    std::map<size_t, size_t> free_ranges;        /* offset -> length */
    std::map<size_t, block> used;                /* offset -> block */
    std::deque<std::pair<size_t, size_t>> quarantine;
    size_t quarantined = 0, used_bytes = 0;
};

struct host_region {
    size_t size;
    mem_class cls;
    bool registered; /* cudaHostRegister'ed user memory (not ours to free) */
};

struct memory_state {
    std::mutex mu;
    char *base = nullptr;
    size_t total = 0;
    int devices = 0;
    heap *heaps = nullptr;
    std::map<uintptr_t, host_region> host;
    std::mutex window_mu;
    int window = 0;
    bool protect = true;
};

memory_state *M;

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

void release_range(heap &h, size_t off, size_t len) {
    auto next = h.free_ranges.lower_bound(off);
    if (next != h.free_ranges.end() && off + len == next->first) {
        len += next->second;
        next = h.free_ranges.erase(next);
    }
    if (next != h.free_ranges.begin()) {
        auto prev = std::prev(next);
        if (prev->first + prev->second == off) {
            prev->second += len;
            return;
        }
    }
    h.free_ranges[off] = len;
}

/* Red zone intact? (canaries are not used under ASan, which poisons the zone instead) */
bool red_zone_intact(const char *p, const block &b) {
#ifdef CUDA_EMU_ASAN
    (void)p, (void)b;
    return true;
#else
    /* every byte a canary: the first one is, and each equals the next (one memcmp: the check runs over
       every allocation after every launch) */
    const char *z = p + b.user;
    size_t n = b.total - b.user; /* at least kRedZone */
    return (unsigned char)z[0] == kCanary && memcmp(z, z + 1, n - 1) == 0;
#endif
}

void report_overrun(const char *p, const block &b, const char *when) {
    size_t first = b.user;
    while (first < b.total && (unsigned char)p[first] == kCanary) first++;
    fault("device memory overrun found %s: the %zu-byte allocation at %p was written at byte %zu, past its end", when, b.user,
          (const void *)p, first);
}

} // namespace

void memory_init(int devices) {
    M = new memory_state();
    const char *prot = getenv("CUDA_EMU_PROTECT");
    M->protect = !(prot && !strcmp(prot, "0"));
    M->devices = devices;
    M->total = kDeviceBytes * (size_t)(devices > 0 ? devices : 1);
    {   /* 2 MiB aligned, in huge pages where the kernel allows: mprotect then updates 512x
           fewer page-table entries when the PROT_NONE window opens and closes */
        const size_t huge = (size_t)2 << 20;
        char *raw = (char *)mmap(nullptr, M->total + huge, M->protect ? PROT_NONE : PROT_READ | PROT_WRITE,
                                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (raw == MAP_FAILED) {
            fprintf(stderr, "cuda_emu: cannot reserve %zu bytes of device memory\n", M->total);
            abort();
        }
        M->base = (char *)(((uintptr_t)raw + huge - 1) & ~(uintptr_t)(huge - 1));
        madvise(M->base, M->total, MADV_HUGEPAGE);
    }
    M->heaps = new heap[devices > 0 ? devices : 1];
    for (int d = 0; d < devices; d++) M->heaps[d].free_ranges[kAlign] = kDeviceBytes - kAlign;
}

size_t device_capacity() { return kDeviceBytes; }

size_t device_used(int device) {
    std::lock_guard<std::mutex> g(M->mu);
    return M->heaps[device].used_bytes;
}

device_access::device_access() {
    if (!M->protect) return;
    std::lock_guard<std::mutex> g(M->window_mu);
    if (M->window++ == 0) mprotect(M->base, M->total, PROT_READ | PROT_WRITE);
}

device_access::~device_access() {
    if (!M->protect) return;
    std::lock_guard<std::mutex> g(M->window_mu);
    if (--M->window == 0) mprotect(M->base, M->total, PROT_NONE);
}

const char *mem_class_name(mem_class c) {
    switch (c) {
    case MEM_DEVICE: return "device memory";
    case MEM_FREED: return "freed (or never allocated) device memory";
    case MEM_PINNED: return "pinned host memory";
    case MEM_MANAGED: return "managed memory";
    default: return "host memory";
    }
}

mem_info classify(const void *p) {
    mem_info r;
    uintptr_t u = (uintptr_t)p, b = (uintptr_t)M->base;
    memset(&r, 0, sizeof r);
    r.cls = MEM_HOST;
    std::lock_guard<std::mutex> g(M->mu);
    if (u >= b && u < b + M->total) {
        size_t off = u - b;
        heap &h = M->heaps[off / kDeviceBytes];
        size_t hoff = off % kDeviceBytes;
        r.device = (int)(off / kDeviceBytes);
        r.cls = MEM_FREED;
        auto it = h.used.upper_bound(hoff);
        if (it != h.used.begin()) {
            --it;
            if (hoff < it->first + it->second.total) {
                r.cls = MEM_DEVICE;
                r.base = M->base + (off - hoff) + it->first;
                r.size = it->second.user;
            }
        }
        return r;
    }
    auto it = M->host.upper_bound(u);
    if (it != M->host.begin()) {
        --it;
        if (u < it->first + it->second.size) {
            r.cls = it->second.cls;
            r.base = (const char *)it->first;
            r.size = it->second.size;
        }
    }
    return r;
}

bool device_range_ok(const char *what, const void *p, size_t n, int device) {
    if (n == 0) return true;
    mem_info m = classify(p);
    if (m.cls == MEM_MANAGED && (const char *)p + n <= m.base + m.size) return true;
    if (m.cls != MEM_DEVICE) {
        if (m.cls == MEM_FREED) fault("%s: %p is freed (or never allocated) device memory of device %d", what, p, m.device);
        else fault("%s: %p is %s, not device memory", what, p, mem_class_name(m.cls));
        return false;
    }
    if (device >= 0 && m.device != device) {
        fault("%s: %p is memory of device %d, not of device %d", what, p, m.device, device);
        return false;
    }
    if ((const char *)p + n > m.base + m.size) {
        fault("%s: %zu bytes at %p run %zu bytes past the end of the %zu-byte allocation at %p", what, n, p,
              (size_t)((const char *)p + n - (m.base + m.size)), m.size, (const void *)m.base);
        return false;
    }
    return true;
}

bool host_range_ok(const char *what, const void *p, size_t n) {
    if (n == 0) return true;
    mem_info m = classify(p);
    if (m.cls == MEM_DEVICE || m.cls == MEM_FREED) {
        fault("%s: %p is %s of device %d, not host memory", what, p, mem_class_name(m.cls), m.device);
        return false;
    }
    return true;
}

void *device_alloc(int device, size_t n) {
    size_t total = round_up(n ? n : 1, kAlign) + kRedZone, off = 0;
    heap &h = M->heaps[device];
    char *p;
    {
        std::lock_guard<std::mutex> g(M->mu);
        for (int pass = 0; pass < 2 && !off; pass++) {
            for (auto &fr : h.free_ranges)
                if (fr.second >= total) {
                    off = fr.first;
                    size_t len = fr.second;
                    h.free_ranges.erase(fr.first);
                    if (len > total) h.free_ranges[off + total] = len - total;
                    break;
                }
            if (!off && pass == 0) { /* give the quarantine back before failing */
                for (auto &q : h.quarantine) release_range(h, q.first, q.second);
                h.quarantine.clear();
                h.quarantined = 0;
            }
        }
        if (!off) return nullptr;
    }
    p = M->base + (size_t)device * kDeviceBytes + off;
    {
        device_access a;
#ifdef CUDA_EMU_ASAN
        ASAN_UNPOISON_MEMORY_REGION(p, n);
        memset(p, kFresh, n);
        ASAN_POISON_MEMORY_REGION(p + n, total - n);
#else
        memset(p, kFresh, n);
        memset(p + n, kCanary, total - n);
#endif
    }
    /* listed only now: the red-zone check never sees a zone before its canary is in place */
    std::lock_guard<std::mutex> g(M->mu);
    h.used[off] = block{n, total};
    h.used_bytes += n;
    return p;
}

bool device_free(const void *ptr, const char *what) {
    uintptr_t u = (uintptr_t)ptr, b = (uintptr_t)M->base;
    if (u < b || u >= b + M->total) {
        fault("%s: %p is %s, not a device allocation", what, ptr, mem_class_name(classify(ptr).cls));
        return false;
    }
    size_t off = u - b, hoff = off % kDeviceBytes;
    heap &h = M->heaps[off / kDeviceBytes];
    block bl;
    {
        std::lock_guard<std::mutex> g(M->mu);
        auto it = h.used.find(hoff);
        if (it == h.used.end()) {
            bool inside = false;
            auto in = h.used.upper_bound(hoff);
            if (in != h.used.begin()) inside = hoff < std::prev(in)->first + std::prev(in)->second.total;
            if (inside) fault("%s: %p points into an allocation, not at its start", what, ptr);
            else fault("%s: %p is not a live device allocation (freed twice, or never allocated)", what, ptr);
            return false;
        }
        bl = it->second;
        h.used.erase(it);
        h.used_bytes -= bl.user;
    }
    {
        char *p = (char *)ptr;
        device_access a;
        if (!red_zone_intact(p, bl)) report_overrun(p, bl, "when it was freed");
#ifdef CUDA_EMU_ASAN
        ASAN_POISON_MEMORY_REGION(p, bl.total);
#else
        memset(p, kFreed, bl.total);
#endif
    }
    std::lock_guard<std::mutex> g(M->mu);
    h.quarantine.push_back({hoff, bl.total});
    h.quarantined += bl.total;
    while (h.quarantined > kQuarantine) {
        release_range(h, h.quarantine.front().first, h.quarantine.front().second);
        h.quarantined -= h.quarantine.front().second;
        h.quarantine.pop_front();
    }
    return true;
}

bool check_red_zones(const char *after) {
    bool ok = true;
#ifdef CUDA_EMU_ASAN
    (void)after;
#else
    std::lock_guard<std::mutex> g(M->mu);
    for (int d = 0; d < M->devices; d++)
        for (auto &u : M->heaps[d].used) {
            char *p = M->base + (size_t)d * kDeviceBytes + u.first;
            if (!red_zone_intact(p, u.second)) {
                char when[256];
                snprintf(when, sizeof when, "after %s", after);
                report_overrun(p, u.second, when);
                memset(p + u.second.user, kCanary, u.second.total - u.second.user); /* report it once */
                ok = false;
            }
        }
#endif
    return ok;
}

void *host_alloc(size_t n, mem_class cls) {
    void *p = nullptr;
    size_t len = round_up(n ? n : 1, 4096);
    if (posix_memalign(&p, 4096, len) != 0) return nullptr;
    std::lock_guard<std::mutex> g(M->mu);
    M->host[(uintptr_t)p] = host_region{len, cls, false};
    return p;
}

bool host_free(void *p, mem_class cls) {
    {
        std::lock_guard<std::mutex> g(M->mu);
        auto it = M->host.find((uintptr_t)p);
        if (it == M->host.end() || it->second.cls != cls || it->second.registered) return false;
        M->host.erase(it);
    }
    free(p);
    return true;
}

bool host_register(void *p, size_t n) {
    std::lock_guard<std::mutex> g(M->mu);
    uintptr_t u = (uintptr_t)p;
    auto it = M->host.upper_bound(u + n - 1);
    if (it != M->host.begin() && std::prev(it)->first + std::prev(it)->second.size > u) return false;
    M->host[u] = host_region{n, MEM_PINNED, true};
    return true;
}

bool host_unregister(void *p) {
    std::lock_guard<std::mutex> g(M->mu);
    auto it = M->host.find((uintptr_t)p);
    if (it == M->host.end() || !it->second.registered) return false;
    M->host.erase(it);
    return true;
}

} // namespace cuda_emu
