// ProcessGroupLockstep: creation, the issue path, and the collectives that reduce or broadcast
// one buffer (the gathers, scatters and all-to-all are in process_group_gather.cc).
#include "process_group.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "lockstep/base/log.h"
#include "tensor_wire.h"

namespace lockstep::torch_backend {
const at::Tensor& single(const std::vector<at::Tensor>& tensors, const char* collective) {
  if (tensors.size() != 1)
    throw std::runtime_error(std::string("lockstep: ") + collective + " takes one tensor per call, got " +
                             std::to_string(tensors.size()) + " (the *_multigpu forms are not supported)");
  return tensors[0];
}

std::vector<comm::WorkPtr> one(comm::WorkPtr w) {
  return {std::move(w)};
}

namespace {

// The deleter of storages moved into shared memory: drops the reference to the allocation.
void release_shared(void* context) {
  delete static_cast<std::shared_ptr<void>*>(context);
}

constexpr std::size_t kSeenStorages = 64;

}  // namespace

ProcessGroupLockstep::ProcessGroupLockstep(const Settings& settings, const GroupPlace& place,
                                           std::unique_ptr<GroupStore> store)
    : CollectiveBase(place.rank, place.size),
      group_id_(place.group_id),
      timeout_(place.timeout),
      store_(std::move(store)),
      comm_(create_communicator(settings, place, *store_)),
      completer_(std::make_unique<CompletionPool>()),
      p2p_completer_(std::make_unique<CompletionPool>()) {
  init();
  sharing_ = size_ > 1 && comm_->backend_name() == "shm";
  cpu_deleter_ = at::empty({1}, at::kByte).storage().data_ptr().get_deleter();
  seen_.assign(kSeenStorages, nullptr);
  LOCKSTEP_LOG(debug, comm) << "torch group '" << group_id_ << "': rank " << rank_ << " of " << size_ << " on "
                            << comm_->backend_name();
}

// Completes what was issued (the peers expect this rank's part of it), then closes the
// communicator and the store. Without the GIL: completing may run Python callbacks.
ProcessGroupLockstep::~ProcessGroupLockstep() {
  without_gil([this] {
    completer_.reset();
    p2p_completer_.reset();
    comm_.reset();
    store_.reset();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::launch(
    c10d::OpType type, const std::function<std::vector<comm::WorkPtr>(comm::Communicator&)>& issue,
    LockstepWork::Finish finish, std::vector<at::Tensor> outputs, std::vector<at::Tensor> inputs) {
  std::lock_guard<std::mutex> lock(issue_mu_);
  if (inputs.empty()) inputs = outputs;
  auto work = c10::make_intrusive<LockstepWork>(rank_, type, issue(*comm_), std::move(finish), std::move(outputs),
                                                inputs);
  completer_->push(work);
  return work;
}

void ProcessGroupLockstep::check_root(std::int64_t root, const char* collective) const {
  if (root < 0 || root >= size_)
    throw std::runtime_error(std::string("lockstep: ") + collective + " from rank " + std::to_string(root) +
                             ", which is not a rank of this " + std::to_string(size_) + "-rank group");
}

bool ProcessGroupLockstep::share_for_allreduce(const at::Tensor& t, std::size_t bytes) {
  // What decides whether to ask must be the same on every rank: the backend, the size, the
  // dtype (the caller's), and the agreements so far.
  if (size_ == 1 || bytes < kShareBytes) return false;
  const c10::Storage& storage = t.storage();
  const bool contiguous = t.is_contiguous();
  if (contiguous && storage.data_ptr().get_deleter() == &release_shared) return true;  // moved before
  if (!sharing_) return false;
  const void* memory = storage.data();
  const bool whole = contiguous && t.storage_offset() == 0 && storage.nbytes() == bytes &&
                     storage.data_ptr().get_deleter() == cpu_deleter_;
  const bool seen = whole && std::find(seen_.begin(), seen_.end(), memory) != seen_.end();
  if (whole && !seen) {
    seen_[seen_next_] = memory;
    seen_next_ = (seen_next_ + 1) % seen_.size();
  }
  std::int32_t everyone = seen ? 1 : 0;
  comm::WorkPtr agree;
  {
    std::lock_guard<std::mutex> lock(issue_mu_);
    agree = comm_->allreduce(&everyone, 1, comm::DType::i32, comm::ReduceOp::min);
  }
  agree->wait();
  if (everyone == 0) {
    if (++refusals_ >= kMaxRefusals) sharing_ = false;
    return false;
  }
  refusals_ = 0;
  std::shared_ptr<void> shared = comm_->allocate_shared(bytes);  // collective; all or none get memory
  if (!shared) {
    sharing_ = false;  // /dev/shm too small somewhere: the same answer on every rank
    return false;
  }
  std::memcpy(shared.get(), memory, bytes);
  void* data = shared.get();
  storage.unsafeGetStorageImpl()->set_data_ptr_noswap(
      c10::DataPtr(data, new std::shared_ptr<void>(std::move(shared)), &release_shared, storage.device()));
  LOCKSTEP_LOG(debug, comm) << "torch group '" << group_id_ << "': a tensor of " << bytes
                            << " bytes all-reduced again now lives in shared memory";
  return true;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::allreduce(std::vector<at::Tensor>& tensors,
                                                               const c10d::AllreduceOptions& opts) {
  const at::Tensor t = single(tensors, "all_reduce");
  const WireSpec spec = reduce_spec(t, opts.reduceOp, "all_reduce");
  const comm::ReduceOp op = comm_op(opts.reduceOp, "all_reduce");
  // In shared memory on every rank (or on none): in place. Otherwise a tensor that is in shared
  // memory here must not be passed as such (the peers pass private memory): a copy goes.
  const bool shared = spec.kind == WireKind::native && share_for_allreduce(t, spec.count * t.element_size());
  const bool shared_here = t.is_contiguous() && t.storage().data_ptr().get_deleter() == &release_shared;
  const Wire wire = shared || !shared_here ? wire_of(t, spec) : Wire{t.reshape({-1}).clone(), true};
  return launch(
      c10d::OpType::ALLREDUCE,
      [&](comm::Communicator& c) { return one(c.allreduce(wire.buffer.data_ptr(), spec.count, spec.dtype, op)); },
      [wire, spec, t] {
        if (wire.copied) unpack(wire.buffer, spec, t);
      },
      {t});
}

// One allreduce of every tensor packed back to back (they share a dtype: torch checks).
c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  std::vector<WireSpec> specs;
  std::int64_t total = 0;
  for (const auto& t : tensors) {
    specs.push_back(reduce_spec(t, opts.reduceOp, "all_reduce_coalesced"));
    if (specs.back().dtype != specs.front().dtype)
      throw std::runtime_error("lockstep: all_reduce_coalesced needs tensors of one dtype, got " +
                               std::string(c10::toString(tensors.front().scalar_type())) + " and " +
                               std::string(c10::toString(t.scalar_type())));
    total += specs.back().count;
  }
  if (tensors.empty()) return launch(c10d::OpType::ALLREDUCE_COALESCED, [](comm::Communicator&) {
    return std::vector<comm::WorkPtr>{};
  }, nullptr, {});
  const comm::ReduceOp op = comm_op(opts.reduceOp, "all_reduce_coalesced");
  at::Tensor flat = at::empty({total}, at::TensorOptions().dtype(specs.front().scalar));
  std::vector<at::Tensor> blocks;
  std::int64_t offset = 0;
  for (std::size_t i = 0; i < tensors.size(); offset += specs[i].count, ++i) {
    blocks.push_back(flat.narrow(0, offset, specs[i].count));
    pack(tensors[i], specs[i], blocks.back());
  }
  return launch(
      c10d::OpType::ALLREDUCE_COALESCED,
      [&](comm::Communicator& c) {
        return one(c.allreduce(flat.data_ptr(), static_cast<std::size_t>(total), specs.front().dtype, op));
      },
      [flat, blocks, specs, tensors] {
        for (std::size_t i = 0; i < tensors.size(); ++i) unpack(blocks[i], specs[i], tensors[i]);
      },
      tensors);
}

// An allreduce whose result only the root keeps; the others reduce a copy, so their tensors
// are left as they were.
c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::reduce(std::vector<at::Tensor>& tensors,
                                                            const c10d::ReduceOptions& opts) {
  const at::Tensor t = single(tensors, "reduce");
  check_root(opts.rootRank, "reduce");
  const WireSpec spec = reduce_spec(t, opts.reduceOp, "reduce");
  const comm::ReduceOp op = comm_op(opts.reduceOp, "reduce");
  const bool root = opts.rootRank == rank_;
  Wire wire = root ? wire_of(t, spec) : Wire{empty_wire(spec, 1), true};
  if (!root) pack(t, spec, wire.buffer);
  return launch(
      c10d::OpType::REDUCE,
      [&](comm::Communicator& c) { return one(c.allreduce(wire.buffer.data_ptr(), spec.count, spec.dtype, op)); },
      [wire, spec, t, root] {
        if (root && wire.copied) unpack(wire.buffer, spec, t);
      },
      {t});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::broadcast(std::vector<at::Tensor>& tensors,
                                                               const c10d::BroadcastOptions& opts) {
  const at::Tensor t = single(tensors, "broadcast");
  check_cpu_dense(t, "broadcast");
  check_root(opts.rootRank, "broadcast");
  const bool root = opts.rootRank == rank_;
  const WireSpec spec = move_spec(t);
  const Wire wire = wire_of(t, spec, /*fill=*/root);
  const int from = static_cast<int>(opts.rootRank);
  return launch(
      c10d::OpType::BROADCAST,
      [&](comm::Communicator& c) { return one(c.broadcast(wire.buffer.data_ptr(), spec.count, spec.dtype, from)); },
      [wire, spec, t, root] {
        if (!root && wire.copied) unpack(wire.buffer, spec, t);
      },
      {t});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::barrier(const c10d::BarrierOptions& /*opts*/) {
  return launch(
      c10d::OpType::BARRIER, [](comm::Communicator& c) { return one(c.barrier()); }, nullptr, {});
}

}  // namespace lockstep::torch_backend
