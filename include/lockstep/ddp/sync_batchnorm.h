// Batch normalisation over the global batch: the mean and variance a training forward uses are
// those of every rank's samples together, so W workers with b samples each normalise as one
// process with W x b would (PyTorch's SyncBatchNorm, for the C++ frontend).
//
//   struct Net : torch::nn::Module {
//     lockstep::SyncBatchNorm bn{register_module("bn", lockstep::SyncBatchNorm(16))};  // for BatchNorm2d(16)
//   };
//   lockstep::sync_batchnorm(*net, comm);   // the Trainer does this under --sync-batchnorm
//
// A drop-in for torch::nn::BatchNorm{1,2,3}d: the same options, parameters and buffers under the
// same names (checkpoints load either way), input (N, C, ...). Until a communicator is attached,
// or with one rank, or in eval, it computes exactly what torch::nn::BatchNorm does (same kernel).
//
// Training forward: each rank sums x and x^2 per channel in float64 and one all-reduce of
// (sums, sums of squares, count) gives the global mean and biased variance; the running
// statistics take the unbiased variance, as BatchNorm's. Backward: one all-reduce of the
// per-channel sums of dy and dy * x_hat gives
//   dx = (dy - sum(dy) / n - x_hat * sum(dy * x_hat) / n) * weight / sqrt(var + eps)
// over the global n, which is the gradient of the sum of the ranks' losses; weight and bias get
// their local sums, which DDP then averages like any gradient. Under DDP (averaging) that is
// exactly the gradient of one process on the concatenated batch with the mean loss, when the
// ranks' batches are equal in size. Two collectives per layer per step, both on the rank's
// compute thread: every rank must run the same SyncBatchNorm layers in the same order.
//
// Why not a convert_sync_batchnorm(module) that swaps existing BatchNorm layers: in libtorch a
// parent calls its children through typed members (torch::nn::BatchNorm2d bn1), which
// Module::replace_module cannot retarget, so a swapped layer would silently never run. Declare
// SyncBatchNorm where BatchNorm was; sync_batchnorm() names any plain BatchNorm it finds.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <string>
#include <vector>

#include "lockstep/comm/communicator.h"

namespace lockstep {

class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  explicit SyncBatchNormImpl(int64_t num_features) : SyncBatchNormImpl(torch::nn::BatchNormOptions(num_features)) {}
  explicit SyncBatchNormImpl(const torch::nn::BatchNormOptions& options);

  void reset() override;
  torch::Tensor forward(const torch::Tensor& input);
  void pretty_print(std::ostream& stream) const override;

  // The ranks whose batches it normalises over (nullptr: this rank's batch alone). Not owned:
  // the communicator must outlive the layer's use.
  void sync_with(comm::Communicator* comm) { comm_ = comm; }
  comm::Communicator* communicator() const { return comm_; }

  torch::nn::BatchNormOptions options;
  torch::Tensor weight, bias;                                   // undefined without affine
  torch::Tensor running_mean, running_var, num_batches_tracked;  // undefined without tracking

 private:
  double average_factor();  // what this forward blends into the running statistics
  comm::Communicator* comm_ = nullptr;
};
TORCH_MODULE(SyncBatchNorm);

// Attaches `comm` to every SyncBatchNorm in `root` (itself included) and returns how many there
// are. ConfigError when `root` also holds a plain torch::nn::BatchNorm{1,2,3}d (its statistics
// would stay per rank): the error names it and says to declare SyncBatchNorm instead.
int sync_batchnorm(torch::nn::Module& root, comm::Communicator& comm);

}  // namespace lockstep
