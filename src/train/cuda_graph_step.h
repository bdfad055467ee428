// --cuda-graphs: the Trainer's step captured once into a CUDA graph and replayed.
//
// A small model on a GPU trains as fast as the host launches its kernels: several hundred per
// step, each a few microseconds of the host's time and less of the GPU's. After kWarmupSteps
// eager steps (which create the optimizer's state and let libtorch set up its kernels), the next
// step's forward, loss, backward, clipping by global norm and AdamW update are captured into one
// CUDA graph (at::cuda::CUDAGraph) and from then on every step is one replay: the batch is copied
// into static input buffers, the learning rate into a device tensor the graph reads, and the
// graph runs.
//
// What the graph holds, and owns: the static inputs and outputs (the loss, the gradient norm),
// one step count per parameter on the device (AdamW's bias corrections read it), the learning
// rate, and the memory of everything allocated while capturing (libtorch's private pool for the
// graph). The optimizer's exp_avg and exp_avg_sq are the Trainer's optimizer's own tensors,
// updated in place, and its host step counts are advanced after every replay, so checkpoints,
// evaluation and logging see the same state as in an eager run.
//
// What it refuses, before training (refusal()): anything but one worker on a CUDA device with
// AdamW, and gradient accumulation, --fp16's skipped steps, gradient checkpointing, ZeRO and
// pipelines. A step whose batch has another shape than the captured one (an epoch's short last
// batch) runs eagerly, with one warning line the first time.
//
// Threading: constructed, used and destroyed on the training thread; from construction to
// destruction that thread's current CUDA stream is a stream of the graph's (capture needs a stream
// other than the default one, and warm-up must run on the stream that captures).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "lockstep/data/loader.h"
#include "lockstep/train/trainer.h"
#include "lockstep/train_core/step_metrics.h"

namespace lockstep::train {

class CudaGraphStep {
 public:
  static constexpr int kWarmupSteps = 3;

  // Why this run cannot capture its step ("" when it can), naming what to change.
  static std::string refusal(const Trainer::Impl& trainer);

  // Switches this thread to the graph's stream (after the device has finished what it was given).
  explicit CudaGraphStep(Trainer::Impl& trainer);
  ~CudaGraphStep();
  CudaGraphStep(const CudaGraphStep&) = delete;
  CudaGraphStep& operator=(const CudaGraphStep&) = delete;

  // One optimiser step by replay (capturing first, the first time), or nullopt: this step is to
  // run eagerly (a warm-up step, or a batch of another shape: then take_batch() hands it back).
  std::optional<StepTimes> step(data::DataLoader<Batch>& loader, LogWindow& window);
  // The batch step() took from the loader and left to the eager step, if any.
  std::optional<Batch> take_batch();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lockstep::train
