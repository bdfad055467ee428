#include "lockstep/comm/types.h"

#include <cstring>
#include <sstream>

#include "backend.h"
#include "lockstep/error.h"

namespace lockstep::comm {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
  }
  return "?";
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::min: return "min";
    case ReduceOp::max: return "max";
    case ReduceOp::product: return "product";
    case ReduceOp::band: return "band";
    case ReduceOp::bor: return "bor";
    case ReduceOp::bxor: return "bxor";
  }
  return "?";
}

DType parse_dtype(const std::string& name) {
  if (name == "f32" || name == "float32" || name == "float") return DType::f32;
  if (name == "f64" || name == "float64" || name == "double") return DType::f64;
  if (name == "f16" || name == "float16" || name == "half") return DType::f16;
  if (name == "bf16" || name == "bfloat16") return DType::bf16;
  if (name == "i32" || name == "int32" || name == "int") return DType::i32;
  if (name == "i64" || name == "int64" || name == "long") return DType::i64;
  throw ConfigError("unknown dtype '" + name + "': use f32, f64, f16, bf16, i32 or i64");
}

ReduceOp parse_reduce_op(const std::string& name) {
  for (ReduceOp op : kAllReduceOps)
    if (name == reduce_op_name(op)) return op;
  throw ConfigError("unknown reduce op '" + name + "': use sum, avg, min, max, product, band, bor or bxor");
}

float f16_to_f32(std::uint16_t h) {
  std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1Fu;
  std::uint32_t mant = h & 0x3FFu;
  std::uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int shift = 0;
    while (!(mant & 0x400u)) {
      mant <<= 1;
      ++shift;
    }
    mant &= 0x3FFu;
    bits = sign | (static_cast<std::uint32_t>(113 - shift) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

std::uint16_t f32_to_f16(float f) {
  std::uint32_t x;
  std::memcpy(&x, &f, 4);
  std::uint32_t sign = (x >> 16) & 0x8000u;
  std::uint32_t abs = x & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<std::uint16_t>(sign | 0x7E00u);   // nan
  if (abs >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // overflow -> inf
  if (abs < 0x38800000u) {                                                    // result is subnormal or zero
    if (abs < 0x33000000u) return static_cast<std::uint16_t>(sign);
    std::uint32_t exp = abs >> 23;
    std::uint32_t mant = (abs & 0x7FFFFFu) | 0x800000u;
    std::uint32_t shift = 126 - exp;  // 14 + (113 - exp) - 1
    std::uint32_t half = mant >> shift;
    std::uint32_t rem = mant & ((1u << shift) - 1);
    std::uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<std::uint16_t>(sign | half);
  }
  std::uint32_t rounded = abs + 0xFFFu + ((abs >> 13) & 1u);  // round to nearest even
  return static_cast<std::uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

std::uint16_t f32_to_bf16(float f) {
  std::uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
  x += 0x7FFFu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>(x >> 16);
}

double load_element(DType t, const void* buf, std::size_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(buf)[i];
    case DType::f64: return static_cast<const double*>(buf)[i];
    case DType::f16: return f16_to_f32(static_cast<const std::uint16_t*>(buf)[i]);
    case DType::bf16: return bf16_to_f32(static_cast<const std::uint16_t*>(buf)[i]);
    case DType::i32: return static_cast<const std::int32_t*>(buf)[i];
    case DType::i64: return static_cast<double>(static_cast<const std::int64_t*>(buf)[i]);
  }
  return 0;
}

void store_element(DType t, void* buf, std::size_t i, double v) {
  switch (t) {
    case DType::f32: static_cast<float*>(buf)[i] = static_cast<float>(v); return;
    case DType::f64: static_cast<double*>(buf)[i] = v; return;
    case DType::f16: static_cast<std::uint16_t*>(buf)[i] = f32_to_f16(static_cast<float>(v)); return;
    case DType::bf16: static_cast<std::uint16_t*>(buf)[i] = f32_to_bf16(static_cast<float>(v)); return;
    case DType::i32: static_cast<std::int32_t*>(buf)[i] = static_cast<std::int32_t>(v); return;
    case DType::i64: static_cast<std::int64_t*>(buf)[i] = static_cast<std::int64_t>(v); return;
  }
}

namespace {
template <typename T, typename D>
void divide_each(T* out, std::size_t count, D by) {
  for (std::size_t i = 0; i < count; ++i) out[i] = static_cast<T>(out[i] / by);
}

// Floats: by a power of two, multiplying by its inverse is the same rounding of the same
// quotient, and several times faster than dividing.
template <typename T>
void divide_each_float(T* out, std::size_t count, int by) {
  if ((by & (by - 1)) != 0) return divide_each(out, count, static_cast<T>(by));
  const T inverse = T(1) / static_cast<T>(by);
  for (std::size_t i = 0; i < count; ++i) out[i] *= inverse;
}

template <float (*Load)(std::uint16_t), std::uint16_t (*Store)(float)>
void divide_each_half(std::uint16_t* out, std::size_t count, float by) {
  for (std::size_t i = 0; i < count; ++i) out[i] = Store(Load(out[i]) / by);
}
}  // namespace

void divide_elements(DType t, void* buf, std::size_t count, int by) {
  switch (t) {
    case DType::f32: return divide_each_float(static_cast<float*>(buf), count, by);
    case DType::f64: return divide_each_float(static_cast<double*>(buf), count, by);
    case DType::i32: return divide_each(static_cast<std::int32_t*>(buf), count, by);
    case DType::i64: return divide_each(static_cast<std::int64_t*>(buf), count, std::int64_t{by});
    case DType::f16:
      return divide_each_half<f16_to_f32, f32_to_f16>(static_cast<std::uint16_t*>(buf), count, float(by));
    case DType::bf16:
      return divide_each_half<bf16_to_f32, f32_to_bf16>(static_cast<std::uint16_t*>(buf), count, float(by));
  }
}

const char* collective_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::allreduce: return "allreduce";
    case CollectiveKind::broadcast: return "broadcast";
    case CollectiveKind::allgather: return "allgather";
    case CollectiveKind::reduce_scatter: return "reduce_scatter";
    case CollectiveKind::barrier: return "barrier";
  }
  return "?";
}

namespace {
constexpr int kCountBits = 40;

std::string describe_fields(CollectiveKind kind, std::size_t count, DType dtype, ReduceOp op, int root) {
  std::ostringstream out;
  out << collective_name(kind);
  if (kind == CollectiveKind::barrier) return out.str();
  out << " (" << dtype_name(dtype) << " x " << count;
  if (kind == CollectiveKind::allreduce || kind == CollectiveKind::reduce_scatter)
    out << ", " << reduce_op_name(op);
  if (kind == CollectiveKind::broadcast) out << ", root " << root;
  out << ")";
  return out.str();
}
}  // namespace

std::string Collective::describe() const {
  std::string text = describe_fields(kind, count, dtype, op, root);
  if (codec) text.insert(text.size() - 1, ", compressed between machines");
  if (machine_memory && kind == CollectiveKind::allgather) text.insert(text.size() - 1, ", into machine memory");
  return text + " #" + std::to_string(sequence);
}

std::uint64_t Collective::signature() const {
  bool reduces = kind == CollectiveKind::allreduce || kind == CollectiveKind::reduce_scatter;
  std::uint64_t s = static_cast<std::uint64_t>(count) & ((1ull << kCountBits) - 1);
  s |= static_cast<std::uint64_t>(kind) << 40;
  s |= static_cast<std::uint64_t>(dtype) << 43;
  s |= static_cast<std::uint64_t>(reduces ? static_cast<int>(op) : 0) << 46;  // 3 bits
  s |= static_cast<std::uint64_t>(kind == CollectiveKind::broadcast ? root & 0x3fff : 0) << 49;
  s |= static_cast<std::uint64_t>(kind == CollectiveKind::allgather && machine_memory ? 1 : 0) << 49;
  s |= static_cast<std::uint64_t>(codec ? 1 : 0) << 63;
  return s;
}

std::string describe_signature(std::uint64_t s) {
  std::string text = describe_fields(static_cast<CollectiveKind>((s >> 40) & 7),
                                     static_cast<std::size_t>(s & ((1ull << kCountBits) - 1)),
                                     static_cast<DType>((s >> 43) & 7), static_cast<ReduceOp>((s >> 46) & 7),
                                     static_cast<int>((s >> 49) & 0x3fff));
  if (s >> 63) text.insert(text.size() - 1, ", compressed between machines");
  if (static_cast<CollectiveKind>((s >> 40) & 7) == CollectiveKind::allgather && ((s >> 49) & 1))
    text.insert(text.size() - 1, ", into machine memory");
  return text;
}

void check_signatures(const Collective& c, const std::uint64_t* signatures, int size, int rank) {
  for (int r = 0; r < size; ++r) {
    if (signatures[r] == signatures[0]) continue;
    throw MismatchError("collective #" + std::to_string(c.sequence) +
                        " differs across ranks: rank 0 issued " + describe_signature(signatures[0]) +
                        " but rank " + std::to_string(r) + " issued " + describe_signature(signatures[r]) +
                        " (seen on rank " +
                        std::to_string(rank) +
                        "). Every rank must issue the same collectives in the same order");
  }
}

}  // namespace lockstep::comm
