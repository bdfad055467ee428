// ZeRO stages 1 and 2 and the one-copy mode over the reducer's flat buckets (see zero.h).
#include "lockstep/ddp/zero.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "lockstep/comm/machine_memory.h"
#include "lockstep/ddp/comm_dtype.h"
#include "lockstep/error.h"
#include "tensor_alias.h"

namespace lockstep {
namespace {

using ddp_detail::alias_into;
using ddp_detail::alias_range;

// ZeRO's slices are floating point: the optimizers it divides hold no integer state.
comm::DType float_dtype_of(const torch::Tensor& t) {
  const auto d = comm_dtype_of(t.scalar_type());
  if (!d || *d == comm::DType::i32 || *d == comm::DType::i64)
    throw ConfigError("ZeRO shards floating-point parameters only (float32/64, float16, bfloat16)");
  return *d;
}

// ----- the optimizers whose state can be cut into slices and put back together ----------------

enum class Kind { sgd, adam, adamw };

Kind kind_of(torch::optim::Optimizer& o) {
  if (dynamic_cast<torch::optim::AdamW*>(&o)) return Kind::adamw;
  if (dynamic_cast<torch::optim::Adam*>(&o)) return Kind::adam;
  if (dynamic_cast<torch::optim::SGD*>(&o)) return Kind::sgd;
  throw ConfigError("ZeRO: the optimizer must be SGD, Adam or AdamW (elementwise updates, state lockstep "
                    "knows how to consolidate)");
}

// One parameter's (or one slice's) state: its step count and its state tensors by name.
struct ParamState {
  std::int64_t step = 0;
  std::map<std::string, torch::Tensor> tensors;
};

template <class S>
ParamState read_adam(const S& s) {
  ParamState out{s.step(), {{"exp_avg", s.exp_avg()}, {"exp_avg_sq", s.exp_avg_sq()}}};
  if (s.max_exp_avg_sq().defined()) out.tensors["max_exp_avg_sq"] = s.max_exp_avg_sq();
  return out;
}

ParamState read_state(Kind kind, const torch::optim::OptimizerParamState& s) {
  switch (kind) {
    case Kind::adamw: return read_adam(static_cast<const torch::optim::AdamWParamState&>(s));
    case Kind::adam: return read_adam(static_cast<const torch::optim::AdamParamState&>(s));
    case Kind::sgd: {
      const auto& m = static_cast<const torch::optim::SGDParamState&>(s).momentum_buffer();
      return m.defined() ? ParamState{0, {{"momentum_buffer", m}}} : ParamState{};
    }
  }
  return {};
}

template <class S>
std::unique_ptr<torch::optim::OptimizerParamState> make_adam(const ParamState& p) {
  auto s = std::make_unique<S>();
  s->step(p.step);
  s->exp_avg(p.tensors.at("exp_avg"));
  s->exp_avg_sq(p.tensors.at("exp_avg_sq"));
  if (auto it = p.tensors.find("max_exp_avg_sq"); it != p.tensors.end()) s->max_exp_avg_sq(it->second);
  return s;
}

std::unique_ptr<torch::optim::OptimizerParamState> make_state(Kind kind, const ParamState& p) {
  switch (kind) {
    case Kind::adamw: return make_adam<torch::optim::AdamWParamState>(p);
    case Kind::adam: return make_adam<torch::optim::AdamParamState>(p);
    case Kind::sgd: {
      auto s = std::make_unique<torch::optim::SGDParamState>();
      s->momentum_buffer(p.tensors.at("momentum_buffer"));
      return s;
    }
  }
  return nullptr;
}

// State tensors per element an optimizer will keep, for the memory record before its first step.
int states_per_element(Kind kind, torch::optim::Optimizer& o) {
  if (kind == Kind::sgd) return static_cast<torch::optim::SGDOptions&>(o.param_groups()[0].options()).momentum() > 0;
  return 2;
}

std::string key_of(const torch::Tensor& t) {
  return c10::guts::to_string(t.unsafeGetTensorImpl());
}

}  // namespace

BucketSharding zero_bucket_sharding(const ZeroOptions& zero, int world) {
  BucketSharding sharding;
  sharding.slices = world;
  sharding.reduce_scatter = zero.stage == 2;
  if (zero.stage == 2) sharding.max_bucket_cap_mb = 4;
  return sharding;
}

struct ZeroOptimizer::Impl {
  Impl(torch::nn::Module& m, Reducer& r, comm::Communicator& c, ZeroOptions o)
      : module(m), reducer(r), comm(c), options(o), buckets(r.flat_buckets()) {}

  torch::nn::Module& module;
  Reducer& reducer;
  comm::Communicator& comm;
  ZeroOptions options;
  std::vector<Reducer::FlatBucket> buckets;
  std::vector<torch::Tensor> flat;    // the parameters, bucket by bucket (padded)
  std::vector<torch::Tensor> shards;  // this rank's slice of each: the optimizer's parameters
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  Kind kind = Kind::adamw;

  std::int64_t slice_length(std::size_t b) const { return buckets[b].numel / comm.size(); }
  std::int64_t my_offset(std::size_t b) const { return comm.rank() * slice_length(b); }
  void check_reducer() const;
  void allocate_flat();
  void move_parameters_in();
  void gather_parameters();
  ParamState shard_state(std::size_t b) const;
};

void ZeroOptimizer::Impl::check_reducer() const {
  if (options.stage != 1 && options.stage != 2)
    throw ConfigError("ZeRO stage " + std::to_string(options.stage) + " is not one lockstep has: use 1 or 2");
  const auto& sharding = reducer.sharding();
  if (!sharding || sharding->slices != comm.size() || sharding->reduce_scatter != (options.stage == 2))
    throw ConfigError("ZeroOptimizer: build its Reducer with zero_bucket_sharding(zero, comm.size())");
}

// Memory the peers read in place when the communicator has it (the all-gather then copies once),
// or (one copy) one block every rank of the machine maps.
void ZeroOptimizer::Impl::allocate_flat() {
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
  std::shared_ptr<void> block = comm::map_machine_memory(comm, total);
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
  const bool writer = !options.shared_parameters || comm.rank() == 0;  // one copy: rank 0 fills it
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    for (std::size_t k = 0; k < buckets[b].params.size(); ++k) {
      auto& p = buckets[b].params[k];
      auto alias = alias_into(flat[b], buckets[b].offsets[k], p);
      if (writer) alias.copy_(p);
      p.set_data(alias);
    }
    shards.push_back(alias_range(flat[b], my_offset(b), slice_length(b)));
    shards.back().set_requires_grad(true);
  }
  if (options.shared_parameters) comm.barrier()->wait();
}

void ZeroOptimizer::Impl::gather_parameters() {
  std::vector<comm::WorkPtr> works;
  for (std::size_t b = 0; b < buckets.size(); ++b)
    works.push_back(comm.allgather(shards[b].data_ptr(), flat[b].data_ptr(), std::size_t(slice_length(b)),
                                   float_dtype_of(flat[b])));
  for (auto& w : works) w->wait();
}

// This rank's state for bucket b's slice (empty before the optimizer's first step).
ParamState ZeroOptimizer::Impl::shard_state(std::size_t b) const {
  auto it = optimizer->state().find(key_of(shards[b]));
  return it == optimizer->state().end() ? ParamState{} : read_state(kind, *it->second);
}

ZeroOptimizer::ZeroOptimizer(torch::nn::Module& module, Reducer& reducer, comm::Communicator& comm,
                             ZeroOptions options, Factory make)
    : impl_(std::make_unique<Impl>(module, reducer, comm, options)) {
  impl_->check_reducer();
  impl_->allocate_flat();
  impl_->move_parameters_in();
  impl_->optimizer = make(impl_->shards);
  impl_->kind = kind_of(*impl_->optimizer);
}

ZeroOptimizer::~ZeroOptimizer() = default;

torch::optim::Optimizer& ZeroOptimizer::shard_optimizer() {
  return *impl_->optimizer;
}

double ZeroOptimizer::clip_grad_norm(double max_norm) {
  auto& s = *impl_;
  double squares = 0;
  for (std::size_t b = 0; b < s.shards.size(); ++b) {
    const auto g = s.reducer.gradient_slice(int(b));
    squares += g.to(torch::kDouble).pow(2).sum().item<double>();
  }
  s.comm.allreduce(&squares, 1, comm::DType::f64, comm::ReduceOp::sum)->wait();
  const double norm = std::sqrt(squares);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1) {
    torch::NoGradGuard no_grad;
    for (std::size_t b = 0; b < s.shards.size(); ++b) s.reducer.gradient_slice(int(b)).mul_(coef);
  }
  return norm;
}

void ZeroOptimizer::step() {
  auto& s = *impl_;
  if (s.options.shared_parameters) s.comm.barrier()->wait();  // nobody still reads parameters
  for (std::size_t b = 0; b < s.shards.size(); ++b) s.shards[b].mutable_grad() = s.reducer.gradient_slice(int(b));
  s.optimizer->step();
  if (s.options.shared_parameters)
    s.comm.barrier()->wait();  // nobody reads a slice its owner still writes
  else
    s.gather_parameters();
}

void ZeroOptimizer::zero_grad() {
  torch::NoGradGuard no_grad;
  for (auto& p : impl_->module.parameters())
    if (p.grad().defined()) p.mutable_grad().zero_();
}

std::unique_ptr<torch::optim::Optimizer> ZeroOptimizer::consolidated(const Factory& make_full) {
  auto& s = *impl_;
  std::map<std::string, ParamState> whole;  // rank 0: by parameter key
  for (std::size_t b = 0; b < s.buckets.size(); ++b) {
    const ParamState mine = s.shard_state(b);
    for (const auto& [name, slice] : mine.tensors) {
      auto all = torch::empty({s.buckets[b].numel}, slice.options());
      s.comm.allgather(slice.data_ptr(), all.data_ptr(), std::size_t(slice.numel()), float_dtype_of(slice))->wait();
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
    ParamState mine{step, {}};
    for (auto& [name, f] : flat_state) mine.tensors[name] = f.narrow(0, s.my_offset(b), s.slice_length(b)).clone();
    s.optimizer->state()[key_of(s.shards[b])] = make_state(s.kind, mine);
  }
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
  m.parameters = s.options.shared_parameters ? all / s.comm.size() : all;
  m.gradients = s.options.stage == 2 ? owned : all;
  m.gradient_slots = std::int64_t(s.reducer.bucket_slot_bytes());
  std::int64_t state = 0;
  for (auto& [key, st] : s.optimizer->state())
    for (auto& [name, t] : read_state(s.kind, *st).tensors) state += t.numel() * t.element_size();
  m.optimizer_state = state > 0 ? state : owned * states_per_element(s.kind, *s.optimizer);
  return m;
}

}  // namespace lockstep
