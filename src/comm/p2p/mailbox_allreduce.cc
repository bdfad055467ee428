#include "mailbox_allreduce.h"

#include <cstring>

namespace lockstep::comm {
namespace {

// The mailbox's dtype for a message of `dtype`: only the width, so that a mismatch of two dtypes
// of the same width reaches the signature checks, which name both collectives.
DType as_words(DType dtype) {
  const std::size_t width = dtype_size(dtype);
  return width == 8 ? DType::i64 : width == 4 ? DType::i32 : DType::f16;
}

int mailbox_tag(std::uint32_t tag) {
  return static_cast<int>(tag & 0x7fffffffu);
}

}  // namespace

MailboxAllreduce::MailboxAllreduce(Mailbox& mailbox, int rank, int size, Hooks hooks)
    : mailbox_(mailbox), rank_(rank), size_(size), hooks_(std::move(hooks)) {}

std::byte* MailboxAllreduce::scratch(std::size_t bytes) {
  if (scratch_.size() < bytes) scratch_.resize(bytes);
  return scratch_.data();  // new[]'s alignment suits every element type
}

void MailboxAllreduce::gather_sum(const void* send, void* out, std::size_t count, DType dtype, const Combine& combine,
                                  std::uint32_t tag) {
  const std::size_t width = dtype_size(dtype), n = static_cast<std::size_t>(size_);
  std::byte* all = scratch(count * n * width);
  std::memcpy(all + static_cast<std::size_t>(rank_) * count * width, send, count * width);
  gather(send, all, count, dtype, tag);
  std::memcpy(out, all, count * width);
  for (std::size_t r = 1; r < n; ++r) combine(out, out, all + r * count * width, count);
}

void MailboxAllreduce::gather(const void* mine, void* all, std::size_t count, DType dtype, std::uint32_t tag) {
  hooks_.before_step();
  const std::size_t bytes = count * dtype_size(dtype);
  Exchange exchange;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    exchange.emplace_back(r, mailbox_.send(mine, count, as_words(dtype), r, mailbox_tag(tag)));
    exchange.emplace_back(r, mailbox_.recv(static_cast<char*>(all) + static_cast<std::size_t>(r) * bytes, count,
                                           as_words(dtype), r, mailbox_tag(tag)));
  }
  hooks_.await(exchange, count);
}

void MailboxAllreduce::ring(const void* send, void* out, std::size_t count, DType dtype, const Combine& combine,
                            std::uint32_t tag) {
  const std::size_t n = static_cast<std::size_t>(size_), me = static_cast<std::size_t>(rank_);
  const std::size_t width = dtype_size(dtype);
  auto lo = [&](std::size_t c) { return c * count / n; };
  auto length = [&](std::size_t c) { return lo(c + 1) - lo(c); };
  auto at = [&](std::size_t c) { return static_cast<char*>(out) + lo(c) * width; };
  if (send != out) std::memcpy(out, send, count * width);
  std::byte* arrived = scratch((count + n - 1) / n * width);  // chunk lengths differ by at most one
  for (std::size_t step = 0; step + 1 < n; ++step) {  // reduce-scatter: this rank ends owning chunk me + 1
    const std::size_t give = (me + n - step) % n, take = (me + 2 * n - step - 1) % n;
    pass_along(at(give), length(give), arrived, length(take), dtype, tag);
    combine(at(take), at(take), arrived, length(take));
  }
  for (std::size_t step = 0; step + 1 < n; ++step) {  // all-gather: pass the owned chunks on
    const std::size_t give = (me + 1 + n - step) % n, take = (me + n - step) % n;
    pass_along(at(give), length(give), at(take), length(take), dtype, tag);
  }
}

void MailboxAllreduce::pass_along(const void* from, std::size_t give, void* into, std::size_t take, DType dtype,
                                  std::uint32_t tag) {
  hooks_.before_step();
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  Exchange exchange;
  exchange.emplace_back(prev, mailbox_.recv(into, take, as_words(dtype), prev, mailbox_tag(tag)));
  exchange.emplace_back(next, mailbox_.send(from, give, as_words(dtype), next, mailbox_tag(tag)));
  hooks_.await(exchange, take);
}

}  // namespace lockstep::comm
