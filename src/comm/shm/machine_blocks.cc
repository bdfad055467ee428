#include "shm/machine_blocks.h"

#include <sys/mman.h>

#include <map>
#include <mutex>

#include "lockstep/error.h"
#include "shm/segment.h"

namespace lockstep::comm::shm {

struct MachineBlocks::State {
  struct Block {
    std::uint64_t id;
    std::size_t bytes;
    std::string name;
    bool unused;  // no collective used it yet: this rank removes its name when it goes
  };
  std::mutex mu;
  std::map<const char*, Block> by_base;

  // A block never used is nobody else's concern: whichever rank drops it removes the name (a rank
  // that comes later makes the object anew, and removes it in turn).
  void drop_name_locked(Block& b) {
    if (b.unused) ::shm_unlink(b.name.c_str());
    b.unused = false;
  }
};

MachineBlocks::MachineBlocks(std::string segment, int rank)
    : segment_(std::move(segment)), rank_(rank), state_(std::make_shared<State>()) {}

MachineBlocks::~MachineBlocks() {
  std::lock_guard<std::mutex> lock(state_->mu);
  for (auto& [base, block] : state_->by_base) state_->drop_name_locked(block);
}

std::shared_ptr<void> MachineBlocks::allocate(std::size_t bytes) {
  const std::uint64_t id = next_id_++;
  const std::string name = segment_ + "-machine-" + std::to_string(id);
  const Mapping m = open_or_create_segment(name, bytes);
  if (!m.base) {
    ::shm_unlink(name.c_str());
    throw SystemError("machine memory: " + describe_failure(m, name, bytes));
  }
  char* base = static_cast<char*>(m.base);
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->by_base[base] = State::Block{id, m.bytes, name, true};
  }
  return std::shared_ptr<void>(base, [state = state_](void* p) {
    std::lock_guard<std::mutex> lock(state->mu);
    auto it = state->by_base.find(static_cast<const char*>(p));
    if (it == state->by_base.end()) return;
    state->drop_name_locked(it->second);
    ::munmap(p, it->second.bytes);
    state->by_base.erase(it);
  });
}

std::optional<MachineBlocks::Place> MachineBlocks::find(const void* p) const {
  const char* c = static_cast<const char*>(p);
  std::lock_guard<std::mutex> lock(state_->mu);
  auto it = state_->by_base.upper_bound(c);
  if (it == state_->by_base.begin()) return std::nullopt;
  --it;
  const auto offset = static_cast<std::size_t>(c - it->first);
  if (offset >= it->second.bytes) return std::nullopt;
  return Place{it->second.id, offset};
}

void MachineBlocks::used_by_all(std::uint64_t id) {
  std::lock_guard<std::mutex> lock(state_->mu);
  for (auto& [base, block] : state_->by_base)
    if (block.id == id && block.unused) {
      if (rank_ == 0) ::shm_unlink(block.name.c_str());
      block.unused = false;
    }
}

}  // namespace lockstep::comm::shm
