// Which ranks share a machine, found by trying rather than trusting names: two ranks share one
// when they run on the same kernel (the same boot id) and each can open the other's probe
// object in /dev/shm. Hostnames may be shared by containers or unresolvable, and ranks in
// different UTS namespaces may still share memory; neither fools this.
//
// Collective over the store: every rank publishes a probe and the peers it reaches, and every
// rank computes the same partition from all of them. The probe objects are unlinked before it
// returns ("/lockstep-<pid>-probe-*", which the launcher also removes after a crash).
#pragma once

#include <string>
#include <vector>

#include "lockstep/comm/store.h"

namespace lockstep::comm {

struct Locality {
  std::vector<int> machine_of;  // rank -> machine, numbered by each machine's lowest rank
  std::vector<int> local_rank;  // rank -> its index among its machine's ranks (by rank)
  int machines = 1;

  int size() const { return static_cast<int>(machine_of.size()); }
  std::vector<int> ranks_on(int machine) const;  // ascending
  bool one_machine() const { return machines == 1; }
  // Every machine holds the same number of ranks (what hier needs).
  bool uniform() const;
  std::string describe() const;  // "2 machines: ranks 0,1 | 2,3"
};

Locality probe_locality(StoreClient& store, const std::string& prefix, int rank, int size, Seconds timeout);

// The partition that `sees` (rank -> ranks it shares memory with, itself included) implies;
// pure, for tests.
Locality locality_from(const std::vector<std::vector<int>>& sees);

}  // namespace lockstep::comm
