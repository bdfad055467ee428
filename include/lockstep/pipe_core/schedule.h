// Pipeline schedules as tables: for every rank of a pipeline, the list of actions it runs in one
// optimiser step, computed before the step and identical on every rank (each rank builds the same
// table from the same four numbers). The runtime (src/pipe/executor.cc) only executes a table; a
// new schedule is a new table, not new runtime code.
//
// Words. A model is cut into S = P x v contiguous *stages*; rank r of the pipeline holds stages
// r, r + P, ..., r + (v - 1) P (v "virtual stages" or chunks per rank, Megatron's layout; v = 1
// outside the interleaved schedule). A step's batch is cut into m *micro-batches*. For each stage
// s and micro-batch k there is one forward F(s,k) and either one backward B(s,k) (input and weight
// gradients together) or, in the zero-bubble schedule, a backward-input Bi(s,k) followed later by
// a backward-weight W(s,k). Activations go from s to s + 1 and their gradients back, each as a
// send on one rank and a recv on the other, written into the tables next to the compute that
// produces or needs them.
//
// The schedules:
//   gpipe        all forwards, then all backwards.                      peak in flight: m
//   1f1b         P - 1 - s forwards of warm-up, then one forward and one backward in turn.
//                                                                       peak in flight: P - s
//   interleaved  1f1b over v chunks per rank: micro-batches go through chunk 0 in rounds of at
//                least P (any m: the rounds are as equal as can be), then chunk 1, ...; the bubble
//                shrinks by about v.                             peak: (v - 1) q + 2 (P - r - 1) + 1
//                                                                (q: the first round's micro-batches)
//   zb           zero bubble (Qi et al., "Zero Bubble Pipeline Parallelism"): the backward split
//                into Bi and W; Bi runs as soon as it can, W fills the time 1f1b idles. ZB-H1's
//                idea with up to P - 1 more micro-batches than 1f1b in flight.
//                                                                peak (F to W): 2P - r - 1
//                With v > 1 chunks per rank (interleaved zero bubble), the least idle of three
//                tables in the interleaved schedule's memory (schedule.cc).
//                                                peak (F to W): at most interleaved's, above
// Every schedule runs each stage's gradient-accumulating actions (B or W) in micro-batch order
// 0, 1, ..., m - 1, the order one process accumulating the same micro-batches uses, so that the
// pipelined sums are bitwise the unpipelined ones.
//
// Sends never block (the receiving rank's mailbox takes every message as it arrives); a recv
// waits for its send. pipe_core/schedule_check.h proves a table complete and free of deadlock.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lockstep::pipe_core {

enum class ScheduleKind { gpipe, one_f_one_b, interleaved, zero_bubble };

// "gpipe", "1f1b", "interleaved", "zb"; ConfigError naming the choices for anything else.
ScheduleKind parse_schedule_kind(const std::string& name);
const char* schedule_name(ScheduleKind kind);

enum class Op : std::uint8_t {
  forward,
  backward,         // input and weight gradients together
  backward_input,   // zb: the input gradient only
  backward_weight,  // zb: the weight gradients of a micro-batch whose backward_input ran
  send_activation,  // stage s's output to stage s + 1
  recv_activation,  // stage s's input from stage s - 1
  send_gradient,    // the gradient of stage s's input to stage s - 1
  recv_gradient,    // the gradient of stage s's output from stage s + 1
  send_tied,        // a weight shared by the first and last stage: the last stage's gradient of it
  recv_tied,        // ... received by the first stage, before its own weight gradient (add_tied_exchange)
};
const char* op_name(Op op);  // "F", "B", "Bi", "W", "send-act", ...

struct Action {
  Op op = Op::forward;
  int stage = 0;        // the stage this rank acts for (a send's sender, a recv's receiver)
  int micro_batch = 0;
  bool operator==(const Action& o) const {
    return op == o.op && stage == o.stage && micro_batch == o.micro_batch;
  }
};
std::string to_string(const Action& a);  // "F3.1": forward of stage 3, micro-batch 1

struct ScheduleTable {
  ScheduleKind kind = ScheduleKind::one_f_one_b;
  int ranks = 1;          // P
  int chunks = 1;         // v
  int micro_batches = 1;  // m
  bool tied = false;      // add_tied_exchange was applied
  bool tied_once = false;  // ... with once: for the last micro-batch only
  bool forward_only = false;  // make_forward_schedule's: no backward at all
  std::vector<std::vector<Action>> actions;  // per rank, in the order it runs them

  int stages() const { return ranks * chunks; }
  int rank_of(int stage) const { return stage % ranks; }
  int chunk_of(int stage) const { return stage / ranks; }
  bool split_backward() const { return kind == ScheduleKind::zero_bubble; }
  // The action that accumulates stage s's weight gradients of micro-batch k: W, or B.
  Op weight_op() const { return split_backward() ? Op::backward_weight : Op::backward; }
  // The action that computes the gradient of stage s's input for micro-batch k: Bi, or B.
  Op input_grad_op() const { return split_backward() ? Op::backward_input : Op::backward; }
  // A 64-bit digest of every action of every rank: ranks compare it before a step first runs it.
  std::uint64_t digest() const;
};

// The table of `kind` for `ranks` x `chunks` stages and `micro_batches` micro-batches.
// ConfigError for what cannot be built: ranks or micro_batches below 1, chunks above 1 for a
// schedule other than interleaved and zb, or chunks below 1.
ScheduleTable make_schedule(ScheduleKind kind, int ranks, int micro_batches, int chunks = 1);

// A weight the first and last stage share (a language model's tied embedding and head): for each
// micro-batch k the last stage sends its gradient of the weight after its backward (under zb its
// input half, which computes that gradient early for the purpose), and the first stage receives it
// before its own weight action for k, so that it accumulates (its gradient + the last stage's)
// micro-batch by micro-batch, as one process would. Nothing changes when one stage is both.
// once: only for the last micro-batch, carrying the last stage's gradients summed over the step
// (m times fewer bytes; the sums then differ from one process's by rounding).
void add_tied_exchange(ScheduleTable& table, bool once = false);

// One rank's actions as text, e.g. "F0.0 send-act0.0 F0.1 ..." (logs, test failures).
std::string describe(const ScheduleTable& table, int rank);

// The forward-only table of an evaluation: each stage forwards every micro-batch in order.
ScheduleTable make_forward_schedule(int ranks, int micro_batches, int chunks = 1);

}  // namespace lockstep::pipe_core
