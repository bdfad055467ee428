// The dropout masks' bits (dropout_hash.h) for 16 elements at a time, in GCC's vectors (lanes.h),
// for the torch-free kernels only: built for the baseline x86-64, where a file with libtorch's
// headers is, these vectors would be passed in memory.
#pragma once

#include <cstdint>

#include "dropout_hash.h"
#include "kernel_clones.h"
#include "lanes.h"

namespace lockstep::models::kernels {

using Longs8 = std::uint64_t __attribute__((vector_size(64)));
using Words8 = std::uint32_t __attribute__((vector_size(32)));

// The 16 bits at each lane's place (counted in elements from the first hash's first element).
LOCKSTEP_INLINE Words8 bits_at(Longs8 hashes, Longs8 place) {
  return __builtin_convertvector(__builtin_shuffle(hashes, place >> 2) >> ((place & 3) * 16), Words8);
}

// The draws of the 16 elements from index `first`: the eight hashes of the words they fall in
// (four, or five when `first` is not a multiple of 4), each lane's 16 bits picked out. (One hash
// per element would cost more than the rest of a fused kernel's arithmetic.)
LOCKSTEP_INLINE Words draws_at(std::uint64_t seed, std::uint64_t first) {
  const Longs8 eight{0, 1, 2, 3, 4, 5, 6, 7};
  const Longs8 hashes = mix(seed + ((first >> 2) + eight) * kGolden);
  const Longs8 low = eight + (first & 3), high = low + 8;
  return __builtin_shufflevector(bits_at(hashes, low), bits_at(hashes, high), 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                 12, 13, 14, 15) &
         0xffffu;
}

// All ones in the lanes of the 16 elements from `first` that the mask keeps.
LOCKSTEP_INLINE Ints kept_lanes(const DropoutBits& drop, std::uint64_t first) {
  return bits_as<Ints>(draws_at(drop.seed, first) >= drop.threshold);
}

}  // namespace lockstep::models::kernels
