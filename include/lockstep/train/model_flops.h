// The matrix products of a libtorch model, and the rate this process multiplies them at.
//
// The Trainer asks these once per start: the products give the run's model FLOPs per sample
// (train_core/matmuls.h says what is counted), and when the doctor asks (LOCKSTEP_PROBE_MATMUL=1)
// the rate is measured here, at the model's own shapes and the run's threads, in fp32 and bf16,
// so that utilisation is stated against what this machine reaches rather than a datasheet.
#pragma once

#include <torch/nn/module.h>

#include <optional>
#include <vector>

#include "lockstep/train_core/matmuls.h"

namespace lockstep::train {

// The forward's products for a micro-batch of `samples`: the model's own list when it implements
// CountsMatmuls, else one product (one row per sample) per torch::nn::Linear it holds. Nothing
// when it holds another module with weights (a convolution) and does not count itself: an
// unknown figure is left out rather than reported too small. Norms and embeddings multiply
// nothing and are passed over.
std::optional<std::vector<Matmul>> model_matmuls(const torch::nn::Module& model, std::int64_t samples);

// FLOP/s this process reaches on the products (each forward product and its two backward ones),
// in `dtype` (torch::kFloat, or torch::kBFloat16 as autocast runs them), with its intra-op
// threads as they are. Each distinct shape is timed after a warm-up for at least
// `seconds_per_shape`; the rate is the products' FLOPs over their summed times, so each shape
// weighs as much as it does in a step.
double measure_matmul_rate(const std::vector<Matmul>& products, torch::Dtype dtype,
                           double seconds_per_shape = 0.02);

}  // namespace lockstep::train
