// Every environment variable lockstep reads, declared once, here, with its default and its
// meaning. Code reads a variable only through get()/environment() with one of these knobs, so
// this table is complete: a test fails when a source file calls getenv itself, and
// docs/environment.md is generated from the table (`lockstep env --markdown`) and checked
// against it.
//
// Thread-safety: reading is safe from any thread as long as nobody calls setenv meanwhile.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace lockstep::knobs {

// Who defines the variable: the tables of docs/environment.md follow this order.
enum class Group {
  job,        // the job's shape, with torchrun's names (lockstep run sets them)
  scheduler,  // what mpirun, Slurm and SageMaker set, used when RANK is unset
  comm,       // lockstep's own runtime settings
  launch,     // read by lockstep run itself
  train,      // read by the Trainer
  libraries,  // read by the libraries lockstep runs on (OpenBLAS, OpenMP, glibc, Gloo)
};

struct Knob {
  const char* name;
  const char* default_value;  // used when unset; nullptr: no default ("not set")
  const char* meaning;        // one line for the docs; says how a computed default is found
  Group group;
};

// clang-format off
// --- the job (torchrun's names) ---
inline constexpr Knob kRank{"RANK", nullptr, "global rank of this process, 0..WORLD_SIZE-1; with WORLD_SIZE also unset (and no scheduler's variables), a job of one", Group::job};
inline constexpr Knob kWorldSize{"WORLD_SIZE", nullptr, "number of processes in the job", Group::job};
inline constexpr Knob kLocalRank{"LOCAL_RANK", nullptr, "rank of this process on its machine (default: RANK mod LOCAL_WORLD_SIZE)", Group::job};
inline constexpr Knob kLocalWorldSize{"LOCAL_WORLD_SIZE", nullptr, "processes on this machine (default: WORLD_SIZE)", Group::job};
inline constexpr Knob kMasterAddr{"MASTER_ADDR", "127.0.0.1", "address of rank 0's machine, as the others reach it", Group::job};
inline constexpr Knob kMasterPort{"MASTER_PORT", nullptr, "port where rank 0 hosts the store when no launcher does", Group::job};
inline constexpr Knob kGroupRank{"GROUP_RANK", nullptr, "the machine's node rank (set by lockstep run); elastic workers name their machine by it", Group::job};
inline constexpr Knob kTorchelasticRestartCount{"TORCHELASTIC_RESTART_COUNT", nullptr, "torchrun's name for LOCKSTEP_RESTART_COUNT, read when that is unset", Group::job};
// --- schedulers ---
inline constexpr Knob kOmpiRank{"OMPI_COMM_WORLD_RANK", nullptr, "mpirun: the rank, used when RANK is unset", Group::scheduler};
inline constexpr Knob kOmpiSize{"OMPI_COMM_WORLD_SIZE", nullptr, "mpirun: the world size", Group::scheduler};
inline constexpr Knob kOmpiLocalRank{"OMPI_COMM_WORLD_LOCAL_RANK", nullptr, "mpirun: the local rank", Group::scheduler};
inline constexpr Knob kOmpiLocalSize{"OMPI_COMM_WORLD_LOCAL_SIZE", nullptr, "mpirun: processes on this machine", Group::scheduler};
inline constexpr Knob kSlurmProcId{"SLURM_PROCID", nullptr, "Slurm srun: the rank, used when RANK and the mpirun variables are unset", Group::scheduler};
inline constexpr Knob kSlurmNtasks{"SLURM_NTASKS", nullptr, "Slurm: the world size", Group::scheduler};
inline constexpr Knob kSlurmLocalId{"SLURM_LOCALID", nullptr, "Slurm: the local rank", Group::scheduler};
inline constexpr Knob kSlurmNtasksPerNode{"SLURM_NTASKS_PER_NODE", nullptr, "Slurm: processes per machine", Group::scheduler};
inline constexpr Knob kSlurmTasksPerNode{"SLURM_TASKS_PER_NODE", nullptr, "Slurm: processes per machine as \"2(x3),1\" (the first count), when SLURM_NTASKS_PER_NODE is unset", Group::scheduler};
inline constexpr Knob kSlurmJobNodelist{"SLURM_JOB_NODELIST", nullptr, "Slurm: the job's hosts; the first is MASTER_ADDR", Group::scheduler};
inline constexpr Knob kSlurmNodelist{"SLURM_NODELIST", nullptr, "Slurm: older name of SLURM_JOB_NODELIST", Group::scheduler};
inline constexpr Knob kSlurmJobId{"SLURM_JOB_ID", nullptr, "Slurm: MASTER_PORT defaults to 20000 + SLURM_JOB_ID mod 20000", Group::scheduler};
inline constexpr Knob kSmHosts{"SM_HOSTS", nullptr, "SageMaker: the job's hosts as a JSON list, one rank each; the first is MASTER_ADDR (port 29500 unless MASTER_PORT is set)", Group::scheduler};
inline constexpr Knob kSmCurrentHost{"SM_CURRENT_HOST", nullptr, "SageMaker: this host; its index in SM_HOSTS is the rank", Group::scheduler};
// --- lockstep's runtime ---
inline constexpr Knob kStoreAddr{"LOCKSTEP_STORE_ADDR", nullptr, "host:port of the launcher's store (set by lockstep run); wins over MASTER_ADDR/MASTER_PORT", Group::comm};
inline constexpr Knob kToken{"LOCKSTEP_TOKEN", "", "the run's secret: every store connection proves it holds it (HMAC); lockstep run reads it too, for jobs across machines", Group::comm};
inline constexpr Knob kRunId{"LOCKSTEP_RUN_ID", "default", "names the run's keys on the store", Group::comm};
inline constexpr Knob kRestartCount{"LOCKSTEP_RESTART_COUNT", "0", "restarts so far (set by lockstep run); the Trainer resumes from its newest checkpoint when above 0", Group::comm};
inline constexpr Knob kElastic{"LOCKSTEP_ELASTIC", nullptr, "MIN:MAX machines, set by lockstep run --nnodes MIN:MAX: the worker joins an elastic membership (the Trainer does; a plain rendezvous refuses) instead of a fixed RANK and WORLD_SIZE", Group::comm};
inline constexpr Knob kBackend{"LOCKSTEP_BACKEND", "auto", "shm, gloo, hier, mpi, nccl (GPU memory; host buffers staged) or auto (shm when every rank is on one machine; gloo when each machine holds one rank; else hier, unequal machines included)", Group::comm};
inline constexpr Knob kTorchBackend{"LOCKSTEP_TORCH_BACKEND", nullptr, "Python: the torch.distributed backend (lockstep, gloo, ...) the default process group is created with as torch is imported (lockstep run --torch-backend sets it), so that a script that never creates one, or creates one only when none exists (the Hugging Face Trainer, Accelerate), runs on it unchanged", Group::comm};
inline constexpr Knob kHierAcross{"LOCKSTEP_HIER_ACROSS", "gloo", "the hier backend's engine between machines: gloo, or mpi (under mpirun, in a lockstep built with MPI; MASTER_ADDR/MASTER_PORT still give the store the machines' shared memory needs)", Group::comm};
inline constexpr Knob kP2pShm{"LOCKSTEP_P2P_SHM", "1", "point-to-point between ranks on one machine (a pipeline's activations, dist.send/recv): through shared memory (1) or over loopback TCP (0)", Group::comm};
inline constexpr Knob kGlooRing{"LOCKSTEP_GLOO_RING", "mailbox", "the gloo backend's all-reduces above 512 KiB gathered: a ring over lockstep's own connections (mailbox), or Gloo's ring (gloo); every rank must name the same, else Gloo's is used", Group::comm};
inline constexpr Knob kTimeout{"LOCKSTEP_TIMEOUT", "300", "seconds any collective or store call may take", Group::comm};
inline constexpr Knob kPeerCheck{"LOCKSTEP_PEER_CHECK", "5", "seconds within which a dead peer is reported; a collective stalled this long is compared with the peers' through the store", Group::comm};
inline constexpr Knob kCheckCollectives{"LOCKSTEP_CHECK_COLLECTIVES", "64", "gloo, hier and mpi: compare the ranks' collectives at the first and then every N-th (covering those in between), every (before each one), or off; shm checks every one at no cost", Group::comm};
inline constexpr Knob kGlooIface{"LOCKSTEP_GLOO_IFACE", nullptr, "network interface the network backends bind (default: the one that routes to the master); wins over GLOO_SOCKET_IFNAME", Group::comm};
inline constexpr Knob kLogLevel{"LOCKSTEP_LOG_LEVEL", "info", "error, warn, info or debug: the lowest level of lines lockstep writes", Group::comm};
inline constexpr Knob kLogSubsystems{"LOCKSTEP_LOG_SUBSYSTEMS", "all", "which subsystems log: all, a list such as comm,store, or ^list to exclude (names: base store comm shm gloo mpi hier run data ddp train doctor)", Group::comm};
// --- the launcher ---
inline constexpr Knob kPath{"PATH", "/usr/local/bin:/usr/bin:/bin", "where lockstep run finds a PROGRAM given without a '/'", Group::launch};
// --- the Trainer ---
inline constexpr Knob kElasticCheck{"LOCKSTEP_ELASTIC_CHECK", "1", "elastic jobs: seconds of training between the members' looks for workers waiting to join (one integer all-reduce each)", Group::train};
inline constexpr Knob kFaultInject{"LOCKSTEP_FAULT_INJECT", nullptr, "tests only, first attempt (elastic: first membership) only; comma-separated: kill-during-save:STEP (rank 0 dies inside the save of checkpoint-STEP), kill-after-step:STEP:RANK, kill-during-eval:STEP:RANK, kill-before-update:STEP:RANK (RANK dies in an elastic ZeRO step holding its gradients, before the update may start), kill-in-update:STEP:RANK (... once its slices are updated, before the all-gather) kill-in-state-transfer:MEMBERSHIP:RANK (RANK dies sending the state to the members of that membership) kill-before-communicator:MEMBERSHIP:RANK (RANK of that elastic membership dies once it is published, before its communicator is up) or kill-after-gloo-address:N:RANK (RANK dies in its process's Nth gloo communicator, 0 the first, once its pairs' addresses are on the store, before its pairs connect); await-joiner:MEMBERSHIP holds that membership's members at their next membership check, up to 60 s, until a joiner waits", Group::train};
inline constexpr Knob kProbeMatmul{"LOCKSTEP_PROBE_MATMUL", nullptr, "1: before training, every worker measures its matmul rate at the model's shapes in fp32 and bf16 (about a second), and metrics.jsonl reports them and the model FLOPs utilisation (mfu); lockstep doctor sets it", Group::train};
inline constexpr Knob kOpenblasOwnCore{"LOCKSTEP_OPENBLAS_OWN_CORE", nullptr, "set by lockstep run beside the OPENBLAS_CORETYPE it chose: the kernels OpenBLAS picks by itself on this CPU, which the Trainer's metrics and lockstep doctor report", Group::train};
// --- libraries lockstep runs on ---
inline constexpr Knob kOmpNumThreads{"OMP_NUM_THREADS", nullptr, "intra-op threads per process; lockstep run and lockstep doctor set cores / workers when it is unset", Group::libraries};
inline constexpr Knob kOpenblasCoretype{"OPENBLAS_CORETYPE", nullptr, "OpenBLAS's kernels (e.g. SkylakeX, Haswell), read when it loads; when unset and OpenBLAS would pick kernels below the CPU's, lockstep run sets the CPU's best for its workers (and says so), and the Trainer warns in programs started otherwise", Group::libraries};
inline constexpr Knob kGlooSocketIfname{"GLOO_SOCKET_IFNAME", nullptr, "PyTorch's name for the interface Gloo binds (the first of a comma-separated list); lockstep honours it when LOCKSTEP_GLOO_IFACE is unset", Group::libraries};
inline constexpr Knob kCudaVisibleDevices{"CUDA_VISIBLE_DEVICES", nullptr, "CUDA's list of the GPUs a process may use (indices or UUIDs, comma-separated); lockstep run --nproc-per-node auto counts the GPUs it leaves, as CUDA would", Group::libraries};
inline constexpr Knob kGlibcTunables{"GLIBC_TUNABLES", nullptr, "glibc's tunables; when unset, lockstep run gives workers malloc tunables that keep freed memory for reuse", Group::libraries};
// clang-format on

inline constexpr const Knob* kAll[] = {&kRank,
                                       &kWorldSize,
                                       &kLocalRank,
                                       &kLocalWorldSize,
                                       &kMasterAddr,
                                       &kMasterPort,
                                       &kGroupRank,
                                       &kTorchelasticRestartCount,
                                       &kOmpiRank,
                                       &kOmpiSize,
                                       &kOmpiLocalRank,
                                       &kOmpiLocalSize,
                                       &kSlurmProcId,
                                       &kSlurmNtasks,
                                       &kSlurmLocalId,
                                       &kSlurmNtasksPerNode,
                                       &kSlurmTasksPerNode,
                                       &kSlurmJobNodelist,
                                       &kSlurmNodelist,
                                       &kSlurmJobId,
                                       &kSmHosts,
                                       &kSmCurrentHost,
                                       &kStoreAddr,
                                       &kToken,
                                       &kRunId,
                                       &kRestartCount,
                                       &kElastic,
                                       &kBackend,
                                       &kTorchBackend,
                                       &kHierAcross,
                                       &kGlooRing,
                                       &kP2pShm,
                                       &kTimeout,
                                       &kPeerCheck,
                                       &kCheckCollectives,
                                       &kGlooIface,
                                       &kLogLevel,
                                       &kLogSubsystems,
                                       &kPath,
                                       &kElasticCheck,
                                       &kFaultInject,
                                       &kOpenblasOwnCore,
                                       &kProbeMatmul,
                                       &kOmpNumThreads,
                                       &kOpenblasCoretype,
                                       &kCudaVisibleDevices,
                                       &kGlibcTunables};

// The variable's value when set and not empty, else its default, else nullopt.
std::optional<std::string> get(const Knob& knob);
// Whether the variable is set at all (even to an empty value).
bool is_set(const Knob& knob);

// A snapshot of the whole environment, NAME -> value: what a launcher passes on to its
// workers, and what the rendezvous parses (tests pass a map of their own instead).
using Environment = std::map<std::string, std::string>;
Environment environment();
// The value in `env` when present and not empty, else nullopt (no default applied).
std::optional<std::string> lookup(const Environment& env, const Knob& knob);

// The table as the Markdown of docs/environment.md (one table per group).
std::string markdown();

}  // namespace lockstep::knobs
