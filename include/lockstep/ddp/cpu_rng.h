// The default CPU generator's state, read and set under its lock: what gradient checkpointing
// replays for a recomputed block, and what a checkpoint saves for each rank.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <torch/types.h>

#include <mutex>

namespace lockstep {

inline torch::Tensor cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

inline void set_cpu_rng_state(const torch::Tensor& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace lockstep
