#include "lockstep/train/arguments.h"

#include <yaml-cpp/yaml.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "lockstep/error.h"

namespace lockstep::train {
namespace {

bool one_of(const std::string& value, std::initializer_list<const char*> allowed) {
  for (const char* a : allowed)
    if (value == a) return true;
  return false;
}

std::string joined(std::initializer_list<const char*> allowed) {
  std::string out;
  for (const char* a : allowed) out += (out.empty() ? "" : ", ") + std::string(a);
  return out;
}

[[noreturn]] void bad(const std::string& flag, const std::string& problem) {
  throw ConfigError("--" + flag + " " + problem);
}

template <class T>
void at_least(const char* flag, T value, T minimum) {
  if (value < minimum || (std::is_floating_point_v<T> && !std::isfinite(static_cast<double>(value)))) {
    std::ostringstream os;
    os << "must be at least " << minimum << " (got " << value << ")";
    bad(flag, os.str());
  }
}

void member(const char* flag, const std::string& value, std::initializer_list<const char*> allowed) {
  if (!one_of(value, allowed)) bad(flag, "must be one of " + joined(allowed) + " (got '" + value + "')");
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

}  // namespace

bool TrainingArguments::best_is_greater() const {
  if (greater_is_better == "true") return true;
  if (greater_is_better == "false") return false;
  return metric_for_best_model.find("accuracy") != std::string::npos;
}

void TrainingArguments::validate() const {
  if (output_dir.empty()) bad("output-dir", "must not be empty");
  at_least("per-device-train-batch-size", per_device_train_batch_size, 1);
  at_least("per-device-eval-batch-size", per_device_eval_batch_size, 1);
  at_least("gradient-accumulation-steps", gradient_accumulation_steps, 1);
  if (max_steps <= 0 && !(num_train_epochs > 0 && std::isfinite(num_train_epochs)))
    bad("num-train-epochs",
        "must be above 0 when --max-steps is not set (got " + std::to_string(num_train_epochs) + ")");
  if (max_steps == 0) bad("max-steps", "must be positive, or -1 to train for --num-train-epochs");
  member("optim", optim, {"adamw", "sgd"});
  at_least("learning-rate", learning_rate, 0.0);
  member("lr-scheduler-type", lr_scheduler_type, {"constant", "constant_with_warmup", "linear", "cosine"});
  at_least("warmup-steps", warmup_steps, std::int64_t{0});
  if (!(warmup_ratio >= 0 && warmup_ratio <= 1)) bad("warmup-ratio", "must be within 0..1");
  at_least("weight-decay", weight_decay, 0.0);
  if (!(adam_beta1 >= 0 && adam_beta1 < 1)) bad("adam-beta1", "must be within [0, 1)");
  if (!(adam_beta2 >= 0 && adam_beta2 < 1)) bad("adam-beta2", "must be within [0, 1)");
  if (!(adam_epsilon > 0)) bad("adam-epsilon", "must be above 0");
  if (!(sgd_momentum >= 0 && sgd_momentum < 1)) bad("sgd-momentum", "must be within [0, 1)");
  at_least("max-grad-norm", max_grad_norm, 0.0);
  at_least("logging-steps", logging_steps, 1);
  member("eval-strategy", eval_strategy, {"no", "steps", "epoch"});
  at_least("eval-steps", eval_steps, 0);
  member("save-strategy", save_strategy, {"no", "steps", "epoch"});
  at_least("save-steps", save_steps, 1);
  at_least("save-total-limit", save_total_limit, 0);
  if (metric_for_best_model.rfind("eval_", 0) != 0)
    bad("metric-for-best-model",
        "must name an evaluation metric: eval_loss or eval_accuracy (got '" + metric_for_best_model + "')");
  member("metric-for-best-model", metric_for_best_model, {"eval_loss", "eval_accuracy"});
  member("greater-is-better", greater_is_better, {"auto", "true", "false"});
  if (load_best_model_at_end) {
    if (eval_strategy == "no" || save_strategy != eval_strategy)
      bad("load-best-model-at-end",
          "needs --save-strategy and --eval-strategy to be the same (steps or epoch), so "
          "every evaluation has its checkpoint");
    if (save_strategy == "steps" && save_steps % static_cast<int>(eval_every()) != 0)
      bad("load-best-model-at-end", "needs --save-steps to be a multiple of --eval-steps (" +
                                        std::to_string(save_steps) + " is not a multiple of " +
                                        std::to_string(eval_every()) + ")");
  }
  at_least("early-stopping-patience", early_stopping_patience, 0);
  at_least("early-stopping-threshold", early_stopping_threshold, 0.0);
  if (early_stopping_patience > 0 && eval_strategy == "no")
    bad("early-stopping-patience", "needs evaluations: set --eval-strategy steps or epoch");
  at_least("dataloader-num-workers", dataloader_num_workers, 0);
  if (!(ddp_bucket_cap_mb > 0)) bad("ddp-bucket-cap-mb", "must be above 0");
  member("ddp-comm-hook", ddp_comm_hook, {"none", "fp16", "bf16"});
  member("backend", backend, {"auto", "shm", "gloo", "mpi"});
}

nlohmann::json TrainingArguments::to_json() const {
  return {{"output_dir", output_dir},
          {"per_device_train_batch_size", per_device_train_batch_size},
          {"per_device_eval_batch_size", per_device_eval_batch_size},
          {"gradient_accumulation_steps", gradient_accumulation_steps},
          {"num_train_epochs", num_train_epochs},
          {"max_steps", max_steps},
          {"optim", optim},
          {"learning_rate", learning_rate},
          {"lr_scheduler_type", lr_scheduler_type},
          {"warmup_steps", warmup_steps},
          {"warmup_ratio", warmup_ratio},
          {"weight_decay", weight_decay},
          {"adam_beta1", adam_beta1},
          {"adam_beta2", adam_beta2},
          {"adam_epsilon", adam_epsilon},
          {"sgd_momentum", sgd_momentum},
          {"max_grad_norm", max_grad_norm},
          {"bf16", bf16},
          {"logging_steps", logging_steps},
          {"eval_strategy", eval_strategy},
          {"eval_steps", eval_steps},
          {"save_strategy", save_strategy},
          {"save_steps", save_steps},
          {"save_total_limit", save_total_limit},
          {"metric_for_best_model", metric_for_best_model},
          {"greater_is_better", greater_is_better},
          {"load_best_model_at_end", load_best_model_at_end},
          {"early_stopping_patience", early_stopping_patience},
          {"early_stopping_threshold", early_stopping_threshold},
          {"resume_from_checkpoint", resume_from_checkpoint},
          {"disable_tqdm", disable_tqdm},
          {"trace", trace},
          {"seed", seed},
          {"dataloader_num_workers", dataloader_num_workers},
          {"ddp_bucket_cap_mb", ddp_bucket_cap_mb},
          {"ddp_comm_hook", ddp_comm_hook},
          {"ddp_find_unused_parameters", ddp_find_unused_parameters},
          {"backend", backend},
          {"config", config}};
}

void add_arguments(CLI::App& app, TrainingArguments& a) {
  auto* g = &app;
  g->add_option("--config", a.config, "YAML or JSON file of these settings (flags override it)");
  g->add_option("--output-dir", a.output_dir, "checkpoints, metrics.jsonl and traces go here")
      ->capture_default_str();
  g->add_option("--per-device-train-batch-size", a.per_device_train_batch_size,
                "samples per worker per micro-batch")
      ->capture_default_str();
  g->add_option("--per-device-eval-batch-size", a.per_device_eval_batch_size,
                "samples per worker per eval batch")
      ->capture_default_str();
  g->add_option("--gradient-accumulation-steps", a.gradient_accumulation_steps,
                "micro-batches per optimiser step (all but the last skip the all-reduce)")
      ->capture_default_str();
  g->add_option("--num-train-epochs", a.num_train_epochs, "passes over the training data (may be fractional)")
      ->capture_default_str();
  g->add_option("--max-steps", a.max_steps, "optimiser steps; overrides --num-train-epochs when > 0")
      ->capture_default_str();
  g->add_option("--optim", a.optim, "adamw | sgd")->capture_default_str();
  g->add_option("--learning-rate", a.learning_rate, "peak learning rate")->capture_default_str();
  g->add_option("--lr-scheduler-type", a.lr_scheduler_type,
                "constant | constant_with_warmup | linear | cosine")
      ->capture_default_str();
  g->add_option("--warmup-steps", a.warmup_steps, "steps of linear warm-up from 0")->capture_default_str();
  g->add_option("--warmup-ratio", a.warmup_ratio,
                "warm-up as a fraction of all steps (if --warmup-steps is 0)")
      ->capture_default_str();
  g->add_option("--weight-decay", a.weight_decay, "decoupled (adamw) or L2 (sgd) weight decay")
      ->capture_default_str();
  g->add_option("--adam-beta1", a.adam_beta1, "adamw")->capture_default_str();
  g->add_option("--adam-beta2", a.adam_beta2, "adamw")->capture_default_str();
  g->add_option("--adam-epsilon", a.adam_epsilon, "adamw")->capture_default_str();
  g->add_option("--sgd-momentum", a.sgd_momentum, "sgd")->capture_default_str();
  g->add_option("--max-grad-norm", a.max_grad_norm, "clip the global gradient norm to this; 0: no clipping")
      ->capture_default_str();
  g->add_flag("--bf16", a.bf16, "bfloat16 autocast (CPU) for matmuls and convolutions");
  g->add_option("--logging-steps", a.logging_steps, "log (and write metrics.jsonl) every N steps")
      ->capture_default_str();
  g->add_option("--eval-strategy", a.eval_strategy, "no | steps | epoch")->capture_default_str();
  g->add_option("--eval-steps", a.eval_steps, "evaluate every N steps (0: --logging-steps)")
      ->capture_default_str();
  g->add_option("--save-strategy", a.save_strategy, "no | steps | epoch")->capture_default_str();
  g->add_option("--save-steps", a.save_steps, "save every N steps")->capture_default_str();
  g->add_option("--save-total-limit", a.save_total_limit,
                "keep at most N checkpoints (never deleting the latest or the best); 0: all")
      ->capture_default_str();
  g->add_option("--metric-for-best-model", a.metric_for_best_model, "eval_loss | eval_accuracy")
      ->capture_default_str();
  g->add_option("--greater-is-better", a.greater_is_better, "auto | true | false")->capture_default_str();
  g->add_flag(
      "--load-best-model-at-end", a.load_best_model_at_end,
      "when training ends, reload the weights of the checkpoint with the best --metric-for-best-model");
  g->add_option("--early-stopping-patience", a.early_stopping_patience,
                "stop after N evaluations without improvement; 0: never")
      ->capture_default_str();
  g->add_option("--early-stopping-threshold", a.early_stopping_threshold,
                "smallest change that counts as better")
      ->capture_default_str();
  g->add_option("--resume-from-checkpoint", a.resume_from_checkpoint,
                "a checkpoint directory, or 'latest' (the newest in --output-dir, if any)");
  g->add_flag("--disable-tqdm", a.disable_tqdm, "no progress bar, plain lines even on a terminal");
  g->add_flag("--trace", a.trace, "write a Chrome trace per rank to OUTPUT_DIR/trace/ (open in Perfetto)");
  g->add_option("--seed", a.seed, "seeds the sampler and each rank's torch generator")->capture_default_str();
  g->add_option("--dataloader-num-workers", a.dataloader_num_workers, "batch-building threads per worker")
      ->capture_default_str();
  g->add_option("--ddp-bucket-cap-mb", a.ddp_bucket_cap_mb, "gradient bucket size")->capture_default_str();
  g->add_option("--ddp-comm-hook", a.ddp_comm_hook, "none | fp16 | bf16 gradients on the wire")
      ->capture_default_str();
  g->add_flag("--ddp-find-unused-parameters", a.ddp_find_unused_parameters,
              "reduce zeros for parameters without a gradient");
  g->add_option("--backend", a.backend, "auto | shm | gloo | mpi")->capture_default_str();
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
  std::vector<std::string> reversed(all.rbegin(), all.rend());  // CLI11 parses a reversed vector
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    std::printf("%s", app.help().c_str());
    std::exit(0);
  } catch (const CLI::ExtrasError& e) {
    throw ConfigError(std::string(e.what()) + "; run with --help for the flags");
  } catch (const CLI::ParseError& e) {
    throw ConfigError(std::string(e.what()) + "; run with --help for the flags");
  }
  args.validate();
  return args;
}

}  // namespace lockstep::train
