// Tensors that share another tensor's memory without being autograd views of it: optimizers
// call grad.detach_() and update parameters in place, which autograd refuses on views.
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace lockstep::ddp_detail {

// `flat`'s memory from `offset` on, with `like`'s shape (contiguous).
inline torch::Tensor alias_into(const torch::Tensor& flat, std::int64_t offset, const torch::Tensor& like) {
  torch::NoGradGuard no_grad;
  auto alias = torch::empty({0}, flat.options());
  alias.set_(flat.storage(), flat.storage_offset() + offset, like.sizes(), like.contiguous().strides());
  return alias;
}

// Elements [offset, offset + n) of the one-dimensional `flat`.
inline torch::Tensor alias_range(const torch::Tensor& flat, std::int64_t offset, std::int64_t n) {
  torch::NoGradGuard no_grad;
  auto alias = torch::empty({0}, flat.options());
  alias.set_(flat.storage(), flat.storage_offset() + offset, {n}, {1});
  return alias;
}

}  // namespace lockstep::ddp_detail
