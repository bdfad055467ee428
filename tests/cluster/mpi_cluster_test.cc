// mpirun across two machines (network namespaces, testing/cluster.h) with the mpi backend, as
// an HPC user starts a job without lockstep run: mpirun on machine 0 starts Open MPI's daemon on
// machine 1 through its rsh agent (here a script that enters machine 1's namespaces instead of
// ssh), the ranks learn who they are from OMPI_COMM_WORLD_* and have no store. Skipped, saying
// why, where namespaces cannot be made or mpirun is missing.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <fstream>

#include "cluster.h"
#include "testing.h"

namespace lockstep::testing {
namespace {

std::string quoted(const std::string& word) {
  std::string out = "'";
  for (char c : word) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Open MPI calls its rsh agent as `agent HOST COMMAND...`; this one runs COMMAND on the machine
// whose address is HOST, in that machine's namespaces.
std::string write_rsh_agent(const VirtualCluster& cluster, const TempDir& dir) {
  const std::string path = dir / "netns-rsh";
  std::ofstream script(path);
  script << "#!/bin/sh\nhost=$1; shift\ncase \"$host\" in\n";
  for (int m = 0; m < cluster.machines(); ++m) {
    script << "  " << cluster.address(m) << "|" << cluster.hostname(m) << ") exec";
    for (const auto& word : cluster.on(m, {"/bin/sh", "-c"})) script << " " << quoted(word);
    script << " \"$*\" ;;\n";
  }
  script << "esac\necho \"netns-rsh: no machine $host\" >&2\nexit 1\n";
  script.close();
  ::chmod(path.c_str(), 0755);
  return path;
}

// mpirun on machine 0 with two ranks on each machine, everything over TCP on the machines' link.
std::vector<std::string> mpirun(const VirtualCluster& cluster, const std::string& agent,
                                const std::vector<std::string>& program) {
  std::vector<std::string> argv = {"mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "4",
                                   "--host", cluster.address(0) + ":2," + cluster.address(1) + ":2",
                                   "--mca", "plm_rsh_agent", agent,
                                   "--mca", "oob_tcp_if_include", VirtualCluster::kInterface,
                                   "--mca", "btl_tcp_if_include", VirtualCluster::kInterface,
                                   "--mca", "btl", "tcp,self",
                                   "-x", "PATH", "env", "-u", "RANK", "-u", "WORLD_SIZE"};
  argv.insert(argv.end(), program.begin(), program.end());
  return cluster.on(0, argv);
}

#define REQUIRE_CLUSTER_AND_MPIRUN()                                                       \
  if (auto why = VirtualCluster::unavailable()) GTEST_SKIP() << *why;                      \
  if (std::system("command -v mpirun > /dev/null") != 0) GTEST_SKIP() << "mpirun is not installed";

// Collectives and point-to-point across the machines; the ranks' point-to-point addresses
// (exchanged with an MPI allgather) are the machines' own, since there is no master to route to.
TEST(MpiCluster, MpirunAcrossTwoMachinesRunsTheCollectivesAndPointToPointTables) {
  REQUIRE_CLUSTER_AND_MPIRUN();
  VirtualCluster cluster({2, "1gbit"});
  TempDir dir("mpi-cluster");
  const std::string agent = write_rsh_agent(cluster, dir);
  for (const char* table : {"conformance", "p2p"}) {
    Process job(mpirun(cluster, agent, {COMM_WORKER, table, "mpi"}));
    EXPECT_EQ(job.wait(300), 0) << table << ":\n" << job.output();
    EXPECT_EQ(count_of(job.output(), " 0 failures on mpi") + count_of(job.output(), " 0 point-to-point failures on mpi"),
              4u)
        << job.output();
  }
  // Both machines carried the job's traffic: machine 1's ranks really ran on machine 1.
  EXPECT_GT(cluster.counters(1).tx_bytes, 1u << 20);
}

// hier under mpirun with MPI as its engine between machines (LOCKSTEP_HIER_ACROSS=mpi): shared
// memory inside each machine, one MPI communicator per local index between them; MASTER_ADDR and
// MASTER_PORT give the store that the machines' shared memory meets through.
TEST(MpiCluster, HierCanUseMpiBetweenMachines) {
  REQUIRE_CLUSTER_AND_MPIRUN();
  VirtualCluster cluster({2, "1gbit"});
  TempDir dir("mpi-hier");
  const std::string agent = write_rsh_agent(cluster, dir);
  const std::vector<std::string> env = {"LOCKSTEP_HIER_ACROSS=mpi", "MASTER_ADDR=" + cluster.address(0),
                                        "MASTER_PORT=29433", "LOCKSTEP_TOKEN=mpi-hier"};
  std::vector<std::string> program = env;
  program.insert(program.end(), {COMM_WORKER, "conformance", "hier", "8192"});
  Process job(mpirun(cluster, agent, program));
  EXPECT_EQ(job.wait(300), 0) << job.output();
  EXPECT_EQ(count_of(job.output(), " 0 failures on hier"), 4u) << job.output();
  EXPECT_NE(job.output().find("shared memory inside, mpi between machines over 2 groups"), std::string::npos)
      << job.output();
  EXPECT_GT(cluster.counters(1).tx_bytes, 1u << 20);
}

}  // namespace
}  // namespace lockstep::testing
