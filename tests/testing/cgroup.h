// A cgroup for a test's processes: a cpu quota or a memory limit (cgroup v1, or v2), removed when
// destroyed, after the processes in it are gone. Needs root; path() is empty where none can be
// made, and the test skips. Processes enter it before `ip netns exec`, which mounts a /sys of its own.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lockstep::testing {

class Cgroup {
 public:
  // At most `share_of_one_core` of a core (0: no limit), at the highest weight: a process in it
  // gets its share before the rest of a loaded host does.
  static Cgroup cpu(double share_of_one_core);
  static Cgroup memory(std::int64_t bytes);  // no swap either
  Cgroup(Cgroup&& other) noexcept;
  Cgroup(const Cgroup&) = delete;
  Cgroup& operator=(const Cgroup&) = delete;
  ~Cgroup();
  const std::string& path() const { return path_; }
  // argv run inside the cgroup.
  std::vector<std::string> around(const std::vector<std::string>& argv) const;

 private:
  Cgroup() = default;
  std::string path_;
};

}  // namespace lockstep::testing
