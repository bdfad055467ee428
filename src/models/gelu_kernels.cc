// fast_bias_gelu's kernels (gelu_kernels.h). Each public function is compiled once per
// instruction set (AVX-512, AVX2 with FMA, and the baseline) and the best one the CPU has is
// chosen when the program loads (GCC's target_clones); the loops over a row's columns are
// vectorized (`omp simd`, this file being built with -fopenmp-simd, and -fno-trapping-math, without
// which GCC keeps a select before a float-to-integer conversion out of vectorized loops).
#include "gelu_kernels.h"

#include <type_traits>

#include "bf16_bits.h"
#include "kernel_clones.h"
#include "vector_math.h"

namespace lockstep::models::kernels {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCubic = 0.044715f;
constexpr float kSqrtHalf = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

// sigmoid(2u) of the tanh form at h.
LOCKSTEP_INLINE float sigmoid_2u(float h) {
  const float u = kSqrt2OverPi * (h + kCubic * h * h * h);
  return 1.0f / (1.0f + exp_clamped(clamp88(-2.0f * u)));
}

// erfc(a)/2 for a >= 0: the Chebyshev fit t exp(-a^2 + P(t)), t = 1/(1 + a/2).
LOCKSTEP_INLINE float half_erfc(float a) {
  const float t = 1.0f / (1.0f + 0.5f * a);
  float p = 0.17087277f;
  p = p * t - 0.82215223f;
  p = p * t + 1.48851587f;
  p = p * t - 1.13520398f;
  p = p * t + 0.27886807f;
  p = p * t - 0.18628806f;
  p = p * t + 0.09678418f;
  p = p * t + 0.37409196f;
  p = p * t + 1.00002368f;
  p = p * t - 1.26551223f;
  return 0.5f * t * exp_clamped(clamp88(p - a * a));
}

// Phi(h), the normal distribution function: erfc(-h/sqrt(2))/2, each tail from erfc.
LOCKSTEP_INLINE float normal_cdf(float h) {
  const float tail = half_erfc((h < 0 ? -h : h) * kSqrtHalf);
  return h < 0 ? tail : 1.0f - tail;
}

// For a bf16 result, the exact form's Phi from a shorter fit: erfc(a)/2 for a >= 0 by
// Abramowitz and Stegun's 7.1.26, t P(t) exp(-a^2)/2 with t = 1/(1 + 0.3275911 a) (absolute error
// below 1.5e-7; relative up to 1e-3 deep in the negative tail, a quarter of bf16's own rounding).
// Its exp(-a^2) is the density's exp(-h^2/2), which the derivative shares. `e` is that exp.
LOCKSTEP_INLINE float half_erfc_short(float a, float e) {
  const float t = 1.0f / (1.0f + 0.3275911f * a);
  float p = 1.061405429f;
  p = p * t - 1.453152027f;
  p = p * t + 1.421413741f;
  p = p * t - 0.284496736f;
  p = p * t + 0.254829592f;
  return 0.5f * t * p * e;
}

// Phi(h) by the short fit, given |h|/sqrt(2) and exp(-h^2/2).
LOCKSTEP_INLINE float normal_cdf_short(float h, float a, float e) {
  const float tail = half_erfc_short(a, e);
  return h < 0 ? tail : 1.0f - tail;
}

// The exact form's fit by the result's type: float's precision for float, the short one for bf16.
template <class T>
constexpr bool kShortFit = std::is_same_v<T, Bf16Bits>;

template <GeluForm form, class T>
LOCKSTEP_INLINE float gelu(float h) {
  if constexpr (form == GeluForm::tanh) {
    return h * sigmoid_2u(h);
  } else if constexpr (kShortFit<T>) {
    const float a = (h < 0 ? -h : h) * kSqrtHalf;
    return h * normal_cdf_short(h, a, exp_clamped(clamp88(-a * a)));
  } else {
    return h * normal_cdf(h);
  }
}

template <GeluForm form, class T>
LOCKSTEP_INLINE float gelu_derivative(float h) {
  if constexpr (form == GeluForm::tanh) {
    const float s = sigmoid_2u(h);
    return s + 2.0f * h * s * (1.0f - s) * kSqrt2OverPi * (1.0f + 3.0f * kCubic * h * h);
  } else if constexpr (kShortFit<T>) {
    const float a = (h < 0 ? -h : h) * kSqrtHalf;
    const float e = exp_clamped(clamp88(-a * a));
    return normal_cdf_short(h, a, e) + h * kInvSqrt2Pi * e;
  } else {
    return normal_cdf(h) + h * kInvSqrt2Pi * exp_clamped(clamp88(-0.5f * h * h));
  }
}

template <GeluForm form, class T>
LOCKSTEP_INLINE void forward_rows(const T* __restrict x, const float* __restrict bias, T* __restrict y,
                                  std::int64_t rows, std::int64_t cols) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* __restrict in = x + r * cols;
    T* __restrict out = y + r * cols;
#pragma omp simd
    for (std::int64_t c = 0; c < cols; ++c) narrow(gelu<form, T>(widen(in[c]) + bias[c]), out[c]);
  }
}

template <GeluForm form, class T>
LOCKSTEP_INLINE void backward_rows(const T* __restrict dy, const T* __restrict x, const float* __restrict bias,
                                   T* __restrict dx, float* __restrict bias_grad, std::int64_t rows,
                                   std::int64_t cols) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* __restrict g = dy + r * cols;
    const T* __restrict in = x + r * cols;
    T* __restrict out = dx + r * cols;
#pragma omp simd
    for (std::int64_t c = 0; c < cols; ++c) {
      const float d = widen(g[c]) * gelu_derivative<form, T>(widen(in[c]) + bias[c]);
      bias_grad[c] += d;
      narrow(d, out[c]);
    }
  }
}

template <class T>
LOCKSTEP_INLINE void forward(GeluForm form, const T* x, const float* bias, T* y, std::int64_t rows,
                             std::int64_t cols) {
  if (form == GeluForm::tanh) return forward_rows<GeluForm::tanh>(x, bias, y, rows, cols);
  forward_rows<GeluForm::exact>(x, bias, y, rows, cols);
}

template <class T>
LOCKSTEP_INLINE void backward(GeluForm form, const T* dy, const T* x, const float* bias, T* dx, float* bias_grad,
                              std::int64_t rows, std::int64_t cols) {
  if (form == GeluForm::tanh) return backward_rows<GeluForm::tanh>(dy, x, bias, dx, bias_grad, rows, cols);
  backward_rows<GeluForm::exact>(dy, x, bias, dx, bias_grad, rows, cols);
}

}  // namespace

LOCKSTEP_CLONES void bias_gelu_forward(GeluForm form, const float* x, const float* bias, float* y,
                                       std::int64_t rows, std::int64_t cols) {
  forward(form, x, bias, y, rows, cols);
}

LOCKSTEP_CLONES void bias_gelu_forward(GeluForm form, const Bf16Bits* x, const float* bias, Bf16Bits* y,
                                       std::int64_t rows, std::int64_t cols) {
  forward(form, x, bias, y, rows, cols);
}

LOCKSTEP_CLONES void bias_gelu_backward(GeluForm form, const float* dy, const float* x, const float* bias,
                                        float* dx, float* bias_grad, std::int64_t rows, std::int64_t cols) {
  backward(form, dy, x, bias, dx, bias_grad, rows, cols);
}

LOCKSTEP_CLONES void bias_gelu_backward(GeluForm form, const Bf16Bits* dy, const Bf16Bits* x, const float* bias,
                                        Bf16Bits* dx, float* bias_grad, std::int64_t rows, std::int64_t cols) {
  backward(form, dy, x, bias, dx, bias_grad, rows, cols);
}

}  // namespace lockstep::models::kernels
