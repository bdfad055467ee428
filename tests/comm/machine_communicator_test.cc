// Communicator::machine_communicator: each machine's ranks, and only them, in a communicator of
// their own over shared memory. Machines are declared (hier's two levels run in one process), so
// a communicator that spanned the world or mixed machines would sum the wrong ranks.
#include <gtest/gtest.h>

#include <mutex>
#include <vector>

#include "lockstep/comm/communicator.h"
#include "testing.h"

namespace lockstep::testing {
namespace {

using comm::CommOptions;
using comm::DType;

void each_machine_sums_its_own_ranks(const std::string& backend, const std::vector<int>& machine_of) {
  const int world = int(machine_of.size());
  CommOptions options{backend};
  options.timeout = comm::Seconds(60);
  options.machine_of = machine_of;
  std::mutex mu;
  std::vector<std::string> failures;
  run_ranks_as_threads(world, options, [&](comm::Communicator& comm) {
    auto fail = [&](const std::string& what) {
      std::lock_guard<std::mutex> lock(mu);
      failures.push_back("rank " + std::to_string(comm.rank()) + ": " + what);
    };
    const int machine = machine_of[std::size_t(comm.rank())];
    int local_rank = 0, local_size = 0, expected = 0;
    for (int r = 0; r < world; ++r) {
      if (machine_of[std::size_t(r)] != machine) continue;
      if (r == comm.rank()) local_rank = local_size;
      ++local_size;
      expected += r + 1;
    }
    auto mine = comm.machine_communicator();
    if (mine->size() != local_size || mine->rank() != local_rank)
      return fail("rank " + std::to_string(mine->rank()) + " of " + std::to_string(mine->size()) + ", expected " +
                  std::to_string(local_rank) + " of " + std::to_string(local_size));
    if (mine->backend_name() != "shm") fail("backend " + mine->backend_name());
    for (int round = 0; round < 3; ++round) {
      std::int32_t value = comm.rank() + 1;
      mine->allreduce(&value, 1, DType::i32, comm::ReduceOp::sum)->wait();
      if (value != expected)
        fail("round " + std::to_string(round) + ": the machine's sum is " + std::to_string(value) + ", not " +
             std::to_string(expected));
      // The world's communicator still spans every machine alongside it.
      std::int32_t all = 1;
      comm.allreduce(&all, 1, DType::i32, comm::ReduceOp::sum)->wait();
      if (all != world) fail("the world's sum is " + std::to_string(all));
    }
  });
  for (const auto& f : failures) ADD_FAILURE() << f;
}

TEST(MachineCommunicator, OneMachineHoldsEveryRank) { each_machine_sums_its_own_ranks("shm", {0, 0, 0}); }

#ifdef LOCKSTEP_HAVE_GLOO
TEST(MachineCommunicator, TwoMachinesOfTwoEachSumOnlyTheirOwn) {
  each_machine_sums_its_own_ranks("hier", {0, 0, 1, 1});
}

TEST(MachineCommunicator, InterleavedAndUnequalMachines) {
  each_machine_sums_its_own_ranks("hier", {0, 1, 0, 0, 2});
}
#endif

}  // namespace
}  // namespace lockstep::testing
