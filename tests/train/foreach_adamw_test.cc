// ForeachAdamW and FusedAdamW against libtorch's AdamW on the CPU, step after step, with weight
// decay, a parameter that misses steps (its own step count) and a state handed from one class to
// the other through a checkpoint: ForeachAdamW bitwise, FusedAdamW to a few ulps.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sstream>
#include <vector>

#include "lockstep/train/foreach_adamw.h"

namespace {

std::vector<torch::Tensor> fresh_parameters() {
  torch::manual_seed(7);
  return {torch::randn({33, 17}, torch::requires_grad()), torch::randn({17}, torch::requires_grad()),
          torch::randn({5, 3, 2}, torch::requires_grad())};
}

// Gradients drawn per step; the last parameter gets none on steps 2 and 5.
void set_gradients(std::vector<torch::Tensor>& params, int step) {
  torch::manual_seed(100 + step);
  for (std::size_t i = 0; i < params.size(); ++i) {
    const bool skipped = i + 1 == params.size() && (step == 2 || step == 5);
    params[i].mutable_grad() = skipped ? torch::Tensor() : torch::randn_like(params[i]);
  }
}

torch::optim::AdamWOptions options() { return torch::optim::AdamWOptions(3e-3).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1); }

using Compare = void (*)(const std::vector<torch::Tensor>&, const std::vector<torch::Tensor>&, int);

void expect_bitwise_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b, int step) {
  for (std::size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(torch::equal(a[i], b[i])) << "parameter " << i << " differs after step " << step;
}

// A few ulps of float32 apart (the parameters are about 1; each step moves them by about 3e-3).
void expect_ulps_apart(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b, int step) {
  for (std::size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(torch::allclose(a[i], b[i], 1e-6, 1e-6))
        << "parameter " << i << " differs after step " << step << " by " << (a[i] - b[i]).abs().max().item<float>();
}

// Six steps of libtorch's AdamW and of Ours side by side, compared after each; then Ours' state
// saved and loaded into libtorch's AdamW over copies, and one more step on each, compared again.
template <class Ours>
void run_against_libtorchs_adamw(Compare compare) {
  auto theirs = fresh_parameters(), ours = fresh_parameters();
  torch::optim::AdamW reference(theirs, options());
  Ours optimizer(ours, options());
  for (int step = 1; step <= 6; ++step) {
    set_gradients(theirs, step);
    set_gradients(ours, step);
    reference.step();
    optimizer.step();
    compare(theirs, ours, step);
  }
  EXPECT_FALSE(torch::allclose(theirs[0], fresh_parameters()[0], 1e-3, 1e-3));  // it trained at all

  std::stringstream saved;
  {
    torch::serialize::OutputArchive archive;
    optimizer.save(archive);
    archive.save_to(saved);
  }
  std::vector<torch::Tensor> copies;
  for (const auto& p : ours) copies.push_back(p.detach().clone().requires_grad_());
  torch::optim::AdamW resumed(copies, options());
  torch::serialize::InputArchive archive;
  archive.load_from(saved);
  resumed.load(archive);
  set_gradients(copies, 7);
  set_gradients(ours, 7);
  resumed.step();
  optimizer.step();
  compare(copies, ours, 7);
}

}  // namespace

TEST(ForeachAdamW, IsLibtorchsAdamWBitwiseOnTheCpuAndSharesItsCheckpoints) {
  run_against_libtorchs_adamw<lockstep::ForeachAdamW>(expect_bitwise_equal);
}

TEST(FusedAdamW, IsLibtorchsAdamWToAFewUlpsAndSharesItsCheckpoints) {
  if (!lockstep::FusedAdamW::available()) GTEST_SKIP() << "this libtorch (before 2.4) has no fused AdamW kernel";
  run_against_libtorchs_adamw<lockstep::FusedAdamW>(expect_ulps_apart);
}
