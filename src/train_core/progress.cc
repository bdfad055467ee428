#include "lockstep/train_core/progress.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace lockstep::train {

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) seconds = 0;
  long s = static_cast<long>(seconds + 0.5);
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", s / 3600, s / 60 % 60, s % 60);
  else
    std::snprintf(buf, sizeof buf, "%02ld:%02ld", s / 60, s % 60);
  return buf;
}

std::string rate_text(double samples_per_second, double tokens_per_second) {
  char buf[64];
  if (tokens_per_second > 0)
    std::snprintf(buf, sizeof buf, "%.0f tokens/s", tokens_per_second);
  else
    std::snprintf(buf, sizeof buf, "%.0f samples/s", samples_per_second);
  return buf;
}

std::string progress_bar(std::int64_t step, std::int64_t max_steps, double elapsed, double eta,
                         const std::string& rate, double loss) {
  const double frac = static_cast<double>(step) / static_cast<double>(std::max<std::int64_t>(1, max_steps));
  const int width = 24, filled = std::clamp(static_cast<int>(frac * width), 0, width);
  std::string bar(static_cast<std::size_t>(filled), '#');
  bar.resize(width, ' ');
  char line[256];
  std::snprintf(line, sizeof line, "\r%3d%% |%s| %lld/%lld [%s<%s, %s, loss %.4f]   ",
                static_cast<int>(frac * 100), bar.c_str(), static_cast<long long>(step),
                static_cast<long long>(max_steps), format_duration(elapsed).c_str(),
                format_duration(eta).c_str(), rate.c_str(), loss);
  return line;
}

std::string progress_line(std::int64_t step, std::int64_t max_steps, double epoch, double loss, double lr,
                          const std::string& rate, double exposed_fraction, double eta) {
  char line[256];
  std::snprintf(
      line, sizeof line,
      "step %lld/%lld (epoch %.2f): loss %.4f, lr %.3g, %s, exposed comm %.1f%%, ETA %s",
      static_cast<long long>(step), static_cast<long long>(max_steps), epoch, loss, lr, rate.c_str(),
      100.0 * exposed_fraction, format_duration(eta).c_str());
  return line;
}

}  // namespace lockstep::train
