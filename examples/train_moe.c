/* train_moe.c - the main job: train a small DeepSeek-style Mixture-of-Experts language model.

   make run                                   # default: C headers of /usr/include, CPU or GPU
   make run ARGS="--steps 100 --log run.jsonl"
   build/examples/train_moe --nproc 2         # two local data-parallel ranks
   torchrun --nproc_per_node 2 --no_python -r 1 -t 1 build/examples/train_moe  # same under torchrun (README)
   build/examples/train_moe --help            # every flag with its default

   The program shows how to embed dsk in a trainer:
     dsk_tensor.h  ops and AdamW        (model: examples/train_model.h)
     dsk_moe.h     the MoE feed-forward layers
     dsk_amp.h     loss scaling, non-finite check, clipping
     dsk_ckpt.h    async checkpoints and exact resume
     dsk_comm.h    ranks, data-parallel gradient buckets, expert parallelism
     dsk_par.h     the rank grid; tensor, sequence and pipeline parallelism (examples/train_par.h)
     dsk_zero.h    --zero 1|2|3, --grad-compress: sharded data parallelism (examples/train_zero.h)
   A step reads the data, runs forward and backward for each micro-batch, all-reduces the
   gradients, unscales and clips them, applies AdamW, updates the expert biases, logs, and
   every --ckpt-every steps hands a checkpoint to a background writer.
   Running it in production (README: Running in production):
     train_data.h     corpus, PyTorch's DistributedSampler order, a loader thread reading ahead
     train_metrics.h  Prometheus /metrics (--metrics-port) and the node_exporter file (--metrics)
     train_signals.h  SIGTERM/SIGINT: finish the step, save, exit 0; SIGUSR1: save; --max-restarts
     train_bind.h     --bind core | numa */
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

/* ------------------------------------------------------------------ options */

typedef struct options {
    /* data */
    char **data;
    int n_data;
    int vocab;                /* token shards only; bytes are 256 */
    int val_every;            /* every n-th window is held out */
    double corpus_mb;         /* cap of the corpus (0: 4 MB of the default corpus, all of --data) */
    int prefetch, drop_last, no_shuffle;
    char *sample_log;
    /* model */
    int seq, d_model, heads, layers, dense_layers, ffn_hidden;
    int experts, shared, top_k, expert_hidden, groups, topk_groups;
    char score[16];           /* sigmoid | softmax */
    double routed_scale, bias_rate, aux_loss, seq_aux_loss, z_loss, capacity, init_std;
    char attn[8], recompute[8], preset[16]; /* train_mla.h: attention kind, recomputation; the preset applied */
    char mtp_ffn[8];                        /* the MTP blocks' FFN: "dense", "moe", "" (dense; moe on HF imports) */
    int q_lora, kv_lora, qk_nope, qk_rope, v_head, original_seq, mtp;
    double rope_factor, mscale, mtp_lambda;
    /* optimisation */
    int batch, accum, steps, warmup;
    double lr, min_lr, wd, clip, beta1, beta2;
    long long seed;
    char dtype[8], device[8];
    int threads;
    int cuda_graph;
    /* evaluation and output */
    int val_interval, val_batches, sample_len, log_every, profile;
    char prompt[256];
    double temperature, peak_tflops;
    char *log_path, *metrics_path;
    int metrics_port;
    char metrics_addr[64];
    /* checkpoints */
    int ckpt_every, keep, sync_ckpt, resume, stop_at;
    char *ckpt_dir;
    /* parallelism */
    int nproc, ep, max_restarts;
    int tp, pp, micro, vstages;
    char pp_schedule[16];
    int zero;                 /* ZeRO stage; 0 with --grad-compress none: the trainer's own data parallelism */
    char grad_compress[32];
    char bind[8];
    int grad_check;
    char *routing_record, *routing_replay;
    int help;
    /* Hugging Face checkpoints (train_hf.h) */
    char *init_from_hf, *export_hf;
    char *plan; /* dsk_plan's choice (train_plan.h) */
    char export_dtype[8];
} options;

/* OPT_AUTO: a flag that may be followed by the word "auto" */
typedef enum { OPT_INT, OPT_DOUBLE, OPT_LL, OPT_STR, OPT_STRBUF, OPT_FLAG, OPT_AUTO, OPT_LIST } opt_kind;

typedef struct opt_spec {
    const char *name;
    opt_kind kind;
    size_t offset;
    size_t bufsize;   /* OPT_STRBUF */
    const char *help;
} opt_spec;

#define O_(field) offsetof(options, field)
static const opt_spec OPTS[] = {
    {"--data", OPT_LIST, O_(data), 0, "PATH... byte files or llm.c token shards"},
    {"--vocab", OPT_INT, O_(vocab), 0, "vocabulary of token shards"},
    {"--val-every", OPT_INT, O_(val_every), 0, "hold out every n-th window for validation"},
    {"--corpus-mb", OPT_DOUBLE, O_(corpus_mb), 0,
     "keep the first MB of the corpus' token data (0 = 4 of the default corpus, all of --data)"},
    {"--prefetch", OPT_INT, O_(prefetch), 0, "batches a loader thread prepares ahead (0 = read in the step)"},
    {"--drop-last", OPT_FLAG, O_(drop_last), 0, "cut the epoch to a multiple of the world size instead of padding it"},
    {"--no-shuffle", OPT_FLAG, O_(no_shuffle), 0, "read the training windows in order (no per-epoch shuffle)"},
    {"--sample-log", OPT_STR, O_(sample_log), 0,
     "FILE: JSON line per batch and rank with the (epoch, sample) pairs read"},
    {"--seq", OPT_INT, O_(seq), 0, "sequence length T"},
    {"--d-model", OPT_INT, O_(d_model), 0, "model width D"},
    {"--heads", OPT_INT, O_(heads), 0, "attention heads"},
    {"--layers", OPT_INT, O_(layers), 0, "transformer blocks"},
    {"--dense-layers", OPT_INT, O_(dense_layers), 0, "leading blocks with a dense FFN (the rest are MoE)"},
    {"--ffn-hidden", OPT_INT, O_(ffn_hidden), 0, "hidden size of the dense FFN"},
    {"--experts", OPT_INT, O_(experts), 0, "routed experts per MoE layer"},
    {"--shared", OPT_INT, O_(shared), 0, "shared experts per MoE layer"},
    {"--top-k", OPT_INT, O_(top_k), 0, "experts per token"},
    {"--expert-hidden", OPT_INT, O_(expert_hidden), 0, "hidden size of each expert"},
    {"--groups", OPT_INT, O_(groups), 0, "expert groups for group-limited routing (1 = off)"},
    {"--topk-groups", OPT_INT, O_(topk_groups), 0, "groups kept per token"},
    {"--score", OPT_STRBUF, O_(score), sizeof(((options *)0)->score), "router score: sigmoid | softmax"},
    {"--routed-scale", OPT_DOUBLE, O_(routed_scale), 0, "routed scaling factor"},
    {"--bias-rate", OPT_DOUBLE, O_(bias_rate), 0, "auxiliary-loss-free expert bias update rate (0 = off)"},
    {"--aux-loss", OPT_DOUBLE, O_(aux_loss), 0, "Switch/GShard auxiliary loss coefficient"},
    {"--seq-aux-loss", OPT_DOUBLE, O_(seq_aux_loss), 0, "DeepSeek-V3's sequence-wise balance loss coefficient"},
    {"--z-loss", OPT_DOUBLE, O_(z_loss), 0, "router z-loss coefficient"},
    {"--init-std", OPT_DOUBLE, O_(init_std), 0, "standard deviation of the initial weights"},
    {"--capacity", OPT_DOUBLE, O_(capacity), 0, "expert capacity factor (0 = dropless)"},
    {"--preset", OPT_STRBUF, O_(preset), sizeof(((options *)0)->preset),
     "tiny | v2-lite | v3: model sizes (flags given as well override them; v2-lite, v3: scaled-down DeepSeek ratios)"},
    {"--attn", OPT_STRBUF, O_(attn), sizeof(((options *)0)->attn), "mha | mla (multi-head latent attention)"},
    {"--q-lora-rank", OPT_INT, O_(q_lora), 0, "MLA query latent rank (0 = plain Wq)"},
    {"--kv-lora-rank", OPT_INT, O_(kv_lora), 0, "MLA key-value latent rank"},
    {"--qk-nope-dim", OPT_INT, O_(qk_nope), 0, "MLA per-head query/key dims without rotary embedding"},
    {"--qk-rope-dim", OPT_INT, O_(qk_rope), 0, "MLA per-head (query) and shared (key) rotary dims"},
    {"--v-head-dim", OPT_INT, O_(v_head), 0, "MLA per-head value dims"},
    {"--original-seq", OPT_INT, O_(original_seq), 0,
     "MLA: pre-training length; longer --seq applies the mscale softmax correction (0 = off)"},
    {"--rope-factor", OPT_DOUBLE, O_(rope_factor), 0, "MLA: context extension factor of the mscale correction"},
    {"--mscale", OPT_DOUBLE, O_(mscale), 0, "MLA: mscale of the correction 0.1 mscale ln(factor) + 1"},
    {"--mtp", OPT_INT, O_(mtp), 0, "multi-token prediction depth D (0 = off)"},
    {"--mtp-lambda", OPT_DOUBLE, O_(mtp_lambda), 0, "weight lambda of the MTP loss (lambda / D per module)"},
    {"--mtp-ffn", OPT_STRBUF, O_(mtp_ffn), sizeof(((options *)0)->mtp_ffn),
     "FFN of the MTP blocks: dense | moe (as the MoE layers; DeepSeek-V3) [dense; moe: --preset v3, --init-from-hf]"},
    {"--recompute", OPT_STRBUF, O_(recompute), sizeof(((options *)0)->recompute),
     "none | attn | full: recompute the attention core, or each whole block, in backward"},
    {"--batch", OPT_INT, O_(batch), 0, "global batch: sequences per micro-step over all ranks"},
    {"--accum", OPT_INT, O_(accum), 0, "micro-steps of gradient accumulation per step"},
    {"--steps", OPT_INT, O_(steps), 0, "optimizer steps"},
    {"--warmup", OPT_INT, O_(warmup), 0, "linear warm-up steps"},
    {"--lr", OPT_DOUBLE, O_(lr), 0, "peak learning rate"},
    {"--min-lr", OPT_DOUBLE, O_(min_lr), 0, "final learning rate of the cosine decay"},
    {"--wd", OPT_DOUBLE, O_(wd), 0, "AdamW weight decay (matrices only)"},
    {"--clip", OPT_DOUBLE, O_(clip), 0, "global gradient-norm clip (0 = off)"},
    {"--beta1", OPT_DOUBLE, O_(beta1), 0, "AdamW beta1"},
    {"--beta2", OPT_DOUBLE, O_(beta2), 0, "AdamW beta2"},
    {"--seed", OPT_LL, O_(seed), 0, "seed of weights and data order"},
    {"--dtype", OPT_STRBUF, O_(dtype), sizeof(((options *)0)->dtype), "f32 | bf16 | fp16"},
    {"--threads", OPT_INT, O_(threads), 0, "CPU threads per rank (0 = OpenMP's default)"},
    {"--device", OPT_STRBUF, O_(device), sizeof(((options *)0)->device), "auto | cpu | cuda"},
    {"--cuda-graph", OPT_FLAG, O_(cuda_graph), 0,
     "capture a whole step (forward, backward, optimizer) as a CUDA graph once and replay it (one GPU rank)"},
    {"--val-interval", OPT_INT, O_(val_interval), 0, "steps between validation runs"},
    {"--val-batches", OPT_INT, O_(val_batches), 0, "global batches per validation run"},
    {"--sample-len", OPT_INT, O_(sample_len), 0, "tokens generated at the end (0 = none)"},
    {"--prompt", OPT_STRBUF, O_(prompt), sizeof(((options *)0)->prompt), "prompt of the final sample"},
    {"--temperature", OPT_DOUBLE, O_(temperature), 0, "sampling temperature (0 = greedy)"},
    {"--log-every", OPT_INT, O_(log_every), 0, "print every n-th step"},
    {"--profile", OPT_FLAG, O_(profile), 0, "time each phase of the step; print the breakdown at the end"},
    {"--log", OPT_STR, O_(log_path), 0, "FILE: JSON lines, one per step and validation"},
    {"--metrics", OPT_STR, O_(metrics_path), 0,
     "FILE: Prometheus text file (node_exporter), rewritten every step; rank r > 0: FILE.rank<r>"},
    {"--metrics-port", OPT_INT, O_(metrics_port), 0,
     "serve http://ADDR:PORT/metrics (PORT + local rank on each rank; 0 = off)"},
    {"--metrics-addr", OPT_STRBUF, O_(metrics_addr), sizeof(((options *)0)->metrics_addr),
     "address of the metrics server"},
    {"--peak-tflops", OPT_DOUBLE, O_(peak_tflops), 0, "peak of one rank's device for MFU"},
    {"--ckpt-every", OPT_INT, O_(ckpt_every), 0, "steps between checkpoints (0 = only at the end)"},
    {"--ckpt-dir", OPT_STR, O_(ckpt_dir), 0, "DIR of checkpoints (none when unset)"},
    {"--keep", OPT_INT, O_(keep), 0, "checkpoints kept (0 = all)"},
    {"--sync-ckpt", OPT_FLAG, O_(sync_ckpt), 0, "write checkpoints synchronously"},
    {"--resume", OPT_AUTO, O_(resume), 0,
     "continue from the newest complete checkpoint in --ckpt-dir, if any (--resume auto: the same)"},
    {"--stop-at", OPT_INT, O_(stop_at), 0, "stop after this step as if interrupted (0 = run to --steps)"},
    {"--nproc", OPT_INT, O_(nproc), 0, "start N local ranks (data parallel)"},
    {"--max-restarts", OPT_INT, O_(max_restarts), 0, "with --nproc: run a failed job again up to K times, resuming"},
    {"--bind", OPT_STRBUF, O_(bind), sizeof(((options *)0)->bind),
     "none | core | numa: pin each local rank (sysfs topology)"},
    {"--ep", OPT_INT, O_(ep), 0, "expert-parallel ranks (divides the data-parallel ranks and --experts)"},
    {"--tp", OPT_INT, O_(tp), 0, "tensor-parallel ranks (heads, FFN and vocabulary split; sequence parallel norms)"},
    {"--pp", OPT_INT, O_(pp), 0, "pipeline stages (the blocks split into contiguous stages)"},
    {"--pp-schedule", OPT_STRBUF, O_(pp_schedule), sizeof(((options *)0)->pp_schedule), "gpipe | 1f1b | interleaved"},
    {"--micro-batches", OPT_INT, O_(micro), 0,
     "pipeline micro-batches per step (divides the sequences per data-parallel rank)"},
    {"--virtual-stages", OPT_INT, O_(vstages), 0, "stages per pipeline rank (--pp-schedule interleaved)"},
    {"--zero", OPT_INT, O_(zero), 0, "ZeRO stage 0-3: shard optimizer state (1), gradients (2), weights (3)"},
    {"--grad-compress", OPT_STRBUF, O_(grad_compress), sizeof(((options *)0)->grad_compress),
     "none | bf16 | powersgd:R[:START] gradient reductions (PowerSGD rank R from pass START, 10 if not given)"},
    {"--init-from-hf", OPT_STR, O_(init_from_hf), 0,
     "DIR: start from a Hugging Face DeepSeek-V2/V3 checkpoint (config.json sets the model; --data: token shards "
     "of its vocabulary)"},
    {"--export-hf", OPT_STR, O_(export_hf), 0, "DIR: write the final weights as a Hugging Face DeepSeek checkpoint"},
    {"--export-dtype", OPT_STRBUF, O_(export_dtype), sizeof(((options *)0)->export_dtype),
     "f32 | bf16 | fp8 (e4m3 with weight_scale_inv blocks) for --export-hf"},
    {"--grad-check", OPT_INT, O_(grad_check), 0,
     "check N elements of every gradient against central differences, then exit"},
    {"--routing-record", OPT_STR, O_(routing_record), 0,
     "FILE: write the MoE routing decisions (rank r > 0: FILE.rank<r>)"},
    {"--routing-replay", OPT_STR, O_(routing_replay), 0, "FILE: take the MoE routing of a --routing-record run"},
    {"--plan", OPT_STR, O_(plan), 0,
     "FILE: the layout dsk_plan chose (its --json): --tp, --pp, --ep, --zero, --micro-batches, --virtual-stages, "
     "--pp-schedule, --recompute"},
    {"--help", OPT_FLAG, O_(help), 0, "this text"},
};
#define N_OPTS ((int)(sizeof OPTS / sizeof OPTS[0]))

static void set_defaults(options *o) {
    memset(o, 0, sizeof *o);
    o->vocab = 50257;
    o->val_every = 20;
    o->prefetch = 4;
    o->seq = 128;
    o->d_model = 128;
    o->heads = 4;
    o->layers = 4;
    o->dense_layers = 1;
    o->ffn_hidden = 384;
    o->experts = 8;
    o->shared = 1;
    o->top_k = 2;
    o->expert_hidden = 128;
    o->groups = 1;
    o->topk_groups = 1;
    strcpy(o->score, "sigmoid");
    strcpy(o->attn, "mha");
    strcpy(o->recompute, "none");
    strcpy(o->preset, "tiny");
    o->q_lora = 0;
    o->kv_lora = 32;
    o->qk_nope = 16;
    o->qk_rope = 16;
    o->v_head = 32;
    o->rope_factor = 40;
    o->mscale = 1.0;
    o->mtp_lambda = 0.3; /* DeepSeek-V3: 0.3 for the first 10T tokens */
    o->routed_scale = 1.0;
    o->init_std = 0.02;
    o->bias_rate = 1e-2; /* DeepSeek-V3 used 1e-3 over far longer runs; a few hundred steps need faster balancing */
    o->batch = 16;
    o->accum = 1;
    o->steps = 500;
    o->warmup = 30;
    o->lr = 3e-3;
    o->min_lr = 3e-4;
    o->wd = 0.1;
    o->clip = 1.0;
    o->beta1 = 0.9;
    o->beta2 = 0.95;
    o->seed = 1337;
    strcpy(o->device, "auto");
    o->val_interval = 100;
    o->val_batches = 8;
    o->sample_len = 240;
    strcpy(o->prompt, "#include <");
    o->temperature = 0.8;
    o->log_every = 1;
    strcpy(o->metrics_addr, "127.0.0.1");
    o->ckpt_every = 0;
    o->ep = 1;
    o->tp = 1;
    o->pp = 1;
    o->micro = 1;
    o->vstages = 1;
    strcpy(o->pp_schedule, "1f1b");
    strcpy(o->grad_compress, "none");
    strcpy(o->bind, "none");
    strcpy(o->export_dtype, "bf16");
    o->nproc = 0;
}

/* Defaults the run decides (set_defaults leaves the flag unset): --help prints these. */
static const struct {
    const char *name, *text;
} RUN_DEFAULTS[] = {
    {"--data", "C headers of /usr/include"},
    {"--dtype", "bf16 on a GPU, f32 on the CPU"},
    {"--peak-tflops", "CPU: measured at start; GPU: 989"},
};

/* The default of flag s as --help prints it ("" when it has none): a run-decided one, or the
   value set_defaults gives. */
static void default_text(const opt_spec *s, const options *d, char *def, size_t n) {
    const char *p = (const char *)d + s->offset;
    def[0] = 0;
    for (size_t i = 0; i < sizeof RUN_DEFAULTS / sizeof RUN_DEFAULTS[0]; i++)
        if (strcmp(RUN_DEFAULTS[i].name, s->name) == 0) {
            snprintf(def, n, "%s", RUN_DEFAULTS[i].text);
            return;
        }
    switch (s->kind) {
    case OPT_INT: snprintf(def, n, "%d", *(const int *)p); break;
    case OPT_DOUBLE: snprintf(def, n, "%g", *(const double *)p); break;
    case OPT_LL: snprintf(def, n, "%lld", *(const long long *)p); break;
    case OPT_STRBUF: snprintf(def, n, "%s", p); break;
    default: break;
    }
}

static void usage(FILE *f) {
    options d;
    set_defaults(&d);
    fprintf(f, "usage: train_moe [flags]; [x]: the default\n");
    for (int i = 0; i < N_OPTS; i++) {
        char def[64];
        default_text(&OPTS[i], &d, def, sizeof def);
        fprintf(f, "  %-16s %s%s%s%s\n", OPTS[i].name, OPTS[i].help, def[0] ? " [" : "", def, def[0] ? "]" : "");
    }
}

/* --preset NAME: model sizes before the other flags are parsed (so they override them). tiny is
   the default model (make run). v2-lite and v3 scale DeepSeek-V2-Lite's and DeepSeek-V3's
   published configurations down to d_model 128 keeping their structure: leading dense layers
   (1 of 27 -> 1 of 4; 3 of 61 -> 1 of 4), routed : shared experts and top-k (64 : 2, top-6 ->
   16 : 2, top-3 (V2-Lite); 256 : 1, top-8 -> 32 : 1, top-4 (V3)), groups and kept groups
   (V3: 8 groups, 4 kept), score (softmax; sigmoid with routed scale 2.5), the MLA ranks and
   head dims at d_model / 16 (kv_lora 512 -> 32, nope 128 -> 8, rope 64 -> 4, v 128 -> 8;
   V3's q_lora 1536 -> 96; V2-Lite has none), their head counts (16; V3's 128 -> 16), and
   V3's MTP depth 1. Returns 0, or 2 after printing what was wrong. */
static int apply_preset(options *o, int argc, char **argv) {
    const char *name = "tiny";
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], "--preset") == 0) name = argv[i + 1];
    if (strcmp(name, "tiny") == 0) return 0; /* set_defaults */
    int v3 = strcmp(name, "v3") == 0;
    if (!v3 && strcmp(name, "v2-lite") != 0) {
        fprintf(stderr, "train_moe: --preset \"%s\": use tiny, v2-lite or v3\n", name);
        return 2;
    }
    strcpy(o->attn, "mla");
    o->d_model = 128;
    o->heads = 16;
    o->layers = 4;
    o->dense_layers = 1;
    o->kv_lora = 32;
    o->qk_nope = 8;
    o->qk_rope = 4;
    o->v_head = 8;
    o->q_lora = v3 ? 96 : 0;
    o->ffn_hidden = v3 ? 288 : 684;    /* 18432 / 64 and 10944 / 16 */
    o->expert_hidden = v3 ? 32 : 88;   /* 2048 / 64 and 1408 / 16 */
    o->experts = v3 ? 32 : 16;
    o->shared = v3 ? 1 : 2;
    o->top_k = v3 ? 4 : 3;
    o->groups = v3 ? 8 : 1;
    o->topk_groups = v3 ? 4 : 1;
    strcpy(o->score, v3 ? "sigmoid" : "softmax");
    o->routed_scale = v3 ? 2.5 : 1.0;
    o->mtp = v3 ? 1 : 0;
    if (v3) strcpy(o->mtp_ffn, "moe"); /* DeepSeek-V3's MTP layer has an MoE FFN */
    return 0;
}

/* Parses argv into o; returns 0, or 2 after printing what was wrong. */
static int parse_args(options *o, int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const opt_spec *s = NULL;
        for (int k = 0; k < N_OPTS && !s; k++)
            if (strcmp(a, OPTS[k].name) == 0) s = &OPTS[k];
        if (!s) {
            fprintf(stderr, "train_moe: unknown flag \"%s\" (train_moe --help lists the flags)\n", a);
            return 2;
        }
        char *p = (char *)o + s->offset;
        if (s->kind == OPT_FLAG || s->kind == OPT_AUTO) {
            *(int *)p = 1;
            if (s->kind == OPT_AUTO && i + 1 < argc && strcmp(argv[i + 1], "auto") == 0) i++;
            continue;
        }
        if (s->kind == OPT_LIST) {
            o->data = &argv[i + 1]; /* the last --data wins, like any flag given twice */
            o->n_data = 0;
            while (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) { i++; o->n_data++; }
            if (o->n_data == 0) { fprintf(stderr, "train_moe: %s needs at least one PATH\n", a); return 2; }
            continue;
        }
        if (i + 1 >= argc) { fprintf(stderr, "train_moe: %s needs a value\n", a); return 2; }
        const char *v = argv[++i];
        char *end = NULL;
        errno = 0;
        switch (s->kind) {
        case OPT_INT: {
            long x = strtol(v, &end, 10);
            if (*v == 0 || *end || errno || x < -2147483647L || x > 2147483647L) goto bad;
            *(int *)p = (int)x;
            break;
        }
        case OPT_LL: {
            long long x = strtoll(v, &end, 10);
            if (*v == 0 || *end || errno) goto bad;
            *(long long *)p = x;
            break;
        }
        case OPT_DOUBLE: {
            double x = strtod(v, &end);
            if (*v == 0 || *end || errno || x != x) goto bad;
            *(double *)p = x;
            break;
        }
        case OPT_STR: *(const char **)p = v; break;
        case OPT_STRBUF:
            if (strlen(v) >= s->bufsize) { fprintf(stderr, "train_moe: %s \"%s\" is too long\n", a, v); return 2; }
            strcpy(p, v);
            break;
        default: break;
        }
        continue;
    bad:
        fprintf(stderr, "train_moe: %s \"%s\" is not a valid %s\n", a, v, s->kind == OPT_DOUBLE ? "number" : "integer");
        return 2;
    }
    return 0;
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
    o->micro = l.pp > 1 ? l.micro : 1;
    o->accum = l.pp > 1 ? 1 : l.micro; /* without a pipeline the plan's passes are accumulation steps */
    o->batch = (int)(job.sequences / o->accum);
    snprintf(o->pp_schedule, sizeof o->pp_schedule, "%s", dsk_par_schedule_name(l.schedule));
    snprintf(o->recompute, sizeof o->recompute, "%s", rc[l.recompute]);
    return 0;
}

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

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

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
#define CHECK(call)                                                                                   \
    do {                                                                                              \
        dsk_status check_s_ = (call);                                                                 \
        if (check_s_ != DSK_OK) {                                                                     \
            fprintf(stderr, "train_moe: rank %d: %s: %s\n", t->rank, dsk_status_str(check_s_), dsk_last_error()); \
            exit(1);                                                                                  \
        }                                                                                             \
    } while (0)

static void fail(const trainer *t, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3), noreturn))
#endif
    ;
static void fail(const trainer *t, const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "train_moe: rank %d: ", t->rank);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
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

/* ---- parallel setup */

/* The rank grid of dsk_par.h (tp fastest, then dp with ep inside, then pp): its expert-
   parallel group shares tokens by all-to-all, its expert-data-parallel group holds the same
   experts and reduces their gradients together. Without --tp/--pp the ep group is ranks r with
   the same r / ep and the replicas those with the same r % ep. */
/* The options every rank must share (model shape, MoE, dtype, batch, layout), checked as soon
   as the ranks meet, so a mismatch names the option rather than a collective's symptom. */
static void agreed_options(const options *o, char *buf, size_t n) {
    snprintf(buf, n, "seq=%d d_model=%d heads=%d layers=%d dense_layers=%d ffn_hidden=%d experts=%d shared=%d "
             "top_k=%d expert_hidden=%d groups=%d topk_groups=%d score=%s routed_scale=%.17g capacity=%.17g "
             "attn=%s q_lora=%d kv_lora=%d qk_nope=%d qk_rope=%d v_head=%d mtp=%d dtype=%s batch=%d accum=%d "
             "seed=%lld tp=%d pp=%d micro=%d vstages=%d pp_schedule=%s ep=%d zero=%d grad_compress=%s",
             o->seq, o->d_model, o->heads, o->layers, o->dense_layers, o->ffn_hidden, o->experts, o->shared, o->top_k,
             o->expert_hidden, o->groups, o->topk_groups, o->score, o->routed_scale, o->capacity, o->attn, o->q_lora,
             o->kv_lora, o->qk_nope, o->qk_rope, o->v_head, o->mtp, o->dtype, o->batch, o->accum, o->seed, o->tp,
             o->pp, o->micro, o->vstages, o->pp_schedule, o->ep, o->zero, o->grad_compress);
}

static void setup_comm(trainer *t) {
    const options *o = t->o;
    t->rank = 0;
    t->world = 1;
    int launched = getenv("RANK") || getenv("OMPI_COMM_WORLD_RANK") || getenv("SLURM_PROCID");
    if (launched) {
        dsk_comm_opts co;
        memset(&co, 0, sizeof co);
        co.timeout_s = 120;
        CHECK(dsk_comm_init_env(&t->comm, &co));
        t->have_comm = 1;
        t->rank = t->comm.rank;
        t->world = t->comm.world_size;
        char agree[1024];
        agreed_options(o, agree, sizeof agree);
        CHECK(dsk_comm_check_agree(&t->comm, "train_moe options", agree));
    }
    t->ep = o->ep;
    if (o->tp < 1 || o->pp < 1 || o->micro < 1 || o->vstages < 1)
        fail(t, "--tp %d, --pp %d, --micro-batches %d, --virtual-stages %d: must be at least 1", o->tp, o->pp, o->micro,
             o->vstages);
    if (t->world % (o->tp * o->pp) != 0)
        fail(t, "--tp %d x --pp %d = %d must divide the world size %d", o->tp, o->pp, o->tp * o->pp, t->world);
    t->dp_size = t->world / (o->tp * o->pp);
    if (t->ep < 1 || t->dp_size % t->ep != 0) {
        if (o->tp * o->pp == 1) fail(t, "--ep %d must divide the world size %d", t->ep, t->world);
        fail(t, "--ep %d must divide the %d data-parallel ranks (world %d / (--tp %d x --pp %d))", t->ep, t->dp_size,
             t->world, o->tp, o->pp);
    }
    if (o->experts % t->ep != 0) fail(t, "--ep %d must divide --experts %d", t->ep, o->experts);
    if (o->batch % t->dp_size != 0)
        fail(t, "--batch %d (global) must be a multiple of the %s %d", o->batch,
             o->tp * o->pp > 1 ? "data-parallel ranks" : "world size", t->dp_size);
    t->batch_local = o->batch / t->dp_size;
    t->dp_rank = 0;
    t->par.on = o->tp > 1 || o->pp > 1;
    if (!t->par.on && (o->micro > 1 || o->vstages > 1 || strcmp(o->pp_schedule, "1f1b") != 0))
        fail(t, "--micro-batches, --virtual-stages and --pp-schedule need --pp 2 or more (--accum accumulates "
                "gradients without a pipeline)");
    if (dsk_par_schedule_parse(o->pp_schedule, &t->par.kind) != DSK_OK)
        fail(t, "--pp-schedule \"%s\": use gpipe, 1f1b or interleaved", o->pp_schedule);
    if (o->vstages > 1 && t->par.kind != DSK_PAR_INTERLEAVED)
        fail(t, "--virtual-stages %d needs --pp-schedule interleaved", o->vstages);
    if (t->par.kind == DSK_PAR_INTERLEAVED && o->micro % o->pp != 0)
        fail(t, "--pp-schedule interleaved needs --micro-batches (%d) to be a multiple of --pp %d", o->micro, o->pp);
    t->par.M = o->micro;
    t->par.v = o->vstages;
    t->par.embed_group = o->mtp > 0; /* the last stage's copy of the embedding (train_par.h) */
    if (o->mtp > 0 && o->pp > 1 && o->zero >= 2)
        fail(t,
             "--mtp %d with --pp %d: --zero 0 or 1 (the last stage's copy of the embedding reduces and gathers "
             "in another order than the first stage's at --zero %d)",
             o->mtp, o->pp, o->zero);
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

/* --bind: pins this rank (every thread so far, and those started later) and prints where. */
static void setup_bind(trainer *t) {
    int local = t->have_comm ? t->comm.local_rank : 0, local_world = t->have_comm ? t->comm.local_world_size : 1, cpus = 0;
    char line[1400];
    CHECK(tb_bind(t->o->bind, local, local_world, &cpus, line, sizeof line));
    if (strcmp(t->o->bind, "none") != 0) t->bind_cpus = cpus;
    printf("%s\n", line);
    fflush(stdout);
}

static void setup_device(trainer *t) {
    const options *o = t->o;
    dsk_ctx_opts co;
    memset(&co, 0, sizeof co);
    if (strcmp(o->device, "cpu") == 0) co.device = DSK_PREFER_CPU;
    else if (strcmp(o->device, "cuda") == 0) co.device = DSK_PREFER_CUDA;
    else if (strcmp(o->device, "auto") != 0) fail(t, "--device \"%s\": use auto, cpu or cuda", o->device);
    co.cuda_index = t->have_comm ? t->comm.local_rank : 0;
    if (o->threads < 0) fail(t, "--threads %d: must be >= 0", o->threads);
    co.n_threads = o->threads ? o->threads : t->bind_cpus; /* OpenMP counted the CPUs before --bind */
#ifdef _OPENMP
    if (co.n_threads > 0) omp_set_num_threads(co.n_threads); /* the parallel loops that take no ctx follow OpenMP's default */
#endif
    CHECK(dsk_ctx_init(&t->ctx, &co));
}

static dsk_dtype compute_dtype(const trainer *t) {
    const char *d = t->o->dtype;
    if (!d[0]) return t->ctx.device.type == DSK_DEV_CUDA ? DSK_BF16 : DSK_F32;
    if (strcmp(d, "f32") == 0) return DSK_F32;
    if (strcmp(d, "bf16") == 0) return DSK_BF16;
    if (strcmp(d, "fp16") == 0 || strcmp(d, "f16") == 0) return DSK_F16;
    fail(t, "--dtype \"%s\": use f32, bf16 or fp16", d);
}

/* ---- data */

static void setup_data(trainer *t) {
    const options *o = t->o;
    if (o->val_every < 2) fail(t, "--val-every %d: must be at least 2", o->val_every);
    if (o->corpus_mb < 0) fail(t, "--corpus-mb %g: must be >= 0 (0 = no cap on --data)", o->corpus_mb);
    CHECK(td_load(&t->data, o->data, o->n_data, o->vocab, "/usr/include", (size_t)(o->corpus_mb * 1e6)));
    CHECK(td_set_windows(&t->data, o->seq, o->val_every, o->batch));
    size_t n = (size_t)t->batch_local * (size_t)o->seq;
    t->h_ids = (int32_t *)malloc(n * sizeof(int32_t));
    t->h_tgt = (int32_t *)malloc(n * sizeof(int32_t));
    t->h_win = (int32_t *)malloc((size_t)(o->seq + 1) * sizeof(int32_t));
    t->h_index = (int64_t *)malloc((size_t)t->batch_local * sizeof(int64_t));
    if (!t->h_ids || !t->h_tgt || !t->h_win || !t->h_index) fail(t, "out of memory for the batch buffers");
    if (o->prefetch < 0) fail(t, "--prefetch %d: must be >= 0", o->prefetch);
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
    double t0 = now_s();
    TM_TRY(td_loader_next(&t->loader, k, t->h_ids, t->h_tgt, t->h_index));
    t->data_wait_s += now_s() - t0;
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
    if (o->routing_record && o->routing_replay) fail(t, "--routing-record and --routing-replay exclude each other");
    if (o->cuda_graph || o->grad_check)
        fail(t, "--routing-record/--routing-replay run without --cuda-graph and --grad-check");
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
    double t0 = now_s();
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
        t->hf.fp8 ? "FP8 e4m3 dequantised" : "weights as stored", now_s() - t0);
}

/* ---- FLOPs and the device peak */

/* Training FLOPs per token: 6 x active parameters (embedding lookups excluded) + causal
   attention 6 L D T (Kaplan et al. 2020, arXiv:2001.08361, Table 1: 6N + 6 n_layer n_ctx d_model). */
static double flops_per_token(const trainer *t) {
    const options *o = t->o;
    double D = o->d_model, active = 0;
    for (int l = 0; l < o->layers; l++) {
        active += tmla_attn_weights(&t->model.cfg);
        if (l < o->dense_layers) active += 3 * D * o->ffn_hidden;
        else active += D * o->experts + 3 * D * o->expert_hidden * (o->top_k + o->shared);
    }
    active += D * t->data.vocab; /* LM head */
    return 6 * active + o->layers * tmla_core_flops(&t->model.cfg) + tmla_mtp_flops(&t->model.cfg);
}

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
        double t0 = now_s();
        dsk_sgemm_cpu(0, 0, n, n, n, 1.0f, a, n, a + n * n, n, 0.0f, a + 2 * n * n, n, t->ctx.n_threads);
        double dt = now_s() - t0;
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

/* ---- --cuda-graph: the whole step captured once and replayed

   graph_step records, at the first step (and again when the loss scale moved: the loss gradient's
   scale is a constant of the capture), every device operation of one step: the schedule's upload,
   zeroing the gradients, for each micro-batch its inputs copied in, forward, loss (kept per
   micro-batch) and backward, then unscale, the skip/clip decision, AdamW on both groups, the
   expert-bias update (skipped on the device flag) and the loss-scale update, the eager step's
   operations in its order. Each step launches it once: the host writes lr and the AdamW step
   (dsk_amp_dstep_schedule) and stages the inputs before, reads the losses and the decision after,
   and gets the eager run's bits (tests/test_train_graph.sh). */

/* The i-th of the step's staged micro-batches: views of row i of (accum, n) device buffers. */
static dsk_status graph_row(const dsk_tensor *buf, const dsk_tensor *like, int i, dsk_tensor *out) {
    int64_t n = dsk_tensor_numel(like);
    char *row = (char *)buf->data + (size_t)(i * n) * dsk_dtype_size(buf->dtype);
    return dsk_tensor_wrap(out, row, buf->dtype, buf->device, like->ndim, like->shape);
}

/* Copies the micro-batch load_train_batch put in the model's inputs to the next staging row. */
static dsk_status graph_stage(trainer *t) {
    tm_model *m = &t->model;
    dsk_tensor r;
    if (!t->dstep.vals) { /* first use: the device state of the captured steps */
        int64_t si[2] = {t->o->accum, dsk_tensor_numel(&m->ids)}, st[2] = {t->o->accum, dsk_tensor_numel(&m->targets)};
        int64_t sl = t->o->accum;
        TM_TRY(dsk_tensor_alloc(&t->ctx, &t->g_ids, m->ids.dtype, 2, si));
        TM_TRY(dsk_tensor_alloc(&t->ctx, &t->g_tgt, m->targets.dtype, 2, st));
        TM_TRY(dsk_tensor_alloc(&t->ctx, &t->g_loss, DSK_F32, 1, &sl));
        TM_TRY(dsk_amp_dstep_init(&t->dstep, &t->ctx));
    }
    TM_TRY(graph_row(&t->g_ids, &m->ids, t->g_micro, &r));
    TM_TRY(dsk_tensor_copy(&t->ctx, &r, &m->ids));
    TM_TRY(graph_row(&t->g_tgt, &m->targets, t->g_micro, &r));
    TM_TRY(dsk_tensor_copy(&t->ctx, &r, &m->targets));
    t->g_micro++;
    return DSK_OK;
}

/* AdamW's options of the step at learning rate lr, decay group (the other group has decay 0). */
static dsk_adamw_opts graph_adamw(const options *o, double lr) {
    dsk_adamw_opts ao = dsk_adamw_defaults();
    ao.lr = (float)lr;
    ao.beta1 = (float)o->beta1;
    ao.beta2 = (float)o->beta2;
    ao.eps = 1e-8f;
    ao.weight_decay = (float)o->wd;
    return ao;
}

/* What the graph holds: one step's device operations (see above), nothing that syncs. */
static dsk_status graph_record(trainer *t, float gscale) {
    const options *o = t->o;
    tm_model *m = &t->model;
    dsk_adamw_opts ao = graph_adamw(o, 0.0); /* lr comes from the dstep */
    dsk_tensor r, **grads;
    dsk_status s;
    TM_TRY(dsk_amp_dstep_upload(&t->dstep, &t->ctx));
    TM_TRY(tm_zero_grads(m));
    for (int a = 0; a < o->accum; a++) {
        TM_TRY(graph_row(&t->g_ids, &m->ids, a, &r));
        TM_TRY(dsk_tensor_copy(&t->ctx, &m->ids, &r));
        TM_TRY(graph_row(&t->g_tgt, &m->targets, a, &r));
        TM_TRY(dsk_tensor_copy(&t->ctx, &m->targets, &r));
        TM_TRY(tm_forward(m, t->batch_local));
        TM_TRY(tm_loss(m, gscale));
        TM_TRY(tm_backward(m));
        TM_TRY(graph_row(&t->g_loss, &m->loss, a, &r));
        TM_TRY(dsk_tensor_copy(&t->ctx, &r, &m->loss));
    }
    grads = (dsk_tensor **)malloc((size_t)m->n_params * sizeof *grads);
    if (!grads) return dsk_set_error(DSK_ERR_OOM, "graph_record: out of memory");
    for (int i = 0; i < m->n_params; i++) grads[i] = &m->params[i].g; /* the eager step's order (one rank: no shards) */
    s = dsk_amp_unscale(&t->scaler, &t->ctx, grads, m->n_params);
    free(grads);
    TM_TRY(s);
    TM_TRY(dsk_amp_decide_dev(&t->dstep, &t->ctx, &t->scaler, o->clip));
    TM_TRY(dsk_amp_step_dev(&t->ctx, t->amp_decay, t->n_decay, &ao, &t->dstep, DSK_AMP_ROUND_NEAREST,
                            (uint64_t)o->seed));
    ao.weight_decay = 0.0f;
    TM_TRY(dsk_amp_step_dev(&t->ctx, t->amp_plain, t->n_plain, &ao, &t->dstep, DSK_AMP_ROUND_NEAREST,
                            (uint64_t)o->seed));
    if (o->bias_rate > 0)
        for (int l = m->cfg.n_dense; l < tm_n_blocks(&m->cfg); l++)
            if (m->blocks[l].is_moe) TM_TRY(dsk_moe_update_bias_unless(&m->blocks[l].moe, &t->ctx, &t->dstep.skip));
    return dsk_amp_update(&t->scaler, &t->ctx);
}

/* Launches the step's graph (capturing it first when needed) once every micro-batch is staged;
   the micro-batches' mean loss goes to si->loss as the eager step sums it. */
static dsk_status graph_step(trainer *t, float gscale, step_info *si) {
    const options *o = t->o;
    dsk_adamw_opts ao = graph_adamw(o, lr_at(o, t->step + 1));
    float *loss;
    dsk_tensor h;
    int64_t n = o->accum;
    dsk_status s;
    t->g_micro = 0;
    TM_TRY(dsk_amp_dstep_schedule(&t->dstep, &t->ctx, ao.lr, t->applied + 1, &ao));
    if (!t->graph.exec || t->graph_scale != gscale) {
        dsk_graph_free(&t->graph);
        TM_TRY(dsk_graph_begin(&t->ctx));
        s = graph_record(t, gscale);
        dsk_status e = dsk_graph_end(&t->ctx, &t->graph); /* ends the capture whatever happened inside it */
        TM_TRY(s);
        TM_TRY(e);
        t->graph_scale = gscale;
    }
    TM_TRY(dsk_graph_launch(&t->ctx, &t->graph));
    loss = (float *)malloc((size_t)n * sizeof *loss);
    if (!loss) return dsk_set_error(DSK_ERR_OOM, "graph_step: out of memory");
    s = dsk_tensor_wrap(&h, loss, DSK_F32, dsk_cpu(), 1, &n);
    if (s == DSK_OK) s = dsk_tensor_copy(&t->ctx, &h, &t->g_loss);
    for (int a = 0; s == DSK_OK && a < o->accum; a++) si->loss += loss[a] / o->accum;
    free(loss);
    return s;
}

/* The decision the replayed step made on the device, for the log and the applied-step count:
   dsk_amp_decide on the scaler's stats, the same function on the same numbers. */
static dsk_status graph_decision(trainer *t, dsk_amp_decision *dec) {
    dsk_amp_stats st = {0.0, 0.0};
    TM_TRY(dsk_amp_stats_get(&t->scaler, &t->ctx, &st));
    *dec = dsk_amp_decide(st, t->o->clip);
    if (!dec->skip) t->applied++;
    return DSK_OK;
}

/* The step's MoE statistics (they arrive a step late on the GPU: requested, then collected after
   the sync): the balancing losses, dropped tokens and the worst load ratio of this rank's layers,
   then over the pipeline's stages (every rank of a stage holds the same values under the loss
   span). */
static dsk_status collect_moe_stats(trainer *t, step_info *si) {
    tm_model *m = &t->model;
    double v[2] = {0, 0}, worst[1] = {0};
    for (int l = m->cfg.n_dense; l < tm_n_blocks(&m->cfg); l++)
        if (m->blocks[l].is_moe) TM_TRY(dsk_moe_stats_request(&m->blocks[l].moe, &t->ctx));
    TM_TRY(dsk_ctx_sync(&t->ctx));
    for (int l = m->cfg.n_dense; l < tm_n_blocks(&m->cfg); l++) {
        dsk_moe_stats *st = &m->blocks[l].stats;
        if (!m->blocks[l].is_moe) continue;
        TM_TRY(dsk_moe_stats_collect(&m->blocks[l].moe, &t->ctx, st));
        v[0] += st->loss / (t->o->accum * (t->par.on ? t->par.M : 1)); /* summed over the step's micro-batches */
        v[1] += (double)st->dropped;
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

/* CPU seconds of this process, every thread (wall time on a shared machine also counts the
   time other programs hold the cores). */
static double cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static dsk_status train_step(trainer *t, step_info *si) {
    const options *o = t->o;
    tm_model *m = &t->model;
    double t0 = now_s(), c0 = cpu_s(), comm0 = comm_seconds(t);
    float scale, loss;
    TM_TRY(dsk_amp_scale_get(&t->scaler, &t->ctx, &scale));
    m->aux_scale = scale * (float)t->dp_size / (float)o->accum; /* see setup_loss_span */
    if (!o->cuda_graph) TM_TRY(tm_zero_grads(&t->model)); /* --cuda-graph: in the step's graph */
    memset(si, 0, sizeof *si);
    for (int a = 0; a < o->accum; a++) {
        double td = now_s(), tdc = cpu_s();
        TM_TRY(load_train_batch(t));
        routes_at(t, TM_PHASE_TRAIN, a, t->h_index);
        t->prof_data += now_s() - td;
        t->prof_data_cpu += cpu_s() - tdc;
        if (t->par.on) { /* the pipeline's micro-batches (train_par.h) */
            double l;
            m->aux_scale = scale * (float)t->dp_size / (float)(o->accum * t->par.M);
            t->par.sync_last = a == o->accum - 1;
            TM_TRY(tp_train_batch(&t->par, scale / (float)(o->accum * t->par.M), &l));
            si->loss += l / o->accum;
            continue;
        }
        if (t->engine) TM_TRY(tz_begin(&t->zero, a == o->accum - 1));
        TM_TRY(micro_batch(t, scale / (float)o->accum));
        if (o->cuda_graph) { if (a == o->accum - 1) TM_TRY(graph_step(t, scale / (float)o->accum, si)); continue; }
        TM_TRY(read_loss(t, &loss));
        si->loss += loss / o->accum;
    }
    double sync0 = now_s();
    if (t->engine) TM_TRY(tz_wait(&t->zero));
    double t_opt = now_s(), t_opt_cpu = cpu_s();
    si->sync_ms = 1e3 * (now_s() - sync0);
    float l2[1] = {t->par.on ? tp_loss_part(&t->par, si->loss) : (float)si->loss};
    TM_TRY(allreduce_host(t, &t->comm, l2, 1, DSK_F32, t->par.on ? DSK_COMM_SUM : DSK_COMM_AVG));
    si->loss = l2[0];
    dsk_amp_decision dec;
    si->lr = lr_at(o, t->step + 1);
    if (o->cuda_graph) TM_TRY(graph_decision(t, &dec)); /* the replayed graph applied AdamW, bias and scale updates */
    else TM_TRY(engine_step(t, si, &dec));
    TM_TRY(collect_moe_stats(t, si));
    t->prof_opt += now_s() - t_opt;
    t->prof_opt_cpu += cpu_s() - t_opt_cpu;
    t->step++;
    si->skipped = dec.skip;
    si->norm = dec.norm;
    si->scale = scale;
    si->ms = 1e3 * (now_s() - t0);
    si->cpu_ms = 1e3 * (cpu_s() - c0);
    t->prof_step += si->ms * 1e-3;
    t->prof_step_cpu += si->cpu_ms * 1e-3;
    t->prof_steps++;
    si->tokens_per_s = (double)o->batch * o->accum * o->seq / (si->ms * 1e-3);
    si->mfu = step_mfu(t, si->tokens_per_s);
    si->comm_share = (comm_seconds(t) - comm0) / (si->ms * 1e-3);
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

/* ---- checkpoints */

typedef struct ck_names { char (*name)[112]; dsk_ckpt_entry *e; int n; } ck_names;

static dsk_status ck_barrier(void *user) {
    trainer *t = (trainer *)user;
    return dsk_comm_barrier(&t->ck_comm, t->ck_ctx.device.type == DSK_DEV_CUDA ? &t->ck_ctx : NULL);
}

/* Every rank gets the same checkpoint outcome: a max all-reduce of a few host words (the host
   backend; NCCL would need device buffers, so it keeps the barrier). */
static dsk_status ck_agree(void *user, int64_t *w, int n) {
    trainer *t = (trainer *)user;
    return dsk_comm_all_reduce(&t->ck_comm, NULL, w, w, n, DSK_I64, DSK_COMM_MAX);
}

static void ck_add(ck_names *c, const char *name, const char *suffix, dsk_tensor *tensor, const tm_param *p, const trainer *t) {
    snprintf(c->name[c->n], sizeof c->name[c->n], "%s%s", name, suffix);
    dsk_ckpt_entry *e = &c->e[c->n++];
    memset(e, 0, sizeof *e);
    e->name = c->name[c->n - 1];
    e->tensor = tensor;
    if (p && p->sharded && t->ep > 1) {
        const dsk_moe *moe = &t->model.blocks[t->model.cfg.n_layers - 1].moe; /* every MoE layer splits alike */
        e->split = 1;
        e->row0 = moe->expert0;
        e->global_rows = moe->opts.n_routed;
    }
}

/* Everything a bitwise-exact resume needs: f32 master weights, both moments, the expert
   biases (the compute copies are rebuilt from the masters by the same rounding). With
   --zero/--grad-compress the dsk_zero objects' pieces (flattened tensors; `load`: what this
   rank reads back). */
static ck_names ck_entries(trainer *t, int load) {
    tm_model *m = &t->model;
    ck_names c;
    int cap = 3 * m->n_params + tm_n_blocks(&m->cfg); /* and an expert bias per MoE layer, the MTP blocks' too */
    c.n = 0;
    c.name = (char(*)[112])calloc((size_t)cap, sizeof *c.name);
    c.e = (dsk_ckpt_entry *)calloc((size_t)cap, sizeof *c.e);
    if (!c.name || !c.e) fail(t, "out of memory for the checkpoint list");
    dsk_zero_ckpt_mode mode = load ? DSK_ZERO_CKPT_LOAD : DSK_ZERO_CKPT_SAVE;
    if (t->engine && tz_ckpt_entries(&t->zero, mode, c.e, cap, &c.n) != DSK_OK)
        fail(t, "checkpoint entries: %s", dsk_last_error());
    for (int i = 0; !t->engine && i < m->n_params; i++) {
        tm_param *p = &m->params[i];
        if (!load && p->sharded && t->ep > 1 && t->rank >= t->ep) continue; /* the ranks holding the same experts
                                                                               as rank r % ep write them once */
        ck_add(&c, p->name, "", &p->w, p, t);
        ck_add(&c, p->name, ".adam_m", &p->m, p, t);
        ck_add(&c, p->name, ".adam_v", &p->v, p, t);
    }
    for (int l = m->cfg.n_dense; l < tm_n_blocks(&m->cfg); l++) {
        if (!m->blocks[l].is_moe || (t->par.on && !load && !tp_bias_writer(&t->par))) continue;
        ck_add(&c, m->blocks[l].moe.bias->name, "", &m->blocks[l].moe.bias->value, NULL, t);
        if (t->par.on && t->rank > 0) { /* a box of the whole bias: only the writer of rank 0's file writes whole */
            c.e[c.n - 1].split = DSK_CKPT_BOX;
            c.e[c.n - 1].offset = t->par.layers[l].bias_off;
            c.e[c.n - 1].global_shape = t->par.layers[l].bias_full;
        }
    }
    return c;
}

/* The settings a checkpoint must share with the run that resumes it. */
static void config_string(const trainer *t, char *buf, size_t n) {
    const options *o = t->o;
    snprintf(buf, n, "vocab=%d seq=%d d_model=%d heads=%d layers=%d dense_layers=%d ffn_hidden=%d experts=%d shared=%d "
             "top_k=%d expert_hidden=%d score=%s batch=%d accum=%d dtype=%s seed=%lld", t->model.cfg.vocab, o->seq,
             o->d_model, o->heads, o->layers, o->dense_layers, o->ffn_hidden, o->experts, o->shared, o->top_k,
             o->expert_hidden, o->score, o->batch, o->accum, dsk_dtype_name(t->model.cfg.cdt), o->seed);
    if (t->model.cfg.mla.attn == TMLA_ATTN_MLA || o->mtp > 0) { /* MHA without MTP keeps the older string */
        size_t k = strlen(buf);
        snprintf(buf + k, n - k, " attn=%s q_lora=%d kv_lora=%d qk_nope=%d qk_rope=%d v_head=%d mtp=%d", o->attn,
                 o->q_lora, o->kv_lora, o->qk_nope, o->qk_rope, o->v_head, o->mtp);
    }
    if (t->model.cfg.mla.mtp_moe && o->mtp > 0) { /* dense MTP blocks keep the older string */
        size_t k = strlen(buf);
        snprintf(buf + k, n - k, " mtp_ffn=moe");
    }
}

/* Epoch of the next training sample and its place in this rank's part of that epoch. */
static void data_epoch(const trainer *t, int64_t *epoch, int64_t *offset) {
    int64_t p = t->data_pos / t->dp_size, n = t->loader.smp.num_samples;
    *epoch = p / n;
    *offset = p % n;
}

/* What fixes the order of the samples, apart from the world size. */
static void data_order_string(const trainer *t, char *buf, size_t n) {
    snprintf(buf, n, "DistributedSampler samples=%lld shuffle=%d drop_last=%d seed=%lld", (long long)t->data.n_train,
             !t->o->no_shuffle, t->o->drop_last, t->o->seed);
}

/* A resume continues the same sample order: the corpus and the sampler settings must match.
   A different world size keeps the position (global sequences consumed) but not the order
   DistributedSampler gives each rank: say so. */
static dsk_status check_data_order(trainer *t, const dsk_ckpt_meta *meta, int64_t step) {
    char order[160];
    data_order_string(t, order, sizeof order);
    const char *saved = dsk_ckpt_meta_get(meta, "train.data_order");
    if (!saved || strcmp(saved, order) != 0)
        return dsk_set_error(DSK_ERR_ARG, "checkpoint step %lld in %s read its data as \"%s\", this run as \"%s\"", (long long)step,
                             t->o->ckpt_dir, saved ? saved : "(not recorded)", order);
    int64_t world = 0;
    TM_TRY(dsk_ckpt_meta_i64(meta, "train.data_world", &world));
    if (world != t->dp_size)
        say(t, "resume: the checkpoint's data was read by %lld data-parallel ranks, this run has %d: DistributedSampler "
               "gives each rank another slice, so the samples of the current epoch are not those of an uninterrupted "
               "run (a global batch holds the same samples while no epoch ends)\n", (long long)world, t->dp_size);
    return DSK_OK;
}

/* A sizes-only layer of the model's MoE options on the CPU (every MoE layer takes them), so every
   rank writes and checks the configuration ("moe.top_k", ...) whichever blocks it holds. */
static dsk_status moe_template(const trainer *t, dsk_moe *tmp) {
    const tm_config *c = &t->model.cfg;
    dsk_moe_opts o = c->moe;
    o.name = "moe";
    o.d_model = c->d_model;
    o.dtype = tm_moe_dtype(c->cdt);
    o.seq_len = c->seq;
    o.ep = NULL;
    return dsk_moe_init(tmp, NULL, &o);
}

static int has_moe(const trainer *t) { return t->model.cfg.n_dense < t->model.cfg.n_layers; }

/* The first setting of a configuration string ("k=v k=v ...") that differs, as "k=a" and "k=b". */
static int config_diff(const char *saved, const char *now, char *a, char *b, size_t n) {
    for (const char *p = now; *p;) {
        size_t len = strcspn(p, " "), klen = strcspn(p, "=");
        if (klen < len) {
            const char *q = saved, *found = NULL;
            for (; *q && !found; q += strcspn(q, " "), q += *q == ' ')
                if (!strncmp(q, p, klen + 1)) found = q;
            if (!found || strcspn(found, " ") != len || strncmp(found, p, len)) {
                snprintf(a, n, "%.*s", found ? (int)strcspn(found, " ") : (int)(klen + 1), found ? found : p);
                if (!found) snprintf(a + strlen(a), n - strlen(a), "(unset)");
                snprintf(b, n, "%.*s", (int)len, p);
                return 1;
            }
        }
        p += len;
        p += *p == ' ';
    }
    return 0;
}

static dsk_status save_checkpoint(trainer *t) {
    char kv_val[10][64], cfg[512], order[160];
    dsk_amp_scaler_state st;
    memset(&st, 0, sizeof st);
    TM_TRY(dsk_amp_state_get(&t->scaler, &t->ctx, &st));
    config_string(t, cfg, sizeof cfg);
    snprintf(kv_val[0], 64, "%lld", (long long)t->step);
    snprintf(kv_val[1], 64, "%lld", (long long)t->applied);
    snprintf(kv_val[2], 64, "%lld", (long long)t->data_pos);
    snprintf(kv_val[3], 64, "%a", (double)st.scale);
    snprintf(kv_val[4], 64, "%d", (int)st.growth_tracker);
    snprintf(kv_val[5], 64, "%d", (int)st.hysteresis_left);
    snprintf(kv_val[6], 64, "%lld", (long long)t->o->seed);
    int64_t epoch, offset;
    data_epoch(t, &epoch, &offset);
    snprintf(kv_val[7], 64, "%lld", (long long)epoch);
    snprintf(kv_val[8], 64, "%lld", (long long)offset);
    snprintf(kv_val[9], 64, "%d", t->dp_size);
    data_order_string(t, order, sizeof order);
    dsk_ckpt_kv kv[12 + DSK_MOE_CONFIG_MAX] = {{"train.step", kv_val[0]},         {"train.applied", kv_val[1]},
                                               {"train.data_pos", kv_val[2]},     {"amp.scale", kv_val[3]},
                                               {"amp.growth_tracker", kv_val[4]}, {"amp.hysteresis_left", kv_val[5]},
                                               {"train.data_seed", kv_val[6]},    {"train.config", cfg},
                                               {"train.data_epoch", kv_val[7]},   {"train.data_offset", kv_val[8]},
                                               {"train.data_world", kv_val[9]},   {"train.data_order", order}};
    int n_kv = 12;
    dsk_moe_config mc;
    if (has_moe(t)) { /* the MoE options, each a pair: a resume names the one that differs */
        dsk_moe tmp;
        TM_TRY(moe_template(t, &tmp));
        dsk_status s = dsk_moe_config_get(&tmp, "moe", &mc);
        dsk_moe_free(&tmp, NULL);
        TM_TRY(s);
        for (int i = 0; i < mc.n; i++, n_kv++) {
            kv[n_kv].key = mc.key[i];
            kv[n_kv].value = mc.value[i];
        }
    }
    ck_names c = ck_entries(t, 0);
    dsk_status s = t->o->sync_ckpt ? dsk_ckpt_save(&t->ck, t->step, c.e, c.n, kv, n_kv)
                                   : dsk_ckpt_save_async(&t->ck, t->step, c.e, c.n, kv, n_kv);
    free(c.name);
    free(c.e);
    return s;
}

static dsk_status meta_int(const dsk_ckpt_meta *meta, const char *key, int64_t *v) { return dsk_ckpt_meta_i64(meta, key, v); }

/* Restores weights, moments, biases, scaler, step counters and data position; the
   configuration recorded in the checkpoint is checked first, for a message that says
   which setting differs rather than which tensor. */
static dsk_status load_checkpoint(trainer *t, int64_t step) {
    tm_model *m = &t->model;
    dsk_ckpt_meta meta;
    char cfg[512];
    config_string(t, cfg, sizeof cfg);
    dsk_status s = dsk_ckpt_load(&t->ck, step, NULL, 0, &meta);
    const char *saved = s == DSK_OK ? dsk_ckpt_meta_get(&meta, "train.config") : NULL;
    char was[96], now[96];
    if (s == DSK_OK && saved && strcmp(saved, cfg) != 0 && config_diff(saved, cfg, was, now, sizeof was))
        s = dsk_set_error(DSK_ERR_ARG, "checkpoint step %lld in %s was written with %s, this run has %s (\"%s\")",
                          (long long)step, t->o->ckpt_dir, was, now, saved);
    else if (s == DSK_OK && (!saved || strcmp(saved, cfg) != 0))
        s = dsk_set_error(DSK_ERR_ARG, "checkpoint step %lld in %s was written with \"%s\", this run has \"%s\"", (long long)step,
                          t->o->ckpt_dir, saved ? saved : "(no configuration)", cfg);
    if (s == DSK_OK && has_moe(t)) { /* every MoE option, named when it differs */
        dsk_moe tmp;
        s = moe_template(t, &tmp);
        if (s == DSK_OK) s = dsk_moe_config_check(&tmp, "moe", (const char *const *)meta.keys,
                                                   (const char *const *)meta.values, meta.n);
        dsk_moe_free(&tmp, NULL);
    }
    if (s == DSK_OK) s = check_data_order(t, &meta, step);
    dsk_ckpt_meta_free(&meta);
    if (s != DSK_OK) return s;
    ck_names c = ck_entries(t, 1);
    s = dsk_ckpt_load(&t->ck, step, c.e, c.n, &meta);
    free(c.name);
    free(c.e);
    int64_t st_step = 0, applied = 0, pos = 0, tracker = 0, hyst = 0;
    double scale = 0;
    if (s == DSK_OK) s = meta_int(&meta, "train.step", &st_step);
    if (s == DSK_OK) s = meta_int(&meta, "train.applied", &applied);
    if (s == DSK_OK) s = meta_int(&meta, "train.data_pos", &pos);
    if (s == DSK_OK) s = meta_int(&meta, "amp.growth_tracker", &tracker);
    if (s == DSK_OK) s = meta_int(&meta, "amp.hysteresis_left", &hyst);
    if (s == DSK_OK) s = dsk_ckpt_meta_f64(&meta, "amp.scale", &scale);
    dsk_ckpt_meta_free(&meta);
    if (s != DSK_OK) return s;
    dsk_amp_scaler_state st;
    st.scale = (float)scale;
    st.growth_tracker = (int32_t)tracker;
    st.hysteresis_left = (int32_t)hyst;
    TM_TRY(dsk_amp_state_set(&t->scaler, &t->ctx, &st));
    if (t->engine) TM_TRY(tz_refresh(&t->zero));
    for (int i = 0; !t->engine && i < m->n_params; i++)
        if (m->params[i].wc.data != m->params[i].w.data) TM_TRY(dsk_tensor_copy(&t->ctx, &m->params[i].wc, &m->params[i].w));
    t->step = st_step;
    t->applied = applied;
    t->data_pos = pos;
    return DSK_OK;
}

/* Loads the newest checkpoint whose files are whole: one whose files are damaged (a truncated
   or altered rank file: DSK_ERR_CORRUPT, agreed by every rank) is named and passed over for the
   one saved before it, as dsk_ckpt_load(-1) does; any other failure stops the run. */
static void resume_newest_good(trainer *t) {
    int n = 0;
    CHECK(dsk_ckpt_list(t->o->ckpt_dir, NULL, 0, &n));
    dsk_ckpt_info *all = calloc((size_t)n, sizeof *all);
    if (!all) fail(t, "--resume: out of memory listing %d checkpoints", n);
    CHECK(dsk_ckpt_list(t->o->ckpt_dir, all, n, &n));
    dsk_status s = DSK_ERR_CORRUPT;
    for (int i = 0; i < n && s == DSK_ERR_CORRUPT; i++) {
        s = load_checkpoint(t, all[i].step);
        if (s == DSK_ERR_CORRUPT)
            say(t, "resume: checkpoint step %lld in %s is damaged (%s); trying the one saved before it\n",
                (long long)all[i].step, t->o->ckpt_dir, dsk_last_error());
    }
    free(all);
    if (s != DSK_OK)
        fail(t, "--resume from %s failed, nothing was written: %s: %s", t->o->ckpt_dir, dsk_status_str(s),
             s == DSK_ERR_CORRUPT ? "every checkpoint is damaged" : dsk_last_error());
}

/* Opens --ckpt-dir; with --resume loads its newest good checkpoint. A run that cannot
   resume exits before it could write anything; a fresh run refuses a directory that holds
   checkpoints, so no run ever overwrites one by accident. */
static void setup_ckpt(trainer *t) {
    options *o = t->o;
    int restart = ts_restart_count();
    if (!o->ckpt_dir) {
        if (o->resume) fail(t, "--resume needs --ckpt-dir");
        if (restart > 0) say(t, "restart %d: no --ckpt-dir, starting again from step 0\n", restart);
        return;
    }
    if (restart > 0 && !o->resume) {
        say(t, "restart %d: resuming from the newest complete checkpoint in %s (as --resume auto)\n", restart, o->ckpt_dir);
        o->resume = 1;
    }
    dsk_ckpt_opts co;
    memset(&co, 0, sizeof co);
    co.rank = t->rank;
    co.world_size = t->world;
    co.barrier = t->world > 1 ? ck_barrier : NULL;
    co.barrier_user = t;
    co.agree = t->world > 1 && t->ck_comm.backend == DSK_COMM_HOST ? ck_agree : NULL;
    co.agree_user = t;
    co.keep_last = o->keep;
    co.ctx = &t->ctx;
    if (t->world > 1 && t->ctx.device.type == DSK_DEV_CUDA) {
        dsk_ctx_opts xo;
        memset(&xo, 0, sizeof xo);
        xo.device = DSK_PREFER_CUDA;
        xo.cuda_index = t->ctx.device.index;
        xo.workspace_bytes = 1 << 20;
        CHECK(dsk_ctx_init(&t->ck_ctx, &xo));
    }
    CHECK(dsk_ckpt_init(&t->ck, o->ckpt_dir, &co));
    t->have_ck = 1;
    int64_t last = -1;
    CHECK(dsk_ckpt_latest(o->ckpt_dir, &last));
    if (!o->resume) {
        if (last >= 0)
            fail(t, "--ckpt-dir %s already holds checkpoints (newest: step %lld); pass --resume to continue from it or "
                    "choose another directory", o->ckpt_dir, (long long)last);
        return;
    }
    if (last < 0) {
        say(t, "resume: no complete checkpoint in %s yet, starting at step 0\n", o->ckpt_dir);
        return;
    }
    resume_newest_good(t);
    int64_t epoch, offset;
    data_epoch(t, &epoch, &offset);
    say(t, "resume: step %lld from %s (data position %lld: epoch %lld, sample %lld of %lld on each rank)\n", (long long)t->step,
        o->ckpt_dir, (long long)t->data_pos, (long long)epoch, (long long)offset, (long long)t->loader.smp.num_samples);
}

/* ---- output */

/* A number for JSON: %.9g (exact for f32), null when not finite (JSON has no NaN/Inf). */
static const char *json_num(char buf[32], double x) {
    if (isfinite(x)) snprintf(buf, 32, "%.9g", x);
    else snprintf(buf, 32, "null");
    return buf;
}

static void log_step(trainer *t, const step_info *si) {
    const options *o = t->o;
    t->train_seconds += si->ms * 1e-3;
    t->steps_timed++;
    double eta = t->train_seconds / (double)t->steps_timed * (double)(o->steps - t->step);
    if (t->rank == 0 && (t->step % o->log_every == 0 || t->step == o->steps || t->step == 1))
        printf("step %5lld/%d | loss %.4f | lr %.2e | norm %6.3f | scale %g | %7.1f ms | %7.0f tok/s | mfu %5.2f%% | comm %4.1f%% | "
               "data %4.1f%% | load %.2f | drop %lld | eta %dm%02ds%s\n",
               (long long)t->step, o->steps, si->loss, si->lr, si->norm, (double)si->scale, si->ms, si->tokens_per_s,
               100 * si->mfu, 100 * si->comm_share, 100 * si->data_ms / si->ms, si->load_ratio, (long long)si->dropped,
               (int)eta / 60, (int)eta % 60, si->skipped ? " | skipped (non-finite gradients)" : "");
    fflush(stdout);
    if (t->log) {
        char loss[32], norm[32];
        fprintf(t->log,
                "{\"type\":\"step\",\"step\":%lld,\"loss\":%s,\"aux_loss\":%.9g,\"lr\":%.9g,\"grad_norm\":%s,\"loss_scale\":%.9g,"
                "\"ms\":%.3f,\"cpu_ms\":%.3f,\"data_wait_ms\":%.3f,\"grad_sync_ms\":%.3f,\"tokens_per_s\":%.1f,\"mfu\":%.6f,"
                "\"comm_share\":%.6f,\"load_max_mean\":%.6f,\"dropped\":%lld,\"skipped\":%d,\"eta_s\":%.1f,"
                "\"reduce_bytes\":%.0f,\"reduce_bytes_uncompressed\":%.0f}\n",
                (long long)t->step, json_num(loss, si->loss), si->aux_loss, si->lr, json_num(norm, si->norm), (double)si->scale, si->ms,
                si->cpu_ms, si->data_ms, si->sync_ms, si->tokens_per_s, si->mfu, si->comm_share, si->load_ratio, (long long)si->dropped,
                si->skipped, eta, si->reduce_bytes, si->plain_bytes);
    }
    if (t->log) fflush(t->log);
}

static void log_val(trainer *t, float v) {
    char val[32];
    t->last_val = v;
    say(t, "step %5lld | validation loss %.4f (%.3f bits/token)\n", (long long)t->step, (double)v, v / log(2.0));
    if (t->log) {
        fprintf(t->log, "{\"type\":\"val\",\"step\":%lld,\"val_loss\":%s}\n", (long long)t->step, json_num(val, v));
        fflush(t->log);
    }
}

/* --metrics FILE of this rank: FILE on rank 0, FILE.rank<r> (before a .prom suffix) on the others. */
static void metrics_file_name(const trainer *t, char *buf, size_t n) {
    const char *f = t->o->metrics_path;
    size_t k = strlen(f);
    int prom = k > 5 && strcmp(f + k - 5, ".prom") == 0;
    if (t->rank == 0) snprintf(buf, n, "%s", f);
    else snprintf(buf, n, "%.*s.rank%d%s", (int)(prom ? k - 5 : k), f, t->rank, prom ? ".prom" : "");
}

/* Starts the metrics server (--metrics-port + local rank) and the GPU probes. */
static void setup_metrics(trainer *t) {
    const options *o = t->o;
    tm_model *m = &t->model;
    t->metrics_on = o->metrics_path || o->metrics_port;
    if (!t->metrics_on) return;
    if (o->metrics_port < 0) fail(t, "--metrics-port %d: must be in 1..65535 (0 = off)", o->metrics_port);
    int n_moe = m->cfg.n_layers - m->cfg.n_dense, local = t->have_comm ? t->comm.local_rank : 0;
    size_t layers = (size_t)(n_moe > 0 ? n_moe : 1), experts = (size_t)(o->experts > 0 ? o->experts : 1);
    t->moe_layer = (int *)calloc(layers, sizeof *t->moe_layer);
    t->moe_load = (double *)calloc(layers * experts, sizeof *t->moe_load);
    t->moe_imbalance = (double *)calloc(layers, sizeof *t->moe_imbalance);
    if (!t->moe_layer || !t->moe_load || !t->moe_imbalance) fail(t, "out of memory for the metrics");
    tmx_values *v = &t->mv;
    v->rank = t->rank;
    v->n_layers = n_moe;
    v->n_experts = o->experts;
    v->layer = t->moe_layer;
    v->expert_load = t->moe_load;
    v->imbalance = t->moe_imbalance;
    v->val_loss = NAN;
    v->restarts = ts_restart_count();
    for (int l = 0; l < n_moe; l++) t->moe_layer[l] = m->cfg.n_dense + l;
    tmx_gpu_open(&t->gpu, local);
    if (o->metrics_port) {
        CHECK(tmx_server_start(&t->msrv, o->metrics_addr, o->metrics_port + local));
        printf("metrics: rank %d serves http://%s:%d/metrics\n", t->rank, o->metrics_addr, o->metrics_port + local);
        fflush(stdout);
    }
}

/* Bytes of the tensors one checkpoint of this rank holds. */
static double checkpoint_bytes(trainer *t) {
    ck_names c = ck_entries(t, 0);
    double bytes = 0;
    for (int i = 0; i < c.n; i++) bytes += (double)dsk_tensor_nbytes(c.e[i].tensor);
    free(c.name);
    free(c.e);
    return bytes;
}

/* save_checkpoint, counted for the metrics. */
static dsk_status save_counted(trainer *t) {
    double t0 = now_s();
    dsk_status s = save_checkpoint(t);
    t->mv.checkpoint_s += now_s() - t0;
    if (s == DSK_OK) {
        t->mv.checkpoints++;
        if (t->metrics_on) t->mv.checkpoint_bytes += checkpoint_bytes(t);
    }
    return s;
}

/* Counts the step (si may be NULL: no new step) and publishes the metrics: the server's
   page and the --metrics file. */
static void write_metrics(trainer *t, const step_info *si) {
    const options *o = t->o;
    tmx_values *v = &t->mv;
    if (!t->metrics_on) return;
    if (si) {
        v->steps = t->step;
        v->skipped_steps += si->skipped;
        v->tokens += (int64_t)t->batch_local * o->accum * o->seq;
        v->dropped_slots += si->dropped;
        v->data_wait_s += si->data_ms * 1e-3;
        v->grad_sync_s += si->sync_ms * 1e-3;
        tmx_hist_observe(&v->step_time, si->ms * 1e-3);
        v->loss = si->loss;
        v->lr = si->lr;
        v->grad_norm = si->norm;
        v->loss_scale = si->scale;
        v->mfu = si->mfu;
        v->comm_ratio = si->comm_share;
        v->data_ratio = si->data_ms / si->ms;
    }
    int64_t epoch, offset;
    data_epoch(t, &epoch, &offset);
    v->epoch = (double)epoch;
    v->comm_s = comm_seconds(t);
    if (t->last_val > 0) v->val_loss = t->last_val;
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) == 0) v->host_memory_high_water_bytes = 1024.0 * (double)ru.ru_maxrss;
    tmx_gpu_read(&t->gpu, t->ctx.device.type == DSK_DEV_CUDA, v);
    for (int l = 0; l < v->n_layers; l++) {
        const dsk_moe_stats *st = &t->model.blocks[v->layer[l]].stats;
        for (int e = 0; e < v->n_experts; e++)
            t->moe_load[l * v->n_experts + e] =
                st->tokens_per_expert && st->slots > 0 ? (double)st->tokens_per_expert[e] / (double)st->slots : 0;
        t->moe_imbalance[l] = st->mean_load > 0 ? st->max_load / st->mean_load : 1;
    }
    tmx_render(&t->mtext, v);
    tmx_server_publish(&t->msrv, &t->mtext);
    if (o->metrics_path) {
        char path[4096];
        metrics_file_name(t, path, sizeof path);
        CHECK(tmx_write_file(path, &t->mtext));
    }
}

static int64_t slab_bytes(const dsk_tensor *t) { return t->data ? (int64_t)dsk_tensor_nbytes(t) : 0; }

/* Every rank: the bytes of its parameters, gradients and optimizer state (the allocator's
   figures: dsk_zero's per role, or the model's slabs), and of the activations and MoE
   workspaces, which this trainer allocates up front (the allocator's count over the model's
   setup, less the slabs): their high-water mark. */
static void memory_state(trainer *t, dsk_zero_memory *z) {
    const tm_model *m = &t->model;
    memset(z, 0, sizeof *z);
    if (t->engine) tz_memory(&t->zero, z);
    else {
        z->params = slab_bytes(m->slab_wc.data ? &m->slab_wc : &m->slab_w);
        z->grads = slab_bytes(&m->slab_g);
        z->optimizer = slab_bytes(&m->slab_m) + slab_bytes(&m->slab_v) + (m->slab_wc.data ? slab_bytes(&m->slab_w) : 0);
    }
}
static void print_memory(trainer *t) {
    dsk_zero_memory z;
    memory_state(t, &z);
    int64_t slabs = t->engine ? 0 : z.params + z.grads + z.optimizer;
    printf("memory, rank %d: parameters %.3f MiB, gradients %.3f MiB, optimizer state %.3f MiB, compression buffers "
           "%.3f MiB, activations (high-water mark) %.3f MiB%s\n",
           t->rank, z.params / 1048576.0, z.grads / 1048576.0, z.optimizer / 1048576.0, z.comm / 1048576.0,
           (double)(t->mem_model - slabs) / 1048576.0,
           t->zopts.stage == 0 ? " (--zero 0: every rank holds everything)" : "");
    printf("memory bytes, rank %d: parameters %lld, gradients %lld, optimizer state %lld, compression buffers %lld, "
           "activations %lld\n",
           t->rank, (long long)z.params, (long long)z.grads, (long long)z.optimizer, (long long)z.comm,
           (long long)(t->mem_model - slabs));
    fflush(stdout);
}

/* At start: the attention, MTP and recomputation settings; at the end: every rank's training
   state and the allocator's high-water mark over the run (train_mla.h). */
static void report_mla(trainer *t, const char *when) {
    const options *o = t->o;
    char line[512];
    if (strcmp(when, "start") == 0) {
        if (t->model.cfg.mla.attn == TMLA_ATTN_MLA)
            say(t, "attention: MLA, q_lora_rank %d, kv_lora_rank %d, qk dims %d nope + %d rope, v dims %d, "
                   "softmax scale %.5f\n", o->q_lora, o->kv_lora, o->qk_nope, o->qk_rope, o->v_head,
                (double)tmla_scale(&t->model.cfg));
        else
            say(t, "attention: MHA, %d heads of %d\n", o->heads, o->d_model / o->heads);
        say(t, "multi-token prediction: depth %d%s, lambda %g; recompute: %s\n", o->mtp, o->mtp ? "" : " (off)",
            o->mtp_lambda, o->recompute);
        return; /* print_memory gave the memory at start */
    }
    dsk_zero_memory z;
    memory_state(t, &z);
    tmla_memory_line(t->ctx.device, (double)z.params, (double)z.grads, (double)z.optimizer + (double)z.comm, t->rank,
                     when, line, sizeof line);
    printf("%s", line);
    fflush(stdout);
}

static void banner(trainer *t) {
    const options *o = t->o;
    const tm_model *m = &t->model;
    int64_t total = 0;
    for (int i = 0; i < m->n_params; i++) total += tm_param_numel(&m->params[i]);
    say(t, "train_moe: %d rank%s (expert parallel %d), %s, %s compute\n", t->world, t->world > 1 ? "s" : "", t->ep,
        t->ctx.device.type == DSK_DEV_CUDA ? "CUDA" : "CPU", dsk_dtype_name(m->cfg.cdt));
    say(t, "data: %s; %lld training and %lld held-out windows of %d tokens\n", t->data.source, (long long)t->data.n_train,
        (long long)t->data.n_val, o->seq + 1);
    const td_sampler *smp = &t->loader.smp;
    say(t, "data order: DistributedSampler over %d rank%s, %lld samples per rank and epoch (%lld %s), %s; %d batches read ahead\n",
        t->world, t->world > 1 ? "s" : "", (long long)smp->num_samples, (long long)llabs(smp->total_size - smp->n),
        smp->drop_last ? "cut" : "padded", smp->shuffle ? "shuffled by seed + epoch" : "in order", o->prefetch);
    say(t, "model: %d blocks (%d dense), d_model %d, %d heads, vocab %d; MoE %d routed (%s, top-%d) + %d shared, expert hidden %d; "
           "%.2fM parameters on rank 0, %.1f MFLOP/token (active)\n",
        o->layers, o->dense_layers, o->d_model, o->heads, m->cfg.vocab, o->experts, o->score, o->top_k, o->shared, o->expert_hidden,
        total / 1e6, t->flops_per_token / 1e6);
    if (t->have_comm) {
        const dsk_par_dims *d = &t->par.grid.dims;
        say(t, "rank grid: tp %d x dp %d (ep %d inside) x pp %d = %d ranks; world rank = tp_i + tp (dp_i + dp pp_i)\n",
            d->tp, d->dp, d->ep, d->pp, t->world);
    }
    if (t->par.on) {
        const tp_state *ps = &t->par;
        say(t, "parallel model: %d heads, FFN %d and vocabulary %d split over tp %d (sequence-parallel norms, "
               "vocabulary-parallel loss), MoE layers on each tp rank's tokens; pipeline %s, %d stage%s x %d virtual, "
               "%d micro-batches of %d sequences, bubble %.3f, at most %d in flight on rank 0 of the pipeline\n",
            o->heads, o->ffn_hidden, m->cfg.vocab, ps->tp, dsk_par_schedule_name(ps->kind), ps->pp, ps->pp > 1 ? "s" : "",
            ps->v, ps->M, ps->Bm, dsk_par_bubble_fraction(ps->kind, ps->pp, ps->M, ps->v),
            dsk_par_in_flight_bound(ps->kind, ps->pp, ps->M, ps->v, 0));
    }
    report_mla(t, "start");
    if (t->engine) {
        double all, comp;
        tz_powersgd_elements(m, t->zopts.psgd_rank, &comp, &all);
        say(t, "zero: stage %d over %d rank%s (experts over %d), gradient reductions %s", o->zero, t->world,
            t->world > 1 ? "s" : "", t->have_comm ? t->rep_comm.world_size : 1, o->grad_compress);
        if (t->zopts.compress == DSK_ZERO_COMPRESS_POWERSGD)
            say(t, " from pass %d: %.0f of %.0f elements, %.3fx fewer bytes", t->zopts.psgd_start, comp, all, all / comp);
        else if (t->zopts.compress == DSK_ZERO_COMPRESS_BF16)
            say(t, ": 2x fewer bytes");
        say(t, "\n");
    }
    if (o->cuda_graph)
        say(t, "cuda graph: each step replays one captured graph (every micro-batch's forward, loss and backward, "
               "unscale, skip/clip decision, AdamW, bias and loss-scale updates)\n");
    say(t, "batch %d x %d tokens x %d accum, %d steps, lr %g (warm-up %d, cosine to %g), clip %g\n", o->batch, o->seq,
        o->accum, o->steps, o->lr, o->warmup, o->min_lr, o->clip);
    char how[96];
    if (o->peak_tflops > 0) snprintf(how, sizeof how, "given by --peak-tflops");
    else if (t->ctx.device.type == DSK_DEV_CUDA) snprintf(how, sizeof how, "H100/H200 bf16 datasheet");
    else
        snprintf(how, sizeof how, "measured at start: best of %d 512^3 f32 GEMMs on %d thread%s", CPU_PEAK_REPS,
                 t->ctx.n_threads, t->ctx.n_threads > 1 ? "s" : "");
    say(t, "mfu: model FLOPs per second over a peak of %.3g GFLOP/s per rank (%s) x %d rank%s, or over the fastest "
           "step's rate if a step runs faster\n", t->peak_flops / 1e9, how, t->world, t->world > 1 ? "s" : "");
    if (t->ctx.device.type == DSK_DEV_CPU) {
        char isa[64];
        say(t, "cpu gemm: %s, %d thread%s per rank, OpenMP spin %s\n", dsk_cpu_gemm_describe(t->ctx.cpu_isa, isa, sizeof isa),
            t->ctx.n_threads, t->ctx.n_threads > 1 ? "s" : "", getenv("GOMP_SPINCOUNT") ? getenv("GOMP_SPINCOUNT") : "default");
    }
}

/* --profile: clears the phase times (after the warm-up steps) and prints their means. */
static void profile_clear(trainer *t) {
    memset(t->model.phase_s, 0, sizeof t->model.phase_s);
    memset(t->model.phase_cpu_s, 0, sizeof t->model.phase_cpu_s);
    t->prof_data = t->prof_opt = t->prof_step = 0;
    t->prof_data_cpu = t->prof_opt_cpu = t->prof_step_cpu = 0;
    t->prof_steps = 0;
}

static void profile_report(const trainer *t) {
    const tm_model *m = &t->model;
    double n = (double)(t->prof_steps > 0 ? t->prof_steps : 1), step = t->prof_step / n * 1e3, known = 0;
    double step_cpu = t->prof_step_cpu / n * 1e3, known_cpu = 0;
    char isa[64];
    if (t->prof_steps == 0) return;
    say(t, "profile: %lld steps after the warm-up, %.1f ms/step wall, %.1f ms/step CPU (all threads; what other programs "
        "on the cores disturb least), %d thread%s, cpu gemm: %s\n", (long long)t->prof_steps, step, step_cpu,
        t->ctx.n_threads, t->ctx.n_threads > 1 ? "s" : "", dsk_cpu_gemm_describe(t->ctx.cpu_isa, isa, sizeof isa));
    say(t, "  %-52s %10s  %6s %10s  %6s\n", "phase", "wall ms", "share", "CPU ms", "share");
    for (int p = 0; p < TM_PH_COUNT; p++) {
        double ms = m->phase_s[p] / n * 1e3, cms = m->phase_cpu_s[p] / n * 1e3;
        known += ms;
        known_cpu += cms;
        say(t, "  %-52s %10.2f  %5.1f%% %10.2f  %5.1f%%\n", tm_phase_names[p], ms, 100 * ms / step, cms, 100 * cms / step_cpu);
    }
    say(t, "  %-52s %10.2f  %5.1f%% %10.2f  %5.1f%%\n", "data (batch loading)", t->prof_data / n * 1e3,
        100 * t->prof_data / n * 1e3 / step, t->prof_data_cpu / n * 1e3, 100 * t->prof_data_cpu / n * 1e3 / step_cpu);
    say(t, "  %-52s %10.2f  %5.1f%% %10.2f  %5.1f%%\n", "optimizer (reduce, unscale, clip, AdamW, bias)",
        t->prof_opt / n * 1e3, 100 * t->prof_opt / n * 1e3 / step, t->prof_opt_cpu / n * 1e3,
        100 * t->prof_opt_cpu / n * 1e3 / step_cpu);
    known += (t->prof_data + t->prof_opt) / n * 1e3;
    known_cpu += (t->prof_data_cpu + t->prof_opt_cpu) / n * 1e3;
    say(t, "  %-52s %10.2f  %5.1f%% %10.2f  %5.1f%%\n", "other (zero grads, loss read, step bookkeeping)", step - known,
        100 * (step - known) / step, step_cpu - known_cpu, 100 * (step_cpu - known_cpu) / step_cpu);
}

/* ---- gradient check */

/* The objective backward differentiates: mean cross-entropy plus the MoE balancing losses. */
static dsk_status objective(trainer *t, double *out) {
    tm_model *m = &t->model;
    float loss;
    TM_TRY(tm_forward(m, t->batch_local));
    TM_TRY(dsk_cross_entropy(&t->ctx, &m->loss, NULL, &m->logits, &m->targets, -1, 1.0f));
    TM_TRY(read_loss(t, &loss));
    *out = loss;
    for (int l = m->cfg.n_dense; l < tm_n_blocks(&m->cfg); l++) *out += m->blocks[l].stats.loss; /* MTP blocks' too */
    double mtp;
    TM_TRY(tmla_mtp_objective(m, &mtp)); /* lambda / D sum_k L_k */
    *out += mtp;
    return DSK_OK;
}

/* Central difference of the objective along element j of w with step h. */
static double central_diff(trainer *t, float *w, int64_t j, double h) {
    double lp, lm;
    float w0 = w[j];
    w[j] = w0 + (float)h;
    CHECK(objective(t, &lp));
    w[j] = w0 - (float)h;
    CHECK(objective(t, &lm));
    w[j] = w0;
    return (lp - lm) / (2 * h);
}

/* --grad-check N: backward's gradient of N elements of every parameter against central
   differences of the f32 objective on one batch. Top-k routing makes the objective piecewise
   smooth: an element whose differences at h and 2h disagree sits near a routing switch and
   is replaced by another (up to 4N tries). A wrong or missing backward term shows as an error
   of several times the bound; f32 rounding stays well below it. */
static int grad_check(trainer *t) {
    tm_model *m = &t->model;
    if (m->cfg.cdt != DSK_F32 || t->world != 1 || t->ctx.device.type != DSK_DEV_CPU || !t->engine ||
        t->zopts.stage != 0 || t->zopts.compress != DSK_ZERO_COMPRESS_NONE || t->par.on)
        fail(t, "--grad-check needs --dtype f32, one rank, the CPU and --zero 0 --grad-compress none");
    CHECK(load_train_batch(t));
    CHECK(tz_begin(&t->zero, 1));
    m->aux_scale = 1.0f;
    m->want_stats = 1; /* the objective reads each forward's MoE loss terms */
    CHECK(tm_forward(m, t->batch_local));
    CHECK(tm_loss(m, 1.0f));
    CHECK(tm_backward(m));
    CHECK(tz_wait(&t->zero)); /* one rank: the gradients as backward left them */
    int bad = 0, n_check = t->o->grad_check;
    for (int i = 0; i < m->n_params; i++) {
        tm_param *p = &m->params[i];
        float *w = (float *)p->w.data, *g = (float *)p->g.data;
        int64_t n = dsk_tensor_numel(&p->w);
        double gmax = 0, worst = 0, h = p->moe_layer >= 0 && strstr(p->name, ".router") ? 3e-3 : 1e-2;
        int checked = 0, kinks = 0;
        for (int64_t j = 0; j < n; j++) gmax = fmax(gmax, fabs(g[j]));
        for (int k = 0; k < 4 * n_check && checked < n_check; k++) {
            int64_t j = (int64_t)(dsk_rng_uniform_at(7, (uint64_t)i, (uint64_t)k) * (float)n) % n;
            double fd = central_diff(t, w, j, h), fd2 = central_diff(t, w, j, 2 * h);
            if (fabs(fd - fd2) > 0.05 * fabs(fd) + 0.005 * gmax + 1e-5) { kinks++; continue; }
            double err = fabs(fd - g[j]) / (0.02 * fabs(fd) + 0.01 * gmax + 1e-5);
            if (err > worst) worst = err;
            checked++;
        }
        int off = worst > 1 || checked == 0;
        say(t, "grad-check %-28s |g|max %.3e  %d checked, %d near a routing switch, worst error / bound %.3f%s\n", p->name, gmax,
            checked, kinks, worst, off ? "  FAIL" : "");
        bad += off;
    }
    say(t, "grad-check: %d of %d parameters off\n", bad, m->n_params);
    return bad ? 1 : 0;
}

/* ---- launcher and main */

/* OpenMP threads that spin for a while at every join hold a core the other threads of a busy
   machine need: with 2 threads on 2 shared cores a step took 5x longer under load (bench/RESULTS.md,
   Training). Unless the user chose a wait policy, re-run this program once with a short spin
   (libgomp) and block time (LLVM's libomp); the runtimes read these only at start-up. */
static void short_omp_spin(char **argv) {
    if (getenv("OMP_WAIT_POLICY") || getenv("GOMP_SPINCOUNT") || getenv("KMP_BLOCKTIME")) return;
    setenv("GOMP_SPINCOUNT", "1000", 1);
    setenv("KMP_BLOCKTIME", "1", 1);
    execv("/proc/self/exe", argv); /* returns only on failure: then run on as we are */
}

/* --nproc N: re-runs this binary N times through dsk_comm's local launcher (restarting the
   job after a failure up to --max-restarts times). */
static int launch_local(const options *o, int argc, char **argv) {
    char exe[4096];
    ssize_t k = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (k <= 0) { fprintf(stderr, "train_moe: --nproc: cannot find this program: %s\n", strerror(errno)); return 1; }
    exe[k] = 0;
    char **args = (char **)calloc((size_t)argc + 1, sizeof *args);
    if (!args) return 1;
    int n = 0;
    args[n++] = exe;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--nproc") == 0) { i++; continue; }
        args[n++] = argv[i];
    }
    int rc = ts_launch(o->nproc > 1 ? o->nproc : 1, o->max_restarts, args);
    free(args);
    return rc;
}

/* SIGTERM or SIGINT on any rank, SIGUSR1 on any rank: agreed by every rank at the end of
   each step (a MAX over ranks), so all stop or save at the same step. */
static void poll_signals(trainer *t, int *stop, int *save) {
    int32_t v[2] = {ts_stop_signal(&t->sig), ts_take_save(&t->sig)};
    CHECK(allreduce_host(t, &t->comm, v, 2, DSK_I32, DSK_COMM_MAX));
    *stop = v[0];
    *save = v[1];
}

/* The line a pre-empted job ends with. */
static void report_stop(trainer *t, int sig) {
    char after[64] = "";
    if (ts_stop_signal(&t->sig)) snprintf(after, sizeof after, ", %.2f s after the signal", ts_now() - t->sig.stop_at);
    if (t->have_ck)
        say(t, "pre-empted: %s, stopped after step %lld, checkpoint of step %lld saved in %s; exiting with status 0%s\n",
            ts_signal_name(sig), (long long)t->step, (long long)t->step, t->o->ckpt_dir, after);
    else
        say(t, "pre-empted: %s, stopped after step %lld; no --ckpt-dir, nothing saved; exiting with status 0%s\n",
            ts_signal_name(sig), (long long)t->step, after);
}

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
    if (o->export_hf && strcmp(o->export_dtype, "f32") != 0 && strcmp(o->export_dtype, "bf16") != 0 &&
        strcmp(o->export_dtype, "fp8") != 0)
        fail(t, "--export-dtype \"%s\": use f32, bf16 or fp8", o->export_dtype);
    if (o->export_hf &&
        (o->tp > 1 || o->pp > 1 || o->ep > 1 || t->zopts.stage > 0 || t->zopts.compress != DSK_ZERO_COMPRESS_NONE))
        fail(t, "--export-hf runs without --tp, --pp, --ep, --zero and --grad-compress in this trainer");
    if (o->export_hf && !o->init_from_hf && strcmp(o->attn, "mla") != 0)
        fail(t, "--export-hf writes DeepSeek's MLA layout: use --attn mla (or --init-from-hf)");
    if (o->export_hf && !o->init_from_hf && strcmp(o->score, "softmax") == 0 && o->bias_rate > 0)
        fail(t, "--export-hf of a softmax-routed model writes DeepseekV2, which has no expert bias: pass "
                "--bias-rate 0");
    if (!o->init_from_hf) return;
    if (o->tp > 1 || o->pp > 1)
        fail(t, "--init-from-hf runs without --tp and --pp in this trainer (the hub's tensors are read whole, not as "
                "tensor-parallel boxes or pipeline stages)");
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

static void check_options(trainer *t) {
    const options *o = t->o;
    if (o->steps < 1) fail(t, "--steps %d: must be at least 1", o->steps);
    if (o->accum < 1) fail(t, "--accum %d: must be at least 1", o->accum);
    if (o->batch < 1) fail(t, "--batch %d: must be at least 1", o->batch);
    if (o->val_interval < 1 || o->val_batches < 1 || o->log_every < 1)
        fail(t, "--val-interval %d, --val-batches %d, --log-every %d: must be at least 1", o->val_interval, o->val_batches, o->log_every);
    if (o->warmup < 0 || o->ckpt_every < 0 || o->keep < 0 || o->sample_len < 0 || o->stop_at < 0)
        fail(t, "--warmup, --ckpt-every, --keep, --sample-len, --stop-at must be >= 0");
    if (o->zero < 0 || o->zero > 3) fail(t, "--zero %d: use 0, 1, 2 or 3", o->zero);
    if (!tz_parse_compress(o->grad_compress, &t->zopts))
        fail(t, "--grad-compress \"%s\": use none, bf16 or powersgd:R[:START] (R >= 1, START >= 0)", o->grad_compress);
    t->zopts.stage = o->zero;
    t->engine = !o->cuda_graph;
    if (o->cuda_graph && (o->zero > 0 || t->zopts.compress != DSK_ZERO_COMPRESS_NONE))
        fail(t, "--cuda-graph runs without --zero and --grad-compress");
    if (!(o->lr > 0) || o->min_lr < 0 || o->wd < 0 || o->clip < 0 || o->beta1 < 0 || o->beta1 >= 1 || o->beta2 < 0 || o->beta2 >= 1)
        fail(t, "--lr %g (> 0), --min-lr %g, --wd %g, --clip %g (>= 0), --beta1 %g, --beta2 %g (in [0, 1)) out of range", o->lr,
             o->min_lr, o->wd, o->clip, o->beta1, o->beta2);
}

int main(int argc, char **argv) {
    options o;
    set_defaults(&o);
    if (apply_preset(&o, argc, argv) != 0) return 2;
    int rc = parse_args(&o, argc, argv);
    if (!rc && o.plan) rc = apply_plan(&o);
    if (rc) return rc;
    if (o.help) { usage(stdout); return 0; }
    short_omp_spin(argv);
    if (o.nproc < 0) { fprintf(stderr, "train_moe: --nproc %d: must be >= 1\n", o.nproc); return 2; }
    if (o.max_restarts < 0) { fprintf(stderr, "train_moe: --max-restarts %d: must be >= 0\n", o.max_restarts); return 2; }
    if ((o.nproc > 1 || o.max_restarts > 0) && !getenv("RANK")) return launch_local(&o, argc, argv);

    trainer tr, *t = &tr;
    memset(t, 0, sizeof *t);
    t->o = &o;
    int e = ts_start(&t->sig); /* before any thread starts */
    if (e != 0) fail(t, "cannot start the signal thread: %s", strerror(e));
    check_options(t);
    hf_options(t);
    setup_comm(t);
    setup_bind(t);
    setup_device(t);
    setup_data(t);
    int64_t live0 = dsk_tensor_mem_stats(t->ctx.device).live_bytes;
    setup_model(t);
    t->mem_model = dsk_tensor_mem_stats(t->ctx.device).live_bytes - live0;
    setup_optimizer(t);
    setup_engine(t);
    setup_loss_span(t);
    import_hf(t);
    setup_routes(t);
    if (o.cuda_graph && (t->ctx.device.type != DSK_DEV_CUDA || t->world > 1))
        fail(t,
             "--cuda-graph needs one rank on a GPU (this run: %d ranks on %s): the gradient reductions of several "
             "ranks synchronise through host-side events that a graph cannot hold",
             t->world, t->ctx.device.type == DSK_DEV_CUDA ? "GPUs" : "the CPU");
    if (o.cuda_graph && o.profile)
        fail(t, "--cuda-graph and --profile exclude each other: --profile synchronises the device after each op, "
                "which a graph capture cannot hold");
    setup_metrics(t);
    t->flops_per_token = flops_per_token(t);
    t->peak_flops = o.peak_tflops > 0 ? o.peak_tflops * 1e12 : t->ctx.device.type == DSK_DEV_CUDA ? 989e12 : measure_cpu_peak(t);
    t->job_peak = t->world * t->peak_flops;
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
    t->t_start = now_s();
    int64_t last_saved = t->step;
    int stop_sig = 0;
    t->model.profile = o.profile;
    while (t->step < o.steps && !(o.stop_at > 0 && t->step >= o.stop_at)) {
        step_info si;
        double waited = t->data_wait_s;
        if (o.profile && t->step == (o.steps >= 20 ? 10 : o.steps / 2)) profile_clear(t); /* warm-up done */
        CHECK(train_step(t, &si));
        si.data_ms = 1e3 * (t->data_wait_s - waited);
        log_step(t, &si);
        if (t->step % o.val_interval == 0 || t->step == o.steps) {
            float v;
            t->model.profile = 0; /* --profile times training steps only */
            CHECK(validate(t, &v));
            t->model.profile = o.profile;
            log_val(t, v);
        }
        if (t->have_ck && o.ckpt_every > 0 && t->step % o.ckpt_every == 0) {
            CHECK(save_counted(t));
            last_saved = t->step;
        }
        write_metrics(t, &si);
        int save;
        poll_signals(t, &stop_sig, &save);
        if (save) {
            if (t->have_ck && last_saved != t->step) {
                CHECK(save_counted(t));
                last_saved = t->step;
            }
            if (t->have_ck) say(t, "SIGUSR1: checkpoint of step %lld saved; training goes on\n", (long long)t->step);
            else say(t, "SIGUSR1 at step %lld: no --ckpt-dir, nothing saved; training goes on\n", (long long)t->step);
        }
        if (stop_sig) break;
    }
    if (t->have_ck) {
        if (last_saved != t->step) CHECK(save_counted(t));
        double t0 = now_s();
        CHECK(dsk_ckpt_wait(&t->ck));
        t->mv.checkpoint_s += now_s() - t0;
    }
    write_metrics(t, NULL);
    if (stop_sig) {
        report_stop(t, stop_sig);
        cleanup(t);
        return 0;
    }
    double wall = now_s() - t->t_start;
    report_mla(t, "end");
    if (o.profile) profile_report(t);
    if (t->step == o.steps) CHECK(generate(t));
    CHECK(tm_routes_close(&t->routes));
    if (o.export_hf && t->rank == 0) {
        double t0 = now_s();
        CHECK(thf_export(&t->model, t->have_hf ? &t->hf : NULL, o.export_hf, o.export_dtype, 0));
        say(t, "exported step %lld to %s (%s) in %.2f s\n", (long long)t->step, o.export_hf, o.export_dtype,
            now_s() - t0);
    }
    say(t, "done: %lld steps in %.1f s (%.0f tokens/s, %.2f%% of step time waiting for data), final validation loss %.4f\n",
        (long long)t->step, wall, t->steps_timed ? (double)o.batch * o.accum * o.seq * t->steps_timed / t->train_seconds : 0.0,
        t->train_seconds > 0 ? 100 * t->data_wait_s / t->train_seconds : 0.0, (double)t->last_val);
    cleanup(t);
    return 0;
}
