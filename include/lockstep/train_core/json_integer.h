// Integers read from JSON that nobody checked (a file on disk): the JSON library converts a
// fraction, or a number the type cannot hold, by a cast, which is undefined behaviour. This
// refuses them.
//
//   const auto offset = json_integer<std::uint64_t>(piece.at("offset"), "a piece's offset");
//   const auto shape = json_integers<std::int64_t>(tensor.at("shape"), "the shape of 'w'");
//
// A DataError naming `what` and the value for a fraction, a number out of T's range, or a value
// that is not a number; whole numbers written as floats (4.0) are read.
#pragma once

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "lockstep/error.h"

namespace lockstep::train {

template <class T>
T json_integer(const nlohmann::json& v, const std::string& what) {
  static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>);
  using Limits = std::numeric_limits<T>;
  const double end = std::ldexp(1.0, Limits::digits);  // 2^digits: the first value above T's range
  const double lowest = std::is_signed_v<T> ? -end : 0.0;
  bool fits = false;
  if (v.is_number_unsigned()) {
    fits = v.get<std::uint64_t>() <= static_cast<std::uint64_t>(Limits::max());
  } else if (v.is_number_integer()) {
    const std::int64_t i = v.get<std::int64_t>();
    fits = i >= 0 ? static_cast<std::uint64_t>(i) <= static_cast<std::uint64_t>(Limits::max())
                  : std::is_signed_v<T> && i >= static_cast<std::int64_t>(Limits::min());
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    if (d >= lowest && d < end && std::trunc(d) == d) return static_cast<T>(d);
  }
  if (!fits)
    throw DataError(what + " is " + v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) +
                    ", not an integer it can hold");
  return v.get<T>();
}

// An array of such integers; a DataError when `v` is not an array.
template <class T>
std::vector<T> json_integers(const nlohmann::json& v, const std::string& what) {
  if (!v.is_array()) throw DataError(what + " is not an array");
  std::vector<T> out;
  for (const auto& e : v) out.push_back(json_integer<T>(e, "an element of " + what));
  return out;
}

}  // namespace lockstep::train
