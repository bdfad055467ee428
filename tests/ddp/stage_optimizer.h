// A rank's optimizer under DDP (stage 0) or ZeRO (stages 1 and 2), for the tests that train the
// same loop either way.
#pragma once

#include <torch/torch.h>

#include <memory>

#include "lockstep/ddp/zero.h"

namespace lockstep::testing {

class StageOptimizer {
 public:
  StageOptimizer(torch::nn::Module& module, Reducer& reducer, comm::Communicator& comm, int zero_stage,
                 const ZeroOptimizer::Factory& make) {
    if (zero_stage > 0)
      zero_ = std::make_unique<ZeroOptimizer>(module, reducer, comm, ZeroOptions{zero_stage, false}, make);
    else
      plain_ = make(module.parameters());
  }
  void step_and_zero_grad() {
    if (zero_) {
      zero_->step();
      zero_->zero_grad();
    } else {
      plain_->step();
      plain_->zero_grad();
    }
  }

 private:
  std::unique_ptr<ZeroOptimizer> zero_;
  std::unique_ptr<torch::optim::Optimizer> plain_;
};

}  // namespace lockstep::testing
