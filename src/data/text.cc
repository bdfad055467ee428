#include "lockstep/data/text.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "lockstep/error.h"

namespace lockstep::data {
namespace {

// The category files: regular files, not the strfile indexes (.dat) nor the .u8 links.
std::vector<std::string> category_files(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (!d)
    throw DataError("the fortune corpus is not at " + dir +
                    ": install Debian's packages fortunes and fortunes-min (apt-get install fortunes), or pass the "
                    "directory that holds the fortune files");
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name[0] == '.' || (name.size() > 4 && name.compare(name.size() - 4, 4, ".dat") == 0)) continue;
    if (name.size() > 3 && name.compare(name.size() - 3, 3, ".u8") == 0) continue;
    struct stat st {};
    if (::lstat((dir + "/" + name).c_str(), &st) == 0 && S_ISREG(st.st_mode)) names.push_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  if (names.empty())
    throw DataError(dir + " holds no fortune files: install Debian's packages fortunes and fortunes-min");
  return names;
}

void read_entries(const std::string& path, const std::string& category, std::vector<TextEntry>& out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError("cannot read the fortune file " + path);
  std::string entry;
  for (std::string line; std::getline(in, line);) {
    if (line == "%") {
      if (!entry.empty()) out.push_back({category, entry});
      entry.clear();
      continue;
    }
    if (!entry.empty()) entry += '\n';
    entry += line;
  }
  if (!entry.empty()) out.push_back({category, entry});
}

}  // namespace

std::uint64_t FortuneCorpus::fnv1a(const std::string& bytes) {
  std::uint64_t h = 14695981039346656037ull;
  for (unsigned char c : bytes) h = (h ^ c) * 1099511628211ull;
  return h;
}

bool FortuneCorpus::in_validation(const std::string& text) {
  return fnv1a(text) % 20 == 0;
}

FortuneCorpus::FortuneCorpus(const std::string& dir) {
  categories_ = category_files(dir);
  for (const auto& name : categories_) read_entries(dir + "/" + name, name, entries_);
}

std::size_t FortuneCorpus::count(const std::string& category) const {
  return static_cast<std::size_t>(
      std::count_if(entries_.begin(), entries_.end(), [&](const TextEntry& e) { return e.category == category; }));
}

TokenBlocks::TokenBlocks(const FortuneCorpus& corpus, TextSplit split, int block_size) : block_size_(block_size) {
  if (block_size < 1) throw ConfigError("a block must hold at least 1 token (got " + std::to_string(block_size) + ")");
  for (const auto& e : corpus.entries())
    if (FortuneCorpus::in_validation(e.text) == (split == TextSplit::validation)) stream_ += e.text + "\n%\n";
  const auto t = static_cast<std::size_t>(block_size);
  blocks_ = stream_.size() > t ? (stream_.size() - 1) / t : 0;
  if (blocks_ == 0)
    throw DataError("the fortune corpus's " + std::string(split == TextSplit::train ? "training" : "validation") +
                    " split holds " + std::to_string(stream_.size()) + " bytes: too few for one block of " +
                    std::to_string(block_size) + " tokens");
}

const std::uint8_t* TokenBlocks::block(std::size_t i) const {
  return reinterpret_cast<const std::uint8_t*>(stream_.data()) + i * static_cast<std::size_t>(block_size_);
}

EntryLabels::EntryLabels(const FortuneCorpus& corpus, TextSplit split, std::size_t min_entries) {
  for (const auto& c : corpus.categories())
    if (corpus.count(c) >= min_entries) classes_.push_back(c);
  if (classes_.size() < 2)
    throw ConfigError("only " + std::to_string(classes_.size()) + " fortune categories have at least " +
                      std::to_string(min_entries) + " entries: lower the minimum to get two classes or more");
  for (const auto& e : corpus.entries()) {
    if (FortuneCorpus::in_validation(e.text) != (split == TextSplit::validation)) continue;
    const auto it = std::find(classes_.begin(), classes_.end(), e.category);
    if (it == classes_.end()) continue;
    texts_.push_back(e.text);
    labels_.push_back(static_cast<int>(it - classes_.begin()));
  }
}

}  // namespace lockstep::data
