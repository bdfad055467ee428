#include "liveness.h"

#include <thread>

#include "lockstep/error.h"

namespace lockstep::comm {

PeerLiveness::PeerLiveness(const BackendContext& ctx)
    : store_(ctx.store),
      prefix_(ctx.prefix),
      rank_(ctx.rank),
      size_(ctx.size),
      global_ranks_(ctx.global_ranks),
      patience_(ctx.options.peer_check) {}

std::string PeerLiveness::key(const char* kind, int r) const {
  return prefix_ + kind + "/" + std::to_string(r);
}

void PeerLiveness::announce() {
  store_->set_ephemeral(key("alive", rank_), "1");
}

void PeerLiveness::mark_failed(const std::string& kind, const std::string& what) {
  try {
    store_->set(key("failed", rank_), kind + "\n" + what, patience_);
  } catch (const Error&) {
    // The store is gone too; peers will see their own errors.
  }
}

std::optional<std::string> PeerLiveness::failure_of(int r) {
  return store_->try_get(key("failed", r), patience_);
}

std::string PeerLiveness::unreachable_verdict() {
  return "a peer failed, and the store is unreachable too (a network partition, or the machine hosting it died)";
}

std::string PeerLiveness::dead_now() {
  std::string dead;
  int count = 0;
  try {
    for (int r = 0; r < size_; ++r) {
      if (r == rank_ || store_->try_get(key("alive", r), patience_) || failure_of(r)) continue;
      dead += (dead.empty() ? "" : ", ") + std::to_string(global(r));
      ++count;
    }
  } catch (const Error&) {
    store_reachable_ = false;
    return unreachable_verdict();
  }
  store_reachable_ = true;
  if (count == 0) return "";
  return (count == 1 ? "rank " : "ranks ") + dead + " died";
}

std::string PeerLiveness::dead_within(Seconds patience) {
  const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(patience);
  for (;;) {
    std::string dead = dead_now();
    if (!dead.empty() || Clock::now() >= until) return dead;
    // Bounded poll of a diagnostic, after the failure is already certain.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::string PeerLiveness::gone_among(const std::vector<int>& ranks) {
  std::string gone;
  for (int r : ranks) {
    if (r == rank_) continue;
    if (auto failed = failure_of(r)) {
      const std::string what = failed->substr(failed->find('\n') + 1);
      gone += (gone.empty() ? "" : "; ") + ("rank " + std::to_string(global(r)) + " left with an error: " +
                                            what.substr(0, what.find('\n')));
    } else if (!store_->try_get(key("alive", r), patience_)) {
      gone += (gone.empty() ? "" : "; ") + ("rank " + std::to_string(global(r)) + " died");
    }
  }
  return gone;
}

}  // namespace lockstep::comm
