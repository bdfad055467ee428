#include "lockstep/comm/store.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

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

TEST(Store, GetWaitsForAKeySetLater) {
  LocalStore store;
  auto reader = store.client();
  std::thread writer([&] {
    auto w = store.client();
    w->wait({"reader-started"});
    w->set("late", "value");
  });
  store.client()->set("reader-started", "1");
  EXPECT_EQ(reader->get("late", Seconds(10)), "value");
  writer.join();
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

TEST(Store, ClientRefusesAServerWithoutTheToken) {
  comm::StoreServer impostor(comm::StoreServerOptions{"127.0.0.1", 0, "impostor-token"});
  // The server refuses us first (our MAC does not verify there): either way, an AuthError.
  EXPECT_THROW(comm::StoreClient(comm::StoreClientOptions{"127.0.0.1", impostor.port(), "real", Seconds(5)}),
               AuthError);
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

TEST(Store, ClientWaitsForAServerThatIsNotUpYet) {
  // Reserve a free port, release it, start connecting, then bring the server up there.
  int port;
  {
    comm::StoreServer probe(comm::StoreServerOptions{"127.0.0.1", 0, "t"});
    port = probe.port();
  }
  std::unique_ptr<comm::StoreClient> client;
  std::thread connecting([&] {
    client =
        std::make_unique<comm::StoreClient>(comm::StoreClientOptions{"127.0.0.1", port, "t", Seconds(20)});
  });
  comm::StoreServer server(comm::StoreServerOptions{"127.0.0.1", port, "t"});
  connecting.join();
  EXPECT_EQ(client->add("x", 2), 2);
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
