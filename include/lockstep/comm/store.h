// The rendezvous store: a small authenticated TCP key-value server and its client.
//
// One StoreServer per job (hosted by the launcher, or by rank 0 when started without one)
// holds byte-string values under string keys. Clients set, get, add to counters,
// compare-and-set, wait for keys with a deadline, delete and count keys. Every connection first
// proves, by HMAC-SHA256 challenge-response in both directions, that it holds the run's secret
// token; the token itself never crosses the wire. The wire format is in docs/store-protocol.md.
//
// Threading: StoreServer runs one event-loop thread and is safe to stop from any thread.
// A StoreClient is safe to share between threads (requests are serialised on one connection);
// for parallel waits open one client per thread.
//
// Identity: every StoreServer object has a random instance id, sent in the authenticated
// handshake. A client is bound to the instance it first reached: the keys it set live there.
//
// Failure: a client reconnects and retries transient connection errors until the call's
// deadline (Add is not resent once its request left, since it is not idempotent). A reconnect
// that reaches another instance on the same address (the store restarted, or one job's store
// closed and the next one's took its port) is a StoreReplacedError at once, never a silent
// carry-on against keys that are not there. A refused token is an AuthError at once; a passed
// deadline a TimeoutError naming the keys.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/comm/types.h"

namespace lockstep::comm {

struct StoreServerOptions {
  // Numeric address to bind: "0.0.0.0" (every IPv4 address), "127.0.0.1", "::1", an
  // interface's address, or "*" (every address, IPv6 and IPv4 alike).
  std::string host = "0.0.0.0";
  int port = 0;       // 0: let the kernel pick a free port (see port())
  std::string token;  // the run's secret; empty is allowed only for tests
  std::size_t max_message_bytes = 64u << 20;
  int listen_fd = -1;  // >= 0: serve this socket, already bound and listening (host/port unused)
};

class StoreServer {
 public:
  explicit StoreServer(StoreServerOptions options);
  ~StoreServer();  // stops the loop and closes every connection
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  int port() const;
  // This server object's identity (hex), which clients learn in the handshake.
  std::string instance_id() const;
  // Connections refused so far (bad token, malformed or oversized message); for tests.
  std::uint64_t refused_connections() const;
  void stop();
  // Blocks until at least `n` WAIT requests are parked (their keys missing), or `timeout`
  // passes (false). For tests that must set a key only once a client waits for it.
  bool await_waiting(std::size_t n, Seconds timeout);

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

struct StoreClientOptions {
  std::string host = "127.0.0.1";
  int port = 0;
  std::string token;
  // Deadline for every call (connect, retries and the reply), unless the call takes one.
  Seconds timeout{300};
};

class StoreClient {
 public:
  // Connects (retrying until options.timeout while the server is not up yet) and
  // authenticates. Throws AuthError on a wrong token, TimeoutError when nobody answers.
  explicit StoreClient(StoreClientOptions options);
  ~StoreClient();
  StoreClient(const StoreClient&) = delete;
  StoreClient& operator=(const StoreClient&) = delete;

  void set(const std::string& key, const std::string& value);
  void set(const std::string& key, const std::string& value, Seconds timeout);
  // Like set, but the server deletes the key when this client's connection closes: other
  // ranks learn that this process died (its sockets close with it) by the key's absence.
  void set_ephemeral(const std::string& key, const std::string& value);
  // Waits until the key exists (up to the timeout), then returns its value.
  std::string get(const std::string& key);
  std::string get(const std::string& key, Seconds timeout);
  // Returns the value if present now, without waiting.
  std::optional<std::string> try_get(const std::string& key);
  std::optional<std::string> try_get(const std::string& key, Seconds timeout);
  // Adds delta to the decimal integer under key (absent = 0) and returns the new value.
  std::int64_t add(const std::string& key, std::int64_t delta);
  // Sets key to desired if its value equals expected (absent key matches an empty expected
  // string). Returns the value held after the call.
  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired);
  // Blocks until every key exists; TimeoutError names the missing ones.
  void wait(const std::vector<std::string>& keys);
  void wait(const std::vector<std::string>& keys, Seconds timeout);
  bool remove(const std::string& key);
  std::int64_t num_keys();

  const StoreClientOptions& options() const { return options_; }
  // The instance (hex) this client is bound to: the one its first connection reached.
  std::string instance_id() const;
  // Requests this client has sent so far (retries included): what a test or benchmark reads to
  // show that a code path costs the store nothing.
  std::uint64_t requests() const { return requests_.load(); }
  // The deadline for later calls that take none (e.g. shorter once a job is up).
  void set_timeout(Seconds timeout);

 private:
  struct Reply;
  Reply call(const std::string& request, Clock::time_point deadline, bool idempotent);
  // One WAIT request: the keys still missing after `timeout` (quoted, comma-separated), or nullopt.
  std::optional<std::string> wait_once(const std::vector<std::string>& keys, Seconds timeout);
  void connect_until(Clock::time_point deadline);
  void bind_to(const std::string& instance, int fd);
  void close_socket();

  StoreClientOptions options_;
  mutable std::mutex mu_;
  int fd_ = -1;
  std::string instance_;  // raw bytes; empty until the first handshake
  std::atomic<std::uint64_t> requests_{0};
};

// While one lives, the waits its thread makes on a StoreClient (wait, get) ask `gone` between
// slices of `slice` and fail with PeerError(what it said) as soon as it names someone: for a
// creation among workers whose liveness the caller can see (an elastic membership building its
// communicator), which must fail within a slice of a member's death, not at the wait's timeout.
// `gone` may use a store itself (its own waits are not watched). Nests: the innermost watches.
class WaitWatch {
 public:
  WaitWatch(std::function<std::string()> gone, Seconds slice);
  ~WaitWatch();
  WaitWatch(const WaitWatch&) = delete;
  WaitWatch& operator=(const WaitWatch&) = delete;

  // The watch of the calling thread, or nullptr.
  static const WaitWatch* current();
  Seconds slice() const { return slice_; }
  // Who is gone ("" when nobody), asked with this watch set aside.
  std::string look() const;

 private:
  std::function<std::string()> gone_;
  Seconds slice_;
  const WaitWatch* outer_;
};

// Hex of 32 random bytes from the OS: a fresh run token.
std::string random_token();

}  // namespace lockstep::comm
