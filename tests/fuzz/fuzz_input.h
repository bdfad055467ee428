// What the fuzz targets share: the input as a file (for readers that take a path), and the rule
// every target checks.
//
// The rule: bad input is a lockstep::Error (lockstep/error.h) whose message says what is wrong;
// anything else leaving the parser (std::out_of_range, a JSON library's exception, bad_alloc, a
// crash, a read past a buffer under AddressSanitizer) is a bug the fuzzer reports.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

#include "lockstep/error.h"

namespace lockstep::fuzz {

// A directory of this process's own, removed when the process exits.
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/lockstep-fuzz-XXXXXX";
    if (!::mkdtemp(pattern.data())) throw std::runtime_error("mkdtemp failed for " + pattern);
    std::atexit([] { std::filesystem::remove_all(scratch_dir()); });
    return std::filesystem::path(pattern);
  }();
  return dir;
}

// Writes the input to `name` in the scratch directory; returns its path.
inline std::string as_file(const std::uint8_t* data, std::size_t size, const std::string& name) {
  const auto path = scratch_dir() / name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!out.flush()) throw std::runtime_error("cannot write " + path.string());
  return path.string();
}

// Runs `parse`; a lockstep::Error with a message is the expected answer to bad input, anything
// else escapes (and the fuzzer reports it). Returns whether the input parsed.
template <typename F>
bool parses(F&& parse) {
  try {
    parse();
    return true;
  } catch (const lockstep::Error& e) {
    if (std::string(e.what()).empty()) std::abort();  // an error must say what is wrong
    return false;
  }
}

}  // namespace lockstep::fuzz
