/* train/report.h - what examples/train_moe.c prints: the step and validation lines (and their
   --log JSON), the memory report, the MLA report, the banner and the --profile breakdown. Part
   of the trainer's one translation unit: train_moe.c includes it after the checkpoints. */

/* ---- output */

/* A number for JSON: %.9g (exact for f32), null when not finite (JSON has no NaN/Inf). */
static const char *json_num(char buf[32], double x) {
    if (isfinite(x)) snprintf(buf, 32, "%.9g", x);
    else snprintf(buf, 32, "null");
    return buf;
}

/* Every rank, after the first step: what its collectives handed over in it (the --log line's
   figures, which only rank 0 writes), for tests/test_plan.sh to compare rank by rank. */
static void print_step_bytes(const trainer *t, const step_info *si) {
    printf("step bytes, rank %d: reduce %.0f, pipeline sends %.0f, ep dispatch %.0f, ep combine %.0f, tp all-reduce "
           "%.0f, tp all-gather %.0f, tp reduce-scatter %.0f, tp calls %.0f\n",
           t->rank, si->reduce_bytes, si->pp_bytes, si->ep_bytes[0], si->ep_bytes[1], si->tp[0], si->tp[1], si->tp[2],
           si->tp[3]);
    fflush(stdout);
}

static void log_step(trainer *t, const step_info *si) {
    const options *o = t->o;
    if (t->step == 1) print_step_bytes(t, si);
    t->train_seconds += si->ms * 1e-3;
    t->steps_timed++;
    double eta = t->train_seconds / (double)t->steps_timed * (double)(o->steps - t->step);
    if (t->rank == 0 && (t->step % o->log_every == 0 || t->step == o->steps || t->step == 1))
        printf("step %5lld/%d | loss %.4f | lr %.2e | norm %6.3f | scale %g | %7.1f ms | %7.0f tok/s | mfu %5.2f%% | "
               "comm %4.1f%% | "
               "data %4.1f%% | load %.2f | drop %lld | eta %dm%02ds%s\n",
               (long long)t->step, o->steps, si->loss, si->lr, si->norm, (double)si->scale, si->ms, si->tokens_per_s,
               100 * si->mfu, 100 * si->comm_share, 100 * si->data_ms / si->ms, si->load_ratio, (long long)si->dropped,
               (int)eta / 60, (int)eta % 60, si->skipped ? " | skipped (non-finite gradients)" : "");
    fflush(stdout);
    if (t->log) {
        char loss[32], norm[32];
        fprintf(t->log,
                "{\"type\":\"step\",\"step\":%lld,\"loss\":%s,\"aux_loss\":%.9g,\"lr\":%.9g,\"grad_norm\":%s,\"loss_"
                "scale\":%.9g,"
                "\"ms\":%.3f,\"cpu_ms\":%.3f,\"data_wait_ms\":%.3f,\"grad_sync_ms\":%.3f,\"tokens_per_s\":%.1f,\"mfu\":"
                "%.6f,"
                "\"comm_share\":%.6f,\"load_max_mean\":%.6f,\"dropped\":%lld,\"skipped\":%d,\"eta_s\":%.1f,"
                "\"reduce_bytes\":%.0f,\"reduce_bytes_uncompressed\":%.0f,\"ep_dispatch_bytes\":%.0f,"
                "\"ep_combine_bytes\":%.0f,\"ep_bytes_off_node\":%.0f,\"pp_send_bytes\":%.0f,"
                "\"tp_all_reduce_bytes\":%.0f,\"tp_all_gather_bytes\":%.0f,\"tp_reduce_scatter_bytes\":%.0f,"
                "\"tp_calls\":%.0f,\"ep_paired_exchanges\":%lld,\"ep_comm_ms\":%.3f}\n",
                (long long)t->step, json_num(loss, si->loss), si->aux_loss, si->lr, json_num(norm, si->norm),
                (double)si->scale, si->ms, si->cpu_ms, si->data_ms, si->sync_ms, si->tokens_per_s, si->mfu,
                si->comm_share, si->load_ratio, (long long)si->dropped, si->skipped, eta, si->reduce_bytes,
                si->plain_bytes, si->ep_bytes[0], si->ep_bytes[1], si->ep_bytes[2], si->pp_bytes, si->tp[0], si->tp[1],
                si->tp[2], si->tp[3], (long long)si->paired, si->ep_comm_ms);
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
            say(t,
                "attention: MLA, q_lora_rank %d, kv_lora_rank %d, qk dims %d nope + %d rope, v dims %d, "
                "softmax scale %.5f\n",
                o->q_lora, o->kv_lora, o->qk_nope, o->qk_rope, o->v_head, (double)tmla_scale(&t->model.cfg));
        else say(t, "attention: MHA, %d heads of %d\n", o->heads, o->d_model / o->heads);
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
    say(t, "train_moe: %d rank%s (expert parallel %d), %s, %s compute%s\n", t->world, t->world > 1 ? "s" : "", t->ep,
        t->ctx.device.type == DSK_DEV_CUDA ? "CUDA" : "CPU", dsk_dtype_name(m->cfg.cdt),
        m->cfg.fp8 ? " with FP8 GEMMs" : "");
    if (t->ep > 1)
        say(t, "expert dispatch: %s; the combine in the activation dtype\n",
            strcmp(o->ep_dispatch, "fp8") == 0 ? "e4m3 codes with 1x128 f32 scales" : "rows in the activation dtype");
    say(t, "data: %s; %lld training and %lld held-out windows of %d tokens\n", t->data.source,
        (long long)t->data.n_train, (long long)t->data.n_val, o->seq + 1);
    const td_sampler *smp = &t->loader.smp;
    say(t,
        "data order: DistributedSampler over %d rank%s, %lld samples per rank and epoch (%lld %s), %s; %d batches read "
        "ahead\n",
        t->world, t->world > 1 ? "s" : "", (long long)smp->num_samples, (long long)llabs(smp->total_size - smp->n),
        smp->drop_last ? "cut" : "padded", smp->shuffle ? "shuffled by seed + epoch" : "in order", o->prefetch);
    say(t,
        "model: %d blocks (%d dense), d_model %d, %d heads, vocab %d; MoE %d routed (%s, top-%d) + %d shared, expert "
        "hidden %d; "
        "%.2fM parameters on rank 0, %.1f MFLOP/token (active)\n",
        o->layers, o->dense_layers, o->d_model, o->heads, m->cfg.vocab, o->experts, o->score, o->top_k, o->shared,
        o->expert_hidden, total / 1e6, t->flops_per_token / 1e6);
    if (t->have_comm) {
        const dsk_par_dims *d = &t->par.grid.dims;
        say(t, "rank grid: tp %d x dp %d (ep %d inside) x pp %d = %d ranks; world rank = tp_i + tp (dp_i + dp pp_i)\n",
            d->tp, d->dp, d->ep, d->pp, t->world);
    }
    if (t->par.on) {
        const tp_state *ps = &t->par;
        say(t,
            "parallel model: %d heads, FFN %d and vocabulary %d split over tp %d (sequence-parallel norms, "
            "vocabulary-parallel loss), MoE layers on each tp rank's tokens; pipeline %s, %d stage%s x %d virtual, "
            "%d micro-batches of %d sequences%s, bubble %.3f, at most %d in flight on rank 0 of the pipeline\n",
            o->heads, o->ffn_hidden, m->cfg.vocab, ps->tp, dsk_par_schedule_name(ps->kind), ps->pp,
            ps->pp > 1 ? "s" : "", ps->v, ps->M, ps->Bm, ps->paired ? " (forwards and backwards paired)" : "",
            dsk_par_bubble_fraction(ps->kind, ps->pp, ps->M, ps->v), ps->sched.in_flight);
    }
    report_mla(t, "start");
    if (t->engine) {
        double all, comp;
        tz_powersgd_elements(m, t->zopts.psgd_rank, &comp, &all);
        say(t, "zero: stage %d over %d rank%s (experts over %d), gradient reductions %s", o->zero, t->world,
            t->world > 1 ? "s" : "", t->have_comm ? t->rep_comm.world_size : 1, o->grad_compress);
        if (t->zopts.compress == DSK_ZERO_COMPRESS_POWERSGD)
            say(t, " from pass %d: %.0f of %.0f elements, %.3fx fewer bytes", t->zopts.psgd_start, comp, all,
                all / comp);
        else if (t->zopts.compress == DSK_ZERO_COMPRESS_BF16) say(t, ": 2x fewer bytes");
        else if (t->zopts.compress == DSK_ZERO_COMPRESS_FP8)
            say(t, ": e4m3 codes and 1x128 f32 scales, about 3.9x fewer bytes%s",
                t->zopts.fp8_ef ? ", error feedback" : "");
        say(t, "\n");
    }
    if (o->cuda_graph && !t->engine)
        say(t, "cuda graph: each step replays one captured graph (every micro-batch's forward, loss and backward, "
               "unscale, skip/clip decision, AdamW, bias and loss-scale updates)\n");
    else if (o->cuda_graph)
        say(t, "cuda graph: each step replays one captured graph (every micro-batch's forward, loss and backward, "
               "the expert exchanges included), then reduces the gradients and steps the optimizer eagerly\n");
    say(t, "batch %d x %d tokens x %d accum, %d steps, lr %g (warm-up %d, cosine to %g), clip %g\n", o->batch, o->seq,
        o->accum, o->steps, o->lr, o->warmup, o->min_lr, o->clip);
    char how[96];
    if (o->peak_tflops > 0) snprintf(how, sizeof how, "given by --peak-tflops");
    else if (t->ctx.device.type == DSK_DEV_CUDA) snprintf(how, sizeof how, "H100/H200 bf16 datasheet");
    else
        snprintf(how, sizeof how, "measured at start: best of %d 512^3 f32 GEMMs on %d thread%s", CPU_PEAK_REPS,
                 t->ctx.n_threads, t->ctx.n_threads > 1 ? "s" : "");
    say(t,
        "mfu: model FLOPs per second over a peak of %.3g GFLOP/s per rank (%s) x %d rank%s, or over the fastest "
        "step's rate if a step runs faster\n",
        t->peak_flops / 1e9, how, t->world, t->world > 1 ? "s" : "");
    if (t->ctx.device.type == DSK_DEV_CPU) {
        char isa[64];
        say(t, "cpu gemm: %s, %d thread%s per rank, OpenMP spin %s\n",
            dsk_cpu_gemm_describe(t->ctx.cpu_isa, isa, sizeof isa), t->ctx.n_threads, t->ctx.n_threads > 1 ? "s" : "",
            getenv("GOMP_SPINCOUNT") ? getenv("GOMP_SPINCOUNT") : "default");
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
    say(t,
        "profile: %lld steps after the warm-up, %.1f ms/step wall, %.1f ms/step CPU (all threads; what other programs "
        "on the cores disturb least), %d thread%s, cpu gemm: %s\n",
        (long long)t->prof_steps, step, step_cpu, t->ctx.n_threads, t->ctx.n_threads > 1 ? "s" : "",
        dsk_cpu_gemm_describe(t->ctx.cpu_isa, isa, sizeof isa));
    say(t, "  %-52s %10s  %6s %10s  %6s\n", "phase", "wall ms", "share", "CPU ms", "share");
    for (int p = 0; p < TM_PH_COUNT; p++) {
        double ms = m->phase_s[p] / n * 1e3, cms = m->phase_cpu_s[p] / n * 1e3;
        known += ms;
        known_cpu += cms;
        say(t, "  %-52s %10.2f  %5.1f%% %10.2f  %5.1f%%\n", tm_phase_names[p], ms, 100 * ms / step, cms,
            100 * cms / step_cpu);
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
