/* train_fp8.h - FP8 linear layers of examples/train_moe.c (--dtype fp8), DeepSeek-V3's recipe
   (technical report, section 3.3) on dsk_matmul_fp8 (dsk_tensor.h) and the block quantisers of
   dsk_amp.h. A linear layer y = x w^T runs its three GEMMs in e4m3 with f32 accumulation:

     forward          y  = x w^T      x in 1x128 tiles (its cache), w in 128x128 blocks
     input gradient   dx = dy w       dy in 1x128 tiles, w^T in 128x128 blocks
     weight gradient  dw += dy^T x    dy^T and x^T in 1x128 tiles along the tokens

   The input x is quantised once in forward and kept for backward in e4m3 with its scales (the
   cache, about half a bf16 copy's bytes), not in bf16; backward dequantises it into shared
   scratch and quantises its transpose for the weight gradient. The scratch is one set for the
   model (sized by the largest weight and the widest input and output), so the caches' saving
   grows with the layer count; under --recompute the blocks share the caches of the inputs they
   recompute (train_mla.h's tmla_cache, train_par.h's tp_cache). The weights are quantised from
   their bf16 compute copy at each use. Everything else (attention core, norms, embedding, LM
   head, router, gating) stays bf16; the master weights and gradients stay f32. */
#ifndef TRAIN_FP8_H
#define TRAIN_FP8_H

#include "../dsk_amp.h"
#include "../dsk_tensor.h"

/* A linear layer's input kept for backward: e4m3 codes (N, K), 1x128 scales (N, ceil(K/128)). */
typedef struct tf8_act {
    dsk_tensor q, s;
} tf8_act;

/* Scratch every FP8 linear shares, flat and viewed per call at its shapes. buf holds first the
   cached input dequantised (bf16, n x k), then, once its transpose is quantised, the output
   gradient's codes in both layouts (2 x n x out bytes). */
typedef struct tf8_scratch {
    dsk_tensor wq, ws;   /* the weight (or its transpose) in 128x128 blocks */
    dsk_tensor buf;      /* bf16 (n x widest): the dequantised input, then the output gradient's codes */
    dsk_tensor gs, gts;  /* the output gradient's scales: 1x128 tiles, and tiles along the tokens */
    dsk_tensor xtq, xts; /* the input's transpose, tiles along the tokens */
} tf8_scratch;

static int64_t tf8_chunks(int64_t k) { return (k + DSK_FP8_BLOCK - 1) / DSK_FP8_BLOCK; }

/* How the caches and the scratch are allocated: the model's allocator (train_model.h's
   tm_alloc_nd: allocated, or under a plan counted over no memory). */
typedef dsk_status (*tf8_alloc_fn)(void *user, dsk_tensor *t, dsk_dtype dt, int nd, const int64_t *shape);

static dsk_status tf8_alloc1(tf8_alloc_fn fn, void *user, dsk_tensor *t, dsk_dtype dt, int64_t n) {
    return fn(user, t, dt, 1, &n);
}

static dsk_status tf8_act_alloc(tf8_alloc_fn fn, void *user, tf8_act *a, int64_t n, int64_t k) {
    int64_t sq[2] = {n, k}, ss[2] = {n, tf8_chunks(k)};
    TM_TRY(fn(user, &a->q, DSK_E4M3, 2, sq));
    return fn(user, &a->s, DSK_F32, 2, ss);
}

static void tf8_act_free(dsk_ctx *ctx, tf8_act *a) {
    dsk_tensor_free(ctx, &a->q);
    dsk_tensor_free(ctx, &a->s);
}

/* Room for inputs of n rows to the linears of `count` weight shapes, pairs (out, in) in sh: the most elements and
   128x128 blocks of a weight, the widest input and output. */
static dsk_status tf8_scratch_alloc(tf8_alloc_fn fn, void *user, tf8_scratch *s, int64_t n, int count,
                                    const int64_t *sh) {
    int64_t w = 0, wb = 0, k = 0, o = 0;
    for (int i = 0; i < count; i++) {
        int64_t oi = sh[2 * i], ki = sh[2 * i + 1], bi = tf8_chunks(oi) * tf8_chunks(ki);
        w = oi * ki > w ? oi * ki : w;
        wb = bi > wb ? bi : wb;
        k = ki > k ? ki : k;
        o = oi > o ? oi : o;
    }
    int64_t big = k > o ? k : o;
    TM_TRY(tf8_alloc1(fn, user, &s->wq, DSK_E4M3, w));
    TM_TRY(tf8_alloc1(fn, user, &s->ws, DSK_F32, wb));
    TM_TRY(tf8_alloc1(fn, user, &s->buf, DSK_BF16, n * big)); /* n k bf16, or 2 n o codes */
    TM_TRY(tf8_alloc1(fn, user, &s->gs, DSK_F32, n * tf8_chunks(o)));
    TM_TRY(tf8_alloc1(fn, user, &s->gts, DSK_F32, o * tf8_chunks(n)));
    TM_TRY(tf8_alloc1(fn, user, &s->xtq, DSK_E4M3, n * k));
    return tf8_alloc1(fn, user, &s->xts, DSK_F32, k * tf8_chunks(n));
}

static void tf8_scratch_free(dsk_ctx *ctx, tf8_scratch *s) {
    dsk_tensor *ts[] = {&s->wq, &s->ws, &s->buf, &s->gs, &s->gts, &s->xtq, &s->xts};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dsk_tensor_free(ctx, ts[i]);
}

/* r * c elements of dtype dt from byte `at` of a flat scratch tensor, as (r, c). */
static dsk_tensor tf8_view_at(const dsk_tensor *flat, dsk_dtype dt, int64_t at, int64_t r, int64_t c) {
    dsk_tensor v;
    int64_t sh[2] = {r, c};
    dsk_tensor_wrap(&v, (char *)flat->data + at, dt, flat->device, 2, sh);
    return v;
}
static dsk_tensor tf8_view(const dsk_tensor *flat, int64_t r, int64_t c) {
    return tf8_view_at(flat, flat->dtype, 0, r, c);
}

/* The output gradient's codes (n, o) in 1x128 tiles (t 0) or transposed (t 1), in buf. */
static dsk_tensor tf8_gview(const tf8_scratch *sc, int t, int64_t n, int64_t o) {
    return tf8_view_at(&sc->buf, DSK_E4M3, t * n * o, t ? o : n, t ? n : o);
}

/* The first n rows of a cache. */
static void tf8_act_rows(const tf8_act *a, int64_t n, dsk_tensor *q, dsk_tensor *s) {
    dsk_tensor_slice(&a->q, 0, 0, n, q);
    dsk_tensor_slice(&a->s, 0, 0, n, s);
}

/* Rows [i n, (i + 1) n) of a cache (one slot of a cache that holds several). */
static tf8_act tf8_act_part(const tf8_act *a, int64_t i, int64_t n) {
    tf8_act v;
    dsk_tensor_slice(&a->q, 0, i * n, n, &v.q);
    dsk_tensor_slice(&a->s, 0, i * n, n, &v.s);
    return v;
}

/* Quantises x (n, K) into the first n rows of its cache. */
static dsk_status tf8_keep(dsk_ctx *ctx, tf8_act *a, const dsk_tensor *x) {
    dsk_tensor q, s;
    tf8_act_rows(a, x->shape[0], &q, &s);
    return dsk_amp_fp8_block_quantize(ctx, &q, &s, x, 1, DSK_FP8_BLOCK, 0);
}

/* y (n, out) = x w^T + beta y from the cached x (its first n rows); w (out, K) bf16. */
static dsk_status tf8_forward(dsk_ctx *ctx, tf8_scratch *sc, dsk_tensor *y, const tf8_act *a, const dsk_tensor *w,
                              float beta) {
    int64_t o = w->shape[0], k = w->shape[1];
    dsk_tensor q, s, wq = tf8_view(&sc->wq, o, k), ws = tf8_view(&sc->ws, tf8_chunks(o), tf8_chunks(k));
    tf8_act_rows(a, y->shape[0], &q, &s);
    TM_TRY(dsk_amp_fp8_block_quantize(ctx, &wq, &ws, w, DSK_FP8_BLOCK, DSK_FP8_BLOCK, 0));
    return dsk_matmul_fp8(ctx, y, &q, &s, DSK_FP8_TILE_1X128, &wq, &ws, DSK_FP8_BLOCK_128X128, 1.0f, beta);
}

/* Quantises the output gradient dy (n, out) in both layouts, for one or more tf8_backward_* calls. */
static dsk_status tf8_grad(dsk_ctx *ctx, tf8_scratch *sc, const dsk_tensor *dy) {
    int64_t n = dy->shape[0], o = dy->shape[1];
    dsk_tensor gq = tf8_gview(sc, 0, n, o), gs = tf8_view(&sc->gs, n, tf8_chunks(o));
    dsk_tensor gtq = tf8_gview(sc, 1, n, o), gts = tf8_view(&sc->gts, o, tf8_chunks(n));
    TM_TRY(dsk_amp_fp8_block_quantize(ctx, &gq, &gs, dy, 1, DSK_FP8_BLOCK, 0));
    return dsk_amp_fp8_block_quantize_t(ctx, &gtq, &gts, dy, 1, DSK_FP8_BLOCK, 0);
}

/* dx (n, K) = dy w + beta dx, dy as tf8_grad left it; w (out, K) bf16. */
static dsk_status tf8_backward_x(dsk_ctx *ctx, tf8_scratch *sc, dsk_tensor *dx, const dsk_tensor *w, float beta) {
    int64_t n = dx->shape[0], o = w->shape[0], k = w->shape[1];
    dsk_tensor gq = tf8_gview(sc, 0, n, o), gs = tf8_view(&sc->gs, n, tf8_chunks(o));
    dsk_tensor wq = tf8_view(&sc->wq, k, o), ws = tf8_view(&sc->ws, tf8_chunks(k), tf8_chunks(o));
    TM_TRY(dsk_amp_fp8_block_quantize_t(ctx, &wq, &ws, w, DSK_FP8_BLOCK, DSK_FP8_BLOCK, 0));
    return dsk_matmul_fp8(ctx, dx, &gq, &gs, DSK_FP8_TILE_1X128, &wq, &ws, DSK_FP8_BLOCK_128X128, 1.0f, beta);
}

/* The cached input's transpose in 1x128 tiles along the tokens (into sc), for the weight
   gradients of every linear that reads it; before tf8_grad, which reuses buf. */
static dsk_status tf8_input_t(dsk_ctx *ctx, tf8_scratch *sc, const tf8_act *a) {
    int64_t n = a->q.shape[0], k = a->q.shape[1];
    dsk_tensor xd = tf8_view(&sc->buf, n, k), xtq = tf8_view(&sc->xtq, k, n),
               xts = tf8_view(&sc->xts, k, tf8_chunks(n));
    TM_TRY(dsk_amp_fp8_block_dequantize(ctx, &xd, &a->q, &a->s, 1, DSK_FP8_BLOCK));
    return dsk_amp_fp8_block_quantize_t(ctx, &xtq, &xts, &xd, 1, DSK_FP8_BLOCK, 0);
}

/* gw (out, K) f32 += dy^T x, dy as tf8_grad and x as tf8_input_t left them. */
static dsk_status tf8_backward_w(dsk_ctx *ctx, tf8_scratch *sc, dsk_tensor *gw, int64_t n) {
    int64_t o = gw->shape[0], k = gw->shape[1];
    dsk_tensor gtq = tf8_gview(sc, 1, n, o), gts = tf8_view(&sc->gts, o, tf8_chunks(n));
    dsk_tensor xtq = tf8_view(&sc->xtq, k, n), xts = tf8_view(&sc->xts, k, tf8_chunks(n));
    return dsk_matmul_fp8(ctx, gw, &gtq, &gts, DSK_FP8_TILE_1X128, &xtq, &xts, DSK_FP8_TILE_1X128, 1.0f, 1.0f);
}

/* The backward of n linear layers that read one input (its cache a) with output gradients dy[i]:
   gw[i] (f32) += dy[i]^T x, then dx = sum over i of dy[i] w[i] (in i order, written). */
static dsk_status tf8_linear_backward(dsk_ctx *ctx, tf8_scratch *sc, int n, dsk_tensor *const *gw,
                                      const dsk_tensor *const *w, const dsk_tensor *const *dy, const tf8_act *a,
                                      dsk_tensor *dx) {
    TM_TRY(tf8_input_t(ctx, sc, a));
    for (int i = 0; i < n; i++) { /* one output gradient's quantised forms at a time in the scratch */
        TM_TRY(tf8_grad(ctx, sc, dy[i]));
        TM_TRY(tf8_backward_w(ctx, sc, gw[i], dy[i]->shape[0]));
        TM_TRY(tf8_backward_x(ctx, sc, dx, w[i], i ? 1.0f : 0.0f));
    }
    return DSK_OK;
}

#endif /* TRAIN_FP8_H */
