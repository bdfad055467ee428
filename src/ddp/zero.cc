// ZeRO stages 1, 2 and 3 and the one-copy mode over the reducer's flat buckets (see zero.h);
// stage 3's units live in zero3_units.cc, the elastic mirrors in zero_mirrors.cc.
#include "lockstep/ddp/zero.h"

#include <torch/torch.h>

#include <malloc.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>

#include "lockstep/ddp/comm_dtype.h"
#include "lockstep/error.h"
#include "lockstep/ddp/optimizer_state.h"
#include "device_collectives.h"
#include "tensor_alias.h"
#include "zero3_units.h"
#include "zero_mirrors.h"

namespace lockstep {
namespace {

using ddp_detail::alias_into;
using ddp_detail::alias_range;
using ddp_detail::key_of;
using ddp_detail::Kind;
using ddp_detail::kind_of;
using ddp_detail::make_state;
using ddp_detail::ParamState;
using ddp_detail::read_state;
using ddp_detail::states_per_element;

// ZeRO's slices are floating point: the optimizers it divides hold no integer state.
comm::DType float_dtype_of(const torch::Tensor& t) {
  const auto d = comm_dtype_of(t.scalar_type());
  if (!d || *d == comm::DType::i32 || *d == comm::DType::i64)
    throw ConfigError("ZeRO shards floating-point parameters only (float32/64, float16, bfloat16)");
  return *d;
}

}  // namespace

BucketSharding zero_bucket_sharding(const ZeroOptions& zero, int world) {
  BucketSharding sharding;
  sharding.slices = world;
  sharding.reduce_scatter = zero.stage >= 2;
  if (zero.stage == 2) sharding.max_bucket_cap_mb = kZero2MaxBucketMb;
  return sharding;
}

BucketSharding zero_bucket_sharding(const ZeroOptions& zero, int world, torch::nn::Module& model,
                                    const std::vector<std::shared_ptr<torch::nn::Module>>& units) {
  BucketSharding sharding = zero_bucket_sharding(zero, world);
  sharding.broadcast_parameters = false;  // the optimizer broadcasts each unit as it cuts it
  std::map<const void*, int> index;  // trainable parameter -> its place in registration order
  for (const auto& p : model.parameters())
    if (p.requires_grad()) index.emplace(p.unsafeGetTensorImpl(), int(index.size()));
  std::vector<int> unit_of(index.size(), -1);
  for (std::size_t u = 0; u < units.size(); ++u)
    for (const auto& p : units[u]->parameters()) {
      auto it = index.find(p.unsafeGetTensorImpl());
      if (it == index.end()) continue;
      if (unit_of[std::size_t(it->second)] >= 0)
        throw ConfigError("ZeRO stage 3: a parameter is in units " + std::to_string(unit_of[std::size_t(it->second)]) +
                          " and " + std::to_string(u) + " of parameter_units(): give each parameter one unit");
      unit_of[std::size_t(it->second)] = int(u);
    }
  for (std::size_t u = units.size(); u-- > 0;) {
    std::vector<int> group;
    for (std::size_t i = 0; i < unit_of.size(); ++i)
      if (unit_of[i] == int(u)) group.push_back(int(i));
    sharding.buckets.push_back(group);
  }
  std::vector<int> root;
  for (std::size_t i = 0; i < unit_of.size(); ++i)
    if (unit_of[i] < 0) root.push_back(int(i));
  sharding.buckets.push_back(root);
  return sharding;
}

struct ZeroOptimizer::Impl {
  Impl(torch::nn::Module& m, Reducer& r, comm::Communicator& c, ZeroOptions o)
      : module(m), reducer(r), comm(c), options(std::move(o)), buckets(r.flat_buckets()), rank(c.rank()),
        world(c.size()) {}

  torch::nn::Module& module;
  Reducer& reducer;          // neither is used once release_communicator() ran
  comm::Communicator& comm;
  ZeroOptions options;
  std::vector<Reducer::FlatBucket> buckets;
  const int rank, world;
  std::vector<torch::Tensor> flat;    // the parameters, bucket by bucket (padded)
  std::vector<torch::Tensor> shards;  // this rank's slice of each: the optimizer's parameters
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  Kind kind = Kind::adamw;
  std::unique_ptr<ddp_detail::ZeroMirrors> mirrors;  // elastic jobs: rank options.mirror_of's slices
  UpdatePhase phase = UpdatePhase::idle;
  std::unique_ptr<ddp_detail::ParameterUnits> units;  // stage 3
  // Tensor parallelism: per bucket, the ranges of this rank's slice that hold cuts of split
  // tensors, as (start in the slice, length).
  std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> split_ranges;

  bool mirrored() const { return options.mirror_of >= 0; }
  bool stage3() const { return options.stage == 3; }
  // Shared parameters: stages 1 and 2 keep the parameters once per machine; stage 3 its gathered
  // units (the hybrid, zero3_units.h).
  bool one_copy() const { return options.shared_parameters && !stage3(); }
  void make_units();
  std::int64_t slice_length(std::size_t b) const { return buckets[b].numel / world; }
  std::int64_t offset_of(int owner, std::size_t b) const { return owner * slice_length(b); }
  std::int64_t my_offset(std::size_t b) const { return offset_of(rank, b); }
  void check_reducer() const;
  void check_device() const;
  void check_one_machine() const;
  void allocate_flat();
  void move_parameters_in();
  void make_mirrors(const Factory& make);
  void find_split_ranges();
  std::pair<double, double> split_and_whole_squares() const;
  void apply_update();
  void gather_parameters();
  ParamState shard_state(std::size_t b) const;
  ParamState state_of(const torch::optim::Optimizer& o, const torch::Tensor& slice) const;
  HeldShard held(int owner, const std::vector<torch::Tensor>& slices, const torch::optim::Optimizer& o) const;
};

// On a GPU each rank keeps its own slices and gathers into its own memory: what is shared
// between ranks, or sent to a mirror, lives in host memory.
void ZeroOptimizer::Impl::check_device() const {
  const auto params = module.parameters();
  if (params.empty() || params.front().is_cpu()) return;
  const std::string device = params.front().device().str();
  if (options.shared_parameters)
    throw ConfigError("ZeRO with one copy of the parameters per machine (--zero-shared-parameters) keeps it in host "
                      "memory the workers map, and the model is on " + device +
                      ": leave out --zero-shared-parameters on a GPU (each worker keeps its slices there)");
  if (mirrored())
    throw ConfigError("ZeRO in an elastic job mirrors each rank's slices in host memory, and the model is on " +
                      device + ": run elastic jobs with ZeRO on the CPU, or with DDP (--zero-stage 0) on the GPU");
}

void ZeroOptimizer::Impl::check_reducer() const {
  if (options.stage < 1 || options.stage > 3)
    throw ConfigError("ZeRO stage " + std::to_string(options.stage) + " is not one lockstep has: use 1, 2 or 3");
  const auto& sharding = reducer.sharding();
  if (!sharding || sharding->slices != comm.size() || sharding->reduce_scatter != (options.stage >= 2) ||
      (stage3() && sharding->buckets.empty()))
    throw ConfigError(stage3() ? "ZeroOptimizer: build its Reducer with zero_bucket_sharding(zero, comm.size(), model, "
                                 "units) for stage 3"
                               : "ZeroOptimizer: build its Reducer with zero_bucket_sharding(zero, comm.size())");
  for (const auto& b : buckets) float_dtype_of(b.params.front());
  if (one_copy()) check_one_machine();
  if (stage3() && mirrored())
    throw ConfigError("ZeRO stage 3 in elastic jobs (mirrored slices) is not built yet: use stage 2 there");
  if (!mirrored()) return;
  if (options.shared_parameters)
    throw ConfigError("ZeRO mirrors (elastic jobs) keep private slices: they do not combine with shared parameters");
  const auto valid = [&](int r) { return r >= 0 && r < world && r != rank; };
  if (!valid(options.mirror_of) || !valid(options.mirrored_by))
    throw ConfigError("ZeRO mirrors: mirror_of " + std::to_string(options.mirror_of) + " and mirrored_by " +
                      std::to_string(options.mirrored_by) + " must be other ranks of the " + std::to_string(world));
}

// Stages 1 and 2 keep one copy for the whole job: every rank updates its slices in place, so all
// of them must map the same block (stage 3 gathers into one block per machine instead).
void ZeroOptimizer::Impl::check_one_machine() const {
  const auto& machine_of = comm.machine_of();
  const bool one_machine =
      comm.size() == 1 || (!machine_of.empty() && std::all_of(machine_of.begin(), machine_of.end(),
                                                              [](int m) { return m == 0; }));
  if (!comm.has_machine_memory() || !one_machine)
    throw ConfigError("ZeRO stage " + std::to_string(options.stage) + " with one copy of the parameters "
                      "(--zero-shared-parameters) keeps them in memory every worker maps, which needs all " +
                      std::to_string(comm.size()) + " workers on one machine and the shm backend (this is " +
                      comm.backend_name() + (one_machine ? "" : " across machines") +
                      "): use --backend shm on one machine, or across machines --zero-stage 3 with "
                      "--zero-shared-parameters on --backend hier (the same number of workers on each)");
}

// Memory the peers read in place when the communicator has it (the all-gather then copies once),
// or (one copy) one block every rank of the machine maps.
void ZeroOptimizer::Impl::allocate_flat() {
  if (stage3()) {  // memory of its own, freed and allocated again as the unit comes and goes;
    // move_parameters_in allocates each when it fills it (see there)
    flat.resize(buckets.size());
    return;
  }
  if (!options.shared_parameters) {
    for (auto& b : buckets) {
      auto opts = b.params.front().options().requires_grad(false);
      const std::size_t bytes = std::size_t(b.numel) * b.params.front().element_size();
      std::shared_ptr<void> memory = opts.device().is_cpu() ? comm.allocate_shared(bytes) : nullptr;
      flat.push_back(memory ? torch::from_blob(memory.get(), {b.numel}, [memory](void*) {}, opts).zero_()
                            : torch::zeros({b.numel}, opts));
    }
    return;
  }
  std::vector<std::size_t> at;
  std::size_t total = 0;
  for (auto& b : buckets) {
    at.push_back(total);
    total += (std::size_t(b.numel) * b.params.front().element_size() + 63) / 64 * 64;
  }
  std::shared_ptr<void> block = comm.allocate_machine_memory(total);
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    auto opts = buckets[b].params.front().options().requires_grad(false);
    if (!opts.device().is_cpu()) throw ConfigError("ZeRO shared parameters live in host memory: use CPU tensors");
    flat.push_back(torch::from_blob(
        static_cast<char*>(block.get()) + at[b], {buckets[b].numel}, [block](void*) {}, opts));
  }
}

// The parameters become aliases of the flat arrays, keeping their values.
void ZeroOptimizer::Impl::move_parameters_in() {
  torch::NoGradGuard no_grad;
  const bool writer = !one_copy() || comm.rank() == 0;  // one copy: rank 0 fills it
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    // Stage 3: one bucket's memory at a time. Allocated together, each would be touched as it is
    // filled and, once freed, stay in malloc's heap (which keeps freed memory: see the end of the constructor):
    // the model twice over. Allocated here, each reuses the block the bucket before gave back.
    if (stage3()) flat[b] = torch::empty({buckets[b].numel}, buckets[b].params.front().options().requires_grad(false));
    for (std::size_t k = 0; k < buckets[b].params.size(); ++k) {
      auto& p = buckets[b].params[k];
      auto alias = alias_into(flat[b], buckets[b].offsets[k], p);
      if (writer) alias.copy_(p);
      p.set_data(alias);
    }
    // Stage 3: the slice is kept apart, and the bucket's memory goes back before the next bucket
    // takes its own.
    if (stage3()) {
      flat[b].narrow(0, buckets[b].offsets.back() + buckets[b].params.back().numel(),
                     buckets[b].numel - buckets[b].offsets.back() - buckets[b].params.back().numel())
          .zero_();  // the padding
      // Rank 0's values, one unit at a time (the reducer left this to us: broadcast whole, the
      // model would exist twice for a moment).
      if (comm.size() > 1) ddp_detail::finish(ddp_detail::broadcast_anywhere(comm, flat[b], 0));
      shards.push_back(flat[b].narrow(0, my_offset(b), slice_length(b)).clone());
      ddp_detail::free_storage(flat[b]);
      ::malloc_trim(0);  // the bucket's parameters, freed as they moved in, go back now: see below
    } else {
      shards.push_back(alias_range(flat[b], my_offset(b), slice_length(b)));
    }
    shards.back().set_requires_grad(true);
  }
  if (one_copy()) comm.barrier()->wait();
}

// Stage 3: which bucket each of the model's units is (the sharding lists them last unit first,
// then the root), and the units' memory freed.
void ZeroOptimizer::Impl::make_units() {
  if (!stage3()) return;
  const int count = int(reducer.sharding()->buckets.size()) - 1;  // the model's units; the last is the root
  std::map<const void*, int> bucket_of_param;
  for (std::size_t b = 0; b < buckets.size(); ++b)
    for (const auto& p : buckets[b].params) bucket_of_param[p.unsafeGetTensorImpl()] = int(b);
  auto bucket_of_group = [&](const std::vector<int>& group) {
    if (group.empty()) return -1;
    std::vector<torch::Tensor> trainable;
    for (const auto& p : module.parameters())
      if (p.requires_grad()) trainable.push_back(p);
    return bucket_of_param.at(trainable.at(std::size_t(group.front())).unsafeGetTensorImpl());
  };
  const auto& groups = reducer.sharding()->buckets;
  std::vector<int> bucket_of_unit(std::size_t(std::max(0, count)));
  for (int u = 0; u < count; ++u) bucket_of_unit[std::size_t(u)] = bucket_of_group(groups[std::size_t(count - 1 - u)]);
  if (options.shared_parameters && !comm.has_machine_memory())
    throw ConfigError("ZeRO stage 3 with one copy per machine (--zero-shared-parameters) gathers each unit into "
                      "memory the ranks of a machine share, which the " + comm.backend_name() +
                      " backend does not have: use the shm backend on one machine or hier across machines (the "
                      "same number of workers on each), or leave out --zero-shared-parameters");
  units = std::make_unique<ddp_detail::ParameterUnits>(comm, flat, shards, bucket_of_unit,
                                                       bucket_of_group(groups.back()), options.shared_parameters);
  reducer.set_on_launched([u = units.get()](int b) { u->release(b); });
}

void ZeroOptimizer::Impl::gather_parameters() {
  std::vector<comm::WorkPtr> works;
  for (std::size_t b = 0; b < buckets.size(); ++b)
    works.push_back(ddp_detail::allgather_anywhere(comm, shards[b], flat[b]));
  for (auto& w : works) ddp_detail::finish(w);
}

// This rank's state for bucket b's slice (empty before the optimizer's first step).
ParamState ZeroOptimizer::Impl::shard_state(std::size_t b) const {
  return state_of(*optimizer, shards[b]);
}

ParamState ZeroOptimizer::Impl::state_of(const torch::optim::Optimizer& o, const torch::Tensor& slice) const {
  auto& states = const_cast<torch::optim::Optimizer&>(o).state();
  auto it = states.find(key_of(slice));
  return it == states.end() ? ParamState{} : read_state(kind, *it->second);
}

void ZeroOptimizer::Impl::make_mirrors(const Factory& make) {
  if (!mirrored()) return;
  std::vector<std::int64_t> offsets, lengths;
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    offsets.push_back(offset_of(options.mirror_of, b));
    lengths.push_back(slice_length(b));
  }
  mirrors = std::make_unique<ddp_detail::ZeroMirrors>(options, flat, offsets, lengths, make);
}

void ZeroOptimizer::Impl::find_split_ranges() {
  if (!options.tensor_group) return;
  std::set<const void*> split;
  for (const auto& p : options.split_parameters) split.insert(p.unsafeGetTensorImpl());
  split_ranges.resize(buckets.size());
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    const std::int64_t lo = my_offset(b), hi = lo + slice_length(b);
    for (std::size_t k = 0; k < buckets[b].params.size(); ++k) {
      if (!split.count(buckets[b].params[k].unsafeGetTensorImpl())) continue;
      const std::int64_t p_lo = buckets[b].offsets[k], p_hi = p_lo + buckets[b].params[k].numel();
      const std::int64_t from = std::max(lo, p_lo), to = std::min(hi, p_hi);
      if (from < to) split_ranges[b].emplace_back(from - lo, to - from);
    }
  }
}

// The squares of this rank's slices' gradients: those of cuts of split tensors, and the rest,
// each added up from its own ranges (the rest are the same on every tensor rank, and so is
// their sum: never a difference of two sums that hold cuts).
std::pair<double, double> ZeroOptimizer::Impl::split_and_whole_squares() const {
  std::vector<torch::Tensor> split, whole;
  for (std::size_t b = 0; b < shards.size(); ++b) {
    const auto g = reducer.gradient_slice(int(b)).to(torch::kDouble);
    std::int64_t at = 0;
    auto add = [&](std::vector<torch::Tensor>& to, std::int64_t from, std::int64_t length) {
      if (length > 0) to.push_back(g.narrow(0, from, length).pow(2).sum());
    };
    for (const auto& [start, length] : split_ranges[b]) {
      add(whole, at, start - at);
      add(split, start, length);
      at = start + length;
    }
    add(whole, at, g.numel() - at);
  }
  auto total = [](const std::vector<torch::Tensor>& sums) {
    return sums.empty() ? 0.0 : torch::stack(sums).sum().item<double>();
  };
  return {total(split), total(whole)};
}

void ZeroOptimizer::Impl::apply_update() {
  optimizer->step();
  if (mirrors) mirrors->step(*optimizer);
  phase = UpdatePhase::applied;
  if (options.on_phase) options.on_phase(phase);
}

ZeroOptimizer::ZeroOptimizer(torch::nn::Module& module, Reducer& reducer, comm::Communicator& comm,
                             ZeroOptions options, Factory make)
    : impl_(std::make_unique<Impl>(module, reducer, comm, options)) {
  impl_->check_reducer();
  impl_->check_device();
  impl_->allocate_flat();
  impl_->move_parameters_in();
  impl_->optimizer = make(impl_->shards);
  impl_->kind = kind_of(*impl_->optimizer);
  impl_->make_mirrors(make);
  impl_->make_units();
  impl_->find_split_ranges();
  // The model's own storage, freed by the cut above, would stay in malloc's heap: lockstep run
  // asks glibc to keep freed memory for reuse (launch/worker_env.h), which is what a training
  // step wants but not what a model cut into slices (stage 3) or moved into buckets wants. Give
  // it back to the system now.
  ::malloc_trim(0);
}

ZeroOptimizer::~ZeroOptimizer() = default;

torch::optim::Optimizer& ZeroOptimizer::shard_optimizer() {
  return *impl_->optimizer;
}

// Under tensor parallelism the whole parameters' squares are summed over the data ranks alone (every
// tensor rank holds the same), the cuts' over the tensor group too.
double ZeroOptimizer::clip_grad_norm(double max_norm) {
  auto& s = *impl_;
  if (s.mirrors) s.mirrors->take_gradients(s.reducer, s.comm);
  double squares = 0;
  if (s.options.tensor_group) {
    const auto [split, whole] = s.split_and_whole_squares();
    double sums[2] = {split, whole};
    s.comm.allreduce(sums, 2, comm::DType::f64, comm::ReduceOp::sum)->wait();
    s.options.tensor_group->allreduce(sums, 1, comm::DType::f64, comm::ReduceOp::sum)->wait();
    squares = sums[0] + sums[1];
  } else {
    for (std::size_t b = 0; b < s.shards.size(); ++b) {
      const auto g = s.reducer.gradient_slice(int(b));
      squares += g.to(torch::kDouble).pow(2).sum().item<double>();
    }
    s.comm.allreduce(&squares, 1, comm::DType::f64, comm::ReduceOp::sum)->wait();
  }
  const double norm = std::sqrt(squares);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1) {
    torch::NoGradGuard no_grad;
    for (std::size_t b = 0; b < s.shards.size(); ++b) s.reducer.gradient_slice(int(b)).mul_(coef);
    if (s.mirrors) s.mirrors->scale_gradients(coef);
  }
  return norm;
}

bool ZeroOptimizer::unscale_gradients(double factor) {
  auto& s = *impl_;
  if (s.mirrors) s.mirrors->take_gradients(s.reducer, s.comm);
  torch::NoGradGuard no_grad;
  std::int32_t overflowed = 0;  // the slices partition every bucket: together the ranks see each gradient once
  for (std::size_t b = 0; b < s.shards.size(); ++b) {
    auto g = s.reducer.gradient_slice(int(b));
    g.mul_(factor);
    if (!torch::isfinite(g).all().item<bool>()) overflowed = 1;
  }
  if (s.mirrors) s.mirrors->scale_gradients(factor);  // the owner checks the mirrored values
  s.comm.allreduce(&overflowed, 1, comm::DType::i32, comm::ReduceOp::max)->wait();
  if (s.options.tensor_group)  // a cut may overflow where the others do not: every rank skips alike
    s.options.tensor_group->allreduce(&overflowed, 1, comm::DType::i32, comm::ReduceOp::max)->wait();
  return overflowed == 0;
}

void ZeroOptimizer::step() {
  auto& s = *impl_;
  if (s.one_copy()) s.comm.barrier()->wait();  // nobody still reads parameters
  for (std::size_t b = 0; b < s.shards.size(); ++b) s.shards[b].mutable_grad() = s.reducer.gradient_slice(int(b));
  if (s.mirrors) {  // update only once every rank holds its gradients (see "Mirrors" in zero.h)
    s.mirrors->take_gradients(s.reducer, s.comm);
    s.phase = UpdatePhase::ready;
    if (s.options.on_phase) s.options.on_phase(s.phase);
    std::int32_t ready = 1;
    s.comm.allreduce(&ready, 1, comm::DType::i32, comm::ReduceOp::sum)->wait();
  }
  s.apply_update();
  if (s.stage3()) {
    s.units->release_all();  // the next forward gathers the updated slices
    // Memory is why one runs stage 3: what the step allocated and freed goes back to the system
    // rather than waiting in malloc's heap (lockstep run has glibc keep it). On the GPT this cut
    // each worker's memory between steps by a fifth at no measurable cost in step time.
    ::malloc_trim(0);
  } else if (s.one_copy()) {
    s.comm.barrier()->wait();  // nobody reads a slice its owner still writes
  } else {
    s.gather_parameters();
    if (s.mirrors) s.mirrors->copy_from(s.flat);  // the owner's values, bit for bit
  }
  s.phase = UpdatePhase::idle;
}

void ZeroOptimizer::skip_step() {
  auto& s = *impl_;
  if (s.mirrors) s.mirrors->drop_gradients();
  if (s.stage3()) s.units->release_all();  // as after an update: the next forward gathers the units
  zero_grad();
  s.phase = UpdatePhase::idle;
}

void ZeroOptimizer::zero_grad() {
  torch::NoGradGuard no_grad;
  for (auto& p : impl_->module.parameters())
    if (p.grad().defined()) p.mutable_grad().zero_();
}

void ZeroOptimizer::release_communicator() {
  auto& s = *impl_;
  if (s.phase != UpdatePhase::ready) return;
  for (auto& shard : s.shards) shard.mutable_grad() = shard.grad().clone();
  if (s.mirrors) s.mirrors->keep_gradients();
}

UpdatePhase ZeroOptimizer::phase() const {
  return impl_->phase;
}

void ZeroOptimizer::finish_update() {
  if (impl_->phase != UpdatePhase::ready) throw ConfigError("ZeroOptimizer::finish_update: no update is ready");
  impl_->apply_update();
}

int ZeroOptimizer::world() const {
  return impl_->world;
}

std::int64_t ZeroOptimizer::optimizer_steps() const {
  return impl_->shards.empty() ? 0 : impl_->shard_state(0).step;
}

// `owner`'s slices as ranges of the module's trainable parameters laid end to end.
HeldShard ZeroOptimizer::Impl::held(int owner, const std::vector<torch::Tensor>& slices,
                                    const torch::optim::Optimizer& o) const {
  std::map<torch_compat::StateKey, std::int64_t> start;  // each parameter's place, end to end
  std::int64_t at = 0;
  for (const auto& p : module.parameters())
    if (p.requires_grad()) {
      start[key_of(p)] = at;
      at += p.numel();
    }
  HeldShard out{owner, {}};
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    const std::int64_t lo = offset_of(owner, b), hi = lo + slice_length(b);
    const ParamState st = state_of(o, slices[b]);
    for (std::size_t k = 0; k < buckets[b].params.size(); ++k) {
      const std::int64_t p_lo = buckets[b].offsets[k], p_hi = p_lo + buckets[b].params[k].numel();
      const std::int64_t from = std::max(lo, p_lo), to = std::min(hi, p_hi);
      if (from >= to) continue;
      HeldRange r;
      r.begin = start.at(key_of(buckets[b].params[k])) + (from - p_lo);
      r.values = slices[b].detach().narrow(0, from - lo, to - from);
      for (const auto& [name, t] : st.tensors) r.state[name] = t.narrow(0, from - lo, to - from);
      out.ranges.push_back(std::move(r));
    }
  }
  return out;
}

std::vector<HeldShard> ZeroOptimizer::holdings() const {
  auto& s = *impl_;
  std::vector<HeldShard> out{s.held(s.rank, s.shards, *s.optimizer)};
  if (s.mirrors) out.push_back(s.held(s.mirrors->owner(), s.mirrors->slices(), s.mirrors->optimizer()));
  return out;
}

std::unique_ptr<torch::optim::Optimizer> ZeroOptimizer::consolidated(const Factory& make_full) {
  auto& s = *impl_;
  std::map<torch_compat::StateKey, ParamState> whole;  // rank 0: by parameter key
  for (std::size_t b = 0; b < s.buckets.size(); ++b) {
    const ParamState mine = s.shard_state(b);
    for (const auto& [name, slice] : mine.tensors) {
      auto all = torch::empty({s.buckets[b].numel}, slice.options());
      ddp_detail::finish(ddp_detail::allgather_anywhere(s.comm, slice, all));
      if (s.comm.rank() != 0) continue;
      for (std::size_t k = 0; k < s.buckets[b].params.size(); ++k) {
        const auto& p = s.buckets[b].params[k];
        auto& st = whole[key_of(p)];
        st.step = mine.step;
        st.tensors[name] = all.narrow(0, s.buckets[b].offsets[k], p.numel()).view(p.sizes()).clone();
      }
    }
  }
  if (s.comm.rank() != 0) return nullptr;
  auto full = make_full(s.module.parameters());
  for (auto& [key, st] : whole) full->state()[key] = make_state(s.kind, st);
  return full;
}

void ZeroOptimizer::load_consolidated(torch::optim::Optimizer& full) {
  auto& s = *impl_;
  if (kind_of(full) != s.kind) throw ConfigError("ZeRO: the consolidated optimizer is of another kind than this one");
  torch::NoGradGuard no_grad;
  for (std::size_t b = 0; b < s.buckets.size(); ++b) {
    const auto& bucket = s.buckets[b];
    std::map<std::string, torch::Tensor> flat_state;  // the bucket's state, laid out like the bucket
    std::int64_t step = 0;
    for (std::size_t k = 0; k < bucket.params.size(); ++k) {
      auto it = full.state().find(key_of(bucket.params[k]));
      if (it == full.state().end()) continue;
      const ParamState p = read_state(s.kind, *it->second);
      step = p.step;
      for (const auto& [name, t] : p.tensors) {
        auto& f = flat_state[name];
        if (!f.defined()) f = torch::zeros({bucket.numel}, t.options());
        f.narrow(0, bucket.offsets[k], t.numel()).copy_(t.reshape({-1}));
      }
    }
    if (flat_state.empty()) continue;
    auto take = [&](int owner, const torch::Tensor& slice, torch::optim::Optimizer& o) {
      ParamState st{step, {}};
      for (auto& [name, f] : flat_state) st.tensors[name] = f.narrow(0, s.offset_of(owner, b), s.slice_length(b)).clone();
      o.state()[key_of(slice)] = make_state(s.kind, st);
    };
    take(s.rank, s.shards[b], *s.optimizer);
    if (s.mirrors) take(s.mirrors->owner(), s.mirrors->slices()[b], s.mirrors->optimizer());
  }
}

UnitRunner ZeroOptimizer::unit_runner() {
  auto& s = *impl_;
  if (!s.stage3()) throw ConfigError("ZeroOptimizer::unit_runner: only stage 3 runs units");
  return [units = s.units.get(), reducer = &s.reducer](int unit, const UnitForward& forward, const torch::Tensor& x) {
    return units->run(unit, forward, x, reducer);
  };
}

void ZeroOptimizer::before_forward() {
  if (impl_->stage3()) impl_->units->before_forward();
}

void ZeroOptimizer::gather_all() {
  if (!impl_->stage3()) throw ConfigError("ZeroOptimizer::gather_all: only stage 3 shards the parameters");
  impl_->units->gather_all();
}

void ZeroOptimizer::release_all(bool keep_values) {
  if (!impl_->stage3()) throw ConfigError("ZeroOptimizer::release_all: only stage 3 shards the parameters");
  if (keep_values)
    impl_->units->keep_gathered_values();
  else
    impl_->units->release_all();
}

void ZeroOptimizer::visit_parameters(const std::function<void(const torch::Tensor&)>& visit) {
  auto& s = *impl_;
  std::map<const void*, int> bucket_of;
  for (std::size_t b = 0; b < s.buckets.size(); ++b)
    for (const auto& p : s.buckets[b].params) bucket_of[p.unsafeGetTensorImpl()] = int(b);
  int held = -1;  // the unit gathered for the parameters being visited
  for (const auto& p : s.module.parameters()) {
    if (!p.requires_grad()) continue;
    if (s.stage3()) {
      const int b = bucket_of.at(p.unsafeGetTensorImpl());
      if (b != held) {
        s.units->release_unit(held);  // never the root: it is held until the end
        s.units->gather(b);
        held = b;
      }
    }
    visit(p);
  }
  if (s.stage3()) s.units->release_all();
}

void ZeroOptimizer::load_slices(const RangeReader& read, const std::vector<std::string>& state, std::int64_t step) {
  auto& s = *impl_;
  if (!s.stage3()) throw ConfigError("ZeroOptimizer::load_slices: only stage 3 keeps nothing but its slices");
  std::map<const void*, int> place;  // trainable parameter -> its place in module.parameters()
  for (const auto& p : s.module.parameters())
    if (p.requires_grad()) place.emplace(p.unsafeGetTensorImpl(), int(place.size()));
  torch::NoGradGuard no_grad;
  for (std::size_t b = 0; b < s.buckets.size(); ++b) {
    const std::int64_t lo = s.my_offset(b), hi = lo + s.slice_length(b);
    auto& shard = s.shards[b];
    // Read into host memory: on a GPU, copied there once the bucket's slices are read.
    auto host = shard.is_cpu() ? shard : torch::empty_like(shard, shard.options().device(torch::kCPU));
    ParamState st{step, {}};
    for (const auto& name : state) st.tensors[name] = torch::zeros_like(host);
    const auto esize = std::int64_t(shard.element_size());
    for (std::size_t k = 0; k < s.buckets[b].params.size(); ++k) {
      const auto& p = s.buckets[b].params[k];
      const std::int64_t p_lo = s.buckets[b].offsets[k], p_hi = p_lo + p.numel();
      const std::int64_t from = std::max(lo, p_lo), to = std::min(hi, p_hi);
      if (from >= to) continue;
      const int at = place.at(p.unsafeGetTensorImpl());
      auto into = [&](const torch::Tensor& t) { return static_cast<char*>(t.data_ptr()) + (from - lo) * esize; };
      read(at, "value", from - p_lo, to - from, into(host));
      for (auto& [name, t] : st.tensors) read(at, name, from - p_lo, to - from, into(t));
    }
    if (!shard.is_cpu()) {
      shard.copy_(host);
      for (auto& [name, t] : st.tensors) t = t.to(shard.device());
    }
    if (!state.empty()) s.optimizer->state()[key_of(shard)] = make_state(s.kind, st);
  }
  s.units->release_all();
}

std::string ZeroOptions::describe() const {
  if (!sharded()) return "";
  return "ZeRO stage " + std::to_string(stage) + (shared_parameters ? ", one copy per machine" : "");
}

ZeroMemory ZeroOptimizer::memory() const {
  auto& s = *impl_;
  ZeroMemory m;
  std::int64_t all = 0, owned = 0;
  for (std::size_t b = 0; b < s.buckets.size(); ++b) {
    const std::int64_t size = s.flat[b].element_size();
    all += s.buckets[b].numel * size;
    owned += s.slice_length(b) * size;
    m.padding += s.buckets[b].numel;
    for (const auto& p : s.buckets[b].params) m.padding -= p.numel();
  }
  m.parameters = s.options.shared_parameters || s.stage3() ? all / s.comm.size() : all;
  m.gradients = s.options.stage >= 2 ? owned : all;
  if (s.units) m.gathered_high_water = s.units->high_water_bytes();
  m.gradient_slots = std::int64_t(s.reducer.bucket_slot_bytes());
  std::int64_t state = 0;
  for (auto& [key, st] : s.optimizer->state())
    for (auto& [name, t] : read_state(s.kind, *st).tensors) state += t.numel() * t.element_size();
  m.optimizer_state = state > 0 ? state : owned * states_per_element(s.kind, *s.optimizer);
  if (s.mirrors) m.mirrors = owned + m.optimizer_state;
  return m;
}

}  // namespace lockstep
