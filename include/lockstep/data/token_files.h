// Tokenized corpora on disk for language-model training, memory-mapped (PROT_READ, MAP_SHARED):
// the tokens stay in the page cache, never read whole into this process's memory. Two formats:
//
//   Flat (nanoGPT's train.bin / val.bin): the tokens as a raw little-endian array, uint16 as
//   `np.array(ids, dtype=np.uint16).tofile(path)` writes it, or uint32 for vocabularies over
//   65,536 tokens. The file records no width: the caller names it (token_width_for(vocab)).
//   The whole file counts as one document.
//
//   Indexed (Megatron's preprocess_data.py): a prefix P with P.idx and P.bin. P.idx, little-endian:
//     bytes 0-8    magic "MMIDIDX\0\0"
//     bytes 9-16   uint64 version, 1
//     byte  17     uint8 dtype code of P.bin's tokens: 1 uint8, 4 int32, 5 int64, 8 uint16
//     bytes 18-25  uint64 S, the sequence count
//     bytes 26-33  uint64 D, the document boundaries (documents + 1)
//     then         int32 sizes[S] (tokens of each sequence), int64 pointers[S] (each sequence's
//                  byte offset in P.bin), int64 doc_idx[D] (the sequence each document starts at:
//                  0 first, nondecreasing, S last), and nothing after.
//   P.bin holds the sequences back to back, so the pointers are the running sums of the sizes
//   times the token width and P.bin is exactly as long as they add up to. The token stream is
//   the sequences in order.
//
// Every field is checked at open against the files' lengths before it is used (counts never
// trusted, sizes summed without overflow); each problem is a lockstep::DataError naming the file,
// the byte offset where it applies, and what to do. A corpus without tokens is refused too.
//
// Language-model blocks (as TokenBlocks in text.h): block i is tokens [i*T, i*T + T], T + 1
// tokens (T inputs, T next-token targets); blocks do not overlap; the remainder is dropped.
//
// Threading: a TokenFile and its blocks are immutable after open, so any number of loader threads
// may read them at once. Copies share one mapping, unmapped when the last copy goes. The files
// must not be truncated or rewritten while mapped (a read past a shrunk file is SIGBUS).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace lockstep::data {

// How a file stores each token: the flat widths and the Megatron dtypes accepted.
enum class TokenType : std::uint8_t { u8, u16, u32, i32, i64 };
std::size_t token_bytes(TokenType type);
const char* token_type_name(TokenType type);  // numpy's name: "uint16", "int64", ...

// A flat file's element width, which its bytes do not record.
enum class TokenWidth : std::uint8_t { u16, u32 };
// uint16 for vocabularies up to 65,536 tokens, uint32 above; a ConfigError for 0 or above 2^32.
TokenWidth token_width_for(std::uint64_t vocab_size);

// Tokens [first, first + count) of the stream.
struct TokenRange {
  std::size_t first = 0;
  std::size_t count = 0;
};

class TokenFileBlocks;
namespace detail {
struct TokenCorpus;  // the mappings and their checked layout (token_files.cc)
}

class TokenFile {
 public:
  static TokenFile open_flat(const std::string& path, TokenWidth width);
  static TokenFile open_indexed(const std::string& prefix);  // reads prefix + ".idx", ".bin"

  const std::string& path() const;  // the file holding the tokens (the .bin)
  TokenType type() const;
  std::size_t size() const;  // tokens, never 0

  // Token i, or tokens [first, first + count) into out; a range past the end is a ConfigError.
  std::int64_t at(std::size_t i) const;
  void copy(std::size_t first, std::size_t count, std::int64_t* out) const;

  // Documents: the index's (D - 1 of them), or the whole flat file as one.
  std::size_t documents() const;
  TokenRange document(std::size_t d) const;

  // Reads every token once; a DataError naming the first one outside [0, vocab_size), its value
  // and its byte offset in path().
  void check_vocabulary(std::uint64_t vocab_size) const;

  // The language-model blocks of block_size inputs; a DataError when the corpus holds fewer than
  // block_size + 1 tokens, a ConfigError for block_size < 1.
  TokenFileBlocks blocks(int block_size) const;

 private:
  explicit TokenFile(std::shared_ptr<const detail::TokenCorpus> corpus) : corpus_(std::move(corpus)) {}
  std::shared_ptr<const detail::TokenCorpus> corpus_;
};

class TokenFileBlocks {
 public:
  std::size_t size() const { return blocks_; }
  int block_size() const { return block_size_; }
  const TokenFile& file() const { return file_; }

  // Block i's T + 1 tokens into out[0..T].
  void copy(std::size_t i, std::int64_t* out) const;
  // A batch as a trainer consumes it: row r of inputs (B x T) is block indices[r]'s first T
  // tokens, row r of targets (B x T) its last T. A block past the end is a ConfigError.
  void copy_batch(const std::vector<std::size_t>& indices, std::int64_t* inputs, std::int64_t* targets) const;

 private:
  friend class TokenFile;
  TokenFileBlocks(TokenFile file, int block_size, std::size_t blocks)
      : file_(std::move(file)), block_size_(block_size), blocks_(blocks) {}
  TokenFile file_;
  int block_size_;
  std::size_t blocks_;
};

}  // namespace lockstep::data
