/* train_bind.h - process placement for examples/train_moe.c: --bind none|core|numa.

   The topology comes from sysfs: the online CPUs (/sys/devices/system/cpu/online), the
   hardware threads of each physical core (cpuN/topology/thread_siblings_list) and the CPUs of
   each NUMA node (/sys/devices/system/node/nodeN/cpulist). Only CPUs this process may use
   (its affinity mask: a cpuset, taskset, or the launcher's) are handed out.
     core  the cores are cut into local_world contiguous blocks, local rank r takes block r
           with all its hardware threads (with fewer cores than ranks: core r mod cores);
     numa  local rank r takes the CPUs of node r * nodes / local_world, so ranks fill the
           nodes in contiguous groups;
     none  nothing changes (sysfs is not read); the CPUs allowed are printed.
   Every thread of the process moves (each task under /proc/self/task), so threads started
   before the binding (the communicator's) follow; threads started later inherit it.

   Contents: 1. CPU lists  2. topology  3. binding
   Only for the example: errors go through dsk_set_error like the library's. */
#ifndef TRAIN_BIND_H
#define TRAIN_BIND_H

#include <dirent.h>
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../dsk_tensor.h"

/* ------------------------------------------------------------------ 1. CPU lists */

/* Parses a kernel CPU list ("0-3,8,10-11") into set; 0 on success, -1 when malformed. */
static int tb_parse_list(const char *s, cpu_set_t *set) {
    CPU_ZERO(set);
    while (*s && *s != '\n') {
        char *end;
        long a = strtol(s, &end, 10), b = a;
        if (end == s || a < 0) return -1;
        if (*end == '-') {
            s = end + 1;
            b = strtol(s, &end, 10);
            if (end == s || b < a) return -1;
        }
        for (long c = a; c <= b && c < CPU_SETSIZE; c++) CPU_SET((int)c, set);
        s = end;
        if (*s == ',') s++;
        else if (*s && *s != '\n') return -1;
    }
    return 0;
}

/* Writes set as a CPU list ("0-3,8") into buf. */
static void tb_format_list(const cpu_set_t *set, char *buf, size_t n) {
    size_t len = 0;
    buf[0] = 0;
    for (int c = 0; c < CPU_SETSIZE; c++) {
        if (!CPU_ISSET(c, set)) continue;
        int e = c;
        while (e + 1 < CPU_SETSIZE && CPU_ISSET(e + 1, set)) e++;
        int k = e > c ? snprintf(buf + len, n - len, "%s%d-%d", len ? "," : "", c, e)
                      : snprintf(buf + len, n - len, "%s%d", len ? "," : "", c);
        if (k < 0 || (size_t)k >= n - len) return;
        len += (size_t)k;
        c = e;
    }
}

/* Reads a small sysfs file as a CPU list into set; 0 on success. */
static int tb_read_list(const char *path, cpu_set_t *set) {
    char buf[4096];
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t k = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[k] = 0;
    return tb_parse_list(buf, set);
}

/* ------------------------------------------------------------------ 2. topology */

typedef struct tb_topology {
    cpu_set_t allowed;     /* online and in this process's affinity mask */
    int n_cores, n_nodes;
    cpu_set_t *core;       /* (n_cores) hardware threads of each core, allowed ones only, by first CPU */
    cpu_set_t *node;       /* (n_nodes) allowed CPUs of each NUMA node with any, by node number */
    int *node_id;          /* (n_nodes) that number */
} tb_topology;

static void tb_free(tb_topology *t) {
    free(t->core);
    free(t->node);
    free(t->node_id);
    memset(t, 0, sizeof *t);
}

/* Reads the topology of the allowed CPUs. A machine without NUMA information in sysfs is one
   node holding every allowed CPU. */
static dsk_status tb_load(tb_topology *t) {
    cpu_set_t online;
    memset(t, 0, sizeof *t);
    if (tb_read_list("/sys/devices/system/cpu/online", &online) != 0)
        return dsk_set_error(DSK_ERR_IO, "--bind: cannot read /sys/devices/system/cpu/online");
    if (sched_getaffinity(0, sizeof t->allowed, &t->allowed) != 0)
        return dsk_set_error(DSK_ERR_IO, "--bind: sched_getaffinity: %s", strerror(errno));
    CPU_AND(&t->allowed, &t->allowed, &online);
    int n = CPU_COUNT(&t->allowed);
    t->core = (cpu_set_t *)calloc((size_t)(n > 0 ? n : 1), sizeof *t->core);
    t->node = (cpu_set_t *)calloc((size_t)(n > 0 ? n : 1), sizeof *t->node);
    t->node_id = (int *)calloc((size_t)(n > 0 ? n : 1), sizeof *t->node_id);
    if (!t->core || !t->node || !t->node_id) { tb_free(t); return dsk_set_error(DSK_ERR_OOM, "--bind: out of memory"); }
    if (n == 0) { tb_free(t); return dsk_set_error(DSK_ERR_ARG, "--bind: this process may run on no online CPU"); }
    char path[128];
    for (int c = 0; c < CPU_SETSIZE; c++) {
        if (!CPU_ISSET(c, &t->allowed)) continue;
        cpu_set_t sib;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/thread_siblings_list", c);
        if (tb_read_list(path, &sib) != 0) { CPU_ZERO(&sib); CPU_SET(c, &sib); }
        CPU_AND(&sib, &sib, &t->allowed);
        int seen = 0;
        for (int i = 0; i < t->n_cores && !seen; i++) seen = CPU_ISSET(c, &t->core[i]);
        if (!seen) t->core[t->n_cores++] = sib;
    }
    for (int node = 0; node < CPU_SETSIZE && t->n_nodes < n; node++) {
        cpu_set_t cpus;
        snprintf(path, sizeof path, "/sys/devices/system/node/node%d/cpulist", node);
        if (tb_read_list(path, &cpus) != 0) continue;
        CPU_AND(&cpus, &cpus, &t->allowed);
        if (CPU_COUNT(&cpus) == 0) continue;
        t->node_id[t->n_nodes] = node;
        t->node[t->n_nodes++] = cpus;
    }
    if (t->n_nodes == 0) {
        t->node[0] = t->allowed;
        t->n_nodes = 1;
    }
    return DSK_OK;
}

/* ------------------------------------------------------------------ 3. binding */

/* The CPUs local rank r of local_world gets under mode ("core" or "numa"), and a description. */
static void tb_plan(const tb_topology *t, const char *mode, int r, int local_world, cpu_set_t *out, char *what,
                    size_t n) {
    CPU_ZERO(out);
    if (strcmp(mode, "numa") == 0) {
        int node = (int)((long)r * t->n_nodes / local_world);
        *out = t->node[node];
        snprintf(what, n, "NUMA node %d, %d of %d nodes", t->node_id[node], node + 1, t->n_nodes);
        return;
    }
    int first, count;
    if (t->n_cores >= local_world) {
        first = (int)((long)r * t->n_cores / local_world);
        count = (int)((long)(r + 1) * t->n_cores / local_world) - first;
    } else {
        first = r % t->n_cores;
        count = 1;
    }
    for (int i = first; i < first + count; i++) CPU_OR(out, out, &t->core[i]);
    snprintf(what, n, "%d core%s of %d%s", count, count > 1 ? "s" : "", t->n_cores,
             t->n_cores < local_world ? ", shared: fewer cores than local ranks" : "");
}

/* Sets the affinity of every thread of this process to set. */
static dsk_status tb_apply(const cpu_set_t *set) {
    DIR *d = opendir("/proc/self/task");
    if (!d) return dsk_set_error(DSK_ERR_IO, "--bind: cannot list /proc/self/task: %s", strerror(errno));
    dsk_status s = DSK_OK;
    for (struct dirent *e; s == DSK_OK && (e = readdir(d)) != NULL;) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
        pid_t tid = (pid_t)atol(e->d_name);
        if (sched_setaffinity(tid, sizeof *set, set) != 0 && errno != ESRCH)
            s = dsk_set_error(DSK_ERR_IO, "--bind: sched_setaffinity of thread %d: %s", (int)tid, strerror(errno));
    }
    closedir(d);
    return s;
}

/* --bind mode for local rank r of local_world: binds, then writes the line to print into
   line and the number of CPUs now allowed into *n_cpus. */
static dsk_status tb_bind(const char *mode, int r, int local_world, int *n_cpus, char *line, size_t n) {
    if (strcmp(mode, "none") != 0 && strcmp(mode, "core") != 0 && strcmp(mode, "numa") != 0)
        return dsk_set_error(DSK_ERR_ARG, "--bind \"%s\": use none, core or numa", mode);
    char list[1024], what[128];
    cpu_set_t set;
    if (strcmp(mode, "none") == 0) { /* no sysfs needed: the affinity the process has */
        if (sched_getaffinity(0, sizeof set, &set) != 0)
            return dsk_set_error(DSK_ERR_IO, "--bind: sched_getaffinity: %s", strerror(errno));
        tb_format_list(&set, list, sizeof list);
        *n_cpus = CPU_COUNT(&set);
        snprintf(line, n, "bind none: local rank %d of %d on CPUs %s (not bound)", r, local_world, list);
        return DSK_OK;
    }
    tb_topology t;
    dsk_status s = tb_load(&t);
    if (s != DSK_OK) return s;
    tb_plan(&t, mode, r, local_world, &set, what, sizeof what);
    s = tb_apply(&set);
    if (s == DSK_OK && sched_getaffinity(0, sizeof set, &set) != 0)
        s = dsk_set_error(DSK_ERR_IO, "--bind: sched_getaffinity: %s", strerror(errno));
    if (s == DSK_OK) {
        tb_format_list(&set, list, sizeof list);
        *n_cpus = CPU_COUNT(&set);
        snprintf(line, n, "bind %s: local rank %d of %d on CPUs %s (%s; %d core%s, %d NUMA node%s allowed)", mode, r,
                 local_world, list, what, t.n_cores, t.n_cores > 1 ? "s" : "", t.n_nodes, t.n_nodes > 1 ? "s" : "");
    }
    tb_free(&t);
    return s;
}

#endif /* TRAIN_BIND_H */
