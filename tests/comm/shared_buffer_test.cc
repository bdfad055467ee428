// Communicator::allocate_shared: buffers peers read and write directly (the shm backend's
// zero-copy allreduce). Results are checked by the conformance table; here: what happens when
// ranks disagree, that nothing is left in /dev/shm, and that memory outlives the communicator.
#include <gtest/gtest.h>

#include <fstream>
#include <atomic>
#include <mutex>

#include <unistd.h>

#include "lockstep/comm/communicator.h"
#include "lockstep/error.h"
#include "testing.h"

namespace lockstep::testing {
namespace {

using comm::CommOptions;
using comm::DType;
using comm::ReduceOp;

int mappings_ending_with(const std::string& suffix) {
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.size() >= suffix.size() && line.compare(line.size() - suffix.size(), suffix.size(), suffix) == 0)
      ++n;
  }
  return n;
}

// One rank passes a shared buffer, the other a private one: both get MismatchError naming
// allocate_shared, instead of one reading memory the other never shared.
TEST(SharedBuffer, RanksThatDisagreeAllFailWithMismatch) {
  std::mutex mu;
  std::vector<std::string> errors;
  run_ranks_as_threads(2, CommOptions{"shm"}, [&](comm::Communicator& comm) {
    auto shared = comm.allocate_shared(4096 * sizeof(float));
    ASSERT_TRUE(shared);
    std::vector<float> own(4096, 1.0f);
    void* buffer = comm.rank() == 0 ? shared.get() : own.data();
    try {
      comm.allreduce(buffer, 4096, DType::f32, ReduceOp::sum)->wait();
      ADD_FAILURE() << "rank " << comm.rank() << " finished a mismatched allreduce";
    } catch (const MismatchError& e) {
      std::lock_guard<std::mutex> lock(mu);
      errors.push_back(e.what());
    }
  });
  ASSERT_EQ(errors.size(), 2u);
  for (const auto& e : errors) {
    EXPECT_NE(e.find("allocate_shared"), std::string::npos) << e;
    EXPECT_NE(e.find("rank 0"), std::string::npos) << e;
  }
}

// Names go once every rank mapped them; peers unmap what the owner released; the memory lives
// on after the communicator; and no file is left in /dev/shm. Only this process's segments count:
// ctest runs other tests beside this one.
TEST(SharedBuffer, NamesAndMappingsAreCleanedUpAndMemoryOutlivesTheCommunicator) {
  auto before = shm_segments(::getpid());
  std::vector<std::shared_ptr<void>> kept(2);
  std::vector<int> names_after_use(2, -1), mapped_before_release(2, -1), mapped_after_release(2, -1);
  run_ranks_as_threads(2, CommOptions{"shm"}, [&](comm::Communicator& comm) {
    const std::size_t n = 1 << 16;
    auto first = comm.allocate_shared(n * sizeof(float));
    auto second = comm.allocate_shared(n * sizeof(float));
    ASSERT_TRUE(first && second);
    auto* f = static_cast<float*>(first.get());
    std::fill(f, f + n, static_cast<float>(comm.rank() + 1));
    comm.allreduce(f, n, DType::f32, ReduceOp::sum)->wait();
    EXPECT_EQ(f[0], 3.0f);
    EXPECT_EQ(f[n - 1], 3.0f);
    comm.barrier()->wait();
    // "<segment>-<rank>-<id>": rank 1's first buffer, mapped here by rank 0 and rank 1.
    if (comm.rank() == 0) {
      names_after_use[0] = static_cast<int>(shm_segments(::getpid()).size() - before.size());
      mapped_before_release[0] = mappings_ending_with("-1-0 (deleted)");
    }
    comm.barrier()->wait();
    if (comm.rank() == 1) first.reset();  // rank 1 releases its first buffer
    comm.barrier()->wait();
    // The next shared allreduce drops peers' mappings of released buffers.
    comm.allreduce(second.get(), n, DType::f32, ReduceOp::sum)->wait();
    comm.barrier()->wait();
    if (comm.rank() == 0) mapped_after_release[0] = mappings_ending_with("-1-0 (deleted)");
    comm.barrier()->wait();
    kept[static_cast<std::size_t>(comm.rank())] = second;
  });
  // After the first use both first buffers' names are gone; both second buffers' remain
  // until their first use, which came later.
  EXPECT_EQ(names_after_use[0], 2);
  EXPECT_EQ(mapped_before_release[0], 2) << "rank 1's own mapping and rank 0's";
  EXPECT_EQ(mapped_after_release[0], 0);
  // The communicators are gone; the memory is still there and writable.
  for (auto& k : kept) {
    ASSERT_TRUE(k);
    static_cast<float*>(k.get())[0] = 7.0f;
    EXPECT_EQ(static_cast<float*>(k.get())[0], 7.0f);
  }
  kept.clear();
  EXPECT_EQ(shm_segments(::getpid()).size(), before.size()) << "a shared buffer was left in /dev/shm";
}

// In-place allgather and reduce_scatter on shared buffers (ZeRO's gathers and gradient
// reduce-scatters) give what the staged paths give, at 2, 3 and 5 ranks, for sizes that do and
// do not fill a slot part; a rank passing private memory where the others pass shared is a
// MismatchError on every rank.
TEST(SharedBuffer, AllgatherAndReduceScatterInPlaceMatchTheStagedPaths) {
  for (int world : {2, 3, 5}) {
    for (std::size_t n : {std::size_t(1), std::size_t(1000), std::size_t(300000)}) {
      std::mutex mu;
      std::vector<std::string> failures;
      run_ranks_as_threads(world, CommOptions{"shm"}, [&](comm::Communicator& comm) {
        const int r = comm.rank();
        const std::size_t all = n * static_cast<std::size_t>(world);
        auto shared = comm.allocate_shared(all * sizeof(float));
        ASSERT_TRUE(shared);
        auto* big = static_cast<float*>(shared.get());
        std::vector<float> staged(all), expect(all);
        // reduce_scatter: element i of rank r is r + i; block r of the sum over ranks.
        for (std::size_t i = 0; i < all; ++i) big[i] = staged[i] = static_cast<float>(r + int(i % 97));
        comm.reduce_scatter(big, big + r * n, n, DType::f32, ReduceOp::sum)->wait();
        std::vector<float> out(n);
        comm.reduce_scatter(staged.data(), out.data(), n, DType::f32, ReduceOp::sum)->wait();
        for (std::size_t i = 0; i < n; ++i)
          if (big[r * n + i] != out[i]) {
            std::lock_guard<std::mutex> lock(mu);
            failures.push_back("reduce_scatter world " + std::to_string(world) + " n " + std::to_string(n));
            break;
          }
        // allgather: rank r's chunk is r * 1000 + i.
        for (std::size_t i = 0; i < n; ++i) big[r * n + i] = static_cast<float>(r * 1000 + int(i % 89));
        comm.allgather(big + r * n, big, n, DType::f32)->wait();
        for (std::size_t q = 0; q < std::size_t(world); ++q)
          for (std::size_t i = 0; i < n; ++i)
            if (big[q * n + i] != static_cast<float>(int(q) * 1000 + int(i % 89))) {
              std::lock_guard<std::mutex> lock(mu);
              failures.push_back("allgather world " + std::to_string(world) + " n " + std::to_string(n));
              q = std::size_t(world);
              break;
            }
      });
      for (const auto& f : failures) ADD_FAILURE() << f;
    }
  }
}

TEST(SharedBuffer, AReduceScatterWithSharedMemoryOnOneRankOnlyIsAMismatch) {
  std::atomic<int> mismatches{0};
  run_ranks_as_threads(2, CommOptions{"shm"}, [&](comm::Communicator& comm) {
    auto shared = comm.allocate_shared(2 * 1024 * sizeof(float));
    std::vector<float> own(2 * 1024, 1.0f);
    float* big = comm.rank() == 0 ? static_cast<float*>(shared.get()) : own.data();
    try {
      comm.reduce_scatter(big, big + comm.rank() * 1024, 1024, DType::f32, ReduceOp::sum)->wait();
    } catch (const MismatchError& e) {
      EXPECT_NE(std::string(e.what()).find("allocate_shared"), std::string::npos) << e.what();
      ++mismatches;
    }
  });
  EXPECT_EQ(mismatches.load(), 2);
}

// Backends without shared memory say so on every rank, without communicating.
TEST(SharedBuffer, OneRankAndGlooGetNone) {
  run_ranks_as_threads(1, CommOptions{"shm"},
                       [&](comm::Communicator& comm) { EXPECT_FALSE(comm.allocate_shared(1024)); });
#ifdef LOCKSTEP_HAVE_GLOO
  run_ranks_as_threads(2, CommOptions{"gloo"},
                       [&](comm::Communicator& comm) { EXPECT_FALSE(comm.allocate_shared(1024)); });
#endif
}

}  // namespace
}  // namespace lockstep::testing
