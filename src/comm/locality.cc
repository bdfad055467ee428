#include "locality.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <sstream>

#include "lockstep/error.h"
#include "shm/segment.h"
#include "store/wire.h"

namespace lockstep::comm {
namespace {

std::string boot_id() {
  std::string id;
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char buf[64] = {};
    if (std::fgets(buf, sizeof buf, f)) id = buf;
    std::fclose(f);
  }
  while (!id.empty() && id.back() == '\n') id.pop_back();
  return id;
}

// A small shared-memory object holding `token`; unlinked when this goes away.
class Probe {
 public:
  Probe() : token_(wire::hex(wire::random_bytes(16))) {
    name_ = shm::segment_name("probe");
    const int fd = ::shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) {
      name_.clear();  // no /dev/shm here: this rank shares memory with nobody
      return;
    }
    const bool ok = ::write(fd, token_.data(), token_.size()) == static_cast<ssize_t>(token_.size());
    ::close(fd);
    if (!ok) unlink();
  }
  ~Probe() { unlink(); }
  Probe(const Probe&) = delete;
  Probe& operator=(const Probe&) = delete;
  // "boot-id name token", what peers need to test it.
  std::string advert() const { return boot_id() + " " + (name_.empty() ? "-" : name_) + " " + token_; }

 private:
  void unlink() {
    if (!name_.empty()) ::shm_unlink(name_.c_str());
    name_.clear();
  }
  std::string token_, name_;
};

// Whether the object named in `advert` is readable here with its token, on this kernel.
bool reachable(const std::string& advert) {
  std::istringstream in(advert);
  std::string boot, name, token;
  in >> boot >> name >> token;
  if (boot != boot_id() || name == "-") return false;
  const int fd = ::shm_open(name.c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) return false;
  std::string seen(token.size(), '\0');
  const bool ok =
      ::pread(fd, seen.data(), seen.size(), 0) == static_cast<ssize_t>(seen.size()) && seen == token;
  ::close(fd);
  return ok;
}

std::vector<std::string> all_keys(const std::string& base, int size) {
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(base + std::to_string(r));
  return keys;
}

}  // namespace

std::vector<int> Locality::ranks_on(int machine) const {
  std::vector<int> out;
  for (int r = 0; r < size(); ++r)
    if (machine_of[static_cast<std::size_t>(r)] == machine) out.push_back(r);
  return out;
}

bool Locality::uniform() const {
  const std::size_t first = ranks_on(0).size();
  for (int m = 1; m < machines; ++m)
    if (ranks_on(m).size() != first) return false;
  return true;
}

std::string Locality::describe() const {
  std::string out = std::to_string(machines) + (machines == 1 ? " machine: ranks " : " machines: ranks ");
  for (int m = 0; m < machines; ++m) {
    auto ranks = ranks_on(m);
    if (m) out += " | ";
    for (std::size_t i = 0; i < ranks.size(); ++i) out += (i ? "," : "") + std::to_string(ranks[i]);
  }
  return out;
}

// Two ranks are on one machine when either reaches the other (sharing is symmetric in truth;
// taking the union keeps one odd failure to open from splitting a machine). Machines are
// connected components, numbered by their lowest rank.
Locality locality_from(const std::vector<std::vector<int>>& sees) {
  const int n = static_cast<int>(sees.size());
  std::vector<int> parent(static_cast<std::size_t>(n));
  std::iota(parent.begin(), parent.end(), 0);
  auto find = [&](int x) {
    while (parent[static_cast<std::size_t>(x)] != x) x = parent[static_cast<std::size_t>(x)];
    return x;
  };
  for (int r = 0; r < n; ++r)
    for (int q : sees[static_cast<std::size_t>(r)]) {
      const int a = find(r), b = find(q);
      if (a != b) parent[static_cast<std::size_t>(std::max(a, b))] = std::min(a, b);
    }
  Locality l;
  l.machine_of.assign(static_cast<std::size_t>(n), -1);
  l.local_rank.assign(static_cast<std::size_t>(n), 0);
  std::vector<int> machine_of_root(static_cast<std::size_t>(n), -1), count;
  l.machines = 0;
  for (int r = 0; r < n; ++r) {
    const int root = find(r);
    if (machine_of_root[static_cast<std::size_t>(root)] < 0) {
      machine_of_root[static_cast<std::size_t>(root)] = l.machines++;
      count.push_back(0);
    }
    const int m = machine_of_root[static_cast<std::size_t>(root)];
    l.machine_of[static_cast<std::size_t>(r)] = m;
    l.local_rank[static_cast<std::size_t>(r)] = count[static_cast<std::size_t>(m)]++;
  }
  return l;
}

Locality probe_locality(StoreClient& store, const std::string& prefix, int rank, int size, Seconds timeout) {
  Probe probe;
  store.set(prefix + "probe/" + std::to_string(rank), probe.advert());
  store.wait(all_keys(prefix + "probe/", size), timeout);
  std::string mine;
  for (int r = 0; r < size; ++r)
    if (r == rank || reachable(store.get(prefix + "probe/" + std::to_string(r))))
      mine += (mine.empty() ? "" : " ") + std::to_string(r);
  store.set(prefix + "sees/" + std::to_string(rank), mine);
  store.wait(all_keys(prefix + "sees/", size), timeout);  // every rank has tested every probe
  std::vector<std::vector<int>> sees(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) {
    std::istringstream in(store.get(prefix + "sees/" + std::to_string(r)));
    for (int q; in >> q;) sees[static_cast<std::size_t>(r)].push_back(q);
  }
  return locality_from(sees);
}

}  // namespace lockstep::comm
