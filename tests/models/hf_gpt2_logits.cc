// For tests/python/test_gpt2.py: the logits lockstep's GPT computes for a Hugging Face GPT-2
// directory, so that Python compares them with transformers' own.
//
//   hf_gpt2_logits MODEL_DIR TOKENS.safetensors OUT.safetensors
//
// TOKENS holds "tokens" (I64 [B, T]); OUT gets "logits" (F32 [B, T, vocab]).
#include <torch/torch.h>

#include "lockstep/base/main.h"
#include "lockstep/error.h"
#include "lockstep/models/hf_gpt2.h"
#include "lockstep/train_core/safetensors.h"

int main(int argc, char** argv) {
  return lockstep::run_main(argc, argv, [&] {
    if (argc != 4) throw lockstep::ConfigError("usage: hf_gpt2_logits MODEL_DIR TOKENS.safetensors OUT.safetensors");
    auto model = lockstep::models::load_hf_gpt2(argv[1]);
    model->eval();
    const auto input = lockstep::train::read_safetensors(argv[2]);
    const auto& t = input.at("tokens");
    if (t.dtype != "I64" || t.shape.size() != 2) throw lockstep::DataError("tokens must be I64 [B, T]");
    auto tokens = torch::from_blob(const_cast<char*>(t.bytes.data()), t.shape, torch::kLong).clone();
    torch::NoGradGuard no_grad;
    const auto logits = model(tokens).to(torch::kFloat).contiguous();
    const lockstep::train::SafeTensor out{
        "F32", std::vector<std::int64_t>(logits.sizes().begin(), logits.sizes().end()),
        std::string_view(static_cast<const char*>(logits.data_ptr()), logits.numel() * sizeof(float))};
    lockstep::train::write_safetensors(argv[3], {{"logits", out}}, {{"format", "pt"}});
    return 0;
  });
}
