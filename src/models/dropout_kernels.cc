// fast_dropout's kernels (dropout_kernels.h): one copy per instruction set (kernel_clones.h), each
// in vectors of 16 (lanes.h).
#include "dropout_kernels.h"

#include "bf16_bits.h"
#include "dropout_hash.h"
#include "dropout_lanes.h"
#include "kernel_clones.h"
#include "lanes.h"
#include "vector_math.h"

namespace lockstep::models::kernels {
namespace {

using Bytes = std::uint8_t __attribute__((vector_size(kLanes)));

template <class T>
LOCKSTEP_INLINE void mask(T* out, std::int64_t first, std::int64_t n, const DropoutBits& drop) {
  for (std::int64_t c = 0; c < n; c += kLanes) {
    const Ints kept = kept_lanes(drop, static_cast<std::uint64_t>(first + c));
    store(out + c, kept ? splat<Floats>(drop.kept) : Floats{}, lanes_at(c, n));
  }
}

template <class R, class X>
LOCKSTEP_INLINE void add_forward(const R* residual, const X* x, R* out, std::uint8_t* keep, std::int64_t first,
                                 std::int64_t n, const DropoutBits& drop) {
  for (std::int64_t c = 0; c < n; c += kLanes) {
    const std::int64_t m = lanes_at(c, n);
    const Ints kept = kept_lanes(drop, static_cast<std::uint64_t>(first + c));
    const Floats dropped = rounded_to<X>(load(x + c, m) * (kept ? splat<Floats>(drop.kept) : Floats{}));
    store(out + c, load(residual + c, m) + dropped, m);
    store_raw(keep + c, __builtin_convertvector(kept & 1, Bytes), m);
  }
}

template <class R, class X>
LOCKSTEP_INLINE void add_backward(const R* grad_out, const std::uint8_t* keep, float kept, X* grad_x,
                                  std::int64_t n) {
  for (std::int64_t c = 0; c < n; c += kLanes) {
    const std::int64_t m = lanes_at(c, n);
    const Ints kept_here = __builtin_convertvector(load_raw<Bytes>(keep + c, m) != 0, Ints);  // 0 or -1 each
    store(grad_x + c, rounded_to<X>(load(grad_out + c, m)) * (kept_here ? splat<Floats>(kept) : Floats{}), m);
  }
}

}  // namespace

LOCKSTEP_CLONES void dropout_mask(float* out, std::int64_t first, std::int64_t n, const DropoutBits& drop) {
  mask(out, first, n, drop);
}

LOCKSTEP_CLONES void dropout_mask(Bf16Bits* out, std::int64_t first, std::int64_t n, const DropoutBits& drop) {
  mask(out, first, n, drop);
}

LOCKSTEP_CLONES void dropout_add_forward(const float* residual, const float* x, float* out, std::uint8_t* keep,
                                         std::int64_t first, std::int64_t n, const DropoutBits& drop) {
  add_forward(residual, x, out, keep, first, n, drop);
}

LOCKSTEP_CLONES void dropout_add_forward(const float* residual, const Bf16Bits* x, float* out, std::uint8_t* keep,
                                         std::int64_t first, std::int64_t n, const DropoutBits& drop) {
  add_forward(residual, x, out, keep, first, n, drop);
}

LOCKSTEP_CLONES void dropout_add_forward(const Bf16Bits* residual, const float* x, Bf16Bits* out, std::uint8_t* keep,
                                         std::int64_t first, std::int64_t n, const DropoutBits& drop) {
  add_forward(residual, x, out, keep, first, n, drop);
}

LOCKSTEP_CLONES void dropout_add_forward(const Bf16Bits* residual, const Bf16Bits* x, Bf16Bits* out,
                                         std::uint8_t* keep, std::int64_t first, std::int64_t n,
                                         const DropoutBits& drop) {
  add_forward(residual, x, out, keep, first, n, drop);
}

LOCKSTEP_CLONES void dropout_add_backward(const float* grad_out, const std::uint8_t* keep, float kept, float* grad_x,
                                          std::int64_t n) {
  add_backward(grad_out, keep, kept, grad_x, n);
}

LOCKSTEP_CLONES void dropout_add_backward(const float* grad_out, const std::uint8_t* keep, float kept,
                                          Bf16Bits* grad_x, std::int64_t n) {
  add_backward(grad_out, keep, kept, grad_x, n);
}

LOCKSTEP_CLONES void dropout_add_backward(const Bf16Bits* grad_out, const std::uint8_t* keep, float kept,
                                          float* grad_x, std::int64_t n) {
  add_backward(grad_out, keep, kept, grad_x, n);
}

LOCKSTEP_CLONES void dropout_add_backward(const Bf16Bits* grad_out, const std::uint8_t* keep, float kept,
                                          Bf16Bits* grad_x, std::int64_t n) {
  add_backward(grad_out, keep, kept, grad_x, n);
}

}  // namespace lockstep::models::kernels
