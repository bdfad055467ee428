// The pipeline against the reference it promises to equal (pipe_runs.h), with ranks as threads
// over real communicators (shared memory for the replicas' reductions, the TCP mailbox for
// activations): after 20 steps in float32 every parameter is bitwise the reference's, for every
// schedule, P in {2, 3, 4}, m in {1, 3, P, 2P + 1} (micro-batches that need not divide by P, of
// unequal sizes), D in {1, 2}. Without any one of the pieces that make it exact (micro-batch
// order, the tied gradient summed per micro-batch, the norm in the model's order, the split
// backward running the same nodes) some of these differ.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <random>
#include <set>

#include "lockstep/error.h"
#include "pipe_runs.h"
#include "testing.h"

namespace lockstep::testing {
namespace {

comm::CommOptions options() {
  comm::CommOptions o;
  o.timeout = comm::Seconds(120);
  return o;
}

// The reference's parameters (replica 0's: DDP keeps the replicas equal) for `run`.
Parameters reference(const PipeRun& run) {
  Parameters out;
  std::mutex mu;
  run_ranks_as_threads(run.replicas, options(), [&](comm::Communicator& c) {
    auto p = reference_run(run, run.replicas > 1 ? &c : nullptr, c.rank());
    std::lock_guard<std::mutex> lock(mu);
    if (c.rank() == 0) out = std::move(p);
  });
  return out;
}

// Every rank's owned parameters, and the check that each replica's ranks own every parameter once.
void expect_pipelined_equals(const PipeRun& run, const Parameters& expected) {
  const int world = run.pipeline * run.replicas;
  std::vector<Parameters> got(static_cast<std::size_t>(world));
  std::mutex mu;
  run_ranks_as_threads(world, options(), [&](comm::Communicator& c) {
    auto p = pipelined_run(run, c);
    std::lock_guard<std::mutex> lock(mu);
    got[static_cast<std::size_t>(c.rank())] = std::move(p);
  });
  const auto mesh = pipe::PipelineMesh::of(world, run.pipeline);
  for (int d = 0; d < run.replicas; ++d) {
    std::set<std::string> owned;
    for (int r : mesh.pipeline_group(d)) {
      double worst = 0;
      const std::string diff = differing(expected, got[static_cast<std::size_t>(r)], &worst);
      EXPECT_EQ(diff, "") << run.describe() << ": rank " << r << " differs from the reference by up to " << worst;
      for (const auto& p : got[static_cast<std::size_t>(r)]) EXPECT_TRUE(owned.insert(p.first).second) << p.first;
    }
    EXPECT_EQ(owned.size(), expected.size()) << run.describe() << ": replica " << d << " owns some parameter twice or never";
  }
}

// Each schedule with its chunks per rank: zb twice, as ZB-H1 and interleaved.
constexpr std::pair<pipe::ScheduleKind, int> kEverySchedule[] = {{pipe::ScheduleKind::gpipe, 1},
                                                                 {pipe::ScheduleKind::one_f_one_b, 1},
                                                                 {pipe::ScheduleKind::interleaved, 2},
                                                                 {pipe::ScheduleKind::zero_bubble, 1},
                                                                 {pipe::ScheduleKind::zero_bubble, 2}};

// The tied gradient summed over the step and sent once: not the same sums as one process's, but
// within rounding of them (20 AdamW steps in float32), for every schedule.
TEST(PipelineNumerics, TheTiedGradientOnceAStepEndsWithinRoundingOfOneProcess) {
  at::set_num_threads(1);
  for (const auto& [kind, chunks] : kEverySchedule) {
    PipeRun run;
    run.schedule = kind;
    run.pipeline = 3;
    run.chunks = chunks;
    run.micro_batches = 5;
    run.tied_once = true;
    const Parameters expected = reference(run);
    std::vector<Parameters> got(3);
    std::mutex mu;
    run_ranks_as_threads(3, options(), [&](comm::Communicator& c) {
      auto p = pipelined_run(run, c);
      std::lock_guard<std::mutex> lock(mu);
      got[std::size_t(c.rank())] = std::move(p);
    });
    double worst = 0, largest = 0;
    for (const auto& rank : got)
      for (const auto& [name, t] : rank) {
        worst = std::max(worst, (t - expected.at(name)).abs().max().item<double>());
        largest = std::max(largest, expected.at(name).abs().max().item<double>());
      }
    EXPECT_LT(worst, 1e-5 * largest) << run.describe();
  }
}

// The ConfigError each rank gets from `fn`, or "" when none (a hang would be the options' timeout:
// a TimeoutError, not a ConfigError).
std::vector<std::string> config_errors(int world, const std::function<void(comm::Communicator&)>& fn) {
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  run_ranks_as_threads(world, options(), [&](comm::Communicator& c) {
    try {
      fn(c);
    } catch (const ConfigError& e) {
      errors[static_cast<std::size_t>(c.rank())] = e.what();
    }
  });
  return errors;
}

pipe::Pipeline make_pipeline(models::GptLmHeadModel& model, comm::Communicator& c, pipe::PipelineOptions options) {
  PipeRun run;
  return pipe::Pipeline(model->pipeline_units(), c, options, micro_batches(run, 0, 0).front(),
                        [](const torch::Tensor& out, const torch::Tensor& target) {
                          return torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}), target.reshape({-1}));
                        });
}

// Ranks that would run different tables wait for transfers that never come: each such start is a
// ConfigError on every rank naming what differs, before any transfer.
TEST(PipelineAgreement, RanksThatWouldRunDifferentTablesAllFailNamingTheDifference) {
  at::set_num_threads(1);
  const auto tied = config_errors(2, [](comm::Communicator& c) {
    auto model = make_model(tiny_gpt(0), false);
    pipe::PipelineOptions o;
    o.pipeline_parallel = 2;
    o.tied_gradient = c.rank() == 0 ? pipe::PipelineOptions::TiedGradient::step
                                    : pipe::PipelineOptions::TiedGradient::micro_batch;
    make_pipeline(model, c, o);
  });
  for (const auto& e : tied) EXPECT_NE(e.find("--pipeline-tied-gradient step"), std::string::npos) << e;
  const auto counts = config_errors(2, [](comm::Communicator& c) {  // the same flags, another m on rank 1
    auto model = make_model(tiny_gpt(0), false);
    pipe::PipelineOptions o;
    o.pipeline_parallel = 2;
    auto pipeline = make_pipeline(model, c, o);
    PipeRun run;
    run.micro_batches = c.rank() == 0 ? 2 : 3;
    pipeline.train_step(micro_batches(run, 0, 0));
  });
  for (const auto& e : counts) {
    EXPECT_NE(e.find("rank 0 runs 2 micro-batches"), std::string::npos) << e;
    EXPECT_NE(e.find("rank 1 3 micro-batches"), std::string::npos) << e;
  }
}

TEST(PipelineNumerics, EverySchedulesParametersAreBitwiseOneProcesss) {
  at::set_num_threads(1);
  std::map<std::pair<int, int>, Parameters> references;  // by (m, D): P and the schedule do not change it
  for (int replicas : {1, 2})
    for (int p : {2, 3, 4})
      for (int m : std::set<int>{1, 3, p, 2 * p + 1})
        for (const auto& [kind, chunks] : kEverySchedule) {
          if (replicas > 1 && chunks > 1 && kind == pipe::ScheduleKind::zero_bubble) continue;  // the trials below draw it
          PipeRun run;
          run.schedule = kind;
          run.pipeline = p;
          run.chunks = chunks;
          run.micro_batches = m;
          run.replicas = replicas;
          auto& expected = references[{m, replicas}];
          if (expected.empty()) expected = reference(run);
          expect_pipelined_equals(run, expected);
        }
  EXPECT_NE(differing(references[{3, 1}], references[{3, 2}]), "")
      << "two replicas train on other data than one: each run above is held to a reference of its own";
  EXPECT_NE(differing(references[{1, 1}], references[{3, 1}]), "")
      << "other micro-batch sizes round otherwise: the reference must be the one of the same m";
}

}  // namespace
}  // namespace lockstep::testing

namespace lockstep::testing {
namespace {

// A random split of `units` units into `stages` non-empty stages, as --pipeline-split text.
std::string random_split(std::mt19937_64& rng, int units, int stages) {
  std::vector<int> counts(static_cast<std::size_t>(stages), 1);
  for (int extra = units - stages; extra > 0; --extra)
    ++counts[std::uniform_int_distribution<std::size_t>(0, counts.size() - 1)(rng)];
  std::string out;
  for (int c : counts) out += (out.empty() ? "" : ",") + std::to_string(c);
  return out;
}

// Trials drawn at random: schedule, P, v, m, D and the stage split. The seed is printed; set
// LOCKSTEP_TEST_SEED to replay a failure.
TEST(PipelineNumerics, RandomisedTrialsAreBitwiseOneProcesss) {
  at::set_num_threads(1);
  const std::uint64_t seed = test_seed();
  std::mt19937_64 rng(seed);
  const int units = tiny_gpt(0).n_layer + 2;
  constexpr pipe::ScheduleKind kKinds[] = {pipe::ScheduleKind::gpipe, pipe::ScheduleKind::one_f_one_b,
                                           pipe::ScheduleKind::interleaved, pipe::ScheduleKind::zero_bubble};
  for (int trial = 0; trial < 16; ++trial) {
    PipeRun run;
    run.schedule = kKinds[std::uniform_int_distribution<int>(0, 3)(rng)];
    run.pipeline = std::uniform_int_distribution<int>(2, 4)(rng);
    // interleaved: v from 2; zb: ZB-H1 (v 1) or interleaved zb
    run.chunks = run.schedule == pipe::ScheduleKind::interleaved   ? std::uniform_int_distribution<int>(2, units / run.pipeline)(rng)
                 : run.schedule == pipe::ScheduleKind::zero_bubble ? std::uniform_int_distribution<int>(1, units / run.pipeline)(rng)
                                                                   : 1;
    run.micro_batches = std::uniform_int_distribution<int>(1, 12)(rng);
    run.replicas = std::uniform_int_distribution<int>(1, 2)(rng);
    run.split = random_split(rng, units, run.pipeline * run.chunks);
    run.steps = 6;
    SCOPED_TRACE("seed " + std::to_string(seed) + ", trial " + std::to_string(trial) + ": " + run.describe());
    expect_pipelined_equals(run, reference(run));
  }
}

}  // namespace
}  // namespace lockstep::testing
