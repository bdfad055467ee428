// TrainingArguments: every knob of a Trainer run, with the Hugging Face Trainer's names.
//
// Set from command-line flags (`--per-device-train-batch-size 64`; dashes or underscores, with a
// space or `=`), from a YAML or JSON file (`--config run.yaml`, keys with either spelling), or
// both: flags override the file. `--help` lists every flag with its default. Values are checked
// as a whole by validate(): a zero batch size, a negative rate, an unknown flag, key or
// scheduler is a ConfigError naming the flag and what to do.
//
// Each argument is declared once, in LOCKSTEP_TRAINING_ARGUMENTS below: its type, name,
// default, help and the rule its value must follow. The struct's members, the flags, the
// JSON of training_args.json and the per-value checks are all generated from that table.
//
// Torch-free: parsing, validation and the learning-rate schedule build and test without libtorch.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "lockstep/comm/backends.h"
#include "lockstep/comm/codec.h"

namespace CLI {
class App;
}

namespace lockstep::train {

// The rule a value must follow (checked by validate(), shown by --help).
struct Rule {
  enum Kind { any, at_least, above, within, below_one, one_of } kind = any;
  double low = 0, high = 0;          // at_least: >= low; above: > low; within: [low, high]; below_one: [0, 1)
  std::vector<std::string> choices;  // one_of
};
inline Rule any() {
  return {};
}
inline Rule at_least(double low) {
  return {Rule::at_least, low, 0, {}};
}
inline Rule above(double low) {
  return {Rule::above, low, 0, {}};
}
inline Rule within(double low, double high) {
  return {Rule::within, low, high, {}};
}
inline Rule below_one() {
  return {Rule::below_one, 0, 1, {}};
}
inline Rule one_of(std::vector<std::string> choices) {
  return {Rule::one_of, 0, 0, std::move(choices)};
}
inline Rule backend_rule() {
  return one_of({std::begin(comm::kBackendNames), std::end(comm::kBackendNames)});
}
inline std::vector<std::string> comm_hook_names() {
  std::vector<std::string> names;
  for (const auto& hook : comm::kCommHooks) names.emplace_back(hook.name);
  return names;
}

// clang-format off
// X(type, name, default, help, rule)
#define LOCKSTEP_TRAINING_ARGUMENTS(X)                                                                          \
  X(std::string, output_dir, "output", "checkpoints, metrics.jsonl and traces go here", any())                 \
  /* batches and length */                                                                                     \
  X(int, per_device_train_batch_size, 64, "samples per worker per micro-batch", at_least(1))                   \
  X(int, per_device_eval_batch_size, 256, "samples per worker per eval batch", at_least(1))                   \
  X(int, gradient_accumulation_steps, 1, "micro-batches per optimiser step (all but the last skip the all-reduce)", at_least(1)) \
  X(double, num_train_epochs, 3, "passes over the training data (may be fractional)", any())                   \
  X(std::int64_t, max_steps, -1, "optimiser steps; overrides --num-train-epochs when > 0", any())               \
  /* optimiser and schedule */                                                                                 \
  X(std::string, optim, "adamw",                                                                               \
    "the optimiser: adamw (the faster of the next two that this build has), adamw_torch (libtorch's loop), "     \
    "adamw_torch_fused (one kernel; libtorch 2.4 and later), sgd",                                              \
    one_of({"adamw", "adamw_torch", "adamw_torch_fused", "sgd"}))                                                \
  X(double, learning_rate, 1e-3, "peak learning rate", at_least(0))                                            \
  X(std::string, lr_scheduler_type, "linear", "the learning-rate schedule",                                    \
    one_of({"constant", "constant_with_warmup", "linear", "cosine"}))                                          \
  X(std::int64_t, warmup_steps, 0, "steps of linear warm-up from 0", at_least(0))                              \
  X(double, warmup_ratio, 0, "warm-up as a fraction of all steps (if --warmup-steps is 0)", within(0, 1))      \
  X(double, weight_decay, 0, "decoupled (adamw) or L2 (sgd) weight decay", at_least(0))                        \
  X(double, adam_beta1, 0.9, "adamw", below_one())                                                             \
  X(double, adam_beta2, 0.999, "adamw", below_one())                                                           \
  X(double, adam_epsilon, 1e-8, "adamw", above(0))                                                    \
  X(double, sgd_momentum, 0.9, "sgd", below_one())                                                             \
  X(double, max_grad_norm, 1.0, "clip the global gradient norm to this; 0: no clipping", at_least(0))          \
  X(std::string, device, "cpu",                                                                               \
    "where the model trains: cpu, cuda (the GPU of this worker's LOCAL_RANK) or auto (cuda when there is one)", \
    one_of({"cpu", "cuda", "auto"}))                                                                           \
  X(bool, bf16, false, "bfloat16 autocast (on the training device) for matmuls and convolutions", any())       \
  X(bool, fp16, false,                                                                                         \
    "float16 autocast with dynamic loss scaling (a skipped step on overflow); CUDA, or CPU on libtorch 2.x", any()) \
  X(bool, gradient_checkpointing, false, "recompute each block's activations in backward (less memory, more time)", any()) \
  X(bool, cuda_graphs, false,                                                                                  \
    "capture the step (forward, backward, clipping, AdamW) into a CUDA graph after 3 eager steps and replay it: one " \
    "worker on --device cuda", any())                                                                            \
  /* logging, evaluation, checkpoints */                                                                       \
  X(int, logging_steps, 50, "log (and write metrics.jsonl) every N steps", at_least(1))                       \
  X(std::string, eval_strategy, "no", "when to evaluate", one_of({"no", "steps", "epoch"}))                   \
  X(int, eval_steps, 0, "evaluate every N steps (0: --logging-steps)", at_least(0))                            \
  X(std::string, save_strategy, "epoch", "when to save a checkpoint", one_of({"no", "steps", "epoch"}))        \
  X(int, save_steps, 500, "save every N steps", at_least(1))                                                   \
  X(int, save_total_limit, 0, "keep at most N checkpoints (never deleting the latest or the best); 0: all", at_least(0)) \
  X(std::string, save_format, "auto",                                                                          \
    "sharded: every rank writes what it holds, no gathering; consolidated: rank 0 writes model.pt and optimizer.pt; " \
    "auto: sharded under ZeRO", one_of({"auto", "sharded", "consolidated"}))                                   \
  X(bool, save_in_background, true,                                                                            \
    "sharded saves: copy the state to memory and train on while a thread writes it (=false: wait for the write)", any()) \
  X(std::string, metric_for_best_model, "eval_loss", "the evaluation metric that picks the best checkpoint",   \
    one_of({"eval_loss", "eval_accuracy", "eval_perplexity"}))                                                                    \
  X(std::string, greater_is_better, "auto", "auto: true for metrics named *accuracy*",                         \
    one_of({"auto", "true", "false"}))                                                                         \
  X(bool, load_best_model_at_end, false, "when training ends, reload the weights of the best checkpoint", any()) \
  X(int, early_stopping_patience, 0, "stop after N evaluations without improvement; 0: never", at_least(0))   \
  X(double, early_stopping_threshold, 0, "smallest change that counts as better", at_least(0))                 \
  X(std::string, resume_from_checkpoint, "", "a checkpoint directory, or 'latest' (the newest in --output-dir, if any)", any()) \
  X(bool, disable_tqdm, false, "no progress bar, plain lines even on a terminal", any())                       \
  X(bool, trace, false, "write a Chrome trace per rank to OUTPUT_DIR/trace/ (open in Perfetto)", any())        \
  /* data, determinism, distribution */                                                                        \
  X(std::uint64_t, seed, 42, "seeds the sampler and each rank's torch generator", any())                       \
  X(int, dataloader_num_workers, 0, "batch-building threads per worker", at_least(0))                          \
  X(double, ddp_bucket_cap_mb, 25, "gradient bucket size", above(0))                                  \
  X(std::string, ddp_comm_hook, "none",                                                                        \
    "gradients on the wire: fp16/bf16 everywhere; powersgd, int8 or auto (measured per bucket) between machines only", \
    one_of(comm_hook_names()))                                                                                 \
  X(int, powersgd_rank, 4, "--ddp-comm-hook powersgd/auto: the rank of PowerSGD's approximation", at_least(1)) \
  X(int, powersgd_rounds, 2,                                                                                   \
    "--ddp-comm-hook powersgd/auto: exchanges per step, 2 (P then Q, the paper), 4 or 6 (2 or 3 power "        \
    "iterations: closer to the best rank-r estimate) or 1 (sides alternate)", within(1, 6))                    \
  X(int, comm_hook_start_step, 10,                                                                             \
    "--ddp-comm-hook powersgd/auto: exact steps before compressing (auto measures the link in them)", at_least(0)) \
  X(int, sync_every, 1,                                                                                        \
    "local SGD / DiLoCo: machines average gradients inside themselves and meet (average their progress across " \
    "machines) every N steps; 1: every step, plain DDP", at_least(1))                                          \
  X(double, outer_learning_rate, 1.0, "--sync-every above 1: the outer step's learning rate (DiLoCo: 0.7)", above(0)) \
  X(double, outer_momentum, 0.0, "--sync-every above 1: the outer step's Nesterov momentum (DiLoCo: 0.9)", within(0, 0.999)) \
  X(bool, ddp_find_unused_parameters, false, "reduce zeros for parameters without a gradient", any())          \
  X(bool, sync_batchnorm, false,                                                                               \
    "normalise over the global batch: the model's lockstep::SyncBatchNorm layers all-reduce their statistics", any()) \
  X(int, zero_stage, 0,                                                                                        \
    "ZeRO: 1 shards the optimizer state across workers, 2 also the gradients, 3 also the parameters; 0: DDP",  \
    within(0, 3))                                                                                              \
  X(bool, zero_shared_parameters, false,                                                                       \
    "ZeRO: one copy per machine in shared memory: stages 1, 2 the parameters (every worker on one machine), " \
    "3 the gathered units (shm, or hier across machines)",                                                     \
    any())                                                                                                     \
  X(int, pipeline_parallel, 1,                                                                                 \
    "pipeline ranks P: the model cut into stages on P workers each, the world P x D replicas; 1: no pipeline",  \
    at_least(1))                                                                                               \
  X(int, tensor_parallel, 1,                                                                                   \
    "tensor ranks T: each layer split over T workers of one machine (the world P x D x T); the model must "    \
    "split itself (the GPT does; docs/layout.md)", at_least(1))                                                \
  X(bool, sequence_parallel, false,                                                                            \
    "--tensor-parallel: the activations between the split layers split along the sequence too (Megatron's "    \
    "sequence parallelism: norms, dropouts and residuals on 1/T of the tokens)", any())                  \
  X(std::string, pipeline_schedule, "1f1b", "--pipeline-parallel: the schedule",                               \
    one_of({"gpipe", "1f1b", "interleaved", "zb"}))                                                            \
  X(int, virtual_stages, 1, "--pipeline-schedule interleaved or zb: stages per pipeline rank", at_least(1))          \
  X(int, num_microbatches, 0,                                                                                  \
    "--pipeline-parallel: micro-batches per step, cut from the step's per-device-train-batch-size x "            \
    "gradient-accumulation-steps samples (any number; 0: gradient-accumulation-steps of per-device-train-batch-size)", \
    at_least(0))                                                                                               \
  X(std::string, pipeline_split, "",                                                                           \
    "--pipeline-parallel: units per stage by hand, e.g. 2,3,3,2 (empty: balanced by --pipeline-balance)", any()) \
  X(std::string, pipeline_tied_gradient, "micro-batch",                                                       \
    "--pipeline-parallel: a weight the first and last stage share (a language model's embedding and head) "   \
    "has its gradient sent every micro-batch (bitwise one process's sums) or once a step (fewer bytes: for "   \
    "large vocabularies and slow links; equal up to rounding)", one_of({"micro-batch", "step"}))              \
  X(std::string, pipeline_balance, "time",                                                                     \
    "--pipeline-parallel: balance stages by each unit's measured forward + backward time, or its parameters",    \
    one_of({"time", "parameters"}))                                                                            \
  X(std::string, backend, "auto", "the communication backend", backend_rule())                                \
  X(std::string, config, "", "YAML or JSON file of these settings (flags override it)", any())
// clang-format on

struct TrainingArguments {
#define LOCKSTEP_ARGUMENT_MEMBER(type, name, value, help, rule) type name = value;
  LOCKSTEP_TRAINING_ARGUMENTS(LOCKSTEP_ARGUMENT_MEMBER)
#undef LOCKSTEP_ARGUMENT_MEMBER

  // Throws ConfigError naming the first bad value (as its flag) and the fix.
  void validate() const;
  void validate_pipeline() const;  // the part of validate() about --pipeline-parallel
  void validate_tensor_parallel() const;  // the part of validate() about --tensor-parallel
  void validate_cuda_graphs() const;  // the part of validate() about --cuda-graphs
  bool best_is_greater() const;
  std::int64_t eval_every() const {
    return eval_steps > 0 ? eval_steps : logging_steps;
  }

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

// Parses a program's own command line: --help prints the help and exits 0; a bad flag is a
// ConfigError (exit 2 under lockstep::run_main) naming it.
void parse_command_line(CLI::App& app, int argc, const char* const* argv);

// The flags a config file stands for, in order ("--key=value"), for tests and parse_arguments.
std::vector<std::string> config_file_flags(const std::string& path);

}  // namespace lockstep::train
