// Tensors between the ranks of a pipeline, over the communicator's point-to-point path (a
// shared-memory lane between ranks on one machine, TCP between machines: comm/communicator.h):
// each tensor as one described message, its element type and shape in front of its bytes, so
// that a receiver needs to know nothing in advance (the last micro-batch of an epoch may be
// smaller) and still gets the bytes straight into the tensor it returns. Sends return at once;
// the tensor is kept alive until the transport has taken it. A GPU tensor goes through host memory.
#pragma once

#include <torch/types.h>

#include <deque>
#include <map>
#include <memory>
#include <utility>

#include "lockstep/comm/communicator.h"

namespace lockstep::pipe {

class TensorChannel {
 public:
  explicit TensorChannel(comm::Communicator& comm) : comm_(comm) {}
  ~TensorChannel();
  void send(const torch::Tensor& tensor, int dst, int tag);
  // Posts the recv of the next tensor from `src` with `tag` now, so that its bytes go straight
  // into its tensor as they arrive, however late recv() asks for it (a recv posted after its
  // message arrived costs a staging copy).
  void expect(int src, int tag);
  // Waits for the tensor (the communicator's timeout; PeerError when the sender died); on
  // `device`. Takes the oldest expect() of (src, tag) if there is one.
  torch::Tensor recv(int src, int tag, const torch::Device& device);
  // Returns once the transport took every send (rethrows a send's error).
  void wait_sends();
  // Whether expected tensors were never taken (a step failed before its recvs): their recvs stay
  // posted and would take the next step's tensors.
  bool has_expectations() const { return !expected_.empty(); }

 private:
  struct Expected {
    comm::WorkPtr work;
    std::shared_ptr<torch::Tensor> tensor;  // filled by the transport when the message arrives
  };
  Expected post(int src, int tag);
  void forget_finished_sends();
  comm::Communicator& comm_;
  std::deque<std::pair<comm::WorkPtr, torch::Tensor>> in_flight_;
  std::map<std::pair<int, int>, std::deque<Expected>> expected_;
};

}  // namespace lockstep::pipe
