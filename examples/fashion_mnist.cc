// Fashion-MNIST on N workers with the Trainer: the demo's job (scripts/demo).
//
//   lockstep run --nproc-per-node 2 build/examples/fashion_mnist --model cnn --output-dir runs/demo
//   build/examples/fashion_mnist evaluate --model cnn --checkpoint runs/demo/checkpoint-2345
//   build/examples/fashion_mnist predict --model cnn --checkpoint runs/demo/checkpoint-2345 --index 0 1 2
//
// `train` (the default) accepts every Trainer flag (--help lists them); `evaluate` and `predict`
// load a checkpoint into a plain model in one process, without the launcher or DDP.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include "lockstep/base/knobs.h"
#include "lockstep/base/main.h"
#include "lockstep/ddp/sync_batchnorm.h"
#include "lockstep/error.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train/datasets.h"
#include "lockstep/train/device.h"
#include "lockstep/train/trainer.h"

using lockstep::data::FashionMnist;
using namespace lockstep::train;

// Under --zero-stage 3 a layer's parameters are gathered only while it runs: the models name
// their large layers as units and run them through the runner (lockstep/ddp/parameter_units.h).
using lockstep::run_unit;
using lockstep::UnitRunner;
using Units = std::vector<std::shared_ptr<torch::nn::Module>>;

// 784-512-256-10 with ReLU.
struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(784, 512))),
        fc2(register_module("fc2", torch::nn::Linear(512, 256))),
        fc3(register_module("fc3", torch::nn::Linear(256, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = run_unit(runner, 0, [&](const torch::Tensor& in) { return torch::relu(fc1(in.flatten(1))); }, x);
    h = run_unit(runner, 1, [&](const torch::Tensor& in) { return torch::relu(fc2(in)); }, h);
    return fc3(h);
  }
  Units parameter_units() { return {fc1.ptr(), fc2.ptr()}; }
  void set_unit_runner(UnitRunner r) { runner = std::move(r); }
  torch::nn::Linear fc1, fc2, fc3;
  UnitRunner runner;
};
TORCH_MODULE(Mlp);

// Two 3x3 convolutions (16 and 32 channels) with batch norm and 2x2 pooling, then 1568-128-10:
// about 2,100 samples/s per core here, and above 0.91 test accuracy in 4-5 epochs. The norm is
// lockstep::SyncBatchNorm: BatchNorm2d per worker, or over the global batch under --sync-batchnorm.
struct CnnImpl : torch::nn::Module {
  CnnImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)))),
        bn1(register_module("bn1", lockstep::SyncBatchNorm(16))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).padding(1)))),
        bn2(register_module("bn2", lockstep::SyncBatchNorm(32))),
        fc1(register_module("fc1", torch::nn::Linear(32 * 7 * 7, 128))),
        fc2(register_module("fc2", torch::nn::Linear(128, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::max_pool2d(torch::relu(bn1(conv1(x))), 2);
    h = torch::max_pool2d(torch::relu(bn2(conv2(h))), 2);
    h = run_unit(runner, 0, [&](const torch::Tensor& in) { return torch::relu(fc1(in.flatten(1))); }, h);
    return fc2(h);
  }
  Units parameter_units() { return {fc1.ptr()}; }  // 200,000 of its 206,000 parameters
  void set_unit_runner(UnitRunner r) { runner = std::move(r); }
  torch::nn::Conv2d conv1;
  lockstep::SyncBatchNorm bn1;
  torch::nn::Conv2d conv2;
  lockstep::SyncBatchNorm bn2;
  torch::nn::Linear fc1, fc2;
  UnitRunner runner;
};
TORCH_MODULE(Cnn);

// 784-2048-2048-2048-10 (12.6 M parameters, 50 MB of gradients per step): communication weighs
// much more than in the other two, which is what `lockstep doctor` demonstrations need.
struct WideImpl : torch::nn::Module {
  WideImpl() {
    int in = 784;
    for (int i = 0; i < 3; ++i, in = 2048)
      layers.push_back(register_module("fc" + std::to_string(i + 1), torch::nn::Linear(in, 2048)));
    head = register_module("head", torch::nn::Linear(2048, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = x.flatten(1);
    for (std::size_t i = 0; i < layers.size(); ++i)
      h = run_unit(runner, int(i), [&](const torch::Tensor& in) { return torch::relu(layers[i](in)); }, h);
    return head(h);
  }
  Units parameter_units() { return {layers[0].ptr(), layers[1].ptr(), layers[2].ptr()}; }
  void set_unit_runner(UnitRunner r) { runner = std::move(r); }
  std::vector<torch::nn::Linear> layers;
  torch::nn::Linear head{nullptr};
  UnitRunner runner;
};
TORCH_MODULE(Wide);

static Model make_model(const std::string& name) {
  if (name == "mlp") return Model::of(Mlp());
  if (name == "cnn") return Model::of(Cnn());
  if (name == "wide") return Model::of(Wide());
  throw lockstep::ConfigError("--model must be mlp, cnn or wide (got '" + name + "')");
}

// A dataset that takes `delay` longer per batch than it needs: starves the workers on purpose.
class SlowDataset : public Dataset {
 public:
  SlowDataset(std::shared_ptr<const Dataset> inner, int delay_ms)
      : inner_(std::move(inner)), delay_ms_(delay_ms) {}
  std::size_t size() const override { return inner_->size(); }
  Batch get(const std::vector<std::size_t>& indices) const override {
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));  // simulated slow storage or decoding
    return inner_->get(indices);
  }

 private:
  std::shared_ptr<const Dataset> inner_;
  int delay_ms_;
};

static int train(int argc, const char* const* argv) {
  std::string model_name = "cnn", data_dir = lockstep::data::kFashionMnistDir;
  std::size_t train_limit = 0, eval_limit = 0;
  int data_delay_ms = 0, data_delay_rank = -1;
  TrainingArguments defaults;  // what works for this job; every flag overrides
  defaults.output_dir = "runs/fashion_mnist";
  defaults.num_train_epochs = 5;
  defaults.learning_rate = 2e-3;
  defaults.lr_scheduler_type = "cosine";
  defaults.weight_decay = 0.01;
  defaults.logging_steps = 100;
  defaults.eval_strategy = "epoch";
  defaults.metric_for_best_model = "eval_accuracy";
  TrainingArguments args = parse_arguments(
      argc, argv,
      [&](CLI::App& app) {
        app.add_option("--model", model_name, "mlp | cnn | wide")->capture_default_str();
        app.add_option("--data-delay-ms", data_delay_ms,
                       "make every training batch this much slower to load (demo)");
        app.add_option("--data-delay-rank", data_delay_rank,
                       "slow only this rank's batches (-1: every rank's): a straggler (demo)");
        app.add_option("--data-dir", data_dir, "directory of the Fashion-MNIST IDX files")
            ->capture_default_str();
        app.add_option("--train-limit", train_limit, "use only the first N training images (0: all)");
        app.add_option("--eval-limit", eval_limit, "use only the first N test images (0: all)");
      },
      "fashion_mnist train: a classifier on Fashion-MNIST with the lockstep Trainer", defaults);
  set_seed(args.seed);  // the same initial weights on every rank and every run
  Model model = make_model(model_name);
  std::shared_ptr<const Dataset> train_set =
      std::make_shared<FashionMnistDataset>(FashionMnist::Split::train, data_dir, train_limit);
  const int rank = std::stoi(lockstep::knobs::get(lockstep::knobs::kRank).value_or("0"));
  if (data_delay_ms > 0 && (data_delay_rank < 0 || data_delay_rank == rank))
    train_set = std::make_shared<SlowDataset>(train_set, data_delay_ms);
  auto test_set = std::make_shared<FashionMnistDataset>(FashionMnist::Split::test, data_dir, eval_limit);
  Trainer trainer(model, train_set, test_set, args);
  TrainResult result = trainer.train();
  nlohmann::json m = trainer.evaluate();
  // Every rank names the same checkpoint (the output directory is shared in a job of several
  // machines), so that whichever rank 0 is left in an elastic job writes the same results.
  std::string checkpoint = latest_checkpoint(args.output_dir);
  if (args.load_best_model_at_end && !trainer.state().best_checkpoint.empty())
    checkpoint = (std::filesystem::path(args.output_dir) / trainer.state().best_checkpoint).string();
  m["checkpoint"] = checkpoint;
  m["model"] = model_name;
  m["train_seconds"] = result.seconds;
  m["global_step"] = result.global_step;
  trainer.save_metrics("eval", m);  // OUTPUT_DIR/eval_results.json
  if (trainer.communicator().rank() == 0) {
    std::printf(
        "trained %lld steps in %.1f s (%.0f samples/s); test accuracy %.4f on %lld images, loss %.4f\n",
        static_cast<long long>(result.global_step), result.seconds, result.samples_per_second,
        m["eval_accuracy"].get<double>(), static_cast<long long>(m["eval_samples"].get<std::int64_t>()),
        m["eval_loss"].get<double>());
    if (!checkpoint.empty())
      std::printf("saved %s; reload it in one process with:\n  %s evaluate --model %s --checkpoint %s\n",
                  checkpoint.c_str(), argv[0], model_name.c_str(), checkpoint.c_str());
  }
  return 0;
}

// Loads a checkpoint into a plain (not distributed) model, on `device`.
static Model load_plain(const std::string& model_name, const std::string& checkpoint, const torch::Device& device) {
  Model model = make_model(model_name);
  std::filesystem::path file = checkpoint;
  if (std::filesystem::is_directory(file)) file /= "model.pt";
  load_module(*model.module, file.string());
  model.module->to(device);
  model.module->eval();
  return model;
}

static void add_device_option(CLI::App& app, std::string& device) {
  app.add_option("--device", device, "cpu | cuda (the GPU of LOCAL_RANK) | auto, as the Trainer's")
      ->capture_default_str();
}

static int evaluate(int argc, const char* const* argv) {
  CLI::App app{"fashion_mnist evaluate: test accuracy of a checkpoint, in one process"};
  std::string model_name = "cnn", checkpoint, data_dir = lockstep::data::kFashionMnistDir;
  std::size_t limit = 0;
  app.add_option("--model", model_name, "mlp | cnn | wide")->capture_default_str();
  app.add_option("--checkpoint", checkpoint, "a checkpoint directory (or its model.pt)")->required();
  app.add_option("--data-dir", data_dir, "directory of the Fashion-MNIST IDX files")->capture_default_str();
  app.add_option("--eval-limit", limit, "use only the first N test images (0: all)");
  std::string device_choice = "cpu";
  add_device_option(app, device_choice);
  parse_command_line(app, argc, argv);
  const torch::Device device = training_device(device_choice, local_rank());
  Model model = load_plain(model_name, checkpoint, device);
  FashionMnistDataset test(FashionMnist::Split::test, data_dir, limit);
  torch::NoGradGuard no_grad;
  std::int64_t correct = 0;
  double loss = 0;
  for (std::size_t start = 0; start < test.size(); start += 500) {
    std::vector<std::size_t> idx;
    for (std::size_t i = start; i < std::min(test.size(), start + 500); ++i) idx.push_back(i);
    Batch b = test.get(idx);
    auto out = model.forward(b.input.to(device));
    const auto target = b.target.to(device);
    loss += torch::nn::functional::cross_entropy(out, target).item<double>() * static_cast<double>(idx.size());
    correct += out.argmax(1).eq(target).sum().item<std::int64_t>();
  }
  std::printf("test accuracy %.4f on %zu images, loss %.4f (%s, one process on %s)\n",
              static_cast<double>(correct) / static_cast<double>(test.size()), test.size(),
              loss / static_cast<double>(test.size()), checkpoint.c_str(), device.str().c_str());
  return 0;
}

static int predict(int argc, const char* const* argv) {
  CLI::App app{"fashion_mnist predict: classify test images with a checkpoint"};
  std::string model_name = "cnn", checkpoint, data_dir = lockstep::data::kFashionMnistDir;
  std::vector<std::size_t> indices = {0, 1, 2, 3, 4};
  app.add_option("--model", model_name, "mlp | cnn | wide")->capture_default_str();
  app.add_option("--checkpoint", checkpoint, "a checkpoint directory (or its model.pt)")->required();
  app.add_option("--data-dir", data_dir, "directory of the Fashion-MNIST IDX files")->capture_default_str();
  app.add_option("--index", indices, "test images to classify")->capture_default_str();
  std::string device_choice = "cpu";
  add_device_option(app, device_choice);
  parse_command_line(app, argc, argv);
  const torch::Device device = training_device(device_choice, local_rank());
  Model model = load_plain(model_name, checkpoint, device);
  FashionMnistDataset test(FashionMnist::Split::test, data_dir);
  torch::NoGradGuard no_grad;
  Batch b = test.get(indices);
  auto probs = torch::softmax(model.forward(b.input.to(device)), 1).to(torch::kCPU);
  for (std::size_t i = 0; i < indices.size(); ++i) {
    auto row = probs[static_cast<std::int64_t>(i)];
    int guess = static_cast<int>(row.argmax().item<std::int64_t>());
    int truth = static_cast<int>(b.target[static_cast<std::int64_t>(i)].item<std::int64_t>());
    std::printf("image %zu: %-11s (%.1f%%)  truth: %-11s %s\n", indices[i], FashionMnist::class_name(guess),
                100.0 * row[guess].item<double>(), FashionMnist::class_name(truth),
                guess == truth ? "" : "<- wrong");
  }
  return 0;
}

int main(int argc, char** argv) {
  return lockstep::run_main(argc, argv, [&] {
    const std::string command = argc > 1 && argv[1][0] != '-' ? argv[1] : "";
    if (command == "evaluate") return evaluate(argc - 1, argv + 1);
    if (command == "predict") return predict(argc - 1, argv + 1);
    if (command == "train") return train(argc - 1, argv + 1);
    if (!command.empty())
      throw lockstep::ConfigError("unknown command '" + command + "': use train, evaluate or predict");
    return train(argc, argv);
  });
}
