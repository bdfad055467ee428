// Communicator: issue-order queue, progress thread, error latching, backend factory.
//
// Threading model (three phases, as in c10d's Work): the caller's thread validates the
// arguments and enqueues a Collective with the next sequence number (prepare); the progress
// thread pops collectives in order and runs them on the backend (run); the caller waits on the
// Work (sync). The first error a backend throws is latched: the progress thread fails every
// queued and later collective with it, since the ranks are no longer in step. A fourth thread,
// the watchdog (watchdog.h), looks at the queue a few times per peer_check and acts only when a
// collective stalls or fails.
#include "lockstep/comm/communicator.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <optional>
#include <mutex>
#include <sstream>
#include <thread>

#include "backend.h"
#include "flight_ring.h"
#include "work_queue.h"
#include "locality.h"
#include "p2p/mailbox.h"
#include "watchdog.h"
#ifdef LOCKSTEP_HAVE_NCCL
#include "nccl/cuda_libraries.h"
#endif
#include "lockstep/base/log.h"
#include "lockstep/comm/backends.h"
#include "lockstep/comm/net_address.h"
#include "lockstep/error.h"

namespace lockstep::comm {

void WorkQueue::run(std::unique_lock<std::mutex>& lock, WorkState& w) {
  std::exception_ptr error = broken;
  const auto start = Clock::now();
  in_flight = w.collective;
  state_since = start;
  ++events;
  ring.started(w.collective.sequence, start);
  lock.unlock();
  std::string what;
  if (!error) {
    try {
      backend->run(w.collective);
    } catch (const std::exception& e) {
      error = std::current_exception();
      what = e.what();
      LOCKSTEP_LOG(debug, comm) << what;
    }
  }
  const auto end = Clock::now();
  lock.lock();
  in_flight.reset();
  state_since = end;
  ++events;
  ring.finished(w.collective.sequence, end);
  if (error && !broken) {
    broken = error;
    broken_text = what;
    if (on_broken) on_broken();
  }
  w.seconds = Seconds(end - start).count();
  busy_seconds += w.seconds;
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
      throw TimeoutError(state_->describe() + " did not finish within " +
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

int Work::source_rank() const {
  std::lock_guard<std::mutex> lock(state_->queue->mu);
  return state_->source;
}

Communicator::Communicator(int rank, int size, std::unique_ptr<Backend> backend, CommOptions options,
                           std::shared_ptr<StoreClient> store)
    : rank_(rank),
      size_(size),
      options_(std::move(options)),
      backend_(std::move(backend)),
      queue_(std::make_unique<WorkQueue>()) {
  queue_->backend = backend_.get();
  queue_->collective_timeout = options_.timeout;
  // The progress thread marks this rank alive for its peers (shm: a robust mutex it holds, which
  // the kernel hands over as owner-dead when the process dies). Collectives may run on the
  // caller's thread before that thread is ever scheduled, so the mark is made before the
  // constructor returns: a rank killed right after its first collectives is then seen as dead,
  // not as one that has not started (which peers wait out until the collective's timeout).
  std::promise<void> marked;
  std::future<void> ready = marked.get_future();
  queue_->thread = std::thread([this, &marked] {
    WorkQueue& q = *queue_;
    backend_->on_thread_start();
    marked.set_value();
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
  ready.wait();
  store_ = store;
  if (store && size_ > 1) start_watchdog(std::move(store));
}

void Communicator::start_watchdog(std::shared_ptr<StoreClient> store) {
  WorkQueue& q = *queue_;
  Watchdog::Hooks hooks;
  hooks.look = [&q] {
    std::lock_guard<std::mutex> lock(q.mu);
    Watchdog::Look look;
    look.in_flight = q.in_flight.has_value();
    if (q.in_flight) look.collective = *q.in_flight;
    look.since = q.state_since;
    look.events = q.events;
    look.error = q.broken_text;
    return look;
  };
  hooks.record = [this] {
    std::lock_guard<std::mutex> lock(queue_->mu);
    return queue_->ring.record(rank_, backend_->name(), Clock::now());
  };
  watchdog_ = std::make_unique<Watchdog>(std::move(store), flight_key(options_.name, rank_),
                                         std::min(options_.peer_check, options_.timeout), *backend_,
                                         std::move(hooks));
  std::lock_guard<std::mutex> lock(q.mu);
  q.on_broken = [w = watchdog_.get()] { w->wake(); };
}

Communicator::~Communicator() {
  {
    std::lock_guard<std::mutex> lock(queue_->mu);
    queue_->stopping = true;
  }
  queue_->work_cv.notify_all();
  queue_->thread.join();  // runs what was issued (peers expect it), watched as ever
  mailbox_.reset();       // sends what was issued, fails the recvs still waiting
  if (watchdog_) {
    {
      std::lock_guard<std::mutex> lock(queue_->mu);
      queue_->on_broken = nullptr;
    }
    watchdog_.reset();
  }
  backend_.reset();
}

const std::string& Communicator::backend_name() const {
  return backend_->name();
}

bool Communicator::takes_device_memory() const {
  return backend_->takes_device_memory();
}

NetworkStats Communicator::network_stats() const {
  return backend_->network_stats();
}

namespace {
// GPU memory where only host memory will do is a ConfigError, not a crash in a copy loop.
void require_host_memory(const void* p, const char* what, const char* operation, const std::string& reader,
                         const char* instead) {
#ifdef LOCKSTEP_HAVE_NCCL
  if (nccl::is_gpu_memory(p))
    throw ConfigError(std::string(operation) + ": the " + what + " is GPU memory, which " + reader +
                      " cannot read: copy it to the host first" + instead);
#else
  (void)p, (void)what, (void)operation, (void)reader, (void)instead;
#endif
}

void require_buffer(const Backend& backend, const void* p, std::size_t count, const char* what,
                    const char* collective) {
  if (p == nullptr && count > 0)
    throw ConfigError(std::string(collective) + ": " + what + " is null but count is " +
                      std::to_string(count));
  if (!backend.takes_device_memory())
    require_host_memory(p, what, collective, "the " + backend.name() + " backend", ", or use the nccl backend");
}

void require_device_backend(const Backend& backend, DeviceReady ready, const char* collective) {
  if (ready.event && !backend.takes_device_memory())
    throw ConfigError(std::string(collective) + ": an event to wait for on the GPU was given to the " + backend.name() +
                      " backend, which reads host memory only: copy the buffers to the host once the device is done "
                      "with them, or use the nccl backend");
}

void require_reduction(ReduceOp op, DType dtype, const char* collective) {
  if (!is_valid_reduction(op, dtype))
    throw ConfigError(std::string(collective) + ": " + reduce_op_name(op) + " is bitwise and applies to i32 and i64, not " +
                      dtype_name(dtype));
}
// An all-reduce or a reduce-scatter, its buffers, reduction and device readiness checked.
Collective checked_reduction(const Backend& backend, CollectiveKind kind, const char* name, const void* send,
                             void* recv, std::size_t count, DType dtype, ReduceOp op, DeviceReady ready) {
  require_buffer(backend, send, count, "send buffer", name);
  require_buffer(backend, recv, count, "recv buffer", name);
  require_reduction(op, dtype, name);
  require_device_backend(backend, ready, name);
  Collective c = Collective::of(kind, send, recv, count, dtype, op);
  c.ready = ready;
  return c;
}

}  // namespace

WorkPtr Communicator::send(const void* buffer, std::size_t count, DType dtype, int dst, int tag) {
  if (!mailbox_) throw ConfigError("send: point-to-point is unavailable on this communicator: " + mailbox_error_);
  require_host_memory(buffer, "buffer", "send", "point-to-point (TCP from host memory)", "");
  return mailbox_->send(buffer, count, dtype, dst, tag);
}

WorkPtr Communicator::recv(void* buffer, std::size_t count, DType dtype, int src, int tag) {
  if (!mailbox_) throw ConfigError("recv: point-to-point is unavailable on this communicator: " + mailbox_error_);
  require_host_memory(buffer, "buffer", "recv", "point-to-point (TCP into host memory)", "");
  return mailbox_->recv(buffer, count, dtype, src, tag);
}

WorkPtr Communicator::send_described(const std::string& description, const void* buffer, std::size_t count,
                                     DType dtype, int dst, int tag) {
  if (!mailbox_) throw ConfigError("send: point-to-point is unavailable on this communicator: " + mailbox_error_);
  require_host_memory(buffer, "buffer", "send", "point-to-point (from host memory)", "");
  return mailbox_->send(buffer, count, dtype, dst, tag, description);
}

WorkPtr Communicator::recv_described(Place place, int src, int tag) {
  if (!mailbox_) throw ConfigError("recv: point-to-point is unavailable on this communicator: " + mailbox_error_);
  return mailbox_->recv_placed(std::move(place), src, tag);
}

bool Communicator::shares_memory_with(int dst) const {
  return mailbox_ && mailbox_->shares_memory_with(dst);
}

std::uint64_t Communicator::issued() const {
  std::lock_guard<std::mutex> lock(queue_->mu);
  return queue_->next_sequence;
}

double Communicator::busy_seconds() const {
  std::lock_guard<std::mutex> lock(queue_->mu);
  return queue_->busy_seconds;
}

WorkPtr Communicator::enqueue(Collective c) {
  auto w = std::make_shared<WorkState>();
  w->queue = queue_.get();
  {
    std::lock_guard<std::mutex> lock(queue_->mu);
    c.sequence = queue_->next_sequence++;
    w->collective = c;
    queue_->ring.issued(c, Clock::now());
    queue_->pending.push_back(w);
  }
  queue_->work_cv.notify_one();
  return std::make_shared<Work>(w);
}


WorkPtr Communicator::allreduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                                DeviceReady ready) {
  return enqueue(
      checked_reduction(*backend_, CollectiveKind::allreduce, "allreduce", send, recv, count, dtype, op, ready));
}

WorkPtr Communicator::allreduce(float* buffer, std::size_t count, ReduceOp op, Codec codec) {
  require_buffer(*backend_, buffer, count, "buffer", "allreduce");
  if (op != ReduceOp::sum && op != ReduceOp::avg)
    throw ConfigError(std::string("allreduce with a codec: ") + reduce_op_name(op) +
                      " is not one a codec can estimate; use sum or avg");
  if (!codec) throw ConfigError("allreduce with a codec: the codec is empty");
  Collective c = Collective::of(CollectiveKind::allreduce, buffer, buffer, count, DType::f32, op);
  c.codec = std::make_shared<const Codec>(std::move(codec));
  return enqueue(c);
}

WorkPtr Communicator::broadcast(void* buffer, std::size_t count, DType dtype, int root) {
  require_buffer(*backend_, buffer, count, "buffer", "broadcast");
  if (root < 0 || root >= size_)
    throw ConfigError("broadcast: root " + std::to_string(root) + " is not a rank of this " +
                      std::to_string(size_) + "-rank communicator");
  Collective c = Collective::of(CollectiveKind::broadcast, buffer, buffer, count, dtype);
  c.root = root;
  return enqueue(c);
}

WorkPtr Communicator::allgather(const void* send, void* recv, std::size_t count, DType dtype) {
  require_buffer(*backend_, send, count, "send buffer", "allgather");
  require_buffer(*backend_, recv, count, "recv buffer", "allgather");
  return enqueue(Collective::of(CollectiveKind::allgather, send, recv, count, dtype));
}

WorkPtr Communicator::allgather_machine(const void* send, void* recv, std::size_t count, DType dtype) {
  require_buffer(*backend_, send, count, "send buffer", "allgather_machine");
  require_buffer(*backend_, recv, count, "recv buffer", "allgather_machine");
  Collective c = Collective::of(CollectiveKind::allgather, send, recv, count, dtype);
  c.machine_memory = size_ > 1;  // one rank: its own memory is its machine's
  return enqueue(c);
}

WorkPtr Communicator::reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype,
                                     ReduceOp op, DeviceReady ready) {
  return enqueue(checked_reduction(*backend_, CollectiveKind::reduce_scatter, "reduce_scatter", send, recv, count,
                                   dtype, op, ready));
}

WorkPtr Communicator::barrier() {
  return enqueue(Collective{});
}

std::shared_ptr<void> Communicator::allocate_machine_memory(std::size_t bytes) {
  if (size_ == 1) return std::shared_ptr<void>(std::calloc(std::max<std::size_t>(bytes, 1), 1), std::free);
  std::shared_ptr<void> memory;
  std::string failure;
  try {
    memory = backend_->allocate_machine_memory(bytes);
  } catch (const Error& e) {
    failure = e.what();
  }
  // All or none: a rank that could not map its machine's block fails every rank, by name.
  std::int32_t state = !failure.empty() ? 0 : memory ? 2 : 1;
  std::int32_t least = state;
  allreduce(&state, &least, 1, DType::i32, ReduceOp::min)->wait();
  if (least == 0)
    throw SystemError(failure.empty() ? "machine memory of " + std::to_string(bytes) +
                                            " bytes could not be made on another rank (see its message)"
                                      : failure);
  if (least != 2) return nullptr;
  backend_->machine_memory_mapped(memory.get());  // every rank holds it: its name can go
  return memory;
}

bool Communicator::has_machine_memory() const {
  return size_ == 1 || backend_->has_machine_memory();
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

std::vector<std::string> available_backends() {
  std::vector<std::string> names{"shm"};
#ifdef LOCKSTEP_HAVE_GLOO
  names.push_back("gloo");
  names.push_back("hier");
#endif
#ifdef LOCKSTEP_HAVE_MPI
  names.push_back("mpi");
#endif
#ifdef LOCKSTEP_HAVE_NCCL
  names.push_back("nccl");
#endif
  return names;
}

namespace {

// Each collective creation of a communicator with this name is one generation; a rank's join
// number tells it which. Generations cannot interleave, because creation returns only after
// all ranks of its generation joined. Fresh keys per generation mean a second communicator
// never reads the first one's.
std::string generation_prefix(StoreClient& store, const CommOptions& options, int size) {
  const std::string base = "comm/" + options.name + "/";
  const std::int64_t join = store.add(base + "joins", 1);
  return base + std::to_string((join - 1) / size) + "/";
}

// Every rank must have been started with the same world size.
void agree_on_size(StoreClient& store, const std::string& prefix, int rank, int size, Seconds timeout) {
  store.set(prefix + "size/" + std::to_string(rank), std::to_string(size));
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(prefix + "size/" + std::to_string(r));
  try {
    store.wait(keys, timeout);
  } catch (const TimeoutError& e) {
    throw TimeoutError("rank " + std::to_string(rank) + " waited " + log::seconds_text(timeout.count()) +
                       " for all " + std::to_string(size) + " ranks to join: " + e.what() +
                       ". Did every rank start, with the same WORLD_SIZE?");
  }
  for (int r = 0; r < size; ++r) {
    const std::string other = store.get(keys[static_cast<std::size_t>(r)]);
    if (other != std::to_string(size))
      throw ConfigError("rank " + std::to_string(r) + " says WORLD_SIZE=" + other + " but rank " +
                        std::to_string(rank) + " says " + std::to_string(size) +
                        ": start every rank with the same WORLD_SIZE");
  }
}

Locality declared_locality(const std::vector<int>& machine_of, int size) {
  if (static_cast<int>(machine_of.size()) != size)
    throw ConfigError("CommOptions::machine_of lists " + std::to_string(machine_of.size()) + " ranks for a " +
                      std::to_string(size) + "-rank communicator");
  std::vector<std::vector<int>> sees(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r)
    for (int q = 0; q < size; ++q)
      if (machine_of[static_cast<std::size_t>(r)] == machine_of[static_cast<std::size_t>(q)])
        sees[static_cast<std::size_t>(r)].push_back(q);
  return locality_from(sees);
}

// auto: shm on one machine; gloo when every machine holds one rank; hier otherwise, unequal
// numbers of ranks per machine included.
std::string resolve_backend(const std::string& asked, const Locality& where) {
  if (asked != "auto") return asked;
  if (where.one_machine()) return "shm";
  if (where.machines == where.size()) return "gloo";
  return "hier";
}

std::unique_ptr<Backend> make_backend(const std::string& backend, const BackendContext& ctx) {
  if (backend == "shm") {
    if (!ctx.locality.one_machine())
      throw ConfigError("backend 'shm' needs every rank on one machine, but they are on " +
                        ctx.locality.describe() + ": use --backend auto, which picks hier across machines");
    return make_shm_backend(ctx);
  }
#ifdef LOCKSTEP_HAVE_GLOO
  if (backend == "gloo") return make_gloo_backend(ctx);
  if (backend == "hier") return make_hier_backend(ctx);
#else
  if (backend == "gloo" || backend == "hier")
    throw ConfigError("this lockstep was built without gloo, which '" + backend +
                      "' needs (install libgloo-dev and rebuild)");
#endif
#ifdef LOCKSTEP_HAVE_MPI
  if (backend == "mpi") return make_mpi_backend(ctx);
#else
  if (backend == "mpi")
    throw ConfigError("this lockstep was built without MPI (install libopenmpi-dev and rebuild)");
#endif
#ifdef LOCKSTEP_HAVE_NCCL
  if (backend == "nccl") return make_nccl_backend(ctx);
#else
  if (backend == "nccl")
    throw ConfigError("this lockstep was built without NCCL's headers (nccl.h, cuda.h: the CUDA toolkit), which "
                      "'nccl' needs; install it and rebuild");
#endif
  throw ConfigError("unknown backend '" + backend + "': use " + backend_choices(", "));
}

// The point-to-point mailbox, its address published on the store before the backend's own
// rendezvous, so that every peer's is there by the time any rank can send. A network that
// offers no port leaves the communicator without point-to-point (said on use), not broken.
std::unique_ptr<Mailbox> open_mailbox(const std::shared_ptr<StoreClient>& store, const std::string& prefix, int rank,
                                      int size, const CommOptions& options, std::string& error) {
  try {
    auto mailbox = std::make_unique<Mailbox>(rank, size, choose_bind_address(store->options().host).address, options);
    store->set(prefix + "p2p/" + std::to_string(rank), mailbox->address());
    mailbox->set_lookup([store, prefix, timeout = options.timeout](int r) {
      return store->get(prefix + "p2p/" + std::to_string(r), timeout);
    });
    return mailbox;
  } catch (const ConfigError& e) {
    error = e.what();
    LOCKSTEP_LOG(debug, comm) << "no point-to-point: " << error;
    return nullptr;
  }
}

}  // namespace

std::unique_ptr<Communicator> Communicator::create(std::shared_ptr<StoreClient> store, int rank, int size,
                                                   CommOptions options) {
  if (size < 1) throw ConfigError("communicator size must be >= 1, got " + std::to_string(size));
  if (rank < 0 || rank >= size)
    throw ConfigError("rank " + std::to_string(rank) + " is outside 0.." + std::to_string(size - 1) +
                      " (RANK must be < WORLD_SIZE)");
  if (!store) {
#ifdef LOCKSTEP_HAVE_MPI
    if (options.backend == "mpi") {
      BackendContext ctx{nullptr, "", rank, size, options, {}};
      auto backend = make_mpi_backend(ctx);
      // No store: the ranks tell each other where they listen with one MPI allgather, made here
      // before any collective can be on the progress thread.
      auto mailbox = std::make_unique<Mailbox>(rank, size, choose_bind_address_without_master().address, options);
      auto where = mpi_allgather_text(mailbox->address());
      mailbox->set_lookup([where](int r) { return where[static_cast<std::size_t>(r)]; });
      std::unique_ptr<Communicator> comm(new Communicator(rank, size, std::move(backend), std::move(options), nullptr));
      comm->mailbox_ = std::move(mailbox);
      return comm;
    }
#endif
    throw ConfigError("Communicator::create needs a store client (only the mpi backend runs without one)");
  }
  const std::string prefix = generation_prefix(*store, options, size);
  agree_on_size(*store, prefix, rank, size, options.timeout);
  std::string mailbox_error;
  auto mailbox = open_mailbox(store, prefix, rank, size, options, mailbox_error);
  const Locality where = options.machine_of.empty()
                             ? probe_locality(*store, prefix, rank, size, options.timeout)
                             : declared_locality(options.machine_of, size);
  const std::string backend = resolve_backend(options.backend, where);
  BackendContext ctx{store, prefix + backend + "/", rank, size, options, where};
  auto impl = make_backend(backend, ctx);
  LOCKSTEP_LOG(debug, comm) << "communicator '" << options.name << "' up: rank " << rank << " of " << size
                            << " on " << backend << " (" << where.describe() << ")";
  std::unique_ptr<Communicator> comm(new Communicator(rank, size, std::move(impl), std::move(options), std::move(store)));
  if (mailbox) mailbox->set_machines(where.machine_of);
  comm->mailbox_ = std::move(mailbox);
  comm->mailbox_error_ = mailbox_error;
  comm->machine_of_ = where.machine_of;
  return comm;
}

std::unique_ptr<Communicator> Communicator::machine_communicator() {
  if (!store_ || machine_of_.empty())
    throw ConfigError("communicator '" + options_.name +
                      "' does not know which ranks share a machine (mpi without a store): it cannot make a "
                      "communicator per machine");
  const int machine = machine_of_[static_cast<std::size_t>(rank_)];
  int local_rank = 0, local_size = 0;
  for (int r = 0; r < size_; ++r) {
    if (machine_of_[static_cast<std::size_t>(r)] != machine) continue;
    if (r == rank_) local_rank = local_size;
    ++local_size;
  }
  CommOptions options = options_;
  options.name = options_.name + "/machine-" + std::to_string(machine);
  options.backend = "shm";
  options.machine_of.assign(static_cast<std::size_t>(local_size), 0);
  return create(store_, local_rank, local_size, std::move(options));
}

std::unique_ptr<Communicator> Communicator::group(const std::vector<int>& members, const std::string& name) {
  const std::string what = "group '" + name + "' of communicator '" + options_.name + "'";
  if (!store_ || machine_of_.empty())
    throw ConfigError(what + ": this communicator has no store (mpi started without one), so it cannot make groups");
  int index = -1;
  std::vector<int> machines;
  for (std::size_t i = 0; i < members.size(); ++i) {
    const int r = members[i];
    if (r < 0 || r >= size_) throw ConfigError(what + " names rank " + std::to_string(r) + " of " + std::to_string(size_));
    if (r == rank_) index = static_cast<int>(i);
    machines.push_back(machine_of_[static_cast<std::size_t>(r)]);
  }
  if (index < 0) throw ConfigError(what + ": rank " + std::to_string(rank_) + " is not one of its members");
  CommOptions options = options_;
  options.name = options_.name + "/" + name;
  const std::string& backend = backend_name();
  options.backend = backend == "hier" || options_.backend == "auto" ? "auto" : backend == "mpi" ? "gloo" : backend;
  options.machine_of = std::move(machines);
  return create(store_, index, static_cast<int>(members.size()), std::move(options));
}

}  // namespace lockstep::comm
