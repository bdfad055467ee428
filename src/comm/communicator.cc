// Communicator: issue-order queue, progress thread, error latching, backend factory.
//
// Threading model (three phases, as in c10d's Work): the caller's thread validates the
// arguments and enqueues a Collective with the next sequence number (prepare); the progress
// thread pops collectives in order and runs them on the backend (run); the caller waits on the
// Work (sync). The first error a backend throws is latched: the progress thread fails every
// queued and later collective with it, since the ranks are no longer in step.
#include "lockstep/comm/communicator.h"

#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <sstream>
#include <thread>

#include "backend.h"
#include "lockstep/base/log.h"
#include "lockstep/error.h"

namespace lockstep::comm {

// All work state of one communicator is guarded by its queue's mutex: completions are rare
// enough (one per collective) that one lock is simpler than one per Work, and it lets a waiting
// caller take over a collective the progress thread has not started (see Work::wait).
struct Communicator::Queue {
  std::mutex mu;
  std::condition_variable work_cv;  // the progress thread sleeps here
  std::condition_variable done_cv;  // callers of Work::wait sleep here
  std::deque<std::shared_ptr<WorkState>> pending;
  bool running = false;  // a collective is on the backend (by either thread)
  bool stopping = false;
  std::uint64_t next_sequence = 0;
  std::exception_ptr broken;  // the first error; later collectives fail with it
  Backend* backend = nullptr;
  Seconds collective_timeout{300};
  std::thread thread;

  // Runs the front collective with `lock` released; the caller set running = true.
  void run(std::unique_lock<std::mutex>& lock, WorkState& w);
};

struct WorkState {
  Communicator::Queue* queue;
  bool done = false;
  std::exception_ptr error;
  double seconds = 0;
  Clock::time_point started{}, finished{};
  Collective collective;
};

void Communicator::Queue::run(std::unique_lock<std::mutex>& lock, WorkState& w) {
  std::exception_ptr error = broken;
  lock.unlock();
  auto start = Clock::now();
  if (!error) {
    try {
      backend->run(w.collective);
    } catch (const std::exception& e) {
      error = std::current_exception();
      LOCKSTEP_LOG(debug, comm) << e.what();
    }
  }
  auto end = Clock::now();
  lock.lock();
  if (error && !broken) broken = error;
  w.seconds = Seconds(end - start).count();
  w.started = start;
  w.finished = end;
  w.error = error;
  w.done = true;
  running = false;
  done_cv.notify_all();
  work_cv.notify_one();
}

bool Work::done() const {
  std::lock_guard<std::mutex> lock(state_->queue->mu);
  return state_->done;
}

// A caller that waits for a collective nobody has started yet runs it on its own thread: a
// synchronous collective then costs no thread hand-off (two context switches, ~10 us). The
// order is kept, since only the queue's front is taken and only while nothing else runs. A
// wait shorter than the collective's own deadline leaves it to the progress thread, so that
// the wait can return on time.
void Work::wait(Seconds timeout) {
  auto& q = *state_->queue;
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout);
  std::unique_lock<std::mutex> lock(q.mu);
  bool may_run_here = timeout >= q.collective_timeout;
  while (!state_->done) {
    if (may_run_here && !q.running && !q.pending.empty() && q.pending.front() == state_) {
      q.pending.pop_front();
      q.running = true;
      q.run(lock, *state_);
      continue;
    }
    if (q.done_cv.wait_until(lock, deadline) == std::cv_status::timeout && !state_->done)
      throw TimeoutError(state_->collective.describe() + " did not finish within " +
                         log::seconds_text(timeout.count()) + " of waiting");
  }
  if (state_->error) std::rethrow_exception(state_->error);
}

double Work::seconds() const {
  std::lock_guard<std::mutex> lock(state_->queue->mu);
  return state_->seconds;
}

std::chrono::steady_clock::time_point Work::started() const {
  std::lock_guard<std::mutex> lock(state_->queue->mu);
  return state_->started;
}

std::chrono::steady_clock::time_point Work::finished() const {
  std::lock_guard<std::mutex> lock(state_->queue->mu);
  return state_->finished;
}

std::uint64_t Work::sequence() const {
  return state_->collective.sequence;
}

Communicator::Communicator(int rank, int size, std::unique_ptr<Backend> backend, CommOptions options)
    : rank_(rank),
      size_(size),
      options_(std::move(options)),
      backend_(std::move(backend)),
      queue_(std::make_unique<Queue>()) {
  queue_->backend = backend_.get();
  queue_->collective_timeout = options_.timeout;
  queue_->thread = std::thread([this] {
    Queue& q = *queue_;
    backend_->on_thread_start();
    std::unique_lock<std::mutex> lock(q.mu);
    for (;;) {
      q.work_cv.wait(lock, [&] { return (q.stopping && !q.running) || (!q.running && !q.pending.empty()); });
      if (q.pending.empty()) break;
      auto w = std::move(q.pending.front());
      q.pending.pop_front();
      q.running = true;
      q.run(lock, *w);
    }
    lock.unlock();
    backend_->on_thread_stop();
  });
}

Communicator::~Communicator() {
  {
    std::lock_guard<std::mutex> lock(queue_->mu);
    queue_->stopping = true;
  }
  queue_->work_cv.notify_all();
  queue_->thread.join();  // runs what was issued: peers expect it
  backend_.reset();
}

const std::string& Communicator::backend_name() const {
  return backend_->name();
}

std::uint64_t Communicator::issued() const {
  std::lock_guard<std::mutex> lock(queue_->mu);
  return queue_->next_sequence;
}

WorkPtr Communicator::enqueue(Collective c) {
  auto w = std::make_shared<WorkState>();
  w->queue = queue_.get();
  {
    std::lock_guard<std::mutex> lock(queue_->mu);
    c.sequence = queue_->next_sequence++;
    w->collective = c;
    queue_->pending.push_back(w);
  }
  queue_->work_cv.notify_one();
  return std::make_shared<Work>(w);
}

namespace {
void require_buffer(const void* p, std::size_t count, const char* what, const char* collective) {
  if (p == nullptr && count > 0)
    throw ConfigError(std::string(collective) + ": " + what + " is null but count is " +
                      std::to_string(count));
}
}  // namespace

WorkPtr Communicator::allreduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op) {
  require_buffer(send, count, "send buffer", "allreduce");
  require_buffer(recv, count, "recv buffer", "allreduce");
  Collective c;
  c.kind = CollectiveKind::allreduce;
  c.send = send;
  c.recv = recv;
  c.count = count;
  c.dtype = dtype;
  c.op = op;
  return enqueue(c);
}

WorkPtr Communicator::broadcast(void* buffer, std::size_t count, DType dtype, int root) {
  require_buffer(buffer, count, "buffer", "broadcast");
  if (root < 0 || root >= size_)
    throw ConfigError("broadcast: root " + std::to_string(root) + " is not a rank of this " +
                      std::to_string(size_) + "-rank communicator");
  Collective c;
  c.kind = CollectiveKind::broadcast;
  c.send = buffer;
  c.recv = buffer;
  c.count = count;
  c.dtype = dtype;
  c.root = root;
  return enqueue(c);
}

WorkPtr Communicator::allgather(const void* send, void* recv, std::size_t count, DType dtype) {
  require_buffer(send, count, "send buffer", "allgather");
  require_buffer(recv, count, "recv buffer", "allgather");
  Collective c;
  c.kind = CollectiveKind::allgather;
  c.send = send;
  c.recv = recv;
  c.count = count;
  c.dtype = dtype;
  return enqueue(c);
}

WorkPtr Communicator::reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype,
                                     ReduceOp op) {
  require_buffer(send, count, "send buffer", "reduce_scatter");
  require_buffer(recv, count, "recv buffer", "reduce_scatter");
  Collective c;
  c.kind = CollectiveKind::reduce_scatter;
  c.send = send;
  c.recv = recv;
  c.count = count;
  c.dtype = dtype;
  c.op = op;
  return enqueue(c);
}

WorkPtr Communicator::barrier() {
  return enqueue(Collective{});
}

std::shared_ptr<void> Communicator::allocate_shared(std::size_t bytes) {
  if (size_ == 1 || !backend_->shares_memory()) return nullptr;
  auto memory = backend_->allocate_shared(bytes);
  // All or none: one rank short of /dev/shm makes every rank use private memory.
  std::int32_t ok = memory ? 1 : 0;
  allreduce(&ok, 1, DType::i32, ReduceOp::min)->wait();
  return ok ? memory : nullptr;
}

// --- creation -------------------------------------------------------------------------------

namespace {

std::string host_identity() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  // Two containers may share a hostname but not a kernel boot: add the boot id when readable.
  std::string boot;
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char buf[64] = {};
    if (std::fgets(buf, sizeof buf, f)) boot = buf;
    std::fclose(f);
    while (!boot.empty() && (boot.back() == '\n')) boot.pop_back();
  }
  return std::string(host) + "/" + boot;
}

}  // namespace

std::vector<std::string> available_backends() {
  std::vector<std::string> names{"shm"};
#ifdef LOCKSTEP_HAVE_GLOO
  names.push_back("gloo");
#endif
#ifdef LOCKSTEP_HAVE_MPI
  names.push_back("mpi");
#endif
  return names;
}

std::unique_ptr<Communicator> Communicator::create(std::shared_ptr<StoreClient> store, int rank, int size,
                                                   CommOptions options) {
  if (size < 1) throw ConfigError("communicator size must be >= 1, got " + std::to_string(size));
  if (rank < 0 || rank >= size)
    throw ConfigError("rank " + std::to_string(rank) + " is outside 0.." + std::to_string(size - 1) +
                      " (RANK must be < WORLD_SIZE)");
  if (!store) {
#ifdef LOCKSTEP_HAVE_MPI
    if (options.backend == "mpi") {
      BackendContext ctx{nullptr, "", rank, size, options};
      return std::unique_ptr<Communicator>(
          new Communicator(rank, size, make_mpi_backend(ctx), std::move(options)));
    }
#endif
    throw ConfigError(
        "Communicator::create needs a store client (only the mpi backend runs "
        "without one)");
  }

  // Each collective creation of a communicator with this name is one generation; a rank's
  // join number tells it which. Generations cannot interleave, because creation returns only
  // after all ranks of its generation joined. Fresh keys per generation mean a second
  // communicator never reads the first one's.
  std::string base = "comm/" + options.name + "/";
  std::int64_t join = store->add(base + "joins", 1);
  std::string prefix = base + std::to_string((join - 1) / size) + "/";

  // Agree on size and the backend; find out whether all ranks share a host.
  std::string my_host = host_identity();
  store->set(prefix + "size/" + std::to_string(rank), std::to_string(size));
  store->set(prefix + "host/" + std::to_string(rank), my_host);
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(prefix + "host/" + std::to_string(r));
  try {
    store->wait(keys, options.timeout);
  } catch (const TimeoutError& e) {
    throw TimeoutError("rank " + std::to_string(rank) + " waited " +
                       log::seconds_text(options.timeout.count()) + " for all " + std::to_string(size) +
                       " ranks to join: " + e.what() + ". Did every rank start, with the same WORLD_SIZE?");
  }
  bool one_host = true;
  for (int r = 0; r < size; ++r) {
    std::string other = store->get(prefix + "size/" + std::to_string(r));
    if (other != std::to_string(size))
      throw ConfigError("rank " + std::to_string(r) + " says WORLD_SIZE=" + other + " but rank " +
                        std::to_string(rank) + " says " + std::to_string(size) +
                        ": start every rank with the same WORLD_SIZE");
    if (store->get(keys[static_cast<std::size_t>(r)]) != my_host) one_host = false;
  }

  std::string backend = options.backend;
  if (backend == "auto") backend = one_host ? "shm" : "gloo";
  BackendContext ctx{store, prefix + backend + "/", rank, size, options};
  std::unique_ptr<Backend> impl;
  if (backend == "shm") {
    if (!one_host)
      throw ConfigError(
          "backend 'shm' needs every rank on one machine, but ranks run on several "
          "hosts: use --backend gloo (or auto)");
    impl = make_shm_backend(ctx);
  } else if (backend == "gloo") {
#ifdef LOCKSTEP_HAVE_GLOO
    impl = make_gloo_backend(ctx);
#else
    throw ConfigError("this lockstep was built without gloo (install libgloo-dev and rebuild)");
#endif
  } else if (backend == "mpi") {
#ifdef LOCKSTEP_HAVE_MPI
    impl = make_mpi_backend(ctx);
#else
    throw ConfigError("this lockstep was built without MPI (install libopenmpi-dev and rebuild)");
#endif
  } else {
    throw ConfigError("unknown backend '" + backend + "': use shm, gloo, mpi or auto");
  }
  LOCKSTEP_LOG(debug, comm) << "communicator '" << options.name << "' up: rank " << rank << " of " << size
                            << " on " << backend;
  return std::unique_ptr<Communicator>(new Communicator(rank, size, std::move(impl), std::move(options)));
}

}  // namespace lockstep::comm
