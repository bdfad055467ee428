// Shared-memory segments: the one place lockstep names, creates and maps POSIX shared-memory
// objects (the shm backend's segment, its shared buffers, a machine's one copy of the
// parameters, the locality probe).
//
// Names are "/lockstep-<creator's pid>-<what>-<random>": lockstep run removes the objects whose
// creator was one of its dead workers (lockstep/comm/shm_segments.h), so a crash between creating
// an object and unlinking it leaves nothing in /dev/shm. A created segment is sized and its pages reserved
// (posix_fallocate) before anyone touches it: tmpfs otherwise hands pages out lazily, and a full
// /dev/shm would kill a process with SIGBUS at its first touch instead of failing here, with a
// message, when there is still a choice.
#pragma once

#include <cstddef>
#include <string>

namespace lockstep::comm::shm {

// A fresh name for an object this process creates: "/lockstep-<pid>-<what>-<16 hex digits>".
std::string segment_name(const std::string& what);

struct Mapping {
  void* base = nullptr;
  std::size_t bytes = 0;
  int error = 0;  // errno of the step that failed, 0 on success
  std::string what;  // that step, for messages: "create", "reserve", "map", "open"
};

// Creates the object, reserves `bytes` (rounded up to a page) and maps it. On failure returns an
// empty Mapping saying which step failed, with nothing left behind.
Mapping create_segment(const std::string& name, std::size_t bytes);
// The object `name`, made by whichever caller comes first, sized and reserved by each (all pass
// the same `bytes`), and mapped: ranks that share an object this way never wait for each other.
Mapping open_or_create_segment(const std::string& name, std::size_t bytes);
// Maps an existing object; `bytes` 0 takes its size from the object.
Mapping open_segment(const std::string& name, std::size_t bytes = 0);
// The failure as a sentence: what, which object, how big, errno's text, and what to check.
std::string describe_failure(const Mapping& m, const std::string& name, std::size_t bytes);

}  // namespace lockstep::comm::shm
