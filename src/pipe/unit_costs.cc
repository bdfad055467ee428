// The units' costs for balancing stages by time: each unit's forward and backward on one
// micro-batch, fed the previous unit's output, the fastest of three runs (the first of which also
// warms the allocator and the kernels up).
#include <torch/torch.h>

#include <algorithm>
#include <limits>

#include "lockstep/base/clock.h"
#include "lockstep/ddp/autocast.h"
#include "pipeline_impl.h"

namespace lockstep::pipe {

std::vector<double> measure_unit_costs(const std::vector<PipelineUnit>& units, const MicroBatch& sample,
                                       const LossFn& loss, std::optional<torch::ScalarType> autocast) {
  constexpr int kRuns = 3;
  std::vector<double> best(units.size(), std::numeric_limits<double>::infinity());
  torch::Device device = torch::kCPU;
  for (const auto& u : units)
    if (!u.parameters.empty()) device = u.parameters.front().second.device();
  for (int run = 0; run < kRuns; ++run) {
    torch::Tensor x = sample.input.to(device);
    for (std::size_t u = 0; u < units.size(); ++u) {
      const torch::Tensor in = x.is_floating_point() ? x.detach().requires_grad_(true) : x;
      const auto begin = Clock::now();
      torch::Tensor out, root;
      {
        Autocast cast(autocast, device.type());
        out = units[u].forward(in, 0);
        root = u + 1 == units.size() ? loss(loss_input(out), sample.target.to(device)) : out;
      }
      if (root.requires_grad()) {
        if (root.dim() == 0)
          root.backward();
        else
          root.backward(torch::ones_like(root));
      }
      best[u] = std::min(best[u], seconds_between(begin, Clock::now()));
      x = out.detach();
    }
  }
  for (const auto& u : units)
    for (const auto& p : u.parameters)
      if (p.second.grad().defined()) p.second.mutable_grad() = torch::Tensor();
  return best;
}

}  // namespace lockstep::pipe
