// The dropout masks' random bits (dropout.h): element i of one call draws 16 bits of
// splitmix64(seed + (i / 4) golden), four elements to a hash, each its own bits. Torch-free and
// branch-free, so that the kernels built for each instruction set vectorize it (a 64-bit multiply
// per lane on AVX-512).
#pragma once

#include <cstdint>

#include "kernel_clones.h"

namespace lockstep::models::kernels {

constexpr std::uint64_t kGolden = 0x9e3779b97f4a7c15ULL;

// splitmix64's output function: a bijective mix of a 64-bit counter (or of each lane of a vector
// of them).
template <class U>
LOCKSTEP_INLINE U mix(U z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Element i's 16 bits under `seed` (for a vector of indices, each lane's).
LOCKSTEP_INLINE std::uint32_t draw16(std::uint64_t seed, std::uint64_t i) {
  return static_cast<std::uint32_t>(mix(seed + (i >> 2) * kGolden) >> ((i & 3) * 16)) & 0xffffu;
}

template <class Longs>
LOCKSTEP_INLINE Longs draw16(std::uint64_t seed, Longs i) {
  return (mix(seed + (i >> 2) * kGolden) >> ((i & 3) * 16)) & 0xffffu;
}

}  // namespace lockstep::models::kernels
