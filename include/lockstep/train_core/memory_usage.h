// The resident memory of this process, from /proc/self/status: now (VmRSS) and its high-water
// mark (VmHWM). 0 where /proc is not there. Torch-free.
#pragma once

#include <cstdint>

namespace lockstep::train {

std::int64_t rss_bytes();
std::int64_t peak_rss_bytes();

}  // namespace lockstep::train
