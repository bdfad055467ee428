// Tensors between the ranks of a pipeline, over the communicator's point-to-point path (a TCP
// mailbox per rank: comm/communicator.h): each tensor as a header (element type, shape) and then
// its bytes, both on the transfer's tag, so that a receiver needs to know nothing in advance (the
// last micro-batch of an epoch may be smaller). Sends return at once; the tensor is kept alive
// until the transport has taken it. A GPU tensor goes through host memory.
#pragma once

#include <torch/types.h>

#include <deque>
#include <utility>

#include "lockstep/comm/communicator.h"

namespace lockstep::pipe {

class TensorChannel {
 public:
  explicit TensorChannel(comm::Communicator& comm) : comm_(comm) {}
  ~TensorChannel();
  void send(const torch::Tensor& tensor, int dst, int tag);
  // Waits for the tensor (the communicator's timeout; PeerError when the sender died); on `device`.
  torch::Tensor recv(int src, int tag, const torch::Device& device);
  // Returns once the transport took every send (rethrows a send's error).
  void wait_sends();

 private:
  void forget_finished_sends();
  comm::Communicator& comm_;
  std::deque<std::pair<comm::WorkPtr, torch::Tensor>> in_flight_;
};

}  // namespace lockstep::pipe
