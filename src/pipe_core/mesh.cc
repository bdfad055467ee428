#include "lockstep/pipe_core/mesh.h"

#include "lockstep/error.h"

namespace lockstep::pipe_core {

PipelineMesh PipelineMesh::of(int world, int pipeline_parallel) {
  if (pipeline_parallel < 1)
    throw ConfigError("--pipeline-parallel must be at least 1 (got " + std::to_string(pipeline_parallel) + ")");
  if (world % pipeline_parallel != 0) {
    std::string divisors;
    for (int p = 1; p <= world; ++p)
      if (world % p == 0) divisors += (divisors.empty() ? "" : ", ") + std::to_string(p);
    throw ConfigError("--pipeline-parallel " + std::to_string(pipeline_parallel) + " does not divide the " +
                      std::to_string(world) + " workers of this job (world = pipeline ranks x replicas): use one of " +
                      divisors + ", or start " + std::to_string(pipeline_parallel) + " x N workers");
  }
  return PipelineMesh{pipeline_parallel, world / pipeline_parallel};
}

std::vector<int> PipelineMesh::stage_group(int pipeline_rank) const {
  std::vector<int> out;
  for (int d = 0; d < replicas; ++d) out.push_back(rank_at(pipeline_rank, d));
  return out;
}

std::vector<int> PipelineMesh::pipeline_group(int replica) const {
  std::vector<int> out;
  for (int p = 0; p < pipeline; ++p) out.push_back(rank_at(p, replica));
  return out;
}

std::string PipelineMesh::describe() const {
  return std::to_string(pipeline) + " pipeline rank" + (pipeline == 1 ? "" : "s") + " x " + std::to_string(replicas) +
         " replica" + (replicas == 1 ? "" : "s") + " (" + std::to_string(world()) + " workers)";
}

}  // namespace lockstep::pipe_core
