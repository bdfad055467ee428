// lockstep plan's inputs (doctor/plan.h): a one-worker run's measured step, and link speeds.
#include <algorithm>
#include <cctype>
#include <fstream>

#include "lockstep/doctor/plan.h"
#include "lockstep/error.h"
#include "lockstep/train_core/metrics.h"

namespace lockstep::doctor {

// The last start recorded in the run's metrics.jsonl (train_core/metrics.h reads and checks it).
PlanStep step_of_run(const std::string& run_dir) {
  const std::string path = run_dir + "/metrics.jsonl";
  if (!std::ifstream(path)) throw ConfigError("lockstep plan: cannot read " + path + ": give the --output-dir of a finished run");
  const auto segments = train::metrics::read_metrics(path);
  if (segments.empty() || !segments.back().begin)
    throw ConfigError("lockstep plan: " + path + " records no start of training (no train_begin line)");
  const train::metrics::Segment& run = segments.back();
  if (run.begin->world_size != 1)
    throw ConfigError("lockstep plan: " + path + " is a run of " + std::to_string(run.begin->world_size) +
                      " workers; measure the step with one (lockstep run --nproc-per-node 1)");
  PlanStep step;
  step.micro_batch = std::max(1, run.begin->per_device_train_batch_size);
  step.micro_batches = std::max(1, run.begin->gradient_accumulation_steps);
  double seconds = 0, tensor_bytes = 0;
  for (std::size_t i = 1; i < run.logs.size(); ++i) {  // the first window warms up
    seconds += run.logs[i].step_seconds;
    tensor_bytes = std::max(tensor_bytes, run.logs[i].step_tensor_bytes.value_or(0.0));
  }
  if (run.logs.size() < 2 || !(seconds > 0))
    throw ConfigError("lockstep plan: " + path + " has no timed log window after the first: run more steps than 2 x "
                      "--logging-steps");
  const double windows = double(run.logs.size() - 1), sequences = double(step.micro_batch) * step.micro_batches;
  step.seconds_per_sequence = seconds / windows / sequences;
  step.activation_bytes_per_sequence = tensor_bytes / step.micro_batch;  // one micro-batch's at a time
  return step;
}

double parse_rate(const std::string& rate) {
  std::size_t used = 0;
  double value = 0;
  try {
    value = std::stod(rate, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string unit = rate.substr(used);
  for (auto& c : unit) c = char(std::tolower(static_cast<unsigned char>(c)));
  const double scale = unit == "mbit" ? 1e6 / 8 : unit == "gbit" ? 1e9 / 8 : unit == "mb/s" ? 1e6 : unit == "gb/s" ? 1e9 : 0;
  if (used == 0 || scale == 0 || !(value > 0))
    throw ConfigError("lockstep plan: '" + rate + "' is not a rate: write it as 100mbit, 1gbit, 500MB/s or 2GB/s");
  return value * scale;
}

}  // namespace lockstep::doctor
