// Codecs: what an all-reduce sends between machines, when it need not be the exact values.
//
// Inside a machine, shared memory moves gradients faster than any compression could shrink them;
// between machines, an ordinary link is often the step's limit. So a codec applies to the network
// leg only. An all-reduce given a codec (Communicator::allreduce with a Codec) runs as usual up to
// the point where a rank holds its share of the buffer summed over its own machine: on hier, its
// shard after the shared-memory reduce-scatter; on gloo with one rank per machine, the whole
// buffer. The codec is called there, on the thread running the collective, with that share and an
// Across, the share's holders on the other machines (one each, the same share of the buffer). It
// must leave in the share the sum over all machines (or its estimate: the codec decides what is
// lost and how it is fed back). The rest proceeds as usual (shm all-gather; avg divides once).
// Inside one machine (shm, or every rank on one machine) the codec is not called: the all-reduce
// is exact. mpi reduces exactly too (a codec there is ignored, not refused).
//
// Contract: every holder of a share makes the same Across calls, in the same order, with the same
// sizes (they are collectives among the holders); a codec is deterministic in that respect given
// the sizes it is called with. It may keep state between calls (error feedback): it is called for
// one collective at a time, and `first`, `count` identify the share, the same at every step of a
// job whose buffers do not change. Errors thrown by Across calls (a dead peer, a timeout) fail the
// collective like any other; a codec's own exception does too.
#pragma once

#include <cstddef>
#include <functional>

#include "lockstep/comm/types.h"

namespace lockstep::comm {

// A share's holders, one per machine, as a codec talks to them. Both calls are collective among
// them and synchronous.
class Across {
 public:
  virtual ~Across() = default;
  virtual int machines() const = 0;
  virtual int machine() const = 0;  // this holder's place among them, 0 .. machines() - 1
  // In place: buffer becomes the element-wise sum of every holder's buffer.
  virtual void sum(void* buffer, std::size_t count, DType dtype) = 0;
  // all receives machines() * bytes: holder m's `mine` at offset m * bytes.
  virtual void gather(const void* mine, void* all, std::size_t bytes) = 0;
};

// share: `count` float32 elements starting at element `first` of the all-reduced buffer, summed
// over this machine's ranks.
using Codec = std::function<void(float* share, std::size_t first, std::size_t count, Across& across)>;

// The gradient encodings DDP offers (--ddp-comm-hook), in the order of ddp::CommHook: fp16 and
// bf16 round every bucket on the wire; powersgd and int8 are codecs, and auto picks one of them
// per bucket, between machines only. One table for the arguments, the DDP and their messages.
struct CommHookName {
  const char* name;
  bool between_machines_only;
};
inline constexpr CommHookName kCommHooks[] = {{"none", false},    {"fp16", false}, {"bf16", false},
                                              {"powersgd", true}, {"int8", true},  {"auto", true}};

}  // namespace lockstep::comm
