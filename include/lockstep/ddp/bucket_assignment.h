// Which parameters share a bucket: a pure function of their sizes, kinds and order, apart from
// the memory the reducer then allocates (as c10d's compute_bucket_assignment_by_size). No torch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lockstep {

struct BucketInput {
  std::int64_t bytes = 0;
  std::string kind;  // dtype and device: a bucket holds one kind only
};

struct BucketCaps {
  std::int64_t first_bytes = 1 << 20;  // the first bucket of each kind, so reducing starts early
  std::int64_t bytes = 25 << 20;       // the others
};

// Walks `order` (indices into `params`, each once) keeping one open bucket per kind; a bucket
// closes as soon as it holds at least its cap, so a parameter larger than the cap has a bucket of
// its own, and no parameter is ever split. Buckets left open at the end follow, ordered by where
// their first parameter appears in `order`. Returns the buckets in the order they are reduced,
// each listing its parameters in `order`'s order; every index in `order` appears exactly once.
std::vector<std::vector<int>> assign_buckets(const std::vector<BucketInput>& params, const std::vector<int>& order,
                                             const BucketCaps& caps);

}  // namespace lockstep
