// Distributed evaluation: every real sample of a dataset once across the ranks, and the buffer
// broadcast that makes the ranks' models agree before it.
#pragma once

#include <functional>
#include <optional>

#include "lockstep/comm/communicator.h"
#include "lockstep/data/evaluation.h"
#include "lockstep/train/trainer.h"

namespace lockstep::train {

// Collective: rank 0's buffers (BatchNorm running statistics) to every rank.
void broadcast_buffers(torch::nn::Module& module, comm::Communicator& comm);

struct EvalSetup {
  int batch_size = 256;
  int loader_workers = 0;
  std::optional<at::ScalarType> autocast;  // --bf16 or --fp16; none: float32
  // ZeRO stage 3: runs before each forward, and every rank forwards every batch (its forward
  // gathers parameters with the others), also a batch that is all padding for this rank.
  std::function<void()> before_forward = nullptr;
  torch::Device device = torch::kCPU;  // where the model is: each batch moves there
  // The predicted class of each output row, for the accuracy; empty: argmax over the last dimension
  // (tensor parallelism gathers its split logits first).
  std::function<torch::Tensor(const torch::Tensor&)> predict = nullptr;
};

// Collective: loss and correct predictions over the whole dataset, split over ranks by a
// non-shuffled DistributedSampler whose padding is skipped, so every sample counts once.
data::EvalTotals evaluate_totals(
    const Model& model, const Dataset& dataset, comm::Communicator& comm, const EvalSetup& setup,
    const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>& loss);

}  // namespace lockstep::train
