// Tensors equal within a tolerance, for the fused kernels' tests against libtorch's ops.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace lockstep::testing {

// |a - b| within atol + rtol |b| everywhere, compared in float64; the worst element named otherwise.
inline ::testing::AssertionResult close(const torch::Tensor& a, const torch::Tensor& b, double rtol, double atol) {
  const auto diff = (a.to(torch::kDouble) - b.to(torch::kDouble)).abs();
  const auto allowed = atol + rtol * b.to(torch::kDouble).abs();
  const auto over = (diff - allowed).flatten();
  const auto worst = over.argmax().item<std::int64_t>();
  if (over[worst].item<double>() <= 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "element " << worst << ": " << a.flatten()[worst].item<double>()
                                       << " against " << b.flatten()[worst].item<double>();
}

}  // namespace lockstep::testing
