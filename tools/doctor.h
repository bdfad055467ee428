// lockstep doctor: why N workers are or are not N times faster than one.
//
// It runs the user's Trainer-based program (by default the Fashion-MNIST example) for a short
// measured segment with 1 worker and with N, through `lockstep run`, reads the step-time
// breakdown each run wrote to metrics.jsonl, measures `lockstep bench allreduce` on the same
// backend for the bucket size the run used, and turns the numbers into findings ranked by the
// share of the step they would save. The analysis (diagnose) is a pure function, tested on
// numbers whose right answer is known.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace lockstep::tools {

// Per-step averages of one measured run (first logging window dropped as warm-up).
struct Segment {
  int world = 1, threads = 1, cores = 1, per_device = 0, accumulation = 1, loader_workers = 0;
  std::string backend, comm_hook = "none";
  std::string blas_core, blas_best_core;  // OpenBLAS's kernels in use, and the CPU's best
  bool blas_forced = false;               // ... chosen with OPENBLAS_CORETYPE
  double samples_per_second = 0;
  double step = 0, data = 0, forward = 0, backward = 0, exposed = 0, comm = 0, optimizer = 0;
  double bytes_per_step = 0, buckets_per_step = 0;
  int windows = 0;  // logging windows averaged
  double other() const;
  double compute() const { return forward + backward; }
  nlohmann::json to_json() const;
};

// Reads OUTPUT_DIR/metrics.jsonl of a Trainer run. Throws ConfigError when there is nothing to
// measure (too few logged steps), naming the file.
Segment read_segment(const std::string& metrics_path);

struct Finding {
  std::string kind;            // blas | threads | data | batch | compression | scheduling | compute
  std::string problem;         // what the numbers show
  std::string action;          // what to change, concretely
  std::string predicted;       // the predicted effect
  double saving = 0;           // predicted share of the N-worker step saved (ranks the findings)
  bool recommendation = true;  // false: a note that explains, with nothing to change
};

// `bench_gbps`: lockstep bench's algorithm bandwidth for the run's bucket size on its backend,
// or 0 when not measured. `blas_speedup`: 1-worker samples/s with OPENBLAS_CORETYPE set to the
// CPU's best kernels over without, when the doctor measured it (0: not measured).
std::vector<Finding> diagnose(const Segment& one, const Segment& many, double bench_gbps,
                              double blas_speedup = 0);
double scaling_efficiency(const Segment& one, const Segment& many);
double training_gbps(const Segment& many);  // bytes all-reduced / time spent all-reducing

std::string format_report(const Segment& one, const Segment& many, double bench_gbps,
                          const std::vector<Finding>& findings);
nlohmann::json findings_json(const Segment& one, const Segment& many, double bench_gbps,
                             const std::vector<Finding>& findings);

struct DoctorOptions {
  int nproc = 2;
  int steps = 30;   // optimiser steps per run
  int window = 10;  // logging window; the first is warm-up
  std::string backend = "auto";
  std::string output_dir;            // empty: a fresh directory under /tmp
  std::vector<std::string> program;  // PROGRAM ARGS...; empty: the Fashion-MNIST example
};

// Runs both segments and the bench, prints the report, writes OUTPUT_DIR/doctor.json.
int run_doctor(const DoctorOptions& options);

}  // namespace lockstep::tools
