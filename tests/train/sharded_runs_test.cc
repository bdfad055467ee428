// Sharded checkpoints in whole runs under the launcher: every rank writes its own shard and
// nothing is gathered; `lockstep checkpoint consolidate` turns one into a model.pt that evaluates
// the same as the shards; a ZeRO-2 checkpoint of 2 workers resumes under DDP on 3, training each
// remaining sample of the epoch exactly once; the save's stall and the writing are recorded.
// Torch-free: it reads what the runs print and write.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "elastic_records.h"
#include "metrics_file.h"
#include "testing.h"

namespace {

namespace fs = std::filesystem;
using lockstep::testing::metrics_events;
using lockstep::testing::Process;
using lockstep::testing::TempDir;

std::vector<std::string> launch(int nproc, const std::string& program,
                                const std::vector<std::string>& flags) {
  std::vector<std::string> argv = {LOCKSTEP_BINARY, "run", "--nproc-per-node", std::to_string(nproc),
                                   program};
  argv.insert(argv.end(), flags.begin(), flags.end());
  return argv;
}

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::string run_ok(const std::vector<std::string>& argv) {
  Process p(argv);
  const int code = p.wait(300);
  EXPECT_EQ(code, 0) << p.output();
  return p.output();
}

// What `fashion_mnist evaluate` prints of a checkpoint: "test accuracy A on N images, loss L".
std::string evaluation(const std::string& checkpoint) {
  Process p({FASHION_MNIST, "evaluate", "--model", "mlp", "--checkpoint", checkpoint, "--eval-limit", "300"});
  EXPECT_EQ(p.wait(60), 0) << p.output();
  const auto at = p.output().find("test accuracy");
  return at == std::string::npos ? p.output() : p.output().substr(at, p.output().find(" (", at) - at);
}

const std::vector<std::string> kShortRun = {"--model",
                                            "mlp",
                                            "--train-limit",
                                            "640",
                                            "--eval-limit",
                                            "200",
                                            "--per-device-train-batch-size",
                                            "16",
                                            "--disable-tqdm",
                                            "--eval-strategy",
                                            "no"};

TEST(ShardedRuns, EachRankWritesItsShardAndConsolidateMakesTheSameModel) {
  TempDir out("sharded-ddp");
  run_ok(launch(2, FASHION_MNIST,
                with(kShortRun, {"--max-steps", "10", "--save-strategy", "steps", "--save-steps", "5",
                                 "--save-format", "sharded", "--output-dir", out.path()})));
  const fs::path dir = out / "checkpoint-10";
  ASSERT_TRUE(fs::exists(dir / "index.json"));
  EXPECT_FALSE(fs::exists(dir / "model.pt")) << "nothing is gathered on rank 0";
  const auto a = fs::file_size(dir / "shard-00000-of-00002.bin"),
             b = fs::file_size(dir / "shard-00001-of-00002.bin");
  // Each holds half of the parameters and AdamW's two moments (rank 0 also the buffers, none here).
  EXPECT_NEAR(double(a) / double(a + b), 0.5, 0.01) << a << " and " << b << " bytes";
  EXPECT_EQ(a + b, 3u * 535818u * 4u) << "the values and two moments of 535,818 parameters, each once";
  EXPECT_FALSE(fs::exists(out / ".tmp-checkpoint-10"));

  const std::string from_shards = evaluation(dir.string());
  Process consolidate({LOCKSTEP_BINARY, "checkpoint", "consolidate", dir.string()});
  ASSERT_EQ(consolidate.wait(60), 0) << consolidate.output();
  EXPECT_NE(consolidate.output().find("wrote " + (dir / "model.pt").string()), std::string::npos)
      << consolidate.output();
  ASSERT_TRUE(fs::exists(dir / "model.pt"));
  EXPECT_EQ(evaluation((dir / "model.pt").string()), from_shards);
  EXPECT_NE(from_shards.find("test accuracy"), std::string::npos) << from_shards;

  // Both saves are in metrics.jsonl, written in the background.
  const auto saves = metrics_events(out / "metrics.jsonl", "checkpoint");
  ASSERT_EQ(saves.size(), 2u);
  EXPECT_EQ(saves[1]["step"], 10);
  EXPECT_EQ(saves[1]["format"], "sharded");
  EXPECT_TRUE(saves[1]["background"].get<bool>());
  EXPECT_EQ(saves[1]["bytes"].get<std::int64_t>(),
            std::int64_t(fs::file_size(dir / "index.json") + fs::file_size(dir / "trainer_state.json") +
                         fs::file_size(dir / "scheduler.json") + fs::file_size(dir / "training_args.json") +
                         a + b));

  Process info({LOCKSTEP_BINARY, "checkpoint", "info", dir.string()});
  ASSERT_EQ(info.wait(60), 0) << info.output();
  EXPECT_NE(info.output().find("written by 2 ranks, step 10"), std::string::npos) << info.output();
  EXPECT_NE(info.output().find("fc1.weight"), std::string::npos) << info.output();
}

// 640 samples; 2 workers x 16 take 160 in 5 steps; 3 workers x 16 take the other 480 in 10 steps:
// together each sample of the epoch exactly once, with the ZeRO-2 shards read back under DDP.
TEST(ShardedRuns, AStageTwoCheckpointOfTwoResumesUnderDdpOnThreeTrainingEachSampleOnce) {
  TempDir out("sharded-reshard"), record("sharded-reshard-record");
  const std::vector<std::string> common = {"--record-dir",
                                           record.path(),
                                           "--train-limit",
                                           "640",
                                           "--per-device-train-batch-size",
                                           "16",
                                           "--logging-steps",
                                           "5",
                                           "--lr-scheduler-type",
                                           "constant",
                                           "--learning-rate",
                                           "3e-3"};
  run_ok(launch(2, ELASTIC_WORKER,
                with(common, {"--zero-stage", "2", "--max-steps", "5", "--save-strategy", "steps",
                              "--save-steps", "5", "--output-dir", out.path()})));
  ASSERT_TRUE(fs::exists(out / "checkpoint-5/index.json"));
  const std::string resumed =
      run_ok(launch(3, ELASTIC_WORKER,
                    with(common, {"--max-steps", "15", "--resume-from-checkpoint", out / "checkpoint-5",
                                  "--output-dir", out / "resumed"})));
  EXPECT_NE(
      resumed.find("the 160 samples of epoch 0 already trained on stay done, the rest are dealt over 3"),
      std::string::npos)
      << resumed;
  const auto steps = lockstep::testing::trained_samples(record.path());
  EXPECT_EQ(lockstep::testing::each_sample_once_per_epoch(steps, 15, 1, 640), "");
  // The loss goes on from the checkpoint's, not from an untrained model's (ln 10 = 2.3).
  const auto before = metrics_events(out / "metrics.jsonl", "log"),
             after = metrics_events(out / "resumed/metrics.jsonl", "log");
  ASSERT_FALSE(before.empty());
  ASSERT_FALSE(after.empty());
  EXPECT_LT(after.front()["loss"].get<double>(), 0.8 * 2.3);
  const auto loads = metrics_events(out / "resumed/metrics.jsonl", "checkpoint");
  ASSERT_FALSE(loads.empty());
  EXPECT_EQ(loads.front()["action"], "resume");
  EXPECT_EQ(loads.front()["saved_world_size"], 2);
  EXPECT_EQ(loads.front()["world_size"], 3);
}

// Stage 3 needs the model's units (libtorch has no forward hooks): a model without them is told so.
TEST(ShardedRuns, StageThreeWithAModelThatNamesNoUnitsIsOneClearError) {
  TempDir out("zero3-no-units"), record("zero3-no-units-record");
  Process p(launch(2, ELASTIC_WORKER, {"--record-dir", record.path(), "--zero-stage", "3", "--max-steps", "2",
                                       "--output-dir", out.path()}));
  EXPECT_NE(p.wait(120), 0);
  EXPECT_NE(p.output().find("--zero-stage 3: the model names no parameter units"), std::string::npos) << p.output();
}

}  // namespace
