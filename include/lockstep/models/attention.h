// The attention probabilities and their dropout in one pass each way.
//
// Written as libtorch ops, causal attention's middle is five passes over the B x H x T x T scores
// forward (the scale and causal mask added, softmax, the dropout mask drawn, the product with
// it) and three back, with the mask kept in memory between. Here one kernel per row of scores
// finds the softmax over the keys the query may see, writes the probabilities (kept for
// backward) and their dropped copy together, and the backward makes one pass from the
// probabilities and the mask drawn again from its seed. The mask is fast_dropout's (dropout.h),
// from the same seed: the same elements are dropped as by fast_dropout(softmax(...)) from the
// same generator state. On the CPU in float32 and bf16 (autocast's), vectorized for AVX-512 and
// AVX2 and chosen at run time (src/models/attention_kernels.h says how it computes and rounds).
// Elsewhere (a GPU, other dtypes) it is the libtorch ops as written.
#pragma once

#include <torch/types.h>

namespace lockstep::models {

// fast_dropout(softmax(scale * scores + causal mask, -1), p, training) for scores [..., T, T]
// (query by key; query t sees keys 0..t), in scores' dtype. ConfigError for p outside [0, 1] or
// scores that are not square in their last two dimensions.
torch::Tensor causal_softmax_dropout(const torch::Tensor& scores, double scale, double p, bool training);

}  // namespace lockstep::models
