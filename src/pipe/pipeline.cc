// The Pipeline's set-up (groups, plan, owners, stages, tied parameters, reducers), what it tells
// about itself, the norm over all stages, and the tied values after a step.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <set>
#include <sstream>

#include "lockstep/base/log.h"
#include "lockstep/comm/collectives.h"
#include "lockstep/error.h"
#include "pipeline_impl.h"
#include "stage_parameters.h"

namespace lockstep::pipe {

void validate(const PipelineOptions& o) {
  if (o.pipeline_parallel < 1)
    throw ConfigError("--pipeline-parallel must be at least 1 (got " + std::to_string(o.pipeline_parallel) + ")");
  if (o.virtual_stages < 1)
    throw ConfigError("--virtual-stages must be at least 1 (got " + std::to_string(o.virtual_stages) + ")");
  if (o.virtual_stages > 1 && o.schedule != ScheduleKind::interleaved && o.schedule != ScheduleKind::zero_bubble)
    throw ConfigError("--virtual-stages " + std::to_string(o.virtual_stages) +
                      " needs --pipeline-schedule interleaved or zb (the " + schedule_name(o.schedule) +
                      " schedule runs one stage per rank)");
  if (o.virtual_stages > 1 && o.pipeline_parallel < 2)
    throw ConfigError("--virtual-stages " + std::to_string(o.virtual_stages) + " needs --pipeline-parallel 2 or more");
  if (o.pipeline_parallel * o.virtual_stages > kMaxStages)
    throw ConfigError("a pipeline of " + std::to_string(o.pipeline_parallel * o.virtual_stages) +
                      " stages: lockstep runs at most " + std::to_string(kMaxStages));
}

namespace {

double parameter_count(const PipelineUnit& unit) {
  double n = 0;
  for (const auto& p : unit.parameters) n += double(p.second.numel());
  return n;
}

std::string plan_text(const StagePlan& plan) {
  std::string out;
  for (int f : plan.first_unit) out += (out.empty() ? "" : ",") + std::to_string(f);
  return out;
}

}  // namespace

void Pipeline::Impl::make_groups() {
  mesh = PipelineMesh::of(world.size(), options.pipeline_parallel);
  prank = mesh.pipeline_rank_of(world.rank());
  replica = mesh.replica_of(world.rank());
  stage_comm = world.group(mesh.stage_group(prank), "pipe-stage-" + std::to_string(prank));
  pipeline_comm = world.group(mesh.pipeline_group(replica), "pipe-replica-" + std::to_string(replica));
  channel = std::make_unique<TensorChannel>(*pipeline_comm);
}

void Pipeline::Impl::make_plan(const MicroBatch& sample) {
  const int n = int(units.size());
  if (!options.split.empty()) {
    plan = parse_stage_split(options.split, n, stages());
  } else if (options.balance == PipelineOptions::Balance::parameters || n < stages()) {
    for (const auto& u : units) unit_costs.push_back(parameter_count(u) / 1e6);
    cost_unit = "M parameters";
    plan = balance_stages(unit_costs, stages());  // ConfigError when there are too few units
  } else {
    unit_costs.assign(std::size_t(n), 0);
    if (world.rank() == 0) unit_costs = measure_unit_costs(units, sample, loss, options.autocast);
    world.broadcast(unit_costs.data(), unit_costs.size(), comm::DType::f64, 0)->wait();
    if (options.tensor_group)  // one tensor rank's mesh measured them for all
      options.tensor_group->broadcast(unit_costs.data(), unit_costs.size(), comm::DType::f64, 0)->wait();
    for (double& c : unit_costs) c *= 1e3;
    cost_unit = "ms";
    plan = balance_stages(unit_costs, stages());
  }
  if (unit_costs.empty()) {
    for (const auto& u : units) unit_costs.push_back(parameter_count(u) / 1e6);
    cost_unit = "M parameters";
  }
}

// Ranks started with other pipeline flags, or another model, would wait for each other's
// transfers forever: compare before anything runs.
void Pipeline::Impl::check_agreement() {
  std::ostringstream mine;
  mine << "--pipeline-parallel " << options.pipeline_parallel << " --pipeline-schedule " << schedule_name(options.schedule)
       << " --virtual-stages " << options.virtual_stages << " --pipeline-tied-gradient "
       << (options.tied_gradient == PipelineOptions::TiedGradient::step ? "step" : "micro-batch") << ", " << units.size()
       << " units, "
       << owners.size() << " parameters, stages starting at units " << plan_text(plan);
  const auto all = comm::allgather_strings(world, mine.str());
  for (int r = 0; r < world.size(); ++r)
    if (all[std::size_t(r)] != all[0])
      throw ConfigError("the workers disagree about the pipeline: rank 0 has " + all[0] + "; rank " +
                        std::to_string(r) + " has " + all[std::size_t(r)] +
                        ". Start every worker with the same flags and model");
}

// Each parameter belongs to the first stage that reads it; one read by two stages must be read by
// the first and the last (tied), whose exchange the tables carry.
void Pipeline::Impl::assign_owners() {
  std::map<std::string, std::set<int>> readers;
  for (int u = 0; u < int(units.size()); ++u)
    for (const auto& [name, tensor] : units[std::size_t(u)].parameters) {
      auto& stages_reading = readers[name];
      if (stages_reading.empty()) owners.emplace_back(name, rank_of(plan.stage_of_unit(u)));
      stages_reading.insert(plan.stage_of_unit(u));
    }
  for (const auto& [name, reading] : readers) {
    if (reading.size() < 2) continue;
    has_tied = true;
    if (reading != std::set<int>{0, last_stage()}) {
      std::string list;
      for (int s : reading) list += (list.empty() ? "" : ", ") + std::to_string(s);
      throw ConfigError("parameter '" + name + "' is read by pipeline stages " + list +
                        "; lockstep ties a parameter between the first and the last stage only (a language model's "
                        "embedding and head): change --pipeline-split so that no other two stages share one");
    }
  }
}

void Pipeline::Impl::make_stages() {
  std::map<std::string, torch::Tensor> by_name;
  for (const auto& u : units)
    for (const auto& [name, tensor] : u.parameters) by_name.emplace(name, tensor);
  if (!by_name.empty()) device = by_name.begin()->second.device();
  std::map<std::string, int> owner_stage;
  for (int u = 0; u < int(units.size()); ++u)
    for (const auto& p : units[std::size_t(u)].parameters) owner_stage.emplace(p.first, plan.stage_of_unit(u));
  for (int c = 0; c < options.virtual_stages; ++c) {
    const int stage = c * options.pipeline_parallel + prank;
    std::vector<PipelineUnit> mine(units.begin() + plan.begin(stage), units.begin() + plan.end(stage));
    chunks[stage] = std::make_unique<StageChunk>(stage, stage == 0, stage == last_stage(), std::move(mine));
    std::vector<std::pair<std::string, torch::Tensor>> chunk_owned;
    for (const auto& [name, pr] : owners)
      if (owner_stage.at(name) == stage) chunk_owned.emplace_back(name, by_name.at(name));
    chunk_modules.push_back(module_of(chunk_owned));
  }
  for (const auto& [name, pr] : owners)
    if (pr == prank) owned.emplace_back(name, by_name.at(name));
}

// The first stage adds the last stage's gradient of each tied parameter, micro-batch by
// micro-batch, before its own accumulates; the last stage keeps its gradient of it to send.
void Pipeline::Impl::tie_parameters() {
  const bool once_a_step = options.tied_gradient == PipelineOptions::TiedGradient::step;
  tied = std::make_unique<TiedParameters>(
      *channel, TiedParameters::Ends{rank_of(0), rank_of(last_stage()), last_stage()}, once_a_step,
      [this](int from_stage, int stage, Channel c, int slot, int k) { return receive(from_stage, stage, c, slot, k); });
  if (stages() < 2) return;
  std::map<std::string, torch::Tensor> first_reads, last_reads;
  for (int u = plan.begin(0); u < plan.end(0); ++u)
    for (const auto& p : units[std::size_t(u)].parameters) first_reads.insert(p);
  for (int u = plan.begin(last_stage()); u < plan.end(last_stage()); ++u)
    for (const auto& p : units[std::size_t(u)].parameters) last_reads.insert(p);
  for (const auto& [name, pr] : owners) {
    if (!first_reads.count(name) || !last_reads.count(name)) continue;
    if (holds(0))
      tied->add_on_first(name, first_reads.at(name));
    else if (holds(last_stage()))
      tied->add_on_last(last_reads.at(name));
  }
}

void Pipeline::Impl::make_reducers() {
  if (mesh.replicas == 1) return;
  for (auto& module : chunk_modules) {
    if (module->parameters().empty()) {
      reducers.emplace_back();
      continue;
    }
    reducers.push_back(std::make_unique<Reducer>(module, *stage_comm, options.ddp));
    reducers.back()->set_caller_finishes(true);
  }
}

const ScheduleTable& Pipeline::Impl::table(int micro_batches) {
  auto it = tables.find(micro_batches);
  if (it != tables.end()) return it->second;
  ScheduleTable t = make_schedule(options.schedule, options.pipeline_parallel, micro_batches, options.virtual_stages);
  if (has_tied) add_tied_exchange(t, options.tied_gradient == PipelineOptions::TiedGradient::step);
  if (const auto check = check_schedule(t); !check.ok()) throw std::logic_error("pipeline: " + check.error);
  check_same_table(t, micro_batches);
  return tables.emplace(micro_batches, std::move(t)).first->second;
}

// Every rank must run the same table, or one waits for a transfer another never sends: compared
// (as its digest) when a step first needs it, so whatever makes tables differ (flags the agreement
// check above does not name, another count of micro-batches) is an error on every rank.
void Pipeline::Impl::check_same_table(const ScheduleTable& t, int micro_batches) {
  const auto all = comm::allgather_strings(world, std::to_string(micro_batches) + " micro-batches, table " +
                                                      std::to_string(t.digest()));
  for (int r = 0; r < world.size(); ++r)
    if (all[std::size_t(r)] != all[0])
      throw ConfigError("the workers' pipeline schedules differ: rank 0 runs " + all[0] + ", rank " +
                        std::to_string(r) + " " + all[std::size_t(r)] +
                        ". Start every worker with the same flags, and give every rank's step the same micro-batches");
}

Pipeline::Pipeline(std::vector<PipelineUnit> units, comm::Communicator& world, PipelineOptions options,
                   const MicroBatch& sample, LossFn loss)
    : impl_(std::make_unique<Impl>(world, std::move(options), std::move(loss))) {
  Impl& s = *impl_;
  validate(s.options);
  if (units.empty()) throw ConfigError("the pipeline got a model with no units");
  s.units = std::move(units);
  s.make_groups();
  s.make_plan(sample);
  s.assign_owners();
  s.check_agreement();
  s.make_stages();
  s.tie_parameters();
  s.make_reducers();
}

Pipeline::~Pipeline() = default;

const PipelineMesh& Pipeline::mesh() const {
  return impl_->mesh;
}
int Pipeline::pipeline_rank() const {
  return impl_->prank;
}
int Pipeline::replica() const {
  return impl_->replica;
}
const StagePlan& Pipeline::plan() const {
  return impl_->plan;
}
std::string Pipeline::describe_plan() const {
  std::vector<std::string> names;
  for (const auto& u : impl_->units) names.push_back(u.name);
  return impl_->plan.describe(names, impl_->unit_costs, impl_->cost_unit);
}
std::vector<int> Pipeline::stages() const {
  std::vector<int> out;
  for (const auto& c : impl_->chunks) out.push_back(c.first);
  return out;
}
bool Pipeline::holds_first_stage() const {
  return impl_->holds(0);
}
bool Pipeline::holds_last_stage() const {
  return impl_->holds(impl_->last_stage());
}
comm::Communicator& Pipeline::pipeline_group() {
  return *impl_->pipeline_comm;
}
comm::Communicator& Pipeline::stage_group() {
  return *impl_->stage_comm;
}
std::vector<std::pair<std::string, torch::Tensor>> Pipeline::named_parameters() const {
  return impl_->owned;
}
std::shared_ptr<torch::nn::Module> Pipeline::module() const {
  return module_of(impl_->owned);
}
std::vector<torch::Tensor> Pipeline::parameters() const {
  std::vector<torch::Tensor> out;
  for (const auto& p : impl_->owned) out.push_back(p.second);
  return out;
}
const std::vector<std::pair<std::string, int>>& Pipeline::owners() const {
  return impl_->owners;
}

PipelineStepStats Pipeline::train_step(const std::vector<MicroBatch>& micro_batches) {
  return impl_->run(micro_batches);
}

namespace {

// Under tensor parallelism: each split parameter's norm (its place in `norms`) made its whole
// tensor's, from its shards' squares summed over the tensor group.
void whole_norms_of_shards(const Pipeline::Impl& s, const std::map<std::string, std::size_t>& index,
                           std::vector<double>& norms) {
  std::set<const void*> split;
  for (const auto& shard : s.options.split_parameters) split.insert(shard.unsafeGetTensorImpl());
  std::vector<double> squares(s.owners.size(), 0);
  for (const auto& [name, p] : s.owned)
    if (split.count(p.unsafeGetTensorImpl()) && p.grad().defined()) squares[index.at(name)] = std::pow(norms[index.at(name)], 2);
  s.options.tensor_group->allreduce(squares.data(), squares.size(), comm::DType::f64, comm::ReduceOp::sum)->wait();
  for (std::size_t i = 0; i < squares.size(); ++i)
    if (squares[i] > 0) norms[i] = std::sqrt(squares[i]);
}

}  // namespace

// libtorch's clip_grad_norm_ over every stage: the same per-parameter norms, stacked in the
// model's order (each rank fills in its own; a sum with zeros elsewhere moves them exactly), in
// the gradients' dtype.
double Pipeline::clip_grad_norm(double max_norm) {
  Impl& s = *impl_;
  const std::size_t n = s.owners.size();
  std::vector<double> norms(2 * n, 0);  // norm, then whether it has a gradient
  std::map<std::string, std::size_t> index;
  for (std::size_t i = 0; i < n; ++i) index[s.owners[i].first] = i;
  std::vector<torch::Tensor> with_grad;
  for (const auto& [name, p] : s.owned) {
    if (!p.grad().defined()) continue;
    with_grad.push_back(p);
    norms[index.at(name)] = p.grad().norm(2.0).item<double>();
    norms[n + index.at(name)] = 1;
  }
  if (s.options.tensor_group && s.options.tensor_group->size() > 1) whole_norms_of_shards(s, index, norms);
  s.pipeline_comm->allreduce(norms.data(), norms.size(), comm::DType::f64, comm::ReduceOp::sum)->wait();
  const auto dtype = with_grad.empty() ? torch::kFloat : with_grad.front().grad().scalar_type();
  std::vector<torch::Tensor> stacked;
  for (std::size_t i = 0; i < n; ++i)
    if (norms[n + i] > 0) stacked.push_back(torch::tensor(norms[i], torch::TensorOptions().dtype(dtype)));
  if (stacked.empty()) return 0;
  const torch::Tensor total = stacked.size() == 1 ? stacked[0] : torch::stack(stacked).norm(2.0);
  if (max_norm > 0) {
    const auto coef = torch::clamp(max_norm / (total + 1e-6), c10::nullopt, 1.0);
    torch::NoGradGuard no_grad;
    for (auto& p : with_grad) p.grad().mul_(coef.to(p.grad().device()));
  }
  return total.item<double>();
}

void Pipeline::after_optimizer_step() {
  impl_->tied->after_optimizer_step(impl_->holds(0));
}

}  // namespace lockstep::pipe
