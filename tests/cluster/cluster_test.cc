// Several machines for real: network namespaces with their own hostnames (which do not resolve)
// and their own /dev/shm, joined by rate-limited links (testing/cluster.h). One `lockstep run`
// per machine, as a user would start them. Skipped, saying why, where namespaces cannot be made.
#include "cluster.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>

#include "cgroup.h"
#include "lockstep/train/checkpoint.h"
#include "metrics_file.h"
#include "testing.h"

namespace fs = std::filesystem;

namespace lockstep::testing {
namespace {

using std::chrono::steady_clock;

double seconds_since(steady_clock::time_point t) {
  return std::chrono::duration<double>(steady_clock::now() - t).count();
}

// Each test makes its own cluster; a missing capability skips it with the reason.
#define REQUIRE_CLUSTER() \
  if (auto why = VirtualCluster::unavailable()) GTEST_SKIP() << *why;

constexpr int kPort = 29400;  // every cluster has network stacks of its own: no clash

// One launcher per machine: `lockstep run --nnodes M --node-rank m ...` inside machine m, with
// `nproc` workers (the last machine: `last_nproc`, when given).
std::vector<std::unique_ptr<Process>> launch(const VirtualCluster& cluster, int nproc,
                                             const std::vector<std::string>& program,
                                             const std::vector<std::string>& launcher_flags = {},
                                             const std::map<std::string, std::string>& env = {},
                                             int last_nproc = 0) {
  std::vector<std::unique_ptr<Process>> nodes;
  auto environment = env;
  environment["LOCKSTEP_TOKEN"] = "cluster-test-token";
  for (int m = 0; m < cluster.machines(); ++m) {
    std::vector<std::string> argv = {LOCKSTEP_BINARY,    "run",
                                     "--nnodes",         std::to_string(cluster.machines()),
                                     "--node-rank",      std::to_string(m),
                                     "--nproc-per-node",
                                     std::to_string(m + 1 == cluster.machines() && last_nproc ? last_nproc : nproc),
                                     "--master-addr",    cluster.address(0),
                                     "--master-port",    std::to_string(kPort)};
    argv.insert(argv.end(), launcher_flags.begin(), launcher_flags.end());
    argv.insert(argv.end(), program.begin(), program.end());
    nodes.push_back(std::make_unique<Process>(cluster.on(m, argv), environment));
  }
  return nodes;
}

std::vector<std::string> trainer(const std::string& out, const std::vector<std::string>& more = {}) {
  std::vector<std::string> argv = {
      FASHION_MNIST,    "--model",         "mlp", "--train-limit", "4096", "--eval-limit", "500",
      "--disable-tqdm", "--logging-steps", "10",  "--output-dir",  out};
  argv.insert(argv.end(), more.begin(), more.end());
  return argv;
}

std::vector<torch::Tensor> parameters_in(const std::string& checkpoint) {
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

bool bitwise_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

// With no knob set, two machines of two workers each pick hier, even though the hostnames do
// not resolve, and every rank ends with the same parameters.
TEST(Cluster, ATwoByTwoTrainerJobPicksHierByItselfAndEveryRankEndsEqual) {
  REQUIRE_CLUSTER();
  const ShmWatch host_shm;
  VirtualCluster cluster({2, "1gbit"});
  TempDir out("cluster-trainer");
  auto nodes = launch(cluster, 2, trainer(out.path(), {"--max-steps", "30", "--save-strategy", "no"}));
  for (auto& n : nodes) ASSERT_EQ(n->wait(180), 0) << n->output();
  const std::string& o = nodes[0]->output();
  EXPECT_NE(o.find("4 workers x 64 per device"), std::string::npos) << o;
  EXPECT_NE(o.find("backend hier"), std::string::npos) << o;
  EXPECT_NE(o.find("all 4 replicas hold the same parameters"), std::string::npos) << o;
  EXPECT_EQ(host_shm.added(), std::vector<std::string>{})
      << "the machines' /dev/shm are their own; the host's stays clean";
}

// Machines of unequal size (2 workers and 1) pick hier too, and every rank ends equal.
TEST(Cluster, MachinesOfUnequalSizePickHierAndEveryRankEndsEqual) {
  REQUIRE_CLUSTER();
  VirtualCluster cluster({2, "1gbit"});
  TempDir out("cluster-uneven");
  auto nodes = launch(cluster, 2, trainer(out.path(), {"--max-steps", "30", "--save-strategy", "no"}), {}, {}, 1);
  for (auto& n : nodes) ASSERT_EQ(n->wait(180), 0) << n->output();
  const std::string& o = nodes[0]->output();
  EXPECT_NE(o.find("3 workers x 64 per device"), std::string::npos) << o;
  EXPECT_NE(o.find("backend hier"), std::string::npos) << o;
  EXPECT_NE(o.find("all 3 replicas hold the same parameters"), std::string::npos) << o;
}

// On a slow link auto measures the exact all-reduce, finds PowerSGD far cheaper, and compresses
// between the machines: the link carries a fraction of what exact gradients would need, and
// every replica still ends equal.
TEST(Cluster, OnASlowLinkAutoCompressesBetweenMachinesAndEveryRankEndsEqual) {
  REQUIRE_CLUSTER();
  VirtualCluster cluster({2, "100mbit"});
  TempDir out("cluster-auto-hook");
  const int steps = 40;
  auto nodes = launch(cluster, 2,
                      trainer(out.path(), {"--max-steps", std::to_string(steps), "--save-strategy", "no",
                                           "--ddp-comm-hook", "auto", "--comm-hook-start-step", "5"}));
  for (auto& n : nodes) ASSERT_EQ(n->wait(300), 0) << n->output();
  const std::string& o = nodes[0]->output();
  EXPECT_NE(o.find("auto comm hook, bucket 0: elements [0, "), std::string::npos) << o;
  EXPECT_NE(o.find("-> powersgd (its compute runs on the communication thread"), std::string::npos) << o;
  EXPECT_NE(o.find("all 4 replicas hold the same parameters"), std::string::npos) << o;
  // Exact gradients: each machine sends at least the model's 535,818 float32 per step (hier, two
  // machines); compressed after the first 5, the link carries well under a third of that.
  const double exact_bytes = 535818.0 * 4 * steps;
  const auto sent = cluster.counters(0).tx_bytes;
  EXPECT_LT(double(sent), 0.3 * exact_bytes) << sent << " bytes sent";
}

// Local SGD on a 100 Mbit/s link: the machines' workers average inside their machine, the
// machines meet every 8 steps, so the link carries a fraction of exact DDP's bytes; every rank
// ends equal, and the checkpoint holds machine 1's own optimizer state and the outer momentum.
TEST(Cluster, OnASlowLinkLocalSgdMeetsEveryEightStepsAndKeepsEachMachinesOptimizerState) {
  REQUIRE_CLUSTER();
  VirtualCluster cluster({2, "100mbit"});
  TempDir out("cluster-local-sgd");
  const int steps = 32;
  auto nodes = launch(cluster, 2,
                      trainer(out.path(), {"--max-steps", std::to_string(steps), "--save-strategy", "steps",
                                           "--save-steps", "16", "--sync-every", "8"}));
  for (auto& n : nodes) ASSERT_EQ(n->wait(300), 0) << n->output();
  const std::string& o = nodes[0]->output();
  EXPECT_NE(o.find("local SGD: gradients are averaged inside each machine (2 workers)"), std::string::npos) << o;
  EXPECT_NE(o.find("all 4 replicas hold the same parameters"), std::string::npos) << o;
  // Exact DDP: at least the model's 535,818 float32 out of each machine per step; here 4
  // meetings and the first broadcast.
  const double exact_bytes = 535818.0 * 4 * steps;
  const auto sent = cluster.counters(0).tx_bytes;
  EXPECT_LT(double(sent), 0.3 * exact_bytes) << sent << " bytes sent";
  const std::string last = out.path() + "/checkpoint-32";
  EXPECT_TRUE(fs::exists(last + "/optimizer-machine-1.pt")) << o;
  EXPECT_TRUE(fs::exists(last + "/outer_optimizer.pt")) << o;
  EXPECT_FALSE(fs::exists(last + "/optimizer-machine-2.pt"));
}

// After a job that was killed mid-training, nothing is left: no namespace, nothing in /dev/shm.
TEST(Cluster, NothingIsLeftBehind) {
  REQUIRE_CLUSTER();
  const ShmWatch host_shm;
  std::string prefix;
  {
    VirtualCluster cluster({2, ""});
    prefix = cluster.prefix();
    TempDir out("cluster-left");
    auto nodes = launch(cluster, 2, trainer(out.path(), {"--max-steps", "100000", "--save-strategy", "no"}));
    ASSERT_TRUE(nodes[0]->read_until("step 10/", 120)) << nodes[0]->output();
  }  // the launchers and their workers are still running: the cluster kills them
  for (const auto& ns : VirtualCluster::namespaces()) EXPECT_NE(ns.rfind(prefix, 0), 0u) << ns << " was left";
  EXPECT_EQ(host_shm.added(), std::vector<std::string>{});
}

// `lockstep doctor` on each of a cluster's machines; returns machine 0's report and its doctor.json.
struct DoctorRun {
  std::string report;
  nlohmann::json doc;
  std::string machine1;
};

DoctorRun run_doctor(const VirtualCluster& cluster, const TempDir& out) {
  std::vector<std::unique_ptr<Process>> doctors;
  for (int m = 0; m < 2; ++m) {
    const std::vector<std::string> argv = {
        LOCKSTEP_BINARY, "doctor",        "--nnodes",      "2",        "--node-rank",   std::to_string(m),
        "--master-addr", cluster.address(0), "--master-port", std::to_string(kPort), "--nproc-per-node", "2",
        "--steps",       "24",            "--window",      "8",        "--output-dir",  out / ("machine" + std::to_string(m)),
        "--",            FASHION_MNIST,   "--model",       "mlp",      "--train-limit", "4096",
        "--per-device-train-batch-size",  "16"};
    doctors.push_back(std::make_unique<Process>(cluster.on(m, argv),
                                                std::map<std::string, std::string>{{"LOCKSTEP_TOKEN", "doctor"}}));
  }
  for (auto& d : doctors) EXPECT_EQ(d->wait(600), 0) << d->output();
  return {doctors[0]->output(), nlohmann::json::parse(read_file(out / "machine0/doctor.json")),
          doctors[1]->output()};
}

bool has_finding(const nlohmann::json& doc, const std::string& kind) {
  for (const auto& f : doc["findings"])
    if (f["kind"] == kind) return true;
  return false;
}

// lockstep doctor across machines: the same command on each, machine 0 reports the bandwidth
// between machines against the link's, and, the link being the limit here (1 Gbit/s, small
// batches), recommends compression. Both links are alike, so none is named as slow.
TEST(Cluster, TheDoctorComparesTheTrafficBetweenMachinesWithTheLinkAndAdvisesCompression) {
  REQUIRE_CLUSTER();
  VirtualCluster cluster({2, "1gbit"});
  TempDir out("cluster-doctor");
  const DoctorRun run = run_doctor(cluster, out);
  EXPECT_NE(run.report.find("between the 2 machines:"), std::string::npos) << run.report;
  EXPECT_NE(run.report.find("the link as lockstep bench sees it"), std::string::npos) << run.report;
  EXPECT_NE(run.report.find("--ddp-comm-hook auto"), std::string::npos) << run.report;
  EXPECT_NE(run.report.find("each machine's link out, alone"), std::string::npos) << run.report;
  EXPECT_TRUE(has_finding(run.doc, "link")) << run.doc.dump(2);
  EXPECT_FALSE(has_finding(run.doc, "slow_link")) << run.doc.dump(2);
  EXPECT_EQ(run.doc["many"]["machines"].get<int>(), 2);
  EXPECT_NE(run.machine1.find("machine 0 prints the report"), std::string::npos) << run.machine1;
}

// One link cut to 100 Mbit/s (machine 1's way out; machine 0's stays at 1 Gbit/s): an all-reduce
// shows only that the network is slow, on every rank alike; the doctor times each machine's link
// out alone and names machine 1's, with the ratio, and blames no rank's compute.
TEST(Cluster, TheDoctorNamesTheMachineWhoseLinkWasCutTo100Mbit) {
  REQUIRE_CLUSTER();
  VirtualCluster cluster({2, "1gbit"});
  cluster.set_rate(1, "100mbit");
  TempDir out("cluster-doctor-slow");
  const DoctorRun run = run_doctor(cluster, out);
  std::printf("%s\n", run.report.c_str());
  ASSERT_TRUE(has_finding(run.doc, "slow_link")) << run.report;
  EXPECT_NE(run.report.find("machine 1's link out carries"), std::string::npos) << run.report;
  EXPECT_EQ(run.report.find("machine 0's link out carries"), std::string::npos) << run.report;
  EXPECT_FALSE(has_finding(run.doc, "straggler")) << run.report;
  const auto links = run.doc["link_out_gbps"];
  ASSERT_EQ(links.size(), 2u) << run.doc.dump(2);
  // tbf at 100 Mbit/s is 0.0125 GB/s; 1 Gbit/s 0.125 (the machines share 2 cores, so less).
  EXPECT_LT(links[1].get<double>(), 0.02);
  EXPECT_GT(links[0].get<double>(), 3 * links[1].get<double>());
}

// The conformance table across machines, over hier and (as the peer it must match) gloo.
struct Layout {
  int machines, per_machine;
  int last_machine = 0;  // workers on the last machine, when it has fewer (0: per_machine)
};

class ClusterConformance : public ::testing::TestWithParam<Layout> {};

TEST_P(ClusterConformance, EveryCollectiveMatchesTheReference) {
  REQUIRE_CLUSTER();
  const Layout l = GetParam();
  VirtualCluster cluster({l.machines, ""});
  auto nodes = launch(cluster, l.per_machine, {COMM_WORKER, "conformance", "hier", "8192"}, {}, {}, l.last_machine);
  for (std::size_t m = 0; m < nodes.size(); ++m) {
    EXPECT_EQ(nodes[m]->wait(300), 0) << nodes[m]->output();
    const int workers = m + 1 == nodes.size() && l.last_machine ? l.last_machine : l.per_machine;
    EXPECT_EQ(count_of(nodes[m]->output(), " 0 failures on hier"), static_cast<std::size_t>(workers))
        << nodes[m]->output();
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, ClusterConformance,
                         ::testing::Values(Layout{2, 2}, Layout{2, 1}, Layout{3, 1}, Layout{2, 2, 1}),
                         [](const ::testing::TestParamInfo<Layout>& param) {
                           return std::to_string(param.param.machines) + "x" +
                                  std::to_string(param.param.per_machine) +
                                  (param.param.last_machine ? "_last" + std::to_string(param.param.last_machine) : "");
                         });

// One machine of two limited to half a core: the Trainer on rank 0 names rank 1 (machine 1's
// only worker) as the straggler, and says its compute is what is slow, not its data.
// - The two machines share this host's cores. Each gets one thread (two pools of a thread per core
//   would take cores from each other), and both run in cgroups of the highest weight, so that on a
//   loaded host machine 0 still has a core and machine 1 its half.
// - A step is mostly compute (big batches over an unlimited link): otherwise machine 1 would idle
//   in the all-reduce for long enough to stay within its half a core.
// - Judged over the windows, as the doctor judges them.
TEST(Cluster, AMachineLimitedToHalfACoreIsNamedAsTheStraggler) {
  REQUIRE_CLUSTER();
  // They outlive the cluster: its processes are gone before the cgroups are removed.
  const Cgroup whole = Cgroup::cpu(0), half = Cgroup::cpu(0.5);
  if (whole.path().empty() || half.path().empty()) GTEST_SKIP() << "no cpu cgroup can be made here";
  VirtualCluster cluster({2, ""});
  TempDir out("cluster-straggler");
  auto program = trainer(out.path(), {"--max-steps", "60", "--save-strategy", "no", "--eval-strategy", "no",
                                      "--per-device-train-batch-size", "2048", "--train-limit", "32768"});
  std::vector<std::unique_ptr<Process>> nodes;
  for (int m = 0; m < 2; ++m) {
    std::vector<std::string> argv = {LOCKSTEP_BINARY, "run", "--nnodes", "2", "--node-rank", std::to_string(m),
                                     "--nproc-per-node", "1", "--master-addr", cluster.address(0),
                                     "--master-port", std::to_string(kPort)};
    argv.insert(argv.end(), program.begin(), program.end());
    // Into the cgroup before entering the machine: `ip netns exec` mounts a /sys of its own.
    nodes.push_back(std::make_unique<Process>((m == 1 ? half : whole).around(cluster.on(m, argv)),
                                              std::map<std::string, std::string>{{"LOCKSTEP_TOKEN", "t"},
                                                                                 {"OMP_NUM_THREADS", "1"}}));
  }
  for (auto& n : nodes) EXPECT_EQ(n->wait(300), 0) << n->output();
  std::map<int, int> windows_naming;  // rank -> the windows that named it
  const auto logs = metrics_events(out.path() + "/metrics.jsonl", "log");
  for (const auto& log : logs)
    if (log.contains("straggler_rank")) ++windows_naming[log["straggler_rank"].get<int>()];
  std::printf("of %zu windows, %d named rank 1 and %d rank 0\n", logs.size(), windows_naming[1], windows_naming[0]);
  const std::string said = nodes[0]->output();
  EXPECT_GE(2 * windows_naming[1], static_cast<int>(logs.size())) << said;
  EXPECT_LT(windows_naming[0], windows_naming[1]) << said;
  EXPECT_NE(said.find("rank 1 is the straggler: its compute"), std::string::npos) << said;
}

TEST(Cluster, GlooSocketIfnameIsHonouredAndABadOneIsNamed) {
  REQUIRE_CLUSTER();
  VirtualCluster cluster({2, ""});
  auto good = launch(cluster, 1, {COMM_WORKER, "conformance", "gloo"}, {}, {{"GLOO_SOCKET_IFNAME", "eth0"}});
  for (auto& n : good) EXPECT_EQ(n->wait(120), 0) << n->output();
  auto bad = launch(cluster, 1, {COMM_WORKER, "conformance", "gloo"}, {}, {{"GLOO_SOCKET_IFNAME", "eth9"}});
  for (auto& n : bad) {
    EXPECT_NE(n->wait(120), 0) << n->output();
    EXPECT_NE(n->output().find("GLOO_SOCKET_IFNAME names interface 'eth9', which does not exist here"),
              std::string::npos)
        << n->output();
  }
}

// Every process of machine 1 dies at once (SIGKILL): machine 0's launcher says so, naming the
// node, within 10 s, and ends.
TEST(Cluster, WhenAWholeMachineIsKilledTheOtherLauncherNamesItWithinTenSeconds) {
  REQUIRE_CLUSTER();
  VirtualCluster cluster({2, "1gbit"});
  TempDir out("cluster-kill");
  auto nodes = launch(cluster, 2, trainer(out.path(), {"--max-steps", "100000", "--save-strategy", "no"}));
  ASSERT_TRUE(nodes[0]->read_until("step 20/", 120)) << nodes[0]->output();
  const auto killed = steady_clock::now();
  cluster.kill_all(1);
  EXPECT_TRUE(nodes[0]->read_until("the launcher of node 1 (node1, " + cluster.address(1) + ") died", 10))
      << nodes[0]->output();
  EXPECT_LT(seconds_since(killed), 10);
  EXPECT_NE(nodes[0]->wait(60), 0);
  EXPECT_LT(seconds_since(killed), 15) << "the launcher should end soon after its report";
}

// A partition (machine 1's link goes down: no packet passes, nothing is reset) mid-training:
// both sides end with an error naming the peer they lost, within 60 s, at default settings.
TEST(Cluster, APartitionEndsBothSidesNamingTheUnreachablePeerWithinAMinute) {
  REQUIRE_CLUSTER();
  VirtualCluster cluster({2, "1gbit"});
  TempDir out("cluster-partition");
  auto nodes = launch(cluster, 2, trainer(out.path(), {"--max-steps", "100000", "--save-strategy", "no"}));
  ASSERT_TRUE(nodes[0]->read_until("step 20/", 120)) << nodes[0]->output();
  const auto cut = steady_clock::now();
  cluster.set_link(1, false);
  for (auto& n : nodes) EXPECT_NE(n->wait(90), 0) << n->output();
  EXPECT_LT(seconds_since(cut), 60);
  const std::string machine1 = cluster.address(1), machine0 = cluster.address(0);
  // Node 0 names machine 1 whichever noticed first: its workers (Gloo's connection to that
  // address, or the watchdog seeing machine 1's ranks 2 and 3 gone from the store) or its
  // launcher (node 1's agent, with its address).
  const std::string& out0 = nodes[0]->output();
  EXPECT_TRUE(out0.find(machine1) != std::string::npos || out0.find("rank 2 died") != std::string::npos ||
              out0.find("rank 3 died") != std::string::npos)
      << out0;
  EXPECT_NE(nodes[1]->output().find("node 0's launcher, which hosts the job's store, stopped answering (" +
                                    machine0),
            std::string::npos)
      << nodes[1]->output();
}

// The same partition with a restart allowed: once the link is back, the job resumes from its
// last checkpoint and ends bitwise equal to a run that was never interrupted.
TEST(Cluster, AfterAPartitionHealsTheJobResumesAndEndsBitwiseEqual) {
  REQUIRE_CLUSTER();
  VirtualCluster cluster({2, "1gbit"});
  TempDir straight("cluster-straight"), healed("cluster-healed");
  const std::vector<std::string> run = {"--max-steps", "240",          "--save-strategy",
                                        "steps",       "--save-steps", "40"};
  auto reference = launch(cluster, 2, trainer(straight.path(), run));
  for (auto& n : reference) ASSERT_EQ(n->wait(300), 0) << n->output();

  auto nodes = launch(cluster, 2, trainer(healed.path(), run), {"--max-restarts", "1"});
  ASSERT_TRUE(nodes[0]->read_until("step 100/", 120)) << nodes[0]->output();
  cluster.set_link(1, false);
  ASSERT_TRUE(nodes[1]->read_until("stopped answering", 60)) << nodes[1]->output();
  ASSERT_TRUE(nodes[0]->read_until("job FAILED", 60)) << nodes[0]->output();
  cluster.set_link(1, true);
  for (auto& n : nodes) ASSERT_EQ(n->wait(300), 0) << n->output();
  EXPECT_NE(nodes[0]->output().find("resumed from " + healed.path() + "/checkpoint-"), std::string::npos)
      << nodes[0]->output();
  EXPECT_NE(nodes[1]->output().find("reached node 0's store again"), std::string::npos) << nodes[1]->output();
  EXPECT_TRUE(
      bitwise_equal(parameters_in(straight / "checkpoint-240"), parameters_in(healed / "checkpoint-240")));
}

}  // namespace
}  // namespace lockstep::testing
