#include "lockstep/models/gpt.h"

#include <torch/torch.h>

#include <cmath>

#include "lockstep/ddp/cpu_rng.h"
#include "lockstep/ddp/gradient_checkpoint.h"
#include "lockstep/ddp/torch_compat.h"
#include "lockstep/models/activation.h"
#include "lockstep/models/attention.h"
#include "lockstep/models/dropout.h"
#include "lockstep/models/linear.h"
#include "lockstep/models/norm.h"
#include "lockstep/error.h"
#include "lockstep/tp/regions.h"
#include "lockstep/tp/layers.h"

namespace lockstep::models {
namespace {

void normal_init(torch::Tensor& t, double std) {
  torch::NoGradGuard no_grad;
  t.normal_(0.0, std);
}

void zero_init(torch::Tensor& t) {
  torch::NoGradGuard no_grad;
  t.zero_();
}

torch::nn::Linear initialised_linear(int in, int out, double std, bool bias = true) {
  torch::nn::Linear l(torch::nn::LinearOptions(in, out).bias(bias));
  normal_init(l->weight, std);
  if (bias) zero_init(l->bias);
  return l;
}

torch::nn::LayerNormOptions layer_norm(const GptConfig& c) {
  return torch::nn::LayerNormOptions({c.n_embd}).eps(c.layer_norm_epsilon);
}

// The layer norms in one pass each way with the cast to the next product's dtype (models/norm.h).
torch::Tensor normed(const torch::nn::LayerNorm& norm, const torch::Tensor& x) {
  return fast_layer_norm(x, norm->weight, norm->bias, norm->options.eps());
}

// The dropout seed of part `index` of a forward (0: the embeddings, i + 1: block i).
std::uint64_t part_seed(std::uint64_t seed, int index) {
  std::uint64_t z = seed ^ (0x9e3779b97f4a7c15ULL * static_cast<std::uint64_t>(index + 1));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Added to the attention scores: -inf in the strictly upper triangle (position t may not attend to
// positions after it), 0 elsewhere.
torch::Tensor causal_mask(std::int64_t t, const torch::TensorOptions& options) {
  return torch::full({t, t}, -std::numeric_limits<float>::infinity(), options).triu(1);
}

}  // namespace

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double p,
                               bool training) {
  // On the CPU only in float32: there the fused kernel's bf16 backward was 2.4-2.8x slower than
  // the stepwise one, its float32 forward and backward 1.4-1.9x faster (PyTorch 2.15, the GPT's
  // shapes; bench/gpt_kernels.py, bench/RESULTS.md).
  const bool fused_is_faster = !q.device().is_cpu() || q.scalar_type() == torch::kFloat;
  if (torch_compat::kFusedAttention && !(training && p > 0) && fused_is_faster)
    return torch_compat::fused_causal_attention(q, k, v);
  const auto b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  // From 512 tokens the strips keep no T x T tensor for backward and ran 1.25-1.5x as fast in
  // float32, 1.0-1.17x in bf16; at 128 tokens 0.75-0.85x (bench/RESULTS.md, attention_bench).
  constexpr std::int64_t kStripsFrom = 512;
  if (q.device().is_cpu() && t >= kStripsFrom) return causal_attention_in_strips(q, k, v, scale, p, training);
  if (q.device().is_cpu()) {
    // The scale, mask, softmax and dropout in one pass each way (models/attention.h).
    const auto scores = at::bmm(q.reshape({b * h, t, d}), k.reshape({b * h, t, d}).transpose(1, 2));
    return torch::matmul(causal_softmax_dropout(scores.view({b, h, t, t}), scale, p, training), v);
  }
  // The mask plus the scaled products in one batched product: the scale is its alpha, the mask its
  // addend. Separate passes for the scale and the mask took a fifth of the attention's time.
  const auto scores = at::baddbmm(causal_mask(t, q.options()), q.reshape({b * h, t, d}),
                                  k.reshape({b * h, t, d}).transpose(1, 2), /*beta=*/1, /*alpha=*/scale);
  return torch::matmul(fast_dropout(torch::softmax(scores.view({b, h, t, t}), -1), p, training), v);
}

void GptConfig::validate() const {
  auto positive = [](const char* name, int v) {
    if (v < 1) throw ConfigError(std::string("GPT ") + name + " must be at least 1 (got " + std::to_string(v) + ")");
  };
  positive("vocab_size", vocab_size);
  positive("block_size", block_size);
  positive("n_layer", n_layer);
  positive("n_head", n_head);
  positive("n_embd", n_embd);
  if (n_embd % n_head != 0)
    throw ConfigError("GPT n_embd " + std::to_string(n_embd) + " is not a multiple of n_head " +
                      std::to_string(n_head) + ": each head takes n_embd / n_head dimensions");
  if (!(dropout >= 0 && dropout < 1)) throw ConfigError("GPT dropout must be within [0, 1)");
  const double attn = attention_dropout();
  if (!(attn >= 0 && attn < 1)) throw ConfigError("GPT attn_dropout must be within [0, 1)");
  if (activation != "gelu" && activation != "gelu_new")
    throw ConfigError("GPT activation '" + activation + "' is not one lockstep's GPT has: use gelu or gelu_new");
  if (!(layer_norm_epsilon > 0)) throw ConfigError("GPT layer_norm_epsilon must be positive");
}

std::int64_t GptConfig::parameters() const {
  const std::int64_t c = n_embd;
  const std::int64_t block = 2 * 2 * c + (3 * c * c + 3 * c) + (c * c + c) + (4 * c * c + 4 * c) + (4 * c * c + c);
  return static_cast<std::int64_t>(vocab_size) * c + static_cast<std::int64_t>(block_size) * c + n_layer * block +
         2 * c;
}

nlohmann::json GptConfig::to_json() const {
  return {{"model_type", "gpt"}, {"vocab_size", vocab_size}, {"block_size", block_size}, {"n_layer", n_layer},
          {"n_head", n_head},     {"n_embd", n_embd},         {"dropout", dropout},
          {"attn_dropout", attention_dropout()}, {"activation", activation}, {"layer_norm_epsilon", layer_norm_epsilon}};
}

GptConfig GptConfig::from_json(const nlohmann::json& j) {
  GptConfig c;
  try {
    if (j.value("model_type", "") != "gpt") throw ConfigError("it does not describe a GPT model (model_type != gpt)");
    c.vocab_size = j.at("vocab_size").get<int>();
    c.block_size = j.at("block_size").get<int>();
    c.n_layer = j.at("n_layer").get<int>();
    c.n_head = j.at("n_head").get<int>();
    c.n_embd = j.at("n_embd").get<int>();
    c.dropout = j.value("dropout", 0.0);
    if (j.contains("attn_dropout")) c.attn_dropout = j.at("attn_dropout").get<double>();  // else: dropout's
    c.activation = j.value("activation", c.activation);  // checkpoints from before it was a choice: exact
    c.layer_norm_epsilon = j.value("layer_norm_epsilon", c.layer_norm_epsilon);
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(std::string("a GPT configuration lacks a field (") + e.what() + ")");
  }
  c.validate();
  return c;
}

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GptConfig& c)
    : n_head_(c.n_head), attn_dropout_(c.attention_dropout()), dropout_(c.dropout) {
  const double residual_std = 0.02 / std::sqrt(2.0 * c.n_layer);
  c_attn = register_module("c_attn", initialised_linear(c.n_embd, 3 * c.n_embd, 0.02));
  c_proj = register_module("c_proj", initialised_linear(c.n_embd, c.n_embd, residual_std));
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x) {
  return dropped(projected(x));
}

torch::Tensor CausalSelfAttentionImpl::residual_forward(const torch::Tensor& residual,
                                                        const torch::Tensor& x) {
  if (sequence_parallel_) return residual + dropped(projected(x));
  return fast_dropout_add(residual, projected(x), dropout_, is_training());
}

torch::Tensor CausalSelfAttentionImpl::projected(const torch::Tensor& x) {
  if (tensor_group_) return split_projected(x);
  const auto b = x.size(0), t = x.size(1), c = x.size(2), d = c / n_head_;
  // One copy to [3, B, H, T, d], runs of d elements at a time: q, k and v each contiguous, which the
  // batched products take as they are (k transposed too). Views of [B, T, H, d] were copied by each
  // product instead, k element by element.
  const auto qkv = fast_linear(x, c_attn->weight, c_attn->bias)
                       .view({b, t, 3, n_head_, d})
                       .permute({2, 0, 3, 1, 4})
                       .contiguous()
                       .unbind(0);
  const auto y = causal_attention(qkv[0], qkv[1], qkv[2], attn_dropout_, is_training())
                     .transpose(1, 2)
                     .contiguous()
                     .view({b, t, c});
  return fast_linear(y, c_proj->weight, c_proj->bias);
}

MlpImpl::MlpImpl(const GptConfig& c)
    : approximate_(c.activation == "gelu_new" ? "tanh" : "none"), dropout_(c.dropout) {
  c_fc = register_module("c_fc", initialised_linear(c.n_embd, 4 * c.n_embd, 0.02));
  const double residual_std = 0.02 / std::sqrt(2.0 * c.n_layer);
  c_proj = register_module("c_proj", initialised_linear(4 * c.n_embd, c.n_embd, residual_std));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  return dropped(projected(x));
}

torch::Tensor MlpImpl::residual_forward(const torch::Tensor& residual, const torch::Tensor& x) {
  if (sequence_parallel_) return residual + dropped(projected(x));
  return fast_dropout_add(residual, projected(x), dropout_, is_training());
}

// On the CPU the bias and the GELU in one pass (models/activation.h); on a GPU the bias inside the
// product, as before.
torch::Tensor MlpImpl::projected(const torch::Tensor& x) {
  if (tensor_group_) return split_projected(x);
  const auto hidden = x.is_cpu() ? fast_bias_gelu(fast_linear(x, c_fc->weight), c_fc->bias, approximate_)
                                 : torch::gelu(fast_linear(x, c_fc->weight, c_fc->bias), approximate_);
  return fast_linear(hidden, c_proj->weight, c_proj->bias);
}

BlockImpl::BlockImpl(const GptConfig& c) {
  ln_1 = register_module("ln_1", torch::nn::LayerNorm(layer_norm(c)));
  attn = register_module("attn", CausalSelfAttention(c));
  ln_2 = register_module("ln_2", torch::nn::LayerNorm(layer_norm(c)));
  mlp = register_module("mlp", Mlp(c));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x) {
  const auto h = attn->residual_forward(x, normed(ln_1, x));
  return mlp->residual_forward(h, normed(ln_2, h));
}

GptModelImpl::GptModelImpl(const GptConfig& c) : config_(c) {
  c.validate();
  wte = register_module("wte", torch::nn::Embedding(c.vocab_size, c.n_embd));
  wpe = register_module("wpe", torch::nn::Embedding(c.block_size, c.n_embd));
  normal_init(wte->weight, 0.02);
  normal_init(wpe->weight, 0.02);
  h = register_module("h", torch::nn::ModuleList());
  for (int i = 0; i < c.n_layer; ++i) h->push_back(Block(c));
  ln_f = register_module("ln_f", torch::nn::LayerNorm(layer_norm(c)));
}

torch::Tensor GptModelImpl::forward(const torch::Tensor& tokens) {
  return forward_seeded(tokens, is_training() ? draw_cpu_seed() : 0);
}

torch::Tensor GptModelImpl::forward_seeded(const torch::Tensor& tokens, std::uint64_t seed) {
  auto x = embed(tokens, seed);
  for (int i = 0; i < int(h->size()); ++i) x = block(i, x, seed);
  return normed(ln_f, x);
}

torch::Tensor GptModelImpl::embed(const torch::Tensor& tokens, std::uint64_t seed) {
  const auto t = tokens.size(1);
  if (t > config_.block_size)
    throw ConfigError("a sequence of " + std::to_string(t) + " tokens is longer than the model's context (block_size " +
                      std::to_string(config_.block_size) + "): use blocks of at most that many tokens");
  DropoutSeeds masks(part_seed(seed, 0));
  auto positions = torch::arange(t, torch::TensorOptions().dtype(torch::kLong).device(tokens.device()));
  if (sequence_parallel_) return split_embed(tokens);
  const auto tokens_in = tensor_group_ ? tp::vocab_parallel_embedding(tokens, wte->weight, *tensor_group_) : wte(tokens);
  return fast_dropout(tokens_in + wpe(positions), config_.dropout, is_training());
}

torch::Tensor GptModelImpl::block(int i, const torch::Tensor& x, std::uint64_t seed) {
  auto block = h[std::size_t(i)]->as<BlockImpl>();
  // The seed is captured, so a checkpointed block's recomputation draws the same masks.
  const UnitForward unit = [this, i, block, seed](const torch::Tensor& in) {
    return run_unit(runner_, i, [block, i, seed](const torch::Tensor& y) {
      DropoutSeeds masks(part_seed(seed, i + 1));
      return block->forward(y);
    }, in);
  };
  return checkpointing_ && is_training() ? gradient_checkpoint(unit, x) : unit(x);
}

std::vector<train::Matmul> GptModelImpl::forward_matmuls(std::int64_t samples) const {
  const std::int64_t t = config_.block_size, c = config_.n_embd, heads = config_.n_head, rows = samples * t;
  const std::vector<train::Matmul> block = {
      {1, rows, c, 3 * c},                  // query, key, value
      {samples * heads, t, c / heads, t},   // scores: q k^T
      {samples * heads, t, t, c / heads},   // scores v
      {1, rows, c, c},                      // attention's output projection
      {1, rows, c, 4 * c},                  // MLP in
      {1, rows, 4 * c, c}};                 // MLP out
  std::vector<train::Matmul> out;
  for (int layer = 0; layer < config_.n_layer; ++layer) out.insert(out.end(), block.begin(), block.end());
  return out;
}

std::vector<std::shared_ptr<torch::nn::Module>> GptModelImpl::parameter_units() {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (const auto& block : *h) out.push_back(block);
  return out;
}

GptLmHeadModelImpl::GptLmHeadModelImpl(const GptConfig& c) {
  transformer = register_module("transformer", GptModel(c));
}

torch::Tensor GptLmHeadModelImpl::forward(const torch::Tensor& tokens) {
  return forward_seeded(tokens, is_training() ? draw_cpu_seed() : 0);
}

namespace {

// The logits of the final norm's output `hidden`: the head shares the token embedding's weights
// (weight tying); split, this rank's rows of them give its vocabulary columns, for every token
// (sequence parallel: gathered first).
torch::Tensor tied_head(GptModelImpl& body, const torch::Tensor& hidden) {
  comm::Communicator* group = body.tensor_group();
  if (!group) return fast_linear(hidden, body.wte->weight);
  const auto in = body.sequence_parallel() ? tp::gather_from_sequence_region(hidden, *group, 1)
                                           : tp::copy_to_tensor_region(hidden, *group);
  return fast_linear(in, body.wte->weight);
}

}  // namespace

torch::Tensor GptLmHeadModelImpl::forward_seeded(const torch::Tensor& tokens, std::uint64_t seed) {
  return tied_head(*transformer, transformer->forward_seeded(tokens, seed));
}

// Split for tensor parallelism, the units are the split ones: each rank's pipeline runs its shards,
// and the units' collectives meet those of its tensor group's pipelines (pipe::PipelineOptions).
std::vector<pipe::PipelineUnit> GptLmHeadModelImpl::pipeline_units() {
  auto named = [](const torch::nn::Module& m, const std::string& prefix) {
    std::vector<std::pair<std::string, torch::Tensor>> out;
    for (const auto& p : m.named_parameters()) out.emplace_back(prefix + p.key(), p.value());
    return out;
  };
  GptModelImpl* body = transformer.get();
  std::vector<pipe::PipelineUnit> units;
  units.push_back({"embedding",
                   {{"transformer.wte.weight", body->wte->weight}, {"transformer.wpe.weight", body->wpe->weight}},
                   [body](const torch::Tensor& tokens, std::uint64_t seed) { return body->embed(tokens, seed); }});
  for (int i = 0; i < int(body->h->size()); ++i)
    units.push_back({"h." + std::to_string(i), named(*body->h[std::size_t(i)], "transformer.h." + std::to_string(i) + "."),
                     [body, i](const torch::Tensor& x, std::uint64_t seed) { return body->block(i, x, seed); }});
  auto head = named(*body->ln_f, "transformer.ln_f.");
  head.emplace_back("transformer.wte.weight", body->wte->weight);
  units.push_back({"head", head, [body](const torch::Tensor& x, std::uint64_t) {
                     return tied_head(*body, normed(body->ln_f, x));
                   }});
  return units;
}

std::vector<train::Matmul> GptLmHeadModelImpl::forward_matmuls(std::int64_t samples) const {
  auto out = transformer->forward_matmuls(samples);
  out.push_back({1, samples * config().block_size, config().n_embd, config().vocab_size});  // the tied head
  return out;
}

GptForSequenceClassificationImpl::GptForSequenceClassificationImpl(const GptConfig& c, int num_labels, int pad_token)
    : pad_token_(pad_token) {
  if (num_labels < 2) throw ConfigError("a classifier needs at least 2 labels (got " + std::to_string(num_labels) + ")");
  transformer = register_module("transformer", GptModel(c));
  score = register_module("score", initialised_linear(c.n_embd, num_labels, 0.02, /*bias=*/false));
}

torch::Tensor GptForSequenceClassificationImpl::forward(const torch::Tensor& tokens) {
  auto hidden = transformer(tokens);  // [B, T, C]
  // The last token before the padding (or the last one, when the sequence fills the block).
  auto last = (tokens != pad_token_).to(torch::kLong).sum(1).sub(1).clamp_min(0);  // [B]
  auto rows = torch::arange(tokens.size(0), torch::TensorOptions().dtype(torch::kLong).device(tokens.device()));
  return score(hidden.index({rows, last}));
}

std::vector<train::Matmul> GptForSequenceClassificationImpl::forward_matmuls(std::int64_t samples) const {
  auto out = transformer->forward_matmuls(samples);
  out.push_back({1, samples, config().n_embd, score->options.out_features()});  // the last token's only
  return out;
}

std::vector<std::int64_t> generate(GptLmHeadModel& model, std::vector<std::int64_t> tokens,
                                   const SamplingOptions& o) {
  if (tokens.empty()) throw ConfigError("generation needs a prompt of at least one token");
  if (model->transformer->tensor_group())
    throw ConfigError("generation from a GPT split for tensor parallelism is not built: its logits are split over "
                      "the tensor group; load the weights into an unsplit GptLmHeadModel");
  const bool was_training = model->is_training();
  model->eval();
  torch::NoGradGuard no_grad;
  auto gen = at::detail::createCPUGenerator(o.seed);
  const int context = model->config().block_size;
  const torch::Device device = model->parameters().front().device();  // the prompt goes where the model is
  for (int i = 0; i < o.max_new_tokens; ++i) {
    const auto start = tokens.size() > static_cast<std::size_t>(context) ? tokens.size() - context : 0;
    std::vector<std::int64_t> window(tokens.begin() + static_cast<std::ptrdiff_t>(start), tokens.end());
    auto input = torch::tensor(window, torch::kLong).unsqueeze(0).to(device);
    // The next token's, sampled on the CPU: the same generator and draws on every device.
    auto logits = model(input).index({0, -1}).to(torch::kCPU, torch::kFloat);
    std::int64_t next;
    if (o.temperature <= 0) {
      next = logits.argmax().item<std::int64_t>();
    } else {
      logits = logits / o.temperature;
      if (o.top_k > 0 && o.top_k < logits.size(0)) {
        auto kth = std::get<0>(logits.topk(o.top_k)).index({-1});
        logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
      }
      next = torch::multinomial(torch::softmax(logits, -1), 1, /*replacement=*/false, gen).item<std::int64_t>();
    }
    tokens.push_back(next);
    if (next == o.stop_token) break;
  }
  model->train(was_training);
  return tokens;
}

}  // namespace lockstep::models
