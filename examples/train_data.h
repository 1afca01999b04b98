/* train_data.h - the data side of examples/train_moe.c: corpus, sampler, background loader.

   A corpus is one stream of tokens made of segments:
     - plain files, read as bytes (vocabulary 256), memory-mapped;
     - llm.c / nanoGPT token shards (256 int32 header: magic 20240520, version 1, token
       count; then uint16 tokens), detected by the header, memory-mapped;
     - the default corpus: the C headers under /usr/include in a fixed order (each
       directory's files sorted by name, then its subdirectories sorted by name), copied
       into one buffer. Its text is whatever this machine has installed, so two machines
       train on different data: tests pass --data tests/data/corpus.txt instead.
   A cap (`cap_bytes`) keeps the first cap_bytes of token data of the stream (a shard token
   is 2 bytes), whichever the source; without one the default corpus stops at 4 MB.
   The stream is cut into windows of T + 1 tokens; every `val_every`-th window is held out
   for validation, the rest are the N training samples.

   Sampler: exactly PyTorch's DistributedSampler(range(N), world, rank, shuffle, seed,
   drop_last) with set_epoch(e): the permutation is torch.randperm(N) from a generator
   seeded with seed + e (MT19937, torch's Fisher-Yates), padded by repeating its first
   indices (or cut, with drop_last) to a multiple of the world size, and rank r takes
   positions r, r + world, ... Each rank reads its epochs back to back as one stream of
   samples; batch k of a rank is positions [k*b, (k+1)*b) of that stream, so every rank
   crosses an epoch at the same batch and the data position is one number (the batch index).

   Loader: a thread fills a ring of `depth` batches ahead of the trainer; the trainer's
   wait for a batch is measured (the data-wait time of the step line).

   Contents: 1. corpus  2. windows  3. MT19937 and torch.randperm  4. DistributedSampler
             5. background loader
   Only for the example: errors go through dsk_set_error like the library's. */
#ifndef TRAIN_DATA_H
#define TRAIN_DATA_H

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../dsk_tensor.h"

#define TD_SHARD_MAGIC 20240520
#define TD_SHARD_HEADER_BYTES 1024

/* ------------------------------------------------------------------ 1. corpus */

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
    char source[320];      /* for messages: "tests/data/corpus.txt (1 byte file, 300000 of 473235 tokens)" */
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
    snprintf(c->source, sizeof c->source, "default corpus, the C headers under %s (%d files, %.2f MB; "
             "differs between machines)", root, nfiles, used / 1e6);
    c->token_bytes = 1;
    c->vocab = 256;
    return td_add_segment(c, c->owned, (int64_t)used, NULL, 0);
}

/* Keeps the first cap_bytes / token_bytes tokens of the stream: later segments are cut or
   unmapped. */
static void td_cap(td_corpus *c, size_t cap_bytes) {
    int64_t keep = (int64_t)(cap_bytes / (size_t)c->token_bytes);
    if (keep >= c->ntok) return;
    int n = 0;
    for (; n < c->nseg && c->seg[n].start < keep; n++)
        if (c->seg[n].ntok > keep - c->seg[n].start) c->seg[n].ntok = keep - c->seg[n].start;
    for (int i = n; i < c->nseg; i++) munmap(c->seg[i].map, c->seg[i].map_len);
    c->nseg = n;
    c->ntok = keep;
}

/* c->source for files: their names (or the first and a count when they are long), the kind
   and the tokens kept of all (`all`). */
static void td_describe_files(td_corpus *c, char **paths, int n, int64_t all) {
    char tokens[96];
    if (c->ntok < all) snprintf(tokens, sizeof tokens, "%lld of %lld tokens", (long long)c->ntok, (long long)all);
    else snprintf(tokens, sizeof tokens, "%lld tokens", (long long)c->ntok);
    size_t names = 0, len = 0, room = sizeof c->source - sizeof tokens - 32;
    for (int i = 0; i < n; i++) names += strlen(paths[i]) + 1;
    if (names <= room)
        for (int i = 0; i < n; i++)
            len += (size_t)snprintf(c->source + len, room - len, "%s%s", i ? " " : "", paths[i]);
    else
        len = (size_t)snprintf(c->source, room, "%.120s and %d more", paths[0], n - 1);
    snprintf(c->source + len, sizeof c->source - len, " (%d %s%s, %s)", n,
             c->token_bytes == 2 ? "token shard" : "byte file", n > 1 ? "s" : "", tokens);
}

/* The default corpus's cap when none is given. */
#define TD_DEFAULT_CORPUS_BYTES 4000000

/* Loads the corpus: `paths` (n > 0) or the default one under `default_root`. cap_bytes keeps
   the first cap_bytes of token data; 0 keeps all of `paths`, TD_DEFAULT_CORPUS_BYTES of the
   default corpus. */
static dsk_status td_load(td_corpus *c, char **paths, int n, int shard_vocab, const char *default_root,
                          size_t cap_bytes) {
    memset(c, 0, sizeof *c);
    if (n == 0) return td_load_default(c, default_root, cap_bytes ? cap_bytes : TD_DEFAULT_CORPUS_BYTES);
    for (int i = 0; i < n; i++) {
        dsk_status s = td_add_file(c, paths[i], shard_vocab);
        if (s != DSK_OK) return s;
    }
    int64_t all = c->ntok;
    if (cap_bytes) td_cap(c, cap_bytes);
    td_describe_files(c, paths, n, all);
    return DSK_OK;
}

/* ------------------------------------------------------------------ 2. windows */

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

/* ------------------------------------------------------------------ 3. MT19937 and torch.randperm */

/* The Mersenne Twister MT19937 (Matsumoto and Nishimura), 32-bit outputs, its state set by
   the reference init_genrand from the low 32 bits of the seed: the CPU engine behind
   torch.Generator().manual_seed(seed). */
typedef struct td_mt19937 {
    uint32_t s[624];
    int i;
} td_mt19937;

static void td_mt_seed(td_mt19937 *m, uint64_t seed) {
    m->s[0] = (uint32_t)seed;
    for (int j = 1; j < 624; j++) m->s[j] = 1812433253u * (m->s[j - 1] ^ (m->s[j - 1] >> 30)) + (uint32_t)j;
    m->i = 624;
}

static uint32_t td_mt_next(td_mt19937 *m) {
    if (m->i == 624) { /* the next 624 words of state at once */
        for (int k = 0; k < 624; k++) {
            uint32_t y = (m->s[k] & 0x80000000u) | (m->s[(k + 1) % 624] & 0x7fffffffu);
            m->s[k] = m->s[(k + 397) % 624] ^ (y >> 1) ^ ((y & 1u) ? 0x9908b0dfu : 0u);
        }
        m->i = 0;
    }
    uint32_t y = m->s[m->i++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    return y ^ (y >> 18);
}

/* torch.randperm shuffles n < UINT32_MAX / 20 with the loop of td_randperm; newer PyTorch
   takes another path above that, so the sampler stops there. */
#define TD_RANDPERM_MAX_N 214748364

/* perm (n) = torch.randperm(n, generator=torch.Generator().manual_seed(seed)): swap element
   i with element i + (next 32-bit output mod (n - i)), for i = 0 .. n - 2. */
static void td_randperm(uint32_t *perm, int64_t n, uint64_t seed) {
    td_mt19937 m;
    td_mt_seed(&m, seed);
    for (int64_t i = 0; i < n; i++) perm[i] = (uint32_t)i;
    for (int64_t i = 0; i + 1 < n; i++) {
        int64_t z = i + (int64_t)(td_mt_next(&m) % (uint64_t)(n - i));
        uint32_t x = perm[i];
        perm[i] = perm[z];
        perm[z] = x;
    }
}

/* ------------------------------------------------------------------ 4. DistributedSampler */

typedef struct td_sampler {
    int64_t n;            /* samples in the dataset */
    int world, rank, shuffle, drop_last;
    uint64_t seed;
    int64_t num_samples;  /* per rank and epoch */
    int64_t total_size;   /* num_samples * world: n plus the padding, or n less the cut tail */
    int64_t epoch;        /* epoch whose order perm holds, -1: none yet */
    uint32_t *perm;       /* (n) with shuffle */
} td_sampler;

static void td_sampler_free(td_sampler *s) {
    free(s->perm);
    memset(s, 0, sizeof *s);
}

/* DistributedSampler's sizes: num_samples = ceil(n / world), or floor(n / world) with
   drop_last (its ceil((n - world) / world) when world does not divide n). */
static dsk_status td_sampler_init(td_sampler *s, int64_t n, int world, int rank, uint64_t seed, int shuffle,
                                  int drop_last) {
    memset(s, 0, sizeof *s);
    if (n < 1 || n >= TD_RANDPERM_MAX_N)
        return dsk_set_error(DSK_ERR_ARG, "td_sampler_init: %lld samples; the sampler reproduces torch.randperm for "
                             "1 to %d", (long long)n, TD_RANDPERM_MAX_N - 1);
    if (world < 1 || rank < 0 || rank >= world)
        return dsk_set_error(DSK_ERR_ARG, "td_sampler_init: rank %d of world %d", rank, world);
    s->n = n;
    s->world = world;
    s->rank = rank;
    s->seed = seed;
    s->shuffle = shuffle;
    s->drop_last = drop_last;
    s->num_samples = drop_last ? n / world : (n + world - 1) / world;
    s->total_size = s->num_samples * world;
    s->epoch = -1;
    if (s->num_samples < 1)
        return dsk_set_error(DSK_ERR_ARG, "--drop-last: %lld training samples over %d ranks leave none per rank",
                             (long long)n, world);
    return DSK_OK;
}

/* *index = the sample at position p of this rank's stream: item p % num_samples of
   DistributedSampler's iteration in epoch p / num_samples. Padding repeats the permutation
   from its start, so global position g reads perm[g mod n]. */
static dsk_status td_sampler_at(td_sampler *s, int64_t p, int64_t *index) {
    int64_t epoch = p / s->num_samples, g = s->rank + (p % s->num_samples) * s->world;
    if (!s->shuffle) {
        *index = g % s->n;
        return DSK_OK;
    }
    if (epoch != s->epoch) {
        if (!s->perm && !(s->perm = (uint32_t *)malloc((size_t)s->n * sizeof *s->perm)))
            return dsk_set_error(DSK_ERR_OOM, "td_sampler_at: out of memory for a permutation of %lld samples",
                                 (long long)s->n);
        td_randperm(s->perm, s->n, s->seed + (uint64_t)epoch);
        s->epoch = epoch;
    }
    *index = s->perm[g % s->n];
    return DSK_OK;
}

/* ------------------------------------------------------------------ 5. background loader */

typedef struct td_loader {
    const td_corpus *c;
    td_sampler smp;       /* read by the filling thread only while it runs */
    int b, depth;         /* sequences per batch; batches filled ahead (0: in the caller, no thread) */
    int32_t *ids, *tgt;   /* (max(depth, 1), b, T) */
    int64_t *index;       /* (max(depth, 1), b) sample of each sequence */
    int64_t *slot;        /* (max(depth, 1)) batch each slot holds, -1: none */
    int32_t *win;         /* (T + 1) scratch of the filling thread */
    int64_t next_fill, next_take;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int sync_ready, running, stop;
    dsk_status err;       /* the filling thread's failure; its message in msg */
    char msg[1024];
} td_loader;

static void td_loader_halt(td_loader *L) {
    if (!L->running) return;
    pthread_mutex_lock(&L->mu);
    L->stop = 1;
    pthread_cond_broadcast(&L->cv);
    pthread_mutex_unlock(&L->mu);
    pthread_join(L->thread, NULL);
    L->running = 0;
}

static void td_loader_free(td_loader *L) {
    td_loader_halt(L);
    if (L->sync_ready) {
        pthread_mutex_destroy(&L->mu);
        pthread_cond_destroy(&L->cv);
    }
    td_sampler_free(&L->smp);
    free(L->ids);
    free(L->tgt);
    free(L->index);
    free(L->slot);
    free(L->win);
    memset(L, 0, sizeof *L);
}

/* A loader of batches of b sequences for `rank` of `world`, `depth` batches ahead. */
static dsk_status td_loader_init(td_loader *L, const td_corpus *c, int b, int depth, int world, int rank, uint64_t seed,
                                 int shuffle, int drop_last) {
    memset(L, 0, sizeof *L);
    if (b < 1 || depth < 0) return dsk_set_error(DSK_ERR_ARG, "td_loader_init: batch %d, depth %d", b, depth);
    dsk_status s = td_sampler_init(&L->smp, c->n_train, world, rank, seed, shuffle, drop_last);
    if (s != DSK_OK) return s;
    L->c = c;
    L->b = b;
    L->depth = depth;
    size_t slots = (size_t)(depth > 0 ? depth : 1), seqs = slots * (size_t)b;
    L->ids = (int32_t *)malloc(seqs * (size_t)c->T * sizeof *L->ids);
    L->tgt = (int32_t *)malloc(seqs * (size_t)c->T * sizeof *L->tgt);
    L->index = (int64_t *)malloc(seqs * sizeof *L->index);
    L->slot = (int64_t *)malloc(slots * sizeof *L->slot);
    L->win = (int32_t *)malloc((size_t)(c->T + 1) * sizeof *L->win);
    if (!L->ids || !L->tgt || !L->index || !L->slot || !L->win) {
        td_loader_free(L);
        return dsk_set_error(DSK_ERR_OOM, "td_loader_init: out of memory for %zu batches of %d x %lld tokens", slots, b,
                             (long long)c->T);
    }
    if (pthread_mutex_init(&L->mu, NULL) != 0 || pthread_cond_init(&L->cv, NULL) != 0) {
        td_loader_free(L);
        return dsk_set_error(DSK_ERR_OOM, "td_loader_init: cannot create the loader's mutex");
    }
    L->sync_ready = 1;
    return DSK_OK;
}

/* Reads batch k into slot k mod depth. */
static dsk_status td_loader_fill(td_loader *L, int64_t k) {
    int64_t T = L->c->T, slot = k % (L->depth > 0 ? L->depth : 1);
    for (int j = 0; j < L->b; j++) {
        int64_t seq = slot * L->b + j;
        dsk_status s = td_sampler_at(&L->smp, k * L->b + j, &L->index[seq]);
        if (s != DSK_OK) return s;
        td_read_window(L->c, td_train_window(L->c, L->index[seq]), L->ids + seq * T, L->tgt + seq * T, L->win);
    }
    return DSK_OK;
}

/* The filling thread: keeps batches [next_take, next_take + depth) ready. */
static void *td_loader_main(void *arg) {
    td_loader *L = (td_loader *)arg;
    pthread_mutex_lock(&L->mu);
    while (!L->stop) {
        if (L->next_fill - L->next_take >= L->depth) {
            pthread_cond_wait(&L->cv, &L->mu);
            continue;
        }
        int64_t k = L->next_fill;
        pthread_mutex_unlock(&L->mu);
        dsk_status s = td_loader_fill(L, k);
        pthread_mutex_lock(&L->mu);
        if (s != DSK_OK) {
            L->err = s;
            snprintf(L->msg, sizeof L->msg, "%s", dsk_last_error());
            pthread_cond_broadcast(&L->cv);
            break;
        }
        L->slot[k % L->depth] = k;
        L->next_fill = k + 1;
        pthread_cond_broadcast(&L->cv);
    }
    pthread_mutex_unlock(&L->mu);
    return NULL;
}

/* Drops what was prepared and prepares from batch k on. */
static dsk_status td_loader_seek(td_loader *L, int64_t k) {
    td_loader_halt(L);
    for (int i = 0; i < (L->depth > 0 ? L->depth : 1); i++) L->slot[i] = -1;
    L->next_fill = L->next_take = k;
    L->stop = 0;
    L->err = DSK_OK;
    if (L->depth == 0) return DSK_OK;
    int e = pthread_create(&L->thread, NULL, td_loader_main, L);
    if (e != 0) return dsk_set_error(DSK_ERR_OOM, "td_loader_seek: cannot start the loader thread: %s", strerror(e));
    L->running = 1;
    return DSK_OK;
}

/* Copies batch k (b sequences of T inputs and T targets) into ids and tgt, and its
   samples into index (b, may be NULL); waits for the filling thread when it is behind.
   Any k works: a k other than the next one (a resume) restarts the filling there. */
static dsk_status td_loader_next(td_loader *L, int64_t k, int32_t *ids, int32_t *tgt, int64_t *index) {
    if (k < 0) return dsk_set_error(DSK_ERR_ARG, "td_loader_next: batch %lld", (long long)k);
    if (k != L->next_take || (L->depth > 0 && !L->running)) {
        dsk_status s = td_loader_seek(L, k);
        if (s != DSK_OK) return s;
    }
    int64_t slot = 0;
    if (L->depth == 0) {
        dsk_status s = td_loader_fill(L, k);
        if (s != DSK_OK) return s;
    } else {
        slot = k % L->depth;
        pthread_mutex_lock(&L->mu);
        while (L->slot[slot] != k && L->err == DSK_OK) pthread_cond_wait(&L->cv, &L->mu);
        int ready = L->slot[slot] == k;
        pthread_mutex_unlock(&L->mu);
        if (!ready) return dsk_set_error(L->err, "%s", L->msg);
    }
    size_t n = (size_t)L->b * (size_t)L->c->T;
    memcpy(ids, L->ids + (size_t)slot * n, n * sizeof *ids);
    memcpy(tgt, L->tgt + (size_t)slot * n, n * sizeof *tgt);
    if (index) memcpy(index, L->index + slot * L->b, (size_t)L->b * sizeof *index);
    pthread_mutex_lock(&L->mu);
    L->slot[slot] = -1;
    L->next_take = k + 1;
    pthread_cond_broadcast(&L->cv);
    pthread_mutex_unlock(&L->mu);
    return DSK_OK;
}

/* One JSON line per batch for --sample-log: {"rank":r,"batch":k,"samples":[[epoch,sample],...]},
   written with one write() so ranks appending to one file (O_APPEND) never interleave. */
static dsk_status td_log_batch(int fd, int rank, const td_sampler *smp, int64_t k, int b, const int64_t *index) {
    size_t cap = 64 + (size_t)b * 48, len = 0;
    char *line = (char *)malloc(cap);
    if (!line) return dsk_set_error(DSK_ERR_OOM, "--sample-log: out of memory");
    len += (size_t)snprintf(line, cap, "{\"rank\":%d,\"batch\":%lld,\"samples\":[", rank, (long long)k);
    for (int j = 0; j < b; j++)
        len += (size_t)snprintf(line + len, cap - len, "%s[%lld,%lld]", j ? "," : "",
                                (long long)((k * b + j) / smp->num_samples), (long long)index[j]);
    len += (size_t)snprintf(line + len, cap - len, "]}\n");
    ssize_t w = write(fd, line, len);
    free(line);
    if (w != (ssize_t)len)
        return dsk_set_error(DSK_ERR_IO, "--sample-log: write failed: %s", w < 0 ? strerror(errno) : "short write");
    return DSK_OK;
}

#endif /* TRAIN_DATA_H */
