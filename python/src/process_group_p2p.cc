// ProcessGroupLockstep: send, recv and recv from any source, on the communicator's
// point-to-point (Communicator::send/recv), any dtype (moved as it is, or as raw bytes).
#include <atomic>
#include <stdexcept>
#include <string>

#include "process_group.h"
#include "tensor_wire.h"

namespace lockstep::torch_backend {
namespace {

// A send's or recv's Work. Unlike a collective's, it is not handed to a completion thread when
// issued: dist.send and dist.recv wait at once, and a hand-off to a thread that then hands the
// result back costs ~70 us a message (measured, bench/compare_p2p.py). It completes on the
// thread that waits for it or asks whether it is done; only a program that takes its Future gets
// it completed by the group's pool, which then fires the Future's callbacks. A Work does not
// outlive its group (as with c10d's own).
// A recv's Work also tells which rank the message came from (dist.recv(t) with no src returns it).
class PointToPointWork final : public LockstepWork {
 public:
  PointToPointWork(int rank, c10d::OpType type, comm::WorkPtr step, Finish finish, std::vector<at::Tensor> outputs,
                   CompletionPool* pool)
      : LockstepWork(rank, type, {step}, std::move(finish), outputs, outputs), step_(std::move(step)), pool_(pool) {}
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    if (timeout != kNoTimeout) {
      try {
        step_->wait(comm::Seconds(static_cast<double>(timeout.count()) / 1000));
      } catch (const std::exception& e) {
        if (!step_->done())
          throw std::runtime_error(std::string("lockstep: ") + e.what() + " (it stays posted; wait again, or exit)");
      }  // a step that failed is done: complete() below raises its error
    }
    return LockstepWork::wait(kNoTimeout);
  }
  bool isCompleted() override {
    if (!step_->done()) return false;
    complete();
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    if (!pooled_.exchange(true)) pool_->push(c10::intrusive_ptr<LockstepWork>::reclaim_copy(this));
    return LockstepWork::getFuture();
  }
  int sourceRank() const override {
    const int source = step_->source_rank();
    if (source < 0) throw std::runtime_error("lockstep: the recv has not received anything yet: wait() for it first");
    return source;
  }

 private:
  comm::WorkPtr step_;
  CompletionPool* pool_;
  std::atomic<bool> pooled_{false};
};

const char* op_name(c10d::OpType type) {
  return type == c10d::OpType::SEND ? "send" : type == c10d::OpType::RECV ? "recv" : "recv from any source";
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::point_to_point(c10d::OpType type, std::vector<at::Tensor>& tensors,
                                                                    int peer, int tag) {
  const char* what = op_name(type);
  if (tensors.size() != 1)
    throw std::runtime_error(std::string("lockstep: ") + what + " takes one tensor, got " + std::to_string(tensors.size()));
  const at::Tensor t = tensors.front();
  check_cpu_dense(t, what);
  if (type != c10d::OpType::RECVANYSOURCE && (peer < 0 || peer >= size_))
    throw std::runtime_error(std::string("lockstep: ") + what + " names rank " + std::to_string(peer) +
                             ", which is not a rank of this " + std::to_string(size_) + "-rank group");
  const WireSpec spec = move_spec(t);
  const bool sending = type == c10d::OpType::SEND;
  const Wire wire = wire_of(t, spec, sending);
  comm::WorkPtr step =
      sending ? comm_->send(wire.buffer.data_ptr(), static_cast<std::size_t>(spec.count), spec.dtype, peer, tag)
              : comm_->recv(wire.buffer.data_ptr(), static_cast<std::size_t>(spec.count), spec.dtype,
                            type == c10d::OpType::RECVANYSOURCE ? comm::Communicator::kAnySource : peer, tag);
  LockstepWork::Finish finish = nullptr;
  if (!sending)
    finish = [wire, spec, t] {
      if (wire.copied) unpack(wire.buffer, spec, t);
    };
  else
    finish = [wire] {};  // holds the packed copy until the send is done
  return c10::make_intrusive<PointToPointWork>(rank_, type, std::move(step), std::move(finish),
                                               std::vector<at::Tensor>{t}, p2p_completer_.get());
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  return point_to_point(c10d::OpType::SEND, tensors, dst_rank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  return point_to_point(c10d::OpType::RECV, tensors, src_rank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return point_to_point(c10d::OpType::RECVANYSOURCE, tensors, -1, tag);
}

}  // namespace lockstep::torch_backend
