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
//
// With --strips CONTEXTS (e.g. 128,512,1024), instead: the fused attention above against
// models::causal_attention_in_strips, the same rows at each context, with dropout 0.1: the
// milliseconds per step and the memory the forward leaves held for backward (glibc's count of
// bytes in use, after the forward less before).
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <malloc.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>
#include <vector>

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

// The fused attention of the GPT's CPU path before the strips: the scores' product,
// causal_softmax_dropout, the product with v.
torch::Tensor fused_whole(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double p) {
  const auto scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  return torch::matmul(lockstep::models::causal_softmax_dropout(torch::matmul(q, k.transpose(-2, -1)), scale, p, true),
                       v);
}

std::int64_t strip_rows = 0;  // --strip-rows: queries per strip, 0 for the default

torch::Tensor attention_of(bool strips, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           double p) {
  if (!strips) return fused_whole(q, k, v, p);
  return lockstep::models::causal_attention_in_strips(q, k, v, 1.0 / std::sqrt(static_cast<double>(q.size(-1))), p,
                                                      true, strip_rows);
}

// glibc's bytes in use (0 elsewhere: the "held" columns then say nothing).
std::size_t bytes_in_use() {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  const auto m = mallinfo2();
  return m.uordblks + m.hblkhd;
#else
  return 0;
#endif
}

struct StripSide {
  double seconds, held_mb;
};

// One step of a side (forward, backward from x.grad): its seconds, and the megabytes the forward
// left held.
StripSide strip_step(bool strips, bool bf16, Heads& x) {
  lockstep::Autocast autocast(bf16 ? std::optional<at::ScalarType>(at::kBFloat16) : std::nullopt, c10::kCPU);
  const auto cast = [&](const torch::Tensor& t) { return bf16 ? t.to(at::kBFloat16) : t; };
  const auto q = cast(x.q), k = cast(x.k), v = cast(x.v);
  const auto before = bytes_in_use();
  const auto begin = std::chrono::steady_clock::now();
  const auto y = attention_of(strips, q, k, v, 0.1);
  const double held = static_cast<double>(bytes_in_use()) - static_cast<double>(before) -
                      static_cast<double>(y.numel() * y.element_size());
  y.backward(x.grad.to(y.scalar_type()));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  for (auto* t : {&x.q, &x.k, &x.v}) t->mutable_grad().reset();
  return {seconds, held / 1e6};
}

void compare_strips(const lockstep::bench::KernelBenchOptions& o, std::int64_t heads,
                    const std::vector<std::int64_t>& contexts) {
  std::printf("| context | dtype | fused ms | strips ms | fused / strips | fused held MB | strips held MB |\n"
              "|---|---|---|---|---|---|---|\n");
  for (const auto context : contexts) {
    const auto batch = std::max<std::int64_t>(1, o.rows / context), d = o.width / heads;
    const auto heads_of = [&] { return torch::randn({batch, heads, context, d}).requires_grad_(true); };
    Heads x{heads_of(), heads_of(), heads_of(), torch::randn({batch, heads, context, d}), {}, {}, {}};
    for (const bool bf16 : {false, true}) {
      StripSide fused{}, strips{};
      const auto [fused_s, strips_s] = lockstep::bench::interleaved_medians(
          o.repeat, [&] { return (fused = strip_step(false, bf16, x)).seconds; },
          [&] { return (strips = strip_step(true, bf16, x)).seconds; });
      std::printf("| %lld | %s | %.2f | %.2f | %.2fx | %.1f | %.1f |\n", static_cast<long long>(context),
                  bf16 ? "bf16 (autocast)" : "float32", fused_s * 1e3, strips_s * 1e3, fused_s / strips_s,
                  fused.held_mb, strips.held_mb);
    }
  }
  std::printf("\n%lld tokens a step (batch x context), %lld heads of %lld, attention dropout 0.1, %d intra-op "
              "thread(s), median of %d steps per side (forward and backward); held: the last step's\n",
              static_cast<long long>(o.rows), static_cast<long long>(heads), static_cast<long long>(o.width / heads),
              o.threads, o.repeat);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"causal attention with the softmax and dropout fused, against libtorch's steps"};
  lockstep::bench::KernelBenchOptions o{2048};
  std::int64_t heads = 8, context = 128;
  o.add_to(app, "the model's width (heads x head width)");
  app.add_option("--heads", heads, "attention heads");
  app.add_option("--context", context, "tokens per sequence (rows must be a multiple)");
  std::vector<std::int64_t> strip_contexts;
  app.add_option("--strips", strip_contexts, "compare the fused attention with the strips at these contexts")
      ->delimiter(',');
  app.add_option("--strip-rows", strip_rows, "queries per strip (0: causal_attention_in_strips' default)");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(o.threads);
  torch::manual_seed(0);
  if (!strip_contexts.empty()) {
    compare_strips(o, heads, strip_contexts);
    return 0;
  }
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
