// A small language model trained for 20 AdamW steps, with dropout and gradient clipping, split over
// T tensor ranks (with and without sequence parallelism, and with data ranks beside them), against
// the same model trained by one process. In float64 only the order of sums differs, so every
// parameter must equal the unsplit run's within 1e-12 relative; a scaling missed or doubled, or a
// wrong shard, shows at 1e-3 or more. The traps named in issue 68 are each exercised: the loss over
// sequence shards (the head gathers the sequence, so the loss is the whole batch's), the global norm
// over split and whole parameters (clipping is active every step), and data ranks averaging
// gradients next to tensor ranks summing them.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>

#include "lockstep/ddp/ddp.h"
#include "lockstep/models/dropout.h"
#include "lockstep/pipe_core/layout.h"
#include "lockstep/tp/cross_entropy.h"
#include "lockstep/tp/gradients.h"
#include "lockstep/tp/layers.h"
#include "lockstep/tp/regions.h"
#include "testing.h"

// A namespace of this file's own: the unity build compiles it with the other tp tests.
namespace lockstep::tp::equivalence_test {
namespace {

constexpr std::int64_t kVocab = 16, kWidth = 8, kHidden = 16, kSequence = 4, kBlocks = 2;
constexpr double kDropout = 0.2, kMaxNorm = 0.05;
constexpr int kSteps = 20;

std::mutex torch_init;

// The unsplit model: embedding, blocks of (norm, MLP, dropout, residual), final norm, head.
struct WholeLm : torch::nn::Module {
  WholeLm() {
    emb = register_module("emb", torch::nn::Embedding(kVocab, kWidth));
    for (int b = 0; b < kBlocks; ++b) {
      norms.push_back(register_module("norm" + std::to_string(b), torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth}))));
      fcs.push_back(register_module("fc" + std::to_string(b), torch::nn::Linear(kWidth, kHidden)));
      projs.push_back(register_module("proj" + std::to_string(b), torch::nn::Linear(kHidden, kWidth)));
    }
    norm_f = register_module("norm_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(kWidth, kVocab).bias(false)));
  }
  torch::Tensor loss(const torch::Tensor& tokens, const torch::Tensor& targets) {
    auto x = emb(tokens);
    for (int b = 0; b < kBlocks; ++b)
      x = x + models::fast_dropout(projs[b](torch::gelu(fcs[b](norms[b](x)))), kDropout, is_training());
    const auto logits = head(norm_f(x));
    return torch::nn::functional::cross_entropy(logits.view({-1, kVocab}), targets.view({-1}));
  }
  torch::nn::Embedding emb{nullptr};
  std::vector<torch::nn::LayerNorm> norms;
  std::vector<torch::nn::Linear> fcs, projs;
  torch::nn::LayerNorm norm_f{nullptr};
  torch::nn::Linear head{nullptr};
};

// The same model split over a tensor group; its shards loaded from a WholeLm.
struct SplitLm : torch::nn::Module {
  // Data rank d of `data_ranks` holds rows [d*rows, (d+1)*rows) of the whole batch.
  SplitLm(comm::Communicator& g, bool sp, int d = 0, int ds = 1)
      : group(&g), sequence_parallel(sp), data_rank(d), data_ranks(ds) {
    ParallelLinearOptions o;
    o.sequence_parallel = sp;
    emb = register_module("emb", VocabParallelEmbedding(kVocab, kWidth, g, o));
    for (int b = 0; b < kBlocks; ++b) {
      norms.push_back(register_module("norm" + std::to_string(b), torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth}))));
      fcs.push_back(register_module("fc" + std::to_string(b), ColumnParallelLinear(kWidth, kHidden, g, o)));
      projs.push_back(register_module("proj" + std::to_string(b), RowParallelLinear(kHidden, kWidth, g, o)));
    }
    norm_f = register_module("norm_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
    auto head_options = o;
    head_options.bias = false;
    head = register_module("head", ColumnParallelLinear(kWidth, kVocab, g, head_options));
  }
  // Called once the parameters are float64 and loaded: under sequence parallelism the norms see a
  // shard of the sequence each, so their gradients are summed over the group.
  void sum_norm_gradients() {
    if (!sequence_parallel) return;
    for (auto& n : norms) sum_gradient_over(n->weight, *group), sum_gradient_over(n->bias, *group);
    sum_gradient_over(norm_f->weight, *group), sum_gradient_over(norm_f->bias, *group);
  }
  void load(WholeLm& w) {
    torch::NoGradGuard no_grad;
    emb->load_shard_of(w.emb->weight);
    for (int b = 0; b < kBlocks; ++b) {
      norms[b]->weight.copy_(w.norms[b]->weight), norms[b]->bias.copy_(w.norms[b]->bias);
      fcs[b]->load_shard_of(w.fcs[b]->weight, w.fcs[b]->bias);
      projs[b]->load_shard_of(w.projs[b]->weight, w.projs[b]->bias);
    }
    norm_f->weight.copy_(w.norm_f->weight), norm_f->bias.copy_(w.norm_f->bias);
    head->load_shard_of(w.head->weight, torch::Tensor());
  }
  torch::Tensor forward(const torch::Tensor& tokens, const torch::Tensor& targets) {  // the loss
    auto x = emb(tokens);  // sequence parallel: this rank's slice of the sequence
    for (int b = 0; b < kBlocks; ++b) {
      const auto h = projs[b](torch::gelu(fcs[b](norms[b](x))));
      x = x + (data_ranks > 1 ? models::fast_dropout_shard(h, kDropout, is_training(), place_of(h))
               : sequence_parallel
                   ? models::fast_dropout_shard(h, kDropout, is_training(),
                                                models::ShardOf::slice(h, 1, group->rank(), group->size()))
                   : models::fast_dropout(h, kDropout, is_training()));
    }
    // The head gathers the sequence: the loss is over every token on every rank.
    return vocab_parallel_cross_entropy(head(norm_f(x)), targets, *group).mean();
  }
  // Where this rank's activations [rows, sequence (or its shard), width] sit in the whole batch's:
  // with data ranks, each draws the masks of its rows of the one process's batch.
  models::ShardOf place_of(const torch::Tensor& h) const {
    const auto sequence_shard = sequence_parallel ? group->rank() * h.size(1) : 0;
    return {{h.size(0) * data_ranks, kSequence, h.size(2)}, {data_rank * h.size(0), sequence_shard, 0}};
  }
  comm::Communicator* group;
  bool sequence_parallel;
  int data_rank, data_ranks;
  VocabParallelEmbedding emb{nullptr};
  std::vector<torch::nn::LayerNorm> norms;
  std::vector<ColumnParallelLinear> fcs;
  std::vector<RowParallelLinear> projs;
  torch::nn::LayerNorm norm_f{nullptr};
  ColumnParallelLinear head{nullptr};
};

struct Batch {
  torch::Tensor tokens, targets;
};

// Step s's batch of `rows` sequences (the same on every rank that asks for the same rows).
Batch batch_of(int step, std::int64_t rows) {
  auto g = at::detail::createCPUGenerator(1000 + std::uint64_t(step));
  return {torch::randint(kVocab, {rows, kSequence}, g), torch::randint(kVocab, {rows, kSequence}, g)};
}

torch::optim::AdamW adamw(const std::vector<torch::Tensor>& params) {
  return torch::optim::AdamW(params, torch::optim::AdamWOptions(3e-2).weight_decay(0.1));
}

std::shared_ptr<WholeLm> whole_model() {
  std::lock_guard<std::mutex> lock(torch_init);
  torch::manual_seed(21);
  auto m = std::make_shared<WholeLm>();
  m->to(torch::kDouble);
  return m;
}

// One process: each step's batch is every data rank's rows, the loss their mean.
std::shared_ptr<WholeLm> train_whole(std::int64_t rows) {
  auto m = whole_model();
  auto opt = adamw(m->parameters());
  models::DropoutSeeds seeds(77);
  for (int s = 0; s < kSteps; ++s) {
    const Batch b = batch_of(s, rows);
    opt.zero_grad();
    m->loss(b.tokens, b.targets).backward();
    const double norm = torch::nn::utils::clip_grad_norm_(m->parameters(), kMaxNorm);
    EXPECT_GT(norm, kMaxNorm) << "clipping is active, so the norm's value matters";
    opt.step();
  }
  return m;
}

void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.sizes().equals(want.sizes())) << what;
  const double scale = std::max(1e-30, want.abs().max().item<double>());
  EXPECT_LE((got - want).abs().max().item<double>() / scale, 1e-12) << what;
}

// Each split parameter's shard against the whole run's, each whole parameter against its own.
void expect_equal_to_whole(SplitLm& split, WholeLm& whole, int t, int tensor) {
  const auto r = [&](const torch::Tensor& w, std::int64_t dim) { return shard_of(w.detach(), dim, t, tensor, "p"); };
  expect_close(split.emb->weight, r(whole.emb->weight, 0), "emb");
  for (int b = 0; b < kBlocks; ++b) {
    const auto n = std::to_string(b);
    expect_close(split.norms[b]->weight, whole.norms[b]->weight.detach(), "norm" + n);
    expect_close(split.fcs[b]->weight, r(whole.fcs[b]->weight, 0), "fc" + n);
    expect_close(split.fcs[b]->bias, r(whole.fcs[b]->bias, 0), "fc bias" + n);
    expect_close(split.projs[b]->weight, r(whole.projs[b]->weight, 1), "proj" + n);
    expect_close(split.projs[b]->bias, whole.projs[b]->bias.detach(), "proj bias" + n);
  }
  expect_close(split.norm_f->bias, whole.norm_f->bias.detach(), "norm_f");
  expect_close(split.head->weight, r(whole.head->weight, 0), "head");
}

struct Split {
  int tensor = 2, data = 1;
  bool sequence_parallel = false;
};

// T x D ranks as threads; the data groups average gradients with lockstep's DDP.
void expect_split_run_is_the_whole_run(const Split& c) {
  SCOPED_TRACE("T " + std::to_string(c.tensor) + " D " + std::to_string(c.data) +
               (c.sequence_parallel ? " sequence parallel" : ""));
  const std::int64_t rows_per_rank = 2;
  auto whole = train_whole(rows_per_rank * c.data);
  auto initial = whole_model();
  LayoutRequest request;
  request.world = c.tensor * c.data;
  request.tensor_parallel = c.tensor;
  request.sequence_parallel = c.sequence_parallel;
  const Layout layout = Layout::build(request);
  comm::CommOptions options;
  options.backend = "shm";
  options.timeout = comm::Seconds(60);
  testing::run_ranks_as_threads(layout.world(), options, [&](comm::Communicator& world) {
    const auto at = layout.coordinates_of(world.rank());
    auto tensor_group = world.group(layout.group_of(ParallelDim::tensor, world.rank()),
                                    layout.group_name(ParallelDim::tensor, world.rank()));
    auto data_group = world.group(layout.group_of(ParallelDim::data, world.rank()),
                                  layout.group_name(ParallelDim::data, world.rank()));
    std::shared_ptr<SplitLm> split;
    {
      std::lock_guard<std::mutex> lock(torch_init);
      split = std::make_shared<SplitLm>(*tensor_group, c.sequence_parallel, at.data, c.data);
    }
    split->to(torch::kDouble);
    split->load(*initial);
    split->sum_norm_gradients();
    DistributedDataParallel ddp(split, *data_group);
    auto opt = adamw(split->parameters());
    models::DropoutSeeds seeds(77);  // every rank draws the one process's seeds, call by call
    for (int s = 0; s < kSteps; ++s) {
      const Batch b = batch_of(s, rows_per_rank * c.data);
      const auto rows = [&](const torch::Tensor& t) { return t.narrow(0, at.data * rows_per_rank, rows_per_rank); };
      opt.zero_grad();
      ddp.forward(rows(b.tokens), rows(b.targets)).backward();
      clip_grad_norm(*split, kMaxNorm, *tensor_group);
      opt.step();
    }
    expect_equal_to_whole(*split, *whole, at.tensor, c.tensor);
  });
}

TEST(TensorParallelEquivalence, TwoAndFourTensorRanksTrainAsOneProcess) {
  expect_split_run_is_the_whole_run({2, 1, false});
  expect_split_run_is_the_whole_run({4, 1, false});
}

TEST(TensorParallelEquivalence, SequenceParallelTrainsAsOneProcessWithTheLossOverTheWholeSequence) {
  expect_split_run_is_the_whole_run({2, 1, true});
  expect_split_run_is_the_whole_run({4, 1, true});
}

TEST(TensorParallelEquivalence, TensorTimesDataRanksTrainAsOneProcessOnTheWholeBatch) {
  expect_split_run_is_the_whole_run({2, 2, false});
  expect_split_run_is_the_whole_run({2, 2, true});
}

// docs/layout.md's memory: a split layer holds 1/T of its parameters, a whole one all of them.
TEST(TensorParallelEquivalence, EachRankHoldsItsShareOfTheSplitParametersAndAllOfTheWholeOnes) {
  const auto whole = whole_model();
  std::int64_t whole_split = 0, whole_kept = 0;
  for (const auto& item : whole->named_parameters()) {
    const bool split = item.key().rfind("norm", 0) != 0 && item.key().find(".bias") == std::string::npos;
    (split || item.key().rfind("fc", 0) == 0 ? whole_split : whole_kept) += item.value().numel();
  }
  for (const int tensor : {2, 4}) {
    comm::CommOptions options;
    options.backend = "shm";
    testing::run_ranks_as_threads(tensor, options, [&](comm::Communicator& group) {
      std::shared_ptr<SplitLm> split;
      {
        std::lock_guard<std::mutex> lock(torch_init);
        split = std::make_shared<SplitLm>(group, false);
      }
      std::int64_t held_split = 0, held_whole = 0;
      for (const auto& p : split->parameters()) (is_split(*split, p) ? held_split : held_whole) += p.numel();
      EXPECT_EQ(held_split * tensor, whole_split);
      EXPECT_EQ(held_whole, whole_kept);
    });
  }
}

// The global norm is the unsplit model's; counting the whole parameters once per rank (summing
// every rank's squares) misses it by far more than the tolerance above.
TEST(TensorParallelEquivalence, TheGlobalNormCountsEachWholeParameterOnce) {
  comm::CommOptions options;
  options.backend = "shm";
  testing::run_ranks_as_threads(2, options, [&](comm::Communicator& group) {
    std::shared_ptr<SplitLm> split;
    {
      std::lock_guard<std::mutex> lock(torch_init);
      split = std::make_shared<SplitLm>(group, false);
    }
    split->to(torch::kDouble);
    auto whole = whole_model();
    split->load(*whole);
    const Batch b = batch_of(0, 2);
    {
      models::DropoutSeeds seeds(77);
      whole->loss(b.tokens, b.targets).backward();
    }
    {
      models::DropoutSeeds seeds(77);
      split->forward(b.tokens, b.targets).backward();
    }
    const double want = torch::nn::utils::clip_grad_norm_(whole->parameters(), 1e9);
    const double got = clip_grad_norm(*split, 1e9, group);
    EXPECT_LE(std::abs(got - want) / want, 1e-12);
    double squares = 0;  // every rank's squares, summed over the group
    for (const auto& p : split->parameters()) squares += p.grad().pow(2).sum().item<double>();
    auto t = torch::tensor({squares}, torch::kDouble);
    group.allreduce(t.data_ptr(), 1, comm::DType::f64, comm::ReduceOp::sum)->wait();
    EXPECT_GT(std::abs(std::sqrt(t.item<double>()) - want) / want, 1e-3);
  });
}

}  // namespace
}  // namespace lockstep::tp::equivalence_test
