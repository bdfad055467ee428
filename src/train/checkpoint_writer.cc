// The background writer of sharded checkpoints (see checkpoint_writer.h).
#include "checkpoint_writer.h"

#include <chrono>
#include <cstring>
#include <filesystem>
#include <vector>

#include "lockstep/base/clock.h"
#include "lockstep/base/log.h"
#include "lockstep/error.h"
#include "lockstep/train_core/durable_file.h"

namespace fs = std::filesystem;

namespace lockstep::train {
namespace {

constexpr int kTag = 0x5c4b00;  // the shards' reports to rank 0, outside every other tag in use

}  // namespace

CheckpointWriter::CheckpointWriter(comm::Communicator& comm) : comm_(&comm), thread_([this] { loop(); }) {}

CheckpointWriter::~CheckpointWriter() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !job_ && !working_; });
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void CheckpointWriter::set_communicator(comm::Communicator& comm) {
  std::lock_guard<std::mutex> lock(mu_);
  comm_ = &comm;
}

void CheckpointWriter::submit(Job job) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !job_ && !working_; });
  job_ = std::move(job);
  cv_.notify_all();
}

CheckpointWriter::Outcome CheckpointWriter::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !job_ && !working_; });
  return last_;
}

bool CheckpointWriter::busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return job_.has_value() || working_;
}

void CheckpointWriter::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return job_.has_value() || stopping_; });
    if (stopping_ && !job_) return;
    Job job = std::move(*job_);
    job_.reset();
    working_ = true;
    lock.unlock();
    Outcome outcome = write(job);
    lock.lock();
    last_ = std::move(outcome);
    working_ = false;
    cv_.notify_all();
  }
}

// Every rank: its shard, then its report to rank 0. Rank 0: the reports, then the commit.
CheckpointWriter::Outcome CheckpointWriter::write(Job& job) {
  const auto begin = std::chrono::steady_clock::now();
  const int rank = comm_->rank(), world = comm_->size();
  Outcome out;
  nlohmann::json entry;
  try {
    entry = write_shard_file(CheckpointDir(job.tmp_dir).shard(rank, world), job.snapshot.tensors, job.snapshot.pieces);
  } catch (const StorageError& e) {
    out = {e.what(), true, 0};
  } catch (const std::exception& e) {
    out = {e.what(), false, 0};
  }
  const std::vector<CheckpointTensor> tensors = std::move(job.snapshot.tensors);
  job.snapshot = ShardSnapshot{};  // the memory goes back before the commit's wait
  try {
    if (rank != 0) {
      tell_rank0(out.error.empty() ? entry.dump() : nlohmann::json{{"error", out.error}}.dump());
    } else {
      std::vector<nlohmann::json> shards{entry};
      for (int r = 1; r < world;
           ++r) {  // every report is heard, even after a failure, so none is left queued
        nlohmann::json report = nlohmann::json::parse(hear_from(r));
        if (report.contains("error") && out.error.empty())
          out.error = "rank " + std::to_string(r) +
                      " could not write its shard: " + report["error"].get<std::string>();
        shards.push_back(std::move(report));
      }
      if (out.error.empty()) {
        if (job.before_commit) job.before_commit();
        const CheckpointDir pending(job.tmp_dir);
        for (const auto& [name, text] : job.files) write_file_durably(pending.file(name), text);
        write_file_durably(pending.index(), sharded_index(tensors, shards, job.extra));
        sync_path(job.tmp_dir);
        replace_directory(job.tmp_dir, job.final_dir);
        sync_path(fs::path(job.final_dir).parent_path().string());
        if (job.after_commit) job.after_commit();
      }
    }
  } catch (const StorageError& e) {
    if (out.error.empty()) out = {e.what(), true, 0};
  } catch (const std::exception& e) {
    if (out.error.empty()) out = {e.what(), false, 0};
  }
  if (rank == 0 && !out.error.empty()) {
    std::error_code ec;
    fs::remove_all(job.tmp_dir, ec);
    LOCKSTEP_LOG(error, train) << "checkpoint " << job.final_dir << " was not saved: " << out.error;
  }
  out.seconds = seconds_since(begin);
  return out;
}

// A report: its length, then its bytes in 4-byte words.
void CheckpointWriter::tell_rank0(const std::string& message) {
  std::int64_t length = std::int64_t(message.size());
  std::vector<std::int32_t> words((message.size() + 3) / 4, 0);
  std::memcpy(words.data(), message.data(), message.size());
  auto a = comm_->send(&length, 1, comm::DType::i64, 0, kTag);
  auto b = comm_->send(words.data(), words.size(), comm::DType::i32, 0, kTag);
  a->wait();
  b->wait();
}

std::string CheckpointWriter::hear_from(int rank) {
  std::int64_t length = 0;
  comm_->recv(&length, 1, comm::DType::i64, rank, kTag)->wait();
  std::vector<std::int32_t> words((std::size_t(length) + 3) / 4, 0);
  comm_->recv(words.data(), words.size(), comm::DType::i32, rank, kTag)->wait();
  return std::string(reinterpret_cast<const char*>(words.data()), std::size_t(length));
}

}  // namespace lockstep::train
