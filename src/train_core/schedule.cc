#include "lockstep/train_core/schedule.h"

#include <algorithm>
#include <cmath>

#include "lockstep/error.h"

namespace lockstep::train {

double Schedule::multiplier(std::int64_t step) const {
  const bool warms = type != "constant";
  if (warms && step < warmup)
    return static_cast<double>(step) / static_cast<double>(std::max<std::int64_t>(1, warmup));
  if (type == "constant" || type == "constant_with_warmup") return 1.0;
  const double span = static_cast<double>(std::max<std::int64_t>(1, total - warmup));
  const double done = std::clamp(static_cast<double>(step - warmup) / span, 0.0, 1.0);
  if (type == "linear") return 1.0 - done;
  if (type == "cosine") return 0.5 * (1.0 + std::cos(M_PI * done));
  throw ConfigError("unknown learning-rate schedule '" + type +
                    "': use constant, constant_with_warmup, linear or cosine");
}

std::int64_t warmup_steps_for(std::int64_t warmup_steps, double warmup_ratio, std::int64_t total) {
  if (warmup_steps > 0) return warmup_steps;
  return static_cast<std::int64_t>(std::ceil(warmup_ratio * static_cast<double>(total)));
}

}  // namespace lockstep::train
