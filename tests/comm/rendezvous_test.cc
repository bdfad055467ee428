#include "lockstep/comm/rendezvous.h"

#include <gtest/gtest.h>

#include <thread>

#include "lockstep/error.h"
#include "testing.h"

namespace lockstep::testing {
namespace {

using comm::rendezvous_info_from;

std::string config_error(const std::map<std::string, std::string>& env) {
  try {
    rendezvous_info_from(env);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(Rendezvous, ReadsTorchrunVariables) {
  auto info = rendezvous_info_from({{"RANK", "3"},
                                    {"WORLD_SIZE", "4"},
                                    {"LOCAL_RANK", "1"},
                                    {"LOCAL_WORLD_SIZE", "2"},
                                    {"MASTER_ADDR", "10.1.2.3"},
                                    {"MASTER_PORT", "29500"},
                                    {"LOCKSTEP_TOKEN", "s"},
                                    {"LOCKSTEP_RUN_ID", "job7"}});
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.world_size, 4);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 2);
  EXPECT_EQ(info.master_addr, "10.1.2.3");
  EXPECT_EQ(info.master_port, 29500);
  EXPECT_EQ(info.token, "s");
  EXPECT_EQ(info.run_id, "job7");
}

TEST(Rendezvous, ReadsOpenMpiVariablesWhenRankIsUnset) {
  auto info = rendezvous_info_from({{"OMPI_COMM_WORLD_RANK", "1"},
                                    {"OMPI_COMM_WORLD_SIZE", "2"},
                                    {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_TRUE(info.from_mpirun);
  EXPECT_EQ(info.rank, 1);
  EXPECT_EQ(info.world_size, 2);
}

TEST(Rendezvous, ReadsSlurmVariablesWhenRankIsUnset) {
  auto info = rendezvous_info_from({{"SLURM_PROCID", "5"},
                                    {"SLURM_NTASKS", "8"},
                                    {"SLURM_LOCALID", "1"},
                                    {"SLURM_TASKS_PER_NODE", "4(x2)"},
                                    {"SLURM_JOB_NODELIST", "gpu[07-08],cpu1"},
                                    {"SLURM_JOB_ID", "123456"}});
  EXPECT_EQ(info.scheduler, "slurm");
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 4);
  EXPECT_EQ(info.master_addr, "gpu07");
  EXPECT_EQ(info.master_port, 20000 + 123456 % 20000);
  // MASTER_PORT, when the job script sets it, wins over the derived one.
  EXPECT_EQ(
      rendezvous_info_from(
          {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_ID", "1"}, {"MASTER_PORT", "4242"}})
          .master_port,
      4242);
}

TEST(Rendezvous, FirstSlurmHost) {
  EXPECT_EQ(comm::first_slurm_host("node05"), "node05");
  EXPECT_EQ(comm::first_slurm_host("a,b"), "a");
  EXPECT_EQ(comm::first_slurm_host("node[01-04,07],gpu[1-2]"), "node01");
  EXPECT_EQ(comm::first_slurm_host("n[3,5]"), "n3");
}

TEST(Rendezvous, ReadsSageMakerVariablesWhenRankIsUnset) {
  auto info = rendezvous_info_from(
      {{"SM_HOSTS", "[\"algo-1\",\"algo-2\",\"algo-3\"]"}, {"SM_CURRENT_HOST", "algo-2"}});
  EXPECT_EQ(info.scheduler, "sagemaker");
  EXPECT_EQ(info.rank, 1);
  EXPECT_EQ(info.world_size, 3);
  EXPECT_EQ(info.master_addr, "algo-1");
  EXPECT_EQ(info.master_port, 29500);
  EXPECT_NE(
      config_error({{"SM_HOSTS", "[\"algo-1\"]"}, {"SM_CURRENT_HOST", "algo-9"}}).find("SM_CURRENT_HOST"),
      std::string::npos);
}

TEST(Rendezvous, NoVariablesIsAJobOfOne) {
  auto info = rendezvous_info_from({});
  EXPECT_EQ(info.rank, 0);
  EXPECT_EQ(info.world_size, 1);
}

TEST(Rendezvous, BadValuesNameTheVariableAndTheFix) {
  EXPECT_NE(config_error({{"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}).find("RANK is not"), std::string::npos);
  EXPECT_NE(config_error({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}})
                .find("RANK must be below WORLD_SIZE"),
            std::string::npos);
  EXPECT_NE(config_error({{"RANK", "x"}, {"WORLD_SIZE", "2"}}).find("RANK='x' is not an integer"),
            std::string::npos);
  EXPECT_NE(config_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "http"}}).find("MASTER_PORT"),
            std::string::npos);
  EXPECT_NE(config_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}).find("out of range"),
            std::string::npos);
  EXPECT_NE(config_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}}).find("MASTER_PORT"), std::string::npos);
  EXPECT_NE(config_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCKSTEP_STORE_ADDR", "nocolon"}})
                .find("host:port"),
            std::string::npos);
  EXPECT_NE(config_error({{"RANK", "0"},
                          {"WORLD_SIZE", "4"},
                          {"MASTER_PORT", "1"},
                          {"LOCAL_RANK", "2"},
                          {"LOCAL_WORLD_SIZE", "2"}})
                .find("LOCAL_RANK"),
            std::string::npos);
}

TEST(Rendezvous, TwoProcessesClaimingOneRankIsAConfigError) {
  LocalStore store;
  comm::RendezvousInfo info;
  info.world_size = 2;
  info.rank = 1;
  info.store_host = "127.0.0.1";
  info.store_port = store.port();
  info.token = store.token();
  info.timeout = comm::Seconds(5);
  comm::Rendezvous first(info);
  try {
    comm::Rendezvous second(info);
    FAIL() << "a second rank 1 joined";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
  }
}

TEST(Rendezvous, RankZeroHostsTheStoreAtMasterPort) {
  int port;
  {
    comm::StoreServer probe(comm::StoreServerOptions{"127.0.0.1", 0, ""});
    port = probe.port();
  }
  auto make = [&](int rank) {
    comm::RendezvousInfo info;
    info.rank = rank;
    info.world_size = 2;
    info.master_addr = "127.0.0.1";
    info.master_port = port;
    info.token = "shared";
    info.timeout = comm::Seconds(20);
    return info;
  };
  std::vector<float> got(2);
  std::thread other([&] {
    comm::Rendezvous r(make(1));
    auto c = r.communicator();
    float v = 2;
    c->allreduce(&v, 1, comm::DType::f32, comm::ReduceOp::sum)->wait();
    got[1] = v;
  });
  {
    comm::Rendezvous r(make(0));
    auto c = r.communicator();
    float v = 1;
    c->allreduce(&v, 1, comm::DType::f32, comm::ReduceOp::sum)->wait();
    got[0] = v;
  }
  other.join();
  EXPECT_EQ(got[0], 3.0f);
  EXPECT_EQ(got[1], 3.0f);
}

}  // namespace
}  // namespace lockstep::testing
