#include "cuda_libraries.h"

#include <dlfcn.h>
#include <link.h>

#include <mutex>

#include "lockstep/error.h"

namespace lockstep::comm::nccl {
namespace {

constexpr const char* kOtherBackends = "the nccl backend reduces GPU memory; for host tensors use any other backend (--backend auto picks one)";

void* open_library(const char* soname, const char* what) {
  void* handle = ::dlopen(soname, RTLD_NOW | RTLD_GLOBAL);
  if (!handle)
    throw ConfigError(std::string("nccl: cannot load ") + soname + " (" + what + "): " + ::dlerror() + "; " +
                      kOtherBackends);
  return handle;
}

template <class Fn>
void resolve(void* handle, const char* soname, const char* symbol, Fn& out) {
  out = reinterpret_cast<Fn>(::dlsym(handle, symbol));
  if (!out)
    throw ConfigError(std::string("nccl: ") + soname + " has no " + symbol + ": it is older than lockstep needs");
}

CudaDriver load_cuda_driver() {
  constexpr const char* kSoname = "libcuda.so.1";
  void* h = open_library(kSoname, "the NVIDIA driver");
  CudaDriver d{};
  resolve(h, kSoname, "cuInit", d.init);
  resolve(h, kSoname, "cuGetErrorString", d.get_error_string);
  resolve(h, kSoname, "cuDeviceGetCount", d.device_get_count);
  resolve(h, kSoname, "cuDeviceGet", d.device_get);
  resolve(h, kSoname, "cuCtxGetCurrent", d.ctx_get_current);
  resolve(h, kSoname, "cuCtxSetCurrent", d.ctx_set_current);
  resolve(h, kSoname, "cuCtxPushCurrent_v2", d.ctx_push_current);
  resolve(h, kSoname, "cuCtxPopCurrent_v2", d.ctx_pop_current);
  resolve(h, kSoname, "cuCtxGetDevice", d.ctx_get_device);
  resolve(h, kSoname, "cuDevicePrimaryCtxRetain", d.primary_ctx_retain);
  resolve(h, kSoname, "cuDevicePrimaryCtxRelease_v2", d.primary_ctx_release);
  resolve(h, kSoname, "cuStreamCreate", d.stream_create);
  resolve(h, kSoname, "cuStreamDestroy_v2", d.stream_destroy);
  resolve(h, kSoname, "cuStreamQuery", d.stream_query);
  resolve(h, kSoname, "cuStreamWaitEvent", d.stream_wait_event);
  resolve(h, kSoname, "cuMemAlloc_v2", d.mem_alloc);
  resolve(h, kSoname, "cuMemFree_v2", d.mem_free);
  resolve(h, kSoname, "cuMemcpyHtoD_v2", d.memcpy_htod);
  resolve(h, kSoname, "cuMemcpyDtoH_v2", d.memcpy_dtoh);
  resolve(h, kSoname, "cuMemcpyHtoDAsync_v2", d.memcpy_htod_async);
  resolve(h, kSoname, "cuMemcpyDtoHAsync_v2", d.memcpy_dtoh_async);
  resolve(h, kSoname, "cuPointerGetAttribute", d.pointer_get_attribute);
  if (CUresult r = d.init(0); r != CUDA_SUCCESS)
    throw ConfigError("nccl: the NVIDIA driver does not start (cuInit: " + std::to_string(static_cast<int>(r)) +
                      "); " + kOtherBackends);
  int count = 0;
  if (d.device_get_count(&count) != CUDA_SUCCESS || count == 0)
    throw ConfigError(std::string("nccl: the NVIDIA driver sees no GPU (mind CUDA_VISIBLE_DEVICES); ") +
                      kOtherBackends);
  return d;
}

NcclLibrary load_nccl() {
  constexpr const char* kSoname = "libnccl.so.2";
  void* h = open_library(kSoname, "NCCL; PyTorch's CUDA wheel carries one, as does the CUDA toolkit");
  NcclLibrary n{};
  resolve(h, kSoname, "ncclGetVersion", n.get_version);
  resolve(h, kSoname, "ncclGetUniqueId", n.get_unique_id);
  resolve(h, kSoname, "ncclCommInitRankConfig", n.comm_init_rank_config);
  resolve(h, kSoname, "ncclCommGetAsyncError", n.comm_get_async_error);
  resolve(h, kSoname, "ncclCommAbort", n.comm_abort);
  resolve(h, kSoname, "ncclCommDestroy", n.comm_destroy);
  resolve(h, kSoname, "ncclGetErrorString", n.get_error_string);
  resolve(h, kSoname, "ncclGetLastError", n.get_last_error);
  resolve(h, kSoname, "ncclAllReduce", n.all_reduce);
  resolve(h, kSoname, "ncclBroadcast", n.broadcast);
  resolve(h, kSoname, "ncclAllGather", n.all_gather);
  resolve(h, kSoname, "ncclReduceScatter", n.reduce_scatter);
  return n;
}

// Loads once; a failure is remembered and rethrown, so every caller gets the same reason.
template <class Library>
const Library& load_once(Library (*load)()) {
  static std::once_flag once;
  static Library library{};
  static std::exception_ptr failure;
  std::call_once(once, [&] {
    try {
      library = load();
    } catch (...) {
      failure = std::current_exception();
    }
  });
  if (failure) std::rethrow_exception(failure);
  return library;
}

}  // namespace

const CudaDriver& cuda_driver() { return load_once(&load_cuda_driver); }
const NcclLibrary& nccl_library() { return load_once(&load_nccl); }

namespace {

// The number of libraries this process has loaded so far (glibc counts them): reading it takes
// ~20 ns, where asking the loader for libcuda.so.1 by name takes ~25 us.
unsigned long long libraries_loaded() {
  unsigned long long adds = 0;
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* out) {
        *static_cast<unsigned long long*>(out) = info->dlpi_adds;
        return 1;  // the counter is on every entry: the first will do
      },
      &adds);
  return adds;
}

// Whether the NVIDIA driver is loaded in this process, asked again only after a library was.
bool driver_loaded() {
  static std::mutex mu;
  static unsigned long long asked_at = ~0ull;
  static bool loaded = false;
  std::lock_guard<std::mutex> lock(mu);
  if (loaded) return true;
  const unsigned long long adds = libraries_loaded();
  if (adds == asked_at) return false;
  asked_at = adds;
  if (void* handle = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD)) {
    ::dlclose(handle);
    loaded = true;
  }
  return loaded;
}

}  // namespace

bool is_gpu_memory(const void* p) {
  if (!p || !driver_loaded()) return false;
  // Loaded, but starting no GPU: nothing can be GPU memory. Found out once.
  static const CudaDriver* const driver = []() -> const CudaDriver* {
    try {
      return &cuda_driver();
    } catch (const ConfigError&) {
      return nullptr;
    }
  }();
  if (!driver) return false;
  unsigned type = 0;
  return driver->pointer_get_attribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, reinterpret_cast<CUdeviceptr>(p)) ==
             CUDA_SUCCESS &&
         type == CU_MEMORYTYPE_DEVICE;
}

std::string cuda_error_text(CUresult result) {
  const char* text = nullptr;
  if (cuda_driver().get_error_string(result, &text) != CUDA_SUCCESS || !text) text = "unknown error";
  return "CUDA error " + std::to_string(static_cast<int>(result)) + ": " + text;
}

}  // namespace lockstep::comm::nccl
