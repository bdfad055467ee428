#include "shm/shm_buffers.h"

#include "shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "lockstep/base/log.h"
#include "lockstep/error.h"

namespace lockstep::comm::shm {
namespace {

constexpr std::size_t kHeaderBytes = 4096;  // keeps the data page-aligned

struct BufferHeader {
  std::atomic<std::uint32_t> released;
};

BufferHeader* header_of(char* base) {
  return reinterpret_cast<BufferHeader*>(base);
}

}  // namespace

std::string buffer_name(const std::string& segment, int rank, std::uint64_t id) {
  return segment + "-" + std::to_string(rank) + "-" + std::to_string(id);
}

struct OwnBuffers::State {
  struct Entry {
    std::uint64_t id;
    char* base;
    std::size_t total, bytes;
    std::string name;
    bool linked;
  };
  mutable std::mutex mu;
  std::map<const char*, Entry> by_data;  // keyed by the data pointer handed out

  void release(const char* data) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = by_data.find(data);
    if (it == by_data.end()) return;
    auto& e = it->second;
    header_of(e.base)->released.store(1, std::memory_order_release);
    if (e.linked) ::shm_unlink(e.name.c_str());
    ::munmap(e.base, e.total);
    by_data.erase(it);
  }
};

OwnBuffers::OwnBuffers(std::string segment, int rank)
    : segment_(std::move(segment)), rank_(rank), state_(std::make_shared<State>()) {}

OwnBuffers::~OwnBuffers() {
  std::lock_guard<std::mutex> lock(state_->mu);
  for (auto& [data, e] : state_->by_data) {
    if (e.linked) ::shm_unlink(e.name.c_str());
    e.linked = false;
  }
}

std::shared_ptr<void> OwnBuffers::allocate(std::size_t bytes) {
  std::uint64_t id;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    id = next_id_++;
  }
  std::string name = buffer_name(segment_, rank_, id);
  std::size_t total = kHeaderBytes + (std::max<std::size_t>(bytes, 1) + 4095) / 4096 * 4096;
  auto fail = [&](const char* what, int error) -> std::shared_ptr<void> {
    LOCKSTEP_LOG(warn, shm) << "cannot " << what << " a shared buffer of " << bytes << " bytes (" << name
                            << "): " << std::strerror(error)
                            << "; using private memory and staged copies instead (is /dev/shm large enough?)";
    return nullptr;
  };
  const shm::Mapping m = create_segment(name, total);
  if (!m.base) return fail(m.what.c_str(), m.error);
  void* base = m.base;
  total = m.bytes;
  char* b = static_cast<char*>(base);
  new (header_of(b)) BufferHeader{};
  char* data = b + kHeaderBytes;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->by_data[data] = State::Entry{id, b, total, bytes, name, true};
  }
  return std::shared_ptr<void>(data, [state = state_](void* p) { state->release(static_cast<char*>(p)); });
}

std::optional<OwnBuffers::Found> OwnBuffers::find(const void* p, std::size_t bytes) const {
  const char* c = static_cast<const char*>(p);
  std::lock_guard<std::mutex> lock(state_->mu);
  auto it = state_->by_data.upper_bound(c);
  if (it == state_->by_data.begin()) return std::nullopt;
  --it;
  std::size_t offset = static_cast<std::size_t>(c - it->first);
  if (offset + bytes > it->second.bytes) return std::nullopt;
  return Found{it->second.id, offset};
}

void OwnBuffers::mapped_by_all(std::uint64_t id) {
  std::lock_guard<std::mutex> lock(state_->mu);
  for (auto& [data, e] : state_->by_data) {
    if (e.id != id) continue;
    if (e.linked) ::shm_unlink(e.name.c_str());
    e.linked = false;
  }
}

PeerBuffers::~PeerBuffers() {
  for (auto& [key, m] : maps_) ::munmap(m.base, m.total);
}

char* PeerBuffers::data(int rank, std::uint64_t id) {
  auto key = std::make_pair(rank, id);
  auto it = maps_.find(key);
  if (it != maps_.end()) return it->second.base + kHeaderBytes;
  std::string name = buffer_name(segment_, rank, id);
  const shm::Mapping m = open_segment(name);
  if (!m.base)
    throw SystemError("shm: rank " + std::to_string(rank) + "'s shared buffer: " + describe_failure(m, name, 0));
  void* base = m.base;
  maps_[key] = Peer{static_cast<char*>(base), m.bytes};
  return static_cast<char*>(base) + kHeaderBytes;
}

void PeerBuffers::drop_released() {
  for (auto it = maps_.begin(); it != maps_.end();) {
    if (header_of(it->second.base)->released.load(std::memory_order_acquire)) {
      ::munmap(it->second.base, it->second.total);
      it = maps_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace lockstep::comm::shm
