// The Trainer's insides: the run, and the parts it is made of.
//
// The run (Trainer::Impl, this file) holds the run's inputs, set when the Trainer is made and
// read by every part: the model, the datasets, the arguments, the callbacks, the loss, the device
// and the communicator (which only the elastic run replaces, at a membership change). It owns the
// run's position (TrainerState, the schedule, the epilogue of the last step) and drives the
// parts, each of which owns its own state:
//   TrainingStep        training_step.h: one optimiser step and what lasts between steps (the
//                       reducer, the optimizer or ZeRO, local SGD, the loss scale, the pipeline,
//                       --cuda-graphs' captured step)
//   TrainerCheckpoints  trainer_checkpoints.h: saving, finding and resuming from checkpoints
//   ElasticRun          elastic_run.h: the run of an elastic job, through members lost and joined
//   TrainerReports      trainer_reports.h: metrics.jsonl, the trace, the first lines, the progress line
// The checkpoints and the elastic run restore the run's position (that is what they are for);
// they reach the step's state only through TrainingStep's operations.
//
// Files:
//   trainer.cc              construction, the run (set-up, epochs, what follows each step)
//   trainer_reports.cc      what the run says: its start, each logging window, the progress line
//   training_step.cc        one optimiser step: micro-batches, backward, clipping, the optimiser
//   training_step_setup.cc  the step's parts built, rebuilt after a membership change, saved
//   cuda_graph_step.cc      CudaGraphStep: under --cuda-graphs, that step captured once and replayed
//   pipeline_run.cc         the same under --pipeline-parallel: the pipeline's set-up, step, evaluation
//   elastic_run.cc          ElasticRun: the run of an elastic job, through members lost and joined
//   trainer_checkpoints.cc  TrainerCheckpoints: saving, finding and resuming from checkpoints
//   evaluate.cc             distributed evaluation
// Threading: everything here runs on the training thread; the reducer's hooks run inside
// backward on that same thread (CPU autograd).
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/base/clock.h"
#include "lockstep/comm/elastic.h"
#include "lockstep/data/elastic_sampler.h"
#include "lockstep/data/evaluation.h"
#include "lockstep/data/loader.h"
#include "lockstep/data/sampler.h"
#include "lockstep/ddp/zero.h"
#include "lockstep/pipe/pipeline.h"
#include "lockstep/pipe_core/layout.h"
#include "lockstep/train/sharded_checkpoint.h"
#include "lockstep/train/trainer.h"
#include "lockstep/train_core/blas.h"
#include "lockstep/train_core/metrics.h"
#include "lockstep/train_core/run_outputs.h"
#include "lockstep/train_core/schedule.h"
#include "lockstep/train_core/step_metrics.h"
#include "elastic_run.h"
#include "trainer_checkpoints.h"
#include "trainer_reports.h"
#include "training_step.h"

namespace lockstep::train {

using LossFn = pipe::LossFn;  // the loss the pipeline's last stage computes is the Trainer's

// This rank's counters that a logging window reports the change of: what it sent over the network,
// and how long its data and tensor groups' collectives ran (Communicator::busy_seconds).
struct WindowCounters {
  comm::NetworkStats network;
  double data_busy = 0, tensor_busy = 0;
};

// What one call of train() carries from step to step.
struct RunProgress {
  Clock::time_point start = Clock::now();
  std::int64_t first_step = 0;  // where this start began (above 0 after a resume)
  TrainerControl control;
  LogWindow window;
  double loss_sum = 0, loss_count = 0, samples = 0;  // the whole run, all ranks
  WindowCounters at_window_start;                    // this rank's, to log each window's share
  std::optional<int> straggler;                      // named in the last window, if any
  std::int64_t overflows_at_window_start = 0;        // --fp16: the loss scale's overflows before the window
};

// What follows optimiser step `step`, part by part, and how far it got. An elastic job moves it
// with the state, so that after a membership change every member resumes at the same part: the
// checkpoint a completed step owes is written whoever survives, and no part runs twice.
struct StepEpilogue {
  enum Part : int { log, evaluate, end_epoch, save, callbacks, final_save, done };
  std::int64_t step = 0;
  int next = done;     // the first part not done
  bool saved = false;  // this step's checkpoint is on disk (the final save does not repeat it)
};

// Under ZeRO stage 3, every parameter gathered for the scope (collective), then back to slices;
// with keep_values, what was written into them (a load) becomes the slices. Elsewhere nothing.
class WholeParameters {
 public:
  WholeParameters(Trainer::Impl& trainer, bool keep_values);
  ~WholeParameters() noexcept(false);
  WholeParameters(const WholeParameters&) = delete;
  WholeParameters& operator=(const WholeParameters&) = delete;

 private:
  ZeroOptimizer* zero_ = nullptr;
  bool keep_values_;
};

// FNV-1a of one parameter's bytes, and the fingerprint of a model from its parameters' hashes in
// the model's order: equal exactly when the parameters are bitwise equal, however they are spread
// over ranks (trainer.cc).
std::uint64_t parameter_hash(const torch::Tensor& p);
std::string combined_fingerprint(const std::vector<std::uint64_t>& hashes);
// Of a module's parameters in order (ZeRO stage 3's gathered unit by unit when `zero` is given).
std::string parameters_fingerprint(const torch::nn::Module& module, ZeroOptimizer* zero);

struct Trainer::Impl {
  Model model;
  std::shared_ptr<const Dataset> train_set, eval_set;
  TrainingArguments args;
  ZeroOptions zero_plan;  // from args, once: what every part asks of ZeRO
  std::vector<std::shared_ptr<TrainerCallback>> callbacks;
  comm::Job job;  // when the Trainer joined by itself
  comm::Communicator* comm = nullptr;
  // --tensor-parallel (tensor_parallel_run.cc): the tensor and data groups the layout derives,
  // made when T > 1; the replicas of a parameter reduce over the data group, else every rank.
  // With a pipeline too, the data group is the pipeline's (its stage group), and mesh_comm (this
  // tensor rank's P x D ranks) is what the pipeline runs over. Declared before the step, whose
  // reducer and pipeline use them, so that they are destroyed after it.
  std::unique_ptr<comm::Communicator> tensor_comm, data_comm, mesh_comm;
  LossFn loss_fn;
  // Evaluation's predicted class of each output row (accuracy); empty: argmax over the last dimension.
  std::function<torch::Tensor(const torch::Tensor&)> predict_fn;
  mutable std::optional<Layout> layout_;  // layout() keeps it
  torch::Device device = torch::kCPU;  // --device: where the model, its batches and its optimizer live

  // training_step.h: one optimiser step and what lasts between steps (declared before the
  // elastic run, whose communicator its reducer uses, so that it is destroyed after it).
  TrainingStep step{*this};
  Schedule schedule;
  TrainerState state;
  StepEpilogue epilogue;
  TrainerReports reports{*this};  // trainer_reports.h: metrics.jsonl, the trace, the progress line

  // The autocast of --bf16 or --fp16; none: float32.
  std::optional<at::ScalarType> autocast_dtype() const {
    if (args.bf16) return at::kBFloat16;
    if (args.fp16) return at::kHalf;
    return std::nullopt;
  }

  int rank() const { return comm->rank(); }
  int world() const { return comm->size(); }
  bool pipelined() const { return args.pipeline_parallel > 1; }
  // The job's layout (pipe_core/layout.h), built and checked once from the arguments and the
  // machines; rebuilt only when an elastic job's membership changed the world (data ranks alone).
  const Layout& layout() const;
  // Data parallelism's view of the job, from the layout: under --pipeline-parallel P its world / P
  // replicas (the pipeline ranks of a replica read the same samples), else every rank.
  int data_rank() const { return layout().data_rank_of(rank()); }
  int data_world() const { return layout().data(); }
  // The groups of --tensor-parallel: see tensor_comm above.
  comm::Communicator& data_communicator() const { return data_comm ? *data_comm : *comm; }
  WindowCounters window_counters() const;
  void split_model();            // collective: the groups made, the model split, its loss set
  void check_tensor_replicas();  // collective: each shard's replicas agree
  // The model's shards and the tensor group, for checkpoints (which hold whole tensors); nullopt
  // when the model is not split.
  std::optional<TensorSplit> tensor_split() const;
  // Samples one rank takes per optimiser step.
  std::size_t samples_per_step() const;
  double learning_rate_at(std::int64_t at) const { return args.learning_rate * schedule.multiplier(at); }
  TraceWriter* trace() const { return reports.trace(); }
  // Whether the tests asked for `kind` here (LOCKSTEP_FAULT_INJECT). `at` is a step, or for
  // kill-in-state-transfer and await-joiner a membership. In an elastic job a fault fires in its first membership
  // only (kill-in-state-transfer: while entering the one named), so the member that takes over
  // the dead one's work does not die the same way.
  bool fault(const char* kind, std::int64_t at) const;
  // Rank 0 writes the line to metrics.jsonl; every rank keeps it in the log history.
  void log(const nlohmann::json& entry);

  // trainer.cc
  TrainResult train();
  void prepare(data::DistributedSampler& sampler, bool& resumed_mid_epoch);
  void place_model();
  void check_precision() const;
  void run_epoch(data::DistributedSampler& sampler, RunProgress& run);
  // Logging, evaluation, the end of an epoch, checkpoints and callbacks after a step: starts the
  // step's epilogue (after_step) or goes on with the parts not done (run_epilogue).
  void after_step(std::size_t position, std::size_t num_samples, RunProgress& run);
  void run_epilogue(std::size_t position, std::size_t num_samples, RunProgress& run);
  bool evaluation_due(bool epoch_done) const;
  bool save_due(bool epoch_done) const;
  void load_best_model();
  void check_replicas();  // collective: logs whether every rank ends with the same parameters
  TrainResult result(const RunProgress& run) const;

  // elastic_run.h: the run of an elastic job (lockstep run --nnodes MIN:MAX), when this is one.
  std::unique_ptr<ElasticRun> elastic;
  // Runs `work` (collective). In an elastic job, when a member is lost in it, the survivors change
  // membership and run it again, until it completes; elsewhere it runs once.
  void run_recovering(const std::function<void()>& work) { elastic ? elastic->run_recovering(work) : work(); }

  // trainer_checkpoints.h: saving, finding and resuming from checkpoints, and the run's results
  // files (declared last: it refers to the parts above).
  TrainerCheckpoints checkpoints{*this};

  // evaluate.cc
  nlohmann::json evaluate();
  void evaluate_during_training(TrainerControl& control);
};

}  // namespace lockstep::train
