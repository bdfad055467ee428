#include "worker_group.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "lockstep/base/knobs.h"
#include "lockstep/error.h"

namespace lockstep::launch {

std::string signal_name(int sig) {
  switch (sig) {
    case SIGKILL: return "SIGKILL";
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGSEGV: return "SIGSEGV";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGILL: return "SIGILL";
    case SIGPIPE: return "SIGPIPE";
    case SIGHUP: return "SIGHUP";
    case SIGQUIT: return "SIGQUIT";
    default: return "signal " + std::to_string(sig);
  }
}

std::optional<std::string> resolve_program(const std::string& program) {
  auto executable = [](const std::string& p) {
    struct stat st {};
    return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(p.c_str(), X_OK) == 0;
  };
  if (program.find('/') != std::string::npos) {
    if (executable(program)) return program;
    return std::nullopt;
  }
  const std::string dirs = knobs::get(knobs::kPath).value_or("");
  std::size_t start = 0;
  while (start <= dirs.size()) {
    std::size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    std::string dir = dirs.substr(start, end - start);
    std::string candidate = (dir.empty() ? "." : dir) + "/" + program;
    if (executable(candidate)) return candidate;
    start = end + 1;
  }
  return std::nullopt;
}

WorkerGroup::WorkerGroup(std::string program_path, std::vector<std::string> argv, OutputPolicy output)
    : program_path_(std::move(program_path)), argv_(std::move(argv)), output_(std::move(output)) {}

WorkerGroup::~WorkerGroup() {
  for (auto& w : workers_) {
    if (!w.exit && w.pid > 0) {
      ::kill(-w.pid, SIGKILL);
      ::waitpid(w.pid, nullptr, 0);
    }
    for (int fd : {w.out_fd, w.err_fd, w.out_file, w.err_file})
      if (fd >= 0) ::close(fd);
  }
}

void WorkerGroup::start(const std::vector<WorkerSpec>& specs) {
  workers_.reserve(specs.size());
  for (const auto& spec : specs) {
    Worker w;
    w.spec = spec;
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0)
      throw SystemError(std::string("cannot create pipes for a worker: ") + std::strerror(errno));
    auto open_log = [&](const std::string& dir, const char* suffix) {
      if (dir.empty()) return -1;
      std::string path = dir + "/rank_" + std::to_string(spec.rank) + "." + suffix;
      int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd < 0) throw SystemError("cannot write " + path + ": " + std::strerror(errno));
      return fd;
    };
    w.out_file = open_log(output_.stdout_file_dir, "stdout");
    w.err_file = open_log(output_.stderr_file_dir, "stderr");

    // Everything the child touches is prepared before fork: after it, only async-signal-safe
    // calls until execve.
    std::vector<char*> argv, envp;
    for (auto& a : argv_) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    for (auto& e : w.spec.env) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);
    pid_t parent = ::getpid();
    pid_t pid = ::fork();
    if (pid < 0) throw SystemError(std::string("fork failed: ") + std::strerror(errno));
    if (pid == 0) {
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != parent) ::_exit(127);  // the agent died before prctl took effect
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      for (int s : {SIGINT, SIGTERM, SIGPIPE, SIGCHLD}) ::signal(s, SIG_DFL);
      ::dup2(out[1], STDOUT_FILENO);
      ::dup2(err[1], STDERR_FILENO);
      ::execve(program_path_.c_str(), argv.data(), envp.data());
      const char msg[] = "lockstep run: exec failed\n";
      ssize_t ignored = ::write(STDERR_FILENO, msg, sizeof msg - 1);
      (void)ignored;
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also from the parent, so a stop right away cannot miss the group
    ::close(out[1]);
    ::close(err[1]);
    w.pid = pid;
    w.out_fd = out[0];
    w.err_fd = err[0];
    ::fcntl(w.out_fd, F_SETFL, O_NONBLOCK);
    ::fcntl(w.err_fd, F_SETFL, O_NONBLOCK);
    workers_.push_back(std::move(w));
  }
}

void WorkerGroup::emit_line(Worker& w, bool is_stderr, const std::string& line) {
  if (is_stderr) {
    w.err_tail.push_back(line);
    while (w.err_tail.size() > output_.tail_lines) w.err_tail.pop_front();
  }
  int file = is_stderr ? w.err_file : w.out_file;
  if (file >= 0) {
    std::string data = line + "\n";
    ssize_t ignored = ::write(file, data.data(), data.size());
    (void)ignored;
  }
  if (is_stderr ? output_.console_stderr : output_.console_stdout) {
    const std::string label = w.spec.label.empty() ? "rank " + std::to_string(w.spec.rank) : w.spec.label;
    std::string data = "[" + label + "] " + line + "\n";
    ssize_t ignored = ::write(is_stderr ? STDERR_FILENO : STDOUT_FILENO, data.data(), data.size());
    (void)ignored;
  }
}

void WorkerGroup::relay(Worker& w, bool is_stderr, const char* data, std::size_t n) {
  std::string& partial = is_stderr ? w.err_partial : w.out_partial;
  partial.append(data, n);
  std::size_t start = 0, nl;
  while ((nl = partial.find('\n', start)) != std::string::npos) {
    emit_line(w, is_stderr, partial.substr(start, nl - start));
    start = nl + 1;
  }
  partial.erase(0, start);
}

// Reads what the pipes hold now; on EOF flushes a last unterminated line and closes.
void WorkerGroup::drain(Worker& w) {
  char buf[65536];
  for (int* fd : {&w.out_fd, &w.err_fd}) {
    bool is_stderr = fd == &w.err_fd;
    while (*fd >= 0) {
      ssize_t n = ::read(*fd, buf, sizeof buf);
      if (n > 0) {
        relay(w, is_stderr, buf, static_cast<std::size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) break;
      std::string& partial = is_stderr ? w.err_partial : w.out_partial;
      if (!partial.empty()) emit_line(w, is_stderr, partial);
      partial.clear();
      ::close(*fd);
      *fd = -1;
    }
  }
}

void WorkerGroup::reap() {
  // One timestamp per round: exits reaped together are simultaneous as far as we can tell.
  const auto now = Clock::now();
  for (;;) {
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) return;
    for (auto& w : workers_) {
      if (w.pid != pid || w.exit) continue;
      drain(w);  // what it wrote before exiting is in the pipe already
      WorkerExit e;
      e.when = now;
      e.stopped_by_us = w.stop_requested;
      if (WIFSIGNALED(status)) {
        e.signal = WTERMSIG(status);
        e.code = 128 + e.signal;
      } else {
        e.code = WEXITSTATUS(status);
      }
      w.exit = e;
    }
  }
}

bool WorkerGroup::poll_once(std::chrono::milliseconds timeout, int signal_fd) {
  std::vector<pollfd> fds;
  std::vector<std::pair<Worker*, bool>> owners;
  for (auto& w : workers_) {
    if (w.out_fd >= 0) fds.push_back({w.out_fd, POLLIN, 0}), owners.push_back({&w, false});
    if (w.err_fd >= 0) fds.push_back({w.err_fd, POLLIN, 0}), owners.push_back({&w, true});
  }
  if (signal_fd >= 0) fds.push_back({signal_fd, POLLIN, 0});
  int n = ::poll(fds.data(), fds.size(), static_cast<int>(timeout.count()));
  bool signalled = false;
  if (n > 0) {
    for (std::size_t i = 0; i < owners.size(); ++i)
      if (fds[i].revents) drain(*owners[i].first);
    if (signal_fd >= 0 && fds.back().revents) signalled = true;
  }
  reap();
  return signalled;
}

void WorkerGroup::terminate_all() {
  reap();  // a worker that already died is recorded as such, not as stopped by us
  for (auto& w : workers_) {
    if (w.exit) continue;
    w.stop_requested = true;
    ::kill(-w.pid, SIGTERM);
  }
}

void WorkerGroup::kill_all() {
  for (auto& w : workers_)
    if (!w.exit) ::kill(-w.pid, SIGKILL);
}

bool WorkerGroup::all_exited() const {
  for (const auto& w : workers_)
    if (!w.exit) return false;
  return true;
}

const Worker* WorkerGroup::first_failure() const {
  const Worker* first = nullptr;
  for (const auto& w : workers_) {
    if (!w.exit || w.exit->code == 0 || w.exit->stopped_by_us) continue;
    // A death by signal before any error exit (peers of a killed rank exit with an error,
    // sometimes before the kernel even reports the death); otherwise the earliest.
    bool signal = w.exit->signal != 0, first_signal = first && first->exit->signal != 0;
    if (!first || (signal && !first_signal) || (signal == first_signal && w.exit->when < first->exit->when))
      first = &w;
  }
  return first;
}

}  // namespace lockstep::launch
