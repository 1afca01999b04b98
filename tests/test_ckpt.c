/* test_ckpt.c - dsk_ckpt.h: the content hash, sharded checkpoints (forked ranks with a
   file-based barrier), resharding, async save, rotation, latest, the DeepSeek hub names, and
   every fault the issue lists: SIGKILLed writers, corrupt/truncated checkpoints, a full disk.
   The safetensors files themselves: tests/test_safetensors.c. */
#define DSK_CKPT_IMPLEMENTATION
#include "dsk_tensor.h"
#include "dsk_ckpt.h"
#include "tests/dsk_test.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/dsk_test_files.h"

static void sleep_us(long us) {
    struct timespec ts;
    ts.tv_sec = us / 1000000;
    ts.tv_nsec = (us % 1000000) * 1000;
    nanosleep(&ts, NULL);
}

static void copy_file(const char *from, const char *to) {
    size_t n;
    unsigned char *p = read_file(from, &n);
    if (p) write_file(to, p, n);
    free(p);
}

/* Copies every regular file of directory `from` into a new directory `to`. */
static void copy_dir(const char *from, const char *to) {
    DIR *d = opendir(from);
    struct dirent *de;
    char a[1024], b[1024];
    mkdir(to, 0755);
    while (d && (de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.') continue;
        snprintf(a, sizeof a, "%s/%s", from, de->d_name);
        snprintf(b, sizeof b, "%s/%s", to, de->d_name);
        copy_file(a, b);
    }
    if (d) closedir(d);
}

static int count_tmp_files(const char *dir) {
    DIR *d = opendir(dir);
    struct dirent *de;
    int n = 0;
    while (d && (de = readdir(d)) != NULL)
        if (strstr(de->d_name, ".tmp")) n++;
    if (d) closedir(d);
    return n;
}

/* The path of rank `rank`'s file in step directory `step_dir` ("rank_<r>.<nonce>.safetensors",
   the nonce of the save that wrote it); "" when there is none. */
static void rank_file(const char *step_dir, int rank, char *out, size_t n) {
    DIR *d = opendir(step_dir);
    struct dirent *de;
    char prefix[32];
    snprintf(prefix, sizeof prefix, "rank_%05d.", rank);
    out[0] = 0;
    while (d && (de = readdir(d)) != NULL)
        if (strncmp(de->d_name, prefix, strlen(prefix)) == 0 && strstr(de->d_name, ".safetensors"))
            snprintf(out, n, "%s/%s", step_dir, de->d_name);
    if (d) closedir(d);
}

/* Rewrites a manifest's last line with the CRC32C of its new text, as a writer would: so a
   test can alter a manifest and still reach the checks behind its CRC. */
static void reseal_manifest(const char *path) {
    size_t n;
    unsigned char *b = read_file(path, &n);
    char line[32];
    if (!b || n < 22) { free(b); return; }
    snprintf(line, sizeof line, ",\"crc32c\":\"%08x\"}\n", dsk_safetensors_crc32c(0, b, n - 22));
    memcpy(b + n - 22, line, 22);
    write_file(path, b, n);
    free(b);
}

/* Replaces the first `from` in a file by `to` (same length or not); 0 when absent. */
static int edit_file(const char *path, const char *from, const char *to) {
    size_t n;
    unsigned char *b = read_file(path, &n);
    char *hit, *out;
    size_t a, lf = strlen(from), lt = strlen(to);
    if (!b) return 0;
    b[n] = 0;
    if (!(hit = strstr((char *)b, from))) { free(b); return 0; }
    a = (size_t)(hit - (char *)b);
    out = (char *)malloc(n - lf + lt + 1);
    memcpy(out, b, a);
    memcpy(out + a, to, lt);
    memcpy(out + a + lt, b + a + lf, n - a - lf);
    write_file(path, out, n - lf + lt);
    free(out);
    free(b);
    return 1;
}

/* ------------------------------------------------------------ a file-based barrier for forked ranks */

typedef struct fbar {
    char dir[400];
    int rank, world, count;
} fbar;

static dsk_status fbar_wait(void *user) {
    fbar *b = (fbar *)user;
    char path[500];
    double deadline = dsk_test_now() + 60.0;
    int fd;
    b->count++;
    snprintf(path, sizeof path, "%s/b%d_r%d", b->dir, b->count, b->rank);
    if ((fd = open(path, O_CREAT | O_WRONLY, 0644)) < 0)
        return dsk_set_error(DSK_ERR_IO, "fbar: cannot create %s", path);
    close(fd);
    for (;;) {
        int all = 1;
        for (int r = 0; r < b->world && all; r++) {
            snprintf(path, sizeof path, "%s/b%d_r%d", b->dir, b->count, r);
            all = access(path, F_OK) == 0;
        }
        if (all) return DSK_OK;
        if (dsk_test_now() > deadline)
            return dsk_set_error(DSK_ERR_TIMEOUT, "fbar: barrier %d timed out on rank %d", b->count, b->rank);
        sleep_us(200);
    }
}

/* Checkpoint options for `rank` of `world` meeting at the file barrier b in directory bar_dir. */
static void fbar_opts(dsk_ckpt_opts *o, fbar *b, const char *bar_dir, int rank, int world) {
    memset(o, 0, sizeof *o);
    memset(b, 0, sizeof *b);
    snprintf(b->dir, sizeof b->dir, "%s", bar_dir);
    b->rank = rank;
    b->world = world;
    o->rank = rank;
    o->world_size = world;
    o->barrier = fbar_wait;
    o->barrier_user = b;
}

/* An agreement over the same directory (opts.agree): each call, every rank writes its words to
   a file of its own, waits for the others' and takes the element-wise maximum. */
static dsk_status fbar_agree(void *user, int64_t *w, int n) {
    fbar *b = (fbar *)user;
    char path[500], tmp[520];
    double deadline = dsk_test_now() + 60.0;
    int64_t *got = (int64_t *)malloc((size_t)n * sizeof *got);
    FILE *f;
    b->count++;
    snprintf(path, sizeof path, "%s/a%d_r%d", b->dir, b->count, b->rank);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    if (!got || !(f = fopen(tmp, "wb")) || fwrite(w, sizeof *w, (size_t)n, f) != (size_t)n || fclose(f) != 0 ||
        rename(tmp, path) != 0) {
        free(got);
        return dsk_set_error(DSK_ERR_IO, "fbar_agree: cannot write %s", path);
    }
    for (int r = 0; r < b->world; r++) {
        snprintf(path, sizeof path, "%s/a%d_r%d", b->dir, b->count, r);
        while (!(f = fopen(path, "rb"))) {
            if (dsk_test_now() > deadline) {
                free(got);
                return dsk_set_error(DSK_ERR_TIMEOUT, "fbar_agree: %d timed out on rank %d", b->count, b->rank);
            }
            sleep_us(200);
        }
        if (fread(got, sizeof *got, (size_t)n, f) != (size_t)n) {
            fclose(f);
            free(got);
            return dsk_set_error(DSK_ERR_IO, "fbar_agree: short %s", path);
        }
        fclose(f);
        for (int i = 0; i < n; i++) w[i] = got[i] > w[i] ? got[i] : w[i];
    }
    free(got);
    return DSK_OK;
}

/* As fbar_opts, with the agreement instead of the barrier. */
static void fagree_opts(dsk_ckpt_opts *o, fbar *b, const char *bar_dir, int rank, int world) {
    fbar_opts(o, b, bar_dir, rank, world);
    o->barrier = NULL;
    o->barrier_user = NULL;
    o->agree = fbar_agree;
    o->agree_user = b;
}

/* Runs fn(rank, world, arg) in `world` forked processes; returns how many failed. A child
   reports failure through its exit status and prints why. */
typedef int (*rank_fn)(int rank, int world, void *arg);
static int run_ranks(int world, rank_fn fn, void *arg) {
    pid_t pids[16];
    int failed = 0;
    fflush(stdout);
    for (int r = 0; r < world; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            int rc = fn(r, world, arg);
            fflush(stdout);
            _exit(rc);
        }
    }
    for (int r = 0; r < world; r++) {
        int st = 0;
        waitpid(pids[r], &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) failed++;
    }
    return failed;
}

/* Runs fn(arg) in a child that is killed after `seconds`: 0 when it returned 0, 1 when it
   returned non-zero, -1 when it hung (the fault under test blocks forever). */
static int run_child_timeout(int (*fn)(void *), void *arg, int seconds) {
    pid_t pid;
    int st = 0;
    fflush(stdout);
    if ((pid = fork()) == 0) {
        int rc;
        alarm((unsigned)seconds);
        rc = fn(arg);
        fflush(stdout);
        _exit(rc);
    }
    waitpid(pid, &st, 0);
    if (WIFSIGNALED(st)) return -1;
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : 1;
}

/* The content hash (incremental saves) is the polynomial its comment defines: checked against
   a one-lane evaluation of that definition on random bytes of lengths around the 16-byte lane
   stride, and one flipped bit always changes it. */
static uint64_t hash_reference(const unsigned char *p, size_t n) {
    const uint64_t P = 0x1fffffffffffffffull, B = DSK__CKPT_HASH_B;
    size_t m = (n + 15) / 16 * 4;
    uint64_t h = 0;
    for (size_t i = 0; i < m; i++) {
        uint64_t v = 0;
        for (int k = 0; k < 4; k++)
            if (4 * i + (size_t)k < n) v |= (uint64_t)p[4 * i + (size_t)k] << (8 * k);
        h = (uint64_t)(((unsigned __int128)h * B + v) % P);
    }
    return (uint64_t)(((unsigned __int128)h * B + n) % P);
}

static void test_content_hash(void) {
    static const size_t lens[] = {0, 1, 3, 4, 5, 15, 16, 17, 31, 32, 33, 100, 4097};
    unsigned char *buf = (unsigned char *)malloc(4097);
    for (size_t i = 0; i < 4097; i++) buf[i] = (unsigned char)dsk_test_rand_u64();
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        size_t n = lens[li];
        uint64_t h = dsk__ckpt_hash(buf, n);
        DSK_TEST_EXPECT(h == hash_reference(buf, n), "length %zu: %016llx, the definition gives %016llx", n,
                        (unsigned long long)h, (unsigned long long)hash_reference(buf, n));
        if (n) {
            size_t at = (size_t)dsk_test_rand_int((int64_t)n);
            buf[at] ^= (unsigned char)(1u << dsk_test_rand_int(8));
            DSK_TEST_EXPECT(dsk__ckpt_hash(buf, n) != h, "length %zu: a flipped bit at %zu kept the hash", n, at);
        }
    }
    memset(buf, 0, 8);
    DSK_TEST_EXPECT(dsk__ckpt_hash(buf, 4) != dsk__ckpt_hash(buf, 5),
                    "4 and 5 zero bytes hash alike: the length is not in the hash");
    free(buf);
}

/* ------------------------------------------------------------ DeepSeek hub names, options */

#ifndef DSK_CKPT_NO_HF
/* dsk_moe parameters by their hub names; an unknown parameter and a short buffer are errors. */
static void test_hf_deepseek_names(void) {
    char names[4][160], name[160];
    const char *params[4] = {"w1", "w2", "router", "bias"};
    for (int i = 0; i < 4; i++) DSK_TEST_OK(dsk_ckpt_hf_deepseek_name(names[i], sizeof names[i], 3, params[i]));
    DSK_TEST_EXPECT(!strcmp(names[0], "model.layers.3.mlp.experts.{E}.gate_proj.weight") &&
                        !strcmp(names[1], "model.layers.3.mlp.experts.{E}.down_proj.weight") &&
                        !strcmp(names[2], "model.layers.3.mlp.gate.weight") &&
                        !strcmp(names[3], "model.layers.3.mlp.gate.e_score_correction_bias"),
                    "DeepSeek names: %s %s %s %s", names[0], names[1], names[2], names[3]);
    DSK_TEST_OK(dsk_ckpt_hf_deepseek_name(name, sizeof name, 0, "shared.w3"));
    DSK_TEST_EXPECT(!strcmp(name, "model.layers.0.mlp.shared_experts.up_proj.weight"), "shared.w3: %s", name);
    DSK_TEST_STATUS(dsk_ckpt_hf_deepseek_name(name, sizeof name, 0, "w9"), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("no DeepSeek name for dsk_moe parameter \"w9\"");
    DSK_TEST_STATUS(dsk_ckpt_hf_deepseek_name(name, 10, 0, "w1"), DSK_ERR_ARG);
}
#endif

/* dsk_ckpt_options names the switches this file was compiled with (tests/test_headers.sh
   builds it again with DSK_CKPT_NO_HF and DSK_SAFETENSORS_NO_SSE42 and runs this). */
static void test_options(void) {
    const char *o = dsk_ckpt_options();
    int hf = strstr(o, "DSK_CKPT_NO_HF") != NULL, sse = strstr(o, "DSK_SAFETENSORS_NO_SSE42") != NULL;
#ifdef DSK_CKPT_NO_HF
    DSK_TEST_EXPECT(hf, "built with DSK_CKPT_NO_HF, the options say \"%s\"", o);
#else
    DSK_TEST_EXPECT(!hf, "built without DSK_CKPT_NO_HF, the options say \"%s\"", o);
#endif
#ifdef DSK_SAFETENSORS_NO_SSE42
    DSK_TEST_EXPECT(sse, "built with DSK_SAFETENSORS_NO_SSE42, the options say \"%s\"", o);
#else
    DSK_TEST_EXPECT(!sse, "built without DSK_SAFETENSORS_NO_SSE42, the options say \"%s\"", o);
#endif
    DSK_TEST_EXPECT(strstr(o, dsk_safetensors_options()) != NULL, "\"%s\" lacks dsk_safetensors_options() \"%s\"", o,
                    dsk_safetensors_options());
}

/* ------------------------------------------------------------ checkpoints, one rank */

static void test_ckpt_single_rank(void) {
    char dir[400], path[600], latest[64] = "";
    const int64_t s1[3] = {3, 5, 7}, s2[1] = {129};
    dsk_tensor a, b, c, a2, b2, c2;
    dsk_ckpt ck;
    dsk_ckpt_meta meta;
    dsk_ckpt_opts o;
    char lossbuf[64];
    double loss = -1.0 / 3.0, loss_back = 0;
    int64_t pos = 0, st = -5;
    size_t n;
    unsigned char *txt;
    memset(&o, 0, sizeof o);
    new_dir(dir, sizeof dir, "single");
    alloc_t(&a, DSK_F32, 3, s1); fill_f32(&a);
    alloc_t(&b, DSK_BF16, 1, s2); fill_random_bytes(&b);
    alloc_t(&c, DSK_F64, 0, NULL); ((double *)c.data)[0] = dsk_test_rand(-1, 1);
    snprintf(lossbuf, sizeof lossbuf, "%a", loss);
    {
        dsk_ckpt_entry e[3] = {{"layer.0.w", &a, 0, 0, 0, NULL, NULL},
                               {"emb", &b, 0, 0, 0, NULL, NULL},
                               {"scalar", &c, 0, 0, 0, NULL, NULL}};
        dsk_ckpt_kv kv[3] = {{"loss_scale", lossbuf}, {"data_pos", "123456789012"}, {"rng", "seed=7;offset=99"}};
        DSK_TEST_OK(dsk_ckpt_init(&ck, dir, &o));
        DSK_TEST_OK(dsk_ckpt_latest(dir, &st));
        DSK_TEST_EXPECT(st == -1, "latest of an empty dir is %lld", (long long)st);
        DSK_TEST_OK(dsk_ckpt_save(&ck, 7, e, 3, kv, 3));
        DSK_TEST_OK(dsk_ckpt_latest(dir, &st));
        DSK_TEST_EXPECT(st == 7, "latest %lld", (long long)st);
        DSK_TEST_OK(dsk_ckpt_verify(dir, 7));
        snprintf(path, sizeof path, "%s/latest", dir);
        if ((txt = read_file(path, &n)) != NULL) { snprintf(latest, sizeof latest, "%.*s", (int)n, txt); free(txt); }
        DSK_TEST_EXPECT(strcmp(latest, "step_00000007\n") == 0, "DIR/latest holds \"%s\"", latest);
        snprintf(path, sizeof path, "%s/step_00000007/manifest.json", dir);
        DSK_TEST_EXPECT(file_size(path) > 0, "no manifest");
        snprintf(path, sizeof path, "%s/step_00000007", dir);
        DSK_TEST_EXPECT(count_tmp_files(path) == 0, "temporary files left behind");
    }
    alloc_t(&a2, DSK_F32, 3, s1);
    alloc_t(&b2, DSK_BF16, 1, s2);
    alloc_t(&c2, DSK_F64, 0, NULL);
    {
        dsk_ckpt_entry e[3] = {{"scalar", &c2, 0, 0, 0, NULL, NULL},
                               {"layer.0.w", &a2, 0, 0, 0, NULL, NULL},
                               {"emb", &b2, 0, 0, 0, NULL, NULL}};
        DSK_TEST_OK(dsk_ckpt_load(&ck, -1, e, 3, &meta));
    }
    DSK_TEST_SAME_BYTES(a2.data, a.data, dsk_tensor_nbytes(&a), "layer.0.w");
    DSK_TEST_SAME_BYTES(b2.data, b.data, dsk_tensor_nbytes(&b), "emb");
    DSK_TEST_SAME_BYTES(c2.data, c.data, 8, "scalar");
    DSK_TEST_EXPECT(meta.step == 7 && meta.world_size == 1 && meta.rank == 0, "meta step %lld world %d",
                    (long long)meta.step, meta.world_size);
    DSK_TEST_OK(dsk_ckpt_meta_f64(&meta, "loss_scale", &loss_back));
    DSK_TEST_EXPECT(loss_back == loss, "loss scale %a back as %a", loss, loss_back);
    DSK_TEST_OK(dsk_ckpt_meta_i64(&meta, "data_pos", &pos));
    DSK_TEST_EXPECT(pos == 123456789012ll, "data_pos %lld", (long long)pos);
    DSK_TEST_EXPECT(dsk_ckpt_meta_get(&meta, "rng") && !strcmp(dsk_ckpt_meta_get(&meta, "rng"), "seed=7;offset=99"),
                    "rng");
    DSK_TEST_EXPECT(dsk_ckpt_meta_get(&meta, "dsk.step") && !strcmp(dsk_ckpt_meta_get(&meta, "dsk.step"), "7"),
                    "dsk.step");
    DSK_TEST_STATUS(dsk_ckpt_meta_i64(&meta, "rng", &pos), DSK_ERR_CORRUPT);
    DSK_TEST_ERROR_MENTIONS("is not an int64");
    DSK_TEST_STATUS(dsk_ckpt_meta_i64(&meta, "nope", &pos), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("no key \"nope\"");
    dsk_ckpt_meta_free(&meta);
    dsk_ckpt_meta_free(&meta);
    dsk_ckpt_free(&ck);
    dsk_ckpt_free(&ck);
    dsk_tensor_free(NULL, &a); dsk_tensor_free(NULL, &b); dsk_tensor_free(NULL, &c);
    dsk_tensor_free(NULL, &a2); dsk_tensor_free(NULL, &b2); dsk_tensor_free(NULL, &c2);
}

/* ------------------------------------------------------------ multi-rank save and load */

/* The global model every rank slices: split tensors, a replicated one, a scalar, an empty. */
typedef struct model {
    dsk_tensor w1;    /* (R1, 5, 3) f32, split */
    dsk_tensor w2;    /* (9, 4) bf16, split */
    dsk_tensor emb;   /* (11, 6) f32, replicated */
    dsk_tensor sc;    /* () f64, replicated */
    dsk_tensor empty; /* (0, 3) f32, split */
} model;

static void model_init(model *m, int64_t r1) {
    const int64_t s1[3] = {r1, 5, 3}, s2[2] = {9, 4}, s3[2] = {11, 6}, s5[2] = {0, 3};
    alloc_t(&m->w1, DSK_F32, 3, s1); fill_f32(&m->w1);
    alloc_t(&m->w2, DSK_BF16, 2, s2); fill_random_bytes(&m->w2);
    alloc_t(&m->emb, DSK_F32, 2, s3); fill_f32(&m->emb);
    alloc_t(&m->sc, DSK_F64, 0, NULL); ((double *)m->sc.data)[0] = dsk_test_rand(-5, 5);
    alloc_t(&m->empty, DSK_F32, 2, s5);
}
static void model_free(model *m) {
    dsk_tensor_free(NULL, &m->w1); dsk_tensor_free(NULL, &m->w2); dsk_tensor_free(NULL, &m->emb);
    dsk_tensor_free(NULL, &m->sc); dsk_tensor_free(NULL, &m->empty);
}

static int64_t split_start(int64_t rows, int r, int w) { return rows * r / w; }

/* Entries for rank r of w: views of the global tensors for saving (own rows), or freshly
   allocated poisoned tensors for loading (own[]). */
static void rank_entries(model *g, int r, int w, int for_load, dsk_ckpt_entry e[5], dsk_tensor own[5]) {
    dsk_tensor *glob[5] = {&g->w1, &g->w2, &g->emb, &g->sc, &g->empty};
    static const char *names[5] = {"moe.w1", "moe.w2", "embed", "scale", "empty"};
    static const int split[5] = {1, 1, 0, 0, 1};
    for (int i = 0; i < 5; i++) {
        dsk_tensor v = *glob[i];
        int64_t rows = glob[i]->ndim ? glob[i]->shape[0] : 0;
        int64_t a = split[i] ? split_start(rows, r, w) : 0, b = split[i] ? split_start(rows, r + 1, w) : rows;
        if (split[i]) dsk_tensor_slice(glob[i], 0, a, b - a, &v);
        if (for_load) alloc_t(&own[i], v.dtype, v.ndim, v.shape);
        else own[i] = v;
        e[i].name = names[i];
        e[i].tensor = &own[i];
        e[i].split = split[i];
        e[i].row0 = a;
        e[i].global_rows = rows;
    }
}

/* 0 when every loaded entry equals its rows of the global model. */
static int compare_entries(const dsk_ckpt_entry e[5], model *g, const char *who) {
    dsk_tensor *glob[5] = {&g->w1, &g->w2, &g->emb, &g->sc, &g->empty};
    int bad = 0;
    for (int i = 0; i < 5; i++) {
        size_t row_bytes =
            glob[i]->ndim ? dsk_tensor_nbytes(glob[i]) / (size_t)(glob[i]->shape[0] ? glob[i]->shape[0] : 1) : 0;
        const unsigned char *want =
            (const unsigned char *)glob[i]->data + (e[i].split ? (size_t)e[i].row0 * row_bytes : 0);
        if (memcmp(e[i].tensor->data, want, dsk_tensor_nbytes(e[i].tensor)) != 0) {
            printf("     %s: tensor %s differs\n", who, e[i].name);
            bad = 1;
        }
    }
    return bad;
}

typedef struct mr_arg {
    model *g;
    char dir[400], bar[400];
    int64_t step;
    int save_world; /* for load checks of metadata */
} mr_arg;

/* A fresh model with r1 rows and a multi-rank job saving `step` from save_world ranks into a
   new directory `tag`, with a new barrier directory. */
static void mr_setup(mr_arg *m, model *g, int64_t r1, int64_t step, int save_world, const char *tag) {
    model_init(g, r1);
    memset(m, 0, sizeof *m);
    m->g = g;
    m->step = step;
    m->save_world = save_world;
    new_dir(m->dir, sizeof m->dir, tag);
    new_dir(m->bar, sizeof m->bar, "bar");
}

static int mr_save(int rank, int world, void *p) {
    mr_arg *m = (mr_arg *)p;
    fbar b;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    dsk_ckpt_entry e[5];
    dsk_tensor own[5];
    char pos[32];
    dsk_ckpt_kv kv[1] = {{"data_pos", pos}};
    dsk_status s;
    fbar_opts(&o, &b, m->bar, rank, world);
    snprintf(pos, sizeof pos, "%d", 1000 + rank);
    rank_entries(m->g, rank, world, 0, e, own);
    if ((s = dsk_ckpt_init(&ck, m->dir, &o)) == DSK_OK) s = dsk_ckpt_save(&ck, m->step, e, 5, kv, 1);
    if (s != DSK_OK) printf("     rank %d/%d save: %s\n", rank, world, dsk_last_error());
    dsk_ckpt_free(&ck);
    return s != DSK_OK;
}

static int mr_load(int rank, int world, void *p) {
    mr_arg *m = (mr_arg *)p;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    dsk_ckpt_entry e[5];
    dsk_tensor own[5];
    dsk_ckpt_meta meta;
    int64_t pos = -1;
    int bad;
    memset(&o, 0, sizeof o);
    o.rank = rank; o.world_size = world; o.barrier = fbar_wait; /* loads never call it */
    rank_entries(m->g, rank, world, 1, e, own);
    if (dsk_ckpt_init(&ck, m->dir, &o) != DSK_OK || dsk_ckpt_load(&ck, m->step, e, 5, &meta) != DSK_OK) {
        printf("     rank %d/%d load: %s\n", rank, world, dsk_last_error());
        return 1;
    }
    bad = compare_entries(e, m->g, "load");
    dsk_ckpt_meta_i64(&meta, "data_pos", &pos);
    if (pos != 1000 + (rank < m->save_world ? rank : 0)) {
        printf("     rank %d: data_pos %lld\n", rank, (long long)pos);
        bad = 1;
    }
    dsk_ckpt_meta_free(&meta);
    dsk_ckpt_free(&ck);
    for (int i = 0; i < 5; i++) dsk_tensor_free(NULL, &own[i]);
    return bad;
}

/* Saves with save_world ranks, then loads with each of load_worlds (forked) and with one
   rank in this process. */
static void multi_rank_case(int save_world, const int *load_worlds, int n_loads, int64_t r1) {
    model g;
    mr_arg m;
    int failed;
    mr_setup(&m, &g, r1, 100 + save_world, save_world, "mr");
    failed = run_ranks(save_world, mr_save, &m);
    DSK_TEST_EXPECT(failed == 0, "%d of %d saving ranks failed", failed, save_world);
    DSK_TEST_OK(dsk_ckpt_verify(m.dir, m.step));
    for (int i = 0; i < n_loads; i++) {
        failed = run_ranks(load_worlds[i], mr_load, &m);
        DSK_TEST_EXPECT(failed == 0, "saved by %d ranks, %d of %d loading ranks failed", save_world, failed,
                        load_worlds[i]);
    }
    DSK_TEST_EXPECT(mr_load(0, 1, &m) == 0, "one rank loading everything saved by %d ranks", save_world);
    model_free(&g);
}

static void test_multi_rank_1_2_3_4(void) {
    for (int w = 1; w <= 4; w++) {
        int lw[1] = {w};
        dsk_test_begin("multi-rank save/load, %d ranks", w);
        multi_rank_case(w, lw, 1, 13);
        dsk_test_end();
    }
}

/* Async saves on 2 ranks: the barriers run on the writer threads while the callers
   overwrite their tensors; the checkpoint holds the values of the call. */
static int mr_save_async(int rank, int world, void *p) {
    mr_arg *m = (mr_arg *)p;
    fbar b;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    dsk_ckpt_entry e[5];
    dsk_tensor own[5], copy[5];
    char pos[32];
    dsk_ckpt_kv kv[1] = {{"data_pos", pos}};
    dsk_status s;
    fbar_opts(&o, &b, m->bar, rank, world);
    snprintf(pos, sizeof pos, "%d", 1000 + rank);
    rank_entries(m->g, rank, world, 0, e, own);
    for (int i = 0; i < 5; i++) { /* save private copies, then scribble over them */
        alloc_t(&copy[i], own[i].dtype, own[i].ndim, own[i].shape);
        dsk_tensor_copy(NULL, &copy[i], &own[i]);
        e[i].tensor = &copy[i];
    }
    if ((s = dsk_ckpt_init(&ck, m->dir, &o)) == DSK_OK &&
        (s = dsk_ckpt_save_async(&ck, m->step, e, 5, kv, 1)) == DSK_OK) {
        for (int i = 0; i < 5; i++)
            dsk_test_poison_bytes(copy[i].data, dsk_tensor_nbytes(&copy[i]) ? dsk_tensor_nbytes(&copy[i]) : 1);
        snprintf(pos, sizeof pos, "garbage");
        s = dsk_ckpt_wait(&ck);
    }
    if (s != DSK_OK) printf("     rank %d/%d async save: %s\n", rank, world, dsk_last_error());
    dsk_ckpt_free(&ck);
    for (int i = 0; i < 5; i++) dsk_tensor_free(NULL, &copy[i]);
    return s != DSK_OK;
}

static void test_multi_rank_async(void) {
    model g;
    mr_arg m;
    mr_setup(&m, &g, 10, 77, 2, "mrasync");
    DSK_TEST_EXPECT(run_ranks(2, mr_save_async, &m) == 0, "async saving ranks failed");
    DSK_TEST_OK(dsk_ckpt_verify(m.dir, m.step));
    DSK_TEST_EXPECT(run_ranks(2, mr_load, &m) == 0, "loading ranks found other values");
    model_free(&g);
}

static void test_reshard(void) {
    const int to2[2] = {2, 3}, to4[2] = {4, 3};
    dsk_test_begin("reshard 4 -> 2, 3 and 1");
    multi_rank_case(4, to2, 2, 13);
    dsk_test_begin("reshard 2 -> 4, 3 and 1");
    multi_rank_case(2, to4, 2, 7);
    dsk_test_begin("reshard 4 -> 2 with fewer rows (3) than ranks");
    multi_rank_case(4, to2, 1, 3);
    dsk_test_end();
}

/* A rank whose rows do not tile the tensor with the others: no manifest, every rank fails. */
static int bad_tiling_save(int rank, int world, void *p) {
    mr_arg *m = (mr_arg *)p;
    fbar b;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    const int64_t shape[1] = {4};
    dsk_tensor t;
    dsk_ckpt_entry e = {"w", &t, 1, rank == 1 ? 3 : 0, 8, NULL, NULL}; /* rank 1 claims rows [3,7), rank 0 [0,4) */
    dsk_status s;
    fbar_opts(&o, &b, m->bar, rank, world);
    alloc_t(&t, DSK_F32, 1, shape);
    fill_f32(&t);
    s = dsk_ckpt_init(&ck, m->dir, &o);
    if (s == DSK_OK) s = dsk_ckpt_save(&ck, 5, &e, 1, NULL, 0);
    dsk_ckpt_free(&ck);
    dsk_tensor_free(NULL, &t);
    if (s == DSK_OK) { printf("     rank %d: save of overlapping rows succeeded\n", rank); return 1; }
    /* barrier mode: both ranks end alike, rank 1 with rank 0's outcome */
    if (s != DSK_ERR_ARG || !strstr(dsk_last_error(), "rank 0's piece [0:4] and rank 1's piece [3:7] overlap")) {
        printf("     rank %d: %s: %s\n", rank, dsk_status_str(s), dsk_last_error());
        return 1;
    }
    return 0;
}

/* Attempt 2 of a step whose attempt 1 died before its manifest: rank 1 now fails before
   writing (a bad entry) while its attempt-1 file is still there. The stale file must not be
   taken for rank 1's part: no checkpoint, rank 0 reports rank 1, and nobody waits forever. */
static int stale_retry_save(int rank, int world, void *p) {
    mr_arg *m = (mr_arg *)p;
    fbar b;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    dsk_ckpt_entry e[5];
    dsk_tensor own[5];
    dsk_status s;
    fbar_opts(&o, &b, m->bar, rank, world);
    rank_entries(m->g, rank, world, 0, e, own);
    if (rank == 1) e[0].global_rows = 1; /* rows [3, 6) of a 1-row tensor: invalid */
    s = dsk_ckpt_init(&ck, m->dir, &o);
    if (s == DSK_OK) s = dsk_ckpt_save(&ck, m->step, e, 5, NULL, 0);
    dsk_ckpt_free(&ck);
    if (rank == 0 && (s != DSK_ERR_PEER || !strstr(dsk_last_error(), "rank 1 did not write"))) {
        printf("     rank 0: %s: %s\n", dsk_status_str(s), dsk_last_error());
        return 1;
    }
    if (rank == 1 && (s != DSK_ERR_PEER || !strstr(dsk_last_error(), "rank 1 did not write") ||
                      !strstr(dsk_last_error(), "this rank: dsk_ckpt_save: tensor \"moe.w1\""))) {
        printf("     rank 1: %s: %s\n", dsk_status_str(s), dsk_last_error());
        return 1;
    }
    return 0;
}

static void test_failed_rank_with_stale_file(void) {
    model g;
    mr_arg m;
    char p[600];
    int64_t st = 0;
    model_init(&g, 6);
    memset(&m, 0, sizeof m);
    m.g = &g;
    m.step = 8;
    new_dir(m.dir, sizeof m.dir, "stale");
    new_dir(m.bar, sizeof m.bar, "bar");
    DSK_TEST_EXPECT(run_ranks(2, mr_save, &m) == 0, "attempt 1 failed");
    snprintf(p, sizeof p, "%s/step_00000008/manifest.json", m.dir);
    unlink(p); /* attempt 1 died before its manifest */
    new_dir(m.bar, sizeof m.bar, "bar");
    DSK_TEST_EXPECT(run_ranks(2, stale_retry_save, &m) == 0, "attempt 2: ranks did not report the failure");
    DSK_TEST_OK(dsk_ckpt_latest(m.dir, &st));
    DSK_TEST_EXPECT(st == -1, "a save with a failed rank became checkpoint %lld", (long long)st);
    model_free(&g);
}

static void test_multi_rank_inconsistent(void) {
    mr_arg m;
    int64_t st = 0;
    memset(&m, 0, sizeof m);
    new_dir(m.dir, sizeof m.dir, "tiling");
    new_dir(m.bar, sizeof m.bar, "bar");
    DSK_TEST_EXPECT(run_ranks(2, bad_tiling_save, &m) == 0, "ranks did not all report the overlap");
    DSK_TEST_OK(dsk_ckpt_latest(m.dir, &st));
    DSK_TEST_EXPECT(st == -1, "an inconsistent save became checkpoint %lld", (long long)st);
}

/* ------------------------------------------------------------ resharding along any dimension */

/* The global tensors of the box tests: A (13, 10) f32, B (4, 6, 7) bf16, and a layout gives
   each rank a box of each: cuts[t][d] lists the cut points of tensor t along dim d; a rank's
   box is the cell (its grid coordinates) of the grid they make. */
typedef struct box_layout {
    int grid[2][3];           /* cells per dim of A and B */
    int64_t cuts[2][3][5];    /* cut points per dim (grid + 1 values) */
} box_layout;

static const int64_t k_box_shape[2][3] = {{13, 10, 0}, {4, 6, 7}};
static const int k_box_ndim[2] = {2, 3};

typedef struct box_arg {
    dsk_tensor glob[2];
    char dir[400], bar[400];
    box_layout lay;
    int64_t step;
    int drop_rank;            /* this rank passes no A (leaves a gap), -1: none */
} box_arg;

/* Rank r's cell of tensor t: offset and extent. */
static void box_cell(const box_layout *l, int t, int r, int64_t *off, int64_t *ext) {
    int rem = r;
    for (int d = k_box_ndim[t] - 1; d >= 0; d--) {
        int c = rem % l->grid[t][d];
        rem /= l->grid[t][d];
        off[d] = l->cuts[t][d][c];
        ext[d] = l->cuts[t][d][c + 1] - off[d];
    }
}

static int box_cells(const box_layout *l, int t) {
    int n = 1;
    for (int d = 0; d < k_box_ndim[t]; d++) n *= l->grid[t][d];
    return n;
}

/* Saves (for_load 0) or loads and checks (1) rank r's boxes under layout a->lay. */
static int box_rank(int rank, int world, void *p, int for_load) {
    box_arg *a = (box_arg *)p;
    fbar b;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    dsk_ckpt_entry e[2];
    dsk_tensor own[2];
    int64_t off[2][3], ext[2][3];
    int n = 0, bad = 0;
    dsk_status s;
    fbar_opts(&o, &b, a->bar, rank, world);
    memset(e, 0, sizeof e);
    for (int t = 0; t < 2; t++) {
        size_t es = dsk_dtype_size(a->glob[t].dtype);
        if (rank >= box_cells(&a->lay, t) || (t == 0 && rank == a->drop_rank)) continue;
        box_cell(&a->lay, t, rank, off[t], ext[t]);
        alloc_t(&own[n], a->glob[t].dtype, k_box_ndim[t], ext[t]);
        if (!for_load)
            box_ref((const unsigned char *)a->glob[t].data, k_box_shape[t], k_box_ndim[t], es, off[t], ext[t],
                    (unsigned char *)own[n].data);
        e[n].name = t ? "B" : "A";
        e[n].tensor = &own[n];
        e[n].split = DSK_CKPT_BOX;
        e[n].offset = off[t];
        e[n].global_shape = k_box_shape[t];
        n++;
    }
    if ((s = dsk_ckpt_init(&ck, a->dir, &o)) == DSK_OK)
        s = for_load ? dsk_ckpt_load(&ck, a->step, e, n, NULL) : dsk_ckpt_save(&ck, a->step, e, n, NULL, 0);
    if (s != DSK_OK) {
        printf("     rank %d/%d %s: %s\n", rank, world, for_load ? "load" : "save", dsk_last_error());
        bad = 1;
    }
    for (int i = 0; i < n && for_load && !bad; i++) {
        int t = e[i].name[0] == 'B';
        size_t nb = dsk_tensor_nbytes(&own[i]);
        unsigned char *want = (unsigned char *)malloc(nb + 1);
        box_ref((const unsigned char *)a->glob[t].data, k_box_shape[t], k_box_ndim[t], dsk_dtype_size(own[i].dtype),
                off[t], ext[t], want);
        if (memcmp(want, own[i].data, nb)) {
            printf("     rank %d/%d: box of %s differs\n", rank, world, e[i].name);
            bad = 1;
        }
        free(want);
    }
    dsk_ckpt_free(&ck);
    for (int i = 0; i < n; i++) dsk_tensor_free(NULL, &own[i]);
    return bad;
}
static int box_save(int rank, int world, void *p) { return box_rank(rank, world, p, 0); }
static int box_load(int rank, int world, void *p) { return box_rank(rank, world, p, 1); }

/* Column-parallel and 2-D pieces saved by 4 ranks (A a 2x2 grid with uneven cuts, B split
   along its last dim) load bitwise into any other layout: A by columns on 3 ranks, B along
   dim 1; a 2-D grid the other way round on 2x3 ranks; everything on 1 rank. A gap is an error. */
static void test_reshard_any_dim(void) {
    box_arg a;
    const box_layout save4 = {{{2, 2, 0}, {1, 1, 4}}, {{{0, 6, 13}, {0, 4, 10}}, {{0, 4}, {0, 6}, {0, 2, 4, 6, 7}}}};
    const box_layout cols3 = {{{1, 3, 0}, {1, 3, 1}}, {{{0, 13}, {0, 3, 7, 10}}, {{0, 4}, {0, 2, 4, 6}, {0, 7}}}};
    const box_layout grid6 = {{{3, 2, 0}, {2, 1, 3}}, {{{0, 1, 7, 13}, {0, 5, 10}}, {{0, 1, 4}, {0, 6}, {0, 3, 5, 7}}}};
    const box_layout whole = {{{1, 1, 0}, {1, 1, 1}}, {{{0, 13}, {0, 10}}, {{0, 4}, {0, 6}, {0, 7}}}};
    memset(&a, 0, sizeof a);
    alloc_t(&a.glob[0], DSK_F32, 2, k_box_shape[0]);
    fill_random_bytes(&a.glob[0]);
    alloc_t(&a.glob[1], DSK_BF16, 3, k_box_shape[1]);
    fill_random_bytes(&a.glob[1]);
    new_dir(a.dir, sizeof a.dir, "boxes");
    new_dir(a.bar, sizeof a.bar, "bar");
    a.step = 3;
    a.drop_rank = -1;
    a.lay = save4;
    DSK_TEST_EXPECT(run_ranks(4, box_save, &a) == 0, "4 ranks saving boxes failed");
    DSK_TEST_OK(dsk_ckpt_verify(a.dir, 3));
    a.lay = cols3;
    DSK_TEST_EXPECT(run_ranks(3, box_load, &a) == 0, "loading by columns on 3 ranks");
    a.lay = grid6;
    DSK_TEST_EXPECT(run_ranks(6, box_load, &a) == 0, "loading a 3x2 / 2x3 grid on 6 ranks");
    a.lay = whole;
    DSK_TEST_EXPECT(box_load(0, 1, &a) == 0, "loading everything on 1 rank");
    /* rows saved (2 ranks, by rows), columns loaded */
    {
        const box_layout rows2 = {{{2, 1, 0}, {2, 1, 1}}, {{{0, 7, 13}, {0, 10}}, {{0, 2, 4}, {0, 6}, {0, 7}}}};
        a.step = 4;
        a.lay = rows2;
        new_dir(a.bar, sizeof a.bar, "bar");
        DSK_TEST_EXPECT(run_ranks(2, box_save, &a) == 0, "2 ranks saving rows failed");
        a.lay = cols3;
        DSK_TEST_EXPECT(run_ranks(3, box_load, &a) == 0, "rows saved, columns loaded");
    }
    /* rank 3 leaves its cell of A out: no checkpoint, and every rank says why */
    a.step = 5;
    a.lay = save4;
    a.drop_rank = 3;
    new_dir(a.bar, sizeof a.bar, "bar");
    DSK_TEST_EXPECT(run_ranks(4, box_save, &a) == 4, "a save with a gap in A did not fail on every rank");
    DSK_TEST_STATUS(dsk_ckpt_verify(a.dir, 5), DSK_ERR_CORRUPT);
    DSK_TEST_ERROR_MENTIONS("is missing: the checkpoint is incomplete");
    dsk_tensor_free(NULL, &a.glob[0]);
    dsk_tensor_free(NULL, &a.glob[1]);
}

/* ------------------------------------------------------------ several boxes of one name per rank */

/* P (2-D, f32) and Q (3-D, bf16) as 2 ranks save them, several boxes of each per rank, as
   dsk_zero saves a flat range of a tensor (a head of a row, whole rows, a tail): rank 0 holds 3
   boxes of P and 5 of Q, rank 1 the rest (1 of P, 4 of Q). Each: rank, tensor, offset, extent. */
static const int64_t k_mb_shape[2][3] = {{7, 9, 0}, {4, 5, 6}};
static const int k_mb_ndim[2] = {2, 3};
typedef struct mb_box {
    int rank, t;
    int64_t off[3], ext[3];
} mb_box;
static const mb_box k_mb_boxes[] = {
    {0, 0, {0, 0}, {2, 9}},       {0, 0, {2, 0}, {3, 4}},       {0, 0, {5, 0}, {2, 4}},
    {1, 0, {2, 4}, {5, 5}},       {0, 1, {0, 2, 1}, {1, 1, 5}}, {0, 1, {0, 3, 0}, {1, 2, 6}},
    {0, 1, {1, 0, 0}, {2, 5, 6}}, {0, 1, {3, 0, 0}, {1, 1, 6}}, {0, 1, {3, 1, 0}, {1, 1, 1}},
    {1, 1, {0, 0, 0}, {1, 2, 6}}, {1, 1, {0, 2, 0}, {1, 1, 1}}, {1, 1, {3, 1, 1}, {1, 1, 5}},
    {1, 1, {3, 2, 0}, {1, 3, 6}}};
#define N_MB ((int)(sizeof k_mb_boxes / sizeof k_mb_boxes[0]))

typedef struct mb_arg {
    dsk_tensor glob[2];
    char dir[400], bar[400];
    int64_t step;
    int64_t want_written[2]; /* bytes each rank's incremental save writes; -1: not checked */
    const char *tamper[2];   /* rank 0 replaces [0] by [1] in its file once the files are durable */
    const char *want_error;  /* the save must fail with this, not succeed */
} mb_arg;

/* The barrier of mb_save: fbar's, and rank 0 alters its own file before the manifest reads it. */
typedef struct mb_bar {
    fbar b; /* first: fbar_wait takes the same pointer */
    const mb_arg *a;
} mb_bar;

static dsk_status mb_wait(void *user) {
    mb_bar *m = (mb_bar *)user;
    dsk_status s = fbar_wait(&m->b);
    if (s == DSK_OK && m->b.rank == 0 && m->b.count == 2 && m->a->tamper[0]) {
        char sd[600], path[700];
        snprintf(sd, sizeof sd, "%s/step_%08lld", m->a->dir, (long long)m->a->step);
        rank_file(sd, 0, path, sizeof path);
        size_t n = 0, k = strlen(m->a->tamper[0]), i = 0;
        unsigned char *f = read_file(path, &n); /* binary: edit_file's strstr stops at the length's zeros */
        while (f && i + k <= n && memcmp(f + i, m->a->tamper[0], k) != 0) i++;
        if (f && i + k <= n) {
            memcpy(f + i, m->a->tamper[1], k); /* same length */
            write_file(path, f, n);
        } else printf("     \"%s\" not in %s\n", m->a->tamper[0], path);
        free(f);
    }
    return s;
}

/* Rank r saves its boxes of a->glob (incrementally): P's whole rows as DSK_CKPT_ROWS, the rest
   as DSK_CKPT_BOX. */
static int mb_save(int rank, int world, void *p) {
    mb_arg *a = (mb_arg *)p;
    mb_bar b;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    dsk_ckpt_entry e[N_MB];
    dsk_tensor own[N_MB];
    int n = 0, bad = 0;
    dsk_status s;
    fbar_opts(&o, &b.b, a->bar, rank, world);
    b.a = a;
    o.barrier = mb_wait;
    o.incremental = 1;
    memset(e, 0, sizeof e);
    for (int i = 0; i < N_MB; i++) {
        const mb_box *x = &k_mb_boxes[i];
        int t = x->t;
        if (x->rank != rank) continue;
        alloc_t(&own[n], a->glob[t].dtype, k_mb_ndim[t], x->ext);
        box_ref((const unsigned char *)a->glob[t].data, k_mb_shape[t], k_mb_ndim[t], dsk_dtype_size(own[n].dtype),
                x->off, x->ext, (unsigned char *)own[n].data);
        e[n].name = t ? "Q" : "P";
        e[n].tensor = &own[n];
        e[n].split = t == 0 && x->ext[1] == k_mb_shape[0][1] ? DSK_CKPT_ROWS : DSK_CKPT_BOX;
        e[n].row0 = x->off[0];
        e[n].global_rows = k_mb_shape[t][0];
        e[n].offset = x->off;
        e[n].global_shape = k_mb_shape[t];
        n++;
    }
    if ((s = dsk_ckpt_init(&ck, a->dir, &o)) == DSK_OK) s = dsk_ckpt_save(&ck, a->step, e, n, NULL, 0);
    if (a->want_error) {
        bad = s == DSK_OK || !strstr(dsk_last_error(), a->want_error);
        if (bad)
            printf("     rank %d: \"%s\", want an error with \"%s\"\n", rank, s ? dsk_last_error() : "ok",
                   a->want_error);
    } else if (s != DSK_OK) {
        printf("     rank %d: %s\n", rank, dsk_last_error());
        bad = 1;
    } else if (a->want_written[rank] >= 0 &&
               dsk_ckpt_last_save(&ck)->bytes_written != (uint64_t)a->want_written[rank]) {
        printf("     rank %d: wrote %llu bytes, want %lld\n", rank,
               (unsigned long long)dsk_ckpt_last_save(&ck)->bytes_written, (long long)a->want_written[rank]);
        bad = 1;
    }
    dsk_ckpt_free(&ck);
    for (int i = 0; i < n; i++) dsk_tensor_free(NULL, &own[i]);
    return bad;
}

/* 0 when checkpoint `step` loads bit for bit as a->glob at another split: P and Q whole (one
   rank), and a box of each cut across the saved boxes. */
static int mb_load(const mb_arg *a, int64_t step) {
    static const int64_t cut_off[2][3] = {{1, 3}, {1, 1, 2}}, cut_ext[2][3] = {{5, 5}, {3, 3, 3}};
    dsk_tensor whole[2], cut[2];
    dsk_ckpt_entry e[4];
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    int bad = 0;
    memset(e, 0, sizeof e);
    memset(&o, 0, sizeof o);
    for (int t = 0; t < 2; t++) {
        alloc_t(&whole[t], a->glob[t].dtype, k_mb_ndim[t], k_mb_shape[t]);
        alloc_t(&cut[t], a->glob[t].dtype, k_mb_ndim[t], cut_ext[t]);
        e[t].name = e[2 + t].name = t ? "Q" : "P";
        e[t].tensor = &whole[t];
        e[2 + t].tensor = &cut[t];
        e[2 + t].split = DSK_CKPT_BOX;
        e[2 + t].offset = cut_off[t];
        e[2 + t].global_shape = k_mb_shape[t];
    }
    if (dsk_ckpt_init(&ck, a->dir, &o) != DSK_OK || dsk_ckpt_load(&ck, step, e, 4, NULL) != DSK_OK) {
        printf("     step %lld: %s\n", (long long)step, dsk_last_error());
        bad = 1;
    }
    for (int t = 0; t < 2 && !bad; t++) {
        size_t nb = dsk_tensor_nbytes(&cut[t]);
        unsigned char *want = (unsigned char *)malloc(nb);
        box_ref((const unsigned char *)a->glob[t].data, k_mb_shape[t], k_mb_ndim[t], dsk_dtype_size(cut[t].dtype),
                cut_off[t], cut_ext[t], want);
        if (memcmp(whole[t].data, a->glob[t].data, dsk_tensor_nbytes(&whole[t])) || memcmp(cut[t].data, want, nb)) {
            printf("     step %lld: %s differs\n", (long long)step, e[t].name);
            bad = 1;
        }
        free(want);
    }
    dsk_ckpt_free(&ck);
    for (int t = 0; t < 2; t++) {
        dsk_tensor_free(NULL, &whole[t]);
        dsk_tensor_free(NULL, &cut[t]);
    }
    return bad;
}

/* Several boxes of one name from one rank (dsk_zero's pieces of a flat range): the rank file
   keeps each under "<name>@<offset>" with dsk.name; the checkpoint loads bit for bit at another
   split, verifies, reuses the unchanged boxes in an incremental save and merges. A rank file
   whose key does not fit its box (written or reused) fails the save. */
static void test_several_boxes_per_rank(void) {
    const int64_t q_row = k_mb_shape[1][1] * k_mb_shape[1][2];
    char sd[600], path[700];
    dsk_safetensors_file f;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    dsk_ckpt_info info[4];
    mb_arg a;
    dsk_status fs;
    int n = 0;
    memset(&a, 0, sizeof a);
    alloc_t(&a.glob[0], DSK_F32, 2, k_mb_shape[0]);
    alloc_t(&a.glob[1], DSK_BF16, 3, k_mb_shape[1]);
    fill_random_bytes(&a.glob[0]);
    fill_random_bytes(&a.glob[1]);
    new_dir(a.dir, sizeof a.dir, "mbox");
    new_dir(a.bar, sizeof a.bar, "bar");
    a.step = 1;
    a.want_written[0] = a.want_written[1] = -1;
    DSK_TEST_EXPECT(run_ranks(2, mb_save, &a) == 0, "2 ranks saving 3 + 5 and 1 + 4 boxes of P and Q");
    DSK_TEST_OK(dsk_ckpt_verify(a.dir, 1));
    DSK_TEST_EXPECT(mb_load(&a, 1) == 0, "step 1 does not load as saved");
    snprintf(sd, sizeof sd, "%s/step_00000001", a.dir);
    rank_file(sd, 0, path, sizeof path);
    fs = dsk_safetensors_open(&f, path);
    DSK_TEST_EXPECT(fs == DSK_OK, "rank 0's file: %s", dsk_last_error());
    if (fs == DSK_OK) {
        const char *v = dsk_safetensors_meta(&f, "dsk.name.Q@1,0,0");
        DSK_TEST_EXPECT(f.n_tensors == 8 && dsk_safetensors_find(&f, "Q@1,0,0") >= 0 &&
                            dsk_safetensors_find(&f, "Q") < 0 && v && strcmp(v, "Q") == 0 &&
                            dsk_safetensors_meta(&f, "dsk.box.P@5,0"),
                        "rank 0's file: %d tensors, Q@1,0,0 %d, dsk.name.Q@1,0,0 \"%s\"", f.n_tensors,
                        dsk_safetensors_find(&f, "Q@1,0,0"), v ? v : "(none)");
        dsk_safetensors_close(&f);
    }
    /* incremental: only rows 1 and 2 of Q change, rank 0's box [1:3,0:5,0:6] */
    for (int64_t i = q_row; i < 3 * q_row; i++) ((uint16_t *)a.glob[1].data)[i] ^= 0x5a5a;
    a.step = 2;
    a.want_written[0] = 2 * q_row * 2;
    a.want_written[1] = 0;
    new_dir(a.bar, sizeof a.bar, "bar");
    DSK_TEST_EXPECT(run_ranks(2, mb_save, &a) == 0, "the incremental save of step 2");
    DSK_TEST_OK(dsk_ckpt_verify(a.dir, 2));
    DSK_TEST_EXPECT(mb_load(&a, 2) == 0, "step 2 does not load as saved");
    /* merged into its own directory: one file per rank again */
    memset(&o, 0, sizeof o);
    DSK_TEST_OK(dsk_ckpt_init(&ck, a.dir, &o));
    DSK_TEST_OK(dsk_ckpt_merge(&ck, 2));
    dsk_ckpt_free(&ck);
    DSK_TEST_OK(dsk_ckpt_list(a.dir, info, 4, &n));
    DSK_TEST_EXPECT(n == 2 && info[0].step == 2 && info[0].n_files == 2, "merged: %d checkpoints, step 2 with %d files",
                    n, info[0].n_files);
    DSK_TEST_OK(dsk_ckpt_verify(a.dir, 2));
    DSK_TEST_EXPECT(mb_load(&a, 2) == 0, "step 2 does not load as saved after merging");
    /* rank files whose keys do not fit their boxes: rank 0 writes no manifest */
    for (int64_t i = q_row; i < 2 * q_row; i++) ((uint16_t *)a.glob[1].data)[i] ^= 0x00ff;
    a.want_written[0] = a.want_written[1] = -1;
    a.step = 3; /* a box written */
    a.tamper[0] = "\"dsk.box.Q@1,0,0\":\"1,0,0;";
    a.tamper[1] = "\"dsk.box.Q@1,0,0\":\"0,0,0;";
    a.want_error = "dsk.name.Q@1,0,0 does not fit its key and box";
    new_dir(a.bar, sizeof a.bar, "bar");
    DSK_TEST_EXPECT(run_ranks(2, mb_save, &a) == 0, "a written box whose key does not fit");
    a.step = 4; /* a box reused */
    a.tamper[0] = "\"dsk.box.Q@0,3,0\":\"0,3,0;";
    a.tamper[1] = "\"dsk.box.Q@0,3,0\":\"1,0,0;";
    a.want_error = "dsk.name.Q@0,3,0 does not fit its key and box";
    new_dir(a.bar, sizeof a.bar, "bar");
    DSK_TEST_EXPECT(run_ranks(2, mb_save, &a) == 0, "a reused box whose key does not fit");
    DSK_TEST_OK(dsk_ckpt_list(a.dir, info, 4, &n));
    DSK_TEST_EXPECT(n == 2 && info[0].step == 2, "%d checkpoints, the newest step %lld", n, (long long)info[0].step);
    dsk_tensor_free(NULL, &a.glob[0]);
    dsk_tensor_free(NULL, &a.glob[1]);
}

/* Several boxes of one name from one rank must be disjoint boxes of one tensor; a whole
   tensor's name stays unique, and so does every key of the rank file. */
static void test_several_boxes_errors(void) {
    const int64_t sa[2] = {2, 9}, sb[2] = {2, 2}, g[2] = {7, 9}, g2[2] = {7, 10}, oa[2] = {0, 0}, ob[2] = {1, 3},
                  oc[2] = {2, 0};
    char dir[400];
    dsk_tensor x, y;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    dsk_ckpt_entry e[3];
    int64_t last = 0;
    new_dir(dir, sizeof dir, "mbox_bad");
    alloc_t(&x, DSK_F32, 2, sa);
    alloc_t(&y, DSK_F32, 2, sb);
    fill_f32(&x);
    fill_f32(&y);
    memset(&o, 0, sizeof o);
    memset(e, 0, sizeof e);
    e[0].name = e[1].name = "P";
    e[0].tensor = &x;
    e[1].tensor = &y;
    e[0].split = e[1].split = DSK_CKPT_BOX;
    e[0].offset = oa;
    e[1].offset = ob;
    e[0].global_shape = e[1].global_shape = g;
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, &o));
    DSK_TEST_STATUS(dsk_ckpt_save(&ck, 1, e, 2, NULL, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("tensor \"P\": this rank's boxes [0:2,0:9] and [1:3,3:5] overlap");
    e[1].offset = oc;
    e[1].global_shape = g2;
    DSK_TEST_STATUS(dsk_ckpt_save(&ck, 1, e, 2, NULL, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("tensor \"P\": this rank's boxes are of [7,9] F32 and of [7,10] F32");
    e[1].global_shape = g;
    e[1].split = DSK_CKPT_WHOLE;
    DSK_TEST_STATUS(dsk_ckpt_save(&ck, 1, e, 2, NULL, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("tensor name \"P\" appears twice");
    e[1].split = DSK_CKPT_BOX;
    e[2].name = "P@2,0";
    e[2].tensor = &y;
    DSK_TEST_STATUS(dsk_ckpt_save(&ck, 1, e, 3, NULL, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("two tensors would be stored under the key \"P@2,0\"");
    DSK_TEST_OK(dsk_ckpt_latest(dir, &last));
    DSK_TEST_EXPECT(last == -1, "a failed save left step %lld", (long long)last);
    dsk_ckpt_free(&ck);
    dsk_tensor_free(NULL, &x);
    dsk_tensor_free(NULL, &y);
}

/* ------------------------------------------------------------ collective outcome */

/* Collective outcome with opts.agree (issue 17): a save where rank 2 of 3 fails (a bad entry)
   gives every rank rank 2's status and message; a load where rank 1's file is missing fails
   on every rank with that file's name, though rank 0 alone would have succeeded (without
   agree it does: a load is each rank's own). */
static int agree_save_rank2_fails(int rank, int world, void *p) {
    mr_arg *m = (mr_arg *)p;
    fbar b;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    dsk_ckpt_entry e[5];
    dsk_tensor own[5];
    dsk_status s;
    fagree_opts(&o, &b, m->bar, rank, world);
    rank_entries(m->g, rank, world, 0, e, own);
    if (rank == 2) e[1].global_rows = 2; /* rows [6, 9) of a 2-row tensor */
    if ((s = dsk_ckpt_init(&ck, m->dir, &o)) == DSK_OK) s = dsk_ckpt_save(&ck, m->step, e, 5, NULL, 0);
    dsk_ckpt_free(&ck);
    if (s != DSK_ERR_ARG || !strstr(dsk_last_error(), "rows [6, 9) do not fit a split tensor of 2 rows") ||
        (rank != 2 && !strstr(dsk_last_error(), "rank 2 of 3 failed"))) {
        printf("     rank %d: %s: %s\n", rank, dsk_status_str(s), dsk_last_error());
        return 1;
    }
    return 0;
}

static int agree_save(int rank, int world, void *p) {
    mr_arg *m = (mr_arg *)p;
    fbar b;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    dsk_ckpt_entry e[5];
    dsk_tensor own[5];
    char pos[32];
    dsk_ckpt_kv kv[1] = {{"data_pos", pos}};
    dsk_status s;
    fagree_opts(&o, &b, m->bar, rank, world);
    snprintf(pos, sizeof pos, "%d", 1000 + rank);
    rank_entries(m->g, rank, world, 0, e, own);
    if ((s = dsk_ckpt_init(&ck, m->dir, &o)) == DSK_OK) s = dsk_ckpt_save(&ck, m->step, e, 5, kv, 1);
    if (s != DSK_OK) printf("     rank %d/%d save: %s\n", rank, world, dsk_last_error());
    dsk_ckpt_free(&ck);
    return s != DSK_OK;
}

/* Each rank loads its own rows (m->step, or the newest when m->step < 0) with or without the
   agreement; the outcome must be m->want_status with m->want_text, or the data of m->g with
   want_n_skipped newer checkpoints passed over, the newest want_skipped_step. */
typedef struct agree_load_arg {
    mr_arg m;
    int use_agree;
    dsk_status want_status;
    const char *want_text;
    int64_t want_step, want_skipped_step;
    int want_n_skipped;
} agree_load_arg;

static int agree_load(int rank, int world, void *p) {
    agree_load_arg *a = (agree_load_arg *)p;
    fbar b;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    dsk_ckpt_entry e[5];
    dsk_tensor own[5];
    dsk_ckpt_meta meta;
    dsk_status s;
    int bad = 0;
    if (a->use_agree) fagree_opts(&o, &b, a->m.bar, rank, world);
    else fbar_opts(&o, &b, a->m.bar, rank, world);
    rank_entries(a->m.g, rank, world, 1, e, own);
    if ((s = dsk_ckpt_init(&ck, a->m.dir, &o)) == DSK_OK) s = dsk_ckpt_load(&ck, a->m.step, e, 5, &meta);
    if (s != a->want_status || (s != DSK_OK && a->want_text && !strstr(dsk_last_error(), a->want_text))) {
        printf("     rank %d: %s: %s\n", rank, dsk_status_str(s), dsk_last_error());
        bad = 1;
    } else if (s == DSK_OK) {
        bad = compare_entries(e, a->m.g, "agreed load");
        if (meta.step != a->want_step || meta.skipped_step != a->want_skipped_step ||
            meta.n_skipped != a->want_n_skipped) {
            printf("     rank %d: loaded step %lld skipping %d, newest %lld\n", rank, (long long)meta.step,
                   meta.n_skipped, (long long)meta.skipped_step);
            bad = 1;
        }
        dsk_ckpt_meta_free(&meta);
    }
    dsk_ckpt_free(&ck);
    for (int i = 0; i < 5; i++) dsk_tensor_free(NULL, &own[i]);
    return bad;
}

static void test_collective_outcome(void) {
    model g, g2;
    mr_arg m;
    agree_load_arg a;
    char sd[700], f1[800];
    int64_t st = 0;
    mr_setup(&m, &g, 9, 5, 3, "agree");
    dsk_test_begin("collective save: rank 2 of 3 fails, every rank reports it");
    DSK_TEST_EXPECT(run_ranks(3, agree_save_rank2_fails, &m) == 0, "ranks reported different outcomes");
    DSK_TEST_OK(dsk_ckpt_latest(m.dir, &st));
    DSK_TEST_EXPECT(st == -1, "a failed save became checkpoint %lld", (long long)st);
    dsk_test_begin("collective save and load with the agreement");
    new_dir(m.bar, sizeof m.bar, "bar");
    m.step = 1;
    DSK_TEST_EXPECT(run_ranks(2, agree_save, &m) == 0, "save step 1 failed");
    memset(&a, 0, sizeof a);
    a.m = m;
    a.use_agree = 1;
    a.want_status = DSK_OK;
    a.want_step = 1;
    a.want_skipped_step = -1;
    new_dir(a.m.bar, sizeof a.m.bar, "bar");
    DSK_TEST_EXPECT(run_ranks(2, agree_load, &a) == 0, "agreed load of step 1");
    /* step 2 with other values, then rank 1's file of step 2 loses a byte: the newest load
       falls back to step 1 on both ranks, though rank 0 reads only its own file */
    model_init(&g2, 9);
    m.g = &g2;
    m.step = 2;
    new_dir(m.bar, sizeof m.bar, "bar");
    DSK_TEST_EXPECT(run_ranks(2, agree_save, &m) == 0, "save step 2 failed");
    snprintf(sd, sizeof sd, "%s/step_00000002", m.dir);
    rank_file(sd, 1, f1, sizeof f1);
    {
        size_t n;
        unsigned char *bytes = read_file(f1, &n);
        bytes[n - 1] ^= 1;
        write_file(f1, bytes, n);
        free(bytes);
    }
    dsk_test_begin("collective load of the newest: every rank falls back past rank 1's damage");
    a.m.step = -1;
    new_dir(a.m.bar, sizeof a.m.bar, "bar");
    a.want_skipped_step = 2;
    a.want_n_skipped = 1;
    DSK_TEST_EXPECT(run_ranks(2, agree_load, &a) == 0, "ranks did not fall back together to step 1");
    /* step 3 saved, then its manifest edited: passed over too, and counted on every rank */
    dsk_test_begin("collective load of the newest: a damaged manifest is counted on every rank");
    m.step = 3;
    new_dir(m.bar, sizeof m.bar, "bar");
    DSK_TEST_EXPECT(run_ranks(2, agree_save, &m) == 0, "save step 3 failed");
    snprintf(sd, sizeof sd, "%s/step_00000003/manifest.json", m.dir);
    DSK_TEST_EXPECT(edit_file(sd, "\"step\":3", "\"step\":4"), "edit step 3's manifest");
    new_dir(a.m.bar, sizeof a.m.bar, "bar");
    a.want_skipped_step = 3;
    a.want_n_skipped = 2;
    DSK_TEST_EXPECT(run_ranks(2, agree_load, &a) == 0, "ranks did not count step 3's manifest");
    /* step 2 asked for by number, rank 1's file missing: both fail, naming it */
    unlink(f1);
    dsk_test_begin("collective load: rank 1's file missing fails every rank, named");
    a.m.step = 2;
    a.m.g = &g2;
    a.want_status = DSK_ERR_CORRUPT;
    a.want_text = "rank_00001.";
    new_dir(a.m.bar, sizeof a.m.bar, "bar");
    DSK_TEST_EXPECT(run_ranks(2, agree_load, &a) == 0, "ranks did not all fail naming rank 1's file");
    dsk_test_begin("without the agreement a load is each rank's own");
    a.use_agree = 0;
    DSK_TEST_EXPECT(run_ranks(2, agree_load, &a) == 1, "without agree only rank 1 should fail");
    dsk_test_end();
    model_free(&g);
    model_free(&g2);
}

/* ------------------------------------------------------------ async save */

static void test_async_overwrite(void) {
    char dir[400];
    const int64_t sa[2] = {1025, 1031}, sb[2] = {129, 7}; /* a: 4.2 MB, two pieces of the parallel copy */
    dsk_tensor a, b, keep_a, keep_b, la, lb;
    dsk_ckpt ck;
    dsk_ckpt_entry e[2] = {{"a", &a, 0, 0, 0, NULL, NULL}, {"b", &b, 0, 0, 0, NULL, NULL}};
    dsk_ckpt_entry le[2] = {{"a", &la, 0, 0, 0, NULL, NULL}, {"b", &lb, 0, 0, 0, NULL, NULL}};
    char val[16] = "first";
    dsk_ckpt_kv kv[1] = {{"tag", val}};
    dsk_ckpt_meta meta;
    new_dir(dir, sizeof dir, "async");
    alloc_t(&a, DSK_F32, 2, sa); fill_f32(&a);
    alloc_t(&b, DSK_BF16, 2, sb); fill_random_bytes(&b);
    alloc_t(&keep_a, DSK_F32, 2, sa); memcpy(keep_a.data, a.data, dsk_tensor_nbytes(&a));
    alloc_t(&keep_b, DSK_BF16, 2, sb); memcpy(keep_b.data, b.data, dsk_tensor_nbytes(&b));
    {
        dsk_ckpt_opts o;
        memset(&o, 0, sizeof o);
        o.snapshot_threads = 2;
        DSK_TEST_OK(dsk_ckpt_init(&ck, dir, &o));
    }
    DSK_TEST_OK(dsk_ckpt_save_async(&ck, 1, e, 2, kv, 1));
    /* training goes on: the tensors and the caller's strings change at once */
    dsk_test_poison_f32((float *)a.data, dsk_tensor_numel(&a));
    memset(b.data, 0x5a, dsk_tensor_nbytes(&b));
    snprintf(val, sizeof val, "changed");
    DSK_TEST_OK(dsk_ckpt_wait(&ck));
    DSK_TEST_OK(dsk_ckpt_wait(&ck)); /* nothing pending: OK */
    /* a second async save then a third right away (the third waits for the second) */
    DSK_TEST_OK(dsk_ckpt_save_async(&ck, 2, e, 2, kv, 1));
    fill_f32(&a);
    DSK_TEST_OK(dsk_ckpt_save_async(&ck, 3, e, 2, kv, 1));
    DSK_TEST_OK(dsk_ckpt_wait(&ck));
    alloc_t(&la, DSK_F32, 2, sa);
    alloc_t(&lb, DSK_BF16, 2, sb);
    DSK_TEST_OK(dsk_ckpt_load(&ck, 1, le, 2, &meta));
    DSK_TEST_SAME_BYTES(la.data, keep_a.data, dsk_tensor_nbytes(&a), "a as of the async call");
    DSK_TEST_SAME_BYTES(lb.data, keep_b.data, dsk_tensor_nbytes(&b), "b as of the async call");
    DSK_TEST_EXPECT(dsk_ckpt_meta_get(&meta, "tag") && !strcmp(dsk_ckpt_meta_get(&meta, "tag"), "first"),
                    "tag as of the call");
    dsk_ckpt_meta_free(&meta);
    DSK_TEST_OK(dsk_ckpt_load(&ck, 3, le, 2, NULL));
    DSK_TEST_SAME_BYTES(la.data, a.data, dsk_tensor_nbytes(&a), "a at step 3");
    DSK_TEST_OK(dsk_ckpt_verify(dir, 2));
    dsk_ckpt_free(&ck);
    dsk_tensor_free(NULL, &a); dsk_tensor_free(NULL, &b); dsk_tensor_free(NULL, &keep_a);
    dsk_tensor_free(NULL, &keep_b); dsk_tensor_free(NULL, &la); dsk_tensor_free(NULL, &lb);
}

/* Readers in the caller's thread while the writer thread saves: both check manifests (the
   tiling of their pieces), so nothing they share may be file-scope state. `make tsan` runs
   this; with the tiling sort's dim in a file-scope variable TSan reported the race. */
static void test_reads_during_async_save(void) {
    char dir[400];
    const int64_t s2[2] = {33, 17};
    dsk_tensor a, back;
    dsk_ckpt ck;
    dsk_ckpt_entry e = {"a", &a, 0, 0, 0, NULL, NULL}, le = {"a", &back, 0, 0, 0, NULL, NULL};
    new_dir(dir, sizeof dir, "readers");
    alloc_t(&a, DSK_F32, 2, s2);
    alloc_t(&back, DSK_F32, 2, s2);
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, NULL));
    fill_f32(&a);
    DSK_TEST_OK(dsk_ckpt_save(&ck, 1, &e, 1, NULL, 0));
    for (int64_t step = 2; step < 12; step++) {
        int64_t latest = -1;
        fill_f32(&a);
        DSK_TEST_OK(dsk_ckpt_save_async(&ck, step, &e, 1, NULL, 0));
        DSK_TEST_OK(dsk_ckpt_verify(dir, 1));
        DSK_TEST_OK(dsk_ckpt_latest(dir, &latest));
        DSK_TEST_EXPECT(latest == step - 1 || latest == step, "latest %lld during the save of %lld", (long long)latest,
                        (long long)step);
        DSK_TEST_OK(dsk_ckpt_wait(&ck));
        DSK_TEST_OK(dsk_ckpt_load(&ck, step, &le, 1, NULL));
        DSK_TEST_SAME_BYTES(back.data, a.data, dsk_tensor_nbytes(&a), "the step saved while readers ran");
    }
    dsk_ckpt_free(&ck);
    dsk_tensor_free(NULL, &a);
    dsk_tensor_free(NULL, &back);
}

/* A failing async save reports at dsk_ckpt_wait, or at the next save when nobody waited. */
static void test_async_error(void) {
    char dir[400], bad[500];
    const int64_t s1[1] = {7};
    dsk_tensor a;
    dsk_ckpt ck;
    dsk_ckpt_entry e = {"a", &a, 0, 0, 0, NULL, NULL};
    new_dir(dir, sizeof dir, "asyncerr");
    snprintf(bad, sizeof bad, "%s/regular_file/ckpt", dir);
    snprintf(dir + strlen(dir), sizeof dir - strlen(dir), "/regular_file");
    write_file(dir, "x", 1);
    alloc_t(&a, DSK_F32, 1, s1); fill_f32(&a);
    DSK_TEST_OK(dsk_ckpt_init(&ck, bad, NULL));
    DSK_TEST_OK(dsk_ckpt_save_async(&ck, 1, &e, 1, NULL, 0));
    DSK_TEST_STATUS(dsk_ckpt_wait(&ck), DSK_ERR_IO);
    DSK_TEST_ERROR_MENTIONS("create directory");
    DSK_TEST_OK(dsk_ckpt_save_async(&ck, 2, &e, 1, NULL, 0));
    DSK_TEST_STATUS(dsk_ckpt_save(&ck, 3, &e, 1, NULL, 0), DSK_ERR_IO);
    DSK_TEST_ERROR_MENTIONS("previous async save failed");
    dsk_ckpt_free(&ck);
    dsk_tensor_free(NULL, &a);
}

/* ------------------------------------------------------------ saving a step again */

/* Saving a step that exists must not touch it before the new one is durable (fault 1 of
   issue 17): a re-save that fails (here a file size limit, as a full disk) leaves the old
   checkpoint loadable even with keep_last 1; one that succeeds replaces it and leaves none of
   the old files behind. */
static int resave_too_big(void *p) {
    const char *dir = (const char *)p;
    const int64_t big[1] = {1 << 18};
    struct rlimit rl;
    dsk_tensor t;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    dsk_ckpt_entry e = {"a", &t, 0, 0, 0, NULL, NULL};
    dsk_status s;
    signal(SIGXFSZ, SIG_IGN);
    rl.rlim_cur = rl.rlim_max = 64 << 10;
    setrlimit(RLIMIT_FSIZE, &rl);
    memset(&o, 0, sizeof o);
    o.keep_last = 1;
    dsk_tensor_alloc(NULL, &t, DSK_F32, 1, big);
    fill_f32(&t);
    dsk_ckpt_init(&ck, dir, &o);
    s = dsk_ckpt_save(&ck, 5, &e, 1, NULL, 0);
    if (s != DSK_ERR_IO) printf("     the re-save of step 5 returned %s: %s\n", dsk_status_str(s), dsk_last_error());
    dsk_ckpt_free(&ck);
    return s != DSK_ERR_IO;
}

static void test_resave_keeps_old(void) {
    char dir[400], sd[600], f0[700], f1[700];
    const int64_t s1[2] = {9, 7};
    dsk_tensor a, b, back;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    dsk_ckpt_entry e = {"a", &a, 0, 0, 0, NULL, NULL}, le = {"a", &back, 0, 0, 0, NULL, NULL};
    int64_t st = -5;
    memset(&o, 0, sizeof o);
    o.keep_last = 1;
    new_dir(dir, sizeof dir, "resave");
    snprintf(sd, sizeof sd, "%s/step_00000005", dir);
    alloc_t(&a, DSK_F32, 2, s1);
    fill_f32(&a);
    alloc_t(&b, DSK_F32, 2, s1);
    alloc_t(&back, DSK_F32, 2, s1);
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, &o));
    DSK_TEST_OK(dsk_ckpt_save(&ck, 5, &e, 1, NULL, 0));
    rank_file(sd, 0, f0, sizeof f0);
    /* a failing re-save (a child limited to 64 KiB per file writes a 1 MiB tensor) */
    DSK_TEST_EXPECT(run_child_timeout(resave_too_big, dir, 30) == 0, "the re-save did not fail as arranged");
    DSK_TEST_OK(dsk_ckpt_latest(dir, &st));
    DSK_TEST_EXPECT(st == 5, "latest %lld after a failed re-save, want 5", (long long)st);
    DSK_TEST_OK(dsk_ckpt_load(&ck, 5, &le, 1, NULL));
    DSK_TEST_SAME_BYTES(back.data, a.data, dsk_tensor_nbytes(&a), "step 5 after a failed re-save");
    DSK_TEST_OK(dsk_ckpt_verify(dir, 5));
    /* a successful re-save with other values replaces it, and the old file goes */
    memcpy(b.data, a.data, dsk_tensor_nbytes(&a));
    fill_f32(&a);
    DSK_TEST_OK(dsk_ckpt_save(&ck, 5, &e, 1, NULL, 0));
    DSK_TEST_OK(dsk_ckpt_load(&ck, 5, &le, 1, NULL));
    DSK_TEST_SAME_BYTES(back.data, a.data, dsk_tensor_nbytes(&a), "step 5 re-saved");
    rank_file(sd, 0, f1, sizeof f1);
    DSK_TEST_EXPECT(strcmp(f0, f1) != 0 && access(f0, F_OK) != 0, "the first save's file %s is still there", f0);
    DSK_TEST_OK(dsk_ckpt_verify(dir, 5));
    dsk_ckpt_free(&ck);
    dsk_tensor_free(NULL, &a);
    dsk_tensor_free(NULL, &b);
    dsk_tensor_free(NULL, &back);
}

/* Two ranks save step 9, then save it again with rank 1 failing (a bad entry): every rank
   reports the failure and step 9 still loads as first saved. */
static int resave_rank1_fails(int rank, int world, void *p) {
    mr_arg *m = (mr_arg *)p;
    fbar b;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    dsk_ckpt_entry e[5];
    dsk_tensor own[5];
    char pos[32];
    dsk_ckpt_kv kv[1] = {{"data_pos", pos}};
    dsk_status s;
    fbar_opts(&o, &b, m->bar, rank, world);
    o.keep_last = 1;
    snprintf(pos, sizeof pos, "%d", 1000 + rank);
    rank_entries(m->g, rank, world, 0, e, own);
    s = dsk_ckpt_init(&ck, m->dir, &o);
    if (s == DSK_OK) s = dsk_ckpt_save(&ck, m->step, e, 5, kv, 1); /* the first save */
    if (s != DSK_OK) { printf("     rank %d: first save: %s\n", rank, dsk_last_error()); return 1; }
    if (rank == 1) e[0].global_rows = 1;
    snprintf(pos, sizeof pos, "%d", 2000 + rank);
    s = dsk_ckpt_save(&ck, m->step, e, 5, kv, 1);
    dsk_ckpt_free(&ck);
    if (s == DSK_OK) { printf("     rank %d: the failing re-save succeeded\n", rank); return 1; }
    return 0;
}

static void test_resave_multi_rank(void) {
    model g;
    mr_arg m;
    mr_setup(&m, &g, 6, 9, 2, "resave2");
    DSK_TEST_EXPECT(run_ranks(2, resave_rank1_fails, &m) == 0, "ranks did not all report the failed re-save");
    DSK_TEST_EXPECT(mr_load(0, 1, &m) == 0, "step 9 does not load as first saved after the failed re-save");
    DSK_TEST_OK(dsk_ckpt_verify(m.dir, 9));
    model_free(&g);
}

/* The commit point: once the manifest is durable the save has happened. A `latest` pointer
   that cannot be written (here a directory stands in its place) is housekeeping: the save
   returns DSK_OK and dsk_ckpt_last_save reports the failure (fault 5 of issue 17). */
static void test_latest_pointer_failure(void) {
    char dir[400], p[600];
    const int64_t s1[1] = {11};
    dsk_tensor a, back;
    dsk_ckpt ck;
    dsk_ckpt_entry e = {"a", &a, 0, 0, 0, NULL, NULL}, le = {"a", &back, 0, 0, 0, NULL, NULL};
    const dsk_ckpt_save_info *info;
    new_dir(dir, sizeof dir, "latestptr");
    snprintf(p, sizeof p, "%s/latest", dir);
    mkdir(p, 0755);
    snprintf(p, sizeof p, "%s/latest/x", dir);
    write_file(p, "x", 1);
    alloc_t(&a, DSK_F32, 1, s1);
    fill_f32(&a);
    alloc_t(&back, DSK_F32, 1, s1);
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, NULL));
    DSK_TEST_EXPECT(dsk_ckpt_last_save(&ck)->step == -1, "a save reported before any");
    DSK_TEST_OK(dsk_ckpt_save(&ck, 3, &e, 1, NULL, 0));
    info = dsk_ckpt_last_save(&ck);
    DSK_TEST_EXPECT(info->step == 3 && info->generation == 1 && info->bytes_written == 44 && info->tensors_written == 1,
                    "save info: step %lld generation %llu bytes %llu tensors %d", (long long)info->step,
                    (unsigned long long)info->generation, (unsigned long long)info->bytes_written,
                    info->tensors_written);
    DSK_TEST_EXPECT(info->cleanup == DSK_ERR_IO && strstr(info->cleanup_error, "latest"), "cleanup %s: %s",
                    dsk_status_str(info->cleanup), info->cleanup_error);
    DSK_TEST_OK(dsk_ckpt_load(&ck, -1, &le, 1, NULL));
    DSK_TEST_SAME_BYTES(back.data, a.data, 44, "step 3");
    /* an async save reports the same through dsk_ckpt_wait */
    DSK_TEST_OK(dsk_ckpt_save_async(&ck, 4, &e, 1, NULL, 0));
    DSK_TEST_OK(dsk_ckpt_wait(&ck));
    DSK_TEST_EXPECT(dsk_ckpt_last_save(&ck)->step == 4 && dsk_ckpt_last_save(&ck)->generation == 2 &&
                    dsk_ckpt_last_save(&ck)->cleanup == DSK_ERR_IO, "async save info");
    dsk_ckpt_free(&ck);
    dsk_tensor_free(NULL, &a);
    dsk_tensor_free(NULL, &back);
}

/* ------------------------------------------------------------ rotation and latest */

static int step_dir_exists(const char *dir, int64_t step, int want_manifest) {
    char p[600];
    snprintf(p, sizeof p, want_manifest ? "%s/step_%08lld/manifest.json" : "%s/step_%08lld", dir, (long long)step);
    return access(p, F_OK) == 0;
}

static void test_rotation(void) {
    char dir[400], junk[600];
    const int64_t s1[2] = {7, 3};
    dsk_tensor a;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    dsk_ckpt_entry e = {"a", &a, 0, 0, 0, NULL, NULL};
    int64_t st;
    memset(&o, 0, sizeof o);
    o.keep_last = 2;
    new_dir(dir, sizeof dir, "rot");
    alloc_t(&a, DSK_F32, 2, s1); fill_f32(&a);
    /* an incomplete older checkpoint (no manifest), reclaimed at init, and a complete newer one */
    snprintf(junk, sizeof junk, "%s/step_00000000", dir);
    mkdir(junk, 0755);
    snprintf(junk, sizeof junk, "%s/step_00000000/rank_00000.00000000000000ab.safetensors", dir);
    write_file(junk, "partial", 7);
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, &o));
    /* step 9 first, then 1..5: the two most recent saves are 4 and 5, whatever their numbers */
    DSK_TEST_OK(dsk_ckpt_save(&ck, 9, &e, 1, NULL, 0));
    DSK_TEST_OK(dsk_ckpt_save(&ck, 1, &e, 1, NULL, 0));
    DSK_TEST_EXPECT(step_dir_exists(dir, 9, 1), "step 9 (saved before 1) must stay with keep_last 2");
    for (int s = 2; s <= 5; s++) DSK_TEST_OK(dsk_ckpt_save(&ck, s, &e, 1, NULL, 0));
    for (int s = 1; s <= 3; s++) DSK_TEST_EXPECT(!step_dir_exists(dir, s, 0), "step %d not rotated away", s);
    DSK_TEST_EXPECT(step_dir_exists(dir, 4, 1) && step_dir_exists(dir, 5, 1), "steps 4 and 5 must stay");
    DSK_TEST_EXPECT(!step_dir_exists(dir, 9, 0), "step 9, saved before 1..5, not rotated away");
    DSK_TEST_EXPECT(!step_dir_exists(dir, 0, 0), "incomplete step 0 not reclaimed");
    DSK_TEST_OK(dsk_ckpt_latest(dir, &st));
    DSK_TEST_EXPECT(st == 5, "latest %lld, want 5", (long long)st);
    DSK_TEST_OK(dsk_ckpt_verify(dir, 4));
    dsk_ckpt_free(&ck);
    dsk_tensor_free(NULL, &a);
}

/* Steps of 19 digits (10^18 up to INT64_MAX) are ordinary steps for latest and rotation
   (fault 4 of issue 17); names that are not the canonical spelling of a step are ignored. */
static void test_huge_steps(void) {
    char dir[400], p[600];
    const int64_t s1[1] = {9};
    const int64_t big = 1000000000000000000ll, max = INT64_MAX;
    dsk_tensor a, b;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    dsk_ckpt_entry e = {"a", &a, 0, 0, 0, NULL, NULL}, le = {"a", &b, 0, 0, 0, NULL, NULL};
    int64_t st = -5;
    memset(&o, 0, sizeof o);
    o.keep_last = 2;
    new_dir(dir, sizeof dir, "huge");
    alloc_t(&a, DSK_F32, 1, s1);
    alloc_t(&b, DSK_F32, 1, s1);
    fill_f32(&a);
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, &o));
    DSK_TEST_OK(dsk_ckpt_save(&ck, 5, &e, 1, NULL, 0));
    DSK_TEST_OK(dsk_ckpt_save(&ck, big, &e, 1, NULL, 0));
    DSK_TEST_OK(dsk_ckpt_latest(dir, &st));
    DSK_TEST_EXPECT(st == big, "latest %lld, want 10^18", (long long)st);
    fill_f32(&a);
    DSK_TEST_OK(dsk_ckpt_save(&ck, max, &e, 1, NULL, 0));
    DSK_TEST_OK(dsk_ckpt_latest(dir, &st));
    DSK_TEST_EXPECT(st == max, "latest %lld, want INT64_MAX", (long long)st);
    DSK_TEST_EXPECT(!step_dir_exists(dir, 5, 0), "step 5 not rotated away (keep_last 2)");
    DSK_TEST_EXPECT(step_dir_exists(dir, big, 1), "step 10^18 must stay");
    DSK_TEST_OK(dsk_ckpt_load(&ck, -1, &le, 1, NULL));
    DSK_TEST_SAME_BYTES(b.data, a.data, dsk_tensor_nbytes(&a), "step INT64_MAX");
    /* a non-canonical spelling of a step (leading zeros beyond 8 digits, 20 digits) is not a step */
    snprintf(p, sizeof p, "%s/step_000000000000000000009", dir);
    mkdir(p, 0755);
    snprintf(p, sizeof p, "%s/step_99999999999999999999", dir);
    mkdir(p, 0755);
    DSK_TEST_OK(dsk_ckpt_latest(dir, &st));
    DSK_TEST_EXPECT(st == max, "latest %lld after odd names, want INT64_MAX", (long long)st);
    dsk_ckpt_free(&ck);
    dsk_tensor_free(NULL, &a);
    dsk_tensor_free(NULL, &b);
}

/* Latest means the most recent complete save (issue 17): save 10 and 20, resume from 10, save
   11: latest is 11, the list is 11, 20, 10, and keep_last 2 then drops 10 and, at the next
   save, 20. */
static void test_latest_after_rollback(void) {
    char dir[400];
    const int64_t s1[1] = {6};
    dsk_tensor a, back;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    dsk_ckpt_entry e = {"a", &a, 0, 0, 0, NULL, NULL}, le = {"a", &back, 0, 0, 0, NULL, NULL};
    dsk_ckpt_info info[4];
    dsk_ckpt_meta meta;
    int64_t st = -5;
    int n = -1;
    memset(&o, 0, sizeof o);
    new_dir(dir, sizeof dir, "rollback");
    alloc_t(&a, DSK_F32, 1, s1);
    alloc_t(&back, DSK_F32, 1, s1);
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, &o));
    fill_f32(&a);
    DSK_TEST_OK(dsk_ckpt_save(&ck, 10, &e, 1, NULL, 0));
    fill_f32(&a);
    DSK_TEST_OK(dsk_ckpt_save(&ck, 20, &e, 1, NULL, 0));
    dsk_ckpt_free(&ck);
    /* the job rolls back: resumes from 10 and saves 11 */
    o.keep_last = 2;
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, &o));
    DSK_TEST_OK(dsk_ckpt_load(&ck, 10, &le, 1, NULL));
    fill_f32(&a);
    DSK_TEST_OK(dsk_ckpt_save(&ck, 11, &e, 1, NULL, 0));
    DSK_TEST_OK(dsk_ckpt_latest(dir, &st));
    DSK_TEST_EXPECT(st == 11, "latest %lld after the rollback, want 11", (long long)st);
    DSK_TEST_OK(dsk_ckpt_load(&ck, -1, &le, 1, &meta));
    DSK_TEST_SAME_BYTES(back.data, a.data, dsk_tensor_nbytes(&a), "the newest load after the rollback");
    DSK_TEST_EXPECT(meta.step == 11 && meta.generation == 3 && meta.n_skipped == 0 && meta.skipped_step == -1,
                    "meta step %lld generation %llu skipped %d", (long long)meta.step,
                    (unsigned long long)meta.generation, meta.n_skipped);
    dsk_ckpt_meta_free(&meta);
    DSK_TEST_OK(dsk_ckpt_list(dir, info, 4, &n));
    DSK_TEST_EXPECT(n == 2 && info[0].step == 11 && info[1].step == 20 && info[0].generation == 3 &&
                        info[1].generation == 2 && info[0].world_size == 1 && info[0].n_files == 1,
                    "list after the rollback: %d entries, first %lld, second %lld", n, (long long)info[0].step,
                    (long long)(n > 1 ? info[1].step : -1));
    DSK_TEST_EXPECT(!step_dir_exists(dir, 10, 0), "step 10 (the oldest save) not rotated away");
    DSK_TEST_OK(dsk_ckpt_save(&ck, 12, &e, 1, NULL, 0));
    DSK_TEST_OK(dsk_ckpt_list(dir, info, 1, &n));
    DSK_TEST_EXPECT(n == 2 && info[0].step == 12, "list: %d entries, first %lld", n, (long long)info[0].step);
    DSK_TEST_EXPECT(!step_dir_exists(dir, 20, 0) && step_dir_exists(dir, 11, 1),
                    "step 20 of the abandoned run must go, 11 stay");
    DSK_TEST_OK(dsk_ckpt_list(dir, NULL, 0, &n));
    DSK_TEST_EXPECT(n == 2, "count %d", n);
    DSK_TEST_STATUS(dsk_ckpt_list(dir, NULL, 2, &n), DSK_ERR_ARG);
    dsk_ckpt_free(&ck);
    dsk_tensor_free(NULL, &a);
    dsk_tensor_free(NULL, &back);
}

/* A load of the newest passes over a checkpoint whose files are damaged (a flipped data
   byte, then a missing file) and says so in meta; several ranks never fall back alone. */
static void test_load_falls_back(void) {
    char dir[400], sd[600], f3[700];
    const int64_t s1[2] = {300, 1000}; /* 1.2 MB: two blocks */
    dsk_tensor a, keep2, back;
    dsk_ckpt ck;
    dsk_ckpt_entry e = {"a", &a, 0, 0, 0, NULL, NULL}, le = {"a", &back, 0, 0, 0, NULL, NULL};
    dsk_ckpt_meta meta;
    size_t n;
    unsigned char *bytes;
    new_dir(dir, sizeof dir, "fallback");
    alloc_t(&a, DSK_F32, 2, s1);
    alloc_t(&keep2, DSK_F32, 2, s1);
    alloc_t(&back, DSK_F32, 2, s1);
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, NULL));
    fill_f32(&a);
    DSK_TEST_OK(dsk_ckpt_save(&ck, 1, &e, 1, NULL, 0));
    fill_f32(&a);
    DSK_TEST_OK(dsk_ckpt_save(&ck, 2, &e, 1, NULL, 0));
    memcpy(keep2.data, a.data, dsk_tensor_nbytes(&a));
    fill_f32(&a);
    DSK_TEST_OK(dsk_ckpt_save(&ck, 3, &e, 1, NULL, 0));
    snprintf(sd, sizeof sd, "%s/step_00000003", dir);
    rank_file(sd, 0, f3, sizeof f3);
    bytes = read_file(f3, &n);
    bytes[n - 5] ^= 0x40; /* a data byte of the last block */
    write_file(f3, bytes, n);
    DSK_TEST_OK(dsk_ckpt_load(&ck, -1, &le, 1, &meta));
    DSK_TEST_SAME_BYTES(back.data, keep2.data, dsk_tensor_nbytes(&a), "fell back to step 2");
    DSK_TEST_EXPECT(meta.step == 2 && meta.n_skipped == 1 && meta.skipped_step == 3 && meta.skipped_error &&
                        strstr(meta.skipped_error, "(data corrupt)"),
                    "meta: step %lld skipped %d (%lld): %s", (long long)meta.step, meta.n_skipped,
                    (long long)meta.skipped_step, meta.skipped_error ? meta.skipped_error : "(none)");
    dsk_ckpt_meta_free(&meta);
    DSK_TEST_STATUS(dsk_ckpt_load(&ck, 3, &le, 1, NULL), DSK_ERR_CORRUPT); /* asked for by number: no fallback */
    /* step 2's file missing too: back to step 1 */
    snprintf(sd, sizeof sd, "%s/step_00000002", dir);
    rank_file(sd, 0, f3, sizeof f3);
    unlink(f3);
    DSK_TEST_OK(dsk_ckpt_load(&ck, -1, &le, 1, &meta));
    DSK_TEST_EXPECT(meta.step == 1 && meta.n_skipped == 2 && meta.skipped_step == 3, "meta: step %lld, %d skipped",
                    (long long)meta.step, meta.n_skipped);
    dsk_ckpt_meta_free(&meta);
    free(bytes);
    dsk_ckpt_free(&ck);
    /* as one of two ranks, with no way to agree: the damage is the answer */
    {
        dsk_ckpt_opts o;
        memset(&o, 0, sizeof o);
        o.rank = 1;
        o.world_size = 2;
        o.barrier = fbar_wait;
        DSK_TEST_OK(dsk_ckpt_init(&ck, dir, &o));
        DSK_TEST_STATUS(dsk_ckpt_load(&ck, -1, &le, 1, &meta), DSK_ERR_CORRUPT);
        DSK_TEST_ERROR_MENTIONS("a rank does not fall back to an older checkpoint alone");
        dsk_ckpt_free(&ck);
    }
    dsk_tensor_free(NULL, &a);
    dsk_tensor_free(NULL, &keep2);
    dsk_tensor_free(NULL, &back);
}

/* Steps 40 and 50 of one tensor (two 1 MiB blocks) in a fresh directory; keep40 receives
   step 40's bytes. Returns the path of step 50's rank file in f50. */
static void two_saves(char *dir, size_t dn, const char *tag, dsk_tensor *a, dsk_tensor *keep40, char *f50, size_t fn) {
    const int64_t s1[2] = {300, 1000};
    dsk_ckpt ck;
    dsk_ckpt_entry e = {"a", a, 0, 0, 0, NULL, NULL};
    char sd[600];
    new_dir(dir, dn, tag);
    alloc_t(a, DSK_F32, 2, s1);
    alloc_t(keep40, DSK_F32, 2, s1);
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, NULL));
    fill_f32(a);
    memcpy(keep40->data, a->data, dsk_tensor_nbytes(a));
    DSK_TEST_OK(dsk_ckpt_save(&ck, 40, &e, 1, NULL, 0));
    fill_f32(a);
    DSK_TEST_OK(dsk_ckpt_save(&ck, 50, &e, 1, NULL, 0));
    dsk_ckpt_free(&ck);
    snprintf(sd, sizeof sd, "%s/step_00000050", dir);
    rank_file(sd, 0, f50, fn);
}

/* The resume example at the top of dsk_ckpt.h, run on a newest checkpoint whose rank file is
   truncated, has a flipped bit in its tensor data, or a garbage header: dsk_ckpt_latest still
   names step 50 (it reads manifests only, as documented), and the example resumes from step 40
   with the skip reported (the example used to load `last` and stop with DSK_ERR_CORRUPT). */
static void test_resume_example_falls_back(void) {
    static const char *kinds[3] = {"truncated", "flipped data bit", "garbage header"};
    for (int kind = 0; kind < 3; kind++) {
        char dir[400], f50[700];
        dsk_tensor a, keep40, back;
        dsk_ckpt ck;
        unsigned char *bytes;
        size_t n;
        int64_t step = -7;
        two_saves(dir, sizeof dir, "resume", &a, &keep40, f50, sizeof f50);
        bytes = read_file(f50, &n);
        if (kind == 0) n -= 1 + (size_t)dsk_test_rand_int(1000);
        if (kind == 1) bytes[n - 1 - (size_t)dsk_test_rand_int(1 << 20)] ^= (unsigned char)(1u << dsk_test_rand_int(8));
        if (kind == 2) memset(bytes + 8, '#', 24);
        write_file(f50, bytes, n);
        free(bytes);
        DSK_TEST_STATUS(dsk_ckpt_verify(dir, 50), DSK_ERR_CORRUPT);
        alloc_t(&back, DSK_F32, 2, a.shape);
        for (int64_t i = 0; i < dsk_tensor_numel(&back); i++) ((float *)back.data)[i] = NAN; /* poison */
        DSK_TEST_OK(dsk_ckpt_init(&ck, dir, NULL));
        {
            /* the example, as written in the header */
            dsk_ckpt_entry e[1] = {{"a", &back, DSK_CKPT_WHOLE, 0, 0, NULL, NULL}};
            int64_t last; dsk_ckpt_meta meta;
            dsk_ckpt_latest(dir, &last);
            DSK_TEST_EXPECT(last == 50, "%s: latest says %lld, documented: 50 (manifests only)", kinds[kind],
                            (long long)last);
            if (last >= 0) {
                DSK_TEST_OK(dsk_ckpt_load(&ck, -1, e, 1, &meta));
                step = meta.step;
                DSK_TEST_EXPECT(meta.n_skipped == 1 && meta.skipped_step == 50 && meta.skipped_error,
                                "%s: skipped %d (step %lld)", kinds[kind], meta.n_skipped,
                                (long long)meta.skipped_step);
                dsk_ckpt_meta_free(&meta);
            }
        }
        DSK_TEST_EXPECT(step == 40, "%s: resumed at step %lld (%s)", kinds[kind], (long long)step, dsk_last_error());
        DSK_TEST_SAME_BYTES(back.data, keep40.data, dsk_tensor_nbytes(&a), kinds[kind]);
        dsk_ckpt_free(&ck);
        dsk_tensor_free(NULL, &a); dsk_tensor_free(NULL, &keep40); dsk_tensor_free(NULL, &back);
    }
}

/* A newest checkpoint whose manifest was edited is passed over like one with damaged files,
   and counted: n_skipped, skipped_step and skipped_error say so (it used to be silent). */
static void test_load_counts_damaged_manifest(void) {
    char dir[400], f50[700], man[700];
    dsk_tensor a, keep40, back;
    dsk_ckpt ck;
    dsk_ckpt_entry le;
    dsk_ckpt_meta meta;
    two_saves(dir, sizeof dir, "badman", &a, &keep40, f50, sizeof f50);
    alloc_t(&back, DSK_F32, 2, a.shape);
    le = (dsk_ckpt_entry){"a", &back, 0, 0, 0, NULL, NULL};
    snprintf(man, sizeof man, "%s/step_00000050/manifest.json", dir);
    DSK_TEST_EXPECT(edit_file(man, "\"step\":50", "\"step\":51"), "edit manifest");
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, NULL));
    DSK_TEST_OK(dsk_ckpt_load(&ck, -1, &le, 1, &meta));
    DSK_TEST_EXPECT(meta.step == 40 && meta.n_skipped == 1 && meta.skipped_step == 50 && meta.skipped_error &&
                        strstr(meta.skipped_error, "step_00000050/manifest.json"),
                    "step %lld, skipped %d (step %lld): %s", (long long)meta.step, meta.n_skipped,
                    (long long)meta.skipped_step, meta.skipped_error ? meta.skipped_error : "(none)");
    DSK_TEST_SAME_BYTES(back.data, keep40.data, dsk_tensor_nbytes(&a), "step 40's data");
    dsk_ckpt_meta_free(&meta);
    /* step 40's file damaged too: nothing loads, and the message names the damaged manifest */
    {
        char sd[600], f40[700];
        snprintf(sd, sizeof sd, "%s/step_00000040", dir);
        rank_file(sd, 0, f40, sizeof f40);
        unlink(f40);
        DSK_TEST_STATUS(dsk_ckpt_load(&ck, -1, &le, 1, &meta), DSK_ERR_CORRUPT);
        snprintf(sd, sizeof sd, "%s/step_00000040/manifest.json", dir);
        unlink(sd);
        DSK_TEST_STATUS(dsk_ckpt_load(&ck, -1, &le, 1, &meta), DSK_ERR_IO);
        DSK_TEST_ERROR_MENTIONS("no complete checkpoint");
        DSK_TEST_ERROR_MENTIONS("damaged manifests: step 50");
    }
    dsk_ckpt_free(&ck);
    dsk_tensor_free(NULL, &a); dsk_tensor_free(NULL, &keep40); dsk_tensor_free(NULL, &back);
}

/* A step that was never saved is not "incomplete": the error says it does not exist and
   lists the checkpoints there are. */
static void test_load_missing_step(void) {
    char dir[400], f50[700];
    dsk_tensor a, keep40;
    dsk_ckpt ck;
    dsk_ckpt_entry le;
    two_saves(dir, sizeof dir, "nostep", &a, &keep40, f50, sizeof f50);
    le = (dsk_ckpt_entry){"a", &keep40, 0, 0, 0, NULL, NULL};
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, NULL));
    DSK_TEST_STATUS(dsk_ckpt_load(&ck, 70, &le, 1, NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("there is no checkpoint of step 70");
    DSK_TEST_ERROR_MENTIONS("complete: step 50, 40 (most recent save first)");
    DSK_TEST_STATUS(dsk_ckpt_verify(dir, 45), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("there is no checkpoint of step 45");
    dsk_ckpt_free(&ck);
    /* in an empty directory */
    new_dir(dir, sizeof dir, "nostep_empty");
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, NULL));
    DSK_TEST_STATUS(dsk_ckpt_load(&ck, 3, &le, 1, NULL), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("(no checkpoint)");
    dsk_ckpt_free(&ck);
    dsk_tensor_free(NULL, &a); dsk_tensor_free(NULL, &keep40);
}

static void test_latest_skips_incomplete(void) {
    char dir[400], p[600];
    const int64_t s1[1] = {5};
    dsk_tensor a, b;
    dsk_ckpt ck;
    dsk_ckpt_entry e = {"a", &a, 0, 0, 0, NULL, NULL}, le = {"a", &b, 0, 0, 0, NULL, NULL};
    int64_t st = 0;
    DSK_TEST_OK(dsk_ckpt_latest("/nonexistent/dsk/ckpt", &st));
    DSK_TEST_EXPECT(st == -1, "missing dir gives %lld", (long long)st);
    new_dir(dir, sizeof dir, "latest");
    alloc_t(&a, DSK_F32, 1, s1); fill_f32(&a);
    alloc_t(&b, DSK_F32, 1, s1);
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, NULL));
    DSK_TEST_OK(dsk_ckpt_save(&ck, 10, &e, 1, NULL, 0));
    DSK_TEST_OK(dsk_ckpt_save(&ck, 20, &e, 1, NULL, 0));
    DSK_TEST_OK(dsk_ckpt_save(&ck, 30, &e, 1, NULL, 0));
    /* 30: manifest removed (incomplete); 20: manifest garbage */
    snprintf(p, sizeof p, "%s/step_00000030/manifest.json", dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/step_00000020/manifest.json", dir);
    write_file(p, "{\"format\":", 10);
    DSK_TEST_OK(dsk_ckpt_latest(dir, &st));
    DSK_TEST_EXPECT(st == 10, "latest %lld, want 10", (long long)st);
    DSK_TEST_OK(dsk_ckpt_load(&ck, -1, &le, 1, NULL));
    DSK_TEST_SAME_BYTES(b.data, a.data, 20, "latest load");
    DSK_TEST_STATUS(dsk_ckpt_load(&ck, 30, &le, 1, NULL), DSK_ERR_CORRUPT);
    DSK_TEST_ERROR_MENTIONS("the checkpoint is incomplete");
    DSK_TEST_STATUS(dsk_ckpt_load(&ck, 20, &le, 1, NULL), DSK_ERR_CORRUPT);
    DSK_TEST_ERROR_MENTIONS("no crc32c line at its end");
    /* a manifest larger than a safetensors header may be is refused unread (fault 9): 30's,
       made complete again but padded to 100,000,001 bytes (a sparse file) */
    snprintf(p, sizeof p, "%s/step_00000030/manifest.json", dir);
    write_file(p, "{}", 2);
    DSK_TEST_EXPECT(truncate(p, 100000001) == 0, "truncate");
    DSK_TEST_STATUS(dsk_ckpt_load(&ck, 30, &le, 1, NULL), DSK_ERR_CORRUPT);
    DSK_TEST_ERROR_MENTIONS("more than the limit of 100000000");
    DSK_TEST_STATUS(dsk_ckpt_load(&ck, 40, &le, 1, NULL), DSK_ERR_ARG); /* never saved */
    DSK_TEST_ERROR_MENTIONS("there is no checkpoint of step 40");
    DSK_TEST_ERROR_MENTIONS("(complete: step 10; damaged manifests: step 30, 20)");
    dsk_ckpt_free(&ck);
    dsk_tensor_free(NULL, &a);
    dsk_tensor_free(NULL, &b);
}

/* A FIFO where a manifest or a rank file should be (fault 3 of issue 17): latest, load,
   verify and file_open must report it, not block forever in open(). */
typedef struct fifo_arg {
    char dir[400];
} fifo_arg;

static int fifo_probe(void *p) {
    fifo_arg *a = (fifo_arg *)p;
    dsk_ckpt ck;
    dsk_safetensors_file f;
    const int64_t s1[1] = {5};
    dsk_tensor t;
    dsk_ckpt_entry e = {"a", &t, 0, 0, 0, NULL, NULL};
    char path[600];
    int64_t st = -5;
    int bad = 0;
    dsk_tensor_alloc(NULL, &t, DSK_F32, 1, s1);
    dsk_ckpt_init(&ck, a->dir, NULL);
    if (dsk_ckpt_latest(a->dir, &st) != DSK_OK || st != 3) {
        printf("     latest: %lld (%s)\n", (long long)st, dsk_last_error());
        bad = 1;
    }
    if (dsk_ckpt_load(&ck, 4, &e, 1, NULL) == DSK_OK || !strstr(dsk_last_error(), "not a regular file")) {
        printf("     load of the FIFO manifest: %s\n", dsk_last_error());
        bad = 1;
    }
    if (dsk_ckpt_verify(a->dir, 4) == DSK_OK) { printf("     verify of the FIFO manifest passed\n"); bad = 1; }
    if (dsk_ckpt_load(&ck, 3, &e, 1, NULL) == DSK_OK || !strstr(dsk_last_error(), "not a regular file")) {
        printf("     load of a FIFO rank file: %s\n", dsk_last_error());
        bad = 1;
    }
    {
        char sd[500];
        snprintf(sd, sizeof sd, "%s/step_00000003", a->dir);
        rank_file(sd, 0, path, sizeof path);
    }
    if (dsk_safetensors_open(&f, path) == DSK_OK) {
        printf("     file_open of a FIFO succeeded\n");
        bad = 1;
    }
    dsk_ckpt_free(&ck);
    dsk_tensor_free(NULL, &t);
    return bad;
}

static void test_fifo_does_not_hang(void) {
    fifo_arg a;
    char p[600];
    const int64_t s1[1] = {5};
    dsk_tensor t;
    dsk_ckpt ck;
    dsk_ckpt_entry e = {"a", &t, 0, 0, 0, NULL, NULL};
    new_dir(a.dir, sizeof a.dir, "fifo");
    alloc_t(&t, DSK_F32, 1, s1);
    fill_f32(&t);
    DSK_TEST_OK(dsk_ckpt_init(&ck, a.dir, NULL));
    DSK_TEST_OK(dsk_ckpt_save(&ck, 1, &e, 1, NULL, 0));
    DSK_TEST_OK(dsk_ckpt_save(&ck, 3, &e, 1, NULL, 0));
    snprintf(p, sizeof p, "%s/step_00000004", a.dir);
    mkdir(p, 0755);
    snprintf(p, sizeof p, "%s/step_00000004/manifest.json", a.dir);
    DSK_TEST_EXPECT(mkfifo(p, 0644) == 0, "mkfifo %s", p);
    {
        char sd[500];
        snprintf(sd, sizeof sd, "%s/step_00000003", a.dir);
        rank_file(sd, 0, p, sizeof p);
    }
    unlink(p);
    DSK_TEST_EXPECT(mkfifo(p, 0644) == 0, "mkfifo %s", p);
    /* newest first: latest opens step 4's FIFO manifest, then finds step 3 (manifest intact) */
    DSK_TEST_EXPECT(run_child_timeout(fifo_probe, &a, 10) == 0,
                    "latest/load/verify/file_open hung or failed on a FIFO");
    dsk_ckpt_free(&ck);
    dsk_tensor_free(NULL, &t);
}

/* A manifest that exists but cannot be read (EACCES here; out of memory alike) is an error of
   dsk_ckpt_latest, not a reason to answer an older step (fault 6 of issue 17). Run as an
   unprivileged user: root reads a file of mode 000. */
typedef struct eacces_arg {
    char dir[400];
} eacces_arg;

static int eacces_probe(void *p) {
    eacces_arg *a = (eacces_arg *)p;
    int64_t st = -5;
    dsk_status s;
    if (geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0)) { printf("     cannot drop root\n"); return 2; }
    s = dsk_ckpt_latest(a->dir, &st);
    if (s != DSK_ERR_IO || !strstr(dsk_last_error(), "step_00000002/manifest.json") ||
        !strstr(dsk_last_error(), "Permission denied")) {
        printf("     latest: %s, step %lld: %s\n", dsk_status_str(s), (long long)st, dsk_last_error());
        return 1;
    }
    return 0;
}

static void test_latest_reports_read_errors(void) {
    eacces_arg a;
    char p[600];
    const int64_t s1[1] = {3};
    dsk_tensor t;
    dsk_ckpt ck;
    dsk_ckpt_entry e = {"a", &t, 0, 0, 0, NULL, NULL};
    new_dir(a.dir, sizeof a.dir, "eacces");
    alloc_t(&t, DSK_F32, 1, s1);
    fill_f32(&t);
    DSK_TEST_OK(dsk_ckpt_init(&ck, a.dir, NULL));
    DSK_TEST_OK(dsk_ckpt_save(&ck, 1, &e, 1, NULL, 0));
    DSK_TEST_OK(dsk_ckpt_save(&ck, 2, &e, 1, NULL, 0));
    snprintf(p, sizeof p, "%s/step_00000002/manifest.json", a.dir);
    DSK_TEST_EXPECT(chmod(p, 0) == 0, "chmod");
    DSK_TEST_EXPECT(run_child_timeout(eacces_probe, &a, 20) == 0, "latest hid an unreadable newest manifest");
    chmod(p, 0644);
    dsk_ckpt_free(&ck);
    dsk_tensor_free(NULL, &t);
}

/* In a checkpoint, any flip in a rank file's header (length prefix included) is caught:
   either the header stops parsing or its bytes no longer match the manifest's CRC. Any flip
   in the manifest is caught by the manifest's own CRC32C (fault 7 of issue 17). */
static void test_flipped_checkpoint_headers(void) {
    model g;
    mr_arg m;
    char pristine[600], work[600], file[700], rank1[700];
    int detected = 0, trials = 40, manifest_detected = 0;
    size_t n;
    unsigned char *bytes;
    uint64_t hlen = 0;
    mr_setup(&m, &g, 6, 3, 2, "fliphdr");
    DSK_TEST_EXPECT(run_ranks(2, mr_save, &m) == 0, "save failed");
    snprintf(pristine, sizeof pristine, "%s/step_00000003", m.dir);
    snprintf(work, sizeof work, "%s/pristine", m.dir);
    copy_dir(pristine, work);
    rank_file(work, 1, file, sizeof file);
    snprintf(rank1, sizeof rank1, "%s", strrchr(file, '/') + 1);
    if (!(bytes = read_file(file, &n)) || n < 8) { free(bytes); model_free(&g); return; }
    for (int b = 7; b >= 0; b--) hlen = (hlen << 8) | bytes[b];
    free(bytes);
    for (int t = 0; t < trials; t++) {
        int which = t % 2; /* rank file header, or manifest */
        char target[1500], saved[1500];
        size_t pos;
        dsk_ckpt ck;
        dsk_ckpt_opts o;
        dsk_ckpt_entry e[5];
        dsk_tensor own[5];
        dsk_status s;
        snprintf(target, sizeof target, "%s/%s", pristine, which ? DSK__CKPT_MANIFEST : rank1);
        snprintf(saved, sizeof saved, "%s/%s", work, which ? DSK__CKPT_MANIFEST : rank1);
        if (!(bytes = read_file(saved, &n)) || !n) { free(bytes); break; }
        pos = which ? (size_t)dsk_test_rand_int((int64_t)n) : (size_t)dsk_test_rand_int((int64_t)(8 + hlen));
        bytes[pos] ^= (unsigned char)(1u << dsk_test_rand_int(8));
        write_file(target, bytes, n);
        free(bytes);
        memset(&o, 0, sizeof o);
        rank_entries(&g, 0, 1, 1, e, own);
        dsk_ckpt_init(&ck, m.dir, &o);
        s = dsk_ckpt_load(&ck, 3, e, 5, NULL);
        if (!which) {
            DSK_TEST_EXPECT(s == DSK_ERR_CORRUPT, "header flip at byte %zu: %s (%s)", pos, dsk_status_str(s),
                            dsk_last_error());
            detected += s != DSK_OK;
        } else {
            DSK_TEST_EXPECT(s == DSK_ERR_CORRUPT, "manifest flip at byte %zu: %s (%s)", pos, dsk_status_str(s),
                            dsk_last_error());
            manifest_detected += s != DSK_OK;
        }
        dsk_ckpt_free(&ck);
        for (int i = 0; i < 5; i++) dsk_tensor_free(NULL, &own[i]);
        copy_file(saved, target);
    }
    DSK_TEST_EXPECT(detected == trials / 2, "%d of %d header flips detected", detected, trials / 2);
    DSK_TEST_EXPECT(manifest_detected == trials / 2, "%d of %d manifest flips detected", manifest_detected, trials / 2);
    model_free(&g);
}

/* dsk_ckpt_verify checks the manifest's tensor list and dtypes against the rank files, not
   only the files' own checksums (fault 7 of issue 17). */
static void test_verify_checks_manifest(void) {
    model g;
    mr_arg m;
    char man[700], keep[700];
    mr_setup(&m, &g, 8, 6, 2, "verifyman");
    DSK_TEST_EXPECT(run_ranks(2, mr_save, &m) == 0, "save failed");
    snprintf(man, sizeof man, "%s/step_00000006/manifest.json", m.dir);
    snprintf(keep, sizeof keep, "%s/manifest.keep", m.dir);
    copy_file(man, keep);
    DSK_TEST_OK(dsk_ckpt_verify(m.dir, 6));
    /* a dtype of the same width: every file and CRC is intact, only the manifest lies; its own
       CRC32C catches the edit, and behind it (resealed) so does the check against the files */
    DSK_TEST_EXPECT(edit_file(man, "\"moe.w1\":{\"dtype\":\"F32\"", "\"moe.w1\":{\"dtype\":\"I32\""), "edit dtype");
    DSK_TEST_STATUS(dsk_ckpt_verify(m.dir, 6), DSK_ERR_CORRUPT);
    DSK_TEST_ERROR_MENTIONS("(altered or damaged)");
    reseal_manifest(man);
    DSK_TEST_STATUS(dsk_ckpt_verify(m.dir, 6), DSK_ERR_CORRUPT);
    DSK_TEST_ERROR_MENTIONS("tensor \"moe.w1\"");
    copy_file(keep, man);
    /* a tensor dropped from the manifest: rank 0's file holds one the manifest does not place */
    DSK_TEST_EXPECT(edit_file(man, "\"scale\":", "\"scalX\":"), "edit name");
    reseal_manifest(man);
    DSK_TEST_STATUS(dsk_ckpt_verify(m.dir, 6), DSK_ERR_CORRUPT);
    copy_file(keep, man);
    DSK_TEST_OK(dsk_ckpt_verify(m.dir, 6));
    model_free(&g);
}

/* Checkpoint-level damage: a missing manifest, a missing or truncated rank file, a tensor
   whose shape or dtype differ from the model. */
static void test_checkpoint_damage(void) {
    model g;
    mr_arg m;
    char p[700], keep[700];
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    dsk_ckpt_entry e[5];
    dsk_tensor own[5];
    mr_setup(&m, &g, 8, 4, 2, "damage");
    DSK_TEST_EXPECT(run_ranks(2, mr_save, &m) == 0, "save failed");
    memset(&o, 0, sizeof o);
    DSK_TEST_OK(dsk_ckpt_init(&ck, m.dir, &o));
    rank_entries(&g, 0, 1, 1, e, own);
    /* truncated rank file */
    snprintf(keep, sizeof keep, "%s/step_00000004", m.dir);
    rank_file(keep, 1, p, sizeof p);
    snprintf(keep, sizeof keep, "%s/keep", m.dir);
    copy_file(p, keep);
    DSK_TEST_EXPECT(truncate(p, file_size(p) - 3) == 0, "truncate");
    DSK_TEST_STATUS(dsk_ckpt_load(&ck, 4, e, 5, NULL), DSK_ERR_CORRUPT);
    DSK_TEST_ERROR_MENTIONS("file truncated");
    DSK_TEST_STATUS(dsk_ckpt_verify(m.dir, 4), DSK_ERR_CORRUPT);
    /* missing rank file: damage, named */
    unlink(p);
    DSK_TEST_STATUS(dsk_ckpt_load(&ck, 4, e, 5, NULL), DSK_ERR_CORRUPT);
    DSK_TEST_ERROR_MENTIONS("rank_00001.");
    DSK_TEST_ERROR_MENTIONS("is missing (the checkpoint is damaged)");
    /* a valid file that is not the one the manifest describes: rank 0's copied over rank 1's */
    {
        char p0[700], sd[700];
        snprintf(sd, sizeof sd, "%s/step_00000004", m.dir);
        rank_file(sd, 0, p0, sizeof p0);
        copy_file(p0, p);
        DSK_TEST_STATUS(dsk_ckpt_load(&ck, 4, e, 5, NULL), DSK_ERR_CORRUPT);
        DSK_TEST_ERROR_MENTIONS("rank_00001.");
    }
    copy_file(keep, p);
    DSK_TEST_OK(dsk_ckpt_load(&ck, 4, e, 5, NULL));
    DSK_TEST_EXPECT(compare_entries(e, &g, "restored") == 0, "restored load differs");
    /* shape and dtype mismatches name the tensor, both shapes and both dtypes */
    {
        dsk_tensor wrong;
        const int64_t ws[3] = {8, 6, 3};
        dsk_ckpt_entry we = {"moe.w1", &wrong, 0, 0, 0, NULL, NULL};
        alloc_t(&wrong, DSK_F32, 3, ws);
        DSK_TEST_STATUS(dsk_ckpt_load(&ck, 4, &we, 1, NULL), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("tensor \"moe.w1\"");
        DSK_TEST_ERROR_MENTIONS("file has [8,5,3] f32, model has [8,6,3] f32");
        dsk_tensor_free(NULL, &wrong);
        alloc_t(&wrong, DSK_BF16, 3, g.w1.shape);
        DSK_TEST_STATUS(dsk_ckpt_load(&ck, 4, &we, 1, NULL), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("file has [8,5,3] f32, model has [8,5,3] bf16 (set allow_cast to convert)");
        dsk_tensor_free(NULL, &wrong);
        /* split request with a different global row count */
        alloc_t(&wrong, DSK_F32, 3, g.w1.shape);
        we.split = 1; we.row0 = 0; we.global_rows = 9;
        DSK_TEST_STATUS(dsk_ckpt_load(&ck, 4, &we, 1, NULL), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("file has [8,5,3] f32, model has [9,5,3] f32");
        we.name = "not.there";
        DSK_TEST_STATUS(dsk_ckpt_load(&ck, 4, &we, 1, NULL), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("tensor \"not.there\" is not in the checkpoint");
        dsk_tensor_free(NULL, &wrong);
    }
    /* allow_cast: bf16 in the file into an f32 model */
    {
        dsk_ckpt ck2;
        dsk_tensor w2f;
        dsk_ckpt_entry ce = {"moe.w2", &w2f, 0, 0, 0, NULL, NULL};
        int64_t n = dsk_tensor_numel(&g.w2);
        double *want = (double *)malloc((size_t)n * sizeof *want);
        o.allow_cast = 1;
        DSK_TEST_OK(dsk_ckpt_init(&ck2, m.dir, &o));
        alloc_t(&w2f, DSK_F32, 2, g.w2.shape);
        DSK_TEST_OK(dsk_ckpt_load(&ck2, 4, &ce, 1, NULL));
        for (int64_t i = 0; i < n; i++) want[i] = dsk_bf16_to_f32(((uint16_t *)g.w2.data)[i]);
        DSK_TEST_CLOSE((float *)w2f.data, want, n, 0, 0, "bf16 -> f32 cast on load");
        free(want);
        dsk_tensor_free(NULL, &w2f);
        dsk_ckpt_free(&ck2);
    }
    /* missing manifest */
    snprintf(p, sizeof p, "%s/step_00000004/manifest.json", m.dir);
    unlink(p);
    DSK_TEST_STATUS(dsk_ckpt_load(&ck, 4, e, 5, NULL), DSK_ERR_CORRUPT);
    DSK_TEST_ERROR_MENTIONS("the checkpoint is incomplete");
    DSK_TEST_STATUS(dsk_ckpt_load(&ck, -1, e, 5, NULL), DSK_ERR_IO);
    DSK_TEST_ERROR_MENTIONS("no complete checkpoint");
    for (int i = 0; i < 5; i++) dsk_tensor_free(NULL, &own[i]);
    dsk_ckpt_free(&ck);
    model_free(&g);
}

/* ------------------------------------------------------------ full disk */

/* In a child limited to 64 KiB per file (SIGXFSZ ignored, so write() fails with EFBIG): a
   1 MiB save and a 1 MiB single file fail with DSK_ERR_IO naming the write, and leave no
   checkpoint and no temporary file. */
static void test_full_disk(void) {
    char dir[400], step_dir[600];
    int fds[2];
    pid_t pid;
    char msg[2][1100];
    int status[2] = {-1, -1}, st = 0;
    int64_t latest = 0;
    new_dir(dir, sizeof dir, "full");
    DSK_TEST_EXPECT(pipe(fds) == 0, "pipe");
    fflush(stdout);
    pid = fork();
    if (pid == 0) {
        struct rlimit rl;
        const int64_t s1[1] = {1 << 18};
        dsk_tensor a;
        dsk_ckpt ck;
        dsk_ckpt_entry e = {"a", &a, 0, 0, 0, NULL, NULL};
        dsk_safetensors_entry se = {"a", &a};
        char path[600], out[2][1100];
        int codes[2];
        close(fds[0]);
        signal(SIGXFSZ, SIG_IGN);
        rl.rlim_cur = rl.rlim_max = 64 << 10;
        setrlimit(RLIMIT_FSIZE, &rl);
        dsk_tensor_alloc(NULL, &a, DSK_F32, 1, s1);
        fill_f32(&a);
        dsk_ckpt_init(&ck, dir, NULL);
        codes[0] = (int)dsk_ckpt_save(&ck, 1, &e, 1, NULL, 0);
        snprintf(out[0], sizeof out[0], "%s", dsk_last_error());
        snprintf(path, sizeof path, "%s/single.safetensors", dir);
        codes[1] = (int)dsk_safetensors_save(NULL, path, &se, 1, NULL, 0);
        snprintf(out[1], sizeof out[1], "%s", dsk_last_error());
        if (write(fds[1], codes, sizeof codes) != (ssize_t)sizeof codes ||
            write(fds[1], out, sizeof out) != (ssize_t)sizeof out)
            _exit(2);
        _exit(0);
    }
    close(fds[1]);
    if (read(fds[0], status, sizeof status) != (ssize_t)sizeof status ||
        read(fds[0], msg, sizeof msg) != (ssize_t)sizeof msg)
        memset(msg, 0, sizeof msg);
    close(fds[0]);
    waitpid(pid, &st, 0);
    DSK_TEST_EXPECT(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child died (status %d)", st);
    for (int i = 0; i < 2; i++) {
        DSK_TEST_EXPECT(status[i] == DSK_ERR_IO, "%s: status %s (%s)", i ? "file save" : "ckpt save",
                        dsk_status_str((dsk_status)status[i]), msg[i]);
        DSK_TEST_EXPECT(strstr(msg[i], "write to") && strstr(msg[i], "File too large"), "message \"%s\"", msg[i]);
    }
    DSK_TEST_OK(dsk_ckpt_latest(dir, &latest));
    DSK_TEST_EXPECT(latest == -1, "a failed save became checkpoint %lld", (long long)latest);
    snprintf(step_dir, sizeof step_dir, "%s/step_00000001", dir);
    DSK_TEST_EXPECT(count_tmp_files(step_dir) == 0 && count_tmp_files(dir) == 0,
                    "temporary files left after a failed write");
}

/* ------------------------------------------------------------ writers killed mid-save */

/* Step s's content is a function of s, so any loaded checkpoint can be checked exactly. */
/* With `inc` (the incremental writer) a changes every 4th step and c every 3rd, so most
   saves reference earlier ones' files for them. */
static void kill_content(int64_t step, int inc, dsk_tensor *a, dsk_tensor *b, dsk_tensor *c) {
    dsk_tensor_uniform(NULL, a, (uint64_t)(inc ? step - step % 4 : step), 0, -1.0f, 1.0f);
    dsk_tensor_normal(NULL, b, (uint64_t)step + 1000000, 0, 0.0f, 1.0f);
    for (int i = 0; i < 5; i++) ((int64_t *)c->data)[i] = (inc ? step - step % 3 : step) * 1000 + i;
}

typedef struct kill_model {
    dsk_tensor a, b, c;
} kill_model;

static void kill_model_init(kill_model *k) {
    const int64_t sa[2] = {64, 33}, sb[2] = {40, 17}, sc[1] = {5};
    alloc_t(&k->a, DSK_F32, 2, sa);
    alloc_t(&k->b, DSK_BF16, 2, sb);
    alloc_t(&k->c, DSK_I64, 1, sc);
}
static void kill_model_free(kill_model *k) {
    dsk_tensor_free(NULL, &k->a); dsk_tensor_free(NULL, &k->b); dsk_tensor_free(NULL, &k->c);
}

/* 0 when checkpoint `step` under dir loads and equals kill_content(step, inc). */
static int kill_check(const char *dir, int64_t step, int inc) {
    kill_model got, want;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    dsk_ckpt_entry e[3];
    dsk_ckpt_meta meta;
    int64_t copy = -1;
    int bad = 0;
    kill_model_init(&got);
    kill_model_init(&want);
    kill_content(step, inc, &want.a, &want.b, &want.c);
    memset(e, 0, sizeof e);
    e[0].name = "a"; e[0].tensor = &got.a; e[1].name = "b"; e[1].tensor = &got.b; e[2].name = "c"; e[2].tensor = &got.c;
    memset(&o, 0, sizeof o);
    o.read_only = 1; /* a checker: it must not reclaim what the test is about to count */
    dsk_ckpt_init(&ck, dir, &o);
    if (dsk_ckpt_load(&ck, step, e, 3, &meta) != DSK_OK) {
        printf("     load of step %lld: %s\n", (long long)step, dsk_last_error());
        bad = 1;
    } else {
        bad = memcmp(got.a.data, want.a.data, dsk_tensor_nbytes(&want.a)) ||
              memcmp(got.b.data, want.b.data, dsk_tensor_nbytes(&want.b)) ||
              memcmp(got.c.data, want.c.data, dsk_tensor_nbytes(&want.c)) ||
              dsk_ckpt_meta_i64(&meta, "step_copy", &copy) != DSK_OK || copy != step;
        if (bad) printf("     step %lld loaded with wrong content\n", (long long)step);
        dsk_ckpt_meta_free(&meta);
    }
    dsk_ckpt_free(&ck);
    kill_model_free(&got);
    kill_model_free(&want);
    return bad;
}

/* The writer: resumes from the newest checkpoint (checking it), then saves step after step,
   reporting each completed step through the pipe, until it is killed. */
static void kill_writer(const char *dir, int fd, int inc) {
    kill_model k;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    int64_t last = -1;
    char copy[32];
    dsk_ckpt_kv kv[1] = {{"step_copy", copy}};
    dsk_ckpt_entry e[3];
    memset(&o, 0, sizeof o);
    o.keep_last = 3;
    o.incremental = inc;
    kill_model_init(&k);
    memset(e, 0, sizeof e);
    e[0].name = "a"; e[0].tensor = &k.a; e[1].name = "b"; e[1].tensor = &k.b; e[2].name = "c"; e[2].tensor = &k.c;
    if (dsk_ckpt_latest(dir, &last) != DSK_OK || (last >= 0 && kill_check(dir, last, inc) != 0)) _exit(3);
    dsk_ckpt_init(&ck, dir, &o);
    if (write(fd, &last, sizeof last) != (ssize_t)sizeof last) _exit(5); /* resumed: saving starts now */
    /* as a resumed job does, the first save is the step it resumed from, again (fault 1 of
       issue 17: that save used to delete the step before writing it) */
    for (int64_t step = last >= 0 ? last : 0;; step++) {
        kill_content(step, inc, &k.a, &k.b, &k.c);
        snprintf(copy, sizeof copy, "%lld", (long long)step);
        if (dsk_ckpt_save(&ck, step, e, 3, kv, 1) != DSK_OK) {
            printf("     writer: %s\n", dsk_last_error());
            _exit(4);
        }
        if (write(fd, &step, sizeof step) != (ssize_t)sizeof step) _exit(5);
    }
}

/* Every step directory that has a manifest verifies in full. */
static int verify_all_complete(const char *dir) {
    dsk__ckpt_scan sc;
    int bad = 0;
    if (dsk__ckpt_scan_dir("test", dir, &sc) != DSK_OK) return 1;
    for (int i = 0; i < sc.n; i++)
        if (sc.e[i].state != DSK__CKPT_INCOMPLETE && dsk_ckpt_verify(dir, sc.e[i].step) != DSK_OK) {
            printf("     step %lld: %s\n", (long long)sc.e[i].step, dsk_last_error());
            bad = 1;
        }
    dsk__ckpt_scan_free(&sc);
    return bad;
}

/* Files a dead save can leave: rank files no complete checkpoint references and temporaries
   in step directories whose manifest is absent or readable, the step directories without a
   manifest, and temporaries in dir. */
static int count_garbage(const char *dir) {
    dsk__ckpt_scan sc;
    int n = count_tmp_files(dir);
    if (dsk__ckpt_scan_dir("test", dir, &sc) != DSK_OK) return 1000;
    for (int i = 0; i < sc.n; i++) {
        char sd[600];
        DIR *d;
        struct dirent *de;
        int live = 0;
        if (sc.e[i].state == DSK__CKPT_DAMAGED) continue;
        snprintf(sd, sizeof sd, "%s/step_%08lld", dir, (long long)sc.e[i].step);
        if (!(d = opendir(sd))) continue;
        while ((de = readdir(d)) != NULL) {
            int rank;
            uint64_t att;
            if (dsk__ckpt_parse_rank_name(de->d_name, &rank, &att)) {
                int used = dsk__ckpt_file_live(&sc, -1, sc.e[i].step, rank, att);
                n += !used;
                live += used;
            } else n += strstr(de->d_name, ".tmp") != NULL;
        }
        closedir(d);
        n += sc.e[i].state == DSK__CKPT_INCOMPLETE &&
             !live; /* a directory only a later checkpoint's references keep is no leftover */
    }
    dsk__ckpt_scan_free(&sc);
    return n;
}

/* Writers killed at random times (SIGKILL), each resuming from the newest checkpoint: every
   reported step is durable and loads bitwise, every complete checkpoint verifies, leftovers do
   not pile up. inc: incremental saves, whose checkpoints reference earlier ones' files. */
static void sigkill_case(int trials, int inc) {
    char dir[400];
    int64_t prev_latest = -1;
    int mid_save = 0, failures = 0;
    new_dir(dir, sizeof dir, inc ? "killinc" : "kill");
    for (int t = 0; t < trials && failures < 3; t++) {
        int fds[2], st = 0;
        int64_t done = -1, step, latest = -2;
        int garbage;
        pid_t pid;
        if (pipe(fds) != 0) { DSK_TEST_EXPECT(0, "pipe"); break; }
        fflush(stdout);
        pid = fork();
        if (pid == 0) { close(fds[0]); kill_writer(dir, fds[1], inc); _exit(0); }
        close(fds[1]);
        if (read(fds[0], &step, sizeof step) != (ssize_t)sizeof step) {
            DSK_TEST_EXPECT(0, "trial %d: the writer failed to resume", t);
            failures++;
        }
        /* every 4th trial lets one save finish first, so checkpoints accumulate on any disk */
        if (t % 4 == 3 && read(fds[0], &step, sizeof step) == (ssize_t)sizeof step) done = step;
        sleep_us((long)dsk_test_rand_int(100000)); /* a save takes ~10-70 ms here (fsyncs) */
        kill(pid, SIGKILL);
        waitpid(pid, &st, 0);
        while (read(fds[0], &step, sizeof step) == (ssize_t)sizeof step) done = step;
        close(fds[0]);
        if (!WIFSIGNALED(st)) {
            DSK_TEST_EXPECT(0, "trial %d: the writer exited by itself with status %d", t,
                            WIFEXITED(st) ? WEXITSTATUS(st) : -1);
            failures++;
            continue;
        }
        DSK_TEST_OK(dsk_ckpt_latest(dir, &latest));
        /* every reported step is durable; at most the one in flight completed unreported */
        if (done >= 0)
            DSK_TEST_EXPECT(latest == done || latest == done + 1, "trial %d: latest %lld after step %lld was reported",
                            t, (long long)latest, (long long)done);
        else
            DSK_TEST_EXPECT(latest == prev_latest || latest == prev_latest + 1, "trial %d: latest %lld, before %lld", t,
                            (long long)latest, (long long)prev_latest);
        if (latest >= 0 && kill_check(dir, latest, inc) != 0) {
            DSK_TEST_EXPECT(0, "trial %d: latest step %lld is wrong", t, (long long)latest);
            failures++;
        }
        if (verify_all_complete(dir) != 0) {
            DSK_TEST_EXPECT(0, "trial %d: a complete checkpoint does not verify", t);
            failures++;
        }
        /* what a killed save leaves is reclaimed by the next writer (issue 17, reclaiming):
           it never grows beyond one save's worth, however many kills came before */
        garbage = count_garbage(dir);
        if (getenv("DSK_TEST_DEBUG")) printf("     trial %d: garbage %d latest %lld\n", t, garbage, (long long)latest);
        if (garbage > 0) mid_save++;
        /* one killed save leaves its own files and temporaries, and a rotation cut short the
           files of the checkpoint it dropped (with incremental saves, and of the earlier saves
           only that one referenced) */
        DSK_TEST_EXPECT(garbage <= (inc ? 12 : 6), "trial %d: %d leftover files and directories (they pile up)", t,
                        garbage);
        prev_latest = latest;
    }
    printf("     %d trials, %d killed with a save half-written, newest step %lld\n", trials, mid_save,
           (long long)prev_latest);
    DSK_TEST_EXPECT(mid_save >= trials / 6, "only %d of %d kills landed inside a save", mid_save, trials);
    DSK_TEST_EXPECT(prev_latest >= trials / 4, "only %lld checkpoints completed", (long long)prev_latest + 1);
    {
        dsk_ckpt ck;
        DSK_TEST_OK(dsk_ckpt_init(&ck, dir, NULL)); /* rank 0's init reclaims the last kill's leftovers */
        DSK_TEST_EXPECT(count_garbage(dir) == 0, "%d leftovers after init", count_garbage(dir));
        DSK_TEST_EXPECT(verify_all_complete(dir) == 0, "a complete checkpoint does not verify after reclaiming");
        dsk_ckpt_free(&ck);
    }
}

static void test_sigkill_during_save(void) {
    dsk_test_begin("writers killed mid-save");
    sigkill_case(60, 0);
    dsk_test_begin("writers killed mid-save, incremental saves");
    sigkill_case(40, 1);
    dsk_test_end();
}

/* ------------------------------------------------------------ reclaiming */

/* A child holding DIR/.lock for `seconds`, as a live writer does. */
static pid_t hold_lock(const char *dir, int seconds) {
    int ready[2];
    pid_t pid;
    char c;
    if (pipe(ready) != 0) return -1;
    fflush(stdout);
    if ((pid = fork()) == 0) {
        char path[600];
        struct flock fl;
        int fd;
        snprintf(path, sizeof path, "%s/.lock", dir);
        fd = open(path, O_RDWR | O_CREAT, 0644);
        memset(&fl, 0, sizeof fl);
        fl.l_type = F_WRLCK;
        if (fd < 0 || fcntl(fd, F_SETLK, &fl) != 0 || ftruncate(fd, 0) != 0) _exit(1);
        if (pwrite(fd, "pid 42 on testhost\n", 19, 0) != 19) _exit(1);
        if (write(ready[1], "x", 1) != 1) _exit(1);
        sleep((unsigned)seconds);
        _exit(0);
    }
    close(ready[1]);
    if (read(ready[0], &c, 1) != 1) pid = -1;
    close(ready[0]);
    return pid;
}

/* A second handle in the same process while a save holds the lock (the lock belongs to the
   open file, not the process): its init reclaims nothing of the live save and its save is
   refused. The first save's barrier, called with the lock held, does it. */
typedef struct inproc {
    const char *dir;
    dsk_tensor *a;
    int calls, dir_kept, refused;
} inproc;

static dsk_status inproc_barrier(void *user) {
    inproc *q = (inproc *)user;
    dsk_ckpt ck2;
    dsk_ckpt_entry e = {"a", q->a, 0, 0, 0, NULL, NULL};
    if (q->calls++ > 0) return DSK_OK;
    if (dsk_ckpt_init(&ck2, q->dir, NULL) != DSK_OK) return DSK_ERR_IO;
    q->dir_kept = step_dir_exists(q->dir, 7, 0);
    q->refused = dsk_ckpt_save(&ck2, 8, &e, 1, NULL, 0) == DSK_ERR_STATE &&
                 strstr(dsk_last_error(), "is locked by another writer") != NULL;
    dsk_ckpt_free(&ck2);
    return dsk_set_error(DSK_ERR_PEER, "test barrier: the other rank is not there");
}

static void test_lock_same_process(void) {
    char dir[400];
    const int64_t s1[1] = {20};
    dsk_tensor a;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    dsk_ckpt_entry e = {"a", &a, 0, 0, 0, NULL, NULL};
    inproc q;
    new_dir(dir, sizeof dir, "lockproc");
    alloc_t(&a, DSK_F32, 1, s1);
    fill_f32(&a);
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, NULL));
    DSK_TEST_OK(dsk_ckpt_save(&ck, 5, &e, 1, NULL, 0));
    dsk_ckpt_free(&ck);
    memset(&q, 0, sizeof q);
    q.dir = dir;
    q.a = &a;
    memset(&o, 0, sizeof o);
    o.world_size = 2;
    o.barrier = inproc_barrier;
    o.barrier_user = &q;
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, &o));
    DSK_TEST_STATUS(dsk_ckpt_save(&ck, 7, &e, 1, NULL, 0), DSK_ERR_PEER);
    dsk_ckpt_free(&ck);
    DSK_TEST_EXPECT(q.calls >= 1, "the barrier was not called");
    DSK_TEST_EXPECT(q.dir_kept, "a second handle's init reclaimed the live save's step directory");
    DSK_TEST_EXPECT(q.refused, "a second handle in the same process saved while the first held the lock");
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, NULL)); /* the lock was released with the first handle */
    DSK_TEST_OK(dsk_ckpt_save(&ck, 9, &e, 1, NULL, 0));
    dsk_ckpt_free(&ck);
    dsk_tensor_free(NULL, &a);
}

/* Space is reclaimed from what dead saves leave (issue 17): at init, incomplete step
   directories older and newer than the newest complete checkpoint and unreferenced files go,
   a directory with a damaged manifest and files dsk did not name stay; while another writer
   holds the lock nothing is touched and a save is refused; shards a failed manifest left are
   reclaimed by the next save. */
static void test_reclaim(void) {
    char dir[400], p[700], sd[600], keep[700];
    const int64_t s1[1] = {33};
    dsk_tensor a, back;
    dsk_ckpt ck;
    dsk_ckpt_entry e = {"a", &a, 0, 0, 0, NULL, NULL}, le = {"a", &back, 0, 0, 0, NULL, NULL};
    pid_t holder;
    int st = 0;
    new_dir(dir, sizeof dir, "reclaim");
    alloc_t(&a, DSK_F32, 1, s1);
    fill_f32(&a);
    alloc_t(&back, DSK_F32, 1, s1);
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, NULL));
    DSK_TEST_OK(dsk_ckpt_save(&ck, 10, &e, 1, NULL, 0));
    DSK_TEST_OK(dsk_ckpt_save(&ck, 20, &e, 1, NULL, 0));
    dsk_ckpt_free(&ck);
    /* the leftovers of dead saves: step 5 (older) and 30 (newer) without a manifest, a file of a
       dropped save and a temporary inside complete step 20, temporaries in DIR */
    for (int k = 0; k < 2; k++) {
        snprintf(sd, sizeof sd, "%s/step_%08d", dir, k ? 30 : 5);
        mkdir(sd, 0755);
        snprintf(p, sizeof p, "%s/rank_00000.00000000000000c%d.safetensors", sd, k);
        write_file(p, "partial", 7);
        snprintf(p, sizeof p, "%s/.rank_00001.00000000000000c%d.safetensors.tmp", sd, k);
        write_file(p, "partial", 7);
    }
    snprintf(p, sizeof p, "%s/step_00000020/rank_00000.00000000000000d1.safetensors", dir);
    write_file(p, "old", 3);
    snprintf(p, sizeof p, "%s/step_00000020/.manifest.json.tmp", dir);
    write_file(p, "{", 1);
    snprintf(p, sizeof p, "%s/.latest.tmp", dir);
    write_file(p, "x", 1);
    /* left alone: a step directory whose manifest is damaged, and a file of the user's */
    snprintf(sd, sizeof sd, "%s/step_00000040", dir);
    mkdir(sd, 0755);
    snprintf(p, sizeof p, "%s/manifest.json", sd);
    write_file(p, "{\"format\":", 10);
    snprintf(p, sizeof p, "%s/rank_00000.00000000000000e1.safetensors", sd);
    write_file(p, "data", 4);
    snprintf(keep, sizeof keep, "%s/step_00000010/notes.txt", dir);
    write_file(keep, "mine", 4);
    DSK_TEST_EXPECT(count_garbage(dir) == 9, "%d leftovers arranged, want 9", count_garbage(dir));
    /* a live writer holds the lock: init touches nothing, a save is refused with its name */
    holder = hold_lock(dir, 30);
    DSK_TEST_EXPECT(holder > 0, "lock holder did not start");
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, NULL));
    DSK_TEST_EXPECT(count_garbage(dir) == 9, "init reclaimed under another writer's lock (%d left)",
                    count_garbage(dir));
    DSK_TEST_STATUS(dsk_ckpt_save(&ck, 21, &e, 1, NULL, 0), DSK_ERR_STATE);
    DSK_TEST_ERROR_MENTIONS("is locked by another writer (pid 42 on testhost)");
    dsk_ckpt_free(&ck);
    kill(holder, SIGKILL);
    waitpid(holder, &st, 0);
    /* the writer died: init reclaims */
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, NULL));
    DSK_TEST_EXPECT(count_garbage(dir) == 0, "%d leftovers after init", count_garbage(dir));
    DSK_TEST_EXPECT(!step_dir_exists(dir, 5, 0) && !step_dir_exists(dir, 30, 0),
                    "incomplete step directories not removed");
    snprintf(p, sizeof p, "%s/rank_00000.00000000000000e1.safetensors", sd);
    DSK_TEST_EXPECT(access(p, F_OK) == 0 && access(keep, F_OK) == 0,
                    "a damaged checkpoint's file or the user's file was removed");
    DSK_TEST_OK(dsk_ckpt_load(&ck, 10, &le, 1, NULL));
    DSK_TEST_OK(dsk_ckpt_load(&ck, 20, &le, 1, NULL));
    DSK_TEST_SAME_BYTES(back.data, a.data, dsk_tensor_nbytes(&a), "step 20 after reclaiming");
    /* a manifest that cannot be written (a directory in its temporary's place, as a full disk
       would) leaves step 25's shards; the next save reclaims them */
    snprintf(sd, sizeof sd, "%s/step_00000025", dir);
    mkdir(sd, 0755);
    snprintf(p, sizeof p, "%s/.manifest.json.tmp", sd);
    mkdir(p, 0755);
    DSK_TEST_STATUS(dsk_ckpt_save(&ck, 25, &e, 1, NULL, 0), DSK_ERR_IO);
    rank_file(sd, 0, keep, sizeof keep);
    DSK_TEST_EXPECT(keep[0] != 0, "the failed save left no shard to reclaim");
    rmdir(p);
    DSK_TEST_OK(dsk_ckpt_save(&ck, 26, &e, 1, NULL, 0));
    DSK_TEST_EXPECT(access(keep, F_OK) != 0 && !step_dir_exists(dir, 25, 0),
                    "the failed save's shards were not reclaimed");
    DSK_TEST_EXPECT(count_garbage(dir) == 0, "%d leftovers after the next save", count_garbage(dir));
    /* read_only: nothing is written, even a save */
    dsk_ckpt_free(&ck);
    {
        dsk_ckpt_opts o;
        memset(&o, 0, sizeof o);
        o.read_only = 1;
        DSK_TEST_OK(dsk_ckpt_init(&ck, dir, &o));
        DSK_TEST_STATUS(dsk_ckpt_save(&ck, 27, &e, 1, NULL, 0), DSK_ERR_STATE);
        DSK_TEST_ERROR_MENTIONS("was opened read_only");
        DSK_TEST_OK(dsk_ckpt_load(&ck, 26, &le, 1, NULL));
        dsk_ckpt_free(&ck);
    }
    dsk_tensor_free(NULL, &a);
    dsk_tensor_free(NULL, &back);
}

/* ------------------------------------------------------------ incremental checkpoints */

/* The chain's tensors at step k: F frozen (2 MB), C1 changing every step, C2 every other
   step, S (a scalar) every step. */
typedef struct inc_model {
    dsk_tensor f, c1, c2, sc;
} inc_model;

static void inc_model_init(inc_model *m) {
    const int64_t sf[2] = {512, 1024}, s1[2] = {33, 64}, s2[1] = {150007};
    alloc_t(&m->f, DSK_F32, 2, sf);
    alloc_t(&m->c1, DSK_F32, 2, s1);
    alloc_t(&m->c2, DSK_BF16, 1, s2);
    alloc_t(&m->sc, DSK_I64, 0, NULL);
}
static void inc_model_free(inc_model *m) {
    dsk_tensor_free(NULL, &m->f);
    dsk_tensor_free(NULL, &m->c1);
    dsk_tensor_free(NULL, &m->c2);
    dsk_tensor_free(NULL, &m->sc);
}
static void inc_content(inc_model *m, int64_t k) {
    dsk_tensor_uniform(NULL, &m->f, 77, 0, -1.0f, 1.0f);
    dsk_tensor_uniform(NULL, &m->c1, (uint64_t)k + 100, 0, -1.0f, 1.0f);
    dsk_tensor_uniform(NULL, &m->c2, (uint64_t)(k - k % 2) + 200, 0, -1.0f, 1.0f);
    *(int64_t *)m->sc.data = k * 7919;
}
static void inc_entries(inc_model *m, dsk_ckpt_entry e[4]) {
    memset(e, 0, 4 * sizeof *e);
    e[0].name = "F"; e[0].tensor = &m->f;
    e[1].name = "C1"; e[1].tensor = &m->c1;
    e[2].name = "C2"; e[2].tensor = &m->c2;
    e[3].name = "S"; e[3].tensor = &m->sc;
}
/* 0 when checkpoint `step` loads bitwise as inc_content(step). */
static int inc_check(dsk_ckpt *ck, int64_t step) {
    inc_model want, got;
    dsk_ckpt_entry e[4];
    int bad;
    inc_model_init(&want);
    inc_model_init(&got);
    inc_content(&want, step);
    inc_entries(&got, e);
    if (dsk_ckpt_load(ck, step, e, 4, NULL) != DSK_OK) {
        printf("     step %lld: %s\n", (long long)step, dsk_last_error());
        bad = 1;
    } else
        bad = memcmp(want.f.data, got.f.data, dsk_tensor_nbytes(&want.f)) ||
              memcmp(want.c1.data, got.c1.data, dsk_tensor_nbytes(&want.c1)) ||
              memcmp(want.c2.data, got.c2.data, dsk_tensor_nbytes(&want.c2)) || memcmp(want.sc.data, got.sc.data, 8);
    inc_model_free(&want);
    inc_model_free(&got);
    return bad;
}

/* A chain of 10 incremental saves writes only what changed (bytes reported), every link
   loads bitwise, rotation keeps the files a live checkpoint references, and merging compacts
   a checkpoint into its own directory, after which the first save's file is reclaimed. */
static void test_incremental_chain(void) {
    char dir[400];
    inc_model m;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    dsk_ckpt_entry e[4];
    dsk_ckpt_info info[12];
    uint64_t bf, b1, b2, total_written = 0, total_full = 0;
    int n = 0;
    memset(&o, 0, sizeof o);
    o.incremental = 1;
    new_dir(dir, sizeof dir, "inc");
    inc_model_init(&m);
    inc_entries(&m, e);
    bf = dsk_tensor_nbytes(&m.f);
    b1 = dsk_tensor_nbytes(&m.c1);
    b2 = dsk_tensor_nbytes(&m.c2);
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, &o));
    for (int64_t k = 1; k <= 10; k++) {
        const dsk_ckpt_save_info *info;
        uint64_t want = k == 1 ? bf + b1 + b2 + 8 : b1 + 8 + (k % 2 == 0 ? b2 : 0);
        inc_content(&m, k);
        DSK_TEST_OK(dsk_ckpt_save(&ck, k, e, 4, NULL, 0));
        info = dsk_ckpt_last_save(&ck);
        DSK_TEST_EXPECT(info->bytes_written == want && info->bytes_written + info->bytes_reused == bf + b1 + b2 + 8,
                        "step %lld: wrote %llu bytes, reused %llu; want %llu written", (long long)k,
                        (unsigned long long)info->bytes_written, (unsigned long long)info->bytes_reused,
                        (unsigned long long)want);
        total_written += info->bytes_written;
        total_full += bf + b1 + b2 + 8;
    }
    printf("     10 incremental saves wrote %.2f MB where full saves write %.2f MB\n", total_written / 1e6,
           total_full / 1e6);
    for (int64_t k = 1; k <= 10; k++)
        DSK_TEST_EXPECT(inc_check(&ck, k) == 0, "step %lld does not load as saved", (long long)k);
    DSK_TEST_OK(dsk_ckpt_verify(dir, 10));
    DSK_TEST_OK(dsk_ckpt_list(dir, info, 12, &n));
    DSK_TEST_EXPECT(n == 10 && info[0].step == 10 && info[0].n_files == 2,
                    "step 10 reads %d files, want 2 (its own, step 1's for F)", info[0].n_files);
    DSK_TEST_EXPECT(info[1].step == 9 && info[1].n_files == 3,
                    "step 9 reads %d files, want 3 (its own, step 8's for C2, step 1's for F)", info[1].n_files);
    dsk_ckpt_free(&ck);
    /* rotation to the 3 most recent: step 1's manifest goes, its file (F) stays for 9..11 */
    o.keep_last = 3;
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, &o));
    inc_content(&m, 11);
    DSK_TEST_OK(dsk_ckpt_save(&ck, 11, e, 4, NULL, 0));
    DSK_TEST_OK(dsk_ckpt_list(dir, info, 12, &n));
    DSK_TEST_EXPECT(n == 3 && info[2].step == 9, "after rotation %d checkpoints, oldest %lld", n,
                    (long long)info[2].step);
    DSK_TEST_EXPECT(step_dir_exists(dir, 1, 0) && !step_dir_exists(dir, 1, 1) && !step_dir_exists(dir, 5, 0),
                    "step 1's directory must stay (it holds F), without its manifest; step 5 must go");
    DSK_TEST_EXPECT(count_garbage(dir) == 0, "%d leftovers after rotation", count_garbage(dir));
    for (int64_t k = 9; k <= 11; k++) DSK_TEST_EXPECT(inc_check(&ck, k) == 0, "step %lld after rotation", (long long)k);
    /* merging 9, 10 and 11: each self-contained, and step 1's file unreferenced, reclaimed */
    for (int64_t k = 9; k <= 11; k++) DSK_TEST_OK(dsk_ckpt_merge(&ck, k));
    DSK_TEST_OK(dsk_ckpt_list(dir, info, 12, &n));
    DSK_TEST_EXPECT(n == 3 && info[0].step == 11 && info[0].n_files == 1 && info[0].generation == 11,
                    "merged: %d checkpoints, newest %lld with %d files, generation %llu", n, (long long)info[0].step,
                    info[0].n_files, (unsigned long long)info[0].generation);
    DSK_TEST_EXPECT(!step_dir_exists(dir, 1, 0), "step 1's directory not reclaimed after merging");
    for (int64_t k = 9; k <= 11; k++) {
        DSK_TEST_EXPECT(inc_check(&ck, k) == 0, "step %lld after merging", (long long)k);
        DSK_TEST_OK(dsk_ckpt_verify(dir, k));
    }
    DSK_TEST_EXPECT(count_garbage(dir) == 0, "%d leftovers after merging", count_garbage(dir));
    /* the next incremental save builds on a merged checkpoint just as well */
    inc_content(&m, 12);
    DSK_TEST_OK(dsk_ckpt_save(&ck, 12, e, 4, NULL, 0));
    DSK_TEST_EXPECT(dsk_ckpt_last_save(&ck)->bytes_written == b1 + b2 + 8, "step 12 wrote %llu bytes",
                    (unsigned long long)dsk_ckpt_last_save(&ck)->bytes_written);
    DSK_TEST_EXPECT(inc_check(&ck, 12) == 0, "step 12");
    DSK_TEST_STATUS(dsk_ckpt_merge(&ck, 4), DSK_ERR_ARG); /* its directory was reclaimed */
    DSK_TEST_ERROR_MENTIONS("there is no checkpoint of step 4");
    dsk_ckpt_free(&ck);
    inc_model_free(&m);
}

/* Incremental saves on 2 ranks (split and whole tensors, some frozen) load on 3 ranks, and
   each rank reports its own bytes. */
static int inc_save_rank(int rank, int world, void *p) {
    mr_arg *m = (mr_arg *)p;
    fbar b;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    dsk_ckpt_entry e[5];
    dsk_tensor own[5];
    char pos[32];
    dsk_ckpt_kv kv[1] = {{"data_pos", pos}};
    dsk_status s;
    int bad = 0;
    fagree_opts(&o, &b, m->bar, rank, world);
    o.incremental = 1;
    snprintf(pos, sizeof pos, "%d", 1000 + rank);
    rank_entries(m->g, rank, world, 0, e, own);
    if ((s = dsk_ckpt_init(&ck, m->dir, &o)) == DSK_OK) s = dsk_ckpt_save(&ck, m->step, e, 5, kv, 1);
    /* the second save: only moe.w2 changes (this rank's rows of it) */
    for (int64_t i = 0; s == DSK_OK && i < dsk_tensor_numel(&own[1]); i++) ((uint16_t *)own[1].data)[i] ^= 0x1111;
    if (s == DSK_OK) s = dsk_ckpt_save(&ck, m->step + 1, e, 5, kv, 1);
    if (s != DSK_OK) { printf("     rank %d: %s\n", rank, dsk_last_error()); bad = 1;
    } else if (dsk_ckpt_last_save(&ck)->bytes_written != dsk_tensor_nbytes(&own[1]) ||
               dsk_ckpt_last_save(&ck)->tensors_written != 1) {
        printf("     rank %d: wrote %llu bytes in %d tensors\n", rank,
               (unsigned long long)dsk_ckpt_last_save(&ck)->bytes_written, dsk_ckpt_last_save(&ck)->tensors_written);
        bad = 1;
    }
    dsk_ckpt_free(&ck);
    return bad;
}

static void test_incremental_multi_rank(void) {
    model g;
    mr_arg m;
    mr_setup(&m, &g, 10, 30, 2, "incmr");
    DSK_TEST_EXPECT(run_ranks(2, inc_save_rank, &m) == 0, "incremental saves on 2 ranks");
    for (int64_t i = 0; i < dsk_tensor_numel(&g.w2); i++) ((uint16_t *)g.w2.data)[i] ^= 0x1111; /* what step 31 holds */
    m.step = 31;
    DSK_TEST_EXPECT(run_ranks(3, mr_load, &m) == 0, "3 ranks loading the incremental step 31");
    DSK_TEST_OK(dsk_ckpt_verify(m.dir, 31));
    model_free(&g);
}

/* ------------------------------------------------------------ bad arguments */

static void test_bad_arguments(void) {
    char dir[400];
    const int64_t s1[1] = {4};
    dsk_tensor a, nodata;
    dsk_ckpt ck, zero;
    dsk_ckpt_opts o;
    dsk_ckpt_entry e[2] = {{"a", &a, 0, 0, 0, NULL, NULL}, {"a", &a, 0, 0, 0, NULL, NULL}};
    dsk_ckpt_kv kv[2] = {{"k", "v"}, {"k", "w"}};
    dsk_ckpt_meta zm;
    new_dir(dir, sizeof dir, "args");
    alloc_t(&a, DSK_F32, 1, s1); fill_f32(&a);
    memset(&o, 0, sizeof o);
    memset(&zero, 0, sizeof zero);
    memset(&zm, 0, sizeof zm);
    dsk_ckpt_free(&zero);
    dsk_ckpt_free(NULL);
    dsk_ckpt_meta_free(&zm);
    DSK_TEST_STATUS(dsk_ckpt_init(&ck, NULL, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("dsk_ckpt_init: directory is NULL");
    o.rank = 2; o.world_size = 2;
    DSK_TEST_STATUS(dsk_ckpt_init(&ck, dir, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("rank 2 outside world size 2");
    o.rank = 0;
    DSK_TEST_STATUS(dsk_ckpt_init(&ck, dir, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("needs a barrier or an agree callback");
    o.world_size = 1; o.keep_last = -1;
    DSK_TEST_STATUS(dsk_ckpt_init(&ck, dir, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("keep_last -1");
    o.keep_last = 0; o.snapshot_threads = -2;
    DSK_TEST_STATUS(dsk_ckpt_init(&ck, dir, &o), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("snapshot_threads -2 outside [0, 1024]");
    o.snapshot_threads = 0;
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, &o));
    DSK_TEST_STATUS(dsk_ckpt_save(&ck, -1, e, 1, NULL, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("step -1 < 0");
    DSK_TEST_STATUS(dsk_ckpt_save(&ck, 1, NULL, 1, NULL, 0), DSK_ERR_ARG);
    DSK_TEST_STATUS(dsk_ckpt_save(&ck, 1, e, 2, NULL, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("tensor name \"a\" appears twice");
    e[1].name = "__metadata__";
    DSK_TEST_STATUS(dsk_ckpt_save(&ck, 1, e, 2, NULL, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("\"__metadata__\" is reserved");
    e[1].name = "";
    DSK_TEST_STATUS(dsk_ckpt_save(&ck, 1, e, 2, NULL, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("entry 1 has no name");
    e[1].name = "b"; e[1].tensor = NULL;
    DSK_TEST_STATUS(dsk_ckpt_save(&ck, 1, e, 2, NULL, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("tensor \"b\" is NULL");
    memset(&nodata, 0, sizeof nodata);
    nodata.ndim = 1; nodata.shape[0] = 3; nodata.stride[0] = 1;
    e[1].tensor = &nodata;
    DSK_TEST_STATUS(dsk_ckpt_save(&ck, 1, e, 2, NULL, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("tensor \"b\" has no data");
    e[1].tensor = &a; e[1].split = 1; e[1].row0 = 2; e[1].global_rows = 5;
    DSK_TEST_STATUS(dsk_ckpt_save(&ck, 1, e, 2, NULL, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("rows [2, 6) do not fit a split tensor of 5 rows");
    e[1].split = 3;
    DSK_TEST_STATUS(dsk_ckpt_save(&ck, 1, e, 2, NULL, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("split 3 is none of DSK_CKPT_WHOLE, DSK_CKPT_ROWS, DSK_CKPT_BOX");
    e[1].split = DSK_CKPT_BOX;
    DSK_TEST_STATUS(dsk_ckpt_save(&ck, 1, e, 2, NULL, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("a DSK_CKPT_BOX entry needs offset and global_shape");
    {
        const int64_t off[1] = {1}, whole[1] = {4};
        e[1].offset = off;
        e[1].global_shape = whole;
        DSK_TEST_STATUS(dsk_ckpt_save(&ck, 1, e, 2, NULL, 0), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("dim 0: [1, 5) does not fit the whole tensor's 4");
        e[1].offset = e[1].global_shape = NULL;
    }
    DSK_TEST_STATUS(dsk_ckpt_save(&ck, 1, e, 1, kv, 2), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("key \"k\" appears twice");
    kv[1].key = "dsk.step";
    DSK_TEST_STATUS(dsk_ckpt_save(&ck, 1, e, 1, kv, 2), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("the prefix \"dsk.\" is reserved");
    kv[1].key = "x"; kv[1].value = NULL;
    DSK_TEST_STATUS(dsk_ckpt_save(&ck, 1, e, 1, kv, 2), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("NULL value");
    {
        dsk_tensor fake = a; /* claims to live on a CUDA device; no ctx given */
        fake.device.type = DSK_DEV_CUDA;
        e[1].tensor = &fake; e[1].split = 0;
        DSK_TEST_STATUS(dsk_ckpt_save(&ck, 1, e, 2, NULL, 0), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("tensor \"b\" is on device type 1 index 0: pass a ctx on that CUDA device");
        e[1].tensor = &a;
    }
    DSK_TEST_STATUS(dsk_ckpt_save(&zero, 1, e, 1, NULL, 0), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("not initialised");
    DSK_TEST_STATUS(dsk_ckpt_load(&zero, 1, e, 1, NULL), DSK_ERR_ARG);
    DSK_TEST_STATUS(dsk_ckpt_latest(NULL, NULL), DSK_ERR_ARG);
    DSK_TEST_STATUS(dsk_ckpt_verify(dir, -3), DSK_ERR_ARG);
    dsk_ckpt_free(&ck);
    dsk_tensor_free(NULL, &a);
}

/* ------------------------------------------------------------ main */

int main(void) {
    dsk_test_init("test_ckpt");
    if (!scratch_init("dsk_ckpt_test")) {
        printf("cannot create a scratch directory\n");
        return 1;
    }
    DSK_TEST_RUN(test_content_hash);
#ifndef DSK_CKPT_NO_HF
    DSK_TEST_RUN(test_hf_deepseek_names);
#endif
    DSK_TEST_RUN(test_options);
    DSK_TEST_RUN(test_ckpt_single_rank);
    test_multi_rank_1_2_3_4();
    DSK_TEST_RUN(test_multi_rank_async);
    test_reshard();
    DSK_TEST_RUN(test_multi_rank_inconsistent);
    DSK_TEST_RUN(test_failed_rank_with_stale_file);
    test_collective_outcome();
    DSK_TEST_RUN(test_reshard_any_dim);
    DSK_TEST_RUN(test_several_boxes_per_rank);
    DSK_TEST_RUN(test_several_boxes_errors);
    DSK_TEST_RUN(test_async_overwrite);
    DSK_TEST_RUN(test_async_error);
    DSK_TEST_RUN(test_reads_during_async_save);
    DSK_TEST_RUN(test_resave_keeps_old);
    DSK_TEST_RUN(test_resave_multi_rank);
    DSK_TEST_RUN(test_latest_pointer_failure);
    DSK_TEST_RUN(test_rotation);
    DSK_TEST_RUN(test_reclaim);
    DSK_TEST_RUN(test_lock_same_process);
    DSK_TEST_RUN(test_latest_skips_incomplete);
    DSK_TEST_RUN(test_latest_after_rollback);
    DSK_TEST_RUN(test_load_falls_back);
    DSK_TEST_RUN(test_resume_example_falls_back);
    DSK_TEST_RUN(test_load_counts_damaged_manifest);
    DSK_TEST_RUN(test_load_missing_step);
    DSK_TEST_RUN(test_fifo_does_not_hang);
    DSK_TEST_RUN(test_huge_steps);
    DSK_TEST_RUN(test_latest_reports_read_errors);
    DSK_TEST_RUN(test_flipped_checkpoint_headers);
    DSK_TEST_RUN(test_checkpoint_damage);
    DSK_TEST_RUN(test_verify_checks_manifest);
    DSK_TEST_RUN(test_full_disk);
    DSK_TEST_RUN(test_incremental_chain);
    DSK_TEST_RUN(test_incremental_multi_rank);
    test_sigkill_during_save();
    DSK_TEST_RUN(test_bad_arguments);
    scratch_remove();
    return dsk_test_finish();
}
