// TCP keepalive and a user timeout on a connected socket: a peer that vanishes without closing
// (a network partition, a machine that lost power) makes every pending read and write on it
// fail within idle + 3 x idle/2 seconds, instead of waiting forever.
#pragma once

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>

namespace lockstep::comm {

inline void keep_alive(int fd, int idle_seconds) {
  const int on = 1, idle = std::max(1, idle_seconds), interval = std::max(1, idle / 2), count = 3;
  const unsigned user_timeout_ms = static_cast<unsigned>((idle + interval * count) * 1000);
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof user_timeout_ms);
}

// The store's connections: a partitioned client's ephemeral keys vanish within ~11 s.
inline constexpr int kStoreKeepAliveSeconds = 5;

}  // namespace lockstep::comm
