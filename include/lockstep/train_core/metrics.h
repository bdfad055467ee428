// The records of OUTPUT_DIR/metrics.jsonl, the Trainer's log: one JSON object per line, each
// with an "event" key. The format is documented in docs/metrics.md, which is generated from the
// tables below (`lockstep metrics-format`) and checked against them by a test, so the Trainer
// that writes these lines, lockstep doctor and lockstep report that read them, and a user's own
// tools all use the same keys.
//
//   {"event":"train_begin", ...}   once per start (a resumed run appends another)
//   {"event":"log", ...}           every --logging-steps optimiser steps
//   {"event":"eval", ...}          after every evaluation during training
//   {"event":"membership_change", ...}  an elastic job lost or gained workers (lockstep run
//                                  --nnodes MIN:MAX) and went on
//   {"event":"checkpoint", ...}    a checkpoint was saved (once it is complete on disk) or resumed from
//
// Each table row is (C++ type, key, meaning); the key is the member's name. Fields of type
// std::optional are left out of a line when absent. Readers ignore keys they do not know.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

// clang-format off
#define LOCKSTEP_TRAIN_BEGIN_FIELDS(X)                                                                  \
  X(int, world_size, "workers in the run")                                                              \
  X(int, per_device_train_batch_size, "samples per worker per micro-batch")                             \
  X(int, gradient_accumulation_steps, "micro-batches per optimiser step")                               \
  X(int, dataloader_num_workers, "batch-building threads per worker")                                  \
  X(int, intra_op_threads, "libtorch intra-op threads per worker")                                      \
  X(int, cores, "CPU cores the machine reports")                                                        \
  X(std::string, backend, "communication backend in use (shm, gloo, hier, mpi, nccl)")                        \
  X(int, machines, "machines the workers run on (found by probing shared memory)")                     \
  X(double, ddp_bucket_cap_mb, "gradient bucket size in effect, MB (ZeRO-2 lowers it to 4)")            \
  X(double, ddp_bucket_cap_mb_asked, "gradient bucket size --ddp-bucket-cap-mb asked for, MB")           \
  X(std::string, ddp_comm_hook, "gradient compression on the wire (none, fp16, bf16, powersgd, int8, auto)")                  \
  X(int, sync_every, "local SGD: optimiser steps between the machines' meetings (1: every step, plain DDP)") \
  X(std::int64_t, parameters, "trainable and frozen parameters of the model")                           \
  X(std::int64_t, parameter_bytes, "bytes of the model's parameters")                                   \
  X(int, zero_stage, "0: DDP; 1: optimizer state sharded; 2: gradients too; 3: parameters too")       \
  X(bool, zero_shared_parameters, "whether the parameters are kept once per machine")                    \
  X(std::int64_t, worker_parameter_bytes, "parameter bytes each worker holds (shared: its share of one copy)") \
  X(std::int64_t, worker_gradient_bytes, "gradient bytes each worker keeps between steps")               \
  X(std::int64_t, worker_gradient_slot_bytes, "ZeRO-2: the two bucket slots gradients pass through")     \
  X(std::int64_t, worker_optimizer_state_bytes, "optimizer-state bytes each worker holds once it stepped") \
  X(bool, gradient_checkpointing, "whether blocks recompute their activations in backward")            \
  X(std::int64_t, max_steps, "optimiser steps the run will take")                                       \
  X(std::int64_t, start_step, "the step this start begins at (above 0 after a resume)")                 \
  X(std::string, blas, "the BLAS library's configuration string (OpenBLAS), empty if unknown")         \
  X(std::string, blas_core, "the OpenBLAS kernel set in use")                                           \
  X(std::string, blas_best_core, "the fastest OpenBLAS kernel set this CPU runs")                       \
  X(std::string, blas_own_core, "the kernel set OpenBLAS picks by itself on this CPU")                  \
  X(bool, blas_forced, "whether OPENBLAS_CORETYPE chose the kernels")                                   \
  X(bool, blas_by_launcher, "whether lockstep run set OPENBLAS_CORETYPE, OpenBLAS's own pick being slower") \
  X(bool, bf16, "whether forward and backward run under bfloat16 autocast (--bf16)")                  \
  X(bool, fp16, "whether forward and backward run under float16 autocast with loss scaling (--fp16)")   \
  X(std::optional<double>, model_flops_per_sample,                                                      \
    "training FLOPs per sample: 3x the forward's matrix products (model FLOPs; recomputation not counted); " \
    "absent when the model's products are unknown (docs/metrics.md says which models count)")           \
  X(std::optional<double>, matmul_fp32_flops_per_second,                                                \
    "rank 0's measured fp32 matmul rate at the model's shapes and threads (LOCKSTEP_PROBE_MATMUL=1)")    \
  X(std::optional<double>, matmul_bf16_flops_per_second, "... and in bfloat16")                          \
  X(std::optional<int>, pipeline_parallel, "--pipeline-parallel: pipeline ranks P (the world is P x replicas)") \
  X(std::optional<std::string>, pipeline_schedule, "... the schedule (gpipe, 1f1b, interleaved, zb)")     \
  X(std::optional<int>, virtual_stages, "... stages per pipeline rank (interleaved, zb)")                    \
  X(std::optional<int>, num_microbatches, "... micro-batches per step (the last step of an epoch may have fewer)") \
  X(std::optional<std::string>, pipeline_plan, "... which units each stage holds, one line per stage")

#define LOCKSTEP_STEP_LOG_FIELDS(X)                                                                     \
  X(std::int64_t, step, "optimiser steps done")                                                         \
  X(double, epoch, "epochs done, fractional")                                                           \
  X(double, loss, "training loss over the window, averaged over samples on every rank")               \
  X(double, learning_rate, "the learning rate of the window's last step")                               \
  X(std::optional<double>, grad_norm, "global gradient norm before clipping (when --max-grad-norm > 0)") \
  X(std::optional<double>, loss_scale,                                                                  \
    "--fp16: the loss scale after the window's last step (--sync-every: the lowest machine's)")         \
  X(std::optional<int>, skipped_steps,                                                                 \
    "--fp16: the window's steps whose gradients overflowed (no update; --sync-every: the most any one "  \
    "machine skipped)")                                                                                 \
  X(double, samples_per_second, "samples of all workers per second of wall time over the window")      \
  X(std::optional<double>, tokens_per_second, "target tokens of all workers per second (per-token targets only)") \
  X(std::optional<double>, model_flops_per_second, "model FLOPs of all workers per second (train_begin's model_flops_per_sample x samples_per_second)") \
  X(std::optional<double>, mfu, "model FLOPs utilisation: model_flops_per_second over world_size times the measured matmul rate at the run's precision (when probed)") \
  X(int, world_size, "workers")                                                                          \
  X(double, step_seconds, "time per step, averaged over steps and ranks")                               \
  X(double, data_seconds, "... waiting for the batch")                                                  \
  X(double, forward_seconds, "... in forward and the loss")                                             \
  X(double, backward_seconds, "... computing backward (communication it hid included)")                 \
  X(double, exposed_comm_seconds, "... waiting for the others: gradient all-reduce, buffers' broadcast")   \
  X(double, comm_seconds, "... all-reducing, overlapped or not")                                        \
  X(double, optimizer_seconds, "... clipping and in the optimiser")                                     \
  X(double, exposed_comm_fraction, "exposed_comm_seconds / step_seconds")                               \
  X(double, allreduce_bytes_per_step, "gradient bytes each rank all-reduced per step")                  \
  X(double, buckets_per_step, "gradient buckets per step")                                              \
  X(std::optional<double>, network_bytes_per_step, "bytes rank 0 sent over the network per step (gloo; hier between machines)") \
  X(std::optional<double>, network_seconds_per_step, "... and the time its network collectives took")   \
  X(std::optional<double>, peak_rss_bytes, "rank 0's resident-memory high-water mark so far (VmHWM)")     \
  X(std::optional<double>, step_tensor_bytes,                                                                  \
    "the most rank 0's CPU tensors grew by within one step of the window, from its start to its peak "         \
    "(activations kept for backward, gradients, temporaries)")                                                 \
  X(std::optional<double>, job_pss_bytes,                                                                      \
    "all workers' proportional set size summed at the window's end: the job's memory, shared pages once") \
  X(std::optional<double>, zero_gathered_high_water_bytes,                                                     \
    "ZeRO stage 3: the most parameter bytes rank 0 held gathered at once so far (with one copy per machine: " \
    "its machine's, shared)")                                                                                  \
  X(std::optional<std::vector<double>>, pipeline_bubble,                                                       \
    "--pipeline-parallel: per pipeline rank (averaged over its replicas), the share of each step it did not "   \
    "compute, from the step's first action to the gradient norm every stage meets at (the bubble)")            \
  X(std::optional<std::vector<double>>, pipeline_bubble_analytic,                                              \
    "... the share its schedule idles (its table simulated step by step with the time each action took, "  \
    "transfers taking none): what pipeline_bubble exceeds it by is the transfers' and the runtime's cost")    \
  X(std::optional<std::vector<double>>, pipeline_compute_seconds, "... per step, in forwards and backwards")   \
  X(std::optional<std::vector<double>>, pipeline_wait_seconds, "... per step, waiting for a stage's transfer")  \
  X(std::optional<std::vector<double>>, pipeline_send_seconds, "... per step, handing transfers to the network") \
  X(std::optional<std::vector<double>>, pipeline_reduce_seconds, "... per step, waiting for the replicas' gradient reduction") \
  X(std::optional<double>, data_comm_seconds,                                                                 \
    "per parallel dimension (tensor parallelism or a pipeline), its communication per step averaged over "     \
    "ranks: the data dimension's (tensor parallelism: the data group's collectives, overlapped or not; a "    \
    "pipeline: the mean of pipeline_reduce_seconds)")                                                         \
  X(std::optional<double>, tensor_comm_seconds, "... the tensor groups' collectives, all on the step's path") \
  X(std::optional<double>, pipeline_comm_seconds, "... the pipeline's transfers: the mean of pipeline_send_seconds") \
  X(std::optional<int>, straggler_rank, "the rank the others waited for over the window, when one stood out") \
  X(std::optional<std::string>, straggler, "... why: its data loading or its compute, and by how much")

#define LOCKSTEP_EVAL_LOG_FIELDS(X)                                                                     \
  X(std::int64_t, step, "optimiser steps done when it ran")                                             \
  X(double, epoch, "epochs done, fractional")                                                           \
  X(double, eval_loss, "mean loss over every real sample of the eval set")                              \
  X(double, eval_accuracy, "share of targets whose highest output is the target (per token for language models)") \
  X(std::int64_t, eval_samples, "samples evaluated (each once, across all ranks)")                      \
  X(std::optional<std::int64_t>, eval_tokens, "target tokens evaluated (per-token targets only)")        \
  X(std::optional<double>, eval_perplexity, "exp(eval_loss), the language-model figure (per-token targets only)") \
  X(double, eval_seconds, "time the evaluation took")

#define LOCKSTEP_MEMBERSHIP_CHANGE_FIELDS(X)                                                            \
  X(std::int64_t, step, "optimiser steps done when training went on: the step every member resumed from") \
  X(std::int64_t, membership, "the new membership's number (0 is the first)")                           \
  X(std::string, reason, "join, or failure: the error that started the change")                        \
  X(int, world_size_before, "workers before the change")                                                \
  X(int, world_size, "workers after it")                                                                 \
  X(int, machines, "machines after it")                                                                  \
  X(std::string, left, "the workers that left (host, machine, local rank), or none")                    \
  X(std::string, joined, "the workers that joined, or none")                                             \
  X(double, agree_seconds, "from noticing to the new membership agreed through the store")              \
  X(double, rebuild_seconds, "building the new membership's communicator")                               \
  X(double, state_seconds, "bringing every member to the newest completed step (a broadcast of the model, " \
                           "the optimizer state and the data position from a member that holds it)")     \
  X(double, recovery_seconds, "from noticing to training again, everything included")                    \
  X(std::int64_t, steps_lost, "completed steps taken again (the step in progress when a member failed is " \
                              "redone: it never completed)")
#define LOCKSTEP_CHECKPOINT_FIELDS(X)                                                                   \
  X(std::int64_t, step, "the optimiser step it holds")                                                  \
  X(std::string, dir, "the checkpoint directory")                                                       \
  X(std::string, action, "save, or resume (read at the start of this run)")                              \
  X(std::string, format, "sharded (every rank wrote its part) or consolidated (rank 0 wrote model.pt)")  \
  X(bool, background, "whether training went on while it was written")                                 \
  X(double, stall_seconds, "save: the time the step that saved spent on it (the slowest rank); resume: reading it") \
  X(double, write_seconds, "save: from the step that saved to the checkpoint complete on disk")          \
  X(std::int64_t, bytes, "bytes of its files (sharded: every rank's shard)")                             \
  X(int, saved_world_size, "the workers that wrote it")                                                  \
  X(int, world_size, "the workers of this run")
// clang-format on

namespace lockstep::train::metrics {

#define LOCKSTEP_METRICS_MEMBER(type, name, meaning) type name{};

struct TrainBegin {
  LOCKSTEP_TRAIN_BEGIN_FIELDS(LOCKSTEP_METRICS_MEMBER)
  nlohmann::json to_json() const;
  static TrainBegin from_json(const nlohmann::json& j);
};

struct StepLog {
  LOCKSTEP_STEP_LOG_FIELDS(LOCKSTEP_METRICS_MEMBER)
  nlohmann::json to_json() const;
  static StepLog from_json(const nlohmann::json& j);
};

struct EvalLog {
  LOCKSTEP_EVAL_LOG_FIELDS(LOCKSTEP_METRICS_MEMBER)
  nlohmann::json to_json() const;
  static EvalLog from_json(const nlohmann::json& j);
};

struct MembershipChangeLog {
  LOCKSTEP_MEMBERSHIP_CHANGE_FIELDS(LOCKSTEP_METRICS_MEMBER)
  nlohmann::json to_json() const;
  static MembershipChangeLog from_json(const nlohmann::json& j);
};

struct CheckpointLog {
  LOCKSTEP_CHECKPOINT_FIELDS(LOCKSTEP_METRICS_MEMBER)
  nlohmann::json to_json() const;
  static CheckpointLog from_json(const nlohmann::json& j);
};

#undef LOCKSTEP_METRICS_MEMBER

// The event names of the "event" key.
inline constexpr const char* kTrainBegin = "train_begin";
inline constexpr const char* kLog = "log";
inline constexpr const char* kEval = "eval";
inline constexpr const char* kMembershipChange = "membership_change";
inline constexpr const char* kCheckpoint = "checkpoint";

// One start of a run: its train_begin and the lines after it.
struct Segment {
  std::optional<TrainBegin> begin;
  std::vector<StepLog> logs;
  std::vector<EvalLog> evals;
  std::vector<MembershipChangeLog> membership_changes;
  std::vector<CheckpointLog> checkpoints;
};

// Every start recorded in a metrics.jsonl, oldest first. A ConfigError names the file when it
// cannot be read or a line in its middle is not JSON; an incomplete last line (a run killed
// while writing it) is skipped.
std::vector<Segment> read_metrics(const std::string& path);

// docs/metrics.md's tables: every record's keys, types and meanings.
std::string markdown();

}  // namespace lockstep::train::metrics
