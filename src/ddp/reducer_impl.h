// The reducer behind DistributedDataParallel: its state, shared by the files that implement it.
//   ddp.cc               the Reducer's face: construction (parameters checked and broadcast),
//                        forward, and what callers ask of it
//   reducer_buckets.cc   where the gradients live: bucket layout, memory, slots, codecs
//   reducer_backward.cc  one backward's reduction: hooks, launches, the end-of-backward wait
//   broadcast_flat.cc    rank 0's tensors to every rank
//
// Threading model: forward runs on the training thread. On CPU the autograd engine runs
// backward, hence every ready hook and the end-of-backward callback, on the thread that
// called backward(); a CUDA engine runs them on its device threads. Either way they touch
// the reducer under `mu`. The all-reduces run on the communicator's progress thread and only
// touch the bucket buffers, which autograd no longer writes once their bucket is launched.
//
// Per synchronised step:
//   before_forward  rebuild buckets once (rank 0's arrival order), broadcast buffers, arm
//   ready hook      first one queues the end-of-backward callback; copy or adopt the grad
//                   into its bucket view; a bucket whose last grad arrived is launched,
//                   always in bucket order so every rank issues the same collectives
//   callback        unused parameters -> zeros (or an error naming them, after reducing so
//                   no peer hangs); wait for every bucket; copy results back; stats
#pragma once

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <mutex>
#include <set>

#include "lockstep/base/clock.h"
#include "lockstep/ddp/comm_dtype.h"
#include "lockstep/ddp/ddp.h"
#include "lockstep/ddp/torch_compat.h"
#include "lockstep/error.h"

namespace lockstep {
namespace ddp_detail {

// The communicator's dtype for a tensor's; a ConfigError naming `what` for one it cannot carry.
comm::DType comm_dtype(torch::ScalarType t, const std::string& what);

// Whether two tensors are the same view of the same memory.
bool same_memory(const torch::Tensor& a, const torch::Tensor& b);

// The weights of the module's embedding tables (a weight tied to a head counts: it is the
// same tensor).
std::set<const c10::TensorImpl*> embedding_tables(torch::nn::Module& module);

}  // namespace ddp_detail

struct Reducer::Impl : std::enable_shared_from_this<Impl> {
  struct Param {
    std::string name;
    torch::Tensor tensor;
    torch_compat::NodePtr accumulator;  // kept alive: the tensor holds it weakly
    std::uintptr_t hook_key = 0;
    int bucket = -1;
    std::int64_t offset = 0;  // where it starts in its bucket
    torch::Tensor view;       // this parameter's slice of its bucket (while the bucket exists)
    bool embedding = false;   // the weight of an Embedding or EmbeddingBag (BucketTensor::embedding)
  };
  struct Bucket {
    torch::Tensor flat;  // under reduce_scatter: only from its launch until it is reduced
    torch::Tensor wire;  // compressed copy, when a comm hook applies
    std::shared_ptr<BucketCodec> codec;  // powersgd, int8, auto: between machines
    torch::Tensor slice;  // this rank's part of the averaged bucket (see Reducer::gradient_slice)
    bool slice_written = true;  // under reduce_scatter: false until a backward (or a zero fill) wrote it
    std::int64_t numel = 0;  // padded to the sharding's slices
    torch::TensorOptions flat_options, wire_options;
    std::vector<int> params;
    int pending = 0;
    comm::WorkPtr work;
    SteadyTime queued{};
    bool shared = false;  // the tensor sent lives in the communicator's shared memory
    std::unique_ptr<c10::Event> written;  // on a GPU over nccl: recorded after backward wrote the bucket
  };

  Impl(std::shared_ptr<torch::nn::Module> m, comm::Communicator& c, DdpOptions o, std::optional<BucketSharding> sh)
      : module(std::move(m)), comm(c), options(std::move(o)), sharding(sh),
        reduce_scatter(sh && sh->reduce_scatter) {}

  std::shared_ptr<torch::nn::Module> module;
  comm::Communicator& comm;
  DdpOptions options;
  std::optional<BucketSharding> sharding;
  bool reduce_scatter;  // the sharding's, for short
  int contributors = 0;  // ranks with real gradients (0: all of them)

  mutable std::mutex mu;
  std::vector<Param> params;  // trainable ones, registration order
  std::vector<Bucket> buckets;
  std::function<void(int)> on_launched;
  std::vector<char> ready;
  std::vector<int> arrival;  // readiness order of the first synchronised step
  std::size_t next_launch = 0;
  bool sync = true;
  bool caller_finishes = false;  // set_caller_finishes: no end-of-backward callback
  bool armed = false;  // this forward's backward reduces
  bool callback_queued = false;
  bool rebuilt = false;
  bool broken = false;  // a backward failed midway; the ranks may disagree now
  SteadyTime backward_begin{}, last_ready{};
  bool backward_seen = false;
  DdpStats stats;

  void check_and_broadcast();
  void install_hooks();
  double bucket_cap_mb() const;
  void build_buckets(const std::vector<int>& order);
  std::vector<std::vector<int>> bucket_layout(const std::vector<int>& order) const;
  bool choose_wire(Bucket& bucket, int b);
  void allocate_bucket(Bucket& bucket, bool compress, const std::vector<torch::Tensor>& old_grads);
  std::vector<std::vector<int>> given_buckets() const;
  torch::Tensor bucket_memory(std::int64_t numel, const torch::TensorOptions& options, bool& shared);
  // Under reduce_scatter the buckets take turns in a few slots of memory (shared when the
  // communicator has it, so the reduce-scatter reads peers' slots in place).
  struct Slot {
    std::shared_ptr<void> memory;
    std::size_t bytes = 0;
    int user = -1;  // the bucket in it
  };
  std::vector<Slot> slots;
  void allocate_slots();
  void materialize(int b);
  void keep_slice(Bucket& bucket);
  void rescale(Bucket& bucket);
  void mark_ready_with_zeros();
  std::int64_t slice_length(const Bucket& bucket) const { return bucket.numel / comm.size(); }
  void rebuild_from_arrival();
  void on_ready(int index);
  void launch_ready();
  void launch(int b);
  comm::WorkPtr reduce(const torch::Tensor& flat, const std::shared_ptr<BucketCodec>& codec,
                       comm::DeviceReady written = {});
  comm::DeviceReady record_written(Bucket& bucket, const torch::Tensor& send);
  std::shared_ptr<BucketCodec> codec_for(int b) const;
  void queue_end_of_backward();
  void finish_backward();
  std::vector<int> fill_missing();
  void wait_for_buckets(DdpStats& s, std::exception_ptr& error);
  void copy_out_of_buckets();
  ConfigError unused_parameters_error(const std::vector<int>& missing) const;
};

}  // namespace lockstep
