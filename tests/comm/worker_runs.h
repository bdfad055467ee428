// How the comm tests run comm_worker as real processes: ranks of one job through a store, or
// under a real mpirun with no store.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "testing.h"

namespace lockstep::testing {

// The backends whose ranks start as plain processes in this build (mpi needs mpirun).
inline std::vector<std::string> process_backends() {
  std::vector<std::string> b{"shm"};
#ifdef LOCKSTEP_HAVE_GLOO
  b.push_back("gloo");
#endif
  return b;
}

// Starts `comm_worker args...` as `ranks` processes of one job; each must exit 0 (its output
// is shown when one does not).
inline void expect_worker_ranks_pass(int ranks, std::vector<std::string> args) {
  LocalStore store;
  args.insert(args.begin(), helper_path("comm_worker"));
  auto children = spawn_ranks(ranks, args, store);
  for (std::size_t r = 0; r < children.size(); ++r)
    EXPECT_EQ(wait_child(children[r], 120), 0) << "rank " << r << ":\n" << read_file(children[r].stdout_path);
}

// Runs `comm_worker args` under `mpirun -np ranks`, ranks from OMPI_COMM_WORLD_* and no store;
// it must exit 0. Skips the test where mpirun is not installed.
inline void expect_worker_passes_under_mpirun(int ranks, const std::string& args) {
  if (std::system("command -v mpirun > /dev/null") != 0) GTEST_SKIP() << "mpirun is not installed";
  TempDir dir("mpi");
  const std::string log = dir / "worker.log";
  const std::string cmd = "mpirun --allow-run-as-root --oversubscribe -np " + std::to_string(ranks) +
                          " env -u RANK -u WORLD_SIZE " + helper_path("comm_worker") + " " + args + " > " + log + " 2>&1";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << read_file(log);
}

}  // namespace lockstep::testing
