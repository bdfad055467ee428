// PowerSGD between machines (see ddp/compression.h), one share of a bucket at a time.
//
// Per call, for a share already summed over its machine:
//   1. M = block + error, for each block (whole rows of one matrix-shaped tensor);
//   2. P = M Q; one all-reduce (sum) of [exact elements | every P] across machines;
//   3. P orthonormalised (Gram-Schmidt over its r columns);
//   4. Q = M^T P; one all-reduce (sum) of every Q; Q is kept for the next call (warm start);
//      with 2k rounds, steps 2-4 run k times, each P computed from the last Q orthonormalised;
//   5. the block becomes P Q^T, the estimate of the machines' sum; error = M - P Q^T / machines.
// Cost per block of rows x cols at rank r: 2k + 1 matrix products of rows x cols x r; on the wire
// k (rows + cols) r floats in place of rows x cols.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>

#include "codecs.h"
#include "lockstep/error.h"

namespace lockstep::ddp_detail {
namespace {

// Columns of p (rows x r) made orthonormal, in place; a zero column stays zero.
void orthonormalize(torch::Tensor& p) {
  const std::int64_t r = p.size(1);
  for (std::int64_t i = 0; i < r; ++i) {
    auto col = p.narrow(1, i, 1);
    col.div_(col.norm() + 1e-8);
    if (i + 1 < r) {
      auto rest = p.narrow(1, i + 1, r - i - 1);
      rest.sub_(col * (col * rest).sum(0, /*keepdim=*/true));
    }
  }
}

class PowerSgdCodec final : public BucketCodec {
 public:
  PowerSgdCodec(std::vector<BucketTensor> layout, const CompressionOptions& options)
      : layout_(std::move(layout)), options_(options) {
    if (options_.powersgd_rank < 1)
      throw ConfigError("PowerSGD rank " + std::to_string(options_.powersgd_rank) + ": use 1 or more");
    const int rounds = options_.powersgd_rounds;
    if (rounds < 1 || (rounds > 1 && rounds % 2 != 0))
      throw ConfigError("PowerSGD rounds " + std::to_string(rounds) +
                        ": use 1 (sides alternate) or an even number (2 per power iteration)");
    std::sort(layout_.begin(), layout_.end(), [](auto& a, auto& b) { return a.offset < b.offset; });
  }

  void operator()(float* share, std::size_t first, std::size_t count, comm::Across& across) override {
    torch::NoGradGuard no_grad;
    Plan& plan = plan_for(first, count);
    if (++plan.calls <= options_.start_step) {
      across.sum(share, count, comm::DType::f32);
      bytes_across_ = std::uint64_t(allreduce_bytes_sent(4.0 * double(count), across.machines()));
      return;
    }
    auto whole = torch::from_blob(share, {std::int64_t(count)}, torch::kFloat);
    if (options_.powersgd_rounds == 1)
      one_round(plan, whole, across);
    else
      compress_and_sum(plan, whole, across);
  }

  CodecReport report() const override { return {"powersgd", "", bytes_across_}; }

 private:
  struct Block {
    std::int64_t begin = 0, rows = 0, cols = 0, rank = 0;
    torch::Tensor q, error;  // cols x rank (kept between calls); rows x cols
    torch::Tensor p;         // one round: rows x rank, the left factor of the last step
  };
  struct Range {
    std::int64_t begin = 0, length = 0;
  };
  struct Plan {
    std::vector<Block> blocks;
    std::vector<Range> exact;  // everything no block covers, sent as it is
    std::int64_t exact_elements = 0, p_elements = 0, q_elements = 0;
    int calls = 0;
    torch::Tensor first_round, second_round;  // [exact | every P], [every Q]: what is summed
    bool right_side = true;                   // one round: this step sums M Q (else M^T P)
  };

  Plan& plan_for(std::size_t first, std::size_t count) {
    auto it = plans_.find(first);
    if (it != plans_.end() && it->second.first_count == count) return it->second.plan;
    Planned planned{count, make_plan(std::int64_t(first), std::int64_t(count))};
    return plans_.insert_or_assign(first, std::move(planned)).first->second.plan;
  }

  // The whole rows of each matrix-shaped tensor inside [first, first + count) that gain from
  // compression become blocks; the rest is sent exactly.
  Plan make_plan(std::int64_t first, std::int64_t count) const {
    Plan plan;
    for (const auto& t : layout_) {
      if (t.shape.size() < 2 || t.shape[0] == 0 || t.embedding) continue;
      std::int64_t numel = 1;
      for (auto d : t.shape) numel *= d;
      const std::int64_t cols = numel / t.shape[0];
      const std::int64_t lo = std::max(first, t.offset) - t.offset;
      const std::int64_t hi = std::min(first + count, t.offset + numel) - t.offset;
      if (lo >= hi || cols == 0) continue;
      const std::int64_t row_lo = (lo + cols - 1) / cols, row_hi = hi / cols;
      const std::int64_t rows = row_hi - row_lo;
      const std::int64_t rank = std::min<std::int64_t>({options_.powersgd_rank, rows, cols});
      if (rows <= 0 || double(rows * cols) < options_.min_compression * double((rows + cols) * rank))
        continue;
      Block b;
      b.begin = t.offset + row_lo * cols - first;
      b.rows = rows;
      b.cols = cols;
      b.rank = rank;
      plan.blocks.push_back(std::move(b));
    }
    std::int64_t at = 0;
    for (const auto& b : plan.blocks) {
      if (b.begin > at) plan.exact.push_back({at, b.begin - at});
      at = b.begin + b.rows * b.cols;
      plan.p_elements += b.rows * b.rank;
      plan.q_elements += b.cols * b.rank;
    }
    if (count > at) plan.exact.push_back({at, count - at});
    for (const auto& r : plan.exact) plan.exact_elements += r.length;
    for (std::size_t i = 0; i < plan.blocks.size(); ++i) start_q(plan.blocks[i], first, i);
    return plan;
  }

  // The same Q on every machine: seeded by the options' seed, the share and the block.
  void start_q(Block& b, std::int64_t first, std::size_t index) const {
    const std::uint64_t seed = options_.seed ^ (std::uint64_t(first) * 0x9e3779b97f4a7c15ull) ^ (index + 1);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    b.q = torch::randn({b.cols, b.rank}, gen, torch::kFloat);
    orthonormalize(b.q);
    b.error = torch::zeros({b.rows, b.cols}, torch::kFloat);
  }

  void compress_and_sum(Plan& plan, torch::Tensor& whole, comm::Across& across) {
    const int machines = across.machines();
    if (!plan.first_round.defined()) {
      plan.first_round = torch::empty({plan.exact_elements + plan.p_elements}, torch::kFloat);
      plan.second_round = torch::empty({plan.q_elements}, torch::kFloat);
    }
    auto& first_round = plan.first_round;
    std::int64_t at = 0;
    for (const auto& r : plan.exact) {
      first_round.narrow(0, at, r.length).copy_(whole.narrow(0, r.begin, r.length));
      at += r.length;
    }
    std::vector<torch::Tensor> ms, ps, qs;
    for (auto& b : plan.blocks) {
      ms.push_back(whole.narrow(0, b.begin, b.rows * b.cols).view({b.rows, b.cols}));
      ms.back().add_(b.error);
      ps.push_back(first_round.narrow(0, at, b.rows * b.rank).view({b.rows, b.rank}));
      torch::mm_out(ps.back(), ms.back(), b.q);
      at += b.rows * b.rank;
    }
    across.sum(first_round.data_ptr(), std::size_t(first_round.numel()), comm::DType::f32);
    at = 0;
    for (const auto& r : plan.exact) {
      whole.narrow(0, r.begin, r.length).copy_(first_round.narrow(0, at, r.length));
      at += r.length;
    }
    auto& second_round = plan.second_round;
    at = 0;
    for (std::size_t i = 0; i < plan.blocks.size(); ++i) {
      auto& b = plan.blocks[i];
      qs.push_back(second_round.narrow(0, at, b.cols * b.rank).view({b.cols, b.rank}));
      at += b.cols * b.rank;
    }
    const int iterations = options_.powersgd_rounds / 2;
    for (int k = 1; k <= iterations; ++k) {
      if (k > 1) refine_p(plan, ms, ps, qs, across);
      for (std::size_t i = 0; i < plan.blocks.size(); ++i) {
        orthonormalize(ps[i]);
        torch::mm_out(qs[i], ms[i].t(), ps[i]);
      }
      if (second_round.numel() > 0)
        across.sum(second_round.data_ptr(), std::size_t(second_round.numel()), comm::DType::f32);
    }
    for (std::size_t i = 0; i < plan.blocks.size(); ++i) {  // two passes over M: error, then estimate
      auto& b = plan.blocks[i];
      b.q.copy_(qs[i]);
      torch::addmm_out(b.error, ms[i], ps[i], qs[i].t(), /*beta=*/1, /*alpha=*/-1.0 / machines);
      torch::mm_out(ms[i], ps[i], qs[i].t());
    }
    bytes_across_ = std::uint64_t(
        allreduce_bytes_sent(4.0 * double(first_round.numel()), machines) +
        (iterations - 1) * allreduce_bytes_sent(4.0 * double(plan.p_elements), machines) +
        iterations * allreduce_bytes_sent(4.0 * double(second_round.numel()), machines));
  }

  // A further power iteration: P = M Q from the summed Q orthonormalised, summed in the same
  // place as the first P (the exact elements before it were already read out).
  void refine_p(Plan& plan, std::vector<torch::Tensor>& ms, std::vector<torch::Tensor>& ps,
                std::vector<torch::Tensor>& qs, comm::Across& across) {
    for (std::size_t i = 0; i < plan.blocks.size(); ++i) {
      orthonormalize(qs[i]);
      torch::mm_out(ps[i], ms[i], qs[i]);
    }
    auto all_p = plan.first_round.narrow(0, plan.exact_elements, plan.p_elements);
    if (all_p.numel() > 0) across.sum(all_p.data_ptr(), std::size_t(all_p.numel()), comm::DType::f32);
  }

  // One exchange per step, as PowerGossip (Vogels et al., 2020) alternates: one factor is the
  // orthonormalised sum of the previous step's other factor, known to every machine, so only the
  // projection onto it is summed; the side alternates so the subspace keeps tracking M.
  void one_round(Plan& plan, torch::Tensor& whole, comm::Across& across) {
    const int machines = across.machines();
    const bool right = plan.right_side;
    if (!plan.first_round.defined())
      plan.first_round =
          torch::empty({plan.exact_elements + std::max(plan.p_elements, plan.q_elements)}, torch::kFloat);
    auto buffer = plan.first_round.narrow(0, 0, plan.exact_elements + (right ? plan.p_elements : plan.q_elements));
    std::int64_t at = 0;
    for (const auto& r : plan.exact) {
      buffer.narrow(0, at, r.length).copy_(whole.narrow(0, r.begin, r.length));
      at += r.length;
    }
    std::vector<torch::Tensor> ms, projections;
    for (auto& b : plan.blocks) {
      ms.push_back(whole.narrow(0, b.begin, b.rows * b.cols).view({b.rows, b.cols}));
      ms.back().add_(b.error);
      const std::int64_t n = (right ? b.rows : b.cols);
      projections.push_back(buffer.narrow(0, at, n * b.rank).view({n, b.rank}));
      if (right)
        torch::mm_out(projections.back(), ms.back(), b.q);
      else
        torch::mm_out(projections.back(), ms.back().t(), b.p);
      at += n * b.rank;
    }
    across.sum(buffer.data_ptr(), std::size_t(buffer.numel()), comm::DType::f32);
    at = 0;
    for (const auto& r : plan.exact) {
      whole.narrow(0, r.begin, r.length).copy_(buffer.narrow(0, at, r.length));
      at += r.length;
    }
    for (std::size_t i = 0; i < plan.blocks.size(); ++i) {
      auto& b = plan.blocks[i];
      const auto left = right ? projections[i] : b.p, right_t = right ? b.q.t() : projections[i].t();
      torch::addmm_out(b.error, ms[i], left, right_t, /*beta=*/1, /*alpha=*/-1.0 / machines);
      torch::mm_out(ms[i], left, right_t);
      auto basis = projections[i].clone();
      orthonormalize(basis);
      (right ? b.p : b.q) = basis;
    }
    plan.right_side = !right;
    bytes_across_ = std::uint64_t(allreduce_bytes_sent(4.0 * double(buffer.numel()), machines));
  }

  struct Planned {
    std::size_t first_count = 0;
    Plan plan;
  };
  std::vector<BucketTensor> layout_;
  CompressionOptions options_;
  std::map<std::size_t, Planned> plans_;  // by the share's first element
  std::uint64_t bytes_across_ = 0;
};

}  // namespace

std::shared_ptr<BucketCodec> make_powersgd_codec(std::vector<BucketTensor> layout,
                                                 const CompressionOptions& options) {
  return std::make_shared<PowerSgdCodec>(std::move(layout), options);
}

}  // namespace lockstep::ddp_detail
