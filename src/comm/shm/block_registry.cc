// The registry of handed-out shared-memory objects: see block_registry.h.
#include "shm/block_registry.h"

#include <sys/mman.h>

#include <map>
#include <mutex>
#include <utility>

namespace lockstep::comm::shm {

struct BlockRegistry::State {
  struct Entry {
    Mapped mapped;
    void (*on_release)(char* base);
    // The name is still there and this rank removes it when the object goes: no rank has used
    // the object yet, so nobody else will.
    bool removes_name;
  };
  mutable std::mutex mu;
  std::map<const char*, Entry> by_data;  // keyed by the data pointer handed out
  std::uint64_t next_id = 0;

  void remove_name_locked(Entry& e) {
    if (e.removes_name) ::shm_unlink(e.mapped.named.name.c_str());
    e.removes_name = false;
  }

  void release(const char* data) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = by_data.find(data);
    if (it == by_data.end()) return;
    Entry& e = it->second;
    if (e.on_release) e.on_release(e.mapped.base);
    remove_name_locked(e);
    ::munmap(e.mapped.base, e.mapped.mapped_bytes);
    by_data.erase(it);
  }
};

BlockRegistry::BlockRegistry(std::string prefix, bool unlinks_when_mapped_by_all)
    : prefix_(std::move(prefix)),
      unlinks_when_mapped_by_all_(unlinks_when_mapped_by_all),
      state_(std::make_shared<State>()) {}

BlockRegistry::~BlockRegistry() {
  std::lock_guard<std::mutex> lock(state_->mu);
  for (auto& [data, e] : state_->by_data) state_->remove_name_locked(e);
}

BlockRegistry::Named BlockRegistry::next() {
  std::lock_guard<std::mutex> lock(state_->mu);
  const std::uint64_t id = state_->next_id++;
  return Named{id, prefix_ + std::to_string(id)};
}

std::shared_ptr<void> BlockRegistry::hand_out(Mapped mapped, void (*on_release)(char* base)) {
  char* data = mapped.data;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->by_data[data] = State::Entry{std::move(mapped), on_release, true};
  }
  return std::shared_ptr<void>(data, [state = state_](void* p) { state->release(static_cast<char*>(p)); });
}

std::optional<Place> BlockRegistry::find(const void* p, std::size_t bytes) const {
  const char* c = static_cast<const char*>(p);
  std::lock_guard<std::mutex> lock(state_->mu);
  auto it = state_->by_data.upper_bound(c);
  if (it == state_->by_data.begin()) return std::nullopt;
  --it;
  const auto offset = static_cast<std::size_t>(c - it->first);
  if (offset + bytes > it->second.mapped.data_bytes) return std::nullopt;
  return Place{it->second.mapped.named.id, offset};
}

void BlockRegistry::mapped_by_all(std::uint64_t id) {
  std::lock_guard<std::mutex> lock(state_->mu);
  for (auto& [data, e] : state_->by_data) {
    if (e.mapped.named.id != id || !e.removes_name) continue;
    if (unlinks_when_mapped_by_all_) ::shm_unlink(e.mapped.named.name.c_str());
    e.removes_name = false;
  }
}

}  // namespace lockstep::comm::shm
