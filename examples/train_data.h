/* train_data.h - the data side of examples/train_moe.c: corpus loading and batches.

   A corpus is one stream of tokens made of segments:
     - plain files, read as bytes (vocabulary 256), memory-mapped;
     - llm.c / nanoGPT token shards (256 int32 header: magic 20240520, version 1, token
       count; then uint16 tokens), detected by the header, memory-mapped;
     - the default corpus: the C headers under /usr/include in a fixed order (each
       directory's files sorted by name, then its subdirectories sorted by name), copied
       into one buffer and capped at `cap_bytes`.
   The stream is cut into windows of T + 1 tokens; every `val_every`-th window is held out
   for validation, the rest are training windows. Training draws windows with the
   counter-based Philox RNG: global sequence j of the run reads training window
   philox(seed, j) mod n_train, so the data position is just j (saved in checkpoints), and
   rank r of R reads sequences [j + r*B/R, j + (r+1)*B/R) of every global batch of B.
   Only for the example: errors go through dsk_set_error like the library's. */
#ifndef TRAIN_DATA_H
#define TRAIN_DATA_H

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../dsk_tensor.h"

#define TD_SHARD_MAGIC 20240520
#define TD_SHARD_HEADER_BYTES 1024

typedef struct td_segment {
    const uint8_t *tokens; /* 1 byte per token (bytes) or 2 (shard, little-endian uint16) */
    int64_t ntok;
    int64_t start;         /* position of its first token in the stream */
    void *map;             /* mmap'ed region (NULL for the default corpus) */
    size_t map_len;
} td_segment;

typedef struct td_corpus {
    td_segment *seg;
    int nseg;
    int token_bytes;       /* 1 or 2 */
    int64_t ntok;
    int vocab;             /* 256 for bytes; the shards' vocabulary otherwise */
    uint8_t *owned;        /* the default corpus buffer */
    char source[256];      /* for messages: "/usr/include (C headers, 178 files)" */
    /* windows */
    int64_t T;             /* window = T + 1 tokens */
    int64_t val_every;
    int64_t n_windows, n_train, n_val;
} td_corpus;

static void td_free(td_corpus *c) {
    for (int i = 0; i < c->nseg; i++)
        if (c->seg[i].map) munmap(c->seg[i].map, c->seg[i].map_len);
    free(c->seg);
    free(c->owned);
    memset(c, 0, sizeof *c);
}

static dsk_status td_add_segment(td_corpus *c, const uint8_t *tokens, int64_t ntok, void *map, size_t map_len) {
    td_segment *s = (td_segment *)realloc(c->seg, (size_t)(c->nseg + 1) * sizeof *s);
    if (!s) return dsk_set_error(DSK_ERR_OOM, "td_add_segment: out of memory for segment %d", c->nseg);
    c->seg = s;
    s[c->nseg].tokens = tokens;
    s[c->nseg].ntok = ntok;
    s[c->nseg].start = c->ntok;
    s[c->nseg].map = map;
    s[c->nseg].map_len = map_len;
    c->nseg++;
    c->ntok += ntok;
    return DSK_OK;
}

static int32_t td_rd_i32(const uint8_t *p) {
    return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
}

/* Maps `path` and appends it: a token shard when its header says so, else bytes. */
static dsk_status td_add_file(td_corpus *c, const char *path, int shard_vocab) {
    struct stat st;
    int fd = open(path, O_RDONLY);
    if (fd < 0) return dsk_set_error(DSK_ERR_IO, "--data: cannot open \"%s\": %s", path, strerror(errno));
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return dsk_set_error(DSK_ERR_IO, "--data: \"%s\" is not a regular file", path);
    }
    if (st.st_size == 0) {
        close(fd);
        return dsk_set_error(DSK_ERR_ARG, "--data: \"%s\" is empty", path);
    }
    size_t len = (size_t)st.st_size;
    void *map = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return dsk_set_error(DSK_ERR_IO, "--data: cannot map \"%s\": %s", path, strerror(errno));
    const uint8_t *p = (const uint8_t *)map;
    int is_shard = len >= TD_SHARD_HEADER_BYTES && td_rd_i32(p) == TD_SHARD_MAGIC;
    int token_bytes = is_shard ? 2 : 1;
    dsk_status s = DSK_OK;
    if (c->nseg > 0 && c->token_bytes != token_bytes)
        s = dsk_set_error(DSK_ERR_ARG, "--data: \"%s\" is a %s but earlier files are %s; do not mix them", path,
                          is_shard ? "token shard" : "byte file", c->token_bytes == 2 ? "token shards" : "byte files");
    else if (is_shard) {
        int32_t version = td_rd_i32(p + 4), ntok = td_rd_i32(p + 8);
        if (version != 1)
            s = dsk_set_error(DSK_ERR_CORRUPT, "--data: token shard \"%s\" has version %d, want 1", path, version);
        else if (ntok <= 0 || (size_t)ntok * 2 + TD_SHARD_HEADER_BYTES != len)
            s = dsk_set_error(DSK_ERR_CORRUPT, "--data: token shard \"%s\" says %d tokens (%lld bytes) but the file has %zu bytes",
                              path, ntok, (long long)ntok * 2 + TD_SHARD_HEADER_BYTES, len);
        else {
            const uint8_t *tok = p + TD_SHARD_HEADER_BYTES;
            for (int32_t i = 0; i < ntok && s == DSK_OK; i++) {
                int t = tok[2 * i] | tok[2 * i + 1] << 8;
                if (t >= shard_vocab)
                    s = dsk_set_error(DSK_ERR_CORRUPT, "--data: token shard \"%s\": token %d at %d is >= --vocab %d", path, t, i,
                                      shard_vocab);
            }
            if (s == DSK_OK) s = td_add_segment(c, tok, ntok, map, len);
        }
    } else
        s = td_add_segment(c, p, (int64_t)len, map, len);
    if (s != DSK_OK) {
        munmap(map, len);
        return s;
    }
    c->token_bytes = token_bytes;
    c->vocab = is_shard ? shard_vocab : 256;
    return DSK_OK;
}

static int td_cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int td_is_header_name(const char *n) {
    size_t k = strlen(n);
    return k > 2 && n[k - 2] == '.' && n[k - 1] == 'h';
}

/* Appends the .h files of `dir` (sorted), then recurses into its subdirectories (sorted),
   until `*used` reaches `cap`. Symbolic links are skipped so no file is read twice. */
static dsk_status td_walk_headers(const char *dir, uint8_t *buf, size_t cap, size_t *used, int *nfiles, int depth) {
    DIR *d = opendir(dir);
    if (!d) return DSK_OK; /* unreadable directories are skipped, like a missing one */
    char **names = NULL;
    size_t n = 0, cap_names = 0;
    dsk_status s = DSK_OK;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (e->d_name[0] == '.') continue;
        if (n == cap_names) {
            cap_names = cap_names ? 2 * cap_names : 64;
            char **nn = (char **)realloc(names, cap_names * sizeof *nn);
            if (!nn) { s = dsk_set_error(DSK_ERR_OOM, "default corpus: out of memory listing %s", dir); break; }
            names = nn;
        }
        if (!(names[n] = strdup(e->d_name))) { s = dsk_set_error(DSK_ERR_OOM, "default corpus: out of memory"); break; }
        n++;
    }
    closedir(d);
    if (s == DSK_OK && n) qsort(names, n, sizeof *names, td_cmp_str);
    char path[4096];
    for (int pass = 0; pass < 2 && s == DSK_OK; pass++) /* pass 0: files, pass 1: directories */
        for (size_t i = 0; i < n && *used < cap; i++) {
            struct stat st;
            snprintf(path, sizeof path, "%s/%s", dir, names[i]);
            if (lstat(path, &st) != 0) continue;
            if (pass == 0 && S_ISREG(st.st_mode) && td_is_header_name(names[i])) {
                FILE *f = fopen(path, "rb");
                if (!f) continue;
                *used += fread(buf + *used, 1, cap - *used, f);
                fclose(f);
                (*nfiles)++;
            } else if (pass == 1 && S_ISDIR(st.st_mode) && depth < 16) {
                if ((s = td_walk_headers(path, buf, cap, used, nfiles, depth + 1)) != DSK_OK) break;
            }
        }
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
    return s;
}

static dsk_status td_load_default(td_corpus *c, const char *root, size_t cap_bytes) {
    size_t used = 0;
    int nfiles = 0;
    c->owned = (uint8_t *)malloc(cap_bytes ? cap_bytes : 1);
    if (!c->owned) return dsk_set_error(DSK_ERR_OOM, "default corpus: out of memory for %zu bytes", cap_bytes);
    dsk_status s = td_walk_headers(root, c->owned, cap_bytes, &used, &nfiles, 0);
    if (s != DSK_OK) return s;
    if (used == 0) return dsk_set_error(DSK_ERR_IO, "default corpus: no .h files under %s; pass --data FILE", root);
    snprintf(c->source, sizeof c->source, "%s (%d C header files, %.2f MB)", root, nfiles, used / 1e6);
    c->token_bytes = 1;
    c->vocab = 256;
    return td_add_segment(c, c->owned, (int64_t)used, NULL, 0);
}

/* Loads the corpus: `paths` (n > 0) or the default one under `default_root`. */
static dsk_status td_load(td_corpus *c, char **paths, int n, int shard_vocab, const char *default_root, size_t cap_bytes) {
    memset(c, 0, sizeof *c);
    if (n == 0) return td_load_default(c, default_root, cap_bytes);
    for (int i = 0; i < n; i++) {
        dsk_status s = td_add_file(c, paths[i], shard_vocab);
        if (s != DSK_OK) return s;
    }
    snprintf(c->source, sizeof c->source, "%s%s (%d %s, %lld tokens)", paths[0], n > 1 ? ", ..." : "", n,
             c->token_bytes == 2 ? "token shards" : "byte files", (long long)c->ntok);
    return DSK_OK;
}

/* Cuts the stream into windows of T + 1 tokens and checks there is enough of it: at least
   `min_train` training windows (one global batch) and one validation window. */
static dsk_status td_set_windows(td_corpus *c, int64_t T, int64_t val_every, int64_t min_train) {
    c->T = T;
    c->val_every = val_every;
    c->n_windows = c->ntok / (T + 1);
    c->n_val = c->n_windows / val_every;
    c->n_train = c->n_windows - c->n_val;
    if (c->n_train < min_train || c->n_val < 1)
        return dsk_set_error(DSK_ERR_ARG,
                             "corpus %s has %lld tokens = %lld windows of %lld (--seq + 1), %lld for training and %lld held out "
                             "(--val-every %lld); one global batch needs %lld training windows and validation needs 1",
                             c->source, (long long)c->ntok, (long long)c->n_windows, (long long)(T + 1), (long long)c->n_train,
                             (long long)c->n_val, (long long)val_every, (long long)min_train);
    return DSK_OK;
}

/* Copies tokens [pos, pos + n) of the stream into out as int32. */
static void td_read(const td_corpus *c, int64_t pos, int64_t n, int32_t *out) {
    int si = 0;
    while (si + 1 < c->nseg && c->seg[si + 1].start <= pos) si++;
    for (int64_t i = 0; i < n; i++, pos++) {
        while (pos >= c->seg[si].start + c->seg[si].ntok) si++;
        int64_t o = pos - c->seg[si].start;
        const uint8_t *t = c->seg[si].tokens;
        out[i] = c->token_bytes == 1 ? t[o] : (int32_t)(t[2 * o] | t[2 * o + 1] << 8);
    }
}

/* Window index of training window i and validation window i. */
static int64_t td_train_window(const td_corpus *c, int64_t i) { return i + i / (c->val_every - 1); }
static int64_t td_val_window(const td_corpus *c, int64_t i) { return i * c->val_every + c->val_every - 1; }

/* Reads window w as inputs (T) and next-token targets (T). */
static void td_read_window(const td_corpus *c, int64_t w, int32_t *inputs, int32_t *targets, int32_t *scratch) {
    td_read(c, w * (c->T + 1), c->T + 1, scratch);
    memcpy(inputs, scratch, (size_t)c->T * sizeof *inputs);
    memcpy(targets, scratch + 1, (size_t)c->T * sizeof *targets);
}

/* The training window global sequence j reads. */
static int64_t td_sample(const td_corpus *c, uint64_t seed, int64_t j) {
    uint32_t r[4];
    dsk_philox4x32(seed ^ 0x5DEECE66Dull, (uint64_t)j, r);
    uint64_t x = (uint64_t)r[0] | (uint64_t)r[1] << 32;
    return td_train_window(c, (int64_t)(x % (uint64_t)c->n_train));
}

#endif /* TRAIN_DATA_H */
