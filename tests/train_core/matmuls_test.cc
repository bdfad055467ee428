// Model FLOPs and the bf16 advice: arithmetic whose right answer is known.
#include "lockstep/train_core/matmuls.h"

#include <gtest/gtest.h>

using lockstep::train::bf16_advice;
using lockstep::train::Matmul;
using lockstep::train::training_flops;

TEST(Matmuls, TrainingCostsTheForwardAndBothGradientProducts) {
  const Matmul p{3, 5, 7, 11};
  EXPECT_DOUBLE_EQ(p.forward_flops(), 2.0 * 3 * 5 * 7 * 11);
  // Backward's products multiply the same number of terms: each costs what the forward does.
  EXPECT_DOUBLE_EQ(p.input_gradient().forward_flops(), p.forward_flops());
  EXPECT_DOUBLE_EQ(p.weight_gradient().forward_flops(), p.forward_flops());
  EXPECT_EQ(p.input_gradient(), (Matmul{3, 5, 11, 7}));
  EXPECT_EQ(p.weight_gradient(), (Matmul{3, 7, 5, 11}));
  EXPECT_DOUBLE_EQ(training_flops({p, {1, 2, 4, 8}}), 3 * (p.forward_flops() + 2.0 * 2 * 4 * 8));
  EXPECT_DOUBLE_EQ(training_flops({}), 0);
}

TEST(Matmuls, Bf16IsAdvisedWithTheStepItWouldTakeOnlyWhereItMultipliesFaster) {
  // A 100 ms step, 80 of them forward and backward; bf16 multiplies 4x faster: 80 -> 20 ms.
  auto advice = bf16_advice(false, 100e9, 400e9, 0.100, 0.080);
  ASSERT_TRUE(advice);
  EXPECT_DOUBLE_EQ(advice->matmul_speedup, 4.0);
  EXPECT_NEAR(advice->predicted_speedup, 0.100 / 0.040, 1e-12);
  // Already bf16; no bf16 units (bf16 no faster, or slower); a rate not measured: nothing.
  EXPECT_FALSE(bf16_advice(true, 100e9, 400e9, 0.100, 0.080));
  EXPECT_FALSE(bf16_advice(false, 100e9, 110e9, 0.100, 0.080));
  EXPECT_FALSE(bf16_advice(false, 100e9, 20e9, 0.100, 0.080));
  EXPECT_FALSE(bf16_advice(false, 0, 400e9, 0.100, 0.080));
  EXPECT_FALSE(bf16_advice(false, 100e9, 0, 0.100, 0.080));
}
