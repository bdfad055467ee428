// Starts N copies of a command on this machine as ranks of one job, with the store hosted
// here: the small supervisor `lockstep demo` and `lockstep bench` use until `lockstep run`
// (the launcher) exists. Any rank failing stops the others; the exit code is the first failure's.
#pragma once

#include <string>
#include <vector>

namespace lockstep::tools {

int run_local_ranks(int nproc, const std::vector<std::string>& argv);

}  // namespace lockstep::tools
