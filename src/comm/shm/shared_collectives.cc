// What the shm backend's collectives on shared buffers (allocate_shared, shm_buffers.h) have in
// common: before its first barrier a rank publishes, in its control block, which of its buffers
// the collective runs on and where (or that it runs on private memory); after it, every rank
// checks that all did the same, and maps the peers' buffers it has not mapped yet.
//
// Which collectives run so: an allreduce in place (send == recv), an allgather whose recv, a
// reduce_scatter whose send, is a shared buffer with the rank's own chunk inside it at its offset.
// Any other runs through the segment's slots, and then every rank must have passed private memory.
#include <string>

#include "lockstep/error.h"
#include "shm/shm_backend.h"

namespace lockstep::comm::shm {

// In the descriptor slot of this collective's parity, like its signature (begin(), barrier.cc).
void ShmBackend::publish_shared(const Collective& c, const std::optional<Place>& shared) {
  const int parity = static_cast<int>(c.sequence & 1);
  control(rank_).shared_id[parity] = shared ? shared->id + 1 : 0;
  control(rank_).shared_offset[parity] = shared ? shared->offset : 0;
}

// The large buffer of an allgather (recv) or reduce_scatter (send), when it comes from
// allocate_shared and the small buffer sits in it at this rank's offset; published for the
// peers like the shared allreduce's.
std::optional<Place> ShmBackend::publish_shared_scatter(const Collective& c) {
  const std::size_t esize = dtype_size(c.dtype);
  const bool gather = c.kind == CollectiveKind::allgather;
  const char* large = static_cast<const char*>(gather ? c.recv : c.send);
  const char* small = static_cast<const char*>(gather ? c.send : c.recv);
  std::optional<Place> shared;
  if (c.count > 0 && small == large + static_cast<std::size_t>(rank_) * c.count * esize)
    shared = own_->find(large, static_cast<std::size_t>(size_) * c.count * esize);
  publish_shared(c, shared);
  return shared;
}

// Every rank must have passed a shared buffer, or none.
void ShmBackend::agree_on_shared(const Collective& c) {
  int parity = static_cast<int>(c.sequence & 1);
  bool mine = control(rank_).shared_id[parity] != 0;
  for (int r = 0; r < size_; ++r) {
    if ((control(r).shared_id[parity] != 0) == mine) continue;
    int with = mine ? rank_ : r, without = mine ? r : rank_;
    throw MismatchError(c.describe() + ": rank " + std::to_string(with) +
                        " passes a buffer from Communicator::allocate_shared (in place) but rank " +
                        std::to_string(without) +
                        " does not; pass shared buffers (in place) on every rank or on none");
  }
}

// The buffers of every rank for this collective: this rank's (`own`), and the peers' mapped here.
std::vector<char*> ShmBackend::shared_buffers(const Collective& c, char* own) {
  const int parity = static_cast<int>(c.sequence & 1);
  peers_->drop_released();
  std::vector<char*> bufs(static_cast<std::size_t>(size_));
  for (int r = 0; r < size_; ++r)
    bufs[static_cast<std::size_t>(r)] =
        r == rank_ ? own
                   : peer_buffer(r, control(r).shared_id[parity] - 1, c) + control(r).shared_offset[parity];
  return bufs;
}

// A peer's shared buffer, mapped here. A buffer that cannot be opened is usually the trace of a
// job already failing (its owner left after a peer died, and unlinked it): say that failure,
// which names the rank at its root, before the bare open error.
char* ShmBackend::peer_buffer(int r, std::uint64_t id, const Collective& c) {
  try {
    return peers_->data(r, id);
  } catch (const SystemError&) {
    check_abort(c);
    for (int p = 0; p < size_; ++p)
      if (p != rank_) check_peer(p, c);
    throw;
  }
}

}  // namespace lockstep::comm::shm
