// Elastic jobs of the tests' Trainer program (elastic_trainer_worker.cc) on this machine, and what
// they leave: the final parameters, the membership changes.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/comm/store.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train_core/metrics.h"
#include "testing.h"

namespace lockstep::testing {

struct MlpImpl : torch::nn::Module {
  MlpImpl() : fc1(register_module("fc1", torch::nn::Linear(784, 256))), fc2(register_module("fc2", torch::nn::Linear(256, 10))) {}
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Mlp);

constexpr std::size_t kSamples = 1920;  // 20 steps of 96 per epoch

inline int free_port() {
  comm::StoreServer probe(comm::StoreServerOptions{"127.0.0.1", 0, ""});
  return probe.port();
}

// An elastic job of `workers` on this machine; extra environment (fault injection) in `env`, extra
// Trainer flags in `flags` (the learning rate is 1e-3 unless they name one).
inline std::unique_ptr<Process> elastic_run(const std::string& dir, int workers, int per_device, int steps,
                                            const std::map<std::string, std::string>& env = {},
                                            const std::vector<std::string>& flags = {}) {
  std::filesystem::create_directories(dir);
  auto environment = env;
  environment["LOCKSTEP_ELASTIC_CHECK"] = "0.05";
  std::vector<std::string> argv{LOCKSTEP_BINARY, "run", "--nnodes", "1:1", "--nproc-per-node",
                                std::to_string(workers), "--master-port", std::to_string(free_port()),
                                "--max-restarts", "3", ELASTIC_WORKER, "--record-dir", dir,
                                "--per-device-train-batch-size", std::to_string(per_device), "--max-steps",
                                std::to_string(steps), "--logging-steps", "5",
                                "--batch-delay-ms", "20", "--output-dir", dir + "/out"};
  if (std::find(flags.begin(), flags.end(), "--learning-rate") == flags.end())
    argv.insert(argv.end(), {"--learning-rate", "1e-3"});
  argv.insert(argv.end(), flags.begin(), flags.end());
  return std::make_unique<Process>(argv, environment);
}

// The parameters in a model file (final.pt, or a checkpoint's model.pt).
inline std::vector<torch::Tensor> parameters_in(const std::string& file) {
  Mlp m;
  train::load_module(*m, file);
  std::vector<torch::Tensor> p;
  for (auto& t : m->parameters()) p.push_back(t.detach().clone());
  return p;
}

inline std::vector<torch::Tensor> final_parameters(const std::string& dir) {
  return parameters_in(dir + "/final.pt");
}

inline double max_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double d = 0;
  for (std::size_t i = 0; i < a.size(); ++i) d = std::max(d, (a[i] - b[i]).abs().max().item<double>());
  return d;
}

inline std::vector<train::metrics::MembershipChangeLog> changes(const std::string& dir) {
  std::vector<train::metrics::MembershipChangeLog> out;
  for (const auto& seg : train::metrics::read_metrics(dir + "/out/metrics.jsonl"))
    out.insert(out.end(), seg.membership_changes.begin(), seg.membership_changes.end());
  return out;
}

}  // namespace lockstep::testing
