// The reducer's face (see reducer_impl.h for its state and the files that implement it):
// construction, where the parameters are checked to match on every rank and rank 0's are
// broadcast; forward, which arms the next backward; and what callers ask of it.
#include "reducer_impl.h"

#include <algorithm>

#include "broadcast_flat.h"
#include "lockstep/comm/codec.h"
#include "signature.h"

namespace lockstep {
namespace ddp_detail {

comm::DType comm_dtype(torch::ScalarType t, const std::string& what) {
  if (const auto d = comm_dtype_of(t)) return *d;
  throw ConfigError("DistributedDataParallel: " + what + " has dtype " + dtype_name(t) +
                    ", which lockstep cannot reduce (float32/64, float16, bfloat16, int32, int64)");
}

bool same_memory(const torch::Tensor& a, const torch::Tensor& b) {
  return a.defined() && b.defined() && a.data_ptr() == b.data_ptr() && a.sizes() == b.sizes() &&
         a.strides() == b.strides();
}

std::set<const c10::TensorImpl*> embedding_tables(torch::nn::Module& module) {
  std::set<const c10::TensorImpl*> tables;
  for (auto& sub : module.modules()) {
    if (auto* e = sub->as<torch::nn::EmbeddingImpl>()) tables.insert(e->weight.unsafeGetTensorImpl());
    if (auto* e = sub->as<torch::nn::EmbeddingBagImpl>()) tables.insert(e->weight.unsafeGetTensorImpl());
  }
  return tables;
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
