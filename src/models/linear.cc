#include "lockstep/models/linear.h"

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "lockstep/ddp/torch_compat.h"

namespace lockstep::models {
namespace {

using Half = std::uint16_t;  // a bf16 or fp16 element, moved and never read as a number

// Tiles of 128 x 128 elements: each tile's reads and writes stay in L2 whatever the matrix's
// leading dimensions (powers of two here, which alias in the cache when walked one column at a
// time).
constexpr std::int64_t kTile = 128;

void transpose_scalar(const Half* in, std::int64_t ld_in, Half* out, std::int64_t ld_out, std::int64_t rows,
                      std::int64_t cols) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) out[c * ld_out + r] = in[r * ld_in + c];
}

#if defined(__SSE2__)
// An 8 x 8 block in three rounds of interleaving 16-, 32- and 64-bit lanes of row pairs.
void transpose_8x8(const Half* in, std::int64_t ld_in, Half* out, std::int64_t ld_out) {
  __m128i a[8], b[8];  // unrolled, so that both live in registers
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) a[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i * ld_in));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    b[2 * i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
    b[2 * i + 1] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
  }
  // b[0], b[2], b[4], b[6] hold columns 0-3 of the row pairs (0,1), (2,3), (4,5), (6,7), the odd
  // ones columns 4-7. Each half makes four output rows (columns of the input) from them.
#pragma GCC unroll 2
  for (int half = 0; half < 2; ++half) {
    const __m128i* p = b + half;
    const __m128i first_two_top = _mm_unpacklo_epi32(p[0], p[2]),
                  last_two_top = _mm_unpackhi_epi32(p[0], p[2]);
    const __m128i first_two_bottom = _mm_unpacklo_epi32(p[4], p[6]);
    const __m128i last_two_bottom = _mm_unpackhi_epi32(p[4], p[6]);
    Half* o = out + 4 * half * ld_out;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm_unpacklo_epi64(first_two_top, first_two_bottom));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + ld_out),
                     _mm_unpackhi_epi64(first_two_top, first_two_bottom));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 2 * ld_out),
                     _mm_unpacklo_epi64(last_two_top, last_two_bottom));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 3 * ld_out),
                     _mm_unpackhi_epi64(last_two_top, last_two_bottom));
  }
}
#endif

// One tile: whole 8 x 8 blocks by the kernel, the ragged right and bottom edges element by element.
void transpose_tile(const Half* in, std::int64_t ld_in, Half* out, std::int64_t ld_out, std::int64_t rows,
                    std::int64_t cols) {
  std::int64_t whole_rows = 0, whole_cols = 0;
#if defined(__SSE2__)
  whole_rows = rows / 8 * 8;
  whole_cols = cols / 8 * 8;
  // Down each column strip: consecutive blocks extend the same eight output rows.
  for (std::int64_t c = 0; c < whole_cols; c += 8)
    for (std::int64_t r = 0; r < whole_rows; r += 8)
      transpose_8x8(in + r * ld_in + c, ld_in, out + c * ld_out + r, ld_out);
#endif
  transpose_scalar(in + whole_cols, ld_in, out + whole_cols * ld_out, ld_out, whole_rows, cols - whole_cols);
  transpose_scalar(in + whole_rows * ld_in, ld_in, out + whole_rows, ld_out, rows - whole_rows, cols);
}

void transpose_2_byte(const Half* in, Half* out, std::int64_t rows, std::int64_t cols) {
  const std::int64_t row_tiles = (rows + kTile - 1) / kTile;
  at::parallel_for(0, row_tiles, 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t rt = begin; rt < end; ++rt) {
      const std::int64_t r = rt * kTile, tile_rows = std::min(kTile, rows - r);
      for (std::int64_t c = 0; c < cols; c += kTile)
        transpose_tile(in + r * cols + c, cols, out + c * rows + r, rows, tile_rows,
                       std::min(kTile, cols - c));
    }
  });
}

// g^T x for g [rows, out] and x [rows, in], with the long dimension rows contiguous in both operands
// of the product: the narrower of g and x is transposed, and with x the product too.
torch::Tensor weight_gradient(const torch::Tensor& g, const torch::Tensor& x) {
  if (g.size(1) <= x.size(1)) return transpose_contiguous(g).mm(x);
  return transpose_contiguous(transpose_contiguous(x).mm(g));
}

// y = x W^T + b in bf16 on the CPU, with the weight's gradient from contiguous operands.
struct Bf16Linear : torch::autograd::Function<Bf16Linear> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
    const auto in = x.reshape({-1, x.size(-1)});
    const auto out = bias ? at::addmm(*bias, in, weight.t()) : in.mm(weight.t());
    ctx->save_for_backward({in, weight});
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["grad_x"] = x.requires_grad();
    ctx->saved_data["grad_bias"] = bias && bias->requires_grad();
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    return out.view(sizes);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& in = saved[0];
    const auto& weight = saved[1];
    if (!grads[0].defined()) return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
    const auto g = grads[0].reshape({-1, weight.size(0)}).contiguous();
    torch::Tensor grad_x, grad_bias;
    if (ctx->saved_data["grad_x"].toBool())
      grad_x = g.mm(weight).view(ctx->saved_data["x_sizes"].toIntVector());
    if (ctx->saved_data["grad_bias"].toBool()) grad_bias = g.sum(0);
    return {grad_x, weight_gradient(g, in), grad_bias};
  }
};

bool bf16_product_on_cpu(const torch::Tensor& x, const torch::Tensor& weight) {
  if (!x.device().is_cpu() || !weight.device().is_cpu()) return false;
  if (torch_compat::autocast_enabled(at::kCPU))
    return torch_compat::autocast_dtype(at::kCPU) == at::kBFloat16 && x.is_floating_point() &&
           weight.is_floating_point();
  return x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16;
}

}  // namespace

torch::Tensor transpose_contiguous(const torch::Tensor& m) {
  TORCH_CHECK(m.dim() == 2, "transpose_contiguous takes a matrix, got ", m.dim(), " dimensions");
  if (m.element_size() != 2 || !m.device().is_cpu()) return m.t().contiguous();
  const auto in = m.contiguous();
  auto out = torch::empty({m.size(1), m.size(0)}, m.options());
  transpose_2_byte(static_cast<const Half*>(in.data_ptr()), static_cast<Half*>(out.data_ptr()), m.size(0),
                   m.size(1));
  return out;
}

torch::Tensor fast_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
  if (!(torch::GradMode::is_enabled() && weight.requires_grad() && bf16_product_on_cpu(x, weight)))
    return torch::nn::functional::linear(x, weight, bias);
  // Autocast's own casts: the weight's bf16 copy is made once per autocast scope, as for libtorch's linear.
  const auto bf16 = [](const torch::Tensor& t) {
    return at::autocast::cached_cast(at::kBFloat16, t, at::kCPU);
  };
  return Bf16Linear::apply(bf16(x), bf16(weight),
                           bias.defined() ? c10::optional<torch::Tensor>(bf16(bias)) : c10::nullopt);
}

}  // namespace lockstep::models
