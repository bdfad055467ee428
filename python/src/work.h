// The c10d Work of the lockstep backend, and the threads that complete them.
//
// A collective goes through three phases, as in c10d's ProcessGroupGloo and in lockstep's own
// Communicator: the caller's thread checks the tensors, packs what must be packed and issues the
// comm steps (ProcessGroupLockstep); the communicator's progress thread runs them in issue order;
// then complete() waits for the steps, unpacks the results into the caller's tensors and
// completes the Work and its Future. complete() runs on whichever thread gets there first: a
// thread of the group's CompletionPool, which takes every Work in issue order so that futures
// fire (and DDP's comm hooks run) without anyone waiting, or a thread in wait().
//
// A Work's Future holds its output tensors (a list), as ProcessGroupGloo's does: DDP and its comm
// hooks read `fut.value()[0]`. A failed collective (a dead peer, a deadline) fails the Work and its
// Future with lockstep's error, which names the collective and the rank.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "lockstep/comm/communicator.h"

namespace lockstep::torch_backend {

class LockstepWork : public c10d::Work {
 public:
  using Finish = std::function<void()>;  // unpacks results; runs once the steps are done
  // `inputs`: what the profiler records the shapes of.
  LockstepWork(int rank, c10d::OpType type, std::vector<comm::WorkPtr> steps, Finish finish,
               std::vector<at::Tensor> outputs, const std::vector<at::Tensor>& inputs);

  // With no timeout, completes the work on this thread if nobody has yet. With one, waits for
  // the completion thread up to then, and raises if it has not finished.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  std::vector<at::Tensor> result() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  // Idempotent and thread-safe: the first caller does the work, later ones return at once.
  // `callbacks(true)` and `callbacks(false)` bracket the Future's callbacks, which may block.
  void complete(const std::function<void(bool entering)>& callbacks = nullptr);

 private:
  std::mutex completing_;  // held by the thread completing this work
  bool done_ = false;      // under completing_
  std::vector<comm::WorkPtr> steps_;
  Finish finish_;
  const std::vector<at::Tensor> outputs_;
  const c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// Completes a group's works, taking them in the order they were issued (the order their steps
// run in), so that futures fire and DDP's comm hooks run without anyone waiting.
//
// Completing a work runs its Future's callbacks, and a callback may itself issue a collective and
// wait for its Future (PowerSGD's hook does, twice per bucket): that later work must then be
// completed by another thread, or the callback waits forever. So the pool keeps at least one
// thread outside callbacks: a thread about to run callbacks while no other is free starts one
// more. Threads stay until the pool is destroyed; there are as many as callbacks ever nested
// plus one (two for plain DDP), not one per work.
class CompletionPool {
 public:
  CompletionPool();
  // Completes what is queued, then stops. Queued works may run Python callbacks: do not hold
  // the GIL here. May run on one of the pool's own threads (a callback that dropped the last
  // reference to the group): that thread is detached, not joined, and ends once it returns
  // from the callback (it keeps the pool's state alive until then).
  ~CompletionPool();
  CompletionPool(const CompletionPool&) = delete;
  CompletionPool& operator=(const CompletionPool&) = delete;

  void push(c10::intrusive_ptr<LockstepWork> work);

  // Waits (up to `timeout`) until every pool of the process has nothing queued and no thread
  // busy with a work: Python's atexit calls it, so that no pool thread drops a Python callback
  // (which takes the GIL) once the interpreter finalizes; a thread that takes the GIL then is
  // ended by Python mid-unwind, and the process aborts. Call without the GIL.
  static void quiesce_all(std::chrono::milliseconds timeout);

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<c10::intrusive_ptr<LockstepWork>> queue;
    int free = 0;  // threads not inside a Future's callbacks
    int busy = 0;  // threads between taking a work and dropping it
    bool stopping = false;
    std::vector<std::thread> threads;
  };
  static void start_thread(const std::shared_ptr<State>& state);  // under state->mu
  static void in_callbacks(const std::shared_ptr<State>& state, bool entering);
  static void loop(std::shared_ptr<State> state);

  std::shared_ptr<State> state_;
};

}  // namespace lockstep::torch_backend
