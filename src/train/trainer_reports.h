// What the Trainer reports, and where: rank 0's first lines, the train_begin record the doctor
// reads, each logging window's metrics.jsonl line and progress line, and the trace.
//
// It owns the run's output files (RunOutputs: metrics.jsonl on rank 0, each rank's trace) and the
// FLOP rates measured when the run starts (what the log's mfu comes from). It reads the run (its
// arguments, position and communicator) and the step's parts (ZeRO's memory, the pipeline's plan,
// the loss scale), and writes none of them; a window's line goes into the log history through the
// run's log().
//
// Threading: the training thread only. announce() and a window's line are collective.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "lockstep/train/trainer.h"
#include "lockstep/train_core/blas.h"
#include "lockstep/train_core/metrics.h"
#include "lockstep/train_core/run_outputs.h"

namespace lockstep::train {

struct RunProgress;

// The model's FLOPs per sample and the rates this worker multiplies at (0: not measured): what
// the log's model_flops_per_second and mfu come from.
struct RunFlops {
  std::optional<double> per_sample;
  double fp32_rate = 0, bf16_rate = 0;
};

class TrainerReports {
 public:
  explicit TrainerReports(Trainer::Impl& run);
  ~TrainerReports();
  TrainerReports(const TrainerReports&) = delete;
  TrainerReports& operator=(const TrainerReports&) = delete;

  // This rank's outputs under --output-dir, opened before anything is recorded.
  void open();
  bool opened() const { return outputs_ != nullptr; }
  // After an elastic membership change: this process's new rank (rank 0 writes metrics.jsonl).
  void set_rank(int rank) { outputs_->set_rank(rank); }
  TraceWriter* trace() const { return outputs_ ? outputs_->trace() : nullptr; }
  // Rank 0 appends `line` to metrics.jsonl (the others nothing).
  void record(const nlohmann::json& line) { outputs_->record(line); }

  // Collective in effect (every rank measures the FLOP rates at once, sharing the cores as
  // training will): rank 0's first lines and the train_begin record.
  void announce();
  // After a step: the window's line when it is due (collective: every rank calls it alike), else
  // the progress bar on a terminal.
  void log_or_show_progress(bool last, RunProgress& run);

 private:
  RunFlops count_flops() const;
  void log_modes() const;
  metrics::TrainBegin train_begin_record(const BlasInfo& blas) const;
  void log_window(RunProgress& run);
  void show_progress(double loss, const std::string& rate, double exposed_fraction, const RunProgress& run);

  Trainer::Impl& run_;
  std::unique_ptr<RunOutputs> outputs_;
  RunFlops flops_;
};

}  // namespace lockstep::train
