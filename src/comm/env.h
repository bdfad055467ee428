// Every environment variable lockstep reads is declared here, once, with its default and
// meaning; docs/environment.md lists the same table for users.
#pragma once

#include <optional>
#include <string>

namespace lockstep::env {

struct Knob {
  const char* name;
  const char* default_value;  // nullptr: no default (absent means "not set")
  const char* meaning;
};

// Job identity (torchrun names, read by the rendezvous).
inline constexpr Knob kRank{"RANK", nullptr, "global rank of this process, 0..WORLD_SIZE-1"};
inline constexpr Knob kWorldSize{"WORLD_SIZE", nullptr, "number of processes in the job"};
inline constexpr Knob kLocalRank{"LOCAL_RANK", nullptr, "rank of this process on its machine"};
inline constexpr Knob kLocalWorldSize{"LOCAL_WORLD_SIZE", nullptr, "number of processes on this machine"};
inline constexpr Knob kMasterAddr{"MASTER_ADDR", "127.0.0.1", "host of rank 0"};
inline constexpr Knob kMasterPort{"MASTER_PORT", nullptr,
                                  "port where rank 0 hosts the store when no launcher does"};
// lockstep's own.
inline constexpr Knob kStoreAddr{"LOCKSTEP_STORE_ADDR", nullptr,
                                 "host:port of the launcher's store (set by lockstep run)"};
inline constexpr Knob kToken{"LOCKSTEP_TOKEN", "",
                             "the run's secret; every store connection proves it holds it"};
inline constexpr Knob kRunId{"LOCKSTEP_RUN_ID", "default", "names the run's keys and segments"};
inline constexpr Knob kRestartCount{"LOCKSTEP_RESTART_COUNT", "0",
                                    "how many times the launcher restarted the group"};
inline constexpr Knob kBackend{"LOCKSTEP_BACKEND", "auto", "shm | gloo | mpi | auto"};
inline constexpr Knob kTimeout{"LOCKSTEP_TIMEOUT", "300", "seconds any collective or store call may take"};
inline constexpr Knob kPeerCheck{"LOCKSTEP_PEER_CHECK", "5", "seconds within which a dead peer is detected"};
inline constexpr Knob kLogLevel{"LOCKSTEP_LOG_LEVEL", "warn", "error | warn | info | debug"};
inline constexpr Knob kGlooIface{"LOCKSTEP_GLOO_IFACE", nullptr,
                                 "network interface gloo binds (default: the hostname's address)"};

inline constexpr const Knob* kAll[] = {
    &kRank,  &kWorldSize,    &kLocalRank, &kLocalWorldSize, &kMasterAddr, &kMasterPort, &kStoreAddr, &kToken,
    &kRunId, &kRestartCount, &kBackend,   &kTimeout,        &kPeerCheck,  &kLogLevel,   &kGlooIface};

// The variable's value, its default when unset, or nullopt when neither.
std::optional<std::string> get(const Knob& knob);

}  // namespace lockstep::env
