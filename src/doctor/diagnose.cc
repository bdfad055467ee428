// The doctor's rules: each looks at the evidence and returns a finding, or nothing. diagnose()
// runs them all and ranks what they found.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>

#include "lockstep/base/cpu_kernels.h"
#include "lockstep/doctor/doctor.h"
#include "lockstep/train_core/matmuls.h"
#include "lockstep/train_core/memory_usage.h"

namespace lockstep::doctor {
namespace {

std::string fmt(const char* format, double a, double b = 0) {
  char buf[256];
  std::snprintf(buf, sizeof buf, format, a, b);
  return buf;
}
std::string ms(double seconds) {
  return fmt("%.1f ms", seconds * 1e3);
}
std::string pct(double fraction) {
  return fmt("%.0f%%", fraction * 100);
}

double step_of(const RunSummary& many) {
  return std::max(many.step, 1e-9);
}

// Matrix products on kernels below what the CPU runs: every worker count pays it. Under lockstep
// run that takes a choice (OPENBLAS_CORETYPE set to slower kernels); outside it, OpenBLAS's own.
std::optional<Finding> blas_kernels(const Evidence& e) {
  const RunSummary& many = e.many;
  if (!openblas_core_below(many.blas_core, many.blas_best_core)) return std::nullopt;
  Finding f;
  f.kind = "blas";
  f.problem =
      "OpenBLAS multiplies with its " + many.blas_core + " kernels, but this CPU runs its " +
      many.blas_best_core + " kernels" +
      (many.blas_forced ? " (OPENBLAS_CORETYPE chose them)" : " (OpenBLAS did not recognise the CPU model)");
  f.action = many.blas_forced ? "start the job with OPENBLAS_CORETYPE=" + many.blas_best_core +
                                    ", or without it (lockstep run then gives workers the CPU's best)"
                              : "start the job with OPENBLAS_CORETYPE=" + many.blas_best_core +
                                    " in its environment (read when OpenBLAS loads), or under lockstep run";
  if (e.blas_speedup > 0) {
    f.predicted = "measured with 1 worker: " + fmt("%.0f", e.one.samples_per_second) + " -> " +
                  fmt("%.0f samples/s (%.1fx)", e.one.samples_per_second * e.blas_speedup, e.blas_speedup);
    f.saving = std::max(0.0, 1.0 - 1.0 / e.blas_speedup);
  } else {
    f.predicted = "faster forward and backward; not measured";
    f.saving = 0.5 * many.compute() / step_of(many);
  }
  return f;
}

// Oversubscription: a fact of the configuration, whatever the timings say. Per machine: cores
// are each machine's own.
std::optional<Finding> oversubscribed_threads(const Evidence& e) {
  const RunSummary& many = e.many;
  const int workers = std::max(1, many.world / std::max(1, many.machines));
  const int used = workers * many.threads;
  if (used <= many.cores) return std::nullopt;
  const int fit = std::max(1, many.cores / workers);
  Finding f;
  f.kind = "threads";
  f.problem = std::to_string(workers) + " workers x " + std::to_string(many.threads) +
              " intra-op threads = " + std::to_string(used) + " threads on " + std::to_string(many.cores) +
              " cores: the threads of different workers take turns on the same cores";
  f.action = "run with OMP_NUM_THREADS=" + std::to_string(fit) +
             " (lockstep run sets cores / workers when it is unset; or call torch::set_num_threads(" +
             std::to_string(fit) + "))";
  f.predicted = "compute no longer time-shared: forward+backward up to " +
                fmt("%.1fx", static_cast<double>(used) / many.cores) + " faster per worker";
  f.saving = 1.0 - static_cast<double>(many.cores) / static_cast<double>(used);
  return f;
}

// Data loading starves the step.
std::optional<Finding> data_wait(const Evidence& e) {
  const RunSummary& many = e.many;
  const double share = many.data / step_of(many);
  if (share <= 0.10) return std::nullopt;
  const double compute = std::max(many.step - many.data, 1e-9);
  const int workers = std::max(many.loader_workers + static_cast<int>(std::ceil(many.data / compute)),
                               many.loader_workers + 1);
  Finding f;
  f.kind = "data";
  f.problem = "each step waits " + ms(many.data) + " for its batch (" + pct(share) +
              " of the step) with --dataloader-num-workers " + std::to_string(many.loader_workers);
  f.action = "set --dataloader-num-workers " + std::to_string(workers) +
             " so batches are built while the model computes (or make the dataset's get() cheaper)";
  f.predicted = "step " + ms(many.step) + " -> about " + ms(std::max(compute, many.data / workers)) +
                " once loading overlaps compute";
  f.saving = share;
  return f;
}

double exposed_share(const RunSummary& many) {
  return many.exposed / step_of(many);
}
bool communication_exposed(const RunSummary& many) {
  return many.world > 1 && exposed_share(many) > 0.15;
}

// Communication that backward could not hide: accumulate more samples per all-reduce.
// Accumulating k micro-batches per step leaves each side's per-sample compute and spreads the
// per-step costs (exposed all-reduce, optimiser) over k times more samples; the efficiency
// tends to one_micro / per_micro. Aim for 90%, or near that limit when it is lower.
std::optional<Finding> larger_batch(const Evidence& e) {
  const RunSummary &one = e.one, &many = e.many;
  if (!communication_exposed(many)) return std::nullopt;
  const double efficiency = scaling_efficiency(one, many);
  const double per_micro = std::max(many.step - many.exposed - many.optimizer, 1e-9);
  const double one_micro = std::max(one.step - one.optimizer, 1e-9);
  const double limit = one_micro / per_micro;
  const double target = std::min(0.9, 0.95 * limit);
  int factor = 1;
  double predicted = efficiency;
  for (int k = 2; k <= 64; k *= 2) {
    predicted = (k * one_micro + one.optimizer) / (k * per_micro + many.optimizer + many.exposed);
    factor = k;
    if (predicted >= target) break;
  }
  Finding f;
  f.kind = "batch";
  f.problem = "backward's end waits " + ms(many.exposed) + " per step for the all-reduce (" +
              pct(exposed_share(many)) + " of the step): " + fmt("%.1f MB", many.bytes_per_step / 1e6) +
              " of gradients per " + std::to_string(many.per_device * many.accumulation) +
              " samples per worker";
  f.action = "communicate less often per sample: --gradient-accumulation-steps " +
             std::to_string(factor * many.accumulation) + " (or a per-device batch " +
             std::to_string(factor) + "x larger if memory allows)";
  f.predicted = "scaling efficiency " + pct(efficiency) + " -> about " + pct(predicted) +
                " (the all-reduce then costs the same per " + std::to_string(factor) + "x more samples)";
  if (limit < 0.9)
    f.predicted += "; beyond that, compute that is slower with " + std::to_string(many.world) +
                   " workers caps it near " + pct(limit);
  f.saving = exposed_share(many) * (1.0 - 1.0 / factor);
  return f;
}

bool allreduce_far_below_bench(const Evidence& e) {
  const double got = training_gbps(e.many);
  return e.bench_gbps > 0 && got > 0 && got < 0.5 * e.bench_gbps;
}

// All-reduces far slower inside training than in the bench: they compete with backward for cores.
std::optional<Finding> comm_competes_for_cores(const Evidence& e) {
  if (!communication_exposed(e.many) || !allreduce_far_below_bench(e)) return std::nullopt;
  const double got = training_gbps(e.many);
  Finding f;
  f.kind = "scheduling";
  f.recommendation = false;
  f.problem = "inside training the all-reduce moved " + fmt("%.2f GB/s", got) + ", " +
              pct(got / e.bench_gbps) + " of the " + fmt("%.2f GB/s", e.bench_gbps) +
              " lockstep bench gets for the same bucket size on " + e.many.backend +
              ": the transport is not the limit, the all-reduce competes with backward for the cores";
  f.action = "keep workers x threads below the core count so the communication thread has a core";
  f.predicted = "up to " + fmt("%.1fx", e.bench_gbps / got) + " faster all-reduces";
  f.saving = exposed_share(e.many) * 0.5;
  return f;
}

// Between machines the link is the limit when the training's network traffic moves about as fast
// as the bench's over the same backend: send fewer bytes across it.
constexpr double kHundredMbit = 0.0125;  // GB/s

bool link_is_the_limit(const Evidence& e) {
  const double got = e.many.network_gbps();
  return e.many.machines > 1 && got > 0 && e.bench_network_gbps > 0 && got >= 0.7 * e.bench_network_gbps;
}

std::optional<Finding> link_bound(const Evidence& e) {
  const RunSummary& many = e.many;
  if (!communication_exposed(many) || !link_is_the_limit(e) || many.comm_hook != "none" || many.sync_every > 1)
    return std::nullopt;
  Finding f;
  f.kind = "link";
  f.problem = "between the " + std::to_string(many.machines) + " machines the all-reduce moves " +
              fmt("%.2f GB/s", many.network_gbps()) + " per rank, " +
              pct(many.network_gbps() / e.bench_network_gbps) +
              " of what the link carries for lockstep bench (" + fmt("%.2f GB/s", e.bench_network_gbps) +
              "): the link is the limit, and backward's end waits " + ms(many.exposed) + " per step for it";
  f.action =
      "compress between machines only: --ddp-comm-hook auto (per bucket, from the measured link and compute: "
      "PowerSGD rank 4 sends (rows + cols) x 4 numbers per matrix, 128x fewer for 1024 x 1024; int8 a quarter; "
      "shared memory inside each machine stays exact); or --ddp-comm-hook bf16 (half the bytes everywhere)";
  if (e.bench_network_gbps < kHundredMbit)
    f.action += ". Below 100 Mbit/s even that may wait: --sync-every 8 (local SGD: the machines meet every 8 "
                "steps, one model's bytes instead of 8 gradients', for some accuracy: see docs/slow-links.md)";
  f.predicted = "exposed communication about " + ms(many.exposed) + " -> " + ms(many.exposed / 4) +
                " or less (int8's quarter of the bytes; PowerSGD's matrices far fewer, plus its compute)";
  f.saving = exposed_share(many) * 0.75;
  return f;
}

// All-reduces at the transport's speed: send fewer bytes.
std::optional<Finding> compress_gradients(const Evidence& e) {
  const RunSummary& many = e.many;
  if (!communication_exposed(many) || allreduce_far_below_bench(e) || many.comm_hook != "none" ||
      link_is_the_limit(e))
    return std::nullopt;
  Finding f;
  f.kind = "compression";
  f.problem = "the all-reduce runs near the transport's speed (" + fmt("%.2f GB/s", training_gbps(many)) +
              (e.bench_gbps > 0 ? ", bench " + fmt("%.2f GB/s", e.bench_gbps) : std::string()) +
              "): it is bandwidth-bound";
  f.action = "send bf16 gradients: --ddp-comm-hook bf16 (summed in float32, rounded once)";
  f.predicted =
      "half the bytes: exposed communication about " + ms(many.exposed) + " -> " + ms(many.exposed / 2);
  f.saving = exposed_share(many) * 0.5;
  return f;
}

// One rank holds every other back: the all-reduce waits for its step, so what the other rules
// read as exposed communication on rank 0 is partly waiting for it. Its ratio is in the
// Trainer's words ("... makes its steps 3.0x as long ...").
std::optional<Finding> straggler_named(const Evidence& e) {
  const RunSummary& many = e.many;
  if (many.straggler_rank < 0) return std::nullopt;
  const std::string rank = "rank " + std::to_string(many.straggler_rank);
  const bool data = many.straggler.find("data loading") != std::string::npos;
  double ratio = 0;
  if (const auto at = many.straggler.find("steps "); at != std::string::npos)
    std::sscanf(many.straggler.c_str() + at, "steps %lfx", &ratio);
  Finding f;
  f.kind = "straggler";
  f.problem = many.straggler.empty() ? rank + " is the straggler in most windows" : many.straggler;
  f.action = data ? "speed up " + rank + "'s data: more --dataloader-num-workers there, or find what makes its "
                        "batches slow to load (its storage, its decoding)"
                  : "find what slows " + rank + "'s compute (another job on its cores, a CPU quota, a slower machine) "
                        "or give its machine fewer workers; every rank runs at its pace";
  f.predicted = ratio > 1 ? fmt("steps up to %.1fx as fast once it keeps up (the others wait %.0f%% of each step)",
                                ratio, 100 * (1 - 1 / ratio))
                          : "steps as fast as the other ranks'";
  f.saving = ratio > 1 ? 1 - 1 / ratio : 0.1;
  return f;
}

// Compute itself slowed down with more workers: a note (shared memory bandwidth, cores).
std::optional<Finding> compute_slowed(const Evidence& e) {
  const double one_compute = e.one.compute();
  if (one_compute <= 0 || e.many.compute() <= 1.35 * one_compute) return std::nullopt;
  Finding f;
  f.kind = "compute";
  f.recommendation = false;
  f.problem = "forward+backward take " + ms(e.many.compute()) + " per step with " +
              std::to_string(e.many.world) + " workers against " + ms(one_compute) +
              " with one: the workers share memory bandwidth and caches";
  f.action = "nothing in lockstep changes this; fewer, larger workers or a larger batch use the cores better";
  return f;
}

// Every worker updates every parameter and keeps all of the optimizer state: when the update
// weighs on the step, or the state on the machine's memory, ZeRO divides both by the workers.
std::optional<Finding> shard_the_optimizer(const Evidence& e) {
  const RunSummary& many = e.many;
  if (many.world < 2 || many.zero_stage > 0) return std::nullopt;
  const double w = many.world;
  const double update_share = many.optimizer / step_of(many);
  const int per_machine = std::max(1, many.world / std::max(1, many.machines));
  const double machine = static_cast<double>(train::machine_memory_bytes());
  const double state_share = machine > 0 ? many.optimizer_state_bytes * per_machine / machine : 0;
  if (update_share < 0.08 && state_share < 0.25) return std::nullopt;
  Finding f;
  f.kind = "zero";
  f.problem = "each of the " + std::to_string(many.world) + " workers updates every parameter (" +
              ms(many.optimizer) + ", " + pct(update_share) + " of the step) and holds all of the optimizer state (" +
              fmt("%.0f MiB per worker, %.0f%% of this machine's memory", many.optimizer_state_bytes / 1048576,
                  100 * state_share) +
              ")";
  f.action = std::string("shard the optimizer: --zero-stage 2 (each worker updates and keeps 1/") +
             std::to_string(many.world) + " of it, same bytes on the wire)" +
             (many.machines == 1 && many.backend == "shm"
                  ? "; --zero-shared-parameters keeps one copy of the parameters on this machine"
                  : "");
  f.predicted = "optimizer step " + ms(many.optimizer) + " -> " + ms(many.optimizer / w) + "; optimizer state " +
                fmt("%.0f -> %.0f MiB per worker", many.optimizer_state_bytes / 1048576,
                    many.optimizer_state_bytes / w / 1048576);
  f.saving = update_share * (1 - 1 / w);
  return f;
}

// One machine's link out is far slower than the others': every all-reduce across the machines
// goes at its pace, which the training's own figures cannot tell from a slow network overall.
std::optional<Finding> slow_link(const Evidence& e) {
  const auto& links = e.link_out_gbps;
  if (links.size() < 2) return std::nullopt;
  const auto slowest = std::min_element(links.begin(), links.end());
  const double fastest = *std::max_element(links.begin(), links.end());
  if (*slowest <= 0 || *slowest >= 0.5 * fastest) return std::nullopt;
  const auto m = std::to_string(slowest - links.begin());
  Finding f;
  f.kind = "slow_link";
  f.problem = "machine " + m + "'s link out carries " + fmt("%.3f GB/s", *slowest) + ", " +
              fmt("%.1fx", fastest / *slowest) + " slower than the fastest machine's (" +
              fmt("%.3f GB/s", fastest) + "): every all-reduce between the machines goes at its pace";
  f.action = "look at machine " + m +
             "'s network (its interface's speed, a rate limit, a busy switch port) or run without it; "
             "until then --ddp-comm-hook auto sends fewer bytes across every link";
  f.predicted = "up to " + fmt("%.1fx", fastest / *slowest) + " faster communication between machines";
  f.saving = exposed_share(e.many) * (1.0 - *slowest / fastest);
  return f;
}

// The run multiplies in fp32 on a CPU whose bf16 units multiply its shapes much faster.
std::optional<Finding> bf16_matmuls(const Evidence& e) {
  const RunSummary& many = e.many;
  const auto advice = train::bf16_advice(many.bf16, many.matmul_fp32, many.matmul_bf16, step_of(many), many.compute());
  if (!advice) return std::nullopt;
  Finding f;
  f.kind = "precision";
  f.problem = "the matrix products run in fp32, which this CPU multiplies at " + fmt("%.0f", many.matmul_fp32 / 1e9) +
              " GFLOP/s per worker at the model's shapes; its bf16 units reach " +
              fmt("%.0f", many.matmul_bf16 / 1e9) + fmt(" (%.1fx)", advice->matmul_speedup);
  f.action = "train with --bf16 (autocast: products in bfloat16, weights, gradients and the optimizer in fp32); "
             "compare the loss curve with this run's";
  f.predicted = "up to " + fmt("%.2fx", advice->predicted_speedup) +
                " faster steps (all of forward and backward at the bf16 rate, the rest unchanged)";
  f.saving = 1 - 1 / advice->predicted_speedup;
  return f;
}

// How much of the machine the run uses: the model FLOPs it achieves over the measured matmul rate
// at its shapes, and why bf16 is not advised where it is no faster.
std::optional<Finding> utilisation(const Evidence& e) {
  const RunSummary& many = e.many;
  if (many.mfu() <= 0) return std::nullopt;
  Finding f;
  f.kind = "utilisation";
  f.recommendation = false;
  const double while_computing = many.compute() > 0 ? many.mfu() * step_of(many) / many.compute() : 0;
  f.problem = "the run reaches " + pct(many.mfu()) + " of this machine's " + (many.bf16 ? "bf16" : "fp32") +
              " matmul rate at the model's shapes (" + fmt("%.0f of %.0f GFLOP/s per worker", many.model_flops_per_worker() / 1e9,
                                                          many.matmul_rate() / 1e9) +
              "), " + pct(while_computing) + " while in forward and backward";
  f.action = "forward and backward also run element-wise work that model FLOPs do not count: activations, norms, "
             "softmax, casts; the rest of the step is in the breakdown above";
  if (!many.bf16 && many.matmul_bf16 > 0 && many.matmul_bf16 < 1.2 * many.matmul_fp32)
    f.action += "; bf16 multiplies no faster here (" + fmt("%.0f GFLOP/s", many.matmul_bf16 / 1e9) +
                ": no bf16 units on this CPU), so --bf16 would cost precision for nothing: keep fp32";
  return f;
}

// A pipelined run: the rank that idles most, against what its schedule idles with the measured
// action times. Well above it: transfers the compute does not hide. Near it: the schedule's own
// bubble, which more micro-batches (or the zero-bubble schedule) shrink; 1f1b's idle share is
// (P - 1) / (m + P - 1), so twice the micro-batches predict that share at 2m.
std::optional<Finding> pipeline_bubble(const Evidence& e) {
  const RunSummary& s = e.many;
  if (s.pipeline < 2 || s.bubble.empty() || s.bubble.size() != s.bubble_analytic.size()) return std::nullopt;
  const auto worst = std::size_t(std::max_element(s.bubble.begin(), s.bubble.end()) - s.bubble.begin());
  const double measured = s.bubble[worst], analytic = s.bubble_analytic[worst];
  if (measured < 0.05) return std::nullopt;
  Finding f;
  f.kind = "pipeline";
  f.problem = "pipeline rank " + std::to_string(worst) + " idles " + pct(measured) + " of each step; its schedule (" +
              s.pipeline_schedule + ", " + std::to_string(s.micro_batches) + " micro-batches) idles " + pct(analytic) +
              " with the action times measured";
  const double p = s.pipeline, m = std::max(1, s.micro_batches);
  if (measured - analytic > 0.05) {
    f.action = "the other " + pct(measured - analytic) + " of the step go to transfers between stages that compute does "
               "not hide (or a stage that computes unevenly): larger micro-batches send fewer, larger messages; on several "
               "machines, check the link between the stages' machines";
    f.predicted = "up to " + pct(measured - analytic) + " of the step";
    f.saving = measured - analytic;
  } else {
    const double now = (p - 1) / (m + p - 1), doubled = (p - 1) / (2 * m + p - 1);
    const double expected = analytic * doubled / now;
    f.action = "run more micro-batches per step (--num-microbatches " + std::to_string(2 * s.micro_batches) +
               ", a smaller --per-device-train-batch-size for the same batch)" +
               (s.pipeline_schedule == "zb" ? "" : ", or --pipeline-schedule zb, whose weight halves fill the bubble");
    f.predicted = "the schedule's idle share falls to about " + pct(expected) + " at twice the micro-batches";
    f.saving = analytic - expected;
  }
  return f;
}

using Rule = std::optional<Finding> (*)(const Evidence&);
constexpr Rule kRules[] = {blas_kernels,       oversubscribed_threads,  straggler_named, slow_link, data_wait,
                           larger_batch,       link_bound,              comm_competes_for_cores,
                           compress_gradients, shard_the_optimizer,     compute_slowed,
                           bf16_matmuls,       pipeline_bubble,         utilisation};

}  // namespace

double scaling_efficiency(const RunSummary& one, const RunSummary& many) {
  if (one.samples_per_second <= 0 || many.world <= 0) return 0;
  return many.samples_per_second / (static_cast<double>(many.world) * one.samples_per_second);
}

double training_gbps(const RunSummary& many) {
  return many.comm > 0 ? many.bytes_per_step / many.comm / 1e9 : 0;
}

std::vector<Finding> diagnose(const Evidence& evidence) {
  std::vector<Finding> out;
  for (Rule rule : kRules)
    if (auto f = rule(evidence)) out.push_back(std::move(*f));
  std::stable_sort(out.begin(), out.end(), [](const Finding& x, const Finding& y) {
    if (x.recommendation != y.recommendation) return x.recommendation;
    if ((x.kind == "threads") != (y.kind == "threads")) return x.kind == "threads";
    // a straggler or one slow link distorts what rank 0 measured: each comes before what those
    // numbers suggest
    const bool x_first = x.kind == "straggler" || x.kind == "slow_link";
    const bool y_first = y.kind == "straggler" || y.kind == "slow_link";
    if (x_first != y_first) return x_first;
    return x.saving > y.saving;
  });
  return out;
}

}  // namespace lockstep::doctor
