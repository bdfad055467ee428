// Shared buffers of the shm backend (Communicator::allocate_shared).
//
// Each allocation is a POSIX shared-memory file of its own, "<segment>-<rank>-<id>" with id
// counting the owner's allocations: a 4 KiB header page, then the data. Peers map a buffer by
// name the first time a collective uses it and keep the mapping. The owner unlinks the name
// once every peer has mapped it (after the first collective that used it) or when the buffer
// is released, whichever comes first; only a rank killed between allocating a buffer and its
// first use leaves a file in /dev/shm. Releasing sets a flag in the header page, which peers
// check before each collective on shared buffers to drop their mappings of released ones.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "shm/block_registry.h"

namespace lockstep::comm::shm {

std::string buffer_name(const std::string& segment, int rank, std::uint64_t id);

// This rank's buffers. allocate() runs on the caller's thread, the rest on the progress thread.
// find() and mapped_by_all() (every peer has mapped buffer `id`: its name can go) come with the
// registry, whose destructor unlinks names not yet unlinked; the memory lives on with its pointers.
class OwnBuffers final : public BlockRegistry {
 public:
  OwnBuffers(const std::string& segment, int rank);

  // nullptr, with a warning, when /dev/shm cannot hold `bytes` more.
  std::shared_ptr<void> allocate(std::size_t bytes);
};

// Peers' buffers, mapped on first use. Progress thread only.
class PeerBuffers {
 public:
  explicit PeerBuffers(std::string segment) : segment_(std::move(segment)) {}
  ~PeerBuffers();
  PeerBuffers(const PeerBuffers&) = delete;
  PeerBuffers& operator=(const PeerBuffers&) = delete;

  // Start of rank's buffer `id`; SystemError when it cannot be mapped.
  char* data(int rank, std::uint64_t id);
  // Unmaps buffers their owners released.
  void drop_released();

 private:
  struct Peer {
    char* base;
    std::size_t total;
  };
  std::string segment_;
  std::map<std::pair<int, std::uint64_t>, Peer> maps_;
};

}  // namespace lockstep::comm::shm
