// A DataLoader over a Trainer Dataset: the batches of training and of evaluation.
#pragma once

#include <memory>
#include <vector>

#include "lockstep/data/loader.h"
#include "lockstep/train/trainer.h"

namespace lockstep::train {

// Batches of `indices` from `ds`, built on `workers` threads.
inline std::unique_ptr<data::DataLoader<Batch>> make_loader(const std::shared_ptr<const Dataset>& ds,
                                                            const std::vector<std::size_t>& indices,
                                                            int batch_size, int workers) {
  data::LoaderOptions lo;
  lo.batch_size = static_cast<std::size_t>(batch_size);
  lo.num_workers = workers;
  return std::make_unique<data::DataLoader<Batch>>(
      indices, [ds](const std::vector<std::size_t>& idx) { return ds->get(idx); }, lo);
}

}  // namespace lockstep::train
