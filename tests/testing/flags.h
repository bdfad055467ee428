// A program's command line in the tests that start examples end to end: flags joined with +.
#pragma once

#include <string>
#include <vector>

namespace lockstep::testing {

using Flags = std::vector<std::string>;

inline Flags operator+(Flags a, const Flags& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace lockstep::testing
