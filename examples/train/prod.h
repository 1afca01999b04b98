/* train/prod.h - examples/train_moe.c in production (README: Running in production): placement
   (--bind, over train_bind.h), the metrics (--metrics FILE, --metrics-port, over
   train_metrics.h), the launcher and its restarts (--nproc, --max-restarts, over
   train_signals.h's ts_launch) and pre-emption (SIGTERM/SIGINT/SIGUSR1 agreed by every rank).
   Part of the trainer's one translation unit: train_moe.c includes it after the checkpoints,
   before main. */

/* --bind: pins this rank (every thread so far, and those started later) and prints where. */
static void setup_bind(trainer *t) {
    int local = t->have_comm ? t->comm.local_rank : 0, local_world = t->have_comm ? t->comm.local_world_size : 1,
        cpus = 0;
    char line[1400];
    CHECK(tb_bind(t->o->bind, local, local_world, &cpus, line, sizeof line));
    if (strcmp(t->o->bind, "none") != 0) t->bind_cpus = cpus;
    printf("%s\n", line);
    fflush(stdout);
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
    double t0 = tm_clock();
    dsk_status s = save_checkpoint(t);
    t->mv.checkpoint_s += tm_clock() - t0;
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
    if (k <= 0) {
        fprintf(stderr, "train_moe: --nproc: cannot find this program: %s\n", strerror(errno));
        return 1;
    }
    exe[k] = 0;
    char **args = (char **)calloc((size_t)argc + 1, sizeof *args);
    if (!args) return 1;
    int n = 0;
    args[n++] = exe;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--nproc") == 0) {
            i++;
            continue;
        }
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
        say(t,
            "pre-empted: %s, stopped after step %lld, checkpoint of step %lld saved in %s; exiting with status 0%s\n",
            ts_signal_name(sig), (long long)t->step, (long long)t->step, t->o->ckpt_dir, after);
    else
        say(t, "pre-empted: %s, stopped after step %lld; no --ckpt-dir, nothing saved; exiting with status 0%s\n",
            ts_signal_name(sig), (long long)t->step, after);
}
