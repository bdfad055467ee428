// The shm backend's class and its segment's layout, shared by the files that implement it (their
// map is atop shm_backend.cc). Private to src/comm: the rest of lockstep reaches the backend
// through make_shm_backend and make_local_shm_backend (backend.h).
//
// Threading: one collective at a time on the communicator's progress thread; allocate_shared and
// allocate_machine_memory on the caller's thread, concurrently (the registries lock).
#pragma once

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "backend.h"
#include "shm/block_registry.h"
#include "shm/machine_blocks.h"
#include "shm/shm_buffers.h"

namespace lockstep::comm::shm {

constexpr std::uint64_t kMagic = 0x6c6f636b73746570ull;  // "lockstep"
constexpr std::size_t kAlign = 64;
constexpr std::size_t kParts = 3;  // slot parts used in turn ("Rounds" in shm_backend.cc)

inline std::size_t round_up(std::size_t n, std::size_t a) {
  return (n + a - 1) / a * a;
}

// One per rank, each on its own cache lines: the barrier's words (barrier.cc), the descriptor of
// the collective this rank is in, and its liveness.
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

// The segment's first bytes, followed by one RankControl per rank.
struct alignas(kAlign) Header {
  std::uint64_t magic;
  std::uint64_t size;
  std::uint64_t slot_bytes;
  std::atomic<int> abort_rank;  // -1, or the first rank that failed
  char abort_reason[512];
};

class ShmBackend final : public LocalBackend {
 public:
  // The members not defined here are in shm_backend.cc.
  explicit ShmBackend(const BackendContext& ctx);
  ~ShmBackend() override;

  const std::string& name() const override;
  bool shares_memory() const override { return true; }
  bool owns_shared(const void* p, std::size_t bytes) const override {
    return own_->find(p, bytes).has_value();
  }
  std::shared_ptr<void> allocate_shared(std::size_t bytes) override { return own_->allocate(bytes); }
  bool has_machine_memory() const override { return true; }
  std::shared_ptr<void> allocate_machine_memory(std::size_t bytes) override {
    return machine_->allocate(bytes);
  }
  void machine_memory_mapped(const void* block) override;
  void on_thread_start() override;
  void on_thread_stop() override;
  void run(const Collective& c) override;
  void allreduce_shared_around(const Collective& c, const ShareStep& between) override;
  void fenced_machine_write(const Collective& c, const std::function<void()>& write) override;

 private:
  RankControl& control(int r) { return controls_[r]; }
  int global(int r) const { return global_ranks_.empty() ? r : global_ranks_[static_cast<std::size_t>(r)]; }
  char* slot(int r, int part) {
    return slots_ + static_cast<std::size_t>(r) * slot_bytes_ + static_cast<std::size_t>(part) * part_bytes_;
  }
  int part() const { return static_cast<int>(round_ % kParts); }

  // shm_backend.cc: the segment, the entry points' deadline and failure report, the dispatch;
  // in_rounds below.
  void init_segment();
  template <class Body>
  void guarded(Body&& body);
  void dispatch(const Collective& c);
  template <class Fill, class Drain>
  void in_rounds(const Collective& c, std::size_t chunk, bool agree, Fill&& fill, Drain&& drain);

  // barrier.cc: waiting, with liveness, abort and deadline checks.
  // Throws PeerError when rank r died, or closed its communicator before reaching barrier
  // generation `needed` (by default: before anything more).
  void check_peer(int r, const Collective& c, std::uint64_t needed = UINT64_MAX);
  std::string peer_lost(int r, const Collective& c, const char* what);
  void check_abort(const Collective& c);
  void wait_all(std::uint64_t gen, const Collective& c);
  std::string timeout_message(std::uint64_t gen, const Collective& c);
  void barrier(const Collective& c);
  void begin(const Collective& c);

  // shared_collectives.cc: what the collectives straight on the ranks' shared buffers share.
  void publish_shared(const Collective& c, const std::optional<Place>& shared);
  std::optional<Place> publish_shared_scatter(const Collective& c);
  void agree_on_shared(const Collective& c);
  std::vector<char*> shared_buffers(const Collective& c, char* own);
  char* peer_buffer(int r, std::uint64_t id, const Collective& c);

  // One file per collective, each opened by its algorithms' steps and cost.
  // allreduce.cc
  void allreduce(const Collective& c);
  void allreduce_one_shot(const Collective& c);
  void allreduce_chunked(const Collective& c);
  void allreduce_shared(const Collective& c, std::uint64_t id, const ShareStep* between);
  // broadcast.cc
  void broadcast(const Collective& c);
  // allgather.cc
  void allgather(const Collective& c);
  void allgather_shared(const Collective& c, std::uint64_t id);
  void allgather_machine(const Collective& c);
  void fenced(const Collective& c, const std::function<void()>& write);
  // reduce_scatter.cc
  void reduce_scatter(const Collective& c);
  void reduce_scatter_shared(const Collective& c, std::uint64_t id);

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
  std::optional<OwnBuffers> own_;         // this rank's shared buffers
  std::optional<PeerBuffers> peers_;      // peers' shared buffers, mapped on first use
  std::optional<MachineBlocks> machine_;  // blocks every rank maps (machine memory)
};

// Runs a staged collective through the slots in rounds of up to `chunk` elements ("Rounds" atop
// shm_backend.cc), at least one even for no elements: fill(offset, m, part) writes this rank's
// part, the round's barrier is crossed (begin()'s in the first round, then, if `agree`, the check
// that the peers passed private buffers too), and drain(offset, m, part) reads the peers' parts.
template <class Fill, class Drain>
void ShmBackend::in_rounds(const Collective& c, std::size_t chunk, bool agree, Fill&& fill, Drain&& drain) {
  std::size_t offset = 0;
  do {
    const std::size_t m = std::min(chunk, c.count - offset);
    const int h = part();
    fill(offset, m, h);
    if (offset == 0) {
      begin(c);
      if (agree) agree_on_shared(c);
    } else {
      barrier(c);
    }
    drain(offset, m, h);
    ++round_;
    offset += m;
  } while (offset < c.count);
}

}  // namespace lockstep::comm::shm
