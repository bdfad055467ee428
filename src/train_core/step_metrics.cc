#include "lockstep/train_core/step_metrics.h"

#include <algorithm>
#include <vector>

#include "lockstep/train_core/straggler.h"

namespace lockstep::train {

void LogWindow::add_loss(double mean_loss, double count) {
  local_.loss_sum += mean_loss * count;
  local_.loss_count += count;
}

void LogWindow::add_step(const StepTimes& t, double samples_all_ranks, double bytes, int buckets) {
  ++steps_;
  samples_ += samples_all_ranks;
  bytes_ += bytes;
  buckets_ += buckets;
  local_.data += t.data;
  local_.forward += t.forward;
  local_.backward += t.backward;
  local_.exposed_comm += t.exposed_comm;
  local_.comm += t.comm;
  local_.optimizer += t.optimizer;
  local_.total += t.total;
}

double LogWindow::local_mean_loss() const {
  return local_.loss_count > 0 ? local_.loss_sum / local_.loss_count : 0;
}

double LogWindow::local_samples_per_second() const {
  return samples_ / std::max(1e-9, std::chrono::duration<double>(Clock::now() - begin_).count());
}

double LogWindow::local_tokens_per_second(int world) const {
  return local_.tokens * world / std::max(1e-9, std::chrono::duration<double>(Clock::now() - begin_).count());
}

namespace {

// Collective: every rank's data and compute seconds per step, gathered, and the straggler if
// one stands out.
std::optional<Straggler> straggler_among(comm::Communicator& comm, const WindowSums& mine, double steps) {
  if (comm.size() < 2) return std::nullopt;
  const double local[3] = {mine.data / steps, (mine.forward + mine.backward + mine.optimizer) / steps,
                           mine.total / steps};
  std::vector<double> all(3 * static_cast<std::size_t>(comm.size()));
  comm.allgather(local, all.data(), 3, comm::DType::f64)->wait();
  std::vector<RankBusy> ranks;
  for (std::size_t r = 0; r < all.size(); r += 3) ranks.push_back({all[r], all[r + 1], all[r + 2]});
  return find_straggler(ranks);
}

}  // namespace

metrics::StepLog LogWindow::summarise(comm::Communicator& comm, bool find_straggler) const {
  // One end for the window's rates, taken before the collectives below (whose waits are not the
  // window's): samples/s and tokens/s over the same seconds.
  const double wall = std::max(1e-9, std::chrono::duration<double>(Clock::now() - begin_).count());
  global_ = local_;
  comm.allreduce(&global_, sizeof(WindowSums) / sizeof(double), comm::DType::f64, comm::ReduceOp::sum)
      ->wait();
  const double ranks_x_steps =
      static_cast<double>(comm.size()) * static_cast<double>(std::max<std::int64_t>(1, steps_));
  const double steps = static_cast<double>(std::max<std::int64_t>(1, steps_));
  metrics::StepLog r;
  r.loss = global_.loss_count > 0 ? global_.loss_sum / global_.loss_count : 0;
  r.samples_per_second = samples_ / wall;
  r.world_size = comm.size();
  r.step_seconds = global_.total / ranks_x_steps;
  r.data_seconds = global_.data / ranks_x_steps;
  r.forward_seconds = global_.forward / ranks_x_steps;
  r.backward_seconds = global_.backward / ranks_x_steps;
  r.exposed_comm_seconds = global_.exposed_comm / ranks_x_steps;
  r.comm_seconds = global_.comm / ranks_x_steps;
  r.optimizer_seconds = global_.optimizer / ranks_x_steps;
  r.exposed_comm_fraction = global_.total > 0 ? global_.exposed_comm / global_.total : 0.0;
  r.allreduce_bytes_per_step = bytes_ / steps;
  r.buckets_per_step = buckets_ / steps;
  if (grad_norm_ >= 0) r.grad_norm = grad_norm_;
  if (auto s = find_straggler ? straggler_among(comm, local_, steps) : std::nullopt) {
    r.straggler_rank = s->rank;
    r.straggler = s->describe();
  }
  if (global_.tokens > 0) r.tokens_per_second = global_.tokens / wall;
  return r;
}

}  // namespace lockstep::train
