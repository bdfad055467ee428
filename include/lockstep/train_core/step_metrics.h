// What a training step costs, by part, and the logging window that averages it over steps and
// ranks into a metrics.jsonl "log" record. Torch-free.
//
// Threading: one window per Trainer, on its training thread.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>

#include "lockstep/base/clock.h"
#include "lockstep/comm/communicator.h"
#include "lockstep/train_core/metrics.h"

namespace lockstep::train {


// One optimiser step on one rank, in seconds.
struct StepTimes {
  double data = 0;          // waiting for batches
  double forward = 0;       // forward and loss
  double backward = 0;      // backward compute (communication it hid included, exposed excluded)
  double exposed_comm = 0;  // backward's end waiting for the gradient all-reduce, and forward's start
                            // for the buffers' broadcast (it waits for every rank)
  double comm = 0;          // all-reduce run time, overlapped or not
  double buffer_sync = 0;   // the buffers' broadcast part of exposed_comm
  double optimizer = 0;     // clipping and the optimiser
  double total = 0;         // the whole step
};

// The numbers every rank contributes to a log line. Plain doubles, so one f64 allreduce sums
// them field by field.
struct WindowSums {
  double loss_sum = 0, loss_count = 0;
  double data = 0, forward = 0, backward = 0, exposed_comm = 0, comm = 0, optimizer = 0, total = 0;
  double tokens = 0;  // target tokens (per-token tasks; 0 otherwise)
};
static_assert(sizeof(WindowSums) == 10 * sizeof(double), "WindowSums is all-reduced as 10 doubles");

class LogWindow {
 public:
  // One micro-batch's mean loss over `count` targets (samples, or tokens).
  void add_loss(double mean_loss, double count);
  void add_tokens(double tokens) { local_.tokens += tokens; }
  // A finished step: its times, the samples it took on all ranks, and what it all-reduced.
  void add_step(const StepTimes& times, double samples_all_ranks, double bytes, int buckets);
  void set_grad_norm(double norm) { grad_norm_ = norm; }
  // How much this rank's tensor memory grew within a step, start to peak; the window keeps the most.
  void add_step_tensor_bytes(double bytes) { step_tensor_bytes_ = std::max(step_tensor_bytes_, bytes); }
  double step_tensor_bytes() const { return step_tensor_bytes_; }
  // Time spent on evaluation or saving does not count as training time.
  void exclude(Clock::duration paused) { begin_ += paused; }

  std::int64_t steps() const { return steps_; }
  double local_mean_loss() const;
  double local_samples_per_second() const;
  // This rank's tokens per second times the world size (0 when the task is not per token).
  double local_tokens_per_second(int world) const;

  // Collective: one allreduce of every rank's sums; the record's loss is the mean over samples
  // on all ranks, its times the means over steps and ranks. step, epoch and learning_rate are
  // the caller's to fill.
  // find_straggler false: ranks that differ by design (a pipeline's stages) are not compared.
  metrics::StepLog summarise(comm::Communicator& comm, bool find_straggler = true) const;
  // The summed losses of every rank (valid after summarise), for the run's mean loss.
  const WindowSums& global_sums() const { return global_; }

 private:
  WindowSums local_;
  mutable WindowSums global_;
  std::int64_t steps_ = 0;
  double samples_ = 0;  // all ranks
  double bytes_ = 0, buckets_ = 0;
  double grad_norm_ = -1;  // < 0: not measured
  double step_tensor_bytes_ = 0;
  Clock::time_point begin_ = Clock::now();
};

}  // namespace lockstep::train
