// Sharded data parallelism: ZeRO stages 1 and 2 (Rajbhandari et al., SC'20), and a one-copy
// mode that keeps the parameters once per machine.
//
//   Reducer reducer(model, comm, DdpOptions{}, zero_bucket_sharding(zero, comm.size()));
//   ZeroOptimizer opt(*model, reducer, comm, zero, [](std::vector<torch::Tensor> shard) {
//     return std::make_unique<torch::optim::AdamW>(shard, torch::optim::AdamWOptions(1e-3));
//   });
//   reducer.before_forward(); loss = ...; loss.backward();   // gradients averaged (stage 2: sliced)
//   opt.clip_grad_norm(1.0); opt.step(); opt.zero_grad();     // every rank holds the new parameters
//
// Partition. The reducer's buckets are flat arrays; each is padded to a multiple of the world
// size W and cut into W equal slices, rank r owning slice r of every bucket (DeepSpeed's flat
// partition, not PyTorch ZeroRedundancyOptimizer's greedy fill by whole tensors). Why: the shards
// balance to within W - 1 padding elements per bucket whatever the tensor sizes (a greedy fill
// is as uneven as the largest tensor: the wide MLP's 784x2048 layer is 16% of it); a slice is
// exactly what a reduce-scatter of the bucket leaves on a rank, so stage 2 reduces each bucket
// as soon as backward fills it; and in one-copy mode the ranks update disjoint ranges of one
// array. The price: the optimizer must be elementwise (SGD, Adam, AdamW are: a tensor cut in two
// updates the same as whole), since one parameter's elements may live on two ranks.
//
// Stage 1: gradients are all-reduced as in DDP; each rank updates only its slices, keeping
// optimizer state for them alone (1/W of DDP's), and all-gathers the updated slices. Stage 2:
// buckets are reduce-scattered as backward fills them, and each rank keeps only its slices'
// gradients (1/W, plus the buckets in flight during backward). Same bytes on the wire as DDP:
// a reduce-scatter and an all-gather are one all-reduce.
//
// One copy (shared_parameters, shm backend): the parameters live once per machine in memory
// every rank maps (comm/machine_memory.h). Each rank updates its own slices in place, so no
// all-gather is needed. Safety: a barrier before the update (no rank still reads parameters in
// backward while an owner writes them) and one after it (no rank's next forward reads a slice
// that is still being written).
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "lockstep/comm/communicator.h"
#include "lockstep/ddp/ddp.h"

namespace lockstep {

struct ZeroOptions {
  int stage = 1;                   // 1: shard the optimizer state; 2: and the gradients
  bool shared_parameters = false;  // one copy of the parameters per machine (all ranks on one)
};

// What sharding needs of the reducer's buckets: fixed from the start, padded to a multiple of the
// world size, and under stage 2 reduce-scattered and no larger than 4 MB (stage 2 keeps two
// buckets' worth of gradients besides the slices: small buckets keep that small and start
// reducing sooner). Reducer::bucket_cap_mb() says what the cap came to.
BucketSharding zero_bucket_sharding(const ZeroOptions& zero, int world);

// What one worker holds, in bytes.
struct ZeroMemory {
  std::int64_t parameters = 0;       // one-copy: this worker's share of its machine's copy
  std::int64_t gradients = 0;        // kept between steps (stage 2: its slices)
  std::int64_t gradient_slots = 0;   // stage 2: the two bucket slots gradients pass through
  std::int64_t optimizer_state = 0;  // measured once the optimizer has stepped, else expected
  std::int64_t padding = 0;          // elements added to even out the slices
};

class ZeroOptimizer {
 public:
  using Factory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;

  // Collective. Moves the module's trainable parameters into flat arrays laid out like the
  // reducer's buckets (the values are kept) and builds `make` over this rank's slices.
  // ConfigError when the reducer was not built with zero_bucket_sharding, or the optimizer `make`
  // builds is not one this can consolidate (SGD, Adam, AdamW).
  ZeroOptimizer(torch::nn::Module& module, Reducer& reducer, comm::Communicator& comm, ZeroOptions options,
                Factory make);
  ~ZeroOptimizer();
  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;

  // Collective: the global gradient norm over all slices (one all-reduce); scales the gradients
  // down to max_norm when it is larger, as torch::nn::utils::clip_grad_norm_. Returns the norm.
  double clip_grad_norm(double max_norm);
  // Collective: updates this rank's slices and brings every rank the new parameters.
  void step();
  void zero_grad();
  // The optimizer over this rank's slices (its param_groups take the learning rate).
  torch::optim::Optimizer& shard_optimizer();

  // Collective: on rank 0, an optimizer `make_full` builds over the module's parameters, holding
  // the whole state as if one process had trained (what DDP would save); nullptr elsewhere.
  std::unique_ptr<torch::optim::Optimizer> consolidated(const Factory& make_full);
  // This rank's slices of a consolidated state (every rank passes the same, e.g. loaded from a
  // checkpoint's optimizer.pt into an optimizer over the module's parameters).
  void load_consolidated(torch::optim::Optimizer& full);

  ZeroMemory memory() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lockstep
