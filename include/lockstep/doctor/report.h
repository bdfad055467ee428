// lockstep report: one self-contained HTML page for a training run.
//
// Reads RUN_DIR/metrics.jsonl (the Trainer's log), RUN_DIR/trace/rank_N.json when the run used
// --trace, and RUN_DIR/doctor.json when lockstep doctor wrote one, and writes an HTML file with
// inline SVG charts and tables: no scripts, no network, opens from disk in any browser.
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/doctor/doctor.h"
#include "lockstep/train_core/metrics.h"

namespace lockstep::doctor {

struct RankTimes {  // per optimiser step, from a rank's Chrome trace
  int steps = 0;
  double data = 0, forward = 0, backward = 0, optimizer = 0, allreduce_busy = 0;
};

// What lockstep doctor wrote (doctor.json).
struct DoctorRecord {
  Evidence evidence;
  double scaling_efficiency = 0, training_gbps = 0;
  std::vector<Finding> findings;
};

struct RunData {
  std::string dir;
  std::optional<train::metrics::TrainBegin> begin;  // of the first start
  std::vector<train::metrics::StepLog> logs;        // every start's, in order
  std::vector<train::metrics::EvalLog> evals;
  std::vector<train::metrics::MembershipChangeLog> membership_changes;  // an elastic job's
  std::map<int, RankTimes> ranks;  // from traces
  std::optional<DoctorRecord> doctor;
};

// Throws ConfigError naming the directory when it holds no metrics.jsonl.
RunData load_run(const std::string& dir, const std::string& doctor_json = "");
std::string render_html(const RunData& run);
// Writes the page (default RUN_DIR/report.html) and returns its path.
std::string write_report(const std::string& dir, const std::string& output = "",
                         const std::string& doctor_json = "");

}  // namespace lockstep::doctor
