// The Pipeline's insides, shared by the files that implement it:
//   pipeline.cc     set-up: groups, plan, stages, owners, tied parameters, reducers; the norm
//   tied_parameters the exchange of the parameters the first and the last stage share
//   executor.cc     one step: a schedule table run action by action
//   unit_costs.cc   the units' measured costs, for the plan
// Threading: the training thread only (the tied hooks run inside backward, on that thread).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/pipe/pipeline.h"
#include "lockstep/pipe_core/schedule_check.h"
#include "stage_chunk.h"
#include "tensor_channel.h"
#include "tied_parameters.h"

namespace lockstep::pipe {

// What the runtime takes from pipe_core's tables beyond pipeline.h's names.
using pipe_core::Action;
using pipe_core::add_tied_exchange;
using pipe_core::balance_stages;
using pipe_core::check_schedule;
using pipe_core::make_forward_schedule;
using pipe_core::make_schedule;
using pipe_core::Op;
using pipe_core::parse_stage_split;
using pipe_core::ScheduleTable;
using pipe_core::simulate;
using pipe_core::Timeline;

// One step's compute actions on this rank, each one's seconds at [(stage x 4 + kind) x m + k]
// (kind: forward, backward, backward_input, backward_weight; zero for other ranks' stages), kept
// until the next report simulates the step with every rank's times.
constexpr std::size_t kRecordedSteps = 256;  // the most steps kept for a report
struct StepRecord {
  int micro_batches = 0;
  std::vector<double> seconds;
};

struct Pipeline::Impl {
  Impl(comm::Communicator& w, PipelineOptions o, LossFn l) : world(w), options(std::move(o)), loss(std::move(l)) {}

  comm::Communicator& world;
  PipelineOptions options;
  LossFn loss;
  PipelineMesh mesh;
  int prank = 0, replica = 0;
  std::unique_ptr<comm::Communicator> stage_comm, pipeline_comm;
  std::unique_ptr<TensorChannel> channel;

  std::vector<PipelineUnit> units;
  StagePlan plan;
  std::vector<double> unit_costs;
  std::string cost_unit;
  std::vector<std::pair<std::string, int>> owners;      // every parameter: its pipeline rank
  std::vector<std::pair<std::string, torch::Tensor>> owned;  // this rank's, model order
  std::map<int, std::unique_ptr<StageChunk>> chunks;    // by stage
  std::vector<std::unique_ptr<Reducer>> reducers;       // per stage held (D > 1), as `chunks`' order
  std::vector<std::shared_ptr<torch::nn::Module>> chunk_modules;
  torch::Device device = torch::kCPU;

  bool has_tied = false;  // the model has a parameter both the first and the last stage read
  std::unique_ptr<TiedParameters> tied;  // this rank's part of their exchange (none: no tensors)

  std::map<int, ScheduleTable> tables;  // by micro-batches per step
  std::vector<StepRecord> recorded;     // since the last analytic_bubbles()

  int stages() const { return options.pipeline_parallel * options.virtual_stages; }
  int last_stage() const { return stages() - 1; }
  int rank_of(int stage) const { return stage % options.pipeline_parallel; }
  bool holds(int stage) const { return chunks.count(stage) > 0; }
  const ScheduleTable& table(int micro_batches);

  // pipeline.cc
  void make_groups();
  void make_plan(const MicroBatch& sample);
  void check_agreement();
  void check_same_table(const ScheduleTable& t, int micro_batches);
  void assign_owners();
  void make_stages();
  void tie_parameters();
  void make_reducers();

  // executor.cc: a step runs this rank's actions in the table's order, each kind by its function.
  struct Step;
  PipelineStepStats run(const std::vector<MicroBatch>& batches);
  void forward(const Action& a, Step& step);
  void backward(const Action& a, const ScheduleTable& table, Step& step);
  void transfer(const Action& a, Step& step);
  torch::Tensor receive(int from_stage, int stage, Channel c, int slot, int micro_batch);
  void expect_transfers(const std::vector<Action>& actions);
};

// unit_costs.cc: forward + backward seconds of each unit on `sample` (the fastest of a few runs),
// each unit fed the previous one's output; the parameters' gradients are dropped after.
std::vector<double> measure_unit_costs(const std::vector<PipelineUnit>& units, const MicroBatch& sample,
                                       const LossFn& loss, std::optional<torch::ScalarType> autocast);

}  // namespace lockstep::pipe
