#include "lockstep/comm/types.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "lockstep/error.h"

namespace lockstep::comm {
namespace {

TEST(Types, EveryF16ValueRoundTripsThroughF32) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    float f = f16_to_f32(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(f32_to_f16(f), h) << "half bits " << h << " -> " << f;
  }
}

TEST(Types, EveryBf16ValueRoundTripsThroughF32) {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    float f = bf16_to_f32(static_cast<std::uint16_t>(b));
    if (std::isnan(f)) continue;
    EXPECT_EQ(f32_to_bf16(f), b);
  }
}

TEST(Types, F16RoundsToNearestEvenAndSaturatesToInfinity) {
  EXPECT_EQ(f16_to_f32(f32_to_f16(1.0f + 1.0f / 4096)), 1.0f);                // below half an ulp
  EXPECT_EQ(f16_to_f32(f32_to_f16(1.0f + 3.0f / 2048)), 1.0f + 2.0f / 1024);  // tie to even
  EXPECT_TRUE(std::isinf(f16_to_f32(f32_to_f16(1e6f))));
  EXPECT_EQ(f16_to_f32(f32_to_f16(5.96e-8f)), std::ldexp(1.0f, -24));  // smallest subnormal
}

// avg's division: each float as if divided exactly and rounded once; integers toward zero.
TEST(Types, DivideElementsRoundsFloatsOnceAndTruncatesIntegers) {
  std::vector<float> f(4096);
  for (std::size_t i = 0; i < f.size(); ++i) f[i] = std::ldexp(1.0f + float(i) / 4096, int(i % 40) - 20);
  f.push_back(std::ldexp(1.5f, -125));  // divided by 4: a subnormal result
  for (int by : {3, 4}) {  // a power of two takes the multiplying path
    auto divided = f;
    divide_elements(DType::f32, divided.data(), divided.size(), by);
    for (std::size_t i = 0; i < f.size(); ++i)
      ASSERT_EQ(divided[i], static_cast<float>(double(f[i]) / by)) << i << " / " << by;
  }
  std::int32_t ints[] = {7, -7, 6};
  divide_elements(DType::i32, ints, 3, 2);
  EXPECT_EQ(ints[0], 3);
  EXPECT_EQ(ints[1], -3);
  EXPECT_EQ(ints[2], 3);
  std::uint16_t half = f32_to_bf16(6.0f);
  divide_elements(DType::bf16, &half, 1, 4);
  EXPECT_EQ(bf16_to_f32(half), 1.5f);
}

TEST(Types, ParseNamesAndRejectUnknownOnes) {
  EXPECT_EQ(parse_dtype("bfloat16"), DType::bf16);
  EXPECT_EQ(parse_reduce_op("max"), ReduceOp::max);
  EXPECT_THROW(parse_dtype("f8"), ConfigError);
  EXPECT_THROW(parse_reduce_op("prod"), ConfigError);
}

}  // namespace
}  // namespace lockstep::comm
