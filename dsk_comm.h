/* dsk_comm.h - ranks, bootstrap, backends (host TCP, NCCL), collectives, groups, gradient buckets.

   Usage: #define DSK_COMM_IMPLEMENTATION in exactly one .c file before including. The
   implementation needs POSIX (sockets, poll, pthreads): include this header first in that
   file, or compile with -D_GNU_SOURCE / -D_POSIX_C_SOURCE=200809L. Link with -lpthread
   (and -lnccl -lcudart under DSK_CUDA).
   Options: DSK_STATIC, DSK_MALLOC/DSK_FREE, DSK_CUDA (adds the nccl backend), DSK_NO_CUDA.

       dsk_comm c;
       DSK_CHECK(dsk_comm_init_env(&c, NULL));      // torchrun, srun or mpirun set the env
       DSK_CHECK(dsk_comm_all_reduce(&c, ctx, grad, grad, n, DSK_F32, DSK_COMM_AVG));
       dsk_comm_free(&c);

   Bootstrap. Rank 0 serves a small key-value store over TCP at MASTER_ADDR:MASTER_PORT
   (set, get that waits, add, barrier). The host backend's endpoints and the NCCL unique id
   pass through it. dsk_comm_spawn_local() starts n ranks on this machine with the
   environment filled in, the way torchrun does.

   Backends, one API. host: CPU buffers over TCP between every pair of ranks (works across
   machines). nccl (DSK_CUDA): device buffers on ctx->stream, a nonblocking communicator so
   init and every call is bounded by the timeout, ncclCommAbort on timeout or error.

   Semantics of the host backend (the reference the tests check exactly):
   - Counts are elements, never bytes. send == recv means in place.
   - Reductions fold the ranks' values in rank order 0, 1, ..., n-1: f32, f16 and bf16 in
     f32 (x0 + x1 + ... rounded once to the dtype at the end), integers in int64 (sums wrap
     to the dtype's width). AVG divides the f32 sum by n (integers: int64 division
     truncating toward zero). MAX and MIN propagate NaN. The order is the same for every
     message size and algorithm, so every rank gets bitwise the same result.
   - Small messages (<= opts.small_bytes) go in one round to every peer; large ones are
     reduce-scattered by direct exchange (each rank owns 1/n of the elements and receives
     only that part from every peer, pieces of opts.piece_bytes) and then all-gathered:
     each rank sends and receives 2(n-1)/n of the buffer, like a ring, but with no partial
     sums on the wire (bf16 stays bf16 on the wire yet is reduced in f32).
   - Every message carries a header (collective, dtype, count, op, root, call number), so
     mismatched calls on different ranks fail with DSK_ERR_PEER naming both sides.
   - Every wait ends by opts.timeout_s: DSK_ERR_TIMEOUT or DSK_ERR_PEER naming the rank.
     After such an error the communicator is unusable (DSK_ERR_STATE) until freed; its
     sockets are half-closed so that peers fail fast instead of waiting for the timeout.
   - A communicator is not thread-safe: one call at a time. Gradient buckets use their own
     communicator (split at init), so the parent stays free during backward.
   Every rank must issue the same collectives in the same order (as with NCCL and MPI).
   License: MIT, see the end of the file. */
#if defined(DSK_COMM_IMPLEMENTATION) && !defined(_GNU_SOURCE) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L
#endif
#ifndef DSK_COMM_H
#define DSK_COMM_H
#include "dsk_tensor.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef enum dsk_comm_backend {
    DSK_COMM_AUTO = 0, /* nccl when built with DSK_CUDA and a GPU is usable, else host */
    DSK_COMM_HOST,
    DSK_COMM_NCCL
} dsk_comm_backend;

typedef enum dsk_comm_op { DSK_COMM_SUM = 0, DSK_COMM_AVG, DSK_COMM_MAX, DSK_COMM_MIN } dsk_comm_op;

#define DSK_COMM_NO_COLOR (-1) /* dsk_comm_split: this rank joins no sub-group */

/* Zero fields take the defaults in brackets. */
typedef struct dsk_comm_opts {
    dsk_comm_backend backend; /* [DSK_COMM_AUTO] */
    double timeout_s;         /* [300] bound of every wait: bootstrap, collectives, buckets */
    const char *master_addr;  /* init: [MASTER_ADDR or "127.0.0.1"]; init_env: used if MASTER_ADDR is unset */
    int master_port;          /* init: [MASTER_PORT or 29500]; init_env: used if MASTER_PORT is unset */
    int local_rank;           /* init only, read when local_world_size > 0 */
    int local_world_size;     /* init only: [world_size, local_rank = rank] */
    size_t small_bytes;       /* [65536] host: messages up to this size use the one-round algorithm */
    size_t piece_bytes;       /* [4 MiB] host: pipelining piece of the large-message algorithm */
} dsk_comm_opts;

/* Bytes this rank sent and received, calls, and seconds spent inside collectives. */
typedef struct dsk_comm_stats {
    uint64_t bytes_sent, bytes_received;
    int64_t calls;
    double seconds;
} dsk_comm_stats;

typedef struct dsk__comm_impl dsk__comm_impl;
/* A communicator; the caller owns the struct, dsk_comm_init fills it. */
typedef struct dsk_comm {
    int rank, world_size;
    int local_rank, local_world_size;
    dsk_comm_backend backend; /* DSK_COMM_HOST or DSK_COMM_NCCL once initialised */
    dsk_comm_stats stats;     /* host backend: updated by every call */
    dsk__comm_impl *impl;
} dsk_comm;

/* Reads RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE (torchrun), else OMPI_COMM_WORLD_RANK/
   _SIZE/_LOCAL_RANK/_LOCAL_SIZE (Open MPI), else SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID
   (Slurm); MASTER_ADDR and MASTER_PORT (or opts) give the store. Then dsk_comm_init. */
DSK_API dsk_status dsk_comm_init_env(dsk_comm *c, const dsk_comm_opts *opts);
/* Collective over world_size processes: rank 0 serves the store, all meet through it.
   opts may be NULL. On failure *c is zeroed and everything opened is released. */
DSK_API dsk_status dsk_comm_init(dsk_comm *c, int rank, int world_size, const dsk_comm_opts *opts);
/* Releases sockets, threads, NCCL communicator; zeroed/freed ok. Free sub-groups first. */
DSK_API void dsk_comm_free(dsk_comm *c);
/* Collective over c: ranks with the same color form *sub, ordered by (key, rank).
   color DSK_COMM_NO_COLOR: *sub is zeroed (world_size 0). Same backend as c. */
DSK_API dsk_status dsk_comm_split(dsk_comm *c, int color, int key, dsk_comm *sub);

/* ---- collectives on (pointer, count, dtype). Host backend: CPU memory, ctx unused (may be
   NULL). nccl: device memory, enqueued on ctx->stream (NULL: the default stream); call
   dsk_comm_sync to wait with the timeout. Dtypes f32, f16, bf16, i32, i64, u8. */

/* recv (count) = op over ranks of send (count). */
DSK_API dsk_status dsk_comm_all_reduce(dsk_comm *c, dsk_ctx *ctx, const void *send, void *recv, int64_t count,
                                       dsk_dtype dt, dsk_comm_op op);
/* recv (recv_count) = op over ranks of block `rank` of send (world_size, recv_count). */
DSK_API dsk_status dsk_comm_reduce_scatter(dsk_comm *c, dsk_ctx *ctx, const void *send, void *recv,
                                           int64_t recv_count, dsk_dtype dt, dsk_comm_op op);
/* recv (world_size, send_count): block r = send of rank r. In place: send = recv + rank * send_count. */
DSK_API dsk_status dsk_comm_all_gather(dsk_comm *c, dsk_ctx *ctx, const void *send, void *recv, int64_t send_count,
                                       dsk_dtype dt);
/* recv (count) = send of rank `root` (send is read on root only). */
DSK_API dsk_status dsk_comm_broadcast(dsk_comm *c, dsk_ctx *ctx, const void *send, void *recv, int64_t count,
                                      dsk_dtype dt, int root);
/* send, recv (world_size, count): block p of send goes to rank p, block p of recv came from rank p. */
DSK_API dsk_status dsk_comm_all_to_all(dsk_comm *c, dsk_ctx *ctx, const void *send, void *recv, int64_t count,
                                       dsk_dtype dt);
/* The MoE dispatch primitive: send_counts[p] elements at send + send_displs[p] go to rank p;
   recv_counts[p] elements from rank p land at recv + recv_displs[p]. Arrays of world_size;
   NULL displacements mean packed (exclusive prefix sums of the counts). Counts may be 0.
   Not in place. Host: a rank that sends a count its peer does not expect fails naming both. */
DSK_API dsk_status dsk_comm_all_to_all_v(dsk_comm *c, dsk_ctx *ctx, const void *send, const int64_t *send_counts,
                                         const int64_t *send_displs, void *recv, const int64_t *recv_counts,
                                         const int64_t *recv_displs, dsk_dtype dt);
/* Point to point; each send must meet a recv of the same count and dtype on `peer`. */
DSK_API dsk_status dsk_comm_send(dsk_comm *c, dsk_ctx *ctx, const void *buf, int64_t count, dsk_dtype dt, int peer);
DSK_API dsk_status dsk_comm_recv(dsk_comm *c, dsk_ctx *ctx, void *buf, int64_t count, dsk_dtype dt, int peer);
/* Returns when every rank has entered the barrier. nccl: also waits for ctx's stream. */
DSK_API dsk_status dsk_comm_barrier(dsk_comm *c, dsk_ctx *ctx);
/* nccl: waits for ctx's stream, polling for NCCL errors, aborting at the timeout. host: no-op. */
DSK_API dsk_status dsk_comm_sync(dsk_comm *c, dsk_ctx *ctx);

/* ---- the same on contiguous tensors (CPU tensors on host, CUDA tensors on nccl). */
DSK_API dsk_status dsk_comm_all_reduce_tensor(dsk_comm *c, dsk_ctx *ctx, dsk_tensor *t, dsk_comm_op op); /* in place */
/* out numel = in numel / world_size, same dtype. */
DSK_API dsk_status dsk_comm_reduce_scatter_tensor(dsk_comm *c, dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *in,
                                                  dsk_comm_op op);
/* out numel = in numel * world_size, same dtype. */
DSK_API dsk_status dsk_comm_all_gather_tensor(dsk_comm *c, dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *in);
DSK_API dsk_status dsk_comm_broadcast_tensor(dsk_comm *c, dsk_ctx *ctx, dsk_tensor *t, int root); /* in place */
/* out, in: same shape and dtype, numel divisible by world_size. */
DSK_API dsk_status dsk_comm_all_to_all_tensor(dsk_comm *c, dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *in);

/* ---- the bootstrap store (world communicators and their sub-groups). Keys starting with
   "dsk/" are reserved. */
DSK_API dsk_status dsk_comm_store_set(dsk_comm *c, const char *key, const void *val, size_t len);
/* Waits (up to the timeout) until key exists; copies min(len, cap) bytes, *len = full length. */
DSK_API dsk_status dsk_comm_store_get(dsk_comm *c, const char *key, void *buf, size_t cap, size_t *len);
/* Adds delta to the int64 counter `key` (created at 0); *result (may be NULL) = new value. */
DSK_API dsk_status dsk_comm_store_add(dsk_comm *c, const char *key, int64_t delta, int64_t *result);
/* Through the store (no mesh traffic): returns when every rank of c has called it. */
DSK_API dsk_status dsk_comm_store_barrier(dsk_comm *c);

/* ---- local launcher */
typedef struct dsk_spawn_opts {
    const char *master_addr; /* ["127.0.0.1"] */
    int master_port;         /* [a free port] */
    double timeout_s;        /* [0: none] kill every rank (SIGKILL) after this long */
    int out_fd;              /* [1] where the ranks' prefixed output goes */
} dsk_spawn_opts;
/* Starts n copies of argv (argv[0] looked up in PATH) with RANK, WORLD_SIZE, LOCAL_RANK,
   LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, forwards each output line (stdout and
   stderr) as "[rank r] line", and waits for all. *worst_exit = the largest exit status
   (128 + signal for a rank killed by a signal). DSK_ERR_TIMEOUT if the timeout killed them. */
DSK_API dsk_status dsk_comm_spawn_local(int n, char *const argv[], const dsk_spawn_opts *opts, int *worst_exit);
/* A TCP port on addr that was free a moment ago (bind to port 0), for launchers and tests. */
DSK_API dsk_status dsk_comm_free_port(const char *addr, int *port);

/* ---- gradient buckets (DDP-style data parallelism)
   Gradients live in one flat buffer: parameter i occupies `counts[i]` elements right after
   parameter i - 1. Buckets take parameters in reverse order (backward produces the last
   first): the first bucket up to first_bucket_bytes, the others up to bucket_bytes (a
   parameter is never split; a bucket holds at least one). When backward has marked every
   parameter of a bucket ready, and every earlier bucket has started, the bucket's in-place
   all-reduce starts: on a progress thread (host) or on a communication stream after an
   event on ctx's stream (nccl), overlapping the rest of backward. Every rank must mark
   parameters in an order that completes buckets in the same order (backward does). */
typedef struct dsk_comm_bucket_opts {
    size_t first_bucket_bytes; /* [1 MiB] */
    size_t bucket_bytes;       /* [25 MiB] */
    int sum_only;              /* [0]: average by world size; 1: plain sum */
} dsk_comm_bucket_opts;

typedef struct dsk__buckets_impl dsk__buckets_impl;
typedef struct dsk_comm_buckets {
    int n_params, n_buckets;
    uint64_t bytes;      /* payload bytes all-reduced so far */
    double seconds;      /* time spent all-reducing (host: progress thread; nccl: comm stream) */
    int64_t reductions;  /* bucket all-reduces completed */
    dsk__buckets_impl *impl;
} dsk_comm_buckets;

/* Collective over c (splits a private communicator). flat: counts summed elements of dt
   (f32, f16, bf16) in CPU memory (host) or device memory (nccl); it must outlive b. */
DSK_API dsk_status dsk_comm_buckets_init(dsk_comm_buckets *b, dsk_comm *c, dsk_ctx *ctx, void *flat, dsk_dtype dt,
                                         int n_params, const int64_t *counts, const dsk_comm_bucket_opts *opts);
/* Starts a backward pass. sync = 0: a gradient-accumulation micro-batch, marks do nothing;
   sync = 1: the last micro-batch, buckets all-reduce as they fill. */
DSK_API dsk_status dsk_comm_buckets_begin(dsk_comm_buckets *b, int sync);
/* Parameter `param`'s gradient is final for this pass; may start bucket all-reduces. */
DSK_API dsk_status dsk_comm_buckets_mark_ready(dsk_comm_buckets *b, int param);
/* Before the optimizer: waits for every started all-reduce (the timeout bounds it). In a
   sync pass every parameter must have been marked. nccl: ctx's stream then waits too. */
DSK_API dsk_status dsk_comm_buckets_wait(dsk_comm_buckets *b);
/* Bucket i covers parameters [*first, *first + *count). */
DSK_API dsk_status dsk_comm_buckets_range(const dsk_comm_buckets *b, int i, int *first, int *count);
DSK_API void dsk_comm_buckets_free(dsk_comm_buckets *b); /* zeroed/freed ok */

DSK_API const char *dsk_comm_op_name(dsk_comm_op op); /* "sum", "avg", "max", "min" */

#ifdef __cplusplus
}
#endif
#endif /* DSK_COMM_H */
