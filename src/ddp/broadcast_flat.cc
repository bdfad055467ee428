// Rank 0's tensors to every rank in few collectives (see broadcast_flat.h).
#include "broadcast_flat.h"

#include <map>

#include "reducer_impl.h"

namespace lockstep::ddp_detail {

// One broadcast per dtype and per 64 MB of tensors (a larger one alone), of each group flattened:
// few collectives, and no copy of the whole model at once (a model that barely fits must not
// need twice its size here).
void broadcast_flat(comm::Communicator& comm, std::vector<torch::Tensor> tensors, const std::string& what) {
  constexpr std::int64_t kChunkBytes = 64 << 20;
  std::map<torch::ScalarType, std::vector<std::vector<torch::Tensor>>> chunks;
  for (auto& t : tensors) {
    auto& list = chunks[t.scalar_type()];
    std::int64_t bytes = 0;
    if (!list.empty())
      for (auto& u : list.back()) bytes += u.numel() * std::int64_t(u.element_size());
    if (list.empty() || bytes + t.numel() * std::int64_t(t.element_size()) > kChunkBytes) list.emplace_back();
    list.back().push_back(t);
  }
  torch::NoGradGuard no_grad;
  for (auto& [dtype, list] : chunks) {
    for (auto& group : list) {
      std::vector<torch::Tensor> flat_parts;
      for (auto& t : group) flat_parts.push_back(t.detach().reshape(-1).to(torch::kCPU));
      auto flat = torch::cat(flat_parts);
      flat_parts.clear();
      comm.broadcast(flat.data_ptr(), flat.numel(), comm_dtype(dtype, what), 0)->wait();
      std::int64_t offset = 0;
      for (auto& t : group) {
        t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
        offset += t.numel();
      }
    }
  }
}

}  // namespace lockstep::ddp_detail
