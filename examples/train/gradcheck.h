/* train/gradcheck.h - --grad-check N of examples/train_moe.c: N elements of every gradient
   against central differences of the objective backward differentiates, then exit. Part of the
   trainer's one translation unit (train_moe.c includes it before main). */

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
            if (fabs(fd - fd2) > 0.05 * fabs(fd) + 0.005 * gmax + 1e-5) {
                kinks++;
                continue;
            }
            double err = fabs(fd - g[j]) / (0.02 * fabs(fd) + 0.01 * gmax + 1e-5);
            if (err > worst) worst = err;
            checked++;
        }
        int off = worst > 1 || checked == 0;
        say(t, "grad-check %-28s |g|max %.3e  %d checked, %d near a routing switch, worst error / bound %.3f%s\n",
            p->name, gmax, checked, kinks, worst, off ? "  FAIL" : "");
        bad += off;
    }
    say(t, "grad-check: %d of %d parameters off\n", bad, m->n_params);
    return bad ? 1 : 0;
}
