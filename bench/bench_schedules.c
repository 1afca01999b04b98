/* bench_schedules.c - the pipeline schedules' step against 1F1B's, as dsk_par_schedule_time runs every rank's list
   (dsk_par.h, "Timed"): p ranks, m micro-batches, a chunk of a stage F = 1 and B = 2 time units (a 1F1B stage
   holds two chunks: F 2, B 4), no link time, each rank's ideal busy time 6 m. For 1F1B, interleaved (2 chunks a
   rank), DualPipeV and the paired lists of both, with the transfers in each list's order (nccl) and with the
   receives ahead (the host backend's buffered messages): the idle units (step - 6 m) and their ratio to 1F1B's
   (p - 1)(F + B) of the same run. Beside them the DualPipe paper's bubble for DualPipeV, (p - 1)(F&B + B - 3W),
   with F&B = F + B (a forward and a backward run one after the other, as on CPU ranks) and W = 0 (no split
   backward). A model of the lists, not of a machine: it runs in microseconds and needs no peer program.
   Usage: bench_schedules [--micro-per-rank K]   (m = K p; default 2 and 4). Not part of `make test`. */
#define _POSIX_C_SOURCE 200809L
#define DSK_TENSOR_IMPLEMENTATION
#define DSK_COMM_IMPLEMENTATION
#define DSK_PAR_IMPLEMENTATION
#include "dsk_par.h"
#include "bench_util.h"
#include <string.h>

/* Idle units of one schedule's lists (chunks f 1, b 2; 1F1B's stages f 2, b 4). */
static double idle_units(dsk_par_schedule_kind kind, int p, int m, int paired, dsk_par_transfers tr) {
    double f[64], b[64], step;
    int v = kind == DSK_PAR_1F1B ? 1 : 2;
    for (int s = 0; s < p * v; s++) f[s] = 2.0 / v, b[s] = 4.0 / v; /* a 1F1B stage is two chunks */
    BENCH_CHECK(dsk_par_schedule_time(kind, p, m, v, paired, tr, f, b, 0.0, &step));
    return step - 6.0 * m;
}

int main(int argc, char **argv) {
    int ks[2] = {2, 4}, nk = 2, ps[3] = {2, 4, 8};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--micro-per-rank") && i + 1 < argc) ks[0] = atoi(argv[++i]), nk = 1;
        else {
            fprintf(stderr, "usage: %s [--micro-per-rank K]\n", argv[0]);
            return 2;
        }
    }
    if (ks[0] < 2) {
        fprintf(stderr, "bench_schedules: --micro-per-rank %d: DualPipeV needs 2 or more\n", ks[0]);
        return 2;
    }
    printf("# bench_schedules: idle time units of a step (chunk F 1, B 2; ideal 6 m a rank), ratio to 1F1B's\n");
    printf("| p | m | transfers | 1F1B | interleaved v2 | DualPipeV | interleaved paired | DualPipeV paired | "
           "DualPipe paper, DualPipeV |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for (int a = 0; a < 3; a++)
        for (int k = 0; k < nk; k++)
            for (int t = 0; t < 2; t++) {
                int p = ps[a], m = ks[k] * p;
                dsk_par_transfers tr = t ? DSK_PAR_TRANSFERS_AHEAD : DSK_PAR_TRANSFERS_IN_ORDER;
                double base = idle_units(DSK_PAR_1F1B, p, m, 0, tr);
                double il = idle_units(DSK_PAR_INTERLEAVED, p, m, 0, tr),
                       dv = idle_units(DSK_PAR_DUALPIPE_V, p, m, 0, tr);
                double ilp = idle_units(DSK_PAR_INTERLEAVED, p, m, 1, tr);
                double dvp = idle_units(DSK_PAR_DUALPIPE_V, p, m, 1, tr);
                printf("| %d | %d | %s | %.0f | %.0f (%.2fx) | %.0f (%.2fx) | %.0f (%.2fx) | %.0f (%.2fx) | %d (%.2fx) "
                       "|\n",
                       p, m, t ? "ahead" : "in order", base, il, il / base, dv, dv / base, ilp, ilp / base, dvp,
                       dvp / base, 5 * (p - 1), 5.0 * (p - 1) / base);
            }
    return 0;
}
