/* mpi_allreduce.c - comm_bench's peer: Open MPI's MPI_Allreduce (float sum, out of place)
   timed the way comm_bench times dsk: warm-up, 5 repeats of k calls, the median per call,
   the slowest rank. Prints "mpi <bytes> <microseconds>" per size. Built with mpicc by the
   Makefile block for comm_bench; comm_bench runs it under mpirun in the same run.
   Usage: mpirun -np N mpi_allreduce MIN_BYTES MAX_BYTES FACTOR (sizes MIN * FACTOR^k, then MAX) */
#include "bench_util.h"
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    for (long long bytes = lo; bytes; bytes = bytes >= hi ? 0 : bytes * factor < hi ? bytes * factor : hi) {
        int count = (int)(bytes / 4), k = (int)(bytes >= (64ll << 20) ? 1 : (64ll << 20) / bytes > 50 ? 50 : (64ll << 20) / bytes);
        double t[5], med, worst;
        MPI_Allreduce(send, recv, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        for (int r = 0; r < 5; r++) {
            double t0;
            MPI_Barrier(MPI_COMM_WORLD);
            t0 = MPI_Wtime();
            for (int i = 0; i < k; i++) MPI_Allreduce(send, recv, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            t[r] = (MPI_Wtime() - t0) / k;
        }
        med = bench_median(t, 5);
        MPI_Allreduce(&med, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (rank == 0) printf("mpi %lld %.3f\n", bytes, worst * 1e6);
        fflush(stdout);
    }
    free(send);
    free(recv);
    MPI_Finalize();
    return 0;
}
