/* test_plan_time.c - dsk_plan.h's pipeline timing: dsk_plan_stage_times (each stage's forward and backward of a
   micro-batch chunk, its tensor-parallel collectives inside), dsk_plan_stages (the pace stage, the schedule's
   lists timed) and dsk_plan_time's bubble, against the same quantities computed here from the cluster's figures
   and dsk_par_schedule_time (which tests/test_par.c checks), on random stage FLOPs and tensor-parallel traffic;
   and dsk_plan_time refusing a pipeline without its stages' times. tests/test_plan_cores.sh checks the same
   through dsk_plan --check-rank on the trainer's model. */
#include "dsk_plan.h"
#include "tests/dsk_test.h"

static const char *k_cluster = "{\"name\": \"test\", \"nodes\": 1, \"gpus_per_node\": 8, \"memory_gb\": 80, "
                               "\"bf16_tflops\": 100, \"fp8_tflops\": 200, \"intra_node_gbps\": 50, "
                               "\"inter_node_gbps\": 10, \"intra_node_latency_us\": 5, \"inter_node_latency_us\": 20, "
                               "\"efficiency\": 0.5, \"overlap\": 0.5}";

/* A model of L layers of which `moe` are MoE; no memory callback (dsk_plan_stages and dsk_plan_time call none). */
static dsk_plan_model model(int moe) {
    dsk_plan_model m;
    memset(&m, 0, sizeof m);
    snprintf(m.name, sizeof m.name, "test");
    m.layers = 8, m.moe_layers = moe, m.heads = 8, m.n_routed = 16, m.top_k = 4;
    m.d_model = 1024, m.vocab = 32000, m.ffn_hidden = 4096;
    m.flops_per_token = 6e9, m.attn_flops_per_token = 1e9, m.act_bytes = 2;
    return m;
}

static dsk_plan_layout layout(int pp, int micro, int v, dsk_par_schedule_kind kind, dsk_plan_recompute rc, int ep) {
    dsk_plan_layout l;
    memset(&l, 0, sizeof l);
    l.tp = 2, l.pp = pp, l.dp = 2, l.ep = ep, l.micro = micro, l.vstages = v, l.schedule = kind;
    l.recompute = rc, l.moments = DSK_F32;
    return l;
}

/* Seconds of one rank of tp x dp computing flops per token for the job's tokens, recomputation's reruns added. */
static double compute_s(const dsk_plan_cluster *c, const dsk_plan_job *job, const dsk_plan_layout *l,
                        const dsk_plan_flops *f, int with_recompute) {
    double flops = f->total;
    if (with_recompute && l->recompute == DSK_PLAN_RECOMPUTE_FULL) flops += f->total / 3;
    if (with_recompute && l->recompute == DSK_PLAN_RECOMPUTE_ATTN) flops += f->attn / 3;
    return (double)job->sequences * job->seq * flops / (l->tp * l->dp * 1e12 * c->bf16_tflops * c->efficiency);
}

/* The expert exchanges of a stage of L MoE layers: 4 L all-to-alls a micro-batch, each of the rank's Nm / tp tokens
   K rows of D, (ep - 1) / ep of them leaving, over the intra-node link (ep tp <= 8 here) with its latency. */
static double ep_s(const dsk_plan_cluster *c, const dsk_plan_job *job, const dsk_plan_model *m,
                   const dsk_plan_layout *l, double L) {
    double Nm = (double)job->seq * job->sequences / (l->dp * (double)l->micro);
    double bytes = 4 * L * (l->ep - 1.0) / l->ep * Nm / l->tp * m->top_k * (double)m->d_model * m->act_bytes;
    return l->ep < 2 ? 0 : l->micro * (bytes / (1e9 * c->intra_gbps) + 4 * L * 1e-6 * c->intra_latency_us);
}

/* A rank's tensor-parallel collectives: each kind's bytes, (tp - 1) / tp of them (twice for an all-reduce) over
   the intra-node link (tp <= 8 here), and a latency a call. */
static double tp_s(const dsk_plan_cluster *c, const dsk_plan_layout *l, const dsk_plan_tp *tp) {
    double share = (l->tp - 1.0) / l->tp;
    return share * (2 * tp->all_reduce + tp->all_gather + tp->reduce_scatter) / (1e9 * c->intra_gbps) +
           tp->calls * 1e-6 * c->intra_latency_us;
}

static void check_layout(const dsk_plan_cluster *c, const dsk_plan_model *m, dsk_plan_layout l, const char *what) {
    dsk_plan_job job = {64, 4096};
    dsk_plan_flops st[8];
    dsk_plan_result r;
    dsk_plan_tp tp = {dsk_test_rand(1e7, 1e9), dsk_test_rand(1e7, 1e9), dsk_test_rand(1e7, 1e9),
                      (double)(int)dsk_test_rand(10, 400)};
    double f[64], b[64], want_f[64], want_b[64], busy[8], pipe = 0, slowest = -1, t = tp_s(c, &l, &tp);
    int p = l.pp, v = l.vstages, pace = 0, S = p * v;
    for (int s = 0; s < p; s++) { /* random stages, the MoE layers spread over the later ones */
        st[s].total = m->flops_per_token / p * dsk_test_rand(0.6, 1.4);
        st[s].attn = st[s].total / 6;
        st[s].fp8 = 0;
        st[s].moe_layers = m->moe_layers ? (s == 0 ? 0 : m->moe_layers / (p - 1) + (s <= m->moe_layers % (p - 1))) : 0;
    }
    for (int s = 0; s < p; s++) {
        dsk_plan_layout plain = l;
        double e = ep_s(c, &job, m, &l, st[s].moe_layers), fw;
        plain.recompute = DSK_PLAN_RECOMPUTE_NONE;
        busy[s] = compute_s(c, &job, &l, &st[s], 1) + e + t;
        fw = compute_s(c, &job, &plain, &st[s], 0) / 3 + (e + t) / 2;
        for (int k = 0; k < v; k++) {
            want_f[k * p + s] = fw / (l.micro * v);
            want_b[k * p + s] = (busy[s] - fw) / (l.micro * v);
        }
        if (busy[s] > slowest) slowest = busy[s], pace = s;
    }
    for (int i = 0; i < S; i++) f[i] = b[i] = -1;
    dsk_plan_stage_times(m, c, &job, &l, &tp, st, f, b);
    for (int i = 0; i < S; i++)
        DSK_TEST_EXPECT(fabs(f[i] - want_f[i]) <= 1e-12 * want_f[i] && fabs(b[i] - want_b[i]) <= 1e-12 * want_b[i],
                        "%s: stage %d forward %.9g backward %.9g s, want %.9g %.9g", what, i, f[i], b[i], want_f[i],
                        want_b[i]);
    /* r.pp_bytes is 0 here: CPU ranks' messages fit their rings (ahead), GPUs' meet in order */
    DSK_TEST_OK(dsk_par_schedule_time(l.schedule, p, l.micro, v, l.paired,
                                      c->cores_per_node > 0 ? DSK_PAR_TRANSFERS_AHEAD : DSK_PAR_TRANSFERS_IN_ORDER,
                                      want_f, want_b, 0.0, &pipe));
    memset(&r, 0, sizeof r);
    r.layout = l;
    r.lead_moe_layers = st[0].moe_layers;
    r.tp = tp;
    DSK_TEST_OK(dsk_plan_stages(m, c, &job, st, &r));
    DSK_TEST_EXPECT(fabs(r.pipe_s - pipe) <= 1e-12 * pipe, "%s: pipeline %.9g s, the lists timed here %.9g", what,
                    r.pipe_s, pipe);
    DSK_TEST_EXPECT(r.stage_flops.total == st[pace].total, "%s: pace stage %.6g FLOPs, want stage %d's %.6g", what,
                    r.stage_flops.total, pace, st[pace].total);
    DSK_TEST_OK(dsk_plan_time(m, c, &job, 0, &r));
    DSK_TEST_EXPECT(fabs(r.compute_s + r.ep_s + r.tp_s - busy[pace]) <= 1e-12 * busy[pace] &&
                        fabs(r.tp_s - t) <= 1e-12 * t,
                    "%s: compute %.9g + ep %.9g + tp %.9g s (want %.9g), the pace stage's busy time %.9g", what,
                    r.compute_s, r.ep_s, r.tp_s, t, busy[pace]);
    DSK_TEST_EXPECT(fabs(r.bubble_s - (pipe - busy[pace])) <= 1e-9 * pipe && r.bubble_s >= 0,
                    "%s: bubble %.9g s, want the pipeline %.9g less the pace stage's %.9g", what, r.bubble_s, pipe,
                    busy[pace]);
}

static void test_pipeline_timing(void) {
    dsk_plan_cluster c;
    dsk_plan_model dense = model(0), moe = model(6);
    DSK_TEST_OK(dsk_plan_cluster_parse(&c, k_cluster, strlen(k_cluster), "test cluster"));
    for (int round = 0; round < 3; round++) {
        check_layout(&c, &dense, layout(2, 4, 1, DSK_PAR_1F1B, DSK_PLAN_RECOMPUTE_NONE, 1), "dense pp2 1f1b m4");
        check_layout(&c, &dense, layout(4, 8, 1, DSK_PAR_GPIPE, DSK_PLAN_RECOMPUTE_FULL, 1), "dense pp4 gpipe full");
        check_layout(&c, &moe, layout(4, 8, 2, DSK_PAR_INTERLEAVED, DSK_PLAN_RECOMPUTE_ATTN, 2),
                     "moe pp4 interleaved v2 attn ep2");
        check_layout(&c, &moe, layout(3, 6, 1, DSK_PAR_1F1B, DSK_PLAN_RECOMPUTE_FULL, 4), "moe pp3 1f1b full ep4");
    }
    DSK_TEST_EXPECT(dsk_plan_transfers(&c, 0) == DSK_PAR_TRANSFERS_IN_ORDER, "GPUs' transfers ahead");
    c.cores_per_node = 2; /* CPU ranks: ahead while a message fits the node's rings */
    check_layout(&c, &moe, layout(4, 8, 2, DSK_PAR_INTERLEAVED, DSK_PLAN_RECOMPUTE_ATTN, 2), "cpu moe pp4 interleaved");
    DSK_TEST_EXPECT(dsk_plan_transfers(&c, (double)dsk_comm_host_ring_room(8)) == DSK_PAR_TRANSFERS_AHEAD &&
                        dsk_plan_transfers(&c, (double)dsk_comm_host_ring_room(8) + 1) == DSK_PAR_TRANSFERS_IN_ORDER &&
                        dsk_comm_host_ring_room(8) == (256 << 10) - 64,
                    "CPU transfers: room %lld", (long long)dsk_comm_host_ring_room(8));
}

/* A layout without a pipeline has no stages' times: dsk_plan_stages zeroes them and the bubble is 0. */
static void test_no_pipeline(void) {
    dsk_plan_cluster c;
    dsk_plan_model m = model(0);
    dsk_plan_job job = {64, 4096};
    dsk_plan_flops st = {6e9, 1e9, 0, 0, {0}};
    dsk_plan_result r;
    DSK_TEST_OK(dsk_plan_cluster_parse(&c, k_cluster, strlen(k_cluster), "test cluster"));
    memset(&r, 0, sizeof r);
    r.layout = layout(1, 4, 1, DSK_PAR_1F1B, DSK_PLAN_RECOMPUTE_NONE, 1);
    r.pipe_s = 5;
    DSK_TEST_OK(dsk_plan_stages(&m, &c, &job, &st, &r));
    DSK_TEST_EXPECT(r.pipe_s == 0 && r.stage_flops.total == 0, "pp 1: pipeline %g s, pace %g FLOPs", r.pipe_s,
                    r.stage_flops.total);
    DSK_TEST_OK(dsk_plan_time(&m, &c, &job, 0, &r));
    DSK_TEST_EXPECT(r.bubble_s == 0 && r.compute_s > 0, "pp 1: bubble %g s, compute %g s", r.bubble_s, r.compute_s);
}

static void test_time_without_stages(void) {
    dsk_plan_cluster c;
    dsk_plan_model m = model(0);
    dsk_plan_job job = {64, 4096};
    dsk_plan_result r;
    DSK_TEST_OK(dsk_plan_cluster_parse(&c, k_cluster, strlen(k_cluster), "test cluster"));
    memset(&r, 0, sizeof r);
    r.layout = layout(4, 8, 1, DSK_PAR_1F1B, DSK_PLAN_RECOMPUTE_NONE, 1);
    r.step_s = -3;
    DSK_TEST_STATUS(dsk_plan_time(&m, &c, &job, 0, &r), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("pipeline of 4 stages without its stages' times (dsk_plan_stages first)");
    DSK_TEST_EXPECT(r.step_s == -3, "a refused call wrote step %g", r.step_s);
}

int main(void) {
    dsk_test_init("test_plan_time");
    DSK_TEST_RUN(test_pipeline_timing);
    DSK_TEST_RUN(test_no_pipeline);
    DSK_TEST_RUN(test_time_without_stages);
    return dsk_test_finish();
}
