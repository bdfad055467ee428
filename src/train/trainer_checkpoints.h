// The Trainer's checkpoints: what a checkpoint holds of a run, saving it (consolidated by rank 0,
// or sharded by every rank, in the background when asked), finding the checkpoint to resume from,
// and resuming at any world size and ZeRO stage.
//
// It reads the run (model, optimizers, state, arguments, communicator) through the Trainer it
// belongs to, and owns what only checkpoints need: the background writer and the save in flight,
// the record of a resume, which checkpoint becomes the best one, and how much of this epoch an
// earlier world had already taken.
//
// Threading: the training thread only. Every call but resume_target() is collective: each rank
// learns whether a save or a results file made it to disk, and fails the same way when it did not.
#pragma once

#include <torch/torch.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <string>

#include "lockstep/data/sampler.h"
#include "lockstep/train/trainer.h"

namespace lockstep::train {

class CheckpointWriter;

class TrainerCheckpoints {
 public:
  explicit TrainerCheckpoints(Trainer::Impl& trainer);
  ~TrainerCheckpoints();
  TrainerCheckpoints(const TrainerCheckpoints&) = delete;
  TrainerCheckpoints& operator=(const TrainerCheckpoints&) = delete;

  // Where this start resumes from (--resume-from-checkpoint, or the latest after a restart by the
  // launcher), "" for a fresh start; a ConfigError when the named directory is not a checkpoint.
  std::string resume_target() const;
  // The model, optimizer, schedule position, RNG and sampler from `dir`.
  void resume(const std::string& dir, data::DistributedSampler& sampler);
  // The checkpoint of the current step; its directory. A sharded save may still be writing when it
  // returns (finish_background_save() waits for it).
  std::string save(std::size_t sampler_position);
  // Waits for the save in flight, if any; every rank learns whether it was committed (a failure
  // throws, as save() does).
  void finish_background_save();
  // Rank 0 writes OUTPUT_DIR/<split>_results.json; every rank learns how it went.
  void write_results(const std::string& split, const nlohmann::json& metrics);

  // The checkpoint record of the resume, for metrics.jsonl after this start's train_begin (once).
  std::optional<nlohmann::json> take_resume_record();
  // A new epoch begins in this world: none of it was taken by another.
  void begin_epoch() { sampler_offset_ = 0; }
  // The best metric improved since the last save: the next checkpoint becomes the best one.
  bool improved_since_save() const { return improved_since_save_; }
  void set_improved_since_save(bool improved) { improved_since_save_ = improved; }

 private:
  bool sharded_saves() const;
  std::string save_consolidated(std::size_t sampler_position);
  std::string save_sharded(std::size_t sampler_position);
  // The checkpoint's name for this step; it becomes the best one if the metric improved.
  std::string name_this_step();
  // Collective: what each rank adds to trainer_state.json, in rank order.
  struct RankStates {
    std::vector<std::string> rngs;         // its generator's state
    std::vector<nlohmann::json> loss_scales;  // --fp16: its loss scale (its machine's under local SGD)
  };
  RankStates gather_rank_states() const;
  nlohmann::json trainer_state_json(std::size_t sampler_position, const RankStates& ranks) const;
  void restore_loss_scale(const nlohmann::json& state, int saved_world);
  void load_state(const std::string& dir);
  void load_pipeline_rank(const std::string& dir);
  void resume_outer(const std::string& dir);
  std::string optimizer_path(const std::string& dir) const;
  // A checkpoint record (metrics.jsonl) for `dir`: its files' bytes, this run's world.
  void record(const std::string& dir, const std::string& action, bool sharded, bool background,
              double stall_seconds, double write_seconds, int saved_world);

  Trainer::Impl& t_;
  std::unique_ptr<CheckpointWriter> writer_;  // sharded saves, made at the first
  std::string in_flight_;                     // the checkpoint the writer is writing ("" when none)
  double stall_seconds_ = 0;                  // the training thread's time in the save in flight
  std::optional<nlohmann::json> resume_record_;
  bool improved_since_save_ = false;
  std::size_t sampler_offset_ = 0;  // this epoch's samples taken before this world began it
};

}  // namespace lockstep::train
