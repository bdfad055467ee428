// The point-to-point mailbox's handshake, spoken by hand over a real loopback connection: a
// connection that answers the mailbox's challenge with the MAC over the published token is taken
// as that rank's (its message arrives), and one that does not prove it (a wrong MAC, a genuine
// answer replayed on a new connection, one presented under another rank, or one naming a
// shared-memory lane its MAC does not cover) is closed without a message reaching anyone.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>

#include "lockstep/comm/options.h"
#include "lockstep/error.h"
#include "net/socket.h"
#include "p2p/mailbox.h"
#include "store/wire.h"

namespace lockstep::testing {
namespace {

using namespace lockstep::comm;

// The protocol as p2p/mailbox.cc defines it (host byte order).
struct Challenge {
  std::uint64_t magic;
  char nonce[wire::kNonceBytes];
};
struct Hello {
  std::uint64_t magic;
  std::int32_t src;
  std::int32_t unused;
  char nonce[wire::kNonceBytes];
  unsigned char mac[wire::kMacBytes];
  char lane[64];
};
struct Header {
  std::int64_t tag;
  std::uint64_t count;
  std::uint32_t dtype;
  std::uint32_t description_bytes;
};

struct Published {
  std::string host, port, token;
};

Published parse(const std::string& address) {
  Published p;
  std::istringstream(address) >> p.host >> p.port >> p.token;
  return p;
}

net::Socket dial(const Published& p) {
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  net::Connected c = net::connect_to(p.host, p.port, deadline, std::chrono::milliseconds(10000), true);
  if (!c.socket) return {};
  c.socket.set_non_blocking(false);
  c.socket.set_blocking_timeouts(Seconds(10));
  return std::move(c.socket);
}

// A hello from `src` offering no lane; its MAC binds the rank and the (empty) lane.
Hello answer(const Challenge& c, const std::string& token, int src) {
  Hello h{c.magic, src, 0, {}, {}, {}};
  std::memset(h.nonce, 7, sizeof h.nonce);
  const wire::Mac mac = wire::handshake_mac(token, "lockstep-p2p-hello-v1", std::string_view(c.nonce, sizeof c.nonce),
                                            std::string_view(h.nonce, sizeof h.nonce), std::to_string(src) + " ");
  std::memcpy(h.mac, mac.data(), sizeof h.mac);
  return h;
}

// True when the peer closed the connection (what the mailbox does to a connection it refuses):
// an end of stream, or a reset when it closed with our unread bytes in its buffer. Not a timeout.
bool closed_by_peer(const net::Socket& s) {
  char byte;
  bool clean_eof = false;
  if (net::recv_all(s.fd(), &byte, 1, &clean_eof) == net::Io::done) return false;
  return clean_eof || errno == ECONNRESET;
}

// Dials the mailbox, answers its challenge with make(challenge), then sends a message (tag 7,
// from rank 1) that would arrive were the answer taken. True when the mailbox closed the
// connection instead.
bool refused(const Published& where, const std::function<Hello(const Challenge&)>& make) {
  net::Socket s = dial(where);
  Challenge challenge{};
  if (!s || net::recv_all(s.fd(), &challenge, sizeof challenge) != net::Io::done) {
    ADD_FAILURE() << "no challenge from " << where.host << ":" << where.port;
    return false;
  }
  const Hello hello = make(challenge);
  const Header header{7, 1, static_cast<std::uint32_t>(DType::f32), 0};
  const float value = -1.0f;
  if (net::send_all(s.fd(), &hello, sizeof hello) != net::Io::done) return true;
  net::send_all(s.fd(), &header, sizeof header);
  net::send_all(s.fd(), &value, sizeof value);
  return closed_by_peer(s);
}

TEST(MailboxHandshake, OnlyAProofOfTheTokenOnAFreshChallengeGetsIn) {
  CommOptions options;
  options.timeout = Seconds(20);
  Mailbox target(0, 2, "127.0.0.1", options), idle(1, 2, "127.0.0.1", options);
  target.set_lookup([&](int) { return idle.address(); });  // a recv watches its source's connection
  const Published where = parse(target.address());
  ASSERT_EQ(where.token.size(), 32u) << target.address();

  // A genuine answer: its message reaches a recv from rank 1.
  net::Socket genuine = dial(where);
  ASSERT_TRUE(genuine);
  Challenge first{};
  ASSERT_EQ(net::recv_all(genuine.fd(), &first, sizeof first), net::Io::done);
  const Hello hello = answer(first, where.token, 1);
  const float value = 42.5f;
  const Header header{7, 1, static_cast<std::uint32_t>(DType::f32), 0};
  ASSERT_EQ(net::send_all(genuine.fd(), &hello, sizeof hello), net::Io::done);
  char lane_mapped = -1;  // the mailbox's answer: no lane was offered, so none is mapped
  ASSERT_EQ(net::recv_all(genuine.fd(), &lane_mapped, 1), net::Io::done);
  EXPECT_EQ(lane_mapped, 0);
  ASSERT_EQ(net::send_all(genuine.fd(), &header, sizeof header), net::Io::done);
  ASSERT_EQ(net::send_all(genuine.fd(), &value, sizeof value), net::Io::done);
  float got = 0;
  target.recv(&got, 1, DType::f32, 1, 7)->wait(Seconds(20));
  EXPECT_EQ(got, value);

  // The same answer replayed on a new connection (a new challenge), an answer under another
  // token, and a genuine proof for rank 1 presented as rank 0's (the MAC binds the rank): refused.
  Challenge second{};
  EXPECT_TRUE(refused(where, [&](const Challenge& c) { second = c; return hello; })) << "a replayed hello was accepted";
  EXPECT_NE(std::memcmp(first.nonce, second.nonce, sizeof first.nonce), 0) << "a challenge repeated its nonce";
  EXPECT_TRUE(refused(where, [](const Challenge& c) { return answer(c, "not-the-token-of-this-mailbox-00", 1); }))
      << "a hello under another token was accepted";
  EXPECT_TRUE(refused(where, [&](const Challenge& c) {
    Hello as_zero = answer(c, where.token, 1);
    as_zero.src = 0;
    return as_zero;
  })) << "a proof made for rank 1 was taken as rank 0's";
  EXPECT_TRUE(refused(where, [&](const Challenge& c) {
    Hello with_lane = answer(c, where.token, 1);
    std::strcpy(with_lane.lane, "/lockstep-1-p2p-0123456789abcdef");
    return with_lane;
  })) << "a lane the MAC does not cover was taken";

  // Nothing of theirs arrived: a recv from rank 1 still waits (and times out).
  EXPECT_THROW(target.recv(&got, 1, DType::f32, 1, 7)->wait(Seconds(0.3)), TimeoutError);
}

// Two real mailboxes find each other through their published addresses and exchange a message
// each way: the handshake as the mailbox itself speaks it.
TEST(MailboxHandshake, TwoMailboxesConnectThroughTheirPublishedAddresses) {
  CommOptions options;
  options.timeout = Seconds(20);
  Mailbox a(0, 2, "127.0.0.1", options), b(1, 2, "127.0.0.1", options);
  a.set_lookup([&](int) { return b.address(); });
  b.set_lookup([&](int) { return a.address(); });
  float to_b = 1.5f, to_a = -2.5f, at_a = 0, at_b = 0;
  auto r1 = a.recv(&at_a, 1, DType::f32, 1, 3);
  auto r2 = b.recv(&at_b, 1, DType::f32, 0, 3);
  a.send(&to_b, 1, DType::f32, 1, 3)->wait(Seconds(20));
  b.send(&to_a, 1, DType::f32, 0, 3)->wait(Seconds(20));
  r1->wait(Seconds(20));
  r2->wait(Seconds(20));
  EXPECT_EQ(at_a, to_a);
  EXPECT_EQ(at_b, to_b);
}

}  // namespace
}  // namespace lockstep::testing
