/* dsk_moe.h - the DeepSeek Mixture-of-Experts layer: router, dispatch/combine, SwiGLU experts,
   shared experts, balancing losses, expert bias, capacity, expert parallelism; forward and backward.

   Usage: #define DSK_MOE_IMPLEMENTATION in exactly one .c file before including (with
   DSK_TENSOR_IMPLEMENTATION and DSK_COMM_IMPLEMENTATION somewhere in the program).
   Options: DSK_STATIC, DSK_MALLOC/DSK_FREE, DSK_CUDA, DSK_NO_CUDA as in dsk_tensor.h.

   Example (given dsk_ctx *ctx, dsk_comm *dp_comm, dsk_tensor *value_views, dsk_tensor *grad_views,
            dsk_tensor *master, dsk_tensor *y, const dsk_tensor *x, dsk_tensor *dx, const dsk_tensor *dy):
       dsk_moe_opts o; memset(&o, 0, sizeof o);
       o.d_model = 512; o.n_routed = 16; o.top_k = 4; o.d_expert = 256; o.n_shared = 1;
       o.score = DSK_MOE_SIGMOID; o.n_group = 4; o.topk_group = 2;
       dsk_moe moe;
       if (dsk_moe_init(&moe, ctx, &o) != DSK_OK) return 1;     // sizes only: no parameter memory yet
       dsk_status st = DSK_OK;
       for (int i = 0; i < moe.n_params && st == DSK_OK; i++) { // name, shape, dtype, sharded, decay
           st = dsk_moe_bind(&moe, ctx, i, &value_views[i], &grad_views[i]);  // views into YOUR slabs
           if (st == DSK_OK) st = dsk_moe_init_param(&moe, ctx, i, &master[i]); // fresh values (or a checkpoint)
       }
       // for each micro-batch:
       if (st == DSK_OK) st = dsk_moe_forward(&moe, ctx, y, x, NULL);       // y (T, D) from x (T, D)
       if (st == DSK_OK) st = dsk_moe_backward(&moe, ctx, dx, dy, 1.0f);    // dx += ..., grads += ...
       if (st == DSK_OK) st = dsk_moe_stats_request(&moe, ctx);   // the step's statistics, asynchronously
       // reduce the gradients (dense ones over every data-parallel rank, expert-sharded ones over
       // the ranks holding the same experts), optimizer step, then
       if (st == DSK_OK) st = dsk_moe_update_bias(&moe, ctx, dp_comm);      // aux-loss-free balancing
       dsk_moe_stats stats;
       if (st == DSK_OK) st = dsk_moe_stats_collect(&moe, ctx, &stats);    // after the step's last sync: no wait
       dsk_moe_free(&moe, ctx);
       return st;
   End of example.

   Parameters (sizes, then bind). dsk_moe_init reports the layer's named parameters in params[]
     (name, shape, dtype, expert_sharded, weight_decay, trainable) and allocates no parameter
     memory. The caller binds a value view (and, for a trainable one, an f32 gradient view) for
     each into its own memory, typically one slab per role as llm.c does, so the layer's
     parameters take the same gradient buckets, optimizer, sharding and checkpoint path as every
     other parameter. dsk_moe_bind_slabs lays them all out in two caller slabs for callers who
     want nothing else. Names are "<name>.router", ".bias", ".w1", ".w2", ".w3", ".shared.w1",
     ".shared.w2", ".shared.w3" as before (checkpoints written before the redesign load).
   Routing (router always f32; W_r (E, D), bias b (E)):
     u = x W_r^T.  Softmax: p = softmax(u).  Sigmoid (DeepSeek-V3): p = sigmoid(u).
     Selection scores c = p + b. With n_group > 1 the experts form n_group equal groups; a group
     scores by opts.group_rule: by default DeepSeek-V3's, the sum of its two largest c (the
     layer always has its bias b; without a bias V3 takes the largest c), for either score
     function; DSK_MOE_GROUP_MAX the largest c (DeepSeek-V2); DSK_MOE_GROUP_MEGATRON the sum
     of its top_k / topk_group largest c (Megatron-Core). The topk_group best groups are kept
     (ties: lower group index) and every other expert is set to -inf. opts.node_limit = M is
     DeepSeek-V3's node-limited routing ("each token to at most M nodes", the nodes ranked by the
     sum of their top K/M affinities): the groups are the nodes of the expert-parallel group
     (ranks numbered node by node), M kept, DSK_MOE_GROUP_MEGATRON's rule; its n_group in
     checkpoints is then the number of nodes. stats.rows_off_node counts what crosses nodes.
     The top_k largest c are selected (ties: lower expert index), in descending order; that
     order is the token's slot order. Weights g_k = scale * p_k / (sum of selected p + 1e-20)
     with normalisation, g_k = scale * p_k without; the bias never enters g or its gradient.
   Non-finite input: a token whose logits u or scores c hold a NaN or an Inf (from x, W_r or b)
     has no ranking; routing gives it experts 0 .. K-1 with NaN weights (never an index out of
     range). CPU: dsk_moe_forward fails with DSK_ERR_NONFINITE naming the first such token (with
     expert parallelism on every rank of the group together); the call writes no y, counts
     nothing toward the bias update and leaves no forward for backward. CUDA: the forward does
     not stop the device to look; such a token is dispatched to no expert and counted nowhere,
     its row of y is NaN (so the loss is, and a loss scaler's non-finite check skips the step),
     and the statistics count it (stats.nonfinite, from dsk_moe_stats_collect or a forward's
     stats): the device flag the caller reads a step later.
   Experts: SwiGLU o = W2 (silu(W1 x) * (W3 x)), w1, w3 (E, F, D), w2 (E, D, F). Shared experts
     are one SwiGLU of hidden n_shared * d_shared, always added: y = sum_k g_k o_k + shared(x).
   Dispatch: the kept (token, slot) pairs, flat index t*K + k, stably counting-sorted by expert
     (dsk_group_by_key); the experts run as grouped GEMMs over those row segments
     (dsk_matmul_grouped; on CUDA a tensor-core kernel of our own that reads the offsets on the
     device: kernels/grouped.cu says why not cuBLAS's grouped GEMM); combine sums a token's
     slots in slot order (no float atomics).
   Losses (over the N tokens of a micro-batch, added to the model loss by the caller; their
     gradients enter backward scaled by its aux_scale), with p' = p for softmax and s / sum_j s_j for sigmoid:
     Switch/GShard  aux_alpha * E * sum_i f_i P_i, f_i = cnt_i / (N K), P_i = mean_t p'_ti;
     DeepSeek-V3 sequence-wise, per sequence of L = seq_len tokens (rows [q L, (q+1) L) of the micro-batch) then
                    averaged over its N / L sequences (N must be a multiple of seq_len, else DSK_ERR_ARG: no
                    partial sequences; seq_len 0: L = N): seq_aux_alpha * sum_i (E/(K L)) cnt_i * (1/L) sum_t p'_ti;
       where cnt_i counts the tokens with i among the top K of their unbiased scores p over all
       experts (opts.loss_count, default, as the V3 paper and Megatron-Core count), or among their
       actual selections (DSK_MOE_COUNT_SELECTED); counts carry no gradient;
     z-loss         z_beta * mean_t (logsumexp_j u_tj)^2.
     The micro-batch is this call's T tokens (N = T), unless a loss span says otherwise (dsk_moe_set_loss_span(m,
     group, row0, N)): the call's tokens are rows [row0, row0 + T) of a micro-batch of N rows spread over the ranks
     of group (tensor/sequence parallelism, a data-parallel group, expert parallelism: any split of the rows, a
     sequence may straddle ranks). Each rank sums its rows' parts in f64 (P_i and, per sequence, P_qi divided by N or
     L, the counts as exact integers, the sum of lse^2) and an all-reduce (SUM) of 2E + 2 (N/L) E + 4 doubles over
     group (on the CPU in two: the 4 of the span check first) gives every rank the micro-batch's sums. So the loss
     values are the micro-batch's, the same bits on every rank of the group (a stats' loss is the group's value:
     average it over the group, never sum it), and a rank's backward gives the gradient of that loss through its own
     rows (coefficients alpha E f_i / N of the global counts, and z_beta 2 lse / N per token): the gradients summed
     over the group are those of one rank holding every row (the coefficients bit for bit, as they come from exact
     counts; the loss values to f64 rounding, as the partial sums add in another order). A trainer that averages
     gradients over the group instead of summing them passes aux_scale times the group's size. The forward checks
     that the rows lie in the span (row0 + T <= N; without a group, T = N and row0 0) and, on the CPU, that the span
     is consistent over the group: every rank's N the same and their T adding up to N (by the first all-reduce, so
     every rank of the group fails together, with DSK_ERR_ARG naming the values, having computed and counted nothing,
     the group still usable; ranks outside the group, e.g. an expert-parallel peer, then time out in their next
     collective). CUDA: one all-reduce and no look from the host: rows that do not add up to N make the loss values
     and coefficients NaN (the loss is, the router's gradients are: a loss scaler's non-finite check skips the step);
     an N that differs between ranks sizes their exchanges differently, which NCCL cannot tell (it hangs until the
     communicator's timeout). Without a span, or with a span of the call's own rows, the bits are those of the call
     alone. The sums run in f64 in a fixed order on both devices (the same code): CPU and CUDA agree.
   Routing record and replay: dsk_moe_routing copies the current slot's forward's decisions, each token's
     K experts in slot order ((T, K) i32 on the host); dsk_moe_forward_replay takes such decisions
     instead of selecting (no group limit, no bias in the choice): the weights g come from the
     current scores p of the given experts by the formula above (so a recorded routing replayed on
     the same input and parameters gives the same bits), the gradients flow through p as with
     selection, and capacity, the losses (DSK_MOE_COUNT_SELECTED counts the replayed experts) and
     the bias-update loads take the replayed experts. For reinforcement learning (recompute the
     log-probabilities of a rollout with its routing) and for tests whose layouts must take the
     same decisions (a near-tie decided differently by another summation order flips an expert).
     Expert parallelism: each rank replays its own tokens. CUDA: the decisions are copied to the
     device (no sync, but a copy from pageable host memory: not inside a CUDA graph capture); a
     token whose routing is not finite keeps its NaN weights and the recorded experts of such a
     token are 0 .. K-1.
   Capacity (capacity_factor > 0): C = ceil(T K / E * capacity_factor) slots per expert from this
     rank's tokens; the rest are dropped (lowest weight first, or latest position first) and
     contribute zero. Default: dropless.
   Expert parallelism (opts.ep with P ranks): rank r holds experts [r E/P, (r+1) E/P); each rank
     routes its own tokens, sends rows by all-to-all-v (counts first), the owners compute and
     send the outputs back; backward runs the reverse exchanges. Every rank must call forward
     and backward together (collectives). CPU layers take a host-backend communicator, CUDA
     layers an nccl one. On CUDA the counts exchange keeps one host sync per forward: NCCL's
     all-to-all-v takes its row counts on the host, and sizing the exchange by the exact counts
     moves P times fewer bytes than a bounded buffer of T*K rows per peer (see bench/RESULTS.md).
     Backward reuses the forward's counts and does not sync. opts.ep_exchange = DSK_MOE_EP_BOUNDED
     trades those bytes for the sync: each rank sends each peer a fixed block of Cp = T min(K, E/P)
     rows (E/P * C under capacity C, when fewer; the same T on every rank), its kept rows for the
     peer's experts then zero rows, with the local expert of each row beside it (a fixed-size
     all-to-all of int32); the receiver sorts the rows by local expert on the device (stable: each
     expert's rows by source rank, then in the source's order, as the exact exchange places them),
     so nothing comes back to the host and the results are the exact exchange's bits.
     Overlap (opts.ep_overlap 1; off by default: on the host it pays where the link is slower than the
     compute, bench/RESULTS.md): the exchange's all-to-all-v begun (dsk_comm_all_to_all_v_start: the
     messages the shared-memory rings or the sockets take leave at once) and finished at the wait, or on a
     second thread when the transport left bytes unsent (the flat exchange of activation rows; chunked,
     the layer moves it on between its chunks instead; a thread for every exchange cost more over shared
     memory than it hid); the other host
     exchanges on a second thread (host backend); or a stream of the layer's own that
     waits for an event on the layer's stream and that the layer's stream waits for in turn (CUDA, no
     host wait, so a bounded step stays a CUDA graph: the graph holds the fork and the join), runs each
     exchange while the layer computes what does not wait on it: the shared experts during the
     forward's dispatch and the backward's, the router's backward while the expert gradients travel
     back. The same bits as serial (each result's arithmetic is unchanged; only independent steps
     move). Chunked dispatch
     (opts.ep_chunk: ON where it applies: ep_overlap, the flat exchange, exact or bounded, or on the host two
     hops, of activation rows, ACT experts, on the host the default ISA's row kernels; AUTO, the default, where
     the ep group spans nodes and routes flat (two hops below), as over one node's shared memory the exchange is
     short and the chunks' smaller GEMMs cost more than it hides; ON pays where the link is slower than the
     compute: on an emulated 0.1 GB/s link it hid the most of every overlap, bench/RESULTS.md): the rank's
     own rows need no transport, so the exchange begun carries only the other ranks' rows while the routed
     experts compute the own ones (forward: their MLP; backward: the input gradient of the output gradients'
     own rows), then each other rank's rows as they land: between chunks the layer moves the exchange on
     (dsk_comm_progress, which says whose messages are whole); no thread (stats.ep_chunks counts the
     chunks). A rank's rows land one after another in the exchange's order, its local experts' segments in
     turn, so a chunk is one grouped call over them (each grouped GEMM one launch on CUDA, whatever
     n_local), its results in that order too: the return sends them as they are, and after the last chunk
     one gather a buffer puts the saved forward (inputs, h1, h3, a) and the backward's output gradients,
     dh1 and dh3 expert-major, as serial leaves them (the backward fetches a chunk's h1 and h3 from there).
     The results go back in one exchange begun after the last chunk (forward: at dsk_moe_return_begin or
     the end; backward: the weight gradients compute while it travels). A row's results have the same bits
     whatever rows share its GEMM (dsk_matmul's rows contract) and whatever order the chunks run in, and the
     weight gradients, sums over rows, run once over whole expert-major segments after the last chunk: the
     serial bits. On CUDA, where NCCL's grouped all-to-all completes as one, the other ranks' rows go as
     P - 1 ring shifts on the exchanges' stream (shift s: to rank me + s, from me - s; every rank in the
     same order), each followed by an event; the layer's stream computes its own rows, then waits for each
     shift's event (the host does not wait) and runs that rank's chunk (offsets on the device, uploaded once
     a call), forward and backward: the serial path's kernels on the same rows, so its bits (tests: 2 and 4
     emulated GPUs, dropless and capacity, and the trainer's bf16 run). P - 1 collectives and P chunks'
     launches (forward 4 a chunk, backward 8) where serial has one of each, and the shifts run one peer pair
     at a time where NCCL's grouped all-to-all moves every pair at once: a CUDA layer chunks when asked
     (ON), not by AUTO, until a GPU measurement says where it pays. The bounded exchange chunks alike, a
     rank's rows its block of Cp (its local experts' segments in turn, the padding last): each block's
     segments come from the keys the forward received, on the device (a binary search each), so a chunked
     bounded step makes no host sync either and stays a CUDA graph; a CUDA layer, not knowing where a
     block's padding begins, runs a chunk's gathers and SwiGLU gradient over the whole block (the GEMMs stop
     at the segments' end; the padding's results are never read). Chunking takes (R, 5 F) of scratch in
     the activation dtype (DSK__MOE_CH_*) beside the serial path's buffers.
     Routes across nodes (opts.ep_route): FLAT sends a row per kept (token, expert) to the expert's rank in
     one all-to-all-v; TWO_HOP sends each token's row once to every node holding one of its kept experts (to
     the rank with this rank's node_rank there, which copies it to its slots on that node: dsk_moe_route,
     DeepSeek-V3 / DeepEP), with the token's routing beside it (2K int32 per row crossing, once a forward), for
     the forward's dispatch and backward's rows to the experts (dy, scaled by the gates at the receiver: the
     sender's product g * dy); the outputs and input gradients come back one row per slot. The same bits as
     flat (tests: dropless, capacity, node-limited; CPU ranks and emulated GPUs). AUTO (the default) takes two
     hops where the ep group spans several nodes and they can run: the exact exchange, ep_dispatch ACT, nodes
     of one size, a CPU layer; TWO_HOP asked for where they cannot fails init with DSK_ERR_UNSUPPORTED naming
     the reason. A CUDA layer takes them when asked (TWO_HOP), not by AUTO: the route is planned on the host
     each forward (the kept order and gates come back, the route's own setup exchanges its counts through
     host memory: about 20 host syncs a forward at 4 ranks against the flat route's 1), which costs more
     than it saves until the plan moves to the device. ep_overlap moves two-hop exchanges to its thread or
     stream as it does flat ones. ep_chunk ON chunks them on the host: the route, which lands every rank's rows
     at once (a node's come through its relay as one message), runs whole on the thread while the experts
     compute this rank's own rows, copied from its send rows as the flat path does; the route's rows are then
     placed in the flat exchange's order (by source rank, each its local experts' segments: the index XI and
     the gates XG, made once a forward from both orders' regroup indices), each other rank's a chunk, and the
     results go back from that order (YI). AUTO does not chunk two hops: at 4 ranks on 2 emulated hosts over 2
     cores the route's thread and the chunks' compute shared the cores and the step took 1.9-9.4 ms longer in
     five runs of six; at 2 ranks, one a core, it was 1.0-2.2 ms shorter in all five (bench/RESULTS.md).
     stats.bytes_off_node counts the bytes of rows each rank's exchanges send to other nodes (flat and bounded
     too), stats.rows_off_node the dispatch's rows (two hops: token rows).
     FP8 dispatch (opts.ep_dispatch = DSK_MOE_DISPATCH_FP8, DeepSeek-V3's): the forward's kept
     rows are quantised in 1x128 tiles (dsk_amp_fp8_block_quantize: scale amax / 448, e4m3 codes;
     a tile with an Inf or a NaN dequantises to NaN) and the codes and scales go by two
     all-to-all-v; the experts' ranks dequantise them into the activation dtype and the experts
     (and their weight gradients) read those values. The combine, and backward's exchanges, stay
     in the activation dtype; backward passes the input gradient straight through the rounding.
     stats.dispatch_bytes and combine_bytes count the forward's two exchanges per rank.
     With FP8 experts the received codes and scales are the experts' input as they come.
     The recipe of a data-parallel step with EP (W ranks in all, EP groups of P, each expert held
     by the W/P ranks of equal ep rank, its "replica group"; each rank's loss the mean over its
     own tokens, the step's loss their mean over W; balancing losses over more than a rank's own
     tokens take a loss span, see "Losses"):
       replicated gradients (router, shared experts, the rest of the model; the bias has none): mean over
         all W ranks (all-reduce SUM / W, or AVG);
       expert-sharded gradients (params[].expert_sharded: w1 w2 w3): SUM over the replica group
         (W/P ranks), then / W: each rank's expert gradient already sums the tokens of its whole
         EP group, so the replica sum holds every token of the world once;
       dsk_moe_update_bias(m, ctx, comm): comm = all W ranks (every rank routes its own tokens,
         and the bias must stay equal on all of them); a pipeline passes the ranks of its stage;
       mixed-precision statistics: the replicated gradients are equal on every rank and must
         count once, the expert-sharded ones differ across the EP group and count once per
         group member: dsk_moe_amp_unscale (with dsk_amp.h) unscales both lists and leaves
         (found_inf, sumsq) = stats(replicated) + SUM over ep of stats(sharded) in the scaler, the
         same on every rank; one all-reduce SUM of every rank's stats over the world would count
         the replicated ones W times.
   FP8 experts (opts.expert_gemm = DSK_MOE_GEMM_FP8, DeepSeek-V3's recipe; needs dsk_amp.h): every
     GEMM of the routed experts (dsk_matmul_fp8_grouped over the segments, offsets on the device) and
     of the shared ones (dsk_matmul_fp8) runs in block-scaled e4m3 with f32 accumulation: forward
     h = x w^T, input gradient dx = dh w, weight gradient dw += dh^T x. Activations and output
     gradients in 1x128 tiles, weights in 128x128 blocks per expert (quantised from the compute copy
     at each use), the weight gradient's two operands quantised along the tokens (the chunks on the
     grid of 128 from the first expert row, so a tile may span two experts' rows). The GEMMs' inputs
     that backward needs, the experts' rows x and silu(h1) h3 of routed and shared experts, are kept
     as e4m3 codes with their f32 scales instead of in the activation dtype (a row's codes are the
     same whether it is quantised before or after the gather or the FP8 dispatch); h1 and h3 stay
     in the activation dtype for the SwiGLU's backward; router, gating, combine and losses are
     unchanged. A NaN or Inf reaches every output that reads its tile or block. Forward outputs and
     dx are row-local: with expert parallelism they are one rank's bits; the weight gradients' tiles
     along the tokens follow each rank's rows. dsk_moe_reserve(_bytes) counts the caches and the
     scratch (one set per layer: the widest projection's weights, an output gradient in both layouts,
     an input's transpose).
   Devices: one pipeline for both. The same sequence of calls runs on either device (dsk_tensor
     ops; the MoE-specific steps run a CPU loop or a CUDA kernel over the same DSK_HD functions
     below), with one buffer registry. Activations are f32 on the CPU (a bf16 layer converts x and
     its weights once per call and rounds y and dx; the CPU is the reference) and in the layer's
     dtype on CUDA (f32 accumulation in every GEMM). On CUDA a forward and backward without
     expert parallelism make no synchronising call and no device-to-host copy (ctx->counters
     proves it): routing, counts, offsets (a device prefix sum), the dispatch permutation, the
     capacity decisions, the losses and the bias-update counts stay on the device; buffers are
     sized by bounds (T*K routed rows) and the grouped GEMM reads its segment offsets there. So a
     whole training step can be captured as a CUDA graph (dsk_moe_reserve first, so that the
     captured calls allocate nothing). Statistics come back asynchronously
     (dsk_moe_stats_request / dsk_moe_stats_collect: a pinned buffer and an event).
   License: MIT, see the end of the file. */

/* Contents
     declarations
       options                   dsk_moe_score, dsk_moe_norm, dsk_moe_group_rule, dsk_moe_loss_count, dsk_moe_drop,
                                 dsk_moe_router, dsk_moe_opts
       the layer                 dsk_moe_param, dsk_moe_config, dsk_moe_stats, dsk_moe, dsk_moe_init/bind/bind_slabs/
                                 init_param/init_params/reserve(_bytes)/free/find_param/set_loss_span/forward/
                                 forward_replay/routing/backward/zero_grad/update_bias(_unless)/stats_request/
                                 stats_collect/config_get/config_check, dsk_moe_amp_unscale (with dsk_amp.h)
       expert-parallel routes    dsk_moe_route_opts, dsk_moe_route, dsk_moe_route_init/dispatch/combine/free
       per-token routing math    dsk_moe_route_token, dsk_moe_route_token_backward
       the rest of the MoE math  losses, capacity, combine, gate gradient, bias update (DSK_HD: CPU and CUDA)
       CUDA launchers            (DSK_CUDA) dsk_cuda_moe_*: kernels/moe.cu
     implementation (DSK_MOE_IMPLEMENTATION)
       state and buffer registry; options and init; parameters; MoE steps (CPU loops, CUDA launchers);
       expert-parallel routes; expert-parallel exchange; forward; backward; statistics and bias;
       configuration in checkpoints; mixed-precision statistics under EP; public entry points */
/* With DSK_STATIC every dsk function is static, so this file must also compile its dependencies. */
#if defined(DSK_STATIC) && defined(DSK_MOE_IMPLEMENTATION)
#ifndef DSK_TENSOR_IMPLEMENTATION
#define DSK_TENSOR_IMPLEMENTATION
#endif
#ifndef DSK_COMM_IMPLEMENTATION
#define DSK_COMM_IMPLEMENTATION
#endif
#endif
#ifndef DSK_MOE_H
#define DSK_MOE_H
#include "dsk_tensor.h"
#include "dsk_comm.h" /* expert parallelism */
DSK__FP_EXACT_BEGIN
#ifdef __cplusplus
extern "C" {
#endif

/* ---- options */

typedef enum dsk_moe_score { DSK_MOE_SOFTMAX = 0, DSK_MOE_SIGMOID = 1 } dsk_moe_score;
/* Normalisation of the selected weights; the default is on for sigmoid, off for softmax. */
typedef enum dsk_moe_norm { DSK_MOE_NORM_DEFAULT = 0, DSK_MOE_NORM_ON = 1, DSK_MOE_NORM_OFF = 2 } dsk_moe_norm;
/* How group-limited routing scores a group from its experts' selection scores c = p + b. */
typedef enum dsk_moe_group_rule {
    DSK_MOE_GROUP_DEEPSEEK_V3 = 0, /* DeepSeek-V3's reference Gate (inference/model.py): the sum of the two largest
                                      c when there is a bias, the largest c without one, for either score function */
    DSK_MOE_GROUP_MAX = 1,         /* the largest c (DeepSeek-V2's group-limited greedy routing) */
    DSK_MOE_GROUP_MEGATRON = 2     /* Megatron-Core's group_limited_topk: the sum of the top_k / topk_group
                                      (integer division) largest c, bias or not (V3's shape, top-8 from 4 kept
                                      groups, sums 2 like V3; other shapes differ) */
} dsk_moe_group_rule;
/* What the balancing losses count as expert i's load (f_i); the bias update always counts the
   actual selections. */
typedef enum dsk_moe_loss_count {
    DSK_MOE_COUNT_TOPK = 0,    /* the published rule (DeepSeek-V3 paper's sequence-wise loss, Megatron-Core's
                                  compute_routing_scores_for_aux_loss): i among the plain top-K of the token's
                                  unbiased scores over all experts */
    DSK_MOE_COUNT_SELECTED = 1 /* i among the token's actual selections, after the bias and the group limit */
} dsk_moe_loss_count;
/* Which slots capacity mode drops: the lowest routing weights, or the latest tokens. */
typedef enum dsk_moe_drop { DSK_MOE_DROP_PROB = 0, DSK_MOE_DROP_POSITION = 1 } dsk_moe_drop;
/* What the forward's expert-parallel dispatch sends: rows in the activation dtype, or e4m3 codes
   with 1x128 f32 scales (DeepSeek-V3), dequantised to the activation dtype by the receiver. */
typedef enum dsk_moe_dispatch { DSK_MOE_DISPATCH_ACT = 0, DSK_MOE_DISPATCH_FP8 = 1 } dsk_moe_dispatch;
/* How the experts (routed and shared) run their GEMMs: in the activation dtype, or block-scaled FP8
   (DeepSeek-V3's recipe, see "FP8 experts" above). */
typedef enum dsk_moe_expert_gemm { DSK_MOE_GEMM_ACT = 0, DSK_MOE_GEMM_FP8 = 1 } dsk_moe_expert_gemm;
/* How expert parallelism sizes its row exchange (see "Expert parallelism" above). */
typedef enum dsk_moe_ep_exchange {
    DSK_MOE_EP_EXACT = 0,  /* rows sized by the exchanged counts: the fewest bytes; CUDA: one host sync a forward */
    DSK_MOE_EP_BOUNDED = 1 /* a fixed block of rows per peer (the worst case), the counts on the device: no host
                              sync (CUDA graphs), more bytes */
} dsk_moe_ep_exchange;
/* How expert parallelism's rows cross nodes (see "Expert parallelism" above). */
typedef enum dsk_moe_ep_route {
    DSK_MOE_ROUTE_AUTO = 0,   /* two hops when the ep group spans several nodes and a CPU layer can (TWO_HOP's
                                 conditions), else flat (CUDA: flat) */
    DSK_MOE_ROUTE_FLAT = 1,   /* one all-to-all-v of the kept rows: a row per (token, expert) to the expert's rank */
    DSK_MOE_ROUTE_TWO_HOP = 2 /* token rows through a two-hop dsk_moe_route: once to each node holding one of the
                                 token's experts, then inside it; needs the exact exchange, ep_dispatch ACT,
                                 expert_gemm ACT and nodes of one size */
} dsk_moe_ep_route;
/* Chunked dispatch (see "Overlap" above): whether the routed experts start on the rows that need no transport. */
typedef enum dsk_moe_ep_chunk {
    DSK_MOE_CHUNK_AUTO = 0, /* ON where a CPU layer's ep group spans nodes and routes flat (ep_route AUTO routes
                               there in two hops, which AUTO does not chunk); over one node's shared memory the
                               chunks' smaller GEMMs cost more than the short exchange they hide
                               (bench/RESULTS.md); CUDA: OFF */
    DSK_MOE_CHUNK_OFF = 1,  /* the experts wait for every row */
    DSK_MOE_CHUNK_ON = 2    /* where it applies: ep_overlap, the flat exchange (exact or bounded) or a CPU
                               layer's two hops, of activation rows, ACT experts */
} dsk_moe_ep_chunk;

/* The routing configuration: what every MoE step of the math below takes instead of positional
   flags (the layer resolves it from its options into dsk_moe.routing). A new score function is
   a new enum value here and a case in dsk_moe_route_token / dsk_moe_route_token_backward. */
typedef struct dsk_moe_router {
    int n_experts;          /* E */
    int top_k;              /* K, 1 <= K <= E */
    dsk_moe_score score;    /* softmax or sigmoid */
    int norm;               /* 1: the selected weights are normalised to sum 1 (before the scale) */
    float scale;            /* routed_scale */
    int n_group;            /* groups of E / n_group experts (1: no group limit) */
    int topk_group;         /* groups kept per token, 1 <= topk_group <= n_group */
    dsk_moe_group_rule group_rule; /* how a group scores (with DSK_MOE_GROUP_MEGATRON: top_k >= topk_group) */
} dsk_moe_router;

/* Zero fields take the defaults in brackets. */
typedef struct dsk_moe_opts {
    const char *name;        /* parameter name prefix ["moe"]: "moe.w1", "moe.shared.w2", ... */
    int64_t d_model;         /* D, required */
    int n_routed;            /* E routed experts, required */
    int top_k;               /* K experts per token, required, 1 <= K <= E */
    int64_t d_expert;        /* F, hidden size of a routed expert, required */
    int n_shared;            /* shared experts [0] */
    int64_t d_shared;        /* hidden size of one shared expert [d_expert] */
    dsk_moe_score score;     /* [DSK_MOE_SOFTMAX] */
    dsk_moe_norm norm;       /* [on for sigmoid, off for softmax] */
    float routed_scale;      /* multiplies the routed weights [1] */
    int n_group;             /* expert groups for group-limited routing [1]; must divide E */
    int topk_group;          /* groups kept per token [n_group] */
    dsk_moe_group_rule group_rule; /* [DSK_MOE_GROUP_DEEPSEEK_V3]; the layer always has its bias, so this ranks
                                      groups by their two largest c */
    float aux_alpha;         /* Switch/GShard auxiliary loss coefficient [0] */
    float seq_aux_alpha;     /* DeepSeek-V3 sequence-wise auxiliary loss coefficient [0] */
    int64_t seq_len;         /* sequence length of the sequence-wise loss [T of each call]: each call's T must
                                then be a multiple of it (whole sequences, as DeepSeek-V3 and Megatron-Core
                                take them); the Switch and z losses do not use it */
    float z_beta;            /* router z-loss coefficient [0] */
    dsk_moe_loss_count loss_count; /* what the Switch and sequence-wise losses count [DSK_MOE_COUNT_TOPK] */
    float bias_rate;         /* aux-loss-free bias update rate gamma [1e-3] */
    int bias_recenter;       /* 1: re-centre the bias to mean 0 after each update [0] */
    float capacity_factor;   /* [0 = dropless] */
    dsk_moe_drop drop;       /* [DSK_MOE_DROP_PROB] */
    dsk_dtype dtype;         /* parameters, x, y, dx, dy: DSK_F32 or DSK_BF16 [DSK_F32] */
    dsk_comm *ep;            /* expert-parallel group [NULL = every expert local] */
    dsk_moe_dispatch ep_dispatch; /* [DSK_MOE_DISPATCH_ACT] the forward's token rows on the wire (with ep only;
                                     FP8 needs dsk_amp.h included before this file in the implementation) */
    dsk_moe_ep_exchange ep_exchange; /* [DSK_MOE_EP_EXACT]; BOUNDED needs the same T on every rank of the group and
                                        ep_dispatch ACT */
    dsk_moe_expert_gemm expert_gemm; /* [DSK_MOE_GEMM_ACT]; FP8 needs dsk_amp.h included before this file in the
                                        implementation */
    int ep_overlap;                  /* 1: each expert exchange runs beside what the layer computes that does not
                                        wait on it (forward: the shared experts; backward: the shared experts,
                                        the router): host backend begun and finished around it, or on a
                                        second thread (see above), CUDA on a stream of the layer's own, ordered
                                        by events (no host wait); the same bits as serial
                                        [0: serial] */
    dsk_moe_ep_route ep_route;       /* [DSK_MOE_ROUTE_AUTO]; resolved by init to FLAT or TWO_HOP */
    dsk_moe_ep_chunk ep_chunk;       /* [DSK_MOE_CHUNK_AUTO] chunked dispatch and return (with ep_overlap); the
                                        same bits */
    int node_limit;                  /* M > 0: each token's experts on at most M nodes of ep (DeepSeek-V3's node-limited
                                routing): group-limited routing with the ep group's nodes as the groups, ranked by
                                the sum of their top_k / M largest c (DSK_MOE_GROUP_MEGATRON's rule) [0: none];
                                ep's ranks numbered node by node, n_group and topk_group left 0 */
    float init_std;          /* dsk_moe_init_param: weights ~ N(0, init_std) [0.02] (router, experts, shared) */
    uint64_t seed;           /* dsk_moe_init_param's stream [0]; expert e gets the same numbers at any EP size */
} dsk_moe_opts;

/* ---- the layer */

/* A named parameter: what dsk_moe_init reports, and the views the caller binds. */
typedef struct dsk_moe_param {
    char name[96];           /* "<prefix>.w1" */
    int ndim;
    int64_t shape[3];        /* this rank's shape (expert-sharded: n_local experts on dim 0) */
    dsk_dtype dtype;         /* of the value: router and bias f32, the rest opts.dtype */
    int expert_sharded;      /* 1: experts [expert0, expert0 + n_local) of n_routed on dim 0 (w1 w2 w3): their
                                gradients reduce over the ranks holding the same experts; 0: replicated */
    int weight_decay;        /* 1: a matrix (weight decay applies), 0: the bias */
    int trainable;           /* 1: has a gradient; 0: the expert bias (dsk_moe_update_bias changes it) */
    dsk_tensor value;        /* bound by the caller (data NULL until then) */
    dsk_tensor grad;         /* f32, bound by the caller for a trainable parameter */
} dsk_moe_param;

#define DSK_MOE_N_PARAMS 8
#define DSK_MOE_MAX_SLOTS 4096 /* saved forwards a layer keeps at most (dsk_moe_set_slots) */
/* params[] indices (the shared experts exist when n_shared > 0: n_params 8, else 5). */
enum { DSK_MOE_P_ROUTER = 0, DSK_MOE_P_BIAS, DSK_MOE_P_W1, DSK_MOE_P_W2, DSK_MOE_P_W3, DSK_MOE_P_SW1, DSK_MOE_P_SW2,
       DSK_MOE_P_SW3 };

/* The layer's configuration as key/value strings for a checkpoint's metadata: "<prefix>.<option>"
   = its resolved value, for every option that shapes the parameters or the math (not ep, seed,
   init_std, name: a checkpoint may resume at another layout). */
#define DSK_MOE_CONFIG_MAX 24
typedef struct dsk_moe_config {
    int n;
    char key[DSK_MOE_CONFIG_MAX][96];
    char value[DSK_MOE_CONFIG_MAX][32];
} dsk_moe_config;

/* Statistics: of one forward (dsk_moe_forward's stats) or summed over the forwards since the
   previous request (dsk_moe_stats_collect). Counts are over the EP group; losses are the loss span's (the
   micro-batch's value, the same on every rank of the span's group; without a span this call's). */
typedef struct dsk_moe_stats {
    int64_t calls;                    /* forwards summed (1 for a forward's own stats) */
    int64_t tokens;                   /* tokens over the EP group */
    int64_t slots;                    /* routed (token, expert) pairs over the EP group, T*K summed */
    int64_t dropped;                  /* slots dropped by capacity over the EP group */
    int64_t nonfinite;                /* tokens with NaN/Inf routing (CUDA; the CPU fails the forward) */
    int64_t rows_off_node;            /* expert parallelism: rows this rank's dispatch sent to ranks on other
                                         nodes (exact: its kept rows; bounded: the whole blocks; two hops: token
                                         rows, once per other node); bytes_off_node counts every exchange */
    const int64_t *tokens_per_expert; /* (E) slots each expert was selected for, EP group; owned by the layer */
    double max_load, mean_load;       /* max and mean of tokens_per_expert */
    double aux_loss, seq_aux_loss, z_loss; /* the loss span's loss terms (coefficients included) */
    double loss;                      /* their sum: add it to the model loss */
    uint64_t dispatch_bytes;          /* EP: bytes this rank handed to the forward's dispatch all-to-all (its kept rows,
                                         its own experts' included: n D act bytes, or n (D + 4 ceil(D / 128)) FP8) */
    uint64_t combine_bytes;           /* EP: bytes handed to the forward's combine all-to-all (R D act bytes) */
    uint64_t bytes_off_node;          /* EP: bytes of rows this rank's exchanges sent to ranks on other nodes: a
                                         forward's stats its dispatch and combine, collected ones every forward's and
                                         backward's since the request (two hops: with the 8K bytes of routing of
                                         each token row the forward sends across; the counts exchange not counted) */
    int64_t ep_chunks;                /* EP chunked dispatch (opts.ep_chunk), a forward's own stats: the chunks its
                                         routed experts ran in (this rank's own rows, then each other rank's as they
                                         landed: the EP size); 0 unchunked */
} dsk_moe_stats;

struct dsk__moe_state;

typedef struct dsk_moe {
    dsk_moe_opts opts;        /* resolved: every default filled in */
    dsk_moe_router routing;   /* the router's configuration, from opts */
    int64_t d_shared_total;   /* n_shared * d_shared */
    int ep_rank, ep_size;     /* 0, 1 without expert parallelism */
    int n_local;              /* experts on this rank: E / ep_size */
    int expert0;              /* first local expert */
    dsk_device device;
    dsk_moe_param params[DSK_MOE_N_PARAMS];
    int n_params;
    /* shortcuts into params[] */
    dsk_moe_param *router, *bias, *w1, *w2, *w3, *sw1, *sw2, *sw3;
    struct dsk__moe_state *st; /* saved activations, workspace, device statistics */
    int eval;                 /* 1: forward passes count toward neither the bias update nor the collected
                                 statistics (validation, generation); set and clear it around them [0] */
} dsk_moe;

/* Validates opts and reports the parameters (params[], unbound) of a layer on ctx's device
   (ctx NULL = CPU); allocates its workspace registry and device statistics, no parameters. */
DSK_API dsk_status dsk_moe_init(dsk_moe *m, dsk_ctx *ctx, const dsk_moe_opts *opts);
DSK_API void dsk_moe_free(dsk_moe *m, dsk_ctx *ctx); /* zeroed/freed ok; never frees bound memory */
/* Binds parameter `index`: value with the parameter's shape and dtype, grad f32 of that shape
   (NULL for the bias; required for a trainable parameter), both contiguous on the layer's
   device. The layer keeps views; the memory stays the caller's and must outlive the binding.
   Saved forwards stay: a backward reads the views bound when it runs, so between a forward and
   its backward rebind only the same values (ZeRO-3's parameters gathered again elsewhere). */
DSK_API dsk_status dsk_moe_bind(dsk_moe *m, dsk_ctx *ctx, int index, const dsk_tensor *value, const dsk_tensor *grad);
/* Sizes for dsk_moe_bind_slabs: value bytes (parameters in params[] order, each 256-byte
   aligned) and f32 gradient elements (dense parameters first, then the expert-sharded ones). */
DSK_API void dsk_moe_slab_sizes(const dsk_moe *m, int64_t *value_bytes, int64_t *grad_dense, int64_t *grad_sharded);
/* Binds every parameter into two caller slabs on the layer's device: values (u8, value_bytes)
   and grads (f32, grad_dense + grad_sharded elements). */
DSK_API dsk_status dsk_moe_bind_slabs(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *values, dsk_tensor *grads);
/* dst (parameter index's shape, any float dtype, on the layer's device) <- its initial values:
   N(0, init_std) from opts.seed at offset 2^40 * s (s = 0 router, 1 w1, 2 w2, 3 w3, 4 shared.w1,
   5 shared.w2, 6 shared.w3) + the element's global position (an expert gets the same numbers at
   any EP size), zeros for the bias. */
DSK_API dsk_status dsk_moe_init_param(dsk_moe *m, dsk_ctx *ctx, int index, dsk_tensor *dst);
/* dsk_moe_init_param into every bound value. */
DSK_API dsk_status dsk_moe_init_params(dsk_moe *m, dsk_ctx *ctx);
/* Allocates the workspace for calls of up to max_tokens tokens now, so later forwards and
   backwards allocate nothing (before a CUDA graph capture). Expert parallelism sizes its
   received rows per call. Set the loss span first: its total_rows size the losses' buffers. */
DSK_API dsk_status dsk_moe_reserve(dsk_moe *m, dsk_ctx *ctx, int64_t max_tokens);
/* The bytes dsk_moe_reserve(m, ctx, max_tokens) allocates, computed by the same sizes without
   allocating: with rows < 0 its expert rows (T K under expert parallelism, the capacity bound
   without), else `rows` expert rows (the worst case of dropless expert parallelism: every
   token of the ep group routed to this rank's experts, ep T K); act: the activations' dtype
   (f32 on the CPU, the layer's dtype on CUDA). */
DSK_API dsk_status dsk_moe_reserve_bytes(const dsk_moe *m, int64_t max_tokens, int64_t rows, dsk_dtype act,
                                         int64_t *bytes);
/* The parameter named `name` (full name, e.g. "moe.w1"), or NULL. */
DSK_API dsk_moe_param *dsk_moe_find_param(dsk_moe *m, const char *name);
/* The loss span of the forwards that follow (see "Losses"), until set again: their T rows are rows
   [row0, row0 + T) of a micro-batch of total_rows tokens spread over the ranks of `group`, each rank calling
   forward with its own disjoint rows (together all of them) and the same total_rows; the balancing losses are the
   micro-batch's, as one rank holding every row computes them. group: host backend for a CPU layer, nccl for a
   CUDA one; every rank of it calls forward together (an all-reduce of the losses' partial sums, when a loss is
   on), eval forwards included. group NULL: this rank holds the whole micro-batch (row0 0, total_rows = the
   call's T). group NULL and total_rows 0: no span, each call its own micro-batch (the default). DSK_ERR_ARG for
   row0 < 0, total_rows < 0, row0 > total_rows or a group that is not initialised; DSK_ERR_UNSUPPORTED for a
   group on the other backend; the forward checks the rest (see "Losses"). Changes nothing on failure. */
DSK_API dsk_status dsk_moe_set_loss_span(dsk_moe *m, dsk_comm *group, int64_t row0, int64_t total_rows);
/* Saved forwards (pipeline schedules, several micro-batches in flight through one layer): the layer
   keeps n forwards for their backwards [1], one in each slot 0 .. n-1; dsk_moe_use_slot picks the
   slot the forwards and backwards that follow save into and differentiate. A micro-batch's forward
   and backward in its own slot give the bits they give with one slot, run back to back (the
   weight gradients sum in the order the backwards run). Each slot holds its own copy of what a
   forward keeps (dsk_moe_reserve_bytes counts them all); the workspace the calls only pass
   through is the layer's, once. Set before dsk_moe_reserve (which sizes every slot). The current
   slot stays, or becomes 0 when it is dropped. DSK_ERR_ARG for n outside 1 .. DSK_MOE_MAX_SLOTS;
   DSK_ERR_STATE when a dropped slot holds a forward no backward has used; DSK_ERR_OOM. Changes
   nothing on failure. */
DSK_API dsk_status dsk_moe_set_slots(dsk_moe *m, dsk_ctx *ctx, int n);
/* Slot `slot` for the forwards and backwards that follow (DSK_ERR_ARG outside 0 .. n-1). */
DSK_API dsk_status dsk_moe_use_slot(dsk_moe *m, int slot);
/* A forward or backward in two calls, so that the caller computes something else while the layer's tokens travel
   (overlap across micro-batches: another micro-batch's attention, another layer's backward): dsk_moe_forward_begin
   routes x, computes the balancing losses and gathers the rows, and under expert parallelism starts their dispatch
   (in flight under ep_overlap: begun on the host, on its thread or stream; without ep_overlap it runs in the begin);
   dsk_moe_forward_end computes the shared and routed experts, brings the outputs back and writes y.
   dsk_moe_backward_begin / _end split a backward alike at the exchange of the rows' gradients. The pair gives the
   bits of dsk_moe_forward (dsk_moe_backward), which is its begin and end in one call. In between, the layer takes no
   other call but its end (DSK_ERR_STATE: forward, backward, reserve, bind, dsk_moe_set_slots, dsk_moe_use_slot);
   other layers run as they like, except that two exchanges must not be in flight on one communicator at once: end
   one layer's before beginning another's on the same expert-parallel group. x, dy and the tensors they alias must
   stay unchanged until the end. An end with a bad y (dx) fails with DSK_ERR_ARG and leaves the begun call pending; a
   begin or end that fails otherwise leaves none (the exchange joined). dsk_moe_free waits for an exchange in
   flight. */
DSK_API dsk_status dsk_moe_forward_begin(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *x);
DSK_API dsk_status dsk_moe_forward_end(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *y, dsk_moe_stats *stats);
DSK_API dsk_status dsk_moe_backward_begin(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *dy, float aux_scale);
DSK_API dsk_status dsk_moe_backward_end(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *dx);
/* Steps between a begin and its end, for callers that interleave two calls' exchanges on one expert group
   (one micro-batch's dispatch travels while another's experts compute, and its return while the first's
   experts compute; overlap across micro-batches): dsk_moe_experts computes the begun call's shared and
   routed experts (forward) or their backward, once the rows have arrived; dsk_moe_return_begin starts the
   experts' results back to their tokens' ranks (in flight under ep_overlap, as the dispatch); dsk_moe_wait
   joins the exchange the call has in flight, if it has one, computing nothing, so that another layer's
   exchange may begin on the group. Each is optional, and each does what the steps before it would have done
   had they not been called; a step already done does nothing; the end does what is left. The bits are those
   of the begin and end alone. DSK_ERR_STATE with no call begun; a step that fails ends the call begun, its
   exchange joined. */
DSK_API dsk_status dsk_moe_experts(dsk_moe *m, dsk_ctx *ctx);
DSK_API dsk_status dsk_moe_return_begin(dsk_moe *m, dsk_ctx *ctx);
DSK_API dsk_status dsk_moe_wait(dsk_moe *m, dsk_ctx *ctx);
/* y (T, D) = MoE(x (T, D)), both opts.dtype on the layer's device; saves what backward needs in
   the current slot (dsk_moe_set_slots: one forward in flight per slot). stats may be NULL; given on
   CUDA it costs one sync (the statistics are read back at once): pass NULL and use
   dsk_moe_stats_collect to stay sync-free.
   CPU: DSK_ERR_NONFINITE when a token's router logits are NaN/Inf (see "Non-finite input"). */
DSK_API dsk_status dsk_moe_forward(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x, dsk_moe_stats *stats);
/* dsk_moe_forward with the routing given instead of selected: experts (T, K) i32 on the CPU,
   each row K distinct experts in [0, E) in slot order (see "Routing record and replay").
   DSK_ERR_ARG for an index out of range, a repeated expert in a row or another shape, before
   anything changes: the layer keeps its saved forward, loads and statistics. */
DSK_API dsk_status dsk_moe_forward_replay(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x,
                                          const dsk_tensor *experts, dsk_moe_stats *stats);
/* The routing of the current slot's forward into experts ((T, K) i32 on the CPU): each token's
   experts in slot order. CUDA: one copy and one sync. DSK_ERR_STATE before any forward (or after a failed one). */
DSK_API dsk_status dsk_moe_routing(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *experts);
/* dx (T, D) += d/dx, every parameter gradient += its part, for the current slot's forward; dy (T, D).
   aux_scale weights the gradients of the layer's loss terms (1; the loss scale under amp;
   divided by the micro-batch count when the model loss is). One backward per forward: a second
   one fails with DSK_ERR_STATE (its gradients would be added twice) until a forward runs. */
DSK_API dsk_status dsk_moe_backward(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *dy, float aux_scale);
/* Zeroes every bound gradient. */
DSK_API dsk_status dsk_moe_zero_grad(dsk_moe *m, dsk_ctx *ctx);
/* Aux-loss-free balancing, after the optimizer step: loads = selections per expert counted by
   every forward since the last update (except those run with m->eval set), summed over `comm`
   (the data-parallel world, NULL = this rank only); b_i += bias_rate * sign(mean load - load_i);
   re-centred if asked. Runs on the layer's device (CUDA: no host sync). Each rank counts the rows it
   routes (its own, under a loss span or not), so with comm = every rank that runs the layer (with
   pipeline parallelism the stage's ranks: tensor x data x expert parallel) each token of the step, every
   micro-batch, counts once, as on one rank; a forward run again for backward (recomputation) must run
   with m->eval set, or its tokens count twice. */
DSK_API dsk_status dsk_moe_update_bias(dsk_moe *m, dsk_ctx *ctx, dsk_comm *comm);
/* dsk_moe_update_bias without a communicator, skipped on the device when *skip (an i32 scalar
   on the layer's device, e.g. dsk_amp_dstep's skip) is not 0: the loads then keep counting into
   the next update, as when the caller does not call dsk_moe_update_bias for a skipped step. For a
   step captured as a CUDA graph, whose skip decision stays on the device. */
DSK_API dsk_status dsk_moe_update_bias_unless(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *skip);
/* Statistics of the forwards since the previous request (m->eval ones excepted): takes them and
   starts over. CUDA: an asynchronous copy into pinned memory and an event; collect waits for
   that event only, so called after a later sync of the stream it does not wait at all. */
DSK_API dsk_status dsk_moe_stats_request(dsk_moe *m, dsk_ctx *ctx);
/* The statistics of the last request (all zero before the first). */
DSK_API dsk_status dsk_moe_stats_collect(dsk_moe *m, dsk_ctx *ctx, dsk_moe_stats *out);
/* The layer's configuration under prefix (NULL: the layer's name), e.g. "moe.top_k" = "2". */
DSK_API dsk_status dsk_moe_config_get(const dsk_moe *m, const char *prefix, dsk_moe_config *out);
/* Checks n key/value pairs read from a checkpoint (e.g. dsk_ckpt_meta's keys, values, n) against
   the layer's configuration under prefix: DSK_ERR_ARG naming the first option whose value
   differs, with both values, or that is missing while others are present. Pairs without any of
   the layer's keys (a checkpoint written before they were) pass. */
DSK_API dsk_status dsk_moe_config_check(const dsk_moe *m, const char *prefix, const char *const *keys,
                                        const char *const *values, int n);
#ifdef DSK_AMP_H
/* (Declared and defined where dsk_amp.h is included before this file, in the implementation's
   file too.) Unscales a step's gradients under expert parallelism and leaves the statistics of
   the whole model in sc, the same on every rank (then dsk_amp_stats_get, dsk_amp_decide,
   dsk_amp_update as without EP): rep (n_rep) the replicated gradients after their reduction (equal
   on every rank), sharded (n_sharded) this rank's expert-sharded ones after theirs (equal over a
   replica group); found_inf and sumsq = those of rep + the SUM over ep of those of sharded, each
   element of the world counted once. ep: the expert-parallel group on sc's backend (host for a
   CPU scaler, nccl for a CUDA one; NULL or 1 rank: no exchange). Every rank of ep calls it
   together. CUDA: two 16-byte reads of the statistics (host syncs), one all-reduce of 2 f64. */
DSK_API dsk_status dsk_moe_amp_unscale(dsk_amp_scaler *sc, dsk_ctx *ctx, dsk_comm *ep, dsk_tensor *const *rep,
                                       int n_rep, dsk_tensor *const *sharded, int n_sharded);
#endif

/* ---- expert-parallel routes: token dispatch and combine, flat or in two hops
   A route sends each of this rank's n_rows rows (row_elems elements of one dtype) to up to k
   ranks and brings one row back from each (the expert outputs). Build it once per routing
   decision (collective over c; every rank passes the same opts), then dispatch and combine
   any number of times, with any dtype. c must outlive the route.
   dest (n_rows, k) int32, host memory: the rank each slot (row i, slot j) goes to, -1 for an
   unused slot. A rank may appear in several slots of a row (two of its experts): each slot is
   a row of its own at the receiver. S = the used slots of this rank.
   dispatch: recv (recv_rows, row_elems) = the rows sent to this rank, by source rank, then by
   (row, slot) at the source: exactly what a flat all-to-all-v gives when every rank packs its
   rows for each destination in (row, slot) order (recv_counts[p] rows from rank p).
   combine: rows (recv_rows, row_elems) in the order dispatch delivered go back to their
   sources; out (S, row_elems) = the row that came back for each used slot, in (row, slot) order.
   two_hop (a communicator whose nodes all have the same number of ranks): a row crosses to
   each destination node once, to the rank with this rank's node_rank there, which copies it to
   its slots on that node (DeepSeek-V3, DeepEP); results are bitwise those of the flat route,
   and fewer rows cross nodes when a row has several slots on one node. The way back crosses
   once per slot (the outputs differ). The two hops run on c's node communicator and cross-node
   one (dsk_comm_node_comms: split off at the first two-hop route, kept with c; NCCL:
   ncclCommSplit). The layer routes this way under opts.ep_route (see "Expert parallelism").
   Host backend: CPU buffers. nccl: device buffers on ctx's stream, rows of an even number of
   bytes (gathered as 16- or 32-bit words). */
typedef struct dsk_moe_route_opts {
    int two_hop; /* [0]: one all-to-all-v over c; 1: across nodes, then inside them */
} dsk_moe_route_opts;

typedef struct dsk__moe_route_impl dsk__moe_route_impl;
typedef struct dsk_moe_route {
    int64_t n_rows, slots; /* rows this rank sends, its used slots (rows combine returns) */
    int k, two_hop;
    int64_t recv_rows;          /* rows dispatch delivers to this rank */
    const int64_t *recv_counts; /* [world_size] of them from each rank (the route owns the array) */
    /* rows this rank sends to other nodes in one dispatch and in one combine */
    int64_t dispatch_rows_off_node, combine_rows_off_node;
    dsk__moe_route_impl *impl;
} dsk_moe_route;

/* Collective over c. ctx: nccl keeps the route's index arrays on its GPU (host: unused, may be NULL). */
DSK_API dsk_status dsk_moe_route_init(dsk_moe_route *rt, dsk_comm *c, dsk_ctx *ctx, int64_t n_rows, int k,
                                      const int32_t *dest, const dsk_moe_route_opts *opts);
/* rows (n_rows, row_elems) -> recv (recv_rows, row_elems). Collective over c. */
DSK_API dsk_status dsk_moe_route_dispatch(dsk_moe_route *rt, dsk_ctx *ctx, const void *rows, int64_t row_elems,
                                          dsk_dtype dt, void *recv);
/* rows (recv_rows, row_elems) -> out (slots, row_elems). Collective over c. */
DSK_API dsk_status dsk_moe_route_combine(dsk_moe_route *rt, dsk_ctx *ctx, const void *rows, int64_t row_elems,
                                         dsk_dtype dt, void *out);
DSK_API void dsk_moe_route_free(dsk_moe_route *rt); /* zeroed/freed ok */

/* ---- per-token routing math shared by the CPU path and the CUDA kernels */

/* logsumexp of u (E). */
static inline DSK_HD float dsk_moe_logsumexp(const float *u, int E) {
    float mx = u[0], s = 0.0f;
    for (int j = 1; j < E; j++) mx = u[j] > mx ? u[j] : mx;
    for (int j = 0; j < E; j++) s += expf(u[j] - mx);
    return mx + logf(s);
}

/* 1 if x is NaN or +-Inf. */
static inline DSK_HD int dsk__moe_nonfinite(float x) { return (dsk_f32_bits(x) & 0x7f800000u) == 0x7f800000u; }

/* How many of a group's largest selection scores make its score, by the group rule. */
static inline DSK_HD int dsk__moe_group_width(const dsk_moe_router *r, int has_bias) {
    int gs = r->n_experts / r->n_group, w;
    if (r->group_rule == DSK_MOE_GROUP_MAX) w = 1;
    else if (r->group_rule == DSK_MOE_GROUP_MEGATRON) w = r->top_k / r->topk_group;
    else w = has_bias ? 2 : 1;
    return w < gs ? w : gs;
}

/* Sum of the w largest of c (n finite values), added largest first (ties: lower index first);
   w <= n. No scratch: pass i takes the largest value ranked after pass i-1's (value, index). */
static inline DSK_HD float dsk__moe_top_sum(const float *c, int n, int w) {
    float s = 0.0f, pv = INFINITY;
    int pi = -1;
    for (int i = 0; i < w; i++) {
        int best = -1;
        for (int j = 0; j < n; j++)
            if ((c[j] < pv || (c[j] == pv && j > pi)) && (best < 0 || c[j] > c[best])) best = j;
        s += c[best];
        pv = c[best];
        pi = best;
    }
    return s;
}

/* Scores of one token: prob (E) from its logits u (softmax p or sigmoid s), and its selection
   scores c (E) = p + bias (bias NULL: none). Returns 1 when a logit or a selection score is NaN
   or Inf, else 0. */
static inline DSK_HD int dsk__moe_scores(const dsk_moe_router *r, const float *u, const float *bias, float *prob,
                                         float *c) {
    const int E = r->n_experts;
    float sum = 0.0f;
    int bad = 0;
    if (r->score == DSK_MOE_SIGMOID) {
        for (int j = 0; j < E; j++) prob[j] = dsk_sigmoid_f(u[j]);
    } else {
        float mx = u[0];
        for (int j = 1; j < E; j++) mx = u[j] > mx ? u[j] : mx;
        for (int j = 0; j < E; j++) { prob[j] = expf(u[j] - mx); sum += prob[j]; }
        for (int j = 0; j < E; j++) prob[j] /= sum;
    }
    for (int j = 0; j < E; j++) {
        c[j] = prob[j] + (bias ? bias[j] : 0.0f);
        bad |= dsk__moe_nonfinite(u[j]) | dsk__moe_nonfinite(c[j]);
    }
    return bad;
}

/* The weights gate (K) of the experts sel (K) from the scores prob (E), in slot order. */
static inline DSK_HD void dsk__moe_gates(const dsk_moe_router *r, const float *prob, const int32_t *sel, float *gate) {
    const int K = r->top_k;
    float sum = 0.0f;
    for (int k = 0; k < K; k++) sum += prob[sel[k]];
    for (int k = 0; k < K; k++) gate[k] = r->scale * (r->norm ? prob[sel[k]] / (sum + 1e-20f) : prob[sel[k]]);
}

/* Routes one token. u (E) logits; bias (E) or NULL; writes prob (E) (softmax p or sigmoid s),
   sel (K) expert ids in slot order and gate (K) weights. scratch: E + n_group floats.
   Returns 0, or 1 when a logit or a selection score (p + bias) is NaN or Inf: then sel holds
   experts 0 .. K-1 (always valid indices) and every gate is NaN. */
static inline DSK_HD int dsk_moe_route_token(const dsk_moe_router *r, const float *u, const float *bias, float *prob,
                                             float *scratch, int32_t *sel, float *gate) {
    const int E = r->n_experts, K = r->top_k;
    float *c = scratch, *gscore = scratch + E;
    if (dsk__moe_scores(r, u, bias, prob, c)) { /* no order among NaNs: a fixed, valid selection, and NaN weights */
        for (int k = 0; k < K; k++) { sel[k] = k; gate[k] = NAN; }
        return 1;
    }
    if (r->n_group > 1) {
        int gs = E / r->n_group, w = dsk__moe_group_width(r, bias != NULL);
        for (int g = 0; g < r->n_group; g++) gscore[g] = dsk__moe_top_sum(c + g * gs, gs, w);
        for (int k = 0; k < r->topk_group; k++) { /* mark kept groups with NaN */
            int best = -1;
            for (int g = 0; g < r->n_group; g++)
                if (gscore[g] == gscore[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
            gscore[best] = NAN;
        }
        for (int g = 0; g < r->n_group; g++)
            if (gscore[g] == gscore[g])
                for (int j = g * gs; j < (g + 1) * gs; j++) c[j] = -INFINITY;
    }
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int j = 0; j < E; j++)
            if (c[j] == c[j] && (best < 0 || c[j] > c[best])) best = j;
        c[best] = NAN; /* taken */
        sel[k] = best;
    }
    dsk__moe_gates(r, prob, sel, gate);
    return 0;
}

/* Replays one token's routing: sel (K) holds the given experts (valid, distinct) and is kept;
   prob and gate are written as dsk_moe_route_token writes them for that selection (the same
   operations in the same order), NaN weights when a logit or selection score is not finite. */
static inline DSK_HD int dsk_moe_replay_token(const dsk_moe_router *r, const float *u, const float *bias, float *prob,
                                              float *scratch, const int32_t *sel, float *gate) {
    if (dsk__moe_scores(r, u, bias, prob, scratch)) {
        for (int k = 0; k < r->top_k; k++) gate[k] = NAN;
        return 1;
    }
    dsk__moe_gates(r, prob, sel, gate);
    return 0;
}

/* Backward of one token's routing into its logits: du (E) is WRITTEN with the gradient from
   dgate (K) (d loss / d gate, zero for dropped slots), the balancing-loss gradient aux_dp (E)
   (d loss / d p' per unit loss weight, times aux_mult; NULL for none) and the z-loss (zcoef *
   d (lse^2) / du / 2, i.e. the caller passes beta * 2 / T * aux_scale; 0 for none). */
static inline DSK_HD void dsk_moe_route_token_backward(const dsk_moe_router *r, const float *u, const float *prob,
                                                       const int32_t *sel, const float *dgate, const float *aux_dp,
                                                       float aux_mult, float zcoef, float *du) {
    const int E = r->n_experts, K = r->top_k, sigmoid = r->score == DSK_MOE_SIGMOID;
    float S = 0.0f, dot = 0.0f;
    for (int k = 0; k < K; k++) S += prob[sel[k]];
    /* du <- d loss / d prob */
    if (aux_dp && sigmoid) { /* p' = s / sum s */
        float tot = 0.0f, d = 0.0f;
        for (int j = 0; j < E; j++) tot += prob[j];
        for (int j = 0; j < E; j++) d += aux_dp[j] * prob[j];
        d /= tot;
        for (int j = 0; j < E; j++) du[j] = aux_mult * (aux_dp[j] - d) / tot;
    } else {
        for (int j = 0; j < E; j++) du[j] = aux_dp ? aux_mult * aux_dp[j] : 0.0f;
    }
    if (r->norm) {
        float sdq = 0.0f, inv = 1.0f / (S + 1e-20f);
        for (int k = 0; k < K; k++) sdq += dgate[k] * prob[sel[k]];
        for (int k = 0; k < K; k++) du[sel[k]] += r->scale * (dgate[k] - sdq * inv) * inv;
    } else {
        for (int k = 0; k < K; k++) du[sel[k]] += r->scale * dgate[k];
    }
    /* through the score function */
    if (sigmoid) {
        for (int j = 0; j < E; j++) du[j] *= prob[j] * (1.0f - prob[j]);
    } else {
        for (int j = 0; j < E; j++) dot += du[j] * prob[j];
        for (int j = 0; j < E; j++) du[j] = prob[j] * (du[j] - dot);
    }
    if (zcoef != 0.0f) {
        float lse = dsk_moe_logsumexp(u, E);
        for (int j = 0; j < E; j++) du[j] += zcoef * lse * expf(u[j] - lse);
    }
}

/* ---- the rest of the MoE math, shared by the CPU loops and the CUDA kernels (one place each) */

/* Score of expert j in the balancing losses: p' = p (softmax) or s / sum_j s_j (sigmoid). */
static inline DSK_HD double dsk__moe_pnorm(int sigmoid, float p, double ptot) { return sigmoid ? p / ptot : p; }

/* Token t's part of the balancing losses: *ptot = sum of its scores (f64, expert order),
   *lse = logsumexp of its logits (when need_lse), lsel (K) = the experts its loss counts: the
   top K of its unbiased scores over all experts (count_topk; ties: lower index), else its
   selections sel (K). */
static inline DSK_HD void dsk__moe_loss_token(int E, int K, int count_topk, int need_lse, const float *prob,
                                              const float *u, const int32_t *sel, double *ptot, float *lse,
                                              int32_t *lsel) {
    double tot = 0;
    for (int j = 0; j < E; j++) tot += prob[j];
    *ptot = tot;
    if (need_lse) *lse = dsk_moe_logsumexp(u, E);
    if (!count_topk) {
        for (int k = 0; k < K; k++) lsel[k] = sel[k];
        return;
    }
    if (tot != tot) { /* a NaN score ranks nothing: the router's fallback for such a token, experts 0 .. K-1 */
        for (int k = 0; k < K; k++) lsel[k] = k;
        return;
    }
    {
        float pv = INFINITY;
        int pi = -1;
        for (int k = 0; k < K; k++) { /* pass k: the largest (value, index) ranked after pass k-1's */
            int best = -1;
            for (int j = 0; j < E; j++)
                if ((prob[j] < pv || (prob[j] == pv && j > pi)) && (best < 0 || prob[j] > prob[best])) best = j;
            lsel[k] = best;
            pv = prob[best];
            pi = best;
        }
    }
}

/* Expert j over this call's tokens [t0, t1) (its rows of one sequence, or all of them): P = sum_t p'_tj / denom
   (denom: the tokens of the whole sequence or micro-batch, on every rank of the loss span) and cnt = the tokens
   counting j (lsel), in token order. */
static inline DSK_HD void dsk__moe_loss_sums(int j, int64_t t0, int64_t t1, int64_t denom, int E, int K, int sigmoid,
                                             const float *prob, const double *ptot, const int32_t *lsel, double *P,
                                             double *cnt) {
    double p = 0, c = 0;
    for (int64_t t = t0; t < t1; t++) {
        p += dsk__moe_pnorm(sigmoid, prob[t * E + j], ptot[t]) / (double)denom;
        for (int k = 0; k < K; k++) c += lsel[t * K + k] == j ? 1.0 : 0.0;
    }
    *P = p;
    *cnt = c;
}

/* The balancing losses' partial sums (f64), this rank's part of the loss span, summed over its group (counts
   are exact integers in f64): Switch P (E) and counts (E), sequence-wise P (nseq, E) and counts (nseq, E), then
   the tail: sum of lse^2, rows, total_rows, total_rows^2 (the last three check the span). Offset of the tail: */
static inline DSK_HD int64_t dsk__moe_part_tail(int E, int64_t nseq) { return 2 * (int64_t)E + 2 * nseq * E; }
#define DSK__MOE_PART_TAIL 4

/* Switch/GShard part of expert j: this call's T tokens of the span's N. */
static inline DSK_HD void dsk__moe_switch_part(int j, int64_t T, int64_t N, int E, int K, int sigmoid,
                                               const float *prob, const double *ptot, const int32_t *lsel,
                                               double *part) {
    dsk__moe_loss_sums(j, 0, T, N, E, K, sigmoid, prob, ptot, lsel, &part[j], &part[E + j]);
}

/* Sequence-wise part of expert j in sequence q (global rows [qL, (q+1)L) of the span): this call's rows of it
   (rows [row0, row0 + T) of the span; none: zeros). */
static inline DSK_HD void dsk__moe_seq_part(int j, int64_t q, int64_t row0, int64_t T, int64_t L, int64_t nseq, int E,
                                            int K, int sigmoid, const float *prob, const double *ptot,
                                            const int32_t *lsel, double *part) {
    int64_t t0 = q * L - row0, t1 = t0 + L, i = 2 * (int64_t)E + q * E + j;
    t0 = t0 < 0 ? 0 : t0;
    t1 = t1 > T ? T : t1;
    dsk__moe_loss_sums(j, t0, t1 > t0 ? t1 : t0, L, E, K, sigmoid, prob, ptot, lsel, &part[i], &part[i + nseq * E]);
}

/* The tail (one thread): this call's sum of lse^2 (lse NULL: 0) in token order, T, N and N^2. */
static inline DSK_HD void dsk__moe_part_tail_fill(int64_t T, int64_t N, const float *lse, double *tail) {
    double z = 0;
    for (int64_t t = 0; lse && t < T; t++) {
        double l = lse[t];
        z += l * l;
    }
    tail[0] = z;
    tail[1] = (double)T;
    tail[2] = (double)N;
    tail[3] = (double)N * (double)N;
}

/* 1 when the group's summed tail is a consistent span: every one of `ranks` ranks passed this total_rows N (the
   sums of N and N^2 say so on every rank alike, as long as ranks N^2 < 2^53) and their rows add up to N. */
static inline DSK_HD int dsk__moe_span_ok(const double *tail, int ranks, int64_t N) {
    return tail[1] == (double)N && tail[2] == (double)ranks * (double)N &&
           tail[3] == (double)ranks * ((double)N * (double)N);
}

/* Switch/GShard term of expert j over the span's N tokens: term = f_j P_j, and the coefficient of
   d loss / d p'_tj (every token): alpha E f_j / N. */
static inline DSK_HD void dsk__moe_switch_term(int j, int64_t N, int E, int K, float alpha, const double *part,
                                               double *term, float *coef) {
    double f = part[E + j] / (double)(N * K);
    *term = f * part[j];
    *coef = (float)(alpha * E * f / (double)N);
}

/* DeepSeek-V3 sequence-wise term of expert j in sequence q (L tokens, nseq sequences). */
static inline DSK_HD void dsk__moe_seq_term(int j, int64_t q, int64_t L, int64_t nseq, int E, int K, float alpha,
                                            const double *part, double *term, float *coef) {
    int64_t i = 2 * (int64_t)E + q * E + j;
    double f = (double)E / (double)(K * L) * part[i + nseq * E];
    *term = f * part[i];
    *coef = (float)(alpha * f / (double)L / (double)nseq);
}

/* The loss values (one thread) from the group's summed parts: out = {aux, seq_aux, z, their sum}, each summed in
   a fixed order (experts, then sequences). Returns 1, or 0 with every value NaN when the span is not consistent
   (dsk__moe_span_ok). */
static inline DSK_HD int dsk__moe_loss_finish(int E, int K, int64_t N, int64_t L, int64_t nseq, int ranks, float alpha,
                                              float seq_alpha, float z_beta, const double *part, double *out) {
    const double *tail = part + dsk__moe_part_tail(E, nseq);
    double term;
    float coef;
    out[0] = out[1] = out[2] = out[3] = 0.0;
    if (!dsk__moe_span_ok(tail, ranks, N)) {
        out[0] = out[1] = out[2] = out[3] = NAN;
        return 0;
    }
    if (N == 0) return 1;
    if (alpha > 0) {
        double loss = 0;
        for (int j = 0; j < E; j++) {
            dsk__moe_switch_term(j, N, E, K, alpha, part, &term, &coef);
            loss += term;
        }
        out[0] = alpha * E * loss;
    }
    if (seq_alpha > 0) {
        double total = 0;
        for (int64_t q = 0; q < nseq; q++) {
            double loss = 0;
            for (int j = 0; j < E; j++) {
                dsk__moe_seq_term(j, q, L, nseq, E, K, seq_alpha, part, &term, &coef);
                loss += term;
            }
            total += seq_alpha * loss;
        }
        out[1] = total / (double)nseq;
    }
    if (z_beta > 0) out[2] = z_beta * tail[0] / (double)N;
    out[3] = out[0] + out[1] + out[2];
    return 1;
}

/* d loss / d p' per unit weight for expert j of sequence q (qj = q E + j): the Switch and sequence-wise parts;
   NaN when the span is not consistent. */
static inline DSK_HD float dsk__moe_aux_coef(int64_t qj, int E, int K, int64_t N, int64_t L, int64_t nseq, int ranks,
                                             float alpha, float seq_alpha, const double *part) {
    float c = 0.0f, coef;
    double term;
    if (!dsk__moe_span_ok(part + dsk__moe_part_tail(E, nseq), ranks, N)) return NAN;
    if (N == 0) return 0.0f;
    if (alpha > 0) {
        dsk__moe_switch_term((int)(qj % E), N, E, K, alpha, part, &term, &coef);
        c += coef;
    }
    if (seq_alpha > 0) {
        dsk__moe_seq_term((int)(qj % E), qj / E, L, nseq, E, K, seq_alpha, part, &term, &coef);
        c += coef;
    }
    return c;
}

/* Capacity order: 1 if slot a (weight ga, flat index ia) is kept before slot b: larger weight
   first (a NaN weight lowest), then the earlier position. */
static inline DSK_HD int dsk__moe_kept_before(float ga, int32_t ia, float gb, int32_t ib) {
    ga = ga == ga ? ga : -INFINITY;
    gb = gb == gb ? gb : -INFINITY;
    if (ga != gb) return ga > gb;
    return ia < ib;
}

/* 1 if the slot at position j of its expert's segment seg (n flat slot indices in position
   order) keeps its place under capacity cap: by position, or by rank of its weight. */
static inline DSK_HD int dsk__moe_capacity_keep(int drop, const float *gate, const int32_t *seg, int64_t n, int64_t j,
                                                int64_t cap) {
    int64_t rank = 0;
    if (drop == DSK_MOE_DROP_POSITION || n <= cap) return j < cap;
    for (int64_t i = 0; i < n; i++) rank += dsk__moe_kept_before(gate[seg[i]], seg[i], gate[seg[j]], seg[j]);
    return rank < cap;
}

/* Position j of the kept order (n_kept = offsets[E]): its source token and weight; -1 and 0
   past the kept rows (the zero padding of a buffer sized by a bound). */
static inline DSK_HD void dsk__moe_plan_row(int64_t j, int K, int32_t n_kept, const int32_t *perm, const float *gate,
                                            int32_t *row_tok, float *row_gate) {
    row_tok[j] = j < n_kept ? perm[j] / K : -1;
    row_gate[j] = j < n_kept ? gate[perm[j]] : 0.0f;
}

/* Bounded expert-parallel dispatch: peer r's block of Cp send rows holds the kept rows of its experts
   [r El, (r+1) El) (kept order, off (P El + 1) their offsets) and zero rows after them. For send row q:
   *row = its kept row or -1, *key = the receiving rank's local expert of that row or -1. */
static inline DSK_HD void dsk__moe_ep_slot(int64_t q, int El, int64_t Cp, const int32_t *off, int32_t *row,
                                           int32_t *key) {
    int64_t r = q / Cp, j = off[r * El] + q % Cp;
    int e = (int)(r * El);
    *row = -1;
    *key = -1;
    if (j >= off[(r + 1) * El]) return;
    while (off[e + 1] <= j) e++;
    *row = (int32_t)j;
    *key = (int32_t)(e - r * El);
}

/* Bounded, chunked: entry i of the received blocks' segments ((P (El + 1)), rank r's at r (El + 1)): where
   local expert e = i % (El + 1) begins in rank r's block of Cp received keys (key: its ep_slot keys, the
   padding's -1 last), e = El where the padding begins; a binary search, the block sorted by key. */
static inline DSK_HD int32_t dsk__moe_block_segment(int64_t i, int El, int64_t Cp, const int32_t *key) {
    const int32_t *k = key + i / (El + 1) * Cp;
    int e = (int)(i % (El + 1));
    int64_t lo = 0, hi = Cp;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if ((k[mid] < 0 ? El : k[mid]) < e) lo = mid + 1;
        else hi = mid;
    }
    return (int32_t)lo;
}

/* ... and the inverse: the send row of kept row j (-1 at j >= the kept rows). */
static inline DSK_HD int32_t dsk__moe_ep_unslot(int64_t j, int P, int El, int64_t Cp, const int32_t *off) {
    int r = 0;
    if (j >= off[P * El]) return -1;
    while (off[(r + 1) * El] <= j) r++;
    return (int32_t)(r * Cp + j - off[r * El]);
}

/* The counts of a forward (one thread): cnt[0] tokens, [1] slots dropped by capacity, [2]
   tokens with non-finite routing (their K slots were left out of the sort), [3, 3 + E)
   selections per expert, [3 + E, 3 + 2E) kept slots per expert; from the offsets of the full
   sort (off_all) and of the kept one (off). */
static inline DSK_HD void dsk__moe_counts(int64_t T, int K, int E, const int32_t *off_all, const int32_t *off,
                                          int64_t *cnt) {
    cnt[0] = T;
    cnt[1] = (int64_t)off_all[E] - off[E];
    cnt[2] = (T * K - off_all[E]) / K;
    for (int e = 0; e < E; e++) {
        cnt[3 + e] = (int64_t)off_all[e + 1] - off_all[e];
        cnt[3 + E + e] = (int64_t)off[e + 1] - off[e];
    }
}

/* Adds a training forward to the bias-update loads (this rank's selections, cnt_local) and to
   the statistics (acc_i: calls, tokens, slots, dropped, non-finite tokens, loads (E) of the EP
   group, cnt_group; acc_f: aux, seq_aux, z of this rank). One thread. */
static inline DSK_HD void dsk__moe_accumulate(int E, int K, const int64_t *cnt_local, const int64_t *cnt_group,
                                              const double *loss, int64_t *load, int64_t *acc_i, double *acc_f) {
    for (int e = 0; e < E; e++) load[e] += cnt_local[3 + e];
    acc_i[0] += 1;
    acc_i[1] += cnt_group[0];
    acc_i[2] += cnt_group[0] * K;
    acc_i[3] += cnt_group[1];
    acc_i[4] += cnt_group[2];
    for (int e = 0; e < E; e++) acc_i[5 + e] += cnt_group[3 + e];
    for (int i = 0; i < 3; i++) acc_f[i] += loss[i];
}

/* Element (t, d) of y: token t's kept slots in slot order (pos, gate (K)), then the shared
   experts' row; NaN for a token with non-finite routing (its gates are NaN). */
static inline DSK_HD float dsk__moe_combine_elem(int K, const int32_t *pos, const float *gate, const void *rows,
                                                 dsk_dtype rdt, int64_t D, int64_t d, const void *shared,
                                                 dsk_dtype sdt, int64_t shared_i) {
    float acc = 0.0f;
    if (gate[0] != gate[0]) return NAN;
    for (int k = 0; k < K; k++) {
        int32_t p = pos[k];
        if (p < 0) continue;
        acc += gate[k] * dsk_load_f32(rows, rdt, (int64_t)p * D + d);
    }
    if (shared) acc += dsk_load_f32(shared, sdt, shared_i);
    return acc;
}

/* Backward of the combine into element (t, d) of dx (f32, value acc): its kept slots' rows in
   slot order. */
static inline DSK_HD float dsk__moe_uncombine_elem(int K, const int32_t *pos, const void *rows, dsk_dtype rdt,
                                                   int64_t D, int64_t d, float acc) {
    for (int k = 0; k < K; k++)
        if (pos[k] >= 0) acc += dsk_load_f32(rows, rdt, (int64_t)pos[k] * D + d);
    return acc;
}

/* Part of a gate gradient d loss / d g = dy_t . o_slot: elements lane, lane + stride, ... of the
   two rows, in f64 (the CPU takes lane 0 of stride 1; a CUDA warp sums 32 lanes in a fixed tree). */
static inline DSK_HD double dsk__moe_dot_part(const void *a, dsk_dtype adt, int64_t a0, const void *b, dsk_dtype bdt,
                                              int64_t b0, int64_t D, int64_t lane, int64_t stride) {
    double acc = 0;
    for (int64_t d = lane; d < D; d += stride)
        acc += (double)dsk_load_f32(a, adt, a0 + d) * dsk_load_f32(b, bdt, b0 + d);
    return acc;
}

/* Aux-loss-free bias update (one thread): b_i += rate * sign(mean load - load_i), re-centred to
   mean 0 when asked. */
static inline DSK_HD void dsk__moe_bias_update(int E, float rate, int recenter, const int64_t *load, float *b) {
    double mean = 0, bmean = 0;
    for (int e = 0; e < E; e++) mean += (double)load[e] / E;
    for (int e = 0; e < E; e++) {
        double l = (double)load[e];
        b[e] += rate * (float)((mean > l) - (mean < l));
    }
    if (recenter) {
        for (int e = 0; e < E; e++) bmean += b[e];
        bmean /= E;
        for (int e = 0; e < E; e++) b[e] -= (float)bmean;
    }
}

/* Routes token t (dsk_moe_route_token; replay: sel already holds its experts, dsk_moe_replay_token)
   and writes its sort keys: its experts, or -1 for a token with non-finite routing (dispatched
   nowhere). */
static inline DSK_HD void dsk__moe_route_one(const dsk_moe_router *r, int64_t t, const float *u, const float *bias,
                                             float *prob, float *scratch, int32_t *sel, float *gate, int32_t *keys,
                                             int replay) {
    int E = r->n_experts, K = r->top_k;
    float *scr = scratch + t * (E + r->n_group);
    int bad = replay ? dsk_moe_replay_token(r, u + t * E, bias, prob + t * E, scr, sel + t * K, gate + t * K)
                     : dsk_moe_route_token(r, u + t * E, bias, prob + t * E, scr, sel + t * K, gate + t * K);
    for (int k = 0; k < K; k++) keys[t * K + k] = bad ? -1 : sel[t * K + k];
}

/* ---------------------------------------------------------------- CUDA launchers
   The C entry points of kernels/moe.cu, with the contracts of dsk_tensor.h's CUDA launchers. */
#if defined(DSK_CUDA) || defined(__CUDACC__) /* a CUDA build, or nvcc compiling the kernels */
/* ---- moe (kernels/moe.cu): the MoE steps of dsk_moe.h, each a kernel over the DSK_HD function of
   the same name there; row-major buffers, slot i = t * K + k, T tokens, E experts, K slots */
/* dsk__moe_route_one per token: u (T,E) -> prob (T,E), scratch (T, E + n_group), sel, gate (T,K), keys (T*K);
   replay 1: sel holds the given experts (read, kept). */
dsk_status dsk_cuda_moe_route(dsk_ctx *ctx, const struct dsk_moe_router *r, int64_t T, const float *u,
                              const float *bias, float *prob, float *scratch, int32_t *sel, float *gate, int32_t *keys,
                              int replay);
/* The balancing losses over a loss span (this call's T rows are rows [row0, row0 + T) of N, on `ranks` ranks).
   loss_parts: dsk__moe_loss_token per token, dsk__moe_switch_part per expert (aux_alpha > 0), dsk__moe_seq_part
   per (sequence, expert) (seq_alpha > 0) and the tail into part (zeroed by the caller); the caller sums part
   over the span's group; loss_finish: dsk__moe_loss_finish and dsk__moe_aux_coef per (sequence, expert). */
typedef struct dsk_cuda_moe_loss_args {
    int64_t T, N, row0, L, nseq;
    int E, K, ranks, sigmoid, count_topk;
    float aux_alpha, seq_alpha, z_beta;
    const float *prob, *u;
    const int32_t *sel;
    double *ptot, *part, *loss;
    float *lse, *aux;
    int32_t *lsel;
} dsk_cuda_moe_loss_args;
dsk_status dsk_cuda_moe_loss_parts(dsk_ctx *ctx, const dsk_cuda_moe_loss_args *a);
dsk_status dsk_cuda_moe_loss_finish(dsk_ctx *ctx, const dsk_cuda_moe_loss_args *a);
/* keys2 (TK) = the expert of each slot that keeps its place under capacity cap (dsk__moe_capacity_keep), else -1. */
dsk_status dsk_cuda_moe_capacity(dsk_ctx *ctx, int E, int drop, int64_t cap, int64_t TK, const int32_t *perm_all,
                                 const int32_t *off_all, const float *gate, int32_t *keys2);
/* pos (TK) = kept row of each slot or -1; row_tok, row_gate (n_rows) by dsk__moe_plan_row. */
dsk_status dsk_cuda_moe_plan(dsk_ctx *ctx, int E, int K, int64_t TK, int64_t n_rows, const int32_t *perm,
                             const int32_t *off, const float *gate, int32_t *pos, int32_t *row_tok, float *row_gate);
/* Bounded EP: pad, skey (P Cp) by dsk__moe_ep_slot, unpad (TK) by dsk__moe_ep_unslot; rgi (n) = the inverse
   of rg's first loff[El] entries, -1 elsewhere. */
dsk_status dsk_cuda_moe_ep_index(dsk_ctx *ctx, int P, int El, int64_t Cp, int64_t TK, const int32_t *off, int32_t *pad,
                                 int32_t *skey, int32_t *unpad);
dsk_status dsk_cuda_moe_ep_inverse(dsk_ctx *ctx, int El, int64_t n, const int32_t *rg, const int32_t *loff,
                                   int32_t *rgi);
/* seg (P (El + 1)) by dsk__moe_block_segment from the received keys (P Cp). */
dsk_status dsk_cuda_moe_block_segments(dsk_ctx *ctx, int P, int El, int64_t Cp, const int32_t *key, int32_t *seg);
/* cnt (3 + 2E) by dsk__moe_counts (one thread). */
dsk_status dsk_cuda_moe_counts(dsk_ctx *ctx, int64_t T, int K, int E, const int32_t *off_all, const int32_t *off,
                               int64_t *cnt);
/* dsk__moe_accumulate (one thread). */
dsk_status dsk_cuda_moe_accumulate(dsk_ctx *ctx, int E, int K, const int64_t *cnt, const int64_t *cnt_group,
                                   const double *loss, int64_t *load, int64_t *acc_i, double *acc_f);
/* y (T, D) in ydt by dsk__moe_combine_elem; rows (kept order) in rdt, shared (T, D) in sdt or NULL. */
dsk_status dsk_cuda_moe_combine(dsk_ctx *ctx, int K, int64_t T, int64_t D, void *y, dsk_dtype ydt, const int32_t *pos,
                                const float *gate, const void *rows, dsk_dtype rdt, const void *shared, dsk_dtype sdt);
/* dgate (TK) = dy_t . row_pos (0 for dropped slots): a warp per slot, dsk__moe_dot_part per lane, a fixed tree. */
dsk_status dsk_cuda_moe_dgate(dsk_ctx *ctx, int K, int64_t TK, int64_t D, float *dgate, const void *dy, dsk_dtype dydt,
                              const int32_t *pos, const void *rows, dsk_dtype rdt);
/* du (T,E) WRITTEN by dsk_moe_route_token_backward per token; aux (nseq, E) or NULL, token t in sequence
   (row0 + t) / seq_len. */
dsk_status dsk_cuda_moe_route_backward(dsk_ctx *ctx, const struct dsk_moe_router *r, int64_t T, const float *u,
                                       const float *prob, const int32_t *sel, const float *dgate, const float *aux,
                                       int64_t row0, int64_t seq_len, float aux_mult, float zcoef, float *du);
/* dxf (T, D) f32 by dsk__moe_uncombine_elem from rows (kept order) in rdt. */
dsk_status dsk_cuda_moe_uncombine(dsk_ctx *ctx, int K, int64_t T, int64_t D, float *dxf, const int32_t *pos,
                                  const void *rows, dsk_dtype rdt);
/* dsk__moe_bias_update (one thread), then load (E) zeroed; nothing when skip (device i32, may be NULL) is set. */
dsk_status dsk_cuda_moe_bias_update(dsk_ctx *ctx, int E, float rate, int recenter, int64_t *load, float *bias,
                                    const int32_t *skip);
#endif

#ifdef __cplusplus
}
#endif
DSK__FP_EXACT_END
#endif /* DSK_MOE_H */

/* ==================================================================== implementation */
#ifdef DSK_MOE_IMPLEMENTATION
#ifndef DSK_MOE_IMPLEMENTATION_DONE
#define DSK_MOE_IMPLEMENTATION_DONE
DSK__FP_EXACT_BEGIN

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

/* ---------------------------------------------------------------- state and buffer registry */

/* OpenMP pragmas only when compiled with -fopenmp (no unknown-pragma warnings without). */
#ifdef _OPENMP
#define DSK__MOE_OMP(x) _Pragma(#x)
#else
#define DSK__MOE_OMP(x)
#endif

/* Every buffer of the pipeline, on the layer's device (act: f32 on the CPU, the layer's dtype on
   CUDA; TK = T * K slots; R = rows of expert work: the kept slots, or their bound T*K on CUDA). */
enum dsk__moe_buf_id {
    /* a forward's activations and indices, kept for its backward: one set per saved forward
       (dsk_moe_set_slots); FP8 experts' e4m3 caches with their 1x128 f32 scales among them */
    DSK__MOE_XF,       /* (T, D) f32 x: the router's input */
    DSK__MOE_XA,       /* (T, D) act x, when act is not f32 (else XF) */
    DSK__MOE_U,        /* (T, E) f32 logits */
    DSK__MOE_PROB,     /* (T, E) f32 scores */
    DSK__MOE_SEL,      /* (T, K) i32 experts in slot order */
    DSK__MOE_AUX,      /* (nseq, E) f32 d loss / d p' coefficients for backward (the span's sequences) */
    DSK__MOE_OFF_ALL,  /* (E + 1) i32 the experts' offsets in PERM_ALL */
    DSK__MOE_OFF,      /* (E + 1) i32 their offsets in PERM: the experts' row segments */
    DSK__MOE_POS,      /* (TK) i32 slot -> kept row, -1 dropped */
    DSK__MOE_ROW_TOK,  /* (TK) i32 kept row -> token, -1 past the kept rows */
    DSK__MOE_ROW_GATE, /* (TK) f32 kept row -> weight */
    DSK__MOE_XS,       /* (TK, D) act token rows in kept order */
    DSK__MOE_XR,       /* (R, D) act rows received by this rank's experts, expert-major (EP) */
    DSK__MOE_H1,       /* (R, F) act */
    DSK__MOE_H3,       /* (R, F) act */
    DSK__MOE_A,        /* (R, F) act silu(h1) h3 */
    DSK__MOE_O,        /* (R, D) act expert outputs */
    DSK__MOE_OB,       /* (TK, D) act expert outputs back in kept order (EP) */
    DSK__MOE_HS1,      /* (T, Fs) act shared experts */
    DSK__MOE_HS3,
    DSK__MOE_AS,
    DSK__MOE_LOCAL_OFF, /* (n_local + 1) i32 local experts' row segments (EP) */
    DSK__MOE_RG,        /* (R) i32 expert-major row -> received row (EP) */
    DSK__MOE_RGI,       /* (R) i32 its inverse (EP) */
    DSK__MOE_EP_PAD,    /* (R = P Cp) i32 bounded EP: send row -> kept row or -1 (dsk__moe_ep_slot) */
    DSK__MOE_EP_UNPAD,  /* (TK) i32 kept row -> send row, -1 */
    DSK__MOE_EP_SEG,    /* (P (n_local + 1)) i32 bounded EP, chunked: the received blocks' segments */
    DSK__MOE_XQ,        /* (T, D) the tokens (the shared experts' input; the routed rows' source without EP) */
    DSK__MOE_XQS,       /* (T, ceil(D / 128)) */
    DSK__MOE_RQ,        /* (R, D) the experts' input rows */
    DSK__MOE_RQS,       /* (R, ceil(D / 128)) */
    DSK__MOE_AQ,        /* (R, F) silu(h1) h3, the input of w2 */
    DSK__MOE_AQS,       /* (R, ceil(F / 128)) */
    DSK__MOE_ASQ,       /* (T, Fs) the shared experts' silu(h1) h3 */
    DSK__MOE_ASQS,      /* (T, ceil(Fs / 128)) */
    DSK__MOE_NSAVED,
    /* the forward's scratch */
    DSK__MOE_SCR = DSK__MOE_NSAVED, /* (T, E + n_group) f32 routing scratch */
    DSK__MOE_GATE,                  /* (T, K) f32 weights */
    DSK__MOE_KEYS,                  /* (TK) i32 sort keys: the experts, -1 for non-finite tokens */
    DSK__MOE_PTOT,                  /* (T) f64 sum of a token's scores (losses) */
    DSK__MOE_LSE,                   /* (T) f32 logsumexp (z-loss) */
    DSK__MOE_LSEL,                  /* (T, K) i32 experts the losses count */
    DSK__MOE_PART,      /* (2E + 2 nseq E + 4) f64 the losses' partial sums, summed over the loss span's group */
    DSK__MOE_LOSS,      /* (4) f64 aux, seq_aux, z, total */
    DSK__MOE_PERM_ALL,  /* (TK) i32 every routed slot by expert */
    DSK__MOE_KEYS2,     /* (TK) i32 keys after capacity */
    DSK__MOE_PERM,      /* (TK) i32 kept slots by expert (-1 past them) */
    DSK__MOE_CNT,       /* (3 + 2E) i64 this rank's counts (dsk__moe_counts) */
    DSK__MOE_CNTG,      /* (3 + 2E) i64 counts summed over the EP group */
    DSK__MOE_STAGE,     /* (max(R, TK), D) act rows of an all-to-all-v (EP) */
    DSK__MOE_Q8,        /* (TK, D) e4m3 codes of the dispatched rows (EP, FP8 dispatch) */
    DSK__MOE_Q8S,       /* (TK, ceil(D / 128)) f32 their scales */
    DSK__MOE_Q8R,       /* (R, D) e4m3 codes received */
    DSK__MOE_Q8RS,      /* (R, ceil(D / 128)) f32 their scales */
    DSK__MOE_YS,        /* (T, D) act shared output */
    DSK__MOE_RECV_CNT,  /* (P, n_local) i64 rows each rank sends to each local expert (EP) */
    DSK__MOE_EP_SKEY,   /* (R) i32 the receiver's local expert of each send row, -1 */
    DSK__MOE_EP_RKEY,   /* (R) i32 the keys received */
    DSK__MOE_STAGE2,    /* (R, D) act rows received (bounded EP) */
    DSK__MOE_CHUNK_SEG, /* (P (n_local + 1)) i32 chunked dispatch: each rank's local experts' segments in its rows */
    /* chunked dispatch (dsk__moe_chunking): rows in the exchange's order (by source rank, as STAGE), which O
       and DXR, the return's rows, take too when chunked */
    DSK__MOE_CH_H1,  /* (R, F) act h1 */
    DSK__MOE_CH_H3,  /* (R, F) act h3 */
    DSK__MOE_CH_A,   /* (R, F) act forward silu(h1) h3 */
    DSK__MOE_CH_DH1, /* (R, F) act backward */
    DSK__MOE_CH_DH3, /* (R, F) act backward */
    /* FP8 experts' scratch, flat, viewed per GEMM (forward and backward) */
    DSK__MOE_W8,  /* e4m3 one projection's weights of every local expert (or a shared one), 128x128 blocks */
    DSK__MOE_W8S, /* f32 their scales */
    DSK__MOE_GQ,  /* e4m3 an output gradient (or h) in 1x128 tiles, rows (R or T) x its width */
    DSK__MOE_GQS, /* f32 */
    DSK__MOE_GTQ, /* e4m3 an output gradient transposed, tiles along the tokens (weight gradients) */
    DSK__MOE_GTS, /* f32 */
    DSK__MOE_ITQ, /* e4m3 a cached input transposed, tiles along the tokens (weight gradients) */
    DSK__MOE_ITS, /* f32 */
    DSK__MOE_WA,  /* act copies of w1 w2 w3 sw1 sw2 sw3 when their dtype is not act: 6 ids */
    DSK__MOE_WA_END = DSK__MOE_WA + 6,
    /* backward */
    DSK__MOE_DYA = DSK__MOE_WA_END, /* (T, D) act dy, when act is not the layer's dtype */
    DSK__MOE_DXF,                   /* (T, D) f32 d x accumulated */
    DSK__MOE_DGATE,                 /* (T, K) f32 */
    DSK__MOE_DU,                    /* (T, E) f32 */
    DSK__MOE_DOS,                   /* (TK, D) act g * dy rows in kept order */
    DSK__MOE_DOR,                   /* (R, D) act at the experts (EP) */
    DSK__MOE_DA,                    /* (R, F) act */
    DSK__MOE_DH1,
    DSK__MOE_DH3,
    DSK__MOE_DXR, /* (R, D) act d expert input */
    DSK__MOE_DXP, /* (TK, D) act back in kept order (EP) */
    DSK__MOE_DAS, /* (T, Fs) act shared experts */
    DSK__MOE_DHS1,
    DSK__MOE_DHS3,
    /* persistent (allocated once by init) */
    DSK__MOE_LOAD,  /* (E) i64 selections since the last bias update */
    DSK__MOE_ACC_I, /* (5 + E) i64 statistics since the last request */
    DSK__MOE_ACC_F, /* (3) f64 */
    DSK__MOE_NBUF
};

typedef struct dsk__moe_store {
    dsk_tensor mem;
    size_t cap;
} dsk__moe_store; /* a buffer and its bytes */

/* A saved forward (a slot of dsk_moe_set_slots): what one forward leaves for its backward. */
struct dsk__moe_fwd {
    int have_fwd;            /* a forward's activations are saved and no backward has used them */
    int bwd_done;            /* a backward used the saved forward (a second one would add its gradients again) */
    int have_route;          /* the forward's routing is in SEL (dsk_moe_routing) */
    int64_t T;               /* tokens of the saved forward */
    int64_t row0, N;         /* its loss span: its rows are rows [row0, row0 + T) of N (no span: 0 and T) */
    int ranks;               /* ranks of the span's group (1: none) */
    int64_t n_kept;          /* kept slots of this rank, when the host knows it (CPU; EP), else -1 */
    int64_t R;               /* rows of expert work in the buffers: exact (CPU, EP) or T*K's bound (CUDA) */
    int64_t n_seq, seq_len;  /* sequences of the sequence-wise loss */
    int64_t *h_recv_cnt;     /* (P * n_local) EP counts on the host */
    int64_t *a2a;            /* (8P) all-to-all-v counts and displacements, forward direction (elements), then
                                the same without this rank's own rows (chunked dispatch) */
    int64_t *send_rows, *recv_rows; /* (P) */
    int64_t *local_off;      /* (n_local + 1) */
    int32_t *h_rg;           /* (R, 2) regroup index and its inverse on the host (EP), grown */
    int64_t h_rg_cap;
    struct dsk__moe_hop *hop; /* opts.ep_route TWO_HOP: the forward's route and indices */
    dsk__moe_store buf[DSK__MOE_NSAVED];
};

enum { DSK__MOE_PEND_NONE, DSK__MOE_PEND_FWD, DSK__MOE_PEND_BWD }; /* what a layer has begun and not ended */

struct dsk__moe_state {
    struct dsk__moe_fwd **fwds; /* the saved forwards (dsk_moe_set_slots) */
    int n_fwds;
    struct dsk__moe_fwd *f; /* the one the next forward and backward use (dsk_moe_use_slot) */
    dsk_comm *span_group;   /* the loss span set for the next forwards (dsk_moe_set_loss_span) */
    int64_t span_row0, span_rows;
    int span_on;                   /* 0: none, each call its own micro-batch */
    dsk_dtype act;                 /* activation dtype */
    int pending;                   /* DSK__MOE_PEND_*: a forward or backward begun and not ended */
    struct dsk__moe_pending *pend; /* its record (made at the first begin) */
    /* the scratch and persistent buffers (the kept ones are each saved forward's) */
    dsk__moe_store buf[DSK__MOE_NBUF - DSK__MOE_NSAVED];
    /* host side */
    int64_t *h_cnt;          /* (3 + 2E) counts on the host (CUDA: copied back when asked for) */
    int *arrival_order;      /* (P) chunked dispatch: the other ranks whose rows have landed, in that order */
    int *landed;             /* (P) chunked dispatch: dsk_comm_progress's report */
    int64_t *fwd_loads;      /* (E) the last forward's stats.tokens_per_expert */
    int64_t *col_acc_i;      /* (5 + E) the last collected statistics (CUDA: pinned) */
    double *col_acc_f;       /* (3) */
    void *event;             /* CUDA: the event after the last request's copy */
    int requested;           /* a request is pending or collected */
    uint64_t fwd_bytes[2], acc_bytes[2], col_bytes[2]; /* EP dispatch and combine bytes: the last forward's, since
                                                          the last request, the last collected */
    uint64_t off_bytes[3];    /* EP bytes sent to other nodes: the last forward's, since the last request, collected */
    int in_forward;           /* the exchanges count into off_bytes[0] too */
    int chunked;              /* this call's exchange to the experts leaves this rank's own rows to the caller */
    int xch_begin;            /* the exchange running now only begins its all-to-all (dsk__moe_begins) */
    size_t xch_unsent;        /* its bytes the transport did not take at the start */
    int64_t fwd_chunks;       /* the last forward's chunks (dsk_moe_stats.ep_chunks) */
    void *side, *ev_fork, *ev_join;     /* CUDA with ep_overlap: the exchanges' stream, and the events that order
                                           it after the layer's stream and the layer's stream after it */
    void **ev_shift;                    /* CUDA with ep_overlap: (P - 1) events, each after a chunked dispatch's
                                           ring shift on side (dsk__moe_others_to_experts) */
    int32_t *chunk_seg;                 /* (P (n_local + 1)) host: DSK__MOE_CHUNK_SEG's values */
};

static int64_t dsk__moe_max(int64_t a, int64_t b) { return a > b ? a : b; }
static int64_t dsk__moe_chunks(int64_t k) { return (k + 127) / 128; } /* 1x128 tiles of a row of k */

/* dsk__moe_spec_at for the FP8 experts' buffers (0 rows unless opts.expert_gemm is FP8). Under FP8
   the activation-dtype copies that only fed a GEMM are gone: A and AS (computed in DA and DAS, then
   quantised), XS and XR (the rows gathered in DOS, received in DOR, quantised; without EP the
   tokens' codes are gathered instead). The scratch is sized by the widest GEMM of either kind. */
static void dsk__moe_spec_fp8(const dsk_moe *m, int id, int64_t T, int64_t R, dsk_dtype *dt, int64_t *rows,
                              int64_t *cols) {
    const dsk_moe_opts *o = &m->opts;
    int64_t D = o->d_model, F = o->d_expert, Fs = m->d_shared_total, El = m->n_local;
    int64_t W = dsk__moe_max(D, F), Ws = Fs > 0 ? dsk__moe_max(D, Fs) : 0, Ts = Fs > 0 ? T : 0;
    int codes = (id - (id < DSK__MOE_W8 ? DSK__MOE_XQ : DSK__MOE_W8)) % 2 == 0; /* codes, f32 scales, alternately */
    *dt = codes ? DSK_E4M3 : DSK_F32;
    *rows = 0;
    *cols = 0;
    if (o->expert_gemm != DSK_MOE_GEMM_FP8) return;
    switch (id) {
    case DSK__MOE_XQ:
    case DSK__MOE_XQS:
        *rows = Fs > 0 || m->ep_size <= 1 ? T : 0;
        *cols = D;
        break;
    case DSK__MOE_RQ:
    case DSK__MOE_RQS:
        *rows = R;
        *cols = D;
        break;
    case DSK__MOE_AQ:
    case DSK__MOE_AQS:
        *rows = R;
        *cols = F;
        break;
    case DSK__MOE_ASQ:
    case DSK__MOE_ASQS:
        *rows = Ts;
        *cols = Fs;
        break;
    case DSK__MOE_W8: *rows = dsk__moe_max(El * F * D, Fs * D); break;
    case DSK__MOE_W8S: *rows = dsk__moe_max(El * dsk__moe_chunks(F), dsk__moe_chunks(Fs)) * dsk__moe_chunks(D); break;
    case DSK__MOE_GQ: *rows = dsk__moe_max(R * W, Ts * Ws); break;
    case DSK__MOE_GQS: *rows = dsk__moe_max(R * dsk__moe_chunks(W), Ts * dsk__moe_chunks(Ws)); break;
    case DSK__MOE_GTQ:
    case DSK__MOE_ITQ: *rows = dsk__moe_max(W * R, Ws * Ts); break;
    default: /* GTS, ITS */ *rows = dsk__moe_max(W * dsk__moe_chunks(R), Ws * dsk__moe_chunks(Ts)); break;
    }
    if (*cols && !codes) *cols = dsk__moe_chunks(*cols);
}

static int dsk__moe_chunking(const dsk_moe *m, const dsk_ctx *ctx);

/* The dtype and (rows, cols) of buffer id for T tokens and R expert rows (cols 0: 1-D), with N
   the loss span's rows (sequences of the sequence-wise loss) and act the activations' dtype. */
static void dsk__moe_spec_at(const dsk_moe *m, int id, int64_t T, int64_t R, int64_t N, dsk_dtype act, dsk_dtype *dt,
                             int64_t *rows, int64_t *cols) {
    const dsk_moe_opts *o = &m->opts;
    int64_t D = o->d_model, E = o->n_routed, K = o->top_k, F = o->d_expert, Fs = m->d_shared_total, TK = T * K;
    int64_t L = o->seq_aux_alpha > 0 && o->seq_len ? o->seq_len : (N > 0 ? N : 1), NS = N / L > 0 ? N / L : 1;
    int ep = m->ep_size > 1, shared = Fs > 0, losses = o->aux_alpha > 0 || o->seq_aux_alpha > 0 || o->z_beta > 0;
    int bounded = ep && o->ep_exchange == DSK_MOE_EP_BOUNDED, fp8 = o->expert_gemm == DSK_MOE_GEMM_FP8;
    *dt = act;
    *cols = 0;
    *rows = 0;
    if ((id >= DSK__MOE_XQ && id <= DSK__MOE_ASQS) || (id >= DSK__MOE_W8 && id <= DSK__MOE_ITS)) {
        dsk__moe_spec_fp8(m, id, T, R, dt, rows, cols);
        return;
    }
    switch (id) {
    case DSK__MOE_XF: *dt = DSK_F32; *rows = T; *cols = D; break;
    case DSK__MOE_XA: *rows = act == DSK_F32 ? 0 : T; *cols = D; break;
    case DSK__MOE_U: case DSK__MOE_PROB: *dt = DSK_F32; *rows = T; *cols = E; break;
    case DSK__MOE_SCR: *dt = DSK_F32; *rows = T; *cols = E + o->n_group; break;
    case DSK__MOE_SEL:
    case DSK__MOE_LSEL:
        *dt = DSK_I32;
        *rows = id == DSK__MOE_SEL || losses ? T : 0;
        *cols = K;
        break;
    case DSK__MOE_GATE: case DSK__MOE_DGATE: *dt = DSK_F32; *rows = T; *cols = K; break;
    case DSK__MOE_KEYS: case DSK__MOE_PERM_ALL: case DSK__MOE_PERM: case DSK__MOE_POS: case DSK__MOE_ROW_TOK:
        *dt = DSK_I32; *rows = TK; break;
    case DSK__MOE_KEYS2: *dt = DSK_I32; *rows = o->capacity_factor > 0 ? TK : 0; break;
    case DSK__MOE_ROW_GATE: *dt = DSK_F32; *rows = TK; break;
    case DSK__MOE_PTOT: *dt = DSK_F64; *rows = losses ? T : 0; break;
    case DSK__MOE_LSE: *dt = DSK_F32; *rows = o->z_beta > 0 ? T : 0; break;
    case DSK__MOE_PART:
        *dt = DSK_F64;
        *rows = 2 * E + 2 * NS * E + DSK__MOE_PART_TAIL;
        break;
    case DSK__MOE_AUX:
        *dt = DSK_F32;
        *rows = NS;
        *cols = E;
        break;
    case DSK__MOE_LOSS: *dt = DSK_F64; *rows = 4; break;
    case DSK__MOE_OFF_ALL: case DSK__MOE_OFF: *dt = DSK_I32; *rows = E + 1; break;
    case DSK__MOE_CNT: *dt = DSK_I64; *rows = 3 + 2 * E; break;
    case DSK__MOE_CNTG: *dt = DSK_I64; *rows = ep ? 3 + 2 * E : 0; break;
    case DSK__MOE_XS:
    case DSK__MOE_DOS:
        *rows = id == DSK__MOE_XS && fp8 ? 0 : TK;
        *cols = D;
        break;
    case DSK__MOE_XR:
    case DSK__MOE_DOR:
        *rows = ep && (id == DSK__MOE_DOR || !fp8) ? R : 0;
        *cols = D;
        break;
    case DSK__MOE_STAGE: *rows = ep ? (R > TK ? R : TK) : 0; *cols = D; break;
    case DSK__MOE_Q8:
    case DSK__MOE_Q8R:
    case DSK__MOE_Q8S:
    case DSK__MOE_Q8RS:
        *dt = id == DSK__MOE_Q8 || id == DSK__MOE_Q8R ? DSK_E4M3 : DSK_F32;
        *rows = ep && o->ep_dispatch == DSK_MOE_DISPATCH_FP8 ? (id == DSK__MOE_Q8 || id == DSK__MOE_Q8S ? TK : R) : 0;
        *cols = id == DSK__MOE_Q8 || id == DSK__MOE_Q8R ? D : (D + 127) / 128;
        break;
    case DSK__MOE_OB: case DSK__MOE_DXP: *rows = ep ? TK : 0; *cols = D; break;
    case DSK__MOE_H1: case DSK__MOE_H3: case DSK__MOE_A: case DSK__MOE_DA: case DSK__MOE_DH1: case DSK__MOE_DH3:
        *rows = id == DSK__MOE_A && fp8 ? 0 : R;
        *cols = F;
        break;
    case DSK__MOE_O: case DSK__MOE_DXR: *rows = R; *cols = D; break;
    case DSK__MOE_HS1: case DSK__MOE_HS3: case DSK__MOE_AS: case DSK__MOE_DAS: case DSK__MOE_DHS1: case DSK__MOE_DHS3:
        *rows = shared && !(id == DSK__MOE_AS && fp8) ? T : 0;
        *cols = Fs;
        break;
    case DSK__MOE_YS: *rows = shared ? T : 0; *cols = D; break;
    case DSK__MOE_RECV_CNT: *dt = DSK_I64; *rows = ep ? (int64_t)m->ep_size * m->n_local : 0; break;
    case DSK__MOE_LOCAL_OFF: *dt = DSK_I32; *rows = ep ? m->n_local + 1 : 0; break;
    case DSK__MOE_RG: case DSK__MOE_RGI: *dt = DSK_I32; *rows = ep ? R : 0; break;
    case DSK__MOE_EP_PAD:
    case DSK__MOE_EP_SKEY:
    case DSK__MOE_EP_RKEY:
        *dt = DSK_I32;
        *rows = bounded ? R : 0;
        break;
    case DSK__MOE_EP_UNPAD:
        *dt = DSK_I32;
        *rows = bounded ? TK : 0;
        break;
    case DSK__MOE_CHUNK_SEG:
    case DSK__MOE_EP_SEG:
        *dt = DSK_I32;
        *rows = ep && (id == DSK__MOE_CHUNK_SEG || (bounded && dsk__moe_chunking(m, NULL)))
                    ? (int64_t)m->ep_size * (m->n_local + 1)
                    : 0;
        break;
    case DSK__MOE_CH_H1:
    case DSK__MOE_CH_H3:
    case DSK__MOE_CH_A:
    case DSK__MOE_CH_DH1:
    case DSK__MOE_CH_DH3:
        *rows = dsk__moe_chunking(m, NULL) ? R : 0;
        *cols = F;
        break;
    case DSK__MOE_STAGE2:
        *rows = bounded ? R : 0;
        *cols = D;
        break;
    case DSK__MOE_DYA: *rows = act != o->dtype ? T : 0; *cols = D; break;
    case DSK__MOE_DXF: *dt = DSK_F32; *rows = T; *cols = D; break;
    case DSK__MOE_DU: *dt = DSK_F32; *rows = T; *cols = E; break;
    case DSK__MOE_LOAD: *dt = DSK_I64; *rows = E; break;
    case DSK__MOE_ACC_I: *dt = DSK_I64; *rows = 5 + E; break;
    case DSK__MOE_ACC_F: *dt = DSK_F64; *rows = 3; break;
    default: { /* act copies of the weights */
        const dsk_moe_param *p = id >= DSK__MOE_WA && id < DSK__MOE_WA_END ? &m->params[DSK_MOE_P_W1 + id - DSK__MOE_WA]
                                                                          : NULL;
        if (p && DSK_MOE_P_W1 + id - DSK__MOE_WA < m->n_params && p->dtype != act)
            *rows = p->shape[0] * p->shape[1] * (p->ndim == 3 ? p->shape[2] : 1);
        break;
    }
    }
}

static void dsk__moe_spec(const dsk_moe *m, int id, int64_t T, int64_t R, dsk_dtype *dt, int64_t *rows, int64_t *cols) {
    dsk__moe_spec_at(m, id, T, R, m->st->f->N, m->st->act, dt, rows, cols);
}

/* Buffer id's memory: the current saved forward's for a kept buffer, else the layer's. */
static dsk__moe_store *dsk__moe_store_of(struct dsk__moe_state *st, int id) {
    return id < DSK__MOE_NSAVED ? &st->f->buf[id] : &st->buf[id - DSK__MOE_NSAVED];
}

/* Buffer id as a tensor for T tokens and R expert rows, grown when too small. Never called for
   a buffer whose contents must survive (forward activations from backward use dsk__moe_saved). */
static dsk_status dsk__moe_buf(dsk_moe *m, dsk_ctx *ctx, int id, int64_t T, int64_t R, dsk_tensor *out) {
    dsk__moe_store *b = dsk__moe_store_of(m->st, id);
    dsk_dtype dt;
    int64_t rows, cols, shape[2];
    size_t bytes;
    dsk__moe_spec(m, id, T, R, &dt, &rows, &cols);
    bytes = (size_t)(rows * (cols ? cols : 1)) * dsk_dtype_size(dt);
    if (bytes > b->cap || !b->mem.data) {
        int64_t n = (int64_t)(bytes ? bytes : 1);
        dsk_tensor_free(ctx, &b->mem);
        b->cap = 0;
        DSK__TRY(dsk_tensor_alloc_on(ctx, m->device, &b->mem, DSK_U8, 1, &n));
        b->cap = bytes;
    }
    shape[0] = rows;
    shape[1] = cols;
    return dsk_tensor_wrap(out, b->mem.data, dt, m->device, cols ? 2 : 1, shape);
}

/* A buffer the saved forward wrote, as a tensor of its forward shape (never reallocated). */
static dsk_tensor dsk__moe_saved(const dsk_moe *m, int id) {
    const struct dsk__moe_state *st = m->st;
    dsk_tensor t;
    dsk_dtype dt;
    int64_t rows, cols, shape[2];
    dsk__moe_spec(m, id, st->f->T, st->f->R, &dt, &rows, &cols);
    shape[0] = rows;
    shape[1] = cols;
    dsk_tensor_wrap(&t, dsk__moe_store_of(m->st, id)->mem.data, dt, m->device, cols ? 2 : 1, shape);
    return t;
}

/* Rows r0 .. r0 + n of t (a view). */
static dsk_tensor dsk__moe_row_range(const dsk_tensor *t, int64_t r0, int64_t n) {
    dsk_tensor v;
    dsk_tensor_slice(t, 0, r0, n, &v);
    return v;
}

/* The first n rows of t (a view). */
static dsk_tensor dsk__moe_rows(const dsk_tensor *t, int64_t n) { return dsk__moe_row_range(t, 0, n); }

static void dsk__moe_hop_free(struct dsk__moe_hop *h, dsk_ctx *ctx);

static void dsk__moe_fwd_free(struct dsk__moe_fwd *f, dsk_ctx *ctx) {
    if (!f) return;
    for (int i = 0; i < DSK__MOE_NSAVED; i++) dsk_tensor_free(ctx, &f->buf[i].mem);
    DSK_FREE(f->h_recv_cnt);
    DSK_FREE(f->a2a);
    DSK_FREE(f->send_rows);
    DSK_FREE(f->recv_rows);
    DSK_FREE(f->local_off);
    DSK_FREE(f->h_rg);
    dsk__moe_hop_free(f->hop, ctx);
    DSK_FREE(f);
}

/* A saved forward's host arrays, sized for the layer's expert parallelism; NULL when out of memory. */
static struct dsk__moe_fwd *dsk__moe_fwd_new(const dsk_moe *m) {
    int64_t P = m->ep_size, El = m->n_local;
    struct dsk__moe_fwd *f = (struct dsk__moe_fwd *)DSK_MALLOC(sizeof *f);
    if (!f) return NULL;
    memset(f, 0, sizeof *f);
    f->n_kept = -1;
    f->h_recv_cnt = (int64_t *)DSK_MALLOC((size_t)(P * El) * sizeof(int64_t));
    f->a2a = (int64_t *)DSK_MALLOC((size_t)(8 * P) * sizeof(int64_t));
    f->send_rows = (int64_t *)DSK_MALLOC((size_t)P * sizeof(int64_t));
    f->recv_rows = (int64_t *)DSK_MALLOC((size_t)P * sizeof(int64_t));
    f->local_off = (int64_t *)DSK_MALLOC((size_t)(El + 1) * sizeof(int64_t));
    if (f->h_recv_cnt && f->a2a && f->send_rows && f->recv_rows && f->local_off) return f;
    dsk__moe_fwd_free(f, NULL);
    return NULL;
}

static void dsk__moe_pending_free(struct dsk__moe_state *st);

static void dsk__moe_state_free(dsk_moe *m, dsk_ctx *ctx) {
    struct dsk__moe_state *st = m->st;
    dsk__moe_pending_free(st); /* after its exchange, if one is in flight */
#ifdef DSK_CUDA
    if (st->side) (void)dsk_cuda_stream_sync(st->side); /* nothing may still use the buffers */
#endif
    for (int i = 0; i < st->n_fwds; i++) dsk__moe_fwd_free(st->fwds[i], ctx);
    DSK_FREE(st->fwds);
    for (int i = 0; i < DSK__MOE_NBUF - DSK__MOE_NSAVED; i++) dsk_tensor_free(ctx, &st->buf[i].mem);
#ifdef DSK_CUDA
    if (m->device.type == DSK_DEV_CUDA) { /* pinned, not DSK_MALLOC'd */
        dsk_cuda_host_free(st->col_acc_i);
        dsk_cuda_host_free(st->col_acc_f);
        dsk_cuda_event_destroy(st->event);
        dsk_cuda_stream_destroy(st->side);
        dsk_cuda_event_destroy(st->ev_fork);
        dsk_cuda_event_destroy(st->ev_join);
        for (int i = 0; st->ev_shift && i < m->ep_size - 1; i++) dsk_cuda_event_destroy(st->ev_shift[i]);
        DSK_FREE(st->ev_shift);
        st->side = st->ev_fork = st->ev_join = NULL;
        st->col_acc_i = NULL;
        st->col_acc_f = NULL;
    }
#endif
    DSK_FREE(st->h_cnt);
    DSK_FREE(st->arrival_order);
    DSK_FREE(st->landed);
    DSK_FREE(st->chunk_seg);
    DSK_FREE(st->fwd_loads);
    DSK_FREE(st->col_acc_i);
    DSK_FREE(st->col_acc_f);
    DSK_FREE(st);
    m->st = NULL;
}

/* ---------------------------------------------------------------- options and init */

static dsk_status dsk__moe_resolve(dsk_moe_opts *o, int ep_size) {
    const char *fn = "dsk_moe_init";
    if (!o->name) o->name = "moe";
    if (strlen(o->name) > 64)
        return dsk_set_error(DSK_ERR_ARG, "%s: name \"%.20s...\" longer than 64 characters", fn, o->name);
    if (o->d_model <= 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": d_model %lld must be > 0", fn, o->name,
                             (long long)o->d_model);
    if (o->n_routed <= 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": n_routed %d must be > 0", fn, o->name, o->n_routed);
    if (o->top_k <= 0 || o->top_k > o->n_routed)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": top_k %d outside [1, n_routed %d]", fn, o->name, o->top_k,
                             o->n_routed);
    if (o->d_expert <= 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": d_expert %lld must be > 0", fn, o->name,
                             (long long)o->d_expert);
    if (o->n_shared < 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": n_shared %d < 0", fn, o->name, o->n_shared);
    if (o->d_shared < 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": d_shared %lld < 0", fn, o->name, (long long)o->d_shared);
    if (!o->d_shared) o->d_shared = o->d_expert;
    if (o->score != DSK_MOE_SOFTMAX && o->score != DSK_MOE_SIGMOID)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": unknown score function %d", fn, o->name, (int)o->score);
    if ((int)o->norm < 0 || (int)o->norm > 2)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": unknown norm setting %d", fn, o->name, (int)o->norm);
    if (o->norm == DSK_MOE_NORM_DEFAULT) o->norm = o->score == DSK_MOE_SIGMOID ? DSK_MOE_NORM_ON : DSK_MOE_NORM_OFF;
    if (o->routed_scale == 0.0f) o->routed_scale = 1.0f;
    if (!(o->routed_scale > 0.0f) || !isfinite(o->routed_scale))
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": routed_scale %g must be finite and > 0", fn, o->name,
                             (double)o->routed_scale);
    if (o->n_group < 0 || o->topk_group < 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": n_group %d, topk_group %d must be >= 0", fn, o->name,
                             o->n_group, o->topk_group);
    if (!o->n_group) o->n_group = 1;
    if (!o->topk_group) o->topk_group = o->n_group;
    if (o->n_routed % o->n_group)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": n_routed %d not divisible by n_group %d", fn, o->name,
                             o->n_routed, o->n_group);
    if (o->topk_group > o->n_group)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": topk_group %d > n_group %d", fn, o->name, o->topk_group,
                             o->n_group);
    if ((int)o->group_rule < 0 || (int)o->group_rule > DSK_MOE_GROUP_MEGATRON)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": unknown group rule %d", fn, o->name, (int)o->group_rule);
    if (o->group_rule == DSK_MOE_GROUP_MEGATRON && o->n_group > 1 && o->top_k < o->topk_group)
        return dsk_set_error(DSK_ERR_ARG,
                             "%s: layer \"%s\": DSK_MOE_GROUP_MEGATRON sums a group's top_k / topk_group largest "
                             "scores: top_k %d < topk_group %d sums none",
                             fn, o->name, o->top_k, o->topk_group);
    if ((int64_t)o->topk_group * (o->n_routed / o->n_group) < o->top_k)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": top_k %d > the %d experts in topk_group %d groups of %d",
                             fn, o->name, o->top_k, o->topk_group * (o->n_routed / o->n_group), o->topk_group,
                             o->n_routed / o->n_group);
    if (o->loss_count != DSK_MOE_COUNT_TOPK && o->loss_count != DSK_MOE_COUNT_SELECTED)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": unknown loss count rule %d", fn, o->name,
                             (int)o->loss_count);
    if (o->aux_alpha < 0 || o->seq_aux_alpha < 0 || o->z_beta < 0 || o->bias_rate < 0 || o->capacity_factor < 0 ||
        !isfinite(o->aux_alpha) || !isfinite(o->seq_aux_alpha) || !isfinite(o->z_beta) || !isfinite(o->bias_rate) ||
        !isfinite(o->capacity_factor))
        return dsk_set_error(DSK_ERR_ARG,
                             "%s: layer \"%s\": aux_alpha %g, seq_aux_alpha %g, z_beta %g, bias_rate %g, "
                             "capacity_factor %g must be finite and >= 0",
                             fn, o->name, (double)o->aux_alpha, (double)o->seq_aux_alpha, (double)o->z_beta,
                             (double)o->bias_rate, (double)o->capacity_factor);
    if (o->seq_len < 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": seq_len %lld < 0", fn, o->name, (long long)o->seq_len);
    if (!o->bias_rate) o->bias_rate = 1e-3f;
    if (o->drop != DSK_MOE_DROP_PROB && o->drop != DSK_MOE_DROP_POSITION)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": unknown drop policy %d", fn, o->name, (int)o->drop);
    if (o->ep_dispatch != DSK_MOE_DISPATCH_ACT && o->ep_dispatch != DSK_MOE_DISPATCH_FP8)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": unknown ep_dispatch %d", fn, o->name, (int)o->ep_dispatch);
#ifndef DSK_AMP_H
    if (o->ep_dispatch == DSK_MOE_DISPATCH_FP8)
        return dsk_set_error(DSK_ERR_UNSUPPORTED,
                             "%s: layer \"%s\": FP8 dispatch needs dsk_amp.h included before "
                             "dsk_moe.h in the implementation",
                             fn, o->name);
#endif
    if (o->expert_gemm != DSK_MOE_GEMM_ACT && o->expert_gemm != DSK_MOE_GEMM_FP8)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": unknown expert_gemm %d (act 0, fp8 1)", fn, o->name,
                             (int)o->expert_gemm);
#ifndef DSK_AMP_H
    if (o->expert_gemm == DSK_MOE_GEMM_FP8)
        return dsk_set_error(DSK_ERR_UNSUPPORTED,
                             "%s: layer \"%s\": FP8 experts need dsk_amp.h included before dsk_moe.h in the "
                             "implementation",
                             fn, o->name);
#endif
    if (o->dtype != DSK_F32 && o->dtype != DSK_BF16)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": dtype %s not supported (f32 or bf16)", fn, o->name,
                             dsk_dtype_name(o->dtype));
    if (o->init_std < 0 || !isfinite(o->init_std))
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": init_std %g must be finite and >= 0", fn, o->name,
                             (double)o->init_std);
    if (!o->init_std) o->init_std = 0.02f;
    if (o->ep_exchange != DSK_MOE_EP_EXACT && o->ep_exchange != DSK_MOE_EP_BOUNDED)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": unknown ep_exchange %d (exact 0, bounded 1)", fn, o->name,
                             (int)o->ep_exchange);
    if (o->ep_chunk != DSK_MOE_CHUNK_AUTO && o->ep_chunk != DSK_MOE_CHUNK_OFF && o->ep_chunk != DSK_MOE_CHUNK_ON)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": unknown ep_chunk %d (auto 0, off 1, on 2)", fn, o->name,
                             (int)o->ep_chunk);
    if (o->ep_exchange == DSK_MOE_EP_BOUNDED && o->ep_dispatch == DSK_MOE_DISPATCH_FP8)
        return dsk_set_error(DSK_ERR_UNSUPPORTED,
                             "%s: layer \"%s\": FP8 dispatch runs on the exact exchange (ep_exchange 0), not the "
                             "bounded one",
                             fn, o->name);
    if (o->n_routed % ep_size)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": n_routed %d not divisible by the expert-parallel size %d",
                             fn, o->name, o->n_routed, ep_size);
    return DSK_OK;
}

/* Node-limited routing (opts.node_limit = M) as group-limited routing: the ep group's nodes are the
   groups (expert parallelism places experts in rank order, so node g holds group g when ranks are
   numbered node by node), M kept, each ranked by its top_k / M largest selection scores. */
static dsk_status dsk__moe_node_groups(dsk_moe_opts *o) {
    const char *fn = "dsk_moe_init", *name = o->name ? o->name : "moe";
    const dsk_comm *c = o->ep;
    if (!o->node_limit) return DSK_OK;
    if (o->node_limit < 0 || !c)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": node_limit %d needs an expert-parallel group and M > 0",
                             fn, name, o->node_limit);
    if (o->n_group > 1 || o->topk_group)
        return dsk_set_error(DSK_ERR_ARG,
                             "%s: layer \"%s\": node_limit %d sets the groups; n_group %d, topk_group "
                             "%d must be 0",
                             fn, name, o->node_limit, o->n_group, o->topk_group);
    if (c->world_size % c->n_nodes || c->node != c->rank / (c->world_size / c->n_nodes))
        return dsk_set_error(DSK_ERR_ARG,
                             "%s: layer \"%s\": node_limit needs the expert-parallel ranks numbered "
                             "node by node on nodes of equal size (rank %d of %d is on node %d of %d)",
                             fn, name, c->rank, c->world_size, c->node, c->n_nodes);
    if (o->node_limit > c->n_nodes || o->top_k < o->node_limit)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": node_limit %d must be <= the %d nodes and <= top_k %d", fn,
                             name, o->node_limit, c->n_nodes, o->top_k);
    o->n_group = c->n_nodes;
    o->topk_group = o->node_limit;
    o->group_rule = DSK_MOE_GROUP_MEGATRON;
    return DSK_OK;
}

/* The routing configuration of resolved options. */
static dsk_moe_router dsk__moe_router_of(const dsk_moe_opts *o) {
    dsk_moe_router r;
    memset(&r, 0, sizeof r);
    r.n_experts = o->n_routed;
    r.top_k = o->top_k;
    r.score = o->score;
    r.norm = o->norm == DSK_MOE_NORM_ON;
    r.scale = o->routed_scale;
    r.n_group = o->n_group;
    r.topk_group = o->topk_group;
    r.group_rule = o->group_rule;
    return r;
}

/* ---------------------------------------------------------------- parameters */

/* Reports the parameters: names, this rank's shapes, dtypes, flags; nothing bound. */
static void dsk__moe_declare(dsk_moe *m) {
    const dsk_moe_opts *o = &m->opts;
    int64_t D = o->d_model, E = o->n_routed, F = o->d_expert, Fs = m->d_shared_total, El = m->n_local;
    static const char *suffix[DSK_MOE_N_PARAMS] = {"router", "bias", "w1", "w2", "w3", "shared.w1", "shared.w2",
                                                   "shared.w3"};
    const int64_t shapes[DSK_MOE_N_PARAMS][3] = {{E, D, 0}, {E, 0, 0}, {El, F, D}, {El, D, F},
                                                 {El, F, D}, {Fs, D, 0}, {D, Fs, 0}, {Fs, D, 0}};
    m->n_params = o->n_shared > 0 ? DSK_MOE_N_PARAMS : DSK_MOE_P_SW1;
    for (int i = 0; i < m->n_params; i++) {
        dsk_moe_param *p = &m->params[i];
        memset(p, 0, sizeof *p);
        snprintf(p->name, sizeof p->name, "%s.%s", o->name, suffix[i]);
        p->ndim = i == DSK_MOE_P_BIAS ? 1 : i >= DSK_MOE_P_W1 && i <= DSK_MOE_P_W3 ? 3 : 2;
        for (int d = 0; d < p->ndim; d++) p->shape[d] = shapes[i][d];
        p->dtype = i <= DSK_MOE_P_BIAS ? DSK_F32 : o->dtype;
        p->expert_sharded = i >= DSK_MOE_P_W1 && i <= DSK_MOE_P_W3;
        p->weight_decay = i != DSK_MOE_P_BIAS;
        p->trainable = i != DSK_MOE_P_BIAS;
        p->value.dtype = p->dtype;
        p->value.device = m->device;
        p->grad.dtype = DSK_F32;
        p->grad.device = m->device;
    }
    m->router = &m->params[DSK_MOE_P_ROUTER]; m->bias = &m->params[DSK_MOE_P_BIAS];
    m->w1 = &m->params[DSK_MOE_P_W1]; m->w2 = &m->params[DSK_MOE_P_W2]; m->w3 = &m->params[DSK_MOE_P_W3];
    m->sw1 = m->n_params > DSK_MOE_P_SW1 ? &m->params[DSK_MOE_P_SW1] : NULL;
    m->sw2 = m->n_params > DSK_MOE_P_SW1 ? &m->params[DSK_MOE_P_SW2] : NULL;
    m->sw3 = m->n_params > DSK_MOE_P_SW1 ? &m->params[DSK_MOE_P_SW3] : NULL;
}

static int64_t dsk__moe_param_numel(const dsk_moe_param *p) {
    int64_t n = 1;
    for (int d = 0; d < p->ndim; d++) n *= p->shape[d];
    return n;
}

static dsk_status dsk__moe_alloc_state(dsk_moe *m, dsk_ctx *ctx) {
    struct dsk__moe_state *st;
    int64_t E = m->opts.n_routed, P = m->ep_size;
    dsk_tensor t;
    m->st = st = (struct dsk__moe_state *)DSK_MALLOC(sizeof *st);
    if (!st) return dsk_set_error(DSK_ERR_OOM, "dsk_moe_init: out of host memory");
    memset(st, 0, sizeof *st);
    st->act = m->device.type == DSK_DEV_CPU ? DSK_F32 : m->opts.dtype;
    st->fwds = (struct dsk__moe_fwd **)DSK_MALLOC(sizeof *st->fwds);
    if (!st->fwds || !(st->fwds[0] = st->f = dsk__moe_fwd_new(m)))
        return dsk_set_error(DSK_ERR_OOM, "dsk_moe_init: out of host memory");
    st->n_fwds = 1;
    st->h_cnt = (int64_t *)DSK_MALLOC((size_t)(3 + 2 * E) * sizeof(int64_t));
    st->arrival_order = (int *)DSK_MALLOC((size_t)P * sizeof(int));
    st->landed = (int *)DSK_MALLOC((size_t)P * sizeof(int));
    st->chunk_seg = (int32_t *)DSK_MALLOC((size_t)(P * (m->n_local + 1)) * sizeof(int32_t));
    st->fwd_loads = (int64_t *)DSK_MALLOC((size_t)E * sizeof(int64_t));
#ifdef DSK_CUDA
    if (m->device.type == DSK_DEV_CUDA) { /* statistics come back into pinned memory after an event */
        st->col_acc_i = (int64_t *)dsk_cuda_host_alloc((size_t)(5 + E) * sizeof(int64_t));
        st->col_acc_f = (double *)dsk_cuda_host_alloc(3 * sizeof(double));
        DSK__TRY(dsk_cuda_event_create(&st->event));
        if (m->opts.ep_overlap && P > 1) { /* the exchanges' stream */
            DSK__TRY(dsk_cuda_stream_create(&st->side));
            DSK__TRY(dsk_cuda_event_create(&st->ev_fork));
            DSK__TRY(dsk_cuda_event_create(&st->ev_join));
            if (!(st->ev_shift = (void **)DSK_MALLOC((size_t)(P - 1) * sizeof(void *))))
                return dsk_set_error(DSK_ERR_OOM, "dsk_moe_init: out of host memory");
            memset(st->ev_shift, 0, (size_t)(P - 1) * sizeof(void *));
            for (int i = 0; i < P - 1; i++) DSK__TRY(dsk_cuda_event_create(&st->ev_shift[i]));
        }
    } else
#endif
    {
        st->col_acc_i = (int64_t *)DSK_MALLOC((size_t)(5 + E) * sizeof(int64_t));
        st->col_acc_f = (double *)DSK_MALLOC(3 * sizeof(double));
    }
    if (!st->h_cnt || !st->arrival_order || !st->landed || !st->chunk_seg || !st->fwd_loads || !st->col_acc_i ||
        !st->col_acc_f)
        return dsk_set_error(DSK_ERR_OOM, "dsk_moe_init: out of host memory");
    memset(st->col_acc_i, 0, (size_t)(5 + E) * sizeof(int64_t));
    memset(st->col_acc_f, 0, 3 * sizeof(double));
    /* the persistent device state: bias-update loads and statistics, from zero */
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_LOAD, 0, 0, &t));
    DSK__TRY(dsk_tensor_fill(ctx, &t, 0.0));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_ACC_I, 0, 0, &t));
    DSK__TRY(dsk_tensor_fill(ctx, &t, 0.0));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_ACC_F, 0, 0, &t));
    return dsk_tensor_fill(ctx, &t, 0.0);
}

/* opts.ep_route resolved to FLAT or TWO_HOP (AUTO: two hops where the ep group spans nodes and they can run). */
static dsk_status dsk__moe_ep_route_resolve(dsk_moe *m) {
    dsk_moe_opts *o = &m->opts;
    const dsk_comm *c = o->ep;
    const char *no = NULL;
    int even = 1;
    if (o->ep_route != DSK_MOE_ROUTE_AUTO && o->ep_route != DSK_MOE_ROUTE_FLAT && o->ep_route != DSK_MOE_ROUTE_TWO_HOP)
        return dsk_set_error(DSK_ERR_ARG, "dsk_moe_init: layer \"%s\": unknown ep_route %d (auto 0, flat 1, two-hop 2)",
                             o->name, (int)o->ep_route);
    for (int r = 0; m->ep_size > 1 && c->n_nodes > 1 && r < c->world_size; r++) { /* one node: nothing to check */
        int size = 0;
        for (int q = 0; q < c->world_size; q++) size += dsk_comm_node_of(c, q) == dsk_comm_node_of(c, r);
        even = even && size == c->node_size;
    }
    if (m->ep_size <= 1) no = "an expert-parallel group of 2 or more ranks";
    else if (o->ep_exchange != DSK_MOE_EP_EXACT) no = "the exact exchange (ep_exchange 0), not the bounded one";
    else if (o->ep_dispatch != DSK_MOE_DISPATCH_ACT) no = "dispatch in the activation dtype (ep_dispatch 0), not FP8";
    else if (o->expert_gemm != DSK_MOE_GEMM_ACT) no = "experts in the activation dtype (expert_gemm 0), not FP8";
    else if (!even) no = "an expert-parallel group whose nodes have one size";
    if (o->ep_route == DSK_MOE_ROUTE_AUTO) /* CUDA: flat, as a two-hop route is planned on the host (syncs) */
        o->ep_route =
            !no && c->n_nodes > 1 && m->device.type == DSK_DEV_CPU ? DSK_MOE_ROUTE_TWO_HOP : DSK_MOE_ROUTE_FLAT;
    else if (o->ep_route == DSK_MOE_ROUTE_TWO_HOP && no)
        return dsk_set_error(m->ep_size <= 1 ? DSK_ERR_ARG : DSK_ERR_UNSUPPORTED,
                             "dsk_moe_init: layer \"%s\": ep_route two-hop needs %s", o->name, no);
    return DSK_OK;
}

DSK_API dsk_status dsk_moe_init(dsk_moe *m, dsk_ctx *ctx, const dsk_moe_opts *opts) {
    dsk_status s;
    if (!m) return dsk_set_error(DSK_ERR_ARG, "dsk_moe_init: layer is NULL");
    memset(m, 0, sizeof *m);
    if (!opts) return dsk_set_error(DSK_ERR_ARG, "dsk_moe_init: opts is NULL");
    m->opts = *opts;
    m->ep_size = 1;
    if (opts->ep) {
        if (opts->ep->world_size < 1 || !opts->ep->impl)
            return dsk_set_error(DSK_ERR_ARG, "dsk_moe_init: expert-parallel communicator is not initialised");
        m->ep_rank = opts->ep->rank;
        m->ep_size = opts->ep->world_size;
    }
    s = dsk__moe_node_groups(&m->opts);
    if (s == DSK_OK) s = dsk__moe_resolve(&m->opts, m->ep_size);
    if (s != DSK_OK) {
        memset(m, 0, sizeof *m);
        return s;
    }
    m->routing = dsk__moe_router_of(&m->opts);
    m->d_shared_total = (int64_t)m->opts.n_shared * m->opts.d_shared;
    m->n_local = m->opts.n_routed / m->ep_size;
    m->expert0 = m->ep_rank * m->n_local;
    m->device = ctx ? ctx->device : dsk_cpu();
    if (opts->ep && m->ep_size > 1 && (m->device.type == DSK_DEV_CUDA) != (opts->ep->backend == DSK_COMM_NCCL)) {
        memset(m, 0, sizeof *m);
        return dsk_set_error(
            DSK_ERR_UNSUPPORTED,
            "dsk_moe_init: layer \"%s\": a %s layer needs an expert-parallel communicator on the %s backend",
            opts->name ? opts->name : "moe", ctx && ctx->device.type == DSK_DEV_CUDA ? "CUDA" : "CPU",
            ctx && ctx->device.type == DSK_DEV_CUDA ? "nccl" : "host");
    }
#ifndef DSK_CUDA
    if (m->device.type != DSK_DEV_CPU) {
        memset(m, 0, sizeof *m);
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "dsk_moe_init: CUDA context in a build without DSK_CUDA");
    }
#endif
    if ((s = dsk__moe_ep_route_resolve(m)) != DSK_OK) {
        memset(m, 0, sizeof *m);
        return s;
    }
    dsk__moe_declare(m);
    s = dsk__moe_alloc_state(m, ctx);
    if (s != DSK_OK) { /* free what was made, keep the first error's message */
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", dsk_last_error());
        dsk_moe_free(m, ctx);
        return dsk_set_error(s, "%s", msg);
    }
    return DSK_OK;
}

DSK_API void dsk_moe_free(dsk_moe *m, dsk_ctx *ctx) {
    if (!m) return;
    if (m->st) dsk__moe_state_free(m, ctx);
    memset(m, 0, sizeof *m);
}

static dsk_status dsk__moe_need_layer(const dsk_moe *m, const char *fn) {
    if (!m) return dsk_set_error(DSK_ERR_ARG, "%s: layer is NULL", fn);
    if (!m->st) return dsk_set_error(DSK_ERR_STATE, "%s: layer not initialised", fn);
    return DSK_OK;
}

/* A CUDA layer's calls take a CUDA ctx. */
static dsk_status dsk__moe_need_cuda_ctx(const dsk_moe *m, const dsk_ctx *ctx, const char *fn) {
    if (m->device.type == DSK_DEV_CUDA && (!ctx || ctx->device.type != DSK_DEV_CUDA))
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\" is on CUDA: pass its CUDA ctx", fn, m->opts.name);
    return DSK_OK;
}

/* No forward or backward begun and not ended holds the layer. */
static dsk_status dsk__moe_need_idle(const dsk_moe *m, const char *fn) {
    int fwd = m->st->pending == DSK__MOE_PEND_FWD;
    if (m->st->pending == DSK__MOE_PEND_NONE) return DSK_OK;
    return dsk_set_error(DSK_ERR_STATE, "%s: layer \"%s\": a %s was begun and not ended: call %s first", fn,
                         m->opts.name, fwd ? "forward" : "backward",
                         fwd ? "dsk_moe_forward_end" : "dsk_moe_backward_end");
}

/* t is a contiguous tensor of p's shape and dtype dt with data on the layer's device. */
static dsk_status dsk__moe_need_view(const dsk_moe *m, const char *fn, const dsk_moe_param *p, const char *what,
                                     const dsk_tensor *t, dsk_dtype dt) {
    char b[96], want[96];
    size_t k = 0;
    int ok = t->ndim == p->ndim && t->dtype == dt && dsk_tensor_is_contiguous(t) && t->device.type == m->device.type &&
             t->device.index == m->device.index && t->data;
    for (int d = 0; ok && d < p->ndim; d++) ok = t->shape[d] == p->shape[d];
    if (ok) return DSK_OK;
    for (int d = 0; d < p->ndim; d++)
        k += (size_t)snprintf(want + k, sizeof want - k, d ? ",%lld" : "[%lld", (long long)p->shape[d]);
    snprintf(want + k, sizeof want - k, "] %s", dsk_dtype_name(dt));
    return dsk_set_error(DSK_ERR_ARG, "%s: parameter \"%s\": %s is %s%s on %s, want %s, contiguous with data on %s", fn,
                         p->name, what, dsk_tensor_describe(t, b, sizeof b), t->data ? "" : " without data",
                         t->device.type == DSK_DEV_CUDA ? "CUDA" : "the CPU", want,
                         m->device.type == DSK_DEV_CUDA ? "CUDA" : "the CPU");
}

DSK_API dsk_status dsk_moe_bind(dsk_moe *m, dsk_ctx *ctx, int index, const dsk_tensor *value, const dsk_tensor *grad) {
    const char *fn = "dsk_moe_bind";
    dsk_moe_param *p;
    (void)ctx;
    DSK__TRY(dsk__moe_need_layer(m, fn));
    DSK__TRY(dsk__moe_need_idle(m, fn));
    if (index < 0 || index >= m->n_params)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": parameter index %d outside [0, %d)", fn, m->opts.name,
                             index, m->n_params);
    p = &m->params[index];
    if (!value) return dsk_set_error(DSK_ERR_ARG, "%s: parameter \"%s\": value is NULL", fn, p->name);
    DSK__TRY(dsk__moe_need_view(m, fn, p, "value", value, p->dtype));
    if (p->trainable && !grad)
        return dsk_set_error(DSK_ERR_ARG, "%s: parameter \"%s\" is trainable: its f32 gradient is required", fn,
                             p->name);
    if (!p->trainable && grad)
        return dsk_set_error(DSK_ERR_ARG, "%s: parameter \"%s\" has no gradient: pass NULL", fn, p->name);
    if (grad) DSK__TRY(dsk__moe_need_view(m, fn, p, "grad", grad, DSK_F32));
    p->value = *value;
    p->value.owns = 0;
    if (grad) {
        p->grad = *grad;
        p->grad.owns = 0;
    }
    return DSK_OK;
}

/* Byte offset of each value in the value slab, and element offset of each gradient. */
static void dsk__moe_slab_layout(const dsk_moe *m, int64_t *voff, int64_t *goff, int64_t *vbytes, int64_t *gdense,
                                 int64_t *gsharded) {
    static const int grad_order[DSK_MOE_N_PARAMS] = {0, 5, 6, 7, 2, 3, 4, 1}; /* dense first, then the experts */
    int64_t vb = 0, g = 0;
    *gdense = 0;
    for (int i = 0; i < m->n_params; i++) {
        voff[i] = vb;
        vb += (dsk__moe_param_numel(&m->params[i]) * (int64_t)dsk_dtype_size(m->params[i].dtype) + 255) & ~(int64_t)255;
    }
    for (int j = 0; j < DSK_MOE_N_PARAMS; j++) {
        int i = grad_order[j];
        if (i >= m->n_params || !m->params[i].trainable) continue;
        goff[i] = g;
        g += dsk__moe_param_numel(&m->params[i]);
        if (!m->params[i].expert_sharded) *gdense = g;
    }
    *vbytes = vb;
    *gsharded = g - *gdense;
}

DSK_API void dsk_moe_slab_sizes(const dsk_moe *m, int64_t *value_bytes, int64_t *grad_dense, int64_t *grad_sharded) {
    int64_t voff[DSK_MOE_N_PARAMS], goff[DSK_MOE_N_PARAMS], vb = 0, gd = 0, gs = 0;
    if (m && m->st) dsk__moe_slab_layout(m, voff, goff, &vb, &gd, &gs);
    if (value_bytes) *value_bytes = vb;
    if (grad_dense) *grad_dense = gd;
    if (grad_sharded) *grad_sharded = gs;
}

DSK_API dsk_status dsk_moe_bind_slabs(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *values, dsk_tensor *grads) {
    const char *fn = "dsk_moe_bind_slabs";
    int64_t voff[DSK_MOE_N_PARAMS], goff[DSK_MOE_N_PARAMS], vb, gd, gs;
    char a[96], b[96];
    DSK__TRY(dsk__moe_need_layer(m, fn));
    DSK__TRY(dsk__moe_need_idle(m, fn));
    if (!values || !grads) return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": a slab is NULL", fn, m->opts.name);
    dsk__moe_slab_layout(m, voff, goff, &vb, &gd, &gs);
    if (values->dtype != DSK_U8 || dsk_tensor_numel(values) < vb || !dsk_tensor_is_contiguous(values) ||
        grads->dtype != DSK_F32 || dsk_tensor_numel(grads) < gd + gs || !dsk_tensor_is_contiguous(grads))
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": slabs %s and %s, want at least %lld u8 and %lld f32", fn,
                             m->opts.name, dsk_tensor_describe(values, a, sizeof a),
                             dsk_tensor_describe(grads, b, sizeof b), (long long)vb, (long long)(gd + gs));
    for (int i = 0; i < m->n_params; i++) {
        dsk_moe_param *p = &m->params[i];
        dsk_tensor v, g;
        DSK__TRY(dsk_tensor_wrap(&v, (char *)values->data + voff[i], p->dtype, values->device, p->ndim, p->shape));
        if (p->trainable)
            DSK__TRY(dsk_tensor_wrap(&g, (float *)grads->data + goff[i], DSK_F32, grads->device, p->ndim, p->shape));
        DSK__TRY(dsk_moe_bind(m, ctx, i, &v, p->trainable ? &g : NULL));
    }
    return DSK_OK;
}

DSK_API dsk_status dsk_moe_init_param(dsk_moe *m, dsk_ctx *ctx, int index, dsk_tensor *dst) {
    const char *fn = "dsk_moe_init_param";
    const dsk_moe_param *p;
    uint64_t offset;
    DSK__TRY(dsk__moe_need_layer(m, fn));
    if (index < 0 || index >= m->n_params)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": parameter index %d outside [0, %d)", fn, m->opts.name,
                             index, m->n_params);
    p = &m->params[index];
    if (!dst || !dsk_dtype_is_float(dst->dtype))
        return dsk_set_error(DSK_ERR_ARG, "%s: parameter \"%s\": dst must be a float tensor", fn, p->name);
    DSK__TRY(dsk__moe_need_view(m, fn, p, "dst", dst, dst->dtype));
    if (index == DSK_MOE_P_BIAS) return dsk_tensor_fill(ctx, dst, 0.0);
    /* streams 2^40 apart (router 0, w1 1, w2 2, w3 3, shared.w1 4, ...); an expert slice starts at its global
       element */
    offset = ((uint64_t)(index == DSK_MOE_P_ROUTER ? 0 : index - 1) << 40) +
             (p->expert_sharded ? (uint64_t)m->expert0 * (uint64_t)(p->shape[1] * p->shape[2]) : 0);
    return dsk_tensor_normal(ctx, dst, m->opts.seed, offset, 0.0f, m->opts.init_std);
}

DSK_API dsk_status dsk_moe_init_params(dsk_moe *m, dsk_ctx *ctx) {
    DSK__TRY(dsk__moe_need_layer(m, "dsk_moe_init_params"));
    for (int i = 0; i < m->n_params; i++) DSK__TRY(dsk_moe_init_param(m, ctx, i, &m->params[i].value));
    return DSK_OK;
}

DSK_API dsk_moe_param *dsk_moe_find_param(dsk_moe *m, const char *name) {
    if (!m || !name) return NULL;
    for (int i = 0; i < m->n_params; i++)
        if (!strcmp(m->params[i].name, name)) return &m->params[i];
    return NULL;
}

/* Every parameter bound (forward, backward, bias update need them). */
static dsk_status dsk__moe_need_bound(const dsk_moe *m, const char *fn) {
    for (int i = 0; i < m->n_params; i++)
        if (!m->params[i].value.data || (m->params[i].trainable && !m->params[i].grad.data))
            return dsk_set_error(DSK_ERR_STATE, "%s: layer \"%s\": parameter \"%s\" is not bound (dsk_moe_bind)", fn,
                                 m->opts.name, m->params[i].name);
    return DSK_OK;
}

DSK_API dsk_status dsk_moe_zero_grad(dsk_moe *m, dsk_ctx *ctx) {
    DSK__TRY(dsk__moe_need_layer(m, "dsk_moe_zero_grad"));
    DSK__TRY(dsk__moe_need_bound(m, "dsk_moe_zero_grad"));
    for (int i = 0; i < m->n_params; i++)
        if (m->params[i].trainable) DSK__TRY(dsk_tensor_fill(ctx, &m->params[i].grad, 0.0));
    return DSK_OK;
}

/* Rows of expert work for T tokens without expert parallelism: T*K, or fewer under capacity. */
static int64_t dsk__moe_rows_bound(const dsk_moe *m, int64_t T) {
    int64_t TK = T * m->opts.top_k, cap;
    if (m->opts.capacity_factor <= 0) return TK;
    cap = (int64_t)ceil((double)TK / m->opts.n_routed * m->opts.capacity_factor);
    return cap * m->opts.n_routed < TK ? cap * m->opts.n_routed : TK;
}

/* Bounded expert parallelism: rows each rank sends each peer at most, Cp = T min(K, E/P) (a token's
   experts are distinct), or E/P * C under capacity C per expert when that is fewer. */
static int64_t dsk__moe_peer_rows(const dsk_moe *m, int64_t T) {
    int64_t K = m->opts.top_k, El = m->n_local, cp = T * (K < El ? K : El), cap;
    if (m->opts.capacity_factor <= 0) return cp;
    cap = (int64_t)ceil((double)(T * K) / m->opts.n_routed * m->opts.capacity_factor);
    return cap * El < cp ? cap * El : cp;
}

/* Rows of expert work for T tokens as the buffers are first sized: bounded EP P Cp, exact EP T*K (the
   counts may say more), without EP dsk__moe_rows_bound. */
static int64_t dsk__moe_rows_first(const dsk_moe *m, int64_t T) {
    if (m->ep_size <= 1) return dsk__moe_rows_bound(m, T);
    if (m->opts.ep_exchange == DSK_MOE_EP_BOUNDED) return m->ep_size * dsk__moe_peer_rows(m, T);
    return T * m->opts.top_k;
}

/* The loss span's rows that dsk_moe_reserve sizes for calls of T tokens. */
static int64_t dsk__moe_reserve_n(const dsk_moe *m, int64_t T) {
    return m->st->span_on && m->st->span_rows > T ? m->st->span_rows : T;
}

/* dsk_moe_reserve's buffers ids [id0, id1) for the current saved forward (which forgets its forward: they may move). */
static dsk_status dsk__moe_reserve_ids(dsk_moe *m, dsk_ctx *ctx, int id0, int id1, int64_t max_tokens) {
    struct dsk__moe_fwd *f = m->st->f;
    dsk_tensor t;
    f->have_fwd = f->bwd_done = f->have_route = 0;
    f->N = dsk__moe_reserve_n(m, max_tokens); /* sequences */
    for (int id = id0; id < id1; id++)
        DSK__TRY(dsk__moe_buf(m, ctx, id, max_tokens, dsk__moe_rows_first(m, max_tokens), &t));
    return DSK_OK;
}

DSK_API dsk_status dsk_moe_reserve(dsk_moe *m, dsk_ctx *ctx, int64_t max_tokens) {
    struct dsk__moe_state *st;
    struct dsk__moe_fwd *cur;
    dsk_status s = DSK_OK;
    DSK__TRY(dsk__moe_need_layer(m, "dsk_moe_reserve"));
    DSK__TRY(dsk__moe_need_idle(m, "dsk_moe_reserve"));
    if (max_tokens < 0)
        return dsk_set_error(DSK_ERR_ARG, "dsk_moe_reserve: layer \"%s\": max_tokens %lld < 0", m->opts.name,
                             (long long)max_tokens);
    st = m->st;
    cur = st->f;
    for (int k = 0; k < st->n_fwds && s == DSK_OK; k++) { /* every saved forward's kept buffers */
        st->f = st->fwds[k];
        s = dsk__moe_reserve_ids(m, ctx, 0, DSK__MOE_NSAVED, max_tokens);
    }
    st->f = cur;
    return s == DSK_OK ? dsk__moe_reserve_ids(m, ctx, DSK__MOE_NSAVED, DSK__MOE_LOAD, max_tokens) : s;
}

/* The index of the current saved forward. */
static int dsk__moe_slot_index(const struct dsk__moe_state *st) {
    int k = 0;
    while (k < st->n_fwds - 1 && st->fwds[k] != st->f) k++;
    return k;
}

DSK_API dsk_status dsk_moe_set_slots(dsk_moe *m, dsk_ctx *ctx, int n) {
    const char *fn = "dsk_moe_set_slots";
    struct dsk__moe_state *st;
    struct dsk__moe_fwd **fw;
    int cur;
    DSK__TRY(dsk__moe_need_layer(m, fn));
    DSK__TRY(dsk__moe_need_idle(m, fn));
    st = m->st;
    if (n < 1 || n > DSK_MOE_MAX_SLOTS)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": %d slots: want 1 to %d", fn, m->opts.name, n,
                             DSK_MOE_MAX_SLOTS);
    for (int k = n; k < st->n_fwds; k++)
        if (st->fwds[k]->have_fwd)
            return dsk_set_error(DSK_ERR_STATE,
                                 "%s: layer \"%s\": slot %d of %d holds a forward no backward has used: run its "
                                 "backward before dropping the slot",
                                 fn, m->opts.name, k, st->n_fwds);
    cur = dsk__moe_slot_index(st);
    if (n > st->n_fwds) {
        if (!(fw = (struct dsk__moe_fwd **)DSK_MALLOC((size_t)n * sizeof *fw)))
            return dsk_set_error(DSK_ERR_OOM, "%s: layer \"%s\": out of host memory for %d slots", fn, m->opts.name, n);
        memcpy(fw, st->fwds, (size_t)st->n_fwds * sizeof *fw);
        for (int k = st->n_fwds; k < n; k++)
            if (!(fw[k] = dsk__moe_fwd_new(m))) {
                while (--k >= st->n_fwds) dsk__moe_fwd_free(fw[k], ctx);
                DSK_FREE(fw);
                return dsk_set_error(DSK_ERR_OOM, "%s: layer \"%s\": out of host memory for %d slots", fn, m->opts.name,
                                     n);
            }
        DSK_FREE(st->fwds);
        st->fwds = fw;
    }
    for (int k = n; k < st->n_fwds; k++) dsk__moe_fwd_free(st->fwds[k], ctx);
    st->n_fwds = n;
    st->f = st->fwds[cur < n ? cur : 0];
    return DSK_OK;
}

DSK_API dsk_status dsk_moe_use_slot(dsk_moe *m, int slot) {
    DSK__TRY(dsk__moe_need_layer(m, "dsk_moe_use_slot"));
    DSK__TRY(dsk__moe_need_idle(m, "dsk_moe_use_slot"));
    if (slot < 0 || slot >= m->st->n_fwds)
        return dsk_set_error(DSK_ERR_ARG, "dsk_moe_use_slot: layer \"%s\": slot %d of %d", m->opts.name, slot,
                             m->st->n_fwds);
    m->st->f = m->st->fwds[slot];
    return DSK_OK;
}

DSK_API dsk_status dsk_moe_reserve_bytes(const dsk_moe *m, int64_t max_tokens, int64_t rows, dsk_dtype act,
                                         int64_t *bytes) {
    DSK__TRY(dsk__moe_need_layer(m, "dsk_moe_reserve_bytes"));
    if (max_tokens < 0 || !bytes)
        return dsk_set_error(DSK_ERR_ARG, "dsk_moe_reserve_bytes: layer \"%s\": max_tokens %lld (>= 0), bytes %p",
                             m->opts.name, (long long)max_tokens, (void *)bytes);
    if (rows < 0) rows = dsk__moe_rows_first(m, max_tokens);
    *bytes = 0;
    for (int id = 0; id < DSK__MOE_LOAD; id++) {
        dsk_dtype dt;
        int64_t r, c, b;
        dsk__moe_spec_at(m, id, max_tokens, rows, dsk__moe_reserve_n(m, max_tokens), act, &dt, &r, &c);
        b = r * (c ? c : 1) * (int64_t)dsk_dtype_size(dt);
        b = b ? b : 1;                                          /* dsk__moe_buf allocates an empty buffer as 1 byte */
        *bytes += id < DSK__MOE_NSAVED ? m->st->n_fwds * b : b; /* a kept buffer in every saved forward */
    }
    return DSK_OK;
}

/* ---------------------------------------------------------------- MoE steps
   Each step runs the DSK_HD math of the declarations: a loop here on the CPU, a kernel of
   kernels/moe.cu on CUDA. Tensors are the registry's buffers on the layer's device. */


/* The layer's steps run on its device: CUDA layers call the kernels of kernels/moe.cu. */
#ifdef DSK_CUDA
#define DSK__MOE_ON_CUDA(m, call)                              \
    do {                                                       \
        if ((m)->device.type == DSK_DEV_CUDA) return (call);   \
    } while (0)
#else
#define DSK__MOE_ON_CUDA(m, call) (void)ctx
#endif

#define DSK__MOE_F32(t) ((float *)(t).data)
#define DSK__MOE_I32(t) ((int32_t *)(t).data)
#define DSK__MOE_I64(t) ((int64_t *)(t).data)
#define DSK__MOE_F64(t) ((double *)(t).data)

/* Routing of T tokens from the logits u: prob, sel, gate and the sort keys (replay: sel holds the
   experts to take). */
static dsk_status dsk__moe_route(dsk_moe *m, dsk_ctx *ctx, int64_t T, const dsk_tensor *u, dsk_tensor *prob,
                                 dsk_tensor *scr, dsk_tensor *sel, dsk_tensor *gate, dsk_tensor *keys, int replay) {
    int nt = dsk_ctx_threads(ctx);
    const float *bias = (const float *)m->bias->value.data;
    DSK__MOE_ON_CUDA(m, dsk_cuda_moe_route(ctx, &m->routing, T, DSK__MOE_F32(*u), bias, DSK__MOE_F32(*prob),
                                           DSK__MOE_F32(*scr), DSK__MOE_I32(*sel), DSK__MOE_F32(*gate),
                                           DSK__MOE_I32(*keys), replay));
    (void)nt;
    DSK__MOE_OMP(omp parallel for schedule(static) num_threads(nt))
    for (int64_t t = 0; t < T; t++)
        dsk__moe_route_one(&m->routing, t, DSK__MOE_F32(*u), bias, DSK__MOE_F32(*prob), DSK__MOE_F32(*scr),
                           DSK__MOE_I32(*sel), DSK__MOE_F32(*gate), DSK__MOE_I32(*keys), replay);
    return DSK_OK;
}

/* The loss tensors of one forward. */
typedef struct dsk__moe_loss_bufs {
    dsk_tensor ptot, lse, lsel, part, aux, loss;
} dsk__moe_loss_bufs;

/* The CPU's message for an inconsistent loss span (the group's summed tail says which; every rank of the group
   sees the same sums, so all of them fail). */
static dsk_status dsk__moe_span_error(const dsk_moe *m, const double *tail) {
    const struct dsk__moe_state *st = m->st;
    if (tail[2] != (double)st->f->ranks * (double)st->f->N ||
        tail[3] != (double)st->f->ranks * ((double)st->f->N * st->f->N))
        return dsk_set_error(DSK_ERR_ARG,
                             "dsk_moe_forward: layer \"%s\": the loss span's total_rows differs between the %d ranks "
                             "of its group (this rank %lld, their sum %.0f); nothing was computed",
                             m->opts.name, st->f->ranks, (long long)st->f->N, tail[2]);
    return dsk_set_error(DSK_ERR_ARG,
                         "dsk_moe_forward: layer \"%s\": the loss span's group holds %.0f rows in all over its %d "
                         "rank(s), not total_rows %lld (this rank rows [%lld, %lld)); nothing was computed",
                         m->opts.name, tail[1], st->f->ranks, (long long)st->f->N, (long long)st->f->row0,
                         (long long)(st->f->row0 + st->f->T));
}

/* The balancing losses of the saved forward's T tokens over its loss span (st: row0, N, seq_len, n_seq, ranks):
   this rank's partial sums, summed over the span's group, then the values into lb->loss (the span's, the same on
   every rank) and the backward's coefficients into lb->aux. CPU: DSK_ERR_ARG for an inconsistent span, found by
   a first exchange of the tail alone (every rank fails together, the group stays usable). */
static dsk_status dsk__moe_losses(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *prob, const dsk_tensor *u,
                                  const dsk_tensor *sel, dsk__moe_loss_bufs *lb) {
    const struct dsk__moe_state *st = m->st;
    const dsk_moe_opts *o = &m->opts;
    int E = o->n_routed, K = o->top_k, sig = o->score == DSK_MOE_SIGMOID, nt = dsk_ctx_threads(ctx), ok;
    int has_s = o->aux_alpha > 0 && st->f->N > 0, has_q = o->seq_aux_alpha > 0 && st->f->N > 0;
    int topk = o->loss_count == DSK_MOE_COUNT_TOPK;
    int64_t T = st->f->T, N = st->f->N, L = st->f->seq_len, nseq = st->f->n_seq, n_part = dsk_tensor_numel(&lb->part);
    const float *p = DSK__MOE_F32(*prob);
    const double *ptot = DSK__MOE_F64(lb->ptot);
    const int32_t *lsel = DSK__MOE_I32(lb->lsel);
    double *part = DSK__MOE_F64(lb->part), *tail = part + dsk__moe_part_tail(E, nseq);
    float *aux;
    DSK__TRY(dsk_tensor_fill(ctx, &lb->part, 0.0)); /* the parts of a loss that is off stay 0 */
#ifdef DSK_CUDA
    if (m->device.type == DSK_DEV_CUDA) {
        dsk_cuda_moe_loss_args a;
        a.T = T;
        a.N = N;
        a.row0 = st->f->row0;
        a.L = L;
        a.nseq = nseq;
        a.E = E;
        a.K = K;
        a.ranks = st->f->ranks;
        a.sigmoid = sig;
        a.count_topk = topk;
        a.aux_alpha = o->aux_alpha; a.seq_alpha = o->seq_aux_alpha; a.z_beta = o->z_beta;
        a.prob = p; a.u = DSK__MOE_F32(*u); a.sel = DSK__MOE_I32(*sel);
        a.ptot = DSK__MOE_F64(lb->ptot);
        a.part = part;
        a.loss = DSK__MOE_F64(lb->loss);
        a.lse = DSK__MOE_F32(lb->lse);
        a.aux = DSK__MOE_F32(lb->aux);
        a.lsel = DSK__MOE_I32(lb->lsel);
        DSK__TRY(dsk_cuda_moe_loss_parts(ctx, &a));
        if (st->f->ranks > 1) /* one exchange on the stream, no host sync: an inconsistent span makes the values NaN */
            DSK__TRY(dsk_comm_all_reduce(st->span_group, ctx, part, part, n_part, DSK_F64, DSK_COMM_SUM));
        return dsk_cuda_moe_loss_finish(ctx, &a);
    }
#endif
    (void)nt;
    DSK__MOE_OMP(omp parallel for schedule(static) num_threads(nt))
    for (int64_t t = 0; t < T; t++)
        dsk__moe_loss_token(E, K, topk, o->z_beta > 0, p + t * E, DSK__MOE_F32(*u) + t * E, DSK__MOE_I32(*sel) + t * K,
                            DSK__MOE_F64(lb->ptot) + t, o->z_beta > 0 ? DSK__MOE_F32(lb->lse) + t : NULL,
                            DSK__MOE_I32(lb->lsel) + t * K);
    if (has_s) {
        DSK__MOE_OMP(omp parallel for schedule(static) num_threads(nt))
        for (int j = 0; j < E; j++) dsk__moe_switch_part(j, T, N, E, K, sig, p, ptot, lsel, part);
    }
    if (has_q) {
        DSK__MOE_OMP(omp parallel for schedule(static) num_threads(nt))
        for (int64_t qj = 0; qj < nseq * E; qj++)
            dsk__moe_seq_part((int)(qj % E), qj / E, st->f->row0, T, L, nseq, E, K, sig, p, ptot, lsel, part);
    }
    dsk__moe_part_tail_fill(T, N, o->z_beta > 0 ? DSK__MOE_F32(lb->lse) : NULL, tail);
    if (st->f->ranks > 1) { /* the tail first: a total_rows that differs between ranks sizes the parts differently */
        DSK__TRY(dsk_comm_all_reduce(st->span_group, ctx, tail, tail, DSK__MOE_PART_TAIL, DSK_F64, DSK_COMM_SUM));
        if (!dsk__moe_span_ok(tail, st->f->ranks, N)) return dsk__moe_span_error(m, tail);
        DSK__TRY(
            dsk_comm_all_reduce(st->span_group, ctx, part, part, n_part - DSK__MOE_PART_TAIL, DSK_F64, DSK_COMM_SUM));
    }
    ok = dsk__moe_loss_finish(E, K, N, L, nseq, st->f->ranks, o->aux_alpha, o->seq_aux_alpha, o->z_beta, part,
                              DSK__MOE_F64(lb->loss));
    if (!ok) return dsk__moe_span_error(m, tail); /* a group of one rank whose rows are not the span */
    aux = DSK__MOE_F32(lb->aux);
    for (int64_t qj = 0; qj < nseq * E; qj++)
        aux[qj] = dsk__moe_aux_coef(qj, E, K, N, L, nseq, st->f->ranks, o->aux_alpha, o->seq_aux_alpha, part);
    return DSK_OK;
}

/* Capacity: keys2[slot] = its expert when it keeps its place, else -1 (from the full sort). */
static dsk_status dsk__moe_capacity(dsk_moe *m, dsk_ctx *ctx, int64_t cap, const dsk_tensor *perm_all,
                                    const dsk_tensor *off_all, const dsk_tensor *gate, dsk_tensor *keys2) {
    int E = m->opts.n_routed, nt = dsk_ctx_threads(ctx);
    const int32_t *pa = DSK__MOE_I32(*perm_all), *oa = DSK__MOE_I32(*off_all);
    int32_t *k2 = DSK__MOE_I32(*keys2);
    DSK__MOE_ON_CUDA(m, dsk_cuda_moe_capacity(ctx, E, m->opts.drop, cap, dsk_tensor_numel(keys2), pa, oa,
                                              DSK__MOE_F32(*gate), k2));
    (void)nt;
    for (int64_t i = 0; i < dsk_tensor_numel(keys2); i++) k2[i] = -1;
    DSK__MOE_OMP(omp parallel for schedule(dynamic, 1) num_threads(nt))
    for (int e = 0; e < E; e++)
        for (int64_t j = 0; j < oa[e + 1] - oa[e]; j++)
            if (dsk__moe_capacity_keep(m->opts.drop, DSK__MOE_F32(*gate), pa + oa[e], oa[e + 1] - oa[e], j, cap))
                k2[pa[oa[e] + j]] = e;
    return DSK_OK;
}

/* The kept order's rows: pos (slot -> row or -1), row_tok and row_gate over n rows. */
static dsk_status dsk__moe_plan(dsk_moe *m, dsk_ctx *ctx, int64_t n, const dsk_tensor *perm, const dsk_tensor *off,
                                const dsk_tensor *gate, dsk_tensor *pos, dsk_tensor *row_tok, dsk_tensor *row_gate) {
    int32_t n_kept, *ps = DSK__MOE_I32(*pos);
    const int32_t *pm = DSK__MOE_I32(*perm);
    DSK__MOE_ON_CUDA(m, dsk_cuda_moe_plan(ctx, m->opts.n_routed, m->opts.top_k, dsk_tensor_numel(pos), n, pm,
                                          DSK__MOE_I32(*off), DSK__MOE_F32(*gate), ps, DSK__MOE_I32(*row_tok),
                                          DSK__MOE_F32(*row_gate)));
    n_kept = DSK__MOE_I32(*off)[m->opts.n_routed];
    for (int64_t i = 0; i < dsk_tensor_numel(pos); i++) ps[i] = -1;
    for (int64_t j = 0; j < n_kept; j++) ps[pm[j]] = (int32_t)j;
    for (int64_t j = 0; j < n; j++)
        dsk__moe_plan_row(j, m->opts.top_k, n_kept, pm, DSK__MOE_F32(*gate), DSK__MOE_I32(*row_tok),
                          DSK__MOE_F32(*row_gate));
    return DSK_OK;
}

static dsk_status dsk__moe_count(dsk_moe *m, dsk_ctx *ctx, int64_t T, const dsk_tensor *off_all,
                                 const dsk_tensor *off, dsk_tensor *cnt) {
    DSK__MOE_ON_CUDA(m, dsk_cuda_moe_counts(ctx, T, m->opts.top_k, m->opts.n_routed, DSK__MOE_I32(*off_all),
                                            DSK__MOE_I32(*off), DSK__MOE_I64(*cnt)));
    dsk__moe_counts(T, m->opts.top_k, m->opts.n_routed, DSK__MOE_I32(*off_all), DSK__MOE_I32(*off), DSK__MOE_I64(*cnt));
    return DSK_OK;
}

/* Bounded EP: pad, skey (P Cp) by dsk__moe_ep_slot and unpad (TK) by dsk__moe_ep_unslot from the kept
   offsets off (E + 1). */
static dsk_status dsk__moe_ep_index(dsk_moe *m, dsk_ctx *ctx, int64_t Cp, int64_t TK, const dsk_tensor *off,
                                    dsk_tensor *pad, dsk_tensor *skey, dsk_tensor *unpad) {
    int P = m->ep_size, El = m->n_local;
    const int32_t *o = DSK__MOE_I32(*off);
    DSK__MOE_ON_CUDA(
        m, dsk_cuda_moe_ep_index(ctx, P, El, Cp, TK, o, DSK__MOE_I32(*pad), DSK__MOE_I32(*skey), DSK__MOE_I32(*unpad)));
    for (int64_t q = 0; q < P * Cp; q++)
        dsk__moe_ep_slot(q, El, Cp, o, DSK__MOE_I32(*pad) + q, DSK__MOE_I32(*skey) + q);
    for (int64_t j = 0; j < TK; j++) DSK__MOE_I32(*unpad)[j] = dsk__moe_ep_unslot(j, P, El, Cp, o);
    return DSK_OK;
}

/* rgi (n) = the inverse of rg's first loff[El] entries (rgi[rg[j]] = j), -1 elsewhere. */
static dsk_status dsk__moe_ep_inverse(dsk_moe *m, dsk_ctx *ctx, int64_t n, const dsk_tensor *rg, const dsk_tensor *loff,
                                      dsk_tensor *rgi) {
    const int32_t *g = DSK__MOE_I32(*rg);
    int32_t *gi = DSK__MOE_I32(*rgi), used;
    DSK__MOE_ON_CUDA(m, dsk_cuda_moe_ep_inverse(ctx, m->n_local, n, g, DSK__MOE_I32(*loff), gi));
    used = DSK__MOE_I32(*loff)[m->n_local];
    for (int64_t q = 0; q < n; q++) gi[q] = -1;
    for (int32_t j = 0; j < used; j++) gi[g[j]] = j;
    return DSK_OK;
}

static dsk_status dsk__moe_accumulate_step(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *cnt, const dsk_tensor *cntg,
                                           const dsk_tensor *loss) {
    struct dsk__moe_state *st = m->st;
    DSK__MOE_ON_CUDA(m, dsk_cuda_moe_accumulate(ctx, m->opts.n_routed, m->opts.top_k, DSK__MOE_I64(*cnt),
                                                DSK__MOE_I64(*cntg), DSK__MOE_F64(*loss),
                                                DSK__MOE_I64(dsk__moe_store_of(st, DSK__MOE_LOAD)->mem),
                                                DSK__MOE_I64(dsk__moe_store_of(st, DSK__MOE_ACC_I)->mem),
                                                DSK__MOE_F64(dsk__moe_store_of(st, DSK__MOE_ACC_F)->mem)));
    dsk__moe_accumulate(m->opts.n_routed, m->opts.top_k, DSK__MOE_I64(*cnt), DSK__MOE_I64(*cntg), DSK__MOE_F64(*loss),
                        DSK__MOE_I64(dsk__moe_store_of(st, DSK__MOE_LOAD)->mem),
                        DSK__MOE_I64(dsk__moe_store_of(st, DSK__MOE_ACC_I)->mem),
                        DSK__MOE_F64(dsk__moe_store_of(st, DSK__MOE_ACC_F)->mem));
    return DSK_OK;
}

/* f32 rows on the CPU (the trainer's case): the combine, its backward and the gate gradient a row
   at a time, vectorised where the order allows. Each repeats the operations of its DSK_HD element
   function in the same order (tests/test_moe_golden.c pins the bits): a sum over slots runs per
   element in slot order; the gate gradient's f64 sums run over d in order, so DSK__MOE_DOT_CHAINS
   slots run side by side (independent chains) instead of vector lanes within one. */
#define DSK__MOE_PAR_MIN 65536 /* elements below which a row loop stays on one thread */
#define DSK__MOE_DOT_CHAINS 4

/* Row t of y: dsk__moe_combine_elem for d = 0 .. D-1. */
static void dsk__moe_combine_row_f32(int K, const int32_t *pos, const float *gate, const float *rows, int64_t D,
                                     const float *shared, float *y) {
    if (gate[0] != gate[0]) {
        for (int64_t d = 0; d < D; d++) y[d] = NAN;
        return;
    }
    for (int64_t d = 0; d < D; d++) y[d] = 0.0f;
    for (int k = 0; k < K; k++) {
        const float *r;
        float g = gate[k];
        if (pos[k] < 0) continue;
        r = rows + (int64_t)pos[k] * D;
        DSK__MOE_OMP(omp simd)
        for (int64_t d = 0; d < D; d++) y[d] += g * r[d];
    }
    if (shared) {
        DSK__MOE_OMP(omp simd)
        for (int64_t d = 0; d < D; d++) y[d] += shared[d];
    }
}

/* Row t of dxf: dsk__moe_uncombine_elem for d = 0 .. D-1. */
static void dsk__moe_uncombine_row_f32(int K, const int32_t *pos, const float *rows, int64_t D, float *dxf) {
    for (int k = 0; k < K; k++) {
        const float *r;
        if (pos[k] < 0) continue;
        r = rows + (int64_t)pos[k] * D;
        DSK__MOE_OMP(omp simd)
        for (int64_t d = 0; d < D; d++) dxf[d] += r[d];
    }
}

/* dgate[i0 .. i0 + n) (n <= DSK__MOE_DOT_CHAINS): dsk__moe_dot_part (lane 0, stride 1) per kept slot,
   the slots' sums interleaved in named scalars (an array invites the vectoriser's gathers); a
   dropped slot gets 0 (its chain reads its own dy row and is dropped). */
static void dsk__moe_dgate_f32(int64_t i0, int n, int K, const int32_t *pos, const float *dy, const float *rows, int64_t D,
                               float *dgate) {
    const float *a[DSK__MOE_DOT_CHAINS], *b[DSK__MOE_DOT_CHAINS];
    double acc[DSK__MOE_DOT_CHAINS], s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (int j = 0; j < DSK__MOE_DOT_CHAINS; j++) {
        int64_t i = i0 + (j < n ? j : 0);
        a[j] = dy + (i / K) * D;
        b[j] = pos[i] >= 0 ? rows + (int64_t)pos[i] * D : a[j];
    }
    for (int64_t d = 0; d < D; d++) {
        s0 += (double)a[0][d] * b[0][d];
        s1 += (double)a[1][d] * b[1][d];
        s2 += (double)a[2][d] * b[2][d];
        s3 += (double)a[3][d] * b[3][d];
    }
    acc[0] = s0; acc[1] = s1; acc[2] = s2; acc[3] = s3;
    for (int j = 0; j < n; j++) dgate[i0 + j] = pos[i0 + j] < 0 ? 0.0f : (float)acc[j];
}

/* y (T, D) in the layer's dtype = combine of the expert rows (kept order) + the shared rows. */
static dsk_status dsk__moe_combine(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *pos,
                                   const dsk_tensor *gate, const dsk_tensor *rows, const dsk_tensor *shared) {
    int64_t T = y->shape[0], D = y->shape[1];
    int K = m->opts.top_k, nt = dsk_ctx_threads(ctx);
    DSK__MOE_ON_CUDA(m, dsk_cuda_moe_combine(ctx, K, T, D, y->data, y->dtype, DSK__MOE_I32(*pos), DSK__MOE_F32(*gate),
                                             rows->data, rows->dtype, shared ? shared->data : NULL,
                                             shared ? shared->dtype : DSK_F32));
    (void)nt;
    if (y->dtype == DSK_F32 && rows->dtype == DSK_F32 && (!shared || shared->dtype == DSK_F32)) {
        DSK__MOE_OMP(omp parallel for schedule(static) num_threads(nt) if (T * D > DSK__MOE_PAR_MIN))
        for (int64_t t = 0; t < T; t++)
            dsk__moe_combine_row_f32(K, DSK__MOE_I32(*pos) + t * K, DSK__MOE_F32(*gate) + t * K, DSK__MOE_F32(*rows), D,
                                     shared ? DSK__MOE_F32(*shared) + t * D : NULL, DSK__MOE_F32(*y) + t * D);
        return DSK_OK;
    }
    DSK__MOE_OMP(omp parallel for schedule(static) num_threads(nt))
    for (int64_t t = 0; t < T; t++)
        for (int64_t d = 0; d < D; d++)
            dsk_store_f32(y->data, y->dtype, t * D + d,
                          dsk__moe_combine_elem(K, DSK__MOE_I32(*pos) + t * K, DSK__MOE_F32(*gate) + t * K, rows->data,
                                                rows->dtype, D, d, shared ? shared->data : NULL,
                                                shared ? shared->dtype : DSK_F32, t * D + d));
    return DSK_OK;
}

/* dgate (T, K) = dy_t . o_slot for kept slots, 0 for dropped ones. */
static dsk_status dsk__moe_dgate(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *dgate, const dsk_tensor *dy,
                                 const dsk_tensor *pos, const dsk_tensor *rows) {
    int64_t TK = dsk_tensor_numel(dgate), D = dy->shape[1];
    int K = m->opts.top_k, nt = dsk_ctx_threads(ctx);
    DSK__MOE_ON_CUDA(m, dsk_cuda_moe_dgate(ctx, K, TK, D, DSK__MOE_F32(*dgate), dy->data, dy->dtype, DSK__MOE_I32(*pos),
                                           rows->data, rows->dtype));
    (void)nt;
    if (dy->dtype == DSK_F32 && rows->dtype == DSK_F32) {
        DSK__MOE_OMP(omp parallel for schedule(static) num_threads(nt) if (TK * D > DSK__MOE_PAR_MIN))
        for (int64_t i = 0; i < TK; i += DSK__MOE_DOT_CHAINS)
            dsk__moe_dgate_f32(i, TK - i < DSK__MOE_DOT_CHAINS ? (int)(TK - i) : DSK__MOE_DOT_CHAINS, K,
                               DSK__MOE_I32(*pos), DSK__MOE_F32(*dy), DSK__MOE_F32(*rows), D, DSK__MOE_F32(*dgate));
        return DSK_OK;
    }
    DSK__MOE_OMP(omp parallel for schedule(static) num_threads(nt))
    for (int64_t i = 0; i < TK; i++) {
        int32_t p = DSK__MOE_I32(*pos)[i];
        DSK__MOE_F32(*dgate)[i] = p < 0 ? 0.0f
                                        : (float)dsk__moe_dot_part(dy->data, dy->dtype, (i / K) * D, rows->data,
                                                                   rows->dtype, (int64_t)p * D, D, 0, 1);
    }
    return DSK_OK;
}

/* du (T, E) written from dgate, the loss coefficients (aux (nseq, E) or NULL: token t is row row0 + t of the
   loss span, in sequence (row0 + t) / seq_len) and the z-loss. */
static dsk_status dsk__moe_route_backward(dsk_moe *m, dsk_ctx *ctx, int64_t T, const dsk_tensor *u,
                                          const dsk_tensor *prob, const dsk_tensor *sel, const dsk_tensor *dgate,
                                          const dsk_tensor *aux, int64_t row0, int64_t seq_len, float aux_scale,
                                          float zcoef, dsk_tensor *du) {
    int E = m->opts.n_routed, K = m->opts.top_k, nt = dsk_ctx_threads(ctx);
    DSK__MOE_ON_CUDA(m, dsk_cuda_moe_route_backward(ctx, &m->routing, T, DSK__MOE_F32(*u), DSK__MOE_F32(*prob),
                                                    DSK__MOE_I32(*sel), DSK__MOE_F32(*dgate),
                                                    aux ? DSK__MOE_F32(*aux) : NULL, row0, seq_len, aux_scale, zcoef,
                                                    DSK__MOE_F32(*du)));
    (void)nt;
    DSK__MOE_OMP(omp parallel for schedule(static) num_threads(nt))
    for (int64_t t = 0; t < T; t++)
        dsk_moe_route_token_backward(&m->routing, DSK__MOE_F32(*u) + t * E, DSK__MOE_F32(*prob) + t * E,
                                     DSK__MOE_I32(*sel) + t * K, DSK__MOE_F32(*dgate) + t * K,
                                     aux ? DSK__MOE_F32(*aux) + ((row0 + t) / seq_len) * E : NULL, aux_scale, zcoef,
                                     DSK__MOE_F32(*du) + t * E);
    return DSK_OK;
}

/* dxf (T, D) f32 += each token's kept rows (kept order) in slot order. */
static dsk_status dsk__moe_uncombine(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *dxf, const dsk_tensor *pos,
                                     const dsk_tensor *rows) {
    int64_t T = dxf->shape[0], D = dxf->shape[1];
    int K = m->opts.top_k, nt = dsk_ctx_threads(ctx);
    DSK__MOE_ON_CUDA(m, dsk_cuda_moe_uncombine(ctx, K, T, D, DSK__MOE_F32(*dxf), DSK__MOE_I32(*pos), rows->data,
                                               rows->dtype));
    (void)nt;
    if (rows->dtype == DSK_F32) {
        DSK__MOE_OMP(omp parallel for schedule(static) num_threads(nt) if (T * D > DSK__MOE_PAR_MIN))
        for (int64_t t = 0; t < T; t++)
            dsk__moe_uncombine_row_f32(K, DSK__MOE_I32(*pos) + t * K, DSK__MOE_F32(*rows), D, DSK__MOE_F32(*dxf) + t * D);
        return DSK_OK;
    }
    DSK__MOE_OMP(omp parallel for schedule(static) num_threads(nt))
    for (int64_t t = 0; t < T; t++)
        for (int64_t d = 0; d < D; d++)
            DSK__MOE_F32(*dxf)[t * D + d] = dsk__moe_uncombine_elem(K, DSK__MOE_I32(*pos) + t * K, rows->data,
                                                                     rows->dtype, D, d, DSK__MOE_F32(*dxf)[t * D + d]);
    return DSK_OK;
}

/* skip: NULL, or an i32 on the layer's device; nothing changes when it holds a non-zero value. */
static dsk_status dsk__moe_bias_step(dsk_moe *m, dsk_ctx *ctx, const int32_t *skip) {
    DSK__MOE_ON_CUDA(m, dsk_cuda_moe_bias_update(ctx, m->opts.n_routed, m->opts.bias_rate, m->opts.bias_recenter,
                                                 DSK__MOE_I64(dsk__moe_store_of(m->st, DSK__MOE_LOAD)->mem),
                                                 (float *)m->bias->value.data, skip));
    if (skip && *skip) return DSK_OK;
    dsk__moe_bias_update(m->opts.n_routed, m->opts.bias_rate, m->opts.bias_recenter,
                         DSK__MOE_I64(dsk__moe_store_of(m->st, DSK__MOE_LOAD)->mem), (float *)m->bias->value.data);
    return dsk_tensor_fill(ctx, &dsk__moe_store_of(m->st, DSK__MOE_LOAD)->mem, 0.0);
}

/* ---------------------------------------------------------------- argument checks */

static dsk_status dsk__moe_check_io(const dsk_moe *m, const char *fn, const char *what, const dsk_tensor *t,
                                    int64_t T) {
    char b[96];
    if (!t) return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": %s is NULL", fn, m->opts.name, what);
    if (t->ndim != 2 || t->shape[1] != m->opts.d_model || t->dtype != m->opts.dtype || (T >= 0 && t->shape[0] != T))
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": %s is %s, want [%lld,%lld] %s", fn, m->opts.name, what,
                             dsk_tensor_describe(t, b, sizeof b), T >= 0 ? (long long)T : (long long)t->shape[0],
                             (long long)m->opts.d_model, dsk_dtype_name(m->opts.dtype));
    if (t->device.type != m->device.type || t->device.index != m->device.index)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": %s is on %s, the layer on %s", fn, m->opts.name, what,
                             t->device.type == DSK_DEV_CUDA ? "CUDA" : "the CPU",
                             m->device.type == DSK_DEV_CUDA ? "CUDA" : "the CPU");
    if (!dsk_tensor_is_contiguous(t) || (!t->data && t->shape[0] > 0))
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": %s must be contiguous with data", fn, m->opts.name, what);
    return DSK_OK;
}

/* ---------------------------------------------------------------- expert-parallel routes
   A route is a plan of gathers and all-to-all-v's over row indices (int32), built on the host
   by dsk_moe_route_init; dispatch and combine replay it on the rows.
   Flat: dispatch gathers the slot rows in (destination, row, slot) order and all-to-all-v's
   them over c; combine all-to-all-v's the rows back and gathers them into slot order.
   Two hops, this rank on node a with node_rank i: hop 1 (cross communicator, one rank per node,
   rank = node) sends each row once to every other node it has slots on, with the local
   destinations of its slots there (k int32 per row, exchanged at init); hop 2 (node
   communicator) sends each local rank d the blocks of every source this rank relays (itself,
   and the ranks with node_rank i on other nodes), in source order, each block in (row, slot)
   order; d places each block where the flat route would have put it. Combine runs it back:
   hop 2 returns each forwarded row to its relay, hop 1 returns the relayed slots' rows to
   their sources in (row, slot) order, and every rank gathers its slots from the two. */

/* Routes take c as dsk_comm.h's collectives do: initialised, on either backend. */
static dsk_status dsk__moe_route_check(const dsk_comm *c, const char *fn) {
    if (!c || !c->impl) return dsk_set_error(DSK_ERR_ARG, "%s: communicator is NULL or not initialised", fn);
    return DSK_OK;
}

/* The dtypes dsk_comm's all-to-all-v carries. */
static int dsk__moe_route_dtype_ok(dsk_dtype dt) {
    return dt == DSK_F32 || dt == DSK_F16 || dt == DSK_BF16 || dt == DSK_F64 || dt == DSK_I32 || dt == DSK_I64 ||
           dt == DSK_U8;
}

static void dsk__moe_prefix(const int64_t *counts, int n, int64_t *displs) {
    int64_t s = 0;
    for (int p = 0; p < n; p++) {
        displs[p] = s;
        s += counts[p];
    }
}

static double dsk__moe_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#ifdef DSK_CUDA
#define DSK__MOE_NCCL(c) ((c)->backend == DSK_COMM_NCCL)
#else
#define DSK__MOE_NCCL(c) 0
#endif

struct dsk__moe_route_impl {
    dsk_comm *c, *node, *cross; /* node, cross: c's node communicators (NULL when flat) */
    int *node_of;               /* [world] node of each rank of c */
    int64_t *recv_counts;       /* [world] */
    /* row counts per peer; flat uses a (rows to each rank) and b (rows from each rank) */
    int64_t *c1s, *c1r;             /* hop 1: rows to / from each node (cross communicator) */
    int64_t *c2s, *c2r;             /* hop 2: rows to / from each local rank (node communicator) */
    int64_t *v1s, *w1r;             /* combine, hop 1: rows back to / from each node */
    int64_t n1, h1, s2, r2, v1, w1; /* their totals */
    /* gathers: dst row q = src row idx[q] */
    int32_t *g1;   /* (n1) hop-1 send <- rows */
    int32_t *g2;   /* (s2) hop-2 send <- [rows | hop-1 received]; flat: (slots) send <- rows */
    int32_t *p2;   /* (recv_rows) recv <- hop-2 received */
    int32_t *q2;   /* (recv_rows) hop-2 back send <- rows given to combine */
    int32_t *q1;   /* (v1) hop-1 back send <- hop-2 back received */
    int32_t *qo;   /* (slots) out <- [hop-2 back received | hop-1 back received]; flat: <- returned */
    int64_t *tmp;  /* [2 * world] element counts of one all-to-all-v */
    char *scratch; /* host: reused buffer for the intermediate rows */
    size_t scratch_bytes;
#ifdef DSK_CUDA
    dsk_tensor dev[6]; /* nccl: g1, g2, p2, q2, q1, qo on the device */
#endif
};

enum { DSK__MOE_RT_G1, DSK__MOE_RT_G2, DSK__MOE_RT_P2, DSK__MOE_RT_Q2, DSK__MOE_RT_Q1, DSK__MOE_RT_QO };

DSK_API void dsk_moe_route_free(dsk_moe_route *rt) {
    dsk__moe_route_impl *ri;
    if (!rt) return;
    ri = rt->impl;
    if (ri) {
#ifdef DSK_CUDA
        for (int i = 0; i < 6; i++) dsk_tensor_free(NULL, &ri->dev[i]);
#endif
        DSK_FREE(ri->recv_counts);
        DSK_FREE(ri->node_of);
        DSK_FREE(ri->c1s);
        DSK_FREE(ri->g1);
        DSK_FREE(ri->g2);
        DSK_FREE(ri->p2);
        DSK_FREE(ri->q2);
        DSK_FREE(ri->q1);
        DSK_FREE(ri->qo);
        DSK_FREE(ri->tmp);
        DSK_FREE(ri->scratch);
        DSK_FREE(ri);
    }
    memset(rt, 0, sizeof *rt);
}

static int32_t *dsk__moe_route_idx(int64_t n) { return (int32_t *)DSK_MALLOC((size_t)(n ? n : 1) * sizeof(int32_t)); }

/* An all-to-all of `per` elements of host memory with every rank of comm (nccl: staged
   through device memory on ctx's stream; the wait is bounded by the timeout). */
static dsk_status dsk__moe_route_meta(dsk_comm *comm, dsk_ctx *ctx, const void *send, const int64_t *scnt, void *recv,
                                      const int64_t *rcnt, dsk_dtype dt) {
#ifdef DSK_CUDA
    if (DSK__MOE_NCCL(comm)) {
        int64_t ns = 0, nr = 0, sh[1];
        size_t esz = dsk_dtype_size(dt);
        dsk_tensor hs, hr, ds, dr;
        dsk_status st;
        for (int p = 0; p < comm->world_size; p++) {
            ns += scnt[p];
            nr += rcnt[p];
        }
        memset(&ds, 0, sizeof ds);
        memset(&dr, 0, sizeof dr);
        sh[0] = (int64_t)(ns * (int64_t)esz);
        st = dsk_tensor_wrap(&hs, (void *)send, DSK_U8, dsk_cpu(), 1, sh);
        if (st == DSK_OK) st = dsk_tensor_alloc(ctx, &ds, DSK_U8, 1, sh);
        if (st == DSK_OK) st = dsk_tensor_copy(ctx, &ds, &hs);
        sh[0] = (int64_t)(nr * (int64_t)esz);
        if (st == DSK_OK) st = dsk_tensor_wrap(&hr, recv, DSK_U8, dsk_cpu(), 1, sh);
        if (st == DSK_OK) st = dsk_tensor_alloc(ctx, &dr, DSK_U8, 1, sh);
        if (st == DSK_OK) st = dsk_comm_all_to_all_v(comm, ctx, ds.data, scnt, NULL, dr.data, rcnt, NULL, dt);
        if (st == DSK_OK) st = dsk_comm_sync(comm, ctx);
        if (st == DSK_OK) st = dsk_tensor_copy(ctx, &hr, &dr);
        dsk_tensor_free(ctx, &ds);
        dsk_tensor_free(ctx, &dr);
        return st;
    }
#endif
    (void)ctx;
    return dsk_comm_all_to_all_v(comm, NULL, send, scnt, NULL, recv, rcnt, NULL, dt);
}

/* One int64 to and from every rank of comm: recv[p] = what rank p put in its send[me]. */
static dsk_status dsk__moe_route_counts(dsk_comm *comm, dsk_ctx *ctx, const int64_t *send, int64_t *recv,
                                        int64_t *ones) {
    for (int p = 0; p < comm->world_size; p++) ones[p] = 1;
    return dsk__moe_route_meta(comm, ctx, send, ones, recv, ones, DSK_I64);
}

/* rank_at[b * L + j]: the j-th rank (in rank order) of node b. */
static void dsk__moe_node_ranks(const dsk_comm *c, const int *node_of, int L, int *rank_at) {
    int *fill = rank_at + (size_t)c->n_nodes * (size_t)L;
    for (int b = 0; b < c->n_nodes; b++) fill[b] = 0;
    for (int r = 0; r < c->world_size; r++) {
        int b = node_of[r];
        rank_at[(size_t)b * L + fill[b]++] = r;
    }
}

/* The flat plan: send in (destination, row, slot) order; combine's returned rows, grouped the
   same way, go back to slot order. cnt: slots per destination. */
static dsk_status dsk__moe_route_flat(dsk_moe_route *rt, const char *fn, const int32_t *dest, const int64_t *cnt) {
    dsk__moe_route_impl *ri = rt->impl;
    int n = ri->c->world_size;
    int64_t *at = ri->tmp, s = 0;
    if (!(ri->g2 = dsk__moe_route_idx(rt->slots)) || !(ri->qo = dsk__moe_route_idx(rt->slots)))
        return dsk_set_error(DSK_ERR_OOM, "%s: route of %lld slots", fn, (long long)rt->slots);
    dsk__moe_prefix(cnt, n, at);
    for (int64_t i = 0; i < rt->n_rows; i++)
        for (int j = 0; j < rt->k; j++) {
            int d = dest[i * rt->k + j];
            if (d < 0) continue;
            ri->g2[at[d]] = (int32_t)i;
            ri->qo[s++] = (int32_t)at[d]++;
        }
    memcpy(ri->c1s, cnt, (size_t)n * sizeof(int64_t)); /* flat: rows to / from each rank in c1s / c1r */
    memcpy(ri->c1r, ri->recv_counts, (size_t)n * sizeof(int64_t));
    for (int p = 0; p < n; p++)
        if (ri->node_of[p] != ri->c->node) rt->dispatch_rows_off_node += cnt[p];
    rt->combine_rows_off_node = 0;
    for (int p = 0; p < n; p++)
        if (ri->node_of[p] != ri->c->node) rt->combine_rows_off_node += ri->recv_counts[p];
    return DSK_OK;
}

/* The sources a relay on node a with node_rank l carries in hop 2: the rank with node_rank l on
   every node (on node a: the relay itself), in rank order. src[0..N). */
static void dsk__moe_relay_sources(const dsk_comm *c, const int *rank_at, int l, int *src) {
    int N = c->n_nodes, L = c->node_size;
    for (int b = 0; b < N; b++) {
        int r = rank_at[(size_t)b * L + l], j = b;
        while (j > 0 && src[j - 1] > r) {
            src[j] = src[j - 1];
            j--;
        }
        src[j] = r;
    }
}

/* The two-hop plan (see the section comment). Collective over the node and cross communicators.
   slot_id[i * k + j]: the index of used slot (i, j) in (row, slot) order, -1 if unused. */
static dsk_status dsk__moe_route_plan2(dsk_moe_route *rt, dsk_ctx *ctx, const char *fn, const int32_t *dest,
                                       const int64_t *slot_id, int *rank_at, int *local_of) {
    dsk__moe_route_impl *ri = rt->impl;
    dsk_comm *c = ri->c;
    const int N = c->n_nodes, L = c->node_size, a = c->node, me_l = c->node_rank, K = rt->k;
    const int *node_of = ri->node_of;
    int64_t *off1 = ri->tmp, *at = ri->tmp + c->world_size, *ones = ri->tmp + 3 * c->world_size;
    int64_t *seen = NULL, *v1pos = NULL, y = 0;
    int32_t *m1s = NULL, *m1r = NULL;
    int *src = (int *)(rank_at + (size_t)N * L + N); /* N more ints, allocated by the caller */
    dsk_status st = DSK_OK;
    /* hop 1: each row once to every other node it has slots on, with its slots' local ranks there */
    if (!(seen = (int64_t *)DSK_MALLOC((size_t)N * sizeof(int64_t))))
        return dsk_set_error(DSK_ERR_OOM, "%s: %d nodes", fn, N);
    for (int b = 0; b < N; b++) {
        ri->c1s[b] = 0;
        seen[b] = -1;
    }
    for (int64_t i = 0; i < rt->n_rows; i++)
        for (int j = 0; j < K; j++) {
            int d = dest[i * K + j], b = d < 0 ? a : node_of[d];
            if (b != a && seen[b] != i) {
                seen[b] = i;
                ri->c1s[b]++;
            }
        }
    ri->n1 = 0;
    for (int b = 0; b < N; b++) ri->n1 += ri->c1s[b];
    if (!(ri->g1 = dsk__moe_route_idx(ri->n1)) ||
        !(m1s = (int32_t *)DSK_MALLOC((size_t)(ri->n1 ? ri->n1 : 1) * K * sizeof(int32_t)))) {
        st = dsk_set_error(DSK_ERR_OOM, "%s: %lld hop-1 rows", fn, (long long)ri->n1);
        goto done;
    }
    dsk__moe_prefix(ri->c1s, N, at);
    for (int b = 0; b < N; b++) seen[b] = -1;
    for (int64_t i = 0; i < rt->n_rows; i++)
        for (int j = 0; j < K; j++) {
            int d = dest[i * K + j], b = d < 0 ? a : node_of[d];
            int64_t pos;
            if (b == a || seen[b] == i) continue;
            seen[b] = i;
            pos = at[b]++;
            ri->g1[pos] = (int32_t)i;
            for (int jj = 0; jj < K; jj++) {
                int dd = dest[i * K + jj];
                m1s[pos * K + jj] = dd >= 0 && node_of[dd] == b ? local_of[dd] : -1;
            }
        }
    if ((st = dsk__moe_route_counts(ri->cross, ctx, ri->c1s, ri->c1r, ones)) != DSK_OK) goto done;
    ri->h1 = 0;
    for (int b = 0; b < N; b++) {
        off1[b] = ri->h1;
        ri->h1 += ri->c1r[b];
    }
    if (!(m1r = (int32_t *)DSK_MALLOC((size_t)(ri->h1 ? ri->h1 : 1) * K * sizeof(int32_t))) ||
        !(v1pos = (int64_t *)DSK_MALLOC((size_t)(ri->h1 ? ri->h1 : 1) * K * sizeof(int64_t)))) {
        st = dsk_set_error(DSK_ERR_OOM, "%s: %lld hop-1 rows received", fn, (long long)ri->h1);
        goto done;
    }
    for (int b = 0; b < N; b++) {
        at[b] = ri->c1s[b] * K;
        at[N + b] = ri->c1r[b] * K;
    }
    if ((st = dsk__moe_route_meta(ri->cross, ctx, m1s, at, m1r, at + N, DSK_I32)) != DSK_OK) goto done;
    /* where the relayed slots go back in combine: per source node, in (row, slot) order */
    ri->v1 = 0;
    for (int b = 0; b < N; b++) {
        ri->v1s[b] = 0;
        for (int64_t t = off1[b]; t < off1[b] + ri->c1r[b]; t++)
            for (int j = 0; j < K; j++) {
                v1pos[t * K + j] = m1r[t * K + j] >= 0 ? ri->v1 + ri->v1s[b]++ : -1;
                if (m1r[t * K + j] < -1 || m1r[t * K + j] >= L) {
                    st = dsk_set_error(DSK_ERR_CORRUPT, "%s: node %d sent local rank %d for a node of %d ranks", fn, b,
                                       (int)m1r[t * K + j], L);
                    goto done;
                }
            }
        ri->v1 += ri->v1s[b];
    }
    /* hop 2: to each local rank, the blocks of the sources this rank relays, in rank order */
    ri->s2 = ri->v1;
    for (int64_t i = 0; i < rt->n_rows; i++)
        for (int j = 0; j < K; j++) ri->s2 += dest[i * K + j] >= 0 && node_of[dest[i * K + j]] == a;
    if (!(ri->g2 = dsk__moe_route_idx(ri->s2)) || !(ri->q1 = dsk__moe_route_idx(ri->v1)) ||
        !(ri->qo = dsk__moe_route_idx(rt->slots)) || !(ri->p2 = dsk__moe_route_idx(rt->recv_rows)) ||
        !(ri->q2 = dsk__moe_route_idx(rt->recv_rows))) {
        st = dsk_set_error(DSK_ERR_OOM, "%s: %lld hop-2 rows", fn, (long long)ri->s2);
        goto done;
    }
    dsk__moe_relay_sources(c, rank_at, me_l, src);
    for (int ld = 0; ld < L; ld++) {
        int d = rank_at[(size_t)a * L + ld];
        int64_t x0 = y;
        for (int e = 0; e < N; e++) {
            int b = node_of[src[e]];
            if (b == a) { /* this rank's own slots on d */
                for (int64_t i = 0; i < rt->n_rows; i++)
                    for (int j = 0; j < K; j++)
                        if (dest[i * K + j] == d) {
                            ri->g2[y] = (int32_t)i;
                            ri->qo[slot_id[i * K + j]] = (int32_t)y++;
                        }
                continue;
            }
            for (int64_t t = off1[b]; t < off1[b] + ri->c1r[b]; t++)
                for (int j = 0; j < K; j++)
                    if (m1r[t * K + j] == ld) {
                        ri->g2[y] = (int32_t)(rt->n_rows + t);
                        ri->q1[v1pos[t * K + j]] = (int32_t)y++;
                    }
        }
        ri->c2s[ld] = y - x0;
    }
    if ((st = dsk__moe_route_counts(ri->node, ctx, ri->c2s, ri->c2r, ones)) != DSK_OK) goto done;
    /* what arrives from each local relay: its sources' blocks (every rank is the source of one
       relay: the one with its node_rank), placed where the flat route puts them */
    y = 0;
    for (int lr = 0; lr < L; lr++) y += ri->c2r[lr];
    if (y != rt->recv_rows) {
        st = dsk_set_error(DSK_ERR_CORRUPT, "%s: the relays of rank %d send it %lld rows, its sources %lld", fn,
                           c->rank, (long long)y, (long long)rt->recv_rows);
        goto done;
    }
    dsk__moe_prefix(ri->recv_counts, c->world_size, at);
    y = 0;
    for (int lr = 0; lr < L; lr++) {
        int64_t y0 = y;
        dsk__moe_relay_sources(c, rank_at, lr, src);
        for (int e = 0; e < N; e++)
            for (int64_t q = 0; q < ri->recv_counts[src[e]]; q++) {
                ri->p2[at[src[e]] + q] = (int32_t)y;
                ri->q2[y++] = (int32_t)(at[src[e]] + q);
            }
        if (y - y0 != ri->c2r[lr]) {
            st = dsk_set_error(DSK_ERR_CORRUPT, "%s: local rank %d relays %lld rows to rank %d, which expects %lld", fn,
                               lr, (long long)ri->c2r[lr], c->rank, (long long)(y - y0));
            goto done;
        }
    }
    ri->r2 = y;
    /* combine, hop 1 back: this rank's slots on other nodes, from the relay there */
    if ((st = dsk__moe_route_counts(ri->cross, ctx, ri->v1s, ri->w1r, ones)) != DSK_OK) goto done;
    ri->w1 = 0;
    for (int b = 0; b < N; b++) {
        at[b] = 0;
        off1[b] = ri->w1;
        ri->w1 += ri->w1r[b];
    }
    for (int64_t i = 0; i < rt->n_rows; i++)
        for (int j = 0; j < K; j++) {
            int d = dest[i * K + j], b = d < 0 ? a : node_of[d];
            if (b != a) ri->qo[slot_id[i * K + j]] = (int32_t)(ri->s2 + off1[b] + at[b]++);
        }
    for (int b = 0; b < N; b++)
        if (at[b] != ri->w1r[b]) {
            st = dsk_set_error(DSK_ERR_CORRUPT, "%s: rank %d has %lld slots on node %d, whose relay returns %lld", fn,
                               c->rank, (long long)at[b], b, (long long)ri->w1r[b]);
            goto done;
        }
    rt->dispatch_rows_off_node = ri->n1;
    rt->combine_rows_off_node = ri->v1;
done:
    DSK_FREE(seen);
    DSK_FREE(m1s);
    DSK_FREE(m1r);
    DSK_FREE(v1pos);
    return st;
}

/* How dispatch and combine move rows: host memcpy, or (nccl) device gathers of the rows seen
   as 32- or 16-bit words, and all-to-all-v's in elements of the caller's dtype. */
typedef struct dsk__moe_rowio {
    dsk_moe_route *rt;
    dsk_ctx *ctx;
    dsk_dtype dt, word; /* word: the dtype the device gathers rows as */
    int64_t row_elems, words;
    size_t row; /* bytes */
    int dev;
} dsk__moe_rowio;

/* dst rows q = src rows idx[q], q < n; which: the index array's slot on the device. */
static dsk_status dsk__moe_rowio_gather(dsk__moe_rowio *rw, void *dst, const void *src, int64_t src_rows,
                                        const int32_t *idx, int which, int64_t n) {
    if (n == 0) return DSK_OK;
#ifdef DSK_CUDA
    if (rw->dev) {
        dsk_tensor o, s;
        int64_t so[2] = {n, rw->words}, ss[2] = {src_rows, rw->words};
        DSK__TRY(dsk_tensor_wrap(&o, dst, rw->word, rw->ctx->device, 2, so));
        DSK__TRY(dsk_tensor_wrap(&s, (void *)src, rw->word, rw->ctx->device, 2, ss));
        return dsk_gather_rows(rw->ctx, &o, &s, &rw->rt->impl->dev[which]);
    }
#endif
    (void)which;
    (void)src_rows;
    for (int64_t q = 0; q < n; q++)
        memcpy((char *)dst + (size_t)q * rw->row, (const char *)src + (size_t)idx[q] * rw->row, rw->row);
    return DSK_OK;
}

static dsk_status dsk__moe_rowio_copy(dsk__moe_rowio *rw, void *dst, const void *src, int64_t n) {
    if (n == 0) return DSK_OK;
#ifdef DSK_CUDA
    if (rw->dev) {
        dsk_tensor o, s;
        int64_t sh[2] = {n, rw->words};
        DSK__TRY(dsk_tensor_wrap(&o, dst, rw->word, rw->ctx->device, 2, sh));
        DSK__TRY(dsk_tensor_wrap(&s, (void *)src, rw->word, rw->ctx->device, 2, sh));
        return dsk_tensor_copy(rw->ctx, &o, &s);
    }
#endif
    memcpy(dst, src, (size_t)n * rw->row);
    return DSK_OK;
}

/* All-to-all-v over comm of scnt[p] rows to p and rcnt[p] rows from p, packed. */
static dsk_status dsk__moe_rowio_a2av(dsk__moe_rowio *rw, dsk_comm *comm, const void *send, const int64_t *scnt,
                                      void *recv, const int64_t *rcnt) {
    int64_t *e = rw->rt->impl->tmp;
    int n = comm->world_size;
    for (int p = 0; p < n; p++) {
        e[p] = scnt[p] * rw->row_elems;
        e[n + p] = rcnt[p] * rw->row_elems;
    }
    return dsk_comm_all_to_all_v(comm, rw->ctx, send, e, NULL, recv, e + n, NULL, rw->dt);
}

/* n bytes for intermediate rows: the route's reused host buffer, or (nccl) device memory. */
static dsk_status dsk__moe_rowio_buffer(dsk__moe_rowio *rw, const char *fn, size_t n, void *devbuf, char **out) {
    dsk__moe_route_impl *ri = rw->rt->impl;
#ifdef DSK_CUDA
    if (rw->dev) {
        dsk_tensor *t = (dsk_tensor *)devbuf;
        int64_t sh[1] = {(int64_t)(n ? n : 1)};
        DSK__TRY(dsk_tensor_alloc(rw->ctx, t, DSK_U8, 1, sh));
        *out = (char *)t->data;
        return DSK_OK;
    }
#endif
    (void)devbuf;
    if (n > ri->scratch_bytes || !ri->scratch) {
        char *p = (char *)DSK_MALLOC(n ? n : 1);
        if (!p) return dsk_set_error(DSK_ERR_OOM, "%s: %zu bytes of intermediate rows", fn, n);
        DSK_FREE(ri->scratch);
        ri->scratch = p;
        ri->scratch_bytes = n;
    }
    *out = ri->scratch;
    return DSK_OK;
}

/* Checks a dispatch or combine call and fills rw; n_in, n_out: the rows of its two buffers. */
static dsk_status dsk__moe_rowio_begin(dsk__moe_rowio *rw, const char *fn, dsk_moe_route *rt, dsk_ctx *ctx,
                                       const void *in, int64_t n_in, int64_t row_elems, dsk_dtype dt, const void *out,
                                       int64_t n_out) {
    memset(rw, 0, sizeof *rw);
    if (!rt || !rt->impl) return dsk_set_error(DSK_ERR_ARG, "%s: route is NULL or not initialised", fn);
    DSK__TRY(dsk__moe_route_check(rt->impl->c, fn));
    if (!dsk__moe_route_dtype_ok(dt))
        return dsk_set_error(DSK_ERR_ARG, "%s: dtype %s is not supported (f32, f16, bf16, f64, i32, i64, u8)", fn,
                             dsk_dtype_name(dt));
    if (row_elems < 0) return dsk_set_error(DSK_ERR_ARG, "%s: row_elems %lld is negative", fn, (long long)row_elems);
    if ((n_in && row_elems && !in) || (n_out && row_elems && !out))
        return dsk_set_error(DSK_ERR_ARG, "%s: NULL buffer for %lld rows in, %lld out", fn, (long long)n_in,
                             (long long)n_out);
    rw->rt = rt;
    rw->ctx = ctx;
    rw->dt = dt;
    rw->row_elems = row_elems;
    rw->row = (size_t)row_elems * dsk_dtype_size(dt);
    rw->dev = DSK__MOE_NCCL(rt->impl->c);
    if (rw->dev) {
        rw->word = rw->row % 4 == 0 ? DSK_F32 : DSK_BF16;
        rw->words = (int64_t)(rw->row / dsk_dtype_size(rw->word));
        if (rw->row % 2)
            return dsk_set_error(DSK_ERR_UNSUPPORTED,
                                 "%s: rows of %zu bytes on the nccl backend (it gathers rows as "
                                 "16-bit words)",
                                 fn, rw->row);
    }
    return DSK_OK;
}

/* Adds what the two-hop communicators moved since *before to c's statistics (host), or the rows
   that left the node (nccl, which counts no bytes). */
static void dsk__moe_route_stats(dsk__moe_rowio *rw, const dsk_comm_stats *before, int64_t rows_off_node, double t0) {
    dsk__moe_route_impl *ri = rw->rt->impl;
    dsk_comm_stats *s = &ri->c->stats;
    s->calls++;
    s->seconds += dsk__moe_now() - t0;
    if (rw->dev) {
        s->bytes_sent_off_node += (uint64_t)rows_off_node * rw->row;
        return;
    }
    for (int h = 0; h < 2; h++) {
        const dsk_comm_stats *now = h ? &ri->cross->stats : &ri->node->stats;
        s->bytes_sent += now->bytes_sent - before[h].bytes_sent;
        s->bytes_received += now->bytes_received - before[h].bytes_received;
        s->bytes_sent_off_node += now->bytes_sent_off_node - before[h].bytes_sent_off_node;
    }
}

DSK_API dsk_status dsk_moe_route_dispatch(dsk_moe_route *rt, dsk_ctx *ctx, const void *rows, int64_t row_elems,
                                          dsk_dtype dt, void *recv) {
    const char *fn = "dsk_moe_route_dispatch";
    dsk__moe_rowio rw;
    dsk__moe_route_impl *ri;
    dsk_comm_stats before[2];
    double t0 = dsk__moe_now();
    dsk_tensor buf;
    char *s1 = NULL, *cat, *s2 = NULL, *r2;
    dsk_status st;
    DSK__TRY(
        dsk__moe_rowio_begin(&rw, fn, rt, ctx, rows, rt ? rt->n_rows : 0, row_elems, dt, recv, rt ? rt->recv_rows : 0));
    ri = rt->impl;
    memset(&buf, 0, sizeof buf);
    if (!rt->two_hop) { /* send <- rows in (destination, row, slot) order; all-to-all-v into recv */
        DSK__TRY(dsk__moe_rowio_buffer(&rw, fn, (size_t)rt->slots * rw.row, &buf, &s2));
        if ((st = dsk__moe_rowio_gather(&rw, s2, rows, rt->n_rows, ri->g2, DSK__MOE_RT_G2, rt->slots)) == DSK_OK)
            st = dsk__moe_rowio_a2av(&rw, ri->c, s2, ri->c1s, recv, ri->c1r);
        if (rw.dev && st == DSK_OK) ri->c->stats.bytes_sent_off_node += (uint64_t)rt->dispatch_rows_off_node * rw.row;
        dsk_tensor_free(ctx, &buf);
        return st;
    }
    before[0] = ri->node->stats;
    before[1] = ri->cross->stats;
    /* the parts are 64 bytes apart, so a send and a receive never share an address, even empty */
    DSK__TRY(dsk__moe_rowio_buffer(&rw, fn, (size_t)(ri->n1 + rt->n_rows + ri->h1 + ri->s2 + ri->r2) * rw.row + 192,
                                   &buf, &s1));
    cat = s1 + (size_t)ri->n1 * rw.row + 64; /* [rows | hop 1 received] */
    s2 = cat + (size_t)(rt->n_rows + ri->h1) * rw.row + 64;
    r2 = s2 + (size_t)ri->s2 * rw.row + 64;
    st = dsk__moe_rowio_gather(&rw, s1, rows, rt->n_rows, ri->g1, DSK__MOE_RT_G1, ri->n1);
    if (st == DSK_OK) st = dsk__moe_rowio_copy(&rw, cat, rows, rt->n_rows);
    if (st == DSK_OK) st = dsk__moe_rowio_a2av(&rw, ri->cross, s1, ri->c1s, cat + (size_t)rt->n_rows * rw.row, ri->c1r);
    if (st == DSK_OK) st = dsk__moe_rowio_gather(&rw, s2, cat, rt->n_rows + ri->h1, ri->g2, DSK__MOE_RT_G2, ri->s2);
    if (st == DSK_OK) st = dsk__moe_rowio_a2av(&rw, ri->node, s2, ri->c2s, r2, ri->c2r);
    if (st == DSK_OK) st = dsk__moe_rowio_gather(&rw, recv, r2, ri->r2, ri->p2, DSK__MOE_RT_P2, rt->recv_rows);
    if (st == DSK_OK) dsk__moe_route_stats(&rw, before, rt->dispatch_rows_off_node, t0);
    dsk_tensor_free(ctx, &buf);
    return st;
}

DSK_API dsk_status dsk_moe_route_combine(dsk_moe_route *rt, dsk_ctx *ctx, const void *rows, int64_t row_elems,
                                         dsk_dtype dt, void *out) {
    const char *fn = "dsk_moe_route_combine";
    dsk__moe_rowio rw;
    dsk__moe_route_impl *ri;
    dsk_comm_stats before[2];
    double t0 = dsk__moe_now();
    dsk_tensor buf;
    char *t2 = NULL, *u2, *v1;
    dsk_status st;
    DSK__TRY(
        dsk__moe_rowio_begin(&rw, fn, rt, ctx, rows, rt ? rt->recv_rows : 0, row_elems, dt, out, rt ? rt->slots : 0));
    ri = rt->impl;
    memset(&buf, 0, sizeof buf);
    if (!rt->two_hop) { /* all-to-all-v back, grouped by destination; then slot order */
        DSK__TRY(dsk__moe_rowio_buffer(&rw, fn, (size_t)rt->slots * rw.row, &buf, &t2));
        if ((st = dsk__moe_rowio_a2av(&rw, ri->c, rows, ri->c1r, t2, ri->c1s)) == DSK_OK)
            st = dsk__moe_rowio_gather(&rw, out, t2, rt->slots, ri->qo, DSK__MOE_RT_QO, rt->slots);
        if (rw.dev && st == DSK_OK) ri->c->stats.bytes_sent_off_node += (uint64_t)rt->combine_rows_off_node * rw.row;
        dsk_tensor_free(ctx, &buf);
        return st;
    }
    before[0] = ri->node->stats;
    before[1] = ri->cross->stats;
    DSK__TRY(
        dsk__moe_rowio_buffer(&rw, fn, (size_t)(rt->recv_rows + ri->s2 + ri->w1 + ri->v1) * rw.row + 128, &buf, &t2));
    u2 = t2 + (size_t)rt->recv_rows * rw.row + 64; /* [hop 2 back | hop 1 back] */
    v1 = u2 + (size_t)(ri->s2 + ri->w1) * rw.row + 64;
    st = dsk__moe_rowio_gather(&rw, t2, rows, rt->recv_rows, ri->q2, DSK__MOE_RT_Q2, rt->recv_rows);
    if (st == DSK_OK) st = dsk__moe_rowio_a2av(&rw, ri->node, t2, ri->c2r, u2, ri->c2s);
    if (st == DSK_OK) st = dsk__moe_rowio_gather(&rw, v1, u2, ri->s2, ri->q1, DSK__MOE_RT_Q1, ri->v1);
    if (st == DSK_OK) st = dsk__moe_rowio_a2av(&rw, ri->cross, v1, ri->v1s, u2 + (size_t)ri->s2 * rw.row, ri->w1r);
    if (st == DSK_OK) st = dsk__moe_rowio_gather(&rw, out, u2, ri->s2 + ri->w1, ri->qo, DSK__MOE_RT_QO, rt->slots);
    if (st == DSK_OK) dsk__moe_route_stats(&rw, before, rt->combine_rows_off_node, t0);
    dsk_tensor_free(ctx, &buf);
    return st;
}

#ifdef DSK_CUDA
/* nccl: the index arrays on ctx's device. */
static dsk_status dsk__moe_route_upload(dsk_moe_route *rt, dsk_ctx *ctx) {
    dsk__moe_route_impl *ri = rt->impl;
    const int32_t *idx[6] = {ri->g1, ri->g2, ri->p2, ri->q2, ri->q1, ri->qo};
    int64_t len[6] = {ri->n1, rt->two_hop ? ri->s2 : rt->slots, rt->recv_rows, rt->recv_rows, ri->v1, rt->slots};
    for (int i = 0; i < 6; i++) {
        dsk_tensor h;
        int64_t sh[1] = {len[i]};
        if (!idx[i] || !len[i]) continue;
        DSK__TRY(dsk_tensor_wrap(&h, (void *)idx[i], DSK_I32, dsk_cpu(), 1, sh));
        DSK__TRY(dsk_tensor_alloc(ctx, &ri->dev[i], DSK_I32, 1, sh));
        DSK__TRY(dsk_tensor_copy(ctx, &ri->dev[i], &h));
    }
    return dsk_ctx_sync(ctx); /* the host arrays may change after init returns */
}
#endif

DSK_API dsk_status dsk_moe_route_init(dsk_moe_route *rt, dsk_comm *c, dsk_ctx *ctx, int64_t n_rows, int k,
                                      const int32_t *dest, const dsk_moe_route_opts *opts) {
    const char *fn = "dsk_moe_route_init";
    dsk__moe_route_impl *ri;
    int64_t *pairs, *slot_id = NULL;
    int n, two = opts && opts->two_hop, *rank_at = NULL;
    dsk_status st = DSK_OK;
    if (!rt) return dsk_set_error(DSK_ERR_ARG, "%s: route is NULL", fn);
    memset(rt, 0, sizeof *rt);
    DSK__TRY(dsk__moe_route_check(c, fn));
    n = c->world_size;
    if (n_rows < 0 || k < 1 || n_rows * (int64_t)k > INT32_MAX || (n_rows && !dest))
        return dsk_set_error(DSK_ERR_ARG,
                             "%s: need n_rows >= 0 (got %lld), 1 <= k, n_rows * k <= 2^31 - 1 (k %d) and "
                             "dest",
                             fn, (long long)n_rows, k);
    for (int64_t i = 0; i < n_rows * k; i++)
        if (dest[i] < -1 || dest[i] >= n)
            return dsk_set_error(DSK_ERR_ARG, "%s: row %lld slot %d goes to rank %d, not in [-1, %d)", fn,
                                 (long long)(i / k), (int)(i % k), (int)dest[i], n);
    if (DSK__MOE_NCCL(c) && (!ctx || ctx->device.type != DSK_DEV_CUDA))
        return dsk_set_error(DSK_ERR_ARG, "%s: the nccl backend needs a ctx on the GPU (its index arrays live there)",
                             fn);
    if (two)
        for (int r = 0; r < n; r++) {
            int size = 0;
            for (int q = 0; q < n; q++) size += dsk_comm_node_of(c, q) == dsk_comm_node_of(c, r);
            if (size != c->node_size)
                return dsk_set_error(DSK_ERR_UNSUPPORTED,
                                     "%s: two hops need nodes of one size, but node %d has %d "
                                     "ranks and node %d has %d",
                                     fn, c->node, c->node_size, dsk_comm_node_of(c, r), size);
        }
    if (!(ri = (dsk__moe_route_impl *)DSK_MALLOC(sizeof *ri))) return dsk_set_error(DSK_ERR_OOM, "%s: route", fn);
    memset(ri, 0, sizeof *ri);
    rt->impl = ri;
    rt->n_rows = n_rows;
    rt->k = k;
    rt->two_hop = two;
    ri->c = c;
    ri->recv_counts = (int64_t *)DSK_MALLOC((size_t)n * sizeof(int64_t));
    ri->c1s = (int64_t *)DSK_MALLOC((size_t)6 * n * sizeof(int64_t));
    ri->tmp = (int64_t *)DSK_MALLOC((size_t)4 * n * sizeof(int64_t));
    ri->node_of = (int *)DSK_MALLOC((size_t)n * sizeof(int));
    slot_id = (int64_t *)DSK_MALLOC((size_t)(n_rows * k + 1) * sizeof(int64_t));
    if (!ri->recv_counts || !ri->c1s || !ri->tmp || !ri->node_of || !slot_id) {
        st = dsk_set_error(DSK_ERR_OOM, "%s: route of %lld rows over %d ranks", fn, (long long)n_rows, n);
        goto done;
    }
    ri->c1r = ri->c1s + n;
    ri->c2s = ri->c1s + 2 * n;
    ri->c2r = ri->c1s + 3 * n;
    ri->v1s = ri->c1s + 4 * n;
    ri->w1r = ri->c1s + 5 * n;
    rt->recv_counts = ri->recv_counts;
    for (int p = 0; p < n; p++) ri->node_of[p] = dsk_comm_node_of(c, p);
    /* slots to each rank, and the kind of route, to every rank: all must have built the same kind */
    pairs = ri->tmp;
    for (int p = 0; p < 2 * n; p++) pairs[p] = p % 2 ? two : 0;
    for (int64_t i = 0; i < n_rows * k; i++) {
        slot_id[i] = dest[i] < 0 ? -1 : rt->slots++;
        if (dest[i] >= 0) pairs[2 * dest[i]]++;
    }
    for (int p = 0; p < n; p++) ri->c2s[p] = pairs[2 * p]; /* kept: c2s is rewritten by the two-hop plan */
    for (int p = 0; p < n; p++) ri->c1s[p] = 2;            /* elements to and from each rank */
    if ((st = dsk__moe_route_meta(c, ctx, pairs, ri->c1s, pairs + 2 * n, ri->c1s, DSK_I64)) != DSK_OK) goto done;
    for (int p = 0; p < n; p++) {
        ri->recv_counts[p] = pairs[2 * n + 2 * p];
        rt->recv_rows += ri->recv_counts[p];
        if (pairs[2 * n + 2 * p + 1] != two) {
            st = dsk_set_error(DSK_ERR_ARG, "%s: rank %d built a %s route but this rank (%d) a %s one", fn, p,
                               two ? "flat" : "two-hop", c->rank, two ? "two-hop" : "flat");
            goto done;
        }
    }
    if (!two) st = dsk__moe_route_flat(rt, fn, dest, ri->c2s);
    else if ((st = dsk_comm_node_comms(c, &ri->node, &ri->cross)) == DSK_OK) {
        int L = c->node_size, N = c->n_nodes;
        if (!(rank_at = (int *)DSK_MALLOC(((size_t)N * L + 2 * (size_t)N + (size_t)n) * sizeof(int))))
            st = dsk_set_error(DSK_ERR_OOM, "%s: %d nodes of %d ranks", fn, N, L);
        else {
            int *local_of = rank_at + (size_t)N * L + 2 * (size_t)N;
            dsk__moe_node_ranks(c, ri->node_of, L, rank_at);
            for (int b = 0; b < N; b++)
                for (int j = 0; j < L; j++) local_of[rank_at[(size_t)b * L + j]] = j;
            st = dsk__moe_route_plan2(rt, ctx, fn, dest, slot_id, rank_at, local_of);
        }
    }
#ifdef DSK_CUDA
    if (st == DSK_OK && DSK__MOE_NCCL(c)) st = dsk__moe_route_upload(rt, ctx);
#endif
done:
    DSK_FREE(slot_id);
    DSK_FREE(rank_at);
    if (st != DSK_OK) dsk_moe_route_free(rt);
    return st;
}

/* ---------------------------------------------------------------- expert-parallel exchange */

/* Host copies of small device arrays: the CPU reads its buffers where they are; CUDA copies
   them back (asynchronously: the caller syncs once for all of them). */
static dsk_status dsk__moe_to_host(dsk_moe *m, dsk_ctx *ctx, void *dst, const void *src, size_t bytes) {
#ifdef DSK_CUDA
    if (m->device.type == DSK_DEV_CUDA) return dsk_cuda_memcpy(ctx, dst, src, bytes, 0);
#endif
    (void)m;
    (void)ctx;
    if (bytes) memcpy(dst, src, bytes); /* an empty batch's arrays may be NULL */
    return DSK_OK;
}

/* ... and host arrays into device buffers (pageable host memory: the copy has consumed the
   source when it returns, so the host array may change at once). */
static dsk_status dsk__moe_to_device(dsk_moe *m, dsk_ctx *ctx, void *dst, const void *src, size_t bytes) {
#ifdef DSK_CUDA
    if (m->device.type == DSK_DEV_CUDA) return dsk_cuda_memcpy(ctx, dst, src, bytes, 1);
#endif
    (void)m;
    (void)ctx;
    if (bytes) memcpy(dst, src, bytes); /* an empty batch's arrays may be NULL */
    return DSK_OK;
}

/* The regroup index of expert parallelism on the host: expert-major row q <- received
   (rank-major) row rg[q], and rg's inverse after it (2R entries in st->f->h_rg). */
static dsk_status dsk__moe_regroup_index(dsk_moe *m, const int64_t *recv, int64_t R) {
    struct dsk__moe_state *st = m->st;
    int P = m->ep_size, El = m->n_local;
    int64_t src = 0;
    int32_t *g, *gi;
    if (2 * R > st->f->h_rg_cap) {
        DSK_FREE(st->f->h_rg);
        st->f->h_rg = (int32_t *)DSK_MALLOC((size_t)(2 * R + 1) * sizeof(int32_t));
        st->f->h_rg_cap = st->f->h_rg ? 2 * R : 0;
        if (!st->f->h_rg)
            return dsk_set_error(DSK_ERR_OOM, "dsk_moe_forward: out of host memory for %lld rows", (long long)R);
    }
    g = st->f->h_rg;
    gi = st->f->h_rg + R;
    for (int r = 0; r < P; r++)
        for (int e = 0; e < El; e++) {
            int64_t before = 0; /* rows of expert e from ranks < r */
            for (int r2 = 0; r2 < r; r2++) before += recv[r2 * El + e];
            for (int64_t j = 0; j < recv[r * El + e]; j++) g[st->f->local_off[e] + before + j] = (int32_t)(src + j);
            src += recv[r * El + e];
        }
    for (int64_t q = 0; q < R; q++) gi[g[q]] = (int32_t)q;
    return DSK_OK;
}

/* After the dispatch: the kept slots per expert go to their owners (all-to-all of the counts),
   the group's totals are summed (cntg), and the host learns the layout of the row exchange:
   st->f->send_rows, recv_rows, a2a, local_off, the regroup index and *n_kept, *R. CUDA: one host
   sync here (the counts), the only one of a forward with expert parallelism. */
static dsk_status dsk__moe_ep_counts(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *cnt, dsk_tensor *cntg,
                                     int64_t *n_kept, int64_t *R) {
    struct dsk__moe_state *st = m->st;
    dsk_comm *c = m->opts.ep;
    int P = m->ep_size, El = m->n_local, E = m->opts.n_routed;
    int64_t D = m->opts.d_model, so = 0, ro = 0, *kept = st->h_cnt + 3 + E, *recv = st->f->h_recv_cnt;
    dsk_tensor recv_cnt, rg, rgi, loff;
    int32_t lo[1024], *lop;
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_RECV_CNT, 0, 0, &recv_cnt));
    DSK__TRY(dsk_comm_all_to_all(c, ctx, DSK__MOE_I64(*cnt) + 3 + E, recv_cnt.data, El, DSK_I64));
    DSK__TRY(dsk_comm_all_reduce(c, ctx, cnt->data, cntg->data, 3 + E, DSK_I64, DSK_COMM_SUM));
    DSK__TRY(dsk__moe_to_host(m, ctx, kept, DSK__MOE_I64(*cnt) + 3 + E, (size_t)E * sizeof(int64_t)));
    DSK__TRY(dsk__moe_to_host(m, ctx, recv, recv_cnt.data, (size_t)(P * El) * sizeof(int64_t)));
    DSK__TRY(dsk_ctx_sync(ctx)); /* CUDA: the counts are on the host now (CPU: nothing to wait for) */
    *n_kept = 0;
    for (int e = 0; e < E; e++) *n_kept += kept[e];
    for (int r = 0; r < P; r++) {
        st->f->send_rows[r] = 0;
        st->f->recv_rows[r] = 0;
        for (int e = 0; e < El; e++) {
            st->f->send_rows[r] += kept[r * El + e];
            st->f->recv_rows[r] += recv[r * El + e];
        }
        st->f->a2a[r] = st->f->send_rows[r] * D;
        st->f->a2a[P + r] = so;
        so += st->f->a2a[r];
        st->f->a2a[2 * P + r] = st->f->recv_rows[r] * D;
        st->f->a2a[3 * P + r] = ro;
        ro += st->f->a2a[2 * P + r];
    }
    st->f->local_off[0] = 0;
    for (int e = 0; e < El; e++) {
        st->f->local_off[e + 1] = st->f->local_off[e];
        for (int r = 0; r < P; r++) st->f->local_off[e + 1] += recv[r * El + e];
    }
    *R = st->f->local_off[El];
    DSK__TRY(dsk__moe_regroup_index(m, recv, *R));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_RG, 0, *R, &rg));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_RGI, 0, *R, &rgi));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_LOCAL_OFF, 0, 0, &loff));
    lop = El + 1 <= 1024 ? lo : (int32_t *)DSK_MALLOC((size_t)(El + 1) * sizeof(int32_t));
    if (!lop) return dsk_set_error(DSK_ERR_OOM, "dsk_moe_forward: out of host memory");
    for (int e = 0; e <= El; e++) lop[e] = (int32_t)st->f->local_off[e];
    {
        dsk_status s = dsk__moe_to_device(m, ctx, loff.data, lop, (size_t)(El + 1) * sizeof(int32_t));
        if (lop != lo) DSK_FREE(lop);
        DSK__TRY(s);
    }
    DSK__TRY(dsk__moe_to_device(m, ctx, rg.data, st->f->h_rg, (size_t)*R * sizeof(int32_t)));
    return dsk__moe_to_device(m, ctx, rgi.data, st->f->h_rg + *R, (size_t)*R * sizeof(int32_t));
}

/* Bounded EP: every peer's block Cp rows, as all-to-all-v counts and displacements (st->f->a2a, in elements),
   which a chunked exchange sends by. */
static void dsk__moe_ep_blocks(dsk_moe *m, int64_t Cp) {
    int P = m->ep_size;
    int64_t *a = m->st->f->a2a, n = Cp * m->opts.d_model;
    for (int r = 0; r < P; r++) a[r] = a[2 * P + r] = n, a[P + r] = a[3 * P + r] = r * n;
}

/* Bounded EP, chunked: each received block's segments (EP_SEG, dsk__moe_block_segment), from the received keys. */
static dsk_status dsk__moe_block_segments(dsk_moe *m, dsk_ctx *ctx, int64_t Cp, const dsk_tensor *rkey) {
    dsk_tensor seg;
    int El = m->n_local;
    int64_t n = (int64_t)m->ep_size * (El + 1);
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_EP_SEG, m->st->f->T, m->st->f->R, &seg));
    DSK__MOE_ON_CUDA(m, dsk_cuda_moe_block_segments(ctx, m->ep_size, El, Cp, DSK__MOE_I32(*rkey), DSK__MOE_I32(seg)));
    for (int64_t i = 0; i < n; i++) DSK__MOE_I32(seg)[i] = dsk__moe_block_segment(i, El, Cp, DSK__MOE_I32(*rkey));
    return DSK_OK;
}

/* Bounded EP after the dispatch (no host sync): the group's totals (cntg), the send layout
   (EP_PAD, EP_UNPAD), the local expert of every row received (the keys travel beside the rows, in
   a fixed-size all-to-all), and from them, on the device, the regroup index RG (a stable sort of
   the received rows by local expert: each expert's rows by source rank, then in the source's kept
   order, as the exact exchange places them), its inverse RGI and the local offsets. */
static dsk_status dsk__moe_ep_bounded(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *off, const dsk_tensor *cnt,
                                      dsk_tensor *cntg) {
    struct dsk__moe_state *st = m->st;
    int64_t T = st->f->T, R = st->f->R, Cp = R / m->ep_size, E = m->opts.n_routed;
    dsk_tensor pad, skey, rkey, unpad, rg, rgi, loff;
    DSK__TRY(dsk_comm_all_reduce(m->opts.ep, ctx, cnt->data, cntg->data, 3 + E, DSK_I64, DSK_COMM_SUM));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_EP_PAD, T, R, &pad));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_EP_SKEY, T, R, &skey));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_EP_RKEY, T, R, &rkey));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_EP_UNPAD, T, R, &unpad));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_RG, T, R, &rg));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_RGI, T, R, &rgi));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_LOCAL_OFF, T, R, &loff));
    DSK__TRY(dsk__moe_ep_index(m, ctx, Cp, T * m->opts.top_k, off, &pad, &skey, &unpad));
    DSK__TRY(dsk_comm_all_to_all(m->opts.ep, ctx, skey.data, rkey.data, Cp, DSK_I32));
    DSK__TRY(dsk_group_by_key(ctx, &rg, &loff, &rkey));
    DSK__TRY(dsk__moe_ep_inverse(m, ctx, R, &rg, &loff, &rgi));
    dsk__moe_ep_blocks(m, Cp);
    return dsk__moe_chunking(m, NULL) ? dsk__moe_block_segments(m, ctx, Cp, &rkey) : DSK_OK;
}

static dsk_status dsk__moe_others_to_experts(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *rows);
static dsk_status dsk__moe_a2a(dsk_moe *m, dsk_ctx *ctx, const void *send, const int64_t *sc, const int64_t *sd,
                               void *recv, const int64_t *rc, const int64_t *rd, dsk_dtype dt);

/* Bounded EP: rows (kept order) -> each peer's block of Cp rows -> dst (R), expert-major (rows past
   the received ones zero); chunked: the other peers' blocks begun into STAGE2; begun (host, st->xch_begin): all
   of them, regrouped at the exchange's end (dsk__moe_exchange_finish). */
static dsk_status dsk__moe_to_experts_bounded(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *rows, dsk_tensor *dst) {
    struct dsk__moe_state *st = m->st;
    const int64_t *a = st->f->a2a, P = m->ep_size;
    dsk_tensor send, recv, pad = dsk__moe_saved(m, DSK__MOE_EP_PAD), rg = dsk__moe_saved(m, DSK__MOE_RG);
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_STAGE, st->f->T, st->f->R, &send));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_STAGE2, st->f->T, st->f->R, &recv));
    send = dsk__moe_rows(&send, st->f->R);
    DSK__TRY(dsk_gather_rows_scaled(ctx, &send, rows, &pad, NULL));
    if (st->chunked) return dsk__moe_others_to_experts(m, ctx, &send);
    if (st->xch_begin) return dsk__moe_a2a(m, ctx, send.data, a, a + P, recv.data, a + 2 * P, a + 3 * P, rows->dtype);
    DSK__TRY(dsk_comm_all_to_all(m->opts.ep, ctx, send.data, recv.data, st->f->R / m->ep_size * m->opts.d_model,
                                 rows->dtype));
    return dsk_gather_rows_scaled(ctx, dst, &recv, &rg, NULL);
}

/* The bounded return's blocks, landed in STAGE, into dst (kept order). */
static dsk_status dsk__moe_unpad(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *dst) {
    dsk_tensor recv, unpad = dsk__moe_saved(m, DSK__MOE_EP_UNPAD);
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_STAGE, m->st->f->T, m->st->f->R, &recv));
    recv = dsk__moe_rows(&recv, m->st->f->R);
    unpad = dsk__moe_rows(&unpad, dst->shape[0]);
    return dsk_gather_rows_scaled(ctx, dst, &recv, &unpad, NULL);
}

/* ... and back: rows (R, expert-major; chunked: the blocks' order) to their sources' blocks, then into dst (kept
   order; begun: at the exchange's end). */
static dsk_status dsk__moe_from_experts_bounded(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *rows, dsk_tensor *dst) {
    struct dsk__moe_state *st = m->st;
    const int64_t *a = st->f->a2a, P = m->ep_size;
    dsk_tensor send, recv, rgi = dsk__moe_saved(m, DSK__MOE_RGI);
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_STAGE2, st->f->T, st->f->R, &send));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_STAGE, st->f->T, st->f->R, &recv));
    if (st->chunked) send = *rows; /* the chunks computed in the exchange's order */
    else DSK__TRY(dsk_gather_rows_scaled(ctx, &send, rows, &rgi, NULL));
    if (st->xch_begin) return dsk__moe_a2a(m, ctx, send.data, a + 2 * P, a + 3 * P, recv.data, a, a + P, rows->dtype);
    DSK__TRY(dsk_comm_all_to_all(m->opts.ep, ctx, send.data, recv.data, st->f->R / m->ep_size * m->opts.d_model,
                                 rows->dtype));
    return dsk__moe_unpad(m, ctx, dst);
}

/* Two hops in the layer (opts.ep_route TWO_HOP). The forward's dispatch and backward's rows to the
   experts send token rows (x, dy) through a dsk_moe_route: each crosses once to every node holding one of its
   kept slots, then fans out inside it. The routing travels beside them once per forward ((T, 2K) int32: each
   slot's expert or -1, then its gate's bits), so the receiver places every row where the flat exchange puts it
   (expert-major: by local expert, source rank, then the source's kept order) and backward scales dy by the
   gate there (the product g * dy the sender makes on the flat path: the same bits). Outputs come back by the
   route's combine, one row per slot, then into the kept order. The plan is made on the host; a CUDA layer
   copies the kept order and gates back once a forward (after the counts' sync, which the exact exchange has
   anyway), sends the routing from device memory, and uploads the indices for its device gathers. A chunked CPU
   layer (opts.ep_chunk) takes the route's rows in the flat exchange's order instead (XI, XG), and sends its
   results back from that order (YI). */
enum {
    DSK__MOE_HOP_RG,
    DSK__MOE_HOP_RGI,
    DSK__MOE_HOP_KIDX,
    DSK__MOE_HOP_GATE,
    DSK__MOE_HOP_STAGE0,
    DSK__MOE_HOP_STAGE1,
    DSK__MOE_HOP_META,
    DSK__MOE_HOP_XI,
    DSK__MOE_HOP_XG,
    DSK__MOE_HOP_YI,
    DSK__MOE_HOP_N
};

struct dsk__moe_hop {
    dsk_moe_route rt;
    int32_t *dest;     /* (T K) the rank of each slot's expert, -1 for a dropped slot */
    int32_t *meta;     /* (T + R, 2K) the routing sent, then the routing received */
    int32_t *rg, *rgi; /* (R) expert-major row <- received row, and back */
    int32_t *kidx;     /* (n_kept) kept row <- the route's used slot */
    float *gate;       /* (R) expert-major: each received row's gate */
    float *stage[2];   /* (max(R, n_kept), D) rows between the route and the gathers (CPU) */
    int32_t *xi, *yi;  /* CPU, (R): the flat exchange's row <- the route's received row, and back */
    float *xg;         /* CPU, (R): the flat exchange's order: each received row's gate */
    int64_t rows;      /* rows of a stage */
    dsk_tensor dev[DSK__MOE_HOP_N]; /* CUDA: rg, rgi, kidx, gate, the stages (act) and meta on the device */
};

static void dsk__moe_hop_arrays_free(struct dsk__moe_hop *h, dsk_ctx *ctx) {
    for (int i = 0; i < DSK__MOE_HOP_N; i++) dsk_tensor_free(ctx, &h->dev[i]);
    dsk_moe_route_free(&h->rt);
    DSK_FREE(h->dest);
    DSK_FREE(h->meta);
    DSK_FREE(h->rg);
    DSK_FREE(h->rgi);
    DSK_FREE(h->kidx);
    DSK_FREE(h->gate);
    DSK_FREE(h->xi);
    DSK_FREE(h->yi);
    DSK_FREE(h->xg);
    DSK_FREE(h->stage[0]);
    DSK_FREE(h->stage[1]);
    memset(h, 0, sizeof *h);
}

static void dsk__moe_hop_free(struct dsk__moe_hop *h, dsk_ctx *ctx) {
    if (!h) return;
    dsk__moe_hop_arrays_free(h, ctx);
    DSK_FREE(h);
}

/* Array i (DSK__MOE_HOP_*) of the two-hop state as a (rows, cols) tensor on the layer's device: the host array
   on the CPU, its device copy on CUDA. */
static dsk_tensor dsk__moe_hop_view(const dsk_moe *m, int i, int64_t rows, int64_t cols) {
    struct dsk__moe_hop *h = m->st->f->hop;
    void *host[DSK__MOE_HOP_N] = {h->rg,       h->rgi,  h->kidx, h->gate, h->stage[0],
                                  h->stage[1], h->meta, h->xi,   h->xg,   h->yi};
    dsk_dtype dt = i == DSK__MOE_HOP_GATE || i == DSK__MOE_HOP_XG         ? DSK_F32
                   : i == DSK__MOE_HOP_STAGE0 || i == DSK__MOE_HOP_STAGE1 ? m->st->act
                                                                          : DSK_I32;
    int64_t sh[2] = {rows, cols};
    dsk_tensor t;
    (void)dsk_tensor_wrap(&t, m->device.type == DSK_DEV_CPU ? host[i] : h->dev[i].data, dt, m->device, cols ? 2 : 1,
                          sh);
    return t;
}

/* Counts bytes an exchange sent to other nodes: into the forward's statistics during a forward, and
   (outside eval) into the collected ones. */
static void dsk__moe_count_off(dsk_moe *m, uint64_t bytes) {
    if (m->st->in_forward) m->st->off_bytes[0] += bytes;
    if (!m->eval) m->st->off_bytes[1] += bytes;
}

/* Flat and bounded exchanges: bytes of rows of `row` bytes sent to ranks on other nodes, toward the
   experts (send_rows) or back from them (recv_rows); bounded: every peer's whole block. */
static uint64_t dsk__moe_flat_off(const dsk_moe *m, int back, size_t row) {
    const dsk_comm *c = m->opts.ep;
    uint64_t n = 0;
    for (int r = 0; r < m->ep_size; r++)
        if (dsk_comm_node_of(c, r) != c->node)
            n += (uint64_t)(m->opts.ep_exchange == DSK_MOE_EP_BOUNDED ? m->st->f->R / m->ep_size
                            : back                                    ? m->st->f->recv_rows[r]
                                                                      : m->st->f->send_rows[r]);
    return n * row;
}

/* Received routing (R rows of 2K) -> each received row's local expert (le) and gate bits (gb); a token's rows
   arrive together, in slot order, one per slot of this rank. */
static dsk_status dsk__moe_hop_parse(dsk_moe *m, const int32_t *meta, int32_t *le, int32_t *gb) {
    const dsk_moe_route *rt = &m->st->f->hop->rt;
    int K = m->opts.top_k, El = m->n_local;
    int64_t row = 0;
    for (int p = 0; p < m->ep_size; p++) {
        int64_t end = row + rt->recv_counts[p];
        while (row < end) {
            const int32_t *mr = meta + row * 2 * K;
            int64_t first = row;
            for (int k = 0; k < K; k++) {
                int e = mr[k] - m->expert0;
                if (mr[k] < 0 || e >= El || e < 0) continue;
                if (row >= end)
                    return dsk_set_error(DSK_ERR_CORRUPT,
                                         "dsk_moe_forward: rank %d sent fewer rows than its routing "
                                         "names",
                                         p);
                le[row] = e;
                gb[row++] = mr[K + k];
            }
            if (row == first)
                return dsk_set_error(DSK_ERR_CORRUPT,
                                     "dsk_moe_forward: rank %d sent a row for none of this rank's "
                                     "experts",
                                     p);
        }
    }
    return DSK_OK;
}

/* The received rows expert-major (a stable sort by local expert of the route's order: by source rank, then
   the source's (token, slot) order, which is its kept order within an expert): rg, rgi, gate. */
static dsk_status dsk__moe_hop_regroup(dsk_moe *m, const int32_t *le, const int32_t *gb) {
    struct dsk__moe_state *st = m->st;
    struct dsk__moe_hop *h = st->f->hop;
    int El = m->n_local;
    int64_t at[1024], *pa = El <= 1024 ? at : (int64_t *)DSK_MALLOC((size_t)El * sizeof(int64_t));
    dsk_status s = DSK_OK;
    if (!pa) return dsk_set_error(DSK_ERR_OOM, "dsk_moe_forward: %d experts' offsets", El);
    for (int e = 0; e < El; e++) pa[e] = st->f->local_off[e];
    for (int64_t j = 0; j < st->f->R; j++) {
        int64_t q = pa[le[j]]++;
        h->rg[q] = (int32_t)j;
        h->rgi[j] = (int32_t)q;
        memcpy(&h->gate[q], &gb[j], sizeof(float));
    }
    for (int e = 0; e < El && s == DSK_OK; e++)
        if (pa[e] != st->f->local_off[e + 1])
            s = dsk_set_error(DSK_ERR_CORRUPT,
                              "dsk_moe_forward: local expert %d: the routing brought %lld rows, the "
                              "counts %lld",
                              e, (long long)(pa[e] - st->f->local_off[e]),
                              (long long)(st->f->local_off[e + 1] - st->f->local_off[e]));
    if (pa != at) DSK_FREE(pa);
    return s;
}

/* CUDA: host copies of the kept order perm, the experts' offsets off (E + 1) and the slots' gates (T K), one
   array *in (DSK_FREE): perm's elements, then off's, then the gates' bits. */
static dsk_status dsk__moe_hop_inputs(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *perm, const dsk_tensor *off,
                                      const dsk_tensor *gate, int32_t **in) {
    int64_t np = dsk_tensor_numel(perm), no = dsk_tensor_numel(off), ng = dsk_tensor_numel(gate);
    int32_t *h = (int32_t *)DSK_MALLOC((size_t)(np + no + ng + 1) * sizeof(int32_t));
    dsk_status e;
    if (!h) return dsk_set_error(DSK_ERR_OOM, "dsk_moe_forward: host copies of %lld slots", (long long)ng);
    e = dsk__moe_to_host(m, ctx, h, perm->data, (size_t)np * sizeof(int32_t));
    if (e == DSK_OK) e = dsk__moe_to_host(m, ctx, h + np, off->data, (size_t)no * sizeof(int32_t));
    if (e == DSK_OK) e = dsk__moe_to_host(m, ctx, h + np + no, gate->data, (size_t)ng * sizeof(float));
    if (e == DSK_OK) e = dsk_ctx_sync(ctx);
    if (e != DSK_OK) {
        DSK_FREE(h);
        return e;
    }
    *in = h;
    return DSK_OK;
}

/* The routing (T, 2K) of h->meta through the route into h->meta + T 2K; CUDA: from and into device memory. */
static dsk_status dsk__moe_hop_routing(dsk_moe *m, dsk_ctx *ctx, int64_t T) {
    struct dsk__moe_hop *h = m->st->f->hop;
    int64_t w = 2 * m->opts.top_k, R = m->st->f->R, n = (T + R) * w + 1;
    int32_t *d;
    if (m->device.type == DSK_DEV_CPU) return dsk_moe_route_dispatch(&h->rt, ctx, h->meta, w, DSK_I32, h->meta + T * w);
    DSK__TRY(dsk_tensor_alloc_on(ctx, m->device, &h->dev[DSK__MOE_HOP_META], DSK_I32, 1, &n));
    d = (int32_t *)h->dev[DSK__MOE_HOP_META].data;
    DSK__TRY(dsk__moe_to_device(m, ctx, d, h->meta, (size_t)(T * w) * sizeof(int32_t)));
    DSK__TRY(dsk_moe_route_dispatch(&h->rt, ctx, d, w, DSK_I32, d + T * w));
    DSK__TRY(dsk__moe_to_host(m, ctx, h->meta + T * w, d + T * w, (size_t)(R * w) * sizeof(int32_t)));
    return dsk_ctx_sync(ctx);
}

/* CUDA: the plan's indices and gates on the device, and the stages (act) between the route and the gathers. */
static dsk_status dsk__moe_hop_upload(dsk_moe *m, dsk_ctx *ctx, int64_t n_kept) {
    struct dsk__moe_hop *h = m->st->f->hop;
    int64_t R = m->st->f->R, n[4] = {R + 1, R + 1, n_kept + 1, R + 1}, sh[2] = {h->rows + 1, m->opts.d_model};
    const void *src[4] = {h->rg, h->rgi, h->kidx, h->gate};
    for (int i = 0; i < 4; i++) {
        DSK__TRY(dsk_tensor_alloc_on(ctx, m->device, &h->dev[i], i == DSK__MOE_HOP_GATE ? DSK_F32 : DSK_I32, 1, &n[i]));
        DSK__TRY(dsk__moe_to_device(m, ctx, h->dev[i].data, src[i], (size_t)(n[i] - 1) * sizeof(int32_t)));
    }
    DSK__TRY(dsk_tensor_alloc_on(ctx, m->device, &h->dev[DSK__MOE_HOP_STAGE0], m->st->act, 2, sh));
    return dsk_tensor_alloc_on(ctx, m->device, &h->dev[DSK__MOE_HOP_STAGE1], m->st->act, 2, sh);
}

/* CPU: the route's received rows in the flat exchange's order (by source rank, a source's rows by local expert),
   where a chunked layer computes (XI, XG), and back (YI): both orders meet in the expert-major one (the flat
   exchange's RG and RGI in st->f->h_rg, the route's rg and rgi). */
static void dsk__moe_hop_flat_order(dsk_moe *m) {
    struct dsk__moe_hop *h = m->st->f->hop;
    const int32_t *frg = m->st->f->h_rg, *frgi = frg + m->st->f->R;
    for (int64_t i = 0; i < m->st->f->R; i++) {
        h->xi[i] = h->rg[frgi[i]];
        h->xg[i] = h->gate[frgi[i]];
        h->yi[i] = frg[h->rgi[i]];
    }
}

/* The forward's route (collective over ep): destinations and routing of this rank's T tokens from the kept
   order (perm, off (E + 1) the experts' offsets in it, gate (T K)), sent to the experts' ranks; every index
   of the exchanges that follow. */
static dsk_status dsk__moe_hop_plan(dsk_moe *m, dsk_ctx *ctx, int64_t T, int64_t n_kept, const dsk_tensor *perm,
                                    const dsk_tensor *off, const dsk_tensor *gate) {
    struct dsk__moe_state *st = m->st;
    struct dsk__moe_hop *h = st->f->hop;
    int K = m->opts.top_k, E = m->opts.n_routed, El = m->n_local, dev = m->device.type != DSK_DEV_CPU;
    int64_t TK = T * K, R = st->f->R, s = 0, D = m->opts.d_model, np = dsk_tensor_numel(perm);
    const int32_t *pm = DSK__MOE_I32(*perm), *of = DSK__MOE_I32(*off);
    const float *g = DSK__MOE_F32(*gate);
    int32_t *le, *in = NULL;
    dsk_moe_route_opts ro = {1};
    dsk_status e;
    if (!h) {
        if (!(h = st->f->hop = (struct dsk__moe_hop *)DSK_MALLOC(sizeof *h)))
            return dsk_set_error(DSK_ERR_OOM, "dsk_moe_forward: two-hop state");
        memset(h, 0, sizeof *h);
    }
    dsk__moe_hop_arrays_free(h, ctx);
    h->rows = R > n_kept ? R : n_kept;
    h->dest = (int32_t *)DSK_MALLOC((size_t)(TK + 1) * sizeof(int32_t));
    h->meta = (int32_t *)DSK_MALLOC((size_t)((T + 2 * R) * 2 * K + 1) * sizeof(int32_t));
    h->rg = (int32_t *)DSK_MALLOC((size_t)(R + 1) * sizeof(int32_t));
    h->rgi = (int32_t *)DSK_MALLOC((size_t)(R + 1) * sizeof(int32_t));
    h->kidx = (int32_t *)DSK_MALLOC((size_t)(n_kept + TK + 1) * sizeof(int32_t));
    h->gate = (float *)DSK_MALLOC((size_t)(R + 1) * sizeof(float));
    for (int i = 0; i < 2 && !dev; i++) h->stage[i] = (float *)DSK_MALLOC((size_t)(h->rows * D + 1) * sizeof(float));
    if (!dev) {
        h->xi = (int32_t *)DSK_MALLOC((size_t)(R + 1) * sizeof(int32_t));
        h->yi = (int32_t *)DSK_MALLOC((size_t)(R + 1) * sizeof(int32_t));
        h->xg = (float *)DSK_MALLOC((size_t)(R + 1) * sizeof(float));
    }
    if (!h->dest || !h->meta || !h->rg || !h->rgi || !h->kidx || !h->gate ||
        (!dev && (!h->stage[0] || !h->stage[1] || !h->xi || !h->yi || !h->xg)))
        return dsk_set_error(DSK_ERR_OOM, "dsk_moe_forward: two-hop indices of %lld tokens, %lld rows", (long long)T,
                             (long long)R);
    if (dev) DSK__TRY(dsk__moe_hop_inputs(m, ctx, perm, off, gate, &in));
    if (in) { /* the device arrays' host copies */
        pm = in;
        of = in + np;
        g = (const float *)(in + np + E + 1);
    }
    for (int64_t f = 0; f < TK; f++) {
        h->dest[f] = -1;
        h->meta[(f / K) * 2 * K + f % K] = -1;
        h->meta[(f / K) * 2 * K + K + f % K] = 0;
    }
    for (int x = 0; x < E; x++)
        for (int64_t q = of[x]; q < of[x + 1]; q++) {
            int64_t f = pm[q];
            h->dest[f] = x / El;
            h->meta[(f / K) * 2 * K + f % K] = x;
            memcpy(&h->meta[(f / K) * 2 * K + K + f % K], &g[f], sizeof(float));
        }
    for (int64_t f = 0; f < TK; f++) h->kidx[n_kept + f] = h->dest[f] >= 0 ? (int32_t)s++ : -1; /* used slots */
    for (int64_t q = 0; q < n_kept; q++) h->kidx[q] = h->kidx[n_kept + pm[q]];
    DSK_FREE(in);
    DSK__TRY(dsk_moe_route_init(&h->rt, m->opts.ep, ctx, T, K, h->dest, &ro));
    if (h->rt.recv_rows != R)
        return dsk_set_error(DSK_ERR_CORRUPT, "dsk_moe_forward: the route brings %lld rows, the counts %lld",
                             (long long)h->rt.recv_rows, (long long)R);
    le = h->meta + (T + R) * 2 * K;
    DSK__TRY(dsk__moe_hop_routing(m, ctx, T));
    dsk__moe_count_off(m, (uint64_t)h->rt.dispatch_rows_off_node * 2 * K * sizeof(int32_t));
    e = dsk__moe_hop_parse(m, h->meta + T * 2 * K, le, le + R);
    if (e == DSK_OK) e = dsk__moe_hop_regroup(m, le, le + R);
    if (e == DSK_OK && !dev) dsk__moe_hop_flat_order(m);
    return e == DSK_OK && dev ? dsk__moe_hop_upload(m, ctx, n_kept) : e;
}

static dsk_status dsk__moe_stage(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *stage);
static void dsk__moe_stage_span(const dsk_moe *m, int r, int64_t *r0, int64_t *n);

/* Chunked: the route's received rows (src, R) into the flat exchange's stage, all but this rank's own, which
   the layer copies there and computes while the route runs (dsk__moe_own_to_stage); scaled as below. */
static dsk_status dsk__moe_hop_to_stage(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *src, int scaled) {
    int64_t r0, n, R = m->st->f->R;
    dsk_tensor stage, xi = dsk__moe_hop_view(m, DSK__MOE_HOP_XI, R, 0),
                      xg = dsk__moe_hop_view(m, DSK__MOE_HOP_XG, R, 0);
    dsk__moe_stage_span(m, m->ep_rank, &r0, &n);
    DSK__TRY(dsk__moe_stage(m, ctx, &stage));
    for (int part = 0; part < 2; part++) { /* the rows before this rank's own, then after them */
        int64_t a = part ? r0 + n : 0, len = part ? R - r0 - n : r0;
        dsk_tensor d = dsk__moe_row_range(&stage, a, len), i = dsk__moe_row_range(&xi, a, len),
                   g = dsk__moe_row_range(&xg, a, len);
        if (len) DSK__TRY(dsk_gather_rows_scaled(ctx, &d, src, &i, scaled ? &g : NULL));
    }
    return DSK_OK;
}

/* Token rows (T, D) through the route to the experts' ranks, expert-major into dst (R, D) (chunked: into the
   stage, dsk__moe_hop_to_stage); scaled: times each row's gate (backward's g * dy). */
static dsk_status dsk__moe_hop_to_experts(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *tok, dsk_tensor *dst,
                                          int scaled) {
    struct dsk__moe_hop *h = m->st->f->hop;
    int64_t R = m->st->f->R, D = m->opts.d_model;
    dsk_tensor stage = dsk__moe_hop_view(m, DSK__MOE_HOP_STAGE0, R, D),
               rg = dsk__moe_hop_view(m, DSK__MOE_HOP_RG, R, 0);
    dsk_tensor gate = dsk__moe_hop_view(m, DSK__MOE_HOP_GATE, R, 0);
    DSK__TRY(dsk_moe_route_dispatch(&h->rt, ctx, tok->data, D, tok->dtype, stage.data));
    dsk__moe_count_off(m, (uint64_t)h->rt.dispatch_rows_off_node * (uint64_t)D * dsk_dtype_size(tok->dtype));
    if (m->st->chunked) return dsk__moe_hop_to_stage(m, ctx, &stage, scaled);
    return dsk_gather_rows_scaled(ctx, dst, &stage, &rg, scaled ? &gate : NULL);
}

/* Rows (R, expert-major; chunked: the flat exchange's order) back through the route to their tokens' ranks, into
   dst (n_kept, kept order). */
static dsk_status dsk__moe_hop_from_experts(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *rows, dsk_tensor *dst) {
    struct dsk__moe_hop *h = m->st->f->hop;
    int64_t R = m->st->f->R, D = m->opts.d_model, n = dst->shape[0];
    dsk_tensor sent = dsk__moe_hop_view(m, DSK__MOE_HOP_STAGE0, R, D);
    dsk_tensor rgi = dsk__moe_hop_view(m, m->st->chunked ? DSK__MOE_HOP_YI : DSK__MOE_HOP_RGI, R, 0);
    dsk_tensor back = dsk__moe_hop_view(m, DSK__MOE_HOP_STAGE1, h->rt.slots, D);
    dsk_tensor kidx = dsk__moe_hop_view(m, DSK__MOE_HOP_KIDX, n, 0);
    if (h->rt.slots != n)
        return dsk_set_error(DSK_ERR_CORRUPT, "dsk_moe: the route returns %lld rows for %lld kept slots",
                             (long long)h->rt.slots, (long long)n);
    DSK__TRY(dsk_gather_rows(ctx, &sent, rows, &rgi));
    DSK__TRY(dsk_moe_route_combine(&h->rt, ctx, sent.data, D, rows->dtype, back.data));
    dsk__moe_count_off(m, (uint64_t)h->rt.combine_rows_off_node * (uint64_t)D * dsk_dtype_size(rows->dtype));
    return dsk_gather_rows(ctx, dst, &back, &kidx);
}

/* An exchange (DSK__MOE_XCH_*) on a second thread, so that the
   caller computes meanwhile (host backend: the collective takes no ctx and the gathers use none of its
   workspace). Its buffers are sized before it starts; the thread's error message comes back at the join. */
typedef struct dsk__moe_async {
    dsk_moe *m;
    dsk_ctx *ctx;
    const dsk_tensor *rows;
    dsk_tensor *dst;
    int way, started, chunked; /* way: DSK__MOE_XCH_*; chunked: the other ranks' rows only, queued as they land */
    int n_arrived;             /* chunked: the other ranks whose rows have landed (st->arrival_order) */
    int forked;                /* CUDA: the exchange was issued on st->side, after ev_fork */
    int begun;                 /* host: its all-to-all begun (dsk__moe_begins), finished at the wait or on the
                                  thread when the transport could not take all of it at the start */
    dsk_ctx side, *caller;     /* CUDA: the caller's ctx on st->side (no workspace: the exchanges need none) */
    dsk_ctx_counters at_fork;  /* side's counters when it was made */
    pthread_t thread;
    dsk_status st;
    char err[1024];
} dsk__moe_async;

/* The exchanges: the forward's dispatch (FP8 where opts.ep_dispatch says, its bytes counted), backward's rows
   to the experts (in the activation dtype), rows back from the experts. */
enum { DSK__MOE_XCH_DISPATCH, DSK__MOE_XCH_TO_EXPERTS, DSK__MOE_XCH_FROM_EXPERTS };

/* How far a call begun has come: its rows sent (or travelling), the experts computed (a chunked exchange's
   return travelling), the experts' results on their way back (dsk_moe_experts, dsk_moe_return_begin). */
enum { DSK__MOE_AT_SENT, DSK__MOE_AT_COMPUTED, DSK__MOE_AT_RETURNING };

/* A forward or backward between its begin and its end (dsk_moe_forward_begin .. _end): the exchange in
   flight and what the end reads. One per layer (st->pend). */
typedef struct dsk__moe_pending {
    int kind;   /* DSK__MOE_PEND_* */
    int at;     /* DSK__MOE_AT_* */
    int flying; /* xch started and not joined */
    int64_t T, R, n_rows;
    float aux_scale;                                                      /* backward */
    dsk_tensor w[6];                                                      /* the weights in the activation dtype */
    dsk_tensor xa, xs, xr, back, pos, gate, row_tok, cntg, loss, offsets; /* forward */
    dsk_tensor ob, ys;                                                    /* forward: the experts' outputs */
    dsk_tensor dya, dxf, dgate, dos, dor, dxp, dxr;                       /* backward */
    dsk__moe_async xch;                                                   /* expert parallelism: the exchange */
} dsk__moe_pending;

static dsk_status dsk__moe_join_on_error(dsk__moe_async *a, dsk_status s);

/* Frees the pending record; a begun call's exchange is joined first. */
static void dsk__moe_pending_free(struct dsk__moe_state *st) {
    if (st->pending != DSK__MOE_PEND_NONE && st->pend && st->pend->xch.m)
        (void)dsk__moe_join_on_error(&st->pend->xch, DSK_ERR_STATE);
    DSK_FREE(st->pend);
    st->pend = NULL;
}

static void dsk__moe_pending_set(dsk__moe_pending *p, int kind, int64_t T, int64_t R, int64_t n_rows,
                                 const dsk_tensor *w) {
    p->kind = kind;
    p->at = DSK__MOE_AT_SENT;
    p->flying = 0;
    p->T = T;
    p->R = R;
    p->n_rows = n_rows;
    memcpy(p->w, w, sizeof p->w);
}

static dsk_status dsk__moe_dispatch(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *rows, dsk_tensor *dst);
static dsk_status dsk__moe_to_experts(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *rows, dsk_tensor *dst);
static dsk_status dsk__moe_from_experts(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *rows, dsk_tensor *dst);

static void *dsk__moe_async_main(void *p) {
    dsk__moe_async *a = (dsk__moe_async *)p;
    a->st = a->way == DSK__MOE_XCH_FROM_EXPERTS ? dsk__moe_from_experts(a->m, a->ctx, a->rows, a->dst)
            : a->way == DSK__MOE_XCH_DISPATCH   ? dsk__moe_dispatch(a->m, a->ctx, a->rows, a->dst)
                                                : dsk__moe_to_experts(a->m, a->ctx, a->rows, a->dst);
    if (a->st != DSK_OK) snprintf(a->err, sizeof a->err, "%s", dsk_last_error());
    return NULL;
}

static dsk_status dsk__moe_stage_to_experts(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *dst);
static void dsk__moe_queue_all(dsk__moe_async *a);
#ifdef DSK_CUDA
static void dsk__moe_queue_shifts(dsk__moe_async *a, int k);
#endif

/* Whether an overlapped host exchange runs without a thread: the flat exchange (exact or bounded) of activation
   rows, whose all-to-all-v begins at the start (the messages the transport takes now: shared-memory rings, sockets'
   buffers) and finishes at the wait, or on the thread when the transport did not take them all (not chunked: there the
   layer moves it on between its chunks, dsk_comm_progress). A thread of its own cost the step more over shared
   memory than the exchange it hid (bench/RESULTS.md). */
static int dsk__moe_begins(const dsk_moe *m, int way) {
    return m->device.type == DSK_DEV_CPU && m->opts.ep_route != DSK_MOE_ROUTE_TWO_HOP &&
           (way != DSK__MOE_XCH_DISPATCH || m->opts.ep_dispatch != DSK_MOE_DISPATCH_FP8);
}

/* The begun exchange's end: its all-to-all finished, the rows to the experts regrouped (chunked: the ranks not
   queued yet queued), the bounded return's blocks unpadded. */
static dsk_status dsk__moe_exchange_finish(dsk__moe_async *a) {
    DSK__TRY(dsk_comm_finish(a->m->opts.ep, a->ctx));
    if (a->chunked) {
        dsk__moe_queue_all(a);
        return DSK_OK;
    }
    if (a->way != DSK__MOE_XCH_FROM_EXPERTS) return dsk__moe_stage_to_experts(a->m, a->ctx, a->dst);
    return a->m->opts.ep_exchange == DSK_MOE_EP_BOUNDED ? dsk__moe_unpad(a->m, a->ctx, a->dst) : DSK_OK;
}

static void *dsk__moe_finish_main(void *p) {
    dsk__moe_async *a = (dsk__moe_async *)p;
    if ((a->st = dsk__moe_exchange_finish(a)) != DSK_OK) snprintf(a->err, sizeof a->err, "%s", dsk_last_error());
    return NULL;
}

/* Begins the exchange (dsk__moe_begins); a thread finishes what the transport did not take. */
static void dsk__moe_exchange_begin(dsk__moe_async *a) {
    struct dsk__moe_state *st = a->m->st;
    st->xch_begin = 1;
    st->xch_unsent = 0;
    dsk__moe_async_main(a);
    st->xch_begin = 0;
    a->begun = a->st == DSK_OK;
    if (a->begun && st->xch_unsent > 0 && !a->chunked)
        a->started = pthread_create(&a->thread, NULL, dsk__moe_finish_main, a) == 0;
}

/* Sizes the buffers an exchange running beside the layer uses (staging; FP8 dispatch's codes and scales, and
   FP8 experts' inputs), so that it only looks them up. Two hops use the forward's route (its own scratch and
   communicators) and staging, sized by the route's plan. */
static dsk_status dsk__moe_exchange_buffers(dsk_moe *m, dsk_ctx *ctx) {
    static const int ids[] = {DSK__MOE_STAGE, DSK__MOE_STAGE2, DSK__MOE_Q8, DSK__MOE_Q8S,
                              DSK__MOE_Q8R,   DSK__MOE_Q8RS,   DSK__MOE_RQ, DSK__MOE_RQS};
    int n = m->opts.ep_dispatch != DSK_MOE_DISPATCH_FP8 ? 2 : m->opts.expert_gemm == DSK_MOE_GEMM_FP8 ? 8 : 6;
    dsk_tensor t;
    for (int i = 0; i < n; i++) DSK__TRY(dsk__moe_buf(m, ctx, ids[i], m->st->f->T, m->st->f->R, &t));
    return DSK_OK;
}

/* Starts the exchange: begun (host) or on the exchanges' stream (CUDA) when the layer overlaps, else here and
   now. */
static dsk_status dsk__moe_exchange_start(dsk__moe_async *a, dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *rows,
                                          dsk_tensor *dst, int way) {
    int thread = m->opts.ep_overlap && m->device.type == DSK_DEV_CPU;
    memset(a, 0, sizeof *a);
    a->m = m;
    a->ctx = ctx;
    a->rows = rows;
    a->dst = dst;
    a->way = way;
    a->chunked = m->st->chunked && way != DSK__MOE_XCH_FROM_EXPERTS;
    if (thread || m->st->side) DSK__TRY(dsk__moe_exchange_buffers(m, ctx));
    if (thread && dsk__moe_begins(m, way)) {
        dsk__moe_exchange_begin(a);
        return DSK_OK;
    }
    if (thread) a->started = pthread_create(&a->thread, NULL, dsk__moe_async_main, a) == 0;
#ifdef DSK_CUDA
    if (m->st->side) { /* issued on the exchanges' stream, after what the layer's stream holds */
        DSK__TRY(dsk_cuda_event_record(ctx, m->st->ev_fork));
        DSK__TRY(dsk_cuda_stream_wait_event(m->st->side, m->st->ev_fork));
        a->side = *ctx;
        a->side.stream = m->st->side;
        a->side.cublas = NULL;
        a->side.workspace = NULL;
        a->side.workspace_bytes = 0;
        a->at_fork = ctx->counters;
        a->caller = ctx;
        a->ctx = &a->side;
        a->forked = 1;
    }
#endif
    if (!a->started) dsk__moe_async_main(a); /* serial (or no thread to be had), or issued on the side stream */
    return DSK_OK;
}

/* Waits for it; its status (and message). */
static dsk_status dsk__moe_exchange_wait(dsk__moe_async *a) {
    if (a->started) pthread_join(a->thread, NULL);
    else if (a->begun && (a->st = dsk__moe_exchange_finish(a)) != DSK_OK)
        snprintf(a->err, sizeof a->err, "%s", dsk_last_error());
    a->started = a->begun = 0;
#ifdef DSK_CUDA
    if (a->forked) { /* the layer's stream waits for the exchange (the host does not) */
        struct dsk__moe_state *st = a->m->st;
        dsk_ctx_counters *c = &a->caller->counters, *s0 = &a->at_fork, *s1 = &a->side.counters;
        dsk_status s = dsk_cuda_stream_record(st->side, st->ev_join);
        if (s == DSK_OK) s = dsk_cuda_stream_wait_event(a->caller->stream, st->ev_join);
        if (a->chunked) dsk__moe_queue_shifts(a, a->m->ep_size - 2); /* the ranks the experts have not come to */
        c->syncs += s1->syncs - s0->syncs; /* what the exchange counted on the side ctx */
        c->d2h_copies += s1->d2h_copies - s0->d2h_copies;
        c->d2h_bytes += s1->d2h_bytes - s0->d2h_bytes;
        a->forked = 0;
        if (s != DSK_OK && a->st == DSK_OK) return s;
    }
#endif
    if (a->st != DSK_OK) return dsk_set_error(a->st, "%s", a->err);
    return DSK_OK;
}

/* s, after joining a's thread (if any) when s is an error: the caller's error wins. */
static dsk_status dsk__moe_join_on_error(dsk__moe_async *a, dsk_status s) {
    char msg[1024];
    if (s == DSK_OK || !a) return s;
    snprintf(msg, sizeof msg, "%s", dsk_last_error());
    (void)dsk__moe_exchange_wait(a);
    return dsk_set_error(s, "%s", msg);
}

/* ---- chunked dispatch (opts.ep_chunk): the routed experts compute this rank's own rows (they need no
   transport) while the exchange begun carries the other ranks', then each other rank's rows as they land
   (dsk_comm_progress between chunks), in that order. Each chunk computes in the exchange's order (STAGE: by
   source rank, a rank's local experts' segments in turn): one grouped call over rank r's rows. A row's outputs
   and input gradients have the same bits whatever rows share its GEMM (dsk_matmul's rows contract) and whatever
   order the chunks run in; what the weight gradients need is regrouped expert-major after the last chunk, where
   they sum whole segments, as serial. */

/* Chunks on this call: ON (or AUTO with a CPU layer's ep group across nodes, routed flat), ep_overlap (CUDA: its
   exchanges' stream), the flat exchange (exact or bounded) or on the CPU two hops, of activation rows, ACT
   experts; on the CPU (f32) the default ISA's row kernels (backward's SwiGLU gradient, dsk_swiglu_grad_cpu). */
static int dsk__moe_chunking(const dsk_moe *m, const dsk_ctx *ctx) {
    const dsk_moe_opts *o = &m->opts;
    if (m->ep_size <= 1 || !o->ep_overlap || o->ep_chunk == DSK_MOE_CHUNK_OFF) return 0;
    if (o->ep_chunk == DSK_MOE_CHUNK_AUTO &&
        (o->ep->n_nodes < 2 || m->device.type == DSK_DEV_CUDA || o->ep_route == DSK_MOE_ROUTE_TWO_HOP))
        return 0;
    if ((o->ep_route == DSK_MOE_ROUTE_TWO_HOP && m->device.type == DSK_DEV_CUDA) ||
        o->ep_dispatch != DSK_MOE_DISPATCH_ACT || o->expert_gemm != DSK_MOE_GEMM_ACT)
        return 0;
    if (m->device.type == DSK_DEV_CUDA) return m->st->side != NULL;
    return m->st->act == DSK_F32 && (!ctx || ctx->cpu_isa == dsk_cpu_isa_auto());
}

/* Rank r's rows in the exchange's order (STAGE, by source rank): [*r0, *r0 + *n), its local experts' segments
   one after the other. */
static void dsk__moe_stage_span(const dsk_moe *m, int r, int64_t *r0, int64_t *n) {
    const int64_t *a = m->st->f->a2a;
    *r0 = a[3 * m->ep_size + r] / m->opts.d_model;
    *n = a[2 * m->ep_size + r] / m->opts.d_model;
}

/* The exchange's stage as its R rows (act): where an all-to-all-v's rows land, by source rank (the bounded
   exchange's in STAGE2, as STAGE holds its send blocks). */
static dsk_status dsk__moe_stage(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *stage) {
    int id = m->opts.ep_exchange == DSK_MOE_EP_BOUNDED ? DSK__MOE_STAGE2 : DSK__MOE_STAGE;
    DSK__TRY(dsk__moe_buf(m, ctx, id, m->st->f->T, m->st->f->R, stage));
    *stage = dsk__moe_rows(stage, m->st->f->R);
    return DSK_OK;
}

/* This rank's own rows (src: the rows to send, kept order, where its rows to itself lie in the exchange's order)
   copied to their place in the stage, which the chunked exchange leaves to the layer; bounded: gathered into
   their block (EP_PAD), the padding zero. */
static dsk_status dsk__moe_own_to_stage(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *src) {
    int64_t r0, n, from = m->st->f->a2a[m->ep_size + m->ep_rank] / m->opts.d_model;
    dsk_tensor stage, d, x, pad;
    dsk__moe_stage_span(m, m->ep_rank, &r0, &n);
    if (!n) return DSK_OK;
    DSK__TRY(dsk__moe_stage(m, ctx, &stage));
    d = dsk__moe_row_range(&stage, r0, n);
    if (m->opts.ep_exchange == DSK_MOE_EP_BOUNDED) {
        pad = dsk__moe_saved(m, DSK__MOE_EP_PAD);
        pad = dsk__moe_row_range(&pad, r0, n);
        return dsk_gather_rows_scaled(ctx, &d, src, &pad, NULL);
    }
    x = dsk__moe_row_range(src, from, n);
    return dsk_tensor_copy(ctx, &d, &x);
}

#ifdef DSK_CUDA
/* CUDA: the other ranks' rows as P - 1 ring shifts on the exchanges' stream (ctx: the side's), shift s sending
   this rank's rows for rank me + s and receiving rank me - s's into STAGE, each followed by its event
   (st->ev_shift[s - 1]) that the layer's stream waits for before that rank's chunk (dsk__moe_next_arrival).
   Every rank runs the shifts in the same order, so each send meets its receive. */
static dsk_status dsk__moe_others_by_shifts(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *rows, void *stage) {
    struct dsk__moe_state *st = m->st;
    int P = m->ep_size, me = m->ep_rank;
    int64_t *a = st->f->a2a, *c = st->f->a2a + 4 * P;
    for (int s = 1; s < P; s++) {
        int to = (me + s) % P, from = (me - s + P) % P;
        memset(c, 0, (size_t)(4 * P) * sizeof(int64_t));
        c[to] = a[to];
        c[P + to] = a[P + to];
        c[2 * P + from] = a[2 * P + from];
        c[3 * P + from] = a[3 * P + from];
        DSK__TRY(
            dsk_comm_all_to_all_v(m->opts.ep, ctx, rows->data, c, c + P, stage, c + 2 * P, c + 3 * P, rows->dtype));
        DSK__TRY(dsk_cuda_event_record(ctx, st->ev_shift[s - 1]));
    }
    return DSK_OK;
}
#endif

/* The exchange's part of a chunked dispatch, begun: the other ranks' rows only (rows: the exact exchange's kept
   order, the bounded one's send blocks), into the stage (rank-major); the layer moves it on and computes each
   rank's rows as they land (dsk__moe_next_arrival). */
static dsk_status dsk__moe_others_to_experts(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *rows) {
    struct dsk__moe_state *st = m->st;
    int P = m->ep_size, me = m->ep_rank;
    int64_t *c = st->f->a2a + 4 * P;
    dsk_tensor stage;
    if (!st->xch_begin && m->device.type == DSK_DEV_CPU)
        return dsk_set_error(DSK_ERR_STATE, "dsk_moe: layer \"%s\": a chunked exchange not begun", m->opts.name);
    DSK__TRY(dsk__moe_stage(m, ctx, &stage));
#ifdef DSK_CUDA
    if (m->device.type == DSK_DEV_CUDA) return dsk__moe_others_by_shifts(m, ctx, rows, stage.data);
#endif
    memcpy(c, st->f->a2a, (size_t)(4 * P) * sizeof(int64_t));
    c[me] = c[2 * P + me] = 0;
    return dsk_comm_all_to_all_v_start(m->opts.ep, ctx, rows->data, c, c + P, stage.data, c + 2 * P, c + 3 * P,
                                       rows->dtype, &st->xch_unsent);
}

/* Queues in st->arrival_order each other rank that st->landed reports and a has not queued yet. */
static void dsk__moe_queue_landed(dsk__moe_async *a) {
    struct dsk__moe_state *st = a->m->st;
    for (int r = 0; r < a->m->ep_size; r++) {
        int queued = r == a->m->ep_rank; /* the layer computes its own rows first */
        for (int k = 0; k < a->n_arrived && !queued; k++) queued = st->arrival_order[k] == r;
        if (!queued && st->landed[r]) st->arrival_order[a->n_arrived++] = r;
    }
}

/* Every rank's rows have landed (the exchange is over): queues those not queued yet. */
static void dsk__moe_queue_all(dsk__moe_async *a) {
    for (int r = 0; r < a->m->ep_size; r++) a->m->st->landed[r] = 1;
    dsk__moe_queue_landed(a);
}

#ifdef DSK_CUDA
/* CUDA: queues the ranks of the ring shifts up to shift k + 1 not queued yet (rank me - j - 1 for shift j + 1),
   whose rows the layer's stream reads once it has waited for their events or for the exchange's end. */
static void dsk__moe_queue_shifts(dsk__moe_async *a, int k) {
    for (; a->n_arrived <= k; a->n_arrived++)
        a->m->st->arrival_order[a->n_arrived] = (a->m->ep_rank - a->n_arrived - 1 + a->m->ep_size) % a->m->ep_size;
}
#endif

/* An error of the chunked exchange's own steps, kept for the join; -1. */
static int dsk__moe_arrival_failed(dsk__moe_async *a, dsk_status s) {
    a->st = s;
    snprintf(a->err, sizeof a->err, "%s", dsk_last_error());
    return -1;
}

/* The k-th other rank whose rows have landed, moving the begun exchange on (dsk_comm_progress, waiting) until
   they have; two hops: all of them once the route's thread is joined; CUDA: rank me - k - 1 of the ring shifts,
   once the layer's stream waits for the shift's event (the host does not wait). -1 once all P - 1 came, or on
   the exchange's error (kept for the join). */
static int dsk__moe_next_arrival(dsk__moe_async *a, int k) {
    dsk_moe *m = a->m;
    dsk_status s;
    if (k >= m->ep_size - 1) return -1;
    if (!a->begun && !a->forked && a->n_arrived == 0) { /* two hops: the route's thread lands every rank's rows */
        if (a->started && (s = dsk__moe_exchange_wait(a)) != DSK_OK) return dsk__moe_arrival_failed(a, s);
        if (a->st == DSK_OK) dsk__moe_queue_all(a);
    }
    if (a->st != DSK_OK) return -1;
#ifdef DSK_CUDA
    if (a->forked) {
        if ((s = dsk_cuda_stream_wait_event(a->caller->stream, m->st->ev_shift[k])) != DSK_OK)
            return dsk__moe_arrival_failed(a, s);
        dsk__moe_queue_shifts(a, k);
        return m->st->arrival_order[k];
    }
#endif
    while (a->n_arrived <= k) {
        if (!a->begun) return -1;
        if ((s = dsk_comm_progress(m->opts.ep, a->ctx, 1, m->st->landed, NULL)) != DSK_OK)
            return dsk__moe_arrival_failed(a, s);
        dsk__moe_queue_landed(a);
    }
    return m->st->arrival_order[k];
}

/* Each rank's local experts' segments in its rows of the stage (n_local + 1 offsets from 0, rank r's at
   r (n_local + 1) of DSK__MOE_CHUNK_SEG), on the layer's device: the offsets of a chunk's grouped GEMMs. */
static dsk_status dsk__moe_chunk_segments(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *segs) {
    int El = m->n_local;
    if (m->opts.ep_exchange == DSK_MOE_EP_BOUNDED) { /* from the forward's received keys, on the device */
        *segs = dsk__moe_saved(m, DSK__MOE_EP_SEG);
        return DSK_OK;
    }
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_CHUNK_SEG, 0, 0, segs));
    for (int r = 0; r < m->ep_size; r++) {
        int32_t *o = m->st->chunk_seg + r * (El + 1);
        o[0] = 0;
        for (int e = 0; e < El; e++) o[e + 1] = o[e] + (int32_t)m->st->f->h_recv_cnt[r * El + e];
    }
    return dsk__moe_to_device(m, ctx, segs->data, m->st->chunk_seg, (size_t)(m->ep_size * (El + 1)) * sizeof(int32_t));
}

/* What a chunked call's chunks use: the segments' offsets, the stage with this rank's own rows copied in (own:
   the send buffer) and the buffers DSK__MOE_CH_H1 .. CH_DH3 (rows in the exchange's order) into ch. */
static dsk_status dsk__moe_chunks_begin(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *own, dsk_tensor *segs,
                                        dsk_tensor *stage, dsk_tensor *ch) {
    for (int id = DSK__MOE_CH_H1; id <= DSK__MOE_CH_DH3; id++)
        DSK__TRY(dsk__moe_buf(m, ctx, id, m->st->f->T, m->st->f->R, &ch[id - DSK__MOE_CH_H1]));
    DSK__TRY(dsk__moe_chunk_segments(m, ctx, segs));
    DSK__TRY(dsk__moe_stage(m, ctx, stage));
    return dsk__moe_own_to_stage(m, ctx, own);
}

/* Rank r's chunk: its rows [*r0, *r0 + *n) of the stage-ordered buffers, and its segments' offsets (bounded: its
   block, where a CUDA layer does not know where the padding begins, a CPU layer does). */
static void dsk__moe_chunk_span(const dsk_moe *m, const dsk_tensor *segs, int r, int64_t *r0, int64_t *n,
                                dsk_tensor *off) {
    dsk__moe_stage_span(m, r, r0, n);
    dsk_tensor_slice(segs, 0, r * (m->n_local + 1), m->n_local + 1, off);
    if (m->opts.ep_exchange == DSK_MOE_EP_BOUNDED && m->device.type == DSK_DEV_CPU) *n = DSK__MOE_I32(*off)[m->n_local];
}

#define DSK__MOE_CH_N (DSK__MOE_CH_DH3 - DSK__MOE_CH_H1 + 1)
#define DSK__MOE_CH(ch, id) (ch)[DSK__MOE_##id - DSK__MOE_CH_H1] /* ch's buffer DSK__MOE_id */

/* Rows [r0, r0 + n) of each of the chunked calls' buffers ch into v. */
static void dsk__moe_chunk_rows(const dsk_tensor *ch, int64_t r0, int64_t n, dsk_tensor *v) {
    for (int i = 0; i < DSK__MOE_CH_N; i++) v[i] = dsk__moe_row_range(&ch[i], r0, n);
}

/* Forward of rank r's chunk: the routed experts on r's rows of the stage, every local expert in one grouped call
   (segs: dsk__moe_chunk_segments), the outputs into the same rows of y, h1, h3 and a of ch. */
static dsk_status dsk__moe_experts_chunk(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *w, const dsk_tensor *segs,
                                         const dsk_tensor *stage, const dsk_tensor *ch, const dsk_tensor *y, int r) {
    int64_t r0, n;
    dsk_tensor off, x, o, v[DSK__MOE_CH_N];
    dsk__moe_chunk_span(m, segs, r, &r0, &n, &off);
    if (!n) return DSK_OK;
    dsk__moe_chunk_rows(ch, r0, n, v);
    x = dsk__moe_row_range(stage, r0, n);
    o = dsk__moe_row_range(y, r0, n);
    return dsk_swiglu_grouped(ctx, &o, &DSK__MOE_CH(v, CH_H1), &DSK__MOE_CH(v, CH_H3), &DSK__MOE_CH(v, CH_A), &x, &w[0],
                              &w[1], &w[2], &off);
}

/* The SwiGLU gradient dh1, dh3 WRITTEN from da, h1, h3 (all (n, F) act). */
static dsk_status dsk__moe_swiglu_grad(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *dh1, dsk_tensor *dh3, const dsk_tensor *da,
                                       const dsk_tensor *h1, const dsk_tensor *h3) {
    if (m->device.type == DSK_DEV_CPU && m->st->act == DSK_F32) { /* written: no zeroing pass */
        dsk_swiglu_grad_cpu(dsk_tensor_numel(da), DSK__MOE_F32(*h1), DSK__MOE_F32(*h3), DSK__MOE_F32(*da),
                            DSK__MOE_F32(*dh1), DSK__MOE_F32(*dh3));
        return DSK_OK;
    }
    return dsk_swiglu_backward(ctx, dh1, dh3, da, h1, h3, DSK_GRAD_WRITE);
}

/* Backward of rank r's chunk: the per-row part of the experts' backward on r's rows of the stage (their output
   gradients): h1 and h3 of those rows gathered from the saved forward (RGI) into ch, then da (into the same rows
   of da), dh1 and dh3 (of ch) and the input gradient (of dx): dsk_swiglu_grouped_backward's arithmetic, its
   rows-form GEMMs, every local expert in one grouped call a product. */
static dsk_status dsk__moe_experts_chunk_backward(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *w, const dsk_tensor *segs,
                                                  const dsk_tensor *stage, const dsk_tensor *h1, const dsk_tensor *h3,
                                                  const dsk_tensor *ch, const dsk_tensor *da, const dsk_tensor *dx,
                                                  int r) {
    int64_t r0, n;
    dsk_tensor off, dy, at, q, g, rgi = dsk__moe_saved(m, DSK__MOE_RGI), v[DSK__MOE_CH_N];
    dsk__moe_chunk_span(m, segs, r, &r0, &n, &off);
    if (!n) return DSK_OK;
    dsk__moe_chunk_rows(ch, r0, n, v);
    dy = dsk__moe_row_range(stage, r0, n);
    at = dsk__moe_row_range(&rgi, r0, n); /* where the forward saved these rows' h1 and h3 */
    q = dsk__moe_row_range(da, r0, n);
    g = dsk__moe_row_range(dx, r0, n);
    DSK__TRY(dsk_gather_rows_scaled(ctx, &DSK__MOE_CH(v, CH_H1), h1, &at, NULL)); /* bounded: padding zero */
    DSK__TRY(dsk_gather_rows_scaled(ctx, &DSK__MOE_CH(v, CH_H3), h3, &at, NULL));
    DSK__TRY(dsk_matmul_grouped(ctx, &q, &dy, 0, &w[1], 0, &off, 1.0f, 0.0f));
    DSK__TRY(dsk__moe_swiglu_grad(m, ctx, &DSK__MOE_CH(v, CH_DH1), &DSK__MOE_CH(v, CH_DH3), &q, &DSK__MOE_CH(v, CH_H1),
                                  &DSK__MOE_CH(v, CH_H3)));
    DSK__TRY(dsk_matmul_grouped(ctx, &g, &DSK__MOE_CH(v, CH_DH1), 0, &w[0], 0, &off, 1.0f, 0.0f));
    return dsk_matmul_grouped(ctx, &g, &DSK__MOE_CH(v, CH_DH3), 0, &w[2], 0, &off, 1.0f, 1.0f);
}

/* The flat exchange's all-to-all-v on the layer's communicator: whole, or begun (st->xch_begin). */
static dsk_status dsk__moe_a2a(dsk_moe *m, dsk_ctx *ctx, const void *send, const int64_t *sc, const int64_t *sd,
                               void *recv, const int64_t *rc, const int64_t *rd, dsk_dtype dt) {
    if (!m->st->xch_begin) return dsk_comm_all_to_all_v(m->opts.ep, ctx, send, sc, sd, recv, rc, rd, dt);
    return dsk_comm_all_to_all_v_start(m->opts.ep, ctx, send, sc, sd, recv, rc, rd, dt, &m->st->xch_unsent);
}

/* Rows in the exchange's order (src, R of them by source rank) regrouped expert-major into dst (bounded: zero
   rows past the received ones). */
static dsk_status dsk__moe_regroup(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *dst, const dsk_tensor *src) {
    dsk_tensor rg = dsk__moe_saved(m, DSK__MOE_RG);
    return dsk_gather_rows_scaled(ctx, dst, src, &rg, NULL);
}

/* The rows to the experts, landed in STAGE (by source rank), regrouped expert-major into dst. */
static dsk_status dsk__moe_stage_to_experts(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *dst) {
    dsk_tensor stage;
    DSK__TRY(dsk__moe_stage(m, ctx, &stage));
    return dsk__moe_regroup(m, ctx, dst, &stage);
}

/* Rows (n_kept of them, kept order) to their experts' ranks, regrouped expert-major into dst (R). */
static dsk_status dsk__moe_to_experts(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *rows, dsk_tensor *dst) {
    struct dsk__moe_state *st = m->st;
    int P = m->ep_size;
    dsk_tensor stage;
    if (m->opts.ep_route == DSK_MOE_ROUTE_TWO_HOP) return dsk__moe_hop_to_experts(m, ctx, rows, dst, 1);
    dsk__moe_count_off(m, dsk__moe_flat_off(m, 0, (size_t)m->opts.d_model * dsk_dtype_size(rows->dtype)));
    if (m->opts.ep_exchange == DSK_MOE_EP_BOUNDED) return dsk__moe_to_experts_bounded(m, ctx, rows, dst);
    if (st->chunked) return dsk__moe_others_to_experts(m, ctx, rows);
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_STAGE, st->f->T, st->f->R, &stage));
    DSK__TRY(dsk__moe_a2a(m, ctx, rows->data, st->f->a2a, st->f->a2a + P, stage.data, st->f->a2a + 2 * P,
                          st->f->a2a + 3 * P, rows->dtype));
    return st->xch_begin ? DSK_OK : dsk__moe_stage_to_experts(m, ctx, dst);
}

#ifdef DSK_AMP_H
/* FP8 dispatch (opts.ep_dispatch), before the send: the rows (n, D) to e4m3 codes and 1x128
   scales (dsk_amp_fp8_block_quantize: a tile with an Inf or a NaN stays non-finite). */
static dsk_status dsk__moe_fp8_quantize(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *rows, dsk_tensor *q,
                                        dsk_tensor *s) {
    struct dsk__moe_state *st = m->st;
    int64_t n = rows->shape[0];
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_Q8, st->f->T, st->f->R, q));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_Q8S, st->f->T, st->f->R, s));
    *q = dsk__moe_rows(q, n);
    *s = dsk__moe_rows(s, n);
    return n > 0 ? dsk_amp_fp8_block_quantize(ctx, q, s, rows, 1, 128, 0) : DSK_OK;
}

/* After the receive: the received codes and scales dequantised into dst (R, D) act. */
static dsk_status dsk__moe_fp8_dequantize(dsk_ctx *ctx, const dsk_tensor *q, const dsk_tensor *s, dsk_tensor *dst) {
    return dst->shape[0] > 0 ? dsk_amp_fp8_block_dequantize(ctx, dst, q, s, 1, 128) : DSK_OK;
}

/* FP8 experts: the received codes and scales, regrouped expert-major, are the experts' input (RQ). */
static dsk_status dsk__moe_f8_received(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *qr, const dsk_tensor *sr,
                                       const dsk_tensor *rg) {
    dsk_tensor rq, rs;
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_RQ, m->st->f->T, m->st->f->R, &rq));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_RQS, m->st->f->T, m->st->f->R, &rs));
    if (m->st->f->R == 0) return DSK_OK;
    DSK__TRY(dsk_gather_rows_scaled(ctx, &rq, qr, rg, NULL));
    return dsk_gather_rows_scaled(ctx, &rs, sr, rg, NULL);
}

/* dsk__moe_to_experts with FP8 on the wire: codes and scales go by two all-to-all-v of the
   forward's row counts, the receiver dequantises and regroups. */
static dsk_status dsk__moe_to_experts_fp8(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *rows, dsk_tensor *dst) {
    struct dsk__moe_state *st = m->st;
    int P = m->ep_size;
    int64_t S = (m->opts.d_model + 127) / 128, so = 0, ro = 0, *v;
    dsk_tensor q, s, qr, sr, stage, rg = dsk__moe_saved(m, DSK__MOE_RG);
    dsk_status e;
    DSK__TRY(dsk__moe_fp8_quantize(m, ctx, rows, &q, &s));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_Q8R, st->f->T, st->f->R, &qr));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_Q8RS, st->f->T, st->f->R, &sr));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_STAGE, st->f->T, st->f->R, &stage));
    if (!(v = (int64_t *)DSK_MALLOC((size_t)(4 * P) * sizeof(int64_t))))
        return dsk_set_error(DSK_ERR_OOM, "dsk_moe_forward: out of host memory for %d counts", 4 * P);
    for (int r = 0; r < P; r++) { /* the scales' counts and displacements: S per row */
        v[r] = st->f->send_rows[r] * S;
        v[P + r] = so;
        so += v[r];
        v[2 * P + r] = st->f->recv_rows[r] * S;
        v[3 * P + r] = ro;
        ro += v[2 * P + r];
    }
    e = dsk_comm_all_to_all_v(m->opts.ep, ctx, q.data, st->f->a2a, st->f->a2a + P, qr.data, st->f->a2a + 2 * P,
                              st->f->a2a + 3 * P, DSK_U8);
    if (e == DSK_OK)
        e = dsk_comm_all_to_all_v(m->opts.ep, ctx, s.data, v, v + P, sr.data, v + 2 * P, v + 3 * P, DSK_F32);
    DSK_FREE(v);
    DSK__TRY(e);
    qr = dsk__moe_rows(&qr, st->f->R);
    sr = dsk__moe_rows(&sr, st->f->R);
    if (m->opts.expert_gemm == DSK_MOE_GEMM_FP8) return dsk__moe_f8_received(m, ctx, &qr, &sr, &rg);
    stage = dsk__moe_rows(&stage, st->f->R);
    DSK__TRY(dsk__moe_fp8_dequantize(ctx, &qr, &sr, &stage));
    return dsk_gather_rows(ctx, dst, &stage, &rg);
}
#endif

#ifdef DSK_AMP_H
/* ---------------------------------------------------------------- FP8 experts
   opts.expert_gemm = DSK_MOE_GEMM_FP8: each projection's three GEMMs on dsk_matmul_fp8_grouped
   (routed experts, the segment offsets on the device) and dsk_matmul_fp8 (shared experts), with
   dsk_amp's quantisers: activations and output gradients in 1x128 tiles, weights in 128x128
   blocks per expert (quantised from the activation-dtype copy at each use), the weight gradients
   from both operands quantised along the tokens, f32 accumulation. The inputs of the GEMMs that
   backward needs (x rows, silu(h1) h3) stay as e4m3 codes and scales; backward dequantises one
   into a buffer that is free at that point and quantises its transpose. */

/* A view of flat buffer id (its dtype) as a tensor of ndim dims from element `at`. */
static dsk_status dsk__moe_f8_view(dsk_moe *m, dsk_ctx *ctx, int id, int64_t at, int ndim, const int64_t *shape,
                                   dsk_tensor *out) {
    dsk_tensor flat;
    DSK__TRY(dsk__moe_buf(m, ctx, id, m->st->f->T, m->st->f->R, &flat));
    return dsk_tensor_wrap(out, (char *)flat.data + (size_t)at * dsk_dtype_size(flat.dtype), flat.dtype, m->device,
                           ndim, shape);
}

/* x (n, k) into codes and 1x128 scales, as (n, k) and (n, ceil(k/128)) views of buffers q and s;
   t 1: its transpose, tiles along the n rows: (k, n) and (k, ceil(n/128)). */
static dsk_status dsk__moe_f8_act(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *x, int t, int q, int s, dsk_tensor *xq,
                                  dsk_tensor *xs) {
    int64_t n = x->shape[0], k = x->shape[1], r = t ? k : n, c = t ? n : k;
    int64_t qsh[2] = {r, c}, ssh[2] = {r, dsk__moe_chunks(c)};
    DSK__TRY(dsk__moe_f8_view(m, ctx, q, 0, 2, qsh, xq));
    DSK__TRY(dsk__moe_f8_view(m, ctx, s, 0, 2, ssh, xs));
    if (n == 0 || k == 0) return DSK_OK;
    return t ? dsk_amp_fp8_block_quantize_t(ctx, xq, xs, x, 1, 128, 0)
             : dsk_amp_fp8_block_quantize(ctx, xq, xs, x, 1, 128, 0);
}

/* The weights w (G, N, K) (or one (N, K)) in 128x128 blocks per expert into W8: as they are (t 0,
   B (G, N, K) of C = A w[g]^T) or transposed (t 1, B (G, K, N) of C = A w[g]). */
static dsk_status dsk__moe_f8_weights(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *w, int t, dsk_tensor *wq,
                                      dsk_tensor *ws) {
    int nd = w->ndim;
    int64_t G = nd == 3 ? w->shape[0] : 1, N = w->shape[nd - 2], K = w->shape[nd - 1], r = t ? K : N, c = t ? N : K;
    int64_t qsh[3] = {G, r, c}, ssh[3] = {G, dsk__moe_chunks(r), dsk__moe_chunks(c)}, wsh[2] = {N, K};
    DSK__TRY(dsk__moe_f8_view(m, ctx, DSK__MOE_W8, 0, nd, qsh + 3 - nd, wq));
    DSK__TRY(dsk__moe_f8_view(m, ctx, DSK__MOE_W8S, 0, nd, ssh + 3 - nd, ws));
    for (int64_t g = 0; g < G && N * K > 0; g++) {
        dsk_tensor wg, qg, sg;
        int64_t ns = ssh[1] * ssh[2];
        dsk_tensor_wrap(&wg, (char *)w->data + (size_t)(g * N * K) * dsk_dtype_size(w->dtype), w->dtype, m->device, 2,
                        wsh);
        DSK__TRY(dsk__moe_f8_view(m, ctx, DSK__MOE_W8, g * N * K, 2, qsh + 1, &qg));
        DSK__TRY(dsk__moe_f8_view(m, ctx, DSK__MOE_W8S, g * ns, 2, ssh + 1, &sg));
        DSK__TRY(t ? dsk_amp_fp8_block_quantize_t(ctx, &qg, &sg, &wg, 128, 128, 0)
                   : dsk_amp_fp8_block_quantize(ctx, &qg, &sg, &wg, 128, 128, 0));
    }
    return DSK_OK;
}

/* C = A w^T + beta C (t 0) or A w + beta C (t 1): A (codes and 1x128 scales) by the weights w in
   128x128 blocks; grouped over the segments off when w is (G, N, K), else one GEMM. */
static dsk_status dsk__moe_f8_gemm(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *C, const dsk_tensor *aq, const dsk_tensor *as,
                                   const dsk_tensor *w, int t, const dsk_tensor *off, float beta) {
    dsk_tensor wq, ws;
    DSK__TRY(dsk__moe_f8_weights(m, ctx, w, t, &wq, &ws));
    if (C->shape[0] == 0 || C->shape[1] == 0) return DSK_OK;
    if (w->ndim == 3) return dsk_matmul_fp8_grouped(ctx, C, aq, as, &wq, &ws, DSK_FP8_BLOCK_128X128, off, 1.0f, beta);
    return dsk_matmul_fp8(ctx, C, aq, as, DSK_FP8_TILE_1X128, &wq, &ws, DSK_FP8_BLOCK_128X128, 1.0f, beta);
}

/* gw += dy^T x from dy (n, o) act and the cached x already transposed into ITQ (k, n): both along
   the tokens; grouped (gw (G, o, k), the segments cutting the tokens) when off is given. */
static dsk_status dsk__moe_f8_wgrad(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *gw, const dsk_tensor *dy,
                                    const dsk_tensor *xtq, const dsk_tensor *xts, const dsk_tensor *off) {
    dsk_tensor gtq, gts;
    DSK__TRY(dsk__moe_f8_act(m, ctx, dy, 1, DSK__MOE_GTQ, DSK__MOE_GTS, &gtq, &gts));
    if (dy->shape[0] == 0) return DSK_OK;
    if (off) return dsk_matmul_fp8_grouped(ctx, gw, &gtq, &gts, xtq, xts, DSK_FP8_TILE_1X128, off, 1.0f, 1.0f);
    return dsk_matmul_fp8(ctx, gw, &gtq, &gts, DSK_FP8_TILE_1X128, xtq, xts, DSK_FP8_TILE_1X128, 1.0f, 1.0f);
}

/* A cached input (codes q, scales s, (n, k)) dequantised into buffer id (act, free at this point),
   then its transpose quantised along the tokens into ITQ (k, n). */
static dsk_status dsk__moe_f8_input_t(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *q, const dsk_tensor *s, int id,
                                      dsk_tensor *xtq, dsk_tensor *xts) {
    dsk_tensor x, flat;
    int64_t sh[2] = {q->shape[0], q->shape[1]};
    DSK__TRY(dsk__moe_buf(m, ctx, id, m->st->f->T, m->st->f->R, &flat));
    DSK__TRY(dsk_tensor_wrap(&x, flat.data, m->st->act, m->device, 2, sh));
    if (sh[0] > 0 && sh[1] > 0) DSK__TRY(dsk_amp_fp8_block_dequantize(ctx, &x, q, s, 1, 128));
    return dsk__moe_f8_act(m, ctx, &x, 1, DSK__MOE_ITQ, DSK__MOE_ITS, xtq, xts);
}

/* The tokens xa (T, D) into XQ (when sized: shared experts, or the routed rows' source without EP). */
static dsk_status dsk__moe_f8_tokens(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *xa) {
    dsk_tensor q, s;
    if (m->d_shared_total == 0 && m->ep_size > 1) return DSK_OK;
    return dsk__moe_f8_act(m, ctx, xa, 0, DSK__MOE_XQ, DSK__MOE_XQS, &q, &s);
}

/* The experts' input rows into RQ: without EP the tokens' codes gathered (a row's 1x128 tiles are
   its own, so these are the gathered rows' codes); with EP the rows received in the activation
   dtype, quantised (FP8 dispatch fills RQ as it receives). */
static dsk_status dsk__moe_f8_rows(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *row_tok, const dsk_tensor *xr) {
    struct dsk__moe_state *st = m->st;
    dsk_tensor xq, xs, rq, rs;
    if (m->ep_size > 1) {
        if (m->opts.ep_dispatch == DSK_MOE_DISPATCH_FP8) return DSK_OK;
        return dsk__moe_f8_act(m, ctx, xr, 0, DSK__MOE_RQ, DSK__MOE_RQS, &rq, &rs);
    }
    xq = dsk__moe_saved(m, DSK__MOE_XQ);
    xs = dsk__moe_saved(m, DSK__MOE_XQS);
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_RQ, st->f->T, st->f->R, &rq));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_RQS, st->f->T, st->f->R, &rs));
    rq = dsk__moe_rows(&rq, row_tok->shape[0]);
    rs = dsk__moe_rows(&rs, row_tok->shape[0]);
    if (row_tok->shape[0] == 0) return DSK_OK;
    DSK__TRY(dsk_gather_rows_scaled(ctx, &rq, &xq, row_tok, NULL));
    return dsk_gather_rows_scaled(ctx, &rs, &xs, row_tok, NULL);
}

/* A SwiGLU in FP8 from the input's codes xq, xs (n, D): h1, h3 (n, Fh), a computed in buffer a_id
   and kept as codes in aq_id, out (n, D); w: w1, w2, w3 (grouped over off when 3-D). h1, h3 and
   out are zeroed first when grouped (rows outside the segments, a bound on CUDA, stay zero). */
static dsk_status dsk__moe_f8_swiglu(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *xq, const dsk_tensor *xs,
                                     const dsk_tensor *w1, const dsk_tensor *w2, const dsk_tensor *w3,
                                     const dsk_tensor *off, int a_id, int aq_id, dsk_tensor *h1, dsk_tensor *h3,
                                     dsk_tensor *out) {
    dsk_tensor a, aq, as;
    if (off) {
        DSK__TRY(dsk_tensor_fill(ctx, h1, 0.0));
        DSK__TRY(dsk_tensor_fill(ctx, h3, 0.0));
    }
    DSK__TRY(dsk__moe_f8_gemm(m, ctx, h1, xq, xs, w1, 0, off, 0.0f));
    DSK__TRY(dsk__moe_f8_gemm(m, ctx, h3, xq, xs, w3, 0, off, 0.0f));
    DSK__TRY(dsk__moe_buf(m, ctx, a_id, m->st->f->T, m->st->f->R, &a));
    a = dsk__moe_rows(&a, h1->shape[0]);
    if (h1->shape[0] > 0) DSK__TRY(dsk_swiglu(ctx, &a, h1, h3));
    DSK__TRY(dsk__moe_f8_act(m, ctx, &a, 0, aq_id, aq_id + 1, &aq, &as));
    return dsk__moe_f8_gemm(m, ctx, out, &aq, &as, w2, 0, off, 0.0f);
}

/* The routed experts' forward: h1, h3 into H1, H3, their output into o (R, D). */
static dsk_status dsk__moe_f8_experts_forward(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *w, const dsk_tensor *off,
                                              dsk_tensor *o) {
    struct dsk__moe_state *st = m->st;
    dsk_tensor rq, rs, h1, h3;
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_RQ, st->f->T, st->f->R, &rq));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_RQS, st->f->T, st->f->R, &rs));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_H1, st->f->T, st->f->R, &h1));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_H3, st->f->T, st->f->R, &h3));
    DSK__TRY(dsk_tensor_fill(ctx, o, 0.0));
    return dsk__moe_f8_swiglu(m, ctx, &rq, &rs, &w[0], &w[1], &w[2], off, DSK__MOE_DA, DSK__MOE_AQ, &h1, &h3, o);
}

/* The shared experts' forward from XQ into HS1, HS3, ASQ and ys (T, D). */
static dsk_status dsk__moe_f8_shared_forward(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *w, dsk_tensor *ys) {
    struct dsk__moe_state *st = m->st;
    dsk_tensor xq = dsk__moe_saved(m, DSK__MOE_XQ), xs = dsk__moe_saved(m, DSK__MOE_XQS), hs1, hs3;
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_HS1, st->f->T, st->f->R, &hs1));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_HS3, st->f->T, st->f->R, &hs3));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_YS, st->f->T, st->f->R, ys));
    return dsk__moe_f8_swiglu(m, ctx, &xq, &xs, &w[3], &w[4], &w[5], NULL, DSK__MOE_DAS, DSK__MOE_ASQ, &hs1, &hs3, ys);
}

/* A SwiGLU's backward in FP8 from dy (n, D) act: x's and a's caches (codes, scales), h1, h3; the
   weight gradients g1, g2, g3 accumulated; dx (n, D) WRITTEN. Scratch: buffer da_id (act, n x Fh)
   holds a dequantised then da, x_id (act, n x D) x dequantised; dh1, dh3 (n, Fh) act. */
typedef struct dsk__moe_f8_bwd {
    const dsk_tensor *xq, *xs, *aq, *as, *h1, *h3, *w, *off; /* w: w1, w2, w3 */
    dsk_tensor *g[3];                                        /* gradients of w1, w2, w3 */
    int da_id, x_id;
    dsk_tensor dh1, dh3;
} dsk__moe_f8_bwd;

static void dsk__moe_f8_bwd_set(dsk__moe_f8_bwd *b, const dsk_tensor *xq, const dsk_tensor *xs, const dsk_tensor *aq,
                                const dsk_tensor *as, const dsk_tensor *h1, const dsk_tensor *h3, const dsk_tensor *w,
                                const dsk_tensor *off, int da_id, int x_id) {
    memset(b, 0, sizeof *b);
    b->xq = xq, b->xs = xs, b->aq = aq, b->as = as, b->h1 = h1, b->h3 = h3, b->w = w, b->off = off;
    b->da_id = da_id, b->x_id = x_id;
}

static dsk_status dsk__moe_f8_swiglu_backward(dsk_moe *m, dsk_ctx *ctx, dsk__moe_f8_bwd *b, const dsk_tensor *dy,
                                              dsk_tensor *dx) {
    int64_t n = dy->shape[0], Fh = b->h1->shape[1], sh[2] = {n, Fh};
    dsk_tensor xtq, xts, gq, gs, da, flat;
    /* w2: its gradient from dy^T and a^T, then da = dy w2 */
    DSK__TRY(dsk__moe_f8_input_t(m, ctx, b->aq, b->as, b->da_id, &xtq, &xts));
    DSK__TRY(dsk__moe_f8_wgrad(m, ctx, b->g[1], dy, &xtq, &xts, b->off));
    DSK__TRY(dsk__moe_f8_act(m, ctx, dy, 0, DSK__MOE_GQ, DSK__MOE_GQS, &gq, &gs));
    DSK__TRY(dsk__moe_buf(m, ctx, b->da_id, m->st->f->T, m->st->f->R, &flat));
    DSK__TRY(dsk_tensor_wrap(&da, flat.data, m->st->act, m->device, 2, sh));
    if (b->off) DSK__TRY(dsk_tensor_fill(ctx, &da, 0.0)); /* rows outside the segments */
    DSK__TRY(dsk__moe_f8_gemm(m, ctx, &da, &gq, &gs, &b->w[1], 1, b->off, 0.0f));
    DSK__TRY(dsk__moe_swiglu_grad(m, ctx, &b->dh1, &b->dh3, &da, b->h1, b->h3));
    /* w1, w3: their gradients from dh^T and x^T, then dx = dh1 w1 + dh3 w3 */
    DSK__TRY(dsk__moe_f8_input_t(m, ctx, b->xq, b->xs, b->x_id, &xtq, &xts));
    DSK__TRY(dsk__moe_f8_wgrad(m, ctx, b->g[0], &b->dh1, &xtq, &xts, b->off));
    DSK__TRY(dsk__moe_f8_wgrad(m, ctx, b->g[2], &b->dh3, &xtq, &xts, b->off));
    if (b->off) DSK__TRY(dsk_tensor_fill(ctx, dx, 0.0));
    DSK__TRY(dsk__moe_f8_act(m, ctx, &b->dh1, 0, DSK__MOE_GQ, DSK__MOE_GQS, &gq, &gs));
    DSK__TRY(dsk__moe_f8_gemm(m, ctx, dx, &gq, &gs, &b->w[0], 1, b->off, 0.0f));
    DSK__TRY(dsk__moe_f8_act(m, ctx, &b->dh3, 0, DSK__MOE_GQ, DSK__MOE_GQS, &gq, &gs));
    return dsk__moe_f8_gemm(m, ctx, dx, &gq, &gs, &b->w[2], 1, b->off, 1.0f);
}

/* The routed experts' backward from dor (R, D): their gradients, dxr (R, D) WRITTEN. */
static dsk_status dsk__moe_f8_experts_backward(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *w, const dsk_tensor *off,
                                               const dsk_tensor *dor, dsk_tensor *dxr) {
    dsk_tensor xq = dsk__moe_saved(m, DSK__MOE_RQ), xs = dsk__moe_saved(m, DSK__MOE_RQS);
    dsk_tensor aq = dsk__moe_saved(m, DSK__MOE_AQ), as = dsk__moe_saved(m, DSK__MOE_AQS);
    dsk_tensor h1 = dsk__moe_saved(m, DSK__MOE_H1), h3 = dsk__moe_saved(m, DSK__MOE_H3);
    dsk__moe_f8_bwd b;
    dsk__moe_f8_bwd_set(&b, &xq, &xs, &aq, &as, &h1, &h3, w, off, DSK__MOE_DA, DSK__MOE_DXR);
    b.g[0] = &m->w1->grad, b.g[1] = &m->w2->grad, b.g[2] = &m->w3->grad;
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_DH1, m->st->f->T, m->st->f->R, &b.dh1));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_DH3, m->st->f->T, m->st->f->R, &b.dh3));
    return dsk__moe_f8_swiglu_backward(m, ctx, &b, dor, dxr);
}

/* The shared experts' backward from dya (T, D): their gradients, dxf (T, D) f32 WRITTEN. */
static dsk_status dsk__moe_f8_shared_backward(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *w, const dsk_tensor *dya,
                                              dsk_tensor *dxf) {
    dsk_tensor xq = dsk__moe_saved(m, DSK__MOE_XQ), xs = dsk__moe_saved(m, DSK__MOE_XQS);
    dsk_tensor aq = dsk__moe_saved(m, DSK__MOE_ASQ), as = dsk__moe_saved(m, DSK__MOE_ASQS);
    dsk_tensor h1 = dsk__moe_saved(m, DSK__MOE_HS1), h3 = dsk__moe_saved(m, DSK__MOE_HS3);
    dsk__moe_f8_bwd b;
    dsk__moe_f8_bwd_set(&b, &xq, &xs, &aq, &as, &h1, &h3, w + 3, NULL, DSK__MOE_DAS, DSK__MOE_YS);
    b.g[0] = &m->sw1->grad, b.g[1] = &m->sw2->grad, b.g[2] = &m->sw3->grad;
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_DHS1, m->st->f->T, m->st->f->R, &b.dh1));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_DHS3, m->st->f->T, m->st->f->R, &b.dh3));
    return dsk__moe_f8_swiglu_backward(m, ctx, &b, dya, dxf);
}
#endif

/* A call of the FP8 experts' code, which needs dsk_amp.h (dsk_moe_init refuses the option without it). */
#ifdef DSK_AMP_H
#define DSK__MOE_F8(call) (call)
#else
#define DSK__MOE_F8(call) dsk_set_error(DSK_ERR_UNSUPPORTED, "dsk_moe: FP8 experts need dsk_amp.h")
#endif

/* The forward's exchange of EP rows: FP8 or the activation dtype; counts the bytes handed over. */
static dsk_status dsk__moe_dispatch(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *rows, dsk_tensor *dst) {
    struct dsk__moe_state *st = m->st;
    int64_t D = m->opts.d_model, n = rows->shape[0];
    size_t es = dsk_dtype_size(rows->dtype);
    int fp8 = m->opts.ep_dispatch == DSK_MOE_DISPATCH_FP8;
    if (m->opts.ep_exchange == DSK_MOE_EP_BOUNDED) n = st->f->R; /* every peer's whole block */
    st->fwd_bytes[0] = fp8 ? (uint64_t)(n * (D + 4 * ((D + 127) / 128))) : (uint64_t)(n * D) * es;
    st->fwd_bytes[1] = (uint64_t)(st->f->R * D) * es;
    for (int i = 0; i < 2 && !m->eval; i++) st->acc_bytes[i] += st->fwd_bytes[i];
    if (m->opts.ep_route == DSK_MOE_ROUTE_TWO_HOP) return dsk__moe_hop_to_experts(m, ctx, rows, dst, 0);
#ifdef DSK_AMP_H
    if (fp8) {
        dsk__moe_count_off(m, dsk__moe_flat_off(m, 0, (size_t)(D + 4 * ((D + 127) / 128))));
        return dsk__moe_to_experts_fp8(m, ctx, rows, dst);
    }
#endif
    return dsk__moe_to_experts(m, ctx, rows, dst);
}

/* The reverse: rows (R, expert-major) back to their tokens' ranks, into dst (n_kept, kept order). */
static dsk_status dsk__moe_from_experts(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *rows, dsk_tensor *dst) {
    struct dsk__moe_state *st = m->st;
    int P = m->ep_size;
    dsk_tensor stage, rgi;
    if (m->opts.ep_route == DSK_MOE_ROUTE_TWO_HOP) return dsk__moe_hop_from_experts(m, ctx, rows, dst);
    dsk__moe_count_off(m, dsk__moe_flat_off(m, 1, (size_t)m->opts.d_model * dsk_dtype_size(rows->dtype)));
    if (m->opts.ep_exchange == DSK_MOE_EP_BOUNDED) return dsk__moe_from_experts_bounded(m, ctx, rows, dst);
    if (st->chunked) /* the chunks computed in the exchange's order */
        return dsk__moe_a2a(m, ctx, rows->data, st->f->a2a + 2 * P, st->f->a2a + 3 * P, dst->data, st->f->a2a,
                            st->f->a2a + P, rows->dtype);
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_STAGE, st->f->T, st->f->R, &stage));
    rgi = dsk__moe_saved(m, DSK__MOE_RGI);
    stage = dsk__moe_rows(&stage, st->f->R);
    DSK__TRY(dsk_gather_rows(ctx, &stage, rows, &rgi));
    return dsk__moe_a2a(m, ctx, stage.data, st->f->a2a + 2 * P, st->f->a2a + 3 * P, dst->data, st->f->a2a,
                        st->f->a2a + P, rows->dtype);
}

/* ---------------------------------------------------------------- forward */

/* The layer's weights in the activation dtype: the parameters, or converted copies (a bf16 layer
   on the CPU), indexed by param - DSK_MOE_P_W1. */
static dsk_status dsk__moe_weights_act(dsk_moe *m, dsk_ctx *ctx, dsk_tensor w[6]) {
    for (int i = 0; i < 6; i++) {
        const dsk_moe_param *p = &m->params[DSK_MOE_P_W1 + i];
        dsk_tensor flat;
        memset(&w[i], 0, sizeof w[i]);
        if (DSK_MOE_P_W1 + i >= m->n_params) continue;
        if (p->dtype == m->st->act) { w[i] = p->value; continue; }
        DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_WA + i, 0, 0, &flat));
        DSK__TRY(dsk_tensor_reshape(&flat, p->ndim, p->shape, &w[i]));
        DSK__TRY(dsk_tensor_copy(ctx, &w[i], &p->value));
    }
    return DSK_OK;
}

/* x (T, D) in the layer's dtype as act (the f32 copy xf when act is f32). */
static dsk_status dsk__moe_act_input(dsk_moe *m, dsk_ctx *ctx, int id, const dsk_tensor *x, const dsk_tensor *xf,
                                     dsk_tensor *out) {
    if (m->st->act == DSK_F32 && xf) { *out = *xf; return DSK_OK; }
    if (m->st->act == x->dtype && !xf) { *out = *x; return DSK_OK; }
    DSK__TRY(dsk__moe_buf(m, ctx, id, x->shape[0], 0, out));
    return dsk_tensor_copy(ctx, out, x);
}

/* A SwiGLU of the rows of x with w1, w3 (N, D) and w2 (D, N) (the shared experts): h1, h3, a
   (T, N), out (T, D). */
static dsk_status dsk__moe_shared_forward(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *x, const dsk_tensor *w,
                                          dsk_tensor *h1, dsk_tensor *h3, dsk_tensor *a, dsk_tensor *out) {
    (void)m;
    DSK__TRY(dsk_matmul(ctx, h1, x, 0, &w[3], 1, 1.0f, 0.0f));
    DSK__TRY(dsk_matmul(ctx, h3, x, 0, &w[5], 1, 1.0f, 0.0f));
    DSK__TRY(dsk_swiglu(ctx, a, h1, h3));
    return dsk_matmul(ctx, out, a, 0, &w[4], 1, 1.0f, 0.0f);
}

/* The shared experts' forward of the rows xa into their buffers; ys: their output (T, D). */
static dsk_status dsk__moe_shared_step(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *xa, const dsk_tensor *w, int64_t T,
                                       int64_t R, dsk_tensor *ys) {
    dsk_tensor hs1, hs3, as;
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_HS1, T, R, &hs1));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_HS3, T, R, &hs3));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_AS, T, R, &as));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_YS, T, R, ys));
    return dsk__moe_shared_forward(m, ctx, xa, w, &hs1, &hs3, &as, ys);
}

/* The CPU fails a forward on non-finite routing (every rank of an EP group together). */
static dsk_status dsk__moe_nonfinite_error(const dsk_moe *m, int64_t T, const int64_t *cnt_group) {
    const int32_t *keys = (const int32_t *)dsk__moe_store_of(m->st, DSK__MOE_KEYS)->mem.data;
    int64_t first = -1, n_bad = 0, K = m->opts.top_k;
    for (int64_t t = 0; t < T; t++)
        if (keys[t * K] < 0 && !n_bad++) first = t;
    if (n_bad)
        return dsk_set_error(DSK_ERR_NONFINITE,
                             "dsk_moe_forward: layer \"%s\": token %lld of %lld has a NaN or Inf router logit or "
                             "selection score (from x, the router weights or the expert bias), %lld such tokens; "
                             "nothing was computed",
                             m->opts.name, (long long)first, (long long)T, (long long)n_bad);
    return dsk_set_error(DSK_ERR_NONFINITE,
                         "dsk_moe_forward: layer \"%s\": %lld tokens on other ranks of the expert-parallel group have "
                         "NaN or Inf router logits; nothing was computed",
                         m->opts.name, (long long)cnt_group[2]);
}

/* Rows the last forward's dispatch sent to other nodes (see dsk_moe_stats), with the ranks numbered
   node by node (node of rank r: r / ranks per node); -1 when this rank sees otherwise. */
static int64_t dsk__moe_rows_off_node(const dsk_moe *m) {
    const dsk_comm *c = m->opts.ep;
    int64_t n = 0, L;
    if (m->ep_size <= 1) return 0;
    L = c->n_nodes > 0 && c->world_size % c->n_nodes == 0 ? c->world_size / c->n_nodes : 0;
    if (m->opts.ep_route == DSK_MOE_ROUTE_TWO_HOP) return m->st->f->hop->rt.dispatch_rows_off_node;
    if (!L || c->node != c->rank / L) return -1;
    for (int r = 0; r < m->ep_size; r++)
        if (r / L != c->node)
            n += m->opts.ep_exchange == DSK_MOE_EP_BOUNDED ? m->st->f->R / m->ep_size : m->st->f->send_rows[r];
    return n;
}

/* A forward's statistics from its counts (EP group) and this rank's losses, on the host. */
static dsk_status dsk__moe_fill_stats(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *cntg, const dsk_tensor *loss,
                                      dsk_moe_stats *s) {
    struct dsk__moe_state *st = m->st;
    int E = m->opts.n_routed;
    int64_t *c = st->h_cnt;
    double hl[4];
    DSK__TRY(dsk__moe_to_host(m, ctx, c, cntg->data, (size_t)(3 + E) * sizeof(int64_t)));
    DSK__TRY(dsk__moe_to_host(m, ctx, hl, loss->data, sizeof hl));
    DSK__TRY(dsk_ctx_sync(ctx)); /* CUDA: a forward asked for its statistics now */
    memset(s, 0, sizeof *s);
    s->calls = 1;
    s->tokens = c[0];
    s->slots = c[0] * m->opts.top_k;
    s->dropped = c[1];
    s->nonfinite = c[2];
    s->rows_off_node = dsk__moe_rows_off_node(m);
    for (int e = 0; e < E; e++) {
        st->fwd_loads[e] = c[3 + e];
        s->max_load = (double)c[3 + e] > s->max_load ? (double)c[3 + e] : s->max_load;
    }
    s->tokens_per_expert = st->fwd_loads;
    s->mean_load = (double)s->slots / E;
    s->aux_loss = hl[0];
    s->seq_aux_loss = hl[1];
    s->z_loss = hl[2];
    s->loss = hl[3];
    s->dispatch_bytes = m->ep_size > 1 ? st->fwd_bytes[0] : 0;
    s->combine_bytes = m->ep_size > 1 ? st->fwd_bytes[1] : 0;
    s->bytes_off_node = st->off_bytes[0];
    s->ep_chunks = st->fwd_chunks;
    return DSK_OK;
}

/* A forward up to its dispatch: the routing, the balancing losses, the kept rows, and under expert
   parallelism the exchange begun (in flight under ep_overlap, or done here); what the end reads in
   st->pend. */
static dsk_status dsk__moe_forward_begin_impl(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *x, int64_t T,
                                              const dsk_tensor *replay) {
    struct dsk__moe_state *st = m->st;
    dsk__moe_pending *p = st->pend;
    const dsk_moe_opts *o = &m->opts;
    int64_t K = o->top_k, E = o->n_routed, TK = T * K, n_kept, R, n_rows;
    int64_t N = st->span_on ? st->span_rows : T; /* the loss span: the micro-batch this call is part of */
    int64_t L = o->seq_aux_alpha > 0 && o->seq_len ? o->seq_len : (N > 0 ? N : 1), nseq = N / L > 0 ? N / L : 1;
    int cpu = m->device.type == DSK_DEV_CPU, ep = m->ep_size > 1, fp8 = o->expert_gemm == DSK_MOE_GEMM_FP8;
    int two = ep && o->ep_route == DSK_MOE_ROUTE_TWO_HOP; /* never with fp8 (dsk__moe_ep_route_resolve) */
    int losses = o->aux_alpha > 0 || o->seq_aux_alpha > 0 || o->z_beta > 0;
    dsk_tensor xf, xa, u, prob, scr, sel, gate, keys, perm_all, off_all, perm, off, pos, row_tok, row_gate, cnt, cntg;
    dsk_tensor xs, xr, back, w[6], offsets;
    dsk__moe_loss_bufs lb;
    memset(&xs, 0, sizeof xs); /* FP8 without EP: no rows gathered, none sent */
    xr = back = xs;
    R = dsk__moe_rows_first(m, T); /* sizes the buffers (exact EP: until the counts say more) */
    st->in_forward = 1;
    st->off_bytes[0] = 0;
    st->f->T = T;
    st->f->R = R;
    st->f->N = N;
    st->f->row0 = st->span_on ? st->span_row0 : 0;
    st->f->ranks = st->span_on && st->span_group ? st->span_group->world_size : 1;
    st->f->seq_len = L;
    st->f->n_seq = nseq;
    /* router: u = x W_r^T in f32 */
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_XF, T, R, &xf));
    DSK__TRY(dsk_tensor_copy(ctx, &xf, x));
    DSK__TRY(dsk__moe_act_input(m, ctx, DSK__MOE_XA, x, &xf, &xa));
    DSK__TRY(dsk__moe_weights_act(m, ctx, w));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_U, T, R, &u));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_PROB, T, R, &prob));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_SCR, T, R, &scr));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_SEL, T, R, &sel));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_GATE, T, R, &gate));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_KEYS, T, R, &keys));
    DSK__TRY(dsk_matmul(ctx, &u, &xf, 0, &m->router->value, 1, 1.0f, 0.0f));
    if (replay && TK > 0) DSK__TRY(dsk__moe_to_device(m, ctx, sel.data, replay->data, (size_t)TK * sizeof(int32_t)));
    DSK__TRY(dsk__moe_route(m, ctx, T, &u, &prob, &scr, &sel, &gate, &keys, replay != NULL));
    /* balancing losses */
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_LOSS, T, R, &lb.loss));
    if (losses) {
        DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_PTOT, T, R, &lb.ptot));
        DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_LSE, T, R, &lb.lse));
        DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_LSEL, T, R, &lb.lsel));
        DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_PART, T, R, &lb.part));
        DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_AUX, T, R, &lb.aux));
        DSK__TRY(dsk__moe_losses(m, ctx, &prob, &u, &sel, &lb));
    } else {
        DSK__TRY(dsk_tensor_fill(ctx, &lb.loss, 0.0));
    }
    /* dispatch: every slot by expert, then the kept ones (capacity) */
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_PERM_ALL, T, R, &perm_all));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_OFF_ALL, T, R, &off_all));
    DSK__TRY(dsk_group_by_key(ctx, &perm_all, &off_all, &keys));
    if (o->capacity_factor > 0) {
        dsk_tensor keys2;
        int64_t cap = (int64_t)ceil((double)TK / E * o->capacity_factor);
        DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_KEYS2, T, R, &keys2));
        DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_PERM, T, R, &perm));
        DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_OFF, T, R, &off));
        DSK__TRY(dsk__moe_capacity(m, ctx, cap, &perm_all, &off_all, &gate, &keys2));
        DSK__TRY(dsk_group_by_key(ctx, &perm, &off, &keys2));
    } else {
        perm = perm_all;
        off = off_all;
    }
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_CNT, T, R, &cnt));
    DSK__TRY(dsk__moe_count(m, ctx, T, &off_all, &off, &cnt));
    cntg = cnt;
    offsets = off;
    n_kept = cpu ? DSK__MOE_I32(off)[E] : -1;
    if (ep) {
        DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_CNTG, T, R, &cntg));
        if (o->ep_exchange == DSK_MOE_EP_BOUNDED) DSK__TRY(dsk__moe_ep_bounded(m, ctx, &off, &cnt, &cntg));
        else DSK__TRY(dsk__moe_ep_counts(m, ctx, &cnt, &cntg, &n_kept, &R));
        st->f->R = R;
        offsets = dsk__moe_saved(m, DSK__MOE_LOCAL_OFF);
    } else if (cpu) {
        R = st->f->R = n_kept;
    }
    if (cpu && DSK__MOE_I64(cntg)[2] > 0) return dsk__moe_nonfinite_error(m, T, DSK__MOE_I64(cntg));
    if (!m->eval) DSK__TRY(dsk__moe_accumulate_step(m, ctx, &cnt, &cntg, &lb.loss));
    /* the kept rows: tokens gathered in kept order (zero rows past them) */
    n_rows = n_kept >= 0 ? n_kept : TK;
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_POS, T, R, &pos));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_ROW_TOK, T, R, &row_tok));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_ROW_GATE, T, R, &row_gate));
    DSK__TRY(dsk__moe_plan(m, ctx, n_rows, &perm, &off, &gate, &pos, &row_tok, &row_gate));
    row_tok = dsk__moe_rows(&row_tok, n_rows);
    if (fp8) DSK__TRY(DSK__MOE_F8(dsk__moe_f8_tokens(m, ctx, &xa)));
    if (!fp8 || ep) { /* FP8: the rows to send in DOS, a buffer of backward's */
        DSK__TRY(dsk__moe_buf(m, ctx, fp8 ? DSK__MOE_DOS : DSK__MOE_XS, T, R, &xs));
        xs = dsk__moe_rows(&xs, n_rows);
        DSK__TRY(dsk_gather_rows_scaled(ctx, &xs, &xa, &row_tok, NULL));
    }
    st->f->n_kept = n_kept;
    /* the rows to the experts (two hops: the tokens' rows) */
    if (ep) {
        if (two) DSK__TRY(dsk__moe_hop_plan(m, ctx, T, n_kept, &perm, &off, &gate));
        DSK__TRY(dsk__moe_buf(m, ctx, fp8 ? DSK__MOE_DOR : DSK__MOE_XR, T, R, &xr));
        DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_OB, T, R, &back));
        back = dsk__moe_rows(&back, n_rows);
    } else if (!fp8) {
        xr = dsk__moe_rows(&xs, R);
    }
    dsk__moe_pending_set(p, DSK__MOE_PEND_FWD, T, R, n_rows, w);
    p->xa = xa, p->xs = xs, p->xr = xr, p->back = back, p->pos = pos, p->gate = gate, p->row_tok = row_tok;
    p->cntg = cntg, p->loss = lb.loss, p->offsets = offsets;
    if (!ep) return DSK_OK;
    st->chunked = dsk__moe_chunking(m, ctx);
    DSK__TRY(dsk__moe_exchange_start(&p->xch, m, ctx, two ? &p->xa : &p->xs, &p->xr, DSK__MOE_XCH_DISPATCH));
    p->flying = 1;
    return DSK_OK;
}

/* The exchange in flight of the call begun, joined. */
static dsk_status dsk__moe_pending_join(dsk__moe_pending *p) {
    if (!p->flying) return DSK_OK;
    p->flying = 0;
    return dsk__moe_exchange_wait(&p->xch);
}

/* The routed experts of a chunked forward: this rank's own rows while the other ranks' travel, then each other
   rank's as they land, in the exchange's order (the outputs there, in p->ob, are the return's rows); then the
   saved forward's inputs, h1, h3 and a expert-major, as the serial path leaves them. */
static dsk_status dsk__moe_forward_chunks(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *h1, dsk_tensor *h3, dsk_tensor *a) {
    struct dsk__moe_state *st = m->st;
    dsk__moe_pending *p = st->pend;
    dsk__moe_async *xch = &p->xch;
    dsk_tensor segs, stage, ch[DSK__MOE_CH_N];
    DSK__TRY(dsk__moe_join_on_error(xch, dsk__moe_chunks_begin(m, ctx, &p->xs, &segs, &stage, ch)));
    for (int k = 0, r = m->ep_rank; r >= 0; r = dsk__moe_next_arrival(xch, k++), st->fwd_chunks++)
        DSK__TRY(dsk__moe_join_on_error(xch, dsk__moe_experts_chunk(m, ctx, p->w, &segs, &stage, ch, &p->ob, r)));
    DSK__TRY(dsk__moe_pending_join(p));
    DSK__TRY(dsk__moe_stage_to_experts(m, ctx, &p->xr));
    DSK__TRY(dsk__moe_regroup(m, ctx, h1, &DSK__MOE_CH(ch, CH_H1)));
    DSK__TRY(dsk__moe_regroup(m, ctx, h3, &DSK__MOE_CH(ch, CH_H3)));
    return dsk__moe_regroup(m, ctx, a, &DSK__MOE_CH(ch, CH_A));
}

/* A forward's experts: the shared experts (while the rows travel), the routed experts (chunked:
   dsk__moe_forward_chunks) into p->ob. */
static dsk_status dsk__moe_forward_experts_impl(dsk_moe *m, dsk_ctx *ctx) {
    struct dsk__moe_state *st = m->st;
    dsk__moe_pending *p = st->pend;
    int64_t T = p->T, R = p->R;
    int ep = m->ep_size > 1, fp8 = m->opts.expert_gemm == DSK_MOE_GEMM_FP8;
    dsk__moe_async *xch = p->flying ? &p->xch : NULL;
    dsk_tensor h1, h3, a, *w = p->w;
    if (m->d_shared_total > 0)
        DSK__TRY(dsk__moe_join_on_error(xch, fp8 ? DSK__MOE_F8(dsk__moe_f8_shared_forward(m, ctx, w, &p->ys))
                                                 : dsk__moe_shared_step(m, ctx, &p->xa, w, T, R, &p->ys)));
    DSK__TRY(dsk__moe_join_on_error(xch, dsk__moe_buf(m, ctx, DSK__MOE_O, T, R, &p->ob)));
    if (!fp8) {
        DSK__TRY(dsk__moe_join_on_error(xch, dsk__moe_buf(m, ctx, DSK__MOE_H1, T, R, &h1)));
        DSK__TRY(dsk__moe_join_on_error(xch, dsk__moe_buf(m, ctx, DSK__MOE_H3, T, R, &h3)));
        DSK__TRY(dsk__moe_join_on_error(xch, dsk__moe_buf(m, ctx, DSK__MOE_A, T, R, &a)));
    }
    st->fwd_chunks = 0;
    if (ep && st->chunked) return dsk__moe_forward_chunks(m, ctx, &h1, &h3, &a);
    DSK__TRY(dsk__moe_pending_join(p));
    if (fp8) {
        DSK__TRY(DSK__MOE_F8(dsk__moe_f8_rows(m, ctx, &p->row_tok, &p->xr)));
        return DSK__MOE_F8(dsk__moe_f8_experts_forward(m, ctx, w, &p->offsets, &p->ob));
    }
    return dsk_swiglu_grouped(ctx, &p->ob, &h1, &h3, &a, &p->xr, &w[0], &w[1], &w[2], &p->offsets);
}

/* The experts' outputs on their way back to their tokens' ranks (p->back): in flight under ep_overlap
   when `overlap`, else here and now. */
static dsk_status dsk__moe_forward_return_impl(dsk_moe *m, dsk_ctx *ctx, int overlap) {
    dsk__moe_pending *p = m->st->pend;
    if (m->ep_size <= 1) return DSK_OK;
    if (!overlap) return dsk__moe_from_experts(m, ctx, &p->ob, &p->back);
    DSK__TRY(dsk__moe_exchange_start(&p->xch, m, ctx, &p->ob, &p->back, DSK__MOE_XCH_FROM_EXPERTS));
    p->flying = 1;
    return DSK_OK;
}

static dsk_status dsk__moe_backward_experts_impl(dsk_moe *m, dsk_ctx *ctx);
static dsk_status dsk__moe_backward_return_impl(dsk_moe *m, dsk_ctx *ctx);

/* The begun call's experts, unless computed (then DSK__MOE_AT_COMPUTED). */
static dsk_status dsk__moe_experts_step(dsk_moe *m, dsk_ctx *ctx) {
    dsk__moe_pending *p = m->st->pend;
    dsk_status s;
    if (p->at >= DSK__MOE_AT_COMPUTED) return DSK_OK;
    s = m->st->pending == DSK__MOE_PEND_FWD ? dsk__moe_forward_experts_impl(m, ctx)
                                            : dsk__moe_backward_experts_impl(m, ctx);
    if (s == DSK_OK) p->at = DSK__MOE_AT_COMPUTED;
    return s;
}

/* Its experts' results on their way back (the experts first), unless they are (then DSK__MOE_AT_RETURNING);
   `overlap`: the forward's in flight under ep_overlap, else in place (the backward's always beside its
   router's backward). */
static dsk_status dsk__moe_return_step(dsk_moe *m, dsk_ctx *ctx, int overlap) {
    dsk__moe_pending *p = m->st->pend;
    dsk_status s;
    if (p->at >= DSK__MOE_AT_RETURNING) return DSK_OK;
    DSK__TRY(dsk__moe_experts_step(m, ctx));
    s = m->st->pending == DSK__MOE_PEND_FWD ? dsk__moe_forward_return_impl(m, ctx, overlap)
                                            : dsk__moe_backward_return_impl(m, ctx);
    if (s == DSK_OK) p->at = DSK__MOE_AT_RETURNING;
    return s;
}

/* The rest of a forward begun: what dsk_moe_experts and dsk_moe_return_begin did not do, the outputs back,
   combined into y. */
static dsk_status dsk__moe_forward_end_impl(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *y, dsk_moe_stats *stats) {
    struct dsk__moe_state *st = m->st;
    dsk__moe_pending *p = st->pend;
    DSK__TRY(dsk__moe_return_step(m, ctx, 0));
    DSK__TRY(dsk__moe_pending_join(p));
    DSK__TRY(dsk__moe_combine(m, ctx, y, &p->pos, &p->gate, m->ep_size > 1 ? &p->back : &p->ob,
                              m->d_shared_total > 0 ? &p->ys : NULL));
    st->in_forward = 0;
    st->f->have_fwd = 1;
    st->f->have_route = 1;
    return stats ? dsk__moe_fill_stats(m, ctx, &p->cntg, &p->loss, stats) : DSK_OK;
}

/* ---------------------------------------------------------------- backward */

/* The shared experts' backward from dya: their gradients, and dxf (T, D) f32 WRITTEN (zeroed without
   shared experts). */
static dsk_status dsk__moe_shared_backward(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *dya, const dsk_tensor *xa,
                                           const dsk_tensor *w, dsk_tensor *dxf) {
    struct dsk__moe_state *st = m->st;
    int64_t T = st->f->T, R = st->f->R, Fs = m->d_shared_total;
    if (Fs > 0) {
        dsk_tensor das, dhs1, dhs3, hs1 = dsk__moe_saved(m, DSK__MOE_HS1), hs3 = dsk__moe_saved(m, DSK__MOE_HS3);
        dsk_tensor as = dsk__moe_saved(m, DSK__MOE_AS);
        DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_DAS, T, R, &das));
        DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_DHS1, T, R, &dhs1));
        DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_DHS3, T, R, &dhs3));
        DSK__TRY(dsk_matmul(ctx, &das, dya, 0, &w[4], 0, 1.0f, 0.0f));
        DSK__TRY(dsk_matmul(ctx, &m->sw2->grad, dya, 1, &as, 0, 1.0f, 1.0f));
        DSK__TRY(dsk__moe_swiglu_grad(m, ctx, &dhs1, &dhs3, &das, &hs1, &hs3));
        DSK__TRY(dsk_matmul(ctx, dxf, &dhs1, 0, &w[3], 0, 1.0f, 0.0f));
        DSK__TRY(dsk_matmul(ctx, dxf, &dhs3, 0, &w[5], 0, 1.0f, 1.0f));
        DSK__TRY(dsk_matmul(ctx, &m->sw1->grad, &dhs1, 1, xa, 0, 1.0f, 1.0f));
        DSK__TRY(dsk_matmul(ctx, &m->sw3->grad, &dhs3, 1, xa, 0, 1.0f, 1.0f));
    } else {
        DSK__TRY(dsk_tensor_fill(ctx, dxf, 0.0));
    }
    return DSK_OK;
}

/* The tensors a forward saved for its backward (the current slot's), its n_rows kept rows. */
typedef struct dsk__moe_kept {
    dsk_tensor xf, xa, u, prob, sel, pos, aux, xs, row_tok, row_gate, h1, h3, a, xr, ob, offsets;
} dsk__moe_kept;

static dsk__moe_kept dsk__moe_kept_views(const dsk_moe *m, int64_t n_rows) {
    const dsk_moe_opts *o = &m->opts;
    int ep = m->ep_size > 1, fp8 = o->expert_gemm == DSK_MOE_GEMM_FP8;
    dsk__moe_kept k;
    k.xf = dsk__moe_saved(m, DSK__MOE_XF);
    k.xa = m->st->act == DSK_F32 ? k.xf : dsk__moe_saved(m, DSK__MOE_XA);
    k.u = dsk__moe_saved(m, DSK__MOE_U), k.prob = dsk__moe_saved(m, DSK__MOE_PROB);
    k.sel = dsk__moe_saved(m, DSK__MOE_SEL), k.pos = dsk__moe_saved(m, DSK__MOE_POS);
    k.aux = dsk__moe_saved(m, DSK__MOE_AUX), k.xs = dsk__moe_saved(m, DSK__MOE_XS);
    k.row_tok = dsk__moe_saved(m, DSK__MOE_ROW_TOK), k.row_gate = dsk__moe_saved(m, DSK__MOE_ROW_GATE);
    k.h1 = dsk__moe_saved(m, DSK__MOE_H1), k.h3 = dsk__moe_saved(m, DSK__MOE_H3), k.a = dsk__moe_saved(m, DSK__MOE_A);
    k.xr = fp8 ? k.xs : ep ? dsk__moe_saved(m, DSK__MOE_XR) : dsk__moe_rows(&k.xs, m->st->f->R); /* FP8: RQ */
    k.ob = dsk__moe_saved(m, ep ? DSK__MOE_OB : DSK__MOE_O);
    k.offsets = dsk__moe_saved(m, ep ? DSK__MOE_LOCAL_OFF : o->capacity_factor > 0 ? DSK__MOE_OFF : DSK__MOE_OFF_ALL);
    k.row_tok = dsk__moe_rows(&k.row_tok, n_rows);
    k.row_gate = dsk__moe_rows(&k.row_gate, n_rows);
    if (ep) k.ob = dsk__moe_rows(&k.ob, n_rows);
    return k;
}

/* A backward up to its rows' exchange: d gate = dy . o for the kept slots, the rows g * dy to go back to the
   experts, and under expert parallelism their exchange begun (beside what the end computes first). */
static dsk_status dsk__moe_backward_begin_impl(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *dy, float aux_scale) {
    struct dsk__moe_state *st = m->st;
    dsk__moe_pending *p = st->pend;
    const dsk_moe_opts *o = &m->opts;
    int64_t T = st->f->T, R = st->f->R, n_rows = st->f->n_kept >= 0 ? st->f->n_kept : T * o->top_k;
    int ep = m->ep_size > 1, two = ep && o->ep_route == DSK_MOE_ROUTE_TWO_HOP;
    dsk__moe_kept k = dsk__moe_kept_views(m, n_rows);
    dsk_tensor w[6];
    DSK__TRY(dsk__moe_weights_act(m, ctx, w));
    dsk__moe_pending_set(p, DSK__MOE_PEND_BWD, T, R, n_rows, w);
    p->aux_scale = aux_scale;
    DSK__TRY(dsk__moe_act_input(m, ctx, DSK__MOE_DYA, dy, NULL, &p->dya));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_DXF, T, R, &p->dxf));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_DGATE, T, R, &p->dgate));
    DSK__TRY(dsk__moe_dgate(m, ctx, &p->dgate, &p->dya, &k.pos, &k.ob));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_DOS, T, R, &p->dos));
    p->dos = dsk__moe_rows(&p->dos, n_rows);
    DSK__TRY(dsk_gather_rows_scaled(ctx, &p->dos, &p->dya, &k.row_tok, &k.row_gate));
    if (!ep) {
        p->dor = dsk__moe_rows(&p->dos, R);
        return DSK_OK;
    }
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_DOR, T, R, &p->dor));
    st->in_forward = 0;
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_DXP, T, R, &p->dxp));
    p->dxp = dsk__moe_rows(&p->dxp, n_rows);
    st->chunked = dsk__moe_chunking(m, ctx);
    DSK__TRY(dsk__moe_exchange_start(&p->xch, m, ctx, two ? &p->dya : &p->dos, &p->dor, DSK__MOE_XCH_TO_EXPERTS));
    p->flying = 1;
    return DSK_OK;
}

/* The experts' weight gradients after the last chunk (the begun backward's dh1, dh3 in their buffers), over whole
   segments in the serial order. */
static dsk_status dsk__moe_chunked_wgrad(dsk_moe *m, dsk_ctx *ctx) {
    dsk__moe_pending *p = m->st->pend;
    dsk__moe_kept k = dsk__moe_kept_views(m, p->n_rows);
    dsk_tensor dh1, dh3;
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_DH1, p->T, p->R, &dh1));
    DSK__TRY(dsk__moe_buf(m, ctx, DSK__MOE_DH3, p->T, p->R, &dh3));
    DSK__TRY(dsk_matmul_grouped(ctx, &m->w2->grad, &p->dor, 1, &k.a, 0, &k.offsets, 1.0f, 1.0f));
    DSK__TRY(dsk_matmul_grouped(ctx, &m->w1->grad, &dh1, 1, &k.xr, 0, &k.offsets, 1.0f, 1.0f));
    return dsk_matmul_grouped(ctx, &m->w3->grad, &dh3, 1, &k.xr, 0, &k.offsets, 1.0f, 1.0f);
}

/* The per-row part of a chunked backward, as its forward (dsk__moe_forward_chunks): the input gradients in the
   exchange's order (in p->dxr, the return's rows; da scratch); then the output gradients, dh1 and dh3
   expert-major for the weight gradients, which wait for the return's start (dsk__moe_backward_return_impl). */
static dsk_status dsk__moe_backward_chunks(dsk_moe *m, dsk_ctx *ctx, const dsk__moe_kept *k, const dsk_tensor *da,
                                           dsk_tensor *dh1, dsk_tensor *dh3) {
    dsk__moe_pending *p = m->st->pend;
    dsk__moe_async *xch = &p->xch;
    dsk_tensor segs, stage, ch[DSK__MOE_CH_N];
    DSK__TRY(dsk__moe_join_on_error(xch, dsk__moe_chunks_begin(m, ctx, &p->dos, &segs, &stage, ch)));
    for (int c = 0, r = m->ep_rank; r >= 0; r = dsk__moe_next_arrival(xch, c++))
        DSK__TRY(dsk__moe_join_on_error(
            xch, dsk__moe_experts_chunk_backward(m, ctx, p->w, &segs, &stage, &k->h1, &k->h3, ch, da, &p->dxr, r)));
    DSK__TRY(dsk__moe_pending_join(p));
    DSK__TRY(dsk__moe_stage_to_experts(m, ctx, &p->dor));
    DSK__TRY(dsk__moe_regroup(m, ctx, dh1, &DSK__MOE_CH(ch, CH_DH1)));
    return dsk__moe_regroup(m, ctx, dh3, &DSK__MOE_CH(ch, CH_DH3));
}

/* A backward's experts: the shared experts' backward while the rows travel, the routed experts' (chunked:
   dsk__moe_backward_chunks) into p->dxr. */
static dsk_status dsk__moe_backward_experts_impl(dsk_moe *m, dsk_ctx *ctx) {
    struct dsk__moe_state *st = m->st;
    dsk__moe_pending *p = st->pend;
    int64_t T = p->T, R = p->R;
    int ep = m->ep_size > 1, fp8 = m->opts.expert_gemm == DSK_MOE_GEMM_FP8;
    dsk__moe_kept k = dsk__moe_kept_views(m, p->n_rows);
    dsk__moe_async *xch = p->flying ? &p->xch : NULL;
    dsk_tensor *w = p->w, da, dh1, dh3;
    DSK__TRY(dsk__moe_join_on_error(xch, fp8 && m->d_shared_total > 0
                                             ? DSK__MOE_F8(dsk__moe_f8_shared_backward(m, ctx, w, &p->dya, &p->dxf))
                                             : dsk__moe_shared_backward(m, ctx, &p->dya, &k.xa, w, &p->dxf)));
    DSK__TRY(dsk__moe_join_on_error(xch, dsk__moe_buf(m, ctx, DSK__MOE_DA, T, R, &da)));
    DSK__TRY(dsk__moe_join_on_error(xch, dsk__moe_buf(m, ctx, DSK__MOE_DH1, T, R, &dh1)));
    DSK__TRY(dsk__moe_join_on_error(xch, dsk__moe_buf(m, ctx, DSK__MOE_DH3, T, R, &dh3)));
    DSK__TRY(dsk__moe_join_on_error(xch, dsk__moe_buf(m, ctx, DSK__MOE_DXR, T, R, &p->dxr)));
    if (ep && st->chunked) return dsk__moe_backward_chunks(m, ctx, &k, &da, &dh1, &dh3);
    DSK__TRY(dsk__moe_pending_join(p));
    if (!ep) p->dxp = p->dxr;
    if (fp8) return DSK__MOE_F8(dsk__moe_f8_experts_backward(m, ctx, w, &k.offsets, &p->dor, &p->dxr));
    return dsk_swiglu_grouped_backward(ctx, &p->dxr, &m->w1->grad, &m->w2->grad, &m->w3->grad, &da, &dh1, &dh3, &p->dor,
                                       &k.xr, &k.h1, &k.h3, &k.a, &w[0], &w[1], &w[2], &k.offsets);
}

/* The rows' input gradients on their way back to their tokens' ranks (p->dxp), in flight under
   ep_overlap; chunked, the experts' weight gradients compute while they travel. */
static dsk_status dsk__moe_backward_return_impl(dsk_moe *m, dsk_ctx *ctx) {
    dsk__moe_pending *p = m->st->pend;
    if (m->ep_size <= 1) return DSK_OK;
    DSK__TRY(dsk__moe_exchange_start(&p->xch, m, ctx, &p->dxr, &p->dxp, DSK__MOE_XCH_FROM_EXPERTS));
    p->flying = 1;
    return m->st->chunked ? dsk__moe_join_on_error(&p->xch, dsk__moe_chunked_wgrad(m, ctx)) : DSK_OK;
}

/* The rest of a backward begun: what dsk_moe_experts and dsk_moe_return_begin did not do, the router's
   backward while the rows travel back, then dx += d/dx. */
static dsk_status dsk__moe_backward_end_impl(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *dx) {
    struct dsk__moe_state *st = m->st;
    dsk__moe_pending *p = st->pend;
    const dsk_moe_opts *o = &m->opts;
    float zcoef = st->f->N > 0 ? o->z_beta * 2.0f / (float)st->f->N * p->aux_scale : 0.0f; /* per token of the span */
    dsk__moe_kept k = dsk__moe_kept_views(m, p->n_rows);
    dsk_tensor du;
    DSK__TRY(dsk__moe_return_step(m, ctx, 0));
    /* router: du (T, E) per token, the routed rows into dxf, then dx += du W_r, dW_r += du^T x */
    DSK__TRY(dsk__moe_join_on_error(p->flying ? &p->xch : NULL, dsk__moe_buf(m, ctx, DSK__MOE_DU, p->T, p->R, &du)));
    DSK__TRY(dsk__moe_join_on_error(p->flying ? &p->xch : NULL,
                                    dsk__moe_route_backward(m, ctx, p->T, &k.u, &k.prob, &k.sel, &p->dgate,
                                                            o->aux_alpha > 0 || o->seq_aux_alpha > 0 ? &k.aux : NULL,
                                                            st->f->row0, st->f->seq_len, p->aux_scale, zcoef, &du)));
    DSK__TRY(dsk__moe_pending_join(p));
    DSK__TRY(dsk__moe_uncombine(m, ctx, &p->dxf, &k.pos, &p->dxp));
    DSK__TRY(dsk_matmul(ctx, &p->dxf, &du, 0, &m->router->value, 0, 1.0f, 1.0f));
    DSK__TRY(dsk_matmul(ctx, &m->router->grad, &du, 1, &k.xf, 0, 1.0f, 1.0f));
    return dsk_axpy(ctx, dx, 1.0f, &p->dxf);
}

/* ---------------------------------------------------------------- statistics and bias */

DSK_API dsk_status dsk_moe_stats_request(dsk_moe *m, dsk_ctx *ctx) {
    struct dsk__moe_state *st;
    int64_t E;
    DSK__TRY(dsk__moe_need_layer(m, "dsk_moe_stats_request"));
    st = m->st;
    E = m->opts.n_routed;
    DSK__TRY(dsk__moe_to_host(m, ctx, st->col_acc_i, dsk__moe_store_of(st, DSK__MOE_ACC_I)->mem.data,
                              (size_t)(5 + E) * sizeof(int64_t)));
    DSK__TRY(
        dsk__moe_to_host(m, ctx, st->col_acc_f, dsk__moe_store_of(st, DSK__MOE_ACC_F)->mem.data, 3 * sizeof(double)));
#ifdef DSK_CUDA
    if (m->device.type == DSK_DEV_CUDA) DSK__TRY(dsk_cuda_event_record(ctx, st->event));
#endif
    st->requested = 1;
    for (int i = 0; i < 2; i++) {
        st->col_bytes[i] = st->acc_bytes[i];
        st->acc_bytes[i] = 0;
    }
    st->off_bytes[2] = st->off_bytes[1];
    st->off_bytes[1] = 0;
    DSK__TRY(dsk_tensor_fill(ctx, &dsk__moe_store_of(st, DSK__MOE_ACC_I)->mem, 0.0));
    return dsk_tensor_fill(ctx, &dsk__moe_store_of(st, DSK__MOE_ACC_F)->mem, 0.0);
}

DSK_API dsk_status dsk_moe_stats_collect(dsk_moe *m, dsk_ctx *ctx, dsk_moe_stats *out) {
    struct dsk__moe_state *st;
    const int64_t *a;
    const double *f;
    int E;
    DSK__TRY(dsk__moe_need_layer(m, "dsk_moe_stats_collect"));
    if (!out) return dsk_set_error(DSK_ERR_ARG, "dsk_moe_stats_collect: layer \"%s\": out is NULL", m->opts.name);
    st = m->st;
#ifdef DSK_CUDA
    if (m->device.type == DSK_DEV_CUDA && st->requested) DSK__TRY(dsk_cuda_event_wait(ctx, st->event));
#else
    (void)ctx;
#endif
    a = st->col_acc_i;
    f = st->col_acc_f;
    E = m->opts.n_routed;
    memset(out, 0, sizeof *out);
    out->calls = a[0];
    out->tokens = a[1];
    out->slots = a[2];
    out->dropped = a[3];
    out->nonfinite = a[4];
    out->tokens_per_expert = a + 5;
    for (int e = 0; e < E; e++) out->max_load = (double)a[5 + e] > out->max_load ? (double)a[5 + e] : out->max_load;
    out->mean_load = (double)out->slots / E;
    out->aux_loss = f[0];
    out->seq_aux_loss = f[1];
    out->z_loss = f[2];
    out->loss = f[0] + f[1] + f[2];
    out->dispatch_bytes = st->col_bytes[0];
    out->combine_bytes = st->col_bytes[1];
    out->bytes_off_node = st->off_bytes[2];
    return DSK_OK;
}

DSK_API dsk_status dsk_moe_update_bias(dsk_moe *m, dsk_ctx *ctx, dsk_comm *comm) {
    const char *fn = "dsk_moe_update_bias";
    dsk_tensor *load;
    DSK__TRY(dsk__moe_need_layer(m, fn));
    DSK__TRY(dsk__moe_need_bound(m, fn));
    load = &dsk__moe_store_of(m->st, DSK__MOE_LOAD)->mem;
    if (comm && comm->world_size > 1) {
        if ((m->device.type == DSK_DEV_CUDA) != (comm->backend == DSK_COMM_NCCL))
            return dsk_set_error(DSK_ERR_UNSUPPORTED,
                                 "%s: layer \"%s\" is on %s: its communicator must use the %s backend", fn,
                                 m->opts.name, m->device.type == DSK_DEV_CUDA ? "CUDA" : "the CPU",
                                 m->device.type == DSK_DEV_CUDA ? "nccl" : "host");
        DSK__TRY(dsk_comm_all_reduce(comm, ctx, load->data, load->data, m->opts.n_routed, DSK_I64, DSK_COMM_SUM));
    }
    return dsk__moe_bias_step(m, ctx, NULL);
}

DSK_API dsk_status dsk_moe_update_bias_unless(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *skip) {
    const char *fn = "dsk_moe_update_bias_unless";
    char b[96];
    DSK__TRY(dsk__moe_need_layer(m, fn));
    DSK__TRY(dsk__moe_need_bound(m, fn));
    if (!skip || skip->dtype != DSK_I32 || dsk_tensor_numel(skip) != 1 || !skip->data)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": skip %s must be one i32 element", fn, m->opts.name,
                             skip ? dsk_tensor_describe(skip, b, sizeof b) : "(NULL)");
    if (skip->device.type != m->device.type || skip->device.index != m->device.index)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": skip is on %s, the layer on %s", fn, m->opts.name,
                             skip->device.type == DSK_DEV_CUDA ? "CUDA" : "the CPU",
                             m->device.type == DSK_DEV_CUDA ? "CUDA" : "the CPU");
    DSK__TRY(dsk__moe_need_cuda_ctx(m, ctx, fn));
    return dsk__moe_bias_step(m, ctx, (const int32_t *)skip->data);
}

/* ---------------------------------------------------------------- configuration in checkpoints */

static void dsk__moe_config_put(dsk_moe_config *c, const char *prefix, const char *name, const char *fmt, double v) {
    snprintf(c->key[c->n], sizeof c->key[0], "%s.%s", prefix, name);
    snprintf(c->value[c->n], sizeof c->value[0], fmt, v);
    c->n++;
}

static void dsk__moe_config_str(dsk_moe_config *c, const char *prefix, const char *name, const char *v) {
    snprintf(c->key[c->n], sizeof c->key[0], "%s.%s", prefix, name);
    snprintf(c->value[c->n], sizeof c->value[0], "%s", v);
    c->n++;
}

DSK_API dsk_status dsk_moe_config_get(const dsk_moe *m, const char *prefix, dsk_moe_config *out) {
    const char *fn = "dsk_moe_config_get";
    const dsk_moe_opts *o;
    DSK__TRY(dsk__moe_need_layer(m, fn));
    if (!out) return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": out is NULL", fn, m->opts.name);
    if (!prefix) prefix = m->opts.name;
    if (strlen(prefix) > 64)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": prefix \"%.20s...\" longer than 64 characters", fn,
                             m->opts.name, prefix);
    o = &m->opts;
    memset(out, 0, sizeof *out);
    /* integers print exactly as %.0f; floats as %.9g, which an f32 round-trips through */
    dsk__moe_config_put(out, prefix, "d_model", "%.0f", (double)o->d_model);
    dsk__moe_config_put(out, prefix, "n_routed", "%.0f", o->n_routed);
    dsk__moe_config_put(out, prefix, "top_k", "%.0f", o->top_k);
    dsk__moe_config_put(out, prefix, "d_expert", "%.0f", (double)o->d_expert);
    dsk__moe_config_put(out, prefix, "n_shared", "%.0f", o->n_shared);
    dsk__moe_config_put(out, prefix, "d_shared", "%.0f", (double)(o->n_shared > 0 ? o->d_shared : 0));
    dsk__moe_config_str(out, prefix, "score", o->score == DSK_MOE_SIGMOID ? "sigmoid" : "softmax");
    dsk__moe_config_str(out, prefix, "norm", o->norm == DSK_MOE_NORM_ON ? "on" : "off");
    dsk__moe_config_put(out, prefix, "routed_scale", "%.9g", (double)o->routed_scale);
    dsk__moe_config_put(out, prefix, "n_group", "%.0f", o->n_group);
    dsk__moe_config_put(out, prefix, "topk_group", "%.0f", o->topk_group);
    dsk__moe_config_str(out, prefix, "group_rule",
                        o->group_rule == DSK_MOE_GROUP_MAX        ? "max"
                        : o->group_rule == DSK_MOE_GROUP_MEGATRON ? "megatron"
                                                                  : "deepseek_v3");
    dsk__moe_config_put(out, prefix, "aux_alpha", "%.9g", (double)o->aux_alpha);
    dsk__moe_config_put(out, prefix, "seq_aux_alpha", "%.9g", (double)o->seq_aux_alpha);
    dsk__moe_config_put(out, prefix, "seq_len", "%.0f", (double)o->seq_len);
    dsk__moe_config_put(out, prefix, "z_beta", "%.9g", (double)o->z_beta);
    dsk__moe_config_str(out, prefix, "loss_count", o->loss_count == DSK_MOE_COUNT_SELECTED ? "selected" : "topk");
    dsk__moe_config_put(out, prefix, "bias_rate", "%.9g", (double)o->bias_rate);
    dsk__moe_config_put(out, prefix, "bias_recenter", "%.0f", o->bias_recenter);
    dsk__moe_config_put(out, prefix, "capacity_factor", "%.9g", (double)o->capacity_factor);
    dsk__moe_config_str(out, prefix, "drop", o->drop == DSK_MOE_DROP_POSITION ? "position" : "prob");
    dsk__moe_config_str(out, prefix, "dtype", dsk_dtype_name(o->dtype));
    return DSK_OK;
}

DSK_API dsk_status dsk_moe_config_check(const dsk_moe *m, const char *prefix, const char *const *keys,
                                        const char *const *values, int n) {
    const char *fn = "dsk_moe_config_check";
    dsk_moe_config c;
    const char *missing = NULL;
    int found = 0;
    DSK__TRY(dsk__moe_need_layer(m, fn));
    if (n < 0 || (n > 0 && (!keys || !values)))
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": %d pairs (keys %s, values %s)", fn, m->opts.name, n,
                             keys ? "given" : "NULL", values ? "given" : "NULL");
    DSK__TRY(dsk_moe_config_get(m, prefix, &c));
    for (int i = 0; i < c.n; i++) {
        const char *v = NULL;
        for (int j = 0; j < n && !v; j++)
            if (keys[j] && !strcmp(keys[j], c.key[i])) v = values[j] ? values[j] : "";
        if (!v) {
            if (!missing) missing = c.key[i];
            continue;
        }
        found++;
        if (strcmp(v, c.value[i]))
            return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": %s: the checkpoint has %s, this layer %s", fn,
                                 m->opts.name, c.key[i], v, c.value[i]);
    }
    if (found && missing)
        return dsk_set_error(DSK_ERR_ARG,
                             "%s: layer \"%s\": the checkpoint holds no %s (but other options of the layer)", fn,
                             m->opts.name, missing);
    return DSK_OK;
}

#ifdef DSK_AMP_H
DSK_API dsk_status dsk_moe_amp_unscale(dsk_amp_scaler *sc, dsk_ctx *ctx, dsk_comm *ep, dsk_tensor *const *rep,
                                       int n_rep, dsk_tensor *const *sharded, int n_sharded) {
    const char *fn = "dsk_moe_amp_unscale";
    dsk_amp_stats r = {0.0, 0.0}, g = {0.0, 0.0};
    if (!sc) return dsk_set_error(DSK_ERR_ARG, "%s: scaler is NULL", fn);
    if (n_rep < 0 || n_sharded < 0 || (n_rep > 0 && !rep) || (n_sharded > 0 && !sharded))
        return dsk_set_error(DSK_ERR_ARG, "%s: %d replicated and %d expert-sharded gradients (lists %s, %s)", fn, n_rep,
                             n_sharded, rep ? "given" : "NULL", sharded ? "given" : "NULL");
    if (ep && ep->world_size > 1 && (sc->device.type == DSK_DEV_CUDA) != (ep->backend == DSK_COMM_NCCL))
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: the scaler is on %s: the expert-parallel group must use the %s "
                             "backend", fn, sc->device.type == DSK_DEV_CUDA ? "CUDA" : "the CPU",
                             sc->device.type == DSK_DEV_CUDA ? "nccl" : "host");
    DSK__TRY(dsk_amp_unscale(sc, ctx, rep, n_rep));
    DSK__TRY(dsk_amp_stats_get(sc, ctx, &r));
    DSK__TRY(dsk_amp_unscale(sc, ctx, sharded, n_sharded));
    if (ep && ep->world_size > 1) /* in place, in the scaler's memory on its device */
        DSK__TRY(dsk_comm_all_reduce(ep, ctx, dsk_amp_stats_data(sc), dsk_amp_stats_data(sc), 2, DSK_F64,
                                     DSK_COMM_SUM));
    DSK__TRY(dsk_amp_stats_get(sc, ctx, &g));
    g.found_inf += r.found_inf;
    g.sumsq += r.sumsq;
    return dsk_amp_stats_set(sc, ctx, &g);
}
#endif

/* ---------------------------------------------------------------- public entry points */

/* experts: (T, K) i32, contiguous, on the CPU; every entry an expert in [0, E), none twice in a
   row. Read on the host only, so a failure leaves the layer as it was. */
static dsk_status dsk__moe_check_replay(const dsk_moe *m, const char *fn, const dsk_tensor *experts, int64_t T) {
    const int K = m->opts.top_k, E = m->opts.n_routed;
    const int32_t *sel;
    char b[96];
    if (!experts) return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": experts is NULL", fn, m->opts.name);
    if (experts->dtype != DSK_I32 || experts->ndim != 2 || experts->shape[0] != T || experts->shape[1] != K ||
        experts->device.type != DSK_DEV_CPU || !dsk_tensor_is_contiguous(experts) || (!experts->data && T > 0))
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": experts is %s, want [%lld,%d] i32, contiguous on the CPU",
                             fn, m->opts.name, dsk_tensor_describe(experts, b, sizeof b), (long long)T, K);
    sel = (const int32_t *)experts->data;
    for (int64_t t = 0; t < T; t++)
        for (int k = 0; k < K; k++) {
            int32_t e = sel[t * K + k];
            if (e < 0 || e >= E)
                return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": experts[%lld][%d] = %d outside [0, %d)", fn,
                                     m->opts.name, (long long)t, k, (int)e, E);
            for (int j = 0; j < k; j++)
                if (sel[t * K + j] == e)
                    return dsk_set_error(DSK_ERR_ARG,
                                         "%s: layer \"%s\": token %lld takes expert %d twice (slots %d and %d)", fn,
                                         m->opts.name, (long long)t, (int)e, j, k);
        }
    return DSK_OK;
}

/* The loss span set for this call's T rows: they lie inside it (without a group: they are all of it), and the
   span is whole sequences of the sequence-wise loss (without a span: the call is). */
static dsk_status dsk__moe_check_span(const dsk_moe *m, const char *fn, int64_t T) {
    const struct dsk__moe_state *st = m->st;
    int64_t N = st->span_on ? st->span_rows : T;
    if (st->span_on && st->span_row0 + T > N)
        return dsk_set_error(DSK_ERR_ARG,
                             "%s: layer \"%s\": this call's %lld rows from row0 %lld end past the loss span's "
                             "total_rows %lld",
                             fn, m->opts.name, (long long)T, (long long)st->span_row0, (long long)N);
    if (st->span_on && !st->span_group && (st->span_row0 != 0 || T != N))
        return dsk_set_error(DSK_ERR_ARG,
                             "%s: layer \"%s\": a loss span without a group holds this call's rows only: total_rows "
                             "%lld and row0 %lld, but the call has %lld rows",
                             fn, m->opts.name, (long long)N, (long long)st->span_row0, (long long)T);
    if (m->opts.seq_aux_alpha > 0 && m->opts.seq_len > 0 && N % m->opts.seq_len)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": %lld tokens %sare not whole sequences of seq_len %lld", fn,
                             m->opts.name, (long long)N, st->span_on ? "(the loss span's total_rows) " : "",
                             (long long)m->opts.seq_len);
    return DSK_OK;
}

/* dsk_moe_forward and dsk_moe_forward_replay: every argument checked before the layer changes. */
/* The pending forward or backward's record, made at the layer's first begin; NULL when out of memory. */
static dsk__moe_pending *dsk__moe_pending_of(dsk_moe *m) {
    if (!m->st->pend && (m->st->pend = (dsk__moe_pending *)DSK_MALLOC(sizeof(dsk__moe_pending))) != NULL)
        memset(m->st->pend, 0, sizeof(dsk__moe_pending));
    if (!m->st->pend) dsk_set_error(DSK_ERR_OOM, "dsk_moe: layer \"%s\": out of host memory", m->opts.name);
    return m->st->pend;
}

/* Checks a forward's input, then runs the forward to its dispatch (st->pending FWD until its end). */
static dsk_status dsk__moe_forward_start(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *x, const dsk_tensor *replay,
                                         const char *fn) {
    struct dsk__moe_state *st;
    int64_t T;
    dsk_status s;
    DSK__TRY(dsk__moe_need_layer(m, fn));
    DSK__TRY(dsk__moe_need_bound(m, fn));
    DSK__TRY(dsk__moe_need_idle(m, fn));
    DSK__TRY(dsk__moe_check_io(m, fn, "x", x, -1));
    T = x->shape[0];
    if (replay) DSK__TRY(dsk__moe_check_replay(m, fn, replay, T));
    DSK__TRY(dsk__moe_check_span(m, fn, T));
    DSK__TRY(dsk__moe_need_cuda_ctx(m, ctx, fn));
    if (!dsk__moe_pending_of(m)) return DSK_ERR_OOM;
    st = m->st;
    st->f->have_fwd = st->f->bwd_done = st->f->have_route = 0;
    st->pending = DSK__MOE_PEND_FWD;
    s = dsk__moe_forward_begin_impl(m, ctx, x, T, replay);
    if (s != DSK_OK) st->pending = DSK__MOE_PEND_NONE; /* no exchange runs after a failed start */
    return s;
}

/* Checks y against the forward begun, then ends it. A bad y leaves it begun. */
static dsk_status dsk__moe_forward_finish(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *y, dsk_moe_stats *stats,
                                          const char *fn) {
    struct dsk__moe_state *st;
    dsk_status s;
    if (stats) memset(stats, 0, sizeof *stats);
    DSK__TRY(dsk__moe_need_layer(m, fn));
    st = m->st;
    if (st->pending != DSK__MOE_PEND_FWD)
        return dsk_set_error(DSK_ERR_STATE, "%s: layer \"%s\": no forward begun (dsk_moe_forward_begin)", fn,
                             m->opts.name);
    DSK__TRY(dsk__moe_check_io(m, fn, "y", y, st->pend->T));
    DSK__TRY(dsk__moe_need_cuda_ctx(m, ctx, fn));
    s = dsk__moe_forward_end_impl(m, ctx, y, stats);
    st->pending = DSK__MOE_PEND_NONE; /* the end joined the exchange, whatever its status */
    if (s != DSK_OK) {
        st->f->have_fwd = st->f->have_route = 0;
        if (stats) memset(stats, 0, sizeof *stats);
    }
    return s;
}

static dsk_status dsk__moe_forward_checked(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x,
                                           const dsk_tensor *replay, dsk_moe_stats *stats, const char *fn) {
    if (stats) memset(stats, 0, sizeof *stats);
    DSK__TRY(dsk__moe_need_layer(m, fn));
    DSK__TRY(dsk__moe_check_io(m, fn, "x", x, -1));
    DSK__TRY(dsk__moe_check_io(m, fn, "y", y, x->shape[0]));
    DSK__TRY(dsk__moe_forward_start(m, ctx, x, replay, fn));
    return dsk__moe_forward_finish(m, ctx, y, stats, fn);
}

DSK_API dsk_status dsk_moe_forward_begin(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *x) {
    return dsk__moe_forward_start(m, ctx, x, NULL, "dsk_moe_forward_begin");
}

DSK_API dsk_status dsk_moe_forward_end(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *y, dsk_moe_stats *stats) {
    return dsk__moe_forward_finish(m, ctx, y, stats, "dsk_moe_forward_end");
}

DSK_API dsk_status dsk_moe_set_loss_span(dsk_moe *m, dsk_comm *group, int64_t row0, int64_t total_rows) {
    const char *fn = "dsk_moe_set_loss_span";
    struct dsk__moe_state *st;
    DSK__TRY(dsk__moe_need_layer(m, fn));
    st = m->st;
    if (row0 < 0 || total_rows < 0 || row0 > total_rows)
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": row0 %lld, total_rows %lld: want 0 <= row0 <= total_rows",
                             fn, m->opts.name, (long long)row0, (long long)total_rows);
    if (group && (group->world_size < 1 || !group->impl))
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": the group is not an initialised communicator", fn,
                             m->opts.name);
    if (group && group->world_size > 1 && (m->device.type == DSK_DEV_CUDA) != (group->backend == DSK_COMM_NCCL))
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: layer \"%s\" is on %s: the group must use the %s backend", fn,
                             m->opts.name, m->device.type == DSK_DEV_CUDA ? "CUDA" : "the CPU",
                             m->device.type == DSK_DEV_CUDA ? "nccl" : "host");
    st->span_group = group;
    st->span_row0 = row0;
    st->span_rows = total_rows;
    st->span_on = group || total_rows > 0;
    return DSK_OK;
}

DSK_API dsk_status dsk_moe_forward(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x, dsk_moe_stats *stats) {
    return dsk__moe_forward_checked(m, ctx, y, x, NULL, stats, "dsk_moe_forward");
}

DSK_API dsk_status dsk_moe_forward_replay(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *y, const dsk_tensor *x,
                                          const dsk_tensor *experts, dsk_moe_stats *stats) {
    const char *fn = "dsk_moe_forward_replay";
    if (!experts) {
        if (stats) memset(stats, 0, sizeof *stats);
        DSK__TRY(dsk__moe_need_layer(m, fn));
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": experts is NULL", fn, m->opts.name);
    }
    return dsk__moe_forward_checked(m, ctx, y, x, experts, stats, fn);
}

DSK_API dsk_status dsk_moe_routing(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *experts) {
    const char *fn = "dsk_moe_routing";
    const struct dsk__moe_state *st;
    char b[96];
    DSK__TRY(dsk__moe_need_layer(m, fn));
    st = m->st;
    if (!st->f->have_route)
        return dsk_set_error(DSK_ERR_STATE, "%s: layer \"%s\": no forward has routed tokens since the layer was made "
                             "or its workspace reserved", fn, m->opts.name);
    if (!experts) return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": experts is NULL", fn, m->opts.name);
    if (experts->dtype != DSK_I32 || experts->ndim != 2 || experts->shape[0] != st->f->T ||
        experts->shape[1] != m->opts.top_k || experts->device.type != DSK_DEV_CPU ||
        !dsk_tensor_is_contiguous(experts) || (!experts->data && st->f->T > 0))
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": experts is %s, want [%lld,%d] i32, contiguous on the CPU",
                             fn, m->opts.name, dsk_tensor_describe(experts, b, sizeof b), (long long)st->f->T,
                             m->opts.top_k);
    if (st->f->T == 0) return DSK_OK;
    DSK__TRY(dsk__moe_to_host(m, ctx, experts->data, dsk__moe_store_of(m->st, DSK__MOE_SEL)->mem.data,
                              (size_t)(st->f->T * m->opts.top_k) * sizeof(int32_t)));
    return dsk_ctx_sync(ctx); /* CUDA: the copy is done when this returns */
}

/* Checks a backward's dy and state, then runs it to its exchange (st->pending BWD until its end). */
static dsk_status dsk__moe_backward_start(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *dy, float aux_scale,
                                          const char *fn) {
    struct dsk__moe_state *st;
    dsk_status s;
    DSK__TRY(dsk__moe_need_layer(m, fn));
    DSK__TRY(dsk__moe_need_idle(m, fn));
    st = m->st;
    if (st->f->bwd_done)
        return dsk_set_error(DSK_ERR_STATE,
                             "%s: layer \"%s\": a backward already used the forward in slot %d (its gradients would "
                             "be added twice): run a forward first",
                             fn, m->opts.name, dsk__moe_slot_index(st));
    if (!st->f->have_fwd)
        return dsk_set_error(DSK_ERR_STATE, "%s: layer \"%s\": no forward to differentiate in slot %d", fn,
                             m->opts.name, dsk__moe_slot_index(st));
    DSK__TRY(dsk__moe_need_bound(m, fn));
    DSK__TRY(dsk__moe_check_io(m, fn, "dy", dy, st->f->T));
    if (!isfinite(aux_scale))
        return dsk_set_error(DSK_ERR_ARG, "%s: layer \"%s\": aux_scale %g is not finite", fn, m->opts.name,
                             (double)aux_scale);
    DSK__TRY(dsk__moe_need_cuda_ctx(m, ctx, fn));
    if (!dsk__moe_pending_of(m)) return DSK_ERR_OOM;
    /* from here the gradients change: this forward is used up, even if a step below fails */
    st->f->have_fwd = 0;
    st->f->bwd_done = 1;
    st->pending = DSK__MOE_PEND_BWD;
    s = dsk__moe_backward_begin_impl(m, ctx, dy, aux_scale);
    if (s != DSK_OK) st->pending = DSK__MOE_PEND_NONE;
    return s;
}

/* Checks dx against the backward begun, then ends it. A bad dx leaves it begun. */
static dsk_status dsk__moe_backward_finish(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *dx, const char *fn) {
    dsk_status s;
    DSK__TRY(dsk__moe_need_layer(m, fn));
    if (m->st->pending != DSK__MOE_PEND_BWD)
        return dsk_set_error(DSK_ERR_STATE, "%s: layer \"%s\": no backward begun (dsk_moe_backward_begin)", fn,
                             m->opts.name);
    DSK__TRY(dsk__moe_check_io(m, fn, "dx", dx, m->st->pend->T));
    DSK__TRY(dsk__moe_need_cuda_ctx(m, ctx, fn));
    s = dsk__moe_backward_end_impl(m, ctx, dx);
    m->st->pending = DSK__MOE_PEND_NONE;
    return s;
}

DSK_API dsk_status dsk_moe_backward(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *dx, const dsk_tensor *dy, float aux_scale) {
    const char *fn = "dsk_moe_backward";
    DSK__TRY(dsk__moe_need_layer(m, fn));
    if (m->st->f->have_fwd && !m->st->f->bwd_done) DSK__TRY(dsk__moe_check_io(m, fn, "dx", dx, m->st->f->T));
    DSK__TRY(dsk__moe_backward_start(m, ctx, dy, aux_scale, fn));
    return dsk__moe_backward_finish(m, ctx, dx, fn);
}

DSK_API dsk_status dsk_moe_backward_begin(dsk_moe *m, dsk_ctx *ctx, const dsk_tensor *dy, float aux_scale) {
    return dsk__moe_backward_start(m, ctx, dy, aux_scale, "dsk_moe_backward_begin");
}

DSK_API dsk_status dsk_moe_backward_end(dsk_moe *m, dsk_ctx *ctx, dsk_tensor *dx) {
    return dsk__moe_backward_finish(m, ctx, dx, "dsk_moe_backward_end");
}

/* The call begun, for a step between its begin and end. */
static dsk_status dsk__moe_need_pending(dsk_moe *m, dsk_ctx *ctx, const char *fn) {
    DSK__TRY(dsk__moe_need_layer(m, fn));
    if (m->st->pending == DSK__MOE_PEND_NONE)
        return dsk_set_error(DSK_ERR_STATE, "%s: layer \"%s\": no forward or backward begun", fn, m->opts.name);
    return dsk__moe_need_cuda_ctx(m, ctx, fn);
}

/* s; a failed step ends the call begun (its exchange joined; a forward leaves nothing to differentiate). */
static dsk_status dsk__moe_step_status(dsk_moe *m, dsk_status s) {
    struct dsk__moe_state *st = m->st;
    if (s == DSK_OK) return s;
    s = dsk__moe_join_on_error(st->pend->flying ? &st->pend->xch : NULL, s);
    if (st->pending == DSK__MOE_PEND_FWD) st->f->have_fwd = st->f->have_route = 0;
    st->pending = DSK__MOE_PEND_NONE;
    return s;
}

DSK_API dsk_status dsk_moe_experts(dsk_moe *m, dsk_ctx *ctx) {
    DSK__TRY(dsk__moe_need_pending(m, ctx, "dsk_moe_experts"));
    return dsk__moe_step_status(m, dsk__moe_experts_step(m, ctx));
}

DSK_API dsk_status dsk_moe_return_begin(dsk_moe *m, dsk_ctx *ctx) {
    DSK__TRY(dsk__moe_need_pending(m, ctx, "dsk_moe_return_begin"));
    return dsk__moe_step_status(m, dsk__moe_return_step(m, ctx, 1));
}

DSK_API dsk_status dsk_moe_wait(dsk_moe *m, dsk_ctx *ctx) {
    dsk__moe_pending *p;
    dsk_status s;
    DSK__TRY(dsk__moe_need_pending(m, ctx, "dsk_moe_wait"));
    p = m->st->pend;
    s = dsk__moe_pending_join(p);
    return dsk__moe_step_status(m, s);
}

DSK__FP_EXACT_END
#endif /* DSK_MOE_IMPLEMENTATION_DONE */
#endif /* DSK_MOE_IMPLEMENTATION */

/* MIT License. Copyright (c) 2026 the dsk authors. Permission is hereby granted, free of
   charge, to any person obtaining a copy of this software, to deal in the software without
   restriction, subject to including this notice. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT
   WARRANTY OF ANY KIND. */
