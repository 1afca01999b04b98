/* train/timer.h - the phase timer of examples/train_model.h (--profile): wall and process CPU
   clocks and TM_T, which times one call into a phase of the model's breakdown. Included by
   train_model.h after tm_model. */
#ifndef TRAIN_TIMER_H
#define TRAIN_TIMER_H

static double tm_clock(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* CPU time of the process (all threads): on a shared machine, what the phase itself cost. */
static double tm_clock_cpu(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Runs `call` (returning from the caller on failure); with m->profile its time goes to phase ph. */
#define TM_T(ph, call) \
    do { \
        double tm_t0_ = m->profile ? tm_clock() : 0.0; \
        double tm_c0_ = m->profile ? tm_clock_cpu() : 0.0; \
        TM_TRY(call); \
        if (m->profile) { \
            TM_TRY(dsk_ctx_sync(m->ctx)); \
            m->phase_s[ph] += tm_clock() - tm_t0_; \
            m->phase_cpu_s[ph] += tm_clock_cpu() - tm_c0_; \
        } \
    } while (0)

#endif /* TRAIN_TIMER_H */
