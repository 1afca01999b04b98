/* dsk_plan.h - a layout planner: from a model, a cluster and a batch to the fastest layout
   (tensor, pipeline, expert and data parallelism, ZeRO stage, recomputation, schedule) whose
   memory fits, with a predicted step time and the reason each other layout lost.

   Usage: #define DSK_PLAN_IMPLEMENTATION in exactly one .c file before including (with the
   implementations of dsk_tensor.h, dsk_comm.h and dsk_par.h somewhere in the program).
   Options: DSK_STATIC, DSK_MALLOC/DSK_FREE as in dsk_tensor.h.

   Example (given const dsk_plan_model *model, const char *cluster_json, char *out, size_t cap):
       dsk_plan_cluster cl;
       dsk_plan_job job;  memset(&job, 0, sizeof job);  job.sequences = 64;  job.seq = 4096;
       dsk_plan_result *res = NULL;
       int n = 0;
       dsk_status st = dsk_plan_cluster_parse(&cl, cluster_json, strlen(cluster_json), "cluster.json");
       if (st == DSK_OK) st = dsk_plan_run(model, &cl, &job, NULL, &res, &n);   // sorted: fitting, fastest first
       if (st == DSK_OK) st = dsk_plan_table(res, n, &cl, 10, out, cap);      // the table with the reasons
       dsk_plan_results_free(res);
       return st;
   End of example.

   The contract.
   - Memory is not estimated here: the model's callback (dsk_plan_model.memory) gives the bytes
     of one rank per role for a layout and a pipeline stage, and the bytes its gradient
     collectives hand over per step. A trainer computes them with its own sizing code:
     examples/train_plan.h runs examples/train_moe.c's model declaration and allocation code in a
     counting mode and dsk_zero_plan (the slabs dsk_zero_init allocates), so the figures are the
     allocator's figures of a run (tests/test_plan.sh checks them against runs). A layout fits
     when the worst stage's total is at most the GPU's memory less cluster.reserve_gb. The
     worst case of dropless expert parallelism (mem.imbalance: every token of the expert group
     routed to one rank's experts, its workspace grown to ep times the reserved rows) is shown,
     not counted: at scale it is hundreds of GB per layer and no layout with expert parallelism
     would fit, while real routing (balanced by the expert bias) stays near the reserved rows.
   - The step time is a model: compute = the job's FLOPs (flops_per_token x tokens, plus the forward
     recomputation reruns) over world x peak x efficiency (a pipeline's: the stage that keeps its pace,
     the most compute and expert exchanges of the model callback's flops and MoE layers per stage,
     dsk_plan_stages, over tp x dp x peak x efficiency), plus the schedule's bubble: the schedule's lists
     run with each stage's own compute, expert exchanges and tensor-parallel collectives (each layer's, inside
     its passes) (dsk_par_schedule_time, the transfers meeting as the cluster's backend has them for the
     messages' size, dsk_plan_transfers; a stage's chunks alike, its forward a third of its FLOPs without
     recomputation and half its exchanges and collectives), less the pace stage's busy time, which for equal
     stages is dsk_par_bubble_fraction x it, and for unequal ones what the lighter stages' order makes them
     wait; each collective's bytes over the link it crosses (ring all-reduce 2 (n-1)/n, reduce-scatter,
     all-gather and all-to-all (n-1)/n of the message per rank, n its group: for the gradient reductions and
     weight gathers each object's own, the data-parallel ranks, the expert group or tp x dp for what tensor
     parallelism replicates, the callback's link_bytes; intra-node when the group fits in a node, else the
     inter-node bandwidth) plus a latency per message; tensor-parallel (the busiest stage's collectives by kind
     and their calls, which the model's callback gives: examples/train_plan.h walks the trainer's
     call sites, tests/test_plan.sh compares them with a run's dsk_comm_stats), expert-parallel
     (dispatch and combine, forward and backward, of that stage's MoE layers) and pipeline (the sends
     of the busiest stage's schedule, whose bytes the model's callback gives: examples/train_plan.h walks the trainer's
     schedule and buffers, and tests/test_plan.sh compares them with the bytes a run hands to
     dsk_comm_send) traffic is exposed, except that with forwards and backwards paired (the
     trainer's --pair-micro-batches) a pair's expert exchanges travel beside the other micro-batch's
     compute (result.ep_hidden_s, dsk__plan_pair_hidden); the gradient reductions overlap the backward
     of the passes that reduce (ZeRO 0-1 reduce once, after the last micro-batch: its backward alone; ZeRO 2-3
     every micro-batch's) up to cluster.overlap of it. An FP8 layout runs the model's fp8_flops_per_token (and
     their recomputed forward) at fp8_tflops instead of bf16_tflops, at the same efficiency. CPU ranks that share
     cores (cluster.cores_per_node below the ranks of a node; bf16_tflops is then one core's rate):
     a waiting rank gives its core away, so the step is the larger of that one-device-per-rank step
     (the critical path) and the node's busy work (every rank's compute and communication, CPU work
     on the host backend, overlapped or not; with cluster.link_wait, a link whose time is a wait, not
     communication) over its cores (result.cores_s is what this adds; the derivation is at
     dsk__plan_shared_cores). The optimizer step, after the reductions, streams
     memory.optimizer_step bytes (the callback's count) at cluster.memory_gbps when the file gives
     it (result.opt_s). The efficiency and the overlap are calibration: bench/plan_rank.sh measures
     this machine's CPU ranks into bench/plan_cpu_calibrated.json (its figures and command in
     bench/RESULTS.md); the GPU files in examples/clusters/ carry datasheet peaks at the efficiency
     0.4 until a GPU session measures one.
   - Layouts enumerated: tp in 1, 2, 4, 8 (within a node, dividing heads, vocabulary and FFN),
     pp dividing world / tp and at most the layers, dp the rest (dividing the sequences), ep
     dividing dp and the experts, ZeRO 0-3, recomputation none / attn / full, AdamW's moments
     in f32 or bf16 (DeepSeek-V3's choice: half their bytes; the time model tells them apart only
     by the optimizer step's bytes, so on a tie the f32 one ranks first and the table lists a bf16
     layout only when its f32 twin does not fit or is slower), FP8 GEMMs or not (when the model
     has FP8 FLOPs; the callback refuses what the trainer does not run in FP8), schedules 1F1B,
     GPipe, interleaved (2 virtual stages, when the micro-batches are a multiple of pp) and
     DualPipeV (when there are at least 2 pp micro-batches), with one sequence per micro-batch;
     without a pipeline, gradient accumulation of one sequence per pass; with expert parallelism and
     2 or more micro-batches, each of these unpaired and paired (all but GPipe, ZeRO 0-2, without
     full recomputation: what the trainer pairs; on one stage the passes become paired
     micro-batches). dsk_plan_space narrows the set.
   - The callback may refuse a layout (DSK_ERR_UNSUPPORTED: the trainer does not run it); it is
     left out.
   - Bad input is named: a cluster file's missing or malformed field by its key; a model that
     fits no layout: dsk_plan_run still returns every layout (none fits), and dsk_plan_table says
     the smallest memory any layout needs against what each GPU has.
   License: MIT, see the end of the file. */

/* Contents
     declarations
       cluster        dsk_plan_cluster, dsk_plan_cluster_parse, dsk_plan_cluster_read
       model and job  dsk_plan_layout, dsk_plan_memory, dsk_plan_model, dsk_plan_job, dsk_plan_space
       planning       dsk_plan_result, dsk_plan_time, dsk_plan_stages, dsk_plan_stage_times, dsk_plan_run,
                      dsk_plan_results_free
       output         dsk_plan_layout_str, dsk_plan_table, dsk_plan_json, dsk_plan_choice_parse/read
     implementation (DSK_PLAN_IMPLEMENTATION)
       JSON fields; cluster; time model; enumeration and ranking; output */

#if defined(DSK_STATIC) && defined(DSK_PLAN_IMPLEMENTATION)
#ifndef DSK_TENSOR_IMPLEMENTATION
#define DSK_TENSOR_IMPLEMENTATION
#endif
#ifndef DSK_COMM_IMPLEMENTATION
#define DSK_COMM_IMPLEMENTATION
#endif
#ifndef DSK_PAR_IMPLEMENTATION
#define DSK_PAR_IMPLEMENTATION
#endif
#endif
#ifndef DSK_PLAN_H
#define DSK_PLAN_H
#include "dsk_tensor.h"
#include "dsk_par.h"
DSK__FP_EXACT_BEGIN
#ifdef __cplusplus
extern "C" {
#endif

/* ---- cluster */

/* Every field required in the file unless marked optional [default]. */
typedef struct dsk_plan_cluster {
    char name[64];
    int nodes, gpus_per_node;
    double memory_gb;               /* per GPU, 1e9 bytes */
    double bf16_tflops, fp8_tflops; /* peak dense per GPU */
    double intra_gbps, inter_gbps;  /* per GPU and direction, GB/s: inside a node (NVLink), between nodes (NIC) */
    double intra_latency_us, inter_latency_us;
    double efficiency; /* optional [0.4]: the share of bf16 peak the GEMMs reach */
    double overlap;    /* optional [0.8]: the share of a reducing pass's backward the gradient collectives hide
                          under */
    double reserve_gb; /* optional [0]: memory per GPU no layout may use (context, fragmentation) */
    int cores_per_node; /* optional [0]: the CPU cores a node's ranks share (CPU ranks); 0: a device per rank */
    int link_wait;      /* optional [0]: CPU ranks: 1 when a link's time is a wait that gives the core away (a
                           network card moves the bytes, or dsk_comm's emulated link, DSK_LINK_GBPS, sleeps), 0
                           when the ranks' CPUs copy them (shared memory) */
    double memory_gbps; /* optional [0]: GB/s at which a rank's optimizer step streams its bytes (the memory's
                           bandwidth per GPU; CPU ranks: per rank); 0: the optimizer step is not timed */
} dsk_plan_cluster;

/* Parses a cluster description (a JSON object of the fields above); `what` names the source in
   messages. A missing, duplicated, unknown or mistyped field fails naming it. */
DSK_API dsk_status dsk_plan_cluster_parse(dsk_plan_cluster *c, const char *json, size_t n, const char *what);
DSK_API dsk_status dsk_plan_cluster_read(dsk_plan_cluster *c, const char *path);

/* ---- model and job */

typedef enum dsk_plan_recompute {
    DSK_PLAN_RECOMPUTE_NONE = 0,
    DSK_PLAN_RECOMPUTE_ATTN,
    DSK_PLAN_RECOMPUTE_FULL
} dsk_plan_recompute;

typedef struct dsk_plan_layout {
    int tp, pp, dp, ep, zero;
    int micro;                      /* pp > 1 or paired: micro-batches per step; else pp 1: accumulation passes */
    int vstages;                    /* interleaved: chunks per rank; dualpipev: 2; else 1 */
    dsk_par_schedule_kind schedule; /* pp > 1 */
    dsk_plan_recompute recompute;
    dsk_dtype moments; /* AdamW's two moments: DSK_F32 or DSK_BF16 (DeepSeek-V3's; the masters stay f32) */
    int fp8;           /* 1: the GEMMs of dsk_plan_model.fp8_flops_per_token in FP8 (the trainer's --dtype fp8) */
    int paired;        /* 1: forwards and backwards paired (dsk_par_schedule_init_paired, the trainer's
                          --pair-micro-batches: more in flight, the expert exchanges beside the other
                          micro-batch's compute) */
} dsk_plan_layout;

/* One rank's bytes by role, as its allocator counts them. */
typedef struct dsk_plan_memory {
    int64_t params, grads, optimizer; /* compute weights, f32 gradients, f32 masters and moments */
    int64_t comm;                     /* communication buffers (compression staging) */
    int64_t activations;              /* activations, scratch and workspaces held through the step */
    int64_t imbalance;                /* dropless expert parallelism's worst case beyond it (every token of the
                                         expert group routed to this rank's experts) */
    int64_t optimizer_step;           /* not held: the bytes its optimizer step reads and writes (AdamW: each
                                         element's gradient, master, moments and weight), which the time model
                                         streams at cluster.memory_gbps */
} dsk_plan_memory;

/* A rank's tensor-parallel collectives per step: the whole messages by kind, in bytes, as
   dsk_comm_stats' payload counters count them, and how many calls. */
typedef struct dsk_plan_tp {
    double all_reduce, all_gather, reduce_scatter, calls;
} dsk_plan_tp;

#define DSK_PLAN_MAX_CHUNKS 16 /* a pipeline rank's chunks whose MoE layers dsk_plan_flops counts apart */

/* Training FLOPs per token (forward and backward, the trainer's count): all of them, and of them the
   attention cores' (what recompute attn reruns) and the GEMMs' an FP8 layout runs in FP8; and the MoE
   layers they hold (a stage's: its chunks' blocks), and of them each chunk's (all zero: not counted apart,
   taken alike). */
typedef struct dsk_plan_flops {
    double total, attn, fp8;
    int moe_layers;
    int chunk_moe_layers[DSK_PLAN_MAX_CHUNKS];
} dsk_plan_flops;

typedef struct dsk_plan_job {
    int64_t sequences; /* global batch per step */
    int64_t seq;       /* tokens per sequence */
} dsk_plan_job;

/* The model: sizes for the traffic and FLOPs, and the trainer's memory for a layout. */
typedef struct dsk_plan_model {
    char name[64];
    int layers, moe_layers, heads, n_routed, top_k;
    int64_t d_model, vocab, ffn_hidden;
    double flops_per_token;      /* training FLOPs per token (the trainer's count) */
    double attn_flops_per_token; /* of which the attention cores' (recompute attn reruns their forward) */
    double fp8_flops_per_token;  /* of which the GEMMs an FP8 layout runs in FP8 (0: no FP8 layouts) */
    double act_bytes;            /* bytes per element of activations on the wire (2: bf16) */
    /* stage `stage` of the layout: its rank's memory; *reduce_bytes and *gather_bytes: what its
       gradient reductions and weight gathers hand over per step (the messages, dsk_zero_plan's);
       *link_bytes: what they put on the rank's link per step: each message times (n - 1) / n of the n ranks
       it is reduced or gathered over (the object's group: the data-parallel ranks, the expert group, tp x dp for
       what tensor parallelism replicates), twice for an all-reduce (ZeRO 0-1; 2-3 reduce-scatter);
       *send_bytes: what its pipeline sends (activations and gradients) hand over per step;
       *tp: its tensor-parallel collectives per step (zero without tensor parallelism);
       *flops: the FLOPs per token of the stage's layers (all its chunks; the last's head and MTP
       modules too), all its tp ranks together, and its chunks' MoE layers (left zero: the model's
       over pp), each chunk's apart (chunk_moe_layers; left zero: taken alike) */
    dsk_status (*memory)(void *user, const dsk_plan_layout *l, const dsk_plan_job *job, int stage, dsk_plan_memory *mem,
                         double *reduce_bytes, double *gather_bytes, double *link_bytes, double *send_bytes,
                         dsk_plan_tp *tp, dsk_plan_flops *flops);
    void *user;
} dsk_plan_model;

/* Restricts the enumeration: a zero field allows every value; a nonzero one only that value
   (tp, pp, ep, zero + 1, recompute + 1, schedule + 1, the moments' dtype + 1, fp8 + 1, paired + 1). */
typedef struct dsk_plan_space {
    int tp, pp, ep, zero_plus1, recompute_plus1, schedule_plus1, moments_plus1, fp8_plus1, paired_plus1;
} dsk_plan_space;

/* ---- planning */

typedef struct dsk_plan_result {
    dsk_plan_layout layout;
    dsk_plan_memory mem; /* the stage whose total is largest */
    int worst_stage;
    int64_t total; /* its total bytes, the imbalance's worst case left out */
    int fits;
    double pp_bytes; /* the busiest stage's pipeline sends per step (the callback's send_bytes) */
    dsk_plan_tp tp;  /* the busiest stage's tensor-parallel collectives per step (the callback's tp) */
    dsk_plan_flops stage_flops; /* the stage that keeps a pipeline's pace: the most compute and expert exchanges (the
                                   callback's flops; pp > 1); moe_layers -1: not counted, the stages' mean taken */
    double pipe_s; /* a pipeline's compute and expert exchanges under its schedule, each stage at its own, the
                      bubble included (dsk_plan_stages; pp > 1) */
    int lead_moe_layers;        /* pipeline rank 0's MoE layers (its chunks'; the callback's flops of stage 0) */
    int lead_chunk_moe_layers[DSK_PLAN_MAX_CHUNKS]; /* of them each of its chunks' (the callback's; zero: alike) */
    /* seconds per step: compute (with recomputation), the bubble, the exposed communication */
    double step_s, compute_s, bubble_s, tp_s, ep_s, pp_s, zero_s, zero_exposed_s;
    double ep_hidden_s; /* of ep_s, what travels beside the other micro-batch of a pair (paired layouts) */
    double opt_s;       /* the optimizer step (mem.optimizer_step at cluster.memory_gbps; 0 without it) */
    double cores_s; /* what ranks sharing a node's cores add (cluster.cores_per_node; dsk_plan_time) */
    char why[200]; /* why it lost to the best (empty for the best) */
} dsk_plan_result;

/* The step time of r->layout given its gradient reductions' and gathers' bytes on a rank's link (the callback's
   link_bytes), r->pp_bytes, r->tp and (pp > 1) dsk_plan_stages' fields (fills the seconds of *r). */
DSK_API dsk_status dsk_plan_time(const dsk_plan_model *m, const dsk_plan_cluster *c, const dsk_plan_job *job,
                                 double grad_link_bytes, dsk_plan_result *r);
/* From r->layout's pp stages' FLOPs (the callback's, stages[0..pp)): r->stage_flops, the stage that keeps the
   pipeline's pace, the most compute and expert exchanges (moe_layers -1 where no stage counts its MoE layers while
   the model has some: then the busiest stage, every stage's exchanges the mean's), and r->pipe_s, the schedule's
   lists timed with each stage's compute and exchanges (dsk_par_schedule_time, the transfers as dsk_plan_transfers
   says for messages of r->pp_bytes over micro x vstages). pp 1: both zeroed. */
DSK_API dsk_status dsk_plan_stages(const dsk_plan_model *m, const dsk_plan_cluster *c, const dsk_plan_job *job,
                                   const dsk_plan_flops *stages, dsk_plan_result *r);
/* How a pipeline's transfers of message_bytes each meet on c: CPU ranks (cores_per_node > 0, the host backend) with
   messages their node's rings hold (dsk_comm_host_ring_room of gpus_per_node ranks) begin their receives ahead and
   their sends leave at once (DSK_PAR_TRANSFERS_AHEAD); larger messages, and GPUs (the lists' order on the stream),
   meet in order (DSK_PAR_TRANSFERS_IN_ORDER). */
DSK_API dsk_par_transfers dsk_plan_transfers(const dsk_plan_cluster *c, double message_bytes);
/* What dsk_plan_stages times: a micro-batch's forward and backward of each global stage dsk_par_stage(schedule, pp,
   k, s) (k pp + s; DualPipeV's V) (fwd_s, bwd_s: pp v each), stage s's compute, expert exchanges and
   tensor-parallel collectives (tp, every stage's taken as the busiest's; NULL: none) over its chunks alike, the
   forward a third of its FLOPs without recomputation and half its exchanges and collectives (each layer's run
   inside its passes, as its compute). */
DSK_API void dsk_plan_stage_times(const dsk_plan_model *m, const dsk_plan_cluster *c, const dsk_plan_job *job,
                                  const dsk_plan_layout *l, const dsk_plan_tp *tp, const dsk_plan_flops *stages,
                                  double *fwd_s, double *bwd_s);
/* Enumerates, sizes and times every layout of the space (NULL: all); *out (dsk_plan_results_free)
   sorted: the fitting ones fastest first, then the others smallest first; each `why` filled. */
DSK_API dsk_status dsk_plan_run(const dsk_plan_model *m, const dsk_plan_cluster *c, const dsk_plan_job *job,
                                const dsk_plan_space *space, dsk_plan_result **out, int *n);
DSK_API void dsk_plan_results_free(dsk_plan_result *r);

/* ---- output */

/* "tp2 pp4 1f1b m16 ep8 dp16 zero1 recompute none moments f32" (then " fp8" for an FP8 layout) */
DSK_API void dsk_plan_layout_str(const dsk_plan_layout *l, char *buf, size_t cap);
/* The best `top` layouts as a text table (memory by role in GB, step time and its parts; a
   layout with bf16 moments left out when its f32 twin fits), then the best of each other kind
   with why it lost; when nothing fits, the smallest memory any layout needs against each GPU's.
   DSK_ERR_ARG when cap is too small. */
DSK_API dsk_status dsk_plan_table(const dsk_plan_result *r, int n, const dsk_plan_cluster *c, int top, char *buf,
                                  size_t cap);
/* One result as a flat JSON object: the layout and the job (what train_moe --plan reads), then
   the predicted memory and time. */
DSK_API dsk_status dsk_plan_json(const dsk_plan_result *r, const dsk_plan_job *job, char *buf, size_t cap);
/* Reads dsk_plan_json's object back: the layout and the job (the predictions are checked for
   being numbers and otherwise ignored; "fp8" may be left out: 0). A missing or malformed field
   fails naming it. */
DSK_API dsk_status dsk_plan_choice_parse(const char *json, size_t n, const char *what, dsk_plan_layout *l,
                                         dsk_plan_job *job);
DSK_API dsk_status dsk_plan_choice_read(const char *path, dsk_plan_layout *l, dsk_plan_job *job);

#ifdef __cplusplus
}
#endif
DSK__FP_EXACT_END
#endif /* DSK_PLAN_H */

#ifdef DSK_PLAN_IMPLEMENTATION
#ifndef DSK_PLAN_IMPLEMENTATION_DONE
#define DSK_PLAN_IMPLEMENTATION_DONE
DSK__FP_EXACT_BEGIN
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- JSON fields */

/* A flat JSON object of string and number values, read field by field. */
typedef struct dsk__plan_field {
    char key[32];
    int is_str;
    char str[64];
    double num;
} dsk__plan_field;

static const char *dsk__plan_ws(const char *p, const char *e) {
    while (p < e && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++;
    return p;
}

/* A JSON string without escapes into out (cap bytes); returns the position after it or NULL. */
static const char *dsk__plan_str(const char *p, const char *e, char *out, size_t cap) {
    size_t n = 0;
    if (p >= e || *p != '"') return NULL;
    for (p++; p < e && *p != '"'; p++) {
        if (*p == '\\' || (unsigned char)*p < 0x20 || n + 1 >= cap) return NULL;
        out[n++] = *p;
    }
    out[n] = 0;
    return p < e ? p + 1 : NULL;
}

static dsk_status dsk__plan_fields(const char *json, size_t len, const char *what, dsk__plan_field *f, int cap,
                                   int *nf) {
    const char *p = json, *e = json + len;
    int n = 0;
    p = dsk__plan_ws(p, e);
    if (p >= e || *p != '{') return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan: %s: not a JSON object", what);
    p = dsk__plan_ws(p + 1, e);
    while (p < e && *p != '}') {
        char *end;
        if (n == cap) return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan: %s: more than %d fields", what, cap);
        memset(&f[n], 0, sizeof f[n]);
        if (!(p = dsk__plan_str(p, e, f[n].key, sizeof f[n].key)))
            return dsk_set_error(DSK_ERR_CORRUPT,
                                 "dsk_plan: %s: field %d: a key of at most 31 characters "
                                 "in quotes expected",
                                 what, n + 1);
        p = dsk__plan_ws(p, e);
        if (p >= e || *p != ':')
            return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan: %s: \"%s\": ':' expected", what, f[n].key);
        p = dsk__plan_ws(p + 1, e);
        if (p < e && *p == '"') {
            f[n].is_str = 1;
            if (!(p = dsk__plan_str(p, e, f[n].str, sizeof f[n].str)))
                return dsk_set_error(DSK_ERR_CORRUPT,
                                     "dsk_plan: %s: \"%s\": a string of at most 63 "
                                     "characters without escapes expected",
                                     what, f[n].key);
        } else {
            char tmp[64];
            size_t k = 0;
            while (p + k < e && k < sizeof tmp - 1 && strchr("+-.0123456789eE", p[k])) k++;
            memcpy(tmp, p, k);
            tmp[k] = 0;
            f[n].num = strtod(tmp, &end);
            if (k == 0 || *end != 0 || !isfinite(f[n].num))
                return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan: %s: \"%s\": a number expected", what, f[n].key);
            p += k;
        }
        for (int i = 0; i < n; i++)
            if (!strcmp(f[i].key, f[n].key))
                return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan: %s: \"%s\" given twice", what, f[n].key);
        n++;
        p = dsk__plan_ws(p, e);
        if (p < e && *p == ',') p = dsk__plan_ws(p + 1, e);
        else if (p >= e || *p != '}')
            return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan: %s: ',' or '}' expected after \"%s\"", what, f[n - 1].key);
    }
    if (p >= e || dsk__plan_ws(p + 1, e) != e)
        return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan: %s: the object does not end with '}'", what);
    *nf = n;
    return DSK_OK;
}

/* ---------------------------------------------------------------- cluster */

typedef struct dsk__plan_key {
    const char *key;
    size_t off;
    int kind;   /* 0 double > 0, 1 int >= 1, 2 string, 3 double >= 0, 4 int >= 0 */
    int needed; /* 0: optional */
} dsk__plan_key;

static const dsk__plan_key dsk__plan_keys[] = {
    {"name", offsetof(dsk_plan_cluster, name), 2, 1},
    {"nodes", offsetof(dsk_plan_cluster, nodes), 1, 1},
    {"gpus_per_node", offsetof(dsk_plan_cluster, gpus_per_node), 1, 1},
    {"memory_gb", offsetof(dsk_plan_cluster, memory_gb), 0, 1},
    {"bf16_tflops", offsetof(dsk_plan_cluster, bf16_tflops), 0, 1},
    {"fp8_tflops", offsetof(dsk_plan_cluster, fp8_tflops), 0, 1},
    {"intra_node_gbps", offsetof(dsk_plan_cluster, intra_gbps), 0, 1},
    {"inter_node_gbps", offsetof(dsk_plan_cluster, inter_gbps), 0, 1},
    {"intra_node_latency_us", offsetof(dsk_plan_cluster, intra_latency_us), 3, 1},
    {"inter_node_latency_us", offsetof(dsk_plan_cluster, inter_latency_us), 3, 1},
    {"efficiency", offsetof(dsk_plan_cluster, efficiency), 0, 0},
    {"overlap", offsetof(dsk_plan_cluster, overlap), 3, 0},
    {"reserve_gb", offsetof(dsk_plan_cluster, reserve_gb), 3, 0},
    {"cores_per_node", offsetof(dsk_plan_cluster, cores_per_node), 4, 0},
    {"memory_gbps", offsetof(dsk_plan_cluster, memory_gbps), 3, 0},
    {"link_wait", offsetof(dsk_plan_cluster, link_wait), 4, 0},
};
#define DSK__PLAN_NKEYS (int)(sizeof dsk__plan_keys / sizeof dsk__plan_keys[0])

static dsk_status dsk__plan_set(dsk_plan_cluster *c, const dsk__plan_key *k, const dsk__plan_field *f,
                                const char *what) {
    char *at = (char *)c + k->off;
    if ((k->kind == 2) != (f->is_str != 0))
        return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan_cluster_parse: %s: \"%s\" must be a %s", what, k->key,
                             k->kind == 2 ? "string" : "number");
    if (k->kind == 2) {
        snprintf(at, sizeof c->name, "%s", f->str);
        return DSK_OK;
    }
    if (k->kind == 1 || k->kind == 4) {
        int lo = k->kind == 1;
        if (f->num < lo || f->num > 1e6 || f->num != floor(f->num))
            return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan_cluster_parse: %s: \"%s\" is %g: a whole number >= %d",
                                 what, k->key, f->num, lo);
        *(int *)at = (int)f->num;
        return DSK_OK;
    }
    if (k->kind == 0 ? !(f->num > 0) : !(f->num >= 0))
        return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan_cluster_parse: %s: \"%s\" is %g: must be %s", what, k->key,
                             f->num, k->kind == 0 ? "> 0" : ">= 0");
    *(double *)at = f->num;
    return DSK_OK;
}

DSK_API dsk_status dsk_plan_cluster_parse(dsk_plan_cluster *c, const char *json, size_t n, const char *what) {
    dsk__plan_field f[2 * DSK__PLAN_NKEYS];
    dsk_plan_cluster out;
    int nf = 0;
    if (!what) what = "cluster";
    if (!c || !json) return dsk_set_error(DSK_ERR_ARG, "dsk_plan_cluster_parse: %s: cluster or text is NULL", what);
    DSK__TRY(dsk__plan_fields(json, n, what, f, 2 * DSK__PLAN_NKEYS, &nf));
    memset(&out, 0, sizeof out);
    out.efficiency = 0.4;
    out.overlap = 0.8;
    for (int i = 0; i < nf; i++) {
        int k = 0;
        while (k < DSK__PLAN_NKEYS && strcmp(dsk__plan_keys[k].key, f[i].key)) k++;
        if (k == DSK__PLAN_NKEYS)
            return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan_cluster_parse: %s: unknown field \"%s\"", what, f[i].key);
        DSK__TRY(dsk__plan_set(&out, &dsk__plan_keys[k], &f[i], what));
    }
    for (int k = 0; k < DSK__PLAN_NKEYS; k++) {
        int given = 0;
        for (int i = 0; i < nf; i++) given |= !strcmp(dsk__plan_keys[k].key, f[i].key);
        if (dsk__plan_keys[k].needed && !given)
            return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan_cluster_parse: %s: missing field \"%s\"", what,
                                 dsk__plan_keys[k].key);
    }
    if (out.efficiency > 1 || out.overlap > 1)
        return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan_cluster_parse: %s: efficiency %g and overlap %g must be <= 1",
                             what, out.efficiency, out.overlap);
    if (out.link_wait > 1)
        return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan_cluster_parse: %s: \"link_wait\" is %d: 0 or 1", what,
                             out.link_wait);
    *c = out;
    return DSK_OK;
}

/* A small file whole into buf (cap bytes, at most cap - 1 of file); *n its length. fn names the caller. */
static dsk_status dsk__plan_read_small(const char *fn, const char *path, char *buf, size_t cap, size_t *n) {
    FILE *f;
    if (!path) return dsk_set_error(DSK_ERR_ARG, "%s: path is NULL", fn);
    if (!(f = fopen(path, "rb"))) return dsk_set_error(DSK_ERR_IO, "%s: cannot open %s", fn, path);
    *n = fread(buf, 1, cap, f);
    fclose(f);
    if (*n == cap) return dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: over %zu KiB", fn, path, cap / 1024);
    return DSK_OK;
}

DSK_API dsk_status dsk_plan_cluster_read(dsk_plan_cluster *c, const char *path) {
    char buf[8192];
    size_t n;
    DSK__TRY(dsk__plan_read_small("dsk_plan_cluster_read", path, buf, sizeof buf, &n));
    return dsk_plan_cluster_parse(c, buf, n, path);
}

/* ---------------------------------------------------------------- time model */

/* Seconds of `msgs` messages moving `bytes` per rank in total over a group of n ranks that spans
   `span` consecutive ranks of the world (in a node when span <= gpus_per_node). */
static double dsk__plan_link(const dsk_plan_cluster *c, int span, double bytes, double msgs) {
    int intra = span <= c->gpus_per_node;
    double bw = 1e9 * (intra ? c->intra_gbps : c->inter_gbps);
    double lat = 1e-6 * (intra ? c->intra_latency_us : c->inter_latency_us);
    return bytes / bw + msgs * lat;
}

/* Ranks sharing cores (a node runs more ranks than cluster.cores_per_node). A core runs one rank at
   a time, and a waiting rank gives its core away (on such a node dsk_comm's host backend never spins:
   it yields, then sleeps in poll()), so a bubble or a wait costs nothing while another rank has work.
   Each rank's busy work W is its compute and its communication: on the host backend every byte is
   copied by the ranks' CPUs (into the shared-memory ring and out, the reduction's fold, the system
   calls that wake a sleeper), so all of it is CPU work, hidden under backward or not. The node's
   cores run the R ranks' R W (the node's ranks taken alike, the modelled rank's W for each, its
   compute the stages' mean `compute_s`) at most `cores` at a time: step >= R W / cores. On a link whose
   time is a wait (cluster.link_wait: a network card moves the bytes, or dsk_comm's emulated link sleeps
   them out) W is compute and the optimizer alone; the copies under it are small beside the link's time. And no rank
   ends before its own chain of dependences, the one-device-per-rank step: step >= that. The step is
   the larger bound (work-bound when the cores never idle, path-bound when they do); r->cores_s is what
   it adds to the one-device-per-rank step. */
static void dsk__plan_shared_cores(const dsk_plan_cluster *c, int world, double compute_s, dsk_plan_result *r) {
    int ranks = world < c->gpus_per_node ? world : c->gpus_per_node;
    double comm_s = c->link_wait ? 0 : r->tp_s + r->ep_s + r->pp_s + r->zero_s;
    double work = ranks * (compute_s + comm_s + r->opt_s);
    r->cores_s = 0;
    if (c->cores_per_node > 0 && ranks > c->cores_per_node && work / c->cores_per_node > r->step_s)
        r->cores_s = work / c->cores_per_node - r->step_s;
    r->step_s += r->cores_s;
}

/* Seconds of `share` ranks computing f's FLOPs for the job's tokens (with l's recomputation; FP8's GEMMs at the
   fp8 peak). */
static double dsk__plan_compute_s(const dsk_plan_cluster *c, const dsk_plan_job *job, const dsk_plan_layout *l,
                                  const dsk_plan_flops *f, int share) {
    double tokens = (double)job->sequences * (double)job->seq, peak = 1e12 * c->bf16_tflops * c->efficiency;
    double flops = f->total, s;
    if (l->recompute == DSK_PLAN_RECOMPUTE_FULL) flops += f->total / 3;
    if (l->recompute == DSK_PLAN_RECOMPUTE_ATTN) flops += f->attn / 3;
    s = tokens * flops / (share * peak);
    if (l->fp8) /* the FP8 GEMMs' share (a full recomputation reruns their forward) at the fp8 peak */
        s -= tokens * f->fp8 * (l->recompute == DSK_PLAN_RECOMPUTE_FULL ? 4.0 / 3 : 1) *
             (1 - c->bf16_tflops / c->fp8_tflops) / (share * peak);
    return s;
}

/* Of a pair's exchanges, how many travel while the other stream computes (the trainer's count, train/par_run.h's
   tp_pair_run): the backward (Lb MoE layers, 2 Lb exchanges: dispatch and return) leads, the forward (Lf) follows,
   and each exchange begun travels beside the other stream's next part, so the shorter stream's 2 min(Lf, Lb) and
   as many of the longer's, and one more when the backward is the longer (the forward's last part). A chunk's
   forward paired with its own backward (1F1B and interleaved) meets it in one layer, where one call ends before
   the other begins: 4 L - 2 of 4 L (the trainer's counts: 10 of 12 at L = 3, 2 of 4 at L = 1). Fractional L (the
   stages' mean): the same rule at the mean, a one-chunk pair at L < 1 half of 4 L. */
static double dsk__plan_pair_exchanges(double Lf, double Lb, int one_chunk) {
    double lo = Lf < Lb ? Lf : Lb;
    if (one_chunk) return Lf >= 1 ? 4 * Lf - 2 : 2 * Lf;
    return 4 * lo + (Lb > Lf && Lb - Lf >= 1 ? 1 : 0);
}

/* Of the expert exchanges' ep_s, what a paired layout hides beside the other micro-batch of each pair:
   pipeline rank 0's paired list (the most warm-up; one stage: its micro-batches) walked pair by pair, each
   pair's travelling exchanges (dsk__plan_pair_exchanges) over the 4 m L its chunks' L MoE layers exchange in a
   step, what the trainer logs (tests/test_plan.sh). L: rank 0's chunks' own counts (the callback's), else
   lead_moe over its v chunks alike, else (lead_moe 0: unknown, or rank 0 holds only dense blocks and is no proxy
   for the stages that pair) the model's over p v. Hidden is at most the compute of the pairs beside it. */
static dsk_status dsk__plan_pair_hidden(const dsk_plan_model *m, const dsk_plan_layout *l, int lead_moe,
                                        const int *chunk_moe, double ep_s, double compute_s, double *hidden) {
    int p = l->pp, v = l->vstages > 0 ? l->vstages : 1, pairs = 0, counted = 0;
    double L[DSK_PLAN_MAX_CHUNKS], all = 0, paired = 0;
    dsk_par_schedule s;
    *hidden = 0;
    if (!l->paired || l->ep < 2 || v > DSK_PLAN_MAX_CHUNKS) return DSK_OK;
    for (int c = 0; c < v; c++) counted += chunk_moe[c];
    for (int c = 0; c < v; c++) {
        L[c] = lead_moe > 0 && counted == lead_moe ? chunk_moe[c]
               : lead_moe > 0                      ? (double)lead_moe / v
                                                   : (double)m->moe_layers / (p * v);
        all += 4.0 * l->micro * L[c];
    }
    if (!(all > 0)) return DSK_OK;
    DSK__TRY(dsk_par_schedule_init_paired(&s, l->schedule, p, l->micro, v, 0));
    for (int i = 0; i < s.n; i++) {
        const dsk_par_action *a = &s.actions[i];
        if (a->kind != DSK_PAR_FORWARD_BACKWARD) continue;
        pairs++;
        paired += dsk__plan_pair_exchanges(L[a->chunk], L[a->bwd_chunk], a->chunk == a->bwd_chunk);
    }
    dsk_par_schedule_free(&s);
    *hidden = ep_s * paired / all;
    if (*hidden > compute_s * pairs / (l->micro * v)) *hidden = compute_s * pairs / (l->micro * v);
    return DSK_OK;
}

/* The expert exchanges of a rank holding L MoE layers per step: dispatch and combine, forward and backward, each
   of the rank's tokens of a micro-batch (over tp) K times in each layer, every micro-batch. */
static double dsk__plan_ep_s(const dsk_plan_model *m, const dsk_plan_cluster *c, const dsk_plan_job *job,
                             const dsk_plan_layout *l, double L) {
    double Nm = (double)job->seq * (double)job->sequences / (l->dp * (double)l->micro); /* tokens per micro-batch */
    if (l->ep < 2) return 0;
    return l->micro *
           dsk__plan_link(c, l->ep * l->tp,
                          4.0 * L * (l->ep - 1.0) / l->ep * Nm / l->tp * m->top_k * (double)m->d_model * m->act_bytes,
                          4.0 * L);
}

/* Whether the callback counted the stages' MoE layers (some stage has one). */
static int dsk__plan_moe_counted(const dsk_plan_flops *stages, int p) {
    for (int s = 0; s < p; s++)
        if (stages[s].moe_layers > 0) return 1;
    return 0;
}

/* The MoE layers whose exchanges stage s pays: its own, or the stages' mean where none counts them (counted 0). */
static double dsk__plan_layers_of(const dsk_plan_model *m, const dsk_plan_layout *l, const dsk_plan_flops *stage,
                                  int counted) {
    return counted || m->moe_layers == 0 ? (double)stage->moe_layers : (double)m->moe_layers / l->pp;
}

/* Seconds of stage f's forward passes: a third of its FLOPs without recomputation, and half its exchanges and
   collectives (comm_s). */
static double dsk__plan_forward_s(const dsk_plan_cluster *c, const dsk_plan_job *job, const dsk_plan_layout *l,
                                  const dsk_plan_flops *f, double comm_s) {
    dsk_plan_layout plain = *l;
    plain.recompute = DSK_PLAN_RECOMPUTE_NONE;
    return dsk__plan_compute_s(c, job, &plain, f, l->tp * l->dp) / 3 + comm_s / 2;
}

/* Seconds of a rank's tensor-parallel collectives per step (a ring's share of each kind's bytes, a latency a call). */
static double dsk__plan_tp_s(const dsk_plan_cluster *c, const dsk_plan_layout *l, const dsk_plan_tp *tp) {
    double n = l->tp;
    if (!tp || l->tp < 2) return 0;
    return dsk__plan_link(c, l->tp, (n - 1) / n * (2 * tp->all_reduce + tp->all_gather + tp->reduce_scatter),
                          tp->calls);
}

DSK_API void dsk_plan_stage_times(const dsk_plan_model *m, const dsk_plan_cluster *c, const dsk_plan_job *job,
                                  const dsk_plan_layout *l, const dsk_plan_tp *tp, const dsk_plan_flops *stages,
                                  double *fwd_s, double *bwd_s) {
    int p = l->pp, v = l->vstages > 0 ? l->vstages : 1, counted = dsk__plan_moe_counted(stages, p);
    double mv = (double)l->micro * v, tp_s = dsk__plan_tp_s(c, l, tp);
    for (int s = 0; s < p; s++) {
        double comm = dsk__plan_ep_s(m, c, job, l, dsk__plan_layers_of(m, l, &stages[s], counted)) + tp_s;
        double busy = dsk__plan_compute_s(c, job, l, &stages[s], l->tp * l->dp) + comm;
        double f = dsk__plan_forward_s(c, job, l, &stages[s], comm);
        for (int k = 0; k < v; k++) { /* each of the rank's chunks alike, at its global stage */
            fwd_s[dsk_par_stage(l->schedule, p, k, s)] = f / mv;
            bwd_s[dsk_par_stage(l->schedule, p, k, s)] = (busy - f) / mv;
        }
    }
}

DSK_API dsk_par_transfers dsk_plan_transfers(const dsk_plan_cluster *c, double message_bytes) {
    return c && c->cores_per_node > 0 && message_bytes <= (double)dsk_comm_host_ring_room(c->gpus_per_node)
               ? DSK_PAR_TRANSFERS_AHEAD
               : DSK_PAR_TRANSFERS_IN_ORDER;
}

DSK_API dsk_status dsk_plan_stages(const dsk_plan_model *m, const dsk_plan_cluster *c, const dsk_plan_job *job,
                                   const dsk_plan_flops *stages, dsk_plan_result *r) {
    const dsk_plan_layout *l = &r->layout;
    int p = l->pp, v = l->vstages > 0 ? l->vstages : 1, pace = 0;
    double *fwd, *bwd;
    dsk_status st;
    memset(&r->stage_flops, 0, sizeof r->stage_flops);
    r->pipe_s = 0;
    if (p <= 1) return DSK_OK;
    fwd = (double *)DSK_MALLOC((size_t)2 * p * v * sizeof *fwd);
    if (!fwd) return dsk_set_error(DSK_ERR_OOM, "dsk_plan_stages: %d stages' times", p * v);
    bwd = fwd + p * v;
    dsk_plan_stage_times(m, c, job, l, &r->tp, stages, fwd, bwd);
    for (int s = 0; s < p; s++)
        if (fwd[s] + bwd[s] > fwd[pace] + bwd[pace]) pace = s;
    r->stage_flops = stages[pace];
    if (!dsk__plan_moe_counted(stages, p) && m->moe_layers > 0)
        r->stage_flops.moe_layers = -1; /* every stage's exchanges the mean's */
    /* the sends' time is r->pp_s, apart */
    /* a message: the stage's sends over its micro-batch chunks (a bound: a middle stage sends both ways) */
    st = dsk_par_schedule_time(l->schedule, p, l->micro, v, l->paired,
                               dsk_plan_transfers(c, r->pp_bytes / ((double)l->micro * v)), fwd, bwd, 0.0, &r->pipe_s);
    DSK_FREE(fwd);
    return st;
}

/* The MoE layers of the stage that keeps a pipeline's pace (r->stage_flops), or the stages' mean where the
   callback does not count them (-1) or there is no pipeline. */
static double dsk__plan_stage_moe(const dsk_plan_model *m, const dsk_plan_result *r) {
    const dsk_plan_layout *l = &r->layout;
    return l->pp > 1 && r->stage_flops.total > 0 && r->stage_flops.moe_layers >= 0 ? r->stage_flops.moe_layers
                                                                                   : (double)m->moe_layers / l->pp;
}

DSK_API dsk_status dsk_plan_time(const dsk_plan_model *m, const dsk_plan_cluster *c, const dsk_plan_job *job,
                                 double grad_link_bytes, dsk_plan_result *r) {
    const dsk_plan_layout *l = &r->layout;
    int world = l->tp * l->pp * l->dp;
    dsk_plan_flops model;
    memset(&model, 0, sizeof model);
    model.total = m->flops_per_token;
    model.attn = m->attn_flops_per_token;
    model.fp8 = m->fp8_flops_per_token;
    model.moe_layers = m->moe_layers;
    double mean_s = dsk__plan_compute_s(c, job, l, &model, world); /* the stages' mean */
    double busy_s;
    if (l->pp > 1 && !(r->pipe_s > 0))
        return dsk_set_error(DSK_ERR_ARG,
                             "dsk_plan_time: a pipeline of %d stages without its stages' times "
                             "(dsk_plan_stages first)",
                             l->pp);
    /* a pipeline keeps its slowest stage's pace (dsk_plan_stages picks it) */
    r->compute_s = l->pp > 1 ? dsk__plan_compute_s(c, job, l, &r->stage_flops, l->tp * l->dp) : mean_s;
    r->tp_s = dsk__plan_tp_s(c, l, &r->tp);
    r->ep_s = dsk__plan_ep_s(m, c, job, l, dsk__plan_stage_moe(m, r));
    /* what the schedule adds to the pace stage's busy time (its own bubble and its waits on the others) */
    busy_s = r->compute_s + r->ep_s + r->tp_s;
    r->bubble_s = l->pp > 1 && r->pipe_s > busy_s ? r->pipe_s - busy_s : 0;
    DSK__TRY(dsk__plan_pair_hidden(m, l, r->lead_moe_layers, r->lead_chunk_moe_layers, r->ep_s, r->compute_s,
                                   &r->ep_hidden_s));
    r->pp_s = l->pp > 1 ? dsk__plan_link(c, l->tp * l->dp + 1, r->pp_bytes, 2.0 * l->micro * l->vstages) : 0;
    r->zero_s = grad_link_bytes > 0 ? dsk__plan_link(c, l->dp * l->tp, grad_link_bytes, 0) : 0;
    /* the reductions run beside the backward of the passes that reduce: ZeRO 0-1 the step's last micro-batch's */
    r->zero_exposed_s = r->zero_s - c->overlap * (2.0 / 3.0) * r->compute_s / (l->zero <= 1 ? l->micro : 1);
    if (r->zero_exposed_s < 0) r->zero_exposed_s = 0;
    /* AdamW after the reductions: memory-bound, nothing beside it */
    r->opt_s = c->memory_gbps > 0 ? (double)r->mem.optimizer_step / (1e9 * c->memory_gbps) : 0;
    r->step_s =
        r->compute_s + r->bubble_s + r->tp_s + r->ep_s - r->ep_hidden_s + r->pp_s + r->zero_exposed_s + r->opt_s;
    dsk__plan_shared_cores(c, world, mean_s, r);
    return DSK_OK;
}

/* ---------------------------------------------------------------- enumeration and ranking */

typedef struct dsk__plan_list {
    dsk_plan_result *r;
    int n, cap;
} dsk__plan_list;

static dsk_status dsk__plan_push(dsk__plan_list *L, const dsk_plan_result *r) {
    if (L->n == L->cap) {
        int cap = L->cap ? 2 * L->cap : 256;
        dsk_plan_result *p = (dsk_plan_result *)DSK_MALLOC((size_t)cap * sizeof *p);
        if (!p) return dsk_set_error(DSK_ERR_OOM, "dsk_plan_run: %d results", cap);
        if (L->n) memcpy(p, L->r, (size_t)L->n * sizeof *p);
        DSK_FREE(L->r);
        L->r = p;
        L->cap = cap;
    }
    L->r[L->n++] = *r;
    return DSK_OK;
}

/* What a rank's tensor-parallel collectives hand over per step, all kinds. */
static double dsk__plan_tp_total(const dsk_plan_tp *tp) { return tp->all_reduce + tp->all_gather + tp->reduce_scatter; }

/* Sizes (the worst stage) and times one layout. */
static dsk_status dsk__plan_eval(const dsk_plan_model *m, const dsk_plan_cluster *c, const dsk_plan_job *job,
                                 dsk_plan_result *r) {
    double red = 0, gat = 0, link = 0;
    dsk_plan_flops *stages = (dsk_plan_flops *)DSK_MALLOC((size_t)r->layout.pp * sizeof *stages);
    dsk_status st = DSK_OK;
    if (!stages) return dsk_set_error(DSK_ERR_OOM, "dsk_plan_run: %d stages' FLOPs", r->layout.pp);
    r->total = -1;
    r->pp_bytes = 0;
    memset(&r->tp, 0, sizeof r->tp);
    memset(&r->stage_flops, 0, sizeof r->stage_flops);
    for (int s = 0; s < r->layout.pp; s++) {
        dsk_plan_memory mem;
        dsk_plan_tp tp;
        dsk_plan_flops fl;
        double rb = 0, gb = 0, lb = 0, sb = 0;
        int64_t tot;
        memset(&mem, 0, sizeof mem);
        memset(&tp, 0, sizeof tp);
        memset(&fl, 0, sizeof fl);
        if ((st = m->memory(m->user, &r->layout, job, s, &mem, &rb, &gb, &lb, &sb, &tp, &fl)) != DSK_OK) break;
        if (sb > r->pp_bytes) r->pp_bytes = sb;
        stages[s] = fl;
        if (s == 0) {
            r->lead_moe_layers = fl.moe_layers;
            memcpy(r->lead_chunk_moe_layers, fl.chunk_moe_layers, sizeof r->lead_chunk_moe_layers);
        }
        if (dsk__plan_tp_total(&tp) > dsk__plan_tp_total(&r->tp)) r->tp = tp;
        tot = mem.params + mem.grads + mem.optimizer + mem.comm + mem.activations;
        if (tot > r->total) {
            r->total = tot;
            r->mem = mem;
            r->worst_stage = s;
        }
        if (rb + gb > red + gat) {
            red = rb;
            gat = gb;
            link = lb;
        }
    }
    if (st == DSK_OK) st = dsk_plan_stages(m, c, job, stages, r);
    DSK_FREE(stages);
    if (st != DSK_OK) return st;
    r->fits = (double)r->total <= 1e9 * (c->memory_gb - c->reserve_gb);
    return dsk_plan_time(m, c, job, link, r);
}

static int dsk__plan_ok(int want, int v) { return want == 0 || want == v; }

/* Every layout of one (tp, pp, dp, ep): ZeRO stages, recomputation, schedules. */
static dsk_status dsk__plan_grid(const dsk_plan_model *m, const dsk_plan_cluster *c, const dsk_plan_job *job,
                                 const dsk_plan_space *sp, int tp, int pp, int dp, int ep, dsk__plan_list *L) {
    int64_t per = job->sequences / dp;
    for (int sch = 0; sch <= (int)DSK_PAR_DUALPIPE_V; sch++) {
        dsk_plan_result r;
        memset(&r, 0, sizeof r);
        r.layout.tp = tp;
        r.layout.pp = pp;
        r.layout.dp = dp;
        r.layout.ep = ep;
        r.layout.micro = (int)per;
        r.layout.vstages = sch == DSK_PAR_INTERLEAVED || sch == DSK_PAR_DUALPIPE_V ? 2 : 1;
        r.layout.schedule = (dsk_par_schedule_kind)sch;
        if (pp == 1 && sch != DSK_PAR_1F1B) continue; /* no pipeline: one entry */
        if (!dsk__plan_ok(sp->schedule_plus1, sch + 1) && pp > 1) continue;
        if (sch == DSK_PAR_INTERLEAVED && (per % pp || m->layers < 2 * pp)) continue;
        if (sch == DSK_PAR_DUALPIPE_V && (per < 2 * pp || m->layers < 2 * pp)) continue;
        for (int k = 0; k < 96; k++) { /* ZeRO stage, recomputation, the moments' dtype, FP8, paired */
            int z = k / 6 % 4, rc = k / 2 % 3, f8 = k / 24 % 2, pair = k / 48;
            dsk_dtype md = k % 2 ? DSK_BF16 : DSK_F32;
            dsk_status st;
            if (!dsk__plan_ok(sp->zero_plus1, z + 1) || !dsk__plan_ok(sp->recompute_plus1, rc + 1) ||
                !dsk__plan_ok(sp->moments_plus1, (int)md + 1) || !dsk__plan_ok(sp->fp8_plus1, f8 + 1) ||
                !dsk__plan_ok(sp->paired_plus1, pair + 1) || (f8 && !(m->fp8_flops_per_token > 0)))
                continue;
            if (pair && (ep < 2 || per < 2 || sch == DSK_PAR_GPIPE || z == 3 || rc == DSK_PLAN_RECOMPUTE_FULL))
                continue; /* what the trainer pairs (examples/train/refuse.h) */
            r.layout.paired = pair;
            r.layout.fp8 = f8;
            r.layout.zero = z;
            r.layout.recompute = (dsk_plan_recompute)rc;
            r.layout.moments = md;
            st = dsk__plan_eval(m, c, job, &r);
            if (st == DSK_ERR_UNSUPPORTED) continue; /* the trainer refuses this layout */
            DSK__TRY(st);
            DSK__TRY(dsk__plan_push(L, &r));
        }
    }
    return DSK_OK;
}

static int dsk__plan_cmp(const void *a, const void *b) {
    const dsk_plan_result *x = (const dsk_plan_result *)a, *y = (const dsk_plan_result *)b;
    if (x->fits != y->fits) return y->fits - x->fits;
    if (x->fits && x->step_s != y->step_s) return x->step_s < y->step_s ? -1 : 1;
    if (x->fits && x->layout.moments != y->layout.moments) /* a tie: f32 moments first (no rounding) */
        return x->layout.moments == DSK_F32 ? -1 : 1;
    return x->total < y->total ? -1 : x->total > y->total;
}

/* The expert-parallel comm r's step waits for. */
static double dsk__plan_ep_exposed(const dsk_plan_result *r) { return r->ep_s - r->ep_hidden_s; }

/* Its exposed communication's share of r's step, in percent. */
static double dsk__plan_comm_pct(const dsk_plan_result *r) {
    return 100 * (r->tp_s + dsk__plan_ep_exposed(r) + r->pp_s + r->zero_exposed_s) / r->step_s;
}

/* Why r lost to the best: does not fit, or the part of its step that grew most. */
static void dsk__plan_why(const dsk_plan_result *best, dsk_plan_result *r, const dsk_plan_cluster *c) {
    const char *names[8] = {"compute (recomputation, busiest stage)",
                            "pipeline bubble",
                            "tensor-parallel comm",
                            "expert-parallel comm",
                            "pipeline sends",
                            "exposed gradient comm",
                            "shared cores",
                            "optimizer step"};
    double d[8] = {r->compute_s - best->compute_s, r->bubble_s - best->bubble_s,
                   r->tp_s - best->tp_s,           dsk__plan_ep_exposed(r) - dsk__plan_ep_exposed(best),
                   r->pp_s - best->pp_s,           r->zero_exposed_s - best->zero_exposed_s,
                   r->cores_s - best->cores_s,     r->opt_s - best->opt_s};
    int k = 0;
    if (r == best && r->fits) {
        r->why[0] = 0;
        return;
    }
    if (!r->fits) {
        snprintf(r->why, sizeof r->why, "does not fit: %.4g GB of %.4g GB (stage %d)", (double)r->total / 1e9,
                 c->memory_gb - c->reserve_gb, r->worst_stage);
        return;
    }
    for (int i = 1; i < 8; i++)
        if (d[i] > d[k]) k = i;
    snprintf(r->why, sizeof r->why, "%.1f%% slower: %s +%.3g s (bubble %.1f%%, comm %.1f%% of its step)",
             100 * (r->step_s / best->step_s - 1), names[k], d[k], 100 * r->bubble_s / r->step_s,
             dsk__plan_comm_pct(r));
}

static int dsk__plan_divides(int64_t a, int64_t b) { return a > 0 && b % a == 0; }

DSK_API dsk_status dsk_plan_run(const dsk_plan_model *m, const dsk_plan_cluster *c, const dsk_plan_job *job,
                                const dsk_plan_space *space, dsk_plan_result **out, int *n) {
    dsk_plan_space all;
    dsk__plan_list L;
    int world;
    dsk_status st = DSK_OK;
    if (!m || !c || !job || !out || !n || !m->memory)
        return dsk_set_error(DSK_ERR_ARG, "dsk_plan_run: model, its memory callback, cluster, job, out and n needed");
    if (job->sequences < 1 || job->seq < 1)
        return dsk_set_error(DSK_ERR_ARG, "dsk_plan_run: %lld sequences of %lld tokens", (long long)job->sequences,
                             (long long)job->seq);
    memset(&all, 0, sizeof all);
    if (!space) space = &all;
    memset(&L, 0, sizeof L);
    world = c->nodes * c->gpus_per_node;
    for (int tp = 1; tp <= 8 && tp <= c->gpus_per_node && st == DSK_OK; tp *= 2) {
        if (!dsk__plan_ok(space->tp, tp) || world % tp || !dsk__plan_divides(tp, m->heads) ||
            !dsk__plan_divides(tp, m->vocab) || !dsk__plan_divides(tp, m->ffn_hidden))
            continue;
        for (int pp = 1; pp <= world / tp && pp <= m->layers && st == DSK_OK; pp++) {
            int dp = world / tp / pp;
            if (!dsk__plan_ok(space->pp, pp) || (world / tp) % pp || job->sequences % dp) continue;
            for (int ep = 1; ep <= dp && st == DSK_OK; ep++)
                if (dsk__plan_ok(space->ep, ep) && dp % ep == 0 && (m->n_routed ? m->n_routed % ep == 0 : ep == 1))
                    st = dsk__plan_grid(m, c, job, space, tp, pp, dp, ep, &L);
        }
    }
    if (st == DSK_OK && L.n == 0)
        st = dsk_set_error(DSK_ERR_ARG,
                           "dsk_plan_run: no layout of %d GPUs splits %lld sequences and the model's "
                           "heads, experts and layers",
                           world, (long long)job->sequences);
    if (st != DSK_OK) {
        DSK_FREE(L.r);
        return st;
    }
    qsort(L.r, (size_t)L.n, sizeof *L.r, dsk__plan_cmp);
    for (int i = 0; i < L.n; i++) dsk__plan_why(&L.r[0], &L.r[i], c);
    *out = L.r;
    *n = L.n;
    return DSK_OK;
}

DSK_API void dsk_plan_results_free(dsk_plan_result *r) { DSK_FREE(r); }

/* ---------------------------------------------------------------- output */

static const char *const dsk__plan_rc_names[3] = {"none", "attn", "full"};

DSK_API void dsk_plan_layout_str(const dsk_plan_layout *l, char *buf, size_t cap) {
    char pipe[48] = "";
    if (l->pp > 1)
        snprintf(pipe, sizeof pipe, " %s%s m%d", dsk_par_schedule_name(l->schedule),
                 l->vstages > 1 ? (l->vstages == 2 ? " v2" : " v?") : "", l->micro);
    else if (l->micro > 1) snprintf(pipe, sizeof pipe, " %s%d", l->paired ? "m" : "accum", l->micro);
    snprintf(buf, cap, "tp%d pp%d%s ep%d dp%d zero%d recompute %s moments %s%s%s", l->tp, l->pp, pipe, l->ep, l->dp,
             l->zero, dsk__plan_rc_names[l->recompute], dsk_dtype_name(l->moments), l->fp8 ? " fp8" : "",
             l->paired ? " paired" : "");
}

typedef struct dsk__plan_out {
    char *buf;
    size_t cap, n;
    int over;
} dsk__plan_out;

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static void
dsk__plan_put(dsk__plan_out *o, const char *fmt, ...) {
    va_list ap;
    int k;
    if (o->over) return;
    va_start(ap, fmt);
    k = vsnprintf(o->buf + o->n, o->cap - o->n, fmt, ap);
    va_end(ap);
    if (k < 0 || (size_t)k >= o->cap - o->n) o->over = 1;
    else o->n += (size_t)k;
}

static void dsk__plan_row(dsk__plan_out *o, const dsk_plan_result *r) {
    char s[128];
    const dsk_plan_memory *m = &r->mem;
    dsk_plan_layout_str(&r->layout, s, sizeof s);
    dsk__plan_put(o, "%-80s %6.1f %6.1f %6.1f %6.1f %6.1f %7.1f %8.0f | %8.3f %5.1f%% %5.1f%%\n", s, m->params / 1e9,
                  m->grads / 1e9, m->optimizer / 1e9, m->activations / 1e9, m->comm / 1e9, r->total / 1e9,
                  m->imbalance / 1e9, r->step_s, 100 * r->bubble_s / r->step_s, dsk__plan_comm_pct(r));
}

/* r[i] has bf16 moments and its f32 twin (the same layout otherwise) is among the first `fit` and no
   slower (the time model tells them apart only by the optimizer step's bytes): the twin needs no
   rounding of the moments. */
static int dsk__plan_twin_fits(const dsk_plan_result *r, int fit, int i) {
    dsk_plan_layout a = r[i].layout;
    if (a.moments != DSK_BF16) return 0;
    for (int j = 0; j < fit; j++) {
        const dsk_plan_layout *b = &r[j].layout;
        if (b->moments == DSK_F32 && b->tp == a.tp && b->pp == a.pp && b->dp == a.dp && b->ep == a.ep &&
            b->zero == a.zero && b->micro == a.micro && b->vstages == a.vstages && b->schedule == a.schedule &&
            b->recompute == a.recompute && b->fp8 == a.fp8 && b->paired == a.paired && r[j].step_s <= r[i].step_s)
            return 1;
    }
    return 0;
}

/* The best result of each (tp, pp, ep, zero) from r[from] on, with why it lost. */
static void dsk__plan_losers(dsk__plan_out *o, const dsk_plan_result *r, int n, int from) {
    for (int i = from; i < n; i++) {
        int seen = 0;
        char s[128];
        for (int j = 0; j < i && !seen; j++)
            seen = r[j].layout.tp == r[i].layout.tp && r[j].layout.pp == r[i].layout.pp &&
                   r[j].layout.ep == r[i].layout.ep && r[j].layout.zero == r[i].layout.zero;
        if (seen) continue;
        dsk_plan_layout_str(&r[i].layout, s, sizeof s);
        dsk__plan_put(o, "  %-80s %s\n", s, r[i].why);
    }
}

DSK_API dsk_status dsk_plan_table(const dsk_plan_result *r, int n, const dsk_plan_cluster *c, int top, char *buf,
                                  size_t cap) {
    dsk__plan_out o = {buf, cap, 0, 0};
    int fit = 0, shown = 0, end = 0;
    if (!r || n < 1 || !c || !buf || cap < 1) return dsk_set_error(DSK_ERR_ARG, "dsk_plan_table: no results or buffer");
    buf[0] = 0;
    while (fit < n && r[fit].fits) fit++;
    for (; end < fit && shown < top; end++) shown += !dsk__plan_twin_fits(r, fit, end);
    dsk__plan_put(&o, "cluster %s: %d x %d GPUs of %.4g GB (%.4g usable), %.4g bf16 TFLOP/s at %.0f%%\n", c->name,
                  c->nodes, c->gpus_per_node, c->memory_gb, c->memory_gb - c->reserve_gb, c->bf16_tflops,
                  100 * c->efficiency);
    if (fit == 0) {
        char s[128];
        dsk_plan_layout_str(&r[0].layout, s, sizeof s);
        dsk__plan_put(&o, "no layout fits: the smallest needs %.4g GB per GPU (%s, stage %d); each GPU has %.4g GB\n",
                      r[0].total / 1e9, s, r[0].worst_stage, c->memory_gb - c->reserve_gb);
        dsk__plan_losers(&o, r, n < 8 ? n : 8, 0);
    } else {
        dsk__plan_put(&o, "%d of %d layouts fit; the best %d (GB per GPU, worst stage):\n", fit, n, shown);
        dsk__plan_put(&o, "%-80s %6s %6s %6s %6s %6s %7s %8s | %8s %6s %6s\n", "layout", "param", "grad", "optim",
                      "act", "comm", "total", "+worst", "step s", "bubble", "comm");
        for (int i = 0; i < end; i++)
            if (!dsk__plan_twin_fits(r, fit, i)) dsk__plan_row(&o, &r[i]);
        dsk__plan_put(&o, "why the others lost (the best of each tp, pp, ep, ZeRO):\n");
        dsk__plan_losers(&o, r, n, end);
    }
    if (o.over) return dsk_set_error(DSK_ERR_ARG, "dsk_plan_table: the table needs more than %zu bytes", cap);
    return DSK_OK;
}

DSK_API dsk_status dsk_plan_json(const dsk_plan_result *r, const dsk_plan_job *job, char *buf, size_t cap) {
    dsk__plan_out o = {buf, cap, 0, 0};
    const dsk_plan_layout *l;
    if (!r || !job || !buf || cap < 1)
        return dsk_set_error(DSK_ERR_ARG, "dsk_plan_json: result, job and buffer needed");
    l = &r->layout;
    dsk__plan_put(
        &o,
        "{\"tp\": %d, \"pp\": %d, \"dp\": %d, \"ep\": %d, \"zero\": %d, \"micro_batches\": %d, "
        "\"virtual_stages\": %d, \"pp_schedule\": \"%s\", \"recompute\": \"%s\", \"moments\": \"%s\", "
        "\"fp8\": %d, \"paired\": %d, \"sequences\": %lld, "
        "\"seq\": %lld, \"params_bytes\": %lld, \"grads_bytes\": %lld, \"optimizer_bytes\": %lld, "
        "\"comm_bytes\": %lld, \"activations_bytes\": %lld, \"imbalance_bytes\": %lld, \"total_bytes\": %lld, "
        "\"fits\": %d, \"step_s\": %.6g, \"compute_s\": %.6g, \"bubble_s\": %.6g, \"tp_s\": %.6g, "
        "\"ep_s\": %.6g, \"ep_hidden_s\": %.6g, \"pp_s\": %.6g, \"zero_exposed_s\": %.6g, \"cores_s\": %.6g, "
        "\"opt_s\": %.6g}\n",
        l->tp, l->pp, l->dp, l->ep, l->zero, l->micro, l->vstages, dsk_par_schedule_name(l->schedule),
        dsk__plan_rc_names[l->recompute], dsk_dtype_name(l->moments), l->fp8, l->paired, (long long)job->sequences,
        (long long)job->seq, (long long)r->mem.params, (long long)r->mem.grads, (long long)r->mem.optimizer,
        (long long)r->mem.comm, (long long)r->mem.activations, (long long)r->mem.imbalance, (long long)r->total,
        r->fits, r->step_s, r->compute_s, r->bubble_s, r->tp_s, r->ep_s, r->ep_hidden_s, r->pp_s, r->zero_exposed_s,
        r->cores_s, r->opt_s);
    if (o.over) return dsk_set_error(DSK_ERR_ARG, "dsk_plan_json: more than %zu bytes", cap);
    return DSK_OK;
}

static const char *const dsk__plan_choice_keys[] = {"tp",
                                                    "pp",
                                                    "dp",
                                                    "ep",
                                                    "zero",
                                                    "micro_batches",
                                                    "virtual_stages",
                                                    "pp_schedule",
                                                    "recompute",
                                                    "moments",
                                                    "sequences",
                                                    "seq",
                                                    "params_bytes",
                                                    "grads_bytes",
                                                    "optimizer_bytes",
                                                    "comm_bytes",
                                                    "activations_bytes",
                                                    "imbalance_bytes",
                                                    "total_bytes",
                                                    "fits",
                                                    "step_s",
                                                    "compute_s",
                                                    "bubble_s",
                                                    "tp_s",
                                                    "ep_s",
                                                    "pp_s",
                                                    "zero_exposed_s",
                                                    "cores_s",
                                                    "opt_s",
                                                    "ep_hidden_s",
                                                    "fp8",
                                                    "paired"};
#define DSK__PLAN_NCHOICE (int)(sizeof dsk__plan_choice_keys / sizeof dsk__plan_choice_keys[0])
#define DSK__PLAN_CHOICE_FP8 (DSK__PLAN_NCHOICE - 2)    /* optional: 0 (the default) or 1 */
#define DSK__PLAN_CHOICE_PAIRED (DSK__PLAN_NCHOICE - 1) /* optional: 0 (the default) or 1 */

/* Field k of the choice as a whole number >= lo (k < 7 or 10, 11), or its string (7-9). */
static dsk_status dsk__plan_choice_num(const dsk__plan_field *f, const char *what, double lo, int64_t *v) {
    if (f->is_str || f->num < lo || f->num != floor(f->num) || f->num > 9e15)
        return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan_choice_parse: %s: \"%s\" must be a whole number >= %g", what,
                             f->key, lo);
    *v = (int64_t)f->num;
    return DSK_OK;
}

DSK_API dsk_status dsk_plan_choice_parse(const char *json, size_t n, const char *what, dsk_plan_layout *l,
                                         dsk_plan_job *job) {
    dsk__plan_field f[DSK__PLAN_NCHOICE + 4];
    int nf = 0, have[DSK__PLAN_NCHOICE] = {0};
    int64_t v[DSK__PLAN_NCHOICE] = {0};
    dsk_plan_layout out;
    char str[3][64] = {"", "", ""}; /* pp_schedule, recompute, moments */
    if (!what) what = "choice";
    if (!json || !l || !job) return dsk_set_error(DSK_ERR_ARG, "dsk_plan_choice_parse: %s: NULL argument", what);
    DSK__TRY(dsk__plan_fields(json, n, what, f, DSK__PLAN_NCHOICE + 4, &nf));
    for (int i = 0; i < nf; i++) {
        int k = 0;
        while (k < DSK__PLAN_NCHOICE && strcmp(dsk__plan_choice_keys[k], f[i].key)) k++;
        if (k == DSK__PLAN_NCHOICE)
            return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan_choice_parse: %s: unknown field \"%s\"", what, f[i].key);
        have[k] = 1;
        if (k >= 7 && k <= 9) {
            if (!f[i].is_str)
                return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan_choice_parse: %s: \"%s\" must be a string", what,
                                     f[i].key);
            snprintf(str[k - 7], 64, "%s", f[i].str);
        } else if (k <= 11 || k >= DSK__PLAN_CHOICE_FP8) {
            DSK__TRY(dsk__plan_choice_num(&f[i], what, k == 4 || k >= DSK__PLAN_CHOICE_FP8 ? 0 : 1, &v[k]));
        } else if (f[i].is_str) {
            return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan_choice_parse: %s: \"%s\" must be a number", what, f[i].key);
        }
    }
    for (int k = 0; k <= 11; k++)
        if (!have[k])
            return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan_choice_parse: %s: missing field \"%s\"", what,
                                 dsk__plan_choice_keys[k]);
    memset(&out, 0, sizeof out);
    if (dsk_par_schedule_parse(str[0], &out.schedule) != DSK_OK)
        return dsk_set_error(DSK_ERR_CORRUPT,
                             "dsk_plan_choice_parse: %s: \"pp_schedule\" \"%s\": gpipe, 1f1b, "
                             "interleaved or dualpipev",
                             what, str[0]);
    while ((int)out.recompute < 3 && strcmp(dsk__plan_rc_names[out.recompute], str[1]))
        out.recompute = (dsk_plan_recompute)(out.recompute + 1);
    if ((int)out.recompute == 3)
        return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan_choice_parse: %s: \"recompute\" \"%s\": none, attn or full",
                             what, str[1]);
    if (strcmp(str[2], "f32") && strcmp(str[2], "bf16"))
        return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan_choice_parse: %s: \"moments\" \"%s\": f32 or bf16", what,
                             str[2]);
    out.moments = strcmp(str[2], "f32") ? DSK_BF16 : DSK_F32;
    if (v[4] > 3)
        return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan_choice_parse: %s: \"zero\" %lld: 0-3", what, (long long)v[4]);
    if (v[DSK__PLAN_CHOICE_FP8] > 1)
        return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan_choice_parse: %s: \"fp8\" %lld: 0 or 1", what,
                             (long long)v[DSK__PLAN_CHOICE_FP8]);
    if (v[DSK__PLAN_CHOICE_PAIRED] > 1)
        return dsk_set_error(DSK_ERR_CORRUPT, "dsk_plan_choice_parse: %s: \"paired\" %lld: 0 or 1", what,
                             (long long)v[DSK__PLAN_CHOICE_PAIRED]);
    out.fp8 = (int)v[DSK__PLAN_CHOICE_FP8];
    out.paired = (int)v[DSK__PLAN_CHOICE_PAIRED];
    out.tp = (int)v[0], out.pp = (int)v[1], out.dp = (int)v[2], out.ep = (int)v[3], out.zero = (int)v[4];
    out.micro = (int)v[5], out.vstages = (int)v[6];
    job->sequences = v[10];
    job->seq = v[11];
    *l = out;
    return DSK_OK;
}

DSK_API dsk_status dsk_plan_choice_read(const char *path, dsk_plan_layout *l, dsk_plan_job *job) {
    char buf[4096];
    size_t n;
    DSK__TRY(dsk__plan_read_small("dsk_plan_choice_read", path, buf, sizeof buf, &n));
    return dsk_plan_choice_parse(buf, n, path, l, job);
}

DSK__FP_EXACT_END
#endif /* DSK_PLAN_IMPLEMENTATION_DONE */
#endif /* DSK_PLAN_IMPLEMENTATION */

/* MIT License. Copyright (c) 2026 the dsk authors. Permission is hereby granted, free of
   charge, to any person obtaining a copy of this software, to deal in the software without
   restriction, subject to including this notice. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT
   WARRANTY OF ANY KIND. */
