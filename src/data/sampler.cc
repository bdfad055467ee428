#include "lockstep/data/sampler.h"

#include <algorithm>
#include <numeric>
#include <string>

#include "lockstep/error.h"

namespace lockstep::data {
namespace {

__extension__ typedef unsigned __int128 uint128;  // GCC/Clang; for the 64x64->128 multiply

std::uint64_t splitmix64(std::uint64_t& x) {
  std::uint64_t z = (x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// xoshiro256** seeded through SplitMix64: small, fast, and specified, so every platform and
// standard library draws the same numbers.
class Generator {
 public:
  Generator(std::uint64_t seed, std::uint64_t stream) {
    std::uint64_t x = seed ^ (stream * 0xD1B54A32D192ED03ull);
    for (auto& word : s_) word = splitmix64(x);
  }
  std::uint64_t next() {
    std::uint64_t result = rotl(s_[1] * 5, 7) * 9, t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  // Uniform in [0, bound) without modulo bias (Lemire's method).
  std::uint64_t below(std::uint64_t bound) {
    uint128 m = static_cast<uint128>(next()) * bound;
    auto low = static_cast<std::uint64_t>(m);
    if (low < bound) {
      std::uint64_t threshold = -bound % bound;
      while (low < threshold) {
        m = static_cast<uint128>(next()) * bound;
        low = static_cast<std::uint64_t>(m);
      }
    }
    return static_cast<std::uint64_t>(m >> 64);
  }

 private:
  static std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::uint64_t s_[4];
};

}  // namespace

std::vector<std::size_t> epoch_permutation(std::size_t n, std::uint64_t seed, std::uint64_t epoch) {
  std::vector<std::size_t> p(n);
  std::iota(p.begin(), p.end(), std::size_t{0});
  Generator g(seed, epoch);
  for (std::size_t i = n; i > 1; --i) std::swap(p[i - 1], p[g.below(i)]);
  return p;
}

DistributedSampler::DistributedSampler(std::size_t dataset_size, int rank, int world_size, bool shuffle,
                                       std::uint64_t seed, bool drop_last)
    : dataset_size_(dataset_size),
      rank_(rank),
      world_size_(world_size),
      shuffle_(shuffle),
      drop_last_(drop_last),
      seed_(seed) {
  if (world_size < 1)
    throw ConfigError("DistributedSampler: world_size must be >= 1, got " + std::to_string(world_size));
  if (rank < 0 || rank >= world_size)
    throw ConfigError("DistributedSampler: rank " + std::to_string(rank) + " is not in 0.." +
                      std::to_string(world_size - 1));
  build();
}

void DistributedSampler::set_epoch(std::uint64_t epoch) {
  state_ = SamplerState{epoch, 0, 0};
  build();
}

void DistributedSampler::build() {
  std::vector<std::size_t> order;
  if (shuffle_) {
    order = epoch_permutation(dataset_size_, seed_, state_.epoch);
  } else {
    order.resize(dataset_size_);
    std::iota(order.begin(), order.end(), std::size_t{0});
  }
  // What the old world took of this epoch is gone; the rest is dealt over this world.
  const std::size_t offset = std::min(state_.offset, dataset_size_), rest = dataset_size_ - offset;
  const auto r = static_cast<std::size_t>(world_size_);
  num_samples_ = drop_last_ ? rest / r : (rest + r - 1) / r;
  const std::size_t total = num_samples_ * r;
  indices_.clear();
  indices_.reserve(num_samples_);
  for (std::size_t g = static_cast<std::size_t>(rank_); g < total; g += r)
    indices_.push_back(order[offset + g % rest]);  // g >= rest only when padding: repeat from the start
}

std::vector<std::size_t> DistributedSampler::remaining() const {
  return std::vector<std::size_t>(indices_.begin() + static_cast<std::ptrdiff_t>(state_.position),
                                  indices_.end());
}

std::vector<std::size_t> DistributedSampler::take(std::size_t n) {
  std::size_t end = std::min(indices_.size(), state_.position + n);
  std::vector<std::size_t> out(indices_.begin() + static_cast<std::ptrdiff_t>(state_.position),
                               indices_.begin() + static_cast<std::ptrdiff_t>(end));
  state_.position = end;
  return out;
}

bool DistributedSampler::is_padding(std::size_t k) const {
  return !drop_last_ && static_cast<std::size_t>(rank_) + k * static_cast<std::size_t>(world_size_) >=
                            dataset_size_ - std::min(state_.offset, dataset_size_);
}

std::size_t DistributedSampler::real_count() const {
  std::size_t n = 0;
  for (std::size_t k = 0; k < num_samples_; ++k) n += is_padding(k) ? 0 : 1;
  return n;
}

void DistributedSampler::load_state(const SamplerState& state) {
  if (state.offset > dataset_size_)
    throw ConfigError("DistributedSampler: saved offset " + std::to_string(state.offset) + " is past the " +
                      std::to_string(dataset_size_) + " samples of the dataset: the checkpoint was made for another "
                      "dataset size");
  if (state.epoch != state_.epoch || state.offset != state_.offset) {
    state_.epoch = state.epoch;
    state_.offset = state.offset;
    build();
  }
  if (state.position > num_samples_)
    throw ConfigError("DistributedSampler: saved position " + std::to_string(state.position) +
                      " is past the " + std::to_string(num_samples_) +
                      " indices of an epoch: the checkpoint was made for another "
                      "dataset size or world size");
  state_.position = state.position;
}

std::size_t consumed_in_epoch(const SamplerState& state, int world, std::size_t dataset_size) {
  return std::min(dataset_size, state.offset + state.position * static_cast<std::size_t>(world));
}

}  // namespace lockstep::data
