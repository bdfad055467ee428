// What the models' fused kernels with a dropout share with fast_dropout (dropout.h), so that their
// masks are its masks: the probability's check, its threshold and scale, and the seed. For the
// files with libtorch's headers (the kernels' own files take kernels::DropoutBits).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace lockstep::models {

// ConfigError unless p is within [0, 1].
void check_dropout_probability(double p);

// p as a threshold on 16 random bits: an element is kept when its bits reach it (65536 and above:
// none is).
std::uint32_t dropout_threshold(double p);

// The kept values' scale for a threshold below 65536: the inverse of the keep probability.
double dropout_scale(std::uint32_t threshold);

// `scale` as an element of `type` (float32 or bf16) holds it, back in float: the kept values'
// factor the fused kernels multiply by, fast_dropout's mask element.
float dropout_scale_in(at::ScalarType type, double scale);

// The next mask's seed on this thread: from the innermost DropoutSeeds, else the default CPU
// generator (one draw).
std::uint64_t next_dropout_seed();

}  // namespace lockstep::models
