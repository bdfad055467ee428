// A decoder-only transformer (GPT-2's architecture) in the libtorch C++ frontend: token and
// learned position embeddings, pre-LayerNorm blocks of causal multi-head self-attention and a
// GELU MLP, dropout, and a language-model head tied to the token embedding. Hugging Face's
// GPT2LMHeadModel directories load into it and are written from it (models/hf_gpt2.h).
//
//   GptConfig config;                      // 4 layers, 4 heads, 256 wide, 128 tokens of context
//   GptLmHeadModel lm(config);             // logits = lm(tokens)      tokens [B, T] -> [B, T, vocab]
//   GptForSequenceClassification clf(config, 13);  // logits [B, 13], from the last real token
//   lm->set_gradient_checkpointing(true);  // each block recomputed in backward (ddp/gradient_checkpoint.h)
//
// Parameter names follow one scheme in both models ("transformer.h.0.attn.c_attn.weight", ...),
// so a language model's checkpoint loads into the classifier's body; only "score.weight" is new.
// Initialisation as GPT-2: weights N(0, 0.02), the projections into the residual stream
// N(0, 0.02 / sqrt(2 n_layer)), biases 0, LayerNorm 1 and 0.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/ddp/parameter_units.h"
#include "lockstep/pipe/units.h"
#include "lockstep/tp/shards.h"
#include "lockstep/train_core/matmuls.h"

namespace lockstep::comm {
class Communicator;
}

namespace lockstep::models {

struct GptConfig {
  int vocab_size = 256;  // byte-level
  int block_size = 128;  // the longest context the model sees
  int n_layer = 4;
  int n_head = 4;
  int n_embd = 256;
  double dropout = 0.1;
  // On the attention probabilities alone (Hugging Face's attn_pdrop); unset, it is `dropout`. At 0
  // (and in evaluation) libtorch 2.x can compute attention in one fused kernel, without the T x T
  // scores in memory (causal_attention below says where); libtorch 1.x has none.
  std::optional<double> attn_dropout;
  // The MLP's nonlinearity, by Hugging Face's names: "gelu" (exact, erf) or "gelu_new" (the tanh
  // approximation GPT-2 was trained with; models loaded from Hugging Face bring theirs).
  std::string activation = "gelu";
  double layer_norm_epsilon = 1e-5;

  // ConfigError naming the field: sizes must be positive, n_embd a multiple of n_head.
  void validate() const;
  double attention_dropout() const { return attn_dropout.value_or(dropout); }
  std::int64_t parameters() const;  // of the language model (the tied head counts once)
  nlohmann::json to_json() const;
  static GptConfig from_json(const nlohmann::json& j);  // ConfigError on missing fields
};

// softmax(q k^T / sqrt(d), causally masked) v for heads [B, H, T, d], with dropout p on the
// probabilities while training. Without dropout, on libtorch 2.x, one fused kernel
// (scaled_dot_product_attention: flash attention) on GPUs, and on the CPU in float32; otherwise,
// on the CPU from 512 tokens, models::causal_attention_in_strips (no T x T tensor kept); else the
// same arithmetic in steps, through the T x T scores.
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double p,
                               bool training);

class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  explicit CausalSelfAttentionImpl(const GptConfig& c);
  torch::Tensor forward(const torch::Tensor& x);
  // residual + forward(x), the output's dropout and the sum in one pass (models/dropout.h).
  torch::Tensor residual_forward(const torch::Tensor& residual, const torch::Tensor& x);

  torch::nn::Linear c_attn{nullptr}, c_proj{nullptr};
  // Tensor parallelism: keeps this rank's heads (their rows of c_attn, columns of c_proj) and
  // exchanges over `group` from then on (gpt_tensor_parallel.cc); with `sequence_parallel` its
  // input and output are this rank's slice of the sequence. Returns the shards it made.
  tp::ShardedParameters split(comm::Communicator& group, bool sequence_parallel);

 private:
  torch::Tensor projected(const torch::Tensor& x);  // forward before the output's dropout
  torch::Tensor split_projected(const torch::Tensor& x);
  torch::Tensor dropped(const torch::Tensor& y);  // the output's dropout (a sequence slice's masks)

  comm::Communicator* tensor_group_ = nullptr;
  bool sequence_parallel_ = false;
  int n_head_;
  double attn_dropout_;  // on the attention probabilities (models/dropout.h)
  double dropout_;       // on the output
};
TORCH_MODULE(CausalSelfAttention);

class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const GptConfig& c);
  torch::Tensor forward(const torch::Tensor& x);
  // residual + forward(x), the output's dropout and the sum in one pass (models/dropout.h).
  torch::Tensor residual_forward(const torch::Tensor& residual, const torch::Tensor& x);

  torch::nn::Linear c_fc{nullptr}, c_proj{nullptr};
  // Tensor parallelism: keeps this rank's hidden features (rows of c_fc, columns of c_proj).
  // Returns the shards it made.
  tp::ShardedParameters split(comm::Communicator& group, bool sequence_parallel);

 private:
  torch::Tensor projected(const torch::Tensor& x);  // forward before the output's dropout
  torch::Tensor split_projected(const torch::Tensor& x);
  torch::Tensor dropped(const torch::Tensor& y);

  comm::Communicator* tensor_group_ = nullptr;
  bool sequence_parallel_ = false;
  std::string approximate_;  // torch::gelu's: "none" or "tanh"
  double dropout_;
};
TORCH_MODULE(Mlp);

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const GptConfig& c);
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  CausalSelfAttention attn{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(Block);

// The body: embeddings, blocks, final LayerNorm. hidden = body(tokens), [B, T] -> [B, T, C].
class GptModelImpl : public torch::nn::Module {
 public:
  explicit GptModelImpl(const GptConfig& c);
  torch::Tensor forward(const torch::Tensor& tokens);
  // With the dropout masks' seed given instead of drawn from the default CPU generator (the one
  // draw a training forward makes): for callers that keep their own streams (ranks as threads).
  torch::Tensor forward_seeded(const torch::Tensor& tokens, std::uint64_t seed);
  void set_gradient_checkpointing(bool on) { checkpointing_ = on; }
  // ZeRO stage 3 (ddp/parameter_units.h): each block is a unit; the embeddings and ln_f the root.
  std::vector<std::shared_ptr<torch::nn::Module>> parameter_units();
  void set_unit_runner(UnitRunner runner) { runner_ = std::move(runner); }
  const GptConfig& config() const { return config_; }
  // What forward runs, in parts a pipeline can cut between (GptLmHeadModel::pipeline_units): the
  // embeddings, then block i. `seed` is the forward's one draw from the default CPU generator
  // (while training); each part takes its dropout masks from it and its own index (models/dropout.h).
  torch::Tensor embed(const torch::Tensor& tokens, std::uint64_t seed);
  torch::Tensor block(int i, const torch::Tensor& x, std::uint64_t seed);
  // The blocks' products for `samples` sequences of block_size tokens: per block the QKV and
  // output projections, attention's two batched products (full T x T: no causal skipping), the
  // MLP's two.
  std::vector<train::Matmul> forward_matmuls(std::int64_t samples) const;

  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};

  // Tensor parallelism: this rank's rows of the vocabulary, heads and hidden features (see
  // GptLmHeadModel::split_for_tensor_parallel).
  void split(comm::Communicator& group, bool sequence_parallel);
  comm::Communicator* tensor_group() const { return tensor_group_; }
  bool sequence_parallel() const { return sequence_parallel_; }
  std::vector<torch::Tensor> split_parameters() const;  // the shards of split tensors
  // Each shard with where it sits in its whole tensor (what checkpoints save and load whole).
  const tp::ShardedParameters& tensor_shards() const { return shards_; }

 private:
  tp::ShardedParameters shards_;
  torch::Tensor split_embed(const torch::Tensor& tokens);  // before the embeddings' dropout
  comm::Communicator* tensor_group_ = nullptr;
  bool sequence_parallel_ = false;
  GptConfig config_;
  bool checkpointing_ = false;
  UnitRunner runner_;
};
TORCH_MODULE(GptModel);

class GptLmHeadModelImpl : public torch::nn::Module, public train::CountsMatmuls {
 public:
  explicit GptLmHeadModelImpl(const GptConfig& c);
  torch::Tensor forward(const torch::Tensor& tokens);  // logits [B, T, vocab]
  torch::Tensor forward_seeded(const torch::Tensor& tokens, std::uint64_t seed);  // GptModel::forward's seed
  std::vector<train::Matmul> forward_matmuls(std::int64_t samples) const override;  // the body's and the head's
  void set_gradient_checkpointing(bool on) { transformer->set_gradient_checkpointing(on); }
  std::vector<std::shared_ptr<torch::nn::Module>> parameter_units() { return transformer->parameter_units(); }
  void set_unit_runner(UnitRunner runner) { transformer->set_unit_runner(std::move(runner)); }
  const GptConfig& config() const { return transformer->config(); }
  // The model as a pipeline's units (pipe/units.h): "embedding" (wte, wpe), "h.0" ... "h.{n-1}",
  // and "head" (ln_f and the tied head, which reads wte again): forward to the bit, in order.
  std::vector<pipe::PipelineUnit> pipeline_units();

  // Tensor parallelism (lockstep/tp, Megatron-LM's plan): splits the model in place over the T
  // ranks of `group`, each keeping its shard of the weights it holds now: the vocabulary (the
  // embedding's rows, and so the tied head's), the attention heads (q, k and v's rows, the output
  // projection's columns) and the MLP's hidden features; the position embedding, the layer norms
  // and the output projections' biases stay whole. Each block then all-reduces twice forward (after
  // attention and after the MLP) and twice backward, and forward returns this rank's vocabulary
  // columns of the logits [B, T, vocab / T]: their loss is tp::vocab_parallel_cross_entropy. The
  // dropout masks are one process's (the heads' from the whole tensor's counter), so the split
  // model trains as the whole one up to the order of sums. Every rank of the group calls it, in
  // the same state. ConfigError when T does not divide n_head or vocab_size, or when already split.
  // With `sequence_parallel` (Megatron's sequence parallelism) the activations between the split
  // layers are slices of the sequence too: layer norms, dropouts and residuals on T-th of the
  // tokens each, an all-gather before each column-parallel layer and a reduce-scatter after each
  // row-parallel one instead of the all-reduces, the whole parameters' gradients (norms,
  // positions, biases) summed over the group. The sequence must divide by T (else ConfigError).
  void split_for_tensor_parallel(comm::Communicator& group, bool sequence_parallel = false) {
    transformer->split(group, sequence_parallel);
  }
  std::vector<torch::Tensor> split_parameters() const { return transformer->split_parameters(); }
  const tp::ShardedParameters& tensor_shards() const { return transformer->tensor_shards(); }

  GptModel transformer{nullptr};
};
TORCH_MODULE(GptLmHeadModel);

// Classifies a sequence from the hidden state of its last real token; tokens equal to
// `pad_token` at the end are padding (GPT-2's sequence classifier does the same).
class GptForSequenceClassificationImpl : public torch::nn::Module, public train::CountsMatmuls {
 public:
  GptForSequenceClassificationImpl(const GptConfig& c, int num_labels, int pad_token = 0);
  torch::Tensor forward(const torch::Tensor& tokens);  // logits [B, num_labels]
  std::vector<train::Matmul> forward_matmuls(std::int64_t samples) const override;  // the body's and the score's
  void set_gradient_checkpointing(bool on) { transformer->set_gradient_checkpointing(on); }
  std::vector<std::shared_ptr<torch::nn::Module>> parameter_units() { return transformer->parameter_units(); }
  void set_unit_runner(UnitRunner runner) { transformer->set_unit_runner(std::move(runner)); }
  const GptConfig& config() const { return transformer->config(); }

  GptModel transformer{nullptr};
  torch::nn::Linear score{nullptr};

 private:
  int pad_token_;
};
TORCH_MODULE(GptForSequenceClassification);

struct SamplingOptions {
  int max_new_tokens = 200;
  double temperature = 0.8;  // 0: always the most likely token
  int top_k = 40;            // 0: every token
  std::uint64_t seed = 0;
  int stop_token = -1;       // ends generation early when sampled (-1: never)
};

// Appends up to max_new_tokens sampled tokens to `prompt` (the model in eval mode, no grad).
std::vector<std::int64_t> generate(GptLmHeadModel& model, std::vector<std::int64_t> prompt,
                                   const SamplingOptions& options);

}  // namespace lockstep::models
