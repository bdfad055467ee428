// Consolidated checkpoints: what one process writes and reads of a checkpoint directory
// (checkpoint_dir.h says what the directory holds), and the torch state in them: model.pt, the
// plain module's parameters and buffers (torch::save format, no wrapper prefix: torch::load(net,
// ".../model.pt") works in any libtorch program), optimizer.pt, the RNG state.
// Rank 0 writes it into OUTPUT_DIR/.tmp-checkpoint-<step>-<pid>/, flushes every file to disk,
// and renames the directory into place, so a checkpoint-<step>/ directory is always complete:
// a process killed mid-write leaves only a .tmp-* directory, which readers ignore and the next
// save removes. A save that fails (a full disk: StorageError naming the path) removes its
// temporary directory before the error leaves write_checkpoint.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "lockstep/train_core/checkpoint_dir.h"

namespace lockstep::train {

// Saves parameters and buffers (nested per submodule, as torch::save does).
void save_module(const torch::nn::Module& module, const std::string& path);

// Loads a module saved by save_module or torch::save into `module`, after checking that every
// parameter and buffer is there with the same shape and dtype and that the file holds nothing
// else. A mismatch is a ConfigError naming the first differing parameter, e.g.
// "checkpoint .../model.pt does not fit this model: parameter 'fc1.weight' is float32[128, 784]
// in the model but float32[256, 784] in the checkpoint".
void load_module(torch::nn::Module& module, const std::string& path);

// Loads what fits, as Hugging Face's from_pretrained does: every parameter and buffer the file
// and the module both have is copied; the ones only the module has keep their values (new
// layers, e.g. a classifier's head) and are listed as missing, the ones only the file has are
// listed as unexpected. A parameter of another shape is a ConfigError naming it.
struct LoadReport {
  std::vector<std::string> loaded, missing, unexpected;
};
LoadReport load_matching(torch::nn::Module& module, const std::string& path);



// Writes checkpoint directory `dir` atomically: model.pt, optimizer.pt, scheduler.json,
// training_args.json and (last) trainer_state.json go into a .tmp- sibling that is flushed and
// renamed to `dir`, replacing an older `dir` if there is one. `after_model` runs once model.pt is
// on disk (the tests' fault injection). `extra` files (name, bytes) go in beside the others.
struct CheckpointFile {
  std::string name, bytes;
};
void write_checkpoint(const std::string& dir, const torch::nn::Module& module,
                      torch::optim::Optimizer& optimizer, const nlohmann::json& scheduler,
                      const nlohmann::json& args, const nlohmann::json& trainer_state,
                      const std::function<void()>& after_model = {}, const std::vector<CheckpointFile>& extra = {});
// An optimizer's state as the bytes of a torch archive (what optimizer.pt holds).
std::string optimizer_bytes(torch::optim::Optimizer& optimizer);

// torch's default CPU generator state as hex text, and back (dropout masks, random init).
std::string rng_state_hex();
void set_rng_state_hex(const std::string& hex);  // ConfigError when it is not a valid state

// Collective-free reading of the parts of a checkpoint, each error naming the file: a
// DataError when the file is damaged or is not what lockstep wrote.
void load_optimizer(torch::optim::Optimizer& optimizer, const std::string& path);

}  // namespace lockstep::train
