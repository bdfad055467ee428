#include "lockstep/models/activation.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>

#include "gelu_kernels.h"
#include "row_blocks.h"

namespace lockstep::models {
namespace {

using kernels::Bf16Bits;
using kernels::GeluForm;

bool fusable(const torch::Tensor& x, const torch::Tensor& bias, const std::string& approximate) {
  const auto floating = [](at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; };
  return (approximate == "tanh" || approximate == "none") && x.device().is_cpu() && bias.device().is_cpu() &&
         floating(x.scalar_type()) && floating(bias.scalar_type()) && x.dim() >= 1 && bias.dim() == 1 &&
         x.numel() > 0 && bias.numel() == x.size(-1);
}

GeluForm form_of(const std::string& approximate) {
  return approximate == "tanh" ? GeluForm::tanh : GeluForm::exact;
}

struct BiasGelu : torch::autograd::Function<BiasGelu> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& bias, std::int64_t tanh) {
    const GeluForm form = tanh ? GeluForm::tanh : GeluForm::exact;
    const auto in = x.contiguous();
    const auto b = bias.to(torch::kFloat).contiguous();
    auto out = torch::empty_like(in);
    const std::int64_t cols = in.size(-1), rows = in.numel() / cols;
    const float* bp = b.data_ptr<float>();
    for_row_blocks(rows, cols, [&](std::int64_t begin, std::int64_t end) {
      if (in.scalar_type() == at::kFloat) {
        kernels::bias_gelu_forward(form, in.data_ptr<float>() + begin * cols, bp,
                                   out.data_ptr<float>() + begin * cols, end - begin, cols);
      } else {
        kernels::bias_gelu_forward(form, static_cast<const Bf16Bits*>(in.data_ptr()) + begin * cols, bp,
                                   static_cast<Bf16Bits*>(out.data_ptr()) + begin * cols, end - begin, cols);
      }
    });
    ctx->save_for_backward({in, b});
    ctx->saved_data["tanh"] = tanh;
    ctx->saved_data["bias_dtype"] = bias.scalar_type();
    return out;
  }

  // The input's gradient, and the bias's: each block of rows sums its own part, then the parts.
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& in = saved[0];
    const torch::Tensor& b = saved[1];
    const GeluForm form = ctx->saved_data["tanh"].toInt() ? GeluForm::tanh : GeluForm::exact;
    const auto dy = grads[0].to(in.scalar_type()).contiguous();
    auto dx = torch::empty_like(in);
    const std::int64_t cols = in.size(-1), rows = in.numel() / cols;
    const std::int64_t blocks = std::max<std::int64_t>(1, std::min<std::int64_t>(at::get_num_threads(), rows));
    auto partial = torch::zeros({blocks, cols}, in.options().dtype(torch::kFloat));
    const float* bp = b.data_ptr<float>();
    at::parallel_for(0, blocks, 1, [&](std::int64_t first, std::int64_t last) {
      for (std::int64_t k = first; k < last; ++k) {
        const std::int64_t begin = rows * k / blocks, end = rows * (k + 1) / blocks;
        float* sum = partial.data_ptr<float>() + k * cols;
        if (in.scalar_type() == at::kFloat) {
          kernels::bias_gelu_backward(form, dy.data_ptr<float>() + begin * cols, in.data_ptr<float>() + begin * cols,
                                      bp, dx.data_ptr<float>() + begin * cols, sum, end - begin, cols);
        } else {
          const auto* g = static_cast<const Bf16Bits*>(dy.data_ptr()) + begin * cols;
          const auto* x = static_cast<const Bf16Bits*>(in.data_ptr()) + begin * cols;
          kernels::bias_gelu_backward(form, g, x, bp, static_cast<Bf16Bits*>(dx.data_ptr()) + begin * cols, sum,
                                      end - begin, cols);
        }
      }
    });
    const auto bias_dtype = ctx->saved_data["bias_dtype"].toScalarType();
    return {dx, partial.sum(0).to(bias_dtype), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor fast_bias_gelu(const torch::Tensor& x, const torch::Tensor& bias, const std::string& approximate) {
  if (!fusable(x, bias, approximate)) return torch::gelu(x + bias.to(x.scalar_type()), approximate);
  return BiasGelu::apply(x, bias, static_cast<std::int64_t>(form_of(approximate) == GeluForm::tanh));
}

}  // namespace lockstep::models
