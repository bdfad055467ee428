// A Megatron indexed dataset's .idx file (the layout is in lockstep/data/token_files.h), checked
// field by field against its own length and its .bin's, then read in place from the mapped bytes.
//
// read_megatron_index trusts nothing it has not checked: every count against the bytes left,
// every size and pointer against the .bin, sums that cannot overflow. A problem is a DataError
// naming the file, the byte offset of the field, and what to do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "lockstep/data/token_files.h"

namespace lockstep::data {

// The little-endian unsigned integer of `bytes` bytes (1 to 8) at p.
inline std::uint64_t load_le(const std::uint8_t* p, std::size_t bytes) {
  std::uint64_t v = 0;
  for (std::size_t k = bytes; k-- > 0;) v = (v << 8) | p[k];
  return v;
}

class MegatronIndex {
 public:
  static constexpr std::size_t kHeaderBytes = 34;  // magic 9, version 8, dtype 1, S 8, D 8

  TokenType type() const { return type_; }
  std::uint64_t tokens() const { return tokens_; }  // the sizes' sum
  std::uint64_t documents() const { return boundaries_ - 1; }
  // Where document d starts in the token stream; d == documents() gives the end.
  std::uint64_t document_start(std::uint64_t d) const;

 private:
  friend MegatronIndex read_megatron_index(const std::uint8_t*, std::size_t, const std::string&,
                                           const std::string&, std::uint64_t);
  std::uint64_t sequence_start(std::uint64_t s) const;  // in tokens; s == S gives the end

  const std::uint8_t* bytes_ = nullptr;  // the mapped .idx, owned by the caller
  TokenType type_ = TokenType::u8;
  std::uint64_t sequences_ = 0;   // S
  std::uint64_t boundaries_ = 0;  // D
  std::uint64_t tokens_ = 0;
};

// The index in `bytes` (the .idx at idx_path, `size` bytes long), whose tokens are in bin_path,
// bin_bytes long. The returned index reads `bytes`, which must outlive it.
MegatronIndex read_megatron_index(const std::uint8_t* bytes, std::size_t size, const std::string& idx_path,
                                  const std::string& bin_path, std::uint64_t bin_bytes);

}  // namespace lockstep::data
