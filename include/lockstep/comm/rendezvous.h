// Rendezvous: how a worker finds its place in the job and the job's store.
//
// From the environment, with torchrun's names: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT; lockstep's own LOCKSTEP_STORE_ADDR (the launcher's store),
// LOCKSTEP_TOKEN, LOCKSTEP_RUN_ID, LOCKSTEP_RESTART_COUNT. When RANK is unset, a scheduler's
// variables stand in: mpirun (OMPI_COMM_WORLD_*), Slurm srun (SLURM_PROCID, SLURM_NTASKS,
// SLURM_LOCALID, the first host of SLURM_JOB_NODELIST as MASTER_ADDR, a port derived from
// SLURM_JOB_ID unless MASTER_PORT is set), SageMaker (SM_HOSTS, SM_CURRENT_HOST: one rank per
// host, the first host as MASTER_ADDR, port 29500 unless MASTER_PORT is set). Or explicit options.
//
// Where the store is: LOCKSTEP_STORE_ADDR when set (lockstep run hosts it); otherwise rank 0
// hosts one on MASTER_ADDR:MASTER_PORT and the others connect there.
//
// Every missing or inconsistent value is a ConfigError naming the variable and the fix.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/comm/communicator.h"
#include "lockstep/comm/store.h"

namespace lockstep::comm {

struct RendezvousInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;     // 0: unset
  std::string store_host;  // from LOCKSTEP_STORE_ADDR; empty: rank 0 hosts at MASTER_PORT
  int store_port = 0;
  std::string token;
  std::string run_id = "default";
  int restart_count = 0;
  Seconds timeout{300};          // LOCKSTEP_TIMEOUT
  Seconds peer_check{5};         // LOCKSTEP_PEER_CHECK
  int check_every = 64;          // LOCKSTEP_CHECK_COLLECTIVES (every: 1, off: 0)
  std::string backend = "auto";  // LOCKSTEP_BACKEND
  std::string gloo_ring = knobs::kGlooRing.default_value;      // LOCKSTEP_GLOO_RING
  std::string hier_across = knobs::kHierAcross.default_value;  // LOCKSTEP_HIER_ACROSS
  bool p2p_shared_memory = true;  // LOCKSTEP_P2P_SHM
  bool from_mpirun = false;      // rank variables came from OMPI_COMM_WORLD_*
  std::string scheduler;         // "slurm" or "sagemaker" when their variables were used
};

// `options` with each setting the program left at its default taken from the environment's
// (timeout, peer check, collective checks, backend, gloo ring, hier's engine, point-to-point's
// shared memory): what a program sets
// wins over a variable.
CommOptions with_environment_defaults(CommOptions options, const RendezvousInfo& info);

// The store prefix of a run's keys for one attempt ("run/<run id>/<restart count>/"): the
// rendezvous' keys and its communicators' names start with it; the launcher reads the workers'
// flight records under it (rendezvous_key_prefix(...) + "default" names the job's communicator).
std::string rendezvous_key_prefix(const std::string& run_id, int restart_count);

// Helpers for scheduler variables, exposed for tests.
std::string first_slurm_host(const std::string& nodelist);               // "n[01-04],m" -> "n01"
std::vector<std::string> parse_host_list(const std::string& json_list);  // SM_HOSTS

// Parses and validates; reads `env` (tests pass a map) or the process environment.
RendezvousInfo rendezvous_info_from_env();
RendezvousInfo rendezvous_info_from(const std::map<std::string, std::string>& env);

// Whether this process was started as one rank of a job: torchrun's, mpirun's, Slurm's or
// SageMaker's variables are present (a program that launches its own ranks otherwise).
bool started_as_rank();
bool started_as_rank(const std::map<std::string, std::string>& env);

// A joined job: this process's place in it and a connection to its store.
class Rendezvous {
 public:
  // Connects to (or, on rank 0 without a launcher, hosts) the store and claims the rank:
  // a second process with the same RANK gets a ConfigError.
  explicit Rendezvous(RendezvousInfo info);
  ~Rendezvous();

  const RendezvousInfo& info() const { return info_; }
  int rank() const { return info_.rank; }
  int world_size() const { return info_.world_size; }
  std::shared_ptr<StoreClient> store() const { return store_; }
  // Prefix that keeps this run's (and this restart's) keys apart from others on the store.
  const std::string& key_prefix() const { return prefix_; }

  // Creates a communicator over all ranks of the job (collective).
  std::unique_ptr<Communicator> communicator(CommOptions options = {});

 private:
  RendezvousInfo info_;
  std::unique_ptr<StoreServer> server_;
  std::shared_ptr<StoreClient> store_;
  std::string prefix_;
};

// The one-line start for a worker: rendezvous from the environment, then a communicator.
// The backend comes from LOCKSTEP_BACKEND unless options.backend is set to something else
// than "auto".
struct Job {
  std::unique_ptr<Rendezvous> rendezvous;
  std::unique_ptr<Communicator> comm;
};
Job join_from_env(CommOptions options = {});

}  // namespace lockstep::comm
