// The GPT model and gradient checkpointing: shapes, causality, the same gradients with and
// without recomputation (dropout on), less activation memory, DDP over recomputed blocks equal
// to one process on the concatenated batch, loading a language model's body into a classifier.
#include "lockstep/models/gpt.h"

#include <gtest/gtest.h>
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <mutex>

#include "lockstep/ddp/ddp.h"
#include "lockstep/ddp/gradient_checkpoint.h"
#include "lockstep/ddp/torch_compat.h"
#include "lockstep/error.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train/tensor_memory.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::models;

namespace {

GptConfig tiny(double dropout = 0.0) {
  GptConfig c;
  c.vocab_size = 64;
  c.block_size = 16;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 32;
  c.dropout = dropout;
  return c;
}

GptLmHeadModel seeded_lm(const GptConfig& c, std::uint64_t seed = 7) {
  static std::mutex mu;  // torch's default generator is shared by the thread ranks
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(seed);
  return GptLmHeadModel(c);
}

torch::Tensor tokens(std::int64_t b, std::int64_t t, std::uint64_t seed) {
  torch::manual_seed(seed);
  return torch::randint(0, 64, {b, t}, torch::kLong);
}

torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

std::vector<torch::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p.grad().clone());
  return out;
}

// bf16 autocast on the CPU for a scope, as torch.autocast("cpu") does.
class Bf16 {
 public:
  explicit Bf16(bool on) : on_(on) {
    if (!on_) return;
    torch_compat::set_cpu_autocast_enabled(true);
    torch_compat::set_cpu_autocast_dtype(at::kBFloat16);
    at::autocast::increment_nesting();
  }
  ~Bf16() {
    if (!on_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    torch_compat::set_cpu_autocast_enabled(false);
  }

 private:
  bool on_;
};

double largest_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  return worst;
}

}  // namespace

TEST(Gpt, ShapesParameterCountAndABadConfigurationNamed) {
  auto lm = seeded_lm(tiny());
  auto logits = lm(tokens(3, 10, 1));
  EXPECT_EQ(logits.sizes(), (std::vector<std::int64_t>{3, 10, 64}));
  std::int64_t n = 0;
  for (const auto& p : lm->parameters()) n += p.numel();
  EXPECT_EQ(n, tiny().parameters());
  GptConfig bad = tiny();
  bad.n_head = 5;
  EXPECT_THROW(bad.validate(), ConfigError);
  EXPECT_THROW(lm(tokens(1, 17, 1)), ConfigError);  // longer than block_size 16
}

// Position t's logits do not depend on tokens after t.
TEST(Gpt, AttentionIsCausal) {
  auto lm = seeded_lm(tiny());
  lm->eval();
  auto a = tokens(1, 12, 3), b = a.clone();
  b.index_put_({0, 8}, (b.index({0, 8}) + 1) % 64);
  auto la = lm(a), lb = lm(b);
  using torch::indexing::Slice;
  EXPECT_TRUE(torch::equal(la.index({0, Slice(0, 8)}), lb.index({0, Slice(0, 8)})));
  EXPECT_FALSE(torch::equal(la.index({0, 8}), lb.index({0, 8})));
}

// causal_attention without dropout (fused on libtorch 2.x) is the textbook arithmetic: masked
// scores, softmax, weighted values, and so are its gradients. float32 to 1e-5: the fused kernel
// sums in its own order (online softmax), a few ulps from the stepwise path.
TEST(GptAttention, WithoutDropoutItIsTheMaskedSoftmaxOfTheScoresAndSoAreItsGradients) {
  torch::manual_seed(5);
  auto q = torch::randn({2, 3, 16, 8}, torch::requires_grad()), k = torch::randn({2, 3, 16, 8}, torch::requires_grad()),
       v = torch::randn({2, 3, 16, 8}, torch::requires_grad());
  const auto future = torch::ones({16, 16}, torch::kBool).triu(1);
  const auto textbook =
      torch::softmax((torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(8.0)).masked_fill(future, -std::numeric_limits<float>::infinity()), -1);
  const auto want = torch::matmul(textbook, v);
  const auto dy = torch::randn_like(want);
  const auto want_grads = torch::autograd::grad({want}, {q, k, v}, {dy});
  for (const bool training : {true, false}) {
    const double p = training ? 0.0 : 0.5;  // evaluation ignores p
    const auto got = causal_attention(q, k, v, p, training);
    EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-5)) << "training " << training;
    const auto grads = torch::autograd::grad({got}, {q, k, v}, {dy});
    for (std::size_t i = 0; i < 3; ++i) EXPECT_TRUE(torch::allclose(grads[i], want_grads[i], 1e-5, 1e-5)) << i;
  }
}

// While training with attention dropout the probabilities are dropped: the result moves, and two
// calls draw different masks.
TEST(GptAttention, WithDropoutWhileTrainingItDrops) {
  torch::manual_seed(6);
  const auto q = torch::randn({1, 2, 16, 8}), k = torch::randn({1, 2, 16, 8}), v = torch::randn({1, 2, 16, 8});
  const auto clean = causal_attention(q, k, v, 0.0, true);
  const auto a = causal_attention(q, k, v, 0.3, true), b = causal_attention(q, k, v, 0.3, true);
  EXPECT_FALSE(torch::allclose(a, clean, 1e-3, 1e-3));
  EXPECT_FALSE(torch::equal(a, b));
}

// attn_dropout unset is dropout's; set, it is its own, in config.json and in Hugging Face's
// attn_pdrop; out of [0, 1) it is refused by name.
TEST(GptAttention, AttentionDropoutFollowsDropoutUnlessSetAndTravelsWithTheConfig) {
  GptConfig c = tiny(0.2);
  EXPECT_EQ(c.attention_dropout(), 0.2);
  EXPECT_EQ(GptConfig::from_json(c.to_json()).attention_dropout(), 0.2);
  auto before = c.to_json();
  before.erase("attn_dropout");  // a checkpoint from before the field
  EXPECT_EQ(GptConfig::from_json(before).attention_dropout(), 0.2);
  c.attn_dropout = 0.0;
  EXPECT_EQ(GptConfig::from_json(c.to_json()).attention_dropout(), 0.0);
  EXPECT_EQ(GptConfig::from_json(c.to_json()).dropout, 0.2);
  c.attn_dropout = 1.0;
  try {
    c.validate();
    ADD_FAILURE() << "attn_dropout 1 accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("attn_dropout"), std::string::npos) << e.what();
  }
}

// With dropout on, recomputation draws the same masks: the gradients match those of the plain
// backward. Not bitwise: in the plain graph autograd sums a block input's two gradients (the
// residual's and the block's) in its own order, in the recomputed one the inner backward does;
// float32 reassociation moves the result by a few ulps (about 1e-7 relative), far below 1e-5.
TEST(GradientCheckpoint, GradientsEqualThoseWithoutRecomputationWithDropoutOn) {
  const GptConfig c = tiny(/*dropout=*/0.2);
  auto x = tokens(4, 16, 5), y = tokens(4, 16, 6);
  auto plain = seeded_lm(c), recomputed = seeded_lm(c);
  recomputed->set_gradient_checkpointing(true);
  torch::manual_seed(99);
  lm_loss(plain(x), y).backward();
  torch::manual_seed(99);
  lm_loss(recomputed(x), y).backward();
  const auto a = grads_of(*plain), b = grads_of(*recomputed);
  double scale = 0;
  for (const auto& g : a) scale = std::max(scale, g.abs().max().item<double>());
  EXPECT_LT(largest_difference(a, b), 1e-5 * scale);
  // The RNG after backward is where it would have been: the next step draws the same.
  const auto after_recomputation = torch::rand({4});
  torch::manual_seed(99);
  lm_loss(plain(x), y);
  EXPECT_TRUE(torch::equal(after_recomputation, torch::rand({4})));
}

TEST(GradientCheckpoint, KeepsLessActivationMemory) {
  lockstep::train::track_tensor_memory();
  GptConfig c = tiny();
  c.n_layer = 6;
  c.block_size = 64;
  c.n_embd = 64;
  auto x = tokens(16, 64, 5), y = tokens(16, 64, 6);
  auto peak_of = [&](bool checkpointing) {
    auto lm = seeded_lm(c);
    lm->set_gradient_checkpointing(checkpointing);
    const auto before = lockstep::train::tensor_bytes();
    lockstep::train::reset_peak_tensor_bytes();
    lm_loss(lm(x), y).backward();
    return lockstep::train::peak_tensor_bytes() - before;
  };
  const auto plain = peak_of(false), recomputed = peak_of(true);
  RecordProperty("plain_bytes", std::to_string(plain));
  RecordProperty("recomputed_bytes", std::to_string(recomputed));
  EXPECT_LT(recomputed, plain / 2) << "plain " << plain << " bytes, recomputed " << recomputed;
}

// DDP over recomputed blocks, 2 and 3 ranks, 3 SGD steps, equals one process on the
// concatenated batch (within 1e-5: the ranks' partial sums reassociate, about 1e-7 per step),
// and every parameter is counted ready once per backward, also with no_sync accumulation, bf16
// autocast and find_unused_parameters.
struct DdpCase {
  int world;
  bool accumulate, bf16, find_unused;
};

class CheckpointedDdp : public ::testing::TestWithParam<DdpCase> {};

TEST_P(CheckpointedDdp, EqualsOneProcessOnTheConcatenatedBatch) {
  const DdpCase k = GetParam();
  const GptConfig c = tiny();
  const int micro = k.accumulate ? 2 : 1;
  const std::int64_t per_rank = 2;
  auto x = tokens(per_rank * k.world * micro, 16, 11), y = tokens(per_rank * k.world * micro, 16, 12);
  auto reference = seeded_lm(c);
  reference->set_gradient_checkpointing(true);
  torch::optim::SGD ref_opt(reference->parameters(), 0.1);
  for (int step = 0; step < 3; ++step) {
    ref_opt.zero_grad();
    torch::Tensor loss;
    {
      Bf16 autocast(k.bf16);
      loss = lm_loss(reference(x).to(torch::kFloat), y);
    }
    loss.backward();
    ref_opt.step();
  }
  std::vector<std::vector<torch::Tensor>> finals(static_cast<std::size_t>(k.world));
  lockstep::testing::run_ranks_as_threads(k.world, comm::CommOptions{"shm"}, [&](comm::Communicator& comm) {
    auto lm = seeded_lm(c);
    lm->set_gradient_checkpointing(true);
    DdpOptions o;
    o.find_unused_parameters = k.find_unused;
    o.bucket_cap_mb = 0.01;  // several buckets, launched while backward still recomputes
    o.first_bucket_cap_mb = 0.01;
    DistributedDataParallel ddp(lm.ptr(), comm, o);
    torch::optim::SGD opt(lm->parameters(), 0.1);
    using torch::indexing::Slice;
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      for (int m = 0; m < micro; ++m) {
        const std::int64_t first = (static_cast<std::int64_t>(m) * k.world + comm.rank()) * per_rank;
        auto xs = x.index({Slice(first, first + per_rank)}), ys = y.index({Slice(first, first + per_rank)});
        std::optional<NoSync> guard;
        if (m + 1 < micro) guard.emplace(ddp.no_sync());
        torch::Tensor loss;
        {
          Bf16 autocast(k.bf16);
          loss = lm_loss(ddp.forward(xs).to(torch::kFloat), ys) / micro;
        }
        loss.backward();
      }
      opt.step();
    }
    for (const auto& p : lm->parameters()) finals[static_cast<std::size_t>(comm.rank())].push_back(p.detach().clone());
  });
  std::vector<torch::Tensor> expected;
  for (const auto& p : reference->parameters()) expected.push_back(p.detach().clone());
  const double tolerance = k.bf16 ? 2e-2 : 1e-5;  // bf16: the products round to 8 bits either way
  for (int r = 0; r < k.world; ++r) {
    EXPECT_LT(largest_difference(finals[static_cast<std::size_t>(r)], expected), tolerance) << "rank " << r;
    EXPECT_EQ(largest_difference(finals[static_cast<std::size_t>(r)], finals[0]), 0.0) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, CheckpointedDdp,
                         ::testing::Values(DdpCase{2, false, false, false}, DdpCase{3, false, false, false},
                                           DdpCase{2, true, false, false}, DdpCase{2, false, true, false},
                                           DdpCase{2, false, false, true}),
                         [](const ::testing::TestParamInfo<DdpCase>& param) {
                           const DdpCase& k = param.param;
                           return "world" + std::to_string(k.world) + (k.accumulate ? "_nosync" : "") +
                                  (k.bf16 ? "_bf16" : "") + (k.find_unused ? "_findunused" : "");
                         });

TEST(Gpt, ALanguageModelsBodyLoadsIntoAClassifierAndOtherShapesAreRefused) {
  lockstep::testing::TempDir dir("gpt-load");
  auto lm = seeded_lm(tiny());
  lockstep::train::save_module(*lm, dir / "model.pt");
  GptForSequenceClassification clf(tiny(), 5);
  const auto report = lockstep::train::load_matching(*clf, dir / "model.pt");
  EXPECT_EQ(report.missing, std::vector<std::string>{"score.weight"});
  EXPECT_TRUE(report.unexpected.empty());
  EXPECT_TRUE(torch::equal(clf->transformer->wte->weight, lm->transformer->wte->weight));
  GptConfig wider = tiny();
  wider.n_embd = 64;
  GptForSequenceClassification other(wider, 5);
  try {
    lockstep::train::load_matching(*other, dir / "model.pt");
    FAIL() << "loaded weights of another shape";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'transformer.wte.weight' is float32[64, 64] in the model but float32[64, 32]"),
              std::string::npos)
        << e.what();
  }
}

TEST(Gpt, TheClassifierReadsTheLastRealToken) {
  auto clf = [] {
    torch::manual_seed(3);
    return GptForSequenceClassification(tiny(), 3, /*pad_token=*/0);
  }();
  clf->eval();
  auto a = torch::tensor({5, 6, 7, 0, 0, 0}, torch::kLong).unsqueeze(0);
  auto b = torch::tensor({5, 6, 7, 0, 0, 9}, torch::kLong).unsqueeze(0);  // a non-pad at the end is read
  auto c = torch::tensor({5, 6, 7}, torch::kLong).unsqueeze(0);
  EXPECT_TRUE(torch::allclose(clf(a), clf(c)));
  EXPECT_FALSE(torch::allclose(clf(a), clf(b)));
}

TEST(Gpt, GenerationIsReproducibleForASeed) {
  auto lm = seeded_lm(tiny());
  SamplingOptions o;
  o.max_new_tokens = 20;
  o.seed = 4;
  const auto a = generate(lm, {1, 2, 3}, o), b = generate(lm, {1, 2, 3}, o);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.size(), 23u);
  o.seed = 5;
  EXPECT_NE(generate(lm, {1, 2, 3}, o), a);
}
