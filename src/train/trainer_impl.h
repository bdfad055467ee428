// The Trainer's insides, shared by the files that implement it:
//   trainer.cc              construction, the run (set-up, epochs, what follows each step)
//   training_step.cc        one optimiser step: micro-batches, backward, clipping, the optimiser
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
#include "lockstep/ddp/ddp.h"
#include "lockstep/ddp/local_sgd.h"
#include "lockstep/ddp/zero.h"
#include "lockstep/pipe/pipeline.h"
#include "lockstep/train/trainer.h"
#include "lockstep/train_core/blas.h"
#include "lockstep/train_core/loss_scale.h"
#include "lockstep/train_core/metrics.h"
#include "lockstep/train_core/run_outputs.h"
#include "lockstep/train_core/schedule.h"
#include "lockstep/train_core/step_metrics.h"
#include "cuda_graph_step.h"
#include "elastic_run.h"
#include "trainer_checkpoints.h"

namespace lockstep::train {

using LossFn = std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;

// What one call of train() carries from step to step.
struct RunProgress {
  Clock::time_point start = Clock::now();
  std::int64_t first_step = 0;  // where this start began (above 0 after a resume)
  TrainerControl control;
  LogWindow window;
  double loss_sum = 0, loss_count = 0, samples = 0;  // the whole run, all ranks
  comm::NetworkStats network_at_window_start;        // this rank's, to log each window's share
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

// The model's FLOPs per sample and the rates this worker multiplies at (0: not measured): what
// the log's model_flops_per_second and mfu come from.
struct RunFlops {
  std::optional<double> per_sample;
  double fp32_rate = 0, bf16_rate = 0;
};

// --pipeline-parallel: each pipeline rank's times over a logging window (PipelineStepStats summed),
// and each step's span: from its first action to the end of the gradient norm's all-reduce, which
// every stage leaves together (what the schedule's makespan is to its simulation).
struct PipelineWindow {
  double compute = 0, wait = 0, send = 0, reduce = 0, span = 0;
  std::int64_t steps = 0;
};

struct Trainer::Impl {
  Model model;
  std::shared_ptr<const Dataset> train_set, eval_set;
  TrainingArguments args;
  ZeroOptions zero_plan;  // from args, once: what every part asks of ZeRO
  std::vector<std::shared_ptr<TrainerCallback>> callbacks;
  comm::Job job;  // when the Trainer joined by itself
  comm::Communicator* comm = nullptr;
  LossFn loss_fn;
  torch::Device device = torch::kCPU;  // --device: where the model, its batches and its optimizer live

  std::unique_ptr<Reducer> reducer;                     // several workers
  std::unique_ptr<torch::optim::Optimizer> optimizer;   // one worker, DDP, or this pipeline rank's parameters
  // --pipeline-parallel above 1: the stages this rank runs, and their own parameters as a module
  // (by the model's names: what the optimizer updates and the checkpoints save of this rank).
  std::unique_ptr<pipe::Pipeline> pipeline;
  std::shared_ptr<torch::nn::Module> stage_module;
  PipelineWindow pipeline_window;
  std::unique_ptr<ZeroOptimizer> zero;                  // --zero-stage 1 or 2 on several workers
  // --sync-every above 1 (local SGD): the reducer spans this machine's ranks only, and the
  // machines meet through the outer optimizer.
  std::unique_ptr<comm::Communicator> machine_comm;
  std::unique_ptr<OuterOptimizer> outer;
  Schedule schedule;
  TrainerState state;
  StepEpilogue epilogue;
  std::unique_ptr<RunOutputs> outputs;
  RunFlops flops;
  LossScale loss_scale;  // --fp16

  // The autocast of --bf16 or --fp16; none: float32.
  std::optional<at::ScalarType> autocast_dtype() const {
    if (args.bf16) return at::kBFloat16;
    if (args.fp16) return at::kHalf;
    return std::nullopt;
  }

  bool stage3() const { return zero && zero_plan.shards_parameters(); }
  int rank() const { return comm->rank(); }
  int world() const { return comm->size(); }
  bool pipelined() const { return args.pipeline_parallel > 1; }
  // Data parallelism's view of the job: under --pipeline-parallel P its world / P replicas (the
  // pipeline ranks of a replica read the same samples), else every rank.
  int data_rank() const;
  int data_world() const;
  // Samples one rank takes per optimiser step.
  std::size_t samples_per_step() const;
  double learning_rate_at(std::int64_t step) const { return args.learning_rate * schedule.multiplier(step); }
  TraceWriter* trace() const { return outputs ? outputs->trace() : nullptr; }
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
  void build_reducer();
  void build_optimizer();
  void build_outer();
  // Local SGD: the machines meet if they trained apart since they last did (collective). Called
  // before anything reads the model: evaluation, a checkpoint, the end of training.
  void meet_machines();
  void place_model();
  void check_precision() const;
  // An optimizer of the configured kind (--optim and its settings) over `params`.
  std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<torch::Tensor> params) const;
  // The optimizer over what this rank updates: its ZeRO slices, or every parameter.
  torch::optim::Optimizer& stepper() { return zero ? zero->shard_optimizer() : *optimizer; }
  void announce();
  metrics::TrainBegin train_begin_record(const BlasInfo& blas) const;
  // Collective in effect (every rank measures at once, sharing the cores as training will).
  RunFlops count_flops() const;
  void log_modes() const;
  void run_epoch(data::DistributedSampler& sampler, RunProgress& run);
  // Logging, evaluation, the end of an epoch, checkpoints and callbacks after a step: starts the
  // step's epilogue (after_step) or goes on with the parts not done (run_epilogue).
  void after_step(std::size_t position, std::size_t num_samples, RunProgress& run);
  void run_epilogue(std::size_t position, std::size_t num_samples, RunProgress& run);
  bool evaluation_due(bool epoch_done) const;
  bool save_due(bool epoch_done) const;
  void log_or_show_progress(bool last, RunProgress& run);
  void log_window(RunProgress& run);
  void show_progress(double loss, const std::string& rate, double exposed_fraction, const RunProgress& run);
  void load_best_model();
  void check_replicas();  // collective: logs whether every rank ends with the same parameters
  TrainResult result(const RunProgress& run) const;

  // training_step.cc
  // One step's data on this rank: its samples (split into micro-batches of the per-device batch),
  // the step's samples over all ranks (the mean is over them), and whether the batch is a stand-in
  // for a rank that has no sample this step (its loss weighs nothing).
  struct StepPlan {
    std::size_t samples = 0;
    double all_ranks_samples = 0;
    bool placeholder = false;
  };
  StepTimes train_step(data::DataLoader<Batch>& loader, std::size_t step_samples, LogWindow& window);
  StepTimes train_step(data::DataLoader<Batch>& loader, const StepPlan& plan, LogWindow& window);
  // The step as written: micro-batches, backward, the all-reduce, clipping and the optimiser;
  // adds the bytes and buckets it all-reduced.
  StepTimes eager_step(data::DataLoader<Batch>& loader, const StepPlan& plan, LogWindow& window, double& bytes,
                       int& buckets);
  // The step's next batch: the one cuda_graph handed back, else the loader's.
  std::optional<Batch> next_batch(data::DataLoader<Batch>& loader);
  // --cuda-graphs, during train(): replays the step once it is captured (cuda_graph_step.h).
  std::unique_ptr<CudaGraphStep> cuda_graph;

  // pipeline_run.cc
  void build_pipeline();
  StepTimes pipeline_step(data::DataLoader<Batch>& loader, const StepPlan& plan, LogWindow& window);
  data::EvalTotals pipeline_eval_totals();
  void add_pipeline_fields(metrics::StepLog& entry);  // collective: each pipeline rank's window
  void check_stage_replicas();                         // collective: each stage's replicas agree

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
