#include "lockstep/pipe_core/layout.h"

#include <algorithm>
#include <set>

#include "lockstep/error.h"

namespace lockstep {
namespace {

std::string join(const std::vector<int>& v, const char* sep = ",") {
  std::string out;
  for (const int x : v) out += (out.empty() ? "" : sep) + std::to_string(x);
  return out;
}

void check_degree(const char* flag, int degree) {
  if (degree < 1) throw ConfigError(std::string(flag) + " must be at least 1 (got " + std::to_string(degree) + ")");
}

// P x T must divide the world: the data dimension takes what is left.
void check_product(const LayoutRequest& r) {
  const int split = r.pipeline_parallel * r.tensor_parallel;
  if (r.world % split == 0) return;
  std::string fits;
  for (int t = 1; t <= r.world; ++t)
    if (r.world % (r.pipeline_parallel * t) == 0) fits += (fits.empty() ? "" : ", ") + std::to_string(t);
  throw ConfigError("--pipeline-parallel " + std::to_string(r.pipeline_parallel) + " x --tensor-parallel " +
                    std::to_string(r.tensor_parallel) + " = " + std::to_string(split) + " does not divide the " +
                    std::to_string(r.world) + " workers of this job (world = pipeline x data x tensor): " +
                    (fits.empty() ? "lower --pipeline-parallel"
                                  : "with this --pipeline-parallel, --tensor-parallel may be " + fits) +
                    ", or start a multiple of " + std::to_string(split) + " workers");
}

// A tensor group exchanges activations in every layer: it must share a machine's memory.
void check_tensor_groups(const Layout& layout, const std::vector<int>& machine_of) {
  if (machine_of.empty() || layout.tensor() == 1) return;
  for (const auto& group : layout.groups(ParallelDim::tensor)) {
    std::set<int> on;
    for (const int r : group) on.insert(machine_of[static_cast<std::size_t>(r)]);
    if (on.size() == 1) continue;
    std::vector<int> machines(on.begin(), on.end());
    throw ConfigError("--tensor-parallel " + std::to_string(layout.tensor()) + ": the tensor group of ranks " +
                      join(group) + " spans machines " + join(machines, " and ") +
                      "; a tensor group exchanges activations in every layer and must sit inside one machine: "
                      "use a --tensor-parallel that divides the workers per machine, and start the same number "
                      "on each (--nproc-per-node)");
  }
}

}  // namespace

const char* dim_name(ParallelDim dim) {
  switch (dim) {
    case ParallelDim::pipeline: return "pipeline";
    case ParallelDim::data: return "data";
    case ParallelDim::tensor: return "tensor";
    case ParallelDim::model: return "model";
    case ParallelDim::mesh: return "mesh";
  }
  return "?";
}

Layout Layout::build(const LayoutRequest& r) {
  check_degree("the world size", r.world);
  check_degree("--pipeline-parallel", r.pipeline_parallel);
  check_degree("--tensor-parallel", r.tensor_parallel);
  check_degree("the context-parallel degree", r.context_parallel);
  if (r.context_parallel > 1)
    throw ConfigError("context parallelism (" + std::to_string(r.context_parallel) +
                      ") is not built: the layout reserves the dimension; leave it at 1");
  if (r.zero_stage < 0 || r.zero_stage > 3)
    throw ConfigError("--zero-stage must be 0, 1, 2 or 3 (got " + std::to_string(r.zero_stage) + ")");
  if (r.sequence_parallel && r.tensor_parallel == 1)
    throw ConfigError("--sequence-parallel splits activations over the tensor group: it needs --tensor-parallel 2 "
                      "or more");
  if (!r.machine_of.empty() && static_cast<int>(r.machine_of.size()) != r.world)
    throw ConfigError("the layout was given the machines of " + std::to_string(r.machine_of.size()) +
                      " ranks for a world of " + std::to_string(r.world));
  check_product(r);
  Layout l;
  l.pipeline_ = r.pipeline_parallel;
  l.tensor_ = r.tensor_parallel;
  l.data_ = r.world / (r.pipeline_parallel * r.tensor_parallel);
  l.zero_stage_ = r.zero_stage;
  l.sequence_parallel_ = r.sequence_parallel;
  l.machine_of_ = r.machine_of;
  l.machines_ = r.machine_of.empty() ? 1 : static_cast<int>(std::set<int>(r.machine_of.begin(), r.machine_of.end()).size());
  check_tensor_groups(l, r.machine_of);
  return l;
}

Layout::Coordinates Layout::coordinates_of(int rank) const {
  if (rank < 0 || rank >= world())
    throw ConfigError("rank " + std::to_string(rank) + " is outside the layout's " + std::to_string(world()) +
                      " workers");
  return Coordinates{rank / (data_ * tensor_), (rank / tensor_) % data_, rank % tensor_};
}

std::vector<int> Layout::group_of(ParallelDim dim, int rank) const {
  const Coordinates at = coordinates_of(rank);
  std::vector<int> out;
  auto along = [&](int n, auto set) {
    for (int i = 0; i < n; ++i) {
      Coordinates c = at;
      set(c, i);
      out.push_back(rank_at(c));
    }
  };
  switch (dim) {
    case ParallelDim::tensor: along(tensor_, [](Coordinates& c, int i) { c.tensor = i; }); break;
    case ParallelDim::data: along(data_, [](Coordinates& c, int i) { c.data = i; }); break;
    case ParallelDim::pipeline: along(pipeline_, [](Coordinates& c, int i) { c.pipeline = i; }); break;
    case ParallelDim::model:
      along(pipeline_ * tensor_, [&](Coordinates& c, int i) { c.pipeline = i / tensor_, c.tensor = i % tensor_; });
      break;
    case ParallelDim::mesh:
      along(pipeline_ * data_, [&](Coordinates& c, int i) { c.pipeline = i / data_, c.data = i % data_; });
      break;
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::vector<int>> Layout::groups(ParallelDim dim) const {
  std::vector<std::vector<int>> out;
  std::vector<bool> seen(static_cast<std::size_t>(world()), false);
  for (int r = 0; r < world(); ++r) {
    if (seen[static_cast<std::size_t>(r)]) continue;
    out.push_back(group_of(dim, r));
    for (const int m : out.back()) seen[static_cast<std::size_t>(m)] = true;
  }
  return out;
}

std::string Layout::group_name(ParallelDim dim, int rank) const {
  const Coordinates c = coordinates_of(rank);
  const std::string p = "p" + std::to_string(c.pipeline), d = "d" + std::to_string(c.data),
                    t = "t" + std::to_string(c.tensor);
  switch (dim) {
    case ParallelDim::tensor: return "tensor/" + p + "-" + d;
    case ParallelDim::data: return "data/" + p + "-" + t;
    case ParallelDim::pipeline: return "pipeline/" + d + "-" + t;
    case ParallelDim::model: return "model/" + d;
    case ParallelDim::mesh: return "mesh/" + t;
  }
  return "?";
}

bool Layout::data_groups_within_machines() const {
  if (machine_of_.empty()) return false;
  for (const auto& group : groups(ParallelDim::data))
    for (const int r : group)
      if (machine_of_[static_cast<std::size_t>(r)] != machine_of_[static_cast<std::size_t>(group.front())]) return false;
  return true;
}

pipe_core::PipelineMesh Layout::pipeline_mesh() const {
  return pipe_core::PipelineMesh{pipeline_, data_};
}

std::string Layout::describe() const {
  std::string out = std::to_string(world()) + (world() == 1 ? " worker" : " workers");
  if (machines_ > 1) out += " on " + std::to_string(machines_) + " machines";
  std::vector<std::string> dims;
  if (pipeline_ > 1) dims.push_back(std::to_string(pipeline_) + " pipeline");
  if (data_ > 1)
    dims.push_back(std::to_string(data_) + " data" +
                   (zero_stage_ > 0 ? " (ZeRO-" + std::to_string(zero_stage_) + ")" : std::string()));
  if (tensor_ > 1) dims.push_back(std::to_string(tensor_) + " tensor" + (sequence_parallel_ ? " (sequence parallel)" : ""));
  if (dims.empty()) return out;
  out += ": ";
  for (std::size_t i = 0; i < dims.size(); ++i) out += (i ? " x " : "") + dims[i];
  return out;
}

}  // namespace lockstep
