// Machine memory on the shm backend (Communicator::allocate_machine_memory): blocks that every
// rank of the segment maps at once, so data every rank of a machine reads is held there once.
//
// The k-th allocation of every rank is one POSIX shared-memory object, "<segment>-machine-<k>":
// whichever rank comes first makes it, each sizes and reserves it (the same size, so the others'
// calls change nothing), and nobody waits for anybody. Collectives find a block by address to
// check that the ranks of a machine name the same place of the same block. Rank 0 unlinks a
// block's name once every rank has mapped it: the communicator says so right after allocating
// (its all-or-none vote), and the first collective that uses the block proves it again; a block
// dropped before either has its name removed by each rank that drops it. A worker killed in
// between leaves a name the launcher removes (it starts with the segment's, which names rank 0's
// pid).
//
// Threading: allocate() on the caller's thread, the rest on the progress thread; one mutex.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "shm/block_registry.h"

namespace lockstep::comm::shm {

// find() and mapped_by_all() (every rank has mapped block `id`: rank 0 unlinks its name; every
// rank calls it) come with the registry.
class MachineBlocks final : public BlockRegistry {
 public:
  MachineBlocks(const std::string& segment, int rank);

  // The next block (zeros), mapped until the last copy of the pointer goes. SystemError naming
  // the size and /dev/shm's free space when it cannot be made.
  std::shared_ptr<void> allocate(std::size_t bytes);
};

}  // namespace lockstep::comm::shm
