// The Trainer under --pipeline-parallel: the pipeline built from the model's units, one optimiser
// step as micro-batches through it, evaluation through its forward-only table, and what each
// pipeline rank reports. The rest of the Trainer (schedules, logging, checkpoints) runs as for DDP,
// with the data dealt over the replicas instead of every rank.
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <sstream>

#include "dataset_loader.h"
#include "lockstep/base/log.h"
#include "lockstep/comm/collectives.h"
#include "lockstep/comm/elastic.h"
#include "lockstep/ddp/autocast.h"
#include "lockstep/error.h"
#include "lockstep/train/tensor_memory.h"
#include "trainer_impl.h"

namespace lockstep::train {

namespace {

pipe::PipelineOptions pipeline_options(const TrainingArguments& args, std::optional<at::ScalarType> autocast) {
  pipe::PipelineOptions o;
  o.pipeline_parallel = args.pipeline_parallel;
  o.schedule = pipe::parse_schedule_kind(args.pipeline_schedule);
  o.virtual_stages = args.virtual_stages;
  o.split = args.pipeline_split;
  o.balance = args.pipeline_balance == "parameters" ? pipe::PipelineOptions::Balance::parameters
                                                    : pipe::PipelineOptions::Balance::time;
  o.autocast = autocast;
  o.tied_gradient = args.pipeline_tied_gradient == "step" ? pipe::PipelineOptions::TiedGradient::step
                                                          : pipe::PipelineOptions::TiedGradient::micro_batch;
  o.ddp.bucket_cap_mb = args.ddp_bucket_cap_mb;
  o.ddp.comm_hook = parse_comm_hook(args.ddp_comm_hook);
  return o;
}

// The step's spans: waiting for data, the pipeline's schedule, the optimizer (ending now).
void trace_step(TraceWriter& trace, Clock::time_point begin, Clock::time_point loaded, Clock::time_point optimizer_begin,
                int micro_batches, const pipe::PipelineStepStats& st) {
  trace.span("data wait", 1, begin, loaded);
  trace.span("pipeline step", 1, loaded, optimizer_begin,
             {{"micro_batches", micro_batches}, {"wait_seconds", st.wait_seconds}, {"compute_seconds", st.compute_seconds}});
  trace.span("optimizer", 1, optimizer_begin, Clock::now());
}

}  // namespace

// Everything that does not combine with pipelining is refused here, before anything trains.
void TrainingStep::build_pipeline() {
  const TrainingArguments& args = run_.args;
  const Model& model = run_.model;
  const std::string with = "--pipeline-parallel " + std::to_string(args.pipeline_parallel);
  if (!model.pipeline_units)
    throw ConfigError(with + ": this model cannot be cut into stages (give it pipeline_units(), as "
                             "models/gpt.h's GptLmHeadModel does: see lockstep/pipe/units.h)");
  const Batch first = run_.train_set->get({0});
  const pipe::MicroBatch sample{first.input.to(run_.device), first.target.to(run_.device), 1};
  // Under tensor parallelism each tensor rank runs its own mesh's pipeline over its shards, in step.
  pipe::PipelineOptions options = pipeline_options(args, run_.autocast_dtype());
  options.tensor_group = run_.tensor_comm.get();
  if (run_.tensor_comm)
    for (const auto& [parameter, shard] : model.tensor_shards()) options.split_parameters.push_back(parameter);
  pipeline_ = std::make_unique<pipe::Pipeline>(model.pipeline_units(), run_.mesh_comm ? *run_.mesh_comm : *run_.comm,
                                               options, sample, run_.loss_fn);
  optimizer_ = make_optimizer(updated_share());
  stage_module_ = pipeline_->module();
  if (run_.rank() == 0)
    LOCKSTEP_LOG(info, train) << "pipeline: " << pipeline_->mesh().describe() << ", schedule " << args.pipeline_schedule
                              << (args.virtual_stages > 1 ? " with " + std::to_string(args.virtual_stages) + " stages per rank" : "")
                              << "\n"
                              << pipeline_->describe_plan();
  if (!owners_.empty() && run_.rank() == 0)
    LOCKSTEP_LOG(info, train) << "--zero-stage 1: each of a stage's " << pipeline_->stage_group().size()
                              << " replicas updates a share of its parameters and keeps their optimizer state alone";
}

// The step's samples (whole micro-batches of the loader) cut into --num-microbatches, each
// weighted by its samples as the unpipelined step weighs its micro-batches.
StepTimes TrainingStep::pipeline_step(data::DataLoader<Batch>& loader, const StepPlan& plan, LogWindow& window) {
  const TrainingArguments& args = run_.args;
  const auto begin = Clock::now();
  const std::int64_t tensors_at_start = tensor_bytes();
  reset_peak_tensor_bytes();
  StepTimes t;
  const auto batch_size = std::size_t(args.per_device_train_batch_size);
  std::vector<torch::Tensor> inputs, targets;
  for (std::size_t taken = 0; taken < plan.samples; taken += batch_size) {
    auto batch = loader.next();
    if (!batch) throw Error("internal: the loader ran out before the epoch's samples did");
    inputs.push_back(batch->input);
    targets.push_back(batch->target);
  }
  const auto input = torch::cat(inputs), target = torch::cat(targets);
  const auto loaded = Clock::now();
  t.data = seconds_between(begin, loaded);
  const std::int64_t samples = input.size(0);
  const int wanted = args.num_microbatches > 0 ? args.num_microbatches : int(inputs.size());
  const int m = int(std::min<std::int64_t>(wanted, samples));
  const double mean_over = plan.all_ranks_samples / run_.data_world();
  std::vector<pipe::MicroBatch> batches;
  const auto in_parts = input.tensor_split(m), target_parts = target.tensor_split(m);
  const double loss_scale = args.fp16 ? loss_scale_.scale() : 1;
  for (int k = 0; k < m; ++k)
    batches.push_back({in_parts[std::size_t(k)], target_parts[std::size_t(k)],
                       double(in_parts[std::size_t(k)].size(0)) / mean_over, loss_scale});
  const pipe::PipelineStepStats st = pipeline_->train_step(batches);
  if (st.loss_targets > 0) {
    window.add_loss(st.loss_sum / st.loss_targets, st.loss_targets);
    const bool counts_tokens = !run_.tensor_comm || run_.tensor_comm->rank() == 0;  // a tensor group's, once
    if (target.dim() >= 2 && counts_tokens) window.add_tokens(st.loss_targets);
  }
  t.forward = st.forward_seconds;
  t.backward = st.compute_seconds - st.forward_seconds;
  t.exposed_comm = st.wait_seconds + st.send_seconds + st.reduce_seconds;
  t.comm = st.reduce_seconds;
  const auto optimizer_begin = Clock::now();
  PipelineWindow& w = pipeline_window_;
  w.compute += st.compute_seconds, w.wait += st.wait_seconds, w.send += st.send_seconds;
  w.reduce += st.reduce_seconds, w.span += seconds_between(loaded, Clock::now()), ++w.steps;
  if (!args.fp16 || !skip_overflowed_step()) {  // every stage skips alike (unscale_gradients)
    const double max_norm = args.max_grad_norm;
    const double norm = pipeline_->clip_grad_norm(max_norm);  // split stages: the unsplit model's
    if (max_norm > 0) window.set_grad_norm(norm);
    const double lr = run_.learning_rate_at(run_.state.global_step);
    for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
    optimizer_->step();
    share_updates();  // --zero-stage 1: each replica's share to the others
    zero_gradients();
    pipeline_->after_optimizer_step();
  }
  t.optimizer = seconds_between(optimizer_begin, Clock::now());
  t.total = seconds_between(begin, Clock::now());
  if (TraceWriter* trace = run_.trace()) trace_step(*trace, begin, loaded, optimizer_begin, m, st);
  window.add_step(t, plan.all_ranks_samples, 0, 0);
  window.add_step_tensor_bytes(static_cast<double>(peak_tensor_bytes() - tensors_at_start));
  return t;
}

// Evaluation through the pipeline: each replica's share of the eval set, in passes of a few
// micro-batches (one per eval batch); the last stage counts loss and accuracy (split for tensor
// parallelism, its tensor rank 0: every rank of the group computes them), the others contribute
// zeros to the sum over the world.
data::EvalTotals TrainingStep::pipeline_eval_totals() {
  const TrainingArguments& args = run_.args;
  const Model& model = run_.model;
  const LossFn& loss_fn = run_.loss_fn;
  const auto& predict = run_.predict_fn;
  const bool counts = !run_.tensor_comm || run_.tensor_comm->rank() == 0;
  data::DistributedSampler sampler(run_.eval_set->size(), run_.data_rank(), run_.data_world(), /*shuffle=*/false);
  std::shared_ptr<const Dataset> ds(run_.eval_set.get(), [](const Dataset*) {});
  auto loader = make_loader(ds, sampler.indices(), args.per_device_eval_batch_size, args.dataloader_num_workers);
  const bool was_training = model.module->is_training();
  model.module->eval();
  data::EvalTotals local;
  std::vector<pipe::MicroBatch> pass;
  auto run_pass = [&] {
    pipeline_->forward_only(pass, [&](int k, const torch::Tensor& output) {
      const torch::Tensor out = loss_input(output), y = pass[std::size_t(k)].target.to(out.device());
      const double loss = loss_fn(out, y).item<double>();
      const std::int64_t correct = (predict ? predict(out) : out.argmax(-1)).eq(y).sum().item<std::int64_t>();
      if (!counts) return;
      local.loss_sum += loss * double(y.numel());
      local.correct += correct;
      local.count += y.numel();
      local.samples += y.size(0);
    });
    pass.clear();
  };
  std::size_t k = 0;
  while (auto batch = loader->next()) {
    const std::int64_t n = batch->target.size(0);
    std::vector<std::int64_t> real;
    for (std::int64_t i = 0; i < n; ++i)
      if (!sampler.is_padding(k + std::size_t(i))) real.push_back(i);
    k += std::size_t(n);
    if (real.empty()) continue;  // every pipeline rank of the replica skips it alike
    auto keep = torch::tensor(real, torch::kLong);
    pass.push_back({batch->input.index_select(0, keep), batch->target.index_select(0, keep), 1});
    if (int(pass.size()) == 2 * args.pipeline_parallel * args.virtual_stages) run_pass();
  }
  if (!pass.empty()) run_pass();
  model.module->train(was_training);
  return data::allreduce_totals(*run_.comm, local);
}

// Collective: each pipeline rank's window, averaged over its replicas: compute, waiting for
// transfers, sending, the replicas' reduction; its bubble (the share of the steps' span it did not
// compute), and the bubble its schedule has with these action times.
void TrainingStep::add_pipeline_fields(metrics::StepLog& entry) {
  const int p = run_.args.pipeline_parallel, prank = pipeline_->pipeline_rank();
  PipelineWindow& w = pipeline_window_;
  // Each pipeline rank's D x T ranks (its replicas, and under tensor parallelism their shards).
  const double steps = double(std::max<std::int64_t>(1, w.steps)), replicas = double(run_.world() / p);
  std::vector<double> rows(std::size_t(p) * 5, 0);
  const double mine[5] = {w.compute, w.wait, w.send, w.reduce, w.span};
  for (int i = 0; i < 5; ++i) rows[std::size_t(prank) * 5 + std::size_t(i)] = mine[i] / steps / replicas;
  run_.comm->allreduce(rows.data(), rows.size(), comm::DType::f64, comm::ReduceOp::sum)->wait();
  std::optional<std::vector<double>>* columns[5] = {&entry.pipeline_compute_seconds, &entry.pipeline_wait_seconds,
                                                    &entry.pipeline_send_seconds, &entry.pipeline_reduce_seconds,
                                                    &entry.pipeline_bubble};
  for (auto* column : columns) column->emplace();
  for (int r = 0; r < p; ++r) {
    const double* row = &rows[std::size_t(r) * 5];
    for (int i = 0; i < 4; ++i) (*columns[i])->push_back(row[i]);
    entry.pipeline_bubble->push_back(row[4] > 0 ? 1 - row[0] / row[4] : 0);
  }
  entry.pipeline_bubble_analytic = pipeline_->analytic_bubbles();
  pipeline_window_ = PipelineWindow{};
}

// DDP's promise per stage: the replicas of each pipeline rank hold the same parameters; and the
// model's fingerprint (the one an unpipelined run prints) from each parameter's hash.
void TrainingStep::check_stage_replicas() {
  std::string mine;
  for (const auto& [name, p] : pipeline_->named_parameters())
    mine += name + " " + std::to_string(parameter_hash(p)) + "\n";
  const auto all = comm::allgather_strings(*run_.comm, mine);
  if (run_.rank() != 0) return;
  const auto mesh = pipeline_->mesh();
  std::string differ;
  std::map<std::string, std::uint64_t> hashes;
  for (int r = 0; r < run_.world(); ++r) {
    if (all[std::size_t(r)] != all[std::size_t(mesh.rank_at(mesh.pipeline_rank_of(r), 0))])
      differ += (differ.empty() ? "" : ", ") + std::to_string(r);
    std::istringstream in(all[std::size_t(r)]);
    std::string name;
    std::uint64_t h = 0;
    while (in >> name >> h) hashes.emplace(name, h);
  }
  std::vector<std::uint64_t> ordered;
  for (const auto& [name, owner] : pipeline_->owners()) ordered.push_back(hashes.at(name));
  const std::string print = "(fingerprint " + combined_fingerprint(ordered) + ")";
  if (differ.empty() && mesh.replicas == 1)
    LOCKSTEP_LOG(info, train) << "the " << mesh.pipeline << " pipeline ranks hold the model's parameters " << print;
  else if (differ.empty())
    LOCKSTEP_LOG(info, train) << "all " << mesh.replicas << " replicas of each of the " << mesh.pipeline
                              << " pipeline ranks hold the same parameters " << print;
  else
    LOCKSTEP_LOG(warn, train) << "the replicas diverged: rank(s) " << differ
                              << " hold parameters that differ from their stage's first replica";
}

}  // namespace lockstep::train
