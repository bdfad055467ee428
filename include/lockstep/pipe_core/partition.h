// Which units of a model each stage holds: a contiguous cut of the units (a GPT's embedding,
// blocks and head) into S stages.
//
// balance_stages cuts so that the costliest stage is as cheap as it can be (the step runs at the
// pace of its slowest stage), from a cost per unit: measured forward + backward seconds (what
// the pipeline measures by default before the first step), or parameter counts. A split given by
// hand ("1,3,3,2": units per stage) is taken as given once it adds up.
#pragma once

#include <string>
#include <vector>

namespace lockstep::pipe_core {

struct StagePlan {
  std::vector<int> first_unit{0};  // stage s holds units [first_unit[s], first_unit[s + 1])
  int stages() const { return int(first_unit.size()) - 1; }
  int begin(int stage) const { return first_unit[std::size_t(stage)]; }
  int end(int stage) const { return first_unit[std::size_t(stage) + 1]; }
  int stage_of_unit(int unit) const;
  // One line per stage: its units by name and its share of the cost, e.g.
  // "stage 0: units 0-2 (wte+wpe, h.0, h.1), 1.20 ms (34%)". `cost_unit` follows each cost.
  std::string describe(const std::vector<std::string>& unit_names, const std::vector<double>& costs,
                       const std::string& cost_unit) const;
};

// ConfigError when there are more stages than units (each stage needs at least one) or a cost is
// negative or not finite.
StagePlan balance_stages(const std::vector<double>& unit_costs, int stages);

// "1,3,3,2": units per stage. ConfigError naming the problem when a count is not a positive
// integer, there are not `stages` of them, or they do not add up to `units`.
StagePlan parse_stage_split(const std::string& text, int units, int stages);

// ZeRO stage 1 over a stage's D replicas: which replica updates (and keeps the optimizer state of)
// each of the stage's parameters, whole tensors, given their element counts: the largest first,
// each to the replica holding the fewest elements so far (the lowest on a tie). The same on every
// replica; the most any replica holds is at most the mean plus the largest tensor.
std::vector<int> owners_of_tensors(const std::vector<long long>& elements, int replicas);

}  // namespace lockstep::pipe_core
