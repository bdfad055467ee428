// assign_buckets, DDP's bucket layout as a pure function: no torch, no processes.
#include "lockstep/ddp/bucket_assignment.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

namespace lockstep {
namespace {

using Buckets = std::vector<std::vector<int>>;

std::vector<BucketInput> floats(const std::vector<std::int64_t>& bytes) {
  std::vector<BucketInput> out;
  for (auto b : bytes) out.push_back({b, "float@cpu"});
  return out;
}

std::vector<int> reversed(std::size_t n) {
  std::vector<int> order(n);
  std::iota(order.rbegin(), order.rend(), 0);
  return order;
}

TEST(AssignBuckets, TheFirstBucketClosesAtTheSmallCapAndTheRestAtTheLargeOne) {
  const auto params = floats({100, 100, 100, 100, 100, 100, 100});
  EXPECT_EQ(assign_buckets(params, reversed(7), {150, 300}), (Buckets{{6, 5}, {4, 3, 2}, {1, 0}}));
}

TEST(AssignBuckets, AParameterLargerThanTheCapHasABucketOfItsOwnAndIsNeverSplit) {
  const auto params = floats({10, 1000, 10});
  EXPECT_EQ(assign_buckets(params, {0, 1, 2}, {5, 100}), (Buckets{{0}, {1}, {2}}));
}

TEST(AssignBuckets, KindsNeverShareABucketAndLeftoversFollowTheirFirstAppearance) {
  std::vector<BucketInput> params = {{8, "float@cpu"}, {8, "double@cpu"}, {8, "float@cpu"}, {8, "double@cpu"}};
  // Caps so large that nothing closes: one bucket per kind, the float one first (param 0 leads).
  EXPECT_EQ(assign_buckets(params, {0, 1, 2, 3}, {1000, 1000}), (Buckets{{0, 2}, {1, 3}}));
  EXPECT_EQ(assign_buckets(params, {3, 2, 1, 0}, {1000, 1000}), (Buckets{{3, 1}, {2, 0}}));
  // Each kind has its own first bucket under the small cap.
  EXPECT_EQ(assign_buckets(params, {0, 1, 2, 3}, {8, 1000}), (Buckets{{0}, {1}, {2}, {3}}));
}

TEST(AssignBuckets, EveryParameterLandsInExactlyOneBucketInOrder) {
  std::vector<BucketInput> params;
  for (int i = 0; i < 200; ++i) params.push_back({(i * 7919) % 1000 + 1, i % 3 ? "float@cpu" : "half@cpu"});
  std::vector<int> order = reversed(params.size());
  std::rotate(order.begin(), order.begin() + 17, order.end());
  const auto buckets = assign_buckets(params, order, {500, 4000});
  std::vector<int> seen;
  for (const auto& b : buckets) {
    ASSERT_FALSE(b.empty());
    for (int i : b) EXPECT_EQ(params[std::size_t(i)].kind, params[std::size_t(b.front())].kind);
    // Within a bucket, parameters keep the order's order.
    for (std::size_t k = 1; k < b.size(); ++k) {
      auto pos = [&](int i) { return std::find(order.begin(), order.end(), i) - order.begin(); };
      EXPECT_LT(pos(b[k - 1]), pos(b[k]));
    }
    seen.insert(seen.end(), b.begin(), b.end());
  }
  std::sort(seen.begin(), seen.end());
  std::vector<int> all(params.size());
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(seen, all);
}

TEST(AssignBuckets, NoParametersNoBuckets) {
  EXPECT_TRUE(assign_buckets({}, {}, {}).empty());
}

}  // namespace
}  // namespace lockstep
