// The elastic part of ZeroOptimizer: copies of another rank's slices (ZeroOptions::mirror_of),
// with an optimizer of their own, updated with the same gradients as the owner's and then set to
// the owner's values bit for bit, so that a lost rank's slices and optimizer state live on in its
// mirror (see "Mirrors" in lockstep/ddp/zero.h; zero_elastic.h puts them back together after a
// change of membership).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "lockstep/comm/communicator.h"
#include "lockstep/ddp/ddp.h"
#include "lockstep/ddp/zero.h"

namespace lockstep::ddp_detail {

class ZeroMirrors {
 public:
  // `owner_offsets` and `length` per bucket: where the mirrored rank's slice of each flat bucket
  // starts, and the slice's length; the slices are copied out of `flat` now.
  ZeroMirrors(const ZeroOptions& options, const std::vector<torch::Tensor>& flat,
              std::vector<std::int64_t> owner_offsets, std::vector<std::int64_t> lengths,
              const ZeroOptimizer::Factory& make);

  // This step's averaged gradients of the mirrored slices, once per step: stage 1 reads them
  // from the all-reduced buckets; under stage 2 each rank sends its own slices to the rank that
  // mirrors it and receives the ones it mirrors.
  void take_gradients(Reducer& reducer, comm::Communicator& comm);
  void scale_gradients(double coefficient);
  // The update, at the owner's learning rates.
  void step(const torch::optim::Optimizer& owner);
  // The owner's new values, from the gathered flat buckets; the next step takes new gradients.
  void copy_from(const std::vector<torch::Tensor>& flat);
  // The gradients made the mirrors' own (the reducer's memory is about to go).
  void keep_gradients();
  // This step's gradients dropped without an update (a skipped step); the next step takes new ones.
  void drop_gradients() { gradients_in_ = false; }

  int owner() const { return owner_; }
  std::vector<torch::Tensor>& slices() { return slices_; }
  torch::optim::Optimizer& optimizer() { return *optimizer_; }

 private:
  int owner_, mirrored_by_, stage_;
  std::vector<std::int64_t> offsets_, lengths_;
  std::vector<torch::Tensor> slices_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::vector<torch::Tensor> received_;  // stage 2: the gradients received from the owner
  bool gradients_in_ = false;            // this step's gradients are in place
};

}  // namespace lockstep::ddp_detail
