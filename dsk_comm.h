/* dsk_comm.h - ranks, bootstrap, backends (host TCP, NCCL), collectives, groups.

   Usage: #define DSK_COMM_IMPLEMENTATION in exactly one .c file before including. The
   implementation needs POSIX 2008 (sockets, poll, pthreads, shm_open) and GCC or Clang (the
   shared-memory rings use the __atomic builtins, the C11 memory model in C and C++ alike).
   The dsk headers ask for POSIX themselves: in that file, put the DSK_*_IMPLEMENTATION defines
   and the dsk includes (in any order among themselves) before any system header, or compile
   with -D_GNU_SOURCE (Linux: lets a waiting rank see which CPU it runs on) or
   -D_POSIX_C_SOURCE=200809L (where a system header came first and hid POSIX, as under glibc
   with -std=c11, the build stops at an #error that says so). Link with -lpthread (and -lnccl
   -lcudart under DSK_CUDA).
   Options: DSK_STATIC, DSK_MALLOC/DSK_FREE, DSK_CUDA (adds the nccl backend), DSK_NO_CUDA;
   DSK_COMM_NO_LAUNCHER leaves out the local launcher (dsk_comm_spawn_local: fork and exec).
   dsk_comm_options() names the switches the implementation was built with.

   Example (given dsk_ctx *ctx, float *grad, int64_t n):
       dsk_comm c;
       if (dsk_comm_init_env(&c, NULL) != DSK_OK) {   // torchrun, srun or mpirun set the env
           fprintf(stderr, "%s\n", dsk_last_error()); // names the function, the rank, the values
           return 1;
       }
       if (dsk_comm_all_reduce(&c, ctx, grad, grad, n, DSK_F32, DSK_COMM_AVG) != DSK_OK)
           fprintf(stderr, "%s\n", dsk_last_error());
       dsk_comm_free(&c);
   End of example.

   Bootstrap. Rank 0 serves a small key-value store over TCP at MASTER_ADDR:MASTER_PORT
   (set, get that waits, add, barrier). The host backend's endpoints and the NCCL unique id
   pass through it. dsk_comm_spawn_local() starts n ranks on this machine with the
   environment filled in, the way torchrun does. dsk_comm_check_agree() checks at setup that
   every rank was given the same configuration and names the option that differs.

   Threads. The ranks of one host share its cores: each rank's dsk_ctx (dsk_tensor.h) runs
   cores / LOCAL_WORLD_SIZE OpenMP threads by default (at least 1), so ranks do not
   oversubscribe the CPU; OMP_NUM_THREADS, when set, overrides that for every rank.
   dsk_comm_spawn_local and torchrun set LOCAL_WORLD_SIZE in every rank's environment.

   Backends, one API. host: CPU buffers; ranks on one host exchange through shared memory,
   ranks on different hosts over TCP, and a communicator mixes both (see "shared memory" in
   the implementation). nccl (DSK_CUDA): device buffers on ctx->stream, a nonblocking
   communicator so init and every call is bounded by the timeout, ncclCommAbort on timeout or
   error.

   Nodes. Ranks that report the same host identity (opts.host_id) form a node; nodes are
   numbered in the order of their lowest rank (dsk_comm.node, n_nodes, node_rank, node_size).
   Host backend: ranks of one node share memory unless opts.transport says TCP.

   Node communicators (dsk_comm_node_comms): the ranks of this rank's node, and the ranks with
   its node_rank on every node, split off once and kept with c: what a two-hop exchange across
   nodes needs (dsk_moe.h's expert-parallel routes, DeepSeek-V3 / DeepEP).

   Semantics of the host backend (the reference the tests check exactly):
   - Counts are elements, never bytes. send == recv means in place.
   - Reductions fold the ranks' values in rank order 0, 1, ..., n-1: f32, f16 and bf16 in
     f32 (x0 + x1 + ... rounded once to the dtype at the end), f64 in f64, integers in int64
     (sums wrap to the dtype's width). AVG divides the sum by n in the same precision
     (integers: int64 division truncating toward zero). MAX and MIN propagate NaN. The
     order is the same for every message size and algorithm, so every rank gets bitwise the
     same result.
   - Small messages (<= opts.small_bytes) go in one round to every peer; large ones are
     reduce-scattered by direct exchange (each rank owns 1/n of the elements and receives
     only that part from every peer, pieces of opts.piece_bytes) and then all-gathered:
     each rank sends and receives 2(n-1)/n of the buffer, like a ring, but with no partial
     sums on the wire (bf16 stays bf16 on the wire yet is reduced in f32).
     Every rank must use the same backend, small_bytes and piece_bytes: init checks them and
     fails on every rank with DSK_ERR_ARG naming the rank that differs and both values.
   - Every message carries a header (collective, dtype, count, op, root, call number), so
     mismatched calls on different ranks fail with DSK_ERR_PEER naming both sides. Rooted
     collectives exchange at least a header between every pair of ranks, so ranks that name
     different roots all fail in that call.
   - Every wait ends by opts.timeout_s: DSK_ERR_TIMEOUT or DSK_ERR_PEER naming the rank. A
     shared-memory wait spins for 20 us (no system call), then yields the CPU between looks
     up to 10 ms, then sleeps until a peer wakes it.
     After such an error the communicator is unusable (DSK_ERR_STATE) until freed; the
     error is published in the store and the sockets are half-closed, so peers fail fast
     and report the root cause ("rank 1 hung up ... after its own error: ..."). Rank 0
     serves the store: when a peer hangs up and the store is gone or silent too, the error
     names rank 0 as the likely first failure. An error is returned at the timeout, not
     later (publishing it does not wait for the store). A program that stops on an error of
     its own calls dsk_comm_abort, which does the same for all its groups of the world and
     keeps rank 0's store up until the other ranks have hung up.
   - A communicator is not thread-safe: one call at a time (dsk_zero.h reduces gradients on a
     communicator of its own, split at init, so the parent stays free during backward).
   Every rank must issue the same collectives in the same order (as with NCCL and MPI).
   License: MIT, see the end of the file. */
/* Contents. Each section starts with a rule comment "---- <title>"; search for the title.
   Declarations: types and options; communicators: init, free, split; collectives; tensor
   forms; the bootstrap store; configuration agreement; local
   launcher (unless DSK_COMM_NO_LAUNCHER); options (dsk_comm_options).
   Implementation (after the "implementation" rule): small helpers; the key-value store
   server; communicator state; store client; configuration agreement; shared memory; the host
   backend's I/O engine; reductions (fixed rank order); host collectives; bootstrap and mesh;
   init; collectives; split; tensor forms; local launcher; options. */
#if defined(DSK_COMM_IMPLEMENTATION) && !defined(_GNU_SOURCE) && !defined(_POSIX_C_SOURCE)
#define _GNU_SOURCE
#endif
/* With DSK_STATIC every dsk function is static, so this file must also compile dsk_tensor.h's. */
#if defined(DSK_STATIC) && defined(DSK_COMM_IMPLEMENTATION) && !defined(DSK_TENSOR_IMPLEMENTATION)
#define DSK_TENSOR_IMPLEMENTATION
#endif
#ifndef DSK_COMM_H
#define DSK_COMM_H
#include "dsk_tensor.h"
#ifdef __cplusplus
extern "C" {
#endif

/* ---- types and options */

typedef enum dsk_comm_backend {
    DSK_COMM_AUTO = 0, /* nccl when built with DSK_CUDA and every rank has a CUDA device of its own, else host */
    DSK_COMM_HOST,
    DSK_COMM_NCCL
} dsk_comm_backend;

typedef enum dsk_comm_op { DSK_COMM_SUM = 0, DSK_COMM_AVG, DSK_COMM_MAX, DSK_COMM_MIN } dsk_comm_op;

#define DSK_COMM_NO_COLOR (-1) /* dsk_comm_split: this rank joins no sub-group */

/* How the host backend reaches the other ranks. */
typedef enum dsk_comm_transport {
    DSK_COMM_TRANSPORT_AUTO = 0, /* shared memory with ranks of this node, TCP with the others */
    DSK_COMM_TRANSPORT_TCP       /* TCP with every rank (a pair uses shared memory only if both allow it) */
} dsk_comm_transport;

/* Zero fields take the defaults in brackets. */
typedef struct dsk_comm_opts {
    dsk_comm_backend backend; /* [DSK_COMM_AUTO] */
    double timeout_s;         /* [300] bound of every wait: bootstrap, collectives */
    const char *master_addr;  /* init: [MASTER_ADDR or "127.0.0.1"]; init_env: used if MASTER_ADDR is unset */
    int master_port;          /* init: [MASTER_PORT or 29500]; init_env: used if MASTER_PORT is unset */
    int local_rank;           /* init only, read when local_world_size > 0 */
    int local_world_size;     /* init only: [world_size, local_rank = rank] */
    /* host: messages up to this size use the one-round algorithm [16 KiB when every rank is on
       one node and allows shared memory, else 64 KiB] */
    size_t small_bytes;
    size_t piece_bytes;       /* [4 MiB] host: pipelining piece of the large-message algorithm */
    /* Identity of the job: a rank whose job id differs from rank 0's fails init instead of
       joining (two jobs that share MASTER_ADDR:MASTER_PORT never merge). init: [none];
       init_env: [DSK_JOB_ID, else the launcher's: TORCHELASTIC_RUN_ID, PMIX_NAMESPACE or
       OMPI_MCA_orte_hnp_uri (Open MPI), SLURM_JOB_ID.SLURM_STEP_ID]. At most 200 characters. */
    const char *job_id;
    dsk_comm_transport transport; /* [DSK_COMM_TRANSPORT_AUTO] host backend */
    /* Identity of this rank's host: ranks with the same one form a node and (host backend)
       share memory. [DSK_HOST_ID, else the kernel's boot id and the host name]. Setting it
       emulates several hosts on one machine (tests do). At most 120 characters. */
    const char *host_id;
    /* host: an emulated network link, for measuring overlap where the CPUs that copy the bytes are
       all busy computing (a NIC moves them without the CPU): every call on the communicator and
       its splits lasts at least link_latency_us + (bytes this rank sent) / link_gbps, sleeping
       out the rest after the real transfer, on the thread that made the call. The link is the
       rank's: its bytes leave one call after another whichever of the communicator and its splits
       (and whichever thread) sends them, so calls at once on two of them take the sum of their
       times. Where the world spans several nodes (host_id) the link is between them: only the
       bytes to other nodes take it, and a communicator within one node does not use it (shared
       memory there, as NVLink between a node's GPUs); on one node every byte does.
       [DSK_LINK_GBPS and DSK_LINK_LATENCY_US; 0: no emulation] (GB/s = 1e9 bytes/s) */
    double link_gbps, link_latency_us;
} dsk_comm_opts;

/* Bytes this rank sent and received (headers included), calls, and seconds spent inside
   collectives. bytes_sent_off_node: the part of bytes_sent that went to ranks on other nodes
   (host backend; dsk_moe.h's routes count their rows on nccl too). send_payload: the bytes of the
   messages handed to dsk_comm_send or dsk_comm_send_start that returned DSK_OK (count x dtype size,
   no headers; both backends): a pipeline's activations and gradients, comparable with a plan's. The same for the
   collectives that returned DSK_OK, each the whole message (as dsk_zero counts its reductions):
   all_reduce_payload count x size, reduce_scatter_payload the input (world x recv_count),
   all_gather_payload the output (world x send_count): a tensor-parallel group's traffic. */
typedef struct dsk_comm_stats {
    uint64_t bytes_sent, bytes_received;
    uint64_t bytes_sent_off_node;
    uint64_t send_payload;
    uint64_t all_reduce_payload, reduce_scatter_payload, all_gather_payload;
    int64_t calls;
    double seconds;
} dsk_comm_stats;

typedef struct dsk__comm_impl dsk__comm_impl;
/* A communicator; the caller owns the struct, dsk_comm_init fills it. */
typedef struct dsk_comm {
    int rank, world_size;
    int local_rank, local_world_size; /* as the launcher (or opts) gave them: GPU selection */
    int node, n_nodes;                /* this rank's node (same host identity) and the node count */
    int node_rank, node_size;         /* index among its node's ranks (in rank order) and their count */
    int shm_peers;                    /* host: peers reached through shared memory (the others: TCP) */
    dsk_comm_backend backend; /* DSK_COMM_HOST or DSK_COMM_NCCL once initialised */
    int cuda_device;          /* nccl: the CUDA device this rank uses (local rank mod visible ones); host: -1 */
    dsk_comm_stats stats;     /* host backend: updated by every call */
    dsk__comm_impl *impl;
} dsk_comm;

/* ---- communicators: init, free, split */

/* Reads RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE (torchrun), else OMPI_COMM_WORLD_RANK/
   _SIZE/_LOCAL_RANK/_LOCAL_SIZE (Open MPI), else SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID
   (Slurm); MASTER_ADDR and MASTER_PORT (or opts) give the store (MASTER_ADDR may be left
   out when the launcher says every rank is on this host). Under torchrun, whose agent
   already serves a store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True), rank 0 serves
   dsk's on MASTER_PORT + 1; DSK_MASTER_PORT, when set, overrides both. The job id (see
   dsk_comm_opts.job_id) comes from the launcher's variables. Then dsk_comm_init. */
DSK_API dsk_status dsk_comm_init_env(dsk_comm *c, const dsk_comm_opts *opts);
/* Collective over world_size processes: rank 0 serves the store, all meet through it.
   opts may be NULL. On failure *c is zeroed and everything opened is released. A rank that
   another process already claimed fails at once with DSK_ERR_ARG naming both processes. */
DSK_API dsk_status dsk_comm_init(dsk_comm *c, int rank, int world_size, const dsk_comm_opts *opts);
/* Releases sockets, threads, NCCL communicator; zeroed/freed ok. Free sub-groups first.
   On rank 0 the store stops taking connections at once, then waits up to 1 s for the other
   ranks to hang up, so a late peer still gets its last reply. */
DSK_API void dsk_comm_free(dsk_comm *c);
/* Collective over c: ranks with the same color form *sub, ordered by (key, rank).
   color DSK_COMM_NO_COLOR: *sub is zeroed (world_size 0). Same backend as c. Host backend: it
   returns once every rank's group is set up (they meet through rank 0's store), so any rank
   may free c right after. */
DSK_API dsk_status dsk_comm_split(dsk_comm *c, int color, int key, dsk_comm *sub);
/* c's node communicator (the ranks of this rank's node, in rank order) and cross-node one (the
   rank with this rank's node_rank on every node, ranked by node), split off at the first call
   (collective over c) and kept with c: freed by dsk_comm_free(c), aborted with it; the caller
   must not free them. For exchanges in two hops across nodes (dsk_moe.h's routes). */
DSK_API dsk_status dsk_comm_node_comms(dsk_comm *c, dsk_comm **node, dsk_comm **cross);
/* The node of rank `rank` of c (numbered as c->node is), or -1 for a rank out of range. */
DSK_API int dsk_comm_node_of(const dsk_comm *c, int rank);

/* ---- collectives on (pointer, count, dtype). Host backend: CPU memory, ctx unused (may be
   NULL). nccl: device memory, enqueued on ctx->stream (NULL: the default stream); call
   dsk_comm_sync to wait with the timeout. Dtypes f32, f16, bf16, f64, i32, i64, u8. */

/* recv (count) = op over ranks of send (count). nccl: AVG of integers is DSK_ERR_UNSUPPORTED. */
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
/* Rooted forms; every rank passes the same root (ranks that name different roots all fail).
   recv (count) on root = op over ranks of send (count), bitwise what all_reduce gives; recv
   is not touched on the other ranks and may be NULL there. In place: send == recv on root.
   nccl: AVG of integers is DSK_ERR_UNSUPPORTED. */
DSK_API dsk_status dsk_comm_reduce(dsk_comm *c, dsk_ctx *ctx, const void *send, void *recv, int64_t count, dsk_dtype dt,
                                   dsk_comm_op op, int root);
/* recv (world_size, send_count) on root: block r = send of rank r; recv is not touched on the
   other ranks and may be NULL there. In place: send = recv + root * send_count on root. */
DSK_API dsk_status dsk_comm_gather(dsk_comm *c, dsk_ctx *ctx, const void *send, void *recv, int64_t send_count,
                                   dsk_dtype dt, int root);
/* recv (recv_count) = block `rank` of root's send (world_size, recv_count); send is read on
   root only and may be NULL elsewhere. In place: recv = send + root * recv_count on root. */
DSK_API dsk_status dsk_comm_scatter(dsk_comm *c, dsk_ctx *ctx, const void *send, void *recv, int64_t recv_count,
                                    dsk_dtype dt, int root);
/* send, recv (world_size, count): block p of send goes to rank p, block p of recv came from rank p. */
DSK_API dsk_status dsk_comm_all_to_all(dsk_comm *c, dsk_ctx *ctx, const void *send, void *recv, int64_t count,
                                       dsk_dtype dt);
/* The MoE dispatch primitive: send_counts[p] elements at send + send_displs[p] go to rank p;
   recv_counts[p] elements from rank p land at recv + recv_displs[p]. Arrays of world_size;
   NULL displacements mean packed (exclusive prefix sums of the counts). Counts may be 0.
   Not in place. Host: when rank p sends rank q a count q does not expect, both p and q fail
   with DSK_ERR_PEER naming both ranks and both counts. */
DSK_API dsk_status dsk_comm_all_to_all_v(dsk_comm *c, dsk_ctx *ctx, const void *send, const int64_t *send_counts,
                                         const int64_t *send_displs, void *recv, const int64_t *recv_counts,
                                         const int64_t *recv_displs, dsk_dtype dt);
/* Called once for each rank p (this one included) when p's message to this rank is in recv. */
typedef void (*dsk_comm_arrived_fn)(void *arg, int rank);
/* dsk_comm_all_to_all_v that says which messages have landed while the others still travel, so that a
   consumer can start on the first (dsk_moe's chunked dispatch). host: arrived(arg, p) runs in the calling
   thread as soon as rank p's message is whole in recv, in the order the messages complete (this rank's own
   first), before the call returns; on an error some ranks are never reported. nccl: the messages are
   ordered on ctx's stream, so arrived runs for every rank, in rank order, once the exchange is enqueued
   (work enqueued on that stream after it sees the data). arrived may be NULL. */
DSK_API dsk_status dsk_comm_all_to_all_v_notify(dsk_comm *c, dsk_ctx *ctx, const void *send, const int64_t *send_counts,
                                                const int64_t *send_displs, void *recv, const int64_t *recv_counts,
                                                const int64_t *recv_displs, dsk_dtype dt, dsk_comm_arrived_fn arrived,
                                                void *arg);
/* Whether this rank's message to rank p may leave: 1 (its block of send is final), 0 (not yet), -1 (never: the
   caller failed). */
typedef int (*dsk_comm_ready_fn)(void *arg, int rank);
/* dsk_comm_all_to_all_v whose messages leave as the caller finishes them, while another of its threads still
   computes the later blocks (dsk_moe's chunked combine). host: the calling thread asks ready(arg, p) for each
   rank p (this one too) until it says 1 and only then sends p's message (copies its own block), receiving
   meanwhile; ready must not block. A -1 ends the call with DSK_ERR_STATE and breaks the communicator, as the
   peers wait for messages that will not come; so does a gate still shut at the deadline (DSK_ERR_TIMEOUT).
   nccl: waits until every block is ready, then enqueues the exchange on ctx's stream. */
DSK_API dsk_status dsk_comm_all_to_all_v_gated(dsk_comm *c, dsk_ctx *ctx, const void *send, const int64_t *send_counts,
                                               const int64_t *send_displs, void *recv, const int64_t *recv_counts,
                                               const int64_t *recv_displs, dsk_dtype dt, dsk_comm_ready_fn ready,
                                               void *arg);
/* dsk_comm_all_to_all_v in two calls, so that the caller computes while the rows travel without a thread of
   its own (dsk_moe's overlap over shared memory and TCP). host: _start posts the messages and moves what the
   transport takes now (this rank's own block copied, what fits the shared-memory rings or the sockets'
   buffers sent, what has landed received) and returns; *unsent (may be NULL) is the bytes of this rank's
   messages still to leave, which move only inside dsk_comm_finish (from this thread or another). nccl: the
   exchange is enqueued on ctx's stream; *unsent is 0. Until dsk_comm_finish returns, send and recv belong to
   the exchange and the communicator takes no other call (DSK_ERR_STATE naming the call). An emulated link
   (opts.link_gbps) counts the exchange's time from _start. stats.seconds adds the time inside both calls. */
DSK_API dsk_status dsk_comm_all_to_all_v_start(dsk_comm *c, dsk_ctx *ctx, const void *send, const int64_t *send_counts,
                                               const int64_t *send_displs, void *recv, const int64_t *recv_counts,
                                               const int64_t *recv_displs, dsk_dtype dt, size_t *unsent);
/* Completes the exchange dsk_comm_all_to_all_v_start began: returns when this rank's messages have left and
   its receives are in recv. DSK_ERR_STATE when none is in flight. */
DSK_API dsk_status dsk_comm_finish(dsk_comm *c, dsk_ctx *ctx);
/* Moves the exchange dsk_comm_all_to_all_v_start began on, without finishing it, so that one thread can compute
   on the messages that have landed while the others travel (dsk_moe's chunked dispatch). host: what the
   transport takes now moves; landed[p] (world_size entries, may be NULL) is 1 once rank p's message is whole in
   recv (this rank's own at once) and, on an emulated link, would have crossed it (the exchange's start, the
   latency, then the bytes this rank has received in it at the link's rate), else 0; once 1, it stays 1. wait:
   returns only once a message has landed since the last call, or every one has (the timeout as for any call).
   *unsent (may be NULL): the bytes of this rank's messages still to leave. nccl: every message is landed (they
   are ordered on ctx's stream), *unsent 0. DSK_ERR_STATE when none is in flight. */
DSK_API dsk_status dsk_comm_progress(dsk_comm *c, dsk_ctx *ctx, int wait, int *landed, size_t *unsent);
/* Point to point; each send must meet a recv of the same count and dtype on `peer`, the messages between two ranks
   meeting in the order they were sent. While requests begun by the calls below are pending, these two wait for
   their own message and move the pending ones meanwhile. */
DSK_API dsk_status dsk_comm_send(dsk_comm *c, dsk_ctx *ctx, const void *buf, int64_t count, dsk_dtype dt, int peer);
DSK_API dsk_status dsk_comm_recv(dsk_comm *c, dsk_ctx *ctx, void *buf, int64_t count, dsk_dtype dt, int peer);
/* Point to point begun now, finished by dsk_comm_wait: *req (may be NULL) is the request's id (ids grow from 0 over
   the communicator's life). host: the message moves as far as the transport takes it now, then only while this
   rank is inside a call of c (no thread moves it), so a receive begun ahead of its use costs nothing while its
   sender is late; a send larger than what the transport buffers (a shared-memory ring of up to 256 KiB, a socket's
   buffer) reaches its receiver only as this rank calls in. A send's buffer must stay unchanged and a receive's
   unread until its wait returns. While requests are pending, c takes no other call than these, dsk_comm_send,
   dsk_comm_recv and dsk_comm_wait (DSK_ERR_STATE): a collective's messages would share their links. nccl: the
   operation is enqueued on ctx's stream at once, as dsk_comm_send and dsk_comm_recv do (in order on the stream). */
DSK_API dsk_status dsk_comm_send_start(dsk_comm *c, dsk_ctx *ctx, const void *buf, int64_t count, dsk_dtype dt,
                                       int peer, int64_t *req);
DSK_API dsk_status dsk_comm_recv_start(dsk_comm *c, dsk_ctx *ctx, void *buf, int64_t count, dsk_dtype dt, int peer,
                                       int64_t *req);
#define DSK_COMM_ALL_REQUESTS (-1)
/* Returns once request `req` is complete (DSK_COMM_ALL_REQUESTS: every pending one), moving every pending request
   meanwhile, so that no order of begun sends and receives can deadlock. A request that completed earlier returns at
   once; an id never issued is DSK_ERR_ARG. An emulated link (opts.link_gbps) ends a request no sooner than its
   start, the latency and (a send) its bytes at the link's rate. nccl: nothing to wait for on the host. */
DSK_API dsk_status dsk_comm_wait(dsk_comm *c, dsk_ctx *ctx, int64_t req);
/* Moves what the pending requests allow now, without waiting, and says where request `req` stands in *state:
   DSK_COMM_REQ_IDLE (host: nothing of its message has moved: a receive whose sender has not begun it),
   DSK_COMM_REQ_MOVING (part of it has: its sender, or its receiver, is at it now), DSK_COMM_REQ_DONE (a wait
   returns at once). nccl: DSK_COMM_REQ_DONE (ordered on the stream). */
enum { DSK_COMM_REQ_IDLE = 0, DSK_COMM_REQ_MOVING = 1, DSK_COMM_REQ_DONE = 2 };
DSK_API dsk_status dsk_comm_test(dsk_comm *c, dsk_ctx *ctx, int64_t req, int *state);
/* The largest message a send leaves in the transport's buffers without its receiver, so that it returns before the
   receiver takes it: to `peer` of c on the host backend over shared memory, the room of one ring (256 KiB less a
   64-byte header; smaller rings where more than 16 ranks share a node); TCP (the socket's buffer is the kernel's)
   and nccl: 0. dsk_comm_host_ring_room: the same for a node of `local_ranks` ranks before any exists. */
DSK_API int64_t dsk_comm_buffered_bytes(const dsk_comm *c, int peer);
DSK_API int64_t dsk_comm_host_ring_room(int local_ranks);
/* Returns when every rank has entered the barrier. nccl: also waits for ctx's stream. */
DSK_API dsk_status dsk_comm_barrier(dsk_comm *c, dsk_ctx *ctx);
/* nccl: waits for ctx's stream, polling for NCCL errors, aborting at the timeout. host: no-op. */
DSK_API dsk_status dsk_comm_sync(dsk_comm *c, dsk_ctx *ctx);

/* ---- tensor forms: the same on contiguous tensors (CPU tensors on host, CUDA tensors on nccl). */
DSK_API dsk_status dsk_comm_all_reduce_tensor(dsk_comm *c, dsk_ctx *ctx, dsk_tensor *t, dsk_comm_op op); /* in place */
/* out numel = in numel / world_size, same dtype. */
DSK_API dsk_status dsk_comm_reduce_scatter_tensor(dsk_comm *c, dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *in,
                                                  dsk_comm_op op);
/* out numel = in numel * world_size, same dtype. */
DSK_API dsk_status dsk_comm_all_gather_tensor(dsk_comm *c, dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *in);
DSK_API dsk_status dsk_comm_broadcast_tensor(dsk_comm *c, dsk_ctx *ctx, dsk_tensor *t, int root); /* in place */
/* out, in: same shape and dtype, numel divisible by world_size. */
DSK_API dsk_status dsk_comm_all_to_all_tensor(dsk_comm *c, dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *in);

/* A program's error exit: every communicator of c's world in this process (c, the world it was
   split from and every split of both, node communicators included) becomes unusable as after a failed
   call: why (NULL: dsk_last_error()) is published in the store under this rank's world rank and
   the connections half-close, so a peer blocked on this process in any group fails at once with
   "... hung up ... after its own error: <why>". On the store's host (world rank 0) it then waits
   until every other rank has hung up on it, at most the timeout, so the store outlives the look-ups.
   Free the communicators after it as usual. Call it while no other thread uses them. */
DSK_API void dsk_comm_abort(dsk_comm *c, const char *why);

/* ---- the bootstrap store (world communicators and their sub-groups). Keys starting with
   "dsk/" are reserved. */
DSK_API dsk_status dsk_comm_store_set(dsk_comm *c, const char *key, const void *val, size_t len);
/* Waits (up to the timeout) until key exists; copies min(len, cap) bytes, *len = full length. */
DSK_API dsk_status dsk_comm_store_get(dsk_comm *c, const char *key, void *buf, size_t cap, size_t *len);
/* Adds delta to the int64 counter `key` (created at 0); *result (may be NULL) = new value. */
DSK_API dsk_status dsk_comm_store_add(dsk_comm *c, const char *key, int64_t delta, int64_t *result);
/* Through the store (no mesh traffic): returns when every rank of c has called it. */
DSK_API dsk_status dsk_comm_store_barrier(dsk_comm *c);

/* ---- configuration agreement */
/* Setup check that every rank of c was given the same configuration. config: this rank's
   settings as "name=value" words separated by white space ("d_model=256 experts=8
   dtype=bf16"); what names them in the message ("train_moe options"). Collective, through the
   store (any backend). DSK_OK when every rank passed the same text (compared as it is);
   else DSK_ERR_ARG on every rank, with the same message naming the first setting in which a
   differing rank departs from rank 0, both values and both ranks, and how many ranks differ:
   "dsk_comm_check_agree: train_moe options differ between ranks: d_model is "256" on rank 0
   but "160" on rank 1 (1 of 2 ranks differ from rank 0)" (or "... is not given on rank 1").
   The communicator stays usable. c: a world communicator or a host-backend sub-group (an
   nccl sub-group has no store connection: DSK_ERR_STATE). */
DSK_API dsk_status dsk_comm_check_agree(dsk_comm *c, const char *what, const char *config);

/* ---- local launcher */
#ifndef DSK_COMM_NO_LAUNCHER
typedef struct dsk_comm_spawn_opts {
    const char *master_addr; /* ["127.0.0.1"] */
    int master_port;         /* [a free port] */
    double timeout_s;        /* [0: none] kill every rank (SIGKILL) after this long */
    int out_fd;              /* [1] where the ranks' prefixed output goes */
} dsk_comm_spawn_opts;
/* Starts n copies of argv (argv[0] looked up in PATH) with RANK, WORLD_SIZE, LOCAL_RANK,
   LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and DSK_JOB_ID (new for every call) set,
   forwards each output line (stdout and stderr) as "[rank r] line", and waits for all. A
   line goes out whole, whatever its length, never mixed with another rank's (a last line
   without a newline gets one).
   *worst_exit = the largest exit status (128 + signal for a rank killed by a signal).
   DSK_ERR_TIMEOUT if the timeout killed them. */
DSK_API dsk_status dsk_comm_spawn_local(int n, char *const argv[], const dsk_comm_spawn_opts *opts, int *worst_exit);
#endif /* DSK_COMM_NO_LAUNCHER */
/* A TCP port on addr that was free a moment ago, for launchers and tests: a random one below the
   kernel's ephemeral range (Linux: /proc/sys/net/ipv4/ip_local_port_range), where no outgoing
   connection's source port can take it between this call and the bind that uses it; the kernel's
   pick (a bind to port 0) when that range leaves no room or every try is taken. */
DSK_API dsk_status dsk_comm_free_port(const char *addr, int *port);

DSK_API const char *dsk_comm_op_name(dsk_comm_op op); /* "sum", "avg", "max", "min" */
/* The compile-out switches the implementation was built with, space-separated, "" for none:
   "DSK_COMM_NO_LAUNCHER". */
DSK_API const char *dsk_comm_options(void);

#ifdef __cplusplus
}
#endif
#endif /* DSK_COMM_H */

/* ==================================================================== implementation */
#ifdef DSK_COMM_IMPLEMENTATION
#ifndef DSK_COMM_IMPLEMENTATION_DONE
#define DSK_COMM_IMPLEMENTATION_DONE
/* glibc hid POSIX 2008 when a system header came before the dsk headers in this file. */
#if defined(__GLIBC__) && !defined(__USE_XOPEN2K8) /* glibc's mark of POSIX 2008 */
#error "dsk_comm.h needs POSIX 2008: put the DSK_*_IMPLEMENTATION defines and dsk includes before any system header, \
or compile with -D_GNU_SOURCE"
#endif

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <dirent.h>
#include <sched.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#ifdef DSK_CUDA
#include <cuda_runtime.h>
#include <nccl.h>
#endif

/* ---------------------------------------------------------------- small helpers */

static void dsk__comm_sleep_s(double s) {
    struct timespec ts;
    ts.tv_sec = (time_t)s;
    ts.tv_nsec = (long)((s - (double)ts.tv_sec) * 1e9);
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

static double dsk__comm_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Milliseconds left until `deadline` for poll(), at least 0, rounded up. */
static int dsk__comm_ms_left(double deadline) {
    double left = deadline - dsk__comm_now();
    if (left <= 0) return 0;
    return left > 86400.0 ? 86400000 : (int)(left * 1000.0) + 1;
}

DSK_API const char *dsk_comm_op_name(dsk_comm_op op) {
    static const char *names[] = {"sum", "avg", "max", "min"};
    return ((int)op >= 0 && (int)op < 4) ? names[op] : "invalid";
}

static int dsk__comm_dtype_ok(dsk_dtype dt) {
    return dt == DSK_F32 || dt == DSK_F16 || dt == DSK_BF16 || dt == DSK_F64 || dt == DSK_I32 || dt == DSK_I64 ||
           dt == DSK_U8;
}

static void dsk__comm_set_nonblocking_cloexec(int fd) {
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    fcntl(fd, F_SETFD, fcntl(fd, F_GETFD) | FD_CLOEXEC);
}

static void dsk__comm_tune_socket(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    dsk__comm_set_nonblocking_cloexec(fd);
}

/* Resolves host:port (IPv4) into *sa. */
static dsk_status dsk__comm_resolve(const char *fn, const char *host, int port, struct sockaddr_in *sa) {
    struct addrinfo hints, *res = NULL;
    int rc;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    rc = getaddrinfo(host, NULL, &hints, &res);
    if (rc != 0 || !res)
        return dsk_set_error(DSK_ERR_ARG, "%s: cannot resolve address \"%s\": %s", fn, host, gai_strerror(rc));
    memcpy(sa, res->ai_addr, sizeof *sa);
    sa->sin_port = htons((uint16_t)port);
    freeaddrinfo(res);
    return DSK_OK;
}

/* A listening socket on addr:port (port 0: any); *port_out = the bound port. `busy` says
   what to do when the port is taken (NULL: pick another MASTER_PORT). */
static dsk_status dsk__comm_listen(const char *fn, const struct sockaddr_in *addr, const char *busy, int *fd_out,
                                   int *port_out) {
    struct sockaddr_in sa = *addr;
    socklen_t sl = sizeof sa;
    int one = 1, fd = socket(AF_INET, SOCK_STREAM, 0);
    char ip[64];
    if (fd < 0) return dsk_set_error(DSK_ERR_IO, "%s: socket: %s", fn, strerror(errno));
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof ip);
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        int e = errno;
        close(fd);
        if (e == EADDRINUSE)
            return dsk_set_error(DSK_ERR_IO, "%s: port %d on %s is already in use (EADDRINUSE): %s", fn,
                                 (int)ntohs(sa.sin_port), ip, busy ? busy : "pick another MASTER_PORT");
        return dsk_set_error(DSK_ERR_IO, "%s: bind %s:%d: %s", fn, ip, (int)ntohs(sa.sin_port), strerror(e));
    }
    if (listen(fd, SOMAXCONN) != 0 || getsockname(fd, (struct sockaddr *)&sa, &sl) != 0) {
        int e = errno;
        close(fd);
        return dsk_set_error(DSK_ERR_IO, "%s: listen on %s: %s", fn, ip, strerror(e));
    }
    dsk__comm_set_nonblocking_cloexec(fd);
    *fd_out = fd;
    if (port_out) *port_out = (int)ntohs(sa.sin_port);
    return DSK_OK;
}

/* Connects to sa, retrying refused connections until deadline (the peer may not listen yet). */
static dsk_status dsk__comm_connect(const char *fn, const struct sockaddr_in *sa, double deadline, const char *who,
                                    int *fd_out) {
    char ip[64];
    const char *last = "no attempt";
    double t0 = dsk__comm_now();
    inet_ntop(AF_INET, &sa->sin_addr, ip, sizeof ip);
    for (;;) {
        int fd = socket(AF_INET, SOCK_STREAM, 0), err = 0;
        if (fd < 0) return dsk_set_error(DSK_ERR_IO, "%s: socket: %s", fn, strerror(errno));
        dsk__comm_set_nonblocking_cloexec(fd);
        if (connect(fd, (const struct sockaddr *)sa, sizeof *sa) != 0) err = errno;
        if (err == EINPROGRESS) {
            struct pollfd p;
            socklen_t el = sizeof err;
            p.fd = fd;
            p.events = POLLOUT;
            p.revents = 0;
            err = ETIMEDOUT;
            if (poll(&p, 1, dsk__comm_ms_left(deadline)) == 1) getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
        }
        if (err == 0) {
            dsk__comm_tune_socket(fd);
            *fd_out = fd;
            return DSK_OK;
        }
        close(fd);
        last = strerror(err);
        if (dsk__comm_now() >= deadline) break;
        dsk__comm_sleep_s(0.02);
        if (dsk__comm_now() >= deadline) break;
    }
    return dsk_set_error(DSK_ERR_TIMEOUT, "%s: no %s at %s:%d after %.2f s (last error: %s)", fn, who, ip,
                         (int)ntohs(sa->sin_port), dsk__comm_now() - t0, last);
}

/* Blocking-style I/O on a nonblocking socket, bounded by deadline. `who` names the peer. */
static dsk_status dsk__comm_write_full(const char *fn, int fd, const void *buf, size_t len, double deadline,
                                       const char *who) {
    const char *p = (const char *)buf;
    while (len > 0) {
        ssize_t s = send(fd, p, len, MSG_NOSIGNAL);
        if (s > 0) { p += s; len -= (size_t)s; continue; }
        if (s < 0 && errno == EINTR) continue;
        if (s < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            struct pollfd pf;
            pf.fd = fd; pf.events = POLLOUT; pf.revents = 0;
            if (poll(&pf, 1, dsk__comm_ms_left(deadline)) == 0)
                return dsk_set_error(DSK_ERR_TIMEOUT, "%s: timed out sending to %s", fn, who);
            continue;
        }
        return dsk_set_error(DSK_ERR_PEER, "%s: sending to %s failed: %s", fn, who, strerror(errno));
    }
    return DSK_OK;
}

static dsk_status dsk__comm_read_full(const char *fn, int fd, void *buf, size_t len, double deadline, const char *who) {
    char *p = (char *)buf;
    double t0 = dsk__comm_now();
    while (len > 0) {
        ssize_t r = recv(fd, p, len, 0);
        if (r > 0) { p += r; len -= (size_t)r; continue; }
        if (r == 0) return dsk_set_error(DSK_ERR_PEER, "%s: %s closed the connection", fn, who);
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            struct pollfd pf;
            pf.fd = fd; pf.events = POLLIN; pf.revents = 0;
            if (poll(&pf, 1, dsk__comm_ms_left(deadline)) == 0)
                return dsk_set_error(DSK_ERR_TIMEOUT, "%s: timed out after %.2f s waiting for %s", fn,
                                     dsk__comm_now() - t0, who);
            continue;
        }
        return dsk_set_error(DSK_ERR_PEER, "%s: receiving from %s failed: %s", fn, who, strerror(errno));
    }
    return DSK_OK;
}

/* ---------------------------------------------------------------- the key-value store server
   One thread on rank 0 of a world communicator. Requests: u32 cmd, u32 key length, u64
   value length (SET) or delta (ADD), key, value. Replies: SET u64 0; GET u64 length + value
   (held until the key exists); ADD i64 new value. */

enum { DSK__COMM_STORE_SET = 1, DSK__COMM_STORE_GET = 2, DSK__COMM_STORE_ADD = 3 };
#define DSK__COMM_STORE_MAX_KEY 4096u
#define DSK__COMM_STORE_MAX_VAL (64u << 20)

typedef struct dsk__comm_kv { char *key; char *val; uint64_t len; } dsk__comm_kv;
typedef struct dsk__comm_store_client { int fd; char *buf; size_t len, cap; char *wait_key; } dsk__comm_store_client;
typedef struct dsk__comm_store_server {
    int listen_fd, wake[2];
    pthread_t thread;
    dsk__comm_kv *kv;
    int nkv, capkv;
    dsk__comm_store_client *cl;
    int ncl, capcl;
} dsk__comm_store_server;

static dsk__comm_kv *dsk__comm_kv_find(dsk__comm_store_server *s, const char *key) {
    for (int i = 0; i < s->nkv; i++)
        if (strcmp(s->kv[i].key, key) == 0) return &s->kv[i];
    return NULL;
}

/* Inserts or replaces key's value; NULL on allocation failure. */
static dsk__comm_kv *dsk__comm_kv_put(dsk__comm_store_server *s, const char *key, const void *val, uint64_t len) {
    dsk__comm_kv *e = dsk__comm_kv_find(s, key);
    char *v = (char *)DSK_MALLOC(len ? (size_t)len : 1);
    if (!v) return NULL;
    if (len) memcpy(v, val, (size_t)len);
    if (!e) {
        if (s->nkv == s->capkv) {
            int cap = s->capkv ? 2 * s->capkv : 64;
            dsk__comm_kv *nk = (dsk__comm_kv *)DSK_MALLOC((size_t)cap * sizeof *nk);
            if (!nk) { DSK_FREE(v); return NULL; }
            if (s->nkv) memcpy(nk, s->kv, (size_t)s->nkv * sizeof *nk);
            DSK_FREE(s->kv);
            s->kv = nk;
            s->capkv = cap;
        }
        e = &s->kv[s->nkv];
        e->key = (char *)DSK_MALLOC(strlen(key) + 1);
        if (!e->key) { DSK_FREE(v); return NULL; }
        strcpy(e->key, key);
        e->val = NULL;
        s->nkv++;
    }
    DSK_FREE(e->val);
    e->val = v;
    e->len = len;
    return e;
}

static void dsk__comm_store_drop(dsk__comm_store_server *s, int i) {
    close(s->cl[i].fd);
    DSK_FREE(s->cl[i].buf);
    DSK_FREE(s->cl[i].wait_key);
    s->cl[i] = s->cl[s->ncl - 1];
    s->ncl--;
}

/* Sends a whole reply; replies are small, a client that does not read them is dropped. */
static int dsk__comm_store_reply(int fd, const void *a, size_t na, const void *b, size_t nb) {
    struct iovec iov[2];
    struct msghdr mh;
    size_t total = na + nb, sent = 0;
    double deadline = dsk__comm_now() + 5.0;
    while (sent < total) {
        ssize_t r;
        int k = 0;
        memset(&mh, 0, sizeof mh);
        if (sent < na) { iov[k].iov_base = (char *)a + sent; iov[k].iov_len = na - sent; k++; }
        if (nb) {
            size_t off = sent > na ? sent - na : 0;
            iov[k].iov_base = (char *)b + off;
            iov[k].iov_len = nb - off;
            k++;
        }
        mh.msg_iov = iov;
        mh.msg_iovlen = (size_t)k;
        r = sendmsg(fd, &mh, MSG_NOSIGNAL);
        if (r > 0) { sent += (size_t)r; continue; }
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            struct pollfd pf;
            pf.fd = fd; pf.events = POLLOUT; pf.revents = 0;
            if (poll(&pf, 1, dsk__comm_ms_left(deadline)) > 0) continue;
        }
        return -1;
    }
    return 0;
}

static int dsk__comm_store_send_value(int fd, const dsk__comm_kv *e) {
    uint64_t len = e->len;
    return dsk__comm_store_reply(fd, &len, sizeof len, e->val, (size_t)e->len);
}

/* Answers every client waiting for e's key; drops those that cannot take the reply. */
static void dsk__comm_store_wake_waiters(dsk__comm_store_server *s, const dsk__comm_kv *e) {
    for (int i = 0; i < s->ncl; i++) {
        if (!s->cl[i].wait_key || strcmp(s->cl[i].wait_key, e->key) != 0) continue;
        DSK_FREE(s->cl[i].wait_key);
        s->cl[i].wait_key = NULL;
        if (dsk__comm_store_send_value(s->cl[i].fd, e) != 0) { dsk__comm_store_drop(s, i); i--; }
    }
}

/* Handles the complete requests buffered for client i; returns -1 if it must be dropped. */
static int dsk__comm_store_serve(dsk__comm_store_server *s, int i) {
    for (;;) {
        dsk__comm_store_client *c = &s->cl[i];
        uint32_t cmd, klen;
        uint64_t n;
        size_t need;
        char key[DSK__COMM_STORE_MAX_KEY + 1];
        dsk__comm_kv *e;
        if (c->len < 16) return 0;
        memcpy(&cmd, c->buf, 4);
        memcpy(&klen, c->buf + 4, 4);
        memcpy(&n, c->buf + 8, 8);
        if (klen == 0 || klen > DSK__COMM_STORE_MAX_KEY || cmd < DSK__COMM_STORE_SET || cmd > DSK__COMM_STORE_ADD ||
            (cmd == DSK__COMM_STORE_SET && n > DSK__COMM_STORE_MAX_VAL) || c->wait_key)
            return -1;
        need = 16 + klen + (cmd == DSK__COMM_STORE_SET ? (size_t)n : 0);
        if (c->len < need) return 0;
        memcpy(key, c->buf + 16, klen);
        key[klen] = 0;
        if (cmd == DSK__COMM_STORE_SET) {
            uint64_t zero = 0;
            if (!(e = dsk__comm_kv_put(s, key, c->buf + 16 + klen, n)) ||
                dsk__comm_store_reply(c->fd, &zero, 8, NULL, 0))
                return -1;
        } else if (cmd == DSK__COMM_STORE_ADD) {
            int64_t v = 0;
            e = dsk__comm_kv_find(s, key);
            if (e && e->len == 8) memcpy(&v, e->val, 8);
            v = (int64_t)((uint64_t)v + n);
            if (!(e = dsk__comm_kv_put(s, key, &v, 8)) || dsk__comm_store_reply(c->fd, &v, 8, NULL, 0)) return -1;
        } else if ((e = dsk__comm_kv_find(s, key)) != NULL) {
            if (dsk__comm_store_send_value(c->fd, e)) return -1;
            e = NULL;
        } else {
            c->wait_key = (char *)DSK_MALLOC(klen + 1);
            if (!c->wait_key) return -1;
            memcpy(c->wait_key, key, (size_t)klen + 1);
        }
        memmove(c->buf, c->buf + need, c->len - need);
        c->len -= need;
        if (e && cmd != DSK__COMM_STORE_GET) {
            int fd = c->fd;
            dsk__comm_store_wake_waiters(s, e);
            /* waking may have dropped clients and moved this one: find it again */
            for (i = 0; i < s->ncl && s->cl[i].fd != fd; i++) {}
            if (i == s->ncl) return 0;
        }
    }
}

/* Reads what client i sent; -1: drop it. */
static int dsk__comm_store_read(dsk__comm_store_server *s, int i) {
    for (;;) {
        dsk__comm_store_client *c = &s->cl[i];
        ssize_t r;
        if (c->cap - c->len < 65536) {
            size_t cap = c->cap ? 2 * c->cap : 131072;
            char *nb;
            if (cap > 2 * (size_t)DSK__COMM_STORE_MAX_VAL) return -1;
            nb = (char *)DSK_MALLOC(cap);
            if (!nb) return -1;
            if (c->len) memcpy(nb, c->buf, c->len);
            DSK_FREE(c->buf);
            c->buf = nb;
            c->cap = cap;
        }
        r = recv(c->fd, c->buf + c->len, c->cap - c->len, 0);
        if (r > 0) { c->len += (size_t)r; continue; }
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return dsk__comm_store_serve(s, i);
        /* hung up: what it sent before still counts (a breaking rank publishes its fault and leaves) */
        dsk__comm_store_serve(s, i);
        return -1;
    }
}

static void *dsk__comm_store_thread(void *arg) {
    dsk__comm_store_server *s = (dsk__comm_store_server *)arg;
    struct pollfd *pf = NULL;
    int cap = 0;
    double drain_until = 0; /* after the stop request: serve those still connected, briefly */
    for (;;) {
        int n = 2 + s->ncl, r;
        if (drain_until > 0 && (s->ncl == 0 || dsk__comm_now() >= drain_until)) break;
        if (n > cap) {
            DSK_FREE(pf);
            cap = 2 * n;
            pf = (struct pollfd *)DSK_MALLOC((size_t)cap * sizeof *pf);
            if (!pf) return NULL;
        }
        pf[0].fd = s->wake[0]; pf[0].events = POLLIN; pf[0].revents = 0;
        pf[1].fd = s->listen_fd; pf[1].events = POLLIN; pf[1].revents = 0; /* -1 once draining: ignored */
        for (int i = 0; i < s->ncl; i++) {
            pf[2 + i].fd = s->cl[i].fd;
            pf[2 + i].events = POLLIN;
            pf[2 + i].revents = 0;
        }
        r = poll(pf, (nfds_t)n, drain_until > 0 ? 20 : -1);
        if (r < 0 && errno != EINTR) break;
        if (r <= 0) continue;
        if (pf[0].revents && drain_until == 0) {
            /* stop: refuse new connections at once (a rank re-initialising must not reach this
               store), and give the others a moment to collect pending replies and hang up */
            char b;
            ssize_t rd = read(s->wake[0], &b, 1);
            (void)rd;
            close(s->listen_fd);
            s->listen_fd = -1;
            drain_until = dsk__comm_now() + 5.0;
            continue;
        }
        /* clients first, by fd: serving may reorder the array */
        for (int j = 2; j < n; j++) {
            int i;
            if (!pf[j].revents) continue;
            for (i = 0; i < s->ncl && s->cl[i].fd != pf[j].fd; i++) {}
            if (i < s->ncl && dsk__comm_store_read(s, i) != 0) {
                for (i = 0; i < s->ncl && s->cl[i].fd != pf[j].fd; i++) {}
                if (i < s->ncl) dsk__comm_store_drop(s, i);
            }
        }
        if (s->listen_fd >= 0 && pf[1].revents) {
            int fd = accept(s->listen_fd, NULL, NULL);
            if (fd >= 0) {
                if (s->ncl == s->capcl) {
                    int nc = s->capcl ? 2 * s->capcl : 16;
                    dsk__comm_store_client *ncl = (dsk__comm_store_client *)DSK_MALLOC((size_t)nc * sizeof *ncl);
                    if (!ncl) { close(fd); continue; }
                    if (s->ncl) memcpy(ncl, s->cl, (size_t)s->ncl * sizeof *ncl);
                    DSK_FREE(s->cl);
                    s->cl = ncl;
                    s->capcl = nc;
                }
                dsk__comm_tune_socket(fd);
                memset(&s->cl[s->ncl], 0, sizeof s->cl[s->ncl]);
                s->cl[s->ncl].fd = fd;
                s->ncl++;
            }
        }
    }
    DSK_FREE(pf);
    return NULL;
}

static void dsk__comm_store_server_free(dsk__comm_store_server *s) {
    if (!s) return;
    if (s->wake[1] >= 0) {
        char b = 1;
        ssize_t w = write(s->wake[1], &b, 1);
        (void)w;
        pthread_join(s->thread, NULL);
    }
    while (s->ncl) dsk__comm_store_drop(s, s->ncl - 1);
    for (int i = 0; i < s->nkv; i++) { DSK_FREE(s->kv[i].key); DSK_FREE(s->kv[i].val); }
    DSK_FREE(s->kv);
    DSK_FREE(s->cl);
    if (s->listen_fd >= 0) close(s->listen_fd);
    if (s->wake[0] >= 0) close(s->wake[0]);
    if (s->wake[1] >= 0) close(s->wake[1]);
    DSK_FREE(s);
}

static dsk_status dsk__comm_store_server_start(const char *fn, const struct sockaddr_in *addr, const char *busy,
                                               dsk__comm_store_server **out) {
    dsk__comm_store_server *s = (dsk__comm_store_server *)DSK_MALLOC(sizeof *s);
    dsk_status st;
    if (!s) return dsk_set_error(DSK_ERR_OOM, "%s: store server", fn);
    memset(s, 0, sizeof *s);
    s->listen_fd = s->wake[0] = s->wake[1] = -1;
    if ((st = dsk__comm_listen(fn, addr, busy, &s->listen_fd, NULL)) != DSK_OK) {
        dsk__comm_store_server_free(s);
        return st;
    }
    if (pipe(s->wake) != 0) {
        s->wake[0] = s->wake[1] = -1;
        dsk__comm_store_server_free(s);
        return dsk_set_error(DSK_ERR_IO, "%s: pipe: %s", fn, strerror(errno));
    }
    dsk__comm_set_nonblocking_cloexec(s->wake[0]);
    dsk__comm_set_nonblocking_cloexec(s->wake[1]);
    if (pthread_create(&s->thread, NULL, dsk__comm_store_thread, s) != 0) {
        close(s->wake[1]);
        s->wake[1] = -1;
        dsk__comm_store_server_free(s);
        return dsk_set_error(DSK_ERR_IO, "%s: cannot start the store thread", fn);
    }
    *out = s;
    return DSK_OK;
}

/* ---------------------------------------------------------------- communicator state */

/* Header in front of every host-backend message: both sides check it before the payload. */
typedef struct dsk__comm_wire {
    uint32_t magic;
    uint16_t kind;  /* dsk__comm_kind */
    uint8_t dtype, op;
    int32_t root;   /* broadcast root, else -1 */
    uint32_t step;  /* round inside the call */
    int64_t count;  /* the call's count (all_to_all_v, send: this message's count) */
    uint64_t seq;   /* collective calls before this one (send/recv: messages to this peer) */
    int64_t expect; /* all_to_all_v: the count the sender expects back from the receiver, else 0 */
} dsk__comm_wire;

#define DSK__COMM_WIRE_MAGIC 0x6b736431u /* "1dsk" */
enum {
    DSK__COMM_ALL_REDUCE = 1, DSK__COMM_REDUCE_SCATTER, DSK__COMM_ALL_GATHER, DSK__COMM_BROADCAST, DSK__COMM_ALL_TO_ALL,
    DSK__COMM_ALL_TO_ALL_V, DSK__COMM_SEND, DSK__COMM_BARRIER, DSK__COMM_REDUCE, DSK__COMM_GATHER, DSK__COMM_SCATTER,
    DSK__COMM_KIND_END
};

static const char *dsk__comm_kind_name(unsigned k) {
    static const char *names[] = {"?", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all",
                                  "all_to_all_v", "send/recv", "barrier", "reduce", "gather", "scatter"};
    return k < DSK__COMM_KIND_END ? names[k] : "an unknown call";
}

#define DSK__COMM_JOB_MAX 200 /* characters of a job id */
#define DSK__COMM_HOST_MAX 120 /* characters of a host identity */

typedef struct dsk__comm_link dsk__comm_link;
typedef struct dsk__comm_nic dsk__comm_nic;

struct dsk__comm_impl {
    int world, rank;                     /* size of this communicator, this rank in it */
    dsk__comm_impl *kin_prev, *kin_next; /* ring of this process's communicators of one world (the
                                    world and its splits, split order) that dsk_comm_abort walks */
    dsk_comm *node_comm, *cross_comm;    /* dsk_comm_node_comms: split off at the first call, freed with this */
    int32_t *cpu;                /* this rank's CPU in the segment (NULL without shared memory) */
    int crowded;                 /* more ranks share this node's memory than it has CPUs: never spin */
    double timeout_s;
    size_t small_bytes, piece_bytes;
    char master_addr[256];
    int master_port;
    char ns[96];                 /* store key namespace of this communicator ("w": the world) */
    int *node_of;                /* [world] node of each rank */
    int *world_of;               /* [world] each rank's rank in the world communicator it was split
                                    from (NULL: this is that communicator), for messages */
    unsigned char *shm_ok;       /* [world] the rank allows shared memory (transport AUTO, host backend) */
    dsk__comm_link *links;       /* [world] shared-memory view of each peer; tx NULL: TCP */
    void *shm;                   /* the mapped segment, NULL if none */
    size_t shm_bytes;
    uint64_t ring;               /* bytes of each ring (a power of two) */
    int store_gone;              /* the store hung up: rank 0, its host, is gone */
    char job_id[DSK__COMM_JOB_MAX + 4]; /* opts.job_id, "" for none */
    char my_ip[64];              /* where peers reach this rank */
    uint64_t tag;                /* identifies the mesh in connection hellos */
    int store_fd;                /* client connection to the store, -1 if none */
    dsk__comm_store_server *server;   /* rank 0 of a world communicator */
    uint64_t store_barriers, splits, agreements;
    int *fds;                    /* [world] mesh sockets, -1 for this rank */
    uint64_t seq;                /* collective calls so far */
    uint64_t *p2p_sent, *p2p_recvd; /* [world] */
    dsk_status broken;           /* DSK_OK, or the error that made the communicator unusable */
    char broken_msg[1024];
    void *scratch;
    size_t scratch_bytes;
    struct pollfd *pfd;          /* io engine work arrays, [2 * world] */
    int *pidx;
    struct dsk__comm_io *ops;         /* [2 * world] */
    const void **srcs;           /* [2 * world] */
    int64_t *off;                /* [world + 1] */
    dsk_comm_arrived_fn arrived; /* dsk_comm_all_to_all_v_notify's, during its io run; else NULL */
    void *arrived_arg;
    dsk_comm_ready_fn ready; /* dsk_comm_all_to_all_v_gated's, during its io run; else NULL */
    void *ready_arg;
    double link_bps, link_s; /* opts.link_gbps (bytes/s) and link_latency_us (s); 0: no emulated link */
    uint64_t link_mark;      /* dsk__comm_link_sent when the last call ended */
    dsk__comm_nic *nic;      /* the emulated link's sending side, one per rank: its communicators of one world
                                  share it (NULL without a link_gbps) */
    int started, started_n;  /* an exchange begun by dsk_comm_all_to_all_v_start: its ops[0..started_n) */
    int until_landed;        /* dsk_comm_progress's wait: the io run returns once a receive is whole, unreported */
    int until_op;            /* dsk_comm_wait: the io run returns once ops[until_op] is finished; -1: all */
    struct dsk__comm_io *p2p; /* pending point to point requests, in start order: ids p2p_base .. p2p_base + p2p_n */
    int p2p_n, p2p_cap;
    int64_t p2p_base;             /* the id of p2p[0]; every request before it is complete */
    double started_t0, started_s; /* when it began, and the seconds its start took */
#ifdef DSK_CUDA
    ncclComm_t nccl;
    void *nccl_flag;             /* one device float for barriers */
#endif
};

/* The sending side of a rank's emulated link: its bytes leave one after another, whichever of the rank's
   communicators (and threads: dsk_zero reduces on its own) sends them, as through one network card. */
struct dsk__comm_nic {
    double free_at; /* when the bytes taken so far have left */
    int refs;       /* the communicators sharing it */
    int off_node;   /* the world spans nodes: only bytes to other nodes take the link (a node's ranks reach each other
                       through shared memory, as a node's GPUs through NVLink), and a communicator within one node is
                       off it */
};

/* Whether messages between c's rank and rank `peer` of c cross the emulated link: always within one node's
   world; across nodes, those between nodes. */
static int dsk__comm_peer_on_link(const dsk_comm *c, int peer) {
    return !c->impl->nic || !c->impl->nic->off_node || c->impl->node_of[peer] != c->node;
}

/* Whether c's calls use the link: always within one node's world; across nodes, a communicator that spans them. */
static int dsk__comm_on_link(const dsk_comm *c) { return !c->impl->nic || !c->impl->nic->off_node || c->n_nodes > 1; }

/* The bytes c's calls have given the link: all it sent, or across nodes those to other nodes. */
static uint64_t dsk__comm_link_sent(const dsk_comm *c) {
    return c->impl->nic && c->impl->nic->off_node ? c->stats.bytes_sent_off_node : c->stats.bytes_sent;
}

static void *dsk__comm_scratch(dsk__comm_impl *m, size_t bytes) {
    if (bytes > m->scratch_bytes) {
        void *p = DSK_MALLOC(bytes);
        if (!p) return NULL;
        DSK_FREE(m->scratch);
        m->scratch = p;
        m->scratch_bytes = bytes;
    }
    return m->scratch ? m->scratch : (m->scratch = DSK_MALLOC(1));
}


/* ---------------------------------------------------------------- store client */

static dsk_status dsk__comm_store_fail(dsk__comm_impl *m, dsk_status st);

static dsk_status dsk__comm_store_call(dsk_comm *c, const char *fn, uint32_t cmd, const char *key, const void *val,
                                  uint64_t n, double deadline) {
    dsk__comm_impl *m = c->impl;
    char who[320];
    unsigned char h[16];
    uint32_t klen = (uint32_t)strlen(key);
    dsk_status st;
    if (m->store_fd < 0) return dsk_set_error(DSK_ERR_STATE, "%s: this communicator has no store connection", fn);
    if (klen == 0 || klen > DSK__COMM_STORE_MAX_KEY)
        return dsk_set_error(DSK_ERR_ARG, "%s: key length %u not in [1, %u]", fn, klen, DSK__COMM_STORE_MAX_KEY);
    snprintf(who, sizeof who, "the key-value store at %s:%d", m->master_addr, m->master_port);
    memcpy(h, &cmd, 4);
    memcpy(h + 4, &klen, 4);
    memcpy(h + 8, &n, 8);
    st = dsk__comm_write_full(fn, m->store_fd, h, 16, deadline, who);
    if (st == DSK_OK) st = dsk__comm_write_full(fn, m->store_fd, key, klen, deadline, who);
    if (st == DSK_OK && cmd == DSK__COMM_STORE_SET)
        st = dsk__comm_write_full(fn, m->store_fd, val, (size_t)n, deadline, who);
    return st == DSK_OK ? DSK_OK : dsk__comm_store_fail(m, st);
}

/* A failed or timed-out request leaves the connection out of step: close it. A store that
   hung up is gone (its host, rank 0, exited or crashed): remembered for fault reports. */
static dsk_status dsk__comm_store_fail(dsk__comm_impl *m, dsk_status st) {
    if (m->store_fd >= 0) close(m->store_fd);
    m->store_fd = -1;
    if (st == DSK_ERR_PEER) m->store_gone = 1;
    return st;
}

static dsk_status dsk__comm_store_set(dsk_comm *c, const char *fn, const char *key, const void *val, size_t len) {
    uint64_t ack;
    dsk_status st;
    double deadline = dsk__comm_now() + c->impl->timeout_s;
    char who[320];
    if (len > DSK__COMM_STORE_MAX_VAL)
        return dsk_set_error(DSK_ERR_ARG, "%s: value of %zu bytes for \"%s\" exceeds %u", fn, len, key,
                             DSK__COMM_STORE_MAX_VAL);
    DSK__TRY(dsk__comm_store_call(c, fn, DSK__COMM_STORE_SET, key, val, len, deadline));
    snprintf(who, sizeof who, "the key-value store at %s:%d", c->impl->master_addr, c->impl->master_port);
    if ((st = dsk__comm_read_full(fn, c->impl->store_fd, &ack, 8, deadline, who)) != DSK_OK)
        return dsk__comm_store_fail(c->impl, st);
    return DSK_OK;
}

static dsk_status dsk__comm_store_get(dsk_comm *c, const char *fn, const char *key, void *buf, size_t cap,
                                      size_t *len_out) {
    dsk__comm_impl *m = c->impl;
    uint64_t len;
    dsk_status st;
    double t0 = dsk__comm_now(), deadline = t0 + m->timeout_s;
    char who[400];
    DSK__TRY(dsk__comm_store_call(c, fn, DSK__COMM_STORE_GET, key, NULL, 0, deadline));
    snprintf(who, sizeof who, "key \"%s\" in the key-value store at %s:%d", key, m->master_addr, m->master_port);
    if ((st = dsk__comm_read_full(fn, m->store_fd, &len, 8, deadline, who)) != DSK_OK)
        return dsk__comm_store_fail(m, st);
    if (len > DSK__COMM_STORE_MAX_VAL)
        return dsk__comm_store_fail(
            m, dsk_set_error(DSK_ERR_CORRUPT, "%s: store reply of %llu bytes", fn, (unsigned long long)len));
    {
        char *tmp = (char *)DSK_MALLOC(len ? (size_t)len : 1);
        if (!tmp)
            return dsk__comm_store_fail(m, dsk_set_error(DSK_ERR_OOM, "%s: %llu bytes", fn, (unsigned long long)len));
        st = dsk__comm_read_full(fn, m->store_fd, tmp, (size_t)len, deadline, who);
        if (st == DSK_OK && buf) memcpy(buf, tmp, (size_t)len < cap ? (size_t)len : cap);
        DSK_FREE(tmp);
        if (st != DSK_OK) return dsk__comm_store_fail(m, st);
    }
    if (len_out) *len_out = (size_t)len;
    return DSK_OK;
}

static dsk_status dsk__comm_store_add(dsk_comm *c, const char *fn, const char *key, int64_t delta, int64_t *result) {
    int64_t v;
    dsk_status st;
    double deadline = dsk__comm_now() + c->impl->timeout_s;
    char who[320];
    DSK__TRY(dsk__comm_store_call(c, fn, DSK__COMM_STORE_ADD, key, NULL, (uint64_t)delta, deadline));
    snprintf(who, sizeof who, "the key-value store at %s:%d", c->impl->master_addr, c->impl->master_port);
    if ((st = dsk__comm_read_full(fn, c->impl->store_fd, &v, 8, deadline, who)) != DSK_OK)
        return dsk__comm_store_fail(c->impl, st);
    if (result) *result = v;
    return DSK_OK;
}

static dsk_status dsk__comm_store_barrier(dsk_comm *c, const char *fn) {
    dsk__comm_impl *m = c->impl;
    char key[160];
    int64_t arrived;
    snprintf(key, sizeof key, "dsk/%s/barrier/%llu", m->ns, (unsigned long long)++m->store_barriers);
    DSK__TRY(dsk__comm_store_add(c, fn, key, 1, &arrived));
    strcat(key, "/done");
    if (arrived == c->world_size) DSK__TRY(dsk__comm_store_set(c, fn, key, "1", 1));
    return dsk__comm_store_get(c, fn, key, NULL, 0, NULL);
}

/* Records the current error as fatal: publishes it in the store under this rank's world rank
   (so a peer that sees this rank hang up, on this communicator or another one split from the
   same world, can report the root cause), then half-closes the mesh so peers fail fast.
   The publication does not wait for the store's reply (a stopped rank 0 must not delay the
   error past the timeout); the store connection is closed after it, as the communicator is
   unusable from here on. */
static dsk_status dsk__comm_break(dsk_comm *c, dsk_status st) {
    dsk__comm_impl *m = c->impl;
    if (m->broken) return st;
    m->broken = st;
    snprintf(m->broken_msg, sizeof m->broken_msg, "%s", dsk_last_error());
    if (m->store_fd >= 0 && m->fds) {
        char key[160];
        int w = m->world_of ? m->world_of[m->rank] : m->rank;
        double until = dsk__comm_now() + 1.0;
        snprintf(key, sizeof key, "dsk/fault/%d", w);
        if (dsk__comm_store_call(c, "dsk_comm", DSK__COMM_STORE_SET, key, m->broken_msg, strlen(m->broken_msg) + 1,
                                 until) == DSK_OK) {
            snprintf(key, sizeof key, "dsk/fault/%d/n", w); /* then the count peers poll (dsk__comm_peer_fault) */
            if (dsk__comm_store_call(c, "dsk_comm", DSK__COMM_STORE_ADD, key, NULL, 1, until) == DSK_OK)
                dsk__comm_store_fail(m, DSK_ERR_STATE);
        }
        dsk_set_error(st, "%s", m->broken_msg);
    }
    for (int r = 0; m->fds && r < m->world; r++)
        if (m->fds[r] >= 0) shutdown(m->fds[r], SHUT_WR);
#ifdef DSK_CUDA
    if (m->nccl) { ncclCommAbort(m->nccl); m->nccl = NULL; }
#endif
    return st;
}

/* The store's host after its abort: reads (and drops) what the other ranks send on the world's
   mesh until each hangs up, so the store stays up while they look up the errors published. */
static void dsk__comm_host_linger(dsk__comm_impl *m) {
    double until = dsk__comm_now() + m->timeout_s;
    for (;;) {
        int n = 0;
        for (int r = 0; r < m->world; r++)
            if (m->fds[r] >= 0) {
                m->pfd[n].fd = m->fds[r];
                m->pfd[n].events = POLLIN;
                m->pfd[n++].revents = 0;
            }
        if (n == 0 || dsk__comm_now() >= until || poll(m->pfd, (nfds_t)n, dsk__comm_ms_left(until)) < 0) return;
        for (int i = 0; i < n; i++) {
            char b[4096];
            ssize_t k;
            if (!m->pfd[i].revents) continue;
            k = recv(m->pfd[i].fd, b, sizeof b, MSG_DONTWAIT);
            if (k > 0 || (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))) continue;
            for (int r = 0; r < m->world; r++) /* hung up: stop watching it */
                if (m->fds[r] == m->pfd[i].fd) {
                    close(m->fds[r]);
                    m->fds[r] = -1;
                }
        }
    }
}

DSK_API void dsk_comm_abort(dsk_comm *c, const char *why) {
    dsk__comm_impl *host = NULL, *k;
    char msg[1024];
    if (!c || !c->impl) return;
    snprintf(msg, sizeof msg, "%s", why ? why : dsk_last_error());
    k = c->impl;
    do {
        dsk_comm one;
        memset(&one, 0, sizeof one); /* dsk__comm_break reads only the state behind impl */
        one.impl = k;
        dsk_set_error(DSK_ERR_STATE, "%s", msg);
        dsk__comm_break(&one, DSK_ERR_STATE);
        if (k->server && k->fds) host = k;
        k = k->kin_next;
    } while (k != c->impl);
    if (host) dsk__comm_host_linger(host);
    dsk_set_error(DSK_ERR_STATE, "%s", msg);
}

enum { DSK__COMM_STORE_UP, DSK__COMM_STORE_GONE, DSK__COMM_STORE_SILENT, DSK__COMM_STORE_NONE };

/* What rank `peer` published when it broke, if it did within a moment ("" if not). Returns
   the state of the store: up, gone (it hung up: rank 0, its host, exited or crashed),
   silent (no answer in time: rank 0 may be stopped) or none (no connection to ask). */
static int dsk__comm_peer_fault(dsk_comm *c, int peer, char *buf, size_t cap) {
    dsk__comm_impl *m = c->impl;
    char key[160], saved[1024];
    double keep = m->timeout_s;
    size_t len = 0;
    dsk_status st;
    buf[0] = 0;
    if (m->store_fd < 0) return m->store_gone ? DSK__COMM_STORE_GONE : DSK__COMM_STORE_NONE;
    snprintf(saved, sizeof saved, "%s", dsk_last_error());
    m->timeout_s = keep < 0.3 ? keep : 0.3;
    /* first a request the store answers at once, so a silent store is told from a missing key */
    snprintf(key, sizeof key, "dsk/%s/ping", m->ns);
    st = dsk__comm_store_add(c, "dsk_comm", key, 0, NULL);
    if (st == DSK_OK) {
        /* the peer publishes before it hangs up but does not wait long for the store: on a busy
           machine its record may land a moment after its hang-up is seen here. Poll its count
           (answered at once) rather than wait in a get: a get that times out would close this
           connection, and this rank could not publish its own error after it */
        int w = m->world_of ? m->world_of[peer] : peer;
        int64_t n = 0;
        double until = dsk__comm_now() + (keep / 2 < 1.0 ? keep / 2 : 1.0);
        snprintf(key, sizeof key, "dsk/fault/%d/n", w);
        while ((st = dsk__comm_store_add(c, "dsk_comm", key, 0, &n)) == DSK_OK && n == 0 && dsk__comm_now() < until)
            dsk__comm_sleep_s(0.02);
        snprintf(key, sizeof key, "dsk/fault/%d", w);
        if (st == DSK_OK && n > 0 && dsk__comm_store_get(c, "dsk_comm", key, buf, cap - 1, &len) == DSK_OK)
            buf[len < cap - 1 ? len : cap - 1] = 0;
    }
    m->timeout_s = keep;
    dsk_set_error(DSK_OK, "%s", saved);
    return st == DSK_OK ? DSK__COMM_STORE_UP : m->store_gone ? DSK__COMM_STORE_GONE : DSK__COMM_STORE_SILENT;
}

/* Whether the communicator can take a call (the store's too, which travel apart from the ranks' messages). */
static dsk_status dsk__comm_usable(const dsk_comm *c, const char *fn) {
    if (!c || !c->impl) return dsk_set_error(DSK_ERR_ARG, "%s: communicator is NULL or not initialised", fn);
    if (c->impl->broken)
        return dsk_set_error(DSK_ERR_STATE, "%s: communicator (rank %d of %d) is unusable after an earlier error: %s",
                             fn, c->rank, c->world_size, c->impl->broken_msg);
    return DSK_OK;
}

/* Whether it can take a point to point call (none while an exchange begun is in flight). */
static dsk_status dsk__comm_check_p2p(const dsk_comm *c, const char *fn) {
    DSK__TRY(dsk__comm_usable(c, fn));
    if (c->impl->started)
        return dsk_set_error(DSK_ERR_STATE,
                             "%s: rank %d's exchange begun by dsk_comm_all_to_all_v_start is in flight; "
                             "dsk_comm_finish it first",
                             fn, c->rank);
    return DSK_OK;
}

/* Whether it can take a call between the ranks (none while an exchange begun is in flight or point to point
   requests are pending). */
static dsk_status dsk__comm_check(const dsk_comm *c, const char *fn) {
    const dsk__comm_impl *m;
    DSK__TRY(dsk__comm_check_p2p(c, fn));
    m = c->impl;
    if (m->p2p_n)
        return dsk_set_error(DSK_ERR_STATE,
                             "%s: rank %d has point to point requests %lld to %lld pending; dsk_comm_wait them first",
                             fn, c->rank, (long long)m->p2p_base, (long long)(m->p2p_base + m->p2p_n - 1));
    return DSK_OK;
}

DSK_API dsk_status dsk_comm_store_set(dsk_comm *c, const char *key, const void *val, size_t len) {
    DSK__TRY(dsk__comm_usable(c, "dsk_comm_store_set"));
    if (!key || (!val && len)) return dsk_set_error(DSK_ERR_ARG, "dsk_comm_store_set: key or value is NULL");
    return dsk__comm_store_set(c, "dsk_comm_store_set", key, val, len);
}

DSK_API dsk_status dsk_comm_store_get(dsk_comm *c, const char *key, void *buf, size_t cap, size_t *len) {
    DSK__TRY(dsk__comm_usable(c, "dsk_comm_store_get"));
    if (!key || (!buf && cap)) return dsk_set_error(DSK_ERR_ARG, "dsk_comm_store_get: key or buffer is NULL");
    return dsk__comm_store_get(c, "dsk_comm_store_get", key, buf, cap, len);
}

DSK_API dsk_status dsk_comm_store_add(dsk_comm *c, const char *key, int64_t delta, int64_t *result) {
    DSK__TRY(dsk__comm_usable(c, "dsk_comm_store_add"));
    if (!key) return dsk_set_error(DSK_ERR_ARG, "dsk_comm_store_add: key is NULL");
    return dsk__comm_store_add(c, "dsk_comm_store_add", key, delta, result);
}

DSK_API dsk_status dsk_comm_store_barrier(dsk_comm *c) {
    DSK__TRY(dsk__comm_usable(c, "dsk_comm_store_barrier"));
    return dsk__comm_store_barrier(c, "dsk_comm_store_barrier");
}

/* ---- configuration agreement (dsk_comm_check_agree) */

/* The next white-space separated word of s from *pos: [*w, *w + *n); 0 at the end. */
static int dsk__comm_word(const char *s, size_t *pos, const char **w, size_t *n) {
    while (s[*pos] == ' ' || s[*pos] == '\t' || s[*pos] == '\n' || s[*pos] == '\r') (*pos)++;
    if (!s[*pos]) return 0;
    *w = s + *pos;
    while (s[*pos] && s[*pos] != ' ' && s[*pos] != '\t' && s[*pos] != '\n' && s[*pos] != '\r') (*pos)++;
    *n = (size_t)(s + *pos - *w);
    return 1;
}

/* Length of a word's name (up to '='). */
static size_t dsk__comm_name_len(const char *w, size_t n) {
    const char *eq = (const char *)memchr(w, '=', n);
    return eq ? (size_t)(eq - w) : n;
}

/* The word of s whose name is name[0, k), or NULL. */
static const char *dsk__comm_find_word(const char *s, const char *name, size_t k, size_t *n) {
    size_t pos = 0;
    const char *w;
    while (dsk__comm_word(s, &pos, &w, n))
        if (dsk__comm_name_len(w, *n) == k && !memcmp(w, name, k)) return w;
    return NULL;
}

/* The value of word w[0, n) whose name has k characters, quoted (at most 200 characters). */
static void dsk__comm_value_desc(char *buf, size_t cap, const char *w, size_t n, size_t k) {
    size_t v = k < n ? n - k - 1 : 0;
    snprintf(buf, cap, "\"%.*s\"", (int)(v < 200 ? v : 200), k < n ? w + k + 1 : "");
}

/* Writes "NAME is A on rank ra but B on rank rb" for the first setting of a that b lacks or
   gives another value (or that b has and a lacks); 0 when the words are the same. */
static int dsk__comm_first_difference(const char *a, int ra, const char *b, int rb, char *out, size_t cap) {
    for (int pass = 0; pass < 2; pass++) {
        const char *x = pass ? b : a, *y = pass ? a : b, *w, *v;
        size_t pos = 0, n, m;
        while (dsk__comm_word(x, &pos, &w, &n)) {
            size_t k = dsk__comm_name_len(w, n);
            char xd[220], yd[220];
            if ((v = dsk__comm_find_word(y, w, k, &m)) != NULL && m == n && !memcmp(v, w, n)) continue;
            dsk__comm_value_desc(xd, sizeof xd, w, n, k);
            if (v) dsk__comm_value_desc(yd, sizeof yd, v, m, k);
            else snprintf(yd, sizeof yd, "not given");
            snprintf(out, cap, "%.*s is %s on rank %d but %s on rank %d", (int)(k > 200 ? 200 : k), w, pass ? yd : xd,
                     ra, pass ? xd : yd, rb);
            return 1;
        }
    }
    return 0;
}

/* Rank r's configuration text of agreement seq, from the store, NUL-terminated (*text, to free). */
static dsk_status dsk__comm_agree_text(dsk_comm *c, const char *fn, uint64_t seq, int r, char **text) {
    char key[160];
    size_t len = 0;
    dsk_status st;
    snprintf(key, sizeof key, "dsk/%s/agree/%llu/%d", c->impl->ns, (unsigned long long)seq, r);
    DSK__TRY(dsk__comm_store_get(c, fn, key, NULL, 0, &len));
    if (!(*text = (char *)DSK_MALLOC(len + 1))) return dsk_set_error(DSK_ERR_OOM, "%s: %zu bytes", fn, len + 1);
    (*text)[len] = 0;
    if ((st = dsk__comm_store_get(c, fn, key, *text, len, &len)) != DSK_OK) { DSK_FREE(*text); *text = NULL; }
    return st;
}

/* The message every rank returns when `differ` ranks differ from rank 0: rank 0's text against
   that of the first differing rank to count itself. */
static dsk_status dsk__comm_disagree(dsk_comm *c, const char *fn, const char *what, uint64_t seq, int64_t differ) {
    char key[160], diff[700];
    int32_t first = -1;
    size_t len = 0;
    char *zero = NULL, *other = NULL;
    dsk_status st;
    snprintf(key, sizeof key, "dsk/%s/agree/%llu/first", c->impl->ns, (unsigned long long)seq);
    st = dsk__comm_store_get(c, fn, key, &first, sizeof first, &len);
    if (st == DSK_OK) st = dsk__comm_agree_text(c, fn, seq, 0, &zero);
    if (st == DSK_OK) st = dsk__comm_agree_text(c, fn, seq, first, &other);
    if (st == DSK_OK && !dsk__comm_first_difference(zero, 0, other, first, diff, sizeof diff))
        snprintf(diff, sizeof diff, "rank 0 has \"%.300s\" but rank %d has \"%.300s\"", zero, first, other);
    if (st == DSK_OK)
        st = dsk_set_error(DSK_ERR_ARG, "%s: %s differ between ranks: %s (%lld of %d ranks differ from rank 0)", fn,
                           what, diff, (long long)differ, c->world_size);
    DSK_FREE(zero);
    DSK_FREE(other);
    return st;
}

DSK_API dsk_status dsk_comm_check_agree(dsk_comm *c, const char *what, const char *config) {
    const char *fn = "dsk_comm_check_agree";
    dsk__comm_impl *m;
    char key[160], *zero = NULL;
    int64_t differ = 0, order = 0;
    uint64_t seq;
    DSK__TRY(dsk__comm_check(c, fn));
    if (!config) return dsk_set_error(DSK_ERR_ARG, "%s: config is NULL", fn);
    m = c->impl;
    what = what ? what : "configurations";
    seq = ++m->agreements;
    snprintf(key, sizeof key, "dsk/%s/agree/%llu/%d", m->ns, (unsigned long long)seq, c->rank);
    DSK__TRY(dsk__comm_store_set(c, fn, key, config, strlen(config)));
    if (c->rank != 0) {
        DSK__TRY(dsk__comm_agree_text(c, fn, seq, 0, &zero));
        differ = strcmp(zero, config) != 0;
        DSK_FREE(zero);
    }
    /* each rank that differs counts itself; the first one to do so names itself */
    snprintf(key, sizeof key, "dsk/%s/agree/%llu/differ", m->ns, (unsigned long long)seq);
    DSK__TRY(dsk__comm_store_add(c, fn, key, differ, &order));
    if (differ && order == 1) {
        int32_t me = c->rank;
        char fkey[160];
        snprintf(fkey, sizeof fkey, "dsk/%s/agree/%llu/first", m->ns, (unsigned long long)seq);
        DSK__TRY(dsk__comm_store_set(c, fn, fkey, &me, sizeof me));
    }
    DSK__TRY(dsk__comm_store_barrier(c, fn));
    DSK__TRY(dsk__comm_store_add(c, fn, key, 0, &differ));
    return differ ? dsk__comm_disagree(c, fn, what, seq, differ) : DSK_OK;
}

/* ---------------------------------------------------------------- shared memory
   The ranks of one communicator on one node share a segment: a block per rank (its pid and
   the CPU it last waited on) and a channel per ordered pair, a single-producer single-consumer byte
   ring that carries the stream a TCP connection would (headers, then payloads), so every
   guarantee of the protocol holds unchanged. Two copies (into the ring, out of it) but no
   system call: pulling large payloads straight from the sender's memory (process_vm_readv, one
   copy) was slower at every size measured (bench/RESULTS.md), rendezvous and page pinning
   included, so it is not done.
   A wait spins on the CPU for DSK__COMM_PAUSE_S (no system call: a peer that runs on another
   CPU answers in that time), then yields the CPU between looks until DSK__COMM_SPIN_S (with
   more runnable processes than CPUs the peer may need this CPU to answer), then sleeps in
   poll() on the TCP connections of the peers it waits for. A rank that starts to wait writes
   its CPU in its block; a waiter whose peer last waited on the same CPU yields at once, and so
   does every waiter when the node's group has more ranks than the machine has CPUs.
   The TCP connections stay open for two purposes: a peer that moves data while this rank
   sleeps on it (the flag of the pair is set) clears the flag and sends one byte; a peer that
   exits, crashes or breaks closes it, so a dead peer is seen as on TCP, and what it wrote
   before is still read. One flag per pair, so only a peer this rank listens to can clear it.
   Memory order: indices are published with release stores and read with acquire loads; the
   sleep flags and the indices are ordered by sequentially consistent fences on both sides (a
   sleeper sets its flags then re-reads the rings; a waker publishes then reads the flag), so
   one of them always sees the other. Segments are named after the job, the communicator and
   the creating process ("/dsk-<pid namespace>-<pid>-<hash>") and unlinked as soon as every
   rank of the node has mapped them, so a crash leaves nothing behind; one whose creator died
   before that is removed by the next segment created in the same pid namespace. */

#define DSK__COMM_SHM_MAGIC 0x314d48534b5344ull /* "DSKSHM1" */
/* The rings fault in at init, not in the first lap of small messages: each rank its own channels
   (dsk__comm_shm_prefault), else (no MADV_POPULATE_WRITE in the headers) the whole segment. */
#if defined(MAP_POPULATE) && !defined(MADV_POPULATE_WRITE)
#define DSK__COMM_MAP_FLAGS (MAP_SHARED | MAP_POPULATE)
#else
#define DSK__COMM_MAP_FLAGS MAP_SHARED
#endif
#define DSK__COMM_LINE 128                       /* keeps indices of the two sides on separate cache lines */
#define DSK__COMM_PAUSE_S 20e-6                  /* spin this long on the CPU ... */
#define DSK__COMM_SPIN_S 10e-3                   /* ... then yield it until this long, then sleep */

typedef struct dsk__comm_shm_head {
    uint64_t magic, bytes, ring;
    int32_t members, mapped; /* mapped: ranks that mapped the segment; the last one unlinks it */
} dsk__comm_shm_head;

typedef struct dsk__comm_shm_rank { /* written by its rank */
    int32_t cpu; /* where the rank last started to wait (-1: unknown) */
} dsk__comm_shm_rank;

typedef struct dsk__comm_chan { /* one direction of one pair; the ring's bytes follow */
    uint64_t head;              /* bytes written, by the producer */
    char pad0[DSK__COMM_LINE - 8];
    uint64_t tail;              /* bytes read, by the consumer */
    char pad1[DSK__COMM_LINE - 8];
    uint32_t sleeping;          /* the consumer sleeps until the producer moves data either way */
    char pad2[DSK__COMM_LINE - 4];
} dsk__comm_chan;

/* A message in a ring: a frame at a 64-byte boundary, then its payload padded to the next
   boundary (unless it has 16 bytes or less and rides in the frame).
   The receiver polls the stamp, written last: (messages in the channel so far << 1) | 1 when
   the payload is already in the ring behind the frame (up to DSK__COMM_EAGER bytes that fit;
   otherwise it streams after the frame, published through the head). So a small message costs
   the receiver the frame's cache line and its payload's, not the head's. Every word at a 64-byte
   boundary of a ring is zero or a live stamp: the receiver clears the boundary words it reads
   before it frees them, so stale bytes never pass for a stamp. */
typedef struct dsk__comm_frame {
    uint64_t stamp;
    dsk__comm_wire hdr;
    char inl[16]; /* a payload of 16 bytes or less */
} dsk__comm_frame;

#define DSK__COMM_FRAME ((uint64_t)sizeof(dsk__comm_frame))
#define DSK__COMM_EAGER ((size_t)16384)
typedef char dsk__comm_frame_is_a_line[sizeof(dsk__comm_frame) == 64 ? 1 : -1];

/* Ring bytes behind the frame for a payload of len bytes (0: in the frame). */
static size_t dsk__comm_ring_payload(size_t len) {
    return len <= sizeof(((dsk__comm_frame *)0)->inl) ? 0 : (len + 63) & ~(size_t)63;
}

/* This rank's view of one peer that shares memory with it. */
struct dsk__comm_link {
    dsk__comm_chan *tx, *rx;    /* the channel to the peer, from the peer; NULL: TCP */
    char *txd, *rxd;            /* their rings */
    uint64_t tx_head, tx_tail;  /* own index, last tail seen */
    uint64_t rx_tail, rx_head;  /* own index, last head seen */
    uint64_t sent, received;    /* messages (frames) */
    int32_t *peer_cpu;          /* the CPU the peer last waited on */
    int gone;                   /* the peer closed its TCP connection */
};

static uint64_t dsk__comm_load64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static void dsk__comm_store64(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

static void dsk__comm_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* The CPU this thread runs on, -1 if unknown. */
static int dsk__comm_cpu(void) {
#if defined(__linux__) && defined(_GNU_SOURCE)
    return sched_getcpu();
#else
    return -1;
#endif
}

static uint64_t dsk__comm_fnv(uint64_t h, const void *p, size_t n) {
    for (size_t i = 0; i < n; i++) h = (h ^ ((const unsigned char *)p)[i]) * 0x100000001b3ull;
    return h;
}

/* The identity that decides which ranks share a node: opts.host_id, DSK_HOST_ID, else the
   host name and the kernel's boot id (two machines never share both). */
static void dsk__comm_host_identity(const char *given, char *buf, size_t cap) {
    const char *v = given && *given ? given : getenv("DSK_HOST_ID");
    char host[128] = "?", boot[64] = "";
    FILE *f;
    if (v && *v) {
        snprintf(buf, cap, "id %.*s", DSK__COMM_HOST_MAX, v);
        return;
    }
    gethostname(host, sizeof host - 1);
    host[sizeof host - 1] = 0;
    if ((f = fopen("/proc/sys/kernel/random/boot_id", "r")) != NULL) {
        if (!fgets(boot, sizeof boot, f)) boot[0] = 0;
        fclose(f);
        boot[strcspn(boot, "\n")] = 0;
    }
    snprintf(buf, cap, "host %.64s boot %.40s", host, boot);
}

/* The inode of this process's pid namespace (0 if unknown): pids in segment names mean
   something only inside it. */
static unsigned long long dsk__comm_pid_ns(void) {
    char link[64] = "";
    unsigned long long ino = 0;
    ssize_t k = readlink("/proc/self/ns/pid", link, sizeof link - 1);
    if (k > 0) {
        link[k] = 0;
        if (sscanf(link, "pid:[%llu]", &ino) != 1) ino = 0;
    }
    return ino;
}

/* Removes segments whose creator (in this pid namespace) is dead: it died before every rank
   had mapped its segment, the only window in which a segment exists under its name. */
static void dsk__comm_shm_clean_stale(unsigned long long ns) {
    DIR *d = opendir("/dev/shm");
    struct dirent *e;
    if (!d) return;
    while ((e = readdir(d)) != NULL) {
        unsigned long long ens;
        int pid, used = 0;
        char name[300];
        if (sscanf(e->d_name, "dsk-%llu-%d-%*16[0-9a-f]%n", &ens, &pid, &used) != 2 || used == 0 ||
            e->d_name[used] != 0 || ens != ns || pid <= 0 || pid == (int)getpid())
            continue;
        if (kill(pid, 0) == 0 || errno != ESRCH) continue;
        snprintf(name, sizeof name, "/%.250s", e->d_name);
        shm_unlink(name);
    }
    closedir(d);
}

static size_t dsk__comm_shm_layout(int L, uint64_t ring, size_t *ranks_at, size_t *chans_at) {
    size_t chan = sizeof(dsk__comm_chan) + (size_t)ring;
    *ranks_at = DSK__COMM_LINE;
    *chans_at = *ranks_at + (size_t)L * DSK__COMM_LINE;
    return *chans_at + (size_t)L * (size_t)L * chan;
}

static dsk__comm_chan *dsk__comm_shm_chan(void *seg, int L, uint64_t ring, int from, int to) {
    size_t ra, ca;
    dsk__comm_shm_layout(L, ring, &ra, &ca);
    return (dsk__comm_chan *)((char *)seg + ca + ((size_t)from * (size_t)L + (size_t)to) *
                                                     (sizeof(dsk__comm_chan) + (size_t)ring));
}

static dsk__comm_shm_rank *dsk__comm_shm_block(void *seg, int j) {
    return (dsk__comm_shm_rank *)((char *)seg + DSK__COMM_LINE + (size_t)j * DSK__COMM_LINE);
}

/* Ring bytes per channel: 256 KiB, less when many ranks share the node (at most 64 MiB of rings). */
static uint64_t dsk__comm_ring_bytes(int L) {
    uint64_t r = (uint64_t)256 << 10;
    while (r > 16384 && (uint64_t)L * (uint64_t)L * r > ((uint64_t)64 << 20)) r >>= 1;
    return r;
}

/* Copies n bytes into the ring at stream position pos (wrapping). */
static void dsk__comm_ring_write(char *ring, uint64_t R, uint64_t pos, const char *src, size_t n) {
    size_t off = (size_t)(pos & (R - 1)), first = n < R - off ? n : (size_t)(R - off);
    memcpy(ring + off, src, first);
    if (n > first) memcpy(ring, src + first, n - first);
}

/* Copies n bytes out of the ring at stream position pos (wrapping), then clears the words at
   64-byte boundaries that end in [pos, pos + n + pad] (pad: bytes the writer skipped, the
   reader's to clear too), so they can never pass for a frame's stamp. A word that the read
   only began is cleared by the read that ends it: the writer may be filling its other bytes,
   and the tail stays before it until then (dsk__comm_publish_tail). */
static void dsk__comm_ring_read(char *ring, uint64_t R, uint64_t pos, char *dst, size_t n, size_t pad) {
    size_t off = (size_t)(pos & (R - 1)), first = n < R - off ? n : (size_t)(R - off);
    memcpy(dst, ring + off, first);
    if (n > first) memcpy(dst + first, ring, n - first);
    for (uint64_t b = (pos + 56) & ~(uint64_t)63; b + 8 <= pos + n + pad; b += 64)
        __atomic_store_n((uint64_t *)(ring + (b & (R - 1))), 0, __ATOMIC_RELAXED);
}

/* Publishes the reader's tail, short of a line whose first word was only partly read: that
   word is cleared by the read that ends it, and the writer must not reuse its bytes before. */
static void dsk__comm_publish_tail(dsk__comm_link *l) {
    uint64_t t = l->rx_tail, in = t & 63;
    dsk__comm_store64(&l->rx->tail, in > 0 && in < 8 ? t - in : t);
}

/* Streams what fits of src[0..len) into the ring; returns the bytes written. `pad` more bytes
   are counted into the head with the last byte (the gap to the next frame). The head is
   published every 64 KiB so the reader starts on a large payload early. */
static size_t dsk__comm_ring_put(dsk__comm_link *l, uint64_t R, const char *src, size_t len, size_t pad) {
    size_t put = 0;
    while (put < len) {
        uint64_t space = R - (l->tx_head - l->tx_tail);
        size_t n = len - put < 65536 ? len - put : 65536, extra = put + n == len ? pad : 0;
        if (space < n + extra) {
            l->tx_tail = dsk__comm_load64(&l->tx->tail);
            space = R - (l->tx_head - l->tx_tail);
        }
        if (space < n + extra) { /* the last byte goes with the pad: hold it back until both fit */
            n = extra ? (space > pad ? (size_t)space - pad : 0) : (size_t)space;
            if (n > len - put) n = len - put;
        }
        if (n == 0) break;
        dsk__comm_ring_write(l->txd, R, l->tx_head, src + put, n);
        put += n;
        l->tx_head += n + (put == len ? pad : 0);
        dsk__comm_store64(&l->tx->head, l->tx_head);
    }
    return put;
}

/* Reads up to len bytes of a streamed payload; returns the bytes read. `pad` more bytes are
   skipped after the last one (the writer counted them into the head with it). */
static size_t dsk__comm_ring_get(dsk__comm_link *l, uint64_t R, char *dst, size_t len, size_t pad) {
    size_t got = 0;
    while (got < len) {
        uint64_t avail = l->rx_head > l->rx_tail ? l->rx_head - l->rx_tail : 0;
        size_t n = len - got;
        if (avail < n) {
            l->rx_head = dsk__comm_load64(&l->rx->head);
            avail = l->rx_head > l->rx_tail ? l->rx_head - l->rx_tail : 0;
        }
        if (n > avail) n = (size_t)avail;
        if (n > 65536) n = 65536;
        if (n == 0) break;
        got += n;
        dsk__comm_ring_read(l->rxd, R, l->rx_tail, dst + got - n, n, got == len ? pad : 0);
        l->rx_tail += n + (got == len ? pad : 0);
        dsk__comm_publish_tail(l);
    }
    return got;
}

/* After moving data with `peer`: if it sleeps on this rank, clear the flag and send it a byte. */
static void dsk__comm_shm_wake(dsk__comm_impl *m, int peer) {
    uint32_t *f = &m->links[peer].tx->sleeping;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(f, __ATOMIC_RELAXED) && __atomic_exchange_n(f, 0, __ATOMIC_ACQ_REL)) {
        char b = 1;
        ssize_t w = send(m->fds[peer], &b, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        (void)w; /* a full socket already holds a wake-up; a closed one belongs to a peer that is gone */
    }
}

/* Reads the wake-up bytes on peer's connection; marks the peer gone at end of stream. */
static void dsk__comm_shm_drain(dsk__comm_impl *m, int peer) {
    char b[64];
    for (;;) {
        ssize_t r = recv(m->fds[peer], b, sizeof b, MSG_DONTWAIT);
        if (r > 0) continue;
        if (r < 0 && errno == EINTR) continue;
        if (r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) m->links[peer].gone = 1;
        return;
    }
}

static void dsk__comm_shm_unmap(dsk__comm_impl *m) {
    if (m->shm) munmap(m->shm, m->shm_bytes);
    m->shm = NULL;
    m->cpu = NULL;
    for (int r = 0; m->links && r < m->world; r++) memset(&m->links[r], 0, sizeof m->links[r]);
}

/* ---------------------------------------------------------------- the host backend's I/O engine
   A call posts one message per (peer, direction) and progresses them all at once with
   poll(), so no order of sends and receives can deadlock. */

typedef struct dsk__comm_io {
    int peer, is_send;
    dsk__comm_wire hdr;      /* sent, or expected */
    dsk__comm_wire got;      /* received */
    char *buf;
    size_t len, done;   /* done counts header + payload bytes */
    int told;           /* a finished receive was reported to dsk__comm_impl.arrived, or as landed by
                           dsk_comm_progress */
    int gated;          /* a send that waits for dsk__comm_impl.ready to open it */
    int after;          /* the op of the same array that must finish first (the same peer and direction; point
                           to point requests), else -1 */
    double due;         /* point to point requests: when the emulated link has carried it (t0 without one) */
} dsk__comm_io;

/* Whether ops[i] waits for an earlier message between the same two ranks. */
static int dsk__comm_io_held(const dsk__comm_io *ops, int i);

static void dsk__comm_wire_describe(const dsk__comm_wire *h, char *buf, size_t n) {
    char extra[64] = "";
    int k = h->kind;
    if (k == DSK__COMM_ALL_REDUCE || k == DSK__COMM_REDUCE_SCATTER || k == DSK__COMM_REDUCE)
        snprintf(extra, sizeof extra, ", %s", dsk_comm_op_name((dsk_comm_op)h->op));
    if (k == DSK__COMM_BROADCAST || k == DSK__COMM_REDUCE || k == DSK__COMM_GATHER || k == DSK__COMM_SCATTER)
        snprintf(extra + strlen(extra), sizeof extra - strlen(extra), ", root %d", (int)h->root);
    snprintf(buf, n, "%s(count %lld, %s%s) call #%llu step %u", dsk__comm_kind_name(h->kind), (long long)h->count,
             dsk_dtype_name((dsk_dtype)h->dtype), extra, (unsigned long long)h->seq, (unsigned)h->step);
}

/* All-to-all-v counts that disagree between this rank and `peer`, seen from either side:
   both ranks get the same sentence naming the sender, the receiver and both counts. */
static dsk_status dsk__comm_a2av_mismatch(dsk_comm *c, const char *fn, int peer, const dsk__comm_wire *got,
                                         const dsk__comm_wire *want) {
    int me = c->rank;
    if (got->count != want->count) /* what peer sends me vs what I expect from it */
        return dsk_set_error(DSK_ERR_PEER,
                             "%s: all_to_all_v counts disagree: rank %d sends rank %d %lld elements but rank "
                             "%d expects %lld (call #%llu; this is rank %d)",
                             fn, peer, me, (long long)got->count, me, (long long)want->count,
                             (unsigned long long)want->seq, me);
    return dsk_set_error(DSK_ERR_PEER,
                         "%s: all_to_all_v counts disagree: rank %d sends rank %d %lld elements but rank %d "
                         "expects %lld (call #%llu; this is rank %d)",
                         fn, me, peer, (long long)want->expect, peer, (long long)got->expect,
                         (unsigned long long)want->seq, me);
}

static int dsk__comm_io_finished(const dsk__comm_io *op) { return op->done == sizeof(dsk__comm_wire) + op->len; }

static int dsk__comm_io_held(const dsk__comm_io *ops, int i) {
    return ops[i].after >= 0 && !dsk__comm_io_finished(&ops[ops[i].after]);
}

/* A received header against the one this rank expects: DSK_OK, or the error naming both calls. */
static dsk_status dsk__comm_check_header(dsk_comm *c, const char *fn, const dsk__comm_io *op) {
    const dsk__comm_wire *g = &op->got, *w = &op->hdr;
    char mine[160], theirs[160];
    if (g->magic != DSK__COMM_WIRE_MAGIC)
        return dsk_set_error(DSK_ERR_CORRUPT, "%s: rank %d sent a message without the dsk header (magic %08x)", fn,
                             op->peer, (unsigned)g->magic);
    if (g->kind == DSK__COMM_ALL_TO_ALL_V && w->kind == g->kind && g->seq == w->seq && g->dtype == w->dtype &&
        (g->count != w->count || g->expect != w->expect))
        return dsk__comm_a2av_mismatch(c, fn, op->peer, g, w);
    if (g->kind == w->kind && g->dtype == w->dtype && g->op == w->op && g->root == w->root && g->count == w->count &&
        g->seq == w->seq && g->step == w->step && g->expect == w->expect)
        return DSK_OK;
    dsk__comm_wire_describe(w, mine, sizeof mine);
    dsk__comm_wire_describe(g, theirs, sizeof theirs);
    return dsk_set_error(DSK_ERR_PEER, "%s: mismatched calls: this rank (%d) expects %s but rank %d sent %s", fn,
                         c->rank, mine, op->peer, theirs);
}


/* "rank P" of this communicator, with its world rank when this one was split from another. */
static const char *dsk__comm_peer_name(const dsk_comm *c, int peer, char *buf, size_t n) {
    if (c->impl->world_of && peer >= 0 && peer < c->world_size)
        snprintf(buf, n, "rank %d (world rank %d)", peer, c->impl->world_of[peer]);
    else snprintf(buf, n, "rank %d", peer);
    return buf;
}

/* The error for a peer that hung up (`how` says how) during op: its own published error if it
   broke first; rank 0 when the store it serves is gone or silent too; else the peer. */
static dsk_status dsk__comm_hangup(dsk_comm *c, const char *fn, const dsk__comm_io *op, const char *how) {
    char what[160], why[400], es[96], peer[48];
    const char *host = strcmp(c->impl->ns, "w") == 0 ? "rank 0" : "world rank 0";
    int store;
    dsk__comm_peer_name(c, op->peer, peer, sizeof peer);
    snprintf(es, sizeof es, "%s", how); /* before the store calls below can touch strerror's buffer */
    store = dsk__comm_peer_fault(c, op->peer, why, sizeof why);
    dsk__comm_wire_describe(&op->hdr, what, sizeof what);
    if (why[0])
        return dsk_set_error(DSK_ERR_PEER, "%s: %s hung up during %s after its own error: %s", fn, peer, what, why);
    if (store == DSK__COMM_STORE_GONE || store == DSK__COMM_STORE_SILENT)
        return dsk_set_error(DSK_ERR_PEER,
                             "%s: lost the connection to %s (%s) during %s; %s, which serves the "
                             "key-value store at %s:%d, %s: it most likely failed first",
                             fn, peer, es, what, host, c->impl->master_addr, c->impl->master_port,
                             store == DSK__COMM_STORE_GONE ? "is gone (exited or crashed)"
                                                           : "does not answer (stopped or overloaded)");
    return dsk_set_error(DSK_ERR_PEER,
                         "%s: lost the connection to %s (%s) during %s: it exited, crashed or "
                         "failed an earlier call",
                         fn, peer, es, what);
}

/* Moves what the socket allows; 1 done, 0 would block, -1 error (*err and the message set). */
static int dsk__comm_io_progress(dsk_comm *c, const char *fn, dsk__comm_io *op, dsk_status *err) {
    int fd = c->impl->fds[op->peer];
    const size_t H = sizeof(dsk__comm_wire);
    while (!dsk__comm_io_finished(op)) {
        ssize_t r;
        if (op->is_send) {
            struct iovec iov[2];
            struct msghdr mh;
            int k = 0;
            memset(&mh, 0, sizeof mh);
            if (op->done < H) { iov[k].iov_base = (char *)&op->hdr + op->done; iov[k].iov_len = H - op->done; k++; }
            if (op->len) {
                size_t off = op->done > H ? op->done - H : 0;
                iov[k].iov_base = op->buf + off; iov[k].iov_len = op->len - off; k++;
            }
            mh.msg_iov = iov;
            mh.msg_iovlen = (size_t)k;
            r = sendmsg(fd, &mh, MSG_NOSIGNAL);
            if (r > 0) {
                op->done += (size_t)r;
                c->stats.bytes_sent += (uint64_t)r;
                if (c->impl->node_of[op->peer] != c->node) c->stats.bytes_sent_off_node += (uint64_t)r;
                continue;
            }
        } else if (op->done < H) {
            r = recv(fd, (char *)&op->got + op->done, H - op->done, 0);
            if (r > 0) {
                op->done += (size_t)r;
                c->stats.bytes_received += (uint64_t)r;
                if (op->done == H && (*err = dsk__comm_check_header(c, fn, op)) != DSK_OK) return -1;
                continue;
            }
        } else {
            size_t off = op->done - H;
            r = recv(fd, op->buf + off, op->len - off, 0);
            if (r > 0) { op->done += (size_t)r; c->stats.bytes_received += (uint64_t)r; continue; }
        }
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
        *err = dsk__comm_hangup(c, fn, op, r == 0 ? "end of stream" : strerror(errno));
        return -1;
    }
    return 1;
}

/* A reduction the engine runs in slices while it waits on sockets, so folding one piece
   overlaps the transfer of the next. srcs holds n pointers (the job owns the array). */
typedef struct dsk__comm_fold_job {
    dsk_dtype dt;
    dsk_comm_op op;
    int n;
    const void **srcs;
    char *dst;
    void *acc;
    int64_t len, done;
} dsk__comm_fold_job;

static void dsk__comm_fold(dsk_dtype dt, dsk_comm_op op, int n, const void *const *src, void *dst, int64_t len,
                           void *acc);

/* Folds the next `max` elements of the job (all that are left if max <= 0). */
static void dsk__comm_fold_slice(dsk__comm_fold_job *job, const void **tmp_srcs, int64_t max) {
    size_t esz = dsk_dtype_size(job->dt);
    int64_t len = job->len - job->done;
    if (max > 0 && len > max) len = max;
    for (int r = 0; r < job->n; r++) tmp_srcs[r] = (const char *)job->srcs[r] + job->done * (int64_t)esz;
    dsk__comm_fold(job->dt, job->op, job->n, tmp_srcs, job->dst + job->done * (int64_t)esz, len, job->acc);
    job->done += len;
}

static int dsk__comm_is_shm(const dsk__comm_impl *m, int peer) { return m->links && m->links[peer].tx; }

/* Whether an op on a shared-memory peer can move now (reads the peer's side, moves nothing). */
static int dsk__comm_shm_ready(dsk__comm_impl *m, const dsk__comm_io *op) {
    dsk__comm_link *l = &m->links[op->peer];
    if (op->is_send) {
        uint64_t space = m->ring - (l->tx_head - dsk__comm_load64(&l->tx->tail));
        return op->done == 0 ? space >= DSK__COMM_FRAME : space > 0;
    }
    if (op->done == 0) {
        const dsk__comm_frame *f = (const dsk__comm_frame *)(l->rxd + (l->rx_tail & (m->ring - 1)));
        return __atomic_load_n(&f->stamp, __ATOMIC_ACQUIRE) >> 1 == l->received + 1;
    }
    return dsk__comm_load64(&l->rx->head) > l->rx_tail;
}

/* A send on shared memory: the frame, with the payload behind it when it fits (or in it when
   tiny), then the rest of the payload streamed. */
static void dsk__comm_shm_send(dsk_comm *c, dsk__comm_io *op) {
    dsk__comm_impl *m = c->impl;
    dsk__comm_link *l = &m->links[op->peer];
    const size_t H = sizeof(dsk__comm_wire), pay = dsk__comm_ring_payload(op->len);
    uint64_t R = m->ring;
    if (op->done == 0) {
        uint64_t space = R - (l->tx_head - l->tx_tail), eager;
        dsk__comm_frame *f;
        if (space < DSK__COMM_FRAME + (pay <= DSK__COMM_EAGER ? pay : 0)) {
            l->tx_tail = dsk__comm_load64(&l->tx->tail);
            space = R - (l->tx_head - l->tx_tail);
        }
        if (space < DSK__COMM_FRAME) return;
        eager = pay && pay <= DSK__COMM_EAGER && space >= DSK__COMM_FRAME + pay;
        if (eager) dsk__comm_ring_write(l->txd, R, l->tx_head + DSK__COMM_FRAME, op->buf, op->len);
        f = (dsk__comm_frame *)(l->txd + (l->tx_head & (R - 1)));
        f->hdr = op->hdr;
        if (op->len && !pay) memcpy(f->inl, op->buf, op->len);
        /* the head first: a reader that sees the stamp must never find the head behind the frame */
        l->tx_head += DSK__COMM_FRAME + (eager ? pay : 0);
        dsk__comm_store64(&l->tx->head, l->tx_head);
        __atomic_store_n(&f->stamp, (++l->sent << 1) | eager, __ATOMIC_RELEASE);
        op->done = pay && !eager ? H : H + op->len;
        c->stats.bytes_sent += op->done;
        return;
    }
    {
        size_t off = op->done - H, k = dsk__comm_ring_put(l, R, op->buf + off, op->len - off, pay - op->len);
        op->done += k;
        c->stats.bytes_sent += k;
    }
}

/* A receive on shared memory: the frame when its stamp shows (the payload with it when it is
   there), then the rest of the payload streamed. -1 on error (*err set). */
static int dsk__comm_shm_recv(dsk_comm *c, const char *fn, dsk__comm_io *op, dsk_status *err) {
    dsk__comm_impl *m = c->impl;
    dsk__comm_link *l = &m->links[op->peer];
    const size_t H = sizeof(dsk__comm_wire), pay = dsk__comm_ring_payload(op->len);
    uint64_t R = m->ring;
    size_t k, off = op->done - H;
    if (op->done == 0) {
        dsk__comm_frame *f = (dsk__comm_frame *)(l->rxd + (l->rx_tail & (R - 1)));
        uint64_t stamp = __atomic_load_n(&f->stamp, __ATOMIC_ACQUIRE);
        if (stamp >> 1 != l->received + 1) return 0;
        l->received++;
        memcpy(&op->got, &f->hdr, H);
        op->done = H;
        c->stats.bytes_received += H;
        if ((*err = dsk__comm_check_header(c, fn, op)) != DSK_OK) return -1;
        if (op->len && !pay) memcpy(op->buf, f->inl, op->len);
        __atomic_store_n(&f->stamp, 0, __ATOMIC_RELAXED);
        l->rx_tail += DSK__COMM_FRAME;
        if (stamp & 1) {
            dsk__comm_ring_read(l->rxd, R, l->rx_tail, op->buf, op->len, pay - op->len);
            l->rx_tail += pay;
        }
        if (!pay || (stamp & 1)) op->done = H + op->len;
        if (l->rx_head < l->rx_tail) l->rx_head = l->rx_tail; /* the cached head: never behind the tail */
        c->stats.bytes_received += op->done - H;
        dsk__comm_publish_tail(l);
        return 1;
    }
    k = dsk__comm_ring_get(l, R, op->buf + off, op->len - off, pay - op->len);
    op->done += k;
    c->stats.bytes_received += k;
    return k > 0;
}

/* Moves what one op on a shared-memory peer allows: 1 if anything moved, 0 if not, -1 on error
   (*err set). A send to a peer that is gone fails; a receive fails once the peer's ring is empty. */
static int dsk__comm_shm_step(dsk_comm *c, const char *fn, dsk__comm_io *op, dsk_status *err) {
    dsk__comm_link *l = &c->impl->links[op->peer];
    size_t before = op->done;
    if (l->gone && op->is_send) { /* the peer will not read what is not in its ring yet */
        *err = dsk__comm_hangup(c, fn, op, "it closed its connection");
        return -1;
    }
    if (op->is_send) dsk__comm_shm_send(c, op);
    else if (dsk__comm_shm_recv(c, fn, op, err) < 0) return -1;
    if (op->done != before) {
        dsk__comm_shm_wake(c->impl, op->peer);
        return 1;
    }
    if (l->gone && !dsk__comm_io_finished(op)) {
        *err = dsk__comm_hangup(c, fn, op, "it closed its connection");
        return -1;
    }
    return 0;
}

/* The error for a call that reached its deadline, naming a peer it waits for (a receive
   first: that peer has not sent). */
static dsk_status dsk__comm_io_timeout(dsk_comm *c, const char *fn, const dsk__comm_io *ops, int n, double t0) {
    int w = -1;
    char what[160], peer[48];
    for (int i = 0; i < n; i++)
        if (!dsk__comm_io_finished(&ops[i]) && !dsk__comm_io_held(ops, i) &&
            (w < 0 || (ops[w].is_send && !ops[i].is_send)))
            w = i;
    if (w < 0) w = 0;
    dsk__comm_wire_describe(&ops[w].hdr, what, sizeof what);
    dsk__comm_peer_name(c, ops[w].peer, peer, sizeof peer);
    if (ops[w].gated) {
        dsk_set_error(DSK_ERR_TIMEOUT,
                      "%s: timed out after %.2f s waiting for the caller to ready its message to %s (%s)", fn,
                      dsk__comm_now() - t0, peer, what);
        return dsk__comm_break(c, DSK_ERR_TIMEOUT);
    }
    dsk_set_error(DSK_ERR_TIMEOUT,
                  "%s: timed out after %.2f s waiting for %s to %s (%zu of %zu bytes) in %s; "
                  "it may be stopped, overloaded or in a different call",
                  fn, dsk__comm_now() - t0, peer, ops[w].is_send ? "accept data" : "send", ops[w].done,
                  sizeof(dsk__comm_wire) + ops[w].len, what);
    return dsk__comm_break(c, DSK_ERR_TIMEOUT);
}

/* Waits in poll() until a TCP op can move, a shared-memory peer wakes this rank (or closes its
   connection) or `ms` pass; TCP ops that can move are progressed. Before sleeping on shared-
   memory peers the flags of those pairs are set and the rings checked again, so no wake-up is
   lost. Returns -1 on error (*err set), else the number of descriptors that were ready. */
static int dsk__comm_io_wait(dsk_comm *c, const char *fn, dsk__comm_io *ops, int n, int ms, dsk_status *err) {
    dsk__comm_impl *m = c->impl;
    int k = 0, shm = 0, r;
    for (int i = 0; i < n; i++) {
        int p = ops[i].peer;
        if (dsk__comm_io_finished(&ops[i]) || ops[i].gated || dsk__comm_io_held(ops, i)) continue;
        if (dsk__comm_is_shm(m, p)) {
            shm = 1;
            if (ms != 0) __atomic_store_n(&m->links[p].rx->sleeping, 1u, __ATOMIC_RELAXED);
        }
        m->pfd[k].fd = m->fds[p];
        m->pfd[k].events = dsk__comm_is_shm(m, p) || !ops[i].is_send ? POLLIN : POLLOUT;
        m->pfd[k].revents = 0;
        m->pidx[k++] = i;
    }
    if (shm && ms != 0) {
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        for (int j = 0; j < k && ms != 0; j++)
            if (dsk__comm_is_shm(m, ops[m->pidx[j]].peer) && dsk__comm_shm_ready(m, &ops[m->pidx[j]])) ms = 0;
    }
    r = poll(m->pfd, (nfds_t)k, ms);
    for (int j = 0; shm && j < k; j++)
        if (dsk__comm_is_shm(m, ops[m->pidx[j]].peer))
            __atomic_store_n(&m->links[ops[m->pidx[j]].peer].rx->sleeping, 0u, __ATOMIC_RELAXED);
    if (r < 0 && errno != EINTR) {
        *err = dsk_set_error(DSK_ERR_IO, "%s: poll: %s", fn, strerror(errno));
        return -1;
    }
    for (int j = 0; r > 0 && j < k; j++) {
        dsk__comm_io *op = &ops[m->pidx[j]];
        if (!m->pfd[j].revents) continue;
        if (dsk__comm_is_shm(m, op->peer)) dsk__comm_shm_drain(m, op->peer);
        else if (dsk__comm_io_progress(c, fn, op, err) < 0) return -1;
    }
    return r > 0 ? r : 0;
}

/* Runs ops[0..n) to completion or to the deadline (t0 + timeout), folding `job` (may be
   NULL) whenever nothing can move; the job is complete on return. Errors break the comm.
   Shared-memory ops move without system calls; when none can, the engine spins, then yields
   (looking at TCP ops without waiting, if any) until DSK__COMM_SPIN_S, then sleeps in poll(). */
/* m->arrived (if set) for each receive of ops[0..n) that finished since the last look. */
static void dsk__comm_tell_arrivals(dsk__comm_impl *m, dsk__comm_io *ops, int n) {
    if (!m->arrived) return;
    for (int i = 0; i < n; i++)
        if (!ops[i].is_send && !ops[i].told && dsk__comm_io_finished(&ops[i])) {
            ops[i].told = 1;
            m->arrived(m->arrived_arg, ops[i].peer);
        }
}

/* Whether a receive of ops[0..n) is whole and not yet reported (dsk_comm_progress's wait). */
static int dsk__comm_whole_untold(const dsk__comm_io *ops, int n) {
    for (int i = 0; i < n; i++)
        if (!ops[i].is_send && !ops[i].told && dsk__comm_io_finished(&ops[i])) return 1;
    return 0;
}

/* Asks m->ready about each gated send of ops[0..n): the number opened, or -1 (*err set) when the caller gave up. */
static int dsk__comm_open_gates(dsk_comm *c, const char *fn, dsk__comm_io *ops, int n, dsk_status *err) {
    dsk__comm_impl *m = c->impl;
    int opened = 0, r;
    for (int i = 0; i < n; i++) {
        if (!ops[i].gated) continue;
        if ((r = m->ready(m->ready_arg, ops[i].peer)) < 0) {
            *err = dsk_set_error(DSK_ERR_STATE, "%s: the caller gave up its message to rank %d (its own error)", fn,
                                 ops[i].peer);
            return -1;
        }
        if (r > 0) {
            ops[i].gated = 0;
            opened++;
        }
    }
    return opened;
}

static dsk_status dsk__comm_io_run(dsk_comm *c, const char *fn, dsk__comm_io *ops, int n, double t0,
                                   dsk__comm_fold_job *job) {
    dsk__comm_impl *m = c->impl;
    double deadline = t0 + m->timeout_s, spin_from = 0;
    unsigned looks = 0; /* idle looks since data last moved */
    int shared_cpu = 0; /* a peer this rank waits for last waited on this CPU: spinning would keep it off */
    for (;;) {
        int shm_wait = 0, tcp_wait = 0, gate_wait = 0, moved = 0, idle = job && job->done < job->len, r;
        dsk_status err = DSK_OK;
        if (m->ready && (r = dsk__comm_open_gates(c, fn, ops, n, &err)) != 0) {
            if (r < 0) return dsk__comm_break(c, err);
            moved = 1;
        }
        for (int i = 0; i < n; i++) {
            if (dsk__comm_io_finished(&ops[i]) || dsk__comm_io_held(ops, i)) continue; /* held: its earlier one waits */
            if (ops[i].gated) {
                gate_wait++;
                continue;
            }
            if (!dsk__comm_is_shm(m, ops[i].peer)) {
                tcp_wait++;
                continue;
            }
            if ((r = dsk__comm_shm_step(c, fn, &ops[i], &err)) < 0) return dsk__comm_break(c, err);
            moved |= r;
            shm_wait += !dsk__comm_io_finished(&ops[i]);
        }
        dsk__comm_tell_arrivals(m, ops, n);
        if (m->until_landed && dsk__comm_whole_untold(ops, n)) return DSK_OK;
        if (m->until_op >= 0 && dsk__comm_io_finished(&ops[m->until_op])) return DSK_OK;
        if (!shm_wait && !tcp_wait && !gate_wait) {
            if (idle) dsk__comm_fold_slice(job, m->srcs + c->world_size, 0);
            return DSK_OK;
        }
        if (tcp_wait && (shm_wait || idle)) { /* TCP next to other work: look without waiting */
            if ((r = dsk__comm_io_wait(c, fn, ops, n, 0, &err)) < 0) return dsk__comm_break(c, err);
            moved |= r > 0;
        }
        if (idle) { /* a slice of the fold between every look at the transfers */
            dsk__comm_fold_slice(job, m->srcs + c->world_size, 32768);
            continue;
        }
        if (moved) {
            spin_from = 0;
            looks = 0;
            continue;
        }
        if (shm_wait && looks == 0) { /* a wait starts: say where, and see whether a peer waited here */
            int cpu = dsk__comm_cpu();
            __atomic_store_n(m->cpu, cpu, __ATOMIC_RELAXED);
            shared_cpu = 0;
            for (int i = 0; i < n && cpu >= 0; i++)
                if (!dsk__comm_io_finished(&ops[i]) && dsk__comm_is_shm(m, ops[i].peer) &&
                    __atomic_load_n(m->links[ops[i].peer].peer_cpu, __ATOMIC_RELAXED) == cpu)
                    shared_cpu = 1;
        }
        if (shm_wait && (++looks & 7) && !shared_cpu && !m->crowded) { /* the clock every 8th idle look */
            dsk__comm_cpu_relax();
            continue;
        }
        {
            double now = dsk__comm_now();
            if (now >= deadline) return dsk__comm_io_timeout(c, fn, ops, n, t0);
            if (shm_wait || gate_wait) {
                if (spin_from == 0) spin_from = now;
                if (now - spin_from < DSK__COMM_PAUSE_S && !shared_cpu && !m->crowded) {
                    dsk__comm_cpu_relax();
                    continue;
                }
                if (now - spin_from < DSK__COMM_SPIN_S) {
                    sched_yield();
                    continue;
                }
            }
        }
        /* a shut gate opens without a wake-up: look again within a millisecond */
        r = gate_wait && dsk__comm_ms_left(deadline) > 1 ? 1 : dsk__comm_ms_left(deadline);
        if (dsk__comm_io_wait(c, fn, ops, n, r, &err) < 0) return dsk__comm_break(c, err);
        if (!gate_wait) spin_from = 0; /* past the spin, a shut gate is looked at once a millisecond */
        looks = 0;
    }
}

static void dsk__comm_io_post(dsk__comm_io *op, int peer, int is_send, const dsk__comm_wire *h, const void *buf,
                              size_t len) {
    op->peer = peer;
    op->is_send = is_send;
    op->hdr = *h;
    memset(&op->got, 0, sizeof op->got);
    op->buf = (char *)buf;
    op->len = len;
    op->done = 0;
    op->told = 0;
    op->gated = 0;
    op->after = -1;
}

/* ---------------------------------------------------------------- reductions (fixed rank order) */

/* f64: the fold in f64. */
static void dsk__comm_fold_f64(dsk_comm_op op, int n, const void *const *src, void *dst, int64_t len, double *a) {
    for (int r = 0; r < n; r++) {
        const double *x = (const double *)src[r];
        if (r == 0) memcpy(a, x, (size_t)len * sizeof(double));
        else if (op == DSK_COMM_SUM || op == DSK_COMM_AVG)
            for (int64_t i = 0; i < len; i++) a[i] = a[i] + x[i];
        else if (op == DSK_COMM_MAX)
            for (int64_t i = 0; i < len; i++) a[i] = (x[i] > a[i] || x[i] != x[i]) ? x[i] : a[i];
        else
            for (int64_t i = 0; i < len; i++) a[i] = (x[i] < a[i] || x[i] != x[i]) ? x[i] : a[i];
    }
    if (op == DSK_COMM_AVG)
        for (int64_t i = 0; i < len; i++) a[i] = a[i] / (double)n;
    memcpy(dst, a, (size_t)len * sizeof(double));
}

/* dst[0..len) = src[0] op src[1] op ... op src[n-1], left to right, in f32 for f32, f16 and
   bf16, f64 for f64 and int64 for integers; AVG divides by n at the end. acc holds len 8-byte
   slots. dst may alias a source. */
static void dsk__comm_fold(dsk_dtype dt, dsk_comm_op op, int n, const void *const *src, void *dst, int64_t len,
                           void *acc) {
    if (dt == DSK_F64) {
        dsk__comm_fold_f64(op, n, src, dst, len, (double *)acc);
    } else if (dsk_dtype_is_float(dt)) {
        /* blocks that stay in cache; per-rank loops without branches so they vectorise */
        const int64_t B = 2048;
        float conv[2048];
        for (int64_t b = 0; b < len; b += B) {
            int64_t nb = len - b < B ? len - b : B;
            float *a = (float *)acc + b;
            for (int r = 0; r < n; r++) {
                const float *x = conv;
                if (dt == DSK_F32) x = (const float *)src[r] + b;
                else if (dt == DSK_BF16)
                    for (int64_t i = 0; i < nb; i++) conv[i] = dsk_bf16_to_f32(((const uint16_t *)src[r])[b + i]);
                else
                    for (int64_t i = 0; i < nb; i++) conv[i] = dsk_f16_to_f32(((const uint16_t *)src[r])[b + i]);
                if (r == 0) memcpy(a, x, (size_t)nb * sizeof(float));
                else if (op == DSK_COMM_SUM || op == DSK_COMM_AVG)
                    for (int64_t i = 0; i < nb; i++) a[i] = a[i] + x[i];
                else if (op == DSK_COMM_MAX)
                    for (int64_t i = 0; i < nb; i++) a[i] = (x[i] > a[i] || x[i] != x[i]) ? x[i] : a[i];
                else
                    for (int64_t i = 0; i < nb; i++) a[i] = (x[i] < a[i] || x[i] != x[i]) ? x[i] : a[i];
            }
            if (op == DSK_COMM_AVG)
                for (int64_t i = 0; i < nb; i++) a[i] = a[i] / (float)n;
            if (dt == DSK_F32) memcpy((float *)dst + b, a, (size_t)nb * sizeof(float));
            else if (dt == DSK_BF16)
                for (int64_t i = 0; i < nb; i++) ((uint16_t *)dst)[b + i] = dsk_f32_to_bf16(a[i]);
            else
                for (int64_t i = 0; i < nb; i++) ((uint16_t *)dst)[b + i] = dsk_f32_to_f16(a[i]);
        }
    } else {
        int64_t *a = (int64_t *)acc;
        for (int r = 0; r < n; r++) {
            const void *s = src[r];
            for (int64_t i = 0; i < len; i++) {
                int64_t x = dt == DSK_I32 ? ((const int32_t *)s)[i] : dt == DSK_I64 ? ((const int64_t *)s)[i]
                                                                                      : ((const uint8_t *)s)[i];
                if (r == 0) a[i] = x;
                else if (op == DSK_COMM_SUM || op == DSK_COMM_AVG) a[i] = (int64_t)((uint64_t)a[i] + (uint64_t)x);
                else if (op == DSK_COMM_MAX) a[i] = x > a[i] ? x : a[i];
                else a[i] = x < a[i] ? x : a[i];
            }
        }
        for (int64_t i = 0; i < len; i++) {
            int64_t v = op == DSK_COMM_AVG ? a[i] / n : a[i];
            if (dt == DSK_I32) ((int32_t *)dst)[i] = (int32_t)(uint32_t)(uint64_t)v;
            else if (dt == DSK_I64) ((int64_t *)dst)[i] = v;
            else ((uint8_t *)dst)[i] = (uint8_t)(uint64_t)v;
        }
    }
}

static dsk__comm_wire dsk__comm_wire_make(dsk__comm_impl *m, int kind, dsk_dtype dt, int op, int root, int64_t count) {
    dsk__comm_wire h;
    memset(&h, 0, sizeof h);
    h.magic = DSK__COMM_WIRE_MAGIC;
    h.kind = (uint16_t)kind;
    h.dtype = (uint8_t)dt;
    h.op = (uint8_t)op;
    h.root = root;
    h.count = count;
    h.seq = m->seq;
    return h;
}

/* ---------------------------------------------------------------- host collectives */

static int64_t dsk__comm_min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t dsk__comm_max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Reduce-scatter by direct exchange. Rank p owns elements [off[p], off[p+1]); in round k each
   rank sends every owner piece k (at most piece_bytes) of its part and folds the pieces it
   receives for its own part in rank order into out, while round k + 1 is on the wire (two
   receive buffers). Every pair exchanges a header every round, even when a piece is empty,
   so mismatched calls are always seen. */
static dsk_status dsk__comm_rs_direct(dsk_comm *c, const char *fn, dsk__comm_wire h, const char *send,
                                      const int64_t *off, dsk_dtype dt, dsk_comm_op op, char *out, double t0,
                                      uint32_t *step) {
    dsk__comm_impl *m = c->impl;
    int n = c->world_size, me = c->rank;
    size_t esz = dsk_dtype_size(dt);
    int64_t P = dsk__comm_max64(1, (int64_t)(m->piece_bytes / esz)), maxlen = 0, rounds;
    size_t tmp_bytes;
    char *tmp;
    dsk__comm_fold_job job;
    for (int p = 0; p < n; p++) maxlen = dsk__comm_max64(maxlen, off[p + 1] - off[p]);
    rounds = maxlen ? (maxlen + P - 1) / P : 1;
    P = dsk__comm_min64(P, dsk__comm_max64(maxlen, 1));
    tmp_bytes = ((size_t)n * (size_t)P * esz + 7) & ~(size_t)7;
    if (!(tmp = (char *)dsk__comm_scratch(m, 2 * tmp_bytes + (size_t)P * 8)))
        return dsk_set_error(DSK_ERR_OOM, "%s: %zu bytes of scratch", fn, 2 * tmp_bytes + (size_t)P * 8);
    memset(&job, 0, sizeof job);
    job.dt = dt;
    job.op = op;
    job.n = n;
    job.srcs = m->srcs;
    job.acc = tmp + 2 * tmp_bytes;
    for (int64_t k = 0; k < rounds; k++) {
        int64_t mine_lo = off[me] + k * P, mine_len = dsk__comm_max64(0, dsk__comm_min64(P, off[me + 1] - mine_lo));
        char *half = tmp + (size_t)(k & 1) * tmp_bytes;
        int no = 0;
        h.step = (*step)++;
        for (int p = 0; p < n; p++) {
            int64_t lo = off[p] + k * P, len = dsk__comm_max64(0, dsk__comm_min64(P, off[p + 1] - lo));
            if (p == me) continue;
            dsk__comm_io_post(&m->ops[no++], p, 1, &h, send + (len ? lo * (int64_t)esz : 0), (size_t)len * esz);
            dsk__comm_io_post(&m->ops[no++], p, 0, &h, half + (size_t)p * (size_t)P * esz, (size_t)mine_len * esz);
        }
        /* this round's transfers, while the previous round's pieces are folded */
        DSK__TRY(dsk__comm_io_run(c, fn, m->ops, no, t0, &job));
        for (int p = 0; p < n; p++)
            m->srcs[p] = p == me ? send + mine_lo * (int64_t)esz : half + (size_t)p * (size_t)P * esz;
        job.dst = out + k * P * (int64_t)esz;
        job.len = mine_len;
        job.done = 0;
    }
    if (job.done < job.len) dsk__comm_fold_slice(&job, m->srcs + n, 0);
    return DSK_OK;
}

/* Every rank sends its part [off[me], off[me+1]) of buf to every other rank (to_all) or to
   ranks != skip, and receives the others' parts in place. */
static dsk_status dsk__comm_ag_direct(dsk_comm *c, const char *fn, dsk__comm_wire h, char *buf, const int64_t *off,
                                      size_t esz, int skip, double t0) {
    dsk__comm_impl *m = c->impl;
    int n = c->world_size, me = c->rank, no = 0;
    for (int p = 0; p < n; p++) {
        if (p == me || p == skip) continue;
        dsk__comm_io_post(&m->ops[no++], p, 1, &h, buf + off[me] * (int64_t)esz, (size_t)(off[me + 1] - off[me]) * esz);
        if (me != skip)
            dsk__comm_io_post(&m->ops[no++], p, 0, &h, buf + off[p] * (int64_t)esz,
                              (size_t)(off[p + 1] - off[p]) * esz);
    }
    return dsk__comm_io_run(c, fn, m->ops, no, t0, NULL);
}

static void dsk__comm_partition(int64_t count, int n, int64_t *off) {
    for (int p = 0; p <= n; p++) off[p] = count / n * p + dsk__comm_min64(p, count % n);
}

static dsk_status dsk__comm_host_all_reduce(dsk_comm *c, const char *fn, const char *send, char *recv, int64_t count,
                                       dsk_dtype dt, dsk_comm_op op, double t0) {
    dsk__comm_impl *m = c->impl;
    int n = c->world_size, me = c->rank;
    size_t esz = dsk_dtype_size(dt), bytes = (size_t)count * esz;
    dsk__comm_wire h = dsk__comm_wire_make(m, DSK__COMM_ALL_REDUCE, dt, op, -1, count);
    uint32_t step = 0;
    if (bytes <= m->small_bytes || count < n) {
        /* one round: every rank receives every buffer and folds them all */
        size_t tb = ((size_t)n * bytes + 7) & ~(size_t)7;
        char *tmp = (char *)dsk__comm_scratch(m, tb + (size_t)count * 8);
        int no = 0;
        if (!tmp) return dsk_set_error(DSK_ERR_OOM, "%s: %zu bytes of scratch", fn, tb + (size_t)count * 8);
        for (int p = 0; p < n; p++) {
            if (p == me) continue;
            dsk__comm_io_post(&m->ops[no++], p, 1, &h, send, bytes);
            dsk__comm_io_post(&m->ops[no++], p, 0, &h, tmp + (size_t)p * bytes, bytes);
        }
        DSK__TRY(dsk__comm_io_run(c, fn, m->ops, no, t0, NULL));
        for (int p = 0; p < n; p++) m->srcs[p] = p == me ? send : tmp + (size_t)p * bytes;
        dsk__comm_fold(dt, op, n, m->srcs, recv, count, tmp + tb);
        return DSK_OK;
    }
    dsk__comm_partition(count, n, m->off);
    DSK__TRY(dsk__comm_rs_direct(c, fn, h, send, m->off, dt, op, recv + m->off[me] * (int64_t)esz, t0, &step));
    h.step = step;
    return dsk__comm_ag_direct(c, fn, h, recv, m->off, esz, -1, t0);
}

static dsk_status dsk__comm_host_reduce_scatter(dsk_comm *c, const char *fn, const char *send, char *recv,
                                                int64_t rcount, dsk_dtype dt, dsk_comm_op op, double t0) {
    dsk__comm_impl *m = c->impl;
    uint32_t step = 0;
    for (int p = 0; p <= c->world_size; p++) m->off[p] = rcount * p;
    return dsk__comm_rs_direct(c, fn, dsk__comm_wire_make(m, DSK__COMM_REDUCE_SCATTER, dt, op, -1, rcount), send,
                               m->off, dt, op, recv, t0, &step);
}

static dsk_status dsk__comm_host_all_gather(dsk_comm *c, const char *fn, const char *send, char *recv, int64_t scount,
                                       dsk_dtype dt, double t0) {
    dsk__comm_impl *m = c->impl;
    size_t esz = dsk_dtype_size(dt);
    char *mine = recv + (int64_t)c->rank * scount * (int64_t)esz;
    if (mine != send && scount) memmove(mine, send, (size_t)scount * esz);
    for (int p = 0; p <= c->world_size; p++) m->off[p] = scount * p;
    return dsk__comm_ag_direct(c, fn, dsk__comm_wire_make(m, DSK__COMM_ALL_GATHER, dt, 0, -1, scount), recv, m->off,
                               esz, -1, t0);
}

/* Posts one exchange with peer p: a send of slen bytes at sbuf and a receive of rlen bytes at
   rbuf, either possibly empty (a header alone). Rooted collectives post one with every peer,
   so each rank checks every other rank's header and a rank that names another root fails. */
static void dsk__comm_post_pair(dsk__comm_impl *m, int *no, int p, const dsk__comm_wire *h, const char *sbuf,
                                size_t slen, char *rbuf, size_t rlen) {
    dsk__comm_io_post(&m->ops[(*no)++], p, 1, h, sbuf, slen);
    dsk__comm_io_post(&m->ops[(*no)++], p, 0, h, rbuf, rlen);
}

/* Small or two ranks: the root sends to every rank. Otherwise scatter + all-gather, so the
   root sends 2(n-1)/n of the buffer instead of (n-1) times all of it. Step 0 is an exchange
   between every pair (see dsk__comm_post_pair); step 1 all-gathers among the other ranks. */
static dsk_status dsk__comm_host_broadcast(dsk_comm *c, const char *fn, const char *send, char *recv, int64_t count,
                                           dsk_dtype dt, int root, double t0) {
    dsk__comm_impl *m = c->impl;
    int n = c->world_size, me = c->rank, no = 0;
    size_t esz = dsk_dtype_size(dt), bytes = (size_t)count * esz;
    int split = bytes > m->small_bytes && n > 2;
    dsk__comm_wire h = dsk__comm_wire_make(m, DSK__COMM_BROADCAST, dt, 0, root, count);
    const int64_t *off = m->off;
    if (me == root && send != recv && bytes) memmove(recv, send, bytes);
    if (split) dsk__comm_partition(count, n, m->off);
    for (int p = 0; p < n; p++) {
        int to = split ? p : 0, from = split ? me : 0; /* the part that goes to p, the part this rank gets */
        size_t slen = split ? (size_t)(off[p + 1] - off[p]) * esz : bytes;
        size_t rlen = split ? (size_t)(off[me + 1] - off[me]) * esz : bytes;
        if (p == me) continue;
        dsk__comm_post_pair(m, &no, p, &h, recv + (split ? off[to] * (int64_t)esz : 0), me == root ? slen : 0,
                            recv + (split ? off[from] * (int64_t)esz : 0), p == root ? rlen : 0);
    }
    DSK__TRY(dsk__comm_io_run(c, fn, m->ops, no, t0, NULL));
    if (!split) return DSK_OK;
    /* all-gather of the parts; nobody sends to the root, which has them all */
    h.step = 1;
    no = 0;
    for (int p = 0; p < n; p++) {
        if (p == me || p == root) continue;
        dsk__comm_io_post(&m->ops[no++], p, 1, &h, recv + off[me] * (int64_t)esz,
                          (size_t)(off[me + 1] - off[me]) * esz);
    }
    if (me != root)
        for (int p = 0; p < n; p++)
            if (p != me)
                dsk__comm_io_post(&m->ops[no++], p, 0, &h, recv + off[p] * (int64_t)esz,
                                  (size_t)(off[p + 1] - off[p]) * esz);
    return dsk__comm_io_run(c, fn, m->ops, no, t0, NULL);
}

/* Small (or fewer elements than ranks): every rank sends its buffer to the root, which folds
   them in rank order. Large: the all-reduce's reduce-scatter, then every rank sends its part
   to the root. Either way the root gets bitwise what dsk_comm_all_reduce gives. */
static dsk_status dsk__comm_host_reduce(dsk_comm *c, const char *fn, const char *send, char *recv, int64_t count,
                                        dsk_dtype dt, dsk_comm_op op, int root, double t0) {
    dsk__comm_impl *m = c->impl;
    int n = c->world_size, me = c->rank, no = 0;
    size_t esz = dsk_dtype_size(dt), bytes = (size_t)count * esz, part_bytes;
    dsk__comm_wire h = dsk__comm_wire_make(m, DSK__COMM_REDUCE, dt, op, root, count);
    uint32_t step = 0;
    char *part;
    dsk_status st;
    if (bytes <= m->small_bytes || count < n) {
        size_t tb = ((size_t)n * bytes + 7) & ~(size_t)7;
        char *tmp = me == root ? (char *)dsk__comm_scratch(m, tb + (size_t)count * 8) : NULL;
        if (me == root && !tmp)
            return dsk_set_error(DSK_ERR_OOM, "%s: %zu bytes of scratch", fn, tb + (size_t)count * 8);
        for (int p = 0; p < n; p++)
            if (p != me)
                dsk__comm_post_pair(m, &no, p, &h, send, p == root ? bytes : 0,
                                    me == root ? tmp + (size_t)p * bytes : NULL, me == root ? bytes : 0);
        DSK__TRY(dsk__comm_io_run(c, fn, m->ops, no, t0, NULL));
        if (me != root) return DSK_OK;
        for (int p = 0; p < n; p++) m->srcs[p] = p == me ? send : tmp + (size_t)p * bytes;
        dsk__comm_fold(dt, op, n, m->srcs, recv, count, tmp + tb);
        return DSK_OK;
    }
    dsk__comm_partition(count, n, m->off);
    part_bytes = (size_t)(m->off[me + 1] - m->off[me]) * esz;
    /* the root folds its part in place; the others into a buffer of their own (rs uses the scratch) */
    part = me == root ? recv + m->off[me] * (int64_t)esz : (char *)DSK_MALLOC(part_bytes ? part_bytes : 1);
    if (!part) return dsk_set_error(DSK_ERR_OOM, "%s: %zu bytes for this rank's part", fn, part_bytes);
    st = dsk__comm_rs_direct(c, fn, h, send, m->off, dt, op, part, t0, &step);
    h.step = step;
    for (int p = 0; st == DSK_OK && p < n; p++) {
        if (p == me || (me != root && p != root)) continue;
        if (me == root) dsk__comm_io_post(&m->ops[no++], p, 0, &h, recv + m->off[p] * (int64_t)esz,
                                          (size_t)(m->off[p + 1] - m->off[p]) * esz);
        else dsk__comm_io_post(&m->ops[no++], p, 1, &h, part, part_bytes);
    }
    if (st == DSK_OK) st = dsk__comm_io_run(c, fn, m->ops, no, t0, NULL);
    if (me != root) DSK_FREE(part);
    return st;
}

/* Every rank sends its block to the root (a header alone to the others, see
   dsk__comm_post_pair); the root's own block is copied. */
static dsk_status dsk__comm_host_gather(dsk_comm *c, const char *fn, const char *send, char *recv, int64_t scount,
                                        dsk_dtype dt, int root, double t0) {
    dsk__comm_impl *m = c->impl;
    int n = c->world_size, me = c->rank, no = 0;
    size_t blk = (size_t)scount * dsk_dtype_size(dt);
    dsk__comm_wire h = dsk__comm_wire_make(m, DSK__COMM_GATHER, dt, 0, root, scount);
    if (me == root && blk && recv + (size_t)root * blk != send) memmove(recv + (size_t)root * blk, send, blk);
    for (int p = 0; p < n; p++)
        if (p != me)
            dsk__comm_post_pair(m, &no, p, &h, send, p == root ? blk : 0, me == root ? recv + (size_t)p * blk : NULL,
                                me == root ? blk : 0);
    return dsk__comm_io_run(c, fn, m->ops, no, t0, NULL);
}

/* The root sends block p to rank p (a header alone between the others); its own is copied. */
static dsk_status dsk__comm_host_scatter(dsk_comm *c, const char *fn, const char *send, char *recv, int64_t rcount,
                                         dsk_dtype dt, int root, double t0) {
    dsk__comm_impl *m = c->impl;
    int n = c->world_size, me = c->rank, no = 0;
    size_t blk = (size_t)rcount * dsk_dtype_size(dt);
    dsk__comm_wire h = dsk__comm_wire_make(m, DSK__COMM_SCATTER, dt, 0, root, rcount);
    if (me == root && blk && send + (size_t)root * blk != recv) memmove(recv, send + (size_t)root * blk, blk);
    for (int p = 0; p < n; p++)
        if (p != me)
            dsk__comm_post_pair(m, &no, p, &h, me == root ? send + (size_t)p * blk : NULL, me == root ? blk : 0, recv,
                                p == root ? blk : 0);
    return dsk__comm_io_run(c, fn, m->ops, no, t0, NULL);
}

/* Waits (yielding) until ready(arg, p) opens p's gate: DSK_OK, or the communicator broken as in io_run. */
static dsk_status dsk__comm_await_gate(dsk_comm *c, const char *fn, dsk_comm_ready_fn ready, void *arg, int p,
                                       double t0) {
    int r;
    while ((r = ready(arg, p)) == 0) {
        if (dsk__comm_now() >= t0 + c->impl->timeout_s) {
            dsk_set_error(DSK_ERR_TIMEOUT,
                          "%s: timed out after %.2f s waiting for the caller to ready its block for rank %d", fn,
                          dsk__comm_now() - t0, p);
            return dsk__comm_break(c, DSK_ERR_TIMEOUT);
        }
        sched_yield();
    }
    if (r > 0) return DSK_OK;
    dsk_set_error(DSK_ERR_STATE, "%s: the caller gave up its message to rank %d (its own error)", fn, p);
    return dsk__comm_break(c, DSK_ERR_STATE);
}

/* Posts an all-to-all's messages in c->impl->ops (message to p = scount[p] elements at send + sdis[p]) and copies
   this rank's own block unless `gated` (its gate opens last); returns the number of ops. */
static int dsk__comm_a2a_post(dsk_comm *c, int kind, const char *send, const int64_t *scount, const int64_t *sdis,
                              char *recv, const int64_t *rcount, const int64_t *rdis, dsk_dtype dt, int gated,
                              dsk_comm_arrived_fn arrived, void *arg) {
    dsk__comm_impl *m = c->impl;
    int n = c->world_size, me = c->rank, no = 0;
    size_t esz = dsk_dtype_size(dt);
    for (int p = 0; p < n; p++) {
        dsk__comm_wire hs, hr;
        if (p == me) {
            if (scount[p] && !gated)
                memmove(recv + rdis[p] * (int64_t)esz, send + sdis[p] * (int64_t)esz, (size_t)scount[p] * esz);
            if (arrived) arrived(arg, me);
            continue;
        }
        hs = dsk__comm_wire_make(m, kind, dt, 0, -1, scount[p]);
        hr = dsk__comm_wire_make(m, kind, dt, 0, -1, rcount[p]);
        if (kind == DSK__COMM_ALL_TO_ALL_V) { /* so a sender of a count its peer does not expect fails too */
            hs.expect = rcount[p];
            hr.expect = scount[p];
        }
        dsk__comm_io_post(&m->ops[no++], p, 1, &hs, send + sdis[p] * (int64_t)esz, (size_t)scount[p] * esz);
        dsk__comm_io_post(&m->ops[no++], p, 0, &hr, recv + rdis[p] * (int64_t)esz, (size_t)rcount[p] * esz);
        m->ops[no - 2].gated = gated;
    }
    return no;
}

/* Moves what ops[0..n) allow now, without waiting: -1 on error (*err set), else the bytes of sends left. */
static int64_t dsk__comm_io_push(dsk_comm *c, const char *fn, dsk__comm_io *ops, int n, dsk_status *err) {
    dsk__comm_impl *m = c->impl;
    int moved = 1, r;
    int64_t left = 0;
    while (moved) {
        int tcp = 0;
        moved = 0;
        for (int i = 0; i < n; i++) {
            if (dsk__comm_io_finished(&ops[i]) || dsk__comm_io_held(ops, i)) continue;
            if (!dsk__comm_is_shm(m, ops[i].peer)) tcp = 1;
            else if ((r = dsk__comm_shm_step(c, fn, &ops[i], err)) < 0) return -1;
            else moved |= r;
        }
        if (tcp) {
            if ((r = dsk__comm_io_wait(c, fn, ops, n, 0, err)) < 0) return -1;
            moved |= r > 0;
        }
    }
    for (int i = 0; i < n; i++)
        if (ops[i].is_send) left += (int64_t)(sizeof(dsk__comm_wire) + ops[i].len - ops[i].done);
    return left;
}

/* Shared by all_to_all and all_to_all_v: message to p = scount[p] elements at send + sdis[p]; arrived (may be
   NULL) told of each rank's message as it lands; ready (may be NULL) opens each message's gate (this rank's own
   block is copied last, after the others' gates opened). */
static dsk_status dsk__comm_host_a2a(dsk_comm *c, const char *fn, int kind, const char *send, const int64_t *scount,
                                     const int64_t *sdis, char *recv, const int64_t *rcount, const int64_t *rdis,
                                     dsk_dtype dt, double t0, dsk_comm_arrived_fn arrived, dsk_comm_ready_fn ready,
                                     void *arg) {
    dsk__comm_impl *m = c->impl;
    int me = c->rank, no;
    size_t esz = dsk_dtype_size(dt);
    dsk_status st;
    no = dsk__comm_a2a_post(c, kind, send, scount, sdis, recv, rcount, rdis, dt, ready != NULL, arrived, arg);
    m->arrived = arrived;
    m->arrived_arg = arg;
    m->ready = ready;
    m->ready_arg = arg;
    st = dsk__comm_io_run(c, fn, m->ops, no, t0, NULL);
    m->arrived = NULL;
    m->ready = NULL;
    if (st == DSK_OK && ready) {
        st = dsk__comm_await_gate(c, fn, ready, arg, me, t0);
        if (st == DSK_OK && scount[me])
            memmove(recv + rdis[me] * (int64_t)esz, send + sdis[me] * (int64_t)esz, (size_t)scount[me] * esz);
    }
    return st;
}

/* dsk_comm_all_to_all_v_start on the host: posted, moved as far as the transport takes it now (*unsent: the
   bytes of sends left); the ops stay for dsk_comm_finish. */
static dsk_status dsk__comm_host_a2a_start(dsk_comm *c, const char *fn, const char *send, const int64_t *scount,
                                           const int64_t *sdis, char *recv, const int64_t *rcount, const int64_t *rdis,
                                           dsk_dtype dt, size_t *unsent) {
    dsk__comm_impl *m = c->impl;
    dsk_status st = DSK_OK;
    int64_t left;
    m->started_n =
        dsk__comm_a2a_post(c, DSK__COMM_ALL_TO_ALL_V, send, scount, sdis, recv, rcount, rdis, dt, 0, NULL, NULL);
    if ((left = dsk__comm_io_push(c, fn, m->ops, m->started_n, &st)) < 0) return dsk__comm_break(c, st);
    if (unsent) *unsent = (size_t)left;
    return DSK_OK;
}

/* When the begun exchange's whole receives that crossed an emulated link would have crossed it: its start, the
   latency and the bytes this rank has received over it at the link's rate (one link takes them one after another);
   0 without one. */
static double dsk__comm_landing_due(const dsk_comm *c) {
    const dsk__comm_impl *m = c->impl;
    size_t got = 0;
    if (m->link_bps <= 0 && m->link_s <= 0) return 0;
    for (int i = 0; i < m->started_n; i++)
        if (!m->ops[i].is_send && dsk__comm_io_finished(&m->ops[i]) && dsk__comm_peer_on_link(c, m->ops[i].peer))
            got += m->ops[i].len;
    return m->started_t0 + m->link_s + (m->link_bps > 0 ? (double)got / m->link_bps : 0);
}

/* dsk_comm_progress on the host: moves the begun exchange's ops as far as they go now and reports the receives
   whole and due as landed (op.told); with `wait`, until one lands that had not, or none is left. */
static dsk_status dsk__comm_host_progress(dsk_comm *c, const char *fn, int wait, double t0, size_t *unsent) {
    dsk__comm_impl *m = c->impl;
    dsk_status st = DSK_OK;
    for (;;) {
        int fresh = 0, left = 0, late = 0, near = 0; /* near: receives left that do not cross the link */
        int64_t bytes = dsk__comm_io_push(c, fn, m->ops, m->started_n, &st);
        double due = dsk__comm_landing_due(c), now = dsk__comm_now();
        if (bytes < 0) return dsk__comm_break(c, st);
        if (unsent) *unsent = (size_t)bytes;
        for (int i = 0; i < m->started_n; i++) {
            dsk__comm_io *op = &m->ops[i];
            if (op->is_send || op->told) continue;
            if (!dsk__comm_io_finished(op)) {
                left++;
                near += !dsk__comm_peer_on_link(c, op->peer);
            } else if (now < due && dsk__comm_peer_on_link(c, op->peer)) late = 1;
            else {
                op->told = 1;
                fresh++;
            }
        }
        if (!wait || fresh || !(left + late)) return DSK_OK;
        if (late) { /* whole, and still on the emulated link; a receive coming off the link may land first */
            dsk__comm_sleep_s(near && due - now > 1e-4 ? 1e-4 : due - now);
            continue;
        }
        m->until_landed = 1;
        st = dsk__comm_io_run(c, fn, m->ops, m->started_n, t0, NULL);
        m->until_landed = 0;
        if (st != DSK_OK) return st;
    }
}

static dsk_status dsk__comm_host_barrier(dsk_comm *c, const char *fn, double t0) {
    dsk__comm_impl *m = c->impl;
    dsk__comm_wire h = dsk__comm_wire_make(m, DSK__COMM_BARRIER, DSK_U8, 0, -1, 0);
    int no = 0;
    for (int p = 0; p < c->world_size; p++) {
        if (p == c->rank) continue;
        dsk__comm_io_post(&m->ops[no++], p, 1, &h, NULL, 0);
        dsk__comm_io_post(&m->ops[no++], p, 0, &h, NULL, 0);
    }
    return dsk__comm_io_run(c, fn, m->ops, no, t0, NULL);
}

/* ---------------------------------------------------------------- bootstrap and mesh */

#define DSK__COMM_EP_LEN 64 /* "ip port" of a rank's mesh listener, zero padded */

typedef struct dsk__comm_hello { uint32_t magic; int32_t rank; uint64_t tag; } dsk__comm_hello;

/* Takes busy_s of the rank's link from t0 or when it frees, whichever is later; returns when those bytes have
   left. Without a link (nic NULL): t0 + busy_s. */
static double dsk__comm_nic_take(dsk__comm_nic *nic, double t0, double busy_s) {
    double cur, next;
    if (!nic) return t0 + busy_s;
    __atomic_load(&nic->free_at, &cur, __ATOMIC_ACQUIRE);
    do next = (cur > t0 ? cur : t0) + busy_s;
    while (!__atomic_compare_exchange(&nic->free_at, &cur, &next, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    return next;
}

static void dsk__comm_nic_share(dsk__comm_impl *m, dsk__comm_nic *nic) {
    m->nic = nic;
    if (nic) __atomic_fetch_add(&nic->refs, 1, __ATOMIC_RELAXED);
}

static void dsk__comm_nic_drop(dsk__comm_impl *m) {
    if (m->nic && __atomic_sub_fetch(&m->nic->refs, 1, __ATOMIC_ACQ_REL) == 0) DSK_FREE(m->nic);
    m->nic = NULL;
}

/* An emulated link's option into *out: `given` (name: its field), else the environment variable `env`, else 0. */
static dsk_status dsk__comm_link_opt(const char *fn, double given, const char *name, const char *env, double *out) {
    const char *v = getenv(env);
    char *end;
    if (!(given >= 0 && given < 1e12)) return dsk_set_error(DSK_ERR_ARG, "%s: %s %g: want 0 or more", fn, name, given);
    *out = given;
    if (given > 0 || !v || !*v) return DSK_OK;
    *out = strtod(v, &end);
    if (*end || !(*out >= 0 && *out < 1e12))
        return dsk_set_error(DSK_ERR_ARG, "%s: %s=\"%s\": want a number, 0 or more", fn, env, v);
    return DSK_OK;
}

/* A world communicator's emulated link, from its options or the environment. */
static dsk_status dsk__comm_link_setup(dsk_comm *c, const char *fn, const dsk_comm_opts *o) {
    double gbps, us;
    DSK__TRY(dsk__comm_link_opt(fn, o ? o->link_gbps : 0, "link_gbps", "DSK_LINK_GBPS", &gbps));
    DSK__TRY(dsk__comm_link_opt(fn, o ? o->link_latency_us : 0, "link_latency_us", "DSK_LINK_LATENCY_US", &us));
    c->impl->link_bps = 1e9 * gbps;
    c->impl->link_s = 1e-6 * us;
    if (gbps > 0 || us > 0) {
        dsk__comm_nic *nic = (dsk__comm_nic *)DSK_MALLOC(sizeof *nic);
        if (!nic) return dsk_set_error(DSK_ERR_OOM, "%s: the emulated link's state", fn);
        memset(nic, 0, sizeof *nic);
        dsk__comm_nic_share(c->impl, nic);
    }
    return DSK_OK;
}

static dsk_status dsk__comm_impl_alloc(dsk_comm *c, const char *fn, const dsk_comm_opts *o, const char *addr,
                                       int port) {
    dsk__comm_impl *m = (dsk__comm_impl *)DSK_MALLOC(sizeof *m);
    int n = c->world_size;
    if (!m) return dsk_set_error(DSK_ERR_OOM, "%s: communicator state", fn);
    memset(m, 0, sizeof *m);
    c->impl = m;
    m->store_fd = -1;
    m->until_op = -1;
    m->timeout_s = o && o->timeout_s > 0 ? o->timeout_s : 300.0;
    m->small_bytes = o ? o->small_bytes : 0; /* 0: the default, chosen once the nodes are known */
    m->piece_bytes = o && o->piece_bytes ? o->piece_bytes : ((size_t)4 << 20);
    snprintf(m->master_addr, sizeof m->master_addr, "%s", addr);
    m->master_port = port;
    snprintf(m->job_id, sizeof m->job_id, "%s", o && o->job_id ? o->job_id : "");
    m->fds = (int *)DSK_MALLOC((size_t)n * sizeof(int));
    m->p2p_sent = (uint64_t *)DSK_MALLOC((size_t)n * sizeof(uint64_t));
    m->p2p_recvd = (uint64_t *)DSK_MALLOC((size_t)n * sizeof(uint64_t));
    m->pfd = (struct pollfd *)DSK_MALLOC((size_t)2 * n * sizeof(struct pollfd));
    m->pidx = (int *)DSK_MALLOC((size_t)2 * n * sizeof(int));
    m->ops = (dsk__comm_io *)DSK_MALLOC((size_t)2 * n * sizeof(dsk__comm_io));
    m->srcs = (const void **)DSK_MALLOC((size_t)2 * n * sizeof(void *)); /* a fold's sources, then a slice's */
    m->off = (int64_t *)DSK_MALLOC((size_t)(n + 1) * sizeof(int64_t));
    m->node_of = (int *)DSK_MALLOC((size_t)n * sizeof(int));
    m->shm_ok = (unsigned char *)DSK_MALLOC((size_t)n);
    m->links = (dsk__comm_link *)DSK_MALLOC((size_t)n * sizeof(dsk__comm_link));
    m->world = n;
    m->rank = c->rank;
    m->kin_prev = m->kin_next = m;
    if (!m->fds || !m->p2p_sent || !m->p2p_recvd || !m->pfd || !m->pidx || !m->ops || !m->srcs || !m->off ||
        !m->node_of || !m->shm_ok || !m->links)
        return dsk_set_error(DSK_ERR_OOM, "%s: communicator arrays for %d ranks", fn, n);
    for (int r = 0; r < n; r++) {
        m->fds[r] = -1;
        m->p2p_sent[r] = m->p2p_recvd[r] = 0;
        m->node_of[r] = 0;
        m->shm_ok[r] = 0;
    }
    memset(m->links, 0, (size_t)n * sizeof(dsk__comm_link));
    c->n_nodes = c->node_size = 1;
    return DSK_OK;
}

/* Numbers the nodes in the order of their lowest rank: ranks r and s share a node when
   same[r] == same[s]; fills node_of and the node fields of c. */
static void dsk__comm_set_nodes(dsk_comm *c, const int *same) {
    dsk__comm_impl *m = c->impl;
    int n = c->world_size, nodes = 0;
    for (int r = 0; r < n; r++) {
        int j = 0;
        while (j < r && same[j] != same[r]) j++;
        m->node_of[r] = j < r ? m->node_of[j] : nodes++;
    }
    c->n_nodes = nodes;
    c->node = m->node_of[c->rank];
    c->node_rank = c->node_size = 0;
    for (int r = 0; r < n; r++) {
        if (m->node_of[r] != c->node) continue;
        c->node_rank += r < c->rank;
        c->node_size++;
    }
}

/* Maps this rank's pages of one channel (a rank uses 2 (L - 1) of the segment's L * L channels:
   every rank mapping all of them, MAP_POPULATE, made an 8-rank job's start mostly page-table work).
   Where the kernel predates MADV_POPULATE_WRITE (5.14) the pages fault in on first use. */
static void dsk__comm_shm_prefault(const void *p, size_t n) {
#ifdef MADV_POPULATE_WRITE
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), a = (uintptr_t)p & ~(page - 1);
    (void)madvise((void *)a, (size_t)((uintptr_t)p + n - a), MADV_POPULATE_WRITE);
#else
    (void)p;
    (void)n;
#endif
}

/* Points this rank's links to the members g[0..L) of its node group (this rank is g[me])
   inside the mapped segment. */
static void dsk__comm_shm_link(dsk_comm *c, const int *g, int L, int me) {
    dsk__comm_impl *m = c->impl;
    m->cpu = &dsk__comm_shm_block(m->shm, me)->cpu;
    for (int j = 0; j < L; j++) {
        dsk__comm_link *l = &m->links[g[j]];
        dsk__comm_shm_rank *b = dsk__comm_shm_block(m->shm, j);
        if (j == me) continue;
        memset(l, 0, sizeof *l);
        l->tx = dsk__comm_shm_chan(m->shm, L, m->ring, me, j);
        l->rx = dsk__comm_shm_chan(m->shm, L, m->ring, j, me);
        l->txd = (char *)(l->tx + 1);
        l->rxd = (char *)(l->rx + 1);
        l->peer_cpu = &b->cpu;
        dsk__comm_shm_prefault(l->tx, sizeof *l->tx + m->ring);
        dsk__comm_shm_prefault(l->rx, sizeof *l->rx + m->ring);
    }
    c->shm_peers = L - 1;
    m->crowded = L > (int)sysconf(_SC_NPROCESSORS_ONLN); /* the machine's, not this rank's affinity */
}

/* Creates (g[0]) or opens (the others) the segment of this rank's node group: members g[0..L)
   in rank order, this rank is g[me]. *seg_out: the mapping or NULL; name: its name ("" if the
   creator failed). The last member to map it unlinks it (*unlinked = 1). */
static dsk_status dsk__comm_shm_map(dsk_comm *c, const char *fn, int L, int me, char *name, size_t cap,
                                    void **seg_out, int *unlinked) {
    dsk__comm_impl *m = c->impl;
    char key[200];
    size_t ra, ca, bytes = dsk__comm_shm_layout(L, m->ring, &ra, &ca), len = 0;
    dsk__comm_shm_head *head;
    struct stat sb;
    void *seg = MAP_FAILED;
    int fd = -1;
    snprintf(key, sizeof key, "dsk/%s/shm/%d", m->ns, m->node_of[c->rank]);
    if (me == 0) {
        unsigned long long ns = dsk__comm_pid_ns();
        uint64_t h = dsk__comm_fnv(0xcbf29ce484222325ull, m->job_id, strlen(m->job_id));
        h = dsk__comm_fnv(h, m->ns, strlen(m->ns));
        h = dsk__comm_fnv(h, &m->tag, sizeof m->tag);
        snprintf(name, cap, "/dsk-%llu-%d-%016llx", ns, (int)getpid(), (unsigned long long)h);
        dsk__comm_shm_clean_stale(ns);
        fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd >= 0 && ftruncate(fd, (off_t)bytes) == 0)
            seg = mmap(NULL, bytes, PROT_READ | PROT_WRITE, DSK__COMM_MAP_FLAGS, fd, 0);
        if (seg != MAP_FAILED) {
            head = (dsk__comm_shm_head *)seg;
            head->bytes = bytes;
            head->ring = m->ring;
            head->members = L;
            head->magic = DSK__COMM_SHM_MAGIC;
        } else {
            if (fd >= 0) shm_unlink(name);
            name[0] = 0; /* the others fall back to TCP */
        }
        if (fd >= 0) close(fd);
        *seg_out = seg == MAP_FAILED ? NULL : seg;
        DSK__TRY(dsk__comm_store_set(c, fn, key, name, strlen(name) + 1));
    } else {
        DSK__TRY(dsk__comm_store_get(c, fn, key, name, cap - 1, &len));
        name[len < cap ? len : cap - 1] = 0;
        if (name[0] && (fd = shm_open(name, O_RDWR, 0)) >= 0 && fstat(fd, &sb) == 0 && (size_t)sb.st_size == bytes)
            seg = mmap(NULL, bytes, PROT_READ | PROT_WRITE, DSK__COMM_MAP_FLAGS, fd, 0);
        if (fd >= 0) close(fd);
        head = (dsk__comm_shm_head *)seg;
        if (seg != MAP_FAILED && (head->magic != DSK__COMM_SHM_MAGIC || head->bytes != bytes ||
                                  head->ring != m->ring || head->members != L)) {
            munmap(seg, bytes);
            seg = MAP_FAILED;
        }
        *seg_out = seg == MAP_FAILED ? NULL : seg;
    }
    if (*seg_out) {
        dsk__comm_shm_rank *b = dsk__comm_shm_block(*seg_out, me);
        b->cpu = -1;
        if (__atomic_add_fetch(&((dsk__comm_shm_head *)*seg_out)->mapped, 1, __ATOMIC_ACQ_REL) == L) {
            shm_unlink(name);
            *unlinked = 1;
        }
    }
    return DSK_OK;
}

/* Shared memory for this rank's node group (ranks of its node that allow it). Every member
   says through the store whether it mapped the segment; if one did not (another /dev/shm, no
   memory), the whole group keeps TCP. */
static dsk_status dsk__comm_shm_setup(dsk_comm *c, const char *fn) {
    dsk__comm_impl *m = c->impl;
    int n = c->world_size, L = 0, me = -1, ok = 1, unlinked = 0, *g;
    char name[128] = "", key[200];
    void *seg = NULL;
    dsk_status st;
    if (!m->shm_ok[c->rank]) return DSK_OK;
    if (!(g = (int *)DSK_MALLOC((size_t)n * sizeof(int))))
        return dsk_set_error(DSK_ERR_OOM, "%s: node group of %d ranks", fn, n);
    for (int r = 0; r < n; r++) {
        if (m->node_of[r] != c->node || !m->shm_ok[r]) continue;
        if (r == c->rank) me = L;
        g[L++] = r;
    }
    if (L < 2) {
        DSK_FREE(g);
        return DSK_OK;
    }
    m->ring = dsk__comm_ring_bytes(L);
    st = dsk__comm_shm_map(c, fn, L, me, name, sizeof name, &seg, &unlinked);
    if (seg) {
        size_t ra, ca;
        m->shm = seg;
        m->shm_bytes = dsk__comm_shm_layout(L, m->ring, &ra, &ca);
    }
    if (st == DSK_OK) {
        char v = seg ? 1 : 0;
        snprintf(key, sizeof key, "dsk/%s/shm/%d/ok/%d", m->ns, c->node, c->rank);
        st = dsk__comm_store_set(c, fn, key, &v, 1);
        for (int j = 0; st == DSK_OK && j < L; j++) {
            size_t len = 0;
            snprintf(key, sizeof key, "dsk/%s/shm/%d/ok/%d", m->ns, c->node, g[j]);
            if ((st = dsk__comm_store_get(c, fn, key, &v, 1, &len)) == DSK_OK && (len != 1 || !v)) ok = 0;
        }
    }
    if (name[0] && !unlinked && (st != DSK_OK || !ok)) shm_unlink(name);
    if (st == DSK_OK && ok) dsk__comm_shm_link(c, g, L, me);
    else dsk__comm_shm_unmap(m);
    DSK_FREE(g);
    return st;
}

static void dsk__comm_impl_free(dsk_comm *c) {
    dsk__comm_impl *m = c->impl;
    if (!m) return;
    m->kin_prev->kin_next = m->kin_next;
    m->kin_next->kin_prev = m->kin_prev;
    dsk__comm_nic_drop(m);
    if (m->node_comm) dsk_comm_free(m->node_comm);
    if (m->cross_comm) dsk_comm_free(m->cross_comm);
    DSK_FREE(m->node_comm);
    DSK_FREE(m->cross_comm);
#ifdef DSK_CUDA
    if (m->nccl) {
        if (m->broken) ncclCommAbort(m->nccl);
        else {
            /* finalize flushes outstanding work; bounded, then abort */
            double deadline = dsk__comm_now() + m->timeout_s;
            ncclResult_t state = ncclSuccess;
            if (ncclCommFinalize(m->nccl) == ncclSuccess || ncclCommGetAsyncError(m->nccl, &state) == ncclSuccess) {
                do {
                    ncclCommGetAsyncError(m->nccl, &state);
                } while (state == ncclInProgress && dsk__comm_now() < deadline);
            }
            if (state == ncclSuccess) ncclCommDestroy(m->nccl);
            else ncclCommAbort(m->nccl);
        }
    }
    dsk_cuda_free(NULL, m->nccl_flag);
#endif
    dsk__comm_shm_unmap(m);
    for (int r = 0; m->fds && r < c->world_size; r++)
        if (m->fds[r] >= 0) close(m->fds[r]);
    if (m->store_fd >= 0) close(m->store_fd); /* before the server, which waits for its clients to leave */
    dsk__comm_store_server_free(m->server);
    DSK_FREE(m->fds); DSK_FREE(m->p2p_sent); DSK_FREE(m->p2p_recvd); DSK_FREE(m->pfd); DSK_FREE(m->pidx);
    DSK_FREE(m->ops);
    DSK_FREE((void *)m->srcs);
    DSK_FREE(m->off);
    DSK_FREE(m->scratch);
    DSK_FREE(m->p2p);
    DSK_FREE(m->node_of);
    DSK_FREE(m->world_of);
    DSK_FREE(m->shm_ok);
    DSK_FREE(m->links);
    DSK_FREE(m);
    c->impl = NULL;
}

DSK_API void dsk_comm_free(dsk_comm *c) {
    if (!c) return;
    dsk__comm_impl_free(c);
    memset(c, 0, sizeof *c);
}

/* A listener for this rank's mesh connections; ep = "ip port" where peers reach it. */
static dsk_status dsk__comm_mesh_listen(dsk_comm *c, const char *fn, int *lfd, char *ep) {
    struct sockaddr_in any;
    int port;
    memset(&any, 0, sizeof any);
    any.sin_family = AF_INET;
    any.sin_addr.s_addr = htonl(INADDR_ANY);
    DSK__TRY(dsk__comm_listen(fn, &any, NULL, lfd, &port));
    memset(ep, 0, DSK__COMM_EP_LEN);
    snprintf(ep, DSK__COMM_EP_LEN, "%.46s %d", c->impl->my_ip, port);
    return DSK_OK;
}

/* Connects every pair: rank i connects to each j < i and accepts each j > i. eps[r] is
   rank r's endpoint. Hellos carry (rank, tag) so stray connections are refused. */
static dsk_status dsk__comm_mesh_connect(dsk_comm *c, const char *fn, int lfd, const char *eps, size_t stride,
                                         double deadline) {
    dsk__comm_impl *m = c->impl;
    int n = c->world_size, me = c->rank, pending = n - 1 - me;
    for (int j = 0; j < me; j++) {
        char ip[DSK__COMM_EP_LEN], who[96];
        int port = 0;
        struct sockaddr_in sa;
        dsk__comm_hello hello;
        const char *ep = eps + (size_t)j * stride;
        if (sscanf(ep, "%63s %d", ip, &port) != 2)
            return dsk_set_error(DSK_ERR_CORRUPT, "%s: rank %d published a bad endpoint \"%.63s\"", fn, j, ep);
        snprintf(who, sizeof who, "rank %d's mesh listener", j);
        DSK__TRY(dsk__comm_resolve(fn, ip, port, &sa));
        DSK__TRY(dsk__comm_connect(fn, &sa, deadline, who, &m->fds[j]));
        hello.magic = DSK__COMM_WIRE_MAGIC;
        hello.rank = me;
        hello.tag = m->tag;
        DSK__TRY(dsk__comm_write_full(fn, m->fds[j], &hello, sizeof hello, deadline, who));
    }
    while (pending > 0) {
        struct pollfd pf;
        dsk__comm_hello hello;
        int fd;
        pf.fd = lfd; pf.events = POLLIN; pf.revents = 0;
        if (poll(&pf, 1, dsk__comm_ms_left(deadline)) <= 0) {
            int first = -1;
            for (int j = n - 1; j > me; j--)
                if (m->fds[j] < 0) first = j;
            return dsk_set_error(DSK_ERR_TIMEOUT,
                                 "%s: timed out waiting for rank %d (and %d more) to connect to rank %d", fn, first,
                                 pending - 1, me);
        }
        if ((fd = accept(lfd, NULL, NULL)) < 0) continue;
        dsk__comm_tune_socket(fd);
        if (dsk__comm_read_full(fn, fd, &hello, sizeof hello, deadline, "a connecting rank") != DSK_OK ||
            hello.magic != DSK__COMM_WIRE_MAGIC || hello.tag != m->tag || hello.rank <= me || hello.rank >= n ||
            m->fds[hello.rank] >= 0) {
            close(fd); /* not one of ours */
            continue;
        }
        m->fds[hello.rank] = fd;
        pending--;
    }
    return DSK_OK;
}

static int dsk__comm_env_int(const char *name, int *out, int *present, char *why, size_t nwhy) {
    const char *v = getenv(name);
    char *end;
    long x;
    *present = v && *v;
    if (!*present) return 1;
    errno = 0;
    x = strtol(v, &end, 10);
    if (errno || *end || end == v || x < 0 || x > 1000000) {
        snprintf(why, nwhy, "%s=\"%s\" is not a non-negative integer", name, v);
        return 0;
    }
    *out = (int)x;
    return 1;
}

#ifdef DSK_CUDA
static dsk_status dsk__comm_nccl_check(dsk_comm *c, const char *fn, ncclResult_t r, const char *what) {
    if (r == ncclSuccess || r == ncclInProgress) return DSK_OK;
    return dsk_set_error(DSK_ERR_NCCL, "%s: %s failed on rank %d: %s (%s)", fn, what, c ? c->rank : -1,
                         ncclGetErrorString(r), c && c->impl && c->impl->nccl ? ncclGetLastError(c->impl->nccl) : "");
}

/* Polls a nonblocking communicator until its last call left ncclInProgress; aborts at the deadline. */
static dsk_status dsk__comm_nccl_settle(dsk_comm *c, const char *fn, ncclComm_t comm, double t0, const char *what) {
    dsk__comm_impl *m = c->impl;
    ncclResult_t state = ncclInProgress;
    for (;;) {
        ncclResult_t r = ncclCommGetAsyncError(comm, &state);
        if (r != ncclSuccess) state = r;
        if (state != ncclInProgress) break;
        if (dsk__comm_now() - t0 > m->timeout_s) {
            dsk_set_error(DSK_ERR_TIMEOUT,
                          "%s: %s on rank %d still in progress after %.2f s; aborting the NCCL communicator", fn, what,
                          c->rank, dsk__comm_now() - t0);
            return dsk__comm_break(c, DSK_ERR_TIMEOUT);
        }
    }
    if (state != ncclSuccess) {
        dsk__comm_nccl_check(c, fn, state, what);
        return dsk__comm_break(c, DSK_ERR_NCCL);
    }
    return DSK_OK;
}

static dsk_status dsk__comm_nccl_init(dsk_comm *c, const char *fn, double t0) {
    dsk__comm_impl *m = c->impl;
    ncclUniqueId id;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    size_t len = 0;
    dsk_status st;
    char key[128];
    DSK__TRY(dsk_cuda_set_device(c->cuda_device)); /* dsk__comm_gpu_identity's, checked by every rank's record */
    snprintf(key, sizeof key, "dsk/%s/nccl_id", m->ns);
    if (c->rank == 0) {
        ncclResult_t r = ncclGetUniqueId(&id);
        if (r != ncclSuccess) return dsk__comm_nccl_check(c, fn, r, "ncclGetUniqueId");
        DSK__TRY(dsk__comm_store_set(c, fn, key, &id, sizeof id));
    } else {
        DSK__TRY(dsk__comm_store_get(c, fn, key, &id, sizeof id, &len));
        if (len != sizeof id)
            return dsk_set_error(DSK_ERR_CORRUPT, "%s: NCCL unique id of %zu bytes, want %zu", fn, len, sizeof id);
    }
    cfg.blocking = 0;
    if ((st = dsk__comm_nccl_check(c, fn, ncclCommInitRankConfig(&m->nccl, c->world_size, id, c->rank, &cfg),
                                   "ncclCommInitRankConfig")) != DSK_OK)
        return dsk__comm_break(c, st); /* aborts what init left */
    DSK__TRY(dsk__comm_nccl_settle(c, fn, m->nccl, t0, "ncclCommInitRankConfig"));
    return dsk_cuda_device_malloc(sizeof(float), &m->nccl_flag);
}
#endif

/* ---------------------------------------------------------------- init */

/* Rank 0's record in the store: the world size and the job identity that every joiner checks. */
typedef struct dsk__comm_hello_rec { int32_t world; char job[DSK__COMM_JOB_MAX + 4]; } dsk__comm_hello_rec;

/* A joiner whose job id differs from rank 0's has reached another job's store: it must not join. */
static dsk_status dsk__comm_same_job(dsk_comm *c, const char *fn, dsk__comm_hello_rec *hello) {
    dsk__comm_impl *m = c->impl;
    hello->job[DSK__COMM_JOB_MAX] = 0;
    if (strcmp(hello->job, m->job_id) == 0) return DSK_OK;
    return dsk_set_error(
        DSK_ERR_ARG,
        "%s: the key-value store at %s:%d belongs to another job: its rank 0 has job id "
        "\"%s\", this rank (%d of %d) has \"%s\". Two jobs share MASTER_ADDR:MASTER_PORT; give each job "
        "its own port",
        fn, m->master_addr, m->master_port, hello->job, c->rank, c->world_size, m->job_id);
}

/* Claims this rank in the store, naming this process. A second claim by another process is a
   duplicate RANK: DSK_ERR_ARG at once. A second claim by this same process means the store
   is its previous communicator's on this port, shutting down: DSK_ERR_PEER, to retry. */
static dsk_status dsk__comm_claim(dsk_comm *c, const char *fn) {
    dsk__comm_impl *m = c->impl;
    char key[64], me[160], other[160], host[64] = "?";
    int64_t claims = 0;
    size_t len = 0;
    gethostname(host, sizeof host - 1);
    host[sizeof host - 1] = 0;
    memset(me, 0, sizeof me);
    memset(other, 0, sizeof other);
    snprintf(me, sizeof me, "pid %ld on %s (%s)", (long)getpid(), host, m->my_ip);
    snprintf(key, sizeof key, "dsk/w/claim/%d", c->rank);
    DSK__TRY(dsk__comm_store_add(c, fn, key, 1, &claims));
    snprintf(key, sizeof key, "dsk/w/claimer/%d", c->rank);
    if (claims == 1) return dsk__comm_store_set(c, fn, key, me, sizeof me);
    DSK__TRY(dsk__comm_store_get(c, fn, key, other, sizeof other - 1, &len));
    if (strcmp(other, me) != 0)
        return dsk_set_error(DSK_ERR_ARG,
                             "%s: rank %d is claimed by %lld processes: %s and this one, %s (is RANK %d set "
                             "twice?)",
                             fn, c->rank, (long long)claims, other, me, c->rank);
    return dsk_set_error(DSK_ERR_PEER,
                         "%s: the key-value store at %s:%d still holds this process's claim of rank %d from "
                         "a previous communicator",
                         fn, m->master_addr, m->master_port, c->rank);
}

/* Rank 0 could not serve the store on its port (status st). When a dsk store whose rank 0 has
   claimed its rank answers there, this process is a second rank 0 (or rank 0 of a second job
   on the port): say so rather than "pick another port". Asks for at most a second. */
static dsk_status dsk__comm_second_zero(dsk_comm *c, const char *fn, const struct sockaddr_in *sa, dsk_status st) {
    dsk__comm_impl *m = c->impl;
    dsk__comm_hello_rec hello;
    char saved[1024], other[160], host[64] = "?";
    double keep = m->timeout_s;
    size_t len = 0, olen = 0;
    int found;
    snprintf(saved, sizeof saved, "%s", dsk_last_error());
    memset(other, 0, sizeof other);
    m->timeout_s = keep < 1.0 ? keep : 1.0;
    found = dsk__comm_connect(fn, sa, dsk__comm_now() + 0.5, "key-value store", &m->store_fd) == DSK_OK &&
            dsk__comm_store_get(c, fn, "dsk/w/hello", &hello, sizeof hello, &len) == DSK_OK &&
            len == sizeof hello &&
            dsk__comm_store_get(c, fn, "dsk/w/claimer/0", other, sizeof other - 1, &olen) == DSK_OK;
    m->timeout_s = keep;
    if (m->store_fd >= 0) close(m->store_fd);
    m->store_fd = -1;
    if (!found) return dsk_set_error(st, "%s", saved);
    hello.job[DSK__COMM_JOB_MAX] = 0;
    gethostname(host, sizeof host - 1);
    host[sizeof host - 1] = 0;
    {
        char me[96];
        int k = snprintf(me, sizeof me, "pid %ld on %s ", (long)getpid(), host);
        if (k > 0 && (size_t)k < sizeof me && !strncmp(other, me, (size_t)k))
            return dsk_set_error(DSK_ERR_ARG,
                                 "%s: this process already serves rank 0's key-value store at %s:%d (a communicator "
                                 "not freed yet): free it first or give the new one another port",
                                 fn, m->master_addr, m->master_port);
    }
    if (strcmp(hello.job, m->job_id) != 0)
        return dsk_set_error(DSK_ERR_ARG,
                             "%s: port %d on %s is taken by the key-value store of another job's rank 0 (%s, job id "
                             "\"%s\"; this process, pid %ld on %s, has \"%s\"): give each job its own MASTER_PORT",
                             fn, m->master_port, m->master_addr, other, hello.job, (long)getpid(), host, m->job_id);
    return dsk_set_error(DSK_ERR_ARG,
                         "%s: rank 0 is claimed by 2 processes: %s serves the key-value store at %s:%d, and this "
                         "one, pid %ld on %s, is rank 0 too (is RANK 0 set twice?)",
                         fn, other, m->master_addr, m->master_port, (long)getpid(), host);
}

/* Connects to the store, checks the world size and claims this rank. A rank other than 0
   that reaches a store which then hangs up, or that already holds its claim, has met the
   store of a previous communicator on this port that is shutting down: it retries. */
static dsk_status dsk__comm_join(dsk_comm *c, const char *fn, const struct sockaddr_in *store_sa, double deadline) {
    dsk__comm_impl *m = c->impl;
    int rank = c->rank, world = c->world_size;
    for (;;) {
        struct sockaddr_in local;
        socklen_t sl = sizeof local;
        dsk__comm_hello_rec hello;
        size_t len = 0;
        dsk_status st = dsk__comm_connect(fn, store_sa, deadline, "key-value store (served by rank 0)", &m->store_fd);
        if (st != DSK_OK) {
            char msg[1200];
            snprintf(msg, sizeof msg, "%s (rank %d of %d; is rank 0 running and MASTER_ADDR:MASTER_PORT right?)",
                     dsk_last_error(), rank, world);
            return dsk_set_error(st, "%s", msg);
        }
        m->store_gone = 0;
        if (getsockname(m->store_fd, (struct sockaddr *)&local, &sl) != 0 ||
            !inet_ntop(AF_INET, &local.sin_addr, m->my_ip, sizeof m->my_ip))
            return dsk_set_error(DSK_ERR_IO, "%s: getsockname: %s", fn, strerror(errno));
        if (rank == 0) {
            memset(&hello, 0, sizeof hello);
            hello.world = world;
            memcpy(hello.job, m->job_id, sizeof hello.job);
            DSK__TRY(dsk__comm_store_set(c, fn, "dsk/w/hello", &hello, sizeof hello));
        }
        st = dsk__comm_store_get(c, fn, "dsk/w/hello", &hello, sizeof hello, &len);
        if (st == DSK_OK && len != sizeof hello)
            return dsk_set_error(DSK_ERR_CORRUPT,
                                 "%s: the key-value store at %s:%d is not a dsk store of this version "
                                 "(hello of %zu bytes, want %zu)",
                                 fn, m->master_addr, m->master_port, len, sizeof hello);
        if (st == DSK_OK) DSK__TRY(dsk__comm_same_job(c, fn, &hello));
        if (st == DSK_OK && hello.world != world)
            return dsk_set_error(DSK_ERR_ARG, "%s: this rank (%d) has WORLD_SIZE %d but rank 0 has %d", fn, rank, world,
                                 (int)hello.world);
        if (st == DSK_OK) st = dsk__comm_claim(c, fn);
        if (st == DSK_OK || rank == 0 || st != DSK_ERR_PEER || dsk__comm_now() >= deadline) return st;
        dsk__comm_store_fail(m, DSK_ERR_STATE);
        dsk__comm_sleep_s(0.05);
    }
}

/* What every rank publishes at init: where its peers reach it (host) and the options that
   shape the wire protocol, which must agree on every rank. */
typedef struct dsk__comm_rank_rec {
    char ep[DSK__COMM_EP_LEN];
    uint64_t small_bytes, piece_bytes;
    int32_t backend, transport;
    char host[DSK__COMM_HOST_MAX + 16]; /* host identity: same string, same node */
    char gpu[32];                       /* the PCI bus id of the device nccl would give it; "" none */
} dsk__comm_rank_rec;

/* The device this rank takes on nccl, c->cuda_device (local rank modulo the visible devices; -1
   without one), and its PCI bus id in buf ("" without), so that ranks given one GPU each by
   CUDA_VISIBLE_DEVICES count as distinct. */
static void dsk__comm_gpu_identity(dsk_comm *c, char *buf, int len) {
    buf[0] = 0;
    c->cuda_device = -1;
#ifdef DSK_CUDA
    int ndev = 0;
    if (dsk_cuda_device_count(&ndev) != DSK_OK || ndev == 0) return;
    if (dsk_cuda_device_bus_id(c->local_rank % ndev, buf, len) == DSK_OK) c->cuda_device = c->local_rank % ndev;
    else buf[0] = 0;
#else
    (void)len;
#endif
}

/* The backend from every rank's record: auto is nccl where each rank has a device of its own (none
   missing, no two ranks of a host on one: nccl refuses those, "Duplicate GPU detected"), else host;
   nccl asked for where that does not hold is an error naming the ranks. */
static dsk_status dsk__comm_resolve_backend(dsk_comm *c, const char *fn, dsk__comm_rank_rec *recs,
                                            dsk_comm_backend *be) {
    int n = c->world_size, a = -1, b = -1;
    for (int r = 0; r < n && a < 0; r++) {
        if (!recs[r].gpu[0]) a = r;
        for (int q = 0; q < r && a < 0; q++)
            if (!strcmp(recs[q].gpu, recs[r].gpu) && !strcmp(recs[q].host, recs[r].host)) a = q, b = r;
    }
    if (*be == DSK_COMM_AUTO) *be = a < 0 ? DSK_COMM_NCCL : DSK_COMM_HOST;
    for (int r = 0; r < n; r++) recs[r].backend = (int32_t)*be;
    if (*be != DSK_COMM_NCCL || a < 0) return DSK_OK;
    if (b < 0)
        return dsk_set_error(DSK_ERR_UNSUPPORTED,
                             "%s: the nccl backend needs a CUDA device on every rank; rank %d has none", fn, a);
    return dsk_set_error(DSK_ERR_UNSUPPORTED,
                         "%s: the nccl backend needs a CUDA device per rank; ranks %d and %d (%s) would share "
                         "device %s (fewer visible devices than local ranks)",
                         fn, a, b, recs[a].host, recs[a].gpu);
}

static dsk_status dsk__comm_same_options(dsk_comm *c, const char *fn, const dsk__comm_rank_rec *mine,
                                         const dsk__comm_rank_rec *theirs, int r) {
    static const char *names[] = {"auto", "host", "nccl"};
    const char *what = theirs->small_bytes != mine->small_bytes ? "small_bytes" : "piece_bytes";
    if (theirs->backend != mine->backend)
        return dsk_set_error(DSK_ERR_ARG, "%s: rank %d uses the %s backend but this rank (%d) uses %s", fn, r,
                             theirs->backend >= 0 && theirs->backend < 3 ? names[theirs->backend] : "an unknown",
                             c->rank, names[mine->backend]);
    if (theirs->small_bytes == mine->small_bytes && theirs->piece_bytes == mine->piece_bytes) return DSK_OK;
    {
        uint64_t t = what[0] == 's' ? theirs->small_bytes : theirs->piece_bytes;
        uint64_t m = what[0] == 's' ? mine->small_bytes : mine->piece_bytes;
        char ts[32], ms[32];
        snprintf(ts, sizeof ts, t ? "%llu" : "the default", (unsigned long long)t);
        snprintf(ms, sizeof ms, m ? "%llu" : "the default", (unsigned long long)m);
        return dsk_set_error(DSK_ERR_ARG,
                             "%s: rank %d has %s %s but this rank (%d) has %s; every rank must use the same "
                             "small_bytes and piece_bytes (they shape the wire protocol)",
                             fn, r, what, ts, c->rank, ms);
    }
}

/* Nodes from the host identities in the rank records; which ranks allow shared memory. */
static dsk_status dsk__comm_world_nodes(dsk_comm *c, const char *fn, const dsk__comm_rank_rec *recs) {
    dsk__comm_impl *m = c->impl;
    int n = c->world_size, *same = (int *)DSK_MALLOC((size_t)n * sizeof(int));
    if (!same) return dsk_set_error(DSK_ERR_OOM, "%s: nodes of %d ranks", fn, n);
    memset(same, 0, (size_t)n * sizeof(int));
    for (int r = 0; r < n; r++) {
        int j = 0;
        while (j < r && strncmp(recs[j].host, recs[r].host, sizeof recs[r].host) != 0) j++;
        same[r] = j;
        m->shm_ok[r] = recs[r].backend == DSK_COMM_HOST && recs[r].transport == DSK_COMM_TRANSPORT_AUTO;
    }
    dsk__comm_set_nodes(c, same);
    DSK_FREE(same);
    if (m->nic) m->nic->off_node = c->n_nodes > 1;
    if (!m->small_bytes) { /* one round for larger messages when TCP latency dominates */
        int all_shm = c->n_nodes == 1;
        for (int r = 0; r < n; r++) all_shm &= m->shm_ok[r];
        m->small_bytes = all_shm ? 16384 : 65536;
    }
    return DSK_OK;
}

static dsk_status dsk__comm_init_world(dsk_comm *c, const char *fn, int rank, int world, const dsk_comm_opts *o,
                                       const char *busy) {
    dsk__comm_impl *m;
    const char *addr = o && o->master_addr
                           ? o->master_addr
                           : (getenv("MASTER_ADDR") && *getenv("MASTER_ADDR") ? getenv("MASTER_ADDR") : "127.0.0.1");
    int port = o && o->master_port ? o->master_port : 29500;
    double t0 = dsk__comm_now(), deadline;
    struct sockaddr_in store_sa;
    char key[160];
    dsk__comm_rank_rec mine, *recs = NULL;
    int lfd = -1;
    size_t len = 0;
    dsk_status st;
    dsk_comm_backend be = o ? o->backend : DSK_COMM_AUTO;

    if (!o || !o->master_port) {
        const char *p = getenv("MASTER_PORT");
        if (p && *p) port = atoi(p);
    }
    if (port <= 0 || port > 65535) return dsk_set_error(DSK_ERR_ARG, "%s: master port %d not in [1, 65535]", fn, port);
#ifndef DSK_CUDA
    if (be == DSK_COMM_NCCL)
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: the nccl backend needs a build with DSK_CUDA", fn);
#endif
    if (be != DSK_COMM_AUTO && be != DSK_COMM_HOST && be != DSK_COMM_NCCL)
        return dsk_set_error(DSK_ERR_ARG, "%s: unknown backend %d", fn, (int)be);
    DSK__TRY(dsk__comm_resolve(fn, addr, port, &store_sa));
    c->rank = rank;
    c->world_size = world;
    c->local_world_size = o && o->local_world_size > 0 ? o->local_world_size : world;
    c->local_rank = o && o->local_world_size > 0 ? o->local_rank : rank;
    c->backend = be;
    DSK__TRY(dsk__comm_impl_alloc(c, fn, o, addr, port));
    DSK__TRY(dsk__comm_link_setup(c, fn, o));
    m = c->impl;
    snprintf(m->ns, sizeof m->ns, "w");
    deadline = t0 + m->timeout_s;
    if (rank == 0 && (st = dsk__comm_store_server_start(fn, &store_sa, busy, &m->server)) != DSK_OK)
        return dsk__comm_second_zero(c, fn, &store_sa, st);
    DSK__TRY(dsk__comm_join(c, fn, &store_sa, deadline));
    if (rank == 0) {
        uint64_t tag = ((uint64_t)getpid() << 32) ^ (uint64_t)(t0 * 1e9);
        DSK__TRY(dsk__comm_store_set(c, fn, "dsk/w/tag", &tag, sizeof tag));
    }
    DSK__TRY(dsk__comm_store_get(c, fn, "dsk/w/tag", &m->tag, sizeof m->tag, &len));
    /* every rank publishes its record, reads everyone's and checks the options; host: connect every pair */
    memset(&mine, 0, sizeof mine);
    mine.backend = (int32_t)be;
    mine.small_bytes = m->small_bytes;
    mine.piece_bytes = m->piece_bytes;
    mine.transport = (int32_t)(o ? o->transport : DSK_COMM_TRANSPORT_AUTO);
    dsk__comm_host_identity(o ? o->host_id : NULL, mine.host, sizeof mine.host);
    c->cuda_device = -1;
    if (be != DSK_COMM_HOST) dsk__comm_gpu_identity(c, mine.gpu, (int)sizeof mine.gpu);
    if (be != DSK_COMM_NCCL) DSK__TRY(dsk__comm_mesh_listen(c, fn, &lfd, mine.ep));
    snprintf(key, sizeof key, "dsk/w/rank/%d", rank);
    if ((st = dsk__comm_store_set(c, fn, key, &mine, sizeof mine)) != DSK_OK) goto done;
    if (!(recs = (dsk__comm_rank_rec *)DSK_MALLOC((size_t)world * sizeof *recs))) {
        st = dsk_set_error(DSK_ERR_OOM, "%s: %d rank records", fn, world);
        goto done;
    }
    for (int r = 0; r < world && st == DSK_OK; r++) {
        snprintf(key, sizeof key, "dsk/w/rank/%d", r);
        st = dsk__comm_store_get(c, fn, key, &recs[r], sizeof recs[r], &len);
        if (st == DSK_ERR_TIMEOUT)
            dsk_set_error(st,
                          "%s: timed out after %.2f s waiting for rank %d of %d to join (was it started, with the same "
                          "MASTER_ADDR:MASTER_PORT?)",
                          fn, dsk__comm_now() - t0, r, world);
        else if (st == DSK_OK && len != sizeof mine)
            st = dsk_set_error(DSK_ERR_CORRUPT, "%s: rank %d published a record of %zu bytes, want %zu", fn, r, len,
                               sizeof mine);
        else if (st == DSK_OK)
            st = dsk__comm_same_options(c, fn, &mine, &recs[r], r);
    }
    if (st == DSK_OK) st = dsk__comm_resolve_backend(c, fn, recs, &be);
    c->backend = be;
    if (be != DSK_COMM_NCCL) c->cuda_device = -1;
    if (st == DSK_OK) st = dsk__comm_world_nodes(c, fn, recs);
#ifdef DSK_CUDA
    if (st == DSK_OK && be == DSK_COMM_NCCL) st = dsk__comm_nccl_init(c, fn, t0);
#endif
    if (st == DSK_OK && be == DSK_COMM_HOST) st = dsk__comm_mesh_connect(c, fn, lfd, recs->ep, sizeof *recs, deadline);
    if (st == DSK_OK && be == DSK_COMM_HOST) st = dsk__comm_shm_setup(c, fn);
done:
    if (lfd >= 0) close(lfd);
    DSK_FREE(recs);
    return st;
}

/* dsk_comm_init; `busy` (NULL: the usual) says what to do when rank 0's store port is taken. */
static dsk_status dsk__comm_init(dsk_comm *c, int rank, int world_size, const dsk_comm_opts *opts, const char *busy) {
    const char *fn = "dsk_comm_init";
    dsk_status st;
    if (!c) return dsk_set_error(DSK_ERR_ARG, "%s: communicator is NULL", fn);
    memset(c, 0, sizeof *c);
    if (world_size < 1 || rank < 0 || rank >= world_size)
        return dsk_set_error(DSK_ERR_ARG, "%s: rank %d is not in [0, world_size %d)", fn, rank, world_size);
    if (opts && opts->local_world_size > 0 && (opts->local_rank < 0 || opts->local_rank >= opts->local_world_size))
        return dsk_set_error(DSK_ERR_ARG, "%s: local_rank %d is not in [0, local_world_size %d)", fn, opts->local_rank,
                             opts->local_world_size);
    if (opts && (opts->timeout_s < 0 || opts->timeout_s != opts->timeout_s))
        return dsk_set_error(DSK_ERR_ARG, "%s: timeout_s %g is negative or NaN", fn, opts->timeout_s);
    if (opts && opts->job_id && strlen(opts->job_id) > DSK__COMM_JOB_MAX)
        return dsk_set_error(DSK_ERR_ARG, "%s: job_id of %zu characters exceeds %d", fn, strlen(opts->job_id),
                             DSK__COMM_JOB_MAX);
    if (opts && opts->host_id && strlen(opts->host_id) > DSK__COMM_HOST_MAX)
        return dsk_set_error(DSK_ERR_ARG, "%s: host_id of %zu characters exceeds %d", fn, strlen(opts->host_id),
                             DSK__COMM_HOST_MAX);
    if (opts && opts->transport != DSK_COMM_TRANSPORT_AUTO && opts->transport != DSK_COMM_TRANSPORT_TCP)
        return dsk_set_error(DSK_ERR_ARG, "%s: unknown transport %d", fn, (int)opts->transport);
    st = dsk__comm_init_world(c, fn, rank, world_size, opts, busy);
    if (st != DSK_OK) {
        dsk__comm_impl_free(c);
        memset(c, 0, sizeof *c);
    }
    return st;
}

DSK_API dsk_status dsk_comm_init(dsk_comm *c, int rank, int world_size, const dsk_comm_opts *opts) {
    return dsk__comm_init(c, rank, world_size, opts, NULL);
}

/* The job identity the launcher of variable set `set` (0 torchrun, 1 Open MPI, 2 Slurm) gives
   every rank of one job alike, as "NAME=value" so a mismatch message says where it came from;
   DSK_JOB_ID (set by dsk_comm_spawn_local) comes first. "" when there is none. */
static void dsk__comm_env_job_id(int set, char *buf, size_t cap) {
    static const char *names[3][2] = {{"TORCHELASTIC_RUN_ID", NULL},
                                      {"PMIX_NAMESPACE", "OMPI_MCA_orte_hnp_uri"},
                                      {"SLURM_JOB_ID", NULL}};
    const char *v = getenv("DSK_JOB_ID"), *step = getenv("SLURM_STEP_ID");
    buf[0] = 0;
    if (v && *v) {
        snprintf(buf, cap, "DSK_JOB_ID=%.*s", DSK__COMM_JOB_MAX - 11, v);
        return;
    }
    for (int i = 0; i < 2 && names[set][i]; i++) {
        v = getenv(names[set][i]);
        if (!v || !*v) continue;
        if (set == 2 && step && *step) snprintf(buf, cap, "%s=%.160s.%.16s", names[set][i], v, step);
        else snprintf(buf, cap, "%s=%.*s", names[set][i], DSK__COMM_JOB_MAX - 32, v);
        return;
    }
}

DSK_API dsk_status dsk_comm_init_env(dsk_comm *c, const dsk_comm_opts *opts) {
    const char *fn = "dsk_comm_init_env";
    static const char *sets[3][4] = { { "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE" },
                                      { "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                                        "OMPI_COMM_WORLD_LOCAL_SIZE" },
                                      { "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE" } };
    int v[4] = {0, 0, 0, 0}, have[4] = {0, 0, 0, 0}, port = 0, s;
    char why[256], job[DSK__COMM_JOB_MAX + 4], busy[256] = "";
    const char *pname = "MASTER_PORT", *addr = getenv("MASTER_ADDR"), *pstr = getenv("DSK_MASTER_PORT"),
               *agent = getenv("TORCHELASTIC_USE_AGENT_STORE");
    int agent_store = !(pstr && *pstr) && agent && (!strcmp(agent, "True") || !strcmp(agent, "1"));
    dsk_comm_opts o;
    if (!c) return dsk_set_error(DSK_ERR_ARG, "%s: communicator is NULL", fn);
    memset(c, 0, sizeof *c);
    for (s = 0; s < 3; s++)
        if (getenv(sets[s][0]) || getenv(sets[s][1])) break;
    if (s == 3)
        return dsk_set_error(DSK_ERR_ARG,
                             "%s: no launcher environment: set RANK and WORLD_SIZE (as torchrun does), or start "
                             "under srun or mpirun",
                             fn);
    for (int i = 0; i < 4; i++) {
        if (s == 2 && i == 3) {
            /* SLURM_NTASKS_PER_NODE looks like "4" or "4(x2)" */
            const char *t = getenv(sets[s][i]);
            if (t && *t && atoi(t) > 0) { v[i] = atoi(t); have[i] = 1; }
            continue;
        }
        if (!dsk__comm_env_int(sets[s][i], &v[i], &have[i], why, sizeof why))
            return dsk_set_error(DSK_ERR_ARG, "%s: %s", fn, why);
    }
    if (!have[0] || !have[1])
        return dsk_set_error(DSK_ERR_ARG, "%s: %s is set but %s is not", fn, have[0] ? sets[s][0] : sets[s][1],
                             have[0] ? sets[s][1] : sets[s][0]);
    if (v[1] < 1 || v[0] >= v[1])
        return dsk_set_error(DSK_ERR_ARG, "%s: %s=%d is not below %s=%d", fn, sets[s][0], v[0], sets[s][1], v[1]);
    if (opts) o = *opts;
    else memset(&o, 0, sizeof o);
    if (!o.job_id) {
        dsk__comm_env_job_id(s, job, sizeof job);
        o.job_id = job;
    }
    if (addr && *addr) o.master_addr = addr;
    if (!o.master_addr) {
        /* every rank on this host (the launcher says so): loopback will do */
        if (v[1] > 1 && !(have[3] && v[3] == v[1]))
            return dsk_set_error(DSK_ERR_ARG,
                                 "%s: MASTER_ADDR is not set: export the address of rank 0's host (rank %d of %d)", fn,
                                 v[0], v[1]);
        o.master_addr = "127.0.0.1";
    }
    if (pstr && *pstr) pname = "DSK_MASTER_PORT";
    else pstr = getenv("MASTER_PORT");
    if (pstr && *pstr) {
        char *end;
        long p = strtol(pstr, &end, 10);
        if (*end || p < 1 || p + agent_store > 65535)
            return dsk_set_error(DSK_ERR_ARG, "%s: %s=\"%s\" is not a port number", fn, pname, pstr);
        /* torchrun's agent already serves its own store on MASTER_PORT: ours takes the next port */
        port = (int)p + agent_store;
        if (agent_store)
            snprintf(busy, sizeof busy,
                     "under torchrun dsk's store takes MASTER_PORT+1 = %d (torchrun's agent serves "
                     "its own store on MASTER_PORT=%ld); free port %d or set DSK_MASTER_PORT to a free port",
                     port, p, port);
        else
            snprintf(busy, sizeof busy, "pick another %s", pname);
    }
    if (port) o.master_port = port;
    if (have[3] && v[3] > 0) {
        o.local_world_size = v[3];
        o.local_rank = have[2] ? v[2] : v[0] % v[3];
        if (o.local_rank >= o.local_world_size)
            return dsk_set_error(DSK_ERR_ARG, "%s: %s=%d is not below %s=%d", fn, sets[s][2], o.local_rank, sets[s][3],
                                 v[3]);
    } else {
        o.local_world_size = 0;
    }
    return dsk__comm_init(c, v[0], v[1], &o, busy[0] ? busy : NULL);
}

/* ---------------------------------------------------------------- collectives */

/* The emulated link (opts.link_gbps): a call that began at t0 ends no sooner than its bytes would
   have crossed the link, after those the rank's other calls gave it first. */
static void dsk__comm_link_wait(dsk_comm *c, double t0) {
    dsk__comm_impl *m = c->impl;
    uint64_t sent = dsk__comm_link_sent(c);
    double until, left;
    if ((m->link_bps <= 0 && m->link_s <= 0) || !dsk__comm_on_link(c)) {
        m->link_mark = sent;
        return;
    }
    until =
        m->link_s + dsk__comm_nic_take(m->nic, t0, m->link_bps > 0 ? (double)(sent - m->link_mark) / m->link_bps : 0);
    m->link_mark = sent;
    if ((left = until - dsk__comm_now()) > 0) dsk__comm_sleep_s(left);
}

/* Counts one finished call: its time and the sequence number the next call carries. */
static dsk_status dsk__comm_done(dsk_comm *c, dsk_status st, double t0) {
    if (st == DSK_OK && c->backend == DSK_COMM_HOST) dsk__comm_link_wait(c, t0);
    c->impl->seq++;
    c->stats.calls++;
    c->stats.seconds += dsk__comm_now() - t0;
    return st;
}

/* A call's buffers, count and dtype. */
static dsk_status dsk__comm_buf_check(const char *fn, const void *send, const void *recv, int64_t count, dsk_dtype dt) {
    if (!dsk__comm_dtype_ok(dt))
        return dsk_set_error(DSK_ERR_ARG, "%s: dtype %s is not supported (f32, f16, bf16, f64, i32, i64, u8)", fn,
                             dsk_dtype_name(dt));
    if (count < 0) return dsk_set_error(DSK_ERR_ARG, "%s: count %lld is negative", fn, (long long)count);
    if (count > 0 && (!send || !recv))
        return dsk_set_error(DSK_ERR_ARG, "%s: NULL buffer for %lld elements", fn, (long long)count);
    return DSK_OK;
}

static dsk_status dsk__comm_coll_check(dsk_comm *c, const char *fn, const void *send, const void *recv, int64_t count,
                                       dsk_dtype dt) {
    DSK__TRY(dsk__comm_check(c, fn));
    return dsk__comm_buf_check(fn, send, recv, count, dt);
}

static dsk_status dsk__comm_op_check(const char *fn, dsk_comm_op op) {
    if ((int)op < 0 || (int)op > (int)DSK_COMM_MIN)
        return dsk_set_error(DSK_ERR_ARG, "%s: unknown reduction op %d", fn, (int)op);
    return DSK_OK;
}

static dsk_status dsk__comm_root_check(const dsk_comm *c, const char *fn, int root) {
    if (root < 0 || root >= c->world_size)
        return dsk_set_error(DSK_ERR_ARG, "%s: root %d is not in [0, world_size %d)", fn, root, c->world_size);
    return DSK_OK;
}

#ifdef DSK_CUDA
static ncclDataType_t dsk__comm_nccl_dtype(dsk_dtype dt) {
    switch (dt) {
    case DSK_F16: return ncclFloat16;
    case DSK_BF16: return ncclBfloat16;
    case DSK_F64: return ncclFloat64;
    case DSK_I32: return ncclInt32;
    case DSK_I64: return ncclInt64;
    case DSK_U8: return ncclUint8;
    default: return ncclFloat32;
    }
}
static ncclRedOp_t dsk__comm_nccl_op(dsk_comm_op op) {
    return op == DSK_COMM_AVG ? ncclAvg : op == DSK_COMM_MAX ? ncclMax : op == DSK_COMM_MIN ? ncclMin : ncclSum;
}
static cudaStream_t dsk__comm_stream(dsk_ctx *ctx) { return ctx ? (cudaStream_t)ctx->stream : (cudaStream_t)0; }

/* Checks an enqueue call's result, then waits for the nonblocking communicator to settle. */
static dsk_status dsk__comm_nccl_done(dsk_comm *c, const char *fn, ncclResult_t r, const char *what, double t0) {
    dsk_status st = dsk__comm_nccl_check(c, fn, r, what);
    if (st) return dsk__comm_break(c, st);
    return dsk__comm_nccl_settle(c, fn, c->impl->nccl, t0, what);
}
#define DSK__COMM_NCCL(c) ((c)->backend == DSK_COMM_NCCL)
#else
#define DSK__COMM_NCCL(c) 0
#endif

static dsk_status dsk__comm_all_reduce_call(dsk_comm *c, dsk_ctx *ctx, const void *send, void *recv, int64_t count,
                                            dsk_dtype dt, dsk_comm_op op) {
    const char *fn = "dsk_comm_all_reduce";
    double t0 = dsk__comm_now();
    DSK__TRY(dsk__comm_coll_check(c, fn, send, recv, count, dt));
    DSK__TRY(dsk__comm_op_check(fn, op));
    (void)ctx;
#ifdef DSK_CUDA
    if (DSK__COMM_NCCL(c)) {
        if (op == DSK_COMM_AVG && !dsk_dtype_is_float(dt))
            return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: avg of %s on the nccl backend", fn, dsk_dtype_name(dt));
        return dsk__comm_done(
            c,
            dsk__comm_nccl_done(c, fn,
                                ncclAllReduce(send, recv, (size_t)count, dsk__comm_nccl_dtype(dt),
                                              dsk__comm_nccl_op(op), c->impl->nccl, dsk__comm_stream(ctx)),
                                "ncclAllReduce", t0),
            t0);
    }
#endif
    if (c->world_size == 1) {
        if (send != recv && count) memmove(recv, send, (size_t)count * dsk_dtype_size(dt));
        return dsk__comm_done(c, DSK_OK, t0);
    }
    return dsk__comm_done(c, dsk__comm_host_all_reduce(c, fn, (const char *)send, (char *)recv, count, dt, op, t0), t0);
}

DSK_API dsk_status dsk_comm_all_reduce(dsk_comm *c, dsk_ctx *ctx, const void *send, void *recv, int64_t count,
                                       dsk_dtype dt, dsk_comm_op op) {
    dsk_status st = dsk__comm_all_reduce_call(c, ctx, send, recv, count, dt, op);
    if (st == DSK_OK) c->stats.all_reduce_payload += (uint64_t)count * dsk_dtype_size(dt);
    return st;
}

static dsk_status dsk__comm_reduce_scatter_call(dsk_comm *c, dsk_ctx *ctx, const void *send, void *recv,
                                                int64_t recv_count, dsk_dtype dt, dsk_comm_op op) {
    const char *fn = "dsk_comm_reduce_scatter";
    double t0 = dsk__comm_now();
    DSK__TRY(dsk__comm_coll_check(c, fn, send, recv, recv_count, dt));
    DSK__TRY(dsk__comm_op_check(fn, op));
    (void)ctx;
#ifdef DSK_CUDA
    if (DSK__COMM_NCCL(c)) {
        if (op == DSK_COMM_AVG && !dsk_dtype_is_float(dt))
            return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: avg of %s on the nccl backend", fn, dsk_dtype_name(dt));
        return dsk__comm_done(
            c,
            dsk__comm_nccl_done(c, fn,
                                ncclReduceScatter(send, recv, (size_t)recv_count, dsk__comm_nccl_dtype(dt),
                                                  dsk__comm_nccl_op(op), c->impl->nccl, dsk__comm_stream(ctx)),
                                "ncclReduceScatter", t0),
            t0);
    }
#endif
    if (c->world_size == 1) {
        if (send != recv && recv_count) memmove(recv, send, (size_t)recv_count * dsk_dtype_size(dt));
        return dsk__comm_done(c, DSK_OK, t0);
    }
    return dsk__comm_done(
        c, dsk__comm_host_reduce_scatter(c, fn, (const char *)send, (char *)recv, recv_count, dt, op, t0), t0);
}

DSK_API dsk_status dsk_comm_reduce_scatter(dsk_comm *c, dsk_ctx *ctx, const void *send, void *recv, int64_t recv_count,
                                           dsk_dtype dt, dsk_comm_op op) {
    dsk_status st = dsk__comm_reduce_scatter_call(c, ctx, send, recv, recv_count, dt, op);
    if (st == DSK_OK) c->stats.reduce_scatter_payload += (uint64_t)(recv_count * c->world_size) * dsk_dtype_size(dt);
    return st;
}

static dsk_status dsk__comm_all_gather_call(dsk_comm *c, dsk_ctx *ctx, const void *send, void *recv, int64_t send_count,
                                            dsk_dtype dt) {
    const char *fn = "dsk_comm_all_gather";
    double t0 = dsk__comm_now();
    DSK__TRY(dsk__comm_coll_check(c, fn, send, recv, send_count, dt));
    (void)ctx;
#ifdef DSK_CUDA
    if (DSK__COMM_NCCL(c))
        return dsk__comm_done(
            c,
            dsk__comm_nccl_done(c, fn,
                                ncclAllGather(send, recv, (size_t)send_count, dsk__comm_nccl_dtype(dt), c->impl->nccl,
                                              dsk__comm_stream(ctx)),
                                "ncclAllGather", t0),
            t0);
#endif
    return dsk__comm_done(c, dsk__comm_host_all_gather(c, fn, (const char *)send, (char *)recv, send_count, dt, t0),
                          t0);
}

DSK_API dsk_status dsk_comm_all_gather(dsk_comm *c, dsk_ctx *ctx, const void *send, void *recv, int64_t send_count,
                                       dsk_dtype dt) {
    dsk_status st = dsk__comm_all_gather_call(c, ctx, send, recv, send_count, dt);
    if (st == DSK_OK) c->stats.all_gather_payload += (uint64_t)(send_count * c->world_size) * dsk_dtype_size(dt);
    return st;
}

DSK_API dsk_status dsk_comm_broadcast(dsk_comm *c, dsk_ctx *ctx, const void *send, void *recv, int64_t count,
                                      dsk_dtype dt, int root) {
    const char *fn = "dsk_comm_broadcast";
    double t0 = dsk__comm_now();
    DSK__TRY(dsk__comm_coll_check(c, fn, c && c->impl && c->rank == root ? send : recv, recv, count, dt));
    DSK__TRY(dsk__comm_root_check(c, fn, root));
    (void)ctx;
#ifdef DSK_CUDA
    if (DSK__COMM_NCCL(c))
        return dsk__comm_done(c,
                              dsk__comm_nccl_done(c, fn,
                                                  ncclBroadcast(send, recv, (size_t)count, dsk__comm_nccl_dtype(dt),
                                                                root, c->impl->nccl, dsk__comm_stream(ctx)),
                                                  "ncclBroadcast", t0),
                              t0);
#endif
    return dsk__comm_done(c, dsk__comm_host_broadcast(c, fn, (const char *)send, (char *)recv, count, dt, root, t0),
                          t0);
}

DSK_API dsk_status dsk_comm_reduce(dsk_comm *c, dsk_ctx *ctx, const void *send, void *recv, int64_t count, dsk_dtype dt,
                                   dsk_comm_op op, int root) {
    const char *fn = "dsk_comm_reduce";
    double t0 = dsk__comm_now();
    int at_root = c && c->impl && c->rank == root;
    DSK__TRY(dsk__comm_coll_check(c, fn, send, at_root ? recv : send, count, dt));
    DSK__TRY(dsk__comm_op_check(fn, op));
    DSK__TRY(dsk__comm_root_check(c, fn, root));
    (void)ctx;
#ifdef DSK_CUDA
    if (DSK__COMM_NCCL(c)) {
        if (op == DSK_COMM_AVG && !dsk_dtype_is_float(dt))
            return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: avg of %s on the nccl backend", fn, dsk_dtype_name(dt));
        return dsk__comm_done(
            c,
            dsk__comm_nccl_done(c, fn,
                                ncclReduce(send, recv, (size_t)count, dsk__comm_nccl_dtype(dt), dsk__comm_nccl_op(op),
                                           root, c->impl->nccl, dsk__comm_stream(ctx)),
                                "ncclReduce", t0),
            t0);
    }
#endif
    if (c->world_size == 1) {
        if (send != recv && count) memmove(recv, send, (size_t)count * dsk_dtype_size(dt));
        return dsk__comm_done(c, DSK_OK, t0);
    }
    return dsk__comm_done(c, dsk__comm_host_reduce(c, fn, (const char *)send, (char *)recv, count, dt, op, root, t0),
                          t0);
}

#ifdef DSK_CUDA
/* Gather (to_root) or scatter on NCCL: one group of sends and receives between the root and
   every rank, the root's own block included unless it is already in place. */
static dsk_status dsk__comm_nccl_rooted(dsk_comm *c, const char *fn, int to_root, const char *send, char *recv,
                                        int64_t count, dsk_dtype dt, int root, dsk_ctx *ctx, double t0) {
    size_t blk = (size_t)count * dsk_dtype_size(dt);
    ncclDataType_t nt = dsk__comm_nccl_dtype(dt);
    ncclComm_t comm = c->impl->nccl;
    cudaStream_t stream = dsk__comm_stream(ctx);
    int me = c->rank, in_place = to_root ? send == recv + (size_t)root * blk : recv == send + (size_t)root * blk;
    ncclResult_t r = ncclGroupStart();
    dsk_status st;
    if ((st = dsk__comm_nccl_check(c, fn, r, "ncclGroupStart")) != DSK_OK) return dsk__comm_break(c, st);
    for (int p = 0; p < c->world_size && r == ncclSuccess && count; p++) {
        if (me != root && p != root) continue;
        if (me == root && p == root && in_place) continue;
        if (to_root) {
            if (p == root) r = ncclSend(send, (size_t)count, nt, root, comm, stream);
            if (r == ncclSuccess && me == root)
                r = ncclRecv(recv + (size_t)p * blk, (size_t)count, nt, p, comm, stream);
        } else {
            if (me == root) r = ncclSend(send + (size_t)p * blk, (size_t)count, nt, p, comm, stream);
            if (r == ncclSuccess && p == root) r = ncclRecv(recv, (size_t)count, nt, root, comm, stream);
        }
    }
    if (r != ncclSuccess) {
        st = dsk__comm_nccl_check(c, fn, r, "ncclSend/ncclRecv");
        ncclGroupEnd();
        return dsk__comm_break(c, st);
    }
    return dsk__comm_nccl_done(c, fn, ncclGroupEnd(), to_root ? "ncclGroupEnd (gather)" : "ncclGroupEnd (scatter)", t0);
}
#endif

DSK_API dsk_status dsk_comm_gather(dsk_comm *c, dsk_ctx *ctx, const void *send, void *recv, int64_t send_count,
                                   dsk_dtype dt, int root) {
    const char *fn = "dsk_comm_gather";
    double t0 = dsk__comm_now();
    int at_root = c && c->impl && c->rank == root;
    DSK__TRY(dsk__comm_coll_check(c, fn, send, at_root ? recv : send, send_count, dt));
    DSK__TRY(dsk__comm_root_check(c, fn, root));
    (void)ctx;
#ifdef DSK_CUDA
    if (DSK__COMM_NCCL(c))
        return dsk__comm_done(c, dsk__comm_nccl_rooted(c, fn, 1, (const char *)send, (char *)recv, send_count, dt, root,
                                                       ctx, t0), t0);
#endif
    return dsk__comm_done(c, dsk__comm_host_gather(c, fn, (const char *)send, (char *)recv, send_count, dt, root, t0),
                          t0);
}

DSK_API dsk_status dsk_comm_scatter(dsk_comm *c, dsk_ctx *ctx, const void *send, void *recv, int64_t recv_count,
                                    dsk_dtype dt, int root) {
    const char *fn = "dsk_comm_scatter";
    double t0 = dsk__comm_now();
    int at_root = c && c->impl && c->rank == root;
    DSK__TRY(dsk__comm_coll_check(c, fn, at_root ? send : recv, recv, recv_count, dt));
    DSK__TRY(dsk__comm_root_check(c, fn, root));
    (void)ctx;
#ifdef DSK_CUDA
    if (DSK__COMM_NCCL(c))
        return dsk__comm_done(c, dsk__comm_nccl_rooted(c, fn, 0, (const char *)send, (char *)recv, recv_count, dt, root,
                                                       ctx, t0), t0);
#endif
    return dsk__comm_done(c, dsk__comm_host_scatter(c, fn, (const char *)send, (char *)recv, recv_count, dt, root, t0),
                          t0);
}

#ifdef DSK_CUDA
/* All-to-all(-v) on NCCL: one group of sends and receives. */
static dsk_status dsk__comm_nccl_a2a(dsk_comm *c, const char *fn, const char *send, const int64_t *sc,
                                     const int64_t *sd, char *recv, const int64_t *rc, const int64_t *rd, dsk_dtype dt,
                                     dsk_ctx *ctx, double t0) {
    size_t esz = dsk_dtype_size(dt);
    ncclDataType_t nt = dsk__comm_nccl_dtype(dt);
    ncclResult_t r = ncclGroupStart();
    dsk_status st;
    if ((st = dsk__comm_nccl_check(c, fn, r, "ncclGroupStart")) != DSK_OK) return dsk__comm_break(c, st);
    for (int p = 0; p < c->world_size && r == ncclSuccess; p++) {
        if (sc[p])
            r = ncclSend(send + sd[p] * (int64_t)esz, (size_t)sc[p], nt, p, c->impl->nccl, dsk__comm_stream(ctx));
        if (r == ncclSuccess && rc[p])
            r = ncclRecv(recv + rd[p] * (int64_t)esz, (size_t)rc[p], nt, p, c->impl->nccl, dsk__comm_stream(ctx));
    }
    if (r != ncclSuccess) {
        st = dsk__comm_nccl_check(c, fn, r, "ncclSend/ncclRecv");
        ncclGroupEnd();
        return dsk__comm_break(c, st);
    }
    return dsk__comm_nccl_done(c, fn, ncclGroupEnd(), "ncclGroupEnd (all-to-all)", t0);
}
#endif

/* Packed displacements when none are given: exclusive prefix sums. */
static void dsk__comm_prefix(const int64_t *counts, int n, int64_t *displs) {
    int64_t s = 0;
    for (int p = 0; p < n; p++) { displs[p] = s; s += counts[p]; }
}

DSK_API dsk_status dsk_comm_all_to_all(dsk_comm *c, dsk_ctx *ctx, const void *send, void *recv, int64_t count,
                                       dsk_dtype dt) {
    const char *fn = "dsk_comm_all_to_all";
    double t0 = dsk__comm_now();
    dsk_status st = DSK_OK;
    int64_t *v;
    int n;
    DSK__TRY(dsk__comm_coll_check(c, fn, send, recv, count, dt));
    n = c->world_size;
    if (!(v = (int64_t *)DSK_MALLOC((size_t)2 * n * sizeof(int64_t))))
        return dsk_set_error(DSK_ERR_OOM, "%s: %d counts", fn, n);
    for (int p = 0; p < n; p++) { v[p] = count; v[n + p] = count * p; }
#ifdef DSK_CUDA
    if (DSK__COMM_NCCL(c)) {
        if (send == recv && count) st = dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: in place on the nccl backend", fn);
        else st = dsk__comm_nccl_a2a(c, fn, (const char *)send, v, v + n, (char *)recv, v, v + n, dt, ctx, t0);
        DSK_FREE(v);
        return dsk__comm_done(c, st, t0);
    }
#endif
    (void)ctx;
    if (send == recv && count) {
        size_t bytes = (size_t)count * (size_t)n * dsk_dtype_size(dt);
        /* the host all-to-all uses no scratch, so the copy can live there */
        void *tmp = dsk__comm_scratch(c->impl, bytes);
        if (!tmp) st = dsk_set_error(DSK_ERR_OOM, "%s: %zu bytes for the in-place copy", fn, bytes);
        else {
            memcpy(tmp, send, bytes);
            send = tmp;
        }
    }
    if (st == DSK_OK)
        st = dsk__comm_host_a2a(c, fn, DSK__COMM_ALL_TO_ALL, (const char *)send, v, v + n, (char *)recv, v, v + n, dt,
                                t0, NULL, NULL, NULL);
    DSK_FREE(v);
    return dsk__comm_done(c, st, t0);
}

static dsk_status dsk__comm_a2a_v(dsk_comm *c, dsk_ctx *ctx, const char *fn, const void *send,
                                  const int64_t *send_counts, const int64_t *send_displs, void *recv,
                                  const int64_t *recv_counts, const int64_t *recv_displs, dsk_dtype dt,
                                  dsk_comm_arrived_fn arrived, dsk_comm_ready_fn ready, void *arg, int start,
                                  size_t *unsent) {
    double t0 = dsk__comm_now();
    dsk_status st;
    int64_t *d;
    int n, me;
    DSK__TRY(dsk__comm_coll_check(c, fn, "", "", 0, dt));
    n = c->world_size;
    me = c->rank;
    if (!send_counts || !recv_counts) return dsk_set_error(DSK_ERR_ARG, "%s: send_counts or recv_counts is NULL", fn);
    for (int p = 0; p < n; p++) {
        if (send_counts[p] < 0 || recv_counts[p] < 0 || (send_displs && send_displs[p] < 0) ||
            (recv_displs && recv_displs[p] < 0))
            return dsk_set_error(
                DSK_ERR_ARG, "%s: negative count or displacement for rank %d (send %lld at %lld, recv %lld at %lld)",
                fn, p, (long long)send_counts[p], (long long)(send_displs ? send_displs[p] : 0),
                (long long)recv_counts[p], (long long)(recv_displs ? recv_displs[p] : 0));
        if ((send_counts[p] && !send) || (recv_counts[p] && !recv))
            return dsk_set_error(DSK_ERR_ARG, "%s: NULL buffer with a nonzero count for rank %d", fn, p);
    }
    if (send_counts[me] != recv_counts[me])
        return dsk_set_error(DSK_ERR_ARG, "%s: rank %d sends itself %lld elements but expects %lld", fn, me,
                             (long long)send_counts[me], (long long)recv_counts[me]);
    if (send && send == recv)
        return dsk_set_error(DSK_ERR_ARG, "%s: send and recv are the same buffer (not supported in place)", fn);
    if (!(d = (int64_t *)DSK_MALLOC((size_t)2 * n * sizeof(int64_t))))
        return dsk_set_error(DSK_ERR_OOM, "%s: %d displacements", fn, n);
    if (send_displs) memcpy(d, send_displs, (size_t)n * sizeof *d);
    else dsk__comm_prefix(send_counts, n, d);
    if (recv_displs) memcpy(d + n, recv_displs, (size_t)n * sizeof *d);
    else dsk__comm_prefix(recv_counts, n, d + n);
    (void)ctx;
#ifdef DSK_CUDA
    if (DSK__COMM_NCCL(c)) {
        st = DSK_OK;
        for (int p = 0; p < n && st == DSK_OK && ready; p++) st = dsk__comm_await_gate(c, fn, ready, arg, p, t0);
        if (st == DSK_OK)
            st = dsk__comm_nccl_a2a(c, fn, (const char *)send, send_counts, d, (char *)recv, recv_counts, d + n, dt,
                                    ctx, t0);
        for (int p = 0; p < n && st == DSK_OK && arrived; p++) arrived(arg, p); /* stream-ordered */
    } else
#endif
        st = start ? dsk__comm_host_a2a_start(c, fn, (const char *)send, send_counts, d, (char *)recv, recv_counts,
                                              d + n, dt, unsent)
                   : dsk__comm_host_a2a(c, fn, DSK__COMM_ALL_TO_ALL_V, (const char *)send, send_counts, d, (char *)recv,
                                        recv_counts, d + n, dt, t0, arrived, ready, arg);
    DSK_FREE(d);
    if (start && st == DSK_OK) { /* the call ends in dsk_comm_finish */
        c->impl->started = 1;
        c->impl->started_t0 = t0;
        c->impl->started_s = dsk__comm_now() - t0;
        return DSK_OK;
    }
    return dsk__comm_done(c, st, t0);
}

DSK_API dsk_status dsk_comm_all_to_all_v(dsk_comm *c, dsk_ctx *ctx, const void *send, const int64_t *send_counts,
                                         const int64_t *send_displs, void *recv, const int64_t *recv_counts,
                                         const int64_t *recv_displs, dsk_dtype dt) {
    return dsk__comm_a2a_v(c, ctx, "dsk_comm_all_to_all_v", send, send_counts, send_displs, recv, recv_counts,
                           recv_displs, dt, NULL, NULL, NULL, 0, NULL);
}

DSK_API dsk_status dsk_comm_all_to_all_v_start(dsk_comm *c, dsk_ctx *ctx, const void *send, const int64_t *send_counts,
                                               const int64_t *send_displs, void *recv, const int64_t *recv_counts,
                                               const int64_t *recv_displs, dsk_dtype dt, size_t *unsent) {
    if (unsent) *unsent = 0;
    return dsk__comm_a2a_v(c, ctx, "dsk_comm_all_to_all_v_start", send, send_counts, send_displs, recv, recv_counts,
                           recv_displs, dt, NULL, NULL, NULL, 1, unsent);
}

/* Whether c has an exchange begun by dsk_comm_all_to_all_v_start (dsk_comm_finish, dsk_comm_progress). */
static dsk_status dsk__comm_begun(const dsk_comm *c, const char *fn) {
    DSK__TRY(dsk__comm_usable(c, fn));
    if (!c->impl->started)
        return dsk_set_error(DSK_ERR_STATE, "%s: rank %d has no exchange begun by dsk_comm_all_to_all_v_start", fn,
                             c->rank);
    return DSK_OK;
}

DSK_API dsk_status dsk_comm_finish(dsk_comm *c, dsk_ctx *ctx) {
    const char *fn = "dsk_comm_finish";
    dsk__comm_impl *m;
    double t0 = dsk__comm_now();
    dsk_status st = DSK_OK;
    (void)ctx;
    DSK__TRY(dsk__comm_begun(c, fn));
    m = c->impl;
    if (c->backend == DSK_COMM_HOST) {
        st = dsk__comm_io_run(c, fn, m->ops, m->started_n, t0, NULL);
        if (st == DSK_OK) dsk__comm_link_wait(c, m->started_t0);
    }
    m->started = 0; /* only now: the ops were in use until here */
    m->seq++;
    c->stats.calls++;
    c->stats.seconds += m->started_s + (dsk__comm_now() - t0);
    return st;
}

/* dsk_comm_progress's report: landed[p] for each rank (host: the receives reported landed, this rank's own). */
static void dsk__comm_landed(const dsk_comm *c, int *landed) {
    const dsk__comm_impl *m = c->impl;
    for (int p = 0; p < c->world_size; p++) landed[p] = c->backend != DSK_COMM_HOST || p == c->rank;
    for (int i = 0; c->backend == DSK_COMM_HOST && i < m->started_n; i++)
        if (!m->ops[i].is_send) landed[m->ops[i].peer] = m->ops[i].told;
}

DSK_API dsk_status dsk_comm_progress(dsk_comm *c, dsk_ctx *ctx, int wait, int *landed, size_t *unsent) {
    double t0 = dsk__comm_now();
    dsk_status st = DSK_OK;
    (void)ctx;
    if (unsent) *unsent = 0;
    DSK__TRY(dsk__comm_begun(c, "dsk_comm_progress"));
    if (c->backend == DSK_COMM_HOST) st = dsk__comm_host_progress(c, "dsk_comm_progress", wait, t0, unsent);
    if (landed) dsk__comm_landed(c, landed);
    c->impl->started_s += dsk__comm_now() - t0;
    return st;
}

DSK_API dsk_status dsk_comm_all_to_all_v_notify(dsk_comm *c, dsk_ctx *ctx, const void *send, const int64_t *send_counts,
                                                const int64_t *send_displs, void *recv, const int64_t *recv_counts,
                                                const int64_t *recv_displs, dsk_dtype dt, dsk_comm_arrived_fn arrived,
                                                void *arg) {
    return dsk__comm_a2a_v(c, ctx, "dsk_comm_all_to_all_v_notify", send, send_counts, send_displs, recv, recv_counts,
                           recv_displs, dt, arrived, NULL, arg, 0, NULL);
}

DSK_API dsk_status dsk_comm_all_to_all_v_gated(dsk_comm *c, dsk_ctx *ctx, const void *send, const int64_t *send_counts,
                                               const int64_t *send_displs, void *recv, const int64_t *recv_counts,
                                               const int64_t *recv_displs, dsk_dtype dt, dsk_comm_ready_fn ready,
                                               void *arg) {
    if (!ready) return dsk_set_error(DSK_ERR_ARG, "dsk_comm_all_to_all_v_gated: ready is NULL");
    return dsk__comm_a2a_v(c, ctx, "dsk_comm_all_to_all_v_gated", send, send_counts, send_displs, recv, recv_counts,
                           recv_displs, dt, NULL, ready, arg, 0, NULL);
}

/* ---------------------------------------------------------------- point to point */

/* A point to point request's arguments and state (begun requests are refused while an exchange is in flight). */
static dsk_status dsk__comm_p2p_check(dsk_comm *c, const char *fn, const void *buf, int64_t count, dsk_dtype dt,
                                      int peer) {
    DSK__TRY(dsk__comm_check_p2p(c, fn));
    DSK__TRY(dsk__comm_buf_check(fn, buf, buf, count, dt));
    if (peer < 0 || peer >= c->world_size || peer == c->rank)
        return dsk_set_error(DSK_ERR_ARG, "%s: peer %d is not another rank of [0, %d) (this is rank %d)", fn, peer,
                             c->world_size, c->rank);
    return DSK_OK;
}

/* host: appends the request to the pending ones (after the last one to the same peer in the same direction) and
   moves what the transport takes now. */
static dsk_status dsk__comm_host_p2p_start(dsk_comm *c, const char *fn, void *buf, int64_t count, dsk_dtype dt,
                                           int peer, int is_send, double t0) {
    dsk__comm_impl *m = c->impl;
    dsk__comm_wire h;
    dsk__comm_io *op;
    dsk_status st = DSK_OK;
    if (m->p2p_n == m->p2p_cap) {
        int cap = m->p2p_cap ? 2 * m->p2p_cap : 16;
        dsk__comm_io *grown = (dsk__comm_io *)DSK_MALLOC((size_t)cap * sizeof *grown);
        if (!grown) return dsk_set_error(DSK_ERR_OOM, "%s: room for %d pending requests", fn, cap);
        if (m->p2p_n) memcpy(grown, m->p2p, (size_t)m->p2p_n * sizeof *grown);
        DSK_FREE(m->p2p);
        m->p2p = grown;
        m->p2p_cap = cap;
    }
    h = dsk__comm_wire_make(m, DSK__COMM_SEND, dt, 0, -1, count);
    h.seq = is_send ? m->p2p_sent[peer]++ : m->p2p_recvd[peer]++;
    op = &m->p2p[m->p2p_n];
    dsk__comm_io_post(op, peer, is_send, &h, buf, (size_t)count * dsk_dtype_size(dt));
    /* the emulated link: a send ends once its bytes have left after the rank's earlier ones, and the latency */
    if (!dsk__comm_peer_on_link(c, peer)) op->due = t0;
    else
        op->due = is_send && m->link_bps > 0 ? m->link_s + dsk__comm_nic_take(m->nic, t0, (double)op->len / m->link_bps)
                                             : t0 + m->link_s;
    for (int i = m->p2p_n - 1; i >= 0 && op->after < 0; i--)
        if (m->p2p[i].peer == peer && m->p2p[i].is_send == is_send) op->after = i;
    m->p2p_n++;
    if (dsk__comm_io_push(c, fn, m->p2p, m->p2p_n, &st) < 0) return dsk__comm_break(c, st);
    return DSK_OK;
}

static void dsk__comm_p2p_link_wait(const dsk__comm_io *op) {
    double left = op->due - dsk__comm_now();
    if (left > 0) dsk__comm_sleep_s(left);
}

/* host: runs the pending requests until request `req` (< 0: every one) is complete; once none is left pending
   the list empties. */
static dsk_status dsk__comm_host_p2p_wait(dsk_comm *c, const char *fn, int64_t req, double t0) {
    dsk__comm_impl *m = c->impl;
    int k = req < 0 ? -1 : (int)(req - m->p2p_base), all = 1;
    dsk_status st;
    m->until_op = k;
    st = dsk__comm_io_run(c, fn, m->p2p, m->p2p_n, t0, NULL);
    m->until_op = -1;
    if (st != DSK_OK) return st;
    for (int i = 0; i < m->p2p_n; i++)
        if (k < 0 || i == k) dsk__comm_p2p_link_wait(&m->p2p[i]);
    for (int i = 0; i < m->p2p_n; i++) all &= dsk__comm_io_finished(&m->p2p[i]);
    if (all) {
        m->p2p_base += m->p2p_n;
        m->p2p_n = 0;
        m->link_mark = dsk__comm_link_sent(c); /* the next call's emulated link counts its own bytes */
    }
    return DSK_OK;
}

/* Begins a checked request (*req its id); the caller counts it. */
static dsk_status dsk__comm_p2p_begin(dsk_comm *c, const char *fn, dsk_ctx *ctx, void *buf, int64_t count, dsk_dtype dt,
                                      int peer, int is_send, double t0, int64_t *req) {
    dsk_status st = DSK_OK;
    dsk__comm_impl *m = c->impl;
    *req = -1;
    (void)ctx;
#ifdef DSK_CUDA
    if (DSK__COMM_NCCL(c)) { /* enqueued in order on the stream: nothing stays pending on the host */
        ncclResult_t r =
            is_send ? ncclSend(buf, (size_t)count, dsk__comm_nccl_dtype(dt), peer, m->nccl, dsk__comm_stream(ctx))
                    : ncclRecv(buf, (size_t)count, dsk__comm_nccl_dtype(dt), peer, m->nccl, dsk__comm_stream(ctx));
        st = dsk__comm_nccl_done(c, fn, r, is_send ? "ncclSend" : "ncclRecv", t0);
        if (st == DSK_OK) *req = m->p2p_base++;
    } else
#endif
    {
        st = dsk__comm_host_p2p_start(c, fn, buf, count, dt, peer, is_send, t0);
        if (st == DSK_OK) *req = m->p2p_base + m->p2p_n - 1;
    }
    return st;
}

/* The counters of a point to point call that began at t0 (its payload once it succeeded). */
static dsk_status dsk__comm_p2p_count(dsk_comm *c, dsk_status st, int is_send, int64_t count, dsk_dtype dt, double t0) {
    if (st == DSK_OK && is_send) c->stats.send_payload += (uint64_t)count * dsk_dtype_size(dt);
    c->stats.calls++;
    c->stats.seconds += dsk__comm_now() - t0;
    return st;
}

static dsk_status dsk__comm_p2p_start(dsk_comm *c, const char *fn, dsk_ctx *ctx, void *buf, int64_t count, dsk_dtype dt,
                                      int peer, int is_send, int64_t *req) {
    double t0 = dsk__comm_now();
    int64_t id;
    dsk_status st;
    if (req) *req = -1;
    DSK__TRY(dsk__comm_p2p_check(c, fn, buf, count, dt, peer));
    st = dsk__comm_p2p_begin(c, fn, ctx, buf, count, dt, peer, is_send, t0, &id);
    if (req) *req = id;
    return dsk__comm_p2p_count(c, st, is_send, count, dt, t0);
}

DSK_API dsk_status dsk_comm_send_start(dsk_comm *c, dsk_ctx *ctx, const void *buf, int64_t count, dsk_dtype dt,
                                       int peer, int64_t *req) {
    return dsk__comm_p2p_start(c, "dsk_comm_send_start", ctx, (void *)buf, count, dt, peer, 1, req);
}

DSK_API dsk_status dsk_comm_recv_start(dsk_comm *c, dsk_ctx *ctx, void *buf, int64_t count, dsk_dtype dt, int peer,
                                       int64_t *req) {
    return dsk__comm_p2p_start(c, "dsk_comm_recv_start", ctx, buf, count, dt, peer, 0, req);
}

/* Whether request req (DSK_COMM_ALL_REQUESTS allowed where `all`) was issued on c. */
static dsk_status dsk__comm_req_check(const dsk_comm *c, const char *fn, int64_t req, int all) {
    const dsk__comm_impl *m;
    DSK__TRY(dsk__comm_check_p2p(c, fn));
    m = c->impl;
    if (req < (all ? DSK_COMM_ALL_REQUESTS : 0) || req >= m->p2p_base + m->p2p_n)
        return dsk_set_error(DSK_ERR_ARG, "%s: request %lld was never begun on rank %d (ids 0 to %lld so far)", fn,
                             (long long)req, c->rank, (long long)(m->p2p_base + m->p2p_n - 1));
    return DSK_OK;
}

/* Waits for request req (< 0: all) without counting the call. */
static dsk_status dsk__comm_wait(dsk_comm *c, const char *fn, int64_t req, double t0) {
    dsk__comm_impl *m;
    DSK__TRY(dsk__comm_req_check(c, fn, req, 1));
    m = c->impl;
    if (c->backend == DSK_COMM_HOST && m->p2p_n && (req < 0 || req >= m->p2p_base))
        return dsk__comm_host_p2p_wait(c, fn, req, t0);
    return DSK_OK;
}

DSK_API dsk_status dsk_comm_wait(dsk_comm *c, dsk_ctx *ctx, int64_t req) {
    double t0 = dsk__comm_now();
    dsk_status st = dsk__comm_wait(c, "dsk_comm_wait", req, t0);
    (void)ctx;
    if (c && c->impl) c->stats.seconds += dsk__comm_now() - t0;
    return st;
}

DSK_API dsk_status dsk_comm_test(dsk_comm *c, dsk_ctx *ctx, int64_t req, int *state) {
    const char *fn = "dsk_comm_test";
    double t0 = dsk__comm_now();
    dsk__comm_impl *m;
    const dsk__comm_io *op;
    dsk_status st = DSK_OK;
    (void)ctx;
    if (!state) return dsk_set_error(DSK_ERR_ARG, "%s: state is NULL", fn);
    DSK__TRY(dsk__comm_req_check(c, fn, req, 0));
    m = c->impl;
    *state = DSK_COMM_REQ_DONE;
    if (c->backend != DSK_COMM_HOST || req < m->p2p_base) return DSK_OK;
    if (dsk__comm_io_push(c, fn, m->p2p, m->p2p_n, &st) < 0) return dsk__comm_break(c, st);
    op = &m->p2p[req - m->p2p_base];
    if (!dsk__comm_io_finished(op)) *state = op->done ? DSK_COMM_REQ_MOVING : DSK_COMM_REQ_IDLE;
    else if (dsk__comm_now() < op->due)
        *state = DSK_COMM_REQ_MOVING; /* not yet across the emulated link: a wait would sleep */
    c->stats.seconds += dsk__comm_now() - t0;
    return DSK_OK;
}

DSK_API int64_t dsk_comm_host_ring_room(int local_ranks) {
    return local_ranks < 2 ? 0 : (int64_t)(dsk__comm_ring_bytes(local_ranks) - DSK__COMM_FRAME);
}

DSK_API int64_t dsk_comm_buffered_bytes(const dsk_comm *c, int peer) {
    if (!c || !c->impl || c->backend != DSK_COMM_HOST || peer < 0 || peer >= c->world_size || peer == c->rank ||
        !dsk__comm_is_shm(c->impl, peer))
        return 0;
    return (int64_t)(c->impl->ring - DSK__COMM_FRAME);
}

/* The blocking calls: begun, then waited for (moving any pending requests meanwhile). */
static dsk_status dsk__comm_p2p(dsk_comm *c, const char *fn, dsk_ctx *ctx, void *buf, int64_t count, dsk_dtype dt,
                                int peer, int is_send) {
    double t0 = dsk__comm_now();
    int64_t req;
    dsk_status st;
    DSK__TRY(dsk__comm_p2p_check(c, fn, buf, count, dt, peer));
    st = dsk__comm_p2p_begin(c, fn, ctx, buf, count, dt, peer, is_send, t0, &req);
    if (st == DSK_OK) st = dsk__comm_wait(c, fn, req, t0);
    return dsk__comm_p2p_count(c, st, is_send, count, dt, t0);
}

DSK_API dsk_status dsk_comm_send(dsk_comm *c, dsk_ctx *ctx, const void *buf, int64_t count, dsk_dtype dt, int peer) {
    return dsk__comm_p2p(c, "dsk_comm_send", ctx, (void *)buf, count, dt, peer, 1);
}

DSK_API dsk_status dsk_comm_recv(dsk_comm *c, dsk_ctx *ctx, void *buf, int64_t count, dsk_dtype dt, int peer) {
    return dsk__comm_p2p(c, "dsk_comm_recv", ctx, buf, count, dt, peer, 0);
}

DSK_API dsk_status dsk_comm_sync(dsk_comm *c, dsk_ctx *ctx) {
    const char *fn = "dsk_comm_sync";
    DSK__TRY(dsk__comm_check(c, fn));
#ifdef DSK_CUDA
    if (DSK__COMM_NCCL(c)) {
        double t0 = dsk__comm_now();
        for (;;) {
            int done = 0;
            ncclResult_t state = ncclSuccess;
            if (dsk_cuda_stream_done(dsk__comm_stream(ctx), &done) != DSK_OK) return dsk__comm_break(c, DSK_ERR_CUDA);
            if (done) return DSK_OK;
            ncclCommGetAsyncError(c->impl->nccl, &state);
            if (state != ncclSuccess && state != ncclInProgress) {
                dsk__comm_nccl_check(c, fn, state, "an NCCL operation");
                return dsk__comm_break(c, DSK_ERR_NCCL);
            }
            if (dsk__comm_now() - t0 > c->impl->timeout_s) {
                dsk_set_error(DSK_ERR_TIMEOUT, "%s: rank %d's stream still busy after %.2f s (a peer may have died or "
                              "stopped); aborting the NCCL communicator", fn, c->rank, dsk__comm_now() - t0);
                return dsk__comm_break(c, DSK_ERR_TIMEOUT);
            }
            dsk__comm_sleep_s(1e-4);
        }
    }
#endif
    (void)ctx;
    return DSK_OK;
}

DSK_API dsk_status dsk_comm_barrier(dsk_comm *c, dsk_ctx *ctx) {
    const char *fn = "dsk_comm_barrier";
    double t0 = dsk__comm_now();
    DSK__TRY(dsk__comm_check(c, fn));
#ifdef DSK_CUDA
    if (DSK__COMM_NCCL(c)) {
        dsk_status st = dsk__comm_nccl_done(c, fn,
                                            ncclAllReduce(c->impl->nccl_flag, c->impl->nccl_flag, 1, ncclFloat32,
                                                          ncclSum, c->impl->nccl, dsk__comm_stream(ctx)),
                                            "ncclAllReduce (barrier)", t0);
        return dsk__comm_done(c, st ? st : dsk_comm_sync(c, ctx), t0);
    }
#endif
    (void)ctx;
    return dsk__comm_done(c, dsk__comm_host_barrier(c, fn, t0), t0);
}

/* ---------------------------------------------------------------- split */

typedef struct dsk__comm_split_rec { int64_t color, key, rank; char ep[DSK__COMM_EP_LEN]; } dsk__comm_split_rec;

/* A sub-group's nodes and shared-memory permissions, from its parent's: member j of sub is
   rank parents[j] of c. */
static dsk_status dsk__comm_sub_nodes(dsk_comm *c, const char *fn, dsk_comm *sub, const int *parents) {
    int *same = (int *)DSK_MALLOC((size_t)sub->world_size * sizeof(int));
    sub->impl->world_of = (int *)DSK_MALLOC((size_t)sub->world_size * sizeof(int));
    if (!same || !sub->impl->world_of) {
        DSK_FREE(same);
        return dsk_set_error(DSK_ERR_OOM, "%s: nodes of %d ranks", fn, sub->world_size);
    }
    for (int j = 0; j < sub->world_size; j++) {
        same[j] = c->impl->node_of[parents[j]];
        sub->impl->shm_ok[j] = c->impl->shm_ok[parents[j]];
        sub->impl->world_of[j] = c->impl->world_of ? c->impl->world_of[parents[j]] : parents[j];
    }
    dsk__comm_set_nodes(sub, same);
    DSK_FREE(same);
    return DSK_OK;
}

#ifdef DSK_CUDA
/* Every rank's (color, key) through NCCL (all[2 r], all[2 r + 1]), for the sub-group's nodes. */
static dsk_status dsk__comm_nccl_split_records(dsk_comm *c, const char *fn, int color, int key, int64_t *all,
                                               double t0) {
    int64_t mine[2], *d = NULL;
    size_t bytes = (size_t)2 * c->world_size * sizeof(int64_t);
    dsk_status st = dsk_cuda_device_malloc(bytes, (void **)&d);
    mine[0] = color;
    mine[1] = key;
    if (st != DSK_OK) return st;
    st = dsk_cuda_memcpy_sync(d + 2 * c->rank, mine, sizeof mine, 1);
    if (st == DSK_OK)
        st = dsk__comm_nccl_done(c, fn, ncclAllGather(d + 2 * c->rank, d, 2, ncclInt64, c->impl->nccl, 0),
                                 "ncclAllGather (split records)", t0);
    if (st == DSK_OK) st = dsk_comm_sync(c, NULL);
    if (st == DSK_OK) st = dsk_cuda_memcpy_sync(all, d, bytes, 0);
    dsk_cuda_free(NULL, d);
    return st;
}

/* The NCCL split itself; parents[0..cnt): the parent ranks of the new group's members. */
static dsk_status dsk__comm_nccl_split_make(dsk_comm *c, const char *fn, int color, int key, dsk_comm *sub, double t0,
                                            const int *parents, int cnt) {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    ncclComm_t nc = NULL;
    dsk_status st;
    int n = 0, r = 0;
    cfg.blocking = 0;
    if ((st = dsk__comm_nccl_check(c, fn,
                                   ncclCommSplit(c->impl->nccl, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &nc, &cfg),
                                   "ncclCommSplit")) != DSK_OK)
        return dsk__comm_break(c, st);
    /* nonblocking split: the parent reads ncclInProgress until the split is done, then newcomm is set */
    DSK__TRY(dsk__comm_nccl_settle(c, fn, c->impl->nccl, t0, "ncclCommSplit"));
    if (color < 0) return DSK_OK;
    if (!nc)
        return dsk_set_error(DSK_ERR_NCCL, "%s: ncclCommSplit gave rank %d (color %d) no communicator", fn, c->rank,
                             color);
    st = dsk__comm_nccl_settle(c, fn, nc, t0, "ncclCommSplit (new communicator)");
    if (st == DSK_OK) st = dsk__comm_nccl_check(c, fn, ncclCommCount(nc, &n), "ncclCommCount");
    if (st == DSK_OK) st = dsk__comm_nccl_check(c, fn, ncclCommUserRank(nc, &r), "ncclCommUserRank");
    if (st != DSK_OK) {
        ncclCommAbort(nc);
        return st;
    }
    sub->rank = r;
    sub->world_size = n;
    if ((st = dsk__comm_impl_alloc(sub, fn, NULL, c->impl->master_addr, c->impl->master_port)) != DSK_OK) {
        ncclCommAbort(nc);
        return st;
    }
    sub->impl->nccl = nc;
    sub->impl->timeout_s = c->impl->timeout_s;
    DSK__TRY(dsk_cuda_device_malloc(sizeof(float), &sub->impl->nccl_flag));
    if (n != cnt || parents[r] != c->rank)
        return dsk_set_error(DSK_ERR_NCCL, "%s: ncclCommSplit made rank %d member %d of %d; the split records say %d "
                             "members", fn, c->rank, r, n, cnt);
    return dsk__comm_sub_nodes(c, fn, sub, parents);
}

static dsk_status dsk__comm_nccl_split(dsk_comm *c, const char *fn, int color, int key, dsk_comm *sub, double t0) {
    dsk_status st;
    int cnt = 0, *parents = (int *)DSK_MALLOC((size_t)c->world_size * sizeof(int));
    int64_t *all = (int64_t *)DSK_MALLOC((size_t)2 * c->world_size * sizeof(int64_t));
    if (!all || !parents) {
        DSK_FREE(all);
        DSK_FREE(parents);
        return dsk_set_error(DSK_ERR_OOM, "%s: %d split records", fn, c->world_size);
    }
    st = dsk__comm_nccl_split_records(c, fn, color, key, all, t0);
    /* members of this color in (key, rank) order, as NCCL orders them: their parent ranks */
    for (int q = 0; st == DSK_OK && q < c->world_size; q++) {
        int64_t cq = all[2 * q], kq = all[2 * q + 1];
        int j;
        if (color < 0 || cq != color) continue;
        for (j = cnt; j > 0 && all[2 * parents[j - 1] + 1] > kq; j--) parents[j] = parents[j - 1];
        parents[j] = q;
        cnt++;
    }
    DSK_FREE(all);
    if (st == DSK_OK) st = dsk__comm_nccl_split_make(c, fn, color, key, sub, t0, parents, cnt);
    DSK_FREE(parents);
    return st;
}
#endif

static dsk_status dsk__comm_host_split(dsk_comm *c, const char *fn, int color, int key, dsk_comm *sub, double t0) {
    dsk__comm_impl *pm = c->impl, *m;
    int n = c->world_size, lfd = -1, cnt = 0, me = -1, *parents = NULL, gathered = 0;
    dsk__comm_split_rec mine, *all;
    char *eps = NULL;
    dsk_status st;
    memset(&mine, 0, sizeof mine);
    mine.color = color;
    mine.key = key;
    mine.rank = c->rank;
    if (color >= 0) DSK__TRY(dsk__comm_mesh_listen(c, fn, &lfd, mine.ep));
    if (!(all = (dsk__comm_split_rec *)DSK_MALLOC((size_t)n * sizeof *all))) {
        if (lfd >= 0) close(lfd);
        return dsk_set_error(DSK_ERR_OOM, "%s: %d split records", fn, n);
    }
    st = dsk__comm_host_all_gather(c, fn, (const char *)&mine, (char *)all, (int64_t)sizeof mine, DSK_U8, t0);
    pm->seq++;
    pm->splits++;
    gathered = st == DSK_OK;
    if (st != DSK_OK || color < 0) goto out;
    /* members of my color in (key, rank) order: stable insertion sort of their indices */
    {
        int *order = (int *)DSK_MALLOC((size_t)n * sizeof(int));
        if (!order) { st = dsk_set_error(DSK_ERR_OOM, "%s: split order", fn); goto out; }
        for (int r = 0; r < n; r++) {
            int j;
            if (all[r].color != color) continue;
            for (j = cnt; j > 0 && (all[order[j - 1]].key > all[r].key); j--) order[j] = order[j - 1];
            order[j] = r;
            cnt++;
        }
        eps = (char *)DSK_MALLOC((size_t)cnt * DSK__COMM_EP_LEN);
        if (!eps) { DSK_FREE(order); st = dsk_set_error(DSK_ERR_OOM, "%s: endpoints", fn); goto out; }
        for (int j = 0; j < cnt; j++) {
            memcpy(eps + (size_t)j * DSK__COMM_EP_LEN, all[order[j]].ep, DSK__COMM_EP_LEN);
            if (order[j] == c->rank) me = j;
        }
        for (int j = 0; j < cnt; j++) order[j] = (int)all[order[j]].rank; /* now: parent rank of member j */
        parents = order;
    }
    sub->rank = me;
    sub->world_size = cnt;
    sub->local_rank = c->local_rank;
    sub->local_world_size = c->local_world_size;
    sub->backend = DSK_COMM_HOST;
    if ((st = dsk__comm_impl_alloc(sub, fn, NULL, pm->master_addr, pm->master_port)) != DSK_OK) goto out;
    m = sub->impl;
    m->timeout_s = pm->timeout_s;
    m->small_bytes = pm->small_bytes;
    m->piece_bytes = pm->piece_bytes;
    m->link_bps = pm->link_bps;
    m->link_s = pm->link_s;
    dsk__comm_nic_share(m, pm->nic);
    memcpy(m->my_ip, pm->my_ip, sizeof m->my_ip);
    snprintf(m->ns, sizeof m->ns, "%.40s/%llu.%d", pm->ns, (unsigned long long)pm->splits, color);
    m->tag = pm->tag ^ (0x9E3779B97F4A7C15ull * (pm->splits * 65536u + (uint64_t)color + 1));
    if ((st = dsk__comm_sub_nodes(c, fn, sub, parents)) != DSK_OK) goto out;
    if ((st = dsk__comm_mesh_connect(sub, fn, lfd, eps, DSK__COMM_EP_LEN, t0 + pm->timeout_s)) != DSK_OK) goto out;
    if (pm->store_fd >= 0 || pm->server) {
        struct sockaddr_in sa;
        if ((st = dsk__comm_resolve(fn, pm->master_addr, pm->master_port, &sa)) == DSK_OK)
            st = dsk__comm_connect(fn, &sa, t0 + pm->timeout_s, "key-value store (served by rank 0)", &m->store_fd);
        if (st == DSK_OK) st = dsk__comm_shm_setup(sub, fn);
    }
out:
    if (lfd >= 0) close(lfd);
    DSK_FREE(all);
    DSK_FREE(eps);
    DSK_FREE(parents);
    if (gathered) { /* no rank returns before every new group has set up over rank 0's store (which rank 0 would
                       otherwise free under a late group's feet if it returned and freed c first) */
        dsk_status bs = dsk__comm_host_barrier(c, fn, t0);
        pm->seq++;
        if (st == DSK_OK) st = bs;
    }
    return st;
}

DSK_API dsk_status dsk_comm_split(dsk_comm *c, int color, int key, dsk_comm *sub) {
    const char *fn = "dsk_comm_split";
    double t0 = dsk__comm_now();
    dsk_status st;
    DSK__TRY(dsk__comm_check(c, fn));
    if (!sub || sub == c) return dsk_set_error(DSK_ERR_ARG, "%s: sub is NULL or the parent itself", fn);
    if (color < DSK_COMM_NO_COLOR)
        return dsk_set_error(DSK_ERR_ARG, "%s: color %d is negative (use DSK_COMM_NO_COLOR to join no group)", fn,
                             color);
    memset(sub, 0, sizeof *sub);
    sub->cuda_device = c->cuda_device;
#ifdef DSK_CUDA
    if (DSK__COMM_NCCL(c)) {
        sub->backend = DSK_COMM_NCCL;
        sub->local_rank = c->local_rank;
        sub->local_world_size = c->local_world_size;
        st = dsk__comm_nccl_split(c, fn, color, key, sub, t0);
    } else
#endif
        st = dsk__comm_host_split(c, fn, color, key, sub, t0);
    if (st != DSK_OK || color < 0) {
        dsk__comm_impl_free(sub);
        memset(sub, 0, sizeof *sub);
    } else { /* join the parent's ring */
        dsk__comm_impl *k = sub->impl, *p = c->impl;
        k->kin_prev = p->kin_prev;
        k->kin_next = p;
        p->kin_prev->kin_next = k;
        p->kin_prev = k;
    }
    return st;
}

DSK_API int dsk_comm_node_of(const dsk_comm *c, int rank) {
    if (!c || !c->impl || rank < 0 || rank >= c->world_size) return -1;
    return c->impl->node_of[rank];
}

DSK_API dsk_status dsk_comm_node_comms(dsk_comm *c, dsk_comm **node, dsk_comm **cross) {
    const char *fn = "dsk_comm_node_comms";
    dsk__comm_impl *m;
    if (!node || !cross) return dsk_set_error(DSK_ERR_ARG, "%s: node or cross is NULL", fn);
    *node = *cross = NULL;
    DSK__TRY(dsk__comm_check(c, fn));
    m = c->impl;
    if (!m->node_comm) {
        m->node_comm = (dsk_comm *)DSK_MALLOC(sizeof(dsk_comm));
        m->cross_comm = (dsk_comm *)DSK_MALLOC(sizeof(dsk_comm));
        if (!m->node_comm || !m->cross_comm) {
            DSK_FREE(m->node_comm);
            DSK_FREE(m->cross_comm);
            m->node_comm = m->cross_comm = NULL;
            return dsk_set_error(DSK_ERR_OOM, "%s: two communicators", fn);
        }
        memset(m->node_comm, 0, sizeof(dsk_comm));
        memset(m->cross_comm, 0, sizeof(dsk_comm));
        if (dsk_comm_split(c, c->node, c->rank, m->node_comm) != DSK_OK ||
            dsk_comm_split(c, c->node_rank, c->node, m->cross_comm) != DSK_OK) {
            char msg[1200];
            snprintf(msg, sizeof msg, "%s: splitting the node and cross-node communicators: %s", fn, dsk_last_error());
            dsk_comm_free(m->node_comm);
            dsk_comm_free(m->cross_comm);
            DSK_FREE(m->node_comm);
            DSK_FREE(m->cross_comm);
            m->node_comm = m->cross_comm = NULL;
            return dsk_set_error(DSK_ERR_PEER, "%s", msg);
        }
    }
    *node = m->node_comm;
    *cross = m->cross_comm;
    return DSK_OK;
}

/* ---------------------------------------------------------------- tensor forms */

static dsk_status dsk__comm_tensor_check(dsk_comm *c, const char *fn, const char *name, const dsk_tensor *t) {
    char d[96];
    dsk_device_type want;
    if (!t) return dsk_set_error(DSK_ERR_ARG, "%s: tensor %s is NULL", fn, name);
    if (!c || !c->impl) return dsk_set_error(DSK_ERR_ARG, "%s: communicator is NULL or not initialised", fn);
    want = c->backend == DSK_COMM_NCCL ? DSK_DEV_CUDA : DSK_DEV_CPU;
    if (!dsk_tensor_is_contiguous(t))
        return dsk_set_error(DSK_ERR_ARG, "%s: tensor %s %s is not contiguous", fn, name,
                             dsk_tensor_describe(t, d, sizeof d));
    if (t->device.type != want)
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: tensor %s %s is on the %s but the %s backend needs %s memory",
                             fn, name, dsk_tensor_describe(t, d, sizeof d),
                             t->device.type == DSK_DEV_CUDA ? "GPU" : "CPU", want == DSK_DEV_CUDA ? "nccl" : "host",
                             want == DSK_DEV_CUDA ? "device" : "CPU");
    return DSK_OK;
}

static dsk_status dsk__comm_tensor_pair(dsk_comm *c, const char *fn, const dsk_tensor *out, const dsk_tensor *in,
                                        int64_t out_per_in_num, int64_t out_per_in_den) {
    char a[96], b[96];
    DSK__TRY(dsk__comm_tensor_check(c, fn, "out", out));
    DSK__TRY(dsk__comm_tensor_check(c, fn, "in", in));
    if (out->dtype != in->dtype || dsk_tensor_numel(in) * out_per_in_num != dsk_tensor_numel(out) * out_per_in_den)
        return dsk_set_error(DSK_ERR_ARG, "%s: out %s does not fit in %s for %d ranks", fn,
                             dsk_tensor_describe(out, a, sizeof a), dsk_tensor_describe(in, b, sizeof b),
                             c->world_size);
    return DSK_OK;
}

DSK_API dsk_status dsk_comm_all_reduce_tensor(dsk_comm *c, dsk_ctx *ctx, dsk_tensor *t, dsk_comm_op op) {
    dsk_status st = dsk__comm_tensor_check(c, "dsk_comm_all_reduce_tensor", "t", t);
    return st ? st : dsk_comm_all_reduce(c, ctx, t->data, t->data, dsk_tensor_numel(t), t->dtype, op);
}

DSK_API dsk_status dsk_comm_reduce_scatter_tensor(dsk_comm *c, dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *in,
                                                  dsk_comm_op op) {
    dsk_status st =
        dsk__comm_tensor_pair(c, "dsk_comm_reduce_scatter_tensor", out, in, 1, c && c->impl ? c->world_size : 1);
    return st ? st : dsk_comm_reduce_scatter(c, ctx, in->data, out->data, dsk_tensor_numel(out), out->dtype, op);
}

DSK_API dsk_status dsk_comm_all_gather_tensor(dsk_comm *c, dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *in) {
    dsk_status st =
        dsk__comm_tensor_pair(c, "dsk_comm_all_gather_tensor", out, in, c && c->impl ? c->world_size : 1, 1);
    return st ? st : dsk_comm_all_gather(c, ctx, in->data, out->data, dsk_tensor_numel(in), in->dtype);
}

DSK_API dsk_status dsk_comm_broadcast_tensor(dsk_comm *c, dsk_ctx *ctx, dsk_tensor *t, int root) {
    dsk_status st = dsk__comm_tensor_check(c, "dsk_comm_broadcast_tensor", "t", t);
    return st ? st : dsk_comm_broadcast(c, ctx, t->data, t->data, dsk_tensor_numel(t), t->dtype, root);
}

DSK_API dsk_status dsk_comm_all_to_all_tensor(dsk_comm *c, dsk_ctx *ctx, dsk_tensor *out, const dsk_tensor *in) {
    const char *fn = "dsk_comm_all_to_all_tensor";
    char d[96];
    DSK__TRY(dsk__comm_tensor_pair(c, fn, out, in, 1, 1));
    if (dsk_tensor_numel(in) % c->world_size)
        return dsk_set_error(DSK_ERR_ARG, "%s: in %s does not split into %d equal blocks", fn,
                             dsk_tensor_describe(in, d, sizeof d), c->world_size);
    return dsk_comm_all_to_all(c, ctx, in->data, out->data, dsk_tensor_numel(in) / c->world_size, in->dtype);
}

/* ---------------------------------------------------------------- local launcher */

/* The lowest port of the kernel's ephemeral range (32768, Linux's default, when it cannot be read). */
static int dsk__comm_ephemeral_low(void) {
    FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
    int lo = 32768, hi = 0;
    if (f) {
        if (fscanf(f, "%d %d", &lo, &hi) != 2) lo = 32768;
        fclose(f);
    }
    return lo;
}

/* Tries up to 64 random ports in [DSK__COMM_PORT_MIN, the ephemeral range's low end). */
#define DSK__COMM_PORT_MIN 20000
static int dsk__comm_quiet_port(const char *fn, const struct sockaddr_in *addr) {
    int lo = dsk__comm_ephemeral_low(), fd;
    uint64_t x = ((uint64_t)getpid() << 32) ^ (uint64_t)(dsk__comm_now() * 1e9); /* the clock moves between calls */
    if (lo - DSK__COMM_PORT_MIN < 1000) return 0;
    for (int i = 0; i < 64; i++) {
        struct sockaddr_in sa = *addr;
        int port;
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        port = DSK__COMM_PORT_MIN + (int)((x >> 33) % (uint64_t)(lo - DSK__COMM_PORT_MIN));
        sa.sin_port = htons((uint16_t)port);
        if (dsk__comm_listen(fn, &sa, NULL, &fd, NULL) == DSK_OK) {
            close(fd);
            return port;
        }
    }
    return 0;
}

DSK_API dsk_status dsk_comm_free_port(const char *addr, int *port) {
    const char *fn = "dsk_comm_free_port";
    struct sockaddr_in sa;
    int fd;
    if (!port) return dsk_set_error(DSK_ERR_ARG, "%s: port is NULL", fn);
    DSK__TRY(dsk__comm_resolve(fn, addr ? addr : "127.0.0.1", 0, &sa));
    if ((*port = dsk__comm_quiet_port(fn, &sa)) != 0) return DSK_OK;
    DSK__TRY(dsk__comm_listen(fn, &sa, NULL, &fd, port));
    close(fd);
    return DSK_OK;
}

#ifndef DSK_COMM_NO_LAUNCHER
static void dsk__comm_write_fd(int fd, const char *p, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return;
        p += w;
        n -= (size_t)w;
    }
}

/* One rank's output in the launcher: bytes read and not yet forwarded (the current line). */
typedef struct dsk__comm_outbuf {
    char *p;
    size_t len, cap;
    size_t seen; /* p[0, seen) holds no newline */
} dsk__comm_outbuf;

/* Writes the complete lines of b with a rank prefix, each whole, and keeps the rest (at `all`,
   the rest too, as a line of its own). */
static void dsk__comm_forward_lines(int out_fd, int rank, dsk__comm_outbuf *b, int all) {
    char prefix[32];
    size_t start = 0;
    int np = snprintf(prefix, sizeof prefix, "[rank %d] ", rank);
    for (;;) {
        char *nl = (char *)memchr(b->p + b->seen, '\n', b->len - b->seen);
        size_t end = nl ? (size_t)(nl - b->p) + 1 : b->len;
        if (!nl && (!all || start == b->len)) break;
        dsk__comm_write_fd(out_fd, prefix, (size_t)np);
        dsk__comm_write_fd(out_fd, b->p + start, end - start);
        if (!nl) dsk__comm_write_fd(out_fd, "\n", 1);
        start = b->seen = end;
    }
    memmove(b->p, b->p + start, b->len - start);
    b->len -= start;
    b->seen = b->len;
}

/* Room for 4 KiB more in b (a line grows without bound); out of memory, the line so far is
   forwarded as a line of its own rather than the child blocking. */
static void dsk__comm_outbuf_room(dsk__comm_outbuf *b, int out_fd, int rank) {
    char *q;
    if (b->cap - b->len >= 4096) return;
    if (!(q = (char *)DSK_MALLOC(b->cap * 2))) { dsk__comm_forward_lines(out_fd, rank, b, 1); return; }
    memcpy(q, b->p, b->len);
    DSK_FREE(b->p);
    b->p = q;
    b->cap *= 2;
}

static void dsk__comm_spawn_child(int rank, int n, int port, const char *addr, const char *job, int out,
                                  char *const argv[]) {
    char v[32];
    dup2(out, 1);
    dup2(out, 2);
    if (out > 2) close(out);
    snprintf(v, sizeof v, "%d", rank); setenv("RANK", v, 1); setenv("LOCAL_RANK", v, 1);
    snprintf(v, sizeof v, "%d", n); setenv("WORLD_SIZE", v, 1); setenv("LOCAL_WORLD_SIZE", v, 1);
    snprintf(v, sizeof v, "%d", port); setenv("MASTER_PORT", v, 1);
    setenv("MASTER_ADDR", addr, 1);
    setenv("DSK_JOB_ID", job, 1);
    signal(SIGPIPE, SIG_DFL);
    execvp(argv[0], argv);
    {
        char msg[512];
        int k =
            snprintf(msg, sizeof msg, "dsk_comm_spawn_local: cannot execute \"%s\": %s\n", argv[0], strerror(errno));
        dsk__comm_write_fd(2, msg, (size_t)(k > 0 ? k : 0));
    }
    _exit(127);
}

static void dsk__comm_spawn_free(pid_t *pids, int *fds, dsk__comm_outbuf *bufs, int n, struct pollfd *pf) {
    for (int r = 0; bufs && r < n; r++) DSK_FREE(bufs[r].p);
    DSK_FREE(pids); DSK_FREE(fds); DSK_FREE(bufs); DSK_FREE(pf);
}

DSK_API dsk_status dsk_comm_spawn_local(int n, char *const argv[], const dsk_comm_spawn_opts *opts, int *worst_exit) {
    const char *fn = "dsk_comm_spawn_local";
    const char *addr = opts && opts->master_addr ? opts->master_addr : "127.0.0.1";
    int port = opts && opts->master_port ? opts->master_port : 0, out_fd = opts && opts->out_fd > 0 ? opts->out_fd : 1;
    double deadline = opts && opts->timeout_s > 0 ? dsk__comm_now() + opts->timeout_s : 0;
    pid_t *pids;
    int *fds, open_fds = 0, worst = 0, killed = 0;
    dsk__comm_outbuf *bufs;
    struct pollfd *pf;
    dsk_status st;
    char job[64];
    if (worst_exit) *worst_exit = 0;
    if (n < 1 || n > 4096 || !argv || !argv[0])
        return dsk_set_error(DSK_ERR_ARG, "%s: need 1 to 4096 ranks and a program (n = %d)", fn, n);
    if (!port) DSK__TRY(dsk_comm_free_port(addr, &port));
    {
        /* every launch is a job of its own: this process and the moment tell it apart */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        snprintf(job, sizeof job, "spawn-%ld-%lld.%09ld", (long)getpid(), (long long)ts.tv_sec, (long)ts.tv_nsec);
    }
    pids = (pid_t *)DSK_MALLOC((size_t)n * sizeof *pids);
    fds = (int *)DSK_MALLOC((size_t)n * sizeof *fds);
    bufs = (dsk__comm_outbuf *)DSK_MALLOC((size_t)n * sizeof *bufs);
    pf = (struct pollfd *)DSK_MALLOC((size_t)n * sizeof *pf);
    if (bufs) memset(bufs, 0, (size_t)n * sizeof *bufs);
    for (int r = 0; bufs && r < n; r++) {
        if (!(bufs[r].p = (char *)DSK_MALLOC(8192))) break;
        bufs[r].cap = 8192;
    }
    if (!pids || !fds || !bufs || !bufs[n - 1].p || !pf) {
        dsk__comm_spawn_free(pids, fds, bufs, n, pf);
        return dsk_set_error(DSK_ERR_OOM, "%s: %d ranks", fn, n);
    }
    st = DSK_OK;
    for (int r = 0; r < n; r++) {
        int p[2];
        pids[r] = -1;
        fds[r] = -1;
        if (st != DSK_OK) continue;
        if (pipe(p) != 0) { st = dsk_set_error(DSK_ERR_IO, "%s: pipe: %s", fn, strerror(errno)); continue; }
        fcntl(p[0], F_SETFD, FD_CLOEXEC);
        pids[r] = fork();
        if (pids[r] == 0) dsk__comm_spawn_child(r, n, port, addr, job, p[1], argv);
        close(p[1]);
        if (pids[r] < 0) { close(p[0]); st = dsk_set_error(DSK_ERR_IO, "%s: fork: %s", fn, strerror(errno)); continue; }
        dsk__comm_set_nonblocking_cloexec(p[0]);
        fds[r] = p[0];
        open_fds++;
    }
    if (st != DSK_OK) /* a rank could not start: stop the others, they would wait for it */
        for (int r = 0; r < n; r++)
            if (pids[r] > 0) kill(pids[r], SIGKILL);
    while (open_fds > 0) {
        int k = 0, ms = 200;
        if (deadline && !killed && dsk__comm_now() >= deadline) {
            for (int r = 0; r < n; r++)
                if (pids[r] > 0) kill(pids[r], SIGKILL);
            killed = 1;
        }
        for (int r = 0; r < n; r++)
            if (fds[r] >= 0) { pf[k].fd = fds[r]; pf[k].events = POLLIN; pf[k].revents = 0; k++; }
        if (poll(pf, (nfds_t)k, ms) <= 0) continue;
        for (int r = 0; r < n; r++) {
            for (;;) {
                ssize_t got;
                if (fds[r] < 0) break;
                dsk__comm_outbuf_room(&bufs[r], out_fd, r);
                got = read(fds[r], bufs[r].p + bufs[r].len, bufs[r].cap - bufs[r].len);
                if (got > 0) {
                    bufs[r].len += (size_t)got;
                    dsk__comm_forward_lines(out_fd, r, &bufs[r], 0);
                    continue;
                }
                if (got < 0 && errno == EINTR) continue;
                if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
                dsk__comm_forward_lines(out_fd, r, &bufs[r], 1);
                close(fds[r]);
                fds[r] = -1;
                open_fds--;
            }
        }
    }
    for (int r = 0; r < n; r++) {
        int status = 0, code;
        if (pids[r] <= 0) continue;
        while (waitpid(pids[r], &status, 0) < 0 && errno == EINTR) {}
        code = WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 255;
        if (code > worst) worst = code;
    }
    if (worst_exit) *worst_exit = worst;
    dsk__comm_spawn_free(pids, fds, bufs, n, pf);
    if (st == DSK_OK && killed)
        st = dsk_set_error(DSK_ERR_TIMEOUT, "%s: ranks still running after %.1f s were killed", fn, opts->timeout_s);
    return st;
}
#endif /* DSK_COMM_NO_LAUNCHER */

/* ---------------------------------------------------------------- options */

DSK_API const char *dsk_comm_options(void) {
#ifdef DSK_COMM_NO_LAUNCHER
    return "DSK_COMM_NO_LAUNCHER";
#else
    return "";
#endif
}

#endif /* DSK_COMM_IMPLEMENTATION_DONE */
#endif /* DSK_COMM_IMPLEMENTATION */

/* MIT License. Copyright (c) 2026 the dsk authors. Permission is hereby granted, free of charge, to any
   person obtaining a copy of this software, to deal in it without restriction, subject to including this
   notice. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND. */
