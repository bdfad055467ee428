#include "lockstep/comm/machine_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#include "lockstep/comm/collectives.h"
#include "lockstep/error.h"
#include "store/wire.h"

namespace lockstep::comm {
namespace {

std::string fresh_name() {
  static const char* digits = "0123456789abcdef";
  std::string name = "/lockstep-" + std::to_string(::getpid()) + "-machine-";
  for (unsigned char c : wire::random_bytes(8)) name += {digits[c >> 4], digits[c & 15]};
  return name;
}

// Maps the object `fd` names; nullptr (errno set) on failure. Closes fd either way.
void* map_fd(int fd, std::size_t bytes) {
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  ::close(fd);
  errno = error;
  return base == MAP_FAILED ? nullptr : base;
}

// Rank 0's part: the object, sized and reserved. Returns the mapping; `error` says why not.
void* create(const std::string& name, std::size_t bytes, std::string& error) {
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    error = std::string("cannot create ") + name + ": " + std::strerror(errno);
    return nullptr;
  }
  int e = ::ftruncate(fd, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
  if (!e) e = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (e) {
    ::close(fd);
    ::shm_unlink(name.c_str());
    error = "cannot reserve " + std::to_string(bytes) + " bytes of shared memory (" + std::strerror(e) +
            "); is /dev/shm large enough?";
    return nullptr;
  }
  void* base = map_fd(fd, bytes);
  if (!base) {
    error = std::string("cannot map ") + name + ": " + std::strerror(errno);
    ::shm_unlink(name.c_str());
  }
  return base;
}

void* open_existing(const std::string& name, std::size_t bytes) {
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
  return fd < 0 ? nullptr : map_fd(fd, bytes);
}

}  // namespace

std::shared_ptr<void> map_machine_memory(Communicator& comm, std::size_t bytes) {
  bytes = std::max<std::size_t>(bytes, 1);
  std::string name, error;
  void* base = nullptr;
  if (comm.rank() == 0) {
    name = fresh_name();
    base = create(name, bytes, error);
    if (!base) name.clear();
  }
  // Everyone learns the name (empty: rank 0 failed, and why).
  const auto from_zero = allgather_strings(comm, comm.rank() == 0 ? (name.empty() ? "!" + error : name) : "");
  const std::string& shared = from_zero[0];
  if (shared[0] == '!') throw SystemError("shared parameters: rank 0 " + shared.substr(1));
  if (comm.rank() != 0) base = open_existing(shared, bytes);
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
