// One attempt of the job on this node: start the workers, then watch, in one loop, the
// workers (exits, signals), this launcher's signals, the job deadline, and every
// monitor_interval the store (another node's failure) and the other agents (alive keys). The
// first failure anywhere stops every worker everywhere: SIGTERM, then SIGKILL after the grace
// period. Then every agent reports the failure that won, and agrees that all workers stopped
// before anyone restarts.
#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "agent.h"
#include "lockstep/base/log.h"
#include "lockstep/base/main.h"
#include "lockstep/comm/shm_segments.h"
#include "lockstep/error.h"
#include "oom.h"

namespace lockstep::launch {

// Let simultaneous exits land before naming the first failure: a killed rank's peers notice
// its death, through shared memory, even before the kernel reports it to us.
constexpr auto kSettle = std::chrono::milliseconds(250);

struct Attempt {
  Attempt(const std::string& program, const std::vector<std::string>& argv, OutputPolicy output)
      : group(program, argv, std::move(output)) {}
  WorkerGroup group;
  Clock::time_point start = Clock::now();
  std::int64_t oom_kills_at_start = oom_kills();  // to tell the kernel's OOM kills from other SIGKILLs
  Clock::time_point deadline = Clock::time_point::max();  // --timeout
  Clock::time_point next_check = Clock::now();
  std::chrono::milliseconds tick{100};
  std::optional<Failure> failure;
  std::optional<Clock::time_point> kill_at;       // SIGKILL what still runs after the grace period
  std::optional<Clock::time_point> settle_until;  // a local failure waits this long for others
  bool done_published = false;                    // every local worker exited 0
  bool finished = false;                          // the loop ends
};

namespace {

void make_dirs(const std::string& path) {
  std::string partial;
  for (std::size_t i = 0; i <= path.size(); ++i) {
    if (i == path.size() || path[i] == '/') {
      if (!partial.empty() && ::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST)
        throw ConfigError("cannot create log directory " + partial + ": " + std::strerror(errno));
    }
    if (i < path.size()) partial += path[i];
  }
}

// Removes what shared memory these workers created and did not unlink (a crash in between).
void remove_worker_segments(const std::vector<Worker>& workers) {
  std::vector<int> pids;
  for (const auto& w : workers) pids.push_back(w.pid);
  comm::remove_shm_segments_of(pids);
}

}  // namespace

SignalWatch::SignalWatch() {
  sigset_t set;
  sigemptyset(&set);
  for (int s : {SIGINT, SIGTERM, SIGCHLD, SIGHUP}) sigaddset(&set, s);
  ::pthread_sigmask(SIG_BLOCK, &set, nullptr);  // before any thread starts: they inherit it
  fd_ = ::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
}

SignalWatch::~SignalWatch() {
  if (fd_ >= 0) ::close(fd_);
}

std::vector<int> SignalWatch::drain() {
  std::vector<int> got;
  signalfd_siginfo info{};
  while (::read(fd_, &info, sizeof info) == sizeof info)
    if (static_cast<int>(info.ssi_signo) != SIGCHLD) got.push_back(static_cast<int>(info.ssi_signo));
  return got;
}

std::vector<int> SignalWatch::wait(std::chrono::milliseconds timeout) {
  pollfd p{fd_, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(timeout.count())) > 0) return drain();
  return {};
}

OutputPolicy Agent::output_policy() {
  OutputPolicy p;
  const int files = options_.tee | options_.redirects;
  p.console_stdout = !(options_.redirects & 1) || (options_.tee & 1);
  p.console_stderr = !(options_.redirects & 2) || (options_.tee & 2);
  if (files == 0) return p;
  const std::string base = options_.log_dir.empty() ? "/tmp/lockstep-logs" : options_.log_dir;
  const std::string dir = base + "/" + placement_.run_id + "/attempt_" + std::to_string(placement_.attempt);
  make_dirs(dir);
  if (files & 1) p.stdout_file_dir = dir;
  if (files & 2) p.stderr_file_dir = dir;
  if (placement_.attempt == 0 && options_.node_rank == 0)
    LOCKSTEP_LOG(info, run) << "worker logs in " << base << "/" << placement_.run_id;
  return p;
}

// The first failure this node learns of stops its workers; later ones change nothing.
void Agent::fail(Attempt& a, const Failure& f) {
  if (!a.failure) a.failure = f;
  if (a.kill_at) return;
  a.group.terminate_all();
  a.kill_at =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(comm::Seconds(options_.grace_period));
}

void Agent::on_signals(Attempt& a, const std::vector<int>& signals) {
  for (int sig : signals) {
    if (interrupted_) continue;
    interrupted_ = true;
    LOCKSTEP_LOG(info, run) << "got " << signal_name(sig) << ": stopping the workers (grace period "
                            << static_cast<int>(options_.grace_period) << " s)";
    if (!a.failure)
      fail(a, publish_failure(event_failure("interrupted", signal_name(sig), kExitSignalBase + sig,
                                            options_.node_rank, a.start)));
  }
}

// What to report for a worker that failed here: a failure another node published first, or a
// node whose launcher is gone (this worker's error is then most likely its consequence: its
// peers there vanished), or else the worker's own failure, published.
Failure Agent::root_cause(const Failure& local, const Attempt& a) {
  try {
    if (auto f = published_failure()) return *f;
    if (auto lost = lost_agent())
      return publish_failure(event_failure("agent-lost", *lost, kExitFailure, options_.node_rank, a.start));
  } catch (const Error&) {
    // The store is gone: this node's own failure is all it knows.
  }
  return publish_failure(local);
}

// Another node's failure, or a lost node; and whether every node is done.
void Agent::check_other_nodes(Attempt& a) {
  try {
    if (!a.failure) {
      if (auto f = published_failure())
        fail(a, *f);
      else if (auto lost = lost_agent())
        fail(a,
             publish_failure(event_failure("agent-lost", *lost, kExitFailure, options_.node_rank, a.start)));
    }
    if (!a.failure && a.done_published && all_nodes_done()) a.finished = true;
  } catch (const Error& e) {
    if (!a.failure)
      fail(a, event_failure("store-lost", placement_.store_address + ": " + e.what(), kExitFailure,
                            options_.node_rank, a.start));
    store_lost_ = true;
  }
}

void Agent::watch_once(Attempt& a) {
  const bool local_done = a.group.all_exited();
  const Worker* failed = a.group.first_failure();
  if (local_done && !a.failure && failed)  // every exit is in: no need to settle
    a.failure = root_cause(worker_failure(*failed, options_.node_rank, a.start, a.oom_kills_at_start), a);
  if (local_done && a.failure) {
    a.finished = true;
    return;
  }
  if (local_done && !a.done_published) {
    try {
      mark_done();
      a.done_published = true;
    } catch (const Error& e) {
      store_lost_ = true;
      a.failure = event_failure("store-lost", placement_.store_address + ": " + e.what(), kExitFailure,
                                options_.node_rank, a.start);
      a.finished = true;
      return;
    }
  }
  const auto wait =
      a.settle_until ? std::min<std::chrono::milliseconds>(a.tick, std::chrono::milliseconds(20)) : a.tick;
  if (!local_done) {
    if (a.group.poll_once(wait, signals_.fd())) on_signals(a, signals_.drain());
  } else {
    on_signals(a, signals_.wait(wait));
  }
  if (!a.failure && a.group.first_failure()) {
    if (!a.settle_until) a.settle_until = Clock::now() + kSettle;
    if (Clock::now() >= *a.settle_until)
      fail(a, root_cause(worker_failure(*a.group.first_failure(), options_.node_rank, a.start, a.oom_kills_at_start), a));
  }
  const auto now = Clock::now();
  if (!a.failure && now >= a.deadline) {
    timed_out_ = true;
    fail(a,
         publish_failure(event_failure("timeout", std::to_string(static_cast<int>(options_.timeout)) + " s",
                                       kExitTimeout, options_.node_rank, a.start)));
  }
  if (now >= a.next_check) {
    a.next_check = now + a.tick;
    check_other_nodes(a);
  }
  if (a.kill_at && now >= *a.kill_at) a.group.kill_all();
}

// After the loop: report, and decide whether the job may go on to another attempt.
int Agent::conclude(Attempt& a) {
  remove_worker_segments(a.group.workers());
  if (!a.failure) return kExitOk;
  const Failure& f = *a.failure;
  LOCKSTEP_LOG(error, run) << failure_report(f, a.group.workers(), placement_.attempt, options_.max_restarts,
                                             placement_.run_id, a.oom_kills_at_start, collectives_at_failure());
  // A deadline or a Ctrl-C anywhere ends the job on every node: no restart.
  if (f.reason == "timeout") timed_out_ = true;
  if (f.reason == "interrupted") interrupted_ = true;
  if (f.reason == "exit" && !restart_can_help(f.code)) no_restart_ = true;
  const bool last_attempt = placement_.attempt >= options_.max_restarts || no_restart_;
  if ((last_attempt || interrupted_ || timed_out_) && !store_lost_) return f.code;  // no attempt follows
  if (store_lost_) {
    // No store, no coordinated restart, unless it can be reached again (node 0 is alive behind
    // a partition that heals) while restarts remain.
    const bool may_restart = !interrupted_ && !timed_out_ && placement_.attempt < options_.max_restarts;
    if (!may_restart || options_.node_rank == 0 || !rejoin()) {
      interrupted_ = true;
      return f.code;
    }
    store_lost_ = false;
  }
  if (!wait_for_every_node_to_stop()) {
    LOCKSTEP_LOG(warn, run) << "not every node confirmed that its workers stopped; giving up on restarts";
    interrupted_ = true;
  }
  return f.code;
}

int Agent::run_attempt() {
  placement_.master_port = agree_on_master_port();
  Attempt a(program_path_, options_.program, output_policy());
  if (options_.timeout > 0)
    a.deadline = a.start + std::chrono::duration_cast<Clock::duration>(comm::Seconds(options_.timeout));
  a.tick = std::chrono::milliseconds(std::max(1, static_cast<int>(options_.monitor_interval * 1000)));
  a.group.start(worker_specs(options_, placement_, knobs::environment()));
  while (!a.finished) watch_once(a);
  return conclude(a);
}

}  // namespace lockstep::launch
