// Shared buffers: this rank's, made here and kept by the registry, and its peers', mapped on first
// use (shm_buffers.h).
#include "shm/shm_buffers.h"

#include "shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
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

// "<segment>-<rank>-": the names of a rank's buffers, less the id.
std::string buffer_prefix(const std::string& segment, int rank) {
  return segment + "-" + std::to_string(rank) + "-";
}

}  // namespace

std::string buffer_name(const std::string& segment, int rank, std::uint64_t id) {
  return buffer_prefix(segment, rank) + std::to_string(id);
}

OwnBuffers::OwnBuffers(const std::string& segment, int rank)
    : BlockRegistry(buffer_prefix(segment, rank), true) {}

std::shared_ptr<void> OwnBuffers::allocate(std::size_t bytes) {
  Named named = next();
  std::size_t total = kHeaderBytes + (std::max<std::size_t>(bytes, 1) + 4095) / 4096 * 4096;
  const shm::Mapping m = create_segment(named.name, total);
  if (!m.base) {
    LOCKSTEP_LOG(warn, shm) << "cannot " << m.what << " a shared buffer of " << bytes << " bytes ("
                            << named.name << "): " << std::strerror(m.error)
                            << "; using private memory and staged copies instead (is /dev/shm large enough?)";
    return nullptr;
  }
  char* base = static_cast<char*>(m.base);
  new (header_of(base)) BufferHeader{};
  return hand_out(Mapped{std::move(named), base, m.bytes, base + kHeaderBytes, bytes},
                  [](char* released) { header_of(released)->released.store(1, std::memory_order_release); });
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
