/* train_signals.h - pre-emption and restarts for examples/train_moe.c.

   A rank blocks SIGTERM, SIGINT and SIGUSR1 before it starts any thread and takes them on a
   thread of its own with sigwait, so no other thread (OpenMP, the checkpoint writer, the
   communicators) is ever interrupted. The training loop reads what arrived at the end of
   each step: SIGTERM or SIGINT asks it to stop after that step (save, exit 0), SIGUSR1 to
   save now and go on. The ranks agree at the end of every step (a MAX over ranks), so every
   rank stops or saves at the same step even when the signal reached only some of them.

   The local launcher (--nproc N) runs the ranks through dsk_comm_spawn_local. When the job
   fails (a rank exits non-zero or dies: its peers then fail naming it) it runs the job again,
   up to --max-restarts times, with DSK_RESTART_COUNT set; a restarted rank resumes from the
   newest complete checkpoint, as under torchrun (TORCHELASTIC_RESTART_COUNT). The launcher
   forwards SIGTERM and SIGUSR1 to the ranks (and SIGINT when it was sent to the launcher
   alone: a terminal's Ctrl-C reaches every rank by itself); after SIGTERM or SIGINT it does
   not restart.

   Contents: 1. signals of a rank  2. restart count  3. the local launcher
   Only for the example (library code never handles signals). */
#ifndef TRAIN_SIGNALS_H
#define TRAIN_SIGNALS_H

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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
    return sig == SIGTERM   ? "SIGTERM"
           : sig == SIGINT  ? "SIGINT"
           : sig == SIGUSR1 ? "SIGUSR1"
           : sig == SIGKILL ? "SIGKILL"
                            : "a signal";
}

/* ------------------------------------------------------------------ 2. restart count */

/* Which run of the job this is: 0 for the first, k for the k-th restart, from the local
   launcher (DSK_RESTART_COUNT) or torchrun (TORCHELASTIC_RESTART_COUNT). */
static int ts_restart_count(void) {
    const char *names[2] = {"DSK_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"};
    for (int i = 0; i < 2; i++) {
        const char *v = getenv(names[i]);
        if (v && *v) return atoi(v);
    }
    return 0;
}

/* ------------------------------------------------------------------ 3. the local launcher */

static volatile sig_atomic_t ts__launcher_stop;

/* Signal-safe string building: appends s, or the decimal digits of x >= 0. */
static char *ts__put(char *p, const char *s) {
    while (*s) *p++ = *s++;
    return p;
}

static char *ts__put_num(char *p, long x) {
    char d[24];
    int k = 0;
    do { d[k++] = (char)('0' + x % 10); x /= 10; } while (x > 0);
    while (k > 0) *p++ = d[--k];
    return p;
}

/* Sends sig to every child of this process (the ranks dsk_comm_spawn_local forked from the
   main thread), read from /proc/<pid>/task/<pid>/children. Only signal-safe calls. */
static void ts__signal_children(int sig) {
    char path[96], buf[4096], *p = path;
    long self = (long)getpid();
    p = ts__put_num(ts__put(p, "/proc/"), self);
    p = ts__put(ts__put_num(ts__put(p, "/task/"), self), "/children");
    *p = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    ssize_t got = read(fd, buf, sizeof buf);
    close(fd);
    long pid = 0;
    for (ssize_t i = 0; i <= got; i++) {
        if (i < got && buf[i] >= '0' && buf[i] <= '9') { pid = pid * 10 + (buf[i] - '0'); continue; }
        if (pid > 0) kill((pid_t)pid, sig);
        pid = 0;
    }
}

static void ts__forward(int sig, siginfo_t *info, void *uctx) {
    (void)uctx;
    int saved = errno;
    if (sig != SIGUSR1) ts__launcher_stop = 1;
    if (!(sig == SIGINT && info && info->si_code != SI_USER)) ts__signal_children(sig);
    errno = saved;
}

static void ts__forward_signals(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = ts__forward;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGUSR1, &sa, NULL);
}

/* Runs argv (argv[0]: this program) as n local ranks; restarts the job up to max_restarts
   times when it fails. Returns the exit status for main. */
static int ts_launch(int n, int max_restarts, char **argv) {
    ts__forward_signals();
    for (int attempt = 0;; attempt++) {
        char v[16];
        snprintf(v, sizeof v, "%d", attempt);
        setenv("DSK_RESTART_COUNT", v, 1);
        int worst = 0;
        double t0 = ts_now();
        dsk_status s = dsk_comm_spawn_local(n, argv, NULL, &worst);
        if (s != DSK_OK) {
            fprintf(stderr, "train_moe: --nproc %d: %s: %s\n", n, dsk_status_str(s), dsk_last_error());
            return worst ? worst : 1;
        }
        if (worst == 0) return 0;
        char why[64];
        if (worst > 128)
            snprintf(why, sizeof why, "a rank was killed by %s (%d)", ts_signal_name(worst - 128), worst - 128);
        else snprintf(why, sizeof why, "a rank exited with status %d", worst);
        if (ts__launcher_stop) {
            fprintf(stderr, "train_moe: the job failed after a stop signal (%s); no restart\n", why);
            return worst;
        }
        if (attempt >= max_restarts) {
            fprintf(stderr, "train_moe: the job failed after %.1f s (%s)%s\n", ts_now() - t0, why,
                    max_restarts > 0 ? "; no restarts left (--max-restarts)" : "");
            return worst;
        }
        fprintf(stderr, "train_moe: the job failed after %.1f s (%s); restart %d of %d from the newest checkpoint\n",
                ts_now() - t0, why, attempt + 1, max_restarts);
    }
}

#endif /* TRAIN_SIGNALS_H */
