// lockstep: the command-line tool. Thin by design: each subcommand parses its flags and calls
// the library (launch, doctor); nothing here is logic a library user could not call.
//
//   lockstep run [options] PROGRAM [ARGS...]   the launcher (torchrun's flags)
//   lockstep store --port P                     a job's store in a process of its own (elastic jobs)
//   lockstep demo                               all-reduce across local processes, checked
//   lockstep bench allreduce                    the nccl-tests style sweep for one backend
//   lockstep doctor [-- PROGRAM ARGS...]         why N workers are or are not N times faster
//   lockstep report RUN_DIR                      one self-contained HTML page for a run
//   lockstep plan --from-run DIR --nnodes N ...  the layouts of a job ranked before running it
//   lockstep env [--markdown]                    every environment variable lockstep reads
//   lockstep metrics-format                      the keys of metrics.jsonl (docs/metrics.md)
//
// demo and bench run as one rank when started inside a job (lockstep run, torchrun, mpirun,
// srun, SageMaker), and otherwise launch --nproc copies of themselves.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <thread>
#include <vector>

#include "lockstep/base/gpus.h"
#include "lockstep/base/knobs.h"
#include "lockstep/base/main.h"
#include "lockstep/comm/backends.h"
#include "lockstep/comm/rendezvous.h"
#include "lockstep/doctor/bench_allreduce.h"
#include "lockstep/doctor/doctor.h"
#include "lockstep/doctor/plan.h"
#include "lockstep/doctor/report.h"
#include "lockstep/error.h"
#include "lockstep/launch/launcher.h"
#include "lockstep/train_core/metrics.h"

namespace {

using namespace lockstep;

// Starts `nproc` copies of this very command on this machine through the launcher.
int launch_self(int nproc, const std::vector<std::string>& args) {
  launch::LaunchOptions o;
  o.nproc_per_node = nproc;
  o.program = args;
  char path[4096];
  ssize_t n = ::readlink("/proc/self/exe", path, sizeof path - 1);
  o.program[0] = n > 0 ? std::string(path, static_cast<std::size_t>(n)) : "/proc/self/exe";
  return launch::run_job(o);
}

// A subcommand: registers its flags on construction, runs when parsed.
struct Command {
  CLI::App* app = nullptr;
  virtual ~Command() = default;
  virtual int run() = 0;
};

struct RunCommand : Command {
  launch::LaunchOptions options;
  std::string nproc = "1";
  std::string nnodes = "1";
  bool standalone = false;
  CLI::Option* join_timeout = nullptr;

  explicit RunCommand(CLI::App& parent) {
    app =
        parent.add_subcommand("run", "Start and supervise the workers of a job (torchrun-compatible flags)");
    app->prefix_command();
    app->add_option("--nproc-per-node", nproc,
                    "workers on this machine: a number, or auto (one per visible GPU, else one per CPU core)")
        ->capture_default_str();
    app->add_option("--nnodes", nnodes,
                    "machines in the job, one `lockstep run` on each; MIN:MAX for an elastic job, which starts "
                    "with MIN and goes on as machines fail or join")
        ->capture_default_str();
    app->add_option("--node-rank", options.node_rank,
                    "this machine's index, 0..nnodes-1; node 0 hosts the store")
        ->capture_default_str();
    app->add_option("--rdzv-endpoint", options.rdzv_endpoint,
                    "elastic jobs: HOST:PORT of a `lockstep store` run apart from the training machines, so "
                    "that losing any of them is survivable (default: node 0 hosts the store)");
    app->add_option("--master-addr", options.master_addr, "address of node 0, as the other nodes reach it")
        ->capture_default_str();
    app->add_option(
           "--master-port", options.master_port,
           "port of node 0's store; 0 on one machine picks a free one (workers get another free port as "
           "MASTER_PORT, for their own use)")
        ->capture_default_str();
    app->add_flag("--standalone", standalone, "one machine, free ports (same as --nnodes 1 --master-port 0)");
    app->add_option("--max-restarts", options.max_restarts,
                    "restart the whole group this many times after a failure")
        ->capture_default_str();
    app->add_option("--monitor-interval", options.monitor_interval,
                    "seconds between checks of the other nodes")
        ->capture_default_str();
    app->add_option("--log-dir", options.log_dir,
                    "directory for per-rank log files (with --tee/--redirects)");
    app->add_option("--tee", options.tee,
                    "copy output to files too: 1 stdout, 2 stderr, 3 both (bare --tee: 3)")
        ->capture_default_str();
    app->add_option("--redirects", options.redirects, "send output to files only: 1 stdout, 2 stderr, 3 both")
        ->capture_default_str();
    app->add_option("--run-id", options.run_id,
                    "the job's name; the same on every node (default: random on one machine)");
    app->add_option("--grace-period", options.grace_period,
                    "seconds between SIGTERM and SIGKILL when stopping workers")
        ->capture_default_str();
    app->add_option("--timeout", options.timeout, "seconds the whole job may take (0: no limit)")
        ->capture_default_str();
    join_timeout =
        app->add_option("--join-timeout", options.join_timeout,
                        "seconds to reach node 0's store and see every node (default: --timeout when set "
                        "and shorter, else 60)");
    app->add_option("--backend", options.backend, "exported as LOCKSTEP_BACKEND: " + comm::backend_choices());
    app->add_option("--torch-backend", options.torch_backend,
                    "Python workers: create torch.distributed's default process group with this backend "
                    "(lockstep, gloo, ...) as torch is imported, for scripts that leave it to the Hugging "
                    "Face Trainer or Accelerate (exported as LOCKSTEP_TORCH_BACKEND; needs lockstep_torch)");
  }

  int run() override {
    options.program = app->remaining();
    if (!options.program.empty() && options.program[0].rfind("-", 0) == 0 && options.program[0] != "-")
      throw ConfigError(
          "unknown option " + options.program[0] +
          " before the program: `lockstep run --help` lists the options (the program and its own "
          "flags come after them)");
    if (join_timeout->count() == 0 && options.timeout > 0)
      options.join_timeout = std::min(options.join_timeout, options.timeout);
    parse_nnodes();
    if (standalone) options.nnodes = 1, options.master_port = 0, options.node_rank = 0, options.min_nodes = 0;
    options.nproc_per_node = parse_nproc();
    return launch::run_job(options);
  }

  // "N", or "MIN:MAX" (torchrun's syntax) for an elastic job.
  void parse_nnodes() {
    const auto colon = nnodes.find(':');
    auto number = [&](const std::string& text) {
      try {
        std::size_t used = 0;
        const int n = std::stoi(text, &used);
        if (used == text.size()) return n;
      } catch (const std::logic_error&) {
      }
      throw ConfigError("--nnodes '" + nnodes + "' is not a number of machines or MIN:MAX");
    };
    if (colon == std::string::npos) {
      options.nnodes = number(nnodes);
      return;
    }
    options.min_nodes = number(nnodes.substr(0, colon));
    options.nnodes = number(nnodes.substr(colon + 1));
    if (options.min_nodes < 1) throw ConfigError("--nnodes " + nnodes + ": MIN must be at least 1");
  }

  int parse_nproc() const {
    if (nproc == "auto") return auto_nproc_per_node(visible_gpus(), std::thread::hardware_concurrency());
    try {
      std::size_t used = 0;
      int n = std::stoi(nproc, &used);
      if (used == nproc.size()) return n;
    } catch (const std::logic_error&) {
    }
    throw ConfigError("--nproc-per-node '" + nproc + "' is not a number or 'auto'");
  }
};

struct StoreCommand : Command {
  std::string host = "*";
  int port = 0;

  explicit StoreCommand(CLI::App& parent) {
    app = parent.add_subcommand(
        "store", "Host a job's store in a process of its own, until SIGINT or SIGTERM (LOCKSTEP_TOKEN: the secret)");
    app->add_option("--host", host, "address to listen on (*: every IPv4 and IPv6 address)")->capture_default_str();
    app->add_option("--port", port, "port to listen on (0: a free one, printed)")->capture_default_str();
  }

  int run() override { return launch::serve_store(host, port); }
};

struct DemoCommand : Command {
  int nproc = 2;
  std::string backend = "auto";
  std::size_t count = 1 << 20;
  std::vector<std::string> argv;

  DemoCommand(CLI::App& parent, std::vector<std::string> raw) : argv(std::move(raw)) {
    app = parent.add_subcommand("demo", "All-reduce across local processes and check the result");
    app->add_option("--nproc", nproc, "processes to start (ignored inside a job)")
        ->check(CLI::Range(1, 256))
        ->capture_default_str();
    app->add_option("--backend", backend, comm::backend_choices())->capture_default_str();
    app->add_option("--count", count, "floats per rank")->capture_default_str();
  }

  int run() override {
    if (comm::started_as_rank()) return doctor::demo_worker(backend, count);
    const int rc = launch_self(nproc, argv);
    std::printf(rc == 0 ? "demo: %d ranks all-reduced and agree\n" : "demo: FAILED\n", nproc);
    return rc;
  }
};

struct BenchCommand : Command {
  doctor::BenchOptions options;
  int nproc = 2;
  std::vector<std::string> argv;
  CLI::App* allreduce = nullptr;

  BenchCommand(CLI::App& parent, std::vector<std::string> raw) : argv(std::move(raw)) {
    app = parent.add_subcommand("bench", "Benchmarks");
    app->require_subcommand(1);
    allreduce = app->add_subcommand("allreduce", "Allreduce sweep with nccl-tests columns");
    allreduce->add_option("--nproc", nproc, "processes to start (ignored inside a job)")
        ->check(CLI::Range(1, 256))
        ->capture_default_str();
    allreduce->add_option("--backend", options.backend, comm::backend_choices())->capture_default_str();
    allreduce->add_option("--dtype", options.dtype, "f32 | f64 | f16 | bf16 | i32 | i64")
        ->capture_default_str();
    allreduce->add_option("--op", options.op, "sum | avg | min | max | product | band | bor | bxor")->capture_default_str();
    allreduce->add_option("--min-bytes", options.min_bytes, "smallest message")->capture_default_str();
    allreduce->add_option("--max-bytes", options.max_bytes, "largest message")->capture_default_str();
    allreduce->add_option("--warmup", options.warmup, "untimed iterations per size")->capture_default_str();
    allreduce->add_option("--iters", options.iters, "timed iterations per size (0: by size)")
        ->capture_default_str();
    allreduce->add_flag("--json", options.json, "print JSON instead of the table");
    allreduce->add_flag("--in-place", options.in_place,
                        "time in-place all-reduces (as torch.distributed and DDP do), not send -> receive");
    allreduce->add_option("--shm-slot-bytes", options.shm_slot_bytes,
                          "shm staging bytes per rank (0: default 1 MiB)");
    allreduce->add_option("--links", options.link_bytes,
                          "after the sweep, time each machine's link out alone with this many bytes (0: not)")
        ->capture_default_str();
  }

  int run() override {
    options.validate();  // before starting any process
    if (comm::started_as_rank()) return doctor::bench_allreduce_worker(options);
    return launch_self(nproc, argv);
  }
};

struct DoctorCommand : Command {
  doctor::DoctorOptions options;
  std::vector<std::string> program;

  explicit DoctorCommand(CLI::App& parent) {
    app = parent.add_subcommand(
        "doctor",
        "Measure a Trainer program with 1 and N workers and explain the difference (recommendations)");
    app->prefix_command();
    app->add_option("--nproc-per-node", options.nproc, "workers per machine in the N-worker run")
        ->check(CLI::Range(1, 256))
        ->capture_default_str();
    app->add_option("--nnodes", options.nnodes,
                    "machines: run the same doctor command on each, with its --node-rank (machine 0 reports)")
        ->capture_default_str();
    app->add_option("--node-rank", options.node_rank, "this machine's index, as for lockstep run")
        ->capture_default_str();
    app->add_option("--master-addr", options.master_addr, "machine 0's address, as for lockstep run")
        ->capture_default_str();
    app->add_option("--master-port", options.master_port, "a free port on machine 0, as for lockstep run");
    app->add_option("--steps", options.steps, "optimiser steps per run")->capture_default_str();
    app->add_option("--window", options.window, "steps per measured window (the first window is warm-up)")
        ->capture_default_str();
    app->add_option("--backend", options.backend, comm::backend_choices())->capture_default_str();
    app->add_option("--output-dir", options.output_dir,
                    "where the runs and doctor.json go (default: a new /tmp dir)");
    app->add_option("program", program,
                    "-- PROGRAM ARGS: a program that trains with lockstep::train::Trainer (default: the "
                    "Fashion-MNIST example's CNN)");
  }

  int run() override {
    if (comm::started_as_rank())
      throw ConfigError(
          "lockstep doctor starts its own runs: call it directly, not under lockstep run "
          "(lockstep doctor --nproc-per-node N -- PROGRAM ARGS)");
    options.program = program;
    for (const auto& a : app->remaining())
      if (a != "--") options.program.push_back(a);
    return doctor::run_doctor(options);
  }
};

struct ReportCommand : Command {
  std::string dir, output, doctor_json;

  explicit ReportCommand(CLI::App& parent) {
    app = parent.add_subcommand("report", "Write one self-contained HTML page for a Trainer run");
    app->add_option("run_dir", dir, "the run's --output-dir (holds metrics.jsonl)")->required();
    app->add_option("-o,--output", output, "the HTML file (default: RUN_DIR/report.html)");
    app->add_option("--doctor", doctor_json,
                    "a doctor.json to include (default: RUN_DIR/doctor.json if any)");
  }

  int run() override {
    std::printf("%s\n", doctor::write_report(dir, output, doctor_json).c_str());
    return 0;
  }
};

struct PlanCommand : Command {
  doctor::PlanModel model;
  doctor::PlanMachines machines;
  doctor::PlanStep step;
  std::string from_run, link = "1gbit", machine_link = "2GB/s";
  double memory_gb = 0;
  int top = 12;

  explicit PlanCommand(CLI::App& parent) {
    app = parent.add_subcommand("plan", "Rank the layouts of a GPT job (pipeline x data x tensor, ZeRO) before running it");
    app->add_option("--from-run", from_run, "a one-worker run of the model (its --output-dir): the measured step");
    app->add_option("--seconds-per-sequence", step.seconds_per_sequence, "or the step's seconds per sequence, given");
    app->add_option("--micro-batch", step.micro_batch, "sequences per micro-batch (default: the run's)");
    app->add_option("--micro-batches", step.micro_batches, "micro-batches per step and replica (default: the run's)");
    app->add_option("--nnodes", machines.nodes, "machines")->capture_default_str();
    app->add_option("--nproc-per-node", machines.nproc_per_node, "workers per machine")->capture_default_str();
    machines.cores = int(std::max(1u, std::thread::hardware_concurrency()));
    app->add_option("--cores", machines.cores, "cores per machine")->capture_default_str();
    app->add_option("--link", link, "the link between machines, each way (100mbit, 1gbit, 2GB/s)")->capture_default_str();
    app->add_option("--machine-link", machine_link,
                    "an all-reduce's bus bandwidth inside a machine (lockstep bench allreduce measures it)")
        ->capture_default_str();
    app->add_option("--memory-gb", memory_gb, "memory per machine (default: this machine's)");
    app->add_option("--n-layer", model.n_layer, "the GPT's blocks")->capture_default_str();
    app->add_option("--n-head", model.n_head, "attention heads per block")->capture_default_str();
    app->add_option("--n-embd", model.n_embd, "width")->capture_default_str();
    app->add_option("--block-size", model.block_size, "tokens of context")->capture_default_str();
    app->add_option("--vocab-size", model.vocab_size, "vocabulary")->capture_default_str();
    app->add_option("--top", top, "layouts shown")->capture_default_str();
  }

  int run() override {
    if (!from_run.empty()) {
      const doctor::PlanStep measured = doctor::step_of_run(from_run);
      if (!app->count("--micro-batch")) step.micro_batch = measured.micro_batch;
      if (!app->count("--micro-batches")) step.micro_batches = measured.micro_batches;
      step.seconds_per_sequence = measured.seconds_per_sequence;
      step.activation_bytes_per_sequence = measured.activation_bytes_per_sequence;
    }
    machines.link_bytes_per_second = doctor::parse_rate(link);
    machines.machine_bytes_per_second = doctor::parse_rate(machine_link);
    machines.memory_bytes = memory_gb > 0 ? memory_gb * 1e9
                                          : double(::sysconf(_SC_PHYS_PAGES)) * double(::sysconf(_SC_PAGESIZE));
    std::printf("%s", doctor::describe_plan(doctor::plan_layouts(model, machines, step), machines, top).c_str());
    return 0;
  }
};

struct EnvCommand : Command {
  bool markdown = false;

  explicit EnvCommand(CLI::App& parent) {
    app = parent.add_subcommand("env", "List every environment variable lockstep reads, with its value here");
    app->add_flag("--markdown", markdown, "print the tables of docs/environment.md instead");
  }

  int run() override {
    if (markdown) {
      std::printf("%s", knobs::markdown().c_str());
      return 0;
    }
    for (const knobs::Knob* k : knobs::kAll) {
      const bool set = knobs::is_set(*k);
      const auto value = knobs::get(*k);
      std::printf("%-28s %s%s\n", k->name, value ? value->c_str() : "(unset)",
                  set     ? ""
                  : value ? "  (default)"
                          : "");
    }
    return 0;
  }
};

// The torch-linked half lives in lockstep-checkpoint beside this binary, so that lockstep itself
// stays torch-free; this only hands the arguments over.
struct CheckpointCommand : Command {
  std::vector<std::string> raw;

  CheckpointCommand(CLI::App& parent, std::vector<std::string> argv) : raw(std::move(argv)) {
    app = parent.add_subcommand("checkpoint", "Sharded checkpoints: consolidate DIR (one model.pt), info DIR");
    app->prefix_command();
    app->allow_extras();
  }
  int run() override {
    std::error_code ec;
    const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
    const std::string tool = (self.parent_path() / "lockstep-checkpoint").string();
    if (ec || !std::filesystem::exists(tool))
      throw ConfigError("lockstep checkpoint needs lockstep-checkpoint beside lockstep (" + tool +
                        "): it is built with the train layer; build or install the whole project");
    std::vector<char*> argv{const_cast<char*>(tool.c_str())};
    for (std::size_t i = 2; i < raw.size(); ++i) argv.push_back(const_cast<char*>(raw[i].c_str()));
    argv.push_back(nullptr);
    ::execv(tool.c_str(), argv.data());
    throw SystemError("cannot run " + tool + ": " + std::strerror(errno));
  }
};

struct MetricsFormatCommand : Command {
  explicit MetricsFormatCommand(CLI::App& parent) {
    app = parent.add_subcommand("metrics-format",
                                "Print the keys of metrics.jsonl (the tables of docs/metrics.md)");
  }
  int run() override {
    std::printf("%s", train::metrics::markdown().c_str());
    return 0;
  }
};

// torchrun accepts `--tee 3` and `--redirects 3`; lockstep also accepts a bare `--tee` (meaning
// 3) and underscores in option names. Normalising stops mattering at the program: the parser
// stops there (prefix_command), and the program's own flags are passed on as they are.
std::vector<std::string> normalise_run_args(const std::vector<std::string>& args) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string a = args[i];
    if (a.rfind("--", 0) != 0) {
      out.push_back(a);
      continue;
    }
    const auto eq = a.find('=');
    std::string name = a.substr(0, eq);
    for (auto& ch : name)
      if (ch == '_') ch = '-';
    out.push_back(name + (eq == std::string::npos ? "" : a.substr(eq)));
    const bool digit_follows =
        i + 1 < args.size() && args[i + 1].size() == 1 && args[i + 1][0] >= '0' && args[i + 1][0] <= '3';
    if ((out.back() == "--tee" || out.back() == "--redirects") && !digit_follows) out.push_back("3");
  }
  return out;
}

int lockstep_main(int argc, char** argv) {
  const std::vector<std::string> raw(argv, argv + argc);
  CLI::App app{"lockstep: distributed data-parallel training for libtorch"};
  app.require_subcommand(1);
  std::vector<std::unique_ptr<Command>> commands;
  commands.push_back(std::make_unique<RunCommand>(app));
  commands.push_back(std::make_unique<StoreCommand>(app));
  commands.push_back(std::make_unique<DemoCommand>(app, raw));
  commands.push_back(std::make_unique<BenchCommand>(app, raw));
  commands.push_back(std::make_unique<DoctorCommand>(app));
  commands.push_back(std::make_unique<ReportCommand>(app));
  commands.push_back(std::make_unique<PlanCommand>(app));
  commands.push_back(std::make_unique<EnvCommand>(app));
  commands.push_back(std::make_unique<MetricsFormatCommand>(app));
  commands.push_back(std::make_unique<CheckpointCommand>(app, raw));

  std::vector<std::string> args = raw.size() > 1 && raw[1] == "run" ? normalise_run_args(raw) : raw;
  std::vector<std::string> reversed(args.rbegin(), args.rend() - 1);  // CLI11 parses a reversed vector
  try {
    app.parse(reversed);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help (of the command asked about)
    throw ConfigError(std::string(e.what()) +
                      "; `lockstep --help` lists the commands, `lockstep COMMAND --help` "
                      "their options");
  }
  for (auto& c : commands)
    if (c->app->parsed()) return c->run();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return lockstep::run_main(argc, argv, [&] { return lockstep_main(argc, argv); });
}
