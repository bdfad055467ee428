#include "lockstep/comm/reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace lockstep::comm::reference {

double input(int rank, std::size_t i) {
  return static_cast<double>(static_cast<long>((static_cast<std::size_t>(rank) * 7 + i * 3) % 13) - 4);
}

double reduced(ReduceOp op, DType dtype, int world, std::size_t i) {
  double sum = 0, lo = input(0, i), hi = input(0, i);
  for (int r = 0; r < world; ++r) {
    const double v = input(r, i);
    sum += v;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  double product = 1;
  std::int64_t band = static_cast<std::int64_t>(input(0, i)), bor = band, bxor = 0;
  for (int r = 0; r < world; ++r) {
    const auto v = static_cast<std::int64_t>(input(r, i));
    product *= static_cast<double>(v);
    band &= v, bor |= v, bxor ^= v;
  }
  switch (op) {
    case ReduceOp::product: return product;
    case ReduceOp::band: return static_cast<double>(band);
    case ReduceOp::bor: return static_cast<double>(bor);
    case ReduceOp::bxor: return static_cast<double>(bxor);
    case ReduceOp::sum: return sum;
    case ReduceOp::min: return lo;
    case ReduceOp::max: return hi;
    case ReduceOp::avg:
      return (dtype == DType::i32 || dtype == DType::i64) ? std::trunc(sum / world) : sum / world;
  }
  return 0;
}

double tolerance(DType dtype, double exact) {
  const double magnitude = std::abs(exact);
  switch (dtype) {
    case DType::f16: return std::ldexp(magnitude, -10);
    case DType::bf16: return std::ldexp(magnitude, -7);
    case DType::f32: return std::ldexp(magnitude, -22);
    case DType::f64: return std::ldexp(magnitude, -50);
    case DType::i32:
    case DType::i64: return 0;
  }
  return 0;
}

}  // namespace lockstep::comm::reference
