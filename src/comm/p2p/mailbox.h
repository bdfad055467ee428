// Point-to-point messages between the ranks of one communicator (Communicator::send/recv).
//
// Every rank listens on a TCP port from creation and publishes "address port token" (through the
// job's authenticated store); a rank connects to a peer the first time it sends to it and answers
// the peer's challenge with the store's handshake MAC over the token, the peer's nonce, its own
// and its rank, so a stray or replayed connection cannot inject messages and the token never
// crosses the mailbox's connections. One reader thread per rank polls the listener and every
// inbound connection and matches each arriving message to the first posted recv with its
// (source, tag), in post order, reading the payload straight into that recv's buffer; a
// message nobody waits for yet is kept in arrival order until a recv takes it. Because the
// reader always drains its sockets, two ranks sending large messages to each other never
// deadlock. One sender thread per rank writes the queued sends in order; a small send to a
// connected peer with nothing queued is written on the caller's thread instead.
//
// Between two ranks on one machine (once set_machines says which share one), the connection only
// proves who is at the other end and shows when the sender ends: the sender offers a
// shared-memory lane (shm_lane.h) in its hello, and once the receiver mapped it every message
// from that sender goes through the lane, read by a thread of the receiver's own. When the lane
// cannot be made or mapped (a full /dev/shm, "machines" declared that are not one), the pair
// keeps to TCP.
//
// A message may carry a description (up to kMaxDescriptionBytes) in front of its elements; a
// recv_placed sees it before the elements arrive and says where they go, so that a message of a
// size the receiver did not know still lands in its final buffer without a staging copy.
//
// Independent of the backend: collectives and point-to-point never share a socket or a
// sequence number, so a recv waiting for a peer does not hold up the collective queue.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/comm/options.h"
#include "lockstep/comm/types.h"
#include "lockstep/comm/work.h"

namespace lockstep::comm {

class Mailbox {
 public:
  // Where rank r listens ("address port token"): called on the sender thread, at most once per
  // peer, on the first send to it; may block (a store wait) and throws when it cannot tell.
  using Lookup = std::function<std::string(int rank)>;

  // Binds a port on `bind_address` (numeric) and starts the reader. Throws ConfigError when
  // the port cannot be opened.
  Mailbox(int rank, int size, const std::string& bind_address, const CommOptions& options);
  ~Mailbox();  // fails what is still pending with "communicator closed"
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;

  // What peers need to reach this rank, for Lookup.
  const std::string& address() const;
  void set_lookup(Lookup lookup);
  // Which machine each rank is on (as Communicator::machine_of): pairs on one machine exchange
  // through shared memory from their next connection on. Before the first send.
  void set_machines(std::vector<int> machine_of);

  WorkPtr send(const void* buffer, std::size_t count, DType dtype, int dst, int tag, std::string description = {});
  WorkPtr recv(void* buffer, std::size_t count, DType dtype, int src, int tag);
  WorkPtr recv_placed(Place place, int src, int tag);
  // Whether messages to `dst` go through shared memory (known once a send to it connected).
  bool shares_memory_with(int dst) const;

  // Fails every recv still waiting with PeerError(why): its owner gave up on them (a backend
  // aborting a collective on its watchdog's verdict).
  void cancel_recvs(const std::string& why);

  struct State;  // internal

 private:
  std::unique_ptr<State> state_;
};

}  // namespace lockstep::comm
