#include "lockstep/comm/rendezvous.h"

#include <algorithm>
#include <cstdlib>
#include <thread>

extern char** environ;

#include "env.h"
#include "lockstep/error.h"
#include "log.h"

namespace lockstep::comm {
namespace {

using EnvMap = std::map<std::string, std::string>;

std::optional<std::string> lookup(const EnvMap& env, const std::string& name) {
  auto it = env.find(name);
  if (it == env.end() || it->second.empty()) return std::nullopt;
  return it->second;
}

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

EnvMap process_env() {
  EnvMap env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return env;
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
  return rendezvous_info_from(process_env());
}

RendezvousInfo rendezvous_info_from(const EnvMap& env) {
  RendezvousInfo info;
  const char* fix_rank =
      "start workers with `lockstep run`, or give each process RANK in "
      "0..WORLD_SIZE-1 and the same WORLD_SIZE";
  auto rank = lookup(env, env::kRank.name);
  auto world = lookup(env, env::kWorldSize.name);
  std::string rank_var = env::kRank.name, world_var = env::kWorldSize.name;
  if (!rank && !world && lookup(env, "OMPI_COMM_WORLD_RANK")) {
    rank_var = "OMPI_COMM_WORLD_RANK";
    world_var = "OMPI_COMM_WORLD_SIZE";
    rank = lookup(env, rank_var);
    world = lookup(env, world_var);
    info.from_mpirun = true;
  }
  EnvMap derived;  // values a scheduler implies, used where the torchrun names are absent
  if (!rank && !world && lookup(env, "SLURM_PROCID") && lookup(env, "SLURM_NTASKS")) {
    rank_var = "SLURM_PROCID";
    world_var = "SLURM_NTASKS";
    rank = lookup(env, rank_var);
    world = lookup(env, world_var);
    info.scheduler = "slurm";
    if (auto l = lookup(env, "SLURM_LOCALID")) derived[env::kLocalRank.name] = *l;
    auto per_node = lookup(env, "SLURM_NTASKS_PER_NODE");
    if (!per_node) per_node = lookup(env, "SLURM_TASKS_PER_NODE");  // "2(x3),1": the first count
    if (per_node) derived[env::kLocalWorldSize.name] = per_node->substr(0, per_node->find_first_of("(,"));
    auto nodes = lookup(env, "SLURM_JOB_NODELIST");
    if (!nodes) nodes = lookup(env, "SLURM_NODELIST");
    if (nodes) derived[env::kMasterAddr.name] = first_slurm_host(*nodes);
    // Slurm names no port: derive one from the job id so every task computes the same.
    if (auto job = lookup(env, "SLURM_JOB_ID"))
      derived[env::kMasterPort.name] = std::to_string(20000 + std::strtol(job->c_str(), nullptr, 10) % 20000);
  } else if (!rank && !world && lookup(env, "SM_HOSTS") && lookup(env, "SM_CURRENT_HOST")) {
    // SageMaker starts the entry point once per host: one rank per host, host order = rank.
    auto hosts = parse_host_list(*lookup(env, "SM_HOSTS"));
    std::string current = *lookup(env, "SM_CURRENT_HOST");
    auto it = std::find(hosts.begin(), hosts.end(), current);
    if (hosts.empty() || it == hosts.end())
      throw ConfigError("SM_CURRENT_HOST='" + current +
                        "' is not in SM_HOSTS: the SageMaker environment is inconsistent");
    rank_var = "SM_CURRENT_HOST";
    world_var = "SM_HOSTS";
    rank = std::to_string(it - hosts.begin());
    world = std::to_string(hosts.size());
    info.scheduler = "sagemaker";
    derived[env::kLocalRank.name] = "0";
    derived[env::kLocalWorldSize.name] = "1";
    derived[env::kMasterAddr.name] = hosts.front();
    derived[env::kMasterPort.name] = "29500";
  }
  auto lookup_or_derived = [&](const std::string& name) {
    auto v = lookup(env, name);
    if (!v) v = lookup(derived, name);
    return v;
  };
  if (!rank && !world) {
    // A lone process is a job of one: convenient for single-worker runs and debugging.
    rank = "0";
    world = "1";
  }
  if (!rank) throw ConfigError(world_var + " is set but " + rank_var + " is not: " + fix_rank);
  if (!world) throw ConfigError(rank_var + " is set but " + world_var + " is not: " + fix_rank);
  info.world_size = static_cast<int>(parse_int(world_var, *world, 1, 1 << 20, fix_rank));
  info.rank = static_cast<int>(parse_int(rank_var, *rank, 0, 1 << 20, fix_rank));
  if (info.rank >= info.world_size)
    throw ConfigError(rank_var + "=" + *rank + " but " + world_var + "=" + *world + ": " + rank_var +
                      " must be below " + world_var + " (0.." + std::to_string(info.world_size - 1) + ")");

  std::string local_rank_var = info.from_mpirun ? "OMPI_COMM_WORLD_LOCAL_RANK" : env::kLocalRank.name;
  std::string local_size_var = info.from_mpirun ? "OMPI_COMM_WORLD_LOCAL_SIZE" : env::kLocalWorldSize.name;
  auto local_size = lookup_or_derived(local_size_var);
  auto local_rank = lookup_or_derived(local_rank_var);
  info.local_world_size = local_size
                              ? static_cast<int>(parse_int(local_size_var, *local_size, 1, 1 << 20, fix_rank))
                              : info.world_size;
  info.local_rank = local_rank
                        ? static_cast<int>(parse_int(local_rank_var, *local_rank, 0, 1 << 20, fix_rank))
                        : info.rank % info.local_world_size;
  if (info.local_rank >= info.local_world_size)
    throw ConfigError(local_rank_var + "=" + std::to_string(info.local_rank) + " but " + local_size_var +
                      "=" + std::to_string(info.local_world_size) +
                      ": the local rank must be below the local world size");

  if (auto addr = lookup_or_derived(env::kMasterAddr.name)) info.master_addr = *addr;
  if (auto port = lookup_or_derived(env::kMasterPort.name))
    info.master_port = static_cast<int>(
        parse_int(env::kMasterPort.name, *port, 1, 65535, "set MASTER_PORT to a free TCP port (1..65535)"));
  if (auto store = lookup(env, env::kStoreAddr.name)) {
    auto colon = store->rfind(':');
    if (colon == std::string::npos || colon == 0)
      throw ConfigError(std::string(env::kStoreAddr.name) + "='" + *store + "' is not host:port");
    info.store_host = store->substr(0, colon);
    info.store_port = static_cast<int>(
        parse_int(env::kStoreAddr.name, store->substr(colon + 1), 1, 65535, "expected host:port"));
  }
  if (info.world_size > 1 && info.store_host.empty() && info.master_port == 0 && !info.from_mpirun)
    throw ConfigError("neither LOCKSTEP_STORE_ADDR nor MASTER_PORT is set, so the " +
                      std::to_string(info.world_size) +
                      " ranks cannot find each other: start "
                      "workers with `lockstep run`, or set MASTER_ADDR and MASTER_PORT");
  info.token = lookup(env, env::kToken.name).value_or("");
  info.run_id = lookup(env, env::kRunId.name).value_or(env::kRunId.default_value);
  if (auto restarts = lookup(env, env::kRestartCount.name))
    info.restart_count = static_cast<int>(
        parse_int(env::kRestartCount.name, *restarts, 0, 1 << 20, "it is set by lockstep run; unset it"));
  if (auto t = lookup(env, env::kTimeout.name)) info.timeout = Seconds(parse_seconds(env::kTimeout.name, *t));
  return info;
}

Rendezvous::Rendezvous(RendezvousInfo info) : info_(std::move(info)) {
  log::set_rank(info_.rank);
  prefix_ = "run/" + info_.run_id + "/" + std::to_string(info_.restart_count) + "/";
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
      server_ = std::make_unique<StoreServer>(StoreServerOptions{"0.0.0.0", info_.master_port, info_.token});
    store_ = std::make_shared<StoreClient>(StoreClientOptions{
        info_.rank == 0 ? "127.0.0.1" : info_.master_addr, info_.master_port, info_.token, info_.timeout});
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
          LOCKSTEP_LOG(warn) << "closing the store while rank " << id << " may still use it";
          return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
  } catch (const Error& e) {
    LOCKSTEP_LOG(warn) << "closing the store: " << e.what();
  }
}

std::unique_ptr<Communicator> Rendezvous::communicator(CommOptions options) {
  options.name = prefix_ + options.name;
  if (options.timeout == CommOptions{}.timeout) options.timeout = info_.timeout;
  if (options.backend == "auto") options.backend = env::get(env::kBackend).value_or("auto");
  if (!store_ && options.backend == "auto") options.backend = "mpi";
  return Communicator::create(store_, info_.rank, info_.world_size, std::move(options));
}

Job join_from_env(CommOptions options) {
  Job job;
  job.rendezvous = std::make_unique<Rendezvous>(rendezvous_info_from_env());
  if (auto t = env::get(env::kPeerCheck))
    options.peer_check = Seconds(parse_seconds(env::kPeerCheck.name, *t));
  job.comm = job.rendezvous->communicator(std::move(options));
  return job;
}

}  // namespace lockstep::comm
