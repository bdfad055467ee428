// Which local address the network backends (gloo, and hier between machines) bind and
// publish to their peers.
//
// Hostnames are not used: in many containers and cloud VMs the hostname does not resolve (and
// Gloo 0.0~git2022 crashes on a name that does not resolve). By default the address is the one
// of the interface that routes to the job's store (the master): what the kernel would use to
// reach it, found with a connected UDP socket, which sends nothing. GLOO_SOCKET_IFNAME
// (PyTorch's name; the first of a comma-separated list) or LOCKSTEP_GLOO_IFACE (wins) name an
// interface instead. IPv6 when the master is IPv6.
#pragma once

#include <string>

namespace lockstep::comm {

struct BindAddress {
  std::string address;           // numeric, e.g. "10.0.0.2" or "fd00::2"
  std::string iface;             // its interface, e.g. "eth0" ("" if not found)
  std::string why;               // "the interface that routes to 10.0.0.1", "LOCKSTEP_GLOO_IFACE=eth1"
  std::string describe() const;  // "10.0.0.2 (eth0, the interface that routes to 10.0.0.1)"
};

// ConfigError naming the interface or host tried, and what exists, when there is none.
BindAddress choose_bind_address(const std::string& master_host);

// For a job with no master to route to (an mpi communicator made without a store): the named
// interface as above, else the first non-loopback interface with an IPv4 address, else loopback.
BindAddress choose_bind_address_without_master();

// The numeric address of interface `iface`, preferring `family` (AF_INET or AF_INET6); "" when
// it has none. For tests and messages.
std::string interface_address(const std::string& iface, int family);
std::string interface_names();  // "lo, eth0"

// A TCP port no one listens on right now (the kernel's pick), for a program that binds it itself
// (MASTER_PORT for PyTorch's TCPStore, say). SystemError when there is none.
int free_tcp_port();

}  // namespace lockstep::comm
