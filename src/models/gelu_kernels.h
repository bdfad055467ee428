// The CPU kernels of fast_bias_gelu (activation.h): gelu(x + bias), exact or in the tanh form,
// forward and backward, over rows of a row-major matrix, float or bf16 (as its bits), with the bias
// in float. Torch-free, so that this file is compiled with the vectorizer's options (and one copy
// per instruction set, chosen when the program starts) without libtorch's headers.
//
// The exact form, libtorch's gelu(approximate="none"): gelu(h) = h Phi(h), Phi the normal
// distribution function, Phi(h) = erfc(-h/sqrt(2))/2, with erfc by the Chebyshev fit of Numerical
// Recipes (relative error below 1.2e-7 for every argument, so Phi keeps its precision far into the
// negative tail); gelu'(h) = Phi(h) + h exp(-h^2/2)/sqrt(2 pi).
//
// The tanh form, as libtorch's gelu(approximate="tanh") and GPT-2's gelu_new:
//   gelu(h) = h/2 (1 + tanh(u)),  u = sqrt(2/pi) (h + 0.044715 h^3),
// computed here as h sigmoid(2u) (the same function: 1 + tanh(u) = 2 sigmoid(2u)), which has no
// cancellation where 1 + tanh(u) is small; its derivative
//   gelu'(h) = s + 2 h s (1 - s) sqrt(2/pi) (1 + 3 * 0.044715 h^2),  s = sigmoid(2u).
// exp is a polynomial the vectorizer can take (relative error a few float ulps), its argument
// clamped to +-88 so that no step overflows. Everything is computed in float; bf16 results are
// rounded to nearest even once.
//
// For bf16 the exact form takes a shorter fit of erfc, Abramowitz and Stegun's 7.1.26 (absolute
// error below 1.5e-7, relative up to 1e-3 deep in the negative tail: a quarter of bf16's own
// rounding), whose exp(-h^2/2) the derivative's density term shares: one exp where the float fit
// needs two, 1.4x faster forward and 2x backward.
#pragma once

#include <cstdint>

#include "bf16_bits.h"

namespace lockstep::models::kernels {

enum class GeluForm { exact, tanh };

// y[r][c] = gelu(x[r][c] + bias[c]) for rows x cols elements; rows apart by `cols`.
void bias_gelu_forward(GeluForm form, const float* x, const float* bias, float* y, std::int64_t rows,
                       std::int64_t cols);
void bias_gelu_forward(GeluForm form, const Bf16Bits* x, const float* bias, Bf16Bits* y, std::int64_t rows,
                       std::int64_t cols);

// dx[r][c] = dy[r][c] gelu'(x[r][c] + bias[c]) (rounded to x's type), and bias_grad[c] += the sum
// over rows of dx (before that rounding), in float.
void bias_gelu_backward(GeluForm form, const float* dy, const float* x, const float* bias, float* dx,
                        float* bias_grad, std::int64_t rows, std::int64_t cols);
void bias_gelu_backward(GeluForm form, const Bf16Bits* dy, const Bf16Bits* x, const float* bias, Bf16Bits* dx,
                        float* bias_grad, std::int64_t rows, std::int64_t cols);

}  // namespace lockstep::models::kernels
