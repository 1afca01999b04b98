/* dsk_plan - the layout planner for examples/train_moe.c's model (dsk_plan.h over train_plan.h).

   dsk_plan --cluster FILE --sequences N [--top K] [--json FILE] [--device cpu|cuda] [TRAINER FLAGS]
   dsk_plan --check-rank R --nproc N [TRAINER FLAGS]

   The model is the trainer's: its flags and --preset, or --init-from-hf DIR (a Hugging Face
   config.json; only the file is read). Every layout of the cluster's GPUs is sized by the trainer's
   own code without allocating (train_plan.h) and timed by dsk_plan.h's model; the table lists the
   best, and why the best of each other (tp, pp, ep, ZeRO) lost; --json writes the best as the
   choice `train_moe --plan FILE` runs. --device cuda (the default) sizes the MoE workspace as a GPU
   holds it (the layer's dtype) and makes bf16 the default compute dtype; cpu as the CPU trainer.
   With bf16 compute every layout is also planned with FP8 GEMMs (the trainer's --dtype fp8).

   --check-rank R: the memory train_moe would report for rank R of the layout its flags give
   (--nproc ranks; --tp --pp --ep --zero --micro-batches ...), as lines tests/test_plan.sh reads. */
#define main train_moe_main
#include "train_moe.c"
#undef main
#include "train_plan.h"

/* Stages that hold the same layers have the same memory: one model build answers them all, and
   every ZeRO stage and moments' dtype at once (tpl_rank). The key: the layout but those, and what the rank's
   chunks hold (the first stage's embedding, the last's head, dense and MoE layers). */
typedef struct plan_entry {
    dsk_plan_layout key;
    int first, last, dense, moe;
    dsk_status st;
    char err[256];
    dsk_plan_memory mem[TPL_VARIANTS];
    double reduce[TPL_VARIANTS], gather[TPL_VARIANTS], send, ep[2], tp[TP_TRAFFIC];
    double link[TPL_VARIANTS];
    dsk_plan_flops flops;
} plan_entry;

typedef struct plan_user {
    tm_config base, base_fp8; /* the model of the flags' compute dtype (fp8 taken as bf16), and with --dtype fp8 */
    tz_opts zo; /* --grad-compress */
    int cuda;
    plan_entry *cache;
    int n, cap;
    int split_P, split[TP_MAX_LAYERS + 1]; /* the trainer's split of the layers over split_P stages */
} plan_user;

static void plan_stage_key(plan_user *u, const dsk_plan_layout *l, int stage, plan_entry *e) {
    int P = l->pp * l->vstages;
    memset(e, 0, sizeof *e);
    e->key = *l;
    e->key.zero = 0;
    e->key.moments = DSK_F32;
    if (u->split_P != P && P <= u->base.n_layers && u->base.n_layers <= TP_MAX_LAYERS) {
        tp_split_layers(&u->base, P, u->split);
        u->split_P = P;
    }
    for (int c = 0; c < l->vstages && u->split_P == P; c++) {
        int s = c * l->pp + stage, lo = u->split[s], hi = u->split[s + 1];
        e->first |= s == 0;
        e->last |= s == P - 1;
        for (int k = lo; k < hi; k++) {
            if (k < u->base.n_dense) e->dense++;
            else e->moe++;
        }
    }
}

/* The trainer's tensor-parallel traffic (tpl_tp_traffic) as dsk_plan.h takes it. */
static void plan_tp(const double tr[TP_TRAFFIC], dsk_plan_tp *tp) {
    tp->all_reduce = tr[TP_AR];
    tp->all_gather = tr[TP_AG];
    tp->reduce_scatter = tr[TP_RS];
    tp->calls = tr[TP_CALLS];
}

static dsk_status plan_memory(void *user, const dsk_plan_layout *l, const dsk_plan_job *job, int stage,
                              dsk_plan_memory *mem, double *reduce, double *gather, double *link, double *send,
                              dsk_plan_tp *tp, dsk_plan_flops *flops) {
    plan_user *u = (plan_user *)user;
    plan_entry k, *e = NULL;
    plan_stage_key(u, l, stage, &k);
    for (int i = 0; i < u->n && !e; i++)
        if (!memcmp(&u->cache[i].key, &k.key, sizeof k.key) && u->cache[i].first == k.first &&
            u->cache[i].last == k.last && u->cache[i].dense == k.dense && u->cache[i].moe == k.moe)
            e = &u->cache[i];
    if (!e) {
        if (u->n == u->cap) {
            plan_entry *c = (plan_entry *)realloc(u->cache, (size_t)(u->cap ? 2 * u->cap : 64) * sizeof *c);
            if (!c) return dsk_set_error(DSK_ERR_OOM, "dsk_plan: out of memory");
            u->cache = c;
            u->cap = u->cap ? 2 * u->cap : 64;
        }
        e = &u->cache[u->n++];
        *e = k;
        e->st = tpl_rank(l->fp8 ? &u->base_fp8 : &u->base, &u->zo, u->cuda, l, job, stage, e->mem, e->reduce, e->gather,
                         e->link, &e->send, e->ep, e->tp, &e->flops);
        if (e->st != DSK_OK) snprintf(e->err, sizeof e->err, "%s", dsk_last_error());
    }
    if (e->st != DSK_OK) return dsk_set_error(e->st, "%s", e->err);
    *mem = e->mem[tpl_variant(l)];
    *reduce = e->reduce[tpl_variant(l)];
    *gather = e->gather[tpl_variant(l)];
    *link = e->link[tpl_variant(l)];
    *send = e->send;
    *flops = e->flops;
    plan_tp(e->tp, tp);
    return DSK_OK;
}

/* The trainer's options from argv (planner flags taken out), its model configuration and the
   model's sizes and FLOPs as the trainer counts them. */
static void plan_model(trainer *t, plan_user *u, dsk_plan_model *pm) {
    const options *o = t->o;
    int shards = 0; /* the trainer's vocabulary: token shards (llm.c .bin files) have --vocab, bytes 256 */
    dsk_plan_flops all;
    char dtype[sizeof o->dtype];
    for (int i = 0; i < o->n_data; i++) {
        size_t k = strlen(o->data[i]);
        shards |= k > 4 && !strcmp(o->data[i] + k - 4, ".bin");
    }
    t->data.vocab = o->init_from_hf || shards ? o->vocab : 256;
    t->batch_local = 1;
    t->engine = 1;
    snprintf(dtype, sizeof dtype, "%s", o->dtype); /* the configurations under --dtype fp8 and without */
    snprintf(t->o->dtype, sizeof t->o->dtype, "fp8");
    model_config(t, &u->base_fp8);
    snprintf(t->o->dtype, sizeof t->o->dtype, "%s", strcmp(dtype, "fp8") ? dtype : "bf16");
    model_config(t, &u->base);
    snprintf(t->o->dtype, sizeof t->o->dtype, "%s", dtype);
    t->model.cfg = u->base;
    memset(pm, 0, sizeof *pm);
    snprintf(pm->name, sizeof pm->name, "%s", o->init_from_hf ? o->init_from_hf : o->preset[0] ? o->preset : "tiny");
    pm->layers = o->layers;
    pm->moe_layers = o->layers - o->dense_layers;
    pm->heads = o->heads;
    pm->n_routed = o->experts;
    pm->top_k = o->top_k;
    pm->d_model = o->d_model;
    pm->vocab = t->data.vocab;
    pm->ffn_hidden = o->ffn_hidden;
    all = tpl_stage_flops(&u->base, NULL); /* the trainer's count, tmla_model_flops */
    pm->flops_per_token = all.total;
    pm->attn_flops_per_token = all.attn;
    pm->fp8_flops_per_token = u->base.cdt == DSK_BF16 ? all.fp8 : 0; /* FP8 layouts: bf16 ones */
    pm->act_bytes = dsk_dtype_size(u->base.cdt);
    pm->memory = plan_memory;
    pm->user = u;
}

/* The layout of the trainer's flags at --nproc ranks. */
static int check_layout(const trainer *t, dsk_plan_layout *l, dsk_plan_job *job) {
    const options *o = t->o;
    memset(l, 0, sizeof *l);
    l->moments = moment_dtype(t);
    l->fp8 = !strcmp(o->dtype, "fp8");
    l->tp = o->tp, l->pp = o->pp, l->ep = o->ep, l->zero = o->zero;
    l->dp = o->nproc / (o->tp * o->pp);
    l->micro = o->pp > 1 || o->pair_micro ? o->micro : o->accum;
    l->paired = o->pair_micro;
    if (dsk_par_schedule_parse(o->pp_schedule, &l->schedule) != DSK_OK) return 2;
    l->vstages = pp_chunks(o, l->schedule);
    l->recompute = !strcmp(o->recompute, "full")   ? DSK_PLAN_RECOMPUTE_FULL
                   : !strcmp(o->recompute, "attn") ? DSK_PLAN_RECOMPUTE_ATTN
                                                   : DSK_PLAN_RECOMPUTE_NONE;
    job->seq = o->seq;
    job->sequences = (int64_t)o->batch * (o->pp > 1 ? 1 : o->accum);
    return l->dp >= 1 && l->dp * o->tp * o->pp == o->nproc ? 0 : 2;
}

/* A pipeline's timed schedule: each stage's forward and backward of a micro-batch chunk, and the lists' step. */
static int print_pipeline(const dsk_plan_model *pm, const dsk_plan_cluster *cl, const dsk_plan_job *job,
                          const dsk_plan_layout *l, const dsk_plan_tp *tp, const dsk_plan_flops *stages,
                          double pipe_s) {
    int n = l->pp * (l->vstages > 0 ? l->vstages : 1);
    double *f = (double *)malloc(2 * (size_t)n * sizeof *f);
    if (!f) {
        fprintf(stderr, "dsk_plan: out of memory for %d stages' times\n", n);
        return 1;
    }
    dsk_plan_stage_times(pm, cl, job, l, tp, stages, f, f + n);
    printf("plan pipeline: %.6f s; forward, backward of a micro-batch chunk by stage:", pipe_s);
    for (int s = 0; s < n; s++) printf(" %.9g %.9g", f[s], f[n + s]);
    printf("\n");
    free(f);
    return 0;
}

/* With --cluster: the step time dsk_plan.h's model predicts for the layout (bench/plan_rank.sh). */
static int check_time(const dsk_plan_model *pm, const char *cluster, const dsk_plan_layout *l, const dsk_plan_job *job,
                      const dsk_plan_memory *mem, double link, double send, const double tr[TP_TRAFFIC],
                      const dsk_plan_flops *stages) {
    dsk_plan_cluster cl;
    dsk_plan_result r;
    memset(&r, 0, sizeof r);
    r.layout = *l;
    r.lead_moe_layers = stages[0].moe_layers;
    memcpy(r.lead_chunk_moe_layers, stages[0].chunk_moe_layers, sizeof r.lead_chunk_moe_layers);
    r.mem = *mem;
    r.pp_bytes = send;
    plan_tp(tr, &r.tp);
    if (dsk_plan_cluster_read(&cl, cluster) != DSK_OK) {
        fprintf(stderr, "dsk_plan: %s\n", dsk_last_error());
        return 1;
    }
    if (dsk_plan_stages(pm, &cl, job, stages, &r) != DSK_OK || dsk_plan_time(pm, &cl, job, link, &r) != DSK_OK) {
        fprintf(stderr, "dsk_plan: %s\n", dsk_last_error());
        return 1;
    }
    printf("plan time: step %.6f s: compute %.6f, bubble %.6f, tp %.6f, ep %.6f, pp %.6f, gradients %.6f (exposed "
           "%.6f), optimizer %.6f, shared cores %.6f, ep hidden %.6f\n",
           r.step_s, r.compute_s, r.bubble_s, r.tp_s, r.ep_s, r.pp_s, r.zero_s, r.zero_exposed_s, r.opt_s, r.cores_s,
           r.ep_hidden_s);
    return l->pp > 1 ? print_pipeline(pm, &cl, job, l, &r.tp, stages, r.pipe_s) : 0;
}

/* Prints the FLOPs per token and the MoE layers of every stage of l (the model's callback, as dsk_plan_run asks),
   into stages[0..pp). */
static int check_flops(const dsk_plan_model *pm, const dsk_plan_layout *l, const dsk_plan_job *job,
                       dsk_plan_flops *stages) {
    printf("plan flops per token: model %.9g", pm->flops_per_token);
    for (int s = 0; s < l->pp; s++) {
        dsk_plan_memory mem;
        dsk_plan_tp tp;
        dsk_plan_flops f;
        double rb, gb, lb, sb;
        if (pm->memory(pm->user, l, job, s, &mem, &rb, &gb, &lb, &sb, &tp, &f) != DSK_OK) {
            fprintf(stderr, "\ndsk_plan: %s\n", dsk_last_error());
            return 1;
        }
        printf(", stage %d %.9g", s, f.total);
        stages[s] = f;
    }
    printf("\nplan MoE layers: model %d", pm->moe_layers);
    for (int s = 0; s < l->pp; s++) printf(", stage %d %d", s, stages[s].moe_layers);
    printf("\n");
    return 0;
}

static int check_rank(trainer *t, plan_user *u, const dsk_plan_model *pm, const char *cluster, int rank) {
    const options *o = t->o;
    dsk_plan_layout l;
    dsk_plan_job job;
    dsk_plan_memory mem[TPL_VARIANTS];
    double red[TPL_VARIANTS], gat[TPL_VARIANTS], send, ep[2], tr[TP_TRAFFIC];
    dsk_plan_flops flops, *stages;
    double link[TPL_VARIANTS];
    int v, rc;
    if (check_layout(t, &l, &job) != 0 || rank < 0 || rank >= o->nproc) {
        fprintf(stderr, "dsk_plan: --check-rank %d: --nproc %d must be a multiple of --tp %d x --pp %d\n", rank,
                o->nproc, o->tp, o->pp);
        return 2;
    }
    if (tpl_rank(l.fp8 ? &u->base_fp8 : &u->base, &u->zo, u->cuda, &l, &job, rank / (l.tp * l.dp), mem, red, gat, link,
                 &send, ep, tr, &flops) != DSK_OK) {
        fprintf(stderr, "dsk_plan: %s\n", dsk_last_error());
        return 1;
    }
    v = tpl_variant(&l);
    printf(
        "plan bytes, rank %d: parameters %lld, gradients %lld, optimizer state %lld, compression buffers %lld, "
        "activations %lld, imbalance %lld, reduce per step %.0f, gather per step %.0f, pipeline sends per step %.0f, "
        "ep dispatch per step %.0f, ep combine per step %.0f, tp all-reduce per step %.0f, tp all-gather per step "
        "%.0f, tp reduce-scatter per step %.0f, tp calls per step %.0f, optimizer step %lld\n",
        rank, (long long)mem[v].params, (long long)mem[v].grads, (long long)mem[v].optimizer, (long long)mem[v].comm,
        (long long)mem[v].activations, (long long)mem[v].imbalance, red[v], gat[v], send, ep[0], ep[1], tr[TP_AR],
        tr[TP_AG], tr[TP_RS], tr[TP_CALLS], (long long)mem[v].optimizer_step);
    if (!(stages = (dsk_plan_flops *)calloc((size_t)l.pp, sizeof *stages))) {
        fprintf(stderr, "dsk_plan: out of memory\n");
        return 1;
    }
    rc = check_flops(pm, &l, &job, stages);
    if (rc == 0 && cluster) rc = check_time(pm, cluster, &l, &job, &mem[v], link[v], send, tr, stages);
    free(stages);
    return rc;
}

static int write_json(const char *path, const dsk_plan_result *r, const dsk_plan_job *job) {
    char buf[2048];
    FILE *f;
    if (dsk_plan_json(r, job, buf, sizeof buf) != DSK_OK || !(f = fopen(path, "w"))) {
        fprintf(stderr, "dsk_plan: --json %s: cannot write it\n", path);
        return 1;
    }
    fputs(buf, f);
    return fclose(f) == 0 ? 0 : 1;
}

static int plan(trainer *t, plan_user *u, const char *cluster, int64_t sequences, int top, const char *json) {
    dsk_plan_model pm;
    dsk_plan_cluster cl;
    dsk_plan_job job;
    dsk_plan_result *res = NULL;
    size_t cap = 1 << 20;
    char *buf = (char *)malloc(cap);
    int n = 0, rc = 0;
    plan_model(t, u, &pm);
    job.sequences = sequences;
    job.seq = t->o->seq;
    if (!buf || dsk_plan_cluster_read(&cl, cluster) != DSK_OK ||
        dsk_plan_run(&pm, &cl, &job, NULL, &res, &n) != DSK_OK ||
        dsk_plan_table(res, n, &cl, top, buf, cap) != DSK_OK) {
        fprintf(stderr, "dsk_plan: %s\n", buf ? dsk_last_error() : "out of memory");
        free(buf);
        dsk_plan_results_free(res);
        return 1;
    }
    printf("model %s: %d layers (%d MoE), d_model %lld, %d experts top-%d, %.3g training FLOPs per token; "
           "%lld sequences of %lld tokens per step\n%s",
           pm.name, pm.layers, pm.moe_layers, (long long)pm.d_model, pm.n_routed, pm.top_k, pm.flops_per_token,
           (long long)job.sequences, (long long)job.seq, buf);
    if (!res[0].fits) rc = 3;
    else if (json) rc = write_json(json, &res[0], &job);
    free(buf);
    dsk_plan_results_free(res);
    return rc;
}

int main(int argc, char **argv) {
    options o;
    const char *cluster = NULL, *json = NULL, *device = "cuda";
    long long sequences = 0;
    int top = 8, check = -1, rc, n = 1;
    char **rest = (char **)calloc((size_t)argc + 1, sizeof *rest);
    trainer *t = (trainer *)calloc(1, sizeof *t);
    plan_user u;
    memset(&u, 0, sizeof u);
    if (!rest || !t) return 1;
    rest[0] = argv[0];
    for (int i = 1; i < argc; i++) { /* the planner's flags; the rest are the trainer's */
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v && !strcmp(a, "--cluster")) cluster = argv[++i];
        else if (v && !strcmp(a, "--json")) json = argv[++i];
        else if (v && !strcmp(a, "--sequences")) sequences = atoll(argv[++i]);
        else if (v && !strcmp(a, "--top")) top = atoi(argv[++i]);
        else if (v && !strcmp(a, "--check-rank")) check = atoi(argv[++i]);
        else if (v && !strcmp(a, "--device")) device = argv[++i];
        else rest[n++] = argv[i];
    }
    set_defaults(&o);
    if (apply_preset(&o, n, rest) != 0 || (rc = parse_args(&o, n, rest)) != 0) return 2;
    u.cuda = strcmp(device, "cpu") != 0;
    if (u.cuda && !o.dtype[0]) strcpy(o.dtype, "bf16");
    t->o = &o;
    if (!tz_parse_compress(o.grad_compress, &u.zo)) {
        fprintf(stderr, "dsk_plan: --grad-compress \"%s\": use none, bf16 or powersgd:R[:START]\n", o.grad_compress);
        return 2;
    }
    if (o.init_from_hf) { /* config.json only; the layout is the plan's (the import's refusal of --tp/--pp aside) */
        int tp = o.tp, pp = o.pp;
        o.tp = o.pp = 1;
        hf_options(t);
        o.tp = tp, o.pp = pp;
    }
    if (check >= 0) {
        dsk_plan_model pm;
        plan_model(t, &u, &pm);
        rc = check_rank(t, &u, &pm, cluster, check);
    } else if (!cluster || sequences < 1) {
        fprintf(stderr, "dsk_plan: --cluster FILE and --sequences N (the global batch) are needed (or --check-rank)\n");
        rc = 2;
    } else {
        rc = plan(t, &u, cluster, sequences, top, json);
    }
    free(u.cache);
    free(rest);
    free(t);
    return rc;
}
