// memcpy in 256-byte blocks through registers, for the shared-memory lanes' copies. glibc copies
// of a few KiB up to ~1 MiB use `rep movsb`, which on the AMD EPYC VM this was measured on ran at
// 2.5-3.5 GB/s whenever source and destination sat 16 bytes apart within 64 (a tensor's bytes
// behind a message's header in the ring: the usual case), against 14-22 GB/s aligned; these
// blocks ran at 9.5-16 GB/s at either offset (build/bench/copy_bench, bench/P2P.md).
#pragma once

#include <cstddef>
#include <cstring>

namespace lockstep::comm {

inline void copy_bytes(unsigned char* to, const unsigned char* from, std::size_t n) {
  constexpr std::size_t kBlock = 256;
  std::size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    unsigned char block[kBlock];
    __builtin_memcpy(block, from + i, kBlock);
    __builtin_memcpy(to + i, block, kBlock);
  }
  std::memcpy(to + i, from + i, n - i);
}

}  // namespace lockstep::comm
