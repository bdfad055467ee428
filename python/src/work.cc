#include "work.h"

#include <ATen/core/ivalue.h>

#include <algorithm>

#include <stdexcept>
#include <string>

#include "lockstep/base/log.h"

namespace lockstep::torch_backend {
namespace {

// The name the profiler shows for a collective, as ProcessGroupGloo's "gloo:all_reduce". Static:
// the profiler keeps the pointer.
const char* profiling_title(c10d::OpType type) {
  switch (type) {
    case c10d::OpType::BROADCAST: return "lockstep:broadcast";
    case c10d::OpType::ALLREDUCE: return "lockstep:all_reduce";
    case c10d::OpType::ALLREDUCE_COALESCED: return "lockstep:all_reduce_coalesced";
    case c10d::OpType::REDUCE: return "lockstep:reduce";
    case c10d::OpType::ALLGATHER: return "lockstep:all_gather";
    case c10d::OpType::_ALLGATHER_BASE: return "lockstep:_allgather_base";
    case c10d::OpType::ALLGATHER_COALESCED: return "lockstep:all_gather_coalesced";
    case c10d::OpType::GATHER: return "lockstep:gather";
    case c10d::OpType::SCATTER: return "lockstep:scatter";
    case c10d::OpType::REDUCE_SCATTER: return "lockstep:reduce_scatter";
    case c10d::OpType::_REDUCE_SCATTER_BASE: return "lockstep:_reduce_scatter_base";
    case c10d::OpType::ALLTOALL_BASE: return "lockstep:all_to_all_base";
    case c10d::OpType::ALLTOALL: return "lockstep:all_to_all";
    case c10d::OpType::BARRIER: return "lockstep:barrier";
    case c10d::OpType::SEND: return "lockstep:send";
    case c10d::OpType::RECV: return "lockstep:recv";
    case c10d::OpType::RECVANYSOURCE: return "lockstep:recvAnySource";
    default: return "lockstep:collective";
  }
}

}  // namespace

LockstepWork::LockstepWork(int rank, c10d::OpType type, std::vector<comm::WorkPtr> steps, Finish finish,
                           std::vector<at::Tensor> outputs, const std::vector<at::Tensor>& inputs)
    : c10d::Work(rank, type, profiling_title(type), inputs),
      steps_(std::move(steps)),
      finish_(std::move(finish)),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

void LockstepWork::complete(const std::function<void(bool entering)>& callbacks) {
  std::lock_guard<std::mutex> hold(completing_);
  if (done_) return;
  std::exception_ptr error;
  try {
    for (const auto& step : steps_) step->wait();
    if (finish_) finish_();
  } catch (...) {
    error = std::current_exception();
  }
  steps_.clear();
  finish_ = nullptr;  // frees the packed copies now, not when Python drops the Work
  done_ = true;
  // The Future first, as ProcessGroupGloo does: its callbacks (DDP's, comm hooks') run here.
  if (callbacks) callbacks(true);
  try {
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
  } catch (...) {
    if (callbacks) callbacks(false);
    finish(error);
    throw;
  }
  if (callbacks) callbacks(false);
  finish(error);
}

bool LockstepWork::wait(std::chrono::milliseconds timeout) {
  if (timeout == kNoTimeout) {
    complete();
  } else {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!cv_.wait_for(lock, timeout, [&] { return completed_; }))
      throw std::runtime_error("lockstep: " + c10d::opTypeToString(opType_) + " did not finish within " +
                               log::seconds_text(static_cast<double>(timeout.count()) / 1000) +
                               " of waiting (it keeps running; wait again, or exit)");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

std::vector<at::Tensor> LockstepWork::result() {
  return outputs_;
}

c10::intrusive_ptr<c10::ivalue::Future> LockstepWork::getFuture() {
  return future_;
}

namespace {
// More threads than this means callbacks nest without end; the pool stops growing (and logs).
constexpr std::size_t kMaxCompletionThreads = 64;
}  // namespace

namespace {
// Every live pool's state, for quiesce_all.
std::mutex& registry_mu() {
  static std::mutex mu;
  return mu;
}
std::vector<std::weak_ptr<void>>& registry() {
  static std::vector<std::weak_ptr<void>> states;
  return states;
}
}  // namespace

CompletionPool::CompletionPool() : state_(std::make_shared<State>()) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    start_thread(state_);
  }
  std::lock_guard<std::mutex> lock(registry_mu());
  auto& states = registry();
  states.erase(std::remove_if(states.begin(), states.end(), [](const auto& w) { return w.expired(); }),
               states.end());
  states.push_back(state_);
}

void CompletionPool::quiesce_all(std::chrono::milliseconds timeout) {
  std::vector<std::shared_ptr<State>> states;
  {
    std::lock_guard<std::mutex> lock(registry_mu());
    for (const auto& w : registry())
      if (auto s = w.lock()) states.push_back(std::static_pointer_cast<State>(s));
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (const auto& state : states) {
    std::unique_lock<std::mutex> lock(state->mu);
    if (!state->cv.wait_until(lock, deadline, [&] { return state->queue.empty() && state->busy == 0; }))
      LOCKSTEP_LOG(warn, comm) << "exiting while a collective's completion still runs";
  }
}

CompletionPool::~CompletionPool() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stopping = true;
  }
  state_->cv.notify_all();
  // Threads may still start others while they drain the queue: join until none is left.
  std::vector<std::thread> threads;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      if (state_->threads.empty()) break;
      threads.swap(state_->threads);
    }
    for (auto& t : threads) {
      if (t.get_id() == std::this_thread::get_id()) {
        t.detach();  // we are inside this thread's callback; it ends when that returns
      } else {
        t.join();
      }
    }
    threads.clear();
  }
}

void CompletionPool::start_thread(const std::shared_ptr<State>& state) {
  if (state->threads.size() >= kMaxCompletionThreads) {
    LOCKSTEP_LOG(warn, comm) << "all " << state->threads.size() << " completion threads wait inside futures' "
                             << "callbacks; later collectives complete only when one returns";
    return;
  }
  ++state->free;
  state->threads.emplace_back([state] { loop(state); });
}

void CompletionPool::in_callbacks(const std::shared_ptr<State>& state, bool entering) {
  std::lock_guard<std::mutex> lock(state->mu);
  if (entering) {
    if (--state->free == 0 && !state->stopping) start_thread(state);
  } else {
    ++state->free;
  }
}

void CompletionPool::push(c10::intrusive_ptr<LockstepWork> work) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->queue.push_back(std::move(work));
  }
  state_->cv.notify_one();
}

void CompletionPool::loop(std::shared_ptr<State> state) {
  const std::function<void(bool)> bracket = [state](bool entering) { in_callbacks(state, entering); };
  std::unique_lock<std::mutex> lock(state->mu);
  for (;;) {
    state->cv.wait(lock, [&] { return state->stopping || !state->queue.empty(); });
    if (state->queue.empty()) return;
    auto work = std::move(state->queue.front());
    state->queue.pop_front();
    ++state->busy;
    lock.unlock();
    try {
      work->complete(bracket);  // errors land in the Work and its Future
    } catch (const std::exception& e) {
      // A Future callback that threw past the Future (c10 catches those it wraps): keep going,
      // later works must still complete.
      LOCKSTEP_LOG(warn, comm) << "a callback of a completed collective failed: " << e.what();
    }
    work.reset();  // drop it before sleeping: it may hold the last reference to large tensors
    lock.lock();
    if (--state->busy == 0 && state->queue.empty()) state->cv.notify_all();  // quiesce_all waits for this
  }
}

}  // namespace lockstep::torch_backend
