#include "lockstep/train/foreach_adamw.h"

#include <torch/torch.h>

#include <cmath>
#include <map>
#include <string>

#include "lockstep/ddp/torch_compat.h"

namespace lockstep {

torch::optim::AdamWParamState& ForeachAdamW::state_of(const torch::Tensor& p) {
  auto& slot = state_[torch_compat::state_key(p)];
  if (!slot) {  // as libtorch's AdamW starts one
    auto fresh = std::make_unique<torch::optim::AdamWParamState>();
    fresh->step(0);
    fresh->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    fresh->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    slot = std::move(fresh);
  }
  return static_cast<torch::optim::AdamWParamState&>(*slot);
}

torch::Tensor ForeachAdamW::step(LossClosure closure) {
  for (const auto& group : param_groups())
    if (static_cast<const torch::optim::AdamWOptions&>(group.options()).amsgrad()) return AdamW::step(closure);
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups()) {
    // Parameters that missed a step (no gradient then) have their own count, so their own
    // bias corrections: one update per distinct count, nearly always one.
    struct Lists {
      std::vector<torch::Tensor> params, grads, exp_avgs, exp_avg_sqs;
    };
    std::map<std::int64_t, Lists> by_step;
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      TORCH_CHECK(!p.grad().is_sparse(), "AdamW does not support sparse gradients");
      auto& state = state_of(p);
      state.step(state.step() + 1);
      auto& lists = by_step[state.step()];
      lists.params.push_back(p);
      lists.grads.push_back(p.grad());
      lists.exp_avgs.push_back(state.exp_avg());
      lists.exp_avg_sqs.push_back(state.exp_avg_sq());
    }
    const auto& options = static_cast<const torch::optim::AdamWOptions&>(group.options());
    for (auto& [step, l] : by_step) update(options, step, l.params, l.grads, l.exp_avgs, l.exp_avg_sqs);
  }
  return loss;
}

// libtorch's AdamW step, each per-parameter operation made one over the lists.
void ForeachAdamW::update(const torch::optim::AdamWOptions& options, std::int64_t step,
                          std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                          std::vector<torch::Tensor>& exp_avgs, std::vector<torch::Tensor>& exp_avg_sqs) {
  const double beta1 = std::get<0>(options.betas()), beta2 = std::get<1>(options.betas());
  if (options.weight_decay() != 0) at::_foreach_mul_(params, 1 - options.lr() * options.weight_decay());
  const double bias_correction1 = 1 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1 - std::pow(beta2, static_cast<double>(step));
  at::_foreach_mul_(exp_avgs, beta1);
  at::_foreach_add_(exp_avgs, grads, 1 - beta1);
  at::_foreach_mul_(exp_avg_sqs, beta2);
  at::_foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2);
  auto denom = at::_foreach_sqrt(exp_avg_sqs);
  at::_foreach_div_(denom, std::sqrt(bias_correction2));
  at::_foreach_add_(denom, options.eps());
  at::_foreach_addcdiv_(params, exp_avgs, denom, -options.lr() / bias_correction1);
}

bool FusedAdamW::available() { return torch_compat::kFusedAdamW; }

void FusedAdamW::update(const torch::optim::AdamWOptions& options, std::int64_t step,
                        std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                        std::vector<torch::Tensor>& exp_avgs, std::vector<torch::Tensor>& exp_avg_sqs) {
  if (torch_compat::kFusedAdamW) {
    // The kernel reads each parameter's step count from a tensor (and increments nothing).
    const auto count =
        torch::full({}, static_cast<double>(step), torch::TensorOptions().device(params.front().device()));
    const std::vector<torch::Tensor> steps(params.size(), count);
    torch_compat::fused_adamw(params, grads, exp_avgs, exp_avg_sqs, steps, options.lr(), std::get<0>(options.betas()),
                              std::get<1>(options.betas()), options.weight_decay(), options.eps());
    return;
  }
  ForeachAdamW::update(options, step, params, grads, exp_avgs, exp_avg_sqs);
}

}  // namespace lockstep
