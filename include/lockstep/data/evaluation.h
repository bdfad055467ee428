// Distributed evaluation: each rank sums loss and correct predictions over the samples it saw,
// skipping the padding its DistributedSampler added (is_padding), and one allreduce combines the
// ranks. Every real sample of the dataset is then counted exactly once, whatever the world size.
#pragma once

#include <cstdint>

#include "lockstep/comm/communicator.h"

namespace lockstep::data {

struct EvalTotals {
  double loss_sum = 0;      // summed over every target (a sample's label, or every token of it)
  std::int64_t correct = 0; // targets predicted right
  std::int64_t count = 0;   // targets
  std::int64_t samples = 0; // samples (equal to count unless each sample has several targets)
  double accuracy() const { return count ? static_cast<double>(correct) / static_cast<double>(count) : 0.0; }
  double mean_loss() const { return count ? loss_sum / static_cast<double>(count) : 0.0; }
};

// Collective: sums every rank's totals (one allreduce of four f64; counts stay exact below 2^53).
EvalTotals allreduce_totals(comm::Communicator& comm, const EvalTotals& local);

}  // namespace lockstep::data
