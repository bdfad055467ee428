// Logging for every layer of lockstep: one line per message on stderr, written with one
// write() so lines from several threads or processes never interleave.
//
//   LOCKSTEP_LOG(info, train) << "resumed from " << dir;
//   -> "lockstep[rank 0] train: resumed from runs/x/checkpoint-400"
//   LOCKSTEP_LOG(warn, run) << "not every node confirmed";
//   -> "lockstep run: warning: not every node confirmed"
//
// A line names the rank when the process has one (set_rank; the rendezvous sets it), the
// subsystem that wrote it, and its level when it is not info. Which lines appear is chosen at
// run time, as NCCL_DEBUG and NCCL_DEBUG_SUBSYS do: LOCKSTEP_LOG_LEVEL (error, warn, info,
// debug; default info) and LOCKSTEP_LOG_SUBSYSTEMS (a comma-separated list such as
// "comm,store", or "all", the default; a leading "^" excludes the listed ones instead).
// Debug lines are compiled in; a disabled line costs one load and a compare, and its
// arguments are not evaluated.
//
// Thread-safety: every function may be called from any thread.
#pragma once

#include <sstream>
#include <string>
#include <string_view>

namespace lockstep::log {

enum class Level { error = 0, warn = 1, info = 2, debug = 3 };

// One bit each, so a set of subsystems is a mask. The name is what a line shows.
enum class Subsystem : unsigned {
  base = 1u << 0,    // "lockstep"
  store = 1u << 1,   // the rendezvous store
  comm = 1u << 2,    // communicators, rendezvous
  shm = 1u << 3,     // shared-memory backend
  gloo = 1u << 4,    // Gloo backend
  mpi = 1u << 5,     // MPI backend
  hier = 1u << 6,    // hierarchical backend
  run = 1u << 7,     // the launcher (lockstep run)
  data = 1u << 8,    // sampler, datasets, loader
  ddp = 1u << 9,     // DistributedDataParallel
  train = 1u << 10,  // the Trainer
  doctor = 1u << 11  // lockstep doctor, report, bench
};

const char* subsystem_name(Subsystem s);

bool enabled(Level level, Subsystem subsystem);
void write(Level level, Subsystem subsystem, std::string_view text);
// The rank shown in every line from now on; -1 (the default) shows none.
void set_rank(int rank);
int rank();

// The pure parts, for tests: LOCKSTEP_LOG_LEVEL's and LOCKSTEP_LOG_SUBSYSTEMS's values as a
// level and a mask of Subsystem bits, and a line as write() prints it (with its newline).
Level parse_level(const std::string& text);
unsigned parse_subsystems(const std::string& text);
std::string format_line(Level level, Subsystem subsystem, int rank, std::string_view text);

// "1.5 s", "300 s": durations in messages, without trailing zeros.
std::string seconds_text(double seconds);

class Line {
 public:
  Line(Level level, Subsystem subsystem) : level_(level), subsystem_(subsystem) {}
  ~Line() { write(level_, subsystem_, out_.str()); }
  Line(const Line&) = delete;
  Line& operator=(const Line&) = delete;
  template <typename T>
  Line& operator<<(const T& v) {
    out_ << v;
    return *this;
  }

 private:
  Level level_;
  Subsystem subsystem_;
  std::ostringstream out_;
};

}  // namespace lockstep::log

// A for-loop rather than if/else, so `if (x) LOCKSTEP_LOG(...) << ...;` has no dangling else.
#define LOCKSTEP_LOG(level, subsystem)                                                                     \
  for (bool lockstep_log_on_ =                                                                             \
           ::lockstep::log::enabled(::lockstep::log::Level::level, ::lockstep::log::Subsystem::subsystem); \
       lockstep_log_on_; lockstep_log_on_ = false)                                                         \
  ::lockstep::log::Line(::lockstep::log::Level::level, ::lockstep::log::Subsystem::subsystem)
