// lockstep run, end to end: real launcher processes, real workers, real signals.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <regex>

#include "lockstep/base/cpu_kernels.h"
#include "lockstep/comm/store.h"
#include "cgroup.h"
#include "testing.h"

namespace lockstep::testing {
namespace {

const std::string kLockstep = LOCKSTEP_BINARY;
const std::string kWorker = COMM_WORKER_BINARY;

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

int free_port() {
  comm::StoreServer probe(comm::StoreServerOptions{"127.0.0.1", 0, ""});
  return probe.port();
}

class EnvContract : public ::testing::TestWithParam<int> {};

TEST_P(EnvContract, WorkersSeeTheTorchrunEnvironmentAndCanAllreduce) {
  int n = GetParam();
  Process run(
      {kLockstep, "run", "--nproc-per-node", std::to_string(n), kWorker, "env", "auto", std::to_string(n)},
      {{"OMP_NUM_THREADS", "<unset>"}});
  EXPECT_EQ(run.wait(60), 0) << run.output();
  EXPECT_EQ(count_of(run.output(), "env ok rank"), static_cast<std::size_t>(n)) << run.output();
  for (int r = 0; r < n; ++r)
    EXPECT_NE(run.output().find("[rank " + std::to_string(r) + "] env ok rank " + std::to_string(r) + " of " +
                                std::to_string(n) + " on shm"),
              std::string::npos)
        << run.output();
}
INSTANTIATE_TEST_SUITE_P(Workers, EnvContract, ::testing::Values(1, 2, 4));

// Workers keep freed memory (no per-step page faults for re-allocated activations), unless
// the user set glibc tunables of their own.
TEST(Launch, WorkersGetMallocTunablesUnlessTheUserSetSome) {
  Process ours({kLockstep, "run", "--nproc-per-node", "1", "/usr/bin/env"}, {{"GLIBC_TUNABLES", "<unset>"}});
  EXPECT_EQ(ours.wait(30), 0) << ours.output();
  EXPECT_NE(ours.output().find("GLIBC_TUNABLES=glibc.malloc.mmap_threshold=268435456:"), std::string::npos)
      << ours.output();
  Process theirs({kLockstep, "run", "--nproc-per-node", "1", "/usr/bin/env"},
                 {{"GLIBC_TUNABLES", "glibc.malloc.arena_max=2"}});
  EXPECT_EQ(theirs.wait(30), 0) << theirs.output();
  EXPECT_NE(theirs.output().find("GLIBC_TUNABLES=glibc.malloc.arena_max=2\n"), std::string::npos)
      << theirs.output();
}

// --torch-backend reaches Python workers as LOCKSTEP_TORCH_BACKEND (lockstep_torch creates the
// default process group with it); without the flag the variable is not set.
TEST(Launch, TorchBackendIsExportedOnlyWhenGiven) {
  Process asked({kLockstep, "run", "--nproc-per-node", "1", "--torch-backend", "cpu:lockstep,cuda:nccl",
                 "/usr/bin/env"},
                {{"LOCKSTEP_TORCH_BACKEND", "<unset>"}});
  EXPECT_EQ(asked.wait(30), 0) << asked.output();
  EXPECT_NE(asked.output().find("LOCKSTEP_TORCH_BACKEND=cpu:lockstep,cuda:nccl\n"), std::string::npos)
      << asked.output();
  Process plain({kLockstep, "run", "--nproc-per-node", "1", "/usr/bin/env"},
                {{"LOCKSTEP_TORCH_BACKEND", "<unset>"}});
  EXPECT_EQ(plain.wait(30), 0) << plain.output();
  EXPECT_EQ(plain.output().find("LOCKSTEP_TORCH_BACKEND="), std::string::npos) << plain.output();
}

// The kernels a worker's OpenBLAS multiplies with ("" when libblas.so.3 is not OpenBLAS).
std::string worker_blas_core(const std::map<std::string, std::string>& env) {
  Process run({kLockstep, "run", "--nproc-per-node", "1", kWorker, "blas", "none"}, env);
  EXPECT_EQ(run.wait(30), 0) << run.output();
  std::smatch m;
  const std::string out = run.output();
  return std::regex_search(out, m, std::regex("blas core '([^']*)'")) ? m[1].str() : "(no line)";
}

// Workers multiply with the best kernels this CPU runs, whether or not OpenBLAS recognises it
// (Debian 12's does not know Emerald Rapids and picks its SSE3 kernels there) ...
TEST(Launch, WorkersMultiplyWithTheCpusBestBlasKernels) {
  const std::string core = worker_blas_core({{"OPENBLAS_CORETYPE", "<unset>"}});
  if (core.empty()) GTEST_SKIP() << "libblas.so.3 is not OpenBLAS here";
  const std::string best = best_openblas_core(this_cpus_flags());
  EXPECT_EQ(openblas_core_level(core), openblas_core_level(best)) << core << " on a CPU that runs " << best;
}

// ... unless the user chose some: the generic kernels every x86-64 CPU runs stay the choice.
TEST(Launch, TheUsersBlasKernelsWin) {
  const std::string core = worker_blas_core({{"OPENBLAS_CORETYPE", "Prescott"}});
  if (core.empty()) GTEST_SKIP() << "libblas.so.3 is not OpenBLAS here";
  EXPECT_EQ(core, "Prescott");
}

TEST(Launch, TwoAgentsOnOneMachineFormOneJobOverGloo) {
  std::string port = std::to_string(free_port());
  auto agent = [&](int node) {
    return std::make_unique<Process>(
        std::vector<std::string>{kLockstep, "run", "--nnodes", "2", "--node-rank", std::to_string(node),
                                 "--master-addr", "127.0.0.1", "--master-port", port, "--nproc-per-node", "2",
                                 "--run-id", "two-nodes", kWorker, "env", "gloo", "4"},
        std::map<std::string, std::string>{{"LOCKSTEP_TOKEN", "shared-secret"}});
  };
  auto node0 = agent(0), node1 = agent(1);
  int code0 = node0->wait(120), code1 = node1->wait(120);
  EXPECT_EQ(code0, 0) << "node 0:\n" << node0->output() << "node 1:\n" << node1->output();
  EXPECT_EQ(code1, 0) << "node 0:\n" << node0->output() << "node 1:\n" << node1->output();
  std::string all = node0->output() + node1->output();
  EXPECT_EQ(count_of(all, " of 4 on gloo"), 4u) << all;
  for (int r : {0, 1}) EXPECT_NE(node0->output().find("env ok rank " + std::to_string(r)), std::string::npos);
  for (int r : {2, 3}) EXPECT_NE(node1->output().find("env ok rank " + std::to_string(r)), std::string::npos);
}

TEST(Launch, WhenNodeZerosLauncherDiesTheOtherNodeStopsWithinSeconds) {
  std::string port = std::to_string(free_port());
  auto agent = [&](int node) {
    return std::make_unique<Process>(
        std::vector<std::string>{kLockstep, "run", "--nnodes", "2", "--node-rank", std::to_string(node),
                                 "--master-port", port, "--nproc-per-node", "1", "--grace-period", "1",
                                 kWorker, "loop", "gloo"},
        std::map<std::string, std::string>{{"LOCKSTEP_TOKEN", "secret"}});
  };
  auto node0 = agent(0), node1 = agent(1);
  ASSERT_TRUE(node1->read_until("ready rank 1", 60)) << node1->output();
  ASSERT_EQ(::kill(node0->pid(), SIGKILL), 0);
  auto start = std::chrono::steady_clock::now();
  int code = node1->wait(60);
  EXPECT_NE(code, 0) << node1->output();
  EXPECT_LT(seconds_since(start), 10) << node1->output();
  EXPECT_NE(node1->output().find("job FAILED"), std::string::npos) << node1->output();
}

TEST(Launch, AKilledWorkerStopsTheJobWithASummaryNamingIt) {
  const double grace = 2;
  auto start = std::chrono::steady_clock::now();
  Process run({kLockstep, "run", "--nproc-per-node", "3", "--grace-period", "2", kWorker, "die", "shm"});
  int code = run.wait(60);
  double took = seconds_since(start);
  EXPECT_EQ(code, 128 + SIGKILL) << run.output();
  EXPECT_LT(took, grace + 5) << run.output();
  EXPECT_NE(run.output().find("first failure: rank 1 (local rank 1"), std::string::npos) << run.output();
  EXPECT_NE(run.output().find("killed by SIGKILL"), std::string::npos) << run.output();
  EXPECT_NE(run.output().find("| rank 1 is about to be killed"), std::string::npos) << run.output();
  EXPECT_EQ(count_of(run.output(), "finished 20 steps"), 0u) << run.output();
  EXPECT_EQ(run.output().find("out of memory"), std::string::npos) << run.output();
}

// A worker that outgrows its machine's memory (a 256 MiB cgroup here) dies of the kernel's OOM
// killer, which sends SIGKILL like anyone; the report says it ran out of memory, and of which limit.
TEST(Launch, AWorkerKilledForMemoryIsNamedAsOutOfMemory) {
  const auto limit = lockstep::testing::Cgroup::memory(256 << 20);
  if (limit.path().empty()) GTEST_SKIP() << "no memory cgroup can be made here (needs root)";
  Process run(limit.around({kLockstep, "run", "--nproc-per-node", "1", "/usr/bin/python3", "-c",
                            "import sys; print('allocating', flush=True); x = b'x' * (1 << 30); print(len(x))"}));
  EXPECT_EQ(run.wait(120), 128 + SIGKILL) << run.output();
  EXPECT_NE(run.output().find("ran out of memory: the kernel's OOM killer ended it (SIGKILL) when its memory "
                              "cgroup's limit of 256 MiB was reached"),
            std::string::npos)
      << run.output();
  // An ordinary SIGKILL is not called that (AKilledWorkerStopsTheJobWithASummaryNamingIt).
}

TEST(Launch, WithARestartTheJobRunsAgainAndSucceeds) {
  Process run({kLockstep, "run", "--nproc-per-node", "3", "--max-restarts", "1", "--grace-period", "2",
               kWorker, "die", "shm"});
  EXPECT_EQ(run.wait(60), 0) << run.output();
  EXPECT_NE(run.output().find("restarting the whole group"), std::string::npos) << run.output();
  EXPECT_EQ(count_of(run.output(), "finished 20 steps"), 3u) << run.output();
}

class StalledJob : public ::testing::TestWithParam<std::string> {};

// Rank 1 stays alive but never issues its second collective; rank 0's times out. The report
// says which rank was behind and where, from the ranks' flight records.
TEST_P(StalledJob, TheReportSaysWhichRankWasBehindAndAtWhichCollective) {
  Process run({kLockstep, "run", "--nproc-per-node", "2", "--grace-period", "1", kWorker, "stall", GetParam()},
              {{"LOCKSTEP_TIMEOUT", "3"}, {"LOCKSTEP_PEER_CHECK", "1"}});
  EXPECT_EQ(run.wait(60), 4) << run.output();  // comm_worker's exit code for a TimeoutError
  const std::string& out = run.output();
  const auto records = out.find("collectives (the ranks' flight records, furthest behind first):");
  ASSERT_NE(records, std::string::npos) << out;
  const auto behind = out.find("rank 1: idle for", records), failed = out.find("rank 0: failed in allreduce", records);
  EXPECT_NE(behind, std::string::npos) << out;
  EXPECT_NE(failed, std::string::npos) << out;
  EXPECT_LT(behind, failed) << "the rank furthest behind comes first";
  EXPECT_NE(out.find("since allreduce (f32 x 1, sum) #0 finished", records), std::string::npos) << out;
}
INSTANTIATE_TEST_SUITE_P(Backends, StalledJob, ::testing::Values("shm", "gloo"));

TEST(Launch, TimeoutStopsAHangingJob) {
  auto start = std::chrono::steady_clock::now();
  Process run({kLockstep, "run", "--nproc-per-node", "2", "--timeout", "1", "--grace-period", "1",
               "/bin/sleep", "60"});
  EXPECT_EQ(run.wait(30), 124) << run.output();
  EXPECT_LT(seconds_since(start), 1 + 1 + 5);
  EXPECT_NE(run.output().find("--timeout"), std::string::npos) << run.output();
}

bool process_gone(pid_t pid) {
  if (::kill(pid, 0) != 0) return true;
  // A zombie no one reaped yet is gone too: it runs nothing and holds nothing.
  std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  auto close_paren = stat.rfind(')');
  return close_paren != std::string::npos && stat.size() > close_paren + 2 && stat[close_paren + 2] == 'Z';
}

TEST(Launch, InterruptStopsEveryWorkerAndLeavesNothingBehind) {
  Process run({kLockstep, "run", "--nproc-per-node", "2", "--grace-period", "3", kWorker, "loop", "shm"});
  ASSERT_TRUE(run.read_until("ready rank", 30, 2)) << run.output();
  std::vector<pid_t> workers;
  std::smatch m;
  std::string out = run.output();
  std::regex pid_re("ready rank \\d+ pid (\\d+)");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), pid_re); it != std::sregex_iterator(); ++it)
    workers.push_back(static_cast<pid_t>(std::stoi((*it)[1])));
  ASSERT_EQ(workers.size(), 2u);
  auto start = std::chrono::steady_clock::now();
  ASSERT_EQ(::kill(run.pid(), SIGINT), 0);
  EXPECT_EQ(run.wait(30), 128 + SIGINT) << run.output();
  EXPECT_LT(seconds_since(start), 3 + 5);
  for (pid_t pid : workers) EXPECT_TRUE(process_gone(pid)) << "worker " << pid << " survived the launcher";
  for (const auto& name : shm_segments())
    for (pid_t pid : workers) EXPECT_NE(name.rfind("lockstep-" + std::to_string(pid) + "-", 0), 0u) << name;
}

TEST(Launch, TwoJobsAtOnceWithoutNamingPorts) {
  Process a({kLockstep, "run", "--nproc-per-node", "2", kWorker, "env", "auto", "2"});
  Process b({kLockstep, "run", "--nproc-per-node", "2", kWorker, "env", "auto", "2"});
  EXPECT_EQ(a.wait(60), 0) << a.output();
  EXPECT_EQ(b.wait(60), 0) << b.output();
  EXPECT_EQ(count_of(a.output() + b.output(), "env ok rank"), 4u);
}

TEST(Launch, APlainPytorchDdpScriptRunsUnmodifiedAndRanksAgree) {
  if (std::system(TORCH_PYTHON " -c 'import torch.distributed' 2>/dev/null") != 0)
    GTEST_SKIP() << TORCH_PYTHON " has no torch (Debian's python3-torch is not installed)";
  Process run({kLockstep, "run", "--nproc-per-node", "2", TORCH_PYTHON, DDP_SCRIPT});
  ASSERT_EQ(run.wait(180), 0) << run.output();
  std::regex sum_re("PARAMS rank=(\\d) world=2 sum=(\\S+)");
  std::map<std::string, std::string> sums;
  std::string out = run.output();
  for (auto it = std::sregex_iterator(out.begin(), out.end(), sum_re); it != std::sregex_iterator(); ++it)
    sums[(*it)[1]] = (*it)[2];
  ASSERT_EQ(sums.size(), 2u) << out;
  EXPECT_EQ(sums["0"], sums["1"]) << out;
}

struct BadInput {
  std::string name;
  std::vector<std::string> args;
  std::string expect;  // in the one-line error
};

class BadInputs : public ::testing::TestWithParam<BadInput> {};

TEST_P(BadInputs, OneLineErrorNonZeroExitWithinTenSeconds) {
  std::vector<std::string> argv{kLockstep, "run"};
  for (const auto& a : GetParam().args) argv.push_back(a);
  auto start = std::chrono::steady_clock::now();
  Process run(argv);
  int code = run.wait(30);
  EXPECT_NE(code, 0) << run.output();
  if (GetParam().name.rfind("Unreachable", 0) != 0) {
    EXPECT_EQ(code, 2) << "bad input exits 2: " << run.output();
  }
  EXPECT_LT(seconds_since(start), 10);
  EXPECT_NE(run.output().find(GetParam().expect), std::string::npos) << run.output();
  EXPECT_EQ(count_of(run.output(), "\n"), 1u) << "expected one line:\n" << run.output();
}

INSTANTIATE_TEST_SUITE_P(
    Launch, BadInputs,
    ::testing::Values(
        BadInput{"ProgramNotFound", {"--nproc-per-node", "2", "no-such-program-xyz"}, "not found"},
        BadInput{"ZeroWorkers", {"--nproc-per-node", "0", "/bin/true"}, "--nproc-per-node"},
        BadInput{"NodeRankTooLarge",
                 {"--nnodes", "2", "--node-rank", "2", "--master-port", "1234", "/bin/true"},
                 "--node-rank 2 is not below --nnodes 2"},
        BadInput{"UnreachableMaster",
                 {"--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port",
                  std::to_string(free_port()), "--join-timeout", "2", "/bin/true"},
                 "could not reach"},
        BadInput{"UnreachableMasterWithinTimeout",
                 {"--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port",
                  std::to_string(free_port()), "--timeout", "2", "/bin/true"},
                 "could not reach"},
        BadInput{"NotANumber", {"--nproc-per-node", "many", "/bin/true"}, "not a number"},
        BadInput{"UnknownOption",
                 {"--frobnicate", "/bin/true"},
                 "unknown option --frobnicate before the program"},
        BadInput{"NotATorchBackend",
                 {"--torch-backend", "Lock Step", "/bin/true"},
                 "--torch-backend 'Lock Step' is not a torch.distributed backend's name"}),
    [](const ::testing::TestParamInfo<BadInput>& param) { return param.param.name; });

// An empty sweep used to divide by zero in every rank (SIGFPE): now it is refused before any
// process starts.
TEST(Bench, AnEmptySweepIsOneLineAndExitTwo) {
  auto start = std::chrono::steady_clock::now();
  Process bench({kLockstep, "bench", "allreduce", "--min-bytes", "0", "--max-bytes", "0"});
  EXPECT_EQ(bench.wait(30), 2) << bench.output();
  EXPECT_LT(seconds_since(start), 10);
  EXPECT_EQ(
      bench.output(),
      "lockstep: error: --min-bytes 0 is below one f32 element (4 bytes): the sweep starts at one element at "
      "least\n");
}

TEST(Launch, AWrongTokenIsRefusedWithAOneLineError) {
  std::string port = std::to_string(free_port());
  Process node0({kLockstep, "run", "--nnodes", "2", "--node-rank", "0", "--master-port", port,
                 "--join-timeout", "5", "/bin/true"},
                {{"LOCKSTEP_TOKEN", "right"}});
  auto start = std::chrono::steady_clock::now();
  Process node1({kLockstep, "run", "--nnodes", "2", "--node-rank", "1", "--master-port", port,
                 "--join-timeout", "20", "/bin/true"},
                {{"LOCKSTEP_TOKEN", "wrong"}});
  EXPECT_NE(node1.wait(30), 0) << node1.output();
  EXPECT_LT(seconds_since(start), 10);
  EXPECT_NE(node1.output().find("LOCKSTEP_TOKEN"), std::string::npos) << node1.output();
  EXPECT_EQ(count_of(node1.output(), "\n"), 1u) << node1.output();
  EXPECT_NE(node0.wait(30), 0);  // node 1 never joined: node 0 gives up after --join-timeout
  EXPECT_NE(node0.output().find("not every node joined"), std::string::npos) << node0.output();
}

// /dev/shm too small for the shm backend's segment (a 1 MiB tmpfs, in a mount namespace of the
// test's own): the worker says so and exits 1. Sizing the segment without reserving its pages made
// the first touch past the tmpfs's end a SIGBUS instead.
TEST(Launch, AFullDevShmIsAClearErrorNotABusError) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to mount a small /dev/shm in a mount namespace";
  Process probe({"/usr/bin/unshare", "--mount", "--propagation", "private", "/bin/true"});
  if (probe.wait(30) != 0) GTEST_SKIP() << "cannot make a private mount namespace here (a chroot?): " << probe.output();
  Process run({"/usr/bin/unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
               "mount -t tmpfs -o size=1m tmpfs /dev/shm && exec \"$@\"", "sh", kLockstep, "run",
               "--nproc-per-node", "2", kWorker, "conformance", "shm", std::to_string(4 << 20)});
  const int code = run.wait(60);
  if (run.output().find("mount: ") != std::string::npos) GTEST_SKIP() << "cannot mount here: " << run.output();
  EXPECT_EQ(code, 1) << run.output();
  EXPECT_EQ(run.output().find("SIGBUS"), std::string::npos) << run.output();
  EXPECT_NE(run.output().find("cannot reserve shared memory /lockstep-"), std::string::npos) << run.output();
  EXPECT_NE(run.output().find("/dev/shm has"), std::string::npos) << run.output();
}

// Successive jobs on one --master-port (the doctor's phases) race: node 1's next launcher can
// reach the previous job's store while it winds down, announce itself there, and then find
// node 0's new store in its place. Made deterministic here: the previous store stays up until
// node 1 has announced itself on it. Node 1 must join again on the new store, not wait there for
// keys it wrote on the old one until --join-timeout.
TEST(Launch, ANodeThatJoinedAPreviousJobsStoreOnItsPortJoinsAgain) {
  const int port = free_port();
  auto previous = std::make_unique<comm::StoreServer>(comm::StoreServerOptions{"127.0.0.1", port, "secret"});
  auto agent = [&](int node) {
    return std::make_unique<Process>(
        std::vector<std::string>{kLockstep, "run", "--nnodes", "2", "--node-rank", std::to_string(node),
                                 "--master-addr", "127.0.0.1", "--master-port", std::to_string(port),
                                 "--nproc-per-node", "1", "--run-id", "next", "--join-timeout", "60", kWorker,
                                 "env", "gloo", "2"},
        std::map<std::string, std::string>{{"LOCKSTEP_TOKEN", "secret"}});
  };
  auto node1 = agent(1);
  comm::StoreClient watcher(comm::StoreClientOptions{"127.0.0.1", port, "secret", comm::Seconds(10)});
  ASSERT_NO_THROW(watcher.wait({"launch/next/agent/1"}, comm::Seconds(30))) << node1->output();
  const auto start = std::chrono::steady_clock::now();
  previous.reset();
  auto node0 = agent(0);
  const int code0 = node0->wait(90), code1 = node1->wait(90);
  EXPECT_EQ(code1, 0) << "node 1:\n" << node1->output() << "node 0:\n" << node0->output();
  EXPECT_EQ(code0, 0) << "node 0:\n" << node0->output();
  EXPECT_LT(seconds_since(start), 45) << "joined only at the join timeout";
  EXPECT_NE(node1->output().find("joining again"), std::string::npos) << node1->output();
  EXPECT_EQ(count_of(node0->output() + node1->output(), " of 2 on gloo"), 2u);
}

}  // namespace
}  // namespace lockstep::testing
