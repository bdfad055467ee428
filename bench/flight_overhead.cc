// What the always-on hang and mismatch machinery costs each collective on the issuing thread:
// the flight ring's three records (issued, started, finished, each with a clock read) and the
// running signature hash (its gather every LOCKSTEP_CHECK_COLLECTIVES-th call is a collective of
// 16 bytes per rank, measured with the all-reduces, not here). Compare the figure with a
// collective's latency and a step's collectives (bench/RESULTS.md).
//
//   build/bench/flight_overhead [--calls N]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "backend.h"
#include "flight_ring.h"

using namespace lockstep::comm;
using lockstep::Clock;

namespace {

double nanoseconds_per_call(std::uint64_t calls, bool with_signature) {
  FlightRing ring;
  SignatureCheck check(64);
  std::uint64_t gathered = 0;
  // Two ranks that agree: the gather (a collective, timed with the all-reduces) becomes two copies.
  const SignatureCheck::Gather agreeing = [&](const std::uint64_t* mine, std::uint64_t* all, std::size_t words) {
    std::memcpy(all, mine, words * sizeof(std::uint64_t));
    std::memcpy(all + words, mine, words * sizeof(std::uint64_t));
    ++gathered;
  };
  Collective c;
  c.kind = CollectiveKind::allreduce;
  c.count = 1024;
  const auto begin = std::chrono::steady_clock::now();
  for (std::uint64_t i = 0; i < calls; ++i) {
    c.sequence = i;
    if (with_signature) check.before(c, 2, 0, agreeing);
    ring.issued(c, Clock::now());
    ring.started(i, Clock::now());
    ring.finished(i, Clock::now());
  }
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - begin).count();
  if (with_signature && gathered != (calls + 63) / 64)
    std::fprintf(stderr, "expected a gather every 64th call, got %llu\n", static_cast<unsigned long long>(gathered));
  return ns / static_cast<double>(calls);
}

}  // namespace

int main(int argc, char** argv) {
  std::uint64_t calls = 10'000'000;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--calls") == 0) calls = std::strtoull(argv[i + 1], nullptr, 10);
  const double ring = nanoseconds_per_call(calls, false);
  std::printf("flight ring (issued, started, finished, 3 clock reads): %.1f ns per collective\n", ring);
  std::printf("... with the running signature hash:                     %.1f ns per collective\n",
              nanoseconds_per_call(calls, true));
  return 0;
}
