// The checker: counts and local order first (a table that fails them is described by its first
// fault), then the table run rank by rank, each as far as its recvs allow, until every rank is
// done or all that are left wait (a deadlock, described by its cycle of waits). The same run with
// costs gives the timeline: a rank's clock advances by its compute and jumps forward to a send's
// time (plus the transfer) when its recv had to wait for it.
#include "lockstep/pipe_core/schedule_check.h"

#include <algorithm>
#include <stdexcept>

namespace lockstep::pipe_core {
namespace {

constexpr int kOps = 10;

struct Invalid : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Where each (op, stage, micro-batch) sits in its rank's list, or -1.
class Positions {
 public:
  explicit Positions(const ScheduleTable& t)
      : stages_(t.stages()), m_(t.micro_batches), at_(std::size_t(kOps) * std::size_t(stages_) * std::size_t(m_), -1) {
    for (int r = 0; r < t.ranks; ++r) {
      const auto& list = t.actions[std::size_t(r)];
      for (std::size_t i = 0; i < list.size(); ++i) {
        const Action& a = list[i];
        if (a.stage < 0 || a.stage >= stages_ || a.micro_batch < 0 || a.micro_batch >= m_)
          throw Invalid("rank " + std::to_string(r) + " has " + to_string(a) + ", outside " + std::to_string(stages_) +
                        " stages and " + std::to_string(m_) + " micro-batches");
        if (t.rank_of(a.stage) != r)
          throw Invalid("rank " + std::to_string(r) + " has " + to_string(a) + ", but stage " + std::to_string(a.stage) +
                        " is on rank " + std::to_string(t.rank_of(a.stage)));
        int& slot = at_[index(a.op, a.stage, a.micro_batch)];
        if (slot >= 0) throw Invalid(to_string(a) + " appears twice on rank " + std::to_string(r));
        slot = int(i);
      }
    }
  }
  int operator()(Op op, int s, int k) const { return at_[index(op, s, k)]; }

 private:
  std::size_t index(Op op, int s, int k) const {
    return (std::size_t(op) * std::size_t(stages_) + std::size_t(s)) * std::size_t(m_) + std::size_t(k);
  }
  int stages_, m_;
  std::vector<int> at_;
};

// Whether the table must hold (op, s, k).
bool expected(const ScheduleTable& t, Op op, int s, int k) {
  const int last = t.stages() - 1;
  const bool tied_here = t.tied && last > 0 && (!t.tied_once || k == t.micro_batches - 1);
  const bool backward = !t.forward_only;
  switch (op) {
    case Op::forward: return true;
    case Op::recv_activation: return s > 0;
    case Op::send_activation: return s < last;
    case Op::backward: return backward && !t.split_backward();
    case Op::backward_input:
    case Op::backward_weight: return backward && t.split_backward();
    case Op::recv_gradient: return backward && s < last;
    case Op::send_gradient: return backward && s > 0;
    case Op::send_tied: return backward && tied_here && s == last;
    case Op::recv_tied: return backward && tied_here && s == 0;
  }
  return false;
}

void check_presence(const ScheduleTable& t, const Positions& at) {
  for (int op = 0; op < kOps; ++op)
    for (int s = 0; s < t.stages(); ++s)
      for (int k = 0; k < t.micro_batches; ++k) {
        const Action a{Op(op), s, k};
        const bool want = expected(t, a.op, s, k), have = at(a.op, s, k) >= 0;
        if (want && !have) throw Invalid(to_string(a) + " is missing (rank " + std::to_string(t.rank_of(s)) + ")");
        if (!want && have) throw Invalid(to_string(a) + " does not belong in a " + schedule_name(t.kind) + " table");
      }
}

// `before` must come earlier than `after` on their rank, when both are in the table.
void require_order(const Positions& at, Action before, Action after) {
  const int b = at(before.op, before.stage, before.micro_batch), a = at(after.op, after.stage, after.micro_batch);
  if (b >= 0 && a >= 0 && b >= a) throw Invalid(to_string(after) + " runs before " + to_string(before) + ", which it needs");
}

void check_local_order(const ScheduleTable& t, const Positions& at) {
  const int last = t.stages() - 1;
  const Op grad = t.split_backward() ? Op::backward_input : Op::backward, weight = t.weight_op();
  for (int s = 0; s <= last; ++s)
    for (int k = 0; k < t.micro_batches; ++k) {
      require_order(at, {Op::recv_activation, s, k}, {Op::forward, s, k});
      require_order(at, {Op::forward, s, k}, {Op::send_activation, s, k});
      if (t.forward_only) continue;
      require_order(at, {Op::forward, s, k}, {grad, s, k});
      require_order(at, {Op::recv_gradient, s, k}, {grad, s, k});
      require_order(at, {grad, s, k}, {Op::send_gradient, s, k});
      require_order(at, {Op::backward_input, s, k}, {Op::backward_weight, s, k});
      require_order(at, {grad, s, k}, {Op::send_tied, s, k});
      require_order(at, {Op::recv_tied, s, k}, {weight, s, k});
      if (k > 0 && at(weight, s, k - 1) > at(weight, s, k))
        throw Invalid("stage " + std::to_string(s) + " accumulates micro-batch " + std::to_string(k) + " before " +
                      std::to_string(k - 1) + ": its gradient sums would not be one process's");
    }
}

// A transfer by the stage that receives it: kind (0 activation, 1 gradient, 2 tied), stage, micro-batch.
struct Message {
  int channel = -1, stage = 0, micro_batch = 0, sender_stage = 0;
};

Message message_of(const ScheduleTable& t, const Action& a) {
  const int s = a.stage, k = a.micro_batch, last = t.stages() - 1;
  switch (a.op) {
    case Op::send_activation: return {0, s + 1, k, s};
    case Op::recv_activation: return {0, s, k, s - 1};
    case Op::send_gradient: return {1, s - 1, k, s};
    case Op::recv_gradient: return {1, s, k, s + 1};
    case Op::send_tied: return {2, 0, k, s};
    case Op::recv_tied: return {2, s, k, last};
    default: return {};
  }
}

bool is_send(Op op) {
  return op == Op::send_activation || op == Op::send_gradient || op == Op::send_tied;
}

double cost_of(const ActionCosts& c, Op op) {
  switch (op) {
    case Op::forward: return c.forward;
    case Op::backward: return c.backward;
    case Op::backward_input: return c.backward_input;
    case Op::backward_weight: return c.backward_weight;
    default: return 0;
  }
}

// Runs the table, compute actions taking cost(action) and transfers `transfer`; Invalid naming
// the cycle of waits when it deadlocks.
Timeline run(const ScheduleTable& t, const std::function<double(const Action&)>& cost, double transfer) {
  const int ranks = t.ranks;
  const std::size_t messages = 3 * std::size_t(t.stages()) * std::size_t(t.micro_batches);
  auto key = [&](const Message& msg) {
    return (std::size_t(msg.channel) * std::size_t(t.stages()) + std::size_t(msg.stage)) * std::size_t(t.micro_batches) +
           std::size_t(msg.micro_batch);
  };
  std::vector<double> sent_at(messages, -1);
  std::vector<std::size_t> pc(std::size_t(ranks), 0);
  Timeline tl;
  std::vector<double> clock(std::size_t(ranks), 0);
  tl.busy.assign(std::size_t(ranks), 0);
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (int r = 0; r < ranks; ++r) {
      const auto& list = t.actions[std::size_t(r)];
      for (std::size_t& i = pc[std::size_t(r)]; i < list.size(); ++i, progressed = true) {
        const Action& a = list[i];
        const Message msg = message_of(t, a);
        double& clk = clock[std::size_t(r)];
        if (msg.channel < 0) {
          const double c = cost(a);
          clk += c;
          tl.busy[std::size_t(r)] += c;
        } else if (is_send(a.op)) {
          sent_at[key(msg)] = clk;
        } else if (sent_at[key(msg)] < 0) {
          break;  // waits for the send
        } else {
          clk = std::max(clk, sent_at[key(msg)] + transfer);
        }
      }
    }
  }
  std::string cycle;
  std::vector<int> seen(std::size_t(ranks), 0);
  for (int r = 0; r < ranks && cycle.empty(); ++r) {
    if (pc[std::size_t(r)] == t.actions[std::size_t(r)].size()) continue;
    for (int at = r;;) {  // follow the waits from the first blocked rank
      seen[std::size_t(at)] = 1;
      const Action& a = t.actions[std::size_t(at)][pc[std::size_t(at)]];
      const int from = t.rank_of(message_of(t, a).sender_stage);
      cycle += "rank " + std::to_string(at) + " waits in " + to_string(a) + " for rank " + std::to_string(from);
      if (pc[std::size_t(from)] == t.actions[std::size_t(from)].size()) {
        cycle += ", which finished without sending it";
        break;
      }
      if (seen[std::size_t(from)]) {
        cycle += " (a cycle)";
        break;
      }
      cycle += "; ";
      at = from;
    }
  }
  if (!cycle.empty()) throw Invalid("deadlock: " + cycle);
  for (double c : clock) tl.makespan = std::max(tl.makespan, c);
  return tl;
}

}  // namespace

ScheduleCheck check_schedule(const ScheduleTable& t) {
  ScheduleCheck out;
  try {
    if (int(t.actions.size()) != t.ranks)
      throw Invalid("the table has " + std::to_string(t.actions.size()) + " ranks' lists for " + std::to_string(t.ranks) +
                    " ranks");
    const Positions at(t);
    check_presence(t, at);
    check_local_order(t, at);
    const ActionCosts unit;
    run(t, [&](const Action& a) { return cost_of(unit, a.op); }, 0);
  } catch (const Invalid& e) {
    out.error = std::string(schedule_name(t.kind)) + " table (P " + std::to_string(t.ranks) + ", v " +
                std::to_string(t.chunks) + ", m " + std::to_string(t.micro_batches) + "): " + e.what();
    return out;
  }
  for (const auto& list : t.actions) {
    int in_flight = 0, peak = 0;
    for (const Action& a : list) {
      if (a.op == Op::forward) peak = std::max(peak, ++in_flight);
      if (a.op == t.weight_op()) --in_flight;
    }
    out.peak_in_flight.push_back(peak);
  }
  return out;
}

Timeline simulate(const ScheduleTable& table, const std::vector<ActionCosts>& costs) {
  if (costs.size() != 1 && int(costs.size()) != table.stages())
    throw std::logic_error("simulate: give one ActionCosts, or one per stage");
  auto of = [&](int stage) -> const ActionCosts& { return costs.size() == 1 ? costs[0] : costs.at(std::size_t(stage)); };
  if (const auto check = check_schedule(table); !check.ok()) throw std::logic_error(check.error);
  // Transfers into a stage take its ActionCosts::transfer.
  bool uniform_transfer = true;
  for (const auto& c : costs) uniform_transfer &= c.transfer == costs[0].transfer;
  if (!uniform_transfer) throw std::logic_error("simulate: every stage's transfer must take the same time");
  return run(table, [&](const Action& a) { return cost_of(of(a.stage), a.op); }, costs[0].transfer);
}

Timeline simulate(const ScheduleTable& table, const std::function<double(const Action&)>& seconds, double transfer) {
  if (const auto check = check_schedule(table); !check.ok()) throw std::logic_error(check.error);
  return run(table, seconds, transfer);
}

}  // namespace lockstep::pipe_core
