/* dsk_ckpt.h - sharded, atomic, verified checkpoints in the safetensors format; async and
   incremental saves; resume with any sharding (another world size, rows, columns, 2-D);
   DeepSeek models in Hugging Face's layout in and out. The files themselves are read and
   written by dsk_safetensors.h, which this header includes and builds on.

   Usage: #define DSK_CKPT_IMPLEMENTATION in exactly one .c file before including (after
   DSK_TENSOR_IMPLEMENTATION's file, or in the same one); it compiles dsk_safetensors.h's
   implementation too, in the same file (so do not define DSK_SAFETENSORS_IMPLEMENTATION in
   another one). Needs POSIX 2008 (files, pthreads), which the dsk headers ask for themselves:
   in that file, put the DSK_*_IMPLEMENTATION defines and the dsk includes (in any order among
   themselves) before any system header, or build with -D_GNU_SOURCE or
   -D_POSIX_C_SOURCE=200809L (where a system header came first and hid POSIX, as under glibc
   with -std=c11, the build stops at an #error that says so).
   Options: DSK_STATIC, DSK_MALLOC/DSK_FREE, DSK_CUDA as in dsk_tensor.h; DSK_CKPT_NO_HF leaves
   out the Hugging Face DeepSeek section (config.json, hub names, FP8 blocks); dsk_safetensors.h's
   DSK_SAFETENSORS_NO_SSE42. dsk_ckpt_options() names the ones the implementation was built with.

   Layout of a checkpoint directory DIR (shared by every rank, e.g. a network file system):
     DIR/step_00001000/rank_00000.<nonce>.safetensors  one file per rank and save; the nonce
                                                     (16 hex digits) is new for every save
     DIR/step_00001000/manifest.json                 written last by rank 0: marks completeness
     DIR/latest                   "step_00001000\n": the last completed save, for people and
                                  scripts (dsk_ckpt_latest reads the manifests instead)
   Every file is written to a temporary name in its directory and renamed into place; rank
   files and manifests are fsynced, then their directory. A step directory without
   manifest.json is incomplete and is never loaded. Each rank file's __metadata__ holds
   "dsk.format", "dsk.version", "dsk.step", "dsk.rank", "dsk.world_size", "dsk.attempt" (the
   nonce), "dsk.crc32c.<tensor>" (CRC32C of the tensor's bytes, 8 hex digits),
   "dsk.blocks.<tensor>" (CRC32C of each 1 MiB of it: "1048576:" then 8 hex digits per block),
   "dsk.box.<tensor>" (for a piece of a split tensor, "o0,o1,..;g0,g1,..": where it starts in
   the whole tensor and the whole tensor's shape), "dsk.name.<tensor>" (see below) and the
   caller's key/value pairs (trainer state: loss scale, RNG state, data position, ...).
   <tensor> is the key a piece has in its file: the tensor's name where the file holds one
   piece of it; where a rank saves several boxes of one name, each is keyed
   "<name>@<o0>,<o1>,..." (its offset in the whole tensor) and "dsk.name.<key>" holds the name.
   Readers find a piece by (name, box): under the name, else under that key, so files with one
   piece per name read as they always did. The manifest lists the files (step,
   rank, nonce, size, CRC32C of the whole file), the step, the save's generation (1 + the
   largest in DIR, so it orders the saves), the world size and each tensor's dtype, whole
   shape and slices [file, offset..., shape...]; its last line holds the CRC32C of the text
   before it.
   Incremental saves (opts.incremental): each piece's 64-bit content hash goes into its file
   ("dsk.hash.<tensor>") and the manifest's slice; a piece whose hash, dtype and box equal the
   base checkpoint's (the most recent complete save) is not written again: its file records
   "dsk.reuse.<tensor>" and the manifest points to the earlier file, listed after this save's
   own. Rotation and reclaiming keep every file a live checkpoint references; dsk_ckpt_merge
   compacts a checkpoint back into its own directory.

   The commit point of a save is the rename of manifest.json into place by rank 0 (and the
   fsync of its directory). Before it nothing that exists is changed or removed, so a failure
   anywhere (any rank, a full disk, a kill) leaves every earlier checkpoint loadable, an
   earlier save of the same step included. From it on the save has happened and returns
   DSK_OK: what follows (the `latest` pointer, the files of an earlier save of this step,
   rotation) is housekeeping, reported by dsk_ckpt_last_save, never as the save's status.

   Saving (every rank calls dsk_ckpt_save with the same step): a tensor is either whole
   (DSK_CKPT_WHOLE: written once, by rank 0) or a piece of a split one (DSK_CKPT_ROWS: rows
   [row0, row0 + shape[0]) of global_rows; DSK_CKPT_BOX: any box, for column-parallel or 2-D
   sharding); the pieces of one name must tile the whole tensor. A rank may pass several ROWS or
   BOX entries of one name (disjoint boxes of the same dtype and whole shape; an overlap is an
   error naming both boxes); a whole tensor's name appears once. Ranks meet at three calls of
   the barrier callback (prepare, files durable, manifest durable); every rank makes all three
   calls even when its own part failed, so a failure anywhere leaves no manifest and every
   rank sees an error. Rank 0 hands the save's nonce to the others in DIR/.attempt; one job
   saves into a directory at a time (rank 0 holds DIR/.lock). With dsk_ckpt_save_async the
   barrier runs on a background thread.
   Collective outcome: with opts.agree (an all-reduce of a few int64 words, in place of the
   barrier) a save and a load give every rank the same status and message: the first failing
   rank's, named ("rank 3: ... \"step_00000100/rank_00003....safetensors\" is missing"); a
   load of the newest falls back to an older checkpoint on every rank together. With the
   barrier alone a save still ends alike on every rank (it succeeded exactly when the
   manifest of this save exists; rank 0 writes why it failed to DIR/.outcome.<nonce>, which
   the others report), but a load is each rank's own and never falls back on several ranks.
   With dsk_comm.h the barrier and the agreement are one line each, on a communicator of their
   own (dsk_comm_split) so that an async save never shares one with training's collectives:
     static dsk_status ckpt_barrier(void *c) { return dsk_comm_barrier((dsk_comm *)c, NULL); }
   (the agreement: see dsk_ckpt_agree_fn; NCCL needs its words in device memory).
   Loading reads any checkpoint into tensors of any split: a rank asks for a box of the whole
   tensor and the loader reads it from whichever files hold it (resharding 4 -> 2, 2 -> 4,
   rows -> columns, ...), reading only the 1 MiB blocks it needs and checking dtype, shape and
   every block's CRC32C on the way.

   Example (given dsk_tensor *embed, dsk_tensor *w1, int64_t row0, int64_t n_experts, int64_t step):
     dsk_ckpt ck; dsk_ckpt_opts o; memset(&o, 0, sizeof o); o.keep_last = 3;
     if (dsk_ckpt_init(&ck, "runs/ckpt", &o) != DSK_OK) return 1;   // dsk_last_error() says why
     dsk_ckpt_entry e[2] = {{"embed", embed, DSK_CKPT_WHOLE, 0, 0, NULL, NULL},
                            {"moe.w1", w1, DSK_CKPT_ROWS, row0, n_experts, NULL, NULL}};
     dsk_ckpt_kv kv[1] = {{"loss_scale", "65536"}};
     dsk_status st = dsk_ckpt_save_async(&ck, step, e, 2, kv, 1);
     // ... train on while the writer thread saves ...
     if (st == DSK_OK) st = dsk_ckpt_wait(&ck);
     int64_t last = -1;                                             // resuming:
     if (st == DSK_OK) st = dsk_ckpt_latest("runs/ckpt", &last);   // -1: none yet, start at step 0
     dsk_ckpt_meta meta;
     if (st == DSK_OK && last >= 0 && (st = dsk_ckpt_load(&ck, -1, e, 2, &meta)) == DSK_OK) {
         step = meta.step;                                          // the newest checkpoint that loads
         dsk_ckpt_meta_free(&meta);
     }
     dsk_ckpt_free(&ck);
     return st;
   End of example.
   Resuming loads step -1, not the step dsk_ckpt_latest names: load(-1) passes over damaged
   checkpoints (a truncated or altered file, a bad manifest; meta.n_skipped says how many) and
   meta.step is the step it loaded, while dsk_ckpt_latest reads the manifests only, so its step
   may be a checkpoint whose files are damaged.
   Cost: a save passes over each byte once (CRC32C on 1 MiB blocks just before writing them,
   about 10 GB/s with SSE4.2), so it runs at the disk's write speed plus a few fsyncs; an
   async save stalls the caller for one memory copy of this rank's tensors (the snapshot
   buffer is kept for the next save). Loads read straight into contiguous host tensors of the
   saved dtype and check each 1 MiB block's CRC32C as it arrives.
   Single files and Hugging Face's sharded sets: dsk_safetensors.h (dsk_safetensors_open,
   dsk_safetensors_hf_open, ...); a rank file is one of its files and opens with it.
   Byte order: little-endian hosts only (the format is little-endian).
   License: MIT, see the end of the file. */
/* Contents
     declarations
       checkpoints               dsk_ckpt_kv, DSK_CKPT_WHOLE/ROWS/BOX, dsk_ckpt_entry, dsk_ckpt_barrier_fn,
                                 dsk_ckpt_agree_fn, dsk_ckpt_opts, dsk_ckpt_save_info, dsk_ckpt, dsk_ckpt_meta,
                                 dsk_ckpt_info, dsk_ckpt_init/free/save/save_async/wait/last_save/merge/load/
                                 latest/list/verify, dsk_ckpt_meta_get/i64/f64/free
       Hugging Face DeepSeek     dsk_ckpt_hf_deepseek_name, dsk_ckpt_hf_deepseek_config(_read/_write),
       (unless DSK_CKPT_NO_HF)   dsk_ckpt_hf_deepseek_role_name, dsk_ckpt_hf_read_dequant, dsk_ckpt_hf_quantize_e4m3
       options                   dsk_ckpt_options
     implementation (DSK_CKPT_IMPLEMENTATION, on dsk_safetensors.h's)
       content hash; rank files; checkpoint directories; manifests; writing manifests (rank 0); the
       directory's checkpoints (scan, rotation, lock, reclaiming); collective save (agreement,
       protocol, incremental); reading checkpoints (load, fallback, merge, latest, list, verify);
       Hugging Face DeepSeek models; metadata; options */
#if defined(DSK_CKPT_IMPLEMENTATION) && !defined(_POSIX_C_SOURCE) && !defined(_GNU_SOURCE) && !defined(_XOPEN_SOURCE)
#define _POSIX_C_SOURCE 200809L
#endif
/* With DSK_STATIC every dsk function is static, so this file must also compile dsk_tensor.h's. */
#if defined(DSK_STATIC) && defined(DSK_CKPT_IMPLEMENTATION) && !defined(DSK_TENSOR_IMPLEMENTATION)
#define DSK_TENSOR_IMPLEMENTATION
#endif
/* The checkpoint implementation calls dsk_safetensors.h's private functions: one file. */
#if defined(DSK_CKPT_IMPLEMENTATION) && !defined(DSK_SAFETENSORS_IMPLEMENTATION)
#define DSK_SAFETENSORS_IMPLEMENTATION
#endif
#include "dsk_safetensors.h"
#ifndef DSK_CKPT_H
#define DSK_CKPT_H

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- checkpoints */

#define DSK_CKPT_FORMAT DSK_SAFETENSORS_FORMAT /* manifests carry the mark of the files they list */
#define DSK_CKPT_VERSION DSK_SAFETENSORS_VERSION

/* One string key/value pair of trainer state: a pair of the rank files' __metadata__. Keys
   starting with "dsk." are reserved. */
typedef dsk_safetensors_kv dsk_ckpt_kv;

/* How a rank's tensor sits in the whole tensor (dsk_ckpt_entry.split). */
enum {
    DSK_CKPT_WHOLE = 0, /* the whole tensor, the same on every rank: rank 0 writes it */
    DSK_CKPT_ROWS = 1,  /* rows [row0, row0 + shape[0]) of a tensor of global_rows rows */
    DSK_CKPT_BOX = 2    /* the box [offset[d], offset[d] + shape[d]) of a tensor of global_shape */
};

/* One named tensor to save or to load into. Saving: the pieces the ranks pass for one name
   must tile the whole tensor, each element saved by exactly one rank (with data parallelism,
   let one replica pass the split entries). Loading: any rank asks for any box. */
typedef struct dsk_ckpt_entry {
    const char *name;            /* non-empty UTF-8, not "__metadata__"; unique but for several
                                    DSK_CKPT_ROWS/BOX boxes of one tensor (see the top) */
    dsk_tensor *tensor;          /* this rank's data: any device, dtype and strides */
    int split;                   /* DSK_CKPT_WHOLE, DSK_CKPT_ROWS or DSK_CKPT_BOX */
    int64_t row0;                /* DSK_CKPT_ROWS: first global row this rank holds */
    int64_t global_rows;         /* DSK_CKPT_ROWS: rows of the whole tensor */
    const int64_t *offset;       /* DSK_CKPT_BOX: tensor->ndim values, where this rank's box starts */
    const int64_t *global_shape; /* DSK_CKPT_BOX: tensor->ndim values, the whole tensor's shape */
} dsk_ckpt_entry;

/* Blocks until every rank has called it (same count on every rank); DSK_OK or an error. */
typedef dsk_status (*dsk_ckpt_barrier_fn)(void *user);
/* Agreement: every rank passes n int64 words (each >= 0) and receives, in place, the
   element-wise maximum over all ranks; called the same number of times with the same n on
   every rank, so it is a barrier too. One all-reduce, e.g. with dsk_comm.h:
     static dsk_status agree(void *c, int64_t *w, int n) {
         return dsk_comm_all_reduce((dsk_comm *)c, NULL, w, w, n, DSK_I64, DSK_COMM_MAX); } */
typedef dsk_status (*dsk_ckpt_agree_fn)(void *user, int64_t *words, int n);

/* Zero fields take the defaults in brackets. */
typedef struct dsk_ckpt_opts {
    int rank;                    /* [0] this process's rank */
    int world_size;              /* [1] ranks saving together */
    dsk_ckpt_barrier_fn barrier; /* world_size > 1: this or agree is required */
    void *barrier_user;          /* passed to barrier */
    dsk_ckpt_agree_fn agree;     /* [NULL] makes saves and loads collective: every rank gets the
                                    same status and message (see the top of the file) */
    void *agree_user;            /* passed to agree */
    int keep_last;               /* [0 = keep all] K > 0: after a save, rank 0 deletes the
                                    complete checkpoints but the K most recently saved */
    int allow_cast;              /* [0] load: convert a saved dtype to the tensor's dtype
                                    instead of failing (floats round to nearest even) */
    dsk_ctx *ctx;                /* [NULL] context for CUDA tensors */
    int snapshot_threads;        /* [1] OpenMP threads copying host tensors for an async save
                                    (more help on an idle many-core node, hurt on a busy one) */
    int read_only;               /* [0] 1: never write or remove anything (reading checkpoints
                                    another job writes): init reclaims nothing, saves fail */
    int incremental;             /* [0] 1: a save writes only the pieces whose content changed
                                    since the most recent checkpoint and references the rest */
} dsk_ckpt_opts;

/* What the last save did (dsk_ckpt_last_save); counts are this rank's. */
typedef struct dsk_ckpt_save_info {
    int64_t step;                /* -1 before the first save */
    uint64_t generation;         /* the save's place in the directory's history (rank 0) */
    uint64_t bytes_written;      /* tensor bytes this rank wrote */
    int tensors_written;
    uint64_t bytes_reused;       /* incremental: tensor bytes unchanged since the base checkpoint,
                                    referenced instead of written */
    int tensors_reused;
    dsk_status cleanup;          /* rank 0: housekeeping after the commit point (latest pointer,
                                    rotation); never the save's status */
    char cleanup_error[1024];    /* its message when cleanup != DSK_OK */
} dsk_ckpt_save_info;

/* A checkpointer for one directory. Caller-owned; fields are private. */
typedef struct dsk_ckpt {
    char *dir;
    dsk_ckpt_opts opts;
    void *stage;         /* host snapshot buffer, reused across async saves */
    size_t stage_bytes;
    void *job;           /* the pending async save, NULL when idle */
    uint64_t n_saves;    /* saves started, the same count on every rank */
    dsk_ckpt_save_info last;
} dsk_ckpt;

/* Metadata of a loaded rank file (this rank's file if it exists in the checkpoint, else
   rank 0's): the caller's pairs plus "dsk.format", "dsk.step", "dsk.rank", "dsk.world_size". */
typedef struct dsk_ckpt_meta {
    int64_t step;
    uint64_t generation; /* the save's place in the directory's history */
    int world_size;      /* world size the checkpoint was saved with */
    int rank;            /* rank whose file the pairs come from */
    int n;
    char **keys;
    char **values;
    int n_skipped;       /* a load of the newest: how many newer checkpoints were damaged (their
                            files, or their manifests: those of larger steps) */
    int64_t skipped_step; /* the largest step of those, or -1 */
    char *skipped_error; /* why it could not be loaded, or NULL */
} dsk_ckpt_meta;

/* A complete checkpoint (dsk_ckpt_list). */
typedef struct dsk_ckpt_info {
    int64_t step;
    uint64_t generation; /* larger: saved later */
    int world_size;
    int n_files;         /* files it reads, earlier saves' included */
} dsk_ckpt_info;

/* dir: the checkpoint root (rank 0 creates it at the first save; its parent must exist).
   Checks the options. Rank 0 (unless read_only) then reclaims what dead saves left in dir:
   the files of every incomplete step directory and every file no complete checkpoint
   references, when it can take dir's lock (a live writer holds it: nothing is touched). */
DSK_API dsk_status dsk_ckpt_init(dsk_ckpt *ck, const char *dir, const dsk_ckpt_opts *opts);
/* Waits for a pending async save (its error is dropped: call dsk_ckpt_wait first to see it)
   and releases everything. Zeroed or freed objects are fine. */
DSK_API void dsk_ckpt_free(dsk_ckpt *ck);

/* Saves DIR/step_<step>/ collectively (see the top of the file) and returns when it is
   complete and durable on every rank. Waits first for a pending async save and returns its
   error, if any, without saving. step >= 0. kv may be NULL when n_kv is 0. Saving a step
   that exists replaces it at the commit point; until then the old one stays loadable. */
DSK_API dsk_status dsk_ckpt_save(dsk_ckpt *ck, int64_t step, const dsk_ckpt_entry *entries, int n,
                                 const dsk_ckpt_kv *kv, int n_kv);
/* As dsk_ckpt_save, but returns once the tensors, names and pairs are copied to host memory
   (device tensors through dsk_tensor_copy); a background thread writes. The caller may change
   or free the tensors at once. dsk_ckpt_wait reports the outcome. */
DSK_API dsk_status dsk_ckpt_save_async(dsk_ckpt *ck, int64_t step, const dsk_ckpt_entry *entries, int n,
                                       const dsk_ckpt_kv *kv, int n_kv);
/* Joins the pending async save, if any, and returns its status (its message in dsk_last_error). */
DSK_API dsk_status dsk_ckpt_wait(dsk_ckpt *ck);
/* What the last completed save did (step -1 before any); valid until the next save or wait. */
DSK_API const dsk_ckpt_save_info *dsk_ckpt_last_save(const dsk_ckpt *ck);
/* Compacts checkpoint `step` (of incremental saves: its manifest references earlier saves'
   files) into one whose files all lie in its own step directory, one per rank, holding every
   piece that rank's files held, each checked on the way. It keeps its step, generation and
   metadata; the new manifest replaces the old one at once, then files no checkpoint
   references any more are reclaimed. One process calls it (rank 0, or a tool) while no save
   runs: it takes DIR's lock. */
DSK_API dsk_status dsk_ckpt_merge(dsk_ckpt *ck, int64_t step);

/* Loads DIR/step_<step>/ into `entries`: each tensor is looked up by name and must match the
   saved dtype (or opts.allow_cast) and the saved global shape; DSK_CKPT_ROWS and DSK_CKPT_BOX
   entries receive their box of it. Every byte read is checked against its CRC32C and every
   file header against the manifest. step < 0: the most recent complete save; when its files
   are damaged (a CRC32C fails, a file is missing) the next most recent, and so on, with
   meta->n_skipped, skipped_step and skipped_error telling what was passed over (on one rank,
   or on every rank together with opts.agree; without it a rank of several never falls back
   alone: it returns the damage); manifests that fail their checks count as damaged saves of
   their step. A step that was never saved is DSK_ERR_ARG, naming the checkpoints there are;
   one whose save did not finish (no manifest) is DSK_ERR_CORRUPT. meta (may be NULL)
   receives the metadata; free it with dsk_ckpt_meta_free. On error the entries' contents
   are unspecified. With opts.agree and
   world_size > 1 every rank must call it (it agrees on the outcome); else it is each rank's
   own and safe to call concurrently on several ranks, with no barrier. */
DSK_API dsk_status dsk_ckpt_load(dsk_ckpt *ck, int64_t step, const dsk_ckpt_entry *entries, int n, dsk_ckpt_meta *meta);

/* Step of the most recent complete save under dir (the largest generation: after a rollback,
   the step saved since, not a larger step saved before), or -1 when there is none (dir
   missing included). It reads the manifests only: an incomplete checkpoint or one whose
   manifest is damaged is skipped, but the rank files are not opened, so the step may be of a
   checkpoint whose files are damaged. To resume, load step -1 (dsk_ckpt_load), which passes
   over those too; dsk_ckpt_verify reads a checkpoint in full. A directory or a manifest that
   cannot be read (permissions, I/O error, out of memory) is an error. */
DSK_API dsk_status dsk_ckpt_latest(const char *dir, int64_t *step);
/* The complete checkpoints under dir, most recent save first: *n of them, the first
   min(*n, cap) written to out (out may be NULL when cap is 0). Errors as dsk_ckpt_latest. */
DSK_API dsk_status dsk_ckpt_list(const char *dir, dsk_ckpt_info *out, int cap, int *n);
/* Reads every file of checkpoint `step` in full and checks the manifest (its own CRC32C, its
   tensors against the files), sizes, headers and all CRC32Cs. */
DSK_API dsk_status dsk_ckpt_verify(const char *dir, int64_t step);

/* Value of key or NULL. */
DSK_API const char *dsk_ckpt_meta_get(const dsk_ckpt_meta *m, const char *key);
/* The value parsed as a whole decimal integer / as a double (strtod: "%.17g" and "%a" exact). */
DSK_API dsk_status dsk_ckpt_meta_i64(const dsk_ckpt_meta *m, const char *key, int64_t *out);
DSK_API dsk_status dsk_ckpt_meta_f64(const dsk_ckpt_meta *m, const char *key, double *out);
DSK_API void dsk_ckpt_meta_free(dsk_ckpt_meta *m);

/* ---------------------------------------------------------------- Hugging Face DeepSeek models */
#ifndef DSK_CKPT_NO_HF

/* The DeepSeek-V2/V3 name (transformers' DeepseekV3 layout) of dsk_moe parameter `moe_param`
   of layer `layer`: "router" -> model.layers.L.mlp.gate.weight, "bias" -> ...mlp.gate.
   e_score_correction_bias, "w1"/"w3"/"w2" -> ...mlp.experts.{E}.gate_proj/up_proj/down_proj.
   weight (stacked: use with stacked 1), "shared.w1"/"shared.w3"/"shared.w2" -> ...mlp.
   shared_experts.gate_proj/up_proj/down_proj.weight. dsk's (E, F, D) w1 and w3 and (E, D, F)
   w2 hold the same matrices as those (F, D) and (D, F) tensors, expert by expert. */
DSK_API dsk_status dsk_ckpt_hf_deepseek_name(char *buf, size_t n, int layer, const char *moe_param);

/* The keys of a DeepSeek-V2/V3 config.json (transformers' DeepseekV2Config / DeepseekV3Config,
   the hub's spelling). dsk_ckpt_hf_deepseek_config_read requires every key below except those
   marked optional (default in brackets); a missing or mistyped key, an unknown architecture,
   topk_method, scoring_func or rope_scaling type fails naming the file and the key. */
typedef struct dsk_ckpt_hf_deepseek_config {
    int version;                          /* architectures: 2 DeepseekV2ForCausalLM, 3 DeepseekV3ForCausalLM */
    int64_t vocab_size, hidden_size, intermediate_size, moe_intermediate_size;
    int num_hidden_layers, first_k_dense_replace, moe_layer_freq;
    int n_routed_experts, n_shared_experts, num_experts_per_tok;
    int n_group, topk_group;              /* null: 1 */
    char topk_method[24];                 /* greedy | group_limited_greedy | noaux_tc */
    char scoring_func[16];                /* softmax | sigmoid */
    int norm_topk_prob;
    double routed_scaling_factor;
    int q_lora_rank;                      /* null: 0 (a plain q_proj) */
    int kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, num_attention_heads;
    double rope_theta, rms_norm_eps;
    int yarn;                             /* rope_scaling {"type": "yarn", ...} given [0: null] */
    double rope_factor, mscale, mscale_all_dim, beta_fast, beta_slow;
    int64_t original_max_position_embeddings;
    int tie_word_embeddings;              /* optional [0] */
    int num_nextn_predict_layers;         /* optional [0] */
    int64_t max_position_embeddings;      /* optional [0: not written] */
    int64_t bos_token_id, eos_token_id;   /* optional [-1: null] */
    int fp8;                              /* quantization_config {"quant_method": "fp8", "fmt": "e4m3"} [0] */
    int block[2];                         /* its weight_block_size [128, 128] */
    char torch_dtype[16];                 /* optional [""]; written as given ("bfloat16", "float32") */
} dsk_ckpt_hf_deepseek_config;

/* Reads dir/config.json into c (zeroed first). */
DSK_API dsk_status dsk_ckpt_hf_deepseek_config_read(dsk_ckpt_hf_deepseek_config *c, const char *dir);
/* Writes dir/config.json (atomically) with every key above in the hub's spelling, plus the
   ones transformers needs to build the model (model_type, architectures, hidden_act,
   num_key_value_heads, attention_bias, rope_interleave for V3). */
DSK_API dsk_status dsk_ckpt_hf_deepseek_config_write(const dsk_ckpt_hf_deepseek_config *c, const char *dir);
/* The hub name of a non-MoE DeepSeek tensor, by role. Layer roles (layer >= 0, the MTP layer
   being num_hidden_layers + k): "ln1" input_layernorm, "ln2" post_attention_layernorm,
   "attn.wq" q_proj, "attn.wq_a" q_a_proj, "attn.q_norm" q_a_layernorm, "attn.wq_b" q_b_proj,
   "attn.wkv_a" kv_a_proj_with_mqa (rows [kv latent | rope key]), "attn.kv_norm" kv_a_layernorm,
   "attn.wkv_b" kv_b_proj (per head [k_nope | v]), "attn.wo" o_proj, "ffn.w1"/"ffn.w3"/"ffn.w2"
   mlp.gate_proj/up_proj/down_proj, MTP "mtp.enorm", "mtp.hnorm", "mtp.proj" (eh_proj: columns
   [enorm(emb) | hnorm(h)]), "mtp.norm" (shared_head.norm), "mtp.embed" (the MTP layer's own
   embed_tokens), "mtp.head" (shared_head.head: its own LM head); the MoE roles of
   dsk_ckpt_hf_deepseek_name. Model roles (layer -1): "embed" model.embed_tokens, "ln_f"
   model.norm, "lm_head". Every matrix is (out, in) as nn.Linear stores it; the rope dims of
   q_b_proj/q_proj and kv_a_proj_with_mqa are in DeepSeek's interleaved pair order, which
   transformers reads with rope_interleave (V3) or its complex rotation (V2) and dsk_rope rotates
   as they are: no permutation. */
DSK_API dsk_status dsk_ckpt_hf_deepseek_role_name(char *buf, size_t n, int layer, const char *role);
/* Checks, then reads, every entry like dsk_safetensors_hf_read with casts allowed, except that a file
   tensor stored as F8_E4M3 with a companion "<name>_scale_inv" (f32, (ceil(rows / block[0]),
   ceil(cols / block[1]))) is read as w * scale_inv of its block (edge blocks partial), each
   product in f32, then rounded to the entry's dtype (the DeepSeek-V3 release's layout). Every
   tensor's presence, shape and scale are checked before any is read, so a missing or misshapen
   tensor or a truncated shard fails naming the file and tensor with nothing read. */
DSK_API dsk_status dsk_ckpt_hf_read_dequant(dsk_safetensors_hf *h, dsk_ctx *ctx,
                                            const dsk_safetensors_hf_entry *entries, int n, const int block[2]);
/* q (R, C) e4m3 and scale_inv (ceil(R / block[0]), ceil(C / block[1])) f32 from w (R, C) f32, all
   host tensors: scale_inv = amax / 448 of each block (1 for an all-zero block), q = e4m3(w /
   scale_inv) rounded to nearest even (as the V3 release's weights are laid out). */
DSK_API dsk_status dsk_ckpt_hf_quantize_e4m3(dsk_tensor *q, dsk_tensor *scale_inv, const dsk_tensor *w,
                                             const int block[2]);
#endif /* DSK_CKPT_NO_HF */

/* ---------------------------------------------------------------- options */

/* The compile-out switches the implementation was built with, its own and dsk_safetensors.h's,
   space-separated, "" for none: "DSK_CKPT_NO_HF DSK_SAFETENSORS_NO_SSE42". */
DSK_API const char *dsk_ckpt_options(void);

#ifdef __cplusplus
}
#endif
#endif /* DSK_CKPT_H */


/* ==================================================================== implementation */
#ifdef DSK_CKPT_IMPLEMENTATION
#ifndef DSK_CKPT_IMPLEMENTATION_DONE
#define DSK_CKPT_IMPLEMENTATION_DONE
/* glibc hid POSIX 2008 when a system header came before the dsk headers in this file. */
#if defined(__GLIBC__) && !defined(__USE_XOPEN2K8) /* glibc's mark of POSIX 2008 */
#error "dsk_ckpt.h needs POSIX 2008: put the DSK_*_IMPLEMENTATION defines and dsk includes before any system header, \
or compile with -D_GNU_SOURCE"
#endif

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

/* Open-file-description locks where present (a lock that belongs to the open file, so a second
   handle in the same process conflicts with it and closing some other descriptor of the file
   does not drop it). glibc declares them only under _GNU_SOURCE, and dsk_tensor.h asks for
   POSIX 2008; their kernel interface is fixed, so on 64-bit Linux they are named here when hidden. */
#if defined(F_OFD_SETLK)
#define DSK__CKPT_SETLK F_OFD_SETLK
#elif defined(__linux__) && defined(__LP64__)
#define DSK__CKPT_SETLK 37 /* F_OFD_SETLK in every Linux architecture's fcntl.h */
#else
#define DSK__CKPT_SETLK F_SETLK
#endif

/* ---------------------------------------------------------------- content hash
   What an incremental save compares to find unchanged tensors (a CRC32C's 2^-32 chance to
   miss a change is too much there): the polynomial hash over the field of p = 2^61 - 1 of
   the bytes as little-endian 32-bit values v_0..v_{m-1}, zero-padded to a multiple of 4,
   then the byte count n: H = (sum_i v_i B^(m-1-i)) B + n mod p, B fixed. Two different
   contents of equal length collide for at most m/4 of the bases B < p, and carry the same
   CRC32C too; four interleaved lanes (multiplier B^4) compute the same H. */

#if !defined(__SIZEOF_INT128__)
#error "dsk_ckpt.h: the content hash needs a compiler with unsigned __int128 (GCC, Clang)"
#endif

#define DSK__CKPT_P61 0x1fffffffffffffffull
#define DSK__CKPT_HASH_B 0x0a5e3c9d17f2468bull /* < p */

static uint64_t dsk__ckpt_mod61(uint64_t r) {
    r = (r & DSK__CKPT_P61) + (r >> 61);
    return r >= DSK__CKPT_P61 ? r - DSK__CKPT_P61 : r;
}
/* a * b + c mod p, for a, b < p and c < 2^32. */
static uint64_t dsk__ckpt_muladd61(uint64_t a, uint64_t b, uint64_t c) {
    unsigned __int128 x = (unsigned __int128)a * b + c;
    return dsk__ckpt_mod61(((uint64_t)x & DSK__CKPT_P61) + (uint64_t)(x >> 61));
}

static uint64_t dsk__ckpt_hash(const unsigned char *p, size_t n) {
    const uint64_t B = DSK__CKPT_HASH_B, B2 = dsk__ckpt_muladd61(B, B, 0), B3 = dsk__ckpt_muladd61(B2, B, 0);
    const uint64_t B4 = dsk__ckpt_muladd61(B3, B, 0);
    uint64_t l0 = 0, l1 = 0, l2 = 0, l3 = 0, h;
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        uint32_t v[4];
        memcpy(v, p + i, 16); /* little-endian hosts only (see the top of the file) */
        l0 = dsk__ckpt_muladd61(l0, B4, v[0]);
        l1 = dsk__ckpt_muladd61(l1, B4, v[1]);
        l2 = dsk__ckpt_muladd61(l2, B4, v[2]);
        l3 = dsk__ckpt_muladd61(l3, B4, v[3]);
    }
    if (i < n) { /* the tail, zero-padded to 16 bytes */
        uint32_t v[4] = {0, 0, 0, 0};
        memcpy(v, p + i, n - i);
        l0 = dsk__ckpt_muladd61(l0, B4, v[0]);
        l1 = dsk__ckpt_muladd61(l1, B4, v[1]);
        l2 = dsk__ckpt_muladd61(l2, B4, v[2]);
        l3 = dsk__ckpt_muladd61(l3, B4, v[3]);
    }
    h = dsk__ckpt_mod61(dsk__ckpt_muladd61(l0, B3, 0) + dsk__ckpt_muladd61(l1, B2, 0));
    h = dsk__ckpt_mod61(h + dsk__ckpt_muladd61(l2, B, 0) + l3);
    return dsk__ckpt_mod61(dsk__ckpt_muladd61(h, B, 0) + (uint64_t)n % DSK__CKPT_P61);
}

/* ---------------------------------------------------------------- rank files
   A rank file is a safetensors file written by dsk_safetensors.h's writer whose __metadata__
   also holds the save's step, rank, world size and nonce, each split piece's box in its whole
   tensor and, in incremental saves, each piece's content hash ("dsk.hash.<tensor>") or, for a
   piece an earlier file holds, the mark "dsk.reuse.<tensor>" in place of its data. The writer
   gets each piece under its key (the name, or "<name>@<offset>" with "dsk.name.<key>" for one
   of several boxes of a name: see the top); the keys are this file's protocol, not the codec's. */

static int dsk__ckpt_cmp_entry_name(const void *a, const void *b) {
    return strcmp((*(const dsk_ckpt_entry *const *)a)->name, (*(const dsk_ckpt_entry *const *)b)->name);
}

/* A repeated name, or NULL: names are unique, except that a rank file may hold several boxes
   (DSK_CKPT_ROWS and DSK_CKPT_BOX entries) of one name. Sorts by_name. */
static const char *dsk__ckpt_dup_name(const dsk_ckpt_entry **by_name, int n) {
    qsort((void *)by_name, (size_t)n, sizeof *by_name, dsk__ckpt_cmp_entry_name);
    for (int i = 1; i < n; i++)
        if (strcmp(by_name[i]->name, by_name[i - 1]->name) == 0 &&
            (by_name[i]->split == DSK_CKPT_WHOLE || by_name[i - 1]->split == DSK_CKPT_WHOLE))
            return by_name[i]->name;
    return NULL;
}

/* The key a rank file holds one of several boxes of `name` under: "<name>@<o0>,<o1>,..." (its
   offset); NULL when out of memory. */
static char *dsk__ckpt_box_key(const char *name, int ndim, const int64_t *off) {
    dsk__st_buf b;
    memset(&b, 0, sizeof b);
    dsk__st_puts(&b, name);
    dsk__st_puts(&b, "@");
    for (int d = 0; d < ndim; d++) dsk__st_putf(&b, d ? ",%lld" : "%lld", (long long)off[d]);
    if (b.oom) {
        dsk__st_buf_free(&b);
        return NULL;
    }
    return b.p;
}

/* The box entry e covers in its whole tensor: offset and whole shape (see dsk_ckpt_entry). */
static dsk_status dsk__ckpt_entry_box(const char *fn, const dsk_ckpt_entry *e, int64_t *off, int64_t *global) {
    const dsk_tensor *t = e->tensor;
    char b[160];
    memset(off, 0, DSK_MAX_DIMS * sizeof *off);
    memcpy(global, t->shape, DSK_MAX_DIMS * sizeof *global);
    if (e->split == DSK_CKPT_WHOLE) return DSK_OK;
    if (e->split == DSK_CKPT_ROWS) {
        if (t->ndim < 1 || e->row0 < 0 || e->global_rows < 0 || e->row0 > e->global_rows - t->shape[0])
            return dsk_set_error(DSK_ERR_ARG,
                                 "%s: tensor \"%s\" %s: rows [%lld, %lld) do not fit a split tensor of %lld rows", fn,
                                 e->name, dsk_tensor_describe(t, b, sizeof b), (long long)e->row0,
                                 (long long)(e->row0 + (t->ndim ? t->shape[0] : 0)), (long long)e->global_rows);
        off[0] = e->row0;
        global[0] = e->global_rows;
        return DSK_OK;
    }
    if (e->split != DSK_CKPT_BOX)
        return dsk_set_error(DSK_ERR_ARG,
                             "%s: tensor \"%s\": split %d is none of DSK_CKPT_WHOLE, DSK_CKPT_ROWS, DSK_CKPT_BOX", fn,
                             e->name, e->split);
    if (!e->offset || !e->global_shape)
        return dsk_set_error(DSK_ERR_ARG, "%s: tensor \"%s\": a DSK_CKPT_BOX entry needs offset and global_shape", fn,
                             e->name);
    for (int d = 0; d < t->ndim; d++) {
        off[d] = e->offset[d];
        global[d] = e->global_shape[d];
        if (off[d] < 0 || global[d] < 0 || off[d] > global[d] - t->shape[d])
            return dsk_set_error(DSK_ERR_ARG,
                                 "%s: tensor \"%s\" %s: dim %d: [%lld, %lld) does not fit the whole tensor's %lld", fn,
                                 e->name, dsk_tensor_describe(t, b, sizeof b), d, (long long)off[d],
                                 (long long)(off[d] + t->shape[d]), (long long)global[d]);
    }
    if (dsk__st_numel(t->ndim, global) < 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: tensor \"%s\": the whole shape overflows", fn, e->name);
    return DSK_OK;
}

/* An entry's checks: those of a tensor to write, then its box. */
static dsk_status dsk__ckpt_check_entry(const char *fn, const dsk_ckpt_entry *e, int i, const dsk_ctx *ctx) {
    dsk_safetensors_entry se = {e->name, e->tensor};
    int64_t off[DSK_MAX_DIMS], global[DSK_MAX_DIMS];
    DSK__TRY(dsk__st_check_entry(fn, &se, i, ctx));
    return dsk__ckpt_entry_box(fn, e, off, global);
}

/* What a rank file records of one piece besides its tensor. */
typedef struct dsk__ckpt_part {
    char *name; /* the tensor's name; the file holds the piece under its key (see the top) */
    int entry;  /* its index in the caller's entries */
    int boxed;  /* a box of a larger tensor (DSK_CKPT_ROWS and DSK_CKPT_BOX entries) */
    int64_t off[DSK_MAX_DIMS], global[DSK_MAX_DIMS];
    int hashed; /* incremental saves: hash holds the content hash */
    uint64_t hash;
    int reused; /* the content is unchanged since the base checkpoint: referenced, not written */
} dsk__ckpt_part;

typedef struct dsk__ckpt_rfile {
    dsk__st_plan st;       /* the file's tensors (each under its key), pairs and layout */
    dsk__ckpt_part *parts; /* one per st.segs[i] */
    int n_parts;
    int64_t step;
    int rank, world;
    uint64_t attempt; /* the save's nonce */
} dsk__ckpt_rfile;

static void dsk__ckpt_rfile_free(dsk__ckpt_rfile *rf) {
    dsk__st_plan_free(&rf->st);
    for (int i = 0; i < rf->n_parts; i++) DSK_FREE(rf->parts[i].name);
    DSK_FREE(rf->parts);
    rf->parts = NULL;
    rf->n_parts = 0;
}

/* By name, then by offset (lexicographically): the boxes of one name next to each other. */
static int dsk__ckpt_cmp_part_box(const void *a, const void *b) {
    const dsk__ckpt_part *x = (const dsk__ckpt_part *)a, *y = (const dsk__ckpt_part *)b;
    int c = strcmp(x->name, y->name);
    for (int d = 0; !c && d < DSK_MAX_DIMS; d++)
        if (x->off[d] != y->off[d]) c = x->off[d] < y->off[d] ? -1 : 1;
    return c;
}

static void dsk__ckpt_box_desc(char *buf, size_t n, int ndim, const int64_t *off, const int64_t *ext);

/* Two boxes of one tensor (offsets in a and b, shapes of ta and tb) share an element. */
static int dsk__ckpt_boxes_meet(const dsk__ckpt_part *a, const dsk_tensor *ta, const dsk__ckpt_part *b,
                                const dsk_tensor *tb) {
    if (!dsk__st_numel(ta->ndim, ta->shape) || !dsk__st_numel(tb->ndim, tb->shape)) return 0;
    for (int d = 0; d < ta->ndim; d++)
        if (b->off[d] >= a->off[d] + ta->shape[d] || a->off[d] >= b->off[d] + tb->shape[d]) return 0;
    return 1;
}

/* The k boxes of one name a rank file holds (g, sorted by offset; their tensors in entries):
   the same dtype and whole shape, and disjoint (each is compared with those starting before
   it ends in dim 0). */
static dsk_status dsk__ckpt_check_boxes(const char *fn, const dsk__ckpt_part *g, int k, const dsk_ckpt_entry *entries) {
    const dsk_tensor *t0 = entries[g[0].entry].tensor;
    char x[200], y[200];
    for (int i = 1; i < k; i++) {
        const dsk_tensor *ti = entries[g[i].entry].tensor;
        if (ti->dtype != t0->dtype || ti->ndim != t0->ndim ||
            memcmp(g[i].global, g[0].global, (size_t)t0->ndim * sizeof(int64_t)))
            return dsk_set_error(DSK_ERR_ARG, "%s: tensor \"%s\": this rank's boxes are of %s and of %s", fn, g[0].name,
                                 dsk__st_desc(x, sizeof x, t0->ndim, g[0].global, dsk__st_stname(t0->dtype)),
                                 dsk__st_desc(y, sizeof y, ti->ndim, g[i].global, dsk__st_stname(ti->dtype)));
    }
    for (int i = 0; i < k; i++) {
        const dsk_tensor *ti = entries[g[i].entry].tensor;
        for (int j = i + 1; j < k && (!ti->ndim || g[j].off[0] < g[i].off[0] + ti->shape[0]); j++) {
            const dsk_tensor *tj = entries[g[j].entry].tensor;
            if (dsk__ckpt_boxes_meet(&g[i], ti, &g[j], tj)) {
                dsk__ckpt_box_desc(x, sizeof x, ti->ndim, g[i].off, ti->shape);
                dsk__ckpt_box_desc(y, sizeof y, tj->ndim, g[j].off, tj->shape);
                return dsk_set_error(DSK_ERR_ARG, "%s: tensor \"%s\": this rank's boxes %s and %s overlap", fn,
                                     g[i].name, x, y);
            }
        }
    }
    return DSK_OK;
}

/* The file's key of every part (n, by entry in keys[]): its name, or name@offset where the
   file holds several boxes of the name (checked by dsk__ckpt_check_boxes); sorts parts by
   name and box. Keys, those of the entries this file leaves out (their names) too, must be
   unique, so every rank reports the same clash. */
static dsk_status dsk__ckpt_part_keys(const char *fn, dsk__ckpt_part *parts, int n, const dsk_ckpt_entry *entries,
                                      int n_entries, char **keys) {
    const char **all, *dup;
    qsort(parts, (size_t)n, sizeof *parts, dsk__ckpt_cmp_part_box);
    for (int i = 0, k; i < n; i += k) {
        for (k = 1; i + k < n && strcmp(parts[i + k].name, parts[i].name) == 0; k++) {}
        if (k > 1) DSK__TRY(dsk__ckpt_check_boxes(fn, parts + i, k, entries));
        for (int j = i; j < i + k; j++) {
            const dsk__ckpt_part *g = &parts[j];
            char **key = &keys[g->entry];
            *key = k > 1 ? dsk__ckpt_box_key(g->name, entries[g->entry].tensor->ndim, g->off) : dsk__st_strdup(g->name);
            if (!*key) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
        }
    }
    if (!(all = (const char **)DSK_MALLOC(((size_t)n_entries + 1) * sizeof *all)))
        return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    for (int i = 0; i < n_entries; i++) all[i] = keys[i] ? keys[i] : entries[i].name;
    dup = dsk__st_find_dup(all, n_entries);
    if (dup) {
        dsk_status s = dsk_set_error(DSK_ERR_ARG,
                                     "%s: two tensors would be stored under the key \"%s\" (a name, or name@offset "
                                     "for one of several boxes of a name)",
                                     fn, dup);
        DSK_FREE((void *)all);
        return s;
    }
    DSK_FREE((void *)all);
    return DSK_OK;
}

/* The parts of the entries the file holds (the split ones and, on rank 0 only, the whole
   ones), in entry order, each with its name and box; entries are checked. */
static dsk_status dsk__ckpt_rfile_parts(const char *fn, dsk__ckpt_rfile *rf, const dsk_ckpt_entry *entries, int n) {
    if (!(rf->parts = (dsk__ckpt_part *)DSK_MALLOC(((size_t)n + 1) * sizeof *rf->parts)))
        return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    for (int i = 0; i < n; i++) {
        const dsk_ckpt_entry *e = &entries[i];
        dsk__ckpt_part *x = &rf->parts[rf->n_parts];
        if (e->split == DSK_CKPT_WHOLE && rf->rank != 0) continue;
        memset(x, 0, sizeof *x);
        if (!(x->name = dsk__st_strdup(e->name))) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
        rf->n_parts++;
        x->entry = i;
        x->boxed = e->split != DSK_CKPT_WHOLE;
        dsk__ckpt_entry_box(fn, e, x->off, x->global); /* checked by the caller */
    }
    return DSK_OK;
}

/* Puts the parts in the order of the plan's segments (parts[i] describes st.segs[i]). */
static dsk_status dsk__ckpt_rfile_order(const char *fn, dsk__ckpt_rfile *rf, int n_entries) {
    dsk__ckpt_part *by_seg = (dsk__ckpt_part *)DSK_MALLOC(((size_t)rf->n_parts + 1) * sizeof *by_seg);
    int *seg_of = (int *)DSK_MALLOC(((size_t)n_entries + 1) * sizeof *seg_of);
    if (!by_seg || !seg_of) {
        DSK_FREE(by_seg);
        DSK_FREE(seg_of);
        return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    }
    for (int i = 0; i < rf->st.n; i++) seg_of[rf->st.segs[i].entry] = i;
    for (int i = 0; i < rf->n_parts; i++) by_seg[seg_of[rf->parts[i].entry]] = rf->parts[i];
    DSK_FREE(rf->parts);
    DSK_FREE(seg_of);
    rf->parts = by_seg;
    return DSK_OK;
}

/* Validates the entries (boxes included) and pairs and plans the file: the split entries
   and, on rank 0 only, the whole ones, each under its key. */
static dsk_status dsk__ckpt_rfile_build(const char *fn, dsk__ckpt_rfile *rf, const dsk_ckpt_entry *entries, int n,
                                        const dsk_ckpt_kv *kv, int n_kv, const dsk_ctx *ctx) {
    dsk_safetensors_entry *se;
    const dsk_ckpt_entry **by_name;
    unsigned char *keep;
    char **keys;
    const char *dup;
    dsk_status s = DSK_OK;
    if (n < 0 || (n && !entries))
        return dsk_set_error(DSK_ERR_ARG, "%s: %d entries at %p", fn, n, (const void *)entries);
    for (int i = 0; i < n; i++) /* every rank checks every entry and box */
        DSK__TRY(dsk__ckpt_check_entry(fn, &entries[i], i, ctx));
    DSK__TRY(dsk__st_check_kv(fn, kv, n_kv));
    se = (dsk_safetensors_entry *)DSK_MALLOC(((size_t)n + 1) * sizeof *se);
    by_name = (const dsk_ckpt_entry **)DSK_MALLOC(((size_t)n + 1) * sizeof *by_name);
    keep = (unsigned char *)DSK_MALLOC((size_t)n + 1);
    keys = (char **)DSK_MALLOC(((size_t)n + 1) * sizeof *keys);
    if (!se || !by_name || !keep || !keys) s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    if (keys) memset(keys, 0, ((size_t)n + 1) * sizeof *keys);
    if (keep) memset(keep, 0, (size_t)n + 1);
    for (int i = 0; s == DSK_OK && i < n; i++) by_name[i] = &entries[i];
    if (s == DSK_OK && (dup = dsk__ckpt_dup_name(by_name, n)) != NULL)
        s = dsk_set_error(DSK_ERR_ARG, "%s: tensor name \"%s\" appears twice", fn, dup);
    if (s == DSK_OK) s = dsk__ckpt_rfile_parts(fn, rf, entries, n);
    if (s == DSK_OK) s = dsk__ckpt_part_keys(fn, rf->parts, rf->n_parts, entries, n, keys);
    for (int i = 0; s == DSK_OK && i < n; i++) {
        se[i].name = keys[i] ? keys[i] : entries[i].name;
        se[i].tensor = entries[i].tensor;
        keep[i] = keys[i] != NULL;
    }
    if (s == DSK_OK) s = dsk__st_plan_build(fn, &rf->st, se, n, keep, kv, n_kv, ctx);
    if (s == DSK_OK) s = dsk__ckpt_rfile_order(fn, rf, n);
    for (int i = 0; keys && i < n; i++) DSK_FREE(keys[i]);
    DSK_FREE(keys);
    DSK_FREE(se);
    DSK_FREE((void *)by_name);
    DSK_FREE(keep);
    return s;
}

/* The rank file's own metadata (dsk__st_meta_fn): the segments' names are their keys. */
static void dsk__ckpt_rfile_meta(dsk__st_buf *b, const dsk__st_plan *p, void *user) {
    const dsk__ckpt_rfile *rf = (const dsk__ckpt_rfile *)user;
    dsk__st_putf(b, ",\"dsk.step\":\"%lld\",\"dsk.rank\":\"%d\"", (long long)rf->step, rf->rank);
    dsk__st_putf(b, ",\"dsk.world_size\":\"%d\",\"dsk.attempt\":\"%016llx\"", rf->world,
                 (unsigned long long)rf->attempt);
    for (int i = 0; i < p->n; i++) {
        const dsk__ckpt_part *x = &rf->parts[i];
        const char *key = p->segs[i].name;
        if (x->hashed) {
            dsk__st_puts(b, ",");
            dsk__st_put_jstr2(b, x->reused ? "dsk.reuse." : "dsk.hash.", key);
            dsk__st_putf(b, ":\"%016llx\"", (unsigned long long)x->hash);
        }
        if (strcmp(key, x->name) != 0) {
            dsk__st_puts(b, ",");
            dsk__st_put_jstr2(b, "dsk.name.", key);
            dsk__st_puts(b, ":");
            dsk__st_put_jstr(b, x->name);
        }
        if (x->boxed) {
            dsk__st_puts(b, ",");
            dsk__st_put_jstr2(b, "dsk.box.", key);
            dsk__st_puts(b, ":\"");
            for (int d = 0; d < p->segs[i].ndim; d++) dsk__st_putf(b, d ? ",%lld" : "%lld", (long long)x->off[d]);
            dsk__st_puts(b, ";");
            for (int d = 0; d < p->segs[i].ndim; d++) dsk__st_putf(b, d ? ",%lld" : "%lld", (long long)x->global[d]);
            dsk__st_puts(b, "\"");
        }
    }
}

/* Writes the rank file as dir/base, atomically (durably as `how` asks). */
static dsk_status dsk__ckpt_rfile_write(const char *fn, dsk__ckpt_rfile *rf, const char *dir, const char *base,
                                        int how) {
    rf->st.meta = dsk__ckpt_rfile_meta;
    rf->st.meta_user = rf;
    return dsk__st_write_plan(fn, &rf->st, dir, base, how);
}

/* ---------------------------------------------------------------- checkpoint directories */

#define DSK__CKPT_MANIFEST "manifest.json"
#define DSK__CKPT_ATTEMPT ".attempt"            /* rank 0 -> the other ranks: the save's nonce */
#define DSK__CKPT_TRAILER 22                    /* bytes of the manifest's last line ,"crc32c":"..."}\n */

static void dsk__ckpt_step_name(char *buf, size_t n, int64_t step) { snprintf(buf, n, "step_%08lld", (long long)step); }

static char *dsk__ckpt_step_dir(const char *root, int64_t step) {
    char name[40];
    dsk__ckpt_step_name(name, sizeof name, step);
    return dsk__st_join(root, name);
}

/* A rank file's name: rank and the nonce of the save that wrote it. */
static void dsk__ckpt_rank_name(char *buf, size_t n, int rank, uint64_t attempt) {
    snprintf(buf, n, "rank_%05d.%016llx.safetensors", rank, (unsigned long long)attempt);
}

/* root/step_<step>/<rank file> for a file of a manifest. */
static char *dsk__ckpt_file_path(const char *root, int64_t step, int rank, uint64_t attempt) {
    char name[80], *sd = dsk__ckpt_step_dir(root, step), *p;
    if (!sd) return NULL;
    dsk__ckpt_rank_name(name, sizeof name, rank, attempt);
    p = dsk__st_join(sd, name);
    DSK_FREE(sd);
    return p;
}

/* "step_<digits>" -> step, else -1. Only the canonical spelling (dsk__ckpt_step_dir's: at
   least 8 digits, no extra leading zeros) counts, so every step has exactly one directory;
   19-digit steps up to INT64_MAX included. */
static int64_t dsk__ckpt_parse_step_name(const char *name) {
    char canon[40];
    uint64_t v = 0;
    const char *p = name + 5;
    if (strncmp(name, "step_", 5) != 0 || !*p || strlen(p) > 19) return -1;
    for (; *p; p++) {
        if (*p < '0' || *p > '9') return -1;
        v = v * 10 + (uint64_t)(*p - '0'); /* 19 digits cannot overflow uint64 */
    }
    if (v > (uint64_t)INT64_MAX) return -1;
    dsk__ckpt_step_name(canon, sizeof canon, (int64_t)v);
    return strcmp(canon, name) == 0 ? (int64_t)v : -1;
}

/* A fresh 62-bit nonce (non-zero) naming one save's files: from /dev/urandom, else the clock,
   the process, the object that saves and its count of saves (so two saves in one clock tick
   differ without any state shared between threads). */
static uint64_t dsk__ckpt_nonce(const void *owner, uint64_t seq) {
    uint64_t v = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (read(fd, &v, sizeof v) != (ssize_t)sizeof v) v = 0;
        close(fd);
    }
    if (!v) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        v = ((uint64_t)ts.tv_sec * 1000000007u) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 32) ^
            (((uint64_t)(uintptr_t)owner + seq) * 0x9e3779b97f4a7c15ull);
    }
    v &= 0x3fffffffffffffffull;
    return v ? v : 1;
}

/* CRC32C of a whole file from its parsed header: the header bytes' CRC combined with each
   tensor's recorded CRC in data order. Every tensor must record one. */
static dsk_status dsk__ckpt_file_crc(const char *fn, const dsk_safetensors_file *f, uint32_t *out) {
    dsk_safetensors_info **order = (dsk_safetensors_info **)DSK_MALLOC(((size_t)f->n_tensors + 1) * sizeof *order);
    uint32_t crc = f->header_crc32c;
    dsk_status s = DSK_OK;
    if (!order) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    for (int i = 0; i < f->n_tensors; i++) order[i] = &f->tensors[i];
    qsort(order, (size_t)f->n_tensors, sizeof *order, dsk__st_cmp_info_off);
    for (int i = 0; i < f->n_tensors && s == DSK_OK; i++) {
        if (!order[i]->has_crc)
            s = dsk_set_error(DSK_ERR_CORRUPT, "%s: \"%s\": tensor \"%s\" has no dsk.crc32c entry", fn, f->path,
                              order[i]->name);
        crc = dsk_safetensors_crc32c_combine(crc, order[i]->crc32c, order[i]->end - order[i]->begin);
    }
    DSK_FREE(order);
    *out = crc;
    return s;
}

/* The metadata value as a whole decimal int64. */
static int dsk__ckpt_parse_i64(const char *v, int64_t *out) {
    char *end;
    long long x;
    if (!v || !*v || (*v != '-' && (*v < '0' || *v > '9'))) return 0;
    errno = 0;
    x = strtoll(v, &end, 10);
    if (errno || *end) return 0;
    *out = x;
    return 1;
}

/* 16 hex digits exactly. */
static int dsk__ckpt_parse_hex64(const char *s, uint64_t *out) {
    uint32_t hi, lo;
    char h[9];
    if (!s || strlen(s) != 16) return 0;
    memcpy(h, s, 8);
    h[8] = 0;
    if (!dsk__st_parse_hex32(h, &hi) || !dsk__st_parse_hex32(s + 8, &lo)) return 0;
    *out = (uint64_t)hi << 32 | lo;
    return 1;
}

/* A rank file's header metadata must name the save that wrote it: step, rank, world size and
   nonce (attempt). */
static dsk_status dsk__ckpt_check_rank_meta(const char *fn, const dsk_safetensors_file *f, int64_t step, int rank,
                                            int world, uint64_t attempt) {
    int64_t v[3];
    uint64_t a = 0;
    const char *fmt = dsk_safetensors_meta(f, "dsk.format");
    if (!fmt || strcmp(fmt, DSK_CKPT_FORMAT) != 0 || !dsk__ckpt_parse_i64(dsk_safetensors_meta(f, "dsk.step"), &v[0]) ||
        !dsk__ckpt_parse_i64(dsk_safetensors_meta(f, "dsk.rank"), &v[1]) ||
        !dsk__ckpt_parse_i64(dsk_safetensors_meta(f, "dsk.world_size"), &v[2]) ||
        !dsk__ckpt_parse_hex64(dsk_safetensors_meta(f, "dsk.attempt"), &a))
        return dsk_set_error(
            DSK_ERR_CORRUPT,
            "%s: \"%s\" lacks the dsk.format/step/rank/world_size/attempt metadata of a dsk checkpoint", fn, f->path);
    if (v[0] != step || v[1] != rank || v[2] != world || a != attempt)
        return dsk_set_error(
            DSK_ERR_CORRUPT,
            "%s: \"%s\" says step %lld rank %lld of %lld, save %016llx; expected step %lld rank %d of %d, "
            "save %016llx",
            fn, f->path, (long long)v[0], (long long)v[1], (long long)v[2], (unsigned long long)a, (long long)step,
            rank, world, (unsigned long long)attempt);
    return DSK_OK;
}

/* "o0,o1,..;g0,g1,..": a box's offset and its whole tensor's shape, ndim values each. */
static int dsk__ckpt_parse_box(const char *v, int ndim, int64_t *off, int64_t *global) {
    for (int part = 0; part < 2; part++) {
        int64_t *dst = part ? global : off;
        for (int d = 0; d < ndim; d++) {
            char *end;
            long long x;
            if (*v < '0' || *v > '9') return 0;
            errno = 0;
            x = strtoll(v, &end, 10);
            if (errno || x < 0) return 0;
            dst[d] = x;
            v = end;
            if (d + 1 < ndim && *v++ != ',') return 0;
        }
        if (part == 0 && *v++ != ';') return 0;
    }
    return *v == 0;
}

/* The content hash a rank file records under prefix + name: 1 found, 0 absent, -1 malformed. */
static int dsk__ckpt_meta_hash(const dsk_safetensors_file *f, const char *prefix, const char *name, uint64_t *hash) {
    char key[1100];
    const char *v;
    snprintf(key, sizeof key, "%s%s", prefix, name);
    if (!(v = dsk_safetensors_meta(f, key))) return 0;
    return dsk__ckpt_parse_hex64(v, hash) ? 1 : -1;
}

/* The box a rank file records for a tensor ("dsk.box.<name>"): 1 found and valid, 0 absent
   (the whole tensor), -1 malformed or outside its whole tensor, -2 out of memory. */
static int dsk__ckpt_box_of(const dsk_safetensors_file *f, const dsk_safetensors_info *t, int64_t *off,
                            int64_t *global) {
    dsk__st_buf kb;
    const char *v;
    int r = 1;
    memset(&kb, 0, sizeof kb);
    dsk__st_puts(&kb, "dsk.box.");
    dsk__st_puts(&kb, t->name);
    v = kb.oom ? NULL : dsk_safetensors_meta(f, kb.p);
    memset(off, 0, DSK_MAX_DIMS * sizeof *off);
    memcpy(global, t->shape, DSK_MAX_DIMS * sizeof *global);
    if (kb.oom) r = -2;
    else if (!v) r = 0;
    else if (!dsk__ckpt_parse_box(v, t->ndim, off, global) || dsk__st_numel(t->ndim, global) < 0) r = -1;
    for (int d = 0; r == 1 && d < t->ndim; d++)
        if (off[d] > global[d] - t->shape[d]) r = -1;
    dsk__st_buf_free(&kb);
    return r;
}

/* The tensor a rank file holds under `key`: the value of "dsk.name.<key>" where the file
   holds several boxes of one name (under keys "<name>@<offset>"), else the key itself. NULL
   when out of memory. */
static const char *dsk__ckpt_key_name(const dsk_safetensors_file *f, const char *key) {
    dsk__st_buf kb;
    const char *v;
    int oom;
    memset(&kb, 0, sizeof kb);
    dsk__st_puts(&kb, "dsk.name.");
    dsk__st_puts(&kb, key);
    v = kb.oom ? NULL : dsk_safetensors_meta(f, kb.p);
    oom = kb.oom;
    dsk__st_buf_free(&kb);
    return oom ? NULL : v ? v : key;
}

/* Whether a rank file may hold the box at `off` of tensor `name` under `key`: the name
   itself, or "<name>@<offset>" (1 yes, 0 no, -1 out of memory). */
static int dsk__ckpt_key_fits(const char *key, const char *name, int ndim, const int64_t *off) {
    char *want;
    int ok;
    if (strcmp(key, name) == 0) return 1;
    if (!(want = dsk__ckpt_box_key(name, ndim, off))) return -1;
    ok = strcmp(want, key) == 0;
    DSK_FREE(want);
    return ok;
}

/* ---------------------------------------------------------------- manifests
   The manifest lists the files of a checkpoint (the `world` files this save wrote first) and
   where each piece of each tensor is: a slice [file, offset..., shape...] per piece. Its last
   line carries the CRC32C of everything before it. */

/* Integer member `key` of object obj. */
static int dsk__ckpt_jget_int(const dsk__st_json *j, int obj, const char *key, int64_t *out) {
    int c = dsk__st_jget(j, obj, key);
    return c >= 0 && dsk__st_jint(j, c, out);
}

typedef struct dsk__ckpt_mfile {
    int64_t step;
    int rank, world;
    uint64_t attempt, size;
    uint32_t crc;
} dsk__ckpt_mfile;

typedef struct dsk__ckpt_mslice {
    int file;
    const int64_t *box; /* offset[ndim] then shape[ndim] */
    int has_hash;       /* written by an incremental save: the content hash */
    uint64_t hash;
} dsk__ckpt_mslice;

typedef struct dsk__ckpt_mtensor {
    const char *name;
    const dsk__st_stdtype *dt;
    int ndim;
    int64_t shape[DSK_MAX_DIMS];
    int first, n_slices;
} dsk__ckpt_mtensor;

typedef struct dsk__ckpt_manifest {
    char *path, *text;
    dsk__st_json json;
    int64_t step;
    uint64_t generation, attempt;
    int world;
    dsk__ckpt_mfile *files;
    int n_files;
    dsk__ckpt_mtensor *tensors; /* sorted by name */
    int n_tensors;
    dsk__ckpt_mslice *slices;
    int64_t *boxes;
} dsk__ckpt_manifest;

static void dsk__ckpt_manifest_free(dsk__ckpt_manifest *m) {
    DSK_FREE(m->path);
    DSK_FREE(m->text);
    dsk__st_json_free(&m->json);
    DSK_FREE(m->files);
    DSK_FREE(m->tensors);
    DSK_FREE(m->slices);
    DSK_FREE(m->boxes);
    memset(m, 0, sizeof *m);
}

static int dsk__ckpt_cmp_mtensor(const void *a, const void *b) {
    return strcmp(((const dsk__ckpt_mtensor *)a)->name, ((const dsk__ckpt_mtensor *)b)->name);
}

static dsk_status dsk__ckpt_bad_manifest(const char *fn, const dsk__ckpt_manifest *m, const char *what,
                                         const char *name) {
    return dsk_set_error(DSK_ERR_CORRUPT, "%s: \"%s\": %s%s%s%s", fn, m->path, what, name ? " (tensor \"" : "",
                         name ? name : "", name ? "\")" : "");
}

/* A box of pieces tiles the whole tensor: each inside it, none overlapping, and together as
   many elements as it has. Overlaps are found by sorting on the dim with the most distinct
   offsets and comparing each box only with those that start before it ends there. */
typedef struct dsk__ckpt_tbox {
    const int64_t *off, *ext;
    int who;
    int64_t key; /* off[d] of the dim being sorted on (the sort's key travels with the box) */
} dsk__ckpt_tbox;

static int dsk__ckpt_cmp_tbox(const void *a, const void *b) {
    int64_t u = ((const dsk__ckpt_tbox *)a)->key, v = ((const dsk__ckpt_tbox *)b)->key;
    return u < v ? -1 : u > v;
}

/* Sorts the boxes by their offset in dim d. */
static void dsk__ckpt_sort_tboxes(dsk__ckpt_tbox *b, int k, int d) {
    for (int i = 0; i < k; i++) b[i].key = b[i].off[d];
    qsort(b, (size_t)k, sizeof *b, dsk__ckpt_cmp_tbox);
}

static void dsk__ckpt_box_desc(char *buf, size_t n, int ndim, const int64_t *off, const int64_t *ext) {
    size_t k = (size_t)snprintf(buf, n, "[");
    for (int d = 0; d < ndim && k < n; d++)
        k += (size_t)snprintf(buf + k, n - k, "%s%lld:%lld", d ? "," : "", (long long)off[d],
                              (long long)(off[d] + ext[d]));
    if (k < n) snprintf(buf + k, n - k, "]");
}

/* 0 when the boxes tile `shape`; else the two boxes (who) that overlap, or -1 and the
   element count when there is a gap. Boxes must lie inside shape. */
static int dsk__ckpt_tiles(dsk__ckpt_tbox *b, int k, int ndim, const int64_t *shape, int *who_a, int *who_b,
                           uint64_t *covered) {
    int best = 0, best_n = -1;
    uint64_t sum = 0;
    for (int d = 0; d < ndim; d++) { /* distinct offsets per dim, by sorting */
        int distinct = 0;
        dsk__ckpt_sort_tboxes(b, k, d);
        for (int i = 0; i < k; i++) distinct += i == 0 || b[i].off[d] != b[i - 1].off[d];
        if (distinct > best_n) { best_n = distinct; best = d; }
    }
    if (ndim) dsk__ckpt_sort_tboxes(b, k, best);
    for (int i = 0; i < k; i++) {
        uint64_t vol = (uint64_t)dsk__st_numel(ndim, b[i].ext);
        sum += vol;
        for (int j = i + 1; ndim && j < k && b[j].off[best] < b[i].off[best] + b[i].ext[best]; j++) {
            int disjoint = vol == 0 || dsk__st_numel(ndim, b[j].ext) == 0;
            for (int d = 0; d < ndim && !disjoint; d++)
                disjoint = b[j].off[d] >= b[i].off[d] + b[i].ext[d] || b[i].off[d] >= b[j].off[d] + b[j].ext[d];
            if (!disjoint) { *who_a = b[i].who; *who_b = b[j].who; return 1; }
        }
        if (!ndim && i > 0) { *who_a = b[0].who; *who_b = b[i].who; return 1; }
    }
    *covered = sum;
    return sum == (uint64_t)dsk__st_numel(ndim, shape) ? 0 : -1;
}

static dsk_status dsk__ckpt_manifest_files(const char *fn, dsk__ckpt_manifest *m, int files) {
    const dsk__st_json *j = &m->json;
    int i = 0;
    m->n_files = dsk__st_jcount(j, files);
    if (dsk__st_jtype(j, files) != DSK__ST_J_ARR || m->n_files < m->world)
        return dsk__ckpt_bad_manifest(fn, m, "\"files\" is not an array of at least world_size entries", NULL);
    if (!(m->files = (dsk__ckpt_mfile *)DSK_MALLOC((size_t)m->n_files * sizeof *m->files)))
        return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    for (int c = dsk__st_jchild(j, files); c >= 0; c = dsk__st_jnext(j, c), i++) {
        dsk__ckpt_mfile *f = &m->files[i];
        int64_t step, rank, world, size;
        if (dsk__st_jtype(j, c) != DSK__ST_J_OBJ || !dsk__ckpt_jget_int(j, c, "step", &step) || step < 0 ||
            !dsk__ckpt_jget_int(j, c, "rank", &rank) || rank < 0 || !dsk__ckpt_jget_int(j, c, "world_size", &world) ||
            world < 1 || world > (1 << 20) || rank >= world || !dsk__ckpt_jget_int(j, c, "size", &size) || size < 8 ||
            !dsk__ckpt_parse_hex64(dsk__st_jstr(j, dsk__st_jget(j, c, "attempt")), &f->attempt) || !f->attempt ||
            !dsk__st_parse_hex32(dsk__st_jstr(j, dsk__st_jget(j, c, "crc32c")), &f->crc))
            return dsk__ckpt_bad_manifest(
                fn, m, "a \"files\" entry lacks step, rank, world_size, attempt, size or crc32c", NULL);
        f->step = step;
        f->rank = (int)rank;
        f->world = (int)world;
        f->size = (uint64_t)size;
        /* the first world_size files are this save's own, one per rank; the rest earlier saves' */
        if (i < m->world ? (f->attempt != m->attempt || f->step != m->step || f->rank != i || f->world != m->world)
                         : f->attempt == m->attempt)
            return dsk__ckpt_bad_manifest(fn, m, "\"files\" does not list this save's files first, in rank order",
                                          NULL);
    }
    return DSK_OK;
}

/* One tensor: dtype, whole shape, and slices [file, offset..., shape...] that tile it. */
static dsk_status dsk__ckpt_manifest_tensor_parse(const char *fn, dsk__ckpt_manifest *m, int node, dsk__ckpt_mtensor *t,
                                                  int *n_slices, int64_t **box_next) {
    const dsk__st_json *j = &m->json;
    int sh = dsk__st_jget(j, node, "shape"), sl = dsk__st_jget(j, node, "slices"), a = 0, b = 0;
    const char *dtype =
        dsk__st_jtype(j, node) == DSK__ST_J_OBJ ? dsk__st_jstr(j, dsk__st_jget(j, node, "dtype")) : NULL;
    dsk__ckpt_tbox *tb;
    uint64_t covered = 0;
    int r;
    t->name = dsk__st_jkey(j, node);
    if (dsk__st_jkey_nul(j, node)) return dsk__ckpt_bad_manifest(fn, m, "tensor name with a NUL character", NULL);
    if (!dtype || !(t->dt = dsk__st_stdtype_by_name(dtype)))
        return dsk__ckpt_bad_manifest(fn, m, "missing or unknown dtype", t->name);
    if (sh < 0 || dsk__st_jtype(j, sh) != DSK__ST_J_ARR || dsk__st_jcount(j, sh) > DSK_MAX_DIMS)
        return dsk__ckpt_bad_manifest(fn, m, "bad shape", t->name);
    t->ndim = 0;
    for (int d = dsk__st_jchild(j, sh); d >= 0; d = dsk__st_jnext(j, d))
        if (!dsk__st_jsize(j, d, &t->shape[t->ndim++])) return dsk__ckpt_bad_manifest(fn, m, "bad shape", t->name);
    if (dsk__st_numel(t->ndim, t->shape) < 0) return dsk__ckpt_bad_manifest(fn, m, "shape overflows", t->name);
    if (sl < 0 || dsk__st_jtype(j, sl) != DSK__ST_J_ARR || dsk__st_jcount(j, sl) < 1)
        return dsk__ckpt_bad_manifest(fn, m, "a tensor without slices", t->name);
    t->first = *n_slices;
    t->n_slices = dsk__st_jcount(j, sl);
    for (int c = dsk__st_jchild(j, sl); c >= 0; c = dsk__st_jnext(j, c)) {
        dsk__ckpt_mslice *x = &m->slices[(*n_slices)++];
        int64_t v, *box = *box_next;
        int e = dsk__st_jchild(j, c), i = 0, len = dsk__st_jcount(j, c);
        if (dsk__st_jtype(j, c) != DSK__ST_J_ARR || (len != 1 + 2 * t->ndim && len != 2 + 2 * t->ndim) ||
            !dsk__st_jsize(j, e, &v) || v >= m->n_files)
            return dsk__ckpt_bad_manifest(fn, m, "a slice is not [file, offset..., shape... (, hash)]", t->name);
        x->file = (int)v;
        x->has_hash = len == 2 + 2 * t->ndim;
        for (e = dsk__st_jnext(j, e); e >= 0; e = dsk__st_jnext(j, e), i++)
            if (i == 2 * t->ndim ? !dsk__ckpt_parse_hex64(dsk__st_jstr(j, e), &x->hash) : !dsk__st_jsize(j, e, &box[i]))
                return dsk__ckpt_bad_manifest(fn, m, "a slice is not [file, offset..., shape... (, hash)]", t->name);
        for (int d = 0; d < t->ndim; d++)
            if (box[d] > t->shape[d] || box[t->ndim + d] > t->shape[d] - box[d])
                return dsk__ckpt_bad_manifest(fn, m, "a slice lies outside its tensor", t->name);
        x->box = box;
        *box_next += 2 * t->ndim;
    }
    if (!(tb = (dsk__ckpt_tbox *)DSK_MALLOC((size_t)t->n_slices * sizeof *tb)))
        return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    for (int i = 0; i < t->n_slices; i++) {
        tb[i].off = m->slices[t->first + i].box;
        tb[i].ext = m->slices[t->first + i].box + t->ndim;
        tb[i].who = i;
    }
    r = dsk__ckpt_tiles(tb, t->n_slices, t->ndim, t->shape, &a, &b, &covered);
    DSK_FREE(tb);
    if (r) return dsk__ckpt_bad_manifest(fn, m, r > 0 ? "slices overlap" : "slices leave a gap", t->name);
    return DSK_OK;
}

/* Validates the manifest text m->text[0, len) of checkpoint `step` (any step when step < 0).
   The trailing "crc32c" member is checked by dsk__ckpt_manifest_read, not here. */
static dsk_status dsk__ckpt_manifest_parse(const char *fn, dsk__ckpt_manifest *m, size_t len, int64_t step) {
    int64_t v, *box_next;
    int top = 0, tens, files, n_slices = 0;
    uint64_t n_box = 0, n_sl = 0;
    const char *fmt;
    dsk__st_json *j = &m->json;
    DSK__TRY(dsk__st_json_parse(j, m->text, len, fn, m->path));
    fmt = dsk__st_jstr(j, dsk__st_jget(j, top, "format"));
    if (!fmt || strcmp(fmt, DSK_CKPT_FORMAT) != 0)
        return dsk__ckpt_bad_manifest(fn, m, "not a dsk-ckpt manifest", NULL);
    if (!dsk__ckpt_jget_int(j, top, "version", &v) || v != DSK_CKPT_VERSION)
        return dsk__ckpt_bad_manifest(fn, m, "unsupported version (this dsk reads version 2)", NULL);
    if (!dsk__ckpt_jget_int(j, top, "step", &m->step) || m->step < 0 || (step >= 0 && m->step != step))
        return dsk__ckpt_bad_manifest(fn, m, "step does not match the directory", NULL);
    if (!dsk__ckpt_jget_int(j, top, "generation", &v) || v < 1)
        return dsk__ckpt_bad_manifest(fn, m, "bad generation", NULL);
    m->generation = (uint64_t)v;
    if (!dsk__ckpt_parse_hex64(dsk__st_jstr(j, dsk__st_jget(j, top, "attempt")), &m->attempt) || !m->attempt)
        return dsk__ckpt_bad_manifest(fn, m, "bad attempt", NULL);
    if (!dsk__ckpt_jget_int(j, top, "world_size", &v) || v < 1 || v > (1 << 20))
        return dsk__ckpt_bad_manifest(fn, m, "bad world_size", NULL);
    m->world = (int)v;
    if ((files = dsk__st_jget(j, top, "files")) < 0) return dsk__ckpt_bad_manifest(fn, m, "no \"files\"", NULL);
    DSK__TRY(dsk__ckpt_manifest_files(fn, m, files));
    tens = dsk__st_jget(j, top, "tensors");
    if (tens < 0 || dsk__st_jtype(j, tens) != DSK__ST_J_OBJ)
        return dsk__ckpt_bad_manifest(fn, m, "no \"tensors\" object", NULL);
    for (int c = dsk__st_jchild(j, tens); c >= 0; c = dsk__st_jnext(j, c)) {
        int k = dsk__st_jget(j, c, "slices"), sh = dsk__st_jget(j, c, "shape");
        uint64_t ns = k >= 0 ? (uint64_t)dsk__st_jcount(j, k) : 0;
        n_sl += ns;
        n_box += ns * 2 * (uint64_t)(sh >= 0 ? dsk__st_jcount(j, sh) : 0);
    }
    m->tensors = (dsk__ckpt_mtensor *)DSK_MALLOC(((size_t)dsk__st_jcount(j, tens) + 1) * sizeof *m->tensors);
    m->slices = (dsk__ckpt_mslice *)DSK_MALLOC(((size_t)n_sl + 1) * sizeof *m->slices);
    m->boxes = (int64_t *)DSK_MALLOC(((size_t)n_box + 1) * sizeof *m->boxes);
    if (!m->tensors || !m->slices || !m->boxes) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    box_next = m->boxes;
    for (int c = dsk__st_jchild(j, tens); c >= 0; c = dsk__st_jnext(j, c)) {
        dsk__ckpt_mtensor *t = &m->tensors[m->n_tensors];
        memset(t, 0, sizeof *t);
        DSK__TRY(dsk__ckpt_manifest_tensor_parse(fn, m, c, t, &n_slices, &box_next));
        m->n_tensors++;
    }
    qsort(m->tensors, (size_t)m->n_tensors, sizeof *m->tensors, dsk__ckpt_cmp_mtensor);
    for (int i = 1; i < m->n_tensors; i++)
        if (strcmp(m->tensors[i].name, m->tensors[i - 1].name) == 0)
            return dsk__ckpt_bad_manifest(fn, m, "duplicate tensor", m->tensors[i].name);
    return DSK_OK;
}

/* The manifest's last line: ,"crc32c":"<CRC32C of every byte before it>"}\n */
static dsk_status dsk__ckpt_manifest_check_crc(const char *fn, const dsk__ckpt_manifest *m, size_t len) {
    const char *tail = m->text + len - DSK__CKPT_TRAILER;
    uint32_t want = 0, got;
    char h[9];
    if (len < DSK__CKPT_TRAILER || strncmp(tail, ",\"crc32c\":\"", 11) != 0 || strcmp(tail + 19, "\"}\n") != 0)
        return dsk__ckpt_bad_manifest(fn, m, "no crc32c line at its end (cut short?)", NULL);
    memcpy(h, tail + 11, 8);
    h[8] = 0;
    got = dsk_safetensors_crc32c(0, m->text, len - DSK__CKPT_TRAILER);
    if (!dsk__st_parse_hex32(h, &want) || got != want)
        return dsk_set_error(DSK_ERR_CORRUPT,
                             "%s: \"%s\": manifest crc32c %08x, its last line says %s (altered or damaged)", fn,
                             m->path, got, h);
    return DSK_OK;
}

/* Reads and validates step_dir/manifest.json for `step`. */
static dsk_status dsk__ckpt_manifest_read(const char *fn, const char *step_dir, int64_t step, dsk__ckpt_manifest *m) {
    size_t len = 0;
    memset(m, 0, sizeof *m);
    if (!(m->path = dsk__st_join(step_dir, DSK__CKPT_MANIFEST)))
        return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    if (!dsk__st_exists(m->path) && errno == ENOENT)
        return dsk_set_error(DSK_ERR_CORRUPT,
                             "%s: \"%s\" is missing: the checkpoint is incomplete (its save did not finish)", fn,
                             m->path);
    DSK__TRY(dsk__st_read_small(fn, m->path, (size_t)DSK_SAFETENSORS_MAX_HEADER, &m->text, &len));
    DSK__TRY(dsk__ckpt_manifest_check_crc(fn, m, len));
    return dsk__ckpt_manifest_parse(fn, m, len, step);
}

static const dsk__ckpt_mtensor *dsk__ckpt_manifest_find(const dsk__ckpt_manifest *m, const char *name) {
    int lo = 0, hi = m->n_tensors - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2, c = strcmp(m->tensors[mid].name, name);
        if (c == 0) return &m->tensors[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return NULL;
}

/* ---------------------------------------------------------------- writing manifests (rank 0) */

/* One piece of a tensor as rank 0 finds it in a rank file. */
typedef struct dsk__ckpt_piece {
    const char *name;
    const char *dtype;     /* the safetensors dtype name (interned in the dtype table) */
    int ndim;
    int64_t off[DSK_MAX_DIMS], ext[DSK_MAX_DIMS], global[DSK_MAX_DIMS];
    int file;
    int has_hash;
    uint64_t hash;
} dsk__ckpt_piece;

static int dsk__ckpt_cmp_piece(const void *a, const void *b) {
    const dsk__ckpt_piece *x = (const dsk__ckpt_piece *)a, *y = (const dsk__ckpt_piece *)b;
    int c = strcmp(x->name, y->name);
    if (c) return c;
    for (int d = 0; d < x->ndim && d < y->ndim; d++)
        if (x->off[d] != y->off[d]) return x->off[d] < y->off[d] ? -1 : 1;
    return x->file < y->file ? -1 : x->file > y->file;
}

/* Checks that the k pieces of one tensor agree on dtype and whole shape and tile it;
   appends the tensor's manifest entry. files: for messages (the writing rank of each). */
static dsk_status dsk__ckpt_manifest_tensor(const char *fn, dsk__st_buf *b, const dsk__ckpt_piece *pc, int k,
                                            const dsk__ckpt_mfile *files) {
    const dsk__ckpt_piece *p0 = &pc[0];
    dsk__ckpt_tbox *tb = (dsk__ckpt_tbox *)DSK_MALLOC((size_t)k * sizeof *tb);
    uint64_t covered = 0;
    int wa = 0, wb = 0, r;
    char x[200], y[200];
    if (!tb) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    for (int i = 0; i < k; i++) {
        if (pc[i].dtype != p0->dtype || pc[i].ndim != p0->ndim ||
            memcmp(pc[i].global, p0->global, (size_t)p0->ndim * sizeof(int64_t))) {
            DSK_FREE(tb);
            return dsk_set_error(DSK_ERR_ARG, "%s: tensor \"%s\": rank %d saved a piece of %s, rank %d of %s", fn,
                                 p0->name, files[p0->file].rank,
                                 dsk__st_desc(x, sizeof x, p0->ndim, p0->global, p0->dtype), files[pc[i].file].rank,
                                 dsk__st_desc(y, sizeof y, pc[i].ndim, pc[i].global, pc[i].dtype));
        }
        tb[i].off = pc[i].off;
        tb[i].ext = pc[i].ext;
        tb[i].who = i;
    }
    r = dsk__ckpt_tiles(tb, k, p0->ndim, p0->global, &wa, &wb, &covered);
    DSK_FREE(tb);
    if (r > 0) {
        dsk__ckpt_box_desc(x, sizeof x, p0->ndim, pc[wa].off, pc[wa].ext);
        dsk__ckpt_box_desc(y, sizeof y, p0->ndim, pc[wb].off, pc[wb].ext);
        return dsk_set_error(DSK_ERR_ARG, "%s: tensor \"%s\": rank %d's piece %s and rank %d's piece %s overlap", fn,
                             p0->name, files[pc[wa].file].rank, x, files[pc[wb].file].rank, y);
    }
    if (r < 0)
        return dsk_set_error(DSK_ERR_ARG,
                             "%s: tensor \"%s\" %s: the ranks' pieces hold %llu of its %lld elements (a gap)", fn,
                             p0->name, dsk__st_desc(x, sizeof x, p0->ndim, p0->global, p0->dtype),
                             (unsigned long long)covered, (long long)dsk__st_numel(p0->ndim, p0->global));
    dsk__st_puts(b, b->n && b->p[b->n - 1] == '{' ? "\n " : ",\n ");
    dsk__st_put_jstr(b, p0->name);
    dsk__st_putf(b, ":{\"dtype\":\"%s\",\"shape\":[", p0->dtype);
    for (int d = 0; d < p0->ndim; d++) dsk__st_putf(b, d ? ",%lld" : "%lld", (long long)p0->global[d]);
    dsk__st_puts(b, "],\"slices\":[");
    for (int i = 0; i < k; i++) {
        dsk__st_putf(b, "%s[%d", i ? "," : "", pc[i].file);
        for (int d = 0; d < p0->ndim; d++) dsk__st_putf(b, ",%lld", (long long)pc[i].off[d]);
        for (int d = 0; d < p0->ndim; d++) dsk__st_putf(b, ",%lld", (long long)pc[i].ext[d]);
        if (pc[i].has_hash) dsk__st_putf(b, ",\"%016llx\"", (unsigned long long)pc[i].hash);
        dsk__st_puts(b, "]");
    }
    dsk__st_puts(b, "]}");
    return DSK_OK;
}

/* The pieces of every tensor in file f (the file-th of the manifest). Only rank 0 writes
   whole tensors. */
static dsk_status dsk__ckpt_file_pieces(const char *fn, const dsk_safetensors_file *f, int file, int rank,
                                        dsk__ckpt_piece *out, int *np) {
    for (int i = 0; i < f->n_tensors; i++) {
        const dsk_safetensors_info *t = &f->tensors[i];
        dsk__ckpt_piece *pc = &out[(*np)++];
        int k = dsk__ckpt_box_of(f, t, pc->off, pc->global), fits;
        if (k == -2) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory reading \"%s\"", fn, f->path);
        if (k < 0)
            return dsk_set_error(DSK_ERR_CORRUPT, "%s: \"%s\": dsk.box.%s is malformed or outside its tensor", fn,
                                 f->path, t->name);
        if (k == 0 && rank != 0)
            return dsk_set_error(DSK_ERR_CORRUPT,
                                 "%s: whole tensor \"%s\" found in rank %d's file (only rank 0 writes it)", fn, t->name,
                                 rank);
        if (!(pc->name = dsk__ckpt_key_name(f, t->name)) ||
            (fits = dsk__ckpt_key_fits(t->name, pc->name, t->ndim, pc->off)) < 0)
            return dsk_set_error(DSK_ERR_OOM, "%s: out of memory reading \"%s\"", fn, f->path);
        if ((k == 0 && strcmp(pc->name, t->name) != 0) || !fits)
            return dsk_set_error(DSK_ERR_CORRUPT, "%s: \"%s\": dsk.name.%s does not fit its key and box", fn, f->path,
                                 t->name);
        pc->dtype = t->dtype_name;
        pc->ndim = t->ndim;
        memcpy(pc->ext, t->shape, sizeof pc->ext);
        pc->file = file;
        pc->has_hash = dsk__ckpt_meta_hash(f, "dsk.hash.", t->name, &pc->hash);
        if (pc->has_hash < 0)
            return dsk_set_error(DSK_ERR_CORRUPT, "%s: \"%s\": dsk.hash.%s is not 16 hex digits", fn, f->path, t->name);
    }
    return DSK_OK;
}

/* The index of file e in the manifest's file list, appended when new. */
static int dsk__ckpt_file_index(dsk__ckpt_mfile *mf, int *n, const dsk__ckpt_mfile *e) {
    for (int i = 0; i < *n; i++)
        if (mf[i].step == e->step && mf[i].rank == e->rank && mf[i].attempt == e->attempt) return i;
    mf[*n] = *e;
    return (*n)++;
}

/* The pieces an incremental save's file f (of rank `rank`) declares unchanged
   ("dsk.reuse.<key>" = their hash, "dsk.box.<key>" their box, key as in dsk__ckpt_key_name):
   each must be a slice of the base checkpoint with that box and hash; the piece then points
   to the base's file. */
static dsk_status dsk__ckpt_reuse_pieces(const char *fn, const dsk_safetensors_file *f, int rank,
                                         const dsk__ckpt_manifest *base, dsk__ckpt_piece *out, int *np,
                                         dsk__ckpt_mfile *mf, int *n_mf) {
    for (int i = 0; i < f->n_meta; i++) {
        const char *fkey = f->meta_keys[i] + 10, *name, *box;
        const dsk__ckpt_mtensor *t;
        dsk__ckpt_piece *pc;
        uint64_t hash;
        int k, fits;
        char key[1100];
        if (strncmp(f->meta_keys[i], "dsk.reuse.", 10) != 0) continue;
        if (!dsk__ckpt_parse_hex64(f->meta_values[i], &hash))
            return dsk_set_error(DSK_ERR_CORRUPT, "%s: \"%s\": %s is not 16 hex digits", fn, f->path, f->meta_keys[i]);
        if (!(name = dsk__ckpt_key_name(f, fkey))) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
        if (!base || !(t = dsk__ckpt_manifest_find(base, name)))
            return dsk_set_error(DSK_ERR_CORRUPT, "%s: \"%s\" reuses \"%s\", which the base checkpoint lacks", fn,
                                 f->path, name);
        pc = &out[(*np)++];
        memset(pc, 0, sizeof *pc);
        memcpy(pc->global, t->shape, sizeof pc->global);
        snprintf(key, sizeof key, "dsk.box.%s", fkey);
        if ((box = dsk_safetensors_meta(f, key)) != NULL && !dsk__ckpt_parse_box(box, t->ndim, pc->off, pc->global))
            return dsk_set_error(DSK_ERR_CORRUPT, "%s: \"%s\": %s is malformed", fn, f->path, key);
        /* the key is the name itself, or (with a box) "<name>@<offset>" */
        if ((fits = box ? dsk__ckpt_key_fits(fkey, name, t->ndim, pc->off) : strcmp(name, fkey) == 0) < 0)
            return dsk_set_error(DSK_ERR_OOM, "%s: out of memory reading \"%s\"", fn, f->path);
        if (!fits)
            return dsk_set_error(DSK_ERR_CORRUPT, "%s: \"%s\": dsk.name.%s does not fit its key and box", fn, f->path,
                                 fkey);
        if (!box && rank != 0)
            return dsk_set_error(DSK_ERR_CORRUPT, "%s: whole tensor \"%s\" reused by rank %d (only rank 0 writes it)",
                                 fn, name, rank);
        for (k = 0; k < t->n_slices; k++) {
            const dsk__ckpt_mslice *sl = &base->slices[t->first + k];
            if (!memcmp(sl->box, pc->off, (size_t)t->ndim * sizeof(int64_t)) && sl->has_hash && sl->hash == hash &&
                !memcmp(pc->global, t->shape, (size_t)t->ndim * sizeof(int64_t))) {
                memcpy(pc->ext, sl->box + t->ndim, (size_t)t->ndim * sizeof(int64_t));
                pc->file = dsk__ckpt_file_index(mf, n_mf, &base->files[sl->file]);
                break;
            }
        }
        if (k == t->n_slices)
            return dsk_set_error(DSK_ERR_CORRUPT,
                                 "%s: \"%s\" reuses a piece of \"%s\" the base checkpoint (step %lld) does not hold",
                                 fn, f->path, name, (long long)base->step);
        pc->name = t->name;
        pc->dtype = t->dt->name;
        pc->ndim = t->ndim;
        pc->has_hash = 1;
        pc->hash = hash;
    }
    return DSK_OK;
}

/* The manifest text of a save: header line, files, tensors from the pieces (sorted here),
   and the CRC line. */
static dsk_status dsk__ckpt_manifest_text(const char *fn, dsk__st_buf *b, int64_t step, uint64_t generation,
                                          uint64_t attempt, int world, const dsk__ckpt_mfile *files, int n_files,
                                          dsk__ckpt_piece *pcs, int np) {
    uint32_t crc;
    dsk__st_putf(b, "{\"format\":\"%s\",\"version\":%d,\"attempt\":\"%016llx\",", DSK_CKPT_FORMAT, DSK_CKPT_VERSION,
                 (unsigned long long)attempt);
    dsk__st_putf(b, "\"step\":%lld,\"generation\":%llu,\"world_size\":%d,\n\"files\":[", (long long)step,
                 (unsigned long long)generation, world);
    for (int i = 0; i < n_files; i++) {
        dsk__st_putf(b, "%s\n {\"step\":%lld,\"rank\":%d,\"world_size\":%d,", i ? "," : "", (long long)files[i].step,
                     files[i].rank, files[i].world);
        dsk__st_putf(b, "\"attempt\":\"%016llx\",\"size\":%llu,\"crc32c\":\"%08x\"}",
                     (unsigned long long)files[i].attempt, (unsigned long long)files[i].size, files[i].crc);
    }
    dsk__st_puts(b, "],\n\"tensors\":{");
    qsort(pcs, (size_t)np, sizeof *pcs, dsk__ckpt_cmp_piece);
    for (int i = 0, k; i < np; i += k) {
        for (k = 1; i + k < np && strcmp(pcs[i + k].name, pcs[i].name) == 0; k++) {}
        DSK__TRY(dsk__ckpt_manifest_tensor(fn, b, pcs + i, k, files));
    }
    dsk__st_puts(b, "}");
    if (b->oom) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory for the manifest", fn);
    crc = dsk_safetensors_crc32c(0, b->p, b->n);
    dsk__st_putf(b, ",\"crc32c\":\"%08x\"}\n", crc);
    if (b->oom) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory for the manifest", fn);
    return DSK_OK;
}

/* Rank 0, after every rank's file is durable: reads their headers (never their data), checks
   that the pieces tile every tensor and writes the manifest: the commit point of the save. */
static dsk_status dsk__ckpt_write_manifest(const char *fn, const char *root, const char *step_dir, int64_t step,
                                           int world, uint64_t attempt, uint64_t generation,
                                           const dsk__ckpt_manifest *base, dsk__ckpt_mfile **files_out,
                                           int *n_files_out) {
    int n_mf = world, cap_mf = world + (base ? base->n_files : 0);
    dsk_safetensors_file *files = (dsk_safetensors_file *)DSK_MALLOC((size_t)world * sizeof *files);
    dsk__ckpt_mfile *mf = (dsk__ckpt_mfile *)DSK_MALLOC((size_t)cap_mf * sizeof *mf);
    dsk__ckpt_piece *pcs = NULL;
    dsk__st_buf b;
    dsk_status s = DSK_OK;
    int np = 0, total = 0;
    memset(&b, 0, sizeof b);
    if (!files || !mf) { DSK_FREE(files); DSK_FREE(mf); return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn); }
    memset(files, 0, (size_t)world * sizeof *files);
    for (int r = 0; r < world && s == DSK_OK; r++) {
        char *path = dsk__ckpt_file_path(root, step, r, attempt);
        if (!path) { s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn); break; }
        s = dsk_safetensors_open(&files[r], path);
        if (s != DSK_OK && !dsk__st_exists(path))
            s = dsk_set_error(DSK_ERR_PEER, "%s: rank %d did not write \"%s\" (its save failed)", fn, r, path);
        DSK_FREE(path);
        if (s == DSK_OK) { close(files[r].fd); files[r].has_fd = 0; }
        if (s == DSK_OK) s = dsk__ckpt_check_rank_meta(fn, &files[r], step, r, world, attempt);
        if (s == DSK_OK) s = dsk__ckpt_file_crc(fn, &files[r], &mf[r].crc);
        mf[r].step = step;
        mf[r].rank = r;
        mf[r].world = world;
        mf[r].attempt = attempt;
        mf[r].size = files[r].file_size;
        total += files[r].n_tensors + files[r].n_meta; /* pieces written or reused */
    }
    if (s == DSK_OK && !(pcs = (dsk__ckpt_piece *)DSK_MALLOC(((size_t)total + 1) * sizeof *pcs)))
        s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    for (int r = 0; r < world && s == DSK_OK; r++) {
        s = dsk__ckpt_file_pieces(fn, &files[r], r, r, pcs, &np);
        if (s == DSK_OK) s = dsk__ckpt_reuse_pieces(fn, &files[r], r, base, pcs, &np, mf, &n_mf);
    }
    if (s == DSK_OK) s = dsk__ckpt_manifest_text(fn, &b, step, generation, attempt, world, mf, n_mf, pcs, np);
    if (s == DSK_OK) s = dsk__st_write_small(fn, step_dir, DSK__CKPT_MANIFEST, b.p, b.n, DSK__ST_DURABLE);
    if (s == DSK_OK) { *files_out = mf; *n_files_out = n_mf; mf = NULL; }
    for (int r = 0; r < world; r++) dsk_safetensors_close(&files[r]);
    DSK_FREE(files);
    DSK_FREE(mf);
    DSK_FREE(pcs);
    dsk__st_buf_free(&b);
    return s;
}

/* ---------------------------------------------------------------- the directory's checkpoints */

/* A step directory as a scan finds it. */
enum { DSK__CKPT_INCOMPLETE, DSK__CKPT_COMPLETE, DSK__CKPT_DAMAGED };
typedef struct dsk__ckpt_scan_ent {
    int64_t step;
    int state;
    dsk_status error;      /* DAMAGED: why (DSK_ERR_CORRUPT: damaged; others: unreadable) */
    uint64_t generation;   /* COMPLETE */
    uint64_t attempt;      /* COMPLETE: its manifest's nonce */
    int world;
    int n_files;
    dsk__ckpt_mfile *files; /* COMPLETE: the files its manifest references */
} dsk__ckpt_scan_ent;

typedef struct dsk__ckpt_scan {
    dsk__ckpt_scan_ent *e;
    int n;
    char first_error[1024]; /* the message of the first unreadable manifest */
} dsk__ckpt_scan;

static void dsk__ckpt_scan_free(dsk__ckpt_scan *sc) {
    for (int i = 0; i < sc->n; i++) DSK_FREE(sc->e[i].files);
    DSK_FREE(sc->e);
    memset(sc, 0, sizeof *sc);
}

static int dsk__ckpt_cmp_scan_step(const void *a, const void *b) {
    int64_t x = ((const dsk__ckpt_scan_ent *)a)->step, y = ((const dsk__ckpt_scan_ent *)b)->step;
    return x > y ? -1 : x < y; /* newest step first */
}

/* Every step directory under root with the state of its manifest; DSK_OK and none when root
   does not exist. Only a failure to list root (or memory) is an error: manifests that cannot
   be read are DAMAGED entries with their status. */
static dsk_status dsk__ckpt_scan_dir(const char *fn, const char *root, dsk__ckpt_scan *sc) {
    DIR *d = opendir(root);
    struct dirent *de;
    int cap = 0;
    dsk_status s = DSK_OK;
    memset(sc, 0, sizeof *sc);
    if (!d) return errno == ENOENT ? DSK_OK : dsk__st_io_error(fn, "open directory", root);
    while (s == DSK_OK && (de = readdir(d)) != NULL) {
        int64_t st = dsk__ckpt_parse_step_name(de->d_name);
        dsk__ckpt_scan_ent *x;
        dsk__ckpt_manifest m;
        char *sd, *man;
        if (st < 0) continue;
        if (sc->n == cap) {
            dsk__ckpt_scan_ent *q = (dsk__ckpt_scan_ent *)DSK_MALLOC((size_t)(cap ? cap * 2 : 16) * sizeof *q);
            if (!q) { s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn); break; }
            if (sc->n) memcpy(q, sc->e, (size_t)sc->n * sizeof *q);
            DSK_FREE(sc->e);
            sc->e = q;
            cap = cap ? cap * 2 : 16;
        }
        x = &sc->e[sc->n++];
        memset(x, 0, sizeof *x);
        memset(&m, 0, sizeof m);
        x->step = st;
        sd = dsk__ckpt_step_dir(root, st);
        man = sd ? dsk__st_join(sd, DSK__CKPT_MANIFEST) : NULL;
        if (!man) { DSK_FREE(sd); s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn); break; }
        if (!dsk__st_exists(man) && errno == ENOENT) x->state = DSK__CKPT_INCOMPLETE;
        else if ((x->error = dsk__ckpt_manifest_read(fn, sd, st, &m)) == DSK_OK) {
            x->state = DSK__CKPT_COMPLETE;
            x->generation = m.generation;
            x->attempt = m.attempt;
            x->world = m.world;
            x->n_files = m.n_files;
            x->files = m.files; /* kept */
            m.files = NULL;
        } else {
            x->state = DSK__CKPT_DAMAGED;
            if (x->error == DSK_ERR_OOM) s = x->error;
            else if (x->error != DSK_ERR_CORRUPT && !sc->first_error[0])
                snprintf(sc->first_error, sizeof sc->first_error, "%s", dsk_last_error());
        }
        dsk__ckpt_manifest_free(&m);
        DSK_FREE(sd);
        DSK_FREE(man);
    }
    closedir(d);
    if (s != DSK_OK) { dsk__ckpt_scan_free(sc); return s; }
    if (sc->n) qsort(sc->e, (size_t)sc->n, sizeof *sc->e, dsk__ckpt_cmp_scan_step);
    return DSK_OK;
}

/* 1 when (step, rank, attempt) is among the files of a COMPLETE entry other than `skip`. */
static int dsk__ckpt_file_live(const dsk__ckpt_scan *sc, int skip, int64_t step, int rank, uint64_t attempt) {
    for (int i = 0; i < sc->n; i++) {
        if (i == skip || sc->e[i].state != DSK__CKPT_COMPLETE) continue;
        for (int k = 0; k < sc->e[i].n_files; k++)
            if (sc->e[i].files[k].attempt == attempt && sc->e[i].files[k].rank == rank &&
                sc->e[i].files[k].step == step)
                return 1;
    }
    return 0;
}

/* Removes the files of scan entry `dead` (a manifest just deleted or replaced) that no other
   complete checkpoint references, and its step directory if that leaves it empty. */
static dsk_status dsk__ckpt_drop_files(const char *fn, const char *root, const dsk__ckpt_scan *sc, int dead,
                                       const dsk__ckpt_mfile *files, int n_files) {
    dsk_status s = DSK_OK;
    for (int k = 0; k < n_files && s == DSK_OK; k++) {
        const dsk__ckpt_mfile *f = &files[k];
        char *path;
        if (dsk__ckpt_file_live(sc, dead, f->step, f->rank, f->attempt)) continue;
        if (!(path = dsk__ckpt_file_path(root, f->step, f->rank, f->attempt)))
            return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
        if (unlink(path) != 0 && errno != ENOENT) s = dsk__st_io_error(fn, "remove", path);
        DSK_FREE(path);
    }
    for (int k = 0; k < n_files && s == DSK_OK; k++) { /* rmdir fails harmlessly on a directory still in use */
        char *sd = dsk__ckpt_step_dir(root, files[k].step);
        if (!sd) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
        if (rmdir(sd) == 0) s = dsk__st_fsync_dir(fn, root);
        DSK_FREE(sd);
    }
    return s;
}

/* Deletes complete checkpoint `i` of the scan: its manifest first (made durable), then its
   files that no other checkpoint references. */
static dsk_status dsk__ckpt_delete_entry(const char *fn, const char *root, dsk__ckpt_scan *sc, int i) {
    char *sd = dsk__ckpt_step_dir(root, sc->e[i].step), *man = sd ? dsk__st_join(sd, DSK__CKPT_MANIFEST) : NULL;
    dsk_status s = DSK_OK;
    if (!man) s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    else if (unlink(man) != 0 && errno != ENOENT) s = dsk__st_io_error(fn, "remove", man);
    else s = dsk__st_fsync_dir(fn, sd);
    sc->e[i].state = DSK__CKPT_INCOMPLETE;
    if (s == DSK_OK) s = dsk__ckpt_drop_files(fn, root, sc, i, sc->e[i].files, sc->e[i].n_files);
    DSK_FREE(sd);
    DSK_FREE(man);
    return s;
}

/* Indices of the complete checkpoints of the scan, most recent save first; *n of them. */
static dsk_status dsk__ckpt_by_generation(const char *fn, const dsk__ckpt_scan *sc, int **order, int *n) {
    *n = 0;
    if (!(*order = (int *)DSK_MALLOC(((size_t)sc->n + 1) * sizeof **order)))
        return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    for (int i = 0; i < sc->n; i++) {
        int k = (*n)++;
        if (sc->e[i].state != DSK__CKPT_COMPLETE) { (*n)--; continue; }
        while (k > 0 && sc->e[(*order)[k - 1]].generation < sc->e[i].generation) { (*order)[k] = (*order)[k - 1]; k--; }
        (*order)[k] = i;
    }
    return DSK_OK;
}

/* Keeps the keep_last most recently saved complete checkpoints (the scan holds the new one). */
static dsk_status dsk__ckpt_rotate(const char *fn, const char *root, dsk__ckpt_scan *sc, int keep_last) {
    int *order, n;
    dsk_status s = dsk__ckpt_by_generation(fn, sc, &order, &n);
    for (int k = keep_last; k < n && s == DSK_OK; k++) s = dsk__ckpt_delete_entry(fn, root, sc, order[k]);
    DSK_FREE(order);
    return s;
}

/* "rank_<5 digits>.<16 hex>.safetensors" -> rank and nonce; 0 if name is not one. */
static int dsk__ckpt_parse_rank_name(const char *name, int *rank, uint64_t *attempt) {
    char canon[80];
    unsigned long long a;
    int r, k = 0;
    if (sscanf(name, "rank_%d.%16llx.safetensors%n", &r, &a, &k) != 2 || name[k] || r < 0) return 0;
    dsk__ckpt_rank_name(canon, sizeof canon, r, (uint64_t)a);
    if (strcmp(canon, name) != 0) return 0;
    *rank = r;
    *attempt = (uint64_t)a;
    return 1;
}

/* DIR/.lock: rank 0 holds an exclusive lock on it (an open-file-description lock where the
   system has them, else a POSIX record lock) while it saves or reclaims, so no other writer
   is ever inside the directory at the same time and what a dead save left can be removed. */
typedef struct dsk__ckpt_lock {
    int fd;
    int held; /* 0: not held, or the file system cannot lock (then nothing is reclaimed) */
} dsk__ckpt_lock;

static void dsk__ckpt_unlock(dsk__ckpt_lock *lk) {
    if (lk->fd >= 0) close(lk->fd); /* releases the lock */
    lk->fd = -1;
    lk->held = 0;
}

/* Takes the lock without waiting: DSK_ERR_STATE naming the holder when another writer has
   it; DSK_OK with held 0 when the file system has no locks. A saver (`save` 1) creates the
   lock file and writes who holds it; init's reclaiming only takes an existing one (no save
   ever ran where there is none) and leaves its text alone. */
static dsk_status dsk__ckpt_lock_take(const char *fn, const char *root, int save, dsk__ckpt_lock *lk) {
    char *path = dsk__st_join(root, ".lock"), owner[256] = "", host[128] = "?";
    struct flock fl;
    ssize_t k;
    dsk_status s = DSK_OK;
    lk->fd = -1;
    lk->held = 0;
    if (!path) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    if ((lk->fd = open(path, O_RDWR | O_CLOEXEC | (save ? O_CREAT : 0), 0644)) < 0) {
        s = !save && errno == ENOENT ? DSK_OK : dsk__st_io_error(fn, "open the lock file", path);
        DSK_FREE(path);
        return s;
    }
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    if (fcntl(lk->fd, DSK__CKPT_SETLK, &fl) == 0) {
        lk->held = 1;
        if (!save) { DSK_FREE(path); return DSK_OK; }
        gethostname(host, sizeof host - 1);
        k = snprintf(owner, sizeof owner, "pid %d on %s, since %lld\n", (int)getpid(), host, (long long)time(NULL));
        if (ftruncate(lk->fd, 0) != 0 ||
            pwrite(lk->fd, owner, (size_t)k, 0) != k) { /* the owner text only helps messages */
        }
    } else if (errno == EAGAIN || errno == EACCES) {
        k = pread(lk->fd, owner, sizeof owner - 1, 0);
        owner[k > 0 ? k : 0] = 0;
        if (k > 0 && owner[k - 1] == '\n') owner[k - 1] = 0;
        s = dsk_set_error(DSK_ERR_STATE,
                          "%s: \"%s\" is locked by another writer (%s): one job saves into a directory at a time", fn,
                          path, owner[0] ? owner : "unknown");
        dsk__ckpt_unlock(lk);
    } else if (errno == ENOLCK || errno == EINVAL || errno == EOPNOTSUPP || errno == ENOSYS) {
        dsk__ckpt_unlock(lk); /* no locks here: save without one, reclaim nothing */
    } else {
        s = dsk__st_io_error(fn, "lock", path);
        dsk__ckpt_unlock(lk);
    }
    DSK_FREE(path);
    return s;
}

/* The outcome files of failed saves in DIR (with the lock held no save is live, and every
   rank has read them: they do so before their save returns). */
static dsk_status dsk__ckpt_reclaim_outcomes(const char *fn, const char *root, int *removed) {
    DIR *d = opendir(root);
    struct dirent *de;
    dsk_status s = DSK_OK;
    while (d && s == DSK_OK && (de = readdir(d)) != NULL) {
        char *p;
        if (strncmp(de->d_name, ".outcome.", 9) != 0) continue;
        if (!(p = dsk__st_join(root, de->d_name))) {
            s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
            break;
        }
        s = dsk__st_remove(fn, p, removed);
        DSK_FREE(p);
    }
    if (d) closedir(d);
    return s;
}

/* Rank 0 holding the lock (so no save is live): removes what no complete checkpoint
   references from every step directory whose manifest is absent or readable: rank files of
   saves that did not finish or were dropped, and temporaries of killed writers; then the
   directories this empties, and stale temporaries of DIR itself. A directory whose manifest
   is damaged, and files dsk did not name, are left alone. */
static dsk_status dsk__ckpt_reclaim(const char *fn, const char *root, const dsk__ckpt_scan *sc) {
    static const char *const root_junk[] = {DSK__CKPT_ATTEMPT, ".latest.tmp", "." DSK__CKPT_ATTEMPT ".tmp"};
    dsk_status s = DSK_OK;
    int rmdirs = 0, removed = 0;
    for (int i = 0; i < sc->n && s == DSK_OK; i++) {
        char *sd, *p;
        DIR *d;
        struct dirent *de;
        if (sc->e[i].state == DSK__CKPT_DAMAGED) continue;
        if (!(sd = dsk__ckpt_step_dir(root, sc->e[i].step))) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
        if (!(d = opendir(sd))) { DSK_FREE(sd); continue; } /* gone meanwhile */
        while (s == DSK_OK && (de = readdir(d)) != NULL) {
            const char *nm = de->d_name;
            size_t len = strlen(nm);
            int rank, ours;
            uint64_t att;
            if (dsk__ckpt_parse_rank_name(nm, &rank, &att))
                ours = !dsk__ckpt_file_live(sc, -1, sc->e[i].step, rank, att);
            else ours = nm[0] == '.' && len > 5 && strcmp(nm + len - 4, ".tmp") == 0;
            if (!ours) continue;
            if (!(p = dsk__st_join(sd, nm))) {
                s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
                break;
            }
            s = dsk__st_remove(fn, p, &removed);
            DSK_FREE(p);
        }
        closedir(d);
        if (s == DSK_OK && sc->e[i].state == DSK__CKPT_INCOMPLETE && rmdir(sd) == 0) rmdirs++;
        DSK_FREE(sd);
    }
    if (s == DSK_OK) s = dsk__ckpt_reclaim_outcomes(fn, root, &removed);
    for (size_t k = 0; k < sizeof root_junk / sizeof root_junk[0] && s == DSK_OK; k++) {
        char *p = dsk__st_join(root, root_junk[k]);
        if (!p) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
        s = dsk__st_remove(fn, p, &removed);
        DSK_FREE(p);
    }
    if (s == DSK_OK && rmdirs) s = dsk__st_fsync_dir(fn, root);
    return s;
}

/* The largest generation among complete checkpoints, 0 when none. */
static uint64_t dsk__ckpt_max_generation(const dsk__ckpt_scan *sc) {
    uint64_t g = 0;
    for (int i = 0; i < sc->n; i++)
        if (sc->e[i].state == DSK__CKPT_COMPLETE && sc->e[i].generation > g) g = sc->e[i].generation;
    return g;
}

/* ---------------------------------------------------------------- collective save
   Rank 0 prepares (directories, the save's nonce, published in DIR/.attempt for the others),
   every rank writes its file, rank 0 writes the manifest (the commit point), then tidies up
   (latest pointer, rotation). The ranks meet at a barrier between the phases; every rank makes
   all three calls even when its own part failed. */

typedef struct dsk__ckpt_job {
    dsk__ckpt_rfile rf; /* this rank's file */
    char *root;
    dsk_ckpt_opts opts;
    uint64_t seq;            /* the save's number on this checkpointer, the same on every rank */
    pthread_t thread;
    dsk_status status;       /* preset: a rank that cannot take part (bad arguments) */
    char msg[1024];
    dsk_ckpt_save_info info;
    dsk__ckpt_lock lock;      /* rank 0: held from prepare to the end */
    dsk__ckpt_scan scan;      /* rank 0: the directory as prepare found it (the lock keeps it so) */
    dsk__ckpt_mfile *files;   /* rank 0: the new manifest's files */
    int n_files;
    int64_t base_step;        /* incremental: the checkpoint the save builds on (its manifest's */
    uint64_t base_attempt;    /* nonce; 0: none) */
    dsk__ckpt_manifest base;
    int base_ok;              /* base holds that manifest */
} dsk__ckpt_job;

static void dsk__ckpt_job_free(dsk__ckpt_job *job) {
    if (!job) return;
    dsk__ckpt_rfile_free(&job->rf);
    dsk__ckpt_unlock(&job->lock);
    dsk__ckpt_scan_free(&job->scan);
    dsk__ckpt_manifest_free(&job->base);
    DSK_FREE(job->files);
    DSK_FREE(job->root);
    DSK_FREE(job);
}

/* Keeps the first error of a sequence with its message. */
static void dsk__ckpt_keep(dsk_status *first, char *msg, size_t n, dsk_status s) {
    if (s == DSK_OK || *first != DSK_OK) return;
    *first = s;
    snprintf(msg, n, "%s", dsk_last_error());
}

static dsk_status dsk__ckpt_barrier(const char *fn, const dsk_ckpt_opts *o, int which, int64_t step) {
    dsk_status s;
    char inner[1024];
    if (o->world_size <= 1) return DSK_OK;
    dsk_clear_error();
    if ((s = o->barrier(o->barrier_user)) == DSK_OK) return DSK_OK;
    snprintf(inner, sizeof inner, "%s", dsk_last_error());
    return dsk_set_error(s, "%s: rank %d: barrier %d of 3 for step %lld failed: %s", fn, o->rank, which,
                         (long long)step, inner[0] ? inner : dsk_status_str(s));
}

/* ---- agreement (opts.agree): the outcome of the lowest failing rank, on every rank */

#define DSK__CKPT_MSG_WORDS 147 /* 7 message bytes per word: 1029 bytes */

/* The status word of a rank: its rank (lower wins) and status; 0 when it is fine. */
static int64_t dsk__ckpt_status_word(const dsk_ckpt_opts *o, dsk_status s) {
    return s == DSK_OK ? 0 : ((int64_t)(o->world_size - o->rank) << 8) | (int64_t)s;
}

/* Runs agreement `what` on words[0, n) (words[0] the status word): on return every rank holds
   the same *s and msg, the lowest failing rank's (a second round carries its message). A
   failing hook breaks the group: its status is returned. */
static dsk_status dsk__ckpt_agree(const char *fn, const dsk_ckpt_opts *o, const char *what, int64_t *words, int n,
                                  dsk_status *s, char *msg, size_t cap) {
    int64_t text[DSK__CKPT_MSG_WORDS];
    char inner[1024];
    dsk_status e;
    int f;
    words[0] = dsk__ckpt_status_word(o, *s);
    dsk_clear_error();
    if ((e = o->agree(o->agree_user, words, n)) != DSK_OK) goto broken;
    if (!words[0]) return DSK_OK;
    f = o->world_size - (int)(words[0] >> 8);
    memset(text, 0, sizeof text);
    if (f == o->rank)
        for (size_t i = 0; i < 7 * DSK__CKPT_MSG_WORDS && msg[i]; i++)
            text[i / 7] |= (int64_t)(unsigned char)msg[i] << (8 * (i % 7));
    if ((e = o->agree(o->agree_user, text, DSK__CKPT_MSG_WORDS)) != DSK_OK) goto broken;
    if (f != o->rank) {
        char got[7 * DSK__CKPT_MSG_WORDS + 1];
        size_t i;
        for (i = 0; i < 7 * DSK__CKPT_MSG_WORDS && (got[i] = (char)(text[i / 7] >> (8 * (i % 7)))); i++) {}
        got[i] = 0;
        *s = (dsk_status)(words[0] & 0xff);
        snprintf(msg, cap, "%s: rank %d of %d failed: %.900s", fn, f, o->world_size, got);
    }
    return DSK_OK;
broken:
    snprintf(inner, sizeof inner, "%s", dsk_last_error());
    return dsk_set_error(e, "%s: rank %d: agreement (%s) failed: %s", fn, o->rank, what,
                         inner[0] ? inner : dsk_status_str(e));
}

/* DIR/.attempt: "dsk-attempt <step> <seq> <nonce> <status> <base step> <base nonce>\n<message>".
   Rank 0 writes it before the first barrier (status 0: go on with nonce, building on the base
   checkpoint when incremental; else its error), the others read it after. */
static dsk_status dsk__ckpt_publish_attempt(const char *fn, const dsk__ckpt_job *job, uint64_t nonce, dsk_status s,
                                            const char *msg) {
    char text[1200];
    int n = snprintf(text, sizeof text, "dsk-attempt %lld %llu %016llx %d %lld %016llx\n%.1000s",
                     (long long)job->rf.step, (unsigned long long)job->seq, (unsigned long long)nonce, (int)s,
                     (long long)job->base_step, (unsigned long long)job->base_attempt, s == DSK_OK ? "" : msg);
    return dsk__st_write_small(fn, job->root, DSK__CKPT_ATTEMPT, text,
                               (size_t)n < sizeof text ? (size_t)n : sizeof text - 1, 0);
}

/* A non-zero rank: the nonce (and base) rank 0 published for this save, or rank 0's error. */
static dsk_status dsk__ckpt_read_attempt(const char *fn, dsk__ckpt_job *job, uint64_t *nonce) {
    char *path = dsk__st_join(job->root, DSK__CKPT_ATTEMPT), *text = NULL, *nl;
    long long step, bstep;
    unsigned long long seq, a, batt;
    int st = -1, k = 0;
    size_t len;
    dsk_status s;
    if (!path) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    s = dsk__st_read_small(fn, path, 4096, &text, &len);
    if (s == DSK_OK &&
        (sscanf(text, "dsk-attempt %lld %llu %llx %d %lld %llx%n", &step, &seq, &a, &st, &bstep, &batt, &k) != 6 ||
         step != job->rf.step || seq != job->seq || text[k] != '\n'))
        s = dsk_set_error(DSK_ERR_PEER,
                          "%s: rank %d: \"%s\" is not rank 0's for save %llu of step %lld: rank 0 failed before it", fn,
                          job->opts.rank, path, (unsigned long long)job->seq, (long long)job->rf.step);
    else if (s != DSK_OK)
        s = dsk_set_error(DSK_ERR_PEER,
                          "%s: rank %d: rank 0 published no \"%s\" for step %lld: it failed before the first barrier",
                          fn, job->opts.rank, path, (long long)job->rf.step);
    else if (st != DSK_OK) {
        nl = text + k + 1;
        s = dsk_set_error(st > 0 && st < DSK_STATUS_COUNT ? (dsk_status)st : DSK_ERR_PEER, "%s", nl);
    } else {
        *nonce = (uint64_t)a;
        job->base_step = bstep;
        job->base_attempt = (uint64_t)batt;
    }
    DSK_FREE(path);
    DSK_FREE(text);
    return s;
}

/* DIR/.outcome.<nonce>: "<status>\n<message>", written by rank 0 when a save fails (barrier
   mode), read by the others after the last barrier, so every rank reports the same. */
static void dsk__ckpt_outcome_name(char *buf, size_t n, uint64_t nonce) {
    snprintf(buf, n, ".outcome.%016llx", (unsigned long long)nonce);
}

static void dsk__ckpt_write_outcome(const char *fn, const dsk__ckpt_job *job, uint64_t nonce, dsk_status s,
                                    const char *msg) {
    char name[48], text[1200];
    int n = snprintf(text, sizeof text, "%d\n%s", (int)s, msg);
    dsk__ckpt_outcome_name(name, sizeof name, nonce);
    dsk__st_write_small(fn, job->root, name, text, (size_t)n < sizeof text ? (size_t)n : sizeof text - 1, 0);
}

/* A non-zero rank whose save did not commit: rank 0's outcome when it wrote one (with this
   rank's own error after it, when it had one), else what it has. */
static void dsk__ckpt_read_outcome(const char *fn, const dsk__ckpt_job *job, uint64_t nonce, int own_failed,
                                   dsk_status *first, char *msg, size_t cap) {
    char name[48], *path, *text = NULL, own[1024];
    size_t len;
    int st = 0, k = 0;
    dsk__ckpt_outcome_name(name, sizeof name, nonce);
    if (!nonce || !(path = dsk__st_join(job->root, name))) return;
    if (dsk__st_read_small(fn, path, 4096, &text, &len) == DSK_OK && sscanf(text, "%d%n", &st, &k) == 1 && st > 0 &&
        st < DSK_STATUS_COUNT && text[k] == '\n') {
        snprintf(own, sizeof own, "%s", own_failed ? msg : "");
        snprintf(msg, cap, "%s: rank %d: step %lld not saved: rank 0 reported: %.600s%s%.300s", fn, job->opts.rank,
                 (long long)job->rf.step, text + k + 1, own[0] ? "; this rank: " : "", own);
        *first = (dsk_status)st;
    }
    DSK_FREE(text);
    DSK_FREE(path);
}

/* Rank 0, incremental: the save builds on the most recent complete checkpoint. */
static dsk_status dsk__ckpt_pick_base(const char *fn, dsk__ckpt_job *job) {
    int *order, n;
    DSK__TRY(dsk__ckpt_by_generation(fn, &job->scan, &order, &n));
    if (n) {
        job->base_step = job->scan.e[order[0]].step;
        job->base_attempt = job->scan.e[order[0]].attempt;
    }
    DSK_FREE(order);
    return DSK_OK;
}

/* Every rank, incremental: the base checkpoint's manifest, if it is still the one rank 0
   chose (else nothing is reused: always safe). */
static void dsk__ckpt_read_base(const char *fn, dsk__ckpt_job *job) {
    char *sd;
    if (!job->base_attempt || !(sd = dsk__ckpt_step_dir(job->root, job->base_step))) return;
    job->base_ok =
        dsk__ckpt_manifest_read(fn, sd, job->base_step, &job->base) == DSK_OK && job->base.attempt == job->base_attempt;
    DSK_FREE(sd);
}

/* Incremental: hashes every piece and marks the ones the base checkpoint holds with the same
   dtype, box and hash as reused (referenced, not written). */
static void dsk__ckpt_mark_reused(dsk__ckpt_job *job) {
    dsk__st_plan *p = &job->rf.st;
    const unsigned char none = 0;
    for (int i = 0; i < p->n; i++) {
        dsk__st_seg *g = &p->segs[i];
        dsk__ckpt_part *x = &job->rf.parts[i];
        const int64_t zero[DSK_MAX_DIMS] = {0}, *off = x->boxed ? x->off : zero,
                      *global = x->boxed ? x->global : g->shape;
        const dsk__ckpt_mtensor *t = job->base_ok ? dsk__ckpt_manifest_find(&job->base, x->name) : NULL;
        x->hash = dsk__ckpt_hash(g->nbytes ? (const unsigned char *)g->data : &none, g->nbytes);
        x->hashed = 1;
        if (!t || t->dt->name != dsk__st_stname(g->dtype) || t->ndim != g->ndim ||
            memcmp(t->shape, global, (size_t)g->ndim * sizeof(int64_t)))
            continue;
        for (int k = 0; k < t->n_slices && !x->reused; k++) {
            const dsk__ckpt_mslice *sl = &job->base.slices[t->first + k];
            x->reused = sl->has_hash && sl->hash == x->hash &&
                        !memcmp(sl->box, off, (size_t)g->ndim * sizeof(int64_t)) &&
                        !memcmp(sl->box + g->ndim, g->shape, (size_t)g->ndim * sizeof(int64_t));
        }
        g->omit = x->reused;
        if (x->reused) {
            job->info.bytes_reused += g->nbytes;
            job->info.tensors_reused++;
        }
    }
    dsk__st_plan_layout(p);
}

/* Rank 0, before the first barrier: the lock, the scan of the directory (and with the lock,
   reclaiming what dead saves left, so a full disk frees up), the step directory, the save's
   nonce. Nothing a complete checkpoint uses is changed: an earlier save of this step stays
   loadable until the new manifest replaces it. */
static dsk_status dsk__ckpt_prepare(const char *fn, dsk__ckpt_job *job, const char *step_dir, uint64_t *nonce) {
    if (mkdir(job->root, 0755) != 0 && errno != EEXIST) return dsk__st_io_error(fn, "create directory", job->root);
    DSK__TRY(dsk__ckpt_lock_take(fn, job->root, 1, &job->lock));
    DSK__TRY(dsk__ckpt_scan_dir(fn, job->root, &job->scan));
    if (job->lock.held) DSK__TRY(dsk__ckpt_reclaim(fn, job->root, &job->scan));
    if (job->opts.incremental) DSK__TRY(dsk__ckpt_pick_base(fn, job));
    if (mkdir(step_dir, 0755) == 0) DSK__TRY(dsk__st_fsync_dir(fn, job->root));
    else if (errno != EEXIST) return dsk__st_io_error(fn, "create directory", step_dir);
    *nonce = dsk__ckpt_nonce(job, job->seq);
    return DSK_OK;
}

/* Puts the committed checkpoint (job->files) into the scan in place of its step's entry;
   *old gets that entry's files (an earlier save of the step), to be dropped. */
static dsk_status dsk__ckpt_scan_commit(const char *fn, dsk__ckpt_job *job, dsk__ckpt_mfile **old, int *n_old) {
    dsk__ckpt_scan *sc = &job->scan;
    dsk__ckpt_scan_ent *x = NULL;
    *old = NULL;
    *n_old = 0;
    for (int i = 0; i < sc->n && !x; i++)
        if (sc->e[i].step == job->rf.step) x = &sc->e[i];
    if (!x) {
        dsk__ckpt_scan_ent *q = (dsk__ckpt_scan_ent *)DSK_MALLOC((size_t)(sc->n + 1) * sizeof *q);
        if (!q) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
        if (sc->n) memcpy(q, sc->e, (size_t)sc->n * sizeof *q);
        DSK_FREE(sc->e);
        sc->e = q;
        x = &sc->e[sc->n++];
        memset(x, 0, sizeof *x);
    } else if (x->state == DSK__CKPT_COMPLETE) {
        *old = x->files;
        *n_old = x->n_files;
    } else DSK_FREE(x->files);
    x->step = job->rf.step;
    x->state = DSK__CKPT_COMPLETE;
    x->generation = job->info.generation;
    x->attempt = job->rf.attempt;
    x->world = job->opts.world_size;
    x->files = job->files;
    x->n_files = job->n_files;
    job->files = NULL;
    qsort(sc->e, (size_t)sc->n, sizeof *sc->e, dsk__ckpt_cmp_scan_step);
    return DSK_OK;
}

/* Rank 0, after the commit point: `latest` (for people; not made durable), the files of an
   earlier save of this step, rotation, reclaiming (what a rotation cut off mid-way left, the
   directories it emptied). Failures go to info.cleanup, never to the save. */
static void dsk__ckpt_tidy(const char *fn, dsk__ckpt_job *job) {
    char latest[40];
    dsk__ckpt_mfile *old = NULL;
    int n_old = 0;
    dsk_status s = DSK_OK;
    snprintf(latest, sizeof latest, "step_%08lld\n", (long long)job->rf.step);
    s = dsk__st_write_small(fn, job->root, "latest", latest, strlen(latest), 0);
    if (s == DSK_OK) s = dsk__ckpt_scan_commit(fn, job, &old, &n_old);
    if (s == DSK_OK && old) s = dsk__ckpt_drop_files(fn, job->root, &job->scan, -1, old, n_old);
    if (s == DSK_OK && job->opts.keep_last > 0) s = dsk__ckpt_rotate(fn, job->root, &job->scan, job->opts.keep_last);
    if (s == DSK_OK && job->lock.held) s = dsk__ckpt_reclaim(fn, job->root, &job->scan);
    if (s != DSK_OK) {
        job->info.cleanup = s;
        snprintf(job->info.cleanup_error, sizeof job->info.cleanup_error, "%s", dsk_last_error());
    }
    DSK_FREE(old);
}

/* Rank 0 between the second and the third barrier: the manifest, its generation one above
   the largest prepare's scan found. */
static dsk_status dsk__ckpt_commit(const char *fn, dsk__ckpt_job *job, const char *step_dir, uint64_t nonce) {
    int64_t step = job->rf.step;
    int world = job->opts.world_size;
    job->info.generation = dsk__ckpt_max_generation(&job->scan) + 1;
    DSK__TRY(dsk__ckpt_write_manifest(fn, job->root, step_dir, step, world, nonce, job->info.generation,
                                      job->base_ok ? &job->base : NULL, &job->files, &job->n_files));
    return DSK_OK;
}

/* A non-zero rank after the last barrier: the save succeeded when the step's manifest is the
   one of this save (its first line names the nonce). */
static dsk_status dsk__ckpt_check_committed(const char *fn, const dsk__ckpt_job *job, const char *step_dir,
                                            uint64_t nonce) {
    char *man = dsk__st_join(step_dir, DSK__CKPT_MANIFEST), head[160], want[48];
    int fd;
    ssize_t k = -1;
    if (!man) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    if ((fd = open(man, O_RDONLY | O_CLOEXEC | O_NONBLOCK)) >= 0) {
        k = pread(fd, head, sizeof head - 1, 0);
        close(fd);
    }
    head[k > 0 ? k : 0] = 0;
    snprintf(want, sizeof want, "\"attempt\":\"%016llx\"", (unsigned long long)nonce);
    DSK_FREE(man);
    if (strstr(head, want)) return DSK_OK;
    return dsk_set_error(
        DSK_ERR_PEER,
        "%s: rank %d: step %lld has no manifest of this save after it: it failed on rank 0 or another rank", fn,
        job->opts.rank, (long long)job->rf.step);
}

/* Sync point k of the save: the barrier, or with opts.agree an agreement that leaves every
   rank with the first failure (and at k = 1 with rank 0's nonce). */
static dsk_status dsk__ckpt_sync(const char *fn, dsk__ckpt_job *job, int k, dsk_status *first, char *msg, size_t cap,
                                 uint64_t *nonce) {
    const dsk_ckpt_opts *o = &job->opts;
    int64_t w[4] = {0, 0, 0, 0};
    char what[32];
    if (o->world_size <= 1) return DSK_OK;
    if (!o->agree) return dsk__ckpt_barrier(fn, o, k, job->rf.step);
    if (k == 1 && o->rank == 0) { /* rank 0's nonce and base; the others' words are 0 */
        w[1] = (int64_t)*nonce;
        w[2] = (int64_t)(job->base_attempt & 0x3fffffffffffffffull);
        w[3] = job->base_attempt ? job->base_step : 0;
    }
    snprintf(what, sizeof what, "%d of 3", k);
    DSK__TRY(dsk__ckpt_agree(fn, o, what, w, 4, first, msg, cap));
    if (k == 1) {
        *nonce = (uint64_t)w[1];
        job->base_attempt = (uint64_t)w[2];
        job->base_step = job->base_attempt ? w[3] : -1;
    }
    return DSK_OK;
}

/* The save protocol. A failing barrier or agreement ends it at once: the group is broken. Any
   other failure is kept and reported after the remaining sync points. */
static dsk_status dsk__ckpt_run(dsk__ckpt_job *job) {
    const char *fn = "dsk_ckpt_save";
    const dsk_ckpt_opts *o = &job->opts;
    int64_t step = job->rf.step;
    char *step_dir = dsk__ckpt_step_dir(job->root, step), name[80], msg[1024] = "";
    dsk_status first = DSK_OK, s = DSK_OK;
    uint64_t nonce = 0;
    int committed = 0, files_say = o->world_size > 1 && !o->agree; /* barrier mode: the file system carries the rest */
    job->info.step = step;
    if (job->status != DSK_OK) dsk__ckpt_keep(&first, msg, sizeof msg, dsk_set_error(job->status, "%s", job->msg));
    if (!step_dir) dsk__ckpt_keep(&first, msg, sizeof msg, dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn));
    if (o->rank == 0) {
        if (first == DSK_OK) dsk__ckpt_keep(&first, msg, sizeof msg, dsk__ckpt_prepare(fn, job, step_dir, &nonce));
        if (files_say && (first == DSK_OK || job->lock.held))
            dsk__ckpt_keep(&first, msg, sizeof msg, dsk__ckpt_publish_attempt(fn, job, nonce, first, msg));
    }
    if ((s = dsk__ckpt_sync(fn, job, 1, &first, msg, sizeof msg, &nonce)) != DSK_OK) goto broken;
    if (files_say && o->rank != 0) {
        dsk_status a = dsk__ckpt_read_attempt(fn, job, &nonce);
        if (first == DSK_OK) dsk__ckpt_keep(&first, msg, sizeof msg, a);
    }
    job->rf.attempt = nonce;
    dsk__ckpt_rank_name(name, sizeof name, o->rank, nonce);
    if (first == DSK_OK && o->incremental) {
        dsk__ckpt_read_base(fn, job);
        dsk__ckpt_mark_reused(job);
    }
    if (first == DSK_OK) {
        /* rank 0's file is in the manifest's directory: the fsync of that directory after the
           manifest's rename makes both names durable at once (one fsync fewer per save) */
        int how = o->rank == 0 ? DSK__ST_FSYNC_FILE : DSK__ST_DURABLE | DSK__ST_WITHDRAW;
        dsk__ckpt_keep(&first, msg, sizeof msg, dsk__ckpt_rfile_write(fn, &job->rf, step_dir, name, how));
        if (first == DSK_OK) {
            job->info.bytes_written = job->rf.st.total;
            job->info.tensors_written = job->rf.st.n - job->info.tensors_reused;
        }
    }
    if ((s = dsk__ckpt_sync(fn, job, 2, &first, msg, sizeof msg, &nonce)) != DSK_OK) goto broken;
    if (first == DSK_OK && o->rank == 0) {
        dsk__ckpt_keep(&first, msg, sizeof msg, dsk__ckpt_commit(fn, job, step_dir, nonce));
        committed = first == DSK_OK;
    }
    if (files_say && o->rank == 0 && first != DSK_OK && job->lock.held)
        dsk__ckpt_write_outcome(fn, job, nonce, first, msg);
    if ((s = dsk__ckpt_sync(fn, job, 3, &first, msg, sizeof msg, &nonce)) != DSK_OK) goto broken;
    if (files_say && o->rank != 0) {
        int own_failed = first != DSK_OK;
        if (!own_failed) dsk__ckpt_keep(&first, msg, sizeof msg, dsk__ckpt_check_committed(fn, job, step_dir, nonce));
        if (first != DSK_OK) dsk__ckpt_read_outcome(fn, job, nonce, own_failed, &first, msg, sizeof msg);
    }
    if (files_say && o->rank == 0) { /* every rank has read it */
        char *att = dsk__st_join(job->root, DSK__CKPT_ATTEMPT);
        if (att) unlink(att);
        DSK_FREE(att);
    }
    if (committed) dsk__ckpt_tidy(fn, job);
    dsk__ckpt_unlock(&job->lock);
    DSK_FREE(step_dir);
    if (first != DSK_OK) return dsk_set_error(first, "%s", msg);
    return DSK_OK;
broken:
    dsk__ckpt_unlock(&job->lock);
    DSK_FREE(step_dir);
    return s;
}

/* Reclaims dir when its lock is free (init): a live writer, or a file system without locks,
   means nothing is touched. */
static dsk_status dsk__ckpt_reclaim_now(const char *fn, const char *dir) {
    dsk__ckpt_lock lk;
    dsk__ckpt_scan sc;
    dsk_status s = dsk__ckpt_lock_take(fn, dir, 0, &lk);
    if (s == DSK_ERR_STATE) { dsk_clear_error(); return DSK_OK; }
    if (s != DSK_OK || !lk.held) { dsk__ckpt_unlock(&lk); return s; }
    if ((s = dsk__ckpt_scan_dir(fn, dir, &sc)) == DSK_OK) s = dsk__ckpt_reclaim(fn, dir, &sc);
    dsk__ckpt_scan_free(&sc);
    dsk__ckpt_unlock(&lk);
    return s;
}

static void *dsk__ckpt_thread(void *arg) {
    dsk__ckpt_job *job = (dsk__ckpt_job *)arg;
    job->status = dsk__ckpt_run(job);
    if (job->status != DSK_OK) snprintf(job->msg, sizeof job->msg, "%s", dsk_last_error());
    return NULL;
}

DSK_API dsk_status dsk_ckpt_init(dsk_ckpt *ck, const char *dir, const dsk_ckpt_opts *opts) {
    const char *fn = "dsk_ckpt_init";
    dsk_ckpt_opts o;
    if (!ck) return dsk_set_error(DSK_ERR_ARG, "%s: ck is NULL", fn);
    memset(ck, 0, sizeof *ck);
    ck->last.step = -1;
    memset(&o, 0, sizeof o);
    if (opts) o = *opts;
    if (!dir || !*dir) return dsk_set_error(DSK_ERR_ARG, "%s: directory is NULL or empty", fn);
    if (o.world_size == 0) o.world_size = 1;
    if (o.world_size < 0 || o.rank < 0 || o.rank >= o.world_size)
        return dsk_set_error(DSK_ERR_ARG, "%s: rank %d outside world size %d", fn, o.rank, o.world_size);
    if (o.world_size > 1 && !o.barrier && !o.agree)
        return dsk_set_error(DSK_ERR_ARG, "%s: world size %d needs a barrier or an agree callback", fn, o.world_size);
    if (o.keep_last < 0) return dsk_set_error(DSK_ERR_ARG, "%s: keep_last %d < 0", fn, o.keep_last);
    if (o.snapshot_threads < 0 || o.snapshot_threads > 1024)
        return dsk_set_error(DSK_ERR_ARG, "%s: snapshot_threads %d outside [0, 1024]", fn, o.snapshot_threads);
    if (!(ck->dir = dsk__st_strdup(dir))) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    ck->opts = o;
    if (o.rank == 0 && !o.read_only && dsk__st_exists(dir)) {
        dsk_status s = dsk__ckpt_reclaim_now(fn, dir);
        if (s != DSK_OK) { DSK_FREE(ck->dir); ck->dir = NULL; return s; }
    }
    return DSK_OK;
}

DSK_API dsk_status dsk_ckpt_wait(dsk_ckpt *ck) {
    dsk__ckpt_job *job;
    dsk_status s;
    if (!ck) return dsk_set_error(DSK_ERR_ARG, "dsk_ckpt_wait: ck is NULL");
    if (!(job = (dsk__ckpt_job *)ck->job)) return DSK_OK;
    pthread_join(job->thread, NULL);
    ck->job = NULL;
    s = job->status;
    if (s == DSK_OK) ck->last = job->info;
    else dsk_set_error(s, "%s", job->msg);
    dsk__ckpt_job_free(job);
    return s;
}

DSK_API const dsk_ckpt_save_info *dsk_ckpt_last_save(const dsk_ckpt *ck) { return ck ? &ck->last : NULL; }

DSK_API void dsk_ckpt_free(dsk_ckpt *ck) {
    if (!ck) return;
    if (ck->job) dsk_ckpt_wait(ck);
    DSK_FREE(ck->dir);
    DSK_FREE(ck->stage);
    memset(ck, 0, sizeof *ck);
}

/* A job saving `step` (its rank file empty; the caller numbers it). */
static dsk_status dsk__ckpt_job_new(const char *fn, dsk_ckpt *ck, int64_t step, dsk__ckpt_job **out) {
    dsk__ckpt_job *job = (dsk__ckpt_job *)DSK_MALLOC(sizeof *job);
    *out = NULL;
    if (!job) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    memset(job, 0, sizeof *job);
    job->lock.fd = -1;
    job->opts = ck->opts;
    job->rf.step = step;
    job->rf.rank = ck->opts.rank;
    job->rf.world = ck->opts.world_size;
    job->info.step = -1;
    job->base_step = -1;
    if (!(job->root = dsk__st_strdup(ck->dir))) {
        DSK_FREE(job);
        return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    }
    *out = job;
    return DSK_OK;
}

/* Shared front half of the two saves: wait for the previous one, validate, snapshot. */
static dsk_status dsk__ckpt_save_begin(const char *fn, dsk_ckpt *ck, int64_t step, const dsk_ckpt_entry *entries, int n,
                                       const dsk_ckpt_kv *kv, int n_kv, int copy_all, dsk__ckpt_job **out) {
    dsk__ckpt_job *job;
    dsk_status s;
    *out = NULL;
    if (!ck || !ck->dir) return dsk_set_error(DSK_ERR_ARG, "%s: checkpointer is NULL or not initialised", fn);
    if ((s = dsk_ckpt_wait(ck)) != DSK_OK) {
        char inner[1024];
        snprintf(inner, sizeof inner, "%s", dsk_last_error());
        return dsk_set_error(s, "%s: step %lld not saved: the previous async save failed: %s", fn, (long long)step,
                             inner);
    }
    if (step < 0) return dsk_set_error(DSK_ERR_ARG, "%s: step %lld < 0", fn, (long long)step);
    if (ck->opts.read_only) return dsk_set_error(DSK_ERR_STATE, "%s: \"%s\" was opened read_only", fn, ck->dir);
    DSK__TRY(dsk__ckpt_job_new(fn, ck, step, &job));
    s = dsk__ckpt_rfile_build(fn, &job->rf, entries, n, kv, n_kv, ck->opts.ctx);
    if (s == DSK_OK && (copy_all || dsk__st_needs_stage(&job->rf.st)) && ck->stage_bytes < job->rf.st.total) {
        DSK_FREE(ck->stage);
        ck->stage_bytes = 0;
        if (!(ck->stage = DSK_MALLOC((size_t)job->rf.st.total)))
            s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory for a %llu-byte snapshot", fn,
                              (unsigned long long)job->rf.st.total);
        else ck->stage_bytes = (size_t)job->rf.st.total;
    }
    if (s == DSK_OK)
        s = dsk__st_snapshot(&job->rf.st, ck->opts.ctx, (unsigned char *)ck->stage, copy_all,
                             ck->opts.snapshot_threads);
    if (s != DSK_OK) { dsk__ckpt_job_free(job); return s; }
    *out = job;
    return DSK_OK;
}

/* A rank that cannot take part in a save still runs the protocol with its error, so the
   others fail (no manifest) instead of waiting, and it reports the common outcome. */
static dsk_status dsk__ckpt_abstain(const char *fn, dsk_ckpt *ck, int64_t step, dsk_status s) {
    dsk__ckpt_job *job;
    char msg[1024];
    if (!ck || !ck->dir || ck->opts.world_size <= 1) return s;
    snprintf(msg, sizeof msg, "%s", dsk_last_error());
    if (ck->job || dsk__ckpt_job_new(fn, ck, step < 0 ? 0 : step, &job) != DSK_OK) return dsk_set_error(s, "%s", msg);
    job->seq = ++ck->n_saves;
    job->status = s;
    snprintf(job->msg, sizeof job->msg, "%s", msg);
    s = dsk__ckpt_run(job); /* fails: with the ranks' common outcome */
    dsk__ckpt_job_free(job);
    return s;
}

DSK_API dsk_status dsk_ckpt_save(dsk_ckpt *ck, int64_t step, const dsk_ckpt_entry *entries, int n,
                                 const dsk_ckpt_kv *kv, int n_kv) {
    dsk__ckpt_job *job;
    dsk_status s = dsk__ckpt_save_begin("dsk_ckpt_save", ck, step, entries, n, kv, n_kv, 0, &job);
    if (s != DSK_OK) return dsk__ckpt_abstain("dsk_ckpt_save", ck, step, s);
    job->seq = ++ck->n_saves;
    s = dsk__ckpt_run(job);
    if (s == DSK_OK) ck->last = job->info;
    dsk__ckpt_job_free(job);
    return s;
}

DSK_API dsk_status dsk_ckpt_save_async(dsk_ckpt *ck, int64_t step, const dsk_ckpt_entry *entries, int n,
                                       const dsk_ckpt_kv *kv, int n_kv) {
    dsk__ckpt_job *job;
    int e;
    dsk_status s = dsk__ckpt_save_begin("dsk_ckpt_save_async", ck, step, entries, n, kv, n_kv, 1, &job);
    if (s != DSK_OK) return dsk__ckpt_abstain("dsk_ckpt_save_async", ck, step, s);
    job->seq = ++ck->n_saves;
    if ((e = pthread_create(&job->thread, NULL, dsk__ckpt_thread, job)) != 0) {
        dsk__ckpt_job_free(job);
        s = dsk_set_error(DSK_ERR_STATE, "dsk_ckpt_save_async: cannot start the writer thread: %s", strerror(e));
        return dsk__ckpt_abstain("dsk_ckpt_save_async", ck, step, s);
    }
    ck->job = job;
    return DSK_OK;
}

/* ---------------------------------------------------------------- reading checkpoints */

/* Opens file i of the manifest and checks it against its entry: size, metadata, whole-file
   CRC (from the header bytes and the recorded tensor CRCs, which reads check in turn). A file
   the manifest names but the disk lacks is damage (DSK_ERR_CORRUPT). */
static dsk_status dsk__ckpt_open_file(const char *fn, const char *root, const dsk__ckpt_manifest *m, int i,
                                      dsk_safetensors_file *f) {
    const dsk__ckpt_mfile *e = &m->files[i];
    char *path = dsk__ckpt_file_path(root, e->step, e->rank, e->attempt);
    uint32_t crc;
    dsk_status s;
    if (!path) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    s = dsk_safetensors_open(f, path);
    if (s == DSK_ERR_IO && !dsk__st_exists(path) && errno == ENOENT)
        s = dsk_set_error(DSK_ERR_CORRUPT, "%s: \"%s\", named by \"%s\", is missing (the checkpoint is damaged)", fn,
                          path, m->path);
    DSK_FREE(path);
    if (s != DSK_OK) return s;
    if (f->file_size != e->size)
        s = dsk_set_error(DSK_ERR_CORRUPT, "%s: \"%s\" has %llu bytes, the manifest says %llu", fn, f->path,
                          (unsigned long long)f->file_size, (unsigned long long)e->size);
    if (s == DSK_OK) s = dsk__ckpt_check_rank_meta(fn, f, e->step, e->rank, e->world, e->attempt);
    if (s == DSK_OK) s = dsk__ckpt_file_crc(fn, f, &crc);
    if (s == DSK_OK && crc != e->crc)
        s = dsk_set_error(DSK_ERR_CORRUPT,
                          "%s: \"%s\": header or recorded checksums altered: file crc32c %08x, the manifest says %08x",
                          fn, f->path, crc, e->crc);
    if (s != DSK_OK) dsk_safetensors_close(f);
    return s;
}

typedef struct dsk__ckpt_reader {
    const char *fn;
    const char *root;
    char *step_dir;
    dsk__ckpt_manifest man;
    dsk_safetensors_file *files; /* opened on first use */
} dsk__ckpt_reader;

static void dsk__ckpt_reader_free(dsk__ckpt_reader *rd) {
    if (rd->files)
        for (int i = 0; i < rd->man.n_files; i++) dsk_safetensors_close(&rd->files[i]);
    DSK_FREE(rd->files);
    DSK_FREE(rd->step_dir);
    dsk__ckpt_manifest_free(&rd->man);
    memset(rd, 0, sizeof *rd);
}

/* What root holds, for messages: "complete: step 50, 40 (most recent first); damaged manifests:
   step 60" or "no checkpoint"; "" when root cannot be scanned. */
static void dsk__ckpt_describe(const char *root, char *buf, size_t cap) {
    dsk__ckpt_scan sc;
    int *order = NULL, n = 0, bad = 0;
    size_t k = 0;
    buf[0] = 0;
    if (dsk__ckpt_scan_dir("dsk_ckpt", root, &sc) != DSK_OK) return;
    if (dsk__ckpt_by_generation("dsk_ckpt", &sc, &order, &n) == DSK_OK) {
        for (int i = 0; i < n && i < 8 && k < cap; i++)
            k += (size_t)snprintf(buf + k, cap - k, "%s%lld", i ? ", " : "complete: step ",
                                  (long long)sc.e[order[i]].step);
        if (n > 8 && k < cap) k += (size_t)snprintf(buf + k, cap - k, " and %d older", n - 8);
        if (n > 1 && k < cap) k += (size_t)snprintf(buf + k, cap - k, " (most recent save first)");
    }
    for (int i = 0; i < sc.n && k < cap; i++)
        if (sc.e[i].state == DSK__CKPT_DAMAGED && bad++ < 8)
            k += (size_t)snprintf(buf + k, cap - k, "%s%lld", bad > 1 ? ", " : k ? "; damaged manifests: step "
                                  : "damaged manifests: step ", (long long)sc.e[i].step);
    if (!n && !bad) snprintf(buf, cap, "no checkpoint");
    DSK_FREE(order);
    dsk__ckpt_scan_free(&sc);
}

/* A load or verify of a step that was never saved (its step directory does not exist). */
static dsk_status dsk__ckpt_no_such_step(const char *fn, const char *root, int64_t step) {
    char what[512];
    dsk__ckpt_describe(root, what, sizeof what);
    return dsk_set_error(DSK_ERR_ARG, "%s: there is no checkpoint of step %lld under \"%s\" (%s)", fn,
                         (long long)step, root, what[0] ? what : "the directory cannot be read");
}

static dsk_status dsk__ckpt_reader_open(const char *fn, dsk__ckpt_reader *rd, const char *root, int64_t step) {
    memset(rd, 0, sizeof *rd);
    rd->fn = fn;
    rd->root = root;
    if (!(rd->step_dir = dsk__ckpt_step_dir(root, step))) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    if (!dsk__st_exists(rd->step_dir) && errno == ENOENT) return dsk__ckpt_no_such_step(fn, root, step);
    DSK__TRY(dsk__ckpt_manifest_read(fn, rd->step_dir, step, &rd->man));
    rd->files = (dsk_safetensors_file *)DSK_MALLOC((size_t)rd->man.n_files * sizeof *rd->files);
    if (!rd->files) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    memset(rd->files, 0, (size_t)rd->man.n_files * sizeof *rd->files);
    return DSK_OK;
}

static dsk_status dsk__ckpt_reader_file(dsk__ckpt_reader *rd, int i, dsk_safetensors_file **f) {
    dsk_status s = DSK_OK;
    if (!rd->files[i].mem) s = dsk__ckpt_open_file(rd->fn, rd->root, &rd->man, i, &rd->files[i]);
    *f = &rd->files[i];
    return s;
}

/* "[8,256,128] bf16" of the checkpoint's tensor and of what the entry asks for. */
static dsk_status dsk__ckpt_mismatch(const char *fn, const dsk__ckpt_reader *rd, const dsk__ckpt_mtensor *t,
                                     const dsk_ckpt_entry *e, const int64_t *global) {
    char a[160], b[160];
    const dsk_tensor *x = e->tensor;
    return dsk_set_error(DSK_ERR_ARG, "%s: tensor \"%s\" (%s): file has %s, model has %s%s", fn, e->name, rd->man.path,
                         dsk__st_desc(a, sizeof a, t->ndim, t->shape,
                                      t->dt->dsk >= 0 ? dsk_dtype_name((dsk_dtype)t->dt->dsk) : t->dt->name),
                         dsk__st_desc(b, sizeof b, x->ndim, global, dsk_dtype_name(x->dtype)),
                         t->ndim == x->ndim && !memcmp(t->shape, global, (size_t)x->ndim * sizeof(int64_t))
                             ? " (set allow_cast to convert)"
                             : "");
}

/* The index of the tensor of f that holds the box slice sl names of t: under t's name, else
   (one of several boxes of t in f) under "<name>@<offset>"; -1 when neither is there. */
static int dsk__ckpt_find_key(const dsk_safetensors_file *f, const dsk__ckpt_mtensor *t, const dsk__ckpt_mslice *sl) {
    int64_t off[DSK_MAX_DIMS], global[DSK_MAX_DIMS];
    int k = dsk_safetensors_find(f, t->name), j = -1;
    const char *own = k >= 0 ? dsk__ckpt_key_name(f, t->name) : NULL; /* not t where the key is another's box */
    char *key;
    if (own && strcmp(own, t->name) == 0 && dsk__ckpt_box_of(f, &f->tensors[k], off, global) >= 0 &&
        !memcmp(off, sl->box, (size_t)t->ndim * sizeof(int64_t)))
        return k;
    if ((key = dsk__ckpt_box_key(t->name, t->ndim, sl->box)) != NULL) {
        const char *name;
        j = dsk_safetensors_find(f, key);
        if (j >= 0 && (!(name = dsk__ckpt_key_name(f, key)) || strcmp(name, t->name) != 0)) j = -1;
        DSK_FREE(key);
    }
    return j >= 0 ? j : k; /* k: not the box asked for, which the caller reports */
}

/* The piece of manifest tensor t that slice sl places in file f: it must be there, with the
   manifest's dtype and the slice's shape and box. */
static dsk_status dsk__ckpt_find_piece(const char *fn, dsk_safetensors_file *f, const dsk__ckpt_mtensor *t,
                                       const dsk__ckpt_mslice *sl, const dsk_safetensors_info **out) {
    const dsk_safetensors_info *ft;
    int64_t off[DSK_MAX_DIMS], global[DSK_MAX_DIMS];
    int k = dsk__ckpt_find_key(f, t, sl), b;
    char d1[160], d2[160], d3[200];
    if (k < 0) return dsk_set_error(DSK_ERR_CORRUPT, "%s: tensor \"%s\" is missing from \"%s\"", fn, t->name, f->path);
    ft = &f->tensors[k];
    dsk__ckpt_box_desc(d3, sizeof d3, t->ndim, sl->box, sl->box + t->ndim);
    if (ft->dtype_name != t->dt->name || ft->ndim != t->ndim ||
        memcmp(ft->shape, sl->box + t->ndim, (size_t)t->ndim * sizeof(int64_t)))
        return dsk_set_error(DSK_ERR_CORRUPT,
                             "%s: tensor \"%s\" in \"%s\" is %s, the manifest expects the box %s of %s", fn, t->name,
                             f->path, dsk__st_desc(d1, sizeof d1, ft->ndim, ft->shape, ft->dtype_name), d3,
                             dsk__st_desc(d2, sizeof d2, t->ndim, t->shape, t->dt->name));
    b = dsk__ckpt_box_of(f, ft, off, global);
    if (b == -2) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory reading \"%s\"", fn, f->path);
    if (b < 0 || memcmp(off, sl->box, (size_t)t->ndim * sizeof(int64_t)) ||
        memcmp(global, t->shape, (size_t)t->ndim * sizeof(int64_t)))
        return dsk_set_error(DSK_ERR_CORRUPT,
                             "%s: tensor \"%s\" in \"%s\" does not hold the box %s the manifest expects", fn, t->name,
                             f->path, d3);
    *out = ft;
    return DSK_OK;
}

/* dst's view of the box (off, ext) of the whole tensor, given dst holds the box at `base`. */
static dsk_status dsk__ckpt_sub_view(const dsk_tensor *dst, const int64_t *base, const int64_t *off, const int64_t *ext,
                                     dsk_tensor *v) {
    *v = *dst;
    for (int d = 0; d < dst->ndim; d++) {
        dsk_tensor w;
        DSK__TRY(dsk_tensor_slice(v, d, off[d] - base[d], ext[d], &w));
        *v = w;
    }
    return DSK_OK;
}

/* Copies the box an entry asks for out of every piece that overlaps it. */
static dsk_status dsk__ckpt_load_entry(dsk__ckpt_reader *rd, const dsk_ckpt_entry *e, dsk_ctx *ctx, int allow_cast) {
    const char *fn = rd->fn;
    const dsk__ckpt_mtensor *t = dsk__ckpt_manifest_find(&rd->man, e->name);
    dsk_tensor *x = e->tensor;
    int64_t base[DSK_MAX_DIMS], global[DSK_MAX_DIMS];
    DSK__TRY(dsk__ckpt_entry_box(fn, e, base, global));
    if (!t)
        return dsk_set_error(DSK_ERR_ARG, "%s: tensor \"%s\" is not in the checkpoint (%s)", fn, e->name, rd->man.path);
    if (t->ndim != x->ndim || memcmp(t->shape, global, (size_t)x->ndim * sizeof(int64_t)) != 0 ||
        (t->dt->dsk != (int)x->dtype && (!allow_cast || t->dt->dsk < 0)))
        return dsk__ckpt_mismatch(fn, rd, t, e, global);
    for (int i = 0; i < t->n_slices; i++) {
        const dsk__ckpt_mslice *sl = &rd->man.slices[t->first + i];
        const int64_t *so = sl->box, *se = sl->box + t->ndim;
        int64_t lo[DSK_MAX_DIMS], ext[DSK_MAX_DIMS], in_piece[DSK_MAX_DIMS];
        const dsk_safetensors_info *ft = NULL;
        dsk_safetensors_file *f;
        dsk_tensor view;
        int empty = 0;
        for (int d = 0; d < t->ndim; d++) { /* the intersection of the piece and the entry's box */
            int64_t a = so[d] > base[d] ? so[d] : base[d],
                    b = so[d] + se[d] < base[d] + x->shape[d] ? so[d] + se[d] : base[d] + x->shape[d];
            lo[d] = a;
            ext[d] = b > a ? b - a : 0;
            in_piece[d] = a - so[d];
            empty |= b <= a;
        }
        if (empty) continue; /* no overlap (or no elements): nothing to read there */
        DSK__TRY(dsk__ckpt_reader_file(rd, sl->file, &f));
        DSK__TRY(dsk__ckpt_find_piece(fn, f, t, sl, &ft));
        DSK__TRY(dsk__ckpt_sub_view(x, base, lo, ext, &view));
        DSK__TRY(dsk__st_read_into(fn, f, ctx, ft, in_piece, &view, allow_cast));
    }
    return DSK_OK;
}

static dsk_status dsk__ckpt_fill_meta(const char *fn, const dsk_safetensors_file *f, const dsk__ckpt_manifest *m,
                                      int rank, dsk_ckpt_meta *meta) {
    int n = 0;
    meta->step = m->step;
    meta->generation = m->generation;
    meta->world_size = m->world;
    meta->rank = rank;
    meta->keys = (char **)DSK_MALLOC(((size_t)f->n_meta + 1) * sizeof(char *));
    meta->values = (char **)DSK_MALLOC(((size_t)f->n_meta + 1) * sizeof(char *));
    if (!meta->keys || !meta->values) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    for (int i = 0; i < f->n_meta; i++) {
        const char *k = f->meta_keys[i];
        if (!strncmp(k, "dsk.crc32c.", 11) || !strncmp(k, "dsk.blocks.", 11) || !strncmp(k, "dsk.box.", 8) ||
            !strncmp(k, "dsk.name.", 9))
            continue;
        meta->keys[n] = dsk__st_strdup(k);
        meta->values[n] = dsk__st_strdup(f->meta_values[i]);
        meta->n = ++n;
        if (!meta->keys[n - 1] || !meta->values[n - 1]) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    }
    return DSK_OK;
}

/* Loads checkpoint `step` (see dsk_ckpt_load). */
static dsk_status dsk__ckpt_load_step(const char *fn, dsk_ckpt *ck, int64_t step, const dsk_ckpt_entry *entries, int n,
                                      dsk_ckpt_meta *meta) {
    dsk__ckpt_reader rd;
    dsk_status s = dsk__ckpt_reader_open(fn, &rd, ck->dir, step);
    for (int i = 0; i < n && s == DSK_OK; i++)
        s = dsk__ckpt_load_entry(&rd, &entries[i], ck->opts.ctx, ck->opts.allow_cast);
    if (s == DSK_OK && meta) {
        int r = ck->opts.rank < rd.man.world ? ck->opts.rank : 0; /* the first world_size files are the ranks' own */
        dsk_safetensors_file *f;
        s = dsk__ckpt_reader_file(&rd, r, &f);
        if (s == DSK_OK) s = dsk__ckpt_fill_meta(fn, f, &rd.man, r, meta);
        if (s != DSK_OK) dsk_ckpt_meta_free(meta);
    }
    dsk__ckpt_reader_free(&rd);
    return s;
}

/* A load of the newest where nothing is complete; damaged manifests are named. */
static dsk_status dsk__ckpt_none_complete(const char *fn, const char *root) {
    char what[512];
    dsk__ckpt_describe(root, what, sizeof what);
    return dsk_set_error(DSK_ERR_IO, "%s: no complete checkpoint under \"%s\" (%s)", fn, root, what);
}

/* meta's account of what a load of the newest passed over: the `skipped` checkpoints whose
   files were damaged (the newest skipped_step, why: first) and every damaged manifest (its
   save cannot be placed in time, so those of steps after the loaded one count). */
static dsk_status dsk__ckpt_report_skipped(const char *fn, const char *root, dsk_ckpt_meta *meta, int skipped,
                                           int64_t skipped_step, const char *first) {
    dsk__ckpt_scan sc;
    dsk__ckpt_manifest m;
    char why[1024];
    dsk_status s = dsk__ckpt_scan_dir(fn, root, &sc);
    snprintf(why, sizeof why, "%s", first);
    for (int i = 0; i < sc.n && s == DSK_OK; i++) { /* newest step first */
        char *sd;
        if (sc.e[i].state != DSK__CKPT_DAMAGED || sc.e[i].step <= meta->step) continue;
        if (sc.e[i].step > skipped_step) {
            if (!(sd = dsk__ckpt_step_dir(root, sc.e[i].step))) {
                s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
                break;
            }
            dsk__ckpt_manifest_read(fn, sd, sc.e[i].step, &m); /* fails again: its message says why */
            snprintf(why, sizeof why, "%s", dsk_last_error());
            dsk__ckpt_manifest_free(&m);
            DSK_FREE(sd);
            skipped_step = sc.e[i].step;
        }
        skipped++;
    }
    dsk__ckpt_scan_free(&sc);
    if (s == DSK_OK && skipped && !(meta->skipped_error = dsk__st_strdup(why)))
        s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    if (s != DSK_OK) { dsk_ckpt_meta_free(meta); return s; }
    meta->n_skipped = skipped;
    meta->skipped_step = skipped_step;
    dsk_clear_error();
    return DSK_OK;
}

/* The most recent complete save that loads: damaged ones (DSK_ERR_CORRUPT) are passed over on
   a single rank and reported in meta. */
static dsk_status dsk__ckpt_load_newest(const char *fn, dsk_ckpt *ck, const dsk_ckpt_entry *entries, int n,
                                        dsk_ckpt_meta *meta) {
    dsk_ckpt_info *list = NULL;
    int count = 0, cap, skipped = 0;
    int64_t skipped_step = -1;
    char first[1024] = "";
    dsk_status s;
    DSK__TRY(dsk_ckpt_list(ck->dir, NULL, 0, &count));
    if (!count) return dsk__ckpt_none_complete(fn, ck->dir);
    if (!(list = (dsk_ckpt_info *)DSK_MALLOC((size_t)count * sizeof *list)))
        return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    cap = count;
    s = dsk_ckpt_list(ck->dir, list, cap, &count);
    if (count > cap) count = cap; /* saves completed since the count: list holds the cap most recent */
    for (int k = 0; k < count && s == DSK_OK; k++) {
        if (meta) memset(meta, 0, sizeof *meta);
        s = dsk__ckpt_load_step(fn, ck, list[k].step, entries, n, meta);
        if (s != DSK_ERR_CORRUPT || k + 1 == count) break;
        if (ck->opts.world_size > 1) {
            s = dsk_set_error(
                s,
                "%.800s (with world_size %d and no opts.agree, a rank does not fall back to an older checkpoint alone)",
                dsk_last_error(), ck->opts.world_size);
            break;
        }
        if (!skipped++) { skipped_step = list[k].step; snprintf(first, sizeof first, "%s", dsk_last_error()); }
        s = DSK_OK;
    }
    if (s == DSK_OK && meta) s = dsk__ckpt_report_skipped(fn, ck->dir, meta, skipped, skipped_step, first);
    DSK_FREE(list);
    return s;
}

/* Loads `step` on every rank and agrees on the outcome (opts.agree). */
static dsk_status dsk__ckpt_load_agreed_step(const char *fn, dsk_ckpt *ck, int64_t step, const dsk_ckpt_entry *entries,
                                             int n, dsk_ckpt_meta *meta) {
    char msg[1024];
    int64_t w[1];
    dsk_status s = dsk__ckpt_load_step(fn, ck, step, entries, n, meta);
    snprintf(msg, sizeof msg, "%s", s == DSK_OK ? "" : dsk_last_error());
    DSK__TRY(dsk__ckpt_agree(fn, &ck->opts, "load", w, 1, &s, msg, sizeof msg));
    if (s == DSK_OK) return DSK_OK;
    if (meta) dsk_ckpt_meta_free(meta);
    return dsk_set_error(s, "%s", msg);
}

/* The newest checkpoint every rank can load, rank 0's list deciding the order: a damaged one
   (on any rank) is passed over by all of them together. */
static dsk_status dsk__ckpt_load_agreed_newest(const char *fn, dsk_ckpt *ck, const dsk_ckpt_entry *entries, int n,
                                               dsk_ckpt_meta *meta) {
    dsk_ckpt_info *list = NULL;
    int count = 0, cap = 0, skipped = 0;
    int64_t skipped_step = -1;
    char first[1024] = "", msg[1024] = "";
    dsk_status s = DSK_OK, ls = DSK_OK;
    if (ck->opts.rank == 0) { /* the candidates, most recent first */
        ls = dsk_ckpt_list(ck->dir, NULL, 0, &count);
        if (ls == DSK_OK && count && !(list = (dsk_ckpt_info *)DSK_MALLOC((size_t)count * sizeof *list)))
            ls = dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
        if (ls == DSK_OK && count) ls = dsk_ckpt_list(ck->dir, list, cap = count, &count);
        if (ls == DSK_OK && count > cap) count = cap; /* saves completed since the count */
        if (ls != DSK_OK) {
            count = 0; /* list may be NULL: rank 0 offers its error, no candidate */
            snprintf(msg, sizeof msg, "%s", dsk_last_error());
        }
    }
    for (int k = 0;; k++) {
        int64_t w[3] = {0, 0, 0};
        if (ck->opts.rank == 0 && k < count) { w[1] = 1; w[2] = list[k].step; }
        s = dsk__ckpt_agree(fn, &ck->opts, "load", w, 3, &ls, msg, sizeof msg);
        if (s == DSK_OK && ls != DSK_OK) s = dsk_set_error(ls, "%s", msg);
        if (s != DSK_OK) break;
        if (!w[1]) {
            s = k ? dsk_set_error(DSK_ERR_CORRUPT, "%s", first)
                  : dsk__ckpt_none_complete(fn, ck->dir);
            break;
        }
        if (meta) memset(meta, 0, sizeof *meta);
        if ((s = dsk__ckpt_load_agreed_step(fn, ck, w[2], entries, n, meta)) != DSK_ERR_CORRUPT) break;
        if (!skipped++) { skipped_step = w[2]; snprintf(first, sizeof first, "%s", dsk_last_error()); }
    }
    if (s == DSK_OK && meta) s = dsk__ckpt_report_skipped(fn, ck->dir, meta, skipped, skipped_step, first);
    DSK_FREE(list);
    return s;
}

DSK_API dsk_status dsk_ckpt_load(dsk_ckpt *ck, int64_t step, const dsk_ckpt_entry *entries, int n,
                                 dsk_ckpt_meta *meta) {
    const char *fn = "dsk_ckpt_load";
    if (meta) { memset(meta, 0, sizeof *meta); meta->skipped_step = -1; }
    if (!ck || !ck->dir) return dsk_set_error(DSK_ERR_ARG, "%s: checkpointer is NULL or not initialised", fn);
    if (n < 0 || (n && !entries))
        return dsk_set_error(DSK_ERR_ARG, "%s: %d entries at %p", fn, n, (const void *)entries);
    for (int i = 0; i < n; i++) {
        if (!entries[i].name || !entries[i].tensor)
            return dsk_set_error(DSK_ERR_ARG, "%s: entry %d has no name or tensor", fn, i);
        DSK__TRY(dsk__ckpt_check_entry(fn, &entries[i], i, ck->opts.ctx));
    }
    DSK__TRY(dsk_ckpt_wait(ck));
    if (ck->opts.agree && ck->opts.world_size > 1)
        return step < 0 ? dsk__ckpt_load_agreed_newest(fn, ck, entries, n, meta)
                        : dsk__ckpt_load_agreed_step(fn, ck, step, entries, n, meta);
    if (step < 0) return dsk__ckpt_load_newest(fn, ck, entries, n, meta);
    return dsk__ckpt_load_step(fn, ck, step, entries, n, meta);
}

/* ---- merging an incremental chain into one checkpoint */

/* The pieces of checkpoint rd held by files of rank r, read (checked) into one buffer, as the
   entries of a new rank file. */
static dsk_status dsk__ckpt_merge_gather(const char *fn, dsk__ckpt_reader *rd, int r, unsigned char **buf,
                                         dsk_ckpt_entry **entries, dsk_tensor **views, uint64_t **hashes, int **hashed,
                                         int *n) {
    const dsk__ckpt_manifest *m = &rd->man;
    const int64_t zero[DSK_MAX_DIMS] = {0};
    uint64_t total = 0, at = 0;
    int k = 0, count = 0;
    for (int i = 0; i < m->n_tensors; i++)
        for (int j = 0; j < m->tensors[i].n_slices; j++) {
            const dsk__ckpt_mslice *sl = &m->slices[m->tensors[i].first + j];
            size_t es = (size_t)(m->tensors[i].dt->bits / 8);
            if (m->files[sl->file].rank != r) continue;
            if (m->tensors[i].dt->dsk < 0)
                return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: tensor \"%s\" is %s, a dtype dsk does not write", fn,
                                     m->tensors[i].name, m->tensors[i].dt->name);
            total += (uint64_t)dsk__st_numel(m->tensors[i].ndim, sl->box + m->tensors[i].ndim) * es;
            count++;
        }
    *buf = (unsigned char *)DSK_MALLOC((size_t)total + 1);
    *entries = (dsk_ckpt_entry *)DSK_MALLOC(((size_t)count + 1) * sizeof **entries);
    *views = (dsk_tensor *)DSK_MALLOC(((size_t)count + 1) * sizeof **views);
    *hashes = (uint64_t *)DSK_MALLOC(((size_t)count + 1) * sizeof **hashes);
    *hashed = (int *)DSK_MALLOC(((size_t)count + 1) * sizeof **hashed);
    if (!*buf || !*entries || !*views || !*hashes || !*hashed)
        return dsk_set_error(DSK_ERR_OOM, "%s: out of memory for %llu bytes", fn, (unsigned long long)total);
    for (int i = 0; i < m->n_tensors; i++)
        for (int j = 0; j < m->tensors[i].n_slices; j++) {
            const dsk__ckpt_mtensor *t = &m->tensors[i];
            const dsk__ckpt_mslice *sl = &m->slices[t->first + j];
            const dsk_safetensors_info *ft;
            dsk_safetensors_file *f;
            dsk_ckpt_entry *e = &(*entries)[k];
            int whole = r == 0 && !memcmp(sl->box + t->ndim, t->shape, (size_t)t->ndim * sizeof(int64_t));
            if (m->files[sl->file].rank != r) continue;
            DSK__TRY(dsk__ckpt_reader_file(rd, sl->file, &f));
            DSK__TRY(dsk__ckpt_find_piece(fn, f, t, sl, &ft));
            DSK__TRY(dsk__st_read_box_bytes(fn, f, ft, zero, ft->shape, *buf + at)); /* the whole piece */
            DSK__TRY(
                dsk_tensor_wrap(&(*views)[k], *buf + at, (dsk_dtype)t->dt->dsk, dsk_cpu(), t->ndim, sl->box + t->ndim));
            memset(e, 0, sizeof *e);
            e->name = t->name;
            e->tensor = &(*views)[k];
            e->split = whole ? DSK_CKPT_WHOLE : DSK_CKPT_BOX;
            e->offset = sl->box;
            e->global_shape = t->shape;
            (*hashes)[k] = sl->hash;
            (*hashed)[k] = sl->has_hash;
            at += dsk_tensor_nbytes(&(*views)[k]);
            k++;
        }
    *n = k;
    return DSK_OK;
}

/* Writes rank r's file of the merged checkpoint: its pieces, hashes and its own metadata. */
static dsk_status dsk__ckpt_merge_rank(const char *fn, dsk__ckpt_reader *rd, int r, uint64_t nonce) {
    unsigned char *buf = NULL;
    dsk_ckpt_entry *entries = NULL;
    dsk_tensor *views = NULL;
    uint64_t *hashes = NULL;
    int *hashed = NULL, n = 0, n_kv = 0;
    dsk_ckpt_kv *kv = NULL;
    dsk__ckpt_rfile rf;
    dsk_safetensors_file *own;
    char name[80];
    dsk_status s;
    memset(&rf, 0, sizeof rf);
    rf.step = rd->man.step;
    rf.rank = r;
    rf.world = rd->man.world;
    rf.attempt = nonce;
    s = dsk__ckpt_merge_gather(fn, rd, r, &buf, &entries, &views, &hashes, &hashed, &n);
    if (s == DSK_OK) s = dsk__ckpt_reader_file(rd, r, &own); /* the caller's pairs of this rank */
    if (s == DSK_OK && !(kv = (dsk_ckpt_kv *)DSK_MALLOC(((size_t)own->n_meta + 1) * sizeof *kv)))
        s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    for (int i = 0; s == DSK_OK && i < own->n_meta; i++)
        if (strncmp(own->meta_keys[i], "dsk.", 4) != 0) {
            kv[n_kv].key = own->meta_keys[i];
            kv[n_kv++].value = own->meta_values[i];
        }
    if (s == DSK_OK) s = dsk__ckpt_rfile_build(fn, &rf, entries, n, kv, n_kv, NULL);
    for (int i = 0; s == DSK_OK && i < rf.st.n; i++) {
        rf.parts[i].hashed = hashed[rf.st.segs[i].entry];
        rf.parts[i].hash = hashes[rf.st.segs[i].entry];
    }
    if (s == DSK_OK) s = dsk__st_snapshot(&rf.st, NULL, NULL, 0, 1);
    dsk__ckpt_rank_name(name, sizeof name, r, nonce);
    if (s == DSK_OK) s = dsk__ckpt_rfile_write(fn, &rf, rd->step_dir, name, DSK__ST_DURABLE | DSK__ST_WITHDRAW);
    dsk__ckpt_rfile_free(&rf);
    DSK_FREE(buf);
    DSK_FREE(entries);
    DSK_FREE(views);
    DSK_FREE(hashes);
    DSK_FREE(hashed);
    DSK_FREE(kv);
    return s;
}

DSK_API dsk_status dsk_ckpt_merge(dsk_ckpt *ck, int64_t step) {
    const char *fn = "dsk_ckpt_merge";
    dsk__ckpt_job *job = NULL;
    dsk__ckpt_reader rd;
    dsk__ckpt_mfile *old = NULL;
    uint64_t nonce;
    int n_old = 0;
    dsk_status s;
    memset(&rd, 0, sizeof rd);
    if (!ck || !ck->dir || step < 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: checkpointer not initialised or step %lld < 0", fn, (long long)step);
    if (ck->opts.read_only) return dsk_set_error(DSK_ERR_STATE, "%s: \"%s\" was opened read_only", fn, ck->dir);
    DSK__TRY(dsk_ckpt_wait(ck));
    DSK__TRY(dsk__ckpt_job_new(fn, ck, step, &job));
    nonce = dsk__ckpt_nonce(ck, ck->n_saves);
    s = dsk__ckpt_lock_take(fn, job->root, 1, &job->lock);
    if (s == DSK_OK) s = dsk__ckpt_scan_dir(fn, job->root, &job->scan);
    if (s == DSK_OK) s = dsk__ckpt_reader_open(fn, &rd, job->root, step);
    for (int r = 0; s == DSK_OK && r < rd.man.world; r++) s = dsk__ckpt_merge_rank(fn, &rd, r, nonce);
    if (s == DSK_OK) {
        job->rf.attempt = nonce;
        job->opts.world_size = rd.man.world;
        job->info.generation = rd.man.generation;
        s = dsk__ckpt_write_manifest(fn, job->root, rd.step_dir, step, rd.man.world, nonce, rd.man.generation, NULL,
                                     &job->files, &job->n_files);
    }
    /* committed: drop the files only the old manifest used, then reclaim */
    if (s == DSK_OK) s = dsk__ckpt_scan_commit(fn, job, &old, &n_old);
    if (s == DSK_OK && old) s = dsk__ckpt_drop_files(fn, job->root, &job->scan, -1, old, n_old);
    if (s == DSK_OK && job->lock.held) s = dsk__ckpt_reclaim(fn, job->root, &job->scan);
    DSK_FREE(old);
    dsk__ckpt_reader_free(&rd);
    dsk__ckpt_job_free(job);
    return s;
}

/* The scan of dir for latest, list and load: every manifest must be readable (a damaged one
   is skipped, one that cannot be read is an error). */
static dsk_status dsk__ckpt_scan_readable(const char *fn, const char *dir, dsk__ckpt_scan *sc) {
    DSK__TRY(dsk__ckpt_scan_dir(fn, dir, sc));
    for (int i = 0; i < sc->n; i++)
        if (sc->e[i].state == DSK__CKPT_DAMAGED && sc->e[i].error != DSK_ERR_CORRUPT) {
            dsk_status s = dsk_set_error(sc->e[i].error, "%s", sc->first_error);
            dsk__ckpt_scan_free(sc);
            return s;
        }
    return DSK_OK;
}

DSK_API dsk_status dsk_ckpt_latest(const char *dir, int64_t *step) {
    const char *fn = "dsk_ckpt_latest";
    dsk_ckpt_info info;
    int n = 0;
    if (!dir || !step) return dsk_set_error(DSK_ERR_ARG, "%s: NULL argument", fn);
    memset(&info, 0, sizeof info); /* gcc -O3 cannot see that n > 0 means dsk_ckpt_list wrote it */
    *step = -1;
    DSK__TRY(dsk_ckpt_list(dir, &info, 1, &n));
    if (n) *step = info.step;
    return DSK_OK;
}

DSK_API dsk_status dsk_ckpt_list(const char *dir, dsk_ckpt_info *out, int cap, int *n) {
    const char *fn = "dsk_ckpt_list";
    dsk__ckpt_scan sc;
    int *order;
    dsk_status s;
    if (!dir || !n || cap < 0 || (cap && !out))
        return dsk_set_error(DSK_ERR_ARG, "%s: NULL argument or cap %d", fn, cap);
    *n = 0;
    DSK__TRY(dsk__ckpt_scan_readable(fn, dir, &sc));
    if ((s = dsk__ckpt_by_generation(fn, &sc, &order, n)) == DSK_OK) {
        for (int k = 0; k < *n && k < cap; k++) {
            const dsk__ckpt_scan_ent *x = &sc.e[order[k]];
            out[k].step = x->step;
            out[k].generation = x->generation;
            out[k].world_size = x->world;
            out[k].n_files = x->n_files;
        }
        DSK_FREE(order);
        dsk_clear_error();
    }
    dsk__ckpt_scan_free(&sc);
    return s;
}

/* Reads a whole tensor in chunks and compares its CRC with the header's. */
static dsk_status dsk__ckpt_verify_tensor(const char *fn, dsk_safetensors_file *f, const dsk_safetensors_info *t,
                                          unsigned char *buf, size_t chunk) {
    uint32_t crc = 0;
    for (uint64_t off = t->begin; off < t->end; off += chunk) {
        size_t k = (size_t)(t->end - off < chunk ? t->end - off : chunk);
        DSK__TRY(dsk__st_pread_all(fn, f->fd, buf, k, 8 + f->header_len + off, f->path));
        f->bytes_read += k;
        crc = dsk_safetensors_crc32c(crc, buf, k);
    }
    if (crc != t->crc32c)
        return dsk_set_error(DSK_ERR_CORRUPT,
                             "%s: tensor \"%s\" in \"%s\": data crc32c %08x, header says %08x (data corrupt)", fn,
                             t->name, f->path, crc, t->crc32c);
    return DSK_OK;
}

/* Every tensor of the manifest is in the files its slices name, as the manifest describes it,
   and every tensor of one of this save's own files is one of those pieces. */
static dsk_status dsk__ckpt_verify_layout(const char *fn, dsk__ckpt_reader *rd) {
    int *pieces = (int *)DSK_MALLOC((size_t)rd->man.n_files * sizeof(int));
    dsk_status s = DSK_OK;
    if (!pieces) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    memset(pieces, 0, (size_t)rd->man.n_files * sizeof(int));
    for (int i = 0; i < rd->man.n_tensors && s == DSK_OK; i++) {
        const dsk__ckpt_mtensor *t = &rd->man.tensors[i];
        for (int k = 0; k < t->n_slices && s == DSK_OK; k++) {
            const dsk__ckpt_mslice *sl = &rd->man.slices[t->first + k];
            const dsk_safetensors_info *ft;
            dsk_safetensors_file *f;
            if ((s = dsk__ckpt_reader_file(rd, sl->file, &f)) == DSK_OK &&
                (s = dsk__ckpt_find_piece(fn, f, t, sl, &ft)) == DSK_OK)
                pieces[sl->file]++;
        }
    }
    for (int i = 0; i < rd->man.world && s == DSK_OK; i++) {
        dsk_safetensors_file *f;
        if ((s = dsk__ckpt_reader_file(rd, i, &f)) == DSK_OK && f->n_tensors != pieces[i])
            s = dsk_set_error(DSK_ERR_CORRUPT, "%s: \"%s\" holds %d tensors, the manifest places %d there", fn, f->path,
                              f->n_tensors, pieces[i]);
    }
    DSK_FREE(pieces);
    return s;
}

DSK_API dsk_status dsk_ckpt_verify(const char *dir, int64_t step) {
    const char *fn = "dsk_ckpt_verify";
    const size_t chunk = (size_t)4 << 20;
    dsk__ckpt_reader rd;
    unsigned char *buf;
    dsk_status s;
    if (!dir || step < 0) return dsk_set_error(DSK_ERR_ARG, "%s: bad directory or step %lld", fn, (long long)step);
    if (!(buf = (unsigned char *)DSK_MALLOC(chunk))) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    s = dsk__ckpt_reader_open(fn, &rd, dir, step);
    if (s == DSK_OK) s = dsk__ckpt_verify_layout(fn, &rd);
    for (int i = 0; s == DSK_OK && i < rd.man.n_files; i++) {
        dsk_safetensors_file *f;
        s = dsk__ckpt_reader_file(&rd, i, &f);
        for (int k = 0; s == DSK_OK && k < f->n_tensors; k++)
            s = dsk__ckpt_verify_tensor(fn, f, &f->tensors[k], buf, chunk);
        dsk_safetensors_close(f);
    }
    dsk__ckpt_reader_free(&rd);
    DSK_FREE(buf);
    return s;
}

/* ---------------------------------------------------------------- Hugging Face DeepSeek models */
#ifndef DSK_CKPT_NO_HF

DSK_API dsk_status dsk_ckpt_hf_deepseek_name(char *buf, size_t n, int layer, const char *moe_param) {
    static const char *const map[][2] = {
        {"router", "mlp.gate.weight"},
        {"bias", "mlp.gate.e_score_correction_bias"},
        {"w1", "mlp.experts.{E}.gate_proj.weight"},
        {"w3", "mlp.experts.{E}.up_proj.weight"},
        {"w2", "mlp.experts.{E}.down_proj.weight"},
        {"shared.w1", "mlp.shared_experts.gate_proj.weight"},
        {"shared.w3", "mlp.shared_experts.up_proj.weight"},
        {"shared.w2", "mlp.shared_experts.down_proj.weight"},
    };
    int k;
    if (!buf || !moe_param || layer < 0)
        return dsk_set_error(DSK_ERR_ARG, "dsk_ckpt_hf_deepseek_name: NULL argument or layer %d", layer);
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (strcmp(map[i][0], moe_param) == 0) {
            k = snprintf(buf, n, "model.layers.%d.%s", layer, map[i][1]);
            if (k < 0 || (size_t)k >= n)
                return dsk_set_error(DSK_ERR_ARG, "dsk_ckpt_hf_deepseek_name: a buffer of %zu bytes is too small", n);
            return DSK_OK;
        }
    return dsk_set_error(DSK_ERR_ARG, "dsk_ckpt_hf_deepseek_name: no DeepSeek name for dsk_moe parameter \"%s\"",
                         moe_param);
}


/* A JSON number (any form) as a double. */
static int dsk__ckpt_jnum(const dsk__st_json *j, int node, double *out) {
    char *end;
    if (node < 0 || dsk__st_jtype(j, node) != DSK__ST_J_NUM) return 0;
    *out = strtod(j->src + j->nodes[node].val, &end);
    return 1;
}

/* Reading one config.json: its parse and where errors point. */
typedef struct dsk__ckpt_hfc {
    dsk__st_json j;
    const char *path;
    int obj;             /* the object keys are looked up in */
    const char *prefix;  /* "" or "rope_scaling." for messages */
} dsk__ckpt_hfc;

static dsk_status dsk__ckpt_hfc_bad(const dsk__ckpt_hfc *r, const char *key, const char *want) {
    return dsk_set_error(DSK_ERR_CORRUPT, "dsk_ckpt_hf_deepseek_config_read: \"%s\": key \"%s%s\" %s", r->path,
                         r->prefix,
                         key, want);
}

/* Integer key (null allowed when null_value >= -1: it gives that value; missing allowed when opt). */
static dsk_status dsk__ckpt_hfc_i64(const dsk__ckpt_hfc *r, const char *key, int64_t *out, int opt, int64_t null_value,
                                    int64_t min) {
    int c = dsk__st_jget(&r->j, r->obj, key);
    if (c < 0) return opt ? DSK_OK : dsk__ckpt_hfc_bad(r, key, "is missing");
    if (dsk__st_jtype(&r->j, c) == DSK__ST_J_NULL && null_value >= -1) {
        *out = null_value;
        return DSK_OK;
    }
    if (!dsk__st_jint(&r->j, c, out)) return dsk__ckpt_hfc_bad(r, key, "is not an integer");
    if (*out < min || *out > INT32_MAX) return dsk__ckpt_hfc_bad(r, key, "is out of range");
    return DSK_OK;
}

static dsk_status dsk__ckpt_hfc_int(const dsk__ckpt_hfc *r, const char *key, int *out, int opt, int null_value,
                                    int min) {
    int64_t v = *out;
    DSK__TRY(dsk__ckpt_hfc_i64(r, key, &v, opt, null_value, min));
    *out = (int)v;
    return DSK_OK;
}

static dsk_status dsk__ckpt_hfc_num(const dsk__ckpt_hfc *r, const char *key, double *out, int opt) {
    int c = dsk__st_jget(&r->j, r->obj, key);
    if (c < 0) return opt ? DSK_OK : dsk__ckpt_hfc_bad(r, key, "is missing");
    if (!dsk__ckpt_jnum(&r->j, c, out)) return dsk__ckpt_hfc_bad(r, key, "is not a number");
    return DSK_OK;
}

static dsk_status dsk__ckpt_hfc_bool(const dsk__ckpt_hfc *r, const char *key, int *out, int opt) {
    int c = dsk__st_jget(&r->j, r->obj, key);
    if (c < 0) return opt ? DSK_OK : dsk__ckpt_hfc_bad(r, key, "is missing");
    if (dsk__st_jtype(&r->j, c) != DSK__ST_J_BOOL) return dsk__ckpt_hfc_bad(r, key, "is not true or false");
    *out = r->j.nodes[c].val != 0;
    return DSK_OK;
}

/* String key, one of the '|'-separated words of `allowed` (NULL: any). */
static dsk_status dsk__ckpt_hfc_str(const dsk__ckpt_hfc *r, const char *key, char *out, size_t cap, int opt,
                                    const char *allowed) {
    int c = dsk__st_jget(&r->j, r->obj, key);
    const char *v = dsk__st_jstr(&r->j, c);
    char want[160];
    if (c < 0) return opt ? DSK_OK : dsk__ckpt_hfc_bad(r, key, "is missing");
    if (!v || strlen(v) >= cap) return dsk__ckpt_hfc_bad(r, key, "is not a short string");
    if (allowed) {
        size_t n = strlen(v);
        const char *p = allowed;
        int ok = 0;
        while (*p && !ok) {
            const char *e = strchr(p, '|');
            size_t len = e ? (size_t)(e - p) : strlen(p);
            ok = len == n && strncmp(p, v, n) == 0;
            p += len + (e != NULL);
        }
        if (!ok) {
            snprintf(want, sizeof want, "is \"%s\": dsk knows %s", v, allowed);
            return dsk__ckpt_hfc_bad(r, key, want);
        }
    }
    snprintf(out, cap, "%s", v);
    return DSK_OK;
}

/* rope_scaling: null, or YaRN with every parameter. */
static dsk_status dsk__ckpt_hfc_rope(dsk__ckpt_hfc *r, dsk_ckpt_hf_deepseek_config *c) {
    int rs = dsk__st_jget(&r->j, 0, "rope_scaling"), top = r->obj;
    char type[16] = "";
    dsk_status s = DSK_OK;
    if (rs < 0 || dsk__st_jtype(&r->j, rs) == DSK__ST_J_NULL) return DSK_OK;
    if (dsk__st_jtype(&r->j, rs) != DSK__ST_J_OBJ)
        return dsk__ckpt_hfc_bad(r, "rope_scaling", "is not null or an object");
    r->obj = rs;
    r->prefix = "rope_scaling.";
    if (dsk__st_jget(&r->j, rs, "type") >= 0) s = dsk__ckpt_hfc_str(r, "type", type, sizeof type, 0, "yarn");
    else s = dsk__ckpt_hfc_str(r, "rope_type", type, sizeof type, 0, "yarn");
    if (s == DSK_OK) s = dsk__ckpt_hfc_num(r, "factor", &c->rope_factor, 0);
    if (s == DSK_OK) s = dsk__ckpt_hfc_i64(r, "original_max_position_embeddings", &c->original_max_position_embeddings,
                                           0, -2, 1);
    if (s == DSK_OK) s = dsk__ckpt_hfc_num(r, "mscale", &c->mscale, 0);
    if (s == DSK_OK) s = dsk__ckpt_hfc_num(r, "mscale_all_dim", &c->mscale_all_dim, 0);
    if (s == DSK_OK) s = dsk__ckpt_hfc_num(r, "beta_fast", &c->beta_fast, 0);
    if (s == DSK_OK) s = dsk__ckpt_hfc_num(r, "beta_slow", &c->beta_slow, 0);
    r->obj = top;
    r->prefix = "";
    c->yarn = s == DSK_OK;
    return s;
}

/* quantization_config: absent, or FP8 e4m3 with its block size. */
static dsk_status dsk__ckpt_hfc_quant(dsk__ckpt_hfc *r, dsk_ckpt_hf_deepseek_config *c) {
    int q = dsk__st_jget(&r->j, 0, "quantization_config"), top = r->obj, bs;
    char word[16];
    dsk_status s;
    c->block[0] = c->block[1] = 128;
    if (q < 0) return DSK_OK;
    if (dsk__st_jtype(&r->j, q) != DSK__ST_J_OBJ)
        return dsk__ckpt_hfc_bad(r, "quantization_config", "is not an object");
    r->obj = q;
    r->prefix = "quantization_config.";
    s = dsk__ckpt_hfc_str(r, "quant_method", word, sizeof word, 0, "fp8");
    if (s == DSK_OK) s = dsk__ckpt_hfc_str(r, "fmt", word, sizeof word, 1, "e4m3");
    bs = dsk__st_jget(&r->j, q, "weight_block_size");
    if (s == DSK_OK && bs >= 0) {
        int64_t v[2] = {0, 0};
        int e = dsk__st_jchild(&r->j, bs);
        if (dsk__st_jcount(&r->j, bs) != 2 || dsk__st_jtype(&r->j, bs) != DSK__ST_J_ARR ||
            !dsk__st_jint(&r->j, e, &v[0]) || !dsk__st_jint(&r->j, dsk__st_jnext(&r->j, e), &v[1]) || v[0] < 1 ||
            v[1] < 1 || v[0] > 65536 || v[1] > 65536)
            s = dsk__ckpt_hfc_bad(r, "weight_block_size", "is not two positive integers");
        c->block[0] = (int)v[0];
        c->block[1] = (int)v[1];
    }
    r->obj = top;
    r->prefix = "";
    c->fp8 = s == DSK_OK;
    return s;
}

/* architectures: a list holding DeepseekV2ForCausalLM or DeepseekV3ForCausalLM. */
static dsk_status dsk__ckpt_hfc_arch(const dsk__ckpt_hfc *r, int *version) {
    int a = dsk__st_jget(&r->j, 0, "architectures");
    if (a < 0) return dsk__ckpt_hfc_bad(r, "architectures", "is missing");
    for (int e = dsk__st_jchild(&r->j, a); e >= 0 && dsk__st_jtype(&r->j, a) == DSK__ST_J_ARR;
         e = dsk__st_jnext(&r->j, e)) {
        const char *v = dsk__st_jstr(&r->j, e);
        if (v && strcmp(v, "DeepseekV2ForCausalLM") == 0) { *version = 2; return DSK_OK; }
        if (v && strcmp(v, "DeepseekV3ForCausalLM") == 0) { *version = 3; return DSK_OK; }
    }
    return dsk__ckpt_hfc_bad(r, "architectures", "names neither DeepseekV2ForCausalLM nor DeepseekV3ForCausalLM");
}

static dsk_status dsk__ckpt_hfc_sizes(const dsk__ckpt_hfc *r, dsk_ckpt_hf_deepseek_config *c) {
    DSK__TRY(dsk__ckpt_hfc_i64(r, "vocab_size", &c->vocab_size, 0, -2, 1));
    DSK__TRY(dsk__ckpt_hfc_i64(r, "hidden_size", &c->hidden_size, 0, -2, 1));
    DSK__TRY(dsk__ckpt_hfc_i64(r, "intermediate_size", &c->intermediate_size, 0, -2, 1));
    DSK__TRY(dsk__ckpt_hfc_i64(r, "moe_intermediate_size", &c->moe_intermediate_size, 0, -2, 1));
    DSK__TRY(dsk__ckpt_hfc_int(r, "num_hidden_layers", &c->num_hidden_layers, 0, -2, 1));
    DSK__TRY(dsk__ckpt_hfc_int(r, "first_k_dense_replace", &c->first_k_dense_replace, 0, -2, 0));
    DSK__TRY(dsk__ckpt_hfc_int(r, "moe_layer_freq", &c->moe_layer_freq, 0, -2, 1));
    DSK__TRY(dsk__ckpt_hfc_int(r, "n_routed_experts", &c->n_routed_experts, 0, -2, 1));
    DSK__TRY(dsk__ckpt_hfc_int(r, "n_shared_experts", &c->n_shared_experts, 0, 0, 0));
    DSK__TRY(dsk__ckpt_hfc_int(r, "num_experts_per_tok", &c->num_experts_per_tok, 0, -2, 1));
    DSK__TRY(dsk__ckpt_hfc_int(r, "n_group", &c->n_group, 0, 1, 1));
    DSK__TRY(dsk__ckpt_hfc_int(r, "topk_group", &c->topk_group, 0, 1, 1));
    DSK__TRY(dsk__ckpt_hfc_int(r, "q_lora_rank", &c->q_lora_rank, 0, 0, 0));
    DSK__TRY(dsk__ckpt_hfc_int(r, "kv_lora_rank", &c->kv_lora_rank, 0, -2, 1));
    DSK__TRY(dsk__ckpt_hfc_int(r, "qk_nope_head_dim", &c->qk_nope_head_dim, 0, -2, 0));
    DSK__TRY(dsk__ckpt_hfc_int(r, "qk_rope_head_dim", &c->qk_rope_head_dim, 0, -2, 0));
    DSK__TRY(dsk__ckpt_hfc_int(r, "v_head_dim", &c->v_head_dim, 0, -2, 1));
    DSK__TRY(dsk__ckpt_hfc_int(r, "num_attention_heads", &c->num_attention_heads, 0, -2, 1));
    DSK__TRY(dsk__ckpt_hfc_int(r, "num_nextn_predict_layers", &c->num_nextn_predict_layers, 1, -2, 0));
    DSK__TRY(dsk__ckpt_hfc_i64(r, "max_position_embeddings", &c->max_position_embeddings, 1, -2, 0));
    DSK__TRY(dsk__ckpt_hfc_i64(r, "bos_token_id", &c->bos_token_id, 1, -1, 0));
    return dsk__ckpt_hfc_i64(r, "eos_token_id", &c->eos_token_id, 1, -1, 0);
}

static dsk_status dsk__ckpt_hfc_routing(const dsk__ckpt_hfc *r, dsk_ckpt_hf_deepseek_config *c) {
    DSK__TRY(dsk__ckpt_hfc_str(r, "topk_method", c->topk_method, sizeof c->topk_method, 0,
                               "greedy|group_limited_greedy|noaux_tc"));
    DSK__TRY(dsk__ckpt_hfc_str(r, "scoring_func", c->scoring_func, sizeof c->scoring_func, 0, "softmax|sigmoid"));
    DSK__TRY(dsk__ckpt_hfc_bool(r, "norm_topk_prob", &c->norm_topk_prob, 0));
    DSK__TRY(dsk__ckpt_hfc_num(r, "routed_scaling_factor", &c->routed_scaling_factor, 0));
    DSK__TRY(dsk__ckpt_hfc_num(r, "rope_theta", &c->rope_theta, 0));
    DSK__TRY(dsk__ckpt_hfc_num(r, "rms_norm_eps", &c->rms_norm_eps, 0));
    DSK__TRY(dsk__ckpt_hfc_bool(r, "tie_word_embeddings", &c->tie_word_embeddings, 1));
    return dsk__ckpt_hfc_str(r, "torch_dtype", c->torch_dtype, sizeof c->torch_dtype, 1, NULL);
}

DSK_API dsk_status dsk_ckpt_hf_deepseek_config_read(dsk_ckpt_hf_deepseek_config *c, const char *dir) {
    const char *fn = "dsk_ckpt_hf_deepseek_config_read";
    dsk__ckpt_hfc r;
    char *text = NULL, *path;
    size_t len = 0;
    dsk_status s;
    if (!c || !dir) return dsk_set_error(DSK_ERR_ARG, "%s: NULL argument", fn);
    memset(c, 0, sizeof *c);
    memset(&r, 0, sizeof r);
    c->bos_token_id = c->eos_token_id = -1;
    if (!(path = dsk__st_join(dir, "config.json"))) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    r.path = path;
    r.prefix = "";
    s = dsk__st_read_small(fn, path, (size_t)1 << 20, &text, &len);
    if (s == DSK_OK) s = dsk__st_json_parse(&r.j, text, len, fn, path);
    if (s == DSK_OK && dsk__st_jtype(&r.j, 0) != DSK__ST_J_OBJ)
        s = dsk_set_error(DSK_ERR_CORRUPT, "%s: \"%s\" is not a JSON object", fn, path);
    if (s == DSK_OK) s = dsk__ckpt_hfc_arch(&r, &c->version);
    if (s == DSK_OK) s = dsk__ckpt_hfc_sizes(&r, c);
    if (s == DSK_OK) s = dsk__ckpt_hfc_routing(&r, c);
    if (s == DSK_OK) s = dsk__ckpt_hfc_rope(&r, c);
    if (s == DSK_OK) s = dsk__ckpt_hfc_quant(&r, c);
    dsk__st_json_free(&r.j);
    DSK_FREE(text);
    DSK_FREE(path);
    if (s != DSK_OK) {
        memset(c, 0, sizeof *c);
        c->bos_token_id = c->eos_token_id = -1;
    }
    return s;
}

/* "key": integer or null (v < 0 with nullable). */
static void dsk__ckpt_hfw_int(dsk__st_buf *b, const char *key, int64_t v, int nullable) {
    if (nullable && v < 0) dsk__st_putf(b, ",\n  \"%s\": null", key);
    else dsk__st_putf(b, ",\n  \"%s\": %lld", key, (long long)v);
}

/* The shortest %g form of v that reads back as v, with a ".0" when it would read as an
   integer (transformers' config classes check float fields' types). */
static const char *dsk__ckpt_hf_num(char buf[40], double v) {
    for (int p = 15; p <= 17; p++) {
        snprintf(buf, 40, "%.*g", p, v);
        if (strtod(buf, NULL) == v) break;
    }
    if (!strpbrk(buf, ".eEn")) strcat(buf, ".0");
    return buf;
}

static void dsk__ckpt_hfw_num(dsk__st_buf *b, const char *key, double v) {
    char t[40];
    dsk__st_putf(b, ",\n  \"%s\": %s", key, dsk__ckpt_hf_num(t, v));
}

static void dsk__ckpt_hfw_str(dsk__st_buf *b, const char *key, const char *v, int is_bool) {
    dsk__st_putf(b, is_bool ? ",\n  \"%s\": %s" : ",\n  \"%s\": \"%s\"", key, v);
}

static void dsk__ckpt_hfw_body(dsk__st_buf *b, const dsk_ckpt_hf_deepseek_config *c) {
    dsk__st_putf(b, "{\n  \"architectures\": [\"DeepseekV%dForCausalLM\"]", c->version);
    dsk__ckpt_hfw_str(b, "model_type", c->version == 3 ? "deepseek_v3" : "deepseek_v2", 0);
    dsk__ckpt_hfw_str(b, "hidden_act", "silu", 0);
    dsk__ckpt_hfw_str(b, "attention_bias", "false", 1);
    if (c->version == 3) dsk__ckpt_hfw_str(b, "rope_interleave", "true", 1);
    dsk__ckpt_hfw_int(b, "vocab_size", c->vocab_size, 0);
    dsk__ckpt_hfw_int(b, "hidden_size", c->hidden_size, 0);
    dsk__ckpt_hfw_int(b, "intermediate_size", c->intermediate_size, 0);
    dsk__ckpt_hfw_int(b, "moe_intermediate_size", c->moe_intermediate_size, 0);
    dsk__ckpt_hfw_int(b, "num_hidden_layers", c->num_hidden_layers, 0);
    dsk__ckpt_hfw_int(b, "first_k_dense_replace", c->first_k_dense_replace, 0);
    dsk__ckpt_hfw_int(b, "moe_layer_freq", c->moe_layer_freq, 0);
    dsk__ckpt_hfw_int(b, "n_routed_experts", c->n_routed_experts, 0);
    dsk__ckpt_hfw_int(b, "n_shared_experts", c->n_shared_experts, 0);
    dsk__ckpt_hfw_int(b, "num_experts_per_tok", c->num_experts_per_tok, 0);
    dsk__ckpt_hfw_int(b, "n_group", c->n_group, 0);
    dsk__ckpt_hfw_int(b, "topk_group", c->topk_group, 0);
    dsk__ckpt_hfw_str(b, "topk_method", c->topk_method, 0);
    dsk__ckpt_hfw_str(b, "scoring_func", c->scoring_func, 0);
    dsk__ckpt_hfw_str(b, "norm_topk_prob", c->norm_topk_prob ? "true" : "false", 1);
    dsk__ckpt_hfw_num(b, "routed_scaling_factor", c->routed_scaling_factor);
    dsk__ckpt_hfw_int(b, "q_lora_rank", c->q_lora_rank > 0 ? c->q_lora_rank : -1, 1);
    dsk__ckpt_hfw_int(b, "kv_lora_rank", c->kv_lora_rank, 0);
    dsk__ckpt_hfw_int(b, "qk_nope_head_dim", c->qk_nope_head_dim, 0);
    dsk__ckpt_hfw_int(b, "qk_rope_head_dim", c->qk_rope_head_dim, 0);
    dsk__ckpt_hfw_int(b, "v_head_dim", c->v_head_dim, 0);
    dsk__ckpt_hfw_int(b, "num_attention_heads", c->num_attention_heads, 0);
    dsk__ckpt_hfw_int(b, "num_key_value_heads", c->num_attention_heads, 0);
    dsk__ckpt_hfw_num(b, "rope_theta", c->rope_theta);
    dsk__ckpt_hfw_num(b, "rms_norm_eps", c->rms_norm_eps);
    dsk__ckpt_hfw_str(b, "tie_word_embeddings", c->tie_word_embeddings ? "true" : "false", 1);
    dsk__ckpt_hfw_int(b, "num_nextn_predict_layers", c->num_nextn_predict_layers, 0);
    if (c->max_position_embeddings > 0) dsk__ckpt_hfw_int(b, "max_position_embeddings", c->max_position_embeddings, 0);
    dsk__ckpt_hfw_int(b, "bos_token_id", c->bos_token_id, 1);
    dsk__ckpt_hfw_int(b, "eos_token_id", c->eos_token_id, 1);
    if (c->torch_dtype[0]) dsk__ckpt_hfw_str(b, "torch_dtype", c->torch_dtype, 0);
}

DSK_API dsk_status dsk_ckpt_hf_deepseek_config_write(const dsk_ckpt_hf_deepseek_config *c, const char *dir) {
    const char *fn = "dsk_ckpt_hf_deepseek_config_write";
    dsk__st_buf b;
    dsk_status s;
    if (!c || !dir) return dsk_set_error(DSK_ERR_ARG, "%s: NULL argument", fn);
    if (c->version != 2 && c->version != 3)
        return dsk_set_error(DSK_ERR_ARG, "%s: version %d (2 or 3)", fn, c->version);
    memset(&b, 0, sizeof b);
    dsk__ckpt_hfw_body(&b, c);
    if (!c->yarn) {
        dsk__st_puts(&b, ",\n  \"rope_scaling\": null");
    } else {
        char t[4][40];
        dsk__st_putf(&b, ",\n  \"rope_scaling\": {\"type\": \"yarn\", \"factor\": %s",
                     dsk__ckpt_hf_num(t[0], c->rope_factor));
        dsk__st_putf(&b, ", \"original_max_position_embeddings\": %lld",
                     (long long)c->original_max_position_embeddings);
        dsk__st_putf(&b, ", \"mscale\": %s, \"mscale_all_dim\": %s", dsk__ckpt_hf_num(t[0], c->mscale),
                     dsk__ckpt_hf_num(t[1], c->mscale_all_dim));
        dsk__st_putf(&b, ", \"beta_fast\": %s, \"beta_slow\": %s}", dsk__ckpt_hf_num(t[2], c->beta_fast),
                     dsk__ckpt_hf_num(t[3], c->beta_slow));
    }
    if (c->fp8) {
        dsk__st_puts(&b, ",\n  \"quantization_config\": {\"quant_method\": \"fp8\", \"fmt\": \"e4m3\", ");
        dsk__st_putf(&b, "\"activation_scheme\": \"dynamic\", \"weight_block_size\": [%d, %d]}", c->block[0],
                     c->block[1]);
    }
    dsk__st_puts(&b, "\n}\n");
    s = b.oom ? dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn)
              : dsk__st_write_small(fn, dir, "config.json", b.p, b.n, DSK__ST_DURABLE);
    dsk__st_buf_free(&b);
    return s;
}

DSK_API dsk_status dsk_ckpt_hf_deepseek_role_name(char *buf, size_t n, int layer, const char *role) {
    static const char *const model[][2] = {
        {"embed", "model.embed_tokens.weight"}, {"ln_f", "model.norm.weight"}, {"lm_head", "lm_head.weight"}};
    static const char *const layers[][2] = {
        {"ln1", "input_layernorm.weight"},          {"ln2", "post_attention_layernorm.weight"},
        {"attn.wq", "self_attn.q_proj.weight"},     {"attn.wq_a", "self_attn.q_a_proj.weight"},
        {"attn.q_norm", "self_attn.q_a_layernorm.weight"}, {"attn.wq_b", "self_attn.q_b_proj.weight"},
        {"attn.wkv_a", "self_attn.kv_a_proj_with_mqa.weight"}, {"attn.kv_norm", "self_attn.kv_a_layernorm.weight"},
        {"attn.wkv_b", "self_attn.kv_b_proj.weight"}, {"attn.wo", "self_attn.o_proj.weight"},
        {"ffn.w1", "mlp.gate_proj.weight"},         {"ffn.w3", "mlp.up_proj.weight"},
        {"ffn.w2", "mlp.down_proj.weight"},         {"mtp.enorm", "enorm.weight"},
        {"mtp.hnorm", "hnorm.weight"},              {"mtp.proj", "eh_proj.weight"},
        {"mtp.norm", "shared_head.norm.weight"},    {"mtp.embed", "embed_tokens.weight"},
        {"mtp.head", "shared_head.head.weight"}};
    const char *fn = "dsk_ckpt_hf_deepseek_role_name";
    int k = -1;
    if (!buf || !role || layer < -1) return dsk_set_error(DSK_ERR_ARG, "%s: NULL argument or layer %d", fn, layer);
    if (layer < 0) {
        for (size_t i = 0; i < sizeof model / sizeof model[0]; i++)
            if (strcmp(model[i][0], role) == 0) k = snprintf(buf, n, "%s", model[i][1]);
    } else {
        for (size_t i = 0; i < sizeof layers / sizeof layers[0]; i++)
            if (strcmp(layers[i][0], role) == 0) k = snprintf(buf, n, "model.layers.%d.%s", layer, layers[i][1]);
        if (k < 0) return dsk_ckpt_hf_deepseek_name(buf, n, layer, role);
    }
    if (k < 0) return dsk_set_error(DSK_ERR_ARG, "%s: no DeepSeek tensor for role \"%s\" of layer %d", fn, role, layer);
    if ((size_t)k >= n) return dsk_set_error(DSK_ERR_ARG, "%s: a buffer of %zu bytes is too small", fn, n);
    return DSK_OK;
}

/* "[a, b, c]" */
static void dsk__ckpt_hf_shape(char *buf, size_t n, int ndim, const int64_t *shape) {
    size_t k = (size_t)snprintf(buf, n, "[");
    for (int d = 0; d < ndim && k < n; d++)
        k += (size_t)snprintf(buf + k, n - k, d ? ", %lld" : "%lld", (long long)shape[d]);
    if (k < n) snprintf(buf + k, n - k, "]");
}

/* Checks one file tensor of an import against its destination (and its FP8 scale). */
static dsk_status dsk__ckpt_hf_check_one(dsk_safetensors_hf *h, const char *name, const dsk_tensor *dst,
                                         const int block[2], dsk__st_buf *sn) {
    const char *fn = "dsk_ckpt_hf_read_dequant";
    dsk_safetensors_file *f = NULL, *sf = NULL;
    const dsk_safetensors_info *t = NULL, *st = NULL;
    int same = 1;
    DSK__TRY(dsk_safetensors_hf_find(h, name, &f, &t));
    same = t->ndim == dst->ndim;
    for (int d = 0; same && d < t->ndim; d++) same = t->shape[d] == dst->shape[d];
    if (!same) {
        char a[96], b[96];
        dsk__ckpt_hf_shape(a, sizeof a, t->ndim, t->shape);
        dsk__ckpt_hf_shape(b, sizeof b, dst->ndim, dst->shape);
        return dsk_set_error(DSK_ERR_ARG, "%s: \"%s\": tensor \"%s\" is %s, the model's is %s", fn, f->path, name, a,
                             b);
    }
    if (t->dtype < 0) return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: \"%s\": tensor \"%s\" has dtype %s", fn, f->path,
                                           name, t->dtype_name);
    if (t->dtype != DSK_E4M3) return DSK_OK;
    sn->n = 0;
    dsk__st_puts(sn, name);
    dsk__st_puts(sn, "_scale_inv");
    if (sn->oom) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    if (t->ndim != 2)
        return dsk_set_error(DSK_ERR_ARG, "%s: \"%s\": FP8 tensor \"%s\" is not a matrix", fn, f->path, name);
    if (dsk_safetensors_hf_find(h, sn->p, &sf, &st) != DSK_OK)
        return dsk_set_error(DSK_ERR_CORRUPT, "%s: \"%s\": FP8 tensor \"%s\" has no \"%s\"", fn, f->path, name, sn->p);
    if (st->dtype != DSK_F32 || st->ndim != 2 || st->shape[0] != (t->shape[0] + block[0] - 1) / block[0] ||
        st->shape[1] != (t->shape[1] + block[1] - 1) / block[1])
        return dsk_set_error(DSK_ERR_ARG, "%s: \"%s\": \"%s\" is not f32 (ceil(%lld/%d), ceil(%lld/%d))", fn, sf->path,
                             sn->p, (long long)t->shape[0], block[0], (long long)t->shape[1], block[1]);
    return DSK_OK;
}

/* w (R, C) = e4m3 q times its block's scale, on the host. */
static void dsk__ckpt_dequant(float *w, const uint8_t *q, const float *scale, int64_t R, int64_t C,
                              const int block[2]) {
    int64_t sc = (C + block[1] - 1) / block[1];
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < C; c++)
            w[r * C + c] = dsk_e4m3_to_f32(q[r * C + c]) * scale[(r / block[0]) * sc + c / block[1]];
}

/* Reads one file tensor into dst, dequantising FP8 (checked by dsk__ckpt_hf_check_one). */
static dsk_status dsk__ckpt_hf_read_one(dsk_safetensors_hf *h, dsk_ctx *ctx, const char *name, dsk_tensor *dst,
                                        const int block[2], dsk__st_buf *sn) {
    const char *fn = "dsk_ckpt_hf_read_dequant";
    dsk_safetensors_file *f = NULL, *sf = NULL;
    const dsk_safetensors_info *t = NULL, *st = NULL;
    dsk_tensor scale, host;
    uint8_t *q = NULL;
    float *w = NULL;
    dsk_status s;
    DSK__TRY(dsk_safetensors_hf_find(h, name, &f, &t));
    if (t->dtype != DSK_E4M3) return dsk_safetensors_read(f, ctx, name, dst, 1);
    memset(&scale, 0, sizeof scale);
    sn->n = 0;
    dsk__st_puts(sn, name);
    dsk__st_puts(sn, "_scale_inv");
    if (sn->oom) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    DSK__TRY(dsk_safetensors_hf_find(h, sn->p, &sf, &st));
    q = (uint8_t *)DSK_MALLOC((size_t)(t->shape[0] * t->shape[1]) + 1);
    w = (float *)DSK_MALLOC((size_t)(t->shape[0] * t->shape[1]) * sizeof *w + 1);
    s = q && w ? dsk_tensor_alloc(NULL, &scale, DSK_F32, 2, st->shape)
               : dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    if (s == DSK_OK) s = dsk_safetensors_read_raw(f, name, NULL, t->shape, q, (size_t)(t->shape[0] * t->shape[1]));
    if (s == DSK_OK) s = dsk_safetensors_read(sf, NULL, sn->p, &scale, 0);
    if (s == DSK_OK) {
        dsk__ckpt_dequant(w, q, (const float *)scale.data, t->shape[0], t->shape[1], block);
        s = dsk_tensor_wrap(&host, w, DSK_F32, dsk_cpu(), 2, t->shape);
    }
    if (s == DSK_OK) s = dsk_tensor_copy(ctx, dst, &host);
    dsk_tensor_free(NULL, &scale);
    DSK_FREE(q);
    DSK_FREE(w);
    return s;
}

DSK_API dsk_status dsk_ckpt_hf_read_dequant(dsk_safetensors_hf *h, dsk_ctx *ctx,
                                            const dsk_safetensors_hf_entry *entries, int n, const int block[2]) {
    const char *fn = "dsk_ckpt_hf_read_dequant";
    dsk__st_buf nm, sn;
    dsk_status s = DSK_OK;
    if (!h || !h->dir || n < 0 || (n && !entries) || !block || block[0] < 1 || block[1] < 1)
        return dsk_set_error(DSK_ERR_ARG, "%s: NULL argument, closed set or bad block size", fn);
    memset(&nm, 0, sizeof nm);
    memset(&sn, 0, sizeof sn);
    for (int pass = 0; pass < 2 && s == DSK_OK; pass++) /* check everything, then read */
        for (int i = 0; i < n && s == DSK_OK; i++) {
            const dsk_safetensors_hf_entry *e = &entries[i];
            int64_t count = 0;
            if ((s = dsk__st_hf_count(fn, e, i, &count)) != DSK_OK) break;
            for (int64_t k = 0; k < count && s == DSK_OK; k++) {
                dsk_tensor view = *e->tensor;
                const char *name = e->name;
                if (e->stacked) {
                    if ((s = dsk__st_hf_expert_name(fn, e->name, e->expert0 + k, &nm)) != DSK_OK) break;
                    if ((s = dsk_tensor_select(e->tensor, k, &view)) != DSK_OK) break;
                    name = nm.p;
                }
                s = pass == 0 ? dsk__ckpt_hf_check_one(h, name, &view, block, &sn)
                              : dsk__ckpt_hf_read_one(h, ctx, name, &view, block, &sn);
            }
        }
    dsk__st_buf_free(&nm);
    dsk__st_buf_free(&sn);
    return s;
}

DSK_API dsk_status dsk_ckpt_hf_quantize_e4m3(dsk_tensor *q, dsk_tensor *scale_inv, const dsk_tensor *w,
                                             const int block[2]) {
    const char *fn = "dsk_ckpt_hf_quantize_e4m3";
    int64_t R, C, sr, sc;
    if (!q || !scale_inv || !w || !block || block[0] < 1 || block[1] < 1)
        return dsk_set_error(DSK_ERR_ARG, "%s: NULL argument or bad block size", fn);
    if (w->ndim != 2 || w->dtype != DSK_F32 || q->dtype != DSK_E4M3 || scale_inv->dtype != DSK_F32 ||
        !dsk_tensor_is_contiguous(w) || !dsk_tensor_is_contiguous(q) || !dsk_tensor_is_contiguous(scale_inv) ||
        w->device.type != DSK_DEV_CPU || q->device.type != DSK_DEV_CPU || scale_inv->device.type != DSK_DEV_CPU)
        return dsk_set_error(DSK_ERR_ARG, "%s: host contiguous w f32 (R, C), q e4m3 and scale_inv f32 needed", fn);
    R = w->shape[0];
    C = w->shape[1];
    sr = (R + block[0] - 1) / block[0];
    sc = (C + block[1] - 1) / block[1];
    if (q->ndim != 2 || q->shape[0] != R || q->shape[1] != C || scale_inv->ndim != 2 || scale_inv->shape[0] != sr ||
        scale_inv->shape[1] != sc)
        return dsk_set_error(DSK_ERR_ARG, "%s: q must be (%lld, %lld) and scale_inv (%lld, %lld)", fn, (long long)R,
                             (long long)C, (long long)sr, (long long)sc);
    for (int64_t br = 0; br < sr; br++)
        for (int64_t bc = 0; bc < sc; bc++) {
            const float *x = (const float *)w->data;
            float amax = 0, s;
            for (int64_t r = br * block[0]; r < R && r < (br + 1) * block[0]; r++)
                for (int64_t c = bc * block[1]; c < C && c < (bc + 1) * block[1]; c++)
                    amax = fmaxf(amax, fabsf(x[r * C + c]));
            s = amax > 0 ? amax / DSK_E4M3_MAX : 1.0f;
            ((float *)scale_inv->data)[br * sc + bc] = s;
            for (int64_t r = br * block[0]; r < R && r < (br + 1) * block[0]; r++)
                for (int64_t c = bc * block[1]; c < C && c < (bc + 1) * block[1]; c++)
                    ((uint8_t *)q->data)[r * C + c] = dsk_f32_to_e4m3(x[r * C + c] / s);
        }
    return DSK_OK;
}
#endif /* DSK_CKPT_NO_HF */

/* ---------------------------------------------------------------- metadata */

DSK_API const char *dsk_ckpt_meta_get(const dsk_ckpt_meta *m, const char *key) {
    if (!m || !key) return NULL;
    for (int i = 0; i < m->n; i++)
        if (strcmp(m->keys[i], key) == 0) return m->values[i];
    return NULL;
}

DSK_API dsk_status dsk_ckpt_meta_i64(const dsk_ckpt_meta *m, const char *key, int64_t *out) {
    const char *v = dsk_ckpt_meta_get(m, key);
    if (!out) return dsk_set_error(DSK_ERR_ARG, "dsk_ckpt_meta_i64: out is NULL");
    if (!v) return dsk_set_error(DSK_ERR_ARG, "dsk_ckpt_meta_i64: no key \"%s\"", key ? key : "(null)");
    if (!dsk__ckpt_parse_i64(v, out))
        return dsk_set_error(DSK_ERR_CORRUPT, "dsk_ckpt_meta_i64: \"%s\" = \"%s\" is not an int64", key, v);
    return DSK_OK;
}

DSK_API dsk_status dsk_ckpt_meta_f64(const dsk_ckpt_meta *m, const char *key, double *out) {
    const char *v = dsk_ckpt_meta_get(m, key);
    char *end;
    if (!out) return dsk_set_error(DSK_ERR_ARG, "dsk_ckpt_meta_f64: out is NULL");
    if (!v) return dsk_set_error(DSK_ERR_ARG, "dsk_ckpt_meta_f64: no key \"%s\"", key ? key : "(null)");
    *out = strtod(v, &end);
    if (!*v || *end)
        return dsk_set_error(DSK_ERR_CORRUPT, "dsk_ckpt_meta_f64: \"%s\" = \"%s\" is not a number", key, v);
    return DSK_OK;
}

DSK_API void dsk_ckpt_meta_free(dsk_ckpt_meta *m) {
    if (!m) return;
    for (int i = 0; i < m->n; i++) { DSK_FREE(m->keys[i]); DSK_FREE(m->values[i]); }
    DSK_FREE(m->keys);
    DSK_FREE(m->values);
    DSK_FREE(m->skipped_error);
    memset(m, 0, sizeof *m);
    m->skipped_step = -1;
}

/* ---------------------------------------------------------------- options */

#ifdef DSK_CKPT_NO_HF
#define DSK__CKPT_OPTIONS " DSK_CKPT_NO_HF" DSK__ST_OPTIONS
#else
#define DSK__CKPT_OPTIONS DSK__ST_OPTIONS
#endif

DSK_API const char *dsk_ckpt_options(void) { return dsk__st_options_text(DSK__CKPT_OPTIONS); }

#endif /* DSK_CKPT_IMPLEMENTATION_DONE */
#endif /* DSK_CKPT_IMPLEMENTATION */

/* MIT License. Copyright (c) 2026 the dsk authors. Permission is hereby granted, free of
   charge, to any person obtaining a copy of this software, to deal in the software without
   restriction, subject to including this notice. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT
   WARRANTY OF ANY KIND. */
