// The resident memory of this process, from /proc/self/status: its high-water mark (VmHWM).
// 0 where /proc is not there. Torch-free.
#pragma once

#include <cstdint>

namespace lockstep::train {

std::int64_t peak_rss_bytes();
std::int64_t machine_memory_bytes();  // MemTotal of /proc/meminfo
// Proportional set size: resident bytes with each shared page divided among the processes that
// map it, so summing it over a job's workers counts shared memory once (smaps_rollup).
std::int64_t pss_bytes();

}  // namespace lockstep::train
