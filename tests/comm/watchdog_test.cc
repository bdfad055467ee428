// Nothing central per collective: in the steady state the communicator makes no store requests;
// mismatches are found over the backend's own transport or, when they stall, through the peers'
// flight records; a timeout names the rank that is behind.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>

#include "lockstep/comm/communicator.h"
#include "lockstep/comm/flight_recorder.h"
#include "lockstep/error.h"
#include "testing.h"

namespace lockstep::testing {
namespace {

using comm::CommOptions;
using comm::DType;
using comm::ReduceOp;

struct Layout {
  std::string backend;
  int world;
  std::vector<int> machine_of;  // hier's two levels on one machine
};

class SteadyState : public ::testing::TestWithParam<Layout> {};

// Past its creation and first collectives, a communicator runs hundreds of collectives of every
// kind, across several checked positions (every 64th), without a single store request.
TEST_P(SteadyState, CollectivesMakeNoStoreRequests) {
  CommOptions options{GetParam().backend};
  options.machine_of = GetParam().machine_of;
  run_ranks_as_threads_with_store(GetParam().world, options, [&](comm::Communicator& comm, comm::StoreClient& store) {
    std::vector<float> small(1024, 1.0f), large(1 << 18, 1.0f);
    std::vector<float> gathered(small.size() * static_cast<std::size_t>(comm.size()));
    comm.allreduce(small.data(), small.size(), DType::f32, ReduceOp::sum)->wait();
    const std::uint64_t before = store.requests();
    for (int i = 0; i < 200; ++i) {
      comm.allreduce(small.data(), small.size(), DType::f32, ReduceOp::avg)->wait();
      if (i % 20 == 0) comm.allreduce(large.data(), large.size(), DType::f32, ReduceOp::sum)->wait();
      if (i % 25 == 0) {
        comm.broadcast(small.data(), small.size(), DType::f32, 0)->wait();
        comm.allgather(small.data(), gathered.data(), small.size(), DType::f32)->wait();
        comm.barrier()->wait();
      }
    }
    EXPECT_GT(comm.issued(), 192u) << "the loop must cross several checked positions";
    EXPECT_EQ(store.requests(), before) << "rank " << comm.rank() << " on " << comm.backend_name();
  });
}

std::vector<Layout> steady_layouts() {
  std::vector<Layout> l{{"shm", 2, {}}};
#ifdef LOCKSTEP_HAVE_GLOO
  l.push_back({"gloo", 2, {}});
  l.push_back({"gloo", 3, {}});
  l.push_back({"hier", 4, {0, 0, 1, 1}});
#endif
  return l;
}
INSTANTIATE_TEST_SUITE_P(Backends, SteadyState, ::testing::ValuesIn(steady_layouts()),
                         [](const ::testing::TestParamInfo<Layout>& p) {
                           return p.param.backend + "_world" + std::to_string(p.param.world);
                         });

#ifdef LOCKSTEP_HAVE_GLOO

// A collective that runs silently with different dtypes of the same size on two ranks (f64 and
// i64 sums move the same bytes) at an unchecked position: the next checked position finds it
// and names it, with what each rank issued.
TEST(GlooChecks, ASilentMismatchBetweenChecksIsNamedAtTheNextCheck) {
  CommOptions options{"gloo"};
  options.check_every = 8;
  std::atomic<int> named{0};
  run_ranks_as_threads(2, options, [&](comm::Communicator& comm) {
    std::vector<double> v(64, 1.0);
    try {
      for (int i = 0; i < 16; ++i) {
        const DType dtype = i == 3 && comm.rank() == 1 ? DType::i64 : DType::f64;
        comm.allreduce(v.data(), v.size(), dtype, ReduceOp::sum)->wait();
      }
      ADD_FAILURE() << "rank " << comm.rank() << " never noticed";
    } catch (const MismatchError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("#3 "), std::string::npos) << what;
      EXPECT_NE(what.find("f64"), std::string::npos) << what;
      EXPECT_NE(what.find("i64"), std::string::npos) << what;
      EXPECT_NE(what.find("at #8"), std::string::npos) << what;
      EXPECT_EQ(comm.issued(), 9u) << "found at the first check after #3, not later";
      ++named;
    }
  });
  EXPECT_EQ(named.load(), 2);
}

// With every collective checked, the mismatch is found before it runs.
TEST(GlooChecks, CheckingEveryCollectiveStopsAMismatchBeforeItRuns) {
  CommOptions options{"gloo"};
  options.check_every = 1;
  std::atomic<int> named{0};
  run_ranks_as_threads(2, options, [&](comm::Communicator& comm) {
    std::vector<double> v(64, 1.0);
    comm.allreduce(v.data(), v.size(), DType::f64, ReduceOp::sum)->wait();
    try {
      comm.allreduce(v.data(), v.size(), DType::f64, comm.rank() == 0 ? ReduceOp::sum : ReduceOp::max)->wait();
      ADD_FAILURE() << "ran a mismatched collective";
    } catch (const MismatchError& e) {
      EXPECT_NE(std::string(e.what()).find("before it ran"), std::string::npos) << e.what();
      EXPECT_EQ(v[0], 2.0) << "the data must be untouched";
      ++named;
    }
  });
  EXPECT_EQ(named.load(), 2);
}

// Different collectives at an unchecked position, which Gloo alone would wait on: the watchdog
// compares the stalled collective with the peer's flight record and fails both ranks, naming both
// collectives, within a few peer_checks.
TEST(GlooChecks, AMismatchThatStallsBetweenChecksIsNamedThroughTheRecords) {
  CommOptions options{"gloo"};
  options.check_every = 64;
  options.peer_check = comm::Seconds(1);
  options.timeout = comm::Seconds(60);
  std::atomic<int> named{0};
  run_ranks_as_threads(2, options, [&](comm::Communicator& comm) {
    std::vector<float> v(1 << 16, 1.0f);
    for (int i = 0; i < 5; ++i) comm.allreduce(v.data(), v.size(), DType::f32, ReduceOp::sum)->wait();
    const auto start = std::chrono::steady_clock::now();
    try {
      if (comm.rank() == 0)
        comm.allreduce(v.data(), v.size(), DType::f32, ReduceOp::sum)->wait();
      else
        comm.barrier()->wait();
      ADD_FAILURE() << "rank " << comm.rank() << " went on";
    } catch (const MismatchError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("#5"), std::string::npos) << what;
      EXPECT_NE(what.find("allreduce"), std::string::npos) << what;
      EXPECT_NE(what.find("barrier"), std::string::npos) << what;
      ++named;
    } catch (const Error& e) {
      ADD_FAILURE() << "rank " << comm.rank() << ": not named as a mismatch: " << e.what();
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(seconds, 10) << "a mismatch must not wait for the 60 s timeout";
  });
  EXPECT_EQ(named.load(), 2);
}

// A rank that stays alive but never issues the collective: the timeout names it and says what
// it was doing (its own record: idle since its last collective).
TEST(GlooChecks, ATimeoutNamesTheRankThatIsBehindAndWhatItDid) {
  CommOptions options{"gloo"};
  options.timeout = comm::Seconds(2);
  options.peer_check = comm::Seconds(1);
  std::promise<void> rank0_done;
  auto done = rank0_done.get_future().share();
  run_ranks_as_threads(2, options, [&](comm::Communicator& comm) {
    float v = 1;
    comm.allreduce(&v, 1, DType::f32, ReduceOp::sum)->wait();
    if (comm.rank() == 1) {
      ASSERT_EQ(done.wait_for(std::chrono::seconds(60)), std::future_status::ready);
      return;
    }
    try {
      comm.allreduce(&v, 1, DType::f32, ReduceOp::sum)->wait();
      ADD_FAILURE() << "allreduce returned without rank 1";
    } catch (const TimeoutError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("allreduce (f32 x 1, sum) #1 timed out"), std::string::npos) << what;
      EXPECT_NE(what.find("rank 1 idle for"), std::string::npos) << what;
      EXPECT_NE(what.find("since allreduce (f32 x 1, sum) #0 finished"), std::string::npos) << what;
    }
    rank0_done.set_value();
  });
}

#endif  // LOCKSTEP_HAVE_GLOO

// A record goes through the store and back, and reads as what the rank was doing.
TEST(FlightRecord, RoundTripsAndDescribesWhatTheRankDid) {
  comm::FlightRecord r;
  r.rank = 1;
  r.backend = "gloo";
  r.published_at = comm::wall_seconds_now();
  r.recent.push_back({7, "allreduce (f32 x 4, sum) #7", 42, 3.0, 2.9, 2.5});
  r.recent.push_back({8, "broadcast (f32 x 4, root 0) #8", 43, 2.0, 2.0, -1});
  const comm::FlightRecord back = comm::FlightRecord::from_json(r.to_json());
  ASSERT_EQ(back.recent.size(), 2u);
  EXPECT_EQ(back.find(7)->signature, 42u);
  EXPECT_EQ(back.find(9), nullptr);
  EXPECT_NE(back.doing(back.published_at).find("in broadcast (f32 x 4, root 0) #8 for 2.0 s"), std::string::npos)
      << back.doing(back.published_at);
  comm::FlightRecord idle = back;
  idle.recent.back().finished_ago = 1.0;
  EXPECT_NE(idle.doing(idle.published_at).find("idle for 1.0 s since broadcast"), std::string::npos)
      << idle.doing(idle.published_at);
  EXPECT_THROW(comm::FlightRecord::from_json("{\"rank\": 1}"), Error);
  // The rank furthest behind comes first; a rank without a record says so.
  const auto lines = comm::describe_flight({back, std::nullopt});
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0].rfind("rank 1: published nothing", 0), 0u) << lines[0];
  EXPECT_EQ(lines[1].rfind("rank 0: in broadcast", 0), 0u) << lines[1];
}

}  // namespace
}  // namespace lockstep::testing
