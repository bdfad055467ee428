// ElasticSampler: an epoch's samples dealt one optimiser step at a time over whatever ranks the
// job has at that step.
//
// Every rank derives the same permutation of 0..N-1 from (seed, epoch), as DistributedSampler
// does. A step takes the next `global_batch` positions of it (fewer at the epoch's end) and deals
// them over the world of that step, strided: rank r of W takes positions p + r, p + r + W, ...
// With a world that never changes this is DistributedSampler's dealing (without its padding: the
// last step is short). When the world changes between steps (an elastic job lost or gained
// ranks), the positions not consumed yet are dealt over the new one: every sample of the epoch is
// visited exactly once, and each step covers the same samples whatever the membership did, so a
// run that changed size computes the training of one that did not, up to float summation order.
//
// A step's shares differ by at most one sample between ranks when W does not divide the step; a
// rank may get none when the step is smaller than W. step_samples is the step's size over all
// ranks: weigh each sample's loss by W / step_samples and average over ranks, and the gradient is
// the mean over the step whatever the shares.
//
// Resumable: state() is (epoch, position), position counting the epoch's samples consumed by
// every rank together. Not thread-safe; one sampler per rank, all advanced at the same steps.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "lockstep/data/sampler.h"

namespace lockstep::data {

// One rank's part of one step.
struct StepShare {
  std::vector<std::size_t> indices;  // dataset indices for this rank, in order
  std::size_t step_samples = 0;      // the whole step's samples, over every rank
};

class ElasticSampler {
 public:
  // Throws ConfigError when global_batch is 0 or the dataset is empty.
  ElasticSampler(std::size_t dataset_size, std::size_t global_batch, bool shuffle = true, std::uint64_t seed = 0);

  // Selects the epoch's permutation and rewinds to its start.
  void set_epoch(std::uint64_t epoch);
  std::uint64_t epoch() const { return state_.epoch; }
  std::size_t dataset_size() const { return order_.size(); }
  std::size_t global_batch() const { return global_batch_; }
  std::size_t steps_per_epoch() const { return (order_.size() + global_batch_ - 1) / global_batch_; }
  bool epoch_done() const { return state_.position >= order_.size(); }

  // rank's share of the next step in a world of `world` ranks (ConfigError when rank is outside it).
  StepShare share(int rank, int world) const;
  // The step was taken by every rank: move past its samples.
  void advance();

  SamplerState state() const { return state_; }
  // ConfigError when the position is past the epoch (a checkpoint of another dataset).
  void load_state(const SamplerState& state);

 private:
  std::size_t step_size() const;

  std::size_t global_batch_;
  bool shuffle_;
  std::uint64_t seed_;
  std::vector<std::size_t> order_;
  SamplerState state_;
};

}  // namespace lockstep::data
