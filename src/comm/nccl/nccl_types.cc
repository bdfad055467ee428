#include "nccl_types.h"

#include "lockstep/error.h"

namespace lockstep::comm::nccl {

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
  }
  throw ConfigError("nccl: unknown element type");
}

Reduction nccl_reduction(ReduceOp op, DType dtype) {
  switch (op) {
    case ReduceOp::sum: return {ncclSum, false};
    case ReduceOp::avg: return is_integer(dtype) ? Reduction{ncclSum, true} : Reduction{ncclAvg, false};
    case ReduceOp::min: return {ncclMin, false};
    case ReduceOp::max: return {ncclMax, false};
    case ReduceOp::product: return {ncclProd, false};
    case ReduceOp::band:
    case ReduceOp::bor:
    case ReduceOp::bxor: break;
  }
  throw ConfigError(std::string("nccl: NCCL has no ") + reduce_op_name(op) +
                    " reduction; reduce on the host with another backend");
}

std::exception_ptr nccl_error(ncclResult_t result, const std::string& message) {
  switch (result) {
    case ncclRemoteError:
    case ncclSystemError: return std::make_exception_ptr(PeerError(message));
    case ncclInvalidArgument:
    case ncclInvalidUsage: return std::make_exception_ptr(ConfigError(message));
    default: return std::make_exception_ptr(SystemError(message));
  }
}

}  // namespace lockstep::comm::nccl
