#include "lockstep/train/trainer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "../ddp/signature.h"
#include "env.h"
#include "evaluate.h"
#include "lockstep/data/evaluation.h"
#include "lockstep/data/loader.h"
#include "lockstep/data/sampler.h"
#include "lockstep/ddp/ddp.h"
#include "lockstep/error.h"
#include "lockstep/train/blas.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train/schedule.h"
#include "progress.h"
#include "trace.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace lockstep::train {
namespace {

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Time of one logging window, summed over its steps.
struct Window {
  std::int64_t steps = 0;
  double samples = 0, loss_sum = 0, loss_count = 0;
  double data = 0, forward = 0, backward = 0, exposed = 0, comm = 0, optimizer = 0, total = 0;
  double grad_norm = 0;
  double bytes = 0, buckets = 0;  // all-reduced per rank (every rank sends the same)
  Clock::time_point begin = Clock::now();
};

}  // namespace

struct Trainer::Impl {
  Model model;
  std::shared_ptr<const Dataset> train_set, eval_set;
  TrainingArguments args;
  std::vector<std::shared_ptr<TrainerCallback>> callbacks;
  comm::Job job;  // when the Trainer joined by itself
  comm::Communicator* comm = nullptr;
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> loss_fn;

  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::unique_ptr<Reducer> reducer;
  Schedule schedule;
  TrainerState state;
  bool improved_since_save = false;
  std::optional<double> last_metric;
  std::unique_ptr<TraceWriter> trace;
  std::ofstream metrics;

  int rank() const { return comm->rank(); }
  int world() const { return comm->size(); }
  bool tty() const { return !args.disable_tqdm && ::isatty(STDERR_FILENO); }

  void say(const std::string& line) const {
    if (rank() != 0) return;
    std::fprintf(stdout, "%s\n", line.c_str());
    std::fflush(stdout);
  }

  void build_optimizer() {
    auto params = model.module->parameters();
    if (args.optim == "sgd") {
      optimizer = std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(args.learning_rate)
                                                                  .momentum(args.sgd_momentum)
                                                                  .weight_decay(args.weight_decay));
    } else {
      optimizer = std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(args.learning_rate)
                                                                    .betas({args.adam_beta1, args.adam_beta2})
                                                                    .eps(args.adam_epsilon)
                                                                    .weight_decay(args.weight_decay));
    }
  }

  void set_lr(double lr) {
    for (auto& group : optimizer->param_groups()) group.options().set_lr(lr);
  }

  void log(const nlohmann::json& entry) {
    state.log_history.push_back(entry);
    if (rank() == 0 && metrics.is_open()) {
      metrics << entry.dump() << "\n";
      metrics.flush();
    }
    for (auto& cb : callbacks) cb->on_log(state, entry);
  }

  void open_outputs() {
    std::error_code ec;
    fs::create_directories(args.output_dir, ec);
    if (ec) throw ConfigError("cannot create --output-dir " + args.output_dir + ": " + ec.message());
    if (rank() == 0) {
      metrics.open(fs::path(args.output_dir) / "metrics.jsonl", std::ios::app);
      if (!metrics) throw ConfigError("cannot write " + args.output_dir + "/metrics.jsonl");
      // A save killed midway leaves a .tmp- directory behind: nothing else refers to it.
      for (const auto& entry : fs::directory_iterator(args.output_dir, ec))
        if (entry.path().filename().string().rfind(".tmp-checkpoint-", 0) == 0)
          fs::remove_all(entry.path(), ec);
    }
    if (args.trace) {
      fs::create_directories(fs::path(args.output_dir) / "trace", ec);
      trace = std::make_unique<TraceWriter>(
          (fs::path(args.output_dir) / "trace" / ("rank_" + std::to_string(rank()) + ".json")).string(),
          rank());
    }
  }

  // ----- checkpoints --------------------------------------------------------------------------

  std::string resume_target() const {
    const std::string& r = args.resume_from_checkpoint;
    if (r == "latest" || (r.empty() && restart_count_from_env() > 0))
      return latest_checkpoint(args.output_dir);
    if (r.empty()) return "";
    if (!fs::exists(fs::path(r) / "trainer_state.json"))
      throw ConfigError("--resume-from-checkpoint " + r +
                        " is not a checkpoint directory (no trainer_state.json); pass a checkpoint-<step> "
                        "directory or 'latest'");
    return r;
  }

  void load_checkpoint(const std::string& dir, data::DistributedSampler& sampler) {
    load_module(*model.module, (fs::path(dir) / "model.pt").string());
    torch::load(*optimizer, (fs::path(dir) / "optimizer.pt").string());
    std::ifstream in(fs::path(dir) / "trainer_state.json");
    nlohmann::json s = nlohmann::json::parse(in);
    state.global_step = s.at("global_step").get<std::int64_t>();
    state.epoch = s.at("epoch").get<std::uint64_t>();
    state.steps_in_epoch = s.at("steps_in_epoch").get<std::int64_t>();
    if (s.contains("best_metric") && !s["best_metric"].is_null())
      state.best_metric = s["best_metric"].get<double>();
    state.best_checkpoint = s.value("best_checkpoint", "");
    state.log_history = s.value("log_history", nlohmann::json::array());
    int saved_world = s.at("world_size").get<int>();
    const auto& rngs = s.at("rng_states");
    if (saved_world == world()) {
      set_rng_state_hex(rngs.at(static_cast<std::size_t>(rank())).get<std::string>());
      sampler.set_epoch(state.epoch);
      sampler.load_state({state.epoch, s.at("sampler_position").get<std::size_t>()});
    } else {
      say("lockstep: warning: " + dir + " was written by " + std::to_string(saved_world) +
          " workers, this run has " + std::to_string(world()) +
          ": the data order of this epoch and the RNG streams start afresh");
      torch::manual_seed(args.seed + static_cast<std::uint64_t>(rank()));
      sampler.set_epoch(state.epoch);
      std::size_t pos = static_cast<std::size_t>(state.steps_in_epoch) * per_step();
      sampler.load_state({state.epoch, std::min(pos, sampler.num_samples())});
    }
    say("lockstep: resumed from " + dir + " at step " + std::to_string(state.global_step) + " (epoch " +
        std::to_string(state.epoch) + ", " + std::to_string(state.steps_in_epoch) + " steps into it)");
  }

  std::size_t per_step() const {
    return static_cast<std::size_t>(args.per_device_train_batch_size) *
           static_cast<std::size_t>(args.gradient_accumulation_steps);
  }

  std::string save(std::size_t sampler_position) {
    auto t0 = Clock::now();
    const std::string mine = rng_state_hex();
    std::vector<std::string> rngs = ddp_detail::allgather_strings(*comm, mine);
    const std::string name = "checkpoint-" + std::to_string(state.global_step);
    const fs::path final_dir = fs::path(args.output_dir) / name;
    if (improved_since_save) {
      state.best_checkpoint = name;
      improved_since_save = false;
    }
    std::string error;
    if (rank() == 0) {
      try {
        nlohmann::json sched = {{"type", schedule.type},
                                {"warmup_steps", schedule.warmup},
                                {"total_steps", schedule.total},
                                {"last_step", state.global_step},
                                {"base_lr", args.learning_rate},
                                {"last_lr", args.learning_rate * schedule.multiplier(state.global_step)}};
        nlohmann::json s = {
            {"global_step", state.global_step},
            {"max_steps", state.max_steps},
            {"epoch", state.epoch},
            {"steps_in_epoch", state.steps_in_epoch},
            {"fractional_epoch", state.fractional_epoch()},
            {"sampler_position", sampler_position},
            {"world_size", world()},
            {"seed", args.seed},
            {"rng_states", rngs},
            {"best_metric", state.best_metric ? nlohmann::json(*state.best_metric) : nlohmann::json()},
            {"best_checkpoint", state.best_checkpoint},
            {"log_history", state.log_history}};
        const std::int64_t step = state.global_step;
        write_checkpoint(final_dir.string(), *model.module, *optimizer, sched, args.to_json(), s, [&] {
          if (fault_requested("kill-during-save", step, 0)) std::raise(SIGKILL);
        });
        std::vector<std::string> keep = {final_dir.string()};
        if (!state.best_checkpoint.empty()) keep.push_back(state.best_checkpoint);
        rotate_checkpoints(args.output_dir, args.save_total_limit, keep);
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    // Everyone learns whether rank 0 managed (and nobody runs ahead of a checkpoint in progress).
    std::int32_t failed = error.empty() ? 0 : 1;
    comm->allreduce(&failed, 1, comm::DType::i32, comm::ReduceOp::max)->wait();
    if (failed)
      throw Error("rank 0 could not write checkpoint " + final_dir.string() +
                  (error.empty() ? "" : ": " + error));
    for (auto& cb : callbacks) cb->on_save(state, final_dir.string());
    if (trace) trace->span("checkpoint", 1, t0, Clock::now(), {{"dir", name}});
    return final_dir.string();
  }

  // ----- evaluation ---------------------------------------------------------------------------

  nlohmann::json evaluate() {
    if (!eval_set) throw ConfigError("evaluation needs an eval dataset: pass one to the Trainer");
    auto t0 = Clock::now();
    broadcast_buffers(*model.module, *comm);
    data::EvalTotals total =
        evaluate_totals(model, *eval_set, *comm,
                        {args.per_device_eval_batch_size, args.dataloader_num_workers, args.bf16}, loss_fn);
    nlohmann::json m = {{"eval_loss", total.mean_loss()},
                        {"eval_accuracy", total.accuracy()},
                        {"eval_samples", total.count},
                        {"eval_seconds", seconds_between(t0, Clock::now())}};
    if (trace) trace->span("evaluate", 1, t0, Clock::now(), m);
    return m;
  }

  // Called inside train(): records the metric, logs, runs the callbacks.
  void evaluate_during_training(TrainerControl& control) {
    nlohmann::json m = evaluate();
    m["step"] = state.global_step;
    m["epoch"] = state.fractional_epoch();
    const double value = m.at(args.metric_for_best_model).get<double>();
    last_metric = value;
    bool greater = args.best_is_greater();
    if (!state.best_metric || (greater ? value > *state.best_metric : value < *state.best_metric)) {
      state.best_metric = value;
      improved_since_save = true;
    }
    say("eval @ step " + std::to_string(state.global_step) + ": loss " +
        std::to_string(m["eval_loss"].get<double>()) + ", accuracy " +
        std::to_string(m["eval_accuracy"].get<double>()) + " (" +
        std::to_string(m["eval_samples"].get<std::int64_t>()) + " samples)");
    log(m);
    for (auto& cb : callbacks) cb->on_evaluate(state, m, control);
  }

  // ----- training -----------------------------------------------------------------------------

  void progress(const Window& w, double loss, double samples_per_s, Clock::time_point start,
                std::int64_t first_step) {
    if (rank() != 0) return;
    const double done = static_cast<double>(state.global_step - first_step);
    const double elapsed = seconds_between(start, Clock::now());
    const double eta =
        done > 0 ? elapsed / done * static_cast<double>(state.max_steps - state.global_step) : 0;
    if (tty()) {
      std::fputs(progress_bar(state.global_step, state.max_steps, elapsed, eta, samples_per_s, loss).c_str(),
                 stderr);
      if (state.global_step >= state.max_steps) std::fputs("\n", stderr);
      std::fflush(stderr);
    } else {
      say(progress_line(state.global_step, state.max_steps, state.fractional_epoch(), loss,
                        args.learning_rate * schedule.multiplier(state.global_step - 1), samples_per_s,
                        w.total > 0 ? w.exposed / w.total : 0.0, eta));
    }
  }

  TrainResult train() {
    auto start = Clock::now();
    torch::manual_seed(args.seed + static_cast<std::uint64_t>(rank()));
    data::DistributedSampler sampler(train_set->size(), rank(), world(), /*shuffle=*/true, args.seed);
    const std::size_t num_samples = sampler.num_samples();
    state.steps_per_epoch = static_cast<std::int64_t>((num_samples + per_step() - 1) / per_step());
    state.max_steps = args.max_steps > 0
                          ? args.max_steps
                          : static_cast<std::int64_t>(std::ceil(args.num_train_epochs *
                                                                static_cast<double>(state.steps_per_epoch)));
    schedule =
        Schedule{args.lr_scheduler_type,
                 warmup_steps_for(args.warmup_steps, args.warmup_ratio, state.max_steps), state.max_steps};
    build_optimizer();
    open_outputs();

    bool resumed_mid_epoch = false;
    if (std::string from = resume_target(); !from.empty()) {
      load_checkpoint(from, sampler);
      resumed_mid_epoch = true;
    } else if (!args.resume_from_checkpoint.empty() || restart_count_from_env() > 0) {
      say("lockstep: no checkpoint in " + args.output_dir + " yet: starting from step 0");
    } else if (auto old = list_checkpoints(args.output_dir); !old.empty()) {
      say("lockstep: warning: " + args.output_dir + " already holds " + std::to_string(old.size()) +
          " checkpoint(s), up to " + fs::path(old.back()).filename().string() +
          "; this run starts from step 0 and replaces them as it reaches their steps "
          "(--resume-from-checkpoint latest continues instead)");
    }

    DdpOptions ddp;
    ddp.bucket_cap_mb = args.ddp_bucket_cap_mb;
    ddp.find_unused_parameters = args.ddp_find_unused_parameters;
    ddp.comm_hook = parse_comm_hook(args.ddp_comm_hook);
    // One worker has nothing to average: no reducer, no copies into buckets.
    if (world() > 1) reducer = std::make_unique<Reducer>(model.module, *comm, ddp);
    model.module->train();

    const std::int64_t effective = static_cast<std::int64_t>(per_step()) * world();
    char head[512];
    std::snprintf(
        head, sizeof head,
        "lockstep: %d worker%s x %d per device x %d accumulation = %lld samples per step; %lld steps "
        "(%.2f epochs of %lld steps), %s, lr %g (%s), backend %s",
        world(), world() == 1 ? "" : "s", args.per_device_train_batch_size, args.gradient_accumulation_steps,
        static_cast<long long>(effective), static_cast<long long>(state.max_steps),
        static_cast<double>(state.max_steps) / static_cast<double>(state.steps_per_epoch),
        static_cast<long long>(state.steps_per_epoch), args.optim.c_str(), args.learning_rate,
        args.lr_scheduler_type.c_str(), comm->backend_name().c_str());
    say(head);
    const BlasInfo blas = blas_info();
    if (!blas.advice.empty()) say("lockstep: warning: " + blas.advice);
    std::int64_t parameter_count = 0;
    for (const auto& p : model.module->parameters()) parameter_count += p.numel();
    if (rank() == 0 && metrics.is_open()) {
      // What the numbers that follow were measured with (lockstep doctor reads it).
      nlohmann::json begin = {{"event", "train_begin"},
                              {"world_size", world()},
                              {"per_device_train_batch_size", args.per_device_train_batch_size},
                              {"gradient_accumulation_steps", args.gradient_accumulation_steps},
                              {"dataloader_num_workers", args.dataloader_num_workers},
                              {"intra_op_threads", at::get_num_threads()},
                              {"cores", static_cast<int>(std::thread::hardware_concurrency())},
                              {"backend", comm->backend_name()},
                              {"ddp_bucket_cap_mb", args.ddp_bucket_cap_mb},
                              {"ddp_comm_hook", args.ddp_comm_hook},
                              {"parameters", parameter_count},
                              {"max_steps", state.max_steps},
                              {"start_step", state.global_step}};
      begin.update(blas.to_json());
      metrics << begin.dump() << "\n";
      metrics.flush();
    }
    for (auto& cb : callbacks) cb->on_train_begin(state);

    TrainerControl control;
    Window window;
    double run_loss_sum = 0, run_loss_count = 0, run_samples = 0;
    const std::int64_t first_step = state.global_step;
    std::int64_t last_saved = -1;
    auto params = model.module->parameters();

    while (state.global_step < state.max_steps && !control.should_stop) {
      if (!resumed_mid_epoch) sampler.set_epoch(state.epoch);
      resumed_mid_epoch = false;
      auto loader = make_loader(train_set, sampler.remaining(), args.per_device_train_batch_size,
                                args.dataloader_num_workers);
      const std::size_t batch_size = static_cast<std::size_t>(args.per_device_train_batch_size);
      std::size_t position = sampler.state().position;

      while (state.global_step < state.max_steps && !control.should_stop && position < num_samples) {
        const auto step_begin = Clock::now();
        const std::size_t step_samples = std::min(per_step(), num_samples - position);
        const int micro = static_cast<int>((step_samples + batch_size - 1) / batch_size);
        double fwd = 0, bwd = 0, data_wait = 0, exposed = 0, comm_s = 0;
        for (int m = 0; m < micro; ++m) {
          auto t0 = Clock::now();
          auto batch = loader->next();
          auto t1 = Clock::now();
          if (!batch) throw Error("internal: the loader ran out before the epoch's samples did");
          const double n = static_cast<double>(batch->target.size(0));
          if (reducer) {
            reducer->set_sync(m == micro - 1);
            reducer->before_forward();
          }
          torch::Tensor loss;
          {
            CpuAutocast autocast(args.bf16);
            torch::Tensor out = model.forward(batch->input);
            if (reducer) reducer->after_forward(&out);
            loss = loss_fn(out.to(torch::kFloat), batch->target);
          }
          window.loss_sum += loss.item<double>() * n;
          window.loss_count += n;
          // The mean over this micro-batch, weighted to make the mean over the whole step.
          auto scaled = loss * (n / static_cast<double>(step_samples));
          auto t2 = Clock::now();
          scaled.backward();
          auto t3 = Clock::now();
          data_wait += seconds_between(t0, t1);
          fwd += seconds_between(t1, t2);
          bwd += seconds_between(t2, t3);
          if (trace) {
            trace->span("data wait", 1, t0, t1);
            trace->span("forward", 1, t1, t2, {{"micro_batch", m}});
            trace->span(m == micro - 1 ? "backward + all-reduce" : "backward (no_sync)", 1, t2, t3);
          }
        }
        if (reducer) {
          const DdpStats& st = reducer->stats();
          exposed = st.exposed_comm_seconds;
          comm_s = st.comm_seconds;
          window.bytes += static_cast<double>(st.bytes_allreduced);
          window.buckets += st.bucket_count;
          if (trace)
            for (const auto& b : st.buckets)
              trace->span("all-reduce", 2, b.started, b.finished,
                          {{"bucket", b.index}, {"parameters", b.parameters}, {"bytes", b.bytes}});
        }

        auto o0 = Clock::now();
        if (args.max_grad_norm > 0) {
          window.grad_norm = torch::nn::utils::clip_grad_norm_(params, args.max_grad_norm);
        }
        set_lr(args.learning_rate * schedule.multiplier(state.global_step));
        optimizer->step();
        optimizer->zero_grad();
        auto o1 = Clock::now();
        if (trace) trace->span("optimizer", 1, o0, o1);

        position += step_samples;
        ++state.global_step;
        ++state.steps_in_epoch;
        window.steps += 1;
        window.samples += static_cast<double>(step_samples) * world();
        window.data += data_wait;
        window.forward += fwd;
        window.backward += bwd - exposed;
        window.exposed += exposed;
        window.comm += comm_s;
        window.optimizer += seconds_between(o0, o1);
        window.total += seconds_between(step_begin, o1);

        const bool epoch_done = position >= num_samples;
        const bool last = state.global_step >= state.max_steps;
        if (state.global_step % args.logging_steps == 0 || last) {
          // Every rank's numbers, averaged: one small allreduce per logging step.
          double v[9] = {window.loss_sum, window.loss_count, window.data,
                         window.forward,  window.backward,   window.exposed,
                         window.comm,     window.optimizer,  window.total};
          comm->allreduce(v, 9, comm::DType::f64, comm::ReduceOp::sum)->wait();
          const double w = static_cast<double>(world()), steps = static_cast<double>(window.steps);
          const double loss = v[1] > 0 ? v[0] / v[1] : 0;
          const double wall = seconds_between(window.begin, Clock::now());
          const double sps = wall > 0 ? window.samples / wall : 0;
          run_loss_sum += v[0];
          run_loss_count += v[1];
          nlohmann::json entry = {
              {"step", state.global_step},
              {"epoch", state.fractional_epoch()},
              {"loss", loss},
              {"learning_rate", args.learning_rate * schedule.multiplier(state.global_step - 1)},
              {"samples_per_second", sps},
              {"world_size", world()},
              {"step_seconds", v[8] / w / steps},
              {"data_seconds", v[2] / w / steps},
              {"forward_seconds", v[3] / w / steps},
              {"backward_seconds", v[4] / w / steps},
              {"exposed_comm_seconds", v[5] / w / steps},
              {"comm_seconds", v[6] / w / steps},
              {"optimizer_seconds", v[7] / w / steps},
              {"exposed_comm_fraction", v[8] > 0 ? v[5] / v[8] : 0.0},
              {"allreduce_bytes_per_step", window.bytes / steps},
              {"buckets_per_step", window.buckets / steps}};
          if (args.max_grad_norm > 0) entry["grad_norm"] = window.grad_norm;
          log(entry);
          progress(window, loss, sps, start, first_step);
          window = Window{};
        } else if (tty()) {
          progress(window, window.loss_count > 0 ? window.loss_sum / window.loss_count : 0,
                   window.samples / std::max(1e-9, seconds_between(window.begin, Clock::now())), start,
                   first_step);
        }
        run_samples += static_cast<double>(step_samples) * world();

        const auto pause_begin = Clock::now();  // evaluation and saving do not count as training time
        if ((args.eval_strategy == "steps" && state.global_step % args.eval_every() == 0) ||
            (args.eval_strategy == "epoch" && epoch_done)) {
          evaluate_during_training(control);
        }
        if (epoch_done) {
          ++state.epoch;
          state.steps_in_epoch = 0;
        }
        const std::size_t saved_position = epoch_done ? 0 : position;
        if ((args.save_strategy == "steps" && state.global_step % args.save_steps == 0) ||
            (args.save_strategy == "epoch" && epoch_done)) {
          save(saved_position);
          last_saved = state.global_step;
        }
        window.begin += Clock::now() - pause_begin;
        for (auto& cb : callbacks) cb->on_step_end(state, control);
        if (fault_requested("kill-after-step", state.global_step, rank())) std::raise(SIGKILL);
        if (trace) trace->flush();
        if ((last || control.should_stop) && args.save_strategy != "no" && last_saved != state.global_step) {
          save(saved_position);
          last_saved = state.global_step;
        }
      }
    }
    if (args.load_best_model_at_end && !state.best_checkpoint.empty()) {
      const std::string best = (fs::path(args.output_dir) / state.best_checkpoint).string();
      load_module(*model.module, (fs::path(best) / "model.pt").string());
      say("lockstep: loaded the best model, " + state.best_checkpoint + " (" + args.metric_for_best_model +
          " " + std::to_string(state.best_metric.value_or(0)) + ")");
    }
    for (auto& cb : callbacks) cb->on_train_end(state);
    TrainResult r;
    r.global_step = state.global_step;
    r.train_loss = run_loss_count > 0 ? run_loss_sum / run_loss_count : 0;
    r.seconds = seconds_between(start, Clock::now());
    r.samples_per_second = r.seconds > 0 ? run_samples / r.seconds : 0;
    r.stopped_early = control.should_stop;
    for (auto it = state.log_history.rbegin(); it != state.log_history.rend(); ++it)
      if (it->contains("eval_loss")) {
        r.last_eval = *it;
        break;
      }
    return r;
  }
};

Trainer::Trainer(Model model, std::shared_ptr<const Dataset> train_dataset,
                 std::shared_ptr<const Dataset> eval_dataset, TrainingArguments args,
                 std::vector<std::shared_ptr<TrainerCallback>> callbacks, comm::Communicator* comm)
    : impl_(std::make_unique<Impl>()) {
  args.validate();
  if (!model.module || !model.forward)
    throw ConfigError("the Trainer needs a model: use Model::of(your_module)");
  if (!train_dataset || train_dataset->size() == 0)
    throw ConfigError("the Trainer needs a non-empty training dataset");
  impl_->model = std::move(model);
  impl_->train_set = std::move(train_dataset);
  impl_->eval_set = std::move(eval_dataset);
  impl_->args = std::move(args);
  impl_->callbacks = std::move(callbacks);
  if (impl_->args.early_stopping_patience > 0)
    impl_->callbacks.push_back(std::make_shared<EarlyStoppingCallback>(
        impl_->args.metric_for_best_model, impl_->args.best_is_greater(), impl_->args.early_stopping_patience,
        impl_->args.early_stopping_threshold));
  if (comm) {
    impl_->comm = comm;
  } else {
    comm::CommOptions options;
    options.backend = impl_->args.backend;
    impl_->job = comm::join_from_env(options);
    impl_->comm = impl_->job.comm.get();
  }
  if (impl_->args.eval_strategy != "no" && !impl_->eval_set)
    throw ConfigError("--eval-strategy " + impl_->args.eval_strategy + " needs an eval dataset");
  impl_->loss_fn = [](const torch::Tensor& out, const torch::Tensor& target) {
    return torch::nn::functional::cross_entropy(out, target);
  };
}

Trainer::~Trainer() = default;
TrainResult Trainer::train() {
  return impl_->train();
}
nlohmann::json Trainer::evaluate() {
  return impl_->evaluate();
}
std::string Trainer::save_checkpoint() {
  if (!impl_->optimizer)
    throw ConfigError("save_checkpoint() needs train() to have set up the optimiser first");
  return impl_->save(0);
}
const TrainerState& Trainer::state() const {
  return impl_->state;
}
const TrainingArguments& Trainer::args() const {
  return impl_->args;
}
comm::Communicator& Trainer::communicator() {
  return *impl_->comm;
}
void Trainer::set_loss(std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> loss) {
  impl_->loss_fn = std::move(loss);
}

}  // namespace lockstep::train
