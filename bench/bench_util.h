/* bench_util.h - what every program in bench/ needs: a monotonic and a CPU-time clock, the median
   of repeated timings and a check that stops the run on a failed dsk call. Static inline, nothing
   to link.
   BENCH_CHECK names dsk_status, dsk_status_str and dsk_last_error: include a dsk header first
   where it is used (mpi_allreduce.c, Open MPI's peer without dsk, uses bench_median only). */
#ifndef BENCH_UTIL_H
#define BENCH_UTIL_H
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static inline double bench__clock_s(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Seconds on CLOCK_MONOTONIC (an arbitrary origin: subtract two readings). */
static inline double bench_now_s(void) { return bench__clock_s(CLOCK_MONOTONIC); }

/* CPU seconds of every thread of the process (a load-independent view of the CPU's work). */
static inline double bench_cpu_s(void) { return bench__clock_s(CLOCK_PROCESS_CPUTIME_ID); }

static inline int bench__cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of v[0..n) (n >= 1); sorts v in place. Even n: the mean of the two middle values. */
static inline double bench_median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, bench__cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Evaluates a dsk call once; on failure prints file:line, the status name and dsk_last_error()
   to stderr and exits 1. */
#define BENCH_CHECK(call)                                                                             \
    do {                                                                                              \
        dsk_status bench_s_ = (call);                                                                 \
        if (bench_s_ != DSK_OK) {                                                                     \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, dsk_status_str(bench_s_), dsk_last_error()); \
            exit(1);                                                                                  \
        }                                                                                             \
    } while (0)

#endif /* BENCH_UTIL_H */
