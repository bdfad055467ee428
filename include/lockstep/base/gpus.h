// How many GPUs this process may use, counted without loading CUDA: the launcher decides
// `--nproc-per-node auto` before any worker starts, and a launcher that initialised CUDA would
// hold a context on every GPU its workers then share. Torch-free.
//
// The NVIDIA driver lists each GPU it drives as one directory under /proc/driver/nvidia/gpus
// (named by its PCI address); CUDA_VISIBLE_DEVICES, when set, narrows those as CUDA does.
#pragma once

#include <optional>
#include <string>

namespace lockstep {

inline constexpr const char* kNvidiaDriverGpus = "/proc/driver/nvidia/gpus";

// The GPUs the driver lists in `driver_dir` (0 when it lists none or is not loaded), narrowed by
// the CUDA_VISIBLE_DEVICES of this process.
int visible_gpus(const std::string& driver_dir = kNvidiaDriverGpus);

// The GPUs left of `driver_gpus` by a CUDA_VISIBLE_DEVICES of `visible` (nullopt: unset, all of
// them). As CUDA reads it: comma-separated entries, each an index below `driver_gpus` or a UUID
// ("GPU-..." or "MIG-..."); the list ends at the first entry that is neither (so "" and "-1"
// leave none), and an entry named twice counts once.
int visible_gpus(int driver_gpus, const std::optional<std::string>& visible);

// What `lockstep run --nproc-per-node auto` starts: one worker per visible GPU when there are
// any, as torchrun does, else one per CPU core.
int auto_nproc_per_node(int gpus, unsigned cores);

}  // namespace lockstep
