/* test_oom.c - host allocation failures: each host allocation of a call fails in turn (DSK_MALLOC
   replaced: the k-th from the call's start returns NULL, the others succeed), for k = 0, 1, ...
   until a run reaches no failure. Each failed run must return DSK_ERR_OOM with a message (no
   other status in its place: an allocation failure is not a damaged file), or succeed, and
   leave behind no allocation it made (DSK_FREE counted): out of memory loses nothing. Covers
   dsk_zero_plan, dsk_zero_init (a failure inside it used to free a table it had not zeroed),
   a MoE layer's init, binding, forward and backward on the CPU (a run that succeeds gives the
   bits of one without failures), the pipeline schedules and their simulated step time, and a
   checkpoint's init, save, load of the newest step and free. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp (dsk_test_files.h) */
#include <stdlib.h>
/* Counted from each run's start; the background threads of a save allocate too, hence atomics. */
static long to_fail_at = -1; /* the allocation that fails; -1: none */
static long to_count, to_live;
static void *to_malloc(size_t n) {
    void *p;
    if (__atomic_fetch_add(&to_count, 1, __ATOMIC_SEQ_CST) == __atomic_load_n(&to_fail_at, __ATOMIC_SEQ_CST))
        return NULL;
    if ((p = malloc(n))) __atomic_fetch_add(&to_live, 1, __ATOMIC_SEQ_CST);
    return p;
}
static void to_free(void *p) {
    if (p) __atomic_fetch_sub(&to_live, 1, __ATOMIC_SEQ_CST);
    free(p);
}
#define DSK_MALLOC(sz) to_malloc(sz)
#define DSK_FREE(p) to_free(p)
#define DSK_TENSOR_IMPLEMENTATION
#define DSK_COMM_IMPLEMENTATION
#define DSK_AMP_IMPLEMENTATION
#define DSK_ZERO_IMPLEMENTATION
#define DSK_CKPT_IMPLEMENTATION
#define DSK_MOE_IMPLEMENTATION
#define DSK_PAR_IMPLEMENTATION
#include "dsk_zero.h"
#include "dsk_ckpt.h"
#include "dsk_moe.h"
#include "dsk_par.h"
#include "tests/dsk_test.h"
#include "tests/dsk_test_files.h"

#include <stdio.h>
#include <string.h>

typedef dsk_status (*to_call)(void *arg); /* one run; on success it releases what it made */

/* Runs call with its k-th allocation failing for k = 0, 1, ... until a run reaches no failure
   (that run must succeed, and every earlier one fail with DSK_ERR_OOM or succeed),
   each run leaving as many allocations alive as before it. Returns the runs that failed. */
static long to_each_failure(const char *name, to_call call, void *arg) {
    long before = to_live, failed = 0;
    int checks_failed = dsk_test_g.checks_failed_total;
    for (long k = 0;; k++) {
        dsk_status st;
        long left;
        __atomic_store_n(&to_count, 0, __ATOMIC_SEQ_CST);
        __atomic_store_n(&to_fail_at, k, __ATOMIC_SEQ_CST);
        st = call(arg);
        __atomic_store_n(&to_fail_at, -1, __ATOMIC_SEQ_CST);
        left = __atomic_load_n(&to_live, __ATOMIC_SEQ_CST) - before;
        if (__atomic_load_n(&to_count, __ATOMIC_SEQ_CST) <= k) { /* every allocation succeeded */
            DSK_TEST_EXPECT(st == DSK_OK, "%s with no allocation failing: status %d, %s", name, (int)st,
                            dsk_last_error());
            DSK_TEST_EXPECT(left == 0, "%s with no allocation failing left %ld allocations", name, left);
            DSK_TEST_EXPECT(k > 0, "%s allocated nothing: the run proves nothing", name);
            return failed;
        }
        failed += st != DSK_OK;
        DSK_TEST_EXPECT(st == DSK_OK || (st == DSK_ERR_OOM && dsk_last_error()[0]),
                        "%s, allocation %ld failing: status %d, \"%s\" (want DSK_ERR_OOM and a message)", name, k,
                        (int)st, dsk_last_error());
        DSK_TEST_EXPECT(left == 0, "%s, allocation %ld failing (status %d): %ld allocations left behind", name, k,
                        (int)st, left);
        if (dsk_test_g.checks_failed_total > checks_failed) return failed; /* one report, not one per k */
    }
}

/* ---- ZeRO: a model of four parameters in two units */

#define TO_NP 4
typedef struct to_zero {
    dsk_zero_param ps[TO_NP];
    dsk_tensor vals[TO_NP], grads[TO_NP];
    dsk_zero_opts o;
} to_zero;

static void to_zero_params(to_zero *z, int stage) {
    static const char *names[TO_NP] = {"embed", "blocks.0.w1", "blocks.0.norm", "head"};
    static const int64_t shapes[TO_NP][2] = {{64, 16}, {48, 16}, {16, 1}, {64, 16}};
    memset(z, 0, sizeof *z);
    for (int p = 0; p < TO_NP; p++) {
        z->ps[p].name = names[p];
        z->ps[p].ndim = shapes[p][1] == 1 ? 1 : 2;
        z->ps[p].shape[0] = shapes[p][0];
        z->ps[p].shape[1] = shapes[p][1];
        z->ps[p].value = &z->vals[p];
        z->ps[p].grad = &z->grads[p];
        z->ps[p].unit = p / 2;
        z->ps[p].no_decay = z->ps[p].ndim == 1;
    }
    z->o.stage = stage;
    z->o.compute_dtype = DSK_BF16;
}

static dsk_status to_run_zero_plan(void *arg) {
    to_zero *z = (to_zero *)arg;
    dsk_zero_plan_out out;
    return dsk_zero_plan(z->ps, TO_NP, 4, 1, &z->o, &out);
}

static dsk_status to_run_zero_init(void *arg) {
    to_zero *z = (to_zero *)arg;
    dsk_zero zero;
    dsk_status st = dsk_zero_init(&zero, NULL, NULL, z->ps, TO_NP, &z->o);
    if (st == DSK_OK) dsk_zero_free(&zero, NULL);
    return st;
}

static void case_zero(int stage) {
    to_zero z;
    long failed;
    dsk_test_begin("every allocation of dsk_zero_plan and dsk_zero_init (stage %d, bf16) failing in turn: DSK_ERR_OOM, "
                   "nothing left allocated",
                   stage);
    to_zero_params(&z, stage);
    failed = to_each_failure("dsk_zero_plan", to_run_zero_plan, &z);
    DSK_TEST_EXPECT(failed > 0, "dsk_zero_plan never failed");
    failed = to_each_failure("dsk_zero_init", to_run_zero_init, &z);
    DSK_TEST_EXPECT(failed > 0, "dsk_zero_init never failed");
    dsk_test_end();
}

/* ---- the MoE layer on the CPU: init, slabs bound, parameters drawn, forward, backward, free */

#define TO_T 24
#define TO_D 16
typedef struct to_moe {
    dsk_moe_opts o;
    dsk_tensor x, dy;
    float y_ref[TO_T * TO_D], dx_ref[TO_T * TO_D];
    int have_ref;
} to_moe;

static dsk_status to_run_moe(void *arg) {
    to_moe *t = (to_moe *)arg;
    int64_t sx[2] = {TO_T, TO_D}, vb, gd, gs, ng;
    dsk_tensor values, grads, y, dx;
    dsk_moe m;
    dsk_status st = dsk_moe_init(&m, NULL, &t->o);
    if (st != DSK_OK) return st;
    memset(&values, 0, sizeof values);
    memset(&grads, 0, sizeof grads);
    memset(&y, 0, sizeof y);
    memset(&dx, 0, sizeof dx);
    dsk_moe_slab_sizes(&m, &vb, &gd, &gs);
    ng = gd + gs;
    st = dsk_tensor_alloc(NULL, &values, DSK_U8, 1, &vb);
    if (st == DSK_OK) st = dsk_tensor_alloc(NULL, &grads, DSK_F32, 1, &ng);
    if (st == DSK_OK) st = dsk_tensor_alloc(NULL, &y, DSK_F32, 2, sx);
    if (st == DSK_OK) st = dsk_tensor_alloc(NULL, &dx, DSK_F32, 2, sx);
    if (st == DSK_OK) st = dsk_moe_bind_slabs(&m, NULL, &values, &grads);
    if (st == DSK_OK) st = dsk_moe_init_params(&m, NULL);
    if (st == DSK_OK) st = dsk_tensor_fill(NULL, &grads, 0.0);
    if (st == DSK_OK) st = dsk_tensor_fill(NULL, &dx, 0.0); /* backward adds to it */
    if (st == DSK_OK) st = dsk_moe_forward(&m, NULL, &y, &t->x, NULL);
    if (st == DSK_OK) st = dsk_moe_backward(&m, NULL, &dx, &t->dy, 1.0f);
    if (st == DSK_OK && !t->have_ref) {
        memcpy(t->y_ref, y.data, sizeof t->y_ref);
        memcpy(t->dx_ref, dx.data, sizeof t->dx_ref);
        t->have_ref = 1;
    } else if (st == DSK_OK &&
               (memcmp(t->y_ref, y.data, sizeof t->y_ref) || memcmp(t->dx_ref, dx.data, sizeof t->dx_ref))) {
        st = dsk_set_error(DSK_ERR_STATE, "dsk_moe: the outputs differ from the run without failures");
    }
    dsk_moe_free(&m, NULL);
    dsk_tensor_free(NULL, &values);
    dsk_tensor_free(NULL, &grads);
    dsk_tensor_free(NULL, &y);
    dsk_tensor_free(NULL, &dx);
    return st;
}

static void case_moe(int capacity) {
    to_moe t;
    int64_t sx[2] = {TO_T, TO_D};
    long failed;
    dsk_test_begin("every allocation of a MoE layer's init, binding, forward and backward (CPU, %s) failing in turn: "
                   "DSK_ERR_OOM, nothing left allocated, the same bits when it succeeds",
                   capacity ? "capacity 1.0" : "dropless");
    memset(&t, 0, sizeof t);
    t.o.d_model = TO_D;
    t.o.n_routed = 4;
    t.o.top_k = 2;
    t.o.d_expert = 8;
    t.o.n_shared = 1;
    t.o.capacity_factor = capacity ? 1.0f : 0.0f;
    t.o.init_std = 0.5f;
    t.o.seed = 3;
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &t.x, DSK_F32, 2, sx));
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &t.dy, DSK_F32, 2, sx));
    dsk_test_fill_f32((float *)t.x.data, TO_T * TO_D, -1, 1);
    dsk_test_fill_f32((float *)t.dy.data, TO_T * TO_D, -1, 1);
    DSK_TEST_OK(to_run_moe(&t)); /* the reference bits */
    failed = to_each_failure("dsk_moe", to_run_moe, &t);
    DSK_TEST_EXPECT(failed > 0, "no run failed");
    dsk_tensor_free(NULL, &t.x);
    dsk_tensor_free(NULL, &t.dy);
    dsk_test_end();
}

/* ---- pipeline schedules: every rank's list, paired and not, and the simulated step time */

typedef struct to_sched {
    dsk_par_schedule_kind kind;
    int chunks;
    double step_ref;
} to_sched;

static dsk_status to_run_schedules(void *arg) {
    to_sched *t = (to_sched *)arg;
    double fwd[8] = {1.0, 1.2, 0.9, 1.1, 1.0, 1.3, 0.8, 1.0}, bwd[8] = {2.0, 2.1, 1.9, 2.2, 2.0, 2.4, 1.7, 2.0}, step;
    dsk_status st = DSK_OK;
    for (int r = 0; r < 4 && st == DSK_OK; r++)
        for (int paired = 0; paired < 2 && st == DSK_OK; paired++) {
            dsk_par_schedule s;
            st = paired ? dsk_par_schedule_init_paired(&s, t->kind, 4, 8, t->chunks, r)
                        : dsk_par_schedule_init(&s, t->kind, 4, 8, t->chunks, r);
            if (st == DSK_OK) dsk_par_schedule_free(&s);
        }
    if (st == DSK_OK)
        st = dsk_par_schedule_time(t->kind, 4, 8, t->chunks, 0, DSK_PAR_TRANSFERS_AHEAD, fwd, bwd, 0.1, &step);
    if (st == DSK_OK && t->step_ref > 0 && step != t->step_ref)
        st = dsk_set_error(DSK_ERR_STATE, "dsk_par_schedule_time: %.17g s, %.17g without failures", step, t->step_ref);
    if (st == DSK_OK) t->step_ref = step;
    return st;
}

static void case_schedules(dsk_par_schedule_kind kind, int chunks) {
    to_sched t = {kind, chunks, 0.0};
    long failed;
    dsk_test_begin("every allocation of the %s schedules of 4 ranks (plain and paired) and of their simulated step "
                   "failing in turn: DSK_ERR_OOM, nothing left allocated, the same time when it succeeds",
                   dsk_par_schedule_name(kind));
    DSK_TEST_OK(to_run_schedules(&t)); /* the reference time */
    failed = to_each_failure("dsk_par_schedule", to_run_schedules, &t);
    DSK_TEST_EXPECT(failed > 0, "no run failed");
    dsk_test_end();
}

/* ---- checkpoints: one rank saves two tensors and loads the newest step back */

typedef struct to_ckpt {
    char dir[300];
    dsk_tensor a, b;
    dsk_ckpt_entry e[2];
    float want[2][96];
    int load;
} to_ckpt;

static dsk_status to_run_ckpt(void *arg) {
    to_ckpt *c = (to_ckpt *)arg;
    dsk_ckpt ck;
    dsk_ckpt_kv kv = {"note", "oom"};
    dsk_status st = dsk_ckpt_init(&ck, c->dir, NULL);
    if (st != DSK_OK) return st;
    if (c->load) {
        memset(c->a.data, 0, 96 * sizeof(float));
        memset(c->b.data, 0, 40 * sizeof(float));
        st = dsk_ckpt_load(&ck, -1, c->e, 2, NULL);
        if (st == DSK_OK &&
            (memcmp(c->a.data, c->want[0], 96 * sizeof(float)) || memcmp(c->b.data, c->want[1], 40 * sizeof(float))))
            st = dsk_set_error(DSK_ERR_CORRUPT, "dsk_ckpt_load: loaded values differ from the saved ones");
    } else {
        st = dsk_ckpt_save(&ck, 7, c->e, 2, &kv, 1);
    }
    dsk_ckpt_free(&ck);
    return st;
}

static void case_ckpt(void) {
    to_ckpt c;
    long failed;
    int64_t sa[2] = {8, 12}, sb[1] = {40};
    dsk_test_begin("every allocation of a checkpoint's save and load failing in turn: DSK_ERR_OOM, nothing "
                   "left allocated, the saved values loaded when it succeeds");
    memset(&c, 0, sizeof c);
    if (!scratch_init("dsk_test_oom")) {
        dsk_test_fail_at(__FILE__, __LINE__, "cannot make a scratch directory under $TMPDIR or /tmp");
        dsk_test_end();
        return;
    }
    snprintf(c.dir, sizeof c.dir, "%s/ck", g_root);
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &c.a, DSK_F32, 2, sa));
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &c.b, DSK_F32, 1, sb));
    dsk_test_fill_f32(c.want[0], 96, -1, 1);
    dsk_test_fill_f32(c.want[1], 40, -1, 1);
    memcpy(c.a.data, c.want[0], sizeof c.want[0]);
    memcpy(c.b.data, c.want[1], 40 * sizeof(float));
    c.e[0].name = "a";
    c.e[0].tensor = &c.a;
    c.e[1].name = "b";
    c.e[1].tensor = &c.b;
    failed = to_each_failure("dsk_ckpt", to_run_ckpt, &c);
    DSK_TEST_EXPECT(failed > 0, "no save failed");
    c.load = 1;
    failed = to_each_failure("dsk_ckpt", to_run_ckpt, &c);
    DSK_TEST_EXPECT(failed > 0, "no load failed");
    dsk_tensor_free(NULL, &c.a);
    dsk_tensor_free(NULL, &c.b);
    scratch_remove();
    dsk_test_end();
}

int main(void) {
    dsk_test_init("test_oom");
    case_zero(0);
    case_zero(1);
    case_zero(3);
    case_moe(0);
    case_moe(1);
    case_schedules(DSK_PAR_1F1B, 1);
    case_schedules(DSK_PAR_INTERLEAVED, 2);
    case_schedules(DSK_PAR_DUALPIPE_V, 2);
    case_ckpt();
    return dsk_test_finish();
}
