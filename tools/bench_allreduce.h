#pragma once

#include <cstddef>
#include <string>

namespace lockstep::tools {

struct BenchOptions {
  std::string backend = "shm";
  std::string dtype = "f32";
  std::string op = "sum";
  std::size_t min_bytes = 4u << 10;
  std::size_t max_bytes = 256u << 20;
  int warmup = 5;
  int iters = 0;  // 0: chosen per size
  bool json = false;
  std::size_t shm_slot_bytes = 0;  // 0: the communicator's default
};

// Runs on every rank of an already-started job; rank 0 prints the table (or JSON).
int bench_allreduce_worker(const BenchOptions& options);

}  // namespace lockstep::tools
