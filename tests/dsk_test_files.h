/* dsk_test_files.h - what the file tests share (test_safetensors.c, test_ckpt.c): a scratch
   directory per run, whole-file reads and writes, tensors with poisoned or random contents, and
   the byte reference of a box of a tensor. Include after tests/dsk_test.h and a dsk header.
   The functions are static inline so that a test using some of them compiles without warnings. */
#ifndef DSK_TEST_FILES_H
#define DSK_TEST_FILES_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_root[256]; /* per-run scratch directory */
static int g_dirs;

/* Creates g_root, "$TMPDIR/<name>_XXXXXX" readable by all; 0 on failure. */
static inline int scratch_init(const char *name) {
    const char *tmp = getenv("TMPDIR");
    snprintf(g_root, sizeof g_root, "%s/%s_XXXXXX", tmp && *tmp ? tmp : "/tmp", name);
    if (!mkdtemp(g_root)) return 0;
    chmod(g_root, 0755); /* a test may read it as an unprivileged user (test_ckpt does) */
    return 1;
}

static inline void scratch_remove(void) {
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_root);
    if (system(cmd) != 0) printf("# could not remove %s\n", g_root);
}

/* A fresh empty directory under g_root. */
static inline void new_dir(char *out, size_t n, const char *tag) {
    snprintf(out, n, "%s/%s_%d", g_root, tag, ++g_dirs);
    mkdir(out, 0755);
}

static inline long file_size(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 ? (long)st.st_size : -1;
}

static inline unsigned char *read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    long sz = file_size(path);
    unsigned char *p;
    *n = 0;
    if (!f || sz < 0) {
        if (f) fclose(f);
        return NULL;
    }
    p = (unsigned char *)malloc((size_t)sz + 1);
    *n = fread(p, 1, (size_t)sz, f);
    fclose(f);
    return p;
}

static inline void write_file(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return;
    fwrite(p, 1, n, f);
    fclose(f);
}

static inline void alloc_t(dsk_tensor *t, dsk_dtype dt, int ndim, const int64_t *shape) {
    dsk_tensor_alloc(NULL, t, dt, ndim, shape);
    dsk_test_poison_bytes(t->data, dsk_tensor_nbytes(t) ? dsk_tensor_nbytes(t) : 1);
}

/* Random bytes: the file format must carry any bit pattern (NaN payloads included). */
static inline void fill_random_bytes(dsk_tensor *t) {
    unsigned char *p = (unsigned char *)t->data;
    for (size_t i = 0; i < dsk_tensor_nbytes(t); i++) p[i] = (unsigned char)dsk_test_rand_u64();
}

static inline void fill_f32(dsk_tensor *t) { dsk_test_fill_f32((float *)t->data, dsk_tensor_numel(t), -3.0, 3.0); }

/* Bytes of box (off, shape) of a row-major tensor with element size es: the reference. */
static inline void box_ref(const unsigned char *src, const int64_t *full, int nd, size_t es, const int64_t *off,
                           const int64_t *shape, unsigned char *out) {
    int64_t idx[DSK_MAX_DIMS] = {0}, n = 1;
    for (int d = 0; d < nd; d++) n *= shape[d];
    for (int64_t i = 0; i < n; i++) {
        int64_t lin = 0, rem = i;
        for (int d = nd - 1; d >= 0; d--) {
            idx[d] = rem % shape[d];
            rem /= shape[d];
        }
        for (int d = 0; d < nd; d++) lin = lin * full[d] + off[d] + idx[d];
        memcpy(out + (size_t)i * es, src + (size_t)lin * es, es);
    }
}

#endif /* DSK_TEST_FILES_H */
