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
//
// causal_attention_in_strips is the whole of causal attention built on the same kernels without
// ever holding the B x H x T x T scores: the queries go in strips of a few rows, each strip's
// scores against only the keys it may see (the products batched over the heads), its
// probabilities made, dropped and multiplied by the values, then let go. Backward makes each strip
// again from q and k (the same products and expressions as the forward's), its dropped
// probabilities and its scores' gradient in one pass over the strip, and sums the keys' and
// values' gradients over the strips in float32 (each strip's part rounded to the dtype by its
// product first, so bf16's error grows with the number of strips). What it keeps for backward is
// q, k and v: memory linear in T where the stepwise attention keeps two T x T tensors per layer,
// and half the scores' products at long contexts (a strip skips the keys after its last query).
#pragma once

#include <torch/types.h>

namespace lockstep::models {

// fast_dropout(softmax(scale * scores + causal mask, -1), p, training) for scores [..., T, T]
// (query by key; query t sees keys 0..t), in scores' dtype. ConfigError for p outside [0, 1] or
// scores that are not square in their last two dimensions.
torch::Tensor causal_softmax_dropout(const torch::Tensor& scores, double scale, double p, bool training);

// fast_dropout(softmax(scale * q k^T + causal mask), p, training) v for q, k, v [..., T, d] (the
// same leading dimensions and T; v's last may differ), with the mask drawn as
// causal_softmax_dropout draws it from the same generator state. In q's dtype, or autocast's bf16
// where CPU autocast is on. strip_rows: about how many queries per strip (at least 8, at most T;
// the strips' sizes evened out), 0 for the default (128, fewer where a strip would pass 4M scores).
// On the CPU in float32 and bf16; elsewhere the stepwise ops with causal_softmax_dropout.
// ConfigError for p outside [0, 1] or mismatched shapes.
torch::Tensor causal_attention_in_strips(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                         double scale, double p, bool training, std::int64_t strip_rows = 0);

}  // namespace lockstep::models
