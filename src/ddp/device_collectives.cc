#include "device_collectives.h"

#include <torch/cuda.h>

#include "lockstep/ddp/comm_dtype.h"
#include "lockstep/error.h"

namespace lockstep::ddp_detail {
namespace {

comm::DType dtype_of(const torch::Tensor& t) {
  const auto d = comm_dtype_of(t.scalar_type());
  if (!d) throw ConfigError(std::string("a collective cannot move ") + c10::toString(t.scalar_type()) + " tensors");
  return *d;
}

// Whether the communicator takes `t`'s own memory; a GPU tensor's, once the device is done
// writing it.
bool in_place(comm::Communicator& comm, const torch::Tensor& t) {
  if (t.is_cpu()) return true;
  if (!comm.takes_device_memory()) return false;
  torch::cuda::synchronize(t.device().index());
  return true;
}

torch::Tensor on_host(const torch::Tensor& t) {
  return t.to(torch::kCPU).contiguous();
}

}  // namespace

comm::WorkPtr allgather_anywhere(comm::Communicator& comm, const torch::Tensor& send, const torch::Tensor& recv) {
  if (send.device() != recv.device())
    throw ConfigError("all-gather from " + send.device().str() + " into " + recv.device().str());
  const auto count = std::size_t(send.numel());
  if (in_place(comm, recv)) return comm.allgather(send.data_ptr(), recv.data_ptr(), count, dtype_of(send));
  auto host_send = on_host(send), host_recv = torch::empty_like(recv, recv.options().device(torch::kCPU));
  comm.allgather(host_send.data_ptr(), host_recv.data_ptr(), count, dtype_of(send))->wait();
  recv.copy_(host_recv);
  return nullptr;
}

comm::WorkPtr broadcast_anywhere(comm::Communicator& comm, const torch::Tensor& t, int root) {
  if (in_place(comm, t)) return comm.broadcast(t.data_ptr(), std::size_t(t.numel()), dtype_of(t), root);
  auto host = on_host(t);
  comm.broadcast(host.data_ptr(), std::size_t(host.numel()), dtype_of(t), root)->wait();
  t.copy_(host);
  return nullptr;
}

comm::WorkPtr allreduce_sum_anywhere(comm::Communicator& comm, const torch::Tensor& t) {
  return allreduce_anywhere(comm, t, comm::ReduceOp::sum);
}

comm::WorkPtr allreduce_anywhere(comm::Communicator& comm, const torch::Tensor& t, comm::ReduceOp op) {
  if (in_place(comm, t)) return comm.allreduce(t.data_ptr(), std::size_t(t.numel()), dtype_of(t), op);
  auto host = on_host(t);
  comm.allreduce(host.data_ptr(), std::size_t(host.numel()), dtype_of(t), op)->wait();
  t.copy_(host);
  return nullptr;
}

comm::WorkPtr reduce_scatter_sum_anywhere(comm::Communicator& comm, const torch::Tensor& send,
                                          const torch::Tensor& recv) {
  if (send.device() != recv.device())
    throw ConfigError("reduce-scatter from " + send.device().str() + " into " + recv.device().str());
  const auto count = std::size_t(recv.numel());
  if (in_place(comm, send))
    return comm.reduce_scatter(send.data_ptr(), recv.data_ptr(), count, dtype_of(send), comm::ReduceOp::sum);
  auto host_send = on_host(send), host_recv = torch::empty_like(recv, recv.options().device(torch::kCPU));
  comm.reduce_scatter(host_send.data_ptr(), host_recv.data_ptr(), count, dtype_of(send), comm::ReduceOp::sum)->wait();
  recv.copy_(host_recv);
  return nullptr;
}

void finish(const comm::WorkPtr& work) {
  if (work) work->wait();
}

}  // namespace lockstep::ddp_detail
