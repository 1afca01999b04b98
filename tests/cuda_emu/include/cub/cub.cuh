/* cub/cub.cuh - cub::DeviceRadixSort as the CPU emulation in tests/cuda_emu implements it:
   a stable LSD radix sort of (key, value) pairs on bits [begin_bit, end_bit) of the keys,
   run in order on `stream`, with cub's calling convention (a NULL temp_storage asks for
   the temporary size, which the real call then checks and uses). */
#ifndef CUDA_EMU_CUB_CUH
#define CUDA_EMU_CUB_CUH

#include "../cuda_runtime.h"
#include <type_traits>

namespace cuda_emu {
enum sort_key_kind { SORT_UNSIGNED, SORT_SIGNED, SORT_FLOAT };
cudaError_t radix_sort_pairs(void *temp, size_t *temp_bytes, const void *keys_in, void *keys_out, size_t key_size, int key_kind,
                             const void *vals_in, void *vals_out, size_t val_size, long long n, int begin_bit, int end_bit,
                             cudaStream_t stream);
template <class K> constexpr int sort_kind() {
    return std::is_floating_point<K>::value ? SORT_FLOAT : std::is_signed<K>::value ? SORT_SIGNED : SORT_UNSIGNED;
}
} // namespace cuda_emu

namespace cub {
struct DeviceRadixSort {
    template <class K, class V, class N>
    static cudaError_t SortPairs(void *d_temp_storage, size_t &temp_storage_bytes, const K *d_keys_in, K *d_keys_out,
                                 const V *d_values_in, V *d_values_out, N num_items, int begin_bit = 0,
                                 int end_bit = (int)sizeof(K) * 8, cudaStream_t stream = 0) {
        static_assert(std::is_arithmetic<K>::value, "cub::DeviceRadixSort keys are arithmetic");
        return cuda_emu::radix_sort_pairs(d_temp_storage, &temp_storage_bytes, d_keys_in, d_keys_out, sizeof(K),
                                          cuda_emu::sort_kind<K>(), d_values_in, d_values_out, sizeof(V), (long long)num_items,
                                          begin_bit, end_bit, stream);
    }
    template <class K, class N>
    static cudaError_t SortKeys(void *d_temp_storage, size_t &temp_storage_bytes, const K *d_keys_in, K *d_keys_out, N num_items,
                                int begin_bit = 0, int end_bit = (int)sizeof(K) * 8, cudaStream_t stream = 0) {
        static_assert(std::is_arithmetic<K>::value, "cub::DeviceRadixSort keys are arithmetic");
        return cuda_emu::radix_sort_pairs(d_temp_storage, &temp_storage_bytes, d_keys_in, d_keys_out, sizeof(K),
                                          cuda_emu::sort_kind<K>(), nullptr, nullptr, 0, (long long)num_items, begin_bit, end_bit,
                                          stream);
    }
};
} // namespace cub

#endif /* CUDA_EMU_CUB_CUH */
