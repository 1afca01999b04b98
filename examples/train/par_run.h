/* train/par_run.h - the run of examples/train_par.h's model: one block forward and backward
   (tensor-parallel attention, MLA and FFN, the expert-parallel MoE layer), the MTP modules, the
   pipeline stages (the executor's callbacks, tp_train_batch, tp_eval_batch), the loss and the
   checkpoints' expert-bias writer. Moved whole from train_par.h, which keeps the types, the
   layout, the placement and the views and includes this file at its end. */

/* ------------------------------------------------------------------ one block */

typedef struct tp_acts { /* one slot of a layer */
    dsk_tensor x, h1, rstd1, h1g, q, k, v, qr, kr, att, probs, x2, h2, rstd2, h2g, g, u, a;
    tf8_act f8_h1, f8_att, f8_h2, f8_a; /* --dtype fp8: the caches of the linears' inputs h1g, att, h2g, a */
} tp_acts;

/* The slot of a layer's activation that `need` recomputes (tp_act): 0 when shared. */
static int tp_sl(const tp_layer *L, int need, int slot) { return L->rc >= need ? 0 : slot; }

static tp_acts tp_slot(tp_state *ps, int l, int slot) {
    tp_layer *L = &ps->layers[l];
    tp_acts s;
    int f = tp_sl(L, TMLA_RECOMPUTE_FULL, slot), a = tp_sl(L, TMLA_RECOMPUTE_ATTN, slot);
    int dense = !ps->m->blocks[l].is_moe, f8 = tp_sl(L, tp_need_f8(ps, TMLA_RECOMPUTE_FULL), slot); /* tp_alloc_acts */
    memset(&s, 0, sizeof s);
    s.x = tp_part(&L->x, slot, ps->Ns);
    s.h1 = tp_part(&L->h1, f8, ps->Ns);
    s.rstd1 = tp_part(&L->rstd1, f, ps->Ns);
    s.x2 = tp_part(&L->x2, f, ps->Ns);
    s.h2 = tp_part(&L->h2, dense ? f8 : f, ps->Ns);
    s.rstd2 = tp_part(&L->rstd2, f, ps->Ns);
    s.h1g = ps->tp > 1 ? tp_part(&L->h1g, f8, ps->Nm) : s.h1;
    if (!tmla_is_mla(&ps->m->cfg.mla)) { /* MLA's own: tp_mla_slot */
        s.q = tp_part(&L->q, f, ps->Nm);
        s.k = tp_part(&L->k, f, ps->Nm);
        s.v = tp_part(&L->v, f, ps->Nm);
        s.qr = tp_part(&L->qr, f, ps->Nm);
        s.kr = tp_part(&L->kr, f, ps->Nm);
        s.att = tp_part(&L->att, tp_sl(L, tp_need_f8(ps, TMLA_RECOMPUTE_ATTN), slot), ps->Nm);
        s.probs = tp_part(&L->probs, a, ps->Bm);
    }
    if (dense) {
        s.h2g = ps->tp > 1 ? tp_part(&L->h2g, f8, ps->Nm) : s.h2;
        s.g = tp_part(&L->g, f, ps->Nm);
        s.u = tp_part(&L->u, f, ps->Nm);
        s.a = tp_part(&L->a, f8, ps->Nm);
    }
    if (ps->m->cfg.fp8) {
        s.f8_h1 = tf8_act_part(&L->f8_h1, f, ps->Nm);
        if (L->f8_att.q.data) s.f8_att = tf8_act_part(&L->f8_att, a, ps->Nm); /* MHA's (MLA: tmla_model's) */
        if (dense) s.f8_h2 = tf8_act_part(&L->f8_h2, f, ps->Nm);
        if (dense) s.f8_a = tf8_act_part(&L->f8_a, f, ps->Nm);
    }
    return s;
}

/* The place of this rank's first row of micro-batch `micro` in the rank's batch (its MoE calls'
   rows for routing record and replay): the micro-batch's sequences, then the sequence-parallel
   shard of the tensor-parallel rank. */
static int64_t tp_row0(const tp_state *ps, int micro) {
    return (int64_t)micro * ps->Nm + (int64_t)ps->grid.at.tp * ps->Ns;
}

/* A recorded or replayed routing (--routes): the MoE forward runs whole in its begin. */
static int tp_moe_whole(const tp_state *ps) { return ps->m->routes && ps->m->routes->mode != TM_ROUTES_OFF; }

/* y = MoE(h) of block l on this rank's Ns rows of micro-batch `micro`, in two calls split where
   the rows' exchange starts (dsk_moe_forward_begin; tp_moe_forward_end writes y): through the
   layer's f32 buffers mx/my when it computes in another dtype than the model (f16: tm_moe_dtype),
   as tm_moe_forward does. */
static dsk_status tp_moe_forward_begin(tp_state *ps, int l, int micro, dsk_tensor *y, const dsk_tensor *h,
                                       dsk_moe_stats *st) {
    tm_model *m = ps->m;
    tm_block *b = &m->blocks[l];
    dsk_tensor mx, my;
    const dsk_tensor *x = h;
    if (b->mx.data) {
        mx = tm_rows(&b->mx, ps->Ns);
        my = tm_rows(&b->my, ps->Ns);
        TM_TRY(dsk_tensor_copy(ps->ctx, &mx, h));
        x = &mx;
    }
    if (tp_moe_whole(ps)) return tm_moe_call(m, &b->moe, l, tp_row0(ps, micro), b->mx.data ? &my : y, x, st);
    TM_TRY(dsk_moe_set_loss_span(&b->moe, m->loss_group, m->loss_row0, m->loss_rows));
    return dsk_moe_forward_begin(&b->moe, ps->ctx, x);
}

static dsk_status tp_moe_forward_end(tp_state *ps, int l, dsk_tensor *y, dsk_moe_stats *st) {
    tm_block *b = &ps->m->blocks[l];
    dsk_tensor my;
    if (!b->mx.data) return tp_moe_whole(ps) ? DSK_OK : dsk_moe_forward_end(&b->moe, ps->ctx, y, st);
    my = tm_rows(&b->my, ps->Ns);
    if (!tp_moe_whole(ps)) TM_TRY(dsk_moe_forward_end(&b->moe, ps->ctx, &my, st));
    return dsk_tensor_copy(ps->ctx, y, &my);
}

/* ps->dx holds d(block output): the MoE layer's backward of its forward in the slot in use, split
   at the exchange of the rows' gradients; tp_moe_backward_end writes d(h2) into ps->dh (through
   mx/my as tm_moe_backward). */
static dsk_status tp_moe_backward_begin(tp_state *ps, int l) {
    tm_model *m = ps->m;
    tm_block *b = &m->blocks[l];
    dsk_tensor my;
    if (!b->my.data) return dsk_moe_backward_begin(&b->moe, ps->ctx, &ps->dx, m->aux_scale);
    my = tm_rows(&b->my, ps->Ns);
    TM_TRY(dsk_tensor_copy(ps->ctx, &my, &ps->dx));
    return dsk_moe_backward_begin(&b->moe, ps->ctx, &my, m->aux_scale);
}

static dsk_status tp_moe_backward_end(tp_state *ps, int l) {
    tm_block *b = &ps->m->blocks[l];
    dsk_tensor mx;
    if (!b->mx.data) {
        TM_TRY(dsk_tensor_fill(ps->ctx, &ps->dh, 0.0));
        return dsk_moe_backward_end(&b->moe, ps->ctx, &ps->dh);
    }
    mx = tm_rows(&b->mx, ps->Ns);
    TM_TRY(dsk_tensor_fill(ps->ctx, &mx, 0.0));
    TM_TRY(dsk_moe_backward_end(&b->moe, ps->ctx, &mx));
    return dsk_tensor_copy(ps->ctx, &ps->dh, &mx);
}

/* The parallel linears of dsk_par.h, or under --dtype fp8 the same layout with each shard's
   GEMMs in FP8 (train_fp8.h): the input the shard multiplies (the gathered one when sequence
   parallel) quantised into its e4m3 cache in forward, which backward reads instead of the bf16
   input; the tensor-parallel collectives (gathers, reduce-scatters, all-reduces) in bf16 as
   without. A row-parallel shard's K is its D/tp or F/tp columns, so its 1x128 scales and 128x128
   weight blocks cover other elements than one rank's: the layouts agree within FP8's rounding,
   not bit for bit. */

/* Y[i] = Xf W[i]^T for i < n (dsk_par_column_forward); fp8: Xf kept in act. */
static dsk_status tp_column_forward(tp_state *ps, int n, dsk_tensor *const *Y, const dsk_tensor *const *W,
                                    const dsk_tensor *X, dsk_tensor *xg, tf8_act *act) {
    tm_model *m = ps->m;
    if (!m->cfg.fp8) return dsk_par_column_forward(&ps->grid.tp, ps->ctx, n, Y, W, X, xg);
    if (xg) TM_TRY(dsk_par_map_forward(&ps->grid.tp, ps->ctx, DSK_PAR_MAP_GATHER, 0, xg, X));
    TM_TRY(tf8_keep(ps->ctx, act, xg ? xg : X));
    for (int i = 0; i < n; i++) TM_TRY(tf8_forward(ps->ctx, &m->f8, Y[i], act, W[i], 0.0f));
    return DSK_OK;
}

/* dW[i] += dY[i]^T Xf, d(X) summed over tp (dsk_par_column_backward); fp8: Xf from act. */
static dsk_status tp_column_backward(tp_state *ps, int n, dsk_tensor *dX, dsk_tensor *dxg, dsk_tensor *const *dW,
                                     const dsk_tensor *const *dY, const dsk_tensor *const *W, const dsk_tensor *Xf,
                                     const tf8_act *act) {
    dsk_comm *tp = &ps->grid.tp;
    if (!ps->m->cfg.fp8) return dsk_par_column_backward(tp, ps->ctx, n, dX, dxg, dW, dY, W, Xf);
    TM_TRY(tf8_linear_backward(ps->ctx, &ps->m->f8, n, dW, W, dY, act, dxg ? dxg : dX));
    if (dxg) return dsk_par_map_forward(tp, ps->ctx, DSK_PAR_MAP_SCATTER, 0, dX, dxg);
    return dsk_par_map_forward(tp, ps->ctx, DSK_PAR_MAP_REDUCE, 0, dX, dX);
}

/* The row-parallel linear's partial product X W^T into p (this rank's part of the sum over tp);
   fp8: X kept in act. beta as dsk_matmul. */
static dsk_status tp_row_partial(tp_state *ps, dsk_tensor *p, const dsk_tensor *X, const dsk_tensor *W, tf8_act *act,
                                 float beta) {
    if (!ps->m->cfg.fp8) return dsk_matmul(ps->ctx, p, X, 0, W, 1, 1.0f, beta);
    TM_TRY(tf8_keep(ps->ctx, act, X));
    return tf8_forward(ps->ctx, &ps->m->f8, p, act, W, beta);
}

/* dX = dYf W, dW += dYf^T X, dYf the gathered dY when dyg (dsk_par_row_backward); fp8: X from act. */
static dsk_status tp_row_backward(tp_state *ps, dsk_tensor *dX, dsk_tensor *dW, const dsk_tensor *dY, dsk_tensor *dyg,
                                  const dsk_tensor *X, const dsk_tensor *W, const tf8_act *act) {
    dsk_comm *tp = &ps->grid.tp;
    if (!ps->m->cfg.fp8) return dsk_par_row_backward(tp, ps->ctx, dX, dW, dY, dyg, X, W);
    if (dyg) TM_TRY(dsk_par_map_forward(tp, ps->ctx, DSK_PAR_MAP_GATHER, 0, dyg, dY));
    const dsk_tensor *dYf = dyg ? dyg : dY;
    return tf8_linear_backward(ps->ctx, &ps->m->f8, 1, &dW, &W, &dYf, act, dX);
}

/* y = r + X W^T through the row-parallel linear W. On one tensor-parallel rank as train_model.h
   does it: y = r, then one GEMM adds to it (one rounding in bf16/f16, the one-rank bits); over
   several the linear's reduced output, then the add. fp8: X kept in act. */
static dsk_status tp_row_residual(tp_state *ps, tm_phase ph, dsk_tensor *y, const dsk_tensor *r, const dsk_tensor *X,
                                  const dsk_tensor *W, tf8_act *act) {
    tm_model *m = ps->m;
    if (ps->tp == 1) {
        TM_T(TM_PH_MOVE, dsk_tensor_copy(ps->ctx, y, r));
        TM_T(ph, tp_row_partial(ps, y, X, W, act, 1.0f));
        return DSK_OK;
    }
    if (!m->cfg.fp8) {
        TM_T(ph, dsk_par_row_forward(&ps->grid.tp, ps->ctx, &ps->tmp, tp_sp(ps, &ps->big), X, W));
    } else {
        TM_T(ph, tp_row_partial(ps, &ps->big, X, W, act, 0.0f));
        TM_T(ph, dsk_par_map_forward(&ps->grid.tp, ps->ctx, DSK_PAR_MAP_SCATTER, 0, &ps->tmp, &ps->big));
    }
    TM_T(TM_PH_MOVE, dsk_add(ps->ctx, y, r, &ps->tmp));
    return DSK_OK;
}

/* Points MLA block l's activations (train_mla.h reads them from the block) at slot `slot`. */
static void tp_mla_slot(tp_state *ps, int l, int slot) {
    const tp_layer *Ly = &ps->layers[l];
    const tmla_block *L = &Ly->mla;
    tmla_block *p = &ps->m->blocks[l].mla;
    int f = tp_sl(Ly, TMLA_RECOMPUTE_FULL, slot), a = tp_sl(Ly, TMLA_RECOMPUTE_ATTN, slot);
    int f8 = tp_sl(Ly, tp_need_f8(ps, TMLA_RECOMPUTE_FULL), slot); /* the normed latents (tp_alloc_mla) */
    const dsk_tensor *src[] = {&L->cq, &L->rstd_q, &L->q, &L->ckv, &L->rstd_kv, &L->kpe, &L->kvb, &L->k};
    dsk_tensor *dst[] = {&p->cq, &p->rstd_q, &p->q, &p->ckv, &p->rstd_kv, &p->kpe, &p->kvb, &p->k};
    for (size_t i = 0; i < sizeof src / sizeof src[0]; i++)
        if (src[i]->data) *dst[i] = tp_part(src[i], f, ps->Nm);
    if (L->cqn.data) p->cqn = tp_part(&L->cqn, f8, ps->Nm);
    p->ckvn = tp_part(&L->ckvn, f8, ps->Nm);
    p->att = tp_part(&L->att, a, ps->Nm);
    p->lse = tp_part(&L->lse, a, ps->Bm);
    if (!ps->m->cfg.fp8) return;
    ps->m->blocks[l].f8_h1 = tf8_act_part(&Ly->f8_h1, f, ps->Nm); /* the caches (tp_alloc_f8) */
    if (L->f8_cqn.q.data) p->f8_cqn = tf8_act_part(&L->f8_cqn, f, ps->Nm);
    p->f8_ckvn = tf8_act_part(&L->f8_ckvn, f, ps->Nm);
}

/* MLA's attention half on slot s (h1 = RMSNorm(x) done): x2 = x + Wo att. Megatron-Core's
   layout: the latent down-projections (Wq_a, Wkv_a with the shared rope key) and their norms
   are replicated and run on the sequence-parallel-gathered h1g, whole on every tensor-parallel
   rank; the up-projections (Wq or Wq_b, Wkv_b) are column-parallel by heads and Wo row-parallel,
   so the rank's heads need no collective until Wo's reduce-scatter. */
static dsk_status tp_mla_forward(tp_state *ps, int l, int slot, tp_acts *s) {
    tm_model *m = ps->m;
    tm_block *b = &m->blocks[l];
    tp_mla_slot(ps, l, slot);
    if (ps->tp > 1)
        TM_T(TM_PH_MOVE, dsk_par_map_forward(&ps->grid.tp, ps->ctx, DSK_PAR_MAP_GATHER, 0, &s->h1g, &s->h1));
    TM_TRY(tmla_latent_forward(m, b, ps->Bm, &s->h1g));
    return tp_row_residual(ps, TM_PH_LINEAR, &s->x2, &s->x, &b->mla.att, &b->mla.wo->wc, &m->mla.f8_att);
}

/* ps->dx holds d(x2) of slot s: d(h1) into ps->dh and the MLA weights' gradients. The rank's
   heads give only their part of d(latent) (every head reads the whole latent), so the
   replicated down-projections' and latent norms' weight gradients on a rank cover every token
   but only its heads: the sum over tp of them is the gradient, which the engine's replicated
   group takes (the sum over the stage's tp x dp ranks, as the sequence-parallel norms' token
   shares); d(h1g) likewise sums over tp, which the reduce-scatter to the rank's rows does. */
static dsk_status tp_mla_backward(tp_state *ps, int l, int slot, tp_acts *s) {
    tm_model *m = ps->m;
    tm_block *b = &m->blocks[l];
    dsk_comm *tp = &ps->grid.tp;
    dsk_tensor *dh = ps->tp > 1 ? &ps->big : &ps->dh; /* d(h1g): all Nm rows */
    tp_mla_slot(ps, l, slot);
    if (m->cfg.fp8) TM_T(TM_PH_LINEAR, tf8_keep(ps->ctx, &m->mla.f8_att, &b->mla.att)); /* forward's codes again */
    TM_T(TM_PH_LINEAR, tp_row_backward(ps, &m->mla.datt, &b->mla.wo->g, &ps->dx, tp_sp(ps, &ps->big), &b->mla.att,
                                       &b->mla.wo->wc, &m->mla.f8_att));
    TM_TRY(tmla_latent_backward(m, b, ps->Bm, &s->h1g, dh));
    if (ps->tp > 1) TM_T(TM_PH_MOVE, dsk_par_map_forward(tp, ps->ctx, DSK_PAR_MAP_SCATTER, 0, &ps->dh, dh));
    return DSK_OK;
}

/* The attention core of block l again on slot s (--recompute attn: its output and statistics,
   or MHA's probabilities, are shared by the layers); the same ops on the same inputs. */
static dsk_status tp_core(tp_state *ps, int l, int slot, tp_acts *s) {
    tm_model *m = ps->m;
    if (tmla_is_mla(&m->cfg.mla)) {
        tp_mla_slot(ps, l, slot);
        return tmla_core(m, &m->blocks[l], ps->Bm);
    }
    dsk_tensor qr4 = tp_heads(ps, &s->qr), kr4 = tp_heads(ps, &s->kr), v4 = tp_heads(ps, &s->v);
    dsk_tensor att4 = tp_heads(ps, &s->att);
    TM_T(TM_PH_ATTN, dsk_attention(ps->ctx, &att4, &s->probs, &qr4, &kr4, &v4, 1.0f / sqrtf((float)ps->Dh)));
    return DSK_OK;
}

/* The attention half of block l on slot s (its x filled): x2 = x + attention(RMSNorm(x)) and
   h2 = RMSNorm(x2), everything backward needs kept. */
static dsk_status tp_attn_half(tp_state *ps, int l, int slot, tp_acts *s) {
    tm_model *m = ps->m;
    tm_block *b = &m->blocks[l];
    dsk_ctx *ctx = ps->ctx;
    const tm_config *c = &m->cfg;
    TM_T(TM_PH_NORM, dsk_rmsnorm(ctx, &s->h1, &s->rstd1, &s->x, &b->ln1->wc, c->norm_eps));
    if (tmla_is_mla(&c->mla)) {
        TM_TRY(tp_mla_forward(ps, l, slot, s));
    } else {
        dsk_tensor *Y3[3] = {&s->q, &s->k, &s->v};
        const dsk_tensor *W3[3] = {&b->wq->wc, &b->wk->wc, &b->wv->wc};
        TM_T(TM_PH_LINEAR, tp_column_forward(ps, 3, Y3, W3, &s->h1, tp_sp(ps, &s->h1g), &s->f8_h1));
        dsk_tensor q4 = tp_heads(ps, &s->q), k4 = tp_heads(ps, &s->k), qr4 = tp_heads(ps, &s->qr);
        dsk_tensor kr4 = tp_heads(ps, &s->kr);
        TM_T(TM_PH_ROPE, dsk_rope(ctx, &qr4, &q4, 0, c->rope_theta));
        TM_T(TM_PH_ROPE, dsk_rope(ctx, &kr4, &k4, 0, c->rope_theta));
        TM_TRY(tp_core(ps, l, slot, s));
        TM_TRY(tp_row_residual(ps, TM_PH_LINEAR, &s->x2, &s->x, &s->att, &b->wo->wc, &s->f8_att));
    }
    TM_T(TM_PH_NORM, dsk_rmsnorm(ctx, &s->h2, &s->rstd2, &s->x2, &b->ln2->wc, c->norm_eps));
    return DSK_OK;
}

/* The dense FFN's input side on slot s: g, u = the column-parallel W1, W3 of h2, a = SwiGLU. */
static dsk_status tp_ffn_in(tp_state *ps, const tm_block *b, tp_acts *s) {
    tm_model *m = ps->m;
    dsk_tensor *Y2[2] = {&s->g, &s->u};
    const dsk_tensor *W2[2] = {&b->w1->wc, &b->w3->wc};
    TM_T(TM_PH_FFN, tp_column_forward(ps, 2, Y2, W2, &s->h2, tp_sp(ps, &s->h2g), &s->f8_h2));
    TM_T(TM_PH_FFN, dsk_swiglu(ps->ctx, &s->a, &s->g, &s->u));
    return DSK_OK;
}

/* Block l on slot `slot` (its x filled), y = block(x) with everything backward needs kept, in
   three parts around an MoE layer's exchange: up to it (a dense block whole), the MoE layer's
   begin (tp_block_forward_moe, 0) and end (1), the rest (tp_block_forward_post). */
static dsk_status tp_block_forward_pre(tp_state *ps, int l, int slot, dsk_tensor *y) {
    tm_block *b = &ps->m->blocks[l];
    tp_acts s = tp_slot(ps, l, slot);
    TM_TRY(tp_attn_half(ps, l, slot, &s));
    if (!b->is_moe) {
        TM_TRY(tp_ffn_in(ps, b, &s));
        return tp_row_residual(ps, TM_PH_FFN, y, &s.x2, &s.a, &b->w2->wc, &s.f8_a);
    }
    return DSK_OK;
}

static dsk_status tp_block_forward_moe(tp_state *ps, int l, int slot, int micro, dsk_tensor *y, int end) {
    tm_model *m = ps->m;
    tm_block *b = &m->blocks[l];
    dsk_moe_stats *st = m->want_stats ? &b->stats : NULL;
    dsk_tensor h2 = tp_slot(ps, l, slot).h2;
    if (end) {
        TM_T(TM_PH_MOE, tp_moe_forward_end(ps, l, y, st));
        return DSK_OK;
    }
    /* the slot at the begin, not before: until then a pair's other micro-batch may be in the layer */
    TM_TRY(dsk_moe_use_slot(&b->moe, tp_moe_slots(ps, l) > 1 ? slot : 0));
    TM_T(TM_PH_MOE, tp_moe_forward_begin(ps, l, micro, y, &h2, st));
    return DSK_OK;
}

static dsk_status tp_block_forward_post(tp_state *ps, int l, int slot, int micro, dsk_tensor *y) {
    tm_model *m = ps->m;
    tm_block *b = &m->blocks[l];
    if (!b->is_moe) return DSK_OK;
    dsk_tensor x2 = tp_slot(ps, l, slot).x2;
    ps->layers[l].moe_micro = ps->train && !b->moe.eval ? micro : -1;
    TM_T(TM_PH_MOVE, dsk_add(ps->ctx, y, y, &x2));
    return DSK_OK;
}

static dsk_status tp_block_forward(tp_state *ps, int l, int slot, int micro, dsk_tensor *y) {
    TM_TRY(tp_block_forward_pre(ps, l, slot, y));
    if (ps->m->blocks[l].is_moe) {
        TM_TRY(tp_block_forward_moe(ps, l, slot, micro, y, 0));
        TM_TRY(tp_block_forward_moe(ps, l, slot, micro, y, 1));
    }
    return tp_block_forward_post(ps, l, slot, micro, y);
}

/* ps->dx holds d(x2) of slot s of an MHA block: d(h1) into ps->dh and the weights' gradients. */
static dsk_status tp_mha_backward(tp_state *ps, int l, tp_acts *s) {
    tm_model *m = ps->m;
    tm_block *b = &m->blocks[l];
    dsk_ctx *ctx = ps->ctx;
    const tm_config *c = &m->cfg;
    TM_T(TM_PH_LINEAR,
         tp_row_backward(ps, &ps->datt, &b->wo->g, &ps->dx, tp_sp(ps, &ps->big), &s->att, &b->wo->wc, &s->f8_att));
    dsk_tensor qr4 = tp_heads(ps, &s->qr), kr4 = tp_heads(ps, &s->kr), v4 = tp_heads(ps, &s->v);
    dsk_tensor do4 = tp_heads(ps, &ps->datt), dqr4 = tp_heads(ps, &ps->dqr), dkr4 = tp_heads(ps, &ps->dkr);
    dsk_tensor dv4 = tp_heads(ps, &ps->dv), dq4 = tp_heads(ps, &ps->dq), dk4 = tp_heads(ps, &ps->dk);
    TM_T(TM_PH_ATTN, dsk_attention_backward(ctx, &dqr4, &dkr4, &dv4, &do4, &qr4, &kr4, &v4, &s->probs,
                                            1.0f / sqrtf((float)ps->Dh), DSK_GRAD_WRITE));
    TM_T(TM_PH_ROPE, dsk_rope_backward(ctx, &dq4, &dqr4, 0, c->rope_theta, DSK_GRAD_WRITE));
    TM_T(TM_PH_ROPE, dsk_rope_backward(ctx, &dk4, &dkr4, 0, c->rope_theta, DSK_GRAD_WRITE));
    dsk_tensor *dW[3] = {&b->wq->g, &b->wk->g, &b->wv->g};
    const dsk_tensor *dY[3] = {&ps->dq, &ps->dk, &ps->dv}, *W[3] = {&b->wq->wc, &b->wk->wc, &b->wv->wc};
    TM_T(TM_PH_LINEAR, tp_column_backward(ps, 3, &ps->dh, tp_sp(ps, &ps->big), dW, dY, W, &s->h1g, &s->f8_h1));
    return DSK_OK;
}

/* ps->dx holds d(block output) of slot `slot`; leaves d(block input) there, gradients added. In
   three parts around an MoE layer's exchange as the forward: up to it (recomputation; a dense
   block's FFN, d(h2) into ps->dh), the MoE layer's begin and end (tp_block_backward_moe: d(h2)
   into ps->dh), the rest (tp_block_backward_post: the norms and the attention). */
static dsk_status tp_block_backward_pre(tp_state *ps, int l, int slot, int micro) {
    tm_model *m = ps->m;
    tm_block *b = &m->blocks[l];
    dsk_ctx *ctx = ps->ctx;
    tp_acts s = tp_slot(ps, l, slot);
    int rc = ps->layers[l].rc;
    if (rc == TMLA_RECOMPUTE_FULL) { /* only x was kept: the forward again (an MoE layer keeps its own state) */
        TM_TRY(tp_attn_half(ps, l, slot, &s));
        if (!b->is_moe) TM_TRY(tp_ffn_in(ps, b, &s));
        if (s.f8_a.q.data) TM_T(TM_PH_FFN, tf8_keep(ctx, &s.f8_a, &s.a)); /* fp8: W2's input (tp_row_residual's) */
    }
    if (!b->is_moe) {
        TM_T(TM_PH_FFN,
             tp_row_backward(ps, &ps->da, &b->w2->g, &ps->dx, tp_sp(ps, &ps->big), &s.a, &b->w2->wc, &s.f8_a));
        TM_T(TM_PH_FFN, dsk_swiglu_backward(ctx, &ps->dg, &ps->du, &ps->da, &s.g, &s.u, DSK_GRAD_WRITE));
        dsk_tensor *dW[2] = {&b->w1->g, &b->w3->g};
        const dsk_tensor *dY[2] = {&ps->dg, &ps->du}, *W[2] = {&b->w1->wc, &b->w3->wc};
        TM_T(TM_PH_FFN, tp_column_backward(ps, 2, &ps->dh, tp_sp(ps, &ps->big), dW, dY, W, &s.h2g, &s.f8_h2));
        return DSK_OK;
    }
    tp_layer *L = &ps->layers[l];
    if (tp_moe_slots(ps, l) == 1 && L->moe_micro != micro) { /* another micro-batch ran through the layer since: */
        int eval = b->moe.eval;                              /* its forward again */
        dsk_status st;
        if (ps->pend) /* tp_pair_run: no second exchange in flight (paired schedules keep S slots) */
            return dsk_set_error(DSK_ERR_STATE,
                                 "tp_block_backward: layer %d's forward again while another "
                                 "micro-batch's expert exchange is in flight",
                                 l);
        TM_TRY(dsk_moe_use_slot(&b->moe, 0));
        b->moe.eval = 1;
        st = tp_moe_forward_begin(ps, l, micro, &ps->tmp, &s.h2, NULL);
        if (st == DSK_OK) st = tp_moe_forward_end(ps, l, &ps->tmp, NULL);
        b->moe.eval = eval;
        TM_TRY(st);
    }
    L->moe_micro = -1;
    return DSK_OK;
}

static dsk_status tp_block_backward_moe(tp_state *ps, int l, int slot, int end) {
    tm_model *m = ps->m;
    if (end) {
        TM_T(TM_PH_MOE, tp_moe_backward_end(ps, l));
        return DSK_OK;
    }
    TM_TRY(dsk_moe_use_slot(&m->blocks[l].moe, tp_moe_slots(ps, l) > 1 ? slot : 0));
    TM_T(TM_PH_MOE, tp_moe_backward_begin(ps, l));
    return DSK_OK;
}

static dsk_status tp_block_backward_post(tp_state *ps, int l, int slot) {
    tm_model *m = ps->m;
    tm_block *b = &m->blocks[l];
    dsk_ctx *ctx = ps->ctx;
    const tm_config *c = &m->cfg;
    tp_acts s = tp_slot(ps, l, slot);
    int rc = ps->layers[l].rc;
    TM_T(TM_PH_NORM, dsk_rmsnorm_backward(ctx, &ps->dx, tm_grad(b->ln2), &ps->dh, &s.x2, &b->ln2->wc, &s.rstd2));
    if (rc == TMLA_RECOMPUTE_ATTN) TM_TRY(tp_core(ps, l, slot, &s)); /* the core's shared output again */
    if (rc == TMLA_RECOMPUTE_ATTN && s.f8_att.q.data) TM_T(TM_PH_LINEAR, tf8_keep(ctx, &s.f8_att, &s.att)); /* MHA */
    if (tmla_is_mla(&c->mla)) TM_TRY(tp_mla_backward(ps, l, slot, &s));
    else TM_TRY(tp_mha_backward(ps, l, &s));
    TM_T(TM_PH_NORM, dsk_rmsnorm_backward(ctx, &ps->dx, tm_grad(b->ln1), &ps->dh, &s.x, &b->ln1->wc, &s.rstd1));
    return DSK_OK;
}

static dsk_status tp_block_backward(tp_state *ps, int l, int slot, int micro) {
    TM_TRY(tp_block_backward_pre(ps, l, slot, micro));
    if (ps->m->blocks[l].is_moe) {
        TM_TRY(tp_block_backward_moe(ps, l, slot, 0));
        TM_TRY(tp_block_backward_moe(ps, l, slot, 1));
    }
    return tp_block_backward_post(ps, l, slot);
}

/* ------------------------------------------------------------------ MTP */

/* The MTP modules (--mtp D, train_mla.h's math) run on the last stage inside the head's unit
   and part, on the rank's Ns rows like a block: module k takes the previous depth's hidden
   state (the main model's last block output for k = 1) and the embedding of the tokens k
   ahead, its projection and norms replicated, its block laid out as the main ones, the shared
   head column-parallel with the vocabulary-parallel cross-entropy of weight lambda / D. The
   embedding of the shifted tokens: with the first stage on this rank, looked up in the
   embedding's unit and its gradient added there; else from the last stage's copy of the
   embedding (Megatron's "embedding group": the same initial numbers and box, its gradient
   summed with the first stage's over TP_G_EMBED, so the two stay equal). */

/* Module k's inputs of micro-batch `micro`: the shifted tokens and targets (the whole batch's
   rows are filled by tp_train_batch), the embeddings and their gradients. */
static dsk_tensor tp_mtp_rows(tp_state *ps, const dsk_tensor *t, int micro) {
    return tp_part(t, micro, t->dtype == DSK_I32 ? ps->Nm : ps->Ns);
}

/* The embeddings of every module's tokens of micro-batch `micro` (the embedding's unit open). */
static dsk_status tp_mtp_embed(tp_state *ps, int micro) {
    tm_model *m = ps->m;
    for (int k = 0; k < m->cfg.mla.mtp_depth; k++) {
        tmla_mtp *t = &m->mla.mtp[k];
        dsk_tensor ids = tp_mtp_rows(ps, &t->ids, micro), emb = tp_mtp_rows(ps, &t->emb, micro);
        TM_T(TM_PH_EMBED,
             dsk_par_embedding_forward(&ps->grid.tp, ps->ctx, &emb, tp_sp(ps, &ps->big), &m->embed->wc, &ids));
    }
    return DSK_OK;
}

/* The embedding's gradient from d(rows) (the rank's Ns rows) at ids (the micro-batch's Nm);
   bf16/f16: the rows gathered in the compute dtype, accumulated from an f32 copy. */
static dsk_status tp_embed_backward(tp_state *ps, const dsk_tensor *dx, const dsk_tensor *ids) {
    tm_model *m = ps->m;
    if (!ps->dx32.data) {
        TM_T(TM_PH_EMBED,
             dsk_par_embedding_backward(&ps->grid.tp, ps->ctx, &m->embed->g, dx, tp_sp(ps, &ps->big), ids));
        return DSK_OK;
    }
    const dsk_tensor *full = dx;
    if (ps->tp > 1) {
        TM_T(TM_PH_MOVE, dsk_par_map_forward(&ps->grid.tp, ps->ctx, DSK_PAR_MAP_GATHER, 0, &ps->big, dx));
        full = &ps->big;
    }
    TM_T(TM_PH_MOVE, dsk_tensor_copy(ps->ctx, &ps->dx32, full));
    TM_T(TM_PH_EMBED, dsk_par_embedding_backward(&ps->grid.tp, ps->ctx, &m->embed->g, &ps->dx32, NULL, ids));
    return DSK_OK;
}

/* Every module's d(embedding) of micro-batch `micro` into the embedding's gradient, depth D first. */
static dsk_status tp_mtp_embed_backward(tp_state *ps, int micro) {
    tm_model *m = ps->m;
    for (int k = m->cfg.mla.mtp_depth - 1; k >= 0; k--) {
        tmla_mtp *t = &m->mla.mtp[k];
        dsk_tensor ids = tp_mtp_rows(ps, &t->ids, micro), demb = tp_mtp_rows(ps, &t->demb, micro);
        TM_TRY(tp_embed_backward(ps, &demb, &ids));
    }
    return DSK_OK;
}

/* The modules' forward and losses on micro-batch `micro` (after the main head's). */
static dsk_status tp_mtp_forward(tp_state *ps, int micro) {
    tm_model *m = ps->m;
    const tm_config *c = &m->cfg;
    dsk_ctx *ctx = ps->ctx;
    for (int k = 1; k <= c->mla.mtp_depth; k++) {
        tmla_mtp *t = &m->mla.mtp[k - 1];
        int l = c->n_layers + k - 1;
        const dsk_tensor *prev = k == 1 ? &ps->xf : &m->mla.mtp[k - 2].y;
        dsk_tensor emb = tp_mtp_rows(ps, &t->emb, micro), x = tp_slot(ps, l, 0).x;
        TM_T(TM_PH_NORM, dsk_rmsnorm(ctx, &t->hn, &t->rstd_h, prev, &t->hnorm->wc, c->norm_eps));
        TM_T(TM_PH_NORM, dsk_rmsnorm(ctx, &t->en, &t->rstd_e, &emb, &t->enorm->wc, c->norm_eps));
        TM_TRY(tmla_mtp_proj_forward(m, t, &x, &t->hn, &t->en));
        TM_TRY(tp_block_forward(ps, l, 0, micro, &t->y));
        dsk_tensor *Y[1] = {&t->logits}, tg = tp_mtp_rows(ps, &t->tgt, micro);
        const dsk_tensor *W[1] = {&m->lm_head->wc};
        TM_T(TM_PH_NORM, dsk_rmsnorm(ctx, &t->hf, &t->rstdf, &t->y, &t->norm->wc, c->norm_eps));
        TM_T(TM_PH_HEAD, dsk_par_column_forward(&ps->grid.tp, ctx, 1, Y, W, &t->hf, tp_sp(ps, &ps->mtp_hfg[k - 1])));
        TM_T(TM_PH_HEAD, dsk_par_cross_entropy(&ps->grid.tp, ctx, &t->loss, &t->dlogits, &t->logits, &tg, -1,
                                               ps->gscale * tmla_mtp_weight(c, k)));
    }
    return DSK_OK;
}

/* The modules' backward of micro-batch `micro`, depth D first: their gradients and the shared
   head's added, d(embedding) of each in its demb rows, d(main model's last hidden) in dcarry. */
static dsk_status tp_mtp_backward(tp_state *ps, int micro) {
    tm_model *m = ps->m;
    const tm_config *c = &m->cfg;
    dsk_ctx *ctx = ps->ctx;
    tmla_model *s = &m->mla;
    for (int k = c->mla.mtp_depth; k >= 1; k--) {
        tmla_mtp *t = &s->mtp[k - 1];
        int l = c->n_layers + k - 1;
        const dsk_tensor *prev = k == 1 ? &ps->xf : &s->mtp[k - 2].y;
        dsk_tensor hfx = ps->tp > 1 ? ps->mtp_hfg[k - 1] : t->hf, emb = tp_mtp_rows(ps, &t->emb, micro);
        dsk_tensor demb = tp_mtp_rows(ps, &t->demb, micro);
        dsk_tensor *dW[1] = {&m->lm_head->g};
        const dsk_tensor *dY[1] = {&t->dlogits}, *W[1] = {&m->lm_head->wc};
        TM_T(TM_PH_HEAD, dsk_par_column_backward(&ps->grid.tp, ctx, 1, &ps->dh, tp_sp(ps, &ps->big), dW, dY, W, &hfx));
        TM_T(TM_PH_MOVE,
             k == c->mla.mtp_depth ? dsk_tensor_fill(ctx, &ps->dx, 0.0) : dsk_tensor_copy(ctx, &ps->dx, &s->dcarry));
        TM_T(TM_PH_NORM, dsk_rmsnorm_backward(ctx, &ps->dx, tm_grad(t->norm), &ps->dh, &t->y, &t->norm->wc, &t->rstdf));
        TM_TRY(tp_block_backward(ps, l, 0, micro)); /* dx = d(block input) */
        TM_TRY(tmla_mtp_proj_backward(m, t, &ps->dx, &ps->dh, &ps->tmp)); /* d(hn), d(en) */
        TM_T(TM_PH_MOVE, dsk_tensor_fill(ctx, &demb, 0.0));
        TM_T(TM_PH_NORM,
             dsk_rmsnorm_backward(ctx, &demb, tm_grad(t->enorm), &ps->tmp, &emb, &t->enorm->wc, &t->rstd_e));
        TM_T(TM_PH_MOVE, dsk_tensor_fill(ctx, &s->dcarry, 0.0));
        TM_T(TM_PH_NORM,
             dsk_rmsnorm_backward(ctx, &s->dcarry, tm_grad(t->hnorm), &ps->dh, prev, &t->hnorm->wc, &t->rstd_h));
    }
    return DSK_OK;
}

/* ------------------------------------------------------------------ stages */

/* Every gradient of unit `unit` is final for this micro-batch: the engine may reduce it. */
static dsk_status tp_unit_ready(tp_state *ps, int unit) {
    for (int i = 0; i < ps->m->n_params; i++)
        if (ps->m->params[i].unit == unit) TM_TRY(tm_ready(ps->m, &ps->m->params[i]));
    return DSK_OK;
}

/* Opens the engine's pass of part `chunk` for micro-batch `micro` unless it is open. The head
   (final norm and LM head) is part v of its own: it runs its backward inside the last chunk's
   forward, and the schedules may run the next micro-batch's forward of that chunk before the
   chunk's backward (interleaved). */
static dsk_status tp_pass(tp_state *ps, int chunk, int micro) {
    if (ps->pass_micro[chunk] == micro) return DSK_OK;
    ps->pass_micro[chunk] = micro;
    return ps->pass_begin ? ps->pass_begin(ps->pass_user, chunk, ps->sync_last && micro == ps->M - 1) : DSK_OK;
}


/* The last global stage's head on ps->xf: loss (added to loss_sum); in training also its
   backward, leaving d(xf) in the chunk's out_grad of this micro-batch. */
static dsk_status tp_head(tp_state *ps, int micro) {
    tm_model *m = ps->m;
    dsk_ctx *ctx = ps->ctx;
    dsk_comm *tp = &ps->grid.tp;
    dsk_tensor tg = tp_part(&m->targets, micro, ps->Nm), hfx = ps->tp > 1 ? ps->hfg : ps->hf;
    dsk_tensor *Y[1] = {&ps->logits};
    const dsk_tensor *W[1] = {&m->lm_head->wc};
    int unit = m->cfg.n_layers + 1, mtp = ps->train && m->cfg.mla.mtp_depth > 0;
    float loss;
    if (mtp && ps->first < 0) { /* the MTP modules' embeddings from the last stage's copy (its own unit 0) */
        TM_TRY(tm_unit(m, 0, TM_FWD_BEGIN));
        TM_TRY(tp_mtp_embed(ps, micro));
        TM_TRY(tm_unit(m, 0, TM_FWD_END));
    }
    TM_TRY(tm_unit(m, unit, TM_FWD_BEGIN));
    TM_T(TM_PH_NORM, dsk_rmsnorm(ctx, &ps->hf, &ps->rstdf, &ps->xf, &m->ln_f->wc, m->cfg.norm_eps));
    TM_T(TM_PH_HEAD, dsk_par_column_forward(tp, ctx, 1, Y, W, &ps->hf, tp_sp(ps, &ps->hfg)));
    TM_T(TM_PH_HEAD,
         dsk_par_cross_entropy(tp, ctx, &m->loss, ps->train ? &ps->dlogits : NULL, &ps->logits, &tg, -1, ps->gscale));
    dsk_tensor hl;
    TM_TRY(dsk_tensor_wrap(&hl, &loss, DSK_F32, dsk_cpu(), 0, NULL));
    TM_TRY(dsk_tensor_copy(ctx, &hl, &m->loss));
    ps->loss_sum += loss;
    if (!ps->train) return tm_unit(m, unit, TM_FWD_END);
    if (mtp) TM_TRY(tp_mtp_forward(ps, micro));
    TM_TRY(tp_pass(ps, ps->v, micro)); /* the unit stays gathered from its forward to its backward */
    TM_TRY(tm_unit(m, unit, TM_BWD_BEGIN));
    if (mtp) TM_TRY(tp_mtp_backward(ps, micro)); /* first, as one rank: the head's gradient is final after */
    dsk_tensor *dW[1] = {&m->lm_head->g};
    const dsk_tensor *dY[1] = {&ps->dlogits};
    TM_T(TM_PH_HEAD, dsk_par_column_backward(tp, ctx, 1, &ps->dh, tp_sp(ps, &ps->big), dW, dY, W, &hfx));
    dsk_tensor og = tp_part(&ps->chunks[ps->last].out_grad, micro, ps->Ns);
    TM_T(TM_PH_MOVE, mtp ? dsk_tensor_copy(ctx, &og, &m->mla.dcarry) : dsk_tensor_fill(ctx, &og, 0.0));
    TM_T(TM_PH_NORM, dsk_rmsnorm_backward(ctx, &og, tm_grad(m->ln_f), &ps->dh, &ps->xf, &m->ln_f->wc, &ps->rstdf));
    TM_TRY(tp_unit_ready(ps, unit));
    TM_TRY(tm_unit(m, unit, TM_BWD_END));
    if (!mtp || ps->first >= 0) return DSK_OK; /* with the first stage here: in its embedding's backward */
    TM_TRY(tm_unit(m, 0, TM_BWD_BEGIN));
    TM_TRY(tp_mtp_embed_backward(ps, micro));
    TM_TRY(tp_unit_ready(ps, 0));
    return tm_unit(m, 0, TM_BWD_END);
}

/* ------------------------------------------------------------------ streams

   A micro-batch's forward or backward through a chunk is a stream of steps: compute up to a
   MoE layer's exchange, the exchange's begin, ..., its end, compute up to the next, ... A forward
   or backward alone runs them in order (tp_stream_run), each MoE call begun and ended. A paired
   schedule's forward-backward (dsk_par_schedule_init_paired) interleaves two streams so that
   one's rows travel while the other computes (tp_pair_run), with one exchange in flight at a
   time, so that the expert group's messages keep one order: a stream computes up to where it
   starts an exchange (an MoE layer's begin, or the return of its experts' results once they
   are computed: dsk_moe_experts, dsk_moe_return_begin), the other's exchange is joined
   (dsk_moe_wait), its own starts, and the other computes. Both directions of every exchange
   travel beside the other stream's compute: its attention and dense layers, or its experts.
   Between their steps the two share only what a step finishes with, except the running
   gradient ps->dx / ps->dh, which the forward's head (its backward, the MTP modules) uses too:
   the forward runs the head on its own pair (fdx, fdh). */

/* Where a stream is in block l: before its first part; before its MoE layer's begin; the call
   begun (rows travelling); its experts computed; their results travelling back; the MoE call
   ended (or no MoE layer), before the block's rest. */
enum { TP_AT_START = 0, TP_AT_PRE, TP_AT_MOE, TP_AT_SENT, TP_AT_COMPUTED, TP_AT_RETURNING, TP_AT_POST, TP_AT_DONE };

static tp_stream tp_stream_of(const tp_state *ps, int bwd, int micro, int chunk) {
    tp_stream st;
    st.bwd = bwd;
    st.micro = micro;
    st.chunk = chunk;
    st.slot = ps->train ? micro % ps->S : 0;
    st.l = bwd ? ps->chunks[chunk].hi - 1 : ps->chunks[chunk].lo;
    st.at = TP_AT_START;
    st.paired = 0;
    return st;
}

/* Whether st runs its MoE calls in steps: paired, and not a recorded or replayed forward (whole in its begin). */
static int tp_stepwise(const tp_state *ps, const tp_stream *st) { return st->paired && (st->bwd || !tp_moe_whole(ps)); }

/* The forward's output of layer l: the next layer's input, the head's, or the chunk's. */
static dsk_tensor tp_stream_out(tp_state *ps, const tp_stream *st) {
    const tp_chunk *ch = &ps->chunks[st->chunk];
    if (st->l + 1 < ch->hi) return tp_slot(ps, st->l + 1, st->slot).x;
    return st->chunk == ps->last ? ps->xf : tp_part(&ch->out_act, st->micro, ps->Ns);
}

/* This rank's chunk holding the stage before (dir -1) or after (+1) chunk c's when that stage is here too
   (DualPipeV's turn on the last pipeline rank: no message, the other chunk's buffer), else -1. */
static int tp_local_neighbour(const tp_state *ps, int c, int dir) {
    int s = ps->chunks[c].stage + dir;
    if (s < 0 || s >= ps->pp * ps->v || dsk_par_stage_rank(ps->kind, ps->pp, s) != ps->grid.at.pp) return -1;
    return s / ps->pp;
}

/* The forward's input of the chunk: the embedding (its unit), the received activation, or the previous stage's
   output on this rank. */
static dsk_status tp_forward_start(tp_state *ps, const tp_stream *st) {
    tm_model *m = ps->m;
    const tp_chunk *ch = &ps->chunks[st->chunk];
    dsk_tensor x0 = tp_slot(ps, ch->lo, st->slot).x;
    if (ch->stage == 0) {
        dsk_tensor ids = tp_part(&m->ids, st->micro, ps->Nm);
        TM_TRY(tm_unit(m, 0, TM_FWD_BEGIN));
        TM_T(TM_PH_EMBED,
             dsk_par_embedding_forward(&ps->grid.tp, ps->ctx, &x0, tp_sp(ps, &ps->big), &m->embed->wc, &ids));
        if (ps->train && m->cfg.mla.mtp_depth > 0 && ps->last >= 0) TM_TRY(tp_mtp_embed(ps, st->micro)); /* MTP's */
        return tm_unit(m, 0, TM_FWD_END);
    }
    int from = tp_local_neighbour(ps, st->chunk, -1);
    dsk_tensor in = tp_part(from >= 0 ? &ps->chunks[from].out_act : &ch->in_act, st->micro, ps->Ns);
    TM_T(TM_PH_MOVE, dsk_tensor_copy(ps->ctx, &x0, &in));
    return DSK_OK;
}

/* The backward's start: the engine's pass and d(chunk output), received or the next stage's on this rank. */
static dsk_status tp_backward_start(tp_state *ps, const tp_stream *st) {
    tm_model *m = ps->m;
    int from = tp_local_neighbour(ps, st->chunk, 1);
    dsk_tensor og = tp_part(from >= 0 ? &ps->chunks[from].in_grad : &ps->chunks[st->chunk].out_grad, st->micro, ps->Ns);
    TM_TRY(tp_pass(ps, st->chunk, st->micro));
    TM_T(TM_PH_MOVE, dsk_tensor_copy(ps->ctx, &ps->dx, &og));
    return DSK_OK;
}

/* The backward's end: the embedding's gradient (its unit), or d(chunk input) to send. */
static dsk_status tp_backward_finish(tp_state *ps, const tp_stream *st) {
    tm_model *m = ps->m;
    if (ps->chunks[st->chunk].stage == 0) {
        dsk_tensor ids = tp_part(&m->ids, st->micro, ps->Nm);
        TM_TRY(tm_unit(m, 0, TM_BWD_BEGIN));
        if (m->cfg.mla.mtp_depth > 0 && ps->last >= 0) TM_TRY(tp_mtp_embed_backward(ps, st->micro)); /* MTP's */
        TM_TRY(tp_embed_backward(ps, &ps->dx, &ids));
        TM_TRY(tp_unit_ready(ps, 0));
        return tm_unit(m, 0, TM_BWD_END);
    }
    dsk_tensor ig = tp_part(&ps->chunks[st->chunk].in_grad, st->micro, ps->Ns);
    TM_T(TM_PH_MOVE, dsk_tensor_copy(ps->ctx, &ig, &ps->dx));
    return DSK_OK;
}

static void tp_swap(dsk_tensor *a, dsk_tensor *b) {
    dsk_tensor t = *a;
    *a = *b;
    *b = t;
}

enum { TP_MOE_BEGIN, TP_MOE_EXPERTS, TP_MOE_RETURN, TP_MOE_END };

/* Layer st->l's MoE call: its begin, a step between (TP_MOE_EXPERTS, TP_MOE_RETURN) or its end. */
static dsk_status tp_stream_moe(tp_state *ps, tp_stream *st, int step) {
    tm_model *m = ps->m;
    dsk_moe *moe = &m->blocks[st->l].moe;
    dsk_tensor y;
    if (step == TP_MOE_EXPERTS) TM_T(TM_PH_MOE, dsk_moe_experts(moe, ps->ctx));
    if (step == TP_MOE_RETURN) TM_T(TM_PH_MOE, dsk_moe_return_begin(moe, ps->ctx));
    if (step == TP_MOE_EXPERTS || step == TP_MOE_RETURN) return DSK_OK;
    if (st->bwd) return tp_block_backward_moe(ps, st->l, st->slot, step == TP_MOE_END);
    y = tp_stream_out(ps, st);
    return tp_block_forward_moe(ps, st->l, st->slot, st->micro, &y, step == TP_MOE_END);
}

/* Ends st's MoE call (what its steps left). */
static dsk_status tp_stream_end(tp_state *ps, tp_stream *st) {
    TM_TRY(tp_stream_moe(ps, st, TP_MOE_END));
    if (ps->pend == st) ps->pend = NULL;
    st->at = TP_AT_POST;
    return DSK_OK;
}

/* Joins the exchange in flight, if one is; its stream's call stays begun where it was. */
static dsk_status tp_quiet(tp_state *ps) {
    tm_model *m = ps->m;
    tp_stream *p = ps->pend;
    ps->pend = NULL;
    if (p && !tp_stepwise(ps, p)) return tp_stream_end(ps, p);
    if (p) TM_T(TM_PH_MOE, dsk_moe_wait(&m->blocks[p->l].moe, ps->ctx));
    return DSK_OK;
}

/* A layer holds one call begun: the other stream's there ends before st's begins (a pair of one
   chunk's forward and backward cross in its middle layer). */
static dsk_status tp_settle(tp_state *ps, const tp_stream *st) {
    for (int i = 0; i < 2; i++) {
        tp_stream *o = &ps->streams[i];
        if (o != st && o->l == st->l && o->at >= TP_AT_SENT && o->at <= TP_AT_RETURNING) TM_TRY(tp_stream_end(ps, o));
    }
    return DSK_OK;
}

/* The forward's end: the head on the last stage (its MTP modules exchange rows themselves, so
   the exchange in flight is joined first), on the forward's own running-gradient pair when paired. */
static dsk_status tp_forward_finish(tp_state *ps, const tp_stream *st) {
    dsk_status s;
    if (st->chunk != ps->last) return DSK_OK;
    if (ps->m->cfg.mla.mtp_depth > 0) TM_TRY(tp_quiet(ps));
    if (!ps->fdx.data) return tp_head(ps, st->micro);
    tp_swap(&ps->dx, &ps->fdx);
    tp_swap(&ps->dh, &ps->fdh);
    s = tp_head(ps, st->micro);
    tp_swap(&ps->dx, &ps->fdx);
    tp_swap(&ps->dh, &ps->fdh);
    return s;
}

/* Whether block l's backward opens its unit (tm_unit) at its MoE layer's begin rather than
   before its first part: an MoE block that recomputes nothing has no work before the exchange,
   and the unit's hooks may rebind the layer (ZeRO-2), which the other micro-batch of a pair may
   still be running a forward through. */
static int tp_unit_at_begin(const tp_state *ps, int l) {
    return ps->m->blocks[l].is_moe && ps->layers[l].rc != TMLA_RECOMPUTE_FULL;
}

/* A block's part before its MoE layer; TP_AT_MOE, or TP_AT_POST without one. */
static dsk_status tp_stream_pre(tp_state *ps, tp_stream *st) {
    int l = st->l;
    if (!st->bwd || !tp_unit_at_begin(ps, l)) TM_TRY(tm_unit(ps->m, l + 1, st->bwd ? TM_BWD_BEGIN : TM_FWD_BEGIN));
    if (st->bwd) {
        TM_TRY(tp_block_backward_pre(ps, l, st->slot, st->micro));
    } else {
        dsk_tensor y = tp_stream_out(ps, st);
        TM_TRY(tp_block_forward_pre(ps, l, st->slot, &y));
    }
    st->at = ps->m->blocks[l].is_moe ? TP_AT_MOE : TP_AT_POST;
    return DSK_OK;
}

/* A block's part after its MoE layer, its unit closed; on to the next block. */
static dsk_status tp_stream_post(tp_state *ps, tp_stream *st) {
    int l = st->l;
    if (st->bwd) {
        TM_TRY(tp_block_backward_post(ps, l, st->slot));
        TM_TRY(tp_unit_ready(ps, l + 1));
        TM_TRY(tm_unit(ps->m, l + 1, TM_BWD_END));
    } else {
        dsk_tensor y = tp_stream_out(ps, st);
        TM_TRY(tp_block_forward_post(ps, l, st->slot, st->micro, &y));
        TM_TRY(tm_unit(ps->m, l + 1, TM_FWD_END));
    }
    st->l += st->bwd ? -1 : 1;
    st->at = TP_AT_PRE;
    return DSK_OK;
}

/* Runs st's compute up to where it starts an exchange (*more = 1: tp_stream_start) or to its end
   (*more = 0). A block's unit (tm_unit) opens before its first part (tp_unit_at_begin) and
   closes after its last. */
static dsk_status tp_stream_compute(tp_state *ps, tp_stream *st, int *more) {
    const tp_chunk *ch = &ps->chunks[st->chunk];
    *more = 0;
    if (st->at == TP_AT_START) {
        TM_TRY(st->bwd ? tp_backward_start(ps, st) : tp_forward_start(ps, st));
        st->at = TP_AT_PRE;
    }
    while (st->at != TP_AT_DONE) {
        int step = tp_stepwise(ps, st);
        if (st->at == TP_AT_MOE || (st->at == TP_AT_COMPUTED && step)) {
            *more = 1;
            break;
        }
        if (st->at == TP_AT_SENT && step) {
            TM_TRY(tp_stream_moe(ps, st, TP_MOE_EXPERTS));
            st->at = TP_AT_COMPUTED;
        } else if (st->at >= TP_AT_SENT && st->at <= TP_AT_RETURNING) {
            TM_TRY(tp_stream_end(ps, st));
        } else if (st->at == TP_AT_POST) {
            TM_TRY(tp_stream_post(ps, st));
        } else if (st->bwd ? st->l < ch->lo : st->l >= ch->hi) {
            TM_TRY(st->bwd ? tp_backward_finish(ps, st) : tp_forward_finish(ps, st));
            st->at = TP_AT_DONE;
        } else {
            TM_TRY(tp_stream_pre(ps, st));
        }
    }
    return DSK_OK;
}

/* Starts st's next exchange, its MoE layer's begin or its experts' return; st pending (ps->pend). */
static dsk_status tp_stream_start(tp_state *ps, tp_stream *st) {
    if (st->at == TP_AT_COMPUTED) {
        TM_TRY(tp_stream_moe(ps, st, TP_MOE_RETURN));
        st->at = TP_AT_RETURNING;
    } else {
        TM_TRY(tp_settle(ps, st));
        if (st->bwd && tp_unit_at_begin(ps, st->l)) TM_TRY(tm_unit(ps->m, st->l + 1, TM_BWD_BEGIN));
        TM_TRY(tp_stream_moe(ps, st, TP_MOE_BEGIN));
        st->at = TP_AT_SENT;
    }
    ps->pend = st;
    return DSK_OK;
}

/* One stream alone, in order (each MoE call begun and ended). */
static dsk_status tp_stream_run(tp_state *ps, tp_stream *st) {
    int more;
    st->paired = 0;
    for (;;) {
        TM_TRY(tp_stream_compute(ps, st, &more));
        if (!more) return DSK_OK;
        TM_TRY(tp_stream_start(ps, st));
        ps->pend = NULL; /* its own next step ends it */
    }
}

/* Two streams interleaved: a computes up to where it starts an exchange, b's in flight is
   joined, a's starts, then b computes, and so on. When one stream is done the other runs
   alone. Each stream's steps keep their order, so its bits are its own. */
static dsk_status tp_pair_run(tp_state *ps, tp_stream *a, tp_stream *b) {
    tp_stream *cur = a, *other = b;
    int more;
    for (;;) {
        TM_TRY(tp_stream_compute(ps, cur, &more));
        ps->paired_exchanges += ps->pend != NULL;
        TM_TRY(tp_quiet(ps));
        if (!more) return tp_stream_run(ps, other);
        TM_TRY(tp_stream_start(ps, cur));
        cur = other;
        other = ps->pend;
    }
}

static dsk_status tp_forward_chunk(void *user, int micro, int chunk) {
    tp_state *ps = (tp_state *)user;
    ps->streams[0] = tp_stream_of(ps, 0, micro, chunk);
    return tp_stream_run(ps, &ps->streams[0]);
}

static dsk_status tp_backward_chunk(void *user, int micro, int chunk) {
    tp_state *ps = (tp_state *)user;
    ps->streams[0] = tp_stream_of(ps, 1, micro, chunk);
    return tp_stream_run(ps, &ps->streams[0]);
}

/* A paired schedule's forward of (micro, chunk) with the backward of (bwd_micro, bwd_chunk),
   interleaved; the backward leads (its first exchange travels while the forward starts). */
static dsk_status tp_forward_backward(void *user, int micro, int chunk, int bwd_micro, int bwd_chunk) {
    tp_state *ps = (tp_state *)user;
    dsk_status s;
    ps->streams[0] = tp_stream_of(ps, 1, bwd_micro, bwd_chunk);
    ps->streams[1] = tp_stream_of(ps, 0, micro, chunk);
    ps->streams[0].paired = ps->streams[1].paired = 1;
    s = tp_pair_run(ps, &ps->streams[0], &ps->streams[1]);
    ps->pend = NULL; /* an error with an exchange in flight: the layer's free joins it */
    return s;
}

static dsk_status tp_buffer(void *user, const dsk_par_action *a, dsk_tensor *t) {
    tp_state *ps = (tp_state *)user;
    tp_chunk *ch = &ps->chunks[a->chunk];
    const dsk_tensor *src = a->kind == DSK_PAR_SEND_ACT    ? &ch->out_act
                            : a->kind == DSK_PAR_RECV_ACT  ? &ch->in_act
                            : a->kind == DSK_PAR_SEND_GRAD ? &ch->in_grad
                                                           : &ch->out_grad;
    *t = tp_part(src, a->micro, ps->Ns);
    return DSK_OK;
}

/* Forward and backward of the M micro-batches in the model's ids/targets by the schedule; loss
   gradients scaled by gscale each. *loss: the mean micro-batch loss on the last stage, else 0. */
static dsk_status tp_train_batch(tp_state *ps, float gscale, double *loss) {
    dsk_par_stage_fns f = {ps, tp_forward_chunk, tp_backward_chunk, tp_buffer, tp_forward_backward};
    ps->train = 1;
    ps->gscale = gscale;
    ps->loss_sum = 0;
    for (int l = 0; l < tm_n_blocks(&ps->m->cfg); l++) ps->layers[l].moe_micro = -1;
    for (int c = 0; c <= ps->v; c++) ps->pass_micro[c] = -1;
    for (int k = 1; ps->last >= 0 && k <= ps->m->cfg.mla.mtp_depth; k++) /* the MTP modules' tokens and targets */
        TM_TRY(tmla_mtp_inputs(ps->m, k, ps->m->cfg.batch));
    TM_TRY(dsk_par_pipeline_run(&ps->sched, &ps->grid.pp, ps->ctx, &f));
    *loss = ps->last >= 0 ? ps->loss_sum / ps->M : 0.0;
    return DSK_OK;
}

/* Forward only (validation, sampling): the first n micro-batches through the stages in order,
   micro-batch by micro-batch and chunk by chunk (each rank's list is a projection of one global
   order, so blocking sends cannot deadlock; DualPipeV's chunk 1 runs back up the ranks). *loss: their
   mean loss on the last stage, else 0; the last stage keeps the last micro-batch's logits (ps->logits,
   this rank's vocabulary). */
static dsk_status tp_eval_batch(tp_state *ps, int n, double *loss) {
    dsk_comm *pp = &ps->grid.pp;
    int r = ps->grid.at.pp, P = ps->pp * ps->v;
    ps->train = 0;
    ps->loss_sum = 0;
    for (int mi = 0; mi < n; mi++)
        for (int c = 0; c < ps->v; c++) {
            tp_chunk *ch = &ps->chunks[c];
            dsk_tensor in = tp_part(&ch->in_act, mi, ps->Ns), out = tp_part(&ch->out_act, mi, ps->Ns);
            int prev = ch->stage > 0 ? dsk_par_stage_rank(ps->kind, ps->pp, ch->stage - 1) : r;
            int next = ch->stage < P - 1 ? dsk_par_stage_rank(ps->kind, ps->pp, ch->stage + 1) : r;
            if (prev != r) TM_TRY(dsk_comm_recv(pp, ps->ctx, in.data, dsk_tensor_numel(&in), in.dtype, prev));
            TM_TRY(tp_forward_chunk(ps, mi, c));
            if (next != r) TM_TRY(dsk_comm_send(pp, ps->ctx, out.data, dsk_tensor_numel(&out), out.dtype, next));
        }
    *loss = ps->last >= 0 ? ps->loss_sum / n : 0.0;
    return DSK_OK;
}

/* Row `row` of the last forward's logits over the whole vocabulary into out (V floats, host):
   the tensor-parallel ranks' columns gathered in rank order. Last stage only (collective over tp). */
static dsk_status tp_logits_row(tp_state *ps, int64_t row, float *out) {
    dsk_tensor lrow, hrow;
    int64_t V = ps->Vl * ps->tp;
    TM_TRY(dsk_tensor_select(&ps->logits, row, &lrow));
    TM_TRY(dsk_tensor_wrap(&hrow, out, DSK_F32, dsk_cpu(), 1, &V));
    if (ps->tp == 1) return dsk_tensor_copy(ps->ctx, &hrow, &lrow);
    TM_TRY(dsk_comm_all_gather(&ps->grid.tp, ps->ctx, lrow.data, ps->vrow.data, ps->Vl, lrow.dtype));
    return dsk_tensor_copy(ps->ctx, &hrow, &ps->vrow);
}

/* ------------------------------------------------------------------ tensor-parallel traffic */

/* What the tensor-parallel collectives of a step hand over, as the tp group's dsk_comm_stats
   count it: bytes of whole messages by kind (TP_AR all-reduce, TP_AG all-gather, TP_RS
   reduce-scatter; dsk_par's gathers and scatters along rows are one call each) and calls. The
   trainer logs a step's (tp_traffic_since); the planner computes it without running one
   (train_plan.h's tpl_tp_traffic) from the same tensors the call sites above pass, walked in
   their order: a call site added or changed above without its twin there fails
   tests/test_plan.sh. */
enum { TP_AR = 0, TP_AG, TP_RS, TP_CALLS, TP_TRAFFIC };

static void tp_traffic_since(const tp_state *ps, const dsk_comm_stats *before, double tr[TP_TRAFFIC]) {
    const dsk_comm_stats *now = &ps->grid.tp.stats;
    tr[TP_AR] = (double)(now->all_reduce_payload - before->all_reduce_payload);
    tr[TP_AG] = (double)(now->all_gather_payload - before->all_gather_payload);
    tr[TP_RS] = (double)(now->reduce_scatter_payload - before->reduce_scatter_payload);
    tr[TP_CALLS] = (double)(now->calls - before->calls);
}

/* ------------------------------------------------------------------ loss */

/* This rank's part of the world's mean of a value the last stage's ranks hold (one per
   data-parallel replica; the others give 0): sum it over the world. */
static float tp_loss_part(const tp_state *ps, double v) {
    return ps->last >= 0 && ps->grid.at.tp == 0 ? (float)(v / ps->dp) : 0.0f;
}

/* Seconds in this layout's collectives and transfers. */
static double tp_comm_seconds(const tp_state *ps) {
    if (!ps->on) return 0;
    return ps->grid.tp.stats.seconds + ps->grid.pp.stats.seconds + ps->grid.dp.stats.seconds + ps->stage.stats.seconds +
           ps->xrep.stats.seconds;
}

/* ------------------------------------------------------------------ checkpoints */

/* Is this rank the one that writes its stage's expert biases (replicated over tp and dp)? */
static int tp_bias_writer(const tp_state *ps) { return ps->grid.at.tp == 0 && ps->grid.at.dp == 0; }
