/* bench_ckpt.c - checkpoint save/load throughput against the disk itself and against Python's
   safetensors, and the stall an async save imposes on the caller.

     build-x/bench/bench_ckpt [MiB=1024] [repeats=3] [dir=$TMPDIR or /tmp] [profile|pairs]

   Tensors: MiB/16 tensors of 16 MiB, alternating f32 (2048, 2048) and bf16 (2048, 4096).
   Peers, measured in the same run on the same disk (one warm-up, then `repeats`, median;
   the raw and the dsk write alternate in order from one repeat to the next, each after a
   sync(): deleting the last repeat's files makes this disk (mounted with discard) slow the
   next journal commit, which must not be charged to whichever write comes next):
     raw write  the same bytes with write() in 1 MiB pieces, then fsync, into a new file
     memcpy     the same bytes copied once in memory: the floor of an async save's stall
     raw read   those bytes back with pread() after dropping them from the page cache
     python     bench/ckpt_peer.py: safetensors.serialize_file of the same shapes and dtypes,
                in each repeat (with and without an fsync, which safetensors never does)
   dsk save is dsk_ckpt_save (CRC32C of every byte, fsyncs, manifest, latest); dsk load is
   dsk_ckpt_load into the existing tensors (every CRC checked) after dropping the page cache.
   Async: time spent inside dsk_ckpt_save_async (the snapshot) against a synchronous save;
   "first" includes allocating the snapshot buffer, "warm" reuses it.
   Incremental: an incremental save after changing a quarter of the tensors: bytes written
   and time against a full save.
   profile: where a save's time goes, each part timed alone on the same bytes (CRC32C, write()
   without fsync, the fsync, one small durable file), next to the raw write and the save.
   pairs: only the save against the raw write, `repeats` pairs, each write after a sync() and
   a 1 s pause (a disk shared with other jobs recovers from the last burst), the order
   alternating; the median of the pairs' ratios is the figure least moved by the disk's drift. */
#define _XOPEN_SOURCE 700 /* sync(); dsk_ckpt.h names the Linux calls it uses itself */
#define DSK_TENSOR_IMPLEMENTATION
#define DSK_CKPT_IMPLEMENTATION
#include "dsk_tensor.h"
#include "dsk_ckpt.h"
#include "bench_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static void run(const char *cmd) {
    if (system(cmd) != 0) fprintf(stderr, "bench_ckpt: \"%s\" failed\n", cmd);
}

/* Drops a file's pages from the page cache (they are clean after fsync). */
static void drop_cache(const char *path) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return;
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
}

/* Drops the checkpoint's rank files (step 1, "rank_<r>.<nonce>.safetensors") from the cache. */
static void drop_rank_files(const char *ck_dir) {
    char sd[800], path[1200];
    DIR *d;
    struct dirent *de;
    snprintf(sd, sizeof sd, "%s/step_00000001", ck_dir);
    if (!(d = opendir(sd))) return;
    while ((de = readdir(d)) != NULL)
        if (strncmp(de->d_name, "rank_", 5) == 0) {
            snprintf(path, sizeof path, "%s/%s", sd, de->d_name);
            drop_cache(path);
        }
    closedir(d);
}

static double raw_write(const char *path, dsk_tensor *t, int n) {
    const size_t piece = (size_t)1 << 20; /* the size dsk writes in */
    double t0 = bench_now_s();
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) { perror(path); exit(1); }
    for (int i = 0; i < n; i++) {
        const char *p = (const char *)t[i].data;
        size_t left = dsk_tensor_nbytes(&t[i]);
        while (left) {
            ssize_t k = write(fd, p, left < piece ? left : piece);
            if (k <= 0) { perror("write"); exit(1); }
            p += k;
            left -= (size_t)k;
        }
    }
    if (fsync(fd) != 0 || close(fd) != 0) { perror("fsync"); exit(1); }
    return bench_now_s() - t0;
}

static double raw_read(const char *path, void *buf, size_t n) {
    double t0;
    int fd;
    size_t done = 0;
    drop_cache(path);
    t0 = bench_now_s();
    if ((fd = open(path, O_RDONLY)) < 0) { perror(path); exit(1); }
    while (done < n) {
        ssize_t k =
            pread(fd, (char *)buf + done, n - done < ((size_t)8 << 20) ? n - done : ((size_t)8 << 20), (off_t)done);
        if (k <= 0) { perror("pread"); exit(1); }
        done += (size_t)k;
    }
    close(fd);
    return bench_now_s() - t0;
}

/* Seconds of CRC32C over every tensor in 1 MiB pieces, as the save computes it. */
static double crc_all(dsk_tensor *t, int n) {
    double t0 = bench_now_s();
    uint32_t acc = 0;
    for (int i = 0; i < n; i++) {
        const unsigned char *p = (const unsigned char *)t[i].data;
        size_t left = dsk_tensor_nbytes(&t[i]);
        for (size_t off = 0; off < left; off += (size_t)1 << 20)
            acc ^= dsk_safetensors_crc32c(0, p + off, left - off < ((size_t)1 << 20) ? left - off : ((size_t)1 << 20));
    }
    if (acc == 0x12345678u) printf("#\n"); /* keeps the loop */
    return bench_now_s() - t0;
}

/* write() of every tensor in 1 MiB pieces without fsync, then the fsync alone. */
static void write_then_fsync(const char *path, dsk_tensor *t, int n, double *dt_write, double *dt_fsync) {
    double t0 = bench_now_s();
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) { perror(path); exit(1); }
    for (int i = 0; i < n; i++) {
        const char *p = (const char *)t[i].data;
        size_t left = dsk_tensor_nbytes(&t[i]);
        while (left) {
            ssize_t k = write(fd, p, left < ((size_t)1 << 20) ? left : ((size_t)1 << 20));
            if (k <= 0) { perror("write"); exit(1); }
            p += k;
            left -= (size_t)k;
        }
    }
    *dt_write = bench_now_s() - t0;
    t0 = bench_now_s();
    if (fsync(fd) != 0 || close(fd) != 0) { perror("fsync"); exit(1); }
    *dt_fsync = bench_now_s() - t0;
}

/* The profile: each part of a save alone, alternating with the raw write and the save. */
static void profile(dsk_tensor *t, dsk_ckpt_entry *e, int n, size_t total, int reps, const char *root, dsk_ckpt *ck) {
    char raw_path[700], ck_dir[700], small[700], cmd[1500];
    double *x = (double *)calloc((size_t)reps * 6, sizeof(double));
    const char *names[6] = {"raw write+fsync",      "dsk save",
                            "crc32c of every byte", "write() alone (page cache)",
                            "its fsync alone",      "one small durable file"};
    snprintf(raw_path, sizeof raw_path, "%s/raw.bin", root);
    snprintf(ck_dir, sizeof ck_dir, "%s/ckpt", root);
    snprintf(small, sizeof small, "%s/small.safetensors", root);
    for (int r = -1; r < reps; r++) {
        double v[6], t0;
        dsk_safetensors_entry one = {e[0].name, e[0].tensor};
        dsk_tensor tiny;
        const int64_t s1[1] = {16};
        for (int k = 0; k < 2; k++) { /* alternating which goes first, each after a sync */
            if ((k == 0) == (r % 2 == 0)) {
                unlink(raw_path);
                sync();
                v[0] = raw_write(raw_path, t, n);
            } else {
                snprintf(cmd, sizeof cmd, "rm -rf '%s'", ck_dir);
                run(cmd);
                sync();
                t0 = bench_now_s();
                BENCH_CHECK(dsk_ckpt_save(ck, 1, e, n, NULL, 0));
                v[1] = bench_now_s() - t0;
            }
        }
        unlink(raw_path);
        sync();
        v[2] = crc_all(t, n);
        write_then_fsync(raw_path, t, n, &v[3], &v[4]);
        unlink(raw_path);
        sync();
        BENCH_CHECK(dsk_tensor_alloc(NULL, &tiny, DSK_F32, 1, s1));
        BENCH_CHECK(dsk_tensor_fill(NULL, &tiny, 1.0));
        one.tensor = &tiny;
        t0 = bench_now_s();
        BENCH_CHECK(dsk_safetensors_save(NULL, small, &one, 1, NULL, 0));
        v[5] = bench_now_s() - t0;
        dsk_tensor_free(NULL, &tiny);
        if (r >= 0)
            for (int k = 0; k < 6; k++) x[k * reps + r] = v[k];
    }
    printf("# profile: %.3f GB, median of %d\n", total / 1e9, reps);
    for (int k = 0; k < 6; k++)
        printf("%-28s %7.3f s%s\n", names[k], bench_median(x + k * reps, reps), k == 1 ? "" : "");
    printf("save - raw write+fsync       %7.3f s\n", bench_median(x + reps, reps) - bench_median(x, reps));
    free(x);
}

/* The pairs protocol (see the top of the file). */
static void pairs(dsk_tensor *t, dsk_ckpt_entry *e, int n, size_t total, int reps, const char *root, dsk_ckpt *ck) {
    char raw_path[700], ck_dir[700], cmd[1500];
    double *x = (double *)calloc((size_t)reps * 3, sizeof(double));
    snprintf(raw_path, sizeof raw_path, "%s/raw.bin", root);
    snprintf(ck_dir, sizeof ck_dir, "%s/ckpt", root);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", ck_dir);
    for (int r = -1; r < reps; r++) {
        double v[2] = {0, 0};
        for (int k = 0; k < 2; k++) {
            unlink(raw_path);
            run(cmd);
            sync();
            sleep(1);
            if ((k == 0) == (r % 2 == 0)) v[0] = raw_write(raw_path, t, n);
            else {
                double t0 = bench_now_s();
                BENCH_CHECK(dsk_ckpt_save(ck, 1, e, n, NULL, 0));
                v[1] = bench_now_s() - t0;
            }
        }
        if (r < 0) continue;
        x[r] = v[0];
        x[reps + r] = v[1];
        x[2 * reps + r] = v[0] / v[1];
        printf("pair %2d (%s first): raw %.3f s, save %.3f s, ratio %.2f\n", r, r % 2 == 0 ? "raw" : "save", v[0], v[1],
               v[0] / v[1]);
    }
    printf("# pairs: %.3f GB, %d pairs\n", total / 1e9, reps);
    printf("raw write+fsync   %7.3f s  %6.2f GB/s (median)\n", bench_median(x, reps),
           total / 1e9 / bench_median(x, reps));
    printf("dsk save          %7.3f s  %6.2f GB/s (median)\n", bench_median(x + reps, reps),
           total / 1e9 / bench_median(x + reps, reps));
    printf("median of the pairs' ratios raw / save: %.2f (target >= 0.95)\n", bench_median(x + 2 * reps, reps));
    unlink(raw_path);
    run(cmd);
    free(x);
}

/* An incremental save after a quarter of the tensors changed, against a full save. */
static void incremental(dsk_tensor *t, dsk_ckpt_entry *e, int n, size_t total, const char *root) {
    char dir[700], cmd[1500];
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    double t_full, t_inc, t0;
    uint64_t written;
    snprintf(dir, sizeof dir, "%s/inc", root);
    memset(&o, 0, sizeof o);
    o.incremental = 1;
    BENCH_CHECK(dsk_ckpt_init(&ck, dir, &o));
    t0 = bench_now_s();
    BENCH_CHECK(dsk_ckpt_save(&ck, 1, e, n, NULL, 0));
    t_full = bench_now_s() - t0;
    for (int i = 0; i < n; i += 4) BENCH_CHECK(dsk_tensor_uniform(NULL, &t[i], 8, (uint64_t)i << 32, -1.0f, 1.0f));
    t0 = bench_now_s();
    BENCH_CHECK(dsk_ckpt_save(&ck, 2, e, n, NULL, 0));
    t_inc = bench_now_s() - t0;
    written = dsk_ckpt_last_save(&ck)->bytes_written;
    printf("incremental save  %7.3f s  wrote %.3f GB of %.3f GB (%d of %d tensors changed; the first, full: %.3f s)\n",
           t_inc, written / 1e9, total / 1e9, dsk_ckpt_last_save(&ck)->tensors_written, n, t_full);
    dsk_ckpt_free(&ck);
    for (int i = 0; i < n; i += 4) BENCH_CHECK(dsk_tensor_uniform(NULL, &t[i], 7, (uint64_t)i << 32, -1.0f, 1.0f));
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    run(cmd);
}

/* One timed serialize_file of the peer after one untimed (its first call pays set-up); 0 if unavailable. */
static int python_peer(int n, const char *dir, double *plain, double *synced) {
    char cmd[1200], line[512];
    FILE *p;
    int ok = 0;
    snprintf(cmd, sizeof cmd, "%s bench/ckpt_peer.py %d 1 '%s' 1 2>&1", getenv("PYTHON") ? getenv("PYTHON") : "python3",
             n, dir);
    if (!(p = popen(cmd, "r"))) return 0;
    while (fgets(line, sizeof line, p))
        if (sscanf(line, "peer save_file %lf fsync %lf", plain, synced) == 2) ok = 1;
        else printf("# peer: %s", line);
    return pclose(p) == 0 && ok;
}

int main(int argc, char **argv) {
    int mib = argc > 1 ? atoi(argv[1]) : 1024, reps = argc > 2 ? atoi(argv[2]) : 3;
    const char *base = argc > 3 ? argv[3] : (getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    int n = mib / 16;
    char root[512], ck_dir[600], raw_path[600], cmd[1400], names[256][32];
    dsk_tensor *t;
    dsk_ckpt_entry *e;
    dsk_ckpt ck;
    double *ts_raw, *ts_save, *ts_read, *ts_load, *ts_async_warm, *ts_copy, *ts_py, *ts_pys, *ts_ratio,
        async_first = 0, py_plain = 0, py_synced = 0;
    int py_ok = 1;
    size_t total = 0;
    void *readbuf;
    if (n < 1 || n > 256 || reps < 1) {
        fprintf(stderr, "usage: bench_ckpt [MiB 16..4096] [repeats >= 1] [dir]\n");
        return 2;
    }
    snprintf(root, sizeof root, "%s/dsk_bench_ckpt_%d", base, (int)getpid());
    mkdir(root, 0755);
    snprintf(ck_dir, sizeof ck_dir, "%s/ckpt", root);
    snprintf(raw_path, sizeof raw_path, "%s/raw.bin", root);
    t = (dsk_tensor *)calloc((size_t)n, sizeof *t);
    e = (dsk_ckpt_entry *)calloc((size_t)n, sizeof *e);
    ts_raw = (double *)calloc((size_t)reps * 9, sizeof(double));
    ts_save = ts_raw + reps; ts_read = ts_save + reps; ts_load = ts_read + reps; ts_async_warm = ts_load + reps;
    ts_copy = ts_async_warm + reps; ts_py = ts_copy + reps; ts_pys = ts_py + reps; ts_ratio = ts_pys + reps;
    for (int i = 0; i < n; i++) {
        const int64_t s32[2] = {2048, 2048}, s16[2] = {2048, 4096};
        BENCH_CHECK(dsk_tensor_alloc(NULL, &t[i], i % 2 ? DSK_BF16 : DSK_F32, 2, i % 2 ? s16 : s32));
        BENCH_CHECK(dsk_tensor_uniform(NULL, &t[i], 7, (uint64_t)i << 32, -1.0f, 1.0f));
        snprintf(names[i], sizeof names[i], "layer.%03d.%s", i, i % 2 ? "w_bf16" : "w_f32");
        e[i].name = names[i];
        e[i].tensor = &t[i];
        total += dsk_tensor_nbytes(&t[i]);
    }
    if (!(readbuf = malloc(total))) { fprintf(stderr, "bench_ckpt: read buffer: out of memory\n"); return 1; }
    memset(readbuf, 1, total);
    {
        dsk_ckpt_opts o;
        memset(&o, 0, sizeof o);
        o.snapshot_threads = getenv("SNAPSHOT_THREADS") ? atoi(getenv("SNAPSHOT_THREADS")) : 1;
        BENCH_CHECK(dsk_ckpt_init(&ck, ck_dir, &o));
        printf("# snapshot_threads %d (set SNAPSHOT_THREADS to change)\n", o.snapshot_threads ? o.snapshot_threads : 1);
    }
    printf("# bench_ckpt: %d tensors, %.3f GB, %d repeats (+1 warm-up), dir %s\n", n, total / 1e9, reps, root);
    if (argc > 4 && (strcmp(argv[4], "profile") == 0 || strcmp(argv[4], "pairs") == 0)) {
        if (argv[4][1] == 'r') profile(t, e, n, total, reps, root, &ck);
        else pairs(t, e, n, total, reps, root, &ck);
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
        run(cmd);
        return 0;
    }

    for (int r = -1; r < reps; r++) {
        double dt_raw = 0, dt_save = 0, dt_read, dt_load, t0;
        /* the disk is shared and its speed drifts: alternate which of the two writes goes first */
        for (int k = 0; k < 2; k++) {
            if ((k == 0) == (r % 2 == 0)) {
                unlink(raw_path);
                sync(); /* the last write's deletions (discards here) must not land in this fsync */
                dt_raw = raw_write(raw_path, t, n);
            } else {
                snprintf(cmd, sizeof cmd, "rm -rf '%s'", ck_dir);
                run(cmd);
                sync();
                t0 = bench_now_s();
                BENCH_CHECK(dsk_ckpt_save(&ck, 1, e, n, NULL, 0));
                dt_save = bench_now_s() - t0;
            }
        }
        dt_read = raw_read(raw_path, readbuf, total);
        unlink(raw_path);
        drop_rank_files(ck_dir);
        t0 = bench_now_s();
        BENCH_CHECK(dsk_ckpt_load(&ck, 1, e, n, NULL));
        dt_load = bench_now_s() - t0;
        /* async: the caller's stall, then the background write finishes before the next rep */
        t0 = bench_now_s();
        BENCH_CHECK(dsk_ckpt_save_async(&ck, 2, e, n, NULL, 0));
        if (r == -1) async_first = bench_now_s() - t0;
        else ts_async_warm[r] = bench_now_s() - t0;
        BENCH_CHECK(dsk_ckpt_wait(&ck));
        t0 = bench_now_s();
        for (int i = 0, off = 0; i < n; off += (int)dsk_tensor_nbytes(&t[i]), i++)
            memcpy((char *)readbuf + off, t[i].data, dsk_tensor_nbytes(&t[i]));
        if (r >= 0) ts_copy[r] = bench_now_s() - t0;
        if (r >= 0) { ts_raw[r] = dt_raw; ts_save[r] = dt_save; ts_read[r] = dt_read; ts_load[r] = dt_load; }
        if (r >= 0) ts_ratio[r] = dt_raw / dt_save;
        /* Python peer in the same repeat: same shapes and dtypes, same directory */
        py_ok &= python_peer(n, root, &py_plain, &py_synced);
        if (r >= 0) { ts_py[r] = py_plain; ts_pys[r] = py_synced; }
    }
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", ck_dir);
    run(cmd);
    incremental(t, e, n, total, root);
    {
        double raw = bench_median(ts_raw, reps), save = bench_median(ts_save, reps);
        double rd = bench_median(ts_read, reps), ld = bench_median(ts_load, reps);
        double warm = bench_median(ts_async_warm, reps), gb = total / 1e9;
        printf("raw write+fsync   %7.3f s  %6.2f GB/s\n", raw, gb / raw);
        printf("dsk save          %7.3f s  %6.2f GB/s   ratio vs raw write %.2f (target >= 0.95), per repeat %.2f\n",
               save, gb / save, raw / save, bench_median(ts_ratio, reps));
        if (py_ok) {
            double py_save = bench_median(ts_py, reps), py_fsync = bench_median(ts_pys, reps);
            printf("python save_file  %7.3f s  %6.2f GB/s   dsk speed-up %.2fx (no fsync in safetensors)\n", py_save,
                   gb / py_save, py_save / save);
            printf("python +fsync     %7.3f s  %6.2f GB/s   dsk speed-up %.2fx\n", py_fsync, gb / py_fsync,
                   py_fsync / save);
        } else {
            printf("python peer       unavailable (needs python3 with safetensors and numpy)\n");
        }
        printf("raw read (cold)   %7.3f s  %6.2f GB/s\n", rd, gb / rd);
        printf("dsk load (cold)   %7.3f s  %6.2f GB/s   ratio vs raw read %.2f\n", ld, gb / ld, rd / ld);
        printf("async stall first %7.3f s  = %.3f of a sync save (allocates the snapshot buffer)\n", async_first,
               async_first / save);
        printf("async stall warm  %7.3f s  = %.3f of a sync save (target < 0.10)\n", warm, warm / save);
        printf("memcpy same bytes %7.3f s  %6.2f GB/s   async stall / memcpy %.2f\n", bench_median(ts_copy, reps),
               gb / bench_median(ts_copy, reps), warm / bench_median(ts_copy, reps));
    }
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    run(cmd);
    dsk_ckpt_free(&ck);
    for (int i = 0; i < n; i++) dsk_tensor_free(NULL, &t[i]);
    free(t); free(e); free(ts_raw); free(readbuf);
    return 0;
}
