// The partitioner and the mesh: balanced cuts, hand-given splits, and the errors a user meets.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "lockstep/error.h"
#include "lockstep/pipe_core/mesh.h"
#include "lockstep/pipe_core/partition.h"

namespace lockstep::pipe_core {
namespace {

TEST(Partition, BalancesTheCostliestStage) {
  // An embedding, six equal blocks and a heavy head: the head gets a stage nearly to itself.
  const std::vector<double> costs = {1, 2, 2, 2, 2, 2, 2, 5};
  const StagePlan plan = balance_stages(costs, 3);
  EXPECT_EQ(plan.first_unit, (std::vector<int>{0, 3, 6, 8}));  // 5 | 6 | 7
  EXPECT_EQ(plan.stage_of_unit(7), 2);
  EXPECT_EQ(plan.stage_of_unit(0), 0);
  // Equal costs: equal stages.
  EXPECT_EQ(balance_stages(std::vector<double>(8, 1.0), 4).first_unit, (std::vector<int>{0, 2, 4, 6, 8}));
  // As many stages as units: one each.
  EXPECT_EQ(balance_stages({3, 1, 2}, 3).first_unit, (std::vector<int>{0, 1, 2, 3}));
}

TEST(Partition, NoCutIsBetterThanTheOneFound) {
  // Every 3-stage cut of 7 units, by brute force.
  const std::vector<double> costs = {4, 1, 3, 3, 1, 2, 5};
  const StagePlan plan = balance_stages(costs, 3);
  auto worst = [&](int a, int b) {
    double s0 = 0, s1 = 0, s2 = 0;
    for (int u = 0; u < 7; ++u) (u < a ? s0 : u < b ? s1 : s2) += costs[std::size_t(u)];
    return std::max({s0, s1, s2});
  };
  double best = 1e9;
  for (int a = 1; a < 6; ++a)
    for (int b = a + 1; b < 7; ++b) best = std::min(best, worst(a, b));
  EXPECT_DOUBLE_EQ(worst(plan.begin(1), plan.begin(2)), best);
}

TEST(Partition, DescribesThePlan) {
  const StagePlan plan = balance_stages({1, 1, 2}, 2);
  EXPECT_EQ(plan.describe({"embedding", "h.0", "head"}, {1, 1, 2}, "ms"),
            "stage 0: units 0-1 (embedding, h.0), 2 ms (50%)\nstage 1: unit 2 (head), 2 ms (50%)");
}

TEST(Partition, MoreStagesThanUnitsIsAConfigError) {
  try {
    balance_stages({1, 1, 1}, 4);
    FAIL() << "4 stages of 3 units were accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("has only 3 units"), std::string::npos) << e.what();
  }
}

TEST(Partition, ParsesAHandGivenSplit) {
  EXPECT_EQ(parse_stage_split("1,3,2", 6, 3).first_unit, (std::vector<int>{0, 1, 4, 6}));
  EXPECT_THROW(parse_stage_split("1,3,2", 7, 3), ConfigError);   // does not add up
  EXPECT_THROW(parse_stage_split("1,5", 6, 3), ConfigError);     // too few stages
  EXPECT_THROW(parse_stage_split("1,x,5", 7, 3), ConfigError);   // not a number
  EXPECT_THROW(parse_stage_split("1,0,5", 6, 3), ConfigError);   // an empty stage
  EXPECT_THROW(parse_stage_split("1,2a,3", 6, 3), ConfigError);  // trailing garbage
}

TEST(Mesh, RanksAreStageMajor) {
  const PipelineMesh mesh = PipelineMesh::of(6, 2);
  EXPECT_EQ(mesh.replicas, 3);
  EXPECT_EQ(mesh.pipeline_rank_of(4), 1);
  EXPECT_EQ(mesh.replica_of(4), 1);
  EXPECT_EQ(mesh.stage_group(1), (std::vector<int>{3, 4, 5}));
  EXPECT_EQ(mesh.pipeline_group(2), (std::vector<int>{2, 5}));
  EXPECT_EQ(mesh.describe(), "2 pipeline ranks x 3 replicas (6 workers)");
}

// ZeRO-1 over a stage's replicas: every tensor has one owner, and random sizes (the seed printed)
// leave no replica above the mean by more than the largest tensor.
TEST(Partition, TensorOwnersSplitAStagesElementsWithinTheLargestTensor) {
  EXPECT_EQ(owners_of_tensors({10, 1, 1, 8}, 2), (std::vector<int>{0, 1, 1, 1}));  // 10 | 8 + 1 + 1
  EXPECT_EQ(owners_of_tensors({5, 5}, 1), (std::vector<int>{0, 0}));
  EXPECT_EQ(owners_of_tensors({}, 3), std::vector<int>{});
  EXPECT_THROW(owners_of_tensors({1}, 0), ConfigError);
  const std::uint64_t seed = std::random_device{}();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 200; ++trial) {
    const int replicas = std::uniform_int_distribution<int>(1, 8)(rng);
    std::vector<long long> sizes(std::uniform_int_distribution<std::size_t>(0, 40)(rng));
    for (auto& n : sizes) n = std::uniform_int_distribution<long long>(1, 1 << 20)(rng);
    const std::vector<int> owner = owners_of_tensors(sizes, replicas);
    std::vector<long long> held(std::size_t(replicas), 0);
    long long total = 0, largest = 0;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      ASSERT_GE(owner[i], 0);
      ASSERT_LT(owner[i], replicas);
      held[std::size_t(owner[i])] += sizes[i];
      total += sizes[i];
      largest = std::max(largest, sizes[i]);
    }
    for (const long long h : held)
      EXPECT_LE(double(h), double(total) / replicas + double(largest)) << "seed " << seed << ", trial " << trial;
  }
}

TEST(Mesh, APipelineThatDoesNotDivideTheWorldIsAConfigError) {
  try {
    PipelineMesh::of(6, 4);
    FAIL() << "P 4 of 6 workers was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("does not divide the 6 workers"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("use one of 1, 2, 3, 6"), std::string::npos) << e.what();
  }
  EXPECT_THROW(PipelineMesh::of(4, 0), ConfigError);
}

}  // namespace
}  // namespace lockstep::pipe_core
