// The Trainer's checkpoints (see trainer_checkpoints.h).
#include "trainer_checkpoints.h"

#include <csignal>
#include <filesystem>
#include <functional>

#include "lockstep/base/log.h"
#include "lockstep/base/main.h"
#include "lockstep/comm/collectives.h"
#include "lockstep/error.h"
#include "checkpoint_writer.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/ddp/optimizer_state.h"
#include "lockstep/train/sharded_checkpoint.h"
#include "lockstep/train_core/durable_file.h"
#include "lockstep/train_core/metrics.h"
#include "lockstep/base/run_env.h"
#include "trainer_impl.h"

namespace fs = std::filesystem;

namespace lockstep::train {
namespace {

nlohmann::json scheduler_json(const Trainer::Impl& t) {
  return {{"type", t.schedule.type},         {"warmup_steps", t.schedule.warmup},
          {"total_steps", t.schedule.total}, {"last_step", t.state.global_step},
          {"base_lr", t.args.learning_rate}, {"last_lr", t.learning_rate_at(t.state.global_step)}};
}

// Rank 0's outcome of a save, shared so every rank fails (or goes on) the same way.
enum class SaveOutcome : std::int32_t { ok = 0, failed = 1, no_storage = 2 };

// Collective: every rank learns the worst outcome of all and, unless it is ok, throws the same
// kind of error (StorageError for a full or read-only disk) with failure(): the message, built
// only when needed.
void agree_on_outcome(comm::Communicator& comm, SaveOutcome mine, const std::function<std::string()>& failure) {
  auto worst = static_cast<std::int32_t>(mine);
  comm.allreduce(&worst, 1, comm::DType::i32, comm::ReduceOp::max)->wait();
  if (worst == static_cast<std::int32_t>(SaveOutcome::no_storage)) throw StorageError(failure());
  if (worst != static_cast<std::int32_t>(SaveOutcome::ok)) throw Error(failure());
}

// Local SGD: each machine's inner optimizer state is its own (AdamW's moments differ between
// machines). The first rank of each machine but machine 0 sends its state to rank 0 (point to
// point: rank 0 alone needs it); rank 0 returns the files, the others nothing.
std::vector<CheckpointFile> machine_optimizer_files(Trainer::Impl& t) {
  std::vector<CheckpointFile> files;
  if (!t.step.outer()) return files;
  const std::vector<int>& machine_of = t.comm->machine_of();
  std::vector<int> first_rank;  // machines are numbered by their lowest rank
  for (int r = 0; r < t.world(); ++r)
    if (machine_of[std::size_t(r)] == int(first_rank.size())) first_rank.push_back(r);
  constexpr int kTag = 0x5eed;
  const int machine = machine_of[std::size_t(t.rank())];
  if (machine > 0 && first_rank[std::size_t(machine)] == t.rank()) {
    std::string bytes = optimizer_bytes(*t.step.optimizer());
    std::int64_t n = std::int64_t(bytes.size());
    bytes.resize((bytes.size() + 3) / 4 * 4);
    t.comm->send(&n, 1, comm::DType::i64, 0, kTag)->wait();
    t.comm->send(bytes.data(), bytes.size() / 4, comm::DType::i32, 0, kTag)->wait();
  } else if (t.rank() == 0) {
    for (int m = 1; m < int(first_rank.size()); ++m) {
      std::int64_t n = 0;
      t.comm->recv(&n, 1, comm::DType::i64, first_rank[std::size_t(m)], kTag)->wait();
      std::string bytes((std::size_t(n) + 3) / 4 * 4, '\0');
      t.comm->recv(bytes.data(), bytes.size() / 4, comm::DType::i32, first_rank[std::size_t(m)], kTag)->wait();
      bytes.resize(std::size_t(n));
      files.push_back({CheckpointDir::machine_optimizer_name(m), std::move(bytes)});
    }
  }
  return files;
}

// The files beside the usual ones: local SGD's outer momentum and the other machines' states.
std::vector<CheckpointFile> extra_files(Trainer::Impl& t) {
  std::vector<CheckpointFile> files = machine_optimizer_files(t);
  if (t.step.outer() && t.rank() == 0) files.push_back({CheckpointDir::kOuterOptimizer, optimizer_bytes(t.step.outer()->outer())});
  return files;
}

// Rank 0 writes the checkpoint; returns how it went and, on failure, why.
SaveOutcome write_on_rank0(Trainer::Impl& t, torch::optim::Optimizer& optimizer, const fs::path& dir,
                           const nlohmann::json& trainer_state, const std::vector<CheckpointFile>& extra,
                           std::string& error) {
  if (t.rank() != 0) return SaveOutcome::ok;
  try {
    const bool die = t.fault("kill-during-save", t.state.global_step);
    write_checkpoint(dir.string(), *t.model.module, optimizer, scheduler_json(t), t.args.to_json(),
                     trainer_state, [die] {
                       if (die) std::raise(SIGKILL);
                     },
                     extra);
    std::vector<std::string> keep = {dir.string()};
    if (!t.state.best_checkpoint.empty()) keep.push_back(t.state.best_checkpoint);
    rotate_checkpoints(t.args.output_dir, t.args.save_total_limit, keep);
    return SaveOutcome::ok;
  } catch (const StorageError& e) {
    error = e.what();
    return SaveOutcome::no_storage;
  } catch (const std::exception& e) {
    error = first_line(e.what());
    return SaveOutcome::failed;
  }
}

std::string intact_note(const std::string& output_dir) {
  const std::string latest = latest_checkpoint(output_dir);
  return latest.empty() ? "no earlier checkpoint exists"
                        : fs::path(latest).filename().string() + " is intact";
}

}  // namespace


TrainerCheckpoints::TrainerCheckpoints(Trainer::Impl& trainer) : t_(trainer) {}

TrainerCheckpoints::~TrainerCheckpoints() = default;

TrainerCheckpoints::RankStates TrainerCheckpoints::gather_rank_states() const {
  RankStates out{comm::allgather_strings(*t_.comm, rng_state_hex()), {}};
  if (t_.args.fp16)
    for (const auto& scale : comm::allgather_strings(*t_.comm, t_.step.loss_scale().to_json().dump()))
      out.loss_scales.push_back(nlohmann::json::parse(scale));
  return out;
}

nlohmann::json TrainerCheckpoints::trainer_state_json(std::size_t sampler_position, const RankStates& ranks) const {
  nlohmann::json j = t_.state.position_json();
  j.update({{"sampler_position", sampler_position},
            {"sampler_offset", sampler_offset_},
            {"world_size", t_.world()},
            {"data_world_size", t_.data_world()},
            {"pipeline_parallel", t_.args.pipeline_parallel},
            {"tensor_parallel", t_.layout().tensor()},
            {"seed", t_.args.seed},
            {"rng_states", ranks.rngs}});
  if (t_.args.fp16) {
    j["loss_scale"] = ranks.loss_scales.at(0);
    // Local SGD: each machine skips its own overflowed steps and keeps its own scale (elsewhere
    // every rank holds the same one).
    if (t_.step.outer()) j["loss_scales"] = ranks.loss_scales;
  }
  return j;
}

std::string TrainerCheckpoints::name_this_step() {
  const std::string name = "checkpoint-" + std::to_string(t_.state.global_step);
  if (improved_since_save_) {
    t_.state.set_best_checkpoint(name);
    improved_since_save_ = false;
  }
  return name;
}

std::string TrainerCheckpoints::save(std::size_t sampler_position) {
  t_.step.meet_machines();  // local SGD: the checkpoint holds the machines' common model
  return sharded_saves() ? save_sharded(sampler_position) : save_consolidated(sampler_position);
}

std::string TrainerCheckpoints::save_consolidated(std::size_t sampler_position) {
  const auto begin = Clock::now();
  const RankStates ranks = gather_rank_states();
  const std::string name = name_this_step();
  const fs::path dir = fs::path(t_.args.output_dir) / name;
  // Under ZeRO the slices' state is put together first, into the file DDP would write.
  WholeParameters parameters(t_, false);
  std::unique_ptr<torch::optim::Optimizer> gathered;
  torch::optim::Optimizer& optimizer = t_.step.whole_optimizer(gathered);
  const std::vector<CheckpointFile> extra = extra_files(t_);
  std::string error;
  const SaveOutcome outcome =
      write_on_rank0(t_, optimizer, dir, trainer_state_json(sampler_position, ranks), extra, error);
  // Everyone learns whether rank 0 managed (and nobody runs ahead of a checkpoint in progress).
  agree_on_outcome(*t_.comm, outcome, [&] {
    const std::string what = t_.rank() == 0 ? error : "rank 0 could not write it (see rank 0's message)";
    return "checkpoint " + dir.string() + " was not saved: " + what + "; " + intact_note(t_.args.output_dir);
  });
  for (auto& cb : t_.callbacks) cb->on_save(t_.state, dir.string());
  const double seconds = seconds_between(begin, Clock::now());
  record(dir.string(), "save", false, false, seconds, seconds, t_.world());
  if (t_.trace()) t_.trace()->span("checkpoint", 1, begin, Clock::now(), {{"dir", name}});
  return dir.string();
}

void TrainerCheckpoints::write_results(const std::string& split, const nlohmann::json& metrics) {
  const fs::path path = fs::path(t_.args.output_dir) / (split + "_results.json");
  std::string error;
  SaveOutcome outcome = SaveOutcome::ok;
  if (t_.rank() == 0) {
    try {
      fs::create_directories(t_.args.output_dir);
      write_file_durably(path.string(), metrics.dump(2) + "\n");
    } catch (const StorageError& e) {
      error = e.what();
      outcome = SaveOutcome::no_storage;
    } catch (const std::exception& e) {
      error = first_line(e.what());
      outcome = SaveOutcome::failed;
    }
  }
  agree_on_outcome(*t_.comm, outcome, [&] {
    return path.string() + " was not written: " +
           (t_.rank() == 0 ? error : "rank 0 could not write it (see rank 0's message)");
  });
}

void TrainerCheckpoints::record(const std::string& dir, const std::string& action, bool sharded, bool background,
                                double stall_seconds, double write_seconds, int saved_world) {
  if (t_.rank() != 0 || !t_.reports.opened()) return;
  metrics::CheckpointLog r;
  r.step = checkpoint_step(dir);
  r.dir = dir;
  r.action = action;
  r.format = sharded ? "sharded" : "consolidated";
  r.background = background;
  r.stall_seconds = stall_seconds;
  r.write_seconds = write_seconds;
  std::error_code ec;
  for (const auto& f : fs::directory_iterator(dir, ec))
    if (f.is_regular_file()) r.bytes += std::int64_t(f.file_size());
  r.saved_world_size = saved_world;
  r.world_size = t_.world();
  const nlohmann::json line = r.to_json();
  if (action == "resume")
    resume_record_ = line;  // written after this start's train_begin
  else
    t_.reports.record(line);
}

std::optional<nlohmann::json> TrainerCheckpoints::take_resume_record() {
  std::optional<nlohmann::json> line;
  line.swap(resume_record_);
  return line;
}

bool TrainerCheckpoints::sharded_saves() const {
  if (t_.step.pipeline()) return true;  // each pipeline rank saves its stages' part
  if (t_.tensor_comm) return true;       // each rank saves its cut of the gathered whole tensors
  if (t_.elastic) return false;  // the writer's reports need one communicator for the whole save
  return t_.args.save_format == "sharded" || (t_.args.save_format == "auto" && t_.zero_plan.sharded());
}

void TrainerCheckpoints::finish_background_save() {
  if (in_flight_.empty()) return;
  const CheckpointWriter::Outcome mine = writer_->wait();
  const std::string dir = in_flight_;
  in_flight_.clear();
  const SaveOutcome outcome = mine.error.empty() ? SaveOutcome::ok
                              : mine.no_storage  ? SaveOutcome::no_storage
                                                 : SaveOutcome::failed;
  agree_on_outcome(*t_.comm, outcome, [&] {
    const std::string what = !mine.error.empty() ? first_line(mine.error) : "another rank could not write its part";
    return "checkpoint " + dir + " was not saved: " + what + "; " + intact_note(t_.args.output_dir);
  });
  // A synchronous save held the step for the writing too.
  const bool background = t_.args.save_in_background;
  const double stall = background ? stall_seconds_ : stall_seconds_ + mine.seconds;
  record(dir, "save", true, background, stall, mine.seconds, t_.world());
  for (auto& cb : t_.callbacks) cb->on_save(t_.state, dir);
}

namespace {

// Rank 0 makes a fresh temporary directory before anyone writes into it; every rank learns
// whether it could.
void prepare_temporary_dir(Trainer::Impl& t, const fs::path& tmp, const fs::path& dir) {
  std::string error;
  auto ready = static_cast<std::int32_t>(SaveOutcome::ok);
  if (t.rank() == 0) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    fs::create_directories(tmp, ec);
    if (ec) {
      error = "cannot create " + tmp.string() + ": " + ec.message();
      ready = static_cast<std::int32_t>(SaveOutcome::failed);
    }
  }
  t.comm->allreduce(&ready, 1, comm::DType::i32, comm::ReduceOp::max)->wait();
  if (ready != static_cast<std::int32_t>(SaveOutcome::ok))
    throw Error("checkpoint " + dir.string() + " was not saved: " +
                (t.rank() == 0 ? error : "rank 0 could not prepare it") + "; " + intact_note(t.args.output_dir));
}

// Rank 0's part of a sharded save besides its shard: the index's fields, the run's JSON files,
// the fault the tests may ask for, and the rotation once committed.
void add_rank0_files(Trainer::Impl& t, const nlohmann::json& trainer_state, CheckpointWriter::Job& job) {
  job.extra = {{"optimizer", job.snapshot.optimizer},
               {"global_step", t.state.global_step},
               {"world_size", t.world()},
               {"pipeline_parallel", t.args.pipeline_parallel},
               {"tensor_parallel", t.layout().tensor()},
               {"zero_stage", t.step.zero() || t.step.pipeline() ? t.zero_plan.stage : 0}};
  job.files = {{CheckpointDir::kTrainerState, trainer_state.dump(2)},
               {CheckpointDir::kScheduler, scheduler_json(t).dump(2)},
               {CheckpointDir::kTrainingArgs, t.args.to_json().dump(2)}};
  job.before_commit = [die = t.fault("kill-during-save", t.state.global_step)] {
    if (die) std::raise(SIGKILL);
  };
  std::vector<std::string> keep = {job.final_dir};
  if (!t.state.best_checkpoint.empty()) keep.push_back(t.state.best_checkpoint);
  job.after_commit = [output_dir = t.args.output_dir, limit = t.args.save_total_limit, keep] {
    rotate_checkpoints(output_dir, limit, keep);
  };
}

[[noreturn]] void refuse_consolidated_into_split(const std::string& dir) {
  throw ConfigError("--resume-from-checkpoint " + dir + ": a consolidated checkpoint (model.pt) does not load into "
                    "a model split for --tensor-parallel yet; resume it without --tensor-parallel and save with "
                    "--save-format sharded, which any layout loads");
}

}  // namespace

// Every rank snapshots what it holds and hands it to its writer; the step goes on at once unless
// the previous save is still being written (or --save-in-background=false).
std::string TrainerCheckpoints::save_sharded(std::size_t sampler_position) {
  const auto begin = Clock::now();
  finish_background_save();
  if (!writer_) writer_ = std::make_unique<CheckpointWriter>(*t_.comm);
  const RankStates ranks = gather_rank_states();
  const std::string name = name_this_step();
  const fs::path dir = fs::path(t_.args.output_dir) / name, tmp = fs::path(t_.args.output_dir) / (".tmp-" + name);
  prepare_temporary_dir(t_, tmp, dir);
  CheckpointWriter::Job job;
  job.tmp_dir = tmp.string();
  job.final_dir = dir.string();
  // A synchronous save writes straight from the live tensors (no copy: the step waits for it).
  const bool copy = t_.args.save_in_background;
  job.snapshot = t_.step.snapshot(copy);
  if (t_.rank() == 0) add_rank0_files(t_, trainer_state_json(sampler_position, ranks), job);
  writer_->submit(std::move(job));
  in_flight_ = dir.string();
  stall_seconds_ = seconds_between(begin, Clock::now());
  if (!t_.args.save_in_background) finish_background_save();
  if (t_.trace()) t_.trace()->span("checkpoint", 1, begin, Clock::now(), {{"dir", name}});
  return dir.string();
}

std::string TrainerCheckpoints::resume_target() const {
  const std::string& r = t_.args.resume_from_checkpoint;
  if (r == "latest" || (r.empty() && restart_count_from_env() > 0)) return latest_checkpoint(t_.args.output_dir);
  if (r.empty()) return "";
  if (!CheckpointDir(r).complete())
    throw ConfigError(
        "--resume-from-checkpoint " + r +
        " is not a checkpoint directory (no trainer_state.json); pass a checkpoint-<step> directory "
        "or 'latest'");
  return r;
}

// A pipeline rank: the whole model's values (every rank holds the model; its stages train their
// part), and the optimizer's state of the parameters it owns, from a checkpoint of any layout
// (pipelined or not, sharded or consolidated).
void TrainerCheckpoints::load_pipeline_rank(const std::string& dir) {
  Model& model = t_.model;
  TrainingStep& step = t_.step;
  const std::optional<TensorSplit> split = t_.tensor_split();  // whole tensors: each rank reads its shards
  if (CheckpointDir(dir).sharded()) {
    load_sharded(dir, *model.module, nullptr, /*part=*/false, split ? &*split : nullptr);
    load_sharded(dir, *step.stage_module(), step.optimizer(), /*part=*/true, split ? &*split : nullptr);
    step.keep_own_optimizer_state();
    return;
  }
  if (split) refuse_consolidated_into_split(dir);
  load_module(*model.module, CheckpointDir(dir).model());
  auto whole = step.make_optimizer(model.module->parameters());
  load_optimizer(*whole, optimizer_path(dir));
  for (const auto& p : step.pipeline()->parameters()) {
    const auto it = whole->state().find(ddp_detail::key_of(p));
    if (it != whole->state().end()) step.optimizer()->state()[ddp_detail::key_of(p)] = std::move(it->second);
  }
  step.keep_own_optimizer_state();
}

// The model and the optimizer's state from either format, at any world size and ZeRO stage: each
// rank reads the whole state and, under ZeRO, keeps its slices.
void TrainerCheckpoints::load_state(const std::string& dir) {
  Model& model = t_.model;
  TrainingStep& step = t_.step;
  if (step.pipeline()) return load_pipeline_rank(dir);
  const CheckpointDir checkpoint(dir);
  const std::optional<TensorSplit> split = t_.tensor_split();
  if (split && !checkpoint.sharded()) refuse_consolidated_into_split(dir);
  if (step.stage3() && checkpoint.sharded()) {  // only this rank's slices are read
    load_sharded_slices(dir, *model.module, *step.zero(), split ? &*split : nullptr);
    return;
  }
  WholeParameters parameters(t_, true);  // stage 3 from consolidated files: loaded whole, then cut
  std::unique_ptr<torch::optim::Optimizer> whole;
  if (step.zero()) whole = step.make_optimizer(model.module->parameters());
  torch::optim::Optimizer& target = step.zero() ? *whole : *step.optimizer();
  if (checkpoint.sharded()) {
    load_sharded(dir, *model.module, &target, /*part=*/false, split ? &*split : nullptr);
  } else {
    load_module(*model.module, checkpoint.model());
    load_optimizer(target, optimizer_path(dir));
  }
  if (step.zero()) step.zero()->load_consolidated(*whole);
  step.keep_own_optimizer_state();  // ZeRO-1 by tensors: this data rank's share alone
  if (step.outer()) resume_outer(dir);
}

// Local SGD: a machine's own optimizer state when the checkpoint has it (a checkpoint saved
// with fewer machines, or without --sync-every, gives every machine machine 0's).
std::string TrainerCheckpoints::optimizer_path(const std::string& dir) const {
  const CheckpointDir checkpoint(dir);
  const int machine = t_.step.outer() ? t_.comm->machine_of()[std::size_t(t_.rank())] : 0;
  if (machine == 0) return checkpoint.optimizer();
  const std::string own = checkpoint.machine_optimizer(machine);
  if (fs::exists(own)) return own;
  LOCKSTEP_LOG(info, train) << dir << " holds no " << CheckpointDir::machine_optimizer_name(machine) << ": rank "
                            << t_.rank() << " (machine " << machine << ") starts from machine 0's optimizer state";
  return checkpoint.optimizer();
}

// Local SGD: every rank loaded the same parameters, the new anchor; the outer momentum comes
// from the checkpoint when it has one (a checkpoint of a run without --sync-every has none).
void TrainerCheckpoints::resume_outer(const std::string& dir) {
  OuterOptimizer& outer = *t_.step.outer();
  outer.restart_from_parameters();
  const std::string path = CheckpointDir(dir).outer_optimizer();
  if (fs::exists(path)) {
    load_optimizer(outer.outer(), path);
  } else if (t_.args.outer_momentum > 0 && t_.rank() == 0) {
    LOCKSTEP_LOG(info, train) << dir << " holds no " << CheckpointDir::kOuterOptimizer
                              << " (saved without --sync-every): the outer momentum starts from zero";
  }
}

// This rank's own scale when the checkpoint has one per rank (local SGD, the same world), else
// the job's. A checkpoint of a run without --fp16 has none: the scale starts afresh.
void TrainerCheckpoints::restore_loss_scale(const nlohmann::json& state, int saved_world) {
  if (state.contains("loss_scales") && saved_world == t_.world())
    t_.step.loss_scale().load_json(state["loss_scales"].at(static_cast<std::size_t>(t_.rank())));
  else if (state.contains("loss_scale"))
    t_.step.loss_scale().load_json(state["loss_scale"]);
}

void TrainerCheckpoints::resume(const std::string& dir, data::DistributedSampler& sampler) {
  const auto begin = Clock::now();
  const std::string state_path = CheckpointDir(dir).trainer_state();
  const nlohmann::json s = read_json_file(state_path, "the trainer state of a checkpoint");
  load_state(dir);
  TrainerState& state = t_.state;
  int saved_world = 0, saved_pipeline = 1, saved_tensor = 1;
  std::size_t consumed = 0;  // samples of this epoch trained on before the checkpoint
  bool same_layout = false;
  try {
    state.load_position(s);
    saved_world = s.at("world_size").get<int>();
    if (t_.args.fp16) restore_loss_scale(s, saved_world);
    const data::SamplerState saved{state.epoch, s.at("sampler_position").get<std::size_t>(),
                                   s.value("sampler_offset", std::size_t{0})};
    sampler.set_epoch(state.epoch);
    // The data is dealt over the replicas (every rank without a pipeline); the generators are per rank.
    const int saved_data_world = s.value("data_world_size", saved_world);
    consumed = data::consumed_in_epoch(saved, saved_data_world, t_.train_set->size());
    saved_pipeline = s.value("pipeline_parallel", 1);
    saved_tensor = s.value("tensor_parallel", 1);
    same_layout = saved_world == t_.world() && saved_pipeline == t_.args.pipeline_parallel &&
                  saved_tensor == t_.layout().tensor();
    if (same_layout) set_rng_state_hex(s.at("rng_states").at(static_cast<std::size_t>(t_.rank())).get<std::string>());
    if (saved_data_world == t_.data_world()) {
      sampler.load_state(saved);
      sampler_offset_ = saved.offset;
    } else {  // the old world took the start of this epoch's permutation; this one deals the rest
      sampler_offset_ = consumed;
      sampler.load_state({state.epoch, 0, sampler_offset_});
    }
  } catch (const nlohmann::json::exception& e) {
    throw DataError(state_path + " lacks a field a checkpoint must have (" + first_line(e.what()) +
                    "): the file is damaged; start from another checkpoint");
  }
  if (!same_layout) {
    if (t_.rank() == 0)
      LOCKSTEP_LOG(info, train) << dir << " was written by " << saved_world << " workers"
                                << (saved_pipeline > 1 ? " (" + std::to_string(saved_pipeline) + " pipeline ranks)" : "")
                                << (saved_tensor > 1 ? " (" + std::to_string(saved_tensor) + " tensor ranks)" : "")
                                << ", this run has " << t_.world() << ": the " << consumed << " samples of epoch "
                                << state.epoch << " already trained on stay done, the rest are dealt over "
                                << t_.data_world() << "; each rank's RNG stream starts afresh";
    torch::manual_seed(t_.args.seed + static_cast<std::uint64_t>(t_.data_rank()));
  }
  record(dir, "resume", CheckpointDir(dir).sharded(), false, seconds_between(begin, Clock::now()), 0, saved_world);
  if (t_.rank() == 0)
    LOCKSTEP_LOG(info, train) << "resumed from " << dir << " at step " << state.global_step << " (epoch "
                              << state.epoch << ", " << state.steps_in_epoch << " steps into it)";
}

}  // namespace lockstep::train
