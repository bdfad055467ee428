#include "lockstep/base/cpu_kernels.h"

#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

namespace lockstep {
namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// In the child: load the BLAS, write its kernel set's name to `fd`, and leave without running
// anything of the parent's (atexit handlers, buffered streams).
[[noreturn]] void report_core_and_exit(int fd) {
  ::unsetenv("OPENBLAS_CORETYPE");
  ::setenv("OPENBLAS_NUM_THREADS", "1", 1);  // no thread pool for a one-line question
  void* blas = ::dlopen("libblas.so.3", RTLD_NOW | RTLD_LOCAL);
  auto corename = blas ? reinterpret_cast<char* (*)()>(::dlsym(blas, "openblas_get_corename")) : nullptr;
  const char* name = corename ? corename() : "";
  const ssize_t written = ::write(fd, name, std::strlen(name));
  ::_exit(written >= 0 ? 0 : 1);
}

}  // namespace

std::string best_openblas_core(const std::string& cpu_flags) {
  std::set<std::string> flags;
  std::istringstream in(cpu_flags);
  for (std::string f; in >> f;) flags.insert(f);
  auto has = [&](const char* f) { return flags.count(f) > 0; };
  if (has("avx512f") && has("avx512bw") && has("avx512vl") && has("avx512dq")) return "SkylakeX";
  if (has("avx2") && has("fma")) return "Haswell";
  if (has("avx")) return "Sandybridge";
  return "";
}

std::string this_cpus_flags() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("flags", 0) == 0) return line.substr(line.find(':') + 1);
  }
  return "";
}

int openblas_core_level(const std::string& core) {
  const std::string c = lower(core);
  // OpenBLAS's x86-64 DYNAMIC_ARCH kernel sets, by the widest vector instructions they use.
  static const std::set<std::string> generic = {
      "katmai",     "coppermine", "northwood", "prescott", "banias",       "atom",      "core2", "penryn",
      "dunnington", "nehalem",    "athlon",    "opteron",  "opteron_sse3", "barcelona", "nano",  "bobcat"};
  static const std::set<std::string> avx = {"sandybridge", "bulldozer", "piledriver", "steamroller",
                                            "excavator"};
  static const std::set<std::string> avx2 = {"haswell", "zen"};
  static const std::set<std::string> avx512 = {"skylakex", "cooperlake", "sapphirerapids"};
  if (generic.count(c)) return 0;
  if (avx.count(c)) return 1;
  if (avx2.count(c)) return 2;
  if (avx512.count(c)) return 3;
  return -1;
}

bool openblas_core_below(const std::string& core, const std::string& best) {
  const int have = openblas_core_level(core), could = openblas_core_level(best);
  return have >= 0 && could > have;
}

std::string openblas_own_core() {
  int fds[2];
  if (::pipe(fds) != 0) return "";
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(fds[0]);
    report_core_and_exit(fds[1]);
  }
  ::close(fds[1]);
  std::string name;
  char buf[64];
  for (ssize_t n; child > 0 && (n = ::read(fds[0], buf, sizeof buf)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    name.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  if (child > 0) ::waitpid(child, &status, 0);
  return child > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0 ? name : "";
}

}  // namespace lockstep
