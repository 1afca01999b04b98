/* test_hf.c - Hugging Face DeepSeek checkpoints in and out of the example model
   (dsk_ckpt.h's DeepSeek section, examples/train_hf.h), against the fixtures under tests/hf/
   that tests/hf/make_fixture.py wrote with transformers:
   - import -> forward: logits within 1e-5 (relative to the largest) of transformers' and the
     loss within 1e-6 relative, for DeepseekV3 (query latent, sigmoid noaux_tc, dense layer,
     shared expert) and DeepseekV2 (q_lora_rank null, softmax group_limited_greedy);
   - FP8 e4m3 + weight_scale_inv (16x16 blocks, partial edge blocks): every imported weight
     equals this file's own decoding of the e4m3 bits times the block's scale, bitwise;
   - export -> import is bitwise (f32), equals bf16 rounding (bf16) and the quantise-dequantise
     of the weights (fp8);
   - the v3 fixture's MTP layer into --mtp 1 (MoE FFN): every tensor bitwise, the MTP logits and
     loss against make_fixture.py's float64 computation of the layer; a missing or misshapen MTP
     tensor, or an MTP embed_tokens other than the model's, is named with nothing loaded;
   - bad input: unknown topk_method, missing key, a shard missing from the index, a tensor of
     the wrong shape, a truncated shard: each fails naming the file and key, nothing loaded. */
#define _DEFAULT_SOURCE /* truncate, mkdtemp: the library is linked, not included */
#include "dsk_ckpt.h"
#include "dsk_comm.h"
#include "dsk_moe.h"
/* the model header holds the trainer's backward and reports, which this test does not call */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include "examples/train_hf.h"
#pragma GCC diagnostic pop
#include "tests/dsk_test.h"
#include <unistd.h>

static dsk_ctx g_ctx;
static char g_tmp[256];
static int g_mtp; /* build: --mtp depth (MoE FFN) */

/* The model of fixture dir (B sequences of T tokens per forward), loaded. */
static dsk_status build(const char *dir, tm_model *m, dsk_ckpt_hf_deepseek_config *h, int B, int T, int load) {
    tm_config c;
    memset(&c, 0, sizeof c);
    memset(m, 0, sizeof *m); /* tm_free accepts it when a step below fails */
    DSK__TRY(dsk_ckpt_hf_deepseek_config_read(h, dir));
    c.seq = T;
    c.batch = B;
    c.cdt = DSK_F32;
    c.init_std = 0.02f;
    c.seed = 7;
    c.mla.mtp_depth = g_mtp;
    c.mla.mtp_moe = g_mtp > 0;
    c.mla.mtp_lambda = 0.3f;
    DSK__TRY(thf_model_config(h, &c));
    DSK__TRY(tm_init(m, &g_ctx, &c));
    return load ? thf_load(m, h, dir) : DSK_OK;
}

/* tokens (B, T + 1), logits (B, T, V), loss of the fixture's reference file. */
typedef struct ref {
    int32_t *tokens;
    float *logits;
    float loss;
    int64_t B, T, V;
} ref;

static void read_ref(const char *dir, ref *r) {
    char path[512];
    dsk_safetensors_file f;
    memset(&f, 0, sizeof f);
    snprintf(path, sizeof path, "%s/reference.safetensors", dir);
    DSK_TEST_OK(dsk_safetensors_open(&f, path));
    const dsk_safetensors_info *tk = &f.tensors[dsk_safetensors_find(&f, "tokens")];
    const dsk_safetensors_info *lg = &f.tensors[dsk_safetensors_find(&f, "logits")];
    r->B = tk->shape[0];
    r->T = tk->shape[1] - 1;
    r->V = lg->shape[2];
    r->tokens = (int32_t *)malloc((size_t)(r->B * (r->T + 1)) * 4);
    r->logits = (float *)malloc((size_t)(r->B * r->T * r->V) * 4);
    DSK_TEST_OK(dsk_safetensors_read_raw(&f, "tokens", NULL, tk->shape, r->tokens, (size_t)(r->B * (r->T + 1)) * 4));
    DSK_TEST_OK(dsk_safetensors_read_raw(&f, "logits", NULL, lg->shape, r->logits, (size_t)(r->B * r->T * r->V) * 4));
    DSK_TEST_OK(dsk_safetensors_read_raw(&f, "loss", NULL, NULL, &r->loss, 4));
    dsk_safetensors_close(&f);
}

/* Forward of the reference tokens: logits (poisoned first) and the mean cross-entropy. */
static void forward(tm_model *m, const ref *r, float *logits, float *loss) {
    int64_t N = r->B * r->T;
    int32_t *ids = (int32_t *)malloc((size_t)N * 4), *tg = (int32_t *)malloc((size_t)N * 4);
    for (int64_t b = 0; b < r->B; b++)
        for (int64_t t = 0; t < r->T; t++) {
            ids[b * r->T + t] = r->tokens[b * (r->T + 1) + t];
            tg[b * r->T + t] = r->tokens[b * (r->T + 1) + t + 1];
        }
    dsk_tensor hi, ht, hl, hs;
    DSK_TEST_OK(dsk_tensor_wrap(&hi, ids, DSK_I32, dsk_cpu(), 1, &N));
    DSK_TEST_OK(dsk_tensor_wrap(&ht, tg, DSK_I32, dsk_cpu(), 1, &N));
    DSK_TEST_OK(dsk_tensor_copy(&g_ctx, &m->ids, &hi));
    DSK_TEST_OK(dsk_tensor_copy(&g_ctx, &m->targets, &ht));
    DSK_TEST_OK(dsk_tensor_fill(&g_ctx, &m->logits, NAN));
    tm_set_eval(m, 1);
    DSK_TEST_OK(tm_forward(m, (int)r->B));
    DSK_TEST_OK(tm_loss(m, 1.0f));
    int64_t sh[2] = {N, r->V};
    DSK_TEST_OK(dsk_tensor_wrap(&hl, logits, DSK_F32, dsk_cpu(), 2, sh));
    DSK_TEST_OK(dsk_tensor_copy(&g_ctx, &hl, &m->logits));
    DSK_TEST_OK(dsk_tensor_wrap(&hs, loss, DSK_F32, dsk_cpu(), 0, NULL));
    DSK_TEST_OK(dsk_tensor_copy(&g_ctx, &hs, &m->loss));
    free(ids);
    free(tg);
}

/* The model of dir's config.json with the tensors of weights (dir itself, or another fixture's
   directory for a fixture of config and reference only) against dir's reference. */
static void check_fixture(const char *dir, const char *weights) {
    ref r;
    tm_model m;
    dsk_ckpt_hf_deepseek_config h;
    read_ref(dir, &r);
    DSK_TEST_OK(build(dir, &m, &h, (int)r.B, (int)r.T, 0));
    DSK_TEST_OK(thf_load(&m, &h, weights));
    int64_t n = r.B * r.T * r.V;
    float *got = (float *)malloc((size_t)n * 4), loss = NAN;
    double *want = (double *)malloc((size_t)n * 8), amax = 0;
    for (int64_t i = 0; i < n; i++) {
        want[i] = r.logits[i];
        amax = fmax(amax, fabs(want[i]));
    }
    forward(&m, &r, got, &loss);
    DSK_TEST_CLOSE(got, want, n, 0.0, 1e-5 * amax, "logits against transformers' (1e-5 of the largest)");
    double wl = r.loss;
    DSK_TEST_CLOSE(&loss, &wl, 1, 1e-6, 0.0, "loss against transformers' (1e-6 relative)");
    tm_free(&m);
    free(got);
    free(want);
    free(r.tokens);
    free(r.logits);
}

static void test_import_v3(void) { check_fixture("tests/hf/v3", "tests/hf/v3"); }

static int same_weights(const tm_model *a, const tm_model *b);

/* Reads float tensor `name` of reference.safetensors in dir into a fresh buffer of n floats. */
static float *read_ref_f32(const char *dir, const char *name, int64_t n) {
    char path[512];
    dsk_safetensors_file f;
    float *buf = (float *)malloc((size_t)n * 4);
    memset(&f, 0, sizeof f);
    snprintf(path, sizeof path, "%s/reference.safetensors", dir);
    DSK_TEST_OK(dsk_safetensors_open(&f, path));
    const dsk_safetensors_info *ti = &f.tensors[dsk_safetensors_find(&f, name)];
    DSK_TEST_OK(dsk_safetensors_read_raw(&f, name, NULL, ti->ndim ? ti->shape : NULL, buf, (size_t)n * 4));
    dsk_safetensors_close(&f);
    return buf;
}

/* --mtp 1 (MoE FFN) on the v3 fixture's MTP layer (model.layers.2.*): every tensor of that layer
   as the model exports it equals the fixture's bitwise (read again by name), and the MTP
   module's logits and loss equal make_fixture.py's float64 computation of the layer (1e-5). */
static void test_import_mtp(void) {
    ref r;
    tm_model m;
    dsk_ckpt_hf_deepseek_config h;
    thf_list t;
    dsk_safetensors_hf hf;
    int checked = 0;
    read_ref("tests/hf/v3", &r);
    g_mtp = 1;
    DSK_TEST_OK(build("tests/hf/v3", &m, &h, (int)r.B, (int)r.T, 0));
    g_mtp = 0;
    DSK_TEST_OK(dsk_tensor_fill(&g_ctx, &m.slab_w, NAN));
    DSK_TEST_OK(thf_load(&m, &h, "tests/hf/v3"));
    DSK_TEST_OK(thf_list_make(&m, 1, 2, &t));
    DSK_TEST_OK(dsk_safetensors_hf_open(&hf, "tests/hf/v3"));
    for (int i = 0; i < t.n; i++) {
        if (!strstr(t.es[i].name, "model.layers.2.")) continue;
        dsk_tensor want, got;
        dsk_safetensors_hf_entry e = t.es[i];
        DSK_TEST_OK(dsk_tensor_alloc(NULL, &want, DSK_F32, e.tensor->ndim, e.tensor->shape));
        DSK_TEST_OK(dsk_tensor_alloc(NULL, &got, DSK_F32, e.tensor->ndim, e.tensor->shape));
        DSK_TEST_OK(dsk_tensor_fill(NULL, &want, NAN));
        DSK_TEST_OK(dsk_tensor_copy(&g_ctx, &got, e.tensor));
        e.tensor = &want;
        DSK_TEST_OK(dsk_ckpt_hf_read_dequant(&hf, &g_ctx, &e, 1, h.block));
        DSK_TEST_EXPECT(memcmp(want.data, got.data, (size_t)dsk_tensor_numel(&got) * 4) == 0, "%s imported bitwise",
                        e.name);
        checked++;
        dsk_tensor_free(NULL, &want);
        dsk_tensor_free(NULL, &got);
    }
    dsk_safetensors_hf_close(&hf);
    thf_list_free(&t);
    DSK_TEST_EXPECT(checked >= 15, "%d MTP-layer tensors compared", checked);
    /* the MTP module's forward: inputs t_{i+1}, targets t_{i+2} of the reference tokens */
    int64_t N = r.B * r.T, V = r.V, T = r.T;
    float *lg = (float *)malloc((size_t)N * 4), loss = NAN, mloss = NAN;
    int32_t *ids = (int32_t *)malloc((size_t)N * 4), *tg = (int32_t *)malloc((size_t)N * 4);
    for (int64_t b = 0; b < r.B; b++)
        for (int64_t i = 0; i < T; i++) {
            ids[b * T + i] = r.tokens[b * (T + 1) + i];
            tg[b * T + i] = r.tokens[b * (T + 1) + i + 1];
        }
    dsk_tensor hi, ht, hs, hl;
    DSK_TEST_OK(dsk_tensor_wrap(&hi, ids, DSK_I32, dsk_cpu(), 1, &N));
    DSK_TEST_OK(dsk_tensor_wrap(&ht, tg, DSK_I32, dsk_cpu(), 1, &N));
    DSK_TEST_OK(dsk_tensor_copy(&g_ctx, &m.ids, &hi));
    DSK_TEST_OK(dsk_tensor_copy(&g_ctx, &m.targets, &ht));
    DSK_TEST_OK(dsk_tensor_fill(&g_ctx, &m.mla.mtp[0].logits, NAN));
    tm_set_eval(&m, 0);
    DSK_TEST_OK(tm_forward(&m, (int)r.B));
    DSK_TEST_OK(tm_loss(&m, 1.0f));
    DSK_TEST_OK(dsk_tensor_wrap(&hs, &mloss, DSK_F32, dsk_cpu(), 0, NULL));
    DSK_TEST_OK(dsk_tensor_copy(&g_ctx, &hs, &m.mla.mtp[0].loss));
    float *all = (float *)malloc((size_t)(N * V) * 4);
    int64_t sh[2] = {N, V};
    DSK_TEST_OK(dsk_tensor_wrap(&hl, all, DSK_F32, dsk_cpu(), 2, sh));
    DSK_TEST_OK(dsk_tensor_copy(&g_ctx, &hl, &m.mla.mtp[0].logits));
    int64_t nm = r.B * (T - 1) * V;
    float *wantf = read_ref_f32("tests/hf/v3", "mtp_logits", nm), *got = (float *)malloc((size_t)nm * 4);
    float *wl = read_ref_f32("tests/hf/v3", "mtp_loss", 1);
    double *want = (double *)malloc((size_t)nm * 8), amax = 0, wloss = wl[0];
    for (int64_t b = 0; b < r.B; b++)
        for (int64_t i = 0; i < T - 1; i++)
            for (int64_t v = 0; v < V; v++) {
                int64_t k = (b * (T - 1) + i) * V + v;
                got[k] = all[(b * T + i) * V + v];
                want[k] = wantf[k];
                amax = fmax(amax, fabs(want[k]));
            }
    DSK_TEST_CLOSE(got, want, nm, 0.0, 1e-5 * amax, "MTP logits against the float64 MTP layer (1e-5 of the largest)");
    DSK_TEST_CLOSE(&mloss, &wloss, 1, 1e-5, 0.0, "MTP loss against the float64 MTP layer (1e-5 relative)");
    (void)loss;
    /* export (f32, several shards) -> import into a fresh --mtp 1 model: bitwise, biases included */
    char dir[300];
    tm_model back;
    dsk_ckpt_hf_deepseek_config h2;
    snprintf(dir, sizeof dir, "%s/mtp_export", g_tmp);
    DSK_TEST_OK(thf_export(&m, &h, dir, "f32", 20000));
    g_mtp = 1;
    DSK_TEST_OK(build(dir, &back, &h2, (int)r.B, (int)r.T, 1));
    g_mtp = 0;
    DSK_TEST_EXPECT(h2.num_nextn_predict_layers == 1, "the export declares %d MTP layers", h2.num_nextn_predict_layers);
    DSK_TEST_EXPECT(same_weights(&m, &back), "export -> import of the MTP model is bitwise");
    tm_free(&back);
    free(lg);
    free(ids);
    free(tg);
    free(all);
    free(wantf);
    free(got);
    free(wl);
    free(want);
    free(r.tokens);
    free(r.logits);
    tm_free(&m);
}

/* Flips the lowest bit of the first element of tensor `name` in its shard of dir. */
static void flip_bit(const char *dir, const char *name) {
    dsk_safetensors_hf hf;
    dsk_safetensors_file *f;
    const dsk_safetensors_info *t;
    DSK_TEST_OK(dsk_safetensors_hf_open(&hf, dir));
    DSK_TEST_OK(dsk_safetensors_hf_find(&hf, name, &f, &t));
    FILE *fp = fopen(f->path, "r+b");
    long at = (long)(8 + f->header_len + t->begin);
    int c = fp && fseek(fp, at, SEEK_SET) == 0 ? fgetc(fp) : EOF;
    DSK_TEST_EXPECT(c != EOF && fseek(fp, at, SEEK_SET) == 0 && fputc(c ^ 1, fp) != EOF, "patch %s", f->path);
    if (fp) fclose(fp);
    dsk_safetensors_hf_close(&hf);
}

/* A fixture copy whose MTP layer lacks a tensor, has one of the wrong shape, or an embed_tokens
   that is not the model's: the import names the tensor and loads nothing. */
static void test_bad_mtp(void) {
    const char *names[3] = {"model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight",
                            "model.layers.2.embed_tokens.weight"};
    for (int c = 0; c < 3; c++) {
        tm_model m;
        dsk_ckpt_hf_deepseek_config h;
        char dir[300], cmd[900];
        snprintf(dir, sizeof dir, "%s/badmtp%d", g_tmp, c);
        snprintf(cmd, sizeof cmd, "mkdir -p '%s' && cp tests/hf/v3/* '%s'/", dir, dir);
        DSK_TEST_EXPECT(system(cmd) == 0, "copy the fixture");
        if (c == 0) { /* renamed in the index: the set no longer holds the tensor */
            snprintf(cmd, sizeof cmd, "sed -i 's/\"%s\"/\"%sX\"/' '%s/model.safetensors.index.json'", names[c],
                     names[c], dir);
            DSK_TEST_EXPECT(system(cmd) == 0, "edit the index");
        }
        if (c == 2) flip_bit(dir, names[c]);
        g_mtp = 1;
        DSK_TEST_OK(build(dir, &m, &h, 1, 4, 0));
        g_mtp = 0;
        if (c == 1) m.mla.mtp[0].enorm->w.shape[0] = 16; /* a model expecting another shape (a view: restored) */
        DSK_TEST_OK(dsk_tensor_fill(&g_ctx, &m.slab_w, NAN));
        DSK_TEST_EXPECT(thf_load(&m, &h, dir) != DSK_OK, "case %d fails", c);
        DSK_TEST_ERROR_MENTIONS(names[c]);
        if (c == 1) m.mla.mtp[0].enorm->w.shape[0] = 32;
        int64_t touched = 0;
        for (int64_t i = 0; i < m.numel; i++) touched += !isnan(((const float *)m.slab_w.data)[i]);
        DSK_TEST_EXPECT(touched == 0, "case %d: nothing loaded: %lld weights changed", c, (long long)touched);
        tm_free(&m);
    }
}
static void test_import_v2(void) { check_fixture("tests/hf/v2", "tests/hf/v2"); }
/* v3's weights under YaRN rope_scaling (factor 4, a ramp between rope pairs 0 and 2, mscale 0.707) */
/* v3's weights with rms_norm_eps 0.05: the layer and final norms take it, the latents' stay at 1e-6 */
static void test_import_v3_eps(void) { check_fixture("tests/hf/v3_eps", "tests/hf/v3"); }
static void test_import_v3_yarn(void) {
    dsk_ckpt_hf_deepseek_config h;
    DSK_TEST_OK(dsk_ckpt_hf_deepseek_config_read(&h, "tests/hf/v3_yarn"));
    DSK_TEST_EXPECT(h.yarn && h.rope_factor == 4.0 && h.original_max_position_embeddings == 64 && h.beta_fast == 8.0 &&
                        h.beta_slow == 0.5 && h.mscale == 0.707 && h.mscale_all_dim == 0.707,
                    "rope_scaling read");
    check_fixture("tests/hf/v3_yarn", "tests/hf/v3");
}

/* e4m3 bits -> value, from the format's definition (bias 7, subnormals, S.1111.111 NaN). */
static double ref_e4m3(uint8_t b) {
    int sign = b >> 7, e = (b >> 3) & 15, mant = b & 7;
    double v;
    if (e == 15 && mant == 7) return NAN;
    v = e == 0 ? ldexp(mant / 8.0, -6) : ldexp(1.0 + mant / 8.0, e - 7);
    return sign ? -v : v;
}

/* Every master weight of m equals the fixture's tensors: FP8 ones decoded here times their
   block's scale (rounded to f32), the rest as stored. Returns the FP8 tensors seen. */
static int check_dequant(tm_model *m, const char *dir, int bs, int with_bias) {
    thf_list list;
    dsk_safetensors_hf hf;
    int n = 0, fp8 = 0, bad = 0;
    DSK_TEST_OK(thf_list_make(m, with_bias, m->cfg.mla.mtp_depth > 0 ? 2 : 0, &list)); /* MTP: the hub's layout */
    const dsk_safetensors_hf_entry *es = list.es;
    n = list.n;
    DSK_TEST_OK(dsk_safetensors_hf_open(&hf, dir));
    for (int i = 0; i < n; i++) {
        int64_t count = es[i].stacked ? es[i].tensor->shape[0] : 1;
        for (int64_t k = 0; k < count; k++) {
            char name[200], sname[220];
            const char *at = strstr(es[i].name, "{E}");
            dsk_tensor v = *es[i].tensor;
            if (es[i].stacked) {
                snprintf(name, sizeof name, "%.*s%lld%s", (int)(at - es[i].name), es[i].name, (long long)k, at + 3);
                DSK_TEST_OK(dsk_tensor_select(es[i].tensor, k, &v));
            } else {
                snprintf(name, sizeof name, "%s", es[i].name);
            }
            dsk_safetensors_file *f, *sf;
            const dsk_safetensors_info *t, *st;
            DSK_TEST_OK(dsk_safetensors_hf_find(&hf, name, &f, &t));
            int64_t ne = dsk_tensor_numel(&v);
            float *want = (float *)malloc((size_t)ne * 4);
            const float *got = (const float *)v.data;
            if (t->dtype == DSK_E4M3) {
                uint8_t *q = (uint8_t *)malloc((size_t)ne);
                snprintf(sname, sizeof sname, "%s_scale_inv", name);
                DSK_TEST_OK(dsk_safetensors_hf_find(&hf, sname, &sf, &st));
                float *sc = (float *)malloc((size_t)(st->shape[0] * st->shape[1]) * 4);
                DSK_TEST_OK(dsk_safetensors_read_raw(f, name, NULL, t->shape, q, (size_t)ne));
                size_t sbytes = (size_t)(st->shape[0] * st->shape[1]) * 4;
                DSK_TEST_OK(dsk_safetensors_read_raw(sf, sname, NULL, st->shape, sc, sbytes));
                for (int64_t r = 0; r < t->shape[0]; r++)
                    for (int64_t c = 0; c < t->shape[1]; c++)
                        want[r * t->shape[1] + c] =
                            (float)(ref_e4m3(q[r * t->shape[1] + c]) * (double)sc[(r / bs) * st->shape[1] + c / bs]);
                free(q);
                free(sc);
                fp8++;
            } else {
                DSK_TEST_OK(dsk_safetensors_read_raw(f, name, NULL, t->shape, want, (size_t)ne * 4));
            }
            bad += memcmp(want, got, (size_t)ne * 4) != 0;
            if (memcmp(want, got, (size_t)ne * 4) != 0) dsk_test_fail_at(__FILE__, __LINE__, "tensor %s differs", name);
            free(want);
        }
    }
    dsk_safetensors_hf_close(&hf);
    thf_list_free(&list);
    DSK_TEST_EXPECT(bad == 0, "%d tensors differ from the reference dequantisation", bad);
    return fp8;
}

/* Without MTP (--mtp 0: the MTP layer skipped) and with it (--mtp 1: its 32 FP8 matrices too). */
static void test_fp8_import(void) {
    for (int mtp = 0; mtp <= 1; mtp++) {
        tm_model m;
        dsk_ckpt_hf_deepseek_config h;
        g_mtp = mtp;
        DSK_TEST_OK(build("tests/hf/v3_fp8", &m, &h, 1, 4, 0));
        g_mtp = 0;
        DSK_TEST_OK(dsk_tensor_fill(&g_ctx, &m.slab_w, NAN));
        DSK_TEST_OK(thf_load(&m, &h, "tests/hf/v3_fp8"));
        DSK_TEST_EXPECT(h.fp8 && h.block[0] == 16 && h.block[1] == 16, "quantization_config read: fp8 %d block %d x %d",
                        h.fp8, h.block[0], h.block[1]);
        int fp8 = check_dequant(&m, "tests/hf/v3_fp8", 16, 1), want = mtp ? 72 : 40;
        DSK_TEST_EXPECT(fp8 == want, "%d FP8 tensors in the fixture (--mtp %d), saw %d", want, mtp, fp8);
        tm_free(&m);
    }
}

/* Masters (and expert biases) of two models of one config, bitwise. */
static int same_weights(const tm_model *a, const tm_model *b) {
    int same = memcmp(a->slab_w.data, b->slab_w.data, dsk_tensor_nbytes(&a->slab_w)) == 0;
    for (int l = a->cfg.n_dense; l < tm_n_blocks(&a->cfg); l++) /* MoE MTP blocks' biases too */
        if (a->blocks[l].is_moe)
            same &= memcmp(a->blocks[l].moe_bias.data, b->blocks[l].moe_bias.data,
                           dsk_tensor_nbytes(&a->blocks[l].moe_bias)) == 0;
    return same;
}

static void test_export_roundtrip(void) {
    const char *fix[] = {"tests/hf/v3", "tests/hf/v2"};
    for (int f = 0; f < 2; f++) {
        tm_model a, b;
        dsk_ckpt_hf_deepseek_config h, h2;
        char dir[300];
        snprintf(dir, sizeof dir, "%s/export%d", g_tmp, f);
        DSK_TEST_OK(build(fix[f], &a, &h, 1, 4, 1));
        DSK_TEST_OK(thf_export(&a, &h, dir, "f32", 20000)); /* small shards: several files and an index */
        DSK_TEST_OK(build(dir, &b, &h2, 1, 4, 0));
        DSK_TEST_OK(dsk_tensor_fill(&g_ctx, &b.slab_w, NAN));
        DSK_TEST_OK(thf_load(&b, &h2, dir));
        DSK_TEST_EXPECT(same_weights(&a, &b), "%s: f32 export -> import is bitwise", fix[f]);
        tm_free(&b);
        /* bf16: the weights rounded to bf16 */
        DSK_TEST_OK(thf_export(&a, &h, dir, "bf16", 0));
        DSK_TEST_OK(build(dir, &b, &h2, 1, 4, 1));
        int64_t n = a.numel, off = 0;
        for (int64_t i = 0; i < n; i++) {
            float w = ((const float *)a.slab_w.data)[i], want = dsk_round_f32(DSK_BF16, w);
            off += memcmp(&want, &((const float *)b.slab_w.data)[i], 4) != 0;
        }
        DSK_TEST_EXPECT(off == 0, "%s: bf16 export -> import: %lld of %lld weights are not the bf16 rounding", fix[f],
                        (long long)off, (long long)n);
        DSK_TEST_EXPECT(strcmp(h2.torch_dtype, "bfloat16") == 0, "bf16 export says torch_dtype \"%s\"", h2.torch_dtype);
        tm_free(&b);
        /* fp8: what the export's own files hold, decoded here; within e4m3's precision of the weights */
        DSK_TEST_OK(thf_export(&a, &h, dir, "fp8", 0));
        DSK_TEST_OK(build(dir, &b, &h2, 1, 4, 1));
        DSK_TEST_EXPECT(h2.fp8 && h2.block[0] == 128, "fp8 export: quantization_config with 128x128 blocks");
        DSK_TEST_EXPECT(check_dequant(&b, dir, 128, h.version == 3) > 0, "fp8 export holds FP8 tensors");
        double worst = 0;
        for (int64_t i = 0; i < n; i++) {
            double w = ((const float *)a.slab_w.data)[i], g = ((const float *)b.slab_w.data)[i];
            worst = fmax(worst, fabs(w - g));
        }
        DSK_TEST_EXPECT(worst > 0 && worst < 0.05, "%s: fp8 round trip moves weights by at most %g (> 0, < 0.05)",
                        fix[f], worst);
        tm_free(&b);
        tm_free(&a);
    }
}

/* The fixture's weights moved by noise (so the export is not the fixture), exported in f32 to
   g_keep/<name>, with dsk's logits of the reference tokens beside it in
   g_keep/<name>_logits.safetensors: tests/test_hf.sh loads that directory with Python's
   safetensors and, where installed, transformers. */
static const char *g_keep;

static void keep_export(const char *fixture, const char *weights, const char *name) {
    ref r;
    tm_model m;
    dsk_ckpt_hf_deepseek_config h;
    dsk_tensor noise;
    char dir[600];
    read_ref(fixture, &r);
    DSK_TEST_OK(build(fixture, &m, &h, (int)r.B, (int)r.T, 0));
    DSK_TEST_OK(thf_load(&m, &h, weights));
    DSK_TEST_OK(dsk_tensor_alloc(&g_ctx, &noise, DSK_F32, 1, &m.numel));
    DSK_TEST_OK(dsk_tensor_normal(&g_ctx, &noise, 99, 0, 0.0f, 0.02f));
    DSK_TEST_OK(dsk_add(&g_ctx, &m.slab_w, &m.slab_w, &noise));
    dsk_tensor_free(&g_ctx, &noise);
    int64_t n = r.B * r.T * r.V, sh[3] = {r.B, r.T, r.V};
    float *logits = (float *)malloc((size_t)n * 4), loss = NAN;
    forward(&m, &r, logits, &loss);
    snprintf(dir, sizeof dir, "%s/%s", g_keep, name);
    DSK_TEST_OK(thf_export(&m, &h, dir, "f32", 0));
    dsk_tensor lt;
    dsk_safetensors_entry e = {"logits", &lt};
    DSK_TEST_OK(dsk_tensor_wrap(&lt, logits, DSK_F32, dsk_cpu(), 3, sh));
    snprintf(dir, sizeof dir, "%s/%s_logits.safetensors", g_keep, name);
    DSK_TEST_OK(dsk_safetensors_save(&g_ctx, dir, &e, 1, NULL, 0));
    free(logits);
    free(r.tokens);
    free(r.logits);
    tm_free(&m);
}

static void test_keep_export(void) {
    keep_export("tests/hf/v3", "tests/hf/v3", "v3_export");
    keep_export("tests/hf/v2", "tests/hf/v2", "v2_export");
    keep_export("tests/hf/v3_yarn", "tests/hf/v3", "v3_yarn_export");
}

/* ------------------------------------------------------------------ bad input */

static void copy_fixture(const char *src, const char *dst) {
    char cmd[800];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s' '%s'", dst, src, dst);
    DSK_TEST_EXPECT(system(cmd) == 0, "%s", cmd);
}

static void edit_file(const char *path, const char *from, const char *to) {
    char cmd[800];
    snprintf(cmd, sizeof cmd, "sed -i 's/%s/%s/' '%s'", from, to, path);
    DSK_TEST_EXPECT(system(cmd) == 0, "%s", cmd);
}

static void test_bad_config(void) {
    char dir[300], path[400];
    dsk_ckpt_hf_deepseek_config h;
    snprintf(dir, sizeof dir, "%s/badcfg", g_tmp);
    snprintf(path, sizeof path, "%s/config.json", dir);
    copy_fixture("tests/hf/v3", dir);
    edit_file(path, "\"noaux_tc\"", "\"balanced\"");
    DSK_TEST_STATUS(dsk_ckpt_hf_deepseek_config_read(&h, dir), DSK_ERR_CORRUPT);
    DSK_TEST_ERROR_MENTIONS("topk_method");
    DSK_TEST_ERROR_MENTIONS("balanced");
    DSK_TEST_ERROR_MENTIONS(path);
    copy_fixture("tests/hf/v3", dir);
    edit_file(path, "\"kv_lora_rank\"", "\"kv_lora_rank_\"");
    DSK_TEST_STATUS(dsk_ckpt_hf_deepseek_config_read(&h, dir), DSK_ERR_CORRUPT);
    DSK_TEST_ERROR_MENTIONS("\"kv_lora_rank\" is missing");
    copy_fixture("tests/hf/v3", dir);
    edit_file(path, "\"rope_scaling\": null", "\"rope_scaling\": {\"type\": \"linear\", \"factor\": 2}");
    DSK_TEST_STATUS(dsk_ckpt_hf_deepseek_config_read(&h, dir), DSK_ERR_CORRUPT);
    DSK_TEST_ERROR_MENTIONS("rope_scaling.type");
    /* what the model cannot express is refused by the trainer's mapping */
    copy_fixture("tests/hf/v3", dir);
    edit_file(path, "\"tie_word_embeddings\": false", "\"tie_word_embeddings\": true");
    tm_config c;
    memset(&c, 0, sizeof c);
    DSK_TEST_OK(dsk_ckpt_hf_deepseek_config_read(&h, dir));
    DSK_TEST_STATUS(thf_model_config(&h, &c), DSK_ERR_UNSUPPORTED);
    DSK_TEST_ERROR_MENTIONS("tie_word_embeddings");
    DSK_TEST_OK(dsk_ckpt_hf_deepseek_config_read(&h, "tests/hf/v3"));
    h.rms_norm_eps = 0;
    DSK_TEST_STATUS(thf_model_config(&h, &c), DSK_ERR_UNSUPPORTED);
    DSK_TEST_ERROR_MENTIONS("rms_norm_eps");
    DSK_TEST_OK(dsk_ckpt_hf_deepseek_config_read(&h, "tests/hf/v3"));
    h.num_nextn_predict_layers = 1;
    c.mla.mtp_depth = 1;
    DSK_TEST_STATUS(thf_model_config(&h, &c), DSK_ERR_UNSUPPORTED);
    DSK_TEST_ERROR_MENTIONS("num_nextn_predict_layers");
}

/* Loads broken copy dir into a fresh model of fixture's config (FP8 scale blocks `block` rows
   high where block > 0): fails, mentions n1 and n2, and leaves every master weight as it was (NaN). */
static void load_fails_in(const char *fixture, int block, const char *dir, const char *n1, const char *n2) {
    tm_model m;
    dsk_ckpt_hf_deepseek_config h;
    DSK_TEST_OK(build(fixture, &m, &h, 1, 4, 0));
    if (block > 0) h.block[0] = block;
    DSK_TEST_OK(dsk_tensor_fill(&g_ctx, &m.slab_w, NAN));
    DSK_TEST_EXPECT(thf_load(&m, &h, dir) != DSK_OK, "loading %s fails", dir);
    DSK_TEST_ERROR_MENTIONS(n1);
    DSK_TEST_ERROR_MENTIONS(n2);
    int64_t touched = 0;
    for (int64_t i = 0; i < m.numel; i++) touched += !isnan(((const float *)m.slab_w.data)[i]);
    DSK_TEST_EXPECT(touched == 0, "nothing loaded: %lld weights changed", (long long)touched);
    tm_free(&m);
}

static void load_fails(const char *dir, const char *n1, const char *n2) {
    load_fails_in("tests/hf/v3", 0, dir, n1, n2);
}

static void load_fails_fp8(const char *dir, int block, const char *n1, const char *n2) {
    load_fails_in("tests/hf/v3_fp8", block, dir, n1, n2);
}

static void test_bad_sets(void) {
    char dir[300], path[400];
    snprintf(dir, sizeof dir, "%s/badset", g_tmp);
    /* the index names a shard that is not there */
    copy_fixture("tests/hf/v3", dir);
    snprintf(path, sizeof path, "%s/model-00002-of-00002.safetensors", dir);
    DSK_TEST_EXPECT(unlink(path) == 0, "remove %s", path);
    load_fails(dir, "model-00002-of-00002.safetensors", "");
    /* a tensor of the wrong shape: a copy whose config has another kv_lora_rank */
    {
        tm_model m;
        dsk_ckpt_hf_deepseek_config h;
        tm_config c;
        memset(&c, 0, sizeof c);
        DSK_TEST_OK(dsk_ckpt_hf_deepseek_config_read(&h, "tests/hf/v3"));
        h.kv_lora_rank = 12;
        c.seq = 4;
        c.batch = 1;
        c.cdt = DSK_F32;
        c.init_std = 0.02f;
        DSK_TEST_OK(thf_model_config(&h, &c));
        DSK_TEST_OK(tm_init(&m, &g_ctx, &c));
        DSK_TEST_OK(dsk_tensor_fill(&g_ctx, &m.slab_w, NAN));
        DSK_TEST_STATUS(thf_load(&m, &h, "tests/hf/v3"), DSK_ERR_ARG);
        DSK_TEST_ERROR_MENTIONS("model.layers.0.self_attn.kv_a_proj_with_mqa.weight");
        DSK_TEST_ERROR_MENTIONS("tests/hf/v3/model-00001-of-00002.safetensors");
        DSK_TEST_ERROR_MENTIONS("[24, 32]");
        int64_t touched = 0;
        for (int64_t i = 0; i < m.numel; i++) touched += !isnan(((const float *)m.slab_w.data)[i]);
        DSK_TEST_EXPECT(touched == 0, "nothing loaded: %lld weights changed", (long long)touched);
        tm_free(&m);
    }
    /* a truncated shard */
    copy_fixture("tests/hf/v3", dir);
    snprintf(path, sizeof path, "%s/model-00002-of-00002.safetensors", dir);
    DSK_TEST_EXPECT(truncate(path, 20000) == 0, "truncate %s", path);
    load_fails(dir, "model-00002-of-00002.safetensors", "");
    /* a tensor the index does not hold */
    copy_fixture("tests/hf/v3", dir);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    edit_file(path, "model.layers.1.mlp.experts.5.up_proj.weight", "model.layers.1.mlp.experts.5.up_proj.weightX");
    load_fails(dir, "model.layers.1.mlp.experts.5.up_proj.weight", dir);
}

/* argv[1]: where test_keep_export leaves its exports (default: the scratch directory). */
/* An export of a V2 model whose expert bias moved is refused: V2 has none. */
static void test_v2_bias_refused(void) {
    tm_model m;
    dsk_ckpt_hf_deepseek_config h;
    char dir[300];
    snprintf(dir, sizeof dir, "%s/v2bias", g_tmp);
    DSK_TEST_OK(build("tests/hf/v2", &m, &h, 1, 4, 1));
    DSK_TEST_OK(dsk_tensor_fill(&g_ctx, &m.blocks[1].moe_bias, 0.01));
    DSK_TEST_STATUS(thf_export(&m, &h, dir, "f32", 0), DSK_ERR_UNSUPPORTED);
    DSK_TEST_ERROR_MENTIONS("layer 1's expert bias is not zero");
    tm_free(&m);
}

/* The library's other refusals: config types, FP8 scales, role names, the writer and the quantiser. */
static void test_bad_library(void) {
    char dir[300], path[400], name[64];
    dsk_ckpt_hf_deepseek_config h;
    snprintf(dir, sizeof dir, "%s/badlib", g_tmp);
    snprintf(path, sizeof path, "%s/config.json", dir);
    const char *edits[][3] = {
        {"\"hidden_size\": 32", "\"hidden_size\": \"32\"", "\"hidden_size\" is not an integer"},
        {"\"norm_topk_prob\": true", "\"norm_topk_prob\": 1", "\"norm_topk_prob\" is not true"},
        {"DeepseekV3ForCausalLM", "LlamaForCausalLM", "\"architectures\" names neither"},
        {"\"scoring_func\": \"sigmoid\"", "\"scoring_func\": \"relu\"", "\"scoring_func\" is \"relu\""},
        {"\"rope_theta\": 10000.0", "\"rope_theta\": null", "\"rope_theta\" is not a number"}};
    for (size_t i = 0; i < sizeof edits / sizeof edits[0]; i++) {
        copy_fixture("tests/hf/v3", dir);
        edit_file(path, edits[i][0], edits[i][1]);
        DSK_TEST_STATUS(dsk_ckpt_hf_deepseek_config_read(&h, dir), DSK_ERR_CORRUPT);
        DSK_TEST_ERROR_MENTIONS(edits[i][2]);
    }
    /* an FP8 tensor whose scale the index does not hold, and scales of another block size */
    copy_fixture("tests/hf/v3_fp8", dir);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    edit_file(path, "o_proj.weight_scale_inv", "o_proj.weight_scale_X"); /* both layers' */
    load_fails_fp8(dir, 16, "model.layers.0.self_attn.o_proj.weight_scale_inv", "has no");
    load_fails_fp8("tests/hf/v3_fp8", 8, "_scale_inv\" is not f32 (ceil(", "/8)");
    /* role names */
    DSK_TEST_OK(dsk_ckpt_hf_deepseek_role_name(name, sizeof name, 4, "attn.wkv_a"));
    DSK_TEST_EXPECT(strcmp(name, "model.layers.4.self_attn.kv_a_proj_with_mqa.weight") == 0, "name %s", name);
    DSK_TEST_OK(dsk_ckpt_hf_deepseek_role_name(name, sizeof name, -1, "lm_head"));
    DSK_TEST_EXPECT(strcmp(name, "lm_head.weight") == 0, "name %s", name);
    DSK_TEST_OK(dsk_ckpt_hf_deepseek_role_name(name, sizeof name, 2, "w2"));
    DSK_TEST_EXPECT(strcmp(name, "model.layers.2.mlp.experts.{E}.down_proj.weight") == 0, "name %s", name);
    DSK_TEST_STATUS(dsk_ckpt_hf_deepseek_role_name(name, sizeof name, 2, "attn.wk"), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("attn.wk");
    DSK_TEST_STATUS(dsk_ckpt_hf_deepseek_role_name(name, sizeof name, -1, "ln1"), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("ln1");
    DSK_TEST_STATUS(dsk_ckpt_hf_deepseek_role_name(name, 12, 3, "ln1"), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("too small");
    DSK_TEST_STATUS(dsk_ckpt_hf_deepseek_role_name(name, sizeof name, -2, "embed"), DSK_ERR_ARG);
    /* the writer and the quantiser */
    memset(&h, 0, sizeof h);
    DSK_TEST_STATUS(dsk_ckpt_hf_deepseek_config_write(&h, g_tmp), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("version 0");
    dsk_tensor w, q, sc;
    int64_t ws[2] = {5, 7}, ss[2] = {2, 2};
    int blk[2] = {4, 4};
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &w, DSK_F32, 2, ws));
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &q, DSK_E4M3, 2, ws));
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &sc, DSK_F32, 2, ss));
    dsk_test_fill_f32((float *)w.data, 35, -3, 3);
    DSK_TEST_OK(dsk_ckpt_hf_quantize_e4m3(&q, &sc, &w, blk));
    for (int64_t r = 0; r < 5; r++) /* every element within e4m3's half-step of its block's scale */
        for (int64_t c = 0; c < 7; c++) {
            double s1 = ((float *)sc.data)[(r / 4) * 2 + c / 4], x = ((float *)w.data)[r * 7 + c];
            double back = ref_e4m3(((uint8_t *)q.data)[r * 7 + c]) * s1;
            DSK_TEST_EXPECT(fabs(back - x) <= fabs(x) / 16 + s1 * ldexp(1, -10), "[%lld,%lld] %g -> %g", (long long)r,
                            (long long)c, x, back);
        }
    blk[1] = 3;
    DSK_TEST_STATUS(dsk_ckpt_hf_quantize_e4m3(&q, &sc, &w, blk), DSK_ERR_ARG);
    DSK_TEST_ERROR_MENTIONS("scale_inv (2, 3)");
    dsk_tensor_free(NULL, &w);
    dsk_tensor_free(NULL, &q);
    dsk_tensor_free(NULL, &sc);
}

int main(int argc, char **argv) {
    dsk_ctx_opts co;
    dsk_test_init("test_hf");
    /* the trainer's model on the CPU, whatever the machine has: test_hf.sh runs the device path */
    memset(&co, 0, sizeof co);
    co.device = DSK_PREFER_CPU;
    DSK_TEST_OK(dsk_ctx_init(&g_ctx, &co));
    snprintf(g_tmp, sizeof g_tmp, "/tmp/test_hf.XXXXXX");
    if (!mkdtemp(g_tmp)) return 1;
    g_keep = argc > 1 ? argv[1] : g_tmp;
    DSK_TEST_RUN(test_import_v3);
    DSK_TEST_RUN(test_import_mtp);
    DSK_TEST_RUN(test_bad_mtp);
    DSK_TEST_RUN(test_import_v2);
    DSK_TEST_RUN(test_import_v3_yarn);
    DSK_TEST_RUN(test_import_v3_eps);
    DSK_TEST_RUN(test_fp8_import);
    DSK_TEST_RUN(test_export_roundtrip);
    DSK_TEST_RUN(test_keep_export);
    DSK_TEST_RUN(test_bad_config);
    DSK_TEST_RUN(test_bad_sets);
    DSK_TEST_RUN(test_bad_library);
    DSK_TEST_RUN(test_v2_bias_refused);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmp);
    if (system(cmd) != 0) return 1;
    dsk_ctx_free(&g_ctx);
    return dsk_test_finish();
}
