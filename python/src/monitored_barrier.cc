// dist.monitored_barrier on a lockstep group. Every rank but 0 announces itself under a key of
// this barrier's own; rank 0 waits for the keys until the timeout, then publishes its verdict
// (which the others wait for), so every rank returns together or raises the same error, naming
// the ranks that did not arrive, as gloo's monitored barrier does. Through the group's store, not
// the communicator: a rank that is stuck elsewhere (or dead) must not stall the check itself.
#include <sstream>
#include <stdexcept>
#include <vector>

#include "lockstep/error.h"
#include "process_group.h"

namespace lockstep::torch_backend {
namespace {

struct Absent {
  std::vector<int> ranks;  // ranks 1..size-1 that did not arrive
  bool before_waiting = false;  // rank 0's time was up before it waited for the first of them
};

// Ranks whose key did not appear within `timeout` (after the first such rank, only those missing
// at that moment; without wait_all, only the first).
Absent ranks_missing(comm::StoreClient& store, const std::string& base, int size, comm::Seconds timeout,
                     bool wait_all) {
  Absent absent;
  const auto deadline = Clock::now() + timeout;
  for (int r = 1; r < size; ++r) {
    const std::string key = base + "arrived/" + std::to_string(r);
    if (store.try_get(key)) continue;
    if (absent.ranks.empty() && Clock::now() >= deadline) absent.before_waiting = true;
    if (absent.ranks.empty() && !absent.before_waiting) {
      try {
        store.get(key, comm::Seconds(deadline - Clock::now()));
        continue;
      } catch (const TimeoutError&) {
      }
    }
    absent.ranks.push_back(r);
    if (!wait_all) break;
  }
  return absent;
}

// gloo's words: "Rank 0 timed out in monitoredBarrier" when its time was up before it waited for a
// rank, "Rank N failed to pass monitoredBarrier" when it waited for rank N in vain.
std::string verdict_on(const Absent& absent, comm::Seconds timeout) {
  if (absent.ranks.empty()) return "ok";
  const long long ms = static_cast<long long>(timeout.count() * 1000);
  std::ostringstream m;
  if (absent.before_waiting) m << "Rank 0 timed out in monitoredBarrier after " << ms << " ms: ";
  m << (absent.ranks.size() == 1 ? "Rank " : "Ranks ");
  for (std::size_t i = 0; i < absent.ranks.size(); ++i) m << (i ? ", " : "") << absent.ranks[i];
  if (absent.before_waiting) {
    m << " had not arrived";
  } else {
    m << " failed to pass monitoredBarrier in " << ms << " ms";
  }
  return m.str();
}

}  // namespace

void ProcessGroupLockstep::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  const comm::Seconds timeout =
      opts.timeout == c10d::kUnsetTimeout ? timeout_ : std::chrono::duration_cast<comm::Seconds>(opts.timeout);
  const std::string base = store_->communicator_name() + "/monitored/" + std::to_string(monitored_barriers_++) + "/";
  comm::StoreClient& store = *store_->client();
  std::string verdict;
  without_gil([&] {
    if (rank_ != 0) {
      store.set(base + "arrived/" + std::to_string(rank_), "1");
      try {
        verdict = store.get(base + "verdict", timeout * 2);  // rank 0 takes up to `timeout` to decide
      } catch (const TimeoutError&) {
        verdict = "rank 0 did not finish monitoredBarrier within twice its timeout (" +
                  std::to_string(static_cast<long long>(timeout.count() * 2000)) + " ms)";
      }
      return;
    }
    const Absent missing = ranks_missing(store, base, size_, timeout, wait_all_ranks);
    verdict = verdict_on(missing, timeout);
    store.set(base + "verdict", verdict);
    for (int r = 1; r < size_; ++r) store.remove(base + "arrived/" + std::to_string(r));
    // Every rank has read the previous barrier's verdict once all arrived at this one.
    if (missing.ranks.empty() && monitored_barriers_ > 1)
      store.remove(store_->communicator_name() + "/monitored/" + std::to_string(monitored_barriers_ - 2) + "/verdict");
  });
  if (verdict != "ok") throw std::runtime_error("lockstep: monitored_barrier: " + verdict);
}

}  // namespace lockstep::torch_backend
