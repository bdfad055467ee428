// causal_softmax_dropout's kernels (attention_kernels.h), built as gelu_kernels.cc is, one copy
// per instruction set, each row's loops in vectors of 16 floats (lanes.h: a row of attention scores
// is a few vectors long), the random bits among them.
#include "attention_kernels.h"

#include <algorithm>
#include <limits>

#include "bf16_bits.h"
#include "dropout_hash.h"
#include "dropout_lanes.h"
#include "kernel_clones.h"
#include "lanes.h"
#include "vector_math.h"

namespace lockstep::models::kernels {
namespace {

// The mask's factor for the 16 elements from index `first`: drop.kept or 0.
template <bool dropout>
LOCKSTEP_INLINE Floats mask_at(const DropoutBits& drop, std::uint64_t first) {
  if constexpr (!dropout) {
    return splat<Floats>(1.0f);
  } else {
    return kept_lanes(drop, first) ? splat<Floats>(drop.kept) : Floats{};
  }
}

// A row's loops go over whole vectors of 16 keys up to the last the query sees, those past it
// masked by selects; the last vector of a row whose length is not a multiple of 16 is loaded and
// stored in part (lanes_at).

// The keys the row's loops go over: what the query sees, rounded up to whole vectors within the row.
LOCKSTEP_INLINE std::int64_t span_of(std::int64_t visible, std::int64_t width) {
  return std::min(width, (visible + kLanes - 1) / kLanes * kLanes);
}

// Lanes of the vector at key c that the query sees (all ones), of `visible`.
LOCKSTEP_INLINE Ints seen(std::int64_t c, std::int64_t visible) {
  return lane_index() + static_cast<std::int32_t>(c) < static_cast<std::int32_t>(visible);
}

// The row's exp(scale * (s - the largest score it sees)) over its span in e, 0 for keys it does not
// see: the inverse of their sum.
template <class T>
LOCKSTEP_INLINE float exponentials(const T* s, std::int64_t visible, std::int64_t span, float scale, float* e) {
  const Floats none = splat<Floats>(-std::numeric_limits<float>::infinity());
  Floats top = none;
  for (std::int64_t c = 0; c < span; c += kLanes) {
    const Floats x = seen(c, visible) ? load(s + c, lanes_at(c, span)) : none;
    top = top < x ? x : top;
  }
  const Floats largest = splat<Floats>(max_of(top));
  Floats sum{};
  for (std::int64_t c = 0; c < span; c += kLanes) {
    const Floats x = exp_clamped(clamp88((load(s + c, lanes_at(c, span)) - largest) * scale));
    const Floats kept = seen(c, visible) ? x : Floats{};
    store(e + c, kept, lanes_at(c, span));
    sum += kept;
  }
  return 1.0f / sum_of(sum);
}

// The row's P (as its type rounds it) and Y over its span (p may be y: Y is stored last). e: the
// row's exponentials, then free.
template <bool dropout, class T>
LOCKSTEP_INLINE void forward_row(const T* s, T* p, T* y, std::uint64_t first, std::int64_t visible,
                                 std::int64_t span, float scale, const DropoutBits& drop, float* e) {
  const float inverse = exponentials(s, visible, span, scale, e);
  for (std::int64_t c = 0; c < span; c += kLanes) {
    const std::int64_t n = lanes_at(c, span);
    const Floats probability = rounded_to<T>(load(e + c, n) * inverse);
    store(p + c, probability, n);
    store(y + c, probability * mask_at<dropout>(drop, first + c), n);
  }
}

// forward_row's Y and backward_row's ds from the row's scores and dY, P made again as forward_row
// makes it but never stored: those two's expressions, in one pass less. e: the exponentials, then
// P; g: dP.
template <bool dropout, class T>
LOCKSTEP_INLINE void rebuilt_backward_row(const T* s, const T* dy, T* y, T* ds, std::uint64_t first,
                                          std::int64_t visible, std::int64_t span, float scale,
                                          const DropoutBits& drop, float* e, float* g) {
  const float inverse = exponentials(s, visible, span, scale, e);
  Floats dot{};
  for (std::int64_t c = 0; c < span; c += kLanes) {
    const std::int64_t n = lanes_at(c, span);
    const Floats probability = rounded_to<T>(load(e + c, n) * inverse), mask = mask_at<dropout>(drop, first + c);
    store(y + c, probability * mask, n);
    const Floats dp = rounded_to<T>(load(dy + c, n) * mask);
    store(e + c, probability, n);
    store(g + c, dp, n);
    dot += dp * probability;
  }
  const Floats total = splat<Floats>(sum_of(dot));
  for (std::int64_t c = 0; c < span; c += kLanes) {
    const std::int64_t n = lanes_at(c, span);
    store(ds + c, load(e + c, n) * (load(g + c, n) - total) * scale, n);
  }
}

// The row's ds from dY and P over its span (P is 0 past what the query sees, and so is ds). g: dP,
// then free.
template <bool dropout, class T>
LOCKSTEP_INLINE void backward_row(const T* dy, const T* p, T* ds, std::uint64_t first, std::int64_t span,
                                  float scale, const DropoutBits& drop, float* g) {
  Floats dot{};
  for (std::int64_t c = 0; c < span; c += kLanes) {
    const std::int64_t n = lanes_at(c, span);
    const Floats dp = rounded_to<T>(load(dy + c, n) * mask_at<dropout>(drop, first + c));
    store(g + c, dp, n);
    dot += dp * load(p + c, n);
  }
  const Floats total = splat<Floats>(sum_of(dot));
  for (std::int64_t c = 0; c < span; c += kLanes) {
    const std::int64_t n = lanes_at(c, span);
    store(ds + c, load(p + c, n) * (load(g + c, n) - total) * scale, n);
  }
}

// Row r of the block: where it starts in the block, its first element's index in the whole
// scores, how many keys it sees. (Plain loops below, not a lambda: a lambda would be compiled
// once, for the baseline instruction set, outside each copy made for the CPU's.)
struct CausalRow {
  std::int64_t at;
  std::uint64_t first;
  std::int64_t visible, span;
};

LOCKSTEP_INLINE CausalRow causal_row(std::int64_t first_row, std::int64_t r, const ScoreRows& block) {
  const std::int64_t index = first_row + r, head = index / block.queries;
  const std::int64_t query = block.first_query + index % block.queries, visible = query + 1;
  return {r * block.width, static_cast<std::uint64_t>((head * block.t + query) * block.t), visible,
          span_of(visible, block.width)};
}

// Zeros past the row's span.
template <class T>
LOCKSTEP_INLINE void zero_past_span(T* out, const CausalRow& row, std::int64_t width) {
  std::fill(out + row.at + row.span, out + row.at + width, T{});
}

template <bool dropout, class T>
LOCKSTEP_INLINE void forward_rows(const T* s, T* p, T* y, std::int64_t first_row, std::int64_t rows,
                                  const ScoreRows& block, float scale, const DropoutBits& drop, float* scratch) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const CausalRow row = causal_row(first_row, r, block);
    forward_row<dropout>(s + row.at, p + row.at, y + row.at, row.first, row.visible, row.span, scale, drop, scratch);
    zero_past_span(p, row, block.width);
    zero_past_span(y, row, block.width);
  }
}

template <bool dropout, class T>
LOCKSTEP_INLINE void backward_rows(const T* dy, const T* p, T* ds, std::int64_t first_row, std::int64_t rows,
                                   const ScoreRows& block, float scale, const DropoutBits& drop, float* scratch) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const CausalRow row = causal_row(first_row, r, block);
    backward_row<dropout>(dy + row.at, p + row.at, ds + row.at, row.first, row.span, scale, drop, scratch);
    zero_past_span(ds, row, block.width);
  }
}

template <bool dropout, class T>
LOCKSTEP_INLINE void rebuilt_backward_rows(const T* s, const T* dy, T* y, T* ds, std::int64_t first_row,
                                           std::int64_t rows, const ScoreRows& block, float scale,
                                           const DropoutBits& drop, float* scratch) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const CausalRow row = causal_row(first_row, r, block);
    rebuilt_backward_row<dropout>(s + row.at, dy + row.at, y + row.at, ds + row.at, row.first, row.visible, row.span,
                                  scale, drop, scratch, scratch + block.width);
    zero_past_span(y, row, block.width);
    zero_past_span(ds, row, block.width);
  }
}

template <class T>
LOCKSTEP_INLINE void forward(const T* s, T* p, T* y, std::int64_t first_row, std::int64_t rows,
                             const ScoreRows& block, float scale, const DropoutBits& drop, float* scratch) {
  if (drop.threshold == 0) return forward_rows<false>(s, p, y, first_row, rows, block, scale, drop, scratch);
  forward_rows<true>(s, p, y, first_row, rows, block, scale, drop, scratch);
}

template <class T>
LOCKSTEP_INLINE void backward(const T* dy, const T* p, T* ds, std::int64_t first_row, std::int64_t rows,
                              const ScoreRows& block, float scale, const DropoutBits& drop, float* scratch) {
  if (drop.threshold == 0) return backward_rows<false>(dy, p, ds, first_row, rows, block, scale, drop, scratch);
  backward_rows<true>(dy, p, ds, first_row, rows, block, scale, drop, scratch);
}

template <class T>
LOCKSTEP_INLINE void rebuilt_backward(const T* s, const T* dy, T* y, T* ds, std::int64_t first_row, std::int64_t rows,
                                      const ScoreRows& block, float scale, const DropoutBits& drop, float* scratch) {
  if (drop.threshold == 0)
    return rebuilt_backward_rows<false>(s, dy, y, ds, first_row, rows, block, scale, drop, scratch);
  rebuilt_backward_rows<true>(s, dy, y, ds, first_row, rows, block, scale, drop, scratch);
}

}  // namespace

LOCKSTEP_CLONES void causal_softmax_dropout_forward(const float* s, float* p, float* y, std::int64_t first_row,
                                                    std::int64_t rows, const ScoreRows& block, float scale,
                                                    const DropoutBits& drop, float* scratch) {
  forward(s, p, y, first_row, rows, block, scale, drop, scratch);
}

LOCKSTEP_CLONES void causal_softmax_dropout_forward(const Bf16Bits* s, Bf16Bits* p, Bf16Bits* y,
                                                    std::int64_t first_row, std::int64_t rows, const ScoreRows& block,
                                                    float scale, const DropoutBits& drop, float* scratch) {
  forward(s, p, y, first_row, rows, block, scale, drop, scratch);
}

LOCKSTEP_CLONES void causal_softmax_dropout_backward(const float* dy, const float* p, float* ds,
                                                     std::int64_t first_row, std::int64_t rows, const ScoreRows& block,
                                                     float scale, const DropoutBits& drop, float* scratch) {
  backward(dy, p, ds, first_row, rows, block, scale, drop, scratch);
}

LOCKSTEP_CLONES void causal_softmax_dropout_backward(const Bf16Bits* dy, const Bf16Bits* p, Bf16Bits* ds,
                                                     std::int64_t first_row, std::int64_t rows, const ScoreRows& block,
                                                     float scale, const DropoutBits& drop, float* scratch) {
  backward(dy, p, ds, first_row, rows, block, scale, drop, scratch);
}

LOCKSTEP_CLONES void causal_softmax_dropout_rebuilt_backward(const float* s, const float* dy, float* y, float* ds,
                                                             std::int64_t first_row, std::int64_t rows,
                                                             const ScoreRows& block, float scale,
                                                             const DropoutBits& drop, float* scratch) {
  rebuilt_backward(s, dy, y, ds, first_row, rows, block, scale, drop, scratch);
}

LOCKSTEP_CLONES void causal_softmax_dropout_rebuilt_backward(const Bf16Bits* s, const Bf16Bits* dy, Bf16Bits* y,
                                                             Bf16Bits* ds, std::int64_t first_row, std::int64_t rows,
                                                             const ScoreRows& block, float scale,
                                                             const DropoutBits& drop, float* scratch) {
  rebuilt_backward(s, dy, y, ds, first_row, rows, block, scale, drop, scratch);
}

}  // namespace lockstep::models::kernels
