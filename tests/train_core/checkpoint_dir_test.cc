// What a checkpoint directory holds, torch-free: where each piece lives, which directories count
// as checkpoints (complete ones only), rotation, and a model.pt that names a sharded directory.
#include "lockstep/train_core/checkpoint_dir.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "testing.h"

namespace lockstep::train {
namespace {

namespace fs = std::filesystem;

TEST(CheckpointDir, NamesEveryPieceInsideItsDirectory) {
  const CheckpointDir dir("/out/checkpoint-400");
  EXPECT_EQ(dir.name(), "checkpoint-400");
  EXPECT_EQ(CheckpointDir("/out/checkpoint-400/").name(), "checkpoint-400");
  EXPECT_EQ(dir.trainer_state(), "/out/checkpoint-400/trainer_state.json");
  EXPECT_EQ(dir.model(), "/out/checkpoint-400/model.pt");
  EXPECT_EQ(dir.optimizer(), "/out/checkpoint-400/optimizer.pt");
  EXPECT_EQ(dir.machine_optimizer(2), "/out/checkpoint-400/optimizer-machine-2.pt");
  EXPECT_EQ(dir.outer_optimizer(), "/out/checkpoint-400/outer_optimizer.pt");
  EXPECT_EQ(dir.index(), "/out/checkpoint-400/index.json");
  EXPECT_EQ(dir.shard(3, 8), "/out/checkpoint-400/shard-00003-of-00008.bin");
}

TEST(CheckpointDir, IsCompleteOnlyWithItsTrainerStateAndShardedOnlyWithItsIndex) {
  lockstep::testing::TempDir temp("checkpoint-dir");
  const CheckpointDir dir(temp / "checkpoint-7");
  fs::create_directories(dir.path());
  EXPECT_FALSE(dir.complete());
  EXPECT_FALSE(dir.sharded());
  std::ofstream(dir.index()) << "{}";
  EXPECT_TRUE(dir.sharded());
  EXPECT_FALSE(dir.complete());
  std::ofstream(dir.trainer_state()) << "{}";
  EXPECT_TRUE(dir.complete());
}

TEST(CheckpointDir, AModelFileNamesItsShardsOnlyWhenAbsentFromAShardedDirectory) {
  lockstep::testing::TempDir temp("in-place");
  const CheckpointDir dir(temp / "checkpoint-3");
  fs::create_directories(dir.path());
  EXPECT_FALSE(CheckpointDir::sharded_in_place_of(dir.model()));  // neither a model.pt nor an index
  std::ofstream(dir.index()) << "{}";
  ASSERT_TRUE(CheckpointDir::sharded_in_place_of(dir.model()));
  EXPECT_EQ(CheckpointDir::sharded_in_place_of(dir.model())->path(), dir.path());
  EXPECT_FALSE(CheckpointDir::sharded_in_place_of(dir.file("other.pt")));
  std::ofstream(dir.model()) << "x";  // a real model.pt is read as itself
  EXPECT_FALSE(CheckpointDir::sharded_in_place_of(dir.model()));
}

TEST(CheckpointDir, RotationKeepsTheLatestAndTheBestAndIgnoresPartialDirectories) {
  lockstep::testing::TempDir temp("rotation");
  const std::string dir = temp.path();
  for (int step : {10, 20, 30, 40, 50}) {
    fs::create_directories(dir + "/checkpoint-" + std::to_string(step));
    std::ofstream(dir + "/checkpoint-" + std::to_string(step) + "/trainer_state.json") << "{}";
  }
  fs::create_directories(dir + "/checkpoint-60");         // no trainer_state.json: incomplete
  fs::create_directories(dir + "/.tmp-checkpoint-70-1");  // a save that was killed
  EXPECT_EQ(latest_checkpoint(dir), dir + "/checkpoint-50");
  auto deleted = rotate_checkpoints(dir, 2, {dir + "/checkpoint-50", dir + "/checkpoint-20"});
  EXPECT_EQ(deleted.size(), 3u);
  auto left = list_checkpoints(dir);
  ASSERT_EQ(left.size(), 2u);
  EXPECT_EQ(fs::path(left[0]).filename(), "checkpoint-20");
  EXPECT_EQ(fs::path(left[1]).filename(), "checkpoint-50");
  EXPECT_EQ(checkpoint_step(dir + "/checkpoint-123"), 123);
  EXPECT_EQ(checkpoint_step(dir + "/checkpoint-12a"), -1);
}

}  // namespace
}  // namespace lockstep::train
