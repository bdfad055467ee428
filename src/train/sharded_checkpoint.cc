// The training state as sharded checkpoints hold it (see train/sharded_checkpoint.h).
#include "lockstep/ddp/comm_dtype.h"
#include "lockstep/train/sharded_checkpoint.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <set>

#include "lockstep/ddp/optimizer_state.h"
#include "lockstep/error.h"

namespace lockstep::train {
namespace {

using ddp_detail::Kind;

std::string dtype_name(torch::ScalarType t) {
  if (auto name = dtype_name_of(t)) return *name;
  throw ConfigError(std::string("a checkpoint cannot hold tensors of dtype ") + c10::toString(t));
}

torch::ScalarType scalar_type_of(const std::string& name) {
  if (auto t = scalar_type_named(name)) return *t;
  throw DataError("a checkpoint tensor has dtype '" + name + "', which lockstep does not know");
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::adamw: return "adamw";
    case Kind::adam: return "adam";
    case Kind::sgd: return "sgd";
  }
  return "?";
}

// The checkpoint's tensors for a module: trainable parameters (module.parameters() order), then
// buffers; with the live tensors beside them.
struct Listed {
  std::vector<CheckpointTensor> tensors;
  std::vector<torch::Tensor> live;
  std::vector<std::int64_t> flat_offsets;  // trainable parameters only: where each starts end to end
  std::vector<const tp::TensorShard*> shards;  // trainable parameters only: a shard's place, or null
  std::size_t parameters = 0;

  // Parameter i's part of a whole tensor read from a checkpoint.
  torch::Tensor part(std::size_t i, const torch::Tensor& whole) const {
    return i < shards.size() && shards[i] ? shards[i]->take(whole) : whole;
  }
};

// Where `parameter` sits in its whole tensor, when it is a tensor-parallel shard.
const tp::TensorShard* shard_of(const TensorSplit* split, const torch::Tensor& parameter) {
  if (!split) return nullptr;
  for (const auto& [p, shard] : split->shards)
    if (p.unsafeGetTensorImpl() == parameter.unsafeGetTensorImpl()) return &shard;
  return nullptr;
}

// A split parameter is listed as its whole tensor (`shards` says which, by index).
Listed list_tensors(const torch::nn::Module& module, const TensorSplit* split = nullptr) {
  Listed out;
  std::int64_t at = 0;
  for (const auto& p : module.named_parameters()) {
    if (!p.value().requires_grad()) continue;
    const tp::TensorShard* shard = shard_of(split, p.value());
    out.tensors.push_back(
        {p.key(), shard ? shard->whole : p.value().sizes().vec(), dtype_name(p.value().scalar_type()), false});
    out.live.push_back(p.value());
    out.shards.push_back(shard);
    out.flat_offsets.push_back(at);
    at += out.tensors.back().numel();
  }
  out.parameters = out.tensors.size();
  for (const auto& b : module.named_buffers()) {
    if (!b.value().defined()) continue;
    out.tensors.push_back({b.key(), b.value().sizes().vec(), dtype_name(b.value().scalar_type()), true});
    out.live.push_back(b.value());
  }
  return out;
}

// Elements [start, start + count) of t as contiguous CPU memory kept alive in `owned`: a copy,
// or (copy false: the writer finishes before training touches t again) t's own where it can.
const void* copy_of(const torch::Tensor& t, std::int64_t start, std::int64_t count,
                    std::vector<torch::Tensor>& owned, bool copy = true) {
  auto part = t.detach().reshape({-1}).narrow(0, start, count).to(torch::kCPU);
  owned.push_back(copy || !part.is_contiguous() ? part.clone() : part);
  return owned.back().data_ptr();
}

void add_buffers(const Listed& listed, ShardSnapshot& s) {
  for (std::size_t i = listed.parameters; i < listed.tensors.size(); ++i) {
    const std::int64_t n = listed.live[i].numel();
    s.pieces.push_back({int(i), 0, n, {{"value", copy_of(listed.live[i], 0, n, s.owned, s.copies)}}});
  }
}

nlohmann::json optimizer_record(Kind kind, torch::optim::Optimizer& o, std::int64_t step) {
  return {{"kind", kind_name(kind)}, {"step", step}, {"state", ddp_detail::state_names(kind, o)}};
}

std::string mismatch(const CheckpointTensor& saved, const CheckpointTensor& mine) {
  auto shape = [](const std::vector<std::int64_t>& s) {
    std::string out = "[";
    for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
    return out + "]";
  };
  return mine.dtype + shape(mine.shape) + " in the model but " + saved.dtype +
         shape(saved.shape) + " in the checkpoint";
}

}  // namespace

std::size_t ShardSnapshot::bytes() const {
  std::size_t n = 0;
  for (const auto& t : owned) n += std::size_t(t.numel()) * t.element_size();
  return n;
}

namespace {

// A run of elements that is contiguous both in a tensor-parallel shard laid flat and in its whole
// tensor laid flat.
struct Run {
  std::int64_t whole = 0, part = 0, count = 0;
};

// Elements [start, start + count) of shard `s` laid flat, as runs of its whole tensor. A cut of
// one dimension of the view keeps each of its outer rows (the range times the inner dimensions)
// contiguous in both: a cut of rows is one run, a cut of columns one run per row.
std::vector<Run> runs_in_whole(const tp::TensorShard& s, std::int64_t start, std::int64_t count) {
  std::int64_t inner = 1;
  for (std::size_t d = std::size_t(s.dim) + 1; d < s.view.size(); ++d) inner *= s.view[d];
  const std::int64_t row = s.length * inner, whole_row = s.view[std::size_t(s.dim)] * inner;
  std::vector<Run> out;
  for (std::int64_t at = start, end = start + count; at < end;) {
    const std::int64_t outer = at / row, in_row = at % row, n = std::min(end - at, row - in_row);
    out.push_back({outer * whole_row + s.start * inner + in_row, at, n});
    at += n;
  }
  return out;
}

// Elements [start, start + count) of `t` laid flat, on the CPU (a view where it is there already):
// one transfer for all the runs a shard's range makes, not one per run (a row each, cut by columns).
torch::Tensor host_range(const torch::Tensor& t, std::int64_t start, std::int64_t count) {
  return t.detach().reshape({-1}).narrow(0, start, count).to(torch::kCPU);
}

// Where each trainable parameter of `listed` starts in the module's own parameters laid end to
// end (under tensor parallelism its shards', not the whole tensors' as listed.flat_offsets).
std::vector<std::int64_t> held_offsets(const Listed& listed) {
  std::vector<std::int64_t> out;
  std::int64_t at = 0;
  for (std::size_t i = 0; i < listed.parameters; ++i) out.push_back(at), at += listed.live[i].numel();
  return out;
}


// The parameters of `listed` that `mine` picks, laid end to end as this rank holds them, cut in
// `world`: cut `rank`'s pieces, with the optimizer's state, and (with `buffers`) the buffers. A
// tensor-parallel shard's elements go where they sit in its whole tensor, nothing gathered; the
// whole parameters beside them only with `whole` (one rank of a tensor group writes those).
ShardSnapshot snapshot_cut(const Listed& listed, const std::function<bool(std::size_t)>& mine,
                           torch::optim::Optimizer& optimizer, int rank, int world, bool buffers, bool copy,
                           bool whole = true) {
  torch::NoGradGuard no_grad;
  ShardSnapshot s;
  s.copies = copy;
  s.tensors = listed.tensors;
  const Kind kind = ddp_detail::kind_of(optimizer);
  std::int64_t total = 0, step = 0;
  std::vector<std::int64_t> offsets(listed.parameters, -1);
  for (std::size_t i = 0; i < listed.parameters; ++i)
    if (mine(i)) offsets[i] = total, total += listed.live[i].numel();
  const std::int64_t lo = total * rank / world, hi = total * (rank + 1) / world;
  for (std::size_t i = 0; i < listed.parameters; ++i) {
    if (offsets[i] < 0) continue;
    const torch::Tensor& p = listed.live[i];
    std::map<std::string, torch::Tensor> state;
    auto it = optimizer.state().find(ddp_detail::key_of(p));
    if (it != optimizer.state().end()) {
      const auto st = ddp_detail::read_state(kind, *it->second);
      step = st.step;
      state = st.tensors;
    }
    const std::int64_t from = std::max(lo, offsets[i]), to = std::min(hi, offsets[i] + p.numel());
    const tp::TensorShard* shard = listed.shards[i];
    if (from >= to || (!shard && !whole)) continue;
    const std::int64_t start = from - offsets[i], count = to - from;
    const torch::Tensor value = host_range(p, start, count);
    std::map<std::string, torch::Tensor> arrays;
    for (const auto& [name, t] : state) arrays[name] = host_range(t, start, count);
    for (const Run& run : shard ? runs_in_whole(*shard, start, count) : std::vector<Run>{{start, start, count}}) {
      ShardPiece piece{int(i), run.whole, run.count, {}};
      piece.arrays["value"] = copy_of(value, run.part - start, run.count, s.owned, copy);
      for (const auto& [name, t] : arrays) piece.arrays[name] = copy_of(t, run.part - start, run.count, s.owned);
      s.pieces.push_back(std::move(piece));
    }
  }
  if (buffers) add_buffers(listed, s);
  s.optimizer = optimizer_record(kind, optimizer, step);
  if (optimizer.state().empty()) s.optimizer["state"] = nlohmann::json::array();
  return s;
}

}  // namespace

ShardSnapshot snapshot_replicated(const torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                                  int rank, int world, bool copy) {
  return snapshot_cut(list_tensors(module), [](std::size_t) { return true; }, optimizer, rank, world, rank == 0, copy);
}

ShardSnapshot snapshot_pipeline_rank(const torch::nn::Module& module, const std::vector<torch::Tensor>& owned,
                                     torch::optim::Optimizer& optimizer, int replica, int replicas, bool buffers,
                                     bool copy) {
  std::set<const void*> mine;
  for (const auto& p : owned) mine.insert(p.unsafeGetTensorImpl());
  const Listed listed = list_tensors(module);
  return snapshot_cut(
      listed, [&](std::size_t i) { return mine.count(listed.live[i].unsafeGetTensorImpl()) > 0; }, optimizer, replica,
      replicas, buffers, copy);
}

ShardSnapshot snapshot_tensor_parallel(const torch::nn::Module& module, const TensorSplit& split,
                                       torch::optim::Optimizer& optimizer, const std::vector<torch::Tensor>& written,
                                       int replica, int replicas, bool buffers) {
  std::set<const void*> mine;
  for (const auto& p : written) mine.insert(p.unsafeGetTensorImpl());
  const Listed listed = list_tensors(module, &split);
  return snapshot_cut(
      listed, [&](std::size_t i) { return mine.count(listed.live[i].unsafeGetTensorImpl()) > 0; }, optimizer,
      replica, replicas, buffers, /*copy=*/true, /*whole=*/split.group->rank() == 0);
}


ShardSnapshot snapshot_zero(const torch::nn::Module& module, const ZeroOptimizer& zero, int rank, bool copy,
                            const TensorSplit* split) {
  torch::NoGradGuard no_grad;
  const Listed listed = list_tensors(module, split);
  const std::vector<std::int64_t> offsets = held_offsets(listed);
  const bool writes_whole = !split || split->group->rank() == 0;  // the tensor ranks hold the same
  ShardSnapshot s;
  s.copies = copy;
  s.tensors = listed.tensors;
  const auto held = zero.holdings();
  std::vector<std::string> names;
  for (const auto& r : held.front().ranges) {
    auto at = std::upper_bound(offsets.begin(), offsets.end(), r.begin);
    const auto i = std::size_t(at - offsets.begin()) - 1;
    const std::int64_t start = r.begin - offsets[i], count = r.values.numel();
    names.clear();
    for (const auto& [name, t] : r.state) names.push_back(name);
    const tp::TensorShard* shard = listed.shards[i];
    if (!shard && !writes_whole) continue;
    const torch::Tensor value = host_range(r.values, 0, count);
    std::map<std::string, torch::Tensor> arrays;
    for (const auto& [name, t] : r.state) arrays[name] = host_range(t, 0, count);
    for (const Run& run : shard ? runs_in_whole(*shard, start, count) : std::vector<Run>{{start, start, count}}) {
      ShardPiece piece{int(i), run.whole, run.count, {}};
      piece.arrays["value"] = copy_of(value, run.part - start, run.count, s.owned, copy);
      for (const auto& [name, t] : arrays) piece.arrays[name] = copy_of(t, run.part - start, run.count, s.owned, copy);
      s.pieces.push_back(std::move(piece));
    }
  }
  if (rank == 0) add_buffers(listed, s);
  auto& shard_optimizer = const_cast<ZeroOptimizer&>(zero).shard_optimizer();
  const Kind kind = ddp_detail::kind_of(shard_optimizer);
  s.optimizer = optimizer_record(kind, shard_optimizer, zero.optimizer_steps());
  s.optimizer["state"] = names;
  return s;
}

std::vector<std::pair<CheckpointTensor, torch::Tensor>> read_sharded_values(const std::string& dir) {
  ShardedCheckpointReader reader(dir);
  std::vector<std::pair<CheckpointTensor, torch::Tensor>> out;
  for (std::size_t t = 0; t < reader.tensors().size(); ++t) {
    const auto& saved = reader.tensors()[t];
    auto value = torch::empty(saved.shape, torch::TensorOptions().dtype(scalar_type_of(saved.dtype)));
    reader.read(int(t), "value", 0, saved.numel(), value.data_ptr());
    out.emplace_back(saved, value);
  }
  return out;
}

namespace {

// Where each of the model's tensors is in the checkpoint, after checking that they match: a
// ConfigError naming the first that is missing, of another shape, or extra.
std::vector<int> matching_tensors(const ShardedCheckpointReader& reader, const Listed& listed, const std::string& dir,
                                  bool part = false) {
  auto fail = [&](const std::string& what) {
    throw ConfigError("checkpoint " + dir + " does not fit this model: " + what +
                      "; load it into the model it was saved from");
  };
  std::vector<int> found(listed.tensors.size());
  for (std::size_t i = 0; i < listed.tensors.size(); ++i) {
    const auto& mine = listed.tensors[i];
    const int t = reader.find(mine.name);
    const char* kind = mine.buffer ? "buffer" : "parameter";
    if (t < 0) fail(std::string(kind) + " '" + mine.name + "' is missing from it");
    const auto& saved = reader.tensors()[std::size_t(t)];
    if (saved.shape != mine.shape || saved.dtype != mine.dtype)
      fail(std::string(kind) + " '" + mine.name + "' is " + mismatch(saved, mine));
    found[i] = t;
  }
  for (const auto& saved : reader.tensors()) {
    if (part) break;
    bool known = false;
    for (const auto& mine : listed.tensors) known |= mine.name == saved.name;
    if (!known) fail("it holds '" + saved.name + "', which the model does not have");
  }
  return found;
}

void check_optimizer_kind(const nlohmann::json& record, Kind kind, const std::string& dir) {
  if (record.value("kind", "") != kind_name(kind))
    throw ConfigError("checkpoint " + dir + " holds the state of a " + record.value("kind", std::string("?")) +
                      " optimizer, and this run uses " + kind_name(kind) + ": resume with the same --optim");
}

}  // namespace

nlohmann::json load_sharded(const std::string& dir, torch::nn::Module& module,
                            torch::optim::Optimizer* optimizer, bool part, const TensorSplit* split) {
  torch::NoGradGuard no_grad;
  ShardedCheckpointReader reader(dir);
  const Listed listed = list_tensors(module, split);
  const std::vector<int> found = matching_tensors(reader, listed, dir, part);
  auto read_tensor = [&](int t, const std::string& array) {
    const auto& saved = reader.tensors()[std::size_t(t)];
    auto out = torch::empty(saved.shape, torch::TensorOptions().dtype(scalar_type_of(saved.dtype)));
    reader.read(t, array, 0, saved.numel(), out.data_ptr());
    return out;
  };
  for (std::size_t i = 0; i < listed.tensors.size(); ++i) {
    const auto& live = listed.live[i];
    const bool shard = i < listed.parameters && listed.shards[i];
    if (!shard && live.is_cpu() && live.is_contiguous())  // straight into the model's memory: no second copy
      reader.read(found[i], "value", 0, live.numel(), live.data_ptr());
    else
      live.copy_(listed.part(i, read_tensor(found[i], "value")));
  }
  const nlohmann::json record = reader.extra().value("optimizer", nlohmann::json::object());
  const auto state = record.value("state", std::vector<std::string>{});
  if (!optimizer || state.empty()) return record;
  const Kind kind = ddp_detail::kind_of(*optimizer);
  check_optimizer_kind(record, kind, dir);
  for (std::size_t i = 0; i < listed.parameters; ++i) {
    ddp_detail::ParamState st{record.value("step", std::int64_t{0}), {}};
    for (const auto& name : state)
      st.tensors[name] = listed.part(i, read_tensor(found[i], name)).to(listed.live[i].device());
    optimizer->state()[ddp_detail::key_of(listed.live[i])] = ddp_detail::make_state(kind, st);
  }
  return record;
}



nlohmann::json load_sharded_slices(const std::string& dir, torch::nn::Module& module, ZeroOptimizer& zero,
                                   const TensorSplit* split) {
  torch::NoGradGuard no_grad;
  ShardedCheckpointReader reader(dir);
  const Listed listed = list_tensors(module, split);
  const std::vector<int> found = matching_tensors(reader, listed, dir);
  for (std::size_t i = listed.parameters; i < listed.tensors.size(); ++i) {  // the buffers, whole
    auto whole = torch::empty(listed.live[i].sizes(), listed.live[i].options().device(torch::kCPU));
    reader.read(found[i], "value", 0, whole.numel(), whole.data_ptr());
    listed.live[i].copy_(whole);
  }
  const nlohmann::json record = reader.extra().value("optimizer", nlohmann::json::object());
  const auto state = record.value("state", std::vector<std::string>{});
  if (!state.empty()) check_optimizer_kind(record, ddp_detail::kind_of(zero.shard_optimizer()), dir);
  zero.load_slices(
      [&](int parameter, const std::string& array, std::int64_t start, std::int64_t count, void* out) {
        const int t = found.at(std::size_t(parameter));
        const tp::TensorShard* shard = listed.shards.at(std::size_t(parameter));
        if (!shard) return reader.read(t, array, start, count, out);
        const std::size_t size = c10::elementSize(scalar_type_of(reader.tensors()[std::size_t(t)].dtype));
        for (const Run& run : runs_in_whole(*shard, start, count))
          reader.read(t, array, run.whole, run.count, static_cast<char*>(out) + std::size_t(run.part - start) * size);
      },
      state, record.value("step", std::int64_t{0}));
  return record;
}

}  // namespace lockstep::train
