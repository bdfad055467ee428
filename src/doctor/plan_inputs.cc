// lockstep plan's inputs (doctor/plan.h): a one-worker run's measured step, and link speeds.
#include <cctype>
#include <fstream>
#include <nlohmann/json.hpp>

#include "lockstep/doctor/plan.h"
#include "lockstep/error.h"

namespace lockstep::doctor {

PlanStep step_of_run(const std::string& run_dir) {
  const std::string path = run_dir + "/metrics.jsonl";
  std::ifstream in(path);
  if (!in) throw ConfigError("lockstep plan: cannot read " + path + ": give the --output-dir of a finished run");
  PlanStep step;
  double seconds = 0, tensor_bytes = 0;
  int windows = 0, seen = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) throw ConfigError("lockstep plan: " + path + " holds a line that is not JSON");
    const std::string event = j.value("event", "");
    if (event == "train_begin") {
      if (j.value("world_size", 1) != 1)
        throw ConfigError("lockstep plan: " + path + " is a run of " + std::to_string(j.value("world_size", 1)) +
                          " workers; measure the step with one (lockstep run --nproc-per-node 1)");
      step.micro_batch = j.value("per_device_train_batch_size", 1);
      step.micro_batches = j.value("gradient_accumulation_steps", 1);
    } else if (event == "log" && j.contains("step_seconds") && seen++ > 0) {  // the first window warms up
      seconds += j["step_seconds"].get<double>();
      tensor_bytes = std::max(tensor_bytes, j.value("step_tensor_bytes", 0.0));
      ++windows;
    }
  }
  if (windows == 0)
    throw ConfigError("lockstep plan: " + path + " has no log window after the first: run more steps than 2 x "
                      "--logging-steps");
  const double sequences = double(step.micro_batch) * step.micro_batches;
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
