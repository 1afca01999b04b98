/* train_metrics.h - Prometheus metrics of examples/train_moe.c.

   After each step the trainer fills a tmx_values and tmx_render turns it into the text
   exposition format 0.0.4: # HELP and # TYPE lines, then samples; counters end in _total,
   times are in seconds and sizes in bytes, the step time is a histogram (_bucket{le},
   _sum, _count), and every sample carries the rank as a label. The same text is served at
   http://ADDR:PORT/metrics by a server thread (tmx_server: one connection at a time, the
   page swapped in under a mutex, so a scrape never sees half a step) and written to a file
   for node_exporter's textfile collector (tmx_write_file: temporary file + rename).
   On a GPU, NVML (libnvidia-ml.so.1, opened at run time) adds utilisation and memory.

   Contents: 1. text  2. step-time histogram  3. the values and their exposition
             4. HTTP server  5. textfile  6. GPU: NVML and the memory pool
   Only for the example: errors go through dsk_set_error like the library's. */
#ifndef TRAIN_METRICS_H
#define TRAIN_METRICS_H

#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>
#ifdef DSK_CUDA
#include <cuda_runtime.h>
#endif

#include "../dsk_tensor.h"

/* ------------------------------------------------------------------ 1. text */

typedef struct tmx_text {
    char *p;
    size_t len, cap;
    int oom;          /* an append failed: the text is incomplete */
} tmx_text;

static void tmx_text_free(tmx_text *b) {
    free(b->p);
    memset(b, 0, sizeof *b);
}

static void tmx_printf(tmx_text *b, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static void tmx_printf(tmx_text *b, const char *fmt, ...) {
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int k = b->oom ? -1 : vsnprintf(b->p ? b->p + b->len : NULL, b->p ? b->cap - b->len : 0, fmt, ap);
        va_end(ap);
        if (k < 0) { b->oom = 1; return; }
        if (b->p && b->len + (size_t)k < b->cap) { b->len += (size_t)k; return; }
        size_t cap = b->cap ? 2 * b->cap : 4096;
        while (cap < b->len + (size_t)k + 1) cap *= 2;
        char *p = (char *)realloc(b->p, cap);
        if (!p) { b->oom = 1; return; }
        b->p = p;
        b->cap = cap;
    }
}

/* A sample value as Prometheus reads it: NaN, +Inf, -Inf or the shortest decimal that reads
   back as x (0.0025, not 0.0025000000000000001). */
static const char *tmx_num(char buf[40], double x) {
    if (isnan(x)) return "NaN";
    if (isinf(x)) return x > 0 ? "+Inf" : "-Inf";
    for (int digits = 6; digits <= 17; digits++) {
        snprintf(buf, 40, "%.*g", digits, x);
        if (strtod(buf, NULL) == x) break;
    }
    return buf;
}

static void tmx_family(tmx_text *b, const char *name, const char *type, const char *help) {
    tmx_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* One family with one sample labelled by rank. */
static void tmx_one(tmx_text *b, int rank, const char *name, const char *type, const char *help, double v) {
    char num[40];
    tmx_family(b, name, type, help);
    tmx_printf(b, "%s{rank=\"%d\"} %s\n", name, rank, tmx_num(num, v));
}

/* ------------------------------------------------------------------ 2. step-time histogram */

#define TMX_STEP_BUCKETS 14
static const double tmx_step_le[TMX_STEP_BUCKETS] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                                     0.25,  0.5,    1,     2.5,  5,     10,  30};

typedef struct tmx_hist {
    uint64_t count[TMX_STEP_BUCKETS + 1]; /* per bucket, not cumulative; the last is (30 s, +Inf) */
    uint64_t total;
    double sum;
} tmx_hist;

static void tmx_hist_observe(tmx_hist *h, double seconds) {
    int i = 0;
    while (i < TMX_STEP_BUCKETS && seconds > tmx_step_le[i]) i++;
    h->count[i]++;
    h->total++;
    h->sum += seconds;
}

static void tmx_hist_write(tmx_text *b, int rank, const char *name, const char *help, const tmx_hist *h) {
    char num[40];
    uint64_t cum = 0;
    tmx_family(b, name, "histogram", help);
    for (int i = 0; i <= TMX_STEP_BUCKETS; i++) {
        cum += h->count[i];
        tmx_printf(b, "%s_bucket{rank=\"%d\",le=\"%s\"} %llu\n", name, rank,
                   i < TMX_STEP_BUCKETS ? tmx_num(num, tmx_step_le[i]) : "+Inf", (unsigned long long)cum);
    }
    tmx_printf(b, "%s_sum{rank=\"%d\"} %s\n%s_count{rank=\"%d\"} %llu\n", name, rank, tmx_num(num, h->sum), name, rank,
               (unsigned long long)h->total);
}

/* ------------------------------------------------------------------ 3. the values and their exposition */

/* Everything one rank exports. Counters count from the start of this process (Prometheus's
   rate() handles the reset of a restart); gauges describe the last step. NaN: not known yet. */
typedef struct tmx_values {
    int rank;
    /* counters */
    int64_t steps, skipped_steps, tokens, dropped_slots, checkpoints;
    double data_wait_s, grad_sync_s, comm_s, checkpoint_s, checkpoint_bytes;
    tmx_hist step_time;
    /* gauges */
    double loss, val_loss, lr, grad_norm, loss_scale, mfu, comm_ratio, data_ratio, epoch, restarts;
    double host_memory_high_water_bytes;
    /* NaN off a GPU */
    double device_memory_high_water_bytes, gpu_utilization, gpu_memory_used_bytes, gpu_memory_total_bytes;
    /* MoE: n_layers x n_experts shares of the routed slots, and max / mean per layer */
    int n_layers, n_experts;
    const int *layer;           /* (n_layers) block index of each MoE layer */
    const double *expert_load;  /* (n_layers, n_experts) */
    const double *imbalance;    /* (n_layers) */
} tmx_values;

static void tmx_render(tmx_text *b, const tmx_values *v) {
    int r = v->rank;
    char num[40];
    b->len = 0;
    b->oom = 0;
    tmx_one(b, r, "dsk_train_steps_total", "counter",
            "Optimizer steps of the run completed (skipped ones included; a resumed run starts at its checkpoint's).",
            (double)v->steps);
    tmx_one(b, r, "dsk_train_skipped_steps_total", "counter", "Steps skipped for non-finite gradients.",
            (double)v->skipped_steps);
    tmx_one(b, r, "dsk_train_tokens_total", "counter", "Training tokens this rank processed.", (double)v->tokens);
    tmx_one(b, r, "dsk_train_loss", "gauge", "Training loss of the last step (nats per token, mean over ranks).",
            v->loss);
    if (!isnan(v->val_loss))
        tmx_one(b, r, "dsk_train_validation_loss", "gauge", "Last validation loss (nats per token).", v->val_loss);
    tmx_one(b, r, "dsk_train_learning_rate", "gauge", "Learning rate of the last step.", v->lr);
    tmx_one(b, r, "dsk_train_grad_norm", "gauge", "Global gradient norm of the last step, before clipping.",
            v->grad_norm);
    tmx_one(b, r, "dsk_train_loss_scale", "gauge", "Loss scale of the last step (1 without dynamic scaling).",
            v->loss_scale);
    tmx_one(b, r, "dsk_train_mfu_ratio", "gauge",
            "Model FLOPs utilisation of the last step: over every rank's peak, or the fastest step's rate if higher.",
            v->mfu);
    tmx_hist_write(b, r, "dsk_train_step_seconds", "Wall time of each step.", &v->step_time);
    tmx_one(b, r, "dsk_train_data_wait_seconds_total", "counter", "Time the steps waited for the data loader.",
            v->data_wait_s);
    tmx_one(b, r, "dsk_train_data_wait_ratio", "gauge", "Share of the last step spent waiting for data.", v->data_ratio);
    tmx_one(b, r, "dsk_train_data_epoch", "gauge", "Epoch of the next training sample.", v->epoch);
    tmx_one(b, r, "dsk_train_grad_sync_seconds_total", "counter",
            "Time the steps waited for gradient all-reduces after backward (buckets and MoE gradients).", v->grad_sync_s);
    tmx_one(b, r, "dsk_train_comm_seconds_total", "counter", "Time spent inside collectives, every communicator of this rank.",
            v->comm_s);
    tmx_one(b, r, "dsk_train_comm_ratio", "gauge", "Share of the last step spent inside collectives.", v->comm_ratio);
    tmx_one(b, r, "dsk_train_dropped_slots_total", "counter", "Routed (token, expert) slots dropped by expert capacity.",
            (double)v->dropped_slots);
    if (v->n_layers > 0) {
        tmx_family(b, "dsk_train_expert_load_ratio", "gauge",
                   "Share of the routed slots each expert received in the last micro-batch.");
        for (int l = 0; l < v->n_layers; l++)
            for (int e = 0; e < v->n_experts; e++)
                tmx_printf(b, "dsk_train_expert_load_ratio{rank=\"%d\",layer=\"%d\",expert=\"%d\"} %s\n", r, v->layer[l], e,
                           tmx_num(num, v->expert_load[l * v->n_experts + e]));
        tmx_family(b, "dsk_train_expert_imbalance_ratio", "gauge",
                   "Most loaded expert over the mean, per MoE layer (1 = balanced).");
        for (int l = 0; l < v->n_layers; l++)
            tmx_printf(b, "dsk_train_expert_imbalance_ratio{rank=\"%d\",layer=\"%d\"} %s\n", r, v->layer[l],
                       tmx_num(num, v->imbalance[l]));
    }
    tmx_one(b, r, "dsk_train_checkpoints_total", "counter", "Checkpoints saved.", (double)v->checkpoints);
    tmx_one(b, r, "dsk_train_checkpoint_save_seconds_total", "counter",
            "Time the training loop spent in checkpoint saves (an async save's copy, a --sync-ckpt save in full).",
            v->checkpoint_s);
    tmx_one(b, r, "dsk_train_checkpoint_bytes_total", "counter", "Tensor bytes this rank handed to checkpoint saves.",
            v->checkpoint_bytes);
    tmx_one(b, r, "dsk_train_restarts", "gauge", "Restarts of the job before this process (launcher or torchrun).",
            v->restarts);
    tmx_one(b, r, "dsk_train_host_memory_high_water_bytes", "gauge", "Peak resident memory of this process.",
            v->host_memory_high_water_bytes);
    if (!isnan(v->device_memory_high_water_bytes))
        tmx_one(b, r, "dsk_train_device_memory_high_water_bytes", "gauge",
                "Peak bytes in use in the CUDA memory pool of this rank.", v->device_memory_high_water_bytes);
    if (!isnan(v->gpu_utilization)) {
        tmx_one(b, r, "dsk_train_gpu_utilization_ratio", "gauge", "GPU busy share over NVML's last sample period.",
                v->gpu_utilization);
        tmx_one(b, r, "dsk_train_gpu_memory_used_bytes", "gauge", "GPU memory in use (NVML, every process).",
                v->gpu_memory_used_bytes);
        tmx_one(b, r, "dsk_train_gpu_memory_total_bytes", "gauge", "GPU memory (NVML).", v->gpu_memory_total_bytes);
    }
}

/* ------------------------------------------------------------------ 4. HTTP server */

typedef struct tmx_server {
    int fd, port, running, stop;
    pthread_t thread;
    pthread_mutex_t mu;
    char *page;           /* the exposition served, owned */
    size_t page_len;
    int64_t scrapes;      /* GET /metrics answered */
} tmx_server;

/* Reads a request head (up to the blank line, 8 KiB, 2 s) and answers it. */
static void tmx_serve_one(tmx_server *s, int c) {
    char req[8192];
    size_t n = 0;
    struct timeval tv = {2, 0};
    setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    while (n + 1 < sizeof req) {
        ssize_t k = recv(c, req + n, sizeof req - 1 - n, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) break;
        n += (size_t)k;
        req[n] = 0;
        if (strstr(req, "\r\n\r\n") || strstr(req, "\n\n")) break;
    }
    req[n] = 0;
    int get = strncmp(req, "GET ", 4) == 0, head = strncmp(req, "HEAD ", 5) == 0;
    const char *path = req + (get ? 4 : head ? 5 : 0);
    int metrics = (get || head) && strncmp(path, "/metrics", 8) == 0 && (path[8] == ' ' || path[8] == '?');
    const char *status = metrics ? "200 OK" : (get || head) ? "404 Not Found" : "405 Method Not Allowed";
    char hdr[256];
    pthread_mutex_lock(&s->mu);
    const char *body = metrics ? s->page : "the metrics are at /metrics\n";
    size_t len = metrics ? s->page_len : strlen(body);
    int h = snprintf(hdr, sizeof hdr, "HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n",
                     status, metrics ? "text/plain; version=0.0.4; charset=utf-8" : "text/plain; charset=utf-8", len);
    if (metrics) s->scrapes++;
    if (send(c, hdr, (size_t)h, MSG_NOSIGNAL) == h && !head)
        for (size_t off = 0; off < len;) {
            ssize_t k = send(c, body + off, len - off, MSG_NOSIGNAL);
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) break;
            off += (size_t)k;
        }
    pthread_mutex_unlock(&s->mu);
}

static void *tmx_server_main(void *arg) {
    tmx_server *s = (tmx_server *)arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        int stop = s->stop;
        pthread_mutex_unlock(&s->mu);
        if (stop) break;
        struct pollfd p = {s->fd, POLLIN, 0};
        if (poll(&p, 1, 100) <= 0) continue;
        int c = accept(s->fd, NULL, NULL);
        if (c < 0) continue;
        tmx_serve_one(s, c);
        close(c);
    }
    return NULL;
}

/* Listens on addr:port (IPv4) and serves the published page from a thread. */
static dsk_status tmx_server_start(tmx_server *s, const char *addr, int port) {
    memset(s, 0, sizeof *s);
    s->fd = -1;
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    if (port < 1 || port > 65535 || inet_pton(AF_INET, addr, &sa.sin_addr) != 1)
        return dsk_set_error(DSK_ERR_ARG, "--metrics-addr %s --metrics-port %d: want an IPv4 address and a port in 1..65535",
                             addr, port);
    int one = 1, fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return dsk_set_error(DSK_ERR_IO, "metrics server: socket: %s", strerror(errno));
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(fd, 16) != 0) {
        int e = errno;
        close(fd);
        return dsk_set_error(DSK_ERR_IO, "metrics server: cannot listen on %s:%d: %s", addr, port, strerror(e));
    }
    s->fd = fd;
    s->port = port;
    pthread_mutex_init(&s->mu, NULL);
    s->page = (char *)malloc(1);
    if (!s->page) {
        close(fd);
        pthread_mutex_destroy(&s->mu);
        return dsk_set_error(DSK_ERR_OOM, "metrics server: out of memory");
    }
    s->page[0] = 0;
    int e = pthread_create(&s->thread, NULL, tmx_server_main, s);
    if (e != 0) {
        close(fd);
        free(s->page);
        pthread_mutex_destroy(&s->mu);
        return dsk_set_error(DSK_ERR_OOM, "metrics server: cannot start its thread: %s", strerror(e));
    }
    s->running = 1;
    return DSK_OK;
}

/* Serves a copy of b from now on (an incomplete b is dropped: the last page stays). */
static void tmx_server_publish(tmx_server *s, const tmx_text *b) {
    if (!s->running || b->oom || !b->p) return;
    char *copy = (char *)malloc(b->len + 1);
    if (!copy) return;
    memcpy(copy, b->p, b->len + 1);
    pthread_mutex_lock(&s->mu);
    char *old = s->page;
    s->page = copy;
    s->page_len = b->len;
    pthread_mutex_unlock(&s->mu);
    free(old);
}

static void tmx_server_stop(tmx_server *s) {
    if (!s->running) return;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    close(s->fd);
    pthread_mutex_destroy(&s->mu);
    free(s->page);
    memset(s, 0, sizeof *s);
}

/* ------------------------------------------------------------------ 5. textfile */

/* Writes b to path through path.tmp and a rename, so a reader never sees half a file. */
static dsk_status tmx_write_file(const char *path, const tmx_text *b) {
    char tmp[4200];
    size_t k = strlen(path);
    if (b->oom) return dsk_set_error(DSK_ERR_OOM, "--metrics: out of memory for the exposition");
    if (k + 5 > sizeof tmp)
        return dsk_set_error(DSK_ERR_ARG, "--metrics: the path is longer than %zu bytes", sizeof tmp - 5);
    memcpy(tmp, path, k);
    memcpy(tmp + k, ".tmp", 5);
    FILE *f = fopen(tmp, "w");
    if (!f) return dsk_set_error(DSK_ERR_IO, "--metrics: cannot write %s: %s", tmp, strerror(errno));
    size_t w = b->len ? fwrite(b->p, 1, b->len, f) : 0;
    int bad = fclose(f) != 0 || w != b->len;
    if (bad || rename(tmp, path) != 0)
        return dsk_set_error(DSK_ERR_IO, "--metrics: cannot %s %s: %s", bad ? "write" : "rename", bad ? tmp : path,
                             strerror(errno));
    return DSK_OK;
}

/* ------------------------------------------------------------------ 6. GPU: NVML and the memory pool */

/* The few NVML entry points used, by their documented signatures (nvml.h is not needed). */
typedef struct tmx_nvml_util { unsigned int gpu, memory; } tmx_nvml_util;
typedef struct tmx_nvml_mem { unsigned long long total, free, used; } tmx_nvml_mem;

typedef struct tmx_gpu {
    void *lib, *dev;
    int (*get_util)(void *, tmx_nvml_util *);
    int (*get_mem)(void *, tmx_nvml_mem *);
    int cuda_index;
} tmx_gpu;

/* Opens NVML for CUDA device cuda_index (found by its PCI bus id, so CUDA_VISIBLE_DEVICES
   does not matter). Returns 0 when NVML or the device is not there; the metrics then leave
   out the NVML gauges. */
static int tmx_gpu_open(tmx_gpu *g, int cuda_index) {
    memset(g, 0, sizeof *g);
    g->cuda_index = cuda_index;
#ifdef DSK_CUDA
    char bus[64];
    if (cudaDeviceGetPCIBusId(bus, (int)sizeof bus, cuda_index) != cudaSuccess) return 0;
    if (!(g->lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL))) return 0;
    int (*init)(void) = (int (*)(void))dlsym(g->lib, "nvmlInit_v2");
    int (*by_bus)(const char *, void **) =
        (int (*)(const char *, void **))dlsym(g->lib, "nvmlDeviceGetHandleByPciBusId_v2");
    g->get_util = (int (*)(void *, tmx_nvml_util *))dlsym(g->lib, "nvmlDeviceGetUtilizationRates");
    g->get_mem = (int (*)(void *, tmx_nvml_mem *))dlsym(g->lib, "nvmlDeviceGetMemoryInfo");
    if (init && by_bus && g->get_util && g->get_mem && init() == 0 && by_bus(bus, &g->dev) == 0) return 1;
    dlclose(g->lib);
    memset(g, 0, sizeof *g);
    g->cuda_index = cuda_index;
#endif
    return 0;
}

static void tmx_gpu_close(tmx_gpu *g) {
    if (g->lib) {
        int (*shutdown)(void) = (int (*)(void))dlsym(g->lib, "nvmlShutdown");
        if (shutdown) shutdown();
        dlclose(g->lib);
    }
    memset(g, 0, sizeof *g);
}

/* Fills the GPU gauges of v (NaN where unknown): NVML's utilisation and memory, and the
   high-water mark of the device's default memory pool (cudaMallocAsync draws from it). */
static void tmx_gpu_read(const tmx_gpu *g, int on_gpu, tmx_values *v) {
    v->gpu_utilization = v->gpu_memory_used_bytes = v->gpu_memory_total_bytes = v->device_memory_high_water_bytes = NAN;
    if (!on_gpu) return;
#ifdef DSK_CUDA
    cudaMemPool_t pool;
    unsigned long long high = 0;
    if (cudaDeviceGetDefaultMemPool(&pool, g->cuda_index) == cudaSuccess &&
        cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high) == cudaSuccess)
        v->device_memory_high_water_bytes = (double)high;
#endif
    tmx_nvml_util u;
    tmx_nvml_mem m;
    if (g->dev && g->get_util(g->dev, &u) == 0) v->gpu_utilization = u.gpu / 100.0;
    if (g->dev && g->get_mem(g->dev, &m) == 0) {
        v->gpu_memory_used_bytes = (double)m.used;
        v->gpu_memory_total_bytes = (double)m.total;
    }
}

#endif /* TRAIN_METRICS_H */
