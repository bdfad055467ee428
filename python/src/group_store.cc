#include "group_store.h"

#include <algorithm>
#include <sstream>

#include "lockstep/base/knobs.h"
#include "lockstep/base/log.h"
#include "lockstep/comm/backends.h"
#include "lockstep/comm/net_address.h"
#include "lockstep/comm/rendezvous.h"
#include "lockstep/error.h"

namespace lockstep::torch_backend {
namespace {

// The c10d key rank 0 announces its store under (inside the group's own prefix).
constexpr const char* kAnnounceKey = "lockstep/store";

// Only lockstep's own variables: the job's shape (RANK, WORLD_SIZE, ...) is torch's business
// here, and may legitimately be absent (init_process_group(rank=..., world_size=...)).
knobs::Environment lockstep_variables(const knobs::Environment& all) {
  knobs::Environment mine;
  for (const knobs::Knob* k : {&knobs::kStoreAddr, &knobs::kToken, &knobs::kRunId, &knobs::kRestartCount,
                               &knobs::kTorchelasticRestartCount, &knobs::kTimeout, &knobs::kPeerCheck,
                               &knobs::kBackend, &knobs::kGlooRing, &knobs::kHierAcross}) {
    auto it = all.find(k->name);
    if (it != all.end()) mine.insert(*it);
  }
  return mine;
}

}  // namespace

Settings settings_from_env() {
  const knobs::Environment env = knobs::environment();
  // The rendezvous parser checks every value and names the variable when one is wrong.
  const comm::RendezvousInfo info = comm::rendezvous_info_from(lockstep_variables(env));
  Settings s;
  s.backend = info.backend;
  if (!comm::is_backend_name(s.backend))
    throw ConfigError(std::string(knobs::kBackend.name) + "='" + s.backend + "' is not a lockstep backend: use " +
                      comm::backend_choices(", "));
  if (knobs::lookup(env, knobs::kTimeout)) s.timeout = info.timeout;
  s.peer_check = info.peer_check;
  s.launcher_host = info.store_host;
  s.launcher_port = info.store_port;
  s.token = info.token;
  s.key_prefix = "run/" + info.run_id + "/" + std::to_string(info.restart_count) + "/";
  s.master_addr = knobs::lookup(env, knobs::kMasterAddr).value_or("");
  s.gloo_ring = info.gloo_ring;
  s.hier_across = info.hier_across;
  return s;
}

GroupStore::GroupStore(const Settings& settings, const GroupPlace& place, const Announcer& announcer)
    : place_(place) {
  if (!settings.launcher_host.empty()) {
    launcher_ = true;
    client_ = std::make_shared<comm::StoreClient>(
        comm::StoreClientOptions{settings.launcher_host, settings.launcher_port, settings.token, place.timeout});
    name_ = settings.key_prefix + "torch/" + place.group_id;
    return;
  }
  name_ = "torch/" + place.group_id;
  if (place.rank == 0) {
    host(settings, place, announcer);
  } else {
    join(announcer, place.timeout);
  }
}

// Binds the address the others reach the master by (a job of one stays on loopback), on a
// port the kernel picks, so nothing can collide with torch's own MASTER_PORT.
void GroupStore::host(const Settings& settings, const GroupPlace& place, const Announcer& announcer) {
  const std::string token = settings.token.empty() ? comm::random_token() : settings.token;
  const std::string address =
      place.size == 1 ? std::string("127.0.0.1") : comm::choose_bind_address(place.master_host).address;
  server_ = std::make_unique<comm::StoreServer>(comm::StoreServerOptions{address, 0, token});
  client_ = std::make_shared<comm::StoreClient>(
      comm::StoreClientOptions{address, server_->port(), token, place.timeout});
  if (place.size > 1) announcer.set(kAnnounceKey, address + "\n" + std::to_string(server_->port()) + "\n" + token);
}

void GroupStore::join(const Announcer& announcer, comm::Seconds timeout) {
  std::istringstream announced(announcer.get(kAnnounceKey));
  std::string address, port, token;
  std::getline(announced, address);
  std::getline(announced, port);
  std::getline(announced, token);
  if (address.empty() || port.empty())
    throw ConfigError("group '" + place_.group_id + "': rank 0 announced a malformed lockstep store address; "
                      "are all ranks running the same lockstep_torch?");
  client_ = std::make_shared<comm::StoreClient>(comm::StoreClientOptions{address, std::stoi(port), token, timeout});
  // Rank 0 learns from this key's disappearance that this process died (see the destructor).
  client_->set_ephemeral("alive/" + std::to_string(place_.rank), "1");
}

GroupStore::~GroupStore() {
  if (!client_ || place_.size == 1 || launcher_) return;
  if (!server_) {
    try {
      client_->set("left/" + std::to_string(place_.rank), "1");
    } catch (const Error&) {
      // The store is gone with rank 0: nobody waits for us.
    }
    return;
  }
  wait_for_members_to_leave();
}

// The store lives in this process: close it only once no member can still be using it (a
// member is done when it said so, or when its ephemeral key vanished because it died). Waits
// on the store in short slices, so a death is seen within one slice; bounded overall.
void GroupStore::wait_for_members_to_leave() {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                 comm::Seconds(std::min(place_.timeout.count(), 30.0)));
  try {
    for (int r = 1; r < place_.size; ++r) {
      const std::string id = std::to_string(r);
      for (;;) {
        try {
          client_->wait({"left/" + id}, comm::Seconds(0.1));
          break;
        } catch (const TimeoutError&) {
          if (!client_->try_get("alive/" + id)) break;
          if (Clock::now() >= deadline) {
            LOCKSTEP_LOG(warn, store) << "closing group '" << place_.group_id << "''s store while rank " << id
                                      << " may still use it";
            return;
          }
        }
      }
    }
  } catch (const Error& e) {
    LOCKSTEP_LOG(warn, store) << "closing group '" << place_.group_id << "''s store: " << e.what();
  }
}

std::unique_ptr<comm::Communicator> create_communicator(const Settings& settings, const GroupPlace& place,
                                                        const GroupStore& store) {
  comm::CommOptions options;
  options.backend = settings.backend;
  options.name = store.communicator_name();
  options.timeout = settings.timeout.value_or(place.timeout);
  options.peer_check = settings.peer_check;
  options.gloo_ring = settings.gloo_ring;
  options.hier_across = settings.hier_across;
  return comm::Communicator::create(store.client(), place.rank, place.size, std::move(options));
}

}  // namespace lockstep::torch_backend
