// `lockstep plan`: which layout (pipeline x data x tensor, ZeRO) to run a GPT on, chosen before
// running it. Every layout the job's workers allow is estimated from the model's shape, the
// machines (workers, cores and memory each, the link between them and shared memory inside one),
// and one worker's measured step (examples/gpt's metrics.jsonl); the layouts whose state and
// activations fit a worker's memory are ranked by their simulated tokens per second.
//
// The estimate, per optimiser step of m micro-batches of b sequences per replica:
//   compute   one worker's measured seconds per sequence, times b m / (P T) on each worker (slower
//             when a machine has fewer cores than workers)
//   pipeline  the 1f1b table (pipe_core/schedule.h) simulated with each stage's forward (a third
//             of its compute) and backward (two thirds), and each activation's transfer over the
//             link it crosses (shared by the ranks of the stage on that machine); the tied
//             embedding's gradient crosses from the last stage to the first once per micro-batch
//   tensor    per block and micro-batch, 2 all-reduces of b x S x h floats forward and 2 backward
//             inside the machine, on the step's path
//   data      the gradients' all-reduce over the data group (across machines when it spans them:
//             each machine's link carries its ranks' share), overlapping the last micro-batch's
//             backward; ZeRO-1 under a pipeline or tensor parallelism adds a broadcast of the
//             parameters, ZeRO-3 half an all-reduce more
//   memory    parameters, gradients and AdamW's two moments (4 + 4 + 8 bytes an element) of the
//             worker's share (1/(P T), the ZeRO-sharded parts 1/D more), and the measured
//             activations of the micro-batches a stage holds at once
// The figures are the algorithm's, not a promise: bench/compare_layouts.py measures four layouts
// across two namespace machines and checks the first pick against the fastest.
#pragma once

#include <string>
#include <vector>

namespace lockstep::doctor {

struct PlanModel {  // the GPT's shape (models/gpt.h's GptConfig)
  int n_layer = 4, n_head = 4, n_embd = 256, block_size = 128, vocab_size = 256;
  double parameters() const;  // embeddings, blocks, final norm (the head is tied)
};

struct PlanMachines {
  int nodes = 1;
  int nproc_per_node = 1;
  int cores = 1;                         // per machine: workers beyond it share them
  double link_bytes_per_second = 0;      // between machines, each way
  double machine_bytes_per_second = 0;   // an all-reduce's bus bandwidth inside one machine
  double memory_bytes = 0;               // per machine
  int world() const { return nodes * nproc_per_node; }
};

struct PlanStep {  // one worker's step, measured
  int micro_batch = 1;    // b: sequences per micro-batch
  int micro_batches = 1;  // m: micro-batches per step and replica
  double seconds_per_sequence = 0;         // forward, backward and optimizer, per sequence
  // What one sequence's forward keeps for backward; from a run, its step's tensor growth per
  // sequence, which also holds the step's temporaries (and the gradients, where zero_grad frees
  // them): an upper bound, so the memory a layout is said to need errs high.
  double activation_bytes_per_sequence = 0;
};

struct LayoutEstimate {
  int pipeline = 1, data = 1, tensor = 1, zero = 0;
  double step_seconds = 0, tokens_per_second = 0;
  double compute_seconds = 0;   // per worker, its share of the model
  double pipeline_seconds = 0;  // the pipeline's makespan beyond its compute (bubble, transfers)
  double tensor_seconds = 0;    // the tensor group's all-reduces
  double data_seconds = 0;      // the data group's reduction not hidden behind backward
  double memory_bytes = 0;      // per worker
  bool fits = true;
  std::string name() const;  // "2 pipeline x 2 tensor", "4 data (ZeRO-1)"
};

// Every layout the world allows (T dividing the workers per machine, the heads and the vocabulary;
// P at most the model's units; ZeRO 0-3 without a pipeline or tensor parallelism, else 0 or 1),
// estimated; fitting ones first, each group by tokens/s, fastest first. ConfigError when an input
// is missing or out of range (no measured step, a link of 0 between several machines, ...).
std::vector<LayoutEstimate> plan_layouts(const PlanModel& model, const PlanMachines& machines, const PlanStep& step);

// The ranking as a table: layout, tokens/s, step seconds and their parts, memory per worker.
std::string describe_plan(const std::vector<LayoutEstimate>& ranked, const PlanMachines& machines, int top);

// One worker's step from a run's metrics.jsonl (examples/gpt run with one worker): the seconds
// per sequence (the log windows' step seconds after the first, over the sequences of a step) and
// the step's tensor growth per sequence. ConfigError naming the file and what is missing (a run of
// several workers, no log window after the first).
PlanStep step_of_run(const std::string& run_dir);

// "100mbit", "1gbit", "10gbit", "2GB/s", "500MB/s" as bytes per second; ConfigError otherwise.
double parse_rate(const std::string& rate);

}  // namespace lockstep::doctor
