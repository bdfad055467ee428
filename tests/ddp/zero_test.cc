// ZeRO stages 1 and 2 and the one-copy mode against DDP, with ranks as threads over real shm
// communicators: the same training (an MLP, a CNN with BatchNorm, the GPT), every rank ending
// bitwise equal to the others; optimizer state and gradients held at 1/W; a consolidated state
// that is DDP's and that loads at another world size.
#include "lockstep/ddp/zero.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>

#include "lockstep/ddp/ddp.h"
#include "lockstep/ddp/torch_compat.h"
#include "lockstep/error.h"
#include "lockstep/models/gpt.h"
#include "testing.h"

namespace lockstep {
namespace {

// A model as the tests drive it: its module, how to call it, and one rank's batch for a step.
struct Net {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::function<std::pair<torch::Tensor, torch::Tensor>(int rank, int step)> batch;
  // Stage 3: the model's units and how its forward runs them.
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  std::function<void(UnitRunner)> set_runner;
};

// 20-33-5 with the first layer a unit of its own (stage 3); the second stays in the root.
struct MlpUnitsImpl : torch::nn::Module {
  MlpUnitsImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(20, 33));
    fc2 = register_module("fc2", torch::nn::Linear(33, 5));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc2(run_unit(runner, 0, [this](const torch::Tensor& in) { return torch::relu(fc1(in)); }, x));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  UnitRunner runner;
};
TORCH_MODULE(MlpUnits);

struct CnnBnImpl : torch::nn::Module {
  CnnBnImpl() {
    // No bias before BatchNorm, as usual: BatchNorm cancels it, so its gradient is rounding noise
    // that AdamW would scale up to full-size steps, and ulps apart would become 1e-2 apart.
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1).bias(false)));
    norm = register_module("norm", torch::nn::BatchNorm2d(4));
    fc = register_module("fc", torch::nn::Linear(4 * 4 * 4, 5));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = run_unit(runner, 0, [this](const torch::Tensor& in) { return conv(in); }, x);
    return fc(torch::max_pool2d(torch::relu(norm(h)), 2).flatten(1));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d norm{nullptr};
  torch::nn::Linear fc{nullptr};
  UnitRunner runner;
};
TORCH_MODULE(CnnBn);

std::mutex init_mu;  // construction draws from torch's global generator, shared by the thread ranks

torch::Tensor seeded_randn(std::vector<std::int64_t> shape, std::uint64_t seed) {
  auto g = at::detail::createCPUGenerator(seed);
  return torch::randn(shape, g);
}

torch::Tensor seeded_labels(std::int64_t n, std::int64_t classes, std::uint64_t seed) {
  auto g = at::detail::createCPUGenerator(seed);
  return torch::randint(classes, {n}, g);
}

Net make_net(const std::string& name) {
  std::lock_guard<std::mutex> lock(init_mu);
  torch::manual_seed(3);
  if (name == "mlp") {
    MlpUnits m;
    return {m.ptr(), [m](const torch::Tensor& x) mutable { return m->forward(x); },
            [](int r, int s) { return std::make_pair(seeded_randn({8, 20}, 100 * s + r), seeded_labels(8, 5, 7 + 100 * s + r)); },
            {m->fc1.ptr()}, [m](UnitRunner u) mutable { m->runner = std::move(u); }};
  }
  if (name == "cnn") {
    CnnBn m;
    return {m.ptr(), [m](const torch::Tensor& x) mutable { return m->forward(x); },
            [](int r, int s) { return std::make_pair(seeded_randn({8, 1, 8, 8}, 100 * s + r), seeded_labels(8, 5, 7 + 100 * s + r)); },
            {m->conv.ptr()}, [m](UnitRunner u) mutable { m->runner = std::move(u); }};
  }
  models::GptConfig c;
  c.vocab_size = 64, c.block_size = 16, c.n_layer = name == "gpt_deep" ? 4 : 2, c.n_head = 2, c.n_embd = 32, c.dropout = 0;
  models::GptLmHeadModel m(c);
  m->set_gradient_checkpointing(name == "gpt_checkpointed");
  return {m.ptr(), [m](const torch::Tensor& x) mutable { return m->forward(x); },
          [](int r, int s) {
            auto g = at::detail::createCPUGenerator(500 + 100 * s + r);
            auto t = torch::randint(64, {4, 17}, g);
            using torch::indexing::Slice;
            return std::make_pair(t.index({Slice(), Slice(0, 16)}), t.index({Slice(), Slice(1, 17)}));
          },
          m->parameter_units(), [m](UnitRunner u) mutable { m->set_unit_runner(std::move(u)); }};
}

torch::Tensor loss_of(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}), target.reshape({-1}));
}

std::unique_ptr<torch::optim::Optimizer> adamw(std::vector<torch::Tensor> params) {
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
}

struct Case {
  std::string model;
  int world;
  int stage;  // 0: DDP
  bool shared = false;
  std::vector<int> machines{};  // hier with these machines (rank -> machine); empty: shm
};

std::string name_of(const Case& c) {
  std::string layout;
  for (int m : c.machines) layout += std::to_string(m);
  return c.model + "_world" + std::to_string(c.world) + "_stage" + std::to_string(c.stage) + (c.shared ? "_shared" : "") +
         (layout.empty() ? "" : "_hier" + layout);
}

comm::CommOptions backend_of(const Case& c) {
  comm::CommOptions options{c.machines.empty() ? "shm" : "hier"};
  options.machine_of = c.machines;
  return options;
}

constexpr int kSteps = 5;
constexpr double kMaxNorm = 0.5;  // small enough that every step clips

// Trains kSteps on every rank and returns each rank's final parameters. (Buffers are each rank's
// own: BatchNorm's running statistics follow the rank's last batch, under DDP as under ZeRO.)
std::vector<std::vector<torch::Tensor>> train(const Case& c, const std::function<void(ZeroOptimizer&, comm::Communicator&)>& after = {}) {
  std::vector<std::vector<torch::Tensor>> finals(static_cast<std::size_t>(c.world));
  lockstep::testing::run_ranks_as_threads(c.world, backend_of(c), [&](comm::Communicator& comm) {
    Net net = make_net(c.model);
    DdpOptions ddp;
    ddp.bucket_cap_mb = 0.002;  // several buckets, so slices cut through tensors
    ddp.first_bucket_cap_mb = 0.001;
    const ZeroOptions zo{c.stage, c.shared};
    std::optional<BucketSharding> sharding;
    if (c.stage == 3) sharding = zero_bucket_sharding(zo, comm.size(), *net.module, net.units);
    if (c.stage == 1 || c.stage == 2) sharding = zero_bucket_sharding(zo, comm.size());
    Reducer reducer(net.module, comm, ddp, sharding);
    std::unique_ptr<ZeroOptimizer> zero;
    std::unique_ptr<torch::optim::Optimizer> plain;
    if (c.stage > 0)
      zero = std::make_unique<ZeroOptimizer>(*net.module, reducer, comm, zo, adamw);
    else
      plain = adamw(net.module->parameters());
    if (c.stage == 3) net.set_runner(zero->unit_runner());
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = net.batch(comm.rank(), step);
      reducer.before_forward();
      if (zero) zero->before_forward();
      auto out = net.forward(x);
      reducer.after_forward(&out);
      loss_of(out, y).backward();
      if (zero) {
        zero->clip_grad_norm(kMaxNorm);
        zero->step();
        zero->zero_grad();
      } else {
        torch::nn::utils::clip_grad_norm_(net.module->parameters(), kMaxNorm);
        plain->step();
        plain->zero_grad();
      }
    }
    if (after && zero) after(*zero, comm);
    if (c.stage == 3) zero->gather_all();  // the parameters exist whole only when gathered
    auto& mine = finals[static_cast<std::size_t>(comm.rank())];
    for (auto& p : net.module->parameters()) mine.push_back(p.detach().clone());
    if (c.stage == 3) zero->release_all(false);
  });
  return finals;
}

double max_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, (a[i].to(torch::kDouble) - b[i].to(torch::kDouble)).abs().max().item<double>());
  return worst;
}

bool bitwise_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

class ZeroTrains : public ::testing::TestWithParam<Case> {};

// The same training as DDP. Not bitwise: the clipping norm is summed over slices in float64 where
// DDP sums per-tensor float32 norms, and AdamW runs its vectorised and scalar paths over other
// element ranges when a tensor is cut; both move results by float32 ulps (about 1e-7
// relative). AdamW's step m / (sqrt(v) + eps) does not scale with the gradient, so where an
// element's gradient is near zero those ulps move its step by more: after five clipped steps at
// lr 1e-2 the GPT's parameters differ by less than 1e-5 with OpenBLAS's Zen kernels and by 1.1e-5
// with its SkylakeX ones (OPENBLAS_CORETYPE, same machine). 1e-4 bounds both and stays 10x below how
// far training moved them (checked below). Every rank ends bitwise equal to the others: the
// parameters they hold are the same bytes, gathered or shared.
TEST_P(ZeroTrains, LikeDdpWithEveryRankBitwiseEqual) {
  const Case c = GetParam();
  const auto ddp = train({c.model, c.world, 0});
  const auto zero = train(c);
  for (int r = 0; r < c.world; ++r) {
    const auto& mine = zero[static_cast<std::size_t>(r)];
    EXPECT_LT(max_difference(mine, ddp[static_cast<std::size_t>(r)]), 1e-4) << "rank " << r;
    EXPECT_TRUE(bitwise_equal(mine, zero[0])) << "rank " << r << " differs from rank 0";
  }
  // ...and not by accident: training moved the parameters far beyond that tolerance.
  std::vector<torch::Tensor> initial;
  for (auto& p : make_net(c.model).module->parameters()) initial.push_back(p.detach().clone());
  ASSERT_EQ(initial.size(), ddp[0].size());
  EXPECT_GT(max_difference(std::vector<torch::Tensor>(ddp[0].begin(), ddp[0].begin() + long(initial.size())), initial), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(
    Models, ZeroTrains,
    ::testing::Values(Case{"mlp", 1, 1}, Case{"mlp", 2, 1}, Case{"mlp", 3, 1}, Case{"mlp", 2, 2}, Case{"mlp", 3, 2},
                      Case{"cnn", 2, 1}, Case{"cnn", 3, 2}, Case{"cnn", 2, 2}, Case{"cnn", 3, 1}, Case{"gpt", 2, 1}, Case{"gpt", 3, 2},
                      Case{"gpt", 2, 2, true}, Case{"mlp", 3, 1, true}, Case{"mlp", 2, 3}, Case{"mlp", 3, 3},
                      Case{"cnn", 2, 3}, Case{"gpt", 2, 3}, Case{"gpt", 3, 3}, Case{"gpt_checkpointed", 2, 3},
                      Case{"gpt", 3, 3, true}, Case{"gpt_checkpointed", 4, 3, true, {0, 0, 1, 1}}),
    [](const ::testing::TestParamInfo<Case>& param) { return name_of(param.param); });

// Stage 3 with one copy per machine holds the same slices and gathers the same values into the
// machine's block: every rank ends bitwise equal to plain stage 3 on the same ranks. On one
// machine (shm), on 2 x 2 and on 3 machines of 2 with the ranks interleaved (hier, machines
// declared), where each rank writes its index group's chunks into its machine's block.
TEST(ZeroStageThreeOneCopyPerMachine, EndsBitwiseEqualToPlainStageThree) {
  for (const Case& hybrid : {Case{"gpt_deep", 3, 3, true}, Case{"gpt", 4, 3, true, {0, 0, 1, 1}},
                             Case{"cnn", 6, 3, true, {0, 1, 2, 0, 1, 2}}}) {
    Case plain = hybrid;
    plain.shared = false;
    const auto expected = train(plain);
    const auto got = train(hybrid);
    for (int r = 0; r < hybrid.world; ++r)
      EXPECT_TRUE(bitwise_equal(got[std::size_t(r)], expected[std::size_t(r)])) << name_of(hybrid) << " rank " << r ;
  }
}

// Stage 3 leaves the broadcast of rank 0's parameters to the optimizer, which sends each unit as
// it cuts it: ranks that built different parameters all end with rank 0's.
TEST(ZeroStageThree, EveryRankStartsFromRankZerosParameters) {
  std::vector<std::vector<torch::Tensor>> seen(3), rank0_built(1);
  lockstep::testing::run_ranks_as_threads(3, comm::CommOptions{"shm"}, [&](comm::Communicator& comm) {
    Net net = make_net("gpt");
    {
      torch::NoGradGuard no_grad;
      for (auto& p : net.module->parameters()) p.add_(float(comm.rank()));
    }
    if (comm.rank() == 0)
      for (auto& p : net.module->parameters()) rank0_built[0].push_back(p.detach().clone());
    const ZeroOptions zo{3, false};
    Reducer reducer(net.module, comm, DdpOptions{}, zero_bucket_sharding(zo, comm.size(), *net.module, net.units));
    ZeroOptimizer zero(*net.module, reducer, comm, zo, adamw);
    zero.gather_all();
    for (auto& p : net.module->parameters()) seen[std::size_t(comm.rank())].push_back(p.detach().clone());
    zero.release_all(false);
  });
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(bitwise_equal(seen[std::size_t(r)], rank0_built[0])) << "rank " << r;
}

// Where there is no machine memory (gloo: it does not know who shares a machine) one copy per
// machine is refused on every rank, naming the backend and what to use.
TEST(ZeroStageThreeOneCopyPerMachine, IsAClearErrorWithoutMachineMemory) {
  std::mutex mu;
  std::vector<std::string> errors;
  lockstep::testing::run_ranks_as_threads(2, comm::CommOptions{"gloo"}, [&](comm::Communicator& comm) {
    Net net = make_net("mlp");
    const ZeroOptions zo{3, true};
    Reducer reducer(net.module, comm, DdpOptions{}, zero_bucket_sharding(zo, comm.size(), *net.module, net.units));
    try {
      ZeroOptimizer zero(*net.module, reducer, comm, zo, adamw);
    } catch (const ConfigError& e) {
      std::lock_guard<std::mutex> lock(mu);
      errors.push_back(e.what());
    }
  });
  ASSERT_EQ(errors.size(), 2u);
  for (const auto& e : errors) EXPECT_NE(e.find("gloo backend does not have"), std::string::npos) << e;
}

// Stages 1 and 2 keep one copy for the whole job, so every rank must map the same block: gloo
// (no machine memory) and hier across two machines (a block per machine) are refused on every
// rank, saying what to use instead.
TEST(ZeroSharedParameters, AreAClearErrorUnlessEveryRankMapsOneBlock) {
  for (const auto& [backend, machine_of] :
       std::vector<std::pair<std::string, std::vector<int>>>{{"gloo", {}}, {"hier", {0, 1}}}) {
    for (int stage : {1, 2}) {
      std::mutex mu;
      std::vector<std::string> errors;
      comm::CommOptions options{backend};
      options.machine_of = machine_of;
      lockstep::testing::run_ranks_as_threads(2, options, [&](comm::Communicator& comm) {
        Net net = make_net("mlp");
        const ZeroOptions zo{stage, true};
        Reducer reducer(net.module, comm, DdpOptions{}, zero_bucket_sharding(zo, comm.size()));
        try {
          ZeroOptimizer zero(*net.module, reducer, comm, zo, adamw);
        } catch (const ConfigError& e) {
          std::lock_guard<std::mutex> lock(mu);
          errors.push_back(e.what());
        }
      });
      ASSERT_EQ(errors.size(), 2u) << backend << ", stage " << stage;
      for (const auto& e : errors) {
        EXPECT_NE(e.find("on one machine and the shm backend (this is " + backend), std::string::npos) << e;
        EXPECT_NE(e.find("--zero-shared-parameters on --backend hier"), std::string::npos) << e;
      }
    }
  }
}

// The one-copy mode needs no all-gather: each rank writes its slices into the one copy. Were the
// memory not shared, a rank would never see the others' updates and would end unlike stage 1.
TEST(ZeroSharedParameters, EndBitwiseEqualToStageOneAndHoldOneCopy) {
  const auto gathered = train({"mlp", 2, 1});
  std::vector<ZeroMemory> held(2);
  const auto shared = train({"mlp", 2, 1, true}, [&](ZeroOptimizer& z, comm::Communicator& comm) {
    held[static_cast<std::size_t>(comm.rank())] = z.memory();
  });
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(bitwise_equal(shared[static_cast<std::size_t>(r)], gathered[0])) << r;
  std::int64_t all = 0;
  for (auto& p : make_net("mlp").module->parameters()) all += p.numel() * 4;
  EXPECT_LE(held[0].parameters + held[1].parameters, all + held[0].padding * 4);
  EXPECT_LT(held[0].parameters, all * 6 / 10);
}

// Optimizer state per rank is 1/W of DDP's (to within the padding, reported); under stage 2 the
// gradients too, and the parameters' own grads are released after every backward.
TEST(ZeroMemory, StateAndGradientsAreOneWthOfDdps) {
  for (int stage : {1, 2}) {
    std::vector<ZeroMemory> held(3);
    std::vector<int> grads_kept(3, -1);
    train({"gpt", 3, stage}, [&](ZeroOptimizer& z, comm::Communicator& comm) {
      held[static_cast<std::size_t>(comm.rank())] = z.memory();
    });
    Net net = make_net("gpt");
    std::int64_t bytes = 0;
    for (auto& p : net.module->parameters()) bytes += p.numel() * 4;
    for (int r = 0; r < 3; ++r) {
      const auto& m = held[static_cast<std::size_t>(r)];
      const double ddp_state = 2.0 * bytes;  // AdamW: exp_avg and exp_avg_sq
      EXPECT_NEAR(m.optimizer_state, ddp_state / 3, 2.0 * 4 * m.padding / 3 + 1) << "stage " << stage << " rank " << r;
      if (stage == 2)
        EXPECT_NEAR(m.gradients, bytes / 3.0, 4.0 * m.padding / 3 + 1) << "rank " << r;
      else
        EXPECT_GE(m.gradients, bytes);
      EXPECT_LT(m.padding, 3 * 8) << "at most W - 1 padding elements per bucket";
    }
  }
}

// Stage 3: a rank holds 1/W of the parameters at rest, and never more than the root and three of
// the four blocks at once (one computing, the next prefetched, the last not yet handed to the
// reduce-scatter): the whole model never exists on any rank. At rest the parameters have no memory.
TEST(ZeroMemory, StageThreeHoldsOneWthOfTheParametersAndNeverTheWholeModel) {
  models::GptConfig c;
  c.vocab_size = 64, c.block_size = 16, c.n_layer = 4, c.n_head = 2, c.n_embd = 32, c.dropout = 0;
  models::GptLmHeadModel probe(c);
  std::int64_t all = 0, block = 0, root = 0;
  for (auto& p : probe->parameters()) all += p.numel() * 4;
  for (auto& p : probe->transformer->h[0]->parameters()) block += p.numel() * 4;
  root = all - 4 * block;
  train({"gpt_deep", 3, 3}, [&](ZeroOptimizer& z, comm::Communicator& comm) {
    const ZeroMemory m = z.memory();
    EXPECT_NEAR(double(m.parameters), double(all) / 3, 4.0 * double(m.padding) / 3 + 4) << "rank " << comm.rank();
    EXPECT_GE(m.gathered_high_water, root + block) << "rank " << comm.rank();
    EXPECT_LE(m.gathered_high_water, root + 3 * block + 4 * 16 * 3) << "rank " << comm.rank();
    EXPECT_LT(m.gathered_high_water, all);
  });
}

TEST(ZeroMemory, StageTwoReleasesTheParametersGradients) {
  lockstep::testing::run_ranks_as_threads(2, comm::CommOptions{"shm"}, [&](comm::Communicator& comm) {
    Net net = make_net("mlp");
    const ZeroOptions zo{2, false};
    Reducer reducer(net.module, comm, DdpOptions{}, zero_bucket_sharding(zo, comm.size()));
    ZeroOptimizer zero(*net.module, reducer, comm, zo, adamw);
    auto [x, y] = net.batch(comm.rank(), 0);
    reducer.before_forward();
    auto out = net.forward(x);
    reducer.after_forward(&out);
    loss_of(out, y).backward();
    for (auto& p : net.module->parameters()) EXPECT_FALSE(p.grad().defined()) << "a full gradient was kept";
    zero.step();
  });
}

// The consolidated state is the state DDP's optimizer holds after the same steps, and it loads
// at another world size: consolidating again there gives it back bit for bit.
TEST(ZeroCheckpoint, TheConsolidatedStateIsDdpsAndLoadsAtAnotherWorldSize) {
  lockstep::testing::TempDir dir("zero-state");
  const std::string file = dir / "optimizer.pt";
  // DDP's optimizer state after kSteps, rank 0.
  std::vector<torch::Tensor> ddp_state;
  {
    lockstep::testing::run_ranks_as_threads(2, comm::CommOptions{"shm"}, [&](comm::Communicator& comm) {
      Net net = make_net("mlp");
      Reducer reducer(net.module, comm, DdpOptions{});
      auto opt = adamw(net.module->parameters());
      for (int step = 0; step < kSteps; ++step) {
        auto [x, y] = net.batch(comm.rank(), step);
        reducer.before_forward();
        auto out = net.forward(x);
        reducer.after_forward(&out);
        loss_of(out, y).backward();
        torch::nn::utils::clip_grad_norm_(net.module->parameters(), kMaxNorm);
        opt->step();
        opt->zero_grad();
      }
      if (comm.rank() != 0) return;
      for (auto& p : net.module->parameters()) {
        auto& s = static_cast<torch::optim::AdamWParamState&>(*opt->state().at(lockstep::torch_compat::state_key(p)));
        ddp_state.push_back(s.exp_avg().clone());
        ddp_state.push_back(s.exp_avg_sq().clone());
      }
    });
  }
  std::vector<torch::Tensor> zero_state;
  train({"mlp", 2, 2}, [&](ZeroOptimizer& z, comm::Communicator& comm) {
    auto whole = z.consolidated(adamw);
    if (comm.rank() != 0) {
      EXPECT_EQ(whole, nullptr);
      return;
    }
    ASSERT_NE(whole, nullptr);
    for (auto& p : whole->parameters()) {
      auto& s = static_cast<torch::optim::AdamWParamState&>(*whole->state().at(lockstep::torch_compat::state_key(p)));
      EXPECT_EQ(s.step(), kSteps);
      zero_state.push_back(s.exp_avg().clone());
      zero_state.push_back(s.exp_avg_sq().clone());
    }
    torch::serialize::OutputArchive archive;
    whole->save(archive);
    archive.save_to(file);
  });
  ASSERT_EQ(zero_state.size(), ddp_state.size());
  EXPECT_LT(max_difference(zero_state, ddp_state), 1e-6);
  // Three ranks take their slices of the two-rank state and put it back together.
  lockstep::testing::run_ranks_as_threads(3, comm::CommOptions{"shm"}, [&](comm::Communicator& comm) {
    Net net = make_net("mlp");
    const ZeroOptions zo{1, false};
    Reducer reducer(net.module, comm, DdpOptions{}, zero_bucket_sharding(zo, comm.size()));
    ZeroOptimizer zero(*net.module, reducer, comm, zo, adamw);
    auto full = adamw(net.module->parameters());
    torch::serialize::InputArchive in;
    in.load_from(file);
    full->load(in);
    zero.load_consolidated(*full);
    auto again = zero.consolidated(adamw);
    if (comm.rank() != 0) return;
    std::size_t k = 0;
    for (auto& p : again->parameters()) {
      auto& s = static_cast<torch::optim::AdamWParamState&>(*again->state().at(lockstep::torch_compat::state_key(p)));
      EXPECT_EQ(s.step(), kSteps);
      EXPECT_TRUE(torch::equal(s.exp_avg(), zero_state[k++]));
      EXPECT_TRUE(torch::equal(s.exp_avg_sq(), zero_state[k++]));
    }
  });
}

TEST(ZeroErrors, AReducerBuiltWithoutZeroOptionsIsRefused) {
  lockstep::testing::run_ranks_as_threads(2, comm::CommOptions{"shm"}, [&](comm::Communicator& comm) {
    Net net = make_net("mlp");
    Reducer reducer(net.module, comm, DdpOptions{});
    EXPECT_THROW(ZeroOptimizer(*net.module, reducer, comm, ZeroOptions{1, false}, adamw), ConfigError);
  });
}

}  // namespace
}  // namespace lockstep
