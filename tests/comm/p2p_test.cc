// Point-to-point send and recv (Communicator::send/recv): the exchange table on every backend,
// ranks as threads and as real processes (under mpirun too), and what goes wrong said plainly:
// a peer that dies, a recv nobody answers, a rank that does not exist.
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <random>

#include "lockstep/error.h"
#include "p2p_exchange.h"
#include "testing.h"
#include "worker_runs.h"

namespace lockstep::testing {
namespace {

using comm::CommOptions;
using comm::Communicator;
using comm::DType;

struct Case {
  std::string backend;
  int world;
  std::vector<int> machines{};  // hier: which machine each rank is on
  bool lanes = true;            // CommOptions::p2p_shared_memory
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string layout;
  for (int m : info.param.machines) layout += std::to_string(m);
  return info.param.backend + "_world" + std::to_string(info.param.world) + (layout.empty() ? "" : "_machines" + layout) +
         (info.param.lanes ? "" : "_tcp");
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << case_name(::testing::TestParamInfo<Case>(c, 0));
}

class PointToPoint : public ::testing::TestWithParam<Case> {};

TEST_P(PointToPoint, ExchangeTableHolds) {
  const Case& c = GetParam();
  CommOptions options;
  options.backend = c.backend;
  options.timeout = comm::Seconds(60);
  options.machine_of = c.machines;
  options.p2p_shared_memory = c.lanes;
  std::mutex mu;
  std::vector<std::string> failures;
  run_ranks_as_threads(c.world, options, [&](Communicator& comm) {
    auto f = run_p2p_exchange(comm, c.lanes);
    std::lock_guard<std::mutex> lock(mu);
    failures.insert(failures.end(), f.begin(), f.end());
  });
  for (const auto& f : failures) ADD_FAILURE() << f;
}

INSTANTIATE_TEST_SUITE_P(Shm, PointToPoint,
                         ::testing::Values(Case{"shm", 1}, Case{"shm", 2}, Case{"shm", 3}, Case{"shm", 4},
                                           Case{"shm", 3, {}, false}),
                         case_name);
#ifdef LOCKSTEP_HAVE_GLOO
INSTANTIATE_TEST_SUITE_P(Gloo, PointToPoint, ::testing::Values(Case{"gloo", 2}, Case{"gloo", 3}), case_name);
INSTANTIATE_TEST_SUITE_P(Hier, PointToPoint, ::testing::Values(Case{"hier", 4, {0, 0, 1, 1}}), case_name);
#endif

class PointToPointProcesses : public ::testing::TestWithParam<std::string> {};

TEST_P(PointToPointProcesses, ExchangeTableHolds) {
  expect_worker_ranks_pass(3, {"p2p", GetParam()});
}

INSTANTIATE_TEST_SUITE_P(Backends, PointToPointProcesses, ::testing::ValuesIn(process_backends()));

#ifdef LOCKSTEP_HAVE_MPI
// Under a real mpirun with no store: the ranks exchange their addresses with one MPI allgather.
TEST(PointToPointMpi, ExchangeTableHoldsUnderMpirun) {
  expect_worker_passes_under_mpirun(3, "p2p mpi");
}
#endif

// Rank 1 is killed while rank 0 waits to receive from it: rank 0's recv is a PeerError naming
// rank 1 (the worker exits 3 on a PeerError), not a wait until the timeout (here 300 s).
TEST(PointToPointFaults, ARecvFromAPeerThatDiesIsAPeerError) {
  LocalStore store;
  auto children = spawn_ranks(2, {helper_path("comm_worker"), "p2p_die", "shm"}, store);
  EXPECT_EQ(wait_child(children[0], 60), 3) << read_file(children[0].stdout_path);
  EXPECT_NE(read_file(children[0].stdout_path).find("rank 1"), std::string::npos) << read_file(children[0].stdout_path);
  EXPECT_EQ(wait_child(children[1], 60), 128 + 9);
}

// Runs comm_worker's p2p_kill on 2 ranks (rank 0 `direction`s, `whole` messages before the
// signal, `how` "kill" or "stop") with the given transport and timeout, and checks what rank 0
// reports: the worker exits 3 only when its transfer failed within 10 s of a kill (30 s of a
// stop) and no message arrived incomplete; the error names rank 1, which ends killed.
void expect_transfer_fails(const char* direction, const char* lanes, int whole, const char* how, const char* timeout) {
  LocalStore store;
  auto children =
      spawn_ranks(2, {helper_path("comm_worker"), "p2p_kill", "shm", std::to_string(whole), direction, how}, store,
                  {{"LOCKSTEP_P2P_SHM", lanes}, {"LOCKSTEP_TIMEOUT", timeout}});
  EXPECT_EQ(wait_child(children[0], 60), 3) << read_file(children[0].stdout_path);
  const std::string said = read_file(children[0].stdout_path);
  std::printf("LOCKSTEP_P2P_SHM=%s, rank 0 %ss: %s", lanes, direction, said.c_str());
  EXPECT_NE(said.find("rank 1"), std::string::npos) << said;
  EXPECT_EQ(wait_child(children[1], 60), 128 + 9) << read_file(children[1].stdout_path);
}

// A peer killed in the middle of a 32 MiB message, after a random number (1-3) of whole ones, both
// ways (rank 0 receiving from it, or sending to it) and both paths (the shared-memory lane and
// loopback TCP): rank 0's transfer fails with a PeerError within seconds, though the
// communicator's timeout is 300 s.
TEST(PointToPointFaults, APeerKilledMidTransferIsAPeerErrorWithinSeconds) {
  const unsigned seed = std::random_device{}();
  std::mt19937 draw(seed);
  for (const char* direction : {"recv", "send"})
    for (const char* lanes : {"1", "0"}) {
      const int whole = static_cast<int>(draw() % 3) + 1;  // connected, and streaming
      SCOPED_TRACE(std::string("seed ") + std::to_string(seed) + ": rank 0 " + direction + "s, " +
                   std::to_string(whole) + " whole messages first, LOCKSTEP_P2P_SHM=" + lanes);
      expect_transfer_fails(direction, lanes, whole, "kill", "300");
    }
}

// The same with rank 1 stopped (SIGSTOP: alive, its connections open, but stuck) instead of
// killed, and a 2 s timeout: rank 0's transfer fails within 30 s instead of waiting for good (on
// the lane the receiver times the rest of a message it got part of, as a TCP read times out; the
// sender gives up on a ring nobody empties).
TEST(PointToPointFaults, APeerStoppedMidTransferFailsTheTransferAfterTheTimeout) {
  for (const char* direction : {"recv", "send"})
    for (const char* lanes : {"1", "0"}) {
      SCOPED_TRACE(std::string("rank 0 ") + direction + "s, LOCKSTEP_P2P_SHM=" + lanes);
      expect_transfer_fails(direction, lanes, 1, "stop", "2");
    }
}

// A recv nobody sends to fails after CommOptions::timeout, naming its source and tag; rank 1
// stays up (held on a condition, not a sleep) until rank 0 has seen the error.
TEST(PointToPointFaults, ARecvNobodyAnswersTimesOutNamingSourceAndTag) {
  CommOptions options{"gloo"};
  options.timeout = comm::Seconds(1);
  std::mutex mu;
  std::condition_variable cv;
  bool seen = false;
  std::string what;
  run_ranks_as_threads(2, options, [&](Communicator& comm) {
    if (comm.rank() == 1) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return seen; });
      return;
    }
    std::int32_t x = 0;
    try {
      comm.recv(&x, 1, DType::i32, 1, 9)->wait();
    } catch (const TimeoutError& e) {
      what = e.what();
    }
    std::lock_guard<std::mutex> lock(mu);
    seen = true;
    cv.notify_all();
  });
  EXPECT_NE(what.find("recv of i32 x 1 from rank 1 (tag 9)"), std::string::npos) << what;
}

TEST(PointToPointFaults, ARankOutsideTheCommunicatorIsAConfigError) {
  run_ranks_as_threads(2, CommOptions{"shm"}, [](Communicator& comm) {
    float x = 0;
    EXPECT_THROW(comm.send(&x, 1, DType::f32, 2, 0), ConfigError);
    EXPECT_THROW(comm.recv(&x, 1, DType::f32, -2, 0), ConfigError);
    EXPECT_THROW(comm.send(nullptr, 3, DType::f32, 0, 0), ConfigError);
  });
}

}  // namespace
}  // namespace lockstep::testing
