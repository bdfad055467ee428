// The gloo backend: collectives over Gloo's TCP transport, for ranks on several machines.
//
// Rendezvous: Gloo's full-mesh connect exchanges addresses through a gloo::rendezvous::Store;
// ours adapts lockstep's authenticated StoreClient under this communicator's key prefix.
// Each collective is tagged with its sequence number (Gloo matches messages by tag), runs with
// the communicator's timeout, and, when check_collectives is on, is preceded by an exchange of
// signatures through the store (see check()) so ranks that disagree raise MismatchError instead
// of waiting on messages that never come. A dead peer closes its sockets: Gloo reports an IoException within
// the TCP round trip, which becomes a PeerError.
//
// Dtypes: f16/bf16 are widened to f32 for reductions (reduced in f32, rounded once); reduce_scatter
// is an allreduce of the whole input, keeping this rank's block (2x the minimal traffic:
// Gloo 0.0~git2022 has no functional reduce_scatter).
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <signal.h>
#include <unistd.h>

#include <cstring>
#include <thread>
#include <vector>

#include "backend.h"
#include "lockstep/base/knobs.h"
#include "lockstep/base/log.h"
#include "lockstep/error.h"

namespace lockstep::comm {
namespace {

class GlooStoreAdapter : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(std::shared_ptr<StoreClient> store, std::string prefix, Seconds timeout)
      : store_(std::move(store)), prefix_(std::move(prefix)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(prefix_ + key, std::string(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    std::string v = store_->get(prefix_ + key, timeout_);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, std::chrono::milliseconds(0)); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override {
    std::vector<std::string> full;
    for (const auto& k : keys) full.push_back(prefix_ + k);
    store_->wait(full, timeout_);
  }

 private:
  std::shared_ptr<StoreClient> store_;
  std::string prefix_;
  Seconds timeout_;
};

template <typename T>
gloo::AllreduceOptions::Func reduce_fn(ReduceOp op) {
  switch (op) {
    case ReduceOp::min:
      return [](void* c, const void* a, const void* b, size_t n) { gloo::min<T>(c, a, b, n); };
    case ReduceOp::max:
      return [](void* c, const void* a, const void* b, size_t n) { gloo::max<T>(c, a, b, n); };
    default: return [](void* c, const void* a, const void* b, size_t n) { gloo::sum<T>(c, a, b, n); };
  }
}

// Gloo writes to sockets without MSG_NOSIGNAL: when a peer dies, the survivor's next write
// would raise SIGPIPE and kill it before it can report which rank died (Python ignores SIGPIPE
// at start-up, so PyTorch users never see this). Ignore SIGPIPE unless the program chose a
// handler itself; writes then fail with EPIPE, which Gloo reports as an IoException.
void ignore_sigpipe_unless_handled() {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    signal(SIGPIPE, SIG_IGN);
  }
}

class GlooBackend final : public Backend {
 public:
  explicit GlooBackend(const BackendContext& ctx)
      : rank_(ctx.rank), size_(ctx.size), options_(ctx.options), store_(ctx.store), prefix_(ctx.prefix) {
    ignore_sigpipe_unless_handled();
    store_->set_ephemeral(prefix_ + "alive/" + std::to_string(rank_), "1");
    gloo::transport::tcp::attr attr;
    if (auto iface = knobs::get(knobs::kGlooIface)) {
      attr.iface = *iface;
    } else {
      char host[256] = {};
      ::gethostname(host, sizeof host - 1);
      attr.hostname = host;
    }
    try {
      device_ = gloo::transport::tcp::CreateDevice(attr);
      auto context = std::make_shared<gloo::rendezvous::Context>(rank_, size_);
      GlooStoreAdapter store(ctx.store, ctx.prefix, options_.timeout);
      context->setTimeout(std::chrono::duration_cast<std::chrono::milliseconds>(options_.timeout));
      context->connectFullMesh(store, device_);
      context_ = context;
    } catch (const gloo::Exception& e) {
      throw PeerError(std::string("gloo: rank ") + std::to_string(rank_) +
                      " could not connect to its peers: " + e.what() +
                      " (set LOCKSTEP_GLOO_IFACE to the network interface the ranks share)");
    }
  }

  const std::string& name() const override {
    static const std::string kName = "gloo";
    return kName;
  }

  void run(const Collective& c) override {
    try {
      if (options_.check_collectives && size_ > 1) check(c);
      dispatch(c);
    } catch (const gloo::Exception& e) {
      std::string what = e.what();
      if (what.find("Timed out") != std::string::npos || what.find("timed out") != std::string::npos) {
        mark_failed();
        throw TimeoutError("gloo: " + c.describe() + " timed out after " +
                           log::seconds_text(options_.timeout.count()) + " on rank " + std::to_string(rank_) +
                           ": " + what);
      }
      std::string dead = dead_ranks();
      mark_failed();
      throw PeerError("gloo: " + dead + " while rank " + std::to_string(rank_) + " was in " + c.describe() +
                      " (" + what + "); the job cannot continue");
    }
  }

  // Tells peers that this rank is leaving because of an error, not dying: they must not blame
  // it when its ephemeral key vanishes.
  void mark_failed() {
    try {
      store_->set(prefix_ + "failed/" + std::to_string(rank_), "1");
    } catch (const Error&) {
      // The store is gone too; peers will see their own errors.
    }
  }

  // Which peers died: their ephemeral store keys vanish when their processes' sockets close.
  // The store may learn of a death a moment after gloo did, so look for up to peer_check.
  std::string dead_ranks() {
    auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(options_.peer_check);
    for (;;) {
      std::string dead = dead_ranks_now();
      if (!dead.empty()) return dead;
      if (Clock::now() >= until) return "a peer closed its connection";
      // Bounded poll of a diagnostic, after the failure is already certain.
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

 private:
  std::uint32_t tag(const Collective& c, std::uint32_t part) const {
    return static_cast<std::uint32_t>((c.sequence << 2) | part);
  }

  // The descriptors go through the store, not through Gloo: Gloo 0.0~git2022 can leave a send
  // to a peer that has just died pending forever (seen as a rare hang of the survivor in the
  // kill test), while a store wait can be cut into peer_check slices with a liveness look
  // between them. A dead peer is then a PeerError within about peer_check.
  void check(const Collective& c) {
    const std::string base = prefix_ + "chk/";
    const std::string seq = std::to_string(c.sequence);
    store_->set(base + seq + "/" + std::to_string(rank_), std::to_string(c.signature()));
    std::vector<std::string> keys;
    for (int r = 0; r < size_; ++r)
      if (r != rank_) keys.push_back(base + seq + "/" + std::to_string(r));
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(options_.timeout);
    const Seconds slice = std::min(options_.peer_check, options_.timeout);
    for (;;) {
      try {
        store_->wait(keys, slice);
        break;
      } catch (const TimeoutError&) {
        std::string dead = dead_ranks_now();
        if (!dead.empty()) {
          mark_failed();
          throw PeerError("gloo: " + dead + " while rank " + std::to_string(rank_) + " was in " +
                          c.describe() + "; the job cannot continue");
        }
        if (Clock::now() >= deadline) {
          mark_failed();
          throw TimeoutError("gloo: " + c.describe() + " timed out after " +
                             log::seconds_text(options_.timeout.count()) + " on rank " +
                             std::to_string(rank_) + " waiting for the other ranks to reach it");
        }
      }
    }
    std::vector<std::uint64_t> sigs(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r)
      sigs[static_cast<std::size_t>(r)] =
          r == rank_ ? c.signature() : std::stoull(store_->get(base + seq + "/" + std::to_string(r)));
    // Every peer has set its key for this collective, so it has read every key of the one
    // before the previous: this rank's can go.
    if (c.sequence >= 2) store_->remove(base + std::to_string(c.sequence - 2) + "/" + std::to_string(rank_));
    check_signatures(c, sigs.data(), size_, rank_);
  }

  // Peers whose liveness key is gone (and that did not announce a failure), now: "" if none.
  std::string dead_ranks_now() {
    std::string dead;
    int count = 0;
    try {
      for (int r = 0; r < size_; ++r) {
        std::string id = std::to_string(r);
        if (r != rank_ && !store_->try_get(prefix_ + "alive/" + id) &&
            !store_->try_get(prefix_ + "failed/" + id)) {
          dead += (dead.empty() ? "" : ", ") + id;
          ++count;
        }
      }
    } catch (const Error&) {
      return "a peer failed (the store is unreachable too)";
    }
    if (count == 0) return "";
    return (count == 1 ? "rank " : "ranks ") + dead + " died";
  }

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
        std::size_t total = c.count * static_cast<std::size_t>(size_);
        std::vector<char> full(total * esize);
        allreduce(c.send, full.data(), total, c.dtype, c.op, tag(c, 0));
        std::memcpy(c.recv, full.data() + static_cast<std::size_t>(rank_) * c.count * esize, c.count * esize);
        return;
      }
    }
  }

  void allreduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op, std::uint32_t t) {
    if (count == 0) return;
    switch (dtype) {
      case DType::f32: return allreduce_typed<float>(send, recv, count, op, t);
      case DType::f64: return allreduce_typed<double>(send, recv, count, op, t);
      case DType::i32: return allreduce_typed<std::int32_t>(send, recv, count, op, t);
      case DType::i64: return allreduce_typed<std::int64_t>(send, recv, count, op, t);
      case DType::f16:
      case DType::bf16: {
        std::vector<float> wide(count);
        auto* in = static_cast<const std::uint16_t*>(send);
        for (std::size_t i = 0; i < count; ++i)
          wide[i] = dtype == DType::f16 ? f16_to_f32(in[i]) : bf16_to_f32(in[i]);
        allreduce_typed<float>(wide.data(), wide.data(), count, op, t);
        auto* out = static_cast<std::uint16_t*>(recv);
        for (std::size_t i = 0; i < count; ++i)
          out[i] = dtype == DType::f16 ? f32_to_f16(wide[i]) : f32_to_bf16(wide[i]);
        return;
      }
    }
  }

  template <typename T>
  void allreduce_typed(const void* send, void* recv, std::size_t count, ReduceOp op, std::uint32_t t) {
    T* out = static_cast<T*>(recv);
    if (send != recv) std::memcpy(out, send, count * sizeof(T));
    gloo::AllreduceOptions opts(context_);
    opts.setOutput(out, count);
    opts.setReduceFunction(reduce_fn<T>(op));
    opts.setTag(t);
    gloo::allreduce(opts);
    if (op == ReduceOp::avg)
      for (std::size_t i = 0; i < count; ++i) out[i] = static_cast<T>(out[i] / static_cast<T>(size_));
  }

  int rank_, size_;
  CommOptions options_;
  std::shared_ptr<StoreClient> store_;
  std::string prefix_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::Context> context_;
};

}  // namespace

std::unique_ptr<Backend> make_gloo_backend(const BackendContext& ctx) {
  return std::make_unique<GlooBackend>(ctx);
}

}  // namespace lockstep::comm
