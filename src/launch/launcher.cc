// lockstep run: the options, and the job on this node from join to leave.
#include "lockstep/launch/launcher.h"

#include <algorithm>
#include <cctype>
#include <cstdio>

#include "agent.h"

#include "lockstep/base/knobs.h"
#include "lockstep/base/log.h"
#include "lockstep/base/main.h"
#include "lockstep/comm/backends.h"
#include "lockstep/error.h"
#include "worker_env.h"

namespace lockstep::launch {

Agent::Agent(const LaunchOptions& options, std::string program_path)
    : options_(options), program_path_(std::move(program_path)) {}

int Agent::run() {
  if (elastic(options_)) {
    const int code = run_elastic();
    leave();
    return code;
  }
  join();
  int code = 0;
  for (placement_.attempt = 0; placement_.attempt <= options_.max_restarts; ++placement_.attempt) {
    code = run_attempt();
    if (code == 0 || interrupted_ || timed_out_ || placement_.attempt == options_.max_restarts) break;
    if (no_restart_) {
      LOCKSTEP_LOG(info, run)
          << "not restarting: exit code " << code
          << " means the input or the disk is at fault (2: bad input, 3: no storage), and a "
             "restart cannot fix that";
      break;
    }
    LOCKSTEP_LOG(info, run) << "restarting the whole group (" << placement_.attempt + 1 << " of "
                            << options_.max_restarts
                            << " restarts): LOCKSTEP_RESTART_COUNT=" << placement_.attempt + 1;
  }
  leave();
  return code;
}

namespace {

// torch.distributed's names: a backend ("lockstep") or a device map ("cpu:gloo,cuda:nccl").
bool torch_backend_name(const std::string& name) {
  return std::all_of(name.begin(), name.end(), [](unsigned char c) {
    return std::islower(c) || std::isdigit(c) || c == '_' || c == ':' || c == ',';
  });
}

}  // namespace

void validate(const LaunchOptions& o) {
  if (o.program.empty()) throw ConfigError("no PROGRAM given: lockstep run [options] PROGRAM [ARGS...]");
  if (o.nproc_per_node < 1)
    throw ConfigError("--nproc-per-node must be at least 1 (got " + std::to_string(o.nproc_per_node) + ")");
  if (o.nnodes < 1) throw ConfigError("--nnodes must be at least 1 (got " + std::to_string(o.nnodes) + ")");
  if (elastic(o) && o.min_nodes > o.nnodes)
    throw ConfigError("--nnodes " + std::to_string(o.min_nodes) + ":" + std::to_string(o.nnodes) +
                      ": MIN must not be above MAX");
  if (elastic(o) && o.rdzv_endpoint.empty() && o.nnodes > 1 && o.master_port == 0)
    throw ConfigError("--nnodes " + std::to_string(o.min_nodes) + ":" + std::to_string(o.nnodes) +
                      " needs --master-port (node 0's store) or --rdzv-endpoint HOST:PORT (a `lockstep store`)");
  if (o.node_rank < 0 || o.node_rank >= o.nnodes)
    throw ConfigError("--node-rank " + std::to_string(o.node_rank) + " is not below --nnodes " +
                      std::to_string(o.nnodes) + ": use 0.." + std::to_string(o.nnodes - 1));
  if (o.master_port < 0 || o.master_port > 65535)
    throw ConfigError("--master-port " + std::to_string(o.master_port) + " is not a TCP port (0..65535)");
  if (!elastic(o) && o.nnodes > 1 && o.master_port == 0)
    throw ConfigError("--nnodes " + std::to_string(o.nnodes) +
                      " needs --master-port (the port of node 0's store, the same on every node)");
  if (o.max_restarts < 0) throw ConfigError("--max-restarts must be >= 0");
  if (!(o.monitor_interval > 0)) throw ConfigError("--monitor-interval must be > 0 seconds");
  if (o.grace_period < 0) throw ConfigError("--grace-period must be >= 0 seconds");
  if (o.timeout < 0) throw ConfigError("--timeout must be >= 0 seconds (0: none)");
  if (o.tee < 0 || o.tee > 3 || o.redirects < 0 || o.redirects > 3)
    throw ConfigError("--tee and --redirects take 0 (none), 1 (stdout), 2 (stderr) or 3 (both)");
  if (!o.backend.empty() && !comm::is_backend_name(o.backend))
    throw ConfigError("--backend '" + o.backend + "' is unknown: use " + comm::backend_choices(", "));
  if (!o.torch_backend.empty() && !torch_backend_name(o.torch_backend))
    throw ConfigError("--torch-backend '" + o.torch_backend +
                      "' is not a torch.distributed backend's name: use one such as lockstep, or a device "
                      "map such as cpu:lockstep,cuda:nccl");
  if (!resolve_program(o.program[0]))
    throw ConfigError("program '" + o.program[0] + "' not found" +
                      (o.program[0].find('/') == std::string::npos ? " on PATH" : " (or not executable)") +
                      ": check the name, or give a path");
}

int serve_store(const std::string& host, int port) {
  const std::string token = knobs::get(knobs::kToken).value_or("");
  if (token.empty())
    throw ConfigError("LOCKSTEP_TOKEN is not set: give the store the job's secret (the same LOCKSTEP_TOKEN on "
                      "every machine)");
  SignalWatch signals;  // before the server's thread starts: it inherits the blocked signals
  comm::StoreServer server(comm::StoreServerOptions{host, port, token});
  std::printf("lockstep store: serving on %s:%d\n", host.c_str(), server.port());
  std::fflush(stdout);
  for (;;) {
    const auto got = signals.wait(std::chrono::milliseconds(1000));
    if (!got.empty()) {
      LOCKSTEP_LOG(info, run) << "store: got " << signal_name(got.front()) << ", stopping";
      return kExitOk;
    }
  }
}

int run_job(const LaunchOptions& options) {
  validate(options);
  choose_blas_kernels();
  Agent agent(options, *resolve_program(options.program[0]));
  return agent.run();
}

}  // namespace lockstep::launch
