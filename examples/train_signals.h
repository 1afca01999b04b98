/* train_signals.h - pre-emption and restarts for examples/train_moe.c.

   A rank blocks SIGTERM, SIGINT and SIGUSR1 before it starts any thread and takes them on a
   thread of its own with sigwait, so no other thread (OpenMP, the checkpoint writer, the
   communicators) is ever interrupted. The training loop reads what arrived at the end of
   each step: SIGTERM or SIGINT asks it to stop after that step (save, exit 0), SIGUSR1 to
   save now and go on. The ranks agree at the end of every step (a MAX over ranks), so every
   rank stops or saves at the same step even when the signal reached only some of them.

   Contents: 1. signals of a rank
   Only for the example (library code never handles signals). */
#ifndef TRAIN_SIGNALS_H
#define TRAIN_SIGNALS_H

#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------------ 1. signals of a rank */

typedef struct ts_signals {
    pthread_t thread;
    int started;
    int stop_sig;       /* first SIGTERM or SIGINT, 0 when none (atomic) */
    int save_req;       /* SIGUSR1 seen since the last ts_take_save (atomic) */
    double stop_at;     /* CLOCK_MONOTONIC seconds when stop_sig arrived */
} ts_signals;

static double ts_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static sigset_t ts_set(void) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGUSR1);
    return set;
}

static void *ts_main(void *arg) {
    ts_signals *s = (ts_signals *)arg;
    sigset_t set = ts_set();
    for (;;) {
        int sig = 0;
        if (sigwait(&set, &sig) != 0) continue;
        if (sig == SIGUSR1) {
            __atomic_store_n(&s->save_req, 1, __ATOMIC_SEQ_CST);
        } else if (__atomic_load_n(&s->stop_sig, __ATOMIC_SEQ_CST) == 0) {
            s->stop_at = ts_now();
            __atomic_store_n(&s->stop_sig, sig, __ATOMIC_SEQ_CST);
        }
    }
    return NULL;
}

/* Blocks the three signals in this thread (every thread started later inherits that) and
   starts the thread that takes them. Call before anything starts a thread. 0 or an errno. */
static int ts_start(ts_signals *s) {
    memset(s, 0, sizeof *s);
    sigset_t set = ts_set();
    int e = pthread_sigmask(SIG_BLOCK, &set, NULL);
    if (e == 0) e = pthread_create(&s->thread, NULL, ts_main, s);
    s->started = e == 0;
    return e;
}

static void ts_stop(ts_signals *s) {
    if (!s->started) return;
    pthread_cancel(s->thread); /* sigwait is a cancellation point */
    pthread_join(s->thread, NULL);
    s->started = 0;
}

/* The stop signal (SIGTERM or SIGINT), 0 when none arrived. */
static int ts_stop_signal(ts_signals *s) { return __atomic_load_n(&s->stop_sig, __ATOMIC_SEQ_CST); }
/* 1 when SIGUSR1 arrived since the last call. */
static int ts_take_save(ts_signals *s) { return __atomic_exchange_n(&s->save_req, 0, __ATOMIC_SEQ_CST); }

static const char *ts_signal_name(int sig) {
    return sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : sig == SIGUSR1 ? "SIGUSR1" : sig == SIGKILL ? "SIGKILL" : "a signal";
}

#endif /* TRAIN_SIGNALS_H */
