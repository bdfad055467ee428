// The point-to-point table: tags and their order, any-source, large messages both ways at once,
// a rank to itself, zero elements, recvs pending across a collective, and a size mismatch.
// Used by the thread-rank gtest and by comm_worker (real processes, incl. under mpirun).
#pragma once

#include <string>
#include <vector>

#include "lockstep/comm/communicator.h"

namespace lockstep::testing {

// Returns one line per wrong case, empty when everything matched. Every rank must call it.
std::vector<std::string> run_p2p_exchange(comm::Communicator& comm);

}  // namespace lockstep::testing
