/* train/mtp.h - multi-token prediction (MTP) of the example model: the modules' inputs, forward,
   loss and backward (the method: examples/train_mla.h's opening comment). Part of train_mla.h's
   definitions: it includes this file after the recomputation section, so the MLA helpers above
   and tm_model's definitions are in scope. */

/* ------------------------------------------------------------------ MTP */

/* Module k's inputs t_{i+k} = targets[i+k-1] and targets t_{i+k+1} = targets[i+k], per sequence;
   positions past the window take token 0 and target -1 (ignored). */
static dsk_status tmla_mtp_inputs(tm_model *m, int k, int nb) {
    const tm_config *c = &m->cfg;
    tmla_mtp *t = &m->mla.mtp[k - 1];
    int64_t T = c->seq, sh[2] = {nb, T};
    dsk_tensor tg, ids, tgt, src, dst;
    dsk_tensor trows = tm_rows(&m->targets, (int64_t)nb * T), irows = tm_rows(&t->ids, (int64_t)nb * T);
    dsk_tensor grows = tm_rows(&t->tgt, (int64_t)nb * T);
    TM_TRY(dsk_tensor_reshape(&trows, 2, sh, &tg));
    TM_TRY(dsk_tensor_reshape(&irows, 2, sh, &ids));
    TM_TRY(dsk_tensor_reshape(&grows, 2, sh, &tgt));
    TM_TRY(dsk_tensor_slice(&tg, 1, k - 1, T - k + 1, &src));
    TM_TRY(dsk_tensor_slice(&ids, 1, 0, T - k + 1, &dst));
    TM_TRY(dsk_tensor_copy(m->ctx, &dst, &src));
    TM_TRY(dsk_tensor_slice(&ids, 1, T - k + 1, k - 1, &dst));
    TM_TRY(dsk_tensor_fill(m->ctx, &dst, 0.0));
    TM_TRY(dsk_tensor_slice(&tg, 1, k, T - k, &src));
    TM_TRY(dsk_tensor_slice(&tgt, 1, 0, T - k, &dst));
    TM_TRY(dsk_tensor_copy(m->ctx, &dst, &src));
    TM_TRY(dsk_tensor_slice(&tgt, 1, T - k, k, &dst));
    return dsk_tensor_fill(m->ctx, &dst, -1.0);
}

/* The modules' inputs and their embeddings, beside the main model's (in the embedding's unit:
   ZeRO gathers the table around it); skipped by evaluation passes. */
static dsk_status tmla_mtp_embed(tm_model *m, int nb) {
    int64_t N = (int64_t)nb * m->cfg.seq;
    if (m->mla.eval) return DSK_OK;
    for (int k = 1; k <= m->cfg.mla.mtp_depth; k++) {
        tmla_mtp *t = &m->mla.mtp[k - 1];
        dsk_tensor ids = tm_rows(&t->ids, N), emb = tm_rows(&t->emb, N);
        TM_T(TM_PH_MOVE, tmla_mtp_inputs(m, k, nb));
        TM_T(TM_PH_EMBED, dsk_embedding(m->ctx, &emb, &m->embed->wc, &ids));
    }
    return DSK_OK;
}

/* x = M [hn | en], module t's projection on the rows of x. bf16: two products over M's column
   blocks; --dtype fp8: one FP8 linear on the concatenation (in m->mla.cat), kept in t->f8_in. */
static dsk_status tmla_mtp_proj_forward(tm_model *m, tmla_mtp *t, dsk_tensor *x, const dsk_tensor *hn,
                                        const dsk_tensor *en) {
    int64_t D = m->cfg.d_model;
    if (!m->cfg.fp8) {
        dsk_tensor ph = tmla_cols(&t->proj->wc, 0, D), pe = tmla_cols(&t->proj->wc, D, D);
        TM_T(TM_PH_LINEAR, tm_mm(m, x, hn, 0, &ph, 1, 0.0f));
        TM_T(TM_PH_LINEAR, tm_mm(m, x, en, 0, &pe, 1, 1.0f));
        return DSK_OK;
    }
    dsk_tensor cat = tm_rows(&m->mla.cat, x->shape[0]), ch = tmla_cols(&cat, 0, D), ce = tmla_cols(&cat, D, D);
    TM_T(TM_PH_MOVE, dsk_tensor_copy(m->ctx, &ch, hn));
    TM_T(TM_PH_MOVE, dsk_tensor_copy(m->ctx, &ce, en));
    TM_T(TM_PH_LINEAR, tf8_keep(m->ctx, &t->f8_in, &cat));
    TM_T(TM_PH_LINEAR, tf8_forward(m->ctx, &m->f8, x, &t->f8_in, &t->proj->wc, 0.0f));
    return DSK_OK;
}

/* The projection's backward from dx: M's gradient added (the caller makes it ready), d(hn) and
   d(en) written (fp8: through m->mla.cat). */
static dsk_status tmla_mtp_proj_backward(tm_model *m, tmla_mtp *t, const dsk_tensor *dx, dsk_tensor *dhn,
                                         dsk_tensor *den) {
    int64_t D = m->cfg.d_model;
    if (!m->cfg.fp8) {
        dsk_tensor ph = tmla_cols(&t->proj->wc, 0, D), pe = tmla_cols(&t->proj->wc, D, D);
        dsk_tensor gh = tmla_cols(&t->proj->g, 0, D), ge = tmla_cols(&t->proj->g, D, D);
        TM_T(TM_PH_LINEAR, tm_mm(m, &gh, dx, 1, &t->hn, 0, 1.0f));
        TM_T(TM_PH_LINEAR, tm_mm(m, &ge, dx, 1, &t->en, 0, 1.0f));
        TM_T(TM_PH_LINEAR, tm_mm(m, dhn, dx, 0, &ph, 0, 0.0f));
        TM_T(TM_PH_LINEAR, tm_mm(m, den, dx, 0, &pe, 0, 0.0f));
        return DSK_OK;
    }
    dsk_tensor cat = tm_rows(&m->mla.cat, dx->shape[0]), ch = tmla_cols(&cat, 0, D), ce = tmla_cols(&cat, D, D);
    dsk_tensor *g = &t->proj->g;
    const dsk_tensor *w = &t->proj->wc;
    TM_T(TM_PH_LINEAR, tf8_linear_backward(m->ctx, &m->f8, 1, &g, &w, &dx, &t->f8_in, &cat));
    TM_T(TM_PH_MOVE, dsk_tensor_copy(m->ctx, dhn, &ch));
    TM_T(TM_PH_MOVE, dsk_tensor_copy(m->ctx, den, &ce));
    return DSK_OK;
}

/* The D modules after the main forward (nb sequences); skipped by evaluation passes. */
static dsk_status tmla_mtp_forward(tm_model *m, int nb) {
    const tm_config *c = &m->cfg;
    int64_t N = (int64_t)nb * c->seq;
    if (m->mla.eval) return DSK_OK;
    for (int k = 1; k <= c->mla.mtp_depth; k++) {
        tmla_mtp *t = &m->mla.mtp[k - 1];
        tm_block *b = &m->blocks[c->n_layers + k - 1];
        dsk_tensor prev = tm_rows(k == 1 ? &m->x_final : &m->mla.mtp[k - 2].y, N);
        dsk_tensor emb = tm_rows(&t->emb, N), en = tm_rows(&t->en, N), hn = tm_rows(&t->hn, N);
        dsk_tensor re = tm_rows(&t->rstd_e, N), rh = tm_rows(&t->rstd_h, N), x = tm_rows(&b->x, N),
                   y = tm_rows(&t->y, N);
        TM_T(TM_PH_NORM, dsk_rmsnorm(m->ctx, &hn, &rh, &prev, &t->hnorm->wc, c->norm_eps));
        TM_T(TM_PH_NORM, dsk_rmsnorm(m->ctx, &en, &re, &emb, &t->enorm->wc, c->norm_eps));
        TM_TRY(tmla_mtp_proj_forward(m, t, &x, &hn, &en));
        TM_TRY(tm_attn_forward(m, b, nb));
        if (b->is_moe) TM_T(TM_PH_MOE, tm_moe_forward(m, c->n_layers + k - 1, N, &y));
        else TM_TRY(tm_dense_forward(m, b, N, &y));
        dsk_tensor hf = tm_rows(&t->hf, N), rf = tm_rows(&t->rstdf, N), logits = tm_rows(&t->logits, N);
        TM_T(TM_PH_NORM, dsk_rmsnorm(m->ctx, &hf, &rf, &y, &t->norm->wc, c->norm_eps));
        TM_T(TM_PH_HEAD, tm_mm(m, &logits, &hf, 0, &m->lm_head->wc, 1, 0.0f));
    }
    return DSK_OK;
}

/* Weight of module k's mean cross-entropy: lambda / D, times (T - k) / T for the report's 1/T. */
static float tmla_mtp_weight(const tm_config *c, int k) {
    return c->mla.mtp_lambda / (float)c->mla.mtp_depth * (float)(c->seq - k) / (float)c->seq;
}

/* Every module's loss and dlogits = grad_scale * d(weighted loss)/dlogits (full micro-batch). */
static dsk_status tmla_mtp_loss(tm_model *m, float grad_scale) {
    const tm_config *c = &m->cfg;
    for (int k = 1; k <= c->mla.mtp_depth; k++) {
        tmla_mtp *t = &m->mla.mtp[k - 1];
        TM_T(TM_PH_HEAD, dsk_cross_entropy(m->ctx, &t->loss, &t->dlogits, &t->logits, &t->tgt, -1,
                                           grad_scale * tmla_mtp_weight(c, k)));
    }
    return DSK_OK;
}

/* lambda / D sum_k L_k of the last forward, on the host (the gradient check's objective). */
static dsk_status tmla_mtp_objective(tm_model *m, double *out) {
    const tm_config *c = &m->cfg;
    *out = 0;
    for (int k = 1; k <= c->mla.mtp_depth; k++) {
        tmla_mtp *t = &m->mla.mtp[k - 1];
        float v;
        dsk_tensor h;
        TM_TRY(dsk_cross_entropy(m->ctx, &t->loss, NULL, &t->logits, &t->tgt, -1, 1.0f));
        TM_TRY(dsk_tensor_wrap(&h, &v, DSK_F32, dsk_cpu(), 0, NULL));
        TM_TRY(dsk_tensor_copy(m->ctx, &h, &t->loss));
        *out += (double)tmla_mtp_weight(c, k) * v;
    }
    return DSK_OK;
}

/* The embedding's gradient from every module's d(emb), depth D first, in the embedding's
   backward unit before the main model's term (ZeRO binds the table's gradient there). */
static dsk_status tmla_mtp_embed_backward(tm_model *m) {
    for (int k = m->cfg.mla.mtp_depth; k >= 1; k--) {
        tmla_mtp *t = &m->mla.mtp[k - 1];
        if (!m->dx32.data) {
            TM_T(TM_PH_EMBED, dsk_embedding_backward(m->ctx, &m->embed->g, &t->demb, &t->ids));
            continue;
        }
        TM_T(TM_PH_MOVE, dsk_tensor_copy(m->ctx, &m->dx32, &t->demb));
        TM_T(TM_PH_EMBED, dsk_embedding_backward(m->ctx, &m->embed->g, &m->dx32, &t->ids));
    }
    return DSK_OK;
}

/* dx holds d(block output) of MTP block l: its FFN's gradients, d(h2) in dh. */
static dsk_status tmla_mtp_ffn_backward(tm_model *m, int l) {
    if (!m->blocks[l].is_moe) return tm_dense_backward(m, &m->blocks[l]);
    TM_T(TM_PH_MOE, tm_moe_backward(m, l));
    for (int i = 0; i < m->n_params; i++) /* the MoE layer's gradients are final */
        if (m->params[i].moe_layer == l) TM_T(TM_PH_MOVE, tm_ready(m, &m->params[i]));
    return DSK_OK;
}

/* Backward of the modules, depth D first, before the main model's (the shared head's gradient
   is final only after it); leaves d(x_final) in dcarry and each d(emb) in its module. */
static dsk_status tmla_mtp_backward(tm_model *m) {
    const tm_config *c = &m->cfg;
    tmla_model *s = &m->mla;
    for (int k = c->mla.mtp_depth; k >= 1; k--) {
        tmla_mtp *t = &s->mtp[k - 1];
        tm_block *b = &m->blocks[c->n_layers + k - 1];
        const dsk_tensor *prev = k == 1 ? &m->x_final : &s->mtp[k - 2].y;
        TM_T(TM_PH_HEAD, tm_mm(m, &m->lm_head->g, &t->dlogits, 1, &t->hf, 0, 1.0f));
        TM_T(TM_PH_HEAD, tm_mm(m, &m->dh, &t->dlogits, 0, &m->lm_head->wc, 0, 0.0f));
        TM_T(TM_PH_MOVE, k == c->mla.mtp_depth ? tm_zero(m, &m->dx) : dsk_tensor_copy(m->ctx, &m->dx, &s->dcarry));
        TM_T(TM_PH_NORM,
             dsk_rmsnorm_backward(m->ctx, &m->dx, tm_grad(t->norm), &m->dh, &t->y, &t->norm->wc, &t->rstdf));
        TM_T(TM_PH_MOVE, tm_ready(m, t->norm));
        TM_TRY(tmla_mtp_ffn_backward(m, c->n_layers + k - 1));
        TM_T(TM_PH_NORM, dsk_rmsnorm_backward(m->ctx, &m->dx, tm_grad(b->ln2), &m->dh, &b->x2, &b->ln2->wc, &b->rstd2));
        TM_T(TM_PH_MOVE, tm_ready(m, b->ln2));
        TM_TRY(tm_attn_backward(m, b)); /* dx = d(block input) */
        TM_TRY(tmla_mtp_proj_backward(m, t, &m->dx, &m->dh, &s->dtmp)); /* d(hn), d(en) */
        TM_T(TM_PH_MOVE, tm_ready(m, t->proj));
        TM_T(TM_PH_MOVE, tm_zero(m, &t->demb));
        TM_T(TM_PH_NORM,
             dsk_rmsnorm_backward(m->ctx, &t->demb, tm_grad(t->enorm), &s->dtmp, &t->emb, &t->enorm->wc, &t->rstd_e));
        TM_T(TM_PH_MOVE, tm_zero(m, &s->dcarry));
        TM_T(TM_PH_NORM,
             dsk_rmsnorm_backward(m->ctx, &s->dcarry, tm_grad(t->hnorm), &m->dh, prev, &t->hnorm->wc, &t->rstd_h));
        TM_T(TM_PH_MOVE, tm_ready(m, t->enorm));
        TM_T(TM_PH_MOVE, tm_ready(m, t->hnorm));
    }
    return DSK_OK;
}

/* The residual gradient the main model's backward starts from: zero, or the MTP modules' d(x_final). */
static dsk_status tmla_seed_dx(tm_model *m) {
    return m->cfg.mla.mtp_depth > 0 ? dsk_tensor_copy(m->ctx, &m->dx, &m->mla.dcarry) : tm_zero(m, &m->dx);
}
