// A Trainer program for the elastic tests: the Fashion-MNIST MLP (784-256-10, no dropout, so a
// run's result depends only on its data and its arithmetic), with every sample it trains on
// recorded.
//
//   elastic_trainer_worker --record-dir DIR [Trainer flags...]
//
// --batch-delay-ms paces the run (each batch loads that much slower), so that a worker started
// mid-run still finds steps to join.
// Writes DIR/<pid>.samples, one line per event, flushed as it goes (a killed worker's file is
// complete up to its death):
//   begin S membership M   it starts training after step S (0, or the step it joined at) in M
//   get I J K ...          the dataset indices of one batch it loaded
//   step S membership M    it completed optimiser step S in membership M
//   change S membership M  the membership changed to M, training going on after step S: the
//                          batches loaded since its last step count for the step after that one
//                          only if the others completed it (then S is that step)
// and, on rank 0 at the end, the final parameters to DIR/final.pt. With --eval-limit N it evaluates
// on the first N test images (for --eval-strategy) and at the end writes OUTPUT_DIR/eval_results.json.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <thread>

#include "lockstep/base/main.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train/datasets.h"
#include "lockstep/train/trainer.h"

using namespace lockstep::train;

namespace {

struct MlpImpl : torch::nn::Module {
  MlpImpl() : fc1(register_module("fc1", torch::nn::Linear(784, 256))), fc2(register_module("fc2", torch::nn::Linear(256, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x.flatten(1)))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Mlp);

// One file per process; the loader's threads and the training thread write to it.
class Record {
 public:
  explicit Record(const std::string& path) : out_(path, std::ios::app) {}
  void line(const std::string& text) {
    std::lock_guard<std::mutex> lock(mu_);
    out_ << text << "\n" << std::flush;
  }

 private:
  std::mutex mu_;
  std::ofstream out_;
};

class RecordingDataset : public Dataset {
 public:
  RecordingDataset(std::shared_ptr<const Dataset> inner, std::shared_ptr<Record> record, int delay_ms)
      : inner_(std::move(inner)), record_(std::move(record)), delay_ms_(delay_ms) {}
  std::size_t size() const override { return inner_->size(); }
  Batch get(const std::vector<std::size_t>& indices) const override {
    if (delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));  // pacing the load
    std::string text = "get";
    for (auto i : indices) text += " " + std::to_string(i);
    record_->line(text);
    return inner_->get(indices);
  }

 private:
  std::shared_ptr<const Dataset> inner_;
  std::shared_ptr<Record> record_;
  int delay_ms_;
};

class RecordSteps : public TrainerCallback {
 public:
  explicit RecordSteps(std::shared_ptr<Record> record) : record_(std::move(record)) {}
  void on_train_begin(const TrainerState& s) override {
    record_->line("begin " + std::to_string(s.global_step) + " membership " + std::to_string(s.membership));
  }
  void on_step_end(const TrainerState& s, TrainerControl&) override {
    record_->line("step " + std::to_string(s.global_step) + " membership " + std::to_string(s.membership));
  }
  // A change of membership abandons the step in progress: what it loaded was not trained on.
  void on_log(const TrainerState&, const nlohmann::json& entry) override {
    if (entry.value("event", "") == "membership_change")
      record_->line("change " + std::to_string(entry.at("step").get<std::int64_t>()) + " membership " +
                    std::to_string(entry.at("membership").get<std::int64_t>()));
  }

 private:
  std::shared_ptr<Record> record_;
};

int run(int argc, char** argv) {
  std::string record_dir;
  std::size_t train_limit = 1920, eval_limit = 0;
  int delay_ms = 0;
  TrainingArguments defaults;
  defaults.save_strategy = "no";
  defaults.eval_strategy = "no";
  defaults.disable_tqdm = true;
  const TrainingArguments args = parse_arguments(
      argc, argv,
      [&](CLI::App& app) {
        app.add_option("--record-dir", record_dir, "where each process records its samples")->required();
        app.add_option("--train-limit", train_limit, "the first N training images")->capture_default_str();
        app.add_option("--batch-delay-ms", delay_ms, "load each batch this much slower (paces the run)");
        app.add_option("--eval-limit", eval_limit, "evaluate on the first N test images (0: no eval set)");
      },
      "elastic_trainer_worker: the elastic tests' Trainer program", defaults);
  set_seed(args.seed);
  auto record = std::make_shared<Record>(record_dir + "/" + std::to_string(::getpid()) + ".samples");
  auto images = std::make_shared<FashionMnistDataset>(lockstep::data::FashionMnist::Split::train,
                                                      lockstep::data::kFashionMnistDir, train_limit);
  std::shared_ptr<const Dataset> tests;
  if (eval_limit > 0)
    tests = std::make_shared<FashionMnistDataset>(lockstep::data::FashionMnist::Split::test,
                                                  lockstep::data::kFashionMnistDir, eval_limit);
  auto model_ptr = Mlp().ptr();
  Trainer trainer(Model::of(model_ptr), std::make_shared<RecordingDataset>(images, record, delay_ms), tests, args,
                  {std::make_shared<RecordSteps>(record)});
  const TrainResult result = trainer.train();
  if (tests) {
    nlohmann::json metrics = trainer.evaluate();
    metrics["global_step"] = result.global_step;
    trainer.save_metrics("eval", metrics);
  }
  if (trainer.communicator().rank() == 0) save_module(*model_ptr, record_dir + "/final.pt");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return lockstep::run_main(argc, argv, [&] { return run(argc, argv); });
}
