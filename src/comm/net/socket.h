// TCP for everything lockstep itself sends between processes (the store, the point-to-point
// mailbox, the launcher's ports): one owned socket type, listening, connecting within a deadline,
// whole-buffer sends and receives, and the liveness options every long-lived connection sets.
// Gloo's and MPI's own connections are theirs; gloo_backend only adds keep_alive to them.
#pragma once

#include <cstddef>
#include <string>

#include "lockstep/base/clock.h"
#include "lockstep/comm/types.h"

namespace lockstep::comm::net {

// TCP keepalive and a user timeout: a peer that vanishes without closing (a network partition, a
// machine that lost power) makes every pending read and write fail within idle + 3 x idle/2
// seconds, instead of waiting forever.
void keep_alive(int fd, int idle_seconds);

// The store's connections: a partitioned client's ephemeral keys vanish within ~11 s.
inline constexpr int kStoreKeepAliveSeconds = 5;

// An open socket, closed when this goes away. Move-only.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() { close(); }
  Socket(Socket&& other) noexcept : fd_(other.release()) {}
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int fd() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  int release();  // the descriptor, now the caller's to close
  void close();

  void set_no_delay();                  // small messages leave at once (TCP_NODELAY)
  void set_non_blocking(bool on);
  void keep_alive(int idle_seconds) { net::keep_alive(fd_, idle_seconds); }
  void set_blocking_timeouts(Seconds timeout);  // a blocking send or recv fails after this long
  int local_port() const;

 private:
  int fd_ = -1;
};

struct ListenOptions {
  bool non_blocking = false;  // the listener (accept_from says for what it accepts)
  bool reuse_address = false;
  bool dual_stack = false;    // an IPv6 socket that takes IPv4 connections too
  int backlog = 256;
};

// A socket listening on the first address getaddrinfo gives for a numeric `host` (nullptr: every
// address of `family`) and `port` (0: the kernel picks). An empty Socket on failure, with errno
// set, and `gai_error` set when the address itself was unusable.
Socket listen_on(int family, const char* host, int port, const ListenOptions& options, std::string& gai_error);

// The next waiting connection (an empty Socket when none), non-blocking or not as asked (it does
// not follow the listener's mode); `peer` gets "1.2.3.4:5" or "[::1]:5" where it is given.
Socket accept_from(const Socket& listener, bool non_blocking, std::string* peer = nullptr);

struct Connected {
  Socket socket;      // empty when no address took the connection
  std::string error;  // then why (the last address tried: its socket's, connect's or the timeout's)
  bool unresolved = false;  // the host did not resolve at all: `error` is the resolver's
};

// A TCP connection to host:port, trying each address getaddrinfo gives in turn, each for at most
// `attempt_cap` and never past `deadline`; TCP_NODELAY set; left non-blocking. `numeric` refuses
// names.
Connected connect_to(const std::string& host, const std::string& port, Clock::time_point deadline,
                     std::chrono::milliseconds attempt_cap, bool numeric = false);

// How a whole-buffer transfer ended; errno tells more for `failed`.
enum class Io { done, timed_out, closed, failed };

// Waits for a non-blocking connect() that said EINPROGRESS to finish, at most until `deadline`,
// through any signal that interrupts the wait: 0, or -1 with errno set (ETIMEDOUT for the deadline).
int finish_connect(int fd, Clock::time_point deadline);

// Milliseconds left until `deadline`, for poll(): 0 once it passed.
int remaining_ms(Clock::time_point deadline);

// All `n` bytes, waiting for the socket (non-blocking or not) at most until `deadline`; `sent`
// (where given) counts the bytes that left, however it ended.
Io send_all(int fd, const void* data, std::size_t n, Clock::time_point deadline, std::size_t* sent = nullptr);
// All `n` bytes from a socket whose own timeouts bound each wait (set_blocking_timeouts).
Io send_all(int fd, const void* data, std::size_t n);
// `header` then `payload` in one system call where the kernel takes both, so that a small message
// is one segment and wakes the receiver once. Blocking, as send_all(fd, data, n).
Io send_two(int fd, const void* header, std::size_t header_bytes, const void* payload, std::size_t n);

// Exactly `n` bytes. `closed` is an end of stream before all came; `at_boundary` (where given) says
// whether it came before the first byte (a peer that closed between messages).
Io recv_all(int fd, void* out, std::size_t n, Clock::time_point deadline);
Io recv_all(int fd, void* out, std::size_t n, bool* at_boundary = nullptr);

// A TCP port no one listens on right now (the kernel's pick), for a program that binds it itself.
// SystemError when there is none.
int free_port();

}  // namespace lockstep::comm::net
