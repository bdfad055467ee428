// The layering docs/architecture.md draws, checked on the source tree: the torch-free layers
// include no libtorch header, every include points down (or sideways within a layer), and no
// two modules of comm include each other. A change that breaks one fails here, naming the file
// and the include.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace lockstep::testing {
namespace {

namespace fs = std::filesystem;

// Bottom to top; doctor sits beside train_core (it reads what a Trainer program writes), and
// pipe_core (schedules, the mesh, the partitioner) beside both.
const std::map<std::string, int> kLayerHeight = {
    {"base", 0}, {"comm", 1},   {"launch", 2}, {"data", 3},   {"train_core", 4}, {"pipe_core", 4},
    {"doctor", 4}, {"ddp", 5}, {"pipe", 6},   {"models", 7}, {"train", 8}};
constexpr int kHighestTorchFree = 4;

struct Source {
  std::string path;  // relative to the source tree
  std::string layer;
  std::vector<std::string> includes;  // what #include names, quotes or brackets alike
};

std::vector<std::string> includes_of(const fs::path& file) {
  std::ifstream in(file);
  static const std::regex include(R"(^\s*#\s*include\s*[<"]([^>"]+)[>"])");
  std::vector<std::string> out;
  std::smatch m;
  for (std::string line; std::getline(in, line);)
    if (std::regex_search(line, m, include)) out.push_back(m[1]);
  return out;
}

// Every .h and .cc of every layer, under src/<layer> and include/lockstep/<layer>.
std::vector<Source> sources() {
  const fs::path root = LOCKSTEP_SOURCE_DIR;
  std::vector<Source> out;
  for (const auto& [layer, height] : kLayerHeight)
    for (const fs::path& dir : {root / "src" / layer, root / "include" / "lockstep" / layer}) {
      if (!fs::exists(dir)) continue;
      for (const auto& f : fs::recursive_directory_iterator(dir)) {
        const auto ext = f.path().extension();
        if (ext == ".h" || ext == ".cc")
          out.push_back({fs::relative(f.path(), root).string(), layer, includes_of(f.path())});
      }
    }
  return out;
}

TEST(Layering, TheSourceTreeIsFound) {
  EXPECT_GT(sources().size(), 100u) << "no sources under " << LOCKSTEP_SOURCE_DIR;
}

TEST(Layering, TheTorchFreeLayersIncludeNoLibtorchHeader) {
  for (const auto& s : sources()) {
    if (kLayerHeight.at(s.layer) > kHighestTorchFree) continue;
    for (const auto& inc : s.includes)
      for (const char* torch : {"torch/", "ATen/", "c10/"})
        EXPECT_NE(inc.rfind(torch, 0), 0u) << s.path << " includes " << inc << ": " << s.layer << " is torch-free";
  }
}

TEST(Layering, EveryIncludePointsDown) {
  for (const auto& s : sources())
    for (const auto& inc : s.includes) {
      if (inc.rfind("lockstep/", 0) != 0) continue;
      const std::string layer = inc.substr(9, inc.find('/', 9) - 9);
      const auto it = kLayerHeight.find(layer);
      if (it == kLayerHeight.end()) continue;  // lockstep/error.h and the like, below every layer
      EXPECT_LE(it->second, kLayerHeight.at(s.layer)) << s.path << " includes " << inc << ", a layer above " << s.layer;
    }
}

// A module is a header and its .cc, public (include/lockstep/comm/x.h) or private (src/comm/x.h).
std::string comm_module(const std::string& path) {
  std::string p = fs::path(path).replace_extension().string();
  for (const std::string& prefix : {std::string("include/lockstep/comm/"), std::string("src/comm/")})
    if (p.rfind(prefix, 0) == 0) return p.substr(prefix.size());
  return "";
}

// The module an include of file `from` names, if it is one of comm's.
std::string included_module(const std::string& from, const std::string& inc, const std::set<std::string>& modules) {
  const std::string dir = fs::path(comm_module(from)).parent_path().string();
  for (const std::string& candidate : {inc.rfind("lockstep/comm/", 0) == 0 ? inc.substr(14) : std::string(),
                                       (fs::path(dir) / inc).lexically_normal().string(), inc}) {
    const std::string m = fs::path(candidate).replace_extension().string();
    if (modules.count(m)) return m;
  }
  return "";
}

TEST(Layering, NoTwoModulesOfCommIncludeEachOther) {
  std::vector<Source> comm;
  std::set<std::string> modules;
  for (auto& s : sources())
    if (s.layer == "comm") {
      modules.insert(comm_module(s.path));
      comm.push_back(std::move(s));
    }
  std::map<std::string, std::set<std::string>> uses;
  for (const auto& s : comm)
    for (const auto& inc : s.includes)
      if (auto m = included_module(s.path, inc, modules); !m.empty() && m != comm_module(s.path))
        uses[comm_module(s.path)].insert(m);
  EXPECT_TRUE(uses["communicator"].count("backend")) << "the check no longer sees comm's includes";
  for (const auto& [a, used] : uses)
    for (const auto& b : used)
      if (const auto back = uses.find(b); a < b && back != uses.end()) {
        EXPECT_FALSE(back->second.count(a)) << "comm/" << a << " and comm/" << b << " include each other";
      }
}

}  // namespace
}  // namespace lockstep::testing
