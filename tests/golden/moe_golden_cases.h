/* tests/golden/moe_golden_cases.h - the configurations, inputs and output records of the MoE
   golden test, shared by the generator (gen_moe_golden.c, built against the dsk_moe.h of
   commit 7a9d942, the layer before issue 13's redesign) and tests/test_moe_golden.c (the
   current layer). Each case sets every parameter and input from the counter-based RNG by name,
   runs forward and backward twice (the second call with fewer tokens, gradients accumulating),
   then the bias update, and records every output as one line:
       <case> <rank> <what> <elements> <FNV-1a 64 of the bytes> <sum as %a>
   so the golden file stays small while any changed bit changes a line. Parameters are written
   through dsk_store_f32 in their dtype; expert e of a sharded parameter reads the numbers of
   its global position, so a rank of an expert-parallel group holds what one rank would. */
#ifndef MOE_GOLDEN_CASES_H
#define MOE_GOLDEN_CASES_H

#include <stdio.h>
#include <string.h>

typedef struct golden_case {
    const char *name;
    int T, T2;             /* tokens per rank of the first and the second call */
    int D, E, K, F, n_shared, Fs;
    dsk_moe_score score;
    int norm;              /* dsk_moe_norm */
    float scale;
    int n_group, topk_group;
    int rule;              /* dsk_moe_group_rule */
    float aux, seq_aux, z;
    int64_t seq_len;
    int count;             /* dsk_moe_loss_count */
    float cf;
    int drop;              /* dsk_moe_drop */
    dsk_dtype dtype;
    int ep;                /* expert-parallel ranks (1: none) */
    float bias_mag;        /* the expert bias ~ U(-bias_mag, bias_mag) */
} golden_case;

/*            name                 T  T2  D  E  K  F sh  Fs  score             norm scale grp tkg rule aux  seq   z    L cnt cf   drop dtype    ep bias */
static const golden_case golden_cases[] = {
    {"softmax_plain",             13, 10, 16, 8, 2, 12, 0, 0,  DSK_MOE_SOFTMAX, 0, 0,    1, 1, 0, 0.01f, 0,    0.001f, 0, 0, 0,    0, DSK_F32,  1, 0.02f},
    {"softmax_shared_aux",        13, 10, 16, 8, 3, 12, 1, 10, DSK_MOE_SOFTMAX, 0, 1.5f, 1, 1, 0, 0.02f, 0,    0.002f, 0, 1, 0,    0, DSK_F32,  1, 0.02f},
    {"sigmoid_v3_groups_seq",     12,  8, 16, 8, 3, 12, 1, 10, DSK_MOE_SIGMOID, 0, 2.5f, 4, 2, 0, 0,     0.01f, 0,     4, 0, 0,    0, DSK_F32,  1, 0.05f},
    {"sigmoid_max_rule_cap_prob", 13, 11, 16, 8, 2, 12, 2, 6,  DSK_MOE_SIGMOID, 1, 1.0f, 4, 2, 1, 0.01f, 0,    0.001f, 0, 0, 0.5f, 0, DSK_F32,  1, 0.05f},
    {"softmax_cap_position",      13,  9, 16, 8, 2, 12, 0, 0,  DSK_MOE_SOFTMAX, 0, 1.0f, 1, 1, 0, 0.01f, 0,    0,      0, 0, 1.0f, 1, DSK_F32,  1, 0.02f},
    {"megatron_rule_selected",    13, 10, 16, 12, 4, 8, 1, 8,  DSK_MOE_SIGMOID, 0, 1.0f, 4, 2, 2, 0.01f, 0,    0.001f, 0, 1, 0,    0, DSK_F32,  1, 0.05f},
    {"bf16_sigmoid_groups_cap",   12,  8, 16, 8, 3, 12, 1, 10, DSK_MOE_SIGMOID, 0, 2.5f, 4, 2, 0, 0.01f, 0.01f, 0.001f, 4, 0, 0.75f, 0, DSK_BF16, 1, 0.05f},
    {"bf16_softmax_aux",          13, 10, 16, 8, 2, 12, 1, 10, DSK_MOE_SOFTMAX, 0, 1.0f, 1, 1, 0, 0.01f, 0,    0.001f, 0, 0, 0,    0, DSK_BF16, 1, 0.02f},
    {"ep2_softmax_shared",        13, 10, 16, 8, 3, 12, 1, 10, DSK_MOE_SOFTMAX, 0, 1.0f, 1, 1, 0, 0.01f, 0,    0.001f, 0, 0, 0,    0, DSK_F32,  2, 0.02f},
    {"ep4_sigmoid_groups_seq",    12,  8, 16, 8, 3, 12, 1, 10, DSK_MOE_SIGMOID, 0, 2.5f, 4, 2, 0, 0.01f, 0.01f, 0.001f, 4, 0, 0,    0, DSK_F32,  4, 0.05f},
    {"ep2_bf16_cap_prob",         13, 10, 16, 8, 2, 12, 1, 10, DSK_MOE_SIGMOID, 0, 1.0f, 4, 2, 0, 0.01f, 0,    0.001f, 0, 0, 0.75f, 0, DSK_BF16, 2, 0.05f},
    {"ep4_softmax_cap_position",  13,  9, 16, 8, 2, 12, 0, 0,  DSK_MOE_SOFTMAX, 0, 1.0f, 1, 1, 0, 0.01f, 0,    0,      0, 0, 1.0f, 1, DSK_F32,  4, 0.02f},
};
#define GOLDEN_N_CASES ((int)(sizeof golden_cases / sizeof golden_cases[0]))

static dsk_moe_opts golden_opts(const golden_case *c) {
    dsk_moe_opts o;
    memset(&o, 0, sizeof o);
    o.name = "moe";
    o.d_model = c->D; o.n_routed = c->E; o.top_k = c->K; o.d_expert = c->F;
    o.n_shared = c->n_shared; o.d_shared = c->n_shared ? c->Fs / c->n_shared : 0;
    o.score = c->score; o.norm = (dsk_moe_norm)c->norm; o.routed_scale = c->scale;
    o.n_group = c->n_group; o.topk_group = c->topk_group; o.group_rule = (dsk_moe_group_rule)c->rule;
    o.aux_alpha = c->aux; o.seq_aux_alpha = c->seq_aux; o.z_beta = c->z; o.seq_len = c->seq_len;
    o.loss_count = (dsk_moe_loss_count)c->count;
    o.capacity_factor = c->cf; o.drop = (dsk_moe_drop)c->drop;
    o.dtype = c->dtype;
    o.bias_rate = 0.01f;
    o.seed = 5;
    return o;
}

/* A stream number for a name (FNV-1a 32). */
static uint64_t golden_stream(const char *name) {
    uint32_t h = 2166136261u;
    for (const char *p = name; *p; p++) h = (h ^ (uint8_t)*p) * 16777619u;
    return (uint64_t)h << 20;
}

/* n elements of dtype dt at dst (CPU) <- U(lo, hi) of stream `name`, starting at element `first`. */
static void golden_fill(void *dst, dsk_dtype dt, int64_t n, const char *name, uint64_t first, float lo, float hi) {
    for (int64_t i = 0; i < n; i++)
        dsk_store_f32(dst, dt, i, lo + (hi - lo) * dsk_rng_uniform_at(11, golden_stream(name), first + (uint64_t)i));
}

/* The value range of a parameter by its name suffix ("router", "bias", "w1", "shared.w2", ...). */
static float golden_range(const golden_case *c, const char *suffix) {
    if (!strcmp(suffix, "bias")) return c->bias_mag;
    if (!strcmp(suffix, "router")) return 0.5f;
    return 0.3f;
}

static uint64_t golden_fnv(const void *p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ ((const uint8_t *)p)[i]) * 1099511628211ull;
    return h;
}

/* One record line: the bytes of n elements of dt (CPU memory). */
static void golden_emit(FILE *f, const golden_case *c, int rank, const char *what, const void *p, dsk_dtype dt,
                        int64_t n) {
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += dsk_load_f64(p, dt, i);
    fprintf(f, "%s %d %s %lld %016llx %a\n", c->name, rank, what, (long long)n,
            (unsigned long long)golden_fnv(p, (size_t)n * dsk_dtype_size(dt)), sum);
}

/* The statistics of a forward: loss terms bit for bit, counts exactly. */
static void golden_emit_stats(FILE *f, const golden_case *c, int rank, const char *what, const dsk_moe_stats *st) {
    double l[4] = {st->aux_loss, st->seq_aux_loss, st->z_loss, st->loss};
    int64_t n[3] = {st->tokens, st->slots, st->dropped};
    char w[96];
    snprintf(w, sizeof w, "%s.losses", what);
    golden_emit(f, c, rank, w, l, DSK_F64, 4);
    snprintf(w, sizeof w, "%s.counts", what);
    golden_emit(f, c, rank, w, n, DSK_I64, 3);
    snprintf(w, sizeof w, "%s.loads", what);
    golden_emit(f, c, rank, w, st->tokens_per_expert, DSK_I64, c->E);
}

/* x or dy of call `call` (0, 1) for rank r: rows [r T, (r + 1) T) of the global batch. */
static void golden_input(const golden_case *c, int call, int rank, const char *what, void *dst) {
    int T = call ? c->T2 : c->T;
    char name[32];
    snprintf(name, sizeof name, "%s%d", what, call);
    golden_fill(dst, c->dtype, (int64_t)T * c->D, name, (uint64_t)rank * T * c->D, -1.0f, 1.0f);
}

#endif /* MOE_GOLDEN_CASES_H */
