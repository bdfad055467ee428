// ZeRO across a change of membership (elastic jobs): the sharded training state put back
// together on the new members, with no disk read.
//
//   zero->release_communicator();            // after a collective failed; before the reducer goes
//   ... the elastic group agrees on the new membership and builds its communicator ...
//   auto state = recover_sharded_state(new_comm, module, {zero.get(), nullptr, steps}, make);
//   zero.reset(); build a reducer and a ZeroOptimizer on new_comm, load_consolidated(*state.optimizer)
//
// Each old rank's slices live on it and on the rank that mirrors it (ZeroOptions::mirror_of, on
// another machine). The members first settle the step in flight: when any of them applied its
// update, every member holds that update's gradients (the update waits for all to hold them), and
// those that had not applied it do so now; otherwise no member applied it and none does. Then,
// for every old rank, one member that holds its slices (its owner or its mirror) contributes them
// at their place in the module's parameters laid end to end, every other member contributes
// zeros, and one all-reduce per tensor (the parameters, then each optimizer state tensor) leaves
// the whole state on every member, exactly (x + 0 = x). Members joining now contribute zeros and
// receive it. Memory: the whole state on every member for the time of the change (DDP's, once).
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "lockstep/comm/communicator.h"
#include "lockstep/ddp/zero.h"

namespace lockstep {

// What a member brings to the change: its ZeroOptimizer (after release_communicator()), or, when
// it trained alone, its optimizer over every parameter, or nothing (it joins now).
struct HeldState {
  ZeroOptimizer* zero = nullptr;  // finishes the step in flight here when other members did
  torch::optim::Optimizer* whole = nullptr;
  std::int64_t completed_steps = 0;  // the steps this member completed (its own count)
};

struct RecoveredState {
  // Where the state stands: the members' newest completed step, plus one when the step in flight
  // was applied (a member whose own count is below it completes that step's bookkeeping).
  std::int64_t steps = 0;
  // An optimizer over the module's trainable parameters holding the whole state; the module's
  // parameters hold the values.
  std::unique_ptr<torch::optim::Optimizer> optimizer;
};

// ZeroOptimizer's options on an elastic membership: each rank's slices are mirrored by the rank in
// the same place on the next machine (one rank further when all are on one machine), so a
// machine's loss leaves a copy of each. `node_of_rank` names each rank's machine, the ranks of a
// machine together, the first machine first.
ZeroOptions mirrored_options(const ZeroOptions& plan, int rank, const std::vector<int>& node_of_rank);

// Collective on the new membership's communicator. comm::ElasticError when an old rank and the
// rank mirroring it are both gone: their slices exist nowhere, and the job must go back to its
// last checkpoint (the launcher restarts it).
RecoveredState recover_sharded_state(comm::Communicator& comm, torch::nn::Module& module, const HeldState& mine,
                                     const ZeroOptimizer::Factory& make_whole);

}  // namespace lockstep
