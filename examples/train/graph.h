/* train/graph.h - --cuda-graph for examples/train_moe.c: one step's device operations captured
   as a CUDA graph and replayed. Part of the trainer's one translation unit: train_moe.c includes
   it after the trainer, step_info and lr_at, before train_step, which calls graph_stage (through
   micro_batch), graph_step and graph_decision. */

/* ---- --cuda-graph: the whole step captured once and replayed

   graph_step records, at the first step (and again when the loss scale moved: the loss gradient's
   scale is a constant of the capture), every device operation of one step: the schedule's upload,
   zeroing the gradients, for each micro-batch its inputs copied in, forward, loss (kept per
   micro-batch) and backward, then unscale, the skip/clip decision, AdamW on both groups, the
   expert-bias update (skipped on the device flag) and the loss-scale update, the eager step's
   operations in its order. Each step launches it once: the host writes lr and the AdamW step
   (dsk_amp_dstep_schedule) and stages the inputs before, reads the losses and the decision after,
   and gets the eager run's bits (tests/test_train_graph.sh).

   Several ranks (data and expert parallelism, the engine of train_zero.h at --zero 0): the graph
   holds the step's passes only (zeroing the gradients, every micro-batch's inputs, forward, loss
   and backward, the expert all-to-alls of the bounded exchange and the balancing losses' spans
   included: NCCL calls on the stream, legal in a capture), captured without the engine's
   gradient marks. After each launch graph_step marks every gradient ready in one reducing pass,
   and the engine all-reduces, decides and steps AdamW eagerly as without --cuda-graph. Why not the
   reductions in the graph too: the engine issues them from its own progress state on a second
   stream (host-side tickets and events), and the decision all-reduces its norm over the world;
   capturing them would mean a second, device-side copy of the engine's reduce, decide and step
   for one flag, while this way the reduced gradients, the decision and AdamW are the eager
   run's own code and bits. The exact EP exchange waits on the host for the counts: refuse.h
   asks for --ep-exchange bounded. */

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
    if (!t->g_loss.data) { /* first use: the device state of the captured steps */
        int64_t si[2] = {t->o->accum, dsk_tensor_numel(&m->ids)}, st[2] = {t->o->accum, dsk_tensor_numel(&m->targets)};
        int64_t sl = t->o->accum;
        TM_TRY(dsk_tensor_alloc(&t->ctx, &t->g_ids, m->ids.dtype, 2, si));
        TM_TRY(dsk_tensor_alloc(&t->ctx, &t->g_tgt, m->targets.dtype, 2, st));
        TM_TRY(dsk_tensor_alloc(&t->ctx, &t->g_loss, DSK_F32, 1, &sl));
        if (!t->engine) TM_TRY(dsk_amp_dstep_init(&t->dstep, &t->ctx));
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

/* Every micro-batch of the step: its inputs copied in, forward, loss (kept) and backward. */
static dsk_status graph_passes(trainer *t, float gscale) {
    tm_model *m = &t->model;
    dsk_tensor r;
    TM_TRY(tm_zero_grads(m));
    for (int a = 0; a < t->o->accum; a++) {
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
    return DSK_OK;
}

/* What the graph holds: one step's device operations (see above), nothing that syncs. Several
   ranks (the engine): the passes only, without the engine's gradient marks (graph_step marks them). */
static dsk_status graph_record(trainer *t, float gscale) {
    const options *o = t->o;
    tm_model *m = &t->model;
    dsk_adamw_opts ao = graph_adamw(o, 0.0); /* lr comes from the dstep */
    dsk_tensor **grads;
    dsk_status s;
    if (t->engine) {
        dsk_status (*ready)(void *, int) = m->grad_ready;
        m->grad_ready = NULL;
        s = graph_passes(t, gscale);
        m->grad_ready = ready;
        return s;
    }
    TM_TRY(dsk_amp_dstep_upload(&t->dstep, &t->ctx));
    TM_TRY(graph_passes(t, gscale));
    grads = (dsk_tensor **)malloc((size_t)m->n_params * sizeof *grads);
    if (!grads) return dsk_set_error(DSK_ERR_OOM, "graph_record: out of memory");
    for (int i = 0; i < m->n_params; i++) grads[i] = &m->params[i].g; /* the eager step's order (one rank: no shards) */
    s = dsk_amp_unscale(&t->scaler, &t->ctx, grads, m->n_params);
    free(grads);
    TM_TRY(s);
    TM_TRY(dsk_amp_decide_dev(&t->dstep, &t->ctx, &t->scaler, o->clip));
    TM_TRY(
        dsk_amp_step_dev(&t->ctx, t->amp_decay, t->n_decay, &ao, &t->dstep, DSK_AMP_ROUND_NEAREST, (uint64_t)o->seed));
    ao.weight_decay = 0.0f;
    TM_TRY(
        dsk_amp_step_dev(&t->ctx, t->amp_plain, t->n_plain, &ao, &t->dstep, DSK_AMP_ROUND_NEAREST, (uint64_t)o->seed));
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
    if (t->engine) TM_TRY(tz_begin(&t->zero, 1)); /* one reducing pass: the marks come after the launch */
    else TM_TRY(dsk_amp_dstep_schedule(&t->dstep, &t->ctx, ao.lr, t->applied + 1, &ao));
    t->g_captured = !t->graph.exec || t->graph_scale != gscale;
    if (t->g_captured) {
        dsk_graph_free(&t->graph);
        TM_TRY(dsk_graph_begin(&t->ctx));
        s = graph_record(t, gscale);
        dsk_status e = dsk_graph_end(&t->ctx, &t->graph); /* ends the capture whatever happened inside it */
        TM_TRY(s);
        TM_TRY(e);
        t->graph_scale = gscale;
    }
    TM_TRY(dsk_graph_launch(&t->ctx, &t->graph));
    for (int i = 0; t->engine && i < t->model.n_params; i++) TM_TRY(tz_grad_ready(&t->zero, i));
    loss = (float *)malloc((size_t)n * sizeof *loss);
    if (!loss) return dsk_set_error(DSK_ERR_OOM, "graph_step: out of memory");
    s = dsk_tensor_wrap(&h, loss, DSK_F32, dsk_cpu(), 1, &n);
    if (s == DSK_OK) s = dsk_tensor_copy(&t->ctx, &h, &t->g_loss);
    for (int a = 0; s == DSK_OK && a < o->accum; a++) si->loss += loss[a] / o->accum;
    free(loss);
    return s;
}

/* The expert exchanges' bytes of the step: dsk_moe counts them on the host as it issues the
   calls, which only the capture does; a replay moves the captured step's bytes again (the
   bounded exchange's blocks are set by the shapes, not the routing). */
static void graph_ep_bytes(trainer *t, step_info *si) {
    for (int i = 0; i < 3; i++)
        if (t->g_captured) t->g_ep_bytes[i] = si->ep_bytes[i];
        else si->ep_bytes[i] = t->g_ep_bytes[i];
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
