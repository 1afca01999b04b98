/* train_plan.h - one rank's memory under a layout of examples/train_moe.c's model, from the
   trainer's own code without allocating it (dsk_plan's memory callback; examples/dsk_plan.c).

   The model is built as a run builds it (tm_init, or tp_model_init for the stages and the
   tensor-parallel shard of rank (tp 0, dp 0, pp `stage`)) with tm_config.plan_bytes set: every
   activation, scratch tensor and buffer goes through tm_alloc_nd, which adds its bytes instead of
   allocating, and the MoE layers' workspace is dsk_moe_reserve_bytes (the sizes dsk_moe_reserve
   allocates). What it allocates for real on the way (each MoE layer's small state, as a run
   does) is read from the allocator and counted too. The training state is tz_plan: the engine's
   own parameter lists and dsk_zero_plan (dsk_zero_init's slabs) at the size of each group. So
   the figures are those the allocator reports at the start of a run of the layout (train_moe's
   "memory bytes" and "activations" lines; tests/test_plan.sh compares them).

   Expert parallelism: dsk_moe_init takes its expert share from the communicator's size and rank;
   the plan hands it a stand-in communicator of ep ranks (rank 0) that nothing calls (the layer
   only reads its size at init). Beyond the start figures a dropless expert-parallel run grows
   its workspace when a rank receives more than T K rows; mem->imbalance is the worst case (every
   token of the expert group routed to this rank), dsk_moe_reserve_bytes at ep T K rows. */
#ifndef TRAIN_PLAN_H
#define TRAIN_PLAN_H

#include "../dsk_plan.h"
#include "train_model.h"
#include "train_par.h"
#include "train_zero.h"

/* The bytes an optimizer step reads and writes per element it updates: the f32 gradient twice (the
   clipping norm, then AdamW), both moments read and written, and the f32 master read and written
   with the compute-dtype weight written (an f32 weight is its own master). */
static int64_t tz_opt_step_bytes(dsk_dtype weight, dsk_dtype moments) {
    int64_t master = weight == DSK_F32 ? 8 : 8 + (int64_t)dsk_dtype_size(weight);
    return 2 * 4 + 4 * (int64_t)dsk_dtype_size(moments) + master;
}

/* What tz_init would allocate (tz_memory's figures) and each object's collectives per pass,
   without memory or communication: the same lists, dsk_zero_plan on each object at the size
   of its group (group_size[g]: the ranks of groups[g]; the shards are the same on every rank).
   plans[k] for k < *n_obj; *opt_step: the bytes the optimizer step moves (tz_opt_step_bytes for
   each element it updates: every one at stage 0, the rank's shard above). m needs only its
   declared parameters (no slabs, no activations). */
static dsk_status tz_plan(tm_model *m, const tz_group *groups, const int *group_size, const tz_place *place,
                          const tz_opts *o, dsk_zero_memory *mem, dsk_zero_plan_out *plans, int *n_obj,
                          int64_t *opt_step, int *obj_ranks) {
    tz t;
    dsk_zero_param *ps;
    int n[TZ_MAX_OBJ] = {0};
    int64_t scratch = 1;
    dsk_status s = tz_tables(&t, m, NULL, o->stage, &ps);
    memset(mem, 0, sizeof *mem);
    *opt_step = 0;
    if (s == DSK_OK) s = tz_lists(&t, place, ps, n, &scratch);
    for (int k = 0; k < t.n_obj && s == DSK_OK; k++) {
        dsk_zero_opts zo = tz_zero_opts(o, &groups[t.obj_group[k]], t.obj_dt[k]);
        obj_ranks[k] = group_size[t.obj_group[k]];
        s = dsk_zero_plan(&ps[k * m->n_params], n[k], obj_ranks[k], 0, &zo, &plans[k]);
        mem->params += plans[k].memory.params;
        mem->grads += plans[k].memory.grads;
        mem->optimizer += plans[k].memory.optimizer;
        mem->comm += plans[k].memory.comm;
        *opt_step += (o->stage == 0 ? plans[k].full_elems : plans[k].shard_elems) *
                     tz_opt_step_bytes(t.obj_dt[k], o->moment_dtype);
    }
    if (o->stage >= 2) mem->grads += scratch * 4; /* tz_memory counts the MoE layers' stand-in gradient */
    *n_obj = t.n_obj;
    free(ps);
    tz_free(&t);
    return s;
}

/* The grid of a layout and rank (tp 0, dp 0, pp stage) of it, set as tp_grid_init would. */
static dsk_status tpl_grid(tp_state *ps, const dsk_plan_layout *l, int stage, int mtp) {
    dsk_par_dims *d = &ps->grid.dims;
    d->tp = l->tp;
    d->pp = l->pp;
    d->ep = l->ep;
    d->dp = 0;
    TM_TRY(dsk_par_dims_resolve(d, l->tp * l->pp * l->dp));
    TM_TRY(dsk_par_coords_of(d, dsk_par_rank_of(d, 0, 0, stage), &ps->grid.at));
    ps->tp = l->tp;
    ps->pp = l->pp;
    ps->dp = l->dp;
    ps->ep = l->ep;
    ps->M = l->micro;
    ps->v = l->vstages;
    ps->kind = l->schedule;
    ps->paired = l->paired;
    ps->embed_group = mtp > 0;
    return DSK_OK;
}

/* The worst case of dropless expert parallelism beyond the reserved workspace: every MoE layer
   on this rank receiving every token of its expert group (ep T K rows). */
static dsk_status tpl_imbalance(const tm_model *m, int64_t T, int ep, int cuda, int64_t *out) {
    *out = 0;
    if (ep < 2) return DSK_OK;
    for (int l = m->cfg.n_dense; l < tm_n_blocks(&m->cfg); l++) {
        const dsk_moe *moe = &m->blocks[l].moe;
        int64_t base, worst;
        dsk_dtype act = cuda ? moe->opts.dtype : DSK_F32;
        if (!m->blocks[l].is_moe) continue;
        TM_TRY(dsk_moe_reserve_bytes(moe, T, -1, act, &base));
        TM_TRY(dsk_moe_reserve_bytes(moe, T, (int64_t)ep * T * moe->opts.top_k, act, &worst));
        *out += worst - base; /* each layer's workspace grows on its own and stays grown */
    }
    return DSK_OK;
}

/* The sizes tpl_rank answers at once: each ZeRO stage with AdamW's moments in f32, then in bf16. */
#define TPL_VARIANTS 8

/* The variant of l (its ZeRO stage and moments) in tpl_rank's arrays. */
static int tpl_variant(const dsk_plan_layout *l) { return (l->moments == DSK_BF16 ? 4 : 0) + l->zero; }

/* The engine's objects for the model built above: their memory and their traffic per step. */
static dsk_status tpl_engine(tm_model *m, tp_state *ps, const dsk_plan_layout *l, const tz_opts *zo, int zero,
                             dsk_dtype moments, dsk_plan_memory *mem, double *reduce, double *gather, double *link) {
    tz_group groups[TZ_MAX_GROUPS];
    int sizes[TZ_MAX_GROUPS] = {0}, n_obj = 0, ranks[TZ_MAX_OBJ] = {0};
    tz_opts o;
    dsk_zero_memory zm;
    dsk_zero_plan_out *plans = (dsk_zero_plan_out *)calloc(TZ_MAX_OBJ, sizeof *plans);
    tz_place *place = (tz_place *)calloc((size_t)m->n_params, sizeof *place);
    dsk_status s = plans && place ? DSK_OK : dsk_set_error(DSK_ERR_OOM, "tpl_engine: out of memory");
    o = *zo;
    o.stage = zero;
    o.moment_dtype = moments;
    if (s == DSK_OK && ps) {
        tp_places(ps, groups, place);
        sizes[TP_G_REPL] = l->tp * l->dp;             /* the stage */
        sizes[TP_G_SHARD] = l->dp;                    /* tensor-parallel shards */
        sizes[TP_G_EMBED] = 2 * l->dp;                /* the first and last stages' copies of the embedding */
        sizes[TP_G_EXPERT] = l->tp * (l->dp / l->ep); /* the stage's ranks holding the same experts */
    } else if (s == DSK_OK) {
        tz_places_dp(m, NULL, NULL, l->dp, groups, place);
        sizes[0] = l->dp;
        sizes[1] = l->dp / l->ep;
    }
    if (s == DSK_OK) s = tz_plan(m, groups, sizes, place, &o, &zm, plans, &n_obj, &mem->optimizer_step, ranks);
    if (s == DSK_OK) {
        /* ZeRO 0-1 reduce once per step, 2-3 every pass; 1-2 gather once, 3 before each unit's forward and backward */
        double passes = zero <= 1 ? 1 : l->micro, gathers = zero == 3 ? 2.0 * l->micro : zero > 0;
        mem->params = zm.params;
        mem->grads = zm.grads;
        mem->optimizer = zm.optimizer;
        mem->comm = zm.comm;
        *reduce = *gather = *link = 0;
        for (int k = 0; k < n_obj;
             k++) { /* on the link: (n - 1) / n of each message of its n ranks, an all-reduce twice */
            double share = (ranks[k] - 1.0) / ranks[k];
            *reduce += passes * (double)plans[k].reduce_bytes;
            *gather += gathers * (double)plans[k].gather_bytes;
            *link += share * ((zero <= 1 ? 2.0 : 1.0) * passes * (double)plans[k].reduce_bytes +
                              gathers * (double)plans[k].gather_bytes);
        }
    }
    free(plans);
    free(place);
    return s;
}

/* The bytes the pipeline's sends of the rank built above hand over per step: its schedule's
   activation and gradient sends (dsk_par_schedule), each the trainer's buffer (tp_buffer). */
static double tpl_send_bytes(tp_state *ps) {
    double n = 0;
    for (int i = 0; ps && ps->pp > 1 && i < ps->sched.n; i++) {
        const dsk_par_action *a = &ps->sched.actions[i];
        dsk_tensor t;
        if (a->kind != DSK_PAR_SEND_ACT && a->kind != DSK_PAR_SEND_GRAD) continue;
        if (tp_buffer(ps, a, &t) == DSK_OK) n += (double)dsk_tensor_nbytes(&t);
    }
    return n;
}

/* Rows one forward of MoE layer `moe` hands to its dispatch (combine: 1) for T tokens, as
   dsk_moe counts them (dsk_moe_stats): exact exchange, every token's K rows (its own experts'
   included; dropless only, else -1) and the combine as many rows as the routing sends back (-1);
   bounded, ep blocks of T min(K, E/ep) rows each way (capacity caps them as the layer does). */
static int64_t tpl_ep_rows(const dsk_moe *moe, int64_t T, int combine) {
    int64_t K = moe->opts.top_k, El = moe->n_local, cp = T * (K < El ? K : El), cap;
    if (moe->opts.ep_exchange != DSK_MOE_EP_BOUNDED) return combine || moe->opts.capacity_factor > 0 ? -1 : T * K;
    if (moe->opts.capacity_factor > 0) {
        cap = (int64_t)ceil((double)(T * K) / moe->opts.n_routed * moe->opts.capacity_factor);
        if (cap * El < cp) cp = cap * El;
    }
    return moe->ep_size * cp;
}

/* The bytes the MoE layers of the rank built above hand to their forwards' dispatch (ep[0]) and
   combine (ep[1]) all-to-alls per step, `calls` forwards of T tokens each (-1: set by the routing). */
static void tpl_ep_bytes(const tm_model *m, const tp_state *ps, int64_t T, int calls, int cuda, double ep[2]) {
    ep[0] = ep[1] = 0;
    for (int l = m->cfg.n_dense; l < tm_n_blocks(&m->cfg); l++) {
        const dsk_moe *moe = &m->blocks[l].moe;
        int64_t D = moe->opts.d_model, es = dsk_dtype_size(cuda ? moe->opts.dtype : DSK_F32);
        if (!m->blocks[l].is_moe || moe->ep_size < 2 || (ps && !ps->layers[l].on)) continue;
        for (int k = 0; k < 2; k++) {
            int64_t rows = tpl_ep_rows(moe, T, k), row = es * D;
            if (k == 0 && moe->opts.ep_dispatch == DSK_MOE_DISPATCH_FP8) row = D + 4 * ((D + 127) / 128);
            ep[k] = rows < 0 || ep[k] < 0 ? -1 : ep[k] + (double)calls * (double)(rows * row);
        }
    }
}

/* One collective of `kind` whose whole message is `bytes`. */
static void tpl_coll(double tr[TP_TRAFFIC], int kind, double bytes) {
    tr[kind] += bytes;
    tr[TP_CALLS] += 1;
}

/* A sequence-parallel gather into, or reduce-scatter out of, the (Nm, ..) tensor t. */
static void tpl_coll_t(double tr[TP_TRAFFIC], int kind, const dsk_tensor *t) {
    tpl_coll(tr, kind, (double)dsk_tensor_nbytes(t));
}

/* dsk_par_cross_entropy over logits: the rows' max (f32) and their two sums (f64) all-reduced. */
static void tpl_ce_traffic(const dsk_tensor *logits, double tr[TP_TRAFFIC]) {
    tpl_coll(tr, TP_AR, 4.0 * (double)logits->shape[0]);
    tpl_coll(tr, TP_AR, 16.0 * (double)logits->shape[0]);
}

/* tp_attn_half: the gather of h1 (MHA's column-parallel QKV, MLA's latents), Wo's reduce-scatter. */
static void tpl_attn_half_traffic(tp_state *ps, int l, double tr[TP_TRAFFIC]) {
    tp_acts s = tp_slot(ps, l, 0);
    tpl_coll_t(tr, TP_AG, &s.h1g);
    tpl_coll_t(tr, TP_RS, &ps->big);
}

/* tp_block_forward (a dense FFN: the gather of h2, W2's reduce-scatter; the MoE layer: none). */
static void tpl_block_forward_traffic(tp_state *ps, int l, double tr[TP_TRAFFIC]) {
    tpl_attn_half_traffic(ps, l, tr);
    if (ps->m->blocks[l].is_moe) return;
    tp_acts s = tp_slot(ps, l, 0);
    tpl_coll_t(tr, TP_AG, &s.h2g);
    tpl_coll_t(tr, TP_RS, &ps->big);
}

/* tp_block_backward: the recomputed forward (full), each row-parallel linear's gather of d(out)
   and each column-parallel one's reduce-scatter of d(in) (MLA: Wo, the latents' d(h1g)). */
static void tpl_block_backward_traffic(tp_state *ps, int l, double tr[TP_TRAFFIC]) {
    int dense = !ps->m->blocks[l].is_moe;
    tp_acts s = tp_slot(ps, l, 0);
    if (ps->layers[l].rc == TMLA_RECOMPUTE_FULL) {
        tpl_attn_half_traffic(ps, l, tr);
        if (dense) tpl_coll_t(tr, TP_AG, &s.h2g);
    }
    for (int half = dense ? 0 : 1; half < 2; half++) {
        tpl_coll_t(tr, TP_AG, &ps->big);
        tpl_coll_t(tr, TP_RS, &ps->big);
    }
}

/* tp_head (training, with its MTP modules' forward and backward and, when the first stage is
   elsewhere, their embeddings from the last stage's copy). */
static void tpl_head_traffic(tp_state *ps, double tr[TP_TRAFFIC]) {
    const tm_config *c = &ps->m->cfg;
    int mtp = c->mla.mtp_depth, copy = mtp > 0 && ps->first < 0;
    for (int k = 0; copy && k < mtp; k++) tpl_coll_t(tr, TP_RS, &ps->big); /* tp_mtp_embed */
    tpl_coll_t(tr, TP_AG, &ps->hfg);
    tpl_ce_traffic(&ps->logits, tr);
    for (int k = 1; k <= mtp; k++) { /* tp_mtp_forward */
        tpl_block_forward_traffic(ps, c->n_layers + k - 1, tr);
        tpl_coll_t(tr, TP_AG, &ps->mtp_hfg[k - 1]);
        tpl_ce_traffic(&ps->m->mla.mtp[k - 1].logits, tr);
    }
    for (int k = mtp; k >= 1; k--) { /* tp_mtp_backward */
        tpl_coll_t(tr, TP_RS, &ps->big);
        tpl_block_backward_traffic(ps, c->n_layers + k - 1, tr);
    }
    tpl_coll_t(tr, TP_RS, &ps->big);
    for (int k = 0; copy && k < mtp; k++) tpl_coll_t(tr, TP_AG, &ps->big); /* tp_mtp_embed_backward */
}

/* The tensor-parallel traffic (train/par_run.h's TP_AR ...) of one training step of the rank built
   in tpl_rank (tp_train_batch: every chunk's forward and backward of each of the M micro-batches,
   tp_forward_chunk and tp_backward_chunk), computed from the layout and the tensors alone (a
   plan's model has them as headers over no memory), each function above the twin of the
   trainer's function it names. Zero without tensor parallelism. */
static void tpl_tp_traffic(tp_state *ps, double tr[TP_TRAFFIC]) {
    double one[TP_TRAFFIC] = {0};
    int mtp = ps->m->cfg.mla.mtp_depth > 0 && ps->last >= 0;
    for (int k = 0; k < TP_TRAFFIC; k++) tr[k] = 0;
    if (ps->tp < 2) return;
    for (int c = 0; c < ps->v; c++) {
        const tp_chunk *ch = &ps->chunks[c];
        int embeds = ch->stage == 0 ? 1 + (mtp ? ps->m->cfg.mla.mtp_depth : 0) : 0;
        for (int k = 0; k < embeds; k++) tpl_coll_t(one, TP_RS, &ps->big); /* dsk_par_embedding_forward */
        for (int l = ch->lo; l < ch->hi; l++) tpl_block_forward_traffic(ps, l, one);
        if (c == ps->last) tpl_head_traffic(ps, one);
        for (int l = ch->hi - 1; l >= ch->lo; l--) tpl_block_backward_traffic(ps, l, one);
        for (int k = 0; k < embeds; k++) tpl_coll_t(one, TP_AG, &ps->big); /* tp_embed_backward */
    }
    for (int k = 0; k < TP_TRAFFIC; k++) tr[k] = ps->M * one[k];
}

/* The training FLOPs per token of the layers of the rank built above (ps NULL: the whole model, as
   tmla_model_flops counts it), all its tp ranks together: its chunks' blocks, and on the last stage the LM
   head and the MTP modules; and its chunks' MoE blocks (the first n_dense blocks are dense). */
static dsk_plan_flops tpl_stage_flops(const tm_config *c, const tp_state *ps) {
    tmla_flops f = {0, 0, 0};
    dsk_plan_flops out;
    memset(&out, 0, sizeof out);
    for (int k = 0; k < (ps ? ps->v : 1); k++) {
        int lo = ps ? ps->chunks[k].lo : 0, hi = ps ? ps->chunks[k].hi : c->n_layers, moe = 0;
        tmla_add_layers_flops(c, lo, hi, &f);
        for (int l = lo; l < hi; l++) moe += l >= c->n_dense;
        out.moe_layers += moe;
        if (k < DSK_PLAN_MAX_CHUNKS) out.chunk_moe_layers[k] = moe;
    }
    if (!ps || ps->last >= 0) tmla_add_tail_flops(c, &f);
    out.total = f.total;
    out.attn = f.attn;
    out.fp8 = f.fp8;
    return out;
}

/* The memory of rank (tp 0, dp 0, pp stage) of layout l for a model of configuration `base`
   (train_moe's model_config), at each ZeRO stage and moments' dtype (l->zero and l->moments
   aside; index tpl_variant): mem[], the bytes its reductions and gathers hand over per step
   (zo: the engine's compression) and link[]: what they put on the rank's link (dsk_plan_model.memory's);
   *send: its pipeline sends' bytes per step; ep_bytes: its MoE layers' dispatch and combine bytes per step
   (tpl_ep_bytes); tp: its tensor-parallel collectives per step (tpl_tp_traffic: bytes by kind, calls);
   *flops: its layers' FLOPs per token (tpl_stage_flops). cuda: size the MoE workspace as a GPU holds it. A
   layout the trainer refuses (its checks in tm_init / tp_model_init) is DSK_ERR_UNSUPPORTED with the trainer's
   message. */
static dsk_status tpl_rank(const tm_config *base, const tz_opts *zo, int cuda, const dsk_plan_layout *l,
                           const dsk_plan_job *job, int stage, dsk_plan_memory mem[TPL_VARIANTS],
                           double reduce[TPL_VARIANTS], double gather[TPL_VARIANTS], double link[TPL_VARIANTS],
                           double *send, double ep_bytes[2], double tp[TP_TRAFFIC], dsk_plan_flops *flops) {
    tm_config c = *base;
    int64_t acts = 0, live0 = dsk_tensor_mem_stats(dsk_cpu()).live_bytes, T;
    int par = l->tp > 1 || l->pp > 1 || l->paired;
    dsk_comm ep; /* a stand-in: dsk_moe_init reads its size, rank and node count (0: one node), nothing calls it */
    tm_model *m = (tm_model *)calloc(1, sizeof *m);
    tp_state *ps = par ? (tp_state *)calloc(1, sizeof *ps) : NULL;
    dsk_status s = m && (ps || !par) ? DSK_OK : dsk_set_error(DSK_ERR_OOM, "tpl_rank: out of memory");
    memset(&ep, 0, sizeof ep);
    ep.world_size = l->ep;
    ep.backend = DSK_COMM_HOST;
    ep.impl = (dsk__comm_impl *)(void *)&ep;
    c.seq = (int)job->seq;
    c.batch = (int)(job->sequences / l->dp / (par ? 1 : l->micro));
    c.external = 1;
    c.plan_bytes = &acts;
    c.plan_cuda = cuda;
    c.mla.recompute = (tmla_recompute)l->recompute;
    c.moe.ep = l->ep > 1 ? &ep : NULL;
    if (s == DSK_OK && par) s = tpl_grid(ps, l, stage, c.mla.mtp_depth);
    if (s == DSK_OK) s = par ? tp_model_init(ps, m, NULL, &c) : tm_init(m, NULL, &c);
    if (s != DSK_OK) {
        char msg[600];
        snprintf(msg, sizeof msg, "%s", dsk_last_error());
        s = dsk_set_error(DSK_ERR_UNSUPPORTED, "the trainer refuses this layout: %s", msg);
    }
    memset(mem, 0, TPL_VARIANTS * sizeof *mem);
    for (int k = 0; k < TPL_VARIANTS && s == DSK_OK; k++)
        s = tpl_engine(m, ps, l, zo, k % 4, k < 4 ? DSK_F32 : DSK_BF16, &mem[k], &reduce[k], &gather[k], &link[k]);
    T = (int64_t)(par ? ps->Bm : m->cfg.batch) * m->cfg.seq; /* tm_bind_moe's reservation */
    *send = s == DSK_OK ? tpl_send_bytes(ps) : 0;
    memset(flops, 0, sizeof *flops);
    if (s == DSK_OK) *flops = tpl_stage_flops(&m->cfg, ps);
    memset(tp, 0, TP_TRAFFIC * sizeof *tp);
    if (s == DSK_OK && ps) tpl_tp_traffic(ps, tp);
    ep_bytes[0] = ep_bytes[1] = 0;
    if (s == DSK_OK) tpl_ep_bytes(m, ps, par ? ps->Ns : T, par ? ps->M : l->micro, cuda, ep_bytes);
    if (s == DSK_OK) s = tpl_imbalance(m, T, l->ep, cuda, &mem[0].imbalance);
    for (int k = 0; k < TPL_VARIANTS; k++) {
        mem[k].imbalance = mem[0].imbalance;
        mem[k].activations = acts + dsk_tensor_mem_stats(dsk_cpu()).live_bytes - live0;
    }
    if (ps) tp_free(ps);
    if (m) tm_free(m);
    free(ps);
    free(m);
    return s;
}

#endif /* TRAIN_PLAN_H */
