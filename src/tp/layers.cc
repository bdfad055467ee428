#include "lockstep/tp/layers.h"

#include <torch/torch.h>

#include "lockstep/error.h"
#include "lockstep/tp/regions.h"

namespace lockstep::tp {
namespace {

// A registered parameter holding this rank's shard of `whole` (detached: the shard is the leaf).
torch::Tensor shard_parameter(torch::nn::Module& m, const char* name, const torch::Tensor& whole, std::int64_t dim,
                              comm::Communicator& group, const char* what) {
  return m.register_parameter(name, shard_of(whole.detach(), dim, group.rank(), group.size(), what).clone());
}

void copy_shard(torch::Tensor& into, const torch::Tensor& whole, std::int64_t dim, comm::Communicator& group,
                const char* what) {
  const auto shard = shard_of(whole.detach(), dim, group.rank(), group.size(), what);
  if (!shard.sizes().equals(into.sizes()))
    throw ConfigError(std::string(what) + ": a whole tensor of shape " + c10::str(whole.sizes()) +
                      " does not fit this layer's shard of shape " + c10::str(into.sizes()));
  torch::NoGradGuard no_grad;
  into.copy_(shard);
}

}  // namespace

torch::Tensor shard_of(const torch::Tensor& whole, std::int64_t dim, int rank, int ranks, const char* what) {
  const auto n = whole.size(dim);
  if (n % ranks != 0)
    throw ConfigError(std::string(what) + ": " + std::to_string(n) + " does not divide over --tensor-parallel " +
                      std::to_string(ranks) + "; use a tensor-parallel degree that divides it");
  const auto part = n / ranks;
  return whole.narrow(dim, rank * part, part);
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(std::int64_t in, std::int64_t out, comm::Communicator& group,
                                                   ParallelLinearOptions options)
    : in_features(in), out_features(out), group_(&group), options_(options) {
  torch::nn::Linear whole(torch::nn::LinearOptions(in, out).bias(options.bias));
  weight = shard_parameter(*this, "weight", whole->weight, 0, group, "a column-parallel linear's output features");
  if (options.bias) bias = shard_parameter(*this, "bias", whole->bias, 0, group, "a column-parallel linear's bias");
}

torch::Tensor ColumnParallelLinearImpl::forward(const torch::Tensor& x) {
  const auto in = options_.sequence_parallel ? gather_from_sequence_region(x, *group_, options_.sequence_dim)
                                             : copy_to_tensor_region(x, *group_);
  const auto y = torch::nn::functional::linear(in, weight, bias);
  return options_.gather_output ? gather_from_tensor_region(y, *group_, -1) : y;
}

void ColumnParallelLinearImpl::load_shard_of(const torch::Tensor& w, const torch::Tensor& b) {
  copy_shard(weight, w, 0, *group_, "ColumnParallelLinear::load_shard_of (weight)");
  if (bias.defined()) copy_shard(bias, b, 0, *group_, "ColumnParallelLinear::load_shard_of (bias)");
}

RowParallelLinearImpl::RowParallelLinearImpl(std::int64_t in, std::int64_t out, comm::Communicator& group,
                                             ParallelLinearOptions options)
    : in_features(in), out_features(out), group_(&group), options_(options) {
  if (options.gather_output) throw ConfigError("RowParallelLinear: gather_output is a column-parallel option");
  torch::nn::Linear whole(torch::nn::LinearOptions(in, out).bias(options.bias));
  weight = shard_parameter(*this, "weight", whole->weight, 1, group, "a row-parallel linear's input features");
  if (options.bias) {
    bias = register_parameter("bias", whole->bias.detach().clone());
    if (options.sequence_parallel) sum_gradient_over(bias, group);
  }
}

torch::Tensor RowParallelLinearImpl::forward(const torch::Tensor& x) {
  const auto partial = torch::nn::functional::linear(x, weight);
  auto y = options_.sequence_parallel ? scatter_to_sequence_region(partial, *group_, options_.sequence_dim)
                                      : reduce_from_tensor_region(partial, *group_);
  return bias.defined() ? y + bias : y;
}

void RowParallelLinearImpl::load_shard_of(const torch::Tensor& w, const torch::Tensor& b) {
  copy_shard(weight, w, 1, *group_, "RowParallelLinear::load_shard_of (weight)");
  if (bias.defined()) {
    torch::NoGradGuard no_grad;
    bias.copy_(b);
  }
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(std::int64_t vocab_, std::int64_t dim_,
                                                       comm::Communicator& group, ParallelLinearOptions options)
    : vocab(vocab_), dim(dim_), first_token(group.rank() * (vocab_ / group.size())), group_(&group),
      options_(options) {
  torch::nn::Embedding whole(vocab_, dim_);
  weight = shard_parameter(*this, "weight", whole->weight, 0, group, "a vocabulary-parallel embedding's vocabulary");
}

torch::Tensor VocabParallelEmbeddingImpl::forward(const torch::Tensor& tokens) {
  return vocab_parallel_embedding(tokens, weight, *group_, options_);
}

torch::Tensor vocab_parallel_embedding(const torch::Tensor& tokens, const torch::Tensor& weight,
                                       comm::Communicator& group, const ParallelLinearOptions& options) {
  const auto rows = weight.size(0), first = group.rank() * rows;
  const auto elsewhere = (tokens < first).logical_or(tokens >= first + rows);
  const auto local = (tokens - first).masked_fill(elsewhere, 0);
  const auto partial = torch::embedding(weight, local).masked_fill(elsewhere.unsqueeze(-1), 0);
  return options.sequence_parallel ? scatter_to_sequence_region(partial, group, options.sequence_dim)
                                   : reduce_from_tensor_region(partial, group);
}

void VocabParallelEmbeddingImpl::load_shard_of(const torch::Tensor& w) {
  copy_shard(weight, w, 0, *group_, "VocabParallelEmbedding::load_shard_of");
}

}  // namespace lockstep::tp
