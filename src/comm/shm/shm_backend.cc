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
// between barriers j+1 and j+2 (the pipelined allreduce below); it is overwritten in round
// j+3, after the writer passed barrier j+2, which every rank reaches only after those reads.
// So a rank never waits for readers before writing. The first barrier of each collective also publishes its
// signature (kind, dtype, count, op, root), in a descriptor slot chosen by sequence parity for the same
// reason; every rank compares all signatures before touching data, so disagreeing ranks all fail together.
//
// Barrier: each rank stores its own monotonically rising generation in its own cache line
// (no shared counter to fight over) and waits until every rank's generation reaches it.
// Waiting spins with pause for ~100 us (not at all when ranks outnumber cores), then sleeps on a
// futex in the late rank's control block, which that rank wakes when it arrives. While waiting it checks,
// every few milliseconds: the abort word (another rank failed), peers' liveness (each rank's progress thread
// holds a robust mutex in the segment; the kernel marks it owner-dead when the process dies), and the
// collective's deadline.
//
// Algorithms (n bytes per rank, W ranks, H = slot part bytes; cost is memory traffic):
//   allreduce, n <= one-shot limit: copy in; barrier; every rank reduces all W inputs.
//     1 barrier, reads W*n. Latency-optimal for small messages.
//   allreduce, larger: per round a chunk of up to H (a slot part) is split into W segments.
//     Each rank copies the segments others own into its part; barrier; it copies out the
//     segments its peers reduced in the previous round (all-gather), then reduces segment r
//     of this round straight from its own input and the peers' parts into its part
//     (reduce-scatter); after the last round one more barrier and all-gather. One barrier per
//     round: the all-gather of round i is pipelined behind the barrier of round i+1. Per rank
//     ~2n copied + n reduced, independent of W. Reduction order is rank order on both paths,
//     so every rank gets bitwise the same result.
//   allreduce in place on buffers from allocate_shared (shm_buffers.h) on every rank: barrier;
//     each rank reduces its 1/W of the elements straight out of every rank's buffer and writes
//     the result into all of them; barrier. Per rank n read and n written, about half the
//     staged path's traffic, in 2 barriers whatever n.
//   broadcast: root copies a chunk in; barrier; the others copy it out.
//   allgather: each copies its chunk in; barrier; each copies all chunks out.
//   reduce_scatter: each copies the blocks others own in; barrier; each reduces its block.
//   allgather / reduce_scatter on shared buffers (the large buffer from allocate_shared on every
//     rank, the small one inside it at the rank's offset): barrier; each rank copies the peers'
//     chunks straight out of their buffers (allgather) or reduces its block straight out of
//     every rank's buffer (reduce_scatter); barrier. No staging: ZeRO's gathers and
//     reduce-scatters cost what the shared allreduce does.
//   allgather into machine memory (one block all ranks map, shm/machine_blocks.h): barrier (every
//     rank issued it, so nobody still reads the block's old contents); each rank writes its own
//     chunk; barrier. Each chunk is written once, into the one copy.
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <optional>
#include <thread>
#include <vector>

#include "backend.h"
#include "lockstep/base/log.h"
#include "lockstep/error.h"
#include "shm/machine_blocks.h"
#include "shm/reduce.h"
#include "shm/segment.h"
#include "shm/shm_buffers.h"
#include "store/wire.h"

namespace lockstep::comm {
namespace {

constexpr std::uint64_t kMagic = 0x6c6f636b73746570ull;  // "lockstep"
constexpr std::size_t kAlign = 64;
constexpr std::size_t kParts = 3;  // slot parts used in turn (see "Rounds" above)

// Futexes on words in the shared segment (not FUTEX_PRIVATE: the waiters are other processes).
void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, Clock::duration timeout) {
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count();
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<std::uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

struct alignas(kAlign) RankControl {
  std::atomic<std::uint64_t> generation;  // barrier generation reached; its own line
  std::atomic<std::uint32_t> wake_word;   // generation's low half: what sleeping peers futex-wait on
  std::atomic<std::uint32_t> sleepers;    // peers asleep on wake_word
  char pad0[kAlign - sizeof(std::atomic<std::uint64_t>) - 2 * sizeof(std::atomic<std::uint32_t>)];
  std::uint64_t sequence[2];  // descriptor slots, indexed by sequence parity
  std::uint64_t signature[2];
  std::uint64_t shared_id[2];      // allreduce on a shared buffer: its id + 1, else 0
  std::uint64_t shared_offset[2];  // ... and the data's offset in it
  std::atomic<int> dead;           // set by whichever peer first finds the owner dead
  std::atomic<int> departed;       // set by the owner when its communicator closes cleanly
  int pid;
  alignas(kAlign) pthread_mutex_t alive;  // held by the owner's progress thread
};

struct alignas(kAlign) Header {
  std::uint64_t magic;
  std::uint64_t size;
  std::uint64_t slot_bytes;
  std::atomic<int> abort_rank;  // -1, or the first rank that failed
  char abort_reason[512];
};

std::size_t round_up(std::size_t n, std::size_t a) {
  return (n + a - 1) / a * a;
}

class ShmBackend final : public LocalBackend {
 public:
  explicit ShmBackend(const BackendContext& ctx)
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

  ~ShmBackend() override { ::munmap(base_, total_bytes_); }

  bool shares_memory() const override { return true; }

  bool owns_shared(const void* p, std::size_t bytes) const override {
    return own_->find(p, bytes).has_value();
  }

  void allreduce_shared_around(const Collective& c, const ShareStep& between) override {
    deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(options_.timeout);
    try {
      const auto shared = own_->find(c.recv, c.count * dtype_size(c.dtype));
      if (!shared) throw ConfigError("internal: allreduce_shared_around on a buffer that is not shared");
      const int parity = static_cast<int>(c.sequence & 1);
      control(rank_).shared_id[parity] = shared->id + 1;
      control(rank_).shared_offset[parity] = shared->offset;
      allreduce_shared(c, shared->id, &between);
    } catch (const Error& e) {
      int expected = -1;
      if (header_->abort_rank.compare_exchange_strong(expected, rank_))
        std::snprintf(header_->abort_reason, sizeof header_->abort_reason, "%s", e.what());
      throw;
    }
  }
  std::shared_ptr<void> allocate_shared(std::size_t bytes) override { return own_->allocate(bytes); }
  bool has_machine_memory() const override { return true; }
  std::shared_ptr<void> allocate_machine_memory(std::size_t bytes) override { return machine_->allocate(bytes); }
  void machine_memory_mapped(const void* block) override {
    if (const auto place = machine_->find(block)) machine_->mapped_by_all(place->id);
  }

  void fenced_machine_write(const Collective& c, const std::function<void()>& write) override {
    deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(options_.timeout);
    try {
      fenced(c, write);
    } catch (const Error& e) {
      int expected = -1;
      if (header_->abort_rank.compare_exchange_strong(expected, rank_))
        std::snprintf(header_->abort_reason, sizeof header_->abort_reason, "%s", e.what());
      throw;
    }
  }

  const std::string& name() const override {
    static const std::string kName = "shm";
    return kName;
  }

  void on_thread_start() override { pthread_mutex_lock(&control(rank_).alive); }

  void on_thread_stop() override {
    control(rank_).departed.store(1, std::memory_order_release);
    pthread_mutex_unlock(&control(rank_).alive);
  }

  void run(const Collective& c) override {
    deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(options_.timeout);
    try {
      dispatch(c);
    } catch (const Error& e) {
      int expected = -1;
      if (header_->abort_rank.compare_exchange_strong(expected, rank_)) {
        std::snprintf(header_->abort_reason, sizeof header_->abort_reason, "%s", e.what());
      }
      throw;
    }
  }

 private:
  RankControl& control(int r) { return controls_[r]; }
  int global(int r) const { return global_ranks_.empty() ? r : global_ranks_[static_cast<std::size_t>(r)]; }
  char* slot(int r, int part) {
    return slots_ + static_cast<std::size_t>(r) * slot_bytes_ + static_cast<std::size_t>(part) * part_bytes_;
  }
  int part() const { return static_cast<int>(round_ % kParts); }

  void init_segment() {
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

  // --- waiting -----------------------------------------------------------------------------

  void check_peer(int r, const Collective& c) {
    RankControl& rc = control(r);
    if (rc.dead.load(std::memory_order_acquire)) throw PeerError(peer_lost(r, c, "died"));
    int status = pthread_mutex_trylock(&rc.alive);
    if (status == EOWNERDEAD || status == ENOTRECOVERABLE) {
      // EOWNERDEAD hands the dead peer's mutex to this thread: give it back at once. A robust
      // mutex left locked stays on this thread's robust list, which the kernel and glibc walk
      // through the segment's memory: once the segment is unmapped (an elastic job goes on with
      // a new communicator in this process), the next robust lock would fault on it.
      if (status == EOWNERDEAD) pthread_mutex_unlock(&rc.alive);
      rc.dead.store(1, std::memory_order_release);
      throw PeerError(peer_lost(r, c, "died"));
    }
    if (status == 0) {
      // Not held: the peer has not started yet, or it closed its communicator.
      pthread_mutex_unlock(&rc.alive);
      if (rc.departed.load(std::memory_order_acquire))
        throw PeerError(peer_lost(r, c, "closed its communicator without issuing this collective"));
    }
  }

  std::string peer_lost(int r, const Collective& c, const char* what) {
    return "rank " + std::to_string(global(r)) + " (pid " + std::to_string(control(r).pid) + ") " + what +
           " while rank " + std::to_string(global(rank_)) + " was in " + c.describe() +
           " on the shm backend; the job cannot continue";
  }

  void check_abort(const Collective& c) {
    int who = header_->abort_rank.load(std::memory_order_acquire);
    if (who >= 0 && who != rank_)
      throw PeerError("rank " + std::to_string(global(who)) + " failed (" + header_->abort_reason +
                      ") while rank " + std::to_string(global(rank_)) + " was in " + c.describe());
  }

  // Waits until every rank reached barrier generation `gen`.
  void wait_all(std::uint64_t gen, const Collective& c) {
    int next = 0;  // ranks below `next` are known to have arrived
    auto arrived_all = [&] {
      while (next < size_ && control(next).generation.load(std::memory_order_acquire) >= gen) ++next;
      return next == size_;
    };
    for (int spin = 0; spin < spin_limit_; ++spin) {
      if (arrived_all()) return;
      cpu_relax();
    }
    auto next_check = Clock::now();
    auto check_every = std::min<Clock::duration>(
        std::chrono::milliseconds(20), std::chrono::duration_cast<Clock::duration>(options_.peer_check / 4));
    for (;;) {
      if (arrived_all()) return;
      auto now = Clock::now();
      if (now >= next_check) {
        check_abort(c);
        for (int r = next; r < size_; ++r)
          if (control(r).generation.load(std::memory_order_acquire) < gen) check_peer(r, c);
        if (now >= deadline_) throw TimeoutError(timeout_message(gen, c));
        next_check = now + check_every;
      }
      // Sleep on the first late rank's wake word until it arrives (it wakes sleepers) or the
      // next check is due. A sleeper is woken with the scheduler's credit for sleeping, so
      // when the cores are busy (DDP: backward computing beside the progress threads) the
      // ranks' progress threads still run together instead of waiting out time slices.
      RankControl& late = control(next);
      late.sleepers.fetch_add(1, std::memory_order_seq_cst);
      std::uint32_t seen = late.wake_word.load(std::memory_order_seq_cst);
      if (late.generation.load(std::memory_order_seq_cst) < gen) {
        futex_wait(&late.wake_word, seen, std::min<Clock::duration>(next_check - now, check_every));
      }
      late.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  std::string timeout_message(std::uint64_t gen, const Collective& c) {
    std::string late;
    for (int r = 0; r < size_; ++r)
      if (control(r).generation.load() < gen) late += (late.empty() ? "" : ", ") + std::to_string(global(r));
    return c.describe() + " timed out after " + log::seconds_text(options_.timeout.count()) + " on rank " +
           std::to_string(rank_) + " waiting for rank(s) " + late +
           ", which are alive but did not reach it (stuck in compute, or issuing collectives in "
           "another order); raise --timeout if they are just slow";
  }

  void barrier(const Collective& c) {
    ++generation_;
    RankControl& mine = control(rank_);
    mine.generation.store(generation_, std::memory_order_seq_cst);
    mine.wake_word.store(static_cast<std::uint32_t>(generation_), std::memory_order_seq_cst);
    if (mine.sleepers.load(std::memory_order_seq_cst) > 0) futex_wake_all(&mine.wake_word);
    wait_all(generation_, c);
  }

  // Opens a collective: publish the signature with the first barrier, then compare.
  void begin(const Collective& c) {
    int parity = static_cast<int>(c.sequence & 1);
    RankControl& me = control(rank_);
    me.sequence[parity] = c.sequence;
    me.signature[parity] = c.signature();
    barrier(c);
    std::vector<std::uint64_t> sigs(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) {
      RankControl& rc = control(r);
      if (rc.sequence[parity] != c.sequence)
        throw MismatchError("rank " + std::to_string(r) + " is at collective #" +
                            std::to_string(rc.sequence[parity]) + " while rank " + std::to_string(rank_) +
                            " is at " + c.describe());
      sigs[static_cast<std::size_t>(r)] = rc.signature[parity];
    }
    check_signatures(c, sigs.data(), size_, rank_);
  }

  // --- collectives -------------------------------------------------------------------------

  void dispatch(const Collective& c) {
    switch (c.kind) {
      case CollectiveKind::barrier:
        begin(c);
        ++round_;
        return;
      case CollectiveKind::allreduce: {
        // Publish whether this is an in-place allreduce on a shared buffer; begin()'s barrier
        // carries it to the peers, and agree_on_shared() compares.
        std::optional<shm::Place> shared;
        if (c.send == c.recv && c.count > 0) shared = own_->find(c.recv, c.count * dtype_size(c.dtype));
        int parity = static_cast<int>(c.sequence & 1);
        control(rank_).shared_id[parity] = shared ? shared->id + 1 : 0;
        control(rank_).shared_offset[parity] = shared ? shared->offset : 0;
        if (shared) return allreduce_shared(c, shared->id, nullptr);
        if (c.count * dtype_size(c.dtype) <= std::min(options_.shm_one_shot_bytes, part_bytes_))
          return allreduce_one_shot(c);
        return allreduce_chunked(c);
      }
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

  // The large buffer of an allgather (recv) or reduce_scatter (send), when it comes from
  // allocate_shared and the small buffer sits in it at this rank's offset; published for the
  // peers like the shared allreduce's.
  std::optional<shm::Place> publish_shared_scatter(const Collective& c) {
    const std::size_t esize = dtype_size(c.dtype);
    const bool gather = c.kind == CollectiveKind::allgather;
    const char* large = static_cast<const char*>(gather ? c.recv : c.send);
    const char* small = static_cast<const char*>(gather ? c.send : c.recv);
    std::optional<shm::Place> shared;
    if (c.count > 0 && small == large + static_cast<std::size_t>(rank_) * c.count * esize)
      shared = own_->find(large, static_cast<std::size_t>(size_) * c.count * esize);
    const int parity = static_cast<int>(c.sequence & 1);
    control(rank_).shared_id[parity] = shared ? shared->id + 1 : 0;
    control(rank_).shared_offset[parity] = shared ? shared->offset : 0;
    return shared;
  }

  void allreduce_one_shot(const Collective& c) {
    std::size_t bytes = c.count * dtype_size(c.dtype);
    int h = part();
    std::memcpy(slot(rank_, h), c.send, bytes);
    begin(c);
    agree_on_shared(c);
    std::vector<const void*> inputs(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) inputs[static_cast<std::size_t>(r)] = r == rank_ ? c.send : slot(r, h);
    reduce(c.dtype, c.op, c.recv, inputs.data(), size_, c.count);
    ++round_;
  }

  void allreduce_chunked(const Collective& c) {
    const std::size_t esize = dtype_size(c.dtype);
    const std::size_t unit = kAlign / std::min<std::size_t>(esize, kAlign);  // elements per line
    const std::size_t chunk = std::max<std::size_t>(part_bytes_ / esize / (unit * size_), 1) * unit * size_;
    const char* send = static_cast<const char*>(c.send);
    char* recv = static_cast<char*>(c.recv);
    std::vector<const void*> inputs(static_cast<std::size_t>(size_));
    // One chunk's split into W segments, and where its reduced segments wait in the slots.
    struct Round {
      std::size_t offset = 0, m = 0, seg = 0;
      int part = 0;
      std::size_t begin(int r) const { return std::min(m, seg * static_cast<std::size_t>(r)); }
      std::size_t len(int r) const { return begin(r + 1) - begin(r); }
    };
    auto gather = [&](const Round& g) {
      for (int r = 0; r < size_; ++r)
        if (r != rank_)
          std::memcpy(recv + (g.offset + g.begin(r)) * esize, slot(r, g.part) + g.begin(r) * esize,
                      g.len(r) * esize);
    };
    std::optional<Round> previous;
    for (std::size_t offset = 0; offset < c.count; offset += chunk) {
      Round now;
      now.offset = offset;
      now.m = std::min(chunk, c.count - offset);
      now.seg = round_up((now.m + size_ - 1) / size_, unit);
      now.part = part();
      char* mine = slot(rank_, now.part);
      for (int r = 0; r < size_; ++r)
        if (r != rank_)
          std::memcpy(mine + now.begin(r) * esize, send + (offset + now.begin(r)) * esize,
                      now.len(r) * esize);
      if (previous) {
        barrier(c);
      } else {
        begin(c);
        agree_on_shared(c);
      }
      if (previous) gather(*previous);
      std::size_t my_begin = now.begin(rank_);
      for (int r = 0; r < size_; ++r)
        inputs[static_cast<std::size_t>(r)] =
            r == rank_ ? send + (offset + my_begin) * esize : slot(r, now.part) + my_begin * esize;
      reduce(c.dtype, c.op, mine + my_begin * esize, inputs.data(), size_, now.len(rank_));
      std::memcpy(recv + (offset + my_begin) * esize, mine + my_begin * esize, now.len(rank_) * esize);
      previous = now;
      ++round_;
    }
    barrier(c);
    gather(*previous);
    ++round_;
  }

  // Every rank must have passed a shared buffer, or none.
  void agree_on_shared(const Collective& c) {
    int parity = static_cast<int>(c.sequence & 1);
    bool mine = control(rank_).shared_id[parity] != 0;
    for (int r = 0; r < size_; ++r) {
      if ((control(r).shared_id[parity] != 0) == mine) continue;
      int with = mine ? rank_ : r, without = mine ? r : rank_;
      throw MismatchError(c.describe() + ": rank " + std::to_string(with) +
                          " passes a buffer from Communicator::allocate_shared (in place) but rank " +
                          std::to_string(without) +
                          " does not; pass shared buffers (in place) on every rank or on none");
    }
  }

  // The buffers of every rank for this collective: this rank's (`own`), and the peers' mapped here.
  std::vector<char*> shared_buffers(const Collective& c, char* own) {
    const int parity = static_cast<int>(c.sequence & 1);
    peers_->drop_released();
    std::vector<char*> bufs(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r)
      bufs[static_cast<std::size_t>(r)] =
          r == rank_ ? own : peer_buffer(r, control(r).shared_id[parity] - 1, c) + control(r).shared_offset[parity];
    return bufs;
  }

  // A peer's shared buffer, mapped here. A buffer that cannot be opened is usually the trace of a
  // job already failing (its owner left after a peer died, and unlinked it): say that failure,
  // which names the rank at its root, before the bare open error.
  char* peer_buffer(int r, std::uint64_t id, const Collective& c) {
    try {
      return peers_->data(r, id);
    } catch (const SystemError&) {
      check_abort(c);
      for (int p = 0; p < size_; ++p)
        if (p != rank_) check_peer(p, c);
      throw;
    }
  }

  void allgather_shared(const Collective& c, std::uint64_t id) {
    begin(c);
    agree_on_shared(c);
    const std::size_t bytes = c.count * dtype_size(c.dtype);
    const std::vector<char*> bufs = shared_buffers(c, static_cast<char*>(c.recv));
    for (int r = 0; r < size_; ++r)
      if (r != rank_)
        std::memcpy(bufs[static_cast<std::size_t>(rank_)] + static_cast<std::size_t>(r) * bytes,
                    bufs[static_cast<std::size_t>(r)] + static_cast<std::size_t>(r) * bytes, bytes);
    barrier(c);  // peers no longer read this rank's chunk
    own_->mapped_by_all(id);
    ++round_;
  }

  void allgather_machine(const Collective& c) {
    const std::size_t bytes = c.count * dtype_size(c.dtype);
    fenced(c, [&] { std::memcpy(static_cast<char*>(c.recv) + static_cast<std::size_t>(rank_) * bytes, c.send, bytes); });
  }

  // Between two barriers, `write` into the machine block at c.recv, once the ranks agree that it
  // is the same place of the same block.
  void fenced(const Collective& c, const std::function<void()>& write) {
    const auto place = machine_->find(c.recv);
    if (!place)
      throw ConfigError("shm: " + c.describe() + " on rank " + std::to_string(global(rank_)) +
                        ": recv is not memory from allocate_machine_memory");
    const int parity = static_cast<int>(c.sequence & 1);
    control(rank_).shared_id[parity] = place->id + 1;
    control(rank_).shared_offset[parity] = place->offset;
    begin(c);
    for (int r = 0; r < size_; ++r)
      if (control(r).shared_id[parity] != place->id + 1 || control(r).shared_offset[parity] != place->offset)
        throw MismatchError("shm: " + c.describe() + ": rank " + std::to_string(global(r)) +
                            " writes another place of the machine's memory (block " +
                            std::to_string(control(r).shared_id[parity] - 1) + ", byte " +
                            std::to_string(control(r).shared_offset[parity]) + ") than rank " +
                            std::to_string(global(rank_)) + " (block " + std::to_string(place->id) + ", byte " +
                            std::to_string(place->offset) + "): the ranks of a machine must take their memory in "
                                                            "the same order");
    machine_->mapped_by_all(place->id);
    write();
    barrier(c);  // the whole block is written
    ++round_;
  }

  void reduce_scatter_shared(const Collective& c, std::uint64_t id) {
    begin(c);
    agree_on_shared(c);
    const std::size_t block = c.count * dtype_size(c.dtype);
    const std::vector<char*> bufs = shared_buffers(c, static_cast<char*>(const_cast<void*>(c.send)));
    std::vector<const void*> inputs(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r)
      inputs[static_cast<std::size_t>(r)] = bufs[static_cast<std::size_t>(r)] + static_cast<std::size_t>(rank_) * block;
    reduce(c.dtype, c.op, c.recv, inputs.data(), size_, c.count);
    barrier(c);  // peers no longer read this rank's buffer
    own_->mapped_by_all(id);
    ++round_;
  }

  // Without `between`: each block of the share is copied to the peers right after it is
  // reduced, while it is in L1. With it: the whole share is reduced first, `between` runs
  // (hier's step across machines), then the share is copied.
  void allreduce_shared(const Collective& c, std::uint64_t id, const ShareStep* between) {
    begin(c);
    agree_on_shared(c);
    const std::size_t esize = dtype_size(c.dtype);
    const std::vector<char*> bufs = shared_buffers(c, static_cast<char*>(c.recv));
    // This rank's share, in whole cache lines: when the buffers are line-aligned (DDP's buckets
    // are page-aligned), no two ranks write one line.
    const std::size_t unit = kAlign / std::min<std::size_t>(esize, kAlign);
    const std::size_t seg = round_up((c.count + size_ - 1) / size_, unit);
    const std::size_t first = std::min(c.count, seg * static_cast<std::size_t>(rank_));
    const std::size_t last = std::min(c.count, first + seg);
    // Blocks small enough that the copies to peers read the result from L1.
    const std::size_t block = std::max<std::size_t>(16384 / esize, unit);
    std::vector<const void*> inputs(static_cast<std::size_t>(size_));
    char* mine = bufs[static_cast<std::size_t>(rank_)];
    auto copy_to_peers = [&](std::size_t i, std::size_t m) {
      for (int r = 0; r < size_; ++r)
        if (r != rank_)
          std::memcpy(bufs[static_cast<std::size_t>(r)] + i * esize, mine + i * esize, m * esize);
    };
    for (std::size_t i = first; i < last; i += block) {
      const std::size_t m = std::min(block, last - i);
      for (int r = 0; r < size_; ++r)
        inputs[static_cast<std::size_t>(r)] = bufs[static_cast<std::size_t>(r)] + i * esize;
      reduce(c.dtype, c.op, mine + i * esize, inputs.data(), size_, m);
      if (!between) copy_to_peers(i, m);
    }
    if (between) {
      (*between)(mine + first * esize, first, last - first);
      copy_to_peers(first, last - first);
    }
    barrier(c);  // every share is everywhere; peers no longer touch this rank's buffer
    own_->mapped_by_all(id);
    ++round_;
  }

  void broadcast(const Collective& c) {
    const std::size_t esize = dtype_size(c.dtype);
    const std::size_t chunk = part_bytes_ / esize;
    char* buf = static_cast<char*>(c.recv);
    std::size_t offset = 0;
    do {
      std::size_t m = std::min(chunk, c.count - offset);
      int h = part();
      if (rank_ == c.root) std::memcpy(slot(rank_, h), buf + offset * esize, m * esize);
      if (offset == 0)
        begin(c);
      else
        barrier(c);
      if (rank_ != c.root) std::memcpy(buf + offset * esize, slot(c.root, h), m * esize);
      ++round_;
      offset += m;
    } while (offset < c.count);
  }

  void allgather(const Collective& c) {
    const std::size_t esize = dtype_size(c.dtype);
    const std::size_t chunk = part_bytes_ / esize;
    const char* send = static_cast<const char*>(c.send);
    char* recv = static_cast<char*>(c.recv);
    std::size_t offset = 0;
    do {
      std::size_t m = std::min(chunk, c.count - offset);
      int h = part();
      std::memcpy(slot(rank_, h), send + offset * esize, m * esize);
      if (offset == 0) {
        begin(c);
        agree_on_shared(c);  // the peers passed private buffers too
      } else {
        barrier(c);
      }
      for (int r = 0; r < size_; ++r) {
        char* dst = recv + (static_cast<std::size_t>(r) * c.count + offset) * esize;
        const char* src = r == rank_ ? send + offset * esize : slot(r, h);
        if (dst != src) std::memmove(dst, src, m * esize);
      }
      ++round_;
      offset += m;
    } while (offset < c.count);
  }

  void reduce_scatter(const Collective& c) {
    const std::size_t esize = dtype_size(c.dtype);
    const std::size_t block = std::max<std::size_t>(part_bytes_ / esize / static_cast<std::size_t>(size_), 1);
    const char* send = static_cast<const char*>(c.send);
    char* recv = static_cast<char*>(c.recv);
    std::vector<const void*> inputs(static_cast<std::size_t>(size_));
    std::size_t offset = 0;
    do {
      std::size_t m = std::min(block, c.count - offset);
      int h = part();
      char* mine = slot(rank_, h);
      for (int r = 0; r < size_; ++r)
        if (r != rank_)
          std::memcpy(mine + static_cast<std::size_t>(r) * block * esize,
                      send + (static_cast<std::size_t>(r) * c.count + offset) * esize, m * esize);
      if (offset == 0) {
        begin(c);
        agree_on_shared(c);  // the peers passed private buffers too
      } else {
        barrier(c);
      }
      for (int r = 0; r < size_; ++r)
        inputs[static_cast<std::size_t>(r)] =
            r == rank_ ? send + (static_cast<std::size_t>(rank_) * c.count + offset) * esize
                       : slot(r, h) + static_cast<std::size_t>(rank_) * block * esize;
      reduce(c.dtype, c.op, recv + offset * esize, inputs.data(), size_, m);
      ++round_;
      offset += m;
    } while (offset < c.count);
  }

  int rank_, size_;
  CommOptions options_;
  std::vector<int> global_ranks_;  // how messages name ranks (BackendContext::global_ranks)
  std::size_t slot_bytes_ = 0, part_bytes_ = 0, total_bytes_ = 0;
  char* base_ = nullptr;
  Header* header_ = nullptr;
  RankControl* controls_ = nullptr;
  char* slots_ = nullptr;
  // Pause-spins before yielding: ~100 us when every rank has a core; none when ranks outnumber
  // cores, since the rank being waited for may need this very core to arrive.
  int spin_limit_ = 0;
  std::uint64_t generation_ = 0;  // this rank's barrier generation
  std::uint64_t round_ = 0;       // rounds completed; round % 3 picks the slot part
  Clock::time_point deadline_;
  std::optional<shm::OwnBuffers> own_;     // this rank's shared buffers
  std::optional<shm::PeerBuffers> peers_;  // peers' shared buffers, mapped on first use
  std::optional<shm::MachineBlocks> machine_;  // blocks every rank maps (machine memory)
};

}  // namespace

std::unique_ptr<Backend> make_shm_backend(const BackendContext& ctx) {
  return std::make_unique<ShmBackend>(ctx);
}

std::unique_ptr<LocalBackend> make_local_shm_backend(const BackendContext& ctx) {
  return std::make_unique<ShmBackend>(ctx);
}

}  // namespace lockstep::comm
