/* train/flags.h - the flags of examples/train_moe.c: the options struct, the flag table (name,
   kind, help), the defaults, --help, the presets and the parser. Part of the trainer's one
   translation unit (train_moe.c includes it before the trainer); it needs only the C library. */
#ifndef TRAIN_FLAGS_H
#define TRAIN_FLAGS_H

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ options */

typedef struct options {
    /* data */
    char **data;
    int n_data;
    int vocab;        /* token shards only; bytes are 256 */
    int val_every;    /* every n-th window is held out */
    double corpus_mb; /* cap of the corpus (0: 4 MB of the default corpus, all of --data) */
    int prefetch, drop_last, no_shuffle;
    char *sample_log;
    /* model */
    int seq, d_model, heads, layers, dense_layers, ffn_hidden;
    int experts, shared, top_k, expert_hidden, groups, topk_groups;
    char score[16]; /* sigmoid | softmax */
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
    int zero; /* ZeRO stage; 0 with --grad-compress none: the trainer's own data parallelism */
    char grad_compress[32];
    char bind[8];
    int grad_check;
    char *routing_record, *routing_replay;
    int help;
    /* Hugging Face checkpoints (train_hf.h) */
    char *init_from_hf, *export_hf;
    char export_dtype[8];
} options;

/* OPT_AUTO: a flag that may be followed by the word "auto" */
typedef enum { OPT_INT, OPT_DOUBLE, OPT_LL, OPT_STR, OPT_STRBUF, OPT_FLAG, OPT_AUTO, OPT_LIST } opt_kind;

typedef struct opt_spec {
    const char *name;
    opt_kind kind;
    size_t offset;
    size_t bufsize; /* OPT_STRBUF */
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
    o->ffn_hidden = v3 ? 288 : 684;  /* 18432 / 64 and 10944 / 16 */
    o->expert_hidden = v3 ? 32 : 88; /* 2048 / 64 and 1408 / 16 */
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
            while (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) {
                i++;
                o->n_data++;
            }
            if (o->n_data == 0) {
                fprintf(stderr, "train_moe: %s needs at least one PATH\n", a);
                return 2;
            }
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "train_moe: %s needs a value\n", a);
            return 2;
        }
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
            if (strlen(v) >= s->bufsize) {
                fprintf(stderr, "train_moe: %s \"%s\" is too long\n", a, v);
                return 2;
            }
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

#endif /* TRAIN_FLAGS_H */
