// lockstep: the command-line tool. Thin by design: it parses flags and calls library code.
//
//   lockstep run [options] PROGRAM [ARGS...]   the launcher (torchrun's flags)
//   lockstep demo                               all-reduce across local processes, checked
//   lockstep bench allreduce                    the nccl-tests style sweep for one backend
//   lockstep doctor [-- PROGRAM ARGS...]         why N workers are or are not N times faster
//   lockstep report RUN_DIR                      one self-contained HTML page for a run
//
// demo and bench run as one rank when started inside a job (RANK or OMPI_COMM_WORLD_RANK set,
// as under lockstep run or mpirun), and otherwise launch --nproc copies of themselves.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <thread>
#include <vector>

#include "bench_allreduce.h"
#include "doctor.h"
#include "lockstep/comm/rendezvous.h"
#include "lockstep/error.h"
#include "lockstep/launch/launcher.h"
#include "report.h"

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
  std::printf("rank %d of %d, %s: joined in %.1f ms; allreduce of %zu floats in %.2f ms: %s\n", comm.rank(),
              world, comm.backend_name().c_str(), setup_ms, count, ms,
              wrong == 0 ? "correct" : (std::to_string(wrong) + " WRONG elements").c_str());
  std::fflush(stdout);
  comm.barrier()->wait();
  return wrong == 0 ? 0 : 1;
}

// Starts `nproc` copies of this very command on this machine through the launcher.
int launch_self(int nproc, const std::vector<std::string>& args) {
  launch::LaunchOptions o;
  o.nproc_per_node = nproc;
  o.program = args;
  o.program[0] = "/proc/self/exe";
  char path[4096];
  ssize_t n = ::readlink("/proc/self/exe", path, sizeof path - 1);
  if (n > 0) o.program[0] = std::string(path, static_cast<std::size_t>(n));
  return launch::run_job(o);
}

// torchrun accepts `--tee 3` and `--redirects 3`; lockstep also accepts a bare `--tee`
// (meaning 3) and underscores in option names.
std::vector<std::string> normalise_run_args(int argc, char** argv) {
  std::vector<std::string> out;
  bool in_program = false;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (!in_program && a.rfind("--", 0) == 0) {
      auto eq = a.find('=');
      std::string name = a.substr(0, eq), rest = eq == std::string::npos ? "" : a.substr(eq);
      for (auto& ch : name)
        if (ch == '_') ch = '-';
      a = name + rest;
      out.push_back(a);
      if ((a == "--tee" || a == "--redirects") && !(i + 1 < argc && std::string(argv[i + 1]).size() == 1 &&
                                                    argv[i + 1][0] >= '0' && argv[i + 1][0] <= '3'))
        out.push_back("3");
      continue;
    }
    out.push_back(a);
    // The first positional after `run` (and after an option's value) is the program: the
    // CLI parser stops there (prefix_command); normalising stops at the first word that is
    // neither an option nor a value, which is at or after the program, so it is harmless.
  }
  return out;
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

  tools::DoctorOptions doc;
  auto* doctor = app.add_subcommand(
      "doctor",
      "Measure a Trainer program with 1 and N workers and explain the difference (recommendations)");
  doctor->prefix_command();
  doctor->add_option("--nproc-per-node", doc.nproc, "workers in the N-worker run")
      ->check(CLI::Range(2, 256))
      ->capture_default_str();
  doctor->add_option("--steps", doc.steps, "optimiser steps per run")->capture_default_str();
  doctor->add_option("--window", doc.window, "steps per measured window (the first window is warm-up)")
      ->capture_default_str();
  doctor->add_option("--backend", doc.backend, "shm | gloo | mpi | auto")->capture_default_str();
  doctor->add_option("--output-dir", doc.output_dir,
                     "where the runs and doctor.json go (default: a new /tmp dir)");
  std::vector<std::string> doctor_program;
  doctor->add_option(
      "program", doctor_program,
      "-- PROGRAM ARGS: a program that trains with lockstep::train::Trainer (default: the Fashion-MNIST "
      "example's CNN)");

  std::string report_dir, report_out, report_doctor;
  auto* report = app.add_subcommand("report", "Write one self-contained HTML page for a Trainer run");
  report->add_option("run_dir", report_dir, "the run's --output-dir (holds metrics.jsonl)")->required();
  report->add_option("-o,--output", report_out, "the HTML file (default: RUN_DIR/report.html)");
  report->add_option("--doctor", report_doctor,
                     "a doctor.json to include (default: RUN_DIR/doctor.json if any)");

  launch::LaunchOptions lo;
  std::string nproc_text = "1";
  bool standalone = false;
  auto* run =
      app.add_subcommand("run", "Start and supervise the workers of a job (torchrun-compatible flags)");
  run->prefix_command();
  run->add_option("--nproc-per-node", nproc_text,
                  "workers on this machine: a number, or auto (one per CPU core)")
      ->capture_default_str();
  run->add_option("--nnodes", lo.nnodes, "machines in the job, one `lockstep run` on each")
      ->capture_default_str();
  run->add_option("--node-rank", lo.node_rank, "this machine's index, 0..nnodes-1; node 0 hosts the store")
      ->capture_default_str();
  run->add_option("--master-addr", lo.master_addr, "address of node 0, as the other nodes reach it")
      ->capture_default_str();
  run->add_option("--master-port", lo.master_port,
                  "port of node 0's store; 0 on one machine picks a free one (workers get another free port "
                  "as MASTER_PORT, for their own use)")
      ->capture_default_str();
  run->add_flag("--standalone", standalone, "one machine, free ports (same as --nnodes 1 --master-port 0)");
  run->add_option("--max-restarts", lo.max_restarts,
                  "restart the whole group this many times after a failure")
      ->capture_default_str();
  run->add_option("--monitor-interval", lo.monitor_interval, "seconds between checks of the other nodes")
      ->capture_default_str();
  run->add_option("--log-dir", lo.log_dir, "directory for per-rank log files (with --tee/--redirects)");
  run->add_option("--tee", lo.tee, "copy output to files too: 1 stdout, 2 stderr, 3 both (bare --tee: 3)")
      ->capture_default_str();
  run->add_option("--redirects", lo.redirects, "send output to files only: 1 stdout, 2 stderr, 3 both")
      ->capture_default_str();
  run->add_option("--run-id", lo.run_id,
                  "the job's name; the same on every node (default: random on one machine)");
  run->add_option("--grace-period", lo.grace_period,
                  "seconds between SIGTERM and SIGKILL when stopping workers")
      ->capture_default_str();
  run->add_option("--timeout", lo.timeout, "seconds the whole job may take (0: no limit)")
      ->capture_default_str();
  auto* join_timeout =
      run->add_option("--join-timeout", lo.join_timeout,
                      "seconds to reach node 0's store and see every node (default: --timeout "
                      "when set and shorter, else 60)");
  run->add_option("--backend", lo.backend, "exported as LOCKSTEP_BACKEND: shm | gloo | mpi | auto");

  std::vector<std::string> normalised;
  if (argc > 1 && std::string(argv[1]) == "run") {
    normalised = normalise_run_args(argc, argv);
  } else {
    normalised.assign(argv, argv + argc);
  }
  std::vector<char*> cargs;
  for (auto& a : normalised) cargs.push_back(a.data());
  int cargc = static_cast<int>(cargs.size());
  CLI11_PARSE(app, cargc, cargs.data());
  try {
    if (run->parsed()) {
      lo.program = run->remaining();
      if (join_timeout->count() == 0 && lo.timeout > 0)
        lo.join_timeout = std::min(lo.join_timeout, lo.timeout);
      if (standalone) lo.nnodes = 1, lo.master_port = 0, lo.node_rank = 0;
      if (nproc_text == "auto") {
        lo.nproc_per_node = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
      } else {
        try {
          std::size_t used = 0;
          lo.nproc_per_node = std::stoi(nproc_text, &used);
          if (used != nproc_text.size()) throw std::invalid_argument(nproc_text);
        } catch (const std::logic_error&) {
          throw ConfigError("--nproc-per-node '" + nproc_text + "' is not a number or 'auto'");
        }
      }
      return launch::run_job(lo);
    }
    if (doctor->parsed()) {
      if (inside_job())
        throw ConfigError(
            "lockstep doctor starts its own runs: call it directly, not under lockstep run "
            "(lockstep doctor --nproc-per-node N -- PROGRAM ARGS)");
      doc.program = doctor_program;
      for (const auto& a : doctor->remaining())
        if (a != "--") doc.program.push_back(a);
      return tools::run_doctor(doc);
    }
    if (report->parsed()) {
      std::printf("%s\n", tools::write_report(report_dir, report_out, report_doctor).c_str());
      return 0;
    }
    if (demo->parsed()) {
      if (inside_job()) return demo_worker(backend, count);
      int rc = launch_self(nproc, raw_args);
      std::printf(rc == 0 ? "demo: %d ranks all-reduced and agree\n" : "demo: FAILED\n", nproc);
      return rc;
    }
    if (ar->parsed()) {
      if (inside_job()) return tools::bench_allreduce_worker(bo);
      return launch_self(bench_nproc, raw_args);
    }
  } catch (const lockstep::Error& e) {
    std::fprintf(stderr, "lockstep: %s\n", e.what());
    return 1;
  }
  return 0;
}
