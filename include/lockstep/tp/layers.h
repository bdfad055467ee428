// Tensor-parallel layers (Megatron-LM's): one layer's weights split over the T ranks of a tensor
// group, each built from the regions of tp/regions.h so that its communication reads off its
// forward.
//
//   ColumnParallelLinear    the output features split: rank r holds rows [r*out/T, (r+1)*out/T) of
//                           the weight and of the bias. Input whole on every rank (or, sequence
//                           parallel, a sequence shard, gathered first); output this rank's features.
//   RowParallelLinear       the input features split: rank r holds columns [r*in/T, (r+1)*in/T) of
//                           the weight; the bias is whole. Input this rank's features (a column-
//                           parallel layer's output); output whole (all-reduced) or, sequence
//                           parallel, this rank's sequence shard (reduce-scattered).
//   VocabParallelEmbedding  the vocabulary split: rank r holds rows [r*V/T, (r+1)*V/T); a token
//                           outside them looks up zeros, and the sum over the group is the lookup.
//
// A column then a row linear (an MLP, attention's projections) costs one all-reduce forward and
// one backward of the activations ([tokens, out] elements), and no weight traffic. Memory: each
// rank holds 1/T of the split weights and of their optimizer state.
//
// Initialisation: each layer draws its whole weight as torch::nn::Linear / Embedding would and
// keeps its shard, so ranks started from the same generator state hold the shards of the model
// one process would have built; load_shard_of copies a shard of given whole tensors instead.
// Sizes that T does not divide are a ConfigError naming the size and T.
//
// Thread-safety: as torch::nn modules. Every rank of the group runs the same layers in the same
// order (the communicator's rule).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>

#include "lockstep/comm/communicator.h"

namespace lockstep::tp {

struct ParallelLinearOptions {
  bool bias = true;
  // Column: gather the output's features on every rank (the layer then ends the region).
  bool gather_output = false;
  // Sequence parallel: the activations outside the layer are shards along `sequence_dim`.
  bool sequence_parallel = false;
  std::int64_t sequence_dim = 1;  // [batch, sequence, features]
};

class ColumnParallelLinearImpl : public torch::nn::Module {
 public:
  ColumnParallelLinearImpl(std::int64_t in_features, std::int64_t out_features, comm::Communicator& group,
                           ParallelLinearOptions options = {});
  torch::Tensor forward(const torch::Tensor& x);
  // This rank's rows of a whole Linear's weight [out, in] and bias [out] (bias may be undefined).
  void load_shard_of(const torch::Tensor& weight, const torch::Tensor& bias);

  const std::int64_t in_features, out_features;  // the whole layer's
  torch::Tensor weight, bias;                     // this rank's shard
 private:
  comm::Communicator* group_;
  ParallelLinearOptions options_;
};
TORCH_MODULE(ColumnParallelLinear);

class RowParallelLinearImpl : public torch::nn::Module {
 public:
  // Under sequence parallelism the bias's gradient is summed over the group (tp::sum_gradient_over).
  RowParallelLinearImpl(std::int64_t in_features, std::int64_t out_features, comm::Communicator& group,
                        ParallelLinearOptions options = {});
  torch::Tensor forward(const torch::Tensor& x);
  // This rank's columns of a whole Linear's weight [out, in]; the bias [out] whole.
  void load_shard_of(const torch::Tensor& weight, const torch::Tensor& bias);

  const std::int64_t in_features, out_features;
  torch::Tensor weight, bias;
 private:
  comm::Communicator* group_;
  ParallelLinearOptions options_;
};
TORCH_MODULE(RowParallelLinear);

class VocabParallelEmbeddingImpl : public torch::nn::Module {
 public:
  VocabParallelEmbeddingImpl(std::int64_t vocab, std::int64_t dim, comm::Communicator& group,
                             ParallelLinearOptions options = {});
  torch::Tensor forward(const torch::Tensor& tokens);  // [batch, sequence] -> [batch, sequence, dim]
  void load_shard_of(const torch::Tensor& weight);     // this rank's rows of a whole [vocab, dim]

  const std::int64_t vocab, dim, first_token;  // this rank holds tokens [first_token, + vocab / T)
  torch::Tensor weight;
 private:
  comm::Communicator* group_;
  ParallelLinearOptions options_;
};
TORCH_MODULE(VocabParallelEmbedding);

// VocabParallelEmbedding's forward over a weight held elsewhere (a model's own parameter, split
// in place): `weight` is this rank's rows [rank * rows, (rank + 1) * rows) of the vocabulary.
torch::Tensor vocab_parallel_embedding(const torch::Tensor& tokens, const torch::Tensor& weight,
                                       comm::Communicator& group, const ParallelLinearOptions& options = {});

// The rows [r*n/T, (r+1)*n/T) of `whole` along `dim` for rank r of a group of T: what a split
// layer holds. ConfigError when T does not divide the size, naming `what`.
torch::Tensor shard_of(const torch::Tensor& whole, std::int64_t dim, int rank, int ranks, const char* what);

}  // namespace lockstep::tp
