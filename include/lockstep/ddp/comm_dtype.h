// The one mapping from torch's element types to the comm layer's (comm::DType) and to the names
// lockstep writes and prints ("float32", as NumPy and safetensors say, not c10's "Float").
// Header-only and light (c10's ScalarType only), so the C++ layers (DDP, ZeRO, checkpoints) and
// the Python backend, which is built against Python's torch, share it.
#pragma once

#include <c10/core/ScalarType.h>

#include <array>
#include <optional>
#include <string>
#include <utility>

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

// Every element type a checkpoint may hold, with its name.
inline constexpr std::array<std::pair<c10::ScalarType, const char*>, 10> kDTypeNames = {{
    {c10::ScalarType::Float, "float32"},
    {c10::ScalarType::Double, "float64"},
    {c10::ScalarType::Half, "float16"},
    {c10::ScalarType::BFloat16, "bfloat16"},
    {c10::ScalarType::Long, "int64"},
    {c10::ScalarType::Int, "int32"},
    {c10::ScalarType::Short, "int16"},
    {c10::ScalarType::Char, "int8"},
    {c10::ScalarType::Byte, "uint8"},
    {c10::ScalarType::Bool, "bool"},
}};

// "float32" for Float ...; nullopt for a type outside kDTypeNames.
inline std::optional<std::string> dtype_name_of(c10::ScalarType t) {
  for (const auto& [type, name] : kDTypeNames)
    if (type == t) return std::string(name);
  return std::nullopt;
}

// lockstep's name where it has one, else c10's ("ComplexFloat"): for messages.
inline std::string dtype_name(c10::ScalarType t) {
  return dtype_name_of(t).value_or(c10::toString(t));
}

// The type named `name` by dtype_name_of, or nullopt.
inline std::optional<c10::ScalarType> scalar_type_named(const std::string& name) {
  for (const auto& [type, type_name] : kDTypeNames)
    if (name == type_name) return type;
  return std::nullopt;
}

}  // namespace lockstep
