#include "tensor_wire.h"

#include <optional>
#include <stdexcept>
#include <string>

#include "lockstep/ddp/comm_dtype.h"

namespace lockstep::torch_backend {
namespace {

constexpr std::int64_t kWordBytes = 4;

std::int64_t byte_count(const at::Tensor& t) {
  return t.numel() * static_cast<std::int64_t>(t.element_size());
}

WireSpec spec_of(WireKind kind, comm::DType dtype, at::ScalarType scalar, std::int64_t count) {
  WireSpec s;
  s.kind = kind;
  s.dtype = dtype;
  s.scalar = scalar;
  s.count = count;
  return s;
}

// A contiguous tensor's bytes, as a 1-D uint8 view of the same memory. as_strided: torch calls
// a tensor with one element (or none) contiguous whatever its stride, and view() wants stride 1.
at::Tensor bytes_view(const at::Tensor& contiguous) {
  return contiguous.as_strided({contiguous.numel()}, {1}).view(at::kByte);
}

}  // namespace

void check_cpu_dense(const at::Tensor& t, const char* collective) {
  if (!t.device().is_cpu())
    throw std::runtime_error(std::string("lockstep: ") + collective + " got a tensor on " + t.device().str() +
                                "; the lockstep backend moves CPU tensors (use nccl for GPU tensors)");
  if (t.layout() != at::kStrided)
    throw std::runtime_error(std::string("lockstep: ") + collective +
                                " got a sparse tensor; the lockstep backend moves dense tensors (call .to_dense())");
}

const char* reduce_op_name(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNKNOWN";
  }
}

comm::ReduceOp comm_op(const c10d::ReduceOp& op, const char* collective) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return comm::ReduceOp::sum;
    case c10d::ReduceOp::AVG: return comm::ReduceOp::avg;
    case c10d::ReduceOp::MIN: return comm::ReduceOp::min;
    case c10d::ReduceOp::MAX: return comm::ReduceOp::max;
    case c10d::ReduceOp::PRODUCT: return comm::ReduceOp::product;
    case c10d::ReduceOp::BAND: return comm::ReduceOp::band;
    case c10d::ReduceOp::BOR: return comm::ReduceOp::bor;
    case c10d::ReduceOp::BXOR: return comm::ReduceOp::bxor;
    default:
      throw std::runtime_error(std::string("lockstep: ") + collective + " with ReduceOp." + reduce_op_name(op) +
                                  " is not supported: lockstep reduces with SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR "
                                  "and BXOR. Use one of those, or run this call on a gloo group "
                                  "(dist.new_group(backend=\"gloo\"))");
  }
}

WireSpec reduce_spec(const at::Tensor& t, const c10d::ReduceOp& op, const char* collective) {
  check_cpu_dense(t, collective);
  const comm::ReduceOp how = comm_op(op, collective);
  const at::ScalarType type = t.scalar_type();
  const bool floating = at::isFloatingType(type) || at::isComplexType(type);
  if (comm::is_bitwise(how) && floating)
    throw std::runtime_error(std::string("lockstep: ") + collective + " with ReduceOp." + reduce_op_name(op) + " on a " +
                             std::string(c10::toString(type)) + " tensor: bitwise reductions apply to integer and bool tensors");
  if (auto native = comm_dtype_of(type)) return spec_of(WireKind::native, *native, type, t.numel());
  switch (type) {
    case at::kByte:
    case at::kChar:
    case at::kShort:
    case at::kBool: return spec_of(WireKind::widened, comm::DType::i32, at::kInt, t.numel());
    case at::kComplexFloat:
    case at::kComplexDouble: {
      if (how != comm::ReduceOp::sum && how != comm::ReduceOp::avg)
        throw std::runtime_error(std::string("lockstep: ") + collective + " with ReduceOp." + reduce_op_name(op) +
                                    " on a complex tensor: complex tensors reduce with SUM or AVG only (no order, "
                                    "no bits, and their product is not elementwise on the real and imaginary parts)");
      const bool single = type == at::kComplexFloat;
      return spec_of(WireKind::complex_pairs, single ? comm::DType::f32 : comm::DType::f64,
                     single ? at::kFloat : at::kDouble, 2 * t.numel());
    }
    default:
      throw std::runtime_error(std::string("lockstep: ") + collective + " cannot reduce " +
                                  std::string(c10::toString(type)) +
                                  " tensors: lockstep reduces float, double, half, bfloat16, int, long (and "
                                  "uint8, int8, int16, bool, complex through them); convert the tensor first");
  }
}

WireSpec move_spec(const at::Tensor& t) {
  const at::ScalarType type = t.scalar_type();
  if (auto native = comm_dtype_of(type)) return spec_of(WireKind::native, *native, type, t.numel());
  return bytes_spec(t);
}

WireSpec bytes_spec(const at::Tensor& t) {
  return spec_of(WireKind::bytes, comm::DType::i32, at::kInt, (byte_count(t) + kWordBytes - 1) / kWordBytes);
}

at::Tensor empty_wire(const WireSpec& spec, std::int64_t blocks) {
  return at::empty({spec.count * blocks}, at::TensorOptions().dtype(spec.scalar));
}

at::Tensor wire_block(const at::Tensor& wire, const WireSpec& spec, std::int64_t i) {
  return wire.narrow(0, i * spec.count, spec.count);
}

at::Tensor wire_view(const at::Tensor& t, const WireSpec& spec) {
  if (!t.is_contiguous()) return {};
  switch (spec.kind) {
    case WireKind::native: return t.reshape({-1});
    case WireKind::widened: return {};
    case WireKind::complex_pairs: return t.is_conj() ? at::Tensor() : at::view_as_real(t).reshape({-1});
    case WireKind::bytes: {
      const bool whole_words = byte_count(t) % kWordBytes == 0;
      const bool aligned = reinterpret_cast<std::uintptr_t>(t.data_ptr()) % kWordBytes == 0;
      return whole_words && aligned ? bytes_view(t).view(at::kInt) : at::Tensor();
    }
  }
  return {};
}

void pack(const at::Tensor& t, const WireSpec& spec, const at::Tensor& block) {
  switch (spec.kind) {
    case WireKind::native:
    case WireKind::widened: block.view(t.sizes()).copy_(t); return;
    case WireKind::complex_pairs: at::view_as_complex(block.view({-1, 2})).view(t.sizes()).copy_(t); return;
    case WireKind::bytes: {
      const std::int64_t n = byte_count(t);
      const at::Tensor dst = block.view(at::kByte);
      dst.narrow(0, 0, n).copy_(bytes_view(t.contiguous()));
      dst.narrow(0, n, dst.numel() - n).zero_();  // the padding, so every rank sends the same bytes
      return;
    }
  }
}

void unpack(const at::Tensor& block, const WireSpec& spec, const at::Tensor& t) {
  switch (spec.kind) {
    case WireKind::native:
    case WireKind::widened: t.copy_(block.view(t.sizes())); return;
    case WireKind::complex_pairs: t.copy_(at::view_as_complex(block.view({-1, 2})).view(t.sizes())); return;
    case WireKind::bytes: {
      const at::Tensor src = block.view(at::kByte).narrow(0, 0, byte_count(t));
      if (t.is_contiguous()) {
        bytes_view(t).copy_(src);
      } else {
        at::Tensor staged = at::empty(t.sizes(), t.options());
        bytes_view(staged).copy_(src);
        t.copy_(staged);
      }
      return;
    }
  }
}

Wire wire_of(const at::Tensor& t, const WireSpec& spec, bool fill) {
  if (at::Tensor view = wire_view(t, spec); view.defined()) return {view, false};
  Wire w{empty_wire(spec, 1), true};
  if (fill) pack(t, spec, w.buffer);
  return w;
}

}  // namespace lockstep::torch_backend
