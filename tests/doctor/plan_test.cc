// lockstep plan (doctor/plan.h): every layout it lists is one the job can run, its ranking follows
// the machines (a slow link between them puts the pipeline across it, a fast one keeps DDP; a
// model that outgrows a worker is sharded), bad input is refused naming the flag, and the command
// reads a real one-worker run of examples/gpt.
#include "lockstep/doctor/plan.h"

#include <gtest/gtest.h>

#include <random>
#include <set>

#include "lockstep/error.h"
#include "testing.h"

namespace lockstep::doctor {
namespace {

// The 8 x 512 GPT of bench/compare_layouts.py: 25 M parameters, whose gradients (100 MB) outweigh a
// micro-batch's activations (256 KB a sequence) by far.
PlanModel big_gpt() {
  PlanModel m;
  m.n_layer = 8, m.n_head = 8, m.n_embd = 512, m.block_size = 128, m.vocab_size = 256;
  return m;
}

PlanStep measured_step() {
  PlanStep s;
  s.micro_batch = 2, s.micro_batches = 4;
  s.seconds_per_sequence = 0.05;
  s.activation_bytes_per_sequence = 40e6;
  return s;
}

PlanMachines two_machines(double link) {
  PlanMachines m;
  m.nodes = 2, m.nproc_per_node = 2, m.cores = 2;
  m.link_bytes_per_second = link;
  m.machine_bytes_per_second = 2e9;
  m.memory_bytes = 16e9;
  return m;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Plan, EveryLayoutFillsTheWorldKeepsTensorGroupsInsideAMachineAndIsRankedFastestFirst) {
  const std::uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 100; ++trial) {
    PlanMachines machines = two_machines(1e8);
    machines.nodes = std::uniform_int_distribution<int>(1, 3)(rng);
    machines.nproc_per_node = std::uniform_int_distribution<int>(1, 4)(rng);
    PlanModel model = big_gpt();
    model.n_head = std::uniform_int_distribution<int>(0, 1)(rng) ? 8 : 6;
    model.n_embd = 96 * model.n_head;
    SCOPED_TRACE("seed " + std::to_string(seed) + ", trial " + std::to_string(trial) + ": " +
                 std::to_string(machines.nodes) + " x " + std::to_string(machines.nproc_per_node) + ", " +
                 std::to_string(model.n_head) + " heads");
    const auto ranked = plan_layouts(model, machines, measured_step());
    ASSERT_FALSE(ranked.empty());
    std::set<std::string> names;
    for (std::size_t i = 0; i < ranked.size(); ++i) {
      const auto& e = ranked[i];
      EXPECT_EQ(e.pipeline * e.data * e.tensor, machines.world()) << e.name();
      EXPECT_EQ(machines.nproc_per_node % e.tensor, 0) << e.name() << ": a tensor group across machines";
      EXPECT_EQ(model.n_head % e.tensor, 0) << e.name();
      EXPECT_LE(e.pipeline, model.n_layer + 2) << e.name();
      EXPECT_TRUE(e.zero == 0 || e.data > 1) << e.name();
      EXPECT_TRUE(e.zero <= 1 || e.pipeline == 1) << e.name() << ": a pipeline refuses ZeRO-2 and 3";
      EXPECT_TRUE(names.insert(e.name()).second) << e.name() << " listed twice";
      EXPECT_GT(e.tokens_per_second, 0) << e.name();
      if (i == 0) continue;
      EXPECT_TRUE(ranked[i - 1].fits || !e.fits) << "fitting layouts come first";
      if (ranked[i - 1].fits == e.fits) {
        EXPECT_GE(ranked[i - 1].tokens_per_second, e.tokens_per_second) << e.name();
      }
    }
  }
}

// DDP all-reduces 100 MB of gradients a step; a pipeline across the link sends a few megabytes of
// activations: at 100 Mbit/s the first pick puts the pipeline across it. At 100 GB/s DDP's
// reduction hides behind the last backward, while a tensor group's all-reduces sit on the step's
// path (2 GB/s inside a machine: DDP leads 2 data x 2 tensor by 16% here) and a pipeline idles in
// its bubble: DDP stays first.
TEST(Plan, ASlowLinkPutsThePipelineAcrossItAndAFastOneKeepsDdp) {
  const auto slow = plan_layouts(big_gpt(), two_machines(100e6 / 8), measured_step());
  EXPECT_GT(slow.front().pipeline, 1) << describe_plan(slow, two_machines(100e6 / 8), 20);
  EXPECT_EQ(slow.front().pipeline_seconds > 0, true);
  const PlanMachines fast = two_machines(100e9);
  const auto quick = plan_layouts(big_gpt(), fast, measured_step());
  EXPECT_EQ(quick.front().pipeline, 1) << describe_plan(quick, fast, 20);
  EXPECT_EQ(quick.front().tensor, 1) << describe_plan(quick, fast, 20);
}

// Data groups that straddle machines (2 machines of 3 workers, 3 pipeline x 2 data: the middle
// stage's 2 replicas sit on both) pay the link, though the first stage's stay inside machine 0.
TEST(Plan, ADataGroupAcrossMachinesPaysTheLinkWhereverItSits) {
  PlanMachines machines = two_machines(100e6 / 8);
  machines.nproc_per_node = 3;
  PlanMachines one_machine = machines;
  one_machine.nodes = 1, one_machine.nproc_per_node = 6;
  auto data_seconds = [](const std::vector<LayoutEstimate>& ranked) {
    for (const auto& e : ranked)
      if (e.pipeline == 3 && e.data == 2 && e.tensor == 1 && e.zero == 0) return e.data_seconds;
    return -1.0;
  };
  const double inside = data_seconds(plan_layouts(big_gpt(), one_machine, measured_step()));
  ASSERT_GE(inside, 0);
  EXPECT_GT(data_seconds(plan_layouts(big_gpt(), machines, measured_step())), inside + 1)
      << "the middle stage's replicas cross the 100 Mbit/s link";
}

// A worker's share of a 2.5 GB machine (1.1 GB, with the headroom) does not hold DDP's 16 bytes per
// parameter of a 100 M parameter model: DDP is listed as not fitting, and the first pick shards the
// model.
TEST(Plan, ALayoutWhoseStateOutgrowsAWorkerIsRankedAfterThoseThatFit) {
  PlanModel model = big_gpt();
  model.n_layer = 32;  // 100 M parameters: 1.6 GB of state under DDP
  PlanMachines machines = two_machines(1e9);
  machines.memory_bytes = 2.5e9;
  PlanStep step = measured_step();
  step.activation_bytes_per_sequence = 10e6;
  const auto ranked = plan_layouts(model, machines, step);
  ASSERT_TRUE(ranked.front().fits) << describe_plan(ranked, machines, 40);
  EXPECT_TRUE(ranked.front().pipeline > 1 || ranked.front().tensor > 1 || ranked.front().zero > 0);
  bool ddp_listed = false;
  for (const auto& e : ranked)
    if (e.pipeline == 1 && e.tensor == 1 && e.zero == 0) {
      ddp_listed = true;
      EXPECT_FALSE(e.fits) << e.memory_bytes;
    }
  EXPECT_TRUE(ddp_listed);
  EXPECT_NE(describe_plan(ranked, machines, 40).find("4 data  "), std::string::npos);
  EXPECT_NE(describe_plan(ranked, machines, 40).find("(does not fit)"), std::string::npos);
}

TEST(Plan, BadInputIsRefusedNamingWhatToGive) {
  EXPECT_NE(error_of([] { parse_rate("fast"); }).find("100mbit"), std::string::npos);
  EXPECT_NE(error_of([] { parse_rate("-1gbit"); }).find("not a rate"), std::string::npos);
  EXPECT_DOUBLE_EQ(parse_rate("100mbit"), 12.5e6);
  EXPECT_DOUBLE_EQ(parse_rate("2GB/s"), 2e9);
  EXPECT_NE(error_of([] { plan_layouts(big_gpt(), two_machines(1e8), PlanStep{}); }).find("--from-run"),
            std::string::npos);
  EXPECT_NE(error_of([] { plan_layouts(big_gpt(), two_machines(0), measured_step()); }).find("--link"),
            std::string::npos);
  EXPECT_NE(error_of([] { step_of_run("/nonexistent/run"); }).find("/nonexistent/run/metrics.jsonl"),
            std::string::npos);
}

// `lockstep plan` on a real one-worker run: it reads the measured step and ranks the layouts of 2
// machines of 2 workers; a run of 2 workers is refused.
TEST(Plan, TheCommandRanksLayoutsFromAOneWorkerRun) {
  testing::TempDir one("plan-one"), two("plan-two");
  const std::vector<std::string> gpt = {"--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16",
                                        "--train-limit", "200", "--eval-strategy", "no", "--save-strategy", "no",
                                        "--per-device-train-batch-size", "2", "--gradient-accumulation-steps", "2",
                                        "--disable-tqdm", "--logging-steps", "4", "--max-steps", "12"};
  for (const auto& [dir, workers] : {std::pair{&one, "1"}, std::pair{&two, "2"}}) {
    std::vector<std::string> argv = {LOCKSTEP_BINARY, "run", "--nproc-per-node", workers, GPT_EXAMPLE,
                                     "--output-dir", dir->path()};
    argv.insert(argv.end(), gpt.begin(), gpt.end());
    testing::Process run(argv, {{"OMP_NUM_THREADS", "1"}});
    ASSERT_EQ(run.wait(300), 0) << run.output();
  }
  const PlanStep step = step_of_run(one.path());
  EXPECT_EQ(step.micro_batch, 2);
  EXPECT_EQ(step.micro_batches, 2);
  EXPECT_GT(step.seconds_per_sequence, 0);
  EXPECT_GT(step.activation_bytes_per_sequence, 0);
  testing::Process plan({LOCKSTEP_BINARY, "plan", "--from-run", one.path(), "--nnodes", "2", "--nproc-per-node", "2",
                         "--link", "100mbit", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size",
                         "16"});
  ASSERT_EQ(plan.wait(60), 0) << plan.output();
  EXPECT_NE(plan.output().find("layouts for 4 workers on 2 machines"), std::string::npos) << plan.output();
  EXPECT_NE(plan.output().find("first pick: "), std::string::npos) << plan.output();
  EXPECT_NE(plan.output().find("2 pipeline x 2 tensor"), std::string::npos) << plan.output();
  testing::Process refused({LOCKSTEP_BINARY, "plan", "--from-run", two.path()});
  EXPECT_NE(refused.wait(60), 0);
  EXPECT_NE(refused.output().find("is a run of 2 workers"), std::string::npos) << refused.output();
}

}  // namespace
}  // namespace lockstep::doctor
