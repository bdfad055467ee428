// int8 between machines (see ddp/compression.h), one share of a bucket at a time.
//
// Per call: x = share + error; per chunk of kChunk elements a scale s = max |x| / 127 and
// q = round(x / s) in [-127, 127]; error = x - q s. The holders all-gather (scales, q) and each
// sums every machine's q s in machine order, so every machine gets the same bits. On the wire:
// count + 4 count / kChunk bytes per machine, against 4 count for float32.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <vector>

#include "codecs.h"

#ifdef __FAST_MATH__
#error "int8_codec.cc rounds through IEEE float addition: build it without -ffast-math"
#endif

namespace lockstep::ddp_detail {
namespace {

constexpr std::size_t kChunk = 1024;

class Int8Codec final : public BucketCodec {
 public:
  void operator()(float* share, std::size_t first, std::size_t count, comm::Across& across) override {
    const int machines = across.machines();
    if (machines >= kInt8MaxMachines) {
      across.sum(share, count, comm::DType::f32);
      bytes_across_ = std::uint64_t(allreduce_bytes_sent(4.0 * double(count), machines));
      return;
    }
    std::vector<float>& error = errors_[first];
    error.resize(count, 0.0f);
    const std::size_t chunks = (count + kChunk - 1) / kChunk;
    const std::size_t message = (chunks * sizeof(float) + count + 3) / 4 * 4;
    mine_.resize(message);
    all_.resize(message * std::size_t(machines));
    quantize(share, error.data(), count, mine_.data());
    across.gather(mine_.data(), all_.data(), message);
    std::fill(share, share + count, 0.0f);
    for (int m = 0; m < machines; ++m) add_dequantized(all_.data() + std::size_t(m) * message, count, share);
    bytes_across_ = std::uint64_t(allgather_bytes_sent(double(message), machines));
  }

  CodecReport report() const override { return {"int8", "", bytes_across_}; }

 private:
  // std::nearbyint for |x| <= 2^22 under the default rounding: adding 1.5 * 2^23 leaves no
  // fraction bits, so the sum is rounded to an integer, half to even. Inline arithmetic where
  // nearbyint is a libm call per element on a target without a rounding instruction.
  static float round_to_even(float x) {
    constexpr float kShift = 12582912.0f;
    return (x + kShift) - kShift;
  }

  // message: the chunks' scales (float), then one int8 per element. Leaves the new error.
  static void quantize(const float* share, float* error, std::size_t count, char* message) {
    const std::size_t chunks = (count + kChunk - 1) / kChunk;
    auto* scales = reinterpret_cast<float*>(message);
    auto* q = reinterpret_cast<std::int8_t*>(message + chunks * sizeof(float));
    for (std::size_t c = 0; c < chunks; ++c) {
      const std::size_t lo = c * kChunk, hi = std::min(count, lo + kChunk);
      float largest = 0;
      for (std::size_t i = lo; i < hi; ++i) {
        error[i] += share[i];  // x, held in error until the residual replaces it
        largest = std::max(largest, std::fabs(error[i]));
      }
      const float scale = largest / 127.0f;
      const float inverse = scale > 0 ? 1.0f / scale : 0.0f;
      for (std::size_t i = lo; i < hi; ++i) {
        const float level = round_to_even(std::clamp(error[i] * inverse, -127.0f, 127.0f));
        q[i] = static_cast<std::int8_t>(level);
        error[i] -= level * scale;
      }
      std::memcpy(scales + c, &scale, sizeof(float));
    }
  }

  static void add_dequantized(const char* message, std::size_t count, float* out) {
    const std::size_t chunks = (count + kChunk - 1) / kChunk;
    const auto* scales = reinterpret_cast<const float*>(message);
    const auto* q = reinterpret_cast<const std::int8_t*>(message + chunks * sizeof(float));
    for (std::size_t c = 0; c < chunks; ++c) {
      const std::size_t lo = c * kChunk, hi = std::min(count, lo + kChunk);
      const float scale = scales[c];
      for (std::size_t i = lo; i < hi; ++i) out[i] += float(q[i]) * scale;
    }
  }

  std::map<std::size_t, std::vector<float>> errors_;  // by the share's first element
  std::vector<char> mine_, all_;                      // this machine's message; every machine's
  std::uint64_t bytes_across_ = 0;
};

}  // namespace

std::shared_ptr<BucketCodec> make_int8_codec() {
  return std::make_shared<Int8Codec>();
}

}  // namespace lockstep::ddp_detail
