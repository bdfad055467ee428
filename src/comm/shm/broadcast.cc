// The shm backend's broadcast (n bytes, W ranks, H = slot part bytes): per round the root copies
// a chunk of up to H into its slot part; barrier; the others copy it out. n/H rounds of one
// barrier each; the root writes n, every other rank reads n. Scratch: the root's slot.
#include <cstring>

#include "shm/shm_backend.h"

namespace lockstep::comm::shm {

void ShmBackend::broadcast(const Collective& c) {
  const std::size_t esize = dtype_size(c.dtype);
  char* buf = static_cast<char*>(c.recv);
  in_rounds(
      c, part_bytes_ / esize, /*agree=*/false,
      [&](std::size_t offset, std::size_t m, int h) {
        if (rank_ == c.root) std::memcpy(slot(rank_, h), buf + offset * esize, m * esize);
      },
      [&](std::size_t offset, std::size_t m, int h) {
        if (rank_ != c.root) std::memcpy(buf + offset * esize, slot(c.root, h), m * esize);
      });
}

}  // namespace lockstep::comm::shm
