// The Trainer's building blocks that are not the loop itself: bf16 autocast, loaders over a
// Dataset, the buffer broadcast, and distributed evaluation.
#pragma once

#include <ATen/autocast_mode.h>

#include <functional>
#include <memory>
#include <vector>

#include "lockstep/comm/communicator.h"
#include "lockstep/data/evaluation.h"
#include "lockstep/data/loader.h"
#include "lockstep/ddp/torch_compat.h"
#include "lockstep/train/trainer.h"

namespace lockstep::train {

// Autocast to bfloat16 on the CPU for the scope, as torch.autocast("cpu") does.
class CpuAutocast {
 public:
  explicit CpuAutocast(bool on) : on_(on) {
    if (!on_) return;
    previous_ = torch_compat::cpu_autocast_enabled();
    torch_compat::set_cpu_autocast_enabled(true);
    torch_compat::set_cpu_autocast_dtype(at::kBFloat16);
    at::autocast::increment_nesting();
  }
  ~CpuAutocast() {
    if (!on_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    torch_compat::set_cpu_autocast_enabled(previous_);
  }
  CpuAutocast(const CpuAutocast&) = delete;
  CpuAutocast& operator=(const CpuAutocast&) = delete;

 private:
  bool on_;
  bool previous_ = false;
};

// Batches of `indices` from `ds`, built on `workers` threads.
inline std::unique_ptr<data::DataLoader<Batch>> make_loader(const std::shared_ptr<const Dataset>& ds,
                                                            const std::vector<std::size_t>& indices,
                                                            int batch_size, int workers) {
  data::LoaderOptions lo;
  lo.batch_size = static_cast<std::size_t>(batch_size);
  lo.num_workers = workers;
  return std::make_unique<data::DataLoader<Batch>>(
      indices, [ds](const std::vector<std::size_t>& idx) { return ds->get(idx); }, lo);
}

// Collective: rank 0's buffers (BatchNorm running statistics) to every rank.
void broadcast_buffers(torch::nn::Module& module, comm::Communicator& comm);

struct EvalSetup {
  int batch_size = 256;
  int loader_workers = 0;
  bool bf16 = false;
  // ZeRO stage 3: runs before each forward, and every rank forwards every batch (its forward
  // gathers parameters with the others), also a batch that is all padding for this rank.
  std::function<void()> before_forward = nullptr;
};

// Collective: loss and correct predictions over the whole dataset, split over ranks by a
// non-shuffled DistributedSampler whose padding is skipped, so every sample counts once.
data::EvalTotals evaluate_totals(
    const Model& model, const Dataset& dataset, comm::Communicator& comm, const EvalSetup& setup,
    const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>& loss);

}  // namespace lockstep::train
