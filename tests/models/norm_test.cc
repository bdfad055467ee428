// Layer norm with the cast in the same pass against libtorch's layer_norm in float64: values and
// the three gradients, with and without bf16 autocast, on ragged, strided and odd shapes; a
// constant row; and the paths it leaves to libtorch.
#include "lockstep/models/norm.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <optional>
#include <string>
#include <vector>

#include "close.h"
#include "lockstep/ddp/autocast.h"

using lockstep::models::fast_layer_norm;
using lockstep::testing::close;

namespace {

constexpr double kEps = 1e-5;

struct NormOutcome {
  torch::Tensor y, dx, dweight, dbias;
};

// y = f(x, weight, bias) and the gradients of (y * g).sum(), under bf16 autocast when asked.
template <class F>
NormOutcome run(const F& f, const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
            const torch::Tensor& g, bool autocast) {
  auto xv = x.detach().clone().requires_grad_(true);
  auto wv = weight.detach().clone().requires_grad_(true);
  auto bv = bias.detach().clone().requires_grad_(true);
  torch::Tensor y;
  {
    lockstep::Autocast scope(autocast ? std::optional(at::kBFloat16) : std::nullopt, c10::DeviceType::CPU);
    y = f(xv, wv, bv);
  }
  (y.to(torch::kDouble) * g).sum().backward();
  return {y.detach(), xv.grad(), wv.grad(), bv.grad()};
}

NormOutcome reference(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                  const torch::Tensor& g) {
  return run([](const torch::Tensor& xv, const torch::Tensor& wv, const torch::Tensor& bv) {
    const auto d = [](const torch::Tensor& t) { return t.to(torch::kDouble); };
    return torch::layer_norm(d(xv), {xv.size(-1)}, d(wv), d(bv), kEps);
  }, x, weight, bias, g, false);
}

NormOutcome fused(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias, const torch::Tensor& g,
              bool autocast) {
  return run([](const torch::Tensor& xv, const torch::Tensor& wv, const torch::Tensor& bv) {
    return fast_layer_norm(xv, wv, bv, kEps);
  }, x, weight, bias, g, autocast);
}

}  // namespace

// Rows with a large mean beside their spread (the variance from two passes, not E[x^2] - m^2).
// Tolerances: float sums over a row in a different order than float64's, a few ulps of the
// row's scale; a bf16 result is one rounding of an 8-bit significand (2^-8 relative). Under
// autocast the gradient arrives in bf16, so the reference gets the same rounded gradient: what
// is compared is the kernel's arithmetic, in float either way. The weight's and bias's gradients
// are sums over rows: their tolerance grows with the root of the rows.
TEST(FastLayerNorm, MatchesLibtorchsLayerNormWithAndWithoutTheCast) {
  torch::manual_seed(5);
  const std::vector<std::vector<std::int64_t>> shapes = {{1, 1}, {3, 17}, {5, 7, 33}, {64, 512}, {2, 3, 4, 129}};
  for (const bool autocast : {false, true}) {
    for (const auto& shape : shapes) {
      const auto x = torch::randn(shape) * 3 + 40;
      const auto weight = torch::randn({shape.back()}), bias = torch::randn({shape.back()});
      auto g = torch::randn(shape, torch::kDouble);
      if (autocast) g = g.to(torch::kBFloat16).to(torch::kDouble);
      const NormOutcome want = reference(x, weight, bias, g);
      const NormOutcome got = fused(x, weight, bias, g, autocast);
      const std::string where = (autocast ? "bf16 out, " : "float out, ") + std::to_string(x.numel());
      EXPECT_EQ(got.y.scalar_type(), autocast ? torch::kBFloat16 : torch::kFloat) << where;
      EXPECT_EQ(got.dx.scalar_type(), torch::kFloat) << where;
      EXPECT_EQ(got.dweight.scalar_type(), torch::kFloat) << where;
      EXPECT_TRUE(close(got.y, want.y, autocast ? 1.0 / 128 : 1e-5, 1e-5)) << where << " (values)";
      // x's gradient is rstd times a difference of terms of the size of dy * weight: float's
      // rounding of those terms, not of the difference, sets its absolute error.
      const auto xd = x.to(torch::kDouble).flatten(0, -2);
      const double rstd = (1 / (xd.var(-1, /*unbiased=*/false) + kEps).sqrt()).max().item<double>();
      const double terms = (g * weight.to(torch::kDouble)).abs().max().item<double>();
      EXPECT_TRUE(close(got.dx, want.dx, 1e-4, 1e-5 * rstd * terms)) << where << " (x's gradient)";
      const double rows = static_cast<double>(x.numel() / shape.back());
      EXPECT_TRUE(close(got.dweight, want.dweight, 1e-4, 1e-4 * std::sqrt(rows))) << where << " (weight's gradient)";
      EXPECT_TRUE(close(got.dbias, want.dbias, 1e-5, 1e-5 * std::sqrt(rows))) << where << " (bias's gradient)";
    }
  }
}

// A transposed (strided) input gives what its contiguous copy gives.
TEST(FastLayerNorm, TakesStridedInputs) {
  torch::manual_seed(6);
  const auto x = torch::randn({40, 24}).t();  // 24 x 40, not contiguous
  const auto weight = torch::randn({40}), bias = torch::randn({40});
  const auto g = torch::randn({24, 40}, torch::kDouble);
  const NormOutcome got = fused(x, weight, bias, g, false);
  const NormOutcome want = reference(x, weight, bias, g);
  EXPECT_TRUE(close(got.y, want.y, 1e-5, 1e-5));
  EXPECT_TRUE(close(got.dx, want.dx, 1e-4, 1e-5));
  EXPECT_TRUE(close(got.dweight, want.dweight, 1e-4, 1e-4));
}

// A constant row has no spread: the result is the bias, and the gradients finite.
TEST(FastLayerNorm, AConstantRowGivesTheBias) {
  const auto x = torch::full({2, 64}, 3.25f);
  const auto weight = torch::randn({64}), bias = torch::randn({64});
  const NormOutcome got = fused(x, weight, bias, torch::randn({2, 64}, torch::kDouble), false);
  EXPECT_TRUE(torch::equal(got.y, bias.expand({2, 64})));
  EXPECT_TRUE(torch::isfinite(got.dx).all().item<bool>());
  EXPECT_TRUE(torch::isfinite(got.dweight).all().item<bool>());
}

// What the kernel does not take is libtorch's layer_norm, as written.
TEST(FastLayerNorm, ElsewhereIsLibtorchsLayerNorm) {
  const auto x = torch::randn({4, 6}, torch::kDouble);  // float64: no kernel
  const auto w = torch::randn({6}, torch::kDouble), b = torch::randn({6}, torch::kDouble);
  EXPECT_TRUE(torch::equal(fast_layer_norm(x, w, b, kEps), torch::layer_norm(x, {6}, w, b, kEps)));
  const auto xf = torch::randn({4, 6});
  const auto wf = torch::randn({6});
  EXPECT_TRUE(torch::equal(fast_layer_norm(xf, wf, torch::Tensor(), kEps),
                           torch::layer_norm(xf, {6}, wf, torch::Tensor(), kEps)));  // no bias
}

// A frozen norm (its weight and bias without gradients, as when fine-tuning adapters): x's
// gradient is the same, and the parameters get none.
TEST(FastLayerNorm, AFrozenNormGivesXsGradientAndNoneToItsParameters) {
  torch::manual_seed(9);
  const auto x = torch::randn({6, 48}).requires_grad_(true);
  const auto weight = torch::randn({48}), bias = torch::randn({48});  // no gradients wanted
  const auto g = torch::randn({6, 48});
  (fast_layer_norm(x, weight, bias, kEps) * g).sum().backward();
  const auto xr = x.detach().to(torch::kDouble).requires_grad_(true);
  (torch::layer_norm(xr, {48}, weight.to(torch::kDouble), bias.to(torch::kDouble), kEps) * g.to(torch::kDouble))
      .sum()
      .backward();
  EXPECT_TRUE(close(x.grad(), xr.grad(), 1e-4, 1e-5));
  EXPECT_FALSE(weight.grad().defined());
  EXPECT_FALSE(bias.grad().defined());
}
