// The GPT split for tensor parallelism (gpt.h's split_for_tensor_parallel; Megatron-LM's plan):
// which rows and columns each rank keeps, and the forward of a split attention and MLP, built from
// lockstep/tp's regions. Each block: the input enters through copy_to_tensor_region (identity
// forward, the input gradient all-reduced backward), q, k and v of this rank's heads come from its
// rows of c_attn, attention runs on those heads, and the output projection's partial sums leave
// through reduce_from_tensor_region (all-reduced forward) before the whole bias; the MLP likewise
// over this rank's hidden features.
#include <torch/torch.h>

#include <cmath>

#include "lockstep/comm/communicator.h"
#include "lockstep/error.h"
#include "lockstep/models/activation.h"
#include "lockstep/models/attention.h"
#include "lockstep/models/dropout.h"
#include "lockstep/models/gpt.h"
#include "lockstep/models/linear.h"
#include "lockstep/tp/layers.h"
#include "lockstep/tp/regions.h"
#include "lockstep/tp/shards.h"

namespace lockstep::models {
namespace {

// The parameter now holds its part `shard` of what it held (the same tensor object: whatever
// refers to it sees the shard), and `kept` says where the part sits in the whole.
void keep(torch::Tensor& parameter, const tp::TensorShard& shard, tp::ShardedParameters& kept) {
  torch::NoGradGuard no_grad;
  parameter.set_data(shard.take(parameter));
  kept.emplace_back(parameter, shard);
}

void check_divides(std::int64_t n, int ranks, const char* what) {
  if (n % ranks != 0)
    throw ConfigError("--tensor-parallel " + std::to_string(ranks) + " does not divide the GPT's " + what + " (" +
                      std::to_string(n) + "): use a tensor-parallel degree that divides it");
}

void check_not_split(const comm::Communicator* group) {
  if (group) throw ConfigError("the GPT is already split for tensor parallelism");
}

// Causal attention on this rank's heads [B, H/T, T, d], heads [first_head, + H/T) of `heads`.
// With dropout, the probabilities' mask is the one the whole [B, H, T, T] tensor draws
// (fast_dropout_shard), so the split run drops what one process drops.
torch::Tensor heads_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double p,
                              bool training, std::int64_t first_head, std::int64_t heads) {
  if (!(training && p > 0)) return causal_attention(q, k, v, 0, training);
  const auto b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const auto scores = at::bmm(q.reshape({b * h, t, d}), k.reshape({b * h, t, d}).transpose(1, 2)).view({b, h, t, t});
  const auto probabilities = causal_softmax_dropout(scores, scale, 0, training);
  const ShardOf where{{b, heads, t, t}, {0, first_head, 0, 0}};
  return torch::matmul(fast_dropout_shard(probabilities, p, training, where), v);
}

// The sequence-parallel activation `y` ([B, T/ranks, C], this rank's slice) as the whole one's slice.
ShardOf sequence_slice(const torch::Tensor& y, const comm::Communicator& group) {
  return ShardOf::slice(y, 1, group.rank(), group.size());
}

// Enters the column-parallel layers: all-gathered from the sequence's slices, or copied.
torch::Tensor enter(const torch::Tensor& x, comm::Communicator& group, bool sequence_parallel) {
  return sequence_parallel ? tp::gather_from_sequence_region(x, group, 1) : tp::copy_to_tensor_region(x, group);
}

// Leaves the row-parallel projection: its partial sums reduce-scattered into the sequence's
// slices, or all-reduced; then its bias, which every rank holds whole.
torch::Tensor leave(const torch::Tensor& partial, const torch::Tensor& bias, comm::Communicator& group,
                    bool sequence_parallel) {
  const auto out = sequence_parallel ? tp::scatter_to_sequence_region(partial, group, 1)
                                     : tp::reduce_from_tensor_region(partial, group);
  return out + bias.to(out.scalar_type());
}

// A block's output dropout: the whole tensor's mask, or under sequence parallelism the whole
// tensor's mask at this rank's tokens.
torch::Tensor output_dropout(const torch::Tensor& y, double p, bool training, const comm::Communicator* group,
                             bool sequence_parallel) {
  if (!sequence_parallel) return fast_dropout(y, p, training);
  return fast_dropout_shard(y, p, training, sequence_slice(y, *group));
}

// The block now computes its part in `group`. Under sequence parallelism each rank adds the output
// bias to its own tokens only, so the bias's gradient is summed over the group.
void join(comm::Communicator& group, bool sequence_parallel, torch::Tensor& output_bias,
          comm::Communicator*& tensor_group, bool& block_sequence_parallel) {
  if (sequence_parallel) tp::sum_gradient_over(output_bias, group);
  tensor_group = &group;
  block_sequence_parallel = sequence_parallel;
}

}  // namespace

tp::ShardedParameters CausalSelfAttentionImpl::split(comm::Communicator& group, bool sequence_parallel) {
  check_not_split(tensor_group_);
  const int ranks = group.size(), rank = group.rank();
  check_divides(n_head_, ranks, "n_head");
  const auto c = c_proj->weight.size(0), part = c / ranks;
  tp::ShardedParameters kept;
  // c_attn's rows are [q; k; v], each [heads x head_dim]: this rank's heads of each.
  keep(c_attn->weight, tp::TensorShard::of({3 * c, c}, {3, c, c}, 1, rank, ranks, {3 * part, c}), kept);
  keep(c_attn->bias, tp::TensorShard::of({3 * c}, {3, c}, 1, rank, ranks, {3 * part}), kept);
  keep(c_proj->weight, tp::TensorShard::of({c, c}, {}, 1, rank, ranks), kept);
  join(group, sequence_parallel, c_proj->bias, tensor_group_, sequence_parallel_);
  return kept;
}

torch::Tensor CausalSelfAttentionImpl::dropped(const torch::Tensor& y) {
  return output_dropout(y, dropout_, is_training(), tensor_group_, sequence_parallel_);
}

torch::Tensor CausalSelfAttentionImpl::split_projected(const torch::Tensor& x) {
  comm::Communicator& group = *tensor_group_;
  const auto in = enter(x, group, sequence_parallel_);  // [B, T, C]: every token
  const std::int64_t b = in.size(0), t = in.size(1), c = in.size(2), d = c / n_head_, heads = n_head_ / group.size();
  const auto qkv = fast_linear(in, c_attn->weight, c_attn->bias)
                       .view({b, t, 3, heads, d})
                       .permute({2, 0, 3, 1, 4})
                       .contiguous()
                       .unbind(0);
  const auto y = heads_attention(qkv[0], qkv[1], qkv[2], attn_dropout_, is_training(), group.rank() * heads, n_head_)
                     .transpose(1, 2)
                     .contiguous()
                     .view({b, t, heads * d});
  return leave(fast_linear(y, c_proj->weight), c_proj->bias, group, sequence_parallel_);
}

tp::ShardedParameters MlpImpl::split(comm::Communicator& group, bool sequence_parallel) {
  check_not_split(tensor_group_);
  const int ranks = group.size(), rank = group.rank();
  check_divides(c_fc->weight.size(0), ranks, "MLP width (4 n_embd)");
  tp::ShardedParameters kept;
  keep(c_fc->weight, tp::TensorShard::of(c_fc->weight.sizes().vec(), {}, 0, rank, ranks), kept);
  keep(c_fc->bias, tp::TensorShard::of(c_fc->bias.sizes().vec(), {}, 0, rank, ranks), kept);
  keep(c_proj->weight, tp::TensorShard::of(c_proj->weight.sizes().vec(), {}, 1, rank, ranks), kept);
  join(group, sequence_parallel, c_proj->bias, tensor_group_, sequence_parallel_);
  return kept;
}

torch::Tensor MlpImpl::dropped(const torch::Tensor& y) {
  return output_dropout(y, dropout_, is_training(), tensor_group_, sequence_parallel_);
}

torch::Tensor MlpImpl::split_projected(const torch::Tensor& x) {
  comm::Communicator& group = *tensor_group_;
  const auto in = enter(x, group, sequence_parallel_);
  const auto hidden = x.is_cpu() ? fast_bias_gelu(fast_linear(in, c_fc->weight), c_fc->bias, approximate_)
                                 : torch::gelu(fast_linear(in, c_fc->weight, c_fc->bias), approximate_);
  return leave(fast_linear(hidden, c_proj->weight), c_proj->bias, group, sequence_parallel_);
}

void GptModelImpl::split(comm::Communicator& group, bool sequence_parallel) {
  check_not_split(tensor_group_);
  const int ranks = group.size();
  check_divides(config_.vocab_size, ranks, "vocab_size");
  check_divides(config_.n_head, ranks, "n_head");
  shards_.clear();
  keep(wte->weight, tp::TensorShard::of(wte->weight.sizes().vec(), {}, 0, group.rank(), ranks), shards_);
  for (const auto& block : *h) {
    auto* b = block->as<BlockImpl>();
    for (auto kept : {b->attn->split(group, sequence_parallel), b->mlp->split(group, sequence_parallel)})
      shards_.insert(shards_.end(), kept.begin(), kept.end());  // the list is built in order: attention first
    // Sequence parallel: each rank normalises its own tokens, so holds part of the norms' gradients.
    if (sequence_parallel)
      for (auto* t : {&b->ln_1->weight, &b->ln_1->bias, &b->ln_2->weight, &b->ln_2->bias})
        tp::sum_gradient_over(*t, group);
  }
  if (sequence_parallel)
    for (auto* t : {&ln_f->weight, &ln_f->bias, &wpe->weight}) tp::sum_gradient_over(*t, group);
  tensor_group_ = &group;
  sequence_parallel_ = sequence_parallel;
}

// The embeddings of this rank's slice of the sequence: the split vocabulary's lookups
// reduce-scattered over the sequence, its positions, and their dropout's slice of the whole mask.
torch::Tensor GptModelImpl::split_embed(const torch::Tensor& tokens) {
  comm::Communicator& group = *tensor_group_;
  tp::ParallelLinearOptions sequence;
  sequence.sequence_parallel = true;
  const auto mine = tp::vocab_parallel_embedding(tokens, wte->weight, group, sequence);
  const auto t = mine.size(1);
  const auto positions =
      torch::arange(group.rank() * t, (group.rank() + 1) * t, torch::TensorOptions().dtype(torch::kLong).device(tokens.device()));
  const auto x = mine + wpe(positions);
  return fast_dropout_shard(x, config_.dropout, is_training(), sequence_slice(x, group));
}

std::vector<torch::Tensor> GptModelImpl::split_parameters() const {
  std::vector<torch::Tensor> out;
  for (const auto& [parameter, shard] : shards_) out.push_back(parameter);
  return out;
}

}  // namespace lockstep::models
