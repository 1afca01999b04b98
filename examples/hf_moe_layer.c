/* hf_moe_layer.c - one MoE layer of a Hugging Face DeepSeek-V2/V3 checkpoint, loaded and run.

   What it shows: reading a published model's MoE layer into a dsk_moe layer, with no trainer:
     - dsk_ckpt_hf_deepseek_config_read reads config.json; its routing keys become dsk_moe_opts
       (V3: sigmoid scores, the group rule of the sum of the two best scores, the expert bias
       e_score_correction_bias; V2: softmax, the best score per group, no bias);
     - each parameter's hub name comes from dsk_ckpt_hf_deepseek_name (the layer's roles
       "router", "bias", "w1", ..., "shared.w3"); the hub keeps one tensor per expert
       (model.layers.L.mlp.experts.{E}.gate_proj.weight), dsk a stacked (E, F, D) tensor: an entry
       with stacked 1 reads them all into it;
     - dsk_safetensors_hf_open opens the sharded set (model.safetensors.index.json), and
       dsk_ckpt_hf_read_dequant checks every tensor's presence and shape before it reads any
       (FP8 weights with their weight_scale_inv blocks are dequantised on the way);
     - a forward on x ~ N(0, 1) from a seed.
   With --out FILE it saves x and y to a safetensors file (dsk_safetensors_save), for a reference
   implementation to compare (tests/test_teach.sh computes the layer in float64 in Python).

   Needs: dsk_tensor.h, dsk_comm.h (dsk_moe.h includes it), dsk_moe.h, dsk_safetensors.h and
   dsk_ckpt.h (its Hugging Face section, not compiled out by DSK_CKPT_NO_HF); link libdsk.a (the
   Makefile builds this file into build/examples/hf_moe_layer).
   Usage: hf_moe_layer DIR [--layer L (default: the first MoE layer)] [--tokens T (8)] [--seed S (1)]
                           [--out FILE] */
#include "dsk_tensor.h"
#include "dsk_moe.h"
#include "dsk_ckpt.h"

#include <stdio.h>
#include <stdlib.h>

static void check(dsk_status s, const char *call) { /* exits at the first failing call, naming it and why */
    if (s != DSK_OK) fprintf(stderr, "hf_moe_layer: %s: %s: %s\n", call, dsk_status_str(s), dsk_last_error()), exit(1);
}
#define CHECK(call) check((call), #call)

int main(int argc, char **argv) {
    const char *dir = NULL, *out = NULL;
    int layer = -1;
    int64_t T = 8;
    uint64_t seed = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--layer") && i + 1 < argc) layer = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) T = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc) seed = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--out") && i + 1 < argc) out = argv[++i];
        else if (!dir && argv[i][0] != '-') dir = argv[i];
        else {
            dir = NULL; /* anything else: the usage below */
            break;
        }
    }
    if (!dir || T < 1) {
        fprintf(stderr, "usage: hf_moe_layer DIR [--layer L] [--tokens T] [--seed S] [--out FILE]\n");
        return 2;
    }

    /* The configuration and the layer it describes. */
    dsk_ckpt_hf_deepseek_config h;
    CHECK(dsk_ckpt_hf_deepseek_config_read(&h, dir));
    if (layer < 0) layer = h.first_k_dense_replace;
    if (layer < h.first_k_dense_replace || layer >= h.num_hidden_layers + h.num_nextn_predict_layers ||
        layer % (h.moe_layer_freq > 0 ? h.moe_layer_freq : 1) != 0) { /* transformers' rule for an MoE layer */
        fprintf(stderr, "hf_moe_layer: layer %d is not an MoE layer of %s (from %d to %d, every %d)\n", layer, dir,
                h.first_k_dense_replace, h.num_hidden_layers + h.num_nextn_predict_layers - 1, h.moe_layer_freq);
        return 2;
    }
    int greedy = strcmp(h.topk_method, "greedy") == 0;
    dsk_moe_opts o;
    memset(&o, 0, sizeof o);
    o.d_model = h.hidden_size;
    o.n_routed = h.n_routed_experts;
    o.top_k = h.num_experts_per_tok;
    o.d_expert = h.moe_intermediate_size;
    o.n_shared = h.n_shared_experts;
    o.d_shared = h.moe_intermediate_size; /* the hub's shared_experts MLP: n_shared of these side by side */
    o.score = h.version == 3 ? DSK_MOE_SIGMOID : DSK_MOE_SOFTMAX;
    o.norm = h.norm_topk_prob ? DSK_MOE_NORM_ON : DSK_MOE_NORM_OFF;
    o.routed_scale = (float)h.routed_scaling_factor;
    o.n_group = greedy ? 1 : h.n_group;
    o.topk_group = greedy ? 1 : h.topk_group;
    o.group_rule = h.version == 3 ? DSK_MOE_GROUP_DEEPSEEK_V3 : DSK_MOE_GROUP_MAX;
    dsk_ctx ctx;
    CHECK(dsk_ctx_init(&ctx, NULL));
    dsk_moe moe;
    CHECK(dsk_moe_init(&moe, &ctx, &o));

    /* Each parameter in a tensor of its own, bound with dsk_moe_bind (moe_layer.c binds slabs
       instead), and its entry: the hub name and the bound value to read into. A trainable
       parameter's binding needs a gradient too, though nothing here runs backward. */
    dsk_tensor vals[DSK_MOE_N_PARAMS], grads[DSK_MOE_N_PARAMS];
    dsk_safetensors_hf_entry es[DSK_MOE_N_PARAMS];
    char names[DSK_MOE_N_PARAMS][160];
    int n = 0;
    memset(grads, 0, sizeof grads);
    for (int i = 0; i < moe.n_params; i++) {
        dsk_moe_param *p = &moe.params[i];
        const char *role = p->name + strlen(moe.opts.name) + 1; /* "moe.shared.w1" -> "shared.w1" */
        CHECK(dsk_tensor_alloc(&ctx, &vals[i], p->dtype, p->ndim, p->shape));
        if (p->trainable) CHECK(dsk_tensor_alloc(&ctx, &grads[i], DSK_F32, p->ndim, p->shape));
        CHECK(dsk_moe_bind(&moe, &ctx, i, &vals[i], p->trainable ? &grads[i] : NULL));
        if (p == moe.bias && h.version != 3) { /* V2 has no bias: 0 */
            CHECK(dsk_tensor_fill(&ctx, &vals[i], 0.0));
            continue;
        }
        CHECK(dsk_ckpt_hf_deepseek_name(names[n], sizeof names[n], layer, role));
        es[n] = (dsk_safetensors_hf_entry){names[n], &vals[i], p->expert_sharded, 0};
        printf("%-10s <- %s%s\n", role, names[n], p->expert_sharded ? " (experts stacked on dim 0)" : "");
        n++;
    }
    dsk_safetensors_hf hf;
    CHECK(dsk_safetensors_hf_open(&hf, dir));
    dsk_status s = dsk_ckpt_hf_read_dequant(&hf, &ctx, es, n, h.block);
    dsk_safetensors_hf_close(&hf);
    CHECK(s);

    /* A forward on fresh input. */
    int64_t sx[2] = {T, h.hidden_size};
    dsk_tensor x, y;
    CHECK(dsk_tensor_alloc(&ctx, &x, DSK_F32, 2, sx));
    CHECK(dsk_tensor_alloc(&ctx, &y, DSK_F32, 2, sx));
    CHECK(dsk_tensor_normal(&ctx, &x, seed, 0, 0.0f, 1.0f));
    moe.eval = 1; /* inference: count nothing toward the bias update */
    dsk_moe_stats st;
    CHECK(dsk_moe_forward(&moe, &ctx, &y, &x, &st));
    printf("layer %d of %s (DeepSeek-V%d): %lld tokens routed to %d of %d experts each; tokens per expert:", layer, dir,
           h.version, (long long)T, o.top_k, o.n_routed);
    for (int e = 0; e < o.n_routed; e++) printf(" %lld", (long long)st.tokens_per_expert[e]);
    printf("\n");

    if (out) {
        char lv[16];
        snprintf(lv, sizeof lv, "%d", layer);
        dsk_safetensors_entry se[2] = {{"x", &x}, {"y", &y}};
        dsk_safetensors_kv kv[1] = {{"layer", lv}};
        CHECK(dsk_safetensors_save(&ctx, out, se, 2, kv, 1));
        printf("x and y saved in %s\n", out);
    }

    int n_params = moe.n_params;
    dsk_moe_free(&moe, &ctx); /* the layer never frees what was bound to it: */
    for (int i = 0; i < n_params; i++) dsk_tensor_free(&ctx, &vals[i]), dsk_tensor_free(&ctx, &grads[i]);
    dsk_tensor_free(&ctx, &x);
    dsk_tensor_free(&ctx, &y);
    dsk_ctx_free(&ctx);
    return 0;
}
