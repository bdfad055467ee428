// One stage held by this rank: its units, and what each micro-batch in flight keeps between its
// forward and its backward (the stage's input as a leaf whose gradient is wanted, the output the
// backward starts from, the zero-bubble split's state).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <vector>

#include "lockstep/pipe/pipeline.h"
#include "lockstep/pipe/units.h"
#include "split_backward.h"

namespace lockstep::pipe {

class StageChunk {
 public:
  StageChunk(int stage, bool first, bool last, std::vector<PipelineUnit> units);
  int stage() const { return stage_; }
  bool first() const { return first_; }
  bool last() const { return last_; }

  // The forward of micro-batch k: the first stage reads the batch's input, the others the
  // activation they received. Returns the output to send on (the last stage: the unscaled loss,
  // after keeping loss x weight to start the backward from).
  torch::Tensor forward(int k, const torch::Tensor& input, std::uint64_t seed);
  torch::Tensor forward_loss(int k, const torch::Tensor& input, std::uint64_t seed, const MicroBatch& batch,
                             const LossFn& loss);
  // Without gradients: the output, nothing kept.
  torch::Tensor forward_only(const torch::Tensor& input, std::uint64_t seed) const;
  // Whole backward of micro-batch k from its output's gradient (undefined on the last stage):
  // accumulates the parameters' gradients and returns the input's (undefined on the first stage).
  torch::Tensor backward(int k, const torch::Tensor& grad);
  // The zero-bubble input half; `eager` parameters' gradients computed now too, into `eager_grads`.
  torch::Tensor backward_input(int k, const torch::Tensor& grad, const std::vector<torch::Tensor>& eager = {},
                               std::vector<torch::Tensor>* eager_grads = nullptr);
  void backward_weight(int k);
  std::size_t in_flight() const { return saved_.size(); }

 private:
  struct Saved {
    torch::Tensor input, output;
    SplitBackward split;
  };
  torch::Tensor run_units(const torch::Tensor& x, std::uint64_t seed) const;
  Saved& saved(int k);

  int stage_;
  bool first_, last_;
  std::vector<PipelineUnit> units_;
  std::map<int, Saved> saved_;
};

}  // namespace lockstep::pipe
