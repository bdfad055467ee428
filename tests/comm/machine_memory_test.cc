// Communicator::allocate_machine_memory and allgather_machine: one block per machine, filled by
// the machine's ranks together. Checked on shm (one machine) and hier (machines declared, so two
// levels run in one process), against the reference values; that ranks of a machine really share
// the block and machines do not; that a block reused round after round is never overwritten while
// a rank still reads it; and what happens when ranks disagree.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "lockstep/comm/communicator.h"
#include "lockstep/comm/reference.h"
#include "lockstep/error.h"
#include "testing.h"

namespace lockstep::testing {
namespace {

using comm::CommOptions;
using comm::DType;

struct Layout {
  std::string backend;
  std::vector<int> machine_of;  // rank -> machine
  bool has_machine_memory;
};

std::string layout_name(const ::testing::TestParamInfo<Layout>& info) {
  std::string name = info.param.backend + "_machines";
  for (int m : info.param.machine_of) name += std::to_string(m);
  return name;
}

void PrintTo(const Layout& l, std::ostream* os) { *os << layout_name(::testing::TestParamInfo<Layout>(l, 0)); }

float value(int rank, std::size_t i, int round) { return float(comm::reference::input(rank, i)) + float(round); }

class MachineMemory : public ::testing::TestWithParam<Layout> {};

// Rounds into one block, every rank reading the whole result before the next round: a rank that
// wrote before every rank of its machine had issued the round would change what a slower one
// reads. Then the machine's first rank writes a marker: the machine's other ranks see it, the
// other machines do not.
TEST_P(MachineMemory, EveryRankReadsEveryChunkOnceItsMachineWroteThemAndMachinesShareNothing) {
  const Layout& layout = GetParam();
  const int world = int(layout.machine_of.size());
  CommOptions options{layout.backend};
  options.timeout = comm::Seconds(60);
  if (layout.backend == "hier") options.machine_of = layout.machine_of;
  std::mutex mu;
  std::vector<std::string> failures;
  run_ranks_as_threads(world, options, [&](comm::Communicator& comm) {
    auto fail = [&](const std::string& what) {
      std::lock_guard<std::mutex> lock(mu);
      failures.push_back("rank " + std::to_string(comm.rank()) + ": " + what);
    };
    for (std::size_t count : {std::size_t{1}, std::size_t{1000}, std::size_t{5000}}) {
      auto block = comm.allocate_machine_memory(std::size_t(world) * count * sizeof(float));
      if (comm.has_machine_memory() != layout.has_machine_memory) return fail("has_machine_memory() disagrees");
      if (bool(block) != layout.has_machine_memory) return fail("machine memory " + std::string(block ? "given" : "missing"));
      std::vector<float> own(std::size_t(world) * count);
      float* all = block ? static_cast<float*>(block.get()) : own.data();
      std::vector<float> mine(count);
      for (int round = 0; round < 40; ++round) {
        for (std::size_t i = 0; i < count; ++i) mine[i] = value(comm.rank(), i, round);
        comm.allgather_machine(mine.data(), all, count, DType::f32)->wait();
        for (int r = 0; r < world; ++r)
          for (std::size_t i = 0; i < count; ++i)
            if (all[std::size_t(r) * count + i] != value(r, i, round))
              return fail("round " + std::to_string(round) + ", count " + std::to_string(count) + ": rank " +
                          std::to_string(r) + "'s element " + std::to_string(i) + " is " +
                          std::to_string(all[std::size_t(r) * count + i]));
      }
      if (!block) continue;
      const int machine = layout.machine_of[std::size_t(comm.rank())];
      int first_of_machine = 0;
      while (layout.machine_of[std::size_t(first_of_machine)] != machine) ++first_of_machine;
      comm.barrier()->wait();
      if (comm.rank() == first_of_machine) all[0] = -1.0f - float(machine);
      comm.barrier()->wait();
      if (all[0] != -1.0f - float(machine))
        fail("does not see its machine's marker: " + std::to_string(all[0]));
      comm.barrier()->wait();
    }
  });
  for (const auto& f : failures) ADD_FAILURE() << f;
}

INSTANTIATE_TEST_SUITE_P(Shm, MachineMemory,
                         ::testing::Values(Layout{"shm", {0}, true}, Layout{"shm", {0, 0}, true},
                                           Layout{"shm", {0, 0, 0}, true}, Layout{"shm", {0, 0, 0, 0, 0}, true}),
                         layout_name);
#ifdef LOCKSTEP_HAVE_GLOO
// Interleaved machines (ranks 0 and 3 on one) too; unequal machines and gloo have none.
INSTANTIATE_TEST_SUITE_P(Hier, MachineMemory,
                         ::testing::Values(Layout{"hier", {0, 0, 1, 1}, true}, Layout{"hier", {0, 1, 2, 0, 1, 2}, true},
                                           Layout{"hier", {0, 1, 2}, true}, Layout{"hier", {0, 0, 0}, true},
                                           Layout{"hier", {0, 0, 1}, false}, Layout{"gloo", {0, 0, 0}, false}),
                         layout_name);
#endif

// Two ranks of a machine that name different places (the second rank one chunk further on) both
// get a MismatchError naming the places, instead of each writing where the other does not read.
TEST(MachineMemoryErrors, RanksThatWriteDifferentPlacesBothFailWithMismatch) {
  std::mutex mu;
  std::vector<std::string> errors;
  run_ranks_as_threads(2, CommOptions{"shm"}, [&](comm::Communicator& comm) {
    auto block = comm.allocate_machine_memory(4 * 64 * sizeof(float));
    ASSERT_TRUE(block);
    std::vector<float> mine(64, 1.0f);
    float* at = static_cast<float*>(block.get()) + (comm.rank() == 1 ? 128 : 0);
    try {
      comm.allgather_machine(mine.data(), at, 64, DType::f32)->wait();
      ADD_FAILURE() << "rank " << comm.rank() << " finished a mismatched gather";
    } catch (const MismatchError& e) {
      std::lock_guard<std::mutex> lock(mu);
      errors.push_back(e.what());
    }
  });
  ASSERT_EQ(errors.size(), 2u);
  for (const auto& e : errors) EXPECT_NE(e.find("another place of the machine's memory"), std::string::npos) << e;
}

TEST(MachineMemoryErrors, PrivateMemoryIsAClearErrorOnShm) {
  std::mutex mu;
  std::vector<std::string> errors;
  run_ranks_as_threads(2, CommOptions{"shm"}, [&](comm::Communicator& comm) {
    std::vector<float> mine(8, 1.0f), all(16);
    try {
      comm.allgather_machine(mine.data(), all.data(), 8, DType::f32)->wait();
    } catch (const Error& e) {
      std::lock_guard<std::mutex> lock(mu);
      errors.push_back(e.what());
    }
  });
  ASSERT_FALSE(errors.empty());
  EXPECT_NE(errors[0].find("not memory from allocate_machine_memory"), std::string::npos) << errors[0];
}

std::size_t machine_blocks_named(const std::vector<std::string>& names) {
  return std::size_t(std::count_if(names.begin(), names.end(),
                                   [](const std::string& n) { return n.find("-machine-") != std::string::npos; }));
}

// A block's name goes as soon as every rank holds it (a job killed from then on leaves nothing
// behind), whether or not a collective ever uses it; the memory lives on with its pointer.
TEST(MachineMemoryErrors, NothingIsLeftInDevShm) {
  const auto before = shm_segments(::getpid());
  std::vector<std::shared_ptr<void>> kept(2);
  std::vector<std::size_t> named_while_held(2, 99);
  run_ranks_as_threads(2, CommOptions{"shm"}, [&](comm::Communicator& comm) {
    auto used = comm.allocate_machine_memory(2 * 16 * sizeof(float));
    auto unused = comm.allocate_machine_memory(4096);
    comm.barrier()->wait();  // both ranks returned from both allocations
    named_while_held[std::size_t(comm.rank())] = machine_blocks_named(shm_segments(::getpid()));
    comm.barrier()->wait();
    std::vector<float> mine(16, float(comm.rank()));
    comm.allgather_machine(mine.data(), used.get(), 16, DType::f32)->wait();
    kept[std::size_t(comm.rank())] = used;
  });
  EXPECT_EQ(named_while_held, std::vector<std::size_t>(2, 0)) << "blocks still named in /dev/shm while held";
  EXPECT_EQ(shm_segments(::getpid()).size(), before.size());
  EXPECT_EQ(static_cast<float*>(kept[0].get())[16], 1.0f);
}

}  // namespace
}  // namespace lockstep::testing
