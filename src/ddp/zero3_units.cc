// ZeRO stage 3's parameter units (see zero3_units.h).
#include "zero3_units.h"

#include <ATen/native/Resize.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <sys/mman.h>

#include <algorithm>
#include <new>

#include "lockstep/ddp/comm_dtype.h"
#include "lockstep/ddp/torch_compat.h"
#include "lockstep/error.h"
#include "device_collectives.h"

namespace lockstep::ddp_detail {
namespace {

// Points the flat array's storage at `data` (`bytes` long), or at nothing. The parameters are
// views of this storage, so they follow without being touched.
void point_storage(const torch::Tensor& flat, void* data, std::size_t bytes) {
  auto* storage = flat.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(data, data, [](void*) {}, c10::Device(c10::kCPU)));
  storage->set_nbytes(bytes);
}

// Gives the flat array fresh memory from its GPU's allocator, which keeps freed blocks for reuse
// itself (the pool below is for host memory).
void take_device_memory(const torch::Tensor& flat) {
  auto fresh = torch::empty({flat.numel()}, flat.options());
  auto* storage = flat.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(
      fresh.storage().unsafeGetStorageImpl()->set_data_ptr(at::DataPtr(nullptr, flat.device())));
  storage->set_nbytes(std::size_t(flat.numel()) * flat.element_size());
}

// The identity in forward; in backward, first gathers its unit again (its backward comes next).
struct GatherBeforeBackward : torch::autograd::Node {
  explicit GatherBeforeBackward(std::function<void()> before) : before_(std::move(before)) {}
  std::string name() const override { return "lockstep::GatherBeforeBackward"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    before_();
    return {grads[0]};
  }

 private:
  std::function<void()> before_;
};

torch::Tensor gather_before_backward(const torch::Tensor& out, std::function<void()> before) {
  auto node = torch_compat::make_node<GatherBeforeBackward>(std::move(before));
  node->set_next_edges(torch::autograd::collect_next_edges(out));
  torch::Tensor result = out.detach();
  torch::autograd::set_history(result, node);
  return result;
}

}  // namespace

void free_storage(const torch::Tensor& flat) {
  auto* storage = flat.storage().unsafeGetStorageImpl();
  if (flat.is_cpu()) return at::native::resize_bytes_cpu(storage, 0);
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, flat.device()));  // the old one's deleter frees it
  storage->set_nbytes(0);
}

// Blocks of memory the units take turns in. Units come and go many times a step; through malloc
// their freed blocks stay in its heap, fragmented by everything allocated in between (the
// launcher asks glibc to keep freed memory for reuse), and the process grew by half the model
// here. The pool holds as many blocks as were ever gathered at once, no more, mapped apart (or,
// for the hybrid, in machine memory: a collective, but only while the pool grows, in the first
// steps).
void* UnitPool::take(std::size_t bytes) {
  for (std::size_t i = 0; i < free_.size(); ++i)
    if (free_[i].bytes == bytes) {
      void* p = free_[i].memory.get();
      free_.erase(free_.begin() + std::ptrdiff_t(i));
      return p;
    }
  std::shared_ptr<void> memory;
  if (comm_) {
    memory = comm_->allocate_machine_memory(bytes);
    if (!memory) throw ConfigError("ZeRO stage 3, one copy per machine: the communicator has no machine memory");
  } else {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    memory = std::shared_ptr<void>(p, [bytes](void* q) { ::munmap(q, bytes); });
  }
  all_.push_back({memory, bytes});
  return memory.get();
}

void UnitPool::give_back(void* data) {
  for (const auto& b : all_)
    if (b.memory.get() == data) return free_.push_back(b);
}

ParameterUnits::ParameterUnits(comm::Communicator& comm, std::vector<torch::Tensor> flat,
                               std::vector<torch::Tensor> shards, std::vector<int> bucket_of_unit, int root,
                               bool one_copy_per_machine)
    : comm_(comm),
      pool_(one_copy_per_machine ? &comm : nullptr),
      flat_(std::move(flat)),
      shards_(std::move(shards)),
      bucket_of_unit_(std::move(bucket_of_unit)),
      root_(root),
      gathered_(flat_.size(), 0),
      from_pool_(flat_.size(), 0),
      works_(flat_.size()) {
  for (std::size_t b = 0; b < flat_.size(); ++b)
    if (flat_[b].storage().nbytes() > 0) {
      gathered_[b] = 1;
      gathered_bytes_ += bytes_of(int(b));
    }
  release_all();
  high_water_ = 0;  // training's, not the construction's (every unit starts whole)
}

ParameterUnits::~ParameterUnits() {
  for (auto& w : works_)
    if (w) w->wait();
}

std::int64_t ParameterUnits::bytes_of(int b) const {
  return flat_[std::size_t(b)].numel() * std::int64_t(flat_[std::size_t(b)].element_size());
}

void ParameterUnits::prefetch(int b) {
  if (b < 0 || gathered_[std::size_t(b)]) return;
  const auto& flat = flat_[std::size_t(b)];
  if (flat.is_cpu()) {
    point_storage(flat, pool_.take(std::size_t(bytes_of(b))), std::size_t(bytes_of(b)));
    from_pool_[std::size_t(b)] = 1;
  } else {
    take_device_memory(flat);
  }
  gathered_[std::size_t(b)] = 1;
  gathered_bytes_ += bytes_of(b);
  high_water_ = std::max(high_water_, gathered_bytes_);
  const auto& shard = shards_[std::size_t(b)];
  if (pool_.shared()) {
    const auto dtype = *comm_dtype_of(flat.scalar_type());
    works_[std::size_t(b)] = comm_.allgather_machine(shard.data_ptr(), flat.data_ptr(), std::size_t(shard.numel()), dtype);
  } else {
    works_[std::size_t(b)] = allgather_anywhere(comm_, shard, flat);  // from a GPU to the host backends: done already
  }
}

void ParameterUnits::finish(int b) {
  if (auto& w = works_[std::size_t(b)]) {
    w->wait();
    w.reset();
  }
}

void ParameterUnits::gather(int b) {
  if (b < 0) return;
  prefetch(b);
  finish(b);
}

void ParameterUnits::release(int b) {
  if (b < 0 || !gathered_[std::size_t(b)]) return;
  finish(b);
  const auto& flat = flat_[std::size_t(b)];
  if (from_pool_[std::size_t(b)]) pool_.give_back(const_cast<void*>(static_cast<const void*>(flat.storage().data())));
  from_pool_[std::size_t(b)] = 0;
  free_storage(flat);  // its own allocation, if it still had it, is freed here
  gathered_[std::size_t(b)] = 0;
  gathered_bytes_ -= bytes_of(b);
}

void ParameterUnits::release_unit(int b) {
  if (b != root_) release(b);
}

void ParameterUnits::gather_all() {
  for (std::size_t b = 0; b < flat_.size(); ++b) prefetch(int(b));
  for (std::size_t b = 0; b < flat_.size(); ++b) finish(int(b));
}

void ParameterUnits::release_all() {
  for (std::size_t b = 0; b < flat_.size(); ++b) release(int(b));
}

void ParameterUnits::keep_gathered_values() {
  torch::NoGradGuard no_grad;
  for (std::size_t b = 0; b < flat_.size(); ++b) {
    if (!gathered_[b]) continue;
    finish(int(b));
    const auto n = shards_[b].numel();
    shards_[b].copy_(flat_[b].narrow(0, comm_.rank() * n, n));
  }
  release_all();
}

int ParameterUnits::next_in_forward(int b) const {
  auto it = std::find(forward_order_.begin(), forward_order_.end(), b);
  return it == forward_order_.end() || it + 1 == forward_order_.end() ? -1 : *(it + 1);
}

int ParameterUnits::previous_in_forward(int b) const {
  auto it = std::find(forward_order_.begin(), forward_order_.end(), b);
  return it == forward_order_.end() || it == forward_order_.begin() ? -1 : *(it - 1);
}

void ParameterUnits::before_forward() {
  if (!forward_order_.empty()) order_known_ = true;
  gather(root_);
}

torch::Tensor ParameterUnits::run(int unit, const UnitForward& forward, const torch::Tensor& input,
                                  const Reducer* reducer) {
  if (unit < 0 || std::size_t(unit) >= bucket_of_unit_.size())
    throw ConfigError("ZeRO stage 3: the model ran unit " + std::to_string(unit) + " but names " +
                      std::to_string(bucket_of_unit_.size()) + " in parameter_units()");
  const int b = bucket_of_unit_[std::size_t(unit)];
  if (b < 0) return forward(input);
  const bool in_backward = reducer && reducer->in_backward();
  const bool training = torch::GradMode::is_enabled();
  if (!order_known_ && training && !in_backward &&
      std::find(forward_order_.begin(), forward_order_.end(), b) == forward_order_.end())
    forward_order_.push_back(b);
  gather(b);
  if (order_known_ && !in_backward) prefetch(next_in_forward(b));
  torch::Tensor out = forward(input);
  if (training && out.requires_grad())
    out = gather_before_backward(out, [this, b] {
      gather(b);
      if (order_known_) prefetch(previous_in_forward(b));
    });
  if (!in_backward) release(b);
  return out;
}

}  // namespace lockstep::ddp_detail
