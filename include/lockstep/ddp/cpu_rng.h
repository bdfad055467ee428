// The default CPU generator's state, read and set under its lock: what gradient checkpointing
// replays for a recomputed block, and what a checkpoint saves for each rank; and its draws.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <torch/types.h>

#include <cstdint>
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

// One 64-bit draw from the default CPU generator: the seed of one forward's dropout masks (the
// GPT draws one per forward; a pipeline one per micro-batch, the same sequence: pipe/units.h).
inline std::uint64_t draw_cpu_seed() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(gen)->random64();
}

}  // namespace lockstep
