// The Trainer under --tensor-parallel: the tensor and data groups made from the layout, the model
// split over the tensor group (Model::split_for_tensor_parallel), the loss over its split
// vocabulary, the global norm counting each whole parameter once, and each shard's replicas
// checked against each other at the end. The rest of the Trainer runs as for DDP, over the data
// group: the reducer, the sampler's split and evaluation's.
#include <torch/torch.h>

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
                      ": this model cannot be split (give it split_for_tensor_parallel() and split_parameters(), as "
                      "models/gpt.h's GptLmHeadModel does; lockstep/tp/layers.h has the split layers)");
  // Every rank makes its tensor group, then its data group: the same order everywhere.
  tensor_comm = comm->group(l.group_of(ParallelDim::tensor, rank()), l.group_name(ParallelDim::tensor, rank()));
  data_comm = comm->group(l.group_of(ParallelDim::data, rank()), l.group_name(ParallelDim::data, rank()));
  model.split_for_tensor_parallel(*tensor_comm, args.sequence_parallel);
  comm::Communicator* group = tensor_comm.get();
  loss_fn = [group](const torch::Tensor& out, const torch::Tensor& target) {
    return tp::vocab_parallel_cross_entropy(out.reshape({-1, out.size(-1)}), target.reshape({-1}), *group).mean();
  };
  predict_fn = [group](const torch::Tensor& out) {
    return tp::gather_from_tensor_region(out, *group, -1).argmax(-1);
  };
}

double TrainingStep::tensor_parallel_clip(double max_norm) {
  const auto split = run_.model.split_parameters();
  std::vector<torch::Tensor> whole;
  for (const auto& p : run_.model.module->parameters())
    if (std::none_of(split.begin(), split.end(), [&](const torch::Tensor& s) { return s.is_same(p); }))
      whole.push_back(p);
  return tp::clip_grad_norm(split, whole, max_norm, *run_.tensor_comm);
}

// The replicas of one shard (a data group) must hold the same parameters; different shards differ.
void Trainer::Impl::check_tensor_replicas() {
  const auto all = comm::allgather_strings(*data_comm, parameters_fingerprint(*model.module, nullptr));
  bool same = true;
  for (const auto& f : all) same = same && f == all[0];
  std::int32_t agree = same ? 1 : 0, everywhere = 0;
  comm->allreduce(&agree, &everywhere, 1, comm::DType::i32, comm::ReduceOp::min)->wait();
  if (rank() != 0) return;
  if (everywhere)
    LOCKSTEP_LOG(info, train) << "the " << layout().data() << " replicas of each of the " << layout().tensor()
                              << " tensor shards hold the same parameters";
  else
    LOCKSTEP_LOG(warn, train) << "the replicas of a tensor shard diverged (a non-deterministic op, or a rank that "
                                 "skipped a step); evaluate with care";
}

}  // namespace lockstep::train
