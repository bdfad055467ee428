// Durations in seconds on the steady clock, which every timing in lockstep uses.
#pragma once

#include <chrono>

namespace lockstep {

using Clock = std::chrono::steady_clock;

inline double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

inline double seconds_since(Clock::time_point t) {
  return seconds_between(t, Clock::now());
}

}  // namespace lockstep
