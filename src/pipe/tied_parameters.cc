// The tied parameters' exchange between the first and the last stage (tied_parameters.h).
#include "tied_parameters.h"

#include <stdexcept>

namespace lockstep::pipe {

TiedParameters::TiedParameters(TensorChannel& channel, Ends ends, bool once_a_step, Receive receive)
    : channel_(channel), ends_(ends), once_a_step_(once_a_step), receive_(std::move(receive)) {}

TiedParameters::~TiedParameters() {
  for (std::size_t i = 0; i < hooks_.size(); ++i) tensors_[i].remove_hook(hooks_[i]);
}

void TiedParameters::add_on_first(const std::string& name, torch::Tensor tensor) {
  const std::size_t i = tensors_.size();
  tensors_.push_back(tensor);
  hooks_.push_back(tensor.register_hook([this, i, name](const torch::Tensor& grad) {
    const auto it = received_.find(running_);
    if (it == received_.end() && once_a_step_) return grad;  // the step's sum comes with its last micro-batch
    if (it == received_.end() || i >= it->second.size())
      throw std::logic_error("pipeline: the last stage's gradient of '" + name + "' for micro-batch " +
                             std::to_string(running_) + " had not arrived");
    return grad + it->second[i];
  }));
}

void TiedParameters::add_on_last(torch::Tensor tensor) {
  const std::size_t i = tensors_.size();
  tensors_.push_back(tensor);
  hooks_.push_back(tensor.register_hook([this, i](const torch::Tensor& grad) {
    if (capturing_) keep(running_, i, grad);
  }));
}

// The last stage's gradient of tied parameter i in micro-batch k: kept to send for k, or once a
// step added to the step's sum.
void TiedParameters::keep(int k, std::size_t i, const torch::Tensor& grad) {
  auto& kept = captured_[once_a_step_ ? kSummed : k];
  if (kept.size() <= i) kept.resize(i + 1);
  if (once_a_step_ && kept[i].defined())
    kept[i].add_(grad);
  else
    kept[i] = grad.clone();
}

void TiedParameters::receive_gradients(int k) {
  auto& grads = received_[k];
  for (std::size_t i = 0; i < tensors_.size(); ++i)
    grads.push_back(receive_(ends_.last_stage, 0, Channel::tied_gradient, int(i), k));
}

void TiedParameters::forget(int k) {
  received_.erase(k);
}

// The last stage's gradients of the tied parameters for micro-batch k (once a step: the step's
// sum), to the first stage.
void TiedParameters::send_gradients(int k) {
  const int key = once_a_step_ ? kSummed : k;
  auto& grads = captured_[key];
  if (grads.size() != tensors_.size())
    throw std::logic_error("pipeline: the last stage has no gradient of a tied parameter for micro-batch " +
                           std::to_string(k));
  for (std::size_t i = 0; i < grads.size(); ++i)
    channel_.send(grads[i], ends_.first_rank, tag_of(Channel::tied_gradient, int(i), k));
  captured_.erase(key);
}

void TiedParameters::after_optimizer_step(bool first) {
  if (tensors_.empty()) return;
  if (first) {
    for (std::size_t i = 0; i < tensors_.size(); ++i)
      channel_.send(tensors_[i].detach(), ends_.last_rank, tag_of(Channel::tied_value, int(i), 0));
    return;
  }
  for (auto& t : tensors_) t.mutable_grad() = torch::Tensor();
  values_due_ = true;
}

void TiedParameters::take_values() {
  if (!values_due_) return;
  values_due_ = false;
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < tensors_.size(); ++i)
    tensors_[i].copy_(receive_(0, ends_.last_stage, Channel::tied_value, int(i), 0));
}

}  // namespace lockstep::pipe
