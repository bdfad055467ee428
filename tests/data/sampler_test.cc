#include "lockstep/data/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

#include "lockstep/error.h"

namespace lockstep::data {
namespace {

struct Case {
  std::size_t n;
  int world;
  bool drop_last;
};

class Coverage : public ::testing::TestWithParam<Case> {};

// One epoch over all ranks: equal counts per rank (PyTorch's formulas); without drop_last every
// index appears and only padding repeats; with drop_last a duplicate-free subset of the right size.
TEST_P(Coverage, RanksSplitAnEpochExactly) {
  const auto [n, world, drop_last] = GetParam();
  std::size_t expected = drop_last ? n / world : (n + world - 1) / world;
  std::multiset<std::size_t> seen;
  std::size_t padding = 0;
  for (int r = 0; r < world; ++r) {
    DistributedSampler s(n, r, world, true, 7, drop_last);
    s.set_epoch(3);
    ASSERT_EQ(s.num_samples(), expected);
    ASSERT_EQ(s.indices().size(), expected);
    for (std::size_t k = 0; k < expected; ++k) {
      EXPECT_LT(s.indices()[k], std::max<std::size_t>(n, 1));
      if (s.is_padding(k))
        ++padding;
      else
        seen.insert(s.indices()[k]);
    }
  }
  std::set<std::size_t> distinct(seen.begin(), seen.end());
  EXPECT_EQ(distinct.size(), seen.size()) << "a real index was handed to two ranks";
  if (drop_last) {
    EXPECT_EQ(seen.size(), expected * world);
    EXPECT_EQ(padding, 0u);
  } else {
    EXPECT_EQ(seen.size(), n) << "every index must appear";
    EXPECT_EQ(padding, expected * world - n);
  }
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (std::size_t n : {0, 1, 7, 60000})
    for (int w : {1, 2, 3, 4})
      for (bool d : {false, true}) out.push_back({n, w, d});
  return out;
}
INSTANTIATE_TEST_SUITE_P(Sweep, Coverage, ::testing::ValuesIn(cases()), [](const auto& param) {
  return "n" + std::to_string(param.param.n) + "_world" + std::to_string(param.param.world) +
         (param.param.drop_last ? "_drop" : "_pad");
});

TEST(Sampler, SameSeedAndEpochGiveTheSameOrderAnotherEpochAnother) {
  DistributedSampler a(1000, 1, 4, true, 42), b(1000, 1, 4, true, 42);
  a.set_epoch(5);
  b.set_epoch(5);
  EXPECT_EQ(a.indices(), b.indices());
  auto epoch5 = a.indices();
  a.set_epoch(6);
  EXPECT_NE(a.indices(), epoch5);
  DistributedSampler other_seed(1000, 1, 4, true, 43);
  other_seed.set_epoch(5);
  EXPECT_NE(other_seed.indices(), epoch5);
  EXPECT_EQ(epoch_permutation(10, 1, 2), epoch_permutation(10, 1, 2));
}

TEST(Sampler, WithoutShuffleRankTakesAStridedShare) {
  DistributedSampler s(10, 1, 3, false);
  EXPECT_EQ(s.indices(), (std::vector<std::size_t>{1, 4, 7, 0}));  // 10 padded to 12: 0 repeats
  EXPECT_FALSE(s.is_padding(2));
  EXPECT_TRUE(s.is_padding(3));
  EXPECT_EQ(s.real_count(), 3u);
}

TEST(Sampler, ResumingAtEveryPositionGivesExactlyTheRest) {
  DistributedSampler s(23, 2, 3, true, 9);
  s.set_epoch(4);
  const auto all = s.indices();
  for (std::size_t pos = 0; pos <= all.size(); ++pos) {
    DistributedSampler first(23, 2, 3, true, 9);
    first.set_epoch(4);
    first.take(pos);
    SamplerState saved = first.state();
    DistributedSampler resumed(23, 2, 3, true, 9);  // a new process: epoch 0 until loaded
    resumed.load_state(saved);
    std::vector<std::size_t> rest = resumed.take(all.size());
    EXPECT_EQ(rest, std::vector<std::size_t>(all.begin() + static_cast<std::ptrdiff_t>(pos), all.end()))
        << "position " << pos;
  }
}

// A world of 2 stops after k indices each; a world of 3 (or 1, or 4) continues the same epoch
// from the offset: the first world's share and the real (non-padding) indices of the second
// together are the dataset, each index once.
TEST(Sampler, AnotherWorldContinuesTheEpochFromWhatTheFirstTook) {
  const std::size_t n = 29;
  for (std::size_t k : {0u, 3u, 7u, 14u, 15u}) {
    for (int next : {1, 3, 4}) {
      std::multiset<std::size_t> seen;
      SamplerState saved;
      for (int r = 0; r < 2; ++r) {
        DistributedSampler first(n, r, 2, true, 5);
        first.set_epoch(2);
        for (std::size_t i : first.take(k)) seen.insert(i);
        saved = first.state();
      }
      const std::size_t offset = consumed_in_epoch(saved, 2, n);
      EXPECT_EQ(offset, std::min(n, 2 * k));
      if (2 * k > n) continue;  // the first world already finished the epoch (with padding)
      for (int r = 0; r < next; ++r) {
        DistributedSampler second(n, r, next, true, 5);
        second.load_state({2, 0, offset});
        const auto rest = second.take(second.num_samples());
        for (std::size_t j = 0; j < rest.size(); ++j)
          if (!second.is_padding(j)) seen.insert(rest[j]);
      }
      EXPECT_EQ(seen.size(), n) << "k " << k << ", next world " << next;
      for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(seen.count(i), 1u) << i << " (k " << k << ", next " << next << ")";
    }
  }
}

TEST(Sampler, BadArgumentsAreConfigErrors) {
  EXPECT_THROW(DistributedSampler(10, 3, 3), ConfigError);
  EXPECT_THROW(DistributedSampler(10, 0, 0), ConfigError);
  DistributedSampler s(10, 0, 2);
  EXPECT_THROW(s.load_state({0, 6}), ConfigError);
}

}  // namespace
}  // namespace lockstep::data
