// AdamW whose update is a handful of multi-tensor (foreach) operations over all of a group's
// parameters, instead of libtorch's loop of several operations per parameter.
//
// On a GPU each foreach operation is one kernel launch (or a few) for the whole group, where
// libtorch's AdamW launches about ten per parameter tensor: a small model's step is bound by
// those launches (bench/RESULTS.md, "On a GPU"). The arithmetic is libtorch's AdamW's, operation
// for operation, and so is the state (exp_avg, exp_avg_sq and step per parameter): checkpoints
// load into either class, and on the CPU, where foreach operations run tensor by tensor, the
// two give bitwise the same parameters. amsgrad falls back to libtorch's loop.
#pragma once

#include <torch/optim/adamw.h>

#include <vector>

namespace lockstep {

class ForeachAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;

 protected:
  // One update of the parameters whose step count (after this step) is `step`.
  virtual void update(const torch::optim::AdamWOptions& options, std::int64_t step, std::vector<torch::Tensor>& params,
                      const std::vector<torch::Tensor>& grads, std::vector<torch::Tensor>& exp_avgs,
                      std::vector<torch::Tensor>& exp_avg_sqs);

 private:
  torch::optim::AdamWParamState& state_of(const torch::Tensor& p);
};

// The same AdamW and state, each update one fused kernel (libtorch 2.4 and later: the kernel
// behind torch.optim.AdamW(fused=True)) that reads and writes every element once. On the CPU it
// is 4-6x faster than libtorch's AdamW (bench/RESULTS.md) and agrees with it to a few ulps,
// not bitwise: it rounds in its own order. Where libtorch lacks the kernel, available() is false
// and step() is ForeachAdamW's.
class FusedAdamW : public ForeachAdamW {
 public:
  using ForeachAdamW::ForeachAdamW;
  static bool available();

 protected:
  void update(const torch::optim::AdamWOptions& options, std::int64_t step, std::vector<torch::Tensor>& params,
              const std::vector<torch::Tensor>& grads, std::vector<torch::Tensor>& exp_avgs,
              std::vector<torch::Tensor>& exp_avg_sqs) override;
};

}  // namespace lockstep
