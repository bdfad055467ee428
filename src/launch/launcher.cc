#include "lockstep/launch/launcher.h"

#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "lockstep/comm/store.h"
#include "lockstep/error.h"
#include "worker_group.h"

extern char** environ;

namespace lockstep::launch {
namespace {

// glibc's malloc returns freed blocks above its mmap threshold (128 KiB, rising with use) to the
// kernel, so a training step that frees and reallocates its activations page-faults them all in
// again each step (the example's CNN trained 34-49% faster here without those faults). Workers
// keep freed memory for reuse instead, so their footprint stays at its peak. Only set when
// GLIBC_TUNABLES is unset: the user's own tunables win.
constexpr const char* kWorkerMallocTunables =
    "glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824";

using comm::Seconds;
using nlohmann::json;

constexpr int kTimeoutExit = 124;
constexpr auto kSettle = std::chrono::milliseconds(250);

void say(const std::string& line) {
  std::string out = "lockstep run: " + line + "\n";
  ssize_t ignored = ::write(STDERR_FILENO, out.data(), out.size());
  (void)ignored;
}

std::string wall_clock() {
  char buf[32];
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::localtime_r(&now, &tm);
  std::strftime(buf, sizeof buf, "%H:%M:%S", &tm);
  return buf;
}

std::string host_name() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return host;
}

// A port no one listens on right now (the kernel's pick); for MASTER_PORT, which the workers'
// own program (e.g. PyTorch's TCPStore on rank 0) binds.
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof addr;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ::close(fd);
    throw SystemError("cannot find a free TCP port");
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

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

// Removes shared-memory segments that workers with these pids created (the shm backend names
// them lockstep-<pid of rank 0>-...). Normally there are none: the backend unlinks a segment
// as soon as every rank mapped it; this covers a crash in between.
void remove_worker_segments(const std::vector<Worker>& workers) {
  DIR* d = ::opendir("/dev/shm");
  if (!d) return;
  std::vector<std::string> doomed;
  while (dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    for (const auto& w : workers)
      if (name.rfind("lockstep-" + std::to_string(w.pid) + "-", 0) == 0) doomed.push_back(name);
  }
  ::closedir(d);
  for (const auto& name : doomed) ::shm_unlink(("/" + name).c_str());
}

std::string describe_exit(const json& f) {
  std::string reason = f.value("reason", "exit");
  if (reason == "timeout") return "the job exceeded --timeout " + f.value("detail", std::string());
  if (reason == "interrupted")
    return "the launcher on node " + std::to_string(f.value("node", 0)) + " got " +
           f.value("detail", std::string());
  if (reason == "store-lost")
    return "node 0's launcher, which hosts the job's store, stopped answering (" +
           f.value("detail", std::string()) + ")";
  if (reason == "agent-lost")
    return "the launcher of node " + f.value("detail", std::string()) + " died or lost its connection";
  std::string who = "rank " + std::to_string(f.value("rank", -1)) + " (local rank " +
                    std::to_string(f.value("local_rank", -1)) + ", node " +
                    std::to_string(f.value("node", 0)) + ", host " + f.value("host", std::string("?")) +
                    ", pid " + std::to_string(f.value("pid", 0)) + ")";
  int sig = f.value("signal", 0);
  std::string how =
      sig ? "was killed by " + signal_name(sig) : "exited with code " + std::to_string(f.value("code", 1));
  return who + " " + how;
}

class Agent {
 public:
  explicit Agent(const LaunchOptions& o) : o_(o) {}

  int run() {
    setup_signals();
    join();
    int code = 0;
    for (attempt_ = 0; attempt_ <= o_.max_restarts; ++attempt_) {
      code = run_attempt();
      if (code == 0 || interrupted_ || timed_out_ || attempt_ == o_.max_restarts) break;
      say("restarting the whole group (" + std::to_string(attempt_ + 1) + " of " +
          std::to_string(o_.max_restarts) +
          " restarts): LOCKSTEP_RESTART_COUNT=" + std::to_string(attempt_ + 1));
    }
    leave();
    return code;
  }

  ~Agent() {
    if (signal_fd_ >= 0) ::close(signal_fd_);
  }

 private:
  std::string key(const std::string& k) const { return "launch/" + run_id_ + "/" + k; }
  std::string attempt_key(const std::string& k) const {
    return key("attempt/" + std::to_string(attempt_) + "/" + k);
  }

  void setup_signals() {
    sigset_t set;
    sigemptyset(&set);
    for (int s : {SIGINT, SIGTERM, SIGCHLD, SIGHUP}) sigaddset(&set, s);
    ::pthread_sigmask(SIG_BLOCK, &set, nullptr);  // before any thread starts: they inherit it
    signal_fd_ = ::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
  }

  void join() {
    run_id_ = o_.run_id;
    if (run_id_.empty()) run_id_ = o_.nnodes == 1 ? comm::random_token().substr(0, 12) : "default";
    token_ = o_.token;
    if (token_.empty()) {
      if (const char* t = std::getenv("LOCKSTEP_TOKEN"); t && *t) token_ = t;
    }
    if (token_.empty()) {
      if (o_.nnodes == 1) {
        token_ = comm::random_token();
      } else {
        token_ = "lockstep-run:" + run_id_;
        if (o_.node_rank == 0)
          say("warning: LOCKSTEP_TOKEN is not set, so the store's token derives from the run id; set the "
              "same "
              "secret LOCKSTEP_TOKEN on every node to keep other programs out");
      }
    }
    std::string store_host = o_.node_rank == 0 ? "127.0.0.1" : o_.master_addr;
    if (o_.node_rank == 0) {
      server_ = std::make_unique<comm::StoreServer>(
          comm::StoreServerOptions{o_.nnodes > 1 ? "0.0.0.0" : "127.0.0.1", o_.master_port, token_});
    }
    store_port_ = server_ ? server_->port() : o_.master_port;
    store_ = std::make_unique<comm::StoreClient>(
        comm::StoreClientOptions{store_host, store_port_, token_, Seconds(o_.join_timeout)});
    if (store_->add(key("claim/" + std::to_string(o_.node_rank)), 1) != 1)
      throw ConfigError("another launcher already joined run '" + run_id_ + "' as --node-rank " +
                        std::to_string(o_.node_rank) + ": give each node a distinct --node-rank in 0.." +
                        std::to_string(o_.nnodes - 1));
    store_->set_ephemeral(key("alive/" + std::to_string(o_.node_rank)), "1");
    store_->set(key("agent/" + std::to_string(o_.node_rank)),
                json{{"host", host_name()}, {"nproc", o_.nproc_per_node}}.dump());
    std::vector<std::string> keys;
    for (int n = 0; n < o_.nnodes; ++n) keys.push_back(key("agent/" + std::to_string(n)));
    try {
      store_->wait(keys, Seconds(o_.join_timeout));
    } catch (const TimeoutError&) {
      throw TimeoutError("not every node joined within " + std::to_string(static_cast<int>(o_.join_timeout)) +
                         " s: start one `lockstep run` per node, each with --nnodes " +
                         std::to_string(o_.nnodes) + " and its own --node-rank");
    }
    // From now on a store that does not answer means node 0's launcher is gone: give up on a
    // call within seconds (reconnects included), not the join timeout.
    store_->set_timeout(Seconds(std::max(3.0, 20 * o_.monitor_interval)));
    world_size_ = 0;
    for (int n = 0; n < o_.nnodes; ++n) {
      json a = json::parse(store_->get(keys[static_cast<std::size_t>(n)]));
      if (n == o_.node_rank) first_rank_ = world_size_;
      hosts_.push_back(a["host"].get<std::string>());
      world_size_ += a["nproc"].get<int>();
    }
  }

  std::vector<WorkerSpec> worker_specs(int master_port) {
    std::map<std::string, std::string> base;
    for (char** e = environ; *e; ++e) {
      std::string kv(*e);
      auto eq = kv.find('=');
      if (eq != std::string::npos) base[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    if (!base.count("OMP_NUM_THREADS"))
      base["OMP_NUM_THREADS"] =
          std::to_string(std::max(1u, cores / static_cast<unsigned>(o_.nproc_per_node)));
    if (!base.count("GLIBC_TUNABLES")) base["GLIBC_TUNABLES"] = kWorkerMallocTunables;
    std::string master_addr = o_.nnodes == 1 ? "127.0.0.1" : o_.master_addr;
    base["MASTER_ADDR"] = master_addr;
    base["MASTER_PORT"] = std::to_string(master_port);
    base["WORLD_SIZE"] = base["ROLE_WORLD_SIZE"] = std::to_string(world_size_);
    base["LOCAL_WORLD_SIZE"] = std::to_string(o_.nproc_per_node);
    base["GROUP_RANK"] = std::to_string(o_.node_rank);
    base["GROUP_WORLD_SIZE"] = std::to_string(o_.nnodes);
    base["ROLE_NAME"] = "default";
    base["TORCHELASTIC_RESTART_COUNT"] = base["LOCKSTEP_RESTART_COUNT"] = std::to_string(attempt_);
    base["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(o_.max_restarts);
    base["TORCHELASTIC_RUN_ID"] = base["LOCKSTEP_RUN_ID"] = run_id_;
    base["LOCKSTEP_STORE_ADDR"] = master_addr + ":" + std::to_string(store_port_);
    base["LOCKSTEP_TOKEN"] = token_;
    if (!o_.backend.empty()) base["LOCKSTEP_BACKEND"] = o_.backend;
    std::vector<WorkerSpec> specs;
    for (int local = 0; local < o_.nproc_per_node; ++local) {
      auto env = base;
      int rank = first_rank_ + local;
      env["RANK"] = env["ROLE_RANK"] = std::to_string(rank);
      env["LOCAL_RANK"] = std::to_string(local);
      WorkerSpec spec;
      spec.rank = rank;
      spec.local_rank = local;
      for (auto& [k, v] : env) spec.env.push_back(k + "=" + v);
      specs.push_back(std::move(spec));
    }
    return specs;
  }

  OutputPolicy output_policy() {
    OutputPolicy p;
    int files = o_.tee | o_.redirects;
    p.console_stdout = !(o_.redirects & 1) || (o_.tee & 1);
    p.console_stderr = !(o_.redirects & 2) || (o_.tee & 2);
    if (files != 0) {
      std::string base = o_.log_dir.empty() ? "/tmp/lockstep-logs" : o_.log_dir;
      std::string dir = base + "/" + run_id_ + "/attempt_" + std::to_string(attempt_);
      make_dirs(dir);
      if (files & 1) p.stdout_file_dir = dir;
      if (files & 2) p.stderr_file_dir = dir;
      if (attempt_ == 0 && o_.node_rank == 0) say("worker logs in " + base + "/" + run_id_);
    }
    return p;
  }

  // Publishes a failure unless another one came first; returns the one that counts.
  json publish_failure(const json& mine) {
    if (store_lost_) return mine;
    try {
      return json::parse(store_->compare_set(attempt_key("failed"), "", mine.dump()));
    } catch (const Error&) {
      store_lost_ = true;  // node 0 is gone: this node stops on its own
      return mine;
    }
  }

  json local_failure_record(const Worker& w) {
    json tail = json::array();
    for (const auto& l : w.err_tail) tail.push_back(l);
    double elapsed = std::chrono::duration<double>(w.exit->when - attempt_start_).count();
    return {{"reason", "exit"},     {"rank", w.spec.rank},      {"local_rank", w.spec.local_rank},
            {"node", o_.node_rank}, {"host", host_name()},      {"pid", w.pid},
            {"code", w.exit->code}, {"signal", w.exit->signal}, {"time", wall_clock()},
            {"elapsed", elapsed},   {"stderr_tail", tail}};
  }

  json event_record(const std::string& reason, const std::string& detail, int code) {
    return {{"reason", reason},
            {"detail", detail},
            {"node", o_.node_rank},
            {"host", host_name()},
            {"code", code},
            {"time", wall_clock()},
            {"elapsed", std::chrono::duration<double>(Clock::now() - attempt_start_).count()}};
  }

  int run_attempt() {
    int master_port;
    if (o_.node_rank == 0) {
      master_port = free_port();
      store_->set(attempt_key("master_port"), std::to_string(master_port));
    } else {
      master_port =
          std::stoi(store_->get(attempt_key("master_port"), Seconds(o_.join_timeout + o_.grace_period + 30)));
    }
    WorkerGroup group(program_path_, o_.program, output_policy());
    attempt_start_ = Clock::now();
    auto job_deadline =
        o_.timeout > 0 ? attempt_start_ + std::chrono::duration_cast<Clock::duration>(Seconds(o_.timeout))
                       : Clock::time_point::max();
    group.start(worker_specs(master_port));

    std::optional<json> failure;
    std::optional<Clock::time_point> kill_at, settle_until;
    auto stop = [&] {
      if (kill_at) return;
      group.terminate_all();
      kill_at = Clock::now() + std::chrono::duration_cast<Clock::duration>(Seconds(o_.grace_period));
    };
    auto tick = std::chrono::milliseconds(std::max(1, static_cast<int>(o_.monitor_interval * 1000)));
    auto next_check = Clock::now();
    bool done_published = false;
    for (;;) {
      bool local_done = group.all_exited();
      if (local_done && !failure && group.first_failure()) {
        failure = publish_failure(local_failure_record(*group.first_failure()));  // all exits are in
      }
      if (local_done && failure) break;
      if (local_done && !done_published) {
        try {
          store_->set(attempt_key("done/" + std::to_string(o_.node_rank)), "1");
        } catch (const Error& e) {
          store_lost_ = true;
          failure = event_record("store-lost", e.what(), 1);
          break;
        }
        done_published = true;
      }
      auto wait =
          settle_until ? std::min<std::chrono::milliseconds>(tick, std::chrono::milliseconds(20)) : tick;
      if (!local_done) {
        if (group.poll_once(wait, signal_fd_))
          handle_signals(failure, [&](const json& f) {
            failure = publish_failure(f);
            stop();
          });
      } else {
        drain_signal_wait(wait, failure, [&](const json& f) { failure = publish_failure(f); });
      }
      if (!failure && group.first_failure()) {
        // Let simultaneous exits land before naming the first failure: a killed rank's peers
        // notice its death, through shared memory, even before the kernel reports it to us.
        if (!settle_until) settle_until = Clock::now() + kSettle;
        if (Clock::now() >= *settle_until) {
          failure = publish_failure(local_failure_record(*group.first_failure()));
          stop();
        }
      }
      auto now = Clock::now();
      if (!failure && now >= job_deadline) {
        timed_out_ = true;
        failure = publish_failure(
            event_record("timeout", std::to_string(static_cast<int>(o_.timeout)) + " s", kTimeoutExit));
        stop();
      }
      if (now >= next_check) {
        next_check = now + tick;
        try {
          if (!failure) {
            if (auto f = store_->try_get(attempt_key("failed"))) {
              failure = json::parse(*f);
              stop();
            } else if (auto lost = lost_agent()) {
              failure = publish_failure(event_record("agent-lost", *lost, 1));
              stop();
            }
          }
          if (!failure && done_published && all_nodes_done()) break;
        } catch (const Error& e) {
          if (!failure) {
            failure = event_record("store-lost", e.what(), 1);
            stop();
          }
          store_lost_ = true;
        }
      }
      if (kill_at && now >= *kill_at) group.kill_all();
    }
    remove_worker_segments(group.workers());
    if (!failure) return 0;

    report(*failure, group);
    // A deadline or a Ctrl-C anywhere ends the job on every node: no restart.
    if (failure->value("reason", "") == "timeout") timed_out_ = true;
    if (failure->value("reason", "") == "interrupted") interrupted_ = true;
    if (store_lost_) {
      interrupted_ = true;  // no store, no coordinated restart
      return failure->value("code", 1);
    }
    // Every node stops its workers before any starts the next attempt.
    store_->set(attempt_key("stopped/" + std::to_string(o_.node_rank)), "1");
    std::vector<std::string> keys;
    for (int n = 0; n < o_.nnodes; ++n) keys.push_back(attempt_key("stopped/" + std::to_string(n)));
    try {
      store_->wait(keys, Seconds(o_.grace_period + 30));
    } catch (const TimeoutError&) {
      say("not every node confirmed that its workers stopped; giving up on restarts");
      interrupted_ = true;
    }
    return failure->value("code", 1);
  }

  template <typename OnFailure>
  void handle_signals(const std::optional<json>& failure, OnFailure on_failure) {
    signalfd_siginfo info{};
    while (::read(signal_fd_, &info, sizeof info) == sizeof info) {
      int sig = static_cast<int>(info.ssi_signo);
      if (sig == SIGCHLD) continue;  // poll_once reaps
      if (!interrupted_) {
        interrupted_ = true;
        say("got " + signal_name(sig) + ": stopping the workers (grace period " +
            std::to_string(static_cast<int>(o_.grace_period)) + " s)");
        if (!failure) on_failure(event_record("interrupted", signal_name(sig), 128 + sig));
      }
    }
  }

  template <typename OnFailure>
  void drain_signal_wait(std::chrono::milliseconds tick, const std::optional<json>& failure,
                         OnFailure on_failure) {
    pollfd p{signal_fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(tick.count())) > 0) handle_signals(failure, on_failure);
  }

  // A node whose launcher is gone before its workers finished this attempt. (One that finished
  // may leave: its ephemeral key vanishes with it.)
  std::optional<std::string> lost_agent() {
    for (int n = 0; n < o_.nnodes; ++n) {
      if (n == o_.node_rank) continue;
      std::string id = std::to_string(n);
      if (!store_->try_get(key("alive/" + id)) && !store_->try_get(attempt_key("done/" + id)))
        return id + " (" + hosts_[static_cast<std::size_t>(n)] + ")";
    }
    return std::nullopt;
  }

  bool all_nodes_done() {
    for (int n = 0; n < o_.nnodes; ++n)
      if (!store_->try_get(attempt_key("done/" + std::to_string(n)))) return false;
    return true;
  }

  void report(const json& f, const WorkerGroup& group) {
    std::string out = "lockstep run: job FAILED (attempt " + std::to_string(attempt_ + 1) + " of " +
                      std::to_string(o_.max_restarts + 1) + ", run id " + run_id_ + ")\n";
    char elapsed[64];
    std::snprintf(elapsed, sizeof elapsed, "%.1f", f.value("elapsed", 0.0));
    out += "  first failure: " + describe_exit(f) + " at " + f.value("time", std::string("?")) + " (" +
           elapsed + " s into the attempt)\n";
    if (f.contains("stderr_tail") && !f["stderr_tail"].empty()) {
      out += "  last " + std::to_string(f["stderr_tail"].size()) + " lines of its stderr:\n";
      for (const auto& l : f["stderr_tail"]) out += "    | " + l.get<std::string>() + "\n";
    } else if (f.value("reason", "") == "exit") {
      out += "  it wrote nothing to stderr\n";
    }
    out += "  workers on this node (" + host_name() + "):\n";
    for (const auto& w : group.workers()) {
      std::string state;
      if (!w.exit)
        state = "still running (killed)";
      else if (w.exit->stopped_by_us)
        state = "stopped by lockstep (" +
                (w.exit->signal ? signal_name(w.exit->signal) : "exit " + std::to_string(w.exit->code)) + ")";
      else if (w.exit->signal)
        state = "killed by " + signal_name(w.exit->signal);
      else
        state = "exited with code " + std::to_string(w.exit->code);
      out +=
          "    rank " + std::to_string(w.spec.rank) + " (pid " + std::to_string(w.pid) + "): " + state + "\n";
    }
    ssize_t ignored = ::write(STDERR_FILENO, out.data(), out.size());
    (void)ignored;
  }

  void leave() {
    try {
      store_->set(key("bye/" + std::to_string(o_.node_rank)), "1");
      if (server_) {
        std::vector<std::string> keys;
        for (int n = 0; n < o_.nnodes; ++n) keys.push_back(key("bye/" + std::to_string(n)));
        store_->wait(keys, Seconds(10));  // keep the store up until every agent read its last key
      }
    } catch (const Error&) {
      // Another agent is gone already: nothing is waiting on us.
    }
  }

 public:
  std::string program_path_;

 private:
  const LaunchOptions& o_;
  int signal_fd_ = -1;
  std::string run_id_, token_;
  std::unique_ptr<comm::StoreServer> server_;
  std::unique_ptr<comm::StoreClient> store_;
  int store_port_ = 0;
  int world_size_ = 0, first_rank_ = 0;
  std::vector<std::string> hosts_;
  int attempt_ = 0;
  Clock::time_point attempt_start_;
  bool interrupted_ = false, timed_out_ = false, store_lost_ = false;
};

}  // namespace

void validate(const LaunchOptions& o) {
  if (o.program.empty()) throw ConfigError("no PROGRAM given: lockstep run [options] PROGRAM [ARGS...]");
  if (o.nproc_per_node < 1)
    throw ConfigError("--nproc-per-node must be at least 1 (got " + std::to_string(o.nproc_per_node) + ")");
  if (o.nnodes < 1) throw ConfigError("--nnodes must be at least 1 (got " + std::to_string(o.nnodes) + ")");
  if (o.node_rank < 0 || o.node_rank >= o.nnodes)
    throw ConfigError("--node-rank " + std::to_string(o.node_rank) + " is not below --nnodes " +
                      std::to_string(o.nnodes) + ": use 0.." + std::to_string(o.nnodes - 1));
  if (o.master_port < 0 || o.master_port > 65535)
    throw ConfigError("--master-port " + std::to_string(o.master_port) + " is not a TCP port (0..65535)");
  if (o.nnodes > 1 && o.master_port == 0)
    throw ConfigError("--nnodes " + std::to_string(o.nnodes) +
                      " needs --master-port (the port of node 0's store, "
                      "the same on every node)");
  if (o.max_restarts < 0) throw ConfigError("--max-restarts must be >= 0");
  if (!(o.monitor_interval > 0)) throw ConfigError("--monitor-interval must be > 0 seconds");
  if (o.grace_period < 0) throw ConfigError("--grace-period must be >= 0 seconds");
  if (o.timeout < 0) throw ConfigError("--timeout must be >= 0 seconds (0: none)");
  if (o.tee < 0 || o.tee > 3 || o.redirects < 0 || o.redirects > 3)
    throw ConfigError("--tee and --redirects take 0 (none), 1 (stdout), 2 (stderr) or 3 (both)");
  if (!o.backend.empty() && o.backend != "shm" && o.backend != "gloo" && o.backend != "mpi" &&
      o.backend != "auto")
    throw ConfigError("--backend '" + o.backend + "' is unknown: use shm, gloo, mpi or auto");
  if (!resolve_program(o.program[0]))
    throw ConfigError("program '" + o.program[0] + "' not found" +
                      (o.program[0].find('/') == std::string::npos ? " on PATH" : " (or not executable)") +
                      ": check the name, or give a path");
}

int run_job(const LaunchOptions& options) {
  validate(options);
  Agent agent(options);
  agent.program_path_ = *resolve_program(options.program[0]);
  return agent.run();
}

}  // namespace lockstep::launch
