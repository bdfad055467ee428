// Hugging Face's GPT-2 and lockstep's GPT, both ways: a directory that
// `GPT2LMHeadModel.save_pretrained` wrote (config.json and model.safetensors, or its shards and
// model.safetensors.index.json) loads into a GptLmHeadModel, and a GptLmHeadModel is written as one
// that `GPT2LMHeadModel.from_pretrained` loads.
//
//   auto lm = lockstep::models::load_hf_gpt2("gpt2-small");   // the shape from config.json
//   ... train it with the Trainer ...
//   lockstep::models::save_hf_gpt2(lm, "gpt2-finetuned");     // the whole directory or none
//
// GPT-2's Conv1D layers store their weights as [in, out], torch's Linear as [out, in]: the weights
// of c_attn, c_proj and c_fc are transposed on the way in and out. Weights of any float dtype are
// read into the model's own. What lockstep's GPT cannot represent (an untied head, cross-attention,
// another MLP width, layer-scaled attention, an activation other than GELU's two forms) is a
// ConfigError naming the field, not a model that computes something else.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "lockstep/models/gpt.h"

namespace lockstep::models {

// config.json of a GPT-2 -> lockstep's GptConfig (Hugging Face's defaults where a field is absent;
// the dropout is resid_pdrop's, the attention's attn_pdrop's).
GptConfig gpt_config_from_hf(const nlohmann::json& hf);
// lockstep's GptConfig -> a GPT2Config's config.json (architectures GPT2LMHeadModel, tied head;
// bos and eos GPT-2's <|endoftext|> 50256 where the vocabulary has it, none otherwise).
nlohmann::json hf_config_of(const GptConfig& c);

// True when `dir` holds a Hugging Face GPT-2 (its config.json says model_type gpt2).
bool is_hf_gpt2_dir(const std::string& dir);

// Fills the model's weights from the directory's safetensors; the model's shape must be the
// directory's (ConfigError naming the tensor whose shape differs, DataError naming a missing one).
void load_hf_gpt2_weights(GptLmHeadModel& model, const std::string& dir);
GptLmHeadModel load_hf_gpt2(const std::string& dir);

// Writes config.json and model.safetensors into a sibling of `dir` and renames it into place.
void save_hf_gpt2(GptLmHeadModel& model, const std::string& dir);

}  // namespace lockstep::models
