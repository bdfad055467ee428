#include "lockstep/models/attention.h"

#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "attention_kernels.h"
#include "dropout_draw.h"
#include "lockstep/ddp/torch_compat.h"
#include "lockstep/error.h"
#include "lockstep/models/dropout.h"
#include "row_blocks.h"

namespace lockstep::models {
namespace {

using kernels::Bf16Bits;
using kernels::DropoutBits;
using kernels::ScoreRows;

bool fusable(const torch::Tensor& scores) {
  return scores.device().is_cpu() && scores.dim() >= 2 && scores.size(-1) == scores.size(-2) &&
         scores.numel() > 0 && (scores.scalar_type() == at::kFloat || scores.scalar_type() == at::kBFloat16);
}

torch::Tensor unfused(const torch::Tensor& scores, double scale, double p, bool training) {
  const auto t = scores.size(-1);
  const auto mask = torch::full({t, t}, -std::numeric_limits<float>::infinity(), scores.options()).triu(1);
  return fast_dropout(torch::softmax(scores * scale + mask, -1), p, training);
}

// kernel(each tensor's rows from first_row..., first_row, rows, scratch) over the rows of `block`
// in parallel blocks, the rows as float or bf16 (the tensors' dtype); scratch: `scratch_rows` rows
// of block.width floats.
template <class Kernel, class... Tensors>
void rows_of(const ScoreRows& block, std::int64_t scratch_rows, const Kernel& kernel, const torch::Tensor& s,
             const Tensors&... rest) {
  const auto run = [&](auto element) {
    using T = decltype(element);
    const auto row = [&](const torch::Tensor& x, std::int64_t r) {
      return static_cast<T*>(x.data_ptr()) + r * block.width;
    };
    for_row_blocks(s.numel() / block.width, block.width, [&](std::int64_t begin, std::int64_t end) {
      std::vector<float> scratch(static_cast<std::size_t>(scratch_rows * block.width));
      kernel(row(s, begin), row(rest, begin)..., begin, end - begin, scratch.data());
    });
  };
  if (s.scalar_type() == at::kBFloat16) return run(Bf16Bits());
  run(float());
}

// The probabilities of the block of contiguous scores s, and their dropped copy.
std::pair<torch::Tensor, torch::Tensor> probabilities(const torch::Tensor& s, const ScoreRows& block, float scale,
                                                      const DropoutBits& drop) {
  auto probs = torch::empty_like(s), out = torch::empty_like(s);
  const auto kernel = [&](auto* in, auto* p, auto* y, std::int64_t first, std::int64_t rows, float* scratch) {
    kernels::causal_softmax_dropout_forward(in, p, y, first, rows, block, scale, drop, scratch);
  };
  rows_of(block, 1, kernel, s, probs, out);
  return {probs, out};
}

// The dropped probabilities alone (the kernel writes P and then Y over it).
torch::Tensor dropped_probabilities(const torch::Tensor& s, const ScoreRows& block, float scale,
                                    const DropoutBits& drop) {
  auto out = torch::empty_like(s);
  const auto kernel = [&](auto* in, auto* y, std::int64_t first, std::int64_t rows, float* scratch) {
    kernels::causal_softmax_dropout_forward(in, y, y, first, rows, block, scale, drop, scratch);
  };
  rows_of(block, 1, kernel, s, out);
  return out;
}

// The scores' gradient of the block from the dropped probabilities' gradient dy and probs.
torch::Tensor scores_gradient(const torch::Tensor& dy, const torch::Tensor& probs, const ScoreRows& block, float scale,
                              const DropoutBits& drop) {
  auto ds = torch::empty_like(probs);
  const auto kernel = [&](auto* g, auto* p, auto* out, std::int64_t first, std::int64_t rows, float* scratch) {
    kernels::causal_softmax_dropout_backward(g, p, out, first, rows, block, scale, drop, scratch);
  };
  rows_of(block, 1, kernel, dy, probs, ds);
  return ds;
}

// The dropped probabilities and the scores' gradient from the scores and dy, in one pass.
std::pair<torch::Tensor, torch::Tensor> rebuilt_gradient(const torch::Tensor& s, const torch::Tensor& dy,
                                                         const ScoreRows& block, float scale,
                                                         const DropoutBits& drop) {
  auto dropped = torch::empty_like(s), ds = torch::empty_like(s);
  const auto kernel = [&](auto* in, auto* g, auto* y, auto* out, std::int64_t first, std::int64_t rows,
                          float* scratch) {
    kernels::causal_softmax_dropout_rebuilt_backward(in, g, y, out, first, rows, block, scale, drop, scratch);
  };
  rows_of(block, 2, kernel, s, dy, dropped, ds);
  return {dropped, ds};
}

// A forward's mask (threshold 0: none, and no seed drawn), kept in ctx for its backward.
DropoutBits new_mask(std::int64_t threshold, at::ScalarType type, torch::autograd::AutogradContext* ctx) {
  const auto bar = static_cast<std::uint32_t>(threshold);
  const DropoutBits drop{threshold ? next_dropout_seed() : 0, bar,
                         threshold ? dropout_scale_in(type, dropout_scale(bar)) : 1.0f};
  ctx->saved_data["seed"] = static_cast<std::int64_t>(drop.seed);
  ctx->saved_data["threshold"] = threshold;
  ctx->saved_data["kept"] = static_cast<double>(drop.kept);
  return drop;
}

DropoutBits saved_mask(torch::autograd::AutogradContext* ctx) {
  return {static_cast<std::uint64_t>(ctx->saved_data["seed"].toInt()),
          static_cast<std::uint32_t>(ctx->saved_data["threshold"].toInt()),
          static_cast<float>(ctx->saved_data["kept"].toDouble())};
}

struct CausalSoftmaxDropout : torch::autograd::Function<CausalSoftmaxDropout> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& scores, double scale,
                               std::int64_t threshold) {
    const auto s = scores.contiguous();
    const auto t = s.size(-1);
    const auto drop = new_mask(threshold, s.scalar_type(), ctx);
    auto [probs, out] = probabilities(s, ScoreRows{t, 0, t, t}, static_cast<float>(scale), drop);
    ctx->save_for_backward({probs});
    ctx->saved_data["scale"] = scale;
    return out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto probs = ctx->get_saved_variables()[0];
    const auto t = probs.size(-1);
    const auto dy = grads[0].to(probs.scalar_type()).contiguous();
    const auto scale = static_cast<float>(ctx->saved_data["scale"].toDouble());
    return {scores_gradient(dy, probs, ScoreRows{t, 0, t, t}, scale, saved_mask(ctx)), torch::Tensor(),
            torch::Tensor()};
  }
};

// Strips of about `rows` queries each over t, their sizes within one of each other (no strip of a
// query or two at the end): f(first query, queries).
template <class F>
void for_strips(std::int64_t t, std::int64_t rows, const F& f) {
  const std::int64_t count = (t + rows - 1) / rows;
  for (std::int64_t i = 0; i < count; ++i) f(i * t / count, (i + 1) * t / count - i * t / count);
}

// The strip's scores against the keys it may see, and where they lie.
std::pair<torch::Tensor, ScoreRows> strip_scores(const torch::Tensor& q, const torch::Tensor& k, std::int64_t first,
                                                 std::int64_t queries) {
  const auto width = first + queries;
  return {at::bmm(q.narrow(1, first, queries), k.narrow(1, 0, width).transpose(1, 2)),
          ScoreRows{q.size(1), first, queries, width}};
}

// q, k, v: [N, T, d] contiguous, one dtype (float or bf16); autocast kept out (the products run in
// that dtype, in forward and backward alike).
struct StripAttention : torch::autograd::Function<StripAttention> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, double scale, std::int64_t threshold, std::int64_t rows) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
    const auto drop = new_mask(threshold, q.scalar_type(), ctx);
    auto out = torch::empty({q.size(0), q.size(1), v.size(2)}, v.options());
    for_strips(q.size(1), rows, [&](std::int64_t first, std::int64_t queries) {
      const auto [s, block] = strip_scores(q, k, first, queries);
      const auto dropped = dropped_probabilities(s, block, static_cast<float>(scale), drop);
      out.narrow(1, first, queries).copy_(at::bmm(dropped, v.narrow(1, 0, block.width)));
    });
    ctx->save_for_backward({q, k, v});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["rows"] = rows;
    return out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2];
    const auto dout = grads[0].to(q.scalar_type()).contiguous();
    const auto drop = saved_mask(ctx);
    const auto scale = static_cast<float>(ctx->saved_data["scale"].toDouble());
    auto dq = torch::empty_like(q);
    auto dk = torch::zeros(k.sizes(), k.options().dtype(at::kFloat));  // summed over the strips
    auto dv = torch::zeros(v.sizes(), v.options().dtype(at::kFloat));
    for_strips(q.size(1), ctx->saved_data["rows"].toInt(), [&](std::int64_t first, std::int64_t queries) {
      const auto [s, block] = strip_scores(q, k, first, queries);
      const auto g = dout.narrow(1, first, queries);
      const auto keys = k.narrow(1, 0, block.width), values = v.narrow(1, 0, block.width);
      const auto [dropped, ds] = rebuilt_gradient(s, at::bmm(g, values.transpose(1, 2)), block, scale, drop);
      dv.narrow(1, 0, block.width).add_(at::bmm(dropped.transpose(1, 2), g));
      dq.narrow(1, first, queries).copy_(at::bmm(ds, keys));
      dk.narrow(1, 0, block.width).add_(at::bmm(ds.transpose(1, 2), q.narrow(1, first, queries)));
    });
    return {dq, dk.to(k.scalar_type()), dv.to(v.scalar_type()), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// The fewest queries in a strip: products of one or two rows go through slower kernels, and in
// libtorch 1.13's bf16 through ones that round more.
constexpr std::int64_t kFewestStripRows = 8;

// Queries per strip: 128 (bench/attention_bench --strips --strip-rows: at contexts 512 and 1024,
// 32 and 64 ran slower in bf16, 256 in float32), fewer where a strip over all the heads would pass
// 4M scores (16 MB in float32), but at least 16 (or T).
std::int64_t default_strip_rows(std::int64_t heads, std::int64_t t) {
  constexpr std::int64_t kStripRows = 128, kStripScores = std::int64_t{1} << 22;
  return std::min({t, kStripRows, std::max<std::int64_t>(16, kStripScores / std::max<std::int64_t>(1, heads * t))});
}

// The dropout's threshold for p while training (0: none), or nullopt for a p that only libtorch's
// path takes: below 2^-17 (a seed drawn for a mask that keeps everything) or 1 (drops everything).
std::optional<std::uint32_t> fusable_threshold(double p, bool training) {
  check_dropout_probability(p);
  if (!(training && p > 0)) return 0u;
  const std::uint32_t threshold = dropout_threshold(p);
  if (threshold == 0 || threshold >= 65536) return std::nullopt;
  return threshold;
}

// The dtype autocast gives the scores' product of q and k: its own for float32 on the CPU while
// CPU autocast is on (it leaves float64 alone), else q's.
at::ScalarType product_dtype(const torch::Tensor& q) {
  if (q.device().is_cpu() && q.scalar_type() == at::kFloat && torch_compat::autocast_enabled(at::kCPU))
    return torch_compat::autocast_dtype(at::kCPU);
  return q.scalar_type();
}

void check_strip_shapes(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        std::int64_t strip_rows) {
  const bool ok = q.dim() >= 2 && q.sizes() == k.sizes() && v.dim() == q.dim() &&
                  q.sizes().slice(0, q.dim() - 1) == v.sizes().slice(0, v.dim() - 1);
  if (!ok)
    throw ConfigError("causal attention takes q and k of one shape [..., T, d] and v [..., T, e] with q's leading "
                      "dimensions; got q " + c10::str(q.sizes()) + ", k " + c10::str(k.sizes()) + ", v " +
                      c10::str(v.sizes()));
  if (strip_rows < 0)
    throw ConfigError("causal attention's strip_rows must be 0 (the default) or more, got " +
                      std::to_string(strip_rows));
}

}  // namespace

torch::Tensor causal_softmax_dropout(const torch::Tensor& scores, double scale, double p, bool training) {
  const auto threshold = fusable_threshold(p, training);
  if (scores.dim() < 2 || scores.size(-1) != scores.size(-2))
    throw ConfigError("causal attention takes square scores [..., T, T] (query by key), got " +
                      c10::str(scores.sizes()));
  if (!fusable(scores) || !threshold || !(scale > 0)) return unfused(scores, scale, p, training);
  return CausalSoftmaxDropout::apply(scores, scale, static_cast<std::int64_t>(*threshold));
}

torch::Tensor causal_attention_in_strips(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                         double scale, double p, bool training, std::int64_t strip_rows) {
  const auto threshold = fusable_threshold(p, training);
  check_strip_shapes(q, k, v, strip_rows);
  const auto type = product_dtype(q);
  const bool in_strips = q.device().is_cpu() && (type == at::kFloat || type == at::kBFloat16) && q.numel() > 0 &&
                         v.numel() > 0 && threshold && scale > 0;
  if (!in_strips || k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type())
    return torch::matmul(causal_softmax_dropout(torch::matmul(q, k.transpose(-2, -1)), scale, p, training), v);
  const auto t = q.size(-2);
  const auto flat = [&](const torch::Tensor& x) { return x.to(type).reshape({-1, t, x.size(-1)}).contiguous(); };
  const auto q3 = flat(q);
  const auto rows = strip_rows ? std::clamp(strip_rows, std::min<std::int64_t>(kFewestStripRows, t), t)
                               : default_strip_rows(q3.size(0), t);
  auto out_shape = q.sizes().vec();
  out_shape.back() = v.size(-1);
  return StripAttention::apply(q3, flat(k), flat(v), scale, static_cast<std::int64_t>(*threshold), rows)
      .view(out_shape);
}

}  // namespace lockstep::models
