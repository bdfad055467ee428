// A SentencePiece tokenizer (a .model file, as spm_train or Python's sentencepiece package writes
// it) read through Debian's libsentencepiece: `gpt prepare-data` encodes text files with it
// (prepare_text.h), `gpt generate --tokenizer` encodes the prompt and decodes what it samples.
//
// Built when pkg-config finds libsentencepiece-dev (src/data/CMakeLists.txt); without it, opening
// a model is a ConfigError that says what to install. Thread-safety: encode and decode are const
// and may run concurrently (the library's processor is immutable once loaded).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "lockstep/data/prepare_text.h"

namespace lockstep::data {

class SentencePiece {
 public:
  // A DataError naming the file when it cannot be read or is not a SentencePiece model.
  explicit SentencePiece(const std::string& model_file);
  ~SentencePiece();
  SentencePiece(const SentencePiece&) = delete;
  SentencePiece& operator=(const SentencePiece&) = delete;

  std::vector<std::int64_t> encode(std::string_view text) const;
  std::string decode(const std::vector<std::int64_t>& ids) const;  // a DataError for an id outside it
  std::uint64_t vocabulary() const;
  std::int64_t end_of_sentence() const;  // -1 when the model has none

  // This tokenizer as prepare_token_file takes it (end_of_sentence ends each document).
  TextEncoder encoder() const;

 private:
  struct Processor;
  std::unique_ptr<Processor> processor_;
  std::string model_file_;
};

// Whether this build reads SentencePiece models (libsentencepiece-dev was found).
bool sentencepiece_built();

}  // namespace lockstep::data
