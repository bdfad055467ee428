// Reduction kernels. Each works through the buffers in blocks of kBlock elements held in a
// local accumulator: the accumulator cannot alias the inputs, so the compiler vectorises the
// inner loops, and the block stays in L1 while all n inputs are folded into it. The f32/f64
// entry points are also compiled for AVX2 and picked at load time (target_clones).
#include "shm/reduce.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace lockstep::comm {
namespace {

constexpr std::size_t kBlock = 1024;

struct Sum {
  template <typename A>
  static A apply(A a, A b) {
    return a + b;
  }
};
struct Min {
  template <typename A>
  static A apply(A a, A b) {
    return b < a ? b : a;
  }
};
struct Max {
  template <typename A>
  static A apply(A a, A b) {
    return a < b ? b : a;
  }
};
struct Product {
  template <typename A>
  static A apply(A a, A b) {
    if constexpr (std::is_integral_v<A>)  // wraps on overflow, as torch's integer product does
      return static_cast<A>(static_cast<std::make_unsigned_t<A>>(a) * static_cast<std::make_unsigned_t<A>>(b));
    else
      return a * b;
  }
};
struct BitAnd {
  template <typename A>
  static A apply(A a, A b) {
    return a & b;
  }
};
struct BitOr {
  template <typename A>
  static A apply(A a, A b) {
    return a | b;
  }
};
struct BitXor {
  template <typename A>
  static A apply(A a, A b) {
    return a ^ b;
  }
};

// T: element type in memory; A: accumulator type; Load/Store convert between them.
template <typename T, typename A, typename Op, bool kAverage, typename Load, typename Store>
inline __attribute__((always_inline)) void reduce_blocks(void* out, const void* const* inputs, int n,
                                                         std::size_t count, Load load, Store store) {
  alignas(64) A acc[kBlock];
  for (std::size_t start = 0; start < count; start += kBlock) {
    std::size_t m = std::min(kBlock, count - start);
    const T* first = static_cast<const T*>(inputs[0]) + start;
    for (std::size_t i = 0; i < m; ++i) acc[i] = load(first[i]);
    for (int k = 1; k < n; ++k) {
      const T* in = static_cast<const T*>(inputs[k]) + start;
      for (std::size_t i = 0; i < m; ++i) acc[i] = Op::apply(acc[i], load(in[i]));
    }
    if constexpr (kAverage) {
      const A divisor = static_cast<A>(n);
      for (std::size_t i = 0; i < m; ++i) acc[i] = acc[i] / divisor;
    }
    T* dst = static_cast<T*>(out) + start;
    for (std::size_t i = 0; i < m; ++i) dst[i] = store(acc[i]);
  }
}

template <typename T, typename A, typename Load, typename Store>
inline __attribute__((always_inline)) void reduce_op(ReduceOp op, void* out, const void* const* in, int n,
                                                     std::size_t count, Load load, Store store) {
  switch (op) {
    case ReduceOp::sum: return reduce_blocks<T, A, Sum, false>(out, in, n, count, load, store);
    case ReduceOp::avg: return reduce_blocks<T, A, Sum, true>(out, in, n, count, load, store);
    case ReduceOp::min: return reduce_blocks<T, A, Min, false>(out, in, n, count, load, store);
    case ReduceOp::max: return reduce_blocks<T, A, Max, false>(out, in, n, count, load, store);
    case ReduceOp::product: return reduce_blocks<T, A, Product, false>(out, in, n, count, load, store);
    case ReduceOp::band:
    case ReduceOp::bor:
    case ReduceOp::bxor:
      // Integers only (the communicator refuses them for other types before they get here).
      if constexpr (std::is_integral_v<A>) {
        if (op == ReduceOp::band) return reduce_blocks<T, A, BitAnd, false>(out, in, n, count, load, store);
        if (op == ReduceOp::bor) return reduce_blocks<T, A, BitOr, false>(out, in, n, count, load, store);
        return reduce_blocks<T, A, BitXor, false>(out, in, n, count, load, store);
      }
      return;
  }
}

template <typename T>
inline __attribute__((always_inline)) void reduce_plain(ReduceOp op, void* out, const void* const* in, int n,
                                                        std::size_t count) {
  reduce_op<T, T>(
      op, out, in, n, count, [](T v) { return v; }, [](T v) { return v; });
}

__attribute__((target_clones("avx2", "default"))) void reduce_f32(ReduceOp op, void* out,
                                                                  const void* const* in, int n,
                                                                  std::size_t count) {
  reduce_plain<float>(op, out, in, n, count);
}

__attribute__((target_clones("avx2", "default"))) void reduce_f64(ReduceOp op, void* out,
                                                                  const void* const* in, int n,
                                                                  std::size_t count) {
  reduce_plain<double>(op, out, in, n, count);
}

__attribute__((target_clones("avx2", "default"))) void reduce_bf16(ReduceOp op, void* out,
                                                                   const void* const* in, int n,
                                                                   std::size_t count) {
  reduce_op<std::uint16_t, float>(
      op, out, in, n, count, [](std::uint16_t v) { return bf16_to_f32(v); },
      [](float v) {
        std::uint32_t x;
        std::memcpy(&x, &v, 4);
        if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
        x += 0x7FFFu + ((x >> 16) & 1u);
        return static_cast<std::uint16_t>(x >> 16);
      });
}

}  // namespace

void reduce(DType dtype, ReduceOp op, void* out, const void* const* inputs, int n, std::size_t count) {
  if (count == 0) return;
  switch (dtype) {
    case DType::f32: return reduce_f32(op, out, inputs, n, count);
    case DType::f64: return reduce_f64(op, out, inputs, n, count);
    case DType::bf16: return reduce_bf16(op, out, inputs, n, count);
    case DType::f16:
      return reduce_op<std::uint16_t, float>(op, out, inputs, n, count, f16_to_f32, f32_to_f16);
    case DType::i32: return reduce_plain<std::int32_t>(op, out, inputs, n, count);
    case DType::i64: return reduce_plain<std::int64_t>(op, out, inputs, n, count);
  }
}

}  // namespace lockstep::comm
