#include "zero_mirrors.h"

#include "lockstep/ddp/comm_dtype.h"
#include "lockstep/error.h"

namespace lockstep::ddp_detail {

ZeroMirrors::ZeroMirrors(const ZeroOptions& options, const std::vector<torch::Tensor>& flat,
                         std::vector<std::int64_t> owner_offsets, std::vector<std::int64_t> lengths,
                         const ZeroOptimizer::Factory& make)
    : owner_(options.mirror_of),
      mirrored_by_(options.mirrored_by),
      stage_(options.stage),
      offsets_(std::move(owner_offsets)),
      lengths_(std::move(lengths)) {
  for (std::size_t b = 0; b < flat.size(); ++b) {
    slices_.push_back(flat[b].narrow(0, offsets_[b], lengths_[b]).clone());
    slices_.back().set_requires_grad(true);
    if (stage_ == 2) received_.push_back(torch::zeros_like(slices_.back()));
  }
  optimizer_ = make(slices_);
}

void ZeroMirrors::take_gradients(Reducer& reducer, comm::Communicator& comm) {
  if (gradients_in_) return;
  constexpr int kTag = 0x5a0000;
  std::vector<comm::WorkPtr> works;
  for (std::size_t b = 0; b < slices_.size(); ++b) {
    if (stage_ == 1) {
      slices_[b].mutable_grad() = reducer.averaged_range(int(b), offsets_[b], lengths_[b]);
      continue;
    }
    const auto dtype = comm_dtype_of(received_[b].scalar_type());
    if (!dtype) throw ConfigError("ZeRO mirrors: a slice of a dtype comm does not carry");
    const auto count = std::size_t(lengths_[b]);
    works.push_back(comm.recv(received_[b].data_ptr(), count, *dtype, owner_, kTag + int(b)));
    const auto mine = reducer.gradient_slice(int(b));
    works.push_back(comm.send(mine.data_ptr(), count, *dtype, mirrored_by_, kTag + int(b)));
    slices_[b].mutable_grad() = received_[b];
  }
  for (auto& w : works) w->wait();
  gradients_in_ = true;
}

void ZeroMirrors::scale_gradients(double coefficient) {
  torch::NoGradGuard no_grad;
  for (auto& m : slices_) m.mutable_grad().mul_(coefficient);
}

void ZeroMirrors::step(const torch::optim::Optimizer& owner) {
  for (std::size_t g = 0; g < owner.param_groups().size(); ++g)
    optimizer_->param_groups()[g].options().set_lr(owner.param_groups()[g].options().get_lr());
  optimizer_->step();
}

void ZeroMirrors::copy_from(const std::vector<torch::Tensor>& flat) {
  torch::NoGradGuard no_grad;
  for (std::size_t b = 0; b < slices_.size(); ++b) slices_[b].copy_(flat[b].narrow(0, offsets_[b], lengths_[b]));
  gradients_in_ = false;
}

void ZeroMirrors::keep_gradients() {
  for (auto& m : slices_) m.mutable_grad() = m.grad().clone();
}

}  // namespace lockstep::ddp_detail
