// Local SGD and DiLoCo: machines train apart and meet every few steps.
//
// Inside a machine the ranks average gradients every step as usual (DDP over the machine's own
// communicator, shared memory), so a machine's replicas stay equal. Across machines nothing is
// sent for K - 1 of every K optimizer steps. At the K-th, the machines meet: every rank
// all-reduces (average over the world) its outer gradient, the change since the last meeting,
// delta = anchor - parameters, and one outer SGD step moves the anchor:
//   buffer = momentum * buffer + delta;  anchor -= lr * (delta + momentum * buffer)   (Nesterov)
// and every rank goes on from the new anchor. lr 1 without momentum is plain model averaging
// (Local SGD, Lin et al., ICLR 2020); lr 0.7 with Nesterov momentum 0.9 is DiLoCo (Douillard et
// al., 2023), whose inner steps run for hundreds of steps. Floating-point buffers (batch-norm
// statistics) are averaged at each meeting. Between meetings the machines hold different models:
// anything that reads the model (evaluation, a checkpoint, the end of training) meets first
// (synchronize()).
//
// Across machines the job sends one model's worth of bytes every K steps instead of one
// gradient's every step; the inner optimizer's state (AdamW's moments) stays each machine's own.
//
// Thread-safety: the training thread only; step() and synchronize() are collective over the
// world communicator.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/sgd.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "lockstep/comm/communicator.h"

namespace lockstep {

struct OuterOptions {
  int sync_every = 1;     // K: inner steps between meetings
  double lr = 1.0;        // the outer step's learning rate
  double momentum = 0.0;  // Nesterov momentum of the outer step (0: none)
};

class OuterOptimizer {
 public:
  // Collective: every rank starts from world rank 0's parameters and buffers, the first anchor.
  // ConfigError for parameters that are not float32.
  OuterOptimizer(torch::nn::Module& module, comm::Communicator& world, OuterOptions options);

  // After each inner optimizer step: counts it, and meets at every sync_every-th. Returns
  // whether it met.
  bool step();
  // Meets now when an inner step was taken since the last meeting; else nothing (no traffic).
  bool synchronize();
  // The anchor is now the module's parameters (after a checkpoint was loaded into them on every
  // rank); the outer momentum is kept.
  void restart_from_parameters();

  int pending() const { return pending_; }
  std::int64_t meetings() const { return meetings_; }
  double last_seconds() const { return last_seconds_; }
  const OuterOptions& options() const { return options_; }
  // The outer step's state (its momentum buffers), for checkpoints.
  torch::optim::Optimizer& outer() { return *outer_; }

 private:
  void meet();
  void average_buffers();

  torch::nn::Module& module_;
  comm::Communicator& world_;
  OuterOptions options_;
  std::vector<torch::Tensor> params_, anchors_;
  std::unique_ptr<torch::optim::SGD> outer_;
  torch::Tensor flat_;  // the outer gradients, all-reduced in one collective
  int pending_ = 0;
  std::int64_t meetings_ = 0;
  double last_seconds_ = 0;
};

}  // namespace lockstep
