// Communicator: the collectives every rank of a job calls, in the same order (MPI semantics).
//
// A Communicator is created collectively by all `size` ranks from a rendezvous (a store
// plus rank and size). Each collective returns at once with a Work handle; one progress
// thread per communicator runs the collectives one at a time in the order they were issued,
// each tagged with a sequence number. Buffers must stay valid and untouched until the Work is
// done. Send and receive buffers may be the same (in place) for allreduce; for allgather and
// reduce_scatter the "small" buffer may sit inside the "large" one at this rank's offset.
//
// Backends: "shm" (one machine: shared memory), "gloo" (TCP, several machines), "hier" (several
// machines with several ranks each: shm inside each, gloo between), "mpi" (under mpirun),
// "auto" (shm on one machine, hier when machines hold equal numbers of ranks, else gloo).
// Which ranks share a machine is found by probing, not from hostnames.
//
// Failure: a collective that does not finish within options.timeout is a TimeoutError naming
// the collective and the ranks it waited for; a peer that died is a PeerError within
// options.peer_check; ranks that issued different collectives at the same position get a
// MismatchError (at once on shm; on gloo and mpi at the next checked collective, see
// CommOptions::check_every, or as soon as the mismatch stalls). Each communicator keeps a
// flight record of its recent collectives (flight_recorder.h), published on the store when a
// collective stalls or fails: the steady state makes no store requests. After any of these the communicator is broken: every later collective fails
// at once with the first error, and the program should exit (the launcher restarts the group).
//
// Thread-safety: issuing collectives from several threads is allowed but their order is then
// the order they reach the queue, which must be the same on every rank.
#pragma once

#include <chrono>
#include <cstddef>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/comm/codec.h"
#include "lockstep/comm/options.h"
#include "lockstep/comm/store.h"
#include "lockstep/comm/types.h"
#include "lockstep/comm/work.h"

namespace lockstep::comm {

class Backend;
class Mailbox;
class Watchdog;
struct WorkQueue;

class Communicator {
 public:
  // Collective: all ranks call it with the same options. `store` is used during creation and
  // by backends that rendezvous through it; it must outlive the communicator.
  static std::unique_ptr<Communicator> create(std::shared_ptr<StoreClient> store, int rank, int size,
                                              CommOptions options = {});
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // The longest any one collective, or recv, may take (CommOptions::timeout).
  Seconds timeout() const { return options_.timeout; }
  const std::string& backend_name() const;
  // Whether the buffers of collectives may be GPU memory (the nccl backend; host memory works
  // there too). Elsewhere a GPU tensor's bytes must be copied to the host first.
  bool takes_device_memory() const;

  // `ready`: see DeviceReady (types.h); only for a backend that takes device memory.
  WorkPtr allreduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                    DeviceReady ready = {});
  WorkPtr allreduce(void* buffer, std::size_t count, DType dtype, ReduceOp op) {
    return allreduce(buffer, buffer, count, dtype, op);
  }
  // In place, float32, sum or avg: the machines exchange what `codec` makes of each rank's
  // share (comm/codec.h); inside a machine the reduction stays exact. Exact everywhere on shm
  // and mpi, and when every rank is on one machine.
  WorkPtr allreduce(float* buffer, std::size_t count, ReduceOp op, Codec codec);
  WorkPtr broadcast(void* buffer, std::size_t count, DType dtype, int root);
  // recv holds size() * count elements, rank r's contribution at offset r * count.
  WorkPtr allgather(const void* send, void* recv, std::size_t count, DType dtype);
  // send holds size() * count elements; recv gets the reduction of block rank().
  WorkPtr reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                         DeviceReady ready = {});
  WorkPtr barrier();

  // Point-to-point, outside the collective order: a send and a recv are matched by (source,
  // tag), in the order each source sent them (MPI's rule), whatever collectives run meanwhile.
  // They travel over TCP between every pair of ranks, connected on first use, on every backend
  // alike; between two ranks on one machine through a ring in shared memory instead (the TCP
  // connection then only shows when the peer ends; CommOptions::p2p_shared_memory). A send is
  // done once its bytes are handed over (to the kernel, or into the ring; the receiver may not
  // have posted its recv yet); the buffer is then free. A recv names its source, or kAnySource to
  // take the first message with its tag from any rank (Work::source_rank says whose). count and
  // dtype must match the send's, else MismatchError. A peer that exits or dies fails the recvs
  // waiting for it with PeerError (after what it sent before); a recv that gets nothing within
  // options.timeout is a TimeoutError naming the source and tag.
  static constexpr int kAnySource = comm::kAnySource;
  WorkPtr send(const void* buffer, std::size_t count, DType dtype, int dst, int tag = 0);
  WorkPtr recv(void* buffer, std::size_t count, DType dtype, int src, int tag = 0);
  // A message that says what it holds: `description` (at most kMaxDescriptionBytes: a tensor's
  // type and shape, say) travels in front of the elements, and the receiver's `place` reads it
  // before they arrive and returns the memory for them (count elements of dtype, as sent). So a
  // message of a size the receiver did not know lands in its final buffer with no staging copy.
  // `place` runs on the transport's thread, or on the caller's when the message came first, and
  // may run under the point-to-point lock: it must not call this communicator. What it throws
  // fails the recv. A message with a non-empty description is taken only by recv_described
  // (a plain recv gets a MismatchError); recv_described takes plain messages too (`place` sees an
  // empty description). Unlike recv, recv_described has no deadline of its own, since it may be
  // posted long before it is needed: wait for it with a timeout (Communicator::timeout()).
  WorkPtr send_described(const std::string& description, const void* buffer, std::size_t count, DType dtype, int dst,
                         int tag = 0);
  WorkPtr recv_described(Place place, int src, int tag = 0);
  // Whether messages to `dst` go through shared memory (known once a send to it connected).
  bool shares_memory_with(int dst) const;

  // Collective: memory that every rank's backend can read and write directly, or nullptr on
  // every rank when there is none (gloo, mpi, a single rank, or /dev/shm too small on any
  // rank). All ranks call it in the same order with the same size. An in-place allreduce on
  // such a buffer (on every rank) skips the staging copies: on shm each rank reduces its share
  // straight out of the peers' buffers and writes the result into all of them. The memory
  // stays valid while the returned pointer (or a copy) lives, even after the communicator.
  std::shared_ptr<void> allocate_shared(std::size_t bytes);

  // Machine memory: one block per machine that every rank on it maps (the same bytes for all of
  // them), so that data every rank of a machine reads (ZeRO's parameters in one-copy mode) is held
  // once per machine. Collective: all ranks call it in the same order with the same size; every
  // rank gets a block, or every rank nullptr when the backend has none (gloo and mpi, which do not
  // know who shares a machine; hier when the machines hold unequal numbers of ranks). SystemError,
  // on every rank, when /dev/shm cannot hold it. Zeros at first; stays mapped while the pointer
  // (or a copy) lives, and leaves no name in /dev/shm once it has returned.
  std::shared_ptr<void> allocate_machine_memory(std::size_t bytes);
  // Whether allocate_machine_memory gives blocks (not collective; the same on every rank).
  bool has_machine_memory() const;
  // allgather into machine memory: recv is the same place of a block from
  // allocate_machine_memory on every rank of a machine, and the machine's ranks fill it together
  // (on hier each rank gathers its share across machines and writes it once; on shm each writes
  // its own chunk): every element is written once per machine, not once per rank. Two promises
  // make the block safe to reuse: nobody writes until every rank of the machine has issued this
  // call (so a rank that stopped reading before issuing it is never overwritten), and the Work is
  // done only once the whole block is written on the machine. Ranks that pass different places
  // get a MismatchError. Where allocate_machine_memory gives nullptr this is an allgather.
  WorkPtr allgather_machine(const void* send, void* recv, std::size_t count, DType dtype);

  // Collective over every rank: a communicator of the ranks on this rank's machine (rank = its
  // index among them, shared memory between them), for work that stays inside a machine while
  // this one spans them (local SGD's inner steps). Its name is this one's plus "/machine-<m>".
  // ConfigError when the machines are unknown (mpi without a store).
  std::unique_ptr<Communicator> machine_communicator();
  // A communicator of some of this one's ranks (a pipeline's stage or replica, pipe/pipeline.h):
  // every rank in `members` calls it with the same list (this communicator's ranks; the new one's
  // rank r is members[r]) and the same `name`, which no other group made from this communicator
  // may use; ranks outside the list do not call it. The machines are this one's (not probed
  // again), and the backend is this one's, or auto where this one is auto or hier (a group may
  // sit on one machine); on mpi, whose communicators come from mpirun, gloo. ConfigError when this
  // rank is not in `members`, a member is not a rank, or the machines are unknown.
  std::unique_ptr<Communicator> group(const std::vector<int>& members, const std::string& name);
  // Which machine each rank is on (0, 0, 1, 1, ...), numbered by each machine's lowest rank;
  // empty when unknown.
  const std::vector<int>& machine_of() const { return machine_of_; }

  // Collectives issued so far (the next sequence number).
  std::uint64_t issued() const;
  // Seconds its collectives have run so far, summed (each from its start, on the progress thread or
  // a waiting caller, to its end; point-to-point transfers not included): the communication time of
  // the dimension it is the group of is the change over a window. Any thread.
  double busy_seconds() const;
  // Safe to call from any thread, also while collectives run.
  NetworkStats network_stats() const;

 private:
  Communicator(int rank, int size, std::unique_ptr<Backend> backend, CommOptions options,
               std::shared_ptr<StoreClient> store);
  WorkPtr enqueue(struct Collective c);
  void start_watchdog(std::shared_ptr<StoreClient> store);

  int rank_, size_;
  CommOptions options_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<WorkQueue> queue_;
  std::unique_ptr<Watchdog> watchdog_;
  std::shared_ptr<StoreClient> store_;  // kept for machine_communicator()
  std::vector<int> machine_of_;
  std::unique_ptr<Mailbox> mailbox_;  // point-to-point; null when it could not open (then p2p throws why)
  std::string mailbox_error_;
};

// Names of the backends built into this binary, e.g. {"shm", "gloo", "mpi"}.
std::vector<std::string> available_backends();

}  // namespace lockstep::comm
