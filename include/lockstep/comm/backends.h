// The names of lockstep's communication backends: the one list that flags, arguments and
// error messages are checked against. Header-only and torch-free.
#pragma once

#include <string>
#include <string_view>

namespace lockstep::comm {

// "auto" picks shm when every rank is on one machine, hier when several machines hold the same
// number of ranks (more than one each), and gloo otherwise; never nccl, which is asked for by
// name (GPU memory: comm/communicator.h).
inline constexpr const char* kBackendNames[] = {"auto", "shm", "gloo", "hier", "mpi", "nccl"};

inline bool is_backend_name(std::string_view name) {
  for (const char* b : kBackendNames)
    if (name == b) return true;
  return false;
}

// "auto | shm | gloo | hier | mpi | nccl", for help texts.
inline std::string backend_choices(const char* separator = " | ") {
  std::string out;
  for (const char* b : kBackendNames) out += (out.empty() ? "" : separator) + std::string(b);
  return out;
}

}  // namespace lockstep::comm
