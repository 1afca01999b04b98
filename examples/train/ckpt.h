/* train/ckpt.h - checkpoints of examples/train_moe.c over dsk_ckpt.h: the entries of every
   parameter and optimizer piece, the config and data-order strings a resume checks, save, load,
   resume from the newest good checkpoint, and --ckpt-dir's setup. Part of the trainer's one
   translation unit: train_moe.c includes it after validate. */

/* ---- checkpoints */

typedef struct ck_names {
    char (*name)[112];
    dsk_ckpt_entry *e;
    int n;
} ck_names;

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

static void ck_add(ck_names *c, const char *name, const char *suffix, dsk_tensor *tensor, const tm_param *p,
                   const trainer *t) {
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
        if (!load && p->sharded && t->ep > 1 && t->rank >= t->ep)
            continue; /* the ranks holding the same experts
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
    snprintf(buf, n,
             "vocab=%d seq=%d d_model=%d heads=%d layers=%d dense_layers=%d ffn_hidden=%d experts=%d shared=%d "
             "top_k=%d expert_hidden=%d score=%s batch=%d accum=%d dtype=%s seed=%lld",
             t->model.cfg.vocab, o->seq, o->d_model, o->heads, o->layers, o->dense_layers, o->ffn_hidden, o->experts,
             o->shared, o->top_k, o->expert_hidden, o->score, o->batch, o->accum, dsk_dtype_name(t->model.cfg.cdt),
             o->seed);
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
        return dsk_set_error(DSK_ERR_ARG, "checkpoint step %lld in %s read its data as \"%s\", this run as \"%s\"",
                             (long long)step, t->o->ckpt_dir, saved ? saved : "(not recorded)", order);
    int64_t world = 0;
    TM_TRY(dsk_ckpt_meta_i64(meta, "train.data_world", &world));
    if (world != t->dp_size)
        say(t,
            "resume: the checkpoint's data was read by %lld data-parallel ranks, this run has %d: DistributedSampler "
            "gives each rank another slice, so the samples of the current epoch are not those of an uninterrupted "
            "run (a global batch holds the same samples while no epoch ends)\n",
            (long long)world, t->dp_size);
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

static dsk_status meta_int(const dsk_ckpt_meta *meta, const char *key, int64_t *v) {
    return dsk_ckpt_meta_i64(meta, key, v);
}

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
        s = dsk_set_error(DSK_ERR_ARG, "checkpoint step %lld in %s was written with \"%s\", this run has \"%s\"",
                          (long long)step, t->o->ckpt_dir, saved ? saved : "(no configuration)", cfg);
    if (s == DSK_OK && has_moe(t)) { /* every MoE option, named when it differs */
        dsk_moe tmp;
        s = moe_template(t, &tmp);
        if (s == DSK_OK)
            s = dsk_moe_config_check(&tmp, "moe", (const char *const *)meta.keys, (const char *const *)meta.values,
                                     meta.n);
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
        if (m->params[i].wc.data != m->params[i].w.data)
            TM_TRY(dsk_tensor_copy(&t->ctx, &m->params[i].wc, &m->params[i].w));
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
        if (restart > 0) say(t, "restart %d: no --ckpt-dir, starting again from step 0\n", restart);
        return;
    }
    if (restart > 0 && !o->resume) {
        say(t, "restart %d: resuming from the newest complete checkpoint in %s (as --resume auto)\n", restart,
            o->ckpt_dir);
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
            fail(t,
                 "--ckpt-dir %s already holds checkpoints (newest: step %lld); pass --resume to continue from it or "
                 "choose another directory",
                 o->ckpt_dir, (long long)last);
        return;
    }
    if (last < 0) {
        say(t, "resume: no complete checkpoint in %s yet, starting at step 0\n", o->ckpt_dir);
        return;
    }
    resume_newest_good(t);
    int64_t epoch, offset;
    data_epoch(t, &epoch, &offset);
    say(t, "resume: step %lld from %s (data position %lld: epoch %lld, sample %lld of %lld on each rank)\n",
        (long long)t->step, o->ckpt_dir, (long long)t->data_pos, (long long)epoch, (long long)offset,
        (long long)t->loader.smp.num_samples);
}
