// The Trainer's run in an elastic job (lockstep run --nnodes MIN:MAX): it trains through members
// that fail or join, in the same processes, without reading a checkpoint (elastic_run.cc says
// how). It owns the elastic group and what only an elastic run needs: the job's fixed global batch,
// the step at which the members next look for joiners, and the loop's progress, kept beyond
// train() so that evaluate() and save_metrics() recover from a lost member too. It trains through
// the Trainer it belongs to (the step, its epilogue, the reducer and optimizers it rebuilds).
//
// Threading: the training thread only; every call is collective over the current membership.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "lockstep/base/clock.h"
#include "lockstep/comm/elastic.h"
#include "lockstep/data/elastic_sampler.h"
#include "lockstep/ddp/zero.h"
#include "lockstep/train/trainer.h"

namespace lockstep::train {

struct RunProgress;
struct ElasticProgress;

class ElasticRun {
 public:
  ElasticRun(Trainer::Impl& trainer, std::unique_ptr<comm::ElasticGroup> group);
  ~ElasticRun();
  ElasticRun(const ElasticRun&) = delete;
  ElasticRun& operator=(const ElasticRun&) = delete;

  // The current membership's communicator (a new one after each change).
  comm::Communicator& comm() { return group_->comm(); }
  std::uint64_t membership() const { return group_->epoch(); }
  // Samples per step: the first membership's, whatever the membership of the moment.
  std::size_t global_batch() const { return global_batch_; }
  TrainResult train();
  // Runs `work` (collective). When a member is lost in it, the survivors change membership and run
  // it again, until it completes; before train() began, it runs once.
  void run_recovering(const std::function<void()>& work);

 private:
  void prepare(data::ElasticSampler& sampler);
  void plan(const data::ElasticSampler& sampler);
  void run_steps(data::ElasticSampler& sampler, RunProgress& run);
  void step(data::ElasticSampler& sampler, RunProgress& run);
  // Whether a joiner waits, after holding for one (at most 60 s) where the tests ask it of this
  // membership (await-joiner), so that their join comes however slowly the joiner starts.
  bool await_joiner_for_tests();
  // After a change: the parts of the newest step's epilogue that no member finished.
  void complete_epilogue(data::ElasticSampler& sampler, RunProgress& run);
  // After a failure (`failure` is its error) or to admit joiners (empty): the new membership, the
  // state brought to the newest step, the reducer rebuilt, a membership_change record.
  void change_membership(data::ElasticSampler& sampler, RunProgress& run, const std::string& failure);
  void log_change(const comm::MembershipChange& change, int world_before, std::int64_t steps_lost,
                  double state_seconds, Clock::time_point begin);
  double sync_state(data::ElasticSampler& sampler, RunProgress& run);  // returns its seconds
  // Under ZeRO (elastic_run.cc says how the sharded state moves).
  ZeroOptions zero_options();
  std::unique_ptr<torch::optim::Optimizer> recover_sharded(data::ElasticSampler& sampler, RunProgress& run);

  Trainer::Impl& t_;
  std::unique_ptr<comm::ElasticGroup> group_;
  std::size_t global_batch_ = 0;            // samples per step over all ranks: fixed when the job started
  std::int64_t next_membership_check_ = 1;  // the step after which the members look for joiners
  std::unique_ptr<ElasticProgress> progress_;
};

}  // namespace lockstep::train
