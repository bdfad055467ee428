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

// Ranks 1..size-1 whose key did not appear within `timeout` (after the first such rank, only
// those missing at that moment; without wait_all, only the first).
std::vector<int> ranks_missing(comm::StoreClient& store, const std::string& base, int size, comm::Seconds timeout,
                               bool wait_all) {
  std::vector<int> missing;
  const auto deadline = Clock::now() + timeout;
  for (int r = 1; r < size; ++r) {
    const std::string key = base + "arrived/" + std::to_string(r);
    if (!missing.empty()) {
      if (!store.try_get(key)) missing.push_back(r);
      continue;
    }
    try {
      store.get(key, std::max(comm::Seconds(0), comm::Seconds(deadline - Clock::now())));
    } catch (const TimeoutError&) {
      missing.push_back(r);
      if (!wait_all) break;
    }
  }
  return missing;
}

std::string verdict_on(const std::vector<int>& missing, comm::Seconds timeout) {
  if (missing.empty()) return "ok";
  std::ostringstream m;
  m << (missing.size() == 1 ? "Rank " : "Ranks ");
  for (std::size_t i = 0; i < missing.size(); ++i) m << (i ? ", " : "") << missing[i];
  m << " failed to pass monitoredBarrier in " << static_cast<long long>(timeout.count() * 1000) << " ms";
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
    const auto missing = ranks_missing(store, base, size_, timeout, wait_all_ranks);
    verdict = verdict_on(missing, timeout);
    store.set(base + "verdict", verdict);
    for (int r = 1; r < size_; ++r) store.remove(base + "arrived/" + std::to_string(r));
    // Every rank has read the previous barrier's verdict once all arrived at this one.
    if (missing.empty() && monitored_barriers_ > 1)
      store.remove(store_->communicator_name() + "/monitored/" + std::to_string(monitored_barriers_ - 2) + "/verdict");
  });
  if (verdict != "ok") throw std::runtime_error("lockstep: monitored_barrier: " + verdict);
}

}  // namespace lockstep::torch_backend
