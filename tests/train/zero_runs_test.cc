// --zero-stage in whole runs of examples/fashion_mnist under the launcher: a killed and restarted
// ZeRO job ends bitwise equal to an uninterrupted one; a kill during a background (sharded) save
// leaves the previous checkpoint; a ZeRO checkpoint resumes under DDP and with 1 or 3 workers;
// train_begin records what each worker holds; and --sync-batchnorm, which makes 2 workers train
// as 1 with their two batches together. Torch-free: it reads what the runs print and write
// (the Trainer prints a hash of the final parameters, equal exactly when they are bitwise equal).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "metrics_file.h"
#include "testing.h"

namespace {

namespace fs = std::filesystem;
using lockstep::testing::metrics_events;
using lockstep::testing::Process;
using lockstep::testing::TempDir;

std::vector<std::string> launch(int nproc, const std::vector<std::string>& flags,
                                const std::vector<std::string>& launcher_flags = {}) {
  std::vector<std::string> argv = {LOCKSTEP_BINARY, "run", "--nproc-per-node", std::to_string(nproc)};
  argv.insert(argv.end(), launcher_flags.begin(), launcher_flags.end());
  argv.push_back(FASHION_MNIST);
  argv.insert(argv.end(), flags.begin(), flags.end());
  return argv;
}

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

const std::vector<std::string> kShortRun = {"--train-limit", "640", "--eval-limit", "200",
                                            "--per-device-train-batch-size", "16", "--disable-tqdm",
                                            "--eval-strategy", "no"};

std::string fingerprint(const std::string& output) {
  const auto at = output.rfind("(fingerprint ");
  return at == std::string::npos ? "" : output.substr(at + 13, 16);
}

std::string run_ok(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {}) {
  Process p(argv, env);
  const int code = p.wait(300);
  EXPECT_EQ(code, 0) << p.output();
  return p.output();
}

// 640 samples, 2 workers x 16: 20 steps per epoch; checkpoint 13 is mid-epoch and the kill at 17
// rolls the job back to it. The CNN has BatchNorm buffers; cosine schedule; AdamW; clipping.
TEST(ZeroRuns, AKilledAndRestartedJobEndsBitwiseEqualToAnUninterruptedOne) {
  const auto flags = with(kShortRun, {"--model", "cnn", "--zero-stage", "2", "--max-steps", "30", "--save-strategy",
                                      "steps", "--save-steps", "13", "--warmup-steps", "3", "--lr-scheduler-type",
                                      "cosine", "--logging-steps", "10"});
  TempDir straight("zero-straight"), killed("zero-killed");
  const std::string a = run_ok(launch(2, with(flags, {"--output-dir", straight.path()})));
  const std::string b = run_ok(launch(2, with(flags, {"--output-dir", killed.path()}), {"--max-restarts", "1"}),
                               {{"LOCKSTEP_FAULT_INJECT", "kill-after-step:17:1"}});
  EXPECT_NE(b.find("SIGKILL"), std::string::npos) << b;
  EXPECT_NE(b.find("resumed from " + killed.path() + "/checkpoint-13 at step 13"), std::string::npos) << b;
  ASSERT_FALSE(fingerprint(a).empty()) << a;
  EXPECT_EQ(fingerprint(b), fingerprint(a));
  // The consolidated checkpoint loads into a plain model in one process.
  Process eval({FASHION_MNIST, "evaluate", "--model", "cnn", "--checkpoint", killed / "checkpoint-30", "--eval-limit",
                "200"});
  EXPECT_EQ(eval.wait(60), 0) << eval.output();
}

TEST(ZeroRuns, AKillDuringABackgroundSaveLeavesThePreviousCheckpoint) {
  TempDir out("zero-killsave");
  const auto flags = with(kShortRun, {"--model", "mlp", "--zero-stage", "1", "--max-steps", "12", "--save-strategy",
                                      "steps", "--save-steps", "5", "--output-dir", out.path()});
  // Rank 0's writer thread dies once every shard of checkpoint-10 is written, before its index.
  Process a(launch(2, flags), {{"LOCKSTEP_FAULT_INJECT", "kill-during-save:10"}});
  EXPECT_EQ(a.wait(180), 128 + 9) << a.output();
  EXPECT_TRUE(fs::exists(out / "checkpoint-5/index.json"));
  EXPECT_FALSE(fs::exists(out / "checkpoint-10"));
  EXPECT_TRUE(fs::exists(out / ".tmp-checkpoint-10/shard-00001-of-00002.bin")) << "killed after the shards";
  const std::string resumed = run_ok(launch(2, with(flags, {"--resume-from-checkpoint", "latest"})));
  EXPECT_NE(resumed.find("resumed from " + out.path() + "/checkpoint-5 at step 5"), std::string::npos) << resumed;
  EXPECT_TRUE(fs::exists(out / "checkpoint-12/trainer_state.json"));
}

// A ZeRO-2 checkpoint of 2 workers continues under DDP on 2, on 1 worker, and under ZeRO-1 on 3:
// the loss goes on from where it was, not from an untrained model's. Under DDP on 2 workers
// the data order is the same, so the curve is the uninterrupted ZeRO run's.
TEST(ZeroRuns, ACheckpointResumesUnderDdpAndWithOneOrThreeWorkers) {
  TempDir base("zero-base");
  const auto flags = with(kShortRun, {"--model", "mlp", "--max-steps", "30", "--save-strategy", "steps",
                                      "--save-steps", "10", "--logging-steps", "10", "--learning-rate", "3e-3"});
  run_ok(launch(2, with(flags, {"--zero-stage", "2", "--output-dir", base.path()})));
  const auto straight = metrics_events(base / "metrics.jsonl", "log");
  ASSERT_EQ(straight.size(), 3u);
  const double untrained = 2.3;  // ln 10: a guess among ten classes
  ASSERT_LT(straight[0]["loss"].get<double>(), 0.8 * untrained);

  struct Resume {
    int workers;
    std::vector<std::string> flags;
  };
  for (const Resume& r : {Resume{2, {}}, Resume{1, {}}, Resume{3, {"--zero-stage", "1"}}, Resume{3, {"--zero-stage", "3"}}}) {
    TempDir out("zero-resume");
    const std::string o = run_ok(launch(
        r.workers, with(with(flags, r.flags), {"--resume-from-checkpoint", base / "checkpoint-10", "--output-dir", out.path()})));
    EXPECT_NE(o.find("resumed from " + base.path() + "/checkpoint-10 at step 10"), std::string::npos) << o;
    const auto logs = metrics_events(out / "metrics.jsonl", "log");
    ASSERT_EQ(logs.size(), 2u) << o;  // steps 20 and 30
    const double before = straight[0]["loss"].get<double>(), after = logs[0]["loss"].get<double>();
    EXPECT_LT(after, before * 1.25) << r.workers << " workers started over instead of resuming";
    if (r.workers == 2)
      EXPECT_NEAR(after, straight[1]["loss"].get<double>(), 1e-3 * after) << "DDP from a ZeRO checkpoint";
  }
}

// Stage 3 (the parameters sharded too) under the launcher: killed and restarted from its sharded
// checkpoint it ends bitwise equal to an uninterrupted stage-3 run, and its checkpoint continues
// under DDP on 3 workers and evaluates in one process.
TEST(ZeroRuns, StageThreeRestartsBitwiseAndItsCheckpointGoesOnUnderDdp) {
  const auto flags = with(kShortRun, {"--model", "mlp", "--zero-stage", "3", "--max-steps", "30", "--save-strategy",
                                      "steps", "--save-steps", "13", "--logging-steps", "10"});
  TempDir straight("zero3-straight"), killed("zero3-killed"), resumed("zero3-ddp");
  const std::string a = run_ok(launch(2, with(flags, {"--output-dir", straight.path()})));
  EXPECT_NE(a.find("ZeRO stage 3"), std::string::npos) << a;
  const std::string b = run_ok(launch(2, with(flags, {"--output-dir", killed.path()}), {"--max-restarts", "1"}),
                               {{"LOCKSTEP_FAULT_INJECT", "kill-after-step:17:1"}});
  EXPECT_NE(b.find("resumed from " + killed.path() + "/checkpoint-13 at step 13"), std::string::npos) << b;
  ASSERT_FALSE(fingerprint(a).empty()) << a;
  EXPECT_EQ(fingerprint(b), fingerprint(a));
  const std::string c = run_ok(launch(3, with(kShortRun, {"--model", "mlp", "--max-steps", "40", "--output-dir",
                                                          resumed.path(), "--resume-from-checkpoint",
                                                          straight / "checkpoint-26"})));
  EXPECT_NE(c.find("resumed from " + straight.path() + "/checkpoint-26 at step 26"), std::string::npos) << c;
  Process eval({FASHION_MNIST, "evaluate", "--model", "mlp", "--checkpoint", straight / "checkpoint-30", "--eval-limit",
                "200"});
  EXPECT_EQ(eval.wait(60), 0) << eval.output();
}

// train_begin says what each worker holds: under stage 1 half of DDP's optimizer state, under
// stage 2 half its gradients too, and with shared parameters half the parameters; and the bucket
// cap in effect (stage 2 lowers the default 25 MB to 4 MB).
TEST(ZeroRuns, TrainBeginRecordsWhatEachWorkerHolds) {
  std::map<std::string, nlohmann::json> begin;
  for (const auto& [name, extra] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"ddp", {}},
           {"stage1", {"--zero-stage", "1"}},
           {"stage2", {"--zero-stage", "2"}},
           {"shared", {"--zero-stage", "2", "--zero-shared-parameters"}}}) {
    TempDir out("zero-mem");
    run_ok(launch(2, with(with(kShortRun, {"--model", "mlp", "--max-steps", "2", "--save-strategy", "no",
                                           "--output-dir", out.path()}),
                          extra)));
    begin[name] = metrics_events(out / "metrics.jsonl", "train_begin").at(0);
  }
  const double params = begin["ddp"]["parameter_bytes"].get<double>();
  auto held = [&](const std::string& run, const char* field) { return begin[run][field].get<double>() / params; };
  EXPECT_EQ(begin["stage2"]["zero_stage"].get<int>(), 2);
  EXPECT_NEAR(held("ddp", "worker_optimizer_state_bytes"), 2.0, 1e-9);
  EXPECT_NEAR(held("stage1", "worker_optimizer_state_bytes"), 1.0, 0.01);
  EXPECT_NEAR(held("stage1", "worker_gradient_bytes"), 1.0, 0.01);
  EXPECT_NEAR(held("stage2", "worker_gradient_bytes"), 0.5, 0.01);
  EXPECT_NEAR(held("stage2", "worker_parameter_bytes"), 1.0, 0.01);
  EXPECT_NEAR(held("shared", "worker_parameter_bytes"), 0.5, 0.01);
  EXPECT_TRUE(begin["shared"]["zero_shared_parameters"].get<bool>());
  for (const char* run : {"ddp", "stage1", "stage2"})
    EXPECT_EQ(begin[run]["ddp_bucket_cap_mb_asked"].get<double>(), 25) << run;
  EXPECT_EQ(begin["ddp"]["ddp_bucket_cap_mb"].get<double>(), 25);
  EXPECT_EQ(begin["stage1"]["ddp_bucket_cap_mb"].get<double>(), 25);
  EXPECT_EQ(begin["stage2"]["ddp_bucket_cap_mb"].get<double>(), 4);
}

// Accumulation (all but the last micro-batch under no_sync), bf16 autocast and evaluation under
// ZeRO-2: the run learns, its evaluations count every sample, and the replicas end equal.
TEST(ZeroRuns, AccumulationBf16AndEvaluationWorkUnderStageTwo) {
  TempDir out("zero-accum");
  const std::string o = run_ok(launch(
      2, {"--model", "cnn", "--zero-stage", "2", "--gradient-accumulation-steps", "2", "--bf16", "--train-limit",
          "640", "--eval-limit", "200", "--per-device-train-batch-size", "8", "--max-steps", "16", "--logging-steps",
          "4", "--eval-strategy", "steps", "--eval-steps", "8", "--save-strategy", "no", "--disable-tqdm",
          "--output-dir", out.path()}));
  EXPECT_NE(o.find("2 workers x 8 per device x 2 accumulation = 32 samples per step"), std::string::npos) << o;
  EXPECT_NE(o.find("all 2 replicas hold the same parameters"), std::string::npos) << o;
  const auto logs = metrics_events(out / "metrics.jsonl", "log");
  const auto evals = metrics_events(out / "metrics.jsonl", "eval");
  ASSERT_EQ(logs.size(), 4u);
  EXPECT_LT(logs.back()["loss"].get<double>(), logs.front()["loss"].get<double>());
  ASSERT_EQ(evals.size(), 2u);
  EXPECT_EQ(evals.back()["eval_samples"].get<int>(), 200);
}

TEST(ZeroRuns, SharedParametersWithoutAStageAreOneLine) {
  Process p(launch(2, with(kShortRun, {"--model", "mlp", "--zero-shared-parameters"})));
  EXPECT_NE(p.wait(60), 0);
  EXPECT_NE(p.output().find("--zero-shared-parameters"), std::string::npos) << p.output();
  EXPECT_NE(p.output().find("add --zero-stage 1, 2 or 3"), std::string::npos) << p.output();
}

// The CNN's norm layers are lockstep::SyncBatchNorm. With --sync-batchnorm, 2 workers x 16
// train as 1 worker x 32 does (the sampler deals the same 32 samples per step, and the statistics
// are over the 32): the logged losses agree to float rounding. Without it each worker normalises
// over its 16, and they do not.
TEST(SyncBatchNormRuns, TwoWorkersTrainAsOneWithTheirBatchesTogether) {
  auto losses = [](int workers, int per_device, const std::vector<std::string>& extra) {
    TempDir out("sync-bn");
    run_ok(launch(workers, with(with(kShortRun, {"--model", "cnn", "--per-device-train-batch-size",
                                                 std::to_string(per_device), "--max-steps", "12", "--logging-steps",
                                                 "4", "--save-strategy", "no", "--output-dir", out.path()}),
                                extra)));
    std::vector<double> out_losses;
    for (const auto& j : metrics_events(out / "metrics.jsonl", "log"))
      out_losses.push_back(j["loss"].get<double>());
    return out_losses;
  };
  const auto one = losses(1, 32, {});
  const auto synced = losses(2, 16, {"--sync-batchnorm"});
  const auto apart = losses(2, 16, {});
  ASSERT_EQ(one.size(), 3u);
  ASSERT_EQ(synced.size(), one.size());
  ASSERT_EQ(apart.size(), one.size());
  double synced_gap = 0, apart_gap = 0;
  for (std::size_t i = 0; i < one.size(); ++i) {
    synced_gap = std::max(synced_gap, std::abs(synced[i] - one[i]) / one[i]);
    apart_gap = std::max(apart_gap, std::abs(apart[i] - one[i]) / one[i]);
  }
  EXPECT_LT(synced_gap, 1e-4);
  EXPECT_GT(apart_gap, 10 * synced_gap);
}

TEST(SyncBatchNormRuns, AModelWithoutSyncBatchNormIsOneClearError) {
  Process p(launch(2, with(kShortRun, {"--model", "mlp", "--sync-batchnorm"})));
  EXPECT_NE(p.wait(60), 0);
  EXPECT_NE(p.output().find("--sync-batchnorm: the model has no lockstep::SyncBatchNorm layer"), std::string::npos)
      << p.output();
}

// A rank whose batches load 40 ms slower is named on the log lines, with its cause, and the
// launcher's output carries the warning once.
TEST(StragglerRuns, ARankWithSlowDataIsNamedOnTheLogLines) {
  TempDir out("straggler");
  const std::string o = run_ok(launch(2, with(kShortRun, {"--model", "mlp", "--max-steps", "10", "--logging-steps", "5",
                                                          "--save-strategy", "no", "--data-delay-ms", "40",
                                                          "--data-delay-rank", "1", "--output-dir", out.path()})));
  const auto logs = metrics_events(out / "metrics.jsonl", "log");
  ASSERT_EQ(logs.size(), 2u);
  for (const auto& j : logs) {
    ASSERT_TRUE(j.contains("straggler_rank")) << j.dump();
    EXPECT_EQ(j["straggler_rank"].get<int>(), 1);
    EXPECT_NE(j["straggler"].get<std::string>().find("rank 1 is the straggler: its data loading"), std::string::npos);
  }
  EXPECT_NE(o.find("rank 1 is the straggler"), std::string::npos) << o;
}

}  // namespace
