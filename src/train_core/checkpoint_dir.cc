// What a checkpoint directory holds and where each piece lives (see checkpoint_dir.h).
#include "lockstep/train_core/checkpoint_dir.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "lockstep/train_core/durable_file.h"

namespace fs = std::filesystem;

namespace lockstep::train {

std::optional<CheckpointDir> CheckpointDir::sharded_in_place_of(const std::string& model_path) {
  if (fs::exists(model_path) || fs::path(model_path).filename() != kModel) return std::nullopt;
  CheckpointDir dir(fs::path(model_path).parent_path().string());
  if (!dir.sharded()) return std::nullopt;
  return dir;
}

std::string CheckpointDir::name() const {
  const fs::path p(path_);
  return p.has_filename() ? p.filename().string() : p.parent_path().filename().string();
}

std::string CheckpointDir::file(const std::string& name) const { return (fs::path(path_) / name).string(); }

bool CheckpointDir::complete() const { return fs::exists(trainer_state()); }

bool CheckpointDir::sharded() const { return fs::exists(index()); }

std::string CheckpointDir::machine_optimizer_name(int machine) {
  return "optimizer-machine-" + std::to_string(machine) + ".pt";
}

std::string CheckpointDir::shard_name(int rank, int world) {
  char name[64];
  std::snprintf(name, sizeof name, "shard-%05d-of-%05d.bin", rank, world);
  return name;
}

std::int64_t checkpoint_step(const std::string& path) {
  const std::string name = CheckpointDir(path).name();
  const std::string prefix = "checkpoint-";
  if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size()) return -1;
  std::int64_t step = 0;
  for (std::size_t i = prefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

std::vector<std::string> list_checkpoints(const std::string& output_dir) {
  std::vector<std::pair<std::int64_t, std::string>> found;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(output_dir, ec)) {
    const std::int64_t step = checkpoint_step(entry.path().string());
    if (step >= 0 && entry.is_directory() && CheckpointDir(entry.path().string()).complete())
      found.emplace_back(step, entry.path().string());
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(f.second);
  return out;
}

std::string latest_checkpoint(const std::string& output_dir) {
  auto all = list_checkpoints(output_dir);
  return all.empty() ? "" : all.back();
}

std::vector<std::string> rotate_checkpoints(const std::string& output_dir, int limit,
                                            const std::vector<std::string>& keep) {
  std::vector<std::string> deleted;
  if (limit <= 0) return deleted;
  auto all = list_checkpoints(output_dir);
  auto kept = [&](const std::string& p) {
    for (const auto& k : keep)
      if (!k.empty() && fs::path(k).filename() == fs::path(p).filename()) return true;
    return false;
  };
  std::size_t remaining = all.size();
  for (const auto& p : all) {
    if (remaining <= static_cast<std::size_t>(limit)) break;
    if (kept(p)) continue;
    fs::remove_all(p);
    deleted.push_back(p);
    --remaining;
  }
  if (!deleted.empty()) sync_path(output_dir);
  return deleted;
}

}  // namespace lockstep::train
