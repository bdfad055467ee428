#include "lockstep/tp/gradients.h"

#include <torch/torch.h>

#include <cmath>
#include <unordered_set>

#include "device_collectives.h"
#include "lockstep/tp/layers.h"

namespace lockstep::tp {
namespace {

// The parameters of `root` that are shards of a split tensor, by their storage's identity.
std::unordered_set<const void*> split_parameters(const torch::nn::Module& root) {
  std::unordered_set<const void*> out;
  auto add = [&](const torch::Tensor& t) {
    if (t.defined()) out.insert(t.unsafeGetTensorImpl());
  };
  for (const auto& m : root.modules(/*include_self=*/true)) {
    if (const auto* c = dynamic_cast<const ColumnParallelLinearImpl*>(m.get())) add(c->weight), add(c->bias);
    if (const auto* r = dynamic_cast<const RowParallelLinearImpl*>(m.get())) add(r->weight);
    if (const auto* e = dynamic_cast<const VocabParallelEmbeddingImpl*>(m.get())) add(e->weight);
  }
  return out;
}

}  // namespace

bool is_split(const torch::nn::Module& root, const torch::Tensor& parameter) {
  return split_parameters(root).count(parameter.unsafeGetTensorImpl()) > 0;
}

double clip_grad_norm(torch::nn::Module& root, double max_norm, comm::Communicator& tensor_group) {
  const auto split = split_parameters(root);
  // [split squares, whole squares], in float64 whatever the parameters' type.
  auto squares = torch::zeros({2}, torch::kDouble);
  std::vector<torch::Tensor> grads;
  for (const auto& p : root.parameters()) {
    if (!p.grad().defined()) continue;
    grads.push_back(p.grad());
    const auto s = p.grad().detach().to(torch::kDouble).pow(2).sum().cpu();
    squares[split.count(p.unsafeGetTensorImpl()) ? 0 : 1] += s;
  }
  auto split_sum = squares.narrow(0, 0, 1).contiguous();
  if (tensor_group.size() > 1) ddp_detail::finish(ddp_detail::allreduce_sum_anywhere(tensor_group, split_sum));
  const double norm = std::sqrt(split_sum.item<double>() + squares[1].item<double>());
  const double coefficient = max_norm / (norm + 1e-6);
  if (coefficient < 1) {
    torch::NoGradGuard no_grad;
    for (auto& g : grads) g.mul_(coefficient);
  }
  return norm;
}

}  // namespace lockstep::tp
