// How many bytes the CPU tensors of this process hold, now and at their peak: a counting
// wrapper around libtorch's CPU allocator, installed once by track_tensor_memory() (the Trainer
// installs it). Only allocations made after it is installed are counted, so install it before
// building the model to see parameters too. Thread-safe.
#pragma once

#include <cstdint>

namespace lockstep::train {

void track_tensor_memory();
bool tensor_memory_tracked();
std::int64_t tensor_bytes();       // allocated now (by allocations since tracking began)
std::int64_t peak_tensor_bytes();  // the most at any moment since the last reset
void reset_peak_tensor_bytes();    // the peak starts again from what is allocated now

}  // namespace lockstep::train
