// Elastic jobs across machines (network namespaces; links not rate-limited, to keep the steps
// short): machines whose workers are killed, that lose power, that are cut off, that join late,
// two lost in a row, and the first machine lost with the store kept apart. Each job must finish with every sample trained exactly
// once per epoch and every replica equal, and leave nothing behind; every wait is bounded.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>

#include "cluster.h"
#include "elastic_records.h"
#include "testing.h"

namespace lockstep::testing {
namespace {

#define REQUIRE_CLUSTER() \
  if (auto why = VirtualCluster::unavailable()) GTEST_SKIP() << *why;

constexpr int kStorePort = 29500;
constexpr std::size_t kSamples = 1920;

// Machines 0..machines-1 train; one more namespace holds the store (`lockstep store`), so that
// any training machine may be lost.
struct ElasticJob {
  ElasticJob(int machines, const std::string& machines_range, int per_machine, int total_steps, int max_restarts = 0)
      : cluster({machines + 1, ""}),
        dir("elastic-cluster"),
        nnodes(machines_range),
        nproc(per_machine),
        steps(total_steps),
        restarts(max_restarts) {
    store = std::make_unique<Process>(
        cluster.on(machines, {LOCKSTEP_BINARY, "store", "--port", std::to_string(kStorePort)}), env());
    EXPECT_TRUE(store->read_until("serving on", 30)) << store->output();
  }
  ~ElasticJob() { EXPECT_EQ(host_shm.added(), std::vector<std::string>{}) << "the host's /dev/shm must stay clean"; }

  std::map<std::string, std::string> env() const {
    // One thread per worker: every "machine" here shares this machine's two cores.
    return {{"LOCKSTEP_TOKEN", "elastic-cluster"},
            {"LOCKSTEP_PEER_CHECK", "1"},
            {"LOCKSTEP_ELASTIC_CHECK", "0.1"},
            {"OMP_NUM_THREADS", "1"}};
  }

  // One launcher on machine m, as a user starts it there.
  Process& start(int m) {
    std::vector<std::string> argv = {
        LOCKSTEP_BINARY, "run", "--nnodes", nnodes, "--nproc-per-node", std::to_string(nproc), "--rdzv-endpoint",
        cluster.address(cluster.machines() - 1) + ":" + std::to_string(kStorePort), "--max-restarts",
        std::to_string(restarts), "--run-id", "elastic", ELASTIC_WORKER, "--record-dir", dir.path(),
        "--per-device-train-batch-size", "32", "--max-steps", std::to_string(steps), "--batch-delay-ms", "10",
        "--learning-rate", "1e-3", "--logging-steps", "10", "--output-dir", dir / "out"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    nodes[m] = std::make_unique<Process>(cluster.on(m, argv), env());
    return *nodes[m];
  }

  // The output of every launcher, for failure messages.
  std::string outputs() const {
    std::string all;
    for (const auto& [m, p] : nodes) all += "--- machine " + std::to_string(m) + ":\n" + p->output();
    return all;
  }

  // Waits for the launchers in `machines` to end with 0, and checks what they trained.
  void expect_finished(const std::vector<int>& machines, int replicas, std::int64_t steps_per_epoch) {
    for (int m : machines) EXPECT_EQ(nodes[m]->wait(300), 0) << outputs();
    EXPECT_NE(outputs().find("all " + std::to_string(replicas) + " replicas hold the same parameters"),
              std::string::npos)
        << outputs();
    EXPECT_EQ(each_sample_once_per_epoch(trained_samples(dir.path()), steps_per_epoch, steps / steps_per_epoch,
                                         kSamples),
              "");
  }

  // Whether a launcher printed `text` within `seconds` (rank 0, which prints progress, may be on
  // any machine: machines are numbered as their launchers reach the store).
  bool saw(const std::string& text, double seconds = 120) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < deadline)
      for (auto& [m, p] : nodes)
        if (p->read_until(text, 0.05)) return true;
    return false;
  }

  const ShmWatch host_shm;  // first: before any machine starts
  VirtualCluster cluster;
  TempDir dir;
  std::string nnodes;
  int nproc, steps, restarts;
  std::vector<std::string> flags;  // the Trainer's, beyond the ones every test uses
  std::unique_ptr<Process> store;
  std::map<int, std::unique_ptr<Process>> nodes;
};

// Machine 1's two workers are killed mid-step (its launcher stays): the four others go on, and
// the launcher's new workers join again.
TEST(ElasticCluster, AMachinesKilledWorkersAreReplacedAndTheJobEndsWhole) {
  REQUIRE_CLUSTER();
  ElasticJob job(3, "3:3", 2, 200, 2);  // global batch 192: 10 steps per epoch
  for (int m = 0; m < 3; ++m) job.start(m);
  ASSERT_TRUE(job.saw("step 30/")) << job.outputs();
  EXPECT_EQ(job.cluster.kill_named(1, "elastic_trainer"), 2);
  ASSERT_TRUE(job.saw("-> 4 workers (failure")) << job.outputs();
  ASSERT_TRUE(job.saw("-> 6 workers (join")) << job.outputs();
  job.expect_finished({0, 1, 2}, 6, 10);
}

// Machine 2 loses power: no packet leaves it again. The others notice through TCP keepalive and
// the store's, agree without it, and finish.
TEST(ElasticCluster, AMachineThatLosesPowerIsLeftOutAndTheOthersFinish) {
  REQUIRE_CLUSTER();
  ElasticJob job(3, "2:3", 1, 300);  // global batch 96: 20 steps per epoch
  for (int m = 0; m < 3; ++m) job.start(m);
  ASSERT_TRUE(job.saw("step 40/")) << job.outputs();
  job.cluster.power_off(2);
  ASSERT_TRUE(job.saw("3 -> 2 workers (failure", 60)) << job.outputs();
  job.expect_finished({0, 1}, 2, 20);
}

// Machine 2 is cut off, then its link comes back: the others go on without it meanwhile, and its
// worker, told it was left out, joins again as a new member.
TEST(ElasticCluster, APartitionedMachineIsLeftOutAndRejoinsWhenItsLinkReturns) {
  REQUIRE_CLUSTER();
  ElasticJob job(3, "2:3", 1, 400);
  for (int m = 0; m < 3; ++m) job.start(m);
  ASSERT_TRUE(job.saw("step 40/")) << job.outputs();
  job.cluster.set_link(2, false);
  ASSERT_TRUE(job.saw("3 -> 2 workers (failure", 60)) << job.outputs();
  job.cluster.set_link(2, true);
  ASSERT_TRUE(job.saw("2 -> 3 workers (join", 60)) << job.outputs();
  job.expect_finished({0, 1, 2}, 3, 20);
}

// A third machine starts while two train (--nnodes 2:3): it is admitted mid-epoch with the
// others' state, and the global batch stays 64.
TEST(ElasticCluster, AMachineThatStartsMidEpochIsAdmitted) {
  REQUIRE_CLUSTER();
  ElasticJob job(3, "2:3", 1, 300);  // global batch 64: 30 steps per epoch
  job.start(0);
  job.start(1);
  ASSERT_TRUE(job.saw("step 20/")) << job.outputs();
  job.start(2);
  ASSERT_TRUE(job.saw("2 -> 3 workers (join", 60)) << job.outputs();
  job.expect_finished({0, 1, 2}, 3, 30);
}

// Two of four machines die one after the other: the last two finish.
TEST(ElasticCluster, TwoMachinesLostInARowLeaveTheOtherTwoToFinish) {
  REQUIRE_CLUSTER();
  ElasticJob job(4, "2:4", 1, 400);  // global batch 128: 15 steps per epoch
  for (int m = 0; m < 4; ++m) job.start(m);
  ASSERT_TRUE(job.saw("step 30/")) << job.outputs();
  job.cluster.kill_all(1);
  ASSERT_TRUE(job.saw("4 -> 3 workers (failure", 60)) << job.outputs();
  job.cluster.kill_all(2);
  ASSERT_TRUE(job.saw("3 -> 2 workers (failure", 60)) << job.outputs();
  job.expect_finished({0, 3}, 2, 15);
}

// The first machine, which holds rank 0, dies with everything on it. The store lives apart, so the
// others agree on a new rank 0 among them and finish.
TEST(ElasticCluster, LosingTheFirstMachineIsSurvivableWithTheStoreApart) {
  REQUIRE_CLUSTER();
  ElasticJob job(3, "2:3", 1, 300);
  for (int m = 0; m < 3; ++m) job.start(m);
  ASSERT_TRUE(job.saw("step 40/")) << job.outputs();
  job.cluster.kill_all(0);
  ASSERT_TRUE(job.saw("3 -> 2 workers (failure", 60)) << job.outputs();
  job.expect_finished({1, 2}, 2, 20);
}

// ZeRO stage 2 on 2 machines x 2 workers: each rank's optimizer slices are mirrored by the rank in
// the same place on the other machine. Machine 1 loses power; machine 0's two workers put the
// whole state together from their own slices and their mirrors of machine 1's, and finish.
TEST(ElasticCluster, ZeroShardsOfAMachineThatLosesPowerLiveOnInTheirMirrors) {
  REQUIRE_CLUSTER();
  ElasticJob job(2, "1:2", 2, 150);  // global batch 128: 15 steps per epoch
  job.flags = {"--zero-stage", "2"};
  for (int m = 0; m < 2; ++m) job.start(m);
  ASSERT_TRUE(job.saw("step 30/")) << job.outputs();
  ASSERT_NE(job.outputs().find("ZeRO mirrors: each worker also keeps"), std::string::npos) << job.outputs();
  job.cluster.power_off(1);
  ASSERT_TRUE(job.saw("4 -> 2 workers (failure", 60)) << job.outputs();
  job.expect_finished({0}, 2, 15);
}

}  // namespace
}  // namespace lockstep::testing
