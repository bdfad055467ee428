// The Trainer: construction, and one run from set-up to the last step.
#include "lockstep/train/trainer.h"

#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <exception>
#include <cstdio>
#include <filesystem>

#include "cuda_graph_step.h"
#include "dataset_loader.h"
#include "evaluate.h"
#include "lockstep/base/log.h"
#include "lockstep/comm/collectives.h"
#include "lockstep/comm/elastic.h"
#include "lockstep/comm/rendezvous.h"
#include "lockstep/ddp/torch_compat.h"
#include "lockstep/error.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train/device.h"
#include "lockstep/train/sharded_checkpoint.h"
#include "lockstep/train/tensor_memory.h"
#include "lockstep/train_core/progress.h"
#include "lockstep/base/run_env.h"
#include "trainer_impl.h"

namespace fs = std::filesystem;

namespace lockstep::train {

std::size_t Trainer::Impl::samples_per_step() const {
  return static_cast<std::size_t>(args.per_device_train_batch_size) *
         static_cast<std::size_t>(args.gradient_accumulation_steps);
}

void Trainer::Impl::log(const nlohmann::json& entry) {
  state.record_log(entry);
  reports.record(entry);
  for (auto& cb : callbacks) cb->on_log(state, entry);
}

// The run's length and schedule, the optimiser, the outputs, a resume, and the reducer.
void Trainer::Impl::prepare(data::DistributedSampler& sampler, bool& resumed_mid_epoch) {
  const std::size_t per_step = samples_per_step();
  const auto per_epoch = static_cast<std::int64_t>((sampler.num_samples() + per_step - 1) / per_step);
  state.set_length(per_epoch, args.max_steps > 0 ? args.max_steps
                                                 : static_cast<std::int64_t>(std::ceil(
                                                       args.num_train_epochs * static_cast<double>(per_epoch))));
  schedule =
      Schedule{args.lr_scheduler_type,
               warmup_steps_for(args.warmup_steps, args.warmup_ratio, state.max_steps), state.max_steps};
  if (args.gradient_checkpointing) {
    if (!model.set_gradient_checkpointing)
      throw ConfigError("--gradient-checkpointing: this model cannot recompute its blocks (give it a "
                        "set_gradient_checkpointing(bool) method that wraps each block in "
                        "lockstep::gradient_checkpoint, as models/gpt.h's do)");
    model.set_gradient_checkpointing(true);
  }
  step.build();
  reports.open();

  if (std::string from = checkpoints.resume_target(); !from.empty()) {
    checkpoints.resume(from, sampler);
    resumed_mid_epoch = true;
  } else if (!args.resume_from_checkpoint.empty() || restart_count_from_env() > 0) {
    if (rank() == 0)
      LOCKSTEP_LOG(info, train) << "no checkpoint in " << args.output_dir << " yet: starting from step 0";
  } else if (auto old = list_checkpoints(args.output_dir); !old.empty() && rank() == 0) {
    LOCKSTEP_LOG(warn, train) << args.output_dir << " already holds " << old.size()
                              << " checkpoint(s), up to " << fs::path(old.back()).filename().string()
                              << "; this run starts from step 0 and replaces them as it reaches their steps "
                                 "(--resume-from-checkpoint latest continues instead)";
  }
  model.module->train();
}

bool Trainer::Impl::evaluation_due(bool epoch_done) const {
  return (args.eval_strategy == "steps" && state.global_step % args.eval_every() == 0) ||
         (args.eval_strategy == "epoch" && epoch_done);
}

bool Trainer::Impl::save_due(bool epoch_done) const {
  return (args.save_strategy == "steps" && state.global_step % args.save_steps == 0) ||
         (args.save_strategy == "epoch" && epoch_done);
}

void Trainer::Impl::after_step(std::size_t position, std::size_t num_samples, RunProgress& run) {
  epilogue = StepEpilogue{state.global_step, StepEpilogue::log, false};
  run_epilogue(position, num_samples, run);
}

// The parts in order, each recorded once done (the log before it runs: at most once).
void Trainer::Impl::run_epilogue(std::size_t position, std::size_t num_samples, RunProgress& run) {
  const bool epoch_done = position >= num_samples;
  const bool last = state.global_step >= state.max_steps;
  const std::size_t saved_position = epoch_done ? 0 : position;
  auto pause_begin = Clock::now();
  while (epilogue.next != StepEpilogue::done) {
    const int part = epilogue.next;
    switch (part) {
      case StepEpilogue::log:
        epilogue.next = StepEpilogue::evaluate;
        reports.log_or_show_progress(last, run);
        pause_begin = Clock::now();
        break;
      case StepEpilogue::evaluate:
        if (evaluation_due(epoch_done)) evaluate_during_training(run.control);
        break;
      case StepEpilogue::end_epoch:
        if (epoch_done) state.finish_epoch();
        break;
      case StepEpilogue::save:
        if (save_due(epoch_done)) {
          checkpoints.save(saved_position);
          epilogue.saved = true;
        }
        run.window.exclude(Clock::now() - pause_begin);
        break;
      case StepEpilogue::callbacks:
        for (auto& cb : callbacks) cb->on_step_end(state, run.control);
        if (fault("kill-after-step", state.global_step)) std::raise(SIGKILL);
        if (trace()) trace()->flush();
        break;
      case StepEpilogue::final_save:  // the last step, or a stop a callback asked for (unless saving is off)
        if ((last || run.control.should_stop) && args.save_strategy != "no" && !epilogue.saved) {
          checkpoints.save(saved_position);
          epilogue.saved = true;
        }
        break;
    }
    epilogue.next = part + 1;
  }
}

WindowCounters Trainer::Impl::window_counters() const {
  return {comm->network_stats(), data_communicator().busy_seconds(), tensor_comm ? tensor_comm->busy_seconds() : 0};
}

bool Trainer::Impl::fault(const char* kind, std::int64_t at) const {
  if (!fault_requested(kind, at, rank())) return false;
  if (!elastic) return true;
  const bool per_membership = std::string(kind) == "kill-in-state-transfer" || std::string(kind) == "await-joiner";
  const std::uint64_t membership = per_membership ? std::uint64_t(at) : 0;
  return elastic->membership() == membership;
}

void Trainer::Impl::run_epoch(data::DistributedSampler& sampler, RunProgress& run) {
  auto loader = make_loader(train_set, sampler.remaining(), args.per_device_train_batch_size,
                            args.dataloader_num_workers);
  const std::size_t num_samples = sampler.num_samples();
  std::size_t position = sampler.state().position;
  while (state.global_step < state.max_steps && !run.control.should_stop && position < num_samples) {
    const std::size_t step_samples = std::min(samples_per_step(), num_samples - position);
    step.run(*loader, StepPlan{step_samples, static_cast<double>(step_samples) * data_world(), false}, run.window);
    position += step_samples;
    state.finish_step();
    run.samples += static_cast<double>(step_samples) * data_world();
    after_step(position, num_samples, run);
  }
}

void Trainer::Impl::load_best_model() {
  if (!args.load_best_model_at_end || state.best_checkpoint.empty()) return;
  const std::string best = (fs::path(args.output_dir) / state.best_checkpoint).string();
  WholeParameters whole(*this, true);
  if (const auto split = tensor_split())  // the checkpoint's whole tensors, this rank's shard of each
    load_sharded(best, *model.module, nullptr, /*part=*/false, &*split);
  else
    load_module(*model.module, CheckpointDir(best).model());
  if (rank() == 0)
    LOCKSTEP_LOG(info, train) << "loaded the best model, " << state.best_checkpoint << " ("
                              << args.metric_for_best_model << " " << state.best_metric.value_or(0) << ")";
}

TrainResult Trainer::Impl::result(const RunProgress& run) const {
  TrainResult r;
  r.global_step = state.global_step;
  r.train_loss = run.loss_count > 0 ? run.loss_sum / run.loss_count : 0;
  r.seconds = seconds_between(run.start, Clock::now());
  r.samples_per_second = r.seconds > 0 ? run.samples / r.seconds : 0;
  r.stopped_early = run.control.should_stop;
  for (auto it = state.log_history.rbegin(); it != state.log_history.rend(); ++it)
    if (it->contains("eval_loss")) {
      r.last_eval = *it;
      break;
    }
  return r;
}

// A hash of every parameter's bytes: FNV-1a of each parameter, then of those hashes in the
// model's order. Equal on two ranks (or two runs) exactly when the parameters are bitwise equal,
// which DDP promises; a check at the end catches what breaks it (an op that is not deterministic,
// a rank that skipped a step) at the cost of one allgather. Per parameter, so that pipeline ranks,
// each holding some, make the same fingerprint as one process holding all.
std::uint64_t parameter_hash(const torch::Tensor& p) {
  std::uint64_t h = 14695981039346656037ull;
  const auto t = p.detach().contiguous().to(torch::kCPU);
  const auto* bytes = static_cast<const unsigned char*>(t.data_ptr());
  for (std::size_t i = 0, n = static_cast<std::size_t>(t.nbytes()); i < n; ++i) h = (h ^ bytes[i]) * 1099511628211ull;
  return h;
}

std::string combined_fingerprint(const std::vector<std::uint64_t>& hashes) {
  std::uint64_t h = 14695981039346656037ull;
  for (std::uint64_t x : hashes)
    for (int b = 0; b < 8; ++b) h = (h ^ ((x >> (8 * b)) & 0xff)) * 1099511628211ull;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

std::string parameters_fingerprint(const torch::nn::Module& module, ZeroOptimizer* zero) {
  std::vector<std::uint64_t> hashes;
  auto hash = [&](const torch::Tensor& p) { hashes.push_back(parameter_hash(p)); };
  if (zero) {  // a unit at a time under stage 3 (frozen parameters are not in it: none here)
    zero->visit_parameters(hash);
  } else {
    for (const auto& p : module.parameters()) hash(p);
  }
  return combined_fingerprint(hashes);
}

WholeParameters::WholeParameters(Trainer::Impl& trainer, bool keep_values) : keep_values_(keep_values) {
  if (!trainer.step.stage3()) return;
  zero_ = trainer.step.zero();
  zero_->gather_all();
}

WholeParameters::~WholeParameters() noexcept(false) {
  if (zero_ && std::uncaught_exceptions() == 0) zero_->release_all(keep_values_);
}

void Trainer::Impl::check_replicas() {
  if (tensor_comm) return check_tensor_replicas();
  if (step.pipeline()) return step.check_stage_replicas();
  ZeroOptimizer* sliced = step.stage3() ? step.zero() : nullptr;
  if (world() == 1) {  // nothing to compare; the fingerprint says what a run with more workers should match
    LOCKSTEP_LOG(info, train) << "one worker holds the parameters (fingerprint "
                              << parameters_fingerprint(*model.module, sliced) << ")";
    return;
  }
  const auto all = comm::allgather_strings(*comm, parameters_fingerprint(*model.module, sliced));
  if (rank() != 0) return;
  std::string differ;
  for (int r = 1; r < world(); ++r)
    if (all[static_cast<std::size_t>(r)] != all[0])
      differ += (differ.empty() ? "" : ", ") + std::to_string(r);
  if (differ.empty())
    LOCKSTEP_LOG(info, train) << "all " << world() << " replicas hold the same parameters (fingerprint "
                              << all[0] << ")";
  else
    LOCKSTEP_LOG(warn, train)
        << "the replicas diverged: rank(s) " << differ
        << " hold parameters that differ from rank 0's (a non-deterministic op, or a rank that "
           "skipped a step); evaluate rank 0's checkpoint with care";
}

TrainResult Trainer::Impl::train() {
  if (elastic) return elastic->train();
  RunProgress run;
  // Under a pipeline every stage of a replica draws the replica's dropout seeds (pipe/units.h).
  torch::manual_seed(args.seed + static_cast<std::uint64_t>(data_rank()));
  data::DistributedSampler sampler(train_set->size(), data_rank(), data_world(), /*shuffle=*/true, args.seed);
  bool resumed_mid_epoch = false;
  prepare(sampler, resumed_mid_epoch);
  reports.announce();
  if (auto record = checkpoints.take_resume_record()) reports.record(*record);
  for (auto& cb : callbacks) cb->on_train_begin(state);
  run.first_step = state.global_step;
  run.at_window_start = window_counters();
  if (args.cuda_graphs) step.begin_cuda_graphs();
  while (state.global_step < state.max_steps && !run.control.should_stop) {
    if (!resumed_mid_epoch) {
      sampler.set_epoch(state.epoch);
      checkpoints.begin_epoch();
    }
    resumed_mid_epoch = false;
    run_epoch(sampler, run);
  }
  step.end_cuda_graphs();
  step.meet_machines();
  checkpoints.finish_background_save();
  check_replicas();
  load_best_model();
  for (auto& cb : callbacks) cb->on_train_end(state);
  return result(run);
}

// The model onto --device, before DDP or an optimizer sees its parameters.
void Trainer::Impl::place_model() {
  if (args.device == "cpu") return;
  device = training_device(args.device, local_rank());
  if (device.is_cpu()) return;
  model.module->to(device);
  if (rank() == 0) LOCKSTEP_LOG(info, train) << "training on " << device.str() << " (worker 0)";
}

const Layout& Trainer::Impl::layout() const {
  if (!layout_ || layout_->world() != world()) {
    LayoutRequest r;
    r.world = world();
    r.pipeline_parallel = args.pipeline_parallel;
    r.tensor_parallel = args.tensor_parallel;
    r.zero_stage = args.zero_stage;
    r.sequence_parallel = args.sequence_parallel;
    r.machine_of = comm->machine_of();
    layout_ = Layout::build(r);
  }
  return *layout_;
}

// --fp16 needs float16 autocast on the training device.
void Trainer::Impl::check_precision() const {
  if (args.fp16 && device.is_cpu() && !torch_compat::kCpuFloat16Autocast)
    throw ConfigError("--fp16 on the CPU: this libtorch (" + std::string(TORCH_VERSION) +
                      ") autocasts the CPU to bfloat16 only; use --bf16 (no loss scaling needed), a CUDA device, or "
                      "libtorch 2.3 or later");
}

Trainer::Trainer(Model model, std::shared_ptr<const Dataset> train_dataset,
                 std::shared_ptr<const Dataset> eval_dataset, TrainingArguments args,
                 std::vector<std::shared_ptr<TrainerCallback>> callbacks, comm::Communicator* comm)
    : impl_(std::make_unique<Impl>()) {
  args.validate();
  if (!model.module || !model.forward)
    throw ConfigError("the Trainer needs a model: use Model::of(your_module)");
  if (!train_dataset || train_dataset->size() == 0)
    throw ConfigError("the Trainer needs a non-empty training dataset");
  impl_->model = std::move(model);
  impl_->train_set = std::move(train_dataset);
  impl_->eval_set = std::move(eval_dataset);
  impl_->args = std::move(args);
  impl_->zero_plan = ZeroOptions{impl_->args.zero_stage, impl_->args.zero_shared_parameters};
  impl_->callbacks = std::move(callbacks);
  if (impl_->args.early_stopping_patience > 0)
    impl_->callbacks.push_back(std::make_shared<EarlyStoppingCallback>(
        impl_->args.metric_for_best_model, impl_->args.best_is_greater(), impl_->args.early_stopping_patience,
        impl_->args.early_stopping_threshold));
  if (comm) {
    impl_->comm = comm;
  } else if (comm::started_elastic()) {  // lockstep run --nnodes MIN:MAX: blocks until admitted
    if (impl_->args.sync_every > 1)
      throw ConfigError("--sync-every " + std::to_string(impl_->args.sync_every) +
                        " in an elastic job: local SGD does not follow membership changes yet; use --sync-every 1");
    if (impl_->pipelined())
      throw ConfigError("--pipeline-parallel " + std::to_string(impl_->args.pipeline_parallel) +
                        " in an elastic job (lockstep run --nnodes MIN:MAX): a pipeline's stages do not follow "
                        "membership changes yet; start a fixed number of workers");
    if (impl_->args.tensor_parallel > 1)
      throw ConfigError("--tensor-parallel " + std::to_string(impl_->args.tensor_parallel) +
                        " in an elastic job (lockstep run --nnodes MIN:MAX): a tensor group does not follow "
                        "membership changes yet; start a fixed number of workers");
    comm::CommOptions options;
    options.backend = impl_->args.backend;
    impl_->elastic = std::make_unique<ElasticRun>(*impl_, comm::join_elastic_from_env(options));
    impl_->comm = &impl_->elastic->comm();
  } else {
    comm::CommOptions options;
    options.backend = impl_->args.backend;
    impl_->job = comm::join_from_env(options);
    impl_->comm = impl_->job.comm.get();
  }
  impl_->layout();  // checked before anything else is built
  if (impl_->args.eval_strategy != "no" && !impl_->eval_set)
    throw ConfigError("--eval-strategy " + impl_->args.eval_strategy + " needs an eval dataset");
  impl_->place_model();
  impl_->check_precision();
  if (impl_->args.cuda_graphs)
    if (const std::string why = CudaGraphStep::refusal(*impl_); !why.empty()) throw ConfigError("--cuda-graphs: " + why);
  impl_->loss_fn = [](const torch::Tensor& out, const torch::Tensor& target) {
    // Over the last dimension: [B, C] logits for [B] labels, or [B, T, V] for [B, T] tokens.
    return torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}), target.reshape({-1}));
  };
  impl_->split_model();
  track_tensor_memory();
}

Trainer::~Trainer() = default;
TrainResult Trainer::train() {
  return impl_->train();
}
nlohmann::json Trainer::evaluate() {
  nlohmann::json metrics;
  impl_->run_recovering([&] { metrics = impl_->evaluate(); });
  return metrics;
}
std::string Trainer::save_checkpoint() {
  if (!impl_->step.built())
    throw ConfigError("save_checkpoint() needs train() to have set up the optimiser first");
  std::string dir;
  impl_->run_recovering([&] {
    dir = impl_->checkpoints.save(0);
    impl_->checkpoints.finish_background_save();
  });
  return dir;
}
void Trainer::save_metrics(const std::string& split, const nlohmann::json& metrics) {
  impl_->run_recovering([&] { impl_->checkpoints.write_results(split, metrics); });
}
const TrainerState& Trainer::state() const {
  return impl_->state;
}
const TrainingArguments& Trainer::args() const {
  return impl_->args;
}
comm::Communicator& Trainer::communicator() {
  return *impl_->comm;
}
void Trainer::set_loss(std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> loss) {
  impl_->loss_fn = std::move(loss);
}

}  // namespace lockstep::train
