// The shm backend: collectives between processes of one machine through one POSIX
// shared-memory segment per communicator.
//
// Segment: a header (one control block per rank, each on its own cache lines) followed by one
// staging slot per rank of options.shm_slot_bytes, split in three parts used in turn. Rank 0 creates the
// segment; once every rank has mapped it, rank 0 unlinks the name, so the memory disappears with the last
// process even when ranks crash (no /dev/shm litter).
//
// Rounds: every collective is a sequence of rounds; round j writes this rank's part j % 3,
// crosses barrier j, then reads peers' parts. Data written in round j is read at the latest
// between barriers j+1 and j+2 (the pipelined allreduce, allreduce.cc); it is overwritten in round
// j+3, after the writer passed barrier j+2, which every rank reaches only after those reads.
// So a rank never waits for readers before writing. The first barrier of each collective also publishes its
// signature (kind, dtype, count, op, root), in a descriptor slot chosen by sequence parity for the same
// reason; every rank compares all signatures before touching data, so disagreeing ranks all fail together.
//
// Where each part lives (one algorithm per file, each opened by its steps and its cost):
//   shm_backend.h         the class, the segment's header and per-rank control blocks, and
//                         in_rounds(), the rounds of the staged broadcast, allgather, reduce_scatter
//   shm_backend.cc        this overview; making and checking the segment; the entry points, which
//                         set the deadline and report a failure to the peers; the dispatch
//   barrier.cc            the barrier: futex wait, peers' liveness, abort, deadline; begin()
//   shared_collectives.cc collectives on shared buffers: publishing, agreeing, mapping the peers'
//   allreduce.cc          allreduce: one-shot, pipelined, in place on shared buffers
//   broadcast.cc          broadcast
//   allgather.cc          allgather: staged, on shared buffers, into machine memory
//   reduce_scatter.cc     reduce_scatter: staged, on shared buffers
//   reduce.cc             the element-wise reduction kernels they all call
//   shm_buffers.h, machine_blocks.h, block_registry.h   the memory handed out (allocate_shared,
//                         allocate_machine_memory) and found again by address
#include "shm/shm_backend.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <new>
#include <thread>

#include "lockstep/error.h"
#include "shm/segment.h"

namespace lockstep::comm::shm {

ShmBackend::ShmBackend(const BackendContext& ctx)
    : rank_(ctx.rank), size_(ctx.size), options_(ctx.options), global_ranks_(ctx.global_ranks) {
  slot_bytes_ =
      round_up(std::max<std::size_t>(options_.shm_slot_bytes, 2 * kAlign * static_cast<std::size_t>(size_)),
               2 * kAlign);
  part_bytes_ = slot_bytes_ / kParts / kAlign * kAlign;
  std::size_t header_bytes = round_up(sizeof(Header) + size_ * sizeof(RankControl), 4096);
  total_bytes_ = header_bytes + slot_bytes_ * static_cast<std::size_t>(size_);
  std::string key = ctx.prefix + "segment";
  std::string name;
  shm::Mapping mapped;
  if (rank_ == 0) {  // reserved, not just sized: a full /dev/shm fails here, not with SIGBUS later
    name = shm::segment_name("comm");
    mapped = shm::create_segment(name, total_bytes_);
    if (!mapped.base) throw SystemError("shm: " + shm::describe_failure(mapped, name, total_bytes_));
  } else {
    name = ctx.store->get(key, options_.timeout);
    mapped = shm::open_segment(name, total_bytes_);
    if (!mapped.base)
      throw SystemError("shm: rank " + std::to_string(rank_) + " " +
                        shm::describe_failure(mapped, name, total_bytes_));
  }
  base_ = static_cast<char*>(mapped.base);
  own_.emplace(name, rank_);
  peers_.emplace(name);
  machine_.emplace(name, rank_);
  header_ = reinterpret_cast<Header*>(base_);
  controls_ = reinterpret_cast<RankControl*>(base_ + sizeof(Header));
  slots_ = base_ + header_bytes;

  if (rank_ == 0) {
    init_segment();
    ctx.store->set(key, name);
  } else if (header_->magic != kMagic || header_->size != static_cast<std::uint64_t>(size_) ||
             header_->slot_bytes != slot_bytes_) {
    throw ConfigError("shm: segment " + name + " was made for another configuration (size " +
                      std::to_string(header_->size) + ", slot " + std::to_string(header_->slot_bytes) +
                      " bytes): all ranks must use the "
                      "same shm options");
  }
  spin_limit_ = static_cast<unsigned>(size_) <= std::thread::hardware_concurrency() ? 2000 : 0;
  control(rank_).pid = static_cast<int>(getpid());
  ctx.store->set(ctx.prefix + "mapped/" + std::to_string(rank_), "1");
  if (rank_ == 0) {
    // Unlink as soon as everyone has the mapping, whatever happens next.
    std::vector<std::string> keys;
    for (int r = 0; r < size_; ++r) keys.push_back(ctx.prefix + "mapped/" + std::to_string(r));
    try {
      ctx.store->wait(keys, options_.timeout);
    } catch (...) {
      ::shm_unlink(name.c_str());
      throw;
    }
    ::shm_unlink(name.c_str());
  }
}

ShmBackend::~ShmBackend() {
  ::munmap(base_, total_bytes_);
}

void ShmBackend::init_segment() {
  header_->magic = kMagic;
  header_->size = static_cast<std::uint64_t>(size_);
  header_->slot_bytes = slot_bytes_;
  new (&header_->abort_rank) std::atomic<int>(-1);
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  for (int r = 0; r < size_; ++r) {
    RankControl& rc = control(r);
    new (&rc.generation) std::atomic<std::uint64_t>(0);
    new (&rc.wake_word) std::atomic<std::uint32_t>(0);
    new (&rc.sleepers) std::atomic<std::uint32_t>(0);
    new (&rc.dead) std::atomic<int>(0);
    new (&rc.departed) std::atomic<int>(0);
    pthread_mutex_init(&rc.alive, &attr);
  }
  pthread_mutexattr_destroy(&attr);
}

const std::string& ShmBackend::name() const {
  static const std::string kName = "shm";
  return kName;
}

void ShmBackend::machine_memory_mapped(const void* block) {
  if (const auto place = machine_->find(block)) machine_->mapped_by_all(place->id);
}

void ShmBackend::on_thread_start() {
  pthread_mutex_lock(&control(rank_).alive);
}

void ShmBackend::on_thread_stop() {
  control(rank_).departed.store(1, std::memory_order_release);
  pthread_mutex_unlock(&control(rank_).alive);
}

// Runs an entry point under the collective's deadline. The first rank to fail records why in
// the header, so the peers' waits (barrier.cc) fail at once and name it.
template <class Body>
void ShmBackend::guarded(Body&& body) {
  deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(options_.timeout);
  try {
    body();
  } catch (const Error& e) {
    int expected = -1;
    if (header_->abort_rank.compare_exchange_strong(expected, rank_))
      std::snprintf(header_->abort_reason, sizeof header_->abort_reason, "%s", e.what());
    throw;
  }
}

void ShmBackend::run(const Collective& c) {
  guarded([&] { dispatch(c); });
}

void ShmBackend::allreduce_shared_around(const Collective& c, const ShareStep& between) {
  guarded([&] {
    const auto shared = own_->find(c.recv, c.count * dtype_size(c.dtype));
    if (!shared) throw ConfigError("internal: allreduce_shared_around on a buffer that is not shared");
    publish_shared(c, shared);
    allreduce_shared(c, shared->id, &between);
  });
}

void ShmBackend::fenced_machine_write(const Collective& c, const std::function<void()>& write) {
  guarded([&] { fenced(c, write); });
}

void ShmBackend::dispatch(const Collective& c) {
  switch (c.kind) {
    case CollectiveKind::barrier:
      begin(c);
      ++round_;
      return;
    case CollectiveKind::allreduce: return allreduce(c);
    case CollectiveKind::broadcast: return broadcast(c);
    case CollectiveKind::allgather:
      if (c.machine_memory) return allgather_machine(c);
      [[fallthrough]];
    case CollectiveKind::reduce_scatter: {
      const auto shared = publish_shared_scatter(c);
      if (!shared) return c.kind == CollectiveKind::allgather ? allgather(c) : reduce_scatter(c);
      return c.kind == CollectiveKind::allgather ? allgather_shared(c, shared->id)
                                                 : reduce_scatter_shared(c, shared->id);
    }
  }
}

}  // namespace lockstep::comm::shm

namespace lockstep::comm {

std::unique_ptr<Backend> make_shm_backend(const BackendContext& ctx) {
  return std::make_unique<shm::ShmBackend>(ctx);
}

std::unique_ptr<LocalBackend> make_local_shm_backend(const BackendContext& ctx) {
  return std::make_unique<shm::ShmBackend>(ctx);
}

}  // namespace lockstep::comm
