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
  const auto split_set = split_parameters(root);
  std::vector<torch::Tensor> split, whole;
  for (const auto& p : root.parameters()) (split_set.count(p.unsafeGetTensorImpl()) ? split : whole).push_back(p);
  return clip_grad_norm(split, whole, max_norm, tensor_group);
}

namespace {

// The sum of the squares of the defined gradients among `params`, in float64.
double squares_of(const std::vector<torch::Tensor>& params, std::vector<torch::Tensor>& grads) {
  double sum = 0;
  for (const auto& p : params) {
    if (!p.grad().defined()) continue;
    grads.push_back(p.grad());
    sum += p.grad().detach().to(torch::kDouble).pow(2).sum().item<double>();
  }
  return sum;
}

}  // namespace

double clip_grad_norm(const std::vector<torch::Tensor>& split, const std::vector<torch::Tensor>& whole,
                      double max_norm, comm::Communicator& tensor_group) {
  std::vector<torch::Tensor> grads;
  auto split_sum = torch::full({1}, squares_of(split, grads), torch::kDouble);
  const double whole_sum = squares_of(whole, grads);
  if (tensor_group.size() > 1) ddp_detail::finish(ddp_detail::allreduce_sum_anywhere(tensor_group, split_sum));
  const double norm = std::sqrt(split_sum.item<double>() + whole_sum);
  const double coefficient = max_norm / (norm + 1e-6);
  if (coefficient < 1) {
    torch::NoGradGuard no_grad;
    for (auto& g : grads) g.mul_(coefficient);
  }
  return norm;
}

}  // namespace lockstep::tp
