// TrainingArguments: every knob of a Trainer run, with the Hugging Face Trainer's names.
//
// Set from command-line flags (`--per-device-train-batch-size 64`; dashes or underscores, with a
// space or `=`), from a YAML or JSON file (`--config run.yaml`, keys with either spelling), or
// both: flags override the file. `--help` lists every flag with its default. Values are checked
// as a whole by validate(): a zero batch size, a negative rate, an unknown flag, key or
// scheduler is a ConfigError naming the flag and what to do.
//
// Torch-free: parsing, validation and the learning-rate schedule build and test without libtorch.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace lockstep::train {

struct TrainingArguments {
  std::string output_dir = "output";  // checkpoints, metrics.jsonl, traces

  // Batches and length.
  int per_device_train_batch_size = 64;
  int per_device_eval_batch_size = 256;
  int gradient_accumulation_steps = 1;
  double num_train_epochs = 3;
  std::int64_t max_steps = -1;  // > 0 overrides num_train_epochs

  // Optimiser and schedule.
  std::string optim = "adamw";  // adamw | sgd
  double learning_rate = 1e-3;
  std::string lr_scheduler_type = "linear";  // constant | constant_with_warmup | linear | cosine
  std::int64_t warmup_steps = 0;
  double warmup_ratio = 0;  // of the total steps, used when warmup_steps is 0
  double weight_decay = 0;
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_epsilon = 1e-8;
  double sgd_momentum = 0.9;
  double max_grad_norm = 1.0;  // 0 disables clipping
  bool bf16 = false;           // CPU autocast to bfloat16 for matmuls and convolutions

  // Logging, evaluation, checkpoints.
  int logging_steps = 50;
  std::string eval_strategy = "no";     // no | steps | epoch
  int eval_steps = 0;                   // 0: logging_steps
  std::string save_strategy = "epoch";  // no | steps | epoch
  int save_steps = 500;
  int save_total_limit = 0;  // 0: keep all; never deletes the latest or the best
  std::string metric_for_best_model = "eval_loss";
  std::string greater_is_better = "auto";  // auto: true for names containing "accuracy"
  bool load_best_model_at_end = false;     // reload the best checkpoint's weights when training ends
  int early_stopping_patience = 0;         // evaluations without improvement; 0: off
  double early_stopping_threshold = 0;
  std::string resume_from_checkpoint;  // a checkpoint directory, or "latest"
  bool disable_tqdm = false;           // plain log lines even on a terminal
  bool trace = false;                  // Chrome trace per rank under output_dir/trace/

  // Data, determinism, distribution.
  std::uint64_t seed = 42;
  int dataloader_num_workers = 0;
  double ddp_bucket_cap_mb = 25;
  std::string ddp_comm_hook = "none";  // none | fp16 | bf16
  bool ddp_find_unused_parameters = false;
  std::string backend = "auto";  // auto | shm | gloo | mpi

  std::string config;  // the YAML/JSON file the values came from, if any

  // Throws ConfigError naming the first bad value (as its flag) and the fix.
  void validate() const;
  bool best_is_greater() const;
  std::int64_t eval_every() const { return eval_steps > 0 ? eval_steps : logging_steps; }

  nlohmann::json to_json() const;
};

// Adds every TrainingArguments flag to `app`, bound to `args` (for programs with their own
// options or subcommands).
void add_arguments(CLI::App& app, TrainingArguments& args);

// Reads `--config FILE` (YAML or JSON) if present, then the flags, then validates. `extra` may
// add the program's own options to the parser first. `--help` prints the flags with their
// defaults and exits 0; a bad flag or value throws ConfigError.
// `defaults` are the values before the file and the flags (and what --help shows).
TrainingArguments parse_arguments(int argc, const char* const* argv,
                                  const std::function<void(CLI::App&)>& extra = {},
                                  const std::string& description = "",
                                  const TrainingArguments& defaults = {});

// The flags a config file stands for, in order ("--key=value"), for tests and parse_arguments.
std::vector<std::string> config_file_flags(const std::string& path);

}  // namespace lockstep::train
