// Hugging Face's GPT-2 <-> lockstep's GPT: see hf_gpt2.h.
#include "lockstep/models/hf_gpt2.h"

#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <memory>
#include <set>

#include "lockstep/error.h"
#include "lockstep/train_core/durable_file.h"
#include "lockstep/train_core/safetensors.h"

namespace fs = std::filesystem;
using lockstep::train::SafeTensor;
using lockstep::train::SafetensorsFile;

namespace lockstep::models {
namespace {

// GPT-2's Conv1D weights, stored [in, out].
bool is_conv1d_weight(const std::string& name) {
  for (const char* suffix : {".c_attn.weight", ".c_proj.weight", ".c_fc.weight"}) {
    const std::string s = suffix;
    if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0) return true;
  }
  return false;
}

// Buffers older transformers saved beside the weights (the causal mask): nothing to load.
bool is_mask_buffer(const std::string& name) {
  for (const std::string s : {".attn.bias", ".attn.masked_bias"})
    if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0) return true;
  return false;
}

torch::ScalarType torch_dtype(const std::string& dtype, const std::string& tensor) {
  static const std::map<std::string, torch::ScalarType> types = {
      {"F32", torch::kFloat}, {"F16", torch::kHalf}, {"BF16", torch::kBFloat16}, {"F64", torch::kDouble}};
  const auto it = types.find(dtype);
  if (it == types.end()) throw DataError("weight '" + tensor + "' is of dtype " + dtype + ", not a float type");
  return it->second;
}

std::string safetensors_dtype(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat: return "F32";
    case torch::kHalf: return "F16";
    case torch::kBFloat16: return "BF16";
    case torch::kDouble: return "F64";
    default: throw ConfigError(std::string("a weight of dtype ") + c10::toString(t) + " has no safetensors float type");
  }
}

// The directory's weights, in one file or in shards (train_core checks the index and the shards).
class HfWeights {
 public:
  explicit HfWeights(const std::string& dir) : files_(dir) {}

  // `name` as lockstep's model calls it; GPT2Model's files lack the "transformer." prefix.
  const SafeTensor* find(const std::string& name) const {
    const std::string prefix = "transformer.";
    const auto& all = files_.tensors();
    auto it = all.find(name);
    if (it == all.end() && name.rfind(prefix, 0) == 0) it = all.find(name.substr(prefix.size()));
    if (it == all.end()) return nullptr;
    used_.insert(it->first);
    return it->second;
  }

  std::vector<std::string> unused() const {
    std::vector<std::string> out;
    for (const auto& entry : files_.tensors())
      if (!used_.count(entry.first) && !is_mask_buffer(entry.first)) out.push_back(entry.first);
    return out;
  }

 private:
  train::SafetensorsDir files_;
  mutable std::set<std::string> used_;
};

torch::Tensor to_tensor(const SafeTensor& t, const std::string& name) {
  auto* data = const_cast<char*>(t.bytes.data());  // from_blob's view is only read, then copied
  return torch::from_blob(data, t.shape, torch::TensorOptions().dtype(torch_dtype(t.dtype, name))).clone();
}

// The checkpoint's head must be the token embedding (lockstep's GPT ties them).
void check_tied_head(const HfWeights& weights, const torch::Tensor& wte) {
  const SafeTensor* head = weights.find("lm_head.weight");
  if (head && !torch::equal(to_tensor(*head, "lm_head.weight").to(wte.scalar_type()), wte))
    throw ConfigError("lm_head.weight differs from transformer.wte.weight: an untied head, which lockstep's GPT "
                      "(whose head is the token embedding) cannot hold");
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < 8; ++i) out += (i ? ", " : "") + names[i];
  return names.size() > 8 ? out + " and " + std::to_string(names.size() - 8) + " more" : out;
}

template <typename T>
T field(const nlohmann::json& hf, const char* name, T fallback) {
  return hf.contains(name) && !hf.at(name).is_null() ? hf.at(name).get<T>() : fallback;
}

}  // namespace

GptConfig gpt_config_from_hf(const nlohmann::json& hf) {
  if (field<std::string>(hf, "model_type", "") != "gpt2")
    throw ConfigError("it describes a '" + field<std::string>(hf, "model_type", "?") +
                      "' model, not a GPT-2 (model_type gpt2)");
  GptConfig c;  // GPT2Config's defaults where a field is absent
  c.vocab_size = field(hf, "vocab_size", 50257);
  c.block_size = field(hf, "n_positions", 1024);
  c.n_embd = field(hf, "n_embd", 768);
  c.n_layer = field(hf, "n_layer", 12);
  c.n_head = field(hf, "n_head", 12);
  c.dropout = field(hf, "resid_pdrop", 0.1);
  c.attn_dropout = field(hf, "attn_pdrop", 0.1);
  c.layer_norm_epsilon = field(hf, "layer_norm_epsilon", 1e-5);
  const auto activation = field<std::string>(hf, "activation_function", "gelu_new");
  if (activation == "gelu") {
    c.activation = "gelu";
  } else if (activation == "gelu_new" || activation == "gelu_pytorch_tanh" || activation == "gelu_fast") {
    c.activation = "gelu_new";  // three spellings of the tanh approximation
  } else {
    throw ConfigError("activation_function '" + activation + "' is not one lockstep's GPT has (gelu, gelu_new)");
  }
  auto refuse = [&](bool unsupported, const std::string& what) {
    if (unsupported) throw ConfigError(what + ": lockstep's GPT does not have that");
  };
  refuse(field(hf, "n_inner", 4 * c.n_embd) != 4 * c.n_embd, "n_inner is not 4 * n_embd");
  refuse(!field(hf, "scale_attn_weights", true), "scale_attn_weights is false");
  refuse(field(hf, "scale_attn_by_inverse_layer_idx", false), "scale_attn_by_inverse_layer_idx is true");
  refuse(field(hf, "add_cross_attention", false), "add_cross_attention is true");
  refuse(!field(hf, "tie_word_embeddings", true), "tie_word_embeddings is false (an untied head)");
  c.validate();
  return c;
}

nlohmann::json hf_config_of(const GptConfig& c) {
  // GPT-2's <|endoftext|> where the vocabulary has it; none in another (a byte-level one).
  constexpr int kEndOfText = 50256;
  const nlohmann::json end_of_text = c.vocab_size > kEndOfText ? nlohmann::json(kEndOfText) : nlohmann::json();
  return {{"architectures", {"GPT2LMHeadModel"}},
          {"model_type", "gpt2"},
          {"vocab_size", c.vocab_size},
          {"n_positions", c.block_size},
          {"n_embd", c.n_embd},
          {"n_layer", c.n_layer},
          {"n_head", c.n_head},
          {"n_inner", nullptr},
          {"activation_function", c.activation},
          {"resid_pdrop", c.dropout},
          {"embd_pdrop", c.dropout},
          {"attn_pdrop", c.attention_dropout()},
          {"layer_norm_epsilon", c.layer_norm_epsilon},
          {"initializer_range", 0.02},
          {"scale_attn_weights", true},
          {"scale_attn_by_inverse_layer_idx", false},
          {"reorder_and_upcast_attn", false},
          {"tie_word_embeddings", true},
          {"use_cache", true},
          {"bos_token_id", end_of_text},
          {"eos_token_id", end_of_text},
          {"torch_dtype", "float32"}};
}

bool is_hf_gpt2_dir(const std::string& dir) {
  const fs::path config = fs::path(dir) / "config.json";
  if (!fs::exists(config)) return false;
  const auto j = train::read_json_file(config.string(), "a model's configuration");
  return j.is_object() && j.value("model_type", "") == "gpt2";
}

void load_hf_gpt2_weights(GptLmHeadModel& model, const std::string& dir) {
  const HfWeights weights(dir);
  torch::NoGradGuard no_grad;
  std::vector<std::string> missing;
  for (auto& item : model->named_parameters()) {
    const std::string& name = item.key();
    torch::Tensor& param = item.value();
    const SafeTensor* t = weights.find(name);
    if (!t) {
      missing.push_back(name);
      continue;
    }
    auto value = to_tensor(*t, name);
    if (is_conv1d_weight(name) && value.dim() == 2) value = value.t();
    if (value.sizes() != param.sizes())
      throw ConfigError(dir + ": weight '" + name + "' has shape " + c10::str(value.sizes()) + ", the model's is " +
                        c10::str(param.sizes()) + " (config.json and the weights disagree?)");
    param.copy_(value);
  }
  if (!missing.empty()) throw DataError(dir + " lacks weights the model needs: " + joined(missing));
  check_tied_head(weights, model->transformer->wte->weight);
  if (const auto unused = weights.unused(); !unused.empty())
    throw ConfigError(dir + " holds weights lockstep's GPT has no place for: " + joined(unused));
}

GptLmHeadModel load_hf_gpt2(const std::string& dir) {
  const std::string config = (fs::path(dir) / "config.json").string();
  GptConfig c;
  try {
    c = gpt_config_from_hf(train::read_json_file(config, "a Hugging Face model's configuration"));
  } catch (const ConfigError& e) {
    throw ConfigError(config + ": " + e.what());
  }
  GptLmHeadModel model(c);
  load_hf_gpt2_weights(model, dir);
  return model;
}

void save_hf_gpt2(GptLmHeadModel& model, const std::string& dir) {
  std::vector<torch::Tensor> keep;  // the bytes the SafeTensors view
  std::vector<std::pair<std::string, SafeTensor>> tensors;
  for (const auto& item : model->named_parameters()) {
    const std::string& name = item.key();
    const torch::Tensor& param = item.value();
    auto value = (is_conv1d_weight(name) ? param.detach().t() : param.detach()).to(torch::kCPU).contiguous();
    keep.push_back(value);
    const auto bytes = static_cast<std::size_t>(value.numel()) * value.element_size();
    tensors.push_back({name, SafeTensor{safetensors_dtype(value.scalar_type()),
                                        std::vector<std::int64_t>(value.sizes().begin(), value.sizes().end()),
                                        std::string_view(static_cast<const char*>(value.data_ptr()), bytes)}});
  }
  const fs::path target = fs::absolute(dir);
  fs::create_directories(target.parent_path());
  const fs::path staging = target.string() + ".tmp-" + std::to_string(::getpid());
  fs::remove_all(staging);
  fs::create_directories(staging);
  try {
    train::write_file_durably((staging / "config.json").string(), hf_config_of(model->config()).dump(2));
    train::write_safetensors((staging / "model.safetensors").string(), tensors, {{"format", "pt"}});
    train::sync_path(staging.string());
    train::replace_directory(staging.string(), target.string());
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(staging, ignored);
    throw;
  }
}

}  // namespace lockstep::models
