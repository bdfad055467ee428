// The shm backend's reduce_scatter, in two algorithms (n bytes in each rank's block, W ranks,
// H = slot part bytes; cost is memory traffic):
//   staged: each copies the blocks others own in (per round up to H/W bytes of each); barrier;
//     each reduces its block. Per rank (W-1)*n copied in, W*n read by the reduction.
//   on shared buffers (the large buffer, send, from allocate_shared on every rank, the small one,
//     recv, inside it at the rank's offset; shared_collectives.cc): barrier; each rank reduces
//     its block straight out of every rank's buffer; barrier. No staging: ZeRO's reduce-scatters
//     cost what the shared allreduce does.
// Both reduce in rank order.
#include <algorithm>
#include <cstring>
#include <vector>

#include "shm/reduce.h"
#include "shm/shm_backend.h"

namespace lockstep::comm::shm {

void ShmBackend::reduce_scatter(const Collective& c) {
  const std::size_t esize = dtype_size(c.dtype);
  const std::size_t block = std::max<std::size_t>(part_bytes_ / esize / static_cast<std::size_t>(size_), 1);
  const char* send = static_cast<const char*>(c.send);
  char* recv = static_cast<char*>(c.recv);
  std::vector<const void*> inputs(static_cast<std::size_t>(size_));
  auto fill = [&](std::size_t offset, std::size_t m, int h) {
    char* mine = slot(rank_, h);
    for (int r = 0; r < size_; ++r)
      if (r != rank_)
        std::memcpy(mine + static_cast<std::size_t>(r) * block * esize,
                    send + (static_cast<std::size_t>(r) * c.count + offset) * esize, m * esize);
  };
  auto drain = [&](std::size_t offset, std::size_t m, int h) {
    for (int r = 0; r < size_; ++r)
      inputs[static_cast<std::size_t>(r)] =
          r == rank_ ? send + (static_cast<std::size_t>(rank_) * c.count + offset) * esize
                     : slot(r, h) + static_cast<std::size_t>(rank_) * block * esize;
    reduce(c.dtype, c.op, recv + offset * esize, inputs.data(), size_, m);
  };
  in_rounds(c, block, /*agree=*/true, fill, drain);
}

void ShmBackend::reduce_scatter_shared(const Collective& c, std::uint64_t id) {
  begin(c);
  agree_on_shared(c);
  const std::size_t block = c.count * dtype_size(c.dtype);
  const std::vector<char*> bufs = shared_buffers(c, static_cast<char*>(const_cast<void*>(c.send)));
  std::vector<const void*> inputs(static_cast<std::size_t>(size_));
  for (int r = 0; r < size_; ++r)
    inputs[static_cast<std::size_t>(r)] =
        bufs[static_cast<std::size_t>(r)] + static_cast<std::size_t>(rank_) * block;
  reduce(c.dtype, c.op, c.recv, inputs.data(), size_, c.count);
  barrier(c);  // peers no longer read this rank's buffer
  own_->mapped_by_all(id);
  ++round_;
}

}  // namespace lockstep::comm::shm
