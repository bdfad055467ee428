// Pipeline parallelism: a model's units (pipe/units.h) cut into stages that run on different
// workers, micro-batches flowing through them under a schedule table (pipe_core/schedule.h),
// combined with data parallelism: world = P pipeline ranks x D replicas (pipe_core/mesh.h).
//
//   lockstep::pipe::PipelineOptions o;  o.pipeline_parallel = 2;  o.schedule = ScheduleKind::zero_bubble;
//   lockstep::pipe::Pipeline pipe(gpt->pipeline_units(), *comm, o, sample, cross_entropy);
//   auto opt = AdamW(pipe.parameters(), ...);         // this rank's stages' parameters only
//   for (...) {
//     pipe.train_step(micro_batches);                 // every stage's gradients, reduced over its replicas
//     pipe.clip_grad_norm(1.0);                       // the norm over all stages
//     opt.step(); opt.zero_grad();
//     pipe.after_optimizer_step();                    // tied weights: the last stage takes the first's
//   }
//
// Exactness. In float32 the parameters after any number of steps equal, to the bit, those of one
// process (or D processes under DDP, for D replicas) that runs the model's own forward over the
// same micro-batches in the same order with the same loss weights, the same clipping and the same
// optimizer: every stage accumulates its micro-batches' gradients in micro-batch order (every
// schedule keeps that order), activations and their gradients cross stages unchanged, the
// zero-bubble split runs the very autograd nodes a whole backward runs, dropout masks come from
// per-micro-batch seeds (units.h), the gradient norm is assembled in the model's parameter order,
// and a tied parameter's gradient is summed micro-batch by micro-batch as one process sums it.
// Hence the tests compare bits, not tolerances.
//
// Tied parameters. A parameter read by units on two stages (a language model's embedding and
// head) must be read by the first and the last stage (ConfigError otherwise). The first stage
// owns it (its optimizer updates it, its checkpoint holds it). For each micro-batch the last stage
// sends its gradient of the parameter to the first, which adds it to its own before accumulating
// (vocabulary x width floats per micro-batch: cheap for byte-level vocabularies, dear for 50k-token
// ones or slow links: TiedGradient::step sends the step's sum once, with the last micro-batch), and
// after each optimizer step the first stage sends the new value back.
//
// What each replica group does: the D ranks of a pipeline rank reduce its gradients with
// DistributedDataParallel's reducer (buckets launched from the gradient hooks during the last
// micro-batch's backward, overlapping it and the rest of the schedule; awaited at the end of
// train_step).
//
// Failure: every transfer and reduction has the communicators' deadlines; a stage that dies makes
// its neighbours' recvs fail with PeerError within the communicators' peer_check, they exit, and so
// on down the pipeline: every rank fails within seconds, naming the peer, never hangs.
//
// Threading: one training thread; the communicators' threads move the bytes.
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/comm/communicator.h"
#include "lockstep/ddp/ddp.h"
#include "lockstep/pipe/units.h"
#include "lockstep/pipe_core/mesh.h"
#include "lockstep/pipe_core/partition.h"
#include "lockstep/pipe_core/schedule.h"

namespace lockstep::pipe {

// The schedules, the mesh and the stage plans are the torch-free pipe_core's; a pipeline's options
// and plan speak of them by these names.
using pipe_core::parse_schedule_kind;
using pipe_core::PipelineMesh;
using pipe_core::schedule_name;
using pipe_core::ScheduleKind;
using pipe_core::StagePlan;

struct PipelineOptions {
  int pipeline_parallel = 2;  // P: pipeline ranks (the world must be a multiple)
  ScheduleKind schedule = ScheduleKind::one_f_one_b;
  int virtual_stages = 1;  // v: stages per rank (interleaved only)
  std::string split;       // units per stage by hand ("1,3,3,2"); empty: balanced
  enum class Balance { time, parameters };
  Balance balance = Balance::time;  // measured forward + backward seconds per unit, or parameter counts
  std::optional<torch::ScalarType> autocast;  // forwards under autocast to this dtype (bf16, fp16)
  // A tied parameter's gradient from the last stage to the first: every micro-batch (bitwise one
  // process's sums), or once a step, summed (m times fewer bytes; equal up to rounding).
  enum class TiedGradient { micro_batch, step };
  TiedGradient tied_gradient = TiedGradient::micro_batch;
  DdpOptions ddp;  // how each pipeline rank's replicas reduce its gradients
  // Under tensor parallelism the pipeline runs over one tensor rank's mesh (Layout's ParallelDim::mesh),
  // each tensor rank its own, in step: a unit's collectives over the tensor group meet because every
  // mesh runs the same plan and schedule. `tensor_group` makes the plan the same: the unit costs its
  // rank 0 measured are every member's. `split_parameters`: the units' parameters that are shards
  // of split tensors (the others are whole on every tensor rank), for the norm of clip_grad_norm.
  comm::Communicator* tensor_group = nullptr;
  std::vector<torch::Tensor> split_parameters;
};

// ConfigError naming the problem: P or v below 1, v above 1 without the interleaved or zb schedule.
void validate(const PipelineOptions& options);

struct MicroBatch {
  torch::Tensor input;   // the first stage's input
  torch::Tensor target;  // the loss's target (the last stage's)
  double loss_weight = 1;  // the micro-batch's loss is multiplied by this before its backward
  double loss_scale = 1;   // --fp16: and then by this (two products, as the unpipelined step's)
};

using LossFn = std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;

// One step on this rank.
struct PipelineStepStats {
  int micro_batches = 0;
  double loss_sum = 0, loss_targets = 0;  // the last stage's: sum of loss x targets, and targets
  double compute_seconds = 0;   // forwards, backwards, weight halves
  double forward_seconds = 0;   // ... of which forwards (the loss included)
  double wait_seconds = 0;      // blocked in recvs: the schedule's bubble, and transfers not hidden
  double send_seconds = 0;      // handing activations and gradients to the transport
  double reduce_seconds = 0;    // waiting at the end for the replicas' gradient reduction
  double step_seconds = 0;      // the whole of train_step
  double bubble() const { return step_seconds > 0 ? wait_seconds / step_seconds : 0; }
};

class Pipeline {
 public:
  // Collective over `world`: the groups of the mesh, the plan (units measured on one micro-batch
  // like `sample` when balancing by time, on world rank 0, then broadcast), the stages, and each
  // pipeline rank's reducer over its replicas. Every rank passes the same units (the whole model,
  // built identically); each keeps the stages it holds.
  Pipeline(std::vector<PipelineUnit> units, comm::Communicator& world, PipelineOptions options,
           const MicroBatch& sample, LossFn loss);
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  const PipelineMesh& mesh() const;
  int pipeline_rank() const;
  int replica() const;
  const StagePlan& plan() const;
  // The plan as one line per stage, with each unit's cost (what rank 0 prints at start).
  std::string describe_plan() const;
  std::vector<int> stages() const;  // held by this rank, first first
  bool holds_first_stage() const;
  bool holds_last_stage() const;
  comm::Communicator& pipeline_group();  // this replica's P ranks
  comm::Communicator& stage_group();     // this pipeline rank's D replicas

  // What this rank updates and saves: its stages' parameters, without the tied ones another stage
  // owns, in the model's order, by the model's names.
  std::vector<std::pair<std::string, torch::Tensor>> named_parameters() const;
  std::vector<torch::Tensor> parameters() const;
  // The same as a module whose named_parameters() are those names (for an optimizer's state by
  // name, and checkpoints); it shares the tensors.
  std::shared_ptr<torch::nn::Module> module() const;
  // Every parameter of the model, in the model's order, and the pipeline rank that owns it.
  const std::vector<std::pair<std::string, int>>& owners() const;

  // One optimiser step's forwards and backwards over this replica's micro-batches (as many as
  // given; at most 65536), under the schedule; leaves in each owned parameter's grad its gradient
  // over the step, averaged over the replicas. Training mode: dropout seeds are drawn here.
  PipelineStepStats train_step(const std::vector<MicroBatch>& micro_batches);
  // Forwards only (evaluation, no gradients): consume(k, output) runs on the last stage's rank for
  // each micro-batch k, in order.
  void forward_only(const std::vector<MicroBatch>& micro_batches,
                    const std::function<void(int micro_batch, const torch::Tensor& output)>& consume);

  // Collective over the pipeline group: the 2-norm of every owned gradient of every stage (one
  // process's clip_grad_norm_ to the bit: per-parameter norms in the model's order), and the
  // gradients scaled by min(1, max_norm / (norm + 1e-6)) when max_norm > 0. Under tensor
  // parallelism (options' tensor_group) also over the tensor group: a split parameter's norm is
  // its whole tensor's (its shards' squares summed over the group), a whole one's counted once;
  // the norm is the unsplit model's, and no cut of the stages changes a bit of it.
  double clip_grad_norm(double max_norm);
  // Collective over the pipeline group (at a log step): each pipeline rank's bubble as the schedule
  // has it, averaged over the steps since the last call: each step's table simulated with the time
  // every one of its actions took (1 - busy / span), transfers taking none. What a rank measures
  // idling beyond it is the transfers' and the runtime's own cost.
  std::vector<double> analytic_bubbles();
  // After the optimizer step: the tied parameters' new values go from the first stage to the
  // last (which takes them before its next forward), and the last stage's copies forget their
  // gradients.
  void after_optimizer_step();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace lockstep::pipe
