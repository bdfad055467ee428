// The Trainer's step: building its parts, rebuilding them after an elastic membership change,
// and what the checkpoints take of them (training_step.h).
#include <torch/torch.h>
#include <malloc.h>

#include "cuda_graph_step.h"
#include "lockstep/base/log.h"
#include "lockstep/ddp/sync_batchnorm.h"
#include "lockstep/error.h"
#include "lockstep/train/foreach_adamw.h"
#include "trainer_impl.h"

namespace lockstep::train {

TrainingStep::TrainingStep(Trainer::Impl& run) : run_(run) {}

TrainingStep::~TrainingStep() = default;

bool TrainingStep::stage3() const { return zero_ && run_.zero_plan.shards_parameters(); }

std::unique_ptr<torch::optim::Optimizer> TrainingStep::make_optimizer(std::vector<torch::Tensor> params) const {
  const TrainingArguments& args = run_.args;
  if (args.optim == "sgd")
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(args.learning_rate)
                                                           .momentum(args.sgd_momentum)
                                                           .weight_decay(args.weight_decay));
  const auto options = torch::optim::AdamWOptions(args.learning_rate)
                           .betas({args.adam_beta1, args.adam_beta2})
                           .eps(args.adam_epsilon)
                           .weight_decay(args.weight_decay);
  if (args.optim == "adamw_torch") return std::make_unique<torch::optim::AdamW>(params, options);
  if (args.optim == "adamw_torch_fused") {
    if (!FusedAdamW::available())
      throw ConfigError("--optim adamw_torch_fused: this build's libtorch has no fused AdamW kernel (libtorch 2.4 "
                        "and later have it): use --optim adamw or adamw_torch");
    return std::make_unique<FusedAdamW>(params, options);
  }
  // adamw: on a GPU the foreach update saves launches. On the CPU the fused kernel, where
  // libtorch has it, is 4-6x faster than the loop; foreach would only hold a temporary the size
  // of all parameters at once, for bitwise the loop's result.
  if (!params.empty() && params.front().is_cuda()) return std::make_unique<ForeachAdamW>(params, options);
  if (FusedAdamW::available()) return std::make_unique<FusedAdamW>(params, options);
  return std::make_unique<torch::optim::AdamW>(params, options);
}

void TrainingStep::build() {
  if (run_.pipelined()) return build_pipeline();
  build_reducer();  // before the optimizer: ZeRO shards the reducer's buckets
  const ZeroOptions& zero = run_.zero_plan;
  if (zero.sharded() && !reducer_ && run_.rank() == 0)
    LOCKSTEP_LOG(info, train) << "--zero-stage " << zero.stage << " with one worker: nothing to shard";
  build_optimizer(zero, /*from_held=*/false);
  if (stage3()) {
    run_.model.set_unit_runner(zero_->unit_runner());
    // Stage 3 is for models that barely fit: freed memory goes back to the system (the
    // launcher's default malloc tunables keep up to 1 GB of it for reuse, which speeds up
    // small models and would cost a large one a third of its machine here).
    ::mallopt(M_MMAP_THRESHOLD, 16 << 20);
    ::mallopt(M_TRIM_THRESHOLD, 32 << 20);
    ::malloc_trim(0);
  }
  build_outer();  // before a resume, which restarts it from the loaded parameters
}

// One worker has nothing to average: no reducer, no copies into buckets. (SyncBatchNorm layers
// follow the communicator in any case: an elastic job builds a new one at each change.)
// Local SGD (--sync-every): gradients and batch statistics stay inside each machine, which
// train apart between the meetings.
void TrainingStep::build_reducer() {
  const TrainingArguments& args = run_.args;
  Model& model = run_.model;
  if (args.sync_every > 1 && run_.world() > 1) machine_comm_ = run_.comm->machine_communicator();
  comm::Communicator* over = machine_comm_ ? machine_comm_.get() : &run_.data_communicator();
  if (args.sync_batchnorm && lockstep::sync_batchnorm(*model.module, *over) == 0)
    throw ConfigError("--sync-batchnorm: the model has no lockstep::SyncBatchNorm layer (declare the layers "
                      "whose statistics should span the ranks as lockstep::SyncBatchNorm, ddp/sync_batchnorm.h)");
  if (over->size() == 1) return;
  DdpOptions ddp;
  ddp.bucket_cap_mb = args.ddp_bucket_cap_mb;
  ddp.find_unused_parameters = args.ddp_find_unused_parameters;
  ddp.comm_hook = parse_comm_hook(args.ddp_comm_hook);
  ddp.compression.powersgd_rank = args.powersgd_rank;
  ddp.compression.powersgd_rounds = args.powersgd_rounds;
  ddp.compression.start_step = args.comm_hook_start_step;
  // A compressed all-reduce costs its exchanges between machines more than its bytes: no small
  // first bucket, so each step pays for as few exchanges as the bucket cap allows.
  const auto hook = ddp.comm_hook;
  if (hook == CommHook::powersgd || hook == CommHook::int8 || hook == CommHook::automatic)
    ddp.first_bucket_cap_mb = ddp.bucket_cap_mb;
  const ZeroOptions& zero = run_.zero_plan;
  std::optional<BucketSharding> sharding;
  if (zero.shards_parameters()) {
    if (!model.parameter_units)
      throw ConfigError("--zero-stage 3: the model names no parameter units (give it parameter_units() and "
                        "set_unit_runner(), as models/gpt.h's do: see lockstep/ddp/parameter_units.h)");
    sharding = zero_bucket_sharding(zero, over->size(), *model.module, model.parameter_units());
  } else if (zero.sharded() && !shares_by_tensor()) {
    sharding = zero_bucket_sharding(zero, over->size());
  }
  reducer_ = std::make_unique<Reducer>(model.module, *over, ddp, sharding);
}

void TrainingStep::build_outer() {
  const TrainingArguments& args = run_.args;
  if (args.sync_every == 1 || run_.world() == 1) return;
  if (machine_comm_ && machine_comm_->size() == run_.world() && run_.rank() == 0)
    LOCKSTEP_LOG(warn, train) << "--sync-every " << args.sync_every
                              << ": every worker is on one machine, so there is no link to spare; the outer step "
                                 "still runs every "
                              << args.sync_every << " steps";
  outer_ = std::make_unique<OuterOptimizer>(*run_.model.module, *run_.comm,
                                            OuterOptions{args.sync_every, args.outer_learning_rate, args.outer_momentum});
}

void TrainingStep::meet_machines() {
  if (outer_) outer_->synchronize();
}

void TrainingStep::begin_cuda_graphs() { cuda_graph_ = std::make_unique<CudaGraphStep>(run_); }

void TrainingStep::end_cuda_graphs() { cuda_graph_.reset(); }

void TrainingStep::leave_communicator() {
  if (zero_) zero_->release_communicator();
  reducer_.reset();  // its buckets live in the old communicator's shared memory
  for (auto& p : run_.model.module->parameters()) p.mutable_grad() = torch::Tensor();
}

HeldState TrainingStep::held_state(std::int64_t steps) const {
  return HeldState{zero_.get(), zero_ ? nullptr : optimizer_.get(), steps};
}

void TrainingStep::hold_whole_state(std::unique_ptr<torch::optim::Optimizer> whole) {
  zero_.reset();
  optimizer_ = std::move(whole);
}

void TrainingStep::build_optimizer(const ZeroOptions& options, bool from_held) {
  std::unique_ptr<torch::optim::Optimizer> whole = from_held ? std::move(optimizer_) : nullptr;
  zero_.reset();
  optimizer_.reset();
  torch::nn::Module& module = *run_.model.module;
  if (shares_by_tensor()) {  // ZeRO-1 by whole tensors (zero_one_shares.cc)
    optimizer_ = make_optimizer(updated_share());
    return;
  }
  if (!options.sharded() || !reducer_) {
    optimizer_ = whole ? std::move(whole) : make_optimizer(module.parameters());
    return;
  }
  ZeroOptions sharded = options;
  if (run_.tensor_comm) {  // each tensor rank's data ranks shard its cut of the model
    sharded.tensor_group = run_.tensor_comm.get();
    for (const auto& shard : run_.model.tensor_shards()) sharded.split_parameters.push_back(shard.first);
  }
  zero_ = std::make_unique<ZeroOptimizer>(module, *reducer_, run_.data_communicator(), sharded,
                                          [this](std::vector<torch::Tensor> p) { return make_optimizer(p); });
  if (whole) zero_->load_consolidated(*whole);
}

torch::optim::Optimizer& TrainingStep::whole_optimizer(std::unique_ptr<torch::optim::Optimizer>& gathered) {
  if (!zero_) return *optimizer_;
  gathered = zero_->consolidated([this](std::vector<torch::Tensor> p) { return make_optimizer(p); });
  return *gathered;
}

ShardSnapshot TrainingStep::snapshot(bool copy) {
  const torch::nn::Module& module = *run_.model.module;
  const bool whole_share = !owners_.empty();  // ZeRO-1 by tensors: each replica writes its share
  const auto split = run_.tensor_split();
  if (zero_) return snapshot_zero(module, *zero_, run_.rank(), copy, split ? &*split : nullptr);
  // Split: each rank its shards where they sit in the whole tensors, cut over the ranks holding
  // the same (a stage's or the model's data ranks; under ZeRO-1, each its share whole).
  if (split)
    return snapshot_tensor_parallel(module, *split, *optimizer_, updated_parameters(),
                                    whole_share ? 0 : run_.data_rank(), whole_share ? 1 : run_.data_world(),
                                    run_.rank() == 0);
  if (pipeline_)  // its cut of its stages' parameters, or under ZeRO-1 the share it updates, whole
    return snapshot_pipeline_rank(module, updated_parameters(), *optimizer_, whole_share ? 0 : run_.data_rank(),
                                  whole_share ? 1 : run_.data_world(), run_.rank() == 0, copy);
  return snapshot_replicated(module, *optimizer_, run_.rank(), run_.world(), copy);
}

}  // namespace lockstep::train
