// The environment each worker starts with: the launcher's own, plus the torchrun contract
// (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), lockstep's (LOCKSTEP_STORE_ADDR, TOKEN,
// RUN_ID, RESTART_COUNT, BACKEND), and defaults for threads and malloc when the user set none.
#pragma once

#include <string>
#include <vector>

#include "lockstep/base/knobs.h"
#include "lockstep/launch/launcher.h"
#include "worker_group.h"

namespace lockstep::launch {

// What the agents agreed on when they joined, and what changes per attempt.
struct JobPlacement {
  std::string run_id, token;
  int world_size = 0;
  int first_rank = 0;         // this node's first global rank
  std::string store_address;  // host:port of node 0's store, as workers reach it
  int attempt = 0;
  int master_port = 0;  // a free port on node 0 for the program's own use (PyTorch's TCPStore)
};

// glibc's malloc returns freed blocks above its mmap threshold (128 KiB, rising with use) to the
// kernel, so a training step that frees and reallocates its activations page-faults them all in
// again each step (the example's CNN trained 34-49% faster here without those faults). Workers
// keep freed memory for reuse instead, so their footprint stays at its peak.
inline constexpr const char* kWorkerMallocTunables =
    "glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824";

// When OpenBLAS would pick kernels below the CPU's best (it does not know the CPU model) and the
// user chose none, sets OPENBLAS_CORETYPE to the best in this process's environment, which every
// worker inherits, with LOCKSTEP_OPENBLAS_OWN_CORE naming OpenBLAS's own pick, and says so in one
// line. Calls setenv: run it before any thread starts.
void choose_blas_kernels();

// One spec per local worker of this node. `inherited` is the launcher's environment.
std::vector<WorkerSpec> worker_specs(const LaunchOptions& options, const JobPlacement& placement,
                                     knobs::Environment inherited);

// An elastic worker of machine `node` (its agent's number in the job) at `local` rank: the store,
// the run, LOCKSTEP_ELASTIC=MIN:MAX, GROUP_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE; no RANK or
// WORLD_SIZE, which change as the membership does. `incarnation` counts the workers started in
// this slot before (they name the log files apart).
WorkerSpec elastic_worker_spec(const LaunchOptions& options, const JobPlacement& placement, int node, int local,
                               int incarnation, knobs::Environment inherited);

}  // namespace lockstep::launch
