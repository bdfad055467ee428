// Hugging Face GPT-2 directories in and out of lockstep's GPT: what is saved loads back bit for bit,
// in GPT-2's layout (Conv1D weights [in, out], no separate head, config.json as GPT2Config writes
// it); what lockstep's GPT cannot hold is refused by name. That transformers itself reads and writes
// the same files, with the same logits: tests/python/test_gpt2.py.
#include "lockstep/models/hf_gpt2.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <mutex>

#include "lockstep/error.h"
#include "lockstep/train_core/durable_file.h"
#include "lockstep/train_core/safetensors.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::models;
namespace fs = std::filesystem;

namespace {

GptConfig small(const std::string& activation = "gelu_new") {
  GptConfig c;
  c.vocab_size = 96;
  c.block_size = 24;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 32;
  c.dropout = 0.0;
  c.activation = activation;
  return c;
}

GptLmHeadModel seeded(const GptConfig& c, std::uint64_t seed) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(seed);
  GptLmHeadModel lm(c);
  lm->eval();
  return lm;
}

torch::Tensor some_tokens(const GptConfig& c) {
  return torch::randint(c.vocab_size, {3, c.block_size}, torch::TensorOptions().dtype(torch::kLong));
}

// Rewrites dir/model.safetensors through `edit`, which gets and returns its tensors by name.
using Tensors = std::vector<std::pair<std::string, train::SafeTensor>>;
void rewrite_weights(const std::string& dir, const std::function<Tensors(Tensors)>& edit) {
  const std::string path = dir + "/model.safetensors";
  const auto file = train::read_safetensors(path);
  Tensors tensors(file.tensors().begin(), file.tensors().end());
  train::write_safetensors(path, edit(std::move(tensors)), {{"format", "pt"}});
}

template <typename E>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(HfGpt2, ASavedDirectoryLoadsBackBitForBitWithTheSameLogits) {
  lockstep::testing::TempDir dir;
  auto lm = seeded(small(), 1);
  save_hf_gpt2(lm, dir / "gpt2");
  auto back = load_hf_gpt2(dir / "gpt2");
  back->eval();
  EXPECT_EQ(back->config().to_json(), lm->config().to_json());
  const auto a = lm->named_parameters();
  const auto b = back->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (const auto& item : a) EXPECT_TRUE(torch::equal(item.value(), b[item.key()])) << item.key();
  torch::NoGradGuard no_grad;
  const auto tokens = some_tokens(lm->config());
  EXPECT_TRUE(torch::equal(lm(tokens), back(tokens)));
}

TEST(HfGpt2, TheFilesHoldGpt2sLayout) {
  lockstep::testing::TempDir dir;
  auto lm = seeded(small(), 2);
  save_hf_gpt2(lm, dir / "gpt2");
  const auto config = train::read_json_file(dir / "gpt2/config.json", "config");
  EXPECT_EQ(config.at("model_type"), "gpt2");
  EXPECT_EQ(config.at("architectures"), nlohmann::json::array({"GPT2LMHeadModel"}));
  EXPECT_EQ(config.at("n_positions"), 24);
  EXPECT_EQ(config.at("activation_function"), "gelu_new");
  const auto file = train::read_safetensors(dir / "gpt2/model.safetensors");
  EXPECT_EQ(file.metadata().at("format"), "pt");
  EXPECT_FALSE(file.contains("lm_head.weight"));  // tied: from_pretrained ties it again
  const auto& c_attn = file.at("transformer.h.1.attn.c_attn.weight");
  EXPECT_EQ(c_attn.shape, (std::vector<std::int64_t>{32, 96}));  // Conv1D: [in, out]
  const auto ours = lm->transformer->h[1]->as<BlockImpl>()->attn->c_attn->weight;  // Linear: [out, in]
  auto stored = torch::from_blob(const_cast<char*>(c_attn.bytes.data()), {32, 96}, torch::kFloat);
  EXPECT_TRUE(torch::equal(stored, ours.t()));
  EXPECT_EQ(file.at("transformer.wte.weight").shape, (std::vector<std::int64_t>{96, 32}));
}

TEST(HfGpt2, AttentionDropoutIsAttnPdropBothWays) {
  GptConfig c = small("gelu");
  c.dropout = 0.1;
  c.attn_dropout = 0.0;
  const auto hf = hf_config_of(c);
  EXPECT_EQ(hf.at("attn_pdrop").get<double>(), 0.0);
  EXPECT_EQ(hf.at("resid_pdrop").get<double>(), 0.1);
  const auto back = gpt_config_from_hf(hf);
  EXPECT_EQ(back.attention_dropout(), 0.0);
  EXPECT_EQ(back.dropout, 0.1);
}

TEST(HfGpt2, TheActivationIsTheConfigsAndGeluNewIsTheTanhApproximation) {
  auto exact = seeded(small("gelu"), 3), tanh = seeded(small("gelu_new"), 3);
  torch::NoGradGuard no_grad;
  const auto tokens = some_tokens(exact->config());
  EXPECT_FALSE(torch::equal(exact(tokens), tanh(tokens)));
  const auto x = torch::linspace(-4, 4, 101);
  const auto formula = 0.5 * x * (1 + torch::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x.pow(3))));
  auto mlp = tanh->transformer->h[0]->as<BlockImpl>()->mlp;
  auto identity = [](torch::nn::Linear& l) {
    l->weight.copy_(torch::eye(l->weight.size(0), l->weight.size(1)));
    l->bias.zero_();
  };
  identity(mlp->c_fc);
  identity(mlp->c_proj);
  auto in = torch::zeros({101, 32});
  in.select(1, 0).copy_(x);
  EXPECT_TRUE(torch::allclose(mlp(in).select(1, 0), formula, 1e-6, 1e-6));
}

TEST(HfGpt2, ConfigurationsLockstepsGptCannotHoldAreRefusedByName) {
  const nlohmann::json base = hf_config_of(small());
  EXPECT_EQ(gpt_config_from_hf(base).to_json(), small().to_json());
  auto refused = [&](const char* field, const nlohmann::json& value) {
    nlohmann::json hf = base;
    hf[field] = value;
    const std::string what = error_of<ConfigError>([&] { gpt_config_from_hf(hf); });
    EXPECT_NE(what.find(field), std::string::npos) << field << ": " << what;
  };
  refused("n_inner", 64);
  refused("activation_function", "relu");
  refused("scale_attn_by_inverse_layer_idx", true);
  refused("scale_attn_weights", false);
  refused("add_cross_attention", true);
  refused("tie_word_embeddings", false);
  refused("model_type", "bert");
  nlohmann::json defaults = {{"model_type", "gpt2"}};  // GPT2Config's defaults: GPT-2 small
  const GptConfig d = gpt_config_from_hf(defaults);
  EXPECT_EQ(d.vocab_size, 50257);
  EXPECT_EQ(d.n_embd, 768);
  EXPECT_EQ(d.block_size, 1024);
  EXPECT_EQ(d.activation, "gelu_new");
}

TEST(HfGpt2, MissingExtraAndUntiedWeightsAreRefusedByName) {
  lockstep::testing::TempDir dir;
  auto lm = seeded(small(), 4);
  const std::string d = dir / "gpt2";
  save_hf_gpt2(lm, d);
  rewrite_weights(d, [](Tensors t) {
    t.erase(std::find_if(t.begin(), t.end(), [](auto& e) { return e.first == "transformer.h.0.ln_2.bias"; }));
    return t;
  });
  EXPECT_NE(error_of<DataError>([&] { load_hf_gpt2(d); }).find("transformer.h.0.ln_2.bias"), std::string::npos);

  save_hf_gpt2(lm, d);
  const std::vector<float> junk(4, 1.0f);
  const std::string junk_bytes(reinterpret_cast<const char*>(junk.data()), 16);
  rewrite_weights(d, [&](Tensors t) {
    t.push_back({"transformer.h.0.crossattention.q_attn.weight", {"F32", {4}, junk_bytes}});
    return t;
  });
  EXPECT_NE(error_of<ConfigError>([&] { load_hf_gpt2(d); }).find("crossattention"), std::string::npos);

  save_hf_gpt2(lm, d);
  auto other = torch::randn({96, 32});
  const std::string head(static_cast<const char*>(other.data_ptr()), 96 * 32 * 4);
  rewrite_weights(d, [&](Tensors t) {
    t.push_back({"lm_head.weight", {"F32", {96, 32}, head}});
    return t;
  });
  EXPECT_NE(error_of<ConfigError>([&] { load_hf_gpt2(d); }).find("untied"), std::string::npos);
}

// GPT2Model's files (no "transformer." prefix), bf16 weights, the causal-mask buffers older
// transformers saved, and a head equal to the embedding all load.
TEST(HfGpt2, FilesOfOtherSaversLoad) {
  lockstep::testing::TempDir dir;
  auto lm = seeded(small(), 5);
  const std::string d = dir / "gpt2";
  save_hf_gpt2(lm, d);
  std::vector<torch::Tensor> keep;
  rewrite_weights(d, [&](Tensors t) {
    Tensors out;
    for (auto& [name, value] : t) {
      auto f = torch::from_blob(const_cast<char*>(value.bytes.data()), value.shape, torch::kFloat);
      keep.push_back(f.to(torch::kBFloat16).contiguous());
      out.push_back({name.substr(std::string("transformer.").size()),
                     {"BF16", value.shape, std::string_view(static_cast<const char*>(keep.back().data_ptr()),
                                                            keep.back().numel() * 2)}});
    }
    keep.push_back(torch::ones({1, 1, 24, 24}, torch::kBFloat16));
    out.push_back({"h.0.attn.bias", {"BF16", {1, 1, 24, 24}, std::string_view(
                                         static_cast<const char*>(keep.back().data_ptr()), 24 * 24 * 2)}});
    const auto wte = std::find_if(out.begin(), out.end(), [](auto& e) { return e.first == "wte.weight"; });
    out.push_back({"lm_head.weight", wte->second});
    return out;
  });
  auto back = load_hf_gpt2(d);
  const auto expected = lm->transformer->ln_f->weight.to(torch::kBFloat16).to(torch::kFloat);
  EXPECT_TRUE(torch::equal(back->transformer->ln_f->weight, expected));
}

TEST(HfGpt2, SavingOverADirectoryReplacesItWhole) {
  lockstep::testing::TempDir dir;
  const std::string d = dir / "gpt2";
  auto first = seeded(small(), 6), second = seeded(small(), 7);
  save_hf_gpt2(first, d);
  train::write_file_durably(d + "/stale.txt", "from before");
  save_hf_gpt2(second, d);
  EXPECT_FALSE(fs::exists(d + "/stale.txt"));
  auto back = load_hf_gpt2(d);
  EXPECT_TRUE(torch::equal(back->transformer->wte->weight, second->transformer->wte->weight));
  for (const auto& entry : fs::directory_iterator(dir.path()))
    EXPECT_EQ(entry.path().filename(), "gpt2") << "left behind: " << entry.path();
}

TEST(HfGpt2, ADirectoryWithoutSafetensorsIsNamed) {
  lockstep::testing::TempDir dir;
  auto lm = seeded(small(), 8);
  const std::string d = dir / "gpt2";
  save_hf_gpt2(lm, d);
  fs::remove(d + "/model.safetensors");
  train::write_file_durably(d + "/pytorch_model.bin", "pickle");
  EXPECT_NE(error_of<DataError>([&] { load_hf_gpt2(d); }).find("safe_serialization"), std::string::npos);
  EXPECT_TRUE(is_hf_gpt2_dir(d));
  EXPECT_FALSE(is_hf_gpt2_dir(dir.path()));
}

}  // namespace
