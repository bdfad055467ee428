// What a collective or a point-to-point call returns: a handle to wait on, whose state the
// communicator (or the mailbox) completes. Torch-free.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>

#include "lockstep/comm/types.h"

namespace lockstep::comm {

struct WorkState;

// One in-flight collective or message. A Work must not outlive its Communicator.
class Work {
 public:
  explicit Work(std::shared_ptr<WorkState> state) : state_(std::move(state)) {}
  bool done() const;
  // Blocks until done; rethrows the collective's error. TimeoutError when `timeout` passes
  // first (the collective itself keeps running; wait again or exit).
  // The default waits as long as the collective may take (it has its own deadline).
  void wait(Seconds timeout = Seconds(1e9));
  // Seconds the progress thread spent running this collective (0 until done).
  double seconds() const;
  // When the collective began and ended running (steady clock; both epoch until it has).
  // A trace or an overlap check reads these instead of timing the caller.
  std::chrono::steady_clock::time_point started() const;
  std::chrono::steady_clock::time_point finished() const;
  std::uint64_t sequence() const;  // collectives only (0 for send and recv)
  // A recv's source once it is done (the one it matched for kAnySource); -1 before, and for others.
  int source_rank() const;

 private:
  std::shared_ptr<WorkState> state_;
};
using WorkPtr = std::shared_ptr<Work>;

}  // namespace lockstep::comm
