/* nccl.cpp - NCCL of the CUDA emulation, for several processes on one machine.

   A communicator maps one POSIX shared-memory segment, named after the unique id (a split
   derives its child's name from the parent's): a header (world size, each rank's pid and
   state, the split exchange) and a single-producer single-consumer ring per ordered pair of
   ranks. Every call becomes a job on the caller's stream: its transfers (a 32-byte header,
   checked by the receiver, then the data) progress together until all are done, then the
   reductions run in rank order. Jobs of one communicator run in the order they were issued.
   Waits poll with a growing back-off; a local abort, a peer's abort flag or a peer process
   that is gone ends them with an error that ncclCommGetAsyncError reports. */
#include "emu.h"
#include "nccl.h"

#include <algorithm>
#include <condition_variable>
#include <errno.h>
#include <fcntl.h>
#include <map>
#include <mutex>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <string.h>
#include <string>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>
#include <vector>

namespace cuda_emu {
namespace {

const uint64_t kMagic = 0x6c6363756d656375ull;
const size_t kRing = (size_t)256 << 10;
const int kMaxRanks = 64;
const char kIdPrefix[] = "cuda_emu_nccl:";

struct rank_slot {
    std::atomic<int32_t> pid, arrived, aborted, split_color, split_key;
    std::atomic<int64_t> split_seq, split_ack;
    char pad[20];
};

struct seg_header {
    std::atomic<uint64_t> magic;
    std::atomic<int32_t> nranks, state; /* state: 0 fresh, 1 being set up, 2 ready */
    rank_slot ranks[kMaxRanks];
};

struct ring {
    std::atomic<uint64_t> head; /* bytes written (producer) */
    char pad0[56];
    std::atomic<uint64_t> tail; /* bytes read (consumer) */
    char pad1[56];
    char data[kRing];
};

struct msg_header {
    uint64_t magic, seq, bytes;
    int32_t kind, src;
};

enum op_kind { OP_ALL_REDUCE, OP_REDUCE, OP_BROADCAST, OP_REDUCE_SCATTER, OP_ALL_GATHER, OP_SEND, OP_RECV };
const char *op_name(int k) {
    static const char *n[] = {"ncclAllReduce", "ncclReduce", "ncclBroadcast", "ncclReduceScatter", "ncclAllGather", "ncclSend", "ncclRecv"};
    return k >= 0 && k <= OP_RECV ? n[k] : "an NCCL call";
}

struct comm {
    int rank = 0, nranks = 0, device = 0;
    bool blocking = true;
    std::string name;
    char *map = nullptr;
    size_t map_len = 0;
    seg_header *h = nullptr;
    ring *rings = nullptr;
    std::atomic<int> state{ncclInProgress};
    std::atomic<bool> aborted{false};
    std::mutex mu;
    std::condition_variable cv;
    uint64_t issued = 0, executed = 0;
    std::vector<uint64_t> sent, recvd; /* message counters per peer (jobs run one at a time) */
    int64_t splits = 0;
    std::mutex err_mu;
    std::string last_error;
    ~comm() {
        if (map) munmap(map, map_len);
    }
    ring *pair(int src, int dst) { return &rings[(size_t)src * nranks + dst]; }
};

struct nccl_op {
    int kind;
    const void *send;
    void *recv;
    size_t count;
    ncclDataType_t dt;
    ncclRedOp_t op;
    int root, peer;
};

__thread char t_last_error[1024];

ncclResult_t set_comm_error(comm *c, ncclResult_t r, const char *fmt, ...) CUDA_EMU_PRINTF(3, 4);
ncclResult_t set_comm_error(comm *c, ncclResult_t r, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    snprintf(t_last_error, sizeof t_last_error, "%s", buf);
    if (c) {
        std::lock_guard<std::mutex> g(c->err_mu);
        c->last_error = buf;
    }
    return r;
}

size_t type_size(ncclDataType_t t) {
    switch (t) {
    case ncclInt8:
    case ncclUint8:
    case ncclFloat8e4m3:
    case ncclFloat8e5m2: return 1;
    case ncclFloat16:
    case ncclBfloat16: return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32: return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64: return 8;
    default: return 0;
    }
}

/* ---------------------------------------------------------------- waiting */

struct backoff {
    int idle = 0;
    void wait() {
        if (++idle < 32) sched_yield();
        else usleep((useconds_t)(idle < 64 ? 20 : idle < 256 ? 100 : 500));
    }
};

bool process_gone(int pid) {
    char path[64], buf[256];
    if (pid <= 0) return false;
    if (kill(pid, 0) != 0 && errno == ESRCH) return true;
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return false;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *p = strrchr(buf, ')'); /* "pid (comm) S ..." */
    return p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}

/* ncclSuccess while the wait may go on; else why it cannot. */
ncclResult_t still_ok(comm &c, double *next_check) {
    if (c.aborted) return set_comm_error(&c, ncclInvalidUsage, "rank %d: the communicator was aborted", c.rank);
    if (now_s() < *next_check) return ncclSuccess;
    *next_check = now_s() + 0.05;
    for (int p = 0; p < c.nranks; p++) {
        if (p == c.rank) continue;
        if (c.h->ranks[p].aborted.load())
            return set_comm_error(&c, ncclRemoteError, "rank %d: rank %d aborted its communicator", c.rank, p);
        if (process_gone(c.h->ranks[p].pid.load()))
            return set_comm_error(&c, ncclRemoteError, "rank %d: rank %d (pid %d) is gone", c.rank, p, (int)c.h->ranks[p].pid.load());
    }
    return ncclSuccess;
}

/* ---------------------------------------------------------------- setup */

ncclResult_t attach(comm &c) {
    size_t len = sizeof(seg_header) + (size_t)c.nranks * c.nranks * sizeof(ring);
    int fd = shm_open(c.name.c_str(), O_CREAT | O_RDWR, 0600);
    double next = 0;
    backoff b;
    if (fd < 0) return set_comm_error(&c, ncclSystemError, "shm_open(%s): %s", c.name.c_str(), strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || ((size_t)st.st_size < len && ftruncate(fd, (off_t)len) != 0)) {
        close(fd);
        return set_comm_error(&c, ncclSystemError, "sizing %s to %zu bytes: %s", c.name.c_str(), len, strerror(errno));
    }
    c.map = (char *)mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (c.map == MAP_FAILED) {
        c.map = nullptr;
        return set_comm_error(&c, ncclSystemError, "mmap of %s: %s", c.name.c_str(), strerror(errno));
    }
    c.map_len = len;
    c.h = (seg_header *)c.map;
    c.rings = (ring *)(c.map + sizeof(seg_header));
    c.sent.assign((size_t)c.nranks, 0);
    c.recvd.assign((size_t)c.nranks, 0);
    int32_t fresh = 0;
    if (c.h->state.compare_exchange_strong(fresh, 1)) {
        c.h->nranks = c.nranks;
        c.h->magic = kMagic;
        c.h->state = 2;
    }
    while (c.h->state.load() != 2) {
        if (c.aborted) return set_comm_error(&c, ncclInvalidUsage, "rank %d: aborted during init", c.rank);
        b.wait();
    }
    if (c.h->nranks.load() != c.nranks)
        return set_comm_error(&c, ncclInvalidUsage, "rank %d was started with %d ranks, another rank with %d", c.rank, c.nranks,
                              (int)c.h->nranks.load());
    int32_t none = 0;
    if (!c.h->ranks[c.rank].pid.compare_exchange_strong(none, (int32_t)getpid()))
        return set_comm_error(&c, ncclInvalidUsage, "rank %d joined twice (pid %d already holds it)", c.rank, (int)none);
    c.h->ranks[c.rank].arrived = 1;
    for (int p = 0; p < c.nranks; p++) {
        while (!c.h->ranks[p].arrived.load()) {
            ncclResult_t r = still_ok(c, &next);
            if (r != ncclSuccess) return r;
            b.wait();
        }
    }
    shm_unlink(c.name.c_str()); /* everyone has it mapped */
    return ncclSuccess;
}

/* ---------------------------------------------------------------- transfers */

struct xfer {
    int peer, kind;
    bool send;
    char *buf;
    size_t bytes, done = 0, hdr_done = 0;
    msg_header hdr; /* sent, or expected */
    msg_header got; /* received */
};

size_t ring_write(ring *r, const char *p, size_t n) {
    uint64_t head = r->head.load(std::memory_order_relaxed), tail = r->tail.load(std::memory_order_acquire);
    size_t space = kRing - (size_t)(head - tail), at = (size_t)(head % kRing), first;
    if (n > space) n = space;
    first = n < kRing - at ? n : kRing - at;
    memcpy(r->data + at, p, first);
    memcpy(r->data, p + first, n - first);
    r->head.store(head + n, std::memory_order_release);
    return n;
}

size_t ring_read(ring *r, char *p, size_t n) {
    uint64_t tail = r->tail.load(std::memory_order_relaxed), head = r->head.load(std::memory_order_acquire);
    size_t avail = (size_t)(head - tail), at = (size_t)(tail % kRing), first;
    if (n > avail) n = avail;
    first = n < kRing - at ? n : kRing - at;
    memcpy(p, r->data + at, first);
    memcpy(p + first, r->data, n - first);
    r->tail.store(tail + n, std::memory_order_release);
    return n;
}

/* Moves what it can of x; true when x is complete. */
ncclResult_t step(comm &c, xfer &x, bool *moved, bool *complete) {
    if (x.send) {
        ring *r = c.pair(c.rank, x.peer);
        if (x.hdr_done < sizeof x.hdr) {
            size_t k = ring_write(r, (const char *)&x.hdr + x.hdr_done, sizeof x.hdr - x.hdr_done);
            x.hdr_done += k;
            *moved |= k > 0;
        }
        if (x.hdr_done == sizeof x.hdr && x.done < x.bytes) {
            size_t k = ring_write(r, x.buf + x.done, x.bytes - x.done);
            x.done += k;
            *moved |= k > 0;
        }
    } else {
        ring *r = c.pair(x.peer, c.rank);
        if (x.hdr_done < sizeof x.got) {
            size_t k = ring_read(r, (char *)&x.got + x.hdr_done, sizeof x.got - x.hdr_done);
            x.hdr_done += k;
            *moved |= k > 0;
            if (x.hdr_done == sizeof x.got &&
                (x.got.magic != kMagic || x.got.seq != x.hdr.seq || x.got.bytes != x.bytes || x.got.kind != x.kind))
                return set_comm_error(&c, ncclInvalidUsage,
                                      "rank %d: mismatched calls with rank %d: this rank is in %s expecting message %llu of %llu "
                                      "bytes, rank %d sent message %llu of %llu bytes from %s",
                                      c.rank, x.peer, op_name(x.kind), (unsigned long long)x.hdr.seq, (unsigned long long)x.bytes,
                                      x.peer, (unsigned long long)x.got.seq, (unsigned long long)x.got.bytes, op_name(x.got.kind));
        }
        if (x.hdr_done == sizeof x.hdr && x.done < x.bytes) {
            size_t k = ring_read(r, x.buf + x.done, x.bytes - x.done);
            x.done += k;
            *moved |= k > 0;
        }
    }
    *complete = x.hdr_done == sizeof x.hdr && x.done == x.bytes;
    return ncclSuccess;
}

ncclResult_t transfer(comm &c, std::vector<xfer> &xs) {
    std::vector<std::vector<size_t>> sendq((size_t)c.nranks), recvq((size_t)c.nranks);
    std::vector<size_t> sendi((size_t)c.nranks, 0), recvi((size_t)c.nranks, 0);
    size_t left = xs.size();
    double next = 0;
    backoff b;
    for (size_t i = 0; i < xs.size(); i++) {
        xfer &x = xs[i];
        x.hdr.magic = kMagic;
        x.hdr.bytes = x.bytes;
        x.hdr.kind = x.kind;
        x.hdr.src = c.rank;
        if (x.send) {
            x.hdr.seq = c.sent[(size_t)x.peer]++;
            sendq[(size_t)x.peer].push_back(i);
        } else {
            x.hdr.seq = c.recvd[(size_t)x.peer]++;
            recvq[(size_t)x.peer].push_back(i);
        }
    }
    while (left) {
        bool moved = false;
        for (int p = 0; p < c.nranks; p++)
            for (int dir = 0; dir < 2; dir++) {
                std::vector<size_t> &q = dir ? recvq[(size_t)p] : sendq[(size_t)p];
                size_t &at = dir ? recvi[(size_t)p] : sendi[(size_t)p];
                while (at < q.size()) { /* in order per peer and direction */
                    bool complete = false;
                    ncclResult_t r = step(c, xs[q[at]], &moved, &complete);
                    if (r != ncclSuccess) return r;
                    if (!complete) break;
                    at++;
                    left--;
                }
            }
        if (moved) {
            b.idle = 0;
            continue;
        }
        ncclResult_t r = still_ok(c, &next);
        if (r != ncclSuccess) return r;
        b.wait();
    }
    return ncclSuccess;
}

/* ---------------------------------------------------------------- reductions */

template <class T> T combine(T a, T b, ncclRedOp_t op) {
    switch (op) {
    case ncclProd: return (T)(a * b);
    case ncclMax: return b > a ? b : a;
    case ncclMin: return b < a ? b : a;
    default: return (T)(a + b);
    }
}

template <class T, class W> void reduce_native(void *dst, const std::vector<const char *> &src, size_t count, ncclRedOp_t op, int n) {
    for (size_t i = 0; i < count; i++) {
        W acc = (W)((const T *)src[0])[i];
        for (size_t r = 1; r < src.size(); r++) acc = combine<W>(acc, (W)((const T *)src[r])[i], op);
        if (op == ncclAvg) acc = (W)(acc / (W)n);
        ((T *)dst)[i] = (T)acc;
    }
}

float load_small(const char *p, ncclDataType_t t, size_t i) {
    switch (t) {
    case ncclFloat16: return f16_to_f32(((const unsigned short *)p)[i]);
    case ncclBfloat16: return bf16_to_f32(((const unsigned short *)p)[i]);
    case ncclFloat8e4m3: return e4m3_to_f32(((const unsigned char *)p)[i]);
    default: return e5m2_to_f32(((const unsigned char *)p)[i]);
    }
}
float round_small(float v, ncclDataType_t t, char *out, size_t i) {
    switch (t) {
    case ncclFloat16: ((unsigned short *)out)[i] = f32_to_f16(v); break;
    case ncclBfloat16: ((unsigned short *)out)[i] = f32_to_bf16(v); break;
    case ncclFloat8e4m3: ((unsigned char *)out)[i] = f32_to_e4m3(v); break;
    default: ((unsigned char *)out)[i] = f32_to_e5m2(v); break;
    }
    return load_small(out, t, i);
}

/* Half and fp8 types: every step rounds to the type, as the device's arithmetic does. */
void reduce_small(void *dst, const std::vector<const char *> &src, size_t count, ncclDataType_t t, ncclRedOp_t op, int n) {
    for (size_t i = 0; i < count; i++) {
        float acc = load_small(src[0], t, i);
        for (size_t r = 1; r < src.size(); r++) acc = round_small(combine<float>(acc, load_small(src[r], t, i), op), t, (char *)dst, i);
        if (op == ncclAvg) acc = acc / (float)n;
        round_small(acc, t, (char *)dst, i);
    }
}

/* Integers wrap (the sum in the unsigned type); avg divides the wrapped sum. */
void reduce(void *dst, const std::vector<const char *> &src, size_t count, ncclDataType_t t, ncclRedOp_t op, int n) {
    bool arith = op == ncclSum || op == ncclProd || op == ncclAvg;
    switch (t) {
    case ncclInt8: arith && op != ncclAvg ? reduce_native<int8_t, uint8_t>(dst, src, count, op, n) : reduce_native<int8_t, int8_t>(dst, src, count, op, n); break;
    case ncclUint8: reduce_native<uint8_t, uint8_t>(dst, src, count, op, n); break;
    case ncclInt32: arith && op != ncclAvg ? reduce_native<int32_t, uint32_t>(dst, src, count, op, n) : reduce_native<int32_t, int64_t>(dst, src, count, op, n); break;
    case ncclUint32: reduce_native<uint32_t, uint32_t>(dst, src, count, op, n); break;
    case ncclInt64: arith && op != ncclAvg ? reduce_native<int64_t, uint64_t>(dst, src, count, op, n) : reduce_native<int64_t, int64_t>(dst, src, count, op, n); break;
    case ncclUint64: reduce_native<uint64_t, uint64_t>(dst, src, count, op, n); break;
    case ncclFloat32: reduce_native<float, float>(dst, src, count, op, n); break;
    case ncclFloat64: reduce_native<double, double>(dst, src, count, op, n); break;
    default: reduce_small(dst, src, count, t, op, n); break;
    }
}

/* ---------------------------------------------------------------- jobs */

struct post_step {
    void *dst;
    std::vector<const char *> src;
    size_t count;
    ncclDataType_t dt;
    ncclRedOp_t op;
    const void *copy_from; /* a plain copy when set */
    size_t copy_bytes;
};

/* The transfers and reductions of one job (one call, or one group's calls). */
ncclResult_t run_ops(comm &c, const std::vector<nccl_op> &ops) {
    std::vector<xfer> xs;
    std::vector<post_step> post;
    std::vector<std::unique_ptr<std::vector<char>>> bufs; /* received blocks and copies of this rank's own input */
    int n = c.nranks, me = c.rank;
    auto scratch = [&bufs](size_t bytes) {
        bufs.emplace_back(new std::vector<char>(bytes ? bytes : 1));
        return bufs.back()->data();
    };
    auto add = [&xs](int peer, int kind, bool send, const void *buf, size_t bytes) {
        xfer x;
        memset(&x.hdr, 0, sizeof x.hdr);
        memset(&x.got, 0, sizeof x.got);
        x.peer = peer, x.kind = kind, x.send = send, x.buf = (char *)buf, x.bytes = bytes;
        xs.push_back(x);
    };
    for (const nccl_op &o : ops) {
        size_t es = type_size(o.dt), bytes = o.count * es;
        switch (o.kind) {
        case OP_ALL_REDUCE:
        case OP_REDUCE: {
            bool gets = o.kind == OP_ALL_REDUCE || me == o.root;
            post_step ps{o.recv, std::vector<const char *>((size_t)n), o.count, o.dt, o.op, nullptr, 0};
            char *own = scratch(bytes);
            memcpy(own, o.send, bytes);
            ps.src[(size_t)me] = own;
            for (int p = 0; p < n; p++) {
                if (p == me) continue;
                if (o.kind == OP_ALL_REDUCE || p == o.root) add(p, o.kind, true, o.send, bytes);
                if (gets) {
                    char *in = scratch(bytes);
                    add(p, o.kind, false, in, bytes);
                    ps.src[(size_t)p] = in;
                }
            }
            if (gets) post.push_back(ps);
            break;
        }
        case OP_BROADCAST:
            if (me == o.root) {
                for (int p = 0; p < n; p++)
                    if (p != me) add(p, o.kind, true, o.send, bytes);
                if (o.send != o.recv) post.push_back(post_step{o.recv, {}, 0, o.dt, o.op, o.send, bytes});
            } else {
                add(o.root, o.kind, false, o.recv, bytes);
            }
            break;
        case OP_REDUCE_SCATTER: {
            post_step ps{o.recv, std::vector<const char *>((size_t)n), o.count, o.dt, o.op, nullptr, 0};
            char *own = scratch(bytes);
            memcpy(own, (const char *)o.send + (size_t)me * bytes, bytes);
            ps.src[(size_t)me] = own;
            for (int p = 0; p < n; p++) {
                if (p == me) continue;
                add(p, o.kind, true, (const char *)o.send + (size_t)p * bytes, bytes);
                char *in = scratch(bytes);
                add(p, o.kind, false, in, bytes);
                ps.src[(size_t)p] = in;
            }
            post.push_back(ps);
            break;
        }
        case OP_ALL_GATHER: {
            char *own = scratch(bytes);
            memcpy(own, o.send, bytes);
            for (int p = 0; p < n; p++) {
                if (p == me) continue;
                add(p, o.kind, true, own, bytes);
                add(p, o.kind, false, (char *)o.recv + (size_t)p * bytes, bytes);
            }
            post.push_back(post_step{(char *)o.recv + (size_t)me * bytes, {}, 0, o.dt, o.op, own, bytes});
            break;
        }
        case OP_SEND: add(o.peer, OP_SEND, true, o.send, bytes); break;
        default: add(o.peer, OP_SEND, false, o.recv, bytes); break; /* matches the peer's send */
        }
    }
    ncclResult_t r = transfer(c, xs);
    if (r != ncclSuccess) return r;
    for (post_step &ps : post) {
        if (ps.copy_from) memmove(ps.dst, ps.copy_from, ps.copy_bytes);
        else reduce(ps.dst, ps.src, ps.count, ps.dt, ps.op, n);
    }
    return ncclSuccess;
}

void run_job(const std::shared_ptr<comm> &cp, const std::vector<nccl_op> &ops, uint64_t seq) {
    comm &c = *cp;
    {
        std::unique_lock<std::mutex> lk(c.mu);
        c.cv.wait(lk, [&] { return c.executed == seq || c.aborted; });
    }
    if (!c.aborted && c.state.load() == ncclSuccess) {
        ncclResult_t r = run_ops(c, ops);
        if (r != ncclSuccess) {
            int ok = ncclSuccess;
            c.state.compare_exchange_strong(ok, r);
        }
    }
    {
        std::lock_guard<std::mutex> g(c.mu);
        c.executed++;
    }
    c.cv.notify_all();
}

/* ---------------------------------------------------------------- handles, groups */

} // namespace
} // namespace cuda_emu

struct ncclComm {
    std::shared_ptr<cuda_emu::comm> c;
};

using namespace cuda_emu;

namespace {

struct pending {
    std::shared_ptr<comm> c;
    stream *s;
    nccl_op op;
};
__thread int t_group_depth;
__thread std::vector<pending> *t_group;

ncclResult_t issue_job(const std::shared_ptr<comm> &c, stream *s, const std::vector<nccl_op> &ops) {
    op_maker make = [c, ops]() -> op_fn {
        uint64_t seq;
        {
            std::lock_guard<std::mutex> g(c->mu);
            seq = c->issued++;
        }
        return [c, ops, seq]() { run_job(c, ops, seq); };
    };
    if (issue(s, ops.size() == 1 ? op_name(ops[0].kind) : "ncclGroupEnd", make) != cudaSuccess)
        return set_comm_error(c.get(), ncclUnhandledCudaError, "issuing on the stream failed: %s", cudaGetErrorString(cudaGetLastError()));
    return ncclSuccess;
}

/* Checks a call and issues it (or keeps it for the group's end). */
ncclResult_t call(ncclComm_t h, cudaStream_t sh, const nccl_op &o, size_t send_bytes, size_t recv_bytes) {
    const char *fn = op_name(o.kind);
    cudaError_t e;
    stream *s;
    ensure_init();
    if (!h || !h->c) return set_comm_error(nullptr, ncclInvalidArgument, "%s: comm is NULL", fn);
    comm &c = *h->c;
    if (c.state.load() != ncclSuccess)
        return set_comm_error(&c, ncclInvalidUsage, "%s: the communicator is %s", fn,
                              c.state.load() == ncclInProgress ? "still being set up" : "in an error state");
    if (!type_size(o.dt)) return set_comm_error(&c, ncclInvalidArgument, "%s: datatype %d", fn, (int)o.dt);
    if (o.op < ncclSum || o.op >= ncclNumOps) return set_comm_error(&c, ncclInvalidArgument, "%s: reduction op %d", fn, (int)o.op);
    if ((o.kind == OP_REDUCE || o.kind == OP_BROADCAST) && (o.root < 0 || o.root >= c.nranks))
        return set_comm_error(&c, ncclInvalidArgument, "%s: root %d of %d ranks", fn, o.root, c.nranks);
    if ((o.kind == OP_SEND || o.kind == OP_RECV) && (o.peer < 0 || o.peer >= c.nranks))
        return set_comm_error(&c, ncclInvalidArgument, "%s: peer %d of %d ranks", fn, o.peer, c.nranks);
    if (!(s = get_stream(sh, &e))) {
        (void)cudaGetLastError();
        return set_comm_error(&c, ncclInvalidArgument, "%s: stream %p is not a live stream", fn, (void *)sh);
    }
    if (stream_device(s) != c.device)
        return set_comm_error(&c, ncclInvalidArgument, "%s: a stream of device %d for a communicator of device %d", fn, stream_device(s),
                              c.device);
    {
        char what[96];
        snprintf(what, sizeof what, "%s send buffer", fn);
        if (send_bytes && !device_range_ok(what, o.send, send_bytes, c.device))
            return set_comm_error(&c, ncclInvalidArgument, "%s: %s", fn, cuda_emu_last_fault());
        snprintf(what, sizeof what, "%s receive buffer", fn);
        if (recv_bytes && !device_range_ok(what, o.recv, recv_bytes, c.device))
            return set_comm_error(&c, ncclInvalidArgument, "%s: %s", fn, cuda_emu_last_fault());
    }
    if (t_group_depth > 0) {
        t_group->push_back(pending{h->c, s, o});
        return ncclSuccess;
    }
    return issue_job(h->c, s, std::vector<nccl_op>{o});
}

ncclResult_t init_rank(ncclComm_t *out, int nranks, const ncclUniqueId &id, int rank, const ncclConfig_t *cfg) {
    int dev = 0;
    ensure_init();
    if (!out) return set_comm_error(nullptr, ncclInvalidArgument, "ncclCommInitRank: comm is NULL");
    *out = nullptr;
    if (nranks < 1 || nranks > kMaxRanks || rank < 0 || rank >= nranks)
        return set_comm_error(nullptr, ncclInvalidArgument, "ncclCommInitRank: rank %d of %d (at most %d ranks)", rank, nranks, kMaxRanks);
    if (memcmp(id.internal, kIdPrefix, sizeof kIdPrefix - 1))
        return set_comm_error(nullptr, ncclInvalidArgument, "ncclCommInitRank: the unique id does not come from ncclGetUniqueId");
    if (cudaGetDevice(&dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return set_comm_error(nullptr, ncclUnhandledCudaError, "ncclCommInitRank: no CUDA device");
    }
    std::shared_ptr<comm> c = std::make_shared<comm>();
    c->rank = rank;
    c->nranks = nranks;
    c->device = dev;
    c->blocking = !(cfg && cfg->blocking != NCCL_CONFIG_UNDEF_INT && cfg->blocking == 0);
    c->name = std::string("/") + std::string(id.internal + sizeof kIdPrefix - 1, strnlen(id.internal + sizeof kIdPrefix - 1, 64));
    *out = new ncclComm{c};
    if (c->blocking) {
        ncclResult_t r = attach(*c);
        c->state = r;
        return r;
    }
    std::thread([c]() { c->state = attach(*c); }).detach();
    return ncclInProgress;
}

/* The split exchange over the parent's header: publish (color, key), wait for everyone,
   read, acknowledge, wait for every acknowledgement (so the slots can be reused). */
ncclResult_t split_work(const std::shared_ptr<comm> &cp, int color, int key, bool blocking, ncclComm_t *newcomm) {
    comm &c = *cp;
    int64_t k = ++c.splits;
    rank_slot &mine = c.h->ranks[c.rank];
    double next = 0;
    backoff b;
    std::vector<std::pair<int, int>> group; /* (key, parent rank) of my color */
    mine.split_color = color;
    mine.split_key = key;
    mine.split_seq.store(k);
    for (int p = 0; p < c.nranks; p++)
        while (c.h->ranks[p].split_seq.load() < k) {
            ncclResult_t r = still_ok(c, &next);
            if (r != ncclSuccess) return r;
            b.wait();
        }
    for (int p = 0; p < c.nranks; p++)
        if (color >= 0 && c.h->ranks[p].split_color.load() == color) group.push_back({c.h->ranks[p].split_key.load(), p});
    mine.split_ack.store(k);
    for (int p = 0; p < c.nranks; p++)
        while (c.h->ranks[p].split_ack.load() < k) {
            ncclResult_t r = still_ok(c, &next);
            if (r != ncclSuccess) return r;
            b.wait();
        }
    if (color < 0) {
        *newcomm = nullptr;
        return ncclSuccess;
    }
    std::sort(group.begin(), group.end());
    std::shared_ptr<comm> nc = std::make_shared<comm>();
    nc->nranks = (int)group.size();
    for (size_t i = 0; i < group.size(); i++)
        if (group[i].second == c.rank) nc->rank = (int)i;
    nc->device = c.device;
    nc->blocking = blocking;
    nc->name = c.name + "_s" + std::to_string(k) + "_c" + std::to_string(color);
    ncclResult_t r = attach(*nc);
    nc->state = r;
    *newcomm = new ncclComm{nc};
    return r;
}

} // namespace

extern "C" {

ncclResult_t ncclGetVersion(int *version) {
    if (!version) return ncclInvalidArgument;
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    unsigned char rnd[16];
    static std::atomic<unsigned> counter{0};
    char *p;
    if (!id) return set_comm_error(nullptr, ncclInvalidArgument, "ncclGetUniqueId: id is NULL");
    if (getrandom(rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd) {
        uint64_t s = (uint64_t)getpid() ^ (uint64_t)(now_s() * 1e9);
        for (size_t i = 0; i < sizeof rnd; i++) rnd[i] = (unsigned char)next_random(&s);
    }
    memset(id, 0, sizeof *id);
    p = id->internal + snprintf(id->internal, sizeof id->internal, "%scuda_emu_nccl_%d_%u_", kIdPrefix, (int)getpid(), counter++);
    for (size_t i = 0; i < sizeof rnd; i++) p += snprintf(p, 3, "%02x", rnd[i]);
    return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
    return init_rank(comm, nranks, id, rank, nullptr);
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t *config) {
    return init_rank(comm, nranks, id, rank, config);
}

ncclResult_t ncclCommSplit(ncclComm_t h, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config) {
    if (!h || !h->c || !newcomm) return set_comm_error(nullptr, ncclInvalidArgument, "ncclCommSplit: NULL argument");
    std::shared_ptr<comm> c = h->c;
    bool blocking = config && config->blocking != NCCL_CONFIG_UNDEF_INT ? config->blocking != 0 : c->blocking;
    if (c->state.load() != ncclSuccess) return set_comm_error(c.get(), ncclInvalidUsage, "ncclCommSplit: the parent is not ready");
    if (color < 0 && color != NCCL_SPLIT_NOCOLOR) return set_comm_error(c.get(), ncclInvalidArgument, "ncclCommSplit: color %d", color);
    *newcomm = nullptr;
    if (c->blocking) return split_work(c, color, key, blocking, newcomm);
    c->state = ncclInProgress;
    std::thread([c, color, key, blocking, newcomm]() {
        ncclComm_t nc = nullptr;
        ncclResult_t r = split_work(c, color, key, blocking, &nc);
        *newcomm = nc;
        c->state = r;
    }).detach();
    return ncclInProgress;
}

static void wait_jobs(comm &c) {
    std::unique_lock<std::mutex> lk(c.mu);
    c.cv.wait(lk, [&c] { return c.executed == c.issued; });
}

ncclResult_t ncclCommFinalize(ncclComm_t h) {
    if (!h || !h->c) return set_comm_error(nullptr, ncclInvalidArgument, "ncclCommFinalize: comm is NULL");
    std::shared_ptr<comm> c = h->c;
    if (c->blocking) {
        wait_jobs(*c);
        return (ncclResult_t)c->state.load();
    }
    int was = c->state.exchange(ncclInProgress);
    std::thread([c, was]() {
        wait_jobs(*c);
        int ok = ncclInProgress;
        c->state.compare_exchange_strong(ok, was);
    }).detach();
    return ncclInProgress;
}

ncclResult_t ncclCommDestroy(ncclComm_t h) {
    if (!h) return ncclInvalidArgument;
    if (h->c) wait_jobs(*h->c);
    delete h;
    return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t h) {
    if (!h) return ncclInvalidArgument;
    if (h->c) {
        comm &c = *h->c;
        c.aborted = true;
        if (c.h) c.h->ranks[c.rank].aborted = 1;
        shm_unlink(c.name.c_str());
        {
            std::lock_guard<std::mutex> g(c.mu);
        }
        c.cv.notify_all();
    }
    delete h;
    return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t h, ncclResult_t *async_error) {
    if (!h || !h->c || !async_error) return ncclInvalidArgument;
    *async_error = (ncclResult_t)h->c->state.load();
    return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t h, int *count) {
    if (!h || !h->c || !count) return ncclInvalidArgument;
    *count = h->c->nranks;
    return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t h, int *device) {
    if (!h || !h->c || !device) return ncclInvalidArgument;
    *device = h->c->device;
    return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t h, int *rank) {
    if (!h || !h->c || !rank) return ncclInvalidArgument;
    *rank = h->c->rank;
    return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

const char *ncclGetLastError(ncclComm_t h) {
    static __thread char buf[1024];
    if (h && h->c) {
        std::lock_guard<std::mutex> g(h->c->err_mu);
        snprintf(buf, sizeof buf, "%s", h->c->last_error.c_str());
        return buf;
    }
    return t_last_error;
}

ncclResult_t ncclGroupStart(void) {
    if (t_group_depth++ == 0) {
        if (!t_group) t_group = new std::vector<pending>();
        t_group->clear();
    }
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
    if (t_group_depth <= 0) return set_comm_error(nullptr, ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
    if (--t_group_depth > 0) return ncclSuccess;
    std::vector<pending> ops;
    ops.swap(*t_group);
    /* one job per communicator, its calls in order */
    std::vector<comm *> order;
    std::map<comm *, std::vector<nccl_op>> by;
    std::map<comm *, pending> first;
    for (const pending &p : ops) {
        comm *c = p.c.get();
        if (!by.count(c)) {
            order.push_back(c);
            first.insert({c, p});
        } else if (first.at(c).s != p.s) {
            return set_comm_error(c, ncclInvalidUsage, "ncclGroupEnd: calls of one communicator on two streams in one group (cuda_emu "
                                  "runs a communicator's group on one stream)");
        }
        by[c].push_back(p.op);
    }
    for (comm *c : order) {
        const pending &p = first.at(c);
        ncclResult_t r = issue_job(p.c, p.s, by[c]);
        if (r != ncclSuccess) return r;
    }
    return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t dt, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream) {
    size_t b = count * type_size(dt);
    return call(comm, stream, nccl_op{OP_ALL_REDUCE, send, recv, count, dt, op, 0, 0}, b, b);
}

ncclResult_t ncclReduce(const void *send, void *recv, size_t count, ncclDataType_t dt, ncclRedOp_t op, int root, ncclComm_t comm,
                        cudaStream_t stream) {
    size_t b = count * type_size(dt);
    bool is_root = comm && comm->c && comm->c->rank == root;
    return call(comm, stream, nccl_op{OP_REDUCE, send, recv, count, dt, op, root, 0}, b, is_root ? b : 0);
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t dt, int root, ncclComm_t comm,
                           cudaStream_t stream) {
    size_t b = count * type_size(dt);
    bool is_root = comm && comm->c && comm->c->rank == root;
    return call(comm, stream, nccl_op{OP_BROADCAST, send, recv, count, dt, ncclSum, root, 0}, is_root ? b : 0, b);
}

ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t dt, int root, ncclComm_t comm, cudaStream_t stream) {
    return ncclBroadcast(buff, buff, count, dt, root, comm, stream);
}

ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t recvcount, ncclDataType_t dt, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
    size_t b = recvcount * type_size(dt);
    int n = comm && comm->c ? comm->c->nranks : 1;
    return call(comm, stream, nccl_op{OP_REDUCE_SCATTER, send, recv, recvcount, dt, op, 0, 0}, b * (size_t)n, b);
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t sendcount, ncclDataType_t dt, ncclComm_t comm, cudaStream_t stream) {
    size_t b = sendcount * type_size(dt);
    int n = comm && comm->c ? comm->c->nranks : 1;
    return call(comm, stream, nccl_op{OP_ALL_GATHER, send, recv, sendcount, dt, ncclSum, 0, 0}, b, b * (size_t)n);
}

ncclResult_t ncclSend(const void *send, size_t count, ncclDataType_t dt, int peer, ncclComm_t comm, cudaStream_t stream) {
    return call(comm, stream, nccl_op{OP_SEND, send, nullptr, count, dt, ncclSum, 0, peer}, count * type_size(dt), 0);
}

ncclResult_t ncclRecv(void *recv, size_t count, ncclDataType_t dt, int peer, ncclComm_t comm, cudaStream_t stream) {
    return call(comm, stream, nccl_op{OP_RECV, nullptr, recv, count, dt, ncclSum, 0, peer}, 0, count * type_size(dt));
}

} // extern "C"
