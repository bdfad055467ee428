#include "lockstep/tp/regions.h"

#include <torch/torch.h>

#include "device_collectives.h"
#include "lockstep/error.h"

namespace lockstep::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

comm::Communicator& group_of(AutogradContext* ctx) {
  return *reinterpret_cast<comm::Communicator*>(ctx->saved_data["group"].toInt());
}

void remember(AutogradContext* ctx, comm::Communicator& group, std::int64_t dim) {
  ctx->saved_data["group"] = reinterpret_cast<std::int64_t>(&group);
  ctx->saved_data["dim"] = dim;
}

std::int64_t dim_of(AutogradContext* ctx) {
  return ctx->saved_data["dim"].toInt();
}

// --- the collectives, on whole tensors -------------------------------------------------------

torch::Tensor all_reduce(const torch::Tensor& x, comm::Communicator& group) {
  if (group.size() == 1) return x.clone();
  auto out = x.contiguous().clone();
  ddp_detail::finish(ddp_detail::allreduce_sum_anywhere(group, out));
  return out;
}

torch::Tensor all_gather(const torch::Tensor& x, comm::Communicator& group, std::int64_t dim) {
  if (group.size() == 1) return x.clone();
  auto send = x.contiguous();
  std::vector<std::int64_t> stacked{group.size()};
  for (const auto s : x.sizes()) stacked.push_back(s);
  auto recv = torch::empty(stacked, x.options());
  ddp_detail::finish(ddp_detail::allgather_anywhere(group, send, recv));
  return torch::cat(recv.unbind(0), dim);
}

void check_divides(const torch::Tensor& x, comm::Communicator& group, std::int64_t dim, const char* what) {
  if (x.size(dim) % group.size() != 0)
    throw ConfigError(std::string(what) + ": dimension " + std::to_string(dim) + " of a tensor of shape " +
                      c10::str(x.sizes()) + " does not divide by the tensor group's " +
                      std::to_string(group.size()) + " ranks: make it a multiple of " + std::to_string(group.size()));
}

torch::Tensor own_slice(const torch::Tensor& x, comm::Communicator& group, std::int64_t dim) {
  check_divides(x, group, dim, "split_to_tensor_region");
  const auto n = x.size(dim) / group.size();
  return x.narrow(dim, group.rank() * n, n).contiguous();
}

torch::Tensor reduce_scatter(const torch::Tensor& x, comm::Communicator& group, std::int64_t dim) {
  check_divides(x, group, dim, "scatter_to_sequence_region");
  if (group.size() == 1) return x.clone();
  auto send = torch::stack(x.chunk(group.size(), dim), 0).contiguous();  // block r: rank r's slice
  auto recv = torch::empty(send[0].sizes(), x.options());
  ddp_detail::finish(ddp_detail::reduce_scatter_sum_anywhere(group, send, recv));
  return recv;
}

torch::Tensor identity(const torch::Tensor& x, comm::Communicator&, std::int64_t) {
  return x.view_as(x);
}

torch::Tensor sum(const torch::Tensor& x, comm::Communicator& group, std::int64_t) {
  return all_reduce(x, group);
}

// --- the regions ---------------------------------------------------------------------------------

using Collective = torch::Tensor (*)(const torch::Tensor&, comm::Communicator&, std::int64_t);

// A region: `Forward` on the way in, `Backward` (its conjugate) on the gradient's way back.
template <Collective Forward, Collective Backward>
struct Region : torch::autograd::Function<Region<Forward, Backward>> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, comm::Communicator* group,
                               std::int64_t dim) {
    remember(ctx, *group, dim);
    return Forward(x, *group, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {Backward(grads[0], group_of(ctx), dim_of(ctx)), torch::Tensor(), torch::Tensor()};
  }
};

using CopyToTensorRegion = Region<identity, sum>;
using ReduceFromTensorRegion = Region<sum, identity>;
using GatherFromTensorRegion = Region<all_gather, own_slice>;
using SplitToTensorRegion = Region<own_slice, all_gather>;
using GatherFromSequenceRegion = Region<all_gather, reduce_scatter>;
using ScatterToSequenceRegion = Region<reduce_scatter, all_gather>;

std::int64_t wrapped(const torch::Tensor& x, std::int64_t dim) {
  return dim < 0 ? dim + x.dim() : dim;
}

}  // namespace

torch::Tensor copy_to_tensor_region(const torch::Tensor& x, comm::Communicator& group) {
  return CopyToTensorRegion::apply(x, &group, 0);
}

torch::Tensor reduce_from_tensor_region(const torch::Tensor& x, comm::Communicator& group) {
  return ReduceFromTensorRegion::apply(x, &group, 0);
}

torch::Tensor gather_from_tensor_region(const torch::Tensor& x, comm::Communicator& group, std::int64_t dim) {
  return GatherFromTensorRegion::apply(x, &group, wrapped(x, dim));
}

torch::Tensor split_to_tensor_region(const torch::Tensor& x, comm::Communicator& group, std::int64_t dim) {
  return SplitToTensorRegion::apply(x, &group, wrapped(x, dim));
}

torch::Tensor gather_from_sequence_region(const torch::Tensor& x, comm::Communicator& group, std::int64_t dim) {
  return GatherFromSequenceRegion::apply(x, &group, wrapped(x, dim));
}

torch::Tensor scatter_to_sequence_region(const torch::Tensor& x, comm::Communicator& group, std::int64_t dim) {
  return ScatterToSequenceRegion::apply(x, &group, wrapped(x, dim));
}

void sum_gradient_over(torch::Tensor& parameter, comm::Communicator& group) {
  if (!parameter.requires_grad())
    throw ConfigError("sum_gradient_over: the tensor does not require a gradient");
  comm::Communicator* g = &group;
  parameter.register_hook([g](const torch::Tensor& grad) { return all_reduce(grad, *g); });
}

}  // namespace lockstep::tp
