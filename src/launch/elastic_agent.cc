// lockstep run for an elastic job (--nnodes MIN:MAX). The agent does not decide membership: its
// workers do, through the store (lockstep/comm/elastic.h). It starts them, relays their output,
// and keeps one worker in each local slot: when a worker dies (a crash, a SIGKILL, an OOM kill) the
// others go on without it, and while --max-restarts allows it starts a new worker in that slot,
// which joins the job at a step boundary with the state of the others. A worker that exits 0 is
// done; exit 2 or 3 (bad input, no storage) stops the machine's workers, since a new worker
// would meet the same input. The agent ends when every slot is done or given up.
#include <algorithm>

#include "agent.h"
#include "lockstep/base/log.h"
#include "lockstep/base/main.h"
#include "lockstep/comm/shm_segments.h"
#include "lockstep/error.h"

namespace lockstep::launch {
namespace {

using comm::Seconds;

std::pair<std::string, int> host_and_port(const std::string& endpoint) {
  const auto colon = endpoint.rfind(':');
  int port = 0;
  try {
    port = colon == std::string::npos ? 0 : std::stoi(endpoint.substr(colon + 1));
  } catch (const std::exception&) {
  }
  if (colon == std::string::npos || colon == 0 || port < 1 || port > 65535)
    throw ConfigError("--rdzv-endpoint '" + endpoint + "' is not HOST:PORT");
  std::string host = endpoint.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return {host, port};
}

std::string describe_exit(const WorkerExit& e) {
  return e.signal ? "was killed by " + signal_name(e.signal) : "exited with code " + std::to_string(e.code);
}

}  // namespace

// Reaches the store (node 0 hosts it unless --rdzv-endpoint names one), and takes a machine number
// in the job: agents count themselves in, so a machine that joins later gets the next one.
void Agent::join_elastic() {
  const LaunchOptions& o = options_;
  placement_.run_id = o.run_id.empty() ? "default" : o.run_id;
  placement_.token = choose_token(o, placement_.run_id);
  std::string host = o.master_addr;
  int port = o.master_port;
  if (!o.rdzv_endpoint.empty()) {
    std::tie(host, port) = host_and_port(o.rdzv_endpoint);
  } else if (o.node_rank == 0) {
    server_ = std::make_unique<comm::StoreServer>(comm::StoreServerOptions{"*", o.master_port, placement_.token});
    port = server_->port();
  }
  placement_.store_address = host + ":" + std::to_string(port);
  store_ = std::make_unique<comm::StoreClient>(
      comm::StoreClientOptions{server_ ? "127.0.0.1" : host, port, placement_.token, Seconds(o.join_timeout)});
  node_ = static_cast<int>(store_->add(key("elastic/machines"), 1)) - 1;
  store_->set_ephemeral(key("alive/" + std::to_string(node_)), "1");
  store_->set_timeout(Seconds(std::max(3.0, 20 * o.monitor_interval)));
  LOCKSTEP_LOG(info, run) << "elastic job '" << placement_.run_id << "': this is machine " << node_ << " ("
                          << host_name() << "), " << o.min_nodes << ".." << o.nnodes << " machines, store at "
                          << placement_.store_address;
}

// Starts the worker of local slot `local`, the `incarnation`-th there.
std::size_t Agent::start_elastic_worker(WorkerGroup& group, int local, int incarnation) {
  group.start({elastic_worker_spec(options_, placement_, node_, local, incarnation, knobs::environment())});
  return group.workers().size() - 1;
}

// Stops every worker (TERM, then KILL after the grace period) and waits for them.
void Agent::stop_all(WorkerGroup& group) {
  group.terminate_all();
  const auto kill_at = Clock::now() + std::chrono::duration_cast<Clock::duration>(Seconds(options_.grace_period));
  while (!group.all_exited()) {
    group.poll_once(std::chrono::milliseconds(20), -1);
    if (Clock::now() >= kill_at) group.kill_all();
  }
}

// Each local slot's worker of the moment, and how the slots have fared.
struct ElasticSlots {
  std::vector<std::size_t> worker;  // index into the group's workers
  std::vector<int> incarnation;
  std::vector<bool> ended;
  int restarts = 0, done = 0, failed_code = 0;
  bool running() const { return std::count(ended.begin(), ended.end(), false) > 0; }
};

std::optional<int> Agent::elastic_interrupted(WorkerGroup& group, Clock::time_point deadline) {
  const auto tick = std::chrono::milliseconds(std::max(1, static_cast<int>(options_.monitor_interval * 1000)));
  if (group.poll_once(tick, signals_.fd())) {
    const auto sigs = signals_.drain();
    if (!sigs.empty()) {
      LOCKSTEP_LOG(info, run) << "got " << signal_name(sigs.front()) << ": stopping the workers";
      stop_all(group);
      return kExitSignalBase + sigs.front();
    }
  }
  if (Clock::now() < deadline) return std::nullopt;
  LOCKSTEP_LOG(error, run) << "the job exceeded --timeout " << options_.timeout << " s: stopping the workers";
  stop_all(group);
  return kExitTimeout;
}

std::optional<int> Agent::on_elastic_exit(WorkerGroup& group, ElasticSlots& slots, std::size_t l) {
  const Worker& w = group.workers()[slots.worker[l]];
  // What it created in shared memory and did not unlink (it was killed): the others mapped what
  // they use, so the names can go now; a job that runs on must not leave them behind.
  comm::remove_shm_segments_of({w.pid});
  const std::string who = "worker " + w.spec.label + " (pid " + std::to_string(w.pid) + ")";
  if (w.exit->code == 0) {
    slots.ended[l] = true;
    ++slots.done;
    return std::nullopt;
  }
  if (!restart_can_help(w.exit->code)) {
    LOCKSTEP_LOG(error, run) << who << " " << describe_exit(*w.exit)
                             << ": bad input or no storage, which a new worker would meet too; stopping";
    const int code = w.exit->code;
    stop_all(group);
    return code;
  }
  slots.failed_code = w.exit->code;
  if (slots.restarts < options_.max_restarts) {
    ++slots.restarts;
    LOCKSTEP_LOG(warn, run) << who << " " << describe_exit(*w.exit)
                            << "; the others go on without it, and a new worker takes its place (restart "
                            << slots.restarts << " of " << options_.max_restarts << ")";
    slots.worker[l] = start_elastic_worker(group, static_cast<int>(l), ++slots.incarnation[l]);
  } else {
    LOCKSTEP_LOG(warn, run) << who << " " << describe_exit(*w.exit)
                            << "; the others go on without it (no restarts left: --max-restarts "
                            << options_.max_restarts << ")";
    slots.ended[l] = true;
  }
  return std::nullopt;
}

int Agent::run_elastic() {
  join_elastic();
  WorkerGroup group(program_path_, options_.program, output_policy());
  const auto locals = static_cast<std::size_t>(options_.nproc_per_node);
  ElasticSlots slots{std::vector<std::size_t>(locals), std::vector<int>(locals, 0), std::vector<bool>(locals, false)};
  for (std::size_t l = 0; l < locals; ++l) slots.worker[l] = start_elastic_worker(group, static_cast<int>(l), 0);
  const auto deadline = options_.timeout > 0
                            ? Clock::now() + std::chrono::duration_cast<Clock::duration>(Seconds(options_.timeout))
                            : Clock::time_point::max();
  while (slots.running()) {
    if (const auto code = elastic_interrupted(group, deadline)) return *code;
    for (std::size_t l = 0; l < locals; ++l) {
      if (slots.ended[l] || !group.workers()[slots.worker[l]].exit) continue;
      if (const auto code = on_elastic_exit(group, slots, l)) return *code;
    }
  }
  return slots.done > 0 ? kExitOk : slots.failed_code;
}

}  // namespace lockstep::launch
