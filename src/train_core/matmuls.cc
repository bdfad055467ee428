#include "lockstep/train_core/matmuls.h"

namespace lockstep::train {

double Matmul::forward_flops() const {
  return 2.0 * static_cast<double>(batch) * static_cast<double>(m) * static_cast<double>(k) *
         static_cast<double>(n);
}

double training_flops(const std::vector<Matmul>& forward) {
  double flops = 0;
  for (const Matmul& p : forward) flops += 3 * p.forward_flops();
  return flops;
}

std::optional<Bf16Advice> bf16_advice(bool bf16_run, double fp32_rate, double bf16_rate, double step_seconds,
                                      double compute_seconds) {
  if (bf16_run || fp32_rate <= 0 || bf16_rate < 1.2 * fp32_rate || step_seconds <= 0) return std::nullopt;
  Bf16Advice advice;
  advice.matmul_speedup = bf16_rate / fp32_rate;
  // An upper bound: all of forward and backward is taken to be matrix products.
  const double predicted_step = step_seconds - compute_seconds * (1 - fp32_rate / bf16_rate);
  advice.predicted_speedup = step_seconds / predicted_step;
  return advice;
}

}  // namespace lockstep::train
