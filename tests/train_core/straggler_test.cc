// find_straggler: which rank the others wait for, from per-rank seconds per step.
#include "lockstep/train_core/straggler.h"

#include <gtest/gtest.h>

namespace lockstep::train {
namespace {

TEST(Straggler, EvenRanksHaveNone) {
  EXPECT_FALSE(find_straggler({{0.001, 0.020}, {0.001, 0.021}, {0.002, 0.019}}));
  EXPECT_FALSE(find_straggler({{0.001, 0.020}}));  // one rank waits for nobody
  EXPECT_FALSE(find_straggler({}));
}

TEST(Straggler, ARankWithSlowDataIsNamedWithItsCause) {
  const auto s = find_straggler({{0.001, 0.020}, {0.030, 0.020}, {0.001, 0.021}});
  ASSERT_TRUE(s);
  EXPECT_EQ(s->rank, 1);
  EXPECT_EQ(s->cause, "data loading");
  EXPECT_NEAR(s->ratio, 0.050 / 0.0215, 1e-9);
  EXPECT_NE(s->describe().find("rank 1 is the straggler: its data loading makes its steps 2.3x"), std::string::npos)
      << s->describe();
}

TEST(Straggler, ARankWithSlowComputeIsNamedWithItsCause) {
  const auto s = find_straggler({{0.001, 0.045}, {0.001, 0.020}});
  ASSERT_TRUE(s);
  EXPECT_EQ(s->rank, 0);
  EXPECT_EQ(s->cause, "compute");
}

// Small steps: 1.5x of 2 ms is noise on a shared host, not a straggler; 5 ms more is needed.
TEST(Straggler, ARatioWithoutMillisecondsBehindItIsNotAStraggler) {
  EXPECT_FALSE(find_straggler({{0.0, 0.002}, {0.0, 0.004}}));
  EXPECT_TRUE(find_straggler({{0.0, 0.002}, {0.0, 0.008}}));
}

// Behind a slow link (every step 170 ms, mostly waiting for it), a rank 7 ms late is 1.6x the
// others' work but costs the step 4%: the link is what they wait for, not the rank. The same
// rank in 20 ms steps is named.
TEST(Straggler, ARankLateByAFewPerCentOfTheStepIsNotNamed) {
  EXPECT_FALSE(find_straggler({{0.0, 0.011, 0.170}, {0.0, 0.018, 0.170}, {0.0, 0.011, 0.170}}));
  EXPECT_TRUE(find_straggler({{0.0, 0.011, 0.020}, {0.0, 0.018, 0.020}, {0.0, 0.011, 0.020}}));
}

}  // namespace
}  // namespace lockstep::train
