// The zero-bubble schedule's backward in two halves, each running libtorch's own autograd nodes
// (so the sums are bitwise those of one whole backward):
//
//   input half   the gradient of the stage's input, through the nodes that lead to it and only
//                those (torch::autograd::grad); a pre-hook on each "split node" (a node on the
//                input's path that also feeds a parameter's path: a linear layer's product, a layer
//                norm) keeps the gradient it was given, and the node's edges into the input's path
//                are cut.
//   weight half  the engine run again from the split nodes with those gradients: each computes
//                only the outputs still connected, its weights' (the input's were cut), and the
//                gradients reach the parameters' accumulators (and DDP's hooks on them).
//
// When the stage's input takes no gradient (the first stage: token ids), the input half has nothing
// to do and the weight half is the whole backward. Nodes without a parameter edge of their own (a
// gradient-checkpointed block's recomputation, which runs its own backward inside) compute their
// parameters' gradients in the input half.
//
// `eager` parameters get their gradients in the input half, returned rather than accumulated (the
// last stage's copy of a tied embedding, whose gradient the first stage waits for), and the weight
// half leaves them out. A part of the graph that leads both to an eager parameter and to another is
// not split from them: std::logic_error (a model's tied head reads only the tied weight there).
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/types.h>

#include <memory>
#include <vector>

#include "lockstep/ddp/torch_compat.h"

namespace lockstep::pipe {

class SplitBackward {
 public:
  // `grad`: the output's gradient; undefined for a scalar loss (then 1). Returns the input's
  // gradient (undefined when `input` takes none), and the eager parameters' in `eager_grads`.
  torch::Tensor input_half(const torch::Tensor& output, const torch::Tensor& grad, const torch::Tensor& input,
                           const std::vector<torch::Tensor>& eager = {}, std::vector<torch::Tensor>* eager_grads = nullptr);
  // Accumulates the parameters' gradients; releases the graph.
  void weight_half();

  struct Captured;  // what the split nodes were given (split_backward.cc)

 private:
  torch::Tensor output_, grad_;  // the whole backward, when the input half found no input path
  std::vector<torch_compat::NodePtr> split_nodes_;
  std::vector<std::vector<std::size_t>> cut_;  // per split node: the edges the input half cut
  std::shared_ptr<Captured> captured_;
};

}  // namespace lockstep::pipe
