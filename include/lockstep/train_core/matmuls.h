// A model's matrix products, counted: the model FLOPs of a training step, the utilisation they
// reach against this machine's measured matmul rate, and what bf16 would buy.
//
// Model FLOPs are the products the model's definition asks for: a forward product of (m x k) by
// (k x n) is 2mkn FLOPs, and training costs three times the forward (backward computes the
// gradient of the input and of the weight, each a product of the same size). Recomputation
// (gradient checkpointing), element-wise work and the optimizer are not counted, which is the
// convention of "model FLOPs utilisation" (MFU) in the PaLM paper: what a run achieves of the
// machine, not how busy it keeps it. The rate it is compared against is measured on this machine
// at the model's own shapes (train/model_flops.h), not a datasheet's peak. Torch-free.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace lockstep::train {

// One forward product: `batch` independent (m x k) by (k x n) products. Shapes are per
// micro-batch of the worker, m counting the rows (samples, or samples x tokens) it multiplies.
struct Matmul {
  std::int64_t batch = 1, m = 0, k = 0, n = 0;
  double forward_flops() const;  // 2 * batch * m * k * n
  // The two products backward runs for it: the input's gradient (m x n by n x k) and the
  // weight's (k x m by m x n).
  Matmul input_gradient() const { return {batch, m, n, k}; }
  Matmul weight_gradient() const { return {batch, k, m, n}; }
  bool operator==(const Matmul& o) const { return batch == o.batch && m == o.m && k == o.k && n == o.n; }
};

// A model whose forward is not a tree of linear layers (attention's products, tied heads)
// describes its own products by implementing this next to torch::nn::Module.
class CountsMatmuls {
 public:
  virtual ~CountsMatmuls() = default;
  // The forward's products for a micro-batch of `samples` samples.
  virtual std::vector<Matmul> forward_matmuls(std::int64_t samples) const = 0;
};

// Training FLOPs of one micro-batch: three times the forward's products.
double training_flops(const std::vector<Matmul>& forward);

// What the run achieves of the rate the machine's matmuls reach at its shapes.
struct Utilisation {
  double achieved = 0;  // model FLOP/s per worker
  double limit = 0;     // the measured matmul rate per worker, at the run's shapes and precision
  double fraction() const { return limit > 0 ? achieved / limit : 0; }
};

// What the doctor says about precision: the bf16 rate over the fp32 one, and the step the run
// would take if its forward and backward ran at the bf16 rate while the rest stayed as it is.
struct Bf16Advice {
  double matmul_speedup = 0;     // bf16 rate / fp32 rate at the model's shapes
  double predicted_speedup = 0;  // step now / step predicted
};
// Nothing (std::nullopt) when the run is bf16 already, a rate is unknown, or bf16 multiplies less
// than 1.2x faster: then --bf16 would cost precision for little.
std::optional<Bf16Advice> bf16_advice(bool bf16_run, double fp32_rate, double bf16_rate, double step_seconds,
                                      double compute_seconds);

}  // namespace lockstep::train
