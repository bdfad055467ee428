// Element types and reduction operators understood by every communicator backend.
//
// Buffers cross the comm API as (pointer, element count, DType): comm never sees a tensor,
// so any C++ program can all-reduce a float*. Half-precision types (f16, bf16) are reduced
// in f32 and rounded once at the end.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "lockstep/base/clock.h"

namespace lockstep::comm {

using Seconds = std::chrono::duration<double>;

enum class DType : std::uint8_t { f32, f64, f16, bf16, i32, i64 };
// product multiplies (half types in f32, rounded once, as the others); band, bor and bxor are
// bitwise and apply to the integer types only (is_valid_reduction).
enum class ReduceOp : std::uint8_t { sum, avg, min, max, product, band, bor, bxor };

inline constexpr DType kAllDTypes[] = {DType::f32,  DType::f64, DType::f16,
                                       DType::bf16, DType::i32, DType::i64};
inline constexpr ReduceOp kAllReduceOps[] = {ReduceOp::sum,     ReduceOp::avg,  ReduceOp::min, ReduceOp::max,
                                             ReduceOp::product, ReduceOp::band, ReduceOp::bor, ReduceOp::bxor};

constexpr bool is_integer(DType t) { return t == DType::i32 || t == DType::i64; }
constexpr bool is_bitwise(ReduceOp op) { return op == ReduceOp::band || op == ReduceOp::bor || op == ReduceOp::bxor; }
// Whether `op` applies to `dtype`: everything but the bitwise ops applies to every type.
constexpr bool is_valid_reduction(ReduceOp op, DType dtype) { return !is_bitwise(op) || is_integer(dtype); }

constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::f16: return 2;
    case DType::bf16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
  }
  return 0;
}

const char* dtype_name(DType t);
const char* reduce_op_name(ReduceOp op);
// Parses "f32", "float32", "float", ...; throws ConfigError naming the accepted values.
DType parse_dtype(const std::string& name);
ReduceOp parse_reduce_op(const std::string& name);

// Conversions used by the half-precision paths (round to nearest even; NaN stays NaN).
float f16_to_f32(std::uint16_t h);
std::uint16_t f32_to_f16(float f);
inline float bf16_to_f32(std::uint16_t b) {
  std::uint32_t bits = static_cast<std::uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}
std::uint16_t f32_to_bf16(float f);

// Element i of a buffer of `dtype`, as a double; and the reverse (rounded to the type). For
// tests, checks and tools; not for hot loops.
double load_element(DType dtype, const void* buffer, std::size_t i);
void store_element(DType dtype, void* buffer, std::size_t i, double value);

// Every element of the buffer divided by `by` (> 0), in place: avg's last step, a sum on the
// wire divided once. Integers truncate toward zero; each float is rounded once, as if divided
// exactly.
void divide_elements(DType dtype, void* buffer, std::size_t count, int by);

// A recv's source that matches a message from any rank (Communicator::kAnySource).
inline constexpr int kAnySource = -1;

// Where a described message's elements go (Communicator::recv_described): given the description
// the sender put in front of them and their count and type, the memory for them. What it throws
// fails the recv.
using Place = std::function<void*(const std::string& description, std::size_t count, DType dtype)>;
// The longest description a message may carry.
inline constexpr std::size_t kMaxDescriptionBytes = 4096;

// A collective's GPU buffers that kernels still queued on a CUDA stream write: an event (a
// CUevent, the same as a cudaEvent_t) recorded on that stream after those kernels. A backend
// that takes device memory (nccl) has its own stream wait for the event on the GPU, so the
// caller goes on at once, and the event may be recorded again once the collective is done.
// Empty: the buffers are ready when the collective is called.
struct DeviceReady {
  void* event = nullptr;
};

}  // namespace lockstep::comm
