// The CUDA driver (libcuda.so.1) and NCCL (libnccl.so.2), loaded when the nccl backend is first
// used rather than linked: lockstep builds, and every other backend runs, on machines without a
// GPU or its driver, and a process that already loaded PyTorch's NCCL uses that one (the same
// soname), so there is never a second copy. The headers (cuda.h, nccl.h) are needed to build.
#pragma once

#include <cuda.h>
#include <nccl.h>

#include <string>

namespace lockstep::comm::nccl {

// The functions lockstep calls, by their ABI names (cuda.h maps cuMemAlloc to cuMemAlloc_v2 ...).
struct CudaDriver {
  decltype(&::cuInit) init;
  decltype(&::cuGetErrorString) get_error_string;
  decltype(&::cuDeviceGetCount) device_get_count;
  decltype(&::cuDeviceGet) device_get;
  decltype(&::cuCtxGetCurrent) ctx_get_current;
  decltype(&::cuCtxSetCurrent) ctx_set_current;
  decltype(&::cuCtxPushCurrent_v2) ctx_push_current;
  decltype(&::cuCtxPopCurrent_v2) ctx_pop_current;
  decltype(&::cuCtxGetDevice) ctx_get_device;
  decltype(&::cuDevicePrimaryCtxRetain) primary_ctx_retain;
  decltype(&::cuDevicePrimaryCtxRelease_v2) primary_ctx_release;
  decltype(&::cuStreamCreate) stream_create;
  decltype(&::cuStreamDestroy_v2) stream_destroy;
  decltype(&::cuStreamQuery) stream_query;
  decltype(&::cuStreamWaitEvent) stream_wait_event;
  decltype(&::cuMemAlloc_v2) mem_alloc;
  decltype(&::cuMemFree_v2) mem_free;
  decltype(&::cuMemcpyHtoD_v2) memcpy_htod;
  decltype(&::cuMemcpyDtoH_v2) memcpy_dtoh;
  decltype(&::cuMemcpyHtoDAsync_v2) memcpy_htod_async;
  decltype(&::cuMemcpyDtoHAsync_v2) memcpy_dtoh_async;
  decltype(&::cuPointerGetAttribute) pointer_get_attribute;
};

struct NcclLibrary {
  decltype(&::ncclGetVersion) get_version;
  decltype(&::ncclGetUniqueId) get_unique_id;
  decltype(&::ncclCommInitRankConfig) comm_init_rank_config;
  decltype(&::ncclCommGetAsyncError) comm_get_async_error;
  decltype(&::ncclCommAbort) comm_abort;
  decltype(&::ncclCommDestroy) comm_destroy;
  decltype(&::ncclGetErrorString) get_error_string;
  decltype(&::ncclGetLastError) get_last_error;
  decltype(&::ncclAllReduce) all_reduce;
  decltype(&::ncclBroadcast) broadcast;
  decltype(&::ncclAllGather) all_gather;
  decltype(&::ncclReduceScatter) reduce_scatter;
};

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
