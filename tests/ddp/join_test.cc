// Join: ranks (threads over real communicators) with different numbers of batches finish
// together under DDP and ZeRO 1 and 2, every rank ending bitwise equal to the others and equal to
// one process that trains, at each step, on the batches of the ranks that still had one.
#include "lockstep/ddp/join.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <mutex>

#include "lockstep/ddp/zero.h"
#include "lockstep/error.h"
#include "stage_optimizer.h"
#include "testing.h"

namespace lockstep {
namespace {

std::mutex init_mu;  // construction draws from torch's global generator, shared by the thread ranks

torch::nn::Sequential make_mlp() {
  std::lock_guard<std::mutex> lock(init_mu);
  torch::manual_seed(5);
  return torch::nn::Sequential(torch::nn::Linear(20, 33), torch::nn::ReLU(), torch::nn::Linear(33, 5));
}

std::pair<torch::Tensor, torch::Tensor> batch(int rank, int step) {
  auto g = at::detail::createCPUGenerator(100 * std::uint64_t(step) + std::uint64_t(rank));
  auto x = torch::randn({8, 20}, g);
  return {x, torch::randint(5, {8}, g)};
}

std::unique_ptr<torch::optim::Optimizer> sgd(std::vector<torch::Tensor> p) {
  return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9));
}

std::vector<torch::Tensor> parameters_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

// One process: step s trains on the concatenated batches of the ranks with more than s batches.
std::vector<torch::Tensor> train_alone(const std::vector<int>& batches_per_rank) {
  auto net = make_mlp();
  auto opt = sgd(net->parameters());
  const int steps = *std::max_element(batches_per_rank.begin(), batches_per_rank.end());
  for (int s = 0; s < steps; ++s) {
    std::vector<torch::Tensor> xs, ys;
    for (int r = 0; r < int(batches_per_rank.size()); ++r)
      if (batches_per_rank[std::size_t(r)] > s) {
        auto [x, y] = batch(r, s);
        xs.push_back(x), ys.push_back(y);
      }
    torch::nn::functional::cross_entropy(net->forward(torch::cat(xs)), torch::cat(ys)).backward();
    opt->step();
    opt->zero_grad();
  }
  return parameters_of(*net);
}

// Each rank trains on its own number of batches through Join; returns each rank's parameters.
std::vector<std::vector<torch::Tensor>> train_joined(const std::vector<int>& batches_per_rank, int zero_stage) {
  const int world = int(batches_per_rank.size());
  std::vector<std::vector<torch::Tensor>> out(static_cast<std::size_t>(world));
  testing::run_ranks_as_threads(world, comm::CommOptions{"shm"}, [&](comm::Communicator& comm) {
    auto net = make_mlp();
    std::optional<BucketSharding> sharding;
    DdpOptions ddp;
    ddp.bucket_cap_mb = 0.002;  // several buckets
    ddp.first_bucket_cap_mb = 0.001;
    if (zero_stage > 0) sharding = zero_bucket_sharding({zero_stage, false}, comm.size());
    Reducer reducer(net.ptr(), comm, ddp, sharding);
    testing::StageOptimizer opt(*net, reducer, comm, zero_stage, sgd);
    Join join(reducer, comm);
    int done = 0;
    while (join.next(done < batches_per_rank[std::size_t(comm.rank())])) {
      reducer.before_forward();
      if (join.has_batch()) {
        auto [x, y] = batch(comm.rank(), done++);
        auto out_ = net->forward(x);
        reducer.after_forward(&out_);
        torch::nn::functional::cross_entropy(out_, y).backward();
      } else {
        reducer.reduce_zeros();
      }
      opt.step_and_zero_grad();
    }
    out[std::size_t(comm.rank())] = parameters_of(*net);
  });
  return out;
}

// Float32 sums over ranks in another order than one process's batch: a few ulps per step.
void expect_close(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(torch::allclose(got[i], want[i], 1e-5, 1e-6))
        << what << ": parameter " << i << " off by " << (got[i] - want[i]).abs().max().item<double>();
}

void expect_equal_ranks(const std::vector<std::vector<torch::Tensor>>& ranks, const std::string& what) {
  for (std::size_t r = 1; r < ranks.size(); ++r)
    for (std::size_t i = 0; i < ranks[0].size(); ++i)
      EXPECT_TRUE(torch::equal(ranks[r][i], ranks[0][i])) << what << ": rank " << r << " parameter " << i;
}

TEST(Join, RanksWithFewerBatchesFinishTogetherUnderDdpAndZero) {
  for (const std::vector<int>& counts : {std::vector<int>{4, 2}, std::vector<int>{4, 3, 1}, std::vector<int>{0, 3, 3}}) {
    const auto alone = train_alone(counts);
    for (int stage : {0, 1, 2}) {
      std::string what = "batches";
      for (int c : counts) what += " " + std::to_string(c);
      what += ", stage " + std::to_string(stage);
      const auto ranks = train_joined(counts, stage);
      expect_equal_ranks(ranks, what);
      expect_close(ranks[0], alone, what);
    }
  }
}

// What the averaging over contributors buys: dividing by the world size instead (zeros counted
// as gradients) trains measurably differently once a rank has run out.
TEST(Join, TheAverageIsOverTheRanksThatHadABatch) {
  const std::vector<int> counts{4, 1};
  const auto alone = train_alone(counts);
  std::vector<std::vector<torch::Tensor>> ranks(2);
  testing::run_ranks_as_threads(2, comm::CommOptions{"shm"}, [&](comm::Communicator& comm) {
    auto net = make_mlp();
    Reducer reducer(net.ptr(), comm, DdpOptions{});
    auto opt = sgd(net->parameters());
    for (int s = 0; s < 4; ++s) {
      reducer.before_forward();
      if (s < counts[std::size_t(comm.rank())]) {
        auto [x, y] = batch(comm.rank(), s);
        auto out = net->forward(x);
        reducer.after_forward(&out);
        torch::nn::functional::cross_entropy(out, y).backward();
      } else {
        reducer.reduce_zeros();  // no Join: the reducer still divides by 2
      }
      opt->step(), opt->zero_grad();
    }
    ranks[std::size_t(comm.rank())] = parameters_of(*net);
  });
  expect_equal_ranks(ranks, "without Join");
  double off = 0;
  for (std::size_t i = 0; i < alone.size(); ++i) off = std::max(off, (ranks[0][i] - alone[i]).abs().max().item<double>());
  EXPECT_GT(off, 1e-3);
}

TEST(Join, ReduceZerosBeforeForwardIsAClearError) {
  testing::run_ranks_as_threads(1, comm::CommOptions{"shm"}, [&](comm::Communicator& comm) {
    auto net = make_mlp();
    Reducer reducer(net.ptr(), comm, DdpOptions{});
    try {
      reducer.reduce_zeros();
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("needs before_forward() first"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
}  // namespace lockstep
