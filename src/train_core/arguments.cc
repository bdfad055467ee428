#include "lockstep/train_core/arguments.h"

#include <yaml-cpp/yaml.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <type_traits>

#include "lockstep/error.h"

namespace lockstep::train {
namespace {

bool compresses_between_machines_only(const std::string& hook) {
  for (const auto& h : comm::kCommHooks)
    if (hook == h.name) return h.between_machines_only;
  return false;
}

[[noreturn]] void bad(const std::string& flag, const std::string& problem) {
  throw ConfigError("--" + flag + " " + problem);
}

// "per_device_train_batch_size" -> "per-device-train-batch-size"
std::string flag_name(const char* member) {
  std::string f = member;
  for (auto& c : f)
    if (c == '_') c = '-';
  return f;
}

std::string joined(const std::vector<std::string>& choices, const char* separator) {
  std::string out;
  for (const auto& c : choices) out += (out.empty() ? "" : separator) + c;
  return out;
}

std::string number_text(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

void check_number(const char* member, double value, const Rule& rule) {
  const std::string got = " (got " + number_text(value) + ")";
  switch (rule.kind) {
    case Rule::at_least:
      if (!(value >= rule.low) || !std::isfinite(value))
        bad(flag_name(member), "must be at least " + number_text(rule.low) + got);
      return;
    case Rule::above:
      if (!(value > rule.low) || !std::isfinite(value))
        bad(flag_name(member), "must be above " + number_text(rule.low) + got);
      return;
    case Rule::within:
      if (!(value >= rule.low && value <= rule.high))
        bad(flag_name(member),
            "must be within " + number_text(rule.low) + ".." + number_text(rule.high) + got);
      return;
    case Rule::below_one:
      if (!(value >= 0 && value < 1)) bad(flag_name(member), "must be within [0, 1)" + got);
      return;
    default: return;
  }
}

void check_choice(const char* member, const std::string& value, const Rule& rule) {
  if (rule.kind != Rule::one_of) return;
  for (const auto& c : rule.choices)
    if (value == c) return;
  bad(flag_name(member), "must be one of " + joined(rule.choices, ", ") + " (got '" + value + "')");
}

template <class T>
void check(const char* member, const T& value, const Rule& rule) {
  if constexpr (std::is_same_v<T, std::string>)
    check_choice(member, value, rule);
  else if constexpr (!std::is_same_v<T, bool>)
    check_number(member, static_cast<double>(value), rule);
}

// "--per_device_train_batch_size=8" -> "--per-device-train-batch-size=8"; values are untouched.
std::string normalise_flag(std::string arg) {
  if (arg.rfind("--", 0) != 0) return arg;
  std::size_t end = arg.find('=');
  if (end == std::string::npos) end = arg.size();
  for (std::size_t i = 2; i < end; ++i)
    if (arg[i] == '_') arg[i] = '-';
  return arg;
}

std::string scalar_text(const YAML::Node& node, const std::string& key, const std::string& path) {
  if (!node.IsScalar())
    throw ConfigError(path + ": '" + key + "' must be a single value (a number, string or true/false)");
  return node.Scalar();
}

std::string help_text(const char* help, const Rule& rule) {
  if (rule.kind == Rule::one_of) return joined(rule.choices, " | ") + ": " + help;
  return help;
}

template <class T>
void add_flag_for(CLI::App& app, const char* member, T& value, const char* help, const Rule& rule) {
  const std::string flag = "--" + flag_name(member);
  if constexpr (std::is_same_v<T, bool>) {
    app.add_flag(flag, value, help);
  } else if (std::string(member) == "config" || std::string(member) == "resume_from_checkpoint") {
    app.add_option(flag, value, help_text(help, rule));
  } else {
    app.add_option(flag, value, help_text(help, rule))->capture_default_str();
  }
}

// --help prints and exits 0; anything else wrong is a ConfigError naming it.
void parse_flags(CLI::App& app, std::vector<std::string> reversed) {
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    std::printf("%s", app.help().c_str());
    std::exit(0);
  } catch (const CLI::ParseError& e) {
    throw ConfigError(std::string(e.what()) + "; run with --help for the flags");
  }
}

}  // namespace

bool TrainingArguments::best_is_greater() const {
  if (greater_is_better == "true") return true;
  if (greater_is_better == "false") return false;
  return metric_for_best_model.find("accuracy") != std::string::npos;
}

void TrainingArguments::validate() const {
  // Each value against its own rule (declared with it in the table)...
#define LOCKSTEP_CHECK(type, name, value, help, rule) check(#name, name, rule);
  LOCKSTEP_TRAINING_ARGUMENTS(LOCKSTEP_CHECK)
#undef LOCKSTEP_CHECK
  // ...then the rules that tie several together.
  if (output_dir.empty()) bad("output-dir", "must not be empty");
  if (max_steps <= 0 && !(num_train_epochs > 0 && std::isfinite(num_train_epochs)))
    bad("num-train-epochs",
        "must be above 0 when --max-steps is not set (got " + number_text(num_train_epochs) + ")");
  if (max_steps == 0) bad("max-steps", "must be positive, or -1 to train for --num-train-epochs");
  if (load_best_model_at_end) {
    if (eval_strategy == "no" || save_strategy != eval_strategy)
      bad("load-best-model-at-end",
          "needs --save-strategy and --eval-strategy to be the same (steps or epoch), so every evaluation "
          "has its checkpoint");
    if (save_strategy == "steps" && save_steps % static_cast<int>(eval_every()) != 0)
      bad("load-best-model-at-end", "needs --save-steps to be a multiple of --eval-steps (" +
                                        std::to_string(save_steps) + " is not a multiple of " +
                                        std::to_string(eval_every()) + ")");
  }
  if (fp16 && bf16) bad("fp16", "and --bf16 are two mixed precisions: choose one (bf16 needs no loss scaling)");
  if (zero_shared_parameters && zero_stage == 0)
    bad("zero-shared-parameters", "is a ZeRO mode: add --zero-stage 1, 2 or 3");
  if (sync_every > 1 && zero_stage > 0)
    bad("sync-every", "keeps a whole model on every machine; it does not combine with --zero-stage (use one)");
  if (sync_every > 1 && compresses_between_machines_only(ddp_comm_hook))
    bad("sync-every", "sends no gradient between machines, which is all --ddp-comm-hook " + ddp_comm_hook +
                          " compresses: use one or the other");
  if (sync_every > 1 && save_format == "sharded")
    bad("sync-every", "saves consolidated checkpoints only: drop --save-format sharded");
  if (powersgd_rounds > 1 && powersgd_rounds % 2 != 0)
    bad("powersgd-rounds", "must be 1 or even (two exchanges per power iteration; got " +
                               std::to_string(powersgd_rounds) + ")");
  validate_pipeline();
  validate_tensor_parallel();
  validate_cuda_graphs();
  if (early_stopping_patience > 0 && eval_strategy == "no")
    bad("early-stopping-patience", "needs evaluations: set --eval-strategy steps or epoch");
}

namespace {

// Under a pipeline ZeRO is stage 1 by whole tensors over each stage's replicas
// (train/zero_one_shares.cc): a stage's gradients are reduced whole.
void refuse_zero_beyond_one(int zero_stage, const std::string& with) {
  if (zero_stage > 1)
    bad("zero-stage", std::to_string(zero_stage) + " does not combine with " + with +
                          " yet (a stage's gradients are reduced whole): use --zero-stage 1, which shards the "
                          "optimizer state over each stage's replicas");
}

// Under a pipeline or tensor parallelism nothing is shared per machine.
void refuse_shared_parameters(bool shared_parameters, const std::string& with) {
  if (shared_parameters)
    bad("zero-shared-parameters", "does not combine with " + with + " (each rank holds its own part of the model)");
}

}  // namespace

// What pipelining (--pipeline-parallel above 1) does not combine with yet, and the flags that
// mean nothing without it.
void TrainingArguments::validate_pipeline() const {
  if (pipeline_parallel == 1) {
    if (num_microbatches > 0) bad("num-microbatches", "cuts a pipeline's step: add --pipeline-parallel 2 or more");
    if (virtual_stages > 1) bad("virtual-stages", "is a pipeline setting: add --pipeline-parallel 2 or more");
    if (!pipeline_split.empty()) bad("pipeline-split", "is a pipeline setting: add --pipeline-parallel 2 or more");
    return;
  }
  if (virtual_stages > 1 && pipeline_schedule != "interleaved" && pipeline_schedule != "zb")
    bad("virtual-stages", "needs --pipeline-schedule interleaved or zb (the " + pipeline_schedule +
                              " schedule runs one stage per pipeline rank)");
  const std::string with = "--pipeline-parallel " + std::to_string(pipeline_parallel);
  refuse_zero_beyond_one(zero_stage, with);
  refuse_shared_parameters(zero_shared_parameters, with);
  if (sync_every > 1) bad("sync-every", "does not combine with " + with + " (local SGD keeps a whole model per machine)");
  if (save_format == "consolidated")
    bad("save-format", "consolidated needs one worker holding the whole model; under " + with +
                           " each stage saves its part (sharded; `lockstep checkpoint consolidate` makes model.pt of one)");
  if (gradient_checkpointing && pipeline_schedule == "zb")
    bad("gradient-checkpointing", "does not combine with --pipeline-schedule zb: a recomputed block computes its "
                                  "weight gradients with its input gradient, which zb splits; use 1f1b or interleaved");
}

// What --tensor-parallel (above 1) does not combine with yet. The model must be one that splits
// (the GPT; the Trainer says so otherwise). ZeRO 1-3 shard over each tensor rank's data ranks.
void TrainingArguments::validate_tensor_parallel() const {
  if (sequence_parallel && tensor_parallel == 1)
    bad("sequence-parallel", "splits the activations over a tensor group: add --tensor-parallel 2 or more");
  if (tensor_parallel == 1) return;
  const std::string with = "--tensor-parallel " + std::to_string(tensor_parallel);
  refuse_shared_parameters(zero_shared_parameters, with);
  if (sync_every > 1) bad("sync-every", "does not combine with " + with + " (local SGD keeps a whole model per machine)");
  if (save_format == "consolidated")
    bad("save-format", "consolidated needs one worker holding the whole model; under " + with +
                           " every rank saves its cut of the whole tensors (sharded, which any layout loads; "
                           "`lockstep checkpoint consolidate` makes model.pt of one)");
}

// What --cuda-graphs does not capture (yet); one worker and a CUDA device are checked at start.
void TrainingArguments::validate_cuda_graphs() const {
  if (!cuda_graphs) return;
  if (device == "cpu") bad("cuda-graphs", "captures a GPU's step: add --device cuda");
  if (optim == "sgd") bad("cuda-graphs", "captures AdamW's update: use --optim adamw");
  if (fp16)
    bad("cuda-graphs", "does not combine with --fp16 (whether a step is skipped is decided on the host): use --bf16");
  if (gradient_accumulation_steps > 1)
    bad("cuda-graphs", "captures one micro-batch per step: drop --gradient-accumulation-steps (raise "
                       "--per-device-train-batch-size instead)");
  if (gradient_checkpointing)
    bad("cuda-graphs", "does not combine with --gradient-checkpointing yet (its recomputation's random state is not "
                       "captured)");
  if (zero_stage > 0) bad("cuda-graphs", "does not capture ZeRO's collectives: drop --zero-stage");
  if (pipeline_parallel > 1) bad("cuda-graphs", "does not capture a pipeline's sends: drop --pipeline-parallel");
  if (sync_every > 1) bad("cuda-graphs", "captures one worker's step; --sync-every needs several");
}

nlohmann::json TrainingArguments::to_json() const {
  nlohmann::json j;
#define LOCKSTEP_TO_JSON(type, name, value, help, rule) j[#name] = name;
  LOCKSTEP_TRAINING_ARGUMENTS(LOCKSTEP_TO_JSON)
#undef LOCKSTEP_TO_JSON
  return j;
}

void add_arguments(CLI::App& app, TrainingArguments& a) {
#define LOCKSTEP_ADD_FLAG(type, name, value, help, rule) add_flag_for(app, #name, a.name, help, rule);
  LOCKSTEP_TRAINING_ARGUMENTS(LOCKSTEP_ADD_FLAG)
#undef LOCKSTEP_ADD_FLAG
}

std::vector<std::string> config_file_flags(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError("cannot read the config file '" + path + "': check the path given to --config");
  YAML::Node root;
  try {
    root = YAML::Load(in);  // JSON is YAML too
  } catch (const YAML::Exception& e) {
    throw ConfigError("config file '" + path + "' is neither valid YAML nor JSON: " + e.what());
  }
  if (root.IsNull()) return {};
  if (!root.IsMap()) throw ConfigError("config file '" + path + "' must hold a map of setting: value");
  std::vector<std::string> flags;
  for (const auto& kv : root) {
    std::string key = kv.first.as<std::string>();
    std::string value = scalar_text(kv.second, key, path);
    flags.push_back(normalise_flag("--" + key) + "=" + value);
  }
  return flags;
}

TrainingArguments parse_arguments(int argc, const char* const* argv,
                                  const std::function<void(CLI::App&)>& extra, const std::string& description,
                                  const TrainingArguments& defaults) {
  TrainingArguments args = defaults;
  CLI::App app{description.empty() ? "lockstep training" : description};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  if (extra) extra(app);
  add_arguments(app, args);

  std::vector<std::string> user;
  for (int i = 1; i < argc; ++i) user.push_back(normalise_flag(argv[i]));
  // The config file's values go first, so the command line's win.
  std::string config;
  for (std::size_t i = 0; i < user.size(); ++i) {
    if (user[i] == "--config" && i + 1 < user.size()) config = user[i + 1];
    if (user[i].rfind("--config=", 0) == 0) config = user[i].substr(9);
  }
  std::vector<std::string> all;
  if (!config.empty()) {
    for (const std::string& f : config_file_flags(config)) {
      std::string name = f.substr(0, f.find('='));
      if (name == "--config" || app.get_option_no_throw(name) == nullptr)
        throw ConfigError("config file '" + config + "': unknown setting '" + name.substr(2) +
                          "'; run with --help for the settings");
      all.push_back(f);
    }
  }
  all.insert(all.end(), user.begin(), user.end());
  parse_flags(app, std::vector<std::string>(all.rbegin(), all.rend()));  // CLI11 parses a reversed vector
  args.validate();
  return args;
}

void parse_command_line(CLI::App& app, int argc, const char* const* argv) {
  std::vector<std::string> reversed;
  for (int i = argc - 1; i >= 1; --i) reversed.emplace_back(argv[i]);
  parse_flags(app, std::move(reversed));
}

}  // namespace lockstep::train
