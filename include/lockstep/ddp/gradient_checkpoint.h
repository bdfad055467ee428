// Gradient checkpointing (activation recomputation) for libtorch, which has none: run a block
// without keeping the activations it creates, and recompute them in backward.
//
//   x = lockstep::gradient_checkpoint([&](const torch::Tensor& h) { return block->forward(h); }, x);
//
// Forward runs `block` under no_grad, keeping only its input (and the CPU RNG and autocast
// state). Backward runs it again with the same RNG state, so dropout draws the same masks, and
// the same autocast state, then backpropagates the output's gradient through the recomputed
// graph: parameters used in the block get their gradients there, through their usual gradient
// accumulators, and the input gets its own. Memory: one tensor (the input) per call instead of
// every intermediate of the block; time: one more forward of the block per backward.
//
// Under DistributedDataParallel each parameter of a recomputed block counts ready exactly once
// per backward, also under no_sync, with gradient accumulation, bf16 autocast and
// find_unused_parameters (the wrapper's forward must return a tensor, as the Trainer's does).
// In eval or under no_grad it simply calls the block. Not for blocks that change their input in
// place, or whose output is a view of it.
#pragma once

#include <torch/types.h>

#include <functional>

namespace lockstep {

using CheckpointedBlock = std::function<torch::Tensor(const torch::Tensor&)>;

torch::Tensor gradient_checkpoint(const CheckpointedBlock& block, const torch::Tensor& input);

}  // namespace lockstep
