#include "lockstep/comm/store.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>
#include <limits>
#include <thread>

#include "lockstep/error.h"
#include "testing.h"

namespace lockstep::testing {
namespace {

using comm::Seconds;

TEST(Store, SetGetDeleteAndCount) {
  LocalStore store;
  auto c = store.client();
  EXPECT_EQ(c->num_keys(), 0);
  c->set("a", std::string("x\0y", 3));
  EXPECT_EQ(c->get("a"), std::string("x\0y", 3));
  EXPECT_EQ(c->try_get("missing"), std::nullopt);
  EXPECT_EQ(c->num_keys(), 1);
  EXPECT_TRUE(c->remove("a"));
  EXPECT_FALSE(c->remove("a"));
  EXPECT_EQ(c->num_keys(), 0);
}

TEST(Store, CompareSet) {
  LocalStore store;
  auto c = store.client();
  EXPECT_EQ(c->compare_set("k", "", "first"), "first");  // absent matches empty
  EXPECT_EQ(c->compare_set("k", "wrong", "second"), "first");
  EXPECT_EQ(c->compare_set("k", "first", "third"), "third");
}

TEST(Store, ConcurrentAddsFromManyClientsAreExact) {
  LocalStore store;
  constexpr int kClients = 8, kAdds = 300;
  std::vector<std::thread> threads;
  for (int t = 0; t < kClients; ++t)
    threads.emplace_back([&] {
      auto c = store.client();
      for (int i = 0; i < kAdds; ++i) c->add("counter", 1);
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(store.client()->add("counter", 0), kClients * kAdds);
}

TEST(Store, AddOnNonIntegerIsAnError) {
  LocalStore store;
  auto c = store.client();
  c->set("text", "hello");
  EXPECT_THROW(c->add("text", 1), Error);
  EXPECT_EQ(c->add("n", 5), 5);  // the connection still serves
}

// An ADD past 64 bits, or on a number too large for them, is an error, not a wrapped counter (the
// first was undefined behaviour in the server, found by tests/fuzz/store_fuzz.cc).
TEST(Store, AddThatWouldOverflowIsAnError) {
  LocalStore store;
  auto c = store.client();
  EXPECT_EQ(c->add("big", std::numeric_limits<std::int64_t>::max()), std::numeric_limits<std::int64_t>::max());
  try {
    c->add("big", 1);
    ADD_FAILURE() << "an ADD past 2^63 - 1 succeeded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("would overflow 64 bits"), std::string::npos) << e.what();
  }
  c->set("huge", "99999999999999999999");
  EXPECT_THROW(c->add("huge", 1), Error);
  EXPECT_EQ(c->get("big"), std::to_string(std::numeric_limits<std::int64_t>::max()));  // unchanged
}

// The key is set only once the server holds the reader's request parked: the get really waited.
TEST(Store, GetWaitsForAKeySetLater) {
  LocalStore store;
  auto reader = store.client(), writer = store.client();
  auto got = std::async(std::launch::async, [&] { return reader->get("late", Seconds(20)); });
  ASSERT_TRUE(store.server().await_waiting(1, Seconds(10))) << "the get never reached the server";
  EXPECT_EQ(writer->try_get("late"), std::nullopt);
  writer->set("late", "value");
  ASSERT_EQ(got.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(got.get(), "value");
}

TEST(Store, WaitTimesOutNamingTheMissingKeys) {
  LocalStore store;
  auto c = store.client();
  c->set("present", "1");
  try {
    c->wait({"present", "never"}, Seconds(0.2));
    FAIL() << "wait returned";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("'never'"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("'present'"), std::string::npos) << e.what();
  }
  c->set("after", "1");  // and the client is usable afterwards
  EXPECT_EQ(c->get("after"), "1");
}

// A wait under a WaitWatch looks between slices and fails with the watch's verdict once it names
// someone: here at its third look, long before the wait's 30 s. The watch's own store calls (a wait
// among them) are not watched, and a wait after the watch ends is a plain one again.
TEST(Store, AWatchedWaitFailsWithTheWatchsVerdict) {
  LocalStore store;
  auto c = store.client();
  c->set("present", "1");
  int looks = 0;
  const auto start = std::chrono::steady_clock::now();
  {
    comm::WaitWatch watch(
        [&] {
          c->wait({"present"}, Seconds(1));
          return ++looks < 3 ? std::string() : std::string("rank 7 is gone");
        },
        Seconds(0.05));
    try {
      c->wait({"present", "never"}, Seconds(30));
      FAIL() << "wait returned";
    } catch (const PeerError& e) {
      EXPECT_NE(std::string(e.what()).find("rank 7 is gone"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("'never'"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(looks, 3);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 20);
  EXPECT_EQ(comm::WaitWatch::current(), nullptr);
  EXPECT_THROW(c->wait({"never"}, Seconds(0.2)), TimeoutError);
  EXPECT_EQ(looks, 3);
}

TEST(Store, WrongTokenIsRefusedOnBothSides) {
  LocalStore store;
  comm::StoreClientOptions bad{"127.0.0.1", store.port(), "not-the-token", Seconds(5)};
  try {
    comm::StoreClient client(bad);
    FAIL() << "connected without the token";
  } catch (const AuthError& e) {
    EXPECT_NE(std::string(e.what()).find("LOCKSTEP_TOKEN"), std::string::npos) << e.what();
  }
  EXPECT_EQ(store.server().refused_connections(), 1u);
  EXPECT_EQ(store.client()->add("still-serving", 1), 1);
}

// A listening loopback socket on a free port, owned by the test.
struct Listener {
  int fd = -1, port = 0;
  Listener() {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    EXPECT_EQ(::listen(fd, 8), 0);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    port = ntohs(addr.sin_port);
  }
  // The next connection, or -1 after `seconds`.
  int accept_within(double seconds) const {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(seconds * 1000)) != 1) return -1;
    return ::accept(fd, nullptr, nullptr);
  }
};

std::string frame(char type, const std::string& payload) {
  const auto n = static_cast<std::uint32_t>(payload.size() + 1);
  std::string out;
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(n >> (8 * i)));
  out.push_back(type);
  return out + payload;
}

// An impostor that follows docs/store-protocol.md but cannot know the token: it accepts any
// AUTH and answers with a proof it made up. Only the client's own check can catch it.
TEST(Store, ClientRefusesAServerWithoutTheToken) {
  Listener impostor;
  std::string auth_seen;
  std::thread serve([&] {
    const int c = impostor.accept_within(10);
    ASSERT_GE(c, 0);
    const std::string hello =
        frame(0x01, std::string("LKST") + std::string("\x02\x00", 2) + std::string(32, 'n'));
    ASSERT_EQ(::send(c, hello.data(), hello.size(), MSG_NOSIGNAL), static_cast<ssize_t>(hello.size()));
    char buf[128];
    for (std::size_t want = 4 + 1 + 32 + 32; auth_seen.size() < want;) {
      ssize_t n = ::recv(c, buf, sizeof buf, 0);
      if (n <= 0) break;
      auth_seen.append(buf, static_cast<std::size_t>(n));
    }
    const std::string ok = frame(0x03, std::string(32, '\0') + std::string(16, 'i'));
    ::send(c, ok.data(), ok.size(), MSG_NOSIGNAL);
    ::close(c);
  });
  try {
    comm::StoreClient client(comm::StoreClientOptions{"127.0.0.1", impostor.port, "real", Seconds(5)});
    FAIL() << "accepted a server that does not hold the token";
  } catch (const AuthError& e) {
    EXPECT_NE(std::string(e.what()).find("could not prove it holds this run's token"), std::string::npos)
        << e.what();
  }
  serve.join();
  ASSERT_EQ(auth_seen.size(), 4u + 1 + 32 + 32);  // the client sent its proof first, as the protocol says
  EXPECT_EQ(auth_seen[4], 0x02);
  ::close(impostor.fd);
}

int raw_connect(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  return fd;
}

// Reads until the server closes the connection; returns the bytes read.
std::string read_until_closed(int fd) {
  std::string all;
  char buf[4096];
  timeval tv{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  for (;;) {
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    all.append(buf, static_cast<std::size_t>(n));
  }
  return all;
}

TEST(Store, GarbageAndOversizedMessagesCloseOnlyThatConnection) {
  LocalStore store;
  auto good = store.client();
  good->set("k", "v");

  int garbage = raw_connect(store.port());
  static const char kJunk[] =
      "\x05\x00\x00\x00\xff"
      "junk";  // a 5-byte frame of type 0xff
  std::string junk(kJunk, sizeof kJunk - 1);
  ASSERT_GT(::send(garbage, junk.data(), junk.size(), MSG_NOSIGNAL), 0);
  std::string reply = read_until_closed(garbage);
  EXPECT_NE(reply.find("expected AUTH"), std::string::npos);
  ::close(garbage);

  int huge = raw_connect(store.port());
  std::string header("\xff\xff\xff\x7f", 4);  // announces a 2 GiB frame
  ASSERT_GT(::send(huge, header.data(), header.size(), MSG_NOSIGNAL), 0);
  reply = read_until_closed(huge);
  EXPECT_NE(reply.find("limit"), std::string::npos);
  ::close(huge);

  EXPECT_GE(store.server().refused_connections(), 2u);
  EXPECT_EQ(good->get("k"), "v");
}

// The client's first connection finds nobody serving (the test accepts and hangs up); only
// then does a server take over the same listening socket, which the test held all along.
TEST(Store, ClientWaitsForAServerThatIsNotUpYet) {
  Listener listener;
  std::unique_ptr<comm::StoreClient> client;
  std::thread connecting([&] {
    client = std::make_unique<comm::StoreClient>(
        comm::StoreClientOptions{"127.0.0.1", listener.port, "t", Seconds(20)});
  });
  const int first = listener.accept_within(10);
  ASSERT_GE(first, 0) << "the client never tried";
  ::close(first);  // no server yet: the client must retry
  comm::StoreServerOptions options;
  options.token = "t";
  options.listen_fd = listener.fd;
  comm::StoreServer server(options);
  connecting.join();
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(client->add("x", 2), 2);
  EXPECT_EQ(server.port(), listener.port);
}

// The race successive jobs on one port met (the doctor's phases): a client parked in a WAIT on
// one store instance, which then stops while a new instance takes over the same address with
// the same token. The test holds the listening socket throughout, so no other process can take
// the port in between. The client must fail at once, not wait on the new store for keys that
// were set on the old one.
TEST(Store, AClientThatReconnectsToAnotherInstanceFailsAtOnce) {
  Listener listener;
  const int same_address = ::dup(listener.fd);
  auto serving = [](int fd) {
    comm::StoreServerOptions o;
    o.token = "t";
    o.listen_fd = fd;
    return o;
  };
  auto old_store = std::make_unique<comm::StoreServer>(serving(listener.fd));
  comm::StoreClient client(comm::StoreClientOptions{"127.0.0.1", listener.port, "t", Seconds(30)});
  const std::string joined = client.instance_id();
  EXPECT_EQ(joined, old_store->instance_id());
  client.set("announced", "1");
  auto waiting = std::async(std::launch::async, [&] { client.wait({"answer"}, Seconds(30)); });
  ASSERT_TRUE(old_store->await_waiting(1, Seconds(10))) << "the wait never reached the server";
  old_store.reset();
  comm::StoreServer new_store(serving(same_address));
  EXPECT_NE(new_store.instance_id(), joined);
  ASSERT_EQ(waiting.wait_for(std::chrono::seconds(10)), std::future_status::ready)
      << "the client went on waiting on the new instance";
  try {
    waiting.get();
    FAIL() << "the wait returned against a store that never held the key";
  } catch (const StoreReplacedError& e) {
    EXPECT_NE(std::string(e.what()).find("new instance"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(joined.substr(0, 8)), std::string::npos) << e.what();
  }
  EXPECT_THROW(client.try_get("announced"), StoreReplacedError);  // every later call too
  EXPECT_EQ(client.instance_id(), joined);
  // A client that starts on the new instance is bound to it and works.
  comm::StoreClient fresh(comm::StoreClientOptions{"127.0.0.1", listener.port, "t", Seconds(10)});
  EXPECT_EQ(fresh.instance_id(), new_store.instance_id());
  EXPECT_EQ(fresh.try_get("announced"), std::nullopt);
}

TEST(Store, UnreachableStoreIsATimeoutNamingTheAddress) {
  int port;
  {
    comm::StoreServer probe(comm::StoreServerOptions{"127.0.0.1", 0, "t"});
    port = probe.port();
  }
  try {
    comm::StoreClient c(comm::StoreClientOptions{"127.0.0.1", port, "t", Seconds(0.5)});
    FAIL();
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(port)), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace lockstep::testing
