// The copies a shared-memory lane makes, measured in one process: glibc's memcpy against the
// lane's block copy (p2p/block_copy.h), in chunks as the lane copies (16 KiB to 4 MiB), with
// source and destination at the same offset within 64 bytes and 16 bytes apart; and, for scale,
// cross-memory attach (process_vm_readv of 4 MiB from a forked child), the one-copy alternative.
//
//   build/bench/copy_bench
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "p2p/block_copy.h"

namespace {

constexpr std::size_t kBytes = std::size_t{4} << 20;

double seconds_since(std::chrono::steady_clock::time_point begin) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
}

// GB/s of each copy when 4 MiB go into a 4 MiB "ring" and back out, `chunk` bytes at a time.
double gbps(bool blocks, std::size_t chunk, std::size_t offset, unsigned char* ring, unsigned char* a, unsigned char* b) {
  const auto copy = [blocks](unsigned char* to, const unsigned char* from, std::size_t n) {
    if (blocks)
      lockstep::comm::copy_bytes(to, from, n);
    else
      std::memcpy(to, from, n);
  };
  const int rounds = 100;
  const auto begin = std::chrono::steady_clock::now();
  for (int r = 0; r < rounds; ++r)
    for (std::size_t at = 0; at < kBytes; at += chunk) {
      copy(ring + at, a + offset + at, chunk);
      copy(b + offset + at, ring + at, chunk);
    }
  return 2.0 * rounds * kBytes / seconds_since(begin) / 1e9;
}

// GB/s of process_vm_readv pulling 4 MiB from this process into a child's buffer.
double cross_memory_gbps(const unsigned char* source) {
  int pipe_fds[2];
  if (::pipe(pipe_fds) != 0) return 0;
  const pid_t parent = ::getpid();
  const pid_t child = ::fork();
  if (child == 0) {
    auto* into = static_cast<unsigned char*>(std::aligned_alloc(64, kBytes));
    std::memset(into, 0, kBytes);
    const int rounds = 50;
    const auto begin = std::chrono::steady_clock::now();
    bool ok = true;
    for (int r = 0; r < rounds; ++r) {
      iovec local{into, kBytes}, remote{const_cast<unsigned char*>(source), kBytes};
      ok = ok && ::process_vm_readv(parent, &local, 1, &remote, 1, 0) == static_cast<ssize_t>(kBytes);
    }
    const double rate = ok ? rounds * kBytes / seconds_since(begin) / 1e9 : 0;
    [[maybe_unused]] ssize_t k = ::write(pipe_fds[1], &rate, sizeof rate);
    ::_exit(0);
  }
  double rate = 0;
  [[maybe_unused]] ssize_t k = ::read(pipe_fds[0], &rate, sizeof rate);
  ::waitpid(child, nullptr, 0);
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);
  return rate;
}

}  // namespace

int main() {
  auto* ring = static_cast<unsigned char*>(std::aligned_alloc(4096, kBytes));
  auto* a = static_cast<unsigned char*>(std::aligned_alloc(4096, kBytes + 64));
  auto* b = static_cast<unsigned char*>(std::aligned_alloc(4096, kBytes + 64));
  std::memset(ring, 1, kBytes);
  std::memset(a, 2, kBytes + 64);
  std::memset(b, 3, kBytes + 64);
  std::printf("| chunk | memcpy, aligned (GB/s) | memcpy, 16 B apart | blocks, aligned | blocks, 16 B apart |\n");
  std::printf("|---:|---:|---:|---:|---:|\n");
  for (std::size_t chunk : {std::size_t{16} << 10, std::size_t{64} << 10, std::size_t{256} << 10, std::size_t{1} << 20, kBytes})
    std::printf("| %zu KiB | %.1f | %.1f | %.1f | %.1f |\n", chunk >> 10, gbps(false, chunk, 0, ring, a, b),
                gbps(false, chunk, 16, ring, a, b), gbps(true, chunk, 0, ring, a, b), gbps(true, chunk, 16, ring, a, b));
  std::printf("process_vm_readv, 4 MiB from another process: %.1f GB/s\n", cross_memory_gbps(a));
  return 0;
}
