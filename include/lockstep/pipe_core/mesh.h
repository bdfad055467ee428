// The 2-D layout of a pipelined job: world = P pipeline ranks x D replicas, described once, from
// which every group and split is derived (as torchtitan's ParallelDims).
//
// Ranks are numbered stage-major: rank = pipeline_rank * D + replica. A pipeline rank's D replicas
// are neighbours, so on machines of D workers each machine holds one pipeline rank: its gradients
// are reduced inside the machine (shared memory), and only activations and their gradients, one
// micro-batch at a time, cross between machines. Groups:
//   stage group      the D ranks holding the same pipeline rank: they reduce its gradients (DDP)
//   pipeline group   the P ranks of one replica, in pipeline order: activations flow along it, and
//                    the global gradient norm and the step's loss are summed over it
// The data is split over the D replicas: every pipeline rank of replica d reads replica d's samples.
#pragma once

#include <string>
#include <vector>

namespace lockstep::pipe_core {

struct PipelineMesh {
  int pipeline = 1;  // P
  int replicas = 1;  // D

  // ConfigError when P is below 1 or does not divide the world, naming both and what would work.
  static PipelineMesh of(int world, int pipeline_parallel);

  int world() const { return pipeline * replicas; }
  int pipeline_rank_of(int rank) const { return rank / replicas; }
  int replica_of(int rank) const { return rank % replicas; }
  int rank_at(int pipeline_rank, int replica) const { return pipeline_rank * replicas + replica; }
  std::vector<int> stage_group(int pipeline_rank) const;  // D ranks
  std::vector<int> pipeline_group(int replica) const;     // P ranks, first stage first
  std::string describe() const;  // "2 pipeline ranks x 3 replicas (6 workers)"
};

}  // namespace lockstep::pipe_core
