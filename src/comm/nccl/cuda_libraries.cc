// Loading the CUDA driver and NCCL at run time, once per process, from the lists in cuda_libraries.h.
#include "cuda_libraries.h"

#include <dlfcn.h>
#include <link.h>

#include <mutex>

#include "lockstep/error.h"

namespace lockstep::comm::nccl {
namespace {

constexpr const char* kOtherBackends = "the nccl backend reduces GPU memory; for host tensors use any other backend (--backend auto picks one)";

// A library dlopen()ed for good (never closed: its functions are used until the process ends).
struct OpenedLibrary {
  void* handle;
  const char* soname;
};

OpenedLibrary open_library(const char* soname, const char* what) {
  void* handle = ::dlopen(soname, RTLD_NOW | RTLD_GLOBAL);
  if (!handle)
    throw ConfigError(std::string("nccl: cannot load ") + soname + " (" + what + "): " + ::dlerror() + "; " +
                      kOtherBackends);
  return OpenedLibrary{handle, soname};
}

template <class Fn>
void resolve(const OpenedLibrary& library, const char* symbol, Fn& out) {
  out = reinterpret_cast<Fn>(::dlsym(library.handle, symbol));
  if (!out)
    throw ConfigError(std::string("nccl: ") + library.soname + " has no " + symbol +
                      ": it is older than lockstep needs");
}

// One row of a list in cuda_libraries.h: its symbol from `library` into `functions`.
#define LOCKSTEP_RESOLVE(member, symbol) resolve(library, #symbol, functions.member);

CudaDriver load_cuda_driver() {
  const OpenedLibrary library = open_library("libcuda.so.1", "the NVIDIA driver");
  CudaDriver functions{};
  LOCKSTEP_CUDA_DRIVER_FUNCTIONS(LOCKSTEP_RESOLVE)
  if (CUresult r = functions.init(0); r != CUDA_SUCCESS)
    throw ConfigError("nccl: the NVIDIA driver does not start (cuInit: " + std::to_string(static_cast<int>(r)) +
                      "); " + kOtherBackends);
  int count = 0;
  if (functions.device_get_count(&count) != CUDA_SUCCESS || count == 0)
    throw ConfigError(std::string("nccl: the NVIDIA driver sees no GPU (mind CUDA_VISIBLE_DEVICES); ") +
                      kOtherBackends);
  return functions;
}

NcclLibrary load_nccl() {
  const OpenedLibrary library =
      open_library("libnccl.so.2", "NCCL; PyTorch's CUDA wheel carries one, as does the CUDA toolkit");
  NcclLibrary functions{};
  LOCKSTEP_NCCL_FUNCTIONS(LOCKSTEP_RESOLVE)
  return functions;
}

#undef LOCKSTEP_RESOLVE

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
