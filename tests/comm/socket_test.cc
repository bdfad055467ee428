// lockstep's own TCP (src/comm/net/socket.h) over real loopback connections: what each whole-buffer
// transfer reports when the peer is slow, gone between messages or gone in the middle of one.
#include "net/socket.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace lockstep::comm::net {
namespace {

// A listener on loopback and one connection to it, both ends.
struct Pair {
  Socket listener, client, server;
};

// Both ends blocking, every blocking call bounded by 60 s, so that a failing test ends.
void connect_pair(Pair& p) {
  std::string gai_error;
  p.listener = listen_on(AF_INET, "127.0.0.1", 0, ListenOptions{}, gai_error);
  ASSERT_TRUE(p.listener) << gai_error << " " << std::strerror(errno);
  const int port = p.listener.local_port();
  ASSERT_GT(port, 0);
  Connected c = connect_to("127.0.0.1", std::to_string(port), Clock::now() + std::chrono::seconds(10),
                           std::chrono::milliseconds(5000), /*numeric=*/true);
  ASSERT_TRUE(c.socket) << c.error;
  p.client = std::move(c.socket);
  p.client.set_non_blocking(false);
  p.client.set_blocking_timeouts(Seconds(60));
  p.server = accept_from(p.listener, /*non_blocking=*/false);
  ASSERT_TRUE(p.server);
  p.server.set_blocking_timeouts(Seconds(60));
}

#define CONNECTED_PAIR(name) \
  Pair name;                 \
  connect_pair(name);        \
  if (::testing::Test::HasFatalFailure()) return

TEST(Socket, AWholeBufferLargerThanTheKernelsCrossesIntact) {
  CONNECTED_PAIR(p);
  std::vector<char> sent(8 << 20), got(sent.size());
  for (std::size_t i = 0; i < sent.size(); ++i) sent[i] = static_cast<char>(i * 131 + 7);
  std::thread writer([&] {
    EXPECT_EQ(send_two(p.client.fd(), sent.data(), 100, sent.data() + 100, sent.size() - 100), Io::done);
  });
  EXPECT_EQ(recv_all(p.server.fd(), got.data(), got.size(), Clock::now() + std::chrono::seconds(60)), Io::done);
  writer.join();
  EXPECT_EQ(sent, got);
}

TEST(Socket, ARecvWithADeadlineTimesOutWhenNothingComes) {
  CONNECTED_PAIR(p);
  char byte;
  EXPECT_EQ(recv_all(p.server.fd(), &byte, 1, Clock::now() + std::chrono::milliseconds(50)), Io::timed_out);
}

TEST(Socket, ABlockingRecvEndsAtItsSocketTimeout) {
  CONNECTED_PAIR(p);
  p.server.set_blocking_timeouts(Seconds(1));  // from 60 s
  char byte;
  EXPECT_EQ(recv_all(p.server.fd(), &byte, 1), Io::timed_out);
}

TEST(Socket, APeerThatClosesBetweenMessagesIsToldFromOneThatClosesInsideOne) {
  CONNECTED_PAIR(between);
  between.client.close();
  char buffer[8];
  bool at_boundary = false;
  EXPECT_EQ(recv_all(between.server.fd(), buffer, sizeof buffer, &at_boundary), Io::closed);
  EXPECT_TRUE(at_boundary);

  CONNECTED_PAIR(inside);
  ASSERT_EQ(send_all(inside.client.fd(), "abc", 3), Io::done);
  inside.client.close();
  EXPECT_EQ(recv_all(inside.server.fd(), buffer, sizeof buffer, &at_boundary), Io::closed);
  EXPECT_FALSE(at_boundary);
}

TEST(Socket, SendingToAClosedPeerFailsWithoutASignal) {
  CONNECTED_PAIR(p);
  p.server.close();
  std::vector<char> data(1 << 20, 'x');
  Io result = Io::done;
  std::size_t sent = 0;
  // The first send may still be taken by the kernel; the peer's reset fails a later one.
  for (int i = 0; i < 100 && result == Io::done; ++i)
    result = send_all(p.client.fd(), data.data(), data.size(), Clock::now() + std::chrono::seconds(10), &sent);
  EXPECT_EQ(result, Io::failed);
  EXPECT_LT(sent, data.size());
}

TEST(Socket, ConnectingWhereNoOneListensIsAnErrorAndANameThatDoesNotResolveSaysSo) {
  Socket bound_only(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));  // holds a port, takes no connection
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(bound_only.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0) << std::strerror(errno);
  const int port = bound_only.local_port();
  Connected refused = connect_to("127.0.0.1", std::to_string(port), Clock::now() + std::chrono::seconds(5),
                                 std::chrono::milliseconds(2000), true);
  EXPECT_FALSE(refused.socket);
  EXPECT_FALSE(refused.unresolved);
  EXPECT_NE(refused.error.find("refused"), std::string::npos) << refused.error;

  Connected nameless = connect_to("no-such-host.invalid", "1", Clock::now() + std::chrono::seconds(5),
                                  std::chrono::milliseconds(2000));
  EXPECT_FALSE(nameless.socket);
  EXPECT_TRUE(nameless.unresolved);
  EXPECT_FALSE(nameless.error.empty());

  Connected numeric_only = connect_to("localhost", "1", Clock::now() + std::chrono::seconds(5),
                                      std::chrono::milliseconds(2000), /*numeric=*/true);
  EXPECT_TRUE(numeric_only.unresolved) << "a name where a numeric address is required";
}

// A connection the listener's full queue leaves waiting: the kernel drops its SYN, so its
// connect() stays in progress (for a second, until the SYN is sent again). Empty if none stays.
Socket pending_connection(const Socket& listener, std::vector<Socket>& queued) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<std::uint16_t>(listener.local_port()));
  for (int i = 0; i < 16; ++i) {
    Socket s(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (::connect(s.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 && errno == EINPROGRESS) {
      pollfd p{s.fd(), POLLOUT, 0};
      if (::poll(&p, 1, 100) == 0) return s;
    }
    queued.push_back(std::move(s));
  }
  return Socket();
}

// libFuzzer's timer, a debugger or a profiler may interrupt the wait; it goes on to its deadline.
TEST(Socket, AConnectInProgressWaitsThroughSignalsUntilItsDeadline) {
  std::string gai_error;
  ListenOptions options;
  options.backlog = 0;
  Socket listener = listen_on(AF_INET, "127.0.0.1", 0, options, gai_error);
  ASSERT_TRUE(listener) << gai_error;
  std::vector<Socket> queued;
  Socket pending = pending_connection(listener, queued);
  ASSERT_TRUE(pending) << "every connection to a listener that accepts none completed";

  struct sigaction quiet{}, before{};
  quiet.sa_handler = [](int) {};  // no SA_RESTART: each signal interrupts the poll
  ASSERT_EQ(::sigaction(SIGUSR1, &quiet, &before), 0);
  const pthread_t waiter = ::pthread_self();
  std::atomic<bool> waiting{true};
  std::thread interrupter([&] {
    while (waiting) {
      ::pthread_kill(waiter, SIGUSR1);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));  // paces the signals
    }
  });
  const auto limit = std::chrono::milliseconds(300);
  const auto start = Clock::now();
  const int result = finish_connect(pending.fd(), start + limit);
  const int err = errno;
  const auto waited = Clock::now() - start;
  waiting = false;
  interrupter.join();
  ::sigaction(SIGUSR1, &before, nullptr);
  EXPECT_EQ(result, -1);
  EXPECT_EQ(err, ETIMEDOUT) << std::strerror(err);
  EXPECT_GE(waited, limit) << "a signal ended the wait early";
}

TEST(Socket, AFreePortCanBeListenedOnAndAnAddressThatIsNotNumericIsRefused) {
  std::string gai_error;
  Socket s = listen_on(AF_INET, "0.0.0.0", free_port(), ListenOptions{}, gai_error);
  EXPECT_TRUE(s) << std::strerror(errno);
  Socket named = listen_on(AF_UNSPEC, "localhost", 0, ListenOptions{}, gai_error);
  EXPECT_FALSE(named);
  EXPECT_FALSE(gai_error.empty());
}

TEST(Socket, AMovedSocketIsClosedOnceByItsLastOwner) {
  CONNECTED_PAIR(p);
  const int fd = p.client.fd();
  Socket moved = std::move(p.client);
  EXPECT_FALSE(p.client);
  EXPECT_EQ(moved.fd(), fd);
  moved = Socket();  // closes it: the peer sees the end of the stream
  char byte;
  bool at_boundary = false;
  EXPECT_EQ(recv_all(p.server.fd(), &byte, 1, &at_boundary), Io::closed);
  EXPECT_TRUE(at_boundary);
}

}  // namespace
}  // namespace lockstep::comm::net
