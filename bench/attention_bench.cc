// Causal attention of the GPT block, forward and backward, with the probabilities and their
// dropout in one pass each way (models::causal_attention on the CPU: causal_softmax_dropout) and
// in libtorch's steps (the scores' product with the scale and the mask added, softmax,
// fast_dropout, the product with the values), interleaved in one process: milliseconds per step
// of each side and their ratio, for float32 and bf16 under CPU autocast, with the GPT's attention
// dropout (0.1) and without.
//
//     build/bench/attention_bench [--rows 2048] [--width 512] [--heads 8] [--context 128]
//                                 [--repeat 20] [--threads 1]
//
// rows = batch x context (16 x 128 by default, the GPT benchmarks' per-worker batch); each head
// is width / heads wide.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>

#include "kernel_bench.h"
#include "lockstep/ddp/autocast.h"
#include "lockstep/models/attention.h"
#include "lockstep/models/dropout.h"
#include "lockstep/models/gpt.h"

namespace {

// The attention as libtorch's ops, as models::causal_attention computed it before the fused kernel.
torch::Tensor stepwise(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double p) {
  const auto b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3);
  const auto mask = torch::full({t, t}, -std::numeric_limits<float>::infinity(), q.options()).triu(1);
  const auto scores = at::baddbmm(mask, q.reshape({b * h, t, d}), k.reshape({b * h, t, d}).transpose(1, 2), 1,
                                  1.0 / std::sqrt(static_cast<double>(d)));
  return torch::matmul(lockstep::models::fast_dropout(torch::softmax(scores.view({b, h, t, t}), -1), p, true), v);
}

// The middle alone: the probabilities (dropped) from the scores.
torch::Tensor probabilities(bool fused, const torch::Tensor& scores, double scale, double p) {
  if (fused) return lockstep::models::causal_softmax_dropout(scores, scale, p, true);
  const auto t = scores.size(-1);
  const auto mask = torch::full({t, t}, -std::numeric_limits<float>::infinity(), scores.options()).triu(1);
  return lockstep::models::fast_dropout(torch::softmax(scores * scale + mask, -1), p, true);
}

struct Heads {
  torch::Tensor q, k, v, grad, scores, scores16, grad_scores;
};

// One step of the side, the whole attention or (middle) the probabilities alone: forward, a
// backward from a fixed gradient; seconds.
double step(bool fused, bool bf16, double p, bool middle, Heads& x) {
  const auto begin = std::chrono::steady_clock::now();
  if (middle) {
    const auto& scores = bf16 ? x.scores16 : x.scores;  // as the scores' product hands them over
    const auto y = probabilities(fused, scores, 1.0 / std::sqrt(static_cast<double>(x.q.size(-1))), p);
    y.backward(x.grad_scores.to(y.scalar_type()));
  } else {
    lockstep::Autocast autocast(bf16 ? std::optional<at::ScalarType>(at::kBFloat16) : std::nullopt, c10::kCPU);
    const auto cast = [&](const torch::Tensor& t) { return bf16 ? t.to(at::kBFloat16) : t; };
    const auto q = cast(x.q), k = cast(x.k), v = cast(x.v);  // as the c_attn product hands them over
    const auto y = fused ? lockstep::models::causal_attention(q, k, v, p, true) : stepwise(q, k, v, p);
    y.backward(x.grad.to(y.scalar_type()));
  }
  for (auto* t : {&x.q, &x.k, &x.v, &x.scores, &x.scores16}) t->mutable_grad().reset();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"causal attention with the softmax and dropout fused, against libtorch's steps"};
  lockstep::bench::KernelBenchOptions o{2048};
  std::int64_t heads = 8, context = 128;
  o.add_to(app, "the model's width (heads x head width)");
  app.add_option("--heads", heads, "attention heads");
  app.add_option("--context", context, "tokens per sequence (rows must be a multiple)");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(o.threads);
  torch::manual_seed(0);
  const auto batch = o.rows / context, d = o.width / heads;
  const auto heads_of = [&] { return torch::randn({batch, heads, context, d}).requires_grad_(true); };
  Heads x{heads_of(),
          heads_of(),
          heads_of(),
          torch::randn({batch, heads, context, d}),
          (torch::randn({batch, heads, context, context}) * 2).requires_grad_(true),
          torch::Tensor(),
          torch::randn({batch, heads, context, context})};
  x.scores16 = x.scores.detach().to(at::kBFloat16).requires_grad_(true);
  std::printf("| what | dtype | attention dropout | libtorch's steps ms | fused ms | steps / fused |\n"
              "|---|---|---|---|---|---|\n");
  for (const bool middle : {true, false}) {
    for (const bool bf16 : {false, true}) {
      for (const double p : {0.1, 0.0}) {
        const auto [plain, fused] = lockstep::bench::interleaved_medians(
            o.repeat, [&] { return step(false, bf16, p, middle, x); }, [&] { return step(true, bf16, p, middle, x); });
        std::printf("| %s | %s | %.1f | %.3f | %.3f | %.2fx |\n", middle ? "probabilities" : "attention",
                    bf16 ? "bf16 (autocast)" : "float32", p, plain * 1e3, fused * 1e3, plain / fused);
      }
    }
  }
  std::printf("\nbatch %lld, %lld heads of %lld, context %lld, %d intra-op thread(s), median of %d steps per side "
              "(forward and backward)\n",
              static_cast<long long>(batch), static_cast<long long>(heads), static_cast<long long>(d),
              static_cast<long long>(context), o.threads, o.repeat);
}
