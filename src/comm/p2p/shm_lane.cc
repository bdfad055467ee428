// The shared-memory lane: a single-writer, single-reader ring. See shm_lane.h.
#include "shm_lane.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "../shm/futex.h"
#include "block_copy.h"
#include "../shm/segment.h"

namespace lockstep::comm {
namespace {

constexpr std::uint64_t kMagic = 0x4c534c414e453031ull;  // "LSLANE01"
constexpr std::size_t kControlBytes = 4096;
// Published (and freed) in chunks of this size, so that the other side starts copying early.
constexpr std::size_t kChunk = 256 << 10;
// A wait spins briefly before it sleeps. Longer spins (2000, or up to 2 ms while the other side is
// inside a message) made 4 MiB round trips slower and noisier on the 2-core VM this was measured
// on, where spinners take the cores the other side's threads need (bench/P2P.md).
constexpr int kSpins = 100;
constexpr std::chrono::milliseconds kNap{50};  // how often a sleeper asks give_up()

}  // namespace

// The writer owns `written` and `data_word`, the reader `taken` and `space_word`; each counter is
// the running total of bytes, so a full ring (written - taken == capacity) and an empty one differ.
struct ShmLane::Control {
  std::uint64_t magic;
  std::uint64_t capacity;
  alignas(64) std::atomic<std::uint64_t> written;
  std::atomic<std::uint32_t> data_word;      // bumped after each publish: the reader sleeps on it
  std::atomic<std::uint32_t> reader_sleeps;  // > 0 while the reader is in (or entering) a sleep
  alignas(64) std::atomic<std::uint64_t> taken;
  std::atomic<std::uint32_t> space_word;  // bumped after each take: the writer sleeps on it
  std::atomic<std::uint32_t> writer_sleeps;
};
static_assert(sizeof(ShmLane::Control) <= kControlBytes, "the lane's control block fits its page");

namespace {

void bump(std::atomic<std::uint32_t>& word, const std::atomic<std::uint32_t>& sleepers) {
  word.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers.load(std::memory_order_seq_cst) > 0) shm::futex_wake_all(&word);
}

// Waits until ready(): spins a little, then sleeps on `word` in naps, asking give_up() after each.
// Returns ready() as it last found it.
template <class Ready>
bool wait_until(std::atomic<std::uint32_t>& word, std::atomic<std::uint32_t>& sleepers, const Ready& ready,
                const ShmLane::GiveUp& give_up) {
  for (int spin = 0; spin < kSpins; ++spin) {
    if (ready()) return true;
    shm::cpu_relax();
  }
  for (;;) {
    const std::uint32_t seen = word.load(std::memory_order_seq_cst);
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (!ready()) shm::futex_wait(&word, seen, kNap);
    sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (ready()) return true;
    if (give_up()) return ready();
  }
}

}  // namespace

std::unique_ptr<ShmLane> ShmLane::create(std::size_t ring_bytes, std::string& error) {
  const std::string name = shm::segment_name("p2p");
  const shm::Mapping m = shm::create_segment(name, kControlBytes + ring_bytes);
  if (!m.base) {
    error = shm::describe_failure(m, name, kControlBytes + ring_bytes);
    return nullptr;
  }
  auto* control = new (m.base) Control{};
  control->magic = kMagic;
  control->capacity = ring_bytes;
  return std::unique_ptr<ShmLane>(new ShmLane(name, m.base, m.bytes, /*owner=*/true));
}

std::unique_ptr<ShmLane> ShmLane::open(const std::string& name, std::string& error) {
  const shm::Mapping m = shm::open_segment(name);
  if (!m.base) {
    error = shm::describe_failure(m, name, 0);
    return nullptr;
  }
  const auto* control = static_cast<const Control*>(m.base);
  if (m.bytes < kControlBytes || control->magic != kMagic || control->capacity > m.bytes - kControlBytes ||
      (control->capacity & (control->capacity - 1)) != 0 || control->capacity == 0) {
    ::munmap(m.base, m.bytes);
    error = "shared-memory object " + name + " is not a lockstep point-to-point lane";
    return nullptr;
  }
  return std::unique_ptr<ShmLane>(new ShmLane(name, m.base, m.bytes, /*owner=*/false));
}

ShmLane::ShmLane(std::string name, void* base, std::size_t bytes, bool owner)
    : name_(std::move(name)),
      base_(base),
      bytes_(bytes),
      owner_(owner),
      control_(static_cast<Control*>(base)),
      ring_(static_cast<unsigned char*>(base) + kControlBytes),
      capacity_(static_cast<std::size_t>(control_->capacity)) {}

ShmLane::~ShmLane() {
  if (owner_) unlink();
  ::munmap(base_, bytes_);
}

void ShmLane::unlink() {
  if (name_.empty()) return;
  ::shm_unlink(name_.c_str());
  owner_ = false;
}

bool ShmLane::write(std::initializer_list<Part> parts, const GiveUp& give_up) {
  for (const Part& p : parts)
    if (!write_part(p.data, p.bytes, give_up)) return false;
  return true;
}

bool ShmLane::write_part(const void* data, std::size_t n, const GiveUp& give_up) {
  Control& c = *control_;
  const auto* from = static_cast<const unsigned char*>(data);
  while (n > 0) {
    const std::uint64_t w = c.written.load(std::memory_order_relaxed);
    const auto free_bytes = [&] { return capacity_ - (w - c.taken.load(std::memory_order_acquire)); };
    if (free_bytes() == 0) {
      if (!wait_until(c.space_word, c.writer_sleeps, [&] { return free_bytes() > 0; }, give_up)) return false;
      continue;
    }
    const std::size_t k = std::min({n, static_cast<std::size_t>(free_bytes()), kChunk});
    const std::size_t at = static_cast<std::size_t>(w % capacity_), first = std::min(k, capacity_ - at);
    copy_bytes(ring_ + at, from, first);
    copy_bytes(ring_, from + first, k - first);
    c.written.store(w + k, std::memory_order_release);
    bump(c.data_word, c.reader_sleeps);
    from += k;
    n -= k;
  }
  return true;
}

bool ShmLane::read(void* out, std::size_t n, const GiveUp& give_up) {
  Control& c = *control_;
  auto* to = static_cast<unsigned char*>(out);
  while (n > 0) {
    const std::uint64_t t = c.taken.load(std::memory_order_relaxed);
    const auto ready_bytes = [&] {
      return std::min<std::uint64_t>(c.written.load(std::memory_order_acquire) - t, capacity_);
    };
    if (ready_bytes() == 0) {
      if (!wait_until(c.data_word, c.reader_sleeps, [&] { return ready_bytes() > 0; }, give_up)) return false;
      continue;
    }
    const std::size_t k = std::min({n, static_cast<std::size_t>(ready_bytes()), kChunk});
    const std::size_t at = static_cast<std::size_t>(t % capacity_), first = std::min(k, capacity_ - at);
    copy_bytes(to, ring_ + at, first);
    copy_bytes(to + first, ring_, k - first);
    c.taken.store(t + k, std::memory_order_release);
    bump(c.space_word, c.writer_sleeps);
    to += k;
    n -= k;
  }
  return true;
}

void ShmLane::wake() {
  control_->data_word.fetch_add(1, std::memory_order_seq_cst);
  control_->space_word.fetch_add(1, std::memory_order_seq_cst);
  shm::futex_wake_all(&control_->data_word);
  shm::futex_wake_all(&control_->space_word);
}

}  // namespace lockstep::comm
