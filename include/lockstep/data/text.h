// Text for language models: Debian's fortune files (packages fortunes and fortunes-min, about
// 2.6 MB of English in ~40 category files under /usr/share/games/fortunes; a line holding only
// "%" ends each entry), read as bytes, with no downloads and no tokenizer to train.
//
//   FortuneCorpus corpus;                           // reads every category file
//   TokenBlocks train(corpus, Split::train, 128);   // the training entries, as blocks of 129 bytes
//   EntryLabels labels(corpus, Split::validation, /*min_entries=*/500);  // entry -> category
//
// Vocabulary: the 256 byte values (a byte-level model; 0 never occurs in the text and pads).
// Split: by entry, not by character, and by content: an entry is in the validation split when
// the FNV-1a hash of its bytes is 0 modulo 20 (about 5 %), so every reader (this one, the
// PyTorch peer in bench/) agrees and a duplicated entry never leaks across the split.
// Language-model stream: the split's entries in order (category files by name, entries in file
// order), each followed by "\n%\n" as in the files; block i is tokens [i*T, i*T + T] (T + 1
// tokens: T inputs, T next-token targets), blocks do not overlap, the remainder is dropped.
//
// Read-only after construction: any number of loader threads may read it at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace lockstep::data {

inline constexpr const char* kFortunesDir = "/usr/share/games/fortunes";
inline constexpr int kByteVocabulary = 256;
inline constexpr std::uint8_t kPadByte = 0;

enum class TextSplit { train, validation };

struct TextEntry {
  std::string category;  // the file it came from, e.g. "computers"
  std::string text;      // without the closing "%" line
};

class FortuneCorpus {
 public:
  // Every regular category file in `dir` (not the .dat indexes, not the .u8 links). A missing
  // directory is a DataError naming the packages to install.
  explicit FortuneCorpus(const std::string& dir = kFortunesDir);

  const std::vector<TextEntry>& entries() const { return entries_; }
  // Categories in file-name order.
  const std::vector<std::string>& categories() const { return categories_; }
  std::size_t count(const std::string& category) const;

  static bool in_validation(const std::string& text);  // the split rule above
  static std::uint64_t fnv1a(const std::string& bytes);

 private:
  std::vector<TextEntry> entries_;
  std::vector<std::string> categories_;
};

// The language-model blocks of one split.
class TokenBlocks {
 public:
  TokenBlocks(const FortuneCorpus& corpus, TextSplit split, int block_size);
  std::size_t size() const { return blocks_; }
  int block_size() const { return block_size_; }
  // Block i's T + 1 tokens.
  const std::uint8_t* block(std::size_t i) const;
  std::size_t tokens() const { return stream_.size(); }

 private:
  std::string stream_;
  int block_size_;
  std::size_t blocks_;
};

// Entries of the categories with at least `min_entries` entries in the whole corpus, each with
// its category's index among those (in file-name order): a text-classification task.
class EntryLabels {
 public:
  EntryLabels(const FortuneCorpus& corpus, TextSplit split, std::size_t min_entries);
  std::size_t size() const { return texts_.size(); }
  const std::string& text(std::size_t i) const { return texts_[i]; }
  int label(std::size_t i) const { return labels_[i]; }
  const std::vector<std::string>& classes() const { return classes_; }

 private:
  std::vector<std::string> texts_;
  std::vector<int> labels_;
  std::vector<std::string> classes_;
};

}  // namespace lockstep::data
