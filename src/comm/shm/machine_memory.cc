#include "lockstep/comm/machine_memory.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#include "lockstep/comm/collectives.h"
#include "lockstep/error.h"
#include "shm/segment.h"

namespace lockstep::comm {

std::shared_ptr<void> map_machine_memory(Communicator& comm, std::size_t bytes) {
  bytes = std::max<std::size_t>(bytes, 1);
  std::string name, error;
  void* base = nullptr;
  if (comm.rank() == 0) {
    name = shm::segment_name("machine");
    const shm::Mapping m = shm::create_segment(name, bytes);
    base = m.base;
    if (!base) {
      error = shm::describe_failure(m, name, bytes);
      name.clear();
    }
  }
  // Everyone learns the name (empty: rank 0 failed, and why).
  const auto from_zero = allgather_strings(comm, comm.rank() == 0 ? (name.empty() ? "!" + error : name) : "");
  const std::string& shared = from_zero[0];
  if (shared[0] == '!') throw SystemError("shared parameters: rank 0 " + shared.substr(1));
  if (comm.rank() != 0) base = shm::open_segment(shared, bytes).base;
  std::int32_t mapped = base != nullptr;
  comm.allreduce(&mapped, 1, DType::i32, ReduceOp::min)->wait();  // also: every rank has opened it
  if (comm.rank() == 0) ::shm_unlink(shared.c_str());
  std::shared_ptr<void> block(base, [bytes](void* p) {
    if (p) ::munmap(p, bytes);
  });
  if (!mapped)
    throw ConfigError("shared parameters need every worker on one machine, sharing /dev/shm: rank " +
                      std::string(base ? "0's memory is not visible to some rank" : std::to_string(comm.rank()) +
                                                                                      " cannot open rank 0's") +
                      " (run one worker group per machine without one-copy mode, or use --zero-stage alone)");
  return block;
}

}  // namespace lockstep::comm
