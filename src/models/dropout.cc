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
#include "dropout_kernels.h"
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

// The mask's bits for a kernel over elements of type T: `kept` as T holds it.
template <class T>
kernels::DropoutBits bits_for(const Mask& m) {
  return {m.seed, m.threshold, static_cast<float>(static_cast<T>(m.kept))};
}

// f(first, count) over blocks of [0, n) in parallel; blocks start at multiples of 64 (whole hash
// words, whole vectors).
template <class F>
void for_each_block(std::int64_t n, const F& f) {
  constexpr std::int64_t kChunk = 64;
  at::parallel_for(0, (n + kChunk - 1) / kChunk, 256, [&](std::int64_t begin, std::int64_t end) {
    f(begin * kChunk, std::min(end * kChunk, n) - begin * kChunk);
  });
}

// The mask of elements of type T into `out`: the kernels for float and bf16, element by element
// for the other types.
template <class T>
void fill_mask(T* out, std::int64_t n, const Mask& m) {
  const auto bits = bits_for<T>(m);
  for_each_block(n, [&](std::int64_t first, std::int64_t count) {
    if constexpr (std::is_same_v<T, float>) {
      kernels::dropout_mask(out + first, first, count, bits);
    } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
      kernels::dropout_mask(reinterpret_cast<kernels::Bf16Bits*>(out) + first, first, count, bits);
    } else {
      const T kept = static_cast<T>(m.kept);
      for (std::int64_t i = first; i < first + count; ++i)
        out[i] = kernels::draw16(m.seed, static_cast<std::uint64_t>(i)) >= m.threshold ? kept : T(0);
    }
  });
}

// The mask of a shard's elements (shapes as `where` says, checked by the caller): element i of the
// shard draws the bits of its index in the whole tensor.
template <class T>
void fill_shard_mask(T* out, at::IntArrayRef sizes, const ShardOf& where, const Mask& m) {
  const auto dims = static_cast<std::int64_t>(sizes.size());
  std::vector<std::int64_t> whole_stride(sizes.size(), 1);
  for (std::int64_t j = dims - 2; j >= 0; --j)
    whole_stride[std::size_t(j)] = whole_stride[std::size_t(j + 1)] * where.whole_sizes[std::size_t(j + 1)];
  const std::int64_t inner = dims == 0 ? 1 : sizes[std::size_t(dims - 1)];
  const std::int64_t rows = inner == 0 ? 0 : c10::multiply_integers(sizes) / inner;
  const T kept = static_cast<T>(m.kept);
  for (std::int64_t row = 0; row < rows; ++row) {
    std::int64_t base = dims == 0 ? 0 : where.offsets[std::size_t(dims - 1)];
    for (std::int64_t j = dims - 2, rest = row; j >= 0; --j) {
      base += (rest % sizes[std::size_t(j)] + where.offsets[std::size_t(j)]) * whole_stride[std::size_t(j)];
      rest /= sizes[std::size_t(j)];
    }
    for (std::int64_t c = 0; c < inner; ++c)
      out[row * inner + c] =
          kernels::draw16(m.seed, static_cast<std::uint64_t>(base + c)) >= m.threshold ? kept : T(0);
  }
}

void check_shard(const torch::Tensor& x, const ShardOf& where) {
  bool fits = where.whole_sizes.size() == std::size_t(x.dim()) && where.offsets.size() == std::size_t(x.dim());
  for (std::int64_t j = 0; fits && j < x.dim(); ++j)
    fits = where.offsets[std::size_t(j)] >= 0 && where.offsets[std::size_t(j)] + x.size(j) <= where.whole_sizes[std::size_t(j)];
  if (!fits)
    throw ConfigError("fast_dropout_shard: a tensor of shape " + c10::str(x.sizes()) + " at offsets " +
                      c10::str(where.offsets) + " does not lie inside a whole of shape " + c10::str(where.whole_sizes));
}

// f(R(), X()) for the pairs the fused sum takes: float and bf16 (as its bits) each way.
template <class F>
void dispatch_pair(at::ScalarType residual, at::ScalarType x, const F& f) {
  const auto with_x = [&](auto r) {
    if (x == at::kFloat) return f(r, float());
    return f(r, kernels::Bf16Bits());
  };
  if (residual == at::kFloat) return with_x(float());
  with_x(kernels::Bf16Bits());
}

// X's kept scale, as the kernels take it.
template <class X>
float kept_for(double kept) {
  return dropout_scale_in(std::is_same_v<X, float> ? at::kFloat : at::kBFloat16, kept);
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
      const kernels::DropoutBits bits{m.seed, m.threshold, kept_for<X>(m.kept)};
      const auto* rp = static_cast<const R*>(r.data_ptr());
      const auto* xp = static_cast<const X*>(in.data_ptr());
      auto* op = static_cast<R*>(out.data_ptr());
      auto* kp = keep.data_ptr<std::uint8_t>();
      for_each_block(out.numel(), [&](std::int64_t first, std::int64_t count) {
        kernels::dropout_add_forward(rp + first, xp + first, op + first, kp + first, first, count, bits);
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
    const double kept = ctx->saved_data["kept"].toDouble();
    dispatch_pair(g.scalar_type(), x_dtype, [&](auto rt, auto xt) {
      using R = decltype(rt);
      using X = decltype(xt);
      const auto* gp = static_cast<const R*>(g.data_ptr());
      const auto* kp = keep.data_ptr<std::uint8_t>();
      auto* xp = static_cast<X*>(grad_x.data_ptr());
      for_each_block(g.numel(), [&](std::int64_t first, std::int64_t count) {
        kernels::dropout_add_backward(gp + first, kp + first, kept_for<X>(kept), xp + first, count);
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

float dropout_scale_in(at::ScalarType type, double scale) {
  const auto as_float = static_cast<float>(scale);
  return type == at::kBFloat16 ? static_cast<float>(c10::BFloat16(as_float)) : as_float;
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
                                  [&] { fill_mask(mask.data_ptr<scalar_t>(), mask.numel(), m); });
  return x * mask;
}

ShardOf ShardOf::slice(const torch::Tensor& shard, std::int64_t dim, std::int64_t index, std::int64_t slices) {
  const auto d = dim < 0 ? dim + shard.dim() : dim;
  ShardOf where{shard.sizes().vec(), std::vector<std::int64_t>(std::size_t(shard.dim()), 0)};
  where.whole_sizes[std::size_t(d)] *= slices;
  where.offsets[std::size_t(d)] = index * shard.size(d);
  return where;
}

torch::Tensor fast_dropout_shard(const torch::Tensor& x, double p, bool training, const ShardOf& where) {
  check_dropout_probability(p);
  check_shard(x, where);
  if (!training || p == 0) return x;
  const auto threshold = dropout_threshold(p);
  if (threshold >= 65536) return x * 0;
  auto mask = torch::empty(x.sizes(), x.options().device(torch::kCPU).requires_grad(false));
  const Mask m = draw_mask(threshold);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, mask.scalar_type(), "lockstep_dropout_shard",
                                  [&] { fill_shard_mask(mask.data_ptr<scalar_t>(), x.sizes(), where, m); });
  return x * mask.to(x.device());
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
