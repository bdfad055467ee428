// The workers of one agent for one attempt: started, their output relayed, their exits reaped,
// stopped on demand. Single-threaded: the agent's event loop calls poll_once() repeatedly.
//
// Each worker is its own process group (so a stop reaches the helpers it forks too), gets
// SIGTERM if the agent dies (PR_SET_PDEATHSIG), and writes stdout and stderr into pipes that
// poll_once() reads: every line goes to the console with a "[rank N] " prefix and/or to
// per-rank files, and the last lines of stderr are kept for the failure report.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/base/clock.h"

namespace lockstep::launch {


struct WorkerSpec {
  int rank = 0;  // names its log files (rank_N.stdout)
  int local_rank = 0;
  std::string label;  // the prefix of its console lines; empty: "rank N"
  std::vector<std::string> env;  // "NAME=value", the whole environment
};

struct OutputPolicy {
  bool console_stdout = true, console_stderr = true;
  std::string stdout_file_dir;  // empty: no file; else DIR/rank_N.stdout
  std::string stderr_file_dir;
  std::size_t tail_lines = 20;
};

struct WorkerExit {
  int code = 0;    // exit status, or 128 + signal
  int signal = 0;  // the terminating signal, 0 when it exited
  bool stopped_by_us = false;
  Clock::time_point when;
};

struct Worker {
  WorkerSpec spec;
  pid_t pid = -1;
  int out_fd = -1, err_fd = -1;
  std::string out_partial, err_partial;
  std::deque<std::string> err_tail;
  int out_file = -1, err_file = -1;
  bool stop_requested = false;
  std::optional<WorkerExit> exit;
};

class WorkerGroup {
 public:
  WorkerGroup(std::string program_path, std::vector<std::string> argv, OutputPolicy output);
  ~WorkerGroup();  // kills what still runs (no orphans), closes pipes and files

  // Starts every worker; throws lockstep::SystemError when a fork fails (the started ones are
  // killed by the destructor).
  void start(const std::vector<WorkerSpec>& specs);

  // Waits up to `timeout` for output, exits, or a signal on `signal_fd` (-1: none); relays
  // output and reaps exits. Returns true if `signal_fd` became readable.
  bool poll_once(std::chrono::milliseconds timeout, int signal_fd);

  // SIGTERM to every live worker's process group; marks them stopped_by_us.
  void terminate_all();
  // SIGKILL to every live worker's process group.
  void kill_all();

  bool all_exited() const;
  // The worker whose failure to report (not one stopped by us): a death by signal before any
  // error exit, else the earliest.
  const Worker* first_failure() const;
  const std::vector<Worker>& workers() const { return workers_; }

 private:
  void relay(Worker& w, bool is_stderr, const char* data, std::size_t n);
  void drain(Worker& w);
  void reap();
  void emit_line(Worker& w, bool is_stderr, const std::string& line);

  std::string program_path_;
  std::vector<std::string> argv_;
  OutputPolicy output_;
  std::vector<Worker> workers_;
};

// The absolute path of `program` (searched on PATH when it has no '/'), or nullopt.
std::optional<std::string> resolve_program(const std::string& program);
std::string signal_name(int sig);

}  // namespace lockstep::launch
