#include "log.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "env.h"

namespace lockstep::log {
namespace {

Level level_from_env() {
  auto v = env::get(env::kLogLevel).value_or("warn");
  if (v == "error") return Level::error;
  if (v == "info") return Level::info;
  if (v == "debug") return Level::debug;
  return Level::warn;
}

std::atomic<int> g_rank{-1};

const char* level_name(Level l) {
  switch (l) {
    case Level::error: return "error";
    case Level::warn: return "warn";
    case Level::info: return "info";
    case Level::debug: return "debug";
  }
  return "?";
}

}  // namespace

bool enabled(Level level) {
  static const Level threshold = level_from_env();
  return level <= threshold;
}

std::string seconds_text(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", seconds);
  return buf;
}

void set_rank(int rank) {
  g_rank.store(rank);
}

void write(Level level, const std::string& line) {
  int rank = g_rank.load();
  char prefix[64];
  if (rank >= 0)
    std::snprintf(prefix, sizeof prefix, "[lockstep rank %d] %s: ", rank, level_name(level));
  else
    std::snprintf(prefix, sizeof prefix, "[lockstep pid %d] %s: ", static_cast<int>(getpid()),
                  level_name(level));
  std::string out = prefix + line + "\n";
  // One write() per line so lines from several threads or ranks do not interleave.
  ssize_t ignored = ::write(STDERR_FILENO, out.data(), out.size());
  (void)ignored;
}

}  // namespace lockstep::log

namespace lockstep::env {

std::optional<std::string> get(const Knob& knob) {
  if (const char* v = std::getenv(knob.name); v != nullptr) return std::string(v);
  if (knob.default_value != nullptr) return std::string(knob.default_value);
  return std::nullopt;
}

}  // namespace lockstep::env
