// The state behind a Work, and the queue whose mutex guards it: shared by the communicator's
// collectives (communicator.cc) and its point-to-point mailbox (p2p/mailbox.cc), whose Works
// wait on a queue of their own with no progress thread.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "backend.h"
#include "flight_ring.h"
#include "lockstep/comm/work.h"

namespace lockstep::comm {

// All work state of one communicator is guarded by its queue's mutex: completions are rare
// enough (one per collective) that one lock is simpler than one per Work, and it lets a waiting
// caller take over a collective the progress thread has not started (see Work::wait).
struct WorkQueue {
  std::mutex mu;
  std::condition_variable work_cv;  // the progress thread sleeps here
  std::condition_variable done_cv;  // callers of Work::wait sleep here
  std::deque<std::shared_ptr<WorkState>> pending;
  bool running = false;  // a collective is on the backend (by either thread)
  bool stopping = false;
  std::uint64_t next_sequence = 0;
  std::exception_ptr broken;  // the first error; later collectives fail with it
  std::string broken_text;
  Backend* backend = nullptr;
  Seconds collective_timeout{300};
  std::thread thread;
  // What the watchdog looks at.
  FlightRing ring;
  std::optional<Collective> in_flight;
  Clock::time_point state_since = Clock::now();
  std::uint64_t events = 0;
  double busy_seconds = 0;  // every collective's run, summed
  std::function<void()> on_broken;  // wakes the watchdog

  // Runs the front collective with `lock` released; the caller set running = true.
  void run(std::unique_lock<std::mutex>& lock, WorkState& w);
};

struct WorkState {
  WorkQueue* queue;
  bool done = false;
  std::exception_ptr error;
  double seconds = 0;
  Clock::time_point started{}, finished{};
  Collective collective;
  std::string label;  // point-to-point: "recv of f32 x 10 from rank 1, tag 3" (else collective.describe())
  int source = -1;    // point-to-point: the rank the message came from
  std::string describe() const { return label.empty() ? collective.describe() : label; }
};

}  // namespace lockstep::comm
