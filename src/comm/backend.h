// The seam between Communicator (queueing, sequence numbers, error latching) and a transport.
//
// A Backend runs one collective at a time, synchronously, on the communicator's progress
// thread. It throws lockstep errors (PeerError, TimeoutError, MismatchError) and may assume
// that it is never called again after it threw: the communicator latches the first error.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "locality.h"
#include "lockstep/comm/codec.h"
#include "lockstep/comm/options.h"
#include "lockstep/comm/store.h"

namespace lockstep::comm {

enum class CollectiveKind : std::uint8_t { allreduce, broadcast, allgather, reduce_scatter, barrier };

const char* collective_name(CollectiveKind kind);

struct Collective {
  CollectiveKind kind = CollectiveKind::barrier;
  const void* send = nullptr;
  void* recv = nullptr;
  std::size_t count = 0;  // per-rank element count (see Communicator)
  DType dtype = DType::f32;
  ReduceOp op = ReduceOp::sum;
  int root = 0;
  std::uint64_t sequence = 0;
  // allreduce (f32, sum or avg) only: what crosses between machines (comm/codec.h). Backends
  // that reduce inside one machine, and mpi, reduce exactly and ignore it.
  std::shared_ptr<const Codec> codec;
  // allgather only: recv is machine memory (Communicator::allocate_machine_memory), filled once
  // per machine by its ranks together. Backends without machine memory treat it as allgather.
  bool machine_memory = false;
  // allreduce and reduce_scatter, on a backend that takes device memory: see DeviceReady.
  DeviceReady ready;

  // A collective moving `count` elements of `dtype` from send to recv; the other fields keep their
  // defaults until the caller sets them.
  static Collective of(CollectiveKind kind, const void* send, void* recv, std::size_t count, DType dtype,
                       ReduceOp op = ReduceOp::sum) {
    Collective c;
    c.kind = kind;
    c.send = send;
    c.recv = recv;
    c.count = count;
    c.dtype = dtype;
    c.op = op;
    return c;
  }

  // This collective as one step of a larger one (a backend's algorithm): the same sequence, dtype,
  // op and options, another kind over other buffers.
  Collective step(CollectiveKind step_kind, const void* step_send, void* step_recv, std::size_t step_count) const {
    Collective c = *this;
    c.kind = step_kind;
    c.send = step_send;
    c.recv = step_recv;
    c.count = step_count;
    return c;
  }

  // "allreduce #12 (f32 x 1000, sum)": used in every error message.
  std::string describe() const;
  // Packs the fields all ranks must agree on into two words, for mismatch checks.
  std::uint64_t signature() const;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const std::string& name() const = 0;
  virtual void run(const Collective& c) = 0;
  // Called on the progress thread before its first collective and before it exits: state
  // tied to a thread's lifetime (the shm liveness lock) is taken and released here.
  virtual void on_thread_start() {}
  virtual void on_thread_stop() {}
  // Backends that use the network count what they sent (thread-safe: read while running).
  virtual NetworkStats network_stats() const { return {}; }
  // Called on the communicator's watchdog thread while run(c) has been going on for `running`
  // (at least peer_check), again every tick until it ends. A backend that cannot tell by
  // itself that a peer died or disagrees (gloo) looks at the peers' liveness and flight records
  // here, and aborts run(c) with the error when it finds one, or when `running` passed the
  // collective's timeout. Must return within about peer_check.
  virtual void on_stall(const Collective& /*c*/, Seconds /*running*/) {}
  // Whether buffers may be GPU memory (nccl): the caller need not stage them through the host.
  virtual bool takes_device_memory() const { return false; }

  // Memory, in two kinds, each with its capability (the same on every rank; a backend without
  // one keeps the defaults). Allocation runs on the caller's thread, concurrently with run().
  // Shared: memory this rank's peers can map (Communicator::allocate_shared), or nullptr.
  virtual bool shares_memory() const { return false; }
  virtual std::shared_ptr<void> allocate_shared(std::size_t /*bytes*/) { return nullptr; }
  // Machine memory: one block per machine that every rank of the machine maps (Communicator::
  // allocate_machine_memory); throws SystemError when /dev/shm cannot hold it. Once every rank
  // holds the block, machine_memory_mapped(block) lets the backend drop what named it (on the
  // caller's thread too, concurrently with run()).
  virtual bool has_machine_memory() const { return false; }
  virtual std::shared_ptr<void> allocate_machine_memory(std::size_t /*bytes*/) { return nullptr; }
  virtual void machine_memory_mapped(const void* /*block*/) {}
};

// The shm backend as the hier backend uses it inside a machine: besides the collectives, the
// in-place allreduce of a shared buffer split in two, so the cross-machine step runs in between.
class LocalBackend : public Backend {
 public:
  // Called with this rank's share of the buffer, reduced over the machine's ranks: `first` is
  // its first element, `count` its length. It may change the share in place.
  using ShareStep = std::function<void(void* share, std::size_t first, std::size_t count)>;
  // Whether [p, p + bytes) lies in a buffer from allocate_shared of this rank.
  virtual bool owns_shared(const void* p, std::size_t bytes) const = 0;
  // c.send == c.recv, a shared buffer on every rank: each rank reduces its share straight out
  // of every rank's buffer into its own, `between` runs on it, then the share is copied into
  // every peer's buffer.
  virtual void allreduce_shared_around(const Collective& c, const ShareStep& between) = 0;
  // c is an allgather into machine memory (c.recv in a block from allocate_machine_memory, at
  // the same place on every rank of the machine): once every rank of the machine has issued it,
  // `write` runs, then once every rank's `write` is done, it returns. What each rank writes is
  // the caller's business (hier: the chunks its group gathered across machines).
  virtual void fenced_machine_write(const Collective& c, const std::function<void()>& write) = 0;
};

struct BackendContext {
  std::shared_ptr<StoreClient> store;
  std::string prefix;  // store key prefix unique to this communicator
  int rank = 0;
  int size = 1;
  CommOptions options;
  Locality locality;  // which ranks share a machine (probed at creation)
  // How messages name rank r of this backend: the job's global rank when the backend serves a
  // group of it (the hier backend's levels); empty: r itself.
  std::vector<int> global_ranks{};
  int global(int r) const { return global_ranks.empty() ? r : global_ranks[static_cast<std::size_t>(r)]; }
};

std::unique_ptr<Backend> make_shm_backend(const BackendContext& ctx);
std::unique_ptr<LocalBackend> make_local_shm_backend(const BackendContext& ctx);
std::unique_ptr<Backend> make_gloo_backend(const BackendContext& ctx);  // when built with gloo
std::unique_ptr<Backend> make_hier_backend(const BackendContext& ctx);  // when built with gloo
std::unique_ptr<Backend> make_mpi_backend(const BackendContext& ctx);   // when built with MPI
std::unique_ptr<Backend> make_nccl_backend(const BackendContext& ctx);  // when built with NCCL's headers
// Collective over MPI_COMM_WORLD (every rank calls it at once): a backend over the ranks that
// passed the same color >= 0, ordered by ctx.rank; nullptr for color -1. When built with MPI.
std::unique_ptr<Backend> make_mpi_group_backend(const BackendContext& ctx, int color);
// Every rank's `mine` (at most 255 bytes) in rank order, over MPI_COMM_WORLD; when built with MPI.
std::vector<std::string> mpi_allgather_text(const std::string& mine);

// Compares every rank's signature of collective `c` (gathered by the caller) and throws
// MismatchError naming the first rank that differs from rank 0 and both descriptions.
void check_signatures(const Collective& c, const std::uint64_t* signatures, int size, int rank);
// "allreduce (f32 x 1000, sum)" from a signature.
std::string describe_signature(std::uint64_t signature);

// Sampled signature checks over a backend's own transport, with no store: every rank folds each
// collective's signature into a running hash; at the checked positions (the first collective,
// then every `every`-th) the ranks gather (sequence, hash) and compare. Equal hashes mean every
// collective since the last check agreed; on a difference the ranks gather the signatures since
// then and the MismatchError names the first collective that differs and what each rank issued.
// Cost: one gather of 16 bytes per rank at a checked position, nothing in between. every = 1
// checks each collective before it runs; 0 checks nothing.
class SignatureCheck {
 public:
  // Gathers `words` words from every rank into all[rank * words ...].
  using Gather = std::function<void(const std::uint64_t* mine, std::uint64_t* all, std::size_t words)>;
  explicit SignatureCheck(int every) : every_(every) {}
  // Before running c, on every rank.
  void before(const Collective& c, int size, int rank, const Gather& gather);

 private:
  [[noreturn]] void pin_down(const Collective& c, int size, int rank, const Gather& gather);
  int every_;
  std::uint64_t hash_ = 0;
  std::vector<std::uint64_t> since_;  // signatures since the last check, this one included
};

}  // namespace lockstep::comm
