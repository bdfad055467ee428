// balance_stages is the linear partition problem: best[s][i], the smallest possible cost of the
// costliest stage when the first i units make s stages, is the least over j of
// max(best[s - 1][j], cost of units j..i-1). O(S n^2) for n units: microseconds for any model
// whose units are blocks. Ties go to the earliest cut, so every rank computes the same plan.
#include "lockstep/pipe_core/partition.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <sstream>

#include "lockstep/error.h"

namespace lockstep::pipe_core {
namespace {

void check_counts(int units, int stages) {
  if (stages < 1) throw ConfigError("a pipeline needs at least one stage");
  if (stages > units)
    throw ConfigError("the pipeline has " + std::to_string(stages) + " stages (--pipeline-parallel x --virtual-stages) "
                      "but the model has only " + std::to_string(units) + " units to put in them: use at most " +
                      std::to_string(units) + " stages, or a deeper model");
}

std::string format_cost(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, v >= 100 ? "%.0f" : "%.3g", v);
  return buf;
}

}  // namespace

int StagePlan::stage_of_unit(int unit) const {
  for (int s = 0; s < stages(); ++s)
    if (unit < end(s)) return s;
  return stages() - 1;
}

std::string StagePlan::describe(const std::vector<std::string>& names, const std::vector<double>& costs,
                                const std::string& cost_unit) const {
  const double total = std::accumulate(costs.begin(), costs.end(), 0.0);
  std::ostringstream out;
  for (int s = 0; s < stages(); ++s) {
    double cost = 0;
    std::string listed;
    for (int u = begin(s); u < end(s); ++u) {
      if (std::size_t(u) < costs.size()) cost += costs[std::size_t(u)];
      if (std::size_t(u) < names.size()) listed += (listed.empty() ? "" : ", ") + names[std::size_t(u)];
    }
    out << (s ? "\n" : "") << "stage " << s << ": unit" << (end(s) - begin(s) == 1 ? " " : "s ") << begin(s);
    if (end(s) - begin(s) > 1) out << "-" << end(s) - 1;
    if (!listed.empty()) out << " (" << listed << ")";
    if (!costs.empty())
      out << ", " << format_cost(cost) << " " << cost_unit << " (" << std::lround(total > 0 ? 100 * cost / total : 0)
          << "%)";
  }
  return out.str();
}

StagePlan balance_stages(const std::vector<double>& costs, int stages) {
  const int n = int(costs.size());
  check_counts(n, stages);
  for (double c : costs)
    if (!(c >= 0) || !std::isfinite(c)) throw ConfigError("a unit's cost must be a finite number at least 0");
  std::vector<double> prefix(std::size_t(n) + 1, 0);
  for (int i = 0; i < n; ++i) prefix[std::size_t(i) + 1] = prefix[std::size_t(i)] + costs[std::size_t(i)];
  const double inf = std::numeric_limits<double>::infinity();
  // best[s][i]: s stages over the first i units; cut[s][i]: where the last of them begins.
  std::vector<std::vector<double>> best(std::size_t(stages) + 1, std::vector<double>(std::size_t(n) + 1, inf));
  std::vector<std::vector<int>> cut(std::size_t(stages) + 1, std::vector<int>(std::size_t(n) + 1, 0));
  best[0][0] = 0;
  for (int s = 1; s <= stages; ++s)
    for (int i = s; i <= n - (stages - s); ++i)
      for (int j = s - 1; j < i; ++j) {
        const double c = std::max(best[std::size_t(s) - 1][std::size_t(j)], prefix[std::size_t(i)] - prefix[std::size_t(j)]);
        if (c < best[std::size_t(s)][std::size_t(i)]) {
          best[std::size_t(s)][std::size_t(i)] = c;
          cut[std::size_t(s)][std::size_t(i)] = j;
        }
      }
  StagePlan plan;
  plan.first_unit.assign(std::size_t(stages) + 1, n);
  for (int s = stages, i = n; s > 0; --s) {
    i = cut[std::size_t(s)][std::size_t(i)];
    plan.first_unit[std::size_t(s) - 1] = i;
  }
  return plan;
}

StagePlan parse_stage_split(const std::string& text, int units, int stages) {
  check_counts(units, stages);
  StagePlan plan;
  std::stringstream in(text);
  int total = 0;
  for (std::string item; std::getline(in, item, ',');) {
    std::size_t used = 0;
    int count = 0;
    try {
      count = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || count < 1)
      throw ConfigError("--pipeline-split '" + text + "': '" + item + "' is not a positive number of units");
    total += count;
    plan.first_unit.push_back(total);
  }
  if (plan.stages() != stages)
    throw ConfigError("--pipeline-split '" + text + "' names " + std::to_string(plan.stages()) + " stages, but the pipeline has " +
                      std::to_string(stages) + " (--pipeline-parallel x --virtual-stages)");
  if (total != units)
    throw ConfigError("--pipeline-split '" + text + "' holds " + std::to_string(total) + " units, but the model has " +
                      std::to_string(units) + ": the counts must add up to it");
  return plan;
}

std::vector<int> owners_of_tensors(const std::vector<long long>& elements, int replicas) {
  if (replicas < 1) throw ConfigError("ZeRO over a stage's replicas needs at least one replica");
  std::vector<std::size_t> order(elements.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return elements[a] > elements[b]; });
  std::vector<long long> held(std::size_t(replicas), 0);
  std::vector<int> owner(elements.size(), 0);
  for (const std::size_t i : order) {
    const auto least = std::min_element(held.begin(), held.end());  // the first of equals
    owner[i] = int(least - held.begin());
    *least += elements[i];
  }
  return owner;
}

}  // namespace lockstep::pipe_core
