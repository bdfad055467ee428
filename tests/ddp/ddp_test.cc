// DistributedDataParallel against single-process training, with ranks as threads over real
// shm (and gloo) communicators. Each test fails if the feature it names is missing: without
// the reduction, ranks train on different data and drift apart; without the broadcast, they
// start apart; without no_sync, the micro-batches are reduced one by one (same mean, but the
// bytes counted differ); and so on.
#include "lockstep/ddp/ddp.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>
#include <set>
#include <thread>

#include "lockstep/error.h"
#include "testing.h"

namespace lockstep {
namespace {

struct MlpImpl : torch::nn::Module {
  MlpImpl(int in, int hidden, int out) {
    fc1 = register_module("fc1", torch::nn::Linear(in, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, hidden));
    fc3 = register_module("fc3", torch::nn::Linear(hidden, out));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(fc1(x.flatten(1)));
    x = torch::relu(fc2(x));
    return fc3(x);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Mlp);

struct CnnImpl : torch::nn::Module {
  CnnImpl() {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 8, 3).padding(1)));
    fc = register_module("fc", torch::nn::Linear(8 * 2 * 2, 5));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1(x)), 2);
    x = torch::max_pool2d(torch::relu(conv2(x)), 2);
    return fc(x.flatten(1));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Cnn);

// BatchNorm normalises with each rank's own batch (as in PyTorch without SyncBatchNorm), so it
// is not in the equivalence test; it is where buffers live.
struct NormedImpl : torch::nn::Module {
  NormedImpl() {
    fc = register_module("fc", torch::nn::Linear(6, 4));
    norm = register_module("norm", torch::nn::BatchNorm1d(4));
  }
  torch::Tensor forward(torch::Tensor x) { return norm(fc(x)); }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};
TORCH_MODULE(Normed);

// A model whose `side` branch joins the output only when asked to.
struct BranchyImpl : torch::nn::Module {
  BranchyImpl() {
    trunk = register_module("trunk", torch::nn::Linear(6, 4));
    side = register_module("side", torch::nn::Linear(6, 4));
  }
  torch::Tensor forward(torch::Tensor x, bool use_side) {
    auto y = trunk(x);
    return use_side ? y + side(x) : y;
  }
  torch::nn::Linear trunk{nullptr}, side{nullptr};
};
TORCH_MODULE(Branchy);

// Module construction draws from torch's global generator: serialise it so rank r's initial
// weights depend only on its seed.
std::mutex init_mu;
template <class Make>
auto seeded(std::uint64_t seed, Make make) {
  std::lock_guard<std::mutex> lock(init_mu);
  torch::manual_seed(seed);
  return make();
}

std::vector<torch::Tensor> snapshot(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p.detach().clone());
  for (auto& b : m.buffers()) out.push_back(b.detach().clone());
  return out;
}

double max_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    worst = std::max(worst, (a[i].to(torch::kDouble) - b[i].to(torch::kDouble)).abs().max().item<double>());
  }
  return worst;
}

bool bitwise_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}

comm::CommOptions shm_options() {
  comm::CommOptions o;
  o.backend = "shm";
  o.timeout = comm::Seconds(60);
  return o;
}

struct Case {
  std::string model;  // mlp | cnn
  int world;
  DdpOptions ddp;
  std::string backend = "shm";
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.model << " on " << c.world << " " << c.backend << " ranks";
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  auto& c = info.param;
  std::string name = c.model + "_w" + std::to_string(c.world) + "_" + c.backend;
  if (c.ddp.bucket_cap_mb < 1) name += "_tiny_buckets";
  if (!c.ddp.gradient_as_bucket_view) name += "_copy_grads";
  if (!c.ddp.shared_buckets) name += "_private_buckets";
  return name;
}

class Equivalence : public ::testing::TestWithParam<Case> {};

// W ranks with batch B each, K steps of SGD with momentum, against one process on the W*B batch.
// Tolerance: the ranks' gradient is the mean of W per-rank means, the reference's the mean
// over W*B samples; the two differ only in float32 summation order, a few ulps (~1e-7
// relative) per step. Five steps at lr 0.05 keep the parameter difference well under 1e-5,
// while training on the wrong data (no reduction) moves parameters by ~1e-2.
TEST_P(Equivalence, MatchesOneProcessOnTheConcatenatedBatch) {
  const Case c = GetParam();
  const int B = 8, K = 5;
  const std::uint64_t seed = 7;
  torch::manual_seed(99);
  auto inputs =
      c.model == "mlp" ? torch::randn({c.world * B * K, 12}) : torch::randn({c.world * B * K, 1, 8, 8});
  auto labels = torch::randint(0, 5, {c.world * B * K});

  auto make = [&]() -> std::shared_ptr<torch::nn::Module> {
    if (c.model == "mlp") return Mlp(12, 16, 5).ptr();
    return Cnn().ptr();
  };
  auto run_forward = [&](torch::nn::Module& m, const torch::Tensor& x) {
    if (c.model == "mlp") return static_cast<MlpImpl&>(m).forward(x);
    return static_cast<CnnImpl&>(m).forward(x);
  };

  // Reference: one process, the whole W*B batch per step.
  auto reference = seeded(seed, make);
  {
    torch::optim::SGD opt(reference->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int k = 0; k < K; ++k) {
      auto rows = torch::arange(k * c.world * B, (k + 1) * c.world * B);
      auto loss =
          torch::cross_entropy_loss(run_forward(*reference, inputs.index({rows})), labels.index({rows}));
      opt.zero_grad();
      loss.backward();
      opt.step();
    }
  }

  std::vector<std::vector<torch::Tensor>> finals(c.world);
  std::vector<DdpStats> stats(c.world);
  comm::CommOptions options = shm_options();
  options.backend = c.backend;
  testing::run_ranks_as_threads(c.world, options, [&](comm::Communicator& comm) {
    int r = comm.rank();
    auto model = seeded(seed + std::uint64_t(r) * 1000, make);  // ranks start apart
    Reducer reducer(model, comm, c.ddp);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int k = 0; k < K; ++k) {
      auto rows = torch::arange((k * c.world + r) * B, (k * c.world + r + 1) * B);
      reducer.before_forward();
      auto out = run_forward(*model, inputs.index({rows}));
      reducer.after_forward(&out);
      auto loss = torch::cross_entropy_loss(out, labels.index({rows}));
      opt.zero_grad();
      loss.backward();
      opt.step();
    }
    finals[r] = snapshot(*model);
    stats[r] = reducer.stats();
  });

  auto expected = snapshot(*reference);
  for (int r = 0; r < c.world; ++r) {
    EXPECT_TRUE(bitwise_equal(finals[r], finals[0])) << "rank " << r << " differs from rank 0";
    EXPECT_EQ(stats[r].step, std::uint64_t(K));
  }
  double diff = max_difference(finals[0], expected);
  EXPECT_LT(diff, 1e-5) << "DDP drifted from single-process training";
  if (c.ddp.bucket_cap_mb < 1) {
    EXPECT_GE(stats[0].bucket_count, 3);
  }
  // On shm the buckets live in shared memory (the zero-copy all-reduce), unless turned off.
  bool shared = c.backend == "shm" && c.world > 1 && c.ddp.shared_buckets;
  for (int r = 0; r < c.world; ++r) EXPECT_EQ(stats[r].shared_buckets, shared ? stats[r].bucket_count : 0);
}

DdpOptions tiny_buckets() {
  DdpOptions o;
  o.bucket_cap_mb = o.first_bucket_cap_mb = 1e-4;  // ~100 bytes: about one parameter each
  return o;
}
DdpOptions private_buckets() {
  DdpOptions o = tiny_buckets();
  o.shared_buckets = false;
  return o;
}
DdpOptions copied_grads() {
  DdpOptions o = tiny_buckets();
  o.gradient_as_bucket_view = false;
  return o;
}

INSTANTIATE_TEST_SUITE_P(Ddp, Equivalence,
                         ::testing::Values(Case{"mlp", 1, {}}, Case{"mlp", 2, {}}, Case{"mlp", 3, {}},
                                           Case{"mlp", 2, tiny_buckets()}, Case{"mlp", 3, tiny_buckets()},
                                           Case{"mlp", 2, copied_grads()}, Case{"mlp", 3, private_buckets()},
                                           Case{"cnn", 1, {}}, Case{"cnn", 2, {}},
                                           Case{"cnn", 3, tiny_buckets()},
                                           Case{"mlp", 3, tiny_buckets(), "gloo"},
                                           Case{"cnn", 2, {}, "gloo"}),
                         case_name);

// Broadcast at construction: ranks built with different seeds hold rank 0's weights after.
TEST(Ddp, ConstructionCopiesRankZerosParametersAndBuffers) {
  std::vector<std::vector<torch::Tensor>> after(3);
  std::vector<torch::Tensor> rank0_before;
  testing::run_ranks_as_threads(3, shm_options(), [&](comm::Communicator& comm) {
    auto model = seeded(100 + comm.rank(), [] { return Normed(); });
    {
      torch::NoGradGuard no_grad;
      model->norm->running_mean.fill_(comm.rank());  // a buffer that differs per rank
    }
    if (comm.rank() == 0) rank0_before = snapshot(*model);
    DistributedDataParallel ddp(model, comm);
    after[comm.rank()] = snapshot(*ddp.module());
  });
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(bitwise_equal(after[r], rank0_before)) << "rank " << r;
}

// Each training forward starts from rank 0's running statistics; with the option off, each
// rank keeps its own.
TEST(Ddp, TrainingForwardsStartFromRankZerosBuffers) {
  for (bool broadcast : {true, false}) {
    std::vector<torch::Tensor> seen(2);  // running_mean right after the third forward began
    testing::run_ranks_as_threads(2, shm_options(), [&](comm::Communicator& comm) {
      auto model = seeded(110, [] { return Normed(); });
      DdpOptions o;
      o.broadcast_buffers = broadcast;
      DistributedDataParallel ddp(model, comm, o);
      auto x = torch::randn({8, 6}) * (comm.rank() + 1);  // ranks see different statistics
      for (int step = 0; step < 2; ++step) ddp.forward(x).pow(2).sum().backward();
      ddp.reducer().before_forward();
      seen[comm.rank()] = model->norm->running_mean.clone();
    });
    EXPECT_EQ(torch::equal(seen[0], seen[1]), broadcast);
  }
}

// Gradient accumulation: 3 forwards under no_sync and a synced 4th equal one step on the 4x batch.
TEST(Ddp, NoSyncAccumulatesThenReducesOnce) {
  const int W = 2, B = 4, micro = 4;
  torch::manual_seed(5);
  auto inputs = torch::randn({W * B * micro, 12});
  auto labels = torch::randint(0, 5, {W * B * micro});
  auto reference = seeded(11, [] { return Mlp(12, 16, 5); });
  {
    torch::optim::SGD opt(reference->parameters(), 0.1);
    auto loss = torch::cross_entropy_loss(reference->forward(inputs), labels);
    loss.backward();
    opt.step();
  }
  std::vector<std::vector<torch::Tensor>> finals(W);
  std::vector<DdpStats> stats(W);
  testing::run_ranks_as_threads(W, shm_options(), [&](comm::Communicator& comm) {
    int r = comm.rank();
    auto model = seeded(11 + r, [] { return Mlp(12, 16, 5); });
    DistributedDataParallel ddp(model, comm, tiny_buckets());
    torch::optim::SGD opt(ddp.parameters(), 0.1);
    opt.zero_grad();
    for (int m = 0; m < micro; ++m) {
      auto rows = torch::arange((r * micro + m) * B, (r * micro + m + 1) * B);
      auto step = [&] {
        auto loss =
            torch::cross_entropy_loss(ddp.forward(inputs.index({rows})), labels.index({rows})) / micro;
        loss.backward();
      };
      if (m + 1 < micro) {
        auto guard = ddp.no_sync();
        step();
        EXPECT_EQ(ddp.stats().step, 0u) << "a no_sync step reduced";
      } else {
        step();
      }
    }
    opt.step();
    finals[r] = snapshot(*model);
    stats[r] = ddp.stats();
  });
  EXPECT_TRUE(bitwise_equal(finals[0], finals[1]));
  EXPECT_LT(max_difference(finals[0], snapshot(*reference)), 1e-6);
  EXPECT_EQ(stats[0].step, 1u);
}

// The side branch is used on odd steps only (on every rank).
TEST(Ddp, UnusedParametersAreReducedAsZerosWhenAsked) {
  const int W = 2, B = 4, K = 4;
  torch::manual_seed(3);
  auto inputs = torch::randn({W * B * K, 6});
  auto targets = torch::randn({W * B * K, 4});
  auto reference = seeded(21, [] { return Branchy(); });
  {
    torch::optim::SGD opt(reference->parameters(), 0.1);
    for (int k = 0; k < K; ++k) {
      auto rows = torch::arange(k * W * B, (k + 1) * W * B);
      auto loss =
          torch::mse_loss(reference->forward(inputs.index({rows}), k % 2 == 1), targets.index({rows}));
      opt.zero_grad();
      loss.backward();
      opt.step();
    }
  }
  std::vector<std::vector<torch::Tensor>> finals(W);
  testing::run_ranks_as_threads(W, shm_options(), [&](comm::Communicator& comm) {
    int r = comm.rank();
    auto model = seeded(21 + r, [] { return Branchy(); });
    DdpOptions o;
    o.find_unused_parameters = true;
    DistributedDataParallel ddp(model, comm, o);
    torch::optim::SGD opt(ddp.parameters(), 0.1);
    for (int k = 0; k < K; ++k) {
      auto rows = torch::arange((k * W + r) * B, (k * W + r + 1) * B);
      auto loss = torch::mse_loss(ddp.forward(inputs.index({rows}), k % 2 == 1), targets.index({rows}));
      opt.zero_grad();
      loss.backward();
      opt.step();
    }
    finals[r] = snapshot(*model);
  });
  EXPECT_TRUE(bitwise_equal(finals[0], finals[1]));
  EXPECT_LT(max_difference(finals[0], snapshot(*reference)), 1e-6);
}

TEST(Ddp, UnusedParameterWithoutTheOptionIsAnErrorNamingIt) {
  const int W = 2;
  std::vector<std::string> errors(W);
  testing::run_ranks_as_threads(W, shm_options(), [&](comm::Communicator& comm) {
    auto model = seeded(31, [] { return Branchy(); });
    DistributedDataParallel ddp(model, comm);
    auto x = torch::randn({4, 6});
    try {
      ddp.forward(x, false).sum().backward();
    } catch (const std::exception& e) {
      errors[comm.rank()] = e.what();
    }
  });
  for (int r = 0; r < W; ++r) {
    EXPECT_NE(errors[r].find("'side.weight'"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("'side.bias'"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("find_unused_parameters"), std::string::npos) << errors[r];
    EXPECT_EQ(errors[r].find("'trunk.weight'"), std::string::npos) << errors[r];
  }
}

TEST(Ddp, DifferentModelsAreAConfigErrorOnEveryRank) {
  const int W = 3;
  std::vector<std::string> errors(W);
  testing::run_ranks_as_threads(W, shm_options(), [&](comm::Communicator& comm) {
    int hidden = comm.rank() == 2 ? 24 : 16;  // rank 2 built another model
    auto model = seeded(41, [&] { return Mlp(12, hidden, 5); });
    try {
      DistributedDataParallel ddp(model, comm);
    } catch (const ConfigError& e) {
      errors[comm.rank()] = e.what();
    }
  });
  for (int r = 0; r < W; ++r) {
    EXPECT_NE(errors[r].find("'fc1.weight' float32[16, 12] on rank 0"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("float32[24, 12] on rank 2"), std::string::npos) << errors[r];
  }
}

// Compression: the reduced gradient is within the 16-bit type's rounding of the exact one, and
// not equal to it (so the compression did happen), and half the bytes went over the wire.
TEST(Ddp, CompressedGradientsStayWithinTheirRoundingError) {
  const int W = 2;
  torch::manual_seed(8);
  auto inputs = torch::randn({W * 16, 12});
  auto labels = torch::randint(0, 5, {W * 16});
  auto grads_with = [&](CommHook hook, std::size_t& bytes) {
    std::vector<std::vector<torch::Tensor>> grads(W);
    std::vector<std::size_t> sent(W);
    testing::run_ranks_as_threads(W, shm_options(), [&](comm::Communicator& comm) {
      int r = comm.rank();
      auto model = seeded(51, [] { return Mlp(12, 64, 5); });
      DdpOptions o;
      o.comm_hook = hook;
      DistributedDataParallel ddp(model, comm, o);
      auto rows = torch::arange(r * 16, (r + 1) * 16);
      torch::cross_entropy_loss(ddp.forward(inputs.index({rows})), labels.index({rows})).backward();
      for (auto& p : model->parameters()) grads[r].push_back(p.grad().clone());
      sent[r] = ddp.stats().bytes_allreduced;
    });
    EXPECT_TRUE(bitwise_equal(grads[0], grads[1]));
    bytes = sent[0];
    return grads[0];
  };
  std::size_t exact_bytes = 0, fp16_bytes = 0, bf16_bytes = 0;
  auto exact = grads_with(CommHook::none, exact_bytes);
  auto fp16 = grads_with(CommHook::fp16, fp16_bytes);
  auto bf16 = grads_with(CommHook::bf16, bf16_bytes);
  EXPECT_EQ(fp16_bytes * 2, exact_bytes);
  EXPECT_EQ(bf16_bytes * 2, exact_bytes);
  auto relative = [&](const std::vector<torch::Tensor>& approx) {
    double num = 0, den = 0;
    for (std::size_t i = 0; i < exact.size(); ++i) {
      num += (approx[i] - exact[i]).pow(2).sum().item<double>();
      den += exact[i].pow(2).sum().item<double>();
    }
    return std::sqrt(num / den);
  };
  // Each rank's input and the result are rounded once each: at most 2 x 2^-11 (fp16) and
  // 2 x 2^-8 (bf16) relative, in norm.
  double e16 = relative(fp16), eb16 = relative(bf16);
  EXPECT_GT(e16, 0);
  EXPECT_LT(e16, 2 * std::ldexp(1.0, -11));
  EXPECT_GT(eb16, 0);
  EXPECT_LT(eb16, 2 * std::ldexp(1.0, -8));
}

// Overlap, from the recorded times rather than a stopwatch: with one bucket per layer, the
// first bucket (the last layer's gradients) is launched, and starts running on the progress
// thread, while backward still computes the earlier layers. Launch-before-end holds by
// construction; start-before-end needs the progress thread scheduled during the first layer's
// backward (a 64x2048x2048 product), so at least one of three steps must show it.
TEST(Ddp, FirstBucketIsReducedWhileBackwardRuns) {
  const int W = 2;
  std::vector<int> overlapped(W, 0);
  std::vector<bool> queued_early(W, true);
  testing::run_ranks_as_threads(W, shm_options(), [&](comm::Communicator& comm) {
    auto model = seeded(61, [] { return Mlp(2048, 2048, 10); });
    DdpOptions o;
    o.bucket_cap_mb = o.first_bucket_cap_mb = 0.01;  // every weight closes its own bucket
    DistributedDataParallel ddp(model, comm, o);
    auto x = torch::randn({64, 2048});
    auto y = torch::randint(0, 10, {64});
    for (int step = 0; step < 3; ++step) {
      torch::cross_entropy_loss(ddp.forward(x), y).backward();
      auto& s = ddp.stats();
      EXPECT_GE(s.bucket_count, 3);
      if (s.buckets[0].queued >= s.backward_end) queued_early[comm.rank()] = false;
      if (s.buckets[0].started < s.backward_end) ++overlapped[comm.rank()];
      EXPECT_GE(s.exposed_comm_seconds, 0);
      EXPECT_GT(s.backward_seconds, 0);
    }
  });
  for (int r = 0; r < W; ++r) {
    EXPECT_TRUE(queued_early[r]) << "rank " << r << ": the first bucket waited for the end of backward";
    EXPECT_GE(overlapped[r], 1) << "rank " << r << ": no step reduced its first bucket during backward";
  }
}

// After the first step the buckets follow the order gradients arrived, taken from rank 0.
TEST(Ddp, BucketsAreRebuiltFromTheArrivalOrder) {
  // forward uses fc2 on a path that makes its gradient arrive last.
  struct OddImpl : torch::nn::Module {
    OddImpl() {
      a = register_module("a", torch::nn::Linear(4, 4));
      b = register_module("b", torch::nn::Linear(4, 4));
    }
    torch::Tensor forward(torch::Tensor x) { return a(b(x)); }  // b is applied first: its grads arrive last
    torch::nn::Linear a{nullptr}, b{nullptr};
  };
  std::vector<std::vector<std::vector<std::string>>> before(2), after(2);
  testing::run_ranks_as_threads(2, shm_options(), [&](comm::Communicator& comm) {
    auto model = seeded(71, [] { return std::make_shared<OddImpl>(); });
    DdpOptions o;
    o.bucket_cap_mb = o.first_bucket_cap_mb = 1e-5;  // 10 bytes: one parameter per bucket
    DistributedDataParallel ddp(model, comm, o);
    before[comm.rank()] = ddp.reducer().bucket_layout();
    for (int step = 0; step < 2; ++step) ddp.forward(torch::randn({2, 4})).sum().backward();
    after[comm.rank()] = ddp.reducer().bucket_layout();
  });
  auto first_two = [](const std::vector<std::vector<std::string>>& layout) {
    EXPECT_EQ(layout.size(), 4u);
    std::set<std::string> names;
    for (std::size_t b = 0; b < 2 && b < layout.size(); ++b) names.insert(layout[b].begin(), layout[b].end());
    return names;
  };
  EXPECT_EQ(first_two(before[0]), (std::set<std::string>{"b.weight", "b.bias"}));  // reverse registration
  EXPECT_EQ(first_two(after[0]), (std::set<std::string>{"a.weight", "a.bias"}));   // arrival order
  EXPECT_EQ(after[0], after[1]);
}

// Real processes under the launcher: ddp_bench trains a few steps and checks that every rank
// ends with rank 0's parameters bit for bit (exit 3 otherwise).
TEST(DdpProcesses, RanksUnderTheLauncherEndBitwiseEqual) {
  for (std::string backend : {"shm", "gloo"}) {
    testing::Process run({LOCKSTEP_BINARY, "run", "--nproc-per-node", backend == "shm" ? "2" : "3",
                          "--backend", backend, DDP_BENCH, "--model", "mlp", "--steps", "4", "--warmup", "1",
                          "--verify", "--bucket-cap-mb", "2"});
    EXPECT_EQ(run.wait(120), 0) << run.output();
    EXPECT_NE(run.output().find("\"ddp\": true"), std::string::npos) << run.output();
  }
}

// A rank killed inside backward: the job ends (the launcher stops the peer, which would
// otherwise find the death itself within the communicator's peer check) and names the rank.
TEST(DdpProcesses, ARankDyingInBackwardEndsTheJobNamingIt) {
  testing::Process run({LOCKSTEP_BINARY, "run", "--nproc-per-node", "2", "--backend", "shm", DDP_BENCH,
                        "--model", "mlp", "--steps", "50", "--warmup", "1", "--crash-rank", "1",
                        "--crash-step", "3"});
  int code = run.wait(60);
  EXPECT_NE(code, 0) << run.output();
  EXPECT_NE(run.output().find("rank 1"), std::string::npos) << run.output();
  EXPECT_NE(run.output().find("SIGKILL"), std::string::npos) << run.output();
}

TEST(Ddp, BadOptionsAreConfigErrors) {
  testing::run_ranks_as_threads(1, shm_options(), [&](comm::Communicator& comm) {
    DdpOptions o;
    o.bucket_cap_mb = 0;
    EXPECT_THROW(DistributedDataParallel(Mlp(2, 2, 2), comm, o), ConfigError);
  });
  EXPECT_THROW(parse_comm_hook("fp8"), ConfigError);
  EXPECT_EQ(parse_comm_hook("bf16"), CommHook::bf16);
}

}  // namespace
}  // namespace lockstep
