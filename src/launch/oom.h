// Whether the kernel's OOM killer ended a worker, and what limit it hit. A worker killed for
// memory dies of SIGKILL like any other; the kernel counts its OOM kills (/proc/vmstat
// oom_kill), so a SIGKILL while that count rose is named as running out of memory, with the
// limit that applied: the memory cgroup's (v1 memory.limit_in_bytes, v2 memory.max) when this
// process can read it, else the machine's memory.
#pragma once

#include <cstdint>
#include <string>

namespace lockstep::launch {

// The kernel's OOM kills on this machine so far, or -1 where it does not say.
std::int64_t oom_kills();
// "its cgroup's limit of 1.0 GiB", or "the machine's 23.5 GiB", or "" when neither is known.
std::string memory_limit_text();

}  // namespace lockstep::launch
