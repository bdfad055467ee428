// The shm backend's allreduce, in three algorithms (n bytes per rank, W ranks, H = slot part
// bytes; cost is memory traffic):
//   one-shot, n <= one-shot limit: copy in; barrier; every rank reduces all W inputs.
//     1 barrier, reads W*n. Latency-optimal for small messages.
//   pipelined, larger: per round a chunk of up to H (a slot part) is split into W segments.
//     Each rank copies the segments others own into its part; barrier; it copies out the
//     segments its peers reduced in the previous round (all-gather), then reduces segment r
//     of this round straight from its own input and the peers' parts into its part
//     (reduce-scatter); after the last round one more barrier and all-gather. One barrier per
//     round: the all-gather of round i is pipelined behind the barrier of round i+1. Per rank
//     ~2n copied + n reduced, independent of W. Reduction order is rank order on both paths,
//     so every rank gets bitwise the same result.
//   in place on buffers from allocate_shared (shm_buffers.h) on every rank: barrier;
//     each rank reduces its 1/W of the elements straight out of every rank's buffer and writes
//     the result into all of them; barrier. Per rank n read and n written, about half the
//     staged path's traffic, in 2 barriers whatever n.
// Scratch: the slots of the segment (shm_backend.cc); the in-place one needs none.
#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "shm/reduce.h"
#include "shm/shm_backend.h"

namespace lockstep::comm::shm {

void ShmBackend::allreduce(const Collective& c) {
  // Publish whether this is an in-place allreduce on a shared buffer; begin()'s barrier
  // carries it to the peers, and agree_on_shared() compares.
  std::optional<Place> shared;
  if (c.send == c.recv && c.count > 0) shared = own_->find(c.recv, c.count * dtype_size(c.dtype));
  publish_shared(c, shared);
  if (shared) return allreduce_shared(c, shared->id, nullptr);
  if (c.count * dtype_size(c.dtype) <= std::min(options_.shm_one_shot_bytes, part_bytes_))
    return allreduce_one_shot(c);
  return allreduce_chunked(c);
}

void ShmBackend::allreduce_one_shot(const Collective& c) {
  std::size_t bytes = c.count * dtype_size(c.dtype);
  int h = part();
  std::memcpy(slot(rank_, h), c.send, bytes);
  begin(c);
  agree_on_shared(c);
  std::vector<const void*> inputs(static_cast<std::size_t>(size_));
  for (int r = 0; r < size_; ++r) inputs[static_cast<std::size_t>(r)] = r == rank_ ? c.send : slot(r, h);
  reduce(c.dtype, c.op, c.recv, inputs.data(), size_, c.count);
  ++round_;
}

void ShmBackend::allreduce_chunked(const Collective& c) {
  const std::size_t esize = dtype_size(c.dtype);
  const std::size_t unit = kAlign / std::min<std::size_t>(esize, kAlign);  // elements per line
  const std::size_t chunk = std::max<std::size_t>(part_bytes_ / esize / (unit * size_), 1) * unit * size_;
  const char* send = static_cast<const char*>(c.send);
  char* recv = static_cast<char*>(c.recv);
  std::vector<const void*> inputs(static_cast<std::size_t>(size_));
  // One chunk's split into W segments, and where its reduced segments wait in the slots.
  struct Round {
    std::size_t offset = 0, m = 0, seg = 0;
    int part = 0;
    std::size_t begin(int r) const { return std::min(m, seg * static_cast<std::size_t>(r)); }
    std::size_t len(int r) const { return begin(r + 1) - begin(r); }
  };
  auto gather = [&](const Round& g) {
    for (int r = 0; r < size_; ++r)
      if (r != rank_)
        std::memcpy(recv + (g.offset + g.begin(r)) * esize, slot(r, g.part) + g.begin(r) * esize,
                    g.len(r) * esize);
  };
  std::optional<Round> previous;
  for (std::size_t offset = 0; offset < c.count; offset += chunk) {
    Round now;
    now.offset = offset;
    now.m = std::min(chunk, c.count - offset);
    now.seg = round_up((now.m + size_ - 1) / size_, unit);
    now.part = part();
    char* mine = slot(rank_, now.part);
    for (int r = 0; r < size_; ++r)
      if (r != rank_)
        std::memcpy(mine + now.begin(r) * esize, send + (offset + now.begin(r)) * esize, now.len(r) * esize);
    if (previous) {
      barrier(c);
    } else {
      begin(c);
      agree_on_shared(c);
    }
    if (previous) gather(*previous);
    std::size_t my_begin = now.begin(rank_);
    for (int r = 0; r < size_; ++r)
      inputs[static_cast<std::size_t>(r)] =
          r == rank_ ? send + (offset + my_begin) * esize : slot(r, now.part) + my_begin * esize;
    reduce(c.dtype, c.op, mine + my_begin * esize, inputs.data(), size_, now.len(rank_));
    std::memcpy(recv + (offset + my_begin) * esize, mine + my_begin * esize, now.len(rank_) * esize);
    previous = now;
    ++round_;
  }
  barrier(c);
  gather(*previous);
  ++round_;
}

// Without `between`: each block of the share is copied to the peers right after it is
// reduced, while it is in L1. With it: the whole share is reduced first, `between` runs
// (hier's step across machines), then the share is copied.
void ShmBackend::allreduce_shared(const Collective& c, std::uint64_t id, const ShareStep* between) {
  begin(c);
  agree_on_shared(c);
  const std::size_t esize = dtype_size(c.dtype);
  const std::vector<char*> bufs = shared_buffers(c, static_cast<char*>(c.recv));
  // This rank's share, in whole cache lines: when the buffers are line-aligned (DDP's buckets
  // are page-aligned), no two ranks write one line.
  const std::size_t unit = kAlign / std::min<std::size_t>(esize, kAlign);
  const std::size_t seg = round_up((c.count + size_ - 1) / size_, unit);
  const std::size_t first = std::min(c.count, seg * static_cast<std::size_t>(rank_));
  const std::size_t last = std::min(c.count, first + seg);
  // Blocks small enough that the copies to peers read the result from L1.
  const std::size_t block = std::max<std::size_t>(16384 / esize, unit);
  std::vector<const void*> inputs(static_cast<std::size_t>(size_));
  char* mine = bufs[static_cast<std::size_t>(rank_)];
  auto copy_to_peers = [&](std::size_t i, std::size_t m) {
    for (int r = 0; r < size_; ++r)
      if (r != rank_) std::memcpy(bufs[static_cast<std::size_t>(r)] + i * esize, mine + i * esize, m * esize);
  };
  for (std::size_t i = first; i < last; i += block) {
    const std::size_t m = std::min(block, last - i);
    for (int r = 0; r < size_; ++r)
      inputs[static_cast<std::size_t>(r)] = bufs[static_cast<std::size_t>(r)] + i * esize;
    reduce(c.dtype, c.op, mine + i * esize, inputs.data(), size_, m);
    if (!between) copy_to_peers(i, m);
  }
  if (between) {
    (*between)(mine + first * esize, first, last - first);
    copy_to_peers(first, last - first);
  }
  barrier(c);  // every share is everywhere; peers no longer touch this rank's buffer
  own_->mapped_by_all(id);
  ++round_;
}

}  // namespace lockstep::comm::shm
