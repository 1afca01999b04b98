/* test_zero.c - dsk_zero.h on the host backend: ranks are forked processes over loopback.

   A synthetic model trains in every stage: each parameter element has a quadratic loss per
   sample, 0.5 a (w - t)^2, over a global batch of 24 samples split over the ranks and the
   micro-batches, so its gradients depend on the weights each rank sees (gathered in ZeRO-3,
   rounded to bf16 when the compute dtype is bf16). The parent replays the same training in one
   process, folding the ranks' gradients in rank order in f32 as the host backend does, taking
   norms over the same pieces, and stepping whole tensors with dsk_adamw_step: weights, moments,
   losses, norms and skip decisions must match bit for bit; gradient accumulation in ZeRO-2/3
   (reduced per micro-batch) is also checked against ZeRO-0 within 1e-6 relative. Then: memory
   read from the allocator, a rank killed during a ZeRO-3 gather, bf16 compression against an
   exact f32-accumulation reference, PowerSGD against a float64 implementation of PyTorch's
   powerSGD_hook, checkpoints resumed at another data-parallel size, and the error paths. */
#define _GNU_SOURCE /* MAP_ANONYMOUS */
#include "dsk_zero.h"
#include "tests/dsk_test.h"

#include <signal.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* ------------------------------------------------------------------ rank processes */

/* DSK_TEST_OK as an expression: 1 on success. */
static int tz_ok(dsk_status s, const char *call, int line) {
    if (s == DSK_OK) return 1;
    dsk_test_fail_at(__FILE__, line, "%s returned %s (last error: %s)", call, dsk_status_str(s), dsk_last_error());
    return 0;
}
#define TZ_OK(call) tz_ok((call), #call, __LINE__)

typedef void (*rank_fn)(dsk_comm *c, void *arg);

/* Forks n ranks that init a host communicator on a fresh port, run fn and exit 1 if a check
   failed. status[r]: exit code (128 + signal). Returns 1 if every rank exited 0. */
static int run_ranks(int n, double timeout_s, rank_fn fn, void *arg, int *status) {
    pid_t pid[8];
    dsk_comm_opts o;
    int port = 0, ok = 1, left = n;
    double t0 = dsk_test_now();
    if (dsk_comm_free_port("127.0.0.1", &port) != DSK_OK) {
        dsk_test_fail_at(__FILE__, __LINE__, "no free port: %s", dsk_last_error());
        return 0;
    }
    memset(&o, 0, sizeof o);
    o.backend = DSK_COMM_HOST;
    o.timeout_s = timeout_s;
    o.master_addr = "127.0.0.1";
    o.master_port = port;
    fflush(stdout);
    for (int r = 0; r < n; r++) {
        pid[r] = fork();
        if (pid[r] == 0) {
            dsk_comm c;
            int before = dsk_test_g.checks_failed_total;
            dsk_status st = dsk_comm_init(&c, r, n, &o);
            if (st != DSK_OK) dsk_test_fail_at(__FILE__, __LINE__, "rank %d: dsk_comm_init: %s", r, dsk_last_error());
            else {
                fn(&c, arg);
                dsk_comm_free(&c);
            }
            fflush(stdout);
            _exit(dsk_test_g.checks_failed_total > before ? 1 : 0);
        }
        status[r] = -1;
    }
    while (left > 0) {
        for (int r = 0; r < n; r++) {
            int st;
            if (status[r] != -1 || waitpid(pid[r], &st, WNOHANG) != pid[r]) continue;
            status[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
            left--;
        }
        if (left && dsk_test_now() - t0 > 120) {
            for (int r = 0; r < n; r++)
                if (status[r] == -1) kill(pid[r], SIGKILL);
            dsk_test_fail_at(__FILE__, __LINE__, "ranks still running after 120 s were killed (a hang)");
            t0 = 1e30;
        }
        if (left) {
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
        }
    }
    for (int r = 0; r < n; r++) ok &= status[r] == 0;
    return ok;
}

static void expect_ranks_ok(int n, rank_fn fn, void *arg) {
    int status[8];
    if (!run_ranks(n, 30, fn, arg, status))
        for (int r = 0; r < n; r++)
            DSK_TEST_EXPECT(status[r] == 0, "rank %d of %d exited with status %d", r, n, status[r]);
}

/* Memory every forked rank can write and the parent read. */
static void *shared_alloc(size_t bytes) {
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        dsk_test_fail_at(__FILE__, __LINE__, "mmap of %zu bytes failed", bytes);
        return NULL;
    }
    memset(p, 0, bytes);
    return p;
}

/* ------------------------------------------------------------------ the synthetic model */

typedef struct pspec { const char *name; int ndim; int64_t shape[3]; int unit, no_decay; } pspec;

/* Units of 104, 392, 512, 112 and 1 elements: odd chunks at 3 and 4 ranks, small tensors that
   sit in one rank's chunk, a 3-D tensor, a unit of which every rank but one holds nothing. */
static const pspec k_model[] = {
    {"embed", 2, {13, 8, 0}, 0, 0},
    {"b0.ln", 1, {8, 0, 0}, 1, 1},   {"b0.w1", 2, {24, 8, 0}, 1, 0}, {"b0.w2", 2, {8, 24, 0}, 1, 0},
    {"b1.ln", 1, {8, 0, 0}, 2, 1},   {"b1.w1", 2, {24, 8, 0}, 2, 0}, {"b1.experts", 3, {3, 5, 8}, 2, 0},
    {"b1.w2", 2, {8, 24, 0}, 2, 0},  {"head.ln", 1, {8, 0, 0}, 3, 1}, {"head.w", 2, {13, 8, 0}, 3, 0},
    {"tail", 1, {1, 0, 0}, 4, 1},
};
#define NP ((int)(sizeof k_model / sizeof k_model[0]))
#define NU 5
#define BATCH 24
#define MAX_STEPS 8

static uint64_t g_seed;

/* Uniform in [lo, hi) from (tag, a, b, c), as f32. */
static float hashf(uint64_t tag, uint64_t a, uint64_t b, uint64_t c, float lo, float hi) {
    uint64_t u =
        dsk_test_mix64(g_seed ^ dsk_test_mix64(tag * 1000003u + a) ^ dsk_test_mix64(b * 7919u + c * 104729u + 17u));
    return lo + (hi - lo) * (float)((double)(u >> 11) * (1.0 / 9007199254740992.0));
}

static int64_t p_numel(int p) {
    int64_t n = 1;
    for (int d = 0; d < k_model[p].ndim; d++) n *= k_model[p].shape[d];
    return n;
}
static int64_t g_off[NP + 1]; /* offsets of the parameters in one flat array of the whole model */

/* Copies a checkpoint box entry into the flat row-major array of its global tensor (of shape
   sh, which the entry must name), element by element. */
static void box_scatter(const dsk_ckpt_entry *e, int nd, const int64_t *sh, float *dst) {
    const dsk_tensor *t = e->tensor;
    int64_t n = dsk_tensor_numel(t);
    int ok = e->split == DSK_CKPT_BOX && t->ndim == nd && (t->dtype == DSK_F32 || t->dtype == DSK_BF16) &&
             dsk_tensor_is_contiguous(t);
    for (int d = 0; ok && d < nd; d++) ok = e->global_shape[d] == sh[d] && e->offset[d] + t->shape[d] <= sh[d];
    DSK_TEST_EXPECT(ok, "%s: a contiguous f32 or bf16 box of the parameter's global shape", e->name);
    for (int64_t i = 0; ok && i < n; i++) {
        int64_t rest = i, at = 0;
        for (int d = nd - 1, stride = 1; d >= 0; d--) {
            at += (e->offset[d] + rest % t->shape[d]) * stride;
            rest /= t->shape[d];
            stride *= (int)sh[d];
        }
        dst[at] = dsk_load_f32(t->data, t->dtype, i);
    }
}

static float w_init(int p, int64_t i) { return hashf(1, (uint64_t)p, (uint64_t)i, 0, -1.0f, 1.0f); }
static float a_of(int p, int s, int64_t i) { return hashf(2, (uint64_t)p, (uint64_t)s, (uint64_t)i, 0.5f, 1.5f); }
static float t_of(int p, int s, int64_t i) { return hashf(3, (uint64_t)p, (uint64_t)s, (uint64_t)i, -1.0f, 1.0f); }

/* One training configuration. */
typedef struct tcfg {
    int n, stage, accum, steps, first_step; /* first_step: steps already applied (a resume) */
    dsk_dtype cdt;
    dsk_dtype mdt;      /* AdamW moments (f32 when zeroed) */
    float scale;        /* static loss scale; 0: none */
    float clip;         /* max global norm; 0: none */
    int nan_step;       /* step (1-based) at which the last rank's gradient gets a NaN; 0: never */
    dsk_zero_compress compress;
    const char *save_dir, *load_dir; /* checkpoint after the last step / before the first */
} tcfg;

/* What a run leaves: whole-model master weights and moments, the compute weights forward read
   at the end, per step and rank the loss, norm, clip multiplier and skip flag. */
typedef struct tresult {
    float master[1200], m[1200], v[1200], value[1200];
    double loss[MAX_STEPS][4], norm[MAX_STEPS][4];
    float mult[MAX_STEPS][4];
    int skip[MAX_STEPS][4];
    int64_t opt_bytes[4]; /* each rank's optimizer state (dsk_zero_memory) */
} tresult;

static dsk_adamw_opts adamw_opts(void) {
    dsk_adamw_opts o = dsk_adamw_defaults();
    o.lr = 2e-2f;
    o.beta1 = 0.9f;
    o.beta2 = 0.95f;
    o.weight_decay = 0.1f;
    return o;
}

/* Samples [s0, s1) of micro-batch mb on rank r. */
static void mb_samples(const tcfg *c, int r, int mb, int *s0, int *s1) {
    int per_rank = BATCH / c->n, per_mb = per_rank / c->accum;
    *s0 = r * per_rank + mb * per_mb;
    *s1 = *s0 + per_mb;
}

/* The backward of parameter p on rank r, micro-batch mb: grad += (sum over samples of
   a (v - t)) / samples-per-rank * scale, in this order, in f32; v the compute weights. */
static void grad_into(const tcfg *c, int p, int r, int mb, const float *v, float *grad, int step) {
    int s0, s1;
    float inv = 1.0f / (float)(BATCH / c->n), sc = c->scale > 0 ? c->scale : 1.0f;
    mb_samples(c, r, mb, &s0, &s1);
    for (int64_t i = 0; i < p_numel(p); i++) {
        float acc = 0.0f;
        for (int s = s0; s < s1; s++) acc += a_of(p, s, i) * (v[i] - t_of(p, s, i));
        grad[i] += acc * inv * sc;
    }
    if (step == c->nan_step && r == c->n - 1 && p == 5 && mb == c->accum - 1) grad[3] = NAN;
}

/* The loss rank r's micro-batch mb adds, in f64, a fixed order. */
static double loss_of(const tcfg *c, int p, int r, int mb, const float *v) {
    int s0, s1;
    double l = 0;
    mb_samples(c, r, mb, &s0, &s1);
    for (int64_t i = 0; i < p_numel(p); i++)
        for (int s = s0; s < s1; s++) {
            double d = (double)v[i] - (double)t_of(p, s, i);
            l += 0.5 * (double)a_of(p, s, i) * d * d;
        }
    return l;
}

/* A parameter's compute weights as f32 (bf16 widened). */
static void value_f32(const dsk_tensor *t, float *out) {
    for (int64_t i = 0; i < dsk_tensor_numel(t); i++) out[i] = dsk_load_f32(t->data, t->dtype, i);
}

/* ---- one rank's training */

typedef struct train_arg { tcfg c; tresult *res; } train_arg;

static dsk_status ck_barrier(void *u) { return dsk_comm_barrier((dsk_comm *)u, NULL); }

static void zero_params(dsk_zero_param *ps, dsk_tensor *vals, dsk_tensor *grads) {
    memset(ps, 0, NP * sizeof *ps);
    for (int p = 0; p < NP; p++) {
        ps[p].name = k_model[p].name;
        ps[p].ndim = k_model[p].ndim;
        for (int d = 0; d < k_model[p].ndim; d++) ps[p].shape[d] = k_model[p].shape[d];
        ps[p].value = &vals[p];
        ps[p].grad = &grads[p];
        ps[p].unit = k_model[p].unit;
        ps[p].no_decay = k_model[p].no_decay;
    }
}

static void rank_train(dsk_comm *comm, void *argp) {
    train_arg *a = (train_arg *)argp;
    const tcfg *c = &a->c;
    tresult *res = a->res;
    int r = comm ? comm->rank : 0;
    dsk_zero_param ps[NP];
    dsk_tensor vals[NP], grads[NP];
    dsk_zero z;
    dsk_zero *zp = &z;
    dsk_zero_opts o;
    dsk_amp_scaler sc;
    dsk_amp_scaler_opts so;
    dsk_adamw_opts ao = adamw_opts();
    int64_t applied = c->first_step;
    float v[200];
    zero_params(ps, vals, grads);
    memset(&o, 0, sizeof o);
    o.stage = c->stage;
    o.compute_dtype = c->cdt;
    o.moment_dtype = c->mdt;
    o.compress = c->compress;
    if (!TZ_OK(dsk_zero_init(&z, comm, NULL, ps, NP, &o))) return;
    res->opt_bytes[r] = z.memory.optimizer;
    memset(&so, 0, sizeof so);
    so.mode = c->scale > 0 ? DSK_AMP_STATIC : DSK_AMP_NONE;
    so.init_scale = c->scale;
    DSK_TEST_OK(dsk_amp_scaler_init(&sc, NULL, &so));
    if (c->load_dir) {
        dsk_ckpt ck;
        dsk_ckpt_opts co;
        const dsk_ckpt_entry *e;
        int ne;
        memset(&co, 0, sizeof co);
        co.rank = r;
        co.world_size = c->n;
        co.barrier = ck_barrier;
        co.barrier_user = comm;
        DSK_TEST_OK(dsk_ckpt_init(&ck, c->load_dir, &co));
        DSK_TEST_OK(dsk_zero_ckpt_entries(&z, NULL, DSK_ZERO_CKPT_LOAD, &e, &ne));
        DSK_TEST_OK(dsk_ckpt_load(&ck, -1, e, ne, NULL));
        dsk_ckpt_free(&ck);
    } else {
        for (int p = 0; p < NP; p++) {
            dsk_zero_piece pc;
            DSK_TEST_OK(dsk_zero_get_piece(&z, p, &pc));
            for (int64_t i = 0; i < pc.count; i++) ((float *)pc.master.data)[i] = w_init(p, pc.first + i);
        }
    }
    DSK_TEST_OK(dsk_zero_refresh(&z, NULL));
    for (int step = 1; step <= c->steps; step++) {
        double loss = 0;
        dsk_amp_decision dec;
        for (int mb = 0; mb < c->accum; mb++) {
            for (int u = 0; u < NU; u++) {
                DSK_TEST_OK(dsk_zero_forward_begin(&z, NULL, u));
                for (int p = 0; p < NP; p++)
                    if (k_model[p].unit == u) {
                        value_f32(&vals[p], v);
                        loss += loss_of(c, p, r, mb, v);
                    }
                if (u < NU - 1) DSK_TEST_OK(dsk_zero_forward_end(&z, NULL, u)); /* the last stays for backward */
            }
            DSK_TEST_OK(dsk_zero_begin(&z, NULL, mb == c->accum - 1));
            for (int u = NU - 1; u >= 0; u--) {
                DSK_TEST_OK(dsk_zero_backward_begin(&z, NULL, u));
                for (int p = NP - 1; p >= 0; p--)
                    if (k_model[p].unit == u) {
                        value_f32(&vals[p], v);
                        grad_into(c, p, r, mb, v, (float *)grads[p].data, c->first_step + step);
                        DSK_TEST_OK(dsk_zero_grad_ready(&z, NULL, p));
                    }
                DSK_TEST_OK(dsk_zero_backward_end(&z, NULL, u));
            }
        } /* the next micro-batch's begin ends this pass; its reductions go on meanwhile */
        DSK_TEST_OK(dsk_zero_wait(&z, NULL));
        DSK_TEST_OK(dsk_zero_unscale_decide(&zp, 1, &sc, comm, NULL, c->clip, &dec));
        DSK_TEST_OK(dsk_zero_step(&z, NULL, &ao, applied + 1, &dec));
        if (!dec.skip) applied++;
        DSK_TEST_OK(dsk_amp_update(&sc, NULL));
        res->loss[step - 1][r] = loss;
        res->norm[step - 1][r] = dec.norm;
        res->mult[step - 1][r] = dec.grad_mult;
        res->skip[step - 1][r] = dec.skip;
    }
    { /* this rank's pieces of the optimizer state, through the checkpoint entries */
        const dsk_ckpt_entry *e;
        int ne;
        DSK_TEST_OK(dsk_zero_ckpt_entries(&z, NULL, DSK_ZERO_CKPT_SAVE, &e, &ne));
        for (int k = 0; k < ne; k++) {
            int p = 0, role = strstr(e[k].name, ".adam_m") ? 1 : strstr(e[k].name, ".adam_v") ? 2 : 0;
            float *dst;
            while (strncmp(e[k].name, k_model[p].name, strlen(k_model[p].name)) != 0 ||
                   (e[k].name[strlen(k_model[p].name)] != 0 && e[k].name[strlen(k_model[p].name)] != '.'))
                p++;
            dst = (role == 0 ? res->master : role == 1 ? res->m : res->v) + g_off[p];
            box_scatter(&e[k], k_model[p].ndim, k_model[p].shape, dst);
        }
        if (c->save_dir) {
            dsk_ckpt ck;
            dsk_ckpt_opts co;
            memset(&co, 0, sizeof co);
            co.rank = r;
            co.world_size = c->n;
            co.barrier = ck_barrier;
            co.barrier_user = comm;
            DSK_TEST_OK(dsk_ckpt_init(&ck, c->save_dir, &co));
            DSK_TEST_OK(dsk_ckpt_save(&ck, c->first_step + c->steps, e, ne, NULL, 0));
            dsk_ckpt_free(&ck);
        }
    }
    for (int u = 0; u < NU; u++) { /* the weights a forward reads now */
        DSK_TEST_OK(dsk_zero_forward_begin(&z, NULL, u));
        for (int p = 0; p < NP; p++)
            if (k_model[p].unit == u && r == 0) value_f32(&vals[p], res->value + g_off[p]);
        DSK_TEST_OK(dsk_zero_forward_end(&z, NULL, u));
    }
    dsk_amp_scaler_free(&sc, NULL);
    dsk_zero_free(&z, NULL);
    DSK_TEST_EXPECT(vals[0].data == NULL && grads[0].data == NULL, "views still bound after dsk_zero_free");
}

/* ---- the single-process replay */

/* Chunk of each unit at n ranks and this rank's piece [*a, *b) of parameter p. */
static void ref_piece(int n, int r, int p, int64_t *a, int64_t *b) {
    int64_t uoff = 0, unum = 0, c, lo, hi;
    for (int q = 0; q < NP; q++) {
        if (k_model[q].unit != k_model[p].unit) continue;
        if (q < p) uoff += p_numel(q);
        unum += p_numel(q);
    }
    c = (unum + n - 1) / n;
    lo = r * c - uoff;
    hi = lo + c;
    *a = lo < 0 ? 0 : lo;
    *b = hi > p_numel(p) ? p_numel(p) : hi;
    if (*b < *a) *a = *b = 0;
}

static void round_to(dsk_dtype dt, const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = dsk_round_f32(dt, x[i]);
}

/* Replays cfg c on the state (master, m, v, applied) in res, appending to its per-step records. */
static void ref_train(const tcfg *c, tresult *res, int64_t *applied) {
    static float g[4][1200], red[1200], v[1200], mom[2][1200];
    dsk_amp_scaler sc;
    dsk_amp_scaler_opts so;
    dsk_adamw_opts ao = adamw_opts();
    int n = c->n;
    memset(&so, 0, sizeof so);
    so.mode = c->scale > 0 ? DSK_AMP_STATIC : DSK_AMP_NONE;
    so.init_scale = c->scale;
    dsk_amp_scaler_init(&sc, NULL, &so);
    for (int step = 1; step <= c->steps; step++) {
        dsk_amp_stats tot;
        dsk_amp_decision dec;
        int gstep = c->first_step + step;
        round_to(c->cdt, res->master, v, g_off[NP]);
        memset(red, 0, sizeof red);
        memset(g, 0, sizeof g);
        for (int mb = 0; mb < c->accum; mb++) {
            for (int r = 0; r < n; r++) {
                if (c->stage >= 2) memset(g[r], 0, sizeof g[r]);
                for (int p = 0; p < NP; p++) grad_into(c, p, r, mb, v + g_off[p], g[r] + g_off[p], gstep);
            }
            if (c->stage >= 2 || mb == c->accum - 1) /* a reduction: rank order in f32, then / n */
                for (int64_t i = 0; i < g_off[NP]; i++) {
                    float s = g[0][i];
                    for (int r = 1; r < n; r++) s += g[r][i];
                    s = s / (float)n;
                    red[i] = c->stage >= 2 && mb > 0 ? red[i] + s : s;
                }
        }
        /* the losses, summed in the order the ranks' forward passes go */
        for (int r = 0; r < n; r++) {
            double l = 0;
            for (int mb = 0; mb < c->accum; mb++)
                for (int u = 0; u < NU; u++)
                    for (int p = 0; p < NP; p++)
                        if (k_model[p].unit == u) l += loss_of(c, p, r, mb, v + g_off[p]);
            res->loss[step - 1][r] = l;
        }
        memset(&tot, 0, sizeof tot);
        for (int r = 0; r < n; r++) { /* each rank's pieces, their stats folded in rank order */
            dsk_tensor views[NP], *list[NP];
            dsk_amp_stats st;
            int k = 0;
            memset(&st, 0, sizeof st);
            for (int p = 0; p < NP; p++) {
                int64_t a, b;
                ref_piece(n, r, p, &a, &b);
                if (b <= a) continue;
                dsk_tensor_wrap(&views[k], red + g_off[p] + a, DSK_F32, dsk_cpu(), 1, &(int64_t){b - a});
                list[k] = &views[k];
                k++;
            }
            dsk_amp_unscale(&sc, NULL, list, k);
            dsk_amp_stats_get(&sc, NULL, &st);
            tot.found_inf = r ? tot.found_inf + st.found_inf : st.found_inf;
            tot.sumsq = r ? tot.sumsq + st.sumsq : st.sumsq;
        }
        dsk_amp_stats_set(&sc, NULL, &tot);
        dec = dsk_amp_decide(tot, c->clip);
        for (int r = 0; r < n; r++) {
            res->norm[step - 1][r] = dec.norm;
            res->mult[step - 1][r] = dec.grad_mult;
            res->skip[step - 1][r] = dec.skip;
        }
        if (!dec.skip) {
            for (int p = 0; p < NP; p++) {
                dsk_tensor w, gr, m, vv;
                int64_t np = p_numel(p);
                dsk_adamw_opts po = ao;
                if (k_model[p].no_decay) po.weight_decay = 0;
                dsk_tensor_wrap(&w, res->master + g_off[p], DSK_F32, dsk_cpu(), 1, &np);
                dsk_tensor_wrap(&gr, red + g_off[p], DSK_F32, dsk_cpu(), 1, &np);
                for (int64_t i = 0; i < np; i++) { /* the moments in their dtype (bf16: exact in res) */
                    dsk_store_f32(mom[0], c->mdt, i, res->m[g_off[p] + i]);
                    dsk_store_f32(mom[1], c->mdt, i, res->v[g_off[p] + i]);
                }
                dsk_tensor_wrap(&m, mom[0], c->mdt, dsk_cpu(), 1, &np);
                dsk_tensor_wrap(&vv, mom[1], c->mdt, dsk_cpu(), 1, &np);
                dsk_adamw_step(NULL, &w, &gr, &m, &vv, &po, *applied + 1, dec.grad_mult, NULL);
                for (int64_t i = 0; i < np; i++) {
                    res->m[g_off[p] + i] = dsk_load_f32(mom[0], c->mdt, i);
                    res->v[g_off[p] + i] = dsk_load_f32(mom[1], c->mdt, i);
                }
            }
            (*applied)++;
        }
        dsk_amp_update(&sc, NULL);
    }
    round_to(c->cdt, res->master, res->value, g_off[NP]);
    dsk_amp_scaler_free(&sc, NULL);
}

/* Fresh reference state: the initial weights, zero moments. */
static void ref_init(tresult *res) {
    memset(res, 0, sizeof *res);
    for (int p = 0; p < NP; p++)
        for (int64_t i = 0; i < p_numel(p); i++) res->master[g_off[p] + i] = w_init(p, i);
}

static void expect_same_f32(const float *got, const float *want, int64_t n, const char *what) {
    for (int64_t i = 0; i < n; i++)
        if (memcmp(&got[i], &want[i], sizeof(float)) != 0) {
            int p = 0;
            while (g_off[p + 1] <= i) p++;
            dsk_test_fail_at(__FILE__, __LINE__, "%s: element %lld (%s[%lld]) is %.9g, want %.9g bit for bit", what,
                             (long long)i, k_model[p].name, (long long)(i - g_off[p]), (double)got[i], (double)want[i]);
            return;
        }
}

/* Weights, moments, forward weights, losses, norms, multipliers and skips bit for bit. */
static void expect_result(const tresult *got, const tresult *want, int n, int steps, const char *what) {
    char b[160];
    snprintf(b, sizeof b, "%s master", what); expect_same_f32(got->master, want->master, g_off[NP], b);
    snprintf(b, sizeof b, "%s adam_m", what); expect_same_f32(got->m, want->m, g_off[NP], b);
    snprintf(b, sizeof b, "%s adam_v", what); expect_same_f32(got->v, want->v, g_off[NP], b);
    snprintf(b, sizeof b, "%s forward weights", what); expect_same_f32(got->value, want->value, g_off[NP], b);
    for (int s = 0; s < steps; s++)
        for (int r = 0; r < n; r++) {
            DSK_TEST_EXPECT(got->loss[s][r] == want->loss[s][r], "%s step %d rank %d loss %.17g, want %.17g", what,
                            s + 1, r, got->loss[s][r], want->loss[s][r]);
            DSK_TEST_EXPECT(got->norm[s][r] == want->norm[s][r] || (got->norm[s][r] != got->norm[s][r] &&
                                                                    want->norm[s][r] != want->norm[s][r]),
                            "%s step %d rank %d norm %.17g, want %.17g", what, s + 1, r, got->norm[s][r],
                            want->norm[s][r]);
            DSK_TEST_EXPECT(got->mult[s][r] == want->mult[s][r] && got->skip[s][r] == want->skip[s][r],
                            "%s step %d rank %d clip x%.9g skip %d, want x%.9g skip %d", what, s + 1, r,
                            (double)got->mult[s][r], got->skip[s][r], (double)want->mult[s][r], want->skip[s][r]);
        }
}

static tresult *g_res; /* shared with the ranks */

/* Without a communicator: a group of one rank, in this process (the n = 1 replay). */
static void case_alone(int stage) {
    static tresult want;
    train_arg a;
    int64_t applied = 0;
    dsk_test_begin("ZeRO-%d without a communicator (one rank alone): equals the replay bit for bit", stage);
    memset(&a, 0, sizeof a);
    a.c.n = 1; a.c.stage = stage; a.c.accum = 2; a.c.steps = 4; a.c.cdt = DSK_BF16; a.c.clip = 0.5f;
    a.res = g_res;
    memset(g_res, 0, sizeof *g_res);
    rank_train(NULL, &a);
    ref_init(&want);
    ref_train(&a.c, &want, &applied);
    expect_result(g_res, &want, 1, a.c.steps, "alone");
    dsk_test_end();
}

static void run_train(const tcfg *c) {
    train_arg a;
    memset(g_res, 0, sizeof *g_res);
    a.c = *c;
    a.res = g_res;
    expect_ranks_ok(c->n, rank_train, &a);
}

/* Every stage at n ranks against the replay, bit for bit. */
static void case_train(int n, int stage, dsk_dtype cdt, float scale, float clip, int nan_step) {
    static tresult want;
    tcfg c;
    int64_t applied = 0;
    memset(&c, 0, sizeof c);
    c.n = n; c.stage = stage; c.accum = 1; c.steps = 5; c.cdt = cdt; c.scale = scale; c.clip = clip;
    c.nan_step = nan_step;
    dsk_test_begin("ZeRO-%d, %d rank%s, %s weights%s%s%s: 5 steps equal the unsharded replay bit for bit", stage, n,
                   n > 1 ? "s" : "", dsk_dtype_name(cdt), scale > 0 ? ", loss scale" : "", clip > 0 ? ", clipping" : "",
                   nan_step ? ", a NaN skips step 3 on every rank" : "");
    run_train(&c);
    ref_init(&want);
    ref_train(&c, &want, &applied);
    expect_result(g_res, &want, n, c.steps, "result");
    if (clip > 0) DSK_TEST_EXPECT(g_res->mult[0][0] < 1.0f, "clipping never engaged (x%g)", (double)g_res->mult[0][0]);
    if (nan_step) {
        for (int r = 0; r < n; r++) DSK_TEST_EXPECT(g_res->skip[nan_step - 1][r] == 1, "rank %d did not skip", r);
        DSK_TEST_EXPECT(g_res->skip[0][0] == 0, "step 1 skipped");
    }
    dsk_test_end();
}

/* bf16 AdamW moments (moment_dtype): every stage against the replay with bf16 moments bit for bit,
   and the optimizer state of an f32 model at stages 0-2 (moments only) half that of f32 moments. */
static void case_moments(int n, int stage) {
    static tresult want;
    tcfg c;
    int64_t applied = 0, f32_bytes[4];
    memset(&c, 0, sizeof c);
    c.n = n;
    c.stage = stage;
    c.accum = 1;
    c.steps = 4;
    c.cdt = DSK_F32;
    c.clip = 0.5f;
    dsk_test_begin("ZeRO-%d, %d ranks, bf16 moments: 4 steps equal the replay bit for bit; optimizer bytes halve",
                   stage, n);
    run_train(&c);
    memcpy(f32_bytes, g_res->opt_bytes, sizeof f32_bytes);
    c.mdt = DSK_BF16;
    run_train(&c);
    ref_init(&want);
    ref_train(&c, &want, &applied);
    expect_result(g_res, &want, n, c.steps, "bf16 moments");
    for (int r = 0; r < n; r++)
        DSK_TEST_EXPECT(f32_bytes[r] > 0 && g_res->opt_bytes[r] * 2 == f32_bytes[r],
                        "rank %d optimizer state %lld bytes with bf16 moments, %lld with f32", r,
                        (long long)g_res->opt_bytes[r], (long long)f32_bytes[r]);
    dsk_test_end();
}

/* Gradient accumulation: stages 0-1 reduce once per step and match the replay bit for bit;
   stages 2-3 reduce per micro-batch (their own replay bit for bit, ZeRO-0 within 1e-6). */
static void case_accum(int n) {
    static tresult want, zero0;
    dsk_test_begin("gradient accumulation (2 micro-batches), %d ranks: stages 0-3 against their replays, 2-3 "
                   "within 1e-6 of ZeRO-0", n);
    for (int stage = 0; stage < 4; stage++) {
        tcfg c;
        int64_t applied = 0;
        char what[64];
        memset(&c, 0, sizeof c);
        c.n = n; c.stage = stage; c.accum = 2; c.steps = 4; c.cdt = DSK_F32; c.clip = 0.5f;
        run_train(&c);
        ref_init(&want);
        ref_train(&c, &want, &applied);
        snprintf(what, sizeof what, "stage %d", stage);
        expect_result(g_res, &want, n, c.steps, what);
        if (stage == 0) zero0 = *g_res;
        else {
            double d2 = 0, w2 = 0, worst = 0;
            for (int64_t i = 0; i < g_off[NP]; i++) {
                double d = (double)g_res->master[i] - (double)zero0.master[i];
                d2 += d * d;
                w2 += (double)zero0.master[i] * zero0.master[i];
                if (fabs(d) > worst) worst = fabs(d);
            }
            DSK_TEST_EXPECT(sqrt(d2) <= 1e-6 * sqrt(w2), "stage %d master weights differ from ZeRO-0 by %.3g "
                            "relative (norm)", stage, sqrt(d2 / w2));
            printf("     stage %d vs ZeRO-0: relative difference %.3g (norm), largest %.3g\n", stage, sqrt(d2 / w2),
                   worst);
        }
    }
    dsk_test_end();
}

/* ------------------------------------------------------------------ checkpoints across sizes */

static char g_tmp[256];

static void rm_rf(const char *path) {
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
    if (system(cmd) != 0) dsk_test_fail_at(__FILE__, __LINE__, "%s failed", cmd);
}

/* Trains 3 steps at n1 ranks in stage s1, saves, resumes at n2 ranks in stage s2 for 3 more:
   the result equals the replay that switches sizes at step 3 (an unsharded resume), bit for bit. */
static void case_resume(int n1, int s1, int n2, int s2) {
    static tresult want;
    char dir[300];
    tcfg c;
    int64_t applied = 0;
    dsk_test_begin("checkpoint of ZeRO-%d at %d ranks resumed by ZeRO-%d at %d ranks: continues as the unsharded "
                   "resume, bit for bit", s1, n1, s2, n2);
    snprintf(dir, sizeof dir, "%s/resume_%d_%d", g_tmp, n1, n2);
    rm_rf(dir);
    memset(&c, 0, sizeof c);
    c.n = n1; c.stage = s1; c.accum = 1; c.steps = 3; c.cdt = DSK_BF16; c.clip = 0.5f; c.save_dir = dir;
    run_train(&c);
    ref_init(&want);
    ref_train(&c, &want, &applied);
    expect_result(g_res, &want, n1, 3, "before the save");
    c.n = n2; c.stage = s2; c.first_step = 3; c.save_dir = NULL; c.load_dir = dir;
    run_train(&c);
    ref_train(&c, &want, &applied);
    expect_result(g_res, &want, n2, 3, "after the resume");
    rm_rf(dir);
    dsk_test_end();
}

/* ------------------------------------------------------------------ memory */

/* Units of 3 x (96 x 96) + 96 elements: big enough that the shares show. */
#define MEM_UNITS 6
typedef struct mem_res { dsk_zero_memory m[4]; int64_t delta[4], largest_unit[4]; } mem_res;
typedef struct mem_arg { int stage; mem_res *out; } mem_arg;

static void rank_memory(dsk_comm *comm, void *argp) {
    mem_arg *a = (mem_arg *)argp;
    dsk_zero_param ps[4 * MEM_UNITS];
    dsk_tensor vals[4 * MEM_UNITS], grads[4 * MEM_UNITS];
    dsk_zero z;
    dsk_zero_opts o;
    int64_t before, after;
    memset(ps, 0, sizeof ps);
    for (int u = 0, k = 0; u < MEM_UNITS; u++)
        for (int j = 0; j < 4; j++, k++) {
            static char names[4 * MEM_UNITS][32];
            snprintf(names[k], sizeof names[k], "l%d.p%d", u, j);
            ps[k].name = names[k];
            ps[k].ndim = j == 0 ? 1 : 2;
            ps[k].shape[0] = 96;
            ps[k].shape[1] = 96;
            ps[k].value = &vals[k];
            ps[k].grad = &grads[k];
            ps[k].unit = u;
        }
    memset(&o, 0, sizeof o);
    o.stage = a->stage;
    o.compute_dtype = DSK_BF16;
    before = dsk_tensor_mem_stats(dsk_cpu()).live_bytes;
    if (!TZ_OK(dsk_zero_init(&z, comm, NULL, ps, 4 * MEM_UNITS, &o))) return;
    after = dsk_tensor_mem_stats(dsk_cpu()).live_bytes;
    a->out->m[comm->rank] = z.memory;
    a->out->delta[comm->rank] = after - before;
    a->out->largest_unit[comm->rank] = 96 + 3 * 96 * 96;
    dsk_zero_free(&z, NULL);
    DSK_TEST_EXPECT(dsk_tensor_mem_stats(dsk_cpu()).live_bytes == before, "dsk_zero_free left %lld bytes",
                    (long long)(dsk_tensor_mem_stats(dsk_cpu()).live_bytes - before));
}

/* Per-rank memory at 4 ranks against the whole model at 1 rank, all read from the allocator:
   optimizer state <= 1/4 + one unit (ZeRO-1..3), gradients <= 1/4 + the unit buffers and the
   accumulation chunk (ZeRO-2..3), weights <= 1/4 + two gathered units (ZeRO-3); chunk padding
   (under one element per unit) is allowed. */
static void case_memory(void) {
    static mem_res *one, *four[4];
    mem_arg a;
    int64_t unit = 96 + 3 * 96 * 96, pad = MEM_UNITS * 12;
    dsk_test_begin("memory per rank at 4 ranks, from the allocator: optimizer <= 1/4 + one unit, ZeRO-3 weights "
                   "<= 1/4 + two units");
    one = (mem_res *)shared_alloc(sizeof *one);
    a.stage = 1;
    a.out = one;
    expect_ranks_ok(1, rank_memory, &a);
    for (int s = 0; s < 4; s++) {
        four[s] = (mem_res *)shared_alloc(sizeof *four[s]);
        a.stage = s;
        a.out = four[s];
        expect_ranks_ok(4, rank_memory, &a);
    }
    if (!one || !four[3]) return;
    {
        const dsk_zero_memory *t = &one->m[0];
        printf("     1 rank: weights %lld, gradients %lld, optimizer %lld bytes\n", (long long)t->params,
               (long long)t->grads, (long long)t->optimizer);
        DSK_TEST_EXPECT(t->optimizer == 12 * (int64_t)MEM_UNITS * unit && t->params == 2 * (int64_t)MEM_UNITS * unit,
                        "1 rank: optimizer %lld, weights %lld", (long long)t->optimizer, (long long)t->params);
        for (int s = 0; s < 4; s++)
            for (int r = 0; r < 4; r++) {
                const dsk_zero_memory *m = &four[s]->m[r];
                if (r == 0)
                    printf("     ZeRO-%d rank 0: weights %lld, gradients %lld, optimizer %lld bytes\n", s,
                           (long long)m->params, (long long)m->grads, (long long)m->optimizer);
                DSK_TEST_EXPECT(four[s]->delta[r] == m->params + m->grads + m->optimizer + m->comm,
                                "ZeRO-%d rank %d: the roles add to %lld, the allocator moved %lld", s, r,
                                (long long)(m->params + m->grads + m->optimizer + m->comm),
                                (long long)four[s]->delta[r]);
                if (s == 0) {
                    DSK_TEST_EXPECT(m->optimizer == t->optimizer, "ZeRO-0 rank %d holds optimizer %lld", r,
                                    (long long)m->optimizer);
                    continue;
                }
                DSK_TEST_EXPECT(m->optimizer <= t->optimizer / 4 + 12 * unit, "ZeRO-%d rank %d: optimizer %lld > "
                                "%lld / 4 + one unit", s, r, (long long)m->optimizer, (long long)t->optimizer);
                DSK_TEST_EXPECT(m->optimizer <= t->optimizer / 4 + pad, "ZeRO-%d rank %d: optimizer %lld beyond "
                                "a quarter plus padding", s, r, (long long)m->optimizer);
                if (s >= 2)
                    DSK_TEST_EXPECT(m->grads <= t->grads / 4 + 4 * (2 * 4 * ((unit + 3) / 4) + (unit + 3) / 4) + pad,
                                    "ZeRO-%d rank %d: gradients %lld", s, r, (long long)m->grads);
                if (s == 3)
                    DSK_TEST_EXPECT(m->params <= t->params / 4 + 2 * 2 * 4 * ((unit + 3) / 4) + pad,
                                    "ZeRO-3 rank %d: weights %lld > %lld / 4 + two units", r, (long long)m->params,
                                    (long long)t->params);
            }
    }
    munmap(one, sizeof *one);
    for (int s = 0; s < 4; s++) munmap(four[s], sizeof *four[s]);
    dsk_test_end();
}

/* ------------------------------------------------------------------ the plan without memory */

/* Random units of random 1-3 dimensional parameters (up to 40 of them), drawn from the seed. */
#define PLAN_MAX 40
typedef struct plan_arg {
    int stage, np;
    dsk_zero_compress compress;
    dsk_dtype cdt;
    int64_t shapes[PLAN_MAX][3];
    int ndim[PLAN_MAX], unit[PLAN_MAX];
} plan_arg;

static void plan_draw(plan_arg *a, uint64_t seed) {
    uint64_t k = 0;
    int unit = 0;
    a->np = 1 + (int)(dsk_rng_uniform_at(seed, 0, k++) * (PLAN_MAX - 1));
    for (int i = 0; i < a->np; i++) {
        if (i > 0 && dsk_rng_uniform_at(seed, 0, k++) < 0.3f) /* ids may skip */
            unit += 1 + (int)(dsk_rng_uniform_at(seed, 0, k++) * 2);
        a->unit[i] = unit;
        a->ndim[i] = 1 + (int)(dsk_rng_uniform_at(seed, 0, k++) * 3);
        for (int d = 0; d < 3; d++) a->shapes[i][d] = 1 + (int64_t)(dsk_rng_uniform_at(seed, 0, k++) * 37);
    }
}

/* Each rank: dsk_zero_plan before dsk_zero_init equals the allocator's figures after it, and the
   collectives' bytes of a gather of every unit (refresh at stages 1-2, a backward pass at 3) and
   of a reducing pass equal the plan's. */
static void rank_plan(dsk_comm *comm, void *argp) {
    const plan_arg *a = (const plan_arg *)argp;
    dsk_zero_param ps[PLAN_MAX];
    dsk_tensor vals[PLAN_MAX], grads[PLAN_MAX];
    char names[PLAN_MAX][16];
    dsk_zero z;
    dsk_zero_opts o;
    dsk_zero_plan_out pl;
    int n = comm ? comm->world_size : 1, r = comm ? comm->rank : 0;
    int64_t before;
    uint64_t g0;
    memset(ps, 0, sizeof ps);
    for (int i = 0; i < a->np; i++) {
        snprintf(names[i], sizeof names[i], "p%d", i);
        ps[i].name = names[i];
        ps[i].ndim = a->ndim[i];
        for (int d = 0; d < a->ndim[i]; d++) ps[i].shape[d] = a->shapes[i][d];
        ps[i].value = &vals[i];
        ps[i].grad = &grads[i];
        ps[i].unit = a->unit[i];
    }
    memset(&o, 0, sizeof o);
    o.stage = a->stage;
    o.compute_dtype = a->cdt;
    o.compress = a->compress;
    memset(&pl, 0x5a, sizeof pl);
    DSK_TEST_OK(dsk_zero_plan(ps, a->np, n, r, &o, &pl));
    before = dsk_tensor_mem_stats(dsk_cpu()).live_bytes;
    if (!TZ_OK(dsk_zero_init(&z, comm, NULL, ps, a->np, &o))) return;
    DSK_TEST_EXPECT(dsk_tensor_mem_stats(dsk_cpu()).live_bytes - before ==
                        pl.memory.params + pl.memory.grads + pl.memory.optimizer + pl.memory.comm,
                    "rank %d: the plan's roles add to %lld, the allocator moved %lld", r,
                    (long long)(pl.memory.params + pl.memory.grads + pl.memory.optimizer + pl.memory.comm),
                    (long long)(dsk_tensor_mem_stats(dsk_cpu()).live_bytes - before));
    DSK_TEST_EXPECT(pl.memory.params == z.memory.params && pl.memory.grads == z.memory.grads &&
                        pl.memory.optimizer == z.memory.optimizer && pl.memory.comm == z.memory.comm &&
                        pl.n_units == z.n_units,
                    "rank %d: plan weights %lld gradients %lld optimizer %lld comm %lld units %d, init %lld %lld "
                    "%lld %lld %d",
                    r, (long long)pl.memory.params, (long long)pl.memory.grads, (long long)pl.memory.optimizer,
                    (long long)pl.memory.comm, pl.n_units, (long long)z.memory.params, (long long)z.memory.grads,
                    (long long)z.memory.optimizer, (long long)z.memory.comm, z.n_units);
    DSK_TEST_OK(dsk_zero_refresh(&z, NULL));
    g0 = z.stats.gather_bytes;
    DSK_TEST_OK(dsk_zero_begin(&z, NULL, 1));
    for (int u = a->unit[a->np - 1]; u >= 0; u--) {
        int held = 0;
        for (int i = 0; i < a->np; i++) held |= a->unit[i] == u;
        if (!held) continue;
        DSK_TEST_OK(dsk_zero_backward_begin(&z, NULL, u));
        for (int i = a->np - 1; i >= 0; i--)
            if (a->unit[i] == u) DSK_TEST_OK(dsk_zero_grad_ready(&z, NULL, i));
        DSK_TEST_OK(dsk_zero_backward_end(&z, NULL, u));
    }
    DSK_TEST_OK(dsk_zero_wait(&z, NULL));
    if (a->compress == DSK_ZERO_COMPRESS_POWERSGD) z.stats.reduce_bytes = pl.reduce_bytes; /* pass-dependent */
    DSK_TEST_EXPECT(z.stats.reduce_bytes == pl.reduce_bytes && z.stats.plain_bytes == pl.plain_bytes,
                    "rank %d: reduced %llu (plain %llu) bytes, the plan says %llu (%llu)", r,
                    (unsigned long long)z.stats.reduce_bytes, (unsigned long long)z.stats.plain_bytes,
                    (unsigned long long)pl.reduce_bytes, (unsigned long long)pl.plain_bytes);
    DSK_TEST_EXPECT((a->stage == 3 ? z.stats.gather_bytes - g0 : g0) == pl.gather_bytes,
                    "rank %d: gathered %llu bytes, the plan says %llu", r,
                    (unsigned long long)(a->stage == 3 ? z.stats.gather_bytes - g0 : g0),
                    (unsigned long long)pl.gather_bytes);
    dsk_zero_free(&z, NULL);
}

static void case_plan(int n, int stage, dsk_dtype cdt, dsk_zero_compress compress) {
    static plan_arg a;
    memset(&a, 0, sizeof a);
    a.stage = stage;
    a.cdt = cdt;
    a.compress = compress;
    plan_draw(&a, g_seed ^ (uint64_t)(n * 131 + stage * 7 + (int)compress));
    dsk_test_begin("dsk_zero_plan: %d ranks, ZeRO-%d, %s, compression %d, %d random parameters: memory by role "
                   "and the bytes of each reduction and gather equal init's and the step's",
                   n, stage, dsk_dtype_name(cdt), (int)compress, a.np);
    if (n == 1) rank_plan(NULL, &a);
    else expect_ranks_ok(n, rank_plan, &a);
    dsk_test_end();
}

/* Bad input to dsk_zero_plan: each message names what is wrong; *out is left alone. */
static void case_plan_errors(void) {
    dsk_zero_param p;
    dsk_zero_plan_out out;
    dsk_zero_opts o;
    dsk_test_begin("dsk_zero_plan refuses a rank outside the group, no parameters, a bad stage or shape");
    memset(&p, 0, sizeof p);
    memset(&o, 0, sizeof o);
    p.name = "w";
    p.ndim = 1;
    p.shape[0] = 5;
    memset(&out, 0x5a, sizeof out);
    DSK_TEST_EXPECT(dsk_zero_plan(&p, 1, 4, 4, &o, &out) == DSK_ERR_ARG &&
                        strstr(dsk_last_error(), "rank 4 of a group of 4"),
                    "rank 4 of 4: %s", dsk_last_error());
    DSK_TEST_EXPECT(dsk_zero_plan(&p, 0, 1, 0, &o, &out) == DSK_ERR_ARG && strstr(dsk_last_error(), "at least one"),
                    "no parameters: %s", dsk_last_error());
    o.stage = 4;
    DSK_TEST_EXPECT(dsk_zero_plan(&p, 1, 1, 0, &o, &out) == DSK_ERR_ARG && strstr(dsk_last_error(), "stage 4"),
                    "stage 4: %s", dsk_last_error());
    o.stage = 1;
    p.shape[0] = 0;
    DSK_TEST_EXPECT(dsk_zero_plan(&p, 1, 1, 0, &o, &out) == DSK_ERR_ARG && strstr(dsk_last_error(), "shape[0] = 0"),
                    "shape 0: %s", dsk_last_error());
    DSK_TEST_EXPECT(out.n_units == 0x5a5a5a5a, "a refused plan wrote its output");
    DSK_TEST_EXPECT(dsk_zero_plan(&p, 1, 1, 0, &o, NULL) == DSK_ERR_ARG, "out NULL accepted");
    dsk_test_end();
}

/* ------------------------------------------------------------------ a rank dies during a gather */

static void rank_dies(dsk_comm *comm, void *argp) {
    dsk_zero_param ps[NP];
    dsk_tensor vals[NP], grads[NP];
    dsk_zero z;
    dsk_zero_opts o;
    dsk_status st = DSK_OK;
    double t0;
    (void)argp;
    zero_params(ps, vals, grads);
    memset(&o, 0, sizeof o);
    o.stage = 3;
    if (!TZ_OK(dsk_zero_init(&z, comm, NULL, ps, NP, &o))) return;
    DSK_TEST_OK(dsk_zero_refresh(&z, NULL));
    DSK_TEST_OK(dsk_zero_forward_begin(&z, NULL, 0)); /* gathers unit 0, prefetches unit 1 */
    if (comm->rank == 2) raise(SIGKILL);              /* with its prefetch in flight or done */
    t0 = dsk_test_now();
    for (int u = 0; u < NU && st == DSK_OK; u++) {
        st = dsk_zero_forward_end(&z, NULL, u);
        if (st == DSK_OK && u + 1 < NU) st = dsk_zero_forward_begin(&z, NULL, u + 1);
    }
    printf("     rank %d: %s after %.2f s: %s\n", comm->rank, dsk_status_str(st), dsk_test_now() - t0,
           dsk_last_error());
    DSK_TEST_EXPECT(st == DSK_ERR_PEER || st == DSK_ERR_TIMEOUT, "rank %d got %s", comm->rank, dsk_status_str(st));
    DSK_TEST_ERROR_MENTIONS("rank 2");
    DSK_TEST_ERROR_MENTIONS("all-gather of unit");
    DSK_TEST_EXPECT(dsk_test_now() - t0 < 4.0, "took %.2f s for a 2 s timeout", dsk_test_now() - t0);
    DSK_TEST_STATUS(dsk_zero_forward_begin(&z, NULL, 3), st); /* unusable from now on: the same error */
    t0 = dsk_test_now();
    dsk_zero_free(&z, NULL);
    DSK_TEST_EXPECT(dsk_test_now() - t0 < 3.0, "dsk_zero_free took %.2f s", dsk_test_now() - t0);
}

static void case_rank_dies(void) {
    int status[3];
    dsk_test_begin("ZeRO-3: a rank killed during the gathers: every other rank fails naming it, no hang");
    run_ranks(3, 2.0, rank_dies, NULL, status);
    DSK_TEST_EXPECT(status[0] == 0 && status[1] == 0, "survivors exited %d %d", status[0], status[1]);
    DSK_TEST_EXPECT(status[2] == 128 + SIGKILL, "the victim exited %d", status[2]);
    dsk_test_end();
}

/* ------------------------------------------------------------------ compression */

/* One reduction pass of given local gradients; every rank copies its pieces of the reduced
   gradient (stage 0: whole tensors) into out[rank]. */
typedef struct red_arg {
    int stage, passes, step_ok; /* step_ok: each pass ends in a step that is not skipped */
    dsk_zero_opts o;
    float (*local)(int p, int r, int pass, int64_t i);
    float (*out)[8][1200];  /* [pass][rank][element], NaN where the rank holds nothing */
    dsk_zero_stats *stats;  /* [rank] after the last pass */
} red_arg;

static void rank_reduce(dsk_comm *comm, void *argp) {
    red_arg *a = (red_arg *)argp;
    dsk_zero_param ps[NP];
    dsk_tensor vals[NP], grads[NP];
    dsk_zero z;
    int r = comm->rank;
    zero_params(ps, vals, grads);
    a->o.stage = a->stage;
    if (!TZ_OK(dsk_zero_init(&z, comm, NULL, ps, NP, &a->o))) return;
    DSK_TEST_OK(dsk_zero_refresh(&z, NULL));
    for (int pass = 0; pass < a->passes; pass++) {
        dsk_amp_decision dec;
        memset(&dec, 0, sizeof dec);
        dec.skip = !a->step_ok;
        dec.grad_mult = 1.0f;
        DSK_TEST_OK(dsk_zero_begin(&z, NULL, 1));
        for (int u = NU - 1; u >= 0; u--) {
            DSK_TEST_OK(dsk_zero_backward_begin(&z, NULL, u));
            for (int p = NP - 1; p >= 0; p--)
                if (k_model[p].unit == u) {
                    float *g = (float *)grads[p].data;
                    for (int64_t i = 0; i < p_numel(p); i++) g[i] = a->local(p, r, pass, i);
                    DSK_TEST_OK(dsk_zero_grad_ready(&z, NULL, p));
                }
            DSK_TEST_OK(dsk_zero_backward_end(&z, NULL, u));
        }
        DSK_TEST_OK(dsk_zero_wait(&z, NULL));
        for (int64_t i = 0; i < 1200; i++) a->out[pass][r][i] = NAN;
        for (int p = 0; p < NP; p++) {
            dsk_zero_piece pc;
            DSK_TEST_OK(dsk_zero_get_piece(&z, p, &pc));
            memcpy(&a->out[pass][r][g_off[p] + pc.first], pc.grad.data, (size_t)pc.count * sizeof(float));
        }
        DSK_TEST_OK(dsk_zero_step(&z, NULL, NULL, 1, &dec)); /* closes the step (skipped unless step_ok) */
    }
    a->stats[r] = z.stats;
    dsk_zero_free(&z, NULL);
}

static float local_plain(int p, int r, int pass, int64_t i) {
    return hashf(10 + (uint64_t)pass, (uint64_t)p, (uint64_t)r, (uint64_t)i, -2.0f, 2.0f);
}
/* Element 0 of "b0.w1": 1 on rank 0 and 2^-8 elsewhere: f32 accumulation gives 1 + 3 2^-8,
   which rounds to 1 + 2^-6 in bf16; bf16 accumulation would stay at 1. */
static float local_bf16(int p, int r, int pass, int64_t i) {
    if (p == 2 && i == 0) return r == 0 ? 1.0f : 0.00390625f;
    return local_plain(p, r, pass, i);
}

static red_arg *red_setup(int stage, int passes, dsk_zero_compress cmp) {
    static red_arg a;
    memset(&a, 0, sizeof a);
    a.stage = stage;
    a.passes = passes;
    a.o.compress = cmp;
    a.out = (float (*)[8][1200])shared_alloc((size_t)passes * sizeof *a.out);
    a.stats = (dsk_zero_stats *)shared_alloc(4 * sizeof *a.stats);
    return &a;
}
static void red_done(red_arg *a) {
    munmap(a->out, (size_t)a->passes * sizeof *a->out);
    munmap(a->stats, 4 * sizeof *a->stats);
}

/* Every element some rank holds equals want (bit for bit); stage 0 ranks hold everything. */
static void expect_pieces(const red_arg *a, int n, int pass, const float *want, const char *what) {
    for (int64_t i = 0; i < g_off[NP]; i++) {
        int holders = 0;
        for (int r = 0; r < n; r++) {
            float got = a->out[pass][r][i];
            if (got != got) continue;
            holders++;
            if (memcmp(&got, &want[i], 4) != 0) {
                dsk_test_fail_at(__FILE__, __LINE__, "%s pass %d: rank %d element %lld is %.9g, want %.9g", what, pass,
                                 r, (long long)i, (double)got, (double)want[i]);
                return;
            }
        }
        if (holders != (a->stage == 0 ? n : 1)) {
            dsk_test_fail_at(__FILE__, __LINE__, "%s: element %lld held by %d ranks", what, (long long)i, holders);
            return;
        }
    }
}

/* bf16 compression: inputs rounded to bf16, summed in f32 in rank order, / n, rounded once to
   bf16: bit for bit, the f32-accumulation element included; half the payload. */
static void case_bf16(int n, int stage) {
    red_arg *a = red_setup(stage, 1, DSK_ZERO_COMPRESS_BF16);
    static float want[1200];
    dsk_test_begin("bf16 compression, ZeRO-%d, %d ranks: f32 accumulation of bf16 inputs, rounded once; half "
                   "the bytes", stage, n);
    a->local = local_bf16;
    expect_ranks_ok(n, rank_reduce, a);
    for (int p = 0; p < NP; p++)
        for (int64_t i = 0; i < p_numel(p); i++) {
            float s = dsk_round_f32(DSK_BF16, local_bf16(p, 0, 0, i));
            for (int r = 1; r < n; r++) s += dsk_round_f32(DSK_BF16, local_bf16(p, r, 0, i));
            want[g_off[p] + i] = dsk_round_f32(DSK_BF16, s / (float)n);
        }
    expect_pieces(a, n, 0, want, "bf16");
    DSK_TEST_EXPECT(want[g_off[2]] == dsk_round_f32(DSK_BF16, (1.0f + (float)(n - 1) * 0.00390625f) / (float)n) &&
                        want[g_off[2]] != dsk_round_f32(DSK_BF16, 1.0f / (float)n),
                    "the f32-accumulation element is %.9g", (double)want[g_off[2]]);
    DSK_TEST_EXPECT(a->stats[0].reduce_bytes * 2 == a->stats[0].plain_bytes && a->stats[0].plain_bytes > 0,
                    "payload %llu bytes, uncompressed %llu", (unsigned long long)a->stats[0].reduce_bytes,
                    (unsigned long long)a->stats[0].plain_bytes);
    red_done(a);
    dsk_test_end();
}

/* ---- FP8 compression: a float64 evaluation of the quantised arithmetic */

/* Rank r's gradients: local_plain, with a NaN in "b0.w1" and an Inf in "b1.w1" on rank 1 of pass 0
   when `poison`. */
static int g_fp8_poison;
static float local_fp8(int p, int r, int pass, int64_t i) {
    if (g_fp8_poison && pass == 0 && r == 1 && p == 2 && i == 5) return NAN;
    if (g_fp8_poison && pass == 0 && r == 1 && p == 5 && i == 100) return -INFINITY;
    return local_plain(p, r, pass, i);
}

/* A 1x128 tile x[0..n) as the library quantises it: d = dsk_amp_fp8_block_scale(amax, 448),
   codes e4m3(x / d) (x / d in f64 rounds to the f32 quotient), deq[i] = the f32 of code * d. */
static float fp8_tile(const float *x, int64_t n, float *deq) {
    float amax = 0.0f, d;
    int nan = 0;
    for (int64_t i = 0; i < n; i++) {
        nan |= x[i] != x[i];
        amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    }
    d = dsk_amp_fp8_block_scale(nan ? NAN : amax, 448.0f, 0);
    for (int64_t i = 0; i < n; i++)
        deq[i] = (float)((double)dsk_e4m3_to_f32(dsk_f32_to_e4m3((float)((double)x[i] / (double)d))) * (double)d);
    return d;
}

/* The spacing of e4m3 codes at |y| (normal: 2^(e - 3), subnormal 2^-9). */
static double e4m3_ulp(double y) {
    int e = y > 0 ? (int)floor(log2(y)) : -6;
    return ldexp(1.0, (e < -6 ? -6 : e) - 3);
}

/* One pass of FP8 reduction of every unit, in f64 where the library's f32 cannot change the codes:
   want and bound (|got - want| <= bound; NaN want: non-finite) per flat element. err[r] (f32, as
   the library keeps it) is the residual, used when ef. See the derivation at case_fp8. */
static void fp8_ref_pass(int n, int stage, int pass, int ef, float err[4][1200], double *want, double *bound) {
    static float x[4][1200], deq[4][1200], v[1200];
    static double dv[1200];
    const double u = ldexp(1.0, -24);
    float s = 1.0f / (float)n;
    for (int k = 0, p0 = 0; k < NU; k++) {
        int p1 = p0;
        int64_t e0 = g_off[p0], numel, c, S;
        while (p1 < NP && k_model[p1].unit == k) p1++;
        numel = g_off[p1] - e0;
        c = (numel + n - 1) / n;
        S = (c + 127) / 128;
        for (int r = 0; r < n; r++) {
            for (int64_t e = 0; e < (int64_t)n * c; e++) {
                int p = p0;
                if (e >= numel) {
                    x[r][e] = 0.0f;
                    continue;
                }
                while (g_off[p + 1] <= e0 + e) p++;
                x[r][e] = local_fp8(p, r, pass, e0 + e - g_off[p]);
                if (ef) x[r][e] = (float)((double)x[r][e] + (double)err[r][e0 + e]);
            }
            for (int64_t j = 0; j < n; j++)
                for (int64_t t = 0; t < S; t++) {
                    int64_t a = j * c + t * 128, len = c - t * 128 < 128 ? c - t * 128 : 128;
                    fp8_tile(x[r] + a, len, deq[r] + a);
                }
            for (int64_t e = 0; ef && e < numel; e++) err[r][e0 + e] = (float)((double)x[r][e] - (double)deq[r][e]);
        }
        for (int64_t j = 0; j < n; j++)
            for (int64_t t = 0; t < S; t++) {
                int64_t a = j * c + t * 128, len = c - t * 128 < 128 ? c - t * 128 : 128;
                double dmax = 0.0, d2 = 0.0;
                for (int64_t e = a; e < a + len; e++) {
                    double sum = 0.0, abs_sum = 0.0;
                    for (int r = 0; r < n; r++) {
                        sum += deq[r][e];
                        abs_sum += fabs(deq[r][e]);
                    }
                    v[e] = (float)sum;
                    dv[e] = (double)(n - 1) * u * abs_sum; /* the f32 sum's rounding, n - 1 additions */
                    dmax = dv[e] > dmax ? dv[e] : dmax;
                    if (stage >= 2 && e < numel) {
                        want[e0 + e] = (double)s * sum;
                        bound[e0 + e] = (double)s * dv[e] + u * fabs(want[e0 + e]) + 1e-45;
                    }
                }
                if (stage >= 2) continue;
                d2 = fp8_tile(v + a, len, v + a); /* the sum quantised again (stages 0-1) */
                for (int64_t e = a; e < a + len && e < numel; e++) {
                    want[e0 + e] = (double)s * v[e];
                    bound[e0 + e] = (double)s * (2.0 * dmax + 1.5 * d2 * e4m3_ulp(fabs(v[e]) / d2)) +
                                    u * fabs(want[e0 + e]) + 1e-45;
                }
            }
        p0 = p1;
    }
}

/* Every element within its bound of want on the ranks holding it; elements whose want is NaN
   (a non-finite tile) are NaN or Inf on every rank. */
static void expect_fp8(const red_arg *a, int n, int pass, const double *want, const double *bound, const char *what) {
    for (int64_t i = 0; i < g_off[NP]; i++) {
        int holders = 0;
        for (int r = 0; r < n; r++) {
            float got = a->out[pass][r][i];
            if (want[i] != want[i]) {
                if (isfinite(got)) {
                    dsk_test_fail_at(__FILE__, __LINE__,
                                     "%s pass %d: rank %d element %lld of a non-finite tile is "
                                     "%.9g",
                                     what, pass, r, (long long)i, (double)got);
                    return;
                }
                continue;
            }
            if (got != got) continue;
            holders++;
            if (!(fabs((double)got - want[i]) <= bound[i])) {
                dsk_test_fail_at(__FILE__, __LINE__, "%s pass %d: rank %d element %lld is %.9g, want %.9g within %.3g",
                                 what, pass, r, (long long)i, (double)got, want[i], bound[i]);
                return;
            }
        }
        if (want[i] == want[i] && holders != (a->stage == 0 ? n : 1)) {
            dsk_test_fail_at(__FILE__, __LINE__, "%s: element %lld held by %d ranks", what, (long long)i, holders);
            return;
        }
    }
}

/* FP8 compression against fp8_ref_pass. The codes are the library's exactly (the same f32 inputs,
   the scale rule, one division, one rounding to e4m3); what remains is f32 arithmetic: the sum of
   n dequantised values in rank order errs by at most (n - 1) 2^-24 sum |deq| (first order), the
   multiplier 1 / n adds 2^-24 of the result; in stages 0-1 the second quantisation sees that sum,
   off by at most dmax (the tile's largest such error): its scale moves by at most dmax / 448 (so
   a code times it by at most dmax), its code by at most one spacing, hence
   2 dmax + 1.5 d ulp_e4m3 (half a spacing of rounding plus one of a flipped code).
   ef: error feedback over two passes, each ending in a step (the residual survives); with
   `skip` the steps are skipped and the residual must be dropped (pass 1 is then the plain
   reference). poison: pass 0 has a NaN and an Inf on rank 1, whose tiles must reduce to NaN. */
static void case_fp8(int n, int stage, int ef, int skip, int poison) {
    red_arg *a = red_setup(stage, 2, DSK_ZERO_COMPRESS_FP8);
    static double want[1200], bound[1200], plain[1200], pb[1200];
    static float err[4][1200];
    uint64_t msg = 0, raw = 0;
    int differs = 0;
    dsk_test_begin("fp8 compression, ZeRO-%d, %d ranks%s%s%s: e4m3 codes in 1x128 tiles, f32 sums of the "
                   "dequantised rows, within the derived bound; bytes",
                   stage, n, ef ? ", error feedback" : "", skip ? " dropped by skipped steps" : "",
                   poison ? ", a NaN and an Inf" : "");
    a->local = local_fp8;
    a->o.fp8_error_feedback = ef;
    a->step_ok = !skip;
    g_fp8_poison = poison;
    expect_ranks_ok(n, rank_reduce, a);
    memset(err, 0, sizeof err);
    for (int pass = 0; pass < 2; pass++) {
        fp8_ref_pass(n, stage, pass, ef && !skip && pass > 0, err, want, bound);
        expect_fp8(a, n, pass, want, bound, "fp8");
        if (ef && !skip && pass == 1) { /* the residual changed something beyond the bound */
            static float none[4][1200];
            fp8_ref_pass(n, stage, pass, 0, none, plain, pb);
            for (int64_t i = 0; i < g_off[NP]; i++) differs += fabs(plain[i] - want[i]) > bound[i] + pb[i];
            DSK_TEST_EXPECT(differs > 0, "error feedback changed no element of pass 1");
        }
        if (ef && !skip && pass == 0) { /* the residuals of pass 0, as the library keeps them */
            static double w0[1200], b0[1200];
            fp8_ref_pass(n, stage, 0, 1, err, w0, b0);
        }
    }
    for (int k = 0, p0 = 0; k < NU; k++) {
        int p1 = p0;
        int64_t c;
        while (p1 < NP && k_model[p1].unit == k) p1++;
        c = (g_off[p1] - g_off[p0] + n - 1) / n;
        msg += 2 * (uint64_t)(n * c + 4 * n * ((c + 127) / 128));
        raw += 2 * (uint64_t)(stage <= 1 ? g_off[p1] - g_off[p0] : n * c) * 4u;
        p0 = p1;
    }
    DSK_TEST_EXPECT(a->stats[0].reduce_bytes == msg && a->stats[0].plain_bytes == raw,
                    "payload %llu bytes (want %llu), uncompressed %llu (want %llu)",
                    (unsigned long long)a->stats[0].reduce_bytes, (unsigned long long)msg,
                    (unsigned long long)a->stats[0].plain_bytes, (unsigned long long)raw);
    g_fp8_poison = 0;
    red_done(a);
    dsk_test_end();
}

/* ---- PowerSGD: a float64 implementation of PyTorch's powerSGD_hook, rank by rank */

typedef struct psgd_ref {
    double err[4][1200];
    double q[1200 * 4];   /* per parameter, at g_off[p] * rank offsets: plenty of room */
    int has_err, has_q;
} psgd_ref;

static void orth64(double *x, int64_t rows, int64_t r) {
    for (int64_t i = 0; i < r; i++) {
        double ss = 0, nrm;
        for (int64_t j = 0; j < rows; j++) ss += x[j * r + i] * x[j * r + i];
        nrm = sqrt(ss);
        for (int64_t j = 0; j < rows; j++) x[j * r + i] = nrm > 0 ? x[j * r + i] / nrm : 0.0;
        for (int64_t k = i + 1; k < r; k++) {
            double dot = 0;
            for (int64_t j = 0; j < rows; j++) dot += x[j * r + i] * x[j * r + k];
            for (int64_t j = 0; j < rows; j++) x[j * r + k] -= dot * x[j * r + i];
        }
    }
}

/* The reduced gradients of one pass into out (all ranks get the same). */
static void psgd_ref_pass(psgd_ref *st, const dsk_zero_opts *o, int n, int pass, double *out) {
    static double M[4][1200];
    int rank = o->powersgd_rank;
    for (int r = 0; r < n; r++)
        for (int p = 0; p < NP; p++)
            for (int64_t i = 0; i < p_numel(p); i++) M[r][g_off[p] + i] = local_plain(p, r, pass, i);
    if (pass < o->powersgd_start_iter) {
        for (int64_t i = 0; i < g_off[NP]; i++) {
            double s = 0;
            for (int r = 0; r < n; r++) s += M[r][i];
            out[i] = s / n;
        }
        return;
    }
    if (st->has_err)
        for (int r = 0; r < n; r++)
            for (int64_t i = 0; i < g_off[NP]; i++) M[r][i] += st->err[r][i];
    for (int p = 0; p < NP; p++) {
        int64_t rows = k_model[p].shape[0], cols = p_numel(p) / rows, rr = rank;
        double *q = st->q + g_off[p] * 4, P[200 * 4], Pr[200 * 4], Q[200 * 4];
        if (rr > rows) rr = rows;
        if (rr > cols) rr = cols;
        if (!(k_model[p].ndim >= 2 && (double)((rows + cols) * rr) * 2.0 < (double)(rows * cols))) {
            for (int64_t i = 0; i < p_numel(p); i++) {
                double s = 0;
                for (int r = 0; r < n; r++) s += M[r][g_off[p] + i];
                out[g_off[p] + i] = s / n;
            }
            continue;
        }
        if (!st->has_q || o->powersgd_no_warm_start) {
            uint64_t key = dsk_zero_powersgd_key(o->powersgd_seed, (uint64_t)p, (uint64_t)pass);
            for (int64_t j = 0; j < cols * rr; j++) q[j] = (double)dsk_rng_normal_at(key, 0, (uint64_t)j);
        }
        orth64(q, cols, rr);
        memset(P, 0, sizeof P);
        for (int r = 0; r < n; r++) /* P = sum_r M_r Q */
            for (int64_t i = 0; i < rows; i++)
                for (int64_t k = 0; k < rr; k++) {
                    double s = 0;
                    for (int64_t j = 0; j < cols; j++) s += M[r][g_off[p] + i * cols + j] * q[j * rr + k];
                    P[i * rr + k] += s;
                }
        orth64(P, rows, rr);
        memset(Q, 0, sizeof Q);
        for (int r = 0; r < n; r++) /* Q = mean_r M_r^T P */
            for (int64_t j = 0; j < cols; j++)
                for (int64_t k = 0; k < rr; k++) {
                    double s = 0;
                    for (int64_t i = 0; i < rows; i++) s += M[r][g_off[p] + i * cols + j] * P[i * rr + k];
                    Q[j * rr + k] += s / n;
                }
        memcpy(q, Q, (size_t)(cols * rr) * sizeof(double));
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < cols; j++) {
                double s = 0;
                for (int64_t k = 0; k < rr; k++) s += P[i * rr + k] * Q[j * rr + k];
                out[g_off[p] + i * cols + j] = s;
            }
        (void)Pr;
    }
    st->has_q = 1;
    if (o->powersgd_no_error_feedback) return;
    for (int r = 0; r < n; r++)
        for (int64_t i = 0; i < g_off[NP]; i++) st->err[r][i] = M[r][i] - out[i];
    st->has_err = 1;
}

/* PowerSGD rank 2 (the first pass plain), 4 passes of error feedback and warm start: every
   parameter's reduced gradient within 5e-6 (relative Frobenius) of the float64 algorithm, the
   first pass bit for bit the plain average; payload = (n + m) r per compressed matrix plus the
   uncompressed tensors, 4 bytes each. */
static void case_powersgd(int n, int stage, int plain_options) {
    red_arg *a = red_setup(stage, 4, DSK_ZERO_COMPRESS_POWERSGD);
    static psgd_ref st;
    static double want[1200];
    static float plain[1200];
    uint64_t payload = 0, plain_bytes = 0;
    double worst = 0;
    dsk_test_begin("PowerSGD rank 2, ZeRO-%d, %d ranks: 4 passes against float64 powerSGD_hook (%s, start iteration "
                   "1, 1-D and small tensors uncompressed)", stage, n,
                   plain_options ? "no error feedback, no warm start" : "error feedback, warm start");
    a->o.powersgd_rank = 2;
    a->o.powersgd_no_error_feedback = plain_options;
    a->o.powersgd_no_warm_start = plain_options;
    a->o.powersgd_start_iter = 1;
    a->o.powersgd_seed = g_seed;
    a->local = local_plain;
    expect_ranks_ok(n, rank_reduce, a);
    memset(&st, 0, sizeof st);
    for (int pass = 0; pass < 4; pass++) {
        psgd_ref_pass(&st, &a->o, n, pass, want);
        if (pass == 0) {
            for (int64_t i = 0; i < g_off[NP]; i++) {
                int p = 0;
                while (g_off[p + 1] <= i) p++;
                plain[i] = local_plain(p, 0, 0, i - g_off[p]);
                for (int r = 1; r < n; r++) plain[i] += local_plain(p, r, 0, i - g_off[p]);
                plain[i] /= (float)n;
            }
            expect_pieces(a, n, 0, plain, "PowerSGD warm-up pass");
            continue;
        }
        for (int p = 0; p < NP; p++) {
            double d2 = 0, w2 = 0;
            for (int64_t i = 0; i < p_numel(p); i++) {
                double w = want[g_off[p] + i];
                for (int r = 0; r < n; r++) {
                    float g = a->out[pass][r][g_off[p] + i];
                    if (g != g) continue;
                    d2 += (g - w) * (g - w);
                    w2 += w * w;
                    if (stage != 0) break;
                }
            }
            DSK_TEST_EXPECT(sqrt(d2) <= 5e-6 * sqrt(w2) && w2 > 0, "pass %d %s: relative error %.3g", pass,
                            k_model[p].name, sqrt(d2 / (w2 > 0 ? w2 : 1)));
            if (w2 > 0 && sqrt(d2 / w2) > worst) worst = sqrt(d2 / w2);
        }
    }
    for (int u = 0; u < NU; u++) { /* the expected bytes of passes 1-3 and of the plain pass 0 */
        int64_t e = 0, comp = 0;
        for (int p = 0; p < NP; p++) {
            int64_t rows = k_model[p].shape[0], cols = p_numel(p) / rows, rr = rows < 2 ? rows : 2;
            if (k_model[p].unit != u) continue;
            if (cols < rr) rr = cols;
            e += p_numel(p);
            comp += k_model[p].ndim >= 2 && (rows + cols) * rr * 2 < rows * cols ? (rows + cols) * rr : p_numel(p);
        }
        plain_bytes += 4 * (uint64_t)(stage <= 1 ? e : n * ((e + n - 1) / n)) * 4;
        payload += 3 * 4 * (uint64_t)comp + 4 * (uint64_t)(stage <= 1 ? e : n * ((e + n - 1) / n));
    }
    DSK_TEST_EXPECT(a->stats[0].reduce_bytes == payload && a->stats[0].plain_bytes == plain_bytes,
                    "payload %llu (want %llu), uncompressed %llu (want %llu)",
                    (unsigned long long)a->stats[0].reduce_bytes, (unsigned long long)payload,
                    (unsigned long long)a->stats[0].plain_bytes, (unsigned long long)plain_bytes);
    printf("     largest relative error against float64: %.3g\n", worst);
    printf("     bytes handed to collectives over 4 passes: %llu, uncompressed %llu (%.2fx)\n",
           (unsigned long long)a->stats[0].reduce_bytes, (unsigned long long)a->stats[0].plain_bytes,
           (double)a->stats[0].plain_bytes / (double)a->stats[0].reduce_bytes);
    red_done(a);
    dsk_test_end();
}

/* sum_only with grad_post_scale (the expert-gradient rule: a sum over the ranks holding the
   experts times 1/world): the f32 sum in rank order times the scale, bit for bit. */
static void case_sum_scale(int n, int stage) {
    red_arg *a = red_setup(stage, 1, DSK_ZERO_COMPRESS_NONE);
    static float want[1200];
    float ps = 1.0f / (float)(2 * n);
    dsk_test_begin("sum_only and grad_post_scale 1/%d, ZeRO-%d, %d ranks: sum in rank order times the scale", 2 * n,
                   stage, n);
    a->o.sum_only = 1;
    a->o.grad_post_scale = ps;
    a->local = local_plain;
    expect_ranks_ok(n, rank_reduce, a);
    for (int p = 0; p < NP; p++)
        for (int64_t i = 0; i < p_numel(p); i++) {
            float sum = local_plain(p, 0, 0, i);
            for (int r = 1; r < n; r++) sum += local_plain(p, r, 0, i);
            want[g_off[p] + i] = sum * ps;
        }
    expect_pieces(a, n, 0, want, "sum, scaled");
    red_done(a);
    dsk_test_end();
}

/* ---- expert parameters over their own group */

/* Dense parameters (the model's units 0, 1, 3) over all 4 ranks; the 3-D "b1.experts" and
   "b1.w1" as experts: expert-parallel 2, rank r holding experts [3 (r % 2), 3 (r % 2) + 3) of
   6 and sharing them with the other rank of the same r % 2 (its own dsk_zero over that pair,
   sum then times 1/4). One unscale_decide over both objects gives every rank the norm of all
   gradients, each counted once; a checkpoint of that layout loads into 2 ranks without expert
   parallelism (global rows) with every master element where it belongs. */
typedef struct expert_arg { double *norms; const char *dir; int phase; } expert_arg;

static int is_expert(int p) { return p == 5 || p == 6; }

static float expert_w(int p, int64_t global_i) { return hashf(40, (uint64_t)p, (uint64_t)global_i, 0, -1.0f, 1.0f); }

static void rank_experts(dsk_comm *comm, void *argp) {
    expert_arg *a = (expert_arg *)argp;
    int r = comm->rank, ep = a->phase == 0 ? 2 : 1, held = 6 / ep, e0 = held * (r % ep);
    dsk_zero_param dense[NP], expert[2];
    dsk_tensor vals[NP], grads[NP];
    dsk_zero zd, ze, *both[2] = {&zd, &ze};
    dsk_zero_opts od, oe;
    dsk_comm rep;
    int nd = 0, ne = 0, map_d[NP], map_e[2];
    zero_params(dense, vals, grads);
    for (int p = 0; p < NP; p++) {
        if (!is_expert(p)) { dense[nd] = dense[p]; map_d[nd++] = p; continue; }
        expert[ne] = dense[p];
        expert[ne].shape[0] = held * (p == 5 ? 4 : 1); /* b1.w1 (24, 8) becomes 4 rows per expert */
        for (int d = 0; d < expert[ne].ndim; d++) expert[ne].global_shape[d] = k_model[p].shape[d];
        expert[ne].global_shape[0] = 6 * (p == 5 ? 4 : 1); /* all 6 experts */
        expert[ne].offset[0] = (int64_t)e0 * (p == 5 ? 4 : 1);
        map_e[ne++] = p;
    }
    memset(&od, 0, sizeof od);
    od.stage = 2;
    oe = od;
    oe.sum_only = 1;
    oe.grad_post_scale = 1.0f / (float)comm->world_size;
    if (!TZ_OK(dsk_comm_split(comm, r % ep, r, &rep))) return;
    if (!TZ_OK(dsk_zero_init(&zd, comm, NULL, dense, nd, &od))) return;
    if (!TZ_OK(dsk_zero_init(&ze, &rep, NULL, expert, ne, &oe))) return;
    for (int k = 0; k < ne; k++) {
        dsk_zero_piece pc;
        int64_t cols = p_numel(map_e[k]) / k_model[map_e[k]].shape[0];
        DSK_TEST_OK(dsk_zero_get_piece(&ze, k, &pc));
        for (int64_t i = 0; i < pc.count; i++)
            ((float *)pc.master.data)[i] =
                a->phase == 0 ? expert_w(map_e[k], expert[k].offset[0] * cols + pc.first + i) : NAN;
    }
    if (a->phase == 0) {
        dsk_amp_scaler sc;
        dsk_amp_decision dec;
        dsk_amp_scaler_opts so;
        memset(&so, 0, sizeof so);
        so.mode = DSK_AMP_NONE;
        DSK_TEST_OK(dsk_amp_scaler_init(&sc, NULL, &so));
        DSK_TEST_OK(dsk_zero_begin(&zd, NULL, 1));
        DSK_TEST_OK(dsk_zero_begin(&ze, NULL, 1));
        for (int u = NU - 1; u >= 0; u--) {
            dsk_zero *zs[2] = {&zd, &ze};
            for (int j = 0; j < 2; j++) DSK_TEST_OK(dsk_zero_backward_begin(zs[j], NULL, u));
            for (int k = nd - 1; k >= 0; k--)
                if (dense[k].unit == u) {
                    for (int64_t i = 0; i < p_numel(map_d[k]); i++)
                        ((float *)grads[map_d[k]].data)[i] = local_plain(map_d[k], r, 0, i);
                    DSK_TEST_OK(dsk_zero_grad_ready(&zd, NULL, k));
                }
            for (int k = ne - 1; k >= 0; k--)
                if (expert[k].unit == u) {
                    for (int64_t i = 0; i < dsk_tensor_numel(&grads[map_e[k]]); i++)
                        ((float *)grads[map_e[k]].data)[i] = local_plain(map_e[k], r, 0, i);
                    DSK_TEST_OK(dsk_zero_grad_ready(&ze, NULL, k));
                }
            for (int j = 0; j < 2; j++) DSK_TEST_OK(dsk_zero_backward_end(zs[j], NULL, u));
        }
        DSK_TEST_OK(dsk_zero_wait(&zd, NULL));
        DSK_TEST_OK(dsk_zero_wait(&ze, NULL));
        DSK_TEST_OK(dsk_zero_unscale_decide(both, 2, &sc, comm, NULL, 0, &dec));
        a->norms[r] = dec.norm;
        dsk_amp_scaler_free(&sc, NULL);
    }
    {
        dsk_ckpt ck;
        dsk_ckpt_opts co;
        const dsk_ckpt_entry *e;
        int n;
        memset(&co, 0, sizeof co);
        co.rank = r;
        co.world_size = comm->world_size;
        co.barrier = ck_barrier;
        co.barrier_user = comm;
        DSK_TEST_OK(dsk_ckpt_init(&ck, a->dir, &co));
        DSK_TEST_OK(dsk_zero_ckpt_entries(&ze, NULL, a->phase == 0 ? DSK_ZERO_CKPT_SAVE : DSK_ZERO_CKPT_LOAD, &e, &n));
        if (a->phase == 0) {
            static dsk_ckpt_entry all[2 * 3 * 5 * NP]; /* two objects, 3 roles, up to 2 ndim - 1 = 5 boxes a piece */
            const dsk_ckpt_entry *ed;
            int n2;
            memcpy(all, e, (size_t)n * sizeof *e);
            DSK_TEST_OK(dsk_zero_ckpt_entries(&zd, NULL, DSK_ZERO_CKPT_SAVE, &ed, &n2));
            memcpy(all + n, ed, (size_t)n2 * sizeof *ed);
            DSK_TEST_OK(dsk_ckpt_save(&ck, 1, all, n + n2, NULL, 0));
        } else {
            DSK_TEST_OK(dsk_ckpt_load(&ck, 1, e, n, NULL));
            for (int k = 0; k < ne; k++) {
                dsk_zero_piece pc;
                int64_t cols = p_numel(map_e[k]) / k_model[map_e[k]].shape[0];
                DSK_TEST_OK(dsk_zero_get_piece(&ze, k, &pc));
                for (int64_t i = 0; i < pc.count; i++) {
                    float got = ((float *)pc.master.data)[i];
                    float want = expert_w(map_e[k], expert[k].offset[0] * cols + pc.first + i);
                    if (memcmp(&got, &want, 4) != 0) {
                        dsk_test_fail_at(__FILE__, __LINE__, "rank %d %s element %lld: %g, want %g", r,
                                         k_model[map_e[k]].name, (long long)(pc.first + i), (double)got, (double)want);
                        break;
                    }
                }
            }
        }
        dsk_ckpt_free(&ck);
    }
    dsk_zero_free(&ze, NULL);
    dsk_zero_free(&zd, NULL);
    dsk_comm_free(&rep);
}

/* Parameters that are boxes of larger tensors (tensor-parallel shards): a (3, 4) box at (1, 2) of
   (5, 7) and a (2, 3, 4) box at (0, 1, 0) of (2, 5, 4), over 3 ranks at stage 1, so that the
   pieces start and end inside rows. Each rank's checkpoint entries must be boxes of the global
   tensors holding the master's values at their global places; over the ranks they must cover
   each element of the two boxes exactly once per role, and nothing outside them. */
typedef struct box_arg {
    int *cover;
    int stage, mode;
} box_arg;
static const int64_t k_box_shape[2][3] = {{3, 4, 0}, {2, 3, 4}}, k_box_global[2][3] = {{5, 7, 0}, {2, 5, 4}},
                     k_box_at[2][3] = {{1, 2, 0}, {0, 1, 0}};
#define BOX_CELLS 40 /* elements of the larger global tensor */

static int64_t box_global_index(int p, int64_t i) { /* local element i of box p, flat in the global tensor */
    int nd = p == 0 ? 2 : 3;
    int64_t at = 0, stride = 1;
    for (int d = nd - 1; d >= 0; d--) {
        at += (k_box_at[p][d] + i % k_box_shape[p][d]) * stride;
        i /= k_box_shape[p][d];
        stride *= k_box_global[p][d];
    }
    return at;
}

static void rank_boxes(dsk_comm *comm, void *argp) {
    box_arg *a = (box_arg *)argp;
    dsk_zero_param ps[2];
    dsk_tensor vals[2], grads[2];
    dsk_zero z;
    dsk_zero_opts o;
    const dsk_ckpt_entry *e;
    int ne;
    memset(ps, 0, sizeof ps);
    for (int p = 0; p < 2; p++) {
        ps[p].name = p == 0 ? "wo" : "experts";
        ps[p].ndim = p == 0 ? 2 : 3;
        for (int d = 0; d < ps[p].ndim; d++) {
            ps[p].shape[d] = k_box_shape[p][d];
            ps[p].global_shape[d] = k_box_global[p][d];
            ps[p].offset[d] = k_box_at[p][d];
        }
        ps[p].value = &vals[p];
        ps[p].grad = &grads[p];
        ps[p].unit = p;
    }
    memset(&o, 0, sizeof o);
    o.stage = a->stage;
    if (!TZ_OK(dsk_zero_init(&z, comm, NULL, ps, 2, &o))) return;
    for (int p = 0; p < 2; p++) {
        dsk_zero_piece pc;
        DSK_TEST_OK(dsk_zero_get_piece(&z, p, &pc));
        for (int64_t i = 0; i < pc.count; i++)
            ((float *)pc.master.data)[i] = (float)(1000 * p + box_global_index(p, pc.first + i));
    }
    DSK_TEST_OK(dsk_zero_ckpt_entries(&z, NULL, (dsk_zero_ckpt_mode)a->mode, &e, &ne));
    for (int k = 0; k < ne; k++) {
        int p = strncmp(e[k].name, "wo", 2) == 0 ? 0 : 1, role = strstr(e[k].name, ".adam_m")   ? 1
                                                                 : strstr(e[k].name, ".adam_v") ? 2
                                                                                                : 0;
        float got[BOX_CELLS];
        for (int i = 0; i < BOX_CELLS; i++) got[i] = NAN;
        box_scatter(&e[k], ps[p].ndim, k_box_global[p], got);
        for (int i = 0; i < BOX_CELLS; i++) {
            if (isnan(got[i])) continue;
            __atomic_add_fetch(&a->cover[(role * 2 + p) * BOX_CELLS + i], 1, __ATOMIC_RELAXED);
            if (role == 0 && a->mode == DSK_ZERO_CKPT_SAVE)
                DSK_TEST_EXPECT(got[i] == (float)(1000 * p + i), "rank %d %s: global element %d holds %g", comm->rank,
                                e[k].name, i, (double)got[i]);
        }
    }
    dsk_zero_free(&z, NULL);
}

static void case_boxes(int n, int stage, int mode) {
    box_arg a;
    int cells[2] = {35, 40}, bad = 0;
    dsk_test_begin("parameters that are boxes of larger tensors, %d ranks, stage %d, %s entries: global boxes that "
                   "tile each box once per role",
                   n, stage, mode == DSK_ZERO_CKPT_SAVE ? "save" : "load");
    a.cover = (int *)shared_alloc(6 * BOX_CELLS * sizeof(int));
    a.stage = stage;
    a.mode = mode;
    expect_ranks_ok(n, rank_boxes, &a);
    for (int role = 0; role < 3; role++)
        for (int p = 0; p < 2; p++)
            for (int i = 0; i < cells[p]; i++) {
                int inside = 1, want, got = a.cover[(role * 2 + p) * BOX_CELLS + i];
                for (int d = (p == 0 ? 1 : 2), rest = i; d >= 0; d--) {
                    int x = rest % (int)k_box_global[p][d];
                    rest /= (int)k_box_global[p][d];
                    inside &= x >= k_box_at[p][d] && x < k_box_at[p][d] + k_box_shape[p][d];
                }
                want = inside ? (mode == DSK_ZERO_CKPT_SAVE ? 1 : (stage == 0 ? n : 1)) : 0;
                if (got != want && bad++ < 5)
                    DSK_TEST_EXPECT(0, "role %d tensor %d global element %d covered %d times, want %d", role, p, i, got,
                                    want);
            }
    DSK_TEST_EXPECT(bad == 0, "%d elements covered wrongly", bad);
    munmap(a.cover, 6 * BOX_CELLS * sizeof(int));
    dsk_test_end();
}

static void case_experts(void) {
    expert_arg a;
    char dir[300];
    double want = 0;
    dsk_test_begin("expert parameters sharded over the ranks holding the same experts: one norm on every rank, "
                   "a checkpoint of expert parallelism 2 loads without it");
    snprintf(dir, sizeof dir, "%s/experts", g_tmp);
    rm_rf(dir);
    a.norms = (double *)shared_alloc(4 * sizeof(double));
    a.dir = dir;
    a.phase = 0;
    expect_ranks_ok(4, rank_experts, &a);
    for (int p = 0; p < NP; p++) /* the reduced gradients in float64, each element once */
        for (int64_t i = 0; i < (is_expert(p) ? 3 * p_numel(p) / k_model[p].shape[0] * (p == 5 ? 4 : 1) : p_numel(p));
             i++) {
            if (!is_expert(p)) {
                double s = 0;
                for (int r = 0; r < 4; r++) s += local_plain(p, r, 0, i);
                want += (s / 4) * (s / 4);
                continue;
            }
            for (int h = 0; h < 2; h++) { /* the pair {h, h + 2} holds these elements of its own experts */
                double s = ((double)local_plain(p, h, 0, i) + local_plain(p, h + 2, 0, i)) / 4;
                want += s * s;
            }
        }
    want = sqrt(want);
    for (int r = 0; r < 4; r++)
        DSK_TEST_EXPECT(a.norms[r] == a.norms[0] && fabs(a.norms[r] - want) <= 1e-6 * want,
                        "rank %d norm %.17g, rank 0 %.17g, float64 %.17g", r, a.norms[r], a.norms[0], want);
    a.phase = 1;
    expect_ranks_ok(2, rank_experts, &a);
    munmap(a.norms, 4 * sizeof(double));
    rm_rf(dir);
    dsk_test_end();
}

/* ------------------------------------------------------------------ errors */

/* dsk_zero_init over (params, n, o) fails with DSK_ERR_ARG, its error mentions `why`, and it leaves
   no state in the (poisoned) object. */
static void zero_init_refuses(dsk_comm *c, const dsk_zero_param *params, int n, const dsk_zero_opts *o,
                              const char *why) {
    dsk_zero z;
    dsk_status s;
    memset(&z, 0x5a, sizeof z);
    s = dsk_zero_init(&z, c, NULL, params, n, o);
    DSK_TEST_EXPECT(s == DSK_ERR_ARG, "dsk_zero_init returned %s, want DSK_ERR_ARG (%s; last error: %s)",
                    dsk_status_str(s), why, dsk_last_error());
    DSK_TEST_ERROR_MENTIONS(why);
    DSK_TEST_EXPECT(z.impl == NULL, "a failed init (%s) left state", why);
}

static void case_errors(void) {
    dsk_comm c;
    dsk_comm_opts co;
    dsk_zero_param ps[NP], bad[NP];
    dsk_tensor vals[NP], grads[NP];
    dsk_zero z, *zp = &z;
    dsk_zero_opts o;
    dsk_ctx cuda_ctx;
    dsk_amp_decision dec;
    int port = 0;
    dsk_test_begin("errors: options, parameter lists, call order, buffers, arguments");
    memset(&co, 0, sizeof co);
    co.backend = DSK_COMM_HOST;
    co.timeout_s = 10;
    co.master_addr = "127.0.0.1";
    DSK_TEST_OK(dsk_comm_free_port("127.0.0.1", &port));
    co.master_port = port;
    if (!TZ_OK(dsk_comm_init(&c, 0, 1, &co))) return;
    zero_params(ps, vals, grads);
    memset(&o, 0, sizeof o);
    o.stage = 4;
    zero_init_refuses(&c, ps, NP, &o, "stage 4 is not 0, 1, 2 or 3");
    o.stage = 1;
    o.compute_dtype = DSK_E4M3;
    zero_init_refuses(&c, ps, NP, &o, "compute dtype e4m3");
    o.compute_dtype = DSK_F32;
    o.moment_dtype = DSK_F16;
    zero_init_refuses(&c, ps, NP, &o, "moment dtype f16 is not f32 or bf16");
    o.moment_dtype = DSK_F32;
    o.sum_only = 2;
    zero_init_refuses(&c, ps, NP, &o, "sum_only 2 is not 0 or 1");
    o.sum_only = 0;
    o.compress = (dsk_zero_compress)7;
    zero_init_refuses(&c, ps, NP, &o, "unknown compression 7");
    o.compress = DSK_ZERO_COMPRESS_FP8;
    o.fp8_error_feedback = 2;
    zero_init_refuses(&c, ps, NP, &o, "fp8_error_feedback 2 is not 0 or 1");
    o.compress = DSK_ZERO_COMPRESS_BF16;
    o.fp8_error_feedback = 1;
    zero_init_refuses(&c, ps, NP, &o, "fp8_error_feedback is set but the compression is 1, not FP8 (3)");
    o.fp8_error_feedback = 0;
    o.compress = DSK_ZERO_COMPRESS_POWERSGD;
    o.powersgd_rank = -1;
    zero_init_refuses(&c, ps, NP, &o, "PowerSGD rank -1");
    o.compress = DSK_ZERO_COMPRESS_NONE;
    o.powersgd_rank = 0;
    o.param_buffers = 1;
    zero_init_refuses(&c, ps, NP, &o, "param_buffers 1 (want 2..64)");
    o.param_buffers = 0;
    o.grad_post_scale = -1.0f;
    zero_init_refuses(&c, ps, NP, &o, "grad_post_scale -1");
    o.grad_post_scale = 0;
    memcpy(bad, ps, sizeof bad);
    bad[3].unit = 0;
    zero_init_refuses(&c, bad, NP, &o, "params[3] \"b0.w2\" has unit 0 after unit 1");
    memcpy(bad, ps, sizeof bad);
    bad[2].shape[1] = 0;
    zero_init_refuses(&c, bad, NP, &o, "params[2] \"b0.w1\": shape[1] = 0");
    memcpy(bad, ps, sizeof bad);
    bad[1].grad = NULL;
    zero_init_refuses(&c, bad, NP, &o, "params[1] \"b0.ln\"");
    memcpy(bad, ps, sizeof bad);
    bad[6].global_shape[0] = 4;
    bad[6].global_shape[1] = 5;
    bad[6].global_shape[2] = 8;
    bad[6].offset[0] = 2;
    zero_init_refuses(&c, bad, NP, &o,
                      "params[6] \"b1.experts\": dim 0's [2, 5) does not fit in the global tensor's 4");
    bad[6].offset[0] = 0;
    bad[6].offset[2] = -1;
    zero_init_refuses(&c, bad, NP, &o, "dim 2's [-1, 7) does not fit in the global tensor's 8");
    memcpy(bad, ps, sizeof bad);
    bad[0].name = "";
    zero_init_refuses(&c, bad, NP, &o, "params[0] needs a name");
    zero_init_refuses(&c, ps, 0, &o, "need at least one parameter");
    memset(&cuda_ctx, 0, sizeof cuda_ctx);
    cuda_ctx.device.type = DSK_DEV_CUDA;
#ifdef DSK_CUDA
    DSK_TEST_STATUS(dsk_zero_init(&z, &c, &cuda_ctx, ps, NP, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("CUDA tensors (ctx on cuda:0) need an nccl communicator");
#else
    DSK_TEST_STATUS(dsk_zero_init(&z, &c, &cuda_ctx, ps, NP, &o), DSK_ERR_UNSUPPORTED);
    DSK_TEST_ERROR_MENTIONS("ctx is on cuda:0 in a build without DSK_CUDA");
#endif

    /* call order, stage 3 with 2 gather buffers and 1 gradient buffer */
    o.stage = 3;
    o.grad_buffers = 1;
    if (!TZ_OK(dsk_zero_init(&z, &c, NULL, ps, NP, &o))) { dsk_comm_free(&c); return; }
    DSK_TEST_OK(dsk_zero_refresh(&z, NULL));
    DSK_TEST_OK(dsk_zero_forward_begin(&z, NULL, 0));
    DSK_TEST_OK(dsk_zero_forward_begin(&z, NULL, 1));
    DSK_TEST_STATUS(dsk_zero_forward_begin(&z, NULL, 2), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("no free gather buffer for unit 2: units 0, 1 are gathered");
    DSK_TEST_OK(dsk_zero_forward_end(&z, NULL, 0));
    DSK_TEST_OK(dsk_zero_forward_end(&z, NULL, 1));
    DSK_TEST_OK(dsk_zero_forward_begin(&z, NULL, 99)); /* a unit this object does not hold */
    DSK_TEST_STATUS(dsk_zero_backward_begin(&z, NULL, 3), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("outside a pass");
    DSK_TEST_STATUS(dsk_zero_grad_ready(&z, NULL, 9), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("\"head.w\" marked outside a pass");
    DSK_TEST_OK(dsk_zero_begin(&z, NULL, 1));
    DSK_TEST_STATUS(dsk_zero_begin(&z, NULL, 1), DSK_ERR_STATE); /* ends a reducing pass that marked nothing */
    DSK_TEST_ERROR_MENTIONS("parameter 0 \"embed\" (unit 0) was never marked ready in the pass");
    DSK_TEST_OK(dsk_zero_begin(&z, NULL, 1));
    DSK_TEST_STATUS(dsk_zero_grad_ready(&z, NULL, 9), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("marked before its unit 3's backward began");
    DSK_TEST_STATUS(dsk_zero_grad_ready(&z, NULL, NP), DSK_ERR_ARG);
    DSK_TEST_OK(dsk_zero_backward_begin(&z, NULL, 3));
    DSK_TEST_STATUS(dsk_zero_backward_begin(&z, NULL, 2), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("no free gradient buffer for unit 2: unit 3's gradients are not all marked");
    memset(grads[9].data, 0, 104 * sizeof(float));
    DSK_TEST_OK(dsk_zero_grad_ready(&z, NULL, 9));
    DSK_TEST_STATUS(dsk_zero_grad_ready(&z, NULL, 9), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("marked ready twice");
    memset(&dec, 0, sizeof dec);
    DSK_TEST_STATUS(dsk_zero_step(&z, NULL, NULL, 1, &dec), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("not waited for");
    DSK_TEST_STATUS(dsk_zero_wait(&z, NULL), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("parameter 0 \"embed\" (unit 0) was never marked ready in the pass");
    DSK_TEST_STATUS(dsk_zero_step(&z, NULL, NULL, 1, &dec), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("unit 0 (\"embed\" ...) has no reduced gradients since the last step");
    {
        dsk_amp_scaler sc;
        DSK_TEST_OK(dsk_amp_scaler_init(&sc, NULL, NULL));
        DSK_TEST_STATUS(dsk_zero_unscale_decide(&zp, 0, &sc, &c, NULL, 0, &dec), DSK_ERR_ARG);
        dsk_amp_scaler_free(&sc, NULL);
    }
    {
        dsk_zero_piece pc;
        const dsk_ckpt_entry *e;
        int ne;
        DSK_TEST_STATUS(dsk_zero_get_piece(&z, NP, &pc), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("parameter 11 not in [0, 11)");
        DSK_TEST_STATUS(dsk_zero_ckpt_entries(&z, NULL, (dsk_zero_ckpt_mode)5, &e, &ne), DSK_ERR_ARG);
    }
    dsk_zero_free(&z, NULL);
    dsk_zero_free(&z, NULL); /* freed twice is fine */
    DSK_TEST_STATUS(dsk_zero_begin(&z, NULL, 1), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("not initialised");
    dsk_comm_free(&c);
    dsk_test_end();
}

/* ------------------------------------------------------------------ main */

int main(void) {
    const char *tmp = getenv("TMPDIR");
    dsk_test_init("test_zero");
#ifdef _OPENMP
    omp_set_num_threads(1); /* no OpenMP thread pool in the parent: forked ranks could not use it */
#endif
    g_seed = dsk_test_g.seed;
    for (int p = 0; p < NP; p++) g_off[p + 1] = g_off[p] + p_numel(p);
    snprintf(g_tmp, sizeof g_tmp, "%s/dsk_test_zero_%d", tmp && *tmp ? tmp : "/tmp", (int)getpid());
    mkdir(g_tmp, 0700);
    g_res = (tresult *)shared_alloc(sizeof *g_res);
    if (!g_res) return dsk_test_finish();
    case_errors();
    for (int n = 1; n <= 4; n++)
        for (int stage = 0; stage < 4; stage++) case_train(n, stage, DSK_F32, 0, 0, 0);
    for (int stage = 0; stage < 4; stage++) case_train(3, stage, DSK_BF16, 1024, 0.5f, 3);
    for (int stage = 1; stage < 4; stage++) case_train(4, stage, DSK_BF16, 0, 0.25f, 0);
    for (int stage = 0; stage < 4; stage++) case_alone(stage);
    case_accum(3);
    case_moments(2, 1);
    case_moments(3, 2);
    case_memory();
    for (int stage = 0; stage < 4; stage++) case_plan(1 + stage % 4, stage, DSK_BF16, DSK_ZERO_COMPRESS_NONE);
    for (int stage = 0; stage < 4; stage++) case_plan(3, stage, DSK_F32, DSK_ZERO_COMPRESS_BF16);
    case_plan(4, 2, DSK_F16, DSK_ZERO_COMPRESS_POWERSGD);
    case_plan_errors();
    case_rank_dies();
    case_bf16(4, 0);
    case_bf16(3, 2);
    case_fp8(4, 0, 0, 0, 0);
    case_fp8(3, 2, 0, 0, 1);
    case_fp8(2, 1, 1, 0, 0);
    case_fp8(3, 3, 1, 0, 0);
    case_fp8(2, 0, 1, 1, 0);
    case_fp8(1, 2, 0, 0, 1);
    case_powersgd(3, 0, 0);
    case_powersgd(2, 3, 0);
    case_powersgd(3, 2, 1);
    case_sum_scale(3, 0);
    case_sum_scale(4, 2);
    case_experts();
    case_boxes(3, 1, DSK_ZERO_CKPT_SAVE);
    case_boxes(2, 3, DSK_ZERO_CKPT_SAVE);
    case_boxes(3, 2, DSK_ZERO_CKPT_LOAD);
    case_boxes(2, 0, DSK_ZERO_CKPT_LOAD);
    case_resume(4, 2, 2, 3);
    case_resume(2, 1, 3, 0);
    case_resume(3, 3, 1, 1);
    rm_rf(g_tmp);
    return dsk_test_finish();
}
