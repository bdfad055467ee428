// The gloo backend: collectives over Gloo's TCP transport, for ranks on several machines.
//
// Address: each rank binds the numeric address of the interface that routes to the store (or
// the one GLOO_SOCKET_IFNAME / LOCKSTEP_GLOO_IFACE names; net_address.h) and publishes it under
// this communicator's prefix, so errors can name the peer behind an address. Gloo is never
// given a hostname: 0.0~git2022 crashes on one that does not resolve.
//
// Rendezvous: Gloo's full-mesh connect exchanges addresses through lockstep's authenticated
// StoreClient, watched so that a peer gone before its pairs connect is a PeerError within a
// second (gloo_connect.h). After that the store is not used while
// collectives run normally: each collective is tagged with its sequence number (Gloo matches
// messages by tag), and at checked positions (CommOptions::check_every) the ranks compare their
// collectives' signatures with a small Gloo all-gather of their own (SignatureCheck).
//
// Failure: a dead peer closes its sockets and Gloo reports an IoException within the TCP round
// trip. A peer that vanishes without closing (a network partition, a machine that lost power)
// is found by TCP keepalive on Gloo's own connections (set after the connect, on the sockets
// that lead to the published peer addresses): within about 2 x peer_check, every pending read
// and write fails. What neither catches (Gloo 0.0~git2022 can leave a send to a peer that has
// just died pending forever; ranks that issued different collectives may wait on each other;
// a rank that never arrives) the communicator's watchdog does: when a collective stalls for
// peer_check it calls on_stall, which looks at the peers' liveness keys and flight records on
// the store and, for a dead peer, a mismatch or the timeout, aborts the collective by shutting
// down the sockets to the peers, so Gloo's blocked call returns and run() throws the verdict.
// Every error is a PeerError, MismatchError or TimeoutError naming the rank(s), never a signal:
// SIGPIPE is ignored unless the program handles it.
//
// All-reduces go through a lockstep Mailbox (p2p/mailbox.h) of the backend's own, not Gloo, with
// its algorithms (p2p/mailbox_allreduce.h): small ones (at most kGatherAllreduceBytes, 512 KiB,
// gathered) as an all-gather and a sum in rank order, larger ones as a ring (LOCKSTEP_GLOO_RING=gloo
// keeps Gloo's for those). Gloo's
// event loop re-polls, level-triggered, a socket whose message arrived before its recv was
// posted, and on shared cores that spinning thread took ~2 ms of CPU per step of a 2 x 2
// PowerSGD job; the mailbox's reader drains every socket and sleeps. Its waits fail with the
// watchdog's verdict like Gloo's (abort cancels them).
//
// Dtypes: f16 and bf16 travel as 16 bits (half the bytes of f32) and are summed in f32, rounded
// to 16 bits at each hop of the ring (once for 2 ranks). reduce_scatter is an allreduce of
// the whole input keeping this rank's block (2x the minimal traffic: Gloo 0.0~git2022 has no
// functional reduce_scatter).
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/context.h>
#include <gloo/transport/tcp/device.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <type_traits>
#include <vector>

#include "backend.h"
#include "gloo_connect.h"
#include "liveness.h"
#include "net/socket.h"
#include "p2p/mailbox.h"
#include "p2p/mailbox_allreduce.h"
#include "lockstep/base/knobs.h"
#include "lockstep/base/log.h"
#include "lockstep/comm/flight_recorder.h"
#include "lockstep/comm/net_address.h"
#include "lockstep/error.h"

namespace lockstep::comm {
namespace {

// Between looks at the peers while Gloo's pairs connect (gloo_connect.h).
constexpr Seconds kConnectLook{1};

// Applies `f` elementwise: c[i] = f(a[i], b[i]).
template <typename T, typename F>
gloo::AllreduceOptions::Func elementwise(F f) {
  return [f](void* c, const void* a, const void* b, size_t n) {
    auto* out = static_cast<T*>(c);
    auto* x = static_cast<const T*>(a);
    auto* y = static_cast<const T*>(b);
    for (size_t i = 0; i < n; ++i) out[i] = f(x[i], y[i]);
  };
}

template <typename T>
gloo::AllreduceOptions::Func reduce_fn(ReduceOp op) {
  switch (op) {
    case ReduceOp::min:
      return [](void* c, const void* a, const void* b, size_t n) { gloo::min<T>(c, a, b, n); };
    case ReduceOp::max:
      return [](void* c, const void* a, const void* b, size_t n) { gloo::max<T>(c, a, b, n); };
    case ReduceOp::product:
      if constexpr (std::is_integral_v<T>)  // wraps on overflow, as torch's integer product does
        return elementwise<T>([](T x, T y) {
          using U = std::make_unsigned_t<T>;
          return static_cast<T>(static_cast<U>(x) * static_cast<U>(y));
        });
      else
        return [](void* c, const void* a, const void* b, size_t n) { gloo::product<T>(c, a, b, n); };
    case ReduceOp::band:
    case ReduceOp::bor:
    case ReduceOp::bxor:
      if constexpr (std::is_integral_v<T>) {  // the communicator refuses them for other types
        if (op == ReduceOp::band) return elementwise<T>([](T x, T y) { return T(x & y); });
        if (op == ReduceOp::bor) return elementwise<T>([](T x, T y) { return T(x | y); });
        return elementwise<T>([](T x, T y) { return T(x ^ y); });
      }
      [[fallthrough]];
    default: return [](void* c, const void* a, const void* b, size_t n) { gloo::sum<T>(c, a, b, n); };
  }
}

// 16-bit floats reduced in f32 and rounded back: Gloo only moves the bytes.
template <float (*Widen)(std::uint16_t), std::uint16_t (*Narrow)(float)>
gloo::AllreduceOptions::Func half_reduce_fn(ReduceOp op) {
  return [op](void* c, const void* a, const void* b, size_t n) {
    auto* out = static_cast<std::uint16_t*>(c);
    auto* x = static_cast<const std::uint16_t*>(a);
    auto* y = static_cast<const std::uint16_t*>(b);
    for (size_t i = 0; i < n; ++i) {
      const float u = Widen(x[i]), v = Widen(y[i]);
      switch (op) {
        case ReduceOp::min: out[i] = Narrow(std::min(u, v)); break;
        case ReduceOp::max: out[i] = Narrow(std::max(u, v)); break;
        case ReduceOp::product: out[i] = Narrow(u * v); break;
        default: out[i] = Narrow(u + v); break;
      }
    }
  };
}

// Gloo writes to sockets without MSG_NOSIGNAL: when a peer dies, the survivor's next write
// would raise SIGPIPE and kill it before it can report which rank died (Python ignores SIGPIPE
// at start-up, so PyTorch users never see this). Ignore SIGPIPE unless the program chose a
// handler itself; writes then fail with EPIPE, which Gloo reports as an IoException.
void ignore_sigpipe_unless_handled() {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) signal(SIGPIPE, SIG_IGN);
}

std::string peer_address(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "";
  char host[NI_MAXHOST] = "";
  ::getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, host, sizeof host, nullptr, 0, NI_NUMERICHOST);
  return host;
}

// Keepalive on the sockets that lead to peers (net/socket.h): a silent peer then fails every
// pending read and write. Returns those sockets.
std::vector<int> watch_connections(const std::set<int>& fds, const std::set<std::string>& peers,
                                   Seconds peer_check) {
  std::vector<int> watched;
  for (int fd : fds)
    if (peers.count(peer_address(fd))) {
      net::keep_alive(fd, static_cast<int>(peer_check.count()));
      watched.push_back(fd);
    }
  return watched;
}

class GlooBackend final : public Backend {
 public:
  explicit GlooBackend(const BackendContext& ctx)
      : rank_(ctx.rank),
        size_(ctx.size),
        options_(ctx.options),
        store_(ctx.store),
        prefix_(ctx.prefix),
        global_ranks_(ctx.global_ranks),
        machines_(ctx.locality.machines),
        checks_(ctx.options.check_every),
        alive_(ctx) {
    ignore_sigpipe_unless_handled();
    alive_.announce();
    bind_ = choose_bind_address(store_->options().host);
    store_->set(prefix_ + "addr/" + std::to_string(rank_), bind_.address);
    open_mailbox_path();
    connect();
    agree_on_mailbox_path_or_name_who_went();
  }

  const std::string& name() const override {
    static const std::string kName = "gloo";
    return kName;
  }

  void run(const Collective& c) override {
    const auto begin = Clock::now();
    running_ = &c;
    try {
      checks_.before(c, size_, rank_, [&](const std::uint64_t* mine, std::uint64_t* all, std::size_t words) {
        gather_words(mine, all, words, tag(c, words == 2 ? 1 : 2));
      });
      if (c.codec && c.kind == CollectiveKind::allreduce && machines_ > 1) {
        sent_bytes_ += allreduce_through_codec(c);
      } else {
        dispatch(c);
        sent_bytes_ += bytes_sent(c);
      }
    } catch (const gloo::Exception& e) {
      if (std::exception_ptr verdict = abort_verdict()) std::rethrow_exception(verdict);
      rethrow(e, c);
    } catch (const MismatchError& e) {
      mark_failed("mismatch", e.what());
      throw;
    }
    sent_nanoseconds_ += static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - begin).count());
  }

  NetworkStats network_stats() const override {
    return {sent_bytes_.load(), static_cast<double>(sent_nanoseconds_.load()) * 1e-9, machines_};
  }

  // The watchdog's verdict on a stalled collective: a dead peer, a peer that issued something
  // else at this position, or the timeout. Store reads here, only while stalled.
  void on_stall(const Collective& c, Seconds running) override {
    if (abort_verdict()) return;
    if (std::string dead = alive_.dead_now(); !dead.empty())
      return abort<PeerError>("gloo: " + dead + " while rank " + std::to_string(global(rank_)) + " was in " +
                              c.describe() + "; the job cannot continue");
    const auto records = peer_records();
    if (std::string differs = mismatch_in(records, c); !differs.empty()) return abort<MismatchError>(differs);
    if (running >= options_.timeout)
      return abort<TimeoutError>("gloo: " + c.describe() + " timed out after " +
                                 log::seconds_text(options_.timeout.count()) + " on rank " +
                                 std::to_string(global(rank_)) + "; the others: " + who_is_behind(records, c));
  }

 private:
  // Makes the collective in flight (or the next one) fail with `verdict`: shutting down the
  // sockets to the peers wakes every Gloo call blocked on them with an IoException.
  // The verdict is announced on the store before the sockets go, so a peer whose connection
  // breaks can tell a mismatch from a death (peer_verdict).
  template <typename Verdict>
  void abort(const std::string& what) {
    {
      std::lock_guard<std::mutex> lock(abort_mu_);
      if (abort_) return;
      abort_ = std::make_exception_ptr(Verdict(what));
    }
    LOCKSTEP_LOG(debug, gloo) << "aborting: " << what;
    mark_failed(std::is_same_v<Verdict, MismatchError> ? "mismatch" : "error", what);
    for (int fd : peer_sockets_) ::shutdown(fd, SHUT_RDWR);
    if (mailbox_) mailbox_->cancel_recvs(what);
  }

  std::exception_ptr abort_verdict() {
    std::lock_guard<std::mutex> lock(abort_mu_);
    return abort_;
  }

  // The peers' flight records (by this backend's rank), as far as they published them.
  std::vector<std::optional<FlightRecord>> peer_records() {
    std::vector<std::optional<FlightRecord>> out(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      try {
        if (auto text = store_->try_get(flight_key(options_.name, global(r)), options_.peer_check))
          out[static_cast<std::size_t>(r)] = FlightRecord::from_json(*text);
      } catch (const Error&) {
        // A record that cannot be read tells nothing; the liveness look and the timeout remain.
      }
    }
    return out;
  }

  // "" unless a peer's record shows a different collective at c's position.
  std::string mismatch_in(const std::vector<std::optional<FlightRecord>>& records, const Collective& c) {
    for (int r = 0; r < size_; ++r) {
      const auto& rec = records[static_cast<std::size_t>(r)];
      const FlightEntry* theirs = rec ? rec->find(c.sequence) : nullptr;
      if (theirs && theirs->signature != c.signature())
        return "gloo: collective #" + std::to_string(c.sequence) + " differs across ranks: rank " +
               std::to_string(global(rank_)) + " issued " + describe_signature(c.signature()) + " but rank " +
               std::to_string(global(r)) + " issued " + describe_signature(theirs->signature) +
               " (found when it stalled). Every rank must issue the same collectives in the same order";
    }
    return "";
  }

  std::string who_is_behind(const std::vector<std::optional<FlightRecord>>& records, const Collective& c) {
    const double now = wall_seconds_now();
    std::string out;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      const auto& rec = records[static_cast<std::size_t>(r)];
      out += (out.empty() ? "rank " : "; rank ") + std::to_string(global(r)) + " " +
             (rec ? rec->doing(now) : "published no record (busy outside collectives, or stalled for less than "
                                      "LOCKSTEP_PEER_CHECK)");
    }
    return out + ". A rank that is idle or in an earlier collective is behind: stuck in compute, or issuing "
                 "fewer collectives than the others; raise LOCKSTEP_TIMEOUT if it is just slow (#" +
           std::to_string(c.sequence) + " is this rank's)";
  }

  // An all-gather of a few 64-bit words over Gloo, for the signature checks.
  void gather_words(const std::uint64_t* mine, std::uint64_t* all, std::size_t words, std::uint32_t t) {
    std::vector<std::uint64_t> in(mine, mine + words);
    gloo::AllgatherOptions opts(context_);
    opts.setInput(in.data(), in.size());
    opts.setOutput(all, words * static_cast<std::size_t>(size_));
    opts.setTag(t);
    gloo::allgather(opts);
  }

  void connect() {
    const std::set<int> before = open_sockets();
    gloo::transport::tcp::attr attr;
    attr.hostname = bind_.address;  // numeric: Gloo resolves it without DNS
    MeshOptions mesh;
    mesh.rank = rank_;
    mesh.size = size_;
    mesh.global_rank = global(rank_);
    mesh.prefix = prefix_;
    mesh.store_timeout = options_.timeout;
    // A backstop behind the watchdog, which names the ranks that are behind at options_.timeout.
    mesh.gloo_timeout =
        std::chrono::duration_cast<std::chrono::milliseconds>(options_.timeout + 2 * options_.peer_check);
    mesh.look_every = std::min(options_.peer_check, kConnectLook);
    try {
      device_ = gloo::transport::tcp::CreateDevice(attr);
      context_ = connect_full_mesh(mesh, store_, device_, alive_);
    } catch (const PeerError& e) {
      mark_failed("error", e.what());  // peers waiting for this rank's connections give up too
      throw;
    } catch (const gloo::Exception& e) {
      mark_failed("error", first_line(e.what()));
      throw PeerError("gloo: rank " + std::to_string(global(rank_)) + " bound " + bind_.describe() +
                      " but could not connect to its peers: " + first_line(e.what()) +
                      " (if the machines share another network, name its interface with GLOO_SOCKET_IFNAME)");
    }
    std::set<int> added;
    for (int fd : open_sockets())
      if (!before.count(fd)) added.insert(fd);
    peer_sockets_ = watch_connections(added, peer_addresses(), options_.peer_check);
  }

  // The mailbox for the all-reduces, its address on the store before Gloo's rendezvous (so
  // every peer's is there by the first send). Without a port it stays closed, and...
  void open_mailbox_path() {
    if (size_ < 2) return;
    CommOptions backstop = options_;  // as Gloo's own: the watchdog's verdict comes first
    backstop.timeout = options_.timeout + 2 * options_.peer_check;
    try {
      mailbox_ = std::make_unique<Mailbox>(rank_, size_, bind_.address, backstop);
    } catch (const ConfigError& e) {
      LOCKSTEP_LOG(debug, gloo) << "all-reduces through Gloo: " << e.what();
      return;
    }
    store_->set(prefix_ + "small/" + std::to_string(rank_), mailbox_->address());
    mailbox_->set_lookup([store = store_, prefix = prefix_, timeout = options_.timeout](int r) {
      return store->get(prefix + "small/" + std::to_string(r), timeout);
    });
  }

  // ... then every rank leaves it closed: all take the same path for every collective. Large
  // all-reduces go through it too (MailboxAllreduce::ring) if every rank asks for that.
  void agree_on_mailbox_path() {
    if (size_ < 2) return;
    const std::string& ring = options_.gloo_ring;
    if (ring != "mailbox" && ring != "gloo")
      throw ConfigError("gloo ring '" + ring + "' (" + knobs::kGlooRing.name + "): use mailbox or gloo");
    std::uint64_t mine = (mailbox_ ? 1 : 0) | (ring == "mailbox" ? 2 : 0);
    std::vector<std::uint64_t> all(static_cast<std::size_t>(size_));
    gather_words(&mine, all.data(), 1, std::numeric_limits<std::uint32_t>::max());
    ring_ = true;
    for (std::uint64_t word : all) {
      if (!(word & 1)) mailbox_.reset();
      ring_ = ring_ && (word & 2);
    }
    if (!mailbox_) return;
    MailboxAllreduce::Hooks hooks{[this] { throw_if_aborted(); },
                                  [this](MailboxAllreduce::Exchange& e, std::size_t count) { await(e, count); }};
    mailbox_allreduce_ = std::make_unique<MailboxAllreduce>(*mailbox_, rank_, size_, std::move(hooks));
  }

  // The first exchange over the new connections: a peer that died just after connecting (or one
  // that gave up on its own connect and closed them) breaks it. A PeerError naming the dead, as
  // for a collective, so that an elastic membership treats it as any loss.
  void agree_on_mailbox_path_or_name_who_went() {
    try {
      agree_on_mailbox_path();
    } catch (const gloo::Exception& e) {
      const std::string what = first_line(e.what());
      mark_failed("error", what);
      throw PeerError("gloo: " + who_went(what) + " while rank " + std::to_string(global(rank_)) +
                      " agreed on its all-reduce path with its peers (" + what + "); the job cannot continue");
    }
  }

  std::set<std::string> peer_addresses() {
    std::set<std::string> out;
    for (int r = 0; r < size_; ++r)
      if (r != rank_) out.insert(address_of(r));
    return out;
  }

  std::string address_of(int r) {
    auto it = addresses_.find(r);
    if (it != addresses_.end()) return it->second;
    return addresses_[r] = store_->get(prefix_ + "addr/" + std::to_string(r), options_.timeout);
  }

  static std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }
  int global(int r) const { return global_ranks_.empty() ? r : global_ranks_[static_cast<std::size_t>(r)]; }

  // Gloo's error as lockstep's: a TimeoutError, or a PeerError naming the peer that went.
  [[noreturn]] void rethrow(const gloo::Exception& e, const Collective& c) {
    const std::string what = first_line(e.what());
    mark_failed("error", what);
    if (std::string found = peer_found_mismatch(); !found.empty()) throw MismatchError(found);
    if (what.find("imed out") != std::string::npos && what.find("Connection timed out") == std::string::npos)
      throw TimeoutError("gloo: " + c.describe() + " timed out after " + log::seconds_text(options_.timeout.count()) +
                         " on rank " + std::to_string(global(rank_)) + ": " + what);
    throw PeerError("gloo: " + who_went(what) + " while rank " + std::to_string(global(rank_)) + " was in " +
                    c.describe() + " (" + what + "); the job cannot continue");
  }

  // The store's liveness keys name a dead rank exactly, once the store has noticed (it may
  // lag Gloo by a moment); the address in Gloo's message names a machine at once, and a rank
  // when only one rank has that address. A partition leaves the keys in place for a while:
  // then the address is all there is.
  std::string who_went(const std::string& what) {
    const auto [by_address, ranks] = ranks_at_addresses_in(what);
    const std::string dead = alive_.dead_now();
    if (!dead.empty() && (alive_.store_reachable() || by_address.empty())) return dead;
    if (ranks == 1 || !alive_.store_reachable()) return by_address;
    if (std::string later = alive_.dead_within(options_.peer_check); !later.empty()) return later;
    return by_address.empty() ? "a peer closed its connection" : by_address;
  }

  // "the connection to 10.0.0.2 (ranks 2, 3) broke" when Gloo's message names a peer's address
  // (ranks on one machine share it).
  // Returns the description and how many ranks it names.
  std::pair<std::string, int> ranks_at_addresses_in(const std::string& what) {
    std::map<std::string, std::string> at;
    int count = 0;
    for (const auto& [r, address] : addresses_)
      if (r != rank_ && what.find("[" + address + "]") != std::string::npos) {
        at[address] += (at[address].empty() ? "" : ", ") + std::to_string(global(r));
        ++count;
      }
    std::string found;
    for (const auto& [address, ranks] : at)
      found += (found.empty() ? "" : ", ") + address + " (rank" + (ranks.find(',') != std::string::npos ? "s " : " ") +
               ranks + ")";
    if (found.empty()) return {"", 0};
    return {"the connection to " + found + " broke: the peer died or is unreachable", count};
  }

  void mark_failed(const std::string& kind, const std::string& what) { alive_.mark_failed(kind, what); }

  // A peer's MismatchError, when one broke the connection because it found the ranks issued
  // different collectives: this rank's collective was the other half of it. "" otherwise.
  std::string peer_found_mismatch() {
    try {
      for (int r = 0; r < size_; ++r) {
        if (r == rank_) continue;
        auto failed = alive_.failure_of(r);
        if (failed && failed->rfind("mismatch\n", 0) == 0)
          return failed->substr(9) + " (found by rank " + std::to_string(global(r)) + ")";
      }
    } catch (const Error&) {
      // No store: the connection error stands.
    }
    return "";
  }

  // What this rank sends for `c` over Gloo's algorithms: a ring all-reduce sends 2 (W-1)/W of
  // the data, an all-gather (W-1) blocks, a broadcast root (W-1) copies.
  std::uint64_t bytes_sent(const Collective& c) const {
    const double w = size_, n = static_cast<double>(c.count * dtype_size(c.dtype));
    switch (c.kind) {
      case CollectiveKind::allreduce: return static_cast<std::uint64_t>(2 * (w - 1) / w * n);
      case CollectiveKind::reduce_scatter: return static_cast<std::uint64_t>(2 * (w - 1) * n);
      case CollectiveKind::allgather: return static_cast<std::uint64_t>((w - 1) * n);
      case CollectiveKind::broadcast: return rank_ == c.root ? static_cast<std::uint64_t>((w - 1) * n) : 0;
      case CollectiveKind::barrier: return 0;
    }
    return 0;
  }

  // Gloo matches messages by tag: the collective's own (part 0), its signature checks' (1, 2)
  // and a codec's exchanges (kFirstCodecPart on).
  static constexpr std::uint32_t kTagParts = 16, kFirstCodecPart = 3;
  std::uint32_t tag(const Collective& c, std::uint32_t part) const {
    return static_cast<std::uint32_t>((c.sequence * kTagParts) | part);
  }

  // Every rank is a holder of the whole buffer (comm/codec.h); returns the bytes it sent.
  std::uint64_t allreduce_through_codec(const Collective& c) {
    if (c.send != c.recv) std::memcpy(c.recv, c.send, c.count * dtype_size(c.dtype));
    Holders holders(*this, c);
    (*c.codec)(static_cast<float*>(c.recv), 0, c.count, holders);
    if (c.op == ReduceOp::avg) divide_elements(c.dtype, c.recv, c.count, size_);
    return holders.sent;
  }

  // The codec's exchanges, each under the next tag part of the collective.
  class Holders final : public Across {
   public:
    Holders(GlooBackend& gloo, const Collective& c) : gloo_(gloo), c_(c) {}
    int machines() const override { return gloo_.size_; }
    int machine() const override { return gloo_.rank_; }
    void sum(void* buffer, std::size_t count, DType dtype) override {
      if (count == 0) return;
      gloo_.allreduce(buffer, buffer, count, dtype, ReduceOp::sum, next_tag());
      sent += static_cast<std::uint64_t>(2.0 * (gloo_.size_ - 1) / gloo_.size_ *
                                         static_cast<double>(count * dtype_size(dtype)));
    }
    void gather(const void* mine, void* all, std::size_t bytes) override {
      if (bytes == 0) return;
      std::vector<std::uint8_t> in(static_cast<const std::uint8_t*>(mine), static_cast<const std::uint8_t*>(mine) + bytes);
      gloo::AllgatherOptions opts(gloo_.context_);
      opts.setInput(in.data(), bytes);
      opts.setOutput(static_cast<std::uint8_t*>(all), bytes * static_cast<std::size_t>(gloo_.size_));
      opts.setTag(next_tag());
      gloo::allgather(opts);
      sent += static_cast<std::uint64_t>(gloo_.size_ - 1) * bytes;
    }
    std::uint64_t sent = 0;

   private:
    std::uint32_t next_tag() {
      if (part_ >= kTagParts)
        throw Error("a codec made more than " + std::to_string(kTagParts - kFirstCodecPart) +
                    " exchanges in one all-reduce (" + c_.describe() + ")");
      return gloo_.tag(c_, part_++);
    }
    GlooBackend& gloo_;
    const Collective& c_;
    std::uint32_t part_ = kFirstCodecPart;
  };

  void dispatch(const Collective& c) {
    const std::size_t esize = dtype_size(c.dtype);
    switch (c.kind) {
      case CollectiveKind::barrier: {
        gloo::BarrierOptions opts(context_);
        opts.setTag(tag(c, 0));
        gloo::barrier(opts);
        return;
      }
      case CollectiveKind::broadcast: {
        if (c.count == 0) return;
        gloo::BroadcastOptions opts(context_);
        auto* p = static_cast<std::uint8_t*>(c.recv);
        if (rank_ == c.root) opts.setInput(p, c.count * esize);
        opts.setOutput(p, c.count * esize);
        opts.setRoot(c.root);
        opts.setTag(tag(c, 0));
        gloo::broadcast(opts);
        return;
      }
      case CollectiveKind::allgather: {
        if (c.count == 0) return;
        std::vector<std::uint8_t> in(static_cast<const std::uint8_t*>(c.send),
                                     static_cast<const std::uint8_t*>(c.send) + c.count * esize);
        gloo::AllgatherOptions opts(context_);
        opts.setInput(in.data(), in.size());
        opts.setOutput(static_cast<std::uint8_t*>(c.recv), in.size() * static_cast<std::size_t>(size_));
        opts.setTag(tag(c, 0));
        gloo::allgather(opts);
        return;
      }
      case CollectiveKind::allreduce: return allreduce(c.send, c.recv, c.count, c.dtype, c.op, tag(c, 0));
      case CollectiveKind::reduce_scatter: {
        const std::size_t total = c.count * static_cast<std::size_t>(size_);
        std::vector<char> full(total * esize);
        allreduce(c.send, full.data(), total, c.dtype, c.op, tag(c, 0));
        std::memcpy(c.recv, full.data() + static_cast<std::size_t>(rank_) * c.count * esize, c.count * esize);
        return;
      }
    }
  }

  void allreduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op, std::uint32_t t) {
    if (count == 0) return;
    reduce_on_the_wire(send, recv, count, dtype, op, t);
    if (op == ReduceOp::avg) divide_elements(dtype, recv, count, size_);
  }

  void reduce_on_the_wire(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                          std::uint32_t t) {
    switch (dtype) {
      case DType::f32: return allreduce_typed<float>(send, recv, count, dtype, reduce_fn<float>(op), t);
      case DType::f64: return allreduce_typed<double>(send, recv, count, dtype, reduce_fn<double>(op), t);
      case DType::i32:
        return allreduce_typed<std::int32_t>(send, recv, count, dtype, reduce_fn<std::int32_t>(op), t);
      case DType::i64:
        return allreduce_typed<std::int64_t>(send, recv, count, dtype, reduce_fn<std::int64_t>(op), t);
      case DType::f16:
        return allreduce_typed<std::uint16_t>(send, recv, count, dtype,
                                              half_reduce_fn<f16_to_f32, f32_to_f16>(op), t);
      case DType::bf16:
        return allreduce_typed<std::uint16_t>(send, recv, count, dtype,
                                              half_reduce_fn<bf16_to_f32, f32_to_bf16>(op), t);
    }
  }

  // Small all-reduces as one all-gather and a sum in rank order (the same bits on every rank):
  // n - 1 ring steps where a ring all-reduce takes 2 (n - 1), each a few messages and a
  // wake-up of its event loop, for (n - 1) / (2 (n - 1) / n) = n / 2 times the bytes. Measured
  // (bench/RESULTS.md): 2 ranks on loopback, 256 KiB each took 232 us this way against 600-1070
  // through Gloo's ring; PowerSGD's factors on 4 machines x 1 (~80 KiB each, 320 KiB gathered)
  // trained 2.86x PyTorch DDP's throughput at 1 Gbit/s against 1.98x at a 128 KiB limit. The
  // extra bytes grow with n (8 ranks: 336 KiB more than the ring at this limit, 2.7 ms at
  // 1 Gbit/s); 8 ranks on one host's 2 cores took 726-1438 us up to 64 KiB against torch
  // gloo's ~20 ms.
  static constexpr std::size_t kGatherAllreduceBytes = 512 * 1024;

  void throw_if_aborted() {
    if (std::exception_ptr verdict = abort_verdict()) std::rethrow_exception(verdict);
  }

  // Waits for one exchange of the mailbox path (peer, send or recv). A size mismatch is a
  // MismatchError naming both ranks, and so is a peer that left having found one; any other
  // failure is a PeerError. Pending recvs are cancelled first (none may write into the caller's
  // buffers later), and the watchdog's verdict wins.
  void await(MailboxAllreduce::Exchange& exchange, std::size_t count) {
    for (auto& [r, work] : exchange) {
      try {
        work->wait();
      } catch (const MismatchError&) {
        mailbox_->cancel_recvs("the all-reduce failed");
        if (std::exception_ptr verdict = abort_verdict()) std::rethrow_exception(verdict);
        const std::string what = "gloo: rank " + std::to_string(global(r)) + " sent a different number of " +
                                 "elements than rank " + std::to_string(global(rank_)) + " expects (" +
                                 std::to_string(count) + ") in " + running_->describe() +
                                 ": the ranks issued different collectives";
        mark_failed("mismatch", what);
        throw MismatchError(what);
      } catch (const Error& e) {
        mailbox_->cancel_recvs("the all-reduce failed");
        if (std::exception_ptr verdict = abort_verdict()) std::rethrow_exception(verdict);
        // A peer that found the ranks' collectives differ leaves at once: its verdict is ours.
        if (std::string found = peer_found_mismatch(); !found.empty()) throw MismatchError(found);
        mark_failed("error", e.what());
        const std::string dead = alive_.dead_now();
        throw PeerError("gloo: " + (dead.empty() ? "rank " + std::to_string(global(r)) + " broke off" : dead) +
                        " while rank " + std::to_string(global(rank_)) + " was in " + running_->describe() +
                        "; the job cannot continue (" + e.what() + ")");
      }
    }
  }

  // Through Gloo's all-gather where the mailbox could not open.
  template <typename T>
  void allreduce_by_gathering(const void* send, T* out, std::size_t count, const gloo::AllreduceOptions::Func& fn,
                              std::uint32_t t) {
    const std::size_t n = static_cast<std::size_t>(size_);
    if (gathered_.size() < count * n * sizeof(T)) gathered_.resize(count * n * sizeof(T));
    T* all = reinterpret_cast<T*>(gathered_.data());  // new[]'s alignment suits every T
    gloo::AllgatherOptions opts(context_);
    opts.setInput(const_cast<T*>(static_cast<const T*>(send)), count);
    opts.setOutput(all, count * n);
    opts.setTag(t);
    gloo::allgather(opts);
    std::memcpy(out, all, count * sizeof(T));
    for (std::size_t r = 1; r < n; ++r) fn(out, out, all + r * count, count);
  }

  template <typename T>
  void allreduce_typed(const void* send, void* recv, std::size_t count, DType dtype,
                       gloo::AllreduceOptions::Func fn, std::uint32_t t) {
    T* out = static_cast<T*>(recv);
    const bool small = count * sizeof(T) * static_cast<std::size_t>(size_) <= kGatherAllreduceBytes;
    if (small && mailbox_allreduce_) return mailbox_allreduce_->gather_sum(send, out, count, dtype, fn, t);
    if (small) return allreduce_by_gathering(send, out, count, fn, t);
    if (mailbox_allreduce_ && ring_ && count >= static_cast<std::size_t>(size_))
      return mailbox_allreduce_->ring(send, out, count, dtype, fn, t);
    gloo::AllreduceOptions opts(context_);
    // Out of place, Gloo copies each segment of the input just before it goes out (in cache,
    // overlapped with the transfers); a whole copy first cost 1.5x the time at 1 MiB.
    if (send != recv) opts.setInput(const_cast<T*>(static_cast<const T*>(send)), count);
    opts.setOutput(out, count);
    opts.setReduceFunction(std::move(fn));
    opts.setTag(t);
    gloo::allreduce(opts);
  }

  int rank_, size_;
  CommOptions options_;
  std::shared_ptr<StoreClient> store_;
  std::string prefix_;
  std::vector<int> global_ranks_;  // how messages name ranks (BackendContext::global_ranks)
  BindAddress bind_;
  std::map<int, std::string> addresses_;  // peers' bound addresses, read on demand
  int machines_ = 1;
  SignatureCheck checks_;
  PeerLiveness alive_;  // the store's verdict on the peers (liveness.h)
  std::vector<int> peer_sockets_;  // Gloo's connections to the peers (shut down to abort)
  std::mutex abort_mu_;
  std::exception_ptr abort_;  // the watchdog's verdict, once it aborted
  std::atomic<std::uint64_t> sent_bytes_{0}, sent_nanoseconds_{0};
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::Context> context_;
  std::unique_ptr<Mailbox> mailbox_;       // all-reduces (large ones if ring_); null: through Gloo
  std::unique_ptr<MailboxAllreduce> mailbox_allreduce_;  // its algorithms
  std::vector<std::byte> gathered_;        // every rank's part of a small one, through Gloo
  bool ring_ = false;                      // larger all-reduces on the mailbox too (LOCKSTEP_GLOO_RING)
  const Collective* running_ = nullptr;  // run()'s collective, for the mailbox path's errors
};

}  // namespace

std::unique_ptr<Backend> make_gloo_backend(const BackendContext& ctx) {
  return std::make_unique<GlooBackend>(ctx);
}

}  // namespace lockstep::comm
