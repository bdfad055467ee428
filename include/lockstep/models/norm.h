// Layer norm with the cast to the next product's dtype in the same pass, forward and backward.
//
// Under CPU autocast to bf16, libtorch runs layer norm in float32 (its autocast policy) and writes
// a float32 result, which the next linear layer then reads again to cast to bf16; backward casts
// the bf16 gradient back to float32 before layer norm's own backward reads it. Here one kernel
// normalises a float32 row and writes it in bf16, and the backward reads the bf16 gradient as it
// is: one pass over the rows for the input's gradient, the weight's and bias's summed as it goes.
// Without autocast the result is float32, from the same kernel. On the CPU, vectorized for AVX-512
// and AVX2 and chosen at run time (src/models/norm_kernels.h says how it computes). The values
// agree with libtorch's layer_norm to a few float ulps (so to bf16's own rounding when the result
// is bf16).
//
// Elsewhere (a GPU, a bf16 input, no weight or bias) it is libtorch's layer_norm as written.
#pragma once

#include <torch/types.h>

namespace lockstep::models {

// Layer norm over x's last dimension with a weight and bias of that size. The result is bf16
// when CPU autocast to bf16 is on, x's dtype otherwise.
torch::Tensor fast_layer_norm(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                              double eps);

}  // namespace lockstep::models
