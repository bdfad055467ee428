#include "lockstep/data/elastic_sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "lockstep/error.h"

namespace lockstep::data {
namespace {

// The union of one step's shares over a world, sorted.
std::vector<std::size_t> step_set(const ElasticSampler& s, int world) {
  std::vector<std::size_t> all;
  for (int r = 0; r < world; ++r) {
    const StepShare share = s.share(r, world);
    all.insert(all.end(), share.indices.begin(), share.indices.end());
  }
  std::sort(all.begin(), all.end());
  return all;
}

// In a world that never changes, each rank takes what DistributedSampler gives it, step by step.
TEST(ElasticSampler, InAFixedWorldItDealsAsTheDistributedSampler) {
  const int world = 3;
  const std::size_t per_rank = 4, n = 120;  // 10 full steps of 12
  ElasticSampler elastic(n, per_rank * world, true, 7);
  std::vector<DistributedSampler> classic;
  for (int r = 0; r < world; ++r) classic.emplace_back(n, r, world, true, 7);
  for (auto epoch : {0u, 1u}) {
    elastic.set_epoch(epoch);
    for (auto& c : classic) c.set_epoch(epoch);
    for (std::size_t step = 0; step < elastic.steps_per_epoch(); ++step) {
      for (int r = 0; r < world; ++r)
        EXPECT_EQ(elastic.share(r, world).indices, classic[static_cast<std::size_t>(r)].take(per_rank))
            << "epoch " << epoch << " step " << step << " rank " << r;
      elastic.advance();
    }
    EXPECT_TRUE(elastic.epoch_done());
  }
}

// A step covers the same samples whatever the world's size: the training does not depend on it.
TEST(ElasticSampler, AStepCoversTheSameSamplesInEveryWorld) {
  ElasticSampler s(1000, 64, true, 3);
  s.advance();
  s.advance();
  const auto reference = step_set(s, 1);
  ASSERT_EQ(reference.size(), 64u);
  for (int world = 2; world <= 7; ++world) EXPECT_EQ(step_set(s, world), reference) << world << " ranks";
}

// The world changes between steps, to sizes that do not divide the step: every sample of the
// epoch is still visited exactly once, the shares of a step differ by one sample at most, and
// step_samples is the step's total.
TEST(ElasticSampler, WhenTheWorldChangesEverySampleIsVisitedOncePerEpoch) {
  const std::size_t n = 1003;
  ElasticSampler s(n, 50, true, 11);
  const int worlds[] = {4, 3, 3, 1, 7, 2, 5};
  std::multiset<std::size_t> seen;
  for (std::size_t step = 0; !s.epoch_done(); ++step) {
    const int world = worlds[step % 7];
    std::size_t smallest = n, largest = 0, total = 0;
    for (int r = 0; r < world; ++r) {
      const StepShare share = s.share(r, world);
      seen.insert(share.indices.begin(), share.indices.end());
      smallest = std::min(smallest, share.indices.size());
      largest = std::max(largest, share.indices.size());
      total += share.indices.size();
      EXPECT_EQ(share.step_samples, s.share(0, world).step_samples);
    }
    EXPECT_EQ(total, s.share(0, world).step_samples);
    EXPECT_LE(largest - smallest, 1u);
    s.advance();
  }
  EXPECT_EQ(seen.size(), n);
  for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(seen.count(i), 1u) << "sample " << i;
  EXPECT_EQ(s.steps_per_epoch(), 21u);  // 20 steps of 50 and one of 3
}

TEST(ElasticSampler, AStepSmallerThanTheWorldLeavesSomeRanksWithout) {
  ElasticSampler s(10, 8, false, 0);
  s.advance();  // 2 samples left
  EXPECT_EQ(s.share(0, 4).indices, (std::vector<std::size_t>{8}));
  EXPECT_EQ(s.share(1, 4).indices, (std::vector<std::size_t>{9}));
  EXPECT_TRUE(s.share(3, 4).indices.empty());
  EXPECT_EQ(s.share(3, 4).step_samples, 2u);
  EXPECT_THROW(s.share(4, 4), ConfigError);
}

TEST(ElasticSampler, ResumesAtItsPositionAndRefusesAnotherDatasetsState) {
  ElasticSampler a(500, 32, true, 5);
  a.set_epoch(2);
  for (int i = 0; i < 5; ++i) a.advance();
  ElasticSampler b(500, 32, true, 5);
  b.load_state(a.state());
  EXPECT_EQ(b.epoch(), 2u);
  EXPECT_EQ(b.share(1, 3).indices, a.share(1, 3).indices);
  EXPECT_THROW(b.load_state(SamplerState{0, 501}), ConfigError);
  EXPECT_THROW(ElasticSampler(500, 0), ConfigError);
}

}  // namespace
}  // namespace lockstep::data
