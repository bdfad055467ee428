// lockstep: the command-line tool. Thin by design: it parses flags and calls library code.
//
//   lockstep demo              all-reduce across local processes, checked, with a summary
//   lockstep bench allreduce   the nccl-tests style sweep for one backend
//
// Both run as "ranks" when started inside a job (RANK or OMPI_COMM_WORLD_RANK is set, as under
// mpirun or a launcher) and otherwise start --nproc copies of themselves on this machine.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <vector>

#include "bench_allreduce.h"
#include "local_spawn.h"
#include "lockstep/comm/rendezvous.h"
#include "lockstep/error.h"

namespace {

using namespace lockstep;
using namespace lockstep::comm;

bool inside_job() {
  return std::getenv("RANK") != nullptr || std::getenv("OMPI_COMM_WORLD_RANK") != nullptr;
}

// Each rank contributes (rank + 1) * (i + 1); the sum over ranks is i+1 times a triangle number.
int demo_worker(const std::string& backend, std::size_t count) {
  CommOptions options;
  options.backend = backend;
  auto start = std::chrono::steady_clock::now();
  Job job = join_from_env(options);
  Communicator& comm = *job.comm;
  double setup_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  std::vector<float> data(count);
  for (std::size_t i = 0; i < count; ++i)
    data[i] = static_cast<float>((comm.rank() + 1) * static_cast<int>(i % 1000 + 1));
  auto t0 = std::chrono::steady_clock::now();
  comm.allreduce(data.data(), count, DType::f32, ReduceOp::sum)->wait();
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  int world = comm.size();
  float triangle = static_cast<float>(world * (world + 1) / 2);
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < count; ++i)
    if (data[i] != triangle * static_cast<float>(i % 1000 + 1)) ++wrong;
  std::printf("[rank %d/%d] %s: joined in %.1f ms; allreduce of %zu floats in %.2f ms: %s\n", comm.rank(),
              world, comm.backend_name().c_str(), setup_ms, count, ms,
              wrong == 0 ? "correct" : (std::to_string(wrong) + " WRONG elements").c_str());
  std::fflush(stdout);
  comm.barrier()->wait();
  return wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"lockstep: distributed data-parallel training for libtorch"};
  app.require_subcommand(1);
  std::vector<std::string> raw_args(argv, argv + argc);

  int nproc = 2;
  std::string backend = "auto";
  std::size_t count = 1 << 20;
  auto* demo = app.add_subcommand("demo", "All-reduce across local processes and check the result");
  demo->add_option("--nproc", nproc, "processes to start (ignored inside a job)")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  demo->add_option("--backend", backend, "shm | gloo | mpi | auto")->capture_default_str();
  demo->add_option("--count", count, "floats per rank")->capture_default_str();

  auto* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  tools::BenchOptions bo;
  int bench_nproc = 2;
  auto* ar = bench->add_subcommand("allreduce", "Allreduce sweep with nccl-tests columns");
  ar->add_option("--nproc", bench_nproc, "processes to start (ignored inside a job)")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  ar->add_option("--backend", bo.backend, "shm | gloo | mpi | auto")->capture_default_str();
  ar->add_option("--dtype", bo.dtype, "f32 | f64 | f16 | bf16 | i32 | i64")->capture_default_str();
  ar->add_option("--op", bo.op, "sum | avg | min | max")->capture_default_str();
  ar->add_option("--min-bytes", bo.min_bytes, "smallest message")->capture_default_str();
  ar->add_option("--max-bytes", bo.max_bytes, "largest message")->capture_default_str();
  ar->add_option("--warmup", bo.warmup, "untimed iterations per size")->capture_default_str();
  ar->add_option("--iters", bo.iters, "timed iterations per size (0: by size)")->capture_default_str();
  ar->add_flag("--json", bo.json, "print JSON instead of the table");
  ar->add_option("--shm-slot-bytes", bo.shm_slot_bytes, "shm staging bytes per rank (0: default 1 MiB)");

  CLI11_PARSE(app, argc, argv);
  try {
    if (demo->parsed()) {
      if (inside_job()) return demo_worker(backend, count);
      int rc = tools::run_local_ranks(nproc, raw_args);
      std::printf(rc == 0 ? "demo: %d ranks all-reduced and agree\n" : "demo: FAILED\n", nproc);
      return rc;
    }
    if (ar->parsed()) {
      if (inside_job()) return tools::bench_allreduce_worker(bo);
      return tools::run_local_ranks(bench_nproc, raw_args);
    }
  } catch (const lockstep::Error& e) {
    std::fprintf(stderr, "lockstep: %s\n", e.what());
    return 1;
  }
  return 0;
}
