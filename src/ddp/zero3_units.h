// ZeRO stage 3's parameter units (see ddp/parameter_units.h and ddp/zero.h): each reducer bucket
// is one unit; its parameters are views of the bucket's flat array, whose memory exists only
// while the unit is gathered. At rest a rank holds its slice of every bucket (shards), which the
// optimizer updates.
//
//   gather(b)    all-gather the shards into bucket b's flat array (allocated for it); waits
//   prefetch(b)  the same, started and not waited for
//   release(b)   the flat array's memory freed (the parameters keep their shapes, not their values)
//
// In forward a unit is gathered before it runs (the next one in forward order prefetched) and
// released after, unless backward has begun (a recomputation: its backward follows at once).
// Its output carries an autograd node whose backward gathers it again (and prefetches the unit
// backward reaches next) before the unit's own backward; the reducer frees it once its gradients
// are handed to the reduce-scatter. All ranks run the same graph, so they issue the same
// collectives in the same order.
//
// Threading: the training thread (forward, and backward on CPU); the all-gathers run on the
// communicator's thread into memory no one reads until they are waited for.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "lockstep/comm/communicator.h"
#include "lockstep/ddp/ddp.h"
#include "lockstep/ddp/parameter_units.h"

namespace lockstep::ddp_detail {

// Gives the flat array's storage back (the views of it keep their shapes, not their memory).
void free_storage(const torch::Tensor& flat);

// Memory for gathered units, reused as they come and go (zero3_units.cc says why). With a
// communicator (the hybrid), its blocks are machine memory, one per machine for all its ranks:
// every rank takes and gives back in the same order, so the ranks of a machine take the same
// block for the same unit (the allgather into it checks that they do).
class UnitPool {
 public:
  explicit UnitPool(comm::Communicator* machine_memory_of = nullptr) : comm_(machine_memory_of) {}
  UnitPool(const UnitPool&) = delete;
  UnitPool& operator=(const UnitPool&) = delete;
  void* take(std::size_t bytes);
  void give_back(void* data);
  bool shared() const { return comm_ != nullptr; }

 private:
  struct Block {
    std::shared_ptr<void> memory;
    std::size_t bytes;
  };
  comm::Communicator* comm_;
  std::vector<Block> all_, free_;
};

class ParameterUnits {
 public:
  // flat[b]: bucket b's flat array (its storage freeable, maybe freed already), shards[b]: this
  // rank's slice of it;
  // bucket_of_unit[u]: the bucket of the model's unit u (-1: it has no trainable parameter);
  // root: the bucket of the parameters in no unit (-1: none); one_copy_per_machine: gathered
  // units live in machine memory, one copy for all the ranks of a machine (the hybrid; the
  // communicator must have machine memory).
  ParameterUnits(comm::Communicator& comm, std::vector<torch::Tensor> flat, std::vector<torch::Tensor> shards,
                 std::vector<int> bucket_of_unit, int root, bool one_copy_per_machine);
  ~ParameterUnits();

  void gather(int bucket);
  void prefetch(int bucket);
  void release(int bucket);
  void release_unit(int bucket);  // release, unless it is the root (held for a whole step)
  void gather_all();
  void release_all();
  // After the parameters were written whole (a load): their slices into the shards.
  void keep_gathered_values();

  // The runner the model's forward calls; reducer (may be null) says whether backward has begun.
  torch::Tensor run(int unit, const UnitForward& forward, const torch::Tensor& input, const Reducer* reducer);
  void before_forward();

  std::int64_t high_water_bytes() const { return high_water_; }

 private:
  std::int64_t bytes_of(int bucket) const;
  void finish(int bucket);  // waits for a gather in flight
  int next_in_forward(int bucket) const;
  int previous_in_forward(int bucket) const;

  comm::Communicator& comm_;
  UnitPool pool_;  // before flat_: outlives the storages that point into it
  std::vector<torch::Tensor> flat_, shards_;
  std::vector<int> bucket_of_unit_;
  int root_;
  std::vector<char> gathered_;        // per bucket: its flat array holds the values (or will, see works_)
  std::vector<char> from_pool_;       // per bucket: its memory is a pool block (else its own allocation)
  std::vector<comm::WorkPtr> works_;  // per bucket: a gather in flight
  std::vector<int> forward_order_;    // buckets in the order forward first ran their units
  bool order_known_ = false;
  std::int64_t gathered_bytes_ = 0, high_water_ = 0;
};

}  // namespace lockstep::ddp_detail
