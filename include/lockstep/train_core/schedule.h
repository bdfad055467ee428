// Learning-rate schedules, as multipliers of the base rate after `step` optimiser steps.
//
// Warm-up rises linearly from 0 over `warmup` steps (every schedule but "constant" honours it);
// then "linear" falls to 0 at `total`, "cosine" follows half a cosine to 0 at `total`,
// "constant" and "constant_with_warmup" stay at 1. These are the Hugging Face schedules.
#pragma once

#include <cstdint>
#include <string>

namespace lockstep::train {

struct Schedule {
  std::string type = "linear";
  std::int64_t warmup = 0;
  std::int64_t total = 1;
  // Throws ConfigError for an unknown type, naming the known ones.
  double multiplier(std::int64_t step) const;
};

// warmup_steps when positive, else ceil(warmup_ratio * total).
std::int64_t warmup_steps_for(std::int64_t warmup_steps, double warmup_ratio, std::int64_t total);

}  // namespace lockstep::train
