// The fused bias and GELU against libtorch's gelu(x + bias): values and both gradients, both
// forms, float32 and bf16, on ragged, strided and odd shapes, and the paths it leaves to libtorch.
#include "lockstep/models/activation.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "close.h"

using lockstep::models::fast_bias_gelu;
using lockstep::testing::close;

namespace {

struct Outcome {
  torch::Tensor y, dx, dbias;
};

// y = gelu(x + bias) and the gradients of (y * g).sum(), through `f`, all in float64 for the
// reference (libtorch's ops on x and bias widened) or as given.
template <class F>
Outcome run(const F& f, const torch::Tensor& x, const torch::Tensor& bias, const torch::Tensor& g) {
  auto xv = x.detach().clone().requires_grad_(true);
  auto bv = bias.detach().clone().requires_grad_(true);
  auto y = f(xv, bv);
  (y.to(torch::kDouble) * g).sum().backward();
  return {y.detach(), xv.grad(), bv.grad()};
}

// The reference: libtorch's ops in float64 on the same inputs.
Outcome reference(const torch::Tensor& x, const torch::Tensor& bias, const torch::Tensor& g, const std::string& form) {
  auto out = run([&](const torch::Tensor& xv, const torch::Tensor& bv) {
    return torch::gelu(xv.to(torch::kDouble) + bv.to(torch::kDouble), form);
  }, x, bias, g);
  return out;
}

}  // namespace

// Each dtype's tolerance: float32 a few ulps of the value (the kernels' exp and erfc are within
// a few float ulps; the sums in a different order); bf16 one rounding of its 8-bit significand
// (2^-8 relative) on the output and on the input gradient, each rounded once from float. The
// bias gradient is a sum over rows, kept in float: against the exact sum it is off by float
// rounding when x is float, and by the rounding of dy and x to bf16 when they are bf16.
TEST(FastBiasGelu, MatchesLibtorchsGeluOfTheSumInBothFormsAndDtypes) {
  torch::manual_seed(7);
  const std::vector<std::vector<std::int64_t>> shapes = {{1, 1}, {3, 17}, {5, 7, 33}, {64, 2048}, {2, 3, 4, 129}};
  for (const std::string form : {"none", "tanh"}) {
    for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
      for (const auto& shape : shapes) {
        const auto x = (torch::randn(shape) * 3).to(dtype);
        const auto bias = torch::randn({shape.back()});
        const auto g = torch::randn(shape, torch::kDouble);
        const Outcome want = reference(x, bias, g, form);
        const Outcome got = run([&](const torch::Tensor& xv, const torch::Tensor& bv) {
          return fast_bias_gelu(xv, bv, form);
        }, x, bias, g);
        const bool bf16 = dtype == torch::kBFloat16;
        const std::string where = form + (bf16 ? " bf16 " : " float ") + std::to_string(x.numel());
        EXPECT_EQ(got.y.scalar_type(), dtype) << where;
        EXPECT_EQ(got.dx.scalar_type(), dtype) << where;
        EXPECT_EQ(got.dbias.scalar_type(), torch::kFloat) << where;
        EXPECT_TRUE(close(got.y, want.y, bf16 ? 1.0 / 128 : 1e-5, bf16 ? 1e-6 : 1e-6)) << where << " (values)";
        EXPECT_TRUE(close(got.dx, want.dx, bf16 ? 1.0 / 128 : 1e-5, bf16 ? 1e-3 : 1e-5)) << where << " (x's gradient)";
        const double rows = static_cast<double>(x.numel() / shape.back());
        EXPECT_TRUE(close(got.dbias, want.dbias, bf16 ? 1.0 / 64 : 1e-4, (bf16 ? 2e-2 : 1e-5) * std::sqrt(rows)))
            << where << " (bias's gradient)";
      }
    }
  }
}

// A transposed (strided) input and a bf16 bias: the same values as from contiguous copies.
TEST(FastBiasGelu, TakesStridedInputsAndABf16Bias) {
  torch::manual_seed(8);
  const auto x = torch::randn({40, 24}).t();  // 24 x 40, not contiguous
  const auto bias = torch::randn({40}).to(torch::kBFloat16);
  const auto g = torch::randn({24, 40}, torch::kDouble);
  const Outcome got = run([](const torch::Tensor& xv, const torch::Tensor& bv) { return fast_bias_gelu(xv, bv, "tanh"); },
                          x, bias, g);
  const Outcome want = reference(x, bias, g, "tanh");
  EXPECT_TRUE(close(got.y, want.y, 1e-5, 1e-6));
  EXPECT_TRUE(close(got.dx, want.dx, 1e-5, 1e-5));
  EXPECT_EQ(got.dbias.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(close(got.dbias, want.dbias, 1.0 / 128, 1e-2));
}

// The far tails and non-finite values: gelu is x far right, 0 far left (not NaN from an
// overflowed exp), and a NaN stays a NaN.
TEST(FastBiasGelu, TailsAreExactAndANaNStaysANaN) {
  const auto x = torch::tensor({-1e6f, -100.0f, -20.0f, 20.0f, 100.0f, 1e6f, NAN});
  const auto zero = torch::zeros({7});
  for (const std::string form : {"none", "tanh"}) {
    const auto y = fast_bias_gelu(x.view({1, 7}), zero, form).flatten();
    for (int i = 0; i < 3; ++i) EXPECT_NEAR(y[i].item<float>(), 0.0f, 1e-30f) << form << " at " << x[i].item<float>();
    for (int i = 3; i < 6; ++i) EXPECT_EQ(y[i].item<float>(), x[i].item<float>()) << form;
    EXPECT_TRUE(std::isnan(y[6].item<float>())) << form;
  }
}

// What the kernel does not take is libtorch's gelu of the sum, as written.
TEST(FastBiasGelu, ElsewhereIsLibtorchsGeluOfTheSum) {
  const auto x = torch::randn({4, 6}, torch::kDouble);  // float64: no kernel
  const auto bias = torch::randn({6}, torch::kDouble);
  EXPECT_TRUE(torch::equal(fast_bias_gelu(x, bias, "none"), torch::gelu(x + bias, "none")));
  const auto wide = torch::randn({4, 6});
  const auto broadcast = torch::randn({1});  // not one per column
  EXPECT_TRUE(torch::equal(fast_bias_gelu(wide, broadcast, "tanh"), torch::gelu(wide + broadcast, "tanh")));
}
