// The CPU kernels of fast_dropout and fast_dropout_add (dropout.h) for float and bf16 elements:
// over elements [first, first + n) of one call (first: their index in the whole tensor, which
// picks their random bits, dropout_hash.h), in vectors of 16 with the bits drawn eight hashes at a
// time. Torch-free, so that this file is compiled once per instruction set (chosen when the program
// starts) without libtorch's headers; dropout.cc compiled for the baseline x86-64, where the
// hash's 64-bit products are scalar, took a tenth of the bf16 GPT's time outside its products.
#pragma once

#include <cstdint>

#include "bf16_bits.h"
#include "dropout_hash.h"

namespace lockstep::models::kernels {

// The mask itself: drop.kept where kept, 0 elsewhere.
void dropout_mask(float* out, std::int64_t first, std::int64_t n, const DropoutBits& drop);
void dropout_mask(Bf16Bits* out, std::int64_t first, std::int64_t n, const DropoutBits& drop);

// out = residual + x * mask (the product rounded to x's type, the sum to residual's), and keep[i]
// = 1 where kept, 0 where dropped (for the backward). Pointers at element `first`.
void dropout_add_forward(const float* residual, const float* x, float* out, std::uint8_t* keep, std::int64_t first,
                         std::int64_t n, const DropoutBits& drop);
void dropout_add_forward(const float* residual, const Bf16Bits* x, float* out, std::uint8_t* keep,
                         std::int64_t first, std::int64_t n, const DropoutBits& drop);
void dropout_add_forward(const Bf16Bits* residual, const float* x, Bf16Bits* out, std::uint8_t* keep,
                         std::int64_t first, std::int64_t n, const DropoutBits& drop);
void dropout_add_forward(const Bf16Bits* residual, const Bf16Bits* x, Bf16Bits* out, std::uint8_t* keep,
                         std::int64_t first, std::int64_t n, const DropoutBits& drop);

// grad_x = grad_out (rounded to x's type) times `kept` where keep[i], else 0: autograd's gradient
// through the sum and the product.
void dropout_add_backward(const float* grad_out, const std::uint8_t* keep, float kept, float* grad_x,
                          std::int64_t n);
void dropout_add_backward(const float* grad_out, const std::uint8_t* keep, float kept, Bf16Bits* grad_x,
                          std::int64_t n);
void dropout_add_backward(const Bf16Bits* grad_out, const std::uint8_t* keep, float kept, float* grad_x,
                          std::int64_t n);
void dropout_add_backward(const Bf16Bits* grad_out, const std::uint8_t* keep, float kept, Bf16Bits* grad_x,
                          std::int64_t n);

}  // namespace lockstep::models::kernels
