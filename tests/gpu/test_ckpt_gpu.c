/* test_ckpt_gpu.c - dsk_ckpt.h with CUDA tensors against the CPU path on the same data.

   Saving device tensors (contiguous and a transposed view, sync and async) must write the
   same bytes as saving their host copies (the per-tensor CRC32Cs of both files agree), and
   loading into device tensors (same dtype, and bf16 with allow_cast) must give exactly what
   loading into host tensors gives. Device outputs are poisoned first. Without a usable CUDA
   device every case reports as skipped. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp, readlink, dirent: the library is linked, not included */
#include "dsk_tensor.h"
#include "dsk_ckpt.h"
#include "tests/dsk_test.h"
#include "tests/gpu/gpu_test_util.h"

#include <dirent.h>
#include <unistd.h>

static char g_root[256];

static void host_rand(dsk_tensor *t, dsk_dtype dt, int nd, const int64_t *shape) {
    dsk_tensor f;
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &f, DSK_F64, nd, shape));
    dsk_test_fill_f64((double *)f.data, dsk_tensor_numel(&f), -4.0, 4.0);
    DSK_TEST_OK(dsk_tensor_alloc(NULL, t, dt, nd, shape));
    DSK_TEST_OK(dsk_tensor_copy(NULL, t, &f));
    dsk_tensor_free(NULL, &f);
}

static void to_device(dsk_tensor *d, const dsk_tensor *h) {
    DSK_TEST_OK(dsk_tensor_alloc(&G, d, h->dtype, h->ndim, h->shape));
    DSK_TEST_OK(dsk_tensor_copy(&G, d, h));
}

/* Host copy of a device tensor, for comparisons. */
static void to_host(dsk_tensor *h, const dsk_tensor *d) {
    DSK_TEST_OK(dsk_tensor_alloc(NULL, h, d->dtype, d->ndim, d->shape));
    DSK_TEST_OK(dsk_tensor_copy(&G, h, d));
    DSK_TEST_OK(dsk_ctx_sync(&G));
}

static void poison_device(dsk_tensor *d) {
    dsk_tensor h;
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &h, d->dtype, d->ndim, d->shape));
    dsk_test_poison_bytes(h.data, dsk_tensor_nbytes(&h));
    DSK_TEST_OK(dsk_tensor_copy(&G, d, &h));
    dsk_tensor_free(NULL, &h);
}

/* CRC32C the file records for tensor name of checkpoint dir/step_<step> (one rank: its only
   file, "rank_00000.<nonce>.safetensors"). */
static uint32_t recorded_crc(const char *dir, int64_t step, const char *name) {
    char sd[600], p[900] = "";
    dsk_safetensors_file f;
    uint32_t crc = 0;
    int i;
    DIR *d;
    struct dirent *de;
    snprintf(sd, sizeof sd, "%s/step_%08lld", dir, (long long)step);
    if ((d = opendir(sd)) != NULL) {
        while ((de = readdir(d)) != NULL)
            if (strncmp(de->d_name, "rank_00000.", 11) == 0) snprintf(p, sizeof p, "%s/%s", sd, de->d_name);
        closedir(d);
    }
    if (dsk_safetensors_open(&f, p) != DSK_OK) return 0;
    if ((i = dsk_safetensors_find(&f, name)) >= 0) crc = f.tensors[i].crc32c;
    dsk_safetensors_close(&f);
    return crc;
}

static void test_save_load_device(int async) {
    static const int64_t sa[2] = {129, 7}, sb[2] = {5, 33};
    char dir_d[400], dir_h[400];
    dsk_tensor ha, hb, da, db, dbt, hbt, la, lb, back_a, back_b;
    dsk_ckpt ckd, ckh;
    dsk_ckpt_opts o;
    if (!have_gpu) { dsk_test_skip("no usable CUDA device"); return; }
    snprintf(dir_d, sizeof dir_d, "%s/dev_%d", g_root, async);
    snprintf(dir_h, sizeof dir_h, "%s/host_%d", g_root, async);
    host_rand(&ha, DSK_F32, 2, sa);
    host_rand(&hb, DSK_BF16, 2, sb);
    to_device(&da, &ha);
    to_device(&db, &hb);
    DSK_TEST_OK(dsk_tensor_transpose(&db, 0, 1, &dbt)); /* (33, 5) strided view on the device */
    DSK_TEST_OK(dsk_tensor_transpose(&hb, 0, 1, &hbt));
    memset(&o, 0, sizeof o);
    o.ctx = &G;
    DSK_TEST_OK(dsk_ckpt_init(&ckd, dir_d, &o));
    DSK_TEST_OK(dsk_ckpt_init(&ckh, dir_h, NULL));
    {
        dsk_ckpt_entry ed[2] = {{"a", &da, 0, 0, 0, NULL, NULL}, {"bt", &dbt, 0, 0, 0, NULL, NULL}},
                       eh[2] = {{"a", &ha, 0, 0, 0, NULL, NULL}, {"bt", &hbt, 0, 0, 0, NULL, NULL}};
        if (async) {
            DSK_TEST_OK(dsk_ckpt_save_async(&ckd, 1, ed, 2, NULL, 0));
            DSK_TEST_OK(dsk_tensor_fill(&G, &da, 0.0)); /* training overwrites the weights at once */
            DSK_TEST_OK(dsk_tensor_fill(&G, &db, 0.0));
            DSK_TEST_OK(dsk_ckpt_wait(&ckd));
        } else {
            DSK_TEST_OK(dsk_ckpt_save(&ckd, 1, ed, 2, NULL, 0));
        }
        DSK_TEST_OK(dsk_ckpt_save(&ckh, 1, eh, 2, NULL, 0));
    }
    DSK_TEST_EXPECT(recorded_crc(dir_d, 1, "a") == recorded_crc(dir_h, 1, "a"), "device and host saves of a differ");
    DSK_TEST_EXPECT(recorded_crc(dir_d, 1, "bt") == recorded_crc(dir_h, 1, "bt"),
                    "device and host saves of the transposed b differ");
    /* load into device tensors and compare with the host originals */
    DSK_TEST_OK(dsk_tensor_alloc(&G, &la, DSK_F32, 2, sa));
    DSK_TEST_OK(dsk_tensor_alloc(&G, &lb, DSK_BF16, 2, hbt.shape));
    poison_device(&la);
    poison_device(&lb);
    {
        dsk_ckpt_entry el[2] = {{"a", &la, 0, 0, 0, NULL, NULL}, {"bt", &lb, 0, 0, 0, NULL, NULL}};
        DSK_TEST_OK(dsk_ckpt_load(&ckd, 1, el, 2, NULL));
    }
    to_host(&back_a, &la);
    to_host(&back_b, &lb);
    DSK_TEST_SAME_BYTES(back_a.data, ha.data, dsk_tensor_nbytes(&ha), "a loaded on the device");
    {
        dsk_tensor want;
        DSK_TEST_OK(dsk_tensor_alloc(NULL, &want, DSK_BF16, 2, hbt.shape));
        DSK_TEST_OK(dsk_tensor_copy(NULL, &want, &hbt));
        DSK_TEST_SAME_BYTES(back_b.data, want.data, dsk_tensor_nbytes(&want), "transposed b loaded on the device");
        dsk_tensor_free(NULL, &want);
    }
    dsk_ckpt_free(&ckd);
    dsk_ckpt_free(&ckh);
    dsk_tensor_free(NULL, &ha); dsk_tensor_free(NULL, &hb); dsk_tensor_free(&G, &da); dsk_tensor_free(&G, &db);
    dsk_tensor_free(&G, &la); dsk_tensor_free(&G, &lb); dsk_tensor_free(NULL, &back_a); dsk_tensor_free(NULL, &back_b);
}

static void test_sync(void) { test_save_load_device(0); }
static void test_async(void) { test_save_load_device(1); }

/* f32 in the file, bf16 on the device: the same bits as the CPU cast on load. */
static void test_cast_on_load(void) {
    static const int64_t s[2] = {7, 129};
    char dir[400];
    dsk_tensor h, dev_bf16, host_bf16, back;
    dsk_ckpt ck;
    dsk_ckpt_opts o;
    if (!have_gpu) { dsk_test_skip("no usable CUDA device"); return; }
    snprintf(dir, sizeof dir, "%s/cast", g_root);
    host_rand(&h, DSK_F32, 2, s);
    memset(&o, 0, sizeof o);
    o.ctx = &G;
    o.allow_cast = 1;
    DSK_TEST_OK(dsk_ckpt_init(&ck, dir, &o));
    {
        dsk_ckpt_entry e = {"w", &h, 0, 0, 0, NULL, NULL};
        DSK_TEST_OK(dsk_ckpt_save(&ck, 3, &e, 1, NULL, 0));
    }
    DSK_TEST_OK(dsk_tensor_alloc(&G, &dev_bf16, DSK_BF16, 2, s));
    DSK_TEST_OK(dsk_tensor_alloc(NULL, &host_bf16, DSK_BF16, 2, s));
    poison_device(&dev_bf16);
    dsk_test_poison_bytes(host_bf16.data, dsk_tensor_nbytes(&host_bf16));
    {
        dsk_ckpt_entry ed = {"w", &dev_bf16, 0, 0, 0, NULL, NULL}, eh = {"w", &host_bf16, 0, 0, 0, NULL, NULL};
        DSK_TEST_OK(dsk_ckpt_load(&ck, 3, &ed, 1, NULL));
        DSK_TEST_OK(dsk_ckpt_load(&ck, 3, &eh, 1, NULL));
    }
    to_host(&back, &dev_bf16);
    DSK_TEST_SAME_BYTES(back.data, host_bf16.data, dsk_tensor_nbytes(&back), "bf16 cast on load, device vs host");
    dsk_ckpt_free(&ck);
    dsk_tensor_free(NULL, &h);
    dsk_tensor_free(&G, &dev_bf16);
    dsk_tensor_free(NULL, &host_bf16);
    dsk_tensor_free(NULL, &back);
}

int main(void) {
    char cmd[300];
    dsk_test_init("test_ckpt_gpu");
    gpu_test_setup();
    snprintf(g_root, sizeof g_root, "/tmp/dsk_ckpt_gpu_XXXXXX");
    if (!mkdtemp(g_root)) { printf("cannot create a scratch directory\n"); return 1; }
    DSK_TEST_RUN(test_sync);
    DSK_TEST_RUN(test_async);
    DSK_TEST_RUN(test_cast_on_load);
    gpu_test_teardown();
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_root);
    if (system(cmd) != 0) printf("# could not remove %s\n", g_root);
    return dsk_test_finish();
}
