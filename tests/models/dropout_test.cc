// The GPT's dropout: the share it drops, the scale it keeps, the same masks from the same
// generator state, and autograd through it.
#include "lockstep/models/dropout.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "lockstep/error.h"

using lockstep::models::fast_dropout;

TEST(Dropout, DropsTheShareAskedAndKeepsTheExpectation) {
  const auto x = torch::ones({1 << 20});
  for (double p : {0.1, 0.5, 0.9}) {
    const auto y = fast_dropout(x, p, /*training=*/true);
    const double dropped = (y == 0).to(torch::kDouble).mean().item<double>();
    const double sigma = std::sqrt(p * (1 - p) / static_cast<double>(x.numel()));
    EXPECT_NEAR(dropped, p, 6 * sigma + 1.0 / 65536) << "p " << p;
    // Every kept element carries the same scale, the inverse of the keep probability (p rounded
    // to 16 bits), so the mean stays 1 within the sampling error.
    const auto kept = y.masked_select(y != 0);
    EXPECT_EQ(kept.min().item<float>(), kept.max().item<float>());
    EXPECT_NEAR(kept[0].item<double>(), 1 / (1 - p), 1.0 / 65536 / ((1 - p) * (1 - p)));  // p to 16 bits
    EXPECT_NEAR(y.mean().item<double>(), 1.0, 6 * sigma / (1 - p)) << "p " << p;
  }
}

TEST(Dropout, TheSameGeneratorStateGivesTheSameMaskAndTheNextCallAnother) {
  const auto x = torch::randn({4, 8, 64, 64}).to(torch::kBFloat16);
  torch::manual_seed(3);
  const auto a = fast_dropout(x, 0.2, true), b = fast_dropout(x, 0.2, true);
  torch::manual_seed(3);
  const auto again = fast_dropout(x, 0.2, true);
  EXPECT_TRUE(torch::equal(a, again));
  EXPECT_FALSE(torch::equal(a, b));
  EXPECT_EQ(a.scalar_type(), torch::kBFloat16);
  // Neighbouring elements are not correlated: four share one hash, in distinct bits.
  const auto drops = (a == 0).flatten().to(torch::kFloat);
  const double both = (drops.slice(0, 0, -1) * drops.slice(0, 1)).mean().item<double>();
  EXPECT_NEAR(both, 0.2 * 0.2, 0.01);
}

TEST(Dropout, OffInEvaluationAtZeroAndAllAtOneAndTheGradientIsTheMask) {
  const auto x = torch::randn({1000}, torch::requires_grad());
  EXPECT_TRUE(fast_dropout(x, 0.5, /*training=*/false).is_same(x));
  EXPECT_TRUE(fast_dropout(x, 0.0, true).is_same(x));
  EXPECT_EQ(fast_dropout(x, 1.0, true).abs().sum().item<float>(), 0);
  auto y = fast_dropout(x, 0.3, true);
  y.sum().backward();
  EXPECT_TRUE(torch::allclose(x.grad() * x, y)) << "d(x * mask)/dx is the mask";
  EXPECT_THROW(fast_dropout(x, 1.5, true), lockstep::ConfigError);
  EXPECT_THROW(fast_dropout(x, -0.1, true), lockstep::ConfigError);
}
