/* st_tool.c - the dsk side of tests/interop/test_interop.sh.
     st_tool write DIR   writes safetensors files and a checkpoint with dsk, plus the raw bytes
                         of every tensor (plain fwrite) and an index for the Python checker
     st_tool hf-read DIR reads the DeepSeek-layout sharded model Python wrote, experts stacked
     st_tool hf-write DIR exports stacked experts in that layout, sharded, for Python to check
   Prints one "ok <case>" or "FAIL <case>: <why>" line per case. The files Python writes are
   read by tests/test_safetensors.c (dsk_safetensors.h alone), which the script runs on them. */
#define DSK_TENSOR_IMPLEMENTATION
#define DSK_CKPT_IMPLEMENTATION
#include "dsk_tensor.h"
#include "dsk_ckpt.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static int failures;

static void report(int ok, const char *what, const char *why) {
    if (ok) printf("ok   %s\n", what);
    else { printf("FAIL %s: %s\n", what, why); failures++; }
}

/* safetensors dtype names, written out independently of dsk_ckpt.h's table. */
static const char *st_name(dsk_dtype dt) {
    switch (dt) {
    case DSK_F32: return "F32";
    case DSK_F16: return "F16";
    case DSK_BF16: return "BF16";
    case DSK_E4M3: return "F8_E4M3";
    case DSK_E5M2: return "F8_E5M2";
    case DSK_F64: return "F64";
    case DSK_I32: return "I32";
    case DSK_I64: return "I64";
    case DSK_U8: return "U8";
    default: return "?";
    }
}
static int numpy_native(dsk_dtype dt) {
    return dt == DSK_F32 || dt == DSK_F16 || dt == DSK_F64 || dt == DSK_I32 || dt == DSK_I64 || dt == DSK_U8;
}

/* The values both sides compute: floats sin(0.37 i + 0.11 k) * 3, ints (7 i + 3 k) mod 200
   (minus 100 for signed types). The Python checker has its own copy of this formula. */
static double value(dsk_dtype dt, int64_t i, int k) {
    if (dsk_dtype_is_float(dt)) return sin(0.37 * (double)i + 0.11 * k) * 3.0;
    return (double)((7 * i + 3 * k) % 200) - (dt == DSK_U8 ? 0 : 100);
}

static int write_raw(const char *dir, const char *name, const void *p, size_t n) {
    char path[1024];
    FILE *f;
    snprintf(path, sizeof path, "%s/expect/%s.bin", dir, name);
    if (!(f = fopen(path, "wb"))) return 0;
    if (n && fwrite(p, 1, n, f) != n) { fclose(f); return 0; }
    return fclose(f) == 0;
}

#define N_SHAPES 5
static const int64_t k_shapes[N_SHAPES][3] = {{0}, {0}, {7}, {3, 5}, {2, 3, 4}};
static const int k_ndims[N_SHAPES] = {0, 1, 1, 2, 3};

static int do_write(const char *dir) {
    dsk_tensor t[DSK_DTYPE_COUNT * N_SHAPES];
    dsk_ckpt_entry all[DSK_DTYPE_COUNT * N_SHAPES];
    dsk_safetensors_entry st_all[DSK_DTYPE_COUNT * N_SHAPES], np[DSK_DTYPE_COUNT * N_SHAPES];
    char names[DSK_DTYPE_COUNT * N_SHAPES][32], path[1024];
    dsk_ckpt_kv kv[2] = {{"purpose", "interop"}, {"unicode", "h\xc3\xa9llo \xe2\x9c\x93"}};
    int n = 0, n_np = 0;
    FILE *idx;
    dsk_ckpt ck;
    snprintf(path, sizeof path, "%s/expect", dir);
    mkdir(dir, 0755);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/index.txt", dir);
    if (!(idx = fopen(path, "w"))) { report(0, "write index", path); return 1; }
    for (int d = 0; d < DSK_DTYPE_COUNT; d++)
        for (int s = 0; s < N_SHAPES; s++, n++) {
            dsk_tensor f64;
            int64_t numel;
            dsk_dtype dt = (dsk_dtype)d;
            dsk_tensor_alloc(NULL, &t[n], dt, k_ndims[s], k_shapes[s]);
            dsk_tensor_alloc(NULL, &f64, DSK_F64, k_ndims[s], k_shapes[s]);
            numel = dsk_tensor_numel(&f64);
            for (int64_t i = 0; i < numel; i++) ((double *)f64.data)[i] = value(dt, i, n);
            dsk_tensor_copy(NULL, &t[n], &f64);
            dsk_tensor_free(NULL, &f64);
            snprintf(names[n], sizeof names[n], "%s.%d", dsk_dtype_name(dt), s);
            all[n].name = names[n];
            all[n].tensor = &t[n];
            all[n].split = 0;
            all[n].row0 = all[n].global_rows = 0;
            st_all[n].name = names[n];
            st_all[n].tensor = &t[n];
            if (numpy_native(dt)) np[n_np++] = st_all[n];
            fprintf(idx, "%s %s %d %d", names[n], st_name(dt), n, k_ndims[s]);
            for (int k = 0; k < k_ndims[s]; k++) fprintf(idx, " %lld", (long long)k_shapes[s][k]);
            fprintf(idx, "\n");
            if (!write_raw(dir, names[n], t[n].data, dsk_tensor_nbytes(&t[n]))) report(0, "write raw bytes", names[n]);
        }
    fclose(idx);
    snprintf(path, sizeof path, "%s/dsk_all.safetensors", dir);
    report(dsk_safetensors_save(NULL, path, st_all, n, kv, 2) == DSK_OK, "dsk writes every dtype", dsk_last_error());
    snprintf(path, sizeof path, "%s/dsk_numpy.safetensors", dir);
    report(dsk_safetensors_save(NULL, path, np, n_np, kv, 2) == DSK_OK, "dsk writes the numpy dtypes",
           dsk_last_error());
    snprintf(path, sizeof path, "%s/ckpt", dir);
    report(dsk_ckpt_init(&ck, path, NULL) == DSK_OK && dsk_ckpt_save(&ck, 42, all, n, kv, 2) == DSK_OK,
           "dsk writes a checkpoint", dsk_last_error());
    dsk_ckpt_free(&ck);
    for (int i = 0; i < n; i++) dsk_tensor_free(NULL, &t[i]);
    return failures != 0;
}

/* The DeepSeek-layout model of check_safetensors.py (hf_tensors): 4 experts, d 8, f 6. */
#define HF_E 4
#define HF_D 8
#define HF_F 6
#define HF_V 16

/* Bytes of file `name`.bin in dir/hf_expect, compared with n bytes at p. */
static int same_as_expect(const char *dir, const char *name, const void *p, size_t n) {
    char path[1200];
    unsigned char *want = (unsigned char *)malloc(n + 1);
    FILE *f;
    int ok;
    snprintf(path, sizeof path, "%s/hf_expect/%s.bin", dir, name);
    f = fopen(path, "rb");
    ok = f && want && fread(want, 1, n + 1, f) == n && memcmp(want, p, n) == 0;
    if (f) fclose(f);
    free(want);
    return ok;
}

/* The dsk side of the model: each layer's router, bias, stacked w1 w3 (E, F, D) and w2
   (E, D, F), shared w1 w3 (F, D) and w2 (D, F), plus the embedding. */
typedef struct hf_model {
    dsk_tensor t[2][8], embed;
    char names[2][8][160];
    dsk_safetensors_hf_entry e[17];
    int n;
} hf_model;

static void hf_model_init(hf_model *m, int fill) {
    static const char *params[8] = {"router", "bias", "w1", "w3", "w2", "shared.w1", "shared.w3", "shared.w2"};
    const int64_t shapes[8][3] = {{HF_E, HF_D},       {HF_E},       {HF_E, HF_F, HF_D}, {HF_E, HF_F, HF_D},
                                  {HF_E, HF_D, HF_F}, {HF_F, HF_D}, {HF_F, HF_D},       {HF_D, HF_F}};
    const int ndims[8] = {2, 1, 3, 3, 3, 2, 2, 2};
    const int64_t se[2] = {HF_V, HF_D};
    m->n = 0;
    for (int l = 0; l < 2; l++)
        for (int i = 0; i < 8; i++) {
            dsk_tensor *t = &m->t[l][i];
            dsk_safetensors_hf_entry *e = &m->e[m->n++];
            dsk_tensor_alloc(NULL, t, i < 2 ? DSK_F32 : DSK_BF16, ndims[i], shapes[i]);
            memset(t->data, 0xA5, dsk_tensor_nbytes(t));
            if (fill) {
                dsk_tensor f64;
                dsk_tensor_alloc(NULL, &f64, DSK_F64, ndims[i], shapes[i]);
                for (int64_t k = 0; k < dsk_tensor_numel(&f64); k++)
                    ((double *)f64.data)[k] = value(DSK_F32, k, 10 * l + i);
                dsk_tensor_copy(NULL, t, &f64);
                dsk_tensor_free(NULL, &f64);
            }
            dsk_ckpt_hf_deepseek_name(m->names[l][i], sizeof m->names[l][i], l + 1, params[i]);
            e->name = m->names[l][i];
            e->tensor = t;
            e->stacked = i >= 2 && i <= 4;
            e->expert0 = 0;
        }
    dsk_tensor_alloc(NULL, &m->embed, DSK_F32, 2, se);
    memset(m->embed.data, 0xA5, dsk_tensor_nbytes(&m->embed));
    if (fill)
        for (int64_t k = 0; k < HF_V * HF_D; k++) ((float *)m->embed.data)[k] = (float)value(DSK_F32, k, 99);
    m->e[m->n].name = "model.embed_tokens.weight";
    m->e[m->n].tensor = &m->embed;
    m->e[m->n].stacked = 0;
    m->e[m->n++].expert0 = 0;
}

static void hf_model_free(hf_model *m) {
    for (int l = 0; l < 2; l++)
        for (int i = 0; i < 8; i++) dsk_tensor_free(NULL, &m->t[l][i]);
    dsk_tensor_free(NULL, &m->embed);
}

/* Reads the model Python wrote in the DeepSeek layout, experts stacked as dsk keeps them,
   and compares every expert's rows with Python's bytes. */
static int do_hf_read(const char *dir) {
    hf_model m;
    dsk_safetensors_hf h;
    char name[200], why[1200];
    dsk_status s;
    hf_model_init(&m, 0);
    s = dsk_safetensors_hf_open(&h, dir);
    report(s == DSK_OK, "dsk opens the sharded model through its index", dsk_last_error());
    if (s == DSK_OK) {
        s = dsk_safetensors_hf_read(&h, NULL, m.e, m.n, 0);
        snprintf(why, sizeof why, "%s", dsk_last_error());
        report(s == DSK_OK && h.n_shards == 3,
               "dsk reads every tensor, per-expert ones into stacked (E, F, D) and (E, D, F)", why);
    }
    for (int i = 0; i < m.n && s == DSK_OK; i++) {
        const dsk_safetensors_hf_entry *e = &m.e[i];
        int64_t count = e->stacked ? e->tensor->shape[0] : 1;
        size_t per = dsk_tensor_nbytes(e->tensor) / (size_t)count;
        for (int64_t x = 0; x < count; x++) {
            const char *at = strstr(e->name, "{E}");
            if (e->stacked)
                snprintf(name, sizeof name, "%.*s%lld%s", (int)(at - e->name), e->name, (long long)x, at + 3);
            else snprintf(name, sizeof name, "%s", e->name);
            report(same_as_expect(dir, name, (const char *)e->tensor->data + x * per, per), name,
                   "bytes differ from Python's");
        }
    }
    dsk_safetensors_hf_close(&h);
    hf_model_free(&m);
    return failures != 0;
}

/* Exports the model in the DeepSeek layout in shards of at most 1 KB, with the bytes of each
   per-expert tensor and a list of names, dtypes and shapes for the Python checker. */
static int do_hf_write(const char *dir) {
    hf_model m;
    char path[1200], name[200];
    FILE *list;
    dsk_status s;
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/hf_expect", dir);
    mkdir(path, 0755);
    hf_model_init(&m, 1);
    s = dsk_safetensors_hf_save(NULL, dir, m.e, m.n, NULL, 0, 1024);
    report(s == DSK_OK, "dsk exports the stacked experts in the DeepSeek layout, sharded, with an index",
           dsk_last_error());
    snprintf(path, sizeof path, "%s/hf_list.txt", dir);
    if (!(list = fopen(path, "w"))) { report(0, "write hf_list.txt", path); hf_model_free(&m); return 1; }
    for (int i = 0; i < m.n; i++) {
        const dsk_safetensors_hf_entry *e = &m.e[i];
        int64_t count = e->stacked ? e->tensor->shape[0] : 1;
        size_t per = dsk_tensor_nbytes(e->tensor) / (size_t)count;
        for (int64_t x = 0; x < count; x++) {
            const char *at = strstr(e->name, "{E}");
            int nd = e->stacked ? e->tensor->ndim - 1 : e->tensor->ndim;
            const int64_t *sh = e->stacked ? e->tensor->shape + 1 : e->tensor->shape;
            if (e->stacked)
                snprintf(name, sizeof name, "%.*s%lld%s", (int)(at - e->name), e->name, (long long)x, at + 3);
            else snprintf(name, sizeof name, "%s", e->name);
            fprintf(list, "%s %s %d", name, st_name(e->tensor->dtype), nd);
            for (int d = 0; d < nd; d++) fprintf(list, " %lld", (long long)sh[d]);
            fprintf(list, "\n");
            snprintf(path, sizeof path, "%s/hf_expect/%s.bin", dir, name);
            {
                FILE *f = fopen(path, "wb");
                if (!f || fwrite((const char *)e->tensor->data + x * per, 1, per, f) != per)
                    report(0, "write expected bytes", path);
                if (f) fclose(f);
            }
        }
    }
    fclose(list);
    hf_model_free(&m);
    return failures != 0;
}

int main(int argc, char **argv) {
    if (argc != 3 || (strcmp(argv[1], "write") && strcmp(argv[1], "hf-read") && strcmp(argv[1], "hf-write"))) {
        fprintf(stderr, "usage: st_tool write|hf-read|hf-write DIR\n");
        return 2;
    }
    if (strcmp(argv[1], "hf-read") == 0) return do_hf_read(argv[2]);
    if (strcmp(argv[1], "hf-write") == 0) return do_hf_write(argv[2]);
    return do_write(argv[2]);
}
