#include "testing.h"

#include "rank_environment.h"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace lockstep::testing {

namespace {

// This process's environment with `overrides` applied ("<unset>" removes a variable), as the
// NAME=value strings execve wants.
std::vector<std::string> environment_with(const std::map<std::string, std::string>& overrides) {
  std::map<std::string, std::string> all;
  for (char** e = environ; *e; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) all[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (const auto& [k, v] : overrides) {
    if (v == "<unset>")
      all.erase(k);
    else
      all[k] = v;
  }
  std::vector<std::string> out;
  for (const auto& [k, v] : all) out.push_back(k + "=" + v);
  return out;
}

// Pointers into `strings`, null-terminated, as execve and posix_spawn want (`strings` must
// outlive them).
std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

}  // namespace

TempDir::TempDir(const std::string& name) {
  std::string base = ::testing::TempDir();
  if (base.empty() || base.back() != '/') base += '/';
  std::string templ = base + "lockstep-" + name + "-XXXXXX";
  if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("cannot create a directory like " + templ);
  path_ = templ;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

LocalStore::LocalStore() : token_(comm::random_token()) {
  server_ = std::make_unique<comm::StoreServer>(comm::StoreServerOptions{"127.0.0.1", 0, token_});
}

std::shared_ptr<comm::StoreClient> LocalStore::client(double timeout_seconds) const {
  return std::make_shared<comm::StoreClient>(
      comm::StoreClientOptions{"127.0.0.1", server_->port(), token_, comm::Seconds(timeout_seconds)});
}

void run_ranks_as_threads(int world, const comm::CommOptions& options,
                          const std::function<void(comm::Communicator&)>& fn) {
  run_ranks_as_threads_with_store(world, options, [&](comm::Communicator& comm, comm::StoreClient&) { fn(comm); });
}

void run_ranks_as_threads_with_store(int world, const comm::CommOptions& options,
                                     const std::function<void(comm::Communicator&, comm::StoreClient&)>& fn) {
  LocalStore store;
  std::vector<std::thread> threads;
  std::exception_ptr first;
  std::mutex mu;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto client = store.client();
        auto comm = comm::Communicator::create(client, r, world, options);
        fn(*comm, *client);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

std::vector<Child> spawn_ranks(int world, const std::vector<std::string>& argv, const LocalStore& store,
                               const std::map<std::string, std::string>& extra_env) {
  auto logs = std::make_shared<TempDir>("ranks");
  static int run = 0;
  std::string run_id = "test-" + std::to_string(getpid()) + "-" + std::to_string(run++);
  std::vector<Child> children;
  for (int r = 0; r < world; ++r) {
    std::map<std::string, std::string> env = rank_environment(r, world, store);
    env["LOCKSTEP_RUN_ID"] = run_id;
    for (const auto& [k, v] : extra_env) env[k] = v;
    std::vector<std::string> env_strings = environment_with(env), args = argv;
    std::vector<char*> envp = c_strings(env_strings), argp = c_strings(args);
    Child child;
    child.stdout_path = *logs / ("rank" + std::to_string(r) + ".log");
    child.logs = logs;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, child.stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                     0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    int rc = posix_spawn(&child.pid, argp[0], &actions, nullptr, argp.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) throw std::runtime_error("cannot spawn " + argv[0]);
    children.push_back(child);
  }
  return children;
}

int wait_child(const Child& child, double timeout_seconds) {
  // A pidfd becomes readable when the process exits: a real wait with a deadline.
  int pidfd = static_cast<int>(syscall(SYS_pidfd_open, child.pid, 0));
  if (pidfd < 0) throw std::runtime_error("pidfd_open failed for child " + std::to_string(child.pid));
  pollfd p{pidfd, POLLIN, 0};
  int ready = poll(&p, 1, static_cast<int>(timeout_seconds * 1000));
  close(pidfd);
  int status = 0;
  if (ready <= 0) {
    kill(child.pid, SIGKILL);
    waitpid(child.pid, &status, 0);
    throw std::runtime_error("child " + std::to_string(child.pid) + " did not exit within " +
                             std::to_string(timeout_seconds) + " s; output:\n" +
                             read_file(child.stdout_path));
  }
  waitpid(child.pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

Process::Process(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env) {
  std::vector<std::string> env_strings = environment_with(env), args = argv;
  std::vector<char*> envp = c_strings(env_strings), argp = c_strings(args);
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 2);
  int rc = posix_spawn(&pid_, argp[0], &actions, nullptr, argp.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  fd_ = fds[0];
  if (rc != 0) throw std::runtime_error("cannot spawn " + argv[0]);
}

Process::~Process() {
  if (exit_code_ < 0 && pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (fd_ >= 0) close(fd_);
}

bool Process::read_some(int timeout_ms) {
  if (fd_ < 0) return false;
  pollfd p{fd_, POLLIN, 0};
  if (poll(&p, 1, timeout_ms) <= 0) return true;
  char buf[4096];
  ssize_t n = read(fd_, buf, sizeof buf);
  if (n <= 0) {
    close(fd_);
    fd_ = -1;
    return false;
  }
  output_.append(buf, static_cast<std::size_t>(n));
  return true;
}

bool Process::read_until(const std::string& text, double timeout_seconds, int times) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
  while (count_of(output_, text) < static_cast<std::size_t>(times)) {
    auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0 || !read_some(static_cast<int>(left.count()))) return false;
  }
  return true;
}

int Process::wait(double timeout_seconds) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
  while (fd_ >= 0) {
    auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      kill(pid_, SIGKILL);
      throw std::runtime_error("process did not finish within " + std::to_string(timeout_seconds) +
                               " s; output so far:\n" + output_);
    }
    read_some(static_cast<int>(left.count()));
  }
  int status = 0;
  waitpid(pid_, &status, 0);
  exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return exit_code_;
}

double train_begin_field(const std::string& metrics_path, const std::string& key) {
  std::ifstream in(metrics_path);
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.value("event", "") == "train_begin") return j.contains(key) ? j[key].get<double>() : -1;
  }
  return -1;
}

std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    std::getline(stat, line);
    const auto close = line.rfind(')');  // the command's name may hold spaces and parentheses
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 2));
    char state = 0;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid == parent) out.push_back(pid_t(std::stoi(name)));
  }
  return out;
}

std::size_t count_of(const std::string& haystack, const std::string& needle) {
  std::size_t n = 0;
  for (auto at = haystack.find(needle); at != std::string::npos;
       at = haystack.find(needle, at + needle.size()))
    ++n;
  return n;
}

std::uint64_t test_seed() {
  const char* given = std::getenv("LOCKSTEP_TEST_SEED");
  const std::uint64_t seed = given ? std::stoull(given) : (std::uint64_t(std::random_device{}()) << 32) | std::random_device{}();
  std::printf("LOCKSTEP_TEST_SEED=%llu\n", static_cast<unsigned long long>(seed));
  return seed;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string helper_path(const std::string& name) {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  std::string self(buf, n > 0 ? static_cast<std::size_t>(n) : 0);
  return self.substr(0, self.rfind('/') + 1) + name;
}

std::vector<std::string> shm_segments(int owner_pid) {
  const std::string prefix = owner_pid ? "lockstep-" + std::to_string(owner_pid) + "-" : "lockstep-";
  std::vector<std::string> out;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) {
      std::string name = e->d_name;
      if (name.rfind(prefix, 0) == 0) out.push_back(name);
    }
    closedir(d);
  }
  return out;
}

ShmWatch::ShmWatch() : before_(shm_segments()) {
  std::sort(before_.begin(), before_.end());
  for (const auto& name : before_) {
    const int maker = std::atoi(name.c_str() + std::string("lockstep-").size());
    const bool runs = maker > 0 && ::kill(maker, 0) == 0;
    std::fprintf(stderr, "/dev/shm already holds %s (its maker, pid %d, %s)\n", name.c_str(), maker,
                 runs ? "still runs" : "is gone: it leaked");
  }
}

std::vector<std::string> ShmWatch::added() const {
  std::vector<std::string> now = shm_segments(), out;
  std::sort(now.begin(), now.end());
  std::set_difference(now.begin(), now.end(), before_.begin(), before_.end(), std::back_inserter(out));
  return out;
}

}  // namespace lockstep::testing
