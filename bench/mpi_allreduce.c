/* mpi_allreduce.c - comm_bench's peer: Open MPI's collectives (float sum, out of place) timed
   the way comm_bench times dsk: warm-up, 5 repeats of k calls, the median per call, the
   slowest rank. Sizes follow nccl-tests and comm_bench: all_reduce buffer, reduce_scatter
   input, all_gather output and all_to_all buffer, rounded down to a multiple of 4 x ranks.
   Prints "mpi <collective> <bytes> <microseconds>" per size ("mpi barrier 0 <us>" for the
   barrier). Built with mpicc by the Makefile block for comm_bench; comm_bench runs it under
   mpirun in the same run, alternating with its own.
   Usage: mpirun -np N mpi_allreduce MIN_BYTES MAX_BYTES FACTOR [all_reduce|reduce_scatter|
          all_gather|all_to_all|barrier ...]   (sizes MIN * FACTOR^k, then MAX; default all_reduce) */
#include "bench_util.h"
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Calls per repeat: enough that a repeat moves 64 MiB, at least 1, at most 1000. */
static int calls_for(long long bytes) {
    long long k = bytes > 0 ? (64ll << 20) / bytes : 1000;
    return (int)(k < 1 ? 1 : k > 1000 ? 1000 : k);
}

static void run(const char *coll, float *send, float *recv, long long bytes, int size) {
    int count = (int)(bytes / 4), per = count / size;
    if (!strcmp(coll, "all_reduce")) MPI_Allreduce(send, recv, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    else if (!strcmp(coll, "reduce_scatter"))
        MPI_Reduce_scatter_block(send, recv, per, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    else if (!strcmp(coll, "all_gather")) MPI_Allgather(send, per, MPI_FLOAT, recv, per, MPI_FLOAT, MPI_COMM_WORLD);
    else if (!strcmp(coll, "all_to_all")) MPI_Alltoall(send, per, MPI_FLOAT, recv, per, MPI_FLOAT, MPI_COMM_WORLD);
    else MPI_Barrier(MPI_COMM_WORLD);
}

/* Median seconds per call over 5 repeats, the slowest rank's. */
static double time_coll(const char *coll, float *send, float *recv, long long bytes, int size) {
    int k = calls_for(bytes);
    double t[5], med, worst;
    run(coll, send, recv, bytes, size);
    for (int r = 0; r < 5; r++) {
        double t0;
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = MPI_Wtime();
        for (int i = 0; i < k; i++) run(coll, send, recv, bytes, size);
        t[r] = (MPI_Wtime() - t0) / k;
    }
    med = bench_median(t, 5);
    MPI_Allreduce(&med, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return worst;
}

int main(int argc, char **argv) {
    int rank, size;
    long long lo = argc > 1 ? atoll(argv[1]) : 8, hi = argc > 2 ? atoll(argv[2]) : (256ll << 20);
    int factor = argc > 3 ? atoi(argv[3]) : 4;
    float *send, *recv;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    send = (float *)malloc((size_t)hi);
    recv = (float *)malloc((size_t)hi);
    for (long long i = 0; i < hi / 4; i++) send[i] = (float)(rank + 1);
    memset(recv, 0, (size_t)hi);
    if (factor < 2) factor = 2;
    for (int c = argc > 4 ? 4 : 0; c < (argc > 4 ? argc : 1); c++) {
        const char *coll = argc > 4 ? argv[c] : "all_reduce";
        if (!strcmp(coll, "barrier")) {
            double t = time_coll(coll, send, recv, 0, size);
            if (rank == 0) printf("mpi barrier 0 %.3f\n", t * 1e6);
            fflush(stdout);
            continue;
        }
        for (long long bytes = lo; bytes; bytes = bytes >= hi ? 0 : bytes * factor < hi ? bytes * factor : hi) {
            long long eff = bytes / (4ll * size) * (4ll * size);
            double t;
            if (eff == 0) continue;
            t = time_coll(coll, send, recv, eff, size);
            if (rank == 0) printf("mpi %s %lld %.3f\n", coll, bytes, t * 1e6);
            fflush(stdout);
        }
    }
    free(send);
    free(recv);
    MPI_Finalize();
    return 0;
}
