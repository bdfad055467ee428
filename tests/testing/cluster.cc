#include "cluster.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "testing.h"

namespace lockstep::testing {
namespace {

// Runs a command, returns its exit code and (merged) output.
int shell(const std::vector<std::string>& argv, std::string* output = nullptr) {
  Process p(argv);
  const int code = p.wait(60);
  if (output) *output = p.output();
  return code;
}

void must(const std::vector<std::string>& argv) {
  std::string out;
  if (shell(argv, &out) != 0) {
    std::string cmd;
    for (const auto& a : argv) cmd += a + " ";
    throw std::runtime_error("cluster set-up failed: " + cmd + "\n" + out);
  }
}

std::vector<std::string> list_netns() {
  std::string out;
  shell({"/sbin/ip", "netns", "list"}, &out);
  std::vector<std::string> names;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) names.push_back(line.substr(0, line.find(' ')));
  return names;
}

void delete_netns(const std::string& ns) {
  std::string pids;
  shell({"/sbin/ip", "netns", "pids", ns}, &pids);
  std::istringstream in(pids);
  for (int pid; in >> pid;) ::kill(pid, SIGKILL);
  shell({"/sbin/ip", "netns", "del", ns});
}

// Namespaces a killed test process left behind: "lst<pid>..." whose pid no longer runs.
void delete_orphans() {
  for (const auto& ns : list_netns()) {
    if (ns.rfind("lst", 0) != 0) continue;
    const int pid = std::atoi(ns.c_str() + 3);
    if (pid > 0 && pid != ::getpid() && ::kill(pid, 0) != 0) delete_netns(ns);
  }
}

}  // namespace

// Tries every kind of step the cluster takes, on a namespace of its own: where one cannot be
// done (no root, no iproute2, a chroot whose / is not a mount point, a kernel without veth,
// bridge or tbf), the tests skip with that step's error.
std::optional<std::string> VirtualCluster::unavailable() {
  if (::geteuid() != 0) return std::string("network namespaces need root");
  if (::access("/sbin/ip", X_OK) != 0) return std::string("iproute2 (ip, tc) is not installed");
  const std::string probe = "lstprobe" + std::to_string(::getpid());
  std::string out;
  if (shell({"/sbin/ip", "netns", "add", probe}, &out) != 0) return "cannot create a network namespace: " + out;
  std::optional<std::string> why;
  const std::vector<std::vector<std::string>> steps = {
      {"/sbin/ip", "-n", probe, "link", "add", "br0", "type", "bridge"},
      {"/sbin/ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1"},
      {"/sbin/tc", "-n", probe, "qdisc", "add", "dev", "v0", "root", "tbf", "rate", "1gbit", "burst", "512kb",
       "latency", "20ms"},
      {"/sbin/ip", "netns", "exec", probe, "/usr/bin/unshare", "--mount", "--uts", "--ipc", "--propagation",
       "private", "/bin/sh", "-c", "mount -t tmpfs tmpfs /dev/shm && hostname probe"}};
  for (const auto& step : steps) {
    if (shell(step, &out) == 0) continue;
    std::string cmd;
    for (const auto& a : step) cmd += a + " ";
    why = "cannot set up network namespaces here (`" + cmd + "` failed: " + out + ")";
    break;
  }
  shell({"/sbin/ip", "netns", "del", probe});
  return why;
}

std::vector<std::string> VirtualCluster::namespaces() {
  return list_netns();
}

VirtualCluster::VirtualCluster(Options options) : options_(std::move(options)) {
  delete_orphans();
  prefix_ = "lst" + std::to_string(::getpid());
  static int serial = 0;
  prefix_ += "c" + std::to_string(serial++);
  subnet_ = 10 + (::getpid() + serial) % 240;
  try {
    must({"/sbin/ip", "netns", "add", switch_netns()});
    made_.push_back(switch_netns());
    must({"/sbin/ip", "-n", switch_netns(), "link", "add", "br0", "type", "bridge"});
    must({"/sbin/ip", "-n", switch_netns(), "link", "set", "br0", "up"});
    for (int m = 0; m < options_.machines; ++m) {
      const std::string ns = netns(m), port = "p" + std::to_string(m);
      must({"/sbin/ip", "netns", "add", ns});
      made_.push_back(ns);
      // The pair is made inside the switch namespace, then one end moves to the machine.
      must({"/sbin/ip", "-n", switch_netns(), "link", "add", port, "type", "veth", "peer", "name", kInterface,
            "netns", ns});
      must({"/sbin/ip", "-n", switch_netns(), "link", "set", port, "master", "br0", "up"});
      must({"/sbin/ip", "-n", ns, "addr", "add", address(m) + "/24", "dev", kInterface});
      must({"/sbin/ip", "-n", ns, "link", "set", kInterface, "up"});
      must({"/sbin/ip", "-n", ns, "link", "set", "lo", "up"});
      if (!options_.rate.empty())
        must({"/sbin/tc", "-n", ns, "qdisc", "add", "dev", kInterface, "root", "tbf", "rate", options_.rate,
              "burst", "512kb", "latency", "20ms"});
    }
  } catch (...) {
    destroy();
    throw;
  }
}

VirtualCluster::~VirtualCluster() {
  destroy();
}

void VirtualCluster::destroy() {
  for (auto it = made_.rbegin(); it != made_.rend(); ++it) delete_netns(*it);
  made_.clear();
}

std::string VirtualCluster::netns(int machine) const {
  return prefix_ + "m" + std::to_string(machine);
}

std::string VirtualCluster::switch_netns() const {
  return prefix_ + "sw";
}

std::string VirtualCluster::address(int machine) const {
  return "10.201." + std::to_string(subnet_) + "." + std::to_string(machine + 1);
}

std::string VirtualCluster::hostname(int machine) const {
  return "node" + std::to_string(machine);
}

std::vector<std::string> VirtualCluster::on(int machine, const std::vector<std::string>& argv) const {
  std::vector<std::string> out = {
      "/sbin/ip",
      "netns",
      "exec",
      netns(machine),
      "/usr/bin/unshare",
      "--mount",
      "--uts",
      "--ipc",
      "--propagation",
      "private",
      "/bin/sh",
      "-c",
      "mount -t tmpfs -o size=1g tmpfs /dev/shm && hostname " + hostname(machine) + " && exec \"$@\"",
      "sh"};
  out.insert(out.end(), argv.begin(), argv.end());
  return out;
}

void VirtualCluster::set_link(int machine, bool up) {
  must({"/sbin/ip", "-n", netns(machine), "link", "set", kInterface, up ? "up" : "down"});
}

void VirtualCluster::set_rate(int machine, const std::string& rate) {
  must({"/sbin/tc", "-n", netns(machine), "qdisc", "replace", "dev", kInterface, "root", "tbf", "rate", rate,
        "burst", "512kb", "latency", "20ms"});
}

void VirtualCluster::kill_all(int machine) {
  std::string pids;
  shell({"/sbin/ip", "netns", "pids", netns(machine)}, &pids);
  std::istringstream in(pids);
  for (int pid; in >> pid;) ::kill(pid, SIGKILL);
}

int VirtualCluster::kill_named(int machine, const std::string& name) {
  std::string pids;
  shell({"/sbin/ip", "netns", "pids", netns(machine)}, &pids);
  std::istringstream in(pids);
  int killed = 0;
  for (int pid; in >> pid;) {
    std::ifstream comm("/proc/" + std::to_string(pid) + "/comm");
    std::string command;
    std::getline(comm, command);
    if (command.rfind(name, 0) == 0 && ::kill(pid, SIGKILL) == 0) ++killed;
  }
  return killed;
}

void VirtualCluster::power_off(int machine) {
  set_link(machine, false);
  const std::string ns = netns(machine);
  delete_netns(ns);
  made_.erase(std::remove(made_.begin(), made_.end(), ns), made_.end());
}

VirtualCluster::Counters VirtualCluster::counters(int machine) const {
  Counters c;
  std::string out;
  shell({"/sbin/ip", "-n", netns(machine), "-s", "-j", "link", "show", kInterface}, &out);
  // "stats64":{"rx":{"bytes":N,...},"tx":{"bytes":M,...}}
  auto number_after = [&](const std::string& key) -> std::uint64_t {
    auto at = out.find(key);
    if (at == std::string::npos) return 0;
    at = out.find("\"bytes\":", at);
    return at == std::string::npos ? 0 : std::strtoull(out.c_str() + at + 8, nullptr, 10);
  };
  c.rx_bytes = number_after("\"rx\":");
  c.tx_bytes = number_after("\"tx\":");
  return c;
}

}  // namespace lockstep::testing
