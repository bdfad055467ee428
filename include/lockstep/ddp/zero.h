// Sharded data parallelism: ZeRO stages 1, 2 and 3 (Rajbhandari et al., SC'20), and a one-copy
// mode that keeps the parameters (stages 1 and 2) or the gathered units (stage 3) once per machine.
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
// One copy (shared_parameters, shm backend, one machine): the parameters live once in machine
// memory (Communicator::allocate_machine_memory) that every rank maps. Each rank updates its own slices in place, so no
// all-gather is needed. Safety: a barrier before the update (no rank still reads parameters in
// backward while an owner writes them) and one after it (no rank's next forward reads a slice
// that is still being written).
//
// Stage 3: the parameters sharded too. The reducer's buckets are the model's units (see
// ddp/parameter_units.h: one bucket per unit, in the order backward finishes them, then the root
// unit's parameters); a rank keeps its slice of each (the optimizer's parameters) and a unit's
// whole parameters exist only while it runs: gathered just before (the next unit prefetched
// while this one computes), freed after, gathered again before its backward, freed once its
// gradients are handed to the reduce-scatter. The step updates the slices and gathers nothing.
// At rest a rank holds 1/W of parameters, gradients and optimizer state; in flight, the root and
// a unit or two (ZeroMemory::gathered_high_water). The same bytes on the wire as ZeRO-2 plus one
// all-gather of each unit per forward and one per backward (1.5x DDP's traffic, as in the paper).
//
// Stage 3 with one copy per machine (shared_parameters; shm, or hier with the same number of ranks
// on every machine): at rest the same slices (a machine's L ranks hold 1/M of the model between
// them), but a unit is gathered into machine memory (Communicator::allgather_machine), once for
// the machine's L ranks: each rank gathers its slice's M copies across machines (its index group)
// and writes them into the machine's block, so every element crosses the network and is written
// once per machine. In flight: the units a step holds at once, once per machine instead of once
// per rank; no copy of the whole unit per rank. FSDP's HYBRID_SHARD and ZeRO++'s hpZ shard inside
// a machine and replicate across machines (full parameters per machine at rest, gathers without the
// network); this does the opposite, sharding across machines, so a model larger than a machine fits.
//
// Mirrors (elastic jobs, ddp/zero_elastic.h). A lost rank takes its slices of the optimizer
// state with it, and nobody else has them. With mirror_of set, each rank also keeps a second set
// of slices, another rank's (on another machine: the Trainer picks the next machine's rank in the
// same place), and applies the same update to them: stage 1 reads that rank's averaged gradient
// from the all-reduced bucket (no extra traffic), stage 2 receives it from that rank (one slice
// per bucket, point-to-point). What it costs: the mirrored slices' parameters and optimizer state
// (twice ZeRO's optimizer memory per rank, still 2/W of DDP's), a second update's compute, stage
// 2's slice of traffic, and one 4-byte all-reduce per step: the update starts only once every rank
// holds its gradients (the all-reduce completing anywhere proves every rank entered it), so after a
// failure either no rank updated, or every survivor holds what it needs to finish the update, and
// the step is never half taken.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/comm/communicator.h"
#include "lockstep/ddp/ddp.h"
#include "lockstep/ddp/parameter_units.h"

namespace lockstep {

// Where a rank stands in the step in flight when its communicator failed.
enum class UpdatePhase {
  idle,     // no update under way: it holds the state after its last completed step
  ready,    // it holds the step's averaged gradients for its slices and its mirrors, not yet applied
  applied,  // it applied the step's update to its slices and its mirrors (the all-gather may not have run)
};

// What a job asks of ZeRO: decided once (the Trainer makes it from --zero-stage and
// --zero-shared-parameters), then asked by every part that depends on it (the reducer's sharding,
// the optimizer, checkpoints, the elastic code) instead of each testing the stage itself; and what
// ZeroOptimizer is built with.
struct ZeroOptions {
  ZeroOptions() = default;
  ZeroOptions(int s, bool shared) : stage(s), shared_parameters(shared) {}
  int stage = 0;                   // 0: none (plain DDP); 1: shard the optimizer state; 2: and the
                                   // gradients; 3: and the parameters
  bool shared_parameters = false;  // one copy per machine: of the parameters (stages 1, 2: all ranks on
                                   // one machine), of the gathered units (stage 3: shm or hier)
  int mirror_of = -1;              // the rank whose slices this rank mirrors (-1: no mirrors)
  int mirrored_by = -1;            // the rank that mirrors this rank's slices
  // Tests (fault injection): told when a mirrored update reaches `ready` (before the all-reduce that
  // lets it start) and `applied` (before the all-gather).
  std::function<void(UpdatePhase)> on_phase;
  // Tensor parallelism (lockstep/tp): the module is one rank's split of a model over
  // `tensor_group`, and `split_parameters` are its cuts of whole tensors (the rest it holds whole,
  // as every rank of the group does). ZeRO then shards over the communicator it is given (the data
  // ranks of one tensor rank); the global norm counts the cuts' elements over the tensor group and
  // the whole parameters once, and --fp16's overflow check spans the tensor group too.
  comm::Communicator* tensor_group = nullptr;
  std::vector<torch::Tensor> split_parameters;

  bool sharded() const { return stage > 0; }
  bool shards_parameters() const { return stage == 3; }
  // "ZeRO stage 2", "ZeRO stage 3, one copy per machine"; "" for none.
  std::string describe() const;
};

// A range of the module's trainable parameters laid end to end (in module.parameters() order) and
// what a rank holds of it: the parameters' values and the optimizer's state tensors, all 1-D.
struct HeldRange {
  std::int64_t begin = 0;
  torch::Tensor values;
  std::map<std::string, torch::Tensor> state;
};

// What a rank holds of a sharded job's training state: the slices of `owner`, each rank of the
// old membership being one owner (its own, and the rank it mirrors).
struct HeldShard {
  int owner = 0;
  std::vector<HeldRange> ranges;
};


// Stage 2 keeps two buckets' worth of gradients besides the slices: small buckets keep that small
// and start reducing sooner. The Trainer says when this lowers --ddp-bucket-cap-mb.
inline constexpr double kZero2MaxBucketMb = 4;

// What sharding needs of the reducer's buckets: fixed from the start, padded to a multiple of the
// world size, and under stage 2 reduce-scattered and no larger than kZero2MaxBucketMb.
// Reducer::bucket_cap_mb() says what the cap came to.
BucketSharding zero_bucket_sharding(const ZeroOptions& zero, int world);
// Stage 3: besides, one bucket per unit of `model` (units whose parameters are all frozen get
// none), the last unit first, and one for the parameters in no unit (the root). A ConfigError
// when a parameter is in two units.
BucketSharding zero_bucket_sharding(const ZeroOptions& zero, int world, torch::nn::Module& model,
                                    const std::vector<std::shared_ptr<torch::nn::Module>>& units);

// What one worker holds, in bytes.
struct ZeroMemory {
  std::int64_t parameters = 0;       // one-copy: this worker's share of its machine's copy
  std::int64_t gradients = 0;        // kept between steps (stage 2: its slices)
  std::int64_t gradient_slots = 0;   // stage 2: the two bucket slots gradients pass through
  std::int64_t optimizer_state = 0;  // measured once the optimizer has stepped, else expected
  std::int64_t padding = 0;          // elements added to even out the slices
  std::int64_t mirrors = 0;          // mirrors: the mirrored slices' parameters and optimizer state
  std::int64_t gathered_high_water = 0;  // stage 3: the most parameter bytes gathered at once so far
                                         // (with one copy per machine: the machine's, shared)
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

  // Collective: the global gradient norm over all slices (one all-reduce; with a tensor group, one
  // more over it); scales the gradients down to max_norm when it is larger, as
  // torch::nn::utils::clip_grad_norm_. Returns the norm.
  double clip_grad_norm(double max_norm);
  // Collective (--fp16's loss scaling): multiplies every slice's gradient by `factor` and returns
  // whether all are finite on every rank (one all-reduce), so that every rank decides alike.
  bool unscale_gradients(double factor);
  // Collective: updates this rank's slices and brings every rank the new parameters.
  void step();
  // Instead of step(), when the update is skipped (an overflowed --fp16 step): this step's
  // gradients are dropped and the parameters stay as they are.
  void skip_step();
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

  // Stage 3 (ConfigError at other stages, except before_forward, a no-op there).
  // What the model runs its units through (its set_unit_runner), with `units` as the model named
  // them when the sharding was made.
  UnitRunner unit_runner();
  // Before every forward (training or not): gathers the root unit's parameters.
  void before_forward();
  // Collective: every parameter gathered whole, to read or to load; then back to slices. With
  // keep_values, the parameters' values (written meanwhile, e.g. by a load) become the slices.
  void gather_all();
  void release_all(bool keep_values);
  // Collective: calls `visit` with every trainable parameter whole, in module.parameters() order.
  // Under stage 3 each unit is gathered only while its parameters are visited (the root for the
  // whole call), so this never needs the whole model's memory; at other stages it just visits.
  void visit_parameters(const std::function<void(const torch::Tensor&)>& visit);
  // Stage 3: this rank's slices of the parameters and of the optimizer's per-element `state`
  // arrays (with Adam's step count `step`), each range read through `read(parameter, array, start,
  // count, out)`: `parameter` its place among the trainable parameters in module.parameters()
  // order, `out` room for `count` elements of its dtype. Nothing outside the slices is read.
  using RangeReader = std::function<void(int parameter, const std::string& array, std::int64_t start,
                                         std::int64_t count, void* out)>;
  void load_slices(const RangeReader& read, const std::vector<std::string>& state, std::int64_t step);

  // Elastic jobs (ddp/zero_elastic.h drives these). After a collective failed: keeps what an
  // update would need (the gradients, copied out of the reducer's buckets), so the reducer and the
  // communicator can be released; only the calls below may follow.
  void release_communicator();
  UpdatePhase phase() const;
  // In phase ready: applies the update to this rank's slices and its mirrors (no communication).
  void finish_update();
  // This rank's slices and its mirrors as ranges of the module's parameters, with their state.
  std::vector<HeldShard> holdings() const;
  // The optimizer's step count (Adam's `step`; 0 before the first update or for SGD).
  std::int64_t optimizer_steps() const;
  int world() const;  // the ranks it was built over

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lockstep
