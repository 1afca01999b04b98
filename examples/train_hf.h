/* train_hf.h - Hugging Face DeepSeek-V2/V3 checkpoints in and out of the example model
   (examples/train_model.h): `train_moe --init-from-hf DIR` and `--export-hf DIR`.

   The library does the file work (dsk_ckpt.h: config.json, the hub's tensor names by role,
   sharded safetensors with an index, FP8 e4m3 weights with weight_scale_inv blocks); this file
   maps the model onto it:
     thf_model_config  hub config -> tm_config, refusing what this model cannot express
     thf_load          every tensor of DIR into the model's master weights (and compute copies)
     thf_config_of     tm_config (+ the imported hub config, if any) -> hub config for an export
     thf_export        config.json and sharded safetensors (f32, bf16, or FP8 e4m3 + scales)
   Names: a parameter "blocks.L.<role>" is layer L's role (dsk_ckpt_hf_deepseek_role_name),
   "blocks.L.moe.<p>" the MoE parameter p (dsk_ckpt_hf_deepseek_name; experts stacked on dim 0
   in dsk, one tensor each on the hub), "embed", "ln_f", "lm_head" the model's. Every matrix
   is (out, in) in both; nothing is permuted but eh_proj's column halves (MTP, below; the
   interleaved rope dims of q_b_proj and kv_a_proj_with_mqa are what dsk_rope rotates).
   What the model cannot express is refused with the key named: tied embeddings, moe_layer_freq
   other than 1, YaRN rope_scaling with mscale != mscale_all_dim (transformers
   then scales the rotary cos/sin by their ratio; YaRN itself is train_mla.h's tmla_rotate),
   routing transformers does not run for the architecture (DeepseekV3: sigmoid + noaux_tc only;
   DeepseekV2: softmax, greedy or group_limited_greedy, norm_topk_prob false).
   MTP: the hub's layers num_hidden_layers + k (k < num_nextn_predict_layers) import into the
   modules of --mtp D (D == num_nextn_predict_layers, MoE FFNs: tmla_config.mtp_moe); with --mtp 0
   they are skipped as transformers skips them. "blocks.L.mtp.proj" is eh_proj with its column
   halves swapped (dsk: [hnorm(h) | enorm(emb)], the hub: [enorm(emb) | hnorm(h)]); the layer's
   embed_tokens and shared_head.head must equal the model's embedding and head bitwise (this
   model shares them) and are written as copies of them. With --mtp D > 0 on a checkpoint
   without MTP layers the modules start from their initialisation. An export writes the MTP
   modules when their FFN is MoE (num_nextn_predict_layers = D), not dense ones. */
#ifndef TRAIN_HF_H
#define TRAIN_HF_H

#include <errno.h>
#include <sys/stat.h>

#include "../dsk_ckpt.h"
#include "train_model.h"

/* ------------------------------------------------------------------ config */

static dsk_status thf_refuse(const char *key, const char *why) {
    return dsk_set_error(DSK_ERR_UNSUPPORTED, "config.json: %s: %s", key, why);
}

static dsk_status thf_check_routing(const dsk_ckpt_hf_deepseek_config *h) {
    if (h->version == 3 && (strcmp(h->scoring_func, "sigmoid") != 0 || strcmp(h->topk_method, "noaux_tc") != 0))
        return thf_refuse("scoring_func/topk_method", "DeepseekV3ForCausalLM routes by sigmoid scores with noaux_tc "
                                                      "only (transformers ignores other values)");
    if (h->version == 2 && (strcmp(h->scoring_func, "softmax") != 0 || strcmp(h->topk_method, "noaux_tc") == 0))
        return thf_refuse("scoring_func/topk_method", "DeepseekV2ForCausalLM routes by softmax with greedy or "
                                                      "group_limited_greedy only");
    if (h->version == 2 && h->norm_topk_prob)
        return thf_refuse("norm_topk_prob", "true: transformers' DeepseekV2 does not normalise the top-k weights");
    if (h->n_routed_experts % h->n_group != 0 || h->topk_group > h->n_group)
        return thf_refuse("n_group/topk_group", "n_group must divide n_routed_experts and topk_group <= n_group");
    return DSK_OK;
}

/* The model's sizes, MLA and MoE settings from the hub config; seq, batch, dtype, seed, loss
   and balancing settings stay the caller's. */
static dsk_status thf_model_config(const dsk_ckpt_hf_deepseek_config *h, tm_config *c) {
    if (h->tie_word_embeddings) return thf_refuse("tie_word_embeddings", "true: this model has its own LM head");
    if (h->moe_layer_freq != 1) return thf_refuse("moe_layer_freq", "only 1 (every layer after the dense ones is MoE)");
    if (!(h->rms_norm_eps > 0)) return thf_refuse("rms_norm_eps", "must be > 0");
    if (h->yarn && h->rope_factor > 1 && h->mscale != h->mscale_all_dim)
        return thf_refuse("rope_scaling", "mscale != mscale_all_dim: transformers then scales the rotary cos/sin by "
                                          "their ratio, which this model does not");
    if (h->num_nextn_predict_layers > 0 && c->mla.mtp_depth > 0 && !c->mla.mtp_moe)
        return thf_refuse("num_nextn_predict_layers", "the hub's MTP layer has an MoE FFN: run with --mtp-ffn moe, or "
                                                      "--mtp 0 (the MTP layer is then skipped)");
    if (h->num_nextn_predict_layers > 0 && c->mla.mtp_depth > 0 && h->num_nextn_predict_layers != c->mla.mtp_depth)
        return thf_refuse("num_nextn_predict_layers", "differs from --mtp: import every MTP layer (--mtp equal to it) "
                                                      "or none (--mtp 0)");
    if (h->first_k_dense_replace > h->num_hidden_layers)
        return thf_refuse("first_k_dense_replace", "larger than num_hidden_layers");
    if (h->qk_rope_head_dim < 2 || h->qk_rope_head_dim % 2)
        return thf_refuse("qk_rope_head_dim", "must be even and at least 2");
    if (h->vocab_size > INT32_MAX || h->hidden_size > INT32_MAX || h->intermediate_size > INT32_MAX)
        return thf_refuse("vocab_size/hidden_size/intermediate_size", "above 2^31");
    DSK__TRY(thf_check_routing(h));
    c->vocab = (int)h->vocab_size;
    c->d_model = (int)h->hidden_size;
    c->n_heads = h->num_attention_heads;
    c->n_layers = h->num_hidden_layers;
    c->n_dense = h->first_k_dense_replace;
    c->ffn_hidden = (int)h->intermediate_size;
    c->rope_theta = (float)h->rope_theta;
    c->norm_eps = (float)h->rms_norm_eps;
    c->mla.latent_eps = 1e-6f; /* transformers' q_a_layernorm and kv_a_layernorm, whatever rms_norm_eps says */
    c->moe.n_routed = h->n_routed_experts;
    c->moe.n_shared = h->n_shared_experts;
    c->moe.top_k = h->num_experts_per_tok;
    c->moe.d_expert = h->moe_intermediate_size;
    c->moe.d_shared = h->moe_intermediate_size;
    c->moe.score = h->version == 3 ? DSK_MOE_SIGMOID : DSK_MOE_SOFTMAX;
    c->moe.norm = h->norm_topk_prob ? DSK_MOE_NORM_ON : DSK_MOE_NORM_OFF;
    c->moe.routed_scale = (float)h->routed_scaling_factor;
    c->moe.n_group = strcmp(h->topk_method, "greedy") == 0 ? 1 : h->n_group;
    c->moe.topk_group = strcmp(h->topk_method, "greedy") == 0 ? 1 : h->topk_group;
    c->moe.group_rule = h->version == 3 ? DSK_MOE_GROUP_DEEPSEEK_V3 : DSK_MOE_GROUP_MAX;
    c->mla.attn = TMLA_ATTN_MLA;
    c->mla.q_lora_rank = h->q_lora_rank;
    c->mla.kv_lora_rank = h->kv_lora_rank;
    c->mla.qk_nope_dim = h->qk_nope_head_dim;
    c->mla.qk_rope_dim = h->qk_rope_head_dim;
    c->mla.v_head_dim = h->v_head_dim;
    c->mla.original_seq = h->yarn ? (int)h->original_max_position_embeddings : 0;
    c->mla.yarn = h->yarn;
    c->mla.rope_factor = h->yarn ? (float)h->rope_factor : 1.0f;
    c->mla.mscale = (float)h->mscale_all_dim; /* transformers' softmax factor (yarn_apply_mscale) */
    c->mla.beta_fast = (float)h->beta_fast;
    c->mla.beta_slow = (float)h->beta_slow;
    return DSK_OK;
}

/* The hub config of model config c: the imported one (h0, may be NULL) with c's sizes. */
static dsk_ckpt_hf_deepseek_config thf_config_of(const tm_config *c, const dsk_ckpt_hf_deepseek_config *h0) {
    dsk_ckpt_hf_deepseek_config h;
    if (h0) h = *h0;
    else {
        memset(&h, 0, sizeof h);
        h.bos_token_id = h.eos_token_id = -1;
        h.version = c->moe.score == DSK_MOE_SIGMOID ? 3 : 2;
        h.moe_layer_freq = 1;
        h.rms_norm_eps = 1e-6;
        snprintf(h.topk_method, sizeof h.topk_method, "%s",
                 h.version == 3 ? "noaux_tc" : c->moe.n_group > 1 ? "group_limited_greedy" : "greedy");
        snprintf(h.scoring_func, sizeof h.scoring_func, "%s", h.version == 3 ? "sigmoid" : "softmax");
        h.norm_topk_prob = c->moe.norm == DSK_MOE_NORM_ON || (c->moe.norm == 0 && h.version == 3);
        h.max_position_embeddings = c->seq;
    }
    h.vocab_size = c->vocab;
    h.hidden_size = c->d_model;
    h.intermediate_size = c->ffn_hidden;
    h.moe_intermediate_size = c->moe.d_expert;
    h.num_hidden_layers = c->n_layers;
    h.first_k_dense_replace = c->n_dense;
    h.n_routed_experts = c->moe.n_routed;
    h.n_shared_experts = c->moe.n_shared;
    h.num_experts_per_tok = c->moe.top_k;
    h.n_group = c->moe.n_group > 0 ? c->moe.n_group : 1;
    h.topk_group = c->moe.topk_group > 0 ? c->moe.topk_group : h.n_group;
    h.routed_scaling_factor = c->moe.routed_scale > 0 ? c->moe.routed_scale : 1.0;
    h.q_lora_rank = c->mla.q_lora_rank;
    h.kv_lora_rank = c->mla.kv_lora_rank;
    h.qk_nope_head_dim = c->mla.qk_nope_dim;
    h.qk_rope_head_dim = c->mla.qk_rope_dim;
    h.v_head_dim = c->mla.v_head_dim;
    h.num_attention_heads = c->n_heads;
    h.rope_theta = c->rope_theta;
    h.rms_norm_eps = c->norm_eps; /* the latents' norms: transformers' 1e-6 (tmla_config.latent_eps) */
    h.num_nextn_predict_layers = c->mla.mtp_moe ? c->mla.mtp_depth : 0; /* dense MTP blocks are not exported */
    return h;
}

/* ------------------------------------------------------------------ names */

/* The hub entry of parameter p (name, stacked experts and the first one), or 0 for none. */
static dsk_status thf_param_entry(const tm_model *m, const tm_param *p, char *buf, size_t n,
                                  dsk_safetensors_hf_entry *e) {
    int l = -1, off = 0;
    memset(e, 0, sizeof *e);
    if (sscanf(p->name, "blocks.%d.%n", &l, &off) != 1 || off == 0) {
        DSK__TRY(dsk_ckpt_hf_deepseek_role_name(buf, n, -1, p->name));
    } else if (p->moe_layer >= 0) {
        const dsk_moe *moe = &m->blocks[p->moe_layer].moe;
        const char *role = p->name + strlen(moe->opts.name) + 1; /* "<prefix>.w1" -> "w1" */
        DSK__TRY(dsk_ckpt_hf_deepseek_name(buf, n, l, role));
        e->stacked = p->sharded;
        e->expert0 = p->sharded ? moe->expert0 : 0;
    } else {
        DSK__TRY(dsk_ckpt_hf_deepseek_role_name(buf, n, l, p->name + off));
    }
    e->name = buf;
    return DSK_OK;
}

/* The model's tensors as hub entries: names and entries on the f32 masters, plus each MoE
   layer's expert bias when the routing has one. With `mtp` the MTP modules' too: eh_proj
   through a host tensor with its halves swapped (proj[k]), and on export embed_tokens and
   shared_head.head as the model's own (an import checks those first: thf_mtp_shared); without,
   they are left out. */
typedef struct thf_list {
    dsk_safetensors_hf_entry *es;
    char (*names)[160];
    int n;
    dsk_tensor proj[TMLA_MAX_MTP]; /* host f32 */
} thf_list;

static void thf_list_free(thf_list *t) {
    free(t->es);
    free(t->names);
    for (int k = 0; k < TMLA_MAX_MTP; k++) dsk_tensor_free(NULL, &t->proj[k]);
    memset(t, 0, sizeof *t);
}

/* Swaps the column halves of the host matrix w (D, 2D) in place: [a | b] -> [b | a]. */
static void thf_swap_halves(dsk_tensor *w) {
    int64_t D = w->shape[0];
    float *r = (float *)w->data;
    for (int64_t i = 0; i < D; i++)
        for (int64_t j = 0; j < D; j++) {
            float x = r[i * 2 * D + j];
            r[i * 2 * D + j] = r[i * 2 * D + D + j];
            r[i * 2 * D + D + j] = x;
        }
}

/* One more entry: hub name from role (layer l) on tensor. */
static dsk_status thf_add(thf_list *t, int l, const char *role, dsk_tensor *tensor) {
    DSK__TRY(dsk_ckpt_hf_deepseek_role_name(t->names[t->n], sizeof t->names[t->n], l, role));
    t->es[t->n].name = t->names[t->n];
    t->es[t->n++].tensor = tensor;
    return DSK_OK;
}

/* MTP module k's entries beyond its parameters: its eh_proj's host tensor (on export filled from
   the model, halves swapped) and, on export, embed_tokens and shared_head.head as the model's. */
static dsk_status thf_mtp_extra(tm_model *m, int k, int import, thf_list *t) {
    int l = m->cfg.n_layers + k;
    const tm_param *p = m->mla.mtp[k].proj;
    DSK__TRY(dsk_tensor_alloc(NULL, &t->proj[k], DSK_F32, 2, p->shape));
    if (import) return DSK_OK;
    DSK__TRY(dsk_tensor_copy(m->ctx, &t->proj[k], &p->w));
    thf_swap_halves(&t->proj[k]);
    DSK__TRY(thf_add(t, l, "mtp.embed", &m->embed->w));
    return thf_add(t, l, "mtp.head", &m->lm_head->w);
}

/* Before an import: the MTP layers' embed_tokens and shared_head.head must equal the model's
   embedding and head bit for bit (this model shares them); read into host copies and compared,
   so a checkpoint that differs fails naming the tensor with nothing loaded. */
static dsk_status thf_mtp_shared(tm_model *m, dsk_safetensors_hf *hf, const int block[2]) {
    int D = m->cfg.mla.mtp_depth, n = 0;
    dsk_safetensors_hf_entry es[2 + 2 * TMLA_MAX_MTP];
    dsk_tensor ts[2 + 2 * TMLA_MAX_MTP];
    char names[2 + 2 * TMLA_MAX_MTP][160];
    dsk_status s = DSK_OK;
    memset(ts, 0, sizeof ts);
    memset(es, 0, sizeof es);
    for (int i = 0; s == DSK_OK && i < 2 + 2 * D; i++) { /* model's embed, head, then each layer's copies */
        const tm_param *p = i % 2 ? m->lm_head : m->embed;
        const char *role = i < 2 ? (i ? "lm_head" : "embed") : i % 2 ? "mtp.head" : "mtp.embed";
        s = dsk_ckpt_hf_deepseek_role_name(names[i], sizeof names[i], i < 2 ? -1 : m->cfg.n_layers + i / 2 - 1, role);
        if (s == DSK_OK) s = dsk_tensor_alloc(NULL, &ts[i], DSK_F32, 2, p->shape);
        es[i].name = names[i];
        es[i].tensor = &ts[i];
        n = i + 1;
    }
    if (s == DSK_OK) s = dsk_ckpt_hf_read_dequant(hf, m->ctx, es, n, block);
    for (int i = 2; s == DSK_OK && i < n; i++)
        if (memcmp(ts[i].data, ts[i % 2].data, (size_t)dsk_tensor_nbytes(&ts[i])) != 0)
            s = dsk_set_error(DSK_ERR_UNSUPPORTED, "--init-from-hf: %s differs from %s: this model's MTP modules "
                              "share the embedding and head", names[i], names[i % 2]);
    for (int i = 0; i < n; i++) dsk_tensor_free(NULL, &ts[i]);
    return s;
}

/* After an import: each eh_proj into its module, its halves swapped back. */
static dsk_status thf_mtp_finish(tm_model *m, thf_list *t) {
    for (int k = 0; k < m->cfg.mla.mtp_depth; k++) {
        thf_swap_halves(&t->proj[k]);
        DSK__TRY(dsk_tensor_copy(m->ctx, &m->mla.mtp[k].proj->w, &t->proj[k]));
    }
    return DSK_OK;
}

/* with_bias: the expert biases; mtp: 1 import the MTP modules, 2 export them, 0 neither. */
static dsk_status thf_list_make(tm_model *m, int with_bias, int mtp, thf_list *t) {
    int cap = m->n_params + tm_n_blocks(&m->cfg) + 2 * m->cfg.mla.mtp_depth + 1;
    memset(t, 0, sizeof *t);
    t->es = (dsk_safetensors_hf_entry *)calloc((size_t)cap, sizeof *t->es);
    t->names = (char(*)[160])calloc((size_t)cap, sizeof *t->names);
    if (!t->es || !t->names) {
        thf_list_free(t);
        return dsk_set_error(DSK_ERR_OOM, "thf_list_make: out of memory for %d tensors", cap);
    }
    for (int i = 0; i < m->n_params; i++) {
        tm_param *p = &m->params[i];
        int l = -1;
        if (sscanf(p->name, "blocks.%d.", &l) == 1 && l >= m->cfg.n_layers && !mtp) continue; /* an MTP module's */
        dsk_status s = thf_param_entry(m, p, t->names[t->n], sizeof t->names[t->n], &t->es[t->n]);
        if (s != DSK_OK) { thf_list_free(t); return s; }
        t->es[t->n++].tensor = l >= m->cfg.n_layers && p == m->mla.mtp[l - m->cfg.n_layers].proj
                                   ? &t->proj[l - m->cfg.n_layers] : &p->w; /* allocated below */
    }
    for (int k = 0; mtp && k < m->cfg.mla.mtp_depth; k++) {
        dsk_status s = thf_mtp_extra(m, k, mtp == 1, t);
        if (s != DSK_OK) { thf_list_free(t); return s; }
    }
    for (int l = m->cfg.n_dense; with_bias && l < (mtp ? tm_n_blocks(&m->cfg) : m->cfg.n_layers); l++) {
        dsk_status s = dsk_ckpt_hf_deepseek_name(t->names[t->n], sizeof t->names[t->n], l, "bias");
        if (s != DSK_OK) { thf_list_free(t); return s; }
        t->es[t->n].name = t->names[t->n];
        t->es[t->n++].tensor = &m->blocks[l].moe_bias;
    }
    return DSK_OK;
}

/* ------------------------------------------------------------------ import */

/* Reads every tensor of dir (config h) into the model's masters, then its compute copies. */
static dsk_status thf_load(tm_model *m, const dsk_ckpt_hf_deepseek_config *h, const char *dir) {
    thf_list t;
    dsk_safetensors_hf hf;
    dsk_status s;
    int mtp = h->num_nextn_predict_layers > 0 && m->cfg.mla.mtp_depth > 0; /* thf_model_config: equal depths, MoE */
    DSK__TRY(thf_list_make(m, h->version == 3, mtp, &t));
    s = dsk_safetensors_hf_open(&hf, dir);
    if (s == DSK_OK && mtp) s = thf_mtp_shared(m, &hf, h->block);
    if (s == DSK_OK) s = dsk_ckpt_hf_read_dequant(&hf, m->ctx, t.es, t.n, h->block);
    dsk_safetensors_hf_close(&hf);
    if (s == DSK_OK && mtp) s = thf_mtp_finish(m, &t);
    thf_list_free(&t);
    if (s == DSK_OK && m->slab_wc.data) s = dsk_tensor_copy(m->ctx, &m->slab_wc, &m->slab_w);
    return s;
}

/* ------------------------------------------------------------------ export */

/* One hub tensor of an export: the model's tensor (a view), a host copy in the export dtype, or
   e4m3 with its scales. */
typedef struct thf_item {
    dsk_tensor q, scale;                /* scale: FP8 only */
    char name[160], scale_name[176];
} thf_item;

/* Whether hub tensor `name` is stored as FP8 by the V3 release: the attention and FFN matrices
   (not the router, embedding, head or norms). */
static int thf_is_fp8(const char *name, const dsk_tensor *t) {
    return t->ndim == 2 && (strstr(name, ".self_attn.") || strstr(name, ".mlp.")) && !strstr(name, "mlp.gate.weight");
}

/* it->q (and it->scale) from the model's tensor t: t itself when it is in the export dtype (a
   view: nothing copied), else a cast host copy, or its FP8 blocks. */
static dsk_status thf_item_fill(tm_model *m, thf_item *it, const dsk_tensor *t, dsk_dtype dt, int fp8,
                                const int block[2]) {
    dsk_tensor w;
    int64_t ss[2];
    dsk_status s;
    if (!fp8 || !thf_is_fp8(it->name, t)) {
        dsk_dtype d = strstr(it->name, "e_score_correction_bias") ? DSK_F32 : dt; /* f32 in the V3 release */
        if (t->dtype == d) {
            it->q = *t;
            it->q.owns = 0;
            return DSK_OK;
        }
        DSK__TRY(dsk_tensor_alloc(NULL, &it->q, d, t->ndim, t->shape));
        return dsk_tensor_copy(m->ctx, &it->q, t);
    }
    ss[0] = (t->shape[0] + block[0] - 1) / block[0];
    ss[1] = (t->shape[1] + block[1] - 1) / block[1];
    memset(&w, 0, sizeof w);
    snprintf(it->scale_name, sizeof it->scale_name, "%s_scale_inv", it->name);
    DSK__TRY(dsk_tensor_alloc(NULL, &w, DSK_F32, 2, t->shape));
    s = dsk_tensor_copy(m->ctx, &w, t);
    if (s == DSK_OK) s = dsk_tensor_alloc(NULL, &it->q, DSK_E4M3, 2, t->shape);
    if (s == DSK_OK) s = dsk_tensor_alloc(NULL, &it->scale, DSK_F32, 2, ss);
    if (s == DSK_OK) s = dsk_ckpt_hf_quantize_e4m3(&it->q, &it->scale, &w, block);
    dsk_tensor_free(NULL, &w);
    return s;
}

/* The entries expanded into one item per hub tensor (experts one by one). */
static dsk_status thf_items(tm_model *m, const thf_list *t, dsk_dtype dt, int fp8, const int block[2], thf_item *items,
                            int *n_items) {
    *n_items = 0;
    for (int i = 0; i < t->n; i++) {
        const dsk_safetensors_hf_entry *e = &t->es[i];
        int64_t count = e->stacked ? e->tensor->shape[0] : 1;
        for (int64_t k = 0; k < count; k++) {
            thf_item *it = &items[(*n_items)++];
            dsk_tensor v = *e->tensor;
            const char *at = strstr(e->name, "{E}");
            if (e->stacked) {
                DSK__TRY(dsk_tensor_select(e->tensor, k, &v));
                snprintf(it->name, sizeof it->name, "%.*s%lld%s", (int)(at - e->name), e->name,
                         (long long)(e->expert0 + k), at + 3);
            } else {
                snprintf(it->name, sizeof it->name, "%s", e->name);
            }
            DSK__TRY(thf_item_fill(m, it, &v, dt, fp8, block));
        }
    }
    return DSK_OK;
}

/* DeepseekV2 has no expert bias: refuses a model whose biases moved (its routing would change). */
static dsk_status thf_no_bias(tm_model *m) {
    for (int l = m->cfg.n_dense; l < tm_n_blocks(&m->cfg); l++) {
        if (!m->blocks[l].is_moe) continue;
        dsk_tensor h;
        dsk_status s = dsk_tensor_alloc(NULL, &h, DSK_F32, 1, m->blocks[l].moe_bias.shape);
        int nonzero = 0;
        if (s == DSK_OK) s = dsk_tensor_copy(m->ctx, &h, &m->blocks[l].moe_bias);
        for (int64_t e = 0; s == DSK_OK && e < h.shape[0]; e++) nonzero |= ((const float *)h.data)[e] != 0.0f;
        dsk_tensor_free(NULL, &h);
        if (s != DSK_OK) return s;
        if (nonzero)
            return dsk_set_error(DSK_ERR_UNSUPPORTED, "--export-hf: layer %d's expert bias is not zero, and "
                                                      "DeepseekV2 (softmax routing) has none", l);
    }
    return DSK_OK;
}

/* Writes config.json (h0: the imported config, or NULL) and the weights (dtype "f32", "bf16",
   or "fp8": e4m3 + weight_scale_inv) into dir (created if missing). Host memory: a copy of the
   weights in the export dtype (none for f32). */
static dsk_status thf_export(tm_model *m, const dsk_ckpt_hf_deepseek_config *h0, const char *dir, const char *dtype,
                             uint64_t max_shard_bytes) {
    dsk_ckpt_hf_deepseek_config h = thf_config_of(&m->cfg, h0);
    int fp8 = strcmp(dtype, "fp8") == 0, n_items = 0, k = 0, total = 0;
    dsk_dtype dt = strcmp(dtype, "bf16") == 0 ? DSK_BF16 : DSK_F32;
    thf_list t;
    thf_item *items = NULL;
    dsk_safetensors_hf_entry *out = NULL;
    dsk_status s;
    if (!fp8 && strcmp(dtype, "bf16") != 0 && strcmp(dtype, "f32") != 0)
        return dsk_set_error(DSK_ERR_ARG, "--export-dtype \"%s\": f32, bf16 or fp8", dtype);
    if (m->cfg.mla.attn != TMLA_ATTN_MLA) return dsk_set_error(DSK_ERR_UNSUPPORTED, "--export-hf: needs --attn mla");
    for (int i = 0; i < m->n_params; i++)
        if (!m->params[i].w.data)
            return dsk_set_error(DSK_ERR_UNSUPPORTED,
                                 "--export-hf: \"%s\" has no whole master on this rank (--zero 0 "
                                 "binds them)",
                                 m->params[i].name);
    if (m->cfg.n_dense < m->cfg.n_layers && m->blocks[m->cfg.n_dense].moe.n_local != m->cfg.moe.n_routed)
        return dsk_set_error(DSK_ERR_UNSUPPORTED, "--export-hf: experts are sharded over ranks (--ep > 1)");
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return dsk_set_error(DSK_ERR_IO, "--export-hf: cannot create \"%s\": %s", dir, strerror(errno));
    h.fp8 = fp8;
    if (h.block[0] < 1 || h.block[1] < 1) h.block[0] = h.block[1] = 128;
    snprintf(h.torch_dtype, sizeof h.torch_dtype, "%s", dt == DSK_BF16 ? "bfloat16" : "float32");
    if (h.version == 2) DSK__TRY(thf_no_bias(m));
    DSK__TRY(thf_list_make(m, h.version == 3, h.num_nextn_predict_layers > 0 ? 2 : 0, &t));
    for (int i = 0; i < t.n; i++) total += t.es[i].stacked ? (int)t.es[i].tensor->shape[0] : 1;
    items = (thf_item *)calloc((size_t)total + 1, sizeof *items);
    out = (dsk_safetensors_hf_entry *)calloc(2 * (size_t)total + 1, sizeof *out);
    s = items && out ? thf_items(m, &t, dt, fp8, h.block, items, &n_items)
                     : dsk_set_error(DSK_ERR_OOM, "--export-hf: out of memory for %d tensors", total);
    for (int i = 0; s == DSK_OK && i < n_items; i++) {
        out[k].name = items[i].name;
        out[k++].tensor = &items[i].q;
        if (!items[i].scale.data) continue;
        out[k].name = items[i].scale_name;
        out[k++].tensor = &items[i].scale;
    }
    if (s == DSK_OK) s = dsk_safetensors_hf_save(m->ctx, dir, out, k, NULL, 0, max_shard_bytes);
    if (s == DSK_OK) s = dsk_ckpt_hf_deepseek_config_write(&h, dir);
    for (int i = 0; items && i < n_items; i++) {
        dsk_tensor_free(NULL, &items[i].q);
        dsk_tensor_free(NULL, &items[i].scale);
    }
    free(items);
    free(out);
    thf_list_free(&t);
    return s;
}

#endif /* TRAIN_HF_H */
