/* cuda_fp16.h - the half type and its conversions, for the CPU emulation in tests/cuda_emu. */
#ifndef CUDA_EMU_CUDA_FP16_H
#define CUDA_EMU_CUDA_FP16_H
#include "cuda_runtime.h"
#ifdef __cplusplus
struct __half {
    unsigned short x;
};
typedef __half half;
namespace cuda_emu {
unsigned short f32_to_f16(float f);
float f16_to_f32(unsigned short h);
} // namespace cuda_emu
inline __half __float2half(float f) { return __half{cuda_emu::f32_to_f16(f)}; }
inline __half __float2half_rn(float f) { return __float2half(f); }
inline float __half2float(__half h) { return cuda_emu::f16_to_f32(h.x); }
#endif
#endif /* CUDA_EMU_CUDA_FP16_H */
