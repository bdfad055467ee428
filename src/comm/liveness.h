// Whether a group's peers are alive, as the rendezvous store sees them: the one verdict of every
// backend that learns of dead peers through the store (gloo, nccl).
//
// Each member holds the ephemeral key "<prefix>alive/<rank>", which the store drops when the
// member's connection closes (its process died, or its machine went). A member that leaves
// because of an error first writes "<prefix>failed/<rank>" ("<kind>\n<message>"): its key then
// vanishes too, but it did not die, and peers must not blame it for their own errors.
//
//   PeerLiveness alive(ctx);                 // ctx: the backend's (backend.h)
//   alive.announce();                        // once, when the member is ready
//   if (auto dead = alive.dead_now(); !dead.empty()) ...   // "rank 3 died", "ranks 2, 3 died"
//
// Every look asks the store with the options' peer_check as its patience; a store that cannot be
// reached gives its own verdict (unreachable_verdict()), and store_reachable() says so until a
// later look reaches it.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend.h"

namespace lockstep::comm {

class PeerLiveness {
 public:
  explicit PeerLiveness(const BackendContext& ctx);

  void announce();
  // Tells peers this member leaves because of an error (best effort: the store may be gone too).
  void mark_failed(const std::string& kind, const std::string& what);
  // What peer r wrote when it left because of an error, if it did.
  std::optional<std::string> failure_of(int r);

  // The peers whose key is gone and that announced no failure, by their global ranks ("" when
  // every peer is there); unreachable_verdict() when the store cannot be asked.
  std::string dead_now();
  // dead_now(), asked again until it names someone or `patience` passes.
  std::string dead_within(Seconds patience);
  // The peers among `ranks` (this backend's) that died or left with an error, described ("rank 3
  // died", "rank 2 left with an error: ..."); "" when every one is there. Only for peers known to
  // have announced themselves: one that has not yet looks dead too.
  std::string gone_among(const std::vector<int>& ranks);
  bool store_reachable() const { return store_reachable_; }
  Seconds patience() const { return patience_; }
  static std::string unreachable_verdict();

 private:
  std::string key(const char* kind, int r) const;
  int global(int r) const { return global_ranks_.empty() ? r : global_ranks_[static_cast<std::size_t>(r)]; }

  std::shared_ptr<StoreClient> store_;
  std::string prefix_;
  int rank_, size_;
  std::vector<int> global_ranks_;
  Seconds patience_;
  std::atomic<bool> store_reachable_{true};  // as the last look found it
};

}  // namespace lockstep::comm
