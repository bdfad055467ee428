// A linear layer whose bf16 weight gradient on the CPU is a product of contiguous operands.
//
// libtorch computes a linear layer's weight gradient as grad_output^T x: the transposed view
// goes to oneDNN as is, and its AMX kernels run that product at about half the rate of the same
// product with both operands contiguous (PyTorch 2.15, the 512-wide GPT's shapes: 430-560 against
// 900-1100 GFLOP/s). libtorch's own transposing copy of a bf16 matrix is about as slow as the
// difference. Here the backward transposes the narrower of grad_output and x (then, for x, the
// product) with a blocked kernel near the memory's speed and multiplies contiguous operands; the
// forward (ATen's linear: the bias inside the product, as PyTorch's), the input gradient and the
// bias gradient are libtorch's. In the GPT's bf16 step that halves the weight gradients' time
// (bench/RESULTS.md).
//
// Everything else (float32, a GPU, no gradient wanted) is torch::nn::functional::linear.
#pragma once

#include <torch/types.h>

namespace lockstep::models {

// x W^T + bias; bias may be undefined. Takes the path above
// when x is on the CPU, the weight needs a gradient, and the product is in bf16 (CPU autocast to
// bf16, or x and the weight both bf16).
torch::Tensor fast_linear(const torch::Tensor& x, const torch::Tensor& weight,
                          const torch::Tensor& bias = {});

// m^T, contiguous, for a 2-D m; a blocked kernel for 2-byte elements (bf16, fp16), libtorch's
// copy for the others.
torch::Tensor transpose_contiguous(const torch::Tensor& m);

}  // namespace lockstep::models
