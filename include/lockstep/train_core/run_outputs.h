// What a Trainer run writes in --output-dir besides checkpoints: metrics.jsonl (rank 0) and,
// with --trace, trace/rank_N.json (every rank). Torch-free.
//
// Opening removes the .tmp-checkpoint-* directories a killed save left (rank 0). A line that
// cannot be written (a full disk) is a StorageError naming the file, not a silent gap.
#pragma once

#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "lockstep/train_core/trace.h"

namespace lockstep::train {

class RunOutputs {
 public:
  // ConfigError when the directory cannot be created or written.
  RunOutputs(const std::string& output_dir, int rank, bool trace);
  ~RunOutputs();
  RunOutputs(const RunOutputs&) = delete;
  RunOutputs& operator=(const RunOutputs&) = delete;

  // Appends one line to metrics.jsonl on rank 0 (other ranks: nothing).
  void record(const nlohmann::json& line);
  // This process's rank changed (an elastic job's membership did): rank 0 writes metrics.jsonl.
  void set_rank(int rank);
  // This rank's trace, or nullptr without --trace.
  TraceWriter* trace() { return trace_.get(); }

 private:
  std::string metrics_path_;
  int metrics_fd_ = -1;
  std::unique_ptr<TraceWriter> trace_;
};

}  // namespace lockstep::train
