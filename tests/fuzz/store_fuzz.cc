// Fuzz target: what a client sends the rendezvous store (docs/store-protocol.md), over a real
// socket to a real StoreServer in this process. The first byte picks whether the client first
// authenticates (odd: the bytes that follow are requests) or not (even: they are its handshake).
// The client then closes its side; the server must answer what it can and close too, within
// seconds, whatever came: never crash, read out of bounds, or hang.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "lockstep/comm/store.h"
#include "net/socket.h"
#include "store/wire.h"

namespace {
namespace net = lockstep::comm::net;
namespace wire = lockstep::comm::wire;
constexpr char kToken[] = "fuzz-token";
constexpr std::chrono::seconds kHang{30};  // no answer and no close in this long is a hang

int server_port() {
  static lockstep::comm::StoreServer server([] {
    lockstep::comm::StoreServerOptions o;
    o.host = "127.0.0.1";
    o.token = kToken;
    o.max_message_bytes = 1 << 16;
    return o;
  }());
  return server.port();
}

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "store fuzz: %s (%s)\n", what, std::strerror(errno));
  std::abort();
}

// Each connection comes from the next of 200 loopback addresses. The client closes first, so
// each of its ports waits in TIME_WAIT for a minute: from one address, a few thousand inputs a
// second would use up the ephemeral ports (CI once saw connect() fail after 62,000 inputs).
void bind_next_source_address(int fd) {
  static unsigned next = 0;
  const int defer_port = 1;  // the port is chosen by connect(), which knows the whole 4-tuple
  ::setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &defer_port, sizeof defer_port);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK + 1 + next++ % 200);  // 127.0.0.2 .. 127.0.0.201
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) fail("cannot bind a loopback source address");
}

// The socket calls below are the product's own (net/socket.h), which wait through a signal
// (libFuzzer's timer, a busy machine's): a harness that took EINTR for a failure once aborted a
// clean run under load.
int connect_to_server() {
  net::Socket s(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!s) fail("cannot make a socket");
  bind_next_source_address(s.fd());
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(server_port()));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int c = ::connect(s.fd(), reinterpret_cast<sockaddr*>(&a), sizeof a);
  if (c != 0 && errno == EINPROGRESS) c = net::finish_connect(s.fd(), lockstep::Clock::now() + kHang);
  if (c != 0) fail("cannot connect");
  s.set_non_blocking(false);
  s.set_blocking_timeouts(kHang);
  return s.release();
}

// What the server does not take is allowed: it may refuse and close.
void send_all(int fd, const std::string& s) { net::send_all(fd, s.data(), s.size()); }

// One whole message, or "" when the server closed. A timeout is a hang.
std::string recv_message(int fd) {
  auto take = [fd](std::string& into, std::size_t n) {
    into.resize(n);
    const net::Io got = net::recv_all(fd, into.data(), n);
    if (got == net::Io::timed_out) fail("the server neither answered nor closed");
    return got == net::Io::done;
  };
  std::string prefix, body;
  if (!take(prefix, 4) || !take(body, wire::read_length_prefix(prefix.data()))) return {};
  return body;
}

void authenticate(int fd) {
  const std::string hello = recv_message(fd);
  wire::Reader r(hello);
  r.type();
  r.bytes(4);
  r.u16();
  const std::string server_nonce(r.bytes(wire::kNonceBytes));
  const std::string client_nonce = wire::random_bytes(wire::kNonceBytes);
  const auto mac = wire::handshake_mac(kToken, wire::kClientLabel, server_nonce, client_nonce);
  send_all(fd, wire::Writer(wire::Type::kAuth)
                   .bytes(client_nonce)
                   .bytes(std::string_view(reinterpret_cast<const char*>(mac.data()), mac.size()))
                   .frame());
  if (wire::Reader(recv_message(fd)).type() != wire::Type::kAuthOk) fail("the token was refused");
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const int fd = connect_to_server();
  if (data[0] & 1) authenticate(fd);
  send_all(fd, std::string(reinterpret_cast<const char*>(data + 1), size - 1));
  ::shutdown(fd, SHUT_WR);
  while (!recv_message(fd).empty()) {
  }
  ::close(fd);
  return 0;
}
