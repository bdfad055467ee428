// How the agents of a job meet and watch each other: agent 0 hosts the store; every agent
// claims its node rank, announces its host and worker count, and waits for the others; ranks
// are numbered node by node. Each agent holds an ephemeral "alive" key: when it dies its
// connection closes and the key vanishes, which the others notice.
#include <algorithm>

#include "agent.h"
#include "lockstep/base/log.h"
#include "lockstep/comm/flight_recorder.h"
#include "lockstep/comm/net_address.h"
#include "lockstep/comm/rendezvous.h"
#include "lockstep/error.h"

namespace lockstep::launch {
namespace {

using comm::Seconds;
using nlohmann::json;

}  // namespace

// The run's secret: the option, LOCKSTEP_TOKEN, a fresh one on one machine, or (with a
// warning) one derived from the run id across machines.
std::string choose_token(const LaunchOptions& o, const std::string& run_id) {
  if (!o.token.empty()) return o.token;
  if (auto t = knobs::get(knobs::kToken); t && !t->empty()) return *t;
  if (o.nnodes == 1) return comm::random_token();
  if (o.node_rank == 0)
    LOCKSTEP_LOG(warn, run)
        << "LOCKSTEP_TOKEN is not set, so the store's token derives from the run id; set the "
           "same secret LOCKSTEP_TOKEN on every node to keep other programs out";
  return "lockstep-run:" + run_id;
}

std::string Agent::key(const std::string& k) const {
  return "launch/" + placement_.run_id + "/" + k;
}

std::string Agent::attempt_key(const std::string& k) const {
  return key("attempt/" + std::to_string(placement_.attempt) + "/" + k);
}

// Joins node 0's store, starting over when the store this node reached turns out to be another
// instance: on a port that successive jobs share (the doctor's phases), the previous job's store
// may still answer while it winds down, and then close; the announcement made there is lost.
void Agent::join() {
  const LaunchOptions& o = options_;
  placement_.run_id = !o.run_id.empty() ? o.run_id
                      : o.nnodes == 1   ? comm::random_token().substr(0, 12)
                                        : "default";
  placement_.token = choose_token(o, placement_.run_id);
  if (o.node_rank == 0)
    server_ = std::make_unique<comm::StoreServer>(
        comm::StoreServerOptions{o.nnodes > 1 ? "*" : "127.0.0.1", o.master_port, placement_.token});
  const int store_port = server_ ? server_->port() : o.master_port;
  placement_.store_address = (o.nnodes == 1 ? "127.0.0.1" : o.master_addr) + ":" + std::to_string(store_port);
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(Seconds(o.join_timeout));
  for (;;) {
    const Seconds left = std::max(Seconds(1), Seconds(deadline - Clock::now()));
    store_ = std::make_unique<comm::StoreClient>(comm::StoreClientOptions{
        o.node_rank == 0 ? "127.0.0.1" : o.master_addr, store_port, placement_.token, left});
    try {
      announce_and_wait(left);
      return;
    } catch (const StoreReplacedError& e) {
      if (Clock::now() >= deadline) throw;
      LOCKSTEP_LOG(info, run) << "joining again: " << e.what();
    }
  }
}

// Claims this node's rank, announces its host and worker count, waits for every node's, and
// numbers the ranks node by node.
void Agent::announce_and_wait(Seconds timeout) {
  const LaunchOptions& o = options_;
  const std::string me = std::to_string(o.node_rank);
  if (store_->add(key("claim/" + me), 1) != 1)
    throw ConfigError("another launcher already joined run '" + placement_.run_id + "' as --node-rank " + me +
                      ": give each node a distinct --node-rank in 0.." + std::to_string(o.nnodes - 1));
  store_->set_ephemeral(key("alive/" + me), "1");
  // The address this node reaches node 0 from names it in reports ("node1, 10.0.0.2").
  std::string address = "127.0.0.1";
  if (o.nnodes > 1) {
    try {
      address = comm::choose_bind_address(o.master_addr).address;
    } catch (const Error&) {
      address = "?";
    }
  }
  store_->set(key("agent/" + me),
              json{{"host", host_name()}, {"address", address}, {"nproc", o.nproc_per_node}}.dump());
  std::vector<std::string> keys;
  for (int n = 0; n < o.nnodes; ++n) keys.push_back(key("agent/" + std::to_string(n)));
  try {
    store_->wait(keys, timeout);
  } catch (const TimeoutError&) {
    throw TimeoutError("not every node joined within " + std::to_string(static_cast<int>(o.join_timeout)) +
                       " s: start one `lockstep run` per node, each with --nnodes " +
                       std::to_string(o.nnodes) + " and its own --node-rank");
  }
  // From now on a store that does not answer means node 0's launcher is gone: give up on a call
  // within seconds (reconnects included), not the join timeout.
  store_->set_timeout(Seconds(std::max(3.0, 20 * o.monitor_interval)));
  placement_.world_size = 0;
  hosts_.clear();
  for (int n = 0; n < o.nnodes; ++n) {
    const json a = json::parse(store_->get(keys[static_cast<std::size_t>(n)]));
    if (n == o.node_rank) placement_.first_rank = placement_.world_size;
    hosts_.push_back(a["host"].get<std::string>() + ", " + a.value("address", "?"));
    placement_.world_size += a["nproc"].get<int>();
  }
}

// Node 0 keeps the store up until every agent still alive has read its last key (at most 10 s);
// an agent whose alive key is gone is not waited for. Elastic agents are numbered as they came.
void Agent::leave() {
  try {
    const int me = elastic(options_) ? node_ : options_.node_rank;
    store_->set(key("bye/" + std::to_string(me)), "1");
    if (!server_) return;
    const int nodes = elastic(options_) ? static_cast<int>(store_->add(key("elastic/machines"), 0)) : options_.nnodes;
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    for (int n = 0; n < nodes; ++n) {
      const std::string id = std::to_string(n);
      for (;;) {
        try {
          store_->wait({key("bye/" + id)}, Seconds(0.2));
          break;
        } catch (const TimeoutError&) {
          if (!store_->try_get(key("alive/" + id)) || Clock::now() >= deadline) break;
        }
      }
    }
  } catch (const Error&) {
    // Another agent is gone already: nothing is waiting on us.
  }
}

int Agent::agree_on_master_port() {
  if (options_.node_rank == 0) {
    const int port = comm::free_tcp_port();
    store_->set(attempt_key("master_port"), std::to_string(port));
    return port;
  }
  return std::stoi(
      store_->get(attempt_key("master_port"), Seconds(options_.join_timeout + options_.grace_period + 30)));
}

Failure Agent::publish_failure(const Failure& mine) {
  if (store_lost_) return mine;
  try {
    return Failure::from_json(
        json::parse(store_->compare_set(attempt_key("failed"), "", mine.to_json().dump())));
  } catch (const Error&) {
    store_lost_ = true;  // node 0 is gone: this node stops on its own
    return mine;
  }
}

std::optional<Failure> Agent::published_failure() {
  if (auto f = store_->try_get(attempt_key("failed"))) return Failure::from_json(json::parse(*f));
  return std::nullopt;
}

// A node whose launcher is gone before its workers finished this attempt. (One that finished
// may leave: its ephemeral key vanishes with it.)
std::optional<std::string> Agent::lost_agent() {
  for (int n = 0; n < options_.nnodes; ++n) {
    if (n == options_.node_rank) continue;
    const std::string id = std::to_string(n);
    if (!store_->try_get(key("alive/" + id)) && !store_->try_get(attempt_key("done/" + id)))
      return id + " (" + hosts_[static_cast<std::size_t>(n)] + ")";
  }
  return std::nullopt;
}

void Agent::mark_done() {
  store_->set(attempt_key("done/" + std::to_string(options_.node_rank)), "1");
}

bool Agent::all_nodes_done() {
  for (int n = 0; n < options_.nnodes; ++n)
    if (!store_->try_get(attempt_key("done/" + std::to_string(n)))) return false;
  return true;
}

bool Agent::rejoin() {
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(Seconds(options_.join_timeout));
  LOCKSTEP_LOG(info, run) << "trying to reach node 0's store (" << placement_.store_address
                          << ") again for up to " << static_cast<int>(options_.join_timeout)
                          << " s, to restart with the other nodes";
  for (;;) {
    try {
      store_->set_ephemeral(key("alive/" + std::to_string(options_.node_rank)), "1");
      LOCKSTEP_LOG(info, run) << "reached node 0's store again";
      return true;
    } catch (const Error&) {
      // Each attempt is bounded by the store client's own deadline (reconnects included).
      if (Clock::now() >= deadline) return false;
    }
  }
}

std::vector<std::string> Agent::collectives_at_failure() {
  if (store_lost_ || placement_.world_size < 2) return {};
  try {
    const auto records = comm::read_flight_records(
        *store_, comm::rendezvous_key_prefix(placement_.run_id, placement_.attempt) + "default",
        placement_.world_size);
    for (const auto& r : records)
      if (r) return comm::describe_flight(records);
  } catch (const Error& e) {
    LOCKSTEP_LOG(debug, run) << "no flight records: " << e.what();
  }
  return {};
}

bool Agent::wait_for_every_node_to_stop() {
  store_->set(attempt_key("stopped/" + std::to_string(options_.node_rank)), "1");
  std::vector<std::string> keys;
  for (int n = 0; n < options_.nnodes; ++n) keys.push_back(attempt_key("stopped/" + std::to_string(n)));
  try {
    store_->wait(keys, Seconds(options_.grace_period + 30));
    return true;
  } catch (const TimeoutError&) {
    return false;
  }
}

}  // namespace lockstep::launch
