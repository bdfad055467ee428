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

// The same elements dropped in every dtype from the same generator state: float and bf16 masks
// come from the vectorized kernels (16 elements, eight hashes at a time), the others element by
// element from the hash's definition. An odd size, so that the last block ends inside a vector.
TEST(Dropout, EveryDtypeDropsTheSameElements) {
  const auto x = torch::rand({5, 1001}) + 1;  // no zeros of its own
  const auto zeros = [&](torch::ScalarType type) {
    torch::manual_seed(17);
    return fast_dropout(x.to(type), 0.4, true) == 0;
  };
  const auto want = zeros(torch::kDouble);
  EXPECT_NEAR(want.to(torch::kFloat).mean().item<float>(), 0.4, 0.02);
  for (const auto type : {torch::kFloat, torch::kBFloat16, torch::kHalf})
    EXPECT_TRUE(torch::equal(zeros(type), want)) << type;
}

// The fused sum: residual + fast_dropout(x) to the bit, forward and both gradients, for the types
// the GPT adds (an fp32 residual stream and bf16 products under autocast, fp32 alone, bf16 alone).
TEST(Dropout, TheFusedSumIsTheSumOfTheDroppedValuesToTheBit) {
  using lockstep::models::fast_dropout_add;
  for (auto [residual_type, x_type] : {std::pair{torch::kFloat, torch::kBFloat16},
                                       {torch::kFloat, torch::kFloat},
                                       {torch::kBFloat16, torch::kBFloat16}}) {
    SCOPED_TRACE(std::string(c10::toString(residual_type)) + " + " + c10::toString(x_type));
    torch::manual_seed(1);
    const auto r0 = torch::randn({3, 50, 77}).to(residual_type), x0 = torch::randn({3, 50, 77}).to(x_type);
    const auto upstream = torch::randn({3, 50, 77}).to(residual_type);
    auto run = [&](bool fused) {
      auto r = r0.clone().requires_grad_(), x = x0.clone().requires_grad_();
      torch::manual_seed(9);
      auto y = fused ? fast_dropout_add(r, x, 0.3, true) : r + fast_dropout(x, 0.3, true);
      y.backward(upstream);
      return std::vector<torch::Tensor>{y, r.grad(), x.grad()};
    };
    const auto fused = run(true), steps = run(false);
    EXPECT_GT((fused[2] == 0).to(torch::kFloat).mean().item<float>(), 0.2) << "it drops";
    for (std::size_t i = 0; i < fused.size(); ++i) {
      EXPECT_EQ(fused[i].scalar_type(), steps[i].scalar_type()) << "output " << i;
      EXPECT_TRUE(torch::equal(fused[i], steps[i])) << "output " << i;
    }
  }
}

TEST(Dropout, TheFusedSumOffInEvaluationAndElsewhereTheTwoSteps) {
  using lockstep::models::fast_dropout_add;
  const auto r = torch::randn({4, 8}), x = torch::randn({4, 8});
  EXPECT_TRUE(torch::equal(fast_dropout_add(r, x, 0.5, /*training=*/false), r + x));
  EXPECT_TRUE(torch::equal(fast_dropout_add(r, x, 0.0, true), r + x));
  EXPECT_TRUE(torch::equal(fast_dropout_add(r, x, 1.0, true), r));
  // A residual that broadcasts takes the two steps: the same values from the same generator state.
  const auto row = torch::randn({8});
  torch::manual_seed(4);
  const auto broadcast = fast_dropout_add(row, x, 0.5, true);
  torch::manual_seed(4);
  EXPECT_TRUE(torch::equal(broadcast, row + fast_dropout(x, 0.5, true)));
  EXPECT_THROW(fast_dropout_add(r, x, 1.5, true), lockstep::ConfigError);
}
