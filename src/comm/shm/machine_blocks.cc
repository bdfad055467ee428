// Machine blocks: see machine_blocks.h.
#include "shm/machine_blocks.h"

#include <sys/mman.h>

#include <utility>

#include "lockstep/error.h"
#include "shm/segment.h"

namespace lockstep::comm::shm {

MachineBlocks::MachineBlocks(const std::string& segment, int rank)
    : BlockRegistry(segment + "-machine-", rank == 0) {}

std::shared_ptr<void> MachineBlocks::allocate(std::size_t bytes) {
  Named named = next();
  const Mapping m = open_or_create_segment(named.name, bytes);
  if (!m.base) {
    ::shm_unlink(named.name.c_str());
    throw SystemError("machine memory: " + describe_failure(m, named.name, bytes));
  }
  char* base = static_cast<char*>(m.base);
  return hand_out(Mapped{std::move(named), base, m.bytes, base, m.bytes}, nullptr);
}

}  // namespace lockstep::comm::shm
