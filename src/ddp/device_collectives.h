// Collectives over tensors wherever they live, host memory or a GPU's (issue 40): ZeRO's, and the
// tensor-parallel regions' (tp/regions.h).
// - On a communicator that takes device memory (nccl), a GPU tensor's own memory goes in, once
//   the device has run the kernels queued before: nccl runs on a stream of its own.
// - On any other (the host backends), GPU tensors go through host copies, and the result is
//   back on the GPU before the call returns: the work returned is null, nothing to wait for.
// - Host tensors go in as they are, and the work returned is the collective's.
#pragma once

#include <torch/torch.h>

#include "lockstep/comm/communicator.h"

namespace lockstep::ddp_detail {

// `recv` holds comm.size() times `send`'s elements, rank r's at r * send.numel().
comm::WorkPtr allgather_anywhere(comm::Communicator& comm, const torch::Tensor& send, const torch::Tensor& recv);
comm::WorkPtr broadcast_anywhere(comm::Communicator& comm, const torch::Tensor& t, int root);
comm::WorkPtr allreduce_sum_anywhere(comm::Communicator& comm, const torch::Tensor& t);
comm::WorkPtr allreduce_anywhere(comm::Communicator& comm, const torch::Tensor& t, comm::ReduceOp op);
// `send` holds comm.size() times `recv`'s elements; recv gets the sum of block comm.rank().
comm::WorkPtr reduce_scatter_sum_anywhere(comm::Communicator& comm, const torch::Tensor& send, const torch::Tensor& recv);

// Waits for a work the calls above returned, when there is one.
void finish(const comm::WorkPtr& work);

}  // namespace lockstep::ddp_detail
