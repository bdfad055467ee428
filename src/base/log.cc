#include "lockstep/base/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>

#include "lockstep/base/knobs.h"

namespace lockstep::log {
namespace {

constexpr Subsystem kSubsystems[] = {Subsystem::base, Subsystem::store, Subsystem::comm,  Subsystem::shm,
                                     Subsystem::gloo, Subsystem::mpi,   Subsystem::hier,  Subsystem::run,
                                     Subsystem::data, Subsystem::ddp,   Subsystem::train, Subsystem::doctor};

unsigned mask_of(const std::string& list) {
  unsigned mask = 0;
  std::size_t start = 0;
  while (start <= list.size()) {
    std::size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    const std::string name = list.substr(start, end - start);
    for (Subsystem s : kSubsystems)
      if (name == subsystem_name(s) || name == "all") mask |= static_cast<unsigned>(s);
    start = end + 1;
  }
  return mask;
}

struct Filter {
  Level threshold = parse_level(knobs::get(knobs::kLogLevel).value_or("info"));
  unsigned subsystems = parse_subsystems(knobs::get(knobs::kLogSubsystems).value_or("all"));
};

const Filter& filter() {
  static const Filter f;
  return f;
}

std::atomic<int> g_rank{-1};

const char* level_prefix(Level level) {
  switch (level) {
    case Level::error: return "error: ";
    case Level::warn: return "warning: ";
    case Level::info: return "";
    case Level::debug: return "debug: ";
  }
  return "";
}

}  // namespace

Level parse_level(const std::string& v) {
  if (v == "error") return Level::error;
  if (v == "warn" || v == "warning") return Level::warn;
  if (v == "debug") return Level::debug;
  return Level::info;
}

unsigned parse_subsystems(const std::string& v) {
  if (!v.empty() && v[0] == '^') return ~mask_of(v.substr(1));
  return mask_of(v);
}

std::string format_line(Level level, Subsystem subsystem, int rank, std::string_view text) {
  std::string out = "lockstep";
  if (rank >= 0) out += "[rank " + std::to_string(rank) + "]";
  if (subsystem != Subsystem::base) out += std::string(" ") + subsystem_name(subsystem);
  out += ": ";
  out += level_prefix(level);
  out += text;
  out += '\n';
  return out;
}

const char* subsystem_name(Subsystem s) {
  switch (s) {
    case Subsystem::base: return "base";
    case Subsystem::store: return "store";
    case Subsystem::comm: return "comm";
    case Subsystem::shm: return "shm";
    case Subsystem::gloo: return "gloo";
    case Subsystem::mpi: return "mpi";
    case Subsystem::hier: return "hier";
    case Subsystem::run: return "run";
    case Subsystem::data: return "data";
    case Subsystem::ddp: return "ddp";
    case Subsystem::train: return "train";
    case Subsystem::doctor: return "doctor";
  }
  return "?";
}

bool enabled(Level level, Subsystem subsystem) {
  const Filter& f = filter();
  return level <= f.threshold && (level == Level::error || (f.subsystems & static_cast<unsigned>(subsystem)));
}

void set_rank(int rank) {
  g_rank.store(rank);
}

int rank() {
  return g_rank.load();
}

std::string seconds_text(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", seconds);
  return buf;
}

void write(Level level, Subsystem subsystem, std::string_view text) {
  const std::string out = format_line(level, subsystem, g_rank.load(), text);
  // One write() per line so lines from several threads or ranks do not interleave.
  std::size_t done = 0;
  while (done < out.size()) {
    ssize_t n = ::write(STDERR_FILENO, out.data() + done, out.size() - done);
    if (n <= 0) break;
    done += static_cast<std::size_t>(n);
  }
}

}  // namespace lockstep::log
