/* ckpt_resume.c - checkpoints that resume exactly and fall back past a damaged one.

   What it shows: a training loop (a linear map learnt with AdamW) that saves its whole state
   (weights, both AdamW moments; the step in the checkpoint) every SAVE_EVERY steps with
   dsk_ckpt_save, and at start resumes from the newest checkpoint that loads:
     - dsk_ckpt_latest says whether DIR holds any complete checkpoint (reads manifests only);
     - dsk_ckpt_load(step -1) loads the newest one whose files pass their CRC32C checks, passing
       over damaged ones, and says what it passed over (meta.n_skipped, skipped_step,
       skipped_error);
     - the data of step s is drawn from (seed, s), so a resumed run computes what the
       uninterrupted run computed: its final weights are the same bits.
   Run it to N steps, again to M > N in the same DIR, and the result equals one run to M; damage
   the newest checkpoint's file in between and it resumes from the one before, saying which it
   passed over and why. The final weights go to DIR/final.bin (raw f32) for comparison.

   Needs: dsk_tensor.h, dsk_ckpt.h (which includes dsk_safetensors.h); link libdsk.a (the
   Makefile builds this file into build/examples/ckpt_resume).
   Usage: ckpt_resume DIR STEPS */
#include "dsk_tensor.h"
#include "dsk_ckpt.h"

#include <stdio.h>
#include <stdlib.h>

enum { B = 16, IN = 24, OUT = 8, SAVE_EVERY = 4 }; /* batch rows, input and output width, save period */

static void check(dsk_status s, const char *call) { /* exits at the first failing call, naming it and why */
    if (s != DSK_OK) fprintf(stderr, "ckpt_resume: %s: %s: %s\n", call, dsk_status_str(s), dsk_last_error()), exit(1);
}
#define CHECK(call) check((call), #call)

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: ckpt_resume DIR STEPS\n");
        return 2;
    }
    const char *dir = argv[1];
    int64_t steps = atoll(argv[2]);

    /* The state: weights w (OUT, IN) and AdamW's moments, all f32 on the CPU. */
    int64_t sw[2] = {OUT, IN}, sx[2] = {B, IN}, sy[2] = {B, OUT};
    int64_t one = 1;
    dsk_tensor w, m, v, g, a, x, y, target, sq;
    CHECK(dsk_tensor_alloc(NULL, &w, DSK_F32, 2, sw));
    CHECK(dsk_tensor_alloc(NULL, &m, DSK_F32, 2, sw));
    CHECK(dsk_tensor_alloc(NULL, &v, DSK_F32, 2, sw));
    CHECK(dsk_tensor_alloc(NULL, &g, DSK_F32, 2, sw));
    CHECK(dsk_tensor_alloc(NULL, &a, DSK_F32, 2, sw)); /* the map to learn */
    CHECK(dsk_tensor_alloc(NULL, &x, DSK_F32, 2, sx));
    CHECK(dsk_tensor_alloc(NULL, &y, DSK_F32, 2, sy));
    CHECK(dsk_tensor_alloc(NULL, &target, DSK_F32, 2, sy));
    CHECK(dsk_tensor_alloc(NULL, &sq, DSK_F32, 0, &one)); /* the loss's sum of squares */
    CHECK(dsk_tensor_normal(NULL, &a, 3, 0, 0.0f, 0.2f));
    CHECK(dsk_tensor_normal(NULL, &w, 5, 0, 0.0f, 0.02f)); /* a fresh start; a resume overwrites */
    CHECK(dsk_tensor_fill(NULL, &m, 0.0));
    CHECK(dsk_tensor_fill(NULL, &v, 0.0));

    /* What a checkpoint holds: each tensor whole (one process). The step is the checkpoint's. */
    dsk_ckpt_entry entries[3] = {{"w", &w, DSK_CKPT_WHOLE, 0, 0, NULL, NULL},
                                 {"adamw.m", &m, DSK_CKPT_WHOLE, 0, 0, NULL, NULL},
                                 {"adamw.v", &v, DSK_CKPT_WHOLE, 0, 0, NULL, NULL}};
    dsk_ckpt ck;
    dsk_ckpt_opts co;
    memset(&co, 0, sizeof co); /* one rank, keep every checkpoint */
    CHECK(dsk_ckpt_init(&ck, dir, &co));

    /* Resume: from the newest checkpoint that loads, if DIR has one. */
    int64_t step = 0, newest = -1;
    CHECK(dsk_ckpt_latest(dir, &newest));
    if (newest >= 0) {
        dsk_ckpt_meta meta;
        CHECK(dsk_ckpt_load(&ck, -1, entries, 3, &meta));
        step = meta.step;
        printf("resumed from step %lld\n", (long long)step);
        if (meta.n_skipped > 0)
            printf("passed over %d damaged checkpoint(s), the newest step %lld: %s\n", meta.n_skipped,
                   (long long)meta.skipped_step, meta.skipped_error ? meta.skipped_error : "(no message)");
        dsk_ckpt_meta_free(&meta);
    } else {
        printf("no checkpoint in %s: starting at step 0\n", dir);
    }

    /* Train: loss = mean (x w^T - x a^T)^2 on the batch of step s, drawn from (seed 9, s). */
    dsk_adamw_opts adamw = dsk_adamw_defaults();
    adamw.lr = 5e-2f;
    while (step < steps) {
        step++;
        CHECK(dsk_tensor_normal(NULL, &x, 9, (uint64_t)step * B * IN, 0.0f, 1.0f));
        CHECK(dsk_matmul(NULL, &target, &x, 0, &a, 1, 1.0f, 0.0f));
        CHECK(dsk_matmul(NULL, &y, &x, 0, &w, 1, 1.0f, 0.0f));
        CHECK(dsk_axpy(NULL, &y, -1.0f, &target));                         /* y - target */
        CHECK(dsk_matmul(NULL, &g, &y, 1, &x, 0, 2.0f / (B * OUT), 0.0f)); /* dloss/dw */
        CHECK(dsk_adamw_step(NULL, &w, &g, &m, &v, &adamw, step, 1.0f, NULL));
        if (step % SAVE_EVERY == 0) {
            CHECK(dsk_ckpt_save(&ck, step, entries, 3, NULL, 0)); /* complete and durable when it returns */
            CHECK(dsk_sum_squares(NULL, &sq, &y));
            printf("step %lld: loss %.6f, saved\n", (long long)step, *(float *)sq.data / (B * OUT));
        }
    }

    /* The final weights, for whoever compares runs. */
    char path[4096];
    snprintf(path, sizeof path, "%s/final.bin", dir);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(w.data, dsk_tensor_nbytes(&w), 1, f) != 1 || fclose(f) != 0) {
        fprintf(stderr, "ckpt_resume: cannot write %s\n", path);
        return 1;
    }
    printf("step %lld: final weights in %s\n", (long long)step, path);

    dsk_ckpt_free(&ck);
    dsk_tensor *owned[] = {&w, &m, &v, &g, &a, &x, &y, &target, &sq};
    for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++) dsk_tensor_free(NULL, owned[i]);
    return 0;
}
