// The CPU kernels of causal_softmax_dropout and causal_attention_in_strips (attention.h): over
// rows of attention scores, each one query's scores against keys 0..width-1 (ScoreRows says which
// query), which sees the keys at positions 0..query,
//   P = softmax(scale * s) over the keys it sees, 0 over the rest,
//   Y = P * mask, the mask fast_dropout's (dropout_hash.h) for the element's index in the whole
//       B x H x T x T scores: kept (times `kept`) when its 16 random bits reach `threshold`, else 0,
// and back, from dY and the P kept by the forward (the mask drawn again from its seed):
//   dP = dY * mask,  ds = scale * P (dP - sum over the row of P dP).
// In float or bf16 (as its bits): computed in float, rounded where libtorch's separate ops round
// (P; the product with the mask; ds), so that the results are theirs within one rounding.
// Torch-free, so that this file is compiled with the vectorizer's options (one copy per
// instruction set, chosen when the program starts) without libtorch's headers.
#pragma once

#include <cstdint>

#include "bf16_bits.h"
#include "dropout_hash.h"

namespace lockstep::models::kernels {

// Where a block of score rows lies in the whole scores: `queries` rows per head, for the queries
// from `first_query`, each `width` keys wide (at least first_query + queries), heads one after
// another; sequences of t queries and t keys. The whole [..., T, T] tensor is {t, 0, t, t}; a strip
// of queries against the keys they may see is {t, first, n, first + n}.
struct ScoreRows {
  std::int64_t t, first_query, queries, width;
};

// Rows [first_row, first_row + rows) of the block, at s, p, y (each the first of those rows; p may
// be y, for Y alone). scratch: block.width floats.
void causal_softmax_dropout_forward(const float* s, float* p, float* y, std::int64_t first_row, std::int64_t rows,
                                    const ScoreRows& block, float scale, const DropoutBits& drop, float* scratch);
void causal_softmax_dropout_forward(const Bf16Bits* s, Bf16Bits* p, Bf16Bits* y, std::int64_t first_row,
                                    std::int64_t rows, const ScoreRows& block, float scale, const DropoutBits& drop,
                                    float* scratch);

void causal_softmax_dropout_backward(const float* dy, const float* p, float* ds, std::int64_t first_row,
                                     std::int64_t rows, const ScoreRows& block, float scale, const DropoutBits& drop,
                                     float* scratch);
void causal_softmax_dropout_backward(const Bf16Bits* dy, const Bf16Bits* p, Bf16Bits* ds, std::int64_t first_row,
                                     std::int64_t rows, const ScoreRows& block, float scale, const DropoutBits& drop,
                                     float* scratch);

// The forward's Y and the backward's ds at once, from the rows' scores s and dY (P made again and
// never stored), for a backward that did not keep P: the two kernels above's expressions.
// scratch: 2 x block.width floats.
void causal_softmax_dropout_rebuilt_backward(const float* s, const float* dy, float* y, float* ds,
                                             std::int64_t first_row, std::int64_t rows, const ScoreRows& block,
                                             float scale, const DropoutBits& drop, float* scratch);
void causal_softmax_dropout_rebuilt_backward(const Bf16Bits* s, const Bf16Bits* dy, Bf16Bits* y, Bf16Bits* ds,
                                             std::int64_t first_row, std::int64_t rows, const ScoreRows& block,
                                             float scale, const DropoutBits& drop, float* scratch);

}  // namespace lockstep::models::kernels
