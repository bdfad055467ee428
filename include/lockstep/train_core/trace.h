// Chrome trace events (the JSON array format Perfetto and chrome://tracing import), one file per
// rank: complete events ("X") on a thread track, timestamps in microseconds since the Unix epoch
// so the ranks' files line up. Torch-free.
#pragma once

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace lockstep::train {

class TraceWriter {
 public:
  using Clock = std::chrono::steady_clock;
  // Throws ConfigError when the file cannot be written.
  TraceWriter(const std::string& path, int rank);
  ~TraceWriter();  // closes the array
  TraceWriter(const TraceWriter&) = delete;
  TraceWriter& operator=(const TraceWriter&) = delete;

  // Track 1 is the training loop, track 2 the gradient all-reduce.
  void span(const char* name, int tid, Clock::time_point begin, Clock::time_point end,
            const nlohmann::json& args = {});
  void flush() { out_.flush(); }

 private:
  double us(Clock::time_point t) const;
  void meta(const char* what, int tid, const std::string& name);
  void emit(const nlohmann::json& e);

  std::ofstream out_;
  int rank_;
  bool first_ = true;
  Clock::time_point origin_steady_;
  long long origin_us_ = 0;
};

}  // namespace lockstep::train
