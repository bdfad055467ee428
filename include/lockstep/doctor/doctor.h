// lockstep doctor: why N workers are or are not N times faster than one.
//
// It runs the user's Trainer-based program (by default the Fashion-MNIST example) for a short
// measured segment with 1 worker and with N, through `lockstep run`, reads the step-time
// breakdown each run wrote to metrics.jsonl, measures `lockstep bench allreduce` on the same
// backend for the bucket size the run used, and turns the numbers into findings ranked by the
// share of the step they would save. The analysis (diagnose) is a pure function of the two
// summaries, one rule per kind of finding, tested on numbers whose right answer is known.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace lockstep::doctor {

// Per-step averages of one measured run (first logging window dropped as warm-up).
struct RunSummary {
  int world = 1, threads = 1, cores = 1, per_device = 0, accumulation = 1, loader_workers = 0;
  std::string backend, comm_hook = "none";
  int sync_every = 1;  // local SGD: steps between the machines' meetings
  std::string blas_core, blas_best_core;  // OpenBLAS's kernels in use, and the CPU's best
  bool blas_forced = false;               // ... chosen with OPENBLAS_CORETYPE
  bool blas_by_launcher = false;          // ... which lockstep run set, OpenBLAS's own pick
  std::string blas_own_core;              // (this) being below the CPU's best
  double samples_per_second = 0;
  double step = 0, data = 0, forward = 0, backward = 0, exposed = 0, comm = 0, optimizer = 0;
  double bytes_per_step = 0, buckets_per_step = 0;
  int machines = 1;
  double network_bytes = 0, network_seconds = 0;  // per step, rank 0: what crossed the network
  int windows = 0;                                // logging windows averaged
  int zero_stage = 0;
  double optimizer_state_bytes = 0;  // what each worker holds (train_begin)
  double peak_rss_bytes = 0;         // rank 0's high-water mark, at the last window
  // The rank the Trainer named as the straggler in at least half of the measured windows (-1:
  // none), and the Trainer's words for the last of them.
  int straggler_rank = -1;
  std::string straggler;
  // The run's precision, its model FLOPs, and the matmul rates each worker measured at the model's
  // shapes (train_core/matmuls.h); 0 where unknown or not measured.
  bool bf16 = false;
  double model_flops_per_sample = 0, matmul_fp32 = 0, matmul_bf16 = 0;
  // --pipeline-parallel: P, the schedule, micro-batches per step, and per pipeline rank its bubble
  // (measured, and what the schedule gives with the measured action times), compute and waits.
  int pipeline = 1, micro_batches = 0;
  std::string pipeline_schedule;
  std::vector<double> bubble, bubble_analytic, stage_compute, stage_wait, stage_send;
  double model_flops_per_worker() const { return world > 0 ? model_flops_per_sample * samples_per_second / world : 0; }
  double matmul_rate() const { return bf16 ? matmul_bf16 : matmul_fp32; }  // at the run's precision
  double mfu() const { return matmul_rate() > 0 ? model_flops_per_worker() / matmul_rate() : 0; }
  double network_gbps() const { return network_seconds > 0 ? network_bytes / network_seconds / 1e9 : 0; }
  double other() const;
  double compute() const { return forward + backward; }
  nlohmann::json to_json() const;  // doctor.json's "one" and "many"
  static RunSummary from_json(const nlohmann::json& j);
};

// Reads OUTPUT_DIR/metrics.jsonl of a Trainer run (its last start). Throws ConfigError when
// there is nothing to measure (too few logged steps), naming the file.
RunSummary read_summary(const std::string& metrics_path);

struct Finding {
  std::string kind;            // blas | threads | straggler | slow_link | data | batch | link | compression | scheduling | zero | compute | pipeline
  std::string problem;         // what the numbers show
  std::string action;          // what to change, concretely
  std::string predicted;       // the predicted effect
  double saving = 0;           // predicted share of the N-worker step saved (ranks the findings)
  bool recommendation = true;  // false: a note that explains, with nothing to change
  nlohmann::json to_json() const;
  static Finding from_json(const nlohmann::json& j);
};

// What diagnose() looks at: the 1-worker and N-worker runs, and two measurements the doctor
// takes beside them.
struct Evidence {
  RunSummary one, many;
  // lockstep bench's algorithm bandwidth for the run's bucket size on its backend; 0: not measured.
  double bench_gbps = 0;
  // ... and what its network transport carried meanwhile (several machines): the link's speed
  // as the all-reduce sees it. 0: not measured or one machine.
  double bench_network_gbps = 0;
  // Each machine's link out timed alone (lockstep bench --links), GB/s by machine; empty: one
  // machine or not measured.
  std::vector<double> link_out_gbps;
  // 1-worker samples/s with OPENBLAS_CORETYPE set to the CPU's best kernels over without; 0: not
  // measured.
  double blas_speedup = 0;
};

// Every rule's finding, recommendations first (oversubscription before the rest, since it
// distorts every other number), then by predicted saving; notes last.
std::vector<Finding> diagnose(const Evidence& evidence);
double scaling_efficiency(const RunSummary& one, const RunSummary& many);
double training_gbps(const RunSummary& many);  // bytes all-reduced / time spent all-reducing

std::string format_report(const Evidence& evidence, const std::vector<Finding>& findings);
nlohmann::json findings_json(const Evidence& evidence, const std::vector<Finding>& findings);

struct DoctorOptions {
  int nproc = 2;  // workers per machine in the N-worker run
  // Several machines: run `lockstep doctor` with the same options on every machine, each with
  // its --node-rank; the 1-worker baseline runs on machine 0, which prints the report.
  int nnodes = 1, node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  int steps = 30;   // optimiser steps per run
  int window = 10;  // logging window; the first is warm-up
  std::string backend = "auto";
  std::string output_dir;            // empty: a fresh directory under /tmp
  std::vector<std::string> program;  // PROGRAM ARGS...; empty: the Fashion-MNIST example
};

// Runs both segments and the bench, prints the report, writes OUTPUT_DIR/doctor.json.
int run_doctor(const DoctorOptions& options);

}  // namespace lockstep::doctor
