// Counting a model's matrix products: the GPT's own count against one made from its parameters,
// linear layers found in any module tree, an unknown module left uncounted, a measured rate.
#include "lockstep/train/model_flops.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "lockstep/models/gpt.h"

using namespace lockstep;
using lockstep::train::Matmul;

// Per sample of T tokens: every linear weight and the tied head (the token embedding) multiply
// each token once (2 FLOPs per weight), attention's two T x T products cost 4 T^2 C per layer,
// training three times the forward. Counted here from the parameters the model holds.
TEST(ModelFlops, TheGptCountsWhatItsParametersAndAttentionMultiply) {
  models::GptConfig c;
  c.vocab_size = 64, c.block_size = 16, c.n_layer = 3, c.n_head = 4, c.n_embd = 32;
  models::GptLmHeadModel lm(c);
  double weights = static_cast<double>(lm->transformer->wte->weight.numel());
  for (const auto& m : lm->modules())
    if (const auto* linear = m->as<torch::nn::Linear>())
      weights += static_cast<double>(linear->weight.numel());
  const double t = c.block_size, per_sample = 3 * (2 * t * weights + c.n_layer * 4 * t * t * c.n_embd);
  const auto products = train::model_matmuls(*lm, 1);
  ASSERT_TRUE(products);
  EXPECT_DOUBLE_EQ(train::training_flops(*products), per_sample);
  // Linear in the micro-batch.
  EXPECT_DOUBLE_EQ(train::training_flops(*train::model_matmuls(*lm, 8)), 8 * per_sample);

  models::GptForSequenceClassification classifier(c, 5);
  const auto classified = train::model_matmuls(*classifier, 1);
  ASSERT_TRUE(classified);
  // The body's products, and the score on the last token instead of the head on every one.
  EXPECT_DOUBLE_EQ(train::training_flops(*classified),
                   per_sample - 3 * 2 * t * c.vocab_size * c.n_embd + 3 * 2.0 * c.n_embd * 5);
}

TEST(ModelFlops, LinearLayersAreFoundInAnyTreeAndOtherWeightsLeaveTheCountUnknown) {
  torch::nn::Module mlp;  // a linear layer, a norm, and one nested a level down
  mlp.register_module("first", torch::nn::Linear(8, 16));
  mlp.register_module("norm", torch::nn::LayerNorm(std::vector<int64_t>{16}));
  mlp.register_module("blocks", torch::nn::ModuleList(torch::nn::Linear(16, 4)));
  const auto products = train::model_matmuls(mlp, 10);
  ASSERT_TRUE(products);
  EXPECT_EQ(*products, (std::vector<Matmul>{{1, 10, 8, 16}, {1, 10, 16, 4}}));
  torch::nn::Sequential cnn(torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3)), torch::nn::Flatten(),
                            torch::nn::Linear(4 * 26 * 26, 10));
  EXPECT_FALSE(train::model_matmuls(*cnn, 10)) << "a convolution's products depend on its input: not counted";
}

TEST(ModelFlops, TheMeasuredRateIsAPositiveFiniteFlopRateAndLeavesTheGeneratorAlone) {
  const std::vector<Matmul> products = {{1, 64, 128, 256}, {4, 16, 32, 16}};
  torch::manual_seed(11);
  const auto expected = torch::rand({4});
  torch::manual_seed(11);
  for (torch::Dtype dtype : {torch::kFloat, torch::kBFloat16}) {
    const double rate = train::measure_matmul_rate(products, dtype, 0.002);
    EXPECT_GT(rate, 1e6) << dtype;  // a product of these shapes takes far less than a second
    EXPECT_TRUE(std::isfinite(rate)) << dtype;
  }
  // A probed run trains on the same random draws as one that was not probed.
  EXPECT_TRUE(torch::equal(torch::rand({4}), expected));
}
