// Layer norm before the GPT block's first product, forward and backward, with the fused kernel
// (models::fast_layer_norm: the norm and the cast to bf16 in one pass) and as libtorch runs it
// (layer_norm in float32 under autocast, then the product's cast), interleaved in one process:
// milliseconds per step of each side and their ratio, for float32 and bf16 under CPU autocast,
// the norm alone (followed by the cast the product would make) and the norm with the product
// (fast_linear, width -> 3 x width, as the attention's c_attn).
//
//     build/bench/layer_norm_bench [--rows 2048] [--width 512] [--repeat 20] [--threads 1]
//
// rows = batch x sequence (16 x 128 by default, the GPT benchmarks' per-worker batch).
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/ddp/autocast.h"
#include "kernel_bench.h"
#include "lockstep/models/linear.h"
#include "lockstep/models/norm.h"

namespace {

using lockstep::models::fast_layer_norm;
using lockstep::models::fast_linear;

struct Params {
  torch::Tensor gamma, beta, weight, bias;
};

torch::Tensor normed(bool fused, const torch::Tensor& x, const Params& p) {
  if (fused) return fast_layer_norm(x, p.gamma, p.beta, 1e-5);
  return torch::layer_norm(x, {x.size(-1)}, p.gamma, p.beta, 1e-5);
}

// One step of the side: forward, a backward from a fixed gradient; seconds.
double step(bool fused, bool bf16, bool with_product, const torch::Tensor& x, Params& p, const torch::Tensor& grad) {
  const auto begin = std::chrono::steady_clock::now();
  {
    lockstep::Autocast autocast(bf16 ? std::optional<at::ScalarType>(at::kBFloat16) : std::nullopt, c10::kCPU);
    auto y = normed(fused, x, p);
    if (bf16) y = y.to(at::kBFloat16);  // the product's own cast (none when already bf16)
    if (with_product) y = fast_linear(y, p.weight, p.bias);
    y.backward(grad.to(y.scalar_type()).view(y.sizes()));
  }
  for (auto* t : {&p.gamma, &p.beta, &p.weight, &p.bias}) t->mutable_grad().reset();
  x.mutable_grad().reset();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fused layer norm + cast against libtorch's, before the GPT block's first product"};
  lockstep::bench::KernelBenchOptions o{2048};
  o.add_to(app, "the model's width (the product is width -> 3 x width)");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(o.threads);
  torch::manual_seed(0);
  const auto x = torch::randn({o.rows, o.width}).requires_grad_(true);  // the residual stream
  Params p{torch::ones({o.width}).requires_grad_(true), torch::zeros({o.width}).requires_grad_(true),
           (torch::randn({3 * o.width, o.width}) * 0.02).requires_grad_(true),
           torch::zeros({3 * o.width}).requires_grad_(true)};
  const auto grad_norm = torch::randn({o.rows, o.width}), grad_product = torch::randn({o.rows, 3 * o.width});
  std::printf("| dtype | what | libtorch ms | fused ms | libtorch / fused |\n|---|---|---|---|---|\n");
  for (const bool bf16 : {false, true}) {
    for (const bool with_product : {false, true}) {
      const auto& grad = with_product ? grad_product : grad_norm;
      const auto [plain, fused] = lockstep::bench::interleaved_medians(
          o.repeat, [&] { return step(false, bf16, with_product, x, p, grad); },
          [&] { return step(true, bf16, with_product, x, p, grad); });
      std::printf("| %s | %s | %.3f | %.3f | %.2fx |\n", bf16 ? "bf16 (autocast)" : "float32",
                  with_product ? "norm + product" : "norm alone", plain * 1e3, fused * 1e3, plain / fused);
    }
  }
  std::printf("\nrows %lld, width %lld, %d intra-op thread(s), median of %d steps per side (forward and backward)\n",
              static_cast<long long>(o.rows), static_cast<long long>(o.width), o.threads, o.repeat);
}
