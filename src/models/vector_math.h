// Element-wise float math for the models' torch-free kernels, in plain arithmetic and selects:
// for a float (which the vectorizer takes in `omp simd` loops) and for a vector of floats (GCC's
// vector extension, lanes.h), from one template. Each kernel's copy for an instruction set inlines
// them.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernel_clones.h"

namespace lockstep::models::kernels {

// v in every lane of F (a float, or a vector of floats).
template <class F>
LOCKSTEP_INLINE F splat(float v) {
  return F{} + v;
}

// n, a whole number in float, as a 32-bit integer of F's shape.
LOCKSTEP_INLINE std::int32_t whole(float n) {
  return static_cast<std::int32_t>(n);
}

template <class F>
LOCKSTEP_INLINE auto whole(F n) {
  return __builtin_convertvector(n, decltype(n < n));  // a comparison's lanes: 32-bit integers
}

// e^x for x in [-88, 88] (callers clamp): 2^n e^r with |r| <= ln(2)/2, e^r by Cephes' polynomial.
template <class F>
LOCKSTEP_INLINE F exp_clamped(F x) {
  // n = t rounded to the nearest integer: adding and taking away 1.5 * 2^23 leaves no fraction.
  const F t = x * 1.4426950408889634f;
  const F n = (t + 12582912.0f) - 12582912.0f;
  const F r = x - n * 0.693359375f + n * 2.12194440e-4f;
  F p = splat<F>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const auto bits = (whole(n) + 127) << 23;  // n >= -127, so no sign bit
  F scale;
  static_assert(sizeof bits == sizeof scale);
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Two selects of their own, which the vectorizer takes (one nested in the other it does not).
template <class F>
LOCKSTEP_INLINE F clamp88(F x) {
  const F low = splat<F>(-88.0f), high = splat<F>(88.0f);
  const F above = x < low ? low : x;
  return above > high ? high : above;
}

}  // namespace lockstep::models::kernels
