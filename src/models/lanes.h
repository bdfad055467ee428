// Sixteen floats as one value (GCC's vector extension: one AVX-512 register, two AVX2 ones, four
// SSE ones, by the instruction set of the kernel copy that inlines it), for kernels whose loops
// are too short for `omp simd` to pay: rows of a few vectors, where its reductions (folded
// lane by lane through memory) and scalar remainders cost more than the arithmetic. Loads and
// stores of float and bf16 (rounded to nearest even, as bf16_bits.h), the first n of 16 at a
// row's end; horizontal sums and maxima. Torch-free.
#pragma once

#include <cstdint>
#include <cstring>

#include "bf16_bits.h"
#include "kernel_clones.h"

namespace lockstep::models::kernels {

constexpr std::int64_t kLanes = 16;

using Floats = float __attribute__((vector_size(4 * kLanes)));
using Ints = std::int32_t __attribute__((vector_size(4 * kLanes)));
using Words = std::uint32_t __attribute__((vector_size(4 * kLanes)));
using Longs = std::uint64_t __attribute__((vector_size(8 * kLanes)));
using Halves = std::uint16_t __attribute__((vector_size(2 * kLanes)));

template <class To, class From>
LOCKSTEP_INLINE To bits_as(const From& from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}

// How many of the 16 lanes from element c hold elements of [0, end): 16, or what is left at the end.
LOCKSTEP_INLINE std::int64_t lanes_at(std::int64_t c, std::int64_t end) {
  return end - c < kLanes ? end - c : kLanes;
}

// 0, 1, ..., 15.
LOCKSTEP_INLINE Ints lane_index() {
  return Ints{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
}

// The n (at most 16) elements at p as a vector of T; the lanes past n 0.
template <class V, class T>
LOCKSTEP_INLINE V load_raw(const T* p, std::int64_t n) {
  static_assert(sizeof(V) == kLanes * sizeof(T));
  V v{};
  if (n == kLanes) {
    std::memcpy(&v, p, sizeof v);  // one load
  } else {
    std::memcpy(&v, p, static_cast<std::size_t>(n) * sizeof(T));
  }
  return v;
}

template <class V, class T>
LOCKSTEP_INLINE void store_raw(T* p, const V& v, std::int64_t n) {
  if (n == kLanes) {
    std::memcpy(p, &v, sizeof v);  // one store
  } else {
    std::memcpy(p, &v, static_cast<std::size_t>(n) * sizeof(T));
  }
}

LOCKSTEP_INLINE Floats load(const float* p, std::int64_t n = kLanes) {
  return load_raw<Floats>(p, n);
}

LOCKSTEP_INLINE Floats load(const Bf16Bits* p, std::int64_t n = kLanes) {
  return bits_as<Floats>(__builtin_convertvector(load_raw<Halves>(p, n), Words) << 16);
}

LOCKSTEP_INLINE void store(float* p, Floats v, std::int64_t n = kLanes) {
  store_raw(p, v, n);
}

// v as the element type T rounds it, still in float: bf16 to nearest even, a NaN staying a NaN.
template <class T>
LOCKSTEP_INLINE Floats rounded_to(Floats v) {
  if constexpr (sizeof(T) == sizeof(float)) {
    return v;
  } else {
    const Words bits = bits_as<Words>(v);
    const Words rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    const Words nan = bits_as<Words>(v != v);  // all ones for a NaN
    return bits_as<Floats>((rounded & ~nan) | (0x7fc00000u & nan));
  }
}

LOCKSTEP_INLINE void store(Bf16Bits* p, Floats v, std::int64_t n = kLanes) {
  store_raw(p, __builtin_convertvector(bits_as<Words>(rounded_to<Bf16Bits>(v)) >> 16, Halves), n);
}

LOCKSTEP_INLINE float sum_of(Floats v) {
  using Half = float __attribute__((vector_size(2 * kLanes)));
  using Quarter = float __attribute__((vector_size(kLanes)));
  const Half h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Quarter q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

LOCKSTEP_INLINE float max_of(Floats v) {
  using Half = float __attribute__((vector_size(2 * kLanes)));
  using Quarter = float __attribute__((vector_size(kLanes)));
  const Half a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const Half b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Half h = a < b ? b : a;
  const Quarter c = __builtin_shufflevector(h, h, 0, 1, 2, 3), d = __builtin_shufflevector(h, h, 4, 5, 6, 7);
  const Quarter q = c < d ? d : c;
  const float x = q[0] < q[2] ? q[2] : q[0], y = q[1] < q[3] ? q[3] : q[1];
  return x < y ? y : x;
}

}  // namespace lockstep::models::kernels
