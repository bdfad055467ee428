// Reading a Megatron .idx: see megatron_index.h. The checks run in file order (header, counts,
// sizes and pointers, the document index), each before anything relies on the field it checks.
#include "megatron_index.h"

#include <cstdio>

#include "lockstep/error.h"

namespace lockstep::data {
namespace {

constexpr std::uint8_t kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
constexpr std::size_t kVersionAt = 9, kDtypeAt = 17, kSequencesAt = 18, kBoundariesAt = 26;
constexpr const char* kRebuild =
    "rebuild the dataset with Megatron's tools/preprocess_data.py, or copy both files again";

[[noreturn]] void refuse(const std::string& path, std::uint64_t offset, const std::string& what,
                         const std::string& what_to_do = kRebuild) {
  throw DataError(path + ", byte offset " + std::to_string(offset) + ": " + what + "; " + what_to_do);
}

std::int64_t load_i64(const std::uint8_t* p) {
  return static_cast<std::int64_t>(load_le(p, 8));
}

std::string hex(const std::uint8_t* p, std::size_t n) {
  std::string text;
  char byte[4];
  for (std::size_t k = 0; k < n; ++k) {
    std::snprintf(byte, sizeof byte, k ? " %02x" : "%02x", p[k]);
    text += byte;
  }
  return text;
}

// Megatron's dtype codes; only the integer ones hold tokens.
TokenType type_of_code(std::uint8_t code, const std::string& path) {
  switch (code) {
    case 1: return TokenType::u8;
    case 4: return TokenType::i32;
    case 5: return TokenType::i64;
    case 8: return TokenType::u16;
    default: break;
  }
  const char* names[] = {"unknown", "uint8",   "int8",    "int16", "int32",
                         "int64",   "float64", "float32", "uint16"};
  refuse(path, kDtypeAt,
         "dtype code " + std::to_string(code) + " (" + names[code < 9 ? code : 0] +
             ") is not a token type this reader takes: 1 (uint8), 4 (int32), 5 (int64) or 8 (uint16)",
         "tokenize into one of those integer types");
}

struct Header {
  TokenType type;
  std::uint64_t sequences;   // S
  std::uint64_t boundaries;  // D
};

// The magic, version and dtype, and counts that fit the file: S and D are compared with the bytes
// that follow them by division, so no count, however large, is multiplied before it is checked.
Header read_header(const std::uint8_t* bytes, std::size_t size, const std::string& path) {
  constexpr std::size_t kHeader = MegatronIndex::kHeaderBytes;
  if (size < kHeader)
    refuse(path, size, "the file ends inside the 34-byte header of a Megatron index (it is truncated)");
  for (std::size_t k = 0; k < sizeof kMagic; ++k)
    if (bytes[k] != kMagic[k])
      refuse(
          path, 0,
          "the magic is " + hex(bytes, sizeof kMagic) +
              ", not 4d 4d 49 44 49 44 58 00 00 (\"MMIDIDX\\0\\0\"): not a Megatron indexed dataset's .idx",
          "pass the prefix P of a dataset written by Megatron's preprocess_data.py (P.idx and P.bin)");
  const std::uint64_t version = load_le(bytes + kVersionAt, 8);
  if (version != 1)
    refuse(path, kVersionAt, "index version " + std::to_string(version) + ", only version 1 is read");
  const Header h{type_of_code(bytes[kDtypeAt], path), load_le(bytes + kSequencesAt, 8),
                 load_le(bytes + kBoundariesAt, 8)};
  const std::uint64_t after_header = size - kHeader;
  if (h.sequences > after_header / 12)
    refuse(path, kSequencesAt,
           "the sequence count " + std::to_string(h.sequences) +
               " needs 12 bytes each (a size and a pointer) but " + std::to_string(after_header) +
               " bytes follow the header (the index is truncated or corrupt)");
  const std::uint64_t after_pointers = after_header - 12 * h.sequences;
  if (h.boundaries > after_pointers / 8)
    refuse(path, kBoundariesAt,
           "the document count " + std::to_string(h.boundaries) + " needs 8 bytes each but " +
               std::to_string(after_pointers) +
               " bytes follow the sizes and pointers (the index is truncated or corrupt)");
  if (after_pointers != 8 * h.boundaries)
    refuse(path, size - (after_pointers - 8 * h.boundaries),
           std::to_string(after_pointers - 8 * h.boundaries) +
               " bytes follow the document index, where the file should end (an index with a multimodal "
               "dataset's sequence modes is not read)");
  return h;
}

// Each size non-negative, each pointer the running sum of the sizes before it times the token
// width, and inside the .bin; returns the tokens in all. The running sum stays at most bin_bytes
// plus one size (< 2^34), so it cannot overflow.
std::uint64_t check_sequences(const std::uint8_t* bytes, const Header& h, const std::string& path,
                              const std::string& bin_path, std::uint64_t bin_bytes) {
  const std::uint64_t width = token_bytes(h.type);
  const std::uint64_t sizes_at = MegatronIndex::kHeaderBytes, pointers_at = sizes_at + 4 * h.sequences;
  std::uint64_t running = 0;
  std::int64_t previous = 0;
  for (std::uint64_t s = 0; s < h.sequences; ++s) {
    const auto size = static_cast<std::int32_t>(load_le(bytes + sizes_at + 4 * s, 4));
    const std::int64_t pointer = load_i64(bytes + pointers_at + 8 * s);
    const std::string which = "sequence " + std::to_string(s);
    if (size < 0)
      refuse(path, sizes_at + 4 * s, which + " has a negative size, " + std::to_string(size) + " tokens");
    if (pointer < 0 || static_cast<std::uint64_t>(pointer) > bin_bytes)
      refuse(path, pointers_at + 8 * s,
             which + "'s pointer " + std::to_string(pointer) + " is outside " + bin_path + " (" +
                 std::to_string(bin_bytes) + " bytes)",
             "the .bin is truncated or belongs to another index: copy or rebuild both files");
    if (pointer < previous)
      refuse(path, pointers_at + 8 * s,
             which + "'s pointer " + std::to_string(pointer) + " is before the previous sequence's, " +
                 std::to_string(previous) + ": the pointers are out of order");
    if (static_cast<std::uint64_t>(pointer) != running)
      refuse(path, pointers_at + 8 * s,
             which + "'s pointer is " + std::to_string(pointer) + ", not " + std::to_string(running) +
                 ", the sizes before it times the token width " + std::to_string(width));
    previous = pointer;
    running += static_cast<std::uint64_t>(size) * width;
  }
  return running / width;
}

// The .bin exactly as long as the sequences: shorter is a truncated copy, longer another build's.
void check_bin_length(std::uint64_t tokens, TokenType type, const std::string& path,
                      const std::string& bin_path, std::uint64_t bin_bytes) {
  const std::uint64_t want = tokens * token_bytes(type);
  const std::string described = path + " describes " + std::to_string(tokens) + " " + token_type_name(type) +
                                " tokens, " + std::to_string(want) + " bytes";
  if (bin_bytes < want)
    refuse(bin_path, bin_bytes, "the file ends here but " + described + " (the .bin is truncated)",
           "copy it again or rebuild the dataset");
  if (bin_bytes > want)
    refuse(bin_path, want,
           std::to_string(bin_bytes - want) + " bytes follow the last sequence: " + described +
               " (the .bin and .idx come from different builds)");
}

// doc_idx: starts at sequence 0, never decreases, stays within the S sequences and ends at S.
void check_documents(const std::uint8_t* bytes, const Header& h, const std::string& path) {
  const std::uint64_t at = MegatronIndex::kHeaderBytes + 12 * h.sequences;
  const std::string count = std::to_string(h.sequences);
  if (h.boundaries == 0)
    refuse(path, kBoundariesAt, "the document count is 0 (an index holds at least boundary 0)");
  std::int64_t previous = 0;
  for (std::uint64_t d = 0; d < h.boundaries; ++d) {
    const std::int64_t start = load_i64(bytes + at + 8 * d);
    const std::string which =
        "document boundary " + std::to_string(d) + " is sequence " + std::to_string(start);
    if (d == 0 && start != 0) refuse(path, at, which + ", not 0");
    if (start < previous)
      refuse(path, at + 8 * d, which + ", before the previous boundary, " + std::to_string(previous));
    if (static_cast<std::uint64_t>(start) > h.sequences)
      refuse(path, at + 8 * d, which + ", past the " + count + " sequences");
    previous = start;
  }
  if (static_cast<std::uint64_t>(previous) != h.sequences)
    refuse(path, at + 8 * (h.boundaries - 1),
           "the last document boundary is sequence " + std::to_string(previous) +
               ", not the sequence count " + count + " (the sequences after it would belong to no document)");
}

}  // namespace

MegatronIndex read_megatron_index(const std::uint8_t* bytes, std::size_t size, const std::string& idx_path,
                                  const std::string& bin_path, std::uint64_t bin_bytes) {
  const Header h = read_header(bytes, size, idx_path);
  MegatronIndex index;
  index.bytes_ = bytes;
  index.type_ = h.type;
  index.sequences_ = h.sequences;
  index.boundaries_ = h.boundaries;
  index.tokens_ = check_sequences(bytes, h, idx_path, bin_path, bin_bytes);
  check_bin_length(index.tokens_, h.type, idx_path, bin_path, bin_bytes);
  check_documents(bytes, h, idx_path);
  return index;
}

std::uint64_t MegatronIndex::sequence_start(std::uint64_t s) const {
  if (s == sequences_) return tokens_;
  const std::uint64_t pointer = load_le(bytes_ + kHeaderBytes + 4 * sequences_ + 8 * s, 8);
  return pointer / token_bytes(type_);
}

std::uint64_t MegatronIndex::document_start(std::uint64_t d) const {
  return sequence_start(load_le(bytes_ + kHeaderBytes + 12 * sequences_ + 8 * d, 8));
}

}  // namespace lockstep::data
