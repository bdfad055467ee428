// Local SGD / DiLoCo (--sync-every, ddp/local_sgd.h): ranks as threads over real communicators,
// two machines declared so hier's two levels run in one process. The outer step against the
// formula; whole Trainer runs: machines apart between meetings and equal after them, the bytes
// between machines, a resume from a checkpoint that needs the saved outer momentum, and --fp16's
// loss scale kept per machine.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>

#include <ATen/CPUGeneratorImpl.h>

#include "lockstep/ddp/local_sgd.h"
#include "lockstep/ddp/torch_compat.h"
#include "lockstep/error.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train/datasets.h"
#include "lockstep/train/trainer.h"
#include "lockstep/train_core/loss_scale.h"
#include "testing.h"

namespace fs = std::filesystem;
using namespace lockstep;
using namespace lockstep::train;

namespace {

#ifdef LOCKSTEP_HAVE_GLOO
const std::vector<int> kTwoMachines = {0, 0, 1, 1};

comm::CommOptions two_machines() {
  comm::CommOptions options{"hier"};
  options.machine_of = kTwoMachines;
  options.timeout = comm::Seconds(120);
  return options;
}

// Each rank moves every parameter by its own amount per inner step; the meeting must average the
// moves and take a Nesterov step on the average, the same on every rank; between meetings no
// collective is issued.
TEST(OuterOptimizer, MeetsEveryKStepsWithANesterovStepOnTheAveragedChange) {
  const double lr = 0.7, mu = 0.9;
  std::mutex m;
  std::vector<std::string> failures;
  std::vector<torch::Tensor> first(4);
  lockstep::testing::run_ranks_as_threads(4, two_machines(), [&](comm::Communicator& comm) {
    auto fail = [&](const std::string& what) {
      std::lock_guard<std::mutex> lock(m);
      failures.push_back("rank " + std::to_string(comm.rank()) + ": " + what);
    };
    torch::NoGradGuard no_grad;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + comm.rank());  // a different start per rank
    torch::nn::Linear net(3, 2);
    for (auto& p : net->parameters()) p.copy_(torch::randn(p.sizes(), gen));
    auto rank0_start = net->weight.clone();
    comm.broadcast(rank0_start.data_ptr(), 6, comm::DType::f32, 0)->wait();
    OuterOptimizer outer(*net, comm, OuterOptions{2, lr, mu});
    if (!torch::equal(net->weight, rank0_start)) fail("did not start from rank 0's parameters");
    auto anchor = net->weight.clone(), buffer = torch::zeros_like(anchor);
    const float move = 0.1f * float(comm.rank() + 1);  // mean over ranks: 0.25 per inner step
    for (int meeting = 0; meeting < 2; ++meeting) {
      net->weight.sub_(move);
      const auto before = comm.issued();
      if (outer.step()) fail("met after one inner step");
      if (comm.issued() != before) fail("issued a collective between meetings");
      net->weight.sub_(move);
      if (!outer.step()) fail("did not meet at the second inner step");
      auto delta = torch::full_like(anchor, 0.5f);  // anchor - parameters, averaged
      buffer = mu * buffer + delta;
      anchor = anchor - lr * (delta + mu * buffer);
      if (!torch::allclose(net->weight, anchor, 1e-5, 1e-6))
        fail("meeting " + std::to_string(meeting) + ": weight " + std::to_string(net->weight[0][0].item<float>()) +
             ", expected " + std::to_string(anchor[0][0].item<float>()));
    }
    const auto before = comm.issued();
    if (outer.synchronize() || comm.issued() != before) fail("met with no inner step since the last meeting");
    std::lock_guard<std::mutex> lock(m);
    first[std::size_t(comm.rank())] = net->weight.clone();
  });
  for (const auto& f : failures) ADD_FAILURE() << f;
  for (int r = 1; r < 4; ++r) EXPECT_TRUE(torch::equal(first[0], first[std::size_t(r)])) << "rank " << r;
}

struct TinyImpl : torch::nn::Module {
  TinyImpl()
      : fc1(register_module("fc1", torch::nn::Linear(784, 16))),
        fc2(register_module("fc2", torch::nn::Linear(16, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x.flatten(1)))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Tiny);

Tiny seeded_tiny() {
  torch::manual_seed(1234);
  return Tiny();
}

std::vector<torch::Tensor> snapshot(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

bool same(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

TrainingArguments local_args(const std::string& out, int sync_every) {
  TrainingArguments a;
  a.output_dir = out;
  a.save_strategy = "no";
  a.logging_steps = 1000;
  a.disable_tqdm = true;
  a.max_grad_norm = 0;
  a.lr_scheduler_type = "constant";
  a.optim = "sgd";
  a.sgd_momentum = 0;
  a.learning_rate = 0.05;
  a.per_device_train_batch_size = 16;
  a.sync_every = sync_every;
  return a;
}

// Records each rank's parameters after `at` and the bytes its world communicator sent between
// machines by the end.
class Watch : public TrainerCallback {
 public:
  Watch(torch::nn::Module& m, std::int64_t at) : module_(m), at_(at) {}
  void on_step_end(const TrainerState& s, TrainerControl&) override {
    if (s.global_step == at_) seen = snapshot(module_);
  }
  std::vector<torch::Tensor> seen;

 private:
  torch::nn::Module& module_;
  std::int64_t at_;
};

struct Runs {
  std::vector<std::vector<torch::Tensor>> at_step, end;
  std::vector<std::uint64_t> bytes_between_machines;
};

// `prepare`, when given, sets each rank's trainer up (a loss of its own) before it trains.
Runs train_two_machines(const TrainingArguments& args, std::int64_t watch_step,
                        const std::function<void(Trainer&, int rank)>& prepare = {}) {
  auto train_set = std::make_shared<FashionMnistDataset>(data::FashionMnist::Split::train, data::kFashionMnistDir, 512);
  std::vector<Tiny> nets;
  for (int r = 0; r < 4; ++r) nets.push_back(seeded_tiny());
  Runs run;
  run.at_step.resize(4);
  run.end.resize(4);
  run.bytes_between_machines.resize(4);
  lockstep::testing::run_ranks_as_threads(4, two_machines(), [&](comm::Communicator& comm) {
    const auto r = std::size_t(comm.rank());
    auto watch = std::make_shared<Watch>(*nets[r], watch_step);
    Trainer trainer(Model::of(nets[r]), train_set, nullptr, args, {watch}, &comm);
    if (prepare) prepare(trainer, comm.rank());
    trainer.train();
    run.at_step[r] = watch->seen;
    run.end[r] = snapshot(*nets[r]);
    run.bytes_between_machines[r] = comm.network_stats().bytes_sent;
  });
  return run;
}

TEST(LocalSgd, MachinesTrainApartBetweenMeetingsSendAThirdOfTheBytesAndEndEqual) {
  lockstep::testing::TempDir out("local-sgd");
  auto args = local_args(out.path(), 4);
  args.max_steps = 12;
  const Runs local = train_two_machines(args, 3);
  EXPECT_TRUE(same(local.at_step[0], local.at_step[1])) << "a machine's two ranks differ after step 3";
  EXPECT_TRUE(same(local.at_step[2], local.at_step[3])) << "a machine's two ranks differ after step 3";
  EXPECT_FALSE(same(local.at_step[0], local.at_step[2])) << "the machines did not train apart before meeting";
  for (int r = 1; r < 4; ++r) EXPECT_TRUE(same(local.end[0], local.end[std::size_t(r)])) << "rank " << r;
  EXPECT_FALSE(same(local.end[0], snapshot(*seeded_tiny()))) << "nothing was trained";

  args.sync_every = 1;
  const Runs ddp = train_two_machines(args, 3);
  EXPECT_TRUE(same(ddp.at_step[0], ddp.at_step[2]));
  // 3 meetings (+ the first broadcast) against 12 all-reduces (+ DDP's first broadcast).
  for (std::size_t r = 0; r < 4; ++r)
    EXPECT_LT(double(local.bytes_between_machines[r]), 0.45 * double(ddp.bytes_between_machines[r]))
        << "rank " << r << ": " << local.bytes_between_machines[r] << " bytes between machines, DDP "
        << ddp.bytes_between_machines[r];
}

// DiLoCo's momentum carries from meeting to meeting, and each machine's AdamW moments are its
// own, so a resume must bring back both.
TEST(LocalSgd, AResumedRunEndsBitwiseWhereTheUninterruptedOneEnds) {
  lockstep::testing::TempDir whole_dir("whole"), halves_dir("halves");
  auto args = local_args(whole_dir.path(), 2);
  args.optim = "adamw";
  args.learning_rate = 1e-3;
  args.outer_learning_rate = 0.7;
  args.outer_momentum = 0.9;
  args.max_steps = 8;
  const Runs whole = train_two_machines(args, 8);

  args.output_dir = halves_dir.path();
  args.save_strategy = "steps";
  args.save_steps = 4;
  args.max_steps = 4;
  train_two_machines(args, 4);
  const CheckpointDir saved((fs::path(halves_dir.path()) / "checkpoint-4").string());
  ASSERT_TRUE(fs::exists(saved.outer_optimizer()));
  ASSERT_TRUE(fs::exists(saved.machine_optimizer(1)));
  args.max_steps = 8;
  args.resume_from_checkpoint = (fs::path(halves_dir.path()) / "checkpoint-4").string();
  const Runs resumed = train_two_machines(args, 8);
  for (std::size_t r = 0; r < 4; ++r) EXPECT_TRUE(same(whole.end[r], resumed.end[r])) << "rank " << r;
}

nlohmann::json loss_scales_in(const fs::path& checkpoint) {
  return nlohmann::json::parse(std::ifstream(checkpoint / "trainer_state.json")).at("loss_scales");
}

// --fp16 under local SGD: each machine decides on its own machine's gradients and keeps its own
// loss scale (no collective between machines for it), so machine 1's overflow at step 3 halves
// machine 1's scale only. Each rank's scale goes into the checkpoint; a resumed run takes its
// own back and ends, scales and parameters, where the uninterrupted one does.
TEST(LocalSgd, Fp16KeepsEachMachinesLossScaleThroughACheckpoint) {
  if (!torch_compat::kCpuFloat16Autocast)
    GTEST_SKIP() << "libtorch " << TORCH_VERSION << " has no float16 CPU autocast";
  auto loss = [](bool overflow_at_step_3) {
    return [overflow_at_step_3](Trainer& trainer, int rank) {
      auto calls = std::make_shared<int>(0);  // one micro-batch per step
      trainer.set_loss([=](const torch::Tensor& out, const torch::Tensor& target) {
        // Weighted down, no gradient comes near float16's limit on its own.
        const torch::Tensor l = torch::nn::functional::cross_entropy(out, target) * 1e-3;
        return ++*calls == 3 && rank == 2 && overflow_at_step_3 ? l * std::numeric_limits<float>::infinity() : l;
      });
    };
  };
  lockstep::testing::TempDir whole_dir("fp16-whole"), resumed_dir("fp16-resumed");
  auto args = local_args(whole_dir.path(), 2);
  args.fp16 = true;
  args.max_steps = 6;
  args.save_strategy = "steps";
  args.save_steps = 2;
  const Runs whole = train_two_machines(args, 6, loss(true));
  const nlohmann::json at4 = loss_scales_in(fs::path(whole_dir.path()) / "checkpoint-4");
  ASSERT_EQ(at4.size(), 4u) << at4;
  for (std::size_t r = 0; r < 4; ++r) {
    const bool machine1 = r >= 2;
    EXPECT_EQ(at4[r].at("scale").get<double>(), LossScale::kInitialScale * (machine1 ? 0.5 : 1)) << at4;
    EXPECT_EQ(at4[r].at("clean_steps").get<int>(), machine1 ? 1 : 4) << at4;
  }
  args.output_dir = resumed_dir.path();
  args.resume_from_checkpoint = (fs::path(whole_dir.path()) / "checkpoint-4").string();
  const Runs resumed = train_two_machines(args, 6, loss(false));
  EXPECT_EQ(loss_scales_in(fs::path(resumed_dir.path()) / "checkpoint-6"),
            loss_scales_in(fs::path(whole_dir.path()) / "checkpoint-6"));
  for (std::size_t r = 0; r < 4; ++r) EXPECT_TRUE(same(whole.end[r], resumed.end[r])) << "rank " << r;
}
#endif

TEST(LocalSgd, RefusesWhatItCannotCombineWith) {
  for (const char* what : {"zero", "hook", "sharded"}) {
    TrainingArguments a;
    a.sync_every = 4;
    if (what == std::string("zero")) a.zero_stage = 1;
    if (what == std::string("hook")) a.ddp_comm_hook = "powersgd";
    if (what == std::string("sharded")) a.save_format = "sharded";
    try {
      a.validate();
      ADD_FAILURE() << "accepted --sync-every with " << what;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("--sync-every"), std::string::npos) << e.what();
    }
  }
  TrainingArguments fine;
  fine.sync_every = 4;
  fine.ddp_comm_hook = "bf16";  // inside machines, it still halves the bytes
  EXPECT_NO_THROW(fine.validate());
}

}  // namespace
