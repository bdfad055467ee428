#include "gloo_connect.h"

#include <dirent.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include "lockstep/base/run_env.h"
#include "lockstep/error.h"

namespace lockstep::comm {

std::set<int> open_sockets() {
  std::set<int> fds;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (dirent* e = ::readdir(d)) {
      const int fd = std::atoi(e->d_name);
      struct stat st {};
      if (e->d_name[0] != '.' && ::fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode)) fds.insert(fd);
    }
    ::closedir(d);
  }
  return fds;
}

namespace {

bool is_rank_number(const std::string& key) {
  return !key.empty() && std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// Gloo's rendezvous keys on lockstep's StoreClient, under the communicator's prefix. Counts the
// calls in progress: the watcher looks only while Gloo is outside them (in a pair's connect).
class StoreAdapter : public gloo::rendezvous::Store {
 public:
  StoreAdapter(std::shared_ptr<StoreClient> store, const MeshOptions& o)
      : store_(std::move(store)),
        prefix_(o.prefix),
        timeout_(o.store_timeout),
        rank_(o.rank),
        ordinal_(count_++) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    InStore in(*this);
    store_->set(prefix_ + key, std::string(data.begin(), data.end()));
    // Gloo's pairs' addresses are under the rank's number.
    if (is_rank_number(key) && fault_requested("kill-after-gloo-address", ordinal_, rank_))
      std::raise(SIGKILL);
  }
  std::vector<char> get(const std::string& key) override {
    InStore in(*this);
    std::string v = store_->get(prefix_ + key, timeout_);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, std::chrono::milliseconds(0)); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override {
    InStore in(*this);
    std::vector<std::string> full;
    for (const auto& k : keys) full.push_back(prefix_ + k);
    store_->wait(full, timeout_);  // a WaitWatch on this thread watches it (store.h)
  }

  bool in_store() const { return calls_ > 0; }

 private:
  struct InStore {
    explicit InStore(StoreAdapter& a) : a_(a) { ++a_.calls_; }
    ~InStore() { --a_.calls_; }
    StoreAdapter& a_;
  };

  std::shared_ptr<StoreClient> store_;
  std::string prefix_;
  Seconds timeout_;
  int rank_;
  int ordinal_;  // this process's how-manieth Gloo connect (0: the first), for the fault point
  std::atomic<int> calls_{0};
  static inline std::atomic<int> count_{0};
};

// The peers that are gone among those that published their addresses (and so had announced
// themselves alive), described; "" when none.
class GonePeers {
 public:
  GonePeers(const MeshOptions& o, StoreClient& store, PeerLiveness& alive)
      : o_(o), store_(store), alive_(alive) {
    for (int r = 0; r < o.size; ++r)
      if (r != o.rank) unpublished_.push_back(r);
  }

  std::string look() {
    std::vector<int> still;
    for (int r : unpublished_)
      (store_.try_get(o_.prefix + std::to_string(r)) ? published_ : still).push_back(r);
    unpublished_ = std::move(still);
    return alive_.gone_among(published_);
  }

 private:
  const MeshOptions& o_;
  StoreClient& store_;
  PeerLiveness& alive_;
  std::vector<int> unpublished_, published_;
};

// Shuts down the TCP sockets opened since `before` that still listen or connect: Gloo's pairs
// waiting for a peer. Their waits fail at once (accept or connect errors).
void shut_down_pending_pairs(const std::set<int>& before) {
  for (int fd : open_sockets()) {
    if (before.count(fd)) continue;
    int protocol = 0, listening = 0;
    socklen_t len = sizeof protocol;
    if (::getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &protocol, &len) != 0 || protocol != IPPROTO_TCP) continue;
    len = sizeof listening;
    const bool listens = ::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) == 0 && listening;
    sockaddr_storage peer{};
    socklen_t peer_len = sizeof peer;
    const bool connecting =
        ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0 && errno == ENOTCONN;
    if (listens || connecting) ::shutdown(fd, SHUT_RDWR);
  }
}

// Every `every`, while Gloo is in a pair's connect, asks `gone` who is gone; at the first answer
// keeps it as the verdict and wakes Gloo's waits. stop() ends it and returns the verdict.
class Watcher {
 public:
  Watcher(const StoreAdapter& adapter, GonePeers& gone, Seconds every)
      : adapter_(adapter), gone_(gone), thread_([this, every] { run(every); }) {}
  ~Watcher() { stop(); }

  std::string stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    return verdict_;
  }

 private:
  void run(Seconds every) {
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, every, [&] { return stop_; })) {
      if (adapter_.in_store()) continue;  // the store's own waits are bounded (and watched in elastic jobs)
      lock.unlock();
      std::string gone;
      try {
        gone = gone_.look();
      } catch (const std::exception&) {
        // The store is unreachable: Gloo's or the store's own error will say so.
      }
      lock.lock();
      if (!gone.empty()) {
        verdict_ = gone;
        shut_down_pending_pairs(before_);
        return;
      }
    }
  }

  const StoreAdapter& adapter_;
  GonePeers& gone_;
  const std::set<int> before_ = open_sockets();  // before Gloo's pairs exist
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::string verdict_;
  std::thread thread_;  // last: it starts once the rest is set
};

// After Gloo failed: a peer that died makes it fail at once (its connection refused or reset),
// and the store may take a moment longer to drop its key. "" when none is found gone.
std::string gone_within(GonePeers& gone, Seconds patience) {
  const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(patience);
  try {
    for (;;) {
      if (std::string why = gone.look(); !why.empty() || Clock::now() >= until) return why;
      // Bounded poll of a diagnostic, after the failure is already certain.
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const Error&) {
    return "";  // no store to ask: Gloo's error stands
  }
}

[[noreturn]] void throw_gone(const std::string& why, const MeshOptions& o) {
  throw PeerError("gloo: " + why + " while the connections to rank " + std::to_string(o.global_rank) +
                  "'s peers formed; the job cannot continue");
}

}  // namespace

std::shared_ptr<gloo::Context> connect_full_mesh(const MeshOptions& options,
                                                 std::shared_ptr<StoreClient> store,
                                                 std::shared_ptr<gloo::transport::Device>& device,
                                                 PeerLiveness& alive) {
  StoreAdapter adapter(store, options);
  GonePeers gone(options, *store, alive);
  auto context = std::make_shared<gloo::rendezvous::Context>(options.rank, options.size);
  context->setTimeout(options.gloo_timeout);
  Watcher watcher(adapter, gone, options.look_every);
  try {
    context->connectFullMesh(adapter, device);
  } catch (const gloo::Exception&) {
    if (std::string why = watcher.stop(); !why.empty()) throw_gone(why, options);
    if (std::string why = gone_within(gone, alive.patience()); !why.empty()) throw_gone(why, options);
    throw;
  }
  if (std::string why = watcher.stop(); !why.empty()) throw_gone(why, options);
  return context;
}

}  // namespace lockstep::comm
