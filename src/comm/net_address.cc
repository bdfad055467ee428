#include "lockstep/comm/net_address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <set>

#include "lockstep/base/knobs.h"
#include "lockstep/error.h"
#include "net/socket.h"

namespace lockstep::comm {
namespace {

std::string numeric(const sockaddr* addr) {
  char host[NI_MAXHOST] = "";
  const socklen_t len = addr->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
  ::getnameinfo(addr, len, host, sizeof host, nullptr, 0, NI_NUMERICHOST);
  std::string h = host;
  return h.substr(0, h.find('%'));  // drop an IPv6 scope
}

// The interface holding `address`, or "".
std::string interface_of(const std::string& address) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string name;
  for (ifaddrs* i = list; i != nullptr && name.empty(); i = i->ifa_next)
    if (i->ifa_addr && (i->ifa_addr->sa_family == AF_INET || i->ifa_addr->sa_family == AF_INET6) &&
        numeric(i->ifa_addr) == address)
      name = i->ifa_name;
  ::freeifaddrs(list);
  return name;
}

// The family of the master's first address (AF_INET when it does not resolve: the store's own
// error will say so more precisely).
int family_of(const std::string& host) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_DGRAM;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return AF_INET;
  const int family = res->ai_family;
  ::freeaddrinfo(res);
  return family;
}

// The local address the kernel routes to `host` from: a UDP socket "connected" to it sends
// nothing, but getsockname() then tells the source address.
std::string route_source(const std::string& host) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_DGRAM;
  if (int rc = ::getaddrinfo(host.c_str(), "9", &hints, &res); rc != 0)
    throw ConfigError("cannot find which address to bind: the master '" + host + "' does not resolve (" +
                      gai_strerror(rc) +
                      "); give MASTER_ADDR (or --master-addr) as an IP address, or name the "
                      "interface with GLOO_SOCKET_IFNAME");
  std::string source, error = "no address";
  for (addrinfo* ai = res; ai != nullptr && source.empty(); ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0)
      source = numeric(reinterpret_cast<sockaddr*>(&local));
    else
      error = std::strerror(errno);
    ::close(fd);
  }
  ::freeaddrinfo(res);
  if (source.empty())
    throw ConfigError(
        "cannot find which address to bind: no route to the master " + host + " (" + error +
        "); check the network, or name the interface with GLOO_SOCKET_IFNAME (interfaces here: " +
        interface_names() + ")");
  return source;
}

// GLOO_SOCKET_IFNAME may list several interfaces (PyTorch uses them all); lockstep binds one.
std::string first_of_list(const std::string& list) {
  return list.substr(0, list.find(','));
}

}  // namespace

std::string interface_address(const std::string& iface, int family) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string other;
  std::string found;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (!i->ifa_addr || iface != i->ifa_name) continue;
    const int f = i->ifa_addr->sa_family;
    if (f != AF_INET && f != AF_INET6) continue;
    const std::string a = numeric(i->ifa_addr);
    if (f == AF_INET6 && a.rfind("fe80", 0) == 0) continue;  // link-local needs a scope: skip
    if (f == family && found.empty()) found = a;
    if (f != family && other.empty()) other = a;
  }
  ::freeifaddrs(list);
  return found.empty() ? other : found;
}

std::string interface_names() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "?";
  std::set<std::string> names;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) names.insert(i->ifa_name);
  ::freeifaddrs(list);
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

std::string BindAddress::describe() const {
  return address + " (" + (iface.empty() ? "" : iface + ", ") + why + ")";
}

BindAddress choose_bind_address(const std::string& master_host) {
  BindAddress b;
  const knobs::Knob* named = knobs::is_set(knobs::kGlooIface)          ? &knobs::kGlooIface
                             : knobs::is_set(knobs::kGlooSocketIfname) ? &knobs::kGlooSocketIfname
                                                                       : nullptr;
  if (named) {
    b.iface = first_of_list(knobs::get(*named).value_or(""));
    b.why = std::string(named->name) + "=" + b.iface;
    b.address = interface_address(b.iface, family_of(master_host));
    if (b.address.empty())
      throw ConfigError(
          std::string(named->name) + " names interface '" + b.iface +
          "', which does not exist here or has no usable address (interfaces here: " + interface_names() +
          "); unset it to bind the interface that routes to the master " + master_host);
    return b;
  }
  b.address = route_source(master_host);
  b.iface = interface_of(b.address);
  b.why = "the interface that routes to " + master_host;
  return b;
}

BindAddress choose_bind_address_without_master() {
  if (knobs::is_set(knobs::kGlooIface) || knobs::is_set(knobs::kGlooSocketIfname)) return choose_bind_address("127.0.0.1");
  BindAddress b{"127.0.0.1", "lo", "no other interface has an IPv4 address"};
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return b;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || (i->ifa_flags & IFF_LOOPBACK) || !(i->ifa_flags & IFF_UP))
      continue;
    b = {numeric(i->ifa_addr), i->ifa_name, "the first interface with an IPv4 address; there is no master to route to"};
    break;
  }
  ::freeifaddrs(list);
  return b;
}

int free_tcp_port() {
  return net::free_port();
}

}  // namespace lockstep::comm
