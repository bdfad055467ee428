// One backward's reduction (see reducer_impl.h): the hooks that see each gradient ready, the
// buckets launched in order as they fill, and the end-of-backward wait that fills what never
// arrived, waits for every bucket, copies the averages back and records what it cost.
#include "reducer_impl.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <sstream>

#include "lockstep/base/log.h"
#include "lockstep/comm/codec.h"

namespace lockstep {

using ddp_detail::comm_dtype;
using ddp_detail::embedding_tables;
using ddp_detail::same_memory;

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

}  // namespace lockstep
