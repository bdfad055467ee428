// The point-to-point table: tags and their order, shared memory on one machine, described
// messages, any-source, large messages both ways at once,
// a rank to itself, zero elements, recvs pending across a collective, and a size mismatch.
// Used by the thread-rank gtest and by comm_worker (real processes, incl. under mpirun).
#pragma once

#include <string>
#include <vector>

#include "lockstep/comm/communicator.h"

namespace lockstep::testing {

// Returns one line per wrong case, empty when everything matched. Every rank must call it.
// `lanes_wanted`: whether the communicator may use shared memory between ranks on one machine.
std::vector<std::string> run_p2p_exchange(comm::Communicator& comm, bool lanes_wanted = true);

}  // namespace lockstep::testing
