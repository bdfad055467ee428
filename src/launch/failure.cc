#include "failure.h"

#include <unistd.h>

#include <csignal>

#include <cstdio>
#include <ctime>

#include "oom.h"

namespace lockstep::launch {

nlohmann::json Failure::to_json() const {
  return {{"reason", reason}, {"detail", detail}, {"rank", rank},       {"local_rank", local_rank},
          {"node", node},     {"host", host},     {"pid", pid},         {"code", code},
          {"signal", signal}, {"time", time},     {"elapsed", elapsed}, {"stderr_tail", stderr_tail},
          {"out_of_memory", out_of_memory}};
}

Failure Failure::from_json(const nlohmann::json& j) {
  Failure f;
  f.reason = j.value("reason", "exit");
  f.detail = j.value("detail", "");
  f.rank = j.value("rank", -1);
  f.local_rank = j.value("local_rank", -1);
  f.node = j.value("node", 0);
  f.host = j.value("host", "?");
  f.pid = j.value("pid", 0);
  f.code = j.value("code", 1);
  f.signal = j.value("signal", 0);
  f.time = j.value("time", "?");
  f.elapsed = j.value("elapsed", 0.0);
  f.stderr_tail = j.value("stderr_tail", std::vector<std::string>{});
  f.out_of_memory = j.value("out_of_memory", "");
  return f;
}

std::string Failure::describe() const {
  if (reason == "timeout") return "the job exceeded --timeout " + detail;
  if (reason == "interrupted") return "the launcher on node " + std::to_string(node) + " got " + detail;
  if (reason == "store-lost")
    return "node 0's launcher, which hosts the job's store, stopped answering (" + detail +
           "): it died, or the network between the machines is down";
  if (reason == "agent-lost") return "the launcher of node " + detail + " died or lost its connection";
  const std::string who = "rank " + std::to_string(rank) + " (local rank " + std::to_string(local_rank) +
                          ", node " + std::to_string(node) + ", host " + host + ", pid " +
                          std::to_string(pid) + ")";
  if (!out_of_memory.empty())
    return who + " ran out of memory: the kernel's OOM killer ended it (SIGKILL) when " + out_of_memory +
           " was reached; give each worker less to hold (a higher --zero-stage, fewer workers per machine, a "
           "smaller batch, --gradient-checkpointing) or the machine more memory";
  return who + " " +
         (signal ? "was killed by " + signal_name(signal) : "exited with code " + std::to_string(code));
}

std::string host_name() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return host;
}

std::string wall_clock() {
  char buf[32];
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::localtime_r(&now, &tm);
  std::strftime(buf, sizeof buf, "%H:%M:%S", &tm);
  return buf;
}

Failure worker_failure(const Worker& w, int node, Clock::time_point attempt_start, std::int64_t oom_kills_at_start) {
  Failure f;
  f.rank = w.spec.rank;
  f.local_rank = w.spec.local_rank;
  f.node = node;
  f.host = host_name();
  f.pid = w.pid;
  f.code = w.exit->code;
  f.signal = w.exit->signal;
  f.time = wall_clock();
  f.elapsed = std::chrono::duration<double>(w.exit->when - attempt_start).count();
  f.stderr_tail.assign(w.err_tail.begin(), w.err_tail.end());
  if (f.signal == SIGKILL && oom_kills_at_start >= 0 && oom_kills() > oom_kills_at_start) {
    f.out_of_memory = memory_limit_text();
    if (f.out_of_memory.empty()) f.out_of_memory = "the memory available";
  }
  return f;
}

Failure event_failure(const std::string& reason, const std::string& detail, int code, int node,
                      Clock::time_point attempt_start) {
  Failure f;
  f.reason = reason;
  f.detail = detail;
  f.node = node;
  f.host = host_name();
  f.code = code;
  f.time = wall_clock();
  f.elapsed = std::chrono::duration<double>(Clock::now() - attempt_start).count();
  return f;
}

namespace {

// Killed by SIGKILL, not by us, while the kernel's OOM kills rose: its memory ran out.
bool out_of_memory(const Worker& w, std::int64_t oom_kills_at_start) {
  return w.exit && !w.exit->stopped_by_us && w.exit->signal == SIGKILL && oom_kills_at_start >= 0 &&
         oom_kills() > oom_kills_at_start;
}

std::string worker_state(const Worker& w, std::int64_t oom_kills_at_start) {
  if (!w.exit) return "still running (killed)";
  if (w.exit->stopped_by_us)
    return "stopped by lockstep (" +
           (w.exit->signal ? signal_name(w.exit->signal) : "exit " + std::to_string(w.exit->code)) + ")";
  if (out_of_memory(w, oom_kills_at_start)) return "killed by SIGKILL: ran out of memory (the kernel's OOM killer)";
  if (w.exit->signal) return "killed by " + signal_name(w.exit->signal);
  return "exited with code " + std::to_string(w.exit->code);
}

}  // namespace

std::string failure_report(const Failure& f, const std::vector<Worker>& workers, int attempt,
                           int max_restarts, const std::string& run_id, std::int64_t oom_kills_at_start,
                           const std::vector<std::string>& collectives) {
  char elapsed[64];
  std::snprintf(elapsed, sizeof elapsed, "%.1f", f.elapsed);
  std::string out = "job FAILED (attempt " + std::to_string(attempt + 1) + " of " +
                    std::to_string(max_restarts + 1) + ", run id " + run_id + ")\n";
  out += "  first failure: " + f.describe() + " at " + f.time + " (" + elapsed + " s into the attempt)\n";
  if (!f.stderr_tail.empty()) {
    out += "  last " + std::to_string(f.stderr_tail.size()) + " lines of its stderr:\n";
    for (const auto& l : f.stderr_tail) out += "    | " + l + "\n";
  } else if (f.reason == "exit") {
    out += "  it wrote nothing to stderr\n";
  }
  // The first failure agreed on may be another rank's reaction to this node's OOM kill.
  for (const auto& w : workers)
    if (f.out_of_memory.empty() && out_of_memory(w, oom_kills_at_start)) {
      const std::string limit = memory_limit_text();
      out += "  on this node, rank " + std::to_string(w.spec.rank) + " ran out of memory first: the kernel's OOM "
             "killer ended it when " + (limit.empty() ? std::string("the memory available") : limit) +
             " was reached (the failure above followed from it)\n";
      break;
    }
  out += "  workers on this node (" + host_name() + "):\n";
  for (const auto& w : workers)
    out += "    rank " + std::to_string(w.spec.rank) + " (pid " + std::to_string(w.pid) +
           "): " + worker_state(w, oom_kills_at_start) + "\n";
  if (!collectives.empty()) {
    out += "  collectives (the ranks' flight records, furthest behind first):\n";
    for (const auto& line : collectives) out += "    " + line + "\n";
  }
  out.pop_back();  // the logger ends the line
  return out;
}

}  // namespace lockstep::launch
