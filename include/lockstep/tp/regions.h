// Tensor parallelism's communication, as autograd functions over the tensor group (Megatron-LM's
// "mappings"): each is named for the region a tensor enters, and its backward is its forward's
// conjugate, so a layer's communication reads off its forward.
//
//   function                      forward                          backward
//   copy_to_tensor_region         identity                         all-reduce (sum)
//   reduce_from_tensor_region     all-reduce (sum)                 identity
//   gather_from_tensor_region     all-gather along `dim`           this rank's slice
//   split_to_tensor_region        this rank's slice along `dim`    all-gather
//   gather_from_sequence_region   all-gather along `dim`           reduce-scatter (sum) along `dim`
//   scatter_to_sequence_region    reduce-scatter (sum) along `dim` all-gather along `dim`
//
// A column-parallel linear enters through copy_to (or, with sequence parallelism, gather_from_
// sequence: its input is then a sequence shard); a row-parallel linear leaves through reduce_from
// (or scatter_to_sequence). Slices are equal: `dim`'s size (or, for a gather, the group's size
// times it) must divide by the group's size, else ConfigError.
//
// Every rank of `group` must call the same functions in the same order, forward and backward (the
// communicator's rule). A tensor on a GPU goes through the communicator directly on nccl and
// through host copies elsewhere. The group must outlive the autograd graph built with it.
#pragma once

#include <torch/types.h>

#include <cstdint>

#include "lockstep/comm/communicator.h"

namespace lockstep::tp {

torch::Tensor copy_to_tensor_region(const torch::Tensor& x, comm::Communicator& group);
torch::Tensor reduce_from_tensor_region(const torch::Tensor& x, comm::Communicator& group);
torch::Tensor gather_from_tensor_region(const torch::Tensor& x, comm::Communicator& group, std::int64_t dim);
torch::Tensor split_to_tensor_region(const torch::Tensor& x, comm::Communicator& group, std::int64_t dim);
torch::Tensor gather_from_sequence_region(const torch::Tensor& x, comm::Communicator& group, std::int64_t dim);
torch::Tensor scatter_to_sequence_region(const torch::Tensor& x, comm::Communicator& group, std::int64_t dim);

// Sums `parameter`'s gradient over the group as backward produces it (a hook; once per backward,
// on the gradient of all its uses). For the parameters that sequence parallelism leaves whole on
// every rank (layer norms, a row-parallel linear's bias): each rank sees only its sequence shard,
// so each holds part of the gradient.
void sum_gradient_over(torch::Tensor& parameter, comm::Communicator& group);

}  // namespace lockstep::tp
