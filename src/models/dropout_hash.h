// The dropout masks' random bits (dropout.h): element i of one call draws 16 bits of
// splitmix64(seed + (i / 4) golden), four elements to a hash, each its own bits, and is kept when
// they reach the call's threshold. Torch-free and branch-free, for the kernels built for each
// instruction set (16 elements at a time: dropout_lanes.h).
#pragma once

#include <cstdint>

#include "kernel_clones.h"

namespace lockstep::models::kernels {

// One call's mask. threshold 0 keeps every element; `kept` is the kept values' scale in the
// element's type.
struct DropoutBits {
  std::uint64_t seed;
  std::uint32_t threshold;
  float kept;
};

constexpr std::uint64_t kGolden = 0x9e3779b97f4a7c15ULL;

// splitmix64's output function: a bijective mix of a 64-bit counter (or of each lane of a vector
// of them, dropout_lanes.h).
template <class U>
LOCKSTEP_INLINE U mix(U z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Element i's 16 bits under `seed`.
LOCKSTEP_INLINE std::uint32_t draw16(std::uint64_t seed, std::uint64_t i) {
  return static_cast<std::uint32_t>(mix(seed + (i >> 2) * kGolden) >> ((i & 3) * 16)) & 0xffffu;
}

}  // namespace lockstep::models::kernels
