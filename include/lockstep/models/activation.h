// The bias and GELU after a linear layer's product, in one pass forward and one back.
//
// Eager libtorch makes three passes over the layer's output for them: addmm first copies the
// bias into every row of its output, the GELU reads that and writes its own, and backward reads
// the GELU's gradient again to sum the bias's. Here the product comes without its bias
// (fast_linear(x, weight)), and one kernel adds the bias and applies the GELU; its backward
// computes the input gradient from what the forward kept (the product) and sums the bias's
// gradient as it goes. On the CPU, in float32 and bf16, both forms (exact, and the tanh form of
// GPT-2's gelu_new), vectorized for AVX-512 and AVX2 and chosen at run time
// (src/models/gelu_kernels.h says how it computes). The values agree with libtorch's
// gelu(x + bias) to within a few float ulps (so to bf16's own rounding when x is bf16); the
// bias's gradient is summed in float. What it saves on the MLP's first half (bench/RESULTS.md):
// 1.07-2.44x in the tanh form; in the exact form 1.18-1.23x in bf16 (a shorter erfc fit for bf16
// results) and nothing in float32, whose products dominate.
//
// Elsewhere (a GPU, other dtypes, a bias that is not one value per column of x) it is libtorch's
// gelu(x + bias) as written.
#pragma once

#include <torch/types.h>

#include <string>

namespace lockstep::models {

// gelu(x + bias) over x's last dimension; `approximate` as libtorch's: "tanh" or "none".
// The result has x's dtype; bias's gradient has bias's.
torch::Tensor fast_bias_gelu(const torch::Tensor& x, const torch::Tensor& bias, const std::string& approximate);

}  // namespace lockstep::models
