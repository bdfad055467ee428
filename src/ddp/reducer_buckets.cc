// Where the reducer's gradients live: which parameters share a bucket, the buckets' memory (shared
// when the communicator has it), under reduce_scatter the slots the buckets take turns in, what
// goes on the wire, and the rebuild in the first step's arrival order (see reducer_impl.h).
#include "reducer_impl.h"

#include "lockstep/base/log.h"
#include "lockstep/ddp/bucket_assignment.h"
#include "tensor_alias.h"

namespace lockstep {

using ddp_detail::alias_into;
using ddp_detail::alias_range;

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

}  // namespace lockstep
