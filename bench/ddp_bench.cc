// Training throughput of one model on Fashion-MNIST-sized inputs (1x28x28, 10 classes), SGD,
// with inputs prepared in memory beforehand so only the training step is measured.
//
//   ddp_bench --model mlp|wide|cnn [--batch 64] [--steps N] [--warmup N] [--threads 1]
//             [--bucket-cap-mb 25] [--comm-hook none|fp16|bf16|powersgd|int8|auto] [--no-sync]
//             [--sync-every K]
//
// Alone, it trains one process without DDP. Under `lockstep run --nproc-per-node N` it wraps
// the model in DistributedDataParallel (--no-sync: every step under no_sync(), the ceiling
// with no communication; --sync-every K: local SGD, DDP over each machine's ranks and the
// machines averaging their models every K steps, ddp/local_sgd.h). Rank 0 prints one JSON line: samples/s over all ranks and the mean
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
#include "lockstep/ddp/local_sgd.h"
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

struct Config {
  std::string model = "mlp", hook = "none", backend = "auto";
  int batch = 64, steps = 60, warmup = 5, threads = 1;
  int powersgd_rounds = 2, sync_every = 1;
  double bucket_cap_mb = 25, first_bucket_cap_mb = 1, slot_mb = 1;
  bool no_sync = false, verify = false, private_buckets = false, timeline = false;
  int crash_rank = -1, crash_step = -1;
};

void add_options(CLI::App& app, Config& c) {
  app.add_option("--model", c.model, "mlp | wide | cnn")->capture_default_str();
  app.add_option("--batch", c.batch, "samples per worker per step")->capture_default_str();
  app.add_option("--steps", c.steps, "measured steps")->capture_default_str();
  app.add_option("--warmup", c.warmup, "unmeasured steps first")->capture_default_str();
  app.add_option("--threads", c.threads, "torch intra-op threads per worker")->capture_default_str();
  app.add_option("--bucket-cap-mb", c.bucket_cap_mb, "DDP bucket cap")->capture_default_str();
  app.add_option("--first-bucket-cap-mb", c.first_bucket_cap_mb, "DDP first bucket cap")
      ->capture_default_str();
  app.add_option("--comm-hook", c.hook, "none | fp16 | bf16 | powersgd | int8 | auto")->capture_default_str();
  app.add_option("--powersgd-rounds", c.powersgd_rounds,
                 "PowerSGD's exchanges per step: 2 (one power iteration), 4, 6 or 1 (sides alternate)")
      ->capture_default_str();
  app.add_option("--backend", c.backend, "shm | gloo | auto")->capture_default_str();
  app.add_option("--shm-slot-mb", c.slot_mb, "shm backend staging slot per rank")->capture_default_str();
  app.add_option("--sync-every", c.sync_every, "local SGD: machines average their models every K steps")
      ->capture_default_str();
  app.add_flag("--no-sync", c.no_sync, "DDP without communication (every step under no_sync)");
  app.add_flag("--private-buckets", c.private_buckets,
               "buckets in private memory, reduced through the shm staging slots (the pre-zero-copy path)");
  app.add_flag("--verify", c.verify, "check that all ranks end with bitwise-equal parameters");
  app.add_option("--crash-rank", c.crash_rank, "this rank kills itself (SIGKILL) ...");
  app.add_option("--crash-step", c.crash_step, "... during the backward of this step (fault tests)");
  app.add_flag("--timeline", c.timeline, "print the last step's bucket timeline per rank to stderr");
}

// The model, and when started as a rank, the job and the DDP wrapper around the model.
struct Side {
  std::shared_ptr<NetImpl> model;
  std::optional<lockstep::comm::Job> job;
  std::unique_ptr<lockstep::comm::Communicator> machine;  // --sync-every: DDP's, inside a machine
  std::optional<lockstep::DistributedDataParallel<NetImpl>> ddp;
  std::optional<lockstep::OuterOptimizer> outer;
  int rank = 0, world = 1;
};

void join(const Config& c, Side& side) {
  if (!lockstep::comm::started_as_rank()) return;
  lockstep::comm::CommOptions options;
  options.backend = c.backend;
  options.shm_slot_bytes = static_cast<std::size_t>(c.slot_mb * (1 << 20));
  side.job = lockstep::comm::join_from_env(options);
  side.rank = side.job->comm->rank();
  side.world = side.job->comm->size();
  lockstep::DdpOptions o;
  o.bucket_cap_mb = c.bucket_cap_mb;
  o.first_bucket_cap_mb = c.first_bucket_cap_mb;
  o.comm_hook = lockstep::parse_comm_hook(c.hook);
  o.compression.powersgd_rounds = c.powersgd_rounds;
  o.shared_buckets = !c.private_buckets;
  lockstep::comm::Communicator* over = side.job->comm.get();
  if (c.sync_every > 1) {
    side.machine = over->machine_communicator();
    over = side.machine.get();
  }
  if (over->size() > 1) side.ddp.emplace(side.model, *over, o);
  if (c.sync_every > 1) side.outer.emplace(*side.model, *side.job->comm, lockstep::OuterOptions{c.sync_every});
}

struct Totals {
  double forward = 0, backward = 0, optimizer = 0, exposed = 0, comm = 0, elapsed = 0;
  std::size_t bytes = 0;
  int buckets = 0, shared = 0;
};

// Warm-up steps, then `steps` measured ones, on a pool of batches made beforehand.
Totals run_steps(const Config& c, Side& side) {
  torch::optim::SGD optimizer(side.model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  torch::manual_seed(100 + side.rank);  // different data on every rank
  const int pool = 8;
  std::vector<torch::Tensor> inputs, labels;
  for (int i = 0; i < pool; ++i) {
    inputs.push_back(torch::rand({c.batch, 1, 28, 28}));
    labels.push_back(torch::randint(0, 10, {c.batch}));
  }
  Totals t;
  Clock::time_point start;
  for (int step = 0; step < c.warmup + c.steps; ++step) {
    if (step == c.warmup) {
      if (side.job) side.job->comm->barrier()->wait();
      start = Clock::now();
      t = Totals{};
    }
    const auto t0 = Clock::now();
    std::optional<lockstep::NoSync> guard;
    if (side.ddp && c.no_sync) guard.emplace(side.ddp->no_sync());
    auto out = side.ddp ? side.ddp->forward(inputs[step % pool]) : side.model->forward(inputs[step % pool]);
    auto loss = torch::cross_entropy_loss(out, labels[step % pool]);
    const auto t1 = Clock::now();
    optimizer.zero_grad();
    if (step == c.crash_step && side.rank == c.crash_rank)  // dies inside backward, buckets in flight
      out.register_hook([](const torch::Tensor&) { std::raise(SIGKILL); });
    loss.backward();
    const auto t2 = Clock::now();
    optimizer.step();
    const auto t3 = Clock::now();
    if (side.outer && side.outer->step()) t.exposed += side.outer->last_seconds();  // the machines met
    t.forward += std::chrono::duration<double>(t1 - t0).count();
    t.backward += std::chrono::duration<double>(t2 - t1).count();
    t.optimizer += std::chrono::duration<double>(t3 - t2).count();
    if (side.ddp && !c.no_sync) {
      const auto& s = side.ddp->stats();
      t.exposed += s.exposed_comm_seconds;
      t.comm += s.comm_seconds;
      t.bytes = s.bytes_allreduced;
      t.buckets = s.bucket_count;
      t.shared = s.shared_buckets;
    }
  }
  if (side.outer) side.outer->synchronize();
  if (side.job) side.job->comm->barrier()->wait();
  t.elapsed = since(start);
  return t;
}

void print_timeline(const Side& side) {
  const auto& s = side.ddp->stats();
  auto ms = [&](lockstep::SteadyTime t) {
    return std::chrono::duration<double, std::milli>(t - s.backward_begin).count();
  };
  std::fprintf(stderr, "rank %d backward 0..%.2f ms, reduced at %.2f\n", side.rank, ms(s.backward_end),
               ms(s.reduced));
  for (auto& b : s.buckets)
    std::fprintf(stderr, "rank %d bucket %d %zu bytes queued %.2f started %.2f finished %.2f\n", side.rank,
                 b.index, b.bytes, ms(b.queued), ms(b.started), ms(b.finished));
}

// Every rank's parameters against rank 0's, bit for bit.
bool parameters_agree(Side& side) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> flat;
  for (auto& p : side.model->parameters()) flat.push_back(p.reshape(-1));
  auto mine = torch::cat(flat);
  auto root = mine.clone();
  side.job->comm
      ->broadcast(root.data_ptr(), static_cast<std::size_t>(root.numel()), lockstep::comm::DType::f32, 0)
      ->wait();
  return torch::equal(mine, root);
}

void print_json(const Config& c, const Side& side, const Totals& t) {
  const double n = c.steps;
  std::printf(
      "{\"model\": \"%s\", \"world\": %d, \"batch\": %d, \"threads\": %d, \"ddp\": %s, \"no_sync\": %s, "
      "\"comm_hook\": \"%s\", \"sync_every\": %d, \"bucket_cap_mb\": %g, \"samples_per_s\": %.1f, \"step_s\": %.6f, "
      "\"forward_s\": %.6f, \"backward_s\": %.6f, \"optimizer_s\": %.6f, \"exposed_comm_s\": %.6f, "
      "\"comm_s\": %.6f, \"bytes_per_step\": %zu, \"buckets\": %d, \"shared_buckets\": %d}\n",
      c.model.c_str(), side.world, c.batch, c.threads, side.ddp ? "true" : "false",
      c.no_sync ? "true" : "false", c.hook.c_str(), c.sync_every, c.bucket_cap_mb, c.batch * side.world * n / t.elapsed,
      t.elapsed / n, t.forward / n, t.backward / n, t.optimizer / n, t.exposed / n, t.comm / n, t.bytes,
      t.buckets, t.shared);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"DDP training throughput on Fashion-MNIST-sized inputs"};
  Config config;
  add_options(app, config);
  CLI11_PARSE(app, argc, argv);
  return lockstep::run_main(argc, argv, [&] {
    torch::set_num_threads(config.threads);
    torch::manual_seed(1);
    Side side;
    side.model = std::make_shared<NetImpl>(widths_of(config.model));
    join(config, side);
    const Totals totals = run_steps(config, side);
    if (side.ddp && config.timeline) print_timeline(side);
    if (config.verify && side.job && !parameters_agree(side)) {
      std::fprintf(stderr, "rank %d: parameters differ from rank 0's\n", side.rank);
      return 3;
    }
    if (side.rank == 0) print_json(config, side, totals);
    return 0;
  });
}
