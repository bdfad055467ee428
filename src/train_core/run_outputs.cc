#include "lockstep/train_core/run_outputs.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "lockstep/error.h"

namespace fs = std::filesystem;

namespace lockstep::train {

RunOutputs::RunOutputs(const std::string& output_dir, int rank, bool trace)
    : metrics_path_((fs::path(output_dir) / "metrics.jsonl").string()) {
  std::error_code ec;
  fs::create_directories(output_dir, ec);
  if (ec) throw ConfigError("cannot create --output-dir " + output_dir + ": " + ec.message());
  if (rank == 0) {
    set_rank(0);
    // A save killed midway leaves a .tmp- directory behind: nothing else refers to it.
    for (const auto& entry : fs::directory_iterator(output_dir, ec))
      if (entry.path().filename().string().rfind(".tmp-checkpoint-", 0) == 0)
        fs::remove_all(entry.path(), ec);
  }
  if (trace) {
    fs::create_directories(fs::path(output_dir) / "trace", ec);
    trace_ = std::make_unique<TraceWriter>(
        (fs::path(output_dir) / "trace" / ("rank_" + std::to_string(rank) + ".json")).string(), rank);
  }
}

RunOutputs::~RunOutputs() {
  if (metrics_fd_ >= 0) ::close(metrics_fd_);
}

void RunOutputs::set_rank(int rank) {
  if (rank != 0) {
    if (metrics_fd_ >= 0) ::close(metrics_fd_);
    metrics_fd_ = -1;
    return;
  }
  if (metrics_fd_ >= 0) return;
  metrics_fd_ = ::open(metrics_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (metrics_fd_ < 0)
    throw ConfigError("cannot write " + metrics_path_ + ": " + std::strerror(errno) + "; check --output-dir");
}

void RunOutputs::record(const nlohmann::json& line) {
  if (metrics_fd_ < 0) return;
  const std::string text = line.dump() + "\n";
  // One write per line (O_APPEND): a reader sees whole lines, a kill leaves at most one cut short.
  ssize_t n = ::write(metrics_fd_, text.data(), text.size());
  if (n < 0) throw_write_error(metrics_path_, errno);
  if (static_cast<std::size_t>(n) != text.size()) throw_write_error(metrics_path_, ENOSPC);
}

}  // namespace lockstep::train
