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

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fused bias + GELU against libtorch's, the GPT MLP's first half"};
  std::int64_t rows = 4096, width = 512;
  int repeat = 20, threads = 1;
  app.add_option("--rows", rows, "batch x sequence");
  app.add_option("--width", width, "the model's width (the hidden layer is 4x)");
  app.add_option("--repeat", repeat, "steps per side (interleaved), after 3 untimed");
  app.add_option("--threads", threads, "intra-op threads");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(threads);
  torch::manual_seed(0);
  const auto x = torch::randn({rows, width}).requires_grad_(false);
  Layer layer{(torch::randn({4 * width, width}) * 0.02).requires_grad_(true),
              torch::zeros({4 * width}).requires_grad_(true)};
  const auto grad = torch::randn({rows, 4 * width});
  std::printf("| dtype | GELU | libtorch ms | fused ms | libtorch / fused |\n|---|---|---|---|---|\n");
  for (const bool bf16 : {false, true}) {
    for (const std::string form : {"none", "tanh"}) {
      std::vector<double> plain, fused;
      for (int i = 0; i < repeat + 3; ++i) {
        const double a = step(false, form, bf16, x, layer, grad), b = step(true, form, bf16, x, layer, grad);
        if (i >= 3) plain.push_back(a), fused.push_back(b);
      }
      std::printf("| %s | %s | %.2f | %.2f | %.2fx |\n", bf16 ? "bf16 (autocast)" : "float32",
                  form == "none" ? "exact" : "tanh", median(plain) * 1e3, median(fused) * 1e3,
                  median(plain) / median(fused));
    }
  }
  std::printf("\nrows %lld, %lld -> %lld, %d intra-op thread(s), median of %d steps per side (forward and "
              "backward of the product, bias and GELU)\n",
              static_cast<long long>(rows), static_cast<long long>(width), static_cast<long long>(4 * width),
              threads, repeat);
}
