// The zero-bubble split on its own: the input half computes the input's gradient and no weight's,
// the weight half then leaves every weight's gradient bitwise what one whole backward leaves, and
// the first stage (token ids in, no input gradient) does everything in its weight half.
#include "split_backward.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "pipe_runs.h"

namespace lockstep::testing {
namespace {

struct Grads {
  torch::Tensor input;
  std::vector<torch::Tensor> weights;
};

std::vector<torch::Tensor> grads_of(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) out.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  return out;
}

// Units [begin, end) of a fresh GPT on a fixed input; whole backward or split.
Grads run(int begin, int end, bool split, bool* weights_after_input_half = nullptr) {
  at::set_num_threads(1);
  auto model = make_model(tiny_gpt(0), false);
  auto units = model->pipeline_units();
  std::vector<torch::Tensor> params;
  for (int u = begin; u < end; ++u)
    for (const auto& p : units[std::size_t(u)].parameters) params.push_back(p.second);
  torch::manual_seed(3);
  torch::Tensor input = begin == 0 ? torch::randint(32, {3, 8}, torch::kLong)
                                   : torch::randn({3, 8, 16}).requires_grad_(true);
  torch::Tensor x = input;
  for (int u = begin; u < end; ++u) x = units[std::size_t(u)].forward(x, 0);
  const torch::Tensor grad = torch::randn(x.sizes());
  Grads g;
  if (!split) {
    x.backward(grad);
    g.input = begin == 0 ? torch::Tensor() : input.grad().clone();
  } else {
    pipe::SplitBackward halves;
    g.input = halves.input_half(x, grad, begin == 0 ? torch::Tensor() : input);
    if (weights_after_input_half) {
      *weights_after_input_half = false;
      for (const auto& p : params) *weights_after_input_half |= p.grad().defined();
    }
    halves.weight_half();
  }
  g.weights = grads_of(params);
  return g;
}

void expect_bitwise(const Grads& whole, const Grads& split) {
  ASSERT_EQ(whole.input.defined(), split.input.defined());
  if (whole.input.defined()) {
    EXPECT_TRUE(torch::equal(whole.input, split.input));
  }
  ASSERT_EQ(whole.weights.size(), split.weights.size());
  for (std::size_t i = 0; i < whole.weights.size(); ++i) {
    ASSERT_TRUE(split.weights[i].defined()) << "weight " << i << " got no gradient";
    EXPECT_TRUE(torch::equal(whole.weights[i], split.weights[i])) << "weight " << i;
  }
}

TEST(SplitBackward, TheInputHalfLeavesTheWeightsAndTheWeightHalfMatchesOneBackward) {
  bool touched = true;
  const Grads split = run(2, 5, true, &touched);  // two blocks and the head
  EXPECT_FALSE(touched) << "the input half accumulated a weight's gradient";
  expect_bitwise(run(2, 5, false), split);
}

TEST(SplitBackward, TheFirstStageDoesEverythingInItsWeightHalf) {
  bool touched = true;
  const Grads split = run(0, 3, true, &touched);  // the embeddings and two blocks
  EXPECT_FALSE(touched);
  EXPECT_FALSE(split.input.defined());
  expect_bitwise(run(0, 3, false), split);
}

}  // namespace
}  // namespace lockstep::testing
