// The training state as sharded checkpoints hold it (train_core/shard_files.h): what a
// rank writes, copied out of the live tensors so training can go on while it is written, and how
// any world size, DDP or ZeRO, reads it back.
//
// The tensors are the module's trainable parameters in module.parameters() order, then its
// buffers. Under DDP every rank holds everything, so rank r writes the r-th of W equal cuts of
// the parameters laid end to end (values and optimizer state) and rank 0 the buffers: each
// element once, no rank gathering anything. Under ZeRO a rank writes the slices it owns.
//
//   auto snapshot = snapshot_replicated(module, optimizer, rank, world);   // or snapshot_zero
//   write_shard_file(CheckpointDir(dir).shard(rank, world), snapshot.tensors, snapshot.pieces);
//   ...
//   load_sharded(dir, module, &optimizer);   // any world size: the whole state on this rank
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "lockstep/ddp/zero.h"
#include "lockstep/tp/shards.h"
#include "lockstep/train_core/checkpoint_dir.h"
#include "lockstep/train_core/shard_files.h"

namespace lockstep::train {

// What a rank writes: the pieces point into `owned`, copies made when the snapshot was taken
// (or, with copies false, the live tensors themselves: for a write that ends before training goes
// on, and a model that has no memory to spare for a copy).
struct ShardSnapshot {
  std::vector<CheckpointTensor> tensors;
  std::vector<ShardPiece> pieces;
  std::vector<torch::Tensor> owned;
  bool copies = true;
  nlohmann::json optimizer;  // {"kind": "adamw", "step": N, "state": ["exp_avg", "exp_avg_sq"]}
  std::size_t bytes() const;
};

// DDP (or one process): the r-th of `world` cuts of every trainable parameter's values and the
// optimizer's state for them, and (rank 0) the buffers.
ShardSnapshot snapshot_replicated(const torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                                  int rank, int world, bool copy = true);
// A pipeline rank (pipe/pipeline.h): the `replica`-th of `replicas` cuts of the parameters in
// `owned` (its stages' own, or under ZeRO-1 its share of them, with replicas 1; laid end to end in
// the model's order) with the optimizer's state for them; every tensor of `module` (the whole
// model, which every rank builds) is listed, so that the shards of all pipeline ranks make one
// checkpoint; `buffers`: this rank writes the buffers too (one rank does).
ShardSnapshot snapshot_pipeline_rank(const torch::nn::Module& module, const std::vector<torch::Tensor>& owned,
                                     torch::optim::Optimizer& optimizer, int replica, int replicas, bool buffers,
                                     bool copy = true);
// Tensor parallelism: the module's parameters that are shards of whole tensors (the model's
// tensor_shards) and the group whose ranks hold the other shards. The checkpoint holds whole
// tensors, so a run of any layout reads it, and so do `gpt generate` and `lockstep checkpoint`.
struct TensorSplit {
  tp::ShardedParameters shards;
  comm::Communicator* group = nullptr;
};
// Tensor parallelism, with data replicas or not: the parameters of `written` as this rank holds
// them (its shards, and the whole ones) laid end to end, the `replica`-th of `replicas` cuts of
// them with their optimizer state, as snapshot_replicated cuts; each element of a shard written
// where it sits in its whole tensor (a run per row of a cut of columns), nothing gathered, and the
// whole parameters by the tensor group's first rank alone. `written`: every parameter, cut over
// the data ranks (or a stage's replicas) holding the same shards; under ZeRO-1 by tensors this data
// rank's share, replicas 1. `buffers`: this rank writes the buffers too (one rank does). Always
// copies.
ShardSnapshot snapshot_tensor_parallel(const torch::nn::Module& module, const TensorSplit& split,
                                       torch::optim::Optimizer& optimizer, const std::vector<torch::Tensor>& written,
                                       int replica, int replicas, bool buffers);
// ZeRO: this rank's own slices (not the ones it mirrors), and (rank 0) the buffers. `split`: the
// module is split for tensor parallelism (ZeRO over each tensor rank's data ranks): a slice of a
// shard is written where it sits in the whole tensor (a run of elements per row of the shard that
// its cut leaves contiguous), nothing gathered; the whole parameters by the group's first rank.
ShardSnapshot snapshot_zero(const torch::nn::Module& module, const ZeroOptimizer& zero, int rank, bool copy = true,
                            const TensorSplit* split = nullptr);

// Reads a sharded checkpoint into the module (parameters and buffers, each checked against the
// model's name, shape and dtype: a ConfigError naming the first that differs) and, when given,
// the whole optimizer state into `optimizer` (built over module.parameters(), of the kind the
// checkpoint names). Returns the checkpoint's optimizer record.
// `part`: the module is part of the checkpoint's model (a pipeline rank's parameters): tensors the
// checkpoint holds beyond the module's are not an error. `split`: the module is split for tensor
// parallelism; each shard reads its part of the whole tensor (and of its optimizer state).
nlohmann::json load_sharded(const std::string& dir, torch::nn::Module& module,
                            torch::optim::Optimizer* optimizer, bool part = false,
                            const TensorSplit* split = nullptr);

// Under ZeRO stage 3: the buffers into the module and this rank's slices into `zero`, reading
// nothing else (a model that barely fits its machines resumes without the whole state anywhere).
// `split`: the module is split for tensor parallelism; each slice of a shard is read from where it
// sits in the whole tensor.
nlohmann::json load_sharded_slices(const std::string& dir, torch::nn::Module& module, ZeroOptimizer& zero,
                                   const TensorSplit* split = nullptr);

// Every tensor's values, by name (what `lockstep checkpoint consolidate` writes as model.pt).
std::vector<std::pair<CheckpointTensor, torch::Tensor>> read_sharded_values(const std::string& dir);

}  // namespace lockstep::train
