// SignatureCheck (backend.h): mismatched collectives found over the backend's own transport.
#include <string>

#include "backend.h"
#include "lockstep/error.h"

namespace lockstep::comm {
namespace {
// splitmix64's finaliser: a running hash in which the order of the signatures matters.
std::uint64_t mix(std::uint64_t h, std::uint64_t v) {
  std::uint64_t z = h ^ (v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
}  // namespace

void SignatureCheck::before(const Collective& c, int size, int rank, const Gather& gather) {
  if (every_ <= 0 || size < 2) return;
  hash_ = mix(hash_, c.signature());
  since_.push_back(c.signature());
  if (c.sequence % static_cast<std::uint64_t>(every_) != 0) return;
  const std::uint64_t mine[2] = {c.sequence, hash_};
  std::vector<std::uint64_t> all(2 * static_cast<std::size_t>(size));
  gather(mine, all.data(), 2);
  for (int r = 0; r < size; ++r)
    if (all[2 * static_cast<std::size_t>(r)] != c.sequence || all[2 * static_cast<std::size_t>(r) + 1] != hash_)
      pin_down(c, size, rank, gather);
  since_.clear();
}

// The hashes differ: every rank holds the same number of signatures since the last check (they
// all check at the same sequence), so one more gather of them finds the first that differs.
void SignatureCheck::pin_down(const Collective& c, int size, int rank, const Gather& gather) {
  const std::size_t n = since_.size();
  std::vector<std::uint64_t> all(n * static_cast<std::size_t>(size));
  gather(since_.data(), all.data(), n);
  const std::uint64_t first = c.sequence + 1 - n;
  for (std::size_t i = 0; i < n; ++i)
    for (int r = 1; r < size; ++r) {
      const std::uint64_t theirs = all[static_cast<std::size_t>(r) * n + i], rank0 = all[i];
      if (theirs == rank0) continue;
      const std::uint64_t seq = first + i;
      const std::string when = seq == c.sequence ? "before it ran"
                                                 : "at #" + std::to_string(c.sequence) +
                                                       ", the first collective checked after it; "
                                                       "LOCKSTEP_CHECK_COLLECTIVES=every stops a mismatch before it runs";
      throw MismatchError("collective #" + std::to_string(seq) + " differs across ranks: rank 0 issued " +
                          describe_signature(rank0) + " but rank " + std::to_string(r) + " issued " +
                          describe_signature(theirs) + " (seen on rank " + std::to_string(rank) + " " + when +
                          "). Every rank must issue the same collectives in the same order");
    }
  throw MismatchError("ranks disagree on a collective between #" + std::to_string(first) + " and #" +
                      std::to_string(c.sequence) + " (seen on rank " + std::to_string(rank) + ")");
}

}  // namespace lockstep::comm
