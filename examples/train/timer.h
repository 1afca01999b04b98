/* train/timer.h - the phase timer of examples/train_model.h (--profile): wall and process CPU
   clocks (the trainer's too) and TM_T, which times one call into a phase of the model's
   breakdown. Included by train_model.h after tm_model. */
#ifndef TRAIN_TIMER_H
#define TRAIN_TIMER_H

/* Seconds on clock `id`. */
static double tm_clock_of(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Wall seconds (monotonic). */
static double tm_clock(void) { return tm_clock_of(CLOCK_MONOTONIC); }

/* CPU time of the process (all threads): on a shared machine, what the phase itself cost. */
static double tm_clock_cpu(void) { return tm_clock_of(CLOCK_PROCESS_CPUTIME_ID); }

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
