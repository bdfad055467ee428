#include "lockstep/train/checkpoint.h"

#include <fcntl.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "lockstep/error.h"

namespace fs = std::filesystem;

namespace lockstep::train {
namespace {

std::string describe(const torch::Tensor& t) {
  std::ostringstream os;
  os << c10::toString(t.scalar_type()) << t.sizes();
  return os.str();
}

std::string lower_dtype(std::string s) {
  // c10 prints "Float"; say "float32" like the DDP signature check does.
  static const std::pair<const char*, const char*> names[] = {
      {"Float", "float32"}, {"Double", "float64"}, {"Half", "float16"}, {"BFloat16", "bfloat16"},
      {"Long", "int64"},    {"Int", "int32"},      {"Bool", "bool"},    {"Byte", "uint8"}};
  for (const auto& [from, to] : names)
    if (s.rfind(from, 0) == 0 && s.size() > std::strlen(from) && s[std::strlen(from)] == '[')
      return to + s.substr(std::strlen(from));
  return s;
}

// Checks the archive against the module (recursively) and collects what to copy.
void check(const torch::nn::Module& module, torch::serialize::InputArchive& archive,
           const std::string& prefix, const std::string& file,
           std::vector<std::pair<torch::Tensor, torch::Tensor>>& copies) {
  auto fail = [&](const std::string& what) {
    throw ConfigError("checkpoint " + file + " does not fit this model: " + what +
                      "; load it into the model it was saved from");
  };
  std::set<std::string> expected;
  auto visit = [&](const std::string& name, const torch::Tensor& mine, bool is_buffer) {
    expected.insert(name);
    const char* kind = is_buffer ? "buffer" : "parameter";
    if (!mine.defined()) return;
    torch::Tensor theirs;
    if (!archive.try_read(name, theirs, is_buffer))
      fail(std::string(kind) + " '" + prefix + name + "' is missing from it");
    if (theirs.sizes() != mine.sizes() || theirs.scalar_type() != mine.scalar_type())
      fail(std::string(kind) + " '" + prefix + name + "' is " + lower_dtype(describe(mine)) +
           " in the model but " + lower_dtype(describe(theirs)) + " in the checkpoint");
    copies.emplace_back(mine, theirs);
  };
  for (const auto& p : module.named_parameters(/*recurse=*/false)) visit(p.key(), p.value(), false);
  for (const auto& b : module.named_buffers(/*recurse=*/false)) visit(b.key(), b.value(), true);
  for (const auto& c : module.named_children()) {
    expected.insert(c.key());
    torch::serialize::InputArchive child;
    if (!archive.try_read(c.key(), child)) fail("submodule '" + prefix + c.key() + "' is missing from it");
    check(*c.value(), child, prefix + c.key() + ".", file, copies);
  }
  for (const std::string& key : archive.keys()) {
    if (!expected.count(key)) fail("it holds '" + prefix + key + "', which the model does not have");
  }
}

}  // namespace

void save_module(const torch::nn::Module& module, const std::string& path) {
  torch::serialize::OutputArchive archive;
  module.save(archive);
  archive.save_to(path);
}

void load_module(torch::nn::Module& module, const std::string& path) {
  if (!fs::exists(path))
    throw ConfigError("no model file at " + path + ": pass a checkpoint directory lockstep wrote");
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(path);
  } catch (const c10::Error& e) {
    throw ConfigError("cannot read " + path + " as a torch archive (" +
                      std::string(e.what_without_backtrace()).substr(0, 200) + ")");
  }
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;
  check(module, archive, "", path, copies);
  torch::NoGradGuard no_grad;
  for (auto& [mine, theirs] : copies) mine.copy_(theirs);
}

std::int64_t checkpoint_step(const std::string& path) {
  std::string name = fs::path(path).filename().string();
  if (name.empty()) name = fs::path(path).parent_path().filename().string();
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
    std::int64_t step = checkpoint_step(entry.path().string());
    // trainer_state.json is written last; a directory without it is not a checkpoint.
    if (step >= 0 && entry.is_directory() && fs::exists(entry.path() / "trainer_state.json"))
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

void sync_path(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error("cannot open " + path + " to flush it: " + std::strerror(errno));
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0) throw Error("fsync of " + path + " failed: " + std::strerror(err));
}

void write_file_durably(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) throw Error("cannot write " + tmp + ": " + std::strerror(errno));
  }
  sync_path(tmp);
  fs::rename(tmp, path);
}

}  // namespace lockstep::train
