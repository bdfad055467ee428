// The CUDA driver (libcuda.so.1) and NCCL (libnccl.so.2), loaded when the nccl backend is first
// used rather than linked: lockstep builds, and every other backend runs, on machines without a
// GPU or its driver, and a process that already loaded PyTorch's NCCL uses that one (the same
// soname), so there is never a second copy. The headers (cuda.h, nccl.h) are needed to build.
#pragma once

#include <cuda.h>
#include <nccl.h>

#include <string>

namespace lockstep::comm::nccl {

// The functions lockstep calls, one row each: the member that holds it, then the symbol it is
// loaded from, by its ABI name (cuda.h maps cuMemAlloc to cuMemAlloc_v2 ...). The structs below
// and the loaders (cuda_libraries.cc) are both made from these lists.
// clang-format off
#define LOCKSTEP_CUDA_DRIVER_FUNCTIONS(X)              \
  X(init, cuInit)                                      \
  X(get_error_string, cuGetErrorString)                \
  X(device_get_count, cuDeviceGetCount)                \
  X(device_get, cuDeviceGet)                           \
  X(ctx_get_current, cuCtxGetCurrent)                  \
  X(ctx_set_current, cuCtxSetCurrent)                  \
  X(ctx_push_current, cuCtxPushCurrent_v2)             \
  X(ctx_pop_current, cuCtxPopCurrent_v2)               \
  X(ctx_get_device, cuCtxGetDevice)                    \
  X(primary_ctx_retain, cuDevicePrimaryCtxRetain)      \
  X(primary_ctx_release, cuDevicePrimaryCtxRelease_v2) \
  X(stream_create, cuStreamCreate)                     \
  X(stream_destroy, cuStreamDestroy_v2)                \
  X(stream_query, cuStreamQuery)                       \
  X(stream_wait_event, cuStreamWaitEvent)              \
  X(mem_alloc, cuMemAlloc_v2)                          \
  X(mem_free, cuMemFree_v2)                            \
  X(memcpy_htod, cuMemcpyHtoD_v2)                      \
  X(memcpy_dtoh, cuMemcpyDtoH_v2)                      \
  X(memcpy_htod_async, cuMemcpyHtoDAsync_v2)           \
  X(memcpy_dtoh_async, cuMemcpyDtoHAsync_v2)           \
  X(pointer_get_attribute, cuPointerGetAttribute)

#define LOCKSTEP_NCCL_FUNCTIONS(X)                 \
  X(get_version, ncclGetVersion)                   \
  X(get_unique_id, ncclGetUniqueId)                \
  X(comm_init_rank_config, ncclCommInitRankConfig) \
  X(comm_get_async_error, ncclCommGetAsyncError)   \
  X(comm_abort, ncclCommAbort)                     \
  X(comm_destroy, ncclCommDestroy)                 \
  X(get_error_string, ncclGetErrorString)          \
  X(get_last_error, ncclGetLastError)              \
  X(all_reduce, ncclAllReduce)                     \
  X(broadcast, ncclBroadcast)                      \
  X(all_gather, ncclAllGather)                     \
  X(reduce_scatter, ncclReduceScatter)
// clang-format on

#define LOCKSTEP_FUNCTION_MEMBER(member, symbol) decltype(&::symbol) member;

struct CudaDriver {
  LOCKSTEP_CUDA_DRIVER_FUNCTIONS(LOCKSTEP_FUNCTION_MEMBER)
};

struct NcclLibrary {
  LOCKSTEP_NCCL_FUNCTIONS(LOCKSTEP_FUNCTION_MEMBER)
};

#undef LOCKSTEP_FUNCTION_MEMBER

// Loaded once per process (cuInit called); throws ConfigError saying what is missing (no NVIDIA
// driver, no GPU, no NCCL) and what to use instead.
const CudaDriver& cuda_driver();
const NcclLibrary& nccl_library();

// Whether `p` is GPU memory: false in a process that has not loaded the NVIDIA driver (which
// then holds none), so asking costs a CPU-only program nothing but a lookup.
bool is_gpu_memory(const void* p);

// "CUDA_ERROR_OUT_OF_MEMORY: out of memory" for a driver result.
std::string cuda_error_text(CUresult result);

}  // namespace lockstep::comm::nccl
