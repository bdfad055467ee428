// The attention probabilities and their dropout in one pass (models/attention.h) against
// libtorch's ops: without dropout, the masked softmax in float64; with it, fast_dropout of
// libtorch's softmax from the same generator state (the same elements dropped). Values and the
// scores' gradient, float32 and bf16, on ragged, odd and strided shapes; the seeds it draws; the
// paths it leaves to libtorch.
#include "lockstep/models/attention.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <vector>

#include "close.h"
#include "lockstep/error.h"
#include "lockstep/models/dropout.h"

using lockstep::models::causal_softmax_dropout;
using lockstep::testing::close;

namespace {

constexpr double kScale = 0.37;

struct Outcome {
  torch::Tensor y, ds;
};

// y = f(scores) and the scores' gradient of (y * g).sum().
template <class F>
Outcome run(const F& f, const torch::Tensor& scores, const torch::Tensor& g) {
  auto s = scores.detach().clone().requires_grad_(true);
  const auto y = f(s);
  (y.to(torch::kDouble) * g).sum().backward();
  return {y.detach(), s.grad()};
}

// softmax(scale * s + causal mask) as libtorch's ops compute it, in s's dtype or (wide) float64.
torch::Tensor stepwise(const torch::Tensor& s, bool wide) {
  const auto t = s.size(-1);
  const auto future = torch::ones({t, t}, torch::kBool).triu(1);
  const auto x = wide ? s.to(torch::kDouble) : s;
  return torch::softmax((x * kScale).masked_fill(future, -std::numeric_limits<double>::infinity()), -1);
}

double worst(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

const std::vector<std::vector<std::int64_t>> kShapes = {{1, 1}, {3, 3}, {2, 5, 5}, {2, 3, 33, 33}, {1, 2, 130, 130}};

}  // namespace

// float32 within a few ulps of float64; bf16 no further from float64 than libtorch's own bf16
// ops are (values and gradient), on each shape.
TEST(CausalSoftmaxDropout, WithoutDropoutItIsTheMaskedSoftmaxAndItsGradient) {
  torch::manual_seed(11);
  for (const auto& shape : kShapes) {
    const auto s32 = torch::randn(shape) * 4, g = torch::randn(shape, torch::kDouble);
    const auto want = run([](const torch::Tensor& s) { return stepwise(s, true); }, s32, g);
    const auto fused = [](const torch::Tensor& s) { return causal_softmax_dropout(s, kScale, 0.0, true); };
    const auto got = run(fused, s32, g);
    EXPECT_TRUE(close(got.y, want.y, 1e-5, 1e-7)) << shape;
    EXPECT_TRUE(close(got.ds, want.ds, 1e-4, 1e-6)) << shape;
    EXPECT_EQ(got.y.triu(1).abs().sum().item<float>(), 0) << "no query sees a later key";

    const auto s16 = s32.to(torch::kBFloat16);
    const auto got16 = run(fused, s16, g);
    const auto libtorch16 = run([](const torch::Tensor& s) { return stepwise(s, false); }, s16, g);
    const auto want16 = run([](const torch::Tensor& s) { return stepwise(s, true); }, s16, g);
    EXPECT_EQ(got16.y.scalar_type(), torch::kBFloat16);
    EXPECT_LE(worst(got16.y, want16.y), 1.5 * worst(libtorch16.y, want16.y) + 1e-6) << shape;
    EXPECT_LE(worst(got16.ds, want16.ds), 1.5 * worst(libtorch16.ds, want16.ds) + 1e-6) << shape;
  }
}

// With dropout, from the same generator state as fast_dropout(softmax): the same elements dropped,
// and the kept values and the gradient within rounding of libtorch's stepwise ops (float32), or no
// further from float64's than those ops are (bf16, whose stepwise path rounds the scaled scores too).
TEST(CausalSoftmaxDropout, WithDropoutItDropsWhatFastDropoutDropsFromTheSameState) {
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    torch::manual_seed(12);
    const auto s = (torch::randn({2, 4, 67, 67}) * 3).to(dtype);
    const auto g = torch::randn(s.sizes(), torch::kDouble);
    const auto dropped = [&](bool wide) {
      return [wide](const torch::Tensor& x) { return lockstep::models::fast_dropout(stepwise(x, wide), 0.25, true); };
    };
    torch::manual_seed(13);
    const auto got = run([](const torch::Tensor& x) { return causal_softmax_dropout(x, kScale, 0.25, true); }, s, g);
    torch::manual_seed(13);
    const auto libtorch = run(dropped(false), s, g);
    torch::manual_seed(13);
    const auto want = run(dropped(true), s, g);  // the same mask, its scale not rounded to bf16
    EXPECT_TRUE(torch::equal(got.y == 0, libtorch.y == 0)) << dtype;
    if (dtype == torch::kFloat) {
      EXPECT_TRUE(close(got.y, libtorch.y, 1e-5, 1e-7));
      EXPECT_TRUE(close(got.ds, libtorch.ds, 1e-4, 1e-6));
    } else {
      EXPECT_LE(worst(got.y, want.y), 1.5 * worst(libtorch.y, want.y) + 1e-6);
      EXPECT_LE(worst(got.ds, want.ds), 1.5 * worst(libtorch.ds, want.ds) + 1e-6);
    }

    // A quarter of what a query sees is dropped (the above-diagonal zeros aside).
    const auto seen = torch::ones({67, 67}, torch::kBool).tril().expand(s.sizes());
    const double share = (got.y == 0).logical_and(seen).sum().item<double>() / seen.sum().item<double>();
    EXPECT_NEAR(share, 0.25, 0.02) << dtype;
  }
}

// One seed per call while dropping, as fast_dropout draws (so that gradient checkpointing's replay
// and a resumed run see the same masks); none in evaluation or at p = 0.
TEST(CausalSoftmaxDropout, DrawsOneSeedWhileDroppingAndNoneOtherwise) {
  const auto s = torch::randn({2, 9, 9});
  const auto next_after = [](const auto& call) {
    torch::manual_seed(21);
    call();
    return torch::randint(1 << 30, {1}).item<std::int64_t>();
  };
  const auto untouched = next_after([] {});
  EXPECT_EQ(next_after([&] { causal_softmax_dropout(s, kScale, 0.5, false); }), untouched);
  EXPECT_EQ(next_after([&] { causal_softmax_dropout(s, kScale, 0.0, true); }), untouched);
  EXPECT_EQ(next_after([&] { causal_softmax_dropout(s, kScale, 0.5, true); }),
            next_after([&] { lockstep::models::fast_dropout(s, 0.5, true); }));
  torch::manual_seed(22);
  const auto a = causal_softmax_dropout(s, kScale, 0.5, true), b = causal_softmax_dropout(s, kScale, 0.5, true);
  EXPECT_FALSE(torch::equal(a, b)) << "the next call draws another mask";
}

// A strided view of the scores gives what its contiguous copy gives; other dtypes, p = 1, and
// out-of-range p or non-square scores take libtorch's path or a clear error.
TEST(CausalSoftmaxDropout, StridedInputsOtherDtypesAndBadArguments) {
  torch::manual_seed(23);
  const auto base = torch::randn({3, 17, 17});
  const auto strided = base.transpose(1, 2);
  EXPECT_TRUE(torch::equal(causal_softmax_dropout(strided, kScale, 0.0, true),
                           causal_softmax_dropout(strided.contiguous(), kScale, 0.0, true)));
  const auto wide = base.to(torch::kDouble);
  EXPECT_TRUE(torch::allclose(causal_softmax_dropout(wide, kScale, 0.0, true), stepwise(wide, true)));
  EXPECT_EQ(causal_softmax_dropout(base, kScale, 1.0, true).abs().sum().item<float>(), 0);
  EXPECT_THROW(causal_softmax_dropout(base, kScale, 1.5, true), lockstep::ConfigError);
  EXPECT_THROW(causal_softmax_dropout(torch::randn({2, 3, 4}), kScale, 0.1, true), lockstep::ConfigError);
}
