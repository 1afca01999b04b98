/* kernels/dsk_cuda.cuh - what every kernels/ .cu file shares.
   DSK__CUDA_KERNEL is the one spelling of a kernel launch: kernel<<<grid, block, shmem,
   stream>>>(args...) under nvcc, a call of cuda_emu_launch when the file is compiled as host
   C++ against the CPU emulation in tests/cuda_emu (DSK_CUDA_EMU). */
#ifndef DSK_CUDA_CUH
#define DSK_CUDA_CUH

#include <cuda_runtime.h>

#ifdef DSK_CUDA_EMU
#define DSK__CUDA_KERNEL(kernel, grid, block, shmem, stream, ...) \
    cuda_emu_launch(#kernel, kernel, dim3(grid), dim3(block), (shmem), (stream), __VA_ARGS__)
#else
#define DSK__CUDA_KERNEL(kernel, grid, block, shmem, stream, ...) kernel<<<(grid), (block), (shmem), (stream)>>>(__VA_ARGS__)
#endif

#endif /* DSK_CUDA_CUH */
