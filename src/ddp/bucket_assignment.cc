#include "lockstep/ddp/bucket_assignment.h"

#include <algorithm>
#include <map>
#include <utility>

namespace lockstep {

std::vector<std::vector<int>> assign_buckets(const std::vector<BucketInput>& params, const std::vector<int>& order,
                                             const BucketCaps& caps) {
  struct Open {
    std::vector<int> params;
    std::int64_t bytes = 0;
    bool first = true;
  };
  std::map<std::string, Open> open;
  std::vector<std::vector<int>> closed;
  for (int i : order) {
    const auto& p = params.at(std::size_t(i));
    auto& o = open[p.kind];
    o.params.push_back(i);
    o.bytes += p.bytes;
    if (o.bytes >= (o.first ? caps.first_bytes : caps.bytes)) {
      closed.push_back(std::move(o.params));
      o = Open{{}, 0, false};
    }
  }
  std::vector<std::pair<std::size_t, std::vector<int>>> rest;  // (where it began in order, bucket)
  for (auto& [kind, o] : open) {
    if (o.params.empty()) continue;
    const auto begins = std::size_t(std::find(order.begin(), order.end(), o.params.front()) - order.begin());
    rest.emplace_back(begins, std::move(o.params));
  }
  std::sort(rest.begin(), rest.end());
  for (auto& r : rest) closed.push_back(std::move(r.second));
  return closed;
}

}  // namespace lockstep
