/* tests/golden/gen_moe_golden.c - writes tests/golden/moe_cpu.txt from the MoE layer as it was
   before issue 13's redesign (dsk_moe.h of commit 7a9d942, with the issue-10 fixes), for
   tests/test_moe_golden.c to hold the rebuilt layer to, bit for bit, on the CPU.
   How it was used (tests/golden/make_moe_golden.sh does exactly this):
       git show 7a9d942:dsk_moe.h > OLD/dsk_moe.h
       gcc -std=c11 -O2 -fopenmp -D_GNU_SOURCE -IOLD -I. tests/golden/gen_moe_golden.c -lm -lpthread
       ./a.out > tests/golden/moe_cpu.txt
   The old layer builds against this tree's dsk_tensor.h, whose scalar math (dsk_swiglu_grad_f,
   ...) it shares with the new one; its only CPU product, dsk_sgemm_cpu, is redirected below to
   the portable micro-kernel (dsk_sgemm_cpu picks the best one this CPU has), and the test runs
   the new layer on a context with cpu_isa = DSK_CPU_ISA_PORTABLE: the records then hold on any
   x86-64, AVX2 or AVX-512. The layer's own code has no FMA contraction (-std=c11 keeps
   -ffp-contract=off). Rerun the script when dsk_tensor.h's portable GEMM or scalar math change
   their bits (it was last rerun for perf's dsk_silu_grad_f with one explicit FMA). */
#define DSK_TENSOR_IMPLEMENTATION
#define DSK_COMM_IMPLEMENTATION
#include "dsk_tensor.h"
#include "dsk_comm.h"

/* dsk_sgemm_cpu on the portable micro-kernel (the old layer calls it for every product). */
static void gen_sgemm_portable(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
                               int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc,
                               int n_threads) {
    dsk__gemm_args g = dsk__sgemm_args(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    dsk__ukernel uk = dsk__ukernel_for(DSK_CPU_ISA_PORTABLE);
    if (dsk__gemm(&g, &uk, n_threads > 0 ? n_threads : dsk__default_threads()) != DSK_OK) dsk__gemm_unpacked(&g);
}
#define dsk_sgemm_cpu gen_sgemm_portable
#define DSK_MOE_IMPLEMENTATION
#include "dsk_moe.h"
#include "tests/golden/moe_golden_cases.h"
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static int fail_msg(const char *what) {
    fprintf(stderr, "gen_moe_golden: %s: %s\n", what, dsk_last_error());
    return 1;
}

/* One rank of one case: everything the case records, into f. */
static int run_rank(const golden_case *c, int rank, dsk_comm *ep, FILE *f) {
    dsk_moe m;
    dsk_moe_opts o = golden_opts(c);
    o.ep = ep;
    if (dsk_moe_init(&m, NULL, &o) != DSK_OK) return fail_msg("init");
    for (int i = 0; i < m.n_params; i++) {
        dsk_moe_param *p = &m.params[i];
        const char *suffix = p->name + 4; /* after "moe." */
        float r = golden_range(c, suffix);
        int64_t n = dsk_tensor_numel(&p->value);
        uint64_t first = p->expert_sharded ? (uint64_t)m.expert0 * (uint64_t)(n / m.n_local) : 0;
        golden_fill(p->value.data, p->value.dtype, n, suffix, first, -r, r);
    }
    for (int call = 0; call < 2; call++) {
        int T = call ? c->T2 : c->T;
        int64_t shp[2] = {T, c->D};
        dsk_tensor x, y, dx, dy;
        dsk_moe_stats st;
        char w[64];
        dsk_tensor_alloc(NULL, &x, c->dtype, 2, shp);
        dsk_tensor_alloc(NULL, &y, c->dtype, 2, shp);
        dsk_tensor_alloc(NULL, &dx, c->dtype, 2, shp);
        dsk_tensor_alloc(NULL, &dy, c->dtype, 2, shp);
        golden_input(c, call, rank, "x", x.data);
        golden_input(c, call, rank, "dy", dy.data);
        dsk_tensor_fill(NULL, &dx, 0.0);
        if (dsk_moe_forward(&m, NULL, &y, &x, &st) != DSK_OK) return fail_msg("forward");
        snprintf(w, sizeof w, "call%d.y", call);
        golden_emit(f, c, rank, w, y.data, c->dtype, (int64_t)T * c->D);
        snprintf(w, sizeof w, "call%d.stats", call);
        golden_emit_stats(f, c, rank, w, &st);
        if (dsk_moe_backward(&m, NULL, &dx, &dy, 0.75f) != DSK_OK) return fail_msg("backward");
        snprintf(w, sizeof w, "call%d.dx", call);
        golden_emit(f, c, rank, w, dx.data, c->dtype, (int64_t)T * c->D);
        for (int i = 0; i < m.n_params; i++) {
            dsk_moe_param *p = &m.params[i];
            if (dsk_tensor_numel(&p->grad) == 0) continue;
            snprintf(w, sizeof w, "call%d.grad.%s", call, p->name + 4);
            golden_emit(f, c, rank, w, p->grad.data, DSK_F32, dsk_tensor_numel(&p->grad));
        }
        dsk_tensor_free(NULL, &x); dsk_tensor_free(NULL, &y); dsk_tensor_free(NULL, &dx); dsk_tensor_free(NULL, &dy);
    }
    if (dsk_moe_update_bias(&m, NULL, ep) != DSK_OK) return fail_msg("update_bias");
    golden_emit(f, c, rank, "bias", m.bias->value.data, DSK_F32, c->E);
    dsk_moe_free(&m, NULL);
    return 0;
}

/* The ranks of a case as forked processes (over the host backend when there are several), each
   writing its own file; the files are then copied to stdout in rank order. The parent never
   starts OpenMP threads, whose pool would not survive the next fork. */
static int run_case(const golden_case *c) {
    int port = 0, bad = 0;
    char path[8][64];
    if (c->ep > 1 && dsk_comm_free_port("127.0.0.1", &port) != DSK_OK) return fail_msg("free port");
    fflush(stdout);
    for (int r = 0; r < c->ep; r++) {
        snprintf(path[r], sizeof path[r], "/tmp/gen_moe_golden.%d.%d", (int)getpid(), r);
        if (fork() == 0) {
            dsk_comm comm;
            dsk_comm_opts co;
            FILE *f = fopen(path[r], "w");
            int rc;
            memset(&co, 0, sizeof co);
            co.backend = DSK_COMM_HOST; co.master_addr = "127.0.0.1"; co.master_port = port; co.timeout_s = 60;
            if (!f) _exit(fail_msg("output file"));
            if (c->ep == 1) _exit(run_rank(c, 0, NULL, f) || fclose(f));
            if (dsk_comm_init(&comm, r, c->ep, &co) != DSK_OK) _exit(fail_msg("comm"));
            rc = run_rank(c, r, &comm, f);
            fclose(f);
            dsk_comm_free(&comm);
            _exit(rc);
        }
    }
    for (int r = 0; r < c->ep; r++) {
        int status = 0;
        if (wait(&status) < 0 || !WIFEXITED(status) || WEXITSTATUS(status)) bad = 1;
    }
    for (int r = 0; r < c->ep && !bad; r++) {
        FILE *f = fopen(path[r], "r");
        char line[512];
        while (f && fgets(line, sizeof line, f)) fputs(line, stdout);
        if (f) fclose(f);
        remove(path[r]);
    }
    return bad;
}

int main(void) {
    printf("# MoE golden records (tests/golden/gen_moe_golden.c on dsk_moe.h of commit 7a9d942)\n");
    for (int i = 0; i < GOLDEN_N_CASES; i++)
        if (run_case(&golden_cases[i])) return 1;
    return 0;
}
