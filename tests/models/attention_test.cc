// The attention probabilities and their dropout in one pass (models/attention.h) against
// libtorch's ops: without dropout, the masked softmax in float64; with it, fast_dropout of
// libtorch's softmax from the same generator state (the same elements dropped). Values and the
// scores' gradient, float32 and bf16, on ragged, odd and strided shapes; the seeds it draws; the
// paths it leaves to libtorch.
#include "lockstep/models/attention.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <vector>

#include "close.h"
#include "lockstep/ddp/autocast.h"
#include "lockstep/error.h"
#include "lockstep/models/dropout.h"
#include "lockstep/models/gpt.h"

using lockstep::models::causal_softmax_dropout;
using lockstep::testing::close;

namespace {

constexpr double kScale = 0.37;

struct AttentionOutcome {
  torch::Tensor y, ds;
};

// y = f(scores) and the scores' gradient of (y * g).sum().
template <class F>
AttentionOutcome run(const F& f, const torch::Tensor& scores, const torch::Tensor& g) {
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

// causal_attention_in_strips (models/attention.h): the whole attention from q, k and v in strips
// of queries, against the stepwise attention (the scores' product, causal_softmax_dropout, the
// product with v), forward and the three gradients.
namespace {

using lockstep::models::causal_attention_in_strips;

struct Gradients {
  torch::Tensor y, dq, dk, dv;
};

// y = f(q, k, v) and the gradients of (y * g).sum().
template <class F>
Gradients attend(const F& f, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                 const torch::Tensor& g) {
  auto a = q.detach().clone().requires_grad_(true), b = k.detach().clone().requires_grad_(true),
       c = v.detach().clone().requires_grad_(true);
  const auto y = f(a, b, c);
  (y.to(torch::kDouble) * g).sum().backward();
  return {y.detach(), a.grad(), b.grad(), c.grad()};
}

// The attention as separate ops, in the inputs' dtype or (wide) float64; the mask (p > 0) is
// causal_softmax_dropout's, drawn from the generator's state.
Gradients stepwise_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& g, double p, bool wide) {
  return attend(
      [&](const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& c) {
        const auto cast = [&](const torch::Tensor& x) { return wide ? x.to(torch::kDouble) : x; };
        const auto s = torch::matmul(cast(a), cast(b).transpose(-2, -1));
        return torch::matmul(causal_softmax_dropout(s, kScale, p, true), cast(c));
      },
      q, k, v, g);
}

Gradients in_strips(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& g,
                    double p, std::int64_t rows) {
  return attend(
      [&](const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& c) {
        return causal_attention_in_strips(a, b, c, kScale, p, true, rows);
      },
      q, k, v, g);
}

// |a - b| / |b| in the L2 norm: unlike the worst element, not a whole bf16 ulp up or down by luck.
double relative(const torch::Tensor& a, const torch::Tensor& b) {
  const auto wide = b.to(torch::kDouble);
  return (a.to(torch::kDouble) - wide).norm().item<double>() / (wide.norm().item<double>() + 1e-30);
}

// The output's and the three gradients' relative errors.
std::vector<double> errors(const Gradients& a, const Gradients& b) {
  return {relative(a.y, b.y), relative(a.dq, b.dq), relative(a.dk, b.dk), relative(a.dv, b.dv)};
}

struct StripCase {
  std::vector<std::int64_t> shape;  // q's and k's [..., T, d]
  std::int64_t value_width, rows;   // v's last dimension; queries per strip (0: the default)
};

// Strips of one query, of a few, ragged (T not a multiple), the whole T at once, the default; odd
// widths; v wider or narrower than q.
const std::vector<StripCase> kStripCases = {
    {{1, 1, 4}, 4, 0},       {{2, 3, 37, 24}, 24, 1},  {{2, 3, 37, 24}, 24, 5}, {{2, 3, 37, 24}, 8, 16},
    {{3, 37, 24}, 40, 37},   {{1, 2, 130, 16}, 16, 48}, {{1, 2, 130, 16}, 16, 0}, {{2, 1, 2, 64, 9}, 9, 17}};

}  // namespace

// float32 within rounding of float64 everywhere; bf16's relative error (L2) no more than 1.5x the
// stepwise bf16 ops' (the keys' and values' gradients sum the strips' rounded products).
TEST(CausalAttentionInStrips, WithoutDropoutItIsTheStepwiseAttentionAndItsGradients) {
  torch::manual_seed(31);
  for (const auto& c : kStripCases) {
    auto vshape = c.shape;
    vshape.back() = c.value_width;
    const auto q = torch::randn(c.shape), k = torch::randn(c.shape), v = torch::randn(vshape);
    const auto g = torch::randn(vshape, torch::kDouble);
    const auto want = stepwise_attention(q, k, v, g, 0.0, true);
    const auto got = in_strips(q, k, v, g, 0.0, c.rows);
    EXPECT_EQ(got.y.scalar_type(), torch::kFloat);
    EXPECT_TRUE(close(got.y, want.y, 1e-4, 1e-6)) << c.shape << " rows " << c.rows;
    EXPECT_TRUE(close(got.dq, want.dq, 1e-4, 1e-5)) << c.shape << " rows " << c.rows;
    EXPECT_TRUE(close(got.dk, want.dk, 1e-4, 1e-5)) << c.shape << " rows " << c.rows;
    EXPECT_TRUE(close(got.dv, want.dv, 1e-4, 1e-5)) << c.shape << " rows " << c.rows;

    const auto q16 = q.to(torch::kBFloat16), k16 = k.to(torch::kBFloat16), v16 = v.to(torch::kBFloat16);
    const auto want16 = stepwise_attention(q16, k16, v16, g, 0.0, true);
    const auto got16 = errors(in_strips(q16, k16, v16, g, 0.0, c.rows), want16);
    const auto libtorch16 = errors(stepwise_attention(q16, k16, v16, g, 0.0, false), want16);
    for (std::size_t i = 0; i < got16.size(); ++i)
      EXPECT_LE(got16[i], 1.5 * libtorch16[i] + 1e-3) << c.shape << " rows " << c.rows << " output " << i;
  }
}

// With dropout, the mask the stepwise attention's causal_softmax_dropout draws from the same state
// (the same elements dropped wherever the strips fall): float32 within rounding of it, bf16 no
// further from it than the stepwise bf16 ops are (relative L2, as above).
TEST(CausalAttentionInStrips, WithDropoutItDropsWhatTheStepwiseAttentionDrops) {
  torch::manual_seed(32);
  const auto q = torch::randn({2, 3, 70, 16}), k = torch::randn({2, 3, 70, 16}), v = torch::randn({2, 3, 70, 16});
  const auto g = torch::randn({2, 3, 70, 16}, torch::kDouble);
  for (const std::int64_t rows : {7, 32, 70}) {
    torch::manual_seed(33);
    const auto got = in_strips(q, k, v, g, 0.3, rows);
    torch::manual_seed(33);
    const auto want = stepwise_attention(q, k, v, g, 0.3, false);
    EXPECT_TRUE(close(got.y, want.y, 1e-4, 1e-5)) << rows;
    EXPECT_TRUE(close(got.dq, want.dq, 1e-4, 1e-5)) << rows;
    EXPECT_TRUE(close(got.dk, want.dk, 1e-4, 1e-5)) << rows;
    EXPECT_TRUE(close(got.dv, want.dv, 1e-4, 1e-5)) << rows;

    const auto q16 = q.to(torch::kBFloat16), k16 = k.to(torch::kBFloat16), v16 = v.to(torch::kBFloat16);
    torch::manual_seed(33);
    const auto got16 = in_strips(q16, k16, v16, g, 0.3, rows);
    torch::manual_seed(33);
    const auto libtorch16 = stepwise_attention(q16, k16, v16, g, 0.3, false);
    torch::manual_seed(33);
    const auto want16 = stepwise_attention(q16, k16, v16, g, 0.3, true);  // the same mask, in float64
    const auto bf16_errors = errors(got16, want16), libtorch_errors = errors(libtorch16, want16);
    for (std::size_t i = 0; i < bf16_errors.size(); ++i)
      EXPECT_LE(bf16_errors[i], 1.5 * libtorch_errors[i] + 1e-3) << rows << " output " << i;
  }
  torch::manual_seed(34);
  const auto a = causal_attention_in_strips(q, k, v, kScale, 0.3, true, 16);
  const auto b = causal_attention_in_strips(q, k, v, kScale, 0.3, true, 16);
  EXPECT_FALSE(torch::equal(a, b)) << "each call draws its own mask";
  EXPECT_TRUE(torch::equal(causal_attention_in_strips(q, k, v, kScale, 0.3, false, 16),
                           causal_attention_in_strips(q, k, v, kScale, 0.0, true, 16)))
      << "evaluation drops nothing";
}

// Under CPU autocast to bf16 it computes in bf16 as autocast's products would, and float32
// inputs get float32 gradients; one seed drawn per dropping call, as fast_dropout draws.
TEST(CausalAttentionInStrips, FollowsAutocastAndDrawsOneSeedPerDroppingCall) {
  torch::manual_seed(35);
  const auto q = torch::randn({2, 40, 8}), k = torch::randn({2, 40, 8}), v = torch::randn({2, 40, 8});
  const auto g = torch::randn({2, 40, 8}, torch::kDouble);
  Gradients got;
  {
    lockstep::Autocast autocast(torch::kBFloat16, c10::kCPU);
    got = in_strips(q, k, v, g, 0.0, 16);
  }
  EXPECT_EQ(got.y.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(got.dq.scalar_type(), torch::kFloat);
  const auto q16 = q.to(torch::kBFloat16), k16 = k.to(torch::kBFloat16), v16 = v.to(torch::kBFloat16);
  EXPECT_TRUE(torch::equal(got.y, causal_attention_in_strips(q16, k16, v16, kScale, 0.0, true, 16)));
  {
    lockstep::Autocast autocast(torch::kBFloat16, c10::kCPU);
    const auto wide = q.to(torch::kDouble);
    EXPECT_EQ(causal_attention_in_strips(wide, wide, wide, kScale, 0.0, true).scalar_type(), torch::kDouble)
        << "autocast leaves float64 alone";
  }

  const auto next_after = [](const auto& call) {
    torch::manual_seed(36);
    call();
    return torch::randint(1 << 30, {1}).item<std::int64_t>();
  };
  EXPECT_EQ(next_after([&] { causal_attention_in_strips(q, k, v, kScale, 0.5, false); }), next_after([] {}));
  EXPECT_EQ(next_after([&] { causal_attention_in_strips(q, k, v, kScale, 0.5, true); }),
            next_after([&] { lockstep::models::fast_dropout(q, 0.5, true); }));
}

// Mismatched shapes and a negative strip are clear errors; float64 and p = 1 take libtorch's path.
TEST(CausalAttentionInStrips, BadArgumentsAndOtherDtypes) {
  const auto q = torch::randn({2, 9, 4});
  EXPECT_THROW(causal_attention_in_strips(q, torch::randn({2, 8, 4}), q, kScale, 0.0, true), lockstep::ConfigError);
  EXPECT_THROW(causal_attention_in_strips(q, q, torch::randn({2, 8, 4}), kScale, 0.0, true), lockstep::ConfigError);
  EXPECT_THROW(causal_attention_in_strips(q, q, q, kScale, 0.0, true, -1), lockstep::ConfigError);
  EXPECT_THROW(causal_attention_in_strips(q, q, q, kScale, 1.5, true), lockstep::ConfigError);
  const auto wide = q.to(torch::kDouble);
  const auto g = torch::randn({2, 9, 4}, torch::kDouble);
  EXPECT_TRUE(close(causal_attention_in_strips(wide, wide, wide, kScale, 0.0, true),
                    stepwise_attention(wide, wide, wide, g, 0.0, true).y, 1e-12, 1e-12));
  EXPECT_EQ(causal_attention_in_strips(q, q, q, kScale, 1.0, true).abs().sum().item<float>(), 0);
}

// The GPT's attention (models::causal_attention) goes through the strips from 512 tokens on the
// CPU: the same mask and the same arithmetic, so bit for bit what the strips give.
TEST(CausalAttentionInStrips, TheGptAttendsInStripsFrom512Tokens) {
  torch::manual_seed(37);
  const auto q = torch::randn({1, 2, 512, 8}), k = torch::randn({1, 2, 512, 8}), v = torch::randn({1, 2, 512, 8});
  torch::manual_seed(38);
  const auto gpt = lockstep::models::causal_attention(q, k, v, 0.1, true);
  torch::manual_seed(38);
  const auto strips = causal_attention_in_strips(q, k, v, 1 / std::sqrt(8.0), 0.1, true);
  EXPECT_TRUE(torch::equal(gpt, strips));
}
