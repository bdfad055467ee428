// lockstep-checkpoint: the torch-linked half of `lockstep checkpoint` (which execs it), kept out of
// the torch-free lockstep binary.
//
//   lockstep checkpoint consolidate DIR [-o FILE]   a sharded checkpoint's parameters and buffers as
//                                                   one model.pt (torch::load reads it)
//   lockstep checkpoint info DIR                    what a sharded checkpoint holds
#include <torch/serialize.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <sstream>

#include "lockstep/base/main.h"
#include "lockstep/error.h"
#include "lockstep/train/sharded_checkpoint.h"
#include "lockstep/train_core/durable_file.h"

namespace fs = std::filesystem;

namespace lockstep {
namespace {

// Dotted names as nested archives, the layout torch::save(module) writes and torch::load reads.
struct Node {
  std::map<std::string, std::pair<torch::Tensor, bool>> tensors;  // name -> (value, is a buffer)
  std::map<std::string, std::unique_ptr<Node>> children;
  void add(const std::string& dotted, const torch::Tensor& value, bool buffer) {
    const auto dot = dotted.find('.');
    if (dot == std::string::npos) {
      tensors[dotted] = {value, buffer};
      return;
    }
    auto& child = children[dotted.substr(0, dot)];
    if (!child) child = std::make_unique<Node>();
    child->add(dotted.substr(dot + 1), value, buffer);
  }
  void write(torch::serialize::OutputArchive& archive) const {
    for (const auto& [name, t] : tensors) archive.write(name, t.first, t.second);
    for (const auto& [name, child] : children) {
      torch::serialize::OutputArchive sub;
      child->write(sub);
      archive.write(name, sub);
    }
  }
};

int consolidate(const std::string& dir, std::string output) {
  if (!train::CheckpointDir(dir).sharded())
    throw ConfigError(dir +
                      " is not a sharded checkpoint (no index.json): a consolidated checkpoint already has "
                      "its model.pt");
  if (output.empty()) output = train::CheckpointDir(dir).model();
  Node root;
  std::size_t count = 0, bytes = 0;
  for (const auto& [saved, value] : train::read_sharded_values(dir)) {
    root.add(saved.name, value, saved.buffer);
    ++count;
    bytes += std::size_t(value.numel()) * value.element_size();
  }
  torch::serialize::OutputArchive archive;
  root.write(archive);
  std::ostringstream out;
  archive.save_to(out);
  train::write_file_durably(output, out.str());
  std::printf("wrote %s: %zu tensors, %.1f MB (load it with torch::load, or --checkpoint %s)\n",
              output.c_str(), count, double(bytes) / 1e6, dir.c_str());
  return 0;
}

int info(const std::string& dir) {
  train::ShardedCheckpointReader reader(dir);
  const auto& extra = reader.extra();
  std::printf("%s: written by %d ranks, step %lld, ZeRO stage %d, optimizer %s\n", dir.c_str(),
              reader.world(), static_cast<long long>(extra.value("global_step", std::int64_t{0})),
              extra.value("zero_stage", 0),
              extra.value("optimizer", nlohmann::json::object()).dump().c_str());
  for (const auto& t : reader.tensors()) {
    std::string shape;
    for (auto d : t.shape) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
    std::printf("  %-40s %s[%s]%s\n", t.name.c_str(), t.dtype.c_str(), shape.c_str(),
                t.buffer ? " (buffer)" : "");
  }
  return 0;
}

int checkpoint_main(int argc, char** argv) {
  CLI::App app{"lockstep checkpoint: sharded checkpoints"};
  app.require_subcommand(1);
  std::string dir, output;
  auto* c = app.add_subcommand("consolidate",
                               "Write a sharded checkpoint's parameters and buffers as one model.pt");
  c->add_option("dir", dir, "the checkpoint directory")->required();
  c->add_option("-o,--output", output, "the file to write (default: DIR/model.pt)");
  auto* i = app.add_subcommand("info", "What a sharded checkpoint holds");
  i->add_option("dir", dir, "the checkpoint directory")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    throw ConfigError(std::string(e.what()) + "; `lockstep checkpoint --help` lists the commands");
  }
  return c->parsed() ? consolidate(dir, output) : info(dir);
}

}  // namespace
}  // namespace lockstep

int main(int argc, char** argv) {
  return lockstep::run_main(argc, argv, [&] { return lockstep::checkpoint_main(argc, argv); });
}
