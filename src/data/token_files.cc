// Token files, mapped: see token_files.h. The mapping is read-only and shared by every copy of a
// TokenFile; tokens are decoded from little-endian bytes on each read, never loaded as a whole.
#include "lockstep/data/token_files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>

#include "lockstep/error.h"
#include "megatron_index.h"

namespace lockstep::data {
namespace {

// A whole file mapped PROT_READ; the descriptor is closed once mapped (the mapping keeps the file).
class MappedBytes {
 public:
  MappedBytes(const std::string& path, const std::string& what_to_do) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw DataError(path + ": cannot open (" + std::strerror(errno) + "); " + what_to_do);
    struct stat st {};
    const bool regular = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
    size_ = regular ? static_cast<std::size_t>(st.st_size) : 0;
    void* p = regular && size_ > 0 ? ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0) : nullptr;
    const int err = errno;
    ::close(fd);
    if (!regular) throw DataError(path + ": not a regular file; " + what_to_do);
    if (p == MAP_FAILED) throw DataError(path + ": cannot map (" + std::strerror(err) + ")");
    bytes_ = static_cast<const std::uint8_t*>(p);
  }
  ~MappedBytes() {
    if (bytes_) ::munmap(const_cast<std::uint8_t*>(bytes_), size_);
  }
  MappedBytes(const MappedBytes&) = delete;
  MappedBytes& operator=(const MappedBytes&) = delete;
  const std::uint8_t* bytes() const { return bytes_; }
  std::size_t size() const { return size_; }

 private:
  const std::uint8_t* bytes_ = nullptr;
  std::size_t size_ = 0;
};

constexpr const char* kFlatHint =
    "pass a token file such as nanoGPT's prepare.py writes (np.array(ids, dtype=np.uint16).tofile(path))";
constexpr const char* kIndexedHint =
    "an indexed dataset is a prefix P with both P.idx and P.bin, as Megatron's preprocess_data.py writes "
    "them";

// count tokens of `type` from `bytes` into out, sign-extended where the type is signed.
void decode(TokenType type, const std::uint8_t* bytes, std::size_t count, std::int64_t* out) {
  const std::size_t width = token_bytes(type);
  for (std::size_t k = 0; k < count; ++k) {
    const std::uint64_t v = load_le(bytes + k * width, width);
    if (type == TokenType::i32)
      out[k] = static_cast<std::int32_t>(static_cast<std::uint32_t>(v));
    else
      out[k] = static_cast<std::int64_t>(v);
  }
}

}  // namespace

namespace detail {
struct TokenCorpus {
  std::string path;  // the .bin
  TokenType type = TokenType::u16;
  std::size_t tokens = 0;
  MappedBytes bin;
  std::unique_ptr<MappedBytes> idx;  // indexed only
  std::optional<MegatronIndex> index;

  TokenCorpus(const std::string& bin_path, const std::string& what_to_do)
      : path(bin_path), bin(bin_path, what_to_do) {}
};
}  // namespace detail

std::size_t token_bytes(TokenType type) {
  switch (type) {
    case TokenType::u8: return 1;
    case TokenType::u16: return 2;
    case TokenType::u32:
    case TokenType::i32: return 4;
    case TokenType::i64: return 8;
  }
  return 1;
}

const char* token_type_name(TokenType type) {
  switch (type) {
    case TokenType::u8: return "uint8";
    case TokenType::u16: return "uint16";
    case TokenType::u32: return "uint32";
    case TokenType::i32: return "int32";
    case TokenType::i64: return "int64";
  }
  return "unknown";
}

TokenWidth token_width_for(std::uint64_t vocab_size) {
  if (vocab_size == 0 || vocab_size > (std::uint64_t{1} << 32))
    throw ConfigError("a vocabulary of " + std::to_string(vocab_size) +
                      " tokens has no flat token width: uint16 holds up to 65,536 tokens, uint32 up to 2^32");
  return vocab_size <= 65536 ? TokenWidth::u16 : TokenWidth::u32;
}

namespace {

void refuse_empty(const detail::TokenCorpus& c) {
  if (c.tokens == 0)
    throw DataError(c.path +
                    ": holds no tokens; a corpus to train on needs at least one block of them (was the "
                    "tokenizer's output empty?)");
}

}  // namespace

TokenFile TokenFile::open_flat(const std::string& path, TokenWidth width) {
  auto c = std::make_shared<detail::TokenCorpus>(path, kFlatHint);
  c->type = width == TokenWidth::u16 ? TokenType::u16 : TokenType::u32;
  const std::size_t w = token_bytes(c->type);
  if (c->bin.size() % w != 0)
    throw DataError(path + ", byte offset " + std::to_string(c->bin.size() - c->bin.size() % w) +
                    ": the file holds " + std::to_string(c->bin.size()) + " bytes, not a whole number of " +
                    std::to_string(w) + "-byte " + token_type_name(c->type) +
                    " tokens; it is truncated, or its tokens are " + (w == 2 ? "uint32" : "uint16") +
                    " (pass the width it was written with)");
  c->tokens = c->bin.size() / w;
  refuse_empty(*c);
  return TokenFile(std::move(c));
}

TokenFile TokenFile::open_indexed(const std::string& prefix) {
  auto idx =
      std::make_unique<MappedBytes>(prefix + ".idx", kIndexedHint);  // the index first: it names the format
  auto c = std::make_shared<detail::TokenCorpus>(prefix + ".bin", kIndexedHint);
  c->idx = std::move(idx);
  c->index = read_megatron_index(c->idx->bytes(), c->idx->size(), prefix + ".idx", c->path, c->bin.size());
  c->type = c->index->type();
  c->tokens = static_cast<std::size_t>(c->index->tokens());
  refuse_empty(*c);
  return TokenFile(std::move(c));
}

const std::string& TokenFile::path() const {
  return corpus_->path;
}
TokenType TokenFile::type() const {
  return corpus_->type;
}
std::size_t TokenFile::size() const {
  return corpus_->tokens;
}

void TokenFile::copy(std::size_t first, std::size_t count, std::int64_t* out) const {
  if (first > size() || count > size() - first)
    throw ConfigError("tokens [" + std::to_string(first) + ", " + std::to_string(first) + " + " +
                      std::to_string(count) + ") are past the end of " + path() + " (" +
                      std::to_string(size()) + " tokens)");
  decode(type(), corpus_->bin.bytes() + first * token_bytes(type()), count, out);
}

std::int64_t TokenFile::at(std::size_t i) const {
  std::int64_t token = 0;
  copy(i, 1, &token);
  return token;
}

std::size_t TokenFile::documents() const {
  return corpus_->index ? static_cast<std::size_t>(corpus_->index->documents()) : 1;
}

TokenRange TokenFile::document(std::size_t d) const {
  if (d >= documents())
    throw ConfigError("document " + std::to_string(d) + " is past the end of " + path() + " (" +
                      std::to_string(documents()) + " documents)");
  if (!corpus_->index) return TokenRange{0, size()};
  const auto first = static_cast<std::size_t>(corpus_->index->document_start(d));
  return TokenRange{first, static_cast<std::size_t>(corpus_->index->document_start(d + 1)) - first};
}

void TokenFile::check_vocabulary(std::uint64_t vocab_size) const {
  constexpr std::size_t kChunk = 1 << 16;
  std::vector<std::int64_t> tokens(std::min(kChunk, size()));
  for (std::size_t first = 0; first < size(); first += kChunk) {
    const std::size_t count = std::min(kChunk, size() - first);
    copy(first, count, tokens.data());
    for (std::size_t k = 0; k < count; ++k) {
      if (tokens[k] >= 0 && static_cast<std::uint64_t>(tokens[k]) < vocab_size) continue;
      throw DataError(path() + ", byte offset " + std::to_string((first + k) * token_bytes(type())) +
                      ": token " + std::to_string(first + k) + " is " + std::to_string(tokens[k]) +
                      ", outside the vocabulary of " + std::to_string(vocab_size) +
                      " tokens; pass the vocabulary size of the tokenizer that wrote "
                      "the file, or tokenize the corpus again with this model's tokenizer");
    }
  }
}

TokenFileBlocks TokenFile::blocks(int block_size) const {
  if (block_size < 1)
    throw ConfigError("a block must hold at least 1 token (got " + std::to_string(block_size) + ")");
  const auto t = static_cast<std::size_t>(block_size);
  if (size() <= t)
    throw DataError(path() + ": holds " + std::to_string(size()) + " tokens, too few for one block of " +
                    std::to_string(t) + " inputs and their targets (" + std::to_string(t + 1) +
                    " tokens); use a shorter block or a larger corpus");
  return TokenFileBlocks(*this, block_size, (size() - 1) / t);
}

void TokenFileBlocks::copy(std::size_t i, std::int64_t* out) const {
  if (i >= blocks_)
    throw ConfigError("block " + std::to_string(i) + " is past the end of " + file_.path() + "'s " +
                      std::to_string(blocks_) + " blocks of " + std::to_string(block_size_) + " tokens");
  const auto t = static_cast<std::size_t>(block_size_);
  file_.copy(i * t, t + 1, out);
}

void TokenFileBlocks::copy_batch(const std::vector<std::size_t>& indices, std::int64_t* inputs,
                                 std::int64_t* targets) const {
  const auto t = static_cast<std::size_t>(block_size_);
  std::vector<std::int64_t> block(t + 1);
  for (std::size_t row = 0; row < indices.size(); ++row) {
    copy(indices[row], block.data());
    std::copy(block.begin(), block.end() - 1, inputs + row * t);
    std::copy(block.begin() + 1, block.end(), targets + row * t);
  }
}

}  // namespace lockstep::data
