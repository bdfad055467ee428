// Gloo's full-mesh connect for the gloo backend, where a peer that is gone is an error within a
// second, not after Gloo's connect timeout.
//
// Gloo 0.0~git2022 connects each pair of ranks once both have published their pairs' addresses
// on the store: the side with the lower address listens, the other connects. A peer gone after
// it published (killed, or failed in its own connect) leaves its listening partners waiting 5 x
// the context's timeout: over 25 minutes with lockstep's defaults. While Gloo connects, a watcher
// thread looks at the peers that published (each announced itself alive before that, liveness.h);
// when one is gone, it shuts down this process's pair sockets that still listen or connect, so
// Gloo's wait fails at once, and connect_full_mesh throws a PeerError naming the peer.
//
// The addresses travel through lockstep's authenticated StoreClient, under the communicator's
// prefix. LOCKSTEP_FAULT_INJECT=kill-after-gloo-address:N:RANK kills RANK of this process's Nth
// Gloo connect (0: the first) once its addresses are published, for the tests.
#pragma once

#include <chrono>
#include <memory>
#include <set>
#include <string>

#include "../liveness.h"
#include "lockstep/comm/store.h"

namespace gloo {
class Context;
namespace transport {
class Device;
}
}  // namespace gloo

namespace lockstep::comm {

struct MeshOptions {
  int rank = 0, size = 0;
  int global_rank = 0;                             // for messages
  std::string prefix;                              // the communicator's keys on the store
  Seconds store_timeout{300};                      // each wait for a peer's addresses
  std::chrono::milliseconds gloo_timeout{300000};  // Gloo's own, a backstop (its connect waits 5x)
  Seconds look_every{1};                           // between the watcher's looks at the peers
};

// The connected context. PeerError when a peer that published is gone (or, after Gloo failed, is
// found gone within `alive`'s patience); Gloo's own exception for any other failure.
std::shared_ptr<gloo::Context> connect_full_mesh(const MeshOptions& options,
                                                 std::shared_ptr<StoreClient> store,
                                                 std::shared_ptr<gloo::transport::Device>& device,
                                                 PeerLiveness& alive);

// The file descriptors of this process's sockets (from /proc/self/fd).
std::set<int> open_sockets();

}  // namespace lockstep::comm
