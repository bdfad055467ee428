// Collectives built from the Communicator's primitives, for what does not fit a fixed-size
// buffer of one dtype. Every rank calls them in the same order, like any collective.
#pragma once

#include <string>
#include <vector>

#include "lockstep/comm/communicator.h"

namespace lockstep::comm {

// Every rank gets every rank's string, in rank order (strings of any lengths, any bytes).
// Two allgathers: the lengths, then the strings padded to the longest.
std::vector<std::string> allgather_strings(Communicator& comm, const std::string& mine);

}  // namespace lockstep::comm
