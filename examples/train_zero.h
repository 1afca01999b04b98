/* train_zero.h - the gradient and optimizer engine of examples/train_moe.c: every model
   parameter lives in a dsk_zero object (the model is built with tm_config.external), which binds
   its compute weights (wc) and f32 gradient (g), reduces the gradients (all-reduce at --zero 0,
   reduce-scatter at 2-3, bucketed by unit and overlapped with backward; --grad-compress),
   unscales them, takes the norm and the skip decision (one all-reduce over the world), steps
   AdamW on f32 masters (sharded at --zero 1-3) and casts back (gathering at 1-3). Every layout
   takes this one path: data, expert, tensor and pipeline parallelism differ only in the groups
   the caller describes (tz_group, tz_place).

   Groups: a parameter's gradient reduces over the ranks of its group (its communicator), as the
     average or as the sum times post_scale. Data parallelism: the dense parameters average over
     every rank; the expert-sharded ones sum over the ranks holding the same experts, times
     1/world (each expert's gradient already gathers every token of its expert-parallel group).
     Tensor and pipeline parallelism (train_par.h): see tp_places.
   Objects: one per (group, part, compute dtype): the part is the pipeline chunk, so that each
     chunk's backward of a micro-batch is one dsk_zero pass (tz_begin_part). Units: the model's
     (embedding, each block, final norm and head), driven by the model's unit hook; the MoE
     layers are bound to their parameters' views again whenever ZeRO moves them (stage 3
     gathers, stage 2-3 gradient buffers).
   Weights start as the one-rank model's (the same counter-based streams, element by element: a
     parameter that is a box of a global tensor takes that box of the global tensor's numbers),
     so every layout and stage trains the same model; checkpoints hold the objects' pieces under
     the global tensors' names and shapes, so any layout resumes any other.

   In train_moe.c:
       tm_init with cfg.external = 1; tz_places_dp (or tp_places);
       tz_init(&z, &model, ctx, groups, places, &opts, seed);
       each step: for each micro-batch a: tz_begin(&z, a == last) (train_par.h: tz_begin_part per chunk);
                  forward, loss, backward (the hooks); tz_wait; tz_decide (unscale, clip, skip: one
                  all-reduce); tz_step; dsk_amp_update
       checkpoints: tz_ckpt_entries(SAVE or LOAD) next to the other entries; after a load tz_refresh */
#ifndef TRAIN_ZERO_H
#define TRAIN_ZERO_H

#include <stdlib.h>
#include <string.h>

#include "../dsk_zero.h"
#include "train_model.h"

#define TZ_MAX_OBJ 48
#define TZ_MAX_GROUPS 4

typedef struct tz_opts {
    int stage;                  /* 0..3 */
    dsk_zero_compress compress;
    int psgd_rank, psgd_start;  /* PowerSGD rank and first compressed pass */
    int fp8_ef;                 /* FP8 with error feedback */
    dsk_dtype moment_dtype;     /* AdamW's moments: f32 or bf16 (--optim-dtype) */
} tz_opts;

/* A reduction group: the ranks holding the same parameters (NULL: this rank alone). */
typedef struct tz_group {
    dsk_comm *comm;
    int sum_only; /* 1: the sum times post_scale; 0: the average */
    float post_scale;
    int stage_cap; /* [0: none] the highest ZeRO stage its objects take (a group whose members run its units at
                      different times cannot gather them per forward) */
} tz_group;

/* Where model parameter i goes. */
typedef struct tz_place {
    int group, part;         /* its tz_group, its part (pipeline chunk; 0 without a pipeline) */
    int64_t global_shape[3]; /* [all 0: the whole tensor] the global tensor it is a box of */
    int64_t offset[3];       /* where the box starts */
    uint64_t init_off;       /* dense parameters: the counter of the global tensor's element 0 */
} tz_place;

typedef struct tz {
    tm_model *m;
    dsk_ctx *ctx;
    int stage, n_obj;
    dsk_zero z[TZ_MAX_OBJ];
    dsk_zero *zp[TZ_MAX_OBJ];
    int obj_group[TZ_MAX_OBJ], obj_part[TZ_MAX_OBJ];
    dsk_dtype obj_dt[TZ_MAX_OBJ];
    int *obj_of, *idx_of;       /* [model params]: object and index in it */
    dsk_tensor scratch;         /* f32, the largest MoE parameter: the gradient an MoE layer is bound to while its
                                   real one does not exist (ZeRO-2/3 forward passes; nothing writes it) */
} tz;

/* "none", "bf16", "fp8", "fp8:ef" (error feedback), "powersgd:R" or "powersgd:R:START" (START: first
   compressed pass, [10]). */
static int tz_parse_compress(const char *s, tz_opts *o) {
    char *end;
    o->compress = DSK_ZERO_COMPRESS_NONE;
    o->psgd_rank = 0;
    o->psgd_start = 10;
    o->fp8_ef = !strcmp(s, "fp8:ef");
    if (!strcmp(s, "none")) return 1;
    if (!strcmp(s, "bf16")) { o->compress = DSK_ZERO_COMPRESS_BF16; return 1; }
    if (!strcmp(s, "fp8") || o->fp8_ef) {
        o->compress = DSK_ZERO_COMPRESS_FP8;
        return 1;
    }
    if (strncmp(s, "powersgd:", 9) != 0) return 0;
    o->compress = DSK_ZERO_COMPRESS_POWERSGD;
    o->psgd_rank = (int)strtol(s + 9, &end, 10);
    if (end == s + 9 || o->psgd_rank < 1) return 0;
    if (*end == ':') {
        const char *st = end + 1;
        o->psgd_start = (int)strtol(st, &end, 10);
        if (end == st || o->psgd_start < 0) return 0;
    }
    return *end == 0;
}

/* The object a parameter goes to: by (group, part, compute dtype), created in first-seen order. */
static int tz_object_of(tz *t, const tm_param *p, const tz_place *pl) {
    dsk_dtype dt = tm_param_dtype(t->m, p);
    for (int k = 0; k < t->n_obj; k++)
        if (t->obj_group[k] == pl->group && t->obj_part[k] == pl->part && t->obj_dt[k] == dt) return k;
    if (t->n_obj == TZ_MAX_OBJ) return -1;
    t->obj_group[t->n_obj] = pl->group;
    t->obj_part[t->n_obj] = pl->part;
    t->obj_dt[t->n_obj] = dt;
    return t->n_obj++;
}

/* Binds the MoE parameters of unit `unit` (-1: all) to their current views, an absent gradient
   to scratch. Before a forward, and between a forward and its backward (keep_forward: the same
   weights gathered elsewhere, and the real gradient; the layer's saved forwards stay). */
static dsk_status tz_bind_moe(tz *t, int unit, int keep_forward) {
    tm_model *m = t->m;
    for (int i = 0; i < m->n_params; i++) {
        tm_param *p = &m->params[i];
        dsk_tensor g = p->g;
        if (p->moe_layer < 0 || (unit >= 0 && p->unit != unit)) continue;
        if (keep_forward && (!p->wc.data || !p->g.data))
            return dsk_set_error(DSK_ERR_STATE, "tz_bind_moe: \"%s\" has no weights or gradient in its backward",
                                 p->name);
        if (!g.data) TM_TRY(dsk_tensor_wrap(&g, t->scratch.data, DSK_F32, t->scratch.device, p->ndim, p->shape));
        TM_TRY(dsk_moe_bind(&m->blocks[p->moe_layer].moe, t->ctx, p->moe_index, &p->wc, &g));
    }
    return DSK_OK;
}

static dsk_status tz_unit_hook(void *user, int unit, int phase) {
    tz *t = (tz *)user;
    for (int k = 0; k < t->n_obj; k++) {
        dsk_zero *z = &t->z[k];
        /* an evaluation forward (no backward) left the last unit gathered: free its buffer for the prefetches */
        if (phase == TM_FWD_BEGIN && unit == 0) TM_TRY(dsk_zero_forward_end(z, t->ctx, t->m->cfg.n_layers + 1));
        if (phase == TM_FWD_BEGIN) TM_TRY(dsk_zero_forward_begin(z, t->ctx, unit));
        else if (phase == TM_FWD_END) TM_TRY(dsk_zero_forward_end(z, t->ctx, unit));
        else if (phase == TM_BWD_BEGIN) TM_TRY(dsk_zero_backward_begin(z, t->ctx, unit));
        else TM_TRY(dsk_zero_backward_end(z, t->ctx, unit));
    }
    if (phase == TM_BWD_BEGIN && t->stage >= 2) /* a compute-dtype norm gradient restarts every micro-batch too */
        for (int i = 0; i < t->m->n_params; i++)
            if (t->m->params[i].unit == unit && t->m->params[i].gc.data)
                TM_TRY(dsk_tensor_fill(t->ctx, &t->m->params[i].gc, 0.0));
    if (phase == TM_FWD_BEGIN && t->stage == 3) return tz_bind_moe(t, unit, 0);
    if (phase == TM_BWD_BEGIN && t->stage >= 2) return tz_bind_moe(t, unit, 1);
    return DSK_OK;
}

static dsk_status tz_grad_ready(void *user, int param) {
    tz *t = (tz *)user;
    return dsk_zero_grad_ready(&t->z[t->obj_of[param]], t->ctx, t->idx_of[param]);
}

/* Piece pc of a parameter that is the box (offset, shape) of a global tensor drawn from the
   counter offset init_off: the global tensor, its box, the piece of the box's flattening. */
static dsk_status tz_init_box(tz *t, const tm_param *p, const tz_place *pl, dsk_zero_piece *pc, uint64_t seed) {
    dsk_tensor full, box, local, flat, part;
    int64_t n = tm_param_numel(p);
    dsk_status s = dsk_tensor_alloc(t->ctx, &full, DSK_F32, p->ndim, pl->global_shape);
    if (s != DSK_OK) return s;
    if ((s = dsk_tensor_alloc(t->ctx, &local, DSK_F32, p->ndim, p->shape)) != DSK_OK) {
        dsk_tensor_free(t->ctx, &full);
        return s;
    }
    s = dsk_tensor_normal(t->ctx, &full, seed, pl->init_off, 0.0f, p->init_std);
    box = full;
    for (int d = 0; d < p->ndim && s == DSK_OK; d++) {
        dsk_tensor cut;
        if ((s = dsk_tensor_slice(&box, d, pl->offset[d], p->shape[d], &cut)) == DSK_OK) box = cut;
    }
    if (s == DSK_OK) s = dsk_tensor_copy(t->ctx, &local, &box);
    if (s == DSK_OK) s = dsk_tensor_reshape(&local, 1, &n, &flat);
    if (s == DSK_OK) s = dsk_tensor_slice(&flat, 0, pc->first, pc->count, &part);
    if (s == DSK_OK) s = dsk_tensor_copy(t->ctx, &pc->master, &part);
    dsk_tensor_free(t->ctx, &local);
    dsk_tensor_free(t->ctx, &full);
    return s;
}

/* Piece pc of an MoE parameter: from its layer's stream through a whole temporary tensor. */
static dsk_status tz_init_moe(tz *t, const tm_param *p, dsk_zero_piece *pc) {
    dsk_tensor full, flat, part;
    int64_t n = tm_param_numel(p);
    dsk_status s = dsk_tensor_alloc(t->ctx, &full, DSK_F32, p->ndim, p->shape);
    if (s != DSK_OK) return s;
    s = dsk_moe_init_param(&t->m->blocks[p->moe_layer].moe, t->ctx, p->moe_index, &full);
    if (s == DSK_OK) s = dsk_tensor_reshape(&full, 1, &n, &flat);
    if (s == DSK_OK) s = dsk_tensor_slice(&flat, 0, pc->first, pc->count, &part);
    if (s == DSK_OK) s = dsk_tensor_copy(t->ctx, &pc->master, &part);
    dsk_tensor_free(t->ctx, &full);
    return s;
}

/* Fresh weights in this rank's pieces, element for element the one-rank model's initialisation
   (tm_init_weights): element j of a dense global tensor draws counter init_off + j; norm weights
   are ones; MoE parameters come from their layers' streams. */
static dsk_status tz_init_weights(tz *t, const tz_place *place, uint64_t seed) {
    tm_model *m = t->m;
    for (int i = 0; i < m->n_params; i++) {
        tm_param *p = &m->params[i];
        const tz_place *pl = &place[i];
        dsk_zero_piece pc;
        TM_TRY(dsk_zero_get_piece(&t->z[t->obj_of[i]], t->idx_of[i], &pc));
        if (pc.count == 0) continue;
        if (p->moe_layer >= 0) TM_TRY(tz_init_moe(t, p, &pc));
        else if (!(p->init_std > 0)) TM_TRY(dsk_tensor_fill(t->ctx, &pc.master, 1.0));
        else if (pl->global_shape[0] > 0) TM_TRY(tz_init_box(t, p, pl, &pc, seed));
        else TM_TRY(dsk_tensor_normal(t->ctx, &pc.master, seed, pl->init_off + (uint64_t)pc.first, 0.0f, p->init_std));
    }
    return DSK_OK;
}

/* The places of data and expert parallelism (groups[0]: dense over dp, averaged; groups[1]:
   experts over rep, summed times 1/world): part 0, experts rows [expert0, expert0 + local) of
   n_routed, dense counters one after the other in the model's order. */
static void tz_places_dp(const tm_model *m, dsk_comm *dp, dsk_comm *rep, int world, tz_group groups[2],
                         tz_place *place) {
    uint64_t off = 0;
    memset(groups, 0, 2 * sizeof *groups);
    groups[0].comm = dp;
    groups[1].comm = rep;
    groups[1].sum_only = 1;
    groups[1].post_scale = 1.0f / (float)world;
    for (int i = 0; i < m->n_params; i++) {
        const tm_param *p = &m->params[i];
        tz_place *pl = &place[i];
        memset(pl, 0, sizeof *pl);
        pl->group = p->sharded ? 1 : 0;
        pl->init_off = off;
        if (p->moe_layer < 0) off += (uint64_t)tm_param_numel(p);
        if (p->sharded) {
            const dsk_moe *moe = &m->blocks[p->moe_layer].moe;
            for (int d = 0; d < p->ndim; d++) pl->global_shape[d] = p->shape[d];
            pl->global_shape[0] = moe->opts.n_routed;
            pl->offset[0] = moe->expert0;
        }
    }
}

/* Rebuilds every object's compute weights from the masters (after initialisation or a load)
   and points the MoE layers at them. */
static dsk_status tz_refresh(tz *t) {
    for (int k = 0; k < t->n_obj; k++) TM_TRY(dsk_zero_refresh(&t->z[k], t->ctx));
    return t->stage <= 2 ? tz_bind_moe(t, -1, 0) : DSK_OK;
}

static void tz_free(tz *t) {
    for (int k = 0; k < t->n_obj; k++) dsk_zero_free(&t->z[k], t->ctx);
    if (t->ctx) dsk_tensor_free(t->ctx, &t->scratch);
    free(t->obj_of);
    free(t->idx_of);
    memset(t, 0, sizeof *t);
}

/* Each object's parameter list (ps[k * n_params ...], n[k] of them) in unit order (the model's
   order is not: its experts come last); *scratch: the largest MoE parameter. tz_init and tz_plan
   build their objects from it. */
static dsk_status tz_lists(tz *t, const tz_place *place, dsk_zero_param *ps, int *n, int64_t *scratch) {
    tm_model *m = t->m;
    for (int unit = 0; unit <= m->cfg.n_layers + 1; unit++)
        for (int i = 0; i < m->n_params; i++) {
            tm_param *p = &m->params[i];
            const tz_place *pl = &place[i];
            int k;
            dsk_zero_param *q;
            if (p->unit != unit) continue;
            if ((k = tz_object_of(t, p, pl)) < 0)
                return dsk_set_error(DSK_ERR_ARG, "tz_init: more than %d (group, part, dtype) objects", TZ_MAX_OBJ);
            q = &ps[k * m->n_params + n[k]];
            t->obj_of[i] = k;
            t->idx_of[i] = n[k]++;
            q->name = p->name;
            q->ndim = p->ndim;
            for (int d = 0; d < p->ndim; d++) {
                q->shape[d] = p->shape[d];
                q->global_shape[d] = pl->global_shape[d];
                q->offset[d] = pl->offset[d];
            }
            q->value = &p->wc;
            q->grad = &p->g;
            q->unit = p->unit;
            q->no_decay = !p->decay;
            if (p->moe_layer >= 0 && tm_param_numel(p) > *scratch) *scratch = tm_param_numel(p);
        }
    return DSK_OK;
}

static dsk_zero_opts tz_zero_opts(const tz_opts *o, const tz_group *g, dsk_dtype dt) {
    dsk_zero_opts zo;
    memset(&zo, 0, sizeof zo);
    zo.stage = g->stage_cap && o->stage > g->stage_cap ? g->stage_cap : o->stage;
    zo.compute_dtype = dt;
    zo.moment_dtype = o->moment_dtype;
    zo.compress = o->compress;
    zo.powersgd_rank = o->psgd_rank;
    zo.powersgd_start_iter = o->psgd_start;
    zo.fp8_error_feedback = o->fp8_ef;
    zo.sum_only = g->sum_only;
    zo.grad_post_scale = g->post_scale;
    return zo;
}

static dsk_status tz_tables(tz *t, tm_model *m, dsk_ctx *ctx, int stage, dsk_zero_param **ps) {
    memset(t, 0, sizeof *t);
    t->m = m;
    t->ctx = ctx;
    t->stage = stage;
    t->obj_of = (int *)calloc((size_t)m->n_params, sizeof(int));
    t->idx_of = (int *)calloc((size_t)m->n_params, sizeof(int));
    *ps = (dsk_zero_param *)calloc((size_t)(TZ_MAX_OBJ * m->n_params), sizeof **ps);
    if (!t->obj_of || !t->idx_of || !*ps) {
        free(*ps);
        *ps = NULL;
        return dsk_set_error(DSK_ERR_OOM, "tz_init: parameter tables");
    }
    return DSK_OK;
}

/* Shards the model m (built with tm_config.external): parameter i over groups[place[i].group]
   in the object of its part; fresh weights from `seed`; installs the model's hooks. Collective
   over every group. */
static dsk_status tz_init(tz *t, tm_model *m, dsk_ctx *ctx, const tz_group *groups, const tz_place *place,
                          const tz_opts *o, uint64_t seed) {
    dsk_zero_param *ps;
    int n[TZ_MAX_OBJ] = {0};
    int64_t scratch = 1;
    dsk_status s = tz_tables(t, m, ctx, o->stage, &ps);
    if (s != DSK_OK) {
        tz_free(t);
        return s;
    }
    s = tz_lists(t, place, ps, n, &scratch);
    for (int k = 0; k < t->n_obj && s == DSK_OK; k++) {
        const tz_group *g = &groups[t->obj_group[k]];
        dsk_zero_opts zo = tz_zero_opts(o, g, t->obj_dt[k]);
        s = dsk_zero_init(&t->z[k], g->comm, ctx, &ps[k * m->n_params], n[k], &zo);
        t->zp[k] = &t->z[k];
    }
    free(ps);
    if (s == DSK_OK && o->stage >= 2) s = dsk_tensor_alloc(ctx, &t->scratch, DSK_F32, 1, &scratch);
    if (s == DSK_OK && o->stage >= 2) s = dsk_tensor_fill(ctx, &t->scratch, 0.0);
    if (s == DSK_OK) s = tz_init_weights(t, place, seed);
    if (s == DSK_OK) s = tz_refresh(t);
    if (s != DSK_OK) {
        tz_free(t);
        return s;
    }
    m->unit_hook = tz_unit_hook;
    m->unit_hook_user = t;
    m->grad_ready = tz_grad_ready;
    m->grad_ready_user = t;
    return DSK_OK;
}

/* Stage 0: points every parameter's w at its whole f32 master, which every rank holds (the code
   that reads or writes whole weights: a Hugging Face import or export, the gradient check). In
   f32 the forward's weights are the masters themselves; after writing masters call tz_refresh. */
static dsk_status tz_bind_masters(tz *t) {
    for (int i = 0; i < t->m->n_params; i++) {
        tm_param *p = &t->m->params[i];
        dsk_zero_piece pc;
        TM_TRY(dsk_zero_get_piece(&t->z[t->obj_of[i]], t->idx_of[i], &pc));
        if (pc.first != 0 || pc.count != tm_param_numel(p))
            return dsk_set_error(DSK_ERR_STATE, "tz_bind_masters: \"%s\" is not whole on this rank (stage %d)", p->name,
                                 t->stage);
        TM_TRY(dsk_tensor_reshape(&pc.master, p->ndim, p->shape, &p->w));
    }
    return DSK_OK;
}

/* Parameter i's piece of the whole tensor w (of the parameter's shape, contiguous) into its f32
   master, at any stage (a Hugging Face import under --zero 1-3); then call tz_refresh. */
static dsk_status tz_set_master(tz *t, int i, const dsk_tensor *w) {
    tm_param *p = &t->m->params[i];
    dsk_zero_piece pc;
    dsk_tensor flat, part;
    int64_t n = tm_param_numel(p);
    TM_TRY(dsk_zero_get_piece(&t->z[t->obj_of[i]], t->idx_of[i], &pc));
    if (pc.count == 0) return DSK_OK;
    TM_TRY(dsk_tensor_reshape(w, 1, &n, &flat));
    TM_TRY(dsk_tensor_slice(&flat, 0, pc.first, pc.count, &part));
    return dsk_tensor_copy(t->ctx, &pc.master, &part);
}

/* ---- a step */

static dsk_status tz_begin(tz *t, int sync) {
    for (int k = 0; k < t->n_obj; k++) TM_TRY(dsk_zero_begin(&t->z[k], t->ctx, sync));
    return DSK_OK;
}

/* A backward pass of part `part` only (a pipeline chunk's backward of one micro-batch). */
static dsk_status tz_begin_part(tz *t, int part, int sync) {
    for (int k = 0; k < t->n_obj; k++)
        if (t->obj_part[k] == part) TM_TRY(dsk_zero_begin(&t->z[k], t->ctx, sync));
    return DSK_OK;
}

static dsk_status tz_wait(tz *t) {
    for (int k = 0; k < t->n_obj; k++) TM_TRY(dsk_zero_wait(&t->z[k], t->ctx));
    return DSK_OK;
}

/* Unscale, norm and skip over every object's pieces, one all-reduce over `world`. */
static dsk_status tz_decide(tz *t, dsk_amp_scaler *sc, dsk_comm *world, double clip, dsk_amp_decision *dec) {
    return dsk_zero_unscale_decide(t->zp, t->n_obj, sc, world, t->ctx, clip, dec);
}

static dsk_status tz_step(tz *t, const dsk_adamw_opts *o, int64_t step, const dsk_amp_decision *dec) {
    for (int k = 0; k < t->n_obj; k++) TM_TRY(dsk_zero_step(&t->z[k], t->ctx, o, step, dec));
    return DSK_OK;
}

/* ---- checkpoints, figures */

/* Appends every object's entries (mode: save or load) to e[*n..cap); the entries point into
   the objects (valid until the next call). */
static dsk_status tz_ckpt_entries(tz *t, dsk_zero_ckpt_mode mode, dsk_ckpt_entry *e, int cap, int *n) {
    for (int k = 0; k < t->n_obj; k++) {
        const dsk_ckpt_entry *ze;
        int nz;
        TM_TRY(dsk_zero_ckpt_entries(&t->z[k], t->ctx, mode, &ze, &nz));
        if (*n + nz > cap)
            return dsk_set_error(DSK_ERR_ARG, "tz_ckpt_entries: %d entries do not fit in %d", *n + nz, cap);
        memcpy(e + *n, ze, (size_t)nz * sizeof *ze);
        *n += nz;
    }
    return DSK_OK;
}

static void tz_memory(const tz *t, dsk_zero_memory *out) {
    memset(out, 0, sizeof *out);
    for (int k = 0; k < t->n_obj; k++) {
        out->params += t->z[k].memory.params;
        out->grads += t->z[k].memory.grads;
        out->optimizer += t->z[k].memory.optimizer;
        out->comm += t->z[k].memory.comm;
    }
    if (t->scratch.data) out->grads += (int64_t)dsk_tensor_nbytes(&t->scratch); /* the MoE layers' stand-in gradient */
}

/* Elements a PowerSGD reduction of rank r hands over for the model's gradients (*comp), and
   uncompressed (*all): PyTorch's rule (dsk_zero_powersgd_compresses, its default minimum
   compression rate 2) on each tensor viewed as (shape[0], rest), P and Q of (rows + cols) r'. */
static void tz_powersgd_elements(const tm_model *m, int r, double *comp, double *all) {
    *comp = *all = 0;
    for (int i = 0; i < m->n_params; i++) {
        const tm_param *p = &m->params[i];
        int64_t n = tm_param_numel(p), rows = p->shape[0], cols = n / rows, rr = r < rows ? r : rows;
        if (cols < rr) rr = cols;
        *all += (double)n;
        *comp += dsk_zero_powersgd_compresses(p->ndim, rows, cols, r, 2.0) ? (double)((rows + cols) * rr) : (double)n;
    }
}

/* Seconds the caller's thread waited for the objects' collectives so far (the exposed part). */
static double tz_wait_seconds(const tz *t) {
    double s = 0;
    for (int k = 0; k < t->n_obj; k++) s += t->z[k].stats.wait_seconds;
    return s;
}

/* Cumulative bytes handed to the gradient reductions and what they would be uncompressed. */
static void tz_bytes(const tz *t, double *reduce, double *plain, double *gather) {
    *reduce = *plain = *gather = 0;
    for (int k = 0; k < t->n_obj; k++) {
        *reduce += (double)t->z[k].stats.reduce_bytes;
        *plain += (double)t->z[k].stats.plain_bytes;
        *gather += (double)t->z[k].stats.gather_bytes;
    }
}

#endif /* TRAIN_ZERO_H */
