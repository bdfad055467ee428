// The GPT's linear layer: its bf16 path on the CPU gives PyTorch's forward and the exact products'
// gradients to bf16's precision, its transposing kernel moves every element to its place, and
// outside bf16 it is the C++ frontend's linear itself.
#include "lockstep/models/linear.h"

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "lockstep/ddp/torch_compat.h"

using lockstep::models::fast_linear;
using lockstep::models::transpose_contiguous;

namespace {

// bf16 autocast on the CPU for a scope, as the Trainer's --bf16 sets it.
class CpuBf16Autocast {
 public:
  CpuBf16Autocast() {
    lockstep::torch_compat::set_cpu_autocast_enabled(true);
    lockstep::torch_compat::set_cpu_autocast_dtype(at::kBFloat16);
    at::autocast::increment_nesting();
  }
  ~CpuBf16Autocast() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    lockstep::torch_compat::set_cpu_autocast_enabled(false);
  }
};

struct Layer {
  torch::Tensor x, weight, bias;
};

Layer random_layer(std::vector<std::int64_t> x_sizes, std::int64_t out, bool bias,
                   torch::Dtype dtype = torch::kFloat) {
  torch::manual_seed(11);
  const auto in = x_sizes.back();
  Layer l;
  l.x = torch::randn(x_sizes).to(dtype).requires_grad_();
  l.weight = (torch::randn({out, in}) / std::sqrt(static_cast<double>(in))).to(dtype).requires_grad_();
  if (bias) l.bias = torch::randn({out}).to(dtype).requires_grad_();
  return l;
}

// The largest difference from `expected`, relative to its largest magnitude.
double relative_error(const torch::Tensor& got, const torch::Tensor& expected) {
  const auto e = expected.to(torch::kDouble);
  return (got.to(torch::kDouble) - e).abs().max().item<double>() / e.abs().max().item<double>();
}

}  // namespace

TEST(Linear, TransposingPutsEveryElementInItsPlace) {
  // Whole 8 x 8 blocks, ragged edges, one tile and several, and a strided view.
  for (auto [rows, cols] :
       {std::pair<std::int64_t, std::int64_t>{2048, 512}, {13, 37}, {8, 8}, {1, 5}, {129, 300}}) {
    for (auto dtype : {torch::kBFloat16, torch::kHalf, torch::kFloat}) {
      const auto m = torch::randn({rows, cols}).to(dtype);
      EXPECT_TRUE(torch::equal(transpose_contiguous(m), m.t().contiguous()))
          << rows << "x" << cols << " " << dtype;
    }
  }
  const auto strided = torch::randn({64, 100}).to(torch::kBFloat16).slice(1, 3, 90);
  const auto t = transpose_contiguous(strided);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_TRUE(torch::equal(t, strided.t()));
}

TEST(Linear, UnderBf16AutocastGivesPyTorchsOutputAndTheProductsGradients) {
  // Wider outputs than inputs and narrower (the kernel transposes the narrower operand), with a
  // bias and without.
  for (auto [in, out] : {std::pair<std::int64_t, std::int64_t>{64, 96}, {96, 64}}) {
    for (bool bias : {true, false}) {
      SCOPED_TRACE(std::to_string(in) + " -> " + std::to_string(out) + (bias ? " with bias" : ""));
      auto ours = random_layer({4, 48, in}, out, bias), theirs = random_layer({4, 48, in}, out, bias);
      torch::manual_seed(5);
      const auto upstream = torch::randn({4, 48, out}).to(torch::kBFloat16);
      torch::Tensor y_ours, y_theirs;
      {
        CpuBf16Autocast autocast;
        y_ours = fast_linear(ours.x, ours.weight, ours.bias);
        // ATen's linear, as torch.nn.functional.linear in Python calls it (the C++ frontend's adds
        // the bias to a rounded 3-D product instead).
        y_theirs = at::linear(theirs.x, theirs.weight, theirs.bias);
      }
      EXPECT_EQ(y_ours.scalar_type(), torch::kBFloat16);
      EXPECT_TRUE(torch::equal(y_ours, y_theirs))
          << "the forward is ATen's linear: one product with the bias";
      y_ours.backward(upstream);
      y_theirs.backward(upstream);
      // Against the exact products of the bf16 operands: bf16 rounds each result to 8 bits.
      const auto x = ours.x.to(torch::kBFloat16).to(torch::kDouble).reshape({-1, in});
      const auto w = ours.weight.to(torch::kBFloat16).to(torch::kDouble);
      const auto g = upstream.to(torch::kDouble).reshape({-1, out});
      const double bf16_rounding = 1.0 / 128;
      EXPECT_LT(relative_error(ours.weight.grad(), g.t().mm(x)), bf16_rounding);
      EXPECT_LT(relative_error(ours.x.grad().reshape({-1, in}), g.mm(w)), bf16_rounding);
      EXPECT_LT(relative_error(ours.weight.grad(), theirs.weight.grad()), bf16_rounding);
      EXPECT_TRUE(torch::equal(ours.x.grad(), theirs.x.grad()));
      EXPECT_EQ(ours.weight.grad().scalar_type(), torch::kFloat)
          << "the parameter's gradient is in its own dtype";
      if (bias) {
        EXPECT_LT(relative_error(ours.bias.grad(), g.sum(0)), bf16_rounding);
      }
    }
  }
}

TEST(Linear, Bf16TensorsWithoutAutocastTakeTheSamePath) {
  auto l = random_layer({256, 32}, 40, /*bias=*/true, torch::kBFloat16);
  const auto x = l.x.detach();  // no input gradient wanted: only the weight's and the bias's
  torch::manual_seed(6);
  const auto upstream = torch::randn({256, 40}).to(torch::kBFloat16);
  fast_linear(x, l.weight, l.bias).backward(upstream);
  const auto g = upstream.to(torch::kDouble);
  EXPECT_LT(relative_error(l.weight.grad(), g.t().mm(x.to(torch::kDouble))), 1.0 / 128);
  EXPECT_LT(relative_error(l.bias.grad(), g.sum(0)), 1.0 / 128);
  EXPECT_EQ(l.weight.grad().scalar_type(), torch::kBFloat16);
}

TEST(Linear, InFloat32ItIsLibtorchsLinearBitForBit) {
  auto ours = random_layer({3, 10, 24}, 20, true), theirs = random_layer({3, 10, 24}, 20, true);
  const auto y_ours = fast_linear(ours.x, ours.weight, ours.bias);
  const auto y_theirs = torch::nn::functional::linear(theirs.x, theirs.weight, theirs.bias);
  EXPECT_TRUE(torch::equal(y_ours, y_theirs));
  y_ours.sum().backward();
  y_theirs.sum().backward();
  EXPECT_TRUE(torch::equal(ours.weight.grad(), theirs.weight.grad()));
  EXPECT_TRUE(torch::equal(ours.x.grad(), theirs.x.grad()));
  EXPECT_TRUE(torch::equal(ours.bias.grad(), theirs.bias.grad()));
}
