#include "lockstep/train_core/loss_scale.h"

#include <gtest/gtest.h>

#include "lockstep/error.h"

namespace lockstep::train {
namespace {

TEST(LossScale, AnOverflowSkipsTheStepAndHalvesTheScale) {
  LossScale s;
  ASSERT_TRUE(s.update(false));
  EXPECT_FALSE(s.update(true));
  EXPECT_EQ(s.scale(), LossScale::kInitialScale / 2);
  EXPECT_EQ(s.clean_steps(), 0);
  EXPECT_FALSE(s.update(true));
  EXPECT_EQ(s.scale(), LossScale::kInitialScale / 4);
  EXPECT_EQ(s.overflows(), 2);
}

TEST(LossScale, GrowsOnlyAfterAnUnbrokenIntervalOfCleanSteps) {
  LossScale s;
  for (std::int64_t i = 0; i + 1 < LossScale::kGrowthInterval; ++i) ASSERT_TRUE(s.update(false));
  EXPECT_EQ(s.scale(), LossScale::kInitialScale);
  s.update(true);  // breaks the run: the count starts again
  for (std::int64_t i = 0; i + 1 < LossScale::kGrowthInterval; ++i) s.update(false);
  EXPECT_EQ(s.scale(), LossScale::kInitialScale / 2);
  EXPECT_TRUE(s.update(false));
  EXPECT_EQ(s.scale(), LossScale::kInitialScale);
  EXPECT_EQ(s.clean_steps(), 0);
}

TEST(LossScale, ItsStateRoundTripsAndAStateItCannotReachIsRefused) {
  LossScale s;
  s.update(true);
  for (int i = 0; i < 7; ++i) s.update(false);
  LossScale back;
  back.load_json(s.to_json());
  EXPECT_EQ(back.scale(), s.scale());
  EXPECT_EQ(back.clean_steps(), 7);
  EXPECT_THROW(back.load_json({{"scale", 0.0}, {"clean_steps", 0}}), DataError);
  EXPECT_THROW(back.load_json({{"scale", 1024.0}, {"clean_steps", LossScale::kGrowthInterval}}), DataError);
  EXPECT_THROW(back.load_json({{"scale", 1024.0}}), DataError);
  EXPECT_EQ(back.scale(), s.scale());  // a refused state leaves the scale as it was
}

}  // namespace
}  // namespace lockstep::train
