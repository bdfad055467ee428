// Uneven inputs: ranks with different numbers of batches finish together, without a hang (what
// PyTorch's Join context does for DDP and ZeroRedundancyOptimizer).
//
//   lockstep::Join join(reducer, comm);
//   auto next = my_batches.begin();
//   while (join.next(next != my_batches.end())) {     // collective: does any rank have a batch?
//     reducer.before_forward();
//     if (join.has_batch()) {
//       auto out = model->forward(next->x); reducer.after_forward(&out);
//       loss(out, next->y).backward(); ++next;
//     } else {
//       reducer.reduce_zeros();                        // the same reductions, with zeros
//     }
//     opt.step(); opt.zero_grad();                     // every rank: ZeroOptimizer or any other
//   }
//
// Each step's gradient is the average over the ranks that had a batch (the reducer divides by
// their number, not the world size: PyTorch's divide_by_initial_world_size=False), and a rank
// that ran out still steps its optimizer with that same gradient, so every rank holds the same
// parameters at every step and nothing needs copying at the end. Under ZeRO that is required
// anyway: a rank that ran out still owns its shard of the optimizer state. Cost: one 4-byte
// all-reduce per step. Not with SyncBatchNorm (a rank without a batch runs no forward, so it
// would miss the layers' collectives), nor inside no_sync() accumulation.
#pragma once

#include <cstdint>

#include "lockstep/comm/communicator.h"
#include "lockstep/ddp/ddp.h"

namespace lockstep {

class Join {
 public:
  Join(Reducer& reducer, comm::Communicator& comm) : reducer_(reducer), comm_(comm) {}

  // Collective, once per step on every rank: whether any rank still has a batch. When one does,
  // the coming reduction averages over those that do.
  bool next(bool has_batch) {
    has_batch_ = has_batch;
    std::int32_t count = has_batch ? 1 : 0;
    comm_.allreduce(&count, 1, comm::DType::i32, comm::ReduceOp::sum)->wait();
    with_batches_ = count;
    reducer_.set_contributors(count > 0 ? count : comm_.size());  // after the last step: all again
    return count > 0;
  }

  bool has_batch() const { return has_batch_; }
  int ranks_with_batches() const { return with_batches_; }  // this step's, from next()

 private:
  Reducer& reducer_;
  comm::Communicator& comm_;
  bool has_batch_ = false;
  int with_batches_ = 0;
};

}  // namespace lockstep
