// --zero-stage 1 under --pipeline-parallel: ZeRO stage 1 over each stage's replicas, as DeepSpeed
// runs its pipelines. The pipeline leaves every replica of a stage the same averaged gradients (it
// reduces them as DDP does); each replica updates a share of the stage's parameters, whole
// tensors (pipe_core/partition.h's owners_of_tensors), and keeps the optimizer state of those
// alone; then each owner broadcasts its new values to the stage's other replicas. A tensor's update
// is the one every replica would have made (the same gradient, state and optimizer), so the run
// ends bitwise on the same run without ZeRO. It saves the optimizer state of all but 1/D of the
// stage's parameters (to within the largest tensor) and costs one broadcast of every parameter over
// the replica group after each step (an all-gather's bytes: the half of an all-reduce ZeRO-1 adds).
// Gradients stay whole on every replica: ZeRO-2 and 3 under a pipeline are not built.
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
  if (!dtype) throw ConfigError(std::string("--zero-stage 1 under a pipeline: a parameter of dtype ") +
                                c10::toString(p.scalar_type()) + " cannot cross the replica group");
  const bool in_place = p.is_cpu() && p.is_contiguous();
  torch::Tensor host = in_place ? p.detach() : p.detach().to(torch::kCPU).contiguous();
  group.broadcast(host.data_ptr(), std::size_t(host.numel()), *dtype, root)->wait();
  if (!in_place) p.detach().copy_(host);
}

}  // namespace

std::vector<torch::Tensor> TrainingStep::stage_share() {
  std::vector<torch::Tensor> all = pipeline_->parameters();
  const int replicas = pipeline_->stage_group().size();
  stage_owners_.clear();
  if (run_.zero_plan.stage != 1 || replicas == 1) return all;
  std::vector<long long> elements;
  for (const auto& p : all) elements.push_back(p.numel());
  stage_owners_ = pipe::owners_of_tensors(elements, replicas);
  std::vector<torch::Tensor> mine;
  for (std::size_t i = 0; i < all.size(); ++i)
    if (stage_owners_[i] == pipeline_->stage_group().rank()) mine.push_back(all[i]);
  return mine;
}

void TrainingStep::share_stage_updates() {
  if (stage_owners_.empty()) return;
  const auto all = pipeline_->parameters();
  for (std::size_t i = 0; i < all.size(); ++i) broadcast_from(pipeline_->stage_group(), all[i], stage_owners_[i]);
}

// The optimizer zeroes the gradients of what it updates; the replicas' shares hold theirs too.
void TrainingStep::zero_gradients() {
  optimizer_->zero_grad();
  if (stage_owners_.empty()) return;
  const auto all = pipeline_->parameters();
  for (std::size_t i = 0; i < all.size(); ++i)
    if (stage_owners_[i] != pipeline_->stage_group().rank() && all[i].grad().defined())
      all[i].mutable_grad().zero_();
}

void TrainingStep::keep_own_optimizer_state() {
  if (stage_owners_.empty()) return;
  const auto all = pipeline_->parameters();
  for (std::size_t i = 0; i < all.size(); ++i)
    if (stage_owners_[i] != pipeline_->stage_group().rank()) optimizer_->state().erase(ddp_detail::key_of(all[i]));
}

}  // namespace lockstep::train
