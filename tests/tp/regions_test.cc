// Tensor parallelism's pieces (tp/regions.h, layers.h, cross_entropy.h) against the unsplit
// computation, in float64 on real communicators (ranks as threads over shared memory): each
// region's forward and backward, each layer's output and gradients, the split cross-entropy's loss
// and gradients. float64 changes only the order of sums, so 1e-12 holds; a scaling missed or a
// wrong shard shows at 1e-3 or more.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>

#include "lockstep/error.h"
#include "lockstep/models/dropout.h"
#include "lockstep/tp/cross_entropy.h"
#include "lockstep/tp/layers.h"
#include "lockstep/tp/regions.h"
#include "testing.h"

namespace lockstep::tp {
namespace {

std::mutex torch_init;  // the default generator is shared by the rank threads

comm::CommOptions shm_options() {
  comm::CommOptions o;
  o.backend = "shm";
  o.timeout = comm::Seconds(60);
  return o;
}

torch::Tensor seeded_randn(std::uint64_t seed, at::IntArrayRef sizes) {
  std::lock_guard<std::mutex> lock(torch_init);
  torch::manual_seed(seed);
  return torch::randn(sizes, torch::kDouble);
}

void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.sizes().equals(want.sizes())) << what << ": " << got.sizes() << " vs " << want.sizes();
  const double scale = std::max(1e-30, want.abs().max().item<double>());
  EXPECT_LE((got - want).abs().max().item<double>() / scale, 1e-12) << what;
}

// Each rank's input: rank r's is seeded r, the same tensor as the test's reference builds.
torch::Tensor input_of(int rank, at::IntArrayRef sizes) {
  return seeded_randn(100 + std::uint64_t(rank), sizes).requires_grad_(true);
}

TEST(TensorRegions, EachForwardAndBackwardIsItsCollectiveAndItsConjugate) {
  for (const int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const std::vector<std::int64_t> shape{2, 3 * world, 5};
    torch::Tensor all = torch::stack([&] {
      std::vector<torch::Tensor> xs;
      for (int r = 0; r < world; ++r) xs.push_back(input_of(r, shape).detach());
      return xs;
    }());
    // The upstream gradient each rank feeds back: rank r's is seeded 200 + r.
    auto grad_of = [](int r, at::IntArrayRef sizes) { return seeded_randn(200 + std::uint64_t(r), sizes); };
    testing::run_ranks_as_threads(world, shm_options(), [&](comm::Communicator& group) {
      const int r = group.rank();
      auto x = input_of(r, shape);
      // copy_to: identity forward, sum of the ranks' gradients backward.
      auto y = copy_to_tensor_region(x, group);
      expect_close(y, x, "copy_to forward");
      y.backward(grad_of(r, shape));
      torch::Tensor sum = torch::zeros(shape, torch::kDouble);
      for (int q = 0; q < world; ++q) sum += grad_of(q, shape);
      expect_close(x.grad(), sum, "copy_to backward");
      // reduce_from: sum forward, identity backward.
      x.mutable_grad() = torch::Tensor();
      y = reduce_from_tensor_region(x, group);
      expect_close(y, all.sum(0), "reduce_from forward");
      y.backward(grad_of(r, shape));
      expect_close(x.grad(), grad_of(r, shape), "reduce_from backward");
      // gather_from_sequence along 1: concatenation forward, the sum's own slice backward.
      x.mutable_grad() = torch::Tensor();
      y = gather_from_sequence_region(x, group, 1);
      expect_close(y, torch::cat(all.unbind(0), 1), "gather_from_sequence forward");
      const std::vector<std::int64_t> gathered{2, 3 * world * world, 5};
      y.backward(grad_of(r, gathered));
      torch::Tensor gsum = torch::zeros(gathered, torch::kDouble);
      for (int q = 0; q < world; ++q) gsum += grad_of(q, gathered);
      expect_close(x.grad(), gsum.narrow(1, r * 3 * world, 3 * world), "gather_from_sequence backward");
      // scatter_to_sequence along 1: the sum's own slice forward, concatenation backward.
      x.mutable_grad() = torch::Tensor();
      y = scatter_to_sequence_region(x, group, 1);
      expect_close(y, all.sum(0).narrow(1, r * 3, 3), "scatter_to_sequence forward");
      const std::vector<std::int64_t> slice{2, 3, 5};
      y.backward(grad_of(r, slice));
      std::vector<torch::Tensor> slices;
      for (int q = 0; q < world; ++q) slices.push_back(grad_of(q, slice));
      expect_close(x.grad(), torch::cat(slices, 1), "scatter_to_sequence backward");
      // gather_from_tensor / split_to_tensor along the last dimension: each other's conjugate.
      x.mutable_grad() = torch::Tensor();
      y = split_to_tensor_region(gather_from_tensor_region(x, group, -1), group, -1);
      expect_close(y, x, "split(gather(x))");
      y.backward(grad_of(r, shape));
      expect_close(x.grad(), grad_of(r, shape), "their backward");
    });
  }
}

TEST(TensorRegions, ASliceThatDoesNotDivideIsRefusedNamingTheSizes) {
  testing::run_ranks_as_threads(2, shm_options(), [&](comm::Communicator& group) {
    auto x = torch::zeros({3, 5}, torch::kDouble);
    try {
      scatter_to_sequence_region(x, group, 0);
      ADD_FAILURE() << "no error";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("does not divide by the tensor group's 2 ranks"), std::string::npos)
          << e.what();
    }
  });
}

// A column then a row linear (an MLP) against the whole Linears, with and without sequence
// parallelism: outputs, the input's gradient and each parameter's shard of the whole gradient.
TEST(TensorParallelLayers, AColumnThenARowLinearIsTheWholeMlp) {
  for (const int world : {2, 4})
    for (const bool sequence_parallel : {false, true}) {
      SCOPED_TRACE("T " + std::to_string(world) + (sequence_parallel ? " sequence parallel" : ""));
      const std::int64_t B = 2, S = 4, H = 6, F = 8;
      torch::nn::Linear fc(nullptr), proj(nullptr);
      {
        std::lock_guard<std::mutex> lock(torch_init);
        torch::manual_seed(7);
        fc = torch::nn::Linear(H, F), proj = torch::nn::Linear(F, H);
        fc->to(torch::kDouble), proj->to(torch::kDouble);
      }
      auto x = seeded_randn(8, {B, S, H}).requires_grad_(true);
      const auto want = proj(torch::gelu(fc(x)));
      const auto upstream = seeded_randn(9, {B, S, H});
      want.backward(upstream);
      testing::run_ranks_as_threads(world, shm_options(), [&](comm::Communicator& group) {
        const int r = group.rank();
        ParallelLinearOptions o;
        o.sequence_parallel = sequence_parallel;
        ColumnParallelLinear col(H, F, group, o);
        RowParallelLinear row(F, H, group, o);
        col->to(torch::kDouble), row->to(torch::kDouble);
        col->load_shard_of(fc->weight, fc->bias);
        row->load_shard_of(proj->weight, proj->bias);
        auto in = x.detach().clone();
        auto mine = sequence_parallel ? in.narrow(1, r * S / world, S / world) : in;
        mine = mine.clone().requires_grad_(true);
        const auto got = row(torch::gelu(col(mine)));
        const auto own = [&](const torch::Tensor& t) {
          return sequence_parallel ? t.narrow(1, r * S / world, S / world) : t;
        };
        expect_close(got, own(want.detach()), "output");
        got.backward(own(upstream));
        expect_close(mine.grad(), own(x.grad()), "input gradient");
        expect_close(col->weight.grad(), shard_of(fc->weight.grad(), 0, r, world, "w"), "column weight");
        expect_close(col->bias.grad(), shard_of(fc->bias.grad(), 0, r, world, "b"), "column bias");
        expect_close(row->weight.grad(), shard_of(proj->weight.grad(), 1, r, world, "w"), "row weight");
        expect_close(row->bias.grad(), proj->bias.grad(), "row bias (summed over the group when split)");
      });
    }
}

TEST(TensorParallelLayers, TheSplitVocabularyLooksUpAndLearnsAsTheWholeEmbeddingAndLoss) {
  const std::int64_t V = 12, H = 5, B = 3, S = 4;
  for (const int world : {2, 3}) {
    SCOPED_TRACE("T " + std::to_string(world));
    torch::nn::Embedding emb(nullptr);
    torch::nn::Linear head(nullptr);
    torch::Tensor tokens, targets;
    {
      std::lock_guard<std::mutex> lock(torch_init);
      torch::manual_seed(11);
      emb = torch::nn::Embedding(V, H), head = torch::nn::Linear(torch::nn::LinearOptions(H, V).bias(false));
      emb->to(torch::kDouble), head->to(torch::kDouble);
      tokens = torch::randint(V, {B, S});
      targets = torch::randint(V, {B, S});
    }
    targets[0][1] = -100;  // ignored, as Hugging Face pads
    const auto logits = head(emb(tokens));
    const auto want = torch::nn::functional::cross_entropy(
        logits.view({-1, V}), targets.view({-1}), torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
    want.sum().backward();
    testing::run_ranks_as_threads(world, shm_options(), [&](comm::Communicator& group) {
      const int r = group.rank();
      VocabParallelEmbedding e(V, H, group);
      ColumnParallelLinear h(H, V, group, [] {
        ParallelLinearOptions o;
        o.bias = false;
        return o;
      }());
      e->to(torch::kDouble), h->to(torch::kDouble);
      e->load_shard_of(emb->weight);
      h->load_shard_of(head->weight, torch::Tensor());
      const auto got = vocab_parallel_cross_entropy(h(e(tokens)), targets, group);
      expect_close(got.view({-1}), want.detach(), "per-token losses");
      EXPECT_EQ(got[0][1].item<double>(), 0.0) << "an ignored target";
      got.sum().backward();
      expect_close(e->weight.grad(), shard_of(emb->weight.grad(), 0, r, world, "e"), "embedding rows");
      expect_close(h->weight.grad(), shard_of(head->weight.grad(), 0, r, world, "h"), "head rows");
      auto outside = targets.clone();
      outside[1][1] = V;
      EXPECT_THROW(vocab_parallel_cross_entropy(h(e(tokens)), outside, group), ConfigError);
    });
  }
}

TEST(TensorParallelLayers, ASizeTheGroupDoesNotDivideIsRefused) {
  testing::run_ranks_as_threads(2, shm_options(), [&](comm::Communicator& group) {
    try {
      ColumnParallelLinear(4, 5, group);
      ADD_FAILURE() << "5 output features split over 2 ranks";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("5 does not divide over --tensor-parallel 2"), std::string::npos)
          << e.what();
    }
    EXPECT_THROW(VocabParallelEmbedding(7, 4, group), ConfigError);
  });
}

// The masks of sequence shards are the whole tensor's: the split run draws one process's masks.
TEST(TensorParallelLayers, ShardedDropoutDrawsTheWholeTensorsMask) {
  const auto x = torch::ones({2, 8, 6}, torch::kDouble);
  torch::Tensor whole;
  {
    models::DropoutSeeds seeds(5);
    whole = models::fast_dropout(x, 0.3, true);
  }
  ASSERT_GT((whole == 0).sum().item<int64_t>(), 0) << "some element dropped";
  for (const int world : {2, 4})
    testing::run_ranks_as_threads(world, shm_options(), [&](comm::Communicator& group) {
      models::DropoutSeeds seeds(5);
      const auto mine = x.narrow(1, group.rank() * 8 / world, 8 / world);
      const auto where = models::ShardOf::slice(mine, 1, group.rank(), world);
      EXPECT_TRUE(torch::equal(models::fast_dropout_shard(mine, 0.3, true, where), whole.narrow(1, group.rank() * 8 / world, 8 / world)));
    });
}

}  // namespace
}  // namespace lockstep::tp
