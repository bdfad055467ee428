#include "worker_env.h"

#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <thread>

#include "lockstep/base/cpu_kernels.h"
#include "lockstep/base/log.h"

namespace lockstep::launch {
namespace {

// Defaults the user's own settings win over.
void add_defaults(knobs::Environment& env, int local_workers) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  if (!env.count(knobs::kOmpNumThreads.name))
    env[knobs::kOmpNumThreads.name] =
        std::to_string(std::max(1u, cores / static_cast<unsigned>(local_workers)));
  if (!env.count(knobs::kGlibcTunables.name)) env[knobs::kGlibcTunables.name] = kWorkerMallocTunables;
}

// What every worker of this node shares: the job's shape and how to reach its store.
void add_job(knobs::Environment& env, const LaunchOptions& o, const JobPlacement& p) {
  const std::string master_addr = o.nnodes == 1 ? "127.0.0.1" : o.master_addr;
  env[knobs::kMasterAddr.name] = master_addr;
  env[knobs::kMasterPort.name] = std::to_string(p.master_port);
  env[knobs::kWorldSize.name] = env["ROLE_WORLD_SIZE"] = std::to_string(p.world_size);
  env[knobs::kLocalWorldSize.name] = std::to_string(o.nproc_per_node);
  env["GROUP_RANK"] = std::to_string(o.node_rank);
  env["GROUP_WORLD_SIZE"] = std::to_string(o.nnodes);
  env["ROLE_NAME"] = "default";
  env[knobs::kTorchelasticRestartCount.name] = env[knobs::kRestartCount.name] = std::to_string(p.attempt);
  env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(o.max_restarts);
  env["TORCHELASTIC_RUN_ID"] = env[knobs::kRunId.name] = p.run_id;
  env[knobs::kStoreAddr.name] = p.store_address;
  env[knobs::kToken.name] = p.token;
  if (!o.backend.empty()) env[knobs::kBackend.name] = o.backend;
  if (!o.torch_backend.empty()) env[knobs::kTorchBackend.name] = o.torch_backend;
}

// In a build tree the torch.distributed backend sits beside tools/ (build/python): Python
// workers get it on their path, so `init_process_group("lockstep")` needs no PYTHONPATH and no
// import. (An installed lockstep registers it through a .pth file in dist-packages instead.)
void add_python_backend(knobs::Environment& env) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return;
  const fs::path dir = exe.parent_path().parent_path() / "python";
  if (!fs::exists(dir / "lockstep_torch", ec)) return;
  std::string& path = env["PYTHONPATH"];
  path = path.empty() ? dir.string() : dir.string() + ":" + path;
}

}  // namespace

void choose_blas_kernels() {
  if (knobs::is_set(knobs::kOpenblasCoretype)) return;
  const std::string own = openblas_own_core(), best = best_openblas_core(this_cpus_flags());
  if (!openblas_core_below(own, best)) return;
  ::setenv(knobs::kOpenblasCoretype.name, best.c_str(), 1);
  ::setenv(knobs::kOpenblasOwnCore.name, own.c_str(), 1);
  LOCKSTEP_LOG(info, run) << "OpenBLAS picks its " << own << " kernels on this CPU, which runs its " << best
                          << " kernels: workers get OPENBLAS_CORETYPE=" << best
                          << " (set OPENBLAS_CORETYPE to choose yourself)";
}

std::vector<WorkerSpec> worker_specs(const LaunchOptions& options, const JobPlacement& placement,
                                     knobs::Environment inherited) {
  add_defaults(inherited, options.nproc_per_node);
  add_python_backend(inherited);
  add_job(inherited, options, placement);
  std::vector<WorkerSpec> specs;
  for (int local = 0; local < options.nproc_per_node; ++local) {
    knobs::Environment env = inherited;
    const int rank = placement.first_rank + local;
    env[knobs::kRank.name] = env["ROLE_RANK"] = std::to_string(rank);
    env[knobs::kLocalRank.name] = std::to_string(local);
    WorkerSpec spec;
    spec.rank = rank;
    spec.local_rank = local;
    for (auto& [k, v] : env) spec.env.push_back(k + "=" + v);
    specs.push_back(std::move(spec));
  }
  return specs;
}

WorkerSpec elastic_worker_spec(const LaunchOptions& options, const JobPlacement& placement, int node, int local,
                               int incarnation, knobs::Environment env) {
  add_defaults(env, options.nproc_per_node);
  add_python_backend(env);
  for (const knobs::Knob* shape : {&knobs::kRank, &knobs::kWorldSize, &knobs::kMasterAddr, &knobs::kMasterPort})
    env.erase(shape->name);
  env[knobs::kElastic.name] = std::to_string(options.min_nodes) + ":" + std::to_string(options.nnodes);
  env[knobs::kGroupRank.name] = std::to_string(node);
  env[knobs::kLocalRank.name] = std::to_string(local);
  env[knobs::kLocalWorldSize.name] = std::to_string(options.nproc_per_node);
  env["TORCHELASTIC_RUN_ID"] = env[knobs::kRunId.name] = placement.run_id;
  env[knobs::kStoreAddr.name] = placement.store_address;
  env[knobs::kToken.name] = placement.token;
  if (!options.backend.empty()) env[knobs::kBackend.name] = options.backend;
  if (!options.torch_backend.empty()) env[knobs::kTorchBackend.name] = options.torch_backend;
  WorkerSpec spec;
  spec.rank = node * options.nproc_per_node + local + incarnation * options.nproc_per_node * options.nnodes;
  spec.local_rank = local;
  spec.label = "node " + std::to_string(node) + " local " + std::to_string(local);
  for (auto& [k, v] : env) spec.env.push_back(k + "=" + v);
  return spec;
}

}  // namespace lockstep::launch
