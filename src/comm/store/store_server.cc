// StoreServer: one epoll event-loop thread serving every client of the job.
//
// Threading model: the constructor binds and listens, then starts the loop thread; from then
// on only that thread touches connections, keys and waiters. stop() (any thread) writes an
// eventfd that the loop polls, and joins it. No locks are needed on the hot state.
//
// Each connection moves through two states: kHandshake (server sent HELLO with its nonce and
// waits for AUTH) and kReady (requests are served in arrival order). A WAIT whose keys are
// missing parks a waiter, answered when the last key appears or its deadline passes; the loop's
// epoll timeout is the earliest waiter deadline. A connection that sends a malformed or
// oversized frame, or a wrong MAC, is told why and closed; the others are not affected.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>

#include "lockstep/base/log.h"
#include "lockstep/comm/store.h"
#include "lockstep/error.h"
#include "net/socket.h"
#include "store/wire.h"

namespace lockstep::comm {
namespace {

using wire::Type;

struct Conn {
  int fd = -1;
  std::string peer;
  bool ready = false;  // handshake done
  std::string server_nonce;
  std::string in;
  std::string out;
  bool closing = false;                // flush `out`, then close
  std::vector<std::string> ephemeral;  // keys deleted when this connection closes
};

struct Waiter {
  std::uint64_t conn_id;
  std::set<std::string> missing;
  Clock::time_point deadline;
};

std::string errno_text() {
  return std::strerror(errno);
}

net::Socket adopt_listener(int fd) {
  net::Socket s(fd);
  s.set_non_blocking(true);
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  return s;
}

// Binds and listens on host:port. host "*" is every address, IPv6 and IPv4 (one dual-stack
// socket), or every IPv4 address where the kernel has no IPv6; otherwise a numeric address of
// either family.
net::Socket open_listener(const StoreServerOptions& o) {
  std::string gai_error;
  net::ListenOptions listen{/*non_blocking=*/true, /*reuse_address=*/true, /*dual_stack=*/false, /*backlog=*/1024};
  net::Socket s;
  if (o.host == "*") {
    listen.dual_stack = true;
    s = net::listen_on(AF_INET6, nullptr, o.port, listen, gai_error);
    listen.dual_stack = false;
    if (!s && errno != EADDRINUSE) s = net::listen_on(AF_INET, nullptr, o.port, listen, gai_error);
  } else {
    s = net::listen_on(AF_UNSPEC, o.host.c_str(), o.port, listen, gai_error);
  }
  if (s) return s;
  const int err = errno;
  if (!gai_error.empty())
    throw ConfigError("store: cannot bind to '" + o.host + "': not a numeric address (" + gai_error +
                      "; use an address such as 0.0.0.0, 127.0.0.1, ::1, or * for every one)");
  throw ConfigError(
      "store: cannot listen on " + o.host + ":" + std::to_string(o.port) + ": " + std::strerror(err) +
      (err == EADDRINUSE ? " (another job uses this port: pick another MASTER_PORT, or 0 for a free one)"
                         : ""));
}

}  // namespace

class StoreServer::Impl {
 public:
  explicit Impl(StoreServerOptions options) : options_(std::move(options)) {
    listener_ = options_.listen_fd >= 0 ? adopt_listener(options_.listen_fd) : open_listener(options_);
    port_ = listener_.local_port();
    epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
    stop_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    add_fd(listener_.fd(), kListenId, EPOLLIN);
    add_fd(stop_fd_, kStopId, EPOLLIN);
    thread_ = std::thread([this] { loop(); });
  }

  ~Impl() {
    stop();
    for (auto& [id, c] : conns_) ::close(c.fd);
    ::close(stop_fd_);
    ::close(epoll_fd_);
  }

  void stop() {
    std::uint64_t one = 1;
    ssize_t ignored = ::write(stop_fd_, &one, sizeof one);
    (void)ignored;
    if (thread_.joinable()) thread_.join();
  }

  int port() const { return port_; }
  const std::string& instance() const { return instance_; }
  std::uint64_t refused() const { return refused_.load(); }

  bool await_parked(std::size_t n, Seconds timeout) {
    std::unique_lock<std::mutex> lock(parked_mu_);
    return parked_cv_.wait_for(lock, timeout, [&] { return parked_ >= n; });
  }

 private:
  static constexpr std::uint64_t kListenId = 0;
  static constexpr std::uint64_t kStopId = 1;

  void add_fd(int fd, std::uint64_t id, std::uint32_t events) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = id;
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
  }

  void loop() {
    epoll_event events[64];
    for (;;) {
      int timeout_ms = -1;
      if (!deadlines_.empty()) {
        auto wait = deadlines_.begin()->first - Clock::now();
        timeout_ms = static_cast<int>(
            std::max<std::int64_t>(0, std::chrono::ceil<std::chrono::milliseconds>(wait).count()));
      }
      int n = ::epoll_wait(epoll_fd_, events, 64, timeout_ms);
      if (n < 0 && errno != EINTR) {
        LOCKSTEP_LOG(error, store) << "epoll_wait failed: " << errno_text();
        return;
      }
      for (int i = 0; i < n; ++i) {
        std::uint64_t id = events[i].data.u64;
        if (id == kStopId) return;
        if (id == kListenId) {
          accept_all();
          continue;
        }
        auto it = conns_.find(id);
        if (it == conns_.end()) continue;
        if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) on_readable(id);
        if (conns_.count(id) && (events[i].events & EPOLLOUT)) flush(id);
      }
      expire_waiters();
    }
  }

  void accept_all() {
    for (;;) {
      std::string peer;
      net::Socket accepted = net::accept_from(listener_, /*non_blocking=*/true, &peer);
      if (!accepted) return;  // EAGAIN, or a transient error: the next event retries
      accepted.set_no_delay();
      accepted.keep_alive(net::kStoreKeepAliveSeconds);  // a partitioned client's ephemeral keys go too
      std::uint64_t id = next_id_++;
      const int fd = accepted.release();
      Conn c;
      c.fd = fd;
      c.peer = peer;
      c.server_nonce = wire::random_bytes(wire::kNonceBytes);
      c.out = wire::Writer(Type::kHello)
                  .bytes(std::string_view(wire::kMagic, 4))
                  .u16(wire::kVersion)
                  .bytes(c.server_nonce)
                  .frame();
      conns_.emplace(id, std::move(c));
      add_fd(fd, id, EPOLLIN);
      flush(id);
    }
  }

  // Handles every whole message that arrived; a client that sent its last requests and closed
  // its side still gets them answered before the connection closes.
  void on_readable(std::uint64_t id) {
    Conn* c = &conns_.at(id);
    if (c->closing) return;  // the rest of its replies are being flushed
    bool ended = false;
    char buf[65536];
    for (;;) {
      ssize_t n = ::read(c->fd, buf, sizeof buf);
      if (n > 0) {
        c->in.append(buf, static_cast<std::size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) break;
      if (n < 0) return close_conn(id);
      ended = true;
      break;
    }
    handle_messages(id);
    if (ended && conns_.count(id)) {
      conns_.at(id).closing = true;
      flush(id);  // closes once the replies are out
    }
  }

  void handle_messages(std::uint64_t id) {
    while (conns_.count(id)) {
      Conn* c = &conns_.at(id);
      if (c->closing || c->in.size() < 4) return;
      std::uint32_t len = wire::read_length_prefix(c->in.data());
      if (len == 0 || len > options_.max_message_bytes) {
        refuse(id, "message of " + std::to_string(len) + " bytes (limit " +
                       std::to_string(options_.max_message_bytes) + ")");
        return;
      }
      if (c->in.size() < 4 + static_cast<std::size_t>(len)) return;
      std::string msg = c->in.substr(4, len);
      c->in.erase(0, 4 + static_cast<std::size_t>(len));
      try {
        handle(id, msg);
      } catch (const Error& e) {
        if (conns_.count(id)) refuse(id, e.what());
        return;
      }
    }
  }

  // Tells the peer why, then closes after the reply is flushed.
  void refuse(std::uint64_t id, const std::string& why) {
    Conn& c = conns_.at(id);
    ++refused_;
    LOCKSTEP_LOG(warn, store) << "closing connection from " << c.peer << ": " << why;
    c.in.clear();
    c.out += wire::Writer(Type::kError).str(why).frame();
    c.closing = true;
    flush(id);
  }

  void reply(std::uint64_t id, const wire::Writer& w) {
    conns_.at(id).out += w.frame();
    flush(id);
  }

  void flush(std::uint64_t id) {
    Conn& c = conns_.at(id);
    while (!c.out.empty()) {
      ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (n > 0) {
        c.out.erase(0, static_cast<std::size_t>(n));
        continue;
      }
      if (errno == EAGAIN || errno == EINTR) {
        epoll_event ev{};
        ev.events = c.closing ? EPOLLOUT : EPOLLIN | EPOLLOUT;  // a closing peer's EOF would wake us forever
        ev.data.u64 = id;
        ::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, c.fd, &ev);
        return;
      }
      close_conn(id);
      return;
    }
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = id;
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, c.fd, &ev);
    if (c.closing) close_conn(id);
  }

  void close_conn(std::uint64_t id) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, it->second.fd, nullptr);
    ::close(it->second.fd);
    std::vector<std::string> ephemeral = std::move(it->second.ephemeral);
    conns_.erase(it);
    for (const auto& key : ephemeral) {
      auto owner = ephemeral_owner_.find(key);
      if (owner == ephemeral_owner_.end() || owner->second != id) continue;  // set again since
      ephemeral_owner_.erase(owner);
      kv_.erase(key);
    }
    for (auto w = waiters_.begin(); w != waiters_.end();) {
      if (w->second.conn_id == id)
        w = drop_waiter(w);
      else
        ++w;
    }
  }

  // The first message must prove the client holds the token; the reply proves the server does.
  void authenticate(std::uint64_t id, Type type, wire::Reader& r) {
    Conn& c = conns_.at(id);
    if (type != Type::kAuth)
      throw Error("expected AUTH, got message type " + std::to_string(static_cast<int>(type)));
    std::string client_nonce(r.bytes(wire::kNonceBytes));
    std::string_view mac = r.bytes(wire::kMacBytes);
    r.expect_end();
    auto want = wire::handshake_mac(options_.token, wire::kClientLabel, c.server_nonce, client_nonce);
    if (!wire::mac_equal(mac, want))
      throw AuthError("authentication failed: the client does not hold this run's token");
    auto proof = wire::handshake_mac(options_.token, wire::kServerLabel, c.server_nonce, client_nonce, instance_);
    c.ready = true;
    reply(id, wire::Writer(Type::kAuthOk)
                  .bytes(std::string_view(reinterpret_cast<const char*>(proof.data()), proof.size()))
                  .bytes(instance_));
  }

  void handle(std::uint64_t id, const std::string& msg) {
    wire::Reader r(msg);
    const Type type = r.type();
    if (!conns_.at(id).ready) return authenticate(id, type, r);
    switch (type) {
      case Type::kSet: return on_set(id, r, /*ephemeral=*/false);
      case Type::kSetEphemeral: return on_set(id, r, /*ephemeral=*/true);
      case Type::kGet: return on_get(id, r);
      case Type::kAdd: return on_add(id, r);
      case Type::kCompareSet: return on_compare_set(id, r);
      case Type::kWait: return on_wait(id, r);
      case Type::kDelete: {
        std::string key = r.str();
        r.expect_end();
        ephemeral_owner_.erase(key);
        return reply(id, wire::Writer(Type::kInt).i64(static_cast<std::int64_t>(kv_.erase(key))));
      }
      case Type::kNumKeys:
        r.expect_end();
        return reply(id, wire::Writer(Type::kInt).i64(static_cast<std::int64_t>(kv_.size())));
      default: throw Error("unknown message type " + std::to_string(static_cast<int>(type)));
    }
  }

  void on_set(std::uint64_t id, wire::Reader& r, bool ephemeral) {
    std::string key = r.str(), value = r.str();
    r.expect_end();
    // The last setter owns the key: a client that reconnected (after a partition) and set it
    // again keeps it when its old connection is finally closed.
    if (ephemeral) {
      conns_.at(id).ephemeral.push_back(key);
      ephemeral_owner_[key] = id;
    } else {
      ephemeral_owner_.erase(key);
    }
    put(key, std::move(value));
    reply(id, wire::Writer(Type::kOk));
  }

  void on_get(std::uint64_t id, wire::Reader& r) {
    std::string key = r.str();
    r.expect_end();
    auto it = kv_.find(key);
    wire::Writer w(Type::kValue);
    w.u8(it != kv_.end() ? 1 : 0).str(it != kv_.end() ? it->second : std::string());
    reply(id, w);
  }

  void on_add(std::uint64_t id, wire::Reader& r) {
    std::string key = r.str();
    std::int64_t delta = r.i64();
    r.expect_end();
    std::int64_t current = 0;
    if (auto it = kv_.find(key); it != kv_.end()) {
      char* end = nullptr;
      errno = 0;
      current = std::strtoll(it->second.c_str(), &end, 10);
      if (it->second.empty() || *end != '\0' || errno == ERANGE)
        return reply(
            id, wire::Writer(Type::kError).str("ADD on key '" + key + "' whose value is not a 64-bit integer"));
    }
    if (__builtin_add_overflow(current, delta, &current))
      return reply(id, wire::Writer(Type::kError).str("ADD on key '" + key + "' would overflow 64 bits"));
    put(key, std::to_string(current));
    reply(id, wire::Writer(Type::kInt).i64(current));
  }

  void on_compare_set(std::uint64_t id, wire::Reader& r) {
    std::string key = r.str(), expected = r.str(), desired = r.str();
    r.expect_end();
    auto it = kv_.find(key);
    std::string current = it != kv_.end() ? it->second : std::string();
    const bool matches = it != kv_.end() ? current == expected : expected.empty();
    if (matches) {
      put(key, desired);
      current = desired;
    }
    reply(id, wire::Writer(Type::kValue).u8(1).str(current));
  }

  // Answered at once when every key exists; otherwise parked until they do or the deadline.
  void on_wait(std::uint64_t id, wire::Reader& r) {
    const std::uint32_t timeout_ms = r.u32();
    const std::uint32_t n = r.u32();
    Waiter w;
    w.conn_id = id;
    for (std::uint32_t i = 0; i < n; ++i) {
      std::string key = r.str();
      if (!kv_.count(key)) w.missing.insert(std::move(key));
    }
    r.expect_end();
    if (w.missing.empty()) return reply(id, wire::Writer(Type::kOk));
    w.deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    const std::uint64_t wid = next_waiter_++;
    for (const auto& k : w.missing) waiting_on_[k].insert(wid);
    deadlines_.emplace(w.deadline, wid);
    waiters_.emplace(wid, std::move(w));
    publish_parked();
  }

  // For tests that need a WAIT to be parked before they set its key (StoreServer::await_waiting).
  void publish_parked() {
    {
      std::lock_guard<std::mutex> lock(parked_mu_);
      parked_ = waiters_.size();
    }
    parked_cv_.notify_all();
  }

  void put(const std::string& key, std::string value) {
    kv_[key] = std::move(value);
    auto it = waiting_on_.find(key);
    if (it == waiting_on_.end()) return;
    std::set<std::uint64_t> ids = std::move(it->second);
    waiting_on_.erase(it);
    for (std::uint64_t wid : ids) {
      auto w = waiters_.find(wid);
      if (w == waiters_.end()) continue;
      w->second.missing.erase(key);
      if (w->second.missing.empty()) {
        std::uint64_t conn = w->second.conn_id;
        drop_waiter(w);
        reply(conn, wire::Writer(Type::kOk));
      }
    }
  }

  std::map<std::uint64_t, Waiter>::iterator drop_waiter(std::map<std::uint64_t, Waiter>::iterator w) {
    for (const auto& k : w->second.missing) {
      auto it = waiting_on_.find(k);
      if (it != waiting_on_.end()) {
        it->second.erase(w->first);
        if (it->second.empty()) waiting_on_.erase(it);
      }
    }
    auto range = deadlines_.equal_range(w->second.deadline);
    for (auto d = range.first; d != range.second; ++d) {
      if (d->second == w->first) {
        deadlines_.erase(d);
        break;
      }
    }
    auto next = waiters_.erase(w);
    publish_parked();
    return next;
  }

  void expire_waiters() {
    auto now = Clock::now();
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      auto w = waiters_.find(deadlines_.begin()->second);
      if (w == waiters_.end()) {
        deadlines_.erase(deadlines_.begin());
        continue;
      }
      wire::Writer msg(Type::kTimeout);
      msg.u32(static_cast<std::uint32_t>(w->second.missing.size()));
      for (const auto& k : w->second.missing) msg.str(k);
      std::uint64_t conn = w->second.conn_id;
      drop_waiter(w);
      reply(conn, msg);
    }
  }

  StoreServerOptions options_;
  const std::string instance_ = wire::random_bytes(wire::kInstanceBytes);
  net::Socket listener_;
  int epoll_fd_ = -1, stop_fd_ = -1, port_ = 0;
  std::thread thread_;
  std::atomic<std::uint64_t> refused_{0};
  std::mutex parked_mu_;
  std::condition_variable parked_cv_;
  std::size_t parked_ = 0;  // waiters_.size(), as other threads may read it
  std::uint64_t next_id_ = 2, next_waiter_ = 1;
  std::unordered_map<std::uint64_t, Conn> conns_;
  std::unordered_map<std::string, std::string> kv_;
  std::unordered_map<std::string, std::uint64_t> ephemeral_owner_;  // key -> the connection it dies with
  std::map<std::uint64_t, Waiter> waiters_;
  std::unordered_map<std::string, std::set<std::uint64_t>> waiting_on_;
  std::multimap<Clock::time_point, std::uint64_t> deadlines_;
};

StoreServer::StoreServer(StoreServerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
StoreServer::~StoreServer() = default;
int StoreServer::port() const {
  return impl_->port();
}
std::string StoreServer::instance_id() const {
  return wire::hex(impl_->instance());
}
std::uint64_t StoreServer::refused_connections() const {
  return impl_->refused();
}
void StoreServer::stop() {
  impl_->stop();
}
bool StoreServer::await_waiting(std::size_t n, Seconds timeout) {
  return impl_->await_parked(n, timeout);
}

std::string random_token() {
  return wire::hex(wire::random_bytes(32));
}

}  // namespace lockstep::comm
