// The schedule tables. GPipe, 1F1B and interleaved 1F1B have closed forms (below, each with its
// order); zb is built by list scheduling (ZeroBubbleScheduler). Either way the result is only
// an order of each rank's actions: the runtime keeps it whatever the real durations, and
// schedule_check.h proves it complete and free of deadlock.
#include "lockstep/pipe_core/schedule.h"

#include <algorithm>
#include <deque>
#include <limits>
#include <optional>
#include <stdexcept>

#include "lockstep/error.h"
#include "lockstep/pipe_core/schedule_check.h"

namespace lockstep::pipe_core {
namespace {

struct Work {
  Op op;
  int stage, micro_batch;
};

// A rank's compute, with the recv each one needs before it and the send of what it produced.
std::vector<Action> with_transfers(const std::vector<Work>& compute, int stages) {
  std::vector<Action> out;
  for (const Work& w : compute) {
    const int s = w.stage, k = w.micro_batch;
    if (w.op == Op::forward) {
      if (s > 0) out.push_back({Op::recv_activation, s, k});
      out.push_back({Op::forward, s, k});
      if (s < stages - 1) out.push_back({Op::send_activation, s, k});
    } else if (w.op == Op::backward || w.op == Op::backward_input) {
      if (s < stages - 1) out.push_back({Op::recv_gradient, s, k});
      out.push_back({w.op, s, k});
      if (s > 0) out.push_back({Op::send_gradient, s, k});
    } else {
      out.push_back({w.op, s, k});
    }
  }
  return out;
}

ScheduleTable table_of(ScheduleKind kind, int ranks, int chunks, int micro_batches,
                       const std::vector<std::vector<Work>>& compute) {
  ScheduleTable t;
  t.kind = kind;
  t.ranks = ranks;
  t.chunks = chunks;
  t.micro_batches = micro_batches;
  for (const auto& rank : compute) t.actions.push_back(with_transfers(rank, ranks * chunks));
  return t;
}

std::vector<std::vector<Work>> gpipe(int ranks, int m) {
  std::vector<std::vector<Work>> out(static_cast<std::size_t>(ranks));
  for (int s = 0; s < ranks; ++s) {
    for (int k = 0; k < m; ++k) out[s].push_back({Op::forward, s, k});
    for (int k = 0; k < m; ++k) out[s].push_back({Op::backward, s, k});
  }
  return out;
}

std::vector<std::vector<Work>> one_f_one_b(int ranks, int m) {
  std::vector<std::vector<Work>> out(static_cast<std::size_t>(ranks));
  for (int s = 0; s < ranks; ++s) {
    const int warmup = std::min(ranks - 1 - s, m);
    auto& w = out[static_cast<std::size_t>(s)];
    for (int k = 0; k < warmup; ++k) w.push_back({Op::forward, s, k});
    for (int k = warmup; k < m; ++k) {
      w.push_back({Op::forward, s, k});
      w.push_back({Op::backward, s, k - warmup});
    }
    for (int k = m - warmup; k < m; ++k) w.push_back({Op::backward, s, k});
  }
  return out;
}

// Megatron's interleaved schedule: the rank's forwards and backwards in the order below; a
// warm-up of (v - 1) q + 2 (P - r - 1) forwards for rounds of q, then one forward and one backward
// in turn. Rounds: floor(m / P) of them (at least one), as equal as can be, the larger first, so each holds
// at least P micro-batches (or all m when m < P) and any m works, not only multiples of P.
std::vector<int> round_sizes(int ranks, int m) {
  const int rounds = std::max(1, m / ranks);
  std::vector<int> out;
  for (int i = 0; i < rounds; ++i) out.push_back(m / rounds + (i < m % rounds ? 1 : 0));
  return out;
}

// One rank's forwards and backwards in Megatron's interleaved order: through chunk 0 in rounds of
// micro-batches, then chunk 1, ...; the backwards in the same rounds with the chunks reversed. With
// one chunk, micro-batch order.
struct InterleavedOrder {
  std::vector<Work> forwards, backwards;
};
InterleavedOrder interleaved_order(int ranks, int chunks, int m, int r, Op backward) {
  InterleavedOrder out;
  const std::vector<int> rounds = round_sizes(ranks, m);
  for (int first = 0, i = 0; first < m; first += rounds[std::size_t(i++)]) {
    const int last = first + rounds[std::size_t(i)];
    for (int c = 0; c < chunks; ++c)
      for (int k = first; k < last; ++k) out.forwards.push_back({Op::forward, c * ranks + r, k});
    for (int c = chunks - 1; c >= 0; --c)
      for (int k = first; k < last; ++k) out.backwards.push_back({backward, c * ranks + r, k});
  }
  return out;
}

// The interleaved schedule's warm-up on rank r: forwards before its first backward.
int interleaved_warmup(int ranks, int chunks, int m, int r) {
  return std::min(chunks * m, 2 * (ranks - r - 1) + (chunks - 1) * round_sizes(ranks, m)[0]);
}

std::vector<std::vector<Work>> interleaved(int ranks, int chunks, int m) {
  std::vector<std::vector<Work>> out(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    const InterleavedOrder order = interleaved_order(ranks, chunks, m, r, Op::backward);
    const int total = chunks * m, warmup = interleaved_warmup(ranks, chunks, m, r);
    auto& w = out[std::size_t(r)];
    for (int i = 0; i < warmup; ++i) w.push_back(order.forwards[std::size_t(i)]);
    for (int i = 0; i < total - warmup; ++i) {
      w.push_back(order.forwards[std::size_t(warmup + i)]);
      w.push_back(order.backwards[std::size_t(i)]);
    }
    for (int i = total - warmup; i < total; ++i) w.push_back(order.backwards[std::size_t(i)]);
  }
  return out;
}

// The zero-bubble schedules by list scheduling: a simulation in unit time (F, Bi and W take 1 each)
// in which every idle rank takes, in order of preference, a backward-input whose gradient is
// there, a forward whose input is there while the rank holds fewer micro-batches than its limit
// between forward and weight half, else its oldest weight half. Each stage runs its forwards and
// its input halves in micro-batch order, and its weight halves in the order of their input halves.
// Among a rank's stages, the input half taken is the first ready one in the interleaved schedule's
// backward order; the forward, the first ready one in its forward order (Forwards::in_order) or
// the ready one of the deepest chunk (Forwards::deepest_first). With one chunk both are
// micro-batch order. Bi runs as soon as it can, so gradients flow back at once, and W fills the
// time 1f1b idles: the idle time falls from (P - 1)(F + B) towards (P - 1)(F + Bi - W), ZB-H1's
// bound, when the three take equal time.
//
// The limit (zb_limit): with one chunk 2P - r - 1, 1f1b's P - r plus P - 1, which let a first stage
// whose input takes no gradient (token ids: its Bi is empty, its W the whole backward) keep
// forwarding while it waits for the first gradients (measured at P 2 on the GPT: 11% idle with
// 1f1b's limit, 8% with this one); with v chunks the interleaved schedule's own peak.
int zb_limit(int ranks, int chunks, int m, int r) {
  if (chunks == 1) return 2 * ranks - r - 1;
  return interleaved_warmup(ranks, chunks, m, r) + 1;
}

class ZeroBubbleScheduler {
 public:
  enum class Forwards { in_order, deepest_first };

  ZeroBubbleScheduler(int ranks, int chunks, int m, Forwards forwards = Forwards::in_order)
      : ranks_(ranks), stages_(ranks * chunks), m_(m), forwards_(forwards), forward_done_(cells(), kNever),
        input_done_(cells(), kNever), next_forward_(std::size_t(stages_), 0), next_input_(std::size_t(stages_), 0) {
    for (int r = 0; r < ranks; ++r) {
      InterleavedOrder order = interleaved_order(ranks, chunks, m, r, Op::backward_input);
      RankState st;
      st.forwards = std::move(order.forwards);
      st.inputs = std::move(order.backwards);
      st.limit = zb_limit(ranks, chunks, m, r);
      state_.push_back(std::move(st));
    }
  }

  std::vector<std::vector<Work>> run() {
    std::vector<std::vector<Work>> order(static_cast<std::size_t>(ranks_));
    std::size_t placed = 0;
    const std::size_t total = 3 * std::size_t(stages_) * std::size_t(m_);
    for (long now = 0; placed < total; ++now) {
      for (int r = 0; r < ranks_; ++r) {
        RankState& st = state_[std::size_t(r)];
        if (st.busy_until > now) continue;
        const std::optional<Work> w = pick(st, now);
        if (!w) continue;
        finish(st, *w, now);
        order[std::size_t(r)].push_back(*w);
        ++placed;
      }
      if (now > long(total) + 4 * ranks_)  // every action takes one tick: a longer run is stuck
        throw std::logic_error("pipeline schedule: the zero-bubble scheduler found no runnable action");
    }
    return order;
  }

 private:
  static constexpr long kNever = std::numeric_limits<long>::max();
  struct RankState {
    std::vector<Work> forwards, inputs;  // the interleaved schedule's orders (the preference)
    std::deque<Work> weights;            // input halves done, weight halves not yet
    int limit = 0;                       // the most micro-batches held between F and W
    int held = 0;
    long busy_until = 0;
  };

  std::size_t cells() const { return std::size_t(stages_) * std::size_t(m_); }
  std::size_t cell(int s, int k) const { return std::size_t(s) * std::size_t(m_) + std::size_t(k); }

  // Of `sequence`, the actions that are their stage's next (`next` per stage) and whose inputs are
  // there: the first, or with `deepest` the one of the highest stage.
  template <typename Ready>
  std::optional<Work> choose(const std::vector<Work>& sequence, const std::vector<int>& next, bool deepest,
                             Ready ready) const {
    std::optional<Work> best;
    for (const Work& w : sequence) {
      if (next[std::size_t(w.stage)] != w.micro_batch || !ready(w)) continue;
      if (!deepest) return w;
      if (!best || best->stage < w.stage) best = w;
    }
    return best;
  }

  std::optional<Work> pick(const RankState& st, long now) const {
    const auto gradient_there = [&](const Work& w) {
      return forward_done_[cell(w.stage, w.micro_batch)] <= now &&
             (w.stage == stages_ - 1 || input_done_[cell(w.stage + 1, w.micro_batch)] <= now);
    };
    if (auto w = choose(st.inputs, next_input_, false, gradient_there)) return w;
    const auto input_there = [&](const Work& w) {
      return w.stage == 0 || forward_done_[cell(w.stage - 1, w.micro_batch)] <= now;
    };
    if (st.held < st.limit)
      if (auto w = choose(st.forwards, next_forward_, forwards_ == Forwards::deepest_first, input_there)) return w;
    if (!st.weights.empty() && input_done_[cell(st.weights.front().stage, st.weights.front().micro_batch)] <= now)
      return st.weights.front();
    return std::nullopt;
  }

  void finish(RankState& st, const Work& w, long now) {
    st.busy_until = now + 1;
    if (w.op == Op::forward) {
      forward_done_[cell(w.stage, w.micro_batch)] = now + 1;
      ++next_forward_[std::size_t(w.stage)];
      ++st.held;
    } else if (w.op == Op::backward_input) {
      input_done_[cell(w.stage, w.micro_batch)] = now + 1;
      ++next_input_[std::size_t(w.stage)];
      st.weights.push_back({Op::backward_weight, w.stage, w.micro_batch});
    } else {
      st.weights.pop_front();
      --st.held;
    }
  }

  int ranks_, stages_, m_;
  Forwards forwards_;
  std::vector<long> forward_done_, input_done_;
  std::vector<int> next_forward_, next_input_;  // per stage: its next micro-batch
  std::vector<RankState> state_;
};

// The interleaved schedule with each backward split into its input half and, at once, its weight
// half: the interleaved schedule's order and memory, as a zb table.
std::vector<std::vector<Work>> interleaved_split(int ranks, int chunks, int m) {
  std::vector<std::vector<Work>> out = interleaved(ranks, chunks, m);
  for (auto& rank : out) {
    std::vector<Work> split;
    for (const Work& w : rank) {
      if (w.op != Op::backward) {
        split.push_back(w);
        continue;
      }
      split.push_back({Op::backward_input, w.stage, w.micro_batch});
      split.push_back({Op::backward_weight, w.stage, w.micro_batch});
    }
    rank = std::move(split);
  }
  return out;
}

// zb over v > 1 chunks: of three tables in the interleaved schedule's memory (the list schedule
// with forwards in order, with the deepest forward first, and interleaved itself with its
// backwards split), the one whose simulated step idles least in the worse of two cost models, each
// F 1, Bi 1, W 1: as is, and with the first stage's Bi free and its W 2 (an input of token ids takes
// no gradient: the GPT's). Neither list schedule is best in every shape (the first idles more at P
// 2 on the GPT, the second at P 4); the third keeps the choice never worse than interleaved in
// either model. Every rank computes the same three and keeps the same one.
std::vector<std::vector<Work>> interleaved_zero_bubble(int ranks, int chunks, int m) {
  const auto worse_idle = [&](const std::vector<std::vector<Work>>& compute) {
    const ScheduleTable t = table_of(ScheduleKind::zero_bubble, ranks, chunks, m, compute);
    double worst = 0;
    for (bool first_input_free : {false, true}) {
      std::vector<ActionCosts> costs(std::size_t(t.stages()), ActionCosts{1, 2, 1, 1, 0});
      if (first_input_free) costs[0].backward_input = 0, costs[0].backward_weight = 2;
      const Timeline run = simulate(t, costs);
      double idle = 0;
      for (int r = 0; r < ranks; ++r) idle += run.bubble(r) / ranks;
      worst = std::max(worst, idle);
    }
    return worst;
  };
  using Forwards = ZeroBubbleScheduler::Forwards;
  std::vector<std::vector<Work>> best = ZeroBubbleScheduler(ranks, chunks, m, Forwards::in_order).run();
  double best_idle = worse_idle(best);
  for (auto candidate : {ZeroBubbleScheduler(ranks, chunks, m, Forwards::deepest_first).run(),
                         interleaved_split(ranks, chunks, m)}) {
    const double idle = worse_idle(candidate);
    if (idle < best_idle - 1e-12) best = std::move(candidate), best_idle = idle;
  }
  return best;
}

void check_shape(ScheduleKind kind, int ranks, int micro_batches, int chunks) {
  if (ranks < 1) throw ConfigError("a pipeline needs at least 1 stage (got " + std::to_string(ranks) + ")");
  if (micro_batches < 1)
    throw ConfigError("--num-microbatches must be at least 1 (got " + std::to_string(micro_batches) + ")");
  if (chunks < 1) throw ConfigError("--virtual-stages must be at least 1 (got " + std::to_string(chunks) + ")");
  if (chunks > 1 && kind != ScheduleKind::interleaved && kind != ScheduleKind::zero_bubble)
    throw ConfigError("--virtual-stages " + std::to_string(chunks) + " needs --pipeline-schedule interleaved or zb (the " +
                      schedule_name(kind) + " schedule runs one stage per rank)");
}

std::uint64_t mix(std::uint64_t h, std::uint64_t v) {
  return (h ^ v) * 1099511628211ull;
}

}  // namespace

ScheduleKind parse_schedule_kind(const std::string& name) {
  if (name == "gpipe") return ScheduleKind::gpipe;
  if (name == "1f1b") return ScheduleKind::one_f_one_b;
  if (name == "interleaved") return ScheduleKind::interleaved;
  if (name == "zb") return ScheduleKind::zero_bubble;
  throw ConfigError("unknown pipeline schedule '" + name + "': use gpipe, 1f1b, interleaved or zb");
}

const char* schedule_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::gpipe: return "gpipe";
    case ScheduleKind::one_f_one_b: return "1f1b";
    case ScheduleKind::interleaved: return "interleaved";
    case ScheduleKind::zero_bubble: return "zb";
  }
  return "?";
}

const char* op_name(Op op) {
  switch (op) {
    case Op::forward: return "F";
    case Op::backward: return "B";
    case Op::backward_input: return "Bi";
    case Op::backward_weight: return "W";
    case Op::send_activation: return "send-act";
    case Op::recv_activation: return "recv-act";
    case Op::send_gradient: return "send-grad";
    case Op::recv_gradient: return "recv-grad";
    case Op::send_tied: return "send-tied";
    case Op::recv_tied: return "recv-tied";
  }
  return "?";
}

std::string to_string(const Action& a) {
  return std::string(op_name(a.op)) + std::to_string(a.stage) + "." + std::to_string(a.micro_batch);
}

std::uint64_t ScheduleTable::digest() const {
  std::uint64_t h = 14695981039346656037ull;
  h = mix(mix(mix(mix(h, std::uint64_t(kind)), std::uint64_t(ranks)), std::uint64_t(chunks)), std::uint64_t(micro_batches));
  for (const auto& rank : actions) {
    h = mix(h, rank.size());
    for (const Action& a : rank)
      h = mix(mix(mix(h, std::uint64_t(a.op)), std::uint64_t(a.stage)), std::uint64_t(a.micro_batch));
  }
  return h;
}

ScheduleTable make_schedule(ScheduleKind kind, int ranks, int micro_batches, int chunks) {
  check_shape(kind, ranks, micro_batches, chunks);
  switch (kind) {
    case ScheduleKind::gpipe:
      return table_of(kind, ranks, 1, micro_batches, gpipe(ranks, micro_batches));
    case ScheduleKind::one_f_one_b:
      return table_of(kind, ranks, 1, micro_batches, one_f_one_b(ranks, micro_batches));
    case ScheduleKind::interleaved:
      // One chunk per rank is 1f1b itself (the interleaved warm-up would hold more for nothing).
      if (chunks == 1) return table_of(kind, ranks, 1, micro_batches, one_f_one_b(ranks, micro_batches));
      return table_of(kind, ranks, chunks, micro_batches, interleaved(ranks, chunks, micro_batches));
    case ScheduleKind::zero_bubble:
      if (chunks == 1) return table_of(kind, ranks, 1, micro_batches, ZeroBubbleScheduler(ranks, 1, micro_batches).run());
      return table_of(kind, ranks, chunks, micro_batches, interleaved_zero_bubble(ranks, chunks, micro_batches));
  }
  throw std::logic_error("make_schedule: unknown kind");
}

void add_tied_exchange(ScheduleTable& table, bool once) {
  const int last = table.stages() - 1;
  if (table.tied || last == 0) {
    table.tied = true;
    table.tied_once = once;
    return;
  }
  const Op weight = table.weight_op(), grad = table.input_grad_op();
  const auto exchanged = [&](const Action& a) { return !once || a.micro_batch == table.micro_batches - 1; };
  for (auto& rank : table.actions) {
    std::vector<Action> out;
    for (const Action& a : rank) {
      if (a.op == weight && a.stage == 0 && exchanged(a)) out.push_back({Op::recv_tied, 0, a.micro_batch});
      out.push_back(a);
      if (a.op == grad && a.stage == last && exchanged(a)) out.push_back({Op::send_tied, last, a.micro_batch});
    }
    rank = std::move(out);
  }
  table.tied = true;
  table.tied_once = once;
}

std::string describe(const ScheduleTable& table, int rank) {
  std::string out;
  for (const Action& a : table.actions.at(std::size_t(rank))) out += (out.empty() ? "" : " ") + to_string(a);
  return out;
}

ScheduleTable make_forward_schedule(int ranks, int micro_batches, int chunks) {
  check_shape(chunks > 1 ? ScheduleKind::interleaved : ScheduleKind::gpipe, ranks, micro_batches, chunks);
  std::vector<std::vector<Work>> compute(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r)
    for (int first = 0; first < micro_batches; first += ranks)
      for (int c = 0; c < chunks; ++c)
        for (int k = first; k < std::min(micro_batches, first + ranks); ++k)
          compute[std::size_t(r)].push_back({Op::forward, c * ranks + r, k});
  ScheduleTable t = table_of(ScheduleKind::gpipe, ranks, chunks, micro_batches, compute);
  t.forward_only = true;
  return t;
}

}  // namespace lockstep::pipe_core
