#include "lockstep/models/dropout.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>

#include "bf16_bits.h"
#include "dropout_draw.h"
#include "dropout_hash.h"
#include "lockstep/error.h"

namespace lockstep::models {
namespace {

using kernels::kGolden;
using kernels::mix;

// The innermost DropoutSeeds of this thread, if any.
thread_local DropoutSeeds* current_seeds = nullptr;

// One call's mask: its seed, the threshold of p, and the scale of the kept values.
struct Mask {
  std::uint64_t seed;
  std::uint32_t threshold;  // below 65536: p = 1 never draws
  double kept;
};

Mask draw_mask(std::uint32_t threshold) {
  return {next_dropout_seed(), threshold, dropout_scale(threshold)};
}

// Chunks of whole hash words. The kernels below run a loop of constant length over each whole
// chunk, on restricted pointers with nothing called in between, so that the compiler vectorizes
// them (at -O2 too).
constexpr std::int64_t kChunk = 64;

// The chunk's 16-bit draws from element `first`: element i's are 16 bits of the hash of (seed, i / 4).
void chunk_draws(std::int64_t first, std::uint64_t seed, std::uint16_t* draw) {
  std::uint64_t bits[kChunk / 4];
  for (std::int64_t w = 0; w < kChunk / 4; ++w)
    bits[w] = mix(seed + static_cast<std::uint64_t>(first / 4 + w) * kGolden);
  for (std::int64_t w = 0; w < kChunk / 4; ++w)
    for (int j = 0; j < 4; ++j) draw[4 * w + j] = static_cast<std::uint16_t>(bits[w] >> (16 * j));
}

// f(first, length, draws) for each chunk of [0, n).
template <class F>
void for_each_chunk(std::int64_t n, std::uint64_t seed, const F& f) {
  at::parallel_for(0, (n + kChunk - 1) / kChunk, 256, [&](std::int64_t begin, std::int64_t end) {
    std::uint16_t draw[kChunk];
    for (std::int64_t c = begin; c < end; ++c) {
      chunk_draws(c * kChunk, seed, draw);
      f(c * kChunk, std::min(kChunk, n - c * kChunk), draw);
    }
  });
}

// Element types through float (bf16_bits.h).
using kernels::Bf16Bits;
using kernels::narrow;
using kernels::widen;
template <class T>
T narrowed(float v) {
  T out;
  narrow(v, out);
  return out;
}

// The chunk's mask, element by element: `kept` or 0, as bits (S: an unsigned integer of the
// element's size; 0 is +0 in every floating type).
template <class S>
void mask_chunk(const std::uint16_t* __restrict draw, std::uint32_t threshold, S kept, S* __restrict out,
                std::int64_t length) {
  if (length == kChunk) {
    for (std::int64_t j = 0; j < kChunk; ++j) out[j] = draw[j] >= threshold ? kept : S(0);
  } else {
    for (std::int64_t j = 0; j < length; ++j) out[j] = draw[j] >= threshold ? kept : S(0);
  }
}

// The mask of elements of type T into `out`, written as their bits.
template <class T>
void fill_mask(void* out, std::int64_t n, const Mask& m) {
  using S = std::conditional_t<sizeof(T) == 2, std::uint16_t,
                               std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>>;
  static_assert(sizeof(T) == sizeof(S));
  const T kept_value = static_cast<T>(m.kept);
  S kept;
  std::memcpy(&kept, &kept_value, sizeof kept);
  for_each_chunk(n, m.seed, [&](std::int64_t first, std::int64_t length, const std::uint16_t* draw) {
    mask_chunk<S>(draw, m.threshold, kept, static_cast<S*>(out) + first, length);
  });
}

// Elements [0, length) of a chunk: residual + x * mask, the product rounded to x's type first
// (fast_dropout's product, then the sum), and which elements it kept.
template <class R, class X>
inline void sum_range(const R* __restrict residual, const X* __restrict x,
                      const std::uint16_t* __restrict draw, std::uint32_t threshold, float kept,
                      R* __restrict out, std::uint8_t* __restrict keep, std::int64_t length) {
  for (std::int64_t j = 0; j < length; ++j) {
    keep[j] = draw[j] >= threshold;
    narrow(widen(residual[j]) + widen(narrowed<X>(widen(x[j]) * (keep[j] ? kept : 0.0f))), out[j]);
  }
}

// Elements [0, length) of a chunk: the gradient of x, grad_out rounded to x's type times the mask,
// as autograd gives it through the sum and fast_dropout.
template <class R, class X>
inline void gradient_range(const R* __restrict grad_out, const std::uint8_t* __restrict keep, float kept,
                           X* __restrict grad_x, std::int64_t length) {
  for (std::int64_t j = 0; j < length; ++j)
    narrow(widen(narrowed<X>(widen(grad_out[j]))) * (keep[j] ? kept : 0.0f), grad_x[j]);
}

// kept in x's type, as a float.
template <class X>
float kept_as(const Mask& m) {
  return widen(narrowed<X>(static_cast<float>(m.kept)));
}

// f(R(), X()) for the pairs the fused sum takes: float and bf16 each way.
template <class F>
void dispatch_pair(at::ScalarType residual, at::ScalarType x, const F& f) {
  const auto with_x = [&](auto r) {
    if (x == at::kFloat) return f(r, float());
    return f(r, Bf16Bits());
  };
  if (residual == at::kFloat) return with_x(float());
  with_x(Bf16Bits());
}

bool fusable_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16;
}

// residual + x * mask forward, grad_out * mask back. Backward keeps a byte per element (which
// were kept), where the two steps kept the mask in x's type.
struct DropoutAdd : torch::autograd::Function<DropoutAdd> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& residual,
                               const torch::Tensor& x, std::int64_t threshold) {
    const Mask m = draw_mask(static_cast<std::uint32_t>(threshold));
    const auto r = residual.contiguous(), in = x.contiguous();
    auto out = torch::empty_like(r);
    auto keep = torch::empty(r.sizes(), r.options().dtype(torch::kByte));
    dispatch_pair(r.scalar_type(), in.scalar_type(), [&](auto rt, auto xt) {
      using R = decltype(rt);
      using X = decltype(xt);
      const auto* rp = static_cast<const R*>(r.data_ptr());
      const auto* xp = static_cast<const X*>(in.data_ptr());
      auto* op = static_cast<R*>(out.data_ptr());
      auto* kp = keep.data_ptr<std::uint8_t>();
      const float kept = kept_as<X>(m);
      for_each_chunk(
          out.numel(), m.seed, [&](std::int64_t first, std::int64_t length, const std::uint16_t* draw) {
            if (length == kChunk) {
              sum_range(rp + first, xp + first, draw, m.threshold, kept, op + first, kp + first, kChunk);
            } else {
              sum_range(rp + first, xp + first, draw, m.threshold, kept, op + first, kp + first, length);
            }
          });
    });
    ctx->save_for_backward({keep});
    ctx->saved_data["kept"] = m.kept;
    ctx->saved_data["x_dtype"] = static_cast<std::int64_t>(x.scalar_type());
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto g = grads[0].contiguous();
    const auto keep = ctx->get_saved_variables()[0];
    const auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    auto grad_x = torch::empty(g.sizes(), g.options().dtype(x_dtype));
    const Mask m{0, 0, ctx->saved_data["kept"].toDouble()};
    dispatch_pair(g.scalar_type(), x_dtype, [&](auto rt, auto xt) {
      using R = decltype(rt);
      using X = decltype(xt);
      const auto* gp = static_cast<const R*>(g.data_ptr());
      const auto* kp = keep.data_ptr<std::uint8_t>();
      auto* xp = static_cast<X*>(grad_x.data_ptr());
      const float kept = kept_as<X>(m);
      at::parallel_for(0, (g.numel() + kChunk - 1) / kChunk, 256, [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t c = begin; c < end; ++c) {
          const std::int64_t first = c * kChunk, length = std::min(kChunk, g.numel() - first);
          if (length == kChunk) {
            gradient_range(gp + first, kp + first, kept, xp + first, kChunk);
          } else {
            gradient_range(gp + first, kp + first, kept, xp + first, length);
          }
        }
      });
    });
    return {g, grad_x, torch::Tensor()};
  }
};

}  // namespace

void check_dropout_probability(double p) {
  if (!(p >= 0 && p <= 1))
    throw ConfigError("dropout probability must be within [0, 1], got " + std::to_string(p));
}

std::uint32_t dropout_threshold(double p) {
  return static_cast<std::uint32_t>(std::lround(p * 65536));
}

double dropout_scale(std::uint32_t threshold) {
  return 65536.0 / static_cast<double>(65536 - threshold);
}

std::uint64_t next_dropout_seed() {
  if (current_seeds) return current_seeds->next();
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(generator)->random64();
}

DropoutSeeds::DropoutSeeds(std::uint64_t seed) : seed_(seed), outer_(current_seeds) {
  current_seeds = this;
}

DropoutSeeds::~DropoutSeeds() {
  current_seeds = outer_;
}

std::uint64_t DropoutSeeds::next() {
  return mix(seed_ + kGolden * ++calls_);
}

torch::Tensor fast_dropout(const torch::Tensor& x, double p, bool training) {
  check_dropout_probability(p);
  if (!training || p == 0) return x;
  // The mask below is written by the CPU: a GPU's tensor takes the GPU's own dropout kernel.
  if (!x.device().is_cpu()) return torch::dropout(x, p, training);
  const auto threshold = dropout_threshold(p);
  if (threshold >= 65536) return x * 0;
  auto mask = torch::empty(x.sizes(), x.options().requires_grad(false));
  const Mask m = draw_mask(threshold);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, mask.scalar_type(), "lockstep_dropout",
                                  [&] { fill_mask<scalar_t>(mask.data_ptr(), mask.numel(), m); });
  return x * mask;
}

torch::Tensor fast_dropout_add(const torch::Tensor& residual, const torch::Tensor& x, double p,
                               bool training) {
  check_dropout_probability(p);
  const auto threshold = dropout_threshold(p);
  const bool fused = training && p > 0 && threshold < 65536 && residual.device().is_cpu() &&
                     x.device().is_cpu() && residual.sizes() == x.sizes() &&
                     residual.scalar_type() == at::result_type(residual, x) &&
                     fusable_type(residual.scalar_type()) && fusable_type(x.scalar_type());
  if (!fused) return residual + fast_dropout(x, p, training);
  return DropoutAdd::apply(residual, x, static_cast<std::int64_t>(threshold));
}

}  // namespace lockstep::models
