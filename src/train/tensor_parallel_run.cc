// The Trainer under --tensor-parallel: the tensor and data groups made from the layout, the model
// split over the tensor group (Model::split_for_tensor_parallel), the loss over its split
// vocabulary, the global norm counting each whole parameter once, and each shard's replicas
// checked against each other at the end. The rest of the Trainer runs as for DDP, over the data
// group: the reducer, the sampler's split and evaluation's.
#include <torch/torch.h>

#include <algorithm>

#include "lockstep/base/log.h"
#include "lockstep/comm/collectives.h"
#include "lockstep/error.h"
#include "lockstep/tp/cross_entropy.h"
#include "lockstep/tp/gradients.h"
#include "lockstep/tp/regions.h"
#include "trainer_impl.h"

namespace lockstep::train {

void Trainer::Impl::split_model() {
  const Layout& l = layout();
  if (l.tensor() == 1) return;
  if (!model.split_for_tensor_parallel)
    throw ConfigError("--tensor-parallel " + std::to_string(l.tensor()) +
                      ": this model cannot be split (give it split_for_tensor_parallel() and tensor_shards(), as "
                      "models/gpt.h's GptLmHeadModel does; lockstep/tp/layers.h has the split layers)");
  // Every rank makes its tensor group, then its data group or its mesh: the same order everywhere.
  tensor_comm = comm->group(l.group_of(ParallelDim::tensor, rank()), l.group_name(ParallelDim::tensor, rank()));
  const ParallelDim second = l.pipelined() ? ParallelDim::mesh : ParallelDim::data;
  (l.pipelined() ? mesh_comm : data_comm) = comm->group(l.group_of(second, rank()), l.group_name(second, rank()));
  model.split_for_tensor_parallel(*tensor_comm, args.sequence_parallel);
  comm::Communicator* group = tensor_comm.get();
  loss_fn = [group](const torch::Tensor& out, const torch::Tensor& target) {
    return tp::vocab_parallel_cross_entropy(out.reshape({-1, out.size(-1)}), target.reshape({-1}), *group).mean();
  };
  predict_fn = [group](const torch::Tensor& out) {
    return tp::gather_from_tensor_region(out, *group, -1).argmax(-1);
  };
}

namespace {

bool is_shard(const tp::ShardedParameters& shards, const torch::Tensor& p) {
  return std::any_of(shards.begin(), shards.end(), [&](const auto& s) { return s.first.is_same(p); });
}

}  // namespace

double TrainingStep::tensor_parallel_clip(double max_norm) {
  const tp::ShardedParameters& shards = run_.model.tensor_shards();
  std::vector<torch::Tensor> split, whole;
  for (const auto& p : trained_parameters()) (is_shard(shards, p) ? split : whole).push_back(p);
  return tp::clip_grad_norm(split, whole, max_norm, *run_.tensor_comm);
}

std::optional<TensorSplit> Trainer::Impl::tensor_split() const {
  if (!tensor_comm) return std::nullopt;
  return TensorSplit{model.tensor_shards(), tensor_comm.get()};
}

namespace {

// Collective over `group`: whether every member's `mine` is the same, agreed by every rank of `all`.
bool same_everywhere(comm::Communicator& group, comm::Communicator& all, const std::string& mine) {
  const auto seen = comm::allgather_strings(group, mine);
  std::int32_t agree = std::all_of(seen.begin(), seen.end(), [&](const std::string& f) { return f == seen[0]; });
  std::int32_t everywhere = 0;
  all.allreduce(&agree, &everywhere, 1, comm::DType::i32, comm::ReduceOp::min)->wait();
  return everywhere != 0;
}

}  // namespace

// The replicas of one shard (a data group) must hold the same parameters, and the ranks of a
// tensor group the same whole (unsplit) parameters: they take the same gradients and skip the same
// steps (--fp16). Different shards differ.
void Trainer::Impl::check_tensor_replicas() {
  comm::Communicator& data = step.pipeline() ? step.pipeline()->stage_group() : *data_comm;
  std::vector<std::uint64_t> all, whole;
  const auto shards = model.tensor_shards();
  auto hash = [&](const torch::Tensor& p) {
    all.push_back(parameter_hash(p));
    if (!is_shard(shards, p)) whole.push_back(all.back());
  };
  if (step.stage3())  // ZeRO-3: a unit at a time, put together from its data ranks' slices
    step.zero()->visit_parameters(hash);
  else
    for (const auto& p : model.module->parameters()) hash(p);
  const bool replicas = same_everywhere(data, *comm, combined_fingerprint(all));
  const bool tensor_ranks = same_everywhere(*tensor_comm, *comm, combined_fingerprint(whole));
  if (rank() != 0) return;
  const Layout& l = layout();
  const std::string held = l.pipelined() ? std::to_string(l.pipeline() * l.tensor()) + " shards (" +
                                               std::to_string(l.pipeline()) + " stages x " + std::to_string(l.tensor()) +
                                               " tensor)"
                                         : std::to_string(l.tensor()) + " tensor shards";
  if (replicas)
    LOCKSTEP_LOG(info, train) << "the " << layout().data() << " replicas of each of the " << held
                              << " hold the same parameters";
  else
    LOCKSTEP_LOG(warn, train) << "the replicas of a tensor shard diverged (a non-deterministic op, or a rank that "
                                 "skipped a step); evaluate with care";
  if (tensor_ranks)
    LOCKSTEP_LOG(info, train) << "the " << layout().tensor() << " ranks of each tensor group hold the same whole "
                                 "parameters";
  else
    LOCKSTEP_LOG(warn, train) << "the ranks of a tensor group hold different whole parameters (layer norms, "
                                 "positions, biases): one took a step the others skipped; evaluate with care";
}

}  // namespace lockstep::train
