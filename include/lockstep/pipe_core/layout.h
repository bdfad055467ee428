// The job's layout: how its workers split the model and the data, described once (as torchtitan's
// ParallelDims). world = pipeline (P) x data (D) x tensor (T); a context dimension is reserved and
// refused above 1. Built and validated once, from the flags and the machines; every group, the
// sampler's split and ZeRO's shards are derived from it, nowhere else.
//
// Ranks are numbered with the tensor dimension innermost and the pipeline outermost:
//     rank = (pipeline_rank * D + data_rank) * T + tensor_rank
// so a tensor group's T ranks are neighbours (one machine: they exchange activations every layer),
// a stage's data replicas come next (their gradients are reduced once a step), and pipeline ranks,
// which pass one micro-batch's activations at a time, go across machines. With T = 1 this is the
// numbering PipelineMesh has always used.
//
// Groups (each a list of world ranks, ascending, which is also the order of the group's ranks):
//   tensor    the T ranks with the same (pipeline, data) rank: they hold one layer's shards
//   data      the D ranks with the same (pipeline, tensor) rank: they reduce (or, under ZeRO, shard)
//             the same parameters' gradients, and read different samples
//   pipeline  the P ranks with the same (data, tensor) rank, first stage first
//   model     the P x T ranks with the same data rank: one whole replica of the model, over which the
//             global gradient norm and the step's loss are summed
//   mesh      the P x D ranks with the same tensor rank: the pipeline runtime's P x D mesh (one per
//             tensor rank, each running the same schedule over its shards), numbered p * D + d
//
// Immutable once built; safe to share between threads.
#pragma once

#include <string>
#include <vector>

#include "lockstep/pipe_core/mesh.h"

namespace lockstep {

// What the flags and the machines say; Layout::build checks it.
struct LayoutRequest {
  int world = 1;
  int pipeline_parallel = 1;  // --pipeline-parallel
  int tensor_parallel = 1;    // --tensor-parallel
  int context_parallel = 1;   // reserved: refused above 1 (not built)
  int zero_stage = 0;         // --zero-stage: the data dimension is sharded (1-3) or replicated (0)
  bool sequence_parallel = false;  // --sequence-parallel: needs T > 1
  std::vector<int> machine_of;     // rank -> machine (0, 0, 1, 1, ...); empty when unknown
};

enum class ParallelDim { pipeline, data, tensor, model, mesh };

class Layout {
 public:
  struct Coordinates {
    int pipeline = 0, data = 0, tensor = 0;
  };

  Layout() = default;  // one worker
  // ConfigError naming the flag, the numbers and what would work when the request cannot be laid
  // out: a degree below 1, a product that is not the world, a tensor group across machines, the
  // reserved context dimension, sequence parallelism without tensor parallelism.
  static Layout build(const LayoutRequest& request);

  int world() const { return pipeline_ * data_ * tensor_; }
  int pipeline() const { return pipeline_; }
  int data() const { return data_; }
  int tensor() const { return tensor_; }
  int zero_stage() const { return zero_stage_; }
  bool sequence_parallel() const { return sequence_parallel_; }
  int machines() const { return machines_; }
  bool pipelined() const { return pipeline_ > 1; }

  Coordinates coordinates_of(int rank) const;
  int rank_at(const Coordinates& c) const { return (c.pipeline * data_ + c.data) * tensor_ + c.tensor; }
  int data_rank_of(int rank) const { return coordinates_of(rank).data; }

  // The ranks of `rank`'s group along `dim` (see the file comment), ascending.
  std::vector<int> group_of(ParallelDim dim, int rank) const;
  // Every group along `dim`, each once, ordered by its lowest rank.
  std::vector<std::vector<int>> groups(ParallelDim dim) const;
  // A name for `rank`'s group along `dim`, the same on each of its members and different for every
  // other group ("tensor/p0-d1"): the name Communicator::group takes.
  std::string group_name(ParallelDim dim, int rank) const;

  // Whether every data group sits inside one machine: ZeRO's one copy per machine then holds a
  // whole replica's parameters in that machine's memory (unknown machines: false).
  bool data_groups_within_machines() const;
  // The pipeline's 2-D view (P x D): of the whole world when T = 1, else of each tensor rank's
  // mesh group (ParallelDim::mesh), whose rank p * D + d is the world's rank_at({p, d, t}).
  pipe_core::PipelineMesh pipeline_mesh() const;

  // "8 workers on 2 machines: 2 pipeline x 2 data (ZeRO-1) x 2 tensor (sequence parallel)";
  // dimensions of size 1 are left out ("1 worker" alone when every one is).
  std::string describe() const;

 private:
  int pipeline_ = 1, data_ = 1, tensor_ = 1, zero_stage_ = 0, machines_ = 1;
  bool sequence_parallel_ = false;
  std::vector<int> machine_of_;
};

const char* dim_name(ParallelDim dim);

}  // namespace lockstep
