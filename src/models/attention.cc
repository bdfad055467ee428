#include "lockstep/models/attention.h"

#include <torch/torch.h>

#include <limits>
#include <vector>

#include "attention_kernels.h"
#include "dropout_draw.h"
#include "lockstep/error.h"
#include "lockstep/models/dropout.h"
#include "row_blocks.h"

namespace lockstep::models {
namespace {

using kernels::Bf16Bits;
using kernels::DropoutBits;

bool fusable(const torch::Tensor& scores) {
  return scores.device().is_cpu() && scores.dim() >= 2 && scores.size(-1) == scores.size(-2) &&
         scores.numel() > 0 && (scores.scalar_type() == at::kFloat || scores.scalar_type() == at::kBFloat16);
}

torch::Tensor unfused(const torch::Tensor& scores, double scale, double p, bool training) {
  const auto t = scores.size(-1);
  const auto mask = torch::full({t, t}, -std::numeric_limits<float>::infinity(), scores.options()).triu(1);
  return fast_dropout(torch::softmax(scores * scale + mask, -1), p, training);
}

// kernel(a, b, c, first_row, rows, t, scratch) over the rows of t scores in parallel blocks, with
// a, b, c the three tensors' rows from first_row as float or bf16 (their dtype, s's).
template <class Kernel>
void rows_of(const torch::Tensor& s, const torch::Tensor& b, const torch::Tensor& c, const Kernel& kernel) {
  const std::int64_t t = s.size(-1);
  const auto run = [&](auto element) {
    using T = decltype(element);
    const auto row = [&](const torch::Tensor& x, std::int64_t r) { return static_cast<T*>(x.data_ptr()) + r * t; };
    for_row_blocks(s.numel() / t, t, [&](std::int64_t begin, std::int64_t end) {
      std::vector<float> scratch(static_cast<std::size_t>(t));
      kernel(row(s, begin), row(b, begin), row(c, begin), begin, end - begin, t, scratch.data());
    });
  };
  if (s.scalar_type() == at::kBFloat16) return run(Bf16Bits());
  run(float());
}

struct CausalSoftmaxDropout : torch::autograd::Function<CausalSoftmaxDropout> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& scores, double scale,
                               std::int64_t threshold) {
    const auto s = scores.contiguous();
    auto probs = torch::empty_like(s), out = torch::empty_like(s);
    const auto bar = static_cast<std::uint32_t>(threshold);  // 0: no dropout, no seed drawn
    const DropoutBits drop{threshold ? next_dropout_seed() : 0, bar,
                           threshold ? dropout_scale_in(s.scalar_type(), dropout_scale(bar)) : 1.0f};
    const auto f = static_cast<float>(scale);
    rows_of(s, probs, out, [&](auto* in, auto* p, auto* y, std::int64_t first, std::int64_t rows, std::int64_t t,
                               float* scratch) {
      kernels::causal_softmax_dropout_forward(in, p, y, first, rows, t, f, drop, scratch);
    });
    ctx->save_for_backward({probs});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["seed"] = static_cast<std::int64_t>(drop.seed);
    ctx->saved_data["threshold"] = threshold;
    ctx->saved_data["kept"] = static_cast<double>(drop.kept);
    return out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto probs = ctx->get_saved_variables()[0];
    const auto dy = grads[0].to(probs.scalar_type()).contiguous();
    auto ds = torch::empty_like(probs);
    const DropoutBits drop{static_cast<std::uint64_t>(ctx->saved_data["seed"].toInt()),
                           static_cast<std::uint32_t>(ctx->saved_data["threshold"].toInt()),
                           static_cast<float>(ctx->saved_data["kept"].toDouble())};
    const auto f = static_cast<float>(ctx->saved_data["scale"].toDouble());
    rows_of(dy, probs, ds, [&](auto* g, auto* p, auto* out, std::int64_t first, std::int64_t rows, std::int64_t t,
                               float* scratch) {
      kernels::causal_softmax_dropout_backward(g, p, out, first, rows, t, f, drop, scratch);
    });
    return {ds, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor causal_softmax_dropout(const torch::Tensor& scores, double scale, double p, bool training) {
  check_dropout_probability(p);
  if (scores.dim() < 2 || scores.size(-1) != scores.size(-2))
    throw ConfigError("causal attention takes square scores [..., T, T] (query by key), got " +
                      c10::str(scores.sizes()));
  const bool drops = training && p > 0;
  const std::uint32_t threshold = drops ? dropout_threshold(p) : 0;
  // A p below 2^-17 draws a seed for a mask that keeps everything; p = 1 drops everything.
  const bool odd_p = drops && (threshold == 0 || threshold >= 65536);
  if (!fusable(scores) || odd_p || !(scale > 0)) return unfused(scores, scale, p, training);
  return CausalSoftmaxDropout::apply(scores, scale, static_cast<std::int64_t>(threshold));
}

}  // namespace lockstep::models
