// Element-wise reductions over several input buffers, used by the shm backend.
#pragma once

#include <cstddef>

#include "lockstep/comm/types.h"

namespace lockstep::comm {

// out[i] = op(inputs[0][i], ..., inputs[n-1][i]) for i < count, combining in input order so
// every rank that reduces the same inputs gets bitwise the same result. avg divides the sum by
// n (integer division for integer types). Half types are combined in f32 and rounded once.
// `out` may alias any input.
void reduce(DType dtype, ReduceOp op, void* out, const void* const* inputs, int n, std::size_t count);

}  // namespace lockstep::comm
