#include "oom.h"

#include <cstdio>
#include <fstream>
#include <sstream>

namespace lockstep::launch {
namespace {

std::string gib(double bytes) {
  char text[32];
  if (bytes < 1024.0 * 1024 * 1024)
    std::snprintf(text, sizeof text, "%.0f MiB", bytes / (1024.0 * 1024));
  else
    std::snprintf(text, sizeof text, "%.1f GiB", bytes / (1024.0 * 1024 * 1024));
  return text;
}

struct CgroupLimit {
  double bytes = 0;  // 0: none, or none it can read
  std::string path;  // a memory cgroup other than the root whose limit it cannot read
};

// The limit of this process's memory cgroup. Inside `ip netns exec`, which mounts a /sys of its
// own, the files are not there to read, but /proc still names the cgroup.
CgroupLimit cgroup_limit() {
  CgroupLimit found;
  std::ifstream self("/proc/self/cgroup");
  for (std::string line; std::getline(self, line);) {
    const auto a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    std::string file;
    if (controllers == "memory") file = "/sys/fs/cgroup/memory" + path + "/memory.limit_in_bytes";
    if (controllers.empty()) file = "/sys/fs/cgroup" + path + "/memory.max";
    if (file.empty()) continue;
    std::ifstream in(file);
    if (!in && path != "/") found.path = path;
    std::string value;
    if (!(in >> value) || value == "max") continue;
    const double bytes = std::stod(value);
    if (bytes > 0 && bytes < 1e18) found.bytes = bytes;  // v1 says "no limit" with a huge number
    if (found.bytes > 0) return found;
  }
  return found;
}

}  // namespace

std::int64_t oom_kills() {
  std::ifstream in("/proc/vmstat");
  std::string key;
  std::int64_t value = 0;
  while (in >> key >> value)
    if (key == "oom_kill") return value;
  return -1;
}

std::string memory_limit_text() {
  const CgroupLimit cgroup = cgroup_limit();
  if (cgroup.bytes > 0) return "its memory cgroup's limit of " + gib(cgroup.bytes);
  if (!cgroup.path.empty()) return "the limit of its memory cgroup " + cgroup.path + " (not readable from here)";
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kib = 0;
  while (in >> key >> kib) {
    if (key == "MemTotal:") return "the machine's " + gib(kib * 1024);
    in.ignore(64, '\n');
  }
  return "";
}

}  // namespace lockstep::launch
