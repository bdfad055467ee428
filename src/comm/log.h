// One logging header for the whole project: lines carry a "[lockstep rank N]" prefix and a
// level; the level comes from LOCKSTEP_LOG_LEVEL (error, warn, info, debug; default warn).
// Debug logging is compiled in and costs one comparison when off.
#pragma once

#include <sstream>
#include <string>

namespace lockstep::log {

// "1.5 s", "300 s": durations in messages, without trailing zeros.
std::string seconds_text(double seconds);

enum class Level { error = 0, warn = 1, info = 2, debug = 3 };

bool enabled(Level level);
void write(Level level, const std::string& line);
// The rank shown in the prefix; -1 (the default) shows the process id instead.
void set_rank(int rank);

class Line {
 public:
  explicit Line(Level level) : level_(level) {}
  ~Line() { write(level_, out_.str()); }
  template <typename T>
  Line& operator<<(const T& v) {
    out_ << v;
    return *this;
  }

 private:
  Level level_;
  std::ostringstream out_;
};

}  // namespace lockstep::log

#define LOCKSTEP_LOG(level)                                       \
  if (!::lockstep::log::enabled(::lockstep::log::Level::level)) { \
  } else                                                          \
    ::lockstep::log::Line(::lockstep::log::Level::level)
