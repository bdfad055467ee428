// Every backend x collective x dtype x op x count against the reference (conformance.cc),
// world sizes 1..5 and 7 (odd sizes find chunking bugs), ranks as threads and as real processes.
#include "conformance.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>

#include "lockstep/error.h"
#include "testing.h"
#include "worker_runs.h"

namespace lockstep::testing {
namespace {

using comm::CommOptions;

struct Case {
  std::string backend;
  int world;
  std::size_t slot_bytes;       // 0: default
  std::vector<int> machines{};  // hier: which machine each rank is on
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string layout;
  for (int m : info.param.machines) layout += std::to_string(m);
  return info.param.backend + "_world" + std::to_string(info.param.world) +
         (info.param.slot_bytes ? "_slot" + std::to_string(info.param.slot_bytes) : "") +
         (layout.empty() ? "" : "_machines" + layout);
}

// gtest prints a parameter in the test's listing; without this, as a dump of its bytes.
void PrintTo(const Case& c, std::ostream* os) {
  *os << case_name(::testing::TestParamInfo<Case>(c, 0));
}

class ThreadRanks : public ::testing::TestWithParam<Case> {};

TEST_P(ThreadRanks, MatchesReference) {
  const Case& c = GetParam();
  CommOptions options;
  options.backend = c.backend;
  options.timeout = comm::Seconds(60);
  if (c.slot_bytes) options.shm_slot_bytes = c.slot_bytes;
  options.machine_of = c.machines;
  // 5000 elements cross a 4 KiB slot's halves many times; 300000 f32 cross the default slot.
  std::vector<std::size_t> counts = {0, 1, 7, 1000, 5000};
  std::mutex mu;
  std::vector<std::string> failures;
  run_ranks_as_threads(c.world, options, [&](comm::Communicator& comm) {
    EXPECT_EQ(comm.backend_name(), c.backend);
    auto f = run_conformance(comm, counts);
    std::lock_guard<std::mutex> lock(mu);
    failures.insert(failures.end(), f.begin(), f.end());
  });
  for (const auto& f : failures) ADD_FAILURE() << f;
}

INSTANTIATE_TEST_SUITE_P(Shm, ThreadRanks,
                         ::testing::Values(Case{"shm", 1, 0}, Case{"shm", 2, 0}, Case{"shm", 3, 0},
                                           Case{"shm", 4, 0}, Case{"shm", 5, 0}, Case{"shm", 7, 0},
                                           Case{"shm", 2, 4096}, Case{"shm", 3, 4096}, Case{"shm", 4, 1024},
                                           Case{"shm", 5, 4096}, Case{"shm", 7, 4096}),
                         case_name);
#ifdef LOCKSTEP_HAVE_GLOO
INSTANTIATE_TEST_SUITE_P(Gloo, ThreadRanks,
                         ::testing::Values(Case{"gloo", 1, 0}, Case{"gloo", 2, 0}, Case{"gloo", 3, 0},
                                           Case{"gloo", 4, 0}, Case{"gloo", 5, 0}, Case{"gloo", 7, 0}),
                         case_name);
// The hier backend's two levels, machines simulated by declaring them (the namespace tests run
// it across real network namespaces): 2x2, 2x1, 3x1, 2x3, 3x2, one machine of 3, and machines of
// unequal size: 2+1, 3+2 interleaved (ranks 0, 2, 4 on one), 1+2+3.
INSTANTIATE_TEST_SUITE_P(Hier, ThreadRanks,
                         ::testing::Values(Case{"hier", 4, 0, {0, 0, 1, 1}}, Case{"hier", 2, 0, {0, 1}},
                                           Case{"hier", 3, 0, {0, 1, 2}},
                                           Case{"hier", 6, 0, {0, 0, 0, 1, 1, 1}},
                                           Case{"hier", 6, 4096, {0, 1, 2, 0, 1, 2}},
                                           Case{"hier", 3, 0, {0, 0, 0}}, Case{"hier", 3, 0, {0, 0, 1}},
                                           Case{"hier", 5, 4096, {0, 1, 0, 1, 0}},
                                           Case{"hier", 6, 0, {0, 1, 1, 2, 2, 2}}),
                         case_name);
#endif

// Large messages on the default slot: the chunked two-phase path with several rounds.
// The bitwise operators apply to integers only: anything else is refused before it is issued,
// naming the operator and the type, on every backend alike (the communicator checks).
TEST(BitwiseOps, OnFloatsAreAConfigErrorNamingOperatorAndType) {
  run_ranks_as_threads(2, CommOptions{"gloo"}, [](comm::Communicator& comm) {
    float x[4] = {1, 2, 3, 4};
    for (auto op : {comm::ReduceOp::band, comm::ReduceOp::bor, comm::ReduceOp::bxor}) {
      try {
        comm.allreduce(x, 4, comm::DType::f32, op)->wait();
        ADD_FAILURE() << "no error";
      } catch (const ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find(std::string(comm::reduce_op_name(op)) + " is bitwise"), std::string::npos)
            << e.what();
        EXPECT_NE(std::string(e.what()).find("not f32"), std::string::npos) << e.what();
      }
    }
    std::int32_t bits = comm.rank() == 0 ? 0b1100 : 0b1010;  // and still works on integers after
    comm.allreduce(&bits, 1, comm::DType::i32, comm::ReduceOp::bxor)->wait();
    EXPECT_EQ(bits, 0b0110);
  });
}

TEST(ShmLarge, ChunkedAllreduceAcrossRoundsIsExact) {
  const std::size_t n = 3 * (1 << 20) / 4 + 13;  // ~3 MiB of f32, not a multiple of anything
  run_ranks_as_threads(3, CommOptions{"shm"}, [&](comm::Communicator& comm) {
    std::vector<float> data(n);
    for (std::size_t i = 0; i < n; ++i) data[i] = static_cast<float>((comm.rank() + 1) * (i % 101));
    comm.allreduce(data.data(), n, comm::DType::f32, comm::ReduceOp::sum)->wait();
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i) wrong += data[i] != static_cast<float>(6 * (i % 101));
    EXPECT_EQ(wrong, 0u) << "rank " << comm.rank();
  });
}

#ifdef LOCKSTEP_HAVE_GLOO
// Above 512 KiB gathered the gloo backend's all-reduces go around a ring: over its own mailbox
// by default, Gloo's with CommOptions::gloo_ring "gloo" (LOCKSTEP_GLOO_RING=gloo). Both, on 2 and
// 3 ranks, every collective, dtype and op at a count no world size divides (uneven chunks).
TEST(GlooLarge, EitherRingMatchesTheReference) {
  for (const char* ring : {"mailbox", "gloo"}) {
    CommOptions options{"gloo"};
    options.gloo_ring = ring;
    for (int world : {2, 3}) {
      std::mutex mu;
      std::vector<std::string> failures;
      run_ranks_as_threads(world, options, [&](comm::Communicator& comm) {
        auto f = run_conformance(comm, {100003});
        std::lock_guard<std::mutex> lock(mu);
        for (auto& one : f) failures.push_back(std::string(ring) + " ring, " + std::to_string(world) + " ranks: " + one);
      });
      for (const auto& f : failures) ADD_FAILURE() << f;
    }
  }
}
#endif

// Real processes: the same table, 3 ranks, each backend.
class ProcessRanks : public ::testing::TestWithParam<std::string> {};

TEST_P(ProcessRanks, MatchesReference) {
  expect_worker_ranks_pass(3, {"conformance", GetParam(), "8192"});
}

INSTANTIATE_TEST_SUITE_P(Backends, ProcessRanks, ::testing::ValuesIn(process_backends()));

#ifdef LOCKSTEP_HAVE_MPI
// Under a real mpirun: ranks come from OMPI_COMM_WORLD_*, no store at all.
TEST(MpiRanks, MatchesReferenceUnderMpirun) {
  expect_worker_passes_under_mpirun(3, "conformance mpi");
}
#endif

}  // namespace
}  // namespace lockstep::testing
