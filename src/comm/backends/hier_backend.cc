// The hier backend: for jobs on several machines with several ranks each. Inside a machine the
// ranks talk through shared memory (a shm backend over the machine's L ranks); between machines,
// each local index has its own Gloo group (the M ranks with that index, one per machine), so all
// L local ranks use the network at once.
//
// allreduce of n elements (sum, min, max; avg is a sum divided once, at the end):
//   1. inside the machine, reduce-scatter: local rank l gets its shard (n / L elements) reduced
//      over the machine;
//   2. across machines, local rank l all-reduces its shard with the M - 1 ranks of index l;
//   3. inside the machine, all-gather the shards.
//   Each machine sends and receives (M - 1) / M x 2 x n elements over the network in Gloo's
//   ring (n for two machines), against 2 (W - 1) / W x n per rank for a flat ring of all W
//   ranks, whose links between machines carry L ranks' traffic. Shared-memory phases move
//   about 2n per rank through memory. On buffers from allocate_shared (DDP's buckets), steps 1
//   and 3 are the shm backend's zero-copy reduction, split around step 2.
// broadcast: the root's index-group broadcasts across machines, then every machine broadcasts
//   inside from that index.
// allgather: each rank gathers its block across machines in its index group, then the machine
//   all-gathers those; the result is put in global rank order.
// reduce_scatter: inside the machine, local rank l gets the partial sums of the M blocks whose
//   owners have index l; across machines, a reduce-scatter of those gives each rank its block.
// barrier: inside, across, inside.
// allgather into machine memory (one block per machine): each rank gathers its chunk across
//   machines in its index group, into scratch of M chunks; then, once every rank of the machine
//   has issued the call, each writes those M chunks into the block: every chunk crosses the
//   network once per machine and is written once per machine, where a plain allgather writes the
//   whole result once per rank.
//
// Machines with unequal numbers of ranks (say 2 and 1): only the first S local indices have a
// group across machines, S being the fewest ranks any machine holds. allreduce: the whole buffer
// reduced inside, S shards across (local rank l < S carries shard l), each shard broadcast inside
// from its carrier; broadcast from a root whose index has no group: inside the root's machine to
// its rank 0, across from there, inside elsewhere; allgather: inside, then every machine's rank 0
// broadcasts its machine's blocks across (their sizes differ) and passes the whole on inside;
// reduce_scatter: an allreduce of the whole input, each rank keeping its block. Each machine
// still crosses the network once per shard, not once per rank as a flat ring of all ranks does.
//
// Errors from either level say which level and which global ranks were involved.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "backend.h"
#include "lockstep/base/knobs.h"
#include "lockstep/base/log.h"
#include "lockstep/error.h"

namespace lockstep::comm {
namespace {

class HierBackend final : public Backend {
 public:
  explicit HierBackend(const BackendContext& ctx) : rank_(ctx.rank), where_(ctx.locality) {
    machine_ = where_.machine_of[static_cast<std::size_t>(rank_)];
    local_ = where_.local_rank[static_cast<std::size_t>(rank_)];
    machine_ranks_ = where_.ranks_on(machine_);
    local_size_ = static_cast<int>(machine_ranks_.size());
    uniform_ = where_.uniform();
    shards_ = local_size_;
    for (int m = 0; m < where_.machines; ++m) shards_ = std::min(shards_, static_cast<int>(where_.ranks_on(m).size()));
    if (local_ < shards_)
      for (int m = 0; m < where_.machines; ++m)
        index_group_.push_back(where_.ranks_on(m)[static_cast<std::size_t>(local_)]);
    BackendContext inside = ctx, across = ctx;
    inside.prefix = ctx.prefix + "machine/" + std::to_string(machine_) + "/";
    inside.rank = local_;
    inside.size = local_size_;
    inside.global_ranks = machine_ranks_;
    across.prefix = ctx.prefix + "index/" + std::to_string(local_) + "/";
    across.rank = machine_;
    across.size = where_.machines;
    across.global_ranks = index_group_;
    local_backend_ = make_local_shm_backend(inside);
    cross_backend_ = make_across(across);
    if (rank_ == 0 && where_.machines > 1)
      LOCKSTEP_LOG(info, comm) << "hier: " << where_.describe() << "; shared memory inside, "
                               << ctx.options.hier_across << " between machines over "
                               << shards_ << " group" << (shards_ == 1 ? "" : "s");
  }

  // The engine between machines (LOCKSTEP_HIER_ACROSS); null on one machine and for local indices
  // without a group. MPI's split is collective over all of MPI's ranks: every rank takes part.
  std::unique_ptr<Backend> make_across(const BackendContext& across) const {
    const bool mine = where_.machines > 1 && local_ < shards_;
    const std::string& engine = across.options.hier_across;
    if (engine == "gloo") return mine ? make_gloo_backend(across) : nullptr;
    if (engine != "mpi")
      throw ConfigError("hier engine across machines '" + engine + "' (" + knobs::kHierAcross.name +
                        "): use gloo or mpi");
#ifdef LOCKSTEP_HAVE_MPI
    auto group = make_mpi_group_backend(across, local_ < shards_ ? local_ : -1);
    return mine ? std::move(group) : nullptr;
#else
    throw ConfigError(std::string("hier engine across machines 'mpi' (") + knobs::kHierAcross.name +
                      "): this lockstep was built without MPI (install libopenmpi-dev and rebuild)");
#endif
  }

  const std::string& name() const override {
    static const std::string kName = "hier";
    return kName;
  }

  void on_thread_start() override {
    local_backend_->on_thread_start();
    if (cross_backend_) cross_backend_->on_thread_start();
  }
  void on_thread_stop() override {
    local_backend_->on_thread_stop();
    if (cross_backend_) cross_backend_->on_thread_stop();
  }
  bool shares_memory() const override { return true; }
  // The shm level watches itself; the Gloo level compares the communicator's records (hier's own
  // sequence numbers, which every rank's record carries) and may abort its step.
  void on_stall(const Collective& c, Seconds running) override {
    if (cross_backend_) cross_backend_->on_stall(c, running);
  }
  NetworkStats network_stats() const override {
    NetworkStats s = cross_backend_ ? cross_backend_->network_stats() : NetworkStats{};
    s.machines = where_.machines;
    return s;
  }
  std::shared_ptr<void> allocate_shared(std::size_t bytes) override {
    return local_backend_->allocate_shared(bytes);
  }
  // Only where every machine holds the same number of ranks: allgather_machine's chunks are laid
  // out by index group.
  bool has_machine_memory() const override { return uniform_; }
  std::shared_ptr<void> allocate_machine_memory(std::size_t bytes) override {
    return uniform_ ? local_backend_->allocate_machine_memory(bytes) : nullptr;
  }
  void machine_memory_mapped(const void* block) override { local_backend_->machine_memory_mapped(block); }

  void run(const Collective& c) override {
    switch (c.kind) {
      case CollectiveKind::allreduce: return uniform_ ? allreduce(c) : allreduce_uneven(c);
      case CollectiveKind::broadcast: return broadcast(c);
      case CollectiveKind::allgather:
        if (c.machine_memory && uniform_) return allgather_machine(c);
        return uniform_ ? allgather(c) : allgather_uneven(plain_allgather(c));
      case CollectiveKind::reduce_scatter: return uniform_ ? reduce_scatter(c) : reduce_scatter_uneven(c);
      case CollectiveKind::barrier:
        inside(c);
        across(c);
        return inside(c);
    }
  }

 private:
  int world() const { return where_.size(); }
  int machines() const { return where_.machines; }

  // A step of `c` run inside the machine or across machines, with that level's own sequence
  // numbers; its errors name the level and the global ranks.
  void inside(Collective step) {
    step.sequence = next_inside_++;
    try {
      local_backend_->run(step);
    } catch (const Error& e) {
      rethrow_with(
          e, "inside machine " + std::to_string(machine_) + " (global ranks " + list(machine_ranks_) + ")");
    }
  }

  void across(Collective step) {
    if (!cross_backend_) return;
    step.sequence = next_across_++;
    try {
      cross_backend_->run(step);
    } catch (const Error& e) {
      rethrow_with(e, "between machines (global ranks " + list(index_group_) + ")");
    }
  }

  [[noreturn]] static void rethrow_with(const Error& e, const std::string& where) {
    const std::string what = "hier, " + where + ": " + e.what();
    if (dynamic_cast<const PeerError*>(&e)) throw PeerError(what);
    if (dynamic_cast<const TimeoutError*>(&e)) throw TimeoutError(what);
    if (dynamic_cast<const MismatchError*>(&e)) throw MismatchError(what);
    if (dynamic_cast<const ConfigError*>(&e)) throw ConfigError(what);
    throw Error(what);
  }

  static std::string list(const std::vector<int>& ranks) {
    std::string out;
    for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
    return out;
  }

  char* scratch(std::vector<char>& buffer, std::size_t bytes) {
    if (buffer.size() < bytes) buffer.resize(bytes);
    return buffer.data();
  }

  // Unequal machines have no machine memory: allgather_machine is an allgather there.
  static Collective plain_allgather(Collective c) {
    c.machine_memory = false;
    return c;
  }

  void allgather_machine(const Collective& c) {
    const std::size_t bytes = c.count * dtype_size(c.dtype);
    char* chunks = scratch(machine_chunks_, bytes * static_cast<std::size_t>(machines()));
    if (cross_backend_) {
      Collective step = c;
      step.machine_memory = false;
      step.recv = chunks;
      across(step);
    } else {
      std::memcpy(chunks, c.send, bytes);
    }
    Collective local = c;
    local.sequence = next_inside_++;
    char* block = static_cast<char*>(c.recv);
    try {
      local_backend_->fenced_machine_write(local, [&] {
        for (std::size_t m = 0; m < index_group_.size(); ++m)
          std::memcpy(block + static_cast<std::size_t>(index_group_[m]) * bytes, chunks + m * bytes, bytes);
      });
    } catch (const Error& e) {
      rethrow_with(
          e, "inside machine " + std::to_string(machine_) + " (global ranks " + list(machine_ranks_) + ")");
    }
  }

  // avg as a sum everywhere, then one division over the world, on this rank's shard only.
  static ReduceOp wire_op(ReduceOp op) { return op == ReduceOp::avg ? ReduceOp::sum : op; }

  void allreduce(const Collective& c) {
    if (c.count == 0) return inside(c);  // everyone still meets: the signature check runs
    Collective local = c;
    local.op = wire_op(c.op);
    if (c.send == c.recv && local_backend_->owns_shared(c.recv, c.count * dtype_size(c.dtype)))
      return allreduce_shared(c, local);
    allreduce_staged(c, local);
  }

  // Zero-copy inside the machine: the shm backend reduces each share out of the peers' buffers,
  // this rank's share crosses the network, then the shm backend copies it into every buffer.
  void allreduce_shared(const Collective& c, Collective local) {
    local.sequence = next_inside_++;
    try {
      local_backend_->allreduce_shared_around(
          local, [&](void* share, std::size_t first, std::size_t count) { shard_across(c, share, first, count); });
    } catch (const Error& e) {
      rethrow_with(
          e, "inside machine " + std::to_string(machine_) + " (global ranks " + list(machine_ranks_) + ")");
    }
  }

  // Elements [first, first + count) of c's buffer, reduced over this machine, reduced across
  // machines by this rank's index group: exactly, or through c's codec.
  void shard_across(const Collective& c, void* shard, std::size_t first, std::size_t count) {
    if (c.codec && cross_backend_ && machines() > 1) {
      IndexGroup group(*this, c);
      (*c.codec)(static_cast<float*>(shard), first, count, group);
    } else {
      Collective step = c;
      step.kind = CollectiveKind::allreduce;
      step.op = wire_op(c.op);
      step.send = step.recv = shard;
      step.count = count;
      step.codec = nullptr;
      across(step);
    }
    if (c.op == ReduceOp::avg) divide_elements(c.dtype, shard, count, world());
  }

  // A codec's view of the share's holders: each call is one more step of this index's group.
  class IndexGroup final : public Across {
   public:
    IndexGroup(HierBackend& hier, const Collective& c) : hier_(hier), c_(c) {}
    int machines() const override { return hier_.machines(); }
    int machine() const override { return hier_.machine_; }
    void sum(void* buffer, std::size_t count, DType dtype) override {
      if (count == 0) return;
      hier_.across(step(CollectiveKind::allreduce, buffer, buffer, count, dtype));
    }
    void gather(const void* mine, void* all, std::size_t bytes) override {
      if (bytes == 0) return;
      const std::size_t words = (bytes + 3) / 4, m = static_cast<std::size_t>(machines());
      std::vector<char> in(words * 4, 0), out(words * 4 * m);
      std::memcpy(in.data(), mine, bytes);
      hier_.across(step(CollectiveKind::allgather, in.data(), out.data(), words, DType::i32));
      for (std::size_t k = 0; k < m; ++k) std::memcpy(static_cast<char*>(all) + k * bytes, out.data() + k * words * 4, bytes);
    }

   private:
    Collective step(CollectiveKind kind, const void* send, void* recv, std::size_t count, DType dtype) const {
      Collective s = c_;
      s.kind = kind;
      s.send = send;
      s.recv = recv;
      s.count = count;
      s.dtype = dtype;
      s.op = ReduceOp::sum;
      s.codec = nullptr;
      return s;
    }
    HierBackend& hier_;
    const Collective& c_;
  };

  void allreduce_staged(const Collective& c, const Collective& local) {
    const std::size_t esize = dtype_size(c.dtype), L = static_cast<std::size_t>(local_size_);
    const std::size_t shard = (c.count + L - 1) / L;
    const bool even = shard * L == c.count;
    const char* in = static_cast<const char*>(c.send);
    if (!even) {  // pad to L shards; the padding is never copied back
      char* padded = scratch(padded_in_, shard * L * esize);
      std::memcpy(padded, c.send, c.count * esize);
      std::memset(padded + c.count * esize, 0, (shard * L - c.count) * esize);
      in = padded;
    }
    char* mine = scratch(shard_, shard * esize);
    inside(local.step(CollectiveKind::reduce_scatter, in, mine, shard));
    shard_across(c, mine, static_cast<std::size_t>(local_) * shard, shard);
    char* out = even ? static_cast<char*>(c.recv) : scratch(padded_out_, shard * L * esize);
    inside(local.step(CollectiveKind::allgather, mine, out, shard));
    if (!even) std::memcpy(c.recv, out, c.count * esize);
  }

  // Unequal machines: reduced inside, shard l across by local rank l < S, shards broadcast inside.
  void allreduce_uneven(const Collective& c) {
    Collective local = c;
    local.op = wire_op(c.op);
    inside(local);
    const std::size_t esize = dtype_size(c.dtype), S = static_cast<std::size_t>(shards_);
    const std::size_t shard = (c.count + S - 1) / S;
    char* out = static_cast<char*>(c.recv);
    auto range = [&](std::size_t l) {
      const std::size_t begin = std::min(c.count, l * shard);
      return std::make_pair(begin, std::min(c.count, begin + shard) - begin);
    };
    for (std::size_t l = 0; l < S; ++l)
      if (const auto [begin, n] = range(l); n > 0 && static_cast<std::size_t>(local_) == l)
        shard_across(c, out + begin * esize, begin, n);
    for (std::size_t l = 0; l < S; ++l) {
      const auto [begin, n] = range(l);
      if (n == 0) continue;
      Collective b = c;
      b.kind = CollectiveKind::broadcast;
      b.send = b.recv = out + begin * esize;
      b.count = n;
      b.root = static_cast<int>(l);
      inside(b);
    }
  }

  void broadcast(const Collective& c) {
    const int root_machine = where_.machine_of[static_cast<std::size_t>(c.root)];
    const int root_local = where_.local_rank[static_cast<std::size_t>(c.root)];
    if (root_local >= shards_) return broadcast_through_rank0(c, root_machine, root_local);
    if (local_ == root_local) {
      Collective step = c;
      step.root = root_machine;
      across(step);
    }
    Collective step = c;
    step.root = root_local;
    inside(step);
  }

  // The root's local index has no group across machines (a machine has fewer ranks): its
  // machine's rank 0 carries the buffer across.
  void broadcast_through_rank0(const Collective& c, int root_machine, int root_local) {
    Collective step = c;
    if (machine_ == root_machine) {
      step.root = root_local;
      inside(step);
    }
    if (local_ == 0) {
      step.root = root_machine;
      across(step);
    }
    if (machine_ != root_machine) {
      step.root = 0;
      inside(step);
    }
  }

  // Unequal machines: each machine gathers its ranks' blocks; every machine's rank 0 broadcasts
  // them across (one broadcast per machine: their sizes differ) and passes the whole on inside.
  void allgather_uneven(const Collective& c) {
    const std::size_t block = c.count * dtype_size(c.dtype), M = static_cast<std::size_t>(machines());
    std::vector<std::size_t> at(M + 1, 0);  // where each machine's blocks start, [machine][local index]
    for (std::size_t m = 0; m < M; ++m) at[m + 1] = at[m] + where_.ranks_on(static_cast<int>(m)).size() * block;
    char* staged = scratch(padded_out_, at[M]);
    Collective step = c;
    step.recv = staged + at[static_cast<std::size_t>(machine_)];
    inside(step);
    Collective b = c;
    b.kind = CollectiveKind::broadcast;
    if (local_ == 0)
      for (std::size_t m = 0; m < M; ++m) {
        b.send = b.recv = staged + at[m];
        b.count = c.count * where_.ranks_on(static_cast<int>(m)).size();
        b.root = static_cast<int>(m);
        across(b);
      }
    b.send = b.recv = staged;
    b.count = c.count * static_cast<std::size_t>(world());
    b.root = 0;
    inside(b);
    for (std::size_t m = 0; m < M; ++m) {
      const auto ranks = where_.ranks_on(static_cast<int>(m));
      for (std::size_t l = 0; l < ranks.size(); ++l)
        std::memcpy(static_cast<char*>(c.recv) + static_cast<std::size_t>(ranks[l]) * block, staged + at[m] + l * block,
                    block);
    }
  }

  // Unequal machines: the whole input all-reduced, each rank keeping its block.
  void reduce_scatter_uneven(const Collective& c) {
    const std::size_t block = c.count * dtype_size(c.dtype);
    char* whole = scratch(padded_in_, block * static_cast<std::size_t>(world()));
    Collective a = c;
    a.kind = CollectiveKind::allreduce;
    a.recv = whole;
    a.count = c.count * static_cast<std::size_t>(world());
    allreduce_uneven(a);
    std::memcpy(c.recv, whole + static_cast<std::size_t>(rank_) * block, block);
  }

  // Blocks arrive in (machine, local index) order; the result is in global rank order.
  void allgather(const Collective& c) {
    const std::size_t esize = dtype_size(c.dtype), block = c.count * esize;
    const std::size_t M = static_cast<std::size_t>(machines()), L = static_cast<std::size_t>(local_size_);
    char* by_machine = scratch(shard_, M * block);  // this index's block from every machine
    Collective step = c;
    step.recv = by_machine;
    across(step);
    if (!cross_backend_) std::memcpy(by_machine, c.send, block);
    char* gathered = scratch(padded_out_, L * M * block);  // [local index][machine]
    step = c;
    step.send = by_machine;
    step.recv = gathered;
    step.count = c.count * M;
    inside(step);
    for (std::size_t l = 0; l < L; ++l)
      for (std::size_t m = 0; m < M; ++m) {
        const int r = where_.ranks_on(static_cast<int>(m))[l];
        std::memmove(static_cast<char*>(c.recv) + static_cast<std::size_t>(r) * block,
                     gathered + (l * M + m) * block, block);
      }
  }

  void reduce_scatter(const Collective& c) {
    const std::size_t esize = dtype_size(c.dtype), block = c.count * esize;
    const std::size_t M = static_cast<std::size_t>(machines()), L = static_cast<std::size_t>(local_size_);
    // Regroup the input: for local index l, the blocks of ranks (0, l), (1, l), ..., (M-1, l).
    char* regrouped = scratch(padded_in_, L * M * block);
    for (std::size_t l = 0; l < L; ++l)
      for (std::size_t m = 0; m < M; ++m) {
        const int r = where_.ranks_on(static_cast<int>(m))[l];
        std::memcpy(regrouped + (l * M + m) * block,
                    static_cast<const char*>(c.send) + static_cast<std::size_t>(r) * block, block);
      }
    char* partial = scratch(shard_, M * block);
    Collective step = c;
    step.op = wire_op(c.op);
    step.send = regrouped;
    step.recv = partial;
    step.count = c.count * M;
    inside(step);
    if (cross_backend_) {
      step = c;
      step.op = wire_op(c.op);
      step.send = partial;
      step.recv = c.recv;
      across(step);
    } else {
      std::memcpy(c.recv, partial, block);
    }
    if (c.op == ReduceOp::avg) divide_elements(c.dtype, c.recv, c.count, world());
  }

  int rank_;
  Locality where_;
  int machine_ = 0, local_ = 0, local_size_ = 1;
  bool uniform_ = true;  // as many ranks on every machine
  int shards_ = 1;       // local indices with a group across machines: the fewest ranks on a machine
  std::vector<int> machine_ranks_;  // global ranks on this machine, by local index
  std::vector<int> index_group_;    // global ranks with this local index, by machine (if it has a group)
  std::unique_ptr<LocalBackend> local_backend_;
  std::unique_ptr<Backend> cross_backend_;  // null on a single machine
  std::uint64_t next_inside_ = 0, next_across_ = 0;
  std::vector<char> padded_in_, padded_out_, shard_;  // scratch, kept between collectives
  std::vector<char> machine_chunks_;  // allgather_machine: the chunks gathered across machines
};

}  // namespace

std::unique_ptr<Backend> make_hier_backend(const BackendContext& ctx) {
  return std::make_unique<HierBackend>(ctx);
}

}  // namespace lockstep::comm
