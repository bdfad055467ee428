// Pipelines across machines (network namespaces, tests/testing/cluster.h): a GPT cut into stages
// whose activations cross a 1 Gbit/s link ends bitwise where the same job ends on one machine and
// where one process ends; with each stage split over its machine's workers (pipeline x tensor), it
// trains as one process does. What is checked is correctness: every machine shares this host's two
// cores, so the timings here prove nothing (bench/compare_pipeline.py measures, and says so).
// Every worker multiplies on one thread so that all runs round alike. Torch-free: it reads the
// fingerprint of the final parameters the Trainer prints.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <iterator>
#include <memory>

#include "cluster.h"
#include "testing.h"

namespace lockstep::testing {
namespace {

#define REQUIRE_CLUSTER() \
  if (auto why = VirtualCluster::unavailable()) GTEST_SKIP() << *why;

constexpr int kPort = 29400;
const std::map<std::string, std::string> kEnv = {{"OMP_NUM_THREADS", "1"}, {"LOCKSTEP_TOKEN", "pipeline-cluster-token"}};

std::vector<std::string> gpt(const std::string& out, const std::vector<std::string>& more) {
  std::vector<std::string> argv = {GPT_EXAMPLE,   "--n-layer", "6",   "--n-head", "2", "--n-embd",
                                   "32",          "--block-size", "16", "--dropout", "0.1", "--train-limit",
                                   "400",         "--eval-strategy", "no", "--save-strategy", "no",
                                   "--per-device-train-batch-size", "2", "--gradient-accumulation-steps", "4",
                                   "--max-steps", "12", "--disable-tqdm", "--output-dir", out};
  argv.insert(argv.end(), more.begin(), more.end());
  return argv;
}

std::string fingerprint(const std::string& output) {
  const auto at = output.rfind("(fingerprint ");
  return at == std::string::npos ? "" : output.substr(at + 13, 16);
}

// `lockstep run` on this machine; rank 0's output.
std::string on_one_machine(int nproc, const std::vector<std::string>& program) {
  std::vector<std::string> argv = {LOCKSTEP_BINARY, "run", "--nproc-per-node", std::to_string(nproc)};
  argv.insert(argv.end(), program.begin(), program.end());
  Process p(argv, kEnv);
  EXPECT_EQ(p.wait(300), 0) << p.output();
  return p.output();
}

// One launcher per machine of `cluster`, `nproc` workers each; machine 0's output.
std::string across(const VirtualCluster& cluster, int nproc, const std::vector<std::string>& program) {
  std::vector<std::unique_ptr<Process>> nodes;
  for (int m = 0; m < cluster.machines(); ++m) {
    std::vector<std::string> argv = {LOCKSTEP_BINARY, "run", "--nnodes", std::to_string(cluster.machines()),
                                     "--node-rank", std::to_string(m), "--nproc-per-node", std::to_string(nproc),
                                     "--master-addr", cluster.address(0), "--master-port", std::to_string(kPort)};
    argv.insert(argv.end(), program.begin(), program.end());
    nodes.push_back(std::make_unique<Process>(cluster.on(m, argv), kEnv));
  }
  for (auto& n : nodes) EXPECT_EQ(n->wait(600), 0) << n->output();
  return nodes[0]->output();
}

// 2 stages x 2 replicas on 2 machines of 2 workers: each machine holds one stage (its replicas
// reduce over shared memory) and the activations cross the link. 4 stages on the same machines:
// stages 0, 1 on one, 2, 3 on the other.
TEST(PipelineCluster, StagesOnTwoMachinesEndWhereOneMachineAndOneProcessEnd) {
  REQUIRE_CLUSTER();
  TempDir a("pipe-one"), b("pipe-single"), c("pipe-2x2"), d("pipe-4x1"), e("pipe-ddp");
  const std::string one = fingerprint(on_one_machine(1, gpt(a.path(), {})));
  const std::string ddp = fingerprint(on_one_machine(2, gpt(e.path(), {})));
  const std::string single = fingerprint(on_one_machine(4, gpt(b.path(), {"--pipeline-parallel", "2"})));
  ASSERT_FALSE(one.empty());
  EXPECT_EQ(single, ddp) << "2 stages x 2 replicas on one machine, against DDP on 2";
  VirtualCluster cluster({2, "1gbit"});
  const std::string two_by_two = across(cluster, 2, gpt(c.path(), {"--pipeline-parallel", "2", "--pipeline-schedule", "zb"}));
  EXPECT_NE(two_by_two.find("2 pipeline ranks x 2 replicas (4 workers)"), std::string::npos) << two_by_two;
  EXPECT_EQ(fingerprint(two_by_two), ddp) << two_by_two;
  const std::string four = across(cluster, 2, gpt(d.path(), {"--pipeline-parallel", "4", "--pipeline-schedule", "interleaved",
                                                             "--virtual-stages", "2"}));
  EXPECT_EQ(fingerprint(four), one) << four;
}

// The validation loss examples/gpt writes at the end.
double eval_loss(const TempDir& out) {
  std::ifstream in(out / "eval_results.json");
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  const auto at = text.find("\"eval_loss\":");
  return at == std::string::npos ? -1 : std::stod(text.substr(at + 12));
}

// Three dimensions on 2 machines of 2 workers: the pipeline's 2 stages across the link, each
// stage's layers split over the 2 workers of its machine (the tensor groups stay inside one
// machine, as the layout demands). It trains as one process does, up to the order of the split
// layers' sums (float32).
TEST(PipelineCluster, PipelinesOfSplitStagesAcrossTwoMachinesTrainAsOneProcess) {
  REQUIRE_CLUSTER();
  TempDir a("pipe3d-one"), b("pipe3d-two-machines");
  const std::vector<std::string> evaluated = {"--eval-limit", "50"};
  on_one_machine(1, gpt(a.path(), evaluated));
  VirtualCluster cluster({2, "1gbit"});
  std::vector<std::string> split = evaluated;
  for (const char* f : {"--pipeline-parallel", "2", "--tensor-parallel", "2", "--sequence-parallel"}) split.push_back(f);
  const std::string three = across(cluster, 2, gpt(b.path(), split));
  EXPECT_NE(three.find("layout: 4 workers on 2 machines: 2 pipeline x 2 tensor (sequence parallel)"), std::string::npos)
      << three;
  EXPECT_NE(three.find("the 2 ranks of each tensor group hold the same whole parameters"), std::string::npos) << three;
  ASSERT_GT(eval_loss(a), 0);
  EXPECT_LE(std::abs(eval_loss(b) - eval_loss(a)) / eval_loss(a), 1e-3)
      << "across machines " << eval_loss(b) << ", one process " << eval_loss(a);
}

}  // namespace
}  // namespace lockstep::testing
