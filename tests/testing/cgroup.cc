#include "cgroup.h"

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>

namespace fs = std::filesystem;

namespace lockstep::testing {
namespace {

// A new cgroup under the v1 hierarchy of `controller` when there is one, else under v2's root.
std::string make(const std::string& controller, const std::string& v1_probe) {
  static std::atomic<int> count{0};
  const std::string name = "/lockstep-test-" + std::to_string(::getpid()) + "-" + std::to_string(count++);
  const std::string v1 = "/sys/fs/cgroup/" + controller, v2 = "/sys/fs/cgroup";
  std::error_code ec;
  if (fs::exists(v1 + "/" + v1_probe) && fs::create_directory(v1 + name, ec)) return v1 + name;
  if (fs::exists(v2 + "/cgroup.controllers") && fs::create_directory(v2 + name, ec)) return v2 + name;
  return "";
}

}  // namespace

Cgroup Cgroup::cpu(double share) {
  Cgroup g;
  g.path_ = make("cpu", "cpu.cfs_quota_us");
  const int quota = share > 0 ? static_cast<int>(share * 100000) : -1;
  if (fs::exists(g.path_ + "/cpu.cfs_quota_us")) {
    std::ofstream(g.path_ + "/cpu.cfs_period_us") << 100000;
    std::ofstream(g.path_ + "/cpu.cfs_quota_us") << quota;
    std::ofstream(g.path_ + "/cpu.shares") << 262144;  // the highest
  } else if (!g.path_.empty()) {
    std::ofstream(g.path_ + "/cpu.max") << (quota > 0 ? std::to_string(quota) : "max") << " 100000";
    std::ofstream(g.path_ + "/cpu.weight") << 10000;  // the highest
  }
  return g;
}

Cgroup Cgroup::memory(std::int64_t bytes) {
  Cgroup g;
  g.path_ = make("memory", "memory.limit_in_bytes");
  if (fs::exists(g.path_ + "/memory.limit_in_bytes")) {
    std::ofstream(g.path_ + "/memory.limit_in_bytes") << bytes;
    if (fs::exists(g.path_ + "/memory.memsw.limit_in_bytes"))
      std::ofstream(g.path_ + "/memory.memsw.limit_in_bytes") << bytes;
  } else if (!g.path_.empty()) {
    std::ofstream(g.path_ + "/memory.max") << bytes;
    std::ofstream(g.path_ + "/memory.swap.max") << 0;
  }
  return g;
}

Cgroup::Cgroup(Cgroup&& other) noexcept : path_(std::move(other.path_)) {
  other.path_.clear();
}

Cgroup::~Cgroup() {
  if (!path_.empty()) ::rmdir(path_.c_str());
}

std::vector<std::string> Cgroup::around(const std::vector<std::string>& argv) const {
  std::vector<std::string> out = {"/bin/sh", "-c", "echo $$ > " + path_ + "/cgroup.procs && exec \"$@\"", "sh"};
  out.insert(out.end(), argv.begin(), argv.end());
  return out;
}

}  // namespace lockstep::testing
