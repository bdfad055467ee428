// ZeRO stage 3 across machines for real (network namespaces, testing/cluster.h): with one copy
// of the gathered units per machine it trains like DDP on 2 machines x 2 workers, and a model
// whose training state does not fit one machine trains across two, in memory cgroups that
// DDP and stage 2 outgrow; its sharded checkpoints move between 2 x 2 under stage 3 and one
// machine of 3 under DDP. Skipped, saying why, where namespaces or cgroups cannot be made.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>

#include "cgroup.h"
#include "cluster.h"
#include "metrics_file.h"
#include "testing.h"

namespace fs = std::filesystem;

namespace lockstep::testing {
namespace {

#define REQUIRE_CLUSTER() \
  if (auto why = VirtualCluster::unavailable()) GTEST_SKIP() << *why;

constexpr int kPort = 29400;

// One `lockstep run` per machine, each in its own cgroup when `limits` has one for it.
std::vector<std::unique_ptr<Process>> launch(const VirtualCluster& cluster, const std::vector<std::string>& program,
                                             const std::vector<Cgroup>* limits = nullptr) {
  std::vector<std::unique_ptr<Process>> nodes;
  for (int m = 0; m < cluster.machines(); ++m) {
    std::vector<std::string> argv = {LOCKSTEP_BINARY, "run",           "--nnodes",        "2",
                                     "--node-rank",   std::to_string(m), "--nproc-per-node", "2",
                                     "--master-addr", cluster.address(0), "--master-port",   std::to_string(kPort)};
    argv.insert(argv.end(), program.begin(), program.end());
    argv = cluster.on(m, argv);
    // Into the cgroup before entering the machine: `ip netns exec` mounts a /sys of its own.
    if (limits) argv = (*limits)[std::size_t(m)].around(argv);
    nodes.push_back(std::make_unique<Process>(argv, std::map<std::string, std::string>{
                                                        {"LOCKSTEP_TOKEN", "zero3"}, {"OMP_NUM_THREADS", "1"}}));
  }
  return nodes;
}

std::vector<torch::Tensor> mlp_parameters(const std::string& checkpoint) {
  torch::serialize::InputArchive archive;
  archive.load_from(checkpoint + "/model.pt");
  std::vector<torch::Tensor> out;
  for (const char* layer : {"fc1", "fc2", "fc3"}) {
    torch::serialize::InputArchive sub;
    archive.read(layer, sub);
    for (const char* name : {"weight", "bias"}) {
      torch::Tensor t;
      sub.read(name, t);
      out.push_back(t);
    }
  }
  return out;
}

double max_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  return worst;
}

std::vector<std::string> mlp_job(const std::string& out, const std::vector<std::string>& more) {
  std::vector<std::string> argv = {FASHION_MNIST,   "--model",         "mlp",       "--train-limit",   "2048",
                                   "--eval-limit",  "200",             "--disable-tqdm", "--max-steps", "10",
                                   "--save-strategy", "steps",         "--save-steps", "5",
                                   "--save-format", "consolidated",    "--output-dir", out};
  argv.insert(argv.end(), more.begin(), more.end());
  return argv;
}

// 2 machines x 2 workers, the units gathered once per machine between the machines' links: the
// same training as DDP. Not bitwise (DDP all-reduces whole buckets, stage 3 reduce-scatters units
// and AdamW updates cut tensors, which moves float32 ulps: 1.5e-7 measured after 10 steps), so
// within 1e-5, 100x below how far the last 5 steps moved the parameters (checked too); the
// Trainer checks that all 4 replicas end bitwise equal to each other.
TEST(Zero3Cluster, OneCopyPerMachineOnTwoMachinesOfTwoTrainsLikeDdp) {
  REQUIRE_CLUSTER();
  TempDir ddp_out("zero3-ddp"), zero_out("zero3-hybrid");
  {
    VirtualCluster cluster({2, "1gbit"});
    auto nodes = launch(cluster, mlp_job(ddp_out.path(), {}));
    for (auto& n : nodes) ASSERT_EQ(n->wait(300), 0) << n->output();
  }
  VirtualCluster cluster({2, "1gbit"});
  auto nodes = launch(cluster, mlp_job(zero_out.path(), {"--zero-stage", "3", "--zero-shared-parameters"}));
  for (auto& n : nodes) ASSERT_EQ(n->wait(300), 0) << n->output();
  const std::string& o = nodes[0]->output();
  EXPECT_NE(o.find("backend hier"), std::string::npos) << o;
  EXPECT_NE(o.find("ZeRO stage 3"), std::string::npos) << o;
  EXPECT_NE(o.find("all 4 replicas hold the same parameters"), std::string::npos) << o;
  const auto ddp = mlp_parameters(ddp_out.path() + "/checkpoint-10");
  const auto zero = mlp_parameters(zero_out.path() + "/checkpoint-10");
  const double apart = max_difference(ddp, zero), moved = max_difference(ddp, mlp_parameters(ddp_out.path() + "/checkpoint-5"));
  EXPECT_LT(apart, 1e-5);
  EXPECT_GT(moved, 1e-3) << "the last 5 steps moved it";
  std::printf("stage 3 (one copy per machine) vs DDP after 10 steps: %.3g apart; steps 5..10 moved DDP by %.3g\n", apart, moved);
}

// A job of `steps` steps of the MLP that writes sharded checkpoints every 5 and logs every 5.
std::vector<std::string> sharded_job(const std::string& out, int steps, const std::vector<std::string>& more) {
  std::vector<std::string> argv = {FASHION_MNIST, "--model", "mlp", "--train-limit", "2048", "--eval-strategy", "no",
                                   "--disable-tqdm", "--per-device-train-batch-size", "32", "--max-steps",
                                   std::to_string(steps), "--save-strategy", "steps", "--save-steps", "5",
                                   "--save-format", "sharded", "--logging-steps", "5", "--output-dir", out};
  argv.insert(argv.end(), more.begin(), more.end());
  return argv;
}

// What a resumed run must show: the checkpoint read at `step`, written by `saved` workers and read
// by `now`; the samples of the epoch already trained on kept out, the rest dealt over the new
// workers; and its first logged loss near where the checkpoint's run left off, far below an
// untrained model's ln 10 = 2.3.
void expect_resumed(const std::string& output, const std::string& out, const std::string& from, int step,
                    int saved, int now, std::int64_t done, double loss_before) {
  EXPECT_NE(output.find("resumed from " + from + " at step " + std::to_string(step)), std::string::npos)
      << output;
  EXPECT_NE(output.find("the " + std::to_string(done) +
                        " samples of epoch 0 already trained on stay done, the rest "
                        "are dealt over " +
                        std::to_string(now)),
            std::string::npos)
      << output;
  const auto loads = metrics_events(out + "/metrics.jsonl", "checkpoint");
  ASSERT_FALSE(loads.empty()) << output;
  EXPECT_EQ(loads.front()["action"], "resume");
  EXPECT_EQ(loads.front()["saved_world_size"], saved);
  EXPECT_EQ(loads.front()["world_size"], now);
  const auto logs = metrics_events(out + "/metrics.jsonl", "log");
  ASSERT_FALSE(logs.empty()) << output;
  const double first = logs.front()["loss"].get<double>();
  EXPECT_LT(first, 0.8 * 2.3) << "started over instead of resuming";
  EXPECT_LT(first, 1.5 * loss_before) << "the loss did not go on from the checkpoint's";
}

// The resharding the issue names: a stage-3 checkpoint (one copy per machine) of 2 machines x 2
// workers resumes on one machine with 3 workers under DDP, and that run's checkpoint goes back to
// 2 x 2 under stage 3. Batches of 32 per worker on 2048 samples: steps 1-5 take 640 (4 x 32 x 5),
// steps 6-10 480 more (3 x 32 x 5), so the second resume keeps out 1120, all in epoch 0.
TEST(Zero3Cluster, AStageThreeCheckpointOfTwoMachinesResumesOnOneMachineOfThreeUnderDdpAndBack) {
  REQUIRE_CLUSTER();
  TempDir first("zero3-reshard-2x2"), second("zero3-reshard-1x3"), third("zero3-reshard-back");
  const std::vector<std::string> stage3 = {"--zero-stage", "3", "--zero-shared-parameters"};
  {
    VirtualCluster cluster({2, "1gbit"});
    auto nodes = launch(cluster, sharded_job(first.path(), 5, stage3));
    for (auto& n : nodes) ASSERT_EQ(n->wait(300), 0) << n->output();
  }
  ASSERT_TRUE(fs::exists(first.path() + "/checkpoint-5/index.json"));
  const double loss5 = metrics_events(first.path() + "/metrics.jsonl", "log").back()["loss"].get<double>();

  const std::string from5 = first.path() + "/checkpoint-5";
  Process ddp(
      [&] {
        std::vector<std::string> argv = {LOCKSTEP_BINARY, "run", "--nproc-per-node", "3"};
        for (const auto& a : sharded_job(second.path(), 10, {"--resume-from-checkpoint", from5}))
          argv.push_back(a);
        return argv;
      }(),
      {{"OMP_NUM_THREADS", "1"}});
  ASSERT_EQ(ddp.wait(300), 0) << ddp.output();
  expect_resumed(ddp.output(), second.path(), from5, 5, 4, 3, 640, loss5);
  const double loss10 = metrics_events(second.path() + "/metrics.jsonl", "log").back()["loss"].get<double>();

  const std::string from10 = second.path() + "/checkpoint-10";
  VirtualCluster cluster({2, "1gbit"});
  auto nodes = launch(cluster, sharded_job(third.path(), 15, [&] {
                        auto a = stage3;
                        a.insert(a.end(), {"--resume-from-checkpoint", from10});
                        return a;
                      }()));
  for (auto& n : nodes) ASSERT_EQ(n->wait(300), 0) << n->output();
  EXPECT_NE(nodes[0]->output().find("ZeRO stage 3"), std::string::npos) << nodes[0]->output();
  expect_resumed(nodes[0]->output(), third.path(), from10, 10, 3, 4, 1120, loss10);
  EXPECT_TRUE(fs::exists(third.path() + "/checkpoint-15/index.json"));
}

// The GPT at 512 wide and 44 layers: 138.7 M parameters, whose float32 parameters, gradients and
// AdamW moments (16 bytes each: 2.2 GB) do not fit a machine whose training state is limited to
// 1.65 GiB (its 2 workers' libtorch and the rest come on top: the limit is that plus twice what
// a worker of this build holds before any model, 2 GiB in all on Debian's libtorch, whose worker
// starts at 190 MB; the pip wheel's starts at 420 MB). Under DDP each worker holds all of that,
// under stage 2 the parameters whole (and, while it builds, twice): both outgrow the limit, and
// the launcher says so. Stage 3 with one copy per machine holds a quarter of it per worker and
// trains, then writes its sharded checkpoint.
std::vector<std::string> big_gpt(const std::string& out, const std::vector<std::string>& zero) {
  std::vector<std::string> argv = {GPT,           "--n-embd",       "512",  "--n-layer",         "44",
                                   "--n-head",    "8",              "--block-size", "64",
                                   "--per-device-train-batch-size", "1",    "--max-steps",       "1",
                                   "--logging-steps", "1",          "--eval-strategy", "no",     "--train-limit", "64",
                                   "--eval-limit", "4",             "--disable-tqdm", "--save-strategy", "steps",
                                   "--save-steps", "1",             "--save-in-background=false", "--output-dir", out};
  argv.insert(argv.end(), zero.begin(), zero.end());
  return argv;
}

// The peak resident memory of a worker of this build that trains a tiny GPT: what libtorch, its
// libraries and the program hold before the model matters.
std::int64_t worker_baseline_bytes() {
  TempDir out("zero3-baseline");
  Process gpt({GPT, "--n-embd", "64", "--n-layer", "1", "--n-head", "4", "--block-size", "64",
               "--per-device-train-batch-size", "1", "--max-steps", "2", "--logging-steps", "1", "--eval-strategy",
               "no", "--train-limit", "8", "--eval-limit", "4", "--disable-tqdm", "--save-strategy", "no",
               "--output-dir", out.path()},
              {{"OMP_NUM_THREADS", "1"}});
  EXPECT_EQ(gpt.wait(120), 0) << gpt.output();
  std::int64_t peak = 0;
  std::ifstream metrics(out.path() + "/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto record = nlohmann::json::parse(line);
    if (record.value("event", "") == "log") peak = std::max(peak, record.value("peak_rss_bytes", std::int64_t(0)));
  }
  EXPECT_GT(peak, 0) << "no peak_rss_bytes in " << out.path() << "/metrics.jsonl";
  return peak;
}

TEST(Zero3Cluster, AModelWhoseStateOutgrowsEachMachineTrainsUnderStageThreeWhereDdpAndStageTwoRunOutOfMemory) {
  REQUIRE_CLUSTER();
  constexpr std::int64_t kStateLimit = std::int64_t(1690) << 20;  // 1.65 GiB for the training state
  const std::int64_t machine_limit = kStateLimit + 2 * worker_baseline_bytes();
  auto limits = [&] {
    std::vector<Cgroup> g;
    for (int m = 0; m < 2; ++m) g.push_back(Cgroup::memory(machine_limit));
    return g;
  };
  if (limits()[0].path().empty()) GTEST_SKIP() << "no memory cgroup can be made here (needs root)";
  for (const auto& zero : std::vector<std::vector<std::string>>{{}, {"--zero-stage", "2"}}) {
    TempDir out("zero3-oom");
    const auto g = limits();
    VirtualCluster cluster({2, "10gbit"});
    auto nodes = launch(cluster, big_gpt(out.path(), zero), &g);
    std::string all;
    for (auto& n : nodes) {
      EXPECT_NE(n->wait(600), 0) << n->output();
      all += n->output();
    }
    // Either the OOM kill is the job's first failure or another rank's reaction to it was agreed
    // first; the launcher names the kill both ways.
    EXPECT_NE(all.find("the kernel's OOM killer ended it"), std::string::npos)
        << "each machine limited to " << (machine_limit >> 20) << " MiB\n" << all;
    EXPECT_FALSE(fs::exists(out.path() + "/checkpoint-1")) << "a checkpoint from a job that did not train";
  }
  TempDir out("zero3-fits");
  const auto g = limits();
  VirtualCluster cluster({2, "10gbit"});
  auto nodes = launch(cluster, big_gpt(out.path(), {"--zero-stage", "3", "--zero-shared-parameters"}), &g);
  for (auto& n : nodes) {
    ASSERT_EQ(n->wait(600), 0) << "each machine limited to " << (machine_limit >> 20) << " MiB\n" << n->output();
  }
  const std::string& o = nodes[0]->output();
  const std::regex parameters(
      R"(GPT: 44 layers, 8 heads, 512 wide, 64 tokens of context, 256 in the vocabulary: ([0-9.]+) M parameters)");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(o, m, parameters)) << o;
  EXPECT_GT(std::stod(m[1]) * 1e6 * 16, double(kStateLimit)) << "the training state must outgrow a machine's share";
  EXPECT_NE(o.find("step 1/1"), std::string::npos) << o;
  EXPECT_TRUE(fs::exists(out.path() + "/checkpoint-1")) << o;
}

}  // namespace
}  // namespace lockstep::testing
