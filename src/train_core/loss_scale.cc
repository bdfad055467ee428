// Dynamic loss scaling (see loss_scale.h).
#include "lockstep/train_core/loss_scale.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "lockstep/error.h"

namespace lockstep::train {

bool LossScale::update(bool overflowed) {
  if (overflowed) {
    scale_ = std::max(scale_ * kBackoffFactor, 1e-30);
    clean_steps_ = 0;
    ++overflows_;
    return false;
  }
  if (++clean_steps_ == kGrowthInterval) {
    const double grown = scale_ * kGrowthFactor;
    if (std::isfinite(grown)) scale_ = grown;
    clean_steps_ = 0;
  }
  return true;
}

nlohmann::json LossScale::to_json() const { return {{"scale", scale_}, {"clean_steps", clean_steps_}}; }

void LossScale::load_json(const nlohmann::json& j) {
  double scale = 0;
  std::int64_t clean_steps = 0;
  try {
    scale = j.at("scale").get<double>();
    clean_steps = j.at("clean_steps").get<std::int64_t>();
  } catch (const nlohmann::json::exception& e) {
    throw DataError("the loss scale's state (loss_scale) is malformed: " + std::string(e.what()));
  }
  if (!(scale > 0) || !std::isfinite(scale) || clean_steps < 0 || clean_steps >= kGrowthInterval)
    throw DataError("the loss scale's state (loss_scale) holds scale " + std::to_string(scale) + " and clean_steps " +
                    std::to_string(clean_steps) + ": not a state --fp16 can reach; the checkpoint is damaged");
  scale_ = scale;
  clean_steps_ = clean_steps;
}

}  // namespace lockstep::train
