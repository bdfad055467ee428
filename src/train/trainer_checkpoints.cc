// The Trainer's checkpoints: what goes into trainer_state.json, saving (rank 0 writes, every
// rank learns how it went), finding the checkpoint to resume from, and resuming.
#include <torch/torch.h>

#include <csignal>
#include <filesystem>

#include "lockstep/base/log.h"
#include "lockstep/base/main.h"
#include "lockstep/comm/collectives.h"
#include "lockstep/error.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train_core/durable_file.h"
#include "lockstep/train_core/run_env.h"
#include "trainer_impl.h"

namespace fs = std::filesystem;

namespace lockstep::train {
namespace {

nlohmann::json scheduler_json(const Trainer::Impl& t) {
  return {{"type", t.schedule.type},         {"warmup_steps", t.schedule.warmup},
          {"total_steps", t.schedule.total}, {"last_step", t.state.global_step},
          {"base_lr", t.args.learning_rate}, {"last_lr", t.learning_rate_at(t.state.global_step)}};
}

nlohmann::json trainer_state_json(const Trainer::Impl& t, std::size_t sampler_position,
                                  const std::vector<std::string>& rng_states) {
  const TrainerState& s = t.state;
  return {{"global_step", s.global_step},
          {"max_steps", s.max_steps},
          {"epoch", s.epoch},
          {"steps_in_epoch", s.steps_in_epoch},
          {"fractional_epoch", s.fractional_epoch()},
          {"sampler_position", sampler_position},
          {"world_size", t.world()},
          {"seed", t.args.seed},
          {"rng_states", rng_states},
          {"best_metric", s.best_metric ? nlohmann::json(*s.best_metric) : nlohmann::json()},
          {"best_checkpoint", s.best_checkpoint},
          {"log_history", s.log_history}};
}

// Rank 0's outcome of a save, shared so every rank fails (or goes on) the same way.
enum class SaveOutcome : std::int32_t { ok = 0, failed = 1, no_storage = 2 };

// Rank 0 writes the checkpoint; returns how it went and, on failure, why.
SaveOutcome write_on_rank0(Trainer::Impl& t, torch::optim::Optimizer* optimizer, const fs::path& dir,
                           std::size_t sampler_position, const std::vector<std::string>& rngs, std::string& error) {
  if (t.rank() != 0) return SaveOutcome::ok;
  try {
    const std::int64_t step = t.state.global_step;
    write_checkpoint(dir.string(), *t.model.module, *optimizer, scheduler_json(t), t.args.to_json(),
                     trainer_state_json(t, sampler_position, rngs), [&] {
                       if (fault_requested("kill-during-save", step, 0)) std::raise(SIGKILL);
                     });
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

std::string Trainer::Impl::save(std::size_t sampler_position) {
  const auto begin = Clock::now();
  const std::vector<std::string> rngs = comm::allgather_strings(*comm, rng_state_hex());
  const std::string name = "checkpoint-" + std::to_string(state.global_step);
  const fs::path dir = fs::path(args.output_dir) / name;
  if (improved_since_save) {
    state.best_checkpoint = name;
    improved_since_save = false;
  }
  // Under ZeRO the slices' state is put together first, into the file DDP would write.
  std::unique_ptr<torch::optim::Optimizer> whole;
  if (zero) whole = zero->consolidated([this](std::vector<torch::Tensor> p) { return make_optimizer(p); });
  std::string error;
  auto outcome = static_cast<std::int32_t>(
      write_on_rank0(*this, zero ? whole.get() : optimizer.get(), dir, sampler_position, rngs, error));
  // Everyone learns whether rank 0 managed (and nobody runs ahead of a checkpoint in progress).
  comm->allreduce(&outcome, 1, comm::DType::i32, comm::ReduceOp::max)->wait();
  const std::string what = rank() == 0 ? error : "rank 0 could not write it (see rank 0's message)";
  if (outcome == static_cast<std::int32_t>(SaveOutcome::no_storage))
    throw StorageError("checkpoint " + dir.string() + " was not saved: " + what + "; " +
                       intact_note(args.output_dir));
  if (outcome != static_cast<std::int32_t>(SaveOutcome::ok))
    throw Error("checkpoint " + dir.string() + " was not saved: " + what + "; " +
                intact_note(args.output_dir));
  for (auto& cb : callbacks) cb->on_save(state, dir.string());
  if (trace()) trace()->span("checkpoint", 1, begin, Clock::now(), {{"dir", name}});
  return dir.string();
}

std::string Trainer::Impl::resume_target() const {
  const std::string& r = args.resume_from_checkpoint;
  if (r == "latest" || (r.empty() && restart_count_from_env() > 0)) return latest_checkpoint(args.output_dir);
  if (r.empty()) return "";
  if (!fs::exists(fs::path(r) / "trainer_state.json"))
    throw ConfigError(
        "--resume-from-checkpoint " + r +
        " is not a checkpoint directory (no trainer_state.json); pass a checkpoint-<step> directory "
        "or 'latest'");
  return r;
}

void Trainer::Impl::resume(const std::string& dir, data::DistributedSampler& sampler) {
  const std::string state_path = (fs::path(dir) / "trainer_state.json").string();
  const nlohmann::json s = read_json_file(state_path, "the trainer state of a checkpoint");
  load_module(*model.module, (fs::path(dir) / "model.pt").string());
  const std::string optimizer_path = (fs::path(dir) / "optimizer.pt").string();
  if (zero) {  // the file holds the whole state, as DDP writes it: each rank takes its slices
    auto whole = make_optimizer(model.module->parameters());
    load_optimizer(*whole, optimizer_path);
    zero->load_consolidated(*whole);
  } else {
    load_optimizer(*optimizer, optimizer_path);
  }
  int saved_world = 0;
  try {
    state.global_step = s.at("global_step").get<std::int64_t>();
    state.epoch = s.at("epoch").get<std::uint64_t>();
    state.steps_in_epoch = s.at("steps_in_epoch").get<std::int64_t>();
    if (s.contains("best_metric") && !s["best_metric"].is_null())
      state.best_metric = s["best_metric"].get<double>();
    state.best_checkpoint = s.value("best_checkpoint", "");
    state.log_history = s.value("log_history", nlohmann::json::array());
    saved_world = s.at("world_size").get<int>();
    if (saved_world == world()) {
      set_rng_state_hex(s.at("rng_states").at(static_cast<std::size_t>(rank())).get<std::string>());
      sampler.set_epoch(state.epoch);
      sampler.load_state({state.epoch, s.at("sampler_position").get<std::size_t>()});
    }
  } catch (const nlohmann::json::exception& e) {
    throw DataError(state_path + " lacks a field a checkpoint must have (" + first_line(e.what()) +
                    "): the file is damaged; start from another checkpoint");
  }
  if (saved_world != world()) {
    if (rank() == 0)
      LOCKSTEP_LOG(warn, train) << dir << " was written by " << saved_world << " workers, this run has "
                                << world()
                                << ": the data order of this epoch and the RNG streams start afresh";
    torch::manual_seed(args.seed + static_cast<std::uint64_t>(rank()));
    sampler.set_epoch(state.epoch);
    const std::size_t pos = static_cast<std::size_t>(state.steps_in_epoch) * samples_per_step();
    sampler.load_state({state.epoch, std::min(pos, sampler.num_samples())});
  }
  if (rank() == 0)
    LOCKSTEP_LOG(info, train) << "resumed from " << dir << " at step " << state.global_step << " (epoch "
                              << state.epoch << ", " << state.steps_in_epoch << " steps into it)";
}

}  // namespace lockstep::train
