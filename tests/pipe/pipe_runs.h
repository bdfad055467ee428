// Training runs for the pipeline's tests: a small GPT trained for some steps either through a
// pipeline (pipe/pipeline.h) or as the reference the pipeline promises to equal: one process (or
// D processes under DDP) running the model's own forward over the same micro-batches in the same
// order, with the same loss weights, clipping and optimizer. Used by the tests with ranks as
// threads and by pipe_worker, whose ranks are processes.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "lockstep/comm/communicator.h"
#include "lockstep/models/gpt.h"
#include "lockstep/pipe/pipeline.h"

namespace lockstep::testing {

struct PipeRun {
  pipe::ScheduleKind schedule = pipe::ScheduleKind::one_f_one_b;
  int pipeline = 2;  // P
  int chunks = 1;    // v
  int micro_batches = 2;
  int replicas = 1;  // D
  int steps = 20;
  std::string split;  // units per stage; empty: balanced by parameters (deterministic)
  double dropout = 0;
  bool checkpointing = false;
  double max_grad_norm = 1.0;
  bool tied_once = false;  // the tied gradient once a step (PipelineOptions::TiedGradient::step)
  std::string describe() const;
};

// 6 blocks (8 units), 2 heads, 16 wide, 8 tokens of context, a vocabulary of 32.
models::GptConfig tiny_gpt(double dropout);
// The same weights on every rank and thread (torch's default generator is seeded under a lock).
models::GptLmHeadModel make_model(const models::GptConfig& config, bool checkpointing);

// Replica d's micro-batches of `step`: 2m + 1 sequences cut into m micro-batches as equal as can
// be (the larger first), each weighted by its share of the replica's sequences.
std::vector<pipe::MicroBatch> micro_batches(const PipeRun& run, int replica, int step);

using Parameters = std::map<std::string, torch::Tensor>;
// Every parameter after the run. `ddp`: the D replicas' communicator (DDP over it), or null for D 1.
Parameters reference_run(const PipeRun& run, comm::Communicator* ddp, int replica);
// This rank's owned parameters after the pipelined run (collective over `world`, P x D ranks).
Parameters pipelined_run(const PipeRun& run, comm::Communicator& world);

// Names of the parameters whose bytes differ ("" when none), and the largest absolute difference.
std::string differing(const Parameters& expected, const Parameters& got, double* max_difference = nullptr);

}  // namespace lockstep::testing
