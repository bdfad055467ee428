// The CPU kernels of fast_layer_norm (norm.h): layer norm over the rows of a row-major float
// matrix, its result written as float or as bf16 (the cast to the next product's dtype in the
// same pass), and its backward from a float or bf16 gradient. Torch-free, so that this file is
// compiled with the vectorizer's options (one copy per instruction set, chosen when the program
// starts) without libtorch's headers.
//
// Forward, per row of n values: mean m (summed as offsets from the row's first value, so that a
// row far from zero keeps its precision), variance v = mean((x - m)^2) (two passes over the row,
// which is in cache after the first), rstd = 1/sqrt(v + eps), y = (x - m) rstd gamma + beta,
// rounded once to bf16 when y is bf16. m and rstd are kept for the backward.
// Backward, per row, with xhat = (x - m) rstd and g = dy gamma:
//   dx = rstd (g - mean(g) - xhat mean(g xhat)),
// and over all rows gamma_grad += dy xhat, beta_grad += dy. Everything is computed in float.
#pragma once

#include <cstdint>

#include "bf16_bits.h"

namespace lockstep::models::kernels {

void layer_norm_forward(const float* x, const float* gamma, const float* beta, float* y, float* mean,
                        float* rstd, std::int64_t rows, std::int64_t cols, float eps);
void layer_norm_forward(const float* x, const float* gamma, const float* beta, Bf16Bits* y, float* mean,
                        float* rstd, std::int64_t rows, std::int64_t cols, float eps);

// dx for rows x cols elements; gamma_grad[c] and beta_grad[c] get the rows' sums added.
void layer_norm_backward(const float* dy, const float* x, const float* mean, const float* rstd, const float* gamma,
                         float* dx, float* gamma_grad, float* beta_grad, std::int64_t rows, std::int64_t cols);
void layer_norm_backward(const Bf16Bits* dy, const float* x, const float* mean, const float* rstd,
                         const float* gamma, float* dx, float* gamma_grad, float* beta_grad, std::int64_t rows,
                         std::int64_t cols);

}  // namespace lockstep::models::kernels
