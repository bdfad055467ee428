// The conformance table: every collective x dtype x op x count on a communicator, checked
// against comm::reference (exact values computed in double precision, independently of any
// backend, with one justified tolerance per dtype).
// Used by the thread-rank gtest and by comm_worker (real processes, incl. under mpirun).
#pragma once

#include <string>
#include <vector>

#include "lockstep/comm/communicator.h"

namespace lockstep::testing {

// Returns one line per wrong case ("allreduce f16 avg count=7: element 3 is 1.5, want 1.25"),
// empty when everything matched. Every rank must call it (it issues collectives).
std::vector<std::string> run_conformance(comm::Communicator& comm, const std::vector<std::size_t>& counts);

}  // namespace lockstep::testing
