// The schedule tables: every table the runtime can be asked for (P <= 8 pipeline ranks, m <= 32
// micro-batches, v <= 4 chunks) is proved complete and free of deadlock by the checker, holds at
// its peak exactly the micro-batches its schedule's formula gives on every rank (a table that held
// more, or fewer, fails), and has the bubble its theory gives; and the
// checker itself rejects the faults it is there to find.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "lockstep/error.h"
#include "lockstep/pipe_core/schedule.h"
#include "lockstep/pipe_core/schedule_check.h"

namespace lockstep::pipe_core {
namespace {

constexpr ScheduleKind kKinds[] = {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved,
                                   ScheduleKind::zero_bubble};

// The most micro-batches rank r may hold at once (forwarded, weight gradient not yet done) under
// each schedule (schedule.h).
int promised_peak(ScheduleKind kind, int ranks, int chunks, int m, int r) {
  switch (kind) {
    case ScheduleKind::gpipe: return m;
    case ScheduleKind::one_f_one_b: return std::min(m, ranks - r);
    case ScheduleKind::zero_bubble:  // with v > 1 chunks, at most this (below)
      if (chunks == 1) return std::min(m, 2 * ranks - r - 1);
      return promised_peak(ScheduleKind::interleaved, ranks, chunks, m, r);
    case ScheduleKind::interleaved: {
      if (chunks == 1) return std::min(m, ranks - r);
      const int rounds = std::max(1, m / ranks), first_round = (m + rounds - 1) / rounds;
      return std::min(chunks * m, (chunks - 1) * first_round + 2 * (ranks - r - 1) + 1);
    }
  }
  return 0;
}

TEST(Schedule, EveryTableUpToEightRanksIsCompleteAndFreeOfDeadlock) {
  for (ScheduleKind kind : kKinds)
    for (int p = 1; p <= 8; ++p)
      for (int v = 1; v <= (kind == ScheduleKind::interleaved || kind == ScheduleKind::zero_bubble ? 4 : 1); ++v)
        for (int m = 1; m <= 32; ++m)
          for (bool tied : {false, true}) {
            ScheduleTable t = make_schedule(kind, p, m, v);
            if (tied) add_tied_exchange(t);
            const ScheduleCheck check = check_schedule(t);
            ASSERT_TRUE(check.ok()) << check.error;
            // Interleaved zb may keep a table that holds less than interleaved (its choice is by idle time).
            const bool at_most = kind == ScheduleKind::zero_bubble && v > 1;
            for (int r = 0; r < p; ++r) {
              const int peak = check.peak_in_flight[std::size_t(r)], promised = promised_peak(kind, p, v, m, r);
              ASSERT_TRUE(at_most ? peak <= promised : peak == promised)
                  << schedule_name(kind) << " P " << p << " v " << v << " m " << m << " rank " << r << " holds " << peak
                  << ", promised " << (at_most ? "at most " : "") << promised << ": " << describe(t, r);
            }
          }
}

TEST(Schedule, ForwardOnlyTablesAreSound) {
  for (int p = 1; p <= 8; ++p)
    for (int v = 1; v <= 4; ++v)
      for (int m = 1; m <= 32; m += 5) {
        const auto check = check_schedule(make_forward_schedule(p, m, v));
        ASSERT_TRUE(check.ok()) << check.error;
      }
}

TEST(Schedule, TheSameInputsGiveTheSameTable) {
  const auto a = make_schedule(ScheduleKind::zero_bubble, 4, 9), b = make_schedule(ScheduleKind::zero_bubble, 4, 9);
  EXPECT_EQ(a.digest(), b.digest());
  EXPECT_NE(a.digest(), make_schedule(ScheduleKind::zero_bubble, 4, 10).digest());
  EXPECT_NE(a.digest(), make_schedule(ScheduleKind::one_f_one_b, 4, 9).digest());
}

TEST(Schedule, OneFOneBIsTheTextbookOrder) {
  const auto t = make_schedule(ScheduleKind::one_f_one_b, 3, 4);
  EXPECT_EQ(describe(t, 0),
            "F0.0 send-act0.0 F0.1 send-act0.1 F0.2 send-act0.2 recv-grad0.0 B0.0 F0.3 send-act0.3 recv-grad0.1 B0.1 "
            "recv-grad0.2 B0.2 recv-grad0.3 B0.3");
  EXPECT_EQ(describe(t, 2),
            "recv-act2.0 F2.0 B2.0 send-grad2.0 recv-act2.1 F2.1 B2.1 send-grad2.1 recv-act2.2 F2.2 B2.2 send-grad2.2 "
            "recv-act2.3 F2.3 B2.3 send-grad2.3");
}

// With every forward taking F and every backward B (zb: B/2 each half), 1f1b and gpipe idle
// (P - 1) / (m + P - 1) of the step on every rank, the interleaved schedule about v times less,
// and zb less again; interleaved zb as little as zb, in interleaved's memory.
TEST(Schedule, BubblesFollowTheory) {
  const int p = 4, m = 8;
  const ActionCosts costs{1, 2, 1, 1, 0};
  const double theory = double(p - 1) / (m + p - 1);
  const auto bubble = [&](ScheduleKind kind, int v) {
    const auto t = make_schedule(kind, p, m, v);
    std::vector<ActionCosts> per_stage(std::size_t(t.stages()), costs);
    for (auto& c : per_stage) {  // a stage of a v-chunk model does 1/v of the work
      c.forward /= v, c.backward /= v, c.backward_input /= v, c.backward_weight /= v;
    }
    return simulate(t, per_stage).bubble(0);
  };
  EXPECT_NEAR(bubble(ScheduleKind::one_f_one_b, 1), theory, 1e-12);
  EXPECT_NEAR(bubble(ScheduleKind::gpipe, 1), theory, 1e-12);
  const double interleaved = bubble(ScheduleKind::interleaved, 2), zb = bubble(ScheduleKind::zero_bubble, 1);
  EXPECT_LT(interleaved, theory * 0.75);
  EXPECT_NEAR(interleaved, double(p - 1) / (2 * m + p - 1), 0.05);
  EXPECT_LT(zb, interleaved);
  const double interleaved_zb = bubble(ScheduleKind::zero_bubble, 2);
  EXPECT_LT(interleaved_zb, 0.75 * interleaved);
  EXPECT_LE(interleaved_zb, zb + 1e-12);  // equal here, holding 5.5 stages' micro-batches on rank 0 to zb's 7
}

// Interleaved zb in every shape up to 8 ranks: never more idle (the mean over the ranks) than
// interleaved 1f1b of the same shape, with equal F, Bi and W, and with the first stage's input half
// free (a model whose input is token ids); and a third less idle over all the shapes.
double mean_idle(const ScheduleTable& t, bool first_input_free) {
  std::vector<ActionCosts> costs(std::size_t(t.stages()), ActionCosts{1, 2, 1, 1, 0});
  if (first_input_free) costs[0].backward_input = 0, costs[0].backward_weight = 2;
  const Timeline run = simulate(t, costs);
  double idle = 0;
  for (int r = 0; r < t.ranks; ++r) idle += run.bubble(r) / t.ranks;
  return idle;
}

TEST(Schedule, InterleavedZeroBubbleIdlesNoMoreThanInterleaved) {
  double zb_total = 0, interleaved_total = 0;
  for (int p = 2; p <= 8; ++p)
    for (int v = 2; v <= 4; ++v)
      for (int m = 1; m <= 32; ++m) {
        const auto zb = make_schedule(ScheduleKind::zero_bubble, p, m, v);
        const auto il = make_schedule(ScheduleKind::interleaved, p, m, v);
        for (bool first_input_free : {false, true}) {
          const double ours = mean_idle(zb, first_input_free), theirs = mean_idle(il, first_input_free);
          ASSERT_LE(ours, theirs + 1e-12) << "P " << p << " v " << v << " m " << m << ", first input half free "
                                          << first_input_free;
          zb_total += ours, interleaved_total += theirs;
        }
      }
  EXPECT_LT(zb_total, 0.75 * interleaved_total);
}

ScheduleTable two_rank_table() {
  return make_schedule(ScheduleKind::one_f_one_b, 2, 2);
}

void expect_rejected(const ScheduleTable& t, const std::string& fragment) {
  const auto check = check_schedule(t);
  ASSERT_FALSE(check.ok()) << "accepted: " << describe(t, 0) << " | " << describe(t, 1);
  EXPECT_NE(check.error.find(fragment), std::string::npos) << check.error;
}

TEST(ScheduleCheck, FindsADeadlockAndNamesItsCycle) {
  auto t = two_rank_table();
  // Rank 0 waits for the gradient of micro-batch 0 before sending its activation.
  auto& r0 = t.actions[0];
  std::rotate(r0.begin(), r0.begin() + 2, r0.begin() + 4);  // F0.0 send-act0.0 F0.1 ... -> F0.1 send-act0.1 F0.0 ...
  auto check = check_schedule(t);
  EXPECT_TRUE(check.ok()) << check.error;  // reordering forwards alone is still sound
  t = two_rank_table();
  const auto send = std::find(t.actions[0].begin(), t.actions[0].end(), Action{Op::send_activation, 0, 0});
  const auto recv = std::find(t.actions[0].begin(), t.actions[0].end(), Action{Op::recv_gradient, 0, 0});
  std::iter_swap(send, recv);
  expect_rejected(t, "deadlock: rank 0 waits in recv-grad0.0 for rank 1; rank 1 waits in recv-act1.0 for rank 0 (a cycle)");
}

// Rank 0's first action of `op` moved to the front of its list.
void first_to_front(ScheduleTable& t, Op op) {
  auto& r0 = t.actions[0];
  const auto it = std::find_if(r0.begin(), r0.end(), [&](const Action& a) { return a.op == op; });
  ASSERT_NE(it, r0.end());
  std::rotate(r0.begin(), it, it + 1);
}

// Through the tied exchange a wait can close over three ranks: rank 0 waiting for the last
// stage's tied gradient of micro-batch 0 before it sends that micro-batch on, the last stage for
// stage 1's activation, stage 1 for rank 0's.
TEST(ScheduleCheck, FindsACycleOverThreeRanks) {
  auto t = make_schedule(ScheduleKind::zero_bubble, 3, 4);
  add_tied_exchange(t);
  ASSERT_TRUE(check_schedule(t).ok());
  first_to_front(t, Op::recv_tied);
  expect_rejected(t, "deadlock: rank 0 waits in recv-tied0.0 for rank 2; rank 2 waits in recv-act2.0 for rank 1; "
                     "rank 1 waits in recv-act1.0 for rank 0 (a cycle)");
}

// Rank 0 waiting for micro-batch 0's gradient before it has sent its activation, in an
// interleaved table (v = 2) and a zero-bubble one.
TEST(ScheduleCheck, FindsDeadlocksInInterleavedAndZeroBubbleTables) {
  for (const auto& [kind, chunks] : {std::pair{ScheduleKind::interleaved, 2}, std::pair{ScheduleKind::zero_bubble, 1}}) {
    SCOPED_TRACE(schedule_name(kind));
    auto t = make_schedule(kind, 2, 4, chunks);
    ASSERT_TRUE(check_schedule(t).ok());
    first_to_front(t, Op::recv_gradient);
    expect_rejected(t, "deadlock: rank 0 waits in recv-grad");
  }
}

TEST(ScheduleCheck, FindsMissingDuplicatedAndMisplacedActions) {
  auto t = two_rank_table();
  t.actions[1].erase(std::find(t.actions[1].begin(), t.actions[1].end(), Action{Op::backward, 1, 1}));
  expect_rejected(t, "B1.1 is missing");
  t = two_rank_table();
  t.actions[0].push_back({Op::forward, 0, 1});
  expect_rejected(t, "F0.1 appears twice on rank 0");
  t = two_rank_table();
  t.actions[0].push_back({Op::forward, 1, 0});
  expect_rejected(t, "but stage 1 is on rank 1");
  t = two_rank_table();
  t.actions[1].push_back({Op::backward_weight, 1, 0});
  expect_rejected(t, "W1.0 does not belong in a 1f1b table");
}

TEST(ScheduleCheck, FindsAnActionBeforeWhatItNeeds) {
  auto t = two_rank_table();
  auto& r1 = t.actions[1];
  std::iter_swap(std::find(r1.begin(), r1.end(), Action{Op::recv_activation, 1, 0}),
                 std::find(r1.begin(), r1.end(), Action{Op::forward, 1, 0}));
  expect_rejected(t, "F1.0 runs before recv-act1.0");
}

TEST(ScheduleCheck, FindsGradientsAccumulatedOutOfOrder) {
  auto t = make_schedule(ScheduleKind::gpipe, 2, 3);
  auto& r1 = t.actions[1];
  // B1.0 send-grad1.0 B1.1 send-grad1.1 -> the two backwards swapped with their sends
  const auto b0 = std::find(r1.begin(), r1.end(), Action{Op::backward, 1, 0});
  std::rotate(b0, b0 + 2, b0 + 4);
  expect_rejected(t, "stage 1 accumulates micro-batch 1 before 0");
}

TEST(ScheduleCheck, TheTiedExchangeWaitsForTheLastStage) {
  auto t = make_schedule(ScheduleKind::zero_bubble, 3, 4);
  add_tied_exchange(t);
  const auto& r0 = t.actions[0];
  const auto recv = std::find(r0.begin(), r0.end(), Action{Op::recv_tied, 0, 2});
  ASSERT_NE(recv, r0.end());
  EXPECT_EQ(*(recv + 1), (Action{Op::backward_weight, 0, 2}));
  const auto& r2 = t.actions[2];  // the last stage sends after its input half, not its weight half
  const auto send = std::find(r2.begin(), r2.end(), Action{Op::send_tied, 2, 2});
  ASSERT_NE(send, r2.end());
  EXPECT_EQ(*(send - 1), (Action{Op::backward_input, 2, 2}));
  auto broken = t;
  auto& last = broken.actions[2];
  last.erase(std::find(last.begin(), last.end(), Action{Op::send_tied, 2, 1}));
  expect_rejected(broken, "send-tied2.1 is missing");
}

TEST(ScheduleCheck, TheOncePerStepTiedExchangeComesWithTheLastMicroBatch) {
  for (ScheduleKind kind : kKinds) {
    auto t = make_schedule(kind, 3, 5, kind == ScheduleKind::interleaved ? 2 : 1);
    add_tied_exchange(t, /*once=*/true);
    const auto check = check_schedule(t);
    ASSERT_TRUE(check.ok()) << check.error;
    int sends = 0;
    for (const auto& rank : t.actions)
      for (const Action& a : rank)
        if (a.op == Op::send_tied) {
          ++sends;
          EXPECT_EQ(a.micro_batch, 4);
        }
    EXPECT_EQ(sends, 1) << schedule_name(kind);
  }
}

TEST(Schedule, BadShapesAreConfigErrors) {
  EXPECT_THROW(make_schedule(ScheduleKind::one_f_one_b, 2, 0), ConfigError);
  EXPECT_THROW(make_schedule(ScheduleKind::one_f_one_b, 0, 4), ConfigError);
  EXPECT_NO_THROW(make_schedule(ScheduleKind::zero_bubble, 2, 4, 2));
  try {
    make_schedule(ScheduleKind::one_f_one_b, 2, 4, 2);
    FAIL() << "v without interleaved was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("needs --pipeline-schedule interleaved"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_schedule_kind("pipedream"), ConfigError);
  EXPECT_EQ(parse_schedule_kind("zb"), ScheduleKind::zero_bubble);
}

}  // namespace
}  // namespace lockstep::pipe_core
