// The Trainer's step: one optimiser step, and everything that lasts from one step to the next
// for it.
//
// It owns, and alone creates, replaces and drops:
//   - the gradient all-reduce (the reducer; over this machine's ranks under local SGD, with the
//     machine's communicator it makes for that),
//   - the optimizer over what this rank updates: every parameter, ZeRO's slices, or a pipeline
//     rank's stages (the whole optimizer state also waits here while an elastic job's membership
//     changes, until it is cut into slices again),
//   - local SGD's outer optimizer, --fp16's loss scale,
//   - --pipeline-parallel's pipeline and each pipeline rank's times over a logging window,
//   - --cuda-graphs' captured step, for the duration of train().
// The checkpoints, the elastic run and the reports reach these through the operations below
// (what the state holds, how it is cut, how it is rebuilt after a membership change); the
// components' own interfaces are lent for reading and loading, never to be replaced.
//
// It reads the run's inputs through the Trainer it belongs to (the model, the arguments, the
// communicator, the device, the loss, the datasets) and the run's position (the step about to
// run, for its learning rate), and writes none of them but the model's parameters and gradients.
//
// Threading: the training thread only; the reducer's hooks run inside backward on that thread.
// Calls that say "collective" are made by every rank of the current communicator alike.
#pragma once

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/data/evaluation.h"
#include "lockstep/data/loader.h"
#include "lockstep/ddp/ddp.h"
#include "lockstep/ddp/local_sgd.h"
#include "lockstep/ddp/zero.h"
#include "lockstep/ddp/zero_elastic.h"
#include "lockstep/pipe/pipeline.h"
#include "lockstep/train/sharded_checkpoint.h"
#include "lockstep/train/trainer.h"
#include "lockstep/train_core/loss_scale.h"
#include "lockstep/train_core/metrics.h"
#include "lockstep/train_core/step_metrics.h"

namespace lockstep::train {

class CudaGraphStep;

// One step's data on this rank: its samples (split into micro-batches of the per-device batch),
// the step's samples over all ranks (the mean is over them), and whether the batch is a stand-in
// for a rank that has no sample this step (its loss weighs nothing).
struct StepPlan {
  std::size_t samples = 0;
  double all_ranks_samples = 0;
  bool placeholder = false;
};

// --pipeline-parallel: each pipeline rank's times over a logging window (PipelineStepStats summed),
// and each step's span: from its first action to the end of the gradient norm's all-reduce, which
// every stage leaves together (what the schedule's makespan is to its simulation).
struct PipelineWindow {
  double compute = 0, wait = 0, send = 0, reduce = 0, span = 0;
  std::int64_t steps = 0;
};

class TrainingStep {
 public:
  explicit TrainingStep(Trainer::Impl& run);
  ~TrainingStep();
  TrainingStep(const TrainingStep&) = delete;
  TrainingStep& operator=(const TrainingStep&) = delete;

  // ---- Set-up (training_step_setup.cc) ----
  // Collective: the parts of a run that starts: the pipeline (--pipeline-parallel); or the
  // reducer, the optimizer over this rank's share, and local SGD's outer optimizer.
  void build();
  bool built() const { return optimizer_ || zero_; }
  // Collective: the gradient all-reduce over the current communicator (none on one worker).
  void build_reducer();
  // An optimizer of the configured kind (--optim and its settings) over `params`.
  std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<torch::Tensor> params) const;
  // --cuda-graphs: from here to end_cuda_graphs(), steps are captured once and replayed.
  void begin_cuda_graphs();
  void end_cuda_graphs();  // the default stream again, once the last replay is done

  // ---- An elastic job's membership changes (training_step_setup.cc) ----
  // Drops what lives in the communicator about to go (the reducer's buckets, ZeRO's use of it)
  // and the gradients.
  void leave_communicator();
  // What this member holds of the optimizer state, for the sharded state's recovery.
  HeldState held_state(std::int64_t steps) const;
  // `whole` (the whole optimizer state over every parameter) becomes the optimizer, ZeRO's slices
  // dropped: it waits here until build_optimizer() cuts it, so that a member lost before then
  // leaves it where the next try of the change finds it.
  void hold_whole_state(std::unique_ptr<torch::optim::Optimizer> whole);
  // Collective: the optimizer over the current membership: ZeRO's slices (with `options`) where
  // there is a reducer and ZeRO is asked for, else the whole state; continuing from the held
  // state when `from_held`, else fresh.
  void build_optimizer(const ZeroOptions& options, bool from_held);

  // ---- One step (training_step.cc, pipeline_run.cc) ----
  // Collective: one optimiser step on the loader's batches; adds its figures to `window`.
  StepTimes run(data::DataLoader<Batch>& loader, const StepPlan& plan, LogWindow& window);
  // The step's next batch: the one the captured step handed back, else the loader's.
  std::optional<Batch> next_batch(data::DataLoader<Batch>& loader);
  // Local SGD: the machines meet if they trained apart since they last did (collective). Called
  // before anything reads the model: evaluation, a checkpoint, the end of training.
  void meet_machines();

  // ---- What the checkpoints hold of it ----
  // Collective under ZeRO: the whole optimizer state, as one optimizer over every parameter
  // (gathered from the slices into `gathered`, which then holds it).
  torch::optim::Optimizer& whole_optimizer(std::unique_ptr<torch::optim::Optimizer>& gathered);
  // What this rank writes of a sharded checkpoint (copied when `copy`, for a background write).
  ShardSnapshot snapshot(bool copy);

  // ---- Its parts, lent for reading and loading (null when the run has none) ----
  Reducer* reducer() const { return reducer_.get(); }
  ZeroOptimizer* zero() const { return zero_.get(); }
  bool stage3() const;  // ZeRO shards the parameters themselves
  OuterOptimizer* outer() const { return outer_.get(); }
  pipe::Pipeline* pipeline() const { return pipeline_.get(); }
  torch::nn::Module* stage_module() const { return stage_module_.get(); }
  // The optimizer over every parameter or this pipeline rank's (none under ZeRO).
  torch::optim::Optimizer* optimizer() const { return optimizer_.get(); }
  // The optimizer over what this rank updates: its ZeRO slices, or every parameter.
  torch::optim::Optimizer& stepper() { return zero_ ? zero_->shard_optimizer() : *optimizer_; }
  LossScale& loss_scale() { return loss_scale_; }
  const LossScale& loss_scale() const { return loss_scale_; }
  // Local SGD: the ranks of this machine, which all-reduce gradients between themselves.
  int machine_ranks() const { return machine_comm_ ? machine_comm_->size() : 1; }

  // ---- --pipeline-parallel (pipeline_run.cc) ----
  data::EvalTotals pipeline_eval_totals();            // collective: evaluation through the pipeline
  void add_pipeline_fields(metrics::StepLog& entry);  // collective: each pipeline rank's window
  void check_stage_replicas();                        // collective: each stage's replicas agree
  // --zero-stage 1 under a pipeline or tensor parallelism (zero_one_shares.cc): after a load, this
  // replica keeps the optimizer state of the parameters it updates and drops the rest.
  void keep_own_optimizer_state();
  // What the optimizer updates here: every parameter this rank trains, or under ZeRO-1 its share.
  std::vector<torch::Tensor> updated_parameters() const;
  double tensor_parallel_clip(double max_norm);       // collective: the norm over the tensor group

 private:
  struct MicroBatch;
  void build_outer();
  void build_pipeline();
  // training_step.cc: the step as written: micro-batches, backward, the all-reduce, clipping and
  // the optimiser; adds the bytes and buckets it all-reduced.
  StepTimes eager_step(data::DataLoader<Batch>& loader, const StepPlan& plan, LogWindow& window, double& bytes,
                       int& buckets);
  void forward_backward(data::DataLoader<Batch>& loader, const MicroBatch& micro, StepTimes& t, LogWindow& window);
  void account_communication(StepTimes& t, double& bytes, int& buckets);
  bool unscale_gradients();
  bool skip_overflowed_step();
  void apply_update(LogWindow& window);
  void optimizer_step(StepTimes& t, LogWindow& window);
  StepTimes pipeline_step(data::DataLoader<Batch>& loader, const StepPlan& plan, LogWindow& window);

  Trainer::Impl& run_;
  std::unique_ptr<Reducer> reducer_;                    // several workers
  std::unique_ptr<torch::optim::Optimizer> optimizer_;  // one worker, DDP, or this pipeline rank's parameters
  // --pipeline-parallel above 1: the stages this rank runs, and their own parameters as a module
  // (by the model's names: what the optimizer updates and the checkpoints save of this rank).
  std::unique_ptr<pipe::Pipeline> pipeline_;
  std::shared_ptr<torch::nn::Module> stage_module_;
  PipelineWindow pipeline_window_;
  // --zero-stage 1 under a pipeline or tensor parallelism (zero_one_shares.cc): ZeRO-1 by whole
  // tensors over the replicas of what this rank trains; for each of trained_parameters(), the
  // replica that updates it (empty without ZeRO or replicas).
  std::vector<int> owners_;
  bool shares_by_tensor() const;                        // asked for: --zero-stage 1 with PP or TP
  std::vector<torch::Tensor> trained_parameters() const;  // its stages', or the whole (split) model's
  comm::Communicator& replica_group() const;            // the stage's replicas, or the data group
  std::vector<torch::Tensor> updated_share();           // makes owners_; what this rank updates
  void share_updates();                                 // collective over the replicas: the new values
  void zero_gradients();                                // the optimizer's, and the others' shares too
  std::unique_ptr<ZeroOptimizer> zero_;  // --zero-stage 1 to 3 on several workers
  // --sync-every above 1 (local SGD): the reducer spans this machine's ranks only, and the
  // machines meet through the outer optimizer.
  std::unique_ptr<comm::Communicator> machine_comm_;
  std::unique_ptr<OuterOptimizer> outer_;
  LossScale loss_scale_;  // --fp16
  std::unique_ptr<CudaGraphStep> cuda_graph_;
};

}  // namespace lockstep::train
