#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>
#include <thread>

#include "lockstep/base/log.h"
#include "lockstep/comm/store.h"
#include "lockstep/error.h"
#include "net/socket.h"
#include "store/wire.h"

namespace lockstep::comm {
namespace {

using wire::Type;

// A socket-level failure that a reconnect may cure.
struct Transient {
  std::string what;
  bool request_sent;
};

void send_all(int fd, const std::string& data, Clock::time_point deadline) {
  std::size_t sent = 0;
  switch (net::send_all(fd, data.data(), data.size(), deadline, &sent)) {
    case net::Io::done: return;
    case net::Io::timed_out: throw TimeoutError("store: send timed out");
    default: throw Transient{std::string("send failed: ") + std::strerror(errno), sent > 0};
  }
}

void recv_exact(int fd, char* out, std::size_t n, Clock::time_point deadline) {
  switch (net::recv_all(fd, out, n, deadline)) {
    case net::Io::done: return;
    case net::Io::timed_out: throw TimeoutError("store: no reply before the deadline");
    case net::Io::closed: throw Transient{"the store closed the connection", true};
    default: throw Transient{std::string("recv failed: ") + std::strerror(errno), true};
  }
}

std::string recv_message(int fd, Clock::time_point deadline) {
  char len_buf[4];
  recv_exact(fd, len_buf, 4, deadline);
  std::uint32_t len = wire::read_length_prefix(len_buf);
  if (len == 0 || len > (256u << 20)) throw Error("store: reply with bad length " + std::to_string(len));
  std::string msg(len, '\0');
  recv_exact(fd, msg.data(), len, deadline);
  return msg;
}

}  // namespace

struct StoreClient::Reply {
  std::string message;
};

StoreClient::StoreClient(StoreClientOptions options) : options_(std::move(options)) {
  std::lock_guard<std::mutex> lock(mu_);
  connect_until(Clock::now() + std::chrono::duration_cast<Clock::duration>(options_.timeout));
}

StoreClient::~StoreClient() {
  close_socket();
}

void StoreClient::set_timeout(Seconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  options_.timeout = timeout;
}

void StoreClient::close_socket() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

namespace {

// A TCP connection to host:port (IPv4 or IPv6, each address getaddrinfo gives in turn), or -1
// with `error` set. ConfigError when the name does not resolve at all.
int tcp_connect(const std::string& host, int port, Clock::time_point deadline, std::string& error) {
  net::Connected c = net::connect_to(host, std::to_string(port), deadline, std::chrono::milliseconds(2000));
  if (c.unresolved)
    throw ConfigError("store: cannot resolve host '" + host + "': " + c.error +
                      " (check MASTER_ADDR / LOCKSTEP_STORE_ADDR; an IP address always works)");
  if (!c.socket) {
    error = c.error;
    return -1;
  }
  c.socket.keep_alive(net::kStoreKeepAliveSeconds);
  return c.socket.release();
}

// The handshake of docs/store-protocol.md: each side proves it holds the token (HMAC over
// both nonces); the token itself never crosses the wire. AuthError when either side fails.
// Returns the server's instance id, which its proof covers.
std::string authenticate(int fd, const std::string& token, const std::string& where, Clock::time_point deadline) {
  const std::string hello = recv_message(fd, deadline);
  wire::Reader r(hello);
  if (r.type() != Type::kHello || r.bytes(4) != std::string_view(wire::kMagic, 4))
    throw Error("store: " + where + " is not a lockstep store (bad greeting)");
  const std::uint16_t version = r.u16();
  if (version != wire::kVersion)
    throw Error("store: " + where + " speaks protocol version " + std::to_string(version) + ", this client " +
                std::to_string(wire::kVersion));
  const std::string server_nonce(r.bytes(wire::kNonceBytes));
  const std::string client_nonce = wire::random_bytes(wire::kNonceBytes);
  const auto mac = wire::handshake_mac(token, wire::kClientLabel, server_nonce, client_nonce);
  send_all(fd,
           wire::Writer(Type::kAuth)
               .bytes(client_nonce)
               .bytes(std::string_view(reinterpret_cast<const char*>(mac.data()), mac.size()))
               .frame(),
           deadline);
  const std::string answer = recv_message(fd, deadline);
  wire::Reader a(answer);
  const Type t = a.type();
  if (t == Type::kError)
    throw AuthError("store at " + where + " refused this process: " + a.str() +
                    ". Its LOCKSTEP_TOKEN differs from the run's: start every worker with the same token "
                    "(lockstep run sets it)");
  const std::string_view proof = t == Type::kAuthOk ? a.bytes(wire::kMacBytes) : std::string_view();
  const std::string instance(t == Type::kAuthOk ? a.bytes(wire::kInstanceBytes) : std::string_view());
  const auto want = wire::handshake_mac(token, wire::kServerLabel, server_nonce, client_nonce, instance);
  if (t != Type::kAuthOk || !wire::mac_equal(proof, want))
    throw AuthError(
        "store at " + where +
        " could not prove it holds this run's token: it belongs to another job, or LOCKSTEP_TOKEN is "
        "wrong here");
  return instance;
}

}  // namespace

// Connects and authenticates, retrying refused or reset connections with a capped backoff
// (the server may not be listening yet: workers often start before rank 0 or the launcher).
void StoreClient::connect_until(Clock::time_point deadline) {
  const std::string where = options_.host + ":" + std::to_string(options_.port);
  std::string last_error = "no attempt made";
  auto backoff = std::chrono::milliseconds(10);
  for (;;) {
    const int fd = tcp_connect(options_.host, options_.port, deadline, last_error);
    if (fd >= 0) {
      std::string instance;
      try {
        instance = authenticate(fd, options_.token, where, deadline);
      } catch (const Transient& t) {
        last_error = t.what;
        ::close(fd);
      } catch (...) {
        ::close(fd);
        throw;
      }
      if (!instance.empty()) {
        bind_to(instance, fd);
        return;
      }
    }
    if (Clock::now() + backoff >= deadline)
      throw TimeoutError("store: could not reach " + where + " within " +
                         log::seconds_text(options_.timeout.count()) + " (last error: " + last_error +
                         "). Is rank 0 or the launcher running, and are MASTER_ADDR/MASTER_PORT (or "
                         "LOCKSTEP_STORE_ADDR) right?");
    // Retry pacing while the server comes up; not synchronisation.
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }
}

// The first connection binds this client to its server's instance; a later one must reach the
// same instance, or the keys this client set (and waits on) are not there.
void StoreClient::bind_to(const std::string& instance, int fd) {
  if (instance_.empty() || instance_ == instance) {
    instance_ = instance;
    fd_ = fd;
    return;
  }
  ::close(fd);
  throw StoreReplacedError("store: the store at " + options_.host + ":" + std::to_string(options_.port) +
                           " is a new instance (" + wire::hex(instance).substr(0, 8) + ", this process joined " +
                           wire::hex(instance_).substr(0, 8) +
                           "): the one it joined stopped or restarted, and the keys it held are gone");
}

std::string StoreClient::instance_id() const {
  std::lock_guard<std::mutex> lock(mu_);
  return wire::hex(instance_);
}

StoreClient::Reply StoreClient::call(const std::string& request, Clock::time_point deadline,
                                     bool idempotent) {
  std::lock_guard<std::mutex> lock(mu_);
  for (;;) {
    if (fd_ < 0) connect_until(deadline);
    try {
      ++requests_;
      send_all(fd_, request, deadline);
      std::string msg = recv_message(fd_, deadline);
      if (!msg.empty() && static_cast<Type>(msg[0]) == Type::kError) {
        wire::Reader r(msg);
        r.type();
        throw Error("store: " + r.str());
      }
      return Reply{std::move(msg)};
    } catch (const Transient& t) {
      close_socket();
      if (t.request_sent && !idempotent)
        throw PeerError("store: connection lost during a non-idempotent request (" + t.what +
                        "); the store at " + options_.host + ":" + std::to_string(options_.port) +
                        " may have died");
      LOCKSTEP_LOG(debug, store) << t.what << "; reconnecting";
    } catch (const TimeoutError&) {
      close_socket();  // the reply may still arrive: this connection is out of step now
      throw;
    }
  }
}

namespace {
Clock::time_point deadline_after(Seconds s) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(s);
}
}  // namespace

void StoreClient::set(const std::string& key, const std::string& value) {
  set(key, value, options_.timeout);
}

void StoreClient::set(const std::string& key, const std::string& value, Seconds timeout) {
  call(wire::Writer(Type::kSet).str(key).str(value).frame(), deadline_after(timeout), true);
}

void StoreClient::set_ephemeral(const std::string& key, const std::string& value) {
  // Not retried over a new connection: the key would die with the old one.
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ < 0) connect_until(deadline_after(options_.timeout));
  auto request = wire::Writer(Type::kSetEphemeral).str(key).str(value).frame();
  auto deadline = deadline_after(options_.timeout);
  try {
    ++requests_;
    send_all(fd_, request, deadline);
    std::string msg = recv_message(fd_, deadline);
    if (msg.empty() || static_cast<Type>(msg[0]) != Type::kOk)
      throw Error("store: ephemeral set of '" + key + "' refused");
  } catch (const Transient& t) {
    close_socket();
    throw PeerError("store: connection lost while setting '" + key + "': " + t.what);
  }
}

std::optional<std::string> StoreClient::try_get(const std::string& key) {
  return try_get(key, options_.timeout);
}

std::optional<std::string> StoreClient::try_get(const std::string& key, Seconds timeout) {
  auto reply = call(wire::Writer(Type::kGet).str(key).frame(), deadline_after(timeout), true);
  wire::Reader r(reply.message);
  r.type();
  bool found = r.u8() != 0;
  std::string value = r.str();
  if (!found) return std::nullopt;
  return value;
}

std::string StoreClient::get(const std::string& key) {
  return get(key, options_.timeout);
}

std::string StoreClient::get(const std::string& key, Seconds timeout) {
  wait({key}, timeout);
  auto v = try_get(key);
  if (!v) throw Error("store: key '" + key + "' was deleted while being read");
  return *v;
}

std::int64_t StoreClient::add(const std::string& key, std::int64_t delta) {
  auto reply =
      call(wire::Writer(Type::kAdd).str(key).i64(delta).frame(), deadline_after(options_.timeout), false);
  wire::Reader r(reply.message);
  r.type();
  return r.i64();
}

std::string StoreClient::compare_set(const std::string& key, const std::string& expected,
                                     const std::string& desired) {
  auto reply = call(wire::Writer(Type::kCompareSet).str(key).str(expected).str(desired).frame(),
                    deadline_after(options_.timeout), true);
  wire::Reader r(reply.message);
  r.type();
  r.u8();
  return r.str();
}

void StoreClient::wait(const std::vector<std::string>& keys) {
  wait(keys, options_.timeout);
}

std::optional<std::string> StoreClient::wait_once(const std::vector<std::string>& keys, Seconds timeout) {
  auto deadline = deadline_after(timeout);
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count();
  wire::Writer w(Type::kWait);
  w.u32(static_cast<std::uint32_t>(std::clamp<std::int64_t>(ms, 0, UINT32_MAX)))
      .u32(static_cast<std::uint32_t>(keys.size()));
  for (const auto& k : keys) w.str(k);
  // The server answers at its own deadline; give the reply a moment to travel.
  auto reply = call(w.frame(), deadline + std::chrono::seconds(5), true);
  wire::Reader r(reply.message);
  if (r.type() != Type::kTimeout) return std::nullopt;
  std::uint32_t n = r.u32();
  std::ostringstream missing;
  for (std::uint32_t i = 0; i < n; ++i) missing << (i ? ", " : "") << "'" << r.str() << "'";
  return missing.str();
}

void StoreClient::wait(const std::vector<std::string>& keys, Seconds timeout) {
  const auto deadline = deadline_after(timeout);
  for (;;) {
    const WaitWatch* watch = WaitWatch::current();
    const Seconds left = std::max(Seconds(0), std::chrono::duration_cast<Seconds>(deadline - Clock::now()));
    const auto missing = wait_once(keys, watch ? std::min(left, watch->slice()) : left);
    if (!missing) return;
    if (!watch || Clock::now() >= deadline)
      throw TimeoutError("store: waited " + log::seconds_text(timeout.count()) +
                         " for keys that never appeared: " + *missing);
    if (const std::string gone = watch->look(); !gone.empty())
      throw PeerError(gone + " (this worker was waiting for " + *missing + ")");
  }
}

namespace {
thread_local const WaitWatch* t_watch = nullptr;
}  // namespace

WaitWatch::WaitWatch(std::function<std::string()> gone, Seconds slice)
    : gone_(std::move(gone)), slice_(slice), outer_(t_watch) {
  t_watch = this;
}

WaitWatch::~WaitWatch() {
  t_watch = outer_;
}

const WaitWatch* WaitWatch::current() {
  return t_watch;
}

std::string WaitWatch::look() const {
  struct SetAside {
    const WaitWatch* held = t_watch;
    SetAside() { t_watch = nullptr; }
    ~SetAside() { t_watch = held; }
  } aside;
  return gone_();
}

bool StoreClient::remove(const std::string& key) {
  auto reply = call(wire::Writer(Type::kDelete).str(key).frame(), deadline_after(options_.timeout), true);
  wire::Reader r(reply.message);
  r.type();
  return r.i64() != 0;
}

std::int64_t StoreClient::num_keys() {
  auto reply = call(wire::Writer(Type::kNumKeys).frame(), deadline_after(options_.timeout), true);
  wire::Reader r(reply.message);
  r.type();
  return r.i64();
}

}  // namespace lockstep::comm
