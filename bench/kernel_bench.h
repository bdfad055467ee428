// What the fused-kernel benchmarks (attention_bench, bias_gelu_bench, layer_norm_bench) share: their options and
// the two sides timed in turn, in one process, with the median of each.
#pragma once

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace lockstep::bench {

struct KernelBenchOptions {
  std::int64_t rows;
  std::int64_t width = 512;
  int repeat = 20;
  int threads = 1;

  // --rows, --width (what it means for this benchmark: `width_help`), --repeat, --threads.
  void add_to(CLI::App& app, const std::string& width_help) {
    app.add_option("--rows", rows, "batch x sequence");
    app.add_option("--width", width, width_help);
    app.add_option("--repeat", repeat, "steps per side (interleaved), after 3 untimed");
    app.add_option("--threads", threads, "intra-op threads");
  }
};

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// first() and second() (each returning its seconds) in turn, 3 untimed rounds and then `repeat`
// timed: the median seconds of each.
template <class First, class Second>
std::pair<double, double> interleaved_medians(int repeat, const First& first, const Second& second) {
  std::vector<double> a, b;
  for (int i = 0; i < repeat + 3; ++i) {
    const double ta = first(), tb = second();
    if (i >= 3) a.push_back(ta), b.push_back(tb);
  }
  return {median(a), median(b)};
}

}  // namespace lockstep::bench
