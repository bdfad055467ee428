// ProcessGroupLockstep: the coalesced tensor forms of all_gather and reduce_scatter, which torch
// 2.x's coalescing manager (and so FSDP2, which gathers and scatters a group of parameters at a
// time) calls with one output and one input per collective.
//
// Each pair is issued as its own collective, in the list's order (the same on every rank), and
// one Work stands for all of them: its completion waits for theirs. The completion pool takes
// works in issue order, so by the time it reaches the coalesced one, its parts are done.
#include <stdexcept>
#include <string>

#include "process_group.h"

namespace lockstep::torch_backend {
namespace {

void check_pairs(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs, const char* name) {
  if (outputs.size() != inputs.size())
    throw std::runtime_error(std::string("lockstep: ") + name + " needs one output per input, got " +
                             std::to_string(outputs.size()) + " outputs and " + std::to_string(inputs.size()) +
                             " inputs");
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::coalesce(c10d::OpType type,
                                                              std::vector<c10::intrusive_ptr<c10d::Work>> parts,
                                                              std::vector<at::Tensor> outputs) {
  return launch(
      type, [](comm::Communicator&) { return std::vector<comm::WorkPtr>{}; },
      [parts = std::move(parts)] {
        for (const auto& part : parts) part->wait();
      },
      std::move(outputs));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  check_pairs(outputs, inputs, "all_gather_into_tensor (coalesced)");
  std::vector<c10::intrusive_ptr<c10d::Work>> parts;
  for (std::size_t i = 0; i < inputs.size(); ++i) parts.push_back(_allgather_base(outputs[i], inputs[i], opts));
  return coalesce(c10d::OpType::ALLGATHER_COALESCED, std::move(parts), outputs);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  check_pairs(outputs, inputs, "reduce_scatter_tensor (coalesced)");
  std::vector<c10::intrusive_ptr<c10d::Work>> parts;
  for (std::size_t i = 0; i < inputs.size(); ++i) parts.push_back(_reduce_scatter_base(outputs[i], inputs[i], opts));
  return coalesce(c10d::OpType::REDUCE_SCATTER, std::move(parts), outputs);
}

}  // namespace lockstep::torch_backend
