// Parameter units: how a model tells ZeRO stage 3 (ddp/zero.h) where its blocks begin and end.
//
// Under stage 3 a rank holds only its slices of the parameters; a unit's parameters (a
// transformer block, a large layer) are gathered just before the unit runs and freed after it,
// and gathered again for its backward. libtorch modules have no forward hooks, so a model that
// trains under stage 3 names its units and runs each through the runner the optimizer gives it:
//
//   struct NetImpl : torch::nn::Module {
//     std::vector<std::shared_ptr<torch::nn::Module>> parameter_units() { return {block1.ptr(),
//     block2.ptr()}; } void set_unit_runner(lockstep::UnitRunner r) { runner_ = std::move(r); } torch::Tensor
//     forward(torch::Tensor x) {
//       x = lockstep::run_unit(runner_, 0, [&](const torch::Tensor& h) { return block1->forward(h); }, x);
//       x = lockstep::run_unit(runner_, 1, [&](const torch::Tensor& h) { return block2->forward(h); }, x);
//       return head(x);
//     }
//     lockstep::UnitRunner runner_;
//   };
//
// The unit index is its place in parameter_units(). Parameters in no unit (embeddings, a head)
// form the root unit, gathered before each forward and held until backward is done with them.
// Without a runner (DDP, ZeRO 1 and 2, one process) run_unit just calls the block. A unit may
// be wrapped in lockstep::gradient_checkpoint: the recomputation runs through the runner again.
#pragma once

#include <torch/types.h>

#include <functional>

namespace lockstep {

using UnitForward = std::function<torch::Tensor(const torch::Tensor&)>;
using UnitRunner =
    std::function<torch::Tensor(int unit, const UnitForward& forward, const torch::Tensor& input)>;

inline torch::Tensor run_unit(const UnitRunner& runner, int unit, const UnitForward& forward,
                              const torch::Tensor& input) {
  return runner ? runner(unit, forward, input) : forward(input);
}

}  // namespace lockstep
