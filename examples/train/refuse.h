/* train/refuse.h - what examples/train_moe.c refuses, in one place: the combinations of flags
   it does not run and the ranges of its numeric flags. README's table "Combinations the trainer
   refuses, and why" mirrors the combinations. A refusal prints "train_moe: rank R: MESSAGE"
   naming the flags and exits with status 1 (fail); each check runs at the first moment it can:
     refuse_launch  before anything starts: --nproc, --max-restarts (exit status 2, no rank yet)
     refuse_flags   the flags alone, before the ranks meet (every rank prints "rank 0")
     refuse_layout  the rank grid, once the ranks have met and the world size is known
     refuse_device  what needs the device: --cuda-graph, --grad-check
   Checked where they are read instead: a flag's own words (--dtype f32|bf16|fp16, --device,
   --score, --attn, --recompute, --mtp-ffn), the model's shape (tm_init names the flag), what
   only the files can tell (--init-from-hf's vocabulary against the data's, a --ckpt-dir that
   already holds checkpoints without --resume). A new refusal is one line here and one row there.
   Part of the trainer's one translation unit: train_moe.c includes it after fail and
   compute_dtype. */

/* Exit status 2 with the message, as the parser's errors. */
static int refuse_launch(const options *o) {
    if (o->nproc < 0) {
        fprintf(stderr, "train_moe: --nproc %d: must be >= 1\n", o->nproc);
        return 2;
    }
    if (o->max_restarts < 0) {
        fprintf(stderr, "train_moe: --max-restarts %d: must be >= 0\n", o->max_restarts);
        return 2;
    }
    return 0;
}

/* The flags alone: ranges, then the combinations (steps and optimisation, --cuda-graph,
   Hugging Face import and export, data, routing record/replay, metrics, checkpoints). */
static void refuse_flags(const trainer *t) {
    const options *o = t->o;
    tz_opts z;
    memset(&z, 0, sizeof z);
    if (o->steps < 1) fail(t, "--steps %d: must be at least 1", o->steps);
    if (o->accum < 1) fail(t, "--accum %d: must be at least 1", o->accum);
    if (o->batch < 1) fail(t, "--batch %d: must be at least 1", o->batch);
    if (o->val_interval < 1 || o->val_batches < 1 || o->log_every < 1)
        fail(t, "--val-interval %d, --val-batches %d, --log-every %d: must be at least 1", o->val_interval,
             o->val_batches, o->log_every);
    if (o->warmup < 0 || o->ckpt_every < 0 || o->keep < 0 || o->sample_len < 0 || o->stop_at < 0)
        fail(t, "--warmup, --ckpt-every, --keep, --sample-len, --stop-at must be >= 0");
    if (o->zero < 0 || o->zero > 3) fail(t, "--zero %d: use 0, 1, 2 or 3", o->zero);
    if (strcmp(o->ep_dispatch, "act") != 0 && strcmp(o->ep_dispatch, "fp8") != 0)
        fail(t, "--ep-dispatch \"%s\": use act or fp8", o->ep_dispatch);
    if (strcmp(o->ep_dispatch, "fp8") == 0 && o->ep < 2)
        fail(t, "--ep-dispatch fp8 needs --ep 2 or more: without expert parallelism no rows are sent");
    if (!tz_parse_compress(o->grad_compress, &z))
        fail(t, "--grad-compress \"%s\": use none, bf16, fp8, fp8:ef or powersgd:R[:START] (R >= 1, START >= 0)",
             o->grad_compress);
    if (o->cuda_graph && (o->zero > 0 || z.compress != DSK_ZERO_COMPRESS_NONE))
        fail(t, "--cuda-graph runs without --zero and --grad-compress");
    if (o->cuda_graph && (o->tp > 1 || o->pp > 1))
        fail(t, "--cuda-graph runs without --tp and --pp (the captured step runs the whole model, not a pipeline's "
                "schedule)");
    if (o->cuda_graph && o->ep > 1 && strcmp(o->ep_exchange, "bounded") != 0)
        fail(t,
             "--cuda-graph with --ep %d needs --ep-exchange bounded: the exact exchange waits on the host for the "
             "counts, which a graph capture cannot hold",
             o->ep);
    if (!(o->lr > 0) || o->min_lr < 0 || o->wd < 0 || o->clip < 0 || o->beta1 < 0 || o->beta1 >= 1 || o->beta2 < 0 ||
        o->beta2 >= 1)
        fail(t,
             "--lr %g (> 0), --min-lr %g, --wd %g, --clip %g (>= 0), --beta1 %g, --beta2 %g (in [0, 1)) out of range",
             o->lr, o->min_lr, o->wd, o->clip, o->beta1, o->beta2);
    if (o->export_hf && strcmp(o->export_dtype, "f32") != 0 && strcmp(o->export_dtype, "bf16") != 0 &&
        strcmp(o->export_dtype, "fp8") != 0)
        fail(t, "--export-dtype \"%s\": use f32, bf16 or fp8", o->export_dtype);
    if (o->export_hf && (o->tp > 1 || o->pp > 1 || o->ep > 1 || o->zero > 0 || z.compress != DSK_ZERO_COMPRESS_NONE))
        fail(t, "--export-hf runs without --tp, --pp, --ep, --zero and --grad-compress in this trainer");
    if (o->export_hf && !o->init_from_hf && strcmp(o->attn, "mla") != 0)
        fail(t, "--export-hf writes DeepSeek's MLA layout: use --attn mla (or --init-from-hf)");
    if (o->export_hf && !o->init_from_hf && strcmp(o->score, "softmax") == 0 && o->bias_rate > 0)
        fail(t, "--export-hf of a softmax-routed model writes DeepseekV2, which has no expert bias: pass "
                "--bias-rate 0");
    if (o->init_from_hf && (o->tp > 1 || o->pp > 1))
        fail(t, "--init-from-hf runs without --tp and --pp in this trainer (the hub's tensors are read whole, not as "
                "tensor-parallel boxes or pipeline stages)");
    if (o->threads < 0) fail(t, "--threads %d: must be >= 0", o->threads);
    if (o->val_every < 2) fail(t, "--val-every %d: must be at least 2", o->val_every);
    if (o->corpus_mb < 0) fail(t, "--corpus-mb %g: must be >= 0 (0 = no cap on --data)", o->corpus_mb);
    if (o->prefetch < 0) fail(t, "--prefetch %d: must be >= 0", o->prefetch);
    if (o->routing_record && o->routing_replay) fail(t, "--routing-record and --routing-replay exclude each other");
    if ((o->routing_record || o->routing_replay) && (o->cuda_graph || o->grad_check))
        fail(t, "--routing-record/--routing-replay run without --cuda-graph and --grad-check");
    if (o->metrics_port < 0) fail(t, "--metrics-port %d: must be in 1..65535 (0 = off)", o->metrics_port);
    if (!o->ckpt_dir && o->resume) fail(t, "--resume needs --ckpt-dir");
}

/* The rank grid (world size t->world): tp x pp x dp with ep inside dp, the pipeline schedule. */
static void refuse_layout(const trainer *t) {
    const options *o = t->o;
    int ep = o->ep, dp;
    dsk_par_schedule_kind kind;
    if (o->tp < 1 || o->pp < 1 || o->micro < 1 || o->vstages < 1)
        fail(t, "--tp %d, --pp %d, --micro-batches %d, --virtual-stages %d: must be at least 1", o->tp, o->pp, o->micro,
             o->vstages);
    if (t->world % (o->tp * o->pp) != 0)
        fail(t, "--tp %d x --pp %d = %d must divide the world size %d", o->tp, o->pp, o->tp * o->pp, t->world);
    dp = t->world / (o->tp * o->pp);
    if (ep < 1 || dp % ep != 0) {
        if (o->tp * o->pp == 1) fail(t, "--ep %d must divide the world size %d", ep, t->world);
        fail(t, "--ep %d must divide the %d data-parallel ranks (world %d / (--tp %d x --pp %d))", ep, dp, t->world,
             o->tp, o->pp);
    }
    if (o->experts % ep != 0) fail(t, "--ep %d must divide --experts %d", ep, o->experts);
    if (o->batch % dp != 0)
        fail(t, "--batch %d (global) must be a multiple of the %s %d", o->batch,
             o->tp * o->pp > 1 ? "data-parallel ranks" : "world size", dp);
    if (o->tp == 1 && o->pp == 1 &&
        ((o->micro > 1 && !o->pair_micro) || o->vstages > 1 || strcmp(o->pp_schedule, "1f1b") != 0))
        fail(t, "--micro-batches, --virtual-stages and --pp-schedule need --pp 2 or more (--accum accumulates "
                "gradients without a pipeline; --pair-micro-batches takes --micro-batches on one stage)");
    if (o->pair_micro && t->world == 1)
        fail(t, "--pair-micro-batches needs several ranks: it hides one micro-batch's expert or pipeline traffic "
                "behind another's compute");
    if (o->pair_micro && o->micro < 2)
        fail(t,
             "--pair-micro-batches needs --micro-batches 2 or more (it pairs one's forward with another's backward)");
    if (o->pair_micro && strcmp(o->pp_schedule, "gpipe") == 0)
        fail(t,
             "--pair-micro-batches needs --pp-schedule 1f1b, interleaved or dualpipev: gpipe runs every forward first");
    if (o->pair_micro && o->zero == 3)
        fail(t, "--pair-micro-batches runs with --zero 0 to 2: at ZeRO-3 a forward opening a block's unit rebinds "
                "its gathered weights into the MoE layer, which the pair's backward may still be using");
    if (o->pair_micro && strcmp(o->recompute, "full") == 0)
        fail(t, "--pair-micro-batches runs without --recompute full: a recomputed block's MoE layer keeps one forward, "
                "which the other micro-batch of a pair would replace");
    if (dsk_par_schedule_parse(o->pp_schedule, &kind) != DSK_OK)
        fail(t, "--pp-schedule \"%s\": use gpipe, 1f1b, interleaved or dualpipev", o->pp_schedule);
    if (kind == DSK_PAR_DUALPIPE_V && o->vstages > 2)
        fail(t, "--pp-schedule dualpipev runs 2 stages a rank (a V), not --virtual-stages %d", o->vstages);
    if (kind == DSK_PAR_DUALPIPE_V && o->micro < 2 * o->pp)
        fail(t, "--pp-schedule dualpipev needs --micro-batches %d or more (2 x --pp %d), not %d", 2 * o->pp, o->pp,
             o->micro);
    if (o->vstages > 1 && kind != DSK_PAR_INTERLEAVED && kind != DSK_PAR_DUALPIPE_V)
        fail(t, "--virtual-stages %d needs --pp-schedule interleaved", o->vstages);
    if (kind == DSK_PAR_INTERLEAVED && o->micro % o->pp != 0)
        fail(t, "--pp-schedule interleaved needs --micro-batches (%d) to be a multiple of --pp %d", o->micro, o->pp);
}

/* What needs the device (t->ctx) and the world size. */
static void refuse_device(const trainer *t) {
    const options *o = t->o;
    if (o->cuda_graph && t->ctx.device.type != DSK_DEV_CUDA)
        fail(t, "--cuda-graph needs GPUs (this run is on the CPU): a CUDA graph holds device work");
    if (o->cuda_graph && o->profile)
        fail(t, "--cuda-graph and --profile exclude each other: --profile synchronises the device after each op, "
                "which a graph capture cannot hold");
    if (o->grad_check > 0 &&
        (compute_dtype(t) != DSK_F32 || t->world != 1 || t->ctx.device.type != DSK_DEV_CPU || o->cuda_graph ||
         o->zero != 0 || t->zopts.compress != DSK_ZERO_COMPRESS_NONE || o->tp > 1 || o->pp > 1))
        fail(t, "--grad-check needs --dtype f32, one rank, the CPU and --zero 0 --grad-compress none");
}
