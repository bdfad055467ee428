// Machines for tests: Linux network namespaces, each with its own hostname and its own
// /dev/shm, joined by veth links to a bridge (in a namespace of its own), each link
// rate-limited with a token bucket (tc tbf) on the machine's side. Traffic goes only to
// addresses inside these namespaces. Needs root (ip, tc, unshare, mount); where they cannot be
// made, unavailable() says why and tests skip with that message.
//
// The destructor kills every process left in the namespaces and deletes them; a cluster left
// behind by a killed test process is deleted by the next one (names carry the creator's pid).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace lockstep::testing {

class VirtualCluster {
 public:
  struct Options {
    int machines = 2;
    std::string rate = "1gbit";  // each machine's egress; "" for no limit
  };
  // Why a cluster cannot be made here, or nullopt when it can.
  static std::optional<std::string> unavailable();

  explicit VirtualCluster(Options options);
  ~VirtualCluster();
  VirtualCluster(const VirtualCluster&) = delete;
  VirtualCluster& operator=(const VirtualCluster&) = delete;

  int machines() const { return options_.machines; }
  // The names of its network namespaces start with this.
  const std::string& prefix() const { return prefix_; }
  // The network namespaces that exist now (all, not only this cluster's).
  static std::vector<std::string> namespaces();
  std::string address(int machine) const;            // e.g. "10.201.7.1" (machine 0), ".2", ...
  std::string hostname(int machine) const;           // "node0", ... (unresolvable, as in many containers)
  static constexpr const char* kInterface = "eth0";  // each machine's link, inside its namespace

  // argv run on `machine`: in its network namespace, with a private mount, UTS and IPC
  // namespace, a fresh tmpfs on /dev/shm and its own hostname. Every process the command
  // starts shares that machine's /dev/shm.
  std::vector<std::string> on(int machine, const std::vector<std::string>& argv) const;

  // Takes a machine's link down (a partition: no packet passes, nothing is reset) or up.
  void set_link(int machine, bool up);
  // Limits what the machine sends to `rate` (a tc rate: "100mbit"), whatever it was made with.
  void set_rate(int machine, const std::string& rate);
  // SIGKILL to every process in the machine's namespace.
  void kill_all(int machine);
  // SIGKILL to the machine's processes whose command name (/proc/PID/comm) starts with `name`;
  // how many there were.
  int kill_named(int machine, const std::string& name);
  // As if the machine lost power: its link goes down first (no FIN or RST leaves it), then every
  // process in it dies and its namespace is deleted. The peers see only silence.
  void power_off(int machine);
  // Bytes the machine sent and received on its link since the cluster was made.
  struct Counters {
    std::uint64_t tx_bytes = 0, rx_bytes = 0;
  };
  Counters counters(int machine) const;

 private:
  std::string netns(int machine) const;
  std::string switch_netns() const;
  void destroy();

  Options options_;
  std::string prefix_;  // "lst<pid>"
  int subnet_ = 0;
  std::vector<std::string> made_;  // namespaces created so far
};

}  // namespace lockstep::testing
