// Dynamic loss scaling for float16 training (--fp16), as PyTorch's GradScaler and DeepSpeed's
// dynamic scaler do it.
//
// float16 holds nothing below ~6e-8, so small gradients of float16 activations vanish. The loss
// is multiplied by `scale()` before backward and the gradients divided by it after, which lifts
// them into float16's range. When a gradient overflows (inf or NaN), that step's update is
// skipped and the scale halved; after `growth_interval` steps in a row without one, it doubles.
// Every rank decides alike: it sees the same all-reduced gradients.
//
// Torch-free: the Trainer multiplies and checks the tensors; this holds the policy and its state,
// which checkpoints and an elastic job's state transfer carry so that a resume is bitwise.
#pragma once

#include <cstdint>

#include <nlohmann/json.hpp>

namespace lockstep::train {

class LossScale {
 public:
  // PyTorch's GradScaler defaults: 2^16, doubled after 2000 clean steps, halved on overflow.
  static constexpr double kInitialScale = 65536.0;
  static constexpr double kGrowthFactor = 2.0;
  static constexpr double kBackoffFactor = 0.5;
  static constexpr std::int64_t kGrowthInterval = 2000;

  double scale() const { return scale_; }
  std::int64_t clean_steps() const { return clean_steps_; }
  // Overflowed steps in this process (not part of the saved state).
  std::int64_t overflows() const { return overflows_; }
  // After a step's gradients were checked: whether its update may be applied (no overflow). The
  // scale never falls below the smallest positive double's neighbourhood, so it stays usable.
  bool update(bool overflowed);

  nlohmann::json to_json() const;
  // The scale and its clean steps from a saved state (a checkpoint's, or another member's in an
  // elastic job); this process's overflow count stays. A DataError when it is malformed.
  void load_json(const nlohmann::json& j);

 private:
  double scale_ = kInitialScale;
  std::int64_t clean_steps_ = 0;  // steps since the last overflow or growth
  std::int64_t overflows_ = 0;
};

}  // namespace lockstep::train
