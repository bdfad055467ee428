// The POSIX shared-memory objects this rank mapped to hand out as memory: the shm backend's shared
// buffers (shm_buffers.h) and its machine blocks (machine_blocks.h) are both one of these, and
// differ only in how they make an object and what they do when they cannot.
//
// Each object is named "<prefix><id>", with id counting the registry's allocations. The registry
// finds an object by address (collectives check that ranks name the same place), removes its name
// once every rank has mapped it, and unmaps it when the last copy of the pointer handed out goes;
// a name still there when the registry goes is removed then. The memory lives on with its
// pointers.
//
// Threading: every member may be called from any thread; one mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace lockstep::comm::shm {

// Where an address lies: which object, and how many bytes from the start of its data.
struct Place {
  std::uint64_t id;
  std::size_t offset;
};

class BlockRegistry {
 public:
  // `unlinks_when_mapped_by_all`: whether this rank removes a name once every rank mapped the
  // object (each rank for its own buffers; rank 0 alone for the blocks all ranks make together).
  BlockRegistry(std::string prefix, bool unlinks_when_mapped_by_all);
  ~BlockRegistry();
  BlockRegistry(const BlockRegistry&) = delete;
  BlockRegistry& operator=(const BlockRegistry&) = delete;

  // The object holding [p, p + bytes), if any.
  std::optional<Place> find(const void* p, std::size_t bytes = 1) const;
  // Every rank has mapped object `id`: its name can go (again is a no-op).
  void mapped_by_all(std::uint64_t id);

 protected:
  struct Named {
    std::uint64_t id;
    std::string name;
  };
  // The next object's id and name.
  Named next();

  struct Mapped {
    Named named;
    char* base;                // the mapping
    std::size_t mapped_bytes;  // its length
    char* data;                // what is handed out, inside it
    std::size_t data_bytes;    // how much of it find() answers for
  };
  // Registers a mapped object and hands out its data. When the last copy of the pointer goes,
  // `on_release` (if any) runs on the mapping, the name is removed if it is still there, and the
  // object is unmapped.
  std::shared_ptr<void> hand_out(Mapped mapped, void (*on_release)(char* base));

 private:
  struct State;
  std::string prefix_;
  bool unlinks_when_mapped_by_all_;
  std::shared_ptr<State> state_;
};

}  // namespace lockstep::comm::shm
