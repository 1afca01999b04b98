/* cub.cpp - cub::DeviceRadixSort of the CUDA emulation: a stable LSD radix sort (8-bit
   digits) of (key, value) pairs on bits [begin_bit, end_bit) of the keys, in cub's order
   (signed keys with the sign bit flipped, floats by their total order), as a stream
   operation. The temporary storage must be as large as the size query said; it is
   scribbled on, as a real sort would. */
#include "emu.h"
#include "cub/cub.cuh"

#include <string.h>
#include <vector>

namespace cuda_emu {

namespace {

uint64_t sortable(const char *k, size_t size, int kind) {
    uint64_t u = 0, sign = (uint64_t)1 << (size * 8 - 1);
    memcpy(&u, k, size); /* little-endian: the low bytes */
    if (kind == SORT_SIGNED) u ^= sign;
    else if (kind == SORT_FLOAT) u = (u & sign) ? ~u & (size == 8 ? ~(uint64_t)0 : ((uint64_t)1 << (size * 8)) - 1) : u | sign;
    return u;
}

struct sort_job {
    const char *kin, *vin;
    char *kout, *vout, *temp;
    size_t ksz, vsz, temp_bytes;
    long long n;
    int kind, begin, end;
};

void run_sort(const sort_job &j) {
    size_t n = (size_t)j.n;
    std::vector<uint64_t> key(n), key2(n);
    std::vector<size_t> idx(n), idx2(n);
    for (size_t i = 0; i < n; i++) {
        key[i] = sortable(j.kin + i * j.ksz, j.ksz, j.kind);
        idx[i] = i;
    }
    for (int shift = j.begin; shift < j.end; shift += 8) {
        int bits = j.end - shift < 8 ? j.end - shift : 8;
        uint64_t mask = ((uint64_t)1 << bits) - 1;
        size_t count[257] = {0};
        for (size_t i = 0; i < n; i++) count[((key[i] >> shift) & mask) + 1]++;
        for (int d = 0; d < 256; d++) count[d + 1] += count[d];
        for (size_t i = 0; i < n; i++) {
            size_t to = count[(key[i] >> shift) & mask]++;
            key2[to] = key[i];
            idx2[to] = idx[i];
        }
        key.swap(key2);
        idx.swap(idx2);
    }
    memset(j.temp, 0xab, j.temp_bytes);
    {
        std::vector<char> kk(n * j.ksz), vv(n * j.vsz); /* outputs may alias the inputs */
        for (size_t i = 0; i < n; i++) {
            memcpy(&kk[i * j.ksz], j.kin + idx[i] * j.ksz, j.ksz);
            if (j.vsz) memcpy(&vv[i * j.vsz], j.vin + idx[i] * j.vsz, j.vsz);
        }
        if (n) memcpy(j.kout, kk.data(), kk.size());
        if (n && j.vsz) memcpy(j.vout, vv.data(), vv.size());
    }
}

} // namespace

cudaError_t radix_sort_pairs(void *temp, size_t *temp_bytes, const void *keys_in, void *keys_out, size_t key_size, int key_kind,
                             const void *vals_in, void *vals_out, size_t val_size, long long n, int begin_bit, int end_bit,
                             cudaStream_t sh) {
    const char *fn = "cub::DeviceRadixSort";
    size_t need = (size_t)(n > 0 ? n : 0) * (key_size + val_size) + 4096;
    cudaError_t e;
    stream *s;
    ensure_init();
    if (!temp_bytes) return fail(cudaErrorInvalidValue, "%s: temp_storage_bytes is NULL", fn);
    if (!temp) {
        *temp_bytes = need;
        return cudaSuccess;
    }
    if (n < 0 || begin_bit < 0 || end_bit < begin_bit || end_bit > (int)(8 * key_size))
        return fail(cudaErrorInvalidValue, "%s: %lld items, bits [%d, %d) of %zu-byte keys", fn, n, begin_bit, end_bit, key_size);
    if (*temp_bytes < need) {
        fault("%s: %zu bytes of temporary storage where the size query asked for %zu", fn, *temp_bytes, need);
        return fail(cudaErrorInvalidValue, "%s: temporary storage too small", fn);
    }
    if (!(s = get_stream(sh, &e))) return fail(e, "%s: stream %p is not a live stream", fn, (void *)sh);
    {
        int d = stream_device(s);
        size_t nk = (size_t)n * key_size, nv = (size_t)n * val_size;
        if (!device_range_ok("cub::DeviceRadixSort temporary storage", temp, need, d) ||
            !device_range_ok("cub::DeviceRadixSort keys in", keys_in, nk, d) || !device_range_ok("cub::DeviceRadixSort keys out", keys_out, nk, d) ||
            (val_size && (!device_range_ok("cub::DeviceRadixSort values in", vals_in, nv, d) ||
                          !device_range_ok("cub::DeviceRadixSort values out", vals_out, nv, d))))
            return fail(cudaErrorInvalidValue, "%s: %s", fn, cuda_emu_last_fault());
    }
    sort_job j{(const char *)keys_in, (const char *)vals_in, (char *)keys_out, (char *)vals_out, (char *)temp, key_size, val_size,
               need, n, key_kind, begin_bit, end_bit};
    return issue_op(s, fn, [j]() { run_sort(j); });
}

} // namespace cuda_emu
