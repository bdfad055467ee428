// How torch tensors cross lockstep's comm, which moves (pointer, count, DType) buffers of six
// element types: f32, f64, f16, bf16, i32, i64.
//
// A WireSpec says how one tensor's elements travel:
//   native         the six types above, as they are;
//   widened        uint8, int8, int16 and bool in reductions: as i32 (exact for any world size a
//                  sum of them fits in), narrowed back afterwards the way torch's casts do
//                  (uint8 wraps modulo 256; bool is "not zero");
//   complex_pairs  complex64/128 in SUM and AVG: as their (real, imaginary) f32/f64 pairs;
//   bytes          any type in data movement (broadcast, the gathers, scatter, all-to-all): as
//                  raw bytes in 4-byte words (i32), the last word zero-padded.
// A tensor's own memory serves as its wire (no copy) when it is contiguous and the spec needs no
// conversion; otherwise the collective works on a packed copy and unpacks the result.
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstdint>

#include "lockstep/comm/types.h"

namespace lockstep::torch_backend {

enum class WireKind : std::uint8_t { native, widened, complex_pairs, bytes };

struct WireSpec {
  WireKind kind = WireKind::native;
  comm::DType dtype = comm::DType::f32;         // the wire's element type
  at::ScalarType scalar = at::ScalarType::Float;  // the same, as torch names it
  std::int64_t count = 0;                        // wire elements of one tensor
};

// Rejects what no lockstep collective takes: tensors off the CPU, sparse tensors.
void check_cpu_dense(const at::Tensor& t, const char* collective);
// The comm operator for a c10d one; a clear error for the ones lockstep has not (PRODUCT, the
// bitwise ones, PREMUL_SUM), naming the operator and the way out.
comm::ReduceOp comm_op(const c10d::ReduceOp& op, const char* collective);
const char* reduce_op_name(const c10d::ReduceOp& op);

WireSpec reduce_spec(const at::Tensor& t, const c10d::ReduceOp& op, const char* collective);
WireSpec move_spec(const at::Tensor& t);
// Raw bytes in words whatever the dtype: for packing tensors of several dtypes into one buffer.
WireSpec bytes_spec(const at::Tensor& t);

// `blocks` tensors' worth of wire, 1-D.
at::Tensor empty_wire(const WireSpec& spec, std::int64_t blocks);
// Wire block i of a buffer holding several.
at::Tensor wire_block(const at::Tensor& wire, const WireSpec& spec, std::int64_t i);
// `t` itself as its wire when that needs no copy, else an undefined tensor.
at::Tensor wire_view(const at::Tensor& t, const WireSpec& spec);
void pack(const at::Tensor& t, const WireSpec& spec, const at::Tensor& block);
void unpack(const at::Tensor& block, const WireSpec& spec, const at::Tensor& t);

// A tensor's wire for a collective that reads it (and writes it, in place): its own memory when
// possible, else a packed copy (`copied` says which, so the caller knows to unpack).
struct Wire {
  at::Tensor buffer;
  bool copied = false;
};
Wire wire_of(const at::Tensor& t, const WireSpec& spec, bool fill = true);

}  // namespace lockstep::torch_backend
