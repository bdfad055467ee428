// ZeRO's sharded state across a change of membership (ddp/zero_elastic.h), with ranks as threads
// over real shm communicators: the case no fault injection in a real job can force, a step in
// flight that some ranks applied and one did not, and the state put back together from owners,
// mirrors and the rank that finishes the step, equal to an uninterrupted run's.
#include "lockstep/ddp/zero_elastic.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>
#include <thread>

#include "lockstep/ddp/ddp.h"
#include "lockstep/ddp/torch_compat.h"
#include "lockstep/error.h"
#include "testing.h"

namespace lockstep {
namespace {

constexpr int kWorld = 3;
std::mutex init_mu;  // construction draws from torch's global generator, shared by the thread ranks

std::shared_ptr<torch::nn::Module> make_mlp() {
  std::lock_guard<std::mutex> lock(init_mu);
  torch::manual_seed(7);
  return torch::nn::Sequential(torch::nn::Linear(12, 17), torch::nn::ReLU(), torch::nn::Linear(17, 4)).ptr();
}

std::unique_ptr<torch::optim::Optimizer> adamw(std::vector<torch::Tensor> p) {
  return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
}

// Rank r's batch for a step: the same on every run.
void backward(torch::nn::Module& module, Reducer& reducer, int rank, int step) {
  auto g = at::detail::createCPUGenerator(100 * static_cast<std::uint64_t>(step) + static_cast<std::uint64_t>(rank));
  const auto x = torch::randn({8, 12}, g), y = torch::randn({8, 4}, g);
  reducer.before_forward();
  auto out = module.as<torch::nn::Sequential>()->forward(x);
  reducer.after_forward(&out);
  torch::mse_loss(out, y).backward();
}

ZeroOptions mirrored(int rank) {
  ZeroOptions o(1, false);
  o.mirror_of = (rank + kWorld - 1) % kWorld;  // rank 0 mirrors rank 2, 1 mirrors 0, 2 mirrors 1
  o.mirrored_by = (rank + 1) % kWorld;
  return o;
}

struct WholeState {
  std::vector<torch::Tensor> params, exp_avg, exp_avg_sq;
  std::int64_t steps = 0;
};

WholeState whole_state(torch::nn::Module& module, torch::optim::Optimizer& o) {
  WholeState w;
  for (const auto& p : module.parameters()) {
    w.params.push_back(p.detach().clone());
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(
        *o.state().at(lockstep::torch_compat::state_key(p)));
    w.exp_avg.push_back(s.exp_avg().clone());
    w.exp_avg_sq.push_back(s.exp_avg_sq().clone());
    w.steps = s.step();
  }
  return w;
}

// Two steps of mirrored ZeRO-1 on 3 ranks, uninterrupted: the whole state rank 0 consolidates.
WholeState uninterrupted() {
  WholeState out;
  testing::run_ranks_as_threads(kWorld, comm::CommOptions{"shm"}, [&](comm::Communicator& comm) {
    auto module = make_mlp();
    Reducer reducer(module, comm, DdpOptions{}, zero_bucket_sharding(ZeroOptions(1, false), kWorld));
    ZeroOptimizer zero(*module, reducer, comm, mirrored(comm.rank()), adamw);
    for (int step = 1; step <= 2; ++step) {
      backward(*module, reducer, comm.rank(), step);
      zero.step();
      zero.zero_grad();
    }
    auto whole = zero.consolidated(adamw);
    if (comm.rank() == 0) out = whole_state(*module, *whole);
  });
  return out;
}

// Every layout of 1 to 4 machines with 1 to 4 ranks each: the mirrors pair up (the rank mirroring
// r is the one r's mirror_of names back), and a rank's slices are mirrored on another machine
// whenever there is one (else by another rank).
TEST(ZeroElastic, EachRanksSlicesAreMirroredOnAnotherMachine) {
  for (int machines = 1; machines <= 4; ++machines)
    for (int per_machine = 1; per_machine <= 4; ++per_machine) {
      const int world = machines * per_machine;
      if (world < 2) continue;
      std::vector<int> node_of_rank;
      for (int r = 0; r < world; ++r) node_of_rank.push_back(10 + r / per_machine);
      for (int r = 0; r < world; ++r) {
        const ZeroOptions o = mirrored_options(ZeroOptions{2, false}, r, node_of_rank);
        const std::string where = std::to_string(machines) + " machines x " + std::to_string(per_machine) + ", rank " +
                                  std::to_string(r);
        EXPECT_EQ(o.stage, 2) << where;
        ASSERT_TRUE(o.mirrored_by >= 0 && o.mirrored_by < world && o.mirrored_by != r) << where;
        EXPECT_EQ(mirrored_options(ZeroOptions{2, false}, o.mirrored_by, node_of_rank).mirror_of, r) << where;
        if (machines > 1) {
          EXPECT_NE(node_of_rank[std::size_t(o.mirrored_by)], node_of_rank[std::size_t(r)]) << where;
        }
      }
    }
}

TEST(ZeroOptions, SaysWhatItShards) {
  EXPECT_EQ(ZeroOptions{}.describe(), "");
  EXPECT_FALSE(ZeroOptions{}.sharded());
  EXPECT_EQ((ZeroOptions{2, false}.describe()), "ZeRO stage 2");
  EXPECT_EQ((ZeroOptions{3, true}.describe()), "ZeRO stage 3, one copy per machine");
  EXPECT_TRUE((ZeroOptions{3, true}.shards_parameters()));
  EXPECT_FALSE((ZeroOptions{2, true}.shards_parameters()));
}

// Step 2 goes wrong: rank 1 joins the all-reduce that lets the update start, then fails before
// applying it (it holds its gradients: phase ready); ranks 0 and 2 apply theirs and wait in vain
// in the all-gather. Rank 2 is then lost; ranks 0 and 1 form a new communicator and put the whole
// state together: rank 1 must finish step 2, rank 2's slices come from rank 0's mirror of them.
TEST(ZeroElastic, AStepHalfAppliedIsFinishedByTheSurvivorsAndEqualsAnUninterruptedOne) {
  const WholeState expected = uninterrupted();
  testing::LocalStore store;
  comm::CommOptions before{"shm"};
  before.name = "before";
  before.timeout = comm::Seconds(2);
  std::vector<UpdatePhase> phase(kWorld);
  std::vector<WholeState> recovered(2);
  std::vector<std::int64_t> steps(2);
  std::vector<std::thread> threads;
  std::mutex mu;
  std::vector<std::string> errors;
  for (int r = 0; r < kWorld; ++r)
    threads.emplace_back([&, r] {
      try {
        auto client = store.client();
        auto module = make_mlp();
        auto comm = comm::Communicator::create(client, r, kWorld, before);
        auto reducer = std::make_unique<Reducer>(module, *comm, DdpOptions{},
                                                 zero_bucket_sharding(ZeroOptions(1, false), kWorld));
        ZeroOptions o = mirrored(r);
        bool armed = false;
        o.on_phase = [&](UpdatePhase p) {
          if (!armed || r != 1 || p != UpdatePhase::ready) return;
          std::int32_t ready = 1;  // what step() would do next: the others may now update
          comm->allreduce(&ready, 1, comm::DType::i32, comm::ReduceOp::sum)->wait();
          throw Error("rank 1 fails after the others were let update");
        };
        ZeroOptimizer zero(*module, *reducer, *comm, o, adamw);
        backward(*module, *reducer, r, 1);
        zero.step();
        zero.zero_grad();
        armed = true;
        backward(*module, *reducer, r, 2);
        try {
          zero.step();
          ADD_FAILURE() << "rank " << r << ": step 2 completed";
        } catch (const Error&) {
        }
        phase[static_cast<std::size_t>(r)] = zero.phase();
        zero.release_communicator();
        reducer.reset();
        comm.reset();
        if (r == 2) return;  // lost
        comm::CommOptions after{"shm"};
        after.name = "after";
        auto survivors = comm::Communicator::create(client, r, 2, after);
        RecoveredState state = recover_sharded_state(*survivors, *module, HeldState{&zero, nullptr, 1}, adamw);
        steps[static_cast<std::size_t>(r)] = state.steps;
        recovered[static_cast<std::size_t>(r)] = whole_state(*module, *state.optimizer);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        errors.push_back("rank " + std::to_string(r) + ": " + e.what());
      }
    });
  for (auto& t : threads) t.join();
  ASSERT_TRUE(errors.empty()) << errors.front();
  EXPECT_EQ(phase[0], UpdatePhase::applied);
  EXPECT_EQ(phase[1], UpdatePhase::ready) << "the case under test: rank 1 did not apply step 2";
  EXPECT_EQ(phase[2], UpdatePhase::applied);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(steps[static_cast<std::size_t>(r)], 2) << "step 2 counts as completed";
    const WholeState& got = recovered[static_cast<std::size_t>(r)];
    EXPECT_EQ(got.steps, expected.steps);
    for (std::size_t i = 0; i < expected.params.size(); ++i) {
      EXPECT_TRUE(torch::equal(got.params[i], expected.params[i])) << "rank " << r << " parameter " << i;
      EXPECT_TRUE(torch::equal(got.exp_avg[i], expected.exp_avg[i])) << "rank " << r << " exp_avg " << i;
      EXPECT_TRUE(torch::equal(got.exp_avg_sq[i], expected.exp_avg_sq[i])) << "rank " << r << " exp_avg_sq " << i;
    }
  }
}

}  // namespace
}  // namespace lockstep
