// The one mapping from torch's element types to the comm layer's (comm::DType). Header-only and
// light (c10's ScalarType only), so the C++ layers (DDP, ZeRO) and the Python backend, which is
// built against Python's torch, share it.
#pragma once

#include <c10/core/ScalarType.h>

#include <optional>

#include "lockstep/comm/types.h"

namespace lockstep {

// The comm dtype that moves `t` as it is, or nullopt where the comm layer has none (bool, the
// 8-bit and complex types: callers widen, split or refuse them).
inline std::optional<comm::DType> comm_dtype_of(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return comm::DType::f32;
    case c10::ScalarType::Double: return comm::DType::f64;
    case c10::ScalarType::Half: return comm::DType::f16;
    case c10::ScalarType::BFloat16: return comm::DType::bf16;
    case c10::ScalarType::Int: return comm::DType::i32;
    case c10::ScalarType::Long: return comm::DType::i64;
    default: return std::nullopt;
  }
}

}  // namespace lockstep
