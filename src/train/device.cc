#include "lockstep/train/device.h"

#include <algorithm>
#include <cctype>

#include "lockstep/base/gpus.h"
#include "lockstep/base/knobs.h"
#include "lockstep/base/log.h"
#include "lockstep/comm/elastic.h"
#include "lockstep/comm/rendezvous.h"
#include "lockstep/error.h"

namespace lockstep::train {
namespace {

// Why `--device cuda` cannot be had here, or "" when it can.
std::string why_no_cuda() {
#if LOCKSTEP_TORCH_CUDA
  // libtorch's CUDA half is linked: without a driver or a GPU it reports no CUDA at all.
  if (!at::hasCUDA())
    return "libtorch here has CUDA, but no GPU or NVIDIA driver answers (the driver lists " +
           std::to_string(visible_gpus()) +
           " GPUs after CUDA_VISIBLE_DEVICES): run on a machine with a GPU or use --device cpu";
#else
  if (!at::hasCUDA())
    return "this libtorch has no CUDA (Debian's is CPU-only): build lockstep on a CUDA libtorch (LOCKSTEP_TORCH=pip "
           "with nvcc installed) or use --device cpu";
#endif
  if (torch::cuda::device_count() == 0)
    return "libtorch has CUDA but sees no GPU (the driver lists " + std::to_string(visible_gpus()) +
           " after CUDA_VISIBLE_DEVICES): run on a machine with a GPU or use --device cpu";
  return "";
}

}  // namespace

torch::Device training_device(const std::string& choice, int local_rank) {
  if (choice == "cpu") return torch::kCPU;
  const std::string why = why_no_cuda();
  if (choice == "auto" && !why.empty()) return torch::kCPU;
  if (choice != "cuda" && choice != "auto")
    throw ConfigError("--device " + choice + ": not a device; use cpu, cuda or auto");
  if (!why.empty()) throw ConfigError("--device cuda: " + why);
  const int gpus = static_cast<int>(torch::cuda::device_count());
  if (local_rank == gpus)  // said once per machine, by its first worker to share
    LOCKSTEP_LOG(warn, train) << "more workers on this machine than GPUs (" << gpus
                              << "): workers share them round-robin, each GPU's time divided among its workers";
  return {torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank % gpus)};
}

int local_rank() {
  if (!comm::started_elastic()) return comm::rendezvous_info_from_env().local_rank;
  const std::string local = knobs::get(knobs::kLocalRank).value_or("0");  // an elastic launcher's
  const bool number = !local.empty() && local.size() < 6 && std::all_of(local.begin(), local.end(), ::isdigit);
  return number ? std::stoi(local) : 0;
}

}  // namespace lockstep::train
