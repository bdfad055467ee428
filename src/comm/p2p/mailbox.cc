// Point-to-point mailbox: listener, reader (matching), sender, shared-memory lanes. See mailbox.h.
#include "mailbox.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <list>
#include <optional>
#include <sstream>
#include <vector>

#include "../net/socket.h"
#include "../store/wire.h"
#include "../work_queue.h"
#include "shm_lane.h"
#include "lockstep/base/log.h"
#include "lockstep/error.h"

namespace lockstep::comm {
namespace {

constexpr std::uint64_t kHelloMagic = 0x4c53503250303033ull;  // "LSP2P003"
// The store's handshake construction (store/wire.h) under the mailbox's own label: a rank proves
// it holds the token the target published, bound to the target's fresh nonce and to its rank.
constexpr std::string_view kHelloLabel = "lockstep-p2p-hello-v1";
constexpr std::uint64_t kMaxMessageBytes = std::uint64_t{1} << 40;
constexpr std::size_t kCallerSendBytes = 64 << 10;
constexpr std::size_t kLaneBytes = 2 << 20;  // each lane's ring

// In host byte order: every rank of a job runs on the same architecture. The acceptor sends a
// Challenge, the connecting rank answers with a Hello (naming the lane it offers, or none), the
// acceptor answers with one byte: 1 when it mapped the lane. The token itself never crosses the wire.
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
  char lane[64];  // the shared-memory lane's name, NUL-terminated; empty: TCP
};
static_assert(sizeof(Challenge) == 8 + wire::kNonceBytes &&
                  sizeof(Hello) == 16 + wire::kNonceBytes + wire::kMacBytes + sizeof(Hello::lane),
              "the handshake's messages have no padding: every byte on the wire is a field");

std::string lane_of(const Hello& h) {
  return std::string(h.lane, strnlen(h.lane, sizeof h.lane));
}

// The MAC a Hello from rank `src` carries, for the target whose token is `token`: it binds the
// lane too, so that nobody but the rank can make the target map an object.
wire::Mac hello_mac(const std::string& token, const Challenge& c, const Hello& h, int src) {
  return wire::handshake_mac(token, kHelloLabel, std::string_view(c.nonce, sizeof c.nonce),
                             std::string_view(h.nonce, sizeof h.nonce), std::to_string(src) + " " + lane_of(h));
}
struct Header {
  std::int64_t tag;
  std::uint64_t count;
  std::uint32_t dtype;
  std::uint32_t description_bytes;  // in front of the elements
};

std::string what_of(const char* dtype, std::size_t count) {
  return std::string(dtype) + " x " + std::to_string(count);
}

struct PostedRecv {
  std::shared_ptr<WorkState> work;
  void* buffer;  // null for a placed recv
  std::size_t count;
  DType dtype;
  int src;  // or kAnySource
  int tag;
  Clock::time_point deadline;
  Place place;  // a recv_placed: takes any message, and says where its elements go
  bool takes(int from, int t) const { return tag == t && (src == kAnySource || src == from); }
};

struct Message {
  int src;
  int tag;
  DType dtype;
  std::size_t count;
  std::string description;
  std::vector<std::uint8_t> bytes;
};

struct SendJob {
  std::shared_ptr<WorkState> work;  // null: only open the connection (a recv watches it)
  const void* buffer;
  std::size_t count;
  DType dtype;
  int dst;
  int tag;
  std::string description;
};

// The reading end of a lane from one peer, and the thread that reads it.
struct LaneReader {
  std::unique_ptr<ShmLane> lane;
  int src;
  std::atomic<bool> stop{false};         // the mailbox is closing
  std::atomic<bool> peer_left{false};    // its connection ended: drain the lane, then say why
  std::atomic<bool> finished{false};     // the thread returned
  std::string why;                       // set before peer_left
  std::thread thread;
};

struct Inbound {
  int fd;
  int src;             // -1 until its hello was read
  LaneReader* lane;    // the peer's messages come through this lane; the connection only ends
};

}  // namespace

struct Mailbox::State {
  int rank, size;
  CommOptions options;
  WorkQueue sync;  // its mutex guards everything below that is not thread-local
  std::string address;
  std::string token;  // hex; published with the address, proven by every rank that connects
  net::Socket listener;
  int wake[2] = {-1, -1};
  Lookup lookup;

  std::list<PostedRecv> posted;
  std::list<Message> unexpected;
  std::vector<std::string> gone;  // per peer: why it can no longer send to us ("" while it can)

  std::deque<SendJob> sends;
  std::condition_variable send_cv;
  bool stop_sending = false, stop_reading = false;
  bool sender_busy = false;  // a send is being written (by the sender thread or a caller)
  std::vector<int> outbound;             // per peer, -1 until connected; closed only at the end
  std::vector<std::string> send_error;   // per peer: why sends to it fail ("" while they work)
  std::vector<bool> connecting;          // a connect job is queued for the peer
  std::vector<int> machine_of;           // empty: unknown (then every pair keeps to TCP)
  std::vector<std::unique_ptr<ShmLane>> out_lane;  // per peer: the lane its messages take (the sender's own)

  std::vector<Inbound> inbound;  // the reader's own
  std::list<std::unique_ptr<LaneReader>> lanes;  // started by the reader, joined at the end
  std::thread reader, sender;

  // --- completion (sync.mu held) ---
  void complete(WorkState& w, std::exception_ptr error, int source) {
    w.source = error ? -1 : source;
    w.error = std::move(error);
    w.finished = Clock::now();
    w.seconds = Seconds(w.finished - w.started).count();
    w.done = true;
    sync.done_cv.notify_all();
  }
  template <class E>
  void fail(WorkState& w, const std::string& why) {
    complete(w, std::make_exception_ptr(E(why)), -1);
  }
  void wake_reader() const {
    const char c = 1;
    [[maybe_unused]] ssize_t k = ::write(wake[1], &c, 1);
  }

  // --- matching ---
  std::string mismatch(const PostedRecv& p, int from, DType dtype, std::size_t count, bool described) const {
    return "rank " + std::to_string(from) + " sent " + what_of(dtype_name(dtype), count) +
           (described ? " described" : "") + " with tag " + std::to_string(p.tag) + " but rank " +
           std::to_string(rank) + "'s " + p.work->label + " expects " + what_of(dtype_name(p.dtype), p.count) +
           (described ? ": take a described message with recv_described" : ": post a recv of the same size and dtype");
  }
  // Whether recv `p` takes a message of this kind as it is ("") or why not.
  std::string refusal(const PostedRecv& p, int from, DType dtype, std::size_t count, const std::string& description) const {
    if (p.place || (p.dtype == dtype && p.count == count && description.empty())) return "";
    return mismatch(p, from, dtype, count, !description.empty());
  }
  // Completes recv `p` with message `m` that arrived before it (sync.mu held).
  void take_kept(const PostedRecv& p, Message& m);
  // Hands one arriving message to the first recv that takes it, or keeps it. `fill` copies the
  // payload into the memory it is given and returns false when the payload could not be read.
  bool deliver(int from, const Header& h, const std::string& description, const std::function<bool(void*)>& fill);
  void lost_peer(int peer, const std::string& why);
  void expire(Clock::time_point now);
  // Takes a kept message for `p`, or posts it (and opens the connection that shows its source's death).
  WorkPtr post(PostedRecv p, const std::string& what);

  // --- one message off a stream (a connection or a lane) ---
  // false with `why` set when the stream broke inside a message or was malformed, or with `why`
  // empty when it ended (or failed) before one began.
  bool receive(int src, const std::function<bool(void*, std::size_t)>& read, std::string& why);
  void read_lane(LaneReader& reader);

  // --- reader ---
  void read_loop();
  void accept_peer();
  void accept_waiting();  // every connection already waiting on the listener
  bool inbound_from(int peer) const;
  bool read_message(Inbound& in);
  void start_lane(std::unique_ptr<ShmLane> lane, int src);
  int poll_timeout_ms();

  // --- sender ---
  void send_loop();
  int connection(int dst);  // the fd, or -1 with send_error[dst] set
  int connect_to(int dst, std::unique_ptr<ShmLane>& lane, std::string& error);
  std::unique_ptr<ShmLane> offer_lane(int dst);
  std::optional<Hello> handshake(const net::Socket& peer) const;
  bool answer(int fd, const Challenge& challenge, const std::string& target_token, const std::string& lane) const;
  void send_one(const SendJob& job);
  bool write_tcp(int fd, const SendJob& job, const Header& h);
  bool write_lane(ShmLane& lane, const SendJob& job, const Header& h);
};

void Mailbox::State::take_kept(const PostedRecv& p, Message& m) {
  const std::string problem = refusal(p, m.src, m.dtype, m.count, m.description);
  if (!problem.empty()) return fail<MismatchError>(*p.work, problem);
  void* into = p.buffer;
  if (p.place) {
    try {
      into = p.place(m.description, m.count, m.dtype);
    } catch (...) {
      return complete(*p.work, std::current_exception(), m.src);
    }
  }
  if (!m.bytes.empty()) std::memcpy(into, m.bytes.data(), m.bytes.size());
  complete(*p.work, nullptr, m.src);
}

bool Mailbox::State::deliver(int from, const Header& h, const std::string& description,
                             const std::function<bool(void*)>& fill) {
  const DType dtype = static_cast<DType>(h.dtype);
  const std::size_t count = static_cast<std::size_t>(h.count);
  std::unique_lock<std::mutex> lock(sync.mu);
  auto it = std::find_if(posted.begin(), posted.end(), [&](const PostedRecv& p) { return p.takes(from, static_cast<int>(h.tag)); });
  if (it != posted.end() && refusal(*it, from, dtype, count, description).empty()) {
    PostedRecv p = *it;
    posted.erase(it);
    lock.unlock();
    void* into = p.buffer;
    std::exception_ptr placing;
    std::vector<std::uint8_t> discard;
    if (p.place) {
      try {
        into = p.place(description, count, dtype);
      } catch (...) {
        placing = std::current_exception();
        discard.resize(count * dtype_size(dtype));  // the elements still leave the stream
        into = discard.data();
      }
    }
    const bool ok = fill(into);
    lock.lock();
    if (ok)
      complete(*p.work, placing, from);
    else
      fail<PeerError>(*p.work, "rank " + std::to_string(from) + " broke off while sending the message of " +
                                   p.work->label + ": it exited, died, or stopped past the timeout");
    return ok;
  }
  Message m{from, static_cast<int>(h.tag), dtype, count, description, std::vector<std::uint8_t>(count * dtype_size(dtype))};
  lock.unlock();
  if (!fill(m.bytes.data())) return false;
  lock.lock();
  it = std::find_if(posted.begin(), posted.end(), [&](const PostedRecv& p) { return p.takes(from, m.tag); });
  if (it == posted.end()) {
    unexpected.push_back(std::move(m));
    return true;
  }
  take_kept(*it, m);
  posted.erase(it);
  return true;
}

void Mailbox::State::lost_peer(int peer, const std::string& why) {
  std::lock_guard<std::mutex> lock(sync.mu);
  if (!gone[static_cast<std::size_t>(peer)].empty()) return;
  gone[static_cast<std::size_t>(peer)] = why;
  for (auto it = posted.begin(); it != posted.end();) {
    if (it->src != peer) {
      ++it;
      continue;
    }
    fail<PeerError>(*it->work, it->work->label + " cannot finish: " + why);
    it = posted.erase(it);
  }
}

void Mailbox::State::expire(Clock::time_point now) {
  std::lock_guard<std::mutex> lock(sync.mu);
  for (auto it = posted.begin(); it != posted.end();) {
    if (it->deadline > now) {
      ++it;
      continue;
    }
    fail<TimeoutError>(*it->work, it->work->label + " got no message within " +
                                      log::seconds_text(options.timeout.count()) +
                                      " (CommOptions::timeout): did the sender post the send, with this tag?");
    it = posted.erase(it);
  }
}

int Mailbox::State::poll_timeout_ms() {
  std::lock_guard<std::mutex> lock(sync.mu);
  auto next = Clock::now() + std::chrono::seconds(1);
  for (const auto& p : posted) next = std::min(next, p.deadline);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(ms + 1, 0, 1000));
}

void Mailbox::State::read_loop() {
  for (;;) {
    std::vector<pollfd> fds{{wake[0], POLLIN, 0}, {listener.fd(), POLLIN, 0}};
    for (const auto& in : inbound) fds.push_back({in.fd, POLLIN, 0});
    std::vector<int> watched;  // outbound connections: readable means the peer closed
    {
      std::lock_guard<std::mutex> lock(sync.mu);
      if (stop_reading) return;
      for (int peer = 0; peer < size; ++peer)
        if (outbound[static_cast<std::size_t>(peer)] >= 0 && send_error[static_cast<std::size_t>(peer)].empty()) {
          fds.push_back({outbound[static_cast<std::size_t>(peer)], POLLIN, 0});
          watched.push_back(peer);
        }
    }
    const int n = ::poll(fds.data(), fds.size(), poll_timeout_ms());
    if (n < 0 && errno != EINTR) {
      LOCKSTEP_LOG(warn, comm) << "point-to-point: poll failed: " << std::strerror(errno);
      return;
    }
    if (n > 0) {
      if (fds[0].revents) {
        char drain[64];
        [[maybe_unused]] ssize_t k = ::read(wake[0], drain, sizeof drain);
      }
      std::size_t i = 2;
      std::vector<Inbound> kept;
      for (auto& in : inbound) {
        if (fds[i++].revents == 0 || read_message(in)) {
          kept.push_back(in);
          continue;
        }
        ::close(in.fd);
      }
      inbound.swap(kept);
      for (int peer : watched) {
        char byte;
        if (fds[i++].revents == 0 || ::recv(fds[i - 1].fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT) > 0) continue;
        const std::string why = "rank " + std::to_string(peer) + " closed its connection (it exited or died)";
        {
          std::lock_guard<std::mutex> lock(sync.mu);
          send_error[static_cast<std::size_t>(peer)] = why;
          ::shutdown(outbound[static_cast<std::size_t>(peer)], SHUT_RDWR);
        }
        // A peer that sent its last messages and exited: they are still on its connection to
        // this rank, perhaps not yet accepted. Its end is told when that connection ends.
        accept_waiting();
        if (!inbound_from(peer)) lost_peer(peer, why);
      }
      if (fds[1].revents & POLLIN) accept_waiting();  // last: it adds to `inbound`, which fds mirrors
    }
    expire(Clock::now());
  }
}

void Mailbox::State::accept_waiting() {
  for (;;) {
    pollfd p{listener.fd(), POLLIN, 0};
    if (::poll(&p, 1, 0) <= 0 || !(p.revents & POLLIN)) return;
    accept_peer();
  }
}

// Whether messages from `peer` may still arrive: its connection is open, or its lane not drained.
bool Mailbox::State::inbound_from(int peer) const {
  return std::any_of(inbound.begin(), inbound.end(), [peer](const Inbound& in) { return in.src == peer; }) ||
         std::any_of(lanes.begin(), lanes.end(), [peer](const auto& r) { return r->src == peer && !r->finished.load(); });
}

// The connecting rank's Hello, once it proved it holds this rank's token; nothing otherwise. The
// whole exchange is bounded (at most 10 s), since the reader serves no one else meanwhile.
std::optional<Hello> Mailbox::State::handshake(const net::Socket& peer) const {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::min(options.timeout, Seconds(10)));
  Challenge challenge{kHelloMagic, {}};
  Hello hello{};
  try {
    const std::string nonce = wire::random_bytes(sizeof challenge.nonce);
    std::memcpy(challenge.nonce, nonce.data(), sizeof challenge.nonce);
  } catch (const std::exception& e) {
    LOCKSTEP_LOG(warn, comm) << "point-to-point: rank " << rank << " cannot challenge a connection: " << e.what();
    return std::nullopt;
  }
  if (net::send_all(peer.fd(), &challenge, sizeof challenge, deadline) != net::Io::done ||
      net::recv_all(peer.fd(), &hello, sizeof hello, deadline) != net::Io::done || hello.magic != kHelloMagic ||
      hello.src < 0 || hello.src >= size ||
      !wire::mac_equal(std::string_view(reinterpret_cast<const char*>(hello.mac), sizeof hello.mac),
                       hello_mac(token, challenge, hello, hello.src)))
    return std::nullopt;
  return hello;
}

void Mailbox::State::accept_peer() {
  net::Socket peer = net::accept_from(listener, /*non_blocking=*/false);
  if (!peer) return;
  const std::optional<Hello> hello = handshake(peer);
  if (!hello) {
    LOCKSTEP_LOG(warn, comm) << "point-to-point: rank " << rank << " refused a connection that did not prove it "
                             << "came from a rank of this communicator";
    return;
  }
  // The lane it offers, if this rank can map it: the answer tells the peer which way to send.
  std::unique_ptr<ShmLane> lane;
  if (const std::string name = lane_of(*hello); !name.empty()) {
    std::string error;
    lane = ShmLane::open(name, error);
    if (lane)
      lane->unlink();  // both ends have it mapped: no name is left behind if either dies now
    else
      LOCKSTEP_LOG(debug, comm) << "point-to-point: rank " << hello->src << "'s lane stays unused: " << error;
  }
  const char mapped = lane ? 1 : 0;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::min(options.timeout, Seconds(10)));
  if (net::send_all(peer.fd(), &mapped, 1, deadline) != net::Io::done) return;
  peer.set_blocking_timeouts(options.timeout);
  peer.keep_alive(static_cast<int>(options.peer_check.count()));
  LaneReader* lane_reader = nullptr;
  if (lane) {
    start_lane(std::move(lane), hello->src);
    lane_reader = lanes.back().get();
  }
  inbound.push_back({peer.release(), hello->src, lane_reader});
}

bool Mailbox::State::receive(int src, const std::function<bool(void*, std::size_t)>& read, std::string& why) {
  Header h{};
  if (!read(&h, sizeof h)) return false;
  const std::string who = "rank " + std::to_string(src);
  if (h.dtype > static_cast<std::uint32_t>(DType::i64) || h.description_bytes > kMaxDescriptionBytes ||
      h.count * dtype_size(static_cast<DType>(h.dtype)) > kMaxMessageBytes) {
    why = who + " sent a malformed message header";
    return false;
  }
  std::string description(h.description_bytes, '\0');
  const std::size_t bytes = h.count * dtype_size(static_cast<DType>(h.dtype));
  if (read(description.data(), description.size()) &&
      deliver(src, h, description, [&](void* into) { return read(into, bytes); }))
    return true;
  why = who + " broke off in the middle of a message (it exited or died)";
  return false;
}

// false when the connection ended (cleanly between messages, or not).
bool Mailbox::State::read_message(Inbound& in) {
  const std::string who = "rank " + std::to_string(in.src);
  if (in.lane) {  // nothing comes this way after the hello: readable means the peer ended
    in.lane->why = who + " closed its connection (it exited or died)";
    in.lane->peer_left.store(true);
    in.lane->lane->wake();
    return false;
  }
  bool clean_eof = false, first = true;
  const auto read = [&](void* into, std::size_t n) {
    const net::Io io = net::recv_all(in.fd, into, n, first ? &clean_eof : nullptr);
    first = false;
    return io == net::Io::done;
  };
  std::string why;
  if (receive(in.src, read, why)) return true;
  if (why.empty())
    why = clean_eof ? who + " closed its connection (it exited or died)" : who + "'s connection failed: " + std::strerror(errno);
  lost_peer(in.src, why);
  return false;
}

// A lane's thread: every message of its peer, in order, until the peer's connection ended and
// the lane is empty (then the peer is lost, as on TCP), the peer stopped inside a message for
// longer than the timeout (as a TCP read times out), or the mailbox closes.
void Mailbox::State::read_lane(LaneReader& r) {
  bool in_message = false, stalled = false;
  Clock::time_point deadline{};
  const auto give_up = [&] {
    stalled = stalled || (in_message && Clock::now() > deadline);
    return stalled || r.stop.load() || r.peer_left.load();
  };
  const auto read = [&](void* into, std::size_t n) {
    const bool ok = r.lane->read(into, n, give_up);
    if (!in_message) deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::min(options.timeout, Seconds(1e6)));
    in_message = true;  // after its header: the rest is due
    return ok;
  };
  std::string why;
  while (!r.stop.load()) {
    in_message = false;
    if (!receive(r.src, read, why)) break;
  }
  if (stalled)
    why = "rank " + std::to_string(r.src) + " sent part of a message and nothing more within " +
          log::seconds_text(options.timeout.count()) + " (CommOptions::timeout; its process is stuck)";
  if (!r.stop.load()) lost_peer(r.src, why.empty() ? r.why : why);
  r.finished.store(true);
  wake_reader();  // inbound_from() changed
}

void Mailbox::State::start_lane(std::unique_ptr<ShmLane> lane, int src) {
  auto made = std::make_unique<LaneReader>();
  made->lane = std::move(lane);
  made->src = src;
  LaneReader& r = *made;
  lanes.push_back(std::move(made));
  r.thread = std::thread([this, &r] { read_lane(r); });
}

// The Hello that proves this rank holds the target's token, answering its challenge.
bool Mailbox::State::answer(int fd, const Challenge& challenge, const std::string& target_token,
                            const std::string& lane) const {
  Hello hello{kHelloMagic, rank, 0, {}, {}, {}};
  const std::string nonce = wire::random_bytes(sizeof hello.nonce);
  std::memcpy(hello.nonce, nonce.data(), sizeof hello.nonce);
  std::memcpy(hello.lane, lane.data(), std::min(lane.size(), sizeof hello.lane - 1));
  const wire::Mac mac = hello_mac(target_token, challenge, hello, rank);
  std::memcpy(hello.mac, mac.data(), sizeof hello.mac);
  return net::send_all(fd, &hello, sizeof hello) == net::Io::done;
}

// A lane for the messages to `dst`, when both ranks are on one machine and shared memory is wanted.
std::unique_ptr<ShmLane> Mailbox::State::offer_lane(int dst) {
  {
    std::lock_guard<std::mutex> lock(sync.mu);
    if (!options.p2p_shared_memory || machine_of.empty() ||
        machine_of[static_cast<std::size_t>(dst)] != machine_of[static_cast<std::size_t>(rank)])
      return nullptr;
  }
  std::string error;
  auto lane = ShmLane::create(kLaneBytes, error);
  if (!lane) LOCKSTEP_LOG(debug, comm) << "point-to-point: to rank " << dst << " over TCP: " << error;
  return lane;
}

int Mailbox::State::connect_to(int dst, std::unique_ptr<ShmLane>& lane, std::string& error) {
  std::string where;
  try {
    where = lookup(dst);
  } catch (const std::exception& e) {
    error = "cannot find where rank " + std::to_string(dst) + " listens: " + e.what();
    return -1;
  }
  std::istringstream in(where);
  std::string host, port;
  std::string peer_token;
  in >> host >> port >> peer_token;
  const Seconds wait = std::min(options.timeout, Seconds(1e6));  // a deadline the clock can hold
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(wait);
  net::Connected c = net::connect_to(host, port, deadline, std::chrono::ceil<std::chrono::milliseconds>(wait),
                                     /*numeric=*/true);
  if (c.unresolved) {
    error = "rank " + std::to_string(dst) + " published an unusable address '" + where + "'";
    return -1;
  }
  if (c.socket) {
    c.socket.set_non_blocking(false);
    c.socket.set_blocking_timeouts(options.timeout);
  }
  Challenge challenge{};
  const net::Io heard = c.socket ? net::recv_all(c.socket.fd(), &challenge, sizeof challenge, deadline) : net::Io::failed;
  if (heard == net::Io::timed_out) {
    error = "rank " + std::to_string(dst) + " at " + host + ":" + port + " accepted the connection but did not " +
            "challenge it within " + std::to_string(wait.count()) + " s (LOCKSTEP_TIMEOUT; its process is stuck)";
    return -1;
  }
  const bool challenged = heard == net::Io::done;
  if (challenged && challenge.magic != kHelloMagic) {
    error = "rank " + std::to_string(dst) + "'s address " + host + ":" + port + " did not answer as a lockstep "
            "point-to-point mailbox (another program took the port, or another lockstep version)";
    return -1;
  }
  std::unique_ptr<ShmLane> offered = challenged ? offer_lane(dst) : nullptr;
  char mapped = 0;
  if (!challenged || !answer(c.socket.fd(), challenge, peer_token, offered ? offered->name() : "") ||
      net::recv_all(c.socket.fd(), &mapped, 1, deadline) != net::Io::done) {
    error = "cannot connect to rank " + std::to_string(dst) + " at " + host + ":" + port + ": " +
            (c.socket ? std::strerror(errno) : c.error) + " (it exited or died, or a firewall is in the way)";
    return -1;
  }
  if (mapped == 1 && offered) {
    offered->unlink();  // the receiver removed the name already; this covers an old one that did not
    lane = std::move(offered);
  }
  c.socket.keep_alive(static_cast<int>(options.peer_check.count()));
  return c.socket.release();
}

int Mailbox::State::connection(int dst) {
  {
    std::lock_guard<std::mutex> lock(sync.mu);
    const auto d = static_cast<std::size_t>(dst);
    if (!send_error[d].empty()) return -1;
    if (outbound[d] >= 0) return outbound[d];
  }
  std::string error;
  std::unique_ptr<ShmLane> lane;
  const int fd = connect_to(dst, lane, error);
  {
    std::lock_guard<std::mutex> lock(sync.mu);
    outbound[static_cast<std::size_t>(dst)] = fd;
    send_error[static_cast<std::size_t>(dst)] = error;
    out_lane[static_cast<std::size_t>(dst)] = std::move(lane);
  }
  if (fd < 0) lost_peer(dst, error);
  wake_reader();  // to watch the new connection
  return fd;
}

bool Mailbox::State::write_tcp(int fd, const SendJob& job, const Header& h) {
  const std::size_t bytes = job.count * dtype_size(job.dtype);
  if (job.description.empty()) return net::send_two(fd, &h, sizeof h, job.buffer, bytes) == net::Io::done;
  std::string front(reinterpret_cast<const char*>(&h), sizeof h);
  front += job.description;
  return net::send_two(fd, front.data(), front.size(), job.buffer, bytes) == net::Io::done;
}

// Gives up when the peer's connection ended (the reader sets send_error) or the message took
// longer than the communicator's timeout (a receiver that is stopped, not dead); then shuts the
// connection, so that the receiver, if it resumes, reports the message it got part of as broken
// instead of waiting for its rest.
bool Mailbox::State::write_lane(ShmLane& lane, const SendJob& job, const Header& h) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::min(options.timeout, Seconds(1e6)));
  const auto d = static_cast<std::size_t>(job.dst);
  bool late = false;
  const auto give_up = [&] {
    late = Clock::now() > deadline;
    std::lock_guard<std::mutex> lock(sync.mu);
    return late || !send_error[d].empty();
  };
  const bool sent = lane.write({{&h, sizeof h},
                               {job.description.data(), job.description.size()},
                               {job.buffer, job.count * dtype_size(job.dtype)}},
                              give_up);
  if (!sent) {
    std::lock_guard<std::mutex> lock(sync.mu);
    if (late && send_error[d].empty())
      send_error[d] = "rank " + std::to_string(job.dst) + " did not take a message from its shared-memory lane within " +
                      log::seconds_text(options.timeout.count()) + " (CommOptions::timeout; its process is stuck)";
    if (outbound[d] >= 0) ::shutdown(outbound[d], SHUT_RDWR);
  }
  return sent;
}

void Mailbox::State::send_one(const SendJob& job) {
  const Header h{job.tag, job.count, static_cast<std::uint32_t>(job.dtype),
                 static_cast<std::uint32_t>(job.description.size())};
  const std::size_t bytes = job.count * dtype_size(job.dtype);
  if (job.dst == rank) {  // to itself: no socket
    deliver(rank, h, job.description, [&](void* into) {
      if (bytes > 0) std::memcpy(into, job.buffer, bytes);
      return true;
    });
    std::lock_guard<std::mutex> lock(sync.mu);
    complete(*job.work, nullptr, -1);
    return;
  }
  const int fd = connection(job.dst);
  const auto d = static_cast<std::size_t>(job.dst);
  ShmLane* lane = nullptr;
  if (fd >= 0) {
    std::lock_guard<std::mutex> lock(sync.mu);
    lane = out_lane[d].get();  // set by connection(), on this sending thread
  }
  const bool sent = fd >= 0 && (lane ? write_lane(*lane, job, h) : write_tcp(fd, job, h));
  std::lock_guard<std::mutex> lock(sync.mu);
  if (!sent && send_error[d].empty())
    send_error[d] = "writing to rank " + std::to_string(job.dst) + " failed: " + std::strerror(errno) + " (it exited or died)";
  if (sent)
    complete(*job.work, nullptr, -1);
  else
    fail<PeerError>(*job.work, job.work->label + " failed: " + send_error[d]);
}

void Mailbox::State::send_loop() {
  for (;;) {
    SendJob job;
    {
      std::unique_lock<std::mutex> lock(sync.mu);
      send_cv.wait(lock, [&] { return (stop_sending && !sender_busy) || (!sends.empty() && !sender_busy); });
      if (sends.empty()) return;  // stopping, and everything issued was sent
      job = sends.front();
      sends.pop_front();
      sender_busy = true;
    }
    if (job.work)
      send_one(job);
    else
      connection(job.dst);
    std::lock_guard<std::mutex> lock(sync.mu);
    sender_busy = false;
  }
}

Mailbox::Mailbox(int rank, int size, const std::string& bind_address, const CommOptions& options)
    : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.rank = rank;
  s.size = size;
  s.options = options;
  s.gone.assign(static_cast<std::size_t>(size), "");
  s.outbound.assign(static_cast<std::size_t>(size), -1);
  s.send_error.assign(static_cast<std::size_t>(size), "");
  s.connecting.assign(static_cast<std::size_t>(size), false);
  s.out_lane.resize(static_cast<std::size_t>(size));
  s.token = wire::hex(wire::random_bytes(16));

  std::string gai_error;
  s.listener = net::listen_on(AF_UNSPEC, bind_address.c_str(), 0, net::ListenOptions{}, gai_error);
  if (!gai_error.empty()) throw ConfigError("point-to-point: cannot use address '" + bind_address + "' to listen on");
  const int port = s.listener ? s.listener.local_port() : -1;
  if (port <= 0 || ::pipe2(s.wake, O_CLOEXEC | O_NONBLOCK) != 0)
    throw ConfigError("point-to-point: cannot listen on " + bind_address + ": " + std::strerror(errno));
  std::ostringstream address;
  address << bind_address << " " << port << " " << s.token;
  s.address = address.str();
  s.reader = std::thread([&s] { s.read_loop(); });
  s.sender = std::thread([&s] { s.send_loop(); });
}

void Mailbox::cancel_recvs(const std::string& why) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.sync.mu);
  for (auto& p : s.posted) s.fail<PeerError>(*p.work, p.work->label + " cancelled: " + why);
  s.posted.clear();
}

Mailbox::~Mailbox() {
  State& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.sync.mu);
    s.stop_sending = true;  // what was issued is still sent: the peers expect it
  }
  s.send_cv.notify_all();
  s.sender.join();
  {
    std::lock_guard<std::mutex> lock(s.sync.mu);
    s.stop_reading = true;
  }
  s.wake_reader();
  s.reader.join();
  for (auto& r : s.lanes) {
    r->stop.store(true);
    r->lane->wake();
    r->thread.join();
  }
  {
    std::lock_guard<std::mutex> lock(s.sync.mu);
    for (auto& p : s.posted) s.fail<Error>(*p.work, p.work->label + " cannot finish: its communicator was destroyed");
    s.posted.clear();
  }
  for (const auto& in : s.inbound) ::close(in.fd);
  for (int fd : s.outbound)
    if (fd >= 0) ::close(fd);
  ::close(s.wake[0]);
  ::close(s.wake[1]);
}

const std::string& Mailbox::address() const {
  return state_->address;
}

void Mailbox::set_machines(std::vector<int> machine_of) {
  if (!machine_of.empty() && machine_of.size() != static_cast<std::size_t>(state_->size))
    throw ConfigError("point-to-point: " + std::to_string(machine_of.size()) + " machines given for " +
                      std::to_string(state_->size) + " ranks");
  std::lock_guard<std::mutex> lock(state_->sync.mu);
  state_->machine_of = std::move(machine_of);
}

bool Mailbox::shares_memory_with(int dst) const {
  std::lock_guard<std::mutex> lock(state_->sync.mu);
  return dst >= 0 && dst < state_->size && state_->out_lane[static_cast<std::size_t>(dst)] != nullptr;
}

void Mailbox::set_lookup(Lookup lookup) {
  std::lock_guard<std::mutex> lock(state_->sync.mu);
  state_->lookup = std::move(lookup);
}

namespace {
void check_peer(int peer, int size, bool any_allowed, const char* call) {
  if ((any_allowed && peer == kAnySource) || (peer >= 0 && peer < size)) return;
  throw ConfigError(std::string(call) + ": rank " + std::to_string(peer) + " is outside 0.." + std::to_string(size - 1) +
                    (any_allowed ? " (or Communicator::kAnySource)" : ""));
}
}  // namespace

WorkPtr Mailbox::send(const void* buffer, std::size_t count, DType dtype, int dst, int tag, std::string description) {
  State& s = *state_;
  check_peer(dst, s.size, false, "send");
  if (buffer == nullptr && count > 0) throw ConfigError("send: buffer is null but count is " + std::to_string(count));
  if (description.size() > kMaxDescriptionBytes)
    throw ConfigError("send: a description of " + std::to_string(description.size()) + " bytes; at most " +
                      std::to_string(kMaxDescriptionBytes) + " travel in front of a message");
  auto w = std::make_shared<WorkState>();
  w->queue = &s.sync;
  w->label = "send of " + what_of(dtype_name(dtype), count) + " to rank " + std::to_string(dst) + " (tag " +
             std::to_string(tag) + ")";
  w->started = Clock::now();
  const SendJob job{w, buffer, count, dtype, dst, tag, std::move(description)};
  std::unique_lock<std::mutex> lock(s.sync.mu);
  const auto d = static_cast<std::size_t>(dst);
  // A small send to a connected peer with nothing queued is written on the caller's thread: it
  // fits the socket's buffer or the lane (the peer's reader drains either), and saves two thread
  // hand-offs.
  if (count * dtype_size(dtype) <= kCallerSendBytes && s.sends.empty() && !s.sender_busy && dst != s.rank &&
      s.outbound[d] >= 0 && s.send_error[d].empty()) {
    s.sender_busy = true;
    lock.unlock();
    s.send_one(job);
    lock.lock();
    s.sender_busy = false;
  } else {
    s.sends.push_back(job);
  }
  lock.unlock();
  s.send_cv.notify_one();
  return std::make_shared<Work>(w);
}

WorkPtr Mailbox::recv(void* buffer, std::size_t count, DType dtype, int src, int tag) {
  check_peer(src, state_->size, true, "recv");
  if (buffer == nullptr && count > 0) throw ConfigError("recv: buffer is null but count is " + std::to_string(count));
  return state_->post(PostedRecv{nullptr, buffer, count, dtype, src, tag, {}, nullptr}, what_of(dtype_name(dtype), count));
}

WorkPtr Mailbox::recv_placed(Place place, int src, int tag) {
  check_peer(src, state_->size, true, "recv");
  if (!place) throw ConfigError("recv_described: no function to say where the elements go");
  return state_->post(PostedRecv{nullptr, nullptr, 0, DType::f32, src, tag, {}, std::move(place)}, "a described message");
}

WorkPtr Mailbox::State::post(PostedRecv p, const std::string& what) {
  State& s = *this;
  const int src = p.src;
  auto w = std::make_shared<WorkState>();
  w->queue = &s.sync;
  w->label = "recv of " + what + " from " +
             (src == kAnySource ? std::string("any rank") : "rank " + std::to_string(src)) + " (tag " +
             std::to_string(p.tag) + ")";
  w->started = Clock::now();
  p.work = w;
  // A described recv may be posted long before it is needed (a pipeline posts a step's recvs when
  // the step begins): its waiter times it, not the mailbox.
  p.deadline = p.place ? Clock::time_point::max()
                       : Clock::now() + std::chrono::duration_cast<Clock::duration>(s.options.timeout);
  std::unique_lock<std::mutex> lock(s.sync.mu);
  auto it = std::find_if(s.unexpected.begin(), s.unexpected.end(), [&](const Message& m) { return p.takes(m.src, m.tag); });
  if (it != s.unexpected.end()) {
    s.take_kept(p, *it);
    s.unexpected.erase(it);
  } else if (src != kAnySource && !s.gone[static_cast<std::size_t>(src)].empty()) {
    s.fail<PeerError>(*w, w->label + " cannot finish: " + s.gone[static_cast<std::size_t>(src)]);
  } else {
    s.posted.push_back(std::move(p));
    // Open the connection to a named source that never sent to us, so that its death shows.
    const auto d = static_cast<std::size_t>(src);
    if (src != kAnySource && src != s.rank && s.outbound[d] < 0 && !s.connecting[d]) {
      s.connecting[d] = true;
      s.sends.push_back({nullptr, nullptr, 0, DType::f32, src, 0, {}});
      lock.unlock();
      s.send_cv.notify_one();
    }
  }
  return std::make_shared<Work>(w);
}

}  // namespace lockstep::comm
