// What the Trainer reports: rank 0's first lines, the train_begin record the doctor reads, and
// each logging window's metrics.jsonl line and progress line.
#include <ATen/Parallel.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <thread>

#include "lockstep/base/knobs.h"
#include "lockstep/base/log.h"
#include "lockstep/train/model_flops.h"
#include "lockstep/train/tensor_memory.h"
#include "lockstep/train_core/blas.h"
#include "lockstep/train_core/memory_usage.h"
#include "lockstep/train_core/metrics.h"
#include "lockstep/train_core/progress.h"
#include "trainer_impl.h"
#include "trainer_reports.h"

namespace lockstep::train {

TrainerReports::TrainerReports(Trainer::Impl& run) : run_(run) {}

TrainerReports::~TrainerReports() = default;

void TrainerReports::open() {
  outputs_ = std::make_unique<RunOutputs>(run_.args.output_dir, run_.rank(), run_.args.trace);
}

// A change of membership empties the window: a step's log cut short by one is not written again.
void TrainerReports::log_or_show_progress(bool last, RunProgress& run) {
  if (run.window.steps() == 0) return;
  const TrainingArguments& args = run_.args;
  if (run_.state.global_step % args.logging_steps == 0 || last) {
    log_window(run);
  } else if (!args.disable_tqdm && ::isatty(STDERR_FILENO)) {
    show_progress(run.window.local_mean_loss(),
                  rate_text(run.window.local_samples_per_second(), run.window.local_tokens_per_second(run_.world())),
                  0, run);
  }
}

// Rank 0's lines on what runs other than plain DDP: local SGD, ZeRO's mirrors, its buckets.
void TrainerReports::log_modes() const {
  const TrainingArguments& args = run_.args;
  const ZeroOptimizer* zero = run_.step.zero();
  const Reducer* reducer = run_.step.reducer();
  if (run_.step.outer())
    LOCKSTEP_LOG(info, train) << "local SGD: gradients are averaged inside each machine ("
                              << run_.step.machine_ranks()
                              << " workers) and the machines meet every " << args.sync_every
                              << " steps (outer step: lr " << args.outer_learning_rate << ", Nesterov momentum "
                              << args.outer_momentum << ") and before each evaluation and checkpoint";
  if (zero && zero->memory().mirrors > 0)
    LOCKSTEP_LOG(info, train) << "ZeRO mirrors: each worker also keeps the slices of a worker on another machine ("
                              << zero->memory().mirrors / 1e6
                              << " MB of parameters and optimizer state), so that a lost machine's shards live on";
  if (reducer && reducer->bucket_cap_mb() < args.ddp_bucket_cap_mb)
    LOCKSTEP_LOG(info, train) << "gradient buckets of " << reducer->bucket_cap_mb() << " MB, not the "
                              << args.ddp_bucket_cap_mb << " MB --ddp-bucket-cap-mb asks: ZeRO-2 keeps two buckets' "
                              << "gradients besides its slices, and small ones start reducing sooner";
}

// The model's FLOPs per sample and, when LOCKSTEP_PROBE_MATMUL asks, the matmul rates at the
// shapes of this worker's micro-batch.
RunFlops TrainerReports::count_flops() const {
  const TrainingArguments& args = run_.args;
  RunFlops counted;
  const auto per_sample = model_matmuls(*run_.model.module, 1);
  if (!per_sample) return counted;
  counted.per_sample = training_flops(*per_sample);
  // The probe times the CPU's products: against a GPU's run it would say nothing.
  if (knobs::get(knobs::kProbeMatmul).value_or("") != "1" || !run_.device.is_cpu()) return counted;
  const auto shapes = *model_matmuls(*run_.model.module, args.per_device_train_batch_size);
  counted.fp32_rate = measure_matmul_rate(shapes, torch::kFloat);
  counted.bf16_rate = measure_matmul_rate(shapes, torch::kBFloat16);
  return counted;
}

// Rank 0's first lines, and the train_begin record the doctor reads.
void TrainerReports::announce() {
  const TrainingArguments& args = run_.args;
  const TrainerState& state = run_.state;
  const BlasInfo blas = blas_info();
  flops_ = count_flops();
  if (run_.rank() != 0) return;
  // Under a pipeline the samples are dealt over the replicas, each pipeline rank of one reading the same.
  const int replicas = run_.data_world(), workers = run_.world();
  const std::string who = run_.step.pipeline() ? std::to_string(replicas) + " replica" + (replicas == 1 ? "" : "s") +
                                                     " (of " + std::to_string(args.pipeline_parallel) + " pipeline ranks)"
                                               : std::to_string(workers) + " worker" + (workers == 1 ? "" : "s");
  // An elastic job's step is its first membership's, dealt over the members of the moment.
  const std::size_t per_worker = run_.samples_per_step();
  const std::size_t step_samples = run_.elastic ? run_.elastic->global_batch() : per_worker * std::size_t(replicas);
  char batch[256];
  if (step_samples == per_worker * std::size_t(replicas))
    std::snprintf(batch, sizeof batch, "%s x %d per device x %d accumulation = %lld samples per step", who.c_str(),
                  args.per_device_train_batch_size, args.gradient_accumulation_steps,
                  static_cast<long long>(step_samples));
  else
    std::snprintf(batch, sizeof batch, "%s share %lld samples per step (the first membership's %lld x %d per device x %d accumulation)",
                  who.c_str(), static_cast<long long>(step_samples), static_cast<long long>(step_samples / per_worker),
                  args.per_device_train_batch_size, args.gradient_accumulation_steps);
  char head[768];
  std::snprintf(
      head, sizeof head,
      "%s; %lld steps (%.2f epochs of "
      "%lld steps), %s, lr %g (%s), backend %s",
      batch, static_cast<long long>(state.max_steps),
      static_cast<double>(state.max_steps) / static_cast<double>(state.steps_per_epoch),
      static_cast<long long>(state.steps_per_epoch), args.optim.c_str(), args.learning_rate,
      args.lr_scheduler_type.c_str(), run_.comm->backend_name().c_str());
  LOCKSTEP_LOG(info, train) << "layout: " << run_.layout().describe();
  LOCKSTEP_LOG(info, train) << head << (run_.step.zero() ? ", " + run_.zero_plan.describe() : "");
  log_modes();
  if (!blas.advice.empty()) LOCKSTEP_LOG(warn, train) << blas.advice;

  if (flops_.fp32_rate > 0)
    LOCKSTEP_LOG(info, train) << "matmul rate at the model's shapes, per worker: fp32 " << flops_.fp32_rate / 1e9
                              << " GFLOP/s, bf16 " << flops_.bf16_rate / 1e9 << " GFLOP/s";
  outputs_->record(train_begin_record(blas).to_json());
}

namespace {

void describe_blas(const BlasInfo& blas, metrics::TrainBegin& begin) {
  begin.blas = blas.config;
  begin.blas_core = blas.core;
  begin.blas_best_core = blas.best_core;
  begin.blas_own_core = blas.own_core;
  begin.blas_forced = blas.forced;
  begin.blas_by_launcher = blas.chosen_by_launcher;
}

// A pipeline rank's settings and its share: its stages' parameters and their gradients (the
// optimizer state, of what it updates, is counted as every worker's is).
void describe_pipeline(const TrainingArguments& args, const pipe::Pipeline& pipeline, metrics::TrainBegin& begin) {
  begin.pipeline_parallel = args.pipeline_parallel;
  begin.pipeline_schedule = args.pipeline_schedule;
  begin.virtual_stages = args.virtual_stages;
  begin.num_microbatches = args.num_microbatches > 0 ? args.num_microbatches : args.gradient_accumulation_steps;
  begin.pipeline_plan = pipeline.describe_plan();
  std::int64_t own = 0;
  for (const auto& p : pipeline.parameters()) own += static_cast<std::int64_t>(p.nbytes());
  begin.worker_parameter_bytes = begin.worker_gradient_bytes = own;
}

}  // namespace

// What the doctor and report read of this start: the configuration, the memory each worker
// holds, the BLAS kernels and the model's FLOPs.
metrics::TrainBegin TrainerReports::train_begin_record(const BlasInfo& blas) const {
  const TrainingArguments& args = run_.args;
  const TrainerState& state = run_.state;
  metrics::TrainBegin begin;
  begin.world_size = run_.world();
  begin.per_device_train_batch_size = args.per_device_train_batch_size;
  begin.gradient_accumulation_steps = args.gradient_accumulation_steps;
  begin.dataloader_num_workers = args.dataloader_num_workers;
  begin.intra_op_threads = at::get_num_threads();
  begin.cores = static_cast<int>(std::thread::hardware_concurrency());
  begin.backend = run_.comm->backend_name();
  begin.machines = run_.comm->network_stats().machines;
  const ZeroOptimizer* zero = run_.step.zero();
  begin.ddp_bucket_cap_mb = run_.step.reducer() ? run_.step.reducer()->bucket_cap_mb() : args.ddp_bucket_cap_mb;
  begin.ddp_bucket_cap_mb_asked = args.ddp_bucket_cap_mb;
  begin.ddp_comm_hook = args.ddp_comm_hook;
  begin.sync_every = run_.step.outer() ? args.sync_every : 1;
  for (const auto& p : run_.model.module->parameters()) {
    begin.parameters += p.numel();
    begin.parameter_bytes += static_cast<std::int64_t>(p.nbytes());
  }
  begin.gradient_checkpointing = args.gradient_checkpointing;
  const bool by_tensor = run_.step.pipeline() || run_.tensor_comm;  // ZeRO-1 by whole tensors
  begin.zero_stage = zero || by_tensor ? run_.zero_plan.stage : 0;
  begin.zero_shared_parameters = zero && run_.zero_plan.shared_parameters;
  const ZeroMemory held = zero ? zero->memory() : ZeroMemory{};
  begin.worker_parameter_bytes = zero ? held.parameters : begin.parameter_bytes;
  begin.worker_gradient_bytes = zero ? held.gradients : begin.parameter_bytes;
  begin.worker_gradient_slot_bytes = held.gradient_slots;
  std::int64_t updated = 0;  // what this worker's optimizer updates: every parameter, or its share
  if (!zero)
    for (const auto& p : run_.step.updated_parameters()) updated += static_cast<std::int64_t>(p.nbytes());
  begin.worker_optimizer_state_bytes =
      zero ? held.optimizer_state : updated * (args.optim == "sgd" ? args.sgd_momentum > 0 : 2);
  begin.max_steps = state.max_steps;
  begin.start_step = state.global_step;
  describe_blas(blas, begin);
  begin.bf16 = args.bf16;
  begin.fp16 = args.fp16;
  begin.model_flops_per_sample = flops_.per_sample;
  if (flops_.fp32_rate > 0) {
    begin.matmul_fp32_flops_per_second = flops_.fp32_rate;
    begin.matmul_bf16_flops_per_second = flops_.bf16_rate;
  }
  if (const pipe::Pipeline* pipeline = run_.step.pipeline()) describe_pipeline(args, *pipeline, begin);
  return begin;
}

void TrainerReports::show_progress(double loss, const std::string& rate, double exposed_fraction,
                                  const RunProgress& run) {
  const TrainingArguments& args = run_.args;
  const TrainerState& state = run_.state;
  if (run_.rank() != 0) return;
  const double done = static_cast<double>(state.global_step - run.first_step);
  const double elapsed = seconds_between(run.start, Clock::now());
  const double eta = done > 0 ? elapsed / done * static_cast<double>(state.max_steps - state.global_step) : 0;
  const bool tty = !args.disable_tqdm && ::isatty(STDERR_FILENO);
  if (tty) {
    std::fputs(
        progress_bar(state.global_step, state.max_steps, elapsed, eta, rate, loss).c_str(),
        stderr);
    if (state.global_step >= state.max_steps) std::fputs("\n", stderr);
    std::fflush(stderr);
  } else {
    std::printf("%s\n", progress_line(state.global_step, state.max_steps, state.fractional_epoch(), loss,
                                      run_.learning_rate_at(state.global_step - 1), rate,
                                      exposed_fraction, eta)
                            .c_str());
    std::fflush(stdout);
  }
}

namespace {

double mean(const std::vector<double>& values) {
  double sum = 0;
  for (const double v : values) sum += v;
  return values.empty() ? 0 : sum / static_cast<double>(values.size());
}

// Collective: each parallel dimension's communication per step, averaged over ranks. Tensor
// parallelism: how long the data and tensor groups' collectives ran over the window (an
// evaluation's gathers fall in the window after it). A pipeline: its own per-rank fields.
void add_dimension_fields(Trainer::Impl& t, metrics::StepLog& entry, const WindowCounters& start,
                          const WindowCounters& now, double steps) {
  if (t.tensor_comm) {
    double busy[2] = {(now.data_busy - start.data_busy) / steps, (now.tensor_busy - start.tensor_busy) / steps};
    t.comm->allreduce(busy, 2, comm::DType::f64, comm::ReduceOp::sum)->wait();
    entry.data_comm_seconds = busy[0] / t.world();
    entry.tensor_comm_seconds = busy[1] / t.world();
  }
  if (entry.pipeline_send_seconds && entry.pipeline_reduce_seconds) {
    entry.data_comm_seconds = mean(*entry.pipeline_reduce_seconds);
    entry.pipeline_comm_seconds = mean(*entry.pipeline_send_seconds);
  }
}

}  // namespace

// Collective: the window's numbers averaged over ranks, as one metrics.jsonl line.
void TrainerReports::log_window(RunProgress& run) {
  const TrainingArguments& args = run_.args;
  const TrainerState& state = run_.state;
  const double steps = static_cast<double>(std::max<std::int64_t>(1, run.window.steps()));
  metrics::StepLog entry = run.window.summarise(*run_.comm, /*find_straggler=*/!run_.step.pipeline());
  const WindowCounters now = run_.window_counters();
  const comm::NetworkStats& network = now.network;
  if (network.bytes_sent > run.at_window_start.network.bytes_sent) {
    entry.network_bytes_per_step =
        static_cast<double>(network.bytes_sent - run.at_window_start.network.bytes_sent) / steps;
    entry.network_seconds_per_step = (network.seconds - run.at_window_start.network.seconds) / steps;
  }
  entry.step = state.global_step;
  entry.epoch = state.fractional_epoch();
  entry.learning_rate = run_.learning_rate_at(state.global_step - 1);
  entry.peak_rss_bytes = static_cast<double>(peak_rss_bytes());
  double pss = static_cast<double>(pss_bytes());
  run_.comm->allreduce(&pss, 1, comm::DType::f64, comm::ReduceOp::sum)->wait();
  entry.job_pss_bytes = pss;
  if (run_.step.stage3())
    entry.zero_gathered_high_water_bytes = static_cast<double>(run_.step.zero()->memory().gathered_high_water);
  if (run_.step.pipeline()) run_.step.add_pipeline_fields(entry);
  add_dimension_fields(run_, entry, run.at_window_start, now, steps);
  if (tensor_memory_tracked()) entry.step_tensor_bytes = run.window.step_tensor_bytes();
  if (flops_.per_sample) {
    entry.model_flops_per_second = *flops_.per_sample * entry.samples_per_second;
    const double rate = args.bf16 ? flops_.bf16_rate : flops_.fp32_rate;
    if (rate > 0) entry.mfu = *entry.model_flops_per_second / run_.world() / rate;
  }
  if (args.fp16) {  // the ranks skip the same steps (under local SGD, those of their machine)
    const LossScale& loss_scale = run_.step.loss_scale();
    double scale = loss_scale.scale();
    double skipped = static_cast<double>(loss_scale.overflows() - run.overflows_at_window_start);
    run.overflows_at_window_start = loss_scale.overflows();
    if (run_.step.outer()) {  // each machine its own: the lowest scale, and the most steps one machine skipped
      run_.comm->allreduce(&scale, 1, comm::DType::f64, comm::ReduceOp::min)->wait();
      run_.comm->allreduce(&skipped, 1, comm::DType::f64, comm::ReduceOp::max)->wait();
    }
    entry.loss_scale = scale;
    entry.skipped_steps = static_cast<int>(skipped);
  }
  run.loss_sum += run.window.global_sums().loss_sum;
  run.loss_count += run.window.global_sums().loss_count;
  if (entry.straggler_rank != run.straggler && run_.rank() == 0) {
    if (entry.straggler)
      LOCKSTEP_LOG(warn, train) << *entry.straggler;
    else
      LOCKSTEP_LOG(info, train) << "no straggler any more: rank " << *run.straggler << " keeps up again";
  }
  run.straggler = entry.straggler_rank;
  run_.log(entry.to_json());
  show_progress(entry.loss, rate_text(entry.samples_per_second, entry.tokens_per_second.value_or(0)),
                entry.exposed_comm_fraction, run);
  run.window = LogWindow{};
  run.at_window_start = run_.window_counters();
}

}  // namespace lockstep::train
