// lockstep plan's estimates (doctor/plan.h): each layout's step simulated from the measured step,
// the machines and the model's shape.
#include "lockstep/doctor/plan.h"

#include <algorithm>
#include <cstdio>
#include <functional>

#include "lockstep/error.h"
#include "lockstep/pipe_core/schedule.h"
#include "lockstep/pipe_core/schedule_check.h"

namespace lockstep::doctor {
namespace {

constexpr double kFloat = 4;           // bytes: parameters, gradients, activations (float32)
constexpr double kMemoryHeadroom = 0.9;  // of a worker's share of its machine

// Where the ranks of a layout sit: rank = (p * D + d) * T + t (pipe_core/layout.h), machine = rank / n.
struct Placement {
  int P, D, T, n;
  int machine(int p, int d, int t) const { return ((p * D + d) * T + t) / n; }
};

void check_inputs(const PlanModel& model, const PlanMachines& machines, const PlanStep& step) {
  auto positive = [](double v, const std::string& what) {
    if (!(v > 0)) throw ConfigError("lockstep plan: " + what + " must be above 0");
  };
  positive(model.n_layer, "--n-layer");
  positive(model.n_head, "--n-head");
  positive(model.n_embd, "--n-embd");
  positive(model.block_size, "--block-size");
  positive(model.vocab_size, "--vocab-size");
  positive(machines.nodes, "--nnodes");
  positive(machines.nproc_per_node, "--nproc-per-node");
  positive(machines.cores, "--cores");
  positive(machines.machine_bytes_per_second, "--machine-link");
  positive(machines.memory_bytes, "--memory-gb");
  if (machines.nodes > 1) positive(machines.link_bytes_per_second, "--link (the machines' link)");
  positive(step.micro_batch, "--micro-batch");
  positive(step.micro_batches, "--micro-batches");
  if (!(step.seconds_per_sequence > 0))
    throw ConfigError("lockstep plan: no measured step: give --from-run DIR (a one-worker run of the model) or "
                      "--seconds-per-sequence");
}

// An all-reduce of `bytes` over `ranks` inside one machine.
double machine_allreduce(double bytes, int ranks, const PlanMachines& m) {
  return ranks < 2 ? 0 : 2.0 * (ranks - 1) / ranks * bytes / m.machine_bytes_per_second;
}

// The gradients' all-reduce (`bytes` per worker) over every data group at once: inside a machine
// over shared memory, and for a group that spans machines (hier) each of its machines' links
// carrying the group's 2 (M - 1) / M share. The slowest machine sets the time: its busiest link,
// and its largest group part's reduction inside.
double data_allreduce(double bytes, const Placement& at, const PlanMachines& m) {
  if (at.D < 2) return 0;
  std::vector<double> link(std::size_t(m.nodes), 0);
  double inside = 0;
  for (int p = 0; p < at.P; ++p)
    for (int t = 0; t < at.T; ++t) {
      std::vector<int> ranks_on(std::size_t(m.nodes), 0);
      for (int d = 0; d < at.D; ++d) ++ranks_on[std::size_t(at.machine(p, d, t))];
      const int spanned = int(std::count_if(ranks_on.begin(), ranks_on.end(), [](int n) { return n > 0; }));
      for (std::size_t machine = 0; machine < ranks_on.size(); ++machine) {
        if (ranks_on[machine] == 0) continue;
        inside = std::max(inside, machine_allreduce(bytes, ranks_on[machine], m));
        if (spanned > 1) link[machine] += 2.0 * (spanned - 1) / spanned * bytes;
      }
    }
  const double busiest = *std::max_element(link.begin(), link.end());
  return inside + (busiest > 0 ? busiest / m.link_bytes_per_second : 0);
}

// One micro-batch's activations (`bytes` per rank) from each stage to the next: the slowest
// boundary, where a machine's link carries those of all its ranks that cross it.
double activation_transfer(double bytes, const Placement& at, const PlanMachines& m) {
  double slowest = bytes / m.machine_bytes_per_second;
  for (int p = 0; p + 1 < at.P; ++p) {
    std::vector<int> crossing(std::size_t(m.nodes), 0);
    for (int d = 0; d < at.D; ++d)
      for (int t = 0; t < at.T; ++t)
        if (at.machine(p, d, t) != at.machine(p + 1, d, t)) ++crossing[std::size_t(at.machine(p, d, t))];
    for (const int c : crossing) slowest = std::max(slowest, c * bytes / m.link_bytes_per_second);
  }
  return slowest;
}

// The tied embedding's gradient, last stage to first, once per micro-batch: over the link when they
// sit on different machines, the busiest machine's link carrying those of all its last-stage ranks.
double tied_transfer(double bytes, const Placement& at, const PlanMachines& m) {
  if (at.P < 2) return 0;
  std::vector<int> crossing(std::size_t(m.nodes), 0);
  for (int d = 0; d < at.D; ++d)
    for (int t = 0; t < at.T; ++t)
      if (at.machine(0, d, t) != at.machine(at.P - 1, d, t)) ++crossing[std::size_t(at.machine(at.P - 1, d, t))];
  const int busiest = *std::max_element(crossing.begin(), crossing.end());
  return busiest > 0 ? busiest * bytes / m.link_bytes_per_second : bytes / m.machine_bytes_per_second;
}

double memory_per_worker(const PlanModel& model, const PlanStep& step, const LayoutEstimate& e) {
  const double share = model.parameters() / (e.pipeline * e.tensor), D = e.data;
  const double parameters = kFloat * share / (e.zero >= 3 ? D : 1);
  const double gradients = kFloat * share / (e.zero >= 2 ? D : 1);
  const double moments = 2 * kFloat * share / (e.zero >= 1 ? D : 1);
  const int in_flight = e.pipeline > 1 ? std::min(e.pipeline, step.micro_batches) : 1;
  // Split layers hold 1/T of their activations; norms, residuals and the attention's inputs stay
  // whole without sequence parallelism: about half of them.
  const double split = e.tensor > 1 ? (1.0 + 1.0 / e.tensor) / 2 : 1;
  const double activations = step.activation_bytes_per_sequence * step.micro_batch * in_flight / e.pipeline * split;
  return parameters + gradients + moments + activations;
}

LayoutEstimate estimate(const PlanModel& model, const PlanMachines& m, const PlanStep& step, int P, int D, int T,
                        int zero) {
  LayoutEstimate e;
  e.pipeline = P, e.data = D, e.tensor = T, e.zero = zero;
  const Placement at{P, D, T, m.nproc_per_node};
  const int mb = step.micro_batches;
  const double slowdown = std::max(1.0, double(m.nproc_per_node) / m.cores);
  e.compute_seconds = step.seconds_per_sequence * step.micro_batch * mb / (P * T) * slowdown;
  const double forward = e.compute_seconds / mb / 3, backward = 2 * forward;
  const double activation = kFloat * step.micro_batch * model.block_size * model.n_embd;
  // Per micro-batch on one stage: 2 all-reduces of the activations per block forward, 2 backward.
  const double blocks = double(model.n_layer) / P, one = machine_allreduce(activation, T, m);
  e.tensor_seconds = mb * 4 * blocks * one;
  double path = e.compute_seconds + e.tensor_seconds;
  if (P > 1) {
    pipe_core::ActionCosts costs;
    costs.forward = forward + 2 * blocks * one;
    costs.backward = backward + 2 * blocks * one;
    costs.transfer = activation_transfer(activation, at, m);
    const double makespan = pipe_core::simulate(pipe_core::make_schedule(pipe_core::ScheduleKind::one_f_one_b, P, mb), {costs}).makespan;
    const double tied = mb * tied_transfer(kFloat * model.vocab_size * model.n_embd / T, at, m);
    e.pipeline_seconds = makespan - path + tied;
    path = makespan + tied;
  }
  const double gradients = kFloat * model.parameters() / (P * T);
  const bool by_tensors = P > 1 || T > 1;  // ZeRO-1 by whole tensors: a broadcast after the step
  const double reduce = data_allreduce(gradients, at, m) * (zero == 3 ? 1.5 : 1);
  e.data_seconds = std::max(0.0, reduce - backward) + (zero == 1 && by_tensors ? reduce / 2 : 0);
  e.step_seconds = path + e.data_seconds;
  e.tokens_per_second = double(D) * mb * step.micro_batch * model.block_size / e.step_seconds;
  e.memory_bytes = memory_per_worker(model, step, e);
  e.fits = e.memory_bytes <= kMemoryHeadroom * m.memory_bytes / m.nproc_per_node;
  return e;
}

std::vector<int> divisors(int n) {
  std::vector<int> out;
  for (int k = 1; k <= n; ++k)
    if (n % k == 0) out.push_back(k);
  return out;
}

std::string gigabytes(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f GB", bytes / 1e9);
  return text;
}

}  // namespace

double PlanModel::parameters() const {
  const double h = n_embd;
  return double(vocab_size) * h + double(block_size) * h + n_layer * (12 * h * h + 13 * h) + 2 * h;
}

std::string LayoutEstimate::name() const {
  std::vector<std::string> dims;
  if (pipeline > 1) dims.push_back(std::to_string(pipeline) + " pipeline");
  if (data > 1 || (pipeline == 1 && tensor == 1))
    dims.push_back(std::to_string(data) + " data" + (zero > 0 ? " (ZeRO-" + std::to_string(zero) + ")" : ""));
  if (tensor > 1) dims.push_back(std::to_string(tensor) + " tensor");
  std::string out;
  for (std::size_t i = 0; i < dims.size(); ++i) out += (i ? " x " : "") + dims[i];
  return out;
}

std::vector<LayoutEstimate> plan_layouts(const PlanModel& model, const PlanMachines& machines, const PlanStep& step) {
  check_inputs(model, machines, step);
  const int world = machines.world(), units = model.n_layer + 2;  // embedding, blocks, head
  std::vector<LayoutEstimate> out;
  for (const int T : divisors(machines.nproc_per_node)) {
    if (model.n_head % T != 0 || model.vocab_size % T != 0) continue;
    for (const int P : divisors(world / T)) {
      if (P > units) continue;
      const int D = world / (T * P);
      const int top_zero = D == 1 ? 0 : (P == 1 ? 3 : 1);  // a pipeline takes ZeRO-1 alone
      for (int zero = 0; zero <= top_zero; ++zero) out.push_back(estimate(model, machines, step, P, D, T, zero));
    }
  }
  std::stable_sort(out.begin(), out.end(), [](const LayoutEstimate& a, const LayoutEstimate& b) {
    if (a.fits != b.fits) return a.fits;
    return a.tokens_per_second > b.tokens_per_second;
  });
  return out;
}

std::string describe_plan(const std::vector<LayoutEstimate>& ranked, const PlanMachines& machines, int top) {
  std::string out = "layouts for " + std::to_string(machines.world()) + " workers on " + std::to_string(machines.nodes) +
                    (machines.nodes == 1 ? " machine" : " machines") + ", fastest first (simulated):\n";
  char line[256];
  std::snprintf(line, sizeof line, "  %-36s %12s %9s %9s %9s %9s %9s %10s\n", "layout", "tokens/s", "step s",
                "compute", "pipeline", "tensor", "data", "memory");
  out += line;
  int shown = 0;
  for (const auto& e : ranked) {
    if (shown++ == top) break;
    std::snprintf(line, sizeof line, "  %-36s %12.0f %9.3f %9.3f %9.3f %9.3f %9.3f %10s%s\n", e.name().c_str(),
                  e.tokens_per_second, e.step_seconds, e.compute_seconds, e.pipeline_seconds, e.tensor_seconds,
                  e.data_seconds, gigabytes(e.memory_bytes).c_str(), e.fits ? "" : "  (does not fit)");
    out += line;
  }
  if (!ranked.empty() && ranked.front().fits)
    out += "first pick: " + ranked.front().name() + "\n";
  else
    out += "no layout fits a worker's memory: lower the micro-batch, or add machines\n";
  return out;
}

}  // namespace lockstep::doctor
