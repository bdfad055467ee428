// Where a torch process group's members meet: the lockstep store its communicator is created
// through (and, on gloo, checks every collective and its peers' liveness with), and the
// settings that come from the environment.
//
// Under `lockstep run` that store is the launcher's (LOCKSTEP_STORE_ADDR, LOCKSTEP_TOKEN); it
// outlives every worker. Anywhere else (torchrun, a program that sets RANK and MASTER_ADDR
// itself, a tcp:// or file:// init_method) the group's rank 0 hosts one on a free port of the
// address that routes to the master, and announces "address, port, token" through the c10d store
// torch gave the group; the other members connect to it. That store lives in rank 0's process,
// so rank 0's GroupStore waits on destruction (bounded) until every member left or died.
//
// Torch-free: the c10d store comes in as two functions, so this file builds in a second.
// Thread-safety: a GroupStore is created and destroyed on one thread; client() may be shared.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "lockstep/comm/communicator.h"
#include "lockstep/comm/store.h"

namespace lockstep::torch_backend {

// What the environment says about every group of this process (read once per group).
struct Settings {
  std::string backend = "auto";         // LOCKSTEP_BACKEND: auto | shm | gloo | hier | mpi | nccl
  std::optional<comm::Seconds> timeout;  // LOCKSTEP_TIMEOUT when set; else torch's timeout rules
  comm::Seconds peer_check{5};           // LOCKSTEP_PEER_CHECK
  std::string launcher_host;             // LOCKSTEP_STORE_ADDR's host; empty: not under lockstep run
  int launcher_port = 0;
  std::string token;       // LOCKSTEP_TOKEN (may be empty)
  std::string key_prefix;  // "run/<LOCKSTEP_RUN_ID>/<restart>/" on the launcher's store
  std::string master_addr;  // MASTER_ADDR when set
  std::string gloo_ring, hier_across;  // LOCKSTEP_GLOO_RING, LOCKSTEP_HIER_ACROSS
};

// Parses and checks the variables; ConfigError names a bad one and the fix.
Settings settings_from_env();

// The c10d store of the group, as GroupStore uses it.
struct Announcer {
  std::function<void(const std::string& key, const std::string& value)> set;
  std::function<std::string(const std::string& key)> get;  // waits for the key (torch's store timeout)
};

struct GroupPlace {
  int rank = 0;
  int size = 1;
  std::string group_id;     // torch's group name: "0" for the default group, then "1", ...
  std::string master_host;  // the host of torch's TCPStore, as this process reaches it
  comm::Seconds timeout{300};
};

class GroupStore {
 public:
  GroupStore(const Settings& settings, const GroupPlace& place, const Announcer& announcer);
  ~GroupStore();
  GroupStore(const GroupStore&) = delete;
  GroupStore& operator=(const GroupStore&) = delete;

  std::shared_ptr<comm::StoreClient> client() const { return client_; }
  // The communicator's name on this store: unique per run, restart and torch group.
  const std::string& communicator_name() const { return name_; }

 private:
  void host(const Settings& settings, const GroupPlace& place, const Announcer& announcer);
  void join(const Announcer& announcer, comm::Seconds timeout);
  void wait_for_members_to_leave();

  GroupPlace place_;
  bool launcher_ = false;                      // the store is lockstep run's
  std::unique_ptr<comm::StoreServer> server_;  // rank 0, when no launcher hosts the store
  std::shared_ptr<comm::StoreClient> client_;
  std::string name_;
};

// Creates the group's communicator through its store (collective over the group's members).
std::unique_ptr<comm::Communicator> create_communicator(const Settings& settings, const GroupPlace& place,
                                                        const GroupStore& store);

}  // namespace lockstep::torch_backend
