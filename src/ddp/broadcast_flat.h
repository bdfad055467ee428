// Rank 0's tensors to every rank in few collectives: the reducer's start and buffer refreshes,
// and local SGD's common starting point.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "lockstep/comm/communicator.h"

namespace lockstep::ddp_detail {

// One broadcast per dtype and per 64 MB of tensors, each group flattened; `what` names the
// tensors in the error for a dtype the communicator cannot carry ("a parameter").
void broadcast_flat(comm::Communicator& comm, std::vector<torch::Tensor> tensors, const std::string& what);

}  // namespace lockstep::ddp_detail
