// Element types through float for the models' own CPU kernels: float, and bf16 as its bits (to
// float exactly; back with rounding to nearest even, as c10::BFloat16 does, a NaN staying a NaN),
// in plain integer operations without a branch, which the vectorizer takes. Torch-free.
#pragma once

#include <cstdint>
#include <cstring>

namespace lockstep::models::kernels {

using Bf16Bits = std::uint16_t;

inline __attribute__((always_inline)) float widen(float v) {
  return v;
}

inline __attribute__((always_inline)) float widen(Bf16Bits v) {
  const std::uint32_t bits = static_cast<std::uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline __attribute__((always_inline)) void narrow(float v, float& out) {
  out = v;
}

inline __attribute__((always_inline)) void narrow(float v, Bf16Bits& out) {
  std::uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const std::uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const std::uint32_t nan = 0u - static_cast<std::uint32_t>(v != v);  // all ones for a NaN
  out = static_cast<Bf16Bits>((rounded & ~nan) | (0x7fc0u & nan));
}

}  // namespace lockstep::models::kernels
