// The run's position and its one serialiser (see TrainerState in trainer.h).
#include "lockstep/train/trainer.h"

namespace lockstep::train {

double TrainerState::fractional_epoch() const {
  if (steps_per_epoch <= 0) return static_cast<double>(epoch);
  return static_cast<double>(epoch) + static_cast<double>(steps_in_epoch) / static_cast<double>(steps_per_epoch);
}

void TrainerState::set_length(std::int64_t per_epoch, std::int64_t max) {
  steps_per_epoch = per_epoch;
  max_steps = max;
}

void TrainerState::finish_step() {
  ++global_step;
  ++steps_in_epoch;
}

void TrainerState::finish_epoch() {
  ++epoch;
  steps_in_epoch = 0;
}

void TrainerState::begin_epoch() { steps_in_epoch = 0; }

void TrainerState::record_log(const nlohmann::json& entry) { log_history.push_back(entry); }

bool TrainerState::offer_metric(double value, bool greater_is_better) {
  const bool better = !best_metric || (greater_is_better ? value > *best_metric : value < *best_metric);
  if (better) best_metric = value;
  return better;
}

void TrainerState::set_best_checkpoint(std::string name) { best_checkpoint = std::move(name); }

void TrainerState::set_membership(std::int64_t number) { membership = number; }

nlohmann::json TrainerState::position_json() const {
  return {{"global_step", global_step},
          {"max_steps", max_steps},
          {"epoch", epoch},
          {"steps_in_epoch", steps_in_epoch},
          {"fractional_epoch", fractional_epoch()},
          {"best_metric", best_metric ? nlohmann::json(*best_metric) : nlohmann::json()},
          {"best_checkpoint", best_checkpoint},
          {"log_history", log_history}};
}

// The run's length (max_steps, steps_per_epoch) is this run's own, not the saved one's.
void TrainerState::load_position(const nlohmann::json& s) {
  global_step = s.at("global_step").get<std::int64_t>();
  epoch = s.at("epoch").get<std::uint64_t>();
  steps_in_epoch = s.at("steps_in_epoch").get<std::int64_t>();
  best_metric.reset();
  if (s.contains("best_metric") && !s["best_metric"].is_null()) best_metric = s["best_metric"].get<double>();
  best_checkpoint = s.value("best_checkpoint", "");
  log_history = s.value("log_history", nlohmann::json::array());
}

}  // namespace lockstep::train
