// Where a worker trains: the Trainer's --device. Torch-facing.
//
// cpu (the default); cuda: the GPU of this worker's LOCAL_RANK, as torchrun users expect (workers
// beyond the GPUs share them round-robin, which the staged backends allow); auto: cuda when this
// libtorch has CUDA and sees a GPU, else cpu. A device that cannot be had is a ConfigError that
// says why (a CPU-only libtorch, or no GPU visible) and what to do.
#pragma once

#include <torch/torch.h>

#include <string>

namespace lockstep::train {

torch::Device training_device(const std::string& choice, int local_rank);

// This worker's index on its machine (LOCAL_RANK, a scheduler's, or an elastic launcher's; 0 in a
// process started alone), which picks its GPU.
int local_rank();

}  // namespace lockstep::train
