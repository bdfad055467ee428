// Where a tensor-parallel shard sits in its whole tensor: the offsets a checkpoint needs to hold
// whole tensors, and a loader of any layout to cut the part it wants.
//
// Every split Megatron-LM's plan makes is one range of one dimension, once the whole tensor is
// viewed the right way: a column-parallel weight [out, in] keeps rows [r*out/T, (r+1)*out/T); a
// row-parallel weight keeps columns; GPT-2's fused q, k, v weight [3C, C] keeps, viewed as
// [3, C, C], rows [r*C/T, (r+1)*C/T) of each of q, k and v. So a shard is (the whole shape, the
// view, the dimension, the range) and the shape the parameter holds.
//
//   const TensorShard s = TensorShard::of({3 * c, c}, {3, c, c}, 1, rank, ranks, {3 * c / ranks, c});
//   weight.set_data(s.take(weight));          // this rank's part of the whole
//   auto whole = s.gather(weight, group);     // collective: the whole again, on every rank
//
// Thread-safety: a value; gather is a collective of `group` (every rank, same order).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/comm/communicator.h"

namespace lockstep::tp {

struct TensorShard {
  std::vector<std::int64_t> whole;  // the whole tensor's shape
  std::vector<std::int64_t> view;   // the whole viewed so that the shard is a range of `dim`
  int dim = 0;
  std::int64_t start = 0, length = 0;  // the range of `dim` this rank keeps
  std::vector<std::int64_t> shape;     // what the parameter holds (the range, reshaped)

  // Rank `rank` of `ranks` equal ranges of `dim` of `whole` viewed as `view` (empty: as itself);
  // `shape` empty: the view's shape with the range's length at `dim`. ConfigError when `ranks` does
  // not divide the dimension.
  static TensorShard of(std::vector<std::int64_t> whole, std::vector<std::int64_t> view, int dim, int rank, int ranks,
                        std::vector<std::int64_t> shape = {});

  // This rank's part of `whole` (the whole tensor's shape), contiguous, of `shape`.
  torch::Tensor take(const torch::Tensor& whole) const;
  // Collective over the group whose ranks hold the shards in rank order: the whole tensor from
  // each rank's `part` (of `shape`), on every rank.
  torch::Tensor gather(const torch::Tensor& part, comm::Communicator& group) const;
  // "rows 16-31 of [64, 32] viewed as [2, 32, 32] along 1"
  std::string describe() const;
};

// A split model's shards: each parameter that holds part of a whole tensor, and where.
using ShardedParameters = std::vector<std::pair<torch::Tensor, TensorShard>>;

}  // namespace lockstep::tp
