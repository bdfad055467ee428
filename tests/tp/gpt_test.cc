// The GPT split for tensor parallelism (models/gpt.h's split_for_tensor_parallel) against the
// unsplit GPT, in float64, ranks as threads: 20 AdamW steps with dropout on the attention
// probabilities, the embeddings and the residuals, and clipping active every step, under T = 2 and
// 4, with gradient checkpointing, T x D with lockstep's DDP over the data groups, and pipelines of
// split stages (P x T, P x D x T), and ZeRO-2/3 over the data ranks. Only the order of sums differs,
// so every parameter must equal the unsplit run's within 1e-12 relative, and so must every element
// the ranks' checkpoint writes (each written by one rank, nothing gathered).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>
#include <random>
#include <set>
#include <tuple>

#include "lockstep/ddp/ddp.h"
#include "lockstep/ddp/zero.h"
#include "lockstep/error.h"
#include "lockstep/models/gpt.h"
#include "lockstep/pipe/pipeline.h"
#include "lockstep/pipe_core/layout.h"
#include "lockstep/tp/cross_entropy.h"
#include "lockstep/tp/gradients.h"
#include "lockstep/train/sharded_checkpoint.h"
#include "testing.h"

// A namespace of this file's own: the unity build compiles it with the other tp tests.
namespace lockstep::tp::gpt_test {
namespace {

using models::GptConfig;
using models::GptLmHeadModel;

constexpr int kSteps = 20, kRowsPerRank = 2;
constexpr double kMaxNorm = 0.05;

std::mutex torch_init;  // the default generator is shared by the rank threads

GptConfig small(double dropout) {
  GptConfig c;
  c.vocab_size = 16;
  c.block_size = 8;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 16;
  c.dropout = dropout;
  return c;
}

GptLmHeadModel seeded_gpt(const GptConfig& c) {
  std::lock_guard<std::mutex> lock(torch_init);
  torch::manual_seed(21);
  GptLmHeadModel m(c);
  m->to(torch::kDouble);
  return m;
}

struct Batch {
  torch::Tensor tokens, targets;
};

Batch batch_of(int step, std::int64_t rows) {
  auto g = at::detail::createCPUGenerator(1000 + std::uint64_t(step));
  return {torch::randint(16, {rows, 8}, g), torch::randint(16, {rows, 8}, g)};
}

torch::optim::AdamW adamw(const std::vector<torch::Tensor>& params) {
  return torch::optim::AdamW(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
}

std::uint64_t dropout_seed(int step) {
  return 5000 + std::uint64_t(step);
}

GptLmHeadModel train_whole(const GptConfig& c, std::int64_t rows, bool checkpointing) {
  auto m = seeded_gpt(c);
  m->set_gradient_checkpointing(checkpointing);
  auto opt = adamw(m->parameters());
  for (int s = 0; s < kSteps; ++s) {
    const Batch b = batch_of(s, rows);
    opt.zero_grad();
    const auto logits = m->forward_seeded(b.tokens, dropout_seed(s));
    torch::nn::functional::cross_entropy(logits.view({-1, c.vocab_size}), b.targets.view({-1})).backward();
    EXPECT_GT(torch::nn::utils::clip_grad_norm_(m->parameters(), kMaxNorm), kMaxNorm) << "clipping is active";
    opt.step();
  }
  return m;
}

// The parameters a split of `whole` holds on this rank, in named order: split as the run was.
std::vector<std::pair<std::string, torch::Tensor>> split_copy_of(const GptConfig& c, GptLmHeadModel& whole,
                                                                 comm::Communicator& group) {
  auto copy = seeded_gpt(c);
  {
    torch::NoGradGuard no_grad;
    auto from = whole->named_parameters();
    for (auto& p : copy->named_parameters()) p.value().copy_(from[p.key()]);
  }
  copy->split_for_tensor_parallel(group);
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : copy->named_parameters()) out.emplace_back(p.key(), p.value().detach());
  return out;
}

struct Split {
  int tensor = 2, data = 1;
  double dropout = 0.1;
  bool checkpointing = false;
  bool sequence_parallel = false;
  int zero_stage = 0;  // 2 or 3: ZeRO over each tensor rank's data ranks
};

// What the data ranks of one tensor rank run over the split model: lockstep's DDP and AdamW, the
// norm clipped by tp::clip_grad_norm; or ZeRO (stage 2 or 3), its norm counting the cuts over
// the tensor group.
class DataRanks {
 public:
  DataRanks(GptLmHeadModel& model, comm::Communicator& data, comm::Communicator& tensor, int zero_stage)
      : model_(model), tensor_(tensor), split_(model->split_parameters()), stage_(zero_stage) {
    for (const auto& p : model->named_parameters())
      if (std::any_of(split_.begin(), split_.end(), [&](const torch::Tensor& s) { return s.is_same(p.value()); }))
        split_names_.insert(p.key());
    ZeroOptions zo{zero_stage, false};
    zo.tensor_group = &tensor;
    zo.split_parameters = split_;
    DdpOptions ddp;
    std::optional<BucketSharding> sharding;
    if (zero_stage == 2) {
      ddp.bucket_cap_mb = 0.002;  // several buckets, so slices cut through tensors
      ddp.first_bucket_cap_mb = 0.001;
      sharding = zero_bucket_sharding(zo, data.size());
    }
    if (zero_stage == 3) sharding = zero_bucket_sharding(zo, data.size(), *model, model->parameter_units());
    reducer_ = std::make_unique<Reducer>(model.ptr(), data, ddp, sharding);
    auto make = [](std::vector<torch::Tensor> p) { return std::make_unique<torch::optim::AdamW>(adamw(p)); };
    if (zero_stage == 0) {
      optimizer_ = make(model->parameters());
      return;
    }
    zero_ = std::make_unique<ZeroOptimizer>(*model, *reducer_, data, zo, make);
    if (zero_stage == 3) model->set_unit_runner(zero_->unit_runner());
  }

  // Seeded forwards, as DDP's own forward would run them.
  void before_forward() {
    reducer_->before_forward();
    if (zero_) zero_->before_forward();
  }
  void after_forward(const torch::Tensor& out) { reducer_->after_forward(&out); }

  void clip_and_step() {
    if (zero_) {
      zero_->clip_grad_norm(kMaxNorm);
      zero_->step();
      zero_->zero_grad();
      return;
    }
    std::vector<torch::Tensor> kept;
    for (const auto& p : model_->parameters())
      if (std::none_of(split_.begin(), split_.end(), [&](const torch::Tensor& s) { return s.is_same(p); }))
        kept.push_back(p);
    clip_grad_norm(split_, kept, kMaxNorm, tensor_);
    optimizer_->step();
    optimizer_->zero_grad();
  }

  // Collective: whether every rank of the tensor group holds bitwise the same whole (unsplit)
  // parameters (layer norms, positions, biases): they took the same gradients, norm and steps.
  bool whole_parameters_agree() {
    std::vector<torch::Tensor> whole;
    for (const auto& [name, p] : parameters())
      if (!split_names_.count(name)) whole.push_back(p.reshape({-1}));
    const auto mine = torch::cat(whole).contiguous();
    auto all = torch::empty({tensor_.size(), mine.numel()}, mine.options());
    tensor_.allgather(mine.data_ptr(), all.data_ptr(), std::size_t(mine.numel()), comm::DType::f64)->wait();
    return all.eq(mine.unsqueeze(0)).all().item<bool>();
  }

  // By name, copied (under stage 3 gathered from the data ranks' slices first).
  ZeroOptimizer& zero() { return *zero_; }
  torch::optim::Optimizer& optimizer() { return *optimizer_; }

  std::map<std::string, torch::Tensor> parameters() {
    const bool sliced = stage_ == 3;
    if (sliced) zero_->gather_all();
    std::map<std::string, torch::Tensor> out;
    for (const auto& p : model_->named_parameters()) out[p.key()] = p.value().detach().clone();
    if (sliced) zero_->release_all(false);
    return out;
  }

 private:
  GptLmHeadModel& model_;
  comm::Communicator& tensor_;
  std::vector<torch::Tensor> split_;
  std::set<std::string> split_names_;
  int stage_;
  std::unique_ptr<Reducer> reducer_;
  std::unique_ptr<ZeroOptimizer> zero_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
};

// A piece of a checkpoint some rank wrote: which elements of which tensor.
struct Written {
  std::string name;
  std::int64_t start = 0, count = 0, numel = 0;
};

// ZeRO's snapshot of a split model (train/sharded_checkpoint.h): every piece holds the values of
// the whole model's tensor at the place it claims (`whole`: each tensor's values, laid flat).
void expect_pieces_hold_the_whole_values(const train::ShardSnapshot& snapshot,
                                         const std::map<std::string, torch::Tensor>& whole,
                                         std::vector<Written>& written) {
  for (const auto& piece : snapshot.pieces) {
    const train::CheckpointTensor& t = snapshot.tensors.at(std::size_t(piece.tensor));
    written.push_back({t.name, piece.start, piece.count, t.numel()});
    const auto it = whole.find(t.name);
    if (it == whole.end()) continue;  // a buffer
    const auto value = torch::from_blob(const_cast<void*>(piece.arrays.at("value")), {piece.count}, torch::kDouble);
    const auto want = it->second.narrow(0, piece.start, piece.count);
    EXPECT_LE((value - want).abs().max().item<double>() / it->second.abs().max().item<double>(), 1e-12)
        << t.name << " [" << piece.start << ", " << piece.start + piece.count << ")";
  }
}

// The pieces all ranks wrote tile every tensor: each element once, none missing.
void expect_each_element_written_once(std::vector<Written> written) {
  std::sort(written.begin(), written.end(),
            [](const Written& a, const Written& b) { return std::tie(a.name, a.start) < std::tie(b.name, b.start); });
  for (std::size_t i = 0; i < written.size(); ++i) {
    const bool first = i == 0 || written[i - 1].name != written[i].name;
    const std::int64_t expected = first ? 0 : written[i - 1].start + written[i - 1].count;
    EXPECT_EQ(written[i].start, expected) << written[i].name << (written[i].start < expected ? ": overlap" : ": gap");
    const bool last = i + 1 == written.size() || written[i + 1].name != written[i].name;
    if (last) {
      EXPECT_EQ(written[i].start + written[i].count, written[i].numel) << written[i].name << ": the end missing";
    }
  }
}

void expect_split_gpt_trains_as_the_whole(const Split& k) {
  SCOPED_TRACE("T " + std::to_string(k.tensor) + " D " + std::to_string(k.data) +
               (k.checkpointing ? " gradient checkpointing" : "") + (k.sequence_parallel ? " sequence parallel" : "") +
               (k.zero_stage ? " ZeRO-" + std::to_string(k.zero_stage) : ""));
  const GptConfig config = small(k.dropout);
  auto whole = train_whole(config, kRowsPerRank * k.data, k.checkpointing);
  LayoutRequest request;
  request.world = k.tensor * k.data;
  request.tensor_parallel = k.tensor;
  const Layout layout = Layout::build(request);
  comm::CommOptions options;
  options.backend = "shm";
  options.timeout = comm::Seconds(60);
  std::map<std::string, torch::Tensor> whole_values;  // what a checkpoint of ZeRO's slices must hold
  for (const auto& p : whole->named_parameters()) whole_values[p.key()] = p.value().detach().reshape({-1});
  std::mutex written_lock;
  std::vector<Written> written;
  testing::run_ranks_as_threads(layout.world(), options, [&](comm::Communicator& world) {
    const int r = world.rank();
    const auto at = layout.coordinates_of(r);
    auto tensor = world.group(layout.group_of(ParallelDim::tensor, r), layout.group_name(ParallelDim::tensor, r));
    auto data = world.group(layout.group_of(ParallelDim::data, r), layout.group_name(ParallelDim::data, r));
    auto model = seeded_gpt(config);
    model->set_gradient_checkpointing(k.checkpointing);
    model->split_for_tensor_parallel(*tensor, k.sequence_parallel);
    DataRanks ranks(model, *data, *tensor, k.zero_stage);
    for (int s = 0; s < kSteps; ++s) {
      const Batch b = batch_of(s, kRowsPerRank * k.data);
      const auto rows = [&](const torch::Tensor& t) { return t.narrow(0, at.data * kRowsPerRank, kRowsPerRank); };
      ranks.before_forward();
      const auto logits = model->forward_seeded(rows(b.tokens), dropout_seed(s));
      ranks.after_forward(logits);
      EXPECT_EQ(logits.size(-1), config.vocab_size / k.tensor) << "the logits stay split";
      vocab_parallel_cross_entropy(logits, rows(b.targets), *tensor).mean().backward();
      ranks.clip_and_step();
    }
    EXPECT_TRUE(ranks.whole_parameters_agree());
    {  // its checkpoint: each shard (or ZeRO's slice of one) where it sits in its whole tensor
      const train::TensorSplit split{model->tensor_shards(), tensor.get()};
      const auto snapshot = k.zero_stage > 0 ? train::snapshot_zero(*model, ranks.zero(), r, true, &split)
                                             : train::snapshot_tensor_parallel(*model, split, ranks.optimizer(),
                                                                               model->parameters(), at.data, k.data,
                                                                               r == 0);
      std::lock_guard<std::mutex> lock(written_lock);
      expect_pieces_hold_the_whole_values(snapshot, whole_values, written);
    }
    const auto want = split_copy_of(config, whole, *tensor);
    auto got = ranks.parameters();
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, w] : want) {
      const auto g = got[name].detach();
      ASSERT_TRUE(g.sizes().equals(w.sizes())) << name;
      EXPECT_LE((g - w).abs().max().item<double>() / w.abs().max().item<double>(), 1e-12) << name;
    }
  });
  expect_each_element_written_once(written);
}

TEST(GptTensorParallel, TwoAndFourTensorRanksWithDropoutTrainAsOneProcess) {
  expect_split_gpt_trains_as_the_whole({2, 1, 0.1, false});
  expect_split_gpt_trains_as_the_whole({4, 1, 0.1, false});
}

TEST(GptTensorParallel, GradientCheckpointingRecomputesTheSplitBlocksExactly) {
  expect_split_gpt_trains_as_the_whole({2, 1, 0.1, true});
}

// Megatron's sequence parallelism: norms, dropouts and residuals on a slice of the tokens each, the
// masks the whole tensors' slices, the whole parameters' gradients summed over the group.
TEST(GptTensorParallel, SequenceParallelTrainsAsOneProcess) {
  expect_split_gpt_trains_as_the_whole({2, 1, 0.1, false, true});
  expect_split_gpt_trains_as_the_whole({4, 1, 0.1, true, true});
  expect_split_gpt_trains_as_the_whole({2, 2, 0.0, false, true});
}

// Without dropout: a data rank's residual masks would be drawn over its own rows, not the whole
// batch's (equivalence_test.cc covers dropout across data ranks with shard-aware masks).
TEST(GptTensorParallel, TensorTimesDataRanksTrainAsOneProcessOnTheWholeBatch) {
  expect_split_gpt_trains_as_the_whole({2, 2, 0.0, false});
}

// ZeRO over each tensor rank's data ranks (torchtitan's FSDP x TP): the parameters, gradients and
// optimizer state of each cut sharded again over its data ranks, the norm over cuts and slices.
TEST(GptTensorParallel, ZeroOverEachTensorRanksDataRanksTrainsAsOneProcess) {
  expect_split_gpt_trains_as_the_whole({2, 2, 0.0, false, false, 2});
  expect_split_gpt_trains_as_the_whole({2, 2, 0.0, true, true, 3});
}

// Layouts drawn at random (the seed printed: LOCKSTEP_TEST_SEED replays it): T of 2 or 4, D of 1
// or 2 (with ZeRO stage 0, 2 or 3 over it), sequence parallelism and gradient checkpointing on or
// off, dropout where D is 1.
TEST(GptTensorParallel, RandomLayoutsTrainAsOneProcess) {
  std::mt19937_64 rng(testing::test_seed());
  for (int trial = 0; trial < 3; ++trial) {
    Split k;
    k.tensor = rng() % 2 ? 4 : 2;
    k.data = k.tensor == 2 && rng() % 2 ? 2 : 1;
    k.dropout = k.data == 1 ? 0.1 : 0.0;
    k.checkpointing = rng() % 2;
    k.sequence_parallel = rng() % 2;
    constexpr int kZeroStages[] = {0, 2, 3};
    k.zero_stage = k.data == 2 ? kZeroStages[rng() % 3] : 0;
    SCOPED_TRACE("trial " + std::to_string(trial));
    expect_split_gpt_trains_as_the_whole(k);
  }
}

// The whole model on `micro_batches` micro-batches of kRowsPerRank rows a step, each micro-batch's
// mean loss weighted 1 / micro_batches, without dropout.
GptLmHeadModel train_whole_in_micro_batches(const GptConfig& c, int micro_batches) {
  auto m = seeded_gpt(c);
  auto opt = adamw(m->parameters());
  for (int s = 0; s < kSteps; ++s) {
    const Batch b = batch_of(s, kRowsPerRank * micro_batches);
    opt.zero_grad();
    for (int k = 0; k < micro_batches; ++k) {
      const auto logits = m->forward_seeded(b.tokens.narrow(0, k * kRowsPerRank, kRowsPerRank), dropout_seed(s));
      const auto targets = b.targets.narrow(0, k * kRowsPerRank, kRowsPerRank);
      (torch::nn::functional::cross_entropy(logits.view({-1, c.vocab_size}), targets.reshape({-1})) / micro_batches)
          .backward();
    }
    EXPECT_GT(torch::nn::utils::clip_grad_norm_(m->parameters(), kMaxNorm), kMaxNorm) << "clipping is active";
    opt.step();
  }
  return m;
}

struct Staged {
  int data = 1;
  bool sequence_parallel = false;
  pipe::ScheduleKind schedule = pipe::ScheduleKind::one_f_one_b;
  int virtual_stages = 1;
};

// 2 stages x 2 tensor ranks (x D data ranks): each tensor rank's mesh runs a pipe::Pipeline of the
// split GPT's units, 4 micro-batches a replica, the norm clipped over stages and shards. Without
// dropout: the rank threads draw the pipeline's dropout seeds from one shared generator.
void expect_split_stages_train_as_the_whole(const Staged& k) {
  SCOPED_TRACE("P 2 T 2 D " + std::to_string(k.data) + ", " + pipe::schedule_name(k.schedule) +
               (k.sequence_parallel ? ", sequence parallel" : ""));
  constexpr int kMicroBatches = 4;
  const GptConfig config = small(0.0);
  auto whole = train_whole_in_micro_batches(config, kMicroBatches * k.data);
  LayoutRequest request;
  request.world = 4 * k.data;
  request.pipeline_parallel = 2;
  request.tensor_parallel = 2;
  const Layout layout = Layout::build(request);
  comm::CommOptions options;
  options.backend = "shm";
  options.timeout = comm::Seconds(60);
  testing::run_ranks_as_threads(layout.world(), options, [&](comm::Communicator& world) {
    const int r = world.rank();
    auto tensor = world.group(layout.group_of(ParallelDim::tensor, r), layout.group_name(ParallelDim::tensor, r));
    auto mesh = world.group(layout.group_of(ParallelDim::mesh, r), layout.group_name(ParallelDim::mesh, r));
    auto model = seeded_gpt(config);
    model->split_for_tensor_parallel(*tensor, k.sequence_parallel);
    pipe::PipelineOptions o;
    o.pipeline_parallel = 2;
    o.schedule = k.schedule;
    o.virtual_stages = k.virtual_stages;
    o.balance = pipe::PipelineOptions::Balance::parameters;
    o.tensor_group = tensor.get();
    o.split_parameters = model->split_parameters();
    const Batch first = batch_of(0, kRowsPerRank);
    auto loss = [&](const torch::Tensor& out, const torch::Tensor& target) {
      return vocab_parallel_cross_entropy(out.reshape({-1, out.size(-1)}), target.reshape({-1}), *tensor).mean();
    };
    pipe::Pipeline pipeline(model->pipeline_units(), *mesh, o, {first.tokens, first.targets, 1}, loss);
    auto opt = adamw(pipeline.parameters());
    const int replica = layout.coordinates_of(r).data;
    for (int s = 0; s < kSteps; ++s) {
      const Batch b = batch_of(s, kRowsPerRank * kMicroBatches * k.data);
      std::vector<pipe::MicroBatch> micro;
      for (int m = 0; m < kMicroBatches; ++m) {
        const std::int64_t row = (replica * kMicroBatches + m) * kRowsPerRank;
        micro.push_back({b.tokens.narrow(0, row, kRowsPerRank), b.targets.narrow(0, row, kRowsPerRank),
                         1.0 / kMicroBatches});
      }
      opt.zero_grad();
      pipeline.train_step(micro);
      EXPECT_GT(pipeline.clip_grad_norm(kMaxNorm), kMaxNorm) << "clipping is active";
      opt.step();
      pipeline.after_optimizer_step();
    }
    const auto want = split_copy_of(config, whole, *tensor);
    std::map<std::string, torch::Tensor> expected(want.begin(), want.end());
    for (const auto& [name, got] : pipeline.named_parameters()) {
      const auto& w = expected.at(name);
      ASSERT_TRUE(got.sizes().equals(w.sizes())) << name;
      EXPECT_LE((got.detach() - w).abs().max().item<double>() / w.abs().max().item<double>(), 1e-12) << name;
    }
  });
}

TEST(GptTensorParallel, PipelinesOfSplitStagesTrainAsOneProcess) {
  expect_split_stages_train_as_the_whole({1, false, pipe::ScheduleKind::one_f_one_b});
  expect_split_stages_train_as_the_whole({1, true, pipe::ScheduleKind::zero_bubble});
  expect_split_stages_train_as_the_whole({2, false, pipe::ScheduleKind::interleaved, 2});
}

TEST(GptTensorParallel, ADegreeThatDoesNotDivideTheHeadsOrTheVocabularyIsRefused) {
  comm::CommOptions options;
  options.backend = "shm";
  testing::run_ranks_as_threads(3, options, [&](comm::Communicator& group) {
    auto model = seeded_gpt(small(0));
    try {
      model->split_for_tensor_parallel(group);
      ADD_FAILURE() << "16 tokens and 4 heads split 3 ways";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("--tensor-parallel 3 does not divide the GPT's vocab_size (16)"),
                std::string::npos)
          << e.what();
    }
  });
  testing::run_ranks_as_threads(2, options, [&](comm::Communicator& group) {
    auto model = seeded_gpt(small(0));
    model->split_for_tensor_parallel(group);
    EXPECT_THROW(model->split_for_tensor_parallel(group), ConfigError);
    EXPECT_THROW(models::generate(model, {1, 2}, {}), ConfigError);
  });
}

}  // namespace
}  // namespace lockstep::tp::gpt_test
