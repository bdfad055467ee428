// Autocast for a scope on the device the model trains on (CPU or CUDA): the Trainer's --bf16 or
// --fp16 around forward and the loss, in training and evaluation alike, and a pipeline stage's
// around its forwards (pipe/pipeline.h).
#pragma once

#include <ATen/autocast_mode.h>

#include <optional>

#include "lockstep/ddp/torch_compat.h"

namespace lockstep {

// What a loss is computed from: a model's output in float32 (an autocast output, bfloat16 or
// float16, cast up; float32 as it is), or in float64 when the model computes in float64. The
// Trainer's step and evaluation and a pipeline's last stage all take the loss of this.
inline at::Tensor loss_input(const at::Tensor& output) {
  return output.scalar_type() == at::kDouble ? output : output.to(at::kFloat);
}

// Autocast to `dtype` on `device` for the scope, as torch.autocast(device, dtype) does; none:
// nothing.
class Autocast {
 public:
  Autocast(std::optional<at::ScalarType> dtype, c10::DeviceType device) : on_(dtype.has_value()), device_(device) {
    if (!on_) return;
    previous_ = torch_compat::autocast_enabled(device_);
    previous_dtype_ = torch_compat::autocast_dtype(device_);
    torch_compat::set_autocast_enabled(device_, true);
    torch_compat::set_autocast_dtype(device_, *dtype);
    at::autocast::increment_nesting();
  }
  ~Autocast() {
    if (!on_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    torch_compat::set_autocast_enabled(device_, previous_);
    torch_compat::set_autocast_dtype(device_, previous_dtype_);
  }
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  bool on_;
  c10::DeviceType device_;
  bool previous_ = false;
  at::ScalarType previous_dtype_ = at::kBFloat16;
};

}  // namespace lockstep
