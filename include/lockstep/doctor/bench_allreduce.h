// `lockstep bench allreduce` and `lockstep demo`: all-reduces across the ranks of a job,
// checked against comm::reference, the first timed like nccl-tests.
#pragma once

#include <cstddef>
#include <string>

namespace lockstep::doctor {

struct BenchOptions {
  std::string backend = "shm";
  std::string dtype = "f32";
  std::string op = "sum";
  std::size_t min_bytes = 4u << 10;
  std::size_t max_bytes = 256u << 20;
  int warmup = 5;
  int iters = 0;  // 0: chosen per size
  bool json = false;
  // Time the all-reduce in place (one buffer, as torch.distributed's all_reduce and DDP's buckets
  // do) rather than from a send buffer into a receive buffer (nccl-tests' default).
  bool in_place = false;
  std::size_t shm_slot_bytes = 0;  // 0: the communicator's default
  // After the sweep, each machine's link out timed alone: this many bytes from its first rank to
  // the next machine's (0: not measured). Needs the launcher's GROUP_RANK and LOCAL_RANK.
  std::size_t link_bytes = 0;

  // ConfigError naming the option when the sweep cannot run (no sizes, a size below one
  // element, a backend or dtype that does not exist).
  void validate() const;
};

// Runs on every rank of an already-started job; rank 0 prints the table (or JSON). Returns 0
// when every result matched the reference, 1 otherwise.
int bench_allreduce_worker(const BenchOptions& options);

// One all-reduce of `count` floats, checked, with the time it took: a quick proof that the
// machine's shared memory or network works. Returns 0 when every rank got the right sum.
int demo_worker(const std::string& backend, std::size_t count);

}  // namespace lockstep::doctor
