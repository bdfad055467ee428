// A GPT-style language model on the fortune corpus (Debian's fortunes), with the Trainer:
//
//   lockstep run --nproc-per-node 2 build/examples/gpt --output-dir runs/gpt          # pretrain
//   build/examples/gpt generate --checkpoint runs/gpt/checkpoint-600 --prompt "The "   # sample
//   lockstep run --nproc-per-node 2 build/examples/gpt finetune --pretrained runs/gpt/checkpoint-600
//   lockstep run --nproc-per-node 2 build/examples/gpt finetune --from-scratch        # the baseline
//   lockstep run --nproc-per-node 2 build/examples/gpt train --from-hf my-gpt2         # from Hugging Face
//   lockstep run --nproc-per-node 2 build/examples/gpt train --train-data train.bin --eval-data val.bin
//       --vocab-size 50304                                                  # token files (one command)
//   build/examples/gpt export-hf --checkpoint runs/gpt/checkpoint-600 --output my-gpt2-tuned
//   build-torch2/examples/gpt prepare-data --tokenizer m.model --out train.bin --separator % TEXT...
//       # text into a token file with a SentencePiece tokenizer; `generate --tokenizer m.model`
//
// `train` (the default) pretrains a byte-level causal language model and reports eval_loss and
// perplexity on the held-out entries; every Trainer flag applies (--gradient-checkpointing,
// --bf16, --resume-from-checkpoint ...). Each checkpoint also holds config.json, the model's
// shape, which `generate` and `finetune` read. `finetune` puts the pretrained body under a new
// classification head that predicts an entry's category file, reporting which weights it loaded,
// which are new and which it did not use, as from_pretrained does. `--from-hf` starts from a
// directory that GPT2LMHeadModel.save_pretrained wrote (on the fortunes its tokens are bytes: a
// vocabulary of at least 256; with --train-data/--eval-data, the files' tokens: nanoGPT's flat
// uint16/uint32 arrays or Megatron's .bin/.idx, data/token_files.h), `export-hf` writes a
// checkpoint as one that from_pretrained loads, and `generate` reads either kind of directory.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "lockstep/base/main.h"
#include "lockstep/data/prepare_text.h"
#include "lockstep/data/sentencepiece.h"
#include "lockstep/error.h"
#include "lockstep/models/gpt.h"
#include "lockstep/models/hf_gpt2.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train/datasets.h"
#include "lockstep/train/device.h"
#include "lockstep/train/trainer.h"
#include "lockstep/train_core/durable_file.h"

namespace fs = std::filesystem;
using lockstep::models::GptConfig;
using namespace lockstep::train;

namespace {

void add_model_options(CLI::App& app, GptConfig& c) {
  app.add_option("--n-layer", c.n_layer, "transformer blocks")->capture_default_str();
  app.add_option("--n-head", c.n_head, "attention heads per block")->capture_default_str();
  app.add_option("--n-embd", c.n_embd, "width of the residual stream")->capture_default_str();
  app.add_option("--block-size", c.block_size,
                 "tokens (bytes) of context per sequence (finetune: of each entry; 0 there: the model's context)")->capture_default_str();
  app.add_option("--dropout", c.dropout, "dropout everywhere")->capture_default_str();
  app.add_option_function<double>(
      "--attn-dropout", [&c](double p) { c.attn_dropout = p; },
      "dropout on the attention probabilities (default: --dropout's); 0 lets libtorch 2.x fuse attention");
}

// The shape of the model a checkpoint holds (written by this program beside model.pt), or of a
// Hugging Face GPT-2's directory.
GptConfig config_of(const std::string& checkpoint) {
  if (lockstep::models::is_hf_gpt2_dir(checkpoint)) return lockstep::models::load_hf_gpt2(checkpoint)->config();
  const fs::path file = fs::path(checkpoint) / "config.json";
  if (!fs::exists(file))
    throw lockstep::ConfigError(checkpoint + " is not a GPT checkpoint of this program: it has no config.json (pass a "
                                             "checkpoint-<step> directory that `gpt train` wrote)");
  try {
    return GptConfig::from_json(read_json_file(file.string(), "the model's configuration"));
  } catch (const lockstep::ConfigError& e) {
    throw lockstep::ConfigError(file.string() + ": " + e.what());
  }
}

// The language model a checkpoint of this program or a Hugging Face GPT-2 directory holds.
lockstep::models::GptLmHeadModel load_language_model(const std::string& dir) {
  if (lockstep::models::is_hf_gpt2_dir(dir)) return lockstep::models::load_hf_gpt2(dir);
  lockstep::models::GptLmHeadModel model(config_of(dir));
  load_module(*model, (fs::path(dir) / "model.pt").string());
  return model;
}

// Model flags that differ both from their defaults and from a pretrained model's shape: its
// weights only load into its own shape.
void refuse_reshape(const GptConfig& given, const GptConfig& pretrained, const std::string& source) {
  const GptConfig d;
  auto refuse = [&](const char* flag, int value, int pretrained_value, int default_value) {
    if (value != default_value && value != pretrained_value)
      throw lockstep::ConfigError(std::string(flag) + " " + std::to_string(value) + " differs from the pretrained " +
                                  "model's " + std::to_string(pretrained_value) + " (" + source +
                                  "/config.json): its weights only load into its own shape; drop the flag");
  };
  refuse("--n-layer", given.n_layer, pretrained.n_layer, d.n_layer);
  refuse("--n-head", given.n_head, pretrained.n_head, d.n_head);
  refuse("--n-embd", given.n_embd, pretrained.n_embd, d.n_embd);
}

// Writes config.json into every checkpoint rank 0 saves.
class SaveConfig : public TrainerCallback {
 public:
  explicit SaveConfig(GptConfig c) : config_(std::move(c)) {}
  void on_save(const TrainerState&, const std::string& dir) override {
    if (rank0) write_file_durably((fs::path(dir) / "config.json").string(), config_.to_json().dump(2));
  }
  bool rank0 = false;  // set once the Trainer joined the job

 private:
  GptConfig config_;
};

// The shape of the Hugging Face GPT-2 in `dir`, which model flags may not change; its training
// blocks are `sequence` tokens, at most its context. Bytes (no token files) need 256 tokens.
GptConfig hf_shape(const GptConfig& given, const std::string& dir, int& sequence, bool bytes) {
  const GptConfig c = config_of(dir);
  refuse_reshape(given, c, dir);
  if (bytes && c.vocab_size < 256)
    throw lockstep::ConfigError(dir + " has a vocabulary of " + std::to_string(c.vocab_size) +
                                " tokens; this program's tokens are bytes, which need 256");
  sequence = std::min(sequence, c.block_size);
  return c;
}

// Pretraining's defaults: one epoch, AdamW with GPT-style decay and beta2, a cosine schedule,
// evaluation and a checkpoint every 100 steps.
TrainingArguments pretrain_defaults() {
  TrainingArguments defaults;
  defaults.output_dir = "runs/gpt";
  defaults.per_device_train_batch_size = 16;
  defaults.per_device_eval_batch_size = 32;
  defaults.learning_rate = 1e-3;
  defaults.lr_scheduler_type = "cosine";
  defaults.warmup_ratio = 0.05;
  defaults.weight_decay = 0.1;
  defaults.adam_beta2 = 0.99;
  defaults.num_train_epochs = 1;
  defaults.logging_steps = 20;
  defaults.eval_strategy = "steps";
  defaults.eval_steps = 100;
  defaults.save_strategy = "steps";
  defaults.save_steps = 100;
  defaults.save_total_limit = 2;
  return defaults;
}

// Where pretraining's text comes from: the fortunes as bytes, or token files.
struct DataFlags {
  std::string corpus_dir = lockstep::data::kFortunesDir, train_data, eval_data;
  std::size_t train_limit = 0, eval_limit = 0;
  bool token_files() const { return !train_data.empty() || !eval_data.empty(); }
};

void add_data_options(CLI::App& app, DataFlags& d, GptConfig& c) {
  app.add_option("--corpus-dir", d.corpus_dir, "directory of the fortune files")->capture_default_str();
  app.add_option("--train-data", d.train_data,
                 "train on a token file instead of the fortunes' bytes: nanoGPT's flat .bin (uint16, or uint32 "
                 "above 65,536 tokens), or a Megatron prefix P (P.idx and P.bin); needs --eval-data and --vocab-size");
  app.add_option("--eval-data", d.eval_data, "the token file to evaluate on, in the same format");
  app.add_option("--vocab-size", c.vocab_size, "tokens in the vocabulary (256 for bytes)")->capture_default_str();
  app.add_option("--train-limit", d.train_limit, "use only the first N training blocks (0: all)");
  app.add_option("--eval-limit", d.eval_limit, "use only the first N validation blocks (0: all)");
}

struct LanguageData {
  std::shared_ptr<Dataset> train, eval;
  std::string description;  // "321 training blocks of 32 (10272 bytes), 40 validation blocks"
};

LanguageData language_data(const DataFlags& d, const GptConfig& config, int sequence) {
  std::ostringstream what;
  if (d.token_files()) {
    if (d.train_data.empty() || d.eval_data.empty())
      throw lockstep::ConfigError("--train-data and --eval-data go together: pass both token files");
    auto train = std::make_shared<TokenFileDataset>(d.train_data, config.vocab_size, sequence, d.train_limit);
    auto eval = std::make_shared<TokenFileDataset>(d.eval_data, config.vocab_size, sequence, d.eval_limit);
    what << train->size() << " training blocks of " << sequence << " tokens from " << d.train_data << ", "
         << eval->size() << " validation blocks from " << d.eval_data;
    return {train, eval, what.str()};
  }
  if (config.vocab_size < lockstep::data::kByteVocabulary)
    throw lockstep::ConfigError("--vocab-size " + std::to_string(config.vocab_size) +
                                " cannot hold the fortunes' bytes (256 tokens): pass token files (--train-data, "
                                "--eval-data) for a smaller vocabulary");
  auto corpus = std::make_shared<const lockstep::data::FortuneCorpus>(d.corpus_dir);
  auto train = std::make_shared<LanguageModelDataset>(corpus, lockstep::data::TextSplit::train, sequence, d.train_limit);
  auto eval = std::make_shared<LanguageModelDataset>(corpus, lockstep::data::TextSplit::validation, sequence,
                                                     d.eval_limit);
  what << train->size() << " training blocks of " << sequence << " (" << train->blocks().tokens() << " bytes), "
       << eval->size() << " validation blocks";
  return {train, eval, what.str()};
}

int pretrain(int argc, const char* const* argv) {
  GptConfig config;
  DataFlags data;
  std::string from_hf;
  TrainingArguments args = parse_arguments(
      argc, argv,
      [&](CLI::App& app) {
        add_model_options(app, config);
        add_data_options(app, data, config);
        app.add_option("--from-hf", from_hf,
                       "start from a Hugging Face GPT-2 directory (save_pretrained's): its shape, vocabulary and "
                       "weights; blocks of min(--block-size, its n_positions) tokens");
      },
      "gpt train: pretrain a GPT on the fortune corpus's bytes, or on token files, with the lockstep Trainer",
      pretrain_defaults());
  int sequence = config.block_size;
  if (!from_hf.empty()) config = hf_shape(config, from_hf, sequence, !data.token_files());
  config.validate();
  const LanguageData text = language_data(data, config, sequence);
  const auto& train_set = text.train;
  const auto& eval_set = text.eval;
  set_seed(args.seed);  // the same initial weights on every rank
  lockstep::models::GptLmHeadModel model(config);
  if (!from_hf.empty()) lockstep::models::load_hf_gpt2_weights(model, from_hf);  // on every rank, the same
  auto save_config = std::make_shared<SaveConfig>(config);
  Trainer trainer(Model::of(model), train_set, eval_set, args, {save_config});
  save_config->rank0 = trainer.communicator().rank() == 0;
  if (trainer.communicator().rank() == 0)
    std::printf("GPT: %d layers, %d heads, %d wide, %d tokens of context, %lld in the vocabulary: %.2f M "
                "parameters%s; %s\n",
                config.n_layer, config.n_head, config.n_embd, config.block_size,
                static_cast<long long>(config.vocab_size), config.parameters() / 1e6,
                from_hf.empty() ? "" : (", from " + from_hf).c_str(), text.description.c_str());
  const TrainResult result = trainer.train();
  const nlohmann::json m = trainer.evaluate();
  if (trainer.communicator().rank() == 0) {
    std::printf("trained %lld steps in %.1f s; validation loss %.4f nats/%s, perplexity %.2f\n",
                static_cast<long long>(result.global_step), result.seconds, m["eval_loss"].get<double>(),
                data.token_files() ? "token" : "byte", m.value("eval_perplexity", 0.0));
    nlohmann::json out = m;
    out["checkpoint"] = latest_checkpoint(args.output_dir);
    out["train_seconds"] = result.seconds;
    out["config"] = config.to_json();
    write_file_durably((fs::path(args.output_dir) / "eval_results.json").string(), out.dump(2));
  }
  return 0;
}

std::vector<std::int64_t> bytes_of(const std::string& text) {
  std::vector<std::int64_t> out;
  for (unsigned char c : text) out.push_back(c);
  return out;
}

// The sampled tokens as text: the tokenizer's pieces, or bytes when there is none.
std::string text_of(const std::vector<std::int64_t>& tokens, const lockstep::data::SentencePiece* tokenizer) {
  if (tokenizer) return tokenizer->decode(tokens);
  std::string text;
  for (auto t : tokens) text.push_back(static_cast<char>(t));
  return text;
}

int generate(int argc, const char* const* argv) {
  CLI::App app{"gpt generate: sample text from a checkpoint"};
  std::string checkpoint, prompt = "%\n", tokenizer_model;
  std::vector<std::int64_t> prompt_tokens;
  bool print_tokens = false;
  lockstep::models::SamplingOptions o;
  int samples = 1;
  app.add_option("--checkpoint", checkpoint,
                 "a checkpoint directory that `gpt train` wrote, or a Hugging Face GPT-2 directory")->required();
  app.add_option("--prompt", prompt, "text to continue")->capture_default_str();
  app.add_option("--prompt-tokens", prompt_tokens,
                 "token ids to continue instead (a model whose tokens are not bytes), comma-separated")
      ->delimiter(',');
  app.add_option("--tokenizer", tokenizer_model,
                 "the SentencePiece .model the training tokens were prepared with (gpt prepare-data): it encodes "
                 "the prompt and decodes the sample; default: tokens are bytes");
  app.add_flag("--print-tokens", print_tokens, "print token ids, one line per sample, instead of text");
  app.add_option("--max-new-tokens", o.max_new_tokens, "tokens to generate (bytes without --tokenizer)")
      ->capture_default_str();
  app.add_option("--temperature", o.temperature, "0: always the most likely byte")->capture_default_str();
  app.add_option("--top-k", o.top_k, "sample among the k most likely bytes (0: all)")->capture_default_str();
  app.add_option("--seed", o.seed, "the sampler's seed")->capture_default_str();
  app.add_option("--samples", samples, "how many texts to sample (separated by a line of %)")->capture_default_str();
  std::string device = "cpu";
  app.add_option("--device", device, "cpu | cuda (the GPU of LOCAL_RANK) | auto, as the Trainer's")
      ->capture_default_str();
  parse_command_line(app, argc, argv);
  std::unique_ptr<lockstep::data::SentencePiece> tokenizer;
  if (!tokenizer_model.empty()) tokenizer = std::make_unique<lockstep::data::SentencePiece>(tokenizer_model);
  if (prompt_tokens.empty()) prompt_tokens = tokenizer ? tokenizer->encode(prompt) : bytes_of(prompt);
  if (prompt_tokens.empty()) throw lockstep::ConfigError("--prompt must hold at least one character");
  const torch::Device where = lockstep::train::training_device(device, lockstep::train::local_rank());
  auto model = load_language_model(checkpoint);
  model->to(where);
  for (auto t : prompt_tokens)
    if (t < 0 || t >= model->config().vocab_size)
      throw lockstep::ConfigError("prompt token " + std::to_string(t) + " is outside the model's vocabulary of " +
                                  std::to_string(model->config().vocab_size));
  for (int s = 0; s < samples; ++s) {
    o.seed += static_cast<std::uint64_t>(s > 0);
    const auto tokens = lockstep::models::generate(model, prompt_tokens, o);
    std::string text;
    if (print_tokens)
      for (auto t : tokens) text += (text.empty() ? "" : " ") + std::to_string(t);
    else
      text = text_of(tokens, tokenizer.get());
    std::printf("%s", s && !print_tokens ? "%\n" : "");
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::printf("\n");
  }
  return 0;
}

// Text files into a token file for --train-data/--eval-data, with a SentencePiece tokenizer.
int prepare_data(int argc, const char* const* argv) {
  CLI::App app{"gpt prepare-data: text files into a token file (nanoGPT's flat array) with a SentencePiece tokenizer"};
  std::string tokenizer_model, out, separator;
  std::vector<std::string> texts;
  app.add_option("--tokenizer", tokenizer_model, "a SentencePiece .model (spm_train's, or Python sentencepiece's)")
      ->required();
  app.add_option("--out", out, "the token file to write, e.g. train.bin (uint16, or uint32 above 65,536 tokens)")
      ->required();
  app.add_option("--separator", separator,
                 "a line that ends a document, e.g. % for fortune files (default: each file is one document)");
  app.add_option("texts", texts, "text files, encoded line by line")->required();
  parse_command_line(app, argc, argv);
  const lockstep::data::SentencePiece tokenizer(tokenizer_model);
  const auto done = lockstep::data::prepare_token_file(tokenizer.encoder(), texts, separator, out);
  std::printf("wrote %s: %llu tokens (uint%d) in %llu documents from %zu files; train with --vocab-size %llu\n",
              out.c_str(), static_cast<unsigned long long>(done.tokens), done.token_bytes * 8,
              static_cast<unsigned long long>(done.documents), texts.size(),
              static_cast<unsigned long long>(tokenizer.vocabulary()));
  return 0;
}

void report_loading(const LoadReport& r, const std::string& checkpoint) {
  auto list = [](const std::vector<std::string>& names) {
    std::string out;
    for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
    return out.empty() ? std::string("none") : out;
  };
  std::printf("loaded %zu tensors from %s\n", r.loaded.size(), checkpoint.c_str());
  std::printf("newly initialised (not in the checkpoint): %s\n", list(r.missing).c_str());
  std::printf("not used (in the checkpoint, not in this model): %s\n", list(r.unexpected).c_str());
}

// The classifier's shape and how many bytes of each entry it reads: from scratch, the flags';
// from a pretrained checkpoint, its config.json's (a reshaped model could not load its weights),
// reading at most its context. given.block_size 0 means "the model's context".
std::pair<GptConfig, int> classifier_shape(const GptConfig& given, const std::string& pretrained) {
  if (pretrained.empty()) {
    GptConfig c = given;
    if (c.block_size == 0) c.block_size = GptConfig{}.block_size;
    return {c, c.block_size};
  }
  GptConfig c = config_of(pretrained);
  refuse_reshape(given, c, pretrained);
  if (given.block_size > c.block_size)
    throw lockstep::ConfigError("--block-size " + std::to_string(given.block_size) +
                                " is larger than the pretrained model's context (block_size " +
                                std::to_string(c.block_size) + "): use at most that");
  c.dropout = given.dropout;
  c.attn_dropout = given.attn_dropout;
  return {c, given.block_size > 0 ? given.block_size : c.block_size};
}

double largest_class_share(const TextClassificationDataset& set, std::size_t classes) {
  std::vector<std::size_t> n(classes, 0);
  for (std::size_t i = 0; i < set.size(); ++i) ++n[static_cast<std::size_t>(set.labels().label(i))];
  return set.size() ? static_cast<double>(*std::max_element(n.begin(), n.end())) / set.size() : 0;
}

// gpt finetune's options besides the Trainer's.
struct FinetuneOptions {
  GptConfig given;
  std::string pretrained, corpus_dir = lockstep::data::kFortunesDir;
  bool from_scratch = false;
  std::size_t min_entries = 500;
};

TrainingArguments finetune_defaults() {
  TrainingArguments d;
  d.output_dir = "runs/gpt-finetune";
  d.per_device_train_batch_size = 16;
  d.per_device_eval_batch_size = 32;
  d.learning_rate = 3e-4;
  d.lr_scheduler_type = "linear";
  d.warmup_ratio = 0.05;
  d.weight_decay = 0.01;
  d.num_train_epochs = 3;
  d.logging_steps = 20;
  d.eval_strategy = "epoch";
  d.save_strategy = "no";
  d.metric_for_best_model = "eval_accuracy";
  return d;
}

TrainingArguments parse_finetune(int argc, const char* const* argv, FinetuneOptions& o) {
  o.given.block_size = 0;  // the pretrained model's context (128 from scratch)
  TrainingArguments args = parse_arguments(
      argc, argv,
      [&](CLI::App& app) {
        add_model_options(app, o.given);
        app.add_option("--pretrained", o.pretrained, "a checkpoint of `gpt train` whose body to start from");
        app.add_flag("--from-scratch", o.from_scratch, "start from random weights instead (the baseline)");
        app.add_option("--min-entries", o.min_entries, "categories with at least this many entries become classes")
            ->capture_default_str();
        app.add_option("--corpus-dir", o.corpus_dir, "directory of the fortune files")->capture_default_str();
      },
      "gpt finetune: classify fortune entries by category file, from a pretrained body or from scratch",
      finetune_defaults());
  if (o.pretrained.empty() == !o.from_scratch)
    throw lockstep::ConfigError("give either --pretrained CHECKPOINT or --from-scratch");
  return args;
}

// Rank 0: the validation accuracy, and eval_results.json (with the classes and where it started).
void report_finetune(const nlohmann::json& m, const TextClassificationDataset& eval_set,
                     const std::vector<std::string>& classes, const FinetuneOptions& o, const std::string& output_dir) {
  std::printf("validation accuracy %.4f over %lld entries (%zu classes; the largest class is %.4f of them)\n",
              m["eval_accuracy"].get<double>(), static_cast<long long>(m["eval_samples"].get<std::int64_t>()),
              classes.size(), largest_class_share(eval_set, classes.size()));
  nlohmann::json out = m;
  out["pretrained"] = o.pretrained;
  out["classes"] = classes;
  write_file_durably((fs::path(output_dir) / "eval_results.json").string(), out.dump(2));
}

int finetune(int argc, const char* const* argv) {
  FinetuneOptions o;
  const TrainingArguments args = parse_finetune(argc, argv, o);
  const auto [config, max_length] = classifier_shape(o.given, o.pretrained);
  config.validate();
  auto corpus = std::make_shared<const lockstep::data::FortuneCorpus>(o.corpus_dir);
  auto train_set = std::make_shared<TextClassificationDataset>(corpus, lockstep::data::TextSplit::train,
                                                               max_length, o.min_entries);
  auto eval_set = std::make_shared<TextClassificationDataset>(corpus, lockstep::data::TextSplit::validation,
                                                              max_length, o.min_entries);
  const auto& classes = train_set->labels().classes();
  set_seed(args.seed);
  lockstep::models::GptForSequenceClassification model(config, static_cast<int>(classes.size()));
  Trainer trainer(Model::of(model), train_set, eval_set, args);
  const bool rank0 = trainer.communicator().rank() == 0;
  if (!o.pretrained.empty()) {  // every rank loads it: DDP then starts from rank 0's copy anyway
    const auto report = load_matching(*model, (fs::path(o.pretrained) / "model.pt").string());
    if (rank0) report_loading(report, o.pretrained);
  }
  if (rank0) {
    std::printf("%zu classes (categories with at least %zu entries):", classes.size(), o.min_entries);
    for (const auto& c : classes) std::printf(" %s (%zu)", c.c_str(), corpus->count(c));
    std::printf("\n%zu training entries, %zu validation entries; %s\n", train_set->size(), eval_set->size(),
                o.pretrained.empty() ? "from scratch" : ("from " + o.pretrained).c_str());
  }
  trainer.train();
  const nlohmann::json m = trainer.evaluate();
  if (rank0) report_finetune(m, *eval_set, classes, o, args.output_dir);
  return 0;
}

int export_hf(int argc, const char* const* argv) {
  CLI::App app{"gpt export-hf: write a checkpoint as a Hugging Face GPT-2 directory (from_pretrained loads it)"};
  std::string checkpoint, output;
  app.add_option("--checkpoint", checkpoint, "a checkpoint directory that `gpt train` wrote")->required();
  app.add_option("--output", output, "the directory to write (replaced whole if it exists)")->required();
  parse_command_line(app, argc, argv);
  auto model = load_language_model(checkpoint);
  lockstep::models::save_hf_gpt2(model, output);
  std::printf("wrote %s (config.json, model.safetensors: %.2f M parameters) from %s\n", output.c_str(),
              model->config().parameters() / 1e6, checkpoint.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return lockstep::run_main(argc, argv, [&] {
    const std::string command = argc > 1 && argv[1][0] != '-' ? argv[1] : "";
    if (command == "generate") return generate(argc - 1, argv + 1);
    if (command == "finetune") return finetune(argc - 1, argv + 1);
    if (command == "train") return pretrain(argc - 1, argv + 1);
    if (command == "export-hf") return export_hf(argc - 1, argv + 1);
    if (command == "prepare-data") return prepare_data(argc - 1, argv + 1);
    if (!command.empty())
      throw lockstep::ConfigError("unknown command '" + command +
                                  "': use train, generate, finetune, export-hf or prepare-data");
    return pretrain(argc, argv);
  });
}
