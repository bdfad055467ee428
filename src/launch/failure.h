// What ended an attempt of a job, as the agents agree on it: the first failure anywhere is
// published on the store (compare-and-set, so one wins) and every agent reports that one.
#pragma once

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "worker_group.h"

namespace lockstep::launch {

struct Failure {
  // exit: a worker failed; timeout: --timeout passed; interrupted: an agent got a signal;
  // store-lost: node 0's agent (the store) stopped answering; agent-lost: another agent died.
  std::string reason = "exit";
  std::string detail;  // timeout: the limit; interrupted: the signal; *-lost: what went
  int rank = -1, local_rank = -1, node = 0, pid = 0;
  int code = 1;            // the exit code the launchers end with
  int signal = 0;          // the worker's terminating signal, 0 when it exited
  std::string host, time;  // where, and the wall-clock time (HH:MM:SS)
  double elapsed = 0;      // seconds into the attempt
  std::string out_of_memory;  // killed by the kernel's OOM killer: the limit it hit (else empty)
  std::vector<std::string> stderr_tail;

  nlohmann::json to_json() const;
  static Failure from_json(const nlohmann::json& j);
  // "rank 1 (local rank 1, node 0, host vm, pid 21740) was killed by SIGKILL", or the event.
  std::string describe() const;
};

std::string host_name();
std::string wall_clock();  // HH:MM:SS, local time

// A worker's failure, as this node saw it; oom_kills_at_start: the kernel's count when the
// attempt began (oom.h), to tell an OOM kill from another SIGKILL.
Failure worker_failure(const Worker& w, int node, Clock::time_point attempt_start, std::int64_t oom_kills_at_start);
// An event that ends the attempt (timeout, interrupted, store-lost, agent-lost).
Failure event_failure(const std::string& reason, const std::string& detail, int code, int node,
                      Clock::time_point attempt_start);

// The report every agent prints: the first failure, its stderr, this node's workers, and, when
// the workers published flight records, what each rank was doing with its collectives.
std::string failure_report(const Failure& f, const std::vector<Worker>& workers, int attempt,
                           int max_restarts, const std::string& run_id, std::int64_t oom_kills_at_start = -1,
                           const std::vector<std::string>& collectives = {});

}  // namespace lockstep::launch
