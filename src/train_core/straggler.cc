#include "lockstep/train_core/straggler.h"

#include <algorithm>
#include <cstdio>

namespace lockstep::train {
namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

constexpr double kRatio = 1.5;
constexpr double kExcessSeconds = 0.005;
constexpr double kShareOfStep = 0.1;

}  // namespace

std::string Straggler::describe() const {
  char ratio_text[32];
  std::snprintf(ratio_text, sizeof ratio_text, "%.1fx", ratio);
  return "rank " + std::to_string(rank) + " is the straggler: its " + cause + " makes its steps " + ratio_text +
         " as long as the other ranks' (median), and every rank waits for it at the gradient all-reduce";
}

std::optional<Straggler> find_straggler(const std::vector<RankBusy>& ranks) {
  if (ranks.size() < 2) return std::nullopt;
  auto busy = [](const RankBusy& r) { return r.data + r.compute; };
  const auto slowest = std::max_element(ranks.begin(), ranks.end(),
                                        [&](const RankBusy& a, const RankBusy& b) { return busy(a) < busy(b); });
  std::vector<double> data, compute, total, steps;
  for (auto it = ranks.begin(); it != ranks.end(); ++it) {
    steps.push_back(it->step);
    if (it == slowest) continue;
    data.push_back(it->data), compute.push_back(it->compute), total.push_back(busy(*it));
  }
  const double others = median(total), excess = busy(*slowest) - others;
  if (busy(*slowest) < kRatio * others || excess < kExcessSeconds || excess < kShareOfStep * median(steps))
    return std::nullopt;
  Straggler s;
  s.rank = static_cast<int>(slowest - ranks.begin());
  s.ratio = others > 0 ? busy(*slowest) / others : 0;
  s.cause = slowest->data - median(data) > slowest->compute - median(compute) ? "data loading" : "compute";
  return s;
}

}  // namespace lockstep::train
