// The shm backend's allgather, in three algorithms (n bytes per rank's chunk, W ranks, H = slot
// part bytes; cost is memory traffic):
//   staged: each copies its chunk in (per round up to H); barrier; each copies all chunks out.
//     Per rank n copied in, W*n copied out (its own chunk not, when it is already in place).
//   on shared buffers (the large buffer, recv, from allocate_shared on every rank, the small one,
//     send, inside it at the rank's offset; shared_collectives.cc): barrier; each rank copies the
//     peers' chunks straight out of their buffers; barrier. No staging: ZeRO's gathers cost what
//     the shared allreduce does.
//   into machine memory (one block all ranks map, shm/machine_blocks.h): barrier (every
//     rank issued it, so nobody still reads the block's old contents); each rank writes its own
//     chunk; barrier. Each chunk is written once, into the one copy. The same two barriers fence
//     any write into the block (fenced_machine_write: hier's chunks gathered across machines).
#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "lockstep/error.h"
#include "shm/shm_backend.h"

namespace lockstep::comm::shm {

void ShmBackend::allgather(const Collective& c) {
  const std::size_t esize = dtype_size(c.dtype);
  const char* send = static_cast<const char*>(c.send);
  char* recv = static_cast<char*>(c.recv);
  in_rounds(
      c, part_bytes_ / esize, /*agree=*/true,
      [&](std::size_t offset, std::size_t m, int h) {
        std::memcpy(slot(rank_, h), send + offset * esize, m * esize);
      },
      [&](std::size_t offset, std::size_t m, int h) {
        for (int r = 0; r < size_; ++r) {
          char* dst = recv + (static_cast<std::size_t>(r) * c.count + offset) * esize;
          const char* src = r == rank_ ? send + offset * esize : slot(r, h);
          if (dst != src) std::memmove(dst, src, m * esize);
        }
      });
}

void ShmBackend::allgather_shared(const Collective& c, std::uint64_t id) {
  begin(c);
  agree_on_shared(c);
  const std::size_t bytes = c.count * dtype_size(c.dtype);
  const std::vector<char*> bufs = shared_buffers(c, static_cast<char*>(c.recv));
  for (int r = 0; r < size_; ++r)
    if (r != rank_)
      std::memcpy(bufs[static_cast<std::size_t>(rank_)] + static_cast<std::size_t>(r) * bytes,
                  bufs[static_cast<std::size_t>(r)] + static_cast<std::size_t>(r) * bytes, bytes);
  barrier(c);  // peers no longer read this rank's chunk
  own_->mapped_by_all(id);
  ++round_;
}

void ShmBackend::allgather_machine(const Collective& c) {
  const std::size_t bytes = c.count * dtype_size(c.dtype);
  fenced(c, [&] {
    std::memcpy(static_cast<char*>(c.recv) + static_cast<std::size_t>(rank_) * bytes, c.send, bytes);
  });
}

// Between two barriers, `write` into the machine block at c.recv, once the ranks agree that it
// is the same place of the same block.
void ShmBackend::fenced(const Collective& c, const std::function<void()>& write) {
  const auto place = machine_->find(c.recv);
  if (!place)
    throw ConfigError("shm: " + c.describe() + " on rank " + std::to_string(global(rank_)) +
                      ": recv is not memory from allocate_machine_memory");
  const int parity = static_cast<int>(c.sequence & 1);
  publish_shared(c, place);
  begin(c);
  for (int r = 0; r < size_; ++r)
    if (control(r).shared_id[parity] != place->id + 1 || control(r).shared_offset[parity] != place->offset)
      throw MismatchError("shm: " + c.describe() + ": rank " + std::to_string(global(r)) +
                          " writes another place of the machine's memory (block " +
                          std::to_string(control(r).shared_id[parity] - 1) + ", byte " +
                          std::to_string(control(r).shared_offset[parity]) + ") than rank " +
                          std::to_string(global(rank_)) + " (block " + std::to_string(place->id) + ", byte " +
                          std::to_string(place->offset) +
                          "): the ranks of a machine must take their memory in "
                          "the same order");
  machine_->mapped_by_all(place->id);
  write();
  barrier(c);  // the whole block is written
  ++round_;
}

}  // namespace lockstep::comm::shm
