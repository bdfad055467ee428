// lockstep's element types, reductions and errors in NCCL's terms. Pure: tested without a GPU.
#pragma once

#include <nccl.h>

#include <exception>
#include <string>

#include "lockstep/comm/types.h"

namespace lockstep::comm::nccl {

ncclDataType_t nccl_type(DType dtype);

// How NCCL computes `op` on `dtype`: its operator, and whether the result is then divided by the
// world size on the host (avg on integers, which lockstep truncates toward zero). Throws
// ConfigError for the bitwise reductions, which NCCL lacks.
struct Reduction {
  ncclRedOp_t op;
  bool divide_after;
};
Reduction nccl_reduction(ReduceOp op, DType dtype);

// The lockstep error a failed NCCL call becomes: a peer's or the network's failure
// (ncclRemoteError, ncclSystemError) a PeerError, misuse (ncclInvalidArgument, ncclInvalidUsage)
// a ConfigError, anything else (CUDA, NCCL internals) a SystemError.
std::exception_ptr nccl_error(ncclResult_t result, const std::string& message);

}  // namespace lockstep::comm::nccl
