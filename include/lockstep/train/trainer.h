// Trainer: the training loop a DDP job needs, with the Hugging Face Trainer's arguments.
//
//   auto job = lockstep::comm::join_from_env();          // or let the Trainer join
//   lockstep::train::Trainer trainer(lockstep::train::Model::of(net), train_set, test_set, args);
//   trainer.train();                                     // resumes, logs, evaluates, saves
//
// What train() does, per optimiser step: takes per_device_train_batch_size x
// gradient_accumulation_steps samples from this rank's DistributedSampler (set_epoch is called
// for you), runs forward/backward per micro-batch under no_sync for all but the last (so only
// the last all-reduces), with the loss divided so the gradient is the mean over the effective
// batch (per-device x accumulation x world); clips the global norm after the all-reduce; steps
// the optimiser and the schedule. Rank 0 prints the effective batch at start, a progress bar on
// a terminal (plain lines otherwise), and writes OUTPUT_DIR/metrics.jsonl; with --trace every
// rank writes OUTPUT_DIR/trace/rank_N.json. Evaluation counts every real sample once across
// ranks. Checkpoints: see checkpoint.h; a worker restarted by `lockstep run --max-restarts`
// resumes from the newest checkpoint by itself.
//
// Threading: one Trainer per process, used from one thread.
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/comm/communicator.h"
#include "lockstep/comm/rendezvous.h"
#include "lockstep/ddp/parameter_units.h"
#include "lockstep/pipe/units.h"
#include "lockstep/tp/shards.h"
#include "lockstep/train_core/arguments.h"

namespace lockstep::train {

// One batch: inputs and integer targets: a class per sample ([B]), or one per token ([B, T]: a
// language model's next tokens; the loss and accuracy are then over tokens, and the Trainer
// reports tokens/s and perplexity).
struct Batch {
  torch::Tensor input, target;
};

// A map-style dataset. get() is called from loader threads at once: it must be thread-safe.
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual std::size_t size() const = 0;
  virtual Batch get(const std::vector<std::size_t>& indices) const = 0;
};

// A module plus how to call it, so the Trainer needs no template. A module with a
// set_gradient_checkpointing(bool) method (models/gpt.h's) gets --gradient-checkpointing, one with
// pipeline_units() (the GPT language model's) --pipeline-parallel.
struct Model {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::function<void(bool)> set_gradient_checkpointing;  // empty: the model cannot
  // ZeRO stage 3 (ddp/parameter_units.h); empty: the model names no units.
  std::function<std::vector<std::shared_ptr<torch::nn::Module>>()> parameter_units;
  std::function<void(UnitRunner)> set_unit_runner;
  // --pipeline-parallel (pipe/units.h); empty: the model cannot be cut into stages.
  std::function<std::vector<pipe::PipelineUnit>()> pipeline_units;
  // --tensor-parallel (lockstep/tp): splits the model's layers in place over the tensor group (and,
  // with --sequence-parallel, the activations between them over the sequence), its forward then
  // returning this rank's vocabulary columns of every token's logits (models/gpt.h's
  // GptLmHeadModel); tensor_shards lists the shards and where each sits in its whole tensor, for
  // the global norm and for checkpoints, which hold whole tensors. Empty: it cannot.
  std::function<void(comm::Communicator&, bool sequence_parallel)> split_for_tensor_parallel;
  std::function<tp::ShardedParameters()> tensor_shards;

  template <class M>
  static Model of(std::shared_ptr<M> m) {
    Model model;
    model.module = m;
    model.forward = [raw = m.get()](const torch::Tensor& x) { return raw->forward(x); };
    if constexpr (has_checkpointing<M>(0))
      model.set_gradient_checkpointing = [raw = m.get()](bool on) { raw->set_gradient_checkpointing(on); };
    if constexpr (has_units<M>(0)) {
      model.parameter_units = [raw = m.get()] { return raw->parameter_units(); };
      model.set_unit_runner = [raw = m.get()](UnitRunner r) { raw->set_unit_runner(std::move(r)); };
    }
    if constexpr (has_pipeline_units<M>(0)) model.pipeline_units = [raw = m.get()] { return raw->pipeline_units(); };
    if constexpr (has_tensor_split<M>(0)) {
      model.split_for_tensor_parallel = [raw = m.get()](comm::Communicator& g, bool sequence_parallel) {
        raw->split_for_tensor_parallel(g, sequence_parallel);
      };
      model.tensor_shards = [raw = m.get()] { return raw->tensor_shards(); };
    }
    return model;
  }
  template <class Holder, class = decltype(std::declval<Holder>().ptr())>
  static Model of(const Holder& holder) {
    return of(holder.ptr());
  }

 private:
  template <class M>
  static constexpr auto has_checkpointing(int) -> decltype(std::declval<M&>().set_gradient_checkpointing(true), true) {
    return true;
  }
  template <class M>
  static constexpr bool has_checkpointing(...) {
    return false;
  }
  template <class M>
  static constexpr auto has_units(int)
      -> decltype(std::declval<M&>().parameter_units(), std::declval<M&>().set_unit_runner(UnitRunner{}), true) {
    return true;
  }
  template <class M>
  static constexpr bool has_units(...) {
    return false;
  }
  template <class M>
  static constexpr auto has_pipeline_units(int) -> decltype(std::declval<M&>().pipeline_units(), true) {
    return true;
  }
  template <class M>
  static constexpr bool has_pipeline_units(...) {
    return false;
  }
  template <class M>
  static constexpr auto has_tensor_split(int)
      -> decltype(std::declval<M&>().split_for_tensor_parallel(std::declval<comm::Communicator&>(), true),
                  std::declval<M&>().tensor_shards(), true) {
    return true;
  }
  template <class M>
  static constexpr bool has_tensor_split(...) {
    return false;
  }
};

// The run's position. Callbacks read it; the Trainer changes it only through the named
// operations below, and saves and restores it (a checkpoint's trainer_state.json, an elastic
// job's state transfer) through position_json / load_position alone.
struct TrainerState {
  std::int64_t global_step = 0;  // optimiser steps done
  std::int64_t max_steps = 0;    // the run's length in steps
  std::int64_t steps_per_epoch = 0;
  std::uint64_t epoch = 0;          // the epoch in progress
  std::int64_t steps_in_epoch = 0;  // steps of that epoch done
  std::int64_t membership = 0;      // an elastic job's membership number (0 until one changes)
  std::optional<double> best_metric;
  std::string best_checkpoint;  // directory name, e.g. "checkpoint-400"
  nlohmann::json log_history = nlohmann::json::array();
  double fractional_epoch() const;

  void set_length(std::int64_t steps_per_epoch, std::int64_t max_steps);
  void finish_step();   // one optimiser step more, in this epoch
  void finish_epoch();  // the next epoch begins
  void begin_epoch();   // the epoch in `epoch` starts (no step of it done)
  void record_log(const nlohmann::json& entry);
  // Whether `value` beats the best metric so far (then it becomes the best).
  bool offer_metric(double value, bool greater_is_better);
  void set_best_checkpoint(std::string name);
  void set_membership(std::int64_t membership);
  // The position as JSON: the counters, the best metric and checkpoint, the log history (and, for
  // readers, max_steps and the fractional epoch). load_position reads what position_json wrote;
  // a missing counter is nlohmann::json's exception, which the caller names the file for.
  nlohmann::json position_json() const;
  void load_position(const nlohmann::json& position);
};

// Set by callbacks to change the course of training.
struct TrainerControl {
  bool should_stop = false;
};

class TrainerCallback {
 public:
  virtual ~TrainerCallback() = default;
  virtual void on_train_begin(const TrainerState&) {}
  virtual void on_step_end(const TrainerState&, TrainerControl&) {}
  virtual void on_log(const TrainerState&, const nlohmann::json& /*entry*/) {}
  virtual void on_evaluate(const TrainerState&, const nlohmann::json& /*metrics*/, TrainerControl&) {}
  virtual void on_save(const TrainerState&, const std::string& /*checkpoint_dir*/) {}
  virtual void on_train_end(const TrainerState&) {}
};

// Stops training when the metric has not improved by more than `threshold` for `patience`
// evaluations in a row.
class EarlyStoppingCallback : public TrainerCallback {
 public:
  EarlyStoppingCallback(std::string metric, bool greater_is_better, int patience, double threshold);
  void on_evaluate(const TrainerState& state, const nlohmann::json& metrics,
                   TrainerControl& control) override;
  int evaluations_without_improvement() const { return bad_; }

 private:
  std::string metric_;
  bool greater_;
  int patience_;
  double threshold_;
  std::optional<double> best_;
  int bad_ = 0;
};

struct TrainResult {
  std::int64_t global_step = 0;
  double train_loss = 0;  // mean over the run's logged steps
  double seconds = 0;
  double samples_per_second = 0;
  nlohmann::json last_eval;  // empty when no evaluation ran
  bool stopped_early = false;
};

class Trainer {
 public:
  // `comm`: the job's communicator; null makes the Trainer join from the environment (world
  // size 1 when started without a launcher) with args.backend.
  Trainer(Model model, std::shared_ptr<const Dataset> train_dataset,
          std::shared_ptr<const Dataset> eval_dataset, TrainingArguments args,
          std::vector<std::shared_ptr<TrainerCallback>> callbacks = {}, comm::Communicator* comm = nullptr);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // In an elastic job (lockstep run --nnodes MIN:MAX) train(), evaluate() and save_metrics() go
  // on through a lost member: the survivors agree on a new membership and finish the call, and
  // every checkpoint a step owes is written (by the new rank 0 when the writer died).
  TrainResult train();
  // Collective: eval_loss, eval_accuracy, eval_samples over the whole eval dataset.
  nlohmann::json evaluate();
  // Collective: writes OUTPUT_DIR/checkpoint-<step> and returns its path.
  std::string save_checkpoint();
  // Collective (Hugging Face's Trainer.save_metrics): rank 0 writes `metrics` to
  // OUTPUT_DIR/<split>_results.json, whole or not at all, and every rank returns once it is on
  // disk (an Error on every rank when it could not be written).
  void save_metrics(const std::string& split, const nlohmann::json& metrics);

  const TrainerState& state() const;
  const TrainingArguments& args() const;
  comm::Communicator& communicator();
  // Loss of one batch; cross entropy unless replaced (before train()).
  void set_loss(std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)> loss);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Seeds torch's default generator (call before building the model, for reproducible weights).
void set_seed(std::uint64_t seed);

}  // namespace lockstep::train
