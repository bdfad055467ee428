// The agent: what one `lockstep run` does on its machine.
//   launcher.cc          the job: join, attempts and restarts, leave
//   agent_rendezvous.cc  agents meet on node 0's store, agree on ranks, watch each other
//   attempt.cc           one attempt: start the workers, watch everything, stop, report
// Threading: all on the calling thread (an event loop over the workers' pipes, a signalfd
// and periodic store checks); node 0's store server runs its own thread.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "failure.h"
#include "lockstep/base/clock.h"
#include "lockstep/comm/store.h"
#include "lockstep/launch/launcher.h"
#include "worker_env.h"

namespace lockstep::launch {

// SIGINT, SIGTERM, SIGHUP and SIGCHLD, blocked and read from a signalfd. Construct before any
// thread starts: threads inherit the mask.
class SignalWatch {
 public:
  SignalWatch();
  ~SignalWatch();
  SignalWatch(const SignalWatch&) = delete;
  SignalWatch& operator=(const SignalWatch&) = delete;
  int fd() const { return fd_; }
  // The termination signals that arrived since the last call (SIGCHLD is left to the reaper).
  std::vector<int> drain();
  // Waits up to `timeout` for a signal; returns what drain() would.
  std::vector<int> wait(std::chrono::milliseconds timeout);

 private:
  int fd_ = -1;
};

// The run's secret: --token, LOCKSTEP_TOKEN, a fresh one on one machine, or (with a warning)
// one derived from the run id across machines.
std::string choose_token(const LaunchOptions& o, const std::string& run_id);

class Agent {
 public:
  Agent(const LaunchOptions& options, std::string program_path);
  // The whole job on this node; returns the launcher's exit code.
  int run();

 private:
  // agent_rendezvous.cc
  void join();
  void announce_and_wait(comm::Seconds timeout);
  void leave();
  std::string key(const std::string& k) const;
  std::string attempt_key(const std::string& k) const;
  int agree_on_master_port();
  // Publishes a failure unless another came first; returns the one that counts.
  Failure publish_failure(const Failure& mine);
  std::optional<Failure> published_failure();
  std::optional<std::string> lost_agent();  // a node whose launcher died mid-attempt
  void mark_done();
  bool all_nodes_done();
  // After a failure: every node confirms its workers stopped before any starts the next attempt.
  bool wait_for_every_node_to_stop();
  // After losing node 0's store (a partition, a restart of the network): reconnects and
  // announces this node again, within --join-timeout. False when node 0 stays unreachable.
  bool rejoin();
  // What each rank was doing with its collectives, from the flight records the workers'
  // communicators published (nothing when none did, or the store is gone).
  std::vector<std::string> collectives_at_failure();

  // elastic_agent.cc: --nnodes MIN:MAX
  int run_elastic();
  void join_elastic();
  std::size_t start_elastic_worker(WorkerGroup& group, int local, int incarnation);
  void stop_all(WorkerGroup& group);
  // The exit code when a signal came or --timeout passed (the workers stopped), else nothing.
  std::optional<int> elastic_interrupted(WorkerGroup& group, Clock::time_point deadline);
  // A worker of local slot `l` exited: restart it, or let the others go on, or (bad input) stop
  // the job with its exit code.
  std::optional<int> on_elastic_exit(WorkerGroup& group, struct ElasticSlots& slots, std::size_t l);

  // attempt.cc
  int run_attempt();
  OutputPolicy output_policy();
  void watch_once(struct Attempt& a);
  void on_signals(struct Attempt& a, const std::vector<int>& signals);
  void check_other_nodes(struct Attempt& a);
  Failure root_cause(const Failure& local, const struct Attempt& a);
  void fail(struct Attempt& a, const Failure& f);
  int conclude(struct Attempt& a);

  const LaunchOptions& options_;
  std::string program_path_;
  SignalWatch signals_;
  JobPlacement placement_;
  std::vector<std::string> hosts_;  // by node rank
  std::unique_ptr<comm::StoreServer> server_;
  std::unique_ptr<comm::StoreClient> store_;
  bool interrupted_ = false, timed_out_ = false, store_lost_ = false;
  bool no_restart_ = false;  // the failure's exit code says a restart cannot help
  int node_ = 0;             // an elastic agent's machine number, in the order agents joined
};

}  // namespace lockstep::launch
