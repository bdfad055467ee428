// A measured run, summarised from its metrics.jsonl.
#include <algorithm>
#include <map>
#include <optional>
#include <type_traits>

#include "lockstep/doctor/doctor.h"
#include "lockstep/error.h"
#include "lockstep/train_core/metrics.h"

namespace lockstep::doctor {

namespace metrics = train::metrics;

double RunSummary::other() const {
  return std::max(0.0, step - data - forward - backward - exposed - optimizer);
}

// Every field with its doctor.json key, once: to_json and from_json both walk this list.
template <class Summary, class Visit>
void visit_fields(Summary& s, Visit&& visit) {
  visit("world_size", s.world);
  visit("intra_op_threads", s.threads);
  visit("cores", s.cores);
  visit("per_device_train_batch_size", s.per_device);
  visit("gradient_accumulation_steps", s.accumulation);
  visit("dataloader_num_workers", s.loader_workers);
  visit("backend", s.backend);
  visit("ddp_comm_hook", s.comm_hook);
  visit("sync_every", s.sync_every);
  visit("blas_core", s.blas_core);
  visit("blas_best_core", s.blas_best_core);
  visit("blas_forced", s.blas_forced);
  visit("blas_by_launcher", s.blas_by_launcher);
  visit("blas_own_core", s.blas_own_core);
  visit("samples_per_second", s.samples_per_second);
  visit("step_seconds", s.step);
  visit("data_seconds", s.data);
  visit("forward_seconds", s.forward);
  visit("backward_seconds", s.backward);
  visit("exposed_comm_seconds", s.exposed);
  visit("comm_seconds", s.comm);
  visit("optimizer_seconds", s.optimizer);
  visit("allreduce_bytes_per_step", s.bytes_per_step);
  visit("buckets_per_step", s.buckets_per_step);
  visit("machines", s.machines);
  visit("network_bytes_per_step", s.network_bytes);
  visit("network_seconds_per_step", s.network_seconds);
  visit("windows", s.windows);
  visit("zero_stage", s.zero_stage);
  visit("worker_optimizer_state_bytes", s.optimizer_state_bytes);
  visit("peak_rss_bytes", s.peak_rss_bytes);
  visit("straggler_rank", s.straggler_rank);
  visit("straggler", s.straggler);
  visit("bf16", s.bf16);
  visit("model_flops_per_sample", s.model_flops_per_sample);
  visit("matmul_fp32_flops_per_second", s.matmul_fp32);
  visit("matmul_bf16_flops_per_second", s.matmul_bf16);
  visit("pipeline_parallel", s.pipeline);
  visit("pipeline_schedule", s.pipeline_schedule);
  visit("num_microbatches", s.micro_batches);
  visit("pipeline_bubble", s.bubble);
  visit("pipeline_bubble_analytic", s.bubble_analytic);
  visit("pipeline_compute_seconds", s.stage_compute);
  visit("pipeline_wait_seconds", s.stage_wait);
  visit("pipeline_send_seconds", s.stage_send);
}

nlohmann::json RunSummary::to_json() const {
  nlohmann::json j;
  visit_fields(*this, [&](const char* key, const auto& value) { j[key] = value; });
  j["other_seconds"] = other();  // derived; readers recompute it
  return j;
}

RunSummary RunSummary::from_json(const nlohmann::json& j) {
  RunSummary s;
  visit_fields(s, [&](const char* key, auto& value) {
    if (auto it = j.find(key); it != j.end() && !it->is_null())
      value = it->get<std::decay_t<decltype(value)>>();
  });
  return s;
}

nlohmann::json Finding::to_json() const {
  return {{"kind", kind},           {"problem", problem}, {"action", action},
          {"predicted", predicted}, {"saving", saving},   {"recommendation", recommendation}};
}

Finding Finding::from_json(const nlohmann::json& j) {
  Finding f;
  f.kind = j.value("kind", "");
  f.problem = j.value("problem", "");
  f.action = j.value("action", "");
  f.predicted = j.value("predicted", "");
  f.saving = j.value("saving", 0.0);
  f.recommendation = j.value("recommendation", true);
  return f;
}

namespace {

void describe_configuration(const metrics::TrainBegin& b, RunSummary& s) {
  s.world = b.world_size;
  s.threads = b.intra_op_threads;
  s.cores = b.cores;
  s.per_device = b.per_device_train_batch_size;
  s.accumulation = b.gradient_accumulation_steps;
  s.loader_workers = b.dataloader_num_workers;
  s.backend = b.backend;
  s.machines = std::max(1, b.machines);
  s.comm_hook = b.ddp_comm_hook;
  s.sync_every = std::max(1, b.sync_every);
  s.blas_core = b.blas_core;
  s.blas_best_core = b.blas_best_core;
  s.blas_forced = b.blas_forced;
  s.blas_by_launcher = b.blas_by_launcher;
  s.blas_own_core = b.blas_own_core;
  s.zero_stage = b.zero_stage;
  s.optimizer_state_bytes = static_cast<double>(b.worker_optimizer_state_bytes);
  s.bf16 = b.bf16;
  s.model_flops_per_sample = b.model_flops_per_sample.value_or(0);
  s.matmul_fp32 = b.matmul_fp32_flops_per_second.value_or(0);
  s.matmul_bf16 = b.matmul_bf16_flops_per_second.value_or(0);
  s.pipeline = b.pipeline_parallel.value_or(1);
  s.pipeline_schedule = b.pipeline_schedule.value_or("");
  s.micro_batches = b.num_microbatches.value_or(0);
}

// Per pipeline rank, the mean over every window but the first of a per-rank list field.
std::vector<double> average_per_rank(const std::vector<metrics::StepLog>& logs,
                                     std::optional<std::vector<double>> metrics::StepLog::*field) {
  std::vector<double> sum;
  double n = 0;
  for (std::size_t i = 1; i < logs.size(); ++i) {
    const auto& v = logs[i].*field;
    if (!v) continue;
    sum.resize(std::max(sum.size(), v->size()), 0.0);
    for (std::size_t r = 0; r < v->size(); ++r) sum[r] += (*v)[r];
    ++n;
  }
  for (double& x : sum) x /= std::max(1.0, n);
  return sum;
}

// The rank the Trainer named in at least half of the windows after the first, if one was.
void name_the_straggler(const std::vector<metrics::StepLog>& logs, RunSummary& s) {
  std::map<int, int> named;
  for (std::size_t i = 1; i < logs.size(); ++i)
    if (logs[i].straggler_rank) ++named[*logs[i].straggler_rank];
  for (const auto& [rank, windows] : named)
    if (2 * windows >= static_cast<int>(logs.size() - 1)) s.straggler_rank = rank;
  for (std::size_t i = 1; i < logs.size(); ++i)
    if (logs[i].straggler_rank == s.straggler_rank && logs[i].straggler) s.straggler = *logs[i].straggler;
}

// Averages over every window but the first (warm-up).
void average_windows(const std::vector<metrics::StepLog>& logs, RunSummary& s) {
  const double n = static_cast<double>(logs.size() - 1);
  auto avg = [&](double metrics::StepLog::*field) {
    double sum = 0;
    for (std::size_t i = 1; i < logs.size(); ++i) sum += logs[i].*field;
    return sum / n;
  };
  s.samples_per_second = avg(&metrics::StepLog::samples_per_second);
  s.step = avg(&metrics::StepLog::step_seconds);
  s.data = avg(&metrics::StepLog::data_seconds);
  s.forward = avg(&metrics::StepLog::forward_seconds);
  s.backward = avg(&metrics::StepLog::backward_seconds);
  s.exposed = avg(&metrics::StepLog::exposed_comm_seconds);
  s.comm = avg(&metrics::StepLog::comm_seconds);
  s.optimizer = avg(&metrics::StepLog::optimizer_seconds);
  s.bytes_per_step = avg(&metrics::StepLog::allreduce_bytes_per_step);
  s.buckets_per_step = avg(&metrics::StepLog::buckets_per_step);
  double bytes = 0, seconds = 0;
  for (std::size_t i = 1; i < logs.size(); ++i) {
    bytes += logs[i].network_bytes_per_step.value_or(0);
    seconds += logs[i].network_seconds_per_step.value_or(0);
  }
  s.network_bytes = bytes / n;
  s.network_seconds = seconds / n;
  s.windows = static_cast<int>(logs.size() - 1);
  s.peak_rss_bytes = logs.back().peak_rss_bytes.value_or(0);
  s.bubble = average_per_rank(logs, &metrics::StepLog::pipeline_bubble);
  s.bubble_analytic = average_per_rank(logs, &metrics::StepLog::pipeline_bubble_analytic);
  s.stage_compute = average_per_rank(logs, &metrics::StepLog::pipeline_compute_seconds);
  s.stage_wait = average_per_rank(logs, &metrics::StepLog::pipeline_wait_seconds);
  s.stage_send = average_per_rank(logs, &metrics::StepLog::pipeline_send_seconds);
  name_the_straggler(logs, s);
}

}  // namespace

RunSummary read_summary(const std::string& metrics_path) {
  std::vector<metrics::Segment> segments;
  try {
    segments = metrics::read_metrics(metrics_path);
  } catch (const ConfigError& e) {
    throw ConfigError(std::string(e.what()) + ": the program did not run the lockstep Trainer?");
  }
  if (segments.empty() || segments.back().logs.size() < 2)
    throw ConfigError(metrics_path + " has " +
                      std::to_string(segments.empty() ? 0 : segments.back().logs.size()) +
                      " logged windows; the doctor needs at least 2 (the first is warm-up): raise --steps");
  RunSummary s;
  if (segments.back().begin) describe_configuration(*segments.back().begin, s);
  average_windows(segments.back().logs, s);
  return s;
}

}  // namespace lockstep::doctor
