/* cuda_runtime.h - the CUDA runtime API as the CPU emulation in tests/cuda_emu implements it.

   A test double, never part of the library or the examples: the Makefile builds the kernels/ .cu files
   as host C++ against this header (with -DDSK_CUDA_EMU) and links the GPU tests with
   libcuda_emu.a, so every kernel runs in `make test` on a machine without a GPU.

   What C code sees: the runtime entry points dsk and its tests call (devices, memory, copies,
   streams, events, graph capture and replay, errors), with CUDA's names, values and
   semantics. What C++ code sees in addition: the kernel language (__global__, __device__,
   __shared__, threadIdx, blockIdx, blockDim, gridDim, dim3, __syncthreads, warp intrinsics,
   atomics, device math) and cuda_emu_launch, which the launch macro of kernels/dsk_cuda.cuh
   calls instead of <<<...>>>. Every CUDA thread runs as a fiber; the order of the fibers
   between synchronisation points comes from a seed (CUDA_EMU_SEED, printed at start).
   tests/cuda_emu/emu.h describes the machine model and the checks. */
#ifndef CUDA_EMU_CUDA_RUNTIME_H
#define CUDA_EMU_CUDA_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

#define CUDA_EMU 1
#define CUDART_VERSION 13000
#define CUDA_VERSION 13000

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- errors */

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInitializationError = 3,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDevicePointer = 17,
    cudaErrorInvalidMemcpyDirection = 21,
    cudaErrorInvalidDeviceFunction = 98,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorIllegalState = 401,
    cudaErrorNotReady = 600,
    cudaErrorIllegalAddress = 700,
    cudaErrorLaunchOutOfResources = 701,
    cudaErrorHostMemoryAlreadyRegistered = 712,
    cudaErrorHostMemoryNotRegistered = 713,
    cudaErrorIllegalInstruction = 715,
    cudaErrorLaunchFailure = 719,
    cudaErrorNotSupported = 801,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureInvalidated = 901,
    cudaErrorStreamCaptureUnmatched = 903,
    cudaErrorStreamCaptureUnjoined = 904,
    cudaErrorStreamCaptureIsolation = 905,
    cudaErrorStreamCaptureImplicit = 906,
    cudaErrorStreamCaptureWrongThread = 908,
    cudaErrorUnknown = 999
} cudaError_t;
#define cudaErrorInvalidHandle cudaErrorInvalidResourceHandle

const char *cudaGetErrorName(cudaError_t error);
const char *cudaGetErrorString(cudaError_t error); /* for emulator faults: the code's text and what was found */
cudaError_t cudaGetLastError(void);                /* and resets it */
cudaError_t cudaPeekAtLastError(void);

/* ---------------------------------------------------------------- library types */

typedef enum cudaDataType_t {
    CUDA_R_32F = 0,
    CUDA_R_64F = 1,
    CUDA_R_16F = 2,
    CUDA_R_8I = 3,
    CUDA_R_8U = 8,
    CUDA_R_32I = 10,
    CUDA_R_16BF = 14,
    CUDA_R_8F_E4M3 = 28,
    CUDA_R_8F_E5M2 = 29
} cudaDataType_t;
typedef cudaDataType_t cudaDataType;

/* ---------------------------------------------------------------- devices */

typedef struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    size_t sharedMemPerBlock;
    int regsPerBlock;
    int warpSize;
    int maxThreadsPerBlock;
    int maxThreadsDim[3];
    int maxGridSize[3];
    size_t totalConstMem;
    int major;
    int minor;
    int multiProcessorCount;
    int l2CacheSize;
    int maxThreadsPerMultiProcessor;
    size_t sharedMemPerBlockOptin;
    size_t sharedMemPerMultiprocessor;
    int memoryBusWidth;
    int pciBusID;
    int pciDeviceID;
    int unifiedAddressing;
    int managedMemory;
    int concurrentKernels;
    int asyncEngineCount;
    int memoryPoolsSupported;
} cudaDeviceProp;

typedef enum cudaDeviceAttr {
    cudaDevAttrMaxThreadsPerBlock = 1,
    cudaDevAttrMaxBlockDimX = 2,
    cudaDevAttrMaxBlockDimY = 3,
    cudaDevAttrMaxBlockDimZ = 4,
    cudaDevAttrMaxGridDimX = 5,
    cudaDevAttrMaxGridDimY = 6,
    cudaDevAttrMaxGridDimZ = 7,
    cudaDevAttrMaxSharedMemoryPerBlock = 8,
    cudaDevAttrWarpSize = 10,
    cudaDevAttrMultiProcessorCount = 16,
    cudaDevAttrL2CacheSize = 38,
    cudaDevAttrComputeCapabilityMajor = 75,
    cudaDevAttrComputeCapabilityMinor = 76,
    cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
    cudaDevAttrMemoryPoolsSupported = 115
} cudaDeviceAttr;

/* Devices: CUDA_EMU_DEVICES where it is set, else as many as CUDA_VISIBLE_DEVICES lists ("" = none:
   cudaGetDeviceCount then fails with cudaErrorNoDevice, as on a machine without a GPU), else 4. So a
   test can hide a machine's real GPUs (CUDA_VISIBLE_DEVICES empty) and keep emulated ones. */
cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int device);
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device);
/* "0000:NN:00.0" with NN = the emulated device's pciBusID (device + 1). */
cudaError_t cudaDeviceGetPCIBusId(char *pciBusId, int len, int device);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaDeviceReset(void);
cudaError_t cudaDriverGetVersion(int *version);
cudaError_t cudaRuntimeGetVersion(int *version);

/* ---------------------------------------------------------------- streams and events */

typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
#define cudaStreamLegacy ((cudaStream_t)0x1)
#define cudaStreamPerThread ((cudaStream_t)0x2)
#define cudaStreamDefault 0x0
#define cudaStreamNonBlocking 0x1
#define cudaEventDefault 0x0
#define cudaEventBlockingSync 0x1
#define cudaEventDisableTiming 0x2
typedef void (*cudaHostFn_t)(void *user_data);

cudaError_t cudaStreamCreate(cudaStream_t *stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags);
cudaError_t cudaStreamCreateWithPriority(cudaStream_t *stream, unsigned int flags, int priority);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamQuery(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags);
cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void *user_data);
cudaError_t cudaEventCreate(cudaEvent_t *event);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);

/* ---------------------------------------------------------------- memory */

typedef enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4
} cudaMemcpyKind;

typedef enum cudaMemoryType {
    cudaMemoryTypeUnregistered = 0,
    cudaMemoryTypeHost = 1,
    cudaMemoryTypeDevice = 2,
    cudaMemoryTypeManaged = 3
} cudaMemoryType;

typedef struct cudaPointerAttributes {
    cudaMemoryType type;
    int device;
    void *devicePointer;
    void *hostPointer;
} cudaPointerAttributes;

typedef struct CUmemPoolHandle_st *cudaMemPool_t;
typedef enum cudaMemPoolAttr {
    cudaMemPoolReuseFollowEventDependencies = 1,
    cudaMemPoolReuseAllowOpportunistic = 2,
    cudaMemPoolReuseAllowInternalDependencies = 3,
    cudaMemPoolAttrReleaseThreshold = 4,
    cudaMemPoolAttrReservedMemCurrent = 5,
    cudaMemPoolAttrReservedMemHigh = 6,
    cudaMemPoolAttrUsedMemCurrent = 7,
    cudaMemPoolAttrUsedMemHigh = 8
} cudaMemPoolAttr;

#define cudaHostAllocDefault 0x0
#define cudaHostAllocPortable 0x1
#define cudaHostAllocMapped 0x2
#define cudaHostRegisterDefault 0x0
#define cudaMemAttachGlobal 0x1

cudaError_t cudaMalloc(void **ptr, size_t size);
cudaError_t cudaFree(void *ptr); /* waits for the device first, as CUDA does */
cudaError_t cudaMallocAsync(void **ptr, size_t size, cudaStream_t stream);
cudaError_t cudaFreeAsync(void *ptr, cudaStream_t stream);
cudaError_t cudaMallocHost(void **ptr, size_t size);
cudaError_t cudaHostAlloc(void **ptr, size_t size, unsigned int flags);
cudaError_t cudaFreeHost(void *ptr);
cudaError_t cudaHostRegister(void *ptr, size_t size, unsigned int flags);
cudaError_t cudaHostUnregister(void *ptr);
cudaError_t cudaMallocManaged(void **ptr, size_t size, unsigned int flags);
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes *attributes, const void *ptr);
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *pool, int device);
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void *value);
cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void *value);

/* Copies check that each pointer is what the kind says (device memory inside one live
   allocation, or host memory), and fail with cudaErrorInvalidValue otherwise. */
cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, cudaMemcpyKind kind, cudaStream_t stream);
cudaError_t cudaMemset(void *ptr, int value, size_t count);
cudaError_t cudaMemsetAsync(void *ptr, int value, size_t count, cudaStream_t stream);

/* ---------------------------------------------------------------- kernel attributes */

typedef enum cudaFuncAttribute {
    cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
    cudaFuncAttributePreferredSharedMemoryCarveout = 9
} cudaFuncAttribute;
/* A kernel (its address, as the C++ overload passes it) may launch with up to `value` bytes of
   dynamic shared memory (up to sharedMemPerBlockOptin, 227 KiB); without it the limit is 48 KiB. */
cudaError_t cudaFuncSetAttribute(const void *func, cudaFuncAttribute attr, int value);

/* ---------------------------------------------------------------- graphs */

typedef struct CUgraph_st *cudaGraph_t;
typedef struct CUgraphExec_st *cudaGraphExec_t;
typedef struct CUgraphNode_st *cudaGraphNode_t;
typedef enum cudaStreamCaptureMode {
    cudaStreamCaptureModeGlobal = 0,
    cudaStreamCaptureModeThreadLocal = 1,
    cudaStreamCaptureModeRelaxed = 2
} cudaStreamCaptureMode;
typedef enum cudaStreamCaptureStatus {
    cudaStreamCaptureStatusNone = 0,
    cudaStreamCaptureStatusActive = 1,
    cudaStreamCaptureStatusInvalidated = 2
} cudaStreamCaptureStatus;

/* Work issued on a capturing stream (launches, copies, memsets, stream-ordered allocations,
   host functions, cuBLAS and NCCL calls, and streams that join by waiting on an event
   recorded in the capture) is recorded instead of run; a launched graph runs it again in the
   order it was issued. Memory from cudaMallocAsync during capture lives until the graph and
   every graph instantiated from it are destroyed. */
cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *graph);
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus *status);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long flags);
cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long flags);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream);
cudaError_t cudaGraphGetNodes(cudaGraph_t graph, cudaGraphNode_t *nodes, size_t *count);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);

/* ---------------------------------------------------------------- emulator controls (tests only) */

/* Faults are misuses the emulator detected (races it saw, a warp intrinsic with a lane that
   does not take part, an out-of-bounds or host access, a device pointer of the wrong kind).
   Each is printed to stderr as it happens; a program that ends with faults it did not
   acknowledge exits with status 3. Tests that provoke faults on purpose take them here. */
int cuda_emu_fault_count(void);
int cuda_emu_take_faults(void); /* returns the count and resets it */
const char *cuda_emu_last_fault(void);
uint64_t cuda_emu_seed(void);
int64_t cuda_emu_launches(const char *kernel); /* launches of `kernel` so far (run, not just issued) */

#ifdef __cplusplus
} /* extern "C" */
#include "cuda_emu_kernel.h"
#endif

#endif /* CUDA_EMU_CUDA_RUNTIME_H */
