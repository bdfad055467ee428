// bfloat16 autocast on the CPU for a scope: the Trainer's --bf16 around forward and the loss, in
// training and evaluation alike.
#pragma once

#include <ATen/autocast_mode.h>

#include "lockstep/ddp/torch_compat.h"

namespace lockstep::train {

// Autocast to bfloat16 on the CPU for the scope, as torch.autocast("cpu") does; off: nothing.
class CpuAutocast {
 public:
  explicit CpuAutocast(bool on) : on_(on) {
    if (!on_) return;
    previous_ = torch_compat::cpu_autocast_enabled();
    torch_compat::set_cpu_autocast_enabled(true);
    torch_compat::set_cpu_autocast_dtype(at::kBFloat16);
    at::autocast::increment_nesting();
  }
  ~CpuAutocast() {
    if (!on_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    torch_compat::set_cpu_autocast_enabled(previous_);
  }
  CpuAutocast(const CpuAutocast&) = delete;
  CpuAutocast& operator=(const CpuAutocast&) = delete;

 private:
  bool on_;
  bool previous_ = false;
};

}  // namespace lockstep::train
