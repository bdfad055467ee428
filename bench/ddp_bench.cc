// Training throughput of one model on Fashion-MNIST-sized inputs (1x28x28, 10 classes), SGD,
// with inputs prepared in memory beforehand so only the training step is measured.
//
//   ddp_bench --model mlp|wide|cnn [--batch 64] [--steps N] [--warmup N] [--threads 1]
//             [--bucket-cap-mb 25] [--comm-hook none|fp16|bf16] [--no-sync]
//
// Alone, it trains one process without DDP. Under `lockstep run --nproc-per-node N` it wraps
// the model in DistributedDataParallel (--no-sync: every step under no_sync(), the ceiling
// with no communication). Rank 0 prints one JSON line: samples/s over all ranks and the mean
// per-step breakdown (forward, backward, exposed communication, optimizer).
//
// --crash-rank/--crash-step make one rank die mid-backward, for the fault tests.
// --timeline prints the last step's bucket timeline per rank to stderr (queued,
// started, finished, relative to backward's start): where exposed communication comes from.
// With --verify, every rank also checks that all ranks end with bitwise-equal parameters and
// exits 3 if not (the launcher tests use it as a real multi-process DDP run).
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <optional>

#include "lockstep/base/main.h"
#include "lockstep/comm/rendezvous.h"
#include "lockstep/ddp/ddp.h"
#include "lockstep/error.h"

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The benchmark's models: MLPs of the given widths, or (widths empty) the Fashion-MNIST example's
// CNN: 3x3 convolutions of 16 and 32 channels with batch norm and 2x2 pooling, then 1568-128-10.
struct NetImpl : torch::nn::Module {
  explicit NetImpl(const std::vector<int>& widths) {
    if (widths.empty()) {
      conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)));
      bn1 = register_module("bn1", torch::nn::BatchNorm2d(16));
      conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).padding(1)));
      bn2 = register_module("bn2", torch::nn::BatchNorm2d(32));
      layers.push_back(register_module("fc1", torch::nn::Linear(32 * 7 * 7, 128)));
      layers.push_back(register_module("fc2", torch::nn::Linear(128, 10)));
      return;
    }
    for (std::size_t i = 0; i + 1 < widths.size(); ++i) {
      layers.push_back(
          register_module("fc" + std::to_string(i + 1), torch::nn::Linear(widths[i], widths[i + 1])));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    if (conv1) {
      x = torch::max_pool2d(torch::relu(bn1(conv1(x))), 2);
      x = torch::max_pool2d(torch::relu(bn2(conv2(x))), 2);
    }
    x = x.flatten(1);
    for (std::size_t i = 0; i < layers.size(); ++i) {
      x = layers[i]->forward(x);
      if (i + 1 < layers.size()) x = torch::relu(x);
    }
    return x;
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  std::vector<torch::nn::Linear> layers;
};

std::vector<int> widths_of(const std::string& model) {
  if (model == "mlp") return {784, 1024, 1024, 10};
  if (model == "wide") return {784, 2048, 2048, 2048, 10};
  if (model == "cnn") return {};
  throw lockstep::ConfigError("unknown --model '" + model +
                              "': use mlp (784-1024-1024-10), wide (784-2048x3-10) or cnn");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"DDP training throughput on Fashion-MNIST-sized inputs"};
  std::string model_name = "mlp", hook = "none", backend = "auto";
  int batch = 64, steps = 60, warmup = 5, threads = 1;
  double bucket_cap_mb = 25;
  bool no_sync = false, verify = false, private_buckets = false;
  app.add_option("--model", model_name, "mlp | wide | cnn")->capture_default_str();
  app.add_option("--batch", batch, "samples per worker per step")->capture_default_str();
  app.add_option("--steps", steps, "measured steps")->capture_default_str();
  app.add_option("--warmup", warmup, "unmeasured steps first")->capture_default_str();
  app.add_option("--threads", threads, "torch intra-op threads per worker")->capture_default_str();
  app.add_option("--bucket-cap-mb", bucket_cap_mb, "DDP bucket cap")->capture_default_str();
  double first_bucket_cap_mb = 1;
  app.add_option("--first-bucket-cap-mb", first_bucket_cap_mb, "DDP first bucket cap")->capture_default_str();
  app.add_option("--comm-hook", hook, "none | fp16 | bf16")->capture_default_str();
  app.add_option("--backend", backend, "shm | gloo | auto")->capture_default_str();
  double slot_mb = 1;
  app.add_option("--shm-slot-mb", slot_mb, "shm backend staging slot per rank")->capture_default_str();
  app.add_flag("--no-sync", no_sync, "DDP without communication (every step under no_sync)");
  app.add_flag("--private-buckets", private_buckets,
               "buckets in private memory, reduced through the shm staging slots (the pre-zero-copy path)");
  app.add_flag("--verify", verify, "check that all ranks end with bitwise-equal parameters");
  int crash_rank = -1, crash_step = -1;
  app.add_option("--crash-rank", crash_rank, "this rank kills itself (SIGKILL) ...");
  app.add_option("--crash-step", crash_step, "... during the backward of this step (fault tests)");
  bool timeline = false;
  app.add_flag("--timeline", timeline, "print the last step's bucket timeline per rank to stderr");
  CLI11_PARSE(app, argc, argv);

  return lockstep::run_main(argc, argv, [&] {
    torch::set_num_threads(threads);
    torch::manual_seed(1);
    auto model = std::make_shared<NetImpl>(widths_of(model_name));
    std::optional<lockstep::comm::Job> job;
    std::optional<lockstep::DistributedDataParallel<NetImpl>> ddp;
    int rank = 0, world = 1;
    if (lockstep::comm::started_as_rank()) {
      lockstep::comm::CommOptions options;
      options.backend = backend;
      options.shm_slot_bytes = std::size_t(slot_mb * (1 << 20));
      job = lockstep::comm::join_from_env(options);
      rank = job->comm->rank();
      world = job->comm->size();
      lockstep::DdpOptions o;
      o.bucket_cap_mb = bucket_cap_mb;
      o.first_bucket_cap_mb = first_bucket_cap_mb;
      o.comm_hook = lockstep::parse_comm_hook(hook);
      o.shared_buckets = !private_buckets;
      ddp.emplace(model, *job->comm, o);
    }
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    // A pool of batches, different per rank, made before timing starts.
    torch::manual_seed(100 + rank);
    const int pool = 8;
    std::vector<torch::Tensor> inputs, labels;
    for (int i = 0; i < pool; ++i) {
      inputs.push_back(torch::rand({batch, 1, 28, 28}));
      labels.push_back(torch::randint(0, 10, {batch}));
    }

    double forward_s = 0, backward_s = 0, optimizer_s = 0, exposed_s = 0, comm_s = 0;
    std::size_t bytes = 0;
    int buckets = 0, shared = 0;
    Clock::time_point start;
    for (int step = 0; step < warmup + steps; ++step) {
      if (step == warmup) {
        if (job) job->comm->barrier()->wait();
        start = Clock::now();
        forward_s = backward_s = optimizer_s = exposed_s = comm_s = 0;
      }
      auto& x = inputs[step % pool];
      auto& y = labels[step % pool];
      auto t0 = Clock::now();
      std::optional<lockstep::NoSync> guard;
      if (ddp && no_sync) guard.emplace(ddp->no_sync());
      auto out = ddp ? ddp->forward(x) : model->forward(x);
      auto loss = torch::cross_entropy_loss(out, y);
      auto t1 = Clock::now();
      optimizer.zero_grad();
      if (step == crash_step && rank == crash_rank) {
        // Dies inside backward, once the first bucket has been handed to the communicator.
        out.register_hook([](const torch::Tensor&) { std::raise(SIGKILL); });
      }
      loss.backward();
      auto t2 = Clock::now();
      optimizer.step();
      auto t3 = Clock::now();
      forward_s += std::chrono::duration<double>(t1 - t0).count();
      backward_s += std::chrono::duration<double>(t2 - t1).count();
      optimizer_s += std::chrono::duration<double>(t3 - t2).count();
      if (ddp && !no_sync) {
        auto& s = ddp->stats();
        exposed_s += s.exposed_comm_seconds;
        comm_s += s.comm_seconds;
        bytes = s.bytes_allreduced;
        buckets = s.bucket_count;
        shared = s.shared_buckets;
      }
    }
    if (job) job->comm->barrier()->wait();
    double elapsed = since(start);
    if (ddp && timeline) {
      auto& s = ddp->stats();
      auto ms = [&](lockstep::SteadyTime t) {
        return std::chrono::duration<double, std::milli>(t - s.backward_begin).count();
      };
      std::fprintf(stderr, "rank %d backward 0..%.2f ms, reduced at %.2f\n", rank, ms(s.backward_end),
                   ms(s.reduced));
      for (auto& b : s.buckets)
        std::fprintf(stderr, "rank %d bucket %d %zu bytes queued %.2f started %.2f finished %.2f\n", rank,
                     b.index, b.bytes, ms(b.queued), ms(b.started), ms(b.finished));
    }

    if (verify && job) {
      // Every rank's parameters against rank 0's, bit for bit.
      torch::NoGradGuard no_grad;
      std::vector<torch::Tensor> flat;
      for (auto& p : model->parameters()) flat.push_back(p.reshape(-1));
      auto mine = torch::cat(flat);
      auto root = mine.clone();
      job->comm->broadcast(root.data_ptr(), root.numel(), lockstep::comm::DType::f32, 0)->wait();
      if (!torch::equal(mine, root)) {
        std::fprintf(stderr, "rank %d: parameters differ from rank 0's\n", rank);
        return 3;
      }
    }
    if (rank == 0) {
      double n = steps;
      std::printf(
          "{\"model\": \"%s\", \"world\": %d, \"batch\": %d, \"threads\": %d, \"ddp\": %s, \"no_sync\": %s, "
          "\"comm_hook\": \"%s\", \"bucket_cap_mb\": %g, \"samples_per_s\": %.1f, \"step_s\": %.6f, "
          "\"forward_s\": %.6f, \"backward_s\": %.6f, \"optimizer_s\": %.6f, \"exposed_comm_s\": %.6f, "
          "\"comm_s\": %.6f, \"bytes_per_step\": %zu, \"buckets\": %d, \"shared_buckets\": %d}\n",
          model_name.c_str(), world, batch, threads, ddp ? "true" : "false", no_sync ? "true" : "false",
          hook.c_str(), bucket_cap_mb, batch * world * n / elapsed, elapsed / n, forward_s / n,
          backward_s / n, optimizer_s / n, exposed_s / n, comm_s / n, bytes, buckets, shared);
    }
    return 0;
  });
}
