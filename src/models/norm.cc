#include "lockstep/models/norm.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>

#include "lockstep/ddp/torch_compat.h"
#include "norm_kernels.h"
#include "row_blocks.h"

namespace lockstep::models {
namespace {

using kernels::Bf16Bits;

bool fusable(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
  const auto cpu_float_vector = [&](const torch::Tensor& t) {
    return t.defined() && t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 1 &&
           t.numel() == x.size(-1);
  };
  return x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 && x.numel() > 0 &&
         cpu_float_vector(weight) && cpu_float_vector(bias);
}

bool cast_to_bf16(const torch::Tensor& x) {
  return x.device().is_cpu() && torch_compat::autocast_enabled(at::kCPU) &&
         torch_compat::autocast_dtype(at::kCPU) == at::kBFloat16;
}

struct LayerNormCast : torch::autograd::Function<LayerNormCast> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias, double eps,
                               std::int64_t bf16_out) {
    const auto in = x.contiguous();
    const auto gamma = weight.contiguous(), beta = bias.contiguous();
    const std::int64_t cols = in.size(-1), rows = in.numel() / cols;
    auto out = torch::empty(in.sizes(), in.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
    auto mean = torch::empty({rows}, in.options()), rstd = torch::empty({rows}, in.options());
    for_row_blocks(rows, cols, [&](std::int64_t begin, std::int64_t end) {
      const float* src = in.data_ptr<float>() + begin * cols;
      float* m = mean.data_ptr<float>() + begin;
      float* s = rstd.data_ptr<float>() + begin;
      if (bf16_out) {
        kernels::layer_norm_forward(src, gamma.data_ptr<float>(), beta.data_ptr<float>(),
                                    static_cast<Bf16Bits*>(out.data_ptr()) + begin * cols, m, s, end - begin,
                                    cols, static_cast<float>(eps));
      } else {
        kernels::layer_norm_forward(src, gamma.data_ptr<float>(), beta.data_ptr<float>(),
                                    out.data_ptr<float>() + begin * cols, m, s, end - begin, cols,
                                    static_cast<float>(eps));
      }
    });
    ctx->save_for_backward({in, gamma, mean, rstd});
    ctx->saved_data["bf16_out"] = bf16_out;
    return out;
  }

  // The input's gradient, and the weight's and bias's: each block of rows sums its own part, then
  // the parts are added.
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &in = saved[0], &gamma = saved[1], &mean = saved[2], &rstd = saved[3];
    const bool bf16 = ctx->saved_data["bf16_out"].toInt() != 0;
    const auto dy = grads[0].to(bf16 ? at::kBFloat16 : at::kFloat).contiguous();
    auto dx = torch::empty_like(in);
    const std::int64_t cols = in.size(-1), rows = in.numel() / cols;
    const std::int64_t blocks = std::max<std::int64_t>(1, std::min<std::int64_t>(at::get_num_threads(), rows));
    auto partial = torch::zeros({2, blocks, cols}, in.options());  // the weight's sums, then the bias's
    at::parallel_for(0, blocks, 1, [&](std::int64_t first, std::int64_t last) {
      for (std::int64_t k = first; k < last; ++k) {
        const std::int64_t begin = rows * k / blocks, end = rows * (k + 1) / blocks;
        float* gamma_grad = partial.data_ptr<float>() + k * cols;
        float* beta_grad = gamma_grad + blocks * cols;
        const float* x = in.data_ptr<float>() + begin * cols;
        float* out = dx.data_ptr<float>() + begin * cols;
        const float* m = mean.data_ptr<float>() + begin;
        const float* s = rstd.data_ptr<float>() + begin;
        if (bf16) {
          kernels::layer_norm_backward(static_cast<const Bf16Bits*>(dy.data_ptr()) + begin * cols, x, m, s,
                                       gamma.data_ptr<float>(), out, gamma_grad, beta_grad, end - begin, cols);
        } else {
          kernels::layer_norm_backward(dy.data_ptr<float>() + begin * cols, x, m, s, gamma.data_ptr<float>(), out,
                                       gamma_grad, beta_grad, end - begin, cols);
        }
      }
    });
    const auto sums = partial.sum(1);
    return {dx, sums[0], sums[1], torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor fast_layer_norm(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                              double eps) {
  if (!fusable(x, weight, bias)) return torch::layer_norm(x, {x.size(-1)}, weight, bias, eps);
  return LayerNormCast::apply(x, weight, bias, eps, static_cast<std::int64_t>(cast_to_bf16(x)));
}

}  // namespace lockstep::models
