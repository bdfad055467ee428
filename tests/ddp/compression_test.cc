// Gradient codecs between machines (ddp/compression.h) over real communicators, ranks as
// threads: gloo with each rank declared its own machine, and hier on 2 x 2 declared machines,
// whose shares cut matrices in the middle. Each test would fail without what it names: a codec
// that sent everything exactly would not save the bytes asserted; one without error feedback
// would not converge on a repeated gradient; one whose machines disagreed would leave the ranks
// with different bits.
#include "lockstep/ddp/compression.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>

#include "lockstep/ddp/ddp.h"
#include "lockstep/error.h"
#include "testing.h"

namespace lockstep {
namespace {

comm::CommOptions machines_of(const std::string& backend, std::vector<int> machine_of) {
  comm::CommOptions o;
  o.backend = backend;
  o.machine_of = std::move(machine_of);
  o.timeout = comm::Seconds(60);
  return o;
}

// Each rank's input is made by `input(rank, call)`; returns every rank's result of every call
// and the bytes each rank sent across machines.
struct Outcome {
  std::vector<std::vector<torch::Tensor>> results;  // [rank][call]
  std::vector<std::uint64_t> bytes;
};
Outcome reduce_through(const comm::CommOptions& options, int world, int calls, const std::string& codec_name,
                       const std::vector<BucketTensor>& layout, CompressionOptions compression,
                       const std::function<torch::Tensor(int, int)>& input) {
  Outcome out;
  out.results.resize(world);
  out.bytes.resize(world);
  testing::run_ranks_as_threads(world, options, [&](comm::Communicator& comm) {
    const int r = comm.rank();
    auto codec = codec_name.empty() ? nullptr : make_bucket_codec(codec_name, layout, compression);
    const auto before = comm.network_stats().bytes_sent;
    for (int k = 0; k < calls; ++k) {
      auto x = input(r, k).contiguous().clone();
      if (codec) {
        comm.allreduce(x.data_ptr<float>(), std::size_t(x.numel()), comm::ReduceOp::sum, as_comm_codec(codec))
            ->wait();
      } else {
        comm.allreduce(x.data_ptr(), std::size_t(x.numel()), comm::DType::f32, comm::ReduceOp::sum)->wait();
      }
      out.results[r].push_back(x);
    }
    out.bytes[r] = comm.network_stats().bytes_sent - before;
  });
  return out;
}

torch::Tensor exact_sum(int world, int call, const std::function<torch::Tensor(int, int)>& input) {
  auto s = input(0, call).clone();
  for (int r = 1; r < world; ++r) s += input(r, call);
  return s;
}

double relative_error(const torch::Tensor& approx, const torch::Tensor& exact) {
  return (approx - exact).norm().item<double>() / exact.norm().item<double>();
}

void expect_every_rank_equal(const Outcome& o) {
  for (std::size_t r = 1; r < o.results.size(); ++r)
    for (std::size_t k = 0; k < o.results[r].size(); ++k)
      ASSERT_TRUE(torch::equal(o.results[r][k], o.results[0][k])) << "rank " << r << ", call " << k;
}

torch::Tensor seeded_randn(std::int64_t n, int seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(std::uint64_t(seed));
  return torch::randn({n}, gen, torch::kFloat);
}

// 5000 elements, 3 machines: every element is within half a quantisation step of each machine's
// chunk, every machine gets the same bits, and a quarter of float32's bytes crossed.
TEST(Codecs, Int8SumsWithinItsStepOnEveryMachineAlikeForAQuarterOfTheBytes) {
  const int W = 3;
  auto input = [](int r, int) { return seeded_randn(5000, 10 + r); };
  auto int8 = reduce_through(machines_of("gloo", {0, 1, 2}), W, 1, "int8", {}, {}, input);
  auto exact = reduce_through(machines_of("gloo", {0, 1, 2}), W, 1, "", {}, {}, input);
  expect_every_rank_equal(int8);
  auto want = exact_sum(W, 0, input);
  torch::Tensor bound = torch::zeros({5000});
  for (int r = 0; r < W; ++r) {
    auto x = input(r, 0);
    for (std::int64_t lo = 0; lo < 5000; lo += 1024) {
      const auto n = std::min<std::int64_t>(1024, 5000 - lo);
      bound.narrow(0, lo, n) += x.narrow(0, lo, n).abs().max() / 127.0f / 2.0f;
    }
  }
  auto err = (int8.results[0][0] - want).abs();
  EXPECT_TRUE((err <= bound * 1.0001f + 1e-6f).all().item<bool>()) << (err - bound).max().item<float>();
  EXPECT_GT(err.max().item<float>(), 0) << "nothing was lost: was it compressed?";
  EXPECT_LT(double(int8.bytes[0]), 0.7 * double(exact.bytes[0]))
      << "int8 " << int8.bytes[0] << " bytes against exact " << exact.bytes[0];
}

// A sum of rank <= r is exactly what PowerSGD rank r recovers at its first compressed step,
// here on hier, whose two shares per machine cut the matrix between rows 31 and 32.
TEST(Codecs, PowerSgdRecoversASumOfLowRankExactlyAndSendsFarFewerBytes) {
  const int W = 4;
  const std::vector<BucketTensor> layout{{0, {64, 48}}, {64 * 48, {64}}};
  CompressionOptions c;
  c.powersgd_rank = 4;
  c.start_step = 0;
  auto input = [](int r, int) {
    auto u = seeded_randn(64, 100 + r), v = seeded_randn(48, 200 + r), b = seeded_randn(64, 300 + r);
    return torch::cat({torch::outer(u, v).reshape(-1), b});
  };
  auto psgd = reduce_through(machines_of("hier", {0, 0, 1, 1}), W, 1, "powersgd", layout, c, input);
  auto exact = reduce_through(machines_of("hier", {0, 0, 1, 1}), W, 1, "", layout, c, input);
  expect_every_rank_equal(psgd);
  EXPECT_LT(relative_error(psgd.results[0][0], exact_sum(W, 0, input)), 1e-4);
  EXPECT_LT(double(psgd.bytes[0]), 0.4 * double(exact.bytes[0]))
      << "powersgd " << psgd.bytes[0] << " bytes against exact " << exact.bytes[0];
}

// The same full-rank gradient at every step: one step's estimate misses much of it, but what it
// missed is fed back, so the mean of the outputs over many steps approaches the exact sum.
TEST(Codecs, ErrorFeedbackMakesTheMeanOfTheOutputsConverge) {
  const int W = 2, steps = 160;
  const std::vector<BucketTensor> layout{{0, {40, 30}}};
  CompressionOptions c;
  c.powersgd_rank = 2;
  c.start_step = 0;
  auto input = [](int r, int) { return seeded_randn(1200, 7 + r); };
  for (const std::string name : {"powersgd", "int8"}) {
    auto o = reduce_through(machines_of("gloo", {0, 1}), W, steps, name, layout, c, input);
    expect_every_rank_equal(o);
    auto want = exact_sum(W, 0, input);
    const double one = relative_error(o.results[0][0], want);
    auto mean = torch::stack(o.results[0]).mean(0);
    const double averaged = relative_error(mean, want);
    EXPECT_GT(one, 0) << name;
    EXPECT_LT(averaged, 0.1 * one) << name << ": one step " << one << ", mean of " << steps << " "
                                   << averaged;
  }
}

// A sum whose singular values fall slowly (1, 0.9, 0.6, 0.5, ...): at its first compressed step,
// from a random Q, PowerSGD rank 2 comes closer to the best rank-2 estimate (the truncated SVD)
// with three power iterations (6 rounds) than with the paper's one, for more bytes.
TEST(Codecs, MorePowerIterationsComeCloserToTheBestRankREstimate) {
  const int W = 2;
  const std::vector<BucketTensor> layout{{0, {64, 48}}};
  auto input = [](int r, int) {
    auto m = torch::zeros({64, 48});
    const float sigma[] = {1.0f, 0.9f, 0.6f, 0.5f, 0.4f, 0.3f};
    for (int j = 0; j < 6; ++j) {
      auto u = seeded_randn(64, 400 + 10 * j), v = seeded_randn(48, 500 + 10 * j);
      m += sigma[j] * (r + 1.0f) * torch::outer(u / u.norm(), v / v.norm());
    }
    return m.reshape(-1);
  };
  auto want = exact_sum(W, 0, input);
  const auto s = torch::linalg_svdvals(want.view({64, 48}));
  const double best = s.narrow(0, 2, s.size(0) - 2).norm().item<double>() / s.norm().item<double>();
  double error[2];
  std::uint64_t bytes[2];
  for (int k = 0; k < 2; ++k) {
    CompressionOptions c;
    c.powersgd_rank = 2;
    c.powersgd_rounds = k == 0 ? 2 : 6;
    c.start_step = 0;
    auto o = reduce_through(machines_of("gloo", {0, 1}), W, 1, "powersgd", layout, c, input);
    expect_every_rank_equal(o);
    error[k] = relative_error(o.results[0][0], want);
    bytes[k] = o.bytes[0];
  }
  EXPECT_LT(error[1], error[0]) << "one iteration " << error[0] << ", three " << error[1] << ", best " << best;
  EXPECT_LT(error[1] - best, 0.5 * (error[0] - best))
      << "one iteration " << error[0] << ", three " << error[1] << ", best " << best;
  EXPECT_GT(bytes[1], bytes[0]);
  try {
    CompressionOptions c;
    c.powersgd_rounds = 3;
    make_bucket_codec("powersgd", layout, c);
    ADD_FAILURE() << "accepted 3 rounds";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("an even number"), std::string::npos) << e.what();
  }
}

// On one machine the codec is not called: the sum is the exact one, bit for bit.
TEST(Codecs, InsideOneMachineTheSumStaysExact) {
  const std::vector<BucketTensor> layout{{0, {40, 30}}};
  CompressionOptions c;
  c.start_step = 0;
  auto input = [](int r, int) { return seeded_randn(1200, 50 + r); };
  comm::CommOptions shm;
  shm.backend = "shm";
  for (const std::string name : {"powersgd", "int8", "auto"}) {
    auto coded = reduce_through(shm, 2, 2, name, layout, c, input);
    auto exact = reduce_through(shm, 2, 2, "", layout, c, input);
    for (int k = 0; k < 2; ++k) EXPECT_TRUE(torch::equal(coded.results[0][k], exact.results[0][k])) << name;
  }
}

// auto measures, then every machine takes the same decision from the same averaged figures.
TEST(Codecs, AutoDecidesOnceAndAlikeOnEveryMachine) {
  const int W = 2;
  const std::vector<BucketTensor> layout{{0, {256, 256}}};
  CompressionOptions c;
  c.start_step = 3;
  std::vector<std::string> choices(W), reasons(W);
  testing::run_ranks_as_threads(W, machines_of("gloo", {0, 1}), [&](comm::Communicator& comm) {
    auto codec = make_bucket_codec("auto", layout, c);
    for (int k = 0; k < 6; ++k) {
      auto x = seeded_randn(256 * 256, comm.rank() * 10 + k);
      comm.allreduce(x.data_ptr<float>(), std::size_t(x.numel()), comm::ReduceOp::avg, as_comm_codec(codec))
          ->wait();
    }
    choices[comm.rank()] = codec->report().choice;
    reasons[comm.rank()] = codec->report().reason;
  });
  EXPECT_TRUE(choices[0] == "exact" || choices[0] == "int8" || choices[0] == "powersgd") << choices[0];
  EXPECT_EQ(choices[0], choices[1]);
  EXPECT_NE(reasons[0].find("link"), std::string::npos) << reasons[0];
  EXPECT_NE(reasons[0].find("powersgd r4"), std::string::npos) << reasons[0];
}

// The rule itself: a slow link makes the small PowerSGD payload win, a fast one keeps it exact,
// and int8 wins where PowerSGD finds nothing to compress.
TEST(Codecs, AutoCompressesOnlyWhereTheLinkMakesItPay) {
  const double bytes = 4e6;
  std::vector<CodecEstimate> slow{{"int8", 0.002, 1e6, 1}, {"powersgd", 0.003, 4e4, 2}};
  EXPECT_EQ(choose_codec(0.032, bytes, 0.0002, slow), "powersgd");  // 125 MB/s
  EXPECT_NEAR(slow[1].seconds, 0.003 + 2 * 0.0002 + 4e4 * (0.0318 / bytes), 1e-9);
  std::vector<CodecEstimate> fast{{"int8", 0.002, 1e6, 1}, {"powersgd", 0.003, 4e4, 2}};
  EXPECT_EQ(choose_codec(0.0035, bytes, 0.0002, fast), "exact");  // 1.2 GB/s: compute costs more
  std::vector<CodecEstimate> vectors{{"int8", 0.002, 1e6, 1}, {"powersgd", 0.0001, bytes, 2}};
  EXPECT_EQ(choose_codec(0.032, bytes, 0.0002, vectors), "int8");
  std::vector<CodecEstimate> marginal{{"int8", 0.026, 1e6, 1}};
  EXPECT_EQ(choose_codec(0.032, bytes, 0.0002, marginal), "exact");  // saves less than a fifth
}

// Through DDP: a model trained with each codec keeps every rank's parameters identical, ends
// near the exact run's loss, and moves fewer bytes between the machines.
TEST(Codecs, DdpTrainsWithEachCodecLikeExactWithFewerBytes) {
  const int W = 2, steps = 30;
  torch::manual_seed(3);
  auto inputs = torch::randn({W * 32, 20});
  auto labels = (inputs.narrow(1, 0, 5).argmax(1));
  auto train = [&](CommHook hook, double& loss, std::uint64_t& bytes) {
    std::vector<std::vector<torch::Tensor>> params(W);
    std::vector<double> losses(W);
    std::vector<std::uint64_t> sent(W);
    std::mutex seeding;  // torch's default generator is shared by the thread ranks
    testing::run_ranks_as_threads(W, machines_of("gloo", {0, 1}), [&](comm::Communicator& comm) {
      std::unique_lock<std::mutex> lock(seeding);
      torch::manual_seed(5);  // the same start in every run: without the lock the ranks' draws interleave
      auto model =
          torch::nn::Sequential(torch::nn::Linear(20, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                                torch::nn::ReLU(), torch::nn::Linear(64, 5));
      lock.unlock();
      DdpOptions o;
      o.comm_hook = hook;
      o.compression.start_step = 3;
      o.compression.powersgd_rank = 2;
      Reducer reducer(model.ptr(), comm, o);
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      const auto before = comm.network_stats().bytes_sent;
      auto rows = torch::arange(comm.rank() * 32, (comm.rank() + 1) * 32);
      for (int s = 0; s < steps; ++s) {
        reducer.before_forward();
        auto out = model->forward(inputs.index({rows}));
        reducer.after_forward(&out);
        auto l = torch::cross_entropy_loss(out, labels.index({rows}));
        opt.zero_grad();
        l.backward();
        opt.step();
        losses[comm.rank()] = l.item<double>();
      }
      sent[comm.rank()] = comm.network_stats().bytes_sent - before;
      for (auto& p : model->parameters()) params[comm.rank()].push_back(p.detach().clone());
    });
    for (std::size_t i = 0; i < params[0].size(); ++i) EXPECT_TRUE(torch::equal(params[0][i], params[1][i]));
    loss = (losses[0] + losses[1]) / 2;
    bytes = sent[0];
  };
  double exact_loss = 0;
  std::uint64_t exact_bytes = 0;
  train(CommHook::none, exact_loss, exact_bytes);
  for (CommHook hook : {CommHook::powersgd, CommHook::int8}) {
    double loss = 0;
    std::uint64_t bytes = 0;
    train(hook, loss, bytes);
    EXPECT_LT(loss, exact_loss * 1.5 + 0.05) << comm_hook_name(hook) << " vs exact " << exact_loss;
    EXPECT_LT(double(bytes), 0.6 * double(exact_bytes)) << comm_hook_name(hook);
  }
}

// An embedding table's gradient (a row per token seen) is far from low rank: PowerSGD sends it
// exact, bit for bit the exact DDP's, while the linear layer beside it is compressed.
TEST(Codecs, PowerSgdSendsAnEmbeddingTableExactAndCompressesTheLayerBesideIt) {
  const int W = 2;
  auto gradients = [&](CommHook hook) {
    std::vector<std::vector<torch::Tensor>> grads(W);
    testing::run_ranks_as_threads(W, machines_of("gloo", {0, 1}), [&](comm::Communicator& comm) {
      auto table = torch::nn::Embedding(64, 48);
      auto layer = torch::nn::Linear(48, 48);
      auto model = torch::nn::Sequential(table, layer);
      {  // the same start in both runs (the ranks are threads: the global generator is shared)
        torch::NoGradGuard no_grad;
        auto init = at::make_generator<at::CPUGeneratorImpl>(std::uint64_t(11));
        for (auto& p : model->parameters()) p.copy_(torch::randn(p.sizes(), init, torch::kFloat));
      }
      DdpOptions o;
      o.comm_hook = hook;
      o.compression.start_step = 0;
      o.compression.powersgd_rank = 1;
      Reducer reducer(model.ptr(), comm, o);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(std::uint64_t(100 + comm.rank()));
      auto tokens = torch::randint(64, {128}, gen, torch::kLong);
      auto target = torch::randn({128, 48}, gen, torch::kFloat);
      reducer.before_forward();
      auto out = model->forward(tokens);
      reducer.after_forward(&out);
      (out - target).pow(2).sum().backward();
      grads[comm.rank()] = {table->weight.grad().clone(), layer->weight.grad().clone()};
    });
    return grads[0];
  };
  auto exact = gradients(CommHook::none), compressed = gradients(CommHook::powersgd);
  EXPECT_TRUE(torch::equal(compressed[0], exact[0])) << "the table's gradient was not sent exact";
  EXPECT_GT(relative_error(compressed[1], exact[1]), 1e-3) << "the linear layer was not compressed";
}

TEST(Codecs, ZeroStageTwoRefusesACodecThatNeedsTheWholeBucket) {
  testing::run_ranks_as_threads(2, machines_of("gloo", {0, 1}), [&](comm::Communicator& comm) {
    auto model = torch::nn::Linear(8, 8);
    DdpOptions o;
    o.comm_hook = CommHook::powersgd;
    BucketSharding sharding;
    sharding.slices = 2;
    sharding.reduce_scatter = true;
    try {
      Reducer reducer(model.ptr(), comm, o, sharding);
      ADD_FAILURE() << "no error";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("ZeRO stage 2"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
}  // namespace lockstep
