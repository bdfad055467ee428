// fast_layer_norm's kernels (norm_kernels.h). Built as gelu_kernels.cc is: one copy of each public
// function per instruction set (AVX-512, AVX2 with FMA, the baseline), chosen when the program
// loads, the loops over a row's columns vectorized by `omp simd`.
#include "norm_kernels.h"

#include <cmath>

#include "bf16_bits.h"
#include "kernel_clones.h"

namespace lockstep::models::kernels {
namespace {

template <class T>
LOCKSTEP_INLINE void forward_rows(const float* __restrict x, const float* __restrict gamma,
                                  const float* __restrict beta, T* __restrict y, float* __restrict mean,
                                  float* __restrict rstd, std::int64_t rows, std::int64_t cols, float eps) {
  const float inv_n = 1.0f / static_cast<float>(cols);
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* __restrict in = x + r * cols;
    T* __restrict out = y + r * cols;
    // The mean as the first value plus the mean offset from it: the offsets are the size of the
    // row's spread, not of its values, so a row far from zero loses no precision in the sum.
    const float shift = in[0];
    float offsets = 0.0f;
#pragma omp simd reduction(+ : offsets)
    for (std::int64_t c = 0; c < cols; ++c) offsets += in[c] - shift;
    const float m = shift + offsets * inv_n;
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (std::int64_t c = 0; c < cols; ++c) squares += (in[c] - m) * (in[c] - m);
    const float s = 1.0f / std::sqrt(squares * inv_n + eps);
#pragma omp simd
    for (std::int64_t c = 0; c < cols; ++c) narrow((in[c] - m) * s * gamma[c] + beta[c], out[c]);
    mean[r] = m;
    rstd[r] = s;
  }
}

template <class T>
LOCKSTEP_INLINE void backward_rows(const T* __restrict dy, const float* __restrict x, const float* __restrict mean,
                                   const float* __restrict rstd, const float* __restrict gamma,
                                   float* __restrict dx, float* __restrict gamma_grad, float* __restrict beta_grad,
                                   std::int64_t rows, std::int64_t cols) {
  const float inv_n = 1.0f / static_cast<float>(cols);
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* __restrict g = dy + r * cols;
    const float* __restrict in = x + r * cols;
    float* __restrict out = dx + r * cols;
    const float m = mean[r], s = rstd[r];
    float sum_g = 0.0f, sum_gx = 0.0f;
#pragma omp simd reduction(+ : sum_g, sum_gx)
    for (std::int64_t c = 0; c < cols; ++c) {
      const float d = widen(g[c]), xhat = (in[c] - m) * s, scaled = d * gamma[c];
      sum_g += scaled;
      sum_gx += scaled * xhat;
      gamma_grad[c] += d * xhat;
      beta_grad[c] += d;
    }
    const float a = sum_g * inv_n, b = sum_gx * inv_n;
#pragma omp simd
    for (std::int64_t c = 0; c < cols; ++c) out[c] = s * (widen(g[c]) * gamma[c] - a - (in[c] - m) * s * b);
  }
}

}  // namespace

LOCKSTEP_CLONES void layer_norm_forward(const float* x, const float* gamma, const float* beta, float* y, float* mean,
                                        float* rstd, std::int64_t rows, std::int64_t cols, float eps) {
  forward_rows(x, gamma, beta, y, mean, rstd, rows, cols, eps);
}

LOCKSTEP_CLONES void layer_norm_forward(const float* x, const float* gamma, const float* beta, Bf16Bits* y,
                                        float* mean, float* rstd, std::int64_t rows, std::int64_t cols, float eps) {
  forward_rows(x, gamma, beta, y, mean, rstd, rows, cols, eps);
}

LOCKSTEP_CLONES void layer_norm_backward(const float* dy, const float* x, const float* mean, const float* rstd,
                                         const float* gamma, float* dx, float* gamma_grad, float* beta_grad,
                                         std::int64_t rows, std::int64_t cols) {
  backward_rows(dy, x, mean, rstd, gamma, dx, gamma_grad, beta_grad, rows, cols);
}

LOCKSTEP_CLONES void layer_norm_backward(const Bf16Bits* dy, const float* x, const float* mean, const float* rstd,
                                         const float* gamma, float* dx, float* gamma_grad, float* beta_grad,
                                         std::int64_t rows, std::int64_t cols) {
  backward_rows(dy, x, mean, rstd, gamma, dx, gamma_grad, beta_grad, rows, cols);
}

}  // namespace lockstep::models::kernels
