// Reference values for checking collectives: inputs every rank can compute alone, the exact
// result of reducing them, and how far a result of each dtype may be from it. The conformance
// tests and `lockstep bench allreduce` both check against these.
#pragma once

#include <cstddef>

#include "lockstep/comm/types.h"

namespace lockstep::comm::reference {

// Rank `rank`'s element i: a small signed integer (-4..8), exact in every dtype; sums over up
// to 64 ranks stay exact in f16 and bf16 too.
double input(int rank, std::size_t i);

// The exact reduction of element i over ranks 0..world-1 (avg of integer dtypes truncates
// toward zero, as the backends do).
double reduced(ReduceOp op, DType dtype, int world, std::size_t i);

// The largest distance from `exact` a correct result of `dtype` may have. Integers and sums of
// these inputs are exact; an avg is divided in f32 (f64 for f64) and rounded once to the
// dtype, so its error stays below one unit in the last place of the dtype: 2^-10 relative for
// f16, 2^-7 for bf16, 2^-22 for f32, 2^-50 for f64.
double tolerance(DType dtype, double exact);

}  // namespace lockstep::comm::reference
