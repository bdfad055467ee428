// What a model gives the pipeline (pipe/pipeline.h): its units in order, each a function from the
// activations before it to those after it, with the parameters it reads. A stage runs a
// contiguous range of units; the first unit takes the batch's input, the last one's output goes
// to the loss.
//
//   std::vector<lockstep::pipe::PipelineUnit> units = gpt->pipeline_units();  // models/gpt.h's
//
// Rules a model keeps so that a pipelined run equals an unpipelined one:
//   - a unit depends on nothing but its input, its parameters and the micro-batch's seed; the
//     model's own forward is these units in order (the same ops, so the same bits);
//   - `parameters` lists every parameter the unit reads, by the model's names, in the order the
//     model registers them; a parameter two units read (a language model's tied embedding and
//     head) is the same tensor in both, and the pipeline keeps the copies of it on two stages
//     exact (pipe/pipeline.h, "tied parameters");
//   - randomness (dropout) comes from `seed`, which the pipeline draws once per micro-batch from
//     the default CPU generator, as the unpipelined model draws one per forward: a unit mixes in
//     its own index and draws from that, so that each micro-batch gets its masks whichever stage
//     runs the unit, and whenever.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace lockstep::pipe {

struct PipelineUnit {
  std::string name;  // "h.3" (in the plan the pipeline prints)
  std::vector<std::pair<std::string, torch::Tensor>> parameters;  // "transformer.h.3.ln_1.weight", ...
  std::function<torch::Tensor(const torch::Tensor& input, std::uint64_t seed)> forward;
};

}  // namespace lockstep::pipe
