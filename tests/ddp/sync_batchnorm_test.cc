// SyncBatchNorm: W ranks (threads over real communicators) training a CNN under DDP and ZeRO
// against one process with torch::nn::BatchNorm2d on the concatenated batch.
#include "lockstep/ddp/sync_batchnorm.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>

#include "lockstep/ddp/ddp.h"
#include "lockstep/ddp/zero.h"
#include "lockstep/error.h"
#include "stage_optimizer.h"
#include "testing.h"

namespace lockstep {
namespace {

// The same CNN with either normalisation; neither draws from the generator when built, so both
// start from the same weights under the same seed.
template <class Norm>
struct CnnImpl : torch::nn::Module {
  CnnImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1).bias(false)));
    norm = register_module("norm", Norm(4));
    fc = register_module("fc", torch::nn::Linear(4 * 4 * 4, 5));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc(torch::max_pool2d(torch::relu(norm(conv(x))), 2).flatten(1)); }
  torch::nn::Conv2d conv{nullptr};
  Norm norm{nullptr};
  torch::nn::Linear fc{nullptr};
};

std::mutex init_mu;  // construction draws from torch's global generator, shared by the thread ranks

template <class Norm>
std::shared_ptr<CnnImpl<Norm>> make_cnn() {
  std::lock_guard<std::mutex> lock(init_mu);
  torch::manual_seed(11);
  return std::make_shared<CnnImpl<Norm>>();
}

constexpr int kPerRank = 6;
constexpr int kSteps = 4;

// Step s's global batch: rank r's part is rows [r * kPerRank, (r + 1) * kPerRank). The inputs
// are shifted and scaled per channel so the statistics matter.
std::pair<torch::Tensor, torch::Tensor> global_batch(int world, int step) {
  auto g = at::detail::createCPUGenerator(1000 + step);
  auto x = torch::randn({world * kPerRank, 1, 8, 8}, g) * 3 + 1.5;
  auto y = torch::randint(5, {world * kPerRank}, g);
  return {x, y};
}

struct Trained {
  std::vector<torch::Tensor> parameters;
  torch::Tensor running_mean, running_var;
};

Trained snapshot(torch::nn::Module& m, const torch::Tensor& mean, const torch::Tensor& var) {
  Trained t;
  for (const auto& p : m.parameters()) t.parameters.push_back(p.detach().clone());
  t.running_mean = mean.clone(), t.running_var = var.clone();
  return t;
}

// One process, plain BatchNorm, the whole batch, mean loss, SGD.
Trained train_alone(int world) {
  auto net = make_cnn<torch::nn::BatchNorm2d>();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.2).momentum(0.9));
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(world, step);
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    opt.step();
    opt.zero_grad();
  }
  return snapshot(*net, net->norm->running_mean, net->norm->running_var);
}

// W ranks with SyncBatchNorm, each on its rows, under DDP (stage 0) or ZeRO (1, 2).
std::vector<Trained> train_synced(int world, int zero_stage, const comm::CommOptions& options = {"shm"}) {
  std::vector<Trained> out(static_cast<std::size_t>(world));
  testing::run_ranks_as_threads(world, options, [&](comm::Communicator& comm) {
    auto net = make_cnn<SyncBatchNorm>();
    EXPECT_EQ(sync_batchnorm(*net, comm), 1);
    std::optional<BucketSharding> sharding;
    if (zero_stage > 0) sharding = zero_bucket_sharding({zero_stage, false}, comm.size());
    Reducer reducer(net, comm, DdpOptions{}, sharding);
    auto sgd = [](std::vector<torch::Tensor> p) {
      return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.2).momentum(0.9));
    };
    testing::StageOptimizer opt(*net, reducer, comm, zero_stage, sgd);
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = global_batch(world, step);
      x = x.narrow(0, comm.rank() * kPerRank, kPerRank), y = y.narrow(0, comm.rank() * kPerRank, kPerRank);
      reducer.before_forward();
      auto logits = net->forward(x);
      reducer.after_forward(&logits);
      torch::nn::functional::cross_entropy(logits, y).backward();
      opt.step_and_zero_grad();
    }
    out[std::size_t(comm.rank())] = snapshot(*net, net->norm->running_mean, net->norm->running_var);
  });
  return out;
}

// float32 arithmetic summed in another order (per rank, then over ranks) differs from the one
// process's by a few ulps per step; four SGD steps with momentum carry that to ~1e-6 relative.
// 1e-4 leaves room and is still far below what per-rank statistics give (tested below).
void expect_close(const Trained& got, const Trained& want, const std::string& what) {
  ASSERT_EQ(got.parameters.size(), want.parameters.size());
  for (std::size_t i = 0; i < got.parameters.size(); ++i)
    EXPECT_TRUE(torch::allclose(got.parameters[i], want.parameters[i], 1e-4, 1e-5))
        << what << ": parameter " << i << " differs by "
        << (got.parameters[i] - want.parameters[i]).abs().max().item<double>();
  EXPECT_TRUE(torch::allclose(got.running_mean, want.running_mean, 1e-4, 1e-5)) << what << ": running mean";
  EXPECT_TRUE(torch::allclose(got.running_var, want.running_var, 1e-4, 1e-5)) << what << ": running variance";
}

TEST(SyncBatchNorm, WithoutACommunicatorItIsBatchNormBitForBit) {
  auto plain = make_cnn<torch::nn::BatchNorm2d>();
  auto synced = make_cnn<SyncBatchNorm>();
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = global_batch(1, step);
    auto a = plain->forward(x), b = synced->forward(x);
    EXPECT_TRUE(torch::equal(a, b));
    torch::nn::functional::cross_entropy(a, y).backward();
    torch::nn::functional::cross_entropy(b, y).backward();
  }
  const auto pp = plain->named_parameters(), sp = synced->named_parameters();
  for (const auto& item : pp) EXPECT_TRUE(torch::equal(item.value().grad(), sp[item.key()].grad())) << item.key();
  const auto pb = plain->named_buffers(), sb = synced->named_buffers();
  ASSERT_EQ(pb.size(), sb.size());
  for (const auto& item : pb) EXPECT_TRUE(torch::equal(item.value(), sb[item.key()])) << item.key();
  plain->eval(), synced->eval();
  auto x = global_batch(1, 9).first;
  EXPECT_TRUE(torch::equal(plain->forward(x), synced->forward(x)));
}

TEST(SyncBatchNorm, TwoAndThreeRanksTrainAsOneProcessOnTheConcatenatedBatch) {
  for (int world : {2, 3}) {
    const Trained alone = train_alone(world);
    const auto ranks = train_synced(world, 0);
    for (int r = 0; r < world; ++r)
      expect_close(ranks[std::size_t(r)], alone, "world " + std::to_string(world) + " rank " + std::to_string(r));
  }
}

TEST(SyncBatchNorm, WorksUnderZeroStagesOneAndTwoAndOnGloo) {
  const Trained alone = train_alone(2);
  for (int stage : {1, 2})
    for (const auto& r : train_synced(2, stage)) expect_close(r, alone, "ZeRO stage " + std::to_string(stage));
  for (const auto& r : train_synced(2, 0, {"gloo"})) expect_close(r, alone, "gloo");
}

// hier: shared memory inside each of two (declared) machines, gloo between them.
TEST(SyncBatchNorm, WorksOnHierAcrossTwoMachines) {
  comm::CommOptions hier{"hier"};
  hier.machine_of = {0, 0, 1, 1};
  const Trained alone = train_alone(4);
  for (const auto& r : train_synced(4, 0, hier)) expect_close(r, alone, "hier 2 x 2");
}

// What the test above would catch: per-rank statistics (plain BatchNorm under DDP) train
// measurably differently from the one process, by far more than the tolerance.
TEST(SyncBatchNorm, PerRankStatisticsAreFarFromTheOneProcess) {
  const Trained alone = train_alone(2);
  std::vector<Trained> ranks(2);
  testing::run_ranks_as_threads(2, comm::CommOptions{"shm"}, [&](comm::Communicator& comm) {
    auto net = make_cnn<torch::nn::BatchNorm2d>();
    Reducer reducer(net, comm, DdpOptions{});
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.2).momentum(0.9));
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = global_batch(2, step);
      x = x.narrow(0, comm.rank() * kPerRank, kPerRank), y = y.narrow(0, comm.rank() * kPerRank, kPerRank);
      reducer.before_forward();
      auto logits = net->forward(x);
      reducer.after_forward(&logits);
      torch::nn::functional::cross_entropy(logits, y).backward();
      opt.step(), opt.zero_grad();
    }
    ranks[std::size_t(comm.rank())] = snapshot(*net, net->norm->running_mean, net->norm->running_var);
  });
  double largest = 0;
  for (std::size_t i = 0; i < alone.parameters.size(); ++i)
    largest = std::max(largest, (ranks[0].parameters[i] - alone.parameters[i]).abs().max().item<double>());
  EXPECT_GT(largest, 1e-3);
}

TEST(SyncBatchNorm, APlainBatchNormInTheModelIsNamed) {
  auto net = make_cnn<torch::nn::BatchNorm2d>();
  testing::run_ranks_as_threads(1, comm::CommOptions{"shm"}, [&](comm::Communicator& comm) {
    try {
      sync_batchnorm(*net, comm);
      ADD_FAILURE() << "no error";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("'model.norm' is a torch::nn::BatchNorm2d"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("lockstep::SyncBatchNorm"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
}  // namespace lockstep
