// Dropout whose mask costs a hash per four elements instead of a generator call per element.
//
// libtorch's CPU dropout draws every element's Bernoulli sample from the Mersenne Twister, one
// call at a time: in the 512-wide GPT under bf16 autocast that was 16% of the step (the
// attention probabilities alone are B x H x T x T elements), more than all the batched products.
// Here one 64-bit seed is drawn from the default CPU generator per call (so a restored
// generator state, as in gradient checkpointing's replay or a resumed run, gives the same masks)
// and element i keeps its value when 16 bits of splitmix64(seed, i / 4) reach a threshold. The
// drop probability is p rounded to a multiple of 1/65536 and the kept values are scaled by the
// exact inverse of the keep probability, so the expectation of every element is unchanged.
// A tensor on a GPU takes libtorch's own dropout (the GPU's kernel and generator).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace lockstep::models {

// For its scope on this thread, each fast_dropout call's mask seed comes from `seed` (the n-th
// call's: a hash of seed and n) instead of the default CPU generator: a model unit's masks then
// depend on the seed it was given, not on what ran before it on this process. How a GPT's units
// get the same masks on a pipeline stage as in one process (pipe/units.h). Scopes nest.
class DropoutSeeds {
 public:
  explicit DropoutSeeds(std::uint64_t seed);
  ~DropoutSeeds();
  DropoutSeeds(const DropoutSeeds&) = delete;
  DropoutSeeds& operator=(const DropoutSeeds&) = delete;
  std::uint64_t next();

 private:
  std::uint64_t seed_, calls_ = 0;
  DropoutSeeds* outer_;
};

// x unchanged when not training or p is 0; zeros when p is 1; else x times a mask of zeros and
// 1/(1-p), in x's dtype, which autograd keeps for backward. ConfigError for p outside [0, 1].
torch::Tensor fast_dropout(const torch::Tensor& x, double p, bool training);

// Where a tensor sits in the whole one it was cut from (a tensor-parallel shard: a block of
// columns, a slice of the sequence): the whole's sizes, and the shard's offset along each of them.
struct ShardOf {
  std::vector<std::int64_t> whole_sizes, offsets;
  // `shard` as slice `index` of `slices` equal ones along `dim` (a tensor-parallel rank's shard of
  // the sequence, or of the heads).
  static ShardOf slice(const torch::Tensor& shard, std::int64_t dim, std::int64_t index, std::int64_t slices);
};

// fast_dropout of the whole tensor, kept to `x`, a shard of it: each element gets the mask its
// place in the whole has under the call's seed (one draw, as fast_dropout), so ranks that hold
// shards of one tensor, and drew the same seed, apply one process's mask between them.
// ConfigError when the shard does not lie inside the whole.
torch::Tensor fast_dropout_shard(const torch::Tensor& x, double p, bool training, const ShardOf& where);

// residual + fast_dropout(x, p, training): the same values to the bit, the same mask from the same
// generator state, in one pass forward and one back, where the two steps took four passes and a
// stored mask (the mask is recomputed from its seed in backward). Elsewhere (a GPU, shapes that
// broadcast, a sum in a wider type than residual's) the two steps as written.
torch::Tensor fast_dropout_add(const torch::Tensor& residual, const torch::Tensor& x, double p,
                               bool training);

}  // namespace lockstep::models
