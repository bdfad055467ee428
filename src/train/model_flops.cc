#include "lockstep/train/model_flops.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>

namespace lockstep::train {
namespace {

// Modules whose weights multiply nothing: their products (none) are known.
bool multiplies_nothing(const torch::nn::Module& m) {
  return m.as<torch::nn::Embedding>() || m.as<torch::nn::LayerNorm>() || m.as<torch::nn::BatchNorm1d>() ||
         m.as<torch::nn::BatchNorm2d>() || m.as<torch::nn::GroupNorm>();
}

bool holds_own_parameters(const torch::nn::Module& m) {
  return !m.parameters(/*recurse=*/false).empty();
}

// Seconds per product of shape p, at dtype, timed over at least `min_seconds` after one warm-up.
// Constant operands: a product's time does not depend on the values, and drawing random ones
// would move the run's generator, so that a probed run trained differently from one that was not.
double seconds_per_product(const Matmul& p, torch::Dtype dtype, double min_seconds) {
  const auto options = torch::TensorOptions().dtype(dtype);
  const auto a = torch::full({p.batch, p.m, p.k}, 0.5, options);
  const auto b = torch::full({p.batch, p.k, p.n}, 0.25, options);
  torch::NoGradGuard no_grad;
  auto out = torch::bmm(a, b);  // warm-up: packing buffers, kernel selection
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  int runs = 0;
  double elapsed = 0;
  do {
    out = torch::bmm(a, b);
    ++runs;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < min_seconds || runs < 2);
  return elapsed / runs;
}

}  // namespace

std::optional<std::vector<Matmul>> model_matmuls(const torch::nn::Module& model, std::int64_t samples) {
  if (const auto* counted = dynamic_cast<const CountsMatmuls*>(&model))
    return counted->forward_matmuls(samples);
  std::vector<Matmul> products;
  // One module's own products; false when it has weights of an unknown kind.
  const auto count = [&](const torch::nn::Module& m) {
    if (const auto* linear = m.as<torch::nn::Linear>()) {
      products.push_back({1, samples, linear->options.in_features(), linear->options.out_features()});
      return true;
    }
    return !holds_own_parameters(m) || multiplies_nothing(m);
  };
  if (!count(model)) return std::nullopt;
  for (const auto& m : model.modules(/*include_self=*/false))  // the model may not be held by a shared_ptr
    if (!count(*m)) return std::nullopt;
  return products;
}

double measure_matmul_rate(const std::vector<Matmul>& products, torch::Dtype dtype,
                           double seconds_per_shape) {
  std::vector<std::pair<Matmul, int>> shapes;  // distinct shapes, and how often a step multiplies each
  for (const Matmul& forward : products)
    for (const Matmul& p : {forward, forward.input_gradient(), forward.weight_gradient()}) {
      auto same = std::find_if(shapes.begin(), shapes.end(), [&](const auto& s) { return s.first == p; });
      if (same == shapes.end())
        shapes.emplace_back(p, 1);
      else
        ++same->second;
    }
  double flops = 0, seconds = 0;
  for (const auto& [p, count] : shapes) {
    flops += count * p.forward_flops();
    seconds += count * seconds_per_product(p, dtype, seconds_per_shape);
  }
  return seconds > 0 ? flops / seconds : 0;
}

}  // namespace lockstep::train
