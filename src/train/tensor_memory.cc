#include "lockstep/train/tensor_memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include "lockstep/ddp/torch_compat.h"

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace lockstep::train {
namespace {

std::atomic<std::int64_t> g_current{0}, g_peak{0};
std::atomic<bool> g_installed{false};

void add(std::int64_t bytes) {
  const std::int64_t now = g_current.fetch_add(bytes) + bytes;
  std::int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}

// Sizes of the live counted allocations, by address. libtorch's raw allocation interface needs a
// DataPtr whose context is its data pointer, so the size cannot travel in the context.
struct Live {
  std::mutex mutex;
  std::unordered_map<void*, std::int64_t> bytes;
};
Live& live() {
  static auto* l = new Live;  // never destroyed: tensors may be freed during static teardown
  return *l;
}

c10::Allocator* g_inner = nullptr;

void release(void* data) {
  if (data == nullptr) return;
  std::int64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(live().mutex);
    auto it = live().bytes.find(data);
    if (it != live().bytes.end()) {
      bytes = it->second;
      live().bytes.erase(it);
    }
  }
  g_current.fetch_sub(bytes);
  g_inner->raw_deallocate(data);
}

class CountingAllocator final : public torch_compat::Allocator {
 protected:
  c10::DataPtr allocate_bytes(std::size_t n) const override {
    void* data = g_inner->raw_allocate(n);
    if (data != nullptr) {
      std::lock_guard<std::mutex> lock(live().mutex);
      live().bytes.emplace(data, static_cast<std::int64_t>(n));
    }
    if (data != nullptr) add(static_cast<std::int64_t>(n));
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
 public:
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
};

}  // namespace

void track_tensor_memory() {
  static std::once_flag once;
  std::call_once(once, [] {
    c10::Allocator* inner = c10::GetCPUAllocator();
    if (inner->raw_deleter() == nullptr) return;  // an allocator we cannot wrap: stay untracked
    g_inner = inner;
    static CountingAllocator counting;
    c10::SetCPUAllocator(&counting, /*priority=*/1);
    g_installed = true;
  });
}

bool tensor_memory_tracked() {
  return g_installed.load();
}

std::int64_t tensor_bytes() {
  return g_current.load();
}

std::int64_t peak_tensor_bytes() {
  return g_peak.load();
}

void reset_peak_tensor_bytes() {
  g_peak.store(g_current.load());
}

}  // namespace lockstep::train
