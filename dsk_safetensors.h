/* dsk_safetensors.h - safetensors files in C: a strict reader (validated as the reference
   implementation does, every tensor's bytes checked against its CRC32C where the file records
   them, boxes read without reading the rest), an atomic and durable writer, and the sharded
   sets Hugging Face publishes (model.safetensors.index.json and its shards).

   Usage: #define DSK_SAFETENSORS_IMPLEMENTATION in exactly one .c file before including
   (after DSK_TENSOR_IMPLEMENTATION's file, or in the same one). dsk_ckpt.h builds on this
   header's implementation: its DSK_CKPT_IMPLEMENTATION compiles this one in the same file, so
   a program that has dsk_ckpt.h's defines DSK_CKPT_IMPLEMENTATION only. Needs POSIX 2008
   (files, pthread_once), asked for as dsk_ckpt.h does: put the DSK_*_IMPLEMENTATION defines
   and the dsk includes before any system header, or build with -D_GNU_SOURCE.
   Options: DSK_STATIC, DSK_MALLOC/DSK_FREE, DSK_CUDA as in dsk_tensor.h;
   DSK_SAFETENSORS_NO_SSE42 forces the table-driven CRC32C even where SSE4.2 is present.
   dsk_safetensors_options() names the options the implementation was compiled with.

   Why dsk_tensor.h: its status codes and thread error message are how every dsk call fails
   (dsk_status, dsk_last_error(): "dsk_safetensors_open: \"a.safetensors\": tensor \"w\"
   [3,4] F32 needs 48 bytes, data_offsets give 40"), its dtypes are the ones a file's tensors
   map to, and reads and writes take dsk_tensors of any device, strides and (with allow_cast)
   dtype. Nothing else of dsk is needed: copy dsk_tensor.h and this file.

   Files: dsk_safetensors_open validates a file's header and keeps the file open;
   dsk_safetensors_read / read_box / read_raw read a tensor, a box of one, or raw bytes of any
   dtype (one pread per contiguous run). dsk_safetensors_save writes one file to a temporary
   name, fsyncs it, renames it into place and fsyncs the directory. Its __metadata__ holds
   "dsk.format" (DSK_SAFETENSORS_FORMAT), "dsk.version", "dsk.crc32c.<tensor>" (CRC32C of the
   tensor's bytes, 8 hex digits), "dsk.blocks.<tensor>" (CRC32C of each 1 MiB of it:
   "1048576:" then 8 hex digits per block) and the caller's key/value pairs; tensors are
   laid out largest element first, then by name, as the reference writer aligns them.
   Sharded sets: dsk_safetensors_hf_open reads an index (or a single model.safetensors),
   dsk_safetensors_hf_read reads entries from whichever shard holds them (MoE experts stacked
   along dim 0 from the one-per-expert tensors the hub names), dsk_safetensors_hf_save writes
   shards and the index last.

   Example (given dsk_tensor *w, const char *path):
     dsk_safetensors_entry e[1] = {{"w", w}};
     dsk_safetensors_kv kv[1] = {{"note", "written by dsk"}};
     dsk_status st = dsk_safetensors_save(NULL, path, e, 1, kv, 1);
     dsk_safetensors_file f;
     if (st != DSK_OK) return st;                                  // dsk_last_error() says why
     if ((st = dsk_safetensors_open(&f, path)) != DSK_OK) return st;
     st = dsk_safetensors_read(&f, NULL, "w", w, 0);               // checks the tensor's CRC32C
     dsk_safetensors_close(&f);
     return st;
   End of example.
   Byte order: little-endian hosts only (the format is little-endian).
   License: MIT, see the end of the file. */
/* Contents
     declarations
       files             DSK_SAFETENSORS_FORMAT/VERSION/MAX_HEADER, dsk_safetensors_kv, dsk_safetensors_entry,
                         dsk_safetensors_info, dsk_safetensors_file, dsk_safetensors_open/parse/find/meta/read/
                         read_box/read_raw/close/save
       sharded sets      dsk_safetensors_hf, dsk_safetensors_hf_entry, dsk_safetensors_hf_open/find/read/close/save
       CRC32C, options   dsk_safetensors_crc32c, dsk_safetensors_crc32c_combine, dsk_safetensors_options
     implementation (DSK_SAFETENSORS_IMPLEMENTATION)
       CRC32C; small helpers; POSIX I/O; strict JSON (RFC 8259); safetensors files (parse, box
       reads); writing: plan, snapshot, file; Hugging Face sharded sets; options */
#if defined(DSK_SAFETENSORS_IMPLEMENTATION) && !defined(_POSIX_C_SOURCE) && !defined(_GNU_SOURCE) && \
    !defined(_XOPEN_SOURCE)
#define _POSIX_C_SOURCE 200809L
#endif
/* With DSK_STATIC every dsk function is static, so this file must also compile dsk_tensor.h's. */
#if defined(DSK_STATIC) && defined(DSK_SAFETENSORS_IMPLEMENTATION) && !defined(DSK_TENSOR_IMPLEMENTATION)
#define DSK_TENSOR_IMPLEMENTATION
#endif
#ifndef DSK_SAFETENSORS_H
#define DSK_SAFETENSORS_H
#include "dsk_tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- files */

#define DSK_SAFETENSORS_FORMAT "dsk-ckpt" /* "dsk.format" of the files dsk writes (dsk_ckpt.h's name) */
#define DSK_SAFETENSORS_VERSION 2
#define DSK_SAFETENSORS_MAX_HEADER 100000000ull /* the reference's limit on the JSON header */

/* One string key/value pair of __metadata__. Keys starting with "dsk." are reserved. */
typedef struct dsk_safetensors_kv {
    const char *key;
    const char *value;
} dsk_safetensors_kv;

/* One named tensor to write. */
typedef struct dsk_safetensors_entry {
    const char *name;   /* unique, non-empty UTF-8, not "__metadata__" */
    dsk_tensor *tensor; /* any device, dtype and strides */
} dsk_safetensors_entry;

/* A tensor described by a safetensors header. */
typedef struct dsk_safetensors_info {
    const char *name;
    const char *dtype_name; /* as in the file: "BF16", "F8_E4M3", "I16", ... */
    int dtype;              /* the dsk_dtype, or -1 when dsk has none (BOOL, I8, I16, U16, U32, U64, C64, F4, ...) */
    int ndim;
    int64_t shape[DSK_MAX_DIMS];
    uint64_t begin, end; /* byte range in the data buffer (which starts at 8 + header_len) */
    int has_crc;         /* __metadata__ holds "dsk.crc32c.<name>" */
    uint32_t crc32c;
    uint64_t block_bytes;   /* > 0: partial reads are checked block by block (dsk files); 0: unchecked */
    const char *block_crcs; /* 8 hex digits per block_bytes of data ("dsk.blocks.<name>"), or NULL when the
                                     whole tensor is one block checked by crc32c */
} dsk_safetensors_info;

/* A parsed safetensors file, validated as the reference implementation (safetensors 0.8)
   does: header <= 100,000,000 bytes of UTF-8 JSON, offsets contiguous from 0 with no gap or
   overlap, sizes matching shape and dtype, the last offset ending the file, shapes and
   offsets plain non-negative integers ("-0", "1.0" and "1e0" refused), "__metadata__" an
   object of strings or null. Differences, each checked against the package by
   tests/interop: dsk refuses duplicate tensor names or metadata keys, unknown fields in a
   tensor entry (DSK_ERR_CORRUPT) and more than 8 dims (DSK_ERR_UNSUPPORTED), which the
   reference accepts; a NUL character in a name or metadata string is DSK_ERR_UNSUPPORTED
   (valid safetensors, but dsk names are C strings). */
typedef struct dsk_safetensors_file {
    char *path; /* NULL for a header parsed from memory */
    int has_fd, fd;
    uint64_t file_size, header_len;
    uint32_t header_crc32c; /* CRC32C of the first 8 + header_len bytes */
    int n_tensors;
    dsk_safetensors_info *tensors; /* sorted by name */
    int n_meta;
    const char **meta_keys; /* __metadata__, sorted by key */
    const char **meta_values;
    uint64_t bytes_read; /* data bytes read from the file so far */
    void *mem;           /* private: the decoded JSON */
} dsk_safetensors_file;

/* Opens and validates a file; reads only its header. */
DSK_API dsk_status dsk_safetensors_open(dsk_safetensors_file *f, const char *path);
/* Validates the header in bytes[0, n) of a file of file_size bytes (n >= 8 + header length);
   the fuzzing entry point. dsk_safetensors_read is then not available. */
DSK_API dsk_status dsk_safetensors_parse(dsk_safetensors_file *f, const void *bytes, size_t n, uint64_t file_size);
/* Index of the tensor called name, or -1. */
DSK_API int dsk_safetensors_find(const dsk_safetensors_file *f, const char *name);
/* Value of a __metadata__ key or NULL. */
DSK_API const char *dsk_safetensors_meta(const dsk_safetensors_file *f, const char *key);
/* Reads tensor `name` into dst (any device and strides; same shape; same dtype unless
   allow_cast), checking its CRC32C when the file records one. */
DSK_API dsk_status dsk_safetensors_read(dsk_safetensors_file *f, dsk_ctx *ctx, const char *name, dsk_tensor *dst,
                                        int allow_cast);
/* Reads the box [offset[d], offset[d] + dst->shape[d]) of tensor `name` (offset NULL: all 0)
   into dst (same ndim; any device and strides; same dtype unless allow_cast). Only the bytes
   of the box are read, with one pread per contiguous run; in a dsk file, the 1 MiB blocks
   that hold them, each checked against its CRC32C. Boxes of files without checksums (other
   writers) are read unchecked. */
DSK_API dsk_status dsk_safetensors_read_box(dsk_safetensors_file *f, dsk_ctx *ctx, const char *name,
                                            const int64_t *offset, dsk_tensor *dst, int allow_cast);
/* The raw little-endian bytes of the box (offset NULL: all 0; shape) of tensor `name`, whatever
   its dtype (dsk_safetensors_info.dtype -1 included), row-major into buf of cap bytes, checked
   as dsk_safetensors_read_box does. Packed dtypes of fewer than 8 bits (F4, F6_*) only whole. */
DSK_API dsk_status dsk_safetensors_read_raw(dsk_safetensors_file *f, const char *name, const int64_t *offset,
                                            const int64_t *shape, void *buf, size_t cap);
DSK_API void dsk_safetensors_close(dsk_safetensors_file *f); /* zeroed/closed ok */
/* Writes one safetensors file atomically and durably, with "dsk.format", per-tensor
   "dsk.crc32c.<name>" and "dsk.blocks.<name>" and the caller's pairs in __metadata__ (see the
   top of the file). kv may be NULL when n_kv is 0. On failure nothing at path has changed. */
DSK_API dsk_status dsk_safetensors_save(dsk_ctx *ctx, const char *path, const dsk_safetensors_entry *entries, int n,
                                        const dsk_safetensors_kv *kv, int n_kv);

/* ---------------------------------------------------------------- sharded sets (Hugging Face) */

/* A model in the layout Hugging Face writes: model.safetensors.index.json ("weight_map":
   tensor name -> shard file) with its shards, or a single model.safetensors. Caller-owned;
   fields are private. */
typedef struct dsk_safetensors_hf {
    char *dir;
    int n_shards;
    char **shard_names;           /* file names in dir */
    dsk_safetensors_file *shards; /* opened on first use */
    int n_tensors;
    char **names;  /* sorted */
    int *shard_of; /* shard of names[i] */
} dsk_safetensors_hf;

/* One tensor to read or write. stacked 1: `name` holds "{E}" and tensor (E, ...) holds the
   experts expert0 .. expert0 + E - 1 along dim 0, each one tensor of the file under `name`
   with "{E}" replaced by its number (dsk keeps experts stacked; published MoE checkpoints
   name them one by one). */
typedef struct dsk_safetensors_hf_entry {
    const char *name;
    dsk_tensor *tensor;
    int stacked;
    int expert0;
} dsk_safetensors_hf_entry;

/* Opens dir's index (or its single model.safetensors); shards are opened as they are used. */
DSK_API dsk_status dsk_safetensors_hf_open(dsk_safetensors_hf *h, const char *dir);
/* The open shard and header entry of tensor `name` (for boxes: dsk_safetensors_read_box). */
DSK_API dsk_status dsk_safetensors_hf_find(dsk_safetensors_hf *h, const char *name, dsk_safetensors_file **file,
                                           const dsk_safetensors_info **info);
/* Reads every entry (same shape; same dtype unless allow_cast), checking CRC32Cs where the
   files have them. */
DSK_API dsk_status dsk_safetensors_hf_read(dsk_safetensors_hf *h, dsk_ctx *ctx, const dsk_safetensors_hf_entry *entries,
                                           int n, int allow_cast);
DSK_API void dsk_safetensors_hf_close(dsk_safetensors_hf *h); /* zeroed/closed ok */
/* Writes the entries into dir (which must exist) as shards "model-00001-of-0000N.safetensors"
   of at most max_shard_bytes of data each (0: 5 GB; a larger tensor gets a shard of its own),
   in entry order, each written atomically, then model.safetensors.index.json ({"metadata":
   {"total_size": bytes}, "weight_map": {...}}) last, atomically: the index is the commit point.
   Shards of an earlier export that the new index does not name, and a model.safetensors, are
   then removed. kv goes into every shard's __metadata__. */
DSK_API dsk_status dsk_safetensors_hf_save(dsk_ctx *ctx, const char *dir, const dsk_safetensors_hf_entry *entries,
                                           int n, const dsk_safetensors_kv *kv, int n_kv, uint64_t max_shard_bytes);

/* ---------------------------------------------------------------- CRC32C, options */

/* CRC32C (Castagnoli, as iSCSI and ext4), chainable: crc = dsk_safetensors_crc32c(0, p, n)
   then dsk_safetensors_crc32c(crc, q, m) = CRC of p||q. SSE4.2 when the CPU has it (and
   DSK_SAFETENSORS_NO_SSE42 is not defined), else slicing-by-8. */
DSK_API uint32_t dsk_safetensors_crc32c(uint32_t crc, const void *data, size_t n);
/* CRC of A||B from crc(A), crc(B) and len(B). */
DSK_API uint32_t dsk_safetensors_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);
/* The compile-out switches the implementation was built with, space-separated, "" for none:
   "DSK_SAFETENSORS_NO_SSE42". */
DSK_API const char *dsk_safetensors_options(void);

#ifdef __cplusplus
}
#endif
#endif /* DSK_SAFETENSORS_H */

/* ==================================================================== implementation */
#ifdef DSK_SAFETENSORS_IMPLEMENTATION
#ifndef DSK_SAFETENSORS_IMPLEMENTATION_DONE
#define DSK_SAFETENSORS_IMPLEMENTATION_DONE
/* glibc hid POSIX 2008 when a system header came before the dsk headers in this file. */
#if defined(__GLIBC__) && !defined(__USE_XOPEN2K8) /* glibc's mark of POSIX 2008 */
#error "dsk_safetensors.h needs POSIX 2008: put the DSK_*_IMPLEMENTATION defines and dsk includes before any \
system header, or compile with -D_GNU_SOURCE"
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
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#error "dsk_safetensors.h: safetensors is little-endian; big-endian hosts are not supported"
#endif

/* sync_file_range (start writeback without waiting) where present: glibc declares it only
   under _GNU_SOURCE, and dsk_tensor.h asks for POSIX 2008; its kernel interface is fixed, so on
   64-bit Linux it is named here when hidden. */
#if defined(SYNC_FILE_RANGE_WRITE)
#define DSK__ST_SYNC_RANGE(fd, off, n) sync_file_range((fd), (off_t)(off), (off_t)(n), SYNC_FILE_RANGE_WRITE)
#elif defined(__linux__) && defined(__LP64__)
#ifdef __cplusplus
extern "C" int sync_file_range(int fd, int64_t offset, int64_t nbytes, unsigned int flags);
#else
int sync_file_range(int fd, int64_t offset, int64_t nbytes, unsigned int flags); /* glibc's and musl's */
#endif
#define DSK__ST_SYNC_RANGE(fd, off, n) sync_file_range((fd), (int64_t)(off), (int64_t)(n), 2u /* _WRITE */)
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(DSK_SAFETENSORS_NO_SSE42)
#define DSK__ST_CRC_HW 1
#include <nmmintrin.h>
#endif

/* ---------------------------------------------------------------- CRC32C
   Reflected polynomial 0x82F63B78. "Raw" functions update the register without the initial
   and final inversion; the register is linear, so raw(s, A||B) = shift(raw(s, A), |B|) ^
   raw(0, B), where shift multiplies by x^(8|B|) modulo the polynomial. */

#define DSK__ST_POLY 0x82F63B78u
#define DSK__ST_BLOCK ((uint64_t)1 << 20) /* bytes per block CRC in the files dsk writes */

static uint32_t dsk__st_crc_table[8][256];
static pthread_once_t dsk__st_crc_once = PTHREAD_ONCE_INIT;

static void dsk__st_crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1u) ? (c >> 1) ^ DSK__ST_POLY : c >> 1;
        dsk__st_crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) {
            uint32_t prev = dsk__st_crc_table[t - 1][i];
            dsk__st_crc_table[t][i] = (prev >> 8) ^ dsk__st_crc_table[0][prev & 0xffu];
        }
}

/* Slicing-by-8: eight table lookups per 8 bytes. */
static uint32_t dsk__st_crc_sw(uint32_t s, const unsigned char *p, size_t n) {
    pthread_once(&dsk__st_crc_once, dsk__st_crc_init);
    while (n && ((uintptr_t)p & 7u)) {
        s = (s >> 8) ^ dsk__st_crc_table[0][(s ^ *p++) & 0xffu];
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        uint32_t lo = (uint32_t)w ^ s, hi = (uint32_t)(w >> 32);
        s = dsk__st_crc_table[7][lo & 0xffu] ^ dsk__st_crc_table[6][(lo >> 8) & 0xffu] ^
            dsk__st_crc_table[5][(lo >> 16) & 0xffu] ^ dsk__st_crc_table[4][lo >> 24] ^
            dsk__st_crc_table[3][hi & 0xffu] ^ dsk__st_crc_table[2][(hi >> 8) & 0xffu] ^
            dsk__st_crc_table[1][(hi >> 16) & 0xffu] ^ dsk__st_crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) s = (s >> 8) ^ dsk__st_crc_table[0][(s ^ *p++) & 0xffu];
    return s;
}

/* a * b modulo the polynomial, both in reflected order (bit 31 = x^0). */
static uint32_t dsk__st_mulmod(uint32_t a, uint32_t b) {
    uint32_t prod = 0;
    for (uint32_t m = 1u << 31; m; m >>= 1) {
        if (a & m) prod ^= b;
        b = (b & 1u) ? (b >> 1) ^ DSK__ST_POLY : b >> 1;
    }
    return prod;
}

/* x^(8n) modulo the polynomial: the operator that appends n zero bytes. */
static uint32_t dsk__st_xpow8n(uint64_t n) {
    uint32_t result = 1u << 31, sq = 1u << 23; /* x^0 and x^8 */
    while (n) {
        if (n & 1u) result = dsk__st_mulmod(result, sq);
        sq = dsk__st_mulmod(sq, sq);
        n >>= 1;
    }
    return result;
}

#ifdef DSK__ST_CRC_HW
#define DSK__ST_HW_BLOCK 16384u
__attribute__((target("sse4.2"))) static uint32_t dsk__st_crc_hw_run(uint32_t s, const unsigned char *p, size_t n) {
    uint64_t c = s;
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
    }
    s = (uint32_t)c;
    for (; n; n--) s = _mm_crc32_u8(s, *p++);
    return s;
}
/* Three independent CRC chains over adjacent blocks hide the instruction's latency; the
   partial CRCs are then shifted into place. */
__attribute__((target("sse4.2"))) static uint32_t dsk__st_crc_hw(uint32_t s, const unsigned char *p, size_t n) {
    const size_t B = DSK__ST_HW_BLOCK;
    if (n >= 3 * B) {
        uint32_t k1 = dsk__st_xpow8n(B), k2 = dsk__st_xpow8n(2 * B);
        while (n >= 3 * B) {
            uint64_t c0 = s, c1 = 0, c2 = 0;
            for (size_t i = 0; i < B; i += 8) {
                uint64_t w0, w1, w2;
                memcpy(&w0, p + i, 8);
                memcpy(&w1, p + B + i, 8);
                memcpy(&w2, p + 2 * B + i, 8);
                c0 = _mm_crc32_u64(c0, w0);
                c1 = _mm_crc32_u64(c1, w1);
                c2 = _mm_crc32_u64(c2, w2);
            }
            s = dsk__st_mulmod(k2, (uint32_t)c0) ^ dsk__st_mulmod(k1, (uint32_t)c1) ^ (uint32_t)c2;
            p += 3 * B;
            n -= 3 * B;
        }
    }
    return dsk__st_crc_hw_run(s, p, n);
}
static int dsk__st_have_sse42(void) { return __builtin_cpu_supports("sse4.2"); }
#endif

static uint32_t dsk__st_crc_raw(uint32_t s, const unsigned char *p, size_t n) {
#ifdef DSK__ST_CRC_HW
    if (dsk__st_have_sse42()) return dsk__st_crc_hw(s, p, n);
#endif
    return dsk__st_crc_sw(s, p, n);
}

DSK_API uint32_t dsk_safetensors_crc32c(uint32_t crc, const void *data, size_t n) {
    if (!n) return crc;
    return ~dsk__st_crc_raw(~crc, (const unsigned char *)data, n);
}

DSK_API uint32_t dsk_safetensors_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
    return dsk__st_mulmod(dsk__st_xpow8n(len_b), crc_a) ^ crc_b;
}

/* ---------------------------------------------------------------- small helpers */

/* Growable byte buffer; an allocation failure latches `oom` and later appends do nothing. */
typedef struct dsk__st_buf {
    char *p;
    size_t n, cap;
    int oom;
} dsk__st_buf;

static void dsk__st_put(dsk__st_buf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *q = (char *)DSK_MALLOC(cap);
        if (!q) {
            b->oom = 1;
            return;
        }
        if (b->n) memcpy(q, b->p, b->n);
        DSK_FREE(b->p);
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}
static void dsk__st_puts(dsk__st_buf *b, const char *s) { dsk__st_put(b, s, strlen(s)); }
static void dsk__st_putf(dsk__st_buf *b, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static void dsk__st_putf(dsk__st_buf *b, const char *fmt, ...) {
    char tmp[128];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (k < 0 || (size_t)k >= sizeof tmp) {
        b->oom = 1;
        return;
    }
    dsk__st_put(b, tmp, (size_t)k);
}
/* A JSON string literal: quotes, backslash and control characters escaped. */
static void dsk__st_put_jstr(dsk__st_buf *b, const char *s) {
    dsk__st_put(b, "\"", 1);
    while (*s) {
        size_t run = 0;
        unsigned char c;
        while (s[run] && (unsigned char)s[run] >= 0x20 && s[run] != '"' && s[run] != '\\') run++;
        dsk__st_put(b, s, run);
        s += run;
        if (!(c = (unsigned char)*s)) break;
        if (c == '"' || c == '\\') {
            char e[2] = {'\\', (char)c};
            dsk__st_put(b, e, 2);
        } else dsk__st_putf(b, "\\u%04x", c);
        s++;
    }
    dsk__st_put(b, "\"", 1);
}
static void dsk__st_buf_free(dsk__st_buf *b) {
    DSK_FREE(b->p);
    memset(b, 0, sizeof *b);
}

static char *dsk__st_strdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *p = (char *)DSK_MALLOC(n);
    if (p) memcpy(p, s, n);
    return p;
}

/* "[8,256,128] bf16" for a shape and a dtype name. */
static const char *dsk__st_desc(char *buf, size_t n, int ndim, const int64_t *shape, const char *dtype) {
    size_t k = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < ndim && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, i ? ",%lld" : "%lld", (long long)shape[i]);
    if (k < n) snprintf(buf + k, n - k, "] %s", dtype);
    return buf;
}

/* Row-major element count with overflow check; -1 on overflow. */
static int64_t dsk__st_numel(int ndim, const int64_t *shape) {
    uint64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return -1;
        if (shape[i] && n > (uint64_t)INT64_MAX / (uint64_t)shape[i]) return -1;
        n *= (uint64_t)shape[i];
    }
    return (int64_t)n;
}

static int dsk__st_valid_utf8(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned char c = s[i];
        size_t len;
        uint32_t cp, min;
        if (c < 0x80) {
            i++;
            continue;
        }
        if ((c & 0xe0u) == 0xc0u) {
            len = 2;
            cp = c & 0x1fu;
            min = 0x80;
        } else if ((c & 0xf0u) == 0xe0u) {
            len = 3;
            cp = c & 0x0fu;
            min = 0x800;
        } else if ((c & 0xf8u) == 0xf0u) {
            len = 4;
            cp = c & 0x07u;
            min = 0x10000;
        } else return 0;
        if (n - i < len) return 0;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xc0u) != 0x80u) return 0;
            cp = (cp << 6) | (s[i + k] & 0x3fu);
        }
        if (cp < min || cp > 0x10ffffu || (cp >= 0xd800u && cp <= 0xdfffu)) return 0;
        i += len;
    }
    return 1;
}

/* ---------------------------------------------------------------- POSIX I/O */

static dsk_status dsk__st_io_error(const char *fn, const char *what, const char *path) {
    int e = errno;
    return dsk_set_error(DSK_ERR_IO, "%s: %s \"%s\": %s (errno %d)", fn, what, path, strerror(e), e);
}

static dsk_status dsk__st_write_all(const char *fn, int fd, const void *p, size_t n, const char *path) {
    const char *q = (const char *)p;
    while (n) {
        ssize_t k = write(fd, q, n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            if (k == 0) errno = EIO;
            return dsk__st_io_error(fn, "write to", path);
        }
        q += k;
        n -= (size_t)k;
    }
    return DSK_OK;
}

static dsk_status dsk__st_pread_all(const char *fn, int fd, void *p, size_t n, uint64_t off, const char *path) {
    char *q = (char *)p;
    while (n) {
        ssize_t k = pread(fd, q, n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n, (off_t)off);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return dsk__st_io_error(fn, "read from", path);
        if (k == 0)
            return dsk_set_error(DSK_ERR_CORRUPT,
                                 "%s: \"%s\" ends early: %zu bytes missing at offset %llu (file truncated?)", fn, path,
                                 n, (unsigned long long)off);
        q += k;
        n -= (size_t)k;
        off += (uint64_t)k;
    }
    return DSK_OK;
}

static dsk_status dsk__st_fsync_dir(const char *fn, const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return dsk__st_io_error(fn, "open directory", dir);
    while (fsync(fd) != 0) {
        if (errno == EINTR) continue;
        dsk_status s = dsk__st_io_error(fn, "fsync directory", dir);
        close(fd);
        return s;
    }
    close(fd);
    return DSK_OK;
}

/* dir + "/" + name, or NULL when out of memory. */
static char *dsk__st_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = (char *)DSK_MALLOC(a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    p[a] = '/';
    memcpy(p + a + 1, name, b + 1);
    return p;
}

/* Splits path into its directory ("." when none) and base name, both allocated. */
static dsk_status dsk__st_split_path(const char *fn, const char *path, char **dir, char **base) {
    const char *slash = strrchr(path, '/');
    *dir = *base = NULL;
    if (!*path || (slash && !slash[1])) return dsk_set_error(DSK_ERR_ARG, "%s: path \"%s\" names no file", fn, path);
    if (!slash) {
        *dir = dsk__st_strdup(".");
        *base = dsk__st_strdup(path);
    } else {
        size_t k = slash == path ? 1 : (size_t)(slash - path);
        *dir = (char *)DSK_MALLOC(k + 1);
        if (*dir) {
            memcpy(*dir, path, k);
            (*dir)[k] = 0;
        }
        *base = dsk__st_strdup(slash + 1);
    }
    if (!*dir || !*base) {
        DSK_FREE(*dir);
        DSK_FREE(*base);
        *dir = *base = NULL;
        return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    }
    return DSK_OK;
}

/* Opens "<dir>/.<base>.tmp" for writing, truncating what a killed writer left. */
static dsk_status dsk__st_open_tmp(const char *fn, const char *dir, const char *base, char **tmp_path, int *fd) {
    size_t a = strlen(dir), b = strlen(base);
    char *p = (char *)DSK_MALLOC(a + b + 8);
    *tmp_path = NULL;
    if (!p) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    snprintf(p, a + b + 8, "%s/.%s.tmp", dir, base);
    *fd = open(p, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (*fd < 0) {
        dsk_status s = dsk__st_io_error(fn, "create", p);
        DSK_FREE(p);
        return s;
    }
    *tmp_path = p;
    return DSK_OK;
}

#define DSK__ST_FSYNC_FILE 1 /* fsync the file before the rename */
#define DSK__ST_FSYNC_DIR 2  /* fsync the directory after it */
#define DSK__ST_DURABLE (DSK__ST_FSYNC_FILE | DSK__ST_FSYNC_DIR)
#define DSK__ST_WITHDRAW 4 /* remove the renamed file again when the directory's fsync fails */

/* Closes the temporary, renames it to dir/base, with the fsyncs `how` asks for. On failure the
   temporary is removed. The fd is closed in every case. */
static dsk_status dsk__st_commit_tmp(const char *fn, int fd, char *tmp_path, const char *dir, const char *base,
                                     int how) {
    dsk_status s = DSK_OK;
    char *final_path = dsk__st_join(dir, base);
    if (!final_path) s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    while (s == DSK_OK && (how & DSK__ST_FSYNC_FILE) && fsync(fd) != 0)
        if (errno != EINTR) s = dsk__st_io_error(fn, "fsync", tmp_path);
    if (close(fd) != 0 && s == DSK_OK && errno != EINTR) s = dsk__st_io_error(fn, "close", tmp_path);
    if (s == DSK_OK && rename(tmp_path, final_path) != 0) s = dsk__st_io_error(fn, "rename into place", final_path);
    if (s != DSK_OK) unlink(tmp_path);
    else if ((how & DSK__ST_FSYNC_DIR) && (s = dsk__st_fsync_dir(fn, dir)) != DSK_OK && (how & DSK__ST_WITHDRAW))
        unlink(final_path);
    DSK_FREE(final_path);
    DSK_FREE(tmp_path);
    return s;
}

/* Writes bytes to dir/base atomically (and durably with DSK__ST_DURABLE). */
static dsk_status dsk__st_write_small(const char *fn, const char *dir, const char *base, const void *p, size_t n,
                                      int how) {
    char *tmp = NULL;
    int fd = -1;
    dsk_status s;
    DSK__TRY(dsk__st_open_tmp(fn, dir, base, &tmp, &fd));
    s = dsk__st_write_all(fn, fd, p, n, tmp);
    if (s != DSK_OK) {
        close(fd);
        unlink(tmp);
        DSK_FREE(tmp);
        return s;
    }
    return dsk__st_commit_tmp(fn, fd, tmp, dir, base, how);
}

/* Opens path for reading only if it is a regular file. O_NONBLOCK keeps open() from blocking
   on a FIFO or a device before fstat can tell (it has no effect on regular files). */
static dsk_status dsk__st_open_regular(const char *fn, const char *path, int *fd, struct stat *st) {
    dsk_status s;
    *fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (*fd < 0) return dsk__st_io_error(fn, "open", path);
    if (fstat(*fd, st) != 0) s = dsk__st_io_error(fn, "stat", path);
    else if (!S_ISREG(st->st_mode)) s = dsk_set_error(DSK_ERR_CORRUPT, "%s: \"%s\" is not a regular file", fn, path);
    else if (fcntl(*fd, F_SETFL, fcntl(*fd, F_GETFL) & ~O_NONBLOCK) != 0) s = dsk__st_io_error(fn, "fcntl", path);
    else return DSK_OK;
    close(*fd);
    *fd = -1;
    return s;
}

/* Reads a whole small regular file (at most max bytes) into a NUL-terminated buffer. */
static dsk_status dsk__st_read_small(const char *fn, const char *path, size_t max, char **out, size_t *len) {
    struct stat st;
    dsk_status s;
    int fd;
    *out = NULL;
    DSK__TRY(dsk__st_open_regular(fn, path, &fd, &st));
    if ((uint64_t)st.st_size > max) {
        close(fd);
        return dsk_set_error(DSK_ERR_CORRUPT, "%s: \"%s\" has %lld bytes, more than the limit of %zu", fn, path,
                             (long long)st.st_size, max);
    }
    *out = (char *)DSK_MALLOC((size_t)st.st_size + 1);
    if (!*out) {
        close(fd);
        return dsk_set_error(DSK_ERR_OOM, "%s: out of memory for \"%s\"", fn, path);
    }
    s = dsk__st_pread_all(fn, fd, *out, (size_t)st.st_size, 0, path);
    close(fd);
    if (s != DSK_OK) {
        DSK_FREE(*out);
        *out = NULL;
        return s;
    }
    (*out)[st.st_size] = 0;
    *len = (size_t)st.st_size;
    return DSK_OK;
}

static int dsk__st_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

/* Removes path when it is a regular file; counts what it removed. */
static dsk_status dsk__st_remove(const char *fn, const char *path, int *removed) {
    struct stat st;
    if (lstat(path, &st) != 0 || !S_ISREG(st.st_mode)) return DSK_OK; /* gone, or not one of ours */
    if (unlink(path) == 0) {
        (*removed)++;
        return DSK_OK;
    }
    return errno == ENOENT ? DSK_OK : dsk__st_io_error(fn, "remove", path);
}

/* ---------------------------------------------------------------- strict JSON (RFC 8259)
   Parses untrusted text into a flat array of values in document order: every read is
   bounds-checked, nesting is limited, strings are decoded (escapes, surrogate pairs) into one
   pool, numbers keep their place in the text and are converted on access. A first pass counts
   an upper bound of the values and string bytes, so memory is allocated once: at most 12 bytes
   per value plus the string bytes, about 6x the text for the densest input ([0,0,0,...]). */

enum { DSK__ST_J_NULL, DSK__ST_J_BOOL, DSK__ST_J_NUM, DSK__ST_J_STR, DSK__ST_J_ARR, DSK__ST_J_OBJ };
#define DSK__ST_J_MAX_DEPTH 32
#define DSK__ST_J_NONE 0xffffffffu
#define DSK__ST_J_OFF_MASK 0x07ffffffu /* pool offsets: texts are at most DSK_SAFETENSORS_MAX_HEADER bytes */
#define DSK__ST_J_TYPE_SHIFT 27
#define DSK__ST_J_KEY_NUL (1u << 30) /* the member key holds a NUL character */
#define DSK__ST_J_STR_NUL (1u << 31) /* the string value holds a NUL character */

/* One value. A container's first member is the value right after it. */
typedef struct dsk__st_jnode {
    uint32_t next; /* next member of the same container, or DSK__ST_J_NONE */
    uint32_t key;  /* pool offset of the member key (0: ""), the type, and the two NUL flags */
    uint32_t val;  /* string: pool offset; number: text offset; bool: 0 or 1; container: member count */
} dsk__st_jnode;

typedef struct dsk__st_json {
    dsk__st_jnode *nodes;
    uint32_t n, cap;
    char *pool; /* decoded strings, each NUL-terminated; pool[0] = "" */
    size_t pool_used, pool_cap;
    const char *src, *end, *p;
    const char *fn, *what; /* error context: function and object */
    dsk_status status;
} dsk__st_json;

static void dsk__st_json_free(dsk__st_json *j) {
    DSK_FREE(j->nodes);
    DSK_FREE(j->pool);
    memset(j, 0, sizeof *j);
}

static int dsk__st_jtype(const dsk__st_json *j, int i) { return (int)((j->nodes[i].key >> DSK__ST_J_TYPE_SHIFT) & 7u); }
static int dsk__st_jcount(const dsk__st_json *j, int i) {
    int t = dsk__st_jtype(j, i);
    return t == DSK__ST_J_ARR || t == DSK__ST_J_OBJ ? (int)j->nodes[i].val : 0;
}
static int dsk__st_jchild(const dsk__st_json *j, int i) { return dsk__st_jcount(j, i) ? i + 1 : -1; }
static int dsk__st_jnext(const dsk__st_json *j, int i) {
    return j->nodes[i].next == DSK__ST_J_NONE ? -1 : (int)j->nodes[i].next;
}
/* The member key of value i; keys with a NUL are cut at it (see dsk__st_jkey_nul). */
static const char *dsk__st_jkey(const dsk__st_json *j, int i) {
    return j->pool + (j->nodes[i].key & DSK__ST_J_OFF_MASK);
}
static int dsk__st_jkey_nul(const dsk__st_json *j, int i) { return (j->nodes[i].key & DSK__ST_J_KEY_NUL) != 0; }
/* A string value without embedded NUL, or NULL. */
static const char *dsk__st_jstr(const dsk__st_json *j, int i) {
    if (i < 0 || dsk__st_jtype(j, i) != DSK__ST_J_STR || (j->nodes[i].key & DSK__ST_J_STR_NUL)) return NULL;
    return j->pool + j->nodes[i].val;
}

static int dsk__st_jfail(dsk__st_json *j, const char *msg) {
    if (j->status == DSK_OK)
        j->status = dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: invalid JSON: %s at byte %lld", j->fn, j->what, msg,
                                  (long long)(j->p - j->src));
    return -1;
}

static void dsk__st_jws(dsk__st_json *j) {
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')) j->p++;
}

/* First pass: an upper bound of the values (each one but the first follows a '[', ',' or
   ':' outside strings) and of the pool bytes (every byte inside quotes, plus a NUL each). */
static void dsk__st_jcount_text(const char *p, const char *end, uint64_t *values, uint64_t *pool) {
    int in_str = 0, esc = 0;
    *values = 1;
    *pool = 1;
    for (; p < end; p++) {
        char c = *p;
        if (in_str) {
            if (esc) esc = 0;
            else if (c == '\\') esc = 1;
            else if (c == '"') {
                in_str = 0;
                (*pool)++;
                continue;
            }
            (*pool)++;
        } else if (c == '"') in_str = 1;
        else if (c == '[' || c == ',' || c == ':') (*values)++;
    }
}

static int dsk__st_jnew(dsk__st_json *j, int type) {
    dsk__st_jnode *x;
    if (j->n == j->cap) return dsk__st_jfail(j, "more values than the text can hold"); /* the count is an upper bound */
    x = &j->nodes[j->n];
    x->next = DSK__ST_J_NONE;
    x->key = (uint32_t)type << DSK__ST_J_TYPE_SHIFT;
    x->val = 0;
    return (int)j->n++;
}

static int dsk__st_jhex4(dsk__st_json *j, uint32_t *out) {
    uint32_t v = 0;
    if (j->end - j->p < 4) return dsk__st_jfail(j, "short \\u escape");
    for (int i = 0; i < 4; i++) {
        char c = *j->p++;
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (uint32_t)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (uint32_t)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (uint32_t)(c - 'A' + 10);
        else return dsk__st_jfail(j, "bad hex digit in \\u escape");
    }
    *out = v;
    return 0;
}

/* Appends code point cp as UTF-8. */
static char *dsk__st_jutf8(char *dst, uint32_t cp) {
    if (cp < 0x80u) *dst++ = (char)cp;
    else if (cp < 0x800u) {
        *dst++ = (char)(0xc0u | (cp >> 6));
        *dst++ = (char)(0x80u | (cp & 0x3fu));
    } else if (cp < 0x10000u) {
        *dst++ = (char)(0xe0u | (cp >> 12));
        *dst++ = (char)(0x80u | ((cp >> 6) & 0x3fu));
        *dst++ = (char)(0x80u | (cp & 0x3fu));
    } else {
        *dst++ = (char)(0xf0u | (cp >> 18));
        *dst++ = (char)(0x80u | ((cp >> 12) & 0x3fu));
        *dst++ = (char)(0x80u | ((cp >> 6) & 0x3fu));
        *dst++ = (char)(0x80u | (cp & 0x3fu));
    }
    return dst;
}

/* Decodes the string at j->p (on its opening quote) into the pool: its pool offset, and
   whether it holds a NUL. An escape never decodes to more bytes than its text, so the pool
   bound of the first pass holds. */
static int dsk__st_jstring(dsk__st_json *j, uint32_t *off, int *has_nul) {
    char *dst = j->pool + j->pool_used, *start = dst;
    *has_nul = 0;
    j->p++; /* opening quote */
    for (;;) {
        unsigned char c;
        uint32_t cp, lo;
        if (j->p >= j->end) return dsk__st_jfail(j, "unterminated string");
        c = (unsigned char)*j->p++;
        if (c == '"') break;
        if (c < 0x20) return dsk__st_jfail(j, "control character in string");
        if (c != '\\') {
            *dst++ = (char)c;
            continue;
        }
        if (j->p >= j->end) return dsk__st_jfail(j, "unterminated escape");
        c = (unsigned char)*j->p++;
        switch (c) {
        case '"': *dst++ = '"'; break;
        case '\\': *dst++ = '\\'; break;
        case '/': *dst++ = '/'; break;
        case 'b': *dst++ = '\b'; break;
        case 'f': *dst++ = '\f'; break;
        case 'n': *dst++ = '\n'; break;
        case 'r': *dst++ = '\r'; break;
        case 't': *dst++ = '\t'; break;
        case 'u':
            if (dsk__st_jhex4(j, &cp)) return -1;
            if (cp >= 0xdc00u && cp <= 0xdfffu) return dsk__st_jfail(j, "lone low surrogate");
            if (cp >= 0xd800u && cp <= 0xdbffu) {
                if (j->end - j->p < 2 || j->p[0] != '\\' || j->p[1] != 'u')
                    return dsk__st_jfail(j, "lone high surrogate");
                j->p += 2;
                if (dsk__st_jhex4(j, &lo)) return -1;
                if (lo < 0xdc00u || lo > 0xdfffu) return dsk__st_jfail(j, "bad low surrogate");
                cp = 0x10000u + ((cp - 0xd800u) << 10) + (lo - 0xdc00u);
            }
            if (cp == 0) *has_nul = 1;
            dst = dsk__st_jutf8(dst, cp);
            break;
        default: return dsk__st_jfail(j, "unknown escape");
        }
    }
    *dst = 0;
    *off = (uint32_t)(start - j->pool);
    j->pool_used += (size_t)(dst - start) + 1;
    return 0;
}

static int dsk__st_jnumber(dsk__st_json *j, int node) {
    const char *s = j->p;
    if (j->p < j->end && *j->p == '-') j->p++;
    if (j->p >= j->end || *j->p < '0' || *j->p > '9') return dsk__st_jfail(j, "bad number");
    if (*j->p == '0') j->p++;
    else
        while (j->p < j->end && *j->p >= '0' && *j->p <= '9') j->p++;
    if (j->p < j->end && *j->p == '.') {
        j->p++;
        if (j->p >= j->end || *j->p < '0' || *j->p > '9') return dsk__st_jfail(j, "bad fraction");
        while (j->p < j->end && *j->p >= '0' && *j->p <= '9') j->p++;
    }
    if (j->p < j->end && (*j->p == 'e' || *j->p == 'E')) {
        j->p++;
        if (j->p < j->end && (*j->p == '+' || *j->p == '-')) j->p++;
        if (j->p >= j->end || *j->p < '0' || *j->p > '9') return dsk__st_jfail(j, "bad exponent");
        while (j->p < j->end && *j->p >= '0' && *j->p <= '9') j->p++;
    }
    j->nodes[node].val = (uint32_t)(s - j->src);
    return 0;
}

static int dsk__st_jliteral(dsk__st_json *j, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(j->end - j->p) < n || memcmp(j->p, word, n) != 0) return dsk__st_jfail(j, "unexpected character");
    j->p += n;
    return 0;
}

static int dsk__st_jvalue(dsk__st_json *j, int depth);

/* Array or object at j->p (on its bracket); members linked in order. */
static int dsk__st_jcontainer(dsk__st_json *j, int depth, int is_obj) {
    int node = dsk__st_jnew(j, is_obj ? DSK__ST_J_OBJ : DSK__ST_J_ARR), last = -1;
    char close = is_obj ? '}' : ']';
    if (node < 0) return -1;
    if (depth >= DSK__ST_J_MAX_DEPTH) return dsk__st_jfail(j, "nesting too deep");
    j->p++;
    dsk__st_jws(j);
    if (j->p < j->end && *j->p == close) {
        j->p++;
        return node;
    }
    for (;;) {
        uint32_t key = 0;
        int key_nul = 0, child;
        if (is_obj) {
            if (j->p >= j->end || *j->p != '"') return dsk__st_jfail(j, "expected a string key");
            if (dsk__st_jstring(j, &key, &key_nul)) return -1;
            dsk__st_jws(j);
            if (j->p >= j->end || *j->p != ':') return dsk__st_jfail(j, "expected ':'");
            j->p++;
        }
        child = dsk__st_jvalue(j, depth + 1);
        if (child < 0) return -1;
        j->nodes[child].key |= key | (key_nul ? DSK__ST_J_KEY_NUL : 0u);
        if (last >= 0) j->nodes[last].next = (uint32_t)child;
        last = child;
        j->nodes[node].val++;
        dsk__st_jws(j);
        if (j->p < j->end && *j->p == ',') {
            j->p++;
            dsk__st_jws(j);
            continue;
        }
        if (j->p < j->end && *j->p == close) {
            j->p++;
            return node;
        }
        return dsk__st_jfail(j, is_obj ? "expected ',' or '}'" : "expected ',' or ']'");
    }
}

static int dsk__st_jvalue(dsk__st_json *j, int depth) {
    int node, nul;
    dsk__st_jws(j);
    if (j->p >= j->end) return dsk__st_jfail(j, "unexpected end");
    switch (*j->p) {
    case '{': return dsk__st_jcontainer(j, depth, 1);
    case '[': return dsk__st_jcontainer(j, depth, 0);
    case '"':
        if ((node = dsk__st_jnew(j, DSK__ST_J_STR)) < 0 || dsk__st_jstring(j, &j->nodes[node].val, &nul)) return -1;
        if (nul) j->nodes[node].key |= DSK__ST_J_STR_NUL;
        return node;
    case 't':
    case 'f':
    case 'n':
        if ((node = dsk__st_jnew(j, *j->p == 'n' ? DSK__ST_J_NULL : DSK__ST_J_BOOL)) < 0) return -1;
        j->nodes[node].val = *j->p == 't';
        return dsk__st_jliteral(j, *j->p == 't' ? "true" : *j->p == 'f' ? "false" : "null") ? -1 : node;
    default:
        if ((node = dsk__st_jnew(j, DSK__ST_J_NUM)) < 0) return -1;
        return dsk__st_jnumber(j, node) ? -1 : node;
    }
}

/* Parses text[0, n) (valid UTF-8 required, n <= DSK_SAFETENSORS_MAX_HEADER) whose top level must be
   an object: node 0. */
static dsk_status dsk__st_json_parse(dsk__st_json *j, const char *text, size_t n, const char *fn, const char *what) {
    uint64_t values, pool;
    memset(j, 0, sizeof *j);
    j->src = j->p = text;
    j->end = text + n;
    j->fn = fn;
    j->what = what;
    if (n > DSK_SAFETENSORS_MAX_HEADER)
        return dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: %zu bytes of JSON exceed the limit of %llu", fn, what, n,
                             (unsigned long long)DSK_SAFETENSORS_MAX_HEADER);
    if (!dsk__st_valid_utf8((const unsigned char *)text, n))
        return dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: header is not valid UTF-8", fn, what);
    dsk__st_jcount_text(text, text + n, &values, &pool);
    j->cap = (uint32_t)values;
    j->pool_cap = (size_t)pool;
    j->nodes = (dsk__st_jnode *)DSK_MALLOC((size_t)values * sizeof *j->nodes);
    j->pool = (char *)DSK_MALLOC((size_t)pool);
    if (!j->nodes || !j->pool) {
        dsk__st_json_free(j);
        return dsk_set_error(DSK_ERR_OOM, "%s: %s: out of memory for %llu JSON values", fn, what,
                             (unsigned long long)values);
    }
    j->pool[0] = 0;
    j->pool_used = 1;
    dsk__st_jws(j);
    if (j->p >= j->end || *j->p != '{') dsk__st_jfail(j, "expected '{'");
    else if (dsk__st_jvalue(j, 0) >= 0) {
        dsk__st_jws(j);
        if (j->p != j->end) dsk__st_jfail(j, "trailing characters");
    }
    if (j->status != DSK_OK) {
        dsk_status s = j->status;
        dsk__st_json_free(j);
        return s;
    }
    return DSK_OK;
}

/* Member `key` of object node obj, or -1. */
static int dsk__st_jget(const dsk__st_json *j, int obj, const char *key) {
    for (int c = dsk__st_jchild(j, obj); c >= 0; c = dsk__st_jnext(j, c))
        if (!dsk__st_jkey_nul(j, c) && strcmp(dsk__st_jkey(j, c), key) == 0) return c;
    return -1;
}

/* A plain integer (optional '-', digits, no fraction or exponent) within int64. */
static int dsk__st_jint(const dsk__st_json *j, int node, int64_t *out) {
    const char *s, *e;
    int neg = 0;
    uint64_t v = 0;
    if (node < 0 || dsk__st_jtype(j, node) != DSK__ST_J_NUM) return 0;
    s = j->src + j->nodes[node].val;
    if (*s == '-') {
        neg = 1;
        s++;
    }
    for (e = s; e < j->end && *e >= '0' && *e <= '9'; e++) {
        if (v > (uint64_t)INT64_MAX / 10) return 0;
        v = v * 10 + (uint64_t)(*e - '0');
        if (v > (uint64_t)INT64_MAX) return 0;
    }
    if (e == s || (e < j->end && (*e == '.' || *e == 'e' || *e == 'E'))) return 0;
    *out = neg ? -(int64_t)v : (int64_t)v;
    return 1;
}

/* Digits only, within int64: the JSON a usize field of the reference accepts ("-0" is the
   float -0.0 to serde_json, so not a size). */
static int dsk__st_jsize(const dsk__st_json *j, int node, int64_t *out) {
    return dsk__st_jint(j, node, out) && j->src[j->nodes[node].val] != '-';
}

/* ---------------------------------------------------------------- safetensors files */

typedef struct dsk__st_stdtype {
    const char *name;
    int bits;
    int dsk; /* dsk_dtype or -1 */
} dsk__st_stdtype;

/* Every dtype of safetensors 0.8, with its width in bits (F4 and F6 are packed). */
static const dsk__st_stdtype dsk__st_stdtypes[] = {
    {"BOOL", 8, -1},      {"F4", 4, -1},          {"F6_E2M3", 6, -1},       {"F6_E3M2", 6, -1},
    {"U8", 8, DSK_U8},    {"I8", 8, -1},          {"F8_E5M2", 8, DSK_E5M2}, {"F8_E4M3", 8, DSK_E4M3},
    {"F8_E8M0", 8, -1},   {"F8_E4M3FNUZ", 8, -1}, {"F8_E5M2FNUZ", 8, -1},   {"I16", 16, -1},
    {"U16", 16, -1},      {"F16", 16, DSK_F16},   {"BF16", 16, DSK_BF16},   {"I32", 32, DSK_I32},
    {"U32", 32, -1},      {"F32", 32, DSK_F32},   {"C64", 64, -1},          {"F64", 64, DSK_F64},
    {"I64", 64, DSK_I64}, {"U64", 64, -1}};
#define DSK__ST_N_STDTYPES ((int)(sizeof dsk__st_stdtypes / sizeof dsk__st_stdtypes[0]))

static const dsk__st_stdtype *dsk__st_stdtype_by_name(const char *name) {
    for (int i = 0; i < DSK__ST_N_STDTYPES; i++)
        if (strcmp(dsk__st_stdtypes[i].name, name) == 0) return &dsk__st_stdtypes[i];
    return NULL;
}
static const char *dsk__st_stname(dsk_dtype dt) {
    for (int i = 0; i < DSK__ST_N_STDTYPES; i++)
        if (dsk__st_stdtypes[i].dsk == (int)dt) return dsk__st_stdtypes[i].name;
    return "?";
}

static int dsk__st_cmp_info_name(const void *a, const void *b) {
    return strcmp(((const dsk_safetensors_info *)a)->name, ((const dsk_safetensors_info *)b)->name);
}
static int dsk__st_cmp_info_off(const void *a, const void *b) {
    const dsk_safetensors_info *x = *(const dsk_safetensors_info *const *)a,
                               *y = *(const dsk_safetensors_info *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

typedef struct dsk__st_kvidx {
    const char *k, *v;
} dsk__st_kvidx;
static int dsk__st_cmp_kvidx(const void *a, const void *b) {
    return strcmp(((const dsk__st_kvidx *)a)->k, ((const dsk__st_kvidx *)b)->k);
}

/* Parses 8 lowercase or uppercase hex digits exactly. */
static int dsk__st_parse_hex32(const char *s, uint32_t *out) {
    uint32_t v = 0;
    if (!s || strlen(s) != 8) return 0;
    for (int i = 0; i < 8; i++) {
        char c = s[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (uint32_t)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (uint32_t)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (uint32_t)(c - 'A' + 10);
        else return 0;
    }
    *out = v;
    return 1;
}

/* Private storage behind dsk_safetensors_file.mem. */
typedef struct dsk__st_filemem {
    dsk__st_json json;
    char *header; /* the first 8 + header_len bytes when read from a file */
} dsk__st_filemem;

DSK_API void dsk_safetensors_close(dsk_safetensors_file *f) {
    if (!f) return;
    if (f->has_fd) close(f->fd);
    if (f->mem) {
        dsk__st_filemem *m = (dsk__st_filemem *)f->mem;
        dsk__st_json_free(&m->json);
        DSK_FREE(m->header);
        DSK_FREE(m);
    }
    DSK_FREE(f->tensors);
    DSK_FREE((void *)f->meta_keys);
    DSK_FREE((void *)f->meta_values);
    DSK_FREE(f->path);
    memset(f, 0, sizeof *f);
}

/* One tensor entry {"dtype": .., "shape": [..], "data_offsets": [b, e]}. */
static dsk_status dsk__st_parse_entry(const char *fn, const char *where, const dsk__st_json *j, int node,
                                      dsk_safetensors_info *t) {
    int seen[3] = {0, 0, 0};
    const dsk__st_stdtype *dt = NULL;
    if (dsk__st_jtype(j, node) != DSK__ST_J_OBJ)
        return dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: tensor \"%s\" is not an object", fn, where, t->name);
    for (int c = dsk__st_jchild(j, node); c >= 0; c = dsk__st_jnext(j, c)) {
        const char *key = dsk__st_jkey(j, c);
        int type = dsk__st_jtype(j, c), count = dsk__st_jcount(j, c);
        int which = strcmp(key, "dtype") == 0          ? 0
                    : strcmp(key, "shape") == 0        ? 1
                    : strcmp(key, "data_offsets") == 0 ? 2
                                                       : -1;
        if (which < 0 || dsk__st_jkey_nul(j, c))
            return dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: tensor \"%s\" has unknown field \"%s\"", fn, where, t->name,
                                 key);
        if (seen[which]++)
            return dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: tensor \"%s\" repeats field \"%s\"", fn, where, t->name,
                                 key);
        if (which == 0) {
            const char *name = dsk__st_jstr(j, c);
            if (!name)
                return dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: tensor \"%s\": dtype is not a string", fn, where,
                                     t->name);
            if (!(dt = dsk__st_stdtype_by_name(name)))
                return dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: tensor \"%s\": unknown dtype \"%s\"", fn, where, t->name,
                                     name);
        } else if (which == 1) {
            if (type != DSK__ST_J_ARR)
                return dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: tensor \"%s\": shape is not an array", fn, where,
                                     t->name);
            if (count > DSK_MAX_DIMS)
                return dsk_set_error(DSK_ERR_UNSUPPORTED, "%s: %s: tensor \"%s\" has %d dims, dsk supports %d", fn,
                                     where, t->name, count, DSK_MAX_DIMS);
            t->ndim = 0;
            for (int d = dsk__st_jchild(j, c); d >= 0; d = dsk__st_jnext(j, d)) {
                int64_t v;
                if (!dsk__st_jsize(j, d, &v))
                    return dsk_set_error(DSK_ERR_CORRUPT,
                                         "%s: %s: tensor \"%s\": shape[%d] is not a non-negative integer", fn, where,
                                         t->name, t->ndim);
                t->shape[t->ndim++] = v;
            }
        } else {
            int64_t v[2];
            int d = dsk__st_jchild(j, c);
            if (type != DSK__ST_J_ARR || count != 2 || !dsk__st_jsize(j, d, &v[0]) ||
                !dsk__st_jsize(j, dsk__st_jnext(j, d), &v[1]))
                return dsk_set_error(DSK_ERR_CORRUPT,
                                     "%s: %s: tensor \"%s\": data_offsets is not two non-negative integers", fn, where,
                                     t->name);
            t->begin = (uint64_t)v[0];
            t->end = (uint64_t)v[1];
        }
    }
    if (!seen[0] || !seen[1] || !seen[2])
        return dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: tensor \"%s\" lacks \"%s\"", fn, where, t->name,
                             !seen[0]   ? "dtype"
                             : !seen[1] ? "shape"
                                        : "data_offsets");
    t->dtype_name = dt->name;
    t->dtype = dt->dsk;
    {
        int64_t numel = dsk__st_numel(t->ndim, t->shape);
        uint64_t bits;
        char b[160];
        if (numel < 0 || (uint64_t)numel > UINT64_MAX / (uint64_t)dt->bits)
            return dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: tensor \"%s\": shape %s overflows", fn, where, t->name,
                                 dsk__st_desc(b, sizeof b, t->ndim, t->shape, dt->name));
        bits = (uint64_t)numel * (uint64_t)dt->bits;
        if (bits % 8)
            return dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: tensor \"%s\": shape %s is not a whole number of bytes", fn,
                                 where, t->name, dsk__st_desc(b, sizeof b, t->ndim, t->shape, dt->name));
        if (t->end < t->begin || t->end - t->begin != bits / 8)
            return dsk_set_error(
                DSK_ERR_CORRUPT,
                "%s: %s: tensor \"%s\": shape %s needs %llu bytes, data_offsets [%llu, %llu] give %lld", fn, where,
                t->name, dsk__st_desc(b, sizeof b, t->ndim, t->shape, dt->name), (unsigned long long)(bits / 8),
                (unsigned long long)t->begin, (unsigned long long)t->end, (long long)(t->end - t->begin));
    }
    return DSK_OK;
}

/* __metadata__: an object of string values. */
static dsk_status dsk__st_parse_meta(const char *fn, const char *where, const dsk__st_json *j, int node,
                                     dsk_safetensors_file *f) {
    int type = dsk__st_jtype(j, node), count = dsk__st_jcount(j, node), i = 0;
    dsk__st_kvidx *kv;
    if (type == DSK__ST_J_NULL) return DSK_OK; /* the reference reads null as no metadata */
    if (type != DSK__ST_J_OBJ)
        return dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: __metadata__ is not an object", fn, where);
    kv = (dsk__st_kvidx *)DSK_MALLOC(((size_t)count + 1) * sizeof *kv);
    f->meta_keys = (const char **)DSK_MALLOC(((size_t)count + 1) * sizeof(char *));
    f->meta_values = (const char **)DSK_MALLOC(((size_t)count + 1) * sizeof(char *));
    if (!kv || !f->meta_keys || !f->meta_values) {
        DSK_FREE(kv);
        return dsk_set_error(DSK_ERR_OOM, "%s: %s: out of memory", fn, where);
    }
    for (int c = dsk__st_jchild(j, node); c >= 0; c = dsk__st_jnext(j, c), i++) {
        dsk_status s = DSK_OK;
        kv[i].k = dsk__st_jkey(j, c);
        kv[i].v = dsk__st_jstr(j, c);
        if (dsk__st_jtype(j, c) != DSK__ST_J_STR)
            s = dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: __metadata__ value of \"%s\" is not a string", fn, where,
                              kv[i].k);
        else if (!kv[i].v || dsk__st_jkey_nul(j, c))
            s = dsk_set_error(DSK_ERR_UNSUPPORTED,
                              "%s: %s: __metadata__ pair \"%s\" holds a NUL character: valid safetensors, but "
                              "dsk keys and values are C strings",
                              fn, where, kv[i].k);
        if (s != DSK_OK) {
            DSK_FREE(kv);
            return s;
        }
    }
    qsort(kv, (size_t)i, sizeof *kv, dsk__st_cmp_kvidx);
    for (int k = 0; k < i; k++) {
        if (k && strcmp(kv[k].k, kv[k - 1].k) == 0) {
            dsk_status s =
                dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: __metadata__ repeats key \"%s\"", fn, where, kv[k].k);
            DSK_FREE(kv);
            return s;
        }
        f->meta_keys[k] = kv[k].k;
        f->meta_values[k] = kv[k].v;
    }
    f->n_meta = i;
    DSK_FREE(kv);
    return DSK_OK;
}

/* Offsets sorted must tile [0, data_len) exactly, and data_len must end the file. */
static dsk_status dsk__st_check_layout(const char *fn, const char *where, dsk_safetensors_file *f) {
    dsk_safetensors_info **order = (dsk_safetensors_info **)DSK_MALLOC(((size_t)f->n_tensors + 1) * sizeof *order);
    uint64_t pos = 0;
    dsk_status s = DSK_OK;
    if (!order) return dsk_set_error(DSK_ERR_OOM, "%s: %s: out of memory", fn, where);
    for (int i = 0; i < f->n_tensors; i++) order[i] = &f->tensors[i];
    qsort(order, (size_t)f->n_tensors, sizeof *order, dsk__st_cmp_info_off);
    for (int i = 0; i < f->n_tensors && s == DSK_OK; i++) {
        if (order[i]->begin != pos)
            s = dsk_set_error(DSK_ERR_CORRUPT,
                              "%s: %s: tensor \"%s\" data_offsets [%llu, %llu] %s the previous tensor ending at %llu",
                              fn, where, order[i]->name, (unsigned long long)order[i]->begin,
                              (unsigned long long)order[i]->end,
                              order[i]->begin > pos ? "leave a gap after" : "overlap", (unsigned long long)pos);
        pos = order[i]->end;
    }
    if (s == DSK_OK && (f->file_size < 8 + f->header_len || pos != f->file_size - 8 - f->header_len))
        s = dsk_set_error(DSK_ERR_CORRUPT,
                          "%s: %s: tensors end at data offset %llu but the file holds %llu data bytes (%s)", fn, where,
                          (unsigned long long)pos, (unsigned long long)(f->file_size - 8 - f->header_len),
                          pos > f->file_size - 8 - f->header_len ? "file truncated" : "trailing bytes");
    DSK_FREE(order);
    return s;
}

/* "dsk.blocks.<name>" = "<block bytes>:<8 hex digits per block>": a power of two from 4 KiB to
   1 GiB, as many CRCs as blocks, and together they must make up the tensor's CRC. */
static dsk_status dsk__st_attach_blocks(const char *fn, const char *where, dsk_safetensors_info *t, const char *v) {
    uint64_t bs = 0, nbytes = t->end - t->begin, nblocks;
    uint32_t acc = 0, crc, k_full;
    const char *hex;
    while (*v >= '0' && *v <= '9' && bs <= ((uint64_t)1 << 30)) bs = bs * 10 + (uint64_t)(*v++ - '0');
    if (*v != ':' || bs < 4096 || bs > ((uint64_t)1 << 30) || (bs & (bs - 1)))
        return dsk_set_error(DSK_ERR_CORRUPT,
                             "%s: %s: tensor \"%s\": dsk.blocks does not start with a block size (4096 .. 2^30)", fn,
                             where, t->name);
    hex = v + 1;
    nblocks = (nbytes + bs - 1) / bs;
    if (strlen(hex) != 8 * nblocks)
        return dsk_set_error(DSK_ERR_CORRUPT,
                             "%s: %s: tensor \"%s\": dsk.blocks holds %zu hex digits, %llu blocks need %llu", fn, where,
                             t->name, strlen(hex), (unsigned long long)nblocks, (unsigned long long)(8 * nblocks));
    k_full = dsk__st_xpow8n(bs);
    for (uint64_t b = 0; b < nblocks; b++) {
        char h[9];
        uint64_t len = b + 1 < nblocks ? bs : nbytes - b * bs;
        memcpy(h, hex + 8 * b, 8);
        h[8] = 0;
        if (!dsk__st_parse_hex32(h, &crc))
            return dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: tensor \"%s\": dsk.blocks has a non-hex digit", fn, where,
                                 t->name);
        acc = dsk__st_mulmod(len == bs ? k_full : dsk__st_xpow8n(len), acc) ^ crc;
    }
    if (acc != t->crc32c)
        return dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: tensor \"%s\": block CRCs make %08x, dsk.crc32c says %08x", fn,
                             where, t->name, acc, t->crc32c);
    t->block_bytes = bs;
    t->block_crcs = hex;
    return DSK_OK;
}

/* Per-tensor CRCs from "dsk.crc32c.<name>" and "dsk.blocks.<name>" when present. */
static dsk_status dsk__st_attach_crcs(const char *fn, const char *where, dsk_safetensors_file *f) {
    for (int i = 0; i < f->n_meta; i++) {
        int t;
        if (strncmp(f->meta_keys[i], "dsk.crc32c.", 11) != 0) continue;
        t = dsk_safetensors_find(f, f->meta_keys[i] + 11);
        if (t < 0)
            return dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: __metadata__ \"%s\" names no tensor", fn, where,
                                 f->meta_keys[i]);
        if (!dsk__st_parse_hex32(f->meta_values[i], &f->tensors[t].crc32c))
            return dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: __metadata__ \"%s\" = \"%s\" is not 8 hex digits", fn, where,
                                 f->meta_keys[i], f->meta_values[i]);
        f->tensors[t].has_crc = 1;
    }
    for (int i = 0; i < f->n_meta; i++) {
        int t;
        if (strncmp(f->meta_keys[i], "dsk.blocks.", 11) != 0) continue;
        t = dsk_safetensors_find(f, f->meta_keys[i] + 11);
        if (t < 0 || !f->tensors[t].has_crc)
            return dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: __metadata__ \"%s\" names no tensor with a dsk.crc32c", fn,
                                 where, f->meta_keys[i]);
        DSK__TRY(dsk__st_attach_blocks(fn, where, &f->tensors[t], f->meta_values[i]));
    }
    for (int i = 0; i < f->n_tensors; i++)
        if (f->tensors[i].has_crc && !f->tensors[i].block_bytes)
            f->tensors[i].block_bytes = f->tensors[i].end - f->tensors[i].begin;
    return DSK_OK;
}

static dsk_status dsk__st_parse(const char *fn, const char *where, dsk_safetensors_file *f, const unsigned char *bytes,
                                size_t n, uint64_t file_size) {
    dsk__st_filemem *m = (dsk__st_filemem *)f->mem;
    dsk__st_json *j = &m->json;
    uint64_t hlen = 0;
    int top, nt = 0, meta = -1;
    if (n < 8 || file_size < 8)
        return dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: %llu bytes is too short for a safetensors file", fn, where,
                             (unsigned long long)(n < file_size ? n : file_size));
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | bytes[i];
    if (hlen > DSK_SAFETENSORS_MAX_HEADER)
        return dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: header length %llu exceeds the limit of %llu", fn, where,
                             (unsigned long long)hlen, (unsigned long long)DSK_SAFETENSORS_MAX_HEADER);
    if (8 + hlen > file_size || 8 + hlen > n)
        return dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: header length %llu runs beyond the file size %llu", fn, where,
                             (unsigned long long)hlen, (unsigned long long)file_size);
    f->header_len = hlen;
    f->file_size = file_size;
    f->header_crc32c = dsk_safetensors_crc32c(0, bytes, (size_t)(8 + hlen));
    DSK__TRY(dsk__st_json_parse(j, (const char *)bytes + 8, (size_t)hlen, fn, where));
    top = 0;
    f->tensors = (dsk_safetensors_info *)DSK_MALLOC(((size_t)dsk__st_jcount(j, top) + 1) * sizeof *f->tensors);
    if (!f->tensors) return dsk_set_error(DSK_ERR_OOM, "%s: %s: out of memory", fn, where);
    for (int c = dsk__st_jchild(j, top); c >= 0; c = dsk__st_jnext(j, c)) {
        dsk_safetensors_info *t = &f->tensors[nt];
        if (dsk__st_jkey_nul(j, c))
            return dsk_set_error(DSK_ERR_UNSUPPORTED,
                                 "%s: %s: tensor \"%s\\u0000...\" has a NUL character in its name: valid "
                                 "safetensors, but dsk names are C strings",
                                 fn, where, dsk__st_jkey(j, c));
        if (strcmp(dsk__st_jkey(j, c), "__metadata__") == 0) {
            if (meta >= 0) return dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: __metadata__ appears twice", fn, where);
            meta = c;
            continue;
        }
        memset(t, 0, sizeof *t);
        t->name = dsk__st_jkey(j, c);
        DSK__TRY(dsk__st_parse_entry(fn, where, j, c, t));
        nt++;
    }
    f->n_tensors = nt;
    qsort(f->tensors, (size_t)nt, sizeof *f->tensors, dsk__st_cmp_info_name);
    for (int i = 1; i < nt; i++)
        if (strcmp(f->tensors[i].name, f->tensors[i - 1].name) == 0)
            return dsk_set_error(DSK_ERR_CORRUPT, "%s: %s: duplicate tensor name \"%s\"", fn, where,
                                 f->tensors[i].name);
    if (meta >= 0) DSK__TRY(dsk__st_parse_meta(fn, where, j, meta, f));
    DSK__TRY(dsk__st_check_layout(fn, where, f));
    return dsk__st_attach_crcs(fn, where, f);
}

static dsk_status dsk__st_file_begin(dsk_safetensors_file *f, const char *fn) {
    memset(f, 0, sizeof *f);
    f->mem = DSK_MALLOC(sizeof(dsk__st_filemem));
    if (!f->mem) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    memset(f->mem, 0, sizeof(dsk__st_filemem));
    return DSK_OK;
}

DSK_API dsk_status dsk_safetensors_parse(dsk_safetensors_file *f, const void *bytes, size_t n, uint64_t file_size) {
    dsk_status s;
    if (!f || (!bytes && n)) return dsk_set_error(DSK_ERR_ARG, "dsk_safetensors_parse: NULL argument");
    DSK__TRY(dsk__st_file_begin(f, "dsk_safetensors_parse"));
    s = dsk__st_parse("dsk_safetensors_parse", "buffer", f, (const unsigned char *)bytes, n, file_size);
    if (s != DSK_OK) dsk_safetensors_close(f);
    return s;
}

DSK_API dsk_status dsk_safetensors_open(dsk_safetensors_file *f, const char *path) {
    const char *fn = "dsk_safetensors_open";
    struct stat st;
    unsigned char len8[8];
    uint64_t hlen = 0;
    dsk__st_filemem *m;
    dsk_status s;
    if (!f || !path) return dsk_set_error(DSK_ERR_ARG, "%s: NULL argument", fn);
    DSK__TRY(dsk__st_file_begin(f, fn));
    m = (dsk__st_filemem *)f->mem;
    if (!(f->path = dsk__st_strdup(path))) {
        s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
        goto fail;
    }
    if ((s = dsk__st_open_regular(fn, path, &f->fd, &st)) != DSK_OK) goto fail;
    f->has_fd = 1;
    if (st.st_size < 8) {
        s = dsk_set_error(DSK_ERR_CORRUPT, "%s: \"%s\": %lld bytes is too short for a safetensors file", fn, path,
                          (long long)st.st_size);
        goto fail;
    }
    if ((s = dsk__st_pread_all(fn, f->fd, len8, 8, 0, path)) != DSK_OK) goto fail;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | len8[i];
    if (hlen > DSK_SAFETENSORS_MAX_HEADER || 8 + hlen > (uint64_t)st.st_size) {
        s = dsk__st_parse(fn, path, f, len8, 8, (uint64_t)st.st_size); /* reports the length error */
        goto fail;
    }
    if (!(m->header = (char *)DSK_MALLOC((size_t)(8 + hlen)))) {
        s = dsk_set_error(DSK_ERR_OOM, "%s: \"%s\": out of memory for a %llu-byte header", fn, path,
                          (unsigned long long)hlen);
        goto fail;
    }
    if ((s = dsk__st_pread_all(fn, f->fd, m->header, (size_t)(8 + hlen), 0, path)) != DSK_OK) goto fail;
    if ((s = dsk__st_parse(fn, path, f, (const unsigned char *)m->header, (size_t)(8 + hlen), (uint64_t)st.st_size)) !=
        DSK_OK)
        goto fail;
    return DSK_OK;
fail:
    dsk_safetensors_close(f);
    return s;
}

DSK_API int dsk_safetensors_find(const dsk_safetensors_file *f, const char *name) {
    int lo = 0, hi = f && name ? f->n_tensors - 1 : -1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2, c = strcmp(f->tensors[mid].name, name);
        if (c == 0) return mid;
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

DSK_API const char *dsk_safetensors_meta(const dsk_safetensors_file *f, const char *key) {
    int lo = 0, hi = f && key ? f->n_meta - 1 : -1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2, c = strcmp(f->meta_keys[mid], key);
        if (c == 0) return f->meta_values[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return NULL;
}

/* Device tensors are copied through ctx's stream: a CUDA tensor needs a CUDA ctx. */
static dsk_status dsk__st_check_device(const char *fn, const char *name, const dsk_tensor *t, const dsk_ctx *ctx) {
    if (t->device.type == DSK_DEV_CPU) return DSK_OK;
    if (t->device.type != DSK_DEV_CUDA || !ctx || ctx->device.type != DSK_DEV_CUDA ||
        ctx->device.index != t->device.index)
        return dsk_set_error(DSK_ERR_ARG,
                             "%s: tensor \"%s\" is on device type %d index %d: pass a ctx on that CUDA device", fn,
                             name, (int)t->device.type, t->device.index);
    return DSK_OK;
}

/* Reading a box of a tensor: the box is cut into runs of contiguous bytes in the file (the
   dims where it spans the whole tensor merge with the first one where it does not); each run
   is read with pread, straight into the output where a run covers a whole checked block, else
   through one cached block. */
typedef struct dsk__st_boxrd {
    const char *fn;
    dsk_safetensors_file *f;
    const dsk_safetensors_info *t;
    uint64_t nbytes;       /* the tensor's bytes */
    uint64_t bsz;          /* bytes per checked block, 0: unchecked */
    unsigned char *bounce; /* one block, read and checked */
    int64_t cached;        /* the block in bounce, -1: none */
} dsk__st_boxrd;

static dsk_status dsk__st_pread_data(dsk__st_boxrd *rd, void *dst, uint64_t off, size_t n) {
    dsk_safetensors_file *f = rd->f;
    f->bytes_read += n;
    return dsk__st_pread_all(rd->fn, f->fd, dst, n, 8 + f->header_len + rd->t->begin + off, f->path);
}

static dsk_status dsk__st_check_block(dsk__st_boxrd *rd, uint64_t b, const unsigned char *p, size_t n) {
    const dsk_safetensors_info *t = rd->t;
    uint32_t want = t->crc32c, got = dsk_safetensors_crc32c(0, p, n);
    char h[9];
    if (t->block_crcs) {
        memcpy(h, t->block_crcs + 8 * b, 8);
        h[8] = 0;
        dsk__st_parse_hex32(h, &want); /* validated when the file was opened */
    }
    if (got == want) return DSK_OK;
    return dsk_set_error(
        DSK_ERR_CORRUPT,
        "%s: tensor \"%s\" in \"%s\": bytes [%llu, %llu): crc32c %08x, header says %08x (data corrupt)", rd->fn,
        t->name, rd->f->path, (unsigned long long)(b * rd->bsz), (unsigned long long)(b * rd->bsz + n), got, want);
}

/* Bytes of whole blocks read with one pread: large requests keep a cold read at the disk's
   speed (1 MiB reads trail by a third on this virtual disk). */
#define DSK__ST_READ_SPAN ((uint64_t)8 << 20)

/* Tensor bytes [lo, hi) into out, every block they touch read and checked. */
static dsk_status dsk__st_copy_range(dsk__st_boxrd *rd, uint64_t lo, uint64_t hi, unsigned char *out) {
    if (!rd->bsz) return dsk__st_pread_data(rd, out, lo, (size_t)(hi - lo));
    while (lo < hi) {
        uint64_t b = lo / rd->bsz, b0 = b * rd->bsz, b1 = b0 + rd->bsz < rd->nbytes ? b0 + rd->bsz : rd->nbytes;
        uint64_t end = hi < b1 ? hi : b1;
        if (lo == b0 && end == b1) { /* whole blocks: read in place, up to DSK__ST_READ_SPAN at once */
            uint64_t e = b1, next;
            while (e - b0 < DSK__ST_READ_SPAN && (next = e + rd->bsz < rd->nbytes ? e + rd->bsz : rd->nbytes) <= hi &&
                   next > e)
                e = next; /* the next block is wanted whole too */
            DSK__TRY(dsk__st_pread_data(rd, out, b0, (size_t)(e - b0)));
            for (uint64_t k = b0; k < e; k += rd->bsz)
                DSK__TRY(dsk__st_check_block(rd, k / rd->bsz, out + (k - b0),
                                             (size_t)((e - k < rd->bsz) ? e - k : rd->bsz)));
            end = e;
        } else {
            if (rd->cached != (int64_t)b) {
                if (!rd->bounce && !(rd->bounce = (unsigned char *)DSK_MALLOC((size_t)rd->bsz)))
                    return dsk_set_error(DSK_ERR_OOM, "%s: tensor \"%s\": out of memory for a %llu-byte block", rd->fn,
                                         rd->t->name, (unsigned long long)rd->bsz);
                rd->cached = -1;
                DSK__TRY(dsk__st_pread_data(rd, rd->bounce, b0, (size_t)(b1 - b0)));
                DSK__TRY(dsk__st_check_block(rd, b, rd->bounce, (size_t)(b1 - b0)));
                rd->cached = (int64_t)b;
            }
            memcpy(out, rd->bounce + (lo - b0), (size_t)(end - lo));
        }
        out += end - lo;
        lo = end;
    }
    return DSK_OK;
}

/* Bytes per element of t, or 0 for packed dtypes of fewer than 8 bits. */
static size_t dsk__st_elem_bytes(const dsk_safetensors_info *t) {
    const dsk__st_stdtype *d = dsk__st_stdtype_by_name(t->dtype_name);
    return d && d->bits % 8 == 0 ? (size_t)(d->bits / 8) : 0;
}

/* Checks that box (off, shape) lies inside t; *bytes = its size. */
static dsk_status dsk__st_check_box(const char *fn, dsk_safetensors_file *f, const dsk_safetensors_info *t,
                                    const int64_t *off, const int64_t *shape, uint64_t *bytes) {
    size_t es = dsk__st_elem_bytes(t);
    int whole = 1;
    for (int d = 0; d < t->ndim; d++) {
        if (off[d] < 0 || shape[d] < 0 || off[d] > t->shape[d] || shape[d] > t->shape[d] - off[d])
            return dsk_set_error(DSK_ERR_ARG, "%s: tensor \"%s\" in \"%s\": dim %d: [%lld, %lld) is outside [0, %lld)",
                                 fn, t->name, f->path ? f->path : "buffer", d, (long long)off[d],
                                 (long long)(off[d] + shape[d]), (long long)t->shape[d]);
        whole &= off[d] == 0 && shape[d] == t->shape[d];
    }
    if (!es && !whole)
        return dsk_set_error(DSK_ERR_UNSUPPORTED,
                             "%s: tensor \"%s\": %s packs elements into fewer than 8 bits: only whole reads", fn,
                             t->name, t->dtype_name);
    *bytes = es ? (uint64_t)dsk__st_numel(t->ndim, shape) * es : t->end - t->begin;
    if (!f->has_fd)
        return dsk_set_error(DSK_ERR_STATE, "%s: tensor \"%s\": the file was parsed from memory, not opened", fn,
                             t->name);
    return DSK_OK;
}

/* Reads box (off, shape) of t, checked, row-major into out (dsk__st_check_box first). */
static dsk_status dsk__st_read_box_bytes(const char *fn, dsk_safetensors_file *f, const dsk_safetensors_info *t,
                                         const int64_t *off, const int64_t *shape, unsigned char *out) {
    dsk__st_boxrd rd;
    int64_t stride[DSK_MAX_DIMS], idx[DSK_MAX_DIMS];
    uint64_t run;
    size_t es = dsk__st_elem_bytes(t);
    int k = t->ndim - 1;
    dsk_status s = DSK_OK;
    memset(&rd, 0, sizeof rd);
    rd.fn = fn;
    rd.f = f;
    rd.t = t;
    rd.nbytes = t->end - t->begin;
    rd.bsz = t->block_bytes;
    rd.cached = -1;
    if (!es || dsk__st_numel(t->ndim, t->shape) == 0) { /* packed dtype (whole only) or no elements */
        s = dsk__st_copy_range(&rd, 0, rd.nbytes, out);
        DSK_FREE(rd.bounce);
        return s;
    }
    if (dsk__st_numel(t->ndim, shape) == 0) return DSK_OK;
    for (int d = t->ndim - 1; d >= 0; d--) stride[d] = d == t->ndim - 1 ? 1 : stride[d + 1] * t->shape[d + 1];
    run = es;
    while (k >= 0 && off[k] == 0 && shape[k] == t->shape[k]) run *= (uint64_t)shape[k--];
    if (k >= 0) run *= (uint64_t)shape[k];
    for (int d = 0; d < k; d++) idx[d] = off[d];
    for (;;) {
        uint64_t start = k >= 0 ? (uint64_t)(off[k] * stride[k]) : 0;
        int d;
        for (d = 0; d < k; d++) start += (uint64_t)(idx[d] * stride[d]);
        if ((s = dsk__st_copy_range(&rd, start * es, start * es + run, out)) != DSK_OK) break;
        out += run;
        for (d = k - 1; d >= 0 && ++idx[d] == off[d] + shape[d]; d--) idx[d] = off[d];
        if (d < 0) break;
    }
    DSK_FREE(rd.bounce);
    return s;
}

/* Copies box (off, dst's shape) of the file tensor into dst, reading straight into dst when
   layouts match, else through a buffer and dsk_tensor_copy (which casts). */
static dsk_status dsk__st_read_into(const char *fn, dsk_safetensors_file *f, dsk_ctx *ctx,
                                    const dsk_safetensors_info *t, const int64_t *off, dsk_tensor *dst,
                                    int allow_cast) {
    dsk_tensor src;
    void *buf;
    uint64_t bytes;
    dsk_status s;
    if (t->dtype < 0)
        return dsk_set_error(DSK_ERR_UNSUPPORTED,
                             "%s: tensor \"%s\" in \"%s\": dtype %s has no dsk dtype (dsk_safetensors_read_raw reads "
                             "its bytes)",
                             fn, t->name, f->path, t->dtype_name);
    if ((int)dst->dtype != t->dtype && !allow_cast)
        return dsk_set_error(DSK_ERR_ARG,
                             "%s: tensor \"%s\" in \"%s\": file has dtype %s, model has %s (set allow_cast to convert)",
                             fn, t->name, f->path, dsk_dtype_name((dsk_dtype)t->dtype), dsk_dtype_name(dst->dtype));
    DSK__TRY(dsk__st_check_box(fn, f, t, off, dst->shape, &bytes));
    if (dst->device.type == DSK_DEV_CPU && (int)dst->dtype == t->dtype && dsk_tensor_is_contiguous(dst) &&
        (dst->data || !bytes))
        return dsk__st_read_box_bytes(fn, f, t, off, dst->shape, (unsigned char *)dst->data);
    if (!(buf = DSK_MALLOC(bytes ? (size_t)bytes : 1)))
        return dsk_set_error(DSK_ERR_OOM, "%s: tensor \"%s\": out of memory for %llu bytes", fn, t->name,
                             (unsigned long long)bytes);
    s = dsk__st_read_box_bytes(fn, f, t, off, dst->shape, (unsigned char *)buf);
    if (s == DSK_OK) s = dsk_tensor_wrap(&src, buf, (dsk_dtype)t->dtype, dsk_cpu(), dst->ndim, dst->shape);
    if (s == DSK_OK) s = dsk_tensor_copy(ctx, dst, &src);
    DSK_FREE(buf);
    return s;
}

/* The file tensor `name`, for the public readers. */
static dsk_status dsk__st_file_tensor(const char *fn, dsk_safetensors_file *f, const char *name,
                                      const dsk_safetensors_info **t) {
    int i;
    if (!f || !name) return dsk_set_error(DSK_ERR_ARG, "%s: NULL argument", fn);
    if ((i = dsk_safetensors_find(f, name)) < 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: no tensor \"%s\" in \"%s\"", fn, name, f->path ? f->path : "buffer");
    *t = &f->tensors[i];
    return DSK_OK;
}

DSK_API dsk_status dsk_safetensors_read(dsk_safetensors_file *f, dsk_ctx *ctx, const char *name, dsk_tensor *dst,
                                        int allow_cast) {
    const char *fn = "dsk_safetensors_read";
    const dsk_safetensors_info *t = NULL;
    const int64_t zero[DSK_MAX_DIMS] = {0};
    char a[160], b[160];
    DSK__TRY(dsk__st_file_tensor(fn, f, name, &t));
    if (!dst) return dsk_set_error(DSK_ERR_ARG, "%s: NULL argument", fn);
    DSK__TRY(dsk__st_check_device(fn, name, dst, ctx));
    if (t->ndim != dst->ndim || memcmp(t->shape, dst->shape, (size_t)t->ndim * sizeof(int64_t)) != 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: tensor \"%s\" in \"%s\": file has %s, model has %s", fn, name,
                             f->path ? f->path : "buffer",
                             dsk__st_desc(a, sizeof a, t->ndim, t->shape,
                                          t->dtype >= 0 ? dsk_dtype_name((dsk_dtype)t->dtype) : t->dtype_name),
                             dsk__st_desc(b, sizeof b, dst->ndim, dst->shape, dsk_dtype_name(dst->dtype)));
    return dsk__st_read_into(fn, f, ctx, t, zero, dst, allow_cast);
}

DSK_API dsk_status dsk_safetensors_read_box(dsk_safetensors_file *f, dsk_ctx *ctx, const char *name,
                                            const int64_t *offset, dsk_tensor *dst, int allow_cast) {
    const char *fn = "dsk_safetensors_read_box";
    const dsk_safetensors_info *t = NULL;
    const int64_t zero[DSK_MAX_DIMS] = {0};
    DSK__TRY(dsk__st_file_tensor(fn, f, name, &t));
    if (!dst) return dsk_set_error(DSK_ERR_ARG, "%s: NULL argument", fn);
    DSK__TRY(dsk__st_check_device(fn, name, dst, ctx));
    if (t->ndim != dst->ndim)
        return dsk_set_error(DSK_ERR_ARG, "%s: tensor \"%s\" has %d dims, the destination %d", fn, name, t->ndim,
                             dst->ndim);
    return dsk__st_read_into(fn, f, ctx, t, offset ? offset : zero, dst, allow_cast);
}

DSK_API dsk_status dsk_safetensors_read_raw(dsk_safetensors_file *f, const char *name, const int64_t *offset,
                                            const int64_t *shape, void *buf, size_t cap) {
    const char *fn = "dsk_safetensors_read_raw";
    const dsk_safetensors_info *t = NULL;
    const int64_t zero[DSK_MAX_DIMS] = {0};
    uint64_t bytes;
    DSK__TRY(dsk__st_file_tensor(fn, f, name, &t));
    if (!shape && t->ndim) return dsk_set_error(DSK_ERR_ARG, "%s: tensor \"%s\": shape is NULL", fn, name);
    if (!offset) offset = zero;
    DSK__TRY(dsk__st_check_box(fn, f, t, offset, shape ? shape : zero, &bytes));
    if (bytes > cap || (bytes && !buf))
        return dsk_set_error(DSK_ERR_ARG, "%s: tensor \"%s\": the box holds %llu bytes, the buffer %zu", fn, name,
                             (unsigned long long)bytes, buf ? cap : 0);
    return dsk__st_read_box_bytes(fn, f, t, offset, shape ? shape : zero, (unsigned char *)buf);
}

/* ---------------------------------------------------------------- writing: plan, snapshot, file */

typedef struct dsk__st_seg {
    char *name;
    const dsk_tensor *src;
    dsk_dtype dtype;
    int ndim;
    int64_t shape[DSK_MAX_DIMS];
    int entry;        /* its index in the caller's entries */
    const void *data; /* contiguous bytes to write: the tensor itself or its snapshot */
    size_t nbytes;
    uint64_t begin; /* offset in the data buffer */
    uint32_t crc;
    uint32_t *blocks; /* CRC32C of each DSK__ST_BLOCK bytes, while the file is written */
    uint64_t n_blocks;
    int omit; /* not in the file: no data, no header entry (dsk_ckpt.h's reused pieces, which
                            its metadata references elsewhere) */
} dsk__st_seg;

struct dsk__st_plan;
/* Appends more "dsk." pairs to __metadata__, each starting with a comma, the same text both
   times the header is written (dsk_ckpt.h: a rank file's step, rank, boxes and hashes). */
typedef void (*dsk__st_meta_fn)(dsk__st_buf *b, const struct dsk__st_plan *p, void *user);

typedef struct dsk__st_plan {
    dsk__st_seg *segs;
    int n;
    char **keys, **values;
    int n_kv;
    uint64_t total;       /* data bytes */
    dsk__st_meta_fn meta; /* NULL or more metadata */
    void *meta_user;
} dsk__st_plan;

static void dsk__st_plan_free(dsk__st_plan *p) {
    for (int i = 0; i < p->n; i++) DSK_FREE(p->segs[i].name);
    for (int i = 0; i < p->n_kv; i++) {
        DSK_FREE(p->keys[i]);
        DSK_FREE(p->values[i]);
    }
    DSK_FREE(p->segs);
    DSK_FREE(p->keys);
    DSK_FREE(p->values);
    memset(p, 0, sizeof *p);
}

static int dsk__st_cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Larger elements first (keeps every tensor aligned to its element size, as the reference
   writer does), then by name. */
static int dsk__st_cmp_seg(const void *a, const void *b) {
    const dsk__st_seg *x = (const dsk__st_seg *)a, *y = (const dsk__st_seg *)b;
    size_t sx = dsk_dtype_size(x->dtype), sy = dsk_dtype_size(y->dtype);
    if (sx != sy) return sx > sy ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* First duplicate among n strings, or NULL. */
static const char *dsk__st_find_dup(const char **names, int n) {
    qsort((void *)names, (size_t)n, sizeof *names, dsk__st_cmp_str);
    for (int i = 1; i < n; i++)
        if (strcmp(names[i], names[i - 1]) == 0) return names[i];
    return NULL;
}

static dsk_status dsk__st_check_entry(const char *fn, const dsk_safetensors_entry *e, int i, const dsk_ctx *ctx) {
    const dsk_tensor *t = e->tensor;
    if (!e->name || !*e->name) return dsk_set_error(DSK_ERR_ARG, "%s: entry %d has no name", fn, i);
    if (strcmp(e->name, "__metadata__") == 0 || !dsk__st_valid_utf8((const unsigned char *)e->name, strlen(e->name)))
        return dsk_set_error(DSK_ERR_ARG, "%s: entry %d: name \"%s\" is reserved or not UTF-8", fn, i, e->name);
    if (!t) return dsk_set_error(DSK_ERR_ARG, "%s: tensor \"%s\" is NULL", fn, e->name);
    if (!dsk_dtype_size(t->dtype) || t->ndim < 0 || t->ndim > DSK_MAX_DIMS || dsk__st_numel(t->ndim, t->shape) < 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: tensor \"%s\": bad dtype %d or shape (ndim %d)", fn, e->name,
                             (int)t->dtype, t->ndim);
    if (!t->data && dsk_tensor_numel(t) > 0)
        return dsk_set_error(DSK_ERR_ARG, "%s: tensor \"%s\" has no data", fn, e->name);
    return dsk__st_check_device(fn, e->name, t, ctx);
}

static dsk_status dsk__st_check_kv(const char *fn, const dsk_safetensors_kv *kv, int n_kv) {
    const char **keys;
    const char *dup;
    if (n_kv < 0 || (n_kv && !kv))
        return dsk_set_error(DSK_ERR_ARG, "%s: %d key/value pairs at %p", fn, n_kv, (const void *)kv);
    for (int i = 0; i < n_kv; i++) {
        if (!kv[i].key || !*kv[i].key || !kv[i].value)
            return dsk_set_error(DSK_ERR_ARG, "%s: pair %d has a NULL or empty key or NULL value", fn, i);
        if (strncmp(kv[i].key, "dsk.", 4) == 0)
            return dsk_set_error(DSK_ERR_ARG, "%s: key \"%s\": the prefix \"dsk.\" is reserved", fn, kv[i].key);
        if (!dsk__st_valid_utf8((const unsigned char *)kv[i].key, strlen(kv[i].key)) ||
            !dsk__st_valid_utf8((const unsigned char *)kv[i].value, strlen(kv[i].value)))
            return dsk_set_error(DSK_ERR_ARG, "%s: pair \"%s\" is not UTF-8", fn, kv[i].key);
    }
    if (!n_kv) return DSK_OK;
    keys = (const char **)DSK_MALLOC((size_t)n_kv * sizeof *keys);
    if (!keys) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    for (int i = 0; i < n_kv; i++) keys[i] = kv[i].key;
    dup = dsk__st_find_dup(keys, n_kv);
    if (dup) {
        dsk_status s = dsk_set_error(DSK_ERR_ARG, "%s: key \"%s\" appears twice", fn, dup);
        DSK_FREE((void *)keys);
        return s;
    }
    DSK_FREE((void *)keys);
    return DSK_OK;
}

/* Places the segments the file holds (not the omitted ones) one after the other. */
static void dsk__st_plan_layout(dsk__st_plan *p) {
    p->total = 0;
    for (int i = 0; i < p->n; i++) {
        p->segs[i].begin = p->total;
        if (!p->segs[i].omit) p->total += p->segs[i].nbytes;
    }
}

/* Validates the entries and pairs and copies what the file needs (names, pairs, shapes) of
   the entries whose keep flag is set (keep NULL: all of them). */
static dsk_status dsk__st_plan_build(const char *fn, dsk__st_plan *p, const dsk_safetensors_entry *entries, int n,
                                     const unsigned char *keep, const dsk_safetensors_kv *kv, int n_kv,
                                     const dsk_ctx *ctx) {
    dsk_status s;
    const char **names;
    const char *dup;
    if (n < 0 || (n && !entries))
        return dsk_set_error(DSK_ERR_ARG, "%s: %d entries at %p", fn, n, (const void *)entries);
    for (int i = 0; i < n; i++) DSK__TRY(dsk__st_check_entry(fn, &entries[i], i, ctx));
    DSK__TRY(dsk__st_check_kv(fn, kv, n_kv));
    names = (const char **)DSK_MALLOC(((size_t)n + 1) * sizeof *names);
    if (!names) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    for (int i = 0; i < n; i++) names[i] = entries[i].name;
    dup = dsk__st_find_dup(names, n);
    if (dup) {
        s = dsk_set_error(DSK_ERR_ARG, "%s: tensor name \"%s\" appears twice", fn, dup);
        DSK_FREE((void *)names);
        return s;
    }
    DSK_FREE((void *)names);
    p->segs = (dsk__st_seg *)DSK_MALLOC(((size_t)n + 1) * sizeof *p->segs);
    p->keys = (char **)DSK_MALLOC(((size_t)n_kv + 1) * sizeof(char *));
    p->values = (char **)DSK_MALLOC(((size_t)n_kv + 1) * sizeof(char *));
    if (!p->segs || !p->keys || !p->values) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    for (int i = 0; i < n; i++) {
        const dsk_safetensors_entry *e = &entries[i];
        dsk__st_seg *g = &p->segs[p->n];
        if (keep && !keep[i]) continue;
        memset(g, 0, sizeof *g);
        if (!(g->name = dsk__st_strdup(e->name))) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
        p->n++;
        g->src = e->tensor;
        g->dtype = e->tensor->dtype;
        g->ndim = e->tensor->ndim;
        memcpy(g->shape, e->tensor->shape, sizeof g->shape);
        g->entry = i;
        g->nbytes = dsk_tensor_nbytes(e->tensor);
    }
    for (int i = 0; i < n_kv; i++) {
        p->keys[i] = dsk__st_strdup(kv[i].key);
        p->values[i] = dsk__st_strdup(kv[i].value);
        p->n_kv = i + 1;
        if (!p->keys[i] || !p->values[i]) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    }
    qsort(p->segs, (size_t)p->n, sizeof *p->segs, dsk__st_cmp_seg);
    dsk__st_plan_layout(p);
    return DSK_OK;
}

/* memcpy in 4 MiB pieces over `threads` OpenMP threads: an async save's snapshot is the
   caller's stall. */
static void dsk__st_copy_par(void *dst, const void *src, size_t n, int threads) {
    const size_t piece = (size_t)4 << 20;
    long long pieces = (long long)((n + piece - 1) / piece);
    if (threads <= 1 || pieces <= 1) {
        memcpy(dst, src, n);
        return;
    }
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads)
#endif
    for (long long i = 0; i < pieces; i++) {
        size_t off = (size_t)i * piece, len = n - off < piece ? n - off : piece;
        memcpy((char *)dst + off, (const char *)src + off, len);
    }
}

/* Points each segment at bytes to write: contiguous host tensors directly (unless copy_all),
   everything else copied into stage (at least p->total bytes). */
static dsk_status dsk__st_snapshot(dsk__st_plan *p, dsk_ctx *ctx, unsigned char *stage, int copy_all, int threads) {
    for (int i = 0; i < p->n; i++) {
        dsk__st_seg *g = &p->segs[i];
        dsk_tensor h;
        int host_contig = g->src->device.type == DSK_DEV_CPU && dsk_tensor_is_contiguous(g->src);
        if (!g->nbytes) {
            g->data = NULL;
            continue;
        }
        if (host_contig && !copy_all) {
            g->data = g->src->data;
            continue;
        }
        g->data = stage + g->begin;
        if (host_contig) {
            dsk__st_copy_par(stage + g->begin, g->src->data, g->nbytes, threads);
            continue;
        }
        DSK__TRY(dsk_tensor_wrap(&h, stage + g->begin, g->dtype, dsk_cpu(), g->ndim, g->shape));
        DSK__TRY(dsk_tensor_copy(ctx, &h, g->src));
    }
    return DSK_OK;
}

static int dsk__st_needs_stage(const dsk__st_plan *p) {
    for (int i = 0; i < p->n; i++)
        if (p->segs[i].nbytes &&
            (p->segs[i].src->device.type != DSK_DEV_CPU || !dsk_tensor_is_contiguous(p->segs[i].src)))
            return 1;
    return 0;
}

/* A JSON string of prefix followed by s. */
static void dsk__st_put_jstr2(dsk__st_buf *b, const char *prefix, const char *s) {
    dsk__st_buf t;
    memset(&t, 0, sizeof t);
    dsk__st_puts(&t, prefix);
    dsk__st_puts(&t, s);
    if (t.oom) b->oom = 1;
    else dsk__st_put_jstr(b, t.p);
    dsk__st_buf_free(&t);
}

/* The JSON header, padded with spaces to a multiple of 8 bytes. CRCs are 8 hex digits, so
   the length does not depend on their values. */
static void dsk__st_header_json(dsk__st_buf *b, const dsk__st_plan *p) {
    dsk__st_putf(b, "{\"__metadata__\":{\"dsk.format\":\"%s\",\"dsk.version\":\"%d\"", DSK_SAFETENSORS_FORMAT,
                 DSK_SAFETENSORS_VERSION);
    for (int i = 0; i < p->n; i++) {
        const dsk__st_seg *g = &p->segs[i];
        if (g->omit) continue;
        dsk__st_puts(b, ",");
        dsk__st_put_jstr2(b, "dsk.crc32c.", g->name);
        dsk__st_putf(b, ":\"%08x\"", g->crc);
        if (g->n_blocks > 1) {
            dsk__st_puts(b, ",");
            dsk__st_put_jstr2(b, "dsk.blocks.", g->name);
            dsk__st_putf(b, ":\"%llu:", (unsigned long long)DSK__ST_BLOCK);
            for (uint64_t k = 0; k < g->n_blocks; k++) dsk__st_putf(b, "%08x", g->blocks[k]);
            dsk__st_puts(b, "\"");
        }
    }
    if (p->meta) p->meta(b, p, p->meta_user);
    for (int i = 0; i < p->n_kv; i++) {
        dsk__st_puts(b, ",");
        dsk__st_put_jstr(b, p->keys[i]);
        dsk__st_puts(b, ":");
        dsk__st_put_jstr(b, p->values[i]);
    }
    dsk__st_puts(b, "}");
    for (int i = 0; i < p->n; i++) {
        const dsk__st_seg *g = &p->segs[i];
        if (g->omit) continue;
        dsk__st_puts(b, ",");
        dsk__st_put_jstr(b, g->name);
        dsk__st_putf(b, ":{\"dtype\":\"%s\",\"shape\":[", dsk__st_stname(g->dtype));
        for (int d = 0; d < g->ndim; d++) dsk__st_putf(b, d ? ",%lld" : "%lld", (long long)g->shape[d]);
        dsk__st_putf(b, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)g->begin,
                     (unsigned long long)(g->begin + g->nbytes));
    }
    dsk__st_puts(b, "}");
    while (!b->oom && b->n % 8) dsk__st_puts(b, " ");
}

static dsk_status dsk__st_pwrite_all(const char *fn, int fd, const void *p, size_t n, uint64_t off, const char *path) {
    const char *q = (const char *)p;
    while (n) {
        ssize_t k = pwrite(fd, q, n, (off_t)off);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            if (k == 0) errno = EIO;
            return dsk__st_io_error(fn, "write to", path);
        }
        q += k;
        n -= (size_t)k;
        off += (uint64_t)k;
    }
    return DSK_OK;
}

/* Bytes written between two requests to start writing back: the disk works on what a save
   wrote while it computes CRCs and copies more, instead of all of it at the final fsync. */
#define DSK__ST_WRITEBACK ((uint64_t)32 << 20)

/* Asks the kernel to start writing [from, to) of fd's data back (no wait; advisory: where
   the call does not exist or fails, the final fsync does it all). Returns `to`. */
static uint64_t dsk__st_start_writeback(int fd, uint64_t from, uint64_t to) {
#ifdef DSK__ST_SYNC_RANGE
    (void)DSK__ST_SYNC_RANGE(fd, from, to - from);
#else
    (void)fd;
    (void)from;
#endif
    return to;
}

/* Per-block CRC arrays of every segment (zeros: the placeholders of the first header). */
static dsk_status dsk__st_alloc_blocks(const char *fn, dsk__st_plan *p) {
    for (int i = 0; i < p->n; i++) {
        dsk__st_seg *g = &p->segs[i];
        g->crc = 0;
        g->n_blocks = g->omit ? 0 : (g->nbytes + DSK__ST_BLOCK - 1) / DSK__ST_BLOCK;
        if (!(g->blocks = (uint32_t *)DSK_MALLOC((size_t)(g->n_blocks + 1) * sizeof(uint32_t))))
            return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
        memset(g->blocks, 0, (size_t)(g->n_blocks + 1) * sizeof(uint32_t));
    }
    return DSK_OK;
}
static void dsk__st_free_blocks(dsk__st_plan *p) {
    for (int i = 0; i < p->n; i++) {
        DSK_FREE(p->segs[i].blocks);
        p->segs[i].blocks = NULL;
    }
}

/* Writes the header (with placeholder CRCs) then the data, computing each block's CRC just
   before writing it, then rewrites the header with the CRCs (their length is fixed). */
static dsk_status dsk__st_write_body(const char *fn, int fd, dsk__st_plan *p, const char *tmp) {
    const uint32_t k_block = dsk__st_xpow8n(DSK__ST_BLOCK);
    uint64_t written = 0, flushed = 0;
    dsk__st_buf h;
    size_t hlen;
    unsigned char len8[8];
    dsk_status s;
    memset(&h, 0, sizeof h);
    if ((s = dsk__st_alloc_blocks(fn, p)) != DSK_OK) goto done;
    dsk__st_put(&h, "\0\0\0\0\0\0\0\0", 8);
    dsk__st_header_json(&h, p);
    if (h.oom) {
        s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory for the header", fn);
        goto done;
    }
    hlen = h.n - 8;
    if (hlen > DSK_SAFETENSORS_MAX_HEADER) {
        s = dsk_set_error(DSK_ERR_ARG, "%s: a %zu-byte header (%d tensors) exceeds the safetensors limit of %llu bytes",
                          fn, hlen, p->n, (unsigned long long)DSK_SAFETENSORS_MAX_HEADER);
        goto done;
    }
    if ((s = dsk__st_write_all(fn, fd, h.p, h.n, tmp)) != DSK_OK) goto done;
    for (int i = 0; i < p->n && s == DSK_OK; i++) {
        dsk__st_seg *g = &p->segs[i];
        const unsigned char *q = (const unsigned char *)g->data;
        for (uint64_t b = 0; b < g->n_blocks && s == DSK_OK; b++) {
            size_t off = (size_t)(b * DSK__ST_BLOCK),
                   k = g->nbytes - off < DSK__ST_BLOCK ? g->nbytes - off : DSK__ST_BLOCK;
            g->blocks[b] = dsk_safetensors_crc32c(0, q + off, k);
            g->crc = dsk__st_mulmod(k == DSK__ST_BLOCK ? k_block : dsk__st_xpow8n(k), g->crc) ^ g->blocks[b];
            s = dsk__st_write_all(fn, fd, q + off, k, tmp);
            written += k;
            if (s == DSK_OK && written - flushed >= DSK__ST_WRITEBACK)
                flushed = dsk__st_start_writeback(fd, flushed, written);
        }
    }
    if (s == DSK_OK) {
        h.n = 0;
        for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
        dsk__st_put(&h, (const char *)len8, 8);
        dsk__st_header_json(&h, p);
        if (h.oom || h.n != hlen + 8) s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory for the header", fn);
        else s = dsk__st_pwrite_all(fn, fd, h.p, h.n, 0, tmp);
    }
done:
    dsk__st_free_blocks(p);
    dsk__st_buf_free(&h);
    return s;
}

/* Writes the plan as dir/base, atomically and durably. */
static dsk_status dsk__st_write_plan(const char *fn, dsk__st_plan *p, const char *dir, const char *base, int how) {
    char *tmp = NULL;
    int fd = -1;
    dsk_status s;
    DSK__TRY(dsk__st_open_tmp(fn, dir, base, &tmp, &fd));
    if ((s = dsk__st_write_body(fn, fd, p, tmp)) != DSK_OK) {
        close(fd);
        unlink(tmp);
        DSK_FREE(tmp);
        return s;
    }
    return dsk__st_commit_tmp(fn, fd, tmp, dir, base, how);
}

DSK_API dsk_status dsk_safetensors_save(dsk_ctx *ctx, const char *path, const dsk_safetensors_entry *entries, int n,
                                        const dsk_safetensors_kv *kv, int n_kv) {
    const char *fn = "dsk_safetensors_save";
    dsk__st_plan p;
    unsigned char *stage = NULL;
    char *dir = NULL, *base = NULL;
    dsk_status s;
    memset(&p, 0, sizeof p);
    if (!path) return dsk_set_error(DSK_ERR_ARG, "%s: path is NULL", fn);
    DSK__TRY(dsk__st_split_path(fn, path, &dir, &base));
    s = dsk__st_plan_build(fn, &p, entries, n, NULL, kv, n_kv, ctx);
    if (s == DSK_OK && dsk__st_needs_stage(&p) && !(stage = (unsigned char *)DSK_MALLOC((size_t)p.total)))
        s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory for a %llu-byte snapshot", fn, (unsigned long long)p.total);
    if (s == DSK_OK) s = dsk__st_snapshot(&p, ctx, stage, 0, 1);
    if (s == DSK_OK) s = dsk__st_write_plan(fn, &p, dir, base, DSK__ST_DURABLE | DSK__ST_WITHDRAW);
    dsk__st_plan_free(&p);
    DSK_FREE(stage);
    DSK_FREE(dir);
    DSK_FREE(base);
    return s;
}

/* ---------------------------------------------------------------- Hugging Face sharded sets */

#define DSK__ST_HF_INDEX "model.safetensors.index.json"
#define DSK__ST_HF_SINGLE "model.safetensors"

DSK_API void dsk_safetensors_hf_close(dsk_safetensors_hf *h) {
    if (!h) return;
    for (int i = 0; i < h->n_shards; i++) {
        if (h->shards) dsk_safetensors_close(&h->shards[i]);
        if (h->shard_names) DSK_FREE(h->shard_names[i]);
    }
    for (int i = 0; i < h->n_tensors; i++) DSK_FREE(h->names[i]);
    DSK_FREE(h->shards);
    DSK_FREE(h->shard_names);
    DSK_FREE(h->names);
    DSK_FREE(h->shard_of);
    DSK_FREE(h->dir);
    memset(h, 0, sizeof *h);
}

/* A shard's file name from an index: a plain name inside dir. */
static int dsk__st_hf_plain_name(const char *s) {
    return s && *s && !strchr(s, '/') && strcmp(s, ".") && strcmp(s, "..");
}

/* Sorts names (with their shards) and refuses a name given twice. */
static dsk_status dsk__st_hf_sort(const char *fn, dsk_safetensors_hf *h, const char *where) {
    for (int i = 1; i < h->n_tensors; i++) { /* insertion of an index by name: usually sorted already */
        char *nm = h->names[i];
        int sh = h->shard_of[i], k = i;
        while (k > 0 && strcmp(h->names[k - 1], nm) > 0) {
            h->names[k] = h->names[k - 1];
            h->shard_of[k] = h->shard_of[k - 1];
            k--;
        }
        h->names[k] = nm;
        h->shard_of[k] = sh;
    }
    for (int i = 1; i < h->n_tensors; i++)
        if (strcmp(h->names[i], h->names[i - 1]) == 0)
            return dsk_set_error(DSK_ERR_CORRUPT, "%s: \"%s\" names tensor \"%s\" twice", fn, where, h->names[i]);
    return DSK_OK;
}

/* The index's weight_map: its names and the distinct shard files they name. */
static dsk_status dsk__st_hf_read_index(const char *fn, dsk_safetensors_hf *h, const char *path) {
    char *text = NULL;
    size_t len = 0;
    dsk__st_json j;
    dsk_status s;
    int wm, count;
    memset(&j, 0, sizeof j);
    DSK__TRY(dsk__st_read_small(fn, path, (size_t)DSK_SAFETENSORS_MAX_HEADER, &text, &len));
    if ((s = dsk__st_json_parse(&j, text, len, fn, path)) != DSK_OK) goto done;
    wm = dsk__st_jget(&j, 0, "weight_map");
    if (wm < 0 || dsk__st_jtype(&j, wm) != DSK__ST_J_OBJ) {
        s = dsk_set_error(DSK_ERR_CORRUPT, "%s: \"%s\" has no \"weight_map\" object", fn, path);
        goto done;
    }
    count = dsk__st_jcount(&j, wm);
    h->names = (char **)DSK_MALLOC(((size_t)count + 1) * sizeof *h->names);
    h->shard_of = (int *)DSK_MALLOC(((size_t)count + 1) * sizeof *h->shard_of);
    h->shard_names = (char **)DSK_MALLOC(((size_t)count + 1) * sizeof *h->shard_names);
    if (!h->names || !h->shard_of || !h->shard_names) {
        s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
        goto done;
    }
    for (int c = dsk__st_jchild(&j, wm); c >= 0; c = dsk__st_jnext(&j, c)) {
        const char *file = dsk__st_jstr(&j, c);
        int k = 0;
        if (dsk__st_jkey_nul(&j, c) || !dsk__st_hf_plain_name(file)) {
            s = dsk_set_error(DSK_ERR_CORRUPT,
                              "%s: \"%s\": weight_map[\"%s\"] is not the name of a file in the directory", fn, path,
                              dsk__st_jkey(&j, c));
            goto done;
        }
        while (k < h->n_shards && strcmp(h->shard_names[k], file) != 0) k++;
        if (k == h->n_shards && !(h->shard_names[h->n_shards++] = dsk__st_strdup(file))) {
            h->n_shards--;
            s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
            goto done;
        }
        h->shard_of[h->n_tensors] = k;
        if (!(h->names[h->n_tensors] = dsk__st_strdup(dsk__st_jkey(&j, c)))) {
            s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
            goto done;
        }
        h->n_tensors++;
    }
    s = dsk__st_hf_sort(fn, h, path);
done:
    dsk__st_json_free(&j);
    DSK_FREE(text);
    return s;
}

/* A single model.safetensors: its tensors, from its header. */
static dsk_status dsk__st_hf_read_single(const char *fn, dsk_safetensors_hf *h, const char *path) {
    dsk_safetensors_file *f;
    h->shard_names = (char **)DSK_MALLOC(sizeof *h->shard_names);
    h->shards = (dsk_safetensors_file *)DSK_MALLOC(sizeof *h->shards);
    if (!h->shard_names || !h->shards || !(h->shard_names[0] = dsk__st_strdup(DSK__ST_HF_SINGLE)))
        return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    h->n_shards = 1;
    f = &h->shards[0];
    memset(f, 0, sizeof *f);
    DSK__TRY(dsk_safetensors_open(f, path));
    h->names = (char **)DSK_MALLOC(((size_t)f->n_tensors + 1) * sizeof *h->names);
    h->shard_of = (int *)DSK_MALLOC(((size_t)f->n_tensors + 1) * sizeof *h->shard_of);
    if (!h->names || !h->shard_of) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    for (int i = 0; i < f->n_tensors; i++) {
        if (!(h->names[i] = dsk__st_strdup(f->tensors[i].name)))
            return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
        h->shard_of[i] = 0;
        h->n_tensors = i + 1;
    }
    return DSK_OK;
}

DSK_API dsk_status dsk_safetensors_hf_open(dsk_safetensors_hf *h, const char *dir) {
    const char *fn = "dsk_safetensors_hf_open";
    char *idx, *single;
    dsk_status s;
    if (!h || !dir) return dsk_set_error(DSK_ERR_ARG, "%s: NULL argument", fn);
    memset(h, 0, sizeof *h);
    idx = dsk__st_join(dir, DSK__ST_HF_INDEX);
    single = dsk__st_join(dir, DSK__ST_HF_SINGLE);
    if (!(h->dir = dsk__st_strdup(dir)) || !idx || !single) s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    else if (dsk__st_exists(idx)) s = dsk__st_hf_read_index(fn, h, idx);
    else if (dsk__st_exists(single)) s = dsk__st_hf_read_single(fn, h, single);
    else
        s = dsk_set_error(DSK_ERR_IO, "%s: \"%s\" holds neither %s nor %s", fn, dir, DSK__ST_HF_INDEX,
                          DSK__ST_HF_SINGLE);
    if (s == DSK_OK && !h->shards) {
        if (!(h->shards = (dsk_safetensors_file *)DSK_MALLOC(((size_t)h->n_shards + 1) * sizeof *h->shards)))
            s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
        else memset(h->shards, 0, ((size_t)h->n_shards + 1) * sizeof *h->shards);
    }
    DSK_FREE(idx);
    DSK_FREE(single);
    if (s != DSK_OK) dsk_safetensors_hf_close(h);
    return s;
}

DSK_API dsk_status dsk_safetensors_hf_find(dsk_safetensors_hf *h, const char *name, dsk_safetensors_file **file,
                                           const dsk_safetensors_info **info) {
    const char *fn = "dsk_safetensors_hf_find";
    int lo = 0, hi, k, t;
    if (!h || !h->dir || !name || !file || !info)
        return dsk_set_error(DSK_ERR_ARG, "%s: NULL argument or closed set", fn);
    hi = h->n_tensors - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2, c = strcmp(h->names[mid], name);
        if (c == 0) {
            lo = mid;
            break;
        }
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    if (lo > hi) return dsk_set_error(DSK_ERR_ARG, "%s: no tensor \"%s\" in \"%s\"", fn, name, h->dir);
    k = h->shard_of[lo];
    if (!h->shards[k].mem) {
        char *path = dsk__st_join(h->dir, h->shard_names[k]);
        dsk_status s;
        if (!path) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
        s = dsk_safetensors_open(&h->shards[k], path);
        DSK_FREE(path);
        if (s != DSK_OK) return s;
    }
    if ((t = dsk_safetensors_find(&h->shards[k], name)) < 0)
        return dsk_set_error(DSK_ERR_CORRUPT, "%s: the index places \"%s\" in \"%s\", which does not hold it", fn, name,
                             h->shards[k].path);
    *file = &h->shards[k];
    *info = &h->shards[k].tensors[t];
    return DSK_OK;
}

/* pattern (holding "{E}": dsk__st_hf_count checked) with "{E}" replaced by e. */
static dsk_status dsk__st_hf_expert_name(const char *fn, const char *pattern, int64_t e, dsk__st_buf *out) {
    const char *at = strstr(pattern, "{E}");
    out->n = 0;
    dsk__st_put(out, pattern, (size_t)(at - pattern));
    dsk__st_putf(out, "%lld", (long long)e);
    dsk__st_puts(out, at + 3);
    return out->oom ? dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn) : DSK_OK;
}

/* The number of file tensors behind an entry (its experts when stacked), checked. */
static dsk_status dsk__st_hf_count(const char *fn, const dsk_safetensors_hf_entry *e, int i, int64_t *count) {
    if (!e->name || !e->tensor) return dsk_set_error(DSK_ERR_ARG, "%s: entry %d has no name or tensor", fn, i);
    if (!e->stacked) {
        *count = 1;
        return DSK_OK;
    }
    if (e->tensor->ndim < 1 || e->expert0 < 0 || !strstr(e->name, "{E}"))
        return dsk_set_error(
            DSK_ERR_ARG,
            "%s: stacked entry \"%s\" needs a tensor of at least one dim, expert0 >= 0 and \"{E}\" in its name", fn,
            e->name);
    *count = e->tensor->shape[0];
    return DSK_OK;
}

DSK_API dsk_status dsk_safetensors_hf_read(dsk_safetensors_hf *h, dsk_ctx *ctx, const dsk_safetensors_hf_entry *entries,
                                           int n, int allow_cast) {
    const char *fn = "dsk_safetensors_hf_read";
    dsk__st_buf nm;
    dsk_status s = DSK_OK;
    if (!h || !h->dir || n < 0 || (n && !entries))
        return dsk_set_error(DSK_ERR_ARG, "%s: NULL argument or closed set", fn);
    memset(&nm, 0, sizeof nm);
    for (int i = 0; i < n && s == DSK_OK; i++) {
        const dsk_safetensors_hf_entry *e = &entries[i];
        int64_t count = 0;
        if ((s = dsk__st_hf_count(fn, e, i, &count)) != DSK_OK) break;
        for (int64_t k = 0; k < count && s == DSK_OK; k++) {
            dsk_safetensors_file *f = NULL;
            const dsk_safetensors_info *t = NULL;
            dsk_tensor view = *e->tensor;
            const char *name = e->name;
            if (e->stacked) {
                if ((s = dsk__st_hf_expert_name(fn, e->name, e->expert0 + k, &nm)) != DSK_OK) break;
                if ((s = dsk_tensor_select(e->tensor, k, &view)) != DSK_OK) break;
                name = nm.p;
            }
            if ((s = dsk_safetensors_hf_find(h, name, &f, &t)) == DSK_OK)
                s = dsk_safetensors_read(f, ctx, name, &view, allow_cast);
        }
    }
    dsk__st_buf_free(&nm);
    return s;
}

/* One file tensor of an export: its name and a view of the caller's tensor. */
typedef struct dsk__st_hf_item {
    char *name;
    dsk_tensor view;
    int shard;
} dsk__st_hf_item;

static int dsk__st_cmp_hf_item(const void *a, const void *b) {
    return strcmp((*(const dsk__st_hf_item *const *)a)->name, (*(const dsk__st_hf_item *const *)b)->name);
}

/* "model-<5 digits>-of-<5 digits>.safetensors" */
static void dsk__st_hf_shard_name(char *buf, size_t n, int k, int total) {
    snprintf(buf, n, "model-%05d-of-%05d.safetensors", k + 1, total);
}

/* The index text of an export; items sorted by name here. */
static dsk_status dsk__st_hf_index_text(const char *fn, dsk__st_buf *b, dsk__st_hf_item *items, int n, int n_shards) {
    dsk__st_hf_item **order = (dsk__st_hf_item **)DSK_MALLOC(((size_t)n + 1) * sizeof *order);
    uint64_t total = 0;
    if (!order) return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    for (int i = 0; i < n; i++) {
        order[i] = &items[i];
        total += dsk_tensor_nbytes(&items[i].view);
    }
    qsort(order, (size_t)n, sizeof *order, dsk__st_cmp_hf_item);
    dsk__st_putf(b, "{\n  \"metadata\": {\n    \"total_size\": %llu\n  },\n  \"weight_map\": {",
                 (unsigned long long)total);
    for (int i = 0; i < n; i++) {
        char shard[64];
        if (i && strcmp(order[i]->name, order[i - 1]->name) == 0) {
            dsk_status s = dsk_set_error(DSK_ERR_ARG, "%s: tensor name \"%s\" appears twice", fn, order[i]->name);
            DSK_FREE(order);
            return s;
        }
        dsk__st_hf_shard_name(shard, sizeof shard, order[i]->shard, n_shards);
        dsk__st_puts(b, i ? ",\n    " : "\n    ");
        dsk__st_put_jstr(b, order[i]->name);
        dsk__st_putf(b, ": \"%s\"", shard);
    }
    dsk__st_puts(b, "\n  }\n}\n");
    DSK_FREE(order);
    return b->oom ? dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn) : DSK_OK;
}

/* After the index: removes model.safetensors and shards of an earlier export it does not name. */
static dsk_status dsk__st_hf_tidy(const char *fn, const char *dir, int n_shards) {
    DIR *d = opendir(dir);
    struct dirent *de;
    dsk_status s = DSK_OK;
    int removed = 0;
    if (!d) return dsk__st_io_error(fn, "open directory", dir);
    while (s == DSK_OK && (de = readdir(d)) != NULL) {
        int k, total, len = 0;
        char *p;
        if (strcmp(de->d_name, DSK__ST_HF_SINGLE) != 0 &&
            (sscanf(de->d_name, "model-%5d-of-%5d.safetensors%n", &k, &total, &len) != 2 || de->d_name[len] ||
             total == n_shards))
            continue;
        if (!(p = dsk__st_join(dir, de->d_name))) {
            s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
            break;
        }
        s = dsk__st_remove(fn, p, &removed);
        DSK_FREE(p);
    }
    closedir(d);
    return s;
}

/* The export's file tensors in entry order (stacked entries expanded), each given a shard. */
static dsk_status dsk__st_hf_items(const char *fn, const dsk_safetensors_hf_entry *entries, int n, uint64_t max_bytes,
                                   dsk__st_hf_item **out, int *n_items, int *n_shards) {
    int64_t total = 0;
    uint64_t fill = 0;
    dsk__st_buf nm;
    dsk_status s = DSK_OK;
    int k = 0;
    *out = NULL;
    *n_items = 0;
    *n_shards = 1;
    for (int i = 0; i < n; i++) {
        int64_t c = 0;
        DSK__TRY(dsk__st_hf_count(fn, &entries[i], i, &c));
        total += c;
    }
    if (total > INT32_MAX / 2) return dsk_set_error(DSK_ERR_ARG, "%s: %lld tensors", fn, (long long)total);
    if (!(*out = (dsk__st_hf_item *)DSK_MALLOC(((size_t)total + 1) * sizeof **out)))
        return dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    memset(*out, 0, ((size_t)total + 1) * sizeof **out);
    memset(&nm, 0, sizeof nm);
    for (int i = 0; i < n && s == DSK_OK; i++) {
        const dsk_safetensors_hf_entry *e = &entries[i];
        int64_t count = e->stacked ? e->tensor->shape[0] : 1;
        for (int64_t x = 0; x < count && s == DSK_OK; x++, k++) {
            dsk__st_hf_item *it = &(*out)[k];
            uint64_t bytes;
            it->view = *e->tensor;
            if (e->stacked && (s = dsk__st_hf_expert_name(fn, e->name, e->expert0 + x, &nm)) == DSK_OK)
                s = dsk_tensor_select(e->tensor, x, &it->view);
            if (s != DSK_OK) break;
            if (!(it->name = dsk__st_strdup(e->stacked ? nm.p : e->name))) {
                s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
                break;
            }
            *n_items = k + 1;
            bytes = dsk_tensor_nbytes(&it->view);
            if (fill && fill + bytes > max_bytes) {
                (*n_shards)++;
                fill = 0;
            }
            it->shard = *n_shards - 1;
            fill += bytes;
        }
    }
    dsk__st_buf_free(&nm);
    return s;
}

DSK_API dsk_status dsk_safetensors_hf_save(dsk_ctx *ctx, const char *dir, const dsk_safetensors_hf_entry *entries,
                                           int n, const dsk_safetensors_kv *kv, int n_kv, uint64_t max_shard_bytes) {
    const char *fn = "dsk_safetensors_hf_save";
    dsk__st_hf_item *items = NULL;
    dsk_safetensors_entry *fe = NULL;
    dsk_safetensors_kv *meta = NULL;
    dsk__st_buf idx;
    int n_items = 0, n_shards = 0, has_format = 0;
    dsk_status s;
    memset(&idx, 0, sizeof idx);
    if (!dir || n < 0 || (n && !entries) || n_kv < 0 || (n_kv && !kv))
        return dsk_set_error(DSK_ERR_ARG, "%s: NULL argument", fn);
    s = dsk__st_hf_items(fn, entries, n, max_shard_bytes ? max_shard_bytes : 5000000000ull, &items, &n_items,
                         &n_shards);
    for (int i = 0; i < n_kv; i++) has_format |= kv[i].key && strcmp(kv[i].key, "format") == 0;
    fe = (dsk_safetensors_entry *)DSK_MALLOC(((size_t)n_items + 1) * sizeof *fe);
    meta = (dsk_safetensors_kv *)DSK_MALLOC(((size_t)n_kv + 2) * sizeof *meta);
    if (s == DSK_OK && (!fe || !meta)) s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
    if (s == DSK_OK) { /* names unique across shards, and the index text, before any file is written */
        if (n_kv) memcpy(meta, kv, (size_t)n_kv * sizeof *meta);
        meta[n_kv].key = "format"; /* what transformers requires of a PyTorch shard */
        meta[n_kv].value = "pt";
        s = dsk__st_hf_index_text(fn, &idx, items, n_items, n_shards);
    }
    for (int k = 0, first = 0; k < n_shards && s == DSK_OK; k++) {
        char shard[64], *path;
        int cnt = 0;
        while (first + cnt < n_items && items[first + cnt].shard == k) {
            fe[cnt].name = items[first + cnt].name;
            fe[cnt].tensor = &items[first + cnt].view;
            cnt++;
        }
        dsk__st_hf_shard_name(shard, sizeof shard, k, n_shards);
        if (!(path = dsk__st_join(dir, shard))) {
            s = dsk_set_error(DSK_ERR_OOM, "%s: out of memory", fn);
            break;
        }
        s = dsk_safetensors_save(ctx, path, fe, cnt, meta, n_kv + !has_format);
        DSK_FREE(path);
        first += cnt;
    }
    if (s == DSK_OK) s = dsk__st_write_small(fn, dir, DSK__ST_HF_INDEX, idx.p, idx.n, DSK__ST_DURABLE);
    if (s == DSK_OK) s = dsk__st_hf_tidy(fn, dir, n_shards);
    for (int i = 0; i < n_items; i++) DSK_FREE(items[i].name);
    DSK_FREE(items);
    DSK_FREE(fe);
    DSK_FREE(meta);
    dsk__st_buf_free(&idx);
    return s;
}

/* ---------------------------------------------------------------- options */

/* Each option in force with a leading space (dsk_ckpt.h lists them after its own). */
#ifdef DSK_SAFETENSORS_NO_SSE42
#define DSK__ST_OPTIONS " DSK_SAFETENSORS_NO_SSE42"
#else
#define DSK__ST_OPTIONS ""
#endif

/* A list of options as the queries return it: without its leading space. */
static const char *dsk__st_options_text(const char *list) { return list[0] ? list + 1 : list; }

DSK_API const char *dsk_safetensors_options(void) { return dsk__st_options_text(DSK__ST_OPTIONS); }

#endif /* DSK_SAFETENSORS_IMPLEMENTATION_DONE */
#endif /* DSK_SAFETENSORS_IMPLEMENTATION */

/* MIT License. Copyright (c) 2026 the dsk authors. Permission is hereby granted, free of
   charge, to any person obtaining a copy of this software, to deal in the software without
   restriction, subject to including this notice. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT
   WARRANTY OF ANY KIND. */
