// --zero-stage 1 under --pipeline-parallel or --tensor-parallel: ZeRO stage 1 by whole tensors
// over the replicas of what a rank trains (a stage's replicas; a tensor shard's data ranks), as
// DeepSpeed runs its pipelines with ZeRO-1. Every replica holds the same averaged gradients (the
// pipeline and the data group's reducer average them as DDP does); each updates a share of the
// parameters, whole tensors (pipe_core/partition.h's owners_of_tensors), and keeps the optimizer
// state of those alone; then each owner broadcasts its new values to the other replicas. A
// tensor's update is the one every replica would have made (the same gradient, state and
// optimizer), so the run ends bitwise on the same run without ZeRO. It saves the optimizer state of
// all but 1/D of the parameters (to within the largest tensor) and costs one broadcast of every
// parameter over the replica group after each step (an all-gather's bytes: the half of an
// all-reduce ZeRO-1 adds), not overlapped with compute. Gradients stay whole on every replica:
// ZeRO-2 and 3 there are not built. (Without a pipeline or tensor parallelism, ZeRO is
// ddp/zero.h's, by flat slices of the reducer's buckets.)
#include <torch/torch.h>

#include "lockstep/ddp/comm_dtype.h"
#include "lockstep/ddp/optimizer_state.h"
#include "lockstep/error.h"
#include "lockstep/pipe_core/partition.h"
#include "trainer_impl.h"

namespace lockstep::train {
namespace {

// Collective over `group`: `p` as `root` holds it, on every member.
void broadcast_from(comm::Communicator& group, const torch::Tensor& p, int root) {
  torch::NoGradGuard no_grad;
  const auto dtype = comm_dtype_of(p.scalar_type());
  if (!dtype) throw ConfigError(std::string("--zero-stage 1: a parameter of dtype ") + c10::toString(p.scalar_type()) +
                                " cannot cross the replica group");
  const bool in_place = p.is_cpu() && p.is_contiguous();
  torch::Tensor host = in_place ? p.detach() : p.detach().to(torch::kCPU).contiguous();
  group.broadcast(host.data_ptr(), std::size_t(host.numel()), *dtype, root)->wait();
  if (!in_place) p.detach().copy_(host);
}

}  // namespace

bool TrainingStep::shares_by_tensor() const {
  return run_.zero_plan.stage == 1 && (run_.pipelined() || run_.tensor_comm);
}

std::vector<torch::Tensor> TrainingStep::trained_parameters() const {
  return pipeline_ ? pipeline_->parameters() : run_.model.module->parameters();
}

comm::Communicator& TrainingStep::replica_group() const {
  return pipeline_ ? pipeline_->stage_group() : run_.data_communicator();
}

std::vector<torch::Tensor> TrainingStep::updated_share() {
  std::vector<torch::Tensor> all = trained_parameters();
  owners_.clear();
  if (!shares_by_tensor() || replica_group().size() == 1) return all;
  std::vector<long long> elements;  // a tensor group's ranks hold equal shards: they agree on the owners
  for (const auto& p : all) elements.push_back(p.numel());
  owners_ = pipe_core::owners_of_tensors(elements, replica_group().size());
  std::vector<torch::Tensor> mine;
  for (std::size_t i = 0; i < all.size(); ++i)
    if (owners_[i] == replica_group().rank()) mine.push_back(all[i]);
  return mine;
}

void TrainingStep::share_updates() {
  if (owners_.empty()) return;
  const auto all = trained_parameters();
  for (std::size_t i = 0; i < all.size(); ++i) broadcast_from(replica_group(), all[i], owners_[i]);
}

// The optimizer zeroes the gradients of what it updates; the other replicas' shares hold theirs too.
void TrainingStep::zero_gradients() {
  optimizer_->zero_grad();
  if (owners_.empty()) return;
  const auto all = trained_parameters();
  for (std::size_t i = 0; i < all.size(); ++i)
    if (owners_[i] != replica_group().rank() && all[i].grad().defined()) all[i].mutable_grad().zero_();
}

void TrainingStep::keep_own_optimizer_state() {
  if (owners_.empty()) return;
  const auto all = trained_parameters();
  for (std::size_t i = 0; i < all.size(); ++i)
    if (owners_[i] != replica_group().rank()) optimizer_->state().erase(ddp_detail::key_of(all[i]));
}

std::vector<torch::Tensor> TrainingStep::updated_parameters() const {
  std::vector<torch::Tensor> out;
  for (const auto& group : optimizer_->param_groups()) out.insert(out.end(), group.params().begin(), group.params().end());
  return out;
}

}  // namespace lockstep::train
