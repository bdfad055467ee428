// Local SGD / DiLoCo outer steps (see ddp/local_sgd.h).
#include "lockstep/ddp/local_sgd.h"

#include <torch/torch.h>

#include <chrono>
#include <string>

#include "broadcast_flat.h"
#include "lockstep/error.h"

namespace lockstep {
namespace {

std::vector<torch::Tensor> floating_buffers(torch::nn::Module& module) {
  std::vector<torch::Tensor> out;
  for (auto& b : module.buffers())
    if (b.is_floating_point()) out.push_back(b);
  return out;
}

}  // namespace

OuterOptimizer::OuterOptimizer(torch::nn::Module& module, comm::Communicator& world, OuterOptions options)
    : module_(module), world_(world), options_(options) {
  if (options_.sync_every < 1)
    throw ConfigError("--sync-every " + std::to_string(options_.sync_every) + ": use 1 or more inner steps");
  if (!(options_.lr > 0)) throw ConfigError("--outer-learning-rate must be above 0");
  if (options_.momentum < 0 || options_.momentum >= 1)
    throw ConfigError("--outer-momentum " + std::to_string(options_.momentum) + ": use 0 <= momentum < 1");
  torch::NoGradGuard no_grad;
  std::int64_t total = 0;
  for (const auto& item : module.named_parameters()) {
    const torch::Tensor& p = item.value();
    if (p.scalar_type() != torch::kFloat)
      throw ConfigError("local SGD keeps float32 parameters; '" + item.key() + "' is " +
                        std::string(c10::toString(p.scalar_type())));
    params_.push_back(p);
    total += p.numel();
  }
  for (const auto& b : floating_buffers(module))
    if (b.scalar_type() != torch::kFloat)
      throw ConfigError("local SGD averages float32 buffers; the module holds a " +
                        std::string(c10::toString(b.scalar_type())) + " one");
  ddp_detail::broadcast_flat(world_, params_, "a parameter");
  if (auto buffers = module.buffers(); !buffers.empty()) ddp_detail::broadcast_flat(world_, buffers, "a buffer");
  for (const auto& p : params_) anchors_.push_back(p.detach().clone());
  flat_ = torch::empty({total}, torch::kFloat);
  torch::optim::SGDOptions o(options_.lr);
  o.momentum(options_.momentum).nesterov(options_.momentum > 0);
  outer_ = std::make_unique<torch::optim::SGD>(anchors_, o);
}

bool OuterOptimizer::step() {
  ++pending_;
  if (pending_ < options_.sync_every) return false;
  meet();
  return true;
}

bool OuterOptimizer::synchronize() {
  if (pending_ == 0) return false;
  meet();
  return true;
}

void OuterOptimizer::restart_from_parameters() {
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params_.size(); ++i) anchors_[i].copy_(params_[i]);
  pending_ = 0;
}

void OuterOptimizer::meet() {
  const auto begin = std::chrono::steady_clock::now();
  torch::NoGradGuard no_grad;
  std::int64_t at = 0;
  for (std::size_t i = 0; i < params_.size(); ++i) {  // delta = anchor - parameters
    const std::int64_t n = params_[i].numel();
    auto delta = flat_.narrow(0, at, n).view_as(params_[i]);
    torch::sub_out(delta, anchors_[i], params_[i]);
    anchors_[i].mutable_grad() = delta;
    at += n;
  }
  world_.allreduce(flat_.data_ptr<float>(), std::size_t(flat_.numel()), comm::DType::f32, comm::ReduceOp::avg)
      ->wait();
  outer_->step();
  for (std::size_t i = 0; i < params_.size(); ++i) params_[i].copy_(anchors_[i]);
  average_buffers();
  pending_ = 0;
  ++meetings_;
  last_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
}

void OuterOptimizer::average_buffers() {
  for (auto& b : floating_buffers(module_)) {
    auto c = b.contiguous();
    world_.allreduce(c.data_ptr<float>(), std::size_t(c.numel()), comm::DType::f32, comm::ReduceOp::avg)->wait();
    if (!c.is_same(b)) b.copy_(c);
  }
}

}  // namespace lockstep
