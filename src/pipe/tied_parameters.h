// The parameters the first and the last stage both read (the GPT's token embedding, which its head
// reads again): the first stage owns and updates them, the last reads a copy. For each micro-batch
// (under TiedGradient::step once a step, summed) the last stage's gradient of them crosses to the
// first stage, whose hooks add it to its own before accumulating, as one process's autograd sums
// the two; after each optimizer step the first stage sends the new values back, which the last
// takes before its next step. The schedule table places the gradients' transfers
// (add_tied_exchange); the executor says whose backward runs and runs the transfers through here.
// Threading: the training thread only (the hooks run inside backward, on that thread).
#pragma once

#include <torch/torch.h>

#include <cstddef>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "tensor_channel.h"

namespace lockstep::pipe {

// What crosses between stages, as the tag of its messages on the pipeline group.
enum class Channel : int { activation = 0, gradient = 1, tied_gradient = 2, tied_value = 3 };
constexpr int kMaxStages = 256;
constexpr int kMaxMicroBatches = 65536;
inline int tag_of(Channel c, int stage, int micro_batch) {
  return (static_cast<int>(c) * kMaxStages + stage) * kMaxMicroBatches + micro_batch;
}

class TiedParameters {
 public:
  // Receives transfer (c, slot, micro_batch) from `from_stage` into `stage`, its error naming both.
  using Receive = std::function<torch::Tensor(int from_stage, int stage, Channel c, int slot, int micro_batch)>;
  struct Ends {
    int first_rank = 0, last_rank = 0;  // the pipeline ranks holding the first and the last stage
    int last_stage = 0;
  };
  TiedParameters(TensorChannel& channel, Ends ends, bool once_a_step, Receive receive);
  ~TiedParameters();  // takes its hooks off the tensors, which outlive it
  TiedParameters(const TiedParameters&) = delete;
  TiedParameters& operator=(const TiedParameters&) = delete;

  // On the first stage's rank: `tensor` (the model's `name`) gets the last stage's gradient added.
  void add_on_first(const std::string& name, torch::Tensor tensor);
  // On the last stage's rank: `tensor`'s gradients are kept to send.
  void add_on_last(torch::Tensor tensor);
  const std::vector<torch::Tensor>& tensors() const { return tensors_; }

  // A step, as the executor runs it: whose backward runs now (-1: none), and whether a whole
  // backward runs (the last stage's hooks keep what they see; under zb the input half hands its
  // gradients to keep() instead).
  void set_running(int micro_batch) { running_ = micro_batch; }
  void set_capturing(bool on) { capturing_ = on; }
  void keep(int micro_batch, std::size_t i, const torch::Tensor& grad);
  void receive_gradients(int micro_batch);  // the first stage: recv-tied
  void forget(int micro_batch);             // the first stage: micro-batch's gradients added
  void send_gradients(int micro_batch);     // the last stage: send-tied
  // After the optimizer step: the first stage sends the new values; the last drops its gradients
  // and takes the values before its next step or pass (take_values).
  void after_optimizer_step(bool first);
  void take_values();

 private:
  static constexpr int kSummed = -1;  // captured_'s key of the step's sum (TiedGradient::step)
  TensorChannel& channel_;
  Ends ends_;
  bool once_a_step_;
  Receive receive_;
  std::vector<torch::Tensor> tensors_;
  std::vector<unsigned> hooks_;
  std::map<int, std::vector<torch::Tensor>> received_;  // first stage: micro-batch -> the last's grads
  std::map<int, std::vector<torch::Tensor>> captured_;  // last stage: micro-batch -> its grads
  int running_ = -1;
  bool capturing_ = false;
  bool values_due_ = false;  // last stage: the first stage sent new values after its step
};

}  // namespace lockstep::pipe
