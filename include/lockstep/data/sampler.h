// DistributedSampler: which dataset indices this rank visits in an epoch.
//
// Every rank computes the same permutation of 0..N-1 from (seed, epoch), with no communication,
// then takes every world_size-th index starting at its rank. Without drop_last the list is padded
// by repeating from its start to a multiple of world_size (each rank gets ceil(N/R) indices; the
// repeats are "padding", which distributed evaluation must not count twice); with drop_last it is
// trimmed (floor(N/R) each). These counts are PyTorch's. The permutation itself differs from
// PyTorch's (which uses torch.randperm with a torch.Generator): ours is a Fisher-Yates shuffle
// driven by a 64-bit SplitMix/xoshiro generator with an unbiased bounded draw, the same on every
// platform and standard library.
//
// Resumable: state() is (epoch, position, offset) and load_state() continues exactly after the
// last index handed out, at once (nothing is replayed). At another world size: the first
// consumed_in_epoch() indices of the epoch's permutation were taken by the old world; a sampler
// given that as its offset deals the rest of the permutation (from there, padded to a multiple of
// its own world) over its ranks, so each remaining sample of the epoch is taken exactly once.
//
// Not thread-safe; one sampler per rank.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace lockstep::data {

struct SamplerState {
  std::uint64_t epoch = 0;
  std::size_t position = 0;  // indices of this epoch already handed out (by this rank)
  std::size_t offset = 0;    // indices of the epoch's permutation taken before this world began it
};

// Indices of the epoch's permutation taken so far by all `world` ranks together (at most the
// dataset's size): where a sampler of another world size continues the epoch from.
std::size_t consumed_in_epoch(const SamplerState& state, int world, std::size_t dataset_size);

class DistributedSampler {
 public:
  // Throws ConfigError when rank is not in 0..world_size-1 or world_size < 1.
  DistributedSampler(std::size_t dataset_size, int rank, int world_size, bool shuffle = true,
                     std::uint64_t seed = 0, bool drop_last = false);

  // Selects the epoch's permutation and rewinds to its start.
  void set_epoch(std::uint64_t epoch);
  std::uint64_t epoch() const { return state_.epoch; }

  // Indices per rank per epoch: ceil(N/R), or floor(N/R) with drop_last (N less the offset).
  std::size_t num_samples() const { return num_samples_; }
  // This rank's whole list for the current epoch (padding included).
  const std::vector<std::size_t>& indices() const { return indices_; }
  // The indices not handed out yet, from position() on.
  std::vector<std::size_t> remaining() const;
  // Hands out up to `n` more indices and advances the position.
  std::vector<std::size_t> take(std::size_t n);
  // Whether this rank's k-th index of the epoch is a repeat added as padding.
  bool is_padding(std::size_t k) const;
  // This rank's indices that are not padding.
  std::size_t real_count() const;

  SamplerState state() const { return state_; }
  void load_state(const SamplerState& state);

 private:
  void build();

  std::size_t dataset_size_;
  int rank_, world_size_;
  bool shuffle_, drop_last_;
  std::uint64_t seed_;
  std::size_t num_samples_ = 0;
  std::vector<std::size_t> indices_;
  SamplerState state_;
};

// The permutation of 0..n-1 every rank derives from (seed, epoch).
std::vector<std::size_t> epoch_permutation(std::size_t n, std::uint64_t seed, std::uint64_t epoch);

}  // namespace lockstep::data
