#include "elastic_records.h"

#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

namespace lockstep::testing {

std::map<std::int64_t, std::multiset<std::size_t>> trained_samples(const std::string& dir) {
  std::map<std::int64_t, std::map<std::int64_t, std::multiset<std::size_t>>> by_step;  // step -> membership
  for (const auto& f : std::filesystem::directory_iterator(dir)) {
    if (f.path().extension() != ".samples") continue;
    std::ifstream in(f.path());
    std::vector<std::size_t> pending;  // loaded since this worker's last completed step
    std::int64_t last_step = -1, last_membership = 0;
    // What a worker loaded for a step it did not see complete (it failed in the step's all-reduce,
    // or was killed): that step, if the others completed it in the same membership, trained on it,
    // since the all-reduce had this worker's share. If the step was taken again in a later
    // membership, the newer take is the one that counts.
    auto unfinished = [&] {
      if (!pending.empty() && last_step >= 0)
        by_step[last_step + 1][last_membership].insert(pending.begin(), pending.end());
      pending.clear();
    };
    for (std::string line; std::getline(in, line);) {
      std::istringstream words(line);
      std::string kind, word;
      words >> kind;
      if (kind == "get") {
        for (std::size_t i; words >> i;) pending.push_back(i);
      } else if (kind == "begin") {  // the step before this worker's first one: a failure in
        words >> last_step >> word >> last_membership;  // that first step knows which it was
      } else if (kind == "change") {
        unfinished();
        words >> last_step >> word >> last_membership;
      } else if (kind == "step") {
        std::int64_t step = 0, membership = 0;
        words >> step >> word >> membership;
        // Nothing loaded since the change: the step was trained before it, and only what followed
        // it (its checkpoint, its callbacks) completed in this membership.
        if (!pending.empty()) by_step[step][membership].insert(pending.begin(), pending.end());
        pending.clear();
        last_step = step;
        last_membership = membership;
      }
    }
    unfinished();
  }
  std::map<std::int64_t, std::multiset<std::size_t>> out;
  for (auto& [step, memberships] : by_step) out[step] = memberships.rbegin()->second;
  return out;
}

std::string each_sample_once_per_epoch(const std::map<std::int64_t, std::multiset<std::size_t>>& steps,
                                       std::int64_t steps_per_epoch, std::int64_t epochs, std::size_t samples) {
  for (std::int64_t e = 0; e < epochs; ++e) {
    std::multiset<std::size_t> seen;
    for (std::int64_t s = e * steps_per_epoch + 1; s <= (e + 1) * steps_per_epoch; ++s) {
      auto it = steps.find(s);
      if (it == steps.end()) return "step " + std::to_string(s) + " was never completed";
      seen.insert(it->second.begin(), it->second.end());
    }
    if (seen.size() != samples)
      return "epoch " + std::to_string(e) + " trained " + std::to_string(seen.size()) + " samples, not " +
             std::to_string(samples);
    for (std::size_t i = 0; i < samples; ++i)
      if (seen.count(i) != 1)
        return "epoch " + std::to_string(e) + " trained sample " + std::to_string(i) + " " +
               std::to_string(seen.count(i)) + " times";
  }
  return "";
}

}  // namespace lockstep::testing
