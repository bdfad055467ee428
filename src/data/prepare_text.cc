// Text files into a flat token file: see prepare_text.h.
#include "lockstep/data/prepare_text.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>

#include "lockstep/data/token_files.h"
#include "lockstep/error.h"

namespace lockstep::data {
namespace {

// The output, written to a temporary file beside it and renamed into place by commit(); removed
// when it goes away uncommitted (an exception on the way).
class TokenWriter {
 public:
  TokenWriter(const std::string& path, int token_bytes)
      : path_(path), temporary_(path + ".tmp-" + std::to_string(::getpid())), token_bytes_(token_bytes) {
    file_ = std::fopen(temporary_.c_str(), "wb");
    if (!file_) throw DataError(path + ": cannot write (" + std::strerror(errno) + "); check the directory");
  }
  ~TokenWriter() {
    if (file_) std::fclose(file_);
    if (!committed_) std::remove(temporary_.c_str());
  }
  TokenWriter(const TokenWriter&) = delete;
  TokenWriter& operator=(const TokenWriter&) = delete;

  void write(std::int64_t token) {
    unsigned char bytes[4];
    for (int b = 0; b < token_bytes_; ++b) bytes[b] = static_cast<unsigned char>(token >> (8 * b));  // little-endian
    if (std::fwrite(bytes, 1, static_cast<std::size_t>(token_bytes_), file_) != static_cast<std::size_t>(token_bytes_))
      throw DataError(path_ + ": write failed (" + std::strerror(errno) + ")");
    ++written_;
  }

  void commit() {
    const bool flushed = std::fflush(file_) == 0 && ::fsync(::fileno(file_)) == 0;
    const bool closed = std::fclose(file_) == 0;
    file_ = nullptr;
    if (!flushed || !closed) throw DataError(path_ + ": write failed (" + std::strerror(errno) + ")");
    if (std::rename(temporary_.c_str(), path_.c_str()) != 0)
      throw DataError(path_ + ": cannot rename the finished file into place (" + std::strerror(errno) + ")");
    committed_ = true;
  }

  std::uint64_t written() const { return written_; }

 private:
  std::string path_, temporary_;
  int token_bytes_;
  std::FILE* file_ = nullptr;
  std::uint64_t written_ = 0;
  bool committed_ = false;
};

// One text file's documents into the writer.
void prepare_file(const TextEncoder& encoder, const std::string& text_file, const std::string& separator,
                  TokenWriter& out, PreparedText& done) {
  std::ifstream in(text_file, std::ios::binary);
  if (!in) throw DataError(text_file + ": cannot read (" + std::strerror(errno) + "); check the path");
  std::uint64_t document_tokens = 0;
  auto end_document = [&] {
    if (document_tokens == 0) return;
    out.write(encoder.end_of_document);
    ++done.documents;
    document_tokens = 0;
  };
  std::string line;
  for (std::uint64_t number = 1; std::getline(in, line); ++number) {
    ++done.lines;
    if (!separator.empty() && line == separator) {
      end_document();
      continue;
    }
    for (std::int64_t token : encoder.encode(line)) {
      if (token < 0 || static_cast<std::uint64_t>(token) >= encoder.vocabulary)
        throw DataError(text_file + ", line " + std::to_string(number) + ": the tokenizer gave token " +
                        std::to_string(token) + ", outside its vocabulary of " + std::to_string(encoder.vocabulary));
      out.write(token);
      ++document_tokens;
    }
  }
  if (in.bad()) throw DataError(text_file + ": read failed (" + std::strerror(errno) + ")");
  end_document();
}

}  // namespace

PreparedText prepare_token_file(const TextEncoder& encoder, const std::vector<std::string>& text_files,
                                const std::string& separator, const std::string& out_path) {
  if (text_files.empty()) throw ConfigError("no text files to prepare: name at least one");
  if (encoder.end_of_document < 0 || static_cast<std::uint64_t>(encoder.end_of_document) >= encoder.vocabulary)
    throw ConfigError("the tokenizer has no end-of-document token in its vocabulary of " +
                      std::to_string(encoder.vocabulary) +
                      " (a SentencePiece model needs one: train it with --eos_id, as spm_train does by default)");
  PreparedText done;
  done.token_bytes = token_width_for(encoder.vocabulary) == TokenWidth::u16 ? 2 : 4;
  TokenWriter out(out_path, done.token_bytes);
  for (const std::string& file : text_files) prepare_file(encoder, file, separator, out, done);
  if (out.written() == 0) throw DataError("the text files hold no tokens: nothing to write to " + out_path);
  out.commit();
  done.tokens = out.written();
  return done;
}

}  // namespace lockstep::data
