/* train_moe.c - the main job: train a small DeepSeek-style Mixture-of-Experts language model.

   make run                                   # default: C headers of /usr/include, CPU or GPU
   make run ARGS="--steps 100 --log run.jsonl"
   build/examples/train_moe --nproc 2         # two local data-parallel ranks
   torchrun --nproc_per_node 2 --no_python -r 1 -t 1 build/examples/train_moe  # same under torchrun (README)
   build/examples/train_moe --help            # every flag with its default

   The program shows how to embed dsk in a trainer:
     dsk_tensor.h  ops and AdamW        (model: examples/train_model.h)
     dsk_moe.h     the MoE feed-forward layers (--ep-dispatch fp8: e4m3 rows to the experts)
     dsk_amp.h     loss scaling, non-finite check, clipping
     dsk_ckpt.h    async checkpoints and exact resume
     dsk_comm.h    ranks, collectives, expert parallelism
     dsk_par.h     the rank grid; tensor, sequence and pipeline parallelism (examples/train_par.h)
     dsk_zero.h    --zero 1|2|3, --grad-compress: sharded data parallelism (examples/train_zero.h)
   A step reads the data, runs forward and backward for each micro-batch, all-reduces the
   gradients, unscales and clips them, applies AdamW, updates the expert biases, logs, and
   every --ckpt-every steps hands a checkpoint to a background writer.
   Read it top down: the trainer struct, the setup_* functions, train_step, validation and
   sampling, then main (setup, train_loop, finish). Its parts, one translation unit:
     train/flags.h    TRAIN_FLAGS: every flag with its default and help, by area; --help, presets
     train/refuse.h   every combination of flags the trainer refuses (README's table mirrors it)
     train/graph.h    --cuda-graph: the step captured once and replayed
     train/ckpt.h     checkpoints: save, load, resume from the newest good one
     train/report.h   the log lines, banner, memory and --profile reports
     train/gradcheck.h  --grad-check
     train/prod.h     production (README: Running in production): --bind, --metrics and
                      --metrics-port, --nproc and --max-restarts, pre-emption (SIGTERM, SIGUSR1)
   and the example's helpers: train_model.h (the model), train_par.h (+ train/par_run.h: tensor
   and pipeline parallelism), train_zero.h (the engine's groups), train_hf.h (Hugging Face),
   train_data.h (loader, DistributedSampler order), train_metrics.h, train_signals.h, train_bind.h. */
#define _GNU_SOURCE /* before any header: train_bind.h's CPU affinity calls (sched_setaffinity, CPU_SET) are GNU */
#include "../dsk_comm.h"
#include "../dsk_tensor.h"
#include "../dsk_amp.h"
#include "../dsk_ckpt.h"
#include "../dsk_moe.h"
#include "../dsk_par.h"
#include "../dsk_zero.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "train_bind.h"
#include "train_data.h"
#include "train_hf.h"
#include "train_model.h"
#include "train_metrics.h"
#include "train_par.h"
#include "../dsk_plan.h"
#include "train_signals.h"
#include "train_zero.h"

#include "train/flags.h"

/* ------------------------------------------------------------------ the trainer */

typedef struct trainer {
    options *o;
    int rank, world, ep;          /* ep: expert-parallel group size */
    int dp_size, dp_rank;         /* data-parallel replicas (each reads its own batches) and this rank's */
    tp_state par;                 /* the rank grid; par.on: tensor/pipeline-parallel model (train_par.h) */
    int have_comm;
    dsk_comm comm;                /* every rank */
    dsk_comm ep_comm;             /* ranks that share tokens by all-to-all (hold different experts) */
    dsk_comm rep_comm;            /* ranks that hold the same experts (expert gradients reduce here) */
    dsk_comm ck_comm;             /* checkpoint barriers, used from the async writer's thread */
    dsk_ctx ck_ctx;               /* CUDA: a stream of this rank's device for those barriers (the writer's thread
                                     has no current device of its own, and the training stream is not its to use) */
    dsk_graph graph;              /* --cuda-graph: the whole step (graph_step) */
    float graph_scale;            /* the loss scale it was captured with (a new scale captures again) */
    dsk_amp_dstep dstep;          /* --cuda-graph: lr, the AdamW step and the skip decision on the device */
    dsk_tensor g_ids, g_tgt, g_loss; /* --cuda-graph: each micro-batch's inputs and loss, on the device */
    int g_micro;                  /* --cuda-graph: micro-batches staged for this step's graph */
    int g_captured;               /* --cuda-graph: this step captured the graph (else replayed it) */
    double g_ep_bytes[3];         /* --cuda-graph: the captured step's expert exchange bytes (as step_info's) */
    dsk_ctx ctx;
    td_corpus data;
    tm_model model;
    dsk_amp_scaler scaler;
    dsk_amp_param *amp_decay, *amp_plain; /* --cuda-graph's optimizer groups: with and without weight decay */
    int n_decay, n_plain;
    int engine; /* the parameters live in the engine's dsk_zero objects (train_zero.h): every run
                                     but --cuda-graph's, whose captured step keeps the model's slabs */
    tz_opts zopts;
    tz zero;
    double zero_bytes[2];         /* bytes handed to gradient reductions so far, and uncompressed (no --zero: buckets) */
    int64_t mem_model;            /* allocator bytes the model's setup took (slabs, activations, MoE workspaces) */
    dsk_ckpt ck;
    int have_ck;
    int64_t step;                 /* completed steps (skipped ones included) */
    int64_t applied;              /* optimizer steps applied (AdamW's step counter) */
    int64_t data_pos;             /* global training sequences consumed (batch index x --batch) */
    td_loader loader;             /* this rank's DistributedSampler slice, read ahead by a thread */
    double data_wait_s;           /* time the steps waited for the loader */
    int sample_log;               /* --sample-log file descriptor, -1 when unset */
    int64_t *h_index;             /* samples of the current batch */
    ts_signals sig;               /* SIGTERM/SIGINT (stop after the step), SIGUSR1 (save now) */
    int bind_cpus;                /* CPUs --bind left this rank (0: not bound) */
    int batch_local;              /* sequences per micro-batch on this rank */
    int32_t *h_ids, *h_tgt, *h_win;
    dsk_tensor h_ids_t, h_tgt_t;  /* host tensors over h_ids, h_tgt */
    FILE *log;
    double peak_flops, flops_per_token; /* peak_flops: one rank's device */
    double job_peak;              /* what MFU divides by: world x peak_flops, or the fastest step's rate */
    int peak_raised;              /* a step ran faster than world x peak_flops */
    double t_start, train_seconds;
    int64_t steps_timed;
    double prof_data, prof_opt, prof_step; /* --profile: seconds of data loading, optimizer, whole steps */
    double prof_data_cpu, prof_opt_cpu, prof_step_cpu; /* the same in process CPU time */
    int64_t prof_steps;
    float last_val;
    /* metrics (--metrics, --metrics-port) */
    int metrics_on;
    tmx_values mv;
    tmx_text mtext;
    tmx_server msrv;
    tmx_gpu gpu;
    int *moe_layer;               /* (MoE layers) block index */
    double *moe_load, *moe_imbalance;
    tm_routes routes;             /* --routing-record / --routing-replay (train_model.h) */
    int64_t *route_seq;           /* (batch_local) the validation windows' numbers, for routes */
    dsk_ckpt_hf_deepseek_config hf; /* --init-from-hf: the checkpoint's config.json */
    int have_hf;
} trainer;

/* Prints on rank 0 only. */
static void say(const trainer *t, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static void say(const trainer *t, const char *fmt, ...) {
    va_list ap;
    if (t->rank != 0) return;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    fflush(stdout);
}

/* The example's error path: print the message of the failing call and exit. */
#define CHECK(call) \
    do { \
        dsk_status check_s_ = (call); \
        if (check_s_ != DSK_OK) fail(t, "%s: %s", dsk_status_str(check_s_), dsk_last_error()); \
    } while (0)

static void fail(const trainer *t, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3), noreturn))
#endif
    ;
static void fail(const trainer *t, const char *fmt, ...) {
    va_list ap;
    char msg[1100]; /* a library error (1024 at most) behind its status */
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "train_moe: rank %d: %s\n", t->rank, msg);
    /* every group of this rank hangs up with msg published, so blocked peers name it; rank 0
       serves the store where they look it up, so it waits for them (dsk_comm_abort) */
    if (t->have_comm) dsk_comm_abort((dsk_comm *)&t->comm, msg);
    exit(1);
}

/* ---- collectives on host scalars (the nccl backend wants device memory: stage through it) */

static dsk_status allreduce_host(trainer *t, dsk_comm *c, void *vals, int64_t n, dsk_dtype dt, dsk_comm_op op) {
    if (!t->have_comm || c->world_size <= 1) return DSK_OK;
    if (t->ctx.device.type == DSK_DEV_CPU || c->backend == DSK_COMM_HOST)
        return dsk_comm_all_reduce(c, &t->ctx, vals, vals, n, dt, op);
    dsk_tensor h, d;
    dsk_status s;
    TM_TRY(dsk_tensor_wrap(&h, vals, dt, dsk_cpu(), 1, &n));
    TM_TRY(dsk_tensor_alloc(&t->ctx, &d, dt, 1, &n));
    if ((s = dsk_tensor_copy(&t->ctx, &d, &h)) == DSK_OK && (s = dsk_comm_all_reduce(c, &t->ctx, d.data, d.data, n, dt, op)) == DSK_OK &&
        (s = dsk_comm_sync(c, &t->ctx)) == DSK_OK)
        s = dsk_tensor_copy(&t->ctx, &h, &d);
    dsk_tensor_free(&t->ctx, &d);
    return s;
}

static dsk_dtype compute_dtype(const trainer *t) {
    const char *d = t->o->dtype;
    if (!d[0]) return t->ctx.device.type == DSK_DEV_CUDA ? DSK_BF16 : DSK_F32;
    if (strcmp(d, "f32") == 0) return DSK_F32;
    if (strcmp(d, "bf16") == 0 || strcmp(d, "fp8") == 0) return DSK_BF16; /* fp8: bf16 outside the FP8 GEMMs */
    if (strcmp(d, "fp16") == 0 || strcmp(d, "f16") == 0) return DSK_F16;
    fail(t, "--dtype \"%s\": use f32, bf16, fp16 or fp8", d);
}

/* --optim-dtype: the dtype of AdamW's moments. */
static dsk_dtype moment_dtype(const trainer *t) {
    const char *d = t->o->optim_dtype;
    if (strcmp(d, "f32") == 0) return DSK_F32;
    if (strcmp(d, "bf16") == 0) return DSK_BF16;
    fail(t, "--optim-dtype \"%s\": use f32 or bf16", d);
}

#include "train/refuse.h" /* every refused combination of flags */

/* ---- parallel setup */

/* The chunks a pipeline rank runs under schedule kind: --virtual-stages, or DualPipeV's 2 (the V: stages r and
   2 pp - 1 - r). dsk_plan sizes its layouts with it too. */
static int pp_chunks(const options *o, dsk_par_schedule_kind kind) {
    return kind == DSK_PAR_DUALPIPE_V ? 2 : o->vstages;
}

/* The options every rank must share (model shape, MoE, dtype, batch, layout), checked as soon
   as the ranks meet, so a mismatch names the option rather than a collective's symptom. */
static void agreed_options(const options *o, char *buf, size_t n) {
    snprintf(buf, n,
             "seq=%d d_model=%d heads=%d layers=%d dense_layers=%d ffn_hidden=%d experts=%d shared=%d "
             "top_k=%d expert_hidden=%d groups=%d topk_groups=%d score=%s routed_scale=%.17g capacity=%.17g "
             "attn=%s q_lora=%d kv_lora=%d qk_nope=%d qk_rope=%d v_head=%d mtp=%d dtype=%s batch=%d accum=%d "
             "seed=%lld tp=%d pp=%d micro=%d vstages=%d pp_schedule=%s ep=%d zero=%d grad_compress=%s "
             "ep_dispatch=%s ep_exchange=%s pair_micro=%d",
             o->seq, o->d_model, o->heads, o->layers, o->dense_layers, o->ffn_hidden, o->experts, o->shared, o->top_k,
             o->expert_hidden, o->groups, o->topk_groups, o->score, o->routed_scale, o->capacity, o->attn, o->q_lora,
             o->kv_lora, o->qk_nope, o->qk_rope, o->v_head, o->mtp, o->dtype, o->batch, o->accum, o->seed, o->tp, o->pp,
             o->micro, o->vstages, o->pp_schedule, o->ep, o->zero, o->grad_compress, o->ep_dispatch, o->ep_exchange,
             o->pair_micro);
}

/* The rank grid of dsk_par.h (tp fastest, then dp with ep inside, then pp): its expert-
   parallel group shares tokens by all-to-all, its expert-data-parallel group holds the same
   experts and reduces their gradients together. Without --tp/--pp the ep group is ranks r with
   the same r / ep and the replicas those with the same r % ep. */
static void setup_comm(trainer *t) {
    const options *o = t->o;
    t->rank = 0;
    t->world = 1;
    int launched = getenv("RANK") || getenv("OMPI_COMM_WORLD_RANK") || getenv("SLURM_PROCID");
    if (launched) {
        dsk_comm_opts co;
        memset(&co, 0, sizeof co);
        co.timeout_s = 120;
        /* the device decides the backend; auto: nccl where each local rank has a GPU of its own */
        if (strcmp(o->device, "cpu") == 0) co.backend = DSK_COMM_HOST;
        else if (strcmp(o->device, "cuda") == 0) co.backend = DSK_COMM_NCCL;
        CHECK(dsk_comm_init_env(&t->comm, &co));
        t->have_comm = 1;
        t->rank = t->comm.rank;
        t->world = t->comm.world_size;
        char agree[1024];
        agreed_options(o, agree, sizeof agree);
        CHECK(dsk_comm_check_agree(&t->comm, "train_moe options", agree));
    }
    refuse_layout(t);
    t->engine |= t->world > 1; /* --cuda-graph on several ranks: the engine reduces after each launch (graph.h) */
    t->ep = o->ep;
    t->dp_size = t->world / (o->tp * o->pp);
    t->batch_local = o->batch / t->dp_size;
    t->dp_rank = 0;
    t->par.on = o->tp > 1 || o->pp > 1 || o->pair_micro;
    t->par.paired = o->pair_micro;
    CHECK(dsk_par_schedule_parse(o->pp_schedule, &t->par.kind)); /* refuse_layout checked it */
    t->par.M = o->micro;
    t->par.v = pp_chunks(o, t->par.kind);
    t->par.embed_group = o->mtp > 0; /* the last stage's copy of the embedding (train_par.h) */
    if (t->have_comm) {
        dsk_par_dims d;
        memset(&d, 0, sizeof d);
        d.tp = o->tp;
        d.pp = o->pp;
        d.ep = t->ep;
        if (t->par.on) CHECK(tp_grid_init(&t->par, &t->comm, &d));
        else CHECK(dsk_par_grid_init(&t->par.grid, &t->comm, &d));
        t->dp_rank = t->par.grid.at.dp;
        t->ep_comm = t->par.grid.ep; /* the trainer's groups from now on (moved: freed with the trainer's) */
        t->rep_comm = t->par.grid.edp;
        memset(&t->par.grid.ep, 0, sizeof t->par.grid.ep);
        memset(&t->par.grid.edp, 0, sizeof t->par.grid.edp);
        CHECK(dsk_comm_split(&t->comm, 0, t->rank, &t->ck_comm));
    }
}

static void setup_device(trainer *t) {
    const options *o = t->o;
    dsk_ctx_opts co;
    memset(&co, 0, sizeof co);
    if (strcmp(o->device, "cpu") == 0) co.device = DSK_PREFER_CPU;
    else if (strcmp(o->device, "cuda") == 0) co.device = DSK_PREFER_CUDA;
    else if (strcmp(o->device, "auto") != 0) fail(t, "--device \"%s\": use auto, cpu or cuda", o->device);
    else if (t->have_comm && t->comm.backend == DSK_COMM_HOST) co.device = DSK_PREFER_CPU; /* fewer GPUs than ranks */
    co.cuda_index = t->have_comm && t->comm.cuda_device >= 0 ? t->comm.cuda_device : 0;    /* nccl's device */
    co.n_threads = o->threads ? o->threads : t->bind_cpus; /* OpenMP counted the CPUs before --bind */
#ifdef _OPENMP
    if (co.n_threads > 0) omp_set_num_threads(co.n_threads); /* the parallel loops that take no ctx follow OpenMP's default */
#endif
    CHECK(dsk_ctx_init(&t->ctx, &co));
}

/* ---- data */

static void setup_data(trainer *t) {
    const options *o = t->o;
    CHECK(td_load(&t->data, o->data, o->n_data, o->vocab, "/usr/include", (size_t)(o->corpus_mb * 1e6)));
    CHECK(td_set_windows(&t->data, o->seq, o->val_every, o->batch));
    size_t n = (size_t)t->batch_local * (size_t)o->seq;
    t->h_ids = (int32_t *)malloc(n * sizeof(int32_t));
    t->h_tgt = (int32_t *)malloc(n * sizeof(int32_t));
    t->h_win = (int32_t *)malloc((size_t)(o->seq + 1) * sizeof(int32_t));
    t->h_index = (int64_t *)malloc((size_t)t->batch_local * sizeof(int64_t));
    if (!t->h_ids || !t->h_tgt || !t->h_win || !t->h_index) fail(t, "out of memory for the batch buffers");
    CHECK(td_loader_init(&t->loader, &t->data, t->batch_local, o->prefetch, t->dp_size, t->dp_rank, (uint64_t)o->seed,
                         !o->no_shuffle, o->drop_last));
    t->sample_log = -1;
    if (o->sample_log && (t->sample_log = open(o->sample_log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644)) < 0)
        fail(t, "--sample-log: cannot open %s: %s", o->sample_log, strerror(errno));
    int64_t nn = (int64_t)n;
    CHECK(dsk_tensor_wrap(&t->h_ids_t, t->h_ids, DSK_I32, dsk_cpu(), 1, &nn));
    CHECK(dsk_tensor_wrap(&t->h_tgt_t, t->h_tgt, DSK_I32, dsk_cpu(), 1, &nn));
}

/* The forward that follows, for --routing-record/--routing-replay: phase, its sub-step and the
   identity of each of this rank's sequences (NULL: their local index). */
static void routes_at(trainer *t, int phase, int64_t sub, const int64_t *seq_id) {
    tm_routes *r = &t->routes;
    r->phase = phase;
    r->step = t->step;
    r->sub = sub;
    r->seq_id = seq_id;
    r->n_seq = t->batch_local;
    r->seq_len = t->o->seq;
}

/* Copies the host batch (h_ids, h_tgt) to the model's device tensors. */
static dsk_status upload_batch(trainer *t) {
    TM_TRY(dsk_tensor_copy(&t->ctx, &t->model.ids, &t->h_ids_t));
    return dsk_tensor_copy(&t->ctx, &t->model.targets, &t->h_tgt_t);
}

/* This rank's sequences of the next global training batch: batch data_pos / --batch of the
   loader (this rank's DistributedSampler stream), waiting for its thread if it is behind. */
static dsk_status load_train_batch(trainer *t) {
    int64_t k = t->data_pos / t->o->batch;
    double t0 = tm_clock();
    TM_TRY(td_loader_next(&t->loader, k, t->h_ids, t->h_tgt, t->h_index));
    t->data_wait_s += tm_clock() - t0;
    if (t->sample_log >= 0)
        TM_TRY(td_log_batch(t->sample_log, t->dp_rank, &t->loader.smp, k, t->batch_local, t->h_index));
    t->data_pos += t->o->batch;
    return upload_batch(t);
}

/* This rank's part of validation batch i: the held-out windows in order. */
static dsk_status load_val_batch(trainer *t, int64_t i) {
    int64_t T = t->o->seq, first = i * t->o->batch + (int64_t)t->dp_rank * t->batch_local;
    for (int b = 0; b < t->batch_local; b++)
        td_read_window(&t->data, td_val_window(&t->data, (first + b) % t->data.n_val), t->h_ids + b * T, t->h_tgt + b * T, t->h_win);
    if (t->route_seq) {
        for (int b = 0; b < t->batch_local; b++) t->route_seq[b] = first + b;
        routes_at(t, TM_PHASE_VAL, i, t->route_seq);
    }
    return upload_batch(t);
}

static void setup_routes(trainer *t) {
    const options *o = t->o;
    if (!o->routing_record && !o->routing_replay) return;
    t->route_seq = (int64_t *)malloc((size_t)t->batch_local * sizeof(int64_t));
    if (!t->route_seq) fail(t, "out of memory for the routing record");
    CHECK(tm_routes_open(&t->routes, o->routing_record ? TM_ROUTES_RECORD : TM_ROUTES_REPLAY,
                         o->routing_record ? o->routing_record : o->routing_replay, o->top_k, t->rank));
    t->model.routes = &t->routes;
}

/* ---- model and optimizer groups */

/* The model's configuration from the options (and config.json with --init-from-hf); dsk_plan
   sizes a layout from it too (train_plan.h). */
static void model_config(trainer *t, tm_config *out) {
    const options *o = t->o;
    tm_config c;
    memset(&c, 0, sizeof c);
    c.vocab = t->data.vocab;
    c.seq = o->seq;
    c.d_model = o->d_model;
    c.n_heads = o->heads;
    c.n_layers = o->layers;
    c.n_dense = o->dense_layers;
    c.ffn_hidden = o->ffn_hidden;
    c.batch = t->batch_local;
    c.rope_theta = 10000.0f;
    c.norm_eps = 1e-5f;
    c.init_std = (float)o->init_std;
    if (!(o->init_std > 0)) fail(t, "--init-std %g: must be > 0", o->init_std);
    c.cdt = compute_dtype(t);
    c.mdt = moment_dtype(t);
    c.fp8 = strcmp(o->dtype, "fp8") == 0;
    c.seed = (uint64_t)o->seed;
    if (strcmp(o->score, "sigmoid") == 0) c.moe.score = DSK_MOE_SIGMOID;
    else if (strcmp(o->score, "softmax") == 0) c.moe.score = DSK_MOE_SOFTMAX;
    else fail(t, "--score \"%s\": use sigmoid or softmax", o->score);
    c.moe.n_routed = o->experts;
    c.moe.n_shared = o->shared;
    c.moe.top_k = o->top_k;
    c.moe.d_expert = o->expert_hidden;
    c.moe.n_group = o->groups;
    c.moe.topk_group = o->topk_groups;
    c.moe.routed_scale = (float)o->routed_scale;
    c.moe.aux_alpha = (float)o->aux_loss;
    c.moe.seq_aux_alpha = (float)o->seq_aux_loss;
    c.moe.z_beta = (float)o->z_loss;
    c.moe.capacity_factor = (float)o->capacity;
    c.moe.bias_rate = (float)o->bias_rate;
    c.moe.ep = t->have_comm && t->ep > 1 ? &t->ep_comm : NULL;
    c.moe.ep_dispatch = strcmp(o->ep_dispatch, "fp8") == 0 ? DSK_MOE_DISPATCH_FP8 : DSK_MOE_DISPATCH_ACT;
    if (strcmp(o->ep_exchange, "exact") != 0 && strcmp(o->ep_exchange, "bounded") != 0)
        fail(t, "--ep-exchange \"%s\": use exact or bounded", o->ep_exchange);
    c.moe.ep_exchange = strcmp(o->ep_exchange, "bounded") == 0 ? DSK_MOE_EP_BOUNDED : DSK_MOE_EP_EXACT;
    if (strcmp(o->ep_overlap, "off") != 0 && strcmp(o->ep_overlap, "on") != 0 && strcmp(o->ep_overlap, "chunked") != 0)
        fail(t, "--ep-overlap \"%s\": use off, on or chunked", o->ep_overlap);
    c.moe.ep_overlap = strcmp(o->ep_overlap, "off") != 0;
    c.moe.ep_chunk = strcmp(o->ep_overlap, "chunked") == 0 ? DSK_MOE_CHUNK_ON : DSK_MOE_CHUNK_AUTO;
    c.moe.expert_gemm = c.fp8 ? DSK_MOE_GEMM_FP8 : DSK_MOE_GEMM_ACT; /* --dtype fp8: the experts' GEMMs too */
    if (strcmp(o->attn, "mha") != 0 && strcmp(o->attn, "mla") != 0) fail(t, "--attn \"%s\": use mha or mla", o->attn);
    c.mla.attn = strcmp(o->attn, "mla") == 0 ? TMLA_ATTN_MLA : TMLA_ATTN_MHA;
    c.mla.q_lora_rank = o->q_lora;
    c.mla.kv_lora_rank = o->kv_lora;
    c.mla.qk_nope_dim = o->qk_nope;
    c.mla.qk_rope_dim = o->qk_rope;
    c.mla.v_head_dim = o->v_head;
    c.mla.original_seq = o->original_seq;
    c.mla.rope_factor = (float)o->rope_factor;
    c.mla.mscale = (float)o->mscale;
    c.mla.mtp_depth = o->mtp;
    c.mla.mtp_lambda = (float)o->mtp_lambda;
    if (strcmp(o->mtp_ffn, "moe") == 0) c.mla.mtp_moe = 1;
    else if (o->mtp_ffn[0] && strcmp(o->mtp_ffn, "dense") != 0)
        fail(t, "--mtp-ffn \"%s\": use dense or moe", o->mtp_ffn);
    if (strcmp(o->recompute, "none") == 0) c.mla.recompute = TMLA_RECOMPUTE_NONE;
    else if (strcmp(o->recompute, "attn") == 0) c.mla.recompute = TMLA_RECOMPUTE_ATTN;
    else if (strcmp(o->recompute, "full") == 0) c.mla.recompute = TMLA_RECOMPUTE_FULL;
    else fail(t, "--recompute \"%s\": use none, attn or full", o->recompute);
    c.external = t->engine;
    if (o->export_hf) c.mla.latent_eps = 1e-6f; /* what transformers' q_a/kv_a norms use */
    if (t->have_hf) {
        if (t->data.vocab != (int)t->hf.vocab_size)
            fail(t, "--init-from-hf: the data's vocabulary is %d tokens, the model's %lld: --data takes token shards "
                    "of the model's vocabulary", t->data.vocab, (long long)t->hf.vocab_size);
        CHECK(thf_model_config(&t->hf, &c));
    }
    if (o->dense_layers < o->layers && o->experts < 1) fail(t, "--experts %d: MoE blocks need at least 1 expert", o->experts);
    *out = c;
}

static void setup_model(trainer *t) {
    tm_config c;
    model_config(t, &c);
    if (t->par.on) CHECK(tp_model_init(&t->par, &t->model, &t->ctx, &c));
    else CHECK(tm_init(&t->model, &t->ctx, &c));
}

/* The loss scaler; for --cuda-graph (one GPU, the model's slabs) the two optimizer groups of its
   captured dsk_amp_step_dev: matrices (weight decay) and norm weights (none). */
static void setup_optimizer(trainer *t) {
    tm_model *m = &t->model;
    dsk_amp_scaler_opts so;
    memset(&so, 0, sizeof so);
    so.mode = m->cfg.cdt == DSK_F16 ? DSK_AMP_DYNAMIC : DSK_AMP_NONE;
    CHECK(dsk_amp_scaler_init(&t->scaler, &t->ctx, &so));
    if (t->engine) return; /* the engine steps its own pieces */
    t->amp_decay = (dsk_amp_param *)calloc((size_t)m->n_params, sizeof(dsk_amp_param));
    t->amp_plain = (dsk_amp_param *)calloc((size_t)m->n_params, sizeof(dsk_amp_param));
    if (!t->amp_decay || !t->amp_plain) fail(t, "out of memory for the optimizer groups");
    for (int i = 0; i < m->n_params; i++) {
        tm_param *p = &m->params[i];
        dsk_amp_param *a = p->decay ? &t->amp_decay[t->n_decay++] : &t->amp_plain[t->n_plain++];
        a->name = p->name;
        a->master = &p->w;
        a->grad = &p->g;
        a->m = &p->m;
        a->v = &p->v;
        a->copy = p->wc.data != p->w.data ? &p->wc : NULL;
    }
}

/* The engine's pass of one pipeline chunk (train_par.h's pass_begin). */
static dsk_status tz_pass_begin(void *user, int chunk, int sync) { return tz_begin_part((tz *)user, chunk, sync); }

/* The gradient and optimizer engine (train_zero.h) over this layout's groups: data and expert
   parallelism (tz_places_dp) or the tensor/pipeline grid's (tp_places). At --zero 0 every rank
   holds every whole master, which the parameters' w then view (the Hugging Face import and
   export and --grad-check read and write whole weights). */
static void setup_engine(trainer *t) {
    tm_model *m = &t->model;
    tz_group groups[TZ_MAX_GROUPS];
    tz_place *place;
    dsk_status s;
    if (!t->engine) return; /* --cuda-graph: one GPU, the model's slabs */
    place = (tz_place *)calloc((size_t)m->n_params, sizeof *place);
    if (!place) fail(t, "out of memory for the parameter places");
    if (t->par.on) tp_places(&t->par, groups, place);
    else tz_places_dp(m, t->have_comm ? &t->comm : NULL, t->have_comm ? &t->rep_comm : NULL, t->world, groups, place);
    s = tz_init(&t->zero, m, &t->ctx, groups, place, &t->zopts, (uint64_t)t->o->seed);
    free(place);
    CHECK(s);
    if (t->zopts.stage == 0) CHECK(tz_bind_masters(&t->zero));
    t->par.pass_begin = tz_pass_begin;
    t->par.pass_user = &t->zero;
}

/* The balancing losses count the global batch (each --accum pass, or each pipeline micro-batch
   over every data-parallel replica): every MoE call takes a loss span over the ranks that share
   its micro-batch: the world under data and expert parallelism, the pipeline stage (tp x dp)
   under --tp/--pp. A rank's rows are its data-parallel replica's place, then (under tp) its
   sequence-parallel shard. Each rank's backward then carries the gradient of the whole
   micro-batch's loss through its own rows, which the engine averages over dp: aux_scale takes
   dp times the loss scale (train_step). */
static void setup_loss_span(trainer *t) {
    tm_model *m = &t->model;
    int64_t T = t->o->seq;
    if (t->dp_size == 1 && !t->par.on) return; /* one rank holds every row */
    if (t->par.on) {
        const tp_state *ps = &t->par;
        m->loss_group = &t->par.stage;
        m->loss_row0 = (int64_t)ps->grid.at.dp * ps->Nm + (int64_t)ps->grid.at.tp * ps->Ns;
        m->loss_rows = (int64_t)ps->dp * ps->Nm;
        return;
    }
    m->loss_group = &t->comm;
    m->loss_row0 = (int64_t)t->dp_rank * t->batch_local * T;
    m->loss_rows = (int64_t)t->o->batch * T;
}

/* --init-from-hf: the hub's weights into the whole masters (--zero 0: tz_bind_masters; --zero
   1-3: whole temporary tensors, each rank keeping its pieces), then the compute copies. */
static void import_hf(trainer *t) {
    tm_model *m = &t->model;
    double t0 = tm_clock();
    int whole = !t->engine || t->zopts.stage == 0;
    dsk_status s = DSK_OK;
    if (!t->have_hf) return;
    for (int i = 0; i < m->n_params && !whole && s == DSK_OK; i++)
        s = dsk_tensor_alloc(&t->ctx, &m->params[i].w, DSK_F32, m->params[i].ndim, m->params[i].shape);
    if (s == DSK_OK) s = thf_load(m, &t->hf, t->o->init_from_hf);
    for (int i = 0; i < m->n_params && !whole; i++) {
        if (s == DSK_OK) s = tz_set_master(&t->zero, i, &m->params[i].w);
        dsk_tensor_free(&t->ctx, &m->params[i].w);
    }
    CHECK(s);
    if (t->engine) CHECK(tz_refresh(&t->zero)); /* --cuda-graph: thf_load rounded the slab's copies */
    say(t, "imported %s (DeepseekV%dForCausalLM, %s) in %.3f s\n", t->o->init_from_hf, t->hf.version,
        t->hf.fp8 ? "FP8 e4m3 dequantised" : "weights as stored", tm_clock() - t0);
}

/* ---- FLOPs and the device peak */

/* The CPU's f32 GEMM rate on this context's threads: the best of CPU_PEAK_REPS 512^3 products
   with dsk_sgemm_cpu, so MFU reads as "share of what this CPU's GEMM does". Other programs
   running meanwhile make it low; step_mfu then raises it to the rate a step reaches. */
#define CPU_PEAK_REPS 16
static double measure_cpu_peak(const trainer *t) {
    const int64_t n = 512;
    float *a = (float *)malloc((size_t)(3 * n * n) * sizeof(float));
    if (!a) return 0;
    for (int64_t i = 0; i < 3 * n * n; i++) a[i] = (float)((i * 7919) % 1000) * 1e-3f;
    double best = 1e30;
    for (int r = 0; r < CPU_PEAK_REPS; r++) {
        double t0 = tm_clock();
        dsk_sgemm_cpu(0, 0, n, n, n, 1.0f, a, n, a + n * n, n, 0.0f, a + 2 * n * n, n, t->ctx.n_threads);
        double dt = tm_clock() - t0;
        if (dt < best) best = dt;
    }
    free(a);
    return 2.0 * (double)n * n * n / best;
}

/* MFU of a step: its model FLOP rate (over all ranks) against the job's peak, world x one
   device's peak. That peak is measured or given, so a step can run faster than it (other
   programs ran while it was measured, or the figure given is low): the job's peak then
   becomes that step's rate, said once, so MFU never reads above 1. */
static double step_mfu(trainer *t, double tokens_per_s) {
    double rate = tokens_per_s * t->flops_per_token;
    if (rate > t->job_peak) {
        if (!t->peak_raised)
            say(t, "mfu: step %lld ran at %.3g GFLOP/s, above the peak of %.3g GFLOP/s; MFU is relative to the fastest "
                   "step from here on\n", (long long)t->step, rate / 1e9, t->job_peak / 1e9);
        t->peak_raised = 1;
        t->job_peak = rate;
    }
    return t->job_peak > 0 ? rate / t->job_peak : 0;
}

/* ---- one training step */

typedef struct step_info {
    double loss, aux_loss, norm, lr, ms, cpu_ms, tokens_per_s, mfu, comm_share, load_ratio;
    double data_ms;           /* waiting for the loader (set by the caller of train_step) */
    double sync_ms;           /* waiting for the gradient all-reduces after backward */
    double reduce_bytes, plain_bytes; /* --zero/--grad-compress: handed to this step's reductions, uncompressed */
    double ep_bytes[3]; /* --ep: handed to the MoE layers' dispatch and combine all-to-alls (forward); sent to other
                           nodes by all their exchanges (forward and backward) */
    double pp_bytes;    /* --pp: handed to the pipeline's sends (activations and gradients) */
    int64_t paired;     /* --pair-micro-batches: expert exchanges that travelled while the other micro-batch computed */
    double ep_comm_ms;  /* --ep: inside the expert-parallel communicator's calls (serial: exposed time) */
    double tp[4];       /* --tp: this step's tensor-parallel collectives (tp_traffic: bytes by kind, calls) */
    float scale;
    int64_t dropped;
    int skipped;
} step_info;

/* Learning rate at step s (1-based): linear warm-up, then cosine decay to min_lr. */
static double lr_at(const options *o, int64_t s) {
    if (o->warmup > 0 && s <= o->warmup) return o->lr * (double)s / o->warmup;
    double span = (double)(o->steps - o->warmup), x = span > 0 ? (double)(s - o->warmup) / span : 1.0;
    if (x > 1) x = 1;
    return o->min_lr + 0.5 * (o->lr - o->min_lr) * (1.0 + cos(3.14159265358979323846 * x));
}

static dsk_status read_loss(trainer *t, float *out) {
    dsk_tensor h;
    TM_TRY(dsk_tensor_wrap(&h, out, DSK_F32, dsk_cpu(), 0, NULL));
    return dsk_tensor_copy(&t->ctx, &h, &t->model.loss);
}

#include "train/graph.h" /* --cuda-graph */

/* The step's MoE statistics (they arrive a step late on the GPU: requested, then collected after
   the sync): the balancing losses, dropped tokens and the worst load ratio of this rank's layers,
   then over the pipeline's stages (every rank of a stage holds the same values under the loss
   span). */
static dsk_status collect_moe_stats(trainer *t, step_info *si) {
    tm_model *m = &t->model;
    double v[2] = {0, 0}, worst[1] = {0};
    si->ep_bytes[0] = si->ep_bytes[1] = si->ep_bytes[2] = 0;
    for (int l = m->cfg.n_dense; l < tm_n_blocks(&m->cfg); l++)
        if (m->blocks[l].is_moe) TM_TRY(dsk_moe_stats_request(&m->blocks[l].moe, &t->ctx));
    TM_TRY(dsk_ctx_sync(&t->ctx));
    for (int l = m->cfg.n_dense; l < tm_n_blocks(&m->cfg); l++) {
        dsk_moe_stats *st = &m->blocks[l].stats;
        if (!m->blocks[l].is_moe) continue;
        TM_TRY(dsk_moe_stats_collect(&m->blocks[l].moe, &t->ctx, st));
        v[0] += st->loss / (t->o->accum * (t->par.on ? t->par.M : 1)); /* summed over the step's micro-batches */
        v[1] += (double)st->dropped;
        si->ep_bytes[0] += (double)st->dispatch_bytes;
        si->ep_bytes[1] += (double)st->combine_bytes;
        si->ep_bytes[2] += (double)st->bytes_off_node;
        if (st->mean_load > 0 && st->max_load / st->mean_load > worst[0]) worst[0] = st->max_load / st->mean_load;
    }
    if (t->par.on && t->par.pp > 1) {
        TM_TRY(allreduce_host(t, &t->par.grid.pp, v, 2, DSK_F64, DSK_COMM_SUM));
        TM_TRY(allreduce_host(t, &t->par.grid.pp, worst, 1, DSK_F64, DSK_COMM_MAX));
    }
    si->aux_loss = v[0];
    si->dropped = (int64_t)v[1];
    si->load_ratio = worst[0];
    return DSK_OK;
}

/* After the reductions: unscale, norm, clip and skip over the world (one all-reduce), AdamW on
   the engine's pieces at the step's learning rate, the expert-bias and loss-scale updates. */
static dsk_status engine_step(trainer *t, step_info *si, dsk_amp_decision *dec) {
    const options *o = t->o;
    tm_model *m = &t->model;
    dsk_adamw_opts ao = dsk_adamw_defaults(); /* every field set below, taken literally (lr may reach 0) */
    int64_t next = t->applied + 1;
    double b[3];
    TM_TRY(tz_decide(&t->zero, &t->scaler, t->have_comm ? &t->comm : NULL, o->clip, dec));
    ao.lr = (float)si->lr;
    ao.beta1 = (float)o->beta1;
    ao.beta2 = (float)o->beta2;
    ao.eps = 1e-8f;
    ao.weight_decay = (float)o->wd; /* the norm weights' decay is 0: no_decay */
    TM_TRY(tz_step(&t->zero, &ao, next, dec));
    tz_bytes(&t->zero, &b[0], &b[1], &b[2]);
    si->reduce_bytes = b[0] - t->zero_bytes[0];
    si->plain_bytes = b[1] - t->zero_bytes[1];
    t->zero_bytes[0] = b[0];
    t->zero_bytes[1] = b[1];
    if (!dec->skip) {
        dsk_comm *load_comm = t->par.on ? &t->par.stage : t->have_comm ? &t->comm : NULL;
        t->applied = next;
        if (o->bias_rate > 0) /* loads summed over the ranks running the layer (with --pp: the stage's) */
            for (int l = m->cfg.n_dense; l < tm_n_blocks(&m->cfg); l++)
                if (m->blocks[l].is_moe) TM_TRY(dsk_moe_update_bias(&m->blocks[l].moe, &t->ctx, load_comm));
    }
    return dsk_amp_update(&t->scaler, &t->ctx);
}

/* Seconds this rank's training thread spent blocked on communication so far: its own
   collectives (every communicator) and its waits for the engine's reductions and gathers, whose
   progress threads otherwise overlap compute (their busy time is not counted: it is hidden). */
static double comm_seconds(const trainer *t) {
    return t->comm.stats.seconds + t->ep_comm.stats.seconds + t->rep_comm.stats.seconds + tp_comm_seconds(&t->par) +
           (t->engine ? tz_wait_seconds(&t->zero) : 0.0);
}

/* Forward, loss and backward of the micro-batch in the model's input tensors, loss gradient
   scaled by gscale. With --cuda-graph they run later, in the step's graph (graph_step): here the
   inputs are only staged for it. */
static dsk_status micro_batch(trainer *t, float gscale) {
    tm_model *m = &t->model;
    if (t->o->cuda_graph) return graph_stage(t);
    TM_TRY(tm_forward(m, t->batch_local));
    TM_TRY(tm_loss(m, gscale));
    return tm_backward(m);
}

static dsk_status train_step(trainer *t, step_info *si) {
    const options *o = t->o;
    tm_model *m = &t->model;
    double t0 = tm_clock(), c0 = tm_clock_cpu(), comm0 = comm_seconds(t), ep0 = t->ep_comm.stats.seconds;
    uint64_t pp0 = t->par.on ? t->par.grid.pp.stats.send_payload : 0;
    int64_t paired0 = t->par.paired_exchanges;
    dsk_comm_stats tp0 = t->par.grid.tp.stats;
    float scale, loss;
    TM_TRY(dsk_amp_scale_get(&t->scaler, &t->ctx, &scale));
    m->aux_scale = scale * (float)t->dp_size / (float)o->accum; /* see setup_loss_span */
    if (!o->cuda_graph) TM_TRY(tm_zero_grads(&t->model)); /* --cuda-graph: in the step's graph */
    memset(si, 0, sizeof *si);
    for (int a = 0; a < o->accum; a++) {
        double td = tm_clock(), tdc = tm_clock_cpu();
        TM_TRY(load_train_batch(t));
        routes_at(t, TM_PHASE_TRAIN, a, t->h_index);
        t->prof_data += tm_clock() - td;
        t->prof_data_cpu += tm_clock_cpu() - tdc;
        if (t->par.on) { /* the pipeline's micro-batches (train_par.h) */
            double l;
            m->aux_scale = scale * (float)t->dp_size / (float)(o->accum * t->par.M);
            t->par.sync_last = a == o->accum - 1;
            TM_TRY(tp_train_batch(&t->par, scale / (float)(o->accum * t->par.M), &l));
            si->loss += l / o->accum;
            continue;
        }
        if (t->engine && !o->cuda_graph) TM_TRY(tz_begin(&t->zero, a == o->accum - 1)); /* graph_step: once */
        TM_TRY(micro_batch(t, scale / (float)o->accum));
        if (o->cuda_graph) { if (a == o->accum - 1) TM_TRY(graph_step(t, scale / (float)o->accum, si)); continue; }
        TM_TRY(read_loss(t, &loss));
        si->loss += loss / o->accum;
    }
    if (t->par.on) si->pp_bytes = (double)(t->par.grid.pp.stats.send_payload - pp0);
    si->paired = t->par.paired_exchanges - paired0;
    if (t->par.on) tp_traffic_since(&t->par, &tp0, si->tp);
    double sync0 = tm_clock();
    if (t->engine) TM_TRY(tz_wait(&t->zero));
    double t_opt = tm_clock(), t_opt_cpu = tm_clock_cpu();
    si->sync_ms = 1e3 * (tm_clock() - sync0);
    float l2[1] = {t->par.on ? tp_loss_part(&t->par, si->loss) : (float)si->loss};
    TM_TRY(allreduce_host(t, &t->comm, l2, 1, DSK_F32, t->par.on ? DSK_COMM_SUM : DSK_COMM_AVG));
    si->loss = l2[0];
    dsk_amp_decision dec;
    si->lr = lr_at(o, t->step + 1);
    if (!t->engine) TM_TRY(graph_decision(t, &dec)); /* the replayed graph applied AdamW, bias and scale updates */
    else TM_TRY(engine_step(t, si, &dec));
    TM_TRY(collect_moe_stats(t, si));
    if (o->cuda_graph) graph_ep_bytes(t, si);
    t->prof_opt += tm_clock() - t_opt;
    t->prof_opt_cpu += tm_clock_cpu() - t_opt_cpu;
    t->step++;
    si->skipped = dec.skip;
    si->norm = dec.norm;
    si->scale = scale;
    si->ms = 1e3 * (tm_clock() - t0);
    si->cpu_ms = 1e3 * (tm_clock_cpu() - c0);
    t->prof_step += si->ms * 1e-3;
    t->prof_step_cpu += si->cpu_ms * 1e-3;
    t->prof_steps++;
    si->tokens_per_s = (double)o->batch * o->accum * o->seq / (si->ms * 1e-3);
    si->mfu = step_mfu(t, si->tokens_per_s);
    si->comm_share = (comm_seconds(t) - comm0) / (si->ms * 1e-3);
    si->ep_comm_ms = 1e3 * (t->ep_comm.stats.seconds - ep0);
    return DSK_OK;
}

/* ---- validation and sampling */

/* Mean loss over --val-batches global batches of held-out windows (the same ones every time). */
static dsk_status validate(trainer *t, float *out) {
    tm_model *m = &t->model;
    double sum = 0;
    float loss;
    dsk_status s = DSK_OK;
    tm_set_eval(m, 1);
    for (int i = 0; i < t->o->val_batches && s == DSK_OK && t->par.on; i++) { /* through the pipeline */
        double l = 0;
        if ((s = load_val_batch(t, i)) == DSK_OK && (s = tp_eval_batch(&t->par, t->par.M, &l)) == DSK_OK) sum += l;
    }
    if (t->par.on) {
        tm_set_eval(m, 0);
        TM_TRY(s);
        float v[1] = {tp_loss_part(&t->par, sum / t->o->val_batches)};
        TM_TRY(allreduce_host(t, &t->comm, v, 1, DSK_F32, DSK_COMM_SUM));
        *out = v[0];
        return DSK_OK;
    }
    for (int i = 0; i < t->o->val_batches && s == DSK_OK; i++) {
        if ((s = load_val_batch(t, i)) == DSK_OK && (s = tm_forward(m, t->batch_local)) == DSK_OK &&
            (s = dsk_cross_entropy(&t->ctx, &m->loss, NULL, &m->logits, &m->targets, -1, 1.0f)) == DSK_OK &&
            (s = read_loss(t, &loss)) == DSK_OK)
            sum += loss;
    }
    tm_set_eval(m, 0);
    TM_TRY(s);
    float v[1] = {(float)(sum / t->o->val_batches)};
    TM_TRY(allreduce_host(t, &t->comm, v, 1, DSK_F32, DSK_COMM_AVG));
    *out = v[0];
    return DSK_OK;
}

/* Token from logits (V) with temperature; u uniform in (0, 1). */
static int sample_token(const float *logits, int V, double temperature, float u) {
    int best = 0;
    for (int i = 1; i < V; i++)
        if (logits[i] > logits[best]) best = i;
    if (temperature <= 0) return best;
    double sum = 0, acc = 0;
    for (int i = 0; i < V; i++) sum += exp((logits[i] - logits[best]) / temperature);
    for (int i = 0; i < V; i++) {
        acc += exp((logits[i] - logits[best]) / temperature) / sum;
        if (u < acc) return i;
    }
    return V - 1;
}

/* Generates --sample-len tokens after --prompt (bytes). Every rank runs the forward passes
   (expert, tensor and pipeline parallelism need them all); rank 0 prints. Each new token reruns the last T
   tokens as one sequence (positions past the end are padding the causal mask ignores). */
static dsk_status generate(trainer *t) {
    const options *o = t->o;
    tm_model *m = &t->model;
    int T = o->seq, V = m->cfg.vocab, n0 = (int)strlen(o->prompt), total = n0 + o->sample_len;
    if (o->sample_len <= 0) return DSK_OK;
    int32_t *text = (int32_t *)malloc((size_t)(total > 0 ? total : 1) * sizeof *text);
    float *row = (float *)malloc((size_t)V * sizeof *row);
    if (!text || !row) { free(text); free(row); return dsk_set_error(DSK_ERR_OOM, "generate: out of memory"); }
    for (int i = 0; i < n0; i++) text[i] = (uint8_t)o->prompt[i] % V;
    if (n0 == 0) text[n0++] = '\n' % V;
    dsk_status s = DSK_OK;
    dsk_comm *span = m->loss_group;
    int64_t span_row0 = m->loss_row0, span_rows = m->loss_rows;
    m->loss_group = NULL; /* each call its own micro-batch: the ranks sample the same prompt, no loss counts */
    m->loss_row0 = m->loss_rows = 0;
    tm_set_eval(m, 1);
    for (int n = n0; n < total && s == DSK_OK; n++) {
        int start = n > T ? n - T : 0, len = n - start;
        routes_at(t, TM_PHASE_SAMPLE, n, NULL);
        memset(t->h_ids, 0, (size_t)T * sizeof *t->h_ids);
        memcpy(t->h_ids, text + start, (size_t)len * sizeof *text);
        dsk_tensor ids = tm_rows(&m->ids, T), hids, lrow, hrow;
        int64_t Tl = T, Vl = V;
        if ((s = dsk_tensor_wrap(&hids, t->h_ids, DSK_I32, dsk_cpu(), 1, &Tl)) != DSK_OK) break;
        if ((s = dsk_tensor_copy(&t->ctx, &ids, &hids)) != DSK_OK) break;
        if (t->par.on) { /* one micro-batch through the pipeline; the last stage samples, every rank learns the token */
            const tp_state *ps = &t->par;
            double l;
            int32_t tok[1] = {0};
            if ((s = tp_eval_batch(&t->par, 1, &l)) != DSK_OK) break;
            if (ps->last >= 0 && (s = tp_logits_row(&t->par, len - 1, row)) != DSK_OK) break;
            float u = dsk_rng_uniform_at((uint64_t)o->seed, 0x5A3B1Eull << 32, (uint64_t)n);
            if (ps->last >= 0 && ps->grid.at.tp == 0 && ps->grid.at.dp == 0) tok[0] = sample_token(row, V, o->temperature, u);
            if ((s = allreduce_host(t, &t->comm, tok, 1, DSK_I32, DSK_COMM_SUM)) != DSK_OK) break;
            text[n] = tok[0];
            continue;
        }
        if ((s = tm_forward(m, 1)) != DSK_OK) break;
        if ((s = dsk_tensor_select(&m->logits, len - 1, &lrow)) != DSK_OK) break;
        if ((s = dsk_tensor_wrap(&hrow, row, DSK_F32, dsk_cpu(), 1, &Vl)) != DSK_OK) break;
        if ((s = dsk_tensor_copy(&t->ctx, &hrow, &lrow)) != DSK_OK) break;
        text[n] = sample_token(row, V, o->temperature, dsk_rng_uniform_at((uint64_t)o->seed, 0x5A3B1Eull << 32, (uint64_t)n));
    }
    tm_set_eval(m, 0);
    m->loss_group = span;
    m->loss_row0 = span_row0;
    m->loss_rows = span_rows;
    if (s == DSK_OK && t->rank == 0) {
        printf("---- sample (%d tokens after the prompt, temperature %g) ----\n", o->sample_len, o->temperature);
        for (int i = 0; i < total; i++) {
            int c = text[i];
            if (V > 256) printf("%d ", c);
            else putchar(c == '\n' || c == '\t' || (c >= 32 && c < 127) ? c : '?');
        }
        printf("\n---- end of sample ----\n");
        fflush(stdout);
    }
    free(text);
    free(row);
    return s;
}

/* ---- the trainer's other parts (examples/train/), each over what stands above */

#include "train/ckpt.h"      /* checkpoints: save, load, resume */
#include "train/report.h"    /* the log lines, banner, memory and profile reports */
#include "train/gradcheck.h" /* --grad-check */
#include "train/prod.h"      /* --bind, metrics, --nproc and restarts, pre-emption */

/* ---- main */

static void cleanup(trainer *t) {
    if (t->have_ck) dsk_ckpt_free(&t->ck);
    dsk_ctx_free(&t->ck_ctx);
    if (t->engine) tz_free(&t->zero);
    dsk_graph_free(&t->graph);
    tp_free(&t->par);
    dsk_amp_dstep_free(&t->dstep, &t->ctx);
    dsk_tensor_free(&t->ctx, &t->g_ids);
    dsk_tensor_free(&t->ctx, &t->g_tgt);
    dsk_tensor_free(&t->ctx, &t->g_loss);
    tm_free(&t->model);
    dsk_amp_scaler_free(&t->scaler, &t->ctx);
    free(t->amp_decay);
    free(t->amp_plain);
    td_loader_free(&t->loader);
    td_free(&t->data);
    free(t->h_index);
    if (t->sample_log >= 0) close(t->sample_log);
    free(t->h_ids);
    free(t->h_tgt);
    free(t->h_win);
    if (t->log) fclose(t->log);
    tmx_server_stop(&t->msrv);
    tmx_gpu_close(&t->gpu);
    tmx_text_free(&t->mtext);
    free(t->moe_layer);
    free(t->moe_load);
    free(t->moe_imbalance);
    free(t->route_seq);
    (void)tm_routes_close(&t->routes); /* a finished run closed it already and checked the record's last write */
    if (t->have_comm) {
        dsk_comm_free(&t->ck_comm);
        dsk_comm_free(&t->rep_comm);
        dsk_comm_free(&t->ep_comm);
        dsk_comm_free(&t->comm);
    }
    dsk_ctx_free(&t->ctx);
    ts_stop(&t->sig);
}

/* --init-from-hf: the model flags from the checkpoint's config.json (which the run prints and
   counts FLOPs by); setup_model then takes every model setting from it (thf_model_config). */
static void hf_options(trainer *t) {
    options *o = t->o;
    const dsk_ckpt_hf_deepseek_config *h = &t->hf;
    if (!o->init_from_hf) return;
    CHECK(dsk_ckpt_hf_deepseek_config_read(&t->hf, o->init_from_hf));
    t->have_hf = 1;
    o->vocab = (int)h->vocab_size;
    o->d_model = (int)h->hidden_size;
    o->heads = h->num_attention_heads;
    o->layers = h->num_hidden_layers;
    o->dense_layers = h->first_k_dense_replace;
    o->ffn_hidden = (int)h->intermediate_size;
    o->experts = h->n_routed_experts;
    o->shared = h->n_shared_experts;
    o->top_k = h->num_experts_per_tok;
    o->expert_hidden = (int)h->moe_intermediate_size;
    o->groups = h->n_group;
    o->topk_groups = h->topk_group;
    snprintf(o->score, sizeof o->score, "%s", h->scoring_func);
    o->routed_scale = h->routed_scaling_factor;
    snprintf(o->attn, sizeof o->attn, "mla");
    o->q_lora = h->q_lora_rank;
    o->kv_lora = h->kv_lora_rank;
    o->qk_nope = h->qk_nope_head_dim;
    o->qk_rope = h->qk_rope_head_dim;
    o->v_head = h->v_head_dim;
    o->original_seq = 0;
    if (h->version == 2) o->bias_rate = 0; /* DeepSeek-V2 routes without an expert bias */
    if (!o->mtp_ffn[0]) strcpy(o->mtp_ffn, "moe"); /* the hub's MTP layer is an MoE layer */
}

/* What the run derives from the flags refuse_flags passed. */
static void derive_options(trainer *t) {
    tz_parse_compress(t->o->grad_compress, &t->zopts);
    t->zopts.stage = t->o->zero;
    t->zopts.moment_dtype = moment_dtype(t);
    t->engine = !t->o->cuda_graph;
}

/* Everything before the first step, in this order: the flags refused or taken, the ranks meet,
   placement, device, data, model, optimizer groups, engine, Hugging Face import, routing record,
   metrics, and the FLOPs and peak MFU divides by. */
static void setup(trainer *t) {
    const options *o = t->o;
    int e = ts_start(&t->sig); /* before any thread starts */
    if (e != 0) fail(t, "cannot start the signal thread: %s", strerror(e));
    refuse_flags(t);
    derive_options(t);
    hf_options(t);
    setup_comm(t);
    setup_bind(t);
    setup_device(t);
    refuse_device(t);
    setup_data(t);
    int64_t live0 = dsk_tensor_mem_stats(t->ctx.device).live_bytes;
    setup_model(t);
    t->mem_model = dsk_tensor_mem_stats(t->ctx.device).live_bytes - live0;
    setup_optimizer(t);
    setup_engine(t);
    setup_loss_span(t);
    import_hf(t);
    setup_routes(t);
    setup_metrics(t);
    t->flops_per_token = tmla_model_flops(&t->model.cfg);
    t->peak_flops = o->peak_tflops > 0                   ? o->peak_tflops * 1e12
                    : t->ctx.device.type == DSK_DEV_CUDA ? 989e12
                                                         : measure_cpu_peak(t);
    t->job_peak = t->world * t->peak_flops;
}

/* After a step: validation every --val-interval steps and at the last. */
static void validate_at_step(trainer *t) {
    const options *o = t->o;
    float v;
    if (t->step % o->val_interval != 0 && t->step != o->steps) return;
    t->model.profile = 0; /* --profile times training steps only */
    CHECK(validate(t, &v));
    t->model.profile = o->profile;
    log_val(t, v);
}

/* A SIGUSR1 on any rank: save now (unless this step was just saved) and go on. */
static void save_on_request(trainer *t, int64_t *last_saved) {
    if (t->have_ck && *last_saved != t->step) {
        CHECK(save_counted(t));
        *last_saved = t->step;
    }
    if (t->have_ck) say(t, "SIGUSR1: checkpoint of step %lld saved; training goes on\n", (long long)t->step);
    else say(t, "SIGUSR1 at step %lld: no --ckpt-dir, nothing saved; training goes on\n", (long long)t->step);
}

/* The steps up to --steps (or --stop-at): train, log, validate, checkpoint every --ckpt-every,
   metrics, signals agreed by every rank; then the last checkpoint is saved and written. Returns
   the signal that stopped the run early, 0 when it ran to its end. */
static int train_loop(trainer *t) {
    const options *o = t->o;
    int64_t last_saved = t->step;
    int stop_sig = 0, save;
    t->t_start = tm_clock();
    t->model.profile = o->profile;
    while (t->step < o->steps && !(o->stop_at > 0 && t->step >= o->stop_at)) {
        step_info si;
        double waited = t->data_wait_s;
        if (o->profile && t->step == (o->steps >= 20 ? 10 : o->steps / 2)) profile_clear(t); /* warm-up done */
        CHECK(train_step(t, &si));
        si.data_ms = 1e3 * (t->data_wait_s - waited);
        log_step(t, &si);
        validate_at_step(t);
        if (t->have_ck && o->ckpt_every > 0 && t->step % o->ckpt_every == 0) {
            CHECK(save_counted(t));
            last_saved = t->step;
        }
        write_metrics(t, &si);
        poll_signals(t, &stop_sig, &save);
        if (save) save_on_request(t, &last_saved);
        if (stop_sig) break;
    }
    if (t->have_ck) {
        if (last_saved != t->step) CHECK(save_counted(t));
        double t0 = tm_clock();
        CHECK(dsk_ckpt_wait(&t->ck));
        t->mv.checkpoint_s += tm_clock() - t0;
    }
    write_metrics(t, NULL);
    return stop_sig;
}

/* A run that reached its end: reports, the sample, --export-hf, the summary line. */
static void finish(trainer *t) {
    const options *o = t->o;
    double wall = tm_clock() - t->t_start;
    report_mla(t, "end");
    if (o->profile) profile_report(t);
    if (t->step == o->steps) CHECK(generate(t));
    CHECK(tm_routes_close(&t->routes));
    if (o->export_hf && t->rank == 0) {
        double t0 = tm_clock();
        CHECK(thf_export(&t->model, t->have_hf ? &t->hf : NULL, o->export_hf, o->export_dtype, 0));
        say(t, "exported step %lld to %s (%s) in %.2f s\n", (long long)t->step, o->export_hf, o->export_dtype,
            tm_clock() - t0);
    }
    say(t,
        "done: %lld steps in %.1f s (%.0f tokens/s, %.2f%% of step time waiting for data), final validation loss "
        "%.4f\n",
        (long long)t->step, wall,
        t->steps_timed ? (double)o->batch * o->accum * o->seq * t->steps_timed / t->train_seconds : 0.0,
        t->train_seconds > 0 ? 100 * t->data_wait_s / t->train_seconds : 0.0, (double)t->last_val);
}

/* --plan FILE: the layout and batch of dsk_plan's JSON choice replace the flags' (dsk_plan.h). */
static int apply_plan(options *o) {
    static const char *const rc[3] = {"none", "attn", "full"};
    dsk_plan_layout l;
    dsk_plan_job job;
    if (dsk_plan_choice_read(o->plan, &l, &job) != DSK_OK) {
        fprintf(stderr, "train_moe: --plan: %s\n", dsk_last_error());
        return 2;
    }
    o->tp = l.tp, o->pp = l.pp, o->ep = l.ep, o->zero = l.zero, o->vstages = l.vstages, o->seq = (int)job.seq;
    o->micro = l.pp > 1 || l.paired ? l.micro : 1;
    o->accum = l.pp > 1 || l.paired ? 1 : l.micro; /* one stage: accumulation steps, or paired micro-batches */
    o->pair_micro = l.paired;
    o->batch = (int)(job.sequences / o->accum);
    snprintf(o->pp_schedule, sizeof o->pp_schedule, "%s", dsk_par_schedule_name(l.schedule));
    snprintf(o->recompute, sizeof o->recompute, "%s", rc[l.recompute]);
    snprintf(o->optim_dtype, sizeof o->optim_dtype, "%s", dsk_dtype_name(l.moments));
    if (l.fp8 || !strcmp(o->dtype, "fp8")) /* the plan's FP8 layouts are bf16 ones with FP8 GEMMs */
        snprintf(o->dtype, sizeof o->dtype, "%s", l.fp8 ? "fp8" : "bf16");
    return 0;
}

int main(int argc, char **argv) {
    options o;
    set_defaults(&o);
    if (apply_preset(&o, argc, argv) != 0) return 2;
    int rc = parse_args(&o, argc, argv);
    if (!rc && o.plan) rc = apply_plan(&o);
    if (rc) return rc;
    if (o.help) {
        usage(stdout);
        return 0;
    }
    short_omp_spin(argv);
    if ((rc = refuse_launch(&o)) != 0) return rc;
    if ((o.nproc > 1 || o.max_restarts > 0) && !getenv("RANK")) return launch_local(&o, argc, argv);

    trainer tr, *t = &tr;
    memset(t, 0, sizeof *t);
    t->o = &o;
    setup(t);
    if (o.grad_check > 0) {
        rc = grad_check(t);
        cleanup(t);
        return rc;
    }
    setup_ckpt(t);
    if (o.log_path && t->rank == 0 && !(t->log = fopen(o.log_path, t->step > 0 ? "a" : "w")))
        fail(t, "--log: cannot open %s: %s", o.log_path, strerror(errno));
    banner(t);
    print_memory(t);
    /* The straight run validated at this step before saving: print that line again so the
       resumed log reads the same (evaluation passes leave the training state alone). */
    if (t->step > 0 && t->step % o.val_interval == 0 && t->step < o.steps) {
        float v;
        CHECK(validate(t, &v));
        log_val(t, v);
    }
    int stop_sig = train_loop(t);
    if (stop_sig) report_stop(t, stop_sig);
    else finish(t);
    cleanup(t);
    return 0;
}
