#include "lockstep/ddp/gradient_checkpoint.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/torch.h>

#include "lockstep/ddp/cpu_rng.h"
#include "lockstep/ddp/torch_compat.h"

namespace lockstep {
namespace {

// The CPU generator set to `state` for the scope, and put back where it was after: the rest of
// backward, and the next step, draw exactly what they would have drawn without recomputation.
class RngReplay {
 public:
  explicit RngReplay(const torch::Tensor& state) : resume_(cpu_rng_state()) { set_cpu_rng_state(state); }
  ~RngReplay() { set_cpu_rng_state(resume_); }
  RngReplay(const RngReplay&) = delete;
  RngReplay& operator=(const RngReplay&) = delete;

 private:
  torch::Tensor resume_;
};

// Autocast's state on the devices a forward may run on.
constexpr at::DeviceType kAutocastDevices[] = {at::kCPU, at::kCUDA};

struct AutocastState {
  bool enabled[2];
  at::ScalarType dtype[2];
  AutocastState() {
    for (int i = 0; i < 2; ++i) {
      enabled[i] = torch_compat::autocast_enabled(kAutocastDevices[i]);
      dtype[i] = torch_compat::autocast_dtype(kAutocastDevices[i]);
    }
  }
  void apply() const {
    for (int i = 0; i < 2; ++i) {
      torch_compat::set_autocast_enabled(kAutocastDevices[i], enabled[i]);
      torch_compat::set_autocast_dtype(kAutocastDevices[i], dtype[i]);
    }
  }
};

// The forward's autocast state (CPU and CUDA), again, for the recomputation.
class AutocastReplay {
 public:
  explicit AutocastReplay(const AutocastState& s) {
    s.apply();
    at::autocast::increment_nesting();
  }
  ~AutocastReplay() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    previous_.apply();
  }
  AutocastReplay(const AutocastReplay&) = delete;
  AutocastReplay& operator=(const AutocastReplay&) = delete;

 private:
  AutocastState previous_;  // captured before the constructor's body applies the forward's
};

// The backward of one checkpointed call: recompute, then backpropagate through the new graph.
struct RecomputeBackward : torch::autograd::Node {
  RecomputeBackward(CheckpointedBlock block, torch::Tensor input, torch::Tensor rng, AutocastState autocast)
      : block_(std::move(block)),
        input_(std::move(input)),
        input_needs_grad_(input_.requires_grad()),
        rng_(std::move(rng)),
        autocast_(autocast) {}

  std::string name() const override { return "lockstep::RecomputeBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    TORCH_CHECK(input_.defined(), "lockstep::gradient_checkpoint: backward through the same block twice (its input "
                                  "was released after the first backward; pass retain_graph only without checkpointing)");
    torch::Tensor x = input_.detach().requires_grad_(input_needs_grad_);
    torch::Tensor out;
    {
      RngReplay rng(rng_);
      AutocastReplay cast(autocast_);
      torch::AutoGradMode enable(true);
      out = block_(x);
    }
    if (out.requires_grad() && grads[0].defined()) torch::autograd::backward({out}, {grads[0]});
    return {input_needs_grad_ ? x.grad() : torch::Tensor()};
  }

  void release_variables() override { input_.reset(); }

 private:
  CheckpointedBlock block_;
  torch::Tensor input_;
  bool input_needs_grad_;
  torch::Tensor rng_;
  AutocastState autocast_;
};

}  // namespace

torch::Tensor gradient_checkpoint(const CheckpointedBlock& block, const torch::Tensor& input) {
  if (!torch::GradMode::is_enabled()) return block(input);
  torch::Tensor rng = cpu_rng_state();
  const AutocastState autocast;
  torch::Tensor out;
  {
    torch::NoGradGuard no_grad;
    out = block(input);
  }
  auto node = torch_compat::make_node<RecomputeBackward>(block, input, std::move(rng), autocast);
  node->set_next_edges(torch::autograd::collect_next_edges(input));
  torch::autograd::set_history(out, node);
  return out;
}

}  // namespace lockstep
