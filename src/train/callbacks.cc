// The callbacks that ship with the Trainer.
#include <torch/torch.h>

#include "lockstep/error.h"
#include "lockstep/train/trainer.h"

namespace lockstep::train {

EarlyStoppingCallback::EarlyStoppingCallback(std::string metric, bool greater_is_better, int patience,
                                             double threshold)
    : metric_(std::move(metric)), greater_(greater_is_better), patience_(patience), threshold_(threshold) {
  if (patience_ < 1) throw ConfigError("early stopping needs a patience of at least 1 evaluation");
}

void EarlyStoppingCallback::on_evaluate(const TrainerState&, const nlohmann::json& metrics,
                                        TrainerControl& control) {
  if (!metrics.contains(metric_))
    throw ConfigError("early stopping watches '" + metric_ +
                      "', which the evaluation does not report (it reports " + metrics.dump() + ")");
  double value = metrics.at(metric_).get<double>();
  bool better = !best_ || (greater_ ? value > *best_ + threshold_ : value < *best_ - threshold_);
  if (better) {
    best_ = value;
    bad_ = 0;
  } else if (++bad_ >= patience_) {
    control.should_stop = true;
  }
}

void set_seed(std::uint64_t seed) {
  torch::manual_seed(seed);
}

}  // namespace lockstep::train
