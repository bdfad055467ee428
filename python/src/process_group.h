// ProcessGroupLockstep: c10d's collectives on a lockstep Communicator, which is what
// torch.distributed's backend "lockstep" creates (a c10d::ProcessGroup on torch 1.x, a
// c10d::Backend on torch 2.x: c10d_compat.h).
//
// Every collective checks its tensors on the caller's thread (CPU and dense; reduce operators
// SUM, AVG, MIN, MAX), packs into a contiguous wire what cannot be sent as it is (tensor_wire.h),
// issues one or more comm steps and returns a LockstepWork at once (work.h). Collectives are
// issued in call order under one lock, and the communicator runs them in that order: the same
// order on every rank, as torch.distributed requires anyway.
//
// What lockstep's comm has no step for is built from the ones it has: reduce from allreduce,
// gather from allgather, scatter from broadcast, all-to-all from an allgather of padded blocks
// (each rank receives every block: world-size times the traffic of a real all-to-all, fine for
// the control messages it is used for). Point-to-point send/recv is not supported.
//
// Shared memory for tensors all-reduced again and again (DDP's gradient buckets). On the shm
// backend, lockstep all-reduces a buffer from Communicator::allocate_shared in place without
// staging copies (each rank reduces its share straight out of the peers' buffers), which is how
// lockstep's C++ DDP keeps its buckets. PyTorch's DDP allocates its buckets itself, so the group
// moves them: a large all_reduce (>= kShareBytes) of a contiguous tensor that owns its whole
// storage, from torch's default CPU allocator, that this rank all-reduced before, is a candidate;
// when every rank's tensor is one (one small allreduce agrees), each rank copies the tensor's
// bytes into shared memory and points the tensor's storage there: the tensor, every view of it
// (DDP's per-parameter views) and its values stay as they were, only the memory under them
// moves. Tensors whose memory belongs to someone else (from_numpy, share_memory_, a file
// mapping) are never moved. The agreement is skipped for tensors already in shared memory; a
// group stops asking after kMaxRefusals agreements in a row that did not move anything, so
// programs without such tensors pay a handful of small allreduces in all.
//
// Thread-safety: collectives may be issued from several threads (DDP issues from autograd's);
// the order they reach the lock must then be the same on every rank.
#pragma once


#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "c10d_compat.h"
#include "group_store.h"
#include "lockstep/comm/communicator.h"
#include "work.h"

namespace lockstep::torch_backend {

class ProcessGroupLockstep : public CollectiveBase {
 public:
  // Collective over the group's members: creates the communicator through `store`.
  ProcessGroupLockstep(const Settings& settings, const GroupPlace& place, std::unique_ptr<GroupStore> store);
  ~ProcessGroupLockstep() override;

  const std::string getBackendName() const override { return "lockstep"; }
  // The comm backend the communicator runs on: "shm", "gloo", "hier" or "mpi".
  const std::string& comm_backend() const { return comm_->backend_name(); }
  const std::string& group_id() const { return group_id_; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // monitored_barrier.cc: rank 0 hears from every other rank through the store within the
  // timeout, or raises naming the first (wait_all_ranks: every) rank that did not arrive.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;

  // process_group_gather.cc
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;

  // process_group_coalesced.cc: one call of the tensor form per pair, under one Work.
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts)
      LOCKSTEP_OVERRIDE_2X;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts)
      LOCKSTEP_OVERRIDE_2X;

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  // Every member's communicator starts at sequence 0, so there is nothing to agree on.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return comm_->issued(); }

 private:
  // Issues a collective: `issue` enqueues its comm steps (under the issue lock, so the steps
  // of concurrent callers never interleave); `finish` unpacks once they are done. The profiler
  // records the shapes of `inputs` (as gloo's do), of `outputs` where none are given (in place).
  c10::intrusive_ptr<c10d::Work> launch(c10d::OpType type,
                                        const std::function<std::vector<comm::WorkPtr>(comm::Communicator&)>& issue,
                                        LockstepWork::Finish finish, std::vector<at::Tensor> outputs,
                                        std::vector<at::Tensor> inputs = {});
  // Every rank's `in` gathered into `outs` (one per rank; empty: this rank keeps nothing).
  // all_gather and gather both run on it (process_group_gather.cc).
  c10::intrusive_ptr<c10d::Work> gather_blocks(c10d::OpType type, const at::Tensor& in, std::vector<at::Tensor> outs);
  // all-to-all of arbitrary blocks (process_group_gather.cc).
  c10::intrusive_ptr<c10d::Work> exchange_blocks(const std::vector<at::Tensor>& send,
                                                 const std::vector<at::Tensor>& receive,
                                                 std::vector<at::Tensor> outputs);
  // One Work over `parts`, issued already (process_group_coalesced.cc).
  c10::intrusive_ptr<c10d::Work> coalesce(c10d::OpType type, std::vector<c10::intrusive_ptr<c10d::Work>> parts,
                                          std::vector<at::Tensor> outputs);
  void check_root(std::int64_t root, const char* collective) const;
  // One send or recv of `tensors` (a list of one, as c10d passes it): process_group_p2p.cc.
  c10::intrusive_ptr<c10d::Work> point_to_point(c10d::OpType type, std::vector<at::Tensor>& tensors, int peer, int tag);
  // The shared-memory move described above, for an all_reduce of `t` (contiguous or not) of
  // `bytes` bytes of a dtype that travels as it is; may move t's storage. True when t's memory
  // is shared on every rank: the all_reduce may then run in place on it.
  bool share_for_allreduce(const at::Tensor& t, std::size_t bytes);

  static constexpr std::size_t kShareBytes = 256u << 10;
  static constexpr int kMaxRefusals = 8;

  std::string group_id_;
  comm::Seconds timeout_;  // the group's: what a monitored barrier without its own timeout gets
  std::uint64_t monitored_barriers_ = 0;  // issued so far (each one's keys are its own)
  std::unique_ptr<GroupStore> store_;
  std::unique_ptr<comm::Communicator> comm_;
  std::unique_ptr<CompletionPool> completer_;
  // Completes the sends and recvs whose Future a program took, apart from the collectives: the
  // pool takes works in issue order, and a recv may wait on its peer for as long as the program
  // likes (process_group_p2p.cc).
  std::unique_ptr<CompletionPool> p2p_completer_;
  std::mutex issue_mu_;
  // share_for_allreduce's state; touched by the issuing thread only (collectives are issued in
  // one order, and these follow it).
  bool sharing_ = false;           // shm backend, several ranks, still asking
  int refusals_ = 0;               // agreements in a row that moved nothing
  c10::DeleterFnPtr cpu_deleter_ = nullptr;  // how torch's default CPU allocator frees
  std::vector<const void*> seen_;  // storages all-reduced lately (a small ring)
  std::size_t seen_next_ = 0;
};

// Runs `f` without the GIL when the calling thread holds it (module.cc; a no-op outside Python).
void without_gil(const std::function<void()>& f);

// torch.distributed passes one tensor per call on CPU; the lists exist for the *_multigpu forms,
// which are refused naming `collective` (process_group.cc).
const at::Tensor& single(const std::vector<at::Tensor>& tensors, const char* collective);
// One handle as the list the comm layer's calls take.
std::vector<comm::WorkPtr> one(comm::WorkPtr w);

}  // namespace lockstep::torch_backend
