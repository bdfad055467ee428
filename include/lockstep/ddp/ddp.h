// DistributedDataParallel for libtorch modules.
//
// Wrap a model that every rank built identically; DistributedDataParallel checks that the
// ranks agree on every parameter's name, dtype and shape (a ConfigError naming the first
// difference otherwise, on every rank), then copies rank 0's parameters and buffers to all.
// After that, every backward pass through a forward of the wrapper leaves in each
// parameter's grad the average of that gradient over all ranks, so an unchanged optimizer
// keeps the replicas identical.
//
// How (see docs/ddp.md): trainable parameters are packed, in reverse registration order and
// per dtype, into flat buckets (the first one small, so communication starts early). A hook on
// each parameter's gradient accumulator marks it ready; once every parameter of a bucket is
// ready, the bucket is all-reduced (averaged) on the communicator's progress thread while
// backward keeps computing the rest. A callback queued on the autograd engine waits for all
// buckets before backward() returns, so optimizer.step() needs nothing more. After the first
// synchronised step, the buckets are rebuilt once in the order gradients actually arrived.
//
//   auto comm = lockstep::comm::join_from_env().comm;        // under `lockstep run`
//   auto model = std::make_shared<Net>();
//   lockstep::DistributedDataParallel ddp(model, *comm);
//   torch::optim::SGD opt(ddp.parameters(), 0.1);
//   auto loss = torch::nll_loss(ddp.forward(x), y);
//   opt.zero_grad(); loss.backward(); opt.step();            // grads are already averaged
//
// Gradient accumulation: forwards run inside `auto guard = ddp.no_sync();` only accumulate
// locally; the next forward outside it reduces the sum.
//
// Thread-safety: one training thread per wrapper. The communicator must outlive the wrapper
// and must not be used by another thread while a backward pass is reducing.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/comm/communicator.h"
#include "lockstep/ddp/compression.h"

namespace lockstep {

// What is sent for float32/float64 buckets. fp16 and bf16 halve (or quarter) the bytes
// everywhere, inside machines too; the sum is formed in float32 and rounded once, so the error
// is that of rounding each rank's gradient and the result to the 16-bit type (relative 2^-11
// for fp16, 2^-8 for bf16). powersgd, int8 and auto compress float32 buckets between machines
// only, with error feedback (ddp/compression.h); inside a machine the sum stays exact, and on
// one machine they change nothing.
enum class CommHook { none, fp16, bf16, powersgd, int8, automatic };  // as comm::kCommHooks
// A name of comm::kCommHooks ("" is none); ConfigError else
CommHook parse_comm_hook(const std::string& name);
const char* comm_hook_name(CommHook hook);

struct DdpOptions {
  double bucket_cap_mb = 25;            // a bucket closes once it holds at least this much
  double first_bucket_cap_mb = 1;       // ...except the first, so the first reduction starts early
  bool broadcast_buffers = true;        // copy rank 0's buffers (BatchNorm stats) at each training forward
  bool find_unused_parameters = false;  // reduce zeros for parameters that got no gradient
  bool gradient_as_bucket_view = true;  // grads live in the buckets: no copy in or out
  CommHook comm_hook = CommHook::none;
  CompressionOptions compression;  // powersgd, int8 and auto: rank, steps before compressing, ...
  // Put the buckets (as sent) in memory the communicator shares between ranks, when it has
  // some (shm backend, CPU tensors): the all-reduce then reads peers' buckets in place
  // instead of copying through staging slots. Falls back to private memory on every rank.
  bool shared_buckets = true;
};

// How ZeRO (ddp/zero.h: zero_bucket_sharding) has the reducer cut its buckets; plain DDP has
// none. With a sharding the buckets are fixed from the start (registration order reversed, not
// re-packed in the order gradients first arrive), since the shards are laid out over them.
struct BucketSharding {
  int slices = 1;  // the world size: every bucket padded to a multiple of it, rank r owning slice r
  // Each rank receives only its slice of every averaged bucket (ZeRO stage 2): buckets are
  // reduce-scattered instead of all-reduced, taking turns in two slots of memory as they
  // launch, and leave behind this rank's slices (gradient_slice, whose memory is first touched
  // by the first backward); the parameters' own grads are released when their bucket launches.
  bool reduce_scatter = false;
  double max_bucket_cap_mb = 0;  // a ceiling on DdpOptions::bucket_cap_mb (0: none)
  // The buckets themselves, as lists of trainable-parameter indices (registration order), in the
  // order they are reduced; empty: cut by size (assign_buckets). ZeRO stage 3 gives one per unit.
  std::vector<std::vector<int>> buckets{};
  // False: the reducer does not broadcast rank 0's parameters at construction (ZeRO stage 3, whose
  // optimizer broadcasts each unit as it cuts it, so the model never exists twice on a rank).
  bool broadcast_parameters = true;
};

using SteadyTime = std::chrono::steady_clock::time_point;

struct BucketStats {
  int index = 0;
  int parameters = 0;
  std::size_t bytes = 0;  // as sent, after compression
  SteadyTime queued{}, started{}, finished{};
};

// One synchronised backward pass. A step run under no_sync() leaves these untouched.
struct DdpStats {
  std::uint64_t step = 0;           // synchronised backward passes so far
  double backward_seconds = 0;      // backward's start (or first gradient) to its last gradient
  double comm_seconds = 0;          // summed run time of the bucket all-reduces
  double exposed_comm_seconds = 0;  // backward's end waiting for communication
  std::size_t bytes_allreduced = 0;
  int bucket_count = 0;
  int buckets_started_before_backward_end = 0;  // the overlap, counted
  int shared_buckets = 0;                       // buckets in shared memory (zero-copy)
  SteadyTime backward_begin{}, backward_end{}, reduced{};
  std::vector<BucketStats> buckets;
};

// The non-template engine behind DistributedDataParallel, usable directly for a module whose
// forward the caller runs itself: call before_forward() before it and after_forward() after.
class Reducer {
 public:
  Reducer(std::shared_ptr<torch::nn::Module> module, comm::Communicator& comm, DdpOptions options,
          std::optional<BucketSharding> sharding = std::nullopt);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  void before_forward();
  // output: the forward's result when it is one tensor (times backward from its gradient).
  void after_forward(const torch::Tensor* output);

  void set_sync(bool enabled);
  bool sync() const;

  // For a caller that runs the backward passes itself, several per step (a pipeline stage,
  // pipe/pipeline.h): buckets still launch from the gradient hooks as they fill, but no callback
  // waits at the end of a backward; finish() waits for every bucket instead. Arm with set_sync(true)
  // and before_forward() before the backward pass(es) that complete the step's gradients, then call
  // finish() once they have run.
  void set_caller_finishes(bool enabled);
  void finish();

  // Uneven inputs (ddp/join.h drives these). How many ranks contribute real gradients to the
  // coming reductions: the average divides by that many instead of the world size, since the
  // other ranks reduce zeros. Collective in effect: every rank must set the same number.
  void set_contributors(int ranks);
  // On a rank without a batch this step, after before_forward() and in place of forward and
  // backward: the reductions a backward would issue, with zeros for every gradient. Leaves the
  // averaged gradients where a backward would, so the optimizer steps as on the other ranks.
  void reduce_zeros();
  const DdpStats& stats() const;
  const DdpOptions& options() const;
  const std::optional<BucketSharding>& sharding() const;
  // The caps the buckets were built with: options()' own, under a sharding's ceiling.
  double bucket_cap_mb() const;
  double first_bucket_cap_mb() const;
  // Parameter names per bucket, in the order buckets are reduced.
  std::vector<std::vector<std::string>> bucket_layout() const;

  // The buckets as flat arrays, for sharding them: each bucket's parameters and where each
  // starts, and its length padded to the sharding's slices. Fixed from the start under a sharding.
  struct FlatBucket {
    std::vector<torch::Tensor> params;
    std::vector<std::int64_t> offsets;
    std::int64_t numel = 0;  // padded
  };
  std::vector<FlatBucket> flat_buckets() const;
  // This rank's slice of bucket b's averaged gradient: elements [rank * n / W, (rank + 1) * n / W)
  // of the padded bucket. A view of the bucket, or under reduce_scatter the tensor the slice is
  // kept in; the same tensor for the reducer's life, valid after each synchronised backward.
  torch::Tensor gradient_slice(int b) const;
  // Without reduce_scatter: elements [offset, offset + length) of bucket b's averaged gradient, a
  // view valid after each synchronised backward (ZeRO's mirrors read another rank's slice here).
  torch::Tensor averaged_range(int b, std::int64_t offset, std::int64_t length) const;
  // Under reduce_scatter: the bytes of the slots buckets take turns in while they are reduced.
  std::size_t bucket_slot_bytes() const;
  // Called on the thread running backward as soon as bucket b is handed to the communicator: its
  // gradients are in the bucket (under reduce_scatter the parameters' own grads are released), so
  // backward no longer needs its parameters (ZeRO stage 3 frees them here).
  void set_on_launched(std::function<void(int bucket)> callback);
  // Whether the backward of the current synchronised step has begun (the forward's output got its
  // gradient): a block run now is a recomputation inside backward.
  bool in_backward() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

// Scope guard returned by no_sync(): restores synchronisation when it goes out of scope.
class NoSync {
 public:
  explicit NoSync(Reducer& reducer) : reducer_(&reducer), previous_(reducer.sync()) {
    reducer.set_sync(false);
  }
  NoSync(NoSync&& other) noexcept : reducer_(other.reducer_), previous_(other.previous_) {
    other.reducer_ = nullptr;
  }
  NoSync(const NoSync&) = delete;
  NoSync& operator=(const NoSync&) = delete;
  NoSync& operator=(NoSync&&) = delete;
  ~NoSync() {
    if (reducer_) reducer_->set_sync(previous_);
  }

 private:
  Reducer* reducer_;
  bool previous_;
};

template <class M>
class DistributedDataParallel {
 public:
  DistributedDataParallel(std::shared_ptr<M> module, comm::Communicator& comm, DdpOptions options = {})
      : module_(std::move(module)), reducer_(module_, comm, std::move(options)) {}
  DistributedDataParallel(torch::nn::ModuleHolder<M> holder, comm::Communicator& comm,
                          DdpOptions options = {})
      : DistributedDataParallel(holder.ptr(), comm, std::move(options)) {}

  template <class... Args>
  auto forward(Args&&... args) {
    reducer_.before_forward();
    auto output = module_->forward(std::forward<Args>(args)...);
    if constexpr (std::is_same_v<std::decay_t<decltype(output)>, torch::Tensor>) {
      reducer_.after_forward(&output);
    } else {
      reducer_.after_forward(nullptr);
    }
    return output;
  }
  template <class... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  [[nodiscard]] NoSync no_sync() { return NoSync(reducer_); }

  // The wrapped module: its names and state carry no wrapper prefix, so a checkpoint of it
  // loads into a plain, unwrapped model.
  const std::shared_ptr<M>& module() const { return module_; }
  std::vector<torch::Tensor> parameters() const { return module_->parameters(); }
  void train(bool on = true) { module_->train(on); }
  void eval() { module_->eval(); }

  const DdpStats& stats() const { return reducer_.stats(); }
  Reducer& reducer() { return reducer_; }

 private:
  std::shared_ptr<M> module_;
  Reducer reducer_;
};

template <class M>
DistributedDataParallel(torch::nn::ModuleHolder<M>, comm::Communicator&, DdpOptions = {})
    -> DistributedDataParallel<M>;

}  // namespace lockstep
