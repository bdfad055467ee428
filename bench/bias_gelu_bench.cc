// The GPT MLP's first half, forward and backward, with the bias and GELU fused
// (fast_linear(x, W) then models::fast_bias_gelu) and as libtorch runs them (the bias inside the
// product, then torch::gelu), interleaved in one process: milliseconds per step of each side and
// their ratio, for float32 and bf16 under CPU autocast, both GELU forms.
//
//     build/bench/bias_gelu_bench [--rows 4096] [--width 512] [--repeat 20] [--threads 1]
//
// rows = batch x sequence (16 x 256 by default), the hidden layer 4 x width, as the GPT's c_fc.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "lockstep/ddp/autocast.h"
#include "lockstep/models/activation.h"
#include "kernel_bench.h"
#include "lockstep/models/linear.h"

namespace {

using lockstep::models::fast_bias_gelu;
using lockstep::models::fast_linear;

struct Layer {
  torch::Tensor weight, bias;
};

// One step of the side: forward, a backward from a fixed gradient; seconds.
double step(bool fused, const std::string& form, bool bf16, const torch::Tensor& x, Layer& layer,
            const torch::Tensor& grad) {
  const auto begin = std::chrono::steady_clock::now();
  {
    lockstep::Autocast autocast(bf16 ? std::optional<at::ScalarType>(at::kBFloat16) : std::nullopt, c10::kCPU);
    const auto h = fused ? fast_bias_gelu(fast_linear(x, layer.weight), layer.bias, form)
                         : torch::gelu(fast_linear(x, layer.weight, layer.bias), form);
    h.backward(grad.to(h.scalar_type()));
  }
  layer.weight.mutable_grad().reset();
  layer.bias.mutable_grad().reset();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fused bias + GELU against libtorch's, the GPT MLP's first half"};
  lockstep::bench::KernelBenchOptions o{4096};
  o.add_to(app, "the model's width (the hidden layer is 4x)");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(o.threads);
  torch::manual_seed(0);
  const auto x = torch::randn({o.rows, o.width}).requires_grad_(false);
  Layer layer{(torch::randn({4 * o.width, o.width}) * 0.02).requires_grad_(true),
              torch::zeros({4 * o.width}).requires_grad_(true)};
  const auto grad = torch::randn({o.rows, 4 * o.width});
  std::printf("| dtype | GELU | libtorch ms | fused ms | libtorch / fused |\n|---|---|---|---|---|\n");
  for (const bool bf16 : {false, true}) {
    for (const std::string form : {"none", "tanh"}) {
      const auto [plain, fused] = lockstep::bench::interleaved_medians(
          o.repeat, [&] { return step(false, form, bf16, x, layer, grad); },
          [&] { return step(true, form, bf16, x, layer, grad); });
      std::printf("| %s | %s | %.2f | %.2f | %.2fx |\n", bf16 ? "bf16 (autocast)" : "float32",
                  form == "none" ? "exact" : "tanh", plain * 1e3, fused * 1e3, plain / fused);
    }
  }
  std::printf("\nrows %lld, %lld -> %lld, %d intra-op thread(s), median of %d steps per side (forward and "
              "backward of the product, bias and GELU)\n",
              static_cast<long long>(o.rows), static_cast<long long>(o.width), static_cast<long long>(4 * o.width),
              o.threads, o.repeat);
}
