// The reducer behind DistributedDataParallel.
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
#include "lockstep/base/clock.h"
#include "lockstep/ddp/ddp.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

#include "lockstep/base/log.h"
#include "lockstep/comm/codec.h"
#include "lockstep/ddp/bucket_assignment.h"
#include "lockstep/ddp/comm_dtype.h"
#include "lockstep/ddp/torch_compat.h"
#include "broadcast_flat.h"
#include "lockstep/error.h"
#include "signature.h"
#include "tensor_alias.h"

namespace lockstep {
namespace {

using ddp_detail::alias_into;
using ddp_detail::alias_range;

comm::DType comm_dtype(torch::ScalarType t, const std::string& what) {
  if (const auto d = comm_dtype_of(t)) return *d;
  throw ConfigError("DistributedDataParallel: " + what + " has dtype " + dtype_name(t) +
                    ", which lockstep cannot reduce (float32/64, float16, bfloat16, int32, int64)");
}

bool same_memory(const torch::Tensor& a, const torch::Tensor& b) {
  return a.defined() && b.defined() && a.data_ptr() == b.data_ptr() && a.sizes() == b.sizes() &&
         a.strides() == b.strides();
}

// The weights of the module's embedding tables (a weight tied to a head counts: it is the
// same tensor).
std::set<const c10::TensorImpl*> embedding_tables(torch::nn::Module& module) {
  std::set<const c10::TensorImpl*> tables;
  for (auto& sub : module.modules()) {
    if (auto* e = sub->as<torch::nn::EmbeddingImpl>()) tables.insert(e->weight.unsafeGetTensorImpl());
    if (auto* e = sub->as<torch::nn::EmbeddingBagImpl>()) tables.insert(e->weight.unsafeGetTensorImpl());
  }
  return tables;
}

}  // namespace

namespace ddp_detail {

// One broadcast per dtype and per 64 MB of tensors (a larger one alone), of each group flattened:
// few collectives, and no copy of the whole model at once (a model that barely fits must not
// need twice its size here).
void broadcast_flat(comm::Communicator& comm, std::vector<torch::Tensor> tensors, const std::string& what) {
  constexpr std::int64_t kChunkBytes = 64 << 20;
  std::map<torch::ScalarType, std::vector<std::vector<torch::Tensor>>> chunks;
  for (auto& t : tensors) {
    auto& list = chunks[t.scalar_type()];
    std::int64_t bytes = 0;
    if (!list.empty())
      for (auto& u : list.back()) bytes += u.numel() * std::int64_t(u.element_size());
    if (list.empty() || bytes + t.numel() * std::int64_t(t.element_size()) > kChunkBytes) list.emplace_back();
    list.back().push_back(t);
  }
  torch::NoGradGuard no_grad;
  for (auto& [dtype, list] : chunks) {
    for (auto& group : list) {
      std::vector<torch::Tensor> flat_parts;
      for (auto& t : group) flat_parts.push_back(t.detach().reshape(-1).to(torch::kCPU));
      auto flat = torch::cat(flat_parts);
      flat_parts.clear();
      comm.broadcast(flat.data_ptr(), flat.numel(), comm_dtype(dtype, what), 0)->wait();
      std::int64_t offset = 0;
      for (auto& t : group) {
        t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
        offset += t.numel();
      }
    }
  }
}

}  // namespace ddp_detail

using ddp_detail::broadcast_flat;

CommHook parse_comm_hook(const std::string& name) {
  if (name.empty()) return CommHook::none;
  std::string names;
  for (std::size_t i = 0; i < std::size(comm::kCommHooks); ++i) {
    if (name == comm::kCommHooks[i].name) return static_cast<CommHook>(i);
    names += (names.empty() ? "" : ", ") + std::string(comm::kCommHooks[i].name);
  }
  throw ConfigError("unknown gradient compression '" + name + "': use one of " + names);
}

const char* comm_hook_name(CommHook hook) {
  return comm::kCommHooks[static_cast<std::size_t>(hook)].name;
}

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

void Reducer::Impl::check_and_broadcast() {
  std::vector<ddp_detail::ParamSignature> mine;
  for (auto& item : module->named_parameters()) {
    auto& p = item.value();
    mine.push_back({item.key(), dtype_name(p.scalar_type()), p.sizes().vec()});
  }
  ddp_detail::check_same_parameters(comm, mine);
  if (comm.size() == 1) return;
  std::vector<torch::Tensor> state = module->parameters();
  if (!state.empty() && (!sharding || sharding->broadcast_parameters)) broadcast_flat(comm, state, "a parameter");
  if (options.broadcast_buffers) {
    auto buffers = module->buffers();
    if (!buffers.empty()) broadcast_flat(comm, buffers, "a buffer");
  }
}

void Reducer::Impl::install_hooks() {
  struct ReadyHook : torch::autograd::FunctionPostHook {
    ReadyHook(std::weak_ptr<Impl> i, int n) : impl(std::move(i)), index(n) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
      if (auto p = impl.lock()) p->on_ready(index);
      return outputs;
    }
    std::weak_ptr<Impl> impl;
    int index;
  };
  const auto tables = embedding_tables(*module);
  for (auto& item : module->named_parameters()) {
    auto& p = item.value();
    auto& name = item.key();
    if (!p.requires_grad()) continue;
    Param param;
    param.name = name;
    param.tensor = p;
    param.embedding = tables.count(p.unsafeGetTensorImpl()) > 0;
    comm_dtype(p.scalar_type(), "parameter '" + name + "'");
    params.push_back(std::move(param));
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    auto& p = params[i];
    p.accumulator = torch::autograd::impl::grad_accumulator(p.tensor);
    p.hook_key = p.accumulator->add_post_hook(std::make_unique<ReadyHook>(weak_from_this(), int(i)));
  }
  ready.assign(params.size(), 0);
}

double Reducer::Impl::bucket_cap_mb() const {
  const double ceiling = sharding ? sharding->max_bucket_cap_mb : 0;
  return ceiling > 0 ? std::min(options.bucket_cap_mb, ceiling) : options.bucket_cap_mb;
}

// Which parameters each bucket holds: the sharding's own buckets, or assign_buckets over `order`.
std::vector<std::vector<int>> Reducer::Impl::bucket_layout(const std::vector<int>& order) const {
  if (sharding && !sharding->buckets.empty()) return given_buckets();
  std::vector<BucketInput> inputs;
  for (const auto& p : params)
    inputs.push_back({p.tensor.numel() * std::int64_t(p.tensor.element_size()),
                      std::string(c10::toString(p.tensor.scalar_type())) + "@" + p.tensor.device().str()});
  const auto mb = [](double m) { return std::int64_t(m * 1024 * 1024); };
  return assign_buckets(inputs, order, {mb(std::min(options.first_bucket_cap_mb, bucket_cap_mb())), mb(bucket_cap_mb())});
}

// What bucket b puts on the wire: a 16-bit copy (the fp16/bf16 hooks, on 32-bit floats and wider;
// returns true), a codec's encoding (the other hooks, on float32), or itself.
bool Reducer::Impl::choose_wire(Bucket& bucket, int b) {
  const auto& first = params[std::size_t(bucket.params.front())].tensor;
  const bool sixteen_bits = options.comm_hook == CommHook::fp16 || options.comm_hook == CommHook::bf16;
  if (!sixteen_bits && options.comm_hook != CommHook::none && first.scalar_type() == torch::kFloat)
    bucket.codec = codec_for(b);
  const bool compress = sixteen_bits && torch::isFloatingType(first.scalar_type()) && first.element_size() >= 4;
  if (compress)
    bucket.wire_options = bucket.flat_options.dtype(options.comm_hook == CommHook::fp16 ? torch::kHalf : torch::kBFloat16);
  return compress;
}

// The bucket's memory; its parameters' gradients become views of it (keeping their values).
// Under reduce-scatter only this rank's slice lives between steps: old gradients go in at the
// next backward, and the slice is not touched (so not resident) until a backward writes it: at
// construction the whole model is still there, and ZeRO-3 is about not holding more than that.
void Reducer::Impl::allocate_bucket(Bucket& bucket, bool compress, const std::vector<torch::Tensor>& old_grads) {
  if (reduce_scatter) {
    bucket.slice = torch::empty({slice_length(bucket)}, bucket.flat_options);
    bucket.slice_written = false;
    return;
  }
  if (compress) {
    bucket.flat = torch::zeros({bucket.numel}, bucket.flat_options);
    bucket.wire = bucket_memory(bucket.numel, bucket.wire_options, bucket.shared);
  } else {
    bucket.flat = bucket_memory(bucket.numel, bucket.flat_options, bucket.shared);
  }
  bucket.slice = alias_range(bucket.flat, comm.rank() * slice_length(bucket), slice_length(bucket));
  for (int i : bucket.params) {
    auto& p = params[std::size_t(i)];
    p.view = alias_into(bucket.flat, p.offset, p.tensor);
    if (old_grads[std::size_t(i)].defined()) p.view.copy_(old_grads[std::size_t(i)]);
    if (options.gradient_as_bucket_view && old_grads[std::size_t(i)].defined()) p.tensor.mutable_grad() = p.view;
  }
}

// Buckets follow `order`, then get their memory: views of it become the grads.
void Reducer::Impl::build_buckets(const std::vector<int>& order) {
  std::vector<torch::Tensor> old_grads(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) old_grads[i] = params[i].tensor.grad();
  const auto layout = bucket_layout(order);
  torch::NoGradGuard no_grad;
  buckets.clear();
  buckets.resize(layout.size());
  for (std::size_t b = 0; b < layout.size(); ++b) {
    auto& bucket = buckets[b];
    bucket.params = layout[b];
    std::int64_t offset = 0;
    for (int i : bucket.params) {
      params[std::size_t(i)].bucket = int(b);
      params[std::size_t(i)].offset = offset;
      offset += params[std::size_t(i)].tensor.numel();
    }
    const std::int64_t multiple = sharding ? sharding->slices : 1;
    bucket.numel = (offset + multiple - 1) / multiple * multiple;
    bucket.flat_options = params[std::size_t(bucket.params.front())].tensor.options().requires_grad(false);
    allocate_bucket(bucket, choose_wire(bucket, int(b)), old_grads);
  }
  if (reduce_scatter) allocate_slots();
}

// The sharding's own buckets, checked: every trainable parameter in exactly one, of one dtype each.
std::vector<std::vector<int>> Reducer::Impl::given_buckets() const {
  std::vector<int> seen(params.size(), 0);
  for (const auto& group : sharding->buckets)
    for (int i : group) {
      if (i < 0 || std::size_t(i) >= params.size() || seen[std::size_t(i)]++)
        throw ConfigError("a bucket sharding lists trainable parameter " + std::to_string(i) +
                          " twice or out of range (" + std::to_string(params.size()) + " parameters)");
      if (params[std::size_t(i)].tensor.scalar_type() != params[std::size_t(group.front())].tensor.scalar_type())
        throw ConfigError("a bucket of a sharding mixes dtypes ('" + params[std::size_t(i)].name + "' and '" +
                          params[std::size_t(group.front())].name + "'): give each dtype its own");
    }
  for (std::size_t i = 0; i < params.size(); ++i)
    if (!seen[i]) throw ConfigError("a bucket sharding leaves out trainable parameter '" + params[i].name + "'");
  std::vector<std::vector<int>> out;
  for (const auto& group : sharding->buckets)
    if (!group.empty()) out.push_back(group);
  return out;
}

// Two slots (one while the other's bucket is reduced) of the largest bucket's size. Collective:
// every rank builds the same buckets, so asks for the same sizes in the same order.
void Reducer::Impl::allocate_slots() {
  std::size_t largest = 0;
  for (auto& b : buckets) {
    const auto& sent = b.wire_options.has_dtype() ? b.wire_options : b.flat_options;
    largest = std::max(largest, std::size_t(b.numel) * c10::elementSize(c10::typeMetaToScalarType(sent.dtype())));
  }
  slots.assign(std::min<std::size_t>(2, buckets.size()), Slot{});
  // On the device the gradients are on: a GPU's buckets are reduced from its memory (a backend
  // that reduces host memory stages them itself).
  const torch::Device device = buckets.empty() ? torch::Device(torch::kCPU) : buckets.front().flat_options.device();
  for (auto& s : slots) {
    s.bytes = largest;
    s.memory = options.shared_buckets && device.is_cpu() ? comm.allocate_shared(largest) : nullptr;
    if (!s.memory) {
      auto bytes = torch::empty({std::int64_t(largest)}, torch::TensorOptions(torch::kByte).device(device));
      s.memory = std::shared_ptr<void>(bytes.data_ptr(), [bytes](void*) {});
    }
  }
}

// Zeros for a bucket, in shared memory when the communicator has it. Collective: every rank
// builds the same buckets in the same order, so every rank asks for the same sizes.
torch::Tensor Reducer::Impl::bucket_memory(std::int64_t numel, const torch::TensorOptions& opts, bool& shared) {
  shared = false;
  if (options.shared_buckets && opts.device().is_cpu()) {
    auto bytes = std::size_t(numel) * c10::elementSize(c10::typeMetaToScalarType(opts.dtype()));
    if (auto memory = comm.allocate_shared(bytes)) {
      shared = true;
      auto t = torch::from_blob(
          memory.get(), {numel}, [memory](void*) mutable { memory.reset(); }, opts);
      return t.zero_();
    }
  }
  return torch::zeros({numel}, opts);
}

// Bucket b's codec over its tensors' places and shapes; auto's decisions are logged on rank 0.
std::shared_ptr<BucketCodec> Reducer::Impl::codec_for(int b) const {
  std::vector<BucketTensor> layout;
  for (int i : buckets[std::size_t(b)].params)
    layout.push_back({params[i].offset, params[i].tensor.sizes().vec(), params[i].embedding});
  std::function<void(const std::string&)> log;
  if (comm.rank() == 0)
    log = [b](const std::string& line) { LOCKSTEP_LOG(info, ddp) << "auto comm hook, bucket " << b << ": " << line; };
  return make_bucket_codec(comm_hook_name(options.comm_hook), std::move(layout), options.compression, std::move(log));
}

// Under reduce_scatter, at the bucket's launch: its slot (once the bucket before it there is
// reduced), this backward's gradients copied in and released, zeros for the rest.
void Reducer::Impl::materialize(int b) {
  Bucket& bucket = buckets[b];
  Slot& slot = slots[std::size_t(b) % slots.size()];
  if (slot.user >= 0 && slot.user != b) {
    Bucket& before = buckets[slot.user];
    if (before.work) before.work->wait();
    keep_slice(before);
  }
  slot.user = b;
  const auto& sent_options = bucket.wire_options.has_dtype() ? bucket.wire_options : bucket.flat_options;
  auto sent = torch::from_blob(slot.memory.get(), {bucket.numel}, [memory = slot.memory](void*) {}, sent_options);
  if (bucket.wire_options.has_dtype()) {
    bucket.wire = sent;
    bucket.flat = torch::empty({bucket.numel}, bucket.flat_options);
  } else {
    bucket.flat = sent;
  }
  std::int64_t used = 0;
  for (int i : bucket.params) {
    auto& p = params[i];
    p.view = alias_into(bucket.flat, p.offset, p.tensor);
    auto& grad = p.tensor.mutable_grad();
    if (grad.defined()) {
      p.view.copy_(grad);
      grad = torch::Tensor();  // only this rank's slice of it will remain
    } else {
      p.view.zero_();  // no gradient this step (find_unused_parameters)
    }
    used += p.tensor.numel();
  }
  bucket.flat.narrow(0, used, bucket.numel - used).zero_();
}

// Under reduce_scatter, once the bucket is reduced: this rank's slice is kept, the slot let go.
void Reducer::Impl::keep_slice(Bucket& bucket) {
  if (!reduce_scatter || !bucket.flat.defined()) return;
  const auto& reduced = bucket.wire.defined() ? bucket.wire : bucket.flat;
  bucket.slice.copy_(reduced.narrow(0, comm.rank() * slice_length(bucket), slice_length(bucket)));
  bucket.slice_written = true;
  bucket.flat = torch::Tensor();
  bucket.wire = torch::Tensor();
  for (int i : bucket.params) params[i].view = torch::Tensor();
}

// The buckets were averaged over every rank, `contributors` of which had real gradients: their
// average is W / contributors times that.
void Reducer::Impl::rescale(Bucket& bucket) {
  if (contributors == 0 || contributors == comm.size()) return;
  const double scale = double(comm.size()) / contributors;
  if (reduce_scatter)
    bucket.slice.mul_(scale);
  else
    bucket.flat.mul_(scale);
}

// Every parameter ready with a zero gradient, as a backward that computed none would leave it;
// then every bucket launches, in order, as on the ranks that computed theirs.
void Reducer::Impl::mark_ready_with_zeros() {
  std::lock_guard<std::mutex> lock(mu);
  if (!armed)
    throw Error("DistributedDataParallel: reduce_zeros() needs before_forward() first, in training mode "
                "and with synchronisation on, as on the ranks that train this step");
  torch::NoGradGuard no_grad;
  backward_begin = last_ready = Clock::now();
  for (std::size_t i = 0; i < params.size(); ++i) {
    auto& p = params[i];
    auto& grad = p.tensor.mutable_grad();
    if (reduce_scatter) {
      grad = torch::Tensor();  // the bucket's launch fills in zeros
    } else {
      p.view.zero_();
      grad = options.gradient_as_bucket_view ? p.view : torch::zeros_like(p.tensor);
    }
    ready[i] = 1;
  }
  for (auto& b : buckets) b.pending = 0;
  launch_ready();
}

// All ranks take rank 0's order, so their buckets match.
void Reducer::Impl::rebuild_from_arrival() {
  rebuilt = true;
  std::vector<std::int64_t> order(params.size(), -1);
  std::vector<char> seen(params.size(), 0);
  std::size_t k = 0;
  for (int i : arrival) {
    if (!seen[i]) order[k++] = i, seen[i] = 1;
  }
  for (int i = int(params.size()) - 1; i >= 0; --i) {
    if (!seen[i]) order[k++] = i;
  }
  if (comm.size() > 1) comm.broadcast(order.data(), order.size(), comm::DType::i64, 0)->wait();
  std::vector<int> as_int(order.begin(), order.end());
  std::vector<int> current;
  for (auto& b : buckets) current.insert(current.end(), b.params.begin(), b.params.end());
  if (as_int != current) build_buckets(as_int);
  arrival.clear();
}

// The callback that waits for every bucket, queued on the graph task that is running now. The
// output's hook queues it at the very start of the outer backward; a gradient that arrives first
// queues it here instead (a forward whose output is not a tensor). Queued from inside a
// gradient-checkpointed block's recomputation, which is a backward of its own, it would run when
// that inner backward ends: too early.
void Reducer::Impl::queue_end_of_backward() {
  if (callback_queued) return;
  callback_queued = true;
  torch::autograd::Engine::get_default_engine().queue_callback([weak = weak_from_this()] {
    if (auto p = weak.lock()) p->finish_backward();
  });
}

void Reducer::Impl::on_ready(int index) {
  std::lock_guard<std::mutex> lock(mu);
  if (!armed) return;
  auto now = Clock::now();
  if (!backward_seen) backward_seen = true, backward_begin = now;
  if (!caller_finishes) queue_end_of_backward();
  auto& p = params[index];
  if (ready[index]) {
    broken = true;
    throw Error("DistributedDataParallel: parameter '" + p.name +
                "' received a gradient twice in one backward pass. Run a new forward through the "
                "wrapper before each backward, or pass retain_graph only under no_sync()");
  }
  ready[index] = 1;
  if (!rebuilt) arrival.push_back(index);
  last_ready = now;
  torch::NoGradGuard no_grad;
  auto& grad = p.tensor.mutable_grad();
  if (reduce_scatter) {
    // The gradient stays where autograd put it until its bucket launches.
  } else if (options.gradient_as_bucket_view) {
    if (!same_memory(grad, p.view)) {
      p.view.copy_(grad);
      grad = p.view;
    }
  } else {
    p.view.copy_(grad);
  }
  if (--buckets[p.bucket].pending == 0) launch_ready();
}

void Reducer::Impl::launch_ready() {
  while (next_launch < buckets.size() && buckets[next_launch].pending == 0) launch(int(next_launch++));
}

void Reducer::Impl::launch(int b) {
  auto& bucket = buckets[b];
  torch::NoGradGuard no_grad;
  if (reduce_scatter) materialize(b);
  auto& send = bucket.wire.defined() ? bucket.wire : bucket.flat;
  if (bucket.wire.defined()) bucket.wire.copy_(bucket.flat);
  bucket.queued = Clock::now();
  if (!send.is_cpu() && comm.takes_device_memory()) {
    bucket.work = reduce(send, bucket.codec, record_written(bucket, send));
  } else if (!send.is_cpu()) {
    // A device bucket goes through host memory to the host backends.
    auto host = send.to(torch::kCPU);
    reduce(host, bucket.codec)->wait();
    send.copy_(host);
    bucket.work = nullptr;
  } else {
    bucket.work = reduce(send, bucket.codec);
  }
  if (on_launched) on_launched(b);
}

// nccl reads the GPU's memory on a stream of its own, and backward's kernels that write the
// bucket may still be queued on the current one: an event after them, which nccl's stream waits
// for on the GPU while backward goes on. (A codec's all-reduce takes no event: the device
// finishes first.)
comm::DeviceReady Reducer::Impl::record_written(Bucket& bucket, const torch::Tensor& send) {
  if (bucket.codec && !reduce_scatter) {
    torch::cuda::synchronize(send.device().index());
    return {};
  }
  if (!bucket.written) bucket.written = std::make_unique<c10::Event>(send.device().type());
  const c10::impl::VirtualGuardImpl guard(send.device().type());
  bucket.written->record(guard.getStream(send.device()));
  void* handle = torch_compat::event_handle(*bucket.written);
  if (!handle) torch::cuda::synchronize(send.device().index());  // libtorch 1.x: no handle to give
  return {handle};
}

// The average of `flat` over the ranks: all of it (through the bucket's codec between machines,
// when it has one), or under reduce_scatter this rank's slice (in place, at the rank's offset).
comm::WorkPtr Reducer::Impl::reduce(const torch::Tensor& flat, const std::shared_ptr<BucketCodec>& codec,
                                    comm::DeviceReady written) {
  const auto dtype = comm_dtype(flat.scalar_type(), "a bucket");
  if (codec && !reduce_scatter)
    return comm.allreduce(flat.data_ptr<float>(), std::size_t(flat.numel()), comm::ReduceOp::avg, as_comm_codec(codec));
  if (!reduce_scatter)
    return comm.allreduce(flat.data_ptr(), flat.data_ptr(), flat.numel(), dtype, comm::ReduceOp::avg, written);
  const std::int64_t n = flat.numel() / comm.size();
  void* mine = static_cast<char*>(flat.data_ptr()) + comm.rank() * n * flat.element_size();
  return comm.reduce_scatter(flat.data_ptr(), mine, std::size_t(n), dtype, comm::ReduceOp::avg, written);
}

// Zeros stand in for gradients that never arrived, so the peers' all-reduce completes either
// way; returns the parameters that had none.
std::vector<int> Reducer::Impl::fill_missing() {
  std::vector<int> missing;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (ready[i]) continue;
    missing.push_back(int(i));
    auto& p = params[i];
    if (!reduce_scatter) p.view.zero_();  // else: zeros when the bucket launches
    if (!reduce_scatter && options.gradient_as_bucket_view && options.find_unused_parameters)
      p.tensor.mutable_grad() = p.view;
    ready[i] = 1;
    --buckets[p.bucket].pending;
  }
  return missing;
}

// Waits for every bucket's all-reduce, decompresses, and records what it cost; the first error
// is kept for after every bucket was waited for.
void Reducer::Impl::wait_for_buckets(DdpStats& s, std::exception_ptr& error) {
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    auto& bucket = buckets[b];
    BucketStats bs;
    bs.index = int(b);
    bs.parameters = int(bucket.params.size());
    const auto& sent = bucket.wire_options.has_dtype() ? bucket.wire_options : bucket.flat_options;
    bs.bytes = std::size_t(bucket.numel) * c10::elementSize(c10::typeMetaToScalarType(sent.dtype()));
    bs.queued = bucket.queued;
    try {
      if (bucket.work) {
        bucket.work->wait();
        bs.started = bucket.work->started();
        bs.finished = bucket.work->finished();
        s.comm_seconds += bucket.work->seconds();
      }
      if (reduce_scatter)
        keep_slice(bucket);
      else if (bucket.wire.defined())
        bucket.flat.copy_(bucket.wire);
      rescale(bucket);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
    bucket.work = nullptr;
    bucket.pending = int(bucket.params.size());
    s.bytes_allreduced += bs.bytes;
    s.shared_buckets += bucket.shared ? 1 : 0;
    if (bs.started != SteadyTime{} && bs.started < last_ready) ++s.buckets_started_before_backward_end;
    s.buckets.push_back(bs);
  }
}

// Without gradient_as_bucket_view the averaged values go back into each parameter's own grad.
void Reducer::Impl::copy_out_of_buckets() {
  if (options.gradient_as_bucket_view || reduce_scatter) return;
  for (auto& p : params) {
    auto& grad = p.tensor.mutable_grad();
    if (grad.defined()) {
      grad.copy_(p.view);
    } else if (options.find_unused_parameters) {
      grad = p.view.clone();
    }
  }
}

ConfigError Reducer::Impl::unused_parameters_error(const std::vector<int>& missing) const {
  std::ostringstream m;
  m << "DistributedDataParallel: on rank " << comm.rank() << ", " << missing.size()
    << " parameter(s) received no gradient in this backward pass: ";
  for (std::size_t k = 0; k < missing.size() && k < 5; ++k) {
    auto& p = params[missing[k]];
    m << (k ? ", " : "") << "'" << p.name << "' " << p.tensor.sizes();
  }
  if (missing.size() > 5) m << " and " << missing.size() - 5 << " more";
  m << ". Every trainable parameter must contribute to the loss of every synchronised step. If some "
       "are used only on some steps, pass find_unused_parameters = true; if they are never used, "
       "freeze them (requires_grad(false)) or remove them.";
  return ConfigError(m.str());
}

void Reducer::Impl::finish_backward() {
  std::lock_guard<std::mutex> lock(mu);
  const auto callback_begin = Clock::now();
  torch::NoGradGuard no_grad;
  const std::vector<int> missing = fill_missing();
  launch_ready();

  std::exception_ptr error;
  DdpStats s;
  s.step = stats.step + 1;
  s.bucket_count = int(buckets.size());
  s.backward_begin = backward_begin;
  s.backward_end = last_ready;
  s.backward_seconds = seconds_between(backward_begin, last_ready);
  wait_for_buckets(s, error);
  copy_out_of_buckets();
  s.reduced = Clock::now();
  s.exposed_comm_seconds = seconds_between(callback_begin, s.reduced);
  stats = std::move(s);
  std::fill(ready.begin(), ready.end(), 0);
  next_launch = 0;
  armed = false;
  callback_queued = false;
  backward_seen = false;
  if (error) {
    broken = true;
    std::rethrow_exception(error);
  }
  if (!missing.empty() && !options.find_unused_parameters) throw unused_parameters_error(missing);
}

Reducer::Reducer(std::shared_ptr<torch::nn::Module> module, comm::Communicator& comm, DdpOptions options,
                 std::optional<BucketSharding> sharding)
    : impl_(std::make_shared<Impl>(std::move(module), comm, std::move(options), sharding)) {
  if (sharding && sharding->slices != comm.size())
    throw ConfigError("DistributedDataParallel: a bucket sharding needs as many slices as ranks (" +
                      std::to_string(sharding->slices) + " for " + std::to_string(comm.size()) +
                      "): build it with zero_bucket_sharding(zero, comm.size())");
  if (impl_->options.bucket_cap_mb <= 0 || impl_->options.first_bucket_cap_mb <= 0) {
    throw ConfigError("DistributedDataParallel: bucket caps must be positive (bucket_cap_mb = " +
                      std::to_string(impl_->options.bucket_cap_mb) +
                      ", first_bucket_cap_mb = " + std::to_string(impl_->options.first_bucket_cap_mb) + ")");
  }
  const auto hook = impl_->options.comm_hook;
  if (impl_->reduce_scatter && (hook == CommHook::powersgd || hook == CommHook::int8 || hook == CommHook::automatic))
    throw ConfigError(std::string("the ") + comm_hook_name(hook) +
                      " comm hook compresses all-reduced buckets, and ZeRO stage 2 reduce-scatters them: use "
                      "ZeRO stage 1, or the bf16 hook");
  impl_->check_and_broadcast();
  impl_->install_hooks();
  std::vector<int> reverse;
  for (int i = int(impl_->params.size()) - 1; i >= 0; --i) reverse.push_back(i);
  impl_->build_buckets(reverse);
  for (auto& b : impl_->buckets) b.pending = int(b.params.size());
}

Reducer::~Reducer() {
  for (auto& p : impl_->params) {
    if (p.accumulator) p.accumulator->del_post_hook(p.hook_key);
  }
}

void Reducer::before_forward() {
  auto& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.broken) {
    throw Error(
        "DistributedDataParallel: an earlier backward pass failed while reducing, so the ranks "
        "may no longer agree; stop this worker and restart the job (lockstep run "
        "--max-restarts resumes from the last checkpoint)");
  }
  if (s.armed && s.callback_queued) {
    // The last backward began reducing but never reached its end-of-backward callback (it
    // threw), so some buckets may be in flight on some ranks only.
    throw Error(
        "DistributedDataParallel: the previous backward pass stopped midway; the ranks may no "
        "longer agree. Stop this worker and restart the job");
  }
  bool training = s.module->is_training() && torch::GradMode::is_enabled();
  if (training && s.stats.step > 0 && !s.rebuilt && !s.sharding) s.rebuild_from_arrival();
  if (training && s.options.broadcast_buffers && s.comm.size() > 1) {
    auto buffers = s.module->buffers();
    if (!buffers.empty()) broadcast_flat(s.comm, buffers, "a buffer");
  }
  s.armed = s.sync && torch::GradMode::is_enabled() && !s.params.empty();
  s.backward_seen = false;
  std::fill(s.ready.begin(), s.ready.end(), 0);
  for (auto& b : s.buckets) b.pending = int(b.params.size());
  s.next_launch = 0;
}

void Reducer::after_forward(const torch::Tensor* output) {
  if (!impl_->armed || !output || !output->requires_grad()) return;
  // The output's gradient is the first thing backward computes: it marks backward's start, in
  // the graph task of the backward the caller started.
  output->register_hook([weak = std::weak_ptr<Impl>(impl_)](const torch::Tensor&) {
    if (auto p = weak.lock()) {
      std::lock_guard<std::mutex> lock(p->mu);
      if (!p->armed) return;
      if (!p->backward_seen) p->backward_seen = true, p->backward_begin = Clock::now();
      p->queue_end_of_backward();
    }
  });
}

void Reducer::set_sync(bool enabled) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->sync = enabled;
}

bool Reducer::sync() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->sync;
}

void Reducer::set_caller_finishes(bool enabled) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->caller_finishes = enabled;
}

void Reducer::finish() {
  if (impl_->armed) impl_->finish_backward();
}

const DdpStats& Reducer::stats() const {
  return impl_->stats;
}
const DdpOptions& Reducer::options() const {
  return impl_->options;
}
void Reducer::set_on_launched(std::function<void(int)> callback) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->on_launched = std::move(callback);
}

bool Reducer::in_backward() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->armed && impl_->backward_seen;
}

const std::optional<BucketSharding>& Reducer::sharding() const {
  return impl_->sharding;
}
double Reducer::bucket_cap_mb() const {
  return impl_->bucket_cap_mb();
}
double Reducer::first_bucket_cap_mb() const {
  return std::min(impl_->options.first_bucket_cap_mb, impl_->bucket_cap_mb());
}

void Reducer::set_contributors(int ranks) {
  if (ranks < 1 || ranks > impl_->comm.size())
    throw ConfigError("DistributedDataParallel: set_contributors(" + std::to_string(ranks) +
                      ") must be between 1 and the world size, " + std::to_string(impl_->comm.size()));
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->contributors = ranks;
}

void Reducer::reduce_zeros() {
  impl_->mark_ready_with_zeros();
  impl_->finish_backward();
}

std::vector<std::vector<std::string>> Reducer::bucket_layout() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<std::vector<std::string>> out;
  for (auto& b : impl_->buckets) {
    out.emplace_back();
    for (int i : b.params) out.back().push_back(impl_->params[i].name);
  }
  return out;
}

std::vector<Reducer::FlatBucket> Reducer::flat_buckets() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<FlatBucket> out;
  for (auto& b : impl_->buckets) {
    FlatBucket f;
    f.numel = b.numel;
    for (int i : b.params) {
      f.params.push_back(impl_->params[i].tensor);
      f.offsets.push_back(impl_->params[i].offset);
    }
    out.push_back(std::move(f));
  }
  return out;
}

std::size_t Reducer::bucket_slot_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::size_t total = 0;
  for (const auto& s : impl_->slots) total += s.bytes;
  return total;
}

torch::Tensor Reducer::gradient_slice(int b) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto& bucket = impl_->buckets.at(std::size_t(b));
  if (!bucket.slice_written) {  // no backward yet: zeros, as a backward without gradients leaves
    torch::NoGradGuard no_grad;
    bucket.slice.zero_();
    bucket.slice_written = true;
  }
  return bucket.slice;
}

torch::Tensor Reducer::averaged_range(int b, std::int64_t offset, std::int64_t length) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->reduce_scatter) throw ConfigError("Reducer::averaged_range: a reduce-scattered bucket keeps only its slice");
  return impl_->buckets.at(std::size_t(b)).flat.narrow(0, offset, length);
}

}  // namespace lockstep
