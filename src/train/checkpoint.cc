#include "lockstep/ddp/comm_dtype.h"
#include "lockstep/train/checkpoint.h"

#include <fcntl.h>
#include <torch/optim/serialize.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "lockstep/base/main.h"
#include "lockstep/ddp/cpu_rng.h"
#include "lockstep/error.h"
#include "lockstep/train/sharded_checkpoint.h"
#include "lockstep/train_core/durable_file.h"

namespace fs = std::filesystem;

namespace lockstep::train {
namespace {

// "float32[3, 4]".
std::string describe(const torch::Tensor& t) {
  std::ostringstream os;
  os << dtype_name(t.scalar_type()) << t.sizes();
  return os.str();
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
      fail(std::string(kind) + " '" + prefix + name + "' is " + describe(mine) +
           " in the model but " + describe(theirs) + " in the checkpoint");
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

std::string to_hex(const torch::Tensor& bytes) {
  static const char* digits = "0123456789abcdef";
  auto t = bytes.contiguous();
  const auto* p = t.data_ptr<std::uint8_t>();
  std::string out;
  out.reserve(static_cast<std::size_t>(t.numel()) * 2);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    out.push_back(digits[p[i] >> 4]);
    out.push_back(digits[p[i] & 15]);
  }
  return out;
}

torch::Tensor from_hex(const std::string& hex) {
  auto t = torch::empty({static_cast<std::int64_t>(hex.size() / 2)}, torch::kUInt8);
  auto* p = t.data_ptr<std::uint8_t>();
  auto nibble = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    throw ConfigError("trainer_state.json holds a corrupt RNG state");
  };
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2)
    p[i / 2] = static_cast<std::uint8_t>(nibble(hex[i]) * 16 + nibble(hex[i + 1]));
  return t;
}

}  // namespace

// The bytes of a torch archive; a libtorch failure becomes an Error naming what was being saved.
template <class Save>
std::string archive_bytes(const char* what, Save&& save) {
  try {
    torch::serialize::OutputArchive archive;
    save(archive);
    std::ostringstream out;
    archive.save_to(out);
    return out.str();
  } catch (const c10::Error& e) {
    throw Error(std::string("cannot serialise the ") + what + ": " + e.what_without_backtrace());
  }
}

std::string optimizer_bytes(torch::optim::Optimizer& optimizer) {
  return archive_bytes("optimizer state", [&](auto& a) { optimizer.save(a); });
}


void save_module(const torch::nn::Module& module, const std::string& path) {
  write_file_durably(path, archive_bytes("model", [&](auto& a) { module.save(a); }));
}

// Where an optimizer's parameters, and so its state, live.
static torch::Device state_device(const torch::optim::Optimizer& optimizer) {
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params()) return p.device();
  return torch::kCPU;
}

void load_optimizer(torch::optim::Optimizer& optimizer, const std::string& path) {
  if (!fs::exists(path)) throw DataError("no optimizer state at " + path + ": the checkpoint is incomplete");
  try {
    torch::serialize::InputArchive archive;
    archive.load_from(path, state_device(optimizer));  // saved on either device, loaded to the parameters'
    optimizer.load(archive);
  } catch (const c10::Error& e) {
    throw DataError("cannot load the optimizer state " + path + " (" +
                    first_line(e.what_without_backtrace()).substr(0, 200) +
                    "): the file is damaged, or was written for another model or optimizer");
  }
}

// A sharded checkpoint has no model.pt: `path` naming one in such a directory reads the shards.
void load_module(torch::nn::Module& module, const std::string& path) {
  if (const auto sharded = CheckpointDir::sharded_in_place_of(path)) {
    load_sharded(sharded->path(), module, nullptr);
    return;
  }
  if (!fs::exists(path))
    throw ConfigError("no model file at " + path + ": pass a checkpoint directory lockstep wrote");
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(path, torch::Device(torch::kCPU));  // saved on either device; copied to the module's below
  } catch (const c10::Error& e) {
    throw ConfigError("cannot read " + path + " as a torch archive (" +
                      std::string(e.what_without_backtrace()).substr(0, 200) + ")");
  }
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;
  check(module, archive, "", path, copies);
  torch::NoGradGuard no_grad;
  for (auto& [mine, theirs] : copies) mine.copy_(theirs);
}

namespace {

// Every tensor of an archive by its dotted name (sub-archives are submodules).
void flatten(torch::serialize::InputArchive& archive, const std::string& prefix,
             std::map<std::string, torch::Tensor>& out) {
  for (const std::string& key : archive.keys()) {
    torch::Tensor t;
    if (archive.try_read(key, t, /*is_buffer=*/false) || archive.try_read(key, t, /*is_buffer=*/true)) {
      out[prefix + key] = t;
      continue;
    }
    torch::serialize::InputArchive child;
    if (archive.try_read(key, child)) flatten(child, prefix + key + ".", out);
  }
}

}  // namespace

LoadReport load_matching(torch::nn::Module& module, const std::string& path) {
  std::map<std::string, torch::Tensor> file;
  if (const auto sharded = CheckpointDir::sharded_in_place_of(path)) {
    for (auto& [saved, value] : read_sharded_values(sharded->path())) file[saved.name] = value;
  } else {
    if (!fs::exists(path))
      throw ConfigError("no model file at " + path + ": pass a checkpoint directory lockstep wrote");
    torch::serialize::InputArchive archive;
    try {
      archive.load_from(path);
    } catch (const c10::Error& e) {
      throw DataError("cannot read " + path + " as a torch archive (" +
                      std::string(e.what_without_backtrace()).substr(0, 200) + ")");
    }
    flatten(archive, "", file);
  }
  LoadReport report;
  torch::NoGradGuard no_grad;
  auto take = [&](const std::string& name, torch::Tensor& mine) {
    auto it = file.find(name);
    if (it == file.end()) {
      report.missing.push_back(name);
      return;
    }
    if (it->second.sizes() != mine.sizes() || it->second.scalar_type() != mine.scalar_type())
      throw ConfigError("checkpoint " + path + " does not fit this model: '" + name + "' is " +
                        describe(mine) + " in the model but " + describe(it->second) +
                        " in the checkpoint (was it saved from a model of another size?)");
    mine.copy_(it->second);
    report.loaded.push_back(name);
    file.erase(it);
  };
  for (auto& p : module.named_parameters()) take(p.key(), p.value());
  for (auto& b : module.named_buffers()) take(b.key(), b.value());
  for (const auto& [name, tensor] : file) report.unexpected.push_back(name);
  return report;
}

std::string rng_state_hex() {
  return to_hex(cpu_rng_state());
}

void set_rng_state_hex(const std::string& hex) {
  set_cpu_rng_state(from_hex(hex));
}

namespace {

// The temporary directory of a save: removed unless the save renamed it into place.
class PendingDir {
 public:
  explicit PendingDir(fs::path path) : path_(std::move(path)) {
    std::error_code ec;
    fs::remove_all(path_, ec);
    fs::create_directories(path_, ec);
    if (ec) throw_write_error(path_.string(), ec.value());
  }
  ~PendingDir() {
    if (path_.empty()) return;
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  PendingDir(const PendingDir&) = delete;
  PendingDir& operator=(const PendingDir&) = delete;
  const fs::path& path() const { return path_; }
  void release() { path_.clear(); }

 private:
  fs::path path_;
};

}  // namespace

void write_checkpoint(const std::string& dir, const torch::nn::Module& module,
                      torch::optim::Optimizer& optimizer, const nlohmann::json& scheduler,
                      const nlohmann::json& args, const nlohmann::json& trainer_state,
                      const std::function<void()>& after_model, const std::vector<CheckpointFile>& extra) {
  const fs::path final_dir = dir;
  const fs::path parent = final_dir.parent_path();
  PendingDir tmp(parent / (".tmp-" + final_dir.filename().string() + "-" + std::to_string(::getpid())));
  const CheckpointDir pending(tmp.path().string());
  save_module(module, pending.model());
  if (after_model) after_model();
  write_file_durably(pending.optimizer(), archive_bytes("optimizer state", [&](auto& a) { optimizer.save(a); }));
  for (const auto& f : extra) write_file_durably(pending.file(f.name), f.bytes);
  write_file_durably(pending.scheduler(), scheduler.dump(2));
  write_file_durably(pending.training_args(), args.dump(2));
  write_file_durably(pending.trainer_state(), trainer_state.dump(1));  // last: marks it complete
  sync_path(tmp.path().string());
  replace_directory(tmp.path().string(), final_dir.string());  // an older one saved at this step too
  tmp.release();
  sync_path(parent.string());
}

}  // namespace lockstep::train
