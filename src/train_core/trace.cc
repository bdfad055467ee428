#include "lockstep/train_core/trace.h"

#include <algorithm>

#include "lockstep/error.h"

namespace lockstep::train {

TraceWriter::TraceWriter(const std::string& path, int rank) : out_(path, std::ios::trunc), rank_(rank) {
  if (!out_) throw ConfigError("cannot write the trace file " + path + ": check --output-dir");
  origin_steady_ = Clock::now();
  origin_us_ = std::chrono::duration_cast<std::chrono::microseconds>(
                   std::chrono::system_clock::now().time_since_epoch())
                   .count();
  out_ << "[\n";
  meta("process_name", 0, "rank " + std::to_string(rank));
  meta("thread_name", 1, "training loop");
  meta("thread_name", 2, "gradient all-reduce");
}

TraceWriter::~TraceWriter() {
  out_ << "\n]\n";
}

void TraceWriter::span(const char* name, int tid, Clock::time_point begin, Clock::time_point end,
                       const nlohmann::json& args) {
  if (end < begin) end = begin;
  const double dur = std::chrono::duration<double, std::micro>(end - begin).count();
  nlohmann::json e = {{"name", name}, {"ph", "X"},       {"pid", rank_},
                      {"tid", tid},   {"ts", us(begin)}, {"dur", dur}};
  if (!args.is_null()) e["args"] = args;
  emit(e);
}

double TraceWriter::us(Clock::time_point t) const {
  return static_cast<double>(origin_us_) +
         std::chrono::duration<double, std::micro>(t - origin_steady_).count();
}

void TraceWriter::meta(const char* what, int tid, const std::string& name) {
  emit({{"name", what}, {"ph", "M"}, {"pid", rank_}, {"tid", tid}, {"args", {{"name", name}}}});
}

void TraceWriter::emit(const nlohmann::json& e) {
  out_ << (first_ ? "" : ",\n") << e.dump();
  first_ = false;
}

}  // namespace lockstep::train
