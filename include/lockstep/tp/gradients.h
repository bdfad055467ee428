// What a tensor-parallel model's gradients need beyond its layers: the global norm over a model
// whose parameters are partly split over the tensor group and partly whole on every rank.
//
// The trap (torchtitan #1733, pytorch#144352): summing every rank's squares over the group counts a
// whole parameter T times; summing none counts a split one 1/T. Here a split parameter's squares
// are summed over the group and a whole one's counted once, so the norm is the unsplit model's.
#pragma once

#include <torch/nn/module.h>

#include <vector>

#include "lockstep/comm/communicator.h"

namespace lockstep::tp {

// Whether `parameter` (of a module under `root`) is a shard of a split tensor: the weight of a
// column- or row-parallel linear or a vocabulary-parallel embedding, or a column-parallel bias.
bool is_split(const torch::nn::Module& root, const torch::Tensor& parameter);

// The global L2 norm of `root`'s gradients over the tensor group (the unsplit model's), and, when
// it exceeds max_norm, every gradient scaled by max_norm / (norm + 1e-6) as
// torch::nn::utils::clip_grad_norm_ does. Every rank of the group calls it; all get the same norm.
// `model_group`, when given, is the group that holds one whole replica (pipeline x tensor ranks,
// Layout's ParallelDim::model): the squares are summed over it instead, the whole parameters of a
// pipeline stage counted by the stage's tensor rank 0 alone.
double clip_grad_norm(torch::nn::Module& root, double max_norm, comm::Communicator& tensor_group);
// The same over parameters the caller sorts: `split` (shards of split tensors) and `whole`.
double clip_grad_norm(const std::vector<torch::Tensor>& split, const std::vector<torch::Tensor>& whole,
                      double max_norm, comm::Communicator& tensor_group);

}  // namespace lockstep::tp
