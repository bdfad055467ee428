#include "local_spawn.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <map>

#include "lockstep/comm/store.h"

extern char** environ;

namespace lockstep::tools {

int run_local_ranks(int nproc, const std::vector<std::string>& argv) {
  std::string token = comm::random_token();
  comm::StoreServer server(comm::StoreServerOptions{"127.0.0.1", 0, token});
  std::vector<pid_t> pids;
  for (int r = 0; r < nproc; ++r) {
    std::map<std::string, std::string> env;
    for (char** e = environ; *e; ++e) {
      std::string kv(*e);
      auto eq = kv.find('=');
      if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    env["RANK"] = env["LOCAL_RANK"] = std::to_string(r);
    env["WORLD_SIZE"] = env["LOCAL_WORLD_SIZE"] = std::to_string(nproc);
    env["MASTER_ADDR"] = "127.0.0.1";
    env["LOCKSTEP_STORE_ADDR"] = "127.0.0.1:" + std::to_string(server.port());
    env["LOCKSTEP_TOKEN"] = token;
    env["LOCKSTEP_RUN_ID"] = "local-" + std::to_string(getpid());
    std::vector<std::string> env_strings;
    for (auto& [k, v] : env) env_strings.push_back(k + "=" + v);
    std::vector<char*> envp, args;
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> argv_copy = argv;
    for (auto& s : argv_copy) args.push_back(s.data());
    args.push_back(nullptr);
    pid_t pid = 0;
    int rc = posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, args.data(), envp.data());
    if (rc != 0) {
      std::fprintf(stderr, "lockstep: cannot start rank %d: %s\n", r, std::strerror(rc));
      for (pid_t p : pids) kill(p, SIGKILL);
      return 1;
    }
    pids.push_back(pid);
  }
  int first_failure = 0;
  std::size_t left = pids.size();
  while (left > 0) {
    int status = 0;
    pid_t pid = waitpid(-1, &status, 0);
    if (pid < 0) break;
    --left;
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (code != 0 && first_failure == 0) {
      first_failure = code;
      for (std::size_t r = 0; r < pids.size(); ++r) {
        if (pids[r] == pid)
          std::fprintf(stderr, "lockstep: rank %zu failed (exit %d); stopping the others\n", r, code);
      }
      for (pid_t p : pids)
        if (p != pid) kill(p, SIGTERM);
    }
  }
  return first_failure;
}

}  // namespace lockstep::tools
