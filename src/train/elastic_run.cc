// The Trainer in an elastic job (lockstep run --nnodes MIN:MAX): it trains through members that
// fail or join, in the same processes, without reading a checkpoint.
//
// The global batch is fixed when the job starts (per-device batch x accumulation x the first
// membership's workers); the ElasticSampler deals each step's samples over the membership of the
// moment, so fewer workers take more micro-batches each and the step's mean is over the same
// samples (each sample's loss weighs W / step_samples before DDP averages over the W ranks).
//
// A step counts once its optimiser update ran, after the all-reduce of its gradients, and every
// rank applies the same update. When a collective fails, a rank catches the error where it was
// (a step's all-reduce, a log's, an evaluation's), releases what used the old communicator (the
// reducer and its buckets), and calls ElasticGroup::recover. In the new membership every member
// says which step it completed; the lowest-ranked member with the newest one broadcasts the
// model, the optimizer state, the step counters and the sampler's position (a joiner, and a member
// that missed the last update, take them), then the reducer is rebuilt. The step that was in
// progress is taken again; no completed step is lost. Admitting joiners works the same way, at
// a step boundary chosen every ~1 s of steps (joiners_waiting: one integer all-reduce).
//
// Under ZeRO (--zero-stage 1 or 2) no member holds the whole optimizer state: each rank's slices
// are mirrored by a rank of the next machine (ZeroOptions::mirror_of), and a change puts the whole
// state back together on every member of the new membership (ddp/zero_elastic.h) before the
// counters are brought up to date and the state is cut again over the new ranks. When the step in
// flight had been applied by some member, every member completes it: the change goes on after it.
//
// What follows a step (its log, evaluation, checkpoint, callbacks: the StepEpilogue) belongs to the
// step: members count the parts of it they finished as progress, so the member furthest along
// brings the others up to date, and after the change every member resumes the epilogue at the same
// part. A checkpoint whose writer died is written by the new rank 0; one that some member saw
// committed is not written again. A member lost during a change (the state's transfer, say) makes
// it start over. evaluate() and save_metrics() after training recover the same way.
#include "elastic_run.h"

#include <algorithm>
#include <cmath>
#include <csignal>
#include <sstream>
#include <thread>

#include "dataset_loader.h"
#include "lockstep/base/clock.h"
#include "lockstep/base/knobs.h"
#include "lockstep/base/log.h"
#include "lockstep/base/main.h"
#include "lockstep/base/run_env.h"
#include "lockstep/error.h"
#include "lockstep/ddp/zero_elastic.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train_core/metrics.h"
#include "trainer_impl.h"

namespace lockstep::train {

// The loop's state, kept beyond train() so that evaluate() and save_metrics() recover too.
struct ElasticProgress {
  explicit ElasticProgress(data::ElasticSampler s) : sampler(std::move(s)) {}
  data::ElasticSampler sampler;
  RunProgress run;
};

ElasticRun::ElasticRun(Trainer::Impl& trainer, std::unique_ptr<comm::ElasticGroup> group)
    : t_(trainer), group_(std::move(group)) {}

ElasticRun::~ElasticRun() = default;

namespace {

// The state a member brings the others up to date with, as bytes (CBOR): the model, the optimizer
// state (under ZeRO it moved already, see recover_sharded_state), the trainer's counters and how
// far the step's epilogue got.
std::string pack_state(Trainer::Impl& t, const data::ElasticSampler& sampler, const RunProgress& run,
                       std::size_t global_batch) {
  std::ostringstream model_bytes, optimizer_bytes;
  torch::serialize::OutputArchive model_archive, optimizer_archive;
  t.model.module->save(model_archive);
  model_archive.save_to(model_bytes);
  if (t.step.optimizer() && !t.zero_plan.sharded()) {
    t.step.optimizer()->save(optimizer_archive);
    optimizer_archive.save_to(optimizer_bytes);
  }
  nlohmann::json counters = t.state.position_json();
  counters.update({{"epilogue", {t.epilogue.step, t.epilogue.next, t.epilogue.saved}},
                   {"should_stop", run.control.should_stop},
                   {"improved_since_save", t.checkpoints.improved_since_save()},
                   {"sampler_epoch", sampler.state().epoch},
                   {"sampler_position", sampler.state().position},
                   {"global_batch", global_batch},
                   {"rng", rng_state_hex()},
                   {"loss_scale", t.step.loss_scale().to_json()}});
  auto binary = [](const std::ostringstream& out) {
    const std::string bytes = out.str();
    return nlohmann::json::binary_t(std::vector<std::uint8_t>(bytes.begin(), bytes.end()));
  };
  const auto cbor = nlohmann::json::to_cbor(
      nlohmann::json{{"model", binary(model_bytes)}, {"optimizer", binary(optimizer_bytes)}, {"counters", counters}});
  return std::string(cbor.begin(), cbor.end());
}

void unpack_state(Trainer::Impl& t, data::ElasticSampler& sampler, RunProgress& run, const std::string& bytes,
                  bool take_rng, std::size_t& global_batch) {
  const nlohmann::json j = nlohmann::json::from_cbor(bytes);
  auto archive_of = [&](const char* key, torch::serialize::InputArchive& archive) {
    const auto& b = j.at(key).get_binary();
    std::istringstream in(std::string(b.begin(), b.end()));
    archive.load_from(in);
  };
  torch::serialize::InputArchive model_archive, optimizer_archive;
  archive_of("model", model_archive);
  t.model.module->load(model_archive);
  if (t.step.optimizer() && !t.zero_plan.sharded()) {
    archive_of("optimizer", optimizer_archive);
    t.step.optimizer()->load(optimizer_archive);
  }
  const nlohmann::json& c = j.at("counters");
  t.state.load_position(c);
  const nlohmann::json& epilogue = c.at("epilogue");
  t.epilogue = StepEpilogue{epilogue.at(0).get<std::int64_t>(), epilogue.at(1).get<int>(), epilogue.at(2).get<bool>()};
  run.control.should_stop = c.at("should_stop").get<bool>();
  t.checkpoints.set_improved_since_save(c.at("improved_since_save").get<bool>());
  global_batch = c.at("global_batch").get<std::size_t>();
  if (take_rng) set_rng_state_hex(c.at("rng").get<std::string>());
  t.step.loss_scale().load_json(c.at("loss_scale"));
  if (global_batch != sampler.global_batch())  // a joiner learns the job's batch only now
    sampler = data::ElasticSampler(t.train_set->size(), global_batch, /*shuffle=*/true, t.args.seed);
  sampler.load_state({c.at("sampler_epoch").get<std::uint64_t>(), c.at("sampler_position").get<std::size_t>()});
}


// A change the members cannot agree on (no membership published in time) ends this worker: it is
// not retried as a lost member would be.
comm::MembershipChange agree_on_membership(comm::ElasticGroup& group, const std::string& failure) {
  try {
    return failure.empty() ? group.grow() : group.recover(failure);
  } catch (const TimeoutError& e) {
    throw Error(first_line(e.what()));
  }
}

}  // namespace

namespace {

// The Trainer's state as the elastic group moves it (comm::bring_up_to_date): a joiner also takes
// the source's RNG state, a member that missed the last update keeps its own.
class MovedState : public comm::ElasticState {
 public:
  MovedState(Trainer::Impl& t, comm::ElasticGroup& group, data::ElasticSampler& sampler, RunProgress& run,
             std::size_t& global_batch)
      : t_(t), group_(group), sampler_(sampler), run_(run), global_batch_(global_batch) {}
  // The steps, and of the newest one's epilogue the parts done: the member furthest along leads.
  std::int64_t completed_steps() const override {
    const int parts = t_.epilogue.step == t_.state.global_step ? t_.epilogue.next : 0;
    return t_.state.global_step * (StepEpilogue::done + 1) + parts;
  }
  std::string save() const override {
    if (t_.fault("kill-in-state-transfer", static_cast<std::int64_t>(group_.epoch()))) std::raise(SIGKILL);
    return pack_state(t_, sampler_, run_, global_batch_);
  }
  void load(const std::string& bytes) override {
    unpack_state(t_, sampler_, run_, bytes, /*take_rng=*/group_.joined_in_current_epoch(), global_batch_);
  }

 private:
  Trainer::Impl& t_;
  comm::ElasticGroup& group_;
  data::ElasticSampler& sampler_;
  RunProgress& run_;
  std::size_t& global_batch_;
};

}  // namespace

// Collective on the current membership: every member reaches the newest completed step.
double ElasticRun::sync_state(data::ElasticSampler& sampler, RunProgress& run) {
  MovedState moved(t_, *group_, sampler, run, global_batch_);
  return comm::bring_up_to_date(*group_, moved);
}

// The run's length and schedule, from the global batch.
void ElasticRun::plan(const data::ElasticSampler& sampler) {
  const auto per_epoch = static_cast<std::int64_t>(sampler.steps_per_epoch());
  t_.state.set_length(per_epoch, t_.args.max_steps > 0 ? t_.args.max_steps
                                                       : static_cast<std::int64_t>(std::ceil(
                                                             t_.args.num_train_epochs * static_cast<double>(per_epoch))));
  t_.schedule = Schedule{t_.args.lr_scheduler_type,
                      warmup_steps_for(t_.args.warmup_steps, t_.args.warmup_ratio, t_.state.max_steps), t_.state.max_steps};
}

void ElasticRun::prepare(data::ElasticSampler& sampler) {
  plan(sampler);
  if (t_.zero_plan.shards_parameters())
    throw ConfigError("--zero-stage 3 in an elastic job: its parameter slices have no mirrors yet; use --zero-stage 1 "
                      "or 2 (each shard is mirrored on another machine)");
  if (t_.zero_plan.sharded() && t_.zero_plan.shared_parameters)
    throw ConfigError("--zero-shared-parameters in an elastic job: the one copy per machine would be lost with the "
                      "machine; use --zero-stage 1 or 2 without it (each shard is mirrored on another machine)");
  if (t_.args.save_format == "sharded" && t_.rank() == 0)
    LOCKSTEP_LOG(warn, train) << "--save-format sharded in an elastic job: each checkpoint is written consolidated, "
                                 "within its step (a sharded save's parts need one membership from start to end)";
  if (t_.args.gradient_checkpointing && t_.model.set_gradient_checkpointing) t_.model.set_gradient_checkpointing(true);
  t_.step.hold_whole_state(t_.step.make_optimizer(t_.model.module->parameters()));
  t_.reports.open();
  t_.model.module->train();
}

// One step: this rank's share of the step's samples, in micro-batches; a rank without a sample
// this step runs a stand-in batch whose loss weighs nothing, so that its all-reduce still happens.
void ElasticRun::step(data::ElasticSampler& sampler, RunProgress& run) {
  data::StepShare share = sampler.share(t_.rank(), t_.world());
  const bool placeholder = share.indices.empty();
  if (placeholder) share.indices.push_back(sampler.share(0, t_.world()).indices.front());
  auto loader = make_loader(t_.train_set, share.indices, t_.args.per_device_train_batch_size, t_.args.dataloader_num_workers);
  t_.step.run(*loader, StepPlan{share.indices.size(), static_cast<double>(share.step_samples), placeholder},
              run.window);
  sampler.advance();
  t_.state.finish_step();
  run.samples += static_cast<double>(share.step_samples);
  t_.after_step(sampler.state().position, sampler.dataset_size(), run);
}

// Steps until the end, admitting joiners every LOCKSTEP_ELASTIC_CHECK seconds of steps (a count
// every member derives from the same all-reduced step time, so all check at the same step).
void ElasticRun::run_steps(data::ElasticSampler& sampler, RunProgress& run) {
  std::int64_t& next_check = next_membership_check_;
  const double check_seconds = std::stod(knobs::get(knobs::kElasticCheck).value_or("1"));
  while (t_.state.global_step < t_.state.max_steps && !run.control.should_stop) {
    if (sampler.epoch_done()) {
      sampler.set_epoch(t_.state.epoch);
      t_.state.begin_epoch();
    }
    const auto begin = Clock::now();
    step(sampler, run);
    if (t_.state.global_step >= next_check) {
      double step_seconds = seconds_since(begin);
      t_.comm->allreduce(&step_seconds, 1, comm::DType::f64, comm::ReduceOp::max)->wait();
      group_->set_step_seconds(step_seconds);
      next_check = t_.state.global_step + std::clamp<std::int64_t>(
                                            static_cast<std::int64_t>(check_seconds / std::max(step_seconds, 1e-6)), 1,
                                            100000);
      if (group_->joiners_waiting() || await_joiner_for_tests()) change_membership(sampler, run, "");
    }
  }
}

bool ElasticRun::await_joiner_for_tests() {
  if (!knobs::get(knobs::kFaultInject)) return false;  // the same in every member's environment
  double asked = t_.rank() == 0 && t_.fault("await-joiner", static_cast<std::int64_t>(group_->epoch())) ? 1 : 0;
  t_.comm->allreduce(&asked, 1, comm::DType::f64, comm::ReduceOp::max)->wait();  // rank 0's view, for all
  if (asked == 0) return false;
  if (t_.rank() == 0)
    LOCKSTEP_LOG(info, train) << "holding membership " << group_->epoch() << " for a joiner (LOCKSTEP_FAULT_INJECT)";
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // a poll interval: each call is collective
    if (group_->joiners_waiting()) return true;
  }
  return false;
}

// Under ZeRO: the slices mirrored on another machine (zero_elastic.h), and the tests' kill points
// in the update.
ZeroOptions ElasticRun::zero_options() {
  std::vector<int> node_of_rank;
  for (const auto& m : group_->members()) node_of_rank.push_back(m.node);
  ZeroOptions o = mirrored_options(t_.zero_plan, t_.rank(), node_of_rank);
  o.on_phase = [this](UpdatePhase phase) {
    const char* fault = phase == UpdatePhase::ready ? "kill-before-update" : "kill-in-update";
    if (t_.fault(fault, t_.state.global_step + 1)) std::raise(SIGKILL);
  };
  return o;
}

// Collective: the sharded state on the new membership (a joiner holds nothing yet). When the step in
// flight was applied somewhere, this member completes its bookkeeping too (it trained on its share).
std::unique_ptr<torch::optim::Optimizer> ElasticRun::recover_sharded(data::ElasticSampler& sampler, RunProgress& run) {
  RecoveredState recovered =
      recover_sharded_state(*t_.comm, *t_.model.module, t_.step.held_state(t_.state.global_step),
                            [this](std::vector<torch::Tensor> p) { return t_.step.make_optimizer(p); });
  t_.step.hold_whole_state(nullptr);
  if (t_.state.global_step + 1 == recovered.steps) {
    run.samples += static_cast<double>(sampler.share(0, t_.world()).step_samples);
    sampler.advance();
    t_.state.finish_step();
    t_.epilogue = StepEpilogue{t_.state.global_step, StepEpilogue::log, false};  // none of it ran here
  }
  return std::move(recovered.optimizer);
}

void ElasticRun::change_membership(data::ElasticSampler& sampler, RunProgress& run, const std::string& failure) {
  const auto begin = Clock::now();
  const int before = t_.world();
  const std::int64_t completed = t_.state.global_step;
  t_.step.leave_communicator();
  const comm::MembershipChange change = agree_on_membership(*group_, failure);
  t_.comm = &group_->comm();
  t_.state.set_membership(static_cast<std::int64_t>(change.epoch));
  const auto state_begin = Clock::now();
  // Under ZeRO the whole state waits in the step until it is cut again: a member lost before
  // then leaves it where the next try of the change finds it (a member that holds it all).
  if (t_.zero_plan.sharded()) t_.step.hold_whole_state(recover_sharded(sampler, run));
  sync_state(sampler, run);
  t_.step.build_reducer();
  if (t_.zero_plan.sharded()) t_.step.build_optimizer(zero_options(), /*from_held=*/true);
  const double state_seconds = seconds_since(state_begin);
  t_.reports.set_rank(t_.rank());
  next_membership_check_ = t_.state.global_step + 1;  // every member, joiners too, looks at the same step
  log_change(change, before, std::max<std::int64_t>(0, completed - t_.state.global_step), state_seconds, begin);
  run.window = LogWindow{};
  run.at_window_start = t_.window_counters();
}

void ElasticRun::log_change(const comm::MembershipChange& change, int world_before, std::int64_t steps_lost,
                            double state_seconds, Clock::time_point begin) {
  metrics::MembershipChangeLog record;
  record.step = t_.state.global_step;
  record.membership = static_cast<std::int64_t>(change.epoch);
  record.reason = change.reason;
  record.world_size_before = world_before;
  record.world_size = t_.world();
  record.machines = group_->nodes();
  record.left = comm::describe_members(change.left);
  record.joined = comm::describe_members(change.joined);
  record.agree_seconds = change.agree_seconds;
  record.rebuild_seconds = change.rebuild_seconds;
  record.state_seconds = state_seconds;
  record.recovery_seconds = seconds_since(begin);
  record.steps_lost = steps_lost;
  t_.log(record.to_json());
  if (t_.rank() == 0)
    LOCKSTEP_LOG(info, train) << "membership " << change.epoch << ": " << world_before << " -> " << t_.world()
                              << " workers (" << change.reason << "; left: " << record.left
                              << "; joined: " << record.joined << "), training again at step " << t_.state.global_step
                              << " after " << record.recovery_seconds << " s (agree " << change.agree_seconds
                              << ", rebuild " << change.rebuild_seconds << ", state " << state_seconds << ")";
}

void ElasticRun::run_recovering(const std::function<void()>& work) {
  if (!progress_) return work();
  std::string failure;  // the error that ended the last membership, until a new one is in place
  for (;;) {
    try {
      if (!failure.empty()) change_membership(progress_->sampler, progress_->run, failure);
      failure.clear();
      return work();
    } catch (const comm::ElasticError&) {
      throw;
    } catch (const StoreReplacedError&) {
      throw;
    } catch (const PeerError& e) {
      failure = first_line(e.what());
    } catch (const TimeoutError& e) {
      failure = first_line(e.what());
    }
  }
}

void ElasticRun::complete_epilogue(data::ElasticSampler& sampler, RunProgress& run) {
  if (t_.epilogue.step != t_.state.global_step || t_.epilogue.next == StepEpilogue::done) return;
  if (t_.rank() == 0)
    LOCKSTEP_LOG(info, train) << "completing what follows step " << t_.state.global_step << " on the new membership"
                              << (t_.epilogue.next <= StepEpilogue::save && t_.save_due(sampler.epoch_done())
                                      ? " (its checkpoint among it)"
                                      : "");
  t_.run_epilogue(sampler.state().position, sampler.dataset_size(), run);
}

TrainResult ElasticRun::train() {
  torch::manual_seed(t_.args.seed + static_cast<std::uint64_t>(t_.rank()));
  // The first membership's: a run whose first membership lost a member before training keeps it.
  global_batch_ = t_.samples_per_step() * static_cast<std::size_t>(group_->first_membership_size());
  progress_ = std::make_unique<ElasticProgress>(
      data::ElasticSampler(t_.train_set->size(), global_batch_, /*shuffle=*/true, t_.args.seed));
  data::ElasticSampler& sampler = progress_->sampler;
  RunProgress& run = progress_->run;
  prepare(sampler);
  t_.state.set_membership(static_cast<std::int64_t>(group_->epoch()));
  // Starting in a later membership, this worker meets members that run a change's collectives:
  // those of a running job admitting it, or others whose first membership lost a member before
  // its communicator was up.
  const bool meets_a_change = group_->epoch() > 0;
  const std::int64_t membership_at_start = t_.state.membership;
  run_recovering([&] {
    if (t_.state.membership != membership_at_start) return;  // a change brought this worker up to date
    if (meets_a_change) {  // the same collectives as the members' change_membership
      if (t_.zero_plan.sharded()) t_.step.hold_whole_state(recover_sharded(sampler, run));
      sync_state(sampler, run);
    }
    t_.step.build_reducer();
    if (t_.zero_plan.sharded()) t_.step.build_optimizer(zero_options(), /*from_held=*/meets_a_change);
  });
  plan(sampler);  // a joiner learnt the job's global batch
  next_membership_check_ = t_.state.global_step + 1;
  t_.reports.announce();
  if (const auto& lost = group_->start_change()) {  // the membership it was admitted into never trained
    const auto took = std::chrono::duration<double>(lost->agree_seconds + lost->rebuild_seconds);
    log_change(*lost, group_->first_membership_size(), 0, 0,
               Clock::now() - std::chrono::duration_cast<Clock::duration>(took));
  }
  for (auto& cb : t_.callbacks) cb->on_train_begin(t_.state);
  run.first_step = t_.state.global_step;
  run.at_window_start = t_.window_counters();
  run_recovering([&] {
    complete_epilogue(sampler, run);
    run_steps(sampler, run);
    t_.check_replicas();
  });
  t_.load_best_model();
  if (t_.rank() == 0) group_->finish();  // a worker still waiting to join has nothing left to do
  for (auto& cb : t_.callbacks) cb->on_train_end(t_.state);
  return t_.result(run);
}

}  // namespace lockstep::train
