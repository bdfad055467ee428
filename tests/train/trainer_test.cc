// The Trainer: accumulation, clipping, evaluation, early stopping, checkpoint files (ranks as
// threads over real shm communicators), and whole runs of the Fashion-MNIST example under the
// launcher: training lowers the loss, a killed and restarted run ends bitwise equal to an
// uninterrupted one, a kill during a save leaves the previous checkpoint usable, rotation.
#include "lockstep/train/trainer.h"

#include <gtest/gtest.h>
#include <sys/mount.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>

#include "lockstep/error.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train/datasets.h"
#include "lockstep/train/device.h"
#include "lockstep/train/foreach_adamw.h"
#include "lockstep/ddp/parameter_units.h"
#include "lockstep/ddp/torch_compat.h"
#include "lockstep/train_core/loss_scale.h"
#include "testing.h"

namespace fs = std::filesystem;
using namespace lockstep;
using namespace lockstep::train;

namespace {

struct TinyImpl : torch::nn::Module {
  explicit TinyImpl(int hidden = 16)
      : fc1(register_module("fc1", torch::nn::Linear(784, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x.flatten(1)))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Tiny);

std::shared_ptr<const FashionMnistDataset> fashion(data::FashionMnist::Split split, std::size_t limit) {
  return std::make_shared<FashionMnistDataset>(split, data::kFashionMnistDir, limit);
}

// The same starting weights for every rank and every configuration.
Tiny seeded_tiny(int hidden = 16) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(1234);
  return Tiny(hidden);
}

std::vector<torch::Tensor> snapshot(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().to(torch::kCPU).clone());
  return out;
}

double max_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  return worst;
}

TrainingArguments quiet_args(const std::string& out) {
  TrainingArguments a;
  a.output_dir = out;
  a.save_strategy = "no";
  a.logging_steps = 1000;
  a.disable_tqdm = true;
  a.max_grad_norm = 0;
  a.lr_scheduler_type = "constant";
  return a;
}

// --fp16, 6 steps of SGD on batches of 8 per rank.
TrainingArguments fp16_args(const std::string& out) {
  TrainingArguments a = quiet_args(out);
  a.fp16 = true;
  a.optim = "sgd";
  a.learning_rate = 0.05;
  a.max_steps = 6;
  a.per_device_train_batch_size = 8;
  return a;
}

// Trains on `world` thread-ranks and returns rank 0's parameters.
std::vector<torch::Tensor> train_threads(int world, TrainingArguments args, std::size_t samples = 512) {
  std::vector<torch::Tensor> result;
  auto train_set = fashion(data::FashionMnist::Split::train, samples);
  comm::CommOptions options;
  options.backend = "shm";
  // Built before the threads start: Trainer::train seeds torch's (process-wide) generator.
  std::vector<Tiny> nets;
  for (int r = 0; r < world; ++r) nets.push_back(seeded_tiny());
  lockstep::testing::run_ranks_as_threads(world, options, [&](comm::Communicator& comm) {
    Tiny net = nets[static_cast<std::size_t>(comm.rank())];
    Trainer trainer(Model::of(net), train_set, nullptr, args, {}, &comm);
    trainer.train();
    if (comm.rank() == 0) result = snapshot(*net);
  });
  return result;
}

}  // namespace

TEST(Trainer, AccumulationMatchesALargerBatchAndMoreWorkers) {
  // Step k of each run sees the same 24 samples: the sampler's permutation split over ranks.
  lockstep::testing::TempDir out_dir("accumulation");
  auto args = quiet_args(out_dir.path());
  args.optim = "sgd";
  args.learning_rate = 0.05;
  args.max_steps = 4;
  args.per_device_train_batch_size = 4;
  args.gradient_accumulation_steps = 3;
  auto accumulated = train_threads(2, args);
  args.per_device_train_batch_size = 12;
  args.gradient_accumulation_steps = 1;
  auto big_batch = train_threads(2, args);
  args.per_device_train_batch_size = 24;
  auto one_worker = train_threads(1, args);
  auto start = snapshot(*seeded_tiny());
  // float32 summation order differs (micro-batch sums, rank sums): a few ulps per step.
  EXPECT_LT(max_difference(big_batch, one_worker), 1e-5);
  EXPECT_LT(max_difference(accumulated, big_batch), 1e-5);
  EXPECT_LT(max_difference(accumulated, one_worker), 1e-5);
  EXPECT_GT(max_difference(accumulated, start), 1e-3);  // it trained at all
}

// --device: where there is no GPU, cuda is an error that says why and auto trains on the CPU
// (bitwise as --device cpu); where there is one (scripts/gpu-check), one worker on it with the
// double batch trains the weights 2 workers on the CPU do, up to float rounding in the GPU's
// kernels. One, because thread-ranks share the process's autograd thread for the GPU, where the
// first rank's gradient hook would wait forever for the second's all-reduce; processes do not
// share it, and gpu-check runs 2 processes on one GPU through host memory.
TEST(Trainer, DeviceCudaTrainsWhereThereIsAGpuAndIsAClearErrorWhereThereIsNone) {
  lockstep::testing::TempDir out_dir("device");
  auto args = quiet_args(out_dir.path());
  args.optim = "sgd";
  args.learning_rate = 0.05;
  args.max_steps = 4;
  args.per_device_train_batch_size = 12;
  const auto on_cpu = train_threads(2, args);
  EXPECT_EQ(training_device("cpu", 0), torch::Device(torch::kCPU));
  if (!torch::cuda::is_available()) {
    try {
      training_device("cuda", 0);
      ADD_FAILURE() << "--device cuda without a GPU was no error";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("--device cuda: "), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("--device cpu"), std::string::npos) << e.what();
    }
    args.device = "cuda";
    EXPECT_THROW(train_threads(1, args), ConfigError);
    args.device = "auto";
    EXPECT_EQ(max_difference(train_threads(2, args), on_cpu), 0.0);
    return;
  }
  EXPECT_EQ(training_device("cuda", 0), torch::Device(torch::kCUDA, 0));
  args.device = "cuda";
  args.per_device_train_batch_size = 24;
  const auto on_gpu = train_threads(1, args);
  EXPECT_LT(max_difference(on_gpu, on_cpu), 1e-4);
  EXPECT_GT(max_difference(on_gpu, snapshot(*seeded_tiny())), 1e-3);  // it trained at all
}

// --cuda-graphs: where there is a GPU, the captured step trains as the eager one (both with the
// fused AdamW kernel; the graph reads the learning rate as a float32 tensor, so not bitwise), the
// epoch's short last batch included (it runs eagerly); elsewhere a clear error before training.
TEST(Trainer, DeviceCudaGraphsTrainAsEagerStepsDo) {
  lockstep::testing::TempDir out_dir("graphs");
  auto args = quiet_args(out_dir.path());
  args.cuda_graphs = true;
  args.learning_rate = 1e-2;
  args.max_grad_norm = 1.0;
  args.per_device_train_batch_size = 16;
  args.max_steps = 40;  // an epoch of 500 samples is 31 steps of 16 and one of 4
  if (!torch::cuda::is_available()) {
    args.device = "auto";  // the CPU here
    try {
      train_threads(1, args, 500);
      ADD_FAILURE() << "--cuda-graphs without a GPU was no error";
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()).rfind("--cuda-graphs: ", 0), 0u) << e.what();
    }
    return;
  }
  args.device = "cuda";
  args.optim = "adamw_torch_fused";
  const auto graphed = train_threads(1, args, 500);
  args.cuda_graphs = false;
  const auto eager = train_threads(1, args, 500);
  EXPECT_GT(max_difference(eager, snapshot(*seeded_tiny())), 1e-3);  // it trained at all
  EXPECT_LT(max_difference(graphed, eager), 1e-5);
}

TEST(Trainer, ClippingBoundsTheGlobalNormOfTheUpdate) {
  auto norm_of_update = [&](double max_norm) {
    lockstep::testing::TempDir out_dir("clip");
    auto args = quiet_args(out_dir.path());
    args.optim = "sgd";
    args.sgd_momentum = 0;
    args.learning_rate = 1.0;
    args.max_steps = 1;
    args.per_device_train_batch_size = 16;
    args.max_grad_norm = max_norm;
    auto after = train_threads(2, args);
    auto before = snapshot(*seeded_tiny());
    double sq = 0;
    for (std::size_t i = 0; i < after.size(); ++i) sq += (after[i] - before[i]).pow(2).sum().item<double>();
    return std::sqrt(sq);
  };
  EXPECT_NEAR(norm_of_update(1e-3), 1e-3, 1e-6);  // lr 1 x the clipped gradient
  EXPECT_GT(norm_of_update(0), 1e-2);             // unclipped, the gradient is far larger
}

// Each step's parameters, as rank 0 holds them after it.
class ParameterRecorder : public TrainerCallback {
 public:
  explicit ParameterRecorder(torch::nn::Module& module) : module_(module) {}
  void on_step_end(const TrainerState&, TrainerControl&) override { steps.push_back(snapshot(module_)); }
  std::vector<std::vector<torch::Tensor>> steps;

 private:
  torch::nn::Module& module_;
};

// --fp16: float16 autocast with a loss scale. One rank's loss overflows at step 3: every rank
// skips that update (it changes no parameter), the scale halves, and training goes on; the
// checkpoint carries the scale. A libtorch without float16 CPU autocast refuses --fp16 on the CPU.
TEST(Trainer, Fp16SkipsAnOverflowedStepOnEveryRankAndHalvesTheLossScale) {
  lockstep::testing::TempDir out_dir("fp16");
  auto args = fp16_args(out_dir.path());
  auto train_set = fashion(data::FashionMnist::Split::train, 512);
  comm::CommOptions options;
  options.backend = "shm";
  if (!torch_compat::kCpuFloat16Autocast) {
    lockstep::testing::run_ranks_as_threads(1, options, [&](comm::Communicator& comm) {
      try {
        Trainer trainer(Model::of(seeded_tiny()), train_set, nullptr, args, {}, &comm);
        ADD_FAILURE() << "--fp16 on the CPU was accepted by libtorch " << TORCH_VERSION;
      } catch (const ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find("--bf16"), std::string::npos) << e.what();
      }
    });
    return;
  }
  std::vector<Tiny> nets = {seeded_tiny(), seeded_tiny()};
  std::vector<std::vector<std::vector<torch::Tensor>>> steps(2);
  std::string checkpoint;
  lockstep::testing::run_ranks_as_threads(2, options, [&](comm::Communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    auto recorder = std::make_shared<ParameterRecorder>(*nets[r]);
    Trainer trainer(Model::of(nets[r]), train_set, nullptr, args, {recorder}, &comm);
    int calls = 0;  // one micro-batch per step: the third call is step 3's
    trainer.set_loss([&calls, rank = comm.rank()](const torch::Tensor& out, const torch::Tensor& target) {
      if (!torch_compat::autocast_enabled(at::kCPU) || torch_compat::autocast_dtype(at::kCPU) != at::kHalf)
        ADD_FAILURE() << "the forward of step " << calls + 1 << " ran outside float16 autocast";
      // Weighted down, its gradients stay far below float16's limit at the initial scale on any
      // host: the one overflow is the one made here.
      const torch::Tensor loss = torch::nn::functional::cross_entropy(out, target) * 1e-3;
      return ++calls == 3 && rank == 1 ? loss * std::numeric_limits<float>::infinity() : loss;
    });
    trainer.train();
    const std::string dir = trainer.save_checkpoint();
    if (comm.rank() == 0) checkpoint = dir;
    steps[r] = recorder->steps;
  });
  ASSERT_EQ(steps[0].size(), 6u);
  EXPECT_EQ(max_difference(steps[0][2], steps[0][1]), 0);  // step 3 changed nothing
  EXPECT_EQ(max_difference(steps[1][2], steps[1][1]), 0);
  EXPECT_GT(max_difference(steps[0][3], steps[0][2]), 0);  // and step 4 trained again
  EXPECT_GT(max_difference(steps[0][1], snapshot(*seeded_tiny())), 0);
  EXPECT_EQ(max_difference(steps[0][5], steps[1][5]), 0);  // the ranks agree
  for (const auto& p : steps[0][5]) EXPECT_TRUE(torch::isfinite(p).all().item<bool>());
  const auto state = nlohmann::json::parse(std::ifstream(checkpoint + "/trainer_state.json"));
  EXPECT_EQ(state.at("loss_scale").at("scale").get<double>(), LossScale::kInitialScale / 2) << state.dump();
  EXPECT_EQ(state.at("loss_scale").at("clean_steps").get<int>(), 3) << state.dump();
}

namespace {

// Tiny with fc1 as a ZeRO stage 3 unit (fc2 is the root's): the same parameters, seeded alike.
struct UnitTinyImpl : TinyImpl {
  std::vector<std::shared_ptr<torch::nn::Module>> parameter_units() { return {fc1.ptr()}; }
  void set_unit_runner(UnitRunner r) { runner = std::move(r); }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc2(torch::relu(run_unit(runner, 0, [this](const torch::Tensor& h) { return fc1(h); }, x.flatten(1))));
  }
  UnitRunner runner;
};
TORCH_MODULE(UnitTiny);

UnitTiny seeded_unit_tiny() {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(1234);
  return UnitTiny();
}

struct Fp16Run {
  std::vector<torch::Tensor> parameters;  // the checkpoint's, after 6 steps
  nlohmann::json loss_scale;
};

// 2 ranks, --fp16, 6 steps of SGD; rank 1's loss overflows at step 3.
Fp16Run train_fp16_with_an_overflow(int zero_stage) {
  lockstep::testing::TempDir out_dir("fp16-zero");
  auto args = fp16_args(out_dir.path());
  args.zero_stage = zero_stage;
  auto train_set = fashion(data::FashionMnist::Split::train, 512);
  comm::CommOptions options;
  options.backend = "shm";
  std::vector<UnitTiny> nets = {seeded_unit_tiny(), seeded_unit_tiny()};
  std::string checkpoint;
  lockstep::testing::run_ranks_as_threads(2, options, [&](comm::Communicator& comm) {
    Trainer trainer(Model::of(nets[static_cast<std::size_t>(comm.rank())]), train_set, nullptr, args, {}, &comm);
    int calls = 0;
    trainer.set_loss([&calls, rank = comm.rank()](const torch::Tensor& out, const torch::Tensor& target) {
      const torch::Tensor loss = torch::nn::functional::cross_entropy(out, target) * 1e-3;
      return ++calls == 3 && rank == 1 ? loss * std::numeric_limits<float>::infinity() : loss;
    });
    trainer.train();
    const std::string dir = trainer.save_checkpoint();
    if (comm.rank() == 0) checkpoint = dir;
  });
  Tiny saved = seeded_tiny();
  load_module(*saved, checkpoint + "/model.pt");
  const auto state = nlohmann::json::parse(std::ifstream(checkpoint + "/trainer_state.json"));
  return {snapshot(*saved), state.at("loss_scale")};
}

}  // namespace

// --fp16 under ZeRO: each rank unscales and checks only its slices of the gradients, and one
// all-reduce has every rank skip the overflowed step. Every stage then trains as DDP does: a rank
// that applied the overflowed update, or one left unscaled, or ranks that disagreed (a hang's
// timeout) would each end elsewhere.
TEST(Trainer, Fp16UnderEveryZeroStageSkipsTheOverflowedStepAsDdpDoes) {
  if (!torch_compat::kCpuFloat16Autocast)
    GTEST_SKIP() << "libtorch " << TORCH_VERSION << " has no float16 CPU autocast (the test above checks the refusal)";
  const Fp16Run ddp = train_fp16_with_an_overflow(0);
  EXPECT_EQ(ddp.loss_scale.at("scale").get<double>(), LossScale::kInitialScale / 2) << ddp.loss_scale;
  EXPECT_EQ(ddp.loss_scale.at("clean_steps").get<int>(), 3) << ddp.loss_scale;
  EXPECT_GT(max_difference(ddp.parameters, snapshot(*seeded_tiny())), 0);
  for (int stage : {1, 2, 3}) {
    const Fp16Run zero = train_fp16_with_an_overflow(stage);
    EXPECT_EQ(zero.loss_scale, ddp.loss_scale) << "stage " << stage;
    EXPECT_LT(max_difference(zero.parameters, ddp.parameters), 1e-6) << "stage " << stage;
  }
}

// ZeRO on a GPU (scripts/gpu-check runs it where there is one): one worker, each stage against
// DDP on the same GPU. The flat arrays and the slices live on the device, stage 3's units take
// GPU memory and give it back, and the collectives go through host memory (shm). Two workers
// sharing one GPU need processes (see the test above): gpu-check trains the GPT so under every stage.
TEST(Trainer, DeviceCudaUnderEveryZeroStageTrainsAsDdpDoes) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU here: scripts/gpu-check runs this where there is one";
  auto train = [](int stage) {
    lockstep::testing::TempDir out_dir("zero-cuda");
    auto args = quiet_args(out_dir.path());
    args.device = "cuda";
    args.optim = "adamw";
    args.learning_rate = 1e-2;
    args.max_steps = 4;
    args.per_device_train_batch_size = 16;
    args.zero_stage = stage;
    auto train_set = fashion(data::FashionMnist::Split::train, 512);
    UnitTiny net = seeded_unit_tiny();
    comm::CommOptions options;
    options.backend = "shm";
    std::vector<torch::Tensor> result;
    lockstep::testing::run_ranks_as_threads(1, options, [&](comm::Communicator& comm) {
      Trainer trainer(Model::of(net), train_set, nullptr, args, {}, &comm);
      trainer.train();
      const std::string dir = trainer.save_checkpoint();
      Tiny saved = seeded_tiny();
      load_module(*saved, dir + "/model.pt");
      result = snapshot(*saved);
    });
    return result;
  };
  const auto ddp = train(0);
  EXPECT_GT(max_difference(ddp, snapshot(*seeded_tiny())), 1e-3);  // it trained at all
  for (int stage : {1, 2, 3}) EXPECT_LT(max_difference(train(stage), ddp), 1e-5) << "stage " << stage;
}

TEST(Trainer, EvaluationCountsEveryRealSampleOnceAcrossRanks) {
  auto eval_set = fashion(data::FashionMnist::Split::test, 101);  // 101 = 3 x 34 - 1: padding
  auto train_set = fashion(data::FashionMnist::Split::train, 64);
  lockstep::testing::TempDir out_dir("eval");
  auto args = quiet_args(out_dir.path());
  args.per_device_eval_batch_size = 16;
  nlohmann::json single;
  {
    Tiny net = seeded_tiny();
    comm::CommOptions options;
    lockstep::testing::run_ranks_as_threads(1, options, [&](comm::Communicator& comm) {
      single = Trainer(Model::of(net), train_set, eval_set, args, {}, &comm).evaluate();
    });
  }
  std::vector<nlohmann::json> per_rank(3);
  comm::CommOptions options;
  options.backend = "shm";
  std::vector<Tiny> nets = {seeded_tiny(), seeded_tiny(), seeded_tiny()};
  lockstep::testing::run_ranks_as_threads(3, options, [&](comm::Communicator& comm) {
    Tiny net = nets[static_cast<std::size_t>(comm.rank())];
    per_rank[static_cast<std::size_t>(comm.rank())] =
        Trainer(Model::of(net), train_set, eval_set, args, {}, &comm).evaluate();
  });
  EXPECT_EQ(single["eval_samples"].get<int>(), 101);
  for (const auto& m : per_rank) {
    EXPECT_EQ(m["eval_samples"].get<int>(), 101);
    EXPECT_EQ(m["eval_accuracy"].get<double>(), single["eval_accuracy"].get<double>());
    EXPECT_NEAR(m["eval_loss"].get<double>(), single["eval_loss"].get<double>(), 1e-6);
  }
}

TEST(Trainer, EarlyStoppingCallbackCountsEvaluationsWithoutImprovement) {
  EarlyStoppingCallback cb("eval_loss", /*greater_is_better=*/false, /*patience=*/2, /*threshold=*/0.01);
  TrainerState state;
  TrainerControl control;
  for (double loss : {1.0, 0.9, 0.895, 0.93}) {  // 0.895 is better by less than the threshold
    cb.on_evaluate(state, {{"eval_loss", loss}}, control);
    if (loss < 0.92) {
      EXPECT_FALSE(control.should_stop) << loss;
    }
  }
  EXPECT_TRUE(control.should_stop);
  EarlyStoppingCallback acc("eval_accuracy", true, 1, 0);
  TrainerControl c2;
  acc.on_evaluate(state, {{"eval_accuracy", 0.5}}, c2);
  acc.on_evaluate(state, {{"eval_accuracy", 0.6}}, c2);
  EXPECT_FALSE(c2.should_stop);
  EXPECT_THROW(acc.on_evaluate(state, {{"eval_loss", 0.6}}, c2), ConfigError);  // metric not reported
}

TEST(Trainer, EarlyStoppingEndsARunThatStoppedImprovingOnEveryRank) {
  lockstep::testing::TempDir out_dir("early");
  auto args = quiet_args(out_dir.path());
  args.learning_rate = 0;  // nothing improves after the first evaluation
  args.max_steps = 100;
  args.per_device_train_batch_size = 8;
  args.eval_strategy = "steps";
  args.eval_steps = 2;
  args.early_stopping_patience = 1;
  auto train_set = fashion(data::FashionMnist::Split::train, 512);
  auto eval_set = fashion(data::FashionMnist::Split::test, 64);
  std::vector<std::int64_t> steps(2);
  comm::CommOptions options;
  options.backend = "shm";
  std::vector<Tiny> nets = {seeded_tiny(), seeded_tiny()};
  lockstep::testing::run_ranks_as_threads(2, options, [&](comm::Communicator& comm) {
    Tiny net = nets[static_cast<std::size_t>(comm.rank())];
    Trainer trainer(Model::of(net), train_set, eval_set, args, {}, &comm);
    auto r = trainer.train();
    EXPECT_TRUE(r.stopped_early);
    steps[static_cast<std::size_t>(comm.rank())] = r.global_step;
  });
  EXPECT_EQ(steps[0], 4);  // evaluated at 2 (best) and 4 (no better): stop
  EXPECT_EQ(steps[1], 4);
}

// --optim's AdamWs (Hugging Face's names): adamw_torch is libtorch's loop; adamw is the fused
// kernel on the CPU where libtorch has it (2.4+), a few ulps from the loop, and the loop itself
// where not; adamw_torch_fused is that kernel, or an error naming what to use instead.
TEST(Trainer, TheAdamwChoicesTrainAlikeAndAMissingFusedKernelIsNamed) {
  lockstep::testing::TempDir out_dir("optim");
  auto args = quiet_args(out_dir.path());
  args.max_steps = 4;
  args.per_device_train_batch_size = 24;
  args.weight_decay = 0.1;
  args.optim = "adamw_torch";
  const auto loop = train_threads(1, args);
  args.optim = "adamw";
  const auto chosen = train_threads(1, args);
  EXPECT_GT(max_difference(loop, snapshot(*seeded_tiny())), 1e-3);  // it trained at all
  if (!lockstep::FusedAdamW::available()) {
    EXPECT_EQ(max_difference(chosen, loop), 0);
    args.optim = "adamw_torch_fused";
    try {
      train_threads(1, args);
      ADD_FAILURE() << "adamw_torch_fused accepted by a libtorch without the kernel";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("adamw_torch_fused"), std::string::npos) << e.what();
    }
    return;
  }
  EXPECT_LT(max_difference(chosen, loop), 1e-5);
  args.optim = "adamw_torch_fused";
  EXPECT_EQ(max_difference(train_threads(1, args), chosen), 0);
}

TEST(Trainer, ConfigurationErrorsAreReportedBeforeTraining) {
  auto train_set = fashion(data::FashionMnist::Split::train, 64);
  comm::CommOptions options;
  lockstep::testing::run_ranks_as_threads(1, options, [&](comm::Communicator& comm) {
    lockstep::testing::TempDir out_dir("config");
    auto args = quiet_args(out_dir.path());
    args.eval_strategy = "epoch";
    Tiny net = seeded_tiny();
    try {
      Trainer t(Model::of(net), train_set, nullptr, args, {}, &comm);
      ADD_FAILURE() << "no error for an eval strategy without an eval dataset";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("eval dataset"), std::string::npos) << e.what();
    }
    lockstep::testing::TempDir other_dir("config");
    args = quiet_args(other_dir.path());
    args.per_device_train_batch_size = 0;
    EXPECT_THROW(Trainer(Model::of(net), train_set, nullptr, args, {}, &comm), ConfigError);
  });
}

TEST(Checkpoint, AModuleLoadsOnlyIntoTheSameShapesAndSaysWhichParameterDiffers) {
  lockstep::testing::TempDir temp("module");
  const std::string dir = temp.path();
  Tiny saved = seeded_tiny(16);
  save_module(*saved, dir + "/model.pt");
  Tiny same(16);
  load_module(*same, dir + "/model.pt");
  EXPECT_EQ(max_difference(snapshot(*same), snapshot(*saved)), 0.0);
  // torch::load reads the same file: no wrapper prefix, plain libtorch format.
  Tiny plain(16);
  torch::load(plain, dir + "/model.pt");
  EXPECT_EQ(max_difference(snapshot(*plain), snapshot(*saved)), 0.0);

  Tiny wider(32);
  try {
    load_module(*wider, dir + "/model.pt");
    ADD_FAILURE() << "a checkpoint of another shape loaded";
  } catch (const ConfigError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("'fc1.weight' is float32[32, 784] in the model but float32[16, 784] in the checkpoint"),
              std::string::npos)
        << m;
  }
  auto other = std::make_shared<torch::nn::Module>();
  other->register_module("fc1", torch::nn::Linear(784, 16));
  other->register_module("head", torch::nn::Linear(16, 10));
  try {
    load_module(*other, dir + "/model.pt");
    ADD_FAILURE() << "a checkpoint with other layer names loaded";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'head'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(load_module(*same, dir + "/missing.pt"), ConfigError);
}

// ----- whole runs of the example under the launcher -----------------------------------------

namespace {

std::vector<std::string> launch(int nproc, std::vector<std::string> flags,
                                std::vector<std::string> launcher_flags = {}) {
  std::vector<std::string> argv = {LOCKSTEP_BINARY, "run", "--nproc-per-node", std::to_string(nproc)};
  argv.insert(argv.end(), launcher_flags.begin(), launcher_flags.end());
  argv.push_back(FASHION_MNIST);
  argv.insert(argv.end(), flags.begin(), flags.end());
  return argv;
}

std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line);
    if (j.value("event", "") == "train_begin") continue;  // the run's settings, not a measurement
    out.push_back(j);
  }
  return out;
}

// Every tensor of two torch archives (nested per submodule), compared bitwise.
void expect_archives_equal(torch::serialize::InputArchive& a, torch::serialize::InputArchive& b,
                           const std::string& at) {
  auto keys = a.keys();
  ASSERT_EQ(keys, b.keys()) << at;
  for (const auto& k : keys) {
    torch::Tensor ta, tb;
    if (a.try_read(k, ta) && b.try_read(k, tb)) {
      EXPECT_TRUE(torch::equal(ta, tb)) << at << k << " differs";
      continue;
    }
    torch::serialize::InputArchive ca, cb;
    ASSERT_TRUE(a.try_read(k, ca) && b.try_read(k, cb)) << at << k << " is neither a tensor nor a submodule";
    expect_archives_equal(ca, cb, at + k + ".");
  }
}

void expect_modules_equal(const std::string& a, const std::string& b) {
  torch::serialize::InputArchive x, y;
  x.load_from(a);
  y.load_from(b);
  expect_archives_equal(x, y, "");
}

void collect_tensors(torch::serialize::InputArchive& a, std::vector<torch::Tensor>& out) {
  for (const auto& k : a.keys()) {
    torch::Tensor t;
    torch::serialize::InputArchive child;
    if (a.try_read(k, t)) {
      out.push_back(t);
    } else if (a.try_read(k, child)) {
      collect_tensors(child, out);
    }
  }
}

// libtorch keys optimiser state by each parameter's address in the process that saved it, so
// two processes' files differ in keys: compare the state tensors themselves, as a multiset.
void expect_optimizer_states_equal(const std::string& a, const std::string& b) {
  torch::serialize::InputArchive x, y;
  x.load_from(a);
  y.load_from(b);
  std::vector<torch::Tensor> ta, tb;
  collect_tensors(x, ta);
  collect_tensors(y, tb);
  ASSERT_EQ(ta.size(), tb.size());
  ASSERT_GT(ta.size(), 0u);
  std::vector<bool> used(tb.size(), false);
  for (const auto& t : ta) {
    bool found = false;
    for (std::size_t j = 0; j < tb.size() && !found; ++j) {
      if (!used[j] && t.sizes() == tb[j].sizes() && t.scalar_type() == tb[j].scalar_type() &&
          torch::equal(t, tb[j]))
        used[j] = found = true;
    }
    EXPECT_TRUE(found) << "an optimiser state tensor of shape " << t.sizes() << " has no bitwise equal in "
                       << b;
  }
}

const std::vector<std::string> kShortRun = {
    "--train-limit",   "640", "--eval-limit", "200", "--per-device-train-batch-size", "16", "--disable-tqdm",
    "--eval-strategy", "no"};

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

TEST(TrainerRuns, AShortRunOnTwoWorkersLowersTheLoss) {
  lockstep::testing::TempDir out_dir("short");
  const std::string out = out_dir.path();
  lockstep::testing::Process run(
      launch(2, with(kShortRun, {"--model", "mlp", "--max-steps", "40", "--logging-steps", "5",
                                 "--save-strategy", "no", "--trace", "--output-dir", out})),
      {{"LOCKSTEP_PROBE_MATMUL", "1"}});
  ASSERT_EQ(run.wait(180), 0) << run.output();
  EXPECT_NE(run.output().find("2 workers x 16 per device x 1 accumulation = 32 samples per step"),
            std::string::npos)
      << run.output();
  auto log = read_jsonl(out + "/metrics.jsonl");
  ASSERT_GE(log.size(), 8u);
  EXPECT_EQ(log.front()["world_size"].get<int>(), 2);
  EXPECT_LT(log.back()["loss"].get<double>(), 0.7 * log.front()["loss"].get<double>());
  for (const char* key : {"samples_per_second", "exposed_comm_fraction", "learning_rate", "forward_seconds",
                          "backward_seconds", "optimizer_seconds", "data_seconds"})
    EXPECT_TRUE(log.back().contains(key)) << key;
  EXPECT_TRUE(list_checkpoints(out).empty());  // --save-strategy no

  // Model FLOPs: an MLP multiplies each weight once per sample (6 FLOPs in training), its biases
  // being under 1% of the parameters; the utilisation is over the rate measured for the run.
  std::ifstream metrics(out + "/metrics.jsonl");
  std::string first;
  std::getline(metrics, first);
  const auto begin = nlohmann::json::parse(first);
  const double per_sample = begin["model_flops_per_sample"].get<double>();
  EXPECT_NEAR(per_sample, 6.0 * begin["parameters"].get<double>(), 0.01 * 6 * begin["parameters"].get<double>());
  const double fp32_rate = begin["matmul_fp32_flops_per_second"].get<double>();
  EXPECT_GT(fp32_rate, 0);
  EXPECT_GT(begin["matmul_bf16_flops_per_second"].get<double>(), 0);
  for (const auto& window : log) {
    EXPECT_NEAR(window["model_flops_per_second"].get<double>(), per_sample * window["samples_per_second"].get<double>(),
                1e-9 * window["model_flops_per_second"].get<double>());
    EXPECT_NEAR(window["mfu"].get<double>(), window["model_flops_per_second"].get<double>() / 2 / fp32_rate, 1e-9);
  }

  // --trace: one Chrome trace per rank, valid JSON, with every phase of a step.
  for (int rank : {0, 1}) {
    std::ifstream in(out + "/trace/rank_" + std::to_string(rank) + ".json");
    ASSERT_TRUE(in) << "no trace for rank " << rank;
    nlohmann::json trace = nlohmann::json::parse(in);
    std::map<std::string, int> count;
    for (const auto& e : trace) {
      count[e["name"].get<std::string>()] += 1;
      if (e["ph"] == "X") {
        EXPECT_GE(e["dur"].get<double>(), 0);
      }
      EXPECT_EQ(e["pid"].get<int>(), rank);
    }
    EXPECT_EQ(count["forward"], 40);
    EXPECT_EQ(count["backward + all-reduce"], 40);
    EXPECT_EQ(count["optimizer"], 40);
    EXPECT_EQ(count["data wait"], 40);
    EXPECT_GE(count["all-reduce"], 40);  // at least one bucket per step, on the comm track
  }
}

TEST(TrainerRuns, Bf16AutocastAndGradientAccumulationTrain) {
  lockstep::testing::TempDir out_dir("bf16");
  const std::string out = out_dir.path();
  lockstep::testing::Process run(
      launch(2, with(kShortRun, {"--model", "cnn", "--max-steps", "16", "--logging-steps", "4", "--bf16",
                                 "--gradient-accumulation-steps", "2", "--per-device-train-batch-size", "8",
                                 "--save-strategy", "no", "--output-dir", out})));
  ASSERT_EQ(run.wait(180), 0) << run.output();
  EXPECT_NE(run.output().find("2 workers x 8 per device x 2 accumulation = 32 samples per step"),
            std::string::npos)
      << run.output();
  auto log = read_jsonl(out + "/metrics.jsonl");
  ASSERT_EQ(log.size(), 4u);
  EXPECT_LT(log.back()["loss"].get<double>(), log.front()["loss"].get<double>());
}

TEST(TrainerRuns, AKilledAndRestartedRunEndsBitwiseEqualToAnUninterruptedOne) {
  // 640 samples, 2 workers x 16: 20 steps per epoch. Checkpoint 13 is mid-epoch; step 30 is in
  // the second epoch. The CNN has BatchNorm buffers; cosine schedule with warm-up; AdamW.
  const std::vector<std::string> flags =
      with(kShortRun, {"--model", "cnn", "--max-steps", "30", "--save-strategy", "steps", "--save-steps",
                       "13", "--warmup-steps", "3", "--lr-scheduler-type", "cosine",
                       "--dataloader-num-workers", "2", "--logging-steps", "10"});
  lockstep::testing::TempDir straight_dir("straight"), killed_dir("killed");
  const std::string straight = straight_dir.path(), killed = killed_dir.path();
  lockstep::testing::Process a(launch(2, with(flags, {"--output-dir", straight})));
  ASSERT_EQ(a.wait(240), 0) << a.output();
  lockstep::testing::Process b(launch(2, with(flags, {"--output-dir", killed}), {"--max-restarts", "1"}),
                               {{"LOCKSTEP_FAULT_INJECT", "kill-after-step:17:1"}});
  ASSERT_EQ(b.wait(240), 0) << b.output();
  EXPECT_NE(b.output().find("SIGKILL"), std::string::npos) << b.output();  // rank 1 really died
  EXPECT_NE(b.output().find("resumed from " + killed + "/checkpoint-13 at step 13"), std::string::npos)
      << b.output();
  ASSERT_TRUE(fs::exists(straight + "/checkpoint-30/model.pt"));
  ASSERT_TRUE(fs::exists(killed + "/checkpoint-30/model.pt"));
  expect_modules_equal(straight + "/checkpoint-30/model.pt", killed + "/checkpoint-30/model.pt");
  expect_optimizer_states_equal(straight + "/checkpoint-30/optimizer.pt",
                                killed + "/checkpoint-30/optimizer.pt");

  // The checkpoint loads into a plain model in one process; another model is refused by name.
  lockstep::testing::Process eval({FASHION_MNIST, "evaluate", "--model", "cnn", "--checkpoint",
                                   killed + "/checkpoint-30", "--eval-limit", "200"});
  EXPECT_EQ(eval.wait(60), 0) << eval.output();
  EXPECT_NE(eval.output().find("test accuracy"), std::string::npos) << eval.output();
  // --device cuda: on a GPU it evaluates there; elsewhere it is an error that says why.
  lockstep::testing::Process on_gpu({FASHION_MNIST, "evaluate", "--model", "cnn", "--checkpoint",
                                     killed + "/checkpoint-30", "--eval-limit", "200", "--device", "cuda"});
  const int code = on_gpu.wait(60);
  if (code == 0) {
    EXPECT_NE(on_gpu.output().find("one process on cuda:0"), std::string::npos) << on_gpu.output();
  } else {
    EXPECT_EQ(code, 2) << on_gpu.output();
    EXPECT_NE(on_gpu.output().find("--device cuda: "), std::string::npos) << on_gpu.output();
  }
  lockstep::testing::Process wrong(
      {FASHION_MNIST, "evaluate", "--model", "mlp", "--checkpoint", killed + "/checkpoint-30"});
  EXPECT_EQ(wrong.wait(60), 2) << wrong.output();
  EXPECT_NE(
      wrong.output().find("parameter 'fc1.weight' is float32[512, 784] in the model but float32[128, 1568]"),
      std::string::npos)
      << wrong.output();
}

TEST(TrainerRuns, AKillDuringASaveLeavesThePreviousCheckpointUsable) {
  lockstep::testing::TempDir out_dir("killsave");
  const std::string out = out_dir.path();
  const std::vector<std::string> flags =
      with(kShortRun, {"--model", "mlp", "--max-steps", "12", "--save-strategy", "steps", "--save-steps", "5",
                       "--output-dir", out});
  lockstep::testing::Process a(launch(2, flags), {{"LOCKSTEP_FAULT_INJECT", "kill-during-save:10"}});
  EXPECT_EQ(a.wait(180), 128 + 9) << a.output();
  EXPECT_TRUE(fs::exists(out + "/checkpoint-5/trainer_state.json"));
  EXPECT_FALSE(fs::exists(out + "/checkpoint-10"));
  bool partial = false;
  for (const auto& e : fs::directory_iterator(out))
    partial |= e.path().filename().string().rfind(".tmp-checkpoint-10-", 0) == 0;
  EXPECT_TRUE(partial) << "the kill did not happen inside the save";
  EXPECT_EQ(latest_checkpoint(out), out + "/checkpoint-5");

  lockstep::testing::Process eval({FASHION_MNIST, "evaluate", "--model", "mlp", "--checkpoint",
                                   out + "/checkpoint-5", "--eval-limit", "100"});
  EXPECT_EQ(eval.wait(60), 0) << eval.output();

  lockstep::testing::Process resume(launch(2, with(flags, {"--resume-from-checkpoint", "latest"})));
  ASSERT_EQ(resume.wait(180), 0) << resume.output();
  EXPECT_NE(resume.output().find("resumed from " + out + "/checkpoint-5 at step 5"), std::string::npos)
      << resume.output();
  EXPECT_TRUE(fs::exists(out + "/checkpoint-12/trainer_state.json"));
  for (const auto& e : fs::directory_iterator(out))
    EXPECT_NE(e.path().filename().string().rfind(".tmp-", 0), 0u) << e.path() << " left behind";
}

TEST(TrainerRuns, RotationKeepsTheLatestAndTheBestCheckpoint) {
  lockstep::testing::TempDir out_dir("rotate");
  const std::string out = out_dir.path();
  lockstep::testing::Process run(
      launch(2, with(kShortRun, {"--model", "mlp", "--max-steps", "16", "--save-strategy", "steps",
                                 "--save-steps", "4", "--save-total-limit", "1", "--eval-strategy", "steps",
                                 "--eval-steps", "4", "--output-dir", out})));
  ASSERT_EQ(run.wait(180), 0) << run.output();
  auto left = list_checkpoints(out);
  ASSERT_GE(left.size(), 1u);
  ASSERT_LE(left.size(), 2u);
  EXPECT_EQ(left.back(), out + "/checkpoint-16");
  nlohmann::json state = nlohmann::json::parse(std::ifstream(out + "/checkpoint-16/trainer_state.json"));
  std::string best = state["best_checkpoint"].get<std::string>();
  ASSERT_FALSE(best.empty());
  EXPECT_TRUE(fs::exists(out + "/" + best + "/model.pt")) << best << " was deleted";
  int evals = 0;
  for (const auto& e : read_jsonl(out + "/metrics.jsonl")) evals += e.contains("eval_loss") ? 1 : 0;
  EXPECT_EQ(evals, 4);
}

TEST(TrainerRuns, LoadBestModelAtEndLeavesTheBestCheckpointsWeightsInTheModel) {
  lockstep::testing::TempDir out_dir("best");
  const std::string out = out_dir.path();
  // A rate high enough that accuracy goes up and down between evaluations.
  lockstep::testing::Process run(launch(2, {"--model",
                                            "mlp",
                                            "--train-limit",
                                            "640",
                                            "--eval-limit",
                                            "500",
                                            "--per-device-train-batch-size",
                                            "16",
                                            "--disable-tqdm",
                                            "--max-steps",
                                            "30",
                                            "--learning-rate",
                                            "0.05",
                                            "--lr-scheduler-type",
                                            "constant",
                                            "--eval-strategy",
                                            "steps",
                                            "--eval-steps",
                                            "5",
                                            "--save-strategy",
                                            "steps",
                                            "--save-steps",
                                            "5",
                                            "--load-best-model-at-end",
                                            "--output-dir",
                                            out}));
  ASSERT_EQ(run.wait(180), 0) << run.output();
  double best = -1;
  int best_step = -1;
  for (const auto& e : read_jsonl(out + "/metrics.jsonl"))
    if (e.contains("eval_accuracy") && e["eval_accuracy"].get<double>() > best) {
      best = e["eval_accuracy"].get<double>();
      best_step = e["step"].get<int>();
    }
  ASSERT_GT(best_step, 0);
  nlohmann::json result = nlohmann::json::parse(std::ifstream(out + "/eval_results.json"));
  // The evaluation after training saw the best checkpoint's weights: the same accuracy, exactly.
  EXPECT_EQ(result["eval_accuracy"].get<double>(), best) << run.output();
  EXPECT_EQ(result["checkpoint"].get<std::string>(), out + "/checkpoint-" + std::to_string(best_step));
  EXPECT_NE(run.output().find("loaded the best model, checkpoint-" + std::to_string(best_step)),
            std::string::npos)
      << run.output();
}

// ----- failure paths: one clear line, the documented exit code, nothing lost -----------------

namespace {

// A tmpfs of `size` mounted on `dir` for the test's lifetime (needs root; error() says why not).
class TmpfsMount {
 public:
  TmpfsMount(const std::string& dir, const std::string& size) : dir_(dir) {
    const std::string options = "size=" + size;
    if (::mount("tmpfs", dir.c_str(), "tmpfs", 0, options.c_str()) == 0)
      mounted_ = true;
    else
      error_ = std::strerror(errno);
  }
  ~TmpfsMount() {
    if (mounted_) ::umount2(dir_.c_str(), MNT_DETACH);
  }
  bool ok() const { return mounted_; }
  const std::string& error() const { return error_; }

 private:
  std::string dir_, error_;
  bool mounted_ = false;
};

bool any_temporary_left(const std::string& dir) {
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().rfind(".tmp-", 0) == 0) return true;
  return false;
}

}  // namespace

// 12 MB hold one MLP checkpoint with AdamW state (6.4 MB) but not two: the save of step 4 runs
// out of space mid-file.
TEST(TrainerRuns, AFullDiskIsOneLineKeepsThePreviousCheckpointAndIsNotRestarted) {
  lockstep::testing::TempDir temp("fulldisk");
  TmpfsMount disk(temp.path(), "12m");
  if (!disk.ok())
    GTEST_SKIP() << "cannot mount a 12 MB tmpfs on " << temp.path() << " (" << disk.error() << ")";
  const std::string out = temp / "run";
  lockstep::testing::Process run(
      launch(2,
             with(kShortRun, {"--model", "mlp", "--optim", "adamw", "--max-steps", "20", "--save-strategy",
                              "steps", "--save-steps", "2", "--output-dir", out}),
             {"--max-restarts", "2"}));
  EXPECT_EQ(run.wait(180), 3) << run.output();
  const std::string& o = run.output();
  EXPECT_NE(o.find("no space left on the device holding " + out + "/.tmp-checkpoint-4"), std::string::npos)
      << o;
  EXPECT_NE(o.find("checkpoint-2 is intact"), std::string::npos) << o;
  EXPECT_NE(o.find("not restarting: exit code 3"), std::string::npos) << o;
  EXPECT_EQ(lockstep::testing::count_of(o, "job FAILED"), 1u) << o;
  for (const char* noise : {"terminate called", "frame #", "c10::Error", "unexpected pos"})
    EXPECT_EQ(o.find(noise), std::string::npos) << noise << " in:\n" << o;
  EXPECT_FALSE(any_temporary_left(out));
  EXPECT_EQ(latest_checkpoint(out), out + "/checkpoint-2");
  lockstep::testing::Process eval({FASHION_MNIST, "evaluate", "--model", "mlp", "--checkpoint",
                                   out + "/checkpoint-2", "--eval-limit", "100"});
  EXPECT_EQ(eval.wait(60), 0) << eval.output();
}

TEST(TrainerRuns, ADamagedTrainerStateIsOneLineNamingTheFile) {
  lockstep::testing::TempDir temp("damaged");
  const std::string out = temp / "run";
  const auto flags = with(kShortRun, {"--model", "mlp", "--max-steps", "4", "--save-strategy", "steps",
                                      "--save-steps", "4", "--output-dir", out});
  lockstep::testing::Process first(with({FASHION_MNIST}, flags));
  ASSERT_EQ(first.wait(120), 0) << first.output();
  std::ofstream(out + "/checkpoint-4/trainer_state.json") << "{\"global_step\": 4, \"epoch\": ";
  lockstep::testing::Process resume(
      with({FASHION_MNIST}, with(flags, {"--resume-from-checkpoint", "latest"})));
  EXPECT_EQ(resume.wait(120), 2) << resume.output();
  const std::string want = "fashion_mnist: error: " + out + "/checkpoint-4/trainer_state.json";
  EXPECT_NE(resume.output().find(want), std::string::npos) << resume.output();
  EXPECT_NE(resume.output().find("not valid JSON at line 1"), std::string::npos) << resume.output();
  EXPECT_EQ(resume.output().find("json.exception"), std::string::npos) << resume.output();
}

// Every program ends the same way on bad input: one line, exit 2.
TEST(TrainerRuns, ABadFlagIsOneLineAndExitTwo) {
  lockstep::testing::Process bad({FASHION_MNIST, "--per-device-train-batch-size", "0"});
  EXPECT_EQ(bad.wait(60), 2) << bad.output();
  EXPECT_EQ(bad.output(), "fashion_mnist: error: --per-device-train-batch-size must be at least 1 (got 0)\n");
  lockstep::testing::Process unknown({FASHION_MNIST, "--no-such-flag"});
  EXPECT_EQ(unknown.wait(60), 2) << unknown.output();
  EXPECT_EQ(lockstep::testing::count_of(unknown.output(), "\n"), 1u) << unknown.output();
  EXPECT_NE(unknown.output().find("--no-such-flag"), std::string::npos) << unknown.output();
}
