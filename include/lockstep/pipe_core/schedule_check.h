// Proof that a schedule table (pipe_core/schedule.h) can run: complete, in order, and free of
// deadlock, and what it costs in time and memory when every action takes a given time.
//
// check_schedule walks the table as the ranks would run it. Sends never block; a recv waits for
// its matching send (same kind, the sending and receiving stage, the micro-batch). If at some
// point every unfinished rank waits in a recv, the table deadlocks, and the report names the
// cycle of waits ("rank 0 waits in recv-grad0.2 for rank 1, which waits in recv-act1.3 for rank
// 0"). It also checks that every stage forwards and backwards every micro-batch exactly once on
// the rank that holds it, that each transfer has exactly one send and one recv, that every action
// comes after what it needs on its own rank (a forward after the recv of its input, a weight half
// after its input half, ...), and that each stage accumulates weight gradients in micro-batch
// order (what makes pipelined sums bitwise the unpipelined ones).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "lockstep/pipe_core/schedule.h"

namespace lockstep::pipe_core {

struct ScheduleCheck {
  std::string error;               // empty: the table is sound
  std::vector<int> peak_in_flight;  // per rank: most micro-batches forwarded and not yet done with
  bool ok() const { return error.empty(); }
};
ScheduleCheck check_schedule(const ScheduleTable& table);

// How long each kind of action takes on one stage (seconds, or any unit).
struct ActionCosts {
  double forward = 1, backward = 2, backward_input = 1, backward_weight = 1;
  double transfer = 0;  // from a send until its recv can complete
};

// The table run with these costs (one entry for every stage, or one for all; every transfer takes
// the same time): when the last action ends, and per rank the time it computed. Its bubble is
// 1 - busy / makespan. std::logic_error on a table check_schedule rejects.
struct Timeline {
  double makespan = 0;
  std::vector<double> busy;  // per rank
  double bubble(int rank) const { return makespan > 0 ? 1 - busy[std::size_t(rank)] / makespan : 0; }
};
Timeline simulate(const ScheduleTable& table, const std::vector<ActionCosts>& costs);
// The same with each compute action's own time (a measured step: `seconds(action)`) and every
// transfer taking `transfer`.
Timeline simulate(const ScheduleTable& table, const std::function<double(const Action&)>& seconds,
                  double transfer = 0);

}  // namespace lockstep::pipe_core
