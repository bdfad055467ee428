#include "lockstep/models/dropout.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <mutex>

#include "lockstep/error.h"

namespace lockstep::models {
namespace {

constexpr std::uint64_t kGolden = 0x9e3779b97f4a7c15ULL;

// splitmix64's output function: a bijective mix of a 64-bit counter.
std::uint64_t mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

std::uint64_t seed_from_default_generator() {
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(generator)->random64();
}

// out[i] = kept if 16 bits of the hash of (seed, i / 4) are at least `threshold`, else 0.
template <class T>
void fill_mask(T* out, std::int64_t n, std::uint64_t seed, std::uint32_t threshold, T kept) {
  at::parallel_for(0, (n + 3) / 4, 1 << 14, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t word = begin; word < end; ++word) {
      const std::uint64_t bits = mix(seed + static_cast<std::uint64_t>(word) * kGolden);
      const std::int64_t first = 4 * word, last = std::min<std::int64_t>(first + 4, n);
      for (std::int64_t i = first; i < last; ++i)
        out[i] = ((bits >> (16 * (i - first))) & 0xffff) >= threshold ? kept : T(0);
    }
  });
}

}  // namespace

torch::Tensor fast_dropout(const torch::Tensor& x, double p, bool training) {
  if (!(p >= 0 && p <= 1))
    throw ConfigError("dropout probability must be within [0, 1], got " + std::to_string(p));
  if (!training || p == 0) return x;
  // The mask below is written by the CPU: a GPU's tensor takes the GPU's own dropout kernel.
  if (!x.device().is_cpu()) return torch::dropout(x, p, training);
  const auto threshold = static_cast<std::uint32_t>(std::lround(p * 65536));
  if (threshold >= 65536) return x * 0;
  const double kept = 65536.0 / static_cast<double>(65536 - threshold);
  auto mask = torch::empty(x.sizes(), x.options().requires_grad(false));
  const std::uint64_t seed = seed_from_default_generator();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, mask.scalar_type(), "lockstep_dropout", [&] {
    fill_mask<scalar_t>(mask.data_ptr<scalar_t>(), mask.numel(), seed, threshold,
                        static_cast<scalar_t>(kept));
  });
  return x * mask;
}

}  // namespace lockstep::models
