// Test helpers shared by every layer's tests: ranks as threads over an in-process store, ranks
// as real processes, and the reference data the conformance tests compare against.
#pragma once

#include <sys/types.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/comm/communicator.h"
#include "lockstep/comm/store.h"

namespace lockstep::testing {

// A store server on a free loopback port with a fresh token, and clients for it.
class LocalStore {
 public:
  LocalStore();
  std::shared_ptr<comm::StoreClient> client(double timeout_seconds = 30) const;
  int port() const { return server_->port(); }
  const std::string& token() const { return token_; }
  comm::StoreServer& server() { return *server_; }

 private:
  std::string token_;
  std::unique_ptr<comm::StoreServer> server_;
};

// Runs fn(rank) on `world` threads, each with its own communicator over one store; rethrows
// the first exception any rank threw (after all threads joined).
void run_ranks_as_threads(int world, const comm::CommOptions& options,
                          const std::function<void(comm::Communicator&)>& fn);
// As above, also handing each rank the store client its communicator uses.
void run_ranks_as_threads_with_store(int world, const comm::CommOptions& options,
                                     const std::function<void(comm::Communicator&, comm::StoreClient&)>& fn);

// A new, empty directory for one test, removed with everything in it when this goes away.
class TempDir {
 public:
  explicit TempDir(const std::string& name = "dir");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& child) const { return path_ + "/" + child; }

 private:
  std::string path_;
};

// A child process of the test, started with posix_spawn.
struct Child {
  pid_t pid = -1;
  std::string stdout_path;        // where its stdout+stderr went
  std::shared_ptr<TempDir> logs;  // holds stdout_path
};

// Starts `world` copies of `argv` as ranks of one job (RANK, WORLD_SIZE, LOCKSTEP_STORE_ADDR,
// LOCKSTEP_TOKEN set; `extra_env` added), output to files in a temp dir.
std::vector<Child> spawn_ranks(int world, const std::vector<std::string>& argv, const LocalStore& store,
                               const std::map<std::string, std::string>& extra_env = {});
// Waits for the child; returns the exit code, or 128 + signal. Fails the test after the deadline.
int wait_child(const Child& child, double timeout_seconds);
std::string read_file(const std::string& path);

// A child process whose stdout and stderr come back through one pipe, read as it runs.
class Process {
 public:
  // Starts argv[0] (a path) with the test's environment plus `env` (NAME=value overrides;
  // a value of "<unset>" removes the variable).
  explicit Process(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {});
  ~Process();  // kills the process if it still runs
  pid_t pid() const { return pid_; }
  // Reads output until it contains `text` `times` times; false if the process ended or the
  // deadline passed first.
  bool read_until(const std::string& text, double timeout_seconds, int times = 1);
  // Reads all output and waits for the exit; returns the exit code (128 + signal). Throws
  // after the deadline (the process is killed).
  int wait(double timeout_seconds);
  const std::string& output() const { return output_; }

 private:
  bool read_some(int timeout_ms);
  pid_t pid_ = -1;
  int fd_ = -1;
  std::string output_;
  int exit_code_ = -1;
};

std::size_t count_of(const std::string& haystack, const std::string& needle);

// The number `key` of the first train_begin record of a metrics.jsonl; -1 when there is none.
double train_begin_field(const std::string& metrics_path, const std::string& key);

// The processes `parent` started and that still run (a launcher's workers), from /proc.
std::vector<pid_t> children_of(pid_t parent);

// A randomised test's seed: LOCKSTEP_TEST_SEED when set (to replay a failure), else a fresh one;
// printed as LOCKSTEP_TEST_SEED=<seed> either way, so a failing run's log says how to replay it.
std::uint64_t test_seed();

// The path of a helper binary built next to the tests (e.g. "comm_worker").
std::string helper_path(const std::string& name);

// Lockstep shared-memory segments currently in /dev/shm: all, or those of communicators whose
// rank 0 ran in process owner_pid (their names carry it).
std::vector<std::string> shm_segments(int owner_pid = 0);

// What one test adds to the host's /dev/shm. The lockstep objects already there when it is made
// belong to something else (an earlier test, another job on the host): they are named on stderr,
// each with whether the process that made it still runs, so a leak is traced to its maker, and
// added() leaves them out.
class ShmWatch {
 public:
  ShmWatch();
  std::vector<std::string> added() const;  // the objects that appeared since, by name

 private:
  std::vector<std::string> before_;  // sorted
};

}  // namespace lockstep::testing
