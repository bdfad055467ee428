#include "stage_chunk.h"

#include <torch/torch.h>

#include <stdexcept>

#include "lockstep/ddp/autocast.h"

namespace lockstep::pipe {

StageChunk::StageChunk(int stage, bool first, bool last, std::vector<PipelineUnit> units)
    : stage_(stage), first_(first), last_(last), units_(std::move(units)) {}

torch::Tensor StageChunk::run_units(const torch::Tensor& x, std::uint64_t seed) const {
  torch::Tensor y = x;
  for (const auto& unit : units_) y = unit.forward(y, seed);
  return y;
}

StageChunk::Saved& StageChunk::saved(int k) {
  const auto it = saved_.find(k);
  if (it == saved_.end())
    throw std::logic_error("pipeline stage " + std::to_string(stage_) + ": backward of micro-batch " + std::to_string(k) +
                           " without its forward");
  return it->second;
}

torch::Tensor StageChunk::forward(int k, const torch::Tensor& input, std::uint64_t seed) {
  // The received activation becomes a leaf of this stage's graph, whose gradient goes back.
  const torch::Tensor x = first_ ? input : input.detach().requires_grad_(input.is_floating_point());
  torch::Tensor y = run_units(x, seed);
  Saved& s = saved_[k];
  s.input = x;
  s.output = y;
  return y.detach();
}

torch::Tensor StageChunk::forward_loss(int k, const torch::Tensor& input, std::uint64_t seed, const MicroBatch& batch,
                                       const LossFn& loss) {
  const torch::Tensor x = first_ ? input : input.detach().requires_grad_(input.is_floating_point());
  // As the Trainer's unpipelined step: the loss in float32 (float64 for a float64 model), then its
  // weight in the step's mean.
  const torch::Tensor value = loss(loss_input(run_units(x, seed)), batch.target.to(x.device()));
  Saved& s = saved_[k];
  s.input = x;
  s.output = value * batch.loss_weight;
  if (batch.loss_scale != 1) s.output = s.output * batch.loss_scale;
  return value.detach();
}

torch::Tensor StageChunk::forward_only(const torch::Tensor& input, std::uint64_t seed) const {
  torch::NoGradGuard no_grad;
  return run_units(input, seed);
}

torch::Tensor StageChunk::backward(int k, const torch::Tensor& grad) {
  torch::Tensor input_grad;
  {
    Saved& s = saved(k);
    if (s.output.requires_grad())
      torch::autograd::backward({s.output}, grad.defined() ? torch::autograd::variable_list{grad}
                                                           : torch::autograd::variable_list{});
    if (!first_ && s.input.requires_grad()) input_grad = s.input.grad();
  }
  saved_.erase(k);
  return input_grad;
}

torch::Tensor StageChunk::backward_input(int k, const torch::Tensor& grad, const std::vector<torch::Tensor>& eager,
                                         std::vector<torch::Tensor>* eager_grads) {
  Saved& s = saved(k);
  torch::Tensor input_grad = s.split.input_half(s.output, grad, first_ ? torch::Tensor() : s.input, eager, eager_grads);
  s.output = torch::Tensor();  // the split holds what the weight half needs
  return input_grad;
}

void StageChunk::backward_weight(int k) {
  saved(k).split.weight_half();
  saved_.erase(k);
}

}  // namespace lockstep::pipe
