// lockstep run: one agent per machine starts, watches and stops the job's workers.
//
// Agent 0 hosts the job's store; every agent joins it with the run's token, registers its
// node, and learns the ranks it owns (nodes in node-rank order, each owning nproc_per_node
// consecutive ranks). Each attempt, every agent starts its workers with the torchrun
// environment plus lockstep's, relays their output with a rank prefix, and watches: its own
// workers (exit codes, signals), the store (another node's failure), the other agents (their
// ephemeral keys vanish when they die), the job deadline, and signals sent to the agent.
// The first failure anywhere stops every worker everywhere (SIGTERM, then SIGKILL after the
// grace period) and is reported by every agent: rank, host, exit code or signal, when, and
// the last lines of its stderr. While restarts remain, the whole group starts again with
// LOCKSTEP_RESTART_COUNT raised. The exit code is the failed worker's (128 + signal).
//
// Elastic jobs (min_nodes > 0, from --nnodes MIN:MAX): every agent starts its workers at once;
// they meet in an elastic membership on the store (lockstep/comm/elastic.h) that forms once MIN
// machines joined. A worker that dies does not stop the others: the survivors go on without it
// in the same processes, and its agent starts a new worker in its place (while --max-restarts
// allows, counted per machine), which joins at a step boundary; an agent started later joins the
// same way. Each agent ends when its workers have ended. The store lives on node 0 (--node-rank
// 0 at --master-port), or, so that losing any training machine is survivable, in a process of
// its own (`lockstep store`) that every agent reaches through --rdzv-endpoint.
//
// Threading: run_job runs on the calling thread (an event loop over pipes, a signalfd and the
// store); the store server, on agent 0, runs its own thread. run_job blocks SIGINT, SIGTERM and
// SIGCHLD in the calling thread before it starts any thread; call it from the main thread.
#pragma once

#include <string>
#include <vector>

namespace lockstep::launch {

struct LaunchOptions {
  int nproc_per_node = 1;  // resolved: "auto" is the visible GPUs, else the CPU cores (base/gpus.h)
  int nnodes = 1;
  int node_rank = 0;
  int min_nodes = 0;          // > 0: an elastic job of min_nodes..nnodes machines (--nnodes MIN:MAX)
  std::string rdzv_endpoint;  // host:port of a store of its own (lockstep store); empty: node 0's
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // agent 0's store; 0 on one machine: a free port
  int max_restarts = 0;
  double monitor_interval = 0.1;     // seconds between checks of the store and other agents
  std::string log_dir;               // per-rank files under DIR/<run-id>/attempt_<k>/
  int tee = 0;                       // bit 1: stdout, bit 2: stderr to files and console
  int redirects = 0;                 // bit 1: stdout, bit 2: stderr to files only
  std::string run_id;                // empty: random on one machine, "default" on several
  double grace_period = 5;           // seconds between SIGTERM and SIGKILL
  double timeout = 0;                // seconds for the whole job; 0: none
  double join_timeout = 60;          // seconds to reach the store and see every agent
  std::string backend;               // exported as LOCKSTEP_BACKEND when set
  std::string torch_backend;         // exported as LOCKSTEP_TORCH_BACKEND when set (Python workers)
  std::string token;                 // empty: LOCKSTEP_TOKEN, else a fresh one (one machine)
  std::vector<std::string> program;  // PROGRAM ARGS...
};

inline bool elastic(const LaunchOptions& o) {
  return o.min_nodes > 0;
}

// Checks the options (throws ConfigError naming the option and the fix).
void validate(const LaunchOptions& options);

// Runs the job to the end and returns the exit code for the launcher: 0, the failed worker's
// code (128 + signal when killed), 124 when --timeout passed, 128 + signal when interrupted.
// Configuration errors are thrown as ConfigError before any worker starts.
int run_job(const LaunchOptions& options);

// `lockstep store`: a store server at host:port with LOCKSTEP_TOKEN as its secret, until SIGINT
// or SIGTERM (exit 0). Prints "lockstep store: serving on HOST:PORT" once it listens.
// ConfigError when LOCKSTEP_TOKEN is unset (a store anyone could use is not served).
int serve_store(const std::string& host, int port);

}  // namespace lockstep::launch
