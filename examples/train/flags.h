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

/* ------------------------------------------------------------------ the flags

   Every flag is one row of TRAIN_FLAGS, grouped by area in --help's order:
     X(KIND, N, field, "--name", default, "help")
   KIND: INT, DOUBLE, LL (long long), FLAG (no value), AUTO (a flag that may be followed by the
   word "auto"), STR (a char * into argv; default NULL), BUF (a char[N] copy; default a string),
   LIST (--data's PATH...: char **field and int n_field). The row declares the options field,
   gives its default (set_defaults; --help prints it) and its --help text: adding a flag is
   adding a row (RUN_DEFAULTS below where the run decides the default, refuse.h where it
   combines badly with another). */
#define TRAIN_FLAGS(X) \
    /* ---- data */ \
    X(LIST, 0, data, "--data", NULL, "PATH... byte files or llm.c token shards") \
    X(INT, 0, vocab, "--vocab", 50257, "vocabulary of token shards") \
    X(INT, 0, val_every, "--val-every", 20, "hold out every n-th window for validation") \
    X(DOUBLE, 0, corpus_mb, "--corpus-mb", 0, \
      "keep the first MB of the corpus' token data (0 = 4 of the default corpus, all of --data)") \
    X(INT, 0, prefetch, "--prefetch", 4, "batches a loader thread prepares ahead (0 = read in the step)") \
    X(FLAG, 0, drop_last, "--drop-last", 0, "cut the epoch to a multiple of the world size instead of padding it") \
    X(FLAG, 0, no_shuffle, "--no-shuffle", 0, "read the training windows in order (no per-epoch shuffle)") \
    X(STR, 0, sample_log, "--sample-log", NULL, \
      "FILE: JSON line per batch and rank with the (epoch, sample) pairs read") \
    /* ---- model */ \
    X(INT, 0, seq, "--seq", 128, "sequence length T") \
    X(INT, 0, d_model, "--d-model", 128, "model width D") \
    X(INT, 0, heads, "--heads", 4, "attention heads") \
    X(INT, 0, layers, "--layers", 4, "transformer blocks") \
    X(INT, 0, dense_layers, "--dense-layers", 1, "leading blocks with a dense FFN (the rest are MoE)") \
    X(INT, 0, ffn_hidden, "--ffn-hidden", 384, "hidden size of the dense FFN") \
    X(INT, 0, experts, "--experts", 8, "routed experts per MoE layer") \
    X(INT, 0, shared, "--shared", 1, "shared experts per MoE layer") \
    X(INT, 0, top_k, "--top-k", 2, "experts per token") \
    X(INT, 0, expert_hidden, "--expert-hidden", 128, "hidden size of each expert") \
    X(INT, 0, groups, "--groups", 1, "expert groups for group-limited routing (1 = off)") \
    X(INT, 0, topk_groups, "--topk-groups", 1, "groups kept per token") \
    X(BUF, 16, score, "--score", "sigmoid", "router score: sigmoid | softmax") \
    X(DOUBLE, 0, routed_scale, "--routed-scale", 1.0, "routed scaling factor") \
    /* bias rate: DeepSeek-V3 used 1e-3 over far longer runs; a few hundred steps need faster balancing */ \
    X(DOUBLE, 0, bias_rate, "--bias-rate", 1e-2, "auxiliary-loss-free expert bias update rate (0 = off)") \
    X(DOUBLE, 0, aux_loss, "--aux-loss", 0, "Switch/GShard auxiliary loss coefficient") \
    X(DOUBLE, 0, seq_aux_loss, "--seq-aux-loss", 0, "DeepSeek-V3's sequence-wise balance loss coefficient") \
    X(DOUBLE, 0, z_loss, "--z-loss", 0, "router z-loss coefficient") \
    X(DOUBLE, 0, init_std, "--init-std", 0.02, "standard deviation of the initial weights") \
    X(DOUBLE, 0, capacity, "--capacity", 0, "expert capacity factor (0 = dropless)") \
    X(BUF, 16, preset, "--preset", "tiny", \
      "tiny | v2-lite | v3: model sizes (flags given as well override them; v2-lite, v3: scaled-down DeepSeek " \
      "ratios)") \
    /* ---- MLA, multi-token prediction, recomputation (train_mla.h) */ \
    X(BUF, 8, attn, "--attn", "mha", "mha | mla (multi-head latent attention)") \
    X(INT, 0, q_lora, "--q-lora-rank", 0, "MLA query latent rank (0 = plain Wq)") \
    X(INT, 0, kv_lora, "--kv-lora-rank", 32, "MLA key-value latent rank") \
    X(INT, 0, qk_nope, "--qk-nope-dim", 16, "MLA per-head query/key dims without rotary embedding") \
    X(INT, 0, qk_rope, "--qk-rope-dim", 16, "MLA per-head (query) and shared (key) rotary dims") \
    X(INT, 0, v_head, "--v-head-dim", 32, "MLA per-head value dims") \
    X(INT, 0, original_seq, "--original-seq", 0, \
      "MLA: pre-training length; longer --seq applies the mscale softmax correction (0 = off)") \
    X(DOUBLE, 0, rope_factor, "--rope-factor", 40, "MLA: context extension factor of the mscale correction") \
    X(DOUBLE, 0, mscale, "--mscale", 1.0, "MLA: mscale of the correction 0.1 mscale ln(factor) + 1") \
    X(INT, 0, mtp, "--mtp", 0, "multi-token prediction depth D (0 = off)") \
    /* MTP lambda: DeepSeek-V3's 0.3 for the first 10T tokens */ \
    X(DOUBLE, 0, mtp_lambda, "--mtp-lambda", 0.3, "weight lambda of the MTP loss (lambda / D per module)") \
    X(BUF, 8, mtp_ffn, "--mtp-ffn", "", \
      "FFN of the MTP blocks: dense | moe (as the MoE layers; DeepSeek-V3) [dense; moe: --preset v3, --init-from-hf]") \
    X(BUF, 8, recompute, "--recompute", "none", \
      "none | attn | full: recompute the attention core, or each whole block, in backward") \
    /* ---- optimisation */ \
    X(INT, 0, batch, "--batch", 16, "global batch: sequences per micro-step over all ranks") \
    X(INT, 0, accum, "--accum", 1, "micro-steps of gradient accumulation per step") \
    X(INT, 0, steps, "--steps", 500, "optimizer steps") \
    X(INT, 0, warmup, "--warmup", 30, "linear warm-up steps") \
    X(DOUBLE, 0, lr, "--lr", 3e-3, "peak learning rate") \
    X(DOUBLE, 0, min_lr, "--min-lr", 3e-4, "final learning rate of the cosine decay") \
    X(DOUBLE, 0, wd, "--wd", 0.1, "AdamW weight decay (matrices only)") \
    X(DOUBLE, 0, clip, "--clip", 1.0, "global gradient-norm clip (0 = off)") \
    X(DOUBLE, 0, beta1, "--beta1", 0.9, "AdamW beta1") \
    X(DOUBLE, 0, beta2, "--beta2", 0.95, "AdamW beta2") \
    X(LL, 0, seed, "--seed", 1337, "seed of weights and data order") \
    /* ---- device and precision */ \
    X(BUF, 8, dtype, "--dtype", "", "f32 | bf16 | fp16 | fp8") \
    X(BUF, 8, optim_dtype, "--optim-dtype", "f32", "AdamW moments: f32 | bf16 (half the optimizer state)") \
    X(INT, 0, threads, "--threads", 0, "CPU threads per rank (0 = OpenMP's default)") \
    X(BUF, 8, device, "--device", "auto", \
      "auto (the GPUs where every rank has one of its own, else the CPU) | cpu | cuda") \
    X(FLAG, 0, cuda_graph, "--cuda-graph", 0, \
      "capture a step as a CUDA graph once and replay it (one GPU: forward, backward, optimizer; more: the passes)") \
    /* ---- evaluation and output */ \
    X(INT, 0, val_interval, "--val-interval", 100, "steps between validation runs") \
    X(INT, 0, val_batches, "--val-batches", 8, "global batches per validation run") \
    X(INT, 0, sample_len, "--sample-len", 240, "tokens generated at the end (0 = none)") \
    X(BUF, 256, prompt, "--prompt", "#include <", "prompt of the final sample") \
    X(DOUBLE, 0, temperature, "--temperature", 0.8, "sampling temperature (0 = greedy)") \
    X(INT, 0, log_every, "--log-every", 1, "print every n-th step") \
    X(FLAG, 0, profile, "--profile", 0, "time each phase of the step; print the breakdown at the end") \
    X(STR, 0, log_path, "--log", NULL, "FILE: JSON lines, one per step and validation") \
    /* ---- metrics (train/prod.h) */ \
    X(STR, 0, metrics_path, "--metrics", NULL, \
      "FILE: Prometheus text file (node_exporter), rewritten every step; rank r > 0: FILE.rank<r>") \
    X(INT, 0, metrics_port, "--metrics-port", 0, \
      "serve http://ADDR:PORT/metrics (PORT + local rank on each rank; 0 = off)") \
    X(BUF, 64, metrics_addr, "--metrics-addr", "127.0.0.1", "address of the metrics server") \
    X(DOUBLE, 0, peak_tflops, "--peak-tflops", 0, "peak of one rank's device for MFU") \
    /* ---- checkpoints (train/ckpt.h) */ \
    X(INT, 0, ckpt_every, "--ckpt-every", 0, "steps between checkpoints (0 = only at the end)") \
    X(STR, 0, ckpt_dir, "--ckpt-dir", NULL, "DIR of checkpoints (none when unset)") \
    X(INT, 0, keep, "--keep", 0, "checkpoints kept (0 = all)") \
    X(FLAG, 0, sync_ckpt, "--sync-ckpt", 0, "write checkpoints synchronously") \
    X(AUTO, 0, resume, "--resume", 0, \
      "continue from the newest complete checkpoint in --ckpt-dir, if any (--resume auto: the same)") \
    X(INT, 0, stop_at, "--stop-at", 0, "stop after this step as if interrupted (0 = run to --steps)") \
    /* ---- launch and placement (train/prod.h) */ \
    X(INT, 0, nproc, "--nproc", 0, "start N local ranks (data parallel)") \
    X(INT, 0, max_restarts, "--max-restarts", 0, "with --nproc: run a failed job again up to K times, resuming") \
    X(BUF, 8, bind, "--bind", "none", "none | core | numa: pin each local rank (sysfs topology)") \
    /* ---- parallelism (train_par.h, train_zero.h) */ \
    X(INT, 0, ep, "--ep", 1, "expert-parallel ranks (divides the data-parallel ranks and --experts)") \
    X(BUF, 8, ep_dispatch, "--ep-dispatch", "act", \
      "act | fp8: the dispatch all-to-all's token rows in the activation dtype, or e4m3 with 1x128 scales " \
      "(DeepSeek-V3; the combine stays in the activation dtype)") \
    X(BUF, 8, ep_exchange, "--ep-exchange", "exact", \
      "exact | bounded: the expert exchanges move the routed rows, or every peer's fixed block of T min(K, E/ep) " \
      "rows (bytes set by the shapes, not the routing; dsk_moe's ep_exchange)") \
    X(BUF, 8, ep_overlap, "--ep-overlap", "off", \
      "off | on | chunked: each expert exchange travels while the layer computes what does not wait on it " \
      "(chunked: and the experts start on each rank's rows as they land; on: only where dsk_moe's ep_chunk AUTO " \
      "does); the same bits") \
    X(INT, 0, tp, "--tp", 1, "tensor-parallel ranks (heads, FFN and vocabulary split; sequence parallel norms)") \
    X(INT, 0, pp, "--pp", 1, "pipeline stages (the blocks split into contiguous stages)") \
    X(BUF, 16, pp_schedule, "--pp-schedule", "1f1b", \
      "gpipe | 1f1b | interleaved | dualpipev (DeepSeek's V: 2 stages a rank)") \
    X(INT, 0, micro, "--micro-batches", 1, \
      "pipeline micro-batches per step (divides the sequences per data-parallel rank)") \
    X(INT, 0, vstages, "--virtual-stages", 1, "stages per pipeline rank (--pp-schedule interleaved; dualpipev: 2)") \
    X(FLAG, 0, pair_micro, "--pair-micro-batches", 0, \
      "run each steady forward with the backward after it, interleaved at the MoE layers: one micro-batch's expert " \
      "exchange travels while the other computes (--ep-overlap on or chunked); more activations in flight; with " \
      "--pp 1 the --micro-batches are the step's; the same bits") \
    X(INT, 0, zero, "--zero", 0, "ZeRO stage 0-3: shard optimizer state (1), gradients (2), weights (3)") \
    X(BUF, 32, grad_compress, "--grad-compress", "none", \
      "none | bf16 | fp8 | fp8:ef | powersgd:R[:START] gradient reductions (fp8: e4m3 with 1x128 scales, :ef with " \
      "error feedback; PowerSGD rank R from pass START, 10 if not given)") \
    /* ---- Hugging Face checkpoints (train_hf.h) */ \
    X(STR, 0, init_from_hf, "--init-from-hf", NULL, \
      "DIR: start from a Hugging Face DeepSeek-V2/V3 checkpoint (config.json sets the model; --data: token shards " \
      "of its vocabulary)") \
    X(STR, 0, export_hf, "--export-hf", NULL, "DIR: write the final weights as a Hugging Face DeepSeek checkpoint") \
    X(BUF, 8, export_dtype, "--export-dtype", "bf16", \
      "f32 | bf16 | fp8 (e4m3 with weight_scale_inv blocks) for --export-hf") \
    /* ---- checks and debugging */ \
    X(INT, 0, grad_check, "--grad-check", 0, \
      "check N elements of every gradient against central differences, then exit") \
    X(STR, 0, routing_record, "--routing-record", NULL, \
      "FILE: write the MoE routing decisions (rank r > 0: FILE.rank<r>)") \
    X(STR, 0, routing_replay, "--routing-replay", NULL, "FILE: take the MoE routing of a --routing-record run") \
    X(STR, 0, plan, "--plan", NULL, \
      "FILE: the layout dsk_plan chose (its --json): --tp, --pp, --ep, --zero, --micro-batches, --virtual-stages, " \
      "--pp-schedule, --recompute") \
    X(FLAG, 0, help, "--help", 0, "this text")

#define OPT_FIELD_INT(f, n) int f;
#define OPT_FIELD_DOUBLE(f, n) double f;
#define OPT_FIELD_LL(f, n) long long f;
#define OPT_FIELD_FLAG(f, n) int f;
#define OPT_FIELD_AUTO(f, n) int f;
#define OPT_FIELD_STR(f, n) char *f;
#define OPT_FIELD_BUF(f, n) char f[n];
#define OPT_FIELD_LIST(f, n) \
    char **f; \
    int n_##f;
#define OPT_FIELD(kind, n, field, name, def, help) OPT_FIELD_##kind(field, n)
typedef struct options {
    TRAIN_FLAGS(OPT_FIELD)
} options;

/* OPT_AUTO: a flag that may be followed by the word "auto" */
typedef enum { OPT_INT, OPT_DOUBLE, OPT_LL, OPT_STR, OPT_BUF, OPT_FLAG, OPT_AUTO, OPT_LIST } opt_kind;

typedef struct opt_spec {
    const char *name;
    opt_kind kind;
    size_t offset;
    size_t bufsize; /* OPT_BUF */
    const char *help;
} opt_spec;

#define OPT_SPEC(kind, n, field, name, def, help) {name, OPT_##kind, offsetof(options, field), n, help},
static const opt_spec OPTS[] = {TRAIN_FLAGS(OPT_SPEC)};
#define N_OPTS ((int)(sizeof OPTS / sizeof OPTS[0]))

#define OPT_SET_INT(o, f, v) (o)->f = (v);
#define OPT_SET_DOUBLE(o, f, v) (o)->f = (v);
#define OPT_SET_LL(o, f, v) (o)->f = (v);
#define OPT_SET_FLAG(o, f, v) (o)->f = (v);
#define OPT_SET_AUTO(o, f, v) (o)->f = (v);
#define OPT_SET_STR(o, f, v) (o)->f = (v);
#define OPT_SET_BUF(o, f, v) snprintf((o)->f, sizeof(o)->f, "%s", (v));
#define OPT_SET_LIST(o, f, v) (o)->f = (v);
#define OPT_DEFAULT(kind, n, field, name, def, help) OPT_SET_##kind(o, field, def)
static void set_defaults(options *o) {
    memset(o, 0, sizeof *o);
    TRAIN_FLAGS(OPT_DEFAULT)
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
    case OPT_BUF: snprintf(def, n, "%s", p); break;
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
        case OPT_BUF:
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
