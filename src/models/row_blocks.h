// The rows of a matrix in at::parallel_for's blocks, for the fused kernels' autograd functions.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace lockstep::models {

// f(row_begin, row_end) over the rows of a rows x cols matrix, in blocks of about 32K elements.
template <class F>
void for_row_blocks(std::int64_t rows, std::int64_t cols, const F& f) {
  const std::int64_t grain = std::max<std::int64_t>(1, 32768 / cols);
  at::parallel_for(0, rows, grain, f);
}

}  // namespace lockstep::models
