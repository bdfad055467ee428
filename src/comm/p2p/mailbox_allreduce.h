// All-reduce algorithms over a Mailbox (p2p/mailbox.h), for a backend that runs its all-reduces on
// lockstep's own connections rather than its engine's (gloo does; see gloo_backend.cc for why).
//
// gather_sum: every rank's buffer to every other, then a sum in rank order: n - 1 exchanges where
// a ring takes 2 (n - 1), for n / 2 times the bytes; the choice for small buffers.
// ring: n - 1 steps of reduce-scatter then n - 1 of all-gather, each sending one of n chunks to the
// next rank and receiving one from the previous (2 (n - 1) / n of the bytes). Each chunk is reduced
// along the ring once and then copied from its owner.
// Both leave the same bits on every rank. Only sizes travel with the messages: a dtype mismatch of
// the same width is the signature checks' to find.
//
// The backend keeps its failure policy: `await` waits for one exchange's works and turns their
// errors into its verdicts; `before_step` throws a verdict already reached (an abort).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "mailbox.h"

namespace lockstep::comm {

class MailboxAllreduce {
 public:
  using Exchange = std::vector<std::pair<int, WorkPtr>>;  // (peer, its send or recv)
  struct Hooks {
    std::function<void()> before_step;
    std::function<void(Exchange&, std::size_t count)> await;
  };
  // c[i] = a[i] op b[i] for n elements (c may be a).
  using Combine = std::function<void(void* c, const void* a, const void* b, std::size_t n)>;

  MailboxAllreduce(Mailbox& mailbox, int rank, int size, Hooks hooks);

  // `count` elements of `send` reduced over the ranks into `out` (which may be `send`).
  void gather_sum(const void* send, void* out, std::size_t count, DType dtype, const Combine& combine, std::uint32_t tag);
  // As gather_sum; needs count >= size.
  void ring(const void* send, void* out, std::size_t count, DType dtype, const Combine& combine, std::uint32_t tag);

 private:
  // Every peer's `count` elements into block r of `all`.
  void gather(const void* mine, void* all, std::size_t count, DType dtype, std::uint32_t tag);
  // One ring step: `give` elements to the next rank while `take` arrive from the previous.
  void pass_along(const void* from, std::size_t give, void* into, std::size_t take, DType dtype, std::uint32_t tag);
  std::byte* scratch(std::size_t bytes);

  Mailbox& mailbox_;
  int rank_, size_;
  Hooks hooks_;
  std::vector<std::byte> scratch_;  // every rank's part of a gather, a ring's arriving chunk
};

}  // namespace lockstep::comm
