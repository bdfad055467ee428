// Cross-entropy over logits whose vocabulary is split over a tensor group (a column-parallel head
// or a vocabulary-parallel embedding's transpose): the whole logits are never gathered.
//
// Each rank holds logits [..., V/T] for tokens [r*V/T, (r+1)*V/T). Forward: the maximum over the
// vocabulary (an all-reduce of max), the sum of exponentials and the target's logit (two all-reduces
// of sum, [tokens] elements each); loss = log(sum exp(z - max)) - (z_target - max). Backward, with no
// communication: softmax(z) - onehot(target) on this rank's columns. Traffic: 3 x tokens elements
// per step instead of tokens x V for a gather.
#pragma once

#include <torch/types.h>

#include <cstdint>

#include "lockstep/comm/communicator.h"

namespace lockstep::tp {

// Per-token losses, shaped as `targets`; a target equal to `ignore_index` has loss 0 and no
// gradient. ConfigError when a target is outside [0, V) (and not ignore_index), or the shapes
// disagree.
torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& local_logits, const torch::Tensor& targets,
                                           comm::Communicator& group, std::int64_t ignore_index = -100);

}  // namespace lockstep::tp
