// Writes sharded checkpoints on a thread of its own while training goes on.
//
// A save: every rank hands over a snapshot of what it holds (submit). Its thread writes the rank's
// shard into the checkpoint's temporary directory, flushes it to disk, and tells rank 0 how it
// went (point-to-point: the shard's entry for the index, or why it failed). Rank 0's thread
// collects all W, writes index.json and the run's JSON files, flushes, and renames the directory
// into place: a checkpoint-<step>/ directory is complete or absent. A kill at any moment leaves the
// previous checkpoints as they were and a .tmp- directory, which readers ignore and the next save
// removes. A save submitted while the previous one is still being written waits for it first:
// at most one snapshot is held in memory besides the live state.
//
// Threading: submit(), wait() and busy() on the training thread; one writer thread. The
// communicator's point-to-point messages are outside the order of its collectives, so the writer
// may use them while training issues collectives. The communicator must outlive the writer, or be
// replaced (set_communicator) only while no save is in flight.
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "lockstep/comm/communicator.h"
#include "lockstep/train/sharded_checkpoint.h"

namespace lockstep::train {

class CheckpointWriter {
 public:
  struct Job {
    std::string tmp_dir, final_dir;
    ShardSnapshot snapshot;
    std::map<std::string, std::string> files;  // rank 0: the checkpoint's other files, name -> text
    nlohmann::json extra;                      // rank 0: into index.json
    std::function<void()> before_commit;       // rank 0, once every shard is written (fault tests)
    std::function<void()> after_commit;        // rank 0, once the checkpoint is in place (rotation)
  };
  // What became of the last save on this rank: rank 0 knows whether the checkpoint is in place,
  // the others whether their shard was written.
  struct Outcome {
    std::string error;        // empty: it went well
    bool no_storage = false;  // the error was a full (or read-only) disk
    double seconds = 0;       // from submit to done, on this rank
  };

  explicit CheckpointWriter(comm::Communicator& comm);
  ~CheckpointWriter();  // waits for a save in flight
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  void set_communicator(comm::Communicator& comm);
  // Hands the save to the writer thread, after waiting for the one before (if any) to finish.
  void submit(Job job);
  // Blocks until no save is in flight; the last save's outcome.
  Outcome wait();
  bool busy() const;

 private:
  void loop();
  Outcome write(Job& job);
  void tell_rank0(const std::string& message);
  std::string hear_from(int rank);

  comm::Communicator* comm_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::optional<Job> job_;
  bool working_ = false, stopping_ = false;
  Outcome last_;
  std::thread thread_;
};

}  // namespace lockstep::train
