// The sharded state put back together on a new membership (see zero_elastic.h).
#include "lockstep/ddp/zero_elastic.h"

#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <vector>

#include "lockstep/comm/elastic.h"
#include "lockstep/error.h"
#include "lockstep/ddp/optimizer_state.h"
#include "device_collectives.h"

namespace lockstep {
namespace {

using ddp_detail::key_of;
using ddp_detail::kind_of;
using ddp_detail::make_state;
using ddp_detail::ParamState;
using ddp_detail::read_state;
using ddp_detail::state_names;

std::vector<torch::Tensor> trainable(torch::nn::Module& module) {
  std::vector<torch::Tensor> out;
  for (auto& p : module.parameters())
    if (p.requires_grad()) out.push_back(p);
  return out;
}

// What each member says of itself, gathered on all: where it stands and whose slices it holds.
struct Description {
  std::int64_t owner = -1;      // its old rank (-1: it joins now)
  std::int64_t mirror_of = -1;  // the old rank it mirrors
  std::int64_t old_world = 0;
  std::int64_t steps = 0;       // completed steps, plus one if it applied the step in flight
  std::int64_t ready = 0;       // it holds the step in flight's gradients, not applied
  std::int64_t optimizer_steps = 0;
  std::int64_t has_state = 0;   // its optimizer has stepped: it holds state tensors
  static constexpr int kFields = 7;
};

Description describe(const HeldState& mine) {
  Description d;
  d.steps = mine.completed_steps;
  if (mine.zero) {
    const auto held = mine.zero->holdings();
    d.owner = held.front().owner;
    d.mirror_of = held.size() > 1 ? held[1].owner : -1;
    d.old_world = mine.zero->world();
    d.steps += mine.zero->phase() == UpdatePhase::applied;
    d.ready = mine.zero->phase() == UpdatePhase::ready;
    d.optimizer_steps = mine.zero->optimizer_steps();
    d.has_state = !held.front().ranges.empty() && !held.front().ranges.front().state.empty();
  } else if (mine.whole) {
    d.owner = 0;
    d.old_world = 1;
    for (auto& [key, st] : mine.whole->state())
      d.optimizer_steps = std::max(d.optimizer_steps, read_state(kind_of(*mine.whole), *st).step);
    d.has_state = !mine.whole->state().empty();
  }
  return d;
}

std::vector<Description> gather(comm::Communicator& comm, const Description& d) {
  std::vector<std::int64_t> all(std::size_t(comm.size()) * Description::kFields);
  const std::int64_t mine[Description::kFields] = {d.owner, d.mirror_of, d.old_world, d.steps,
                                                   d.ready, d.optimizer_steps, d.has_state};
  comm.allgather(mine, all.data(), Description::kFields, comm::DType::i64)->wait();
  std::vector<Description> out;
  for (int r = 0; r < comm.size(); ++r) {
    const std::int64_t* f = &all[std::size_t(r) * Description::kFields];
    out.push_back({f[0], f[1], f[2], f[3], f[4], f[5], f[6]});
  }
  return out;
}

// The whole state as one optimizer holds it: the parameters' values and each state tensor, laid end
// to end in trainable() order.
struct WholeLayout {
  std::vector<torch::Tensor> params;
  std::int64_t numel = 0;
  torch::TensorOptions options;
};

WholeLayout layout_of(torch::nn::Module& module) {
  WholeLayout l;
  l.params = trainable(module);
  if (l.params.empty()) throw ConfigError("ZeRO: the module has no trainable parameters");
  l.options = l.params.front().options().requires_grad(false);
  for (auto& p : l.params) {
    if (p.scalar_type() != l.params.front().scalar_type())
      throw ConfigError("ZeRO in an elastic job: every trainable parameter must have one dtype");
    l.numel += p.numel();
  }
  return l;
}

// This member's contribution: the ranges it was chosen for, zeros elsewhere.
void contribute(const std::vector<HeldShard>& held, const std::vector<int>& chosen_owners, torch::Tensor& values,
                std::map<std::string, torch::Tensor>& state) {
  torch::NoGradGuard no_grad;
  for (const auto& shard : held) {
    if (std::find(chosen_owners.begin(), chosen_owners.end(), shard.owner) == chosen_owners.end()) continue;
    for (const auto& r : shard.ranges) {
      values.narrow(0, r.begin, r.values.numel()).copy_(r.values);
      for (auto& [name, t] : state) t.narrow(0, r.begin, r.values.numel()).copy_(r.state.at(name));
    }
  }
}

// One worker that trained alone holds everything, as owner 0 of a world of one.
HeldShard whole_shard(const WholeLayout& l, torch::optim::Optimizer& o) {
  HeldShard out{0, {}};
  std::int64_t at = 0;
  for (const auto& p : l.params) {
    HeldRange r;
    r.begin = at;
    r.values = p.detach().reshape({-1});
    auto it = o.state().find(key_of(p));
    if (it != o.state().end())
      for (auto& [name, t] : read_state(kind_of(o), *it->second).tensors) r.state[name] = t.reshape({-1});
    out.ranges.push_back(std::move(r));
    at += p.numel();
  }
  return out;
}

// The module's parameters take the values (fresh memory: the old ZeRO arrays may be shared
// memory of the old communicator), the optimizer the state, per parameter.
void install(const WholeLayout& l, const torch::Tensor& values, const std::map<std::string, torch::Tensor>& state,
             std::int64_t optimizer_steps, torch::optim::Optimizer& o) {
  torch::NoGradGuard no_grad;
  const auto kind = kind_of(o);
  std::int64_t at = 0;
  for (auto p : l.params) {
    p.set_data(values.narrow(0, at, p.numel()).view(p.sizes()).clone());
    if (!state.empty()) {
      ParamState st{optimizer_steps, {}};
      for (const auto& [name, t] : state) st.tensors[name] = t.narrow(0, at, p.numel()).view(p.sizes()).clone();
      o.state()[key_of(p)] = make_state(kind, st);
    }
    at += p.numel();
  }
}

// Settles the step in flight: any member that applied it means all hold its gradients.
std::int64_t settle_step_in_flight(const std::vector<Description>& all, Description& me, const HeldState& mine) {
  std::int64_t newest = 0;
  for (const auto& d : all) newest = std::max(newest, d.steps);
  if (me.owner >= 0 && me.steps == newest - 1 && me.ready) mine.zero->finish_update();
  return newest;
}

// For every old rank, the first member holding its slices at the newest step.
std::vector<int> choose_sources(const std::vector<Description>& all, std::int64_t newest) {
  std::int64_t old_world = 0;
  for (const auto& d : all) old_world = std::max(old_world, d.old_world);
  std::vector<int> source(std::size_t(old_world), -1);
  for (std::int64_t owner = 0; owner < old_world; ++owner)
    for (std::size_t r = 0; r < all.size() && source[std::size_t(owner)] < 0; ++r) {
      const auto& d = all[r];
      const bool holds = d.owner == owner || d.mirror_of == owner;
      const bool current = d.steps == newest || (d.steps == newest - 1 && d.ready);  // the ready ones finished
      if (holds && current) source[std::size_t(owner)] = int(r);
    }
  for (std::size_t owner = 0; owner < source.size(); ++owner)
    if (source[owner] < 0)
      throw comm::ElasticError("ZeRO: the optimizer state of rank " + std::to_string(owner) + " of the " +
                               std::to_string(old_world) +
                               " before this change was lost with it and with the rank that mirrored it (both "
                               "gone at once); the job cannot go on without its last checkpoint");
  return source;
}

}  // namespace

ZeroOptions mirrored_options(const ZeroOptions& plan, int rank, const std::vector<int>& node_of_rank) {
  const int world = static_cast<int>(node_of_rank.size());
  int first_machine = 0;  // how many ranks the first machine holds
  while (first_machine < world && node_of_rank[std::size_t(first_machine)] == node_of_rank.front()) ++first_machine;
  const int shift = first_machine < world ? first_machine : 1;
  ZeroOptions o = plan;
  o.mirror_of = (rank - shift + world) % world;
  o.mirrored_by = (rank + shift) % world;
  return o;
}

RecoveredState recover_sharded_state(comm::Communicator& comm, torch::nn::Module& module, const HeldState& mine,
                                     const ZeroOptimizer::Factory& make_whole) {
  const auto all_before = gather(comm, describe(mine));
  Description me = all_before[std::size_t(comm.rank())];
  RecoveredState out;
  out.steps = settle_step_in_flight(all_before, me, mine);
  const std::vector<int> source = choose_sources(all_before, out.steps);
  std::vector<int> mine_to_send;
  for (std::size_t owner = 0; owner < source.size(); ++owner)
    if (source[owner] == comm.rank()) mine_to_send.push_back(int(owner));

  const WholeLayout l = layout_of(module);
  out.optimizer = make_whole(l.params);
  std::int64_t optimizer_steps = 0;
  bool has_state = false;
  for (std::size_t r = 0; r < all_before.size(); ++r) {  // a member that finished the update above counts one more
    const auto& d = all_before[r];
    const bool finished = d.ready && d.steps == out.steps - 1;
    optimizer_steps = std::max(optimizer_steps, d.optimizer_steps + (finished ? 1 : 0));
    has_state = has_state || d.has_state || finished;
  }
  torch::Tensor values = torch::zeros({l.numel}, l.options);
  std::map<std::string, torch::Tensor> state;
  if (has_state)
    for (const auto& name : state_names(kind_of(*out.optimizer), *out.optimizer))
      state[name] = torch::zeros({l.numel}, l.options);
  std::vector<HeldShard> held;
  if (mine.zero) held = mine.zero->holdings();
  if (mine.whole) held = {whole_shard(l, *mine.whole)};
  contribute(held, mine_to_send, values, state);

  ddp_detail::finish(ddp_detail::allreduce_sum_anywhere(comm, values));
  for (auto& [name, t] : state) ddp_detail::finish(ddp_detail::allreduce_sum_anywhere(comm, t));
  install(l, values, state, optimizer_steps, *out.optimizer);
  return out;
}

}  // namespace lockstep
