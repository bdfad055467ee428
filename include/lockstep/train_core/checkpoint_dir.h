// What a checkpoint directory holds and where each piece lives: the one answer every reader and
// writer of checkpoints asks (the Trainer's saves and resumes, the background writer, `lockstep
// checkpoint`, load_module given a model.pt). Torch-free: paths and names only.
//
// OUTPUT_DIR/checkpoint-<step>/ holds, in either format:
//   trainer_state.json        the run's position (written last: a directory without it is no
//                             checkpoint), scheduler.json, training_args.json
// consolidated (one process wrote everything):
//   model.pt                  parameters and buffers (torch::save format)
//   optimizer.pt              the optimizer's state; local SGD: machine 0's
//   optimizer-machine-<m>.pt  local SGD: machine m's own optimizer state
//   outer_optimizer.pt        local SGD: the outer step's momentum
// sharded (every rank wrote its part; docs/checkpoint-format.md):
//   shard-<r>-of-<W>.bin      rank r's pieces
//   index.json                what every shard holds (written last by rank 0)
// Saves go into a .tmp-* sibling that is renamed into place, so readers see whole directories only.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace lockstep::train {

class CheckpointDir {
 public:
  explicit CheckpointDir(std::string path) : path_(std::move(path)) {}
  // The directory a model.pt path names when that file is absent and its directory is sharded
  // (the parameters are in the shards then), else nothing.
  static std::optional<CheckpointDir> sharded_in_place_of(const std::string& model_path);

  const std::string& path() const { return path_; }
  std::string name() const;  // "checkpoint-400"

  // Where each piece lives.
  std::string trainer_state() const { return file(kTrainerState); }
  std::string scheduler() const { return file(kScheduler); }
  std::string training_args() const { return file(kTrainingArgs); }
  std::string model() const { return file(kModel); }
  std::string optimizer() const { return file(kOptimizer); }
  std::string machine_optimizer(int machine) const { return file(machine_optimizer_name(machine)); }
  std::string outer_optimizer() const { return file(kOuterOptimizer); }
  std::string index() const { return file(kIndex); }
  std::string shard(int rank, int world) const { return file(shard_name(rank, world)); }
  std::string file(const std::string& name) const;

  // What it holds, read from the disk.
  bool complete() const;  // trainer_state.json is there
  bool sharded() const;   // index.json is there

  // The pieces' names, for writers that fill a temporary directory under another name.
  static constexpr const char* kTrainerState = "trainer_state.json";
  static constexpr const char* kScheduler = "scheduler.json";
  static constexpr const char* kTrainingArgs = "training_args.json";
  static constexpr const char* kModel = "model.pt";
  static constexpr const char* kOptimizer = "optimizer.pt";
  static constexpr const char* kOuterOptimizer = "outer_optimizer.pt";
  static constexpr const char* kIndex = "index.json";
  static std::string machine_optimizer_name(int machine);  // "optimizer-machine-<m>.pt"
  static std::string shard_name(int rank, int world);      // "shard-00003-of-00008.bin"

 private:
  std::string path_;
};

// The step in a "checkpoint-<step>" name, or -1.
std::int64_t checkpoint_step(const std::string& path);

// The complete checkpoint directories under output_dir, oldest (lowest step) first.
std::vector<std::string> list_checkpoints(const std::string& output_dir);

// The newest of them, or "" when there is none.
std::string latest_checkpoint(const std::string& output_dir);

// Deletes the oldest checkpoints until at most `limit` remain (0: no limit), never the ones
// named in `keep` (the latest and the best). Returns the paths deleted.
std::vector<std::string> rotate_checkpoints(const std::string& output_dir, int limit,
                                            const std::vector<std::string>& keep);

}  // namespace lockstep::train
