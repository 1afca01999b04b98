/* tests/test_moe_golden.c - the CPU MoE layer bit for bit against the layer before issue 13's
   redesign: every output, gradient, loss and count of tests/golden/moe_cpu.txt (written by
   tests/golden/gen_moe_golden.c from dsk_moe.h of commit 7a9d942) over 12 configurations:
   routing modes, group rules, loss rules, capacity by weight and by position, shared experts,
   bf16, expert parallelism over 2 and 4 ranks; two calls each (gradients accumulating, T
   changing), then the bias update. The layer runs on a context with cpu_isa =
   DSK_CPU_ISA_PORTABLE, the GEMM micro-kernel the generator used: its bits are the same on any
   x86-64 (AVX2 or AVX-512 would change them; see tests/golden/gen_moe_golden.c). */
#define _POSIX_C_SOURCE 200809L /* mkdtemp, readlink, dirent: the library is linked, not included */
#include "dsk_moe.h"
#include "tests/dsk_test.h"
#include "tests/golden/moe_golden_cases.h"
#include <sys/wait.h>
#include <unistd.h>

#define GOLDEN_FILE "tests/golden/moe_cpu.txt"

static int fail_msg(FILE *f, const char *what) {
    fprintf(f, "error %s: %s\n", what, dsk_last_error());
    return 1;
}

/* One rank of one case, through the new API (parameters bound into slabs this test owns). */
static int run_rank(const golden_case *c, int rank, dsk_comm *ep, FILE *f) {
    dsk_moe m;
    dsk_moe_opts o = golden_opts(c);
    dsk_tensor values, grads;
    int64_t vb, gd, gs;
    dsk_ctx ctx;
    dsk_ctx_opts co;
    memset(&co, 0, sizeof co);
    co.device = DSK_PREFER_CPU;
    co.cpu_isa = DSK_CPU_ISA_PORTABLE; /* the generator's micro-kernel */
    if (dsk_ctx_init(&ctx, &co) != DSK_OK) return fail_msg(f, "ctx");
    o.ep = ep;
    if (dsk_moe_init(&m, &ctx, &o) != DSK_OK) return fail_msg(f, "init");
    dsk_moe_slab_sizes(&m, &vb, &gd, &gs);
    gs += gd;
    if (dsk_tensor_alloc(NULL, &values, DSK_U8, 1, &vb) != DSK_OK || dsk_tensor_alloc(NULL, &grads, DSK_F32, 1, &gs) != DSK_OK ||
        dsk_moe_bind_slabs(&m, &ctx, &values, &grads) != DSK_OK || dsk_tensor_fill(NULL, &grads, 0.0) != DSK_OK)
        return fail_msg(f, "bind");
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
        dsk_tensor_fill(NULL, &y, NAN);
        if (dsk_moe_forward(&m, &ctx, &y, &x, &st) != DSK_OK) return fail_msg(f, "forward");
        snprintf(w, sizeof w, "call%d.y", call);
        golden_emit(f, c, rank, w, y.data, c->dtype, (int64_t)T * c->D);
        snprintf(w, sizeof w, "call%d.stats", call);
        golden_emit_stats(f, c, rank, w, &st);
        if (dsk_moe_backward(&m, &ctx, &dx, &dy, 0.75f) != DSK_OK) return fail_msg(f, "backward");
        snprintf(w, sizeof w, "call%d.dx", call);
        golden_emit(f, c, rank, w, dx.data, c->dtype, (int64_t)T * c->D);
        for (int i = 0; i < m.n_params; i++) {
            dsk_moe_param *p = &m.params[i];
            if (!p->trainable) continue;
            snprintf(w, sizeof w, "call%d.grad.%s", call, p->name + 4);
            golden_emit(f, c, rank, w, p->grad.data, DSK_F32, dsk_tensor_numel(&p->grad));
        }
        dsk_tensor_free(NULL, &x); dsk_tensor_free(NULL, &y); dsk_tensor_free(NULL, &dx); dsk_tensor_free(NULL, &dy);
    }
    if (dsk_moe_update_bias(&m, &ctx, ep) != DSK_OK) return fail_msg(f, "update_bias");
    golden_emit(f, c, rank, "bias", m.bias->value.data, DSK_F32, c->E);
    dsk_moe_free(&m, &ctx);
    dsk_tensor_free(NULL, &values);
    dsk_tensor_free(NULL, &grads);
    dsk_ctx_free(&ctx);
    return 0;
}

/* Runs a case's ranks as forked processes (the parent never starts OpenMP, whose thread pool
   would not survive a fork), their records into one file, rank by rank. */
static int run_case(const golden_case *c, const char *out) {
    int port = 0, bad = 0;
    char path[8][96];
    FILE *all = fopen(out, "w");
    if (!all) return 1;
    if (c->ep > 1 && dsk_comm_free_port("127.0.0.1", &port) != DSK_OK) { fclose(all); return 1; }
    for (int r = 0; r < c->ep; r++) {
        snprintf(path[r], sizeof path[r], "%s.%d", out, r);
        if (fork() == 0) {
            dsk_comm comm;
            dsk_comm_opts co;
            FILE *f = fopen(path[r], "w");
            int rc;
            memset(&co, 0, sizeof co);
            co.backend = DSK_COMM_HOST; co.master_addr = "127.0.0.1"; co.master_port = port; co.timeout_s = 60;
            if (!f) _exit(2);
            if (c->ep == 1) _exit(run_rank(c, 0, NULL, f) || fclose(f));
            if (dsk_comm_init(&comm, r, c->ep, &co) != DSK_OK) _exit(fail_msg(f, "comm") + fclose(f));
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
    for (int r = 0; r < c->ep; r++) {
        FILE *f = fopen(path[r], "r");
        char line[512];
        while (f && fgets(line, sizeof line, f)) fputs(line, all);
        if (f) fclose(f);
        remove(path[r]);
    }
    fclose(all);
    return bad;
}

/* The golden file's lines of case `name`, in order, compared with the file `got`. */
static void check_case(const golden_case *c, const char *got) {
    FILE *g = fopen(GOLDEN_FILE, "r"), *h = fopen(got, "r");
    char want[512], line[512], prefix[96];
    int n = 0, same = 0, first_bad = 0;
    char bad_want[512] = "", bad_got[512] = "";
    snprintf(prefix, sizeof prefix, "%s ", c->name);
    if (!g || !h) {
        dsk_test_fail_at(__FILE__, __LINE__, "cannot open %s or %s", GOLDEN_FILE, got);
        if (g) fclose(g);
        if (h) fclose(h);
        return;
    }
    while (fgets(want, sizeof want, g)) {
        if (strncmp(want, prefix, strlen(prefix))) continue;
        n++;
        if (!fgets(line, sizeof line, h)) line[0] = 0;
        if (!strcmp(line, want)) same++;
        else if (!first_bad++) {
            snprintf(bad_want, sizeof bad_want, "%s", want);
            snprintf(bad_got, sizeof bad_got, "%s", line);
        }
    }
    if (fgets(line, sizeof line, h)) n++; /* more lines than the golden file has */
    fclose(g);
    fclose(h);
    DSK_TEST_EXPECT(n >= 15, "%d golden lines for the case", n);
    DSK_TEST_EXPECT(same == n, "%d of %d records differ; first: want %s     got %s", n - same, n, bad_want, bad_got);
}

int main(void) {
    char dir[] = "/tmp/test_moe_golden.XXXXXX", path[GOLDEN_N_CASES][128];
    int rc[GOLDEN_N_CASES];
    dsk_test_init("test_moe_golden");
    if (!mkdtemp(dir)) { fprintf(stderr, "test_moe_golden: mkdtemp failed\n"); return 1; }
    for (int i = 0; i < GOLDEN_N_CASES; i++) { /* every fork before any check */
        snprintf(path[i], sizeof path[i], "%s/%s", dir, golden_cases[i].name);
        rc[i] = run_case(&golden_cases[i], path[i]);
    }
    for (int i = 0; i < GOLDEN_N_CASES; i++) {
        const golden_case *c = &golden_cases[i];
        dsk_test_begin("golden %s (%d rank%s, %s): bitwise equal to the layer before the redesign", c->name, c->ep,
                       c->ep > 1 ? "s" : "", dsk_dtype_name(c->dtype));
        DSK_TEST_EXPECT(rc[i] == 0, "a rank failed (its error is in %s)", path[i]);
        check_case(c, path[i]);
        dsk_test_end();
        if (rc[i] == 0) remove(path[i]);
    }
    rmdir(dir);
    return dsk_test_finish();
}
