#include "lockstep/tp/cross_entropy.h"

#include <torch/torch.h>

#include "device_collectives.h"
#include "lockstep/error.h"

namespace lockstep::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// In place, over the group.
void reduce(torch::Tensor& t, comm::Communicator& group, comm::ReduceOp op) {
  if (group.size() > 1) ddp_detail::finish(ddp_detail::allreduce_anywhere(group, t, op));
}

// Targets as this rank's column indices (0 where elsewhere) and whether each is here.
std::pair<torch::Tensor, torch::Tensor> local_targets(const torch::Tensor& targets, std::int64_t first,
                                                      std::int64_t columns) {
  const auto here = (targets >= first).logical_and(targets < first + columns);
  return {(targets - first).masked_fill(here.logical_not(), 0), here};
}

void check_targets(const torch::Tensor& targets, std::int64_t vocab, std::int64_t ignore_index) {
  const auto bad = (targets < 0).logical_or(targets >= vocab).logical_and(targets != ignore_index);
  if (bad.any().item<bool>())
    throw ConfigError("vocab_parallel_cross_entropy: target " +
                      std::to_string(targets.masked_select(bad)[0].item<std::int64_t>()) +
                      " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
}

struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  // logits [N, V/T], targets [N].
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits, const torch::Tensor& targets,
                               comm::Communicator* group, std::int64_t ignore_index) {
    const auto columns = logits.size(1);
    const auto first = group->rank() * columns;
    check_targets(targets, columns * group->size(), ignore_index);
    auto max = std::get<0>(logits.detach().max(1)).contiguous();
    reduce(max, *group, comm::ReduceOp::max);
    const auto shifted = logits.detach() - max.unsqueeze(1);
    const auto [local, here] = local_targets(targets, first, columns);
    auto target_logit = shifted.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(here.logical_not(), 0).contiguous();
    auto exp = shifted.exp();
    auto sum_exp = exp.sum(1).contiguous();
    reduce(target_logit, *group, comm::ReduceOp::sum);
    reduce(sum_exp, *group, comm::ReduceOp::sum);
    const auto ignored = targets == ignore_index;
    const auto loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0);
    exp.div_(sum_exp.unsqueeze(1));  // this rank's columns of the softmax
    ctx->save_for_backward({exp, local, here.logical_and(ignored.logical_not()), ignored});
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &softmax = saved[0], &local = saved[1], &here = saved[2], &ignored = saved[3];
    auto grad = softmax.clone();
    grad.scatter_add_(1, local.unsqueeze(1), -here.to(grad.scalar_type()).unsqueeze(1));
    grad.mul_(grads[0].masked_fill(ignored, 0).unsqueeze(1));
    return {grad, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& local_logits, const torch::Tensor& targets,
                                           comm::Communicator& group, std::int64_t ignore_index) {
  if (local_logits.dim() < 1 || local_logits.dim() != targets.dim() + 1 ||
      !local_logits.sizes().slice(0, targets.dim()).equals(targets.sizes()))
    throw ConfigError("vocab_parallel_cross_entropy: logits of shape " + c10::str(local_logits.sizes()) +
                      " do not match targets of shape " + c10::str(targets.sizes()) +
                      " (logits are the targets' shape plus this rank's vocabulary columns)");
  const auto columns = local_logits.size(-1);
  const auto flat = VocabParallelCrossEntropy::apply(local_logits.reshape({-1, columns}),
                                                     targets.reshape({-1}).to(torch::kLong), &group, ignore_index);
  return flat.view(targets.sizes());
}

}  // namespace lockstep::tp
