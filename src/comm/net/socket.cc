#include "socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "lockstep/error.h"

namespace lockstep::comm::net {

void keep_alive(int fd, int idle_seconds) {
  const int on = 1, idle = std::max(1, idle_seconds), interval = std::max(1, idle / 2), count = 3;
  const unsigned user_timeout_ms = static_cast<unsigned>((idle + interval * count) * 1000);
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof user_timeout_ms);
}

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = other.release();
  }
  return *this;
}

int Socket::release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

void Socket::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void Socket::set_no_delay() {
  const int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

void Socket::set_non_blocking(bool on) {
  const int flags = ::fcntl(fd_, F_GETFL);
  ::fcntl(fd_, F_SETFL, on ? flags | O_NONBLOCK : flags & ~O_NONBLOCK);
}

void Socket::set_blocking_timeouts(Seconds timeout) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(std::max(1.0, timeout.count()));
  ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
}

int Socket::local_port() const {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  if (::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return -1;
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
}

namespace {

int socket_flags(bool non_blocking) {
  return SOCK_STREAM | SOCK_CLOEXEC | (non_blocking ? SOCK_NONBLOCK : 0);
}

// "1.2.3.4:5" or "[::1]:5".
std::string address_text(const sockaddr* addr, socklen_t len) {
  char host[NI_MAXHOST] = "?", port[NI_MAXSERV] = "?";
  ::getnameinfo(addr, len, host, sizeof host, port, sizeof port, NI_NUMERICHOST | NI_NUMERICSERV);
  const std::string h = host;
  return (h.find(':') != std::string::npos ? "[" + h + "]" : h) + ":" + port;
}

// Waits until `fd` is ready for `events`; false when the deadline passed first.
bool wait_for(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int ready = ::poll(&p, 1, remaining_ms(deadline));
    if (ready > 0) return true;
    if (ready == 0) return false;
    if (errno != EINTR) return true;  // the next call reports the socket's error
  }
}

}  // namespace

int finish_connect(int fd, Clock::time_point deadline) {
  if (!wait_for(fd, POLLOUT, deadline)) {  // a signal on the way is waited through, not a timeout
    errno = ETIMEDOUT;
    return -1;
  }
  int err = 0;
  socklen_t len = sizeof err;
  ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
  errno = err;
  return err == 0 ? 0 : -1;
}

Socket listen_on(int family, const char* host, int port, const ListenOptions& options, std::string& gai_error) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = family;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICHOST | AI_NUMERICSERV;
  if (int rc = ::getaddrinfo(host, std::to_string(port).c_str(), &hints, &res); rc != 0 || res == nullptr) {
    gai_error = rc != 0 ? gai_strerror(rc) : "no address";
    errno = EINVAL;
    return Socket();
  }
  Socket s(::socket(res->ai_family, socket_flags(options.non_blocking), 0));
  const int one = 1, zero = 0;
  if (s && options.reuse_address) ::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (s && options.dual_stack) ::setsockopt(s.fd(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
  if (s && (::bind(s.fd(), res->ai_addr, res->ai_addrlen) != 0 || ::listen(s.fd(), options.backlog) != 0)) {
    const int err = errno;
    s.close();
    errno = err;
  }
  ::freeaddrinfo(res);
  return s;
}

Socket accept_from(const Socket& listener, bool non_blocking, std::string* peer) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  Socket s(::accept4(listener.fd(), reinterpret_cast<sockaddr*>(&addr), &len,
                     SOCK_CLOEXEC | (non_blocking ? SOCK_NONBLOCK : 0)));
  if (s && peer) *peer = address_text(reinterpret_cast<sockaddr*>(&addr), len);
  return s;
}

Connected connect_to(const std::string& host, const std::string& port, Clock::time_point deadline,
                     std::chrono::milliseconds attempt_cap, bool numeric) {
  Connected out;
  const std::int64_t cap_ms = std::clamp<std::int64_t>(attempt_cap.count(), 0, 1 << 30);
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (numeric) hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  if (int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &res); rc != 0 || res == nullptr) {
    out.error = rc != 0 ? gai_strerror(rc) : "no address";
    out.unresolved = true;
    return out;
  }
  for (addrinfo* ai = res; ai != nullptr && !out.socket; ai = ai->ai_next) {
    Socket s(::socket(ai->ai_family, socket_flags(true), 0));
    if (!s) {
      out.error = std::strerror(errno);
      continue;
    }
    int c = ::connect(s.fd(), ai->ai_addr, ai->ai_addrlen);
    if (c != 0 && errno == EINPROGRESS)
      c = finish_connect(s.fd(), std::min(deadline, Clock::now() + std::chrono::milliseconds(cap_ms)));
    if (c == 0)
      out.socket = std::move(s);
    else
      out.error = std::strerror(errno);
  }
  ::freeaddrinfo(res);
  if (out.socket) out.socket.set_no_delay();
  return out;
}

int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<std::int64_t>(left, 0, 1 << 30));
}

Io send_all(int fd, const void* data, std::size_t n, Clock::time_point deadline, std::size_t* sent) {
  const char* c = static_cast<const char*>(data);
  if (sent) *sent = 0;
  while (n > 0) {
    const ssize_t k = ::send(fd, c, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      c += k;
      n -= static_cast<std::size_t>(k);
      if (sent) *sent += static_cast<std::size_t>(k);
    } else if (k < 0 && (errno == EAGAIN || errno == EINTR)) {
      if (!wait_for(fd, POLLOUT, deadline)) return Io::timed_out;
    } else {
      return Io::failed;
    }
  }
  return Io::done;
}

Io send_all(int fd, const void* data, std::size_t n) {
  const char* c = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::send(fd, c, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return Io::timed_out;  // SO_SNDTIMEO
    if (k <= 0) return Io::failed;
    c += k;
    n -= static_cast<std::size_t>(k);
  }
  return Io::done;
}

Io send_two(int fd, const void* header, std::size_t header_bytes, const void* payload, std::size_t n) {
  iovec parts[2] = {{const_cast<void*>(header), header_bytes}, {const_cast<void*>(payload), n}};
  msghdr msg{};
  msg.msg_iov = parts;
  msg.msg_iovlen = n > 0 ? 2 : 1;
  ssize_t k;
  do {
    k = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
  } while (k < 0 && errno == EINTR);
  if (k < 0) return errno == EAGAIN || errno == EWOULDBLOCK ? Io::timed_out : Io::failed;
  const auto sent = static_cast<std::size_t>(k);
  if (sent < header_bytes) {
    const Io rest = send_all(fd, static_cast<const char*>(header) + sent, header_bytes - sent);
    return rest == Io::done ? send_all(fd, payload, n) : rest;
  }
  return send_all(fd, static_cast<const char*>(payload) + (sent - header_bytes), n - (sent - header_bytes));
}

Io recv_all(int fd, void* out, std::size_t n, Clock::time_point deadline) {
  char* c = static_cast<char*>(out);
  while (n > 0) {
    if (!wait_for(fd, POLLIN, deadline)) return Io::timed_out;
    const ssize_t k = ::recv(fd, c, n, MSG_DONTWAIT);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (k == 0) return Io::closed;
    if (k < 0) return Io::failed;
    c += k;
    n -= static_cast<std::size_t>(k);
  }
  return Io::done;
}

Io recv_all(int fd, void* out, std::size_t n, bool* at_boundary) {
  char* c = static_cast<char*>(out);
  const std::size_t want = n;
  if (at_boundary) *at_boundary = false;
  while (n > 0) {
    const ssize_t k = ::recv(fd, c, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k == 0) {
      if (at_boundary) *at_boundary = n == want;
      return Io::closed;
    }
    if (k < 0) return errno == EAGAIN || errno == EWOULDBLOCK ? Io::timed_out : Io::failed;
    c += k;
    n -= static_cast<std::size_t>(k);
  }
  return Io::done;
}

int free_port() {
  std::string unused;
  Socket probe = listen_on(AF_INET, nullptr, 0, ListenOptions{}, unused);
  const int port = probe ? probe.local_port() : -1;
  if (port <= 0) throw SystemError("cannot find a free TCP port: " + std::string(std::strerror(errno)));
  return port;
}

}  // namespace lockstep::comm::net
