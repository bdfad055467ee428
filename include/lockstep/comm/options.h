// What a communicator is created with (CommOptions) and what it reports about the network
// (NetworkStats). Apart from communicator.h so that the backends, which sit below the
// Communicator, can use both without including it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/base/knobs.h"
#include "lockstep/comm/types.h"

namespace lockstep::comm {

struct CommOptions {
  std::string backend = "auto";  // shm | gloo | hier | mpi | nccl | auto (see communicator.h)
  std::string name = "default";  // keeps several communicators of one job apart
  Seconds timeout{300};          // longest any one collective may take
  Seconds peer_check{5};         // a dead peer is reported within this
  // shm: bytes of shared memory each rank owns for staging (three parts used in turn).
  std::size_t shm_slot_bytes = 1u << 20;
  // shm: messages up to this size take the one-shot path (every rank reduces everything).
  std::size_t shm_one_shot_bytes = 64u << 10;
  // gloo/mpi: compare the ranks' collectives (kind, dtype, count, op, root) over the backend's
  // own transport at the first collective and every N-th after it; the check covers every
  // collective in between (a running hash), and a mismatch is a MismatchError naming the first
  // collective that differs. 1: before every collective (one small gather each); 0: never.
  // Whatever N, a collective that stalls is compared with the peers' through the store at
  // once. shm always checks every collective, at no extra cost. (LOCKSTEP_CHECK_COLLECTIVES)
  int check_every = 64;
  // Which machine each rank is on (0, 0, 1, 1, ...), instead of finding out by probing shared
  // memory: lets tests run the hier backend's two levels inside one machine. Empty: probe.
  std::vector<int> machine_of{};
  // gloo: all-reduces above 512 KiB gathered go around a ring over lockstep's own connections
  // ("mailbox") or Gloo's ("gloo"); every rank must ask for the same, else Gloo's is used.
  std::string gloo_ring = knobs::kGlooRing.default_value;
  // Point-to-point between ranks on one machine through shared memory (else loopback TCP).
  bool p2p_shared_memory = true;
  // hier: the engine between machines, "gloo" or "mpi" (under mpirun, built with MPI).
  std::string hier_across = knobs::kHierAcross.default_value;
};

// What crossed the network so far on this rank: bytes it sent through the network transport
// (every gloo collective; hier's steps between machines), the time those collectives took, and
// how many machines the communicator spans. All zero on shm.
struct NetworkStats {
  std::uint64_t bytes_sent = 0;
  double seconds = 0;
  int machines = 1;
  double gbps() const { return seconds > 0 ? static_cast<double>(bytes_sent) / seconds / 1e9 : 0; }
};

}  // namespace lockstep::comm
