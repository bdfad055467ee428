#include "lockstep/comm/rendezvous.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <thread>

#include "lockstep/base/knobs.h"
#include "lockstep/base/log.h"
#include "lockstep/error.h"

namespace lockstep::comm {
namespace {

using knobs::Environment;
using knobs::Knob;
using knobs::lookup;

const char* kFixRank =
    "start workers with `lockstep run`, or give each process RANK in 0..WORLD_SIZE-1 and the same "
    "WORLD_SIZE";

long parse_int(const std::string& name, const std::string& value, long lo, long hi, const char* fix) {
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || errno != 0)
    throw ConfigError(name + "='" + value + "' is not an integer: " + fix);
  if (v < lo || v > hi)
    throw ConfigError(name + "=" + value + " is out of range " + std::to_string(lo) + ".." +
                      std::to_string(hi) + ": " + fix);
  return v;
}

double parse_seconds(const std::string& name, const std::string& value) {
  char* end = nullptr;
  double v = std::strtod(value.c_str(), &end);
  if (value.empty() || *end != '\0' || !(v > 0))
    throw ConfigError(name + "='" + value + "' is not a positive number of seconds");
  return v;
}

// LOCKSTEP_CHECK_COLLECTIVES: "every" (1), "off" (0) or a positive N.
int parse_check_every(const std::string& value) {
  if (value == "every") return 1;
  if (value == "off") return 0;
  return static_cast<int>(parse_int(knobs::kCheckCollectives.name, value, 1, 1 << 30,
                                    "give every, off, or N to check every N-th collective"));
}

// Where the job's shape came from: the variables that held the rank and world size (named in
// errors), their values, and what the scheduler implies for the rest (used where the torchrun
// names are absent).
struct Source {
  const Knob* rank_var = &knobs::kRank;
  const Knob* world_var = &knobs::kWorldSize;
  const Knob* local_rank_var = &knobs::kLocalRank;
  const Knob* local_size_var = &knobs::kLocalWorldSize;
  std::optional<std::string> rank, world;
  Environment derived;  // knob name -> value the scheduler implies
  bool from_mpirun = false;
  std::string scheduler;
};

std::optional<Source> from_torchrun(const Environment& env) {
  Source s;
  s.rank = lookup(env, knobs::kRank);
  s.world = lookup(env, knobs::kWorldSize);
  if (!s.rank && !s.world) return std::nullopt;
  return s;
}

std::optional<Source> from_mpirun(const Environment& env) {
  if (!lookup(env, knobs::kOmpiRank)) return std::nullopt;
  Source s;
  s.rank_var = &knobs::kOmpiRank;
  s.world_var = &knobs::kOmpiSize;
  s.local_rank_var = &knobs::kOmpiLocalRank;
  s.local_size_var = &knobs::kOmpiLocalSize;
  s.rank = lookup(env, knobs::kOmpiRank);
  s.world = lookup(env, knobs::kOmpiSize);
  s.from_mpirun = true;
  return s;
}

std::optional<Source> from_slurm(const Environment& env) {
  if (!lookup(env, knobs::kSlurmProcId) || !lookup(env, knobs::kSlurmNtasks)) return std::nullopt;
  Source s;
  s.rank_var = &knobs::kSlurmProcId;
  s.world_var = &knobs::kSlurmNtasks;
  s.rank = lookup(env, knobs::kSlurmProcId);
  s.world = lookup(env, knobs::kSlurmNtasks);
  s.scheduler = "slurm";
  if (auto l = lookup(env, knobs::kSlurmLocalId)) s.derived[knobs::kLocalRank.name] = *l;
  auto per_node = lookup(env, knobs::kSlurmNtasksPerNode);
  if (!per_node) per_node = lookup(env, knobs::kSlurmTasksPerNode);  // "2(x3),1": the first count
  if (per_node) s.derived[knobs::kLocalWorldSize.name] = per_node->substr(0, per_node->find_first_of("(,"));
  auto nodes = lookup(env, knobs::kSlurmJobNodelist);
  if (!nodes) nodes = lookup(env, knobs::kSlurmNodelist);
  if (nodes) s.derived[knobs::kMasterAddr.name] = first_slurm_host(*nodes);
  // Slurm names no port: derive one from the job id so every task computes the same.
  if (auto job = lookup(env, knobs::kSlurmJobId))
    s.derived[knobs::kMasterPort.name] =
        std::to_string(20000 + std::strtol(job->c_str(), nullptr, 10) % 20000);
  return s;
}

// SageMaker starts the entry point once per host: one rank per host, host order = rank.
std::optional<Source> from_sagemaker(const Environment& env) {
  auto hosts_json = lookup(env, knobs::kSmHosts);
  auto current = lookup(env, knobs::kSmCurrentHost);
  if (!hosts_json || !current) return std::nullopt;
  auto hosts = parse_host_list(*hosts_json);
  auto it = std::find(hosts.begin(), hosts.end(), *current);
  if (hosts.empty() || it == hosts.end())
    throw ConfigError("SM_CURRENT_HOST='" + *current +
                      "' is not in SM_HOSTS: the SageMaker environment is inconsistent");
  Source s;
  s.rank_var = &knobs::kSmCurrentHost;
  s.world_var = &knobs::kSmHosts;
  s.rank = std::to_string(it - hosts.begin());
  s.world = std::to_string(hosts.size());
  s.scheduler = "sagemaker";
  s.derived[knobs::kLocalRank.name] = "0";
  s.derived[knobs::kLocalWorldSize.name] = "1";
  s.derived[knobs::kMasterAddr.name] = hosts.front();
  s.derived[knobs::kMasterPort.name] = "29500";
  return s;
}

// The first source whose variables are present, in the documented order; a lone process with
// none of them is a job of one (convenient for single-worker runs and debugging).
Source find_source(const Environment& env) {
  for (auto detect : {from_torchrun, from_mpirun, from_slurm, from_sagemaker})
    if (auto s = detect(env)) return *s;
  Source lone;
  lone.rank = "0";
  lone.world = "1";
  return lone;
}

void read_shape(const Source& src, const Environment& env, RendezvousInfo& info) {
  const std::string rank_var = src.rank_var->name, world_var = src.world_var->name;
  if (!src.rank) throw ConfigError(world_var + " is set but " + rank_var + " is not: " + kFixRank);
  if (!src.world) throw ConfigError(rank_var + " is set but " + world_var + " is not: " + kFixRank);
  info.world_size = static_cast<int>(parse_int(world_var, *src.world, 1, 1 << 20, kFixRank));
  info.rank = static_cast<int>(parse_int(rank_var, *src.rank, 0, 1 << 20, kFixRank));
  if (info.rank >= info.world_size)
    throw ConfigError(rank_var + "=" + *src.rank + " but " + world_var + "=" + *src.world + ": " + rank_var +
                      " must be below " + world_var + " (0.." + std::to_string(info.world_size - 1) + ")");
  auto local_or_derived = [&](const Knob& k) {
    auto v = lookup(env, k);
    return v ? v : lookup(src.derived, k);
  };
  const std::string local_rank_var = src.local_rank_var->name, local_size_var = src.local_size_var->name;
  auto local_size = local_or_derived(*src.local_size_var);
  auto local_rank = local_or_derived(*src.local_rank_var);
  info.local_world_size = local_size
                              ? static_cast<int>(parse_int(local_size_var, *local_size, 1, 1 << 20, kFixRank))
                              : info.world_size;
  info.local_rank = local_rank
                        ? static_cast<int>(parse_int(local_rank_var, *local_rank, 0, 1 << 20, kFixRank))
                        : info.rank % info.local_world_size;
  if (info.local_rank >= info.local_world_size)
    throw ConfigError(local_rank_var + "=" + std::to_string(info.local_rank) + " but " + local_size_var +
                      "=" + std::to_string(info.local_world_size) +
                      ": the local rank must be below the local world size");
}

void read_store_address(const Source& src, const Environment& env, RendezvousInfo& info) {
  auto local_or_derived = [&](const Knob& k) {
    auto v = lookup(env, k);
    return v ? v : lookup(src.derived, k);
  };
  if (auto addr = local_or_derived(knobs::kMasterAddr)) info.master_addr = *addr;
  if (auto port = local_or_derived(knobs::kMasterPort))
    info.master_port = static_cast<int>(
        parse_int(knobs::kMasterPort.name, *port, 1, 65535, "set MASTER_PORT to a free TCP port (1..65535)"));
  if (auto store = lookup(env, knobs::kStoreAddr)) {
    auto colon = store->rfind(':');
    if (colon == std::string::npos || colon == 0)
      throw ConfigError(std::string(knobs::kStoreAddr.name) + "='" + *store + "' is not host:port");
    info.store_host = store->substr(0, colon);
    info.store_port = static_cast<int>(
        parse_int(knobs::kStoreAddr.name, store->substr(colon + 1), 1, 65535, "expected host:port"));
  }
  if (info.world_size > 1 && info.store_host.empty() && info.master_port == 0 && !info.from_mpirun)
    throw ConfigError("neither LOCKSTEP_STORE_ADDR nor MASTER_PORT is set, so the " +
                      std::to_string(info.world_size) +
                      " ranks cannot find each other: start workers with `lockstep run`, or set MASTER_ADDR "
                      "and MASTER_PORT");
}

}  // namespace

std::string first_slurm_host(const std::string& nodelist) {
  // "node[01-04,07],gpu[1-2]" -> "node01"; "a,b" -> "a"; "node05" -> "node05"
  std::size_t stop = nodelist.find_first_of(",[");
  std::string host = nodelist.substr(0, stop);
  if (stop != std::string::npos && nodelist[stop] == '[') {
    std::size_t end = nodelist.find_first_of(",-]", stop + 1);
    host += nodelist.substr(stop + 1, end == std::string::npos ? std::string::npos : end - stop - 1);
  }
  return host;
}

std::vector<std::string> parse_host_list(const std::string& json_list) {
  std::vector<std::string> hosts;  // ["algo-1","algo-2"]: the quoted strings, in order
  std::size_t at = 0;
  while ((at = json_list.find('"', at)) != std::string::npos) {
    std::size_t end = json_list.find('"', at + 1);
    if (end == std::string::npos) break;
    hosts.push_back(json_list.substr(at + 1, end - at - 1));
    at = end + 1;
  }
  return hosts;
}

RendezvousInfo rendezvous_info_from_env() {
  return rendezvous_info_from(knobs::environment());
}

bool started_as_rank(const std::map<std::string, std::string>& env) {
  for (auto detect : {from_torchrun, from_mpirun, from_slurm, from_sagemaker})
    if (detect(env)) return true;
  return false;
}

bool started_as_rank() {
  return started_as_rank(knobs::environment());
}

RendezvousInfo rendezvous_info_from(const Environment& env) {
  if (lookup(env, knobs::kElastic))
    throw ConfigError("this worker was started by an elastic launcher (lockstep run --nnodes MIN:MAX, which sets "
                      "LOCKSTEP_ELASTIC): its rank changes as machines come and go, so it must join with "
                      "comm::join_elastic_from_env() (the Trainer does) instead of a fixed RANK and WORLD_SIZE");
  RendezvousInfo info;
  const Source src = find_source(env);
  info.from_mpirun = src.from_mpirun;
  info.scheduler = src.scheduler;
  read_shape(src, env, info);
  read_store_address(src, env, info);
  info.token = lookup(env, knobs::kToken).value_or("");
  info.run_id = lookup(env, knobs::kRunId).value_or(knobs::kRunId.default_value);
  auto restarts = lookup(env, knobs::kRestartCount);
  if (!restarts) restarts = lookup(env, knobs::kTorchelasticRestartCount);
  if (restarts)
    info.restart_count = static_cast<int>(
        parse_int(knobs::kRestartCount.name, *restarts, 0, 1 << 20, "it is set by lockstep run; unset it"));
  if (auto t = lookup(env, knobs::kTimeout)) info.timeout = Seconds(parse_seconds(knobs::kTimeout.name, *t));
  if (auto t = lookup(env, knobs::kPeerCheck))
    info.peer_check = Seconds(parse_seconds(knobs::kPeerCheck.name, *t));
  if (auto c = lookup(env, knobs::kCheckCollectives)) info.check_every = parse_check_every(*c);
  info.backend = lookup(env, knobs::kBackend).value_or(knobs::kBackend.default_value);
  info.gloo_ring = lookup(env, knobs::kGlooRing).value_or(knobs::kGlooRing.default_value);
  info.hier_across = lookup(env, knobs::kHierAcross).value_or(knobs::kHierAcross.default_value);
  if (auto p2p = lookup(env, knobs::kP2pShm)) {
    if (*p2p != "0" && *p2p != "1")
      throw ConfigError(std::string(knobs::kP2pShm.name) + "='" + *p2p + "': use 1 (shared memory) or 0 (loopback TCP)");
    info.p2p_shared_memory = *p2p == "1";
  }
  return info;
}

CommOptions with_environment_defaults(CommOptions options, const RendezvousInfo& info) {
  const CommOptions defaults;
  if (options.timeout == defaults.timeout) options.timeout = info.timeout;
  if (options.peer_check == defaults.peer_check) options.peer_check = info.peer_check;
  if (options.check_every == defaults.check_every) options.check_every = info.check_every;
  if (options.backend == defaults.backend) options.backend = info.backend;
  if (options.gloo_ring == defaults.gloo_ring) options.gloo_ring = info.gloo_ring;
  if (options.hier_across == defaults.hier_across) options.hier_across = info.hier_across;
  if (options.p2p_shared_memory == defaults.p2p_shared_memory) options.p2p_shared_memory = info.p2p_shared_memory;
  return options;
}

std::string rendezvous_key_prefix(const std::string& run_id, int restart_count) {
  return "run/" + run_id + "/" + std::to_string(restart_count) + "/";
}

Rendezvous::Rendezvous(RendezvousInfo info) : info_(std::move(info)) {
  // Under lockstep run (LOCKSTEP_STORE_ADDR) the launcher prefixes every output line with
  // "[rank N]" already; elsewhere the log lines name the rank themselves.
  if (info_.store_host.empty()) log::set_rank(info_.rank);
  prefix_ = rendezvous_key_prefix(info_.run_id, info_.restart_count);
  if (info_.world_size == 1 && info_.store_host.empty() && info_.master_port == 0) {
    // A job of one hosts a private store on a free loopback port.
    server_ = std::make_unique<StoreServer>(StoreServerOptions{"127.0.0.1", 0, info_.token});
    store_ = std::make_shared<StoreClient>(
        StoreClientOptions{"127.0.0.1", server_->port(), info_.token, info_.timeout});
  } else if (!info_.store_host.empty()) {
    store_ = std::make_shared<StoreClient>(
        StoreClientOptions{info_.store_host, info_.store_port, info_.token, info_.timeout});
  } else if (info_.from_mpirun && info_.master_port == 0) {
    return;  // under mpirun without a store: only the mpi backend, which needs none
  } else if (info_.master_port == 0) {
    throw ConfigError("no store to rendezvous through: set MASTER_ADDR/MASTER_PORT or use lockstep run");
  } else {
    if (info_.rank == 0)
      server_ = std::make_unique<StoreServer>(StoreServerOptions{"*", info_.master_port, info_.token});
    // Rank 0 too reaches its own store at MASTER_ADDR: the backends bind the address that routes
    // to the store's host, and a rank 0 that said 127.0.0.1 bound loopback where its peers on
    // other machines must reach it (Gloo connected only by the direction of its handshake).
    store_ = std::make_shared<StoreClient>(
        StoreClientOptions{info_.master_addr, info_.master_port, info_.token, info_.timeout});
  }
  if (store_->add(prefix_ + "claim/" + std::to_string(info_.rank), 1) != 1)
    throw ConfigError("another process already joined this run as rank " + std::to_string(info_.rank) +
                      ": give each process a distinct RANK in 0.." + std::to_string(info_.world_size - 1));
  if (info_.world_size > 1 && info_.rank != 0)
    store_->set_ephemeral(prefix_ + "alive/" + std::to_string(info_.rank), "1");
}

Rendezvous::~Rendezvous() {
  if (!store_ || info_.world_size == 1) return;
  if (!server_) {
    try {
      store_->set(prefix_ + "left/" + std::to_string(info_.rank), "1");
    } catch (const Error&) {
      // The store is gone: nobody is waiting for us.
    }
    return;
  }
  // Rank 0's store must outlive the peers' last use of it. A peer is done when it said it left,
  // or when its ephemeral key vanished (it died: no point waiting for it). Bounded poll.
  auto deadline = Clock::now() +
                  std::chrono::duration_cast<Clock::duration>(Seconds(std::min(info_.timeout.count(), 30.0)));
  try {
    for (int r = 1; r < info_.world_size; ++r) {
      std::string id = std::to_string(r);
      while (!store_->try_get(prefix_ + "left/" + id) && store_->try_get(prefix_ + "alive/" + id)) {
        if (Clock::now() >= deadline) {
          LOCKSTEP_LOG(warn, store) << "closing the store while rank " << id << " may still use it";
          return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
  } catch (const Error& e) {
    LOCKSTEP_LOG(warn, store) << "closing the store: " << e.what();
  }
}

std::unique_ptr<Communicator> Rendezvous::communicator(CommOptions options) {
  options.name = prefix_ + options.name;
  options = with_environment_defaults(std::move(options), info_);
  if (!store_ && options.backend == "auto") options.backend = "mpi";
  return Communicator::create(store_, info_.rank, info_.world_size, std::move(options));
}

Job join_from_env(CommOptions options) {
  Job job;
  job.rendezvous = std::make_unique<Rendezvous>(rendezvous_info_from_env());
  job.comm = job.rendezvous->communicator(std::move(options));
  return job;
}

}  // namespace lockstep::comm
