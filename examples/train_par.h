/* train_par.h - tensor, sequence and pipeline parallelism for the model of train_model.h, on
   dsk_par.h (the rank grid, Megatron's mappings, parallel linears, vocabulary parallelism,
   pipeline schedules and executor). examples/train_moe.c turns it on with --tp, --pp,
   --pp-schedule, --micro-batches and --virtual-stages.

   Layout. The rank grid of dsk_par.h: world rank = tp_i + tp (dp_i + dp pp_i), expert
     parallelism inside dp. A rank holds the blocks of its pipeline stages and, of each, its
     tensor-parallel shard:
       attention   wq, wk, wv column-parallel (rows [r D/tp, (r+1) D/tp): heads r H/tp ..),
                   wo row-parallel (columns), so each rank runs H/tp heads on every token
       MLA         (--attn mla, Megatron-Core's layout) the up-projections wq (q_lora 0) or
                   wq_b, and wkv_b column-parallel by heads (rows of heads r H/tp ..), wo
                   row-parallel; the latent down-projections wq_a and wkv_a (with the shared
                   rope key) and the latents' norms replicated, run whole on the gathered input
                   (N rows) on every rank; their weight gradients and d(input) from the rank's
                   heads only, both summed over tp (see tp_mla_backward)
       dense FFN   w1, w3 column-parallel, w2 row-parallel
       embedding   vocabulary-parallel rows; lm_head vocabulary-parallel rows, with the
                   vocabulary-parallel cross-entropy (the full logits are never formed)
       norms       replicated; they run under sequence parallelism on the rank's N/tp tokens
                   (rows [r N/tp, (r+1) N/tp) of the micro-batch): all-gather before the
                   column-parallel linears, reduce-scatter after the row-parallel ones
       MTP         (--mtp D) the modules on the last stage, after the main head, in its unit and
                   part: norms and projection replicated on the rank's N/tp tokens, the block
                   as the main ones, the shared head and its vocabulary-parallel loss; the
                   shifted tokens' embeddings from a copy of the embedding on the last stage
                   when the first stage is elsewhere (Megatron's embedding group, see MTP)
       MoE layers  replicated over tp (router, shared experts, routed experts) and sharded by
                   expert parallelism only: each tensor-parallel rank runs the layer on its own
                   N/tp tokens (the sequence-parallel shard it already holds), so an MoE layer
                   needs no tensor-parallel collective at all and its experts keep whole GEMMs;
                   the price is that expert weights are not split over tp (EP does that).
     Gradients go through the trainer's one engine (train_zero.h, dsk_zero objects), with the
     groups of tp_places: norms and MoE replicated parameters saw only this rank's tokens: summed
     over the ranks of the stage (tp x dp); tensor-parallel shards over dp; the embedding, when
     the last stage holds a copy (--mtp), over the first and last stages' ranks of its
     tensor-parallel rank (2 dp); expert shards over the ranks of the stage holding the same
     experts (tp x edp); then each times 1/dp (every
     data-parallel replica's loss is its own micro-batch mean). Each pipeline chunk is its own
     part: its backward of a micro-batch is one pass (pass_begin), the last micro-batch's reduces
     (--zero 0-1) or every one reduce-scatters (--zero 2-3); the model's unit hooks drive the
     ZeRO-3 gathers and the gradient buffers, grad_ready starts each unit's reduction.
   Initialisation: every dense tensor takes the numbers the one-rank model gives it (its full
     tensor drawn from the same counter offset, then the rank's box: tp_places gives the engine
     both), MoE layers their own streams; so any layout starts from the one-rank model's weights.
   Pipeline: the layers split into pp * v contiguous global stages (v virtual stages for the
     interleaved schedule, 2 for dualpipev); rank r runs stages c pp + r (dualpipev: r and 2 pp - 1 - r,
     the stage after pp - 1 on the same rank, whose activation and gradient the chunks hand over in
     memory: tp_local_neighbour). The embedding is on global stage 0, the
     final norm, LM head and loss on the last; the residual stream (N/tp, D) of a micro-batch
     travels between stages by send/receive of the executor. Activations of in-flight
     micro-batches sit in slots (micro mod the schedule's in-flight bound), and so do an MoE
     layer's saved forwards (dsk_moe_set_slots, the same slot). Under --recompute full it keeps one
     forward for its backward, which runs it again first when another micro-batch ran through the
     layer since (in eval mode: counted once for the expert bias); an MTP module's layer runs its
     backward right after its forward: one slot.
   Balancing losses and expert capacity are per MoE call (a micro-batch's N/tp tokens on a
     rank), as they are per rank under data parallelism; the tests run dropless without them.
   Sampling runs the prompt as sequence 0 of one micro-batch (the others hold the last batch's
     tokens; with a capacity factor they share the experts' slots).
   Dtypes (--dtype f32|bf16|f16|fp8) as train_model.h has them: f32 masters, gradients and moments
     (the engine's); compute copies wc of the weights, which every op reads; activations, the
     residual stream sent between stages, the sequence-parallel gathers and scatters and the
     logits in the compute dtype; norms' rstd, attention probabilities, routers, the
     cross-entropy's math and the loss f32; norm weights' gradients accumulate in gc (compute
     dtype), copied to g when their unit's backward ends (tm_ready); the embedding's gradient
     from an f32 copy of the (gathered) dx. An f16 model runs its MoE layers in f32 (through the
     layer's mx/my); the trainer's loss scale comes in as gscale. --dtype fp8 (bf16 otherwise):
     each column- and row-parallel shard's three GEMMs in FP8 (train_fp8.h), its input kept for
     backward in an e4m3 cache per slot (f8_h1 .. f8_a; the one shared slot of what the layer's backward
     recomputes and quantises again: all under --recompute full, MHA's Wo input under attn: tp_cache),
     the bf16 input one shared slot (tp_need_f8);
     the tensor-parallel collectives bf16 (train/par_run.h's tp_column_forward and the others).
   Limits (refused with a message): --tp divides the heads, the FFN hidden size, the
     vocabulary and the tokens of a micro-batch; every global stage holds a block; --mtp with
     --pp only at --zero 0-1 (train_moe.c: the embedding's copy would gather and reduce in
     another order than the first stage's).
   Recomputation (--recompute, as train_mla.h has it): attn keeps one slot of the attention
     core's output and statistics (MHA: probabilities) that every layer shares and recomputes
     the core before each block's attention backward; full keeps only each block's input per
     slot and reruns the block's attention half and dense FFN input (an MoE layer keeps its own
     state) before its backward. The same ops on the same inputs: the gradients are those
     without recomputation bit for bit. The MTP blocks keep theirs (their backward follows their
     forward at once).
   Contents: layout (tp_layout, tp_model_init, tp_places); views; then, in train/par_run.h, one
   block (forward, backward); MTP; stages (the executor's callbacks, tp_train_batch,
   tp_eval_batch); loss; checkpoints (who writes the expert bias). */
#ifndef TRAIN_PAR_H
#define TRAIN_PAR_H

#include "../dsk_par.h"
#include "train_model.h"
#include "train_zero.h"

typedef enum tp_split { TP_REPL = 0, TP_ROWS, TP_COLS } tp_split;
/* How a gradient reduces; also the order of the parameters in the slabs. */
typedef enum tp_group { TP_G_REPL = 0, TP_G_SHARD, TP_G_EMBED, TP_G_EXPERT, TP_G_COUNT } tp_group;

typedef struct tp_pinfo {
    int split, group;
    int64_t off[3], full[3]; /* this rank's box in the full tensor */
    uint64_t init_off;       /* the full tensor's counter offset in the one-rank model's initialisation */
} tp_pinfo;

typedef struct tp_layer {
    int on, chunk;
    /* per slot (S slots of rows each) */
    dsk_tensor x, h1, rstd1, h1g, q, k, v, qr, kr, att, probs, x2, h2, rstd2, h2g, g, u, a;
    tmla_block mla; /* --attn mla: the latents, queries, keys, values and core output per slot (tensors only) */
    tf8_act f8_h1, f8_att, f8_h2, f8_a; /* --dtype fp8: the linears' inputs in e4m3 per slot (h1g, att; dense h2g, a) */
    int rc;         /* tmla_recompute mode: what the layer's backward recomputes (MTP blocks: none) */
    int moe_micro; /* micro-batch of the MoE layer's saved forward (-1: none) */
    int64_t bias_off[1], bias_full[1];
} tp_layer;

typedef struct tp_chunk {
    int stage, lo, hi;
    dsk_tensor in_act, out_act, in_grad, out_grad; /* (M Ns, D): one (Ns, D) per micro-batch */
} tp_chunk;

/* One micro-batch's forward or backward through a chunk as steps (train/par_run.h's streams). */
typedef struct tp_stream {
    int bwd, micro, chunk, slot;
    int l, at;  /* the layer of the next step and where in it (TP_AT_*) */
    int paired; /* beside another stream: its MoE calls in steps (dsk_moe_experts, ...) */
} tp_stream;

typedef struct tp_state {
    int on;
    int tp, pp, dp, ep, v, M, S;    /* S: activation slots (the schedule's in-flight bound) */
    dsk_par_schedule_kind kind;
    int paired;                     /* set before tp_model_init: --pair-micro-batches (dsk_par_schedule_init_paired) */
    dsk_par_grid grid;              /* its ep and edp groups are the trainer's */
    dsk_comm stage;                 /* same pipeline stage (tp x dp) */
    dsk_comm xrep;                  /* same stage and same experts (tp x edp) */
    int embed_group;                /* set before tp_grid_init: --mtp under --pp (the embedding's copy) */
    dsk_comm embg;                  /* the first and the last stage's ranks of this tensor-parallel rank (2 dp) */
    int embed_copy;                 /* the first and last stages are on other ranks: the last holds a copy */
    dsk_par_schedule sched;
    tm_model *m;
    dsk_ctx *ctx;
    int Bm;                         /* sequences per micro-batch */
    int64_t T, Nm, Ns, D, Dl, Dh, Hl, Fl, Vl;
    tp_pinfo pinfo[1024];
    int group_n[TP_G_COUNT + 1];       /* first parameter of each group */
    /* the engine's pass of chunk `chunk` (its backward of one micro-batch; sync: the step's last) */
    dsk_status (*pass_begin)(void *user, int chunk, int sync);
    void *pass_user;
    int sync_last;      /* this batch is the step's last (--accum): its last micro-batch reduces */
    int pass_micro[17]; /* the micro-batch whose pass each chunk has open, or -1 */
    tp_layer *layers;   /* (n_layers + the MTP blocks) */
    tp_layer sh;        /* --recompute: the one slot of the recomputed activations every layer shares */
    tp_chunk chunks[16];
    int first, last;                /* chunk holding global stage 0 / the last one, or -1 */
    dsk_tensor dx, dh, tmp, big, datt, dq, dk, dv, dqr, dkr, dg, du, da;
    dsk_tensor fdx, fdh;      /* paired: the running gradient of a forward's head (train/par_run.h's streams) */
    tp_stream streams[2];     /* the streams running: one, or a pair's backward and forward */
    tp_stream *pend;          /* the one whose expert exchange is in flight, or NULL */
    int64_t paired_exchanges; /* expert exchanges that travelled while a pair's other micro-batch computed */
    dsk_tensor xf, hf, rstdf, hfg, logits, dlogits, vrow; /* vrow (V): a row of logits gathered over tp */
    dsk_tensor dx32;                  /* bf16/f16, first stage: (Nm, D) f32 copy of the gathered dx */
    dsk_tensor mtp_hfg[TMLA_MAX_MTP]; /* tp > 1: each MTP module's gathered final norm output (Nm, D) */
    int train;                      /* 1: forward keeps what backward needs and the head runs its backward */
    float gscale;                   /* loss gradient scale of one micro-batch */
    double loss_sum;                /* over this run's micro-batches (last stage) */
} tp_state;

/* ------------------------------------------------------------------ layout */

/* The pipeline's split of the layers over its P global stages (stage s holds [bound[s], bound[s + 1])), each
   stage at least one layer. A pipeline keeps its busiest stage's pace, so the split is one whose busiest stage
   (its blocks' FLOPs per token, tmla_layer_flops; the last's also its LM head and MTP modules) has the fewest
   FLOPs, the bound found by bisection; under it each stage from the last back takes as many layers as fit, so
   the early stages, which hold the most micro-batches in flight under 1F1B, are the lightest. P <= n_layers
   <= TP_MAX_LAYERS. */
#define TP_MAX_LAYERS 1024
static int tp_split_greedy(const double *pre, int L, int P, double head, double cap, int bound[]) {
    int end = L;
    bound[P] = L;
    for (int s = P; s > 0; s--) { /* stage s - 1: [start, end), at least one layer left to each earlier stage */
        double extra = s == P ? head : 0;
        int start = end - 1;
        while (start > s - 1 && pre[end] - pre[start - 1] + extra <= cap) start--;
        if (s == 1) start = 0;
        if (pre[end] - pre[start] + extra > cap) return 0;
        bound[s - 1] = end = start;
    }
    return 1;
}
static void tp_split_layers(const tm_config *c, int P, int bound[]) {
    int L = c->n_layers;
    tmla_flops tail = {0, 0, 0};
    double pre[TP_MAX_LAYERS + 1], head, lo = 0, hi;
    tmla_add_tail_flops(c, &tail);
    head = tail.total;
    pre[0] = 0;
    for (int l = 0; l < L; l++) pre[l + 1] = pre[l] + tmla_layer_flops(c, l).total;
    hi = pre[L] + head; /* one stage could hold it all: every split fits */
    for (int it = 0; it < 64 && hi - lo > 1e-9 * hi; it++) {
        double mid = (lo + hi) / 2;
        if (tp_split_greedy(pre, L, P, head, mid, bound)) hi = mid;
        else lo = mid;
    }
    tp_split_greedy(pre, L, P, head, hi, bound);
}

/* The chunk of this rank that holds layer l, or -1. */
static int tp_chunk_of(const tp_state *ps, int l) {
    for (int c = 0; c < ps->v; c++)
        if (l >= ps->chunks[c].lo && l < ps->chunks[c].hi) return c;
    return -1;
}

/* Checks the sizes against the grid; every message names the flags. */
static dsk_status tp_check(const tp_state *ps, const tm_config *c) {
    int tp = ps->tp, S = ps->pp * ps->v;
    if (c->n_heads % tp || c->ffn_hidden % tp || c->vocab % tp)
        return dsk_set_error(DSK_ERR_ARG, "--tp %d must divide --heads %d, --ffn-hidden %d and the vocabulary %d", tp,
                             c->n_heads, c->ffn_hidden, c->vocab);
    if (c->batch % ps->M)
        return dsk_set_error(DSK_ERR_ARG, "--micro-batches %d must divide the %d sequences per data-parallel rank",
                             ps->M, c->batch);
    if ((int64_t)(c->batch / ps->M) * c->seq % tp)
        return dsk_set_error(DSK_ERR_ARG, "--tp %d must divide the %lld tokens of a micro-batch (sequence parallelism)",
                             tp, (long long)(c->batch / ps->M) * c->seq);
    if (c->moe.seq_aux_alpha > 0 && (c->batch / ps->M) % tp)
        return dsk_set_error(DSK_ERR_ARG, "the sequence-wise aux loss needs whole sequences per tensor-parallel rank: "
                             "--tp %d must divide the %d sequences of a micro-batch", tp, c->batch / ps->M);
    if (c->n_layers > TP_MAX_LAYERS)
        return dsk_set_error(DSK_ERR_ARG, "--layers %d under --tp/--pp: at most %d", c->n_layers, TP_MAX_LAYERS);
    if (c->n_layers < S)
        return dsk_set_error(DSK_ERR_ARG, "--layers %d cannot fill %d pipeline stages (--pp %d x --virtual-stages %d)",
                             c->n_layers, S, ps->pp, ps->v);
    if (ps->v > 16) return dsk_set_error(DSK_ERR_ARG, "--virtual-stages %d: at most 16", ps->v);
    if (ps->v > 1 && ps->pp < 2) return dsk_set_error(DSK_ERR_ARG, "--virtual-stages %d needs --pp 2 or more", ps->v);
    return DSK_OK;
}

/* The layer of a block parameter (by identity), -1 for the embedding and the head's unit (ln_f,
   lm_head, the MTP modules and their blocks). */
static int tp_param_layer(const tm_model *m, const tm_param *p, int *split) {
    int L = m->cfg.n_layers;
    *split = TP_REPL;
    if (p->moe_layer >= 0) return p->moe_layer < L ? p->moe_layer : -1;
    if (p == m->embed || p == m->lm_head) *split = TP_ROWS;
    if (p == m->embed || p == m->lm_head || p == m->ln_f) return -1;
    for (int k = 0; k < m->cfg.mla.mtp_depth; k++) {
        const tmla_mtp *t = &m->mla.mtp[k];
        if (p == t->hnorm || p == t->enorm || p == t->proj || p == t->norm) return -1;
    }
    for (int l = 0; l < tm_n_blocks(&m->cfg); l++) {
        const tm_block *b = &m->blocks[l];
        const tmla_block *a = &b->mla;
        if (p == b->wq || p == b->wk || p == b->wv || p == b->w1 || p == b->w3) *split = TP_ROWS;
        else if (p == a->wq || p == a->wq_b || p == a->wkv_b) *split = TP_ROWS; /* MLA: rows by heads */
        else if (p == b->wo || p == b->w2 || p == a->wo) *split = TP_COLS;
        else if (p != b->ln1 && p != b->ln2 && p != a->wq_a && p != a->q_norm && p != a->wkv_a && p != a->kv_norm)
            continue;
        return l < L ? l : -1;
    }
    return -2;
}

/* Rewrites the declared full model (every layer, full shapes) into this rank's part: keeps
   the parameters of its stages, shrinks each to its tensor-parallel box, orders them by
   gradient group (replicated, tensor-parallel shards, expert shards) and repoints the model's
   parameter pointers. */
static dsk_status tp_layout(tp_state *ps, tm_model *m) {
    tm_param *kept = (tm_param *)malloc((size_t)m->n_params * sizeof *kept);
    int n = m->n_params, map[1024], k = 0, tp_i = ps->grid.at.tp;
    uint64_t off = 0;
    if (!kept) return dsk_set_error(DSK_ERR_OOM, "tp_layout: out of memory");
    for (int i = 0; i < n; i++) map[i] = -1;
    for (int g = 0; g < TP_G_COUNT; g++) {
        ps->group_n[g] = k;
        off = 0;
        for (int i = 0; i < n; i++) {
            tm_param *p = &m->params[i];
            int split, l = tp_param_layer(m, p, &split), on;
            uint64_t init_off = off;
            if (p->moe_layer < 0) off += (uint64_t)tm_param_numel(p);
            if (l == -2) {
                free(kept);
                return dsk_set_error(DSK_ERR_UNSUPPORTED,
                                     "parameter \"%s\" has no tensor/pipeline-parallel layout "
                                     "(--tp/--pp support MHA and MLA attention, dense FFN and MoE blocks)",
                                     p->name);
            }
            int group = p->sharded ? TP_G_EXPERT : split == TP_REPL ? TP_G_REPL : TP_G_SHARD;
            if (p == m->embed && ps->embed_copy) group = TP_G_EMBED;
            if (group != g) continue;
            if (l >= 0) on = tp_chunk_of(ps, l) >= 0;
            else if (p == m->embed) on = ps->first >= 0 || (ps->embed_copy && ps->last >= 0);
            else on = ps->last >= 0;
            if (!on) continue;
            tp_pinfo *pi = &ps->pinfo[k];
            memset(pi, 0, sizeof *pi);
            pi->split = split;
            pi->group = group;
            pi->init_off = init_off;
            for (int d = 0; d < p->ndim; d++) pi->full[d] = p->shape[d];
            if (p->sharded) { /* the layer's local experts of n_routed */
                const dsk_moe *moe = &m->blocks[p->moe_layer].moe;
                pi->full[0] = moe->opts.n_routed;
                pi->off[0] = moe->expert0;
            }
            kept[k] = *p;
            if (split != TP_REPL) {
                int d = split == TP_ROWS ? 0 : 1;
                if (p->shape[d] % ps->tp) {
                    free(kept);
                    return dsk_set_error(DSK_ERR_ARG, "--tp %d does not divide dim %d (%lld) of \"%s\"", ps->tp, d,
                                         (long long)p->shape[d], p->name);
                }
                kept[k].shape[d] = p->shape[d] / ps->tp;
                pi->off[d] = (int64_t)tp_i * kept[k].shape[d];
            }
            map[i] = k++;
        }
    }
    ps->group_n[TP_G_COUNT] = k;
    tm_param *old = m->params;
    for (int k = 0; k < m->cfg.mla.mtp_depth; k++) {
        tmla_mtp *t = &m->mla.mtp[k];
        tm_param **ptrs[] = {&t->hnorm, &t->enorm, &t->proj, &t->norm};
        for (size_t j = 0; j < 4; j++) *ptrs[j] = map[*ptrs[j] - old] >= 0 ? &m->params[map[*ptrs[j] - old]] : NULL;
    }
    for (int l = 0; l < tm_n_blocks(&m->cfg); l++) {
        tm_block *b = &m->blocks[l];
        tm_param **ptrs[] = {&b->ln1,      &b->wq,        &b->wk,          &b->wv,        &b->wo,       &b->ln2,
                             &b->w1,       &b->w3,        &b->w2,          &b->mla.wq,    &b->mla.wq_a, &b->mla.q_norm,
                             &b->mla.wq_b, &b->mla.wkv_a, &b->mla.kv_norm, &b->mla.wkv_b, &b->mla.wo};
        for (size_t j = 0; j < sizeof ptrs / sizeof ptrs[0]; j++)
            if (*ptrs[j]) *ptrs[j] = map[*ptrs[j] - old] >= 0 ? &m->params[map[*ptrs[j] - old]] : NULL;
    }
    tm_param **top[] = {&m->embed, &m->ln_f, &m->lm_head};
    for (size_t j = 0; j < 3; j++) *top[j] = map[*top[j] - old] >= 0 ? &m->params[map[*top[j] - old]] : NULL;
    memcpy(m->params, kept, (size_t)k * sizeof *kept);
    free(kept);
    m->n_params = k;
    m->n_dense_params = ps->group_n[TP_G_EXPERT];
    return DSK_OK;
}

static dsk_status tp_alloc(tp_state *ps, dsk_tensor *t, dsk_dtype dt, int64_t r, int64_t c) {
    return tm_alloc2(ps->m, t, dt, r, c);
}

/* Activation t of layer L, one slot of shape (nd dims, d0 rows): S slots of it, or, when the
   layer's backward recomputes it (L->rc >= need: TMLA_RECOMPUTE_ATTN for the attention core's
   output and statistics, _FULL for all but the block input), the one slot of the same field of
   ps->sh that every such layer shares (only the latest forward's values live there). */
static dsk_status tp_act(tp_state *ps, tp_layer *L, dsk_tensor *t, int need, dsk_dtype dt, int nd, int64_t d0,
                         int64_t d1, int64_t d2, int64_t d3) {
    int64_t sh[4] = {d0, d1, d2, d3};
    if (L->rc < need) {
        sh[0] *= ps->S;
        return tm_alloc_nd(ps->m, t, dt, nd, sh);
    }
    dsk_tensor *one = (dsk_tensor *)((char *)&ps->sh + ((char *)t - (char *)L));
    if (!one->data) TM_TRY(tm_alloc_nd(ps->m, one, dt, nd, sh));
    *t = *one;
    t->owns = 0;
    return DSK_OK;
}

/* tp_act's need of an activation that only the forward reads under --dtype fp8 (a linear's input,
   kept for backward in its e4m3 cache instead): none, one slot every layer shares; else `need`. */
static int tp_need_f8(const tp_state *ps, int need) { return ps->m->cfg.fp8 ? TMLA_RECOMPUTE_NONE : need; }

/* Saved forwards of MoE block l's layer: one per activation slot, but one under full recomputation and in an MTP
   module (whose layer then runs a forward again when another micro-batch went through it since). */
static int tp_moe_slots(const tp_state *ps, int l) {
    return l >= ps->m->cfg.n_layers || ps->layers[l].rc >= TMLA_RECOMPUTE_FULL ? 1 : ps->S;
}

/* --dtype fp8: layer L's cache a of its linear's input (a slot: Nm rows, k columns), as tp_act places the
   activations: S slots, or the one slot of ps->sh every layer shares when its backward recomputes the input
   (L->rc >= need) and quantises it there again (the same values, the same codes). */
static dsk_status tp_cache(tp_state *ps, tp_layer *L, tf8_act *a, int need, int64_t k) {
    TM_TRY(tp_act(ps, L, &a->q, need, DSK_E4M3, 2, ps->Nm, k, 0, 0));
    return tp_act(ps, L, &a->s, need, DSK_F32, 2, ps->Nm, tf8_chunks(k), 0, 0);
}

/* --dtype fp8: layer L's caches of its linears' inputs (MLA: h1g and the normed latents; Wo's input has the
   model's one cache, tmla_alloc_scratch); MHA's Wo input is recomputed under --recompute attn too. */
static dsk_status tp_alloc_f8(tp_state *ps, tp_layer *L, int dense) {
    const tmla_config *a = &ps->m->cfg.mla;
    int F = TMLA_RECOMPUTE_FULL;
    TM_TRY(tp_cache(ps, L, &L->f8_h1, F, ps->D));
    if (tmla_is_mla(a) && a->q_lora_rank > 0) TM_TRY(tp_cache(ps, L, &L->mla.f8_cqn, F, a->q_lora_rank));
    if (tmla_is_mla(a)) TM_TRY(tp_cache(ps, L, &L->mla.f8_ckvn, F, a->kv_lora_rank));
    else TM_TRY(tp_cache(ps, L, &L->f8_att, TMLA_RECOMPUTE_ATTN, ps->Dl));
    if (!dense) return DSK_OK;
    TM_TRY(tp_cache(ps, L, &L->f8_h2, F, ps->D));
    return tp_cache(ps, L, &L->f8_a, F, ps->Fl);
}

/* The MLA activations of layer l, S slots of a micro-batch's Nm rows and the rank's Hl heads
   (the latents whole on every rank: they come from the gathered input). */
static dsk_status tp_alloc_mla(tp_state *ps, tp_layer *L) {
    const tmla_config *a = &ps->m->cfg.mla;
    tmla_block *p = &L->mla;
    dsk_dtype dt = ps->m->cfg.cdt;
    int64_t R = ps->Nm, H = ps->Hl, dn = a->qk_nope_dim, dr = a->qk_rope_dim, dqk = dn + dr, ql = a->q_lora_rank;
    int F = TMLA_RECOMPUTE_FULL, F8 = tp_need_f8(ps, F); /* the normed latents: the up-projections' inputs */
    if (ql > 0) {
        TM_TRY(tp_act(ps, L, &p->cq, F, dt, 2, R, ql, 0, 0));
        TM_TRY(tp_act(ps, L, &p->cqn, F8, dt, 2, R, ql, 0, 0));
        TM_TRY(tp_act(ps, L, &p->rstd_q, F, DSK_F32, 1, R, 0, 0, 0));
    }
    TM_TRY(tp_act(ps, L, &p->q, F, dt, 2, R, H * dqk, 0, 0));
    TM_TRY(tp_act(ps, L, &p->ckv, F, dt, 2, R, a->kv_lora_rank, 0, 0));
    TM_TRY(tp_act(ps, L, &p->ckvn, F8, dt, 2, R, a->kv_lora_rank, 0, 0));
    TM_TRY(tp_act(ps, L, &p->rstd_kv, F, DSK_F32, 1, R, 0, 0, 0));
    TM_TRY(tp_act(ps, L, &p->kpe, F, dt, 2, R, dr, 0, 0));
    TM_TRY(tp_act(ps, L, &p->kvb, F, dt, 2, R, H * (dn + a->v_head_dim), 0, 0));
    TM_TRY(tp_act(ps, L, &p->k, F, dt, 2, R, H * dqk, 0, 0));
    TM_TRY(tp_act(ps, L, &p->att, TMLA_RECOMPUTE_ATTN, dt, 2, R, H * a->v_head_dim, 0, 0));
    return tp_act(ps, L, &p->lse, TMLA_RECOMPUTE_ATTN, DSK_F32, 3, ps->Bm, H, ps->T, 0);
}

/* The MTP modules' tensors on the last stage (train_mla.h's tmla_mtp; tmla_free frees them):
   the shifted tokens and targets of the whole batch, the embeddings and their gradients per
   micro-batch (the rank's Ns rows), the rest for one micro-batch. */
static dsk_status tp_alloc_mtp(tp_state *ps) {
    tm_model *m = ps->m;
    dsk_dtype dt = m->cfg.cdt;
    int64_t N = (int64_t)m->cfg.batch * m->cfg.seq, Ns = ps->Ns, D = ps->D;
    for (int k = 0; k < m->cfg.mla.mtp_depth; k++) {
        tmla_mtp *t = &m->mla.mtp[k];
        TM_TRY(tp_alloc(ps, &t->ids, DSK_I32, N, 0));
        TM_TRY(tp_alloc(ps, &t->tgt, DSK_I32, N, 0));
        TM_TRY(tp_alloc(ps, &t->emb, dt, ps->M * Ns, D));
        TM_TRY(tp_alloc(ps, &t->demb, dt, ps->M * Ns, D));
        dsk_tensor *nd[] = {&t->en, &t->hn, &t->y, &t->hf};
        for (size_t i = 0; i < 4; i++) TM_TRY(tp_alloc(ps, nd[i], dt, Ns, D));
        dsk_tensor *nr[] = {&t->rstd_e, &t->rstd_h, &t->rstdf};
        for (size_t i = 0; i < 3; i++) TM_TRY(tp_alloc(ps, nr[i], DSK_F32, Ns, 0));
        TM_TRY(tp_alloc(ps, &t->logits, dt, ps->Nm, ps->Vl));
        TM_TRY(tp_alloc(ps, &t->dlogits, dt, ps->Nm, ps->Vl));
        TM_TRY(tm_alloc_nd(m, &t->loss, DSK_F32, 0, NULL));
        if (ps->tp > 1) TM_TRY(tp_alloc(ps, &ps->mtp_hfg[k], dt, ps->Nm, D));
        if (m->cfg.fp8) TM_TRY(tmla_alloc_cache(m, &t->f8_in, Ns, 2 * D)); /* the projection's input */
    }
    if (m->cfg.fp8 && m->cfg.mla.mtp_depth > 0) TM_TRY(tp_alloc(ps, &m->mla.cat, dt, Ns, 2 * D));
    return tp_alloc(ps, &m->mla.dcarry, dt, Ns, D);
}

/* Activations (S slots per layer), scratch, pipeline buffers, the batch tensors: in the compute
   dtype as tm_alloc_acts has them (norms' rstd and attention probabilities f32). */
static dsk_status tp_alloc_acts(tp_state *ps) {
    tm_model *m = ps->m;
    const tm_config *c = &m->cfg;
    int64_t S = ps->S, Nm = ps->Nm, Ns = ps->Ns, D = ps->D, Dl = ps->Dl, Fl = ps->Fl, N = (int64_t)c->batch * c->seq;
    dsk_dtype dt = c->cdt;
    int mla = tmla_is_mla(&c->mla);
    int64_t Fd = 0; /* Fl when the rank has a dense FFN (the FP8 scratch's) */
    for (int l = 0; l < tm_n_blocks(c); l++) {
        tp_layer *L = &ps->layers[l];
        int F = TMLA_RECOMPUTE_FULL;
        if (!L->on) continue;
        L->rc = l < c->n_layers ? c->mla.recompute : TMLA_RECOMPUTE_NONE;
        int dense = !m->blocks[l].is_moe, F8 = tp_need_f8(ps, F); /* F8: a linear's input (fp8: cached) */
        TM_TRY(tp_alloc(ps, &L->x, dt, S * Ns, D));
        TM_TRY(tp_act(ps, L, &L->h1, F8, dt, 2, Ns, D, 0, 0));
        TM_TRY(tp_act(ps, L, &L->x2, F, dt, 2, Ns, D, 0, 0));
        TM_TRY(tp_act(ps, L, &L->h2, dense ? F8 : F, dt, 2, Ns, D, 0, 0)); /* an MoE layer's input stays */
        TM_TRY(tp_act(ps, L, &L->rstd1, F, DSK_F32, 1, Ns, 0, 0, 0));
        TM_TRY(tp_act(ps, L, &L->rstd2, F, DSK_F32, 1, Ns, 0, 0, 0));
        if (mla) {
            TM_TRY(tp_alloc_mla(ps, L));
        } else {
            dsk_tensor *nl[] = {&L->q, &L->k, &L->v, &L->qr, &L->kr};
            for (size_t i = 0; i < 5; i++) TM_TRY(tp_act(ps, L, nl[i], F, dt, 2, Nm, Dl, 0, 0));
            TM_TRY(tp_act(ps, L, &L->att, tp_need_f8(ps, TMLA_RECOMPUTE_ATTN), dt, 2, Nm, Dl, 0, 0));
            TM_TRY(tp_act(ps, L, &L->probs, TMLA_RECOMPUTE_ATTN, DSK_F32, 4, ps->Bm, ps->Hl, c->seq, c->seq));
        }
        if (ps->tp > 1) TM_TRY(tp_act(ps, L, &L->h1g, F8, dt, 2, Nm, D, 0, 0));
        if (dense) {
            if (ps->tp > 1) TM_TRY(tp_act(ps, L, &L->h2g, F8, dt, 2, Nm, D, 0, 0));
            TM_TRY(tp_act(ps, L, &L->g, F, dt, 2, Nm, Fl, 0, 0));
            TM_TRY(tp_act(ps, L, &L->u, F, dt, 2, Nm, Fl, 0, 0));
            TM_TRY(tp_act(ps, L, &L->a, F8, dt, 2, Nm, Fl, 0, 0));
        }
        if (!dense) TM_TRY(dsk_moe_set_slots(&m->blocks[l].moe, ps->ctx, tp_moe_slots(ps, l)));
        if (c->fp8) TM_TRY(tp_alloc_f8(ps, L, dense));
        if (dense) Fd = Fl;
        L->moe_micro = -1;
        L->bias_full[0] = c->moe.n_routed;
    }
    dsk_tensor *sd[] = {&ps->dx, &ps->dh, &ps->tmp, &ps->xf, &ps->hf};
    for (size_t i = 0; i < 5; i++) TM_TRY(tp_alloc(ps, sd[i], dt, Ns, D));
    if (ps->paired && ps->last >= 0) TM_TRY(tp_alloc(ps, &ps->fdx, dt, Ns, D));
    if (ps->paired && ps->last >= 0) TM_TRY(tp_alloc(ps, &ps->fdh, dt, Ns, D));
    TM_TRY(tp_alloc(ps, &ps->rstdf, DSK_F32, Ns, 0));
    TM_TRY(tp_alloc(ps, &ps->big, dt, Nm, D));
    if (ps->tp > 1) TM_TRY(tp_alloc(ps, &ps->hfg, dt, Nm, D));
    /* the FP8 linears' scratch, for a micro-batch and the rank's shards (the MTP projection's on the last stage) */
    int64_t sh[2 * TMLA_FP8_SHAPES], Dt = ps->last >= 0 && c->mla.mtp_depth > 0 ? D : 0;
    if (c->fp8)
        TM_TRY(tf8_scratch_alloc(tm_alloc_nd, m, &m->f8, Nm, tmla_fp8_shapes(&c->mla, ps->Hl, D, Dl, Fd, Dt, sh), sh));
    if (mla) { /* train_mla.h's scratch for a micro-batch and this rank's heads; tp_unit_ready marks gradients */
        m->mla.heads = ps->Hl;
        m->mla.unit_ready = 1;
        TM_TRY(tmla_alloc_scratch(m, Nm, ps->Hl));
    } else {
        dsk_tensor *sl[] = {&ps->datt, &ps->dq, &ps->dk, &ps->dv, &ps->dqr, &ps->dkr};
        for (size_t i = 0; i < 6; i++) TM_TRY(tp_alloc(ps, sl[i], dt, Nm, Dl));
    }
    if (c->n_dense > 0) {
        dsk_tensor *sf[] = {&ps->dg, &ps->du, &ps->da};
        for (size_t i = 0; i < 3; i++) TM_TRY(tp_alloc(ps, sf[i], dt, Nm, Fl));
    }
    if (ps->last >= 0) { /* logits in the compute dtype as one rank's; the cross-entropy's math is f32/f64 */
        TM_TRY(tp_alloc(ps, &ps->logits, dt, Nm, ps->Vl));
        TM_TRY(tp_alloc(ps, &ps->dlogits, dt, Nm, ps->Vl));
        TM_TRY(tp_alloc(ps, &ps->vrow, dt, ps->Vl * ps->tp, 0));
    }
    for (int k = 0; k < ps->v; k++) { /* the residual stream and its gradient between stages */
        tp_chunk *ch = &ps->chunks[k];
        dsk_tensor *bufs[] = {&ch->in_act, &ch->out_act, &ch->in_grad, &ch->out_grad};
        for (size_t i = 0; i < 4; i++) TM_TRY(tp_alloc(ps, bufs[i], dt, ps->M * Ns, D));
    }
    if (ps->last >= 0 && c->mla.mtp_depth > 0) TM_TRY(tp_alloc_mtp(ps));
    if (dt != DSK_F32) {
        if (ps->first >= 0 || (ps->last >= 0 && c->mla.mtp_depth > 0)) /* the embedding's f32 gradient from it */
            TM_TRY(tp_alloc(ps, &ps->dx32, DSK_F32, Nm, D));
        for (int i = 0; i < m->n_params; i++) /* norm weights' gradients in the compute dtype (tm_param.gc) */
            if (m->params[i].ndim == 1) TM_TRY(tm_alloc_nd(m, &m->params[i].gc, dt, 1, m->params[i].shape));
    }
    TM_TRY(tm_alloc_nd(m, &m->ids, DSK_I32, 1, &N));
    TM_TRY(tm_alloc_nd(m, &m->targets, DSK_I32, 1, &N));
    return tm_alloc_nd(m, &m->loss, DSK_F32, 0, NULL);
}

/* The grid, the stage and expert-replica groups and the schedule; dims.ep set by the caller.
   Collective over world. */
static dsk_status tp_grid_init(tp_state *ps, dsk_comm *world, const dsk_par_dims *dims) {
    TM_TRY(dsk_par_grid_init(&ps->grid, world, dims));
    const dsk_par_dims *d = &ps->grid.dims;
    const dsk_par_coords *at = &ps->grid.at;
    ps->tp = d->tp;
    ps->pp = d->pp;
    ps->dp = d->dp;
    ps->ep = d->ep;
    TM_TRY(dsk_comm_split(world, at->pp, world->rank, &ps->stage));
    TM_TRY(dsk_comm_split(world, at->pp * d->ep + at->ep, world->rank, &ps->xrep));
    if (!ps->embed_group || d->pp < 2 || ps->kind == DSK_PAR_DUALPIPE_V) return DSK_OK; /* the V: both on pp 0 */
    int ends = at->pp == 0 || at->pp == d->pp - 1;
    return dsk_comm_split(world, ends ? at->tp : DSK_COMM_NO_COLOR, world->rank, &ps->embg);
}

/* The parameters of this rank's stages and tensor-parallel shard, declared without
   activations (tm_declare_model's part of tp_model_init; a planner sizes them: train_plan.h).
   ps->tp/pp/v/M/kind and the grid's dims and coordinates are set. */
static dsk_status tp_model_declare(tp_state *ps, tm_model *m, dsk_ctx *ctx, const tm_config *cfg) {
    memset(m, 0, sizeof *m);
    m->cfg = *cfg;
    m->ctx = ctx;
    ps->m = m;
    ps->ctx = ctx;
    TM_TRY(tm_check_config(cfg));
    TM_TRY(tp_check(ps, cfg));
    if (!cfg->external)
        return dsk_set_error(DSK_ERR_ARG, "tp_model_init: the model must be external (tz_init binds it)");
    int r = ps->grid.at.pp, P = ps->pp * ps->v;
    ps->first = ps->last = -1;
    int bound[TP_MAX_LAYERS + 1];
    tp_split_layers(cfg, P, bound);
    for (int c = 0; c < ps->v; c++) {
        tp_chunk *ch = &ps->chunks[c];
        ch->stage = dsk_par_stage(ps->kind, ps->pp, c, r);
        ch->lo = bound[ch->stage];
        ch->hi = bound[ch->stage + 1];
        if (ch->stage == 0) ps->first = c;
        if (ch->stage == P - 1) ps->last = c;
    }
    ps->T = cfg->seq;
    ps->Bm = cfg->batch / ps->M;
    ps->Nm = (int64_t)ps->Bm * cfg->seq;
    ps->Ns = ps->Nm / ps->tp;
    ps->D = cfg->d_model;
    ps->Dh = cfg->d_model / cfg->n_heads;
    ps->Hl = cfg->n_heads / ps->tp;
    ps->Dl = ps->Hl * ps->Dh;
    ps->Fl = cfg->ffn_hidden / ps->tp;
    ps->Vl = cfg->vocab / ps->tp;
    ps->embed_copy = cfg->mla.mtp_depth > 0 && ps->pp > 1 && ps->kind != DSK_PAR_DUALPIPE_V; /* the V ends at home */
    if (ps->embed_copy && !ps->embed_group)
        return dsk_set_error(DSK_ERR_ARG, "tp_model_init: --mtp under --pp needs embed_group set before tp_grid_init");
    if (ps->paired) TM_TRY(dsk_par_schedule_init_paired(&ps->sched, ps->kind, ps->pp, ps->M, ps->v, r));
    else TM_TRY(dsk_par_schedule_init(&ps->sched, ps->kind, ps->pp, ps->M, ps->v, r));
    ps->S = ps->sched.in_flight < ps->M ? ps->sched.in_flight : ps->M;
    if (ps->S < 1) ps->S = 1;
    int nb = tm_n_blocks(cfg); /* the MTP blocks after the layers, on the last stage (in the head's part) */
    m->blocks = (tm_block *)calloc((size_t)nb, sizeof *m->blocks);
    ps->layers = (tp_layer *)calloc((size_t)nb, sizeof *ps->layers);
    m->moe_names = (char(*)[32])calloc((size_t)nb, sizeof *m->moe_names);
    if (!m->blocks || !ps->layers || !m->moe_names) return dsk_set_error(DSK_ERR_OOM, "tp_model_init: out of memory");
    for (int l = 0; l < nb; l++) {
        int mtp = l >= cfg->n_layers;
        ps->layers[l].chunk = mtp ? ps->last : tp_chunk_of(ps, l);
        ps->layers[l].on = ps->layers[l].chunk >= 0;
        if (ps->layers[l].on && l >= cfg->n_dense && (!mtp || cfg->mla.mtp_moe)) {
            tm_config mc = *cfg;
            mc.batch = ps->Bm; /* one call: the rank's N/tp tokens of a micro-batch */
            m->cfg = mc;
            TM_TRY(tm_init_moe(m, l, m->moe_names[l], sizeof m->moe_names[l]));
            m->cfg = *cfg;
        }
    }
    tm_declare(m);
    TM_TRY(tp_layout(ps, m));
    for (int i = 0; i < m->n_params; i++) {
        m->numel += tm_param_numel(&m->params[i]);
        if (i < m->n_dense_params) m->numel_dense = m->numel;
    }
    return DSK_OK;
}

/* The model of this rank: like tm_init with cfg->external (the engine binds the weights and
   gradients: tp_places), for the stages and the tensor-parallel shard of the grid.
   ps->tp/pp/v/M/kind and the grid are set. */
static dsk_status tp_model_init(tp_state *ps, tm_model *m, dsk_ctx *ctx, const tm_config *cfg) {
    TM_TRY(tp_model_declare(ps, m, ctx, cfg));
    TM_TRY(tp_alloc_acts(ps));
    /* an MoE layer runs one micro-batch's rows at a time: its workspace is reserved for those (the
       whole batch's, which dsk_plan showed is M x tp too much, would not fit at scale) */
    m->cfg.batch = ps->Bm;
    dsk_status s = tm_bind_moe(m);
    m->cfg.batch = cfg->batch;
    return s;
}

/* The engine's groups and where each of this rank's parameters goes (train_zero.h):
   replicated parameters over the stage (tp x dp), tensor-parallel shards over dp, the MTP
   modules' copy of the embedding with the first stage's (the embedding group), expert shards
   over the stage's ranks holding the same experts (tp x edp), each summed times 1/dp; the part
   is the chunk holding the parameter (the head and the last stage's embedding copy: part v, see
   tp_pass); the box is the rank's part of the full tensor; the counters are the one-rank
   model's. */
static void tp_places(tp_state *ps, tz_group groups[TP_G_COUNT], tz_place *place) {
    tm_model *m = ps->m;
    dsk_comm *comms[TP_G_COUNT] = {&ps->stage, &ps->grid.dp, ps->embg.world_size ? &ps->embg : NULL, &ps->xrep};
    memset(groups, 0, TP_G_COUNT * sizeof *groups);
    for (int g = 0; g < TP_G_COUNT; g++) {
        groups[g].comm = comms[g];
        groups[g].sum_only = 1;
        groups[g].post_scale = 1.0f / (float)ps->dp;
    }
    /* the first stage gathers the embedding as its first forward begins, the last stage its copy once the
       activations arrive: at ZeRO-3 each would wait for the other, so the pair keeps whole weights (stage 2) */
    groups[TP_G_EMBED].stage_cap = 2;
    for (int i = 0; i < m->n_params; i++) {
        const tm_param *p = &m->params[i];
        const tp_pinfo *pi = &ps->pinfo[i];
        tz_place *pl = &place[i];
        int split, l = tp_param_layer(m, p, &split);
        memset(pl, 0, sizeof *pl);
        pl->group = pi->group;
        pl->part = l >= 0 ? tp_chunk_of(ps, l) : p == m->embed && ps->first >= 0 ? ps->first : ps->v; /* the head's */
        pl->init_off = pi->init_off;
        if (pi->split == TP_REPL && pi->group != TP_G_EXPERT) continue;
        for (int d = 0; d < p->ndim; d++) {
            pl->global_shape[d] = pi->full[d];
            pl->offset[d] = pi->off[d];
        }
    }
}

static void tp_free(tp_state *ps) {
    dsk_ctx *ctx = ps->ctx;
    if (ps->layers && ps->m)
        for (int l = 0; l <= tm_n_blocks(&ps->m->cfg); l++) { /* and the recomputed activations' shared slot */
            tp_layer *L = l < tm_n_blocks(&ps->m->cfg) ? &ps->layers[l] : &ps->sh;
            dsk_tensor *ts[] = {&L->x, &L->h1, &L->rstd1, &L->h1g, &L->q, &L->k, &L->v, &L->qr, &L->kr, &L->att,
                                &L->probs, &L->x2, &L->h2, &L->rstd2, &L->h2g, &L->g, &L->u, &L->a};
            for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dsk_tensor_free(ctx, ts[i]);
            tmla_block *p = &L->mla;
            dsk_tensor *ms[] = {&p->cq,      &p->cqn, &p->rstd_q, &p->q, &p->ckv, &p->ckvn,
                                &p->rstd_kv, &p->kpe, &p->kvb,    &p->k, &p->att, &p->lse};
            for (size_t i = 0; i < sizeof ms / sizeof ms[0]; i++) dsk_tensor_free(ctx, ms[i]);
            tf8_act *f8[] = {&L->f8_h1, &L->f8_att, &L->f8_h2, &L->f8_a, &p->f8_cqn, &p->f8_ckvn};
            for (size_t i = 0; i < sizeof f8 / sizeof f8[0]; i++) tf8_act_free(ctx, f8[i]);
        }
    for (int c = 0; c < 16; c++) {
        tp_chunk *ch = &ps->chunks[c];
        dsk_tensor *ts[] = {&ch->in_act, &ch->out_act, &ch->in_grad, &ch->out_grad};
        for (size_t i = 0; i < 4; i++) dsk_tensor_free(ctx, ts[i]);
    }
    dsk_tensor *ts[] = {&ps->dx,  &ps->dh,     &ps->tmp,     &ps->big,  &ps->datt, &ps->dq,  &ps->dk, &ps->dv,
                        &ps->dqr, &ps->dkr,    &ps->dg,      &ps->du,   &ps->da,   &ps->xf,  &ps->hf, &ps->rstdf,
                        &ps->hfg, &ps->logits, &ps->dlogits, &ps->vrow, &ps->dx32, &ps->fdx, &ps->fdh};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dsk_tensor_free(ctx, ts[i]);
    for (int k = 0; k < TMLA_MAX_MTP; k++) dsk_tensor_free(ctx, &ps->mtp_hfg[k]);
    free(ps->layers);
    dsk_par_schedule_free(&ps->sched);
    dsk_comm_free(&ps->embg);
    dsk_comm_free(&ps->xrep);
    dsk_comm_free(&ps->stage);
    dsk_par_grid_free(&ps->grid);
    memset(ps, 0, sizeof *ps);
}

/* ------------------------------------------------------------------ views */

/* Rows [i n, (i + 1) n) of t. */
static dsk_tensor tp_part(const dsk_tensor *t, int64_t i, int64_t n) {
    dsk_tensor v;
    dsk_tensor_slice(t, 0, i * n, n, &v);
    return v;
}

/* Rows of an (Nm, Dl) tensor as (Bm, T, Hl, Dh). */
static dsk_tensor tp_heads(const tp_state *ps, const dsk_tensor *t) {
    int64_t sh[4] = {ps->Bm, ps->T, ps->Hl, ps->Dh};
    dsk_tensor v;
    dsk_tensor_reshape(t, 4, sh, &v);
    return v;
}

/* The sequence-parallel scratch when tp > 1, else NULL (the mappings are identities). */
static dsk_tensor *tp_sp(tp_state *ps, dsk_tensor *t) { return ps->tp > 1 ? t : NULL; }

#include "train/par_run.h" /* one block, MTP, stages, loss, checkpoints */

#endif /* TRAIN_PAR_H */
