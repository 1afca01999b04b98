/* cuda_bf16.h - the bfloat16 type and its conversions, for the CPU emulation in tests/cuda_emu. */
#ifndef CUDA_EMU_CUDA_BF16_H
#define CUDA_EMU_CUDA_BF16_H
#include "cuda_fp16.h"
#ifdef __cplusplus
struct __nv_bfloat16 {
    unsigned short x;
};
#include <string.h>
namespace cuda_emu {
unsigned short f32_to_bf16(float f);
/* Inline: the emulated tensor-core products convert every element they read. */
inline float bf16_to_f32(unsigned short h) {
    unsigned int u = (unsigned int)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
} // namespace cuda_emu
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16{cuda_emu::f32_to_bf16(f)}; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 h) { return cuda_emu::bf16_to_f32(h.x); }
#endif
#endif /* CUDA_EMU_CUDA_BF16_H */
