// One block of memory that every rank of a communicator maps at once: ZeRO's one-copy mode keeps
// the parameters there, once per machine instead of once per rank.
//
//   auto block = lockstep::comm::map_machine_memory(comm, bytes);   // collective
//   float* all = static_cast<float*>(block.get());                  // the same bytes on every rank
//
// Rank 0 creates a POSIX shared-memory object of `bytes` (zeros, the pages reserved up front so
// a full /dev/shm is an error now rather than a SIGBUS later), every other rank maps it by name,
// and once all have, rank 0 unlinks the name: nothing is left in /dev/shm even if the job is
// killed from then on. Every rank gets the same outcome: ConfigError when some rank cannot see
// rank 0's memory (the ranks are not all on one machine), SystemError when rank 0 cannot create
// it (naming the size; is /dev/shm large enough?). Writers and readers synchronise themselves
// (a barrier between one rank's writes and another's reads). The memory stays mapped while the
// returned pointer or a copy lives, even after the communicator. Torch-free.
#pragma once

#include <cstddef>
#include <memory>

#include "lockstep/comm/communicator.h"

namespace lockstep::comm {

std::shared_ptr<void> map_machine_memory(Communicator& comm, std::size_t bytes);

}  // namespace lockstep::comm
