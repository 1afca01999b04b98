/* fuzz_ckpt.c - libFuzzer target for the two parsers of untrusted bytes, dsk_safetensors.h's and
   dsk_ckpt.h's, and the JSON reader behind them: every input is parsed as a whole safetensors file
   (dsk_safetensors_parse) and as a checkpoint manifest. They must return a status with a
   message, never crash, leak or read out of bounds; what they accept must be consistent
   (tensors inside the file, slices inside their tensor and naming one of the files).
   Build and run: `make fuzz` (scripts/fuzz.sh; clang -fsanitize=fuzzer,address,undefined).
   Seeds: tests/fuzz_corpus/. */
#define DSK_TENSOR_IMPLEMENTATION
#define DSK_CKPT_IMPLEMENTATION
#include "dsk_tensor.h"
#include "dsk_ckpt.h"

#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void fuzz_manifest(const uint8_t *data, size_t size) {
    dsk__ckpt_manifest m;
    char path[] = "fuzz/manifest.json";
    dsk_clear_error();
    memset(&m, 0, sizeof m);
    m.path = (char *)malloc(sizeof path);
    m.text = (char *)malloc(size + 1);
    if (!m.path || !m.text) abort();
    memcpy(m.path, path, sizeof path);
    if (size) memcpy(m.text, data, size);
    m.text[size] = 0;
    if (dsk__ckpt_manifest_parse("fuzz", &m, size, -1) == DSK_OK) {
        for (int i = 0; i < m.n_tensors; i++) {
            const dsk__ckpt_mtensor *t = &m.tensors[i];
            for (int k = 0; k < t->n_slices; k++) {
                const dsk__ckpt_mslice *sl = &m.slices[t->first + k];
                if (sl->file < 0 || sl->file >= m.n_files) abort();
                for (int d = 0; d < t->ndim; d++) /* the slice's box inside its tensor */
                    if (sl->box[d] < 0 || sl->box[t->ndim + d] < 0 || sl->box[d] + sl->box[t->ndim + d] > t->shape[d])
                        abort();
            }
            if (dsk__ckpt_manifest_find(&m, t->name) != t) abort();
        }
    } else if (!dsk_last_error()[0]) {
        abort();
    }
    dsk__ckpt_manifest_free(&m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    dsk_safetensors_file f;
    if (dsk_safetensors_parse(&f, data, size, size) == DSK_OK) {
        uint64_t data_bytes = size - 8 - f.header_len;
        for (int i = 0; i < f.n_tensors; i++) {
            const dsk_safetensors_info *t = &f.tensors[i];
            if (t->begin > t->end || t->end > data_bytes) abort(); /* the parser let a tensor out of the file */
            if (dsk_safetensors_find(&f, t->name) != i) abort();
        }
        for (int i = 0; i < f.n_meta; i++)
            if (dsk_safetensors_meta(&f, f.meta_keys[i]) != f.meta_values[i]) abort();
        dsk_safetensors_close(&f);
    } else if (!dsk_last_error()[0]) {
        abort(); /* an error without a message */
    }
    fuzz_manifest(data, size);
    return 0;
}
