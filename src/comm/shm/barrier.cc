// The shm backend's barrier, which every collective's rounds cross (shm_backend.cc), and begin(),
// the first barrier of a collective, which also compares the ranks' signatures.
//
// Barrier: each rank stores its own monotonically rising generation in its own cache line
// (no shared counter to fight over) and waits until every rank's generation reaches it.
// Waiting spins with pause for ~100 us (not at all when ranks outnumber cores), then sleeps on a
// futex in the late rank's control block, which that rank wakes when it arrives. While waiting it checks,
// every few milliseconds: the abort word (another rank failed), peers' liveness (each rank's progress thread
// holds a robust mutex in the segment; the kernel marks it owner-dead when the process dies), and the
// collective's deadline.
//
// Cost: one store and one wake per rank; a waiter reads the W generations, each on its own line.
#include <algorithm>
#include <cerrno>
#include <cstdint>

#include "lockstep/base/log.h"
#include "lockstep/error.h"
#include "shm/futex.h"
#include "shm/shm_backend.h"

namespace lockstep::comm::shm {

void ShmBackend::check_peer(int r, const Collective& c, std::uint64_t needed) {
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
    // Not held: the peer has not started yet, or it closed its communicator. One that arrived
    // between the caller's look at its generation and this one, then closed, did its part: its
    // generation, stored before it departed, says so.
    pthread_mutex_unlock(&rc.alive);
    if (rc.departed.load(std::memory_order_acquire) && rc.generation.load(std::memory_order_acquire) < needed)
      throw PeerError(peer_lost(r, c, "closed its communicator without issuing this collective"));
  }
}

std::string ShmBackend::peer_lost(int r, const Collective& c, const char* what) {
  return "rank " + std::to_string(global(r)) + " (pid " + std::to_string(control(r).pid) + ") " + what +
         " while rank " + std::to_string(global(rank_)) + " was in " + c.describe() +
         " on the shm backend; the job cannot continue";
}

void ShmBackend::check_abort(const Collective& c) {
  int who = header_->abort_rank.load(std::memory_order_acquire);
  if (who >= 0 && who != rank_)
    throw PeerError("rank " + std::to_string(global(who)) + " failed (" + header_->abort_reason +
                    ") while rank " + std::to_string(global(rank_)) + " was in " + c.describe());
}

// Waits until every rank reached barrier generation `gen`.
void ShmBackend::wait_all(std::uint64_t gen, const Collective& c) {
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
        if (control(r).generation.load(std::memory_order_acquire) < gen) check_peer(r, c, gen);
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

std::string ShmBackend::timeout_message(std::uint64_t gen, const Collective& c) {
  std::string late;
  for (int r = 0; r < size_; ++r)
    if (control(r).generation.load() < gen) late += (late.empty() ? "" : ", ") + std::to_string(global(r));
  return c.describe() + " timed out after " + log::seconds_text(options_.timeout.count()) + " on rank " +
         std::to_string(rank_) + " waiting for rank(s) " + late +
         ", which are alive but did not reach it (stuck in compute, or issuing collectives in "
         "another order); raise --timeout if they are just slow";
}

void ShmBackend::barrier(const Collective& c) {
  ++generation_;
  RankControl& mine = control(rank_);
  mine.generation.store(generation_, std::memory_order_seq_cst);
  mine.wake_word.store(static_cast<std::uint32_t>(generation_), std::memory_order_seq_cst);
  if (mine.sleepers.load(std::memory_order_seq_cst) > 0) futex_wake_all(&mine.wake_word);
  wait_all(generation_, c);
}

// Opens a collective: publish the signature with the first barrier, then compare.
void ShmBackend::begin(const Collective& c) {
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

}  // namespace lockstep::comm::shm
