#include "lockstep/tp/shards.h"

#include <torch/torch.h>

#include "device_collectives.h"
#include "lockstep/error.h"

namespace lockstep::tp {
namespace {

std::string shape_text(const std::vector<std::int64_t>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// The view with the range's length at `dim`: the shard before it is reshaped.
std::vector<std::int64_t> ranged_view(const TensorShard& s) {
  std::vector<std::int64_t> v = s.view;
  v[std::size_t(s.dim)] = s.length;
  return v;
}

}  // namespace

TensorShard TensorShard::of(std::vector<std::int64_t> whole, std::vector<std::int64_t> view, int dim, int rank,
                            int ranks, std::vector<std::int64_t> shape) {
  TensorShard s;
  s.whole = std::move(whole);
  s.view = view.empty() ? s.whole : std::move(view);
  s.dim = dim;
  const std::int64_t n = s.view.at(std::size_t(dim));
  if (ranks < 1 || n % ranks != 0)
    throw ConfigError("a tensor of shape " + shape_text(s.whole) + " cannot be split " + std::to_string(ranks) +
                      " ways along dimension " + std::to_string(dim) + " of " + shape_text(s.view) + " (" +
                      std::to_string(n) + "): use a tensor-parallel degree that divides it");
  s.length = n / ranks;
  s.start = s.length * rank;
  s.shape = shape.empty() ? ranged_view(s) : std::move(shape);
  return s;
}

torch::Tensor TensorShard::take(const torch::Tensor& whole_tensor) const {
  return whole_tensor.detach().reshape(view).narrow(dim, start, length).reshape(shape).contiguous();
}

torch::Tensor TensorShard::gather(const torch::Tensor& part, comm::Communicator& group) const {
  const auto send = part.detach().contiguous();
  std::vector<std::int64_t> stacked{group.size()};
  for (const auto s : shape) stacked.push_back(s);
  auto recv = torch::empty(stacked, send.options());
  ddp_detail::finish(ddp_detail::allgather_anywhere(group, send, recv));
  std::vector<torch::Tensor> pieces;  // rank r holds [r * length, (r + 1) * length) of `dim`
  for (const auto& p : recv.unbind(0)) pieces.push_back(p.reshape(ranged_view(*this)));
  return torch::cat(pieces, dim).reshape(whole);
}

std::string TensorShard::describe() const {
  std::string out = "[" + std::to_string(start) + ", " + std::to_string(start + length) + ") of dimension " +
                    std::to_string(dim) + " of " + shape_text(whole);
  if (view != whole) out += " viewed as " + shape_text(view);
  return out;
}

}  // namespace lockstep::tp
