// A real Slurm on two machines (network namespaces, testing/cluster.h): munged, slurmctld on
// machine 0 and one slurmd per machine, from Debian's slurm-wlm and munge, configured in a temp
// dir. The Fashion-MNIST example runs as an HPC user would start it: `srun` with no launcher
// (the rendezvous reads Slurm's variables), and an `sbatch` script that calls `lockstep run` once
// per machine. Each machine's /etc/hosts (bind-mounted in its own mount namespace) names both
// machines, as a cluster's DNS would. Skipped, saying why, where namespaces cannot be made,
// Slurm is not installed, or slurmd cannot start (it needs a cgroup v1 hierarchy).
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>

#include "cluster.h"
#include "testing.h"

namespace lockstep::testing {
namespace {

constexpr const char* kTools[] = {"munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol"};

std::optional<std::string> slurm_missing() {
  for (const char* tool : kTools)
    if (std::system(("command -v " + std::string(tool) + " > /dev/null").c_str()) != 0)
      return std::string(tool) + " is not installed (apt-get install slurm-wlm munge; ./scripts/test installs them)";
  return std::nullopt;
}

void write(const std::string& path, const std::string& text, mode_t mode = 0644) {
  std::ofstream(path) << text;
  ::chmod(path.c_str(), mode);
}

// munged, slurmctld and the slurmds of `cluster`, up until destroyed (the processes die with
// their Process objects and the cluster's namespaces).
class Slurm {
 public:
  Slurm(const VirtualCluster& cluster, const TempDir& dir) : cluster_(cluster), dir_(dir) {
    ::chmod(dir.path().c_str(), 0755);  // munged wants its socket's directory reachable
    std::string key(1024, '\0');
    std::ifstream("/dev/urandom").read(key.data(), static_cast<std::streamsize>(key.size()));
    write(dir / "munge.key", key, 0600);
    std::string hosts = "127.0.0.1 localhost\n";
    for (int m = 0; m < cluster.machines(); ++m) {
      hosts += cluster.address(m) + " " + cluster.hostname(m) + "\n";
      std::filesystem::create_directories(dir / ("spool-" + cluster.hostname(m)));
    }
    write(dir / "hosts", hosts);
    std::filesystem::create_directories(dir / "state");
    write(dir / "slurm.conf", config());
    write(dir / "cgroup.conf", "CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n");
  }

  // Starts the daemons; the reason when slurmd cannot run here.
  std::optional<std::string> start() {
    munged_ = std::make_unique<Process>(std::vector<std::string>{
        "/usr/sbin/munged", "--foreground", "--force", "--socket", dir_ / "munge.sock", "--key-file",
        dir_ / "munge.key", "--pid-file", dir_ / "munged.pid", "--log-file", dir_ / "munged.log", "--seed-file",
        dir_ / "munged.seed"});
    if (!munged_->read_until("Created socket", 30)) return "munged did not start:\n" + munged_->output();
    daemons_.push_back(std::make_unique<Process>(cluster_.on(0, {"/usr/sbin/slurmctld", "-D", "-f", conf()})));
    if (!daemons_.back()->read_until("Running as primary controller", 60))
      return "slurmctld did not start:\n" + daemons_.back()->output();
    for (int m = 0; m < cluster_.machines(); ++m) {
      daemons_.push_back(std::make_unique<Process>(cluster_.on(
          m, {"/bin/sh", "-c",
              "mount --bind " + dir_ / "hosts" + " /etc/hosts && exec /usr/sbin/slurmd -D -N " + cluster_.hostname(m) +
                  " -f " + conf()})));
      if (!daemons_.back()->read_until("slurmd started on", 60))
        return "slurmd cannot run here:\n" + daemons_.back()->output();
    }
    return std::nullopt;
  }

  std::string conf() const { return dir_ / "slurm.conf"; }

  // argv on machine 0 (where jobs are submitted), with its /etc/hosts.
  std::vector<std::string> submit(const std::string& command) const {
    return cluster_.on(0, {"/bin/sh", "-c", "mount --bind " + dir_ / "hosts" + " /etc/hosts && exec " + command});
  }

 private:
  std::string config() const {
    const std::string d = dir_.path();
    std::string nodes, names;
    for (int m = 0; m < cluster_.machines(); ++m) {
      nodes += "NodeName=" + cluster_.hostname(m) + " NodeAddr=" + cluster_.address(m) + " CPUs=2 State=UNKNOWN\n";
      names += (m ? "," : "") + cluster_.hostname(m);
    }
    return "ClusterName=lockstep\nSlurmctldHost=" + cluster_.hostname(0) + "(" + cluster_.address(0) +
           ")\nSlurmUser=root\nSlurmdUser=root\nAuthType=auth/munge\nAuthInfo=socket=" + d +
           "/munge.sock\nCredType=cred/munge\nStateSaveLocation=" + d + "/state\nSlurmdSpoolDir=" + d +
           "/spool-%n\nSlurmctldPidFile=" + d + "/slurmctld.pid\nSlurmdPidFile=" + d +
           "/slurmd-%n.pid\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nSwitchType=switch/none\n"
           "MpiDefault=none\nSchedulerType=sched/builtin\nSelectType=select/linear\nReturnToService=2\n"
           "SlurmdParameters=config_overrides\nJobAcctGatherType=jobacct_gather/none\n"
           "AccountingStorageType=accounting_storage/none\n" +
           nodes + "PartitionName=all Nodes=" + names + " Default=YES MaxTime=INFINITE State=UP\n";
  }

  const VirtualCluster& cluster_;
  const TempDir& dir_;
  std::unique_ptr<Process> munged_;
  std::vector<std::unique_ptr<Process>> daemons_;
};

std::string trainer(const std::string& out) {
  return std::string(FASHION_MNIST) +
         " --model mlp --train-limit 2048 --eval-limit 200 --max-steps 12 --logging-steps 4 --disable-tqdm"
         " --output-dir " +
         out;
}

#define REQUIRE_SLURM(slurm)                                            \
  if (auto why = VirtualCluster::unavailable()) GTEST_SKIP() << *why;   \
  if (auto why = slurm_missing()) GTEST_SKIP() << *why;

// srun -N2 --ntasks-per-node=2 of the example, no lockstep run: 4 ranks from SLURM_PROCID and
// friends, machine 0 (the first host of SLURM_JOB_NODELIST) hosting the store on a port from
// SLURM_JOB_ID; hier picked for 2 machines x 2. Then an sbatch script that runs `lockstep run`
// once per machine with srun, as torchrun users write theirs.
TEST(SlurmCluster, SrunWithoutTheLauncherAndSbatchWithItTrainAcrossTwoMachines) {
  REQUIRE_SLURM();
  VirtualCluster cluster({2, "1gbit"});
  TempDir dir("slurm");
  Slurm slurm(cluster, dir);
  if (auto why = slurm.start()) GTEST_SKIP() << *why;
  const std::map<std::string, std::string> env = {{"SLURM_CONF", slurm.conf()}};

  Process srun(slurm.submit("srun --nodes=2 --ntasks-per-node=2 " + trainer(dir / "srun")), env);
  EXPECT_EQ(srun.wait(300), 0) << srun.output();
  EXPECT_NE(srun.output().find("4 workers"), std::string::npos) << srun.output();
  EXPECT_NE(srun.output().find("backend hier"), std::string::npos) << srun.output();
  EXPECT_EQ(count_of(srun.output(), "all 4 replicas hold the same parameters"), 1u) << srun.output();

  const std::string script = dir / "job.sh";
  write(script,
        "#!/bin/sh\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --output=" + dir / "job.out" +
            "\nexport LOCKSTEP_TOKEN=the-jobs-secret\nmaster=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n"
            "srun sh -c \"exec " + LOCKSTEP_BINARY +
            " run --nnodes $SLURM_JOB_NUM_NODES --node-rank \\$SLURM_NODEID --nproc-per-node 2"
            " --master-addr $master --master-port 29500 " + trainer(dir / "sbatch") + "\"\n",
        0755);
  Process sbatch(slurm.submit("sbatch --wait " + script), env);
  EXPECT_EQ(sbatch.wait(300), 0) << sbatch.output();
  const std::string out = read_file(dir / "job.out");
  EXPECT_EQ(count_of(out, "all 4 replicas hold the same parameters"), 1u) << out;
  EXPECT_NE(out.find("4 workers"), std::string::npos) << out;  // machine 1's launcher's two joined
  EXPECT_EQ(out.find("LOCKSTEP_TOKEN is not set"), std::string::npos) << out;
  EXPECT_GT(cluster.counters(1).tx_bytes, 1u << 20);
}

}  // namespace
}  // namespace lockstep::testing
