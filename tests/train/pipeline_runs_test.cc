// examples/gpt pipelined (--pipeline-parallel) in whole runs, as a user runs it under `lockstep
// run`: with dropout, its parameters end bitwise the unpipelined run's (one worker, or DDP for two
// replicas); a checkpoint of one layout goes on under others and into the unpipelined GPT; a
// stage killed at a random moment fails the job within seconds and `--max-restarts` resumes it
// bitwise; without a launcher the killed stage's neighbour fails within seconds naming it; and
// what pipelining does not take is refused before anything trains. Every worker multiplies on one
// thread (OMP_NUM_THREADS=1) so that runs with different numbers of workers round alike.
// Torch-free: it reads what the runs print (the Trainer's fingerprint of the final parameters is
// equal exactly when they are bitwise equal) and write.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <nlohmann/json.hpp>

#include "lockstep/comm/store.h"
#include "rank_environment.h"
#include "flags.h"
#include "testing.h"

namespace {

namespace fs = std::filesystem;
using lockstep::testing::Process;
using lockstep::testing::TempDir;

using lockstep::testing::Flags;
using lockstep::testing::operator+;

// 4 blocks (6 units), 16 bytes of context; steps of 4 micro-batches of 2 sequences.
Flags tiny(const std::string& out, int steps, const std::string& dropout = "0.1") {
  return {"--n-layer", "4", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--dropout", dropout,
          "--train-limit", "400", "--eval-strategy", "no", "--per-device-train-batch-size", "2",
          "--gradient-accumulation-steps", "4", "--disable-tqdm", "--logging-steps", "1", "--max-steps",
          std::to_string(steps), "--output-dir", out};
}

Flags launch(int nproc, const Flags& flags, const Flags& launcher = {}) {
  return Flags{LOCKSTEP_BINARY, "run", "--nproc-per-node", std::to_string(nproc)} + launcher + Flags{GPT_EXAMPLE} +
         flags;
}

const std::map<std::string, std::string> kOneThread = {{"OMP_NUM_THREADS", "1"}};

std::string run_ok(const Flags& argv) {
  Process p(argv, kOneThread);
  EXPECT_EQ(p.wait(300), 0) << p.output();
  return p.output();
}

std::string fingerprint(const std::string& output) {
  const auto at = output.rfind("(fingerprint ");
  return at == std::string::npos ? "" : output.substr(at + 13, 16);
}

TEST(PipelineRuns, PipelinedRunsWithDropoutEndBitwiseOnTheUnpipelinedOnes) {
  TempDir a("pp-one"), b("pp-zb"), c("pp-interleaved"), d("pp-ddp"), e("pp-2x2");
  const std::string one = fingerprint(run_ok(launch(1, tiny(a.path(), 20) + Flags{"--save-strategy", "no"})));
  ASSERT_FALSE(one.empty());
  EXPECT_EQ(fingerprint(run_ok(launch(2, tiny(b.path(), 20) + Flags{"--save-strategy", "no", "--pipeline-parallel", "2",
                                                                  "--pipeline-schedule", "zb"}))),
            one);
  EXPECT_EQ(fingerprint(run_ok(launch(3, tiny(c.path(), 20) + Flags{"--save-strategy", "no", "--pipeline-parallel", "3",
                                                                  "--pipeline-schedule", "interleaved",
                                                                  "--virtual-stages", "2"}))),
            one);
  // Two replicas: DDP on 2 workers, and a 2-stage pipeline on each of 2 replicas.
  const std::string ddp = fingerprint(run_ok(launch(2, tiny(d.path(), 20) + Flags{"--save-strategy", "no"})));
  ASSERT_FALSE(ddp.empty());
  EXPECT_NE(ddp, one) << "two replicas see other samples than one";
  const std::string two_by_two = run_ok(launch(4, tiny(e.path(), 20) + Flags{"--save-strategy", "no",
                                                                            "--pipeline-parallel", "2",
                                                                            "--pipeline-schedule", "gpipe"}));
  EXPECT_EQ(fingerprint(two_by_two), ddp);
  EXPECT_NE(two_by_two.find("layout: 4 workers: 2 pipeline x 2 data"), std::string::npos) << "rank 0 says its layout";
}

// Every validation loss metrics.jsonl logged during training, in order.
std::vector<double> eval_losses(const TempDir& out) {
  std::ifstream in(out / "metrics.jsonl");
  std::vector<double> losses;
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.value("event", "") == "eval" && j.contains("eval_loss")) losses.push_back(j["eval_loss"].get<double>());
  }
  return losses;
}

// One trial of the promises docs/pipeline.md makes, its options drawn from `rng`.
struct Promise {
  int stages = 2, replicas = 1, chunks = 1;  // chunks: --virtual-stages
  std::string schedule = "1f1b", backend = "shm";
  bool checkpointing = false, bf16 = false, tied_once_a_step = false;
  bool more_micro_batches = false;  // --num-microbatches 8 cutting 4 x 2 sequences: against 8 x 1

  static Promise draw(std::mt19937& rng) {
    auto pick = [&](int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng); };
    Promise p;
    const char* schedules[] = {"gpipe", "1f1b", "interleaved", "zb"};
    p.schedule = schedules[pick(4)];
    p.stages = 2 + pick(2);
    p.chunks = p.schedule == "interleaved" ? 2 : p.schedule == "zb" ? 1 + pick(2) : 1;
    p.replicas = p.stages == 2 ? 1 + pick(3) : 1 + pick(2);
    p.backend = p.replicas > 1 && pick(2) ? "gloo" : "shm";
    p.checkpointing = p.schedule != "zb" && pick(2);
    p.bf16 = pick(2);
    p.tied_once_a_step = pick(4) == 0;
    p.more_micro_batches = pick(2);
    return p;
  }
  std::string describe() const {
    return std::to_string(stages) + " stages x " + std::to_string(replicas) + " replicas on " + backend + ", " +
           schedule + (chunks > 1 ? " v " + std::to_string(chunks) : "") + (checkpointing ? ", gradient checkpointing" : "") + (bf16 ? ", bf16" : "") +
           (tied_once_a_step ? ", tied gradient once a step" : "") +
           (more_micro_batches ? ", 8 micro-batches of 1" : "");
  }
  // What both sides run: 20 steps with dropout, evaluated every 5. Under gloo every bucket is
  // small enough (at most 512 KiB gathered over the ranks) to be summed in rank order, as shm sums
  // it: a larger one goes round gloo's ring, whose order follows where a gradient sits in its
  // bucket, and DDP's buckets are not a stage's (docs/pipeline.md).
  Flags common(const std::string& out) const {
    Flags f = tiny(out, 20) + Flags{"--save-strategy", "no", "--eval-strategy", "steps", "--eval-steps", "5",
                                    "--eval-limit", "40", "--backend", backend, "--ddp-bucket-cap-mb", "0.05"};
    if (bf16) f = f + Flags{"--bf16"};
    if (checkpointing) f = f + Flags{"--gradient-checkpointing"};
    return f;
  }
  Flags unpipelined(const std::string& out) const {
    return common(out) + (more_micro_batches ? Flags{"--per-device-train-batch-size", "1",
                                                     "--gradient-accumulation-steps", "8"}
                                             : Flags{});
  }
  Flags pipelined(const std::string& out) const {
    Flags f = common(out) + Flags{"--pipeline-parallel", std::to_string(stages), "--pipeline-schedule", schedule};
    if (chunks > 1) f = f + Flags{"--virtual-stages", std::to_string(chunks)};
    if (more_micro_batches) f = f + Flags{"--num-microbatches", "8"};
    if (tied_once_a_step) f = f + Flags{"--pipeline-tied-gradient", "step"};
    return f;
  }
};

// What docs/pipeline.md promises, drawn at random (the seed printed; LOCKSTEP_TEST_SEED replays
// it): each schedule, 2 or 3 stages, 1 to 3 replicas on shm or gloo, gradient checkpointing,
// --bf16, --num-microbatches other than the gradient accumulation steps, dropout, and the
// evaluation through the pipeline: the pipelined run ends bitwise on the unpipelined one (one
// worker, or DDP over the replicas) and evaluates to the same loss at every evaluation. Under
// --pipeline-tied-gradient step, equal up to rounding: the validation losses within 1e-5.
TEST(PipelineRuns, WhatTheDocsPromiseHoldsBitwiseInRandomTrials) {
  const std::uint64_t seed = lockstep::testing::test_seed();
  std::mt19937 rng(static_cast<std::mt19937::result_type>(seed));
  for (int trial = 0; trial < 3; ++trial) {
    const Promise p = Promise::draw(rng);
    SCOPED_TRACE("seed " + std::to_string(seed) + ", trial " + std::to_string(trial) + ": " + p.describe());
    TempDir flat("pp-promise-flat"), staged("pp-promise-staged");
    const std::string want = fingerprint(run_ok(launch(p.replicas, p.unpipelined(flat.path()))));
    ASSERT_FALSE(want.empty());
    const std::string got = run_ok(launch(p.stages * p.replicas, p.pipelined(staged.path())));
    const auto expected = eval_losses(flat), evaluated = eval_losses(staged);
    ASSERT_EQ(expected.size(), 4u);
    ASSERT_EQ(evaluated.size(), expected.size()) << got;
    if (p.tied_once_a_step) {
      for (std::size_t i = 0; i < expected.size(); ++i)
        EXPECT_LE(std::abs(evaluated[i] - expected[i]) / expected[i], 1e-5) << "evaluation " << i;
      continue;
    }
    EXPECT_EQ(fingerprint(got), want) << got;
    for (std::size_t i = 0; i < expected.size(); ++i) EXPECT_EQ(evaluated[i], expected[i]) << "evaluation " << i;
  }
}

// --fp16: the loss scaled as the unpipelined step scales it, and every stage skipping an
// overflowed step together, so a pipeline ends bitwise on one worker and skips the same steps.
TEST(PipelineRuns, Fp16PipelinesSkipTheUnpipelinedRunsStepsAndEndBitwiseOnIt) {
  TempDir a("pp-fp16-one"), b("pp-fp16-two");
  Process whole(launch(1, tiny(a.path(), 20) + Flags{"--save-strategy", "no", "--fp16"}), kOneThread);
  const int code = whole.wait(300);
  if (code != 0 && whole.output().find("autocasts the CPU to bfloat16 only") != std::string::npos)
    GTEST_SKIP() << "this libtorch has no float16 CPU autocast (the suite runs this test on PyTorch 2.x)";
  ASSERT_EQ(code, 0) << whole.output();
  const std::string one = whole.output();
  ASSERT_FALSE(fingerprint(one).empty());
  const std::string two = run_ok(launch(2, tiny(b.path(), 20) + Flags{"--save-strategy", "no", "--fp16",
                                                                    "--pipeline-parallel", "2", "--pipeline-schedule",
                                                                    "zb"}));
  EXPECT_EQ(fingerprint(two), fingerprint(one)) << two;
  const std::string skipped = "a gradient overflowed float16";
  EXPECT_EQ(lockstep::testing::count_of(two, skipped), lockstep::testing::count_of(one, skipped)) << two;
}

// --zero-stage 1 over each stage's replicas: a 2-stage pipeline of 2 replicas ends bitwise on DDP
// over 2 workers (each tensor's update is the one every replica would make); rank 0 (stage 0,
// replica 0) keeps the optimizer state of about half its stage's parameters; and the checkpoint the
// replicas write, each its share whole, resumes under DDP ending where the uninterrupted run ends.
TEST(PipelineRuns, ZeroOneOverAStagesReplicasEndsBitwiseOnDdpAndItsCheckpointResumesWithoutIt) {
  TempDir ddp("pp-z1-ddp"), sharded("pp-z1"), resumed("pp-z1-resumed");
  const Flags save = {"--save-strategy", "steps", "--save-steps", "6"};
  const std::string expected = fingerprint(run_ok(launch(2, tiny(ddp.path(), 12, "0") + save)));
  ASSERT_FALSE(expected.empty());
  const std::string z1 = run_ok(launch(4, tiny(sharded.path(), 12, "0") + save +
                                             Flags{"--pipeline-parallel", "2", "--zero-stage", "1"}));
  EXPECT_EQ(fingerprint(z1), expected) << z1;
  EXPECT_NE(z1.find("layout: 4 workers: 2 pipeline x 2 data (ZeRO-1)"), std::string::npos) << z1;
  // AdamW keeps two moments per element: without ZeRO, twice the stage's parameter bytes.
  EXPECT_LE(lockstep::testing::train_begin_field(sharded / "metrics.jsonl", "worker_optimizer_state_bytes"),
            0.6 * 2 * lockstep::testing::train_begin_field(sharded / "metrics.jsonl", "worker_parameter_bytes"));
  const std::string from = sharded / "checkpoint-6";
  const std::string o = run_ok(launch(2, tiny(resumed.path(), 12, "0") + Flags{"--resume-from-checkpoint", from}));
  EXPECT_NE(o.find("resumed from " + from + " at step 6"), std::string::npos) << o;
  EXPECT_EQ(fingerprint(o), expected) << "DDP on 2, from the pipeline's ZeRO-1 checkpoint";
}

// A pipelined checkpoint (each stage its part) goes on under another pipeline and without one,
// ending where the uninterrupted run ends; the unpipelined GPT samples from it and exports it.
TEST(PipelineRuns, ACheckpointGoesOnUnderAnyLayoutAndIntoTheUnpipelinedModel) {
  TempDir base("pp-base"), flat("pp-flat"), three("pp-three"), hf("pp-hf");
  const Flags save = {"--save-strategy", "steps", "--save-steps", "6"};
  const std::string straight =
      fingerprint(run_ok(launch(2, tiny(base.path(), 12, "0") + save + Flags{"--pipeline-parallel", "2"})));
  ASSERT_FALSE(straight.empty());
  const std::string from = base / "checkpoint-6";
  ASSERT_TRUE(fs::exists(fs::path(from) / "index.json")) << "a pipelined save is sharded";
  const std::string o1 = run_ok(launch(1, tiny(flat.path(), 12, "0") + Flags{"--resume-from-checkpoint", from}));
  EXPECT_NE(o1.find("resumed from " + from + " at step 6"), std::string::npos) << o1;
  EXPECT_EQ(fingerprint(o1), straight) << "unpipelined, from a 2-stage checkpoint";
  const std::string o3 = run_ok(launch(3, tiny(three.path(), 12, "0") + Flags{"--resume-from-checkpoint", from,
                                                                             "--pipeline-parallel", "3",
                                                                             "--pipeline-schedule", "zb"}));
  EXPECT_EQ(fingerprint(o3), straight) << "3 stages, from a 2-stage checkpoint";
  // And the other way: the unpipelined run's checkpoint into a pipeline.
  TempDir back("pp-back");
  const std::string o4 = run_ok(launch(2, tiny(back.path(), 12, "0") + Flags{"--resume-from-checkpoint",
                                                                            flat / "checkpoint-12", "--max-steps", "14",
                                                                            "--pipeline-parallel", "2"}));
  EXPECT_NE(o4.find("at step 12"), std::string::npos) << o4;
  Process sample({GPT_EXAMPLE, "generate", "--checkpoint", base / "checkpoint-12", "--max-new-tokens", "16"});
  EXPECT_EQ(sample.wait(60), 0) << sample.output();
  Process exported({GPT_EXAMPLE, "export-hf", "--checkpoint", base / "checkpoint-12", "--output", hf.path() + "/gpt2"});
  EXPECT_EQ(exported.wait(60), 0) << exported.output();
  EXPECT_TRUE(fs::exists(hf / "gpt2/model.safetensors"));
}

// Random kill points (the seed is printed; LOCKSTEP_TEST_SEED replays it): a random stage of a
// 3-stage pipeline killed at a random step; the launcher names it within seconds, restarts the
// group, which resumes from the last checkpoint and ends bitwise on the uninterrupted run.
TEST(PipelineRuns, AStageKilledAtRandomFailsTheJobWithinSecondsAndRestartsBitwise) {
  const std::uint64_t seed = lockstep::testing::test_seed();
  std::mt19937 rng(static_cast<std::mt19937::result_type>(seed));
  const Flags pipeline = {"--pipeline-parallel", "3", "--save-strategy", "steps", "--save-steps", "4"};
  TempDir straight_dir("pp-straight");
  const std::string straight = fingerprint(run_ok(launch(3, tiny(straight_dir.path(), 40) + pipeline)));
  ASSERT_FALSE(straight.empty());
  for (int trial = 0; trial < 2; ++trial) {
    const int step = std::uniform_int_distribution<int>(5, 30)(rng);
    SCOPED_TRACE("seed " + std::to_string(seed) + ", trial " + std::to_string(trial) + ": a kill after step " +
                 std::to_string(step));
    TempDir out("pp-killed");
    Process job(launch(3, tiny(out.path(), 40) + pipeline, {"--max-restarts", "1"}), kOneThread);
    ASSERT_TRUE(job.read_until("step " + std::to_string(step) + "/40", 180)) << job.output();
    const auto workers = lockstep::testing::children_of(job.pid());
    ASSERT_EQ(workers.size(), 3u) << job.output();
    const pid_t victim = workers[std::uniform_int_distribution<std::size_t>(0, 2)(rng)];
    ::kill(victim, SIGKILL);
    const auto killed = std::chrono::steady_clock::now();
    ASSERT_TRUE(job.read_until("SIGKILL", 30)) << job.output();
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count(), 10.0)
        << "the launcher took long to notice";
    EXPECT_EQ(job.wait(300), 0) << job.output();
    EXPECT_NE(job.output().find("resumed from " + out.path() + "/checkpoint-"), std::string::npos) << job.output();
    EXPECT_EQ(fingerprint(job.output()), straight) << job.output();
  }
}

// Without a launcher to stop the others, the pipeline itself: a stage's neighbour waiting for its
// activations or gradients fails within seconds, naming the rank that died.
TEST(PipelineRuns, WithoutALauncherTheKilledStagesNeighbourFailsWithinSecondsNamingIt) {
  lockstep::testing::LocalStore store;
  TempDir out("pp-nolauncher");
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 2; ++r) {
    const auto env = lockstep::testing::rank_environment(r, 2, store, kOneThread);
    ranks.push_back(std::make_unique<Process>(
        Flags{GPT_EXAMPLE} + tiny(out.path(), 1000, "0") + Flags{"--save-strategy", "no", "--pipeline-parallel", "2"},
        env));
  }
  ASSERT_TRUE(ranks[0]->read_until("step 3/", 120)) << ranks[0]->output();
  ::kill(ranks[1]->pid(), SIGKILL);
  const auto killed = std::chrono::steady_clock::now();
  const int code = ranks[0]->wait(60);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count(), 15.0);
  EXPECT_NE(code, 0) << ranks[0]->output();
  EXPECT_NE(ranks[0]->output().find("from stage 1 (worker 1)"), std::string::npos) << ranks[0]->output();
  ranks[1]->wait(10);
}

std::pair<int, std::string> run_fail(const Flags& argv) {
  Process p(argv, kOneThread);
  const int code = p.wait(120);
  return {code, p.output()};
}

// Each a clear error, exit code 2, before a single step.
TEST(PipelineRuns, WhatAPipelineCannotTakeIsRefusedBeforeTraining) {
  TempDir out("pp-bad");
  struct Case {
    int workers;
    Flags flags;
    std::string says;
  };
  const std::vector<Case> cases = {
      {2, {"--pipeline-parallel", "3"}, "does not divide the 2 workers"},
      {2, {"--pipeline-parallel", "2", "--n-layer", "1", "--pipeline-schedule", "interleaved", "--virtual-stages", "2"},
       "but the model has only 3 units"},
      {2, {"--pipeline-parallel", "2", "--virtual-stages", "2"}, "needs --pipeline-schedule interleaved"},
      {2, {"--pipeline-parallel", "2", "--zero-stage", "3"}, "--zero-stage 3 does not combine with --pipeline-parallel 2"},
      {2, {"--pipeline-parallel", "2", "--pipeline-split", "1,2"}, "holds 3 units, but the model has 6"},
      {2, {"--pipeline-parallel", "2", "--gradient-checkpointing", "--pipeline-schedule", "zb"},
       "does not combine with --pipeline-schedule zb"},
      {1, {"--num-microbatches", "4"}, "add --pipeline-parallel 2 or more"},
  };
  for (const auto& c : cases) {
    const auto [code, output] = run_fail(launch(c.workers, tiny(out.path(), 4) + c.flags));
    EXPECT_EQ(code, 2) << output;
    EXPECT_NE(output.find(c.says), std::string::npos) << output;
    EXPECT_EQ(output.find("step 1/"), std::string::npos) << "it trained first: " << output;
  }
  // An elastic job, whose membership a pipeline does not follow yet.
  {
    const int port = lockstep::comm::StoreServer(lockstep::comm::StoreServerOptions{"127.0.0.1", 0, ""}).port();
    Process elastic({LOCKSTEP_BINARY, "run", "--nnodes", "1:1", "--nproc-per-node", "2", "--master-port",
                     std::to_string(port), GPT_EXAMPLE, "--pipeline-parallel", "2", "--max-steps", "2", "--output-dir",
                     out.path()},
                    kOneThread);
    EXPECT_NE(elastic.wait(120), 0) << elastic.output();
    EXPECT_NE(elastic.output().find("--pipeline-parallel 2 in an elastic job"), std::string::npos) << elastic.output();
    EXPECT_EQ(elastic.output().find("step 1/"), std::string::npos) << elastic.output();
  }
  // A checkpoint of another model (twice as wide) does not load into a pipeline's stages.
  TempDir wide("pp-wide");
  Flags wider = tiny(wide.path(), 2, "0");
  *(std::find(wider.begin(), wider.end(), "--n-embd") + 1) = "64";
  run_ok(launch(1, wider + Flags{"--save-strategy", "steps", "--save-steps", "2", "--save-format", "sharded"}));
  const auto [code, output] = run_fail(launch(2, tiny(out.path(), 4, "0") + Flags{"--pipeline-parallel", "2",
                                                                                   "--resume-from-checkpoint",
                                                                                   wide / "checkpoint-2"}));
  EXPECT_EQ(code, 2) << output;
  EXPECT_NE(output.find("does not fit this model"), std::string::npos) << output;
}

}  // namespace
